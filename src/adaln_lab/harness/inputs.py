"""Inputs of the seed report's protocol, tensor for tensor.

`make(seed, n)` draws every tensor from its own `torch.Generator` on the target device, seeded
`s * 1000 + salt`: x with s = seed and salt 18; norm_weight, temb, weight, bias with s = 1 and
salts 19, 20, 21, 22 (the parameters are the same for every seed). The layout uses a CPU
generator seeded `seed`: first n modality tags in [0, 3) (unused), then n timestep indices in
[0, T). On CUDA these are the very tensors of the seed report.

Shapes: x (n, H) bf16; norm_weight (H,) bf16; temb (T, D) fp32; weight (2H, D) bf16;
bias (2H,) bf16; timestep_indices (n,) int64. Defaults H = 5376, D = 2688, T = 3.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

H_REAL, D_REAL, T_REAL = 5376, 2688, 3
SALT_X, SALT_NORM_WEIGHT, SALT_TEMB, SALT_WEIGHT, SALT_BIAS, SALT_UPSTREAM = 18, 19, 20, 21, 22, 23
PARAMETER_SEED = 1
LEAVES = ("x", "norm_weight", "temb", "weight", "bias")


class CallArgs:
    """`leaves` (the differentiable arguments, in the class's `LEAF_NAMES` order) and `args` (the leaves,
    then `timestep_indices`) of a dataclass holding one call's arguments."""

    LEAF_NAMES: ClassVar[tuple[str, ...]]

    @property
    def leaves(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, name) for name in self.LEAF_NAMES)

    @property
    def args(self) -> tuple[torch.Tensor, ...]:
        return (*self.leaves, self.timestep_indices)


@dataclass
class Inputs(CallArgs):
    """One call's arguments; `leaves` are the five differentiable ones, in `LEAVES` order."""

    LEAF_NAMES: ClassVar[tuple[str, ...]] = LEAVES
    x: torch.Tensor
    norm_weight: torch.Tensor
    temb: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor
    timestep_indices: torch.Tensor

    def rows(self, index: torch.Tensor) -> "Inputs":
        """The same parameters with only the rows `index` (1-D int64) of x and timestep_indices."""
        index = index.to(self.x.device)
        return Inputs(self.x.index_select(0, index), self.norm_weight, self.temb, self.weight, self.bias,
                      self.timestep_indices.index_select(0, index))


def generator(device: torch.device, s: int, salt: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(s * 1000 + salt)


def make(seed: int, n: int, device="cpu", *, H: int = H_REAL, D: int = D_REAL, T: int = T_REAL) -> Inputs:
    """The seed protocol's inputs for `seed` and `n` rows (see module docstring)."""
    device = torch.device(device)

    def randn(*shape, s, salt):
        return torch.randn(*shape, generator=generator(device, s, salt), device=device)

    x = (randn(n, H, s=seed, salt=SALT_X) * 2).to(torch.bfloat16)
    norm_weight = (0.5 + torch.rand(H, generator=generator(device, PARAMETER_SEED, SALT_NORM_WEIGHT),
                                    device=device)).to(torch.bfloat16)
    temb = randn(T, D, s=PARAMETER_SEED, salt=SALT_TEMB)
    weight = (randn(2 * H, D, s=PARAMETER_SEED, salt=SALT_WEIGHT) * D ** -0.5).to(torch.bfloat16)
    bias = (randn(2 * H, s=PARAMETER_SEED, salt=SALT_BIAS) * 0.02).to(torch.bfloat16)
    layout = torch.Generator().manual_seed(seed)
    torch.randint(0, 3, (n,), generator=layout)  # modality tags: drawn to keep the stream, unused
    timestep_indices = torch.randint(0, T, (n,), generator=layout).to(device)
    return Inputs(x, norm_weight, temb, weight, bias, timestep_indices)


def upstream(seed: int, like: torch.Tensor) -> torch.Tensor:
    """Upstream gradient dy = randn in the output dtype, one generator per seed (salt 23).

    Row r of dy depends on the seed and r only, so a row keeps its dy when it is moved between
    batches by `Inputs.rows`-style indexing of the same tensor.
    """
    g = generator(like.device, seed, SALT_UPSTREAM)
    return torch.randn(like.shape, generator=g, device=like.device).to(like.dtype)
