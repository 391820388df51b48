"""A markdown summary of a report JSON: the README's results table is this function's output.

`markdown(report)` prints, in this order:

1. the results table, one row per size and candidate: batch invariance, parameter-gradient
   repeatability; GPU time from CUDA-graph replays (`fwd_us_graph`, `fwd_bwd_us_graph`), each with
   its multiple of the memory floor; eager CUDA-event times (`fwd_us`, `fwd_bwd_us_pure`, also
   with floor multiples); the forward under inference mode (`fwd_us_inference`); the host time to
   issue forward+backward (`host_fwd_bwd_us`) beside the run's autograd host floor; gradient errors;
2. the floors: memory floor per size, and the autograd floor (identity autograd.Function);
3. why any CUDA-graph figure is missing, and what each candidate row ran (`source`);
4. the machine, copy bandwidth and commit.

Figures a report does not have (older reports lack the graph, inference and host keys; graph
figures are null where the capture failed or no CUDA was there) print as "n/a".
"""

from __future__ import annotations

import json
from pathlib import Path

GRADS = ("x", "nw", "temb", "w", "b")
NA = "n/a"


class ReportError(ValueError):
    """A report file that cannot be read or is not an adaln_lab report; the message is one line."""


def load(path: str | Path) -> dict:
    """Read a report JSON, or raise ReportError with a one-line reason."""
    try:
        report = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ReportError(f"no such report file: {path}") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ReportError(f"cannot read {path}: {type(error).__name__}: {error}") from None
    except json.JSONDecodeError as error:
        raise ReportError(f"{path} is not JSON: {error}") from None
    if not isinstance(report, dict) or not isinstance(report.get("results", {}).get("plain"), dict) \
            or "memory_floor" not in report:
        raise ReportError(f"{path} is not an adaln_lab report (no results.plain / memory_floor)")
    return report


def _us(value) -> str:
    if value is None:
        return NA
    return f"{value:.0f}" if value >= 10 else f"{value:.1f}"


def _with_floor(value, floor) -> str:
    if value is None:
        return NA
    return f"{_us(value)} ({value / floor:.2f}x)" if floor else _us(value)


def _yes(flag) -> str:
    return NA if flag is None else ("yes" if flag else "no")


def _grad_errors(a: dict) -> str:
    errors = a.get("grad_rel_err")
    if not errors:
        return NA
    return " / ".join(f"{errors[g]:.2g}" if errors.get(g) is not None else NA for g in GRADS)


def results_table(report: dict) -> list[str]:
    floor = report["memory_floor"]
    host_floor = report.get("autograd_floor_host_us")
    head = ["candidate", "rows", "batch invariant", "params repeat",
            "graph fwd us (x floor)", "graph fwd+bwd us (x floor)", "eager fwd us (x floor)",
            "eager fwd+bwd us (x floor)", "inference fwd us", "host fwd+bwd us (autograd host floor)",
            "grad err x/nw/temb/w/b"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for S in floor:
        for name, entry in report["results"]["plain"].items():
            a = entry.get("accuracy_latency", {}).get(S)
            if a is None:
                continue
            inv = entry.get("batch_invariance", {})
            f = floor[S]
            host = a.get("host_fwd_bwd_us")
            cells = [name, S, _yes(inv.get("batch_invariant")), _yes(inv.get("params_repeatable")),
                     _with_floor(a.get("fwd_us_graph"), f.get("fwd_us")),
                     _with_floor(a.get("fwd_bwd_us_graph"), f.get("fwd_bwd_us")),
                     _with_floor(a.get("fwd_us"), f.get("fwd_us")),
                     _with_floor(a.get("fwd_bwd_us_pure"), f.get("fwd_bwd_us")),
                     _us(a.get("fwd_us_inference")),
                     NA if host is None else f"{_us(host)} (floor {_us(host_floor)})",
                     _grad_errors(a)]
            rows.append("| " + " | ".join(cells) + " |")
    return rows


def floors_table(report: dict) -> list[str]:
    rows = ["| rows | memory floor fwd us | memory floor fwd+bwd us |", "|---|---|---|"]
    for S, f in report["memory_floor"].items():
        rows.append(f"| {S} | {f['fwd_us']:.1f} | {f['fwd_bwd_us']:.1f} |")
    gpu, host = report.get("autograd_floor_us"), report.get("autograd_floor_host_us")
    figures = (f"{_us(gpu)} us CUDA events, {_us(host)} us host" if gpu is not None or host is not None
               else f"{NA} (not in this report)")
    rows += ["", f"autograd floor (fwd+bwd of an identity autograd.Function over the 5 leaves): {figures}."]
    return rows


def notes(report: dict) -> list[str]:
    lines, no_cuda = [], False
    for name, entry in report["results"]["plain"].items():
        for S, a in entry.get("accuracy_latency", {}).items():
            for key, label in (("fwd_us_graph", "fwd"), ("fwd_bwd_us_graph", "fwd+bwd")):
                reason = a.get(key + "_error")
                if a.get(key) is None and reason == "no CUDA":
                    no_cuda = True
                elif a.get(key) is None and reason:
                    lines.append(f"- graph {label} of {name} @{S} failed to capture: {reason}")
    if no_cuda:
        lines.insert(0, "- graph columns: n/a (no CUDA in this run)")
    lines += [f"- {name} ran: {entry.get('source', NA)}" for name, entry in report["results"]["plain"].items()]
    return lines


def markdown(report: dict) -> str:
    env = report.get("environment") or {}
    copy = report.get("copy_TBps")
    tail = (f"{env.get('gpu') or env.get('cpu') or NA}, copy {NA if copy is None else f'{copy:.2f}'} TB/s; "
            f"commit {str(report.get('adaln_lab_commit'))[:7]}.")
    return "\n".join(results_table(report) + [""] + floors_table(report) + [""] + notes(report) + ["", tail])


def render(path: str | Path) -> str:
    """`markdown(load(path))`, with a malformed report turned into ReportError too."""
    report = load(path)
    try:
        return markdown(report)
    except (KeyError, TypeError, AttributeError, ValueError) as error:
        raise ReportError(f"{path} is not a complete adaln_lab report: {type(error).__name__}: {error}") from None

