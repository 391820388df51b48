"""`patch` / `unpatch`: swap diffusers' `MiniMaxH3AdaLayerNormOut` modules of a model for `AdaLNOut` and back.

Both work in place on any `nn.Module` tree, share the swapped modules' `norm` and `linear` submodules
(so parameters, state-dict keys, devices and dtypes are untouched) and return the qualified names they
swapped. diffusers is imported inside these functions only, never at `import adaln_lab`.

Hooks: a module carrying forward/backward hooks, a diffusers hook registry (`_diffusers_hook`: context
parallelism, layerwise casting, group offloading) or an accelerate hook (`_hf_hook`) is refused with
an error instead of being swapped, since the swap would silently drop the hook. Patch first, then
enable such features: the replacement keeps the name (`norm_out`) and forward signature they key on.
"""

from __future__ import annotations

import torch.nn as nn

from .module import AdaLNOut, _check_options

_DIFFUSERS_MODULE = "diffusers.models.transformers.transformer_minimax_h3"


def _diffusers_class() -> type:
    """diffusers' `MiniMaxH3AdaLayerNormOut`, imported now (a clear ImportError when it is missing)."""
    try:
        import diffusers  # noqa: F401
    except ImportError as err:
        raise ImportError("adaln_lab.patch / unpatch need diffusers (MiniMax-H3 is in diffusers 0.42): "
                          "pip install 'diffusers>=0.42,<0.43', or install adaln_lab with its [test] extra") from err
    try:
        from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3AdaLayerNormOut
    except ImportError as err:
        raise ImportError(f"diffusers {getattr(diffusers, '__version__', '?')} has no MiniMaxH3AdaLayerNormOut "
                          f"({_DIFFUSERS_MODULE}); adaln_lab targets diffusers 0.42") from err
    return MiniMaxH3AdaLayerNormOut


def _refuse_hooks(name: str, module: nn.Module) -> None:
    for sub_name, sub in module.named_modules():
        where = f"{name}.{sub_name}" if sub_name else (name or "<root>")
        for attr in ("_diffusers_hook", "_hf_hook"):
            if getattr(sub, attr, None) is not None:
                raise ValueError(f"{where} carries a {attr} (diffusers/accelerate hooks: offloading, layerwise "
                                 "casting, context parallelism...); swapping the module would drop it. Patch "
                                 "before enabling those features.")
    for attr in ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks"):
        if getattr(module, attr, None):
            raise ValueError(f"{name or '<root>'} has {attr[1:]} registered; swapping the module would drop "
                             "them. Patch before registering hooks.")


def _swap(model: nn.Module, match, build) -> list[str]:
    """Replace every submodule of `model` for which `match(module)` holds by `build(module)`, in place.

    A module reachable under several names is built once and set under each of them; the root itself
    cannot be replaced in place (ValueError). Returns the qualified names replaced, in `named_modules` order.
    """
    targets = [(name, module) for name, module in model.named_modules(remove_duplicate=False) if match(module)]
    if any(name == "" for name, _ in targets):
        raise ValueError(f"model is itself a {type(model).__name__}; it cannot be swapped in place "
                         "(use AdaLNOut.from_diffusers / AdaLNOut.to_diffusers)")
    for name, module in targets:
        _refuse_hooks(name, module)
    built: dict[int, nn.Module] = {}
    for name, module in targets:
        new = built.get(id(module))
        if new is None:
            new = built[id(module)] = build(module)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, new)
    return [name for name, _ in targets]


def patch(model: nn.Module, *, backend: str = "auto", table_backend: str = "cuda") -> list[str]:
    """Swap every diffusers `MiniMaxH3AdaLayerNormOut` inside `model` for `AdaLNOut.from_diffusers`, in place.

    Returns the qualified names swapped (e.g. `["norm_out"]` for a `MiniMaxH3Transformer3DModel`); a
    model with none left (already patched) gives `[]`. To change the backend of a patched model, set
    `module.backend` / `module.table_backend` on its `AdaLNOut` modules or `unpatch` and patch again.
    """
    cls = _diffusers_class()
    _check_options(backend, table_backend)  # before anything is swapped
    return _swap(model, lambda m: type(m) is cls,
                 lambda m: AdaLNOut.from_diffusers(m, backend=backend, table_backend=table_backend))


def unpatch(model: nn.Module) -> list[str]:
    """Put diffusers `MiniMaxH3AdaLayerNormOut` modules back in place of every `AdaLNOut` of `model`
    (sharing their `norm` and `linear`). Returns the qualified names swapped back."""
    _diffusers_class()
    return _swap(model, lambda m: isinstance(m, AdaLNOut), lambda m: m.to_diffusers())
