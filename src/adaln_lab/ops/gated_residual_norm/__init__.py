"""An H3 block's first gated residual and second modulated RMSNorm as one op (`gated_residual_norm`): `op` (the
public function and its one autograd node), `launch` (the launch ops writing caller-allocated outputs); README.md
gives the math, the kernels and the limits."""

from .op import gated_residual_norm

__all__ = ["gated_residual_norm"]
