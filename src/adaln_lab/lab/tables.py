"""Markdown tables of the notebooks, from a report (`python -m adaln_lab report`) or a lab file.

Every number is printed with `fmt` (3 significant digits, or 'n/a'), so a test can find the
report's figures in a notebook's output by formatting them the same way. The report's tables take
None for a report that is not there (a folder of `python -m adaln_lab.lab --out DIR` has none) and
say so in one line (`evidence.missing`) instead.
"""

from __future__ import annotations

GRADS = ("x", "nw", "temb", "w", "b")
NA = "n/a"


def fmt(value, digits: int = 3) -> str:
    """3 significant digits ('0.0068', '1.47e-07', '246'), 'n/a' for None."""
    if value is None:
        return NA
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    return f"{value:.{digits}g}"


def us(value) -> str:
    """Microseconds with one decimal ('63.6', '1105.2'), 'n/a' for None."""
    return NA if value is None else f"{value:.1f}"


def pct(value, digits: int = 3) -> str:
    """A fraction as a percentage with `digits` decimals ('99.972 %'), 'n/a' for None."""
    return NA if value is None else f"{100 * value:.{digits}f} %"


def table(head: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(fmt(c) if not isinstance(c, str) else c for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _no_report(what: str) -> str:
    from .evidence import missing

    return missing("report.json", what)


def report_errors(report: dict | None) -> str:
    """Forward and gradient errors (max|err| / max|ref| vs the float64 golden) of a report, with the
    fraction of d_bias correctly rounded, per size and candidate."""
    if report is None:
        return _no_report("the report's errors")
    rows = []
    for S in report["memory_floor"]:
        for name, entry in report["results"]["plain"].items():
            a = entry["accuracy_latency"][S]
            rows.append([name, S, a["fwd_rel_err"], *(a["grad_rel_err"][g] for g in GRADS),
                         pct(a["grad_correctly_rounded"]["b"])])
    return table(["candidate", "rows", "fwd", *(f"d{g}" for g in GRADS), "d_bias correctly rounded"], rows)


def lab_errors(data: dict, sizes=None) -> str:
    """The same columns from a lab_errors.json (`errors.measure`), at `sizes` (default table_sizes)."""
    rows = []
    for S in sizes or data["table_sizes"]:
        for name, e in data["errors"][str(S)].items():
            rows.append([name, str(S), e["fwd_rel_err"], *(e["grad_rel_err"][g] for g in GRADS),
                         pct(e["grad_correctly_rounded"]["b"])])
    return table(["candidate", "rows", "fwd", *(f"d{g}" for g in GRADS), "d_bias correctly rounded"], rows)


def attribution(att: dict) -> str:
    names = sorted({n for v in att["variants"] for n in v["match"]})
    rows = [[v["label"], v["max_rel_err"], v["rms_rel_err"], *(pct(v["match"][n]) for n in names)]
            for v in att["variants"]]
    return table(["roundings on", "max rel err", "rms rel err", *(f"{n}: bitwise equal" for n in names)], rows)


def spread(sp: dict) -> str:
    rows = []
    for name, params in sp["candidates"].items():
        for p, e in params.items():
            rows.append([name, p, e["distinct"], pct(e["differ_fraction"]), e["max_spread_rel"]])
    return table(["candidate", "gradient", f"distinct of {sp['repeats']} runs", "elements differing",
                   "max spread / max|g|"], rows)


def report_latency(report: dict | None) -> str:
    """Per size and candidate: graph, eager and host times, memory floor and autograd host floor (us)."""
    if report is None:
        return _no_report("the report's times")
    rows = []
    host_floor = report.get("autograd_floor_host_us")
    for S, floor in report["memory_floor"].items():
        for name, entry in report["results"]["plain"].items():
            a = entry["accuracy_latency"][S]
            rows.append([name, S] + [us(v) for v in (
                a.get("fwd_us_graph"), a.get("fwd_us"), a.get("host_fwd_us"), floor["fwd_us"],
                a.get("fwd_bwd_us_graph"), a.get("fwd_bwd_us_pure"), a.get("host_fwd_bwd_us"), floor["fwd_bwd_us"],
                host_floor)])
    return table(["candidate", "rows", "fwd graph", "fwd eager", "fwd host", "fwd floor", "fwd+bwd graph",
                   "fwd+bwd eager", "fwd+bwd host", "fwd+bwd floor", "autograd host floor"], rows)


def kernels(rows: list[dict]) -> str:
    """A roofline list (`latency.roofline` / `latency.sweep_roofline`): us, MB, TB/s, x own floor."""
    out = [[k["name"], k["calls"], us(k["us"]), None if k["bytes"] is None else f"{k['bytes'] / 1e6:.1f}", k["TBps"],
            us(k["floor_us"]), k["x_floor"]] for k in rows]
    return table(["kernel", "launches", "us", "MB moved", "TB/s", "floor us", "x floor"], out)


def invariance(report: dict | None) -> str:
    """The report's verdicts per candidate: the three row checks and parameter-gradient repeatability."""
    if report is None:
        return _no_report("the full protocol's verdicts")
    rows = []
    for name, entry in report["results"]["plain"].items():
        b = entry["batch_invariance"]
        all_rows = sum(r["fwd_differ"] for r in b["all_rows"].values()), \
            sum(r["rowgrad_differ"] for r in b["all_rows"].values())
        sub, sweep = b["full_vs_sub_batches"], b["batch_size_sweep"]
        rows.append([name, f"{all_rows[0]} / {all_rows[1]}", f"{sub['fwd_differ']} / {sub['rowgrad_differ']}",
                     f"{sweep['differ']} of {sweep['comparisons']}",
                     ", ".join(p for p, ok in b["params_repeatable_each"].items() if not ok) or "all repeatable",
                     b["batch_invariant"]])
    return table(["candidate", "all_rows: out / dx rows differ", "sub-batches: out / dx rows differ",
                   "sweep: rows differ", "parameter grads not repeatable", "batch invariant"], rows)


def check_detail(check: str, result: dict) -> str:
    """One line for one check's result (`walkthrough.run_check`)."""
    if check == "all_rows":
        return "; ".join(f"n={n}: {v['fwd_differ']} out / {v['rowgrad_differ']} dx of {v['rows']}"
                         for n, v in result.items())
    if check == "full_vs_sub_batches":
        return (f"{result['sub_batches']} sub-batches: {result['fwd_differ']} out / {result['rowgrad_differ']} "
                "dx rows differ")
    if check == "batch_size_sweep":
        return f"{result['differ']} of {result['comparisons']} probe placements differ"
    return ", ".join(f"{p}: {'same' if ok else 'DIFFERS'}" for p, ok in result.items())


def checks(results: dict, check: str) -> str:
    """Live results of one check per candidate ({name: result}), with the verdict."""
    from .walkthrough import failures

    return table(["candidate", check, "verdict"],
                 [[name, check_detail(check, r), "pass" if failures(check, r) == 0 else "FAIL"]
                  for name, r in results.items()])


PARITY = "adaln_lab's forward against diffusers'"


def parity(report: dict | None) -> dict:
    """{table backend: {rows: parity}} of a report's `forward_parity_vs_diffusers`; {} where it has none
    (no report, or a CPU run's: the harness measures it on CUDA only)."""
    if report is None:
        return {}
    return report["results"]["plain"].get("adaln_lab", {}).get("forward_parity_vs_diffusers") or {}


def report_parity(report: dict | None) -> str:
    """adaln_lab's forward against diffusers' in a report (`forward_parity_vs_diffusers`): bitwise
    equal, within one ulp, largest distance in ulps of the output and of the final add's operand;
    one line saying it was not measured where the report has none."""
    if report is None:
        return _no_report(PARITY)
    if not parity(report):
        from .evidence import NOT_MEASURED, machine

        return f"{PARITY}: {NOT_MEASURED} (the report of {machine(report)} has none: a CUDA run measures it)"
    rows = [[backend, S, pct(p["bitwise_equal_fraction"], 5), pct(p["within_1_ulp_fraction"], 5), p["max_ulp"],
             p["max_operand_ulp"]] for backend, sizes in parity(report).items() for S, p in sizes.items()]
    return table(["adaln_lab", "rows", "bitwise equal", "within 1 ulp", "max ulps (output)",
                  "max ulps (largest operand of + shift)"], rows)


def parity_largest(report: dict | None, backend: str = "table_backend=cuda") -> str | None:
    """The sentence on the largest distance of `report_parity` (output ulps against the ulps of the larger
    operand of `+ shift`), or None where the report has no parity figures for `backend`."""
    sizes = parity(report).get(backend)
    if not sizes:
        return None
    worst = max(sizes.values(), key=lambda p: p["max_ulp"])
    return (f"largest distance there: {worst['max_ulp']} ulps of the output, but {worst['max_operand_ulp']} ulps of "
            "the larger operand of `+ shift`: a cancellation, not an arithmetic error")


ZERO_OUTPUT = "out = 0 (no ratio)"


def cancellation(value) -> str:
    """A cancellation ratio of `errors.ulp_analysis` ('133'), or 'out = 0 (no ratio)' where the output is 0."""
    from .ulps import is_zero_output

    return ZERO_OUTPUT if is_zero_output(value) else fmt(value)


def cancellation_bins(u: dict) -> str:
    """Per cancellation bin of one `errors.ulp_analysis`: elements, those that differ, the largest distance;
    the elements whose output is 0 in a row of their own (files written before that count fold them into
    the last bin, and the table says so)."""
    rows = [[f"[{b['from']}, {'inf' if b['to'] is None else b['to']})", b["elements"], b["differ"], b["max_ulp"]]
            for b in u["by_cancellation"]]
    zero = u.get("zero_output")
    if zero is not None:
        rows.append([ZERO_OUTPUT, zero["elements"], zero["differ"], zero["max_ulp"]])
    else:
        rows[-1][0] += " incl. out = 0 (file written before they were counted apart)"
    return table(["cancellation", "elements", "differ", "largest ulps"], rows)


def ulp_largest(u: dict) -> str:
    """The largest distances of one `errors.ulp_analysis`: where, the two values, shift, p and cancellation."""
    return table(["row", "col", "ulps", "this", "diffusers", "shift", "p", "cancellation"],
                 [[d["row"], d["col"], d["ulps"], d["a"], d["b"], d["shift"], d["product"],
                   cancellation(d["cancellation"])] for d in u["largest"]])


def against_report(comparison: dict) -> str:
    """`errors.against_report`: one line of counts per verdict, then the figures that are not equal."""
    rows = comparison["rows"]
    counts = {}
    for r in rows:
        counts[r["verdict"]] = counts.get(r["verdict"], 0) + 1
    head = (f"lab file at commit {comparison['lab_commit'][:7]}, report at {comparison['report_commit'][:7]}: "
            f"{len(rows)} figures in both; " + ", ".join(f"{n} {v}" for v, n in counts.items()))
    differ = [[r["rows"], r["candidate"], r["quantity"], r["lab"], r["report"], r["verdict"]]
              for r in rows if r["verdict"] != "equal"]
    if not differ:
        return head
    return head + "\n\n" + table(["rows", "candidate", "error of", "lab file", "report.json", "why they differ"],
                                 differ)
