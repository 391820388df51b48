"""The report: every check of the harness on candidates (built-in names or any callable), in the seed
report's schema.

Same keys as tests/data/seed_prior_art_b200.json (so the files read side by side), with
`adaln_lab_commit` where the seed has `rl_kernel_commit`, plus: the measured copy bandwidth
(`copy_TBps`), the memory floor per size (`memory_floor`), the autograd floor of the run
(`autograd_floor_us`, `autograd_floor_host_us`), per size and candidate the pure
forward+backward time, CUDA-graph, inference-mode and host (issue) times, the spread of each
timing's samples (`spread_us`) and the fraction of copy bandwidth achieved, for adaln_lab its
forward parity with diffusers, and `schema_notes`, which explains the keys kept only for the seed's
schema and every timing key. On a CPU the memory floor's times and the floor fractions are null
(reason in `floor_null_reason`): torch's CPU code is nowhere near streaming at copy bandwidth.

Order of work: every candidate's invariance, accuracy and eager timings first, then the autograd
floor, then the CUDA-graph timings of all candidates and sizes last (torch.compile's candidate
last of all), on inputs made before the first capture: a failed capture can leave the CUDA RNG
that `inputs.make` draws from unusable, and it must not cost the rest of the report.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path

import torch

from . import estimate, invariance
from .accuracy import accuracy, parity
from .candidates import Named, adaln_lab_candidate, diffusers_candidate, resolve
from .inputs import make, upstream
from .latency import (autograd_floor, copy_bandwidth, graph_latency, host_latency, inference_latency,
                      latency, memory_floor)
from .output import write  # noqa: F401 - `report.write`, as before
from .progress import progress, write as progress_write
from .protocol import FULL, QUICK, Protocol

LIBRARIES = ("torch", "triton", "diffusers", "cupy-cuda13x", "numba-cuda", "numpy", "ml_dtypes",
             "liger-kernel", "vllm", "flashinfer-python", "sglang", "transformer_engine", "megatron-core")
REPO = Path(__file__).resolve().parents[3]  # the checkout: src/adaln_lab/harness/report.py
GRAPH_KEYS = ("fwd_us_graph", "fwd_bwd_us_graph", "fwd_us_graph_error", "fwd_bwd_us_graph_error")
CPU_FLOOR = ("null on a CPU: torch's CPU code does not stream memory at copy bandwidth, so a multiple of this "
             "floor would say nothing (the byte counts stand)")

SCHEMA_NOTES = {
    "seed": "'seed' in names ('seed report', 'seed protocol', 'seed_prior_art') means the prior-art report "
            "tests/data/seed_prior_art_b200.json (RL-Kernel, NVIDIA B200): this report copies its schema "
            "key for key so the two read side by side, and runs its protocol. The protocol's `seeds`, "
            "`sub_batch_seeds` and `accuracy_seed` are RNG seeds of `inputs.make`, unrelated.",
    "rfc": "kept from the seed report's schema (there it names the RL-Kernel RFC the report belonged to); "
           "unused here, always null.",
    "kind": "'adaln_lab_report' (the seed's is 'h3_prior_art').",
    "adaln_lab_commit": "the seed's rl_kernel_commit: the commit measured (ADALN_LAB_COMMIT wins over git).",
    "fwd_us": "eager forward, leaves requiring grad; CUDA events around each call after a synchronize "
              "(wall clock on CPU), median of protocol.iters samples after protocol.warmup calls.",
    "fwd_bwd_us": "seed protocol: clone the five leaves, forward, backward with an all-ones gradient, all timed.",
    "fwd_bwd_us_pure": "forward + backward (all-ones gradient) on prepared leaves whose grads are reset; timed "
                       "like fwd_us.",
    "fwd_us_inference": "forward under torch.inference_mode() on inputs not requiring grad; timed like fwd_us.",
    "host_fwd_us": "CPU wall time (perf_counter) to issue the forward, nothing waited on (synchronize before "
                   "each sample, outside the clock); median. On a CPU the work runs inside the call.",
    "host_fwd_bwd_us": "like host_fwd_us for forward + .backward() (until it returns), grads reset outside the clock.",
    "fwd_us_graph": "the forward captured once in a torch.cuda.CUDAGraph and replayed: median over samples of "
                    "(CUDA-event time of 10 back-to-back replays) / 10, after warm-up replays; the GPU's own "
                    "time. null when the capture failed or there is no CUDA, reason in fwd_us_graph_error.",
    "fwd_bwd_us_graph": "like fwd_us_graph for forward + backward (all-ones gradient, grads made inside the "
                        "capture); reason of a null in fwd_bwd_us_graph_error.",
    "autograd_floor_us": "once per run: forward + backward of an identity autograd.Function over the five leaves "
                         "(no GPU work, five AccumulateGrad of preallocated gradients), timed like fwd_bwd_us_pure, "
                         "at the first accuracy size.",
    "autograd_floor_host_us": "the same identity call timed like host_fwd_bwd_us: what torch autograd alone costs "
                              "the host per forward+backward.",
    "memory_floor": "per size: bytes read once and written once (fwd_bytes, fwd_bwd_bytes) over copy_TBps; on a "
                    "CPU fwd_us and fwd_bwd_us are null, reason in floor_null_reason (so are the candidates' "
                    "fwd_floor_fraction and fwd_bwd_floor_fraction).",
    "copy_TBps": "measured device-to-device copy bandwidth (host memory on a CPU), (read + write) / median time.",
    "spread_us": "per timing key of an accuracy_latency entry, its samples: min, p25, median, p75, max (us) and n; "
                 "median is the key's value.",
    "diffusers_replay": "the row of the 'diffusers' candidate where diffusers is not importable: adaln_lab's "
                        "op-for-op replay of diffusers' module, not diffusers (replay_of: 'diffusers').",
    "rows_invariant": "the three row checks alone (all_rows, full_vs_sub_batches, batch_size_sweep): no row whose "
                      "output or dx differs; `batch_invariant` (the seed's verdict) also needs params_repeatable.",
    "rowgrad_differ": "rows whose dx (the gradient of x) is not bitwise equal to the reference row's; fwd_differ "
                      "the same for the output.",
    "fwd_max_abs_diff": "the largest |diff| among the elements that differ (rowgrad_max_abs_diff: of dx); 0 when "
                        "none; first_differ: where the first differing row was (null when none).",
}


def _version(name: str):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git(*args: str):
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def provenance() -> dict:
    """The commit measured and whether tracked files differ from it.

    ADALN_LAB_COMMIT, when set, names the commit of a copied tree and wins over git: a copy can
    carry a stale .git (the H200 run of 574ba6f found one at 41b0f59 and reported that commit,
    dirty). The dirty flag is then git's answer only when git's HEAD is that very commit, else null
    (unknown) rather than a guess. Without the variable, git's HEAD and status are used.
    """
    named = os.environ.get("ADALN_LAB_COMMIT")
    head = _git("rev-parse", "HEAD")
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no")) if head is not None else None
    if named:
        same = head is not None and head.startswith(named)
        return {"adaln_lab_commit": head if same else named, "tracked_tree_dirty": dirty if same else None}
    return {"adaln_lab_commit": head, "tracked_tree_dirty": dirty}


def environment(device: torch.device) -> dict:
    cuda = device.type == "cuda"
    return {
        "gpu": torch.cuda.get_device_name(device) if cuda else None,
        "capability": list(torch.cuda.get_device_capability(device)) if cuda else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "tf32": bool(torch.backends.cuda.matmul.allow_tf32),
        "libraries": {name: _version(name) for name in LIBRARIES},
        "megatron_source_commit": None,
        "mode_environment": {"plain": {}},
        "device": str(device),
        "cpu": platform.processor() or platform.machine(),
    }


def batch_invariance(fn, protocol: Protocol, device: torch.device) -> dict:
    """The four checks of `invariance` on `fn`; `rows_invariant` is the three row checks alone,
    `batch_invariant` the seed's verdict (those and `params_repeatable`)."""
    p = protocol
    checks = progress(4, "batch invariance", unit="check", leave=True)
    checks.set_postfix_str("all_rows")
    report = {"all_rows": invariance.all_rows(fn, p.all_rows_sizes, p.seeds, device, p.shape)}
    checks.update()
    checks.set_postfix_str("params_repeatable")
    batch = make(p.seeds[0], p.accuracy_sizes[0], device, **p.shape)
    repeat = invariance.params_repeatable(fn, batch, upstream(p.seeds[0], batch.x))
    report["params_repeatable"] = all(repeat.values())
    report["params_repeatable_each"] = repeat
    checks.update()
    checks.set_postfix_str("full_vs_sub_batches")
    report["full_vs_sub_batches"] = invariance.full_vs_sub_batches(
        fn, p.full_batch, p.sub_batch_sizes, p.sub_batch_seeds, p.small_limit, p.small_step, device, p.shape)
    checks.update()
    checks.set_postfix_str("batch_size_sweep")
    report["batch_size_sweep"] = invariance.batch_size_sweep(
        fn, p.sweep_sizes, p.probe_rows, p.pool_size, p.seeds, device, p.shape)
    checks.update()
    checks.close()
    report["rows_invariant"] = invariance.rows_invariant(report)
    report["batch_invariant"] = invariance.batch_invariant(report)
    return report


def accuracy_latency(candidate: Named, protocol: Protocol, device: torch.device, floors: dict) -> dict:
    """Per accuracy size: errors, timings, `spread_us` of their samples and the floor fractions (null
    where the floor is, on a CPU)."""
    out = {}
    for S in protocol.accuracy_sizes:
        inputs = make(protocol.accuracy_seed, S, device, **protocol.shape)
        entry = accuracy(candidate.fn, inputs, upstream(protocol.accuracy_seed, inputs.x))
        spread: dict = {}
        entry.update(latency(candidate.fn, inputs, protocol.warmup, protocol.iters, spread))
        entry["fwd_us_inference"] = inference_latency(candidate.fn, inputs, protocol.warmup, protocol.iters, spread)
        entry.update(host_latency(candidate.fn, inputs, protocol.warmup, protocol.iters, spread))
        entry.update(dict.fromkeys(GRAPH_KEYS))  # filled by graph_timings, after every other measurement
        entry["spread_us"] = spread
        floor = floors[str(S)]
        for key, timed in (("fwd", "fwd_us"), ("fwd_bwd", "fwd_bwd_us_pure")):
            entry[f"{key}_floor_fraction"] = (None if floor[f"{key}_us"] is None
                                              else floor[f"{key}_us"] / entry[timed])
        out[str(S)] = entry
    return out


def floors_of(protocol: Protocol, copy: float, device: torch.device) -> dict:
    """`memory_floor` per accuracy size; on a CPU its times are null with `floor_null_reason`."""
    floors = {str(S): memory_floor(S, protocol.H, protocol.D, protocol.T, copy) for S in protocol.accuracy_sizes}
    if device.type != "cuda":
        for floor in floors.values():
            floor.update(fwd_us=None, fwd_bwd_us=None, floor_null_reason=CPU_FLOOR)
    return floors


def forward_parity(protocol: Protocol, device: torch.device) -> dict:
    """adaln_lab's forward against diffusers', for both table backends, at the accuracy sizes."""
    baseline = diffusers_candidate().fn
    out = {}
    for table_backend in ("cuda", "torch"):
        fn = adaln_lab_candidate(table_backend).fn
        out[f"table_backend={table_backend}"] = {
            str(S): parity(fn, baseline, make(protocol.accuracy_seed, S, device, **protocol.shape))
            for S in protocol.accuracy_sizes}
    return out


def graph_timings(candidates: list[Named], protocol: Protocol, device: torch.device, results: dict) -> None:
    """CUDA-graph timings of every candidate and size into `results[name][S]` (accuracy_latency
    entries). Inputs for all sizes are made before the first capture; torch.compile's candidate
    goes last, so that a capture failure, which can leave CUDA unwell, touches the others least."""
    inputs = {str(S): make(protocol.accuracy_seed, S, device, **protocol.shape) for S in protocol.accuracy_sizes}
    order = sorted(candidates, key=lambda c: c.name == "torch_compile")
    for candidate in (progress(None, "cuda graphs", unit="candidate", leave=True, iterable=order)
                      if device.type == "cuda" else order):
        for S, batch in inputs.items():
            entry = results[candidate.name][S]
            figures = graph_latency(candidate.fn, batch, protocol.warmup, protocol.iters,
                                    spread=entry.setdefault("spread_us", {}))
            entry.update(figures)
            for key in ("fwd_us_graph", "fwd_bwd_us_graph"):
                if figures[key] is None and figures[key + "_error"] != "no CUDA":
                    progress_write(f"[adaln_lab report] {candidate.name} @{S}: {key} capture failed: "
                                   f"{figures[key + '_error']}")
        if device.type == "cuda":
            torch.cuda.empty_cache()


def announce(candidate: Named, device: torch.device) -> str:
    """The one line the report prints per candidate: what its row really runs (and a warning)."""
    line = f"[adaln_lab report] candidate {candidate.name} on {device}: {candidate.source}"
    return line + (f"  !! WARNING: {candidate.warning}" if candidate.warning else "")


def announce_estimate(candidates: list[Named], protocol: Protocol, device: torch.device) -> float:
    """Time a few calls of each candidate, print the whole run's extrapolated time; return its seconds."""
    batches = estimate.report_batches(protocol)
    total = sum(estimate.seconds(estimate.call_cost(c.fn, protocol, device), batches) for c in candidates)
    probe = min(estimate.PROBE_ROWS, protocol.full_batch)
    progress_write(f"[adaln_lab report] full protocol, {len(candidates)} candidate(s), ~{len(batches)} calls each: "
                   f"{estimate.minutes(total)} on this device ({device}; extrapolated from calls of 1 and {probe} "
                   "rows; --quick for a run of seconds)")
    return total


def run_report(candidates: list, device: str | torch.device, quick: bool, protocol: Protocol | None = None) -> dict:
    """The report of `candidates`: built-in names ("diffusers", "adaln_lab", ...), `Named`, or any callable
    `fn(x (S, H), norm_weight (H,), temb (T, D), weight (2H, D), bias (2H,), timestep_indices (S,)) -> (S, H)`
    (its row is named module:qualname). `protocol` defaults to QUICK or FULL by `quick`; the full
    protocol first prints an estimate of its time. A candidate that is not batch-invariant gets its
    failed checks printed in a few lines (`invariance.failure_summary`)."""
    device = torch.device(device)
    protocol = protocol or (QUICK if quick else FULL)
    candidates = resolve(list(candidates), device)
    if not candidates:
        raise ValueError("no candidates: name built-ins (--candidates) or pass callables (--candidate mod:fn)")
    for candidate in candidates:
        progress_write(announce(candidate, device))
    if not quick:
        announce_estimate(candidates, protocol, device)
    copy = copy_bandwidth(device, protocol.copy_bytes)
    floors = floors_of(protocol, copy, device)
    report = {
        "kind": "adaln_lab_report",
        "rfc": None,
        "op": "final_adaln_out",
        **provenance(),
        "environment": environment(device),
        "quick": quick,
        "protocol": vars(protocol) | {"sweep_sizes": protocol.sweep_sizes},
        "copy_TBps": copy,
        "memory_floor": floors,
        "autograd_floor_us": None,
        "autograd_floor_host_us": None,
        "schema_notes": SCHEMA_NOTES,
        "results": {"plain": {}},
    }
    for candidate in progress(None, "candidates", unit="candidate", leave=True, iterable=candidates):
        entry = {"source": candidate.source, "has_backward": True,
                 **({"replay_of": candidate.replay_of} if candidate.replay_of else {}),
                 "batch_invariance": batch_invariance(candidate.fn, protocol, device),
                 "accuracy_latency": accuracy_latency(candidate, protocol, device, floors)}
        if not entry["batch_invariance"]["batch_invariant"]:
            progress_write("\n".join([f"[adaln_lab report] {candidate.name} is not batch-invariant:"]
                                     + [f"  {line}" for line in invariance.failure_summary(entry["batch_invariance"])]))
        if candidate.name == "adaln_lab" and device.type == "cuda":
            entry["forward_parity_vs_diffusers"] = forward_parity(protocol, device)
            entry["forward_parity_baseline"] = diffusers_candidate().source
        report["results"]["plain"][candidate.name] = entry
        if device.type == "cuda":
            torch.cuda.empty_cache()
    report.update(autograd_floor(make(protocol.accuracy_seed, protocol.accuracy_sizes[0], device, **protocol.shape),
                                 protocol.warmup, protocol.iters))
    graph_timings(candidates, protocol, device,
                  {name: entry["accuracy_latency"] for name, entry in report["results"]["plain"].items()})
    return report
