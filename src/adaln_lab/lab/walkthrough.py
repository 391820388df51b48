"""The seed's invariance checks one at a time, planted counter-examples, and rows that differ.

A candidate is `fn(x (S, H), norm_weight (H,), temb (T, D), weight (2H, D), bias (2H,),
timestep_indices (S,)) -> (S, H)`, differentiable by autograd (`harness.candidates`).

- `run_check(check, fn, protocol, device)`: one of `CHECKS` with the protocol's sizes, straight
  through to `adaln_lab.harness.invariance`.
- `PLANTED`: wrappers of the diffusers replay, each broken in one way a real kernel breaks
  (no kernels here: each is the replay plus one planted dependence).
- `rows_that_differ`: per row, how far a candidate's output and dx for the row alone are from
  the same row inside a batch (bitwise counts and ulps).
- `candidate_names` / `user_report`: which candidates exist here, and the report of the
  harness run on any list of named callables (yours too), renderable by `harness.render.markdown`.
"""

from __future__ import annotations

import dataclasses

import torch

from ..harness import invariance
from ..harness.accuracy import ulp_distance
from ..harness.calls import forward_backward
from ..harness.inputs import Inputs, make, upstream
from ..harness.protocol import QUICK, Protocol
from ..reference.final_adaln_out import replay

CHECKS = ("all_rows", "full_vs_sub_batches", "batch_size_sweep", "params_repeatable")
NAMES = ("diffusers", "torch_compile", "adaln_lab", "adaln_lab_numba")


def run_check(check: str, fn, protocol: Protocol, device) -> dict:
    """The harness's `check` on `fn` at `protocol`'s sizes (see harness.invariance's docstring).

    params_repeatable returns {parameter: bool} for 3 calls on the first seed's batch of
    accuracy_sizes[0] rows, as `harness.report.batch_invariance` runs it.
    """
    p, device = protocol, torch.device(device)
    if check == "all_rows":
        return invariance.all_rows(fn, p.all_rows_sizes, p.seeds, device, p.shape)
    if check == "full_vs_sub_batches":
        return invariance.full_vs_sub_batches(fn, p.full_batch, p.sub_batch_sizes, p.sub_batch_seeds,
                                              p.small_limit, p.small_step, device, p.shape)
    if check == "batch_size_sweep":
        return invariance.batch_size_sweep(fn, p.sweep_sizes, p.probe_rows, p.pool_size, p.seeds, device, p.shape)
    if check == "params_repeatable":
        batch = make(p.seeds[0], p.accuracy_sizes[0], device, **p.shape)
        return invariance.params_repeatable(fn, batch, upstream(p.seeds[0], batch.x))
    raise ValueError(f"check must be one of {CHECKS}, got {check!r}")


def failures(check: str, result: dict) -> int:
    """How many rows (or parameters) the check found differing: 0 is a pass."""
    if check == "all_rows":
        return sum(r["fwd_differ"] + r["rowgrad_differ"] for r in result.values())
    if check == "full_vs_sub_batches":
        return result["fwd_differ"] + result["rowgrad_differ"]
    if check == "batch_size_sweep":
        return result["differ"]
    return sum(not same for same in result.values())


# --- planted counter-examples: the replay, broken in one way each ----------------------------------

def batch_size_dependent(x, norm_weight, temb, weight, bias, timestep_indices):
    """Every row nudged by a term that depends on how many rows the batch has (a tile size picked
    from the batch size)."""
    return replay(x, norm_weight, temb, weight, bias, timestep_indices) + (x.shape[0] % 5) * 2.0 ** -6 * x


def big_batch_path(x, norm_weight, temb, weight, bias, timestep_indices):
    """A fused float32 path (no bf16 rounding between rms_norm, the product and `+ shift`) once the
    batch has more than 128 rows, as a kernel that switches strategy with the batch size: rows of
    the quick protocol's small batches (all_rows: 8 and 17 rows; the sweep's pool: 64) never see it."""
    if x.shape[0] <= 128:
        return replay(x, norm_weight, temb, weight, bias, timestep_indices)
    table = torch.nn.functional.linear(torch.nn.functional.silu(temb).to(weight.dtype), weight, bias)
    shift, scale = table.float().chunk(2, dim=-1)
    hidden = torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), norm_weight.float(), 1e-5)
    out = hidden * (1.0 + scale.index_select(0, timestep_indices)) + shift.index_select(0, timestep_indices)
    return out.to(x.dtype)


_CALLS = [0]  # the "weight" plant's backward calls so far: its noise differs from each call to the next


class _PlantedBackward(torch.autograd.Function):
    """Forward: the replay, untouched. Backward: torch's gradients, then one of them perturbed:
    `how` = "dx" scales dx by a factor of the batch size; "weight" scales d_weight by 1 + 2^-6 or 1 + 2^-5 on
    alternate calls, as call-to-call noise: factors a bf16 d_weight keeps apart (a random factor near 1 rounds to
    the same bf16 factor in a quarter of three-call runs, and the plant would go unseen)."""

    @staticmethod
    def forward(ctx, how, x, norm_weight, temb, weight, bias, timestep_indices):
        ctx.how = how
        ctx.save_for_backward(x, norm_weight, temb, weight, bias, timestep_indices)
        return replay(x, norm_weight, temb, weight, bias, timestep_indices)

    @staticmethod
    def backward(ctx, dy):
        x, norm_weight, temb, weight, bias, idx = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(True) for t in (x, norm_weight, temb, weight, bias)]
            dx, dnw, dtemb, dw, db = torch.autograd.grad(replay(*leaves, idx), leaves, dy)
        if ctx.how == "dx":
            dx = dx * (1 + (x.shape[0] % 3) * 2.0 ** -7)
        else:
            _CALLS[0] += 1
            dw = dw * (1 + 2.0 ** -(5 + _CALLS[0] % 2))
        return None, dx, dnw, dtemb, dw, db, None


def dx_batch_dependent(x, norm_weight, temb, weight, bias, timestep_indices):
    """Forward invariant, dx not: what torch.compile's backward does (its dx depends on the batch)."""
    return _PlantedBackward.apply("dx", x, norm_weight, temb, weight, bias, timestep_indices)


def non_repeatable(x, norm_weight, temb, weight, bias, timestep_indices):
    """Every row and its dx invariant, but d_weight perturbed from call to call, as unordered atomics
    (diffusers' bf16 scatter-add on a GPU) perturb it: only the repeatability check sees it."""
    return _PlantedBackward.apply("weight", x, norm_weight, temb, weight, bias, timestep_indices)


PLANTED = {"batch_size_dependent": batch_size_dependent, "big_batch_path": big_batch_path,
           "dx_batch_dependent": dx_batch_dependent, "non_repeatable": non_repeatable}


def planted_table(protocol: Protocol = QUICK, device="cpu") -> dict:
    """{planted name: {check: failures}} for every planted counter-example and check."""
    return {name: {check: failures(check, run_check(check, fn, protocol, device)) for check in CHECKS}
            for name, fn in PLANTED.items()}


# --- rows that differ ------------------------------------------------------------------------------

def rows_that_differ(fn, inputs: Inputs, dy: torch.Tensor, rows) -> list[dict]:
    """For each row r in `rows`: the candidate on row r alone against row r of the whole batch.

    Per row: `fwd_differ` / `dx_differ` (elements of the (H,) row not bitwise equal), `dx_max_ulp`
    (largest distance in bf16 ulps), `dx_max_rel` (max|alone - batch| / max|batch row|) and
    `dx_columns` (the first 8 columns that differ).
    """
    full = forward_backward(fn, inputs, dy)
    out = []
    for r in rows:
        alone = forward_backward(fn, inputs.rows(torch.tensor([r])), dy[r:r + 1])
        a, b = alone.grads["x"][0], full.grads["x"][r]
        differ = a.view(torch.int16) != b.view(torch.int16) if a.element_size() == 2 else a != b
        ulps = ulp_distance(a, b) if a.element_size() == 2 else None
        scale = float(b.abs().max().double()) or 1.0
        out.append({"row": int(r), "fwd_differ": int((alone.out[0] != full.out[r]).sum()),
                    "dx_differ": int(differ.sum()), "dx_max_ulp": int(ulps.max()) if ulps is not None else None,
                    "dx_max_rel": float((a.double() - b.double()).abs().max()) / scale,
                    "dx_columns": torch.nonzero(differ).flatten()[:8].tolist()})
    return out


# --- candidates, and the report on your own ones --------------------------------------------------

def candidate_names(device) -> tuple[list[str], dict]:
    """(names among NAMES that `harness.candidates.resolve` builds on `device`, {name: why not})."""
    from ..harness import candidates

    ok, skipped = [], {}
    for name in NAMES:
        if name not in candidates.BUILTIN:
            skipped[name] = "not in adaln_lab.harness.candidates.BUILTIN (not written yet)"
            continue
        try:
            candidates.resolve([name], torch.device(device))
        except Exception as error:  # noqa: BLE001 - a candidate that cannot run here is skipped, with why
            skipped[name] = f"{type(error).__name__}: {error}"[:300]
            continue
        ok.append(name)
    return ok, skipped


def candidates_here(device, names=NAMES) -> tuple[list, dict]:
    """([harness Named] of `names` that run on `device`, {name: why skipped}) (see candidate_names)."""
    from ..harness.candidates import resolve

    ok, skipped = candidate_names(device)
    built = resolve([n for n in ok if n in names], torch.device(device))
    return built, {n: why for n, why in skipped.items() if n in names}


def user_report(named, device="cpu", quick: bool = True, protocol: Protocol | None = None) -> dict:
    """The report of `python -m adaln_lab report` for any list of `harness.candidates.Named`.

    The same steps as `harness.report.run_report` (invariance, accuracy and eager / host timings,
    autograd floor, CUDA-graph timings last) without looking names up, so a callable of yours runs
    through all of it: `Named("mine", "what it runs", my_fn)`. Render with `harness.render.markdown`.
    """
    from ..harness import report as rep
    from ..harness.latency import autograd_floor, copy_bandwidth, memory_floor
    from ..harness.protocol import FULL

    device = torch.device(device)
    p = protocol or (QUICK if quick else FULL)
    copy = copy_bandwidth(device, p.copy_bytes)
    floors = {str(S): memory_floor(S, p.H, p.D, p.T, copy) for S in p.accuracy_sizes}
    out = {"kind": "adaln_lab_report", "op": "final_adaln_out", **rep.provenance(),
           "environment": rep.environment(device), "quick": quick,
           "protocol": dataclasses.asdict(p) | {"sweep_sizes": p.sweep_sizes}, "copy_TBps": copy,
           "memory_floor": floors, "schema_notes": rep.SCHEMA_NOTES, "results": {"plain": {}}}
    for c in named:
        out["results"]["plain"][c.name] = {"source": c.source, "has_backward": True,
                                           "batch_invariance": rep.batch_invariance(c.fn, p, device),
                                           "accuracy_latency": rep.accuracy_latency(c, p, device, floors)}
    out.update(autograd_floor(make(p.accuracy_seed, p.accuracy_sizes[0], device, **p.shape), p.warmup, p.iters))
    rep.graph_timings(named, p, device, {n: e["accuracy_latency"] for n, e in out["results"]["plain"].items()})
    return out


def measure(candidates, device, quick: bool = False, bar=None) -> dict:
    """lab_invariance.json: each candidate through the four checks at the quick protocol's sizes
    (the real H, D on a GPU; a candidate that raises is recorded with its error), the planted
    table (CPU), and for torch_compile, diffusers and adaln_lab every 16th row of a 257-row batch
    alone against the batch (`rows_that_differ`)."""
    device = torch.device(device)
    p = QUICK if quick or device.type != "cuda" else dataclasses.replace(QUICK, H=5376, D=2688)
    data = {"kind": "adaln_lab_lab_invariance", "protocol": dataclasses.asdict(p),
            "candidates": {c.name: c.source for c in candidates}, "checks": {}, "planted": None, "rows_differ": {}}
    for c in candidates:
        try:
            data["checks"][c.name] = {check: run_check(check, c.fn, p, device) for check in CHECKS}
        except Exception as error:  # noqa: BLE001 - e.g. a candidate still being written: recorded
            data["checks"][c.name] = {"error": f"{type(error).__name__}: {error}"[:400]}
        if bar is not None:
            bar.update()
    data["planted"] = planted_table(QUICK, "cpu")
    inputs = make(3, 257, device, **p.shape)
    dy = upstream(3, inputs.x)
    for c in candidates:
        if c.name in ("torch_compile", "diffusers", "adaln_lab"):
            data["rows_differ"][c.name] = rows_that_differ(c.fn, inputs, dy, range(0, 257, 16))
    if bar is not None:
        bar.update()
    return data
