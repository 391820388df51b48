"""The launch sequence of the CUDA op, checked on the CPU: a recorder stands in for every kernel and
`core.tensors.gpu` says yes for CPU tensors (the host model's stand-in of the GPU), so norm_out's launch ops
(`final_adaln_out.launch.forward` / `backward`) take their CUDA branch (`kernels_forward` / `kernels_backward`) and
CI sees which kernels a forward and a backward launch, with which geometry, on which stream, and that every pointer
they get lies inside a live buffer of the right size (the kernels themselves run in
tests/ops/test_final_adaln_out.py)."""

import dataclasses

import pytest
import torch

from adaln_lab.core import launchers, tensors
from adaln_lab.core import plan as plan_module
from adaln_lab.harness.inputs import make, upstream
from adaln_lab.ops.final_adaln_out import launch

STREAM = 7  # torch's current stream as the launch bodies read it (`tensors.current_stream`): every launch is on it


class Recorder:
    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def __call__(self, grid, block, shared_mem, stream, *args):
        assert len(args) == len(launchers.SIGNATURES[self.name]), self.name
        self.calls.append((self.name, grid, block, shared_mem, args, stream))

    def after_previous(self, grid, block, shared_mem, stream, *args):
        """The programmatic dependent launch: recorded as the launch it is, and named in PROGRAMMATIC."""
        PROGRAMMATIC.append(len(self.calls))
        self(grid, block, shared_mem, stream, *args)


PROGRAMMATIC = []  # indices into the recorded calls of the launches made with after_previous


@pytest.fixture
def calls(monkeypatch):
    recorded = []
    PROGRAMMATIC.clear()
    monkeypatch.setattr(launchers, "kernels", lambda device, plan: {n: Recorder(n, recorded) for n in launchers.SIGNATURES})
    monkeypatch.setattr(launchers, "bind", lambda device: None)
    monkeypatch.setattr(tensors, "current_stream", lambda device: STREAM)
    monkeypatch.setattr(tensors, "gpu", lambda t: True)
    from cupy.cuda import runtime

    monkeypatch.setattr(runtime, "memsetAsync",
                        lambda ptr, value, size, stream: recorded.append(("memset", ptr, size, stream)))
    return recorded


class Forward:
    """launch.forward on route "cupy" (its CUDA branch, under the `calls` fixture), out and the forward workspace
    allocated as FinalAdaLNOut allocates them; `backward` runs launch.backward on that workspace."""

    def __init__(self, i, table_backend="cuda"):
        H = i.x.shape[-1]
        T, D = i.temb.shape
        self.plan = plan_module.plan(H, D, T)
        self.rows = self.plan.rows(i.x.numel() // H)
        self.out = torch.empty_like(i.x)
        self.workspace = torch.empty(plan_module.forward_bytes(T, H, self.rows.rows, D), dtype=torch.uint8)
        assert (self.rows.fwd_offsets, self.rows.fwd_bytes) == plan_module.forward_workspace(T, H, self.rows.rows, D)
        assert self.rows.fwd_bytes == self.workspace.numel()
        launch.forward(*i.args, 1e-5, "cupy", table_backend, self.out, self.workspace)

    def backward(self, i, dy):
        """launch.backward on the forward's workspace, the gradients allocated as FinalAdaLNOut allocates them
        (the backward's workspace is its own allocation)."""
        grads = (torch.empty_like(i.x), torch.empty_like(i.norm_weight), torch.empty_like(i.temb),
                 torch.empty_like(i.weight), i.weight.new_empty(i.weight.shape[:1]))
        launch.backward(dy, i.x, i.norm_weight, i.temb, i.weight, i.timestep_indices, self.workspace, "cupy", *grads)
        return grads


def _streams(calls):
    return {c[-1] for c in calls}


def _buffers(buffers):
    return [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in buffers if t.numel()]


def _inside(pointer, buffers):
    return any(a <= pointer < b for a, b in buffers)


@pytest.mark.parametrize("rows", [1, 1031])
def test_forward_and_backward_launch_each_kernel_once_on_live_buffers(calls, rows):
    i = make(1, rows, "cpu")
    forward = Forward(i)
    out = forward.out
    dy = upstream(1, i.x)
    grads = forward.backward(i, dy)
    names = [c[0] for c in calls]
    assert names == ["table_act", "table_bf16", "norm_modulate_warp_bf16", "norm_modulate_bwd_bf16",
                     "reduce_partials_bf16", "table_bwd_bf16", "table_bwd_reduce"]
    assert _streams(calls) == {STREAM}
    plan, r = forward.plan, forward.rows
    # the table kernel may start as table_act ends, and with PDL the row kernel as the table ends
    assert PROGRAMMATIC == ([1, 2] if plan.fwd_pdl else [1])  # indices of the calls
    assert calls[0][1] == (plan.table_act_grid, 1, 1) and calls[1][1] == (*plan.table_grid, 1)
    act = calls[0][4][1]  # table.cu's scratch (T, D) bf16: the forward workspace's last piece
    assert act == forward.workspace.data_ptr() + r.fwd_offsets["act"] and calls[0][4][0] == i.temb.data_ptr()
    calls = calls[1:]
    assert calls[1][1] == (-(-rows // plan.fwd_warp_rows), 1, 1) and calls[1][2] == (32 * plan.fwd_warp_rows, 1, 1)
    assert calls[2][1] == (r.bwd_ranges, 1, 1)
    assert calls[3][1] == (-(-plan.H // 32), 1, 1) and calls[4][1] == plan.tb_grid + (1,)
    assert calls[5][1] == (-(-plan.D // 32), plan.T, 1) and calls[5][4][3] == plan.blocks_j
    # every pointer argument points into something alive: inputs, outputs, the forward's workspace
    # (kept for the backward) or the backward's workspace (the only allocation not returned); the one null
    # pointer is table_bwd's d_bias, an output norm_out takes from reduce_partials instead
    live = _buffers([*i.args, dy, out, forward.workspace, *grads])
    workspace_pointers = [a for c in calls[2:] for kind, a in zip(launchers.SIGNATURES[c[0]], c[4])
                          if kind == "p" and a and not _inside(a, live)]
    base = min(workspace_pointers)
    for name, _, _, _, args, _ in calls:
        for kind, a in zip(launchers.SIGNATURES[name], args):
            if kind == "p" and (a or name != "table_bwd_bf16"):
                assert _inside(a, live) or 0 <= a - base < r.bwd_bytes, (name, a)
    # the backward's workspace pieces are where the plan lays them out (d_scale: the second half of d_table's rows)
    d_scale = base + r.bwd_offsets["d_table"] + 4 * plan.H
    assert sorted(a - base for a in set(workspace_pointers) - {d_scale}) == sorted(r.bwd_offsets.values())
    # and every argument is the buffer its kernel parameter names (a swap of two would pass the checks above)
    fws, o, b = forward.workspace.data_ptr(), r.fwd_offsets, r.bwd_offsets
    p = {name: t.data_ptr() for name, t in zip(("x", "norm_weight", "temb", "weight", "bias", "idx"), i.args)}
    expected = {
        "table_bf16": [act, p["weight"], p["bias"], fws + o["table"], fws + o["table_f32"]],
        "norm_modulate_warp_bf16": [p["x"], p["norm_weight"], fws + o["table"], p["idx"], out.data_ptr(),
                                    fws + o["rstd"]],
        "norm_modulate_bwd_bf16": [dy.data_ptr(), p["x"], fws + o["rstd"], p["norm_weight"], fws + o["table_f32"],
                                   p["idx"], grads[0].data_ptr(), base + b["row_partials"]],
        "reduce_partials_bf16": [base + b["row_partials"], p["norm_weight"], fws + o["table_f32"], base + b["d_table"],
                                 d_scale, grads[1].data_ptr(), grads[4].data_ptr()],
        "table_bwd_bf16": [base + b["d_table"], p["temb"], p["weight"], grads[3].data_ptr(), base + b["dact_partials"],
                           0],
        "table_bwd_reduce": [base + b["dact_partials"], p["temb"], grads[2].data_ptr()],
    }
    for name, _, _, _, args, _ in calls:
        pointers = [a for kind, a in zip(launchers.SIGNATURES[name], args) if kind == "p"]
        assert pointers == expected[name], name


def test_a_large_table_launches_table_bwd_as_two_halves_with_the_same_arguments(calls):
    """From TB_SPLIT_MIN_T table rows on, d_weight and dact come from two kernels on table_bwd_bf16's
    grid, block and arguments (the same sums: tests/core/test_tensors.py checks the bits on a GPU)."""
    i = make(1, 37, "cpu", T=9)
    forward = Forward(i)
    assert forward.plan.tb_split and not plan_module.plan(5376, 2688, 4).tb_split
    forward.backward(i, upstream(1, i.x))
    names = [c[0] for c in calls]
    assert names[-3:] == ["table_bwd_d_weight_bf16", "table_bwd_dact_bf16", "table_bwd_reduce"]
    assert "table_bwd_bf16" not in names
    halves = calls[-3:-1]
    assert halves[0][1:] == halves[1][1:] and halves[0][1] == forward.plan.tb_grid + (1,)
    assert _streams(calls) == {STREAM}


@pytest.mark.parametrize("lead, rows", [((), 37), ((2,), 40), ((), 0)])
def test_many_timesteps_launch_the_sorted_backward_on_its_workspace(calls, lead, rows):
    """From BWD_SORTED_MIN_T timesteps on (plan.bwd_sorted), norm_out's backward sorts the rows (row_order on the S
    indices, 0 with no rows), then the sorted pass and its reduce: each pointer the piece of the backward workspace
    the plan lays out for it (row_order's offsets and order, bwd_ranges + T partial slots, d_scale half a row into
    d_table), with leading dims (rows = 2 S) too."""
    i = make(1, rows, "cpu", T=12)
    if lead:
        i = dataclasses.replace(i, x=i.x.reshape(2, rows // 2, -1), timestep_indices=i.timestep_indices[:rows // 2])
    forward = Forward(i)
    plan, r = forward.plan, forward.rows
    assert plan.bwd_sorted and not plan_module.plan(5376, 2688, 9).bwd_sorted
    dy = upstream(1, i.x)
    calls.clear()
    grads = forward.backward(i, dy)
    names = [c[0] for c in calls]
    sorted_pass = ["norm_modulate_bwd_sorted_bf16"] if rows else []  # nothing to pass over with no rows
    assert names[:3] == ["row_order", *sorted_pass, "reduce_partials_sorted_bf16", "table_bwd_mma_terms"][:3]
    by = {c[0]: c for c in calls}
    order_args, reduce_args = by["row_order"][4], by["reduce_partials_sorted_bf16"][4]
    base = reduce_args[0] - r.bwd_offsets["row_partials"]
    S = i.x.shape[-2]
    assert order_args[1] == base + r.bwd_offsets["row_order"] and order_args[2] == order_args[1] + 4 * (plan.T + 1)
    assert order_args[3] == (S if rows else 0) and r.bwd_offsets["row_order"] + 4 * (plan.T + 1 + rows) <= r.bwd_bytes
    d_table = base + r.bwd_offsets["d_table"]
    assert reduce_args[3:5] == (d_table, d_table + 4 * plan.H) and reduce_args[7] == order_args[1]
    assert reduce_args[5:7] == (grads[1].data_ptr(), grads[4].data_ptr())
    slots = launchers.sorted_slots(plan, r)
    assert r.bwd_offsets["d_table"] >= r.bwd_offsets["row_partials"] + slots * 2 * plan.H * 4 or \
        r.bwd_offsets["row_partials"] >= r.bwd_offsets["d_table"] + plan.T * 2 * plan.H * 4
    if rows:
        pass_args = by["norm_modulate_bwd_sorted_bf16"][4]
        assert pass_args[6:9] == (order_args[1], grads[0].data_ptr(), base + r.bwd_offsets["row_partials"])
    # table_bwd on tensor cores (plan.tb_mma): the terms once, into table_bwd's workspace after dact_partials, then
    # its halves on them, then table_bwd_reduce on the partials; the grids the plan gives, the terms inside it
    assert plan.tb_mma and names[-4:] == ["table_bwd_mma_terms", "table_bwd_mma_d_weight", "table_bwd_mma_dact",
                                          "table_bwd_reduce"]
    partials = base + r.bwd_offsets["dact_partials"]
    terms = partials + plan.tb_terms_at
    assert r.bwd_offsets["dact_partials"] + plan.tb_bytes <= r.bwd_bytes
    assert plan.tb_bytes - plan.tb_terms_at == 2 * (6 * 16 * 2 * plan.H + 3 * 16 * plan.D)  # T 12: TP 16, N 2H
    assert [by[n][1] for n in names[-4:-1]] == [g + (1,) for g in plan.tbm_grids]
    assert by["table_bwd_mma_terms"][4] == (d_table, i.temb.data_ptr(), terms, 0)  # no d_bias: reduce_partials'
    assert by["table_bwd_mma_d_weight"][4] == (terms, grads[3].data_ptr())
    assert by["table_bwd_mma_dact"][4] == (terms, i.weight.data_ptr(), partials)
    assert by["table_bwd_reduce"][4][:3] == (partials, i.temb.data_ptr(), grads[2].data_ptr())
    assert _streams(calls) == {STREAM}


def test_signatures_match_the_kernels():
    """launchers.SIGNATURES (what the driver launch packs) against each kernel's parameter list in kernels_cu/."""
    import re

    from adaln_lab.core import loader

    text = "".join((loader.kernel_dir() / n).read_text() for n in loader.KERNEL_FILES)
    kinds = {"int": "i", "float": "f"}
    for name, signature in launchers.SIGNATURES.items():
        params = re.search(rf"{name}\(([^)]*)\)", text).group(1).split(",")
        got = "".join("p" if "*" in param else kinds[param.split()[-2]] for param in params)
        assert got == signature, (name, got, signature)


def test_empty_batch_launches_no_row_kernel_and_zeroes_the_partials(calls):
    i = make(1, 0, "cpu", H=264, D=64, T=2)
    forward = Forward(i)
    assert forward.out.shape == (0, 264)
    forward.backward(i, torch.empty_like(forward.out))
    names = [c[0] for c in calls]
    assert names == ["table_act", "table_bf16", "memset", "reduce_partials_bf16", "table_bwd_bf16", "table_bwd_reduce"]
    memset = calls[2]
    assert memset[2] == 2 * 2 * 264 * 4  # one range of (T, 2, H) fp32 zeros
    assert _streams(calls) == {STREAM}
    assert calls[3][4][7] == 1  # reduce_partials sums that one range (its nblocks argument)


def test_the_row_kernel_waits_on_the_table_kernel_only_when_it_follows_it(calls, monkeypatch):
    """With PDL on and table_backend="torch" the table comes from F.linear, not the table kernel: the row kernel
    is launched plainly (a programmatic launch after some other kernel would gain nothing)."""
    monkeypatch.setitem(plan_module.TUNING, "FWD_PDL", 1)
    plan_module.clear_caches()
    tensors.context.cache_clear()
    try:
        i = make(1, 9, "cpu", H=64, D=32, T=2)
        assert plan_module.plan(64, 32, 2).fwd_pdl
        Forward(i, "cuda")
        assert [c[0] for c in calls] == ["table_act", "table_bf16", "norm_modulate_warp_bf16"]
        assert PROGRAMMATIC == [1, 2]  # the table after table_act, the rows after the table
        Forward(i, "torch")
        assert [c[0] for c in calls][3:] == ["norm_modulate_warp_bf16"] and PROGRAMMATIC == [1, 2]
    finally:  # no plan built under the override outlives the test
        monkeypatch.undo()
        plan_module.clear_caches()
        tensors.context.cache_clear()


def test_the_programmatic_launch_hands_the_driver_its_geometry_stream_attribute_and_arguments(monkeypatch):
    """Kernel.after_previous (cuLaunchKernelEx) on a stand-in driver call: each launch gives the driver the grid,
    block, shared memory, stream and the programmatic-serialization attribute of that call, and the argument
    block of that call, though the configuration and the arguments are built once and rewritten in place (the
    configuration's head only when it changes: a repeated head, then one seen before, still give their own)."""
    import ctypes
    import struct
    from types import SimpleNamespace

    seen = []

    def driver_launch(config_address, function, params_address, extra):
        config = launchers._LaunchConfig.from_address(config_address)
        attribute = config.attrs[0]
        slots = ctypes.cast(params_address, ctypes.POINTER(ctypes.c_void_p))
        args = [ctypes.string_at(slots[i], 8) for i in range(len(launchers.SIGNATURES["norm_modulate_warp_bf16"]))]
        seen.append((tuple(config.grid), tuple(config.block), config.shared_mem, config.stream, config.num_attrs,
                     attribute.id, attribute.value, function, args, extra))
        return 0

    monkeypatch.setattr(launchers, "_launch_kernel_ex", lambda: driver_launch)
    kernel = launchers.Kernel("norm_modulate_warp_bf16", SimpleNamespace(kernel=SimpleNamespace(ptr=77)))
    launched = ((9, 5), (9, 5), (4097, 6), (9, 5), (9, 6))
    for rows, stream in launched:
        kernel.after_previous((rows, 1, 1), (256, 1, 1), 0, stream, 1, 2, 3, 4, 5, 6, 7, 0.5, rows, 1)
    assert len(seen) == len(launched)
    for (grid, block, smem, stream, n, attr, value, function, args, extra), (rows, want_stream) in zip(seen, launched):
        assert (grid, block, smem, stream, n) == ((rows, 1, 1), (256, 1, 1), 0, want_stream, 1)
        assert (attr, value, function, extra) == (launchers.PROGRAMMATIC_STREAM_SERIALIZATION, 1, 77, None)
        assert [struct.unpack("<Q", a)[0] for a in args[:6]] == [1, 2, 3, 4, 5, 6]
        assert struct.unpack("<i", args[6][:4])[0] == 7 and struct.unpack("<f", args[7][:4])[0] == 0.5
        assert struct.unpack("<i", args[8][:4])[0] == rows
    not_sm90 = launchers.Kernel("norm_modulate_warp_bf16", SimpleNamespace(kernel=SimpleNamespace(ptr=77)),
                                programmatic=False)
    monkeypatch.setattr(not_sm90, "_launch", lambda *a: seen.append("plain"))
    not_sm90.after_previous((1, 1, 1), (256, 1, 1), 0, 5, 1, 2, 3, 4, 5, 6, 7, 0.5, 1, 1)
    assert seen[-1] == "plain"


def test_a_forward_workspace_short_of_the_plan_is_refused(calls):
    """The kernels write every piece of the forward workspace, the table kernel's act scratch last: a workspace one
    byte short of `forward_bytes` (an old size) is refused before any launch, naming the size it needs."""
    i = make(1, 64, "cpu")
    H, (T, D) = i.x.shape[-1], i.temb.shape
    nbytes = plan_module.forward_bytes(T, H, 64, D)
    with pytest.raises(ValueError, match=str(nbytes)):
        launch.forward(*i.args, 1e-5, "cupy", "cuda", torch.empty_like(i.x), torch.empty(nbytes - 1, dtype=torch.uint8))
    assert calls == []


def test_aligned_addresses_are_the_aligned_tensors_and_their_pointers():
    """tensors.aligned_addresses: the tensors themselves and their pointers where all are contiguous and 16-byte
    aligned, else every one through tensors.aligned (a copy where one is strided or off the boundary)."""
    a, b = torch.zeros(64), torch.zeros(8, 8, dtype=torch.bfloat16)
    ts, at = tensors.aligned_addresses(a, b)
    assert ts[0] is a and ts[1] is b and at == (a.data_ptr(), b.data_ptr())
    for odd in (b.t(), torch.zeros(72, dtype=torch.bfloat16)[1:65]):
        ts, at = tensors.aligned_addresses(a, odd)
        assert at == tuple(t.data_ptr() for t in ts) and all(p % 16 == 0 for p in at)
        assert all(t.is_contiguous() for t in ts) and torch.equal(ts[1], odd) and ts[0] is a
