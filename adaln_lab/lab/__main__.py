"""python -m adaln_lab.lab --out DIR [--quick] [--device cpu|cuda] [--only errors,latency,invariance]

Measures the lab on this machine and writes DIR/lab_errors.json, DIR/lab_latency.json and
DIR/lab_invariance.json (what the notebooks read in evidence mode), with progress on stderr (a bar
on a terminal, plain lines in a log: `harness.progress`). Candidates: diffusers, torch_compile (CUDA only),
adaln_lab and adaln_lab_numba where `harness.candidates` has it. Without --quick on a CPU the float64 goldens at 131072 rows need
tens of GB and most of an hour; --quick runs the small sizes (H = 256) in well under a minute.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from ..harness.progress import progress, write
from . import errors, evidence, latency_sweep, walkthrough

STEPS = ("errors", "invariance", "latency")  # CUDA-graph captures (latency) last, as the report does


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m adaln_lab.lab", description=__doc__.split("\n\n")[1])
    parser.add_argument("--out", required=True,
                        help="directory for lab_errors.json, lab_invariance.json, lab_latency.json")
    parser.add_argument("--quick", action="store_true", help="small sizes (H = 256): CPUs and smoke tests")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    parser.add_argument("--only", default=",".join(STEPS), help=f"comma-separated subset of {', '.join(STEPS)}")
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda asked for, but torch sees no CUDA device")
    if device.type == "cpu":
        torch.set_num_threads(1)  # small CPU problems: faster on one thread, and a busy machine cannot stall it
    asked = {s for s in args.only.split(",") if s}
    if asked - set(STEPS):
        parser.error(f"--only takes {', '.join(STEPS)}")
    steps = [s for s in STEPS if s in asked]

    candidates, skipped = walkthrough.candidates_here(device)
    for name, why in skipped.items():
        write(f"[adaln_lab.lab] candidate {name} skipped: {why}")
    for c in candidates:
        write(f"[adaln_lab.lab] candidate {c.name} on {device}: {c.source}" + (f"  !! {c.warning}" if c.warning else ""))
    main_candidates = [c for c in candidates if c.name != "adaln_lab_numba"]
    err_plan = errors.plan(args.quick)
    rows = latency_sweep.QUICK_ROWS if args.quick else latency_sweep.FULL_ROWS
    total = {"errors": len(err_plan["sizes"]),
             "latency": 2 * len(main_candidates) * len(rows) + (0 if device.type != "cuda" else 2),
             "invariance": len(candidates) + 1}
    meta = evidence.meta(device, args.quick)
    with progress(sum(total[s] for s in steps), "adaln_lab.lab", unit="step", leave=True) as bar:
        for step in steps:
            bar.set_postfix_str(step)
            start = time.perf_counter()
            if step == "errors":
                data = errors.measure(main_candidates, device, args.quick, bar=bar)
            elif step == "latency":
                data = latency_sweep.measure(main_candidates, device, args.quick, bar=bar)
            else:
                data = walkthrough.measure(candidates, device, args.quick, bar=bar)
            data["meta"] = {**meta, "seconds": time.perf_counter() - start, "skipped_candidates": skipped}
            path = evidence.save(data, evidence.lab_path(step, args.out))
            write(f"[adaln_lab.lab] wrote {path} ({data['meta']['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
