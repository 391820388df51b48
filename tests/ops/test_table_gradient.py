"""`adaln_lab.ops.table_gradient`: a block's row ops write their chunks' gradients into one table gradient, which
norm1's op returns. Every gradient is bitwise what the same ops give through autograd's chunk views (the ops
composed one by one, `_chunked`), for a full backward and for passes that stop short: a loss on norm1's output
alone, on norm2's alone, two passes over one graph, a pass that wants only the attention's parameter and then a
full one. On the CPU (the torch code) and, on a GPU, the kernels (their reduces writing with the table's stride);
a recorder checks on the CPU that the kernels' writes land in the chunks' columns."""

import pytest
import torch

from adaln_lab import block_adaln_path, gated_residual, gated_residual_norm
from adaln_lab.ops.modulated_rms_norm import modulated_rms_norm_and_residual
from adaln_lab.core import launchers, tensors
from adaln_lab.ops.modulation_table import modulation_table
from adaln_lab.ops.table_gradient import GATE_MLP, GATE_MSA, SHIFT_MSA, TableGradient
from adaln_lab.reference.block import CHUNKS, table_chunks

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
    """The block as its public ops with autograd's chunk views of the table (no TableGradient)."""
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


def _check(device, sequence):
    ours = _run(block_adaln_path, SEQUENCES[sequence], device)
    theirs = _run(_chunked, SEQUENCES[sequence], device)
    _assert_same(ours[0], theirs[0])
    for mine, other in zip(ours[1], theirs[1]):
        for a, b in zip(mine or (), other or ()):
            _assert_same(a, b)
    for a, b in zip(ours[2], theirs[2]):
        _assert_same(a, b)


@pytest.mark.parametrize("sequence", SEQUENCES)
def test_gradients_are_the_chunk_views_bits(sequence):
    _check("cpu", sequence)


@pytest.mark.gpu
@pytest.mark.parametrize("sequence", SEQUENCES)
def test_cuda_gradients_are_the_chunk_views_bits(sequence):
    _check("cuda", sequence)


def test_columns_pointer_and_take():
    table = torch.zeros(T, 18 * H)
    grad = TableGradient(table, H)
    grad.write(GATE_MSA, torch.full((3 * T, H), 2.0), torch.full((3 * T, H), 3.0), torch.full((3 * T, H), 4.0))
    address, stride = grad.pointer(GATE_MLP, 1)
    assert stride == 6 * H and address == grad.columns(GATE_MLP, 1).data_ptr()
    grad.columns(GATE_MLP, 1).fill_(5.0)
    taken = grad.take().view(3 * T, 6 * H)
    expected = [0.0, 0.0, 2.0, 3.0, 4.0, 5.0]  # shift_msa and scale_msa were not written: zeros
    for chunk, value in enumerate(expected):
        assert torch.equal(taken[:, chunk * H:(chunk + 1) * H], torch.full((3 * T, H), value)), CHUNKS[chunk]
    with pytest.raises(RuntimeError, match="before any columns"):
        grad.take()  # taken: the next pass starts a new buffer
    assert (CHUNKS[SHIFT_MSA], CHUNKS[GATE_MSA], CHUNKS[GATE_MLP]) == ("shift_msa", "gate_msa", "gate_mlp")


def test_a_planted_stale_column_is_caught(monkeypatch):
    """The checker itself: a TableGradient that keeps its buffer from one pass to the next (passes told apart by
    nothing, the buffer not forgotten when taken) hands "full then norm1 alone" the first pass's columns where the
    second must have zeros."""
    from adaln_lab.ops import table_gradient

    def take_keeping_the_buffer(self):
        buffer, written = self._passes[0]
        rows = buffer.view(-1, self.row_stride)
        for chunk in set(range(len(CHUNKS))) - written:
            rows[:, chunk * self.H:(chunk + 1) * self.H].zero_()
        return buffer

    monkeypatch.setattr(table_gradient, "_task_id", lambda: 0)
    monkeypatch.setattr(TableGradient, "take", take_keeping_the_buffer)
    _check("cpu", "norm1 alone")  # one pass: no stale state to find
    with pytest.raises(AssertionError):
        _check("cpu", "full then norm1 alone")


def test_the_kernels_read_the_row_tables_and_write_the_chunks_columns(monkeypatch):
    """The CUDA glue on CPU tensors with a recorder for each kernel: the forward's norms read the row tables the
    table kernel writes; the three row ops' reduces get the table gradient's columns of their chunks with the row
    stride 6H, and table_bwd reads that buffer."""
    recorded = []
    monkeypatch.setattr(launchers, "kernels",
                        lambda device, plan: {n: Recorder(n, recorded) for n in launchers.SIGNATURES})
    monkeypatch.setattr(launchers, "bind", lambda device: None)
    monkeypatch.setattr(tensors, "current_stream", lambda device: 0)
    monkeypatch.setattr(tensors, "current_device", lambda: -1)  # a CPU tensor's get_device()
    from adaln_lab.core import support

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
    calls = [(c[0], c[4]) for c in recorded]
    # the forward: the table kernel's bf16 output is the two row tables, which norm1 and norm2 read
    launched = dict(forward)
    rows_bf16 = launched["table_bf16"][3]
    norm1 = next(args for name, args in forward if name.startswith("norm_modulate"))
    assert norm1[2] == rows_bf16 and launched["gated_residual_norm_bf16"][5] == rows_bf16 + 3 * T * 2 * H_ * 2
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
    assert found == {chunk: 6 * H_ for chunk in range(len(CHUNKS))}  # all six chunks, each with the row stride 6H
    # the four row passes' partials lie in the same allocation, after the table gradient, one region each, and each
    # reduce reads what its row pass wrote
    partials_at = {"norm_modulate_bwd_sorted_bf16": 8, "norm_modulate_bwd_residual_sorted_bf16": 9,
                   "gated_residual_bwd_sorted_bf16": 6}
    passes = [(name, args[partials_at[name]]) for name, args in calls if name in partials_at]
    reads = [args[0] for name, args in calls if name in ("reduce_partials_sorted_bf16", "gated_residual_reduce_sorted")]
    assert [address for _, address in passes] == reads and len(set(reads)) == 4
    norm_floats, gate_floats = tensors.row_workspaces(x, 3 * T)
    regions = sorted((address, f32 * (gate_floats if name.startswith("gated") else norm_floats))
                     for name, address in passes)
    assert regions[0][0] == d_table + f32 * T * 18 * H_
    assert all(a + size == b for (a, size), (b, _) in zip(regions, regions[1:]))  # back to back, none overlapping


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
    """An eager forward whose backward compiled autograd traces: the ops then return their chunks' gradients as
    table-shaped tensors (no writes into the table gradient while traced), and every gradient is the plain run's."""
    compiled_autograd = pytest.importorskip("torch._dynamo.compiled_autograd")

    def traced(out, dy, seen, leaves):
        with compiled_autograd._enable(torch.compile(backend="eager")):
            out.backward(dy)

    plain = _run(block_adaln_path, [_full], "cpu")
    again = _run(block_adaln_path, [traced], "cpu")
    for a, b in zip(plain[2], again[2]):
        _assert_same(a, b)


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
    """Two threads taking gradients of one graph at once (retain_graph): each pass has its own buffer, so every pass
    gives the single-threaded bits."""
    _concurrent_passes()


def test_a_planted_shared_buffer_is_caught(monkeypatch):
    """The checker itself: with every pass given the same key (one buffer shared by the two threads' passes) the
    concurrent passes fail, by wrong bits or by a take that finds no buffer."""
    from adaln_lab.ops import table_gradient

    monkeypatch.setattr(table_gradient, "_task_id", lambda: 0)
    with pytest.raises(AssertionError):
        _concurrent_passes()


def _concurrent_passes():
    import threading

    leaves, row_index, dy = _case("cpu")
    leaves = [t.requires_grad_(True) for t in leaves]
    x, temb, weight, bias, n1, n2, p = leaves
    out = block_adaln_path(x, temb, weight, bias, n1, n2, row_index, lambda h: h * p, lambda h: h * 0.5, EPS1, EPS2)
    expected = torch.autograd.grad(out, leaves[:6], dy, retain_graph=True)
    found, errors = [], []

    def passes():
        try:
            for _ in range(20):
                found.append(torch.autograd.grad(out, leaves[:6], dy, retain_graph=True))
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=passes) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and len(found) == 40
    for grads in found:
        for a, b in zip(grads, expected):
            _assert_same(a, b)
