"""The table on tensor cores (table.cu) against cuBLAS's F.linear for T from 1 to T_MAX: bitwise checks, GPU times."""

# At norm_out's width (H 5376, D 2688: N = 2H = 10752 columns), the seed protocol's temb, weight and bias
# (`adaln_lab.harness.inputs.make`), every T:
# - error of table_f32 against the float64 golden of bf16(silu(temb)) @ weight^T + bias, as a share of the
#   conditioning sum_k |act w| (the fp32 accumulation bound's scale);
# - the bf16 table bitwise against F.linear's (cuBLAS: diffusers' own table);
# - T-invariance: rows computed alone (T = 1) and in windows of 3 at another tile position, bitwise the batch's;
# - column slices (offsets multiples of 16) computed alone, bitwise; other tile shapes (TILES), bitwise and timed;
#   a second run bitwise.
# Times: CUDA-graph replays between CUDA events (GPU time, no host), medians, three weight copies rotated (174 MB,
# past the 50 MB L2), the report's copy bandwidth measured in the same run; floor = (weight + outputs) bytes at it.
#
#     python3 bench/tools/table_mma.py [--out FILE.json] [--quick] [--ts T,...] [--tiles MTxNTxAHEAD,...]
#         [--tile-ts T,...]

from __future__ import annotations

import argparse
import json
import contextlib
import pathlib

import torch
import torch.nn.functional as F
from cupy.cuda.compiler import CompileException

from adaln_lab.bench.timing import graph_us
from adaln_lab.core import launchers, plan as plan_module, tensors
from adaln_lab.harness.inputs import make
from adaln_lab.harness.latency import copy_bandwidth

TILES = ((1, 1, 4), (2, 1, 2), (4, 1, 2), (2, 4, 3))  # other tile shapes (MT, NT, AHEAD), at T = 3 and 10 only (each
TILE_TS = (3, 10)                                      # one a compile of the whole unit)
TS = (1, 3, 8, 10, 16, 32)


@contextlib.contextmanager
def tile(shape):
    """table.cu compiled with one tile shape (MT, NT, AHEAD) for every T."""
    saved = plan_module.TUNING["TABLE_TILES"]
    plan_module.TUNING["TABLE_TILES"] = ((plan_module.T_MAX, *shape),)
    launchers.forget_compiled()
    try:
        yield
    finally:
        plan_module.TUNING["TABLE_TILES"] = saved
        launchers.forget_compiled()


def mma(temb, weight, bias):
    """(table bf16, table_f32): norm_out's table kernel, tensors.table."""
    return tensors.table(temb, weight, bias)


def golden(act, weight, bias):
    a, w = act.double(), weight.double()
    return a @ w.T + bias.double(), a.abs() @ w.abs().T


def checks(T: int, tile_ts=TILE_TS, tiles=TILES) -> dict:
    i = make(0, 1, "cuda", T=T)
    temb, weight, bias = i.temb, i.weight, i.bias
    table, table_f32 = mma(temb, weight, bias)
    act = F.silu(temb).to(torch.bfloat16)
    exact, cond = golden(act, weight, bias)
    err = ((table_f32.double() - exact).abs() / cond.clamp_min(1e-300)).max().item()
    out = {"T": T, "tile": plan_module.plan(5376, 2688, T).table_tile, "err_over_cond": err,
           "bf16_equal_cublas": (table == F.linear(act, weight, bias)).float().mean().item()}
    again = mma(temb, weight, bias)
    out["repeat_bitwise"] = bool(torch.equal(again[0], table) and torch.equal(again[1], table_f32))
    out["rows_alone_bitwise"] = all(torch.equal(mma(temb[r:r + 1], weight, bias)[1], table_f32[r:r + 1])
                                    for r in range(T))
    out["rows_in_windows_of_3_bitwise"] = all(torch.equal(mma(temb[r:r + 3], weight, bias)[1], table_f32[r:r + 3])
                                              for r in range(T - 2))
    g = torch.Generator().manual_seed(7)
    slices = []
    for _ in range(4):
        a = 16 * int(torch.randint(0, 10752 // 16 - 1, (1,), generator=g))  # norm_out's table: 2H' columns, 8 | H'
        b = min(10752, a + 16 * int(torch.randint(1, 150, (1,), generator=g)))
        part, part_f32 = tensors.table(temb, weight[a:b].contiguous(), bias[a:b].contiguous())
        slices.append(bool(torch.equal(part_f32, table_f32[:, a:b]) and torch.equal(part, table[:, a:b])))
    out["column_slices_bitwise"] = all(slices)
    if T in tile_ts:
        same = []
        for shape in tiles:
            try:
                with tile(shape):
                    same.append(torch.equal(mma(temb, weight, bias)[1], table_f32))
            except CompileException as e:  # a shape that does not compile (shared memory): named, the others go on
                out[f"tile{shape}_error"] = compile_error(e)
        out["other_tiles_bitwise"] = all(same) if len(same) == len(tiles) else None  # None: a shape did not run
    return out


def compile_error(e: Exception) -> str:
    """The last line of a compile error (ptxas names the resource), or its repr."""
    return (str(e).strip().splitlines() or [repr(e)])[-1][:200]


def median_us(fn, copies, per_batch=12) -> float:
    """GPU time of one call: `per_batch` calls (weight copies rotated) captured in one CUDA graph, its replays timed
    by `adaln_lab.bench.timing.graph_us` (medians of back-to-back replays between CUDA events), per call."""
    return graph_us(lambda: [fn(k % len(copies)) for k in range(per_batch)]) / per_batch


def timings(T: int, bw: float, tile_ts=TILE_TS, tiles=TILES) -> dict:
    i = make(0, 1, "cuda", T=T)
    copies = [(i.weight.clone(), i.bias.clone()) for _ in range(3)]
    temb = i.temb
    N, D = i.weight.shape
    out = {"T": T, "table_us": median_us(lambda k: mma(temb, *copies[k]), copies)}
    for shape in tiles if T in tile_ts else ():
        try:
            with tile(shape):
                out[f"tile{shape}_us"] = median_us(lambda k: mma(temb, *copies[k]), copies)
        except CompileException as e:  # as in checks
            out[f"tile{shape}_error"] = compile_error(e)
    out["cublas_us"] = median_us(lambda k: F.linear(F.silu(temb).to(torch.bfloat16), *copies[k]), copies)
    out["floor_us"] = (N * D * 2 + T * N * 6 + T * D * 4) / bw / 1e6
    out["fraction_of_copy_bw"] = out["floor_us"] / out["table_us"]
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path)
    parser.add_argument("--quick", action="store_true", help="T 1, 3 and 10 only; other tiles checked at T 3, "
                        "not timed")
    parser.add_argument("--ts", help="T values, comma-separated (default: 1,3,8,10,16,32)")
    parser.add_argument("--tiles", help="other tile shapes MTxNTxAHEAD, comma-separated (default: TILES)")
    parser.add_argument("--tile-ts", help="T values, comma-separated, that check and time the other tiles "
                        "(default: 3,10)")
    args = parser.parse_args(argv)
    ts, check_tiles, time_tiles = ((1, 3, 10), (3,), ()) if args.quick else (TS, TILE_TS, TILE_TS)
    if args.ts:
        ts = tuple(int(t) for t in args.ts.split(","))
    if args.tile_ts:
        check_tiles = tuple(int(t) for t in args.tile_ts.split(","))
        time_tiles = () if args.quick else check_tiles  # --quick times no other tile
    tiles = tuple(tuple(int(v) for v in t.split("x")) for t in args.tiles.split(",")) if args.tiles else TILES
    result = {"gpu": torch.cuda.get_device_name(), "checks": [], "times": []}
    for T in ts:
        c = checks(T, check_tiles, tiles)
        print(json.dumps(c), flush=True)
        result["checks"].append(c)
    bw = copy_bandwidth(torch.device("cuda"), 1 << 30)  # the report's copy bandwidth
    result["copy_TBps"] = bw
    print(f"copy {bw:.2f} TB/s", flush=True)
    for T in ts:
        t = timings(T, bw, time_tiles, tiles)
        print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in t.items()}), flush=True)
        result["times"].append(t)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
