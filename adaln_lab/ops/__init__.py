"""The ops, one folder each (`<op>/op.py`: the public function and its one autograd node; `<op>/launch.py`: the
launch ops writing caller-allocated outputs; `<op>/README.md`: the math, the kernels, the limits), and `block`, one
H3 block's AdaLN composed from them. What they share (the plan, the kernel rule, the launch core, the eager / compiled
helper, the warnings) is in `adaln_lab.core`.
"""

from ..core.warnings import KernelFallbackWarning
from .block import block_adaln_path
from .final_adaln_out import final_adaln_out
from .gated_residual import gated_residual
from .gated_residual_norm import gated_residual_norm
from .modulated_rms_norm import modulated_rms_norm, modulated_rms_norm_and_residual
from .modulation_table import modulation_table
from .row_order import row_order

__all__ = ["KernelFallbackWarning", "block_adaln_path", "final_adaln_out", "gated_residual", "gated_residual_norm",
           "modulated_rms_norm", "modulated_rms_norm_and_residual", "modulation_table", "row_order"]
