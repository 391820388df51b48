"""An H3 block's gated residual (`gated_residual`): `op` (the public function and its one autograd node), `launch`
(the launch ops writing caller-allocated outputs); README.md gives the math, the kernels and the limits."""

from .op import gated_residual

__all__ = ["gated_residual"]
