"""ExactGradients under FSDP2 (`adaln_lab.nn.fsdp2_shard`: fp32 master weights, bf16 compute) on gloo ranks (CPU,
one spawn of 4): a patched tiny MiniMax-H3 model, one global batch of 4 samples dealt by sample to world sizes 1, 2
and 4 (sub-meshes of the 4 ranks), with 4, 2 and 1 micro-batches a rank (an accumulator each, merged in reverse
order): after `all_reduce(group)` and `write()`
every AdaLN parameter's sharded fp32 gradient, gathered, is the same bits in every layout (FSDP2's divide factor 1:
sums, as the exact gradients are). Plain FSDP2 (its fp32 reduce-scatter of the ranks' gradients) over the same
layouts is caught by the same check. A trainable time embedding is refused at write (NotImplementedError), no
gradient written; so is a write while the parameters are still unsharded. With PEFT LoRA on every AdaLN projection
(a spawn of 2), the adapters' sharded gradients are the same bits on one and two ranks."""

import pytest
import torch
import torch.distributed as dist

from ..exact_parts import ranks

pytestmark = pytest.mark.integration  # gloo ranks in processes of their own

PER_SAMPLE = ("hidden_states", "audio_hidden_states", "encoder_hidden_states")
LAYOUTS = (("exact", 1, 4), ("exact", 2, 2), ("exact", 4, 1), ("plain", 1, 1), ("plain", 4, 1))  # (how, W, micro)


def _model(device: str, lora: bool = False):
    """(the patched tiny H3 model, its inputs, a cotangent of its sample) on `device` (backend "auto": on CUDA each
    AdaLN on the kernels where they take its inputs, FSDP2's bf16 unsharded parameters among them, else its torch
    code, warned); lora: PEFT LoRA on every AdaLN projection first (only the adapters train)."""
    import adaln_lab
    from adaln_lab.testing import tiny_h3_model

    model, inputs = tiny_h3_model(batch=4)
    if lora:
        from peft import LoraConfig, inject_adapter_in_model

        inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, target_modules=["adaln_proj.linear", "norm_out.linear"],
                                           init_lora_weights=False), model, adapter_name="a")
    adaln_lab.patch(model)
    cot = torch.randn(4, *model(**inputs).sample.shape[1:], generator=torch.Generator().manual_seed(5))
    return model.to(device), {k: v.to(device) for k, v in inputs.items()}, cot.to(device)


def _step(how, group, mesh, micro, frozen_time=True, reshard=True, written=None, device="cpu", lora=False):
    """One step of the sharded model on this rank's samples: {AdaLN parameter (lora: adapter): its gradient in
    full}."""
    from adaln_lab.bench.multi_gpu import adaln_keys  # in the rank's process (it sets a CUDA environment variable)
    from adaln_lab.nn import ExactGradients, fsdp2_shard

    model, inputs, cot = _model(device, lora)
    names = [n for n, p in model.named_parameters() if "lora_" in n] if lora else adaln_keys(model)
    if frozen_time:
        model.time_embedder.requires_grad_(False)
    fsdp2_shard(model, mesh, divide_factor=1.0)  # the ranks' gradients summed, as the exact ones
    if not reshard:
        model.set_reshard_after_backward(False)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    mine = list(range(rank * 4 // world, (rank + 1) * 4 // world))
    model.zero_grad(set_to_none=True)
    parts = [ExactGradients() for _ in range(micro)]  # one accumulator a micro-batch, merged in reverse order
    for k, acc in enumerate(parts):
        idx = torch.tensor(mine[k::micro], device=device)
        part = {key: (v[idx] if key in PER_SAMPLE else v) for key, v in inputs.items()}
        with acc if how == "exact" else torch.enable_grad():
            (model(**part).sample * cot[idx]).sum().backward()
    acc = ExactGradients()
    for other in reversed(parts):
        acc.merge(other)
    if how == "exact":
        acc.all_reduce(group)
        try:
            acc.write()
        finally:  # on a refusal: whether any AdaLN parameter got a gradient
            if written is not None:
                written.append(any(p.grad is not None for n, p in model.named_parameters() if n in names))
    params = dict(model.named_parameters())
    return {n: params[n].grad.full_tensor() for n in names}


def _reference(device="cpu"):
    """{AdaLN parameter: its exact gradient} of the whole batch in one process, unsharded, in the checkpoint's
    layout (what FSDP2's bf16 policy computes with: bf16 weights, the fp32 modules fp32): bf16, rounded once."""
    from adaln_lab.bench.multi_gpu import adaln_keys
    from adaln_lab.nn import ExactGradients

    model, inputs, cot = _model(device)
    for name, module in model.named_modules():
        if not (name and any(key in name for key in model._keep_in_fp32_modules)):
            for p in module.parameters(recurse=False):
                p.data = p.data.to(torch.bfloat16)
    model.time_embedder.requires_grad_(False)
    acc = ExactGradients()
    with acc:
        (model(**inputs).sample.float() * cot).sum().backward()
    acc.write()
    params = dict(model.named_parameters())
    return {n: params[n].grad for n in adaln_keys(model)}


def _worker(rank, world, out):
    """Every layout on the ranks of rank 0's sub-mesh (the others' sub-meshes would repeat it); first, beside rank
    0's one-rank layout, rank 1 the unsharded reference and ranks 2 and 3 one refusal each. Rank 0 saves it all."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.nn.attention import SDPBackend, sdpa_kernel

    singles, pairs = [dist.new_group([r]) for r in range(4)], [dist.new_group(p) for p in ([0, 1], [2, 3])]
    groups = {1: singles[rank], 2: pairs[rank // 2], 4: dist.group.WORLD}  # every rank makes every group
    found = {}
    with sdpa_kernel(SDPBackend.MATH):  # the math backend's attention backward repeats
        mesh1 = DeviceMesh.from_group(groups[1], "cpu")
        if rank == 1:
            found["reference"] = _reference()
        elif rank == 2:  # refused: a trainable time embedding, and no gradient set
            with pytest.raises(NotImplementedError, match="Freeze the time embedding"):
                _step("exact", groups[1], mesh1, 2, frozen_time=False, written=found.setdefault("refused", []))
        elif rank == 3:  # refused: the parameters left unsharded, and no gradient set
            with pytest.raises(ValueError, match="call model.reshard"):
                _step("exact", groups[1], mesh1, 2, reshard=False, written=found.setdefault("refused", []))
        for how, world, micro in LAYOUTS:
            if rank < world:
                found[(how, world, micro)] = _step(how, groups[world], DeviceMesh.from_group(groups[world], "cpu"),
                                                   micro)
    parts = [None] * 4
    dist.all_gather_object(parts, found)
    if rank == 0:
        merged = {**parts[1], "refused": parts[2]["refused"] + parts[3]["refused"], **parts[0]}
        torch.save(merged, out)


def test_fsdp2_adaln_gradients_are_one_bits_for_every_world_size_and_micro_batch_split(tmp_path):
    pytest.importorskip("diffusers")
    found = ranks(_worker, 4, tmp_path)
    assert found.pop("refused") == [False, False]  # both refusals wrote no gradient
    one = found[("exact", 1, 4)]
    assert len(one) == 11 and all(g.dtype == torch.float32 for g in one.values())  # the masters' dtype
    for layout in (("exact", 2, 2), ("exact", 4, 1)):
        assert all(torch.equal(found[layout][n], one[n]) for n in one), layout
    plain, plain4 = found[("plain", 1, 1)], found[("plain", 4, 1)]
    assert not all(torch.equal(plain4[n], plain[n]) for n in plain)  # the planted fp32 reduce-scatter is caught
    assert_the_exact_sums_of(found["reference"], one)


def assert_the_exact_sums_of(reference: dict, got: dict) -> None:
    """`got` (fp32, FSDP2's masters) are the exact gradients of the model in the layout FSDP2 computes in (bf16
    weights = bf16(master), fp32 modules fp32), which `reference` holds from one unsharded process rounded once to
    bf16: two roundings of one exact sum lie within half a bf16 ulp plus one fp32 ulp of each other."""
    assert set(got) == set(reference) and len(got) == 11
    for n, g in got.items():
        ref = reference[n]
        assert ref.dtype == torch.bfloat16 and g.dtype == torch.float32, n
        bound = torch.ldexp(torch.ones_like(g), torch.frexp(ref.float())[1] - 9) + torch.ldexp(
            torch.ones_like(g), torch.frexp(g)[1] - 24)
        bound = torch.where(ref == 0, 2.0 ** -133, bound)  # a bf16 zero: |exact| at most half its least subnormal
        assert bool(((g.double() - ref.double()).abs() <= bound.double()).all()), n


def _cuda_worker(rank, world, out):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.nn.attention import SDPBackend, sdpa_kernel

    group = dist.group.WORLD
    with sdpa_kernel(SDPBackend.MATH):
        got = _step("exact", group, DeviceMesh.from_group(group, "cuda"), 2, device="cuda")
        reference = _reference("cuda")
    torch.save({"exact": {k: v.cpu() for k, v in got.items()}, "reference": {k: v.cpu() for k, v in reference.items()}},
               out)


@pytest.mark.gpu
def test_cuda_fsdp2_one_nccl_rank_writes_the_exact_gradients_as_sharded_masters(tmp_path):
    """On CUDA (backend "auto"), one NCCL rank, two micro-batches merged: the sharded fp32 masters' gradients are the
    unsharded checkpoint layout's exact ones, within two roundings."""
    pytest.importorskip("diffusers")
    found = ranks(_cuda_worker, 1, tmp_path, backend="nccl")
    assert_the_exact_sums_of(found["reference"], found["exact"])


def _lora_worker(rank, world, out):
    """LoRA on every AdaLN projection: world sizes 1 (two micro-batches) and 2 (one each), exact and plain."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.nn.attention import SDPBackend, sdpa_kernel

    singles = [dist.new_group([r]) for r in range(2)]
    found = {}
    with sdpa_kernel(SDPBackend.MATH):
        for how in ("exact", "plain"):
            if rank == 0:
                found[(how, 1)] = _step(how, singles[0], DeviceMesh.from_group(singles[0], "cpu"), 2, lora=True)
            found[(how, 2)] = _step(how, dist.group.WORLD, DeviceMesh.from_group(dist.group.WORLD, "cpu"), 1,
                                    lora=True)
    if rank == 0:
        torch.save(found, out)


def test_fsdp2_lora_gradients_are_one_bits_on_one_and_two_ranks(tmp_path):
    """PEFT LoRA on every AdaLN projection under FSDP2 (the adapters sharded, fp32 masters): the 6 adapters'
    gradients, gathered, are the same bits on one rank with two micro-batches and on two ranks; plain FSDP2 over the
    same layouts is not."""
    pytest.importorskip("diffusers")
    pytest.importorskip("peft")
    found = ranks(_lora_worker, 2, tmp_path)
    one, two = found[("exact", 1)], found[("exact", 2)]
    assert len(one) == 6 and all(g.dtype == torch.float32 and g.any() for g in one.values())
    assert all(torch.equal(two[n], one[n]) for n in one)
    assert not all(torch.equal(found[("plain", 2)][n], found[("plain", 1)][n]) for n in one)
