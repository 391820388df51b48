"""`adaln_lab.ops.eager.apply`: the ops' eager Functions through the C++ apply give Function.apply's outputs and
gradients, and Function.apply itself runs wherever its Python layer matters (torch.compile, functorch transforms)."""

import pytest
import torch

from adaln_lab.ops import eager
from adaln_lab.ops.modulated_rms_norm import ModulatedRMSNorm


class Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x * factor

    @staticmethod
    def backward(ctx, dy):
        return dy * ctx.factor, None


def _norm_inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 16, generator=g).bfloat16().requires_grad_(True)
    norm_weight = (1 + 0.1 * torch.randn(16, generator=g)).bfloat16().requires_grad_(True)
    shift, scale = (torch.randn(3, 16, generator=g).requires_grad_(True) for _ in range(2))
    return x, norm_weight, shift, scale, torch.tensor([0, 2, 1, 1, 0])


def test_the_c_apply_gives_function_applys_outputs_and_gradients():
    results = []
    for apply in (lambda f, *a: f.apply(*a), eager.apply):
        leaves = _norm_inputs()
        out = apply(ModulatedRMSNorm, *leaves, 1e-5, torch.bfloat16, False)
        out.float().square().sum().backward()
        results.append([out.detach()] + [t.grad for t in leaves[:4]])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_function_apply_runs_under_a_functorch_transform_and_not_in_plain_eager(monkeypatch):
    calls = []
    original = Scale.apply.__func__

    def counted(cls, *args):
        calls.append(cls)
        return original(cls, *args)

    monkeypatch.setattr(Scale, "apply", classmethod(counted))
    x = torch.randn(4, requires_grad=True)
    eager.apply(Scale, x, 3.0).sum().backward()
    assert calls == [] and torch.equal(x.grad, torch.full((4,), 3.0))
    with pytest.raises(RuntimeError):  # functorch needs setup_context; reaching Function.apply is what is checked
        torch.func.grad(lambda t: eager.apply(Scale, t, 3.0).sum())(torch.randn(4))
    assert calls == [Scale]
