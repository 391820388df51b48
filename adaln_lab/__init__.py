"""adaln_lab: the final AdaLN output of diffusion transformers, fast, exactly rounded, batch-invariant."""

from .module import AdaLNOut
from .op import final_adaln_out
from .patch import patch, unpatch
from .reference import golden, replay
from .validate import validate

__all__ = ["AdaLNOut", "final_adaln_out", "golden", "patch", "replay", "unpatch", "validate"]
__version__ = "0.1.0"
