"""adaln_lab: the final AdaLN output of diffusion transformers, fast, exactly rounded, batch-invariant."""

from .op import final_adaln_out
from .reference import golden, replay
from .validate import validate

__all__ = ["final_adaln_out", "golden", "replay", "validate"]
__version__ = "0.1.0"
