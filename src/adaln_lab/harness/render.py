"""A markdown summary of a report JSON (`report` or `block-report`): the report's tables are its output.

`markdown(report)` prints, in this order:

1. the results table, one row per size and candidate: batch invariance (the three row checks:
   no row whose output or dx differs), parameter-gradient repeatability; GPU time from CUDA-graph
   replays (`fwd_us_graph`, `fwd_bwd_us_graph`), each with its multiple of the memory floor; eager
   CUDA-event times (`fwd_us`, `fwd_bwd_us_pure`, also with floor multiples); the forward under
   inference mode (`fwd_us_inference`); the host time to issue forward+backward (`host_fwd_bwd_us`)
   beside the run's autograd host floor; gradient errors;
2. the floors: memory floor per size, and the autograd floor (identity autograd.Function);
3. why any CUDA-graph figure is missing, and what each candidate row ran (`source`);
4. the machine, copy bandwidth and commit.

A timing with samples in the report (`spread_us`) prints as "median ±N%", N half the interquartile
range of its samples in % of the median, so a noisy figure shows. Figures a report does not have
(older reports lack the graph, inference and host keys; graph figures are null where the capture
failed) print as "n/a". A CPU run's GPU-only figures (CUDA graphs, memory floor and multiples of
it, null in its JSON) print as "n/a on CPU", and one line says what its rows measure there; its copy
bandwidth (host memory) prints as measured. A row of adaln_lab's replay standing in for a library
that is not installed (`replay_of`, the row `diffusers_replay`) gets a line saying so.
`block_markdown` renders a block report (`python -m adaln_lab block-report`); `render` picks by the
file's kind.
"""

from __future__ import annotations

import json
from pathlib import Path

GRADS = ("x", "nw", "temb", "w", "b")
BLOCK_GRADS = ("x", "norm1_weight", "norm2_weight", "temb", "weight", "bias")
NA = "n/a"
NA_CPU = "n/a on CPU"
BLOCK_KIND = "adaln_lab_block_report"


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
    if isinstance(report, dict) and report.get("kind") == BLOCK_KIND:
        if not isinstance(report.get("sizes"), dict):
            raise ReportError(f"{path} is not a complete adaln_lab block report (no sizes)")
        return report
    if not isinstance(report, dict) or not isinstance(report.get("results", {}).get("plain"), dict) \
            or "memory_floor" not in report:
        raise ReportError(f"{path} is neither an adaln_lab report (no results.plain / memory_floor) nor a "
                          "block report")
    return report


def _us(value) -> str:
    if value is None:
        return NA
    return f"{value:.0f}" if value >= 10 else f"{value:.1f}"


def _spread(figures: dict, key: str) -> str:
    """" ±N%": half the interquartile range of `key`'s samples in % of their median; "" without samples."""
    s = (figures.get("spread_us") or {}).get(key)
    if not s or not s.get("median"):
        return ""
    return f" ±{50 * (s['p75'] - s['p25']) / s['median']:.0f}%"


def _timed(figures: dict, key: str) -> str:
    """`figures[key]` in us with its spread, or n/a."""
    value = figures.get(key)
    return NA if value is None else _us(value) + _spread(figures, key)


def _with_floor(value, floor, figures: dict | None = None, key: str = "") -> str:
    if value is None:
        return NA
    text = _us(value) + (_spread(figures, key) if figures else "")
    return f"{text} ({value / floor:.2f}x)" if floor else text


def _yes(flag) -> str:
    return NA if flag is None else ("yes" if flag else "no")


def _grad_errors(a: dict) -> str:
    errors = a.get("grad_rel_err")
    if not errors:
        return NA
    return " / ".join(f"{errors[g]:.2g}" if errors.get(g) is not None else NA for g in GRADS)


def on_cpu(report: dict) -> bool:
    """Whether the report was measured on a CPU: its recorded device, else no GPU and no CUDA anywhere."""
    device = report.get("device") or (report.get("environment") or {}).get("device")
    if device:
        return not str(device).startswith("cuda")
    if (report.get("environment") or {}).get("gpu"):
        return False
    reasons = [figures.get(key + "_error") for figures in _figures(report)
               for key in ("fwd_us_graph", "fwd_bwd_us_graph")]
    return bool(reasons) and all(reason == "no CUDA" for reason in reasons)


def _figures(report: dict) -> list[dict]:
    if report.get("kind") == BLOCK_KIND:
        return [c for entry in report["sizes"].values() for c in entry.get("candidates", {}).values()]
    return [a for entry in report["results"]["plain"].values() for a in entry.get("accuracy_latency", {}).values()]


def rows_invariant(inv: dict):
    """The "batch invariant" column: the three row checks only (no row whose output or dx differs);
    None when the report lacks them. Parameter repeatability is the next column."""
    if "rows_invariant" in inv:
        return inv["rows_invariant"]
    try:
        counts = [r[k] for r in inv["all_rows"].values() for k in ("fwd_differ", "rowgrad_differ")]
        counts += [inv["full_vs_sub_batches"][k] for k in ("fwd_differ", "rowgrad_differ")]
        counts.append(inv["batch_size_sweep"]["differ"])
    except (KeyError, AttributeError, TypeError):
        return None
    return not any(counts)


def results_table(report: dict) -> list[str]:
    floor = report["memory_floor"]
    host_floor = report.get("autograd_floor_host_us")
    cpu = on_cpu(report)
    head = ["candidate", "rows", "batch invariant", "params repeat",
            "graph fwd us (x floor)", "graph fwd+bwd us (x floor)", "eager fwd us (x floor)",
            "eager fwd+bwd us (x floor)", "inference fwd us", "host fwd+bwd us (autograd host floor)",
            "grad err x/nw/temb/w/b"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def eager(a, key, fl):
        return (NA if a.get(key) is None else f"{_timed(a, key)} ({NA_CPU})" if cpu
                else _with_floor(a.get(key), fl, a, key))

    for S in floor:
        for name, entry in report["results"]["plain"].items():
            a = entry.get("accuracy_latency", {}).get(S)
            if a is None:
                continue
            inv = entry.get("batch_invariance", {})
            f = floor[S]
            host = a.get("host_fwd_bwd_us")
            cells = [name, S, _yes(rows_invariant(inv)), _yes(inv.get("params_repeatable")),
                     NA_CPU if cpu else _with_floor(a.get("fwd_us_graph"), f.get("fwd_us"), a, "fwd_us_graph"),
                     NA_CPU if cpu else _with_floor(a.get("fwd_bwd_us_graph"), f.get("fwd_bwd_us"), a,
                                                    "fwd_bwd_us_graph"),
                     eager(a, "fwd_us", f.get("fwd_us")),
                     eager(a, "fwd_bwd_us_pure", f.get("fwd_bwd_us")),
                     _timed(a, "fwd_us_inference"),
                     NA if host is None else f"{_timed(a, 'host_fwd_bwd_us')} (floor {_us(host_floor)})",
                     _grad_errors(a)]
            rows.append("| " + " | ".join(cells) + " |")
    return rows


def floors_table(report: dict) -> list[str]:
    cpu = on_cpu(report)
    rows = ["| rows | memory floor fwd us | memory floor fwd+bwd us |", "|---|---|---|"]
    for S, f in report["memory_floor"].items():
        fwd, fwd_bwd = (NA if f.get(key) is None else f"{f[key]:.1f}" for key in ("fwd_us", "fwd_bwd_us"))
        rows.append(f"| {S} | {NA_CPU} | {NA_CPU} |" if cpu else f"| {S} | {fwd} | {fwd_bwd} |")
    gpu, host = report.get("autograd_floor_us"), report.get("autograd_floor_host_us")
    if gpu is None and host is None:
        figures = f"{NA} (not in this report)"
    elif cpu:
        figures = f"CUDA events {NA_CPU}; {_us(gpu)} us wall clock, {_us(host)} us host"
    else:
        figures = f"{_us(gpu)} us CUDA events, {_us(host)} us host"
    rows += ["", f"autograd floor (fwd+bwd of an identity autograd.Function over the 5 leaves): {figures}."]
    return rows


def same_errors(report: dict) -> list[list[str]]:
    """Groups (2 or more) of candidates whose forward and gradient errors are equal at every size."""
    groups: dict[str, list[str]] = {}
    for name, entry in report["results"]["plain"].items():
        key = json.dumps({S: [a.get("fwd_rel_err"), a.get("grad_rel_err")]
                          for S, a in entry.get("accuracy_latency", {}).items()}, sort_keys=True)
        groups.setdefault(key, []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def cpu_lines(report: dict) -> list[str]:
    """What a CPU report's rows measure, in a line or two."""
    lines = ["- CPU run: every time is this CPU's wall clock of torch code (CUDA events, CUDA graphs and the memory "
             f"floor with its multiples are GPU figures: {NA_CPU}, null in the JSON)."]
    for names in same_errors(report):
        why = (" (adaln_lab falls back to its op-for-op torch replay of diffusers' module off CUDA, not its "
               "kernels)" if "adaln_lab" in names else "")
        lines.append(f"- {' and '.join(names)} give the same errors: on a CPU they run the same torch ops{why}.")
    return lines


def replay_lines(rows: dict) -> list[str]:
    """A line per row that is adaln_lab's replay standing in for a library not installed (`replay_of`)."""
    return [f"- {name}: NOT {entry['replay_of']} ({entry['replay_of']} is not installed here): adaln_lab's op-for-op "
            f"replay of it" for name, entry in rows.items() if entry.get("replay_of")]


def spread_lines(figures: list[dict]) -> list[str]:
    """The legend of " ±N%", when any figure has samples."""
    if not any(a.get("spread_us") for a in figures):
        return []
    return ["- ±N%: half the interquartile range of a time's samples, in % of their median (min to max: spread_us "
            "in the JSON)."]


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
    if on_cpu(report):
        lines[:0] = cpu_lines(report)
    elif no_cuda:
        lines.insert(0, "- graph columns: n/a (no CUDA in this run)")
    lines[:0] = replay_lines(report["results"]["plain"])
    lines += spread_lines(_figures(report))
    lines.append("- batch invariant: no row whose output or dx differs in all_rows, full_vs_sub_batches and "
                 "batch_size_sweep; params repeat: parameter gradients bitwise equal over 3 identical calls.")
    lines += [f"- {name} ran: {entry.get('source', NA)}" for name, entry in report["results"]["plain"].items()]
    return lines


def copy_text(report: dict) -> str:
    """The copy bandwidth the report measured: the GPU's, or on a CPU host memory's (no floor drawn from it)."""
    copy, cpu = report.get("copy_TBps"), on_cpu(report)
    figure = NA if copy is None else f"{copy:.3g}" if cpu else f"{copy:.2f}"
    return f"host memory copy {figure} TB/s (no floor on CPU)" if cpu else f"copy {figure} TB/s"


def _tail(report: dict) -> str:
    env = report.get("environment") or {}
    where = env.get("gpu") or env.get("cpu") or report.get("device") or NA
    return f"{where}, {copy_text(report)}; commit {str(report.get('adaln_lab_commit'))[:7]}."


def markdown(report: dict) -> str:
    """The tables of a report (`run_report`), or of a block report (`block_markdown`)."""
    if report.get("kind") == BLOCK_KIND:
        return block_markdown(report)
    return "\n".join(results_table(report) + [""] + floors_table(report) + [""] + notes(report) + ["", _tail(report)])


def block_markdown(report: dict) -> str:
    """A block report's tables: per size and candidate the CUDA-graph times (x floor, x adaln_lab), host
    times, bitwise repeat and errors against the float64 block; the floors; what each row ran."""
    cpu = on_cpu(report)
    head = ["rows", "candidate", "graph fwd+bwd us (x floor)", "graph fwd us (x floor)", "fwd+bwd x adaln_lab",
            "host fwd+bwd us", "host fwd us", "grads repeat", "fwd err",
            "grad err x/norm1/norm2/temb/w/b"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    floors = ["| rows | floor fwd us | floor fwd+bwd us |", "|---|---|---|"]
    failures, sources, replays = [], {}, {}
    for S, entry in report["sizes"].items():
        fl = entry.get("floor", {})
        floors.append(f"| {S} | {NA_CPU} | {NA_CPU} |" if cpu else
                      f"| {S} | {_us(fl.get('fwd_us'))} | {_us(fl.get('fwd_bwd_us'))} |")
        for name, c in entry.get("candidates", {}).items():
            sources.setdefault(name, c.get("source", NA))
            replays.setdefault(name, c)
            errors = c.get("grad_rel_err") or {}
            ratio = c.get("fwd_bwd_graph_x_adaln_lab")
            cells = [S, name,
                     NA_CPU if cpu else _with_floor(c.get("fwd_bwd_us_graph"), fl.get("fwd_bwd_us"), c,
                                                    "fwd_bwd_us_graph"),
                     NA_CPU if cpu else _with_floor(c.get("fwd_us_graph"), fl.get("fwd_us"), c, "fwd_us_graph"),
                     NA_CPU if cpu else (NA if ratio is None else f"{ratio:.2f}x"),
                     _timed(c, "host_fwd_bwd_us"), _timed(c, "host_fwd_us"), _yes(c.get("grads_repeat_bitwise")),
                     NA if c.get("fwd_rel_err") is None else f"{c['fwd_rel_err']:.2g}",
                     " / ".join(NA if errors.get(g) is None else f"{errors[g]:.2g}" for g in BLOCK_GRADS)]
            rows.append("| " + " | ".join(str(cell) for cell in cells) + " |")
            for key, label in (("fwd_us_graph", "fwd"), ("fwd_bwd_us_graph", "fwd+bwd")):
                reason = c.get(key + "_error")
                if c.get(key) is None and reason and reason != "no CUDA":
                    failures.append(f"- graph {label} of {name} @{S} failed to capture: {reason}")
    lines = [f"- CPU run: host times are this CPU's wall clock of the torch code; CUDA graphs and the memory floor "
             f"are GPU figures ({NA_CPU}, null in the JSON)."] if cpu else []
    lines = replay_lines(replays) + lines + failures + spread_lines(_figures(report))
    lines += [f"- {name} ran: {source}" for name, source in sources.items()]
    if report.get("golden"):
        lines.append(f"- errors against: {report['golden']}")
    shape = report.get("shape") or {}
    tail = (f"block report, H {shape.get('H', NA)}, D {shape.get('D', NA)}, T {shape.get('T', NA)}; "
            f"{copy_text(report)}; commit {str(report.get('adaln_lab_commit'))[:7]}.")
    return "\n".join(rows + [""] + floors + [""] + lines + ["", tail])


def render(path: str | Path) -> str:
    """`markdown(load(path))`, with a malformed report turned into ReportError too."""
    report = load(path)
    try:
        return markdown(report)
    except (KeyError, TypeError, AttributeError, ValueError) as error:
        raise ReportError(f"{path} is not a complete adaln_lab report: {type(error).__name__}: {error}") from None
