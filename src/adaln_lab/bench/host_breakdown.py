"""Where the host time of one eager forward+backward goes: norm_out and one H3 block's AdaLN path, on a GPU.

For each op: the host time of forward+backward (perf_counter from the call to `.backward()` returning, the
device synchronised before each sample, median of 200 after 30 warm-ups) of adaln_lab, of diffusers' ops
(the replay) and of the identity autograd floor over the same leaves, in one run, and beside each its CPU time
(`host cpu`: process_time over the same span, every thread's, so a preempted or throttled host adds less noise
than to the wall time; host-ab's rounds print both); then cProfile over 500
calls of adaln_lab's, the functions by their own time per call. cProfile adds its own cost per Python call:
read its shares, not its absolute figures.

    python3 -m adaln_lab.bench.host_breakdown [--rows 4097] [--primitives] [--bounds] [--op-table] [--no-profile] > host_breakdown.txt

--primitives first prints the host cost of each piece an eager call is made of (an allocation, a launch, the
argument checks, an autograd.Function's forward and backward with and without saved tensors), each the median
over 2000 back-to-back calls, so that the sums above can be read against them. Those loops do not synchronise:
an item that launches GPU work (the launch, the forwards at --rows) shows the larger of its host time and its GPU
time per call, so read those as upper bounds of the host's part.

--bounds first prints what an autograd.Function that only launches and allocates as the op does (and with fewer
launches and allocations) costs against the report's identity floor, interleaved in rounds: the least any eager
path with those counts can cost on this host.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch

from adaln_lab import block_adaln_path, final_adaln_out
from adaln_lab.harness.block_report import EPS, make_block
from adaln_lab.harness.inputs import make
from adaln_lab.reference import replay
from adaln_lab.reference.block import replay_block_adaln


class Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, *leaves):
        return leaves[0].clone()

    @staticmethod
    def backward(ctx, dy):
        return (dy,) + (None,) * (len(ctx.needs_input_grad) - 1)


def passthrough(h):
    return h


def host_samples(step, prepare, samples=200, warmup=30, sync=torch.cuda.synchronize,
                 clock=time.perf_counter) -> list[float]:
    """Host us of `samples` calls of step() after `warmup`, each after prepare() and sync() (outside the clock).
    clock: time.perf_counter (wall time), or time.process_time (the CPU time of every thread of the process, the
    autograd engine's included: what a preempted or slowed host adds to the wall time is left out)."""
    times = []
    for i in range(warmup + samples):
        prepare()
        sync()
        t0 = clock()
        step()
        t1 = clock()
        if i >= warmup:
            times.append((t1 - t0) * 1e6)
    return times


def host_us(step, leaves, samples=200, warmup=30, clock=time.perf_counter) -> float:
    """Median host us of step(), the leaves' grads reset before each call (clock: host_samples')."""
    return statistics.median(host_samples(step, lambda: reset(leaves), samples, warmup, clock=clock))


def report(name: str, what: str, step, leaves, n: int) -> None:
    """The step's median host time, wall then CPU time (`host_samples`), one line each."""
    print(f"{name}: host {what} {host_us(step, leaves):.0f} us at {n} rows")
    print(f"{name}: host cpu {what} {host_us(step, leaves, clock=time.process_time):.0f} us at {n} rows")


def profile(step, leaves, calls=500) -> str:
    prof = cProfile.Profile()
    for i in range(calls):
        for leaf in leaves:
            leaf.grad = None
        if i % 50 == 0:
            torch.cuda.synchronize()
        prof.enable()
        step()
        prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out).sort_stats("tottime")
    stats.print_stats(40)
    total = sum(row[2] for row in stats.stats.values())
    return f"profiled own time per call: {total / calls * 1e6:.1f} us\n" + out.getvalue()


def op_table(step, leaves, calls=50) -> str:
    """torch.profiler's table of `calls` calls, ops by self CPU time (the engine's C++ nodes included)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for _ in range(5):
        reset(leaves)
        step()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            reset(leaves)
            step()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)


def loop_us(fn, calls=2000, repeats=5) -> float:
    """Host us per call of fn, the median of `repeats` loops of `calls` back-to-back calls (no synchronisation)."""
    fn()
    per = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        per.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(per)


class Saving(torch.autograd.Function):
    @staticmethod
    def forward(ctx, *leaves):
        ctx.save_for_backward(*leaves)
        return leaves[0].view_as(leaves[0])

    @staticmethod
    def backward(ctx, dy):
        saved = ctx.saved_tensors
        return (dy,) + (None,) * (len(saved) - 1)


def reset(leaves) -> None:
    for leaf in leaves:
        leaf.grad = None


def primitives(n: int) -> None:
    from adaln_lab.core import launchers, tensors
    from adaln_lab.core.plan import plan as make_plan
    from adaln_lab.core import support
    from adaln_lab.core.autocast import autocast_params
    from adaln_lab.core.library import eager
    from adaln_lab.core.checks import validate

    inputs = make(3, n, "cuda")
    x, nw, temb, w, b, idx = inputs.args
    p = make_plan(x.shape[-1], temb.shape[1], temb.shape[0])
    one = p.rows(1)
    k = launchers.kernels(0, p)
    stream = tensors.current_stream(0)
    out = torch.empty_like(x)
    ws = torch.empty(p.rows(n).fwd_bytes, dtype=torch.uint8, device="cuda")
    o = one.fwd_offsets
    device = x.device
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs.leaves]
    ones = torch.ones_like(x)
    items = {
        "torch.empty(bytes, uint8, cuda)": lambda: torch.empty(1 << 20, dtype=torch.uint8, device=device),
        "torch.empty_like(x)": lambda: torch.empty_like(x),
        "x.contiguous()": lambda: x.contiguous(),
        "x.data_ptr()": lambda: x.data_ptr(),
        "launchers.bind(0)": lambda: launchers.bind(0),
        "tensors.current_stream(0)": lambda: tensors.current_stream(0),
        "tensors.context(...)": lambda: tensors.context(0, x.shape[-1], temb.shape[1], temb.shape[0], n),
        "one launch (norm_modulate, 1 row)": lambda: launchers.launch_norm_modulate(
            k, p, one, stream, x.data_ptr(), nw.data_ptr(), ws.data_ptr() + o["table"], idx.data_ptr(),
            out.data_ptr(), ws.data_ptr() + o["rstd"], x.shape[-2], 1e-5),
        "checks.validate(...)": lambda: validate(x, nw, temb, w, b, idx, 1e-5, check_indices=False),
        "support.final_adaln_out(...)": lambda: support.final_adaln_out(x, nw, temb, w, b),
        "autocast_params(...)": lambda: autocast_params(x, nw, w, b),
        "library.eager() (the eager / compiled test)": eager,
        "identity Function forward (5 leaves)": lambda: Identity.apply(*leaves),
        "identity Function forward+backward (grads reset)": lambda: (reset(leaves), Identity.apply(*leaves).backward(ones)),
        "saving Function forward+backward (saves 5, grads reset)": lambda: (reset(leaves),
                                                                             Saving.apply(*leaves).backward(ones)),
        "grads reset alone": lambda: reset(leaves),
        "final_adaln_out forward (grad)": lambda: final_adaln_out(*leaves, idx),
    }
    items_no_grad = {"final_adaln_out forward (no_grad)": lambda: final_adaln_out(*inputs.args)}  # run under no_grad
    for name, fn in items.items():
        reset(leaves)
        print(f"primitive {name}: {loop_us(fn, calls=500 if 'final' in name or 'Function' in name else 2000):.2f} us")
    with torch.no_grad():
        for name, fn in items_no_grad.items():
            print(f"primitive {name}: {loop_us(fn, calls=500):.2f} us")
    del inputs, leaves, out, ws
    torch.cuda.synchronize()


def bounds(n: int, rounds: int = 5, device: str = "cuda", samples: int = 200, warmup: int = 40) -> None:
    """What no eager path with a given number of launches and allocations can undercut, against the report's floor.

    `Bare(launches_fwd, allocations_fwd, launches_bwd, allocations_bwd)`: an autograd.Function over norm_out's five
    leaves that saves what the op saves and does only that many launches (a one-row norm_modulate each, its host
    cost is the driver's and the argument block's) and allocations, returning fresh gradients; no checks, no plan
    lookups. Timed like the report's host fwd+bwd, interleaved with the report's identity floor and the op in
    `rounds` rounds of `warmup` + `samples` calls each (medians of all samples). `device` "cpu" runs it on CPU tensors
    (under adaln_lab.bench.host_model's stand-ins, for tests)."""
    from adaln_lab.core import launchers, tensors
    from adaln_lab.core.plan import plan as make_plan
    from adaln_lab.harness.latency import identity_floor

    inputs = make(3, n, device)
    x, nw, temb, w, b, idx = inputs.args
    p = make_plan(x.shape[-1], temb.shape[1], temb.shape[0])
    one, k = p.rows(1), launchers.kernels(0, p)
    offsets = p.rows(n).fwd_offsets
    ws = torch.zeros(p.rows(n).fwd_bytes, dtype=torch.uint8, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    scratch = torch.empty_like(x)
    pointers = (x.data_ptr(), nw.data_ptr(), ws.data_ptr() + offsets["table"], idx.data_ptr(), scratch.data_ptr(),
                ws.data_ptr() + offsets["rstd"])

    def launch(count):
        stream = tensors.current_stream(0)
        for _ in range(count):
            launchers.launch_norm_modulate(k, p, one, stream, *pointers, x.shape[-2], 1e-5)

    class Bare(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, nw, temb, w, b, idx, counts):
            ctx.counts = counts
            out = torch.empty_like(x)
            keep = [torch.empty(1024, dtype=torch.uint8, device=x.device) for _ in range(counts[1] - 1)]
            launch(counts[0])
            ctx.save_for_backward(x, nw, temb, w, idx, *keep)
            return out

        @staticmethod
        def backward(ctx, dy):
            x, nw, temb, w, idx = ctx.saved_tensors[:5]
            launchers.bind(0)
            grads = [torch.empty_like(t) for t in (x, nw, temb, w)] + [torch.empty(w.shape[0], dtype=w.dtype,
                                                                                   device=w.device)]
            work = [torch.empty(1024, dtype=torch.uint8, device=x.device) for _ in range(ctx.counts[3] - 5)]
            launch(ctx.counts[2])
            del work
            return (*grads, None, None)

    leaves = [t.detach().clone().requires_grad_(True) for t in inputs.leaves]
    ones = torch.ones_like(inputs.x)
    prepare_floor, floor_step = identity_floor([t.detach().clone().requires_grad_(True) for t in inputs.leaves], ones)
    steps = {"identity floor (the report's)": (floor_step, prepare_floor),
             "final_adaln_out adaln_lab": (lambda: final_adaln_out(*leaves, idx).backward(ones), None)}
    for counts in ((2, 2, 4, 6), (2, 2, 1, 5), (1, 1, 1, 5)):  # (launches, allocations) forward, then backward
        whose = "the op's " if counts == (2, 2, 4, 6) else ""
        name = f"Bare, {whose}{counts[0]}+{counts[2]} launches, {counts[1]}+{counts[3]} allocations"
        steps[name] = (lambda counts=counts: Bare.apply(*leaves, idx, counts).backward(ones), None)
    found = {name: [] for name in steps}
    for _ in range(rounds):
        for name, (step, prepare) in steps.items():
            found[name] += host_samples(step, prepare or (lambda: reset(leaves)), samples, warmup, sync)
    floor = statistics.median(found["identity floor (the report's)"])
    for name, values in found.items():
        us = statistics.median(values)
        print(f"bound {name}: host fwd+bwd {us:.0f} us at {n} rows ({us / floor:.2f}x the floor)")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=4097)
    parser.add_argument("--primitives", action="store_true")
    parser.add_argument("--op-table", action="store_true", help="torch.profiler's CPU-time table of each step")
    parser.add_argument("--no-profile", action="store_true", help="the host times alone, no cProfile")
    parser.add_argument("--bounds", action="store_true", help="the least an eager path with the op's launches and "
                        "allocations (or fewer) costs, against the report's identity floor, in rounds")
    args = parser.parse_args()
    n = args.rows
    if args.primitives:
        primitives(n)
    if args.bounds:
        bounds(n)

    inputs = make(3, n, "cuda")
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs.leaves]
    idx = inputs.timestep_indices
    ones = torch.ones_like(inputs.x)
    steps = {
        "final_adaln_out adaln_lab": lambda: final_adaln_out(*leaves, idx).backward(ones),
        "final_adaln_out diffusers replay": lambda: replay(*leaves, idx).backward(ones),
        "final_adaln_out identity floor": lambda: Identity.apply(*leaves).backward(ones),
    }
    for name, step in steps.items():
        report(name, "fwd+bwd", step, leaves, n)
    forwards = {"final_adaln_out adaln_lab": lambda: final_adaln_out(*leaves, idx),
                "final_adaln_out diffusers replay": lambda: replay(*leaves, idx)}
    for name, step in forwards.items():
        report(name, "fwd", step, leaves, n)

    block = make_block(3, n, "cuda")
    b_leaves = [t.detach().clone().requires_grad_(True) for t in block.leaves]
    x, n1, n2, temb, w, b = b_leaves
    bidx = block.timestep_indices
    b_ones = torch.ones_like(block.x)

    def ours():
        block_adaln_path(x, temb, w, b, n1, n2, bidx, passthrough, passthrough, EPS, EPS).backward(b_ones)

    def theirs():
        replay_block_adaln(x, temb, w, b, n1, n2, bidx, passthrough, passthrough, EPS, EPS).backward(b_ones)

    block_steps = {"block adaln_lab": ours, "block diffusers replay": theirs,
                   "block identity floor": lambda: Identity.apply(*b_leaves).backward(b_ones)}
    for name, step in block_steps.items():
        report(name, "fwd+bwd", step, b_leaves, n)
    block_forwards = {
        "block adaln_lab": lambda: block_adaln_path(x, temb, w, b, n1, n2, bidx, passthrough, passthrough, EPS, EPS),
        "block diffusers replay": lambda: replay_block_adaln(x, temb, w, b, n1, n2, bidx, passthrough, passthrough,
                                                             EPS, EPS)}
    for name, step in block_forwards.items():
        report(name, "fwd", step, b_leaves, n)
    if args.op_table:
        for name, (step, step_leaves) in {"final_adaln_out adaln_lab": (steps["final_adaln_out adaln_lab"], leaves),
                                          "block adaln_lab": (ours, b_leaves),
                                          "block diffusers replay": (theirs, b_leaves)}.items():
            print(f"\n== torch.profiler: {name} ==")
            print(op_table(step, step_leaves))
    if args.no_profile:
        return
    print("\n== cProfile: final_adaln_out adaln_lab ==")
    print(profile(steps["final_adaln_out adaln_lab"], leaves))
    print("\n== cProfile: block adaln_lab ==")
    print(profile(ours, b_leaves))


if __name__ == "__main__":
    main()
