"""Shared by the tests of adaln_lab.lab: the tiny shape, the replay as a candidate, an ulp nudge."""

import torch

from adaln_lab.harness.candidates import Named
from adaln_lab.reference import replay

SHAPE = {"H": 64, "D": 32, "T": 3}
CPU = torch.device("cpu")
REPLAY = Named("replay", "adaln_lab.reference.replay", replay)


def bump(t: torch.Tensor, index, ulps: int) -> torch.Tensor:
    """t (bf16) with the elements at flat `index` moved `ulps` units in the last place away from 0."""
    bits = t.clone().view(torch.int16).flatten()
    bits[index] += ulps
    return bits.view(torch.bfloat16).view(t.shape)
