"""An H3 block's modulated RMSNorm (`modulated_rms_norm`, `modulated_rms_norm_and_residual`): `op` (the public
functions and their one autograd node), `launch` (the launch ops writing caller-allocated outputs); README.md gives
the math, the kernels and the limits."""

from .op import modulated_rms_norm, modulated_rms_norm_and_residual

__all__ = ["modulated_rms_norm", "modulated_rms_norm_and_residual"]
