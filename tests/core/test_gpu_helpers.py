"""The GPU tests' launch helpers (tests/core/test_tensors.py, which test_row_order.py and test_modulation_table.py
use too) call their launch ops with arguments the ops' signatures take, checked on the CPU: each op is replaced by
a stub that binds the call to the op's own signature, so a changed signature fails here and not first on a GPU
(at bb26dd2 thirteen GPU tests called two backward ops without the `partials` argument they had come to require).
"""

import inspect

import pytest
import torch

from adaln_lab.ops.gated_residual import launch as residual_launch
from adaln_lab.ops.gated_residual_norm import launch as pair_launch
from adaln_lab.ops.modulated_rms_norm import launch as norm_launch
from adaln_lab.ops.modulation_table import launch as table_launch

from . import test_tensors as helpers

H, D, R, S = 64, 32, 6, 10


@pytest.fixture
def bound(monkeypatch):
    """{op name: the arguments of its last call, bound to its signature} with every launch op stubbed."""
    calls = {}
    for module in (residual_launch, pair_launch, norm_launch, table_launch):
        for name in ("forward", "backward"):
            op = getattr(module, name)
            signature = inspect.signature(op)

            def stub(*args, signature=signature, key=f"{module.__name__}.{name}", **kwargs):
                calls[key] = signature.bind(*args, **kwargs)  # TypeError on a missing or an extra argument

            monkeypatch.setattr(module, name, stub)
    return calls


def test_every_helper_binds_to_its_ops_signature(bound):
    g = torch.Generator().manual_seed(0)
    x, y, dy, d_res = (torch.randn(S, H, generator=g).bfloat16() for _ in range(4))
    idx = torch.randint(0, R, (S,), generator=g)
    table = torch.randn(R, 3 * H, generator=g)
    nw = torch.randn(H, generator=g).bfloat16()
    shift, scale, gate = table[:, :H], table[:, H:2 * H], table[:, 2 * H:]
    temb, weight, bias = torch.randn(3, D), torch.randn(18 * H, D).bfloat16(), torch.zeros(18 * H).bfloat16()
    _, rstd = helpers.norm_fwd(x, nw, shift, scale, idx, 1e-5)
    helpers.norm_bwd(dy, x, nw, shift, scale, idx, rstd, d_residual=d_res)
    helpers.gr_fwd(x, gate, y, idx)
    helpers.gr_bwd(dy, gate, y, idx)
    helpers.grn_fwd(x, gate, y, idx, nw, shift, scale, 1e-5)
    helpers.table_fwd(temb, weight, bias)
    helpers.table_bwd(torch.randn(3, 18 * H), temb, weight)
    assert len(bound) == 7, sorted(bound)


def test_the_stub_catches_a_call_missing_an_argument(bound):
    """The planted counter-example: the call the helpers made at bb26dd2 (no `partials`)."""
    x = torch.zeros(S, H).bfloat16()
    with pytest.raises(TypeError, match="partials"):
        norm_launch.backward(x, x, x[0], x[:R].float(), x[:R].float(), torch.zeros(S, dtype=torch.long),
                             torch.zeros(S), None, None, "cupy", x, x[0], torch.zeros(R, 2 * H), 0)
