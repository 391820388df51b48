"""`core.library`: what torch.compile sees of an op's one autograd node — its launch ops, and no warning of its own."""

import warnings

import pytest
import torch

from adaln_lab.core.library import eager
from adaln_lab.ops.block import block_adaln_path
from adaln_lab.ops.final_adaln_out.op import FinalAdaLNOut
from adaln_lab.testing import make_inputs


def test_compiling_the_ops_warns_nothing():
    """A route decision or a workspace size traced through a cached function makes dynamo warn the user (a
    `functools.lru_cache`-wrapped call); the ops trace without one."""
    torch._dynamo.reset()
    inputs = make_inputs(16, H=64, D=32, T=3)
    args = [inputs[n] for n in ("x", "norm_weight", "temb", "weight", "bias", "timestep_indices")]
    g = torch.Generator().manual_seed(0)
    S, H, T, D = 8, 16, 2, 8
    x, temb = torch.randn(S, H, generator=g), torch.randn(T, D, generator=g)
    w, b = torch.randn(18 * H, D, generator=g), torch.randn(18 * H, generator=g)
    n1, n2, ri = torch.randn(H, generator=g), torch.randn(H, generator=g), torch.randint(0, 3 * T, (S,), generator=g)

    def norm_out(*a):
        return FinalAdaLNOut.apply(*a, 1e-5, "torch", "cuda")

    def block(x):
        return block_adaln_path(x, temb, w, b, n1, n2, ri, lambda h: h, lambda h: h)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert torch.equal(torch.compile(norm_out, fullgraph=True)(*args), norm_out(*args))
        assert torch.equal(torch.compile(block, fullgraph=True)(x), block(x))
    ours = [str(w.message) for w in caught if "lru_cache" in str(w.message) or "adaln_lab" in w.filename]
    assert ours == []  # (torch's own deprecation notes while dynamo imports its parts are not ours)


def test_eager_is_false_only_while_tracing():
    seen = []

    def f(x):
        seen.append(eager())
        return x + 1

    assert eager()
    torch.compile(f, fullgraph=True)(torch.ones(2))
    assert seen == [False]


def test_a_mutated_argument_with_a_default_is_refused():
    """torch 2.11 indexes a custom op's mutated arguments by position without filling defaults (and dynamo drops an
    argument equal to its default): library_op refuses a default on one at registration, naming it."""
    from adaln_lab.core.library import library_op

    def body(x: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor | None = None) -> None:
        out.copy_(x)

    with pytest.raises(TypeError, match="scratch"):
        library_op("adaln_lab_test::defaulted_scratch", mutates_args=("out", "scratch"))(body)


def test_mutates_args_naming_no_argument_is_refused():
    from adaln_lab.core.library import library_op

    def body(x: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(x)

    with pytest.raises(TypeError, match="outt"):
        library_op("adaln_lab_test::misnamed", mutates_args=(a for a in ("outt",)))(body)
