"""The ops, one file each: validation, dispatch (torch | cupy | numba), custom op + fake, autograd, lean eager path.

`support` holds the one rule for what the kernels take (and `KernelFallbackWarning`, raised where CUDA inputs go to
the torch code), `checks` the shared argument checks, `autocast` what fp32 parameters become under autocast.
"""

from .block_adaln import block_adaln_path
from .final_adaln_out import final_adaln_out
from .gated_residual import gated_residual
from .gated_residual_norm import gated_residual_norm
from .modulated_rms_norm import modulated_rms_norm, modulated_rms_norm_and_residual
from .modulation_table import modulation_table
from .row_order import row_order
from ..core.support import KernelFallbackWarning

__all__ = ["KernelFallbackWarning", "block_adaln_path", "final_adaln_out", "gated_residual", "gated_residual_norm", "modulated_rms_norm",
           "modulated_rms_norm_and_residual", "modulation_table", "row_order"]
