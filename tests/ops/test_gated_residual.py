"""`adaln_lab.gated_residual`: diffusers' `x + gate[i] * y` bit for bit on the CPU, its launch ops (opcheck, the
column the backward writes), dx = dout itself, d_y torch's own bf16 product, d_gate an exact float64 sum per table
row, torch.compile and compiled autograd, `backend=`; GPU: gated_residual.cu, fallbacks (warned)."""

import pytest
import torch

from adaln_lab import gated_residual, modulation_table, row_order
from adaln_lab.ops import KernelFallbackWarning
from adaln_lab.ops.gated_residual import launch
from adaln_lab.reference import block as br

from .contract import assert_eager_bits_under_compiled_autograd_and_checkpointing, rel_l2
from .test_modulated_rms_norm import DTYPES  # one dtype table

H, D, T = 32, 16, 3
R = 3 * T


def _case(S=40, lead=(), dtype=torch.bfloat16, table_dtype=torch.bfloat16, seed=0, device="cpu", H_=H, D_=D):
    """x, y (*lead, S, H), gate: gate_msa of a real table (a strided view), row_index (S,), dout."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*lead, S, H_, generator=g) * 2).to(dtype)
    y = torch.randn(*lead, S, H_, generator=g).to(dtype)
    temb = torch.randn(T, D_, generator=g)
    weight = (torch.randn(18 * H_, D_, generator=g) * D_ ** -0.5).to(table_dtype)
    bias = (torch.randn(18 * H_, generator=g) * 0.1).to(table_dtype)
    row_index = torch.randint(0, R, (S,), generator=g)
    dout = torch.randn(*lead, S, H_, generator=g).to(torch.promote_types(dtype, table_dtype))
    x, y, temb, weight, bias, row_index, dout = (t.to(device) for t in (x, y, temb, weight, bias, row_index, dout))
    gate = br.table_chunks(modulation_table(temb, weight, bias), H_)[2]
    return x, gate, y, row_index, dout


def _call(x, gate, y, row_index, table_dtype=torch.bfloat16):
    return gated_residual(x, gate, y, row_index, table_dtype=table_dtype)


def _diffusers(x, gate, y, row_index, table_dtype=torch.bfloat16):
    """diffusers' line `residual + gate_msa.index_select(0, adaln_indices) * attn_output` on the bf16 chunk."""
    return x + gate.to(table_dtype).index_select(0, row_index) * y


def _golden(x, gate, y, row_index, table_dtype=None):
    return br.golden_gated_residual(x, gate, y, row_index)


def _grads(fn, leaves, row_index, dout, **kw):
    leaves = [t.detach().clone().requires_grad_(True) for t in leaves]
    out = fn(leaves[0], leaves[1], leaves[2], row_index, **kw)
    out.backward(dout.to(out.dtype))
    return out.detach(), [t.grad for t in leaves]


def _launch_forward(x, gate, y, row_index, table_dtype, route="torch"):
    """out written by the forward launch op into an output allocated as the op's node allocates it."""
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, torch.promote_types(table_dtype, y.dtype)),
                      device=x.device)
    launch.forward(x, gate, y, row_index, table_dtype, route, out)
    return out


@pytest.mark.parametrize("dtype,table_dtype", DTYPES)
@pytest.mark.parametrize("lead", [(), (2,)])
def test_forward_is_diffusers_bit_for_bit(dtype, table_dtype, lead):
    x, gate, y, row_index, _ = _case(lead=lead, dtype=dtype, table_dtype=table_dtype)
    out = _call(x, gate, y, row_index, table_dtype)
    want = _diffusers(x, gate, y, row_index, table_dtype)
    assert out.dtype == want.dtype == torch.promote_types(dtype, table_dtype) and out.shape == x.shape
    assert torch.equal(out, want)
    assert torch.equal(_launch_forward(x, gate, y, row_index, table_dtype), want)
    assert torch.equal(gated_residual(x, gate, y, row_index), _call(x, gate, y, row_index, dtype))  # default: x's


@pytest.mark.parametrize("lead", [(), (2,)])
def test_gradients_dx_is_dout_dy_is_torchs_and_d_gate_exact(lead):
    x, gate, y, row_index, dout = _case(S=300, lead=lead, seed=1)
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, gate, y)]
    _call(*leaves[:3], row_index).backward(dout)
    dx, d_gate, d_y = (t.grad for t in leaves)
    assert torch.equal(dx, dout)
    assert torch.equal(d_y, dout * gate.bfloat16().index_select(0, row_index))  # diffusers' own d_y
    assert d_gate.dtype == torch.float32 and d_gate.shape == (R, H)
    exact = torch.zeros(R, H, dtype=torch.float64).index_add_(
        0, row_index.repeat(x.numel() // H // 300), (dout.double() * y.double()).reshape(-1, H))
    assert torch.equal(d_gate, exact.float())  # one rounding of the exact sum
    _, theirs = _grads(_diffusers, (x, gate, y), row_index, dout)
    assert rel_l2(d_gate, exact) <= rel_l2(theirs[1], exact)


@pytest.mark.parametrize("S", [64, 1024])
def test_every_gradient_at_least_as_accurate_as_diffusers(S):
    x, gate, y, row_index, dout = _case(S=S, seed=S)
    _, ours = _grads(_call, (x, gate, y), row_index, dout)
    _, theirs = _grads(_diffusers, (x, gate, y), row_index, dout)
    _, golden = _grads(_golden, [t.double() for t in (x, gate, y)], row_index, dout.double())
    for name, got, theirs_, gold in zip(("dx", "d_gate", "d_y"), ours, theirs, golden):
        assert rel_l2(got, gold) <= rel_l2(theirs_, gold), name


def test_rows_are_independent_and_gradients_repeat():
    x, gate, y, row_index, dout = _case(S=300, seed=2)
    out, grads = _grads(_call, (x, gate, y), row_index, dout)
    _, again = _grads(_call, (x, gate, y), row_index, dout)
    assert all(torch.equal(a, b) for a, b in zip(grads, again))
    rows = torch.randperm(300, generator=torch.Generator().manual_seed(3))[:50]
    sub_out, sub = _grads(_call, (x[rows], gate, y[rows]), row_index[rows], dout[rows])
    assert torch.equal(sub_out, out[rows]) and torch.equal(sub[2], grads[2][rows])


def test_a_gate_beyond_table_dtype_is_rounded_as_diffusers_rounds_it():
    """A float32 gate with values that bf16 cannot hold: forward and d_y use bf16(gate) (the cast to the
    table's dtype), d_gate is the exact sum (the cast passed straight through)."""
    x, _, y, row_index, dout = _case(seed=4)
    gate = torch.randn(R, H, generator=torch.Generator().manual_seed(5))
    assert not torch.equal(gate, gate.bfloat16().float())
    out, (dx, d_gate, d_y) = _grads(_call, (x, gate, y), row_index, dout)
    assert torch.equal(out, _diffusers(x, gate, y, row_index))
    assert torch.equal(d_y, dout * gate.bfloat16().index_select(0, row_index))
    exact = torch.zeros(R, H, dtype=torch.float64).index_add_(0, row_index, dout.double() * y.double())
    assert torch.equal(d_gate, exact.float())


def test_mixed_dtypes_cast_dx_back_to_x():
    x, gate, y, row_index, dout = _case(dtype=torch.bfloat16, table_dtype=torch.float32)
    _, (dx, d_gate, d_y) = _grads(_call, (x, gate, y), row_index, dout, table_dtype=torch.float32)
    assert dout.dtype == torch.float32 and dx.dtype == torch.bfloat16 and torch.equal(dx, dout.bfloat16())
    assert d_y.dtype == torch.bfloat16 and d_gate.dtype == torch.float32


def test_empty_batch():
    x, gate, y, row_index, dout = _case(S=0)
    out, (dx, d_gate, d_y) = _grads(_call, (x, gate, y), row_index, dout)
    assert out.shape == dx.shape == d_y.shape == (0, H) and not d_gate.any()


OPCHECK_CASES = {"bf16": dict(), "fp32": dict(dtype=torch.float32, table_dtype=torch.float32),
                 "leading dims": dict(lead=(2,)), "one row": dict(S=1), "no rows": dict(S=0)}


def _opcheck_launch_ops(x, gate, y, row_index, dout, table_dtype, route):
    """torch.library.opcheck on the two launch ops (outputs allocated as the op's node allocates them), the
    backward with and without the row order, writing d_gate into chunk 5 of a (R, 6H) table gradient."""
    out = _launch_forward(x, gate, y, row_index, table_dtype, route)
    torch.library.opcheck(launch.forward.op, (x, gate, y, row_index, table_dtype, route, torch.empty_like(out)))
    R, h = gate.shape
    d_table = torch.empty(R, 6 * h, dtype=torch.float32, device=x.device)
    for order in (None, row_order(row_index, R, h)):
        torch.library.opcheck(launch.backward.op, (dout.to(out.dtype), gate, y, row_index, order, table_dtype, route,
                                                   torch.empty_like(y), d_table, 5 * h, None))


@pytest.mark.parametrize("case", OPCHECK_CASES)
def test_opcheck(case):
    kwargs = OPCHECK_CASES[case]
    x, gate, y, row_index, dout = _case(**kwargs)
    _opcheck_launch_ops(x, gate, y, row_index, dout, kwargs.get("table_dtype", torch.bfloat16), "torch")


@pytest.mark.parametrize("column", [0, 3])
def test_backward_launch_writes_d_gate_into_its_column_only(column):
    """The backward launch op: d_y as the op's, d_gate (the op's exact sum) in columns [column, column + H) of a
    (R, 6H) table gradient (a block's chunk `column`), every other column untouched."""
    x, gate, y, row_index, dout = _case(S=50, seed=6)
    _, (dx, d_gate, d_y) = _grads(_call, (x, gate, y), row_index, dout)
    got_d_y, d_table = torch.empty_like(y), torch.full((R, 6 * H), float("nan"))
    launch.backward(dout, gate, y, row_index, None, torch.bfloat16, "torch", got_d_y, d_table, column * H, None)
    assert torch.equal(got_d_y, d_y) and torch.equal(d_table[:, column * H:(column + 1) * H], d_gate)
    assert torch.cat([d_table[:, :column * H], d_table[:, (column + 1) * H:]], dim=1).isnan().all()


def test_compiled_autograd_and_checkpointing_give_the_eager_bits():
    """The op's one autograd node under compiled autograd (its backward traced) and torch.utils.checkpoint
    (reentrant or not): eager's bits."""
    x, gate, y, row_index, dout = _case(S=33, lead=(2,), seed=8)
    assert_eager_bits_under_compiled_autograd_and_checkpointing(_call, (x, gate, y), row_index, dout, _grads)


def test_backend_option():
    """backend "torch" is "auto"'s CPU route, bit for bit (no warning on the CPU); "cupy" refuses CPU tensors naming
    why; anything else is refused naming the option."""
    import warnings

    x, gate, y, row_index, dout = _case(S=21, seed=7)
    with warnings.catch_warnings():
        warnings.simplefilter("error", KernelFallbackWarning)
        auto = _grads(gated_residual, (x, gate, y), row_index, dout)
    torch_ = _grads(lambda *a: gated_residual(*a, backend="torch"), (x, gate, y), row_index, dout)
    assert torch.equal(auto[0], torch_[0]) and all(torch.equal(a, b) for a, b in zip(auto[1], torch_[1]))
    with pytest.raises(ValueError, match="the CUDA kernels need CUDA tensors, but x is on cpu"):
        gated_residual(x, gate, y, row_index, backend="cupy")
    with pytest.raises(ValueError, match="backend must be one of"):
        gated_residual(x, gate, y, row_index, backend="cuda")


def test_compile_fullgraph_matches_eager():
    x, gate, y, row_index, dout = _case(S=33, lead=(2,))
    compiled = torch.compile(_call, fullgraph=True, backend="aot_eager")
    eager_out, eager = _grads(_call, (x, gate, y), row_index, dout)
    out, traced = _grads(compiled, (x, gate, y), row_index, dout)
    assert torch.equal(out, eager_out) and all(torch.equal(a, b) for a, b in zip(eager, traced))


def test_bad_inputs_are_refused_naming_the_argument():
    x, gate, y, row_index, _ = _case()
    with pytest.raises(ValueError, match="y of x's shape"):
        gated_residual(x, gate, y[:-1], row_index)
    with pytest.raises(ValueError, match="gate"):
        gated_residual(x, gate[:, :-1], y, row_index)
    with pytest.raises(ValueError, match="row_index"):
        gated_residual(x, gate, y, row_index[:-1])
    with pytest.raises(TypeError, match="row_index"):
        gated_residual(x, gate, y, row_index.int())
    with pytest.raises(TypeError, match="floating-point y"):
        gated_residual(x, gate, y.long(), row_index)
    with pytest.raises(TypeError, match="gate"):
        gated_residual(x, gate.long(), y, row_index)


# ---------------------------------------------------------------- GPU (H200) ----------------------------------

GH, GD = 1024, 256


@pytest.mark.gpu
@pytest.mark.parametrize("lead", [(), (2,)])
def test_cuda_matches_diffusers_bitwise(lead):
    """gated_residual.cu rounds as diffusers' bf16 ops: out and d_y bit for bit; d_gate an ordered float32 sum."""
    x, gate, y, row_index, dout = _case(S=2049, lead=lead, device="cuda", H_=GH, D_=GD)
    out, (dx, d_gate, d_y) = _grads(_call, (x, gate, y), row_index, dout)
    assert torch.equal(out, _diffusers(x, gate, y, row_index))
    assert torch.equal(dx, dout)
    assert torch.equal(d_y, dout * gate.bfloat16().index_select(0, row_index))
    _, again = _grads(_call, (x, gate, y), row_index, dout)
    assert torch.equal(again[1], d_gate)
    _, theirs = _grads(_diffusers, (x, gate, y), row_index, dout)
    _, golden = _grads(_golden, [t.double() for t in (x, gate, y)], row_index, dout.double())
    for name, got, theirs_, gold in zip(("dx", "d_gate", "d_y"), (dx, d_gate, d_y), theirs, golden):
        assert rel_l2(got, gold) <= rel_l2(theirs_, gold), name
    rows = torch.randperm(2049, device="cuda")[:500]
    sub_out, sub = _grads(_call, (x[:, rows] if lead else x[rows], gate, y[:, rows] if lead else y[rows]),
                          row_index[rows], dout[:, rows] if lead else dout[rows])
    assert torch.equal(sub_out, out[:, rows] if lead else out[rows])
    assert torch.equal(sub[2], d_y[:, rows] if lead else d_y[rows])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,table_dtype", DTYPES[1:])
def test_cuda_falls_back_to_torch_for_other_dtypes(dtype, table_dtype):
    """backend "auto" warns KernelFallbackWarning naming the reason and runs the torch code (the CPU's gradients);
    backend "cupy" refuses the same inputs."""
    x, gate, y, row_index, dout = _case(dtype=dtype, table_dtype=table_dtype, device="cuda", H_=GH, D_=GD)
    with pytest.warns(KernelFallbackWarning, match="gated_residual: the CUDA kernels cannot take these inputs "
                                                   r"\(the CUDA kernels need .* bfloat16"):
        out, grads = _grads(_call, (x, gate, y), row_index, dout, table_dtype=table_dtype)
    with pytest.raises(TypeError, match="bfloat16"):
        gated_residual(x, gate, y, row_index, table_dtype=table_dtype, backend="cupy")
    assert torch.equal(out, _diffusers(x, gate, y, row_index, table_dtype))
    cpu = _grads(_call, [t.cpu() for t in (x, gate, y)], row_index.cpu(), dout.cpu(), table_dtype=table_dtype)[1]
    for a, b in zip(grads, cpu):
        assert a.dtype == b.dtype and torch.allclose(a.cpu().double(), b.double(), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_cuda_opcheck():
    """The launch ops on the kernels' route: opcheck, and the backward writing the op's own bits into chunk 5's
    columns of a (R, 6H) float32 table gradient (the reduce's row stride 6H), no other column touched."""
    x, gate, y, row_index, dout = _case(S=100, lead=(2,), device="cuda", H_=GH, D_=GD)
    _opcheck_launch_ops(x, gate, y, row_index, dout, torch.bfloat16, "cupy")
    out, (dx, d_gate, d_y) = _grads(_call, (x, gate, y), row_index, dout)
    assert torch.equal(_launch_forward(x, gate, y, row_index, torch.bfloat16, "cupy"), out)
    got_d_y, d_table = torch.empty_like(y), torch.full((R, 6 * GH), float("nan"), device="cuda")
    launch.backward(dout, gate, y, row_index, None, torch.bfloat16, "cupy", got_d_y, d_table, 5 * GH, None)
    assert torch.equal(got_d_y, d_y) and torch.equal(d_table[:, 5 * GH:], d_gate)
    assert d_table[:, :5 * GH].isnan().all()
