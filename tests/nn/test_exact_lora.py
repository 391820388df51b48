"""adaln_lab.nn.ExactGradients with PEFT LoRA adapters on norm_out's projection (the torch route, CPU): the norm
weight's, the base projection's, lora_A's, lora_B's and the time embedding's gradients are the same bits for one
batch and for micro-batches of 2, 3 and 8 parts by sample and within samples, in either order; plain autograd over
the same splits (the planted float32 accumulation) changes them. The adapters' gradients are the fixed functions of
the exact table gradient: dB = s dW A^T and dA = s B^T dW with dW the base weight's (float64, before rounding), so
the written ones agree with the written dW within the two roundings (derived below); a dropped scaling fails it.
An adapter that cannot be recorded (a bias, an active dropout) is refused."""

import pytest
import torch

from adaln_lab.nn import AdaLNOut, ExactGradients

from ..exact_parts import by_sample, norm_out_batch, time_embedding, within

peft = pytest.importorskip("peft", reason="the test extra brings peft")
from peft import LoraConfig, inject_adapter_in_model  # noqa: E402

B, S, H, D, T = 8, 24, 16, 8, 3
SCALE = 8 / 4  # lora_alpha / r


def setup(seed: int = 0, **config):
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    module = AdaLNOut(H, D, eps=1e-5, backend="torch")
    with torch.no_grad():
        module.norm.weight.copy_(1 + 0.1 * torch.randn(H, generator=g))
        module.linear.weight.copy_(0.1 * torch.randn(2 * H, D, generator=g))
        module.linear.bias.copy_(0.1 * torch.randn(2 * H, generator=g))
    inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, target_modules=["linear"], init_lora_weights=False,
                                       **config), module, adapter_name="a")
    module = module.bfloat16().requires_grad_(True)  # the base too (PEFT freezes it): its dW checks the adapters'
    embed = time_embedding(g, D)
    return module, embed, norm_out_batch(g, B, S, H, T)


def grads(module, embed, parts, exact=True):
    """{name: gradient} of module's trainable parameters and the time embedding's weight over the parts."""
    params = {name: p for name, p in module.named_parameters() if p.requires_grad}
    for p in [*params.values(), *embed.parameters()]:
        p.grad = None
    acc = ExactGradients()
    for x, feats, idx, cot in parts:
        with acc if exact else torch.enable_grad():
            (module(x, embed(feats), idx).float() * cot).sum().backward()
    if exact:
        acc.write()
    out = {name: p.grad.clone() for name, p in params.items()}
    out["embed.weight"] = embed.weight.grad.clone()
    return out


def same(a, b) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def test_lora_gradients_are_the_same_bits_for_every_split():
    module, embed, batch = setup()
    frozen = setup()[0].requires_grad_(False)  # PEFT's default: only the adapters train, and they get their gradients
    for name, p in frozen.named_parameters():
        p.requires_grad_("lora_" in name)
    assert set(grads(frozen, embed, [batch])) == {"linear.lora_A.a.weight", "linear.lora_B.a.weight",
                                                              "embed.weight"}
    one = grads(module, embed, [batch])
    assert {"linear.lora_A.a.weight", "linear.lora_B.a.weight", "linear.base_layer.weight"} <= set(one)
    assert all(bool(torch.isfinite(g.float()).all()) and g.any() for g in one.values())
    splits = [parts for n in (2, 3, 8) for parts in (by_sample(batch, n), within(batch, n))]
    for parts in splits:
        assert same(grads(module, embed, parts), one) and same(grads(module, embed, parts[::-1]), one), len(parts)
    plain = grads(module, embed, [batch], exact=False)
    assert any(not same(grads(module, embed, parts, exact=False), plain) for parts in splits)


def _ulp_half(t: torch.Tensor) -> torch.Tensor:
    """Half a unit in the last place of each element of t in t's dtype, float64 (the error of one rounding)."""
    t64 = t.double().abs()
    bits = {torch.bfloat16: 8, torch.float32: 24}[t.dtype]
    exponent = torch.floor(torch.log2(t64.clamp_min(torch.finfo(t.dtype).tiny)))
    return torch.exp2(exponent - bits)  # 2^(e - p + 1) / 2


def test_the_adapters_gradients_are_the_base_weights_times_the_factors():
    """dB = s dW A^T and dA = s B^T dW for the same float64 dW: each written gradient is one rounding of its float64
    value, so |dB - s dW' A^T| <= ulp(dB) / 2 + s |dW - dW'| |A|^T with |dW - dW'| <= ulp(dW') / 2 elementwise (dW' the
    written base gradient), and the same for dA; a gradient missing its scaling fails the bound."""
    module, embed, batch = setup(1)
    got = grads(module, embed, [batch])
    A = module.linear.lora_A["a"].weight.detach().double()
    B_ = module.linear.lora_B["a"].weight.detach().double()
    dW = got["linear.base_layer.weight"]
    dW_err = _ulp_half(dW)
    checks = (("linear.lora_B.a.weight", SCALE * dW.double() @ A.T, SCALE * dW_err @ A.abs().T),
              ("linear.lora_A.a.weight", SCALE * B_.T @ dW.double(), SCALE * B_.abs().T @ dW_err))
    for name, want, carried in checks:
        bound = _ulp_half(got[name]) + carried
        assert bool(((got[name].double() - want).abs() <= bound).all()), name
        unscaled = got[name].double() / SCALE  # the planted missing scaling
        assert not bool(((unscaled - want).abs() <= bound).all()), name


@pytest.mark.parametrize("config, reason", [(dict(lora_dropout=0.5), "active dropout"), (dict(lora_bias=True),
                                                                                         "has a bias")])
def test_adapters_that_cannot_be_recorded_are_refused(config, reason):
    module, embed, (x, feats, idx, cot) = setup(2, **config)
    module.train()
    with ExactGradients(), pytest.raises(NotImplementedError, match=reason):
        module(x, embed(feats), idx)


def test_a_patched_h3_model_with_lora_gives_the_same_adapter_gradients_for_every_split_by_sample():
    """A patched tiny MiniMax-H3 model with LoRA on every AdaLN projection (PEFT's default: only the adapters
    train): the adapters' gradients are the same bits for one batch of 4 samples and its micro-batches in any order;
    plain autograd over the same parts changes them."""
    pytest.importorskip("diffusers")
    import adaln_lab
    from adaln_lab.testing import tiny_h3_model

    model, inputs = tiny_h3_model(batch=4)
    inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, target_modules=["adaln_proj.linear", "norm_out.linear"],
                                       init_lora_weights=False), model, adapter_name="a")
    adaln_lab.patch(model)
    lora = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert len(lora) == 6 and all("lora_" in n for n in lora)  # norm_out's and two blocks' A and B
    per_sample = ("hidden_states", "audio_hidden_states", "encoder_hidden_states")
    cot = torch.randn(4, *model(**inputs).sample.shape[1:], generator=torch.Generator().manual_seed(5))

    def run(parts, exact=True):
        model.zero_grad(set_to_none=True)
        acc = ExactGradients()
        for idx in parts:
            part = {k: (v[idx] if k in per_sample else v) for k, v in inputs.items()}
            with acc if exact else torch.enable_grad():
                (model(**part).sample * cot[idx]).sum().backward()
        if exact:
            acc.write()
        return {n: p.grad.clone() for n, p in lora.items()}

    one = run([slice(0, 4)])
    assert all(g.any() for g in one.values())
    splits = ([slice(0, 2), slice(2, 4)], [slice(2, 4), slice(0, 2)], [slice(1, 3), slice(3, 4), slice(0, 1)],
              [slice(k, k + 1) for k in (3, 1, 0, 2)])
    for parts in splits:
        assert same(run(parts), one), parts
    plain = run([slice(0, 4)], exact=False)
    assert any(not same(run(parts, exact=False), plain) for parts in splits)


def test_parts_with_other_adapters_are_refused():
    """The adapters' gradients are formed once at write from every part's table gradient: a part that ran another
    scaling on the same projection would be written with the wrong one, so it raises."""
    module, embed, (x, feats, idx, cot) = setup(3)
    acc = ExactGradients()
    with acc:
        (module(x, embed(feats), idx).float() * cot).sum().backward()
    module.linear.scaling["a"] = 1.0
    with acc, pytest.raises(ValueError, match="other LoRA adapters"):
        module(x, embed(feats), idx)
