"""Bitwise batch invariance of any candidate, the seed report's three checks plus repeatability.

- `all_rows`: every row alone versus inside full batches (sizes x seeds).
- `full_vs_sub_batches`: one big batch versus contiguous sub-batches covering it; sub-batches of
  fewer than `small_limit` rows start every `small_step` rows.
- `batch_size_sweep`: probe rows placed first, middle and last inside batches of many sizes filled
  with other rows, plus the whole pool reversed.
- `params_repeatable`: the same call twice gives the same bits for every parameter gradient.

A row "differs" when its forward output (or its dx) is not bitwise equal to the reference row.
"""

from __future__ import annotations

import torch
from tqdm import tqdm

from .calls import forward_backward
from .inputs import Inputs, make, upstream

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


def _progress(total: int, desc: str):
    return tqdm(total=total, desc=desc, unit="call", leave=False, dynamic_ncols=True)


def all_rows(fn, sizes, seeds, device, shape) -> dict:
    out = {}
    for n in sizes:
        fwd_differ = rowgrad_differ = 0
        with _progress(n * len(seeds), f"all_rows n={n}") as bar:
            for seed in seeds:
                batch = make(seed, n, device, **shape)
                dy = upstream(seed, batch.x)
                full = forward_backward(fn, batch, dy)
                for r in range(n):
                    index = torch.tensor([r])
                    alone = forward_backward(fn, batch.rows(index), dy[r:r + 1])
                    fwd_differ += int(_rows_differ(alone.out, full.out[r:r + 1]).item())
                    rowgrad_differ += int(_rows_differ(alone.grads["x"], full.grads["x"][r:r + 1]).item())
                    bar.update()
        out[str(n)] = {"rows": n * len(seeds), "fwd_differ": fwd_differ, "rowgrad_differ": rowgrad_differ}
    return out


def sub_batch_starts(full_batch: int, size: int, small_limit: int, small_step: int) -> range:
    """Where the sub-batches of `size` rows start: tiling the batch, or every `small_step` rows."""
    return range(0, full_batch, size if size >= small_limit else small_step)


def full_vs_sub_batches(fn, full_batch, sizes, seeds, small_limit, small_step, device, shape) -> dict:
    count = fwd_differ = rowgrad_differ = 0
    total = len(seeds) * sum(len(sub_batch_starts(full_batch, s, small_limit, small_step)) for s in sizes)
    with _progress(total, f"full_vs_sub_batches N={full_batch}") as bar:
        for seed in seeds:
            batch = make(seed, full_batch, device, **shape)
            dy = upstream(seed, batch.x)
            full = forward_backward(fn, batch, dy)
            for size in sizes:
                for start in sub_batch_starts(full_batch, size, small_limit, small_step):
                    stop = min(start + size, full_batch)
                    index = torch.arange(start, stop)
                    sub = forward_backward(fn, batch.rows(index), dy[start:stop])
                    fwd_differ += int(_rows_differ(sub.out, full.out[start:stop]).sum())
                    rowgrad_differ += int(_rows_differ(sub.grads["x"], full.grads["x"][start:stop]).sum())
                    count += 1
                    bar.update()
            del full, batch, dy
    return {"full_batch": full_batch, "sub_batch_sizes": list(sizes), "sub_batches": count,
            "fwd_differ": fwd_differ, "rowgrad_differ": rowgrad_differ}


def sweep_positions(b: int) -> list[int]:
    """First, middle and last position in a batch of b rows, without repeats."""
    return sorted({0, b // 2, b - 1})


def batch_size_sweep(fn, batch_sizes, probe_rows, pool_size, seeds, device, shape) -> dict:
    comparisons = differ = 0
    failures: list[dict] = []
    per_seed = sum(len(sweep_positions(b)) for b in batch_sizes) * len(probe_rows) + len(probe_rows)

    def compare(result, positions, reference, probes, seed, b, where):
        nonlocal comparisons, differ
        bad = _rows_differ(result.out[positions], reference.out[probes]) | \
            _rows_differ(result.grads["x"][positions], reference.grads["x"][probes])
        comparisons += len(probes)
        differ += int(bad.sum())
        for k in torch.nonzero(bad).flatten().tolist():
            if len(failures) < MAX_FAILURES:
                failures.append({"seed": seed, "batch_size": b, "probe_row": int(probes[k]), "position": where})

    with _progress(per_seed * len(seeds), "batch_size_sweep") as bar:
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
    return {"batch_sizes": list(batch_sizes), "probe_rows": list(probe_rows), "comparisons": comparisons,
            "differ": differ, "first_failures": failures}


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


def batch_invariant(report: dict) -> bool:
    """The seed's verdict: no differing row anywhere and repeatable parameter gradients."""
    rows = report["all_rows"].values()
    return (report["params_repeatable"]
            and all(r["fwd_differ"] == 0 and r["rowgrad_differ"] == 0 for r in rows)
            and report["full_vs_sub_batches"]["fwd_differ"] == 0
            and report["full_vs_sub_batches"]["rowgrad_differ"] == 0
            and report["batch_size_sweep"]["differ"] == 0)
