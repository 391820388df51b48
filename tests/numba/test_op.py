"""backend="numba" (adaln_lab.ops.final_adaln_out.twin.op): the Numba twin of kernels_cu as the bodies of the op's
launch ops, route "numba" of its one autograd node `FinalAdaLNOut`.

On a CPU through numba's CUDA simulator at tiny shapes (the simulator runs a few thousand threads a
second; every fwd + bwd here costs seconds, so the module runs a handful of them): the plumbing of the
op (shapes, broadcast of x (..., S, H), saved tensors, dtypes, needs_input_grad, refusals) and the
twin's numerics against the bounds tests/numba/test_forward.py (forward against diffusers' replay) and
tests/numba/bounds.py (gradients against the float64 golden) hold the twin to; row invariance and
repeatability bit for bit (the twin against itself). On a GPU (`gpu` mark): every output and gradient
of backend="numba" bit for bit equal to backend="cupy", at the accuracy sizes 4097 and 32768 and at the
seed protocol's invariance sizes (adaln_lab.harness.protocol.FULL) with the real shape. The twin's GPU
tests know of no instruction where the twin cannot have the kernels' bits, so no ulp bound is allowed.
"""

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from adaln_lab import final_adaln_out
from adaln_lab.core import support
from adaln_lab.core.plan import forward_workspace
from adaln_lab.harness.accuracy import golden_result, parity, rel_err
from adaln_lab.harness.candidates import resolve
from adaln_lab.harness.inputs import Inputs, make, upstream
from adaln_lab.harness.protocol import FULL
from adaln_lab.ops.final_adaln_out import launch
from adaln_lab.ops.final_adaln_out.op import FinalAdaLNOut
from adaln_lab.ops.final_adaln_out.twin import backward as numba_backward, forward as numba_forward, op as numba_op
from adaln_lab.reference import replay

from .bounds import NAMES, Case, assert_within, golden_tolerances, same_bits

pytestmark = pytest.mark.integration  # the Numba twin in numba's CUDA simulator (a few thousand threads a second)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TINY = {"H": 32, "D": 16, "T": 2}  # one table block of 512 threads: ~2.5 s a table in the simulator
EPS = 1e-5
LEAF_DTYPES = (torch.bfloat16, torch.bfloat16, torch.float32, torch.bfloat16, torch.bfloat16)


def saved_of(out):
    """What out's node (FinalAdaLNOut) saved: (x, norm_weight, temb, weight, timestep_indices, table_f32, rstd),
    the last two the views of its forward workspace (`launch.saved_views`), which is checked to have the size
    `forward_workspace` gives."""
    assert type(out.grad_fn).__name__ == "FinalAdaLNOutBackward"
    x, norm_weight, temb, weight, idx, workspace = (t.detach() for t in out.grad_fn.saved_tensors)
    (T, D), H = temb.shape, x.shape[-1]
    rows = x.numel() // H
    assert workspace.dtype == torch.uint8 and workspace.shape == (forward_workspace(T, H, rows, D)[1],)
    _, table_f32, rstd = launch.saved_views(workspace, T, H, rows, D)
    return x, norm_weight, temb, weight, idx, table_f32.clone(), rstd.clone()


def run(inputs: Inputs, dy_seed: int, x_shape=None, **kwargs):
    """(out, grads, saved) of final_adaln_out(backend="numba") on fresh leaves; x viewed as x_shape."""
    leaves = [t.detach().clone() for t in inputs.leaves]
    if x_shape is not None:
        leaves[0] = leaves[0].view(x_shape)
    leaves = [t.requires_grad_(True) for t in leaves]
    out = final_adaln_out(*leaves, inputs.timestep_indices, EPS, backend="numba", **kwargs)
    saved = saved_of(out)
    out.backward(upstream(dy_seed, out))
    return out.detach(), tuple(leaf.grad for leaf in leaves), saved


# ---------------------------------------------------------------- one batch of x (2, 3, H), S = 3

one_worker = pytest.mark.xdist_group("numba_op")  # the tests of the module fixture `batch`: built once


@pytest.fixture(scope="module")
def batch():
    """6 rows as x (2, 3, H) with the 3 timestep indices of its first rows; the op's one fwd + bwd."""
    flat = make(5, 6, DEVICE, **TINY)
    inputs = dataclasses.replace(flat, x=flat.x.view(2, 3, TINY["H"]),
                                 timestep_indices=torch.tensor([1, 0, 1], device=DEVICE))
    out, grads, saved = run(inputs, 5)
    return inputs, out, grads, saved


def flattened(inputs: Inputs) -> Inputs:
    """x (..., S, H) as (rows, H) with the indices repeated: the same function, one index per row."""
    H, S = inputs.x.shape[-1], inputs.timestep_indices.shape[0]
    x = inputs.x.reshape(-1, H)
    return dataclasses.replace(inputs, x=x, timestep_indices=inputs.timestep_indices.repeat(x.shape[0] // S))


@one_worker
def test_shapes_dtypes_and_saved_tensors(batch):
    inputs, out, grads, saved = batch
    H, T = TINY["H"], TINY["T"]
    assert out.shape == (2, 3, H) and out.dtype == torch.bfloat16
    for name, g, leaf, dtype in zip(NAMES, grads, inputs.leaves, LEAF_DTYPES):
        assert g is not None and g.shape == leaf.shape and g.dtype == dtype, name
    # what the node keeps for either route: x, norm_weight, temb, weight, timestep_indices and the workspace
    # holding table_f32 and rstd
    x, norm_weight, temb, weight, idx, table_f32, rstd = saved
    for a, b in ((x, inputs.x), (norm_weight, inputs.norm_weight), (temb, inputs.temb), (weight, inputs.weight),
                 (idx, inputs.timestep_indices)):
        assert torch.equal(a, b)
    assert table_f32.shape == (T, 2 * H) and table_f32.dtype == torch.float32
    assert rstd.shape == (6,) and rstd.dtype == torch.float32
    exact = torch.rsqrt(inputs.x.double().reshape(6, H).pow(2).mean(-1) + EPS)
    assert float((rstd.double() / exact - 1).abs().max()) < 2.0 ** -20


@one_worker
def test_op_is_the_twins_kernels_composed(batch):
    """out is the twin's norm_modulate on the saved table (table_f32 rounds to the twin's bf16 table,
    tests/numba/test_forward.py), every gradient the twin's backward on the saved tensors: bit for bit."""
    inputs, out, grads, saved = batch
    x, norm_weight, temb, weight, idx, table_f32, rstd = saved
    H = x.shape[-1]
    again, rstd_again = numba_forward.norm_modulate(x.reshape(-1, H), norm_weight, table_f32.to(torch.bfloat16),
                                                    idx, EPS)
    assert same_bits(again.view(out.shape), out) and same_bits(rstd_again, rstd)
    dy = upstream(5, out)
    twin = numba_backward.backward(dy, x, rstd, norm_weight, table_f32, idx, temb, weight)
    for name, a, b in zip(NAMES, twin, grads):
        assert same_bits(a, b), name


@one_worker
def test_forward_is_diffusers_up_to_summation_order(batch):
    """The bounds of tests/numba/test_forward.py: against diffusers' replay, and near the float64 golden."""
    inputs, out, _, _ = batch
    result = parity(lambda *args: out, replay, inputs)
    assert result["within_1_ulp_fraction"] >= 0.99
    assert result["max_operand_ulp"] <= 4
    golden_out, _ = golden_result(flattened(inputs), upstream(5, out).reshape(6, -1))
    assert rel_err(out.reshape(6, -1), golden_out) < 2.0 ** -7


@one_worker
def test_gradients_within_the_bounds_of_the_float64_golden(batch):
    """tests/numba/bounds.py's per-element bounds, on the op's own saved rstd and table_f32."""
    inputs, out, grads, saved = batch
    *_, table_f32, rstd = saved
    flat = flattened(inputs)
    case = Case(flat, upstream(5, out).reshape(6, -1), rstd, table_f32, ())
    golden, tol = golden_tolerances(case)
    for name, value in zip(NAMES, grads):
        value = value.reshape(golden[name].shape)
        assert_within(name, value, golden[name], tol[name])
        assert float(tol[name].max()) <= 2.0 ** -5 * float(golden[name].abs().max()), name


@one_worker
def test_rows_do_not_depend_on_the_batch(batch):
    """Rows 0 and 4 alone give the batch's output and dx rows bit for bit."""
    inputs, out, grads, _ = batch
    H = TINY["H"]
    flat = flattened(inputs)
    dy = upstream(5, out).reshape(6, H)
    for r in (0, 4):
        alone = flat.rows(torch.tensor([r]))
        leaves = [t.detach().clone().requires_grad_(True) for t in alone.leaves]
        out_r = final_adaln_out(*leaves, alone.timestep_indices, EPS, backend="numba")
        out_r.backward(dy[r:r + 1])
        assert same_bits(out_r.detach()[0], out.reshape(6, H)[r]), r
        assert same_bits(leaves[0].grad[0], grads[0].reshape(6, H)[r]), r


@one_worker
@pytest.mark.slow  # a plain second call: test_op_is_the_twins_kernels_composed already runs the row kernel and the
# whole backward again on the same inputs and compares bit for bit, and test_forward.py's T-invariance test runs
# the table kernel again on the same rows
def test_calls_repeat(batch):
    """The whole batch again gives every output and gradient bit for bit."""
    inputs, out, grads, _ = batch
    out2, grads2, _ = run(inputs, 5)
    assert same_bits(out2, out)
    for name, a, b in zip(NAMES, grads2, grads):
        assert same_bits(a, b), name


# ---------------------------------------------------------------- the autograd Function itself

def test_function_with_torch_table_and_only_x_requiring_grad():
    """FinalAdaLNOut.apply directly on route "numba", table_backend="torch" (F.linear's table, as the cupy
    backend): out is the twin's row kernel on that table; only x gets a gradient, within the golden bounds."""
    import torch.nn.functional as F

    inputs = make(7, 4, DEVICE, **TINY)
    x = inputs.x.clone().requires_grad_(True)
    out = FinalAdaLNOut.apply(x, inputs.norm_weight, inputs.temb, inputs.weight, inputs.bias,
                              inputs.timestep_indices, EPS, "numba", "torch")
    act = F.silu(inputs.temb).to(torch.bfloat16)
    table = F.linear(act, inputs.weight, inputs.bias)
    expected, _ = numba_forward.norm_modulate(inputs.x, inputs.norm_weight, table, inputs.timestep_indices, EPS)
    assert same_bits(out.detach(), expected)
    *_, table_f32, rstd = saved_of(out)
    assert torch.equal(table_f32, F.linear(act.float(), inputs.weight.float(), inputs.bias.float()))
    dy = upstream(7, out)
    out.backward(dy)
    assert x.grad is not None and x.grad.dtype == torch.bfloat16
    golden, tol = golden_tolerances(Case(inputs, dy, rstd, table_f32, ()))
    assert_within("dx", x.grad, golden["dx"], tol["dx"])


def test_an_empty_batch_gives_an_empty_output_and_zero_parameter_gradients():
    inputs = make(1, 3, DEVICE, **TINY)
    H = TINY["H"]
    leaves = [t.detach().clone() for t in inputs.leaves]
    leaves[0] = leaves[0][:0].reshape(2, 0, H)
    leaves = [t.requires_grad_(True) for t in leaves]
    out = final_adaln_out(*leaves, inputs.timestep_indices[:0], EPS, backend="numba", table_backend="torch")
    assert out.shape == (2, 0, H) and out.dtype == torch.bfloat16
    out.backward(torch.zeros_like(out))
    assert leaves[0].grad.shape == (2, 0, H)
    for name, leaf in zip(NAMES[1:], leaves[1:]):
        assert leaf.grad.shape == leaf.shape and bool((leaf.grad == 0).all()), name


def test_an_unchecked_invalid_index_gives_a_nan_row():
    inputs = make(2, 3, DEVICE, **TINY)
    idx = torch.tensor([1, 5, 0], device=DEVICE)
    with torch.no_grad():
        out = final_adaln_out(*inputs.leaves, idx, EPS, backend="numba", table_backend="torch", check_indices=False)
    assert bool(out[1].float().isnan().all()) and not bool(out[[0, 2]].float().isnan().any())
    with pytest.raises(IndexError, match="outside"):  # checked: refused before any kernel runs
        final_adaln_out(*inputs.leaves, idx, EPS, backend="numba", check_indices=True)


# ---------------------------------------------------------------- refusals (no kernel runs)

@pytest.mark.parametrize("change, error, match", [
    (lambda i: {"x": i.x.float()}, TypeError, "the CUDA kernels need x in bfloat16, got torch.float32"),
    (lambda i: {"temb": i.temb.double()}, TypeError, "the CUDA kernels need temb in float32, got torch.float64"),
    (lambda i: {"x": i.x.half(), "norm_weight": i.norm_weight.half(), "weight": i.weight.half(),
                "bias": i.bias.half()}, TypeError, "the CUDA kernels need x in bfloat16, got torch.float16"),
], ids=["x_fp32", "temb_fp64", "all_fp16"])
def test_refuses_dtypes_the_kernels_cannot_take(change, error, match):
    inputs = make(1, 2, DEVICE, **TINY)
    inputs = dataclasses.replace(inputs, **change(inputs))
    with pytest.raises(error, match=match):
        final_adaln_out(*inputs.args, EPS, backend="numba")


@pytest.mark.parametrize("shape, match", [
    (dict(H=12, D=16, T=1), r"the CUDA kernels need H \(x.shape\[-1\]\) divisible by 8, got 12"),
    (dict(H=16, D=12, T=1), r"the CUDA kernels need D \(temb.shape\[1\]\) divisible by 8, got 12"),
    (dict(H=8, D=8, T=3073), r"the CUDA kernels need T \(temb.shape\[0\]\) <= 3072, got 3073"),
    (dict(H=8, D=11784, T=1), r"the Numba twin's table kernel takes T \* D <= 11776"),  # cupy takes it
], ids=["H", "D", "T", "TD"])
def test_refuses_shapes_the_kernels_cannot_take(shape, match):
    inputs = make(1, 2, DEVICE, **shape)
    with pytest.raises(ValueError, match=match):
        final_adaln_out(*inputs.args, EPS, backend="numba")
    assert support.twin_td_max(8, 8, 1) == 11776


def test_numba_is_imported_only_by_the_numba_backend_and_cpu_tensors_need_the_simulator():
    """A fresh process without NUMBA_ENABLE_CUDASIM: importing adaln_lab and running backend "torch"
    import no numba; backend "numba" on CPU tensors is then refused, naming the device."""
    script = """
import sys
import adaln_lab
from adaln_lab.harness.inputs import make
i = make(1, 2, "cpu", H=16, D=8, T=1)
adaln_lab.final_adaln_out(*i.args, backend="torch")
assert "numba" not in sys.modules, "numba imported before the numba backend was called"
try:
    adaln_lab.final_adaln_out(*i.args, backend="numba")
except ValueError as error:
    print("REFUSED", error)
"""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "REFUSED backend='numba' needs CUDA tensors" in result.stdout and "x is on cpu" in result.stdout


# ---------------------------------------------------------------- the report's candidate

def test_candidate_is_refused_off_cuda_by_resolve_and_the_cli(tmp_path):
    with pytest.raises(ValueError, match="candidate 'adaln_lab_numba' runs on CUDA only"):
        resolve(["adaln_lab_numba"], torch.device("cpu"))
    run_ = subprocess.run([sys.executable, "-m", "adaln_lab", "report", "--quick", "--device", "cpu",
                           "--candidates", "adaln_lab_numba", "--out", str(tmp_path / "x.json")],
                          capture_output=True, text=True, timeout=300)
    assert run_.returncode == 2 and "candidate 'adaln_lab_numba' runs on CUDA only" in run_.stderr
    assert not (tmp_path / "x.json").exists()


def test_candidate_builds_under_the_simulator_with_a_warning():
    if not numba_op.simulating():
        pytest.skip("numba's simulator is off (a GPU is here)")
    from adaln_lab.harness.candidates import adaln_lab_numba_candidate

    named = adaln_lab_numba_candidate(device="cpu")
    assert named.name == "adaln_lab_numba" and "simulator" in named.source and named.warning
    with pytest.raises(ValueError, match="simulator is on"):
        adaln_lab_numba_candidate(device="cuda")


# ---------------------------------------------------------------- on a GPU: backend "cupy"'s bits

def both_backends(inputs: Inputs, dy_seed: int, x_shape=None, **kwargs):
    """{backend: (out, grads)} for "cupy" and "numba" on the same leaves and the same upstream gradient, both on
    F.linear's table (table_backend "torch"): the twin's own table keeps v25's GEMV order, table.cu sums on tensor
    cores (tests/numba/test_forward.py compares the two tables with the golden)."""
    kwargs.setdefault("table_backend", "torch")
    results = {}
    for backend in ("cupy", "numba"):
        leaves = [t.detach().clone() for t in inputs.leaves]
        if x_shape is not None:
            leaves[0] = leaves[0].view(x_shape)
        leaves = [t.requires_grad_(True) for t in leaves]
        out = final_adaln_out(*leaves, inputs.timestep_indices, EPS, backend=backend, **kwargs)
        out.backward(upstream(dy_seed, out))
        results[backend] = (out.detach(), tuple(leaf.grad for leaf in leaves))
    torch.cuda.synchronize()
    return results


def assert_same_as_cupy(results):
    (out_c, grads_c), (out_n, grads_n) = results["cupy"], results["numba"]
    assert same_bits(out_n, out_c), "out"
    for name, a, b in zip(NAMES, grads_n, grads_c):
        assert same_bits(a, b), name


INVARIANCE_SIZES = sorted(set(FULL.all_rows_sizes) | set(FULL.sub_batch_sizes) | {FULL.full_batch, 2, 9, 17, 2047})


@pytest.mark.gpu
@pytest.mark.parametrize("rows", FULL.accuracy_sizes)
def test_numba_equals_cupy_bit_for_bit_at_the_accuracy_sizes(rows):
    inputs = make(FULL.accuracy_seed, rows, "cuda")
    assert_same_as_cupy(both_backends(inputs, FULL.accuracy_seed))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", INVARIANCE_SIZES)
def test_numba_equals_cupy_bit_for_bit_at_the_invariance_sizes(rows):
    """FULL's all_rows sizes, sub-batch sizes and full batch (1 .. 131072 rows: every row-range geometry
    the protocol meets) and a few of the sweep's, seed 3 (the protocol's first)."""
    inputs = make(FULL.seeds[0], rows, "cuda")
    assert_same_as_cupy(both_backends(inputs, FULL.seeds[0]))


@pytest.mark.gpu
def test_numba_equals_cupy_with_leading_dims():
    inputs = make(4, 4 * 1025, "cuda")
    inputs = dataclasses.replace(inputs, timestep_indices=inputs.timestep_indices[:1025].contiguous())
    assert_same_as_cupy(both_backends(inputs, 4, x_shape=(4, 1025, inputs.x.shape[-1])))


@pytest.mark.gpu
def test_numba_poisons_like_cupy():
    """Unchecked indices outside [0, T): the same NaN rows and gradients, the same bits elsewhere."""
    inputs = make(2, 300, "cuda")
    idx = inputs.timestep_indices.clone()
    idx[5], idx[200] = 3, -1
    inputs = dataclasses.replace(inputs, timestep_indices=idx)
    results = both_backends(inputs, 2, check_indices=False)
    assert bool(results["numba"][0][5].float().isnan().all())
    assert_same_as_cupy(results)


@pytest.mark.gpu
def test_numba_runs_on_torchs_current_stream_and_in_a_cuda_graph():
    """On a side stream, and captured in a CUDA graph (a launch outside the capturing stream would break
    the capture): the eager bits."""
    inputs = make(1, 257, "cuda")
    eager = final_adaln_out(*inputs.args, EPS, backend="numba")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        side = final_adaln_out(*inputs.args, EPS, backend="numba")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            captured = final_adaln_out(*inputs.args, EPS, backend="numba")
        graph.replay()
    torch.cuda.synchronize()
    assert same_bits(side, eager) and same_bits(captured, eager)


@pytest.mark.gpu
def test_candidate_resolves_on_cuda_and_is_backend_numba():
    (named,) = resolve(["adaln_lab_numba"], torch.device("cuda"))
    assert named.name == "adaln_lab_numba" and "numba" in named.source and named.warning is None
    inputs = make(3, 257, "cuda")
    with torch.no_grad():
        out = named.fn(*inputs.args)
        ref = final_adaln_out(*inputs.args, EPS, backend="numba")  # its own table: v25's GEMV (not table.cu's mma)
    torch.cuda.synchronize()
    assert same_bits(out, ref)
