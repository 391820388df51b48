"""Command line of adaln_lab (installed by pip as the `adaln-lab` console script too).

usage:
  python -m adaln_lab report --out FILE.json [--quick] [--device cpu|cuda] [--candidates NAMES]
                             [--candidate pkg.mod:fn ...]
      the seed protocol (batch invariance, accuracy, latency) on each candidate row
  python -m adaln_lab block-report --out FILE.json [--quick] [--device cpu|cuda] [--candidates NAMES]
      one MiniMax-H3 block's AdaLN parts: time against their memory floor, accuracy, repeatability
  python -m adaln_lab table FILE.json
      the markdown tables of a report or block report JSON (exit 2 if unreadable)

report and block-report check --out before measuring anything: a missing directory is created (said
on stderr), a place that cannot be written is a one-line error (exit 2). At the end they print their
table (the one `table` prints) on stdout, then write the JSON; should that write fail all the same,
the JSON goes to a new file in the temporary directory, named on stderr (exit 1).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEFAULT_CANDIDATES = {"cpu": "diffusers,adaln_lab", "cuda": "diffusers,torch_compile,adaln_lab"}
EPILOG = """\
`adaln-lab` (pyproject's [project.scripts], installed with the package) runs the same commands:
  adaln-lab report --out report.json --quick
  adaln-lab table report.json
A command's options: python -m adaln_lab COMMAND --help."""
OUT_HELP = ("path of the JSON to write; checked before anything is measured: a missing directory is created "
            "(said on stderr), an unwritable place is an error (exit 2)")


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (exit 2)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def prog() -> str:
    """How the user called us: `adaln-lab` (the console script) or `python -m adaln_lab`."""
    return "adaln-lab" if Path(sys.argv[0]).name == "adaln-lab" else "python -m adaln_lab"


def parser() -> Parser:
    """The command line's parser (every option has help text; tests/harness/test_cli.py checks)."""
    top = Parser(prog=prog(), description=__doc__, epilog=EPILOG,
                 formatter_class=argparse.RawDescriptionHelpFormatter)  # the usage lines kept as written
    commands = top.add_subparsers(dest="command", required=True, metavar="{report,block-report,table}")
    report = commands.add_parser(
        "report", help="run the invariance / accuracy / latency protocol, print its table, write JSON",
        description="The seed protocol (batch invariance, accuracy against the float64 golden, latency) on each "
                    "candidate; says on stderr what each row runs, prints the table on stdout, writes --out.")
    report.add_argument("--out", required=True, metavar="FILE.json", help=OUT_HELP)
    report.add_argument("--quick", action="store_true",
                        help="small sizes (H = 256): tens of seconds on a CPU. Without it the seed protocol's full "
                             "sizes: minutes on a GPU, hours on a CPU (the report prints its estimate first)")
    report.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="default: cuda when torch sees a GPU, else cpu")
    report.add_argument("--candidates", default=None, metavar="NAMES",
                        help="comma-separated names among diffusers, torch_compile, adaln_lab, adaln_lab_numba "
                             "(torch_compile and adaln_lab_numba: CUDA only) "
                             f"(default: {DEFAULT_CANDIDATES['cuda']} on cuda, {DEFAULT_CANDIDATES['cpu']} on cpu; "
                             "'' for none, e.g. with --candidate). Without diffusers installed, the diffusers row "
                             "is adaln_lab's replay, named diffusers_replay")
    report.add_argument("--candidate", action="append", default=[], metavar="MODULE:FUNCTION",
                        help="a callable fn(x, norm_weight, temb, weight, bias, timestep_indices) -> out to report "
                             "beside the built-ins, e.g. my_pkg.kernels:my_adaln (imported; repeatable); its rows "
                             "are named MODULE:FUNCTION")
    block = commands.add_parser(
        "block-report", help="one MiniMax-H3 block's AdaLN parts against their floor, print its table, write JSON",
        description="One MiniMax-H3 block's AdaLN parts (modulation table, two modulated RMSNorms, two gated "
                    "residuals; attention and FFN pass-through): time against their memory floor, errors against "
                    "the float64 block, repeatability. Runs without diffusers on adaln_lab's replay of its block "
                    "(the diffusers row is then named diffusers_replay).")
    block.add_argument("--out", required=True, metavar="FILE.json", help=OUT_HELP)
    block.add_argument("--quick", action="store_true",
                       help="small shapes (H = 256, D = 128), for CPUs and smoke tests; without it H3's real shapes "
                            "(H = 5376), which want a GPU")
    block.add_argument("--device", choices=("cpu", "cuda"), default=None,
                       help="default: cuda when torch sees a GPU, else cpu")
    block.add_argument("--candidates", default="diffusers,torch_compile,adaln_lab", metavar="NAMES",
                       help="comma-separated names among diffusers, torch_compile, adaln_lab (default: all three)")
    table = commands.add_parser(
        "table", help="print a report or block report JSON as markdown tables",
        description="Print the markdown tables of a report or block report JSON on stdout (what report and "
                    "block-report print at their end); an unreadable file is a one-line error, exit 2.")
    table.add_argument("report_json", metavar="FILE.json",
                       help="a JSON written by `report` or `block-report`")
    return top


def deliver(result: dict, out: str, name: str) -> int:
    """Print `result`'s table, then write it to `out`; if that fails, keep it in a temporary file (exit 1)."""
    from .harness.output import keep, write
    from .harness.render import markdown

    print(markdown(result), flush=True)
    try:
        write(result, out)
    except OSError as error:
        reason = error.strerror or str(error)
        try:
            kept = f"the results are kept in {keep(result)}"
        except OSError:
            print(f"{name}: error: --out {out}: could not write ({reason}), nor a temporary file; the JSON "
                  "follows on stdout", file=sys.stderr)
            print(json.dumps(result, default=str))
            return 1
        print(f"{name}: error: --out {out}: could not write ({reason}); {kept}", file=sys.stderr)
        return 1
    return 0


def fail(name: str, message: str) -> int:
    """A user's mistake found after parsing: one line on stderr; exit status 2."""
    print(f"{name}: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    cli = parser()
    args = cli.parse_args(argv)
    name = f"{cli.prog} {args.command}"

    if args.command == "table":
        from .harness.render import ReportError, render

        try:
            print(render(args.report_json))
        except ReportError as error:
            return fail(name, str(error))
        return 0

    import torch

    from .harness.output import OutputError, check_output
    from .harness.report import provenance, run_report

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        return fail(name, "--device cuda asked for, but torch sees no CUDA device")
    if args.command == "block-report":
        from .harness.block_report import CANDIDATES

        unknown = [n for n in args.candidates.split(",") if n and n not in CANDIDATES]
        if unknown:
            return fail(name, f"--candidates: unknown block candidate(s) {', '.join(unknown)}; known: "
                              f"{', '.join(CANDIDATES)}")
    try:
        created = check_output(args.out)
    except OutputError as error:
        return fail(name, f"--out {args.out}: {error}")
    if created is not None:
        print(f"{name}: created the directory {created} for --out", file=sys.stderr)

    if args.command == "block-report":
        from .harness.block_report import run_block_report

        result = run_block_report([n for n in args.candidates.split(",") if n], device, args.quick)
        return deliver({**provenance(), **result}, args.out, name)
    from .harness.calls import CandidateOutputError
    from .harness.candidates import load_candidate

    names = [n for n in (DEFAULT_CANDIDATES[device] if args.candidates is None else args.candidates).split(",") if n]
    try:
        mine = [load_candidate(spec) for spec in args.candidate]
        result = run_report(names + mine, device, args.quick)
    except (ValueError, CandidateOutputError) as error:
        return fail(name, str(error))
    return deliver(result, args.out, name)


if __name__ == "__main__":
    sys.exit(main())
