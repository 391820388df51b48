"""What an H3 block's exact route on the kernels costs beside its plain fwd+bwd, after checking its bits."""

# Issue 40, a block's AdaLN on the kernels. At MiniMax-H3's width (H 5376, D 2688, T 3 timesteps, 3T = 9 chunk
# rows), bf16 parameters, rows of x in one sequence with interleaved chunk rows, the block protocol's attn and ff
# (`rowwise_attn` / `rowwise_ff`: row-wise, so a split changes no row's terms). Checked first:
#   dx of the exact route (inside ExactGradients) equals the plain block's, bit for bit;
#   the four AdaLN gradients of the rows in one call equal those of the rows in 2 and 3 parts, the parts merged in
#   reversed order (the exact sums: the same integers), and differ from the plain route's for some split.
# Then eager steps between CUDA events (medians; host time included: the exact route is eager only):
#   plain       block_adaln_path forward + backward (fixed-order parameter sums)
#   exact_part  the same inside `with ExactGradients()`: the norms' and the gated residuals' row passes with their
#               sums exact (in place of the plain passes and their reduces), no table backward, and the part's
#               states folded in when the `with` ends (a micro-batch's cost)
#   write       ExactGradients.write of one part (once a step: the table's gradient over the distinct temb rows,
#               d_weight as exact float64 products on the weight's device; temb wants no gradient here)
# and exact_part / plain; then GPU time alone (CUDA-graph replays, as the block report times its candidates) of the
# plain fwd+bwd and of the exact one inside an open `with` (its fold-in at the `with`'s end left out: host work),
# and their ratio (a capture that fails is reported with its error, not timed).
#
#     python3 bench/tools/block_exact_cost.py [--rows 4097,32768] [--out FILE.json] [--profile-write]
#                                            [--row-double 0|1]

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import torch

from adaln_lab import block_adaln_path
from adaln_lab.bench.timing import gpu_us, graph_us
from adaln_lab.core import launchers, plan as plan_module
from adaln_lab.harness.block_protocol import rowwise_attn, rowwise_ff
from adaln_lab.nn import ExactGradients

H, D, T = 5376, 2688, 3


def inputs(rows: int):
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(1, rows, H, device="cuda", generator=g).bfloat16()
    dy = (torch.randn(1, rows, H, device="cuda", generator=g) * 1e-3).bfloat16()
    temb = torch.randn(T, D, device="cuda", generator=g)
    params = [(0.02 * torch.randn(18 * H, D, device="cuda", generator=g)).bfloat16(),
              (0.02 * torch.randn(18 * H, device="cuda", generator=g)).bfloat16(),
              (1 + 0.1 * torch.randn(H, device="cuda", generator=g)).bfloat16(),
              (1 + 0.1 * torch.randn(H, device="cuda", generator=g)).bfloat16()]
    idx = torch.randint(0, 3 * T, (rows,), device="cuda", generator=g)
    return x, dy, temb, [torch.nn.Parameter(p) for p in params], idx


def step(x, dy, temb, params, idx, acc=None) -> torch.Tensor:
    """One forward and backward (inside `acc` where given); x's gradient."""
    x = x.detach().requires_grad_(True)
    with acc if acc is not None else torch.enable_grad():
        block_adaln_path(x, temb, *params, idx, rowwise_attn, rowwise_ff, backend="cupy").backward(dy)
    return x.grad


def grads(params, parts, exact: bool):
    """The four gradients of the parts (x, dy, temb, params, idx) run one after the other, exactly or plainly."""
    for p in params:
        p.grad = None
    acc = ExactGradients() if exact else None
    for part in parts:
        step(*part, acc=acc)
    if exact:
        acc.write()
    return [p.grad.clone() for p in params]


def split(x, dy, temb, params, idx, n: int) -> list[tuple]:
    cuts = [round(x.shape[1] * k / n) for k in range(n + 1)]
    return [(x[:, a:b], dy[:, a:b], temb, params, idx[a:b]) for a, b in zip(cuts, cuts[1:])]


def check(rows: int) -> None:
    x, dy, temb, params, idx = case = inputs(rows)
    plain_dx, exact_dx = step(*case), step(*case, acc=ExactGradients())
    if not torch.equal(plain_dx, exact_dx):
        raise AssertionError(f"the exact route's dx differs from the plain block's at {rows} rows")
    one, plain = grads(params, [case], True), grads(params, [case], False)
    moved = False
    for n in (2, 3):
        parts = split(*case, n)
        if not all(torch.equal(a, b) for a, b in zip(grads(params, parts[::-1], True), one)):
            raise AssertionError(f"the exact gradients of {n} parts differ from one call's at {rows} rows")
        moved |= not all(torch.equal(a, b) for a, b in zip(grads(params, parts, False), plain))
    if not moved:
        raise AssertionError(f"no split changed the plain route's gradients at {rows} rows: the check cannot fail")


def measure(rows: int, profile_write: bool = False) -> dict:
    """The checks, then the timings at `rows` (module comment); profile_write: write's profile printed too."""
    check(rows)
    case = inputs(rows)
    params = case[3]

    def plain():
        for p in params:
            p.grad = None
        step(*case)

    def exact_part():
        for p in params:
            p.grad = None
        step(*case, acc=ExactGradients())

    writes = []
    for _ in range(5):
        for p in params:
            p.grad = None
        acc = ExactGradients()
        step(*case, acc=acc)
        torch.cuda.synchronize()
        start = time.perf_counter()
        acc.write()
        torch.cuda.synchronize()
        writes.append((time.perf_counter() - start) * 1e6)
    if profile_write:
        print(write_profile(params, case), flush=True)
    us = {"plain": gpu_us(plain, reps=10), "exact_part": gpu_us(exact_part, reps=10),
          "write": statistics.median(writes)}
    entry = {"rows": rows, "us": us, "exact_part_over_plain": us["exact_part"] / us["plain"]}
    acc = ExactGradients()
    try:
        us["plain_graph"] = graph_us(plain)
        with acc:  # the parts' states pile up in acc while the graph is captured and replayed; never written
            us["exact_graph"] = graph_us(lambda: step(*case))
        entry["exact_graph_over_plain_graph"] = us["exact_graph"] / us["plain_graph"]
    except RuntimeError as error:  # a capture the exact route's host work breaks: said, not hidden
        entry["graph_error"] = str(error)
    return entry


def write_profile(params, case, top: int = 25) -> str:
    """torch.profiler's tables of one write (after a recorded part): the ops by their own GPU time, then by their own
    CPU time (copies between the host and the device and waits for the device included), where write's time goes."""
    from torch.profiler import ProfilerActivity, profile

    for p in params:
        p.grad = None
    acc = ExactGradients()
    step(*case, acc=acc)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        acc.write()
        torch.cuda.synchronize()
    table = prof.key_averages()
    return (f"write's ops by own GPU time:\n{table.table(sort_by='self_device_time_total', row_limit=top)}\n"
            f"write's ops by own CPU time:\n{table.table(sort_by='self_cpu_time_total', row_limit=top)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", default="4097,32768")
    parser.add_argument("--out")
    parser.add_argument("--profile-write", action="store_true",
                        help="print torch.profiler's tables of one write at each size")
    parser.add_argument("--row-double", type=int, choices=(0, 1),
                        help="TUNING's EXACT_ROW_DOUBLE for this run (the norms' exact passes' windows; default: "
                             "the shipped one)")
    args = parser.parse_args()
    if args.row_double is not None:
        plan_module.TUNING["EXACT_ROW_DOUBLE"] = args.row_double
        launchers.forget_compiled()
    result = {"gpu": torch.cuda.get_device_name(0), "H": H, "D": D, "T": T,
              "exact_row_double": plan_module.TUNING["EXACT_ROW_DOUBLE"], "sizes": []}
    for rows in (int(r) for r in args.rows.split(",")):
        entry = measure(rows, args.profile_write)
        result["sizes"].append(entry)
        graph = (f"graph {entry['us']['plain_graph']:.1f} / {entry['us']['exact_graph']:.1f} us "
                 f"({entry['exact_graph_over_plain_graph']:.2f}x)" if "graph_error" not in entry
                 else f"graph capture failed: {entry['graph_error'][:200]}")
        print(f"rows {rows}: plain {entry['us']['plain']:.1f} us, exact part {entry['us']['exact_part']:.1f} us "
              f"({entry['exact_part_over_plain']:.2f}x), write {entry['us']['write']:.0f} us; {graph}", flush=True)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
