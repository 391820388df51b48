"""`AdaLNTransformerBlock`: a drop-in for diffusers' `MiniMaxH3TransformerBlock` whose AdaLN runs on adaln_lab's ops.

The block shares the original's `norm1`, `attn`, `norm2`, `ff` and `adaln_proj` submodules (same
tensors, state-dict keys and order, devices, dtypes) and has its forward signature
`forward(hidden_states, temb, adaln_indices, rotary_emb, attention_mask=None)`. Its AdaLN path is
`block_adaln_path`: `modulation_table` (the (T, 18H) float32 table), `modulated_rms_norm_and_residual`
for norm1 (x's two gradients summed inside the norm's backward), `gated_residual_norm` for the first
residual with norm2 (one op: one pass less, and the same gradient sum) and `gated_residual` for the second
residual; attention and feed-forward are the shared modules, called as
diffusers calls them. Importing this module never imports diffusers.

Numerics: the forward replays diffusers (CPU: bit for bit; CUDA kernels: see the ops). Gradients reach
the table in float32 (diffusers: bf16 sums). On the CUDA kernels the parameter gradients are reduced in
a fixed order (repeatable bit for bit) and dx of a row depends on that row alone; the torch code that
runs where the kernels cannot (fp32 blocks on CUDA, T > 10) sums with index_add_, whose CUDA atomics
give no such promise. Backends: "auto" (the ops: CUDA
kernels where they run, torch code elsewhere), "cupy" (the ops, but refuse inputs the kernels cannot
take, with the reason) and "torch" (diffusers' own ops and autograd, `block_reference.replay_block_adaln`).

Class-name lists: diffusers' `_no_split_modules` / `_repeated_blocks` (device maps,
`compile_repeated_blocks`) name `MiniMaxH3TransformerBlock`; a patched block is an `AdaLNTransformerBlock`,
so patch after `compile_repeated_blocks` / dispatching, or compile the blocks yourself.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .block_reference import MODALITIES, replay_block_adaln, table_chunks
from .gated_residual import gated_residual
from .gated_residual_norm import gated_residual_norm
from .modulated_rms_norm import modulated_rms_norm_and_residual
from .modulation_table import TABLE_BACKENDS, modulation_table
from .row_order import row_order

BLOCK_BACKENDS = ("auto", "torch", "cupy")


def unsupported_block(x, temb, weight, bias, norm1_weight, norm2_weight) -> Exception | None:
    """Why the CUDA kernels cannot run a block's AdaLN ops on these inputs (None if they can)."""
    from . import block_cuda
    from .modulation_table import unsupported

    error = unsupported(temb, weight, bias)
    if error is None:
        error = block_cuda.unsupported_rows(x, MODALITIES * temb.shape[0], norm1_weight=norm1_weight,
                                            norm2_weight=norm2_weight)
    return error


def block_adaln_path(x: torch.Tensor, temb: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                     norm1_weight: torch.Tensor, norm2_weight: torch.Tensor, row_index: torch.Tensor, attn, ff,
                     eps1: float = 1e-5, eps2: float = 1e-5, *, backend: str = "auto",
                     table_backend: str = "cuda") -> torch.Tensor:
    """One H3 block with `attn` and `ff` as given (module docstring of `adaln_lab.block_reference`):

        table = modulation_table(temb, weight, bias)          (T, 18H) -> six (3T, H) chunks
        h, x = modulated_rms_norm_and_residual(x, norm1_weight, shift_msa, scale_msa, row_index, eps1)
        x, h = gated_residual_norm(x, gate_msa, attn(h), norm2_weight, shift_mlp, scale_mlp, row_index, eps2)
        x = gated_residual(x, gate_mlp, ff(h), row_index)
    (diffusers' first residual and norm2 in one op, `adaln_lab.gated_residual_norm`; norm1 hands x on so
    that x's two gradients are summed inside its backward)

    Args:
        x: (..., S, H) hidden states; temb (T, D); weight (18H, D), bias (18H,): `adaln_proj.linear`;
        norm1_weight, norm2_weight: (H,); row_index: (S,) int64 in [0, 3T) (diffusers' `adaln_indices`),
        row s of every leading index of x uses table row row_index[s].
        attn, ff: maps of (..., S, H) tensors (row-wise ones keep the path batch-invariant).
        backend: "auto", "cupy" or "torch" (module docstring); table_backend: "cuda" or "torch".

    Returns:
        (..., S, H), diffusers' block output for these attn and ff.
    """
    _check_options(backend, table_backend)
    H = x.shape[-1]
    if weight.dim() != 2 or weight.shape[0] != 6 * MODALITIES * H:
        raise ValueError(f"block_adaln_path needs weight of shape (18H, D) = ({18 * H}, D), got {tuple(weight.shape)}")
    if backend == "torch":
        return replay_block_adaln(x, temb, weight, bias, norm1_weight, norm2_weight, row_index, attn, ff, eps1, eps2)
    if backend == "cupy":
        error = unsupported_block(x, temb, weight, bias, norm1_weight, norm2_weight)
        if error is not None:
            raise error
    table_dtype = weight.dtype
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = table_chunks(
        modulation_table(temb, weight, bias, table_backend=table_backend), H)
    # the CUDA backward passes walk the rows in table-row order: sorted once here for the block's three ops
    # (whenever grad mode is on: attn's or ff's parameters alone may want a backward through them); where the
    # ops then run torch code instead (say an fp32 norm weight), they ignore it
    kernels = x.is_cuda and x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16
    sortable = row_index.shape == (x.shape[-2],) and row_index.dtype == torch.int64  # else the ops raise
    order = row_order(row_index, shift_msa.shape[0], H) if kernels and torch.is_grad_enabled() and sortable else None
    h, x = modulated_rms_norm_and_residual(x, norm1_weight, shift_msa, scale_msa, row_index, eps1,
                                           table_dtype=table_dtype, row_order=order)
    x, h = gated_residual_norm(x, gate_msa, attn(h), norm2_weight, shift_mlp, scale_mlp, row_index, eps2,
                               table_dtype=table_dtype, row_order=order)
    return gated_residual(x, gate_mlp, ff(h), row_index, table_dtype=table_dtype, row_order=order)


def _check_options(backend: str, table_backend: str) -> None:
    if backend not in BLOCK_BACKENDS:
        raise ValueError(f"backend must be one of {BLOCK_BACKENDS}, got {backend!r}")
    if table_backend not in TABLE_BACKENDS:
        raise ValueError(f"table_backend must be one of {TABLE_BACKENDS}, got {table_backend!r}")


def _eps(norm: nn.RMSNorm, x: torch.Tensor) -> float:
    """norm's epsilon; None means what F.rms_norm does: the epsilon of its compute dtype (as `AdaLNOut`)."""
    return norm.eps if norm.eps is not None else torch.finfo(torch.promote_types(x.dtype, torch.float32)).eps


_SKIPPED = ("norm1", "norm2", "adaln_proj", "adaln_proj.linear")  # submodules whose forward the block does not call


def _check_submodules(block: nn.Module) -> None:
    name = type(block).__name__
    for norm_name in ("norm1", "norm2"):
        norm = getattr(block, norm_name, None)
        if type(norm) is not nn.RMSNorm or norm.weight is None or norm.weight.dim() != 1:
            raise TypeError(f"{name}.{norm_name} must be an nn.RMSNorm with a weight, got {type(norm).__name__}")
    H = block.norm1.weight.shape[0]
    linear = getattr(getattr(block, "adaln_proj", None), "linear", None)
    if type(linear) is not nn.Linear or linear.bias is None:
        raise TypeError(f"{name}.adaln_proj.linear must be a plain nn.Linear with a bias (the block reads its weight "
                        f"and bias directly, so a wrapper such as a PEFT/LoRA layer would be skipped), got "
                        f"{type(linear).__name__}")
    if block.norm2.weight.shape != (H,) or linear.out_features != 6 * MODALITIES * H:
        raise TypeError(f"{name}: norm2 has {tuple(block.norm2.weight.shape)} channels and adaln_proj.linear "
                        f"{linear.out_features} outputs; expected ({H},) and 18 * H = {18 * H}")
    for sub_name in ("attn", "ff"):
        if not isinstance(getattr(block, sub_name, None), nn.Module):
            raise TypeError(f"{name}.{sub_name} must be a module")
    for sub_name in _SKIPPED:
        sub = block.get_submodule(sub_name)
        for attr in ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks"):
            if getattr(sub, attr, None):
                raise ValueError(f"{name}.{sub_name} has {attr[1:]} registered; the AdaLN block reads its "
                                 "parameters without calling its forward, so they would never run")


class AdaLNTransformerBlock(nn.Module):
    """Drop-in for diffusers' `MiniMaxH3TransformerBlock` whose AdaLN runs on `block_adaln_path`.

    Args (as diffusers'): hidden_size H, num_attention_heads, attention_head_dim, ffn_dim, time_embed_dim D,
    norm_eps, qk_norm_eps; plus backend ("auto", "cupy", "torch") and table_backend ("cuda", "torch").
    The constructor builds a diffusers block (imports diffusers) and takes its submodules.

    forward(hidden_states (B, S, H), temb (T, D), adaln_indices (S,) int64 in [0, 3T), rotary_emb
    (cos, sin), attention_mask=None) -> (B, S, H) in hidden_states' dtype.
    """

    def __init__(self, hidden_size: int, num_attention_heads: int, attention_head_dim: int, ffn_dim: int,
                 time_embed_dim: int, norm_eps: float, qk_norm_eps: float, *, backend: str = "auto",
                 table_backend: str = "cuda"):
        from .patch import _diffusers_block_class

        _check_options(backend, table_backend)
        block = _diffusers_block_class()(hidden_size, num_attention_heads, attention_head_dim, ffn_dim,
                                         time_embed_dim, norm_eps, qk_norm_eps)
        super().__init__()
        self._take(block, backend, table_backend)

    def _take(self, block: nn.Module, backend: str, table_backend: str) -> None:
        # diffusers' registration order, so state_dict keys come in the same order
        self.norm1, self.attn, self.norm2 = block.norm1, block.attn, block.norm2
        self.ff, self.adaln_proj = block.ff, block.adaln_proj
        self.backend, self.table_backend = backend, table_backend
        self.train(block.training)

    @classmethod
    def from_diffusers(cls, block: nn.Module, *, backend: str = "auto",
                       table_backend: str = "cuda") -> "AdaLNTransformerBlock":
        """An `AdaLNTransformerBlock` sharing `block`'s submodules (nothing copied or allocated). `block` is a
        `MiniMaxH3TransformerBlock` (or anything with its layout). Raises TypeError when norm1 / norm2 are not
        plain `nn.RMSNorm`s with weights or `adaln_proj.linear` is not a plain `nn.Linear` (18H outputs, a
        bias), and ValueError when one of those carries hooks: the block reads them without calling them."""
        _check_options(backend, table_backend)
        _check_submodules(block)
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._take(block, backend, table_backend)
        return self

    def to_diffusers(self) -> nn.Module:
        """A diffusers `MiniMaxH3TransformerBlock` sharing this block's submodules (imports diffusers)."""
        from .patch import _diffusers_block_class

        cls = _diffusers_block_class()
        block = cls.__new__(cls)
        nn.Module.__init__(block)
        block.norm1, block.attn, block.norm2 = self.norm1, self.attn, self.norm2
        block.ff, block.adaln_proj = self.ff, self.adaln_proj
        block.train(self.training)
        return block

    def forward(self, hidden_states: torch.Tensor, temb: torch.Tensor, adaln_indices: torch.Tensor,
                rotary_emb: tuple[torch.Tensor, torch.Tensor], attention_mask: torch.Tensor | None = None):
        linear = self.adaln_proj.linear

        def attn(h):
            return self.attn(h, rotary_emb, attention_mask)

        return block_adaln_path(hidden_states, temb, linear.weight, linear.bias, self.norm1.weight, self.norm2.weight,
                                adaln_indices, attn, self.ff, _eps(self.norm1, hidden_states),
                                _eps(self.norm2, hidden_states), backend=self.backend,
                                table_backend=self.table_backend)

    def extra_repr(self) -> str:
        return f"backend={self.backend!r}, table_backend={self.table_backend!r}"


# ---- the seed's invariance protocol on one block's AdaLN path ----

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
