"""PEFT LoRA on the AdaLN projections (`adaln_lab.nn.adapters`): the adapted table is PEFT's, row by row and
T-invariant; the patched model gives the LoRA parameters their gradients (patch before or after
`add_adapter`; merged, disabled, two adapters), within the derived bound of the unpatched model's, repeatably;
what it does not model runs diffusers' forward with a warning.

The bound: the patched and the unpatched model compute the same function with other rounding points, so each
is some distance from the float64 model (same weights and adapters). The patched one is claimed no less
accurate than the unpatched one; then, by the triangle inequality, the two differ by at most twice the
unpatched model's own distance from float64 (L2 per tensor). A dropped adapter term breaks it by orders of
magnitude (checked below).
"""

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import adaln_lab
from adaln_lab import modulation_table
from adaln_lab.nn import AdaLNFallbackWarning, adapters

from .test_patch import ALL_PARTS, SMALL, SMALL_ROWS, forward_backward, make_inputs, make_model, upstreams

peft = pytest.importorskip("peft", reason="the test extra brings peft")
from peft import LoraConfig, inject_adapter_in_model  # noqa: E402

TARGETS = ["adaln_proj.linear", "norm_out.linear"]
pytestmark = pytest.mark.filterwarnings("ignore:Already found a `peft_config` attribute")


def lora_config(r=4, alpha=8, **more):
    return LoraConfig(r=r, lora_alpha=alpha, target_modules=TARGETS, init_lora_weights=False, **more)


class Holder(nn.Module):
    def __init__(self, linear):
        super().__init__()
        self.norm_out = nn.Module()
        self.norm_out.linear = linear


def lora_layer(seed, D=16, N=64, adapter_dtype=torch.bfloat16, second=False):
    torch.manual_seed(seed)
    holder = Holder(nn.Linear(D, N).to(torch.bfloat16))
    inject_adapter_in_model(lora_config(), holder, adapter_name="a")
    if second:
        inject_adapter_in_model(lora_config(r=2, alpha=6), holder, adapter_name="b")
    layer = holder.norm_out.linear
    if second:
        layer.set_adapter(["a", "b"])
    for name, p in layer.named_parameters():
        if "lora_" in name:
            p.data = p.data.to(adapter_dtype)
    return layer


@pytest.mark.parametrize("adapter_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("second", [False, True])
def test_adapted_table_rows_are_peft_rows_bitwise_and_t_invariant(adapter_dtype, second):
    """Row t of the adapted table is PEFT's layer on that one row, bit for bit (CPU), and the same bits whether
    the table has 1 or 4 rows."""
    layer = lora_layer(0, adapter_dtype=adapter_dtype, second=second)
    base, names = adapters.layout(layer)
    assert base is layer.base_layer and names == (("a", "b") if second else ("a",))
    temb = torch.randn(4, 16)
    with torch.no_grad():
        table = adapters.adapted_table(modulation_table(temb, base.weight, base.bias), temb, layer, names)
        for t in range(4):
            peft_row = layer(F.silu(temb[t:t + 1]).to(torch.bfloat16))
            assert peft_row.dtype == torch.bfloat16
            assert torch.equal(table[t:t + 1], peft_row.float()), t
            one = temb[t:t + 1]
            assert torch.equal(adapters.adapted_table(modulation_table(one, base.weight, base.bias), one, layer,
                                                      names), table[t:t + 1]), t


def test_layout_merged_and_disabled_add_nothing_and_refusals_say_why():
    layer = lora_layer(1)
    layer.merge()
    assert adapters.layout(layer) == (layer.base_layer, ())
    layer.unmerge()
    layer.enable_adapters(False)
    assert adapters.layout(layer) == (layer.base_layer, ())
    layer.merge()
    assert "disabled while merged" in adapters.layout(layer)
    assert "neither a plain nn.Linear" in adapters.layout(nn.Sequential(nn.Linear(4, 4)))
    hooked = lora_layer(2)
    hooked.lora_A["a"].register_forward_hook(lambda *args: None)
    assert "lora_A.a has forward_hooks" in adapters.layout(hooked)
    holder = Holder(nn.Linear(16, 64))
    inject_adapter_in_model(lora_config(use_dora=True), holder, adapter_name="d")
    assert "DoRA" in adapters.layout(holder.norm_out.linear)


def models_with_lora(seed, precision, order, config=None, device="cpu"):
    """(unpatched model with LoRA, patched model with the same LoRA weights, float64 model): `order` "patch" patches
    first and then adds the adapter, "adapter" the other way round."""
    kwargs = {} if config is None else {"config": config}
    base = make_model(seed, precision, **kwargs)
    ref = copy.deepcopy(base)
    ref.add_adapter(lora_config())
    patched = copy.deepcopy(base)
    if order == "patch":
        assert adaln_lab.patch(patched, parts=ALL_PARTS)
        patched.add_adapter(lora_config())
    else:
        patched.add_adapter(lora_config())
        assert adaln_lab.patch(patched, parts=ALL_PARTS)
    patched.load_state_dict(ref.state_dict())
    gold = copy.deepcopy(ref).double()
    return ref.to(device), patched.to(device), gold.to(device)


def lora_keys(model):
    return [n for n, _ in model.named_parameters() if "lora_" in n and ("adaln_proj" in n or "norm_out" in n)]


def run_three(ref, patched, gold, inputs, dys):
    want = forward_backward(ref, inputs, dys)
    with warnings.catch_warnings():
        warnings.simplefilter("error", AdaLNFallbackWarning)  # the kernels' path, never diffusers' forward
        got = forward_backward(patched, inputs, dys)
    wide = {k: (v.double() if v.is_floating_point() else v) for k, v in inputs.items()}
    exact = forward_backward(gold, wide, tuple(d.double() for d in dys))
    return want, got, exact


def within_twice_the_noise(got, want, exact) -> bool:
    got, want, exact = got.double(), want.double(), exact.double()
    return (got - want).norm().item() <= 2 * (want - exact).norm().item()


@pytest.mark.parametrize("order", ["patch", "adapter"])
@pytest.mark.parametrize("precision", ["mixed", "fp32"])
def test_patched_model_lora_gradients_flow_within_the_bound_and_repeat(order, precision):
    ref, patched, gold = models_with_lora(40, precision, order)
    inputs = make_inputs(41)
    dys = upstreams(42, ref, inputs)
    want, got, exact = run_three(ref, patched, gold, inputs, dys)
    keys = lora_keys(patched)
    assert len(keys) == 2 * 3  # lora_A and lora_B of two blocks' adaln_proj and of norm_out
    for out in (0, 1):
        assert within_twice_the_noise(got[out], want[out], exact[out])
    for key in keys:
        assert got[2][key] is not None and torch.isfinite(got[2][key]).all(), key
        assert within_twice_the_noise(got[2][key], want[2][key], exact[2][key]), key
    again = forward_backward(patched, inputs, dys)[2]
    assert all(torch.equal(again[k], got[2][k]) for k in keys)


def test_the_bound_catches_a_dropped_adapter_term(monkeypatch):
    ref, patched, gold = models_with_lora(43, "mixed", "patch")
    inputs = make_inputs(44)
    dys = upstreams(45, ref, inputs)
    monkeypatch.setattr(adapters, "adapted_table", lambda table, *args: table)
    want, got, exact = run_three(ref, patched, gold, inputs, dys)
    block_key = next(k for k in lora_keys(patched) if "adaln_proj" in k)
    assert not within_twice_the_noise(got[0], want[0], exact[0])
    assert got[2][block_key] is None


def test_merged_disabled_and_two_adapters_as_unpatched():
    ref, patched, gold = models_with_lora(46, "mixed", "patch")
    inputs = make_inputs(47)
    dys = upstreams(48, ref, inputs)
    for model in (ref, patched, gold):
        model.add_adapter(lora_config(r=2, alpha=6), adapter_name="second")
        model.set_adapter(["default", "second"])
    patched.load_state_dict(ref.state_dict())
    gold.load_state_dict({k: v.double() for k, v in ref.state_dict().items()})
    want, got, exact = run_three(ref, patched, gold, inputs, dys)
    assert within_twice_the_noise(got[0], want[0], exact[0])
    for key in lora_keys(patched):
        assert "second" in key or "default" in key
        assert within_twice_the_noise(got[2][key], want[2][key], exact[2][key]), key
    for model in (ref, patched):
        model.disable_adapters()
    with torch.no_grad():
        assert torch.equal(patched(**inputs).sample, ref(**inputs).sample)
    for model in (ref, patched):
        model.enable_adapters()
        for module in model.modules():
            if hasattr(module, "merge") and hasattr(module, "lora_A"):
                module.merge()
    with torch.no_grad():
        assert torch.equal(patched(**inputs).sample, ref(**inputs).sample)


# ---------------------------------------------------------------- GPU (H200) ----------------------------------


@pytest.mark.gpu
def test_cuda_adapted_table_rows_are_t_invariant():
    layer = lora_layer(3, D=256, N=18 * 256).cuda()
    base, names = adapters.layout(layer)
    temb = torch.randn(5, 256, device="cuda")
    with torch.no_grad():
        table = adapters.adapted_table(modulation_table(temb, base.weight, base.bias), temb, layer, names)
        for t in range(5):
            one = temb[t:t + 1]
            assert torch.equal(adapters.adapted_table(modulation_table(one, base.weight, base.bias), one, layer,
                                                      names), table[t:t + 1]), t


@pytest.mark.gpu
def test_cuda_patched_model_lora_within_the_bound_and_repeating_bitwise():
    """The SMALL model, bf16 with the checkpoint's fp32 modules, on the kernels: forward and LoRA gradients within
    twice the unpatched model's distance from float64, every LoRA gradient twice bit for bit (attention on SDPA's
    math backend, whose backward has no atomics)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    ref, patched, gold = models_with_lora(50, "mixed", "patch", config=SMALL, device="cuda")
    inputs = make_inputs(51, SMALL_ROWS, SMALL, device="cuda")
    dys = upstreams(52, ref, inputs)
    with sdpa_kernel(SDPBackend.MATH):
        want, got, exact = run_three(ref, patched, gold, inputs, dys)
        again = forward_backward(patched, inputs, dys)[2]
    for out in (0, 1):
        assert within_twice_the_noise(got[out], want[out], exact[out])
    keys = lora_keys(patched)
    assert len(keys) == 6
    for key in keys:
        assert got[2][key] is not None, key
        assert within_twice_the_noise(got[2][key], want[2][key], exact[2][key]), key
        assert torch.equal(again[key], got[2][key]), key
