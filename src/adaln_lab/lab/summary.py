"""The key figures of a lab run's files, as markdown: what `python -m adaln_lab.lab` prints on stdout.

`python -m adaln_lab.lab table DIR|FILE...` prints the same for files already written
(`python -m adaln_lab table` renders reports, not lab files). Per file, one heading naming the
machine, commit and sizes (`evidence.describe`) and one table:

- lab_errors.json: at its largest table size, max|err| / max|golden| of the forward, dx and d_bias
  against the float64 golden, and the fraction of d_bias correctly rounded;
- lab_latency.json: at the sweep's smallest and largest rows, forward+backward time: GPU (CUDA graph,
  "n/a" off CUDA), eager, host, and the memory floor (us);
- lab_invariance.json: rows (or parameters) found differing by each check, and the verdict.
"""

from __future__ import annotations

import json
from pathlib import Path

from . import evidence
from .tables import NA, pct, table, us

KINDS = {f"adaln_lab_lab_{kind}": kind for kind in evidence.KINDS}
NA_CPU = "n/a on CPU"


class LabFileError(ValueError):
    """A path that is not a lab file or a folder holding some; the message is one line."""


def load(path: str | Path) -> dict:
    """A lab file's JSON, or LabFileError saying why not."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise LabFileError(f"no such file: {path}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise LabFileError(f"cannot read {path}: {type(error).__name__}: {error}") from None
    if not isinstance(data, dict) or data.get("kind") not in KINDS:
        kind = data.get("kind") if isinstance(data, dict) else None
        hint = " (a report: python -m adaln_lab table renders it)" if kind in ("adaln_lab_report",
                                                                               "adaln_lab_block_report") else ""
        raise LabFileError(f"{path} is not a lab file (kind {kind!r}){hint}")
    return data


def lab_files(paths) -> list[Path]:
    """The lab files among `paths`: a folder stands for its lab_errors / lab_latency / lab_invariance.json."""
    out = []
    for path in map(Path, paths):
        if path.is_dir():
            found = [evidence.lab_path(kind, path) for kind in evidence.KINDS]
            found = [p for p in found if p.is_file()]
            if not found:
                raise LabFileError(f"{path} holds no lab_*.json (python -m adaln_lab.lab --out {path} writes them)")
            out += found
        else:
            out.append(path)
    return out


def errors_table(data: dict) -> str:
    S = str(data["table_sizes"][-1])
    rows = [[name, S, e["fwd_rel_err"], e["grad_rel_err"]["x"], e["grad_rel_err"]["b"],
             pct(e["grad_correctly_rounded"]["b"])] for name, e in data["errors"][S].items()]
    return table(["candidate", "rows", "fwd error", "dx error", "d_bias error", "d_bias correctly rounded"], rows)


def latency_table(data: dict) -> str:
    sweep = data["sweep"]
    sizes = sorted({sweep["rows"][0], sweep["rows"][-1]})
    on_cpu = (data.get("meta", {}).get("environment") or {}).get("device") == "cpu"
    gpu_only = (lambda value: NA_CPU) if on_cpu else us  # a CPU has no CUDA graph, and no GPU memory floor
    rows = []
    for S in map(str, sizes):
        for name, entries in sweep["candidates"].items():
            e = entries[S]
            rows.append([name, S, gpu_only(e.get("fwd_bwd_us_graph")), us(e.get("fwd_bwd_us_pure")),
                         us(e.get("host_fwd_bwd_us")), gpu_only(sweep["memory_floor"][S]["fwd_bwd_us"])])
    return table(["candidate", "rows", "fwd+bwd GPU (graph) us", "fwd+bwd eager us", "fwd+bwd host us",
                  "memory floor us"], rows)


def invariance_table(data: dict) -> str:
    from .walkthrough import CHECKS, failures

    rows = []
    for name, checks in data["checks"].items():
        if "error" in checks:
            rows.append([name, *(NA for _ in CHECKS), f"could not run: {checks['error'][:80]}"])
            continue
        found = [failures(check, checks[check]) for check in CHECKS]
        rows.append([name, *found, "batch invariant" if not any(found[:3]) else "NOT batch invariant"])
    return table(["candidate", *(f"{c}: differ" for c in CHECKS), "verdict"], rows)


TABLES = {"errors": errors_table, "latency": latency_table, "invariance": invariance_table}


def render(paths) -> str:
    """Markdown for the lab files among `paths` (files or folders); LabFileError for one that is not."""
    parts = []
    for path in lab_files(paths):
        data = load(path)
        kind = KINDS[data["kind"]]
        try:
            body = TABLES[kind](data)
        except (KeyError, IndexError, TypeError) as error:
            raise LabFileError(f"{path} is not a complete lab file: {type(error).__name__}: {error}") from None
        parts.append(f"### {path.name}: {evidence.describe(data)}\n\n{body}")
    return "\n\n".join(parts)


__all__ = ["KINDS", "LabFileError", "load", "lab_files", "errors_table", "latency_table", "invariance_table",
           "render"]
