"""Modules for diffusers models: `AdaLNOut` (norm_out), `AdaLNTransformerBlock` (a block), `patch` / `unpatch`.

The only layer that imports diffusers (through `upstream`, on demand, never at `import adaln_lab`).
"""

from ..core.warnings import AdaLNFallbackWarning, AdaLNOutFallbackWarning, NothingToPatchWarning
from .adaln_out import AdaLNOut
from .exact import ExactGradients
from .block import AdaLNTransformerBlock
from .fsdp import fsdp2_shard
from .patch import patch, unpatch

__all__ = ["AdaLNFallbackWarning", "AdaLNOut", "AdaLNOutFallbackWarning", "AdaLNTransformerBlock", "ExactGradients",
           "fsdp2_shard", "NothingToPatchWarning", "patch", "unpatch"]
