"""`adaln_lab.ops.final_adaln_out` (MiniMax-H3's norm_out as one op) and its layers.

CPU: the launch ops (`launch.forward` / `launch.backward`, `torch.ops.adaln_lab.final_adaln_out_fwd` / `_bwd`,
writing caller-allocated outputs): registration, no-op fake kernels, opcheck, and the one autograd node
`FinalAdaLNOut` on them, eager and under torch.compile(fullgraph=True) (on CPU tensors the launch bodies are the
replay forward and the analytic backward, so CI checks every layer but the CUDA kernels themselves).
GPU (`gpu` mark; kernels_cu through `FinalAdaLNOut` and the launch ops): parity with diffusers, accuracy,
invariance, empty batches, errors, streams, torch.compile, CUDA graphs and opcheck.
"""

import pytest
import torch

from adaln_lab import final_adaln_out
from adaln_lab.core.library import apply
from adaln_lab.core.plan import forward_bytes, forward_workspace
from adaln_lab.harness import invariance
from adaln_lab.harness.accuracy import SEED_GRAD_BOUNDS, accuracy, parity
from adaln_lab.harness.candidates import adaln_lab_candidate, diffusers_candidate
from adaln_lab.harness.inputs import make, upstream
from adaln_lab.ops.final_adaln_out import launch
from adaln_lab.ops.final_adaln_out.op import FinalAdaLNOut
from adaln_lab.reference import replay

gpu = pytest.mark.gpu


# ---------------------------------------------------------------- CPU: the launch ops and the autograd node

SHAPE = dict(H=64, D=32, T=3)  # the CPU tests'


def _leaves(inputs):
    return [t.detach().clone().requires_grad_(True) for t in inputs.leaves]


def _workspace(x, T, D=SHAPE["D"]):
    """The forward workspace of x (..., S, H), T table rows and temb width D, as FinalAdaLNOut allocates it."""
    H = x.shape[-1]
    return torch.empty(forward_bytes(T, H, x.numel() // H, D), dtype=torch.uint8, device=x.device)


def _outputs(x, T, D=SHAPE["D"]):
    """(out, workspace) of launch.forward for x (..., S, H), T table rows and temb width D (out contiguous)."""
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), _workspace(x, T, D)


def _grad_outputs(x, norm_weight, temb, weight):
    """dx, d_norm_weight, d_temb, d_weight, d_bias of launch.backward, as FinalAdaLNOut allocates them."""
    return (torch.empty_like(x), torch.empty_like(norm_weight), torch.empty_like(temb), torch.empty_like(weight),
            weight.new_empty(weight.shape[:1]))


def _node(x, norm_weight, temb, weight, bias, timestep_indices, eps=1e-5):
    """The autograd node of route "cupy" (on CPU tensors: the launch bodies' reference) through core.library.apply:
    the C++ apply in eager code, Function.apply while torch.compile traces."""
    return apply(FinalAdaLNOut, x, norm_weight, temb, weight, bias, timestep_indices, float(eps), "cupy", "cuda")


def test_ops_are_registered_with_no_op_fake_kernels():
    """The launch ops are torch.ops.adaln_lab.final_adaln_out_fwd / _bwd; their fakes return nothing (the caller
    allocated every output), and the node allocates out (rows, H) and the workspace holding the bf16 table
    (T, 2H), table_f32 (T, 2H), rstd (rows,) and the table kernel's act scratch (T, D)."""
    assert hasattr(torch.ops.adaln_lab, "final_adaln_out_fwd")
    assert hasattr(torch.ops.adaln_lab, "final_adaln_out_bwd")
    inputs = make(1, 10, "cpu", **SHAPE)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in inputs.args]
        out, workspace = _outputs(fake[0], 3)
        assert torch.ops.adaln_lab.final_adaln_out_fwd(*fake, 1e-5, "cupy", "cuda", out, workspace) is None
        assert workspace.shape == (forward_workspace(3, 64, 10, 32)[1],) and workspace.dtype == torch.uint8
        table, table_f32, rstd = launch.saved_views(workspace, 3, 64, 10, 32)
        assert table.shape == (3, 128) and table.dtype == torch.bfloat16
        assert table_f32.shape == (3, 128) and table_f32.dtype == torch.float32
        assert rstd.shape == (10,) and rstd.dtype == torch.float32
        x, norm_weight, temb, weight, _, idx = fake
        grads = _grad_outputs(x, norm_weight, temb, weight)
        assert torch.ops.adaln_lab.final_adaln_out_bwd(out, x, norm_weight, temb, weight, idx, workspace, "cupy",
                                                       *grads) is None
        result = FinalAdaLNOut.apply(*fake, 1e-5, "cupy", "cuda")
        assert result.shape == (10, 64) and result.dtype == torch.bfloat16


@pytest.mark.parametrize("route", ["cupy", "torch"])
@pytest.mark.parametrize("rows", [0, 1, 37])
def test_opcheck_on_cpu(rows, route):
    inputs = make(2, rows, "cpu", **SHAPE)
    args = (*_leaves(inputs), inputs.timestep_indices, 1e-5, route, "cuda", *_outputs(inputs.x, 3))
    torch.library.opcheck(launch.forward.op, args)


def test_cpu_kernel_forward_is_the_replay_and_backward_is_close_to_autograd():
    inputs = make(3, 41, "cpu", **SHAPE)
    dy = upstream(3, inputs.x)
    ours = _leaves(inputs)
    out = FinalAdaLNOut.apply(*ours, inputs.timestep_indices, 1e-5, "cupy", "cuda")
    out.backward(dy)
    ref = _leaves(inputs)
    expected = replay(*ref, inputs.timestep_indices)
    expected.backward(dy)
    assert torch.equal(out, expected)
    for a, b in zip(ours, ref):
        scale = b.grad.double().abs().max()
        assert (a.grad.double() - b.grad.double()).abs().max() <= 0.05 * scale


def test_c_apply_gives_function_applys_outputs_and_gradients():
    """core.library.apply (the C++ apply in eager code) and FinalAdaLNOut.apply: the same bits, forward and
    backward."""
    inputs = make(8, 19, "cpu", **SHAPE)
    dy = upstream(8, inputs.x)
    results = []
    for call in (lambda *a: FinalAdaLNOut.apply(*a, 1e-5, "cupy", "cuda"), _node):
        leaves = _leaves(inputs)
        out = call(*leaves, inputs.timestep_indices)
        out.backward(dy)
        results.append([out.detach()] + [leaf.grad for leaf in leaves])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def _recording_backend(graphs):
    """aot_autograd whose forward and backward compilers note each graph's call targets (the graphs run as traced,
    as aot_eager's)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def record(gm, example_inputs):
        graphs.append([" ".join(map(str, (n.target, *n.args[:1]))) for n in gm.graph.nodes if n.op == "call_function"])
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=record, bw_compiler=record)


def test_compile_fullgraph_traces_the_op_forward_and_backward():
    """torch.compile with fullgraph=True raises on any graph break: the node's forward is one launch op
    (final_adaln_out_fwd) in the forward graph, its backward one (final_adaln_out_bwd) in the backward graph, and
    the compiled call equals the eager one bit for bit."""
    torch._dynamo.reset()
    inputs = make(4, 33, "cpu", **SHAPE)
    dy = upstream(4, inputs.x)

    def fn(x, norm_weight, temb, weight, bias, timestep_indices):
        return _node(x, norm_weight, temb, weight, bias, timestep_indices)

    eager = _leaves(inputs)
    out_eager = _node(*eager, inputs.timestep_indices)
    out_eager.backward(dy)
    graphs = []
    compiled = torch.compile(fn, fullgraph=True, backend=_recording_backend(graphs))
    leaves = _leaves(inputs)
    out = compiled(*leaves, inputs.timestep_indices)
    out.backward(dy)
    assert torch.equal(out, out_eager)
    for a, b in zip(leaves, eager):
        assert torch.equal(a.grad, b.grad)
    assert len(graphs) == 2
    for graph, name in zip(graphs, ("final_adaln_out_fwd", "final_adaln_out_bwd")):
        assert sum(f"adaln_lab.{name}.default" in call for call in graph) == 1, graph
        assert not any("adaln_lab." in call and name not in call for call in graph), graph


@pytest.mark.parametrize("route", ["cupy", "torch"])
def test_a_workspace_one_byte_short_is_refused(route):
    """On the CPU as on the kernels (whose check a GPU test sized the workspace for another D and met first)."""
    inputs = make(2, 5, "cpu", **SHAPE)
    out, workspace = _outputs(inputs.x, 3)
    with pytest.raises(ValueError, match=f"a workspace of {workspace.numel() - 1} bytes, the plan needs"):
        launch.forward(*inputs.args, 1e-5, route, "cuda", out, workspace[:-1])


def test_opcheck_of_the_backward_op_and_of_non_contiguous_inputs():
    """The backward op on its own (on the forward's workspace), and a permuted x written into a contiguous out:
    the values of the contiguous x."""
    inputs = make(5, 24, "cpu", **SHAPE)
    out, workspace = _outputs(inputs.x, 3)
    launch.forward(*inputs.args, 1e-5, "cupy", "cuda", out, workspace)
    dy = upstream(5, inputs.x)
    grads = _grad_outputs(inputs.x, inputs.norm_weight, inputs.temb, inputs.weight)
    torch.library.opcheck(launch.backward.op, (dy, inputs.x, inputs.norm_weight, inputs.temb, inputs.weight,
                                               inputs.timestep_indices, workspace, "cupy", *grads))
    x3 = inputs.x.view(4, 6, 64).transpose(0, 1)  # (6, 4, 64) with S = 4: non-contiguous
    assert not x3.is_contiguous()
    rest = [t.detach().clone().requires_grad_(True) for t in inputs.leaves[1:]]
    out3, workspace3 = _outputs(x3, 3)
    args = (x3, *rest, inputs.timestep_indices[:4], 1e-5, "cupy", "cuda", out3, workspace3)
    torch.library.opcheck(launch.forward.op, args)
    launch.forward(*args)
    dense, dense_workspace = _outputs(x3, 3)
    launch.forward(x3.contiguous(), *rest, inputs.timestep_indices[:4], 1e-5, "cupy", "cuda", dense, dense_workspace)
    assert out3.is_contiguous() and torch.equal(out3, dense)


def test_cpu_table_f32_is_the_unrounded_table():
    """table_f32 is the fp32 sum before the table's bf16 rounding, as table.cu gives it."""
    inputs = make(6, 3, "cpu", **SHAPE)
    out, workspace = _outputs(inputs.x, 3)
    launch.forward(*inputs.args, 1e-5, "cupy", "cuda", out, workspace)
    _, table_f32, rstd = launch.saved_views(workspace, 3, 64, 3, 32)
    act = torch.nn.functional.silu(inputs.temb).to(torch.bfloat16).double()
    exact = act @ inputs.weight.double().T + inputs.bias.double()
    assert (table_f32.double() - exact).abs().max() <= 1e-5 * exact.abs().max()
    assert not torch.equal(table_f32, table_f32.to(torch.bfloat16).float())


# ---------------------------------------------------------------- GPU: kernels_cu

SHAPES = [dict(H=5376, D=2688, T=3), dict(H=264, D=64, T=1), dict(H=1024, D=256, T=8), dict(H=1024, D=256, T=12),
          dict(H=5376, D=2688, T=32), dict(H=1024, D=256, T=64), dict(H=5376, D=2688, T=256),
          dict(H=1024, D=256, T=1024), dict(H=264, D=64, T=3072)]  # from T 12: the sorted row pass (plan.bwd_sorted);
# from T 64 row_order.cu's wide kernels (plan.row_order_wide); 3072: T_MAX


@gpu
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("table_backend", ["torch", "cuda"])
def test_forward_parity_with_diffusers(shape, table_backend):
    inputs = make(1, 777, "cuda", **shape)
    result = parity(adaln_lab_candidate(table_backend).fn, diffusers_candidate().fn, inputs)
    assert result["bitwise_equal_fraction"] >= (0.9999 if table_backend == "torch" else 0.999)
    assert result["within_1_ulp_fraction"] >= (0.99999 if table_backend == "torch" else 0.9998)


@gpu
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_gradients_beat_the_seed_bounds(shape):
    inputs = make(1, 1031, "cuda", **shape)
    acc = accuracy(adaln_lab_candidate().fn, inputs, upstream(1, inputs.x))
    for key, bound in SEED_GRAD_BOUNDS.items():  # the seed report's rl_kernel figures
        assert acc["grad_rel_err"][key] <= bound, (key, acc["grad_rel_err"][key])
    # d_bias is a bf16 output whose error is its own rounding: it must be the exact gradient
    # rounded once, which no implementation can beat on the same data
    assert acc["grad_correctly_rounded"]["b"] >= 0.999
    assert acc["fwd_rel_err"] <= 0.01


@gpu
@pytest.mark.parametrize("T", [3, 32])
def test_rows_invariant_and_params_repeat(T):
    fn = adaln_lab_candidate().fn
    shape = dict(H=5376, D=2688, T=T)
    rows = invariance.all_rows(fn, (33,), (3,), torch.device("cuda"), shape)
    assert rows["33"]["fwd_differ"] == 0 and rows["33"]["rowgrad_differ"] == 0
    sub = invariance.full_vs_sub_batches(fn, 3000, (1, 7, 1000), (3,), 1000, 256, torch.device("cuda"), shape)
    assert sub["fwd_differ"] == 0 and sub["rowgrad_differ"] == 0
    batch = make(3, 2049, "cuda", **shape)
    assert all(invariance.params_repeatable(fn, batch, upstream(3, batch.x)).values())


@gpu
def test_leading_dims_broadcast_like_diffusers():
    inputs = make(2, 96, "cuda", H=264, D=64, T=3)
    x = inputs.x.view(2, 48, 264)
    idx = inputs.timestep_indices[:48]
    args = (x, inputs.norm_weight, inputs.temb, inputs.weight, inputs.bias, idx)
    ours = final_adaln_out(*args, backend="cupy", table_backend="torch")
    ref = final_adaln_out(*args, backend="torch")
    assert ours.shape == ref.shape
    assert (ours.float() - ref.float()).abs().max() <= 0.02 * ref.float().abs().max()


@gpu
def test_cuda_op_errors():
    inputs = make(1, 8, "cuda", H=264, D=64, T=3)
    bad = inputs.timestep_indices.clone()
    bad[3] = 3
    with pytest.raises(IndexError, match="timestep_indices"):
        final_adaln_out(*inputs.leaves, bad, check_indices=True)
    with pytest.raises(TypeError, match="the CUDA kernels need x in bfloat16, got torch.float16"):
        final_adaln_out(inputs.x.half(), *inputs.leaves[1:], inputs.timestep_indices, backend="cupy")
    with pytest.raises(ValueError, match=r"the CUDA kernels need H \(x.shape\[-1\]\) divisible by 8, got 260"):
        odd = make(1, 8, "cuda", H=260, D=64, T=3)
        final_adaln_out(*odd.args, backend="cupy")


@gpu
def test_runs_on_torch_current_stream():
    inputs = make(1, 300, "cuda", H=264, D=64, T=3)
    expected = final_adaln_out(*inputs.args)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(10_000_000)  # keep the side stream busy: a launch on another stream would run first
        got = final_adaln_out(*inputs.args)
    stream.synchronize()
    assert torch.equal(got, expected)


def _grads(fn, inputs, dy):
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs.leaves]
    out = fn(*leaves, inputs.timestep_indices)
    out.backward(dy)
    return out.detach(), [leaf.grad for leaf in leaves]


@gpu
@pytest.mark.parametrize("shape", SHAPES[:2] + [dict(H=264, D=64, T=12)], ids=str)
def test_empty_batch_gives_an_empty_output_and_zero_gradients(shape):
    inputs = make(1, 0, "cuda", **shape)
    out, grads = _grads(adaln_lab_candidate().fn, inputs, torch.empty(0, shape["H"], dtype=torch.bfloat16, device="cuda"))
    assert out.shape == (0, shape["H"])
    assert grads[0].shape == (0, shape["H"])
    for g in grads[1:]:
        assert torch.count_nonzero(g) == 0 and bool(torch.isfinite(g.float()).all())


@gpu
@pytest.mark.parametrize("T", [3, 12])
def test_out_of_range_indices_give_nan_rows_without_a_host_sync(T):
    inputs = make(1, 64, "cuda", H=264, D=64, T=T)
    bad = inputs.timestep_indices.clone()
    bad[5], bad[9] = T, -1
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = final_adaln_out(*inputs.leaves, bad)  # the default call never waits on the GPU
    finally:
        torch.cuda.set_sync_debug_mode("default")
    nan_rows = torch.isnan(out.float()).all(dim=1)
    assert nan_rows[5] and nan_rows[9] and int(nan_rows.sum()) == 2


@gpu
def test_forward_backward_never_syncs_the_host():
    inputs = make(1, 300, "cuda", H=264, D=64, T=3)
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs.leaves]
    dy = upstream(1, inputs.x)
    final_adaln_out(*leaves, inputs.timestep_indices).backward(dy)  # compile and warm up first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        final_adaln_out(*leaves, inputs.timestep_indices).backward(dy)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@gpu
def test_cuda_graph_replay_equals_eager():
    inputs = make(1, 777, "cuda", H=264, D=64, T=3)
    dy = upstream(1, inputs.x)
    fn = adaln_lab_candidate().fn
    out_eager, grads_eager = _grads(fn, inputs, dy)
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs.leaves]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn(*leaves, inputs.timestep_indices).backward(dy)
    torch.cuda.current_stream().wait_stream(side)
    for leaf in leaves:
        leaf.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*leaves, inputs.timestep_indices)
        out.backward(dy)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, out_eager)
    for leaf, g in zip(leaves, grads_eager):
        assert torch.equal(leaf.grad, g)


@gpu
def test_torch_compile_fullgraph_equals_eager():
    inputs = make(1, 513, "cuda", H=264, D=64, T=3)
    dy = upstream(1, inputs.x)
    fn = adaln_lab_candidate().fn
    out_eager, grads_eager = _grads(fn, inputs, dy)
    compiled = torch.compile(fn, fullgraph=True)
    out, grads = _grads(compiled, inputs, dy)
    assert torch.equal(out, out_eager)
    for a, b in zip(grads, grads_eager):
        assert torch.equal(a, b)
    graphs = torch.compile(fn, fullgraph=True, mode="reduce-overhead")
    for _ in range(3):  # recorded, then replayed
        out, grads = _grads(graphs, inputs, dy)
        assert torch.equal(out, out_eager)
        for a, b in zip(grads, grads_eager):
            assert torch.equal(a, b)


@gpu
@pytest.mark.parametrize("table_backend", ["cuda", "torch"])
def test_custom_ops_pass_opcheck_on_cuda(table_backend):
    """The launch ops on the kernels (route "cupy" on CUDA tensors), the backward on the forward's workspace."""
    inputs = make(1, 65, "cuda", H=264, D=64, T=3)
    out, workspace = _outputs(inputs.x, 3, 64)
    args = (*_leaves(inputs), inputs.timestep_indices, 1e-5, "cupy", table_backend, out, workspace)
    torch.library.opcheck(launch.forward.op, args)
    launch.forward(*inputs.args, 1e-5, "cupy", table_backend, out, workspace)
    dy = upstream(1, inputs.x)
    grads = _grad_outputs(inputs.x, inputs.norm_weight, inputs.temb, inputs.weight)
    torch.library.opcheck(launch.backward.op, (dy, inputs.x, inputs.norm_weight, inputs.temb, inputs.weight,
                                               inputs.timestep_indices, workspace, "cupy", *grads))


def _cpu_call(fn, inputs, dy):
    leaves = _leaves(inputs)
    out = fn(*leaves, inputs.timestep_indices)
    out.backward(dy)
    return out, [leaf.grad for leaf in leaves]


def test_compile_fullgraph_on_cpu_tensors_forward_and_backward_equal_eager():
    """The default call on CPU tensors (the replay, indices checked) under torch.compile(fullgraph=True): no
    `.item()` while tracing (it would be a data-dependent guard, an error under fullgraph), and the traced
    forward and backward (aot_eager: the traced ops run as eager ones) equal eager bit for bit."""
    torch._dynamo.reset()
    inputs = make(3, 9, "cpu", **SHAPE)
    dy = upstream(3, inputs.x)
    out_eager, grads_eager = _cpu_call(final_adaln_out, inputs, dy)
    compiled = torch.compile(lambda *a: final_adaln_out(*a), fullgraph=True, backend="aot_eager")
    out, grads = _cpu_call(compiled, inputs, dy)
    assert torch.equal(out, out_eager)
    for a, b in zip(grads, grads_eager):
        assert torch.equal(a, b)


@pytest.mark.parametrize("bad", [-1, 3])
def test_bad_index_on_cpu_tensors_eager_unchecked_and_compiled(bad):
    """What a timestep index outside [0, T) = [0, 3) does on CPU tensors (the docstring's list): the default
    check raises IndexError naming the value; unchecked, the replay's index_select raises torch's IndexError;
    under torch.compile(fullgraph=True) the check is an assert inside the graph (RuntimeError), nothing read
    back while tracing."""
    torch._dynamo.reset()
    inputs = make(3, 9, "cpu", **SHAPE)
    indices = inputs.timestep_indices.clone()
    indices[4] = bad
    args = (*inputs.leaves, indices)
    with pytest.raises(IndexError, match=rf"timestep_indices holds {bad}, outside \[0, T\) = \[0, 3\)"):
        final_adaln_out(*args)
    with pytest.raises(IndexError, match="index out of range"):
        final_adaln_out(*args, check_indices=False)
    compiled = torch.compile(lambda *a: final_adaln_out(*a), fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(*inputs.leaves, inputs.timestep_indices), final_adaln_out(*inputs.args))
    with pytest.raises(RuntimeError, match=r"timestep_indices holds a value outside \[0, T\)"):
        compiled(*args)
