"""`AdaLNOut`: a drop-in `nn.Module` for diffusers' `MiniMaxH3AdaLayerNormOut` backed by `final_adaln_out`.

Same submodules (`norm`: `nn.RMSNorm`, `linear`: `nn.Linear`), hence the same state-dict keys
(`norm.weight`, `linear.weight`, `linear.bias`), the same constructor arguments and the same forward
signature `forward(hidden_states, temb, timestep_indices)`. Importing this module never imports diffusers.

temb's dtype. diffusers computes `linear(silu(temb).to(linear's dtype))`: SiLU at temb's own precision,
then one cast. In the MiniMax-H3 checkpoint `time_embedder` is float32, so temb is float32 and the op
takes it as is. When temb is not float32/float64 (e.g. a model cast wholesale to bf16):

- backend "torch" (or "auto" on CPU tensors): the diffusers replay runs on temb as given, so the module
  is the diffusers module op for op (`adaln_lab.reference.replay`; the op's own float32 check of temb
  is the only thing skipped).
- backend "cupy" (or "auto" on CUDA tensors) with temb in weight's dtype: temb is widened to float32
  (exact) for the kernels. This changes no rounding point: torch computes a bf16/fp16 SiLU in float32
  and rounds once to temb's dtype, the following `.to(weight.dtype)` is then a no-op, and the kernels
  also compute SiLU in float32 and round once to weight's dtype (on the CPU, torch's bf16 and fp16 SiLU
  equal the float32 SiLU rounded once for every finite input, `tests/nn/test_adaln_out.py`). Only temb's
  gradient differs in where it is rounded: the kernels' fp32 d_temb is rounded once to temb's dtype.
- backend "cupy" with temb in a third dtype (say fp16 temb, bf16 weight): diffusers rounds twice (SiLU
  to temb's dtype, then to weight's), which the kernels do not model, so the module falls back to the
  diffusers replay and warns (`AdaLNOutFallbackWarning`).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn

from ..core import support
from ..core.autocast import autocast_params
from ..core.exact import recorder, refuse_unrecorded
from ..core.checks import BACKENDS, TABLE_BACKENDS, check_option
from ..ops.final_adaln_out import final_adaln_out
from ..ops.final_adaln_out.exact import record as exact_record
from ..ops.modulated_rms_norm import modulated_rms_norm
from ..ops.modulation_table import modulation_table
from ..reference.final_adaln_out import replay
from . import adapters
from ..core.warnings import AdaLNOutFallbackWarning
from .fallback import foreign, warn_once
from .upstream import diffusers_class

_EXACT_TEMB_DTYPES = (torch.float32, torch.float64)


_READS = {"norm": nn.RMSNorm, "linear": None}  # the submodules whose parameters forward reads (linear: `adapters`)


def check_options(backend: str, table_backend: str) -> None:
    """Raise ValueError naming the option unless backend and table_backend are norm_out's."""
    check_option("backend", backend, BACKENDS)
    check_option("table_backend", table_backend, TABLE_BACKENDS)


class AdaLNOut(nn.Module):
    """Drop-in for diffusers' `MiniMaxH3AdaLayerNormOut`, computed by `adaln_lab.final_adaln_out`.

    Args:
        hidden_size: H, channels of the packed sequence.
        time_embed_dim: D, channels of temb.
        eps: RMSNorm epsilon (diffusers passes the model's `final_norm_eps`).
        backend: "auto" (CUDA kernels for CUDA tensors, the diffusers replay otherwise), "torch" or
            "cupy"; see `final_adaln_out`.
        table_backend: "cuda" (fixed-order table on tensor cores, T-invariant table rows) or "torch" (`F.linear`).

    forward(hidden_states (..., S, H), temb (T, D), timestep_indices (S,) int64) -> (..., S, H) in
    hidden_states' dtype. See the module docstring for a temb that is not float32.
    """

    def __init__(self, hidden_size: int, time_embed_dim: int, eps: float, *, backend: str = "auto",
                 table_backend: str = "cuda"):
        super().__init__()
        check_options(backend, table_backend)
        self.norm = nn.RMSNorm(hidden_size, eps=eps)
        self.linear = nn.Linear(time_embed_dim, 2 * hidden_size, bias=True)
        self.backend = backend
        self.table_backend = table_backend

    @classmethod
    def from_diffusers(cls, module: nn.Module, *, backend: str = "auto", table_backend: str = "cuda") -> "AdaLNOut":
        """An `AdaLNOut` that shares `module`'s `norm` and `linear` submodules (so its parameters: same
        tensors, device, dtype and eps; nothing is copied or allocated). `module` is a
        `MiniMaxH3AdaLayerNormOut` (or anything with the same `norm` / `linear` layout).
        Raises TypeError unless `norm` is an `nn.RMSNorm` with a weight and `linear` a module (`submodules`);
        a PEFT LoRA layer as `linear` runs on the ops (`adapters`); hooks on them or another wrapper make a call
        run diffusers' forward (`fallback`)."""
        check_options(backend, table_backend)
        norm, linear = submodules(module)
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.norm = norm
        self.linear = linear
        self.backend = backend
        self.table_backend = table_backend
        self.train(module.training)
        return self

    def to_diffusers(self) -> nn.Module:
        """A diffusers `MiniMaxH3AdaLayerNormOut` sharing this module's `norm` and `linear` (imports diffusers)."""
        cls = diffusers_class("MiniMaxH3AdaLayerNormOut")
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.norm = self.norm
        module.linear = self.linear
        module.train(self.training)
        return module

    def _resolved_backend(self, hidden_states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> str:
        """The backend this call runs: "auto" asks the op's own rule (the kernels where they run), with
        temb as it will reach them (float32)."""
        if self.backend != "auto":
            return self.backend
        if not hidden_states.is_cuda:
            return "torch"
        temb_f32 = hidden_states.new_empty((1, weight.shape[1]), dtype=torch.float32, device="meta")
        norm_weight, weight, bias = autocast_params(hidden_states, self.norm.weight, weight, bias)
        error = support.final_adaln_out(hidden_states, norm_weight, temb_f32, weight, bias)
        if error is not None:
            support.warn_fallback(type(self).__name__, hidden_states, error)
        return "torch" if error is not None else "cupy"

    def forward(self, hidden_states: torch.Tensor, temb: torch.Tensor, timestep_indices: torch.Tensor) -> torch.Tensor:
        found = foreign(self, _READS)
        if found is None:
            found = adapters.layout(self.linear)
            found = f"linear {found}" if isinstance(found, str) else found
        if isinstance(found, str):  # hooks or a wrapper on a submodule: diffusers' forward, so that they act
            refuse_unrecorded("AdaLNOut", found)
            warn_once(self, found)
            return self._diffusers_forward(hidden_states, temb, timestep_indices)
        base, names = found
        weight, bias, norm_weight = base.weight, base.bias, self.norm.weight
        eps = self.norm.eps
        if eps is None:  # what F.rms_norm does with eps=None: the epsilon of its compute dtype
            eps = torch.finfo(torch.promote_types(hidden_states.dtype, torch.float32)).eps
        exact = recorder()
        if names:
            if exact is not None:
                return self._exact_adapted_forward(hidden_states, temb, timestep_indices, base, names, eps, exact)
            return self._adapted_forward(hidden_states, temb, timestep_indices, base, names, eps)
        if temb.dtype not in _EXACT_TEMB_DTYPES:
            if self._resolved_backend(hidden_states, weight, bias) == "torch":
                refuse_unrecorded("AdaLNOut", f"temb is {temb.dtype} on the torch route")
                # diffusers' ops on temb as given (SiLU at temb's precision), bitwise the diffusers module
                return replay(hidden_states, norm_weight, temb, weight, bias, timestep_indices, eps)
            if temb.dtype != autocast_params(hidden_states, weight)[0].dtype:  # (bf16 under autocast)
                refuse_unrecorded("AdaLNOut", f"temb is {temb.dtype} and the projection {weight.dtype}")
                warnings.warn(
                    f"AdaLNOut: temb is {temb.dtype} but the projection is {weight.dtype}; diffusers rounds "
                    f"SiLU(temb) to {temb.dtype} and then to {weight.dtype}, which the CUDA kernels do not "
                    "model, so this call runs the diffusers replay (backend='torch'). Pass temb in float32 "
                    f"or in {weight.dtype} to use the kernels.",
                    AdaLNOutFallbackWarning, stacklevel=2)
                return replay(hidden_states, norm_weight, temb, weight, bias, timestep_indices, eps)
            # SiLU in float32 rounded once to weight's dtype == diffusers' SiLU at temb's (= weight's) dtype. Inside
            # ExactGradients the caller's temb is kept and the op gets a widened copy without a graph, so write sends
            # the caller's temb its gradient (float64, with the blocks' that share it), rounded once to its dtype
            if exact is not None and torch.is_grad_enabled():
                exact.keep_temb((norm_weight, weight, bias), temb)
                temb = temb.detach()
            temb = temb.float()
        if exact is not None:  # inside ExactGradients: where these parameters live (FSDP2 reshards them)
            exact.own(self, ("linear.weight", "linear.bias", "norm.weight"))
        return final_adaln_out(hidden_states, norm_weight, temb, weight, bias, timestep_indices, eps=eps,
                               backend=self.backend, table_backend=self.table_backend)

    def _diffusers_forward(self, hidden_states, temb, timestep_indices):
        return diffusers_class("MiniMaxH3AdaLayerNormOut").forward(self, hidden_states, temb, timestep_indices)

    def _adapted_forward(self, hidden_states, temb, timestep_indices, base, names, eps):
        """LoRA adapters on `linear` (`adapters`): the table by `modulation_table` plus the adapters' terms, then
        `modulated_rms_norm` with shift | scale read from it (norm_out's formula; the block ops' rounding of the
        table: float32 holding the projection dtype's values). Where the backend resolves to "torch" (backend
        "torch", or "auto" where the kernels do not run): diffusers' (and PEFT's) own forward, as without adapters."""
        if self._resolved_backend(hidden_states, base.weight, base.bias) == "torch":
            return self._diffusers_forward(hidden_states, temb, timestep_indices)
        norm_weight, weight, bias = autocast_params(hidden_states, self.norm.weight, base.weight, base.bias)
        backend = "cupy" if self.backend == "cupy" else "auto"
        table = modulation_table(temb, weight, bias, table_backend=self.table_backend, backend=backend)
        shift, scale = adapters.adapted_table(table, temb, self.linear, names, weight.dtype).chunk(2, dim=-1)
        return modulated_rms_norm(hidden_states, norm_weight, shift, scale, timestep_indices, eps,
                                  table_dtype=weight.dtype, backend=backend)

    def _exact_adapted_forward(self, hidden_states, temb, timestep_indices, base, names, eps, exact):
        """Inside `ExactGradients` with LoRA adapters on `linear`: norm_out's exact node on the torch route (a warning
        on CUDA with backend "auto"; "cupy" raises) with the adapters' terms on each table row
        (`adapters.adapted_table`); the recorder forms the adapters' gradients (`adapters.exact_terms`)."""
        if temb.dtype not in _EXACT_TEMB_DTYPES:
            refuse_unrecorded("AdaLNOut", f"temb is {temb.dtype}")
        if hidden_states.is_cuda:
            error = NotImplementedError("LoRA adapters' exact gradients are recorded on the torch route only")
            if self.backend == "cupy":
                raise error
            support.warn_fallback(type(self).__name__, hidden_states, error)
        exact.own(self, ("linear.base_layer.weight", "linear.base_layer.bias", "norm.weight"))
        terms = adapters.note_exact(exact, self, "linear", names, (base.weight, base.bias, self.norm.weight),
                                    "AdaLNOut")
        linear, dtype = self.linear, base.weight.dtype

        def adapt(table, temb_rows):
            return adapters.adapted_table(table.float(), temb_rows, linear, names, dtype).to(table.dtype)

        return exact_record(hidden_states, self.norm.weight, temb, base.weight, base.bias, timestep_indices, eps,
                            exact, adapt=adapt, watched=[t for A, B, _ in terms for t in (A, B) if t.requires_grad])

    def extra_repr(self) -> str:
        return f"backend={self.backend!r}, table_backend={self.table_backend!r}"


def submodules(module: nn.Module) -> tuple[nn.Module, nn.Module]:
    """module's `norm` (an nn.RMSNorm with a weight) and `linear` (a plain nn.Linear with a bias and 2H outputs, or
    any other module: a PEFT LoRA layer runs on the ops (`adapters`), anything else makes every call run
    diffusers' forward, see `fallback`)."""
    name = type(module).__name__
    norm, linear = getattr(module, "norm", None), getattr(module, "linear", None)
    if type(norm) is not nn.RMSNorm or norm.weight is None:
        raise TypeError(f"{name}.norm must be an nn.RMSNorm with a weight, got {type(norm).__name__}")
    if not isinstance(linear, nn.Module):
        raise TypeError(f"{name}.linear must be a module, got {type(linear).__name__}")
    if type(linear) is nn.Linear and (linear.bias is None or linear.out_features != 2 * norm.weight.shape[0]):
        raise TypeError(f"{name}.linear must have a bias and 2 * hidden_size = {2 * norm.weight.shape[0]} outputs, "
                        f"got bias={linear.bias is not None}, {linear.out_features} outputs")
    return norm, linear
