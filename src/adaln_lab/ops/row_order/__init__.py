"""The rows of a batch in table-row order (`row_order`), which the blocks' backward row passes walk; README.md
gives the layout of the order and its limits."""

from .op import launch_in, order_torch, row_order

__all__ = ["launch_in", "order_torch", "row_order"]
