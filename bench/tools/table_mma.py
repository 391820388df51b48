"""A candidate table kernel on tensor cores (table_mma.cu) against the shipped one and cuBLAS, T 1 to 1024."""

# The table on tensor cores (table_mma.cu beside this file), checked and timed against the shipped table kernel and
# cuBLAS's F.linear, for T from 1 to 1024, at norm_out's width (H 5376, D 2688: N = 2H = 10752 columns).
#
# Checks, every T (the seed protocol's temb, weight and bias, `adaln_lab.harness.inputs.make`):
# - error of table_f32 against the float64 golden of bf16(silu(temb)) @ weight^T + bias, as a share of the
#   conditioning sum_k |act w| (the fp32 accumulation bound's scale), beside the shipped kernel's (T <= 9);
# - the bf16 table bitwise against F.linear's (cuBLAS: diffusers' own table) and the shipped kernel's;
# - T-invariance: rows computed alone (T = 1) and in windows of 3 at another tile position, bitwise the batch's;
# - column slices (offsets multiples of 8) computed alone, bitwise the full table's columns; a second run bitwise.
# Times: CUDA-graph replays between CUDA events (GPU time, no host), medians, three weight copies rotated (174 MB,
# past the 50 MB L2), the report's copy bandwidth measured in the same run; floor = (weight + outputs) bytes at it.
#
#     python3 bench/tools/table_mma.py [--out FILE.json] [--quick]

from __future__ import annotations

import argparse
import json
import pathlib
import statistics

import cupy
import numpy
import torch
import torch.nn.functional as F

from adaln_lab.core import tensors
from adaln_lab.harness.inputs import make
from adaln_lab.harness.latency import copy_bandwidth

HERE = pathlib.Path(__file__).parent
VARIANTS = {(1, 1, 4), (2, 1, 4), (1, 1, 2), (1, 2, 4), (2, 2, 4), (2, 4, 3), (1, 4, 4), (1, 8, 2), (1, 8, 3)}
TS = (1, 3, 8, 10, 16, 32, 64, 256, 1024)


def default_variant(T: int) -> tuple:
    return (1, 1, 4) if T <= 8 else (1, 2, 4) if T <= 16 else (1, 4, 4) if T <= 32 else (1, 8, 2)


class Mma:
    def __init__(self):
        names = [f"table_mma<{m}, {n}, {p}>" for m, n, p in sorted(VARIANTS)]
        self.module = cupy.RawModule(code=(HERE / "table_mma.cu").read_text(), options=("--std=c++17",),
                                     name_expressions=names)
        self.kernels = {v: self.module.get_function(name) for v, name in zip(sorted(VARIANTS), names)}
        self.silu = self.module.get_function("silu_bf16")

    def __call__(self, temb, weight, bias, variant=None, act=None):
        T, D = temb.shape
        N = weight.shape[0]
        m, n, p = variant or default_variant(T)
        stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
        with stream:
            if act is None:
                act = torch.empty(T, D, dtype=torch.bfloat16, device=temb.device)
                self.silu((min(132 * 4, -(-T * D // 256)),), (256,), (ptr(temb), ptr(act), numpy.int32(T * D)))
            table = torch.empty(T, N, dtype=torch.bfloat16, device=temb.device)
            table_f32 = torch.empty(T, N, dtype=torch.float32, device=temb.device)
            grid = (-(-T // (8 * n)), -(-N // (16 * m)))
            self.kernels[(m, n, p)](grid, (256,), (ptr(act), ptr(weight), ptr(bias), ptr(table), ptr(table_f32),
                                                   numpy.int32(T), numpy.int32(N), numpy.int32(D)))
        return table, table_f32, act


def ptr(t: torch.Tensor):
    return numpy.uint64(t.data_ptr())


def golden(act, weight, bias):
    a, w = act.double(), weight.double()
    return a @ w.T + bias.double(), a.abs() @ w.abs().T


def checks(mma, T: int) -> dict:
    i = make(0, 1, "cuda", T=T)
    temb, weight, bias = i.temb, i.weight, i.bias
    table, table_f32, act = mma(temb, weight, bias)
    act_torch = F.silu(temb).to(torch.bfloat16)
    exact, cond = golden(act, weight, bias)
    err = ((table_f32.double() - exact).abs() / cond.clamp_min(1e-300)).max().item()
    cublas = F.linear(act, weight, bias)
    out = {"T": T, "variant": default_variant(T), "act_equal_torch": (act == act_torch).float().mean().item(),
           "err_over_cond": err, "bf16_equal_cublas": (table == cublas).float().mean().item()}
    again = mma(temb, weight, bias)
    out["repeat_bitwise"] = bool(torch.equal(again[0], table) and torch.equal(again[1], table_f32))
    if T * 2688 <= 24576:
        shipped, shipped_f32 = tensors.table(temb, weight, bias)
        out["shipped_err_over_cond"] = ((shipped_f32.double() - exact).abs() / cond.clamp_min(1e-300)).max().item()
        out["shipped_bf16_equal_cublas"] = (shipped == cublas).float().mean().item()
        out["bf16_equal_shipped"] = (table == shipped).float().mean().item()
    rows = range(T) if T <= 16 else sorted(set(torch.randint(0, T, (24,), generator=torch.Generator().manual_seed(T))
                                               .tolist()) | {0, T - 1})
    alone = all(torch.equal(mma(temb[r:r + 1], weight, bias, act=act[r:r + 1])[1], table_f32[r:r + 1]) for r in rows)
    windows = all(torch.equal(mma(temb[r:r + 3], weight, bias, act=act[r:r + 3].contiguous())[1], table_f32[r:r + 3])
                  for r in rows if r + 3 <= T)
    out["rows_alone_bitwise"], out["rows_in_windows_of_3_bitwise"] = alone, windows
    g = torch.Generator().manual_seed(7)
    slices = []
    for _ in range(4):
        a = 8 * int(torch.randint(0, 10752 // 8 - 1, (1,), generator=g))
        b = min(10752, a + 8 * int(torch.randint(1, 300, (1,), generator=g)))
        part, part_f32, _ = mma(temb, weight[a:b].contiguous(), bias[a:b].contiguous(), act=act)
        slices.append(bool(torch.equal(part_f32, table_f32[:, a:b]) and torch.equal(part, table[:, a:b])))
    out["column_slices_bitwise"] = all(slices)
    other = [v for v in VARIANTS if v != default_variant(T)]
    out["other_variants_bitwise"] = all(torch.equal(mma(temb, weight, bias, variant=v, act=act)[1], table_f32)
                                        for v in other)
    return out


def median_us(fn, copies, batches=9, per_batch=12) -> float:
    """GPU time of one call: `per_batch` calls (weight copies rotated) captured in a CUDA graph, replayed `batches`
    times between CUDA events; the median over replays, per call."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for k in range(3):
            fn(k % len(copies))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for k in range(per_batch):
            fn(k % len(copies))
    graph.replay()
    times = []
    for _ in range(batches):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / per_batch)
    return statistics.median(times)


def timings(mma, T: int, bw: float) -> dict:
    i = make(0, 1, "cuda", T=T)
    copies = [(i.weight.clone(), i.bias.clone()) for _ in range(3)]
    temb = i.temb
    N, D = i.weight.shape
    out = {"T": T}
    out["mma_us"] = median_us(lambda k: mma(temb, *copies[k]), copies)
    for v in sorted(VARIANTS):
        if v[1] * 8 >= min(T, 64) and (v[1] == 1 or v[1] * 8 < 2 * T):
            out[f"mma{v}_us"] = median_us(lambda k, v=v: mma(temb, *copies[k], variant=v), copies)
    out["cublas_us"] = median_us(lambda k: F.linear(F.silu(temb).to(torch.bfloat16), *copies[k]), copies)
    if T * D <= 24576:
        out["shipped_us"] = median_us(lambda k: tensors.table(temb, *copies[k]), copies)
    floor_bytes = N * D * 2 + T * N * 6 + T * D * 6
    out["floor_us"] = floor_bytes / bw / 1e6
    out["mma_fraction_of_copy_bw"] = out["floor_us"] / out["mma_us"]
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path)
    parser.add_argument("--quick", action="store_true", help="T 1, 3, 8, 64 only")
    args = parser.parse_args(argv)
    ts = (1, 3, 8, 64) if args.quick else TS
    mma = Mma()
    result = {"gpu": torch.cuda.get_device_name(), "checks": [], "times": []}
    for T in ts:
        c = checks(mma, T)
        print(json.dumps(c), flush=True)
        result["checks"].append(c)
    bw = copy_bandwidth(torch.device("cuda"), 1 << 30)  # the report's copy bandwidth
    result["copy_TBps"] = bw
    print(f"copy {bw:.2f} TB/s", flush=True)
    for T in ts:
        t = timings(mma, T, bw)
        print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in t.items()}), flush=True)
        result["times"].append(t)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
