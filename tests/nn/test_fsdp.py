"""The patched model under FSDP2 (`fully_shard`) with fp32 master weights and
`MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)`.

The recipe is `adaln_lab.nn.fsdp2_shard` (patch first; each block, each fp32 module and the root in groups of
their own).

What holds, per rank r of W, each on its own micro-batch (batch row r) of one batch of W:
- forward: the sharded model's outputs equal, bit for bit, those of the unsharded model in the checkpoint's layout
  (bf16 weights = bf16(master), fp32 modules fp32, `checkpoint_layout`) on the same micro-batch;
- gradients: the reduce-scatter sums the W ranks' gradients in fp32 and divides by W; for W = 2 the sum of two
  gradients is one fp32 rounding (exact where both are bf16, whose 8-bit significands add within fp32's 24)
  and the halving is exact, so every AdaLN gradient equals, bit for bit, `(g_0.float() + g_1.float()) / 2` of the
  unsharded model's micro-batch gradients g_r (for W = 1: g_0.float()); and it repeats run to run.
CPU: gloo, 2 ranks, the ops' torch code. GPU (H200): NCCL, 1 rank, the kernels (no fallback warning).
"""

import multiprocessing
import os
import socket
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import adaln_lab
from adaln_lab.nn import AdaLNFallbackWarning, fsdp2_shard
from adaln_lab.ops import KernelFallbackWarning

from .test_patch import ALL_PARTS, SMALL, SMALL_ROWS, TINY, TINY_ROWS, adaln_keys, make_inputs, make_model, upstreams

pytestmark = pytest.mark.integration  # gloo ranks in processes of their own

BATCHED = ("hidden_states", "audio_hidden_states", "encoder_hidden_states")


def checkpoint_layout(model):
    """model (fp32) in the checkpoint's layout: bf16 parameters but the `_keep_in_fp32_modules`' (buffers as they
    are, which `model.to(torch.bfloat16)` would round: the rotary embedding's inv_freq)."""
    for name, module in model.named_modules():
        if not (name and any(key in name for key in model._keep_in_fp32_modules)):
            for p in module.parameters(recurse=False):
                p.data = p.data.to(torch.bfloat16)
    return model


def _micro(inputs, dys, r):
    return ({k: (v[r:r + 1] if k in BATCHED else v) for k, v in inputs.items()}, (dys[0][r:r + 1], dys[1][r:r + 1]))


def _step(model, inputs, dys):
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    torch.autograd.backward([out.sample, out.audio_sample], [d.to(out.sample.dtype) for d in dys])
    grads = {}
    for key, p in model.named_parameters():
        if key in set(adaln_keys(model)):
            g = p.grad
            grads[key] = (g.full_tensor() if hasattr(g, "full_tensor") else g).clone()
    return (out.sample.detach(), out.audio_sample.detach()), grads


def _worker(rank, world, port, device, config, rows):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # SDPA's math backend: the flash / memory-efficient backwards accumulate dq with atomics, which would vary every
    # gradient upstream of an attention from run to run whatever the sharding does
    with sdpa_kernel(SDPBackend.MATH):
        _compare(rank, world, device, config, rows)
    dist.destroy_process_group()


def _compare(rank, world, device, config, rows):
    """The module docstring's checks on this rank."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device, (world,))
    inputs = make_inputs(80, rows, config, batch=world, device=device)
    ref_model = checkpoint_layout(make_model(81, "fp32", config)).to(device)
    dys = upstreams(82, ref_model, inputs)
    assert adaln_lab.patch(ref_model, parts=ALL_PARTS)
    micro = [_micro(inputs, dys, r) for r in range(world)]
    refs = [_step(ref_model, *m) for m in micro]
    model = fsdp2_shard(adaln_lab_patched(make_model(81, "fp32", config).to(device)), mesh)
    with warnings.catch_warnings():
        if device == "cuda":
            warnings.simplefilter("error", AdaLNFallbackWarning)
            warnings.simplefilter("error", KernelFallbackWarning)
        out, grads = _step(model, *micro[rank])
        _, again = _step(model, *micro[rank])
    for got, want in zip(out, refs[rank][0]):
        assert got.dtype == want.dtype and torch.equal(got, want), (rank, (got.float() - want.float()).abs().max())
    for key, g in grads.items():
        expected = sum(ref[1][key].float() for ref in refs) / world
        assert g.dtype == torch.float32 and torch.equal(g, expected), (rank, key, (g - expected).abs().max())
        assert torch.equal(g, again[key]), (rank, key)


def adaln_lab_patched(model):
    assert adaln_lab.patch(model, parts=ALL_PARTS)
    return model


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fsdp2_two_cpu_ranks_forward_bitwise_and_gradients_the_reduce_scatters_mean():
    # Each rank a process of its own, forked from multiprocessing's fork server, which imported this module (torch,
    # torch.distributed, diffusers, adaln_lab: seconds) once for both ranks, instead of two fresh interpreters
    # importing it each; the server is itself a fresh interpreter, so no state of this pytest process reaches a rank.
    multiprocessing.set_forkserver_preload([__name__])
    mp.start_processes(_worker, args=(2, _free_port(), "cpu", TINY, TINY_ROWS), nprocs=2, join=True,
                       start_method="forkserver")


@pytest.mark.gpu
def test_cuda_fsdp2_one_rank_nccl_kernels_forward_bitwise_and_gradients_fp32_of_the_unsharded():
    mp.spawn(_worker, args=(1, _free_port(), "cuda", SMALL, SMALL_ROWS), nprocs=1, join=True)
