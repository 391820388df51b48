"""Edge inputs of `final_adaln_out` that it takes, one test per case (the refused ones:
test_final_adaln_out_bad_inputs.py).

CPU, backend="torch" (the diffusers replay): S = 0, T = 1, leading dims, non-contiguous views of
every argument, requires_grad on each of the 32 subsets of the five leaves.

GPU (marked `gpu`, skipped without CUDA): the same cases with backend="cupy" on CUDA bf16 tensors
(H = 264, D = 64), compared with backend="torch" on the same tensors: outputs with a bitwise-equal
fraction >= 0.999 and max|diff| <= 0.02 max|ref|, every gradient within 0.02 max|ref| (x) / the
documented looser parameter bounds, and exactly zero gradients for S = 0; plus the CUDA path's
H limits, from `adaln_lab.core.plan.check_shapes`.
"""

from __future__ import annotations

import itertools
import math
import subprocess
import sys

import pytest
import torch

from adaln_lab import final_adaln_out
from adaln_lab.harness.inputs import make

from ..paths import ROOT

LEAVES = ("x", "norm_weight", "temb", "weight", "bias")
NAMES = (*LEAVES, "timestep_indices")
CPU_SHAPE = dict(H=16, D=8, T=3)
GPU_SHAPE = dict(H=264, D=64, T=3)


def inputs(S=6, lead=(), device="cpu", H=16, D=8, T=3, seed=1):
    """Six arguments (bf16 x / norm_weight / weight / bias, fp32 temb, int64 indices) on `device`."""
    n = S * math.prod(lead)
    made = make(seed, max(n, S, 1), device, H=H, D=D, T=T)
    x = made.x[:n].reshape(*lead, S, H)
    return [x, made.norm_weight, made.temb, made.weight, made.bias, made.timestep_indices[:S].contiguous()]


def run(args, requires=LEAVES, dy_seed=0, **kw):
    """Forward + backward on fresh leaf copies; (out, {leaf: grad or None})."""
    leaves = [a.detach().clone().requires_grad_(name in requires) for name, a in zip(LEAVES, args[:5])]
    out = final_adaln_out(*leaves, args[5], **kw)
    if out.requires_grad:
        g = torch.Generator(device=out.device).manual_seed(dy_seed)
        out.backward(torch.randn(out.shape, generator=g, device=out.device).to(out.dtype))
    return out.detach(), {name: leaf.grad for name, leaf in zip(LEAVES, leaves)}


def assert_same(a: torch.Tensor, b: torch.Tensor, what: str):
    assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, b.shape, a.dtype, b.dtype)
    assert torch.equal(a, b), f"{what}: {int((a != b).sum())} of {a.numel()} differ"


# ---------------------------------------------------------------------------------------------- accepted

def check_empty(backend, device, shape):
    for lead in ((), (2,)):
        args = inputs(0, lead, device, **shape)
        out, grads = run(args, backend=backend)
        assert out.shape == (*lead, 0, shape["H"]) and out.dtype == torch.bfloat16
        for name, arg in zip(LEAVES, args):
            grad = grads[name]
            assert grad is not None, f"d_{name} is None"
            assert grad.shape == arg.shape and grad.dtype == arg.dtype, (name, grad.shape, grad.dtype)
            assert not bool(grad.any()), f"d_{name} is not exactly zero for S = 0"


def test_s_zero():
    """S = 0: empty output (..., 0, H); backward works and every parameter gradient is exactly zero
    (torch gives zero tensors, not None: index_select / rms_norm / linear backward of no rows)."""
    check_empty("torch", "cpu", CPU_SHAPE)


def check_t_one(backend, device, shape):
    args = inputs(24, (), device, **{**shape, "T": 1})
    assert bool((args[5] == 0).all())
    out, grads = run(args, backend=backend)
    assert bool(torch.isfinite(out).all()) and all(bool(torch.isfinite(g).all()) for g in grads.values())
    return args, out, grads


def test_t_one():
    """T = 1 (one timestep, every index 0): equals diffusers' module bit for bit, output and gradients."""
    args, out, grads = check_t_one("torch", "cpu", CPU_SHAPE)
    diffusers = pytest.importorskip("diffusers.models.transformers.transformer_minimax_h3")
    module = diffusers.MiniMaxH3AdaLayerNormOut(16, 8, eps=1e-5).to(torch.bfloat16)
    with torch.no_grad():
        module.norm.weight.copy_(args[1])
        module.linear.weight.copy_(args[3])
        module.linear.bias.copy_(args[4])
    x = args[0].detach().clone().requires_grad_(True)
    temb = args[2].detach().clone().requires_grad_(True)
    ref = module(x, temb, args[5])
    ref.backward(torch.randn(ref.shape, generator=torch.Generator().manual_seed(0)).to(ref.dtype))
    assert_same(out, ref.detach(), "out")
    for name, ref_grad in (("x", x.grad), ("norm_weight", module.norm.weight.grad), ("temb", temb.grad),
                           ("weight", module.linear.weight.grad), ("bias", module.linear.bias.grad)):
        assert_same(grads[name], ref_grad, f"d_{name}")


def test_leading_dims():
    """x (2, 3, S, H): every (i, j) slice is the 2-D call on that slice, bitwise (output and d_x); the
    parameter gradients are the sums over the slices (up to float summation order)."""
    args = inputs(5, (2, 3), "cpu", **CPU_SHAPE)
    out, grads = run(args, dy_seed=3)
    assert out.shape == (2, 3, 5, 16)
    g = torch.Generator().manual_seed(3)
    dy = torch.randn(out.shape, generator=g).to(out.dtype)
    param_sums = {name: torch.zeros(grads[name].shape, dtype=torch.float64) for name in LEAVES[1:]}
    for i, j in itertools.product(range(2), range(3)):
        leaves = [args[0][i, j].clone().requires_grad_(True)] + [a.clone().requires_grad_(True) for a in args[1:5]]
        part = final_adaln_out(*leaves, args[5], backend="torch")
        part.backward(dy[i, j])
        assert_same(out[i, j], part.detach(), f"out[{i}, {j}]")
        assert_same(grads["x"][i, j], leaves[0].grad, f"d_x[{i}, {j}]")
        for name, leaf in zip(LEAVES[1:], leaves[1:]):
            param_sums[name] += leaf.grad.double()
    for name, total in param_sums.items():
        err = float((grads[name].double() - total).abs().max() / total.abs().max())
        assert err <= 2 ** -6, (name, err)  # each side rounds its bf16 / fp32 sum once more


def _view(t: torch.Tensor, kind: str) -> torch.Tensor:
    """A tensor equal to t but laid out oddly."""
    if kind == "every_other_element":  # last-dim stride 2
        wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
        wide[..., 1::2] = t
        return wide[..., 1::2]
    if kind == "storage_offset":  # contiguous strides, data starting 3 elements into its storage
        padded = torch.zeros(t.numel() + 3, dtype=t.dtype, device=t.device)
        padded[3:] = t.reshape(-1)
        return padded[3:].view(t.shape)
    if kind == "transposed_layout":  # column-major storage
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    raise ValueError(kind)


def _view_cases():
    for position, name in enumerate(NAMES):
        kinds = ["every_other_element", "storage_offset"]
        if name in ("x", "temb", "weight"):
            kinds.append("transposed_layout")
        for kind in kinds:
            yield pytest.param(position, kind, id=f"{name}-{kind}")


def check_view(position, kind, backend, device, shape):
    args = inputs(7, (), device, **shape)
    ref, ref_grads = run(args, backend=backend)
    view = _view(args[position], kind)
    assert torch.equal(view, args[position])
    assert view.storage_offset() == 3 if kind == "storage_offset" else not view.is_contiguous()
    args[position] = view
    # run() would .clone() the leaves (a dense copy); keep the view itself as the leaf
    leaves = [a.detach().requires_grad_(True) if i == position else a.detach().clone().requires_grad_(True)
              for i, a in enumerate(args[:5])]
    out = final_adaln_out(*leaves, args[5], backend=backend)
    g = torch.Generator(device=out.device).manual_seed(0)
    out.backward(torch.randn(out.shape, generator=g, device=out.device).to(out.dtype))
    assert_same(out.detach(), ref, "out")
    for name, leaf in zip(LEAVES, leaves):
        assert_same(leaf.grad, ref_grads[name], f"d_{name}")


@pytest.mark.parametrize("position,kind", list(_view_cases()))
def test_non_contiguous(position, kind):
    """A non-contiguous or offset view of any argument gives the contiguous call's output and gradients."""
    check_view(position, kind, "torch", "cpu", CPU_SHAPE)


def check_stride_zero(backend, device, shape):
    """Broadcast (stride-0) arguments: one row of x for every row, one norm_weight value, one temb row
    for every timestep, one bias value; all equal the same call on dense copies."""
    args = inputs(5, (), device, **shape)
    S_, H_ = args[0].shape
    args[0] = args[0][:1].expand(S_, H_)
    args[1] = args[1][:1].expand(H_)
    args[2] = args[2][:1].expand_as(args[2])
    args[4] = args[4][:1].expand_as(args[4])
    assert all(0 in a.stride() for a in (args[0], args[1], args[2], args[4]))
    dense = [a.contiguous() for a in args]
    out = final_adaln_out(*args, backend=backend)
    assert_same(out, final_adaln_out(*dense, backend=backend), "out")
    same_index = args[5] == args[5][0]  # every row is x[0]: rows of one timestep give one output row
    assert bool((out[same_index] == out[:1]).all())
    _, grads = run(dense, backend=backend)
    leaves = [a.detach().requires_grad_(True) for a in args[:5]]  # stride-0 leaves
    out = final_adaln_out(*leaves, args[5], backend=backend)
    g = torch.Generator(device=out.device).manual_seed(0)
    out.backward(torch.randn(out.shape, generator=g, device=out.device).to(out.dtype))
    for name, leaf in zip(LEAVES, leaves):
        assert_same(leaf.grad, grads[name], f"d_{name}")


def test_stride_zero():
    check_stride_zero("torch", "cpu", CPU_SHAPE)


SUBSETS = [subset for r in range(6) for subset in itertools.combinations(LEAVES, r)]


def check_subset(subset, backend, device, shape):
    args = inputs(9, (), device, **shape)
    _, all_grads = run(args, backend=backend)
    _, grads = run(args, requires=subset, backend=backend)
    for name in LEAVES:
        if name in subset:
            assert grads[name] is not None, f"d_{name} missing"
            assert_same(grads[name], all_grads[name], f"d_{name}")
        else:
            assert grads[name] is None, f"d_{name} computed but not asked for"
    leaves = [a.detach().clone().requires_grad_(name in subset) for name, a in zip(LEAVES, args[:5])]
    assert final_adaln_out(*leaves, args[5], backend=backend).requires_grad == bool(subset)


@pytest.mark.parametrize("subset", SUBSETS, ids=lambda s: "+".join(s) or "none")
def test_requires_grad_subset(subset):
    """Gradients exist exactly for the leaves that require grad, and equal the all-leaves gradients."""
    check_subset(subset, "torch", "cpu", CPU_SHAPE)


# ---------------------------------------------------------------------------------------------- GPU

def golden_grads(args, requires, dy_seed=0):
    """Gradients of the float64 golden (no rounding anywhere) for the leaves in `requires`."""
    from adaln_lab.reference import golden

    leaves = [a.detach().double().requires_grad_(name in requires) for name, a in zip(LEAVES, args[:5])]
    out = golden(*leaves, args[5])
    if not requires:
        return dict.fromkeys(LEAVES)
    g = torch.Generator(device=out.device).manual_seed(dy_seed)
    dy = torch.randn(out.shape, generator=g, device=out.device).to(args[0].dtype)  # run()'s dy
    out.backward(dy.double())
    return {name: leaf.grad for name, leaf in zip(LEAVES, leaves)}


def compare_cuda(args, requires=LEAVES, table_backend="cuda"):
    """cupy vs torch on the same CUDA tensors.

    Output: bitwise-equal fraction >= 0.999 and max|diff| <= 0.02 max|ref|. d_x: within 0.02
    max|ref| of torch's. Parameter gradients: within 0.02 max|golden| of the float64 golden rather
    than of torch's, whose own bf16 reductions are off by up to 0.03 (d_temb) and 0.09 (d_weight) at
    the seed's sizes (README's table); the kernels' are within 0.003.
    """
    out, grads = run(args, requires, backend="cupy", table_backend=table_backend)
    ref, ref_grads = run(args, requires, backend="torch")
    assert out.shape == ref.shape and out.dtype == ref.dtype
    if out.numel():
        bitwise = float((out == ref).double().mean())
        diff = float((out.double() - ref.double()).abs().max())
        assert bitwise >= 0.999, f"only {bitwise:.5f} of the output bitwise equal to backend='torch'"
        assert diff <= 0.02 * float(ref.double().abs().max()), diff
    exact = golden_grads(args, requires)
    for name in LEAVES:
        if name not in requires:
            assert grads[name] is None and ref_grads[name] is None
            continue
        g = grads[name]
        assert g.shape == ref_grads[name].shape and g.dtype == ref_grads[name].dtype, name
        r = ref_grads[name] if name == "x" else exact[name]
        if r.numel() and bool(r.any()):
            err = float((g.double() - r.double()).abs().max() / r.double().abs().max())
            assert err <= 0.02, (name, err)
    return out, grads


@pytest.mark.gpu
def test_gpu_s_zero():
    check_empty("cupy", "cuda", GPU_SHAPE)


@pytest.mark.gpu
def test_gpu_t_one():
    args, _, _ = check_t_one("cupy", "cuda", GPU_SHAPE)
    compare_cuda(args)


@pytest.mark.gpu
def test_gpu_leading_dims():
    args = inputs(40, (2, 3), "cuda", **GPU_SHAPE)
    out, grads = compare_cuda(args)
    flat = [args[0].reshape(-1, 40, GPU_SHAPE["H"])[k] for k in range(6)]
    for k, x in enumerate(flat):  # the kernels are row-local: each slice is the 2-D call, bitwise
        assert_same(out.reshape(-1, 40, GPU_SHAPE["H"])[k], final_adaln_out(x, *args[1:], backend="cupy"), f"slice {k}")


@pytest.mark.gpu
@pytest.mark.parametrize("position,kind", list(_view_cases()))
def test_gpu_non_contiguous(position, kind):
    if kind != "storage_offset":
        check_view(position, kind, "cupy", "cuda", GPU_SHAPE)
        return
    # a contiguous tensor 6 bytes into its storage: .contiguous() keeps it, so kernels with 16-byte
    # vector loads must copy it themselves; a misaligned load is a sticky CUDA error that would
    # fail every later test of the session, so this case runs in its own process
    code = ("import sys; sys.path[:0] = ['.']; import tests.ops.test_final_adaln_out_edge_inputs as t; "
            f"t.check_view({position}, {kind!r}, 'cupy', 'cuda', t.GPU_SHAPE)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]


@pytest.mark.gpu
def test_gpu_stride_zero():
    check_stride_zero("cupy", "cuda", GPU_SHAPE)


@pytest.mark.gpu
@pytest.mark.parametrize("subset", SUBSETS, ids=lambda s: "+".join(s) or "none")
def test_gpu_requires_grad_subset(subset):
    check_subset(subset, "cupy", "cuda", GPU_SHAPE)
    compare_cuda(inputs(33, (), "cuda", **GPU_SHAPE), requires=subset)


def _largest_accepted_h(D=64, T=1, limit=1 << 20):
    """The largest multiple of 8 that the CUDA path's `check_shapes` accepts (binary search)."""
    from adaln_lab.core.plan import check_shapes

    def ok(h):
        try:
            check_shapes(h, D, T)
            return True
        except ValueError:
            return False

    assert ok(8), "H = 8 must be accepted"
    lo, hi = 1, limit // 8  # in units of 8
    assert not ok(hi * 8), "no upper limit on H below 2^20"
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid * 8) else (lo, mid)
    return lo * 8


@pytest.mark.gpu
def test_gpu_smallest_h():
    compare_cuda(inputs(40, (), "cuda", H=8, D=64, T=3))


@pytest.mark.gpu
def test_gpu_largest_h_and_one_past():
    h_max = _largest_accepted_h()
    out = final_adaln_out(*inputs(4, (), "cuda", H=h_max, D=64, T=1), backend="cupy")
    assert out.shape == (4, h_max) and bool(torch.isfinite(out).all())
    for h in (h_max + 8, h_max + 1):
        with pytest.raises(ValueError, match=r"H \(x\.shape\[-1\]\)"):
            final_adaln_out(*inputs(4, (), "cuda", H=h, D=64, T=1), backend="cupy")
