"""The patched model under diffusers' memory features: group offloading (block and leaf level), accelerate's cpu
offload and fp8 layerwise casting. Where a feature puts hooks on the submodules a patched module reads, that
module runs diffusers' own forward (`adaln_lab.nn.fallback`, with a warning); where it hooks the patched module
as a whole (block-level offloading onloads a block's parameters before its forward) or skips a module (layerwise
casting skips every module named like "norm", norm_out included), the kernels run. So on CUDA the outputs and the
gradients of the two main inputs (a backward through every block) equal the unpatched model's within bf16 rounding: at most twice the unpatched model's own distance from the float32
model under the same feature (the bound of tests/nn/test_patch.py's GPU parity test), and the peak GPU memory
is no higher than the unpatched model's. On the CPU every module runs diffusers' ops: bit for bit."""

import copy
import gc

import pytest
import torch

import adaln_lab

from .test_patch import ALL_PARTS, SMALL, SMALL_ROWS, TINY, TINY_ROWS, make_inputs, make_model, upstreams

FEATURES = ["group_block", "group_leaf", "cpu_offload", "fp8_casting"]


def with_feature(model, feature, device, compute_dtype=torch.bfloat16):
    if feature == "group_block":
        model.enable_group_offload(torch.device(device), offload_type="block_level", num_blocks_per_group=1)
    elif feature == "group_leaf":
        model.enable_group_offload(torch.device(device), offload_type="leaf_level")
    elif feature == "cpu_offload":
        from accelerate import cpu_offload

        cpu_offload(model, execution_device=torch.device(device))
    else:
        model.to(device).enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=compute_dtype)
    return model


def requested_bytes(key: str) -> int:
    return torch.cuda.memory_stats()[f"requested_bytes.all.{key}"]


def peak_and_output(model, inputs, dys, device):
    """(the peak bytes requested on the device during one forward under no_grad, above what was requested before it;
    that forward's outputs; the gradients of <outputs, dys> with respect to the model's two main inputs from a second
    forward with grad, or the exception's type where that backward raises). The peak is taken above the baseline
    so that what outlives a call (the model's resident weights, the workspaces a first backward allocates for its
    own thread) does not count against the model measured after it. Requested, not allocated, bytes: the caching
    allocator hands out a cached block of up to 1 MiB more than asked for without splitting it, so allocated bytes
    depend on what earlier tests left in the cache (seen: the same call measured 655360 bytes apart)."""
    with torch.no_grad():  # a warm-up: what a first call allocates for good (caches, workspaces) is not its peak
        model(**inputs)
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    before = requested_bytes("current") if device == "cuda" else 0
    with torch.no_grad():
        out = model(**inputs)
    peak = requested_bytes("peak") - before if device == "cuda" else 0
    leaves = {k: inputs[k].detach().clone().requires_grad_(True) for k in ("hidden_states", "audio_hidden_states")}
    try:
        grad_out = model(**{**inputs, **leaves})
        torch.autograd.backward([grad_out.sample, grad_out.audio_sample], list(dys))
        grads = tuple(leaf.grad.cpu() for leaf in leaves.values())
    except RuntimeError as error:  # diffusers' group offloading holds no weights for a backward (compare below)
        grads = type(error)
    return peak, (out.sample.cpu(), out.audio_sample.cpu()), grads


def run_feature(feature, device, config, rows):
    """{"unpatched" | "patched" | "float32": (peak bytes, (outputs, input gradients))}: the mixed-precision model
    unpatched and patched under the feature, and the same weights in a float32 model under it (fp8 casting:
    computing in float32)."""
    base = make_model(60, "mixed", config)
    inputs = make_inputs(61, rows, config, device=device)
    dys = upstreams(62, base, inputs)
    results = {}
    for name in ("unpatched", "patched", "float32"):
        if name == "float32":
            model = make_model(60, "fp32", config)
            model.load_state_dict(base.state_dict())
        else:
            model = copy.deepcopy(base)
        if name == "patched":
            assert adaln_lab.patch(model, parts=ALL_PARTS)
        with_feature(model, feature, device, torch.float32 if name == "float32" else torch.bfloat16)
        results[name] = peak_and_output(model, inputs, dys, device)
        del model
    return results


def test_fp8_layerwise_casting_on_the_cpu_equals_unpatched():
    results = run_feature("fp8_casting", "cpu", TINY, TINY_ROWS)
    (_, out_a, grads_a), (_, out_b, grads_b) = results["unpatched"], results["patched"]
    assert all(torch.equal(a, b) for a, b in zip(out_a + grads_a, out_b + grads_b))


@pytest.mark.gpu
@pytest.mark.parametrize("feature", FEATURES)
def test_cuda_patched_model_under_memory_features_equals_unpatched_and_peaks_no_higher(feature):
    results = run_feature(feature, "cuda", SMALL, SMALL_ROWS)
    (peak_a, out_a, grads_a), (peak_b, out_b, grads_b), (_, exact, grads_exact) = (
        results["unpatched"], results["patched"], results["float32"])
    for got, want, wide in zip(out_b, out_a, exact):
        noise = (want.float() - wide.float()).abs().max().item()
        assert (got.float() - want.float()).abs().max().item() <= 2 * noise
    if isinstance(grads_a, type):  # the unpatched model's backward fails under this feature: the patched one's too
        assert grads_b is grads_a, (feature, grads_b)
    else:
        assert not isinstance(grads_b, type), (feature, grads_b)
        for got, want, wide in zip(grads_b, grads_a, grads_exact):
            noise = (want.float() - wide.float()).abs().max().item()
            assert (got.float() - want.float()).abs().max().item() <= 2 * noise
    assert peak_b <= peak_a, (peak_b, peak_a)


def test_a_parameter_moved_or_cast_after_the_forward_is_refused_before_the_kernels_read_it():
    from adaln_lab.core.support import check_saved

    x, w = torch.zeros(2, 8, dtype=torch.bfloat16), torch.ones(8, dtype=torch.bfloat16)
    check_saved("op", x, norm_weight=w)
    w.data = w.data.to(torch.float8_e4m3fn)  # what layerwise casting does to a parameter after its forward
    with pytest.raises(RuntimeError, match="norm_weight is now torch.float8_e4m3fn on cpu"):
        check_saved("op", x, norm_weight=w)
