"""`adaln_lab.core.library.apply`: the ops' autograd Functions through the C++ apply give Function.apply's outputs
and gradients, and Function.apply itself runs wherever its Python layer matters (torch.compile, functorch
transforms); `core.library.eager` tells eager code from tracing."""

import pytest
import torch

from adaln_lab.core import library
from adaln_lab.ops.modulated_rms_norm.op import ModulatedRMSNorm


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


def _norm(apply, leaves):
    """ModulatedRMSNorm's out on the torch route (no order, no residual, no block table, no row tables)."""
    return apply(ModulatedRMSNorm, *leaves, 1e-5, torch.bfloat16, "torch", None, False, None, 0, None, None)[0]


def test_the_c_apply_gives_function_applys_outputs_and_gradients():
    results = []
    for apply in (lambda f, *a: f.apply(*a), library.apply):
        leaves = _norm_inputs()
        out = _norm(apply, leaves)
        out.float().square().sum().backward()
        results.append([out.detach()] + [t.grad for t in leaves[:4]])
    for a, b in zip(*results):
        assert torch.equal(a, b)
    assert all(g is not None for g in results[0][1:])


def test_function_apply_runs_under_a_functorch_transform_and_not_in_plain_eager(monkeypatch):
    calls = []
    original = Scale.apply.__func__

    def counted(cls, *args):
        calls.append(cls)
        return original(cls, *args)

    monkeypatch.setattr(Scale, "apply", classmethod(counted))
    x = torch.randn(4, requires_grad=True)
    library.apply(Scale, x, 3.0).sum().backward()
    assert calls == [] and torch.equal(x.grad, torch.full((4,), 3.0))
    with pytest.raises(RuntimeError):  # functorch needs setup_context; reaching Function.apply is what is checked
        torch.func.grad(lambda t: library.apply(Scale, t, 3.0).sum())(torch.randn(4))
    assert calls == [Scale]


def test_apply_traces_under_torch_compile_and_eager_tells_tracing_from_eager_code():
    """Under torch.compile(fullgraph=True) library.apply is traced without a graph break (a break raises), its node
    differentiable; `library.eager()` is False while tracing and True in eager code; the compiled call gives the
    eager output and gradient bits."""
    torch._dynamo.reset()
    seen = []

    def fn(x):
        seen.append(library.eager())
        return library.apply(Scale, x, 3.0) * x

    results = []
    for call in (fn, torch.compile(fn, fullgraph=True, backend="aot_eager")):
        x = torch.arange(1.0, 5.0).requires_grad_(True)
        out = call(x)
        out.sum().backward()
        results.append((out.detach(), x.grad))
    assert seen == [True, False]
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    assert torch.equal(results[1][1], 6 * torch.arange(1.0, 5.0))
