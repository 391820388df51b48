"""Bf16 ulp distances between two outputs of the lab (`adaln_lab.lab.errors.measure`'s `ulp` entries).

- `ulp_analysis`: distances in bf16 ulps between two outputs, their histogram and where the
  largest sit (`p + shift` cancelling: a 1-ulp difference of an operand is many ulps of the sum).
- `cancellation_points` / `is_zero_output`: the distance-against-cancellation points of a lab file,
  whichever layout wrote it.
"""

from __future__ import annotations

import math

import torch

from ..harness.accuracy import ulp_distance
from ..harness.inputs import Inputs
from ..reference.final_adaln_out import table_reference

ULP_EDGES = [0, 1, 2, 3] + [2 ** k + 1 for k in range(2, 17)]  # bins [0], [1], [2], [3, 4], [5, 8], ...
CANCELLATION_EDGES = [1, 2, 4, 16, 256, math.inf]


def ulp_bins() -> list[str]:
    labels = []
    for lo, hi in zip(ULP_EDGES, ULP_EDGES[1:] + [None]):
        labels.append(f">={lo}" if hi is None else (str(lo) if hi == lo + 1 else f"{lo}-{hi - 1}"))
    return labels


def ulp_analysis(a: torch.Tensor, b: torch.Tensor, inputs: Inputs, top: int = 10, sample: int = 2000) -> dict:
    """Bf16 ulp distances between outputs a and b ((S, H), one 16-bit dtype) and where they sit.

    `histogram`: counts per `ulp_bins()` bin. The cancellation of an element is
    max(|p|, |shift|) / |out| with out = b, shift the row's shift (diffusers' bf16 table) and
    p = out - shift: how many times larger the final add's operands are than its result (a 1-ulp
    change of an operand is about that many ulps of the result). Where out == 0 the operands
    cancel completely and the ratio has no value: those elements are counted apart in
    `zero_output` (elements, differ, max_ulp), not in `by_cancellation`, and their cancellation
    is None in `largest`. `by_cancellation`: per cancellation bin (out != 0), the elements, those
    that differ and their largest distance. `largest`: the `top` largest distances with row,
    column, values and cancellation. `sample`: up to `sample` differing elements drawn at random
    plus the `top` largest, as `cancellation` / `ulps` (out != 0) and `zero_output_ulps` (out == 0),
    for a scatter plot that always shows the largest distances.
    """
    ulps = ulp_distance(a, b).flatten()
    counts = torch.bucketize(ulps, torch.tensor(ULP_EDGES[1:], device=ulps.device), right=True).bincount(
        minlength=len(ULP_EDGES))
    with torch.no_grad():
        shift = table_reference(inputs.temb, inputs.weight, inputs.bias).chunk(2, dim=-1)[0]
        shift = shift.index_select(0, inputs.timestep_indices).to(torch.float64).flatten()
    ref = b.to(torch.float64).flatten()
    product = ref - shift
    zero = ref == 0
    cancellation = torch.maximum(product.abs(), shift.abs()) / torch.where(zero, torch.ones_like(ref), ref.abs())
    cancellation = cancellation.masked_fill(zero, math.inf)  # out == 0: no ratio; never written out as a number
    differ = ulps > 0

    def count(inside):
        both = inside & differ
        return {"elements": int(inside.sum()), "differ": int(both.sum()),
                "max_ulp": int(ulps[both].max()) if bool(both.any()) else 0}

    by_cancellation = []
    for lo, hi in zip(CANCELLATION_EDGES, CANCELLATION_EDGES[1:]):
        inside = ~zero & ((cancellation >= lo) & (cancellation < hi) if lo > 1 else cancellation < hi)
        by_cancellation.append({"from": lo, "to": None if math.isinf(hi) else hi, **count(inside)})
    k = min(top, ulps.numel())
    values, where = ulps.topk(k) if k else (ulps[:0], ulps[:0])
    H = a.shape[-1]

    def ratio(i):
        return None if bool(zero[i]) else float(cancellation[i])

    largest = [{"row": int(i) // H, "col": int(i) % H, "ulps": int(u), "a": float(a.flatten()[i]),
                "b": float(ref[i]), "shift": float(shift[i]), "product": float(product[i]),
                "cancellation": ratio(i)} for u, i in zip(values.tolist(), where.tolist()) if u > 0]
    index = torch.nonzero(differ).flatten()
    if index.numel() > sample:
        pick = torch.randperm(index.numel(), generator=torch.Generator().manual_seed(0))[:sample]
        index = index[pick.to(index.device)]
    index = torch.cat([index, where[values > 0]]).unique()
    finite = index[~zero[index]]
    return {"rows": a.shape[0], "elements": ulps.numel(), "bins": ulp_bins(), "histogram": counts.tolist(),
            "bitwise_equal_fraction": float((~differ).double().mean()),
            "max_ulp": int(ulps.max()) if ulps.numel() else 0,
            "by_cancellation": by_cancellation, "zero_output": count(zero), "largest": largest,
            "sample": {"cancellation": cancellation[finite].tolist(), "ulps": ulps[finite].tolist(),
                       "zero_output_ulps": ulps[index[zero[index]]].tolist()}}


LEGACY_ZERO_OUTPUT = 1e300  # lab files written before `zero_output`: out == 0 gave max(|p|, |shift|) / 2.2e-308


def is_zero_output(cancellation) -> bool:
    """Whether a cancellation of a lab file stands for out == 0: None, or (files written before
    `zero_output` existed, where the ratio divided by float64's tiny) a value above 1e300; any
    nonzero bf16 output gives a ratio below 1e42."""
    return cancellation is None or cancellation > LEGACY_ZERO_OUTPUT


def cancellation_points(u: dict) -> dict:
    """The points of one `ulp_analysis` for the distance-against-cancellation scatter.

    {"cancellation": [...], "ulps": [...]} for out != 0 and {"zero_output_ulps": [...]} for
    out == 0, from `sample` and `largest` together (so the largest distances are drawn even from
    files whose sample missed them), reading files of either layout (see `is_zero_output`).
    """
    s = u["sample"]
    pairs = list(zip(s["cancellation"], s["ulps"])) + [(d["cancellation"], d["ulps"]) for d in u["largest"]]
    zero = list(s.get("zero_output_ulps", [])) + [n for c, n in pairs if is_zero_output(c)]
    finite = [(c, n) for c, n in pairs if not is_zero_output(c)]
    return {"cancellation": [c for c, _ in finite], "ulps": [n for _, n in finite], "zero_output_ulps": zero}


__all__ = ["ulp_bins", "ulp_analysis", "is_zero_output", "cancellation_points"]
