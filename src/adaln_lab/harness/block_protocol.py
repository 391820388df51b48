"""The seed's invariance protocol on one H3 block's AdaLN path: row-wise stand-ins for attention and the
feed-forward, and `protocol_candidate`, a block candidate taking the protocol's norm_out inputs."""

from __future__ import annotations

import torch

from ..ops.block import block_adaln_path
from ..reference.block import MODALITIES


def rowwise_attn(h: torch.Tensor) -> torch.Tensor:
    """A fixed row-wise stand-in for attention: a channel permutation and exactly rounded products, so
    every row's bits depend on that row alone on any device."""
    return h.flip(-1) * h * 0.5


def rowwise_ff(h: torch.Tensor) -> torch.Tensor:
    """A fixed row-wise stand-in for the feed-forward (as `rowwise_attn`)."""
    return h.roll(1, dims=-1) - 0.25 * h


def protocol_candidate(attn=rowwise_attn, ff=rowwise_ff, *, backend: str = "auto", table_backend: str = "cuda"):
    """fn(x (n, H), norm_weight (H,), temb (T, D), weight (2H, D), bias (2H,), timestep_indices (n,)) -> (n, H):
    one block's AdaLN path on the seed protocol's inputs (`adaln_lab.harness`, `adaln_lab.testing`), for
    `assert_batch_invariant`. The block's parameters are built differentiably from the protocol's: weight and
    bias rolled by 0..8 rows for the nine (modality, chunk pair) slices of (18H, D), norm2's weight = norm1's
    reversed; each row's modality tag (0, 1, 2) is read from the signs of its first two channels, so it
    travels with the row; row_index = timestep_indices * 3 + tag."""

    def fn(x, norm_weight, temb, weight, bias, timestep_indices):
        block_weight = torch.cat([weight.roll(k, dims=0) for k in range(9)])
        block_bias = torch.cat([bias.roll(k, dims=0) for k in range(9)])
        first = x.detach()[:, :2] > 0
        row_index = timestep_indices * MODALITIES + first[:, 0].long() + first[:, 1].long()
        return block_adaln_path(x, temb, block_weight, block_bias, norm_weight, norm_weight.flip(0), row_index,
                                attn, ff, backend=backend, table_backend=table_backend)

    return fn
