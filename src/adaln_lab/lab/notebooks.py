"""Execute the lab's notebooks top to bottom and check that no cell raises; --write saves their outputs into the files.

python -m adaln_lab.lab.notebooks [--write] [PATH ...]

Each notebook keeps `MODE = "auto"`: on a machine with CUDA it measures afresh, on a CPU it reads
the committed GPU evidence (bench/results/<machine>, `lab.evidence.EVIDENCE_MACHINE`), or the folder
$ADALN_LAB_EVIDENCE_DIR names. Without `--write` nothing is written: the run only checks; with it
the executed notebook, outputs included, replaces the file (what gets committed after a run).
Needs the test extra (nbclient, nbformat, ipykernel). Prints each notebook's seconds on stderr and
exits 1 if any cell raised.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

NOTEBOOK_DIR = Path(__file__).resolve().parents[3] / "notebooks"  # the checkout's, beside src/


def execute(path: str | Path, timeout: int = 1800, write: bool = False):
    """(executed notebook, seconds, [error outputs]) of one notebook, run in its own directory."""
    import nbclient
    import nbformat

    path = Path(path)
    notebook = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    client = nbclient.NotebookClient(notebook, timeout=timeout, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError:
        pass  # the error output stays in the notebook and is reported below
    seconds = time.perf_counter() - start
    failed = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])
              if o.get("output_type") == "error"]
    if write:
        nbformat.write(notebook, path)
    return notebook, seconds, failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m adaln_lab.lab.notebooks", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n")[2])
    parser.add_argument("paths", nargs="*", help=f"notebooks (default: every *.ipynb in {NOTEBOOK_DIR})")
    parser.add_argument("--write", action="store_true",
                        help="write the executed notebooks, outputs included, back into their files "
                             "(without it nothing is written)")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds one cell may take (default 1800)")
    args = parser.parse_args(argv)
    paths = [Path(p) for p in args.paths] or sorted(NOTEBOOK_DIR.glob("*.ipynb"))
    status = 0
    for path in paths:
        _, seconds, failed = execute(path, args.timeout, args.write)
        print(f"{path}: {seconds:.0f} s, {'FAILED: ' + failed[0].get('ename', '') if failed else 'ok'}"
              f"{', written' if args.write else ''}", file=sys.stderr)
        status |= bool(failed)
    return status


if __name__ == "__main__":
    sys.exit(main())
