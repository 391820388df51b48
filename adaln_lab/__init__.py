"""adaln_lab: MiniMax-H3's AdaLN (the final output norm and the blocks' modulation), fast, exactly rounded,
batch-invariant.

Public names: the ops (`final_adaln_out`, `modulation_table`, `modulated_rms_norm`, `gated_residual`,
`gated_residual_norm`, `row_order`, `block_adaln_path`), the modules and patcher (`AdaLNOut`,
`AdaLNTransformerBlock`, `patch`, `unpatch`), the reference (`replay`, `golden`) and `validate`.
"""

from .nn import AdaLNOut, AdaLNTransformerBlock, patch, unpatch
from .ops import (block_adaln_path, final_adaln_out, gated_residual, gated_residual_norm, modulated_rms_norm,
                  modulation_table, row_order)
from .core.checks import validate
from .reference import golden, replay

__all__ = ["AdaLNOut", "AdaLNTransformerBlock", "block_adaln_path", "final_adaln_out", "gated_residual",
           "gated_residual_norm", "golden", "modulated_rms_norm", "modulation_table", "patch", "replay",
           "row_order", "unpatch", "validate"]
__version__ = "0.1.0"
