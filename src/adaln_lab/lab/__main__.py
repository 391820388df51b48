"""python -m adaln_lab.lab --out DIR [--quick] [--device cpu|cuda] [--only errors,latency,invariance]
python -m adaln_lab.lab table DIR|FILE [...]

Measures the lab on this machine and writes DIR/lab_errors.json, DIR/lab_latency.json and
DIR/lab_invariance.json (what the notebooks read in evidence mode), with progress on stderr (a bar
on a terminal, plain lines in a log: `harness.progress`). On stdout: each file written, then the
key figures of each (`lab.summary`); `table DIR` prints those again for files already written.
Candidates: diffusers, torch_compile (CUDA only), adaln_lab and adaln_lab_numba where
`harness.candidates` has it. Without --quick on a CPU the float64 goldens at 131072 rows need
tens of GB and most of an hour; --quick runs the small sizes (H = 256) in well under a minute.

The notebooks read DIR instead of the committed evidence when ADALN_LAB_EVIDENCE_DIR=DIR is set
(`ADALN_LAB_EVIDENCE_DIR=DIR jupyter lab notebooks/`); where DIR lacks report.json (written by
`python -m adaln_lab report --out DIR/report.json`) or sweep.json, the parts that need them say
"not measured in this run".
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

STEPS = ("errors", "invariance", "latency")  # CUDA-graph captures (latency) last, as the report does
USAGE = __doc__.split("\n\n")[0].replace("\n", "\n       ")  # under "usage: "
DESCRIPTION = "\n\n".join(__doc__.split("\n\n")[1:])


def table_main(argv: list[str]) -> int:
    """`python -m adaln_lab.lab table DIR|FILE...`: the summary of lab files on stdout; exit 2 if one is unreadable."""
    from .summary import LabFileError, render

    parser = argparse.ArgumentParser(prog="python -m adaln_lab.lab table",
                                     description="print the key figures of lab_*.json files as markdown tables")
    parser.add_argument("paths", nargs="+", metavar="DIR|FILE",
                        help="a folder written by `python -m adaln_lab.lab --out DIR`, or lab_*.json files")
    args = parser.parse_args(argv)
    try:
        print(render(args.paths))
    except LabFileError as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 2
    return 0


def out_dir(parser: argparse.ArgumentParser, out: str) -> Path:
    """--out as a directory that exists and takes files, checked before anything is measured."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        parser.error(f"--out {out}: exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".adaln_lab_write_test"
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        parser.error(f"--out {out}: cannot write there ({error.strerror or error})")
    return path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["table"]:
        return table_main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m adaln_lab.lab", usage=USAGE, description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="directory for lab_errors.json, lab_invariance.json, lab_latency.json (created)")
    parser.add_argument("--quick", action="store_true", help="small sizes (H = 256): CPUs and smoke tests")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    parser.add_argument("--only", default=",".join(STEPS), help=f"comma-separated subset of {', '.join(STEPS)}")
    args = parser.parse_args(argv)
    asked = {s for s in args.only.split(",") if s}
    if not asked or asked - set(STEPS):
        parser.error(f"--only takes {', '.join(STEPS)}")
    steps = [s for s in STEPS if s in asked]
    out = out_dir(parser, args.out)

    import torch

    from ..harness.progress import progress, write
    from . import errors, evidence, latency_sweep, summary, walkthrough

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda asked for, but torch sees no CUDA device")
    if device.type == "cpu":
        torch.set_num_threads(1)  # small CPU problems: faster on one thread, and a busy machine cannot stall it

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
    written = []
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
            written.append(evidence.save(data, evidence.lab_path(step, out)))
            print(f"wrote {written[-1]} ({step}, {data['meta']['seconds']:.0f} s)", flush=True)
    print(f"\n{summary.render(written)}\n\nPrint these tables again: python -m adaln_lab.lab table {out}\n"
          f"Open the notebooks on these files: ADALN_LAB_EVIDENCE_DIR={out} jupyter lab notebooks/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
