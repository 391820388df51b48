"""Latency against the number of rows, and adaln_lab's kernels against the bytes each must move.

Every timing is the harness's own (`adaln_lab.harness.latency`): eager `fwd_us` / `fwd_bwd_us_pure`
(CUDA events around one call after a synchronize), `host_fwd_us` / `host_fwd_bwd_us` (CPU time to
issue one call), `fwd_us_graph` / `fwd_bwd_us_graph` (CUDA-graph replay: the GPU's own time), the
autograd floor (an identity autograd.Function over the five leaves) and the memory floor (bytes
read once and written once at the copy bandwidth of the run). Eager time close to the host time
while far above the graph time means the call is bound by the host.

Shapes: x (S, H) bf16 for S in `rows`; parameters as in `harness.inputs.make`.

- `rows_sweep`: all of that for each candidate and number of rows.
- `kernel_bytes`: bytes each adaln_lab kernel reads and writes at S rows (from `adaln_lab.core.plan`).
- `kernel_profile`: device time per kernel of forward+backward calls (torch.profiler, CUDA only:
  CUPTI sees every kernel of the process, the ones adaln_lab launches through the driver too).
- `roofline`: the two together: achieved TB/s and multiple of each kernel's own floor.
- `sweep_kernels`: the committed per-kernel times of bench/results/<machine>/sweep.json (each kernel
  alone, back to back) for the kernels HEAD ships, as evidence where no GPU is at hand.
"""

from __future__ import annotations

import math

import torch

from ..harness.inputs import make
from ..harness.latency import (autograd_floor, copy_bandwidth, graph_latency, host_latency, latency,
                               memory_floor)

FULL_ROWS = (1, 64, 1024, 4097, 32768, 131072)
QUICK_ROWS = (1, 16, 256, 4096)
QUICK_SHAPE = {"H": 256, "D": 128, "T": 3}
FULL_SHAPE = {"H": 5376, "D": 2688, "T": 3}


def iterations(S: int, quick: bool) -> dict:
    """warmup / iters / graph replays per sample at S rows: fewer for the big sizes (bounded run time)."""
    if quick:
        return {"warmup": 1, "iters": 3, "replays": 3}
    return {"warmup": 5, "iters": 20, "replays": 10} if S <= 4097 else {"warmup": 3, "iters": 10, "replays": 5}


def rows_sweep(candidates, rows, device, shape: dict, quick: bool = False, seed: int = 1, bar=None) -> dict:
    """Per candidate and S in `rows`: eager, host and graph times (us), with the floors of the run.

    Returns {rows, shape, copy_TBps, memory_floor: {S: {fwd_us, fwd_bwd_us, ...}}, autograd_floor:
    {S: {autograd_floor_us, autograd_floor_host_us}}, candidates: {name: {S: {fwd_us,
    fwd_bwd_us_pure, host_fwd_us, host_fwd_bwd_us, fwd_us_graph, fwd_bwd_us_graph, ...}}}}.
    Order as in the report: eager timings first, graph captures last (torch.compile's last of all)
    on inputs made before the first capture. `bar` advances once per (candidate, S) and phase.
    """
    device = torch.device(device)
    H, D, T = shape["H"], shape["D"], shape["T"]
    copy = copy_bandwidth(device, (64 << 20) if quick or device.type != "cuda" else (2 << 30))
    inputs = {S: make(seed, S, device, **shape) for S in rows}
    out = {"rows": list(rows), "shape": dict(shape), "copy_TBps": copy,
           "memory_floor": {str(S): memory_floor(S, H, D, T, copy) for S in rows},
           "autograd_floor": {}, "candidates": {c.name: {} for c in candidates}}
    for c in candidates:
        for S in rows:
            it = iterations(S, quick)
            entry = latency(c.fn, inputs[S], it["warmup"], it["iters"])
            entry.update(host_latency(c.fn, inputs[S], it["warmup"], it["iters"]))
            out["candidates"][c.name][str(S)] = entry
            if bar is not None:
                bar.update()
    for S in rows:
        it = iterations(S, quick)
        out["autograd_floor"][str(S)] = autograd_floor(inputs[S], it["warmup"], it["iters"])
    for c in sorted(candidates, key=lambda c: c.name == "torch_compile"):
        for S in rows:
            it = iterations(S, quick)
            out["candidates"][c.name][str(S)].update(
                graph_latency(c.fn, inputs[S], it["warmup"], it["iters"], it["replays"]))
            if bar is not None:
                bar.update()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def _plan_numbers(S: int, H: int, D: int, T: int) -> tuple[int, int]:
    """(row ranges of the backward row pass, row blocks of table_bwd) from adaln_lab.core.plan, with
    the plan's TUNING (BWD_RANGES ranges, TB_ROWS rows per block) should the plan refuse the shape."""
    from ..core.plan import TUNING
    from ..core.plan import plan as make_plan

    try:
        p = make_plan(H, D, T)
        return max(p.rows(S).bwd_ranges, 1), p.blocks_j
    except Exception:  # noqa: BLE001 - a shape the kernels refuse still gets its byte model
        return max(min(S, TUNING["BWD_RANGES"]), 1), math.ceil(2 * H / TUNING["TB_ROWS"])


def kernel_bytes(S: int, H: int, D: int, T: int) -> dict:
    """Bytes each adaln_lab kernel must read plus write at S rows of bf16 x (the kernels' arguments).

    table_act: temb in, bf16(silu(temb)) out. table_bf16: that, weight, bias in; bf16 and fp32 table out.
    norm_modulate_bf16: x, norm_weight,
    bf16 table, indices in; out and rstd out (its two other kernels, norm_modulate_warp_bf16 and
    norm_modulate_rowwise_bf16, the same bytes). norm_modulate_bwd_bf16: dy, x, rstd, norm_weight,
    fp32 table, indices in; dx and the row partials (ranges, T, 2, H) fp32 out.
    reduce_partials_bf16: the partials, norm_weight, fp32 table in; d_table fp32, d_norm_weight,
    d_bias out. table_bwd_bf16: d_table, temb, weight in; d_weight and the activation partials
    (blocks, T, D) fp32 out. table_bwd_reduce: the partials, temb in; d_temb out.
    """
    ranges, blocks = _plan_numbers(S, H, D, T)
    rows, weight = S * H * 2, 2 * H * D * 2
    table16, table32 = T * 2 * H * 2, T * 2 * H * 4
    temb, partials, dact = T * D * 4, ranges * T * 2 * H * 4, blocks * T * D * 4
    act = T * D * 2  # table.cu's bf16(silu(temb)), written by table_act, read by table_bf16
    forward = {
        "table_act": temb + act,
        "table_bf16": act + weight + 2 * H * 2 + table16 + table32,
        "norm_modulate_bf16": 2 * rows + H * 2 + table16 + S * 8 + S * 4,
    }
    forward["norm_modulate_rowwise_bf16"] = forward["norm_modulate_warp_bf16"] = forward["norm_modulate_bf16"]
    backward = {
        "norm_modulate_bwd_bf16": 3 * rows + S * 4 + H * 2 + table32 + S * 8 + partials,
        "reduce_partials_bf16": partials + H * 2 + table32 + table32 + H * 2 + 2 * H * 2,
        "table_bwd_bf16": table32 + temb + weight + weight + dact,
        "table_bwd_reduce": dact + temb + temb,
    }
    return {**forward, **backward}


def kernel_table(events, iters: int) -> list[dict]:
    """Sum (name, device us) kernel events of `iters` calls into [{name, calls, us}] per call, largest first."""
    table: dict[str, list] = {}
    for name, us in events:
        entry = table.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += us
    rows = [{"name": name, "calls": n / iters, "us": total / iters} for name, (n, total) in table.items()]
    return sorted(rows, key=lambda r: -r["us"])


def kernel_profile(fn, inputs, iters: int = 5, warmup: int = 3) -> list[dict] | None:
    """Device time per kernel of one forward+backward (all-ones gradient) of `fn`, mean of `iters`
    profiled calls after `warmup`: [{name, calls, us}] per call. None off CUDA."""
    if inputs.x.device.type != "cuda":
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    leaves = [t.detach().clone().requires_grad_(True) for t in inputs.leaves]
    ones = torch.ones_like(inputs.x)

    def step():
        for leaf in leaves:
            leaf.grad = None
        fn(*leaves, inputs.timestep_indices).backward(ones)

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    events = [(e.name, e.time_range.elapsed_us()) for e in prof.events() if e.device_type == DeviceType.CUDA]
    return kernel_table(events, iters)


def roofline(kernels: list[dict], S: int, shape: dict, copy_TBps: float) -> list[dict]:
    """Each profiled kernel with its bytes (None where the byte model does not know it), achieved
    TB/s, its own floor (bytes at the copy bandwidth, us) and its time as a multiple of that floor."""
    model = kernel_bytes(S, shape["H"], shape["D"], shape["T"])
    out = []
    for k in kernels:
        nbytes = next((b for name, b in model.items() if k["name"] == name or k["name"].startswith(name + "(")), None)
        floor = nbytes / copy_TBps / 1e6 if nbytes else None
        out.append({**k, "bytes": nbytes, "TBps": nbytes / k["us"] / 1e6 if nbytes and k["us"] else None,
                    "floor_us": floor, "x_floor": k["us"] / floor if floor else None})
    return out


# The kernels HEAD ships, as adaln_lab/bench/sweep.py names them in its "default" (HEAD's plan) entries; its
# "table_bwd+reduce" is table_bwd and its reduce together, which the profile inside the calls
# (lab_latency.json) shows apart.
SHIPPED = {"table_bf16": ("default", "table"), "norm_modulate_warp_bf16": ("default", "norm_modulate"),
           "norm_modulate_bwd_bf16": ("default", "norm_modulate_bwd"),
           "reduce_partials_bf16": ("default", "reduce_partials")}


def sweep_kernels(sweep: dict, S: int) -> list[dict]:
    """[{name, calls, us}] of the shipped kernels at S rows from an adaln_lab/bench/sweep.py JSON (each
    kernel timed alone, back to back): those of `SHIPPED`."""
    out = []
    for name, (config, key) in SHIPPED.items():
        us = sweep.get(f"{S} {config}", {}).get("us", {}).get(key)
        if us is not None:
            out.append({"name": name, "calls": 1.0, "us": us})
    return out


def sweep_roofline(sweep: dict, S: int, shape: dict, copy_TBps: float) -> list[dict]:
    """`roofline` of `sweep_kernels`."""
    model = kernel_bytes(S, shape["H"], shape["D"], shape["T"])
    out = []
    for k in sweep_kernels(sweep, S):
        nbytes = model[k["name"]]
        floor = nbytes / copy_TBps / 1e6
        out.append({**k, "bytes": nbytes, "TBps": nbytes / k["us"] / 1e6, "floor_us": floor,
                    "x_floor": k["us"] / floor})
    return out


def measure(candidates, device, quick: bool = False, seed: int = 1, bar=None, rows=None,
            profile_rows=None) -> dict:
    """lab_latency.json: `sweep` (rows_sweep) and `kernels` ({S: roofline of adaln_lab's profile},
    empty off CUDA or without an adaln_lab candidate)."""
    device = torch.device(device)
    shape = dict(QUICK_SHAPE if quick else FULL_SHAPE)
    rows = tuple(rows or (QUICK_ROWS if quick else FULL_ROWS))
    profile_rows = tuple(profile_rows or ((256,) if quick else (4097, 32768)))
    lab = next((c for c in candidates if c.name == "adaln_lab"), None)
    profiled = lab is not None and device.type == "cuda"
    # inputs made before any CUDA-graph capture (a failed capture can leave the CUDA RNG unusable)
    profile_inputs = {S: make(seed, S, device, **shape) for S in profile_rows} if profiled else {}
    data = {"kind": "adaln_lab_lab_latency", "candidates": {c.name: c.source for c in candidates},
            "warnings": {c.name: c.warning for c in candidates if c.warning},
            "sweep": rows_sweep(candidates, rows, device, shape, quick, seed, bar), "kernels": {},
            "kernels_error": None}
    for S, inputs in profile_inputs.items():
        try:
            profile = kernel_profile(lab.fn, inputs)
            if profile:
                data["kernels"][str(S)] = roofline(profile, S, shape, data["sweep"]["copy_TBps"])
            else:
                data["kernels_error"] = "the profiler saw no CUDA kernel"
        except Exception as error:  # noqa: BLE001 - a profiler that fails is reported, the rest kept
            data["kernels_error"] = f"{type(error).__name__}: {error}"[:400]
        if bar is not None:
            bar.update()
    return data


def host_bound_rows(sweep: dict, name: str) -> list[int]:
    """The rows of a rows_sweep at which `name`'s host time to issue forward+backward exceeds its
    GPU (graph) time: there an eager call waits on the host, whatever its kernels do."""
    out = []
    for S in sweep["rows"]:
        e = sweep["candidates"][name][str(S)]
        if e.get("fwd_bwd_us_graph") is not None and e["host_fwd_bwd_us"] > e["fwd_bwd_us_graph"]:
            out.append(S)
    return out
