"""The report: every check of the harness on named candidates, written in the seed report's schema.

Same keys as ../shared/reference/seed_prior_art_b200.json (so the files read side by side), with
`adaln_lab_commit` where the seed has `rl_kernel_commit`, plus: the measured copy bandwidth
(`copy_TBps`), the memory floor per size (`memory_floor`), per size and candidate the pure
forward+backward time and the fraction of copy bandwidth achieved, and for adaln_lab its forward
parity with diffusers.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from . import invariance
from .accuracy import accuracy, parity
from .candidates import Named, adaln_lab_candidate, diffusers_candidate, resolve
from .inputs import make, upstream
from .latency import copy_bandwidth, latency, memory_floor
from .protocol import FULL, QUICK, Protocol

LIBRARIES = ("torch", "triton", "diffusers", "cupy-cuda13x", "numba-cuda", "numpy", "ml_dtypes",
             "liger-kernel", "vllm", "flashinfer-python", "sglang", "transformer_engine", "megatron-core")
REPO = Path(__file__).resolve().parents[2]


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


def _provenance() -> dict:
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
    p = protocol
    report = {"all_rows": invariance.all_rows(fn, p.all_rows_sizes, p.seeds, device, p.shape)}
    batch = make(p.seeds[0], p.accuracy_sizes[0], device, **p.shape)
    repeat = invariance.params_repeatable(fn, batch, upstream(p.seeds[0], batch.x))
    report["params_repeatable"] = all(repeat.values())
    report["params_repeatable_each"] = repeat
    report["full_vs_sub_batches"] = invariance.full_vs_sub_batches(
        fn, p.full_batch, p.sub_batch_sizes, p.sub_batch_seeds, p.small_limit, p.small_step, device, p.shape)
    report["batch_size_sweep"] = invariance.batch_size_sweep(
        fn, p.sweep_sizes, p.probe_rows, p.pool_size, p.seeds, device, p.shape)
    report["batch_invariant"] = invariance.batch_invariant(report)
    return report


def accuracy_latency(candidate: Named, protocol: Protocol, device: torch.device, floors: dict) -> dict:
    out = {}
    for S in protocol.accuracy_sizes:
        inputs = make(protocol.accuracy_seed, S, device, **protocol.shape)
        entry = accuracy(candidate.fn, inputs, upstream(protocol.accuracy_seed, inputs.x))
        entry.update(latency(candidate.fn, inputs, protocol.warmup, protocol.iters))
        floor = floors[str(S)]
        entry["fwd_floor_fraction"] = floor["fwd_us"] / entry["fwd_us"]
        entry["fwd_bwd_floor_fraction"] = floor["fwd_bwd_us"] / entry["fwd_bwd_us_pure"]
        out[str(S)] = entry
    return out


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


def run_report(names: list[str], device: str | torch.device, quick: bool) -> dict:
    device = torch.device(device)
    protocol = QUICK if quick else FULL
    candidates = resolve(names, device)
    copy = copy_bandwidth(device, protocol.copy_bytes)
    floors = {str(S): memory_floor(S, protocol.H, protocol.D, protocol.T, copy) for S in protocol.accuracy_sizes}
    report = {
        "kind": "adaln_lab_report",
        "rfc": None,
        "op": "final_adaln_out",
        **_provenance(),
        "environment": environment(device),
        "quick": quick,
        "protocol": vars(protocol) | {"sweep_sizes": protocol.sweep_sizes},
        "copy_TBps": copy,
        "memory_floor": floors,
        "results": {"plain": {}},
    }
    for candidate in tqdm(candidates, desc="candidates", leave=True, dynamic_ncols=True):
        entry = {"source": candidate.source, "has_backward": True,
                 "batch_invariance": batch_invariance(candidate.fn, protocol, device),
                 "accuracy_latency": accuracy_latency(candidate, protocol, device, floors)}
        if candidate.name == "adaln_lab" and device.type == "cuda":
            entry["forward_parity_vs_diffusers"] = forward_parity(protocol, device)
        report["results"]["plain"][candidate.name] = entry
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return report


def write(report: dict, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(report, indent=2, default=str) + "\n")
    tmp.replace(path)
    print(f"wrote {path}", file=sys.stderr)
