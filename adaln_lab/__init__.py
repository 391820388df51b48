"""adaln_lab: MiniMax-H3's AdaLN (the final output norm and the blocks' modulation), fast, exactly rounded, batch-invariant."""

from .block_module import AdaLNTransformerBlock, block_adaln_path
from .gated_residual import gated_residual
from .gated_residual_norm import gated_residual_norm
from .modulated_rms_norm import modulated_rms_norm
from .modulation_table import modulation_table
from .module import AdaLNOut
from .op import final_adaln_out
from .patch import patch, unpatch
from .reference import golden, replay
from .row_order import row_order
from .validate import validate

__all__ = ["AdaLNOut", "AdaLNTransformerBlock", "block_adaln_path", "final_adaln_out", "gated_residual",
           "gated_residual_norm", "golden",
           "modulated_rms_norm", "modulation_table", "patch", "replay", "row_order", "unpatch", "validate"]
__version__ = "0.1.0"
