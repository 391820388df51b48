"""diffusers' MiniMax-H3 classes, imported on demand: the one place adaln_lab imports diffusers."""

from __future__ import annotations

_DIFFUSERS_MODULE = "diffusers.models.transformers.transformer_minimax_h3"


def diffusers_class(name: str) -> type:
    """diffusers' MiniMax-H3 class `name` (`MiniMaxH3AdaLayerNormOut`, `MiniMaxH3TransformerBlock`), imported
    now (a clear ImportError when it is missing)."""
    try:
        import diffusers  # noqa: F401
    except ImportError as err:
        raise ImportError(f"diffusers' {name} was asked for, and diffusers is not installed (patch, unpatch, "
                          "from_diffusers, to_diffusers and testing.tiny_h3_model need diffusers; MiniMax-H3 is in "
                          "diffusers 0.42): pip install 'diffusers>=0.42,<0.43', or install adaln_lab with its [test] "
                          "or [notebooks] extra") from err
    try:
        import importlib

        return getattr(importlib.import_module(_DIFFUSERS_MODULE), name)
    except (ImportError, AttributeError) as err:
        raise ImportError(f"diffusers {getattr(diffusers, '__version__', '?')} has no {name} "
                          f"({_DIFFUSERS_MODULE}); adaln_lab targets diffusers 0.42") from err
