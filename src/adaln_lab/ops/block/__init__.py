"""One H3 block's AdaLN composed from the ops (`block_adaln_path`); README.md gives the data flow."""

from .op import block_adaln_path

__all__ = ["block_adaln_path"]
