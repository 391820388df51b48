"""Modules for diffusers models: `AdaLNOut` (norm_out), `AdaLNTransformerBlock` (a block), `patch` / `unpatch`.

The only layer that imports diffusers (through `upstream`, on demand, never at `import adaln_lab`).
"""

from .adaln_out import AdaLNOut, AdaLNOutFallbackWarning
from .block import AdaLNTransformerBlock
from .fallback import AdaLNFallbackWarning
from .fsdp import fsdp2_shard
from .patch import NothingToPatchWarning, patch, unpatch

__all__ = ["AdaLNFallbackWarning", "AdaLNOut", "AdaLNOutFallbackWarning", "AdaLNTransformerBlock", "fsdp2_shard",
           "NothingToPatchWarning", "patch", "unpatch"]
