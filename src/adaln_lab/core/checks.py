"""The ops' argument checks, each written once: `validate` (final_adaln_out), `check_rows` (the block ops'
x / row_index / table chunks), `check_order` (a given row order), `check_table_inputs` (modulation_table),
`check_option` (backend names).

`validate` is the one input check shared by every backend of `final_adaln_out`.

Every failure names the argument: TypeError for a wrong type or dtype (and for an eps that is not a
real number), ValueError for a wrong shape, device or eps value, IndexError for a timestep index
outside [0, T) (in eager calls; under torch.compile see `validate`).

dtype rule (what diffusers' `MiniMaxH3AdaLayerNormOut` meets inside `MiniMaxH3Transformer3DModel`,
read off a small model run through each way of setting its dtype; `tests/ops/test_checks.py` pins it):

- norm_weight, weight and bias are the parameters of one module (`norm_out.norm.weight`,
  `norm_out.linear.weight`, `.bias`) and always share one dtype P: `from_pretrained(torch_dtype=...)`,
  `model.to(dtype)` / `.half()` and layerwise casting (which skips `norm_out` as a whole, by its
  "norm" pattern) each set the dtype of the whole module. A mix is refused (TypeError naming both
  arguments and both dtypes): it would change the table's and the output's dtype behind the
  caller's back.
- x is the residual stream: P after `from_pretrained(torch_dtype=P)` or `.to(P)`, but with
  `enable_layerwise_casting(compute_dtype=C)` it is C while `norm_out` keeps its loaded dtype
  (e.g. bf16 x with float32 parameters after a default float32 load; fp16 x with bf16 parameters
  after a bf16 load and fp16 compute). diffusers runs every such pair, so any floating x is
  accepted, and the output has diffusers' dtype: `torch.promote_types(x.dtype, P)`, which is x's
  dtype whenever x and the parameters agree (every configuration without layerwise casting).
- temb comes from `time_embedder`, kept float32 by `_keep_in_fp32_modules` (and by layerwise
  casting's skip list), or P after a wholesale `model.to(P)`. Accepted: float32, float64 (the
  float64 goldens' inputs), or P. Anything else (say fp16 temb with bf16 parameters, which the model
  never produces) is refused, naming temb and weight with both dtypes.

Non-contiguous and oddly strided tensors are accepted: the backends make them contiguous.
"""

from __future__ import annotations

import math
import numbers

import torch

from .library import eager

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_FLOAT_DTYPES = frozenset(FLOAT_DTYPES)
_TEMB_DTYPES = frozenset((torch.float32, torch.float64))
_NAMES = ("x", "norm_weight", "temb", "weight", "bias", "timestep_indices")
_Tensor = torch.Tensor
_STRIDED = torch.strided
_INT64 = torch.int64
_INF = math.inf


def _tensor(name: str, value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.layout is not _STRIDED:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {value.layout}")
    return value


def _float_dtype_error(name: str, dtype: torch.dtype) -> TypeError:
    return TypeError(f"{name} must be floating point (bfloat16, float16, float32 or float64), got {dtype}")


def _check_eps(eps) -> float:
    if type(eps) is not float:
        if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
            raise TypeError(f"eps must be a real number (float), got {type(eps).__name__} {eps!r}")
        eps = float(eps)
    if not 0.0 < eps < _INF:  # NaN fails this too
        raise ValueError(f"eps must be a positive finite number, got {eps!r}")
    return eps


def validate(x, norm_weight, temb, weight, bias, timestep_indices, eps, *, check_indices: bool = True):
    """Check the arguments of `final_adaln_out`; return (S, H, T, D).

    Shapes: x (..., S, H) with H >= 1 (S = 0 and empty leading dims are fine); norm_weight (H,);
    temb (T, D) with T, D >= 1; weight (2H, D); bias (2H,); timestep_indices (S,) int64 with values
    in [0, T). All dense tensors on one device (any strides). dtypes: see the module docstring
    (norm_weight, weight, bias share one floating dtype; x any floating dtype; temb float32,
    float64 or the parameters' dtype). eps: a positive finite real number.

    `check_indices=False` skips the value range check of `timestep_indices` (on CUDA that check
    costs one host synchronisation). Under torch.compile no value is read on the host (no `.item()`, so
    fullgraph traces): on CPU tensors the check becomes an assert inside the graph (RuntimeError instead
    of IndexError), on CUDA it is skipped. Shapes, dtypes and devices are always checked.
    """
    # types and layouts: one fast test for the common case, the named error from the slow path
    if not (isinstance(x, _Tensor) and isinstance(norm_weight, _Tensor) and isinstance(temb, _Tensor)
            and isinstance(weight, _Tensor) and isinstance(bias, _Tensor) and isinstance(timestep_indices, _Tensor)
            and x.layout is _STRIDED and norm_weight.layout is _STRIDED and temb.layout is _STRIDED
            and weight.layout is _STRIDED and bias.layout is _STRIDED and timestep_indices.layout is _STRIDED):
        for name, value in zip(_NAMES, (x, norm_weight, temb, weight, bias, timestep_indices)):
            _tensor(name, value)

    # dtypes
    param_dtype = norm_weight.dtype
    if x.dtype not in _FLOAT_DTYPES:
        raise _float_dtype_error("x", x.dtype)
    if param_dtype not in _FLOAT_DTYPES:
        raise _float_dtype_error("norm_weight", param_dtype)
    if weight.dtype is not param_dtype:
        if weight.dtype not in _FLOAT_DTYPES:
            raise _float_dtype_error("weight", weight.dtype)
        raise TypeError(f"weight is {weight.dtype} but norm_weight is {param_dtype}: norm_weight, weight and bias "
                        "(norm_out's parameters) must share one dtype")
    if bias.dtype is not param_dtype:
        if bias.dtype not in _FLOAT_DTYPES:
            raise _float_dtype_error("bias", bias.dtype)
        raise TypeError(f"bias is {bias.dtype} but weight is {param_dtype}: norm_weight, weight and bias "
                        "(norm_out's parameters) must share one dtype")
    temb_dtype = temb.dtype
    if temb_dtype is not param_dtype and temb_dtype not in _TEMB_DTYPES:
        raise TypeError(f"temb must be float32, float64 or weight's dtype; temb is {temb_dtype} but weight is "
                        f"{param_dtype}")
    if timestep_indices.dtype is not _INT64:
        raise TypeError(f"timestep_indices must be int64, got {timestep_indices.dtype}")
    _check_eps(eps)

    # devices
    device = x.device
    if not (norm_weight.device == device and temb.device == device and weight.device == device
            and bias.device == device and timestep_indices.device == device):
        for name, value in zip(_NAMES[1:], (norm_weight, temb, weight, bias, timestep_indices)):
            if value.device != device:
                raise ValueError(f"{name} is on {value.device} but x is on {device}: all inputs must share one device")

    # shapes
    x_shape = x.shape
    if len(x_shape) < 2:
        raise ValueError(f"x must have shape (..., S, H), got {tuple(x_shape)}")
    S, H = x_shape[-2], x_shape[-1]
    if H == 0:
        raise ValueError(f"x must have a non-empty last dimension H, got shape {tuple(x_shape)}")
    if norm_weight.shape != (H,):
        raise ValueError(f"norm_weight has shape {tuple(norm_weight.shape)} but x's last dimension is {H} (x has shape "
                         f"{tuple(x_shape)}): H is taken from x, and norm_weight must have shape (H,) = ({H},)")
    temb_shape = temb.shape
    if len(temb_shape) != 2 or temb_shape[0] == 0 or temb_shape[1] == 0:
        raise ValueError(f"temb must have shape (T, D) with T, D >= 1, got {tuple(temb_shape)}")
    T, D = temb_shape
    weight_shape = weight.shape
    if weight_shape != (2 * H, D):
        if len(weight_shape) == 2 and weight_shape[0] == 2 * H:  # the rows fit x: the two D disagree
            raise ValueError(f"temb has D = {D} (shape {tuple(temb_shape)}) but weight has D = {weight_shape[1]} "
                             f"(shape {tuple(weight_shape)}): temb (T, D) and weight (2H, D) must share D")
        raise ValueError(f"weight must have shape (2H, D) = ({2 * H}, {D}), H = {H} being x's last dimension and "
                         f"D = {D} temb's (temb has shape {tuple(temb_shape)}), got {tuple(weight_shape)}")
    if bias.shape != (2 * H,):
        raise ValueError(f"bias must have shape (2H,) = ({2 * H},), H = {H} being x's last dimension (x has shape "
                         f"{tuple(x_shape)}), got {tuple(bias.shape)}")
    if timestep_indices.shape != (S,):
        raise ValueError(f"timestep_indices must have shape (S,) = ({S},), S = {S} being x's second-to-last "
                         f"dimension (x has shape {tuple(x_shape)}), got {tuple(timestep_indices.shape)}")

    # values
    if check_indices and S > 0 and not timestep_indices.is_meta:
        if not eager():  # no host value under tracing: an assert in the graph (CPU only)
            if timestep_indices.device.type == "cpu":
                torch._assert_async(((timestep_indices >= 0) & (timestep_indices < T)).all(),
                                    "timestep_indices holds a value outside [0, T), T = temb.shape[0]")
            return S, H, T, D
        if timestep_indices.is_cuda:  # one device-to-host copy, one synchronisation
            lo, hi = torch.stack(timestep_indices.aminmax()).tolist()
        else:
            lo, hi = timestep_indices.aminmax()
            lo, hi = lo.item(), hi.item()
        if lo < 0 or hi >= T:
            bad = lo if lo < 0 else hi
            raise IndexError(f"timestep_indices holds {bad}, outside [0, T) = [0, {T})")
    return S, H, T, D


BACKENDS = ("auto", "torch", "cupy", "numba")
BLOCK_BACKENDS = ("auto", "torch", "cupy")
NUMERICS = ("diffusers",)
TABLE_BACKENDS = ("cuda", "torch")


def check_option(name: str, value, choices: tuple) -> None:
    """Raise ValueError naming the option unless value is one of choices."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def check_devices(op: str, first: str, device: torch.device, named) -> None:
    """Raise ValueError naming the argument unless every tensor of `named` ((name, tensor or None) pairs) is on
    `device`, the device of argument `first`."""
    for name, t in named:
        if t is not None and t.device != device:
            raise ValueError(f"{op}: {name} is on {t.device} but {first} is on {device}: all inputs must share one "
                             "device")


def check_rows(op: str, x: torch.Tensor, row_index: torch.Tensor, *, y: torch.Tensor | None = None,
               norms: dict | None = None, **tables: torch.Tensor) -> None:
    """Raise ValueError / TypeError naming the argument unless x (..., S, H), row_index (S,) int64, each
    table argument (R, H) (one R for all) and, where given, y (x's shape, floating point) and each norm weight of
    `norms` ({name: (H,) floating point}: an op's norm_weight, a block's two) fit, all on x's device."""
    if x.dim() < 2:
        raise ValueError(f"{op} needs x of shape (..., S, H), got {tuple(x.shape)}")
    S, H = x.shape[-2], x.shape[-1]
    if row_index.shape != (S,):
        raise ValueError(f"{op} needs row_index of shape (S,) = ({S},), S = {S} being x's second-to-last dimension "
                         f"(x has shape {tuple(x.shape)}), got {tuple(row_index.shape)}")
    if row_index.dtype != torch.int64:
        raise TypeError(f"{op} needs row_index of dtype int64, got {row_index.dtype}")
    for name, t in tables.items():
        if t.dim() != 2 or t.shape[1] != H:
            raise ValueError(f"{op} needs {name} of shape (R, H), H = {H} being x's last dimension (x has shape "
                             f"{tuple(x.shape)}), got {name} {tuple(t.shape)}")
    if len({t.shape[0] for t in tables.values()}) > 1:
        raise ValueError(f"{op} needs {', '.join(tables)} of one shape (R, H), got "
                         + ", ".join(f"{name} {tuple(t.shape)}" for name, t in tables.items()))
    if y is not None and y.shape != x.shape:
        raise ValueError(f"{op} needs y of x's shape {tuple(x.shape)}, got {tuple(y.shape)}")
    norms = norms or {}
    for name, norm_weight in norms.items():
        if norm_weight.shape != (H,):
            raise ValueError(f"{op} needs {name} of shape (H,) = ({H},), H = {H} being x's last dimension (x has "
                             f"shape {tuple(x.shape)}), got {tuple(norm_weight.shape)}")
    named = (("x", x), *tables.items(), ("y", y), *norms.items())
    for name, t in named:
        if t is not None and not t.dtype.is_floating_point:
            raise TypeError(f"{op} needs a floating-point {name}, got {t.dtype}")
    check_devices(op, "x", x.device, (*named, ("row_index", row_index)))


def check_order(op: str, order: torch.Tensor | None, row_index: torch.Tensor, table_rows: int) -> None:
    """Raise ValueError unless order is None or has row_order's shape and dtype for this row_index."""
    if order is not None and (order.shape != (table_rows + 1 + row_index.shape[0],) or order.dtype != torch.int32
                              or order.device != row_index.device):
        raise ValueError(f"{op} needs row_order = adaln_lab.row_order(row_index, {table_rows}, H): "
                         f"({table_rows + 1 + row_index.shape[0]},) int32 on {row_index.device}, got "
                         f"{tuple(order.shape)} {order.dtype} on {order.device}")


def check_table_inputs(temb: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> None:
    """Raise ValueError / TypeError naming the argument unless temb (T, D), weight (N, D), bias (N,) fit."""
    if temb.dim() != 2 or weight.dim() != 2 or bias.dim() != 1:
        raise ValueError(f"modulation_table needs temb (T, D), weight (N, D) and bias (N,), got shapes "
                         f"{tuple(temb.shape)}, {tuple(weight.shape)}, {tuple(bias.shape)}")
    if temb.shape[1] != weight.shape[1]:
        raise ValueError(f"modulation_table: temb has D = {temb.shape[1]} (shape {tuple(temb.shape)}) but weight has "
                         f"D = {weight.shape[1]} (shape {tuple(weight.shape)}): temb (T, D) and weight (N, D) disagree")
    if bias.shape[0] != weight.shape[0]:
        raise ValueError(f"modulation_table: bias has N = {bias.shape[0]} (shape {tuple(bias.shape)}) but weight has "
                         f"N = {weight.shape[0]} rows (shape {tuple(weight.shape)}): bias (N,) and weight (N, D) "
                         "disagree")
    named = (("temb", temb), ("weight", weight), ("bias", bias))
    for name, t in named:
        if not t.dtype.is_floating_point:
            raise TypeError(f"modulation_table needs a floating-point {name}, got {t.dtype}")
    check_devices("modulation_table", "temb", temb.device, named)
