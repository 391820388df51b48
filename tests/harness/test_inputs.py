"""`adaln_lab.harness.inputs`: the seed protocol's inputs (shared parameters, per-seed rows and indices)."""

import torch

from adaln_lab.harness.inputs import make

SHAPE = {"H": 32, "D": 16, "T": 3}


def test_inputs_follow_the_seed_protocol():
    a, b = make(3, 6, **SHAPE), make(4, 6, **SHAPE)
    assert not torch.equal(a.x, b.x)
    for name in ("norm_weight", "temb", "weight", "bias"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    g = torch.Generator().manual_seed(3)
    torch.randint(0, 3, (6,), generator=g)
    assert torch.equal(a.timestep_indices, torch.randint(0, 3, (6,), generator=g))
    expected_x = (torch.randn(6, 32, generator=torch.Generator().manual_seed(3018)) * 2).to(torch.bfloat16)
    assert torch.equal(a.x, expected_x)
