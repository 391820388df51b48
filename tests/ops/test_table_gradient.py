"""`adaln_lab.core.table_gradient`: a block's row ops hand the table from op to op (a "link" output each), and in
the backward the (T, 18H) table gradient goes back the same way, each op writing its chunks' columns, the first op
of the pass making the buffer (`for_op`, zeroing the chunks of the ops that did not run). Every gradient is bitwise
what the same ops give through autograd's chunk views (the ops composed one by one, `_chunked`), for a full backward
and for passes that stop short: a loss on norm1's output alone, on norm2's alone, two passes over one graph, a pass
that wants only the attention's parameter and then a full one; eager, compiled (fullgraph), under compiled autograd,
activation checkpointing and concurrent passes. Planted faults (a buffer not zeroed, kept from pass to pass, shared
by concurrent passes, a chunk written into the wrong columns) are caught. On the CPU (the torch code) and, on a
GPU, the kernels (their reduces writing with the table's stride); a recorder checks on the CPU that the kernels'
writes land in the chunks' columns and that the norms read the row tables the table kernel writes."""

import threading

import pytest
import torch

from adaln_lab import block_adaln_path, gated_residual, gated_residual_norm
from adaln_lab.core import launchers, support, table_gradient, tensors
from adaln_lab.core.table_gradient import CHUNKS, GATE_MLP, GATE_MSA, SHIFT_MLP, SHIFT_MSA
from adaln_lab.ops.gated_residual import launch as gated_residual_launch
from adaln_lab.ops.modulated_rms_norm import modulated_rms_norm_and_residual
from adaln_lab.ops.modulation_table import modulation_table
from adaln_lab.reference.block import CHUNKS as REFERENCE_CHUNKS
from adaln_lab.reference.block import table_chunks

from ..core.test_launchers import Recorder

H, D, T, S = 64, 32, 3, 37
EPS1, EPS2 = 1e-5, 1e-6


def _case(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    leaves = [(torch.randn(S, H, generator=g) * 2).bfloat16(), torch.randn(T, D, generator=g),
              (torch.randn(18 * H, D, generator=g) * D ** -0.5).bfloat16(),
              (torch.randn(18 * H, generator=g) * 0.02).bfloat16(),
              (0.5 + torch.rand(H, generator=g)).bfloat16(), (0.5 + torch.rand(H, generator=g)).bfloat16(),
              (1 + 0.1 * torch.randn(H, generator=g)).bfloat16()]  # the last: the attention's parameter
    row_index = torch.randint(0, 3 * T, (S,), generator=g)
    dy = torch.randn(S, H, generator=g).bfloat16()
    return [t.to(device) for t in leaves], row_index.to(device), dy.to(device)


def _chunked(x, temb, weight, bias, n1, n2, row_index, attn, ff, eps1, eps2, adapt_table=None):
    """The block as its public ops with autograd's chunk views of the table (no table gradient handed on)."""
    table = modulation_table(temb, weight, bias)
    if adapt_table is not None:
        table = adapt_table(table)
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = table_chunks(table, x.shape[-1])
    h, x = modulated_rms_norm_and_residual(x, n1, shift_msa, scale_msa, row_index, eps1, table_dtype=weight.dtype)
    x, h = gated_residual_norm(x, gate_msa, attn(h), n2, shift_mlp, scale_mlp, row_index, eps2,
                               table_dtype=weight.dtype)
    return gated_residual(x, gate_mlp, ff(h), row_index, table_dtype=weight.dtype)


def _run(path, passes, device):
    """Gradients of every leaf after `passes` (callables of (out, seen, leaves)), each leaf's .grad (None as zeros)."""
    leaves, row_index, dy = _case(device)
    leaves = [t.requires_grad_(True) for t in leaves]
    x, temb, weight, bias, n1, n2, p = leaves
    seen = {}

    def attn(h):
        seen["h"] = h
        return h * p

    def ff(h):
        seen["h2"] = h
        return h * 0.5

    out = path(x, temb, weight, bias, n1, n2, row_index, attn, ff, EPS1, EPS2)
    found = [pass_(out, dy, seen, leaves) for pass_ in passes]
    return out.detach(), found, [t.grad for t in leaves]


def _full(out, dy, seen, leaves):
    out.backward(dy, retain_graph=True)


def _norm1_only(out, dy, seen, leaves):
    return torch.autograd.grad(seen["h"].float().square().sum(), leaves[:6], retain_graph=True, allow_unused=True)


def _norm2_only(out, dy, seen, leaves):
    return torch.autograd.grad(seen["h2"].float().sum(), leaves[:6], retain_graph=True, allow_unused=True)


def _attn_param_only(out, dy, seen, leaves):
    return torch.autograd.grad(out, [leaves[6]], dy, retain_graph=True)


SEQUENCES = {"full": [_full], "norm1 alone": [_norm1_only], "norm2 alone": [_norm2_only],
             "norm1 then full": [_norm1_only, _full], "full then norm1 alone": [_full, _norm1_only],
             "attention parameter then full": [_attn_param_only, _full],
             "full twice": [_full, _full]}


def _assert_same(a, b):
    if a is None or b is None:
        assert a is None and b is None
        return
    assert torch.equal(a, b), (a - b).abs().max()


def _check(device, sequence, path=block_adaln_path, same=_assert_same):
    ours = _run(path, SEQUENCES[sequence], device)
    theirs = _run(_chunked, SEQUENCES[sequence], device)
    _assert_same(ours[0], theirs[0])
    for mine, other in zip(ours[1], theirs[1]):
        for a, b in zip(mine or (), other or ()):
            same(a, b)
    for a, b in zip(ours[2], theirs[2]):
        same(a, b)


@pytest.mark.parametrize("sequence", SEQUENCES)
def test_gradients_are_the_chunk_views_bits(sequence):
    _check("cpu", sequence)


@pytest.mark.gpu
@pytest.mark.parametrize("sequence", SEQUENCES)
def test_cuda_gradients_are_the_chunk_views_bits(sequence):
    _check("cuda", sequence)


def test_for_op_columns_and_standalone():
    """for_op: the link's gradient itself where the ops after this one made the buffer, else a new (T, 18H) buffer
    of the table's dtype and device whose chunks from `end` on are zeros; columns: the (3T, 6H) view, row stride 6H;
    standalone: an op's own (R, width) buffer."""
    meta = (torch.Size((T, 18 * H)), torch.float32, torch.device("cpu"))
    link = torch.full((T, 18 * H), 7.0)
    assert table_gradient.for_op(link, meta, H, 2) is link
    for end in range(1, len(CHUNKS) + 1):
        buffer = table_gradient.for_op(None, meta, H, end)
        assert buffer.shape == (T, 18 * H) and buffer.dtype == torch.float32
        rows = buffer.view(3 * T, 6 * H)
        assert not rows[:, end * H:].any()  # the chunks of the ops after this one: zeros
    buffer = torch.arange(T * 18 * H, dtype=torch.float32).view(T, 18 * H)
    view = table_gradient.columns(buffer, H)
    assert view.shape == (3 * T, 6 * H) and view.stride() == (6 * H, 1) and view.data_ptr() == buffer.data_ptr()
    for chunk in range(len(CHUNKS)):  # chunk c of table row 3t + m: columns (6m + c) H of row t
        assert torch.equal(view[1::3, chunk * H:(chunk + 1) * H], buffer[:, (6 + chunk) * H:(7 + chunk) * H])
    own = table_gradient.standalone(3 * T, 2 * H, torch.bfloat16, torch.device("cpu"))
    assert own.shape == (3 * T, 2 * H) and own.dtype == torch.bfloat16
    assert CHUNKS == REFERENCE_CHUNKS
    assert (CHUNKS[SHIFT_MSA], CHUNKS[GATE_MSA], CHUNKS[SHIFT_MLP], CHUNKS[GATE_MLP]) == (
        "shift_msa", "gate_msa", "shift_mlp", "gate_mlp")


def test_a_planted_unzeroed_buffer_is_caught(monkeypatch):
    """The checker itself: a for_op that does not zero the chunks of the ops that did not run (its new buffer NaN,
    as uninitialised memory may be) hands "norm1 alone" and "norm2 alone" garbage in those chunks; a full pass,
    where the first op to run writes the last chunk, needs no zeros and still passes."""
    def no_zeroing(d_link, table, hidden_size, end, partials=0):
        if d_link is not None:
            return d_link
        shape, dtype, device = table
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(table_gradient, "for_op", no_zeroing)
    _check("cpu", "full")
    for sequence in ("norm1 alone", "norm2 alone"):
        with pytest.raises(AssertionError):
            _check("cpu", sequence)


def test_a_planted_stale_buffer_is_caught(monkeypatch):
    """The checker itself: a for_op that keeps one buffer from one pass to the next and zeroes it only when made
    hands "full then norm1 alone" the first pass's columns where the second must have zeros."""
    kept = {}

    def stale(d_link, table, hidden_size, end, partials=0):
        if d_link is not None:
            return d_link
        if "buffer" not in kept:
            kept["buffer"] = torch.zeros(table[0], dtype=table[1], device=table[2])
        return kept["buffer"]

    monkeypatch.setattr(table_gradient, "for_op", stale)
    _check("cpu", "norm1 alone")  # one pass: no stale state to find
    kept.clear()
    with pytest.raises(AssertionError):
        _check("cpu", "full then norm1 alone")


def _plant_wrong_column(monkeypatch):
    """A gated residual's backward launch writing d_gate one chunk to the left where it writes into a block's table
    gradient (column > 0; the standalone ops, column 0, untouched): gate_msa's and gate_mlp's columns are left
    unwritten."""
    original = gated_residual_launch.backward

    def one_chunk_left(dout, gate, y, row_index, order, table_dtype, route, d_y, d_table, column, partials=None):
        shifted = column - gate.shape[1] if column > 0 else column
        original(dout, gate, y, row_index, order, table_dtype, route, d_y, d_table, shifted, partials)

    monkeypatch.setattr(gated_residual_launch, "backward", one_chunk_left)


def _poison_new_buffers(monkeypatch):
    """for_op's new buffers NaN in the chunks the ops must write (uninitialised memory, which otherwise may hold the
    right values: the CPU allocator hands back the buffer a previous run just freed, so columns a planted fault
    leaves unwritten could still read right)."""
    original = table_gradient.for_op

    def poisoned(d_link, table, hidden_size, end, partials=0):
        buffer = original(d_link, table, hidden_size, end, partials)
        if d_link is None:
            buffer.view(-1, len(CHUNKS) * hidden_size)[:, :end * hidden_size].fill_(float("nan"))
        return buffer

    monkeypatch.setattr(table_gradient, "for_op", poisoned)


def test_a_planted_wrong_column_is_caught(monkeypatch):
    _poison_new_buffers(monkeypatch)
    _check("cpu", "full")
    _plant_wrong_column(monkeypatch)
    with pytest.raises(AssertionError):
        _check("cpu", "full")


def _recorded_block(monkeypatch):
    """The CUDA glue on CPU tensors with a recorder for each kernel (a block at H 1024, backend "cupy"): the
    (name, arguments) of the forward's launches and of the backward's."""
    recorded = []
    monkeypatch.setattr(launchers, "kernels",
                        lambda device, plan: {n: Recorder(n, recorded) for n in launchers.SIGNATURES})
    monkeypatch.setattr(launchers, "bind", lambda device: None)
    monkeypatch.setattr(tensors, "current_stream", lambda device: 0)
    monkeypatch.setattr(support, "_not_cuda", lambda name, t: None)
    tensors.context.cache_clear()
    try:
        H_, D_ = 1024, 256
        g = torch.Generator().manual_seed(0)
        x = torch.randn(S, H_, generator=g).bfloat16().requires_grad_(True)
        temb = torch.randn(T, D_, generator=g).requires_grad_(True)
        weight = (torch.randn(18 * H_, D_, generator=g) * 0.02).bfloat16().requires_grad_(True)
        bias = torch.zeros(18 * H_).bfloat16().requires_grad_(True)
        n1, n2 = (torch.ones(H_).bfloat16().requires_grad_(True) for _ in range(2))
        row_index = torch.randint(0, 3 * T, (S,), generator=g)
        out = block_adaln_path(x, temb, weight, bias, n1, n2, row_index, lambda h: h, lambda h: h, backend="cupy")
        forward = [(c[0], c[4]) for c in recorded]
        recorded.clear()
        out.backward(torch.ones_like(out))
    finally:
        tensors.context.cache_clear()
    return H_, forward, [(c[0], c[4]) for c in recorded]


def _check_recorded(H_, forward, calls):
    # the forward: the table kernel's bf16 output is the two row tables, which norm1 and norm2 read
    launched = dict(forward)
    rows_bf16 = launched["table_bf16"][3]
    norm1 = next(args for name, args in forward if name.startswith("norm_modulate"))
    assert norm1[2] == rows_bf16 and launched["gated_residual_norm_bf16"][5] == rows_bf16 + 3 * T * 2 * H_ * 2
    # the table kernel's act scratch right after the two row tables, in their allocation
    assert launched["table_act"][1] == launched["table_bf16"][0] == rows_bf16 + 2 * 3 * T * 2 * H_ * 2
    f32 = 4
    d_table = next(args[0] for name, args in calls if name.startswith("table_bwd") and name != "table_bwd_reduce")
    writes = [(name, args) for name, args in calls
              if name in ("reduce_partials_sorted_bf16", "gated_residual_reduce_sorted")]
    found = {}
    for name, args in writes:
        if name == "reduce_partials_sorted_bf16":  # d_shift, d_scale pointers 4th and 5th, d_stride last
            found[(args[3] - d_table) // (f32 * H_)] = args[-1]
            found[(args[4] - d_table) // (f32 * H_)] = args[-1]
        else:  # d_gate 2nd, d_stride last
            found[(args[1] - d_table) // (f32 * H_)] = args[-1]
    assert len(writes) == 4  # norm1's, gated_residual_norm's two (norm, gate), gated_residual's
    assert found == {chunk: 6 * H_ for chunk in range(len(CHUNKS))}  # all six chunks, each with the row stride 6H
    # each of the four row passes' partials is what its reduce reads
    partials_at = {"norm_modulate_bwd_sorted_bf16": 8, "norm_modulate_bwd_residual_sorted_bf16": 9,
                   "gated_residual_bwd_sorted_bf16": 6}
    passes = [args[partials_at[name]] for name, args in calls if name in partials_at]
    reads = [args[0] for name, args in calls if name in ("reduce_partials_sorted_bf16", "gated_residual_reduce_sorted")]
    assert len(passes) == 4 and passes == reads
    # all four in one scratch after the table in the table gradient's allocation (one allocation for both)
    assert set(passes) == {d_table + T * 18 * H_ * f32}


def test_the_kernels_read_the_row_tables_and_write_the_chunks_columns(monkeypatch):
    """The CUDA glue on CPU tensors with a recorder for each kernel: the forward's norms read the row tables the
    table kernel writes; the three row ops' reduces get the table gradient's columns of their chunks with the row
    stride 6H, and table_bwd reads that buffer, whose allocation also holds the four passes' partials."""
    _check_recorded(*_recorded_block(monkeypatch))


def test_a_planted_wrong_column_is_caught_in_the_kernels_arguments(monkeypatch):
    _plant_wrong_column(monkeypatch)
    with pytest.raises(AssertionError):
        _check_recorded(*_recorded_block(monkeypatch))


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_gives_the_same_bits(reentrant):
    """Under torch.utils.checkpoint (diffusers' gradient checkpointing) the block recomputes its forward in the
    backward (reentrant: a nested backward pass of its own): every gradient is the plain run's."""
    from torch.utils.checkpoint import checkpoint

    def checkpointed(*args):
        return checkpoint(block_adaln_path, *args, use_reentrant=reentrant)

    plain = _run(block_adaln_path, [_full], "cpu")
    again = _run(checkpointed, [_full], "cpu")
    _assert_same(plain[0], again[0])
    for a, b in zip(plain[2], again[2]):
        _assert_same(a, b)


def test_compiled_autograd_gives_the_same_bits():
    """An eager forward whose backward compiled autograd traces: the buffer goes from op to op as a traced value
    (the launch ops opaque nodes writing its columns), and every gradient is the plain run's."""
    compiled_autograd = pytest.importorskip("torch._dynamo.compiled_autograd")
    from torch._dynamo.utils import counters

    captures = counters["compiled_autograd"]["captures"]

    def traced(out, dy, seen, leaves):
        with compiled_autograd._enable(torch.compile(backend="eager")):
            out.backward(dy)

    plain = _run(block_adaln_path, [_full], "cpu")
    again = _run(block_adaln_path, [traced], "cpu")
    assert counters["compiled_autograd"]["captures"] > captures  # the backward was traced
    for a, b in zip(plain[2], again[2]):
        _assert_same(a, b)


@pytest.mark.parametrize("sequence", ["full", "norm1 alone", "norm2 alone", "full then norm1 alone"])
def test_compiled_block_gives_the_chunk_views_bits(sequence):
    """torch.compile(fullgraph=True) of the block (aot_eager: the same launch ops): the table gradient of each pass
    is the chunk views' bits, the passes that stop short included. (The compiled graph is one autograd node: a leaf
    it does not reach in a pass, norm2's weight for a loss on norm1's output, gets zeros where eager gives None.)"""
    def same_or_zeros(a, b):
        if (a is None) != (b is None):
            assert not (b if a is None else a).any()
            return
        _assert_same(a, b)

    _check("cpu", sequence, torch.compile(block_adaln_path, fullgraph=True, backend="aot_eager"), same_or_zeros)


def test_lora_adapt_table_gets_its_gradient():
    """A LoRA-style adapter on the table (the nn layer's `adapt_table`): its parameter's gradient and every other one
    are the chunk views' bits."""
    g = torch.Generator().manual_seed(5)
    down = (torch.randn(D, 4, generator=g) * 0.1).requires_grad_(True)
    up = (torch.randn(4, 18 * H, generator=g) * 0.1).requires_grad_(True)

    def run(path, **adapt):
        leaves, row_index, dy = _case("cpu")
        leaves = [t.requires_grad_(True) for t in leaves[:6]]
        x, temb, weight, bias, n1, n2 = leaves
        for p in (down, up):
            p.grad = None

        def adapt_table(table):
            return table + (temb @ down @ up)

        out = path(x, temb, weight, bias, n1, n2, row_index, lambda h: h * 1.5, lambda h: h * 0.5, EPS1, EPS2,
                   adapt_table=adapt_table)
        out.backward(dy)
        return [t.grad for t in leaves] + [down.grad.clone(), up.grad.clone()]

    for a, b in zip(run(block_adaln_path), run(_chunked)):
        _assert_same(a, b)


def test_concurrent_passes_over_one_graph_keep_their_own_buffers():
    """Two threads taking gradients of one graph at once (retain_graph), each with an upstream gradient of its own:
    each pass has its own buffer, so every pass gives the single-threaded bits."""
    _concurrent_passes()


def test_a_planted_shared_buffer_is_caught(monkeypatch):
    """The checker itself: a for_op that hands every pass one buffer (zeroing the right chunks, so one pass after
    another still gets the right bits) fails the concurrent passes: one thread's columns in another's gradient."""
    kept = {}

    def shared(d_link, table, hidden_size, end, partials=0):
        if d_link is not None:
            return d_link
        if "buffer" not in kept:
            kept["buffer"] = torch.empty(table[0], dtype=table[1], device=table[2])
        kept["buffer"].view(-1, len(CHUNKS) * hidden_size)[:, end * hidden_size:].zero_()
        return kept["buffer"]

    monkeypatch.setattr(table_gradient, "for_op", shared)
    _check("cpu", "full then norm1 alone")  # one pass after another: the right bits
    with pytest.raises(AssertionError):
        _concurrent_passes()


def _concurrent_passes(rounds=10):
    """Two threads, `rounds` passes each over one graph, thread i with upstream gradient dys[i]. A barrier in the
    backward (a hook on the gradient of ff's input: after gated_residual's backward wrote its chunk, before the
    ops before it run) holds each pass until the other thread's pass reaches it, so the two overlap every round."""
    leaves, row_index, dy = _case("cpu")
    leaves = [t.requires_grad_(True) for t in leaves]
    x, temb, weight, bias, n1, n2, p = leaves
    barrier, together = threading.Barrier(2, timeout=60), {"on": False}

    def meet(grad):
        if together["on"]:
            barrier.wait()

    def ff(h):
        h.register_hook(meet)
        return h * 0.5

    out = block_adaln_path(x, temb, weight, bias, n1, n2, row_index, lambda h: h * p, ff, EPS1, EPS2)
    dys = (dy, torch.randn(dy.shape, generator=torch.Generator().manual_seed(11)).bfloat16())
    expected = [torch.autograd.grad(out, leaves[:6], d, retain_graph=True) for d in dys]
    found, errors = ([], []), []

    def passes(i):
        try:
            for _ in range(rounds):
                found[i].append(torch.autograd.grad(out, leaves[:6], dys[i], retain_graph=True))
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)
            barrier.abort()

    together["on"] = True
    threads = [threading.Thread(target=passes, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and [len(f) for f in found] == [rounds, rounds]
    for i in range(2):
        for grads in found[i]:
            for a, b in zip(grads, expected[i]):
                _assert_same(a, b)


def test_the_row_partials_come_only_from_a_buffer_for_op_made_with_them():
    """partials_of: the scratch for_op put after a buffer it made (`partials` floats, right after the table), and
    None for any other tensor, a view of a larger allocation included (its tail may hold live data)."""
    H_ = 8
    meta = (torch.Size((3, 18 * H_)), torch.float32, torch.device("cpu"))
    buffer = table_gradient.for_op(None, meta, H_, len(CHUNKS), 100)
    scratch = table_gradient.partials_of(buffer)
    assert scratch.numel() == 100 and scratch.data_ptr() == buffer.data_ptr() + 4 * buffer.numel()
    larger = torch.zeros(3 * 18 * H_ + 100)
    assert table_gradient.partials_of(larger[:3 * 18 * H_].view(3, 18 * H_)) is None
    assert table_gradient.partials_of(buffer + 0) is None  # a gradient autograd summed
    assert table_gradient.partials_of(table_gradient.for_op(None, meta, H_, len(CHUNKS))) is None
