"""adaln_lab: MiniMax-H3's AdaLN (the final output norm and the blocks' modulation), fast, exactly rounded,
batch-invariant.

Public names: the ops (`final_adaln_out`, `modulation_table`, `modulated_rms_norm`, `gated_residual`,
`gated_residual_norm`, `row_order`, `block_adaln_path`), the modules and patcher (`AdaLNOut`,
`AdaLNTransformerBlock`, `patch`, `unpatch`), the reference (`replay`, `golden`) and `validate`.
"""

from .core.checks import validate
from .nn import AdaLNOut, AdaLNTransformerBlock, patch, unpatch
from .ops.block import block_adaln_path
from .ops.final_adaln_out import final_adaln_out
from .ops.gated_residual import gated_residual
from .ops.gated_residual_norm import gated_residual_norm
from .ops.modulated_rms_norm import modulated_rms_norm, modulated_rms_norm_and_residual
from .ops.modulation_table import modulation_table
from .ops.row_order import row_order
from .reference import golden, replay

__all__ = ["AdaLNOut", "AdaLNTransformerBlock", "block_adaln_path", "final_adaln_out", "gated_residual",
           "gated_residual_norm", "golden", "modulated_rms_norm", "modulated_rms_norm_and_residual", "modulation_table", "patch", "replay",
           "row_order", "unpatch", "validate"]
__version__ = "0.1.0"
