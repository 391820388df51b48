"""Command line of adaln_lab.

    python -m adaln_lab report --out FILE.json [--quick] [--device cpu|cuda] [--candidates NAMES]
                               [--candidate pkg.mod:fn ...]   (your callable beside the built-ins; repeatable)
    python -m adaln_lab table FILE.json          (markdown summary of a report or block report; exit 2 if unreadable)
    python -m adaln_lab block-report --out FILE.json [--quick] [--candidates NAMES]
                                                 (one H3 block's AdaLN parts: time vs floor, accuracy, repeat)

report and block-report print their table (the one `table` prints) on stdout at the end.
"""

from __future__ import annotations

import argparse
import sys

DEFAULT_CANDIDATES = {"cpu": "diffusers,adaln_lab", "cuda": "diffusers,torch_compile,adaln_lab"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m adaln_lab", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    report = commands.add_parser("report", help="run the invariance / accuracy / latency protocol, write JSON")
    report.add_argument("--out", required=True, help="path of the JSON report to write")
    report.add_argument("--quick", action="store_true", help="small sizes (a CPU finishes in minutes)")
    report.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="default: cuda when available, else cpu")
    report.add_argument("--candidates", default=None,
                        help="comma-separated names among diffusers, torch_compile, adaln_lab, adaln_lab_numba (CUDA only) "
                             f"(default: {DEFAULT_CANDIDATES['cuda']} on cuda, {DEFAULT_CANDIDATES['cpu']} on cpu; "
                             "'' for none, e.g. with --candidate)")
    report.add_argument("--candidate", action="append", default=[], metavar="MODULE:FUNCTION",
                        help="a callable fn(x, norm_weight, temb, weight, bias, timestep_indices) -> out to report "
                             "beside the built-ins, e.g. my_pkg.kernels:my_adaln (imported; repeatable); its rows "
                             "are named MODULE:FUNCTION")
    block = commands.add_parser("block-report", help="one MiniMax-H3 block's AdaLN parts against their floor")
    block.add_argument("--out", required=True, help="path of the JSON report to write")
    block.add_argument("--quick", action="store_true", help="small shapes (a CPU finishes in a minute)")
    block.add_argument("--device", choices=("cpu", "cuda"), default=None)
    block.add_argument("--candidates", default="diffusers,torch_compile,adaln_lab",
                       help="comma-separated names among diffusers, torch_compile, adaln_lab")
    table = commands.add_parser("table", help="print a report or block report JSON as markdown tables")
    table.add_argument("report_json")
    args = parser.parse_args(argv)

    if args.command == "table":
        from .harness.render import ReportError, render

        try:
            print(render(args.report_json))
        except ReportError as error:
            print(f"python -m adaln_lab table: error: {error}", file=sys.stderr)
            return 2
        return 0

    import torch

    from .harness.render import markdown
    from .harness.report import provenance, run_report, write

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda asked for, but torch sees no CUDA device")
    if args.command == "block-report":
        from .harness.block_report import run_block_report

        try:
            result = run_block_report([n for n in args.candidates.split(",") if n], device, args.quick)
        except ValueError as error:
            parser.error(str(error))
        result = {**provenance(), **result}
        write(result, args.out)
        print(markdown(result))
        return 0
    from .harness.calls import CandidateOutputError
    from .harness.candidates import load_candidate

    names = [n for n in (DEFAULT_CANDIDATES[device] if args.candidates is None else args.candidates).split(",") if n]
    try:
        mine = [load_candidate(spec) for spec in args.candidate]
        result = run_report(names + mine, device, args.quick)
    except (ValueError, CandidateOutputError) as error:
        parser.error(str(error))
    write(result, args.out)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
