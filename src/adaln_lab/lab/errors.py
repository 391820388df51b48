"""Error analysis of the candidates against float64 goldens (`adaln_lab.reference`).

Shapes: x (S, H) bf16, norm_weight (H,), temb (T, D) fp32, weight (2H, D), bias (2H,),
timestep_indices (S,) int64, upstream gradient dy (S, H) bf16 (`harness.inputs.upstream`).
Metric everywhere: max|err| / max|ref| against the float64 `pure` golden (the seed report's, as in
`harness.accuracy`), plus the fraction of a bf16 result equal to the exact value rounded once.

- `errors_at`: forward and the five gradients of each candidate at one size; the golden is
  evaluated `chunk_rows` rows at a time (parameter gradients summed over chunks in float64), so
  131072 rows at H = 5376 fit a GPU: a float64 (S, H) tensor is 5.6 GB there. Cost measured on
  a 2-core CPU (H = 5376, chunks of 8192 rows): ~0.6 s per chunk for the weight side plus ~0.17 ms
  per row, i.e. ~25 s at 131072 rows, each candidate's own call aside, so CPUs run the small
  sizes; on an H200 it is memory-bound elementwise work, ~0.5 kB of float64 traffic per element
  (~20 GB per chunk, ~5 ms at 4 TB/s): ~0.1 s at 131072 rows.
- `rounded_golden` / `attribution`: the forward in float64 with any subset of diffusers' six
  rounding points switched on (`ROUNDING_POINTS`): none is `golden(flavour="pure")`, SiLU cast
  and table is `golden(flavour="declared")`, all six is diffusers' own arithmetic.
- `ulp_analysis`, `ulp_bins`, `cancellation_points`, `is_zero_output`: bf16 ulp distances
  between two outputs (`adaln_lab.lab.ulps`, importable from here too).
- `spread`: run-to-run differences of the parameter gradients of repeated identical calls.
- `measure`: all of it over a list of sizes, as the dict `python -m adaln_lab.lab` writes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..harness.accuracy import GRAD_KEYS, correctly_rounded, rel_err
from ..harness.calls import forward_backward
from ..harness.inputs import LEAVES, Inputs, make, upstream
from ..reference.final_adaln_out import golden
from .ulps import cancellation_points, is_zero_output, ulp_analysis, ulp_bins

EPS = 1e-5
F64 = torch.float64
ROUNDING_POINTS = ("silu", "table", "rms_norm", "one_plus_scale", "product", "shift_add")
DECLARED = ("silu", "table")  # reference.golden(flavour="declared")
PARAMETERS = ("norm_weight", "temb", "weight", "bias")


def rounded_golden(inputs: Inputs, rounded=(), eps: float = EPS) -> torch.Tensor:
    """Forward (S, H) float64 with the named rounding points of diffusers switched on.

    Points: "silu" (SiLU output cast to weight's dtype), "table" (the linear's output in weight's
    dtype), "rms_norm" (F.rms_norm's output in x's dtype), "one_plus_scale", "product",
    "shift_add" (each rounded to the stream dtype, promote(x, weight)). A rounding is `.to(dtype)`
    then back to float64; everything else is float64, in `reference.golden`'s order.
    """
    unknown = set(rounded) - set(ROUNDING_POINTS)
    if unknown:
        raise ValueError(f"unknown rounding points {sorted(unknown)}; known: {ROUNDING_POINTS}")
    proj = inputs.weight.dtype
    norm_dtype = torch.promote_types(inputs.x.dtype, inputs.norm_weight.dtype)
    stream = torch.promote_types(norm_dtype, proj)

    def r(value, dtype, point):
        return value.to(dtype).to(F64) if point in rounded else value

    x, nw, temb, w, b = (t.detach().to(F64) for t in inputs.leaves)
    act = r(F.silu(temb), proj, "silu")
    shift, scale = r(F.linear(act, w, b), proj, "table").chunk(2, dim=-1)
    normed = r(x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * nw, norm_dtype, "rms_norm")
    factor = r(1.0 + scale, stream, "one_plus_scale")
    idx = inputs.timestep_indices
    product = r(normed * factor.index_select(0, idx), stream, "product")
    return r(product + shift.index_select(0, idx), stream, "shift_add")


class _Stat:
    """max|value - ref|, max|ref| and the count of value == ref rounded once, over chunks."""

    def __init__(self):
        self.err = self.ref = 0.0
        self.exact = self.count = 0

    def add(self, value: torch.Tensor, ref: torch.Tensor) -> None:
        if value.numel() == 0:
            return
        self.err = max(self.err, float((value.to(F64) - ref).abs().max()))
        self.ref = max(self.ref, float(ref.abs().max()))
        self.exact += int((value == ref.to(value.dtype)).sum())
        self.count += value.numel()

    @property
    def rel(self) -> float:
        return self.err / self.ref if self.ref else float("nan")

    @property
    def correctly_rounded(self) -> float:
        return self.exact / self.count if self.count else float("nan")


def golden_by_chunks(inputs: Inputs, dy: torch.Tensor, visit, chunk_rows: int = 8192) -> dict:
    """The `pure` golden's forward and gradients, `chunk_rows` rows of x at a time.

    Calls `visit(start, stop, out, dx)` per chunk (out, dx: (stop - start, H) float64) and returns
    the parameter gradients {norm_weight (H,), temb (T, D), weight (2H, D), bias (2H,)} in float64,
    summed over the chunks by autograd's accumulation.
    """
    params = [getattr(inputs, name).detach().to(F64).requires_grad_(True) for name in PARAMETERS]
    S = inputs.x.shape[0]
    for start in range(0, S, chunk_rows):
        stop = min(S, start + chunk_rows)
        x = inputs.x[start:stop].detach().to(F64).requires_grad_(True)
        out = golden(x, *params, inputs.timestep_indices[start:stop], EPS)
        out.backward(dy[start:stop].to(F64))
        visit(start, stop, out.detach(), x.grad)
        del out, x
    return {name: (p.grad if p.grad is not None else torch.zeros_like(p)) for name, p in zip(PARAMETERS, params)}


def errors_at(candidates, inputs: Inputs, dy: torch.Tensor, chunk_rows: int = 8192):
    """({name: entry}, {name: harness Result}) for each candidate (`harness.candidates.Named`).

    entry: `fwd_rel_err`, `grad_rel_err` and `grad_correctly_rounded` keyed x, nw, temb, w, b,
    exactly `harness.accuracy.accuracy`'s figures (same definitions, chunked golden).
    """
    results = {c.name: forward_backward(c.fn, inputs, dy) for c in candidates}
    stats = {name: {"out": _Stat(), "x": _Stat()} for name in results}

    def visit(start, stop, out, dx):
        for name, result in results.items():
            stats[name]["out"].add(result.out[start:stop], out)
            stats[name]["x"].add(result.grads["x"][start:stop], dx)

    ref = golden_by_chunks(inputs, dy, visit, chunk_rows)
    entries = {}
    for name, result in results.items():
        grad_err = {"x": stats[name]["x"].rel}
        cr = {"x": stats[name]["x"].correctly_rounded}
        for leaf, key in GRAD_KEYS.items():
            if leaf != "x":
                grad_err[key] = rel_err(result.grads[leaf], ref[leaf])
                cr[key] = correctly_rounded(result.grads[leaf], ref[leaf])
        out = stats[name]["out"]
        entries[name] = {"fwd_rel_err": out.rel, "fwd_correctly_rounded": out.correctly_rounded,
                         "grad_rel_err": grad_err, "grad_correctly_rounded": cr}
    return entries, results


def _variants():
    every = ROUNDING_POINTS
    yield "none (pure golden)", ()
    for point in every:
        yield f"only {point}", (point,)
    yield "declared (silu, table)", DECLARED
    for point in every:
        yield f"all but {point}", tuple(p for p in every if p != point)
    yield "all six (diffusers)", every


def attribution(inputs: Inputs, outputs: dict | None = None) -> dict:
    """How much each rounding point contributes to the forward error (float64 goldens, (S, H)).

    `variants`: per subset of rounding points, `max_rel_err` and `rms_rel_err` (rms(err) /
    rms(pure)) against the pure golden, and for each given output (name -> (S, H) tensor) the
    fraction of elements equal to that variant rounded to the output's dtype (which roundings
    an implementation performs). `points`: per point, its error alone, the error of all six
    without it, and its share of the summed variance of the points alone (independent roundings
    add in variance).
    """
    outputs = outputs or {}
    pure = rounded_golden(inputs, ())
    ref_max, ref_rms = float(pure.abs().max()), float(pure.pow(2).mean().sqrt())
    variants = []
    for label, points in _variants():
        value = rounded_golden(inputs, points)
        err = value - pure
        variants.append({"label": label, "rounded": list(points),
                         "max_rel_err": float(err.abs().max()) / ref_max,
                         "rms_rel_err": float(err.pow(2).mean().sqrt()) / ref_rms,
                         "match": {name: float((out == value.to(out.dtype)).double().mean())
                                   for name, out in outputs.items()}})
    by_label = {v["label"]: v for v in variants}
    alone = {p: by_label[f"only {p}"]["rms_rel_err"] for p in ROUNDING_POINTS}
    total = sum(v * v for v in alone.values()) or 1.0
    points = {p: {"alone_max_rel_err": by_label[f"only {p}"]["max_rel_err"], "alone_rms_rel_err": alone[p],
                  "without_rms_rel_err": by_label[f"all but {p}"]["rms_rel_err"],
                  "variance_share": alone[p] ** 2 / total} for p in ROUNDING_POINTS}
    return {"rows": inputs.x.shape[0], "variants": variants, "points": points,
            "all_rms_rel_err": by_label["all six (diffusers)"]["rms_rel_err"]}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def spread(candidates, inputs: Inputs, dy: torch.Tensor, repeats: int = 5) -> dict:
    """Run-to-run spread of each candidate's parameter gradients over `repeats` identical calls.

    Per candidate and parameter: `distinct` (how many different bit patterns), `differ_fraction`
    (elements where some run differs from the first), `max_spread_rel` (max over runs of
    max|g_r - g_0| / max|g_0|).
    """
    out = {}
    for c in candidates:
        runs = []
        for _ in range(repeats):
            result = forward_backward(c.fn, inputs, dy)
            runs.append({name: result.grads[name] for name in PARAMETERS})
            del result
        entry = {}
        for name in PARAMETERS:
            first = runs[0][name]
            patterns, differ, worst = [], torch.zeros_like(first, dtype=torch.bool), 0.0
            for run in runs:
                g = run[name]
                if not any(torch.equal(_bits(g), p) for p in patterns):
                    patterns.append(_bits(g))
                differ |= _bits(g) != _bits(first)
                worst = max(worst, float((g.to(F64) - first.to(F64)).abs().max()))
            scale = float(first.abs().max()) or 1.0
            entry[name] = {"distinct": len(patterns), "differ_fraction": float(differ.double().mean()),
                           "max_spread_rel": worst / scale}
        out[c.name] = entry
    return {"rows": inputs.x.shape[0], "repeats": repeats, "candidates": out}


FULL_SIZES = (1024, 4097, 16384, 32768, 65536, 131072)
REPORT_SIZES = (4097, 32768)  # harness.protocol.FULL.accuracy_sizes
TABLE_SIZES = (4097, 32768, 131072)
QUICK_SHAPE = {"H": 256, "D": 128, "T": 3}
QUICK_SIZES = (64, 257, 1025, 4097)


def plan(quick: bool) -> dict:
    """Sizes of one measurement: full (the real shape) or quick (H = 256, for CPUs and CI)."""
    if quick:
        return {"shape": dict(QUICK_SHAPE), "sizes": QUICK_SIZES, "table_sizes": QUICK_SIZES[1:],
                "attribution_rows": 257, "ulp_rows": 1025, "spread_rows": 1025, "repeats": 3, "chunk_rows": 1024}
    return {"shape": {"H": 5376, "D": 2688, "T": 3}, "sizes": FULL_SIZES, "table_sizes": TABLE_SIZES,
            "attribution_rows": 4097, "ulp_rows": 32768, "spread_rows": 32768, "repeats": 5, "chunk_rows": 8192}


def measure(candidates, device, quick: bool = False, seed: int = 1, bar=None, **overrides) -> dict:
    """Every error figure of the lab on `device`, as written to lab_errors.json.

    `candidates`: `harness.candidates.Named` list (diffusers first serves as the ulp baseline).
    `overrides` replace entries of `plan(quick)`. `bar` (a tqdm) advances once per size.
    Keys: shape, sizes, table_sizes, candidates ({name: source}), errors ({rows: {name: entry}}),
    attribution, ulp ({pair label: ulp_analysis}), spread.
    """
    device = torch.device(device)
    p = {**plan(quick), **overrides}
    data = {"kind": "adaln_lab_lab_errors", "shape": p["shape"], "sizes": list(p["sizes"]),
            "table_sizes": list(p["table_sizes"]), "seed": seed,
            "candidates": {c.name: c.source for c in candidates},
            "warnings": {c.name: c.warning for c in candidates if c.warning},
            "errors": {}, "attribution": None, "ulp": {}, "spread": None}
    names = [c.name for c in candidates]
    # the report's sizes first, in its order: torch.compile then compiles (static, then dynamic) as in the report
    order = [S for S in REPORT_SIZES if S in p["sizes"]] + [S for S in p["sizes"] if S not in REPORT_SIZES]
    for S in order:
        inputs = make(seed, S, device, **p["shape"])
        dy = upstream(seed, inputs.x)
        entries, results = errors_at(candidates, inputs, dy, p["chunk_rows"])
        data["errors"][str(S)] = entries
        if S == p["attribution_rows"]:
            data["attribution"] = attribution(inputs, {n: r.out for n, r in results.items()})
            if "diffusers" in results:
                rounded = rounded_golden(inputs, ROUNDING_POINTS).to(results["diffusers"].out.dtype)
                data["ulp"]["golden with the six roundings vs diffusers"] = ulp_analysis(
                    rounded, results["diffusers"].out, inputs)
        if S == p["ulp_rows"] and "diffusers" in names:
            for name in names:
                if name != "diffusers":
                    data["ulp"][f"{name} vs diffusers"] = ulp_analysis(results[name].out, results["diffusers"].out,
                                                                       inputs)
        del results
        if S == p["spread_rows"]:
            data["spread"] = spread(candidates, inputs, dy, p["repeats"])
        del inputs, dy
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if bar is not None:
            bar.update()
    data["errors"] = {str(S): data["errors"][str(S)] for S in p["sizes"]}  # ascending, as `sizes`
    return data


def growth(data: dict, keys=("temb", "w", "b")) -> dict:
    """{candidate: {grad key: [rel err at each of data['sizes']]}} from a measure() dict."""
    sizes = [str(S) for S in data["sizes"]]
    return {name: {k: [data["errors"][S][name]["grad_rel_err"][k] for S in sizes] for k in keys}
            for name in data["candidates"]}


SPREAD_NAMES = {"nw": "norm_weight", "temb": "temb", "w": "weight", "b": "bias"}
AGREE = 1e-12  # in units of max|golden|: float64 summation order (chunked or not) moves an error by ~1e-15


def against_report(data: dict, report: dict) -> dict:
    """Every figure a lab file (`measure`) and a report (`python -m adaln_lab report`) both hold, and why
    two of them differ.

    Both measure `harness.inputs.make(1, S)` and `upstream(1, x)` at the report's sizes with the same
    metric (max|err| / max|golden|, `errors_at` equals `harness.accuracy`), so a figure is the same in
    both (within AGREE) unless (checked in this order) the two files come from different commits
    ("commits differ": the kernels may have changed between them) or the candidate's gradient changes
    from run to run (`spread` of the lab file, or the report's params_repeatable: "run to run", atomic
    adds on a GPU). Anything else is "unexplained". Returns {"lab_commit", "report_commit",
    "rows": [{rows, candidate, quantity, lab, report, verdict}]}, verdict "equal" or one of the above.
    """
    lab_commit = str((data.get("meta") or {}).get("adaln_lab_commit") or "unknown")
    report_commit = str(report.get("adaln_lab_commit") or "unknown")
    same_commit = "unknown" not in (lab_commit, report_commit) and (
        lab_commit.startswith(report_commit) or report_commit.startswith(lab_commit))
    spread_ = (data.get("spread") or {}).get("candidates", {})
    rows = []
    for S, by_name in data["errors"].items():
        for name, ours in by_name.items():
            theirs = report["results"]["plain"].get(name, {}).get("accuracy_latency", {}).get(S)
            if theirs is None:
                continue
            repeatable = report["results"]["plain"][name].get("batch_invariance", {}).get(
                "params_repeatable_each", {})
            # (quantity, the parameter whose run-to-run spread can explain it: None for the output and dx)
            pairs = [("fwd", None, ours["fwd_rel_err"], theirs["fwd_rel_err"])]
            pairs += [(f"d{k}", SPREAD_NAMES.get(k), ours["grad_rel_err"][k], theirs["grad_rel_err"][k])
                      for k in GRAD_KEYS.values()]
            for quantity, spread_key, a, b in pairs:
                varies = spread_key is not None and (
                    spread_.get(name, {}).get(spread_key, {}).get("distinct", 1) > 1
                    or repeatable.get(spread_key, True) is False)
                if abs(a - b) <= AGREE:
                    verdict = "equal"
                elif not same_commit:
                    verdict = "commits differ"
                elif varies:
                    verdict = "run to run"
                else:
                    verdict = "unexplained"
                rows.append({"rows": S, "candidate": name, "quantity": quantity, "lab": a, "report": b,
                             "verdict": verdict})
    return {"lab_commit": lab_commit, "report_commit": report_commit, "rows": rows}


__all__ = ["ROUNDING_POINTS", "DECLARED", "LEAVES", "rounded_golden", "golden_by_chunks", "errors_at",
           "attribution", "ulp_analysis", "ulp_bins", "is_zero_output", "cancellation_points", "spread", "plan",
           "measure", "growth", "against_report"]
