"""`AdaLNTransformerBlock`: a drop-in for diffusers' `MiniMaxH3TransformerBlock` whose AdaLN runs on adaln_lab's ops.

The block shares the original's `norm1`, `attn`, `norm2`, `ff` and `adaln_proj` submodules (same
tensors, state-dict keys and order, devices, dtypes) and has its forward signature
`forward(hidden_states, temb, adaln_indices, rotary_emb, attention_mask=None)`. Its AdaLN path is
`adaln_lab.ops.block.block_adaln_path`: `modulation_table` (the (T, 18H) float32 table), `modulated_rms_norm_and_residual`
for norm1 (x's two gradients summed inside the norm's backward), `gated_residual_norm` for the first
residual with norm2 (one op: one pass less, and the same gradient sum) and `gated_residual` for the second
residual; attention and feed-forward are the shared modules, called as
diffusers calls them. Importing this module never imports diffusers (`upstream` does, on demand).

Numerics: the forward replays diffusers (CPU: bit for bit; CUDA kernels: see the ops). Gradients reach
the table in float32 (diffusers: bf16 sums). On the CUDA kernels the parameter gradients are reduced in
a fixed order (repeatable bit for bit) and dx of a row depends on that row alone; the torch code that
runs where the kernels cannot (fp32 blocks on CUDA, T > 10) sums with index_add_, whose CUDA atomics
give no such promise. Backends: "auto" (the ops: CUDA
kernels where they run, torch code elsewhere), "cupy" (the ops, but refuse inputs the kernels cannot
take, with the reason) and "torch" (diffusers' own ops and autograd, `reference.block.replay_block_adaln`).

Class-name lists: diffusers' `_no_split_modules` / `_repeated_blocks` (device maps,
`compile_repeated_blocks`) name `MiniMaxH3TransformerBlock`; a patched block is an `AdaLNTransformerBlock`,
so patch after `compile_repeated_blocks` / dispatching, or compile the blocks yourself.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..core.autocast import autocast_params
from ..core.exact import recorder, refuse_unrecorded
from ..ops.block import block_adaln_path
from ..core.checks import BLOCK_BACKENDS, TABLE_BACKENDS, check_option
from ..reference.block import MODALITIES
from . import adapters
from .fallback import foreign, warn_once
from .upstream import diffusers_class


def check_options(backend: str, table_backend: str) -> None:
    """Raise ValueError naming the option unless backend and table_backend are a block's."""
    check_option("backend", backend, BLOCK_BACKENDS)
    check_option("table_backend", table_backend, TABLE_BACKENDS)


def _eps(norm: nn.RMSNorm, x: torch.Tensor) -> float:
    """norm's epsilon; None means what F.rms_norm does: the epsilon of its compute dtype (as `AdaLNOut`)."""
    return norm.eps if norm.eps is not None else torch.finfo(torch.promote_types(x.dtype, torch.float32)).eps


_READS = {"norm1": nn.RMSNorm, "norm2": nn.RMSNorm, "adaln_proj": None, "adaln_proj.linear": None}
# the submodules whose parameters the block reads instead of calling them (None: any class; the projection may be
# a PEFT LoRA layer, `adapters`)


def check_submodules(block: nn.Module) -> None:
    """Raise TypeError unless block has diffusers' layout: norm1, norm2 nn.RMSNorms with (H,) weights, attn and ff
    modules, adaln_proj.linear a plain nn.Linear with a bias and 18H outputs, or any other module (a PEFT LoRA
    layer runs on the ops, `adapters`; anything else makes every call run diffusers' forward, see `fallback`)."""
    name = type(block).__name__
    for norm_name in ("norm1", "norm2"):
        norm = getattr(block, norm_name, None)
        if type(norm) is not nn.RMSNorm or norm.weight is None or norm.weight.dim() != 1:
            raise TypeError(f"{name}.{norm_name} must be an nn.RMSNorm with a weight, got {type(norm).__name__}")
    H = block.norm1.weight.shape[0]
    linear = getattr(getattr(block, "adaln_proj", None), "linear", None)
    if not isinstance(linear, nn.Module):
        raise TypeError(f"{name}.adaln_proj.linear must be a module, got {type(linear).__name__}")
    plain = type(linear) is nn.Linear
    if block.norm2.weight.shape != (H,) or (plain and (linear.bias is None or linear.out_features != 6 * MODALITIES * H)):
        raise TypeError(f"{name}: norm2 has {tuple(block.norm2.weight.shape)} channels and adaln_proj.linear "
                        f"{getattr(linear, 'out_features', '?')} outputs (bias {getattr(linear, 'bias', None) is not None}); "
                        f"expected ({H},) and 18 * H = {18 * H} with a bias")
    for sub_name in ("attn", "ff"):
        if not isinstance(getattr(block, sub_name, None), nn.Module):
            raise TypeError(f"{name}.{sub_name} must be a module")


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
        check_options(backend, table_backend)
        block = diffusers_class("MiniMaxH3TransformerBlock")(hidden_size, num_attention_heads, attention_head_dim,
                                                             ffn_dim, time_embed_dim, norm_eps, qk_norm_eps)
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
        `MiniMaxH3TransformerBlock` (or anything with its layout; `check_submodules` says what, TypeError
        otherwise). A PEFT LoRA layer as adaln_proj.linear runs on the ops (`adapters`); hooks or another wrapper on
        the submodules it reads make a call run diffusers' forward (`fallback`)."""
        check_options(backend, table_backend)
        check_submodules(block)
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._take(block, backend, table_backend)
        return self

    def to_diffusers(self) -> nn.Module:
        """A diffusers `MiniMaxH3TransformerBlock` sharing this block's submodules (imports diffusers)."""
        cls = diffusers_class("MiniMaxH3TransformerBlock")
        block = cls.__new__(cls)
        nn.Module.__init__(block)
        block.norm1, block.attn, block.norm2 = self.norm1, self.attn, self.norm2
        block.ff, block.adaln_proj = self.ff, self.adaln_proj
        block.train(self.training)
        return block

    def forward(self, hidden_states: torch.Tensor, temb: torch.Tensor, adaln_indices: torch.Tensor,
                rotary_emb: tuple[torch.Tensor, torch.Tensor], attention_mask: torch.Tensor | None = None):
        found = foreign(self, _READS)
        if found is None:
            found = adapters.layout(self.adaln_proj.linear)
            found = f"adaln_proj.linear {found}" if isinstance(found, str) else found
        exact = recorder()
        if isinstance(found, str) or (self.backend == "torch" and found[1] and exact is None):
            refuse_unrecorded("AdaLNTransformerBlock", found if isinstance(found, str) else "adapters, backend 'torch'")
            if isinstance(found, str):  # hooks or a wrapper on a submodule it reads: diffusers' forward, so they act
                warn_once(self, found)
            return diffusers_class("MiniMaxH3TransformerBlock").forward(self, hidden_states, temb, adaln_indices,
                                                                        rotary_emb, attention_mask)
        base, names = found
        linear = self.adaln_proj.linear

        def attn(h):
            return self.attn(h, rotary_emb, attention_mask)

        def adapt_table(table):  # the base projection's dtype as the ops run it (bf16 under autocast)
            return adapters.adapted_table(table, temb, linear, names,
                                          autocast_params(hidden_states, base.weight)[0].dtype)

        if exact is not None:  # inside ExactGradients: where these parameters live (FSDP2 reshards them), adapters
            proj = "adaln_proj.linear.base_layer" if names else "adaln_proj.linear"
            exact.own(self, (f"{proj}.weight", f"{proj}.bias", "norm1.weight", "norm2.weight"))
            if names:
                adapters.note_exact(exact, self, "adaln_proj.linear", names,
                                    (base.weight, base.bias, self.norm1.weight, self.norm2.weight),
                                    "AdaLNTransformerBlock")
        return block_adaln_path(hidden_states, temb, base.weight, base.bias, self.norm1.weight, self.norm2.weight,
                                adaln_indices, attn, self.ff, _eps(self.norm1, hidden_states),
                                _eps(self.norm2, hidden_states), backend=self.backend,
                                table_backend=self.table_backend, adapt_table=adapt_table if names else None)

    def extra_repr(self) -> str:
        return f"backend={self.backend!r}, table_backend={self.table_backend!r}"
