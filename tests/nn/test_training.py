"""The patched model trained as users train it: fp32 master weights under autocast, gradient accumulation.

- fp32 master weights under `torch.autocast("cuda", torch.bfloat16)` (GPU): every AdaLN runs on the kernels (no
  AdaLNFallbackWarning, no KernelFallbackWarning), the AdaLN gradients are fp32 and repeat bit for bit, and the
  outputs and AdaLN gradients lie within twice diffusers' own distance (under the same autocast) from the fp32
  model run without autocast: the bf16 rounding noise both carry (`adaln_lab.core.autocast` says where the two
  round differently).
- Gradient accumulation over micro-batches (GPU, kernels; CPU, the torch code): the accumulated gradient is, bit
  for bit, the sum of the micro-batches' gradients in the order they ran, and repeats; it is not the full
  batch's gradient bit for bit (a different split is a different fixed-order sum): the bits depend on the
  split, the order of the micro-batches and nothing else.
"""

import warnings

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import adaln_lab
from adaln_lab.nn import AdaLNFallbackWarning
from adaln_lab.ops import KernelFallbackWarning

from .test_patch import ALL_PARTS, SMALL, SMALL_ROWS, TINY, TINY_ROWS, adaln_keys, make_inputs, make_model, upstreams


def _step(model, inputs, dys, autocast):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
        out = model(**inputs)
    torch.autograd.backward([out.sample, out.audio_sample], [d.to(out.sample.dtype) for d in dys])
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if k in set(adaln_keys(model))}
    return (out.sample.detach().float(), out.audio_sample.detach().float()), grads


@pytest.mark.gpu
def test_cuda_fp32_master_weights_under_autocast_run_the_kernels_repeat_and_stay_within_bf16_noise():
    model = make_model(70, "fp32", SMALL).cuda()
    inputs = make_inputs(71, SMALL_ROWS, SMALL, device="cuda")
    dys = upstreams(72, model, inputs)
    with sdpa_kernel(SDPBackend.MATH):  # the flash backward's atomics would vary every gradient upstream of it
        wide_out, wide_grads = _step(model, inputs, dys, autocast=False)
        ref_out, ref_grads = _step(model, inputs, dys, autocast=True)
        assert adaln_lab.patch(model, parts=ALL_PARTS)
        with warnings.catch_warnings():
            warnings.simplefilter("error", AdaLNFallbackWarning)
            warnings.simplefilter("error", KernelFallbackWarning)
            out, grads = _step(model, inputs, dys, autocast=True)
            _, again = _step(model, inputs, dys, autocast=True)
    for got, want, wide in zip(out, ref_out, wide_out):
        assert (got - want).abs().max().item() <= 2 * (want - wide).abs().max().item()
    for key in adaln_keys(model):
        assert grads[key].dtype == torch.float32 and torch.equal(grads[key], again[key]), key
        noise = (ref_grads[key] - wide_grads[key]).abs().max().item()
        assert (grads[key] - ref_grads[key]).abs().max().item() <= 2 * noise, key


def _micro(inputs, rows):
    return {k: (v[rows] if k in ("hidden_states", "audio_hidden_states", "encoder_hidden_states") else v)
            for k, v in inputs.items()}


def _backward(model, inputs, dys, rows):
    out = model(**_micro(inputs, rows))
    torch.autograd.backward([out.sample, out.audio_sample], [dys[0][rows], dys[1][rows]])


def _adaln_grads(model):
    return {k: p.grad.clone() for k, p in model.named_parameters() if k in set(adaln_keys(model))}


def _accumulated(model, inputs, dys, parts):
    """AdaLN gradients accumulated over micro-batches (the batch rows `parts`, in order), and each micro-batch's
    own (from a step of its own)."""
    own = []
    for rows in parts:
        model.zero_grad(set_to_none=True)
        _backward(model, inputs, dys, rows)
        own.append(_adaln_grads(model))
    model.zero_grad(set_to_none=True)
    for rows in parts:
        _backward(model, inputs, dys, rows)
    return _adaln_grads(model), own


def _accumulation_case(device, config, rows):
    model = make_model(73, "mixed", config).to(device)
    inputs = make_inputs(74, rows, config, batch=2, device=device)
    assert adaln_lab.patch(model, parts=ALL_PARTS)
    return model, inputs, upstreams(75, model, inputs)


def _check_accumulation(model, inputs, dys):
    total, own = _accumulated(model, inputs, dys, [slice(0, 1), slice(1, 2)])
    again, _ = _accumulated(model, inputs, dys, [slice(0, 1), slice(1, 2)])
    full, _ = _accumulated(model, inputs, dys, [slice(0, 2)])
    for key in total:
        assert torch.equal(total[key], again[key]), key
        assert torch.equal(total[key], own[0][key] + own[1][key]), key
    return sum(not torch.equal(total[key], full[key]) for key in total)


def test_gradient_accumulation_is_the_ordered_sum_of_the_micro_batches():
    _check_accumulation(*_accumulation_case("cpu", TINY, TINY_ROWS))


@pytest.mark.gpu
def test_cuda_gradient_accumulation_is_the_ordered_sum_of_the_micro_batches_and_depends_on_the_split():
    with sdpa_kernel(SDPBackend.MATH):
        differ = _check_accumulation(*_accumulation_case("cuda", SMALL, SMALL_ROWS))
    assert differ > 0  # the split shows in the bits: the accumulated sum is not the full batch's
