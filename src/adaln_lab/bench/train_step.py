"""One training step of a full-width MiniMax-H3 transformer, patched against diffusers, on a GPU.

The model: diffusers' MiniMaxH3Transformer3DModel at full width (H 5376, 56 x 128 heads, FFN 14336, D 2688) with
2 blocks and 1 refiner block, 4097 packed rows (512 text, 3072 video, 513 audio; batch 1; three timesteps).
Two precisions, one model each (the variants share its weights: patched by `adaln_lab.patch`, put back by
`adaln_lab.unpatch`):
- `bf16`: the checkpoint's layout (bf16, `_keep_in_fp32_modules` in float32);
- `autocast`: fp32 master weights, every step under `torch.autocast("cuda", torch.bfloat16)` (what accelerate's
  `mixed_precision="bf16"` does).
Variants: `diffusers`, `diffusers_deterministic` (`torch.use_deterministic_algorithms(True)`, CUBLAS_WORKSPACE_CONFIG
set), `adaln_lab` (patched), `adaln_lab_deterministic` (patched, and deterministic algorithms for the rest of the
model: attention's backward among them) and `adaln_lab_exact` (patched, each step inside `adaln_lab.nn.ExactGradients`
and its write: the AdaLN gradients exact; `exact_over_plain` its step time over `adaln_lab`'s); with `--row-form K`
also `adaln_lab_exact_form<K>`, the exact step with TUNING's EXACT_ROW_DOUBLE K (0: int64 windows, 1: float64 windows;
`exact_form<K>_over_plain`), and with `--no-wait` `adaln_lab_exact_no_wait`, the exact step with
`core.transfers.NO_WAIT` 1 (`exact_no_wait_over_plain`). A step is forward, backward of a fixed random upstream,
`zero_grad(set_to_none=True)` after it. Per variant: the median step time of 10 timed steps after 3 warm-ups (CUDA
events, the default SDPA backend) and its phases' medians (`phases`: forward, backward, write from the backward's end,
write's host time), every AdaLNFallbackWarning / KernelFallbackWarning the variant raised, and whether its AdaLN
gradients (norm_out's and each block's norm1, norm2, adaln_proj) repeat bit for bit over two steps, under the default
SDPA backend and under SDPA's math backend (the flash backward accumulates dq with atomics, so every gradient upstream
of an attention varies there whatever the AdaLN does); the patched forward is checked against diffusers' first (max
|diff| over the two outputs, beside diffusers' own distance from the float32 model for scale).

    python3 -m adaln_lab.bench.train_step [--steps 10] [--row-form 0] [--no-wait] > train_step.json   (table: stderr)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts: deterministic cuBLAS

import torch  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import adaln_lab  # noqa: E402
from adaln_lab.core import launchers, transfers  # noqa: E402
from adaln_lab.nn import AdaLNFallbackWarning  # noqa: E402
from adaln_lab.ops import KernelFallbackWarning  # noqa: E402
from adaln_lab.testing import checkpoint_layout, h3_inputs  # noqa: E402

CONFIG = dict(num_layers=2, num_refiner_layers=1)
ROWS = dict(text=512, video=3072, audio=513)
VARIANTS = ("diffusers", "diffusers_deterministic", "adaln_lab", "adaln_lab_deterministic", "adaln_lab_exact")


def build(precision: str):
    from diffusers import MiniMaxH3Transformer3DModel

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = MiniMaxH3Transformer3DModel(**CONFIG)
    if precision == "bf16":
        checkpoint_layout(model)
    return model.train()


def make_inputs(model, seed=1):
    inputs, dys = h3_inputs(model, (ROWS["text"], ROWS["video"], ROWS["audio"]), seed, upstream=True)
    return {k: v.cuda() for k, v in inputs.items()}, tuple(d.cuda() for d in dys)


def adaln_keys(model):
    return [name for name, _ in model.named_parameters()
            if name.startswith("norm_out.") or (name.startswith("transformer_blocks.")
                                                and any(k in name for k in (".norm1.", ".norm2.", ".adaln_proj.")))]


def step(model, inputs, dys, autocast: bool, exact: bool = False, marks=None):
    """Forward and backward of the fixed upstream; `exact`: inside an ExactGradients, then its write. `marks`: a
    list that gets a CUDA event after the forward, one after the backward and the host seconds write took."""
    from adaln_lab.nn import ExactGradients

    acc = ExactGradients()
    with acc if exact else torch.enable_grad():
        with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
            out = model(**inputs)
        _mark(marks)
        torch.autograd.backward([out.sample, out.audio_sample], [d.to(out.sample.dtype) for d in dys])
    _mark(marks)
    host = time.perf_counter()
    if exact:
        acc.write()
    if marks is not None:
        marks.append(time.perf_counter() - host)
    return out


def _mark(marks) -> None:
    if marks is not None:
        marks.append(torch.cuda.Event(enable_timing=True))
        marks[-1].record()


def adaln_grads(model, inputs, dys, autocast, exact=False):
    model.zero_grad(set_to_none=True)
    step(model, inputs, dys, autocast, exact)
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if k in set(adaln_keys(model))}
    model.zero_grad(set_to_none=True)
    return grads


def repeats(model, inputs, dys, autocast, backend=None, exact=False):
    """The AdaLN parameters whose gradients differ between two identical steps."""
    if backend is None:
        first, second = (adaln_grads(model, inputs, dys, autocast, exact) for _ in range(2))
    else:
        with sdpa_kernel(backend):
            first, second = (adaln_grads(model, inputs, dys, autocast, exact) for _ in range(2))
    return sorted(k for k in first if not torch.equal(first[k], second[k]))


def time_steps(model, inputs, dys, autocast, steps, warmup=3, exact=False):
    """The median step time (ms), and the medians of its phases: forward, backward, write (the events' GPU
    stream time from the backward's end to the step's end) and write's host time (its call's return, ms)."""
    times, phases = [], []
    for i in range(warmup + steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        marks = []
        start.record()
        step(model, inputs, dys, autocast, exact, marks)
        model.zero_grad(set_to_none=True)
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
            forward, backward, host = marks
            phases.append((start.elapsed_time(forward), forward.elapsed_time(backward), backward.elapsed_time(end),
                           1e3 * host))
    medians = [round(statistics.median(p), 3) for p in zip(*phases)]
    return statistics.median(times), dict(zip(("forward_ms", "backward_ms", "write_ms", "write_host_ms"), medians))


def run_variant(model, inputs, dys, autocast, variant, steps):
    if variant == "adaln_lab_exact_no_wait":
        saved, transfers.NO_WAIT = transfers.NO_WAIT, 1
        try:
            return run_variant(model, inputs, dys, autocast, "adaln_lab_exact", steps)
        finally:
            transfers.NO_WAIT = saved
    if variant.startswith("adaln_lab_exact_form"):
        with launchers.tuned(EXACT_ROW_DOUBLE=int(variant[len("adaln_lab_exact_form"):])):
            return run_variant(model, inputs, dys, autocast, "adaln_lab_exact", steps)
    deterministic, exact = variant.endswith("_deterministic"), variant.endswith("_exact")
    if variant.startswith("adaln_lab"):
        adaln_lab.patch(model)
    torch.use_deterministic_algorithms(deterministic)
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with torch.no_grad(), torch.autocast("cuda", torch.bfloat16, enabled=autocast):
                out = model(**inputs)
            ms, phases = time_steps(model, inputs, dys, autocast, steps, exact=exact)
            differ_default = repeats(model, inputs, dys, autocast, exact=exact)
            differ_math = repeats(model, inputs, dys, autocast, SDPBackend.MATH, exact)
        fallbacks = sorted({str(w.message)[:160] for w in seen
                            if issubclass(w.category, (AdaLNFallbackWarning, KernelFallbackWarning))})
    finally:
        torch.use_deterministic_algorithms(False)
        adaln_lab.unpatch(model)
    return dict(step_ms=round(ms, 3), phases=phases, fallback_warnings=fallbacks,
                adaln_grads_differ_default_sdpa=differ_default, adaln_grads_differ_math_sdpa=differ_math,
                adaln_params=len(adaln_keys(model))), (out.sample.float(), out.audio_sample.float())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--row-form", type=int, choices=(0, 1), default=None,
                        help="also the exact step with TUNING's EXACT_ROW_DOUBLE set to this (adaln_lab_exact_form<K>)")
    parser.add_argument("--no-wait", action="store_true",
                        help="also the exact step with core.transfers.NO_WAIT 1 (adaln_lab_exact_no_wait)")
    args = parser.parse_args()
    extra = None if args.row_form is None else f"adaln_lab_exact_form{args.row_form}"
    variants = VARIANTS + ((extra,) if extra else ()) + (("adaln_lab_exact_no_wait",) if args.no_wait else ())
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "config": CONFIG, "rows": ROWS,
               "precisions": {}}
    wide = None
    for precision in ("autocast", "bf16"):
        model = build(precision)
        inputs, dys = make_inputs(model)
        if precision == "autocast":  # the fp32 model without autocast: the scale of bf16 noise
            with torch.no_grad():
                out = model(**inputs)
            wide = (out.sample.float(), out.audio_sample.float())
        entry = {}
        outs = {}
        for variant in variants:
            entry[variant], outs[variant] = run_variant(model, inputs, dys, precision == "autocast", variant,
                                                        args.steps)
            print(f"{precision:8s} {variant:24s} {entry[variant]['step_ms']:8.2f} ms  fallbacks "
                  f"{len(entry[variant]['fallback_warnings'])}  AdaLN grads differing (default / math SDPA): "
                  f"{len(entry[variant]['adaln_grads_differ_default_sdpa'])} / "
                  f"{len(entry[variant]['adaln_grads_differ_math_sdpa'])} of {entry[variant]['adaln_params']}; "
                  + ", ".join(f"{k} {v:.2f}" for k, v in entry[variant]["phases"].items()),
                  file=sys.stderr, flush=True)
        entry["patched_vs_diffusers_max_abs"] = max((a - b).abs().max().item()
                                                    for a, b in zip(outs["adaln_lab"], outs["diffusers"]))
        entry["diffusers_vs_fp32_model_max_abs"] = max((a - b).abs().max().item()
                                                       for a, b in zip(outs["diffusers"], wide))
        entry["speedup_vs_diffusers"] = round(entry["diffusers"]["step_ms"] / entry["adaln_lab"]["step_ms"], 3)
        entry["speedup_vs_deterministic"] = round(
            entry["diffusers_deterministic"]["step_ms"] / entry["adaln_lab"]["step_ms"], 3)
        entry["deterministic_speedup"] = round(
            entry["diffusers_deterministic"]["step_ms"] / entry["adaln_lab_deterministic"]["step_ms"], 3)
        entry["exact_over_plain"] = round(entry["adaln_lab_exact"]["step_ms"] / entry["adaln_lab"]["step_ms"], 3)
        if args.no_wait:
            entry["exact_no_wait_over_plain"] = round(
                entry["adaln_lab_exact_no_wait"]["step_ms"] / entry["adaln_lab"]["step_ms"], 3)
        if extra:
            entry[f"exact_form{args.row_form}_over_plain"] = round(
                entry[extra]["step_ms"] / entry["adaln_lab"]["step_ms"], 3)
        results["precisions"][precision] = entry
        print(f"{precision}: adaln_lab {entry['speedup_vs_diffusers']}x diffusers, "
              f"{entry['speedup_vs_deterministic']}x deterministic diffusers, deterministic "
              f"{entry['deterministic_speedup']}x deterministic diffusers, exact {entry['exact_over_plain']}x plain"
              + (f" (EXACT_ROW_DOUBLE {args.row_form}: {entry[f'exact_form{args.row_form}_over_plain']}x)"
                 if extra else "")
              + (f" (no wait: {entry['exact_no_wait_over_plain']}x)" if args.no_wait else "") + "; "
              f"forward max |patched - diffusers| "
              f"{entry['patched_vs_diffusers_max_abs']:.3g} (diffusers vs the fp32 model: "
              f"{entry['diffusers_vs_fp32_model_max_abs']:.3g})", file=sys.stderr, flush=True)
        del model, inputs, dys, outs
        torch.cuda.empty_cache()
    json.dump(results, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
