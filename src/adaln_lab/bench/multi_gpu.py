"""FSDP2 over W ranks and diffusers' context parallelism (ulysses W, ring W) on the patched MiniMax-H3 model,
each against the same model unsharded on one device; one process per rank, one host.

    python3 -m adaln_lab.bench.multi_gpu --device cuda --world 2 --out multi_gpu.json        (W GPUs, NCCL)
    python3 -m adaln_lab.bench.multi_gpu --device cpu --world 2 --out multi_gpu_cpu.json     (the CPU emulation, gloo)

Every rank builds the same seeded model and inputs: on cuda diffusers' MiniMaxH3Transformer3DModel at full width
(H 5376, 56 x 128 heads) with 2 blocks and 1 refiner block; on cpu a tiny one (H 32, 2 heads). The checks run under
`torch.use_deterministic_algorithms(True)` (attention's backward otherwise accumulates dq with atomics, which varies
every gradient upstream of it whatever the sharding does); the timings under the defaults. Runs:

- `fsdp`: `adaln_lab.nn.fsdp2_shard` (fp32 master weights, bf16 compute, fp32 reduce-scatter), rank r on
  micro-batch r (its own seeded inputs of batch 1). Checks: the forward equals, bit for bit, the unsharded model's
  in the checkpoint's layout (bf16 weights = bf16(master)) on the same micro-batch; every AdaLN gradient equals the
  fp32 mean of the unsharded model's micro-batch gradients, bit for bit for W <= 2 (W = 2: a sum of two values
  rounds once whichever rank adds, and halving is exact), else the exact mean within (W + 1) fp32 roundings of
  the mean of magnitudes (W - 1 additions, the scaling by 1 / W, slack of one); both repeat bit for bit. Figures:
  median ms of a bare train step (no gradient gathered; deterministic algorithms off), patched and diffusers
  under the same FSDP2.
- `ulysses`, `ring`: the model in the checkpoint's layout, `set_attention_backend(backend)`, then
  `enable_parallelism(config=ContextParallelConfig(ulysses_degree=W | ring_degree=W))`: the plan splits the packed
  rows, `adaln_indices` and `timestep_indices` (S must divide by W). norm_out is wrapped inside the plan's split,
  so the run records each rank's rows, indices, output, upstream and dx there. Checks (patched): those rows get the
  output and dx bits the unsharded op gives them (the ranks' rows gathered, one call), and the rank's norm_out
  parameter gradients equal the op's on its rows alone; the AdaLN gradients summed over the ranks repeat bit for
  bit; where diffusers' output under the plan is bitwise its unsharded one, the patched output is too. Figures,
  patched beside diffusers: max |output - the model's unsharded output|, and per AdaLN parameter the
  max |gradient summed over the ranks - the unsharded gradient| relative to the unsharded gradient's max.
  Ring needs an attention backend that returns the log-sum-exp (diffusers' `_native_flash` or `_native_cudnn`);
  on a CPU there is none, so `ring` is skipped there, with the reason in the output.
- `exact`: ExactGradients under FSDP2 on every world size dividing W, one global batch of W samples
  (`adaln_lab.bench.multi_gpu_exact`): the AdaLN gradients the same bits for every size, a planted fp32
  reduce-scatter caught; figures: the exact and the plain step, the all-reduce's bytes and time.
- `planted`: `ulysses` with a planted counter-example, a norm_out whose rows also read the mean of their shard's
  rows; its checks: the unsharded row check catches it, while the rank-rows-alone check and the repeat still hold
  (so the catch is the leak's, not a broken recording).

The JSON (--out, and a summary on stderr): device, world, config, rows, per run its checks (name: true / false)
and figures, and `checks_failed`; the exit status is 1 when any check failed.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import socket
import statistics
import sys
import time
import warnings

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts: deterministic cuBLAS

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import adaln_lab  # noqa: E402
from adaln_lab.bench.multi_gpu_exact import run_exact  # noqa: E402
from adaln_lab.nn import AdaLNFallbackWarning, fsdp2_shard  # noqa: E402
from adaln_lab.ops import KernelFallbackWarning  # noqa: E402
from adaln_lab.testing import TINY_H3 as TINY, h3_inputs, h3_model  # noqa: E402

FULL = dict(num_layers=2, num_refiner_layers=1)  # full width: diffusers' default config, 2 blocks
ROWS = {"tiny": dict(fsdp=dict(text=5, video=8, audio=4), cp=dict(text=8, video=16, audio=8)),
        "full": dict(fsdp=dict(text=512, video=3072, audio=513), cp=dict(text=512, video=3072, audio=512))}
CP_BACKENDS = {"cuda": {"ulysses": "native", "ring": "_native_flash"}, "cpu": {"ulysses": "native", "ring": None}}
RUNS = ("fsdp", "ulysses", "ring", "planted", "exact")
NORM_OUT_PARAMS = ("norm_out.linear.weight", "norm_out.linear.bias", "norm_out.norm.weight")


def build(config: dict, device: str, layout: str):
    """The seeded model (`adaln_lab.testing.h3_model`): layout "fp32" (master weights) or "checkpoint" (bf16 but
    `_keep_in_fp32_modules`)."""
    model = h3_model(config, 0)
    if layout == "checkpoint":
        for name, module in model.named_modules():
            if not (name and any(key in name for key in model._keep_in_fp32_modules)):
                for p in module.parameters(recurse=False):
                    p.data = p.data.to(torch.bfloat16)
    return model.to(device).train()


def make_inputs(model, rows: dict, seed: int, device: str, batch: int = 1):
    """One packed layout of text, video and audio rows (`adaln_lab.testing.h3_inputs`) and the upstreams."""
    inputs, dys = h3_inputs(model, (rows["text"], rows["video"], rows["audio"]), seed, batch=batch, upstream=True)
    return {k: v.to(device) for k, v in inputs.items()}, tuple(d.to(device) for d in dys)


def adaln_keys(model):
    return [name for name, _ in model.named_parameters()
            if name.startswith("norm_out.") or (name.startswith("transformer_blocks.")
                                                and any(k in name for k in (".norm1.", ".norm2.", ".adaln_proj.")))]


def step(model, inputs, dys):
    """Forward and backward; the outputs and the AdaLN gradients (full tensors, fp32 or as stored)."""
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    torch.autograd.backward([out.sample, out.audio_sample], [d.to(out.sample.dtype) for d in dys])
    keys = set(adaln_keys(model))
    grads = {}
    for key, p in model.named_parameters():
        if key in keys:
            g = p.grad
            grads[key] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return (out.sample.detach().clone(), out.audio_sample.detach().clone()), grads


def bare_step(model, inputs, dys):
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    torch.autograd.backward([out.sample, out.audio_sample], [d.to(out.sample.dtype) for d in dys])


def median_step_ms(model, inputs, dys, steps: int, warmup: int = 2) -> float:
    """Median wall time of a bare train step (no gradient gathered or copied), deterministic algorithms off."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(False)
    times = []
    for i in range(warmup + steps):
        if inputs["hidden_states"].is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        bare_step(model, inputs, dys)
        if inputs["hidden_states"].is_cuda:
            torch.cuda.synchronize()
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    dist.barrier()
    return round(statistics.median(times), 3)


def max_abs(a, b) -> float:
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b))


def patched(model):
    assert adaln_lab.patch(model, parts=("norm_out", "blocks")), "patch swapped nothing"
    return model


def run_fsdp(rank, world, device, config, rows, steps):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device, (world,))
    ref = patched(build(config, device, "checkpoint"))
    micro = [make_inputs(ref, rows, 100 + r, device) for r in range(world)]
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        refs = [step(ref, *m) for m in micro]
    del ref
    model = fsdp2_shard(patched(build(config, device, "fp32")), mesh)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        out, grads = step(model, *micro[rank])
        _, again = step(model, *micro[rank])
    checks = {"forward_bitwise_unsharded": all(torch.equal(a, b) for a, b in zip(out, refs[rank][0]))}
    worst = {}
    exact = True
    for key, g in grads.items():
        parts = [r[1][key].float() for r in refs]
        mean = sum(parts) / world
        worst[key] = (g - mean).abs().max().item()
        if world <= 2:
            exact &= torch.equal(g, mean)
        else:  # W - 1 fp32 additions in some order, a scaling by 1 / W, against the exact mean
            exact64 = sum(p.double() for p in parts) / world
            bound = (world + 1) * 2 ** -24 * sum(p.double().abs() for p in parts) / world
            exact &= bool(((g.double() - exact64).abs() <= bound).all())
    checks["adaln_grads_reduce_scatter_mean"] = exact
    checks["adaln_grads_repeat"] = all(torch.equal(g, again[k]) for k, g in grads.items())
    figures = {"adaln_grad_max_abs_vs_mean": max(worst.values()),
               "step_ms_adaln_lab": median_step_ms(model, *micro[rank], steps)}
    del model
    plain = fsdp2_shard(build(config, device, "fp32"), mesh)
    figures["step_ms_diffusers"] = median_step_ms(plain, *micro[rank], steps)
    figures["speedup_vs_diffusers"] = round(figures["step_ms_diffusers"] / figures["step_ms_adaln_lab"], 3)
    return checks, figures


def leaky(forward):
    """The planted counter-example (run `planted`): norm_out whose rows also read the mean of the rows they are sharded with."""

    @functools.wraps(forward)
    def planted(hidden_states, temb, timestep_indices):
        return forward(hidden_states, temb, timestep_indices) + hidden_states.mean(dim=1, keepdim=True)

    return planted


def record_norm_out(module, store: list, plant: bool):
    """Wrap module.forward (before the plan's hooks wrap it, so inside the split): record each call's rows. Returns
    the forward the records come from, outside every hook."""
    inner = leaky(module.forward) if plant else module.forward

    @functools.wraps(inner)
    def forward(hidden_states, temb, timestep_indices):
        rec = dict(x=hidden_states.detach().clone(), temb=temb.detach().clone(), index=timestep_indices.clone())
        if hidden_states.requires_grad:
            hidden_states.register_hook(lambda g: rec.__setitem__("dx", g.detach().clone()))
        out = inner(hidden_states, temb, timestep_indices)
        if out.requires_grad:
            out.register_hook(lambda g: rec.__setitem__("dy", g.detach().clone()))
        rec["out"] = out.detach().clone()
        store.append(rec)
        return out

    module.forward = forward
    return inner


def norm_out_alone(module, forward, x, temb, index, dy):
    """norm_out's `forward` on these rows only: out, dx and the module's parameters' gradients."""
    x = x.detach().clone().requires_grad_(True)
    params = [module.linear.weight, module.linear.bias, module.norm.weight]
    out = forward(x, temb, index)
    grads = torch.autograd.grad(out, [x] + params, dy)
    return out.detach(), grads[0], grads[1:]


def gather_rows(t, world, dim):
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, dim=dim)


def run_cp(mode, rank, world, device, config, rows, plant=False):
    from diffusers import ContextParallelConfig

    backend = CP_BACKENDS[device][mode]
    cp_config = (ContextParallelConfig(ulysses_degree=world) if mode == "ulysses"
                 else ContextParallelConfig(ring_degree=world))
    checks, figures = {}, {"attention_backend": backend}
    results = {}
    for variant in ("adaln_lab", "diffusers"):
        model = build(config, device, "checkpoint")
        if variant == "adaln_lab":
            patched(model)
        model.set_attention_backend(backend)
        inputs, dys = make_inputs(model, rows, 200, device)
        single = step(model, inputs, dys)
        calls = []
        if variant == "adaln_lab":
            forward = record_norm_out(model.norm_out, calls, plant)
        model.enable_parallelism(config=cp_config)
        runs = []
        for _ in range(2):
            calls.clear()
            out, grads = step(model, inputs, dys)
            local = {k: model.get_parameter(k).grad.detach().clone() for k in NORM_OUT_PARAMS if variant == "adaln_lab"}
            for g in grads.values():
                dist.all_reduce(g)
            runs.append((out, grads))
        results[variant] = dict(single=single, runs=runs)
        if variant == "adaln_lab":
            checks["adaln_grads_summed_repeat"] = all(torch.equal(g, runs[1][1][k]) for k, g in runs[0][1].items())
            (rec,) = calls
            alone = norm_out_alone(model.norm_out, forward, rec["x"], rec["temb"], rec["index"], rec["dy"])
            checks["norm_out_rank_rows_alone_bitwise"] = (
                torch.equal(alone[0], rec["out"]) and torch.equal(alone[1], rec["dx"])
                and all(torch.equal(a, local[k]) for a, k in zip(alone[2], NORM_OUT_PARAMS)))
            x_all, index_all = gather_rows(rec["x"], world, 1), gather_rows(rec["index"], world, 0)
            dy_all = gather_rows(rec["dy"], world, 1)
            full = norm_out_alone(model.norm_out, forward, x_all, rec["temb"], index_all, dy_all)
            checks["norm_out_rows_bitwise_unsharded"] = (
                torch.equal(full[0].chunk(world, 1)[rank], rec["out"])
                and torch.equal(full[1].chunk(world, 1)[rank], rec["dx"]))
        del model
    for variant, res in results.items():
        out1, grads1 = res["single"]
        outc, gradsc = res["runs"][0]
        figures[f"{variant}_out_max_abs_vs_unsharded"] = max_abs(outc, out1)
        rel = {k: (gradsc[k].float() - g.float()).abs().max().item() / max(g.float().abs().max().item(), 1e-30)
               for k, g in grads1.items()}
        figures[f"{variant}_adaln_grad_rel_vs_unsharded"] = rel
        figures[f"{variant}_adaln_grad_rel_vs_unsharded_max"] = max(rel.values())
    figures["adaln_lab_out_bitwise_unsharded"] = figures["adaln_lab_out_max_abs_vs_unsharded"] == 0.0
    figures["diffusers_out_bitwise_unsharded"] = figures["diffusers_out_max_abs_vs_unsharded"] == 0.0
    # where attention's split leaves diffusers' output bits alone, the row-wise AdaLN ops must too
    checks["out_bitwise_where_diffusers_is"] = (figures["adaln_lab_out_bitwise_unsharded"]
                                                or not figures["diffusers_out_bitwise_unsharded"])
    return checks, figures


def worker(rank, world, port, device, config_name, runs, steps, folder):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device == "cuda":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
        torch.accelerator.device_count = lambda: 1  # diffusers' parallel config takes rank % the accelerators
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=world)
    config = TINY if config_name == "tiny" else FULL
    results = {}
    for run in runs:
        start = time.perf_counter()
        if run not in ("fsdp", "exact") and world < 2:
            results[run] = dict(skipped="context parallelism needs 2 ranks or more")
        elif run == "ring" and CP_BACKENDS[device]["ring"] is None:
            results[run] = dict(skipped="ring attention needs a backend returning the log-sum-exp; none on a CPU")
        else:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                torch.use_deterministic_algorithms(True, warn_only=True)
                try:
                    if run == "fsdp":
                        checks, figures = run_fsdp(rank, world, device, config, ROWS[config_name]["fsdp"], steps)
                    elif run == "exact":
                        checks, figures = run_exact(rank, world, device, config, ROWS[config_name]["fsdp"], steps,
                                                    build, make_inputs, adaln_keys)
                    elif run == "planted":
                        checks, figures = run_cp("ulysses", rank, world, device, config, ROWS[config_name]["cp"],
                                                 plant=True)
                        # the leak reads only the rank's rows: alone on them it repeats, under the plan it must not
                        checks = {"planted_leaky_norm_out_caught": not checks["norm_out_rows_bitwise_unsharded"],
                                  "planted_rank_rows_alone_bitwise": checks["norm_out_rank_rows_alone_bitwise"],
                                  "planted_adaln_grads_summed_repeat": checks["adaln_grads_summed_repeat"]}
                    else:
                        checks, figures = run_cp(run, rank, world, device, config, ROWS[config_name]["cp"])
                finally:
                    torch.use_deterministic_algorithms(False)
            fallbacks = sorted({str(w.message)[:160] for w in seen
                                if issubclass(w.category, (AdaLNFallbackWarning, KernelFallbackWarning))})
            nondeterministic = sorted({str(w.message)[:160] for w in seen if "determinis" in str(w.message)})
            if device == "cuda":
                checks["no_fallback_warning"] = not fallbacks
            results[run] = dict(checks=checks, figures=figures, fallback_warnings=fallbacks,
                                nondeterministic_warnings=nondeterministic, seconds=round(time.perf_counter() - start, 1))
        print(f"[rank {rank}] {run}: {json.dumps(results[run].get('checks', results[run]))}", file=sys.stderr,
              flush=True)
        with open(os.path.join(folder, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--world", type=int, default=2, help="ranks (on cuda: GPUs), default 2")
    parser.add_argument("--config", choices=("full", "tiny"), help="default: full on cuda, tiny on cpu")
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, of {', '.join(RUNS)}")
    parser.add_argument("--steps", type=int, default=5, help="timed train steps per variant (fsdp)")
    parser.add_argument("--out", required=True, help="the JSON to write")
    args = parser.parse_args(argv)
    if args.world < 1:
        parser.error(f"--world must be >= 1, got {args.world}")
    runs = args.runs.split(",")
    if unknown := sorted(set(runs) - set(RUNS)):
        parser.error(f"--runs: unknown {unknown}; choose from {RUNS}")
    if args.device == "cuda" and torch.cuda.device_count() < args.world:
        parser.error(f"--world {args.world} needs {args.world} GPUs; {torch.cuda.device_count()} visible")
    config = args.config or ("full" if args.device == "cuda" else "tiny")
    folder = args.out + ".ranks"  # each rank's results after each run: kept when a rank fails
    os.makedirs(folder, exist_ok=True)
    for r in range(args.world):
        if os.path.exists(os.path.join(folder, f"rank{r}.json")):
            os.remove(os.path.join(folder, f"rank{r}.json"))
    error = None
    try:
        mp.spawn(worker, args=(args.world, free_port(), args.device, config, runs, args.steps, folder),
                 nprocs=args.world, join=True)
    except Exception as err:  # a rank raised: the others were stopped; keep what every rank finished
        error = f"{type(err).__name__}: {str(err).strip().splitlines()[-1] if str(err).strip() else ''}"
    ranks = []
    for r in range(args.world):
        path = os.path.join(folder, f"rank{r}.json")
        ranks.append(json.load(open(path)) if os.path.exists(path) else {})
    failed = [f"{run} rank {r}: {name}" for r, res in enumerate(ranks) for run in runs
              for name, ok in res.get(run, {}).get("checks", {}).items() if not ok]
    failed += [f"{run} rank {r}: did not finish" for r, res in enumerate(ranks) for run in runs if run not in res]
    if error:
        failed.append(f"a rank raised {error}")
    result = dict(device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu", torch=torch.__version__,
                  world=args.world, config=config, rows=ROWS[config], runs={run: [res.get(run) for res in ranks]
                                                                             for run in runs},
                  checks_failed=failed)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for run in runs:
        first = ranks[0].get(run) or {"skipped": "did not finish"}
        state = first.get("skipped") or ("ok" if not any(s.startswith(f"{run} ") for s in failed) else "FAILED")
        shown = {k: v for k, v in first.get("figures", {}).items() if not isinstance(v, dict)}
        print(f"{run}: {state}; rank 0 figures {json.dumps(shown)}", file=sys.stderr)
    print(f"checks failed: {failed or 'none'}; wrote {args.out}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
