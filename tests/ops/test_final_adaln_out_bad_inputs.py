"""Edge inputs `final_adaln_out` refuses: every bad input (`BAD_INPUTS`) raises its error class with the
argument's name in the message, on the CPU with backend="torch" and on the GPU (`gpu` mark) with
backend="cupy" (the validation is the one `adaln_lab.core.checks.validate` of every backend).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from adaln_lab import final_adaln_out

from .test_final_adaln_out_edge_inputs import CPU_SHAPE, GPU_SHAPE, inputs


def _dims(args):
    return dict(S=args[5].shape[0], H=args[1].shape[0], D=args[2].shape[1], T=args[2].shape[0])


def _set(position, value):
    """Replace argument `position` by value(old, other_device, dims) (or by value itself)."""
    def mutate(args, other):
        args[position] = value(args[position], other, _dims(args)) if callable(value) else value
        return args, {}
    return mutate


def _kw(**kw):
    def mutate(args, other):
        return args, kw
    return mutate


def _shape(position, shape):
    """Replace argument `position` by zeros of shape(dims) in its dtype and device."""
    return _set(position, lambda t, o, d: torch.zeros(shape(d), dtype=t.dtype, device=t.device))


def _bad_index(value):
    def mutate(args, other):
        idx = args[5].clone()
        idx[2] = value(_dims(args))
        args[5] = idx
        return args, {}
    return mutate


# (id, mutate(args, other_device) -> (args, kwargs), error class, regex the message must match; the
# regex is formatted with the call's S, H, D, T, H1 = H - 1, H2 = 2H, D1 = D + 1, S1 = S - 1: see check_bad)
BAD_INPUTS = [
    # not a tensor / not dense
    ("x-list", _set(0, lambda t, o, d: t.tolist()), TypeError, "x must be a torch.Tensor, got list"),
    ("x-numpy", _set(0, lambda t, o, d: t.float().cpu().numpy()), TypeError, "x must be a torch.Tensor, got ndarray"),
    ("norm_weight-none", _set(1, None), TypeError, "norm_weight must be a torch.Tensor, got NoneType"),
    ("temb-float", _set(2, 1.0), TypeError, "temb must be a torch.Tensor, got float"),
    ("weight-numpy", _set(3, lambda t, o, d: np.zeros((2 * d["H"], d["D"]))), TypeError,
     "weight must be a torch.Tensor, got ndarray"),
    ("bias-tuple", _set(4, lambda t, o, d: (0.0,) * (2 * d["H"])), TypeError, "bias must be a torch.Tensor, got tuple"),
    ("timestep_indices-list", _set(5, lambda t, o, d: t.tolist()), TypeError,
     "timestep_indices must be a torch.Tensor, got list"),
    ("x-sparse", _set(0, lambda t, o, d: t.to_sparse()), TypeError, "x must be a dense .*torch.sparse_coo"),
    ("norm_weight-sparse", _set(1, lambda t, o, d: t.to_sparse()), TypeError, "norm_weight must be a dense"),
    ("timestep_indices-sparse", _set(5, lambda t, o, d: t.to_sparse()), TypeError, "timestep_indices must be a dense"),
    # wrong dtypes
    ("x-int32", _set(0, lambda t, o, d: t.to(torch.int32)), TypeError, "x must be floating point.*got torch.int32"),
    ("x-bool", _set(0, lambda t, o, d: t > 0), TypeError, "x must be floating point.*got torch.bool"),
    ("x-complex64", _set(0, lambda t, o, d: t.to(torch.complex64)), TypeError, "x must be floating point.*complex64"),
    ("x-float8", _set(0, lambda t, o, d: t.to(torch.float8_e4m3fn)), TypeError, "x must be floating point.*float8"),
    ("norm_weight-int64", _set(1, lambda t, o, d: t.to(torch.int64)), TypeError,
     "norm_weight must be floating point.*int64"),
    ("weight-int8", _set(3, lambda t, o, d: t.to(torch.int8)), TypeError, "weight must be floating point.*int8"),
    ("bias-bool", _set(4, lambda t, o, d: t > 0), TypeError, "bias must be floating point.*bool"),
    ("temb-int32", _set(2, lambda t, o, d: t.to(torch.int32)), TypeError, "temb must be float32.*temb is torch.int32"),
    ("timestep_indices-int32", _set(5, lambda t, o, d: t.to(torch.int32)), TypeError,
     "timestep_indices must be int64, got torch.int32"),
    ("timestep_indices-float", _set(5, lambda t, o, d: t.float()), TypeError,
     "timestep_indices must be int64, got torch.float32"),
    # mixed float dtypes: norm_out's three parameters share one dtype; temb float32, float64 or theirs
    ("weight-fp16-vs-bf16", _set(3, lambda t, o, d: t.half()), TypeError,
     "weight is torch.float16 but norm_weight is torch.bfloat16"),
    ("norm_weight-fp32-vs-bf16", _set(1, lambda t, o, d: t.float()), TypeError,
     "weight is torch.bfloat16 but norm_weight is torch.float32"),
    ("bias-fp32-vs-bf16", _set(4, lambda t, o, d: t.float()), TypeError,
     "bias is torch.float32 but weight is torch.bfloat16"),
    ("temb-fp16-vs-bf16", _set(2, lambda t, o, d: t.half()), TypeError,
     "temb is torch.float16 but weight is torch.bfloat16"),
    # eps
    ("eps-zero", _kw(eps=0.0), ValueError, "eps must be a positive finite number, got 0.0"),
    ("eps-negative", _kw(eps=-1e-5), ValueError, "eps must be a positive finite number, got -1e-05"),
    ("eps-nan", _kw(eps=float("nan")), ValueError, "eps must be a positive finite number, got nan"),
    ("eps-inf", _kw(eps=float("inf")), ValueError, "eps must be a positive finite number, got inf"),
    ("eps-minus-inf", _kw(eps=float("-inf")), ValueError, "eps must be a positive finite number, got -inf"),
    ("eps-bool", _kw(eps=True), TypeError, "eps must be a real number.*bool"),
    ("eps-str", _kw(eps="1e-5"), TypeError, "eps must be a real number.*str"),
    ("eps-none", _kw(eps=None), TypeError, "eps must be a real number.*NoneType"),
    ("eps-tensor", _kw(eps=torch.tensor(1e-5)), TypeError, "eps must be a real number.*Tensor"),
    ("eps-complex", _kw(eps=1e-5 + 0j), TypeError, "eps must be a real number.*complex"),
    # devices (other_device: meta on the CPU, cpu on the GPU)
    ("norm_weight-device", _set(1, lambda t, o, d: t.to(o)), ValueError, "norm_weight is on .* but x is on"),
    ("temb-device", _set(2, lambda t, o, d: t.to(o)), ValueError, "temb is on .* but x is on"),
    ("weight-device", _set(3, lambda t, o, d: t.to(o)), ValueError, "^weight is on .* but x is on"),
    ("bias-device", _set(4, lambda t, o, d: t.to(o)), ValueError, "bias is on .* but x is on"),
    ("timestep_indices-device", _set(5, lambda t, o, d: t.to(o)), ValueError,
     "timestep_indices is on .* but x is on"),
    ("x-device", _set(0, lambda t, o, d: t.to(o)), ValueError, "norm_weight is on .* but x is on"),
    # shapes
    ("x-1d", _shape(0, lambda d: (d["H"],)), ValueError, r"x must have shape \(\.\.\., S, H\), got \({H},\)"),
    ("x-0d", _shape(0, lambda d: ()), ValueError, r"x must have shape \(\.\.\., S, H\), got \(\)"),
    ("x-empty-H", _shape(0, lambda d: (d["S"], 0)), ValueError, "x must have a non-empty last dimension"),
    # x's last dimension is H: a mismatch with norm_weight names both and says which one is taken as H
    ("x-H-short", _shape(0, lambda d: (d["S"], d["H"] - 1)), ValueError,
     r"^norm_weight has shape \({H},\) but x's last dimension is {H1} \(x has shape \({S}, {H1}\)\): H is taken "
     r"from x, and norm_weight must have shape \(H,\) = \({H1},\)$"),
    ("norm_weight-short", _shape(1, lambda d: (d["H"] - 1,)), ValueError,
     r"^norm_weight has shape \({H1},\) but x's last dimension is {H} \(x has shape \({S}, {H}\)\): H is taken "
     r"from x, and norm_weight must have shape \(H,\) = \({H},\)$"),
    ("norm_weight-2d", _shape(1, lambda d: (1, d["H"])), ValueError,
     r"norm_weight has shape \(1, {H}\) but x's last dimension is {H}"),
    ("temb-1d", _shape(2, lambda d: (d["D"],)), ValueError, r"temb must have shape \(T, D\) with T, D >= 1"),
    ("temb-3d", _shape(2, lambda d: (d["T"], d["D"], 1)), ValueError, r"temb must have shape \(T, D\)"),
    ("temb-T0", _shape(2, lambda d: (0, d["D"])), ValueError, r"temb must have shape \(T, D\) with T, D >= 1"),
    ("temb-D0", _shape(2, lambda d: (d["T"], 0)), ValueError, r"temb must have shape \(T, D\) with T, D >= 1"),
    ("weight-transposed", _shape(3, lambda d: (d["D"], 2 * d["H"])), ValueError,
     r"weight must have shape \(2H, D\) = \({H2}, {D}\), H = {H} being x's last dimension and D = {D} temb's "
     r"\(temb has shape \({T}, {D}\)\), got \({D}, {H2}\)"),
    ("weight-H-rows", _shape(3, lambda d: (d["H"], d["D"])), ValueError, r"weight must have shape \(2H, D\)"),
    # temb and weight share D: a mismatch names both, whichever of the two is off
    ("weight-D-mismatch", _shape(3, lambda d: (2 * d["H"], d["D"] + 1)), ValueError,
     r"temb has D = {D} \(shape \({T}, {D}\)\) but weight has D = {D1} \(shape \({H2}, {D1}\)\)"),
    ("temb-D-mismatch", _shape(2, lambda d: (d["T"], d["D"] + 1)), ValueError,
     r"temb has D = {D1} \(shape \({T}, {D1}\)\) but weight has D = {D} \(shape \({H2}, {D}\)\): temb \(T, D\) "
     r"and weight \(2H, D\) must share D"),
    ("bias-H", _shape(4, lambda d: (d["H"],)), ValueError,
     r"bias must have shape \(2H,\) = \({H2},\), H = {H} being x's last dimension \(x has shape \({S}, {H}\)\), "
     r"got \({H},\)"),
    ("bias-2d", _shape(4, lambda d: (2 * d["H"], 1)), ValueError, r"bias must have shape \(2H,\)"),
    ("timestep_indices-short", _shape(5, lambda d: (d["S"] - 1,)), ValueError,
     r"timestep_indices must have shape \(S,\) = \({S},\), S = {S} being x's second-to-last dimension \(x has shape "
     r"\({S}, {H}\)\), got \({S1},\)"),
    ("timestep_indices-2d", _shape(5, lambda d: (1, d["S"])), ValueError, r"timestep_indices must have shape \(S,\)"),
    ("timestep_indices-column", _shape(5, lambda d: (d["S"], 1)), ValueError,
     r"timestep_indices must have shape \(S,\)"),
    ("timestep_indices-0d", _shape(5, lambda d: ()), ValueError, r"timestep_indices must have shape \(S,\)"),
    # index values
    ("timestep_indices-negative", _bad_index(lambda d: -1), IndexError,
     r"timestep_indices holds -1, outside \[0, T\) = \[0, {T}\)"),
    ("timestep_indices-T", _bad_index(lambda d: d["T"]), IndexError,
     r"timestep_indices holds {T}, outside \[0, T\) = \[0, {T}\)"),
    # options
    ("backend", _kw(backend="jax"), ValueError, "backend must be one of"),
    ("numerics", _kw(numerics="fp64"), ValueError, "numerics must be one of"),
    ("table_backend", _kw(table_backend="cublas"), ValueError, "table_backend must be one of"),
]


def check_bad(mutate, error, match, backend, device, other_device, shape, **options):
    args = inputs(6, (), device, **shape)
    d = _dims(args)
    match = match.format(**d, H1=d["H"] - 1, H2=2 * d["H"], D1=d["D"] + 1, S1=d["S"] - 1)
    args, kw = mutate(args, other_device)
    with pytest.raises(error, match=match):
        final_adaln_out(*args, **{"backend": backend, **options, **kw})


BAD_PARAMS = [pytest.param(m, e, r, id=i) for i, m, e, r in BAD_INPUTS]


@pytest.mark.parametrize("mutate,error,match", BAD_PARAMS)
def test_bad_input(mutate, error, match):
    check_bad(mutate, error, match, "torch", "cpu", "meta", CPU_SHAPE)


@pytest.mark.gpu
@pytest.mark.parametrize("mutate,error,match", BAD_PARAMS)
def test_gpu_bad_input(mutate, error, match):
    # on CUDA the index range check is opt-in (it costs a host synchronisation)
    check_bad(mutate, error, match, "cupy", "cuda", "cpu", GPU_SHAPE, check_indices=True)
