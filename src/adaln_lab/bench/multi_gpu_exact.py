"""The `exact` run of `adaln_lab.bench.multi_gpu`: ExactGradients under FSDP2 on every world size that divides W.

The W ranks form sub-meshes of w consecutive ranks for each power of two w dividing W (1, 2, 4, ...); every
sub-mesh runs one global batch of W samples (the patched model sharded over it by `fsdp2_shard` with divide factor
1, fp32 masters, the time embedding frozen), dealt by sample, W / w micro-batches a rank, each inside `with acc`,
then `acc.all_reduce(group)` and `acc.write()`. Checks (rank 0, which is in the first sub-mesh of every size): every AdaLN parameter's gradient
(gathered) is the same bits for every w; plain FSDP2 (the whole batch in one backward on one rank, against one
sample a rank on the largest w: its fp32 reduce-scatter) is caught by the same check (with one size only, W odd, no
check). Figures on the largest w: median ms of the exact step and of the plain FSDP2 step, the bytes of one rank's
exact states (`ExactGradients.state_bytes`: the norm weights' limbs, the table's limbs and rows over the distinct
timesteps) and one all-reduce's time (synchronised before and after).
The AdaLN ops record on the torch route (a patched model with backend "torch", the same code on every rank).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

PER_SAMPLE = ("hidden_states", "audio_hidden_states", "encoder_hidden_states")


def _sizes(world: int) -> list[int]:
    return [w for w in (2 ** k for k in range(world.bit_length())) if world % w == 0]


def _model(build, config, device, mesh):
    import adaln_lab
    from adaln_lab.nn import fsdp2_shard

    model = build(config, device, "fp32")
    assert adaln_lab.patch(model, parts=("norm_out", "blocks"), backend="torch"), "patch swapped nothing"
    model.time_embedder.requires_grad_(False)  # exact gradients under FSDP2 take it frozen (nn.exact)
    return fsdp2_shard(model, mesh, divide_factor=1.0)  # FSDP2 sums the ranks' gradients, as the exact ones are


def _step(model, inputs, dys, samples, group, exact: bool, timed: dict | None = None):
    """One train step on `samples` (this rank's micro-batches: lists of sample indices); returns the acc's
    all-reduce bytes."""
    from adaln_lab.nn import ExactGradients

    model.zero_grad(set_to_none=True)
    acc = ExactGradients()
    for micro in samples:
        idx = torch.tensor(micro)
        part = {k: (v[idx] if k in PER_SAMPLE else v) for k, v in inputs.items()}
        with acc if exact else torch.enable_grad():
            out = model(**part)
            torch.autograd.backward([out.sample, out.audio_sample],
                                    [d[idx].to(out.sample.dtype) for d in dys])
    if not exact:
        return 0
    sent = acc.state_bytes()
    _sync(inputs)
    dist.barrier(group)
    start = time.perf_counter()
    acc.all_reduce(group)
    _sync(inputs)
    if timed is not None:  # one sample, the backward's GPU work finished before it
        timed["all_reduce_ms"] = round((time.perf_counter() - start) * 1e3, 3)
    acc.write()
    return sent


def _sync(inputs) -> None:
    if inputs["hidden_states"].is_cuda:
        torch.cuda.synchronize()


def _grads(model, keys) -> dict:
    params = dict(model.named_parameters())
    return {k: params[k].grad.full_tensor() for k in keys}


def run_exact(rank, world, device, config, rows, steps, build, make_inputs, adaln_keys):
    from torch.distributed.device_mesh import DeviceMesh

    groups = {}
    for w in _sizes(world):  # every rank creates every group, in one order
        groups[w] = [dist.new_group(list(range(b, b + w))) for b in range(0, world, w)][rank // w]
    found, sent, timed = {}, 0, {}
    top = max(_sizes(world))  # the largest power of two dividing W: its sub-meshes time the steps
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        for how, sizes in (("exact", _sizes(world)), ("plain", sorted({1, top}))):
            for w in sizes:
                group = groups[w]
                mesh = DeviceMesh.from_group(group, device)
                model = _model(build, config, device, mesh)
                inputs, dys = make_inputs(model, rows, 300, device, batch=world)
                per = world // w
                mine = list(range((rank % w) * per, (rank % w + 1) * per))
                # exact: one micro-batch a sample; plain: the rank's samples in one (one rank: the whole batch)
                samples = [[s] for s in mine] if how == "exact" else [mine]
                sent = _step(model, inputs, dys, samples, group, how == "exact", timed) or sent
                found[(how, w)] = _grads(model, adaln_keys(model))
                if w == top:
                    times = []
                    for _ in range(steps):
                        start = time.perf_counter()
                        _step(model, inputs, dys, samples, group, how == "exact")
                        _sync(inputs)
                        times.append((time.perf_counter() - start) * 1e3)
                    timed[f"step_ms_{how}"] = round(statistics.median(times), 3)
                del model
    one, checks = found[("exact", 1)], {}
    if top > 1:  # one world size alone has nothing to agree with
        checks["exact_adaln_grads_bitwise_every_world"] = all(
            torch.equal(found[("exact", w)][k], g) for w in _sizes(world) for k, g in one.items())
        checks["planted_fp32_reduce_scatter_caught"] = not all(  # plain FSDP2's split changes bits
            torch.equal(found[("plain", top)][k], g) for k, g in found[("plain", 1)].items())
    figures = {"worlds": _sizes(world), "all_reduce_bytes_per_rank": sent, **timed}
    if "step_ms_plain" in timed and "step_ms_exact" in timed:
        figures["exact_over_plain"] = round(timed["step_ms_exact"] / timed["step_ms_plain"], 3)
    return checks, figures
