"""The op contract, one suite parametrized over the public ops (`tests/ops/contract.py` describes each op once).

CPU, every op (row_order where a property applies):
  (1) eager == torch.compile(fullgraph=True) bit for bit, outputs and gradients, the launch ops in the graphs;
  (2) the output is the diffusers replay bit for bit; the gradients keep the op's contract: bit for bit where the
      docstring says so, else within the derived bound of the float64 golden (one rounding of the exact value);
  (3) torch.library.opcheck on every launch op (route "torch");
  (4) batch invariance: each row's output and row gradients the same bits alone, in a sub-batch and in the batch;
  (5) a wrong dtype / shape / device / option raises an error that names the argument (known gaps: strict xfails);
  (6) the one rule: with every rule of `core.support` refusing, backend "cupy" raises that very refusal in every
      op and module, and backend "auto" falls back silently on CPU tensors (warns on CUDA ones: GPU test).
Planted counter-examples show that the helpers of (1), (2) and (4) fail on a wrong op.
GPU (`gpu` mark): the kernels against the replay on the same GPU (the per-op thresholds of the ops' own GPU tests),
parameter gradients repeating bit for bit, CUDA-graph replay, an empty batch, a side stream, batch invariance,
the one rule's warnings.

torch.compile runs with AOTAutograd and the traced graphs run as traced (aot_eager's numerics): inductor would fuse
and re-round the torch code of the replay (norm_out's CPU path), which the contract does not claim.
"""

import dataclasses
import warnings

import pytest
import torch

from adaln_lab.core.warnings import KernelFallbackWarning
from adaln_lab.harness.accuracy import ulp_distance
from adaln_lab.harness.inputs import make as harness_inputs

from .contract import (CASES, BF16, F64, Shape, as_tuple, assert_compiled_matches_eager, assert_results_equal,
                       assert_rows_invariant, assert_same_bits, assert_within, bad_input_params, call_with, cases,
                       golden_grads, names_argument, plant_refusal, run, slice_rows, ulp, upstream)



def _inputs(case, seed, shape=None, device="cpu"):
    """(args, dys) of one call: the case's inputs and seeded upstream gradients of its outputs."""
    args = case.make(seed) if shape is None else case.make(seed, shape)
    args = {n: (v.to(device) if isinstance(v, torch.Tensor) else v) for n, v in args.items()}
    with torch.no_grad():
        outs = as_tuple(case.call(args))
    return args, tuple(d.to(device) for d in upstream(tuple(o.cpu() for o in outs), seed))


# ---------------------------------------------------------------- (1) eager == torch.compile(fullgraph=True)


@pytest.mark.parametrize("case", cases())
def test_compiled_equals_eager_bit_for_bit(case, one_thread):
    """Outputs and gradients; the op's launch ops are in the traced graphs (its one autograd node traced, forward
    and backward), and norm_out's CPU path, the replay, calls none."""
    args, dys = _inputs(case, 0)
    graphs = assert_compiled_matches_eager(case.call, args, dys, case.differentiable)
    called = " ".join(" ".join(graph) for graph in graphs)
    for op in case.compiled_ops:
        assert op in called, (op, graphs)
    if not case.compiled_ops:
        assert "adaln_lab." not in called, graphs


def _off_when_compiled(case, where: str):
    """case.call plus a planted difference that only the compiled call has: "output" adds an ulp to the first
    output; "gradient" leaves the output's bits and scales its gradient by 1 + 2^-4."""

    def call(args, backend="auto"):
        outs = list(as_tuple(case.call(args, backend)))
        if torch.compiler.is_compiling():
            out = outs[0]
            if where == "output":
                outs[0] = out + ulp(out.detach(), out.dtype).to(out.dtype)
            else:
                outs[0] = out + 2 ** -4 * (out - out.detach())
        return tuple(outs) if len(outs) > 1 else outs[0]

    return call


@pytest.mark.parametrize("where", ["output", "gradient"])
def test_planted_compiled_difference_fails_the_compile_check(where, one_thread):
    case = CASES["modulated_rms_norm"]
    args, dys = _inputs(case, 0)
    with pytest.raises(AssertionError, match=f"torch.compile.*{'output 0' if where == 'output' else 'gradient of x'}"):
        assert_compiled_matches_eager(_off_when_compiled(case, where), args, dys, case.differentiable)


# ---------------------------------------------------------------- (2) the replay's output, the contract's gradients


@pytest.mark.parametrize("case", cases())
def test_cpu_output_is_the_replay_and_gradients_keep_the_contract(case, one_thread):
    args, dys = _inputs(case, 1)
    outs, grads = run(case.call, args, dys, case.differentiable)
    replay = as_tuple(case.replay(args))
    assert len(outs) == len(replay)
    for i, (got, want) in enumerate(zip(outs, replay)):
        assert_same_bits(got, want, f"{case.name} output {i} vs the diffusers replay")
    assert not case.differentiable or case.exact_grads or case.grad_bounds, "a differentiable op states no contract"
    if case.exact_grads is not None:
        want = case.exact_grads(args, dys)
        for name in case.differentiable:
            assert_same_bits(grads[name], want[name], f"{case.name}: gradient of {name} vs the contract's")
    if case.grad_bounds is not None:
        _, golden = golden_grads(case, args, dys)
        bounds = case.grad_bounds(args, dys, golden)
        assert bounds.keys() == set(case.differentiable)
        for name in case.differentiable:
            assert grads[name].dtype == args[name].dtype, name
            assert_within(grads[name], golden[name], bounds[name], f"{case.name}: gradient of {name} vs float64")


@pytest.mark.parametrize("case", cases(lambda c: c.grad_bounds is not None))
def test_planted_gradient_one_ulp_off_fails_the_bound(case, one_thread):
    """The bounds are tight: each gradient moved one ulp away from the golden, at the element of its tightest bound,
    fails. Not so d_scale of the norms: a float32 gradient of float32 per-row products (x rstd), whose bound is
    that float32 error (a few float32 ulps, `contract._norm_errors`); it is held below one bf16 ulp everywhere,
    and a move by one bf16 ulp fails it."""
    args, dys = _inputs(case, 1)
    _, grads = run(case.call, args, dys, case.differentiable)
    _, golden = golden_grads(case, args, dys)
    bounds = case.grad_bounds(args, dys, golden)
    coarse = set()
    for name in case.differentiable:
        got, gold, bound = grads[name].flatten(), golden[name].flatten(), bounds[name].flatten()
        units = ulp(gold, got.dtype)
        i = int((bound / units).argmin())
        step = units[i]
        if bound[i] >= units[i]:
            coarse.add(name)
            assert bool((bound < ulp(gold, BF16)).all()), name
            step = ulp(gold[i], BF16)
        off = got.to(F64)
        off[i] += step if off[i] >= gold[i] else -step
        with pytest.raises(AssertionError, match="outside the bound"):
            assert_within(off.to(got.dtype), gold, bound, name)
    assert coarse <= {"scale"}, coarse


# ---------------------------------------------------------------- (3) opcheck on the launch ops


def _grad_requiring(fn, example):
    """The example arguments with each floating tensor the op does not write requiring grad (opcheck's autograd
    registration check then runs on them)."""
    schema = fn.op._opoverload._schema
    written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    return tuple(v.detach().clone().requires_grad_(True)
                 if isinstance(v, torch.Tensor) and v.is_floating_point() and a.name not in written else v
                 for a, v in zip(schema.arguments, example))


@pytest.mark.parametrize("case", cases(lambda c: c.launch_ops is not None))
def test_launch_ops_pass_opcheck(case, one_thread):
    args, _ = _inputs(case, 2)
    launched = case.launch_ops(args)
    assert launched
    for label, fn, example in launched:
        torch.library.opcheck(fn.op, _grad_requiring(fn, example))


# ---------------------------------------------------------------- (4) batch invariance


@pytest.mark.parametrize("case", cases(lambda c: bool(c.rows)))
def test_rows_are_batch_invariant(case, one_thread):
    args, dys = _inputs(case, 3)
    assert_rows_invariant(case.call, args, dys, case.differentiable, case.rows, case.out_row_dim)


def test_final_adaln_out_passes_the_quick_invariance_protocol(one_thread):
    """adaln_lab.testing's helper (the seed's four checks) on norm_out, at a small width."""
    from adaln_lab import final_adaln_out
    from adaln_lab.testing import assert_batch_invariant

    report = assert_batch_invariant(final_adaln_out, device="cpu", quick=True, H=16, D=16)
    assert report["batch_invariant"]


def _off_in_a_batch(case, where: str):
    """case.call, wrong in a batch of more than one row: "output" adds an ulp to row 0 of the first output;
    "gradient" leaves the output's bits and scales row 0's gradient by 1 + 2^-4."""
    name, dim = next(iter(case.rows.items()))

    def call(args, backend="auto"):
        outs = list(as_tuple(case.call(args, backend)))
        if args[name].shape[dim] > 1:
            out = outs[0]
            mask = torch.zeros_like(out)
            slice_rows(mask, case.out_row_dim, range(0, 1)).fill_(1)
            if where == "output":
                outs[0] = out + mask * ulp(out.detach(), out.dtype).to(out.dtype)
            else:
                outs[0] = out + 2 ** -4 * mask * (out - out.detach())
        return tuple(outs) if len(outs) > 1 else outs[0]

    return call


@pytest.mark.parametrize("where", ["output", "gradient"])
@pytest.mark.parametrize("case", cases(lambda c: bool(c.rows)))
def test_planted_batch_dependence_fails_the_invariance_check(case, where, one_thread):
    args, dys = _inputs(case, 3)
    first = next(iter(case.rows))
    with pytest.raises(AssertionError, match=f"not batch-invariant.*{'output 0' if where == 'output' else first}"):
        assert_rows_invariant(_off_in_a_batch(case, where), args, dys, case.differentiable, case.rows,
                              case.out_row_dim)


def test_planted_batch_dependence_fails_the_quick_invariance_protocol(one_thread):
    from adaln_lab.testing import assert_batch_invariant

    wrong = _off_in_a_batch(dataclasses.replace(CASES["final_adaln_out"], rows={"x": -2}), "output")

    def fn(x, norm_weight, temb, weight, bias, timestep_indices):
        return wrong(dict(x=x, norm_weight=norm_weight, temb=temb, weight=weight, bias=bias,
                          timestep_indices=timestep_indices, eps=1e-5))

    with pytest.raises(AssertionError, match="is not batch-invariant"):
        assert_batch_invariant(fn, device="cpu", quick=True, H=16, D=16)


# ---------------------------------------------------------------- (5) bad inputs


@pytest.mark.parametrize("case,bad", bad_input_params())
def test_bad_input_raises_an_error_naming_the_argument(case, bad, one_thread):
    """One line, the argument named, no chained traceback (a user mistake)."""
    args, _ = _inputs(case, 4)
    with pytest.raises(bad.error) as info:
        call_with(case, bad.change(args))
    message = str(info.value)
    assert names_argument(message, bad.argument), message
    assert "\n" not in message and info.value.__cause__ is None, message


# ---------------------------------------------------------------- (6) the one rule


@pytest.mark.parametrize("case", cases(lambda c: c.asks_the_rule))
def test_every_op_asks_the_one_rule(case, monkeypatch, one_thread):
    """backend "cupy" raises the rule's very refusal; backend "auto" on CPU tensors falls back to the torch code
    without a warning: the bits of the unpatched call."""
    args, dys = _inputs(case, 5)
    unpatched = run(case.call, args, dys, case.differentiable)
    planted = ValueError("planted refusal")
    plant_refusal(monkeypatch, planted)
    with pytest.raises(ValueError, match="planted refusal") as info:
        case.call(args, "cupy")
    assert info.value is planted
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_results_equal(run(case.call, args, dys, case.differentiable), unpatched, f"{case.name} auto")


def _tiny_modules(backend, device="cpu", dtype=torch.float32):
    """(AdaLNOut, AdaLNTransformerBlock, their diffusers modules, their inputs) of adaln_lab.testing's tiny
    MiniMax-H3 model."""
    pytest.importorskip("diffusers", reason="the test extra brings diffusers 0.42")
    from adaln_lab import AdaLNOut, AdaLNTransformerBlock
    from adaln_lab.testing import h3_inputs, h3_model

    model = h3_model().to(device=device, dtype=dtype)
    inputs = h3_inputs(model, (3, 4, 2), 1, positions=8)
    with torch.no_grad():
        temb = model.time_embedder(model.time_proj(inputs["timestep"].to(device)).to(dtype)).float()
    S = inputs["token_tags"].shape[0]
    x = torch.randn(1, S, model.config.hidden_size, generator=torch.Generator().manual_seed(2)).to(device, dtype)
    idx = inputs["timestep_indices"].to(device)
    rotary = tuple(t.to(device) for t in model.rope(inputs["position_ids"].to(device)))
    norm_out, block = model.norm_out, model.transformer_blocks[0]
    ours = (AdaLNOut.from_diffusers(norm_out, backend=backend),
            AdaLNTransformerBlock.from_diffusers(block, backend=backend))
    calls = ((x, temb, idx), (x, temb, idx * 3 + inputs["token_tags"].to(device), rotary))
    return ours, (norm_out, block), calls


def test_the_one_rule_decides_the_modules(monkeypatch, one_thread):
    """AdaLNOut and AdaLNTransformerBlock with backend "cupy" raise the planted refusal; with "auto" on CPU tensors
    they run silently, diffusers' forward bit for bit."""
    ours, theirs, calls = _tiny_modules("cupy")
    planted = ValueError("planted refusal")
    plant_refusal(monkeypatch, planted)
    for module, args in zip(ours, calls):
        with pytest.raises(ValueError, match="planted refusal") as info, torch.no_grad():
            module(*args)
        assert info.value is planted, type(module).__name__
    for module, diffusers_module, args in zip(ours, theirs, calls):
        module.backend = "auto"
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("error")
            assert_same_bits(module(*args), diffusers_module(*args), type(module).__name__)


# ---------------------------------------------------------------- GPU: the kernels (backend "cupy")

GPU = Shape(S=300, H=256, D=128, T=3)


def _cupy(case):
    return lambda args: case.call(args, "cupy")


def _ulp_parity(out, want):
    """tests/ops/test_final_adaln_out.py's bound of the default table: >= 99.9 % of the elements bitwise the
    replay's, >= 99.98 % within one ulp."""
    ulps = ulp_distance(out, want)
    assert (ulps == 0).double().mean().item() >= 0.999
    assert (ulps <= 1).double().mean().item() >= 0.9998


def _norm_parity(out, want):
    """tests/ops/test_modulated_rms_norm.py's bound: >= 99.99 % bitwise, at most 2 bf16 ulps of the output's
    scale."""
    assert (out == want).float().mean().item() >= 0.9999
    assert (out.float() - want.float()).abs().max().item() <= 2 * float(ulp(want.abs().max(), BF16))


def _table_parity(out, want):
    """tests/ops/test_modulation_table.py's bound: table.cu equals cuBLAS's table on >= 99.9 % of the entries."""
    assert (out == want).float().mean().item() >= 0.999


def _bitwise(out, want):
    assert_same_bits(out, want, "kernels vs replay")


# Each op at its own GPU test's shapes and inputs, held to its bound, output by output: tests/ops/
# test_final_adaln_out.py (the harness's inputs, S 777 at three widths), test_modulation_table.py (T 3, H 256,
# D 128), the row ops' (S 2048, H 1024, D 256; chunks of a real table).
# gated_residual_norm's kernels give the two ops' bits (test_gated_residual_norm.py): x_out the gated residual's
# (bitwise the replay), out the norm's on that very x_out. block_adaln_path: no forward bound is stated (the norms'
# differences travel through attn and ff); its kernels are held to repeatability, graphs, streams below.
_ROWS = Shape(S=2048, H=1024, D=256, T=3, lead=())
PARITY = {
    "final_adaln_out": ([Shape(S=777, H=5376, D=2688, T=3, lead=()), Shape(S=777, H=264, D=64, T=1, lead=()),
                         Shape(S=777, H=1024, D=256, T=8, lead=())], (_ulp_parity,)),
    "modulation_table": ([Shape(S=1, H=256, D=128, T=2, lead=())], (_table_parity,)),  # T + 1 = 3 timesteps
    "modulated_rms_norm": ([_ROWS], (_norm_parity,)),
    "modulated_rms_norm_and_residual": ([_ROWS], (_norm_parity, _bitwise)),
    "gated_residual": ([_ROWS], (_bitwise,)),
    "gated_residual_norm": ([_ROWS], (_bitwise, _norm_parity)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", cases(lambda c: c.name in PARITY))
def test_gpu_kernels_against_the_replay_on_the_same_gpu(case):
    shapes, checks = PARITY[case.name]
    for shape in shapes:
        if case.name == "final_adaln_out":
            inputs = harness_inputs(1, shape.S, "cuda", H=shape.H, D=shape.D, T=shape.T)
            args = dict(zip(("x", "norm_weight", "temb", "weight", "bias", "timestep_indices"), inputs.args),
                        eps=1e-5)
        else:
            args, _ = _inputs(case, 6, shape, "cuda")
        with torch.no_grad():
            outs, want = as_tuple(case.call(args, "cupy")), as_tuple(case.replay(args))
        assert len(outs) == len(want) == len(checks)
        for check, out, ref in zip(checks, outs, want):
            assert out.shape == ref.shape and out.dtype == ref.dtype
            check(out, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("case", cases(lambda c: c.asks_the_rule))
def test_gpu_gradients_repeat_bit_for_bit(case):
    args, dys = _inputs(case, 7, GPU, "cuda")
    first = run(_cupy(case), args, dys, case.differentiable)
    assert_results_equal(run(_cupy(case), args, dys, case.differentiable), first, f"{case.name} run twice")


@pytest.mark.gpu
@pytest.mark.parametrize("case", cases(lambda c: c.asks_the_rule))
def test_gpu_cuda_graph_replay_equals_eager(case):
    """One CUDA graph of forward and backward (warmed up on a side stream first), replayed: eager's bits."""
    args, dys = _inputs(case, 8, GPU, "cuda")
    eager = run(_cupy(case), args, dys, case.differentiable)
    live = {**args, **{n: args[n].detach().clone().requires_grad_(True) for n in case.differentiable}}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            run(_cupy(case), args, dys, case.differentiable)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = as_tuple(case.call(live, "cupy"))
        grads = torch.autograd.grad(outs, [live[n] for n in case.differentiable], list(dys))
    for _ in range(2):
        graph.replay()
    torch.cuda.synchronize()
    assert_results_equal((tuple(o.detach() for o in outs), dict(zip(case.differentiable, grads))), eager,
                         f"{case.name} CUDA graph")


@pytest.mark.gpu
@pytest.mark.parametrize("case", cases(lambda c: c.asks_the_rule and bool(c.rows) and c.name != "modulation_table"))
def test_gpu_empty_batch(case):
    """S = 0: empty outputs and row gradients, every other gradient zero (nothing summed)."""
    args, dys = _inputs(case, 9, dataclasses.replace(GPU, S=0), "cuda")
    outs, grads = run(_cupy(case), args, dys, case.differentiable)
    x = args["x"]
    for out in outs:
        assert out.shape == x.shape and out.numel() == 0
    for name in case.differentiable:
        g = grads[name]
        assert g.shape == args[name].shape, name
        if name not in case.rows:
            assert torch.count_nonzero(g) == 0 and bool(torch.isfinite(g.float()).all()), name


@pytest.mark.gpu
@pytest.mark.parametrize("case", cases(lambda c: c.asks_the_rule))
def test_gpu_side_stream_gives_the_same_bits(case):
    """The launches follow torch's current stream: a busy side stream (a sleep queued first) gives the default
    stream's bits."""
    args, dys = _inputs(case, 10, GPU, "cuda")
    want = run(_cupy(case), args, dys, case.differentiable)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.cuda._sleep(10_000_000)  # a launch on another stream would run before this
        got = run(_cupy(case), args, dys, case.differentiable)
    stream.synchronize()
    assert_results_equal(got, want, f"{case.name} on a side stream")


@pytest.mark.gpu
@pytest.mark.parametrize("case", cases(lambda c: bool(c.rows) and c.asks_the_rule))
def test_gpu_rows_are_batch_invariant(case):
    args, dys = _inputs(case, 3, device="cuda")
    assert_rows_invariant(_cupy(case), args, dys, case.differentiable, case.rows, case.out_row_dim)


@pytest.mark.gpu
@pytest.mark.parametrize("case", cases(lambda c: c.asks_the_rule))
def test_gpu_the_one_rule_makes_auto_warn_and_fall_back(case, monkeypatch):
    """On CUDA tensors the kernels take, a planted refusal: backend "auto" warns KernelFallbackWarning naming it
    and runs the torch code (the replay's forward); backend "cupy" raises it."""
    args, _ = _inputs(case, 11, GPU, "cuda")
    planted = ValueError("planted refusal")
    plant_refusal(monkeypatch, planted)
    with pytest.raises(ValueError, match="planted refusal"), torch.no_grad():
        case.call(args, "cupy")
    with pytest.warns(KernelFallbackWarning, match="planted refusal"), torch.no_grad():
        outs = as_tuple(case.call(args, "auto"))
    with torch.no_grad():
        for i, (out, want) in enumerate(zip(outs, as_tuple(case.replay(args)))):
            assert_same_bits(out, want, f"{case.name} output {i}")


@pytest.mark.gpu
def test_gpu_the_one_rule_makes_the_modules_warn(monkeypatch):
    ours, _, calls = _tiny_modules("auto", "cuda", BF16)
    plant_refusal(monkeypatch, ValueError("planted refusal"))
    for module, args in zip(ours, calls):
        with pytest.warns(KernelFallbackWarning, match="planted refusal"), torch.no_grad():
            module(*args)
