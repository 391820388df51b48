"""What exact cross-row sums cost in a row pass: fp32 partials against exact integer states, and the anchor pass."""

# Issue 40's speed question before building it (NOTES v34, v36). bench/tools/exact_cost.cu holds three kernels over
# the same (rows, 5376) bf16 x and dy (a stand-in for norm_out's backward row pass at one timestep, without its
# row-wide dot product): pass_f32 (today's three fp32 sums a column), pass_exact (two exact sums a column as three
# int64 states: dy in one, dy * xhat split in two, a per-tensor quantum each), pass_exact_wide (dy * xhat as one
# 128-bit integer from the float's bits: a window of 88 binades against 39) and amax_dy (each column's largest
# |dy|: the pass an exact mode needs for its quanta; a real mode also needs max |dy xhat| or a looser bound). Checked
# before timing: pass_f32's sums within the fp32 accumulation bound of the float64 golden (a block adds rows_per
# terms, the blocks are added in float64); pass_exact's states of the blocks it did not flag, summed as Python
# integers, equal to the exact sums of the same float32 terms over those blocks' rows (the first and the last 32
# columns), and the flagged blocks counted (a term of p below 2^-38 of the largest: about one a pass at 32768 rows
# of these inputs, where the op would raise or take a wider path). Times: CUDA-graph replays between CUDA
# events (GPU time), medians; floor = the pass's bytes (x, dy read, dx written) at the run's copy bandwidth.
#
#     python3 bench/tools/exact_cost.py [--rows 4097,32768] [--blocks 132,264] [--out FILE.json]

from __future__ import annotations

import argparse
import json
import math
import pathlib

import cupy
import numpy
import torch

from adaln_lab.bench.timing import graph_us
from adaln_lab.harness.latency import copy_bandwidth

H = 5376
THREADS = H // 8
BLOCKS = 264  # row ranges by default: two an SM on an H100 (132 SMs), as the row pass's plan
CHECK_COLUMNS = list(range(32)) + list(range(H - 32, H))


def module():
    source = (pathlib.Path(__file__).with_name("exact_cost.cu")).read_text()
    return cupy.RawModule(code=source, options=("-std=c++17", "--device-int128"))


def launch(kernel, blocks: int, rows: int, *args) -> None:
    rows_per = -(-rows // blocks)
    ptrs = [numpy.uint64(a.data_ptr()) if isinstance(a, torch.Tensor) else a for a in args]
    with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
        kernel((blocks,), (THREADS,), (*ptrs, numpy.int32(rows), numpy.int32(rows_per)))


def exponent_of(t: torch.Tensor) -> int:
    """e with 2^e <= max |t| < 2^(e + 1) (0 for an all-zero t)."""
    m = float(t.abs().max())
    return math.frexp(m)[1] - 1 if m > 0 else 0


def inputs(rows: int):
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, H, device="cuda", generator=g).bfloat16()
    dy = (torch.randn(rows, H, device="cuda", generator=g) * 1e-3).bfloat16()
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1) + 1e-6)
    nw = (1 + 0.1 * torch.randn(H, device="cuda", generator=g)).bfloat16().float()
    scale1 = (1 + 0.1 * torch.randn(H, device="cuda", generator=g)).bfloat16().float()
    p = dy.float() * (xf * rstd[:, None])  # the pass's terms: each product rounded to float32, no fma
    return x, dy, rstd, nw, scale1, p


def check_f32(partials, blocks, dy, p, nw, scale1) -> float:
    """The largest error of pass_f32's sums (each block's rows_per terms in fp32, the blocks reduced in float64)
    against the float64 sums of its terms, as a share of the bound (rows_per + 1) u sum |term|; raises past 1."""
    got = partials.view(blocks, 3, H).double().sum(0)
    terms = (dy.double(), (p * nw).double(), (p * scale1).double())
    rows_per = -(-dy.shape[0] // blocks)
    worst = 0.0
    for k, t in enumerate(terms):
        bound = (rows_per + 1) * 2.0 ** -24 * t.abs().sum(0)
        share = float(((got[k] - t.sum(0)).abs() / bound.clamp_min(1e-300)).max())
        worst = max(worst, share)
    if worst > 1:
        raise AssertionError(f"pass_f32 outside the fp32 accumulation bound ({worst:.3g} of it)")
    return worst


def exact_column_sums(t: torch.Tensor) -> list[int]:
    """Exact sums of float32 terms (rows, C) as integers in units of 2^-149."""
    scaled = [[int(v * 2.0 ** 149) for v in col] for col in t.double().T.cpu().tolist()]
    return [sum(col) for col in scaled]


def two_states(hi: int, lo: int) -> int:
    """pass_exact's P in units of its quantum: hi 2^40 + lo."""
    return hi * 2 ** 40 + lo


def one_wide_state(low: int, high: int) -> int:
    """pass_exact_wide's P in units of its quantum: the 128-bit integer of its two words (the low one unsigned)."""
    return high * 2 ** 64 + (low % 2 ** 64)


def check_exact(partials, flags, blocks, dy, p, quanta, p_of=two_states) -> int:
    """An exact pass: over the blocks it did not flag, D and P of CHECK_COLUMNS (P from the two words by p_of) equal
    the exact sums of the same terms over those blocks' rows; returns the number of flagged blocks (raises if every
    block is flagged)."""
    rows_per = -(-dy.shape[0] // blocks)
    kept = [b for b, flag in enumerate(flags.tolist()) if not flag and b * rows_per < dy.shape[0]]
    if not kept:
        raise AssertionError("pass_exact flagged every block")
    columns = torch.tensor(CHECK_COLUMNS, device=partials.device)
    states = partials.view(blocks, 3, H)[kept][:, :, columns].cpu().tolist()
    rows = torch.cat([torch.arange(b * rows_per, min(dy.shape[0], (b + 1) * rows_per)) for b in kept]).to(dy.device)
    q_g, q_p = quanta.tolist()
    n = len(CHECK_COLUMNS)
    d = [sum(b[0][c] for b in states) for c in range(n)]
    got_d = [v * 2 ** (q_g + 149) for v in d]
    got_p = [sum(p_of(b[1][c], b[2][c]) for b in states) * 2 ** (q_p + 149) for c in range(n)]
    if (got_d != exact_column_sums(dy[rows][:, columns].float())
            or got_p != exact_column_sums(p[rows][:, columns])):
        raise AssertionError("pass_exact's states differ from the exact sums of its terms")
    return blocks - len(kept) - sum(1 for b in range(blocks) if b * rows_per >= dy.shape[0])


def measure(rows: int, blocks: int, k, copy_TBps: float) -> dict:
    x, dy, rstd, nw, scale1, p = inputs(rows)
    dx = torch.empty_like(x)
    f32 = torch.empty(blocks * 3 * H, dtype=torch.float32, device="cuda")
    states = torch.empty(blocks * 3 * H, dtype=torch.int64, device="cuda")
    flags = torch.zeros(blocks, dtype=torch.int32, device="cuda")
    amax = torch.zeros(H, dtype=torch.int32, device="cuda")
    quanta = torch.tensor([exponent_of(dy.float()) + 1 - 47, exponent_of(p) + 1 - 62], dtype=torch.int32,
                          device="cuda")
    quanta_wide = torch.tensor([exponent_of(dy.float()) + 1 - 47, exponent_of(p) + 1 - 112], dtype=torch.int32,
                               device="cuda")
    wide = torch.empty_like(states)
    flags_wide = torch.zeros_like(flags)
    steps = {
        "f32": lambda: launch(k.get_function("pass_f32"), blocks, rows, x, dy, rstd, nw, scale1, dx, f32),
        "exact": lambda: launch(k.get_function("pass_exact"), blocks, rows, x, dy, rstd, quanta, dx, states,
                                flags),
        "exact_wide": lambda: launch(k.get_function("pass_exact_wide"), blocks, rows, x, dy, rstd, quanta_wide, dx,
                                     wide, flags_wide),
        "amax_dy": lambda: launch(k.get_function("amax_dy"), blocks, rows, dy, amax),
    }
    for step in steps.values():
        step()
    torch.cuda.synchronize()
    share = check_f32(f32, blocks, dy, p, nw, scale1)
    flagged = check_exact(states, flags, blocks, dy, p, quanta)
    flagged_wide = check_exact(wide, flags_wide, blocks, dy, p, quanta_wide, one_wide_state)
    if not torch.equal(amax.view(torch.float32), dy.float().abs().amax(0)):
        raise AssertionError("amax_dy differs from torch's amax")
    us = {name: graph_us(step) for name, step in steps.items()}
    floor = 6 * rows * H / (copy_TBps * 1e12) * 1e6
    return {"rows": rows, "blocks": blocks, "us": us, "floor_us": floor, "f32_error_share_of_bound": share,
            "exact_over_f32": us["exact"] / us["f32"], "exact_wide_over_f32": us["exact_wide"] / us["f32"],
            "exact_and_amax_over_f32": (us["exact"] + us["amax_dy"]) / us["f32"],
            "quanta": quanta.tolist(), "quanta_wide": quanta_wide.tolist(), "flagged_blocks": flagged,
            "flagged_blocks_wide": flagged_wide}


def registers(k) -> dict:
    return {name: {"regs": k.get_function(name).attributes["num_regs"],
                   "local_bytes": k.get_function(name).attributes["local_size_bytes"]}
            for name in ("pass_f32", "pass_exact", "pass_exact_wide", "amax_dy")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", default="4097,32768")
    parser.add_argument("--blocks", default=str(BLOCKS),
                        help="row ranges (blocks) of every pass, a comma list: each size runs at each")
    parser.add_argument("--out")
    args = parser.parse_args()
    k = module()
    copy = copy_bandwidth(torch.device("cuda"), 2 ** 31)
    result = {"gpu": torch.cuda.get_device_name(0), "copy_TBps": copy, "H": H,
              "kernels": registers(k), "sizes": []}
    for rows, blocks in ((int(r), int(b)) for r in args.rows.split(",") for b in args.blocks.split(",")):
        entry = measure(rows, blocks, k, copy)
        result["sizes"].append(entry)
        print(f"rows {rows}, {blocks} blocks: f32 {entry['us']['f32']:.1f} us, exact {entry['us']['exact']:.1f} "
              f"({entry['exact_over_f32']:.2f}x), exact_wide {entry['us']['exact_wide']:.1f} "
              f"({entry['exact_wide_over_f32']:.2f}x), amax_dy {entry['us']['amax_dy']:.1f}, floor "
              f"{entry['floor_us']:.1f}, blocks flagged {entry['flagged_blocks']} / {entry['flagged_blocks_wide']}")
    print(json.dumps(result["kernels"]))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
