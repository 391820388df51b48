"""norm_out (`final_adaln_out`): `op` (the public function and its one autograd node), `launch` (the launch ops
writing caller-allocated outputs); README.md gives the math, the kernels it launches and its limits."""

from .op import final_adaln_out

__all__ = ["final_adaln_out"]
