"""ExactGradients under diffusers' context parallelism (ulysses 2, real, on 2 gloo ranks of a CPU): the patched tiny
MiniMax-H3 model in the checkpoint's layout, SDPA's math backend (whose attention gives each head the same bits
however ulysses deals the heads), a batch of 2 samples in one part or in two micro-batches: after `all_reduce()`
and `write()` every AdaLN parameter's gradient is the bits one process writes for the whole batch, and the time
embedding's gradients summed over the ranks (each timestep's d_temb goes back on its lowest holder) are one
process's. Plain autograd under the same plan, its AdaLN gradients summed over the ranks, is caught by the check."""

import pytest
import torch
import torch.distributed as dist

from ..exact_parts import ranks

pytestmark = pytest.mark.integration  # gloo ranks in processes of their own

PER_SAMPLE = ("hidden_states", "audio_hidden_states", "encoder_hidden_states")
ROWS_CP = dict(text=8, video=16, audio=8)  # adaln_lab.bench.multi_gpu's tiny context-parallel rows


def _step(model, inputs, dys, micro, exact, parallel):
    """{AdaLN parameter: gradient}, {time embedding parameter: gradient} of one step over `micro` parts."""
    from adaln_lab.bench.multi_gpu import adaln_keys
    from adaln_lab.nn import ExactGradients

    model.zero_grad(set_to_none=True)
    acc = ExactGradients()
    for idx in micro:
        part = {k: (v[idx] if k in PER_SAMPLE else v) for k, v in inputs.items()}
        with acc if exact else torch.enable_grad():
            out = model(**part)
            torch.autograd.backward([out.sample, out.audio_sample], [d[idx].to(out.sample.dtype) for d in dys])
    if exact and parallel:
        acc.all_reduce()
    if exact:
        acc.write()
    grads = {k: model.get_parameter(k).grad.clone() for k in adaln_keys(model)}
    embed = {k: p.grad.clone() for k, p in model.time_embedder.named_parameters()}
    if parallel:  # each rank holds its rows' part (plain) or every rank the whole (exact); the time embedding: sums
        for g in (*([] if exact else grads.values()), *embed.values()):
            dist.all_reduce(g)
    return grads, embed


def _worker(rank, world, out):
    torch.set_num_threads(1)
    torch.accelerator.device_count = lambda: 1  # diffusers' parallel config takes rank % the accelerators
    from diffusers import ContextParallelConfig
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from adaln_lab.bench.multi_gpu import ROWS, build, make_inputs, patched
    from adaln_lab.testing import TINY_H3

    found = {}
    with sdpa_kernel(SDPBackend.MATH):
        for parallel in (False, True):
            model = patched(build(TINY_H3, "cpu", "checkpoint"))
            model.set_attention_backend("native")
            assert ROWS["tiny"]["cp"] == ROWS_CP
            inputs, dys = make_inputs(model, ROWS_CP, 200, "cpu", batch=2)
            if parallel:
                model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=2))
            seen = []  # the rows norm_out gets: half of them under the plan
            model.norm_out.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[1]))
            for name, micro, exact in (("exact", [[0, 1]], True), ("exact_micro", [[1], [0]], True),
                                       ("plain", [[0, 1]], False)):
                found[(name, parallel)] = _step(model, inputs, dys, [torch.tensor(m) for m in micro], exact, parallel)
            found[("rows", parallel)] = sorted(set(seen))
            del model
    if rank == 0:
        torch.save(found, out)


def test_ulysses_2_gives_the_adaln_gradients_one_process_writes(tmp_path):
    pytest.importorskip("diffusers")
    found = ranks(_worker, 2, tmp_path)
    rows = ROWS_CP["text"] + ROWS_CP["video"] + ROWS_CP["audio"]
    assert found[("rows", False)] == [rows] and found[("rows", True)] == [rows // 2]  # the plan split the rows
    one, embed = found[("exact", False)]
    assert len(one) == 11
    for key in (("exact", True), ("exact_micro", True), ("exact_micro", False)):
        grads, embed_grads = found[key]
        assert all(torch.equal(grads[k], g) for k, g in one.items()), key
        assert all(torch.equal(embed_grads[k], g) for k, g in embed.items()), key
    plain, _ = found[("plain", False)]
    cp_plain, _ = found[("plain", True)]
    assert not all(torch.equal(cp_plain[k], g) for k, g in plain.items())  # plain autograd's split is caught
