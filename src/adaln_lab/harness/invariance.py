"""Bitwise batch invariance of any candidate, the seed report's three checks plus repeatability.

- `all_rows`: every row alone versus inside full batches (sizes x seeds).
- `full_vs_sub_batches`: one big batch versus contiguous sub-batches covering it; sub-batches of
  fewer than `small_limit` rows start every `small_step` rows.
- `batch_size_sweep`: probe rows placed first, middle and last inside batches of many sizes filled
  with other rows, plus the whole pool reversed.
- `params_repeatable`: the same call twice gives the same bits for every parameter gradient.

A row "differs" when its forward output (or its dx) is not bitwise equal to the reference row;
`fwd_differ` counts rows whose output differs, `rowgrad_differ` rows whose dx (the gradient of x)
differs. Each row check also records the largest |diff| of those elements (`fwd_max_abs_diff`,
`rowgrad_max_abs_diff`; a NaN against a number counts as inf) and where the first differing row
was (`first_differ`, null when none). `failure_summary` says all that in a few lines.
"""

from __future__ import annotations

import torch
from .calls import forward_backward
from .inputs import Inputs, make, upstream
from .progress import progress

MAX_FAILURES = 10
PARAMETERS = ("norm_weight", "temb", "weight", "bias")


def _rows_differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Bool per row: any element of the row not bitwise equal (NaN payloads included)."""
    a = a.reshape(a.shape[0], -1).contiguous()
    b = b.reshape(b.shape[0], -1).contiguous()
    if a.dtype.is_floating_point:
        view = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        a, b = a.view(view), b.view(view)
    return (a != b).any(dim=1)


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b| over the elements that are not bitwise equal (float64; NaN against anything: inf)."""
    a, b = a.reshape(a.shape[0], -1).contiguous(), b.reshape(b.shape[0], -1).contiguous()
    if a.dtype.is_floating_point:
        view = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        unequal = a.view(view) != b.view(view)
    else:
        unequal = a != b
    if not bool(unequal.any()):
        return 0.0
    diff = (a.to(torch.float64) - b.to(torch.float64)).abs()[unequal]
    return float(torch.nan_to_num(diff, nan=float("inf")).max())


class _Tally:
    """Counts of rows whose output / dx differ, their largest |diff| and the first differing row."""

    def __init__(self):
        self.fwd = self.dx = 0
        self.fwd_max = self.dx_max = 0.0
        self.first = None

    def add(self, result, reference, rows, reference_rows, where) -> torch.Tensor:
        """Compare `result`'s `rows` with `reference`'s `reference_rows`; `where(k)` describes the k-th row."""
        a, b = result.out[rows], reference.out[reference_rows]
        ga, gb = result.grads["x"][rows], reference.grads["x"][reference_rows]
        fwd, dx = _rows_differ(a, b), _rows_differ(ga, gb)
        self.fwd += int(fwd.sum())
        self.dx += int(dx.sum())
        if bool(fwd.any()):
            self.fwd_max = max(self.fwd_max, max_abs_diff(a, b))
        if bool(dx.any()):
            self.dx_max = max(self.dx_max, max_abs_diff(ga, gb))
        bad = fwd | dx
        if self.first is None and bool(bad.any()):
            self.first = where(int(torch.nonzero(bad)[0]))
        return bad

    def figures(self) -> dict:
        return {"fwd_differ": self.fwd, "rowgrad_differ": self.dx, "fwd_max_abs_diff": self.fwd_max,
                "rowgrad_max_abs_diff": self.dx_max, "first_differ": self.first}


def all_rows(fn, sizes, seeds, device, shape) -> dict:
    out = {}
    for n in sizes:
        tally = _Tally()
        with progress(n * len(seeds), f"all_rows n={n}") as bar:
            for seed in seeds:
                batch = make(seed, n, device, **shape)
                dy = upstream(seed, batch.x)
                full = forward_backward(fn, batch, dy)
                for r in range(n):
                    alone = forward_backward(fn, batch.rows(torch.tensor([r])), dy[r:r + 1])
                    tally.add(alone, full, slice(0, 1), slice(r, r + 1), lambda k: {"seed": seed, "row": r})
                    bar.update()
        out[str(n)] = {"rows": n * len(seeds), **tally.figures()}
    return out


def sub_batch_starts(full_batch: int, size: int, small_limit: int, small_step: int) -> range:
    """Where the sub-batches of `size` rows start: tiling the batch, or every `small_step` rows."""
    return range(0, full_batch, size if size >= small_limit else small_step)


def full_vs_sub_batches(fn, full_batch, sizes, seeds, small_limit, small_step, device, shape) -> dict:
    count = rows = 0
    tally = _Tally()
    total = len(seeds) * sum(len(sub_batch_starts(full_batch, s, small_limit, small_step)) for s in sizes)
    with progress(total, f"full_vs_sub_batches N={full_batch}") as bar:
        for seed in seeds:
            batch = make(seed, full_batch, device, **shape)
            dy = upstream(seed, batch.x)
            full = forward_backward(fn, batch, dy)
            for size in sizes:
                for start in sub_batch_starts(full_batch, size, small_limit, small_step):
                    stop = min(start + size, full_batch)
                    index = torch.arange(start, stop)
                    sub = forward_backward(fn, batch.rows(index), dy[start:stop])
                    tally.add(sub, full, slice(None), slice(start, stop),
                              lambda k, seed=seed, size=size, start=start:
                              {"seed": seed, "sub_batch_size": size, "sub_batch_start": start, "row": start + k})
                    count += 1
                    rows += stop - start
                    bar.update()
            del full, batch, dy
    return {"full_batch": full_batch, "sub_batch_sizes": list(sizes), "sub_batches": count,
            "rows_compared": rows, **tally.figures()}


def sweep_positions(b: int) -> list[int]:
    """First, middle and last position in a batch of b rows, without repeats."""
    return sorted({0, b // 2, b - 1})


def batch_size_sweep(fn, batch_sizes, probe_rows, pool_size, seeds, device, shape) -> dict:
    comparisons = differ = 0
    failures: list[dict] = []
    tally = _Tally()
    per_seed = sum(len(sweep_positions(b)) for b in batch_sizes) * len(probe_rows) + len(probe_rows)

    def compare(result, positions, reference, probes, seed, b, where):
        nonlocal comparisons, differ
        bad = tally.add(result, reference, positions, probes, lambda k: None)
        comparisons += len(probes)
        differ += int(bad.sum())
        for k in torch.nonzero(bad).flatten().tolist():
            if len(failures) < MAX_FAILURES:
                failures.append({"seed": seed, "batch_size": b, "probe_row": int(probes[k]), "position": where})

    with progress(per_seed * len(seeds), "batch_size_sweep") as bar:
        for seed in seeds:
            pool = make(seed, pool_size, device, **shape)
            dy = upstream(seed, pool.x)
            reference = forward_backward(fn, pool, dy)
            order = torch.randperm(pool_size, generator=torch.Generator().manual_seed(seed))
            for b in batch_sizes:
                for p in probe_rows:
                    fillers = order[order != p][: b - 1]
                    for pos in sweep_positions(b):
                        index = torch.cat([fillers[:pos], torch.tensor([p]), fillers[pos:]])
                        result = forward_backward(fn, pool.rows(index), dy[index.to(dy.device)])
                        compare(result, [pos], reference, [p], seed, b, pos)
                        bar.update()
            reverse = torch.arange(pool_size - 1, -1, -1)
            result = forward_backward(fn, pool.rows(reverse), dy[reverse.to(dy.device)])
            compare(result, [pool_size - 1 - p for p in probe_rows], reference, list(probe_rows), seed,
                    pool_size, "reversed")
            bar.update(len(probe_rows))
    figures = tally.figures()
    return {"batch_sizes": list(batch_sizes), "probe_rows": list(probe_rows), "comparisons": comparisons,
            "differ": differ, "first_failures": failures, "fwd_differ": figures["fwd_differ"],
            "rowgrad_differ": figures["rowgrad_differ"], "fwd_max_abs_diff": figures["fwd_max_abs_diff"],
            "rowgrad_max_abs_diff": figures["rowgrad_max_abs_diff"]}


def params_repeatable(fn, inputs: Inputs, dy: torch.Tensor, repeats: int = 3) -> dict:
    """Whether `repeats` identical calls give bitwise equal parameter gradients, per parameter."""
    first = forward_backward(fn, inputs, dy)
    same = {name: True for name in PARAMETERS}
    for _ in range(repeats - 1):
        again = forward_backward(fn, inputs, dy)
        for name in PARAMETERS:
            same[name] &= not bool(_rows_differ(again.grads[name].reshape(1, -1),
                                                first.grads[name].reshape(1, -1)).any())
    return same


def rows_invariant(report: dict) -> bool:
    """The three row checks only: no row whose output or dx differs (parameter repeatability aside)."""
    rows = report["all_rows"].values()
    return (all(r["fwd_differ"] == 0 and r["rowgrad_differ"] == 0 for r in rows)
            and report["full_vs_sub_batches"]["fwd_differ"] == 0
            and report["full_vs_sub_batches"]["rowgrad_differ"] == 0
            and report["batch_size_sweep"]["differ"] == 0)


def batch_invariant(report: dict) -> bool:
    """The seed's verdict: no differing row anywhere and repeatable parameter gradients."""
    return bool(report["params_repeatable"]) and rows_invariant(report)


def _g(value) -> str:
    return "n/a" if value is None else f"{value:.3g}"


def _counts(fwd: int, dx: int, of: int, fwd_max, dx_max) -> str:
    parts = []
    if fwd:
        parts.append(f"{fwd} of {of} rows differ in the output (largest |diff| {_g(fwd_max)})")
    if dx:
        parts.append(f"{dx} of {of} rows differ in dx, the gradient of x (largest |diff| {_g(dx_max)})")
    return "; ".join(parts)


def _first(where: dict | None) -> str:
    if not where:
        return ""
    return "; first differing row: " + ", ".join(f"{k}={v}" for k, v in where.items())


def failure_summary(report: dict) -> list[str]:
    """One line per failed check of `batch_invariance`'s report (at most 4): which check, how many rows
    differ (output and dx apart), the largest |diff| and the first differing row; then one line naming
    the checks that passed."""
    lines, passed = [], []
    failed = {n: r for n, r in report["all_rows"].items() if r["fwd_differ"] or r["rowgrad_differ"]}
    if failed:
        rows = sum(r["rows"] for r in report["all_rows"].values())
        fwd, dx = (sum(r[k] for r in failed.values()) for k in ("fwd_differ", "rowgrad_differ"))
        big = [max(r[k] for r in failed.values()) if all(k in r for r in failed.values()) else None
               for k in ("fwd_max_abs_diff", "rowgrad_max_abs_diff")]
        n, first = next(iter(failed.items()))
        where = first.get("first_differ")
        lines.append(f"all_rows (each row alone vs inside a batch of n = {', '.join(report['all_rows'])} rows): "
                     f"{_counts(fwd, dx, rows, *big)}{_first(where and {'n': n, **where})}")
    else:
        passed.append("all_rows")
    sub = report["full_vs_sub_batches"]
    if sub["fwd_differ"] or sub["rowgrad_differ"]:
        detail = _counts(sub["fwd_differ"], sub["rowgrad_differ"], sub.get("rows_compared", "the"),
                         sub.get("fwd_max_abs_diff"), sub.get("rowgrad_max_abs_diff"))
        lines.append(f"full_vs_sub_batches (a {sub['full_batch']}-row batch vs {sub['sub_batches']} sub-batches of "
                     f"{', '.join(map(str, sub['sub_batch_sizes']))} rows): {detail}{_first(sub.get('first_differ'))}")
    else:
        passed.append("full_vs_sub_batches")
    sweep = report["batch_size_sweep"]
    if sweep["differ"]:
        first = sweep["first_failures"][0] if sweep["first_failures"] else None
        detail = _counts(sweep.get("fwd_differ", 0), sweep.get("rowgrad_differ", 0), sweep["comparisons"],
                         sweep.get("fwd_max_abs_diff"), sweep.get("rowgrad_max_abs_diff"))
        detail = detail or f"{sweep['differ']} of {sweep['comparisons']} placed rows differ"
        lines.append(f"batch_size_sweep (probe rows {', '.join(map(str, sweep['probe_rows']))} placed first, "
                     f"middle and last in batches of {min(sweep['batch_sizes'])} to {max(sweep['batch_sizes'])} "
                     f"rows, and the pool reversed): {detail}{_first(first)}")
    else:
        passed.append("batch_size_sweep")
    if not report["params_repeatable"]:
        bad = [name for name, same in report.get("params_repeatable_each", {}).items() if not same]
        lines.append(f"params_repeatable (the same call 3 times): the gradients of {', '.join(bad) or 'a parameter'} "
                     "differ between identical calls (unordered accumulation, e.g. atomics)")
    else:
        passed.append("params_repeatable")
    return lines + ([f"passed: {', '.join(passed)}"] if passed else [])
