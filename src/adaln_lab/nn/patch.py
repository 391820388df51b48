"""`patch` / `unpatch`: swap diffusers' MiniMax-H3 AdaLN modules of a model for adaln_lab's and back.

Parts: "norm_out" swaps every `MiniMaxH3AdaLayerNormOut` for `AdaLNOut`; "blocks" every
`MiniMaxH3TransformerBlock` for `AdaLNTransformerBlock` (its AdaLN on adaln_lab's ops, its attention and
feed-forward unchanged). Both work in place on any `nn.Module` tree, share the swapped modules'
submodules (so parameters, state-dict keys, devices and dtypes are untouched) and return the qualified
names they swapped. diffusers is imported inside these functions only, never at `import adaln_lab`.

Hooks: a module to swap that itself carries forward/backward hooks, a diffusers hook registry
(`_diffusers_hook`: context parallelism, layerwise casting, group offloading) or an accelerate hook
(`_hf_hook`) is refused with an error instead of being swapped, since the swap would drop the hook (patch
first, then enable such features: the replacement keeps the name and forward signature they key on). Hooks
and adapter layers on its submodules stay: the swapped module shares those submodules; PEFT LoRA layers on the
projections run on its ops (`adaln_lab.nn.adapters`), anything else makes it run diffusers' own forward while
it is there, with a one-time warning (`adaln_lab.nn.fallback`).
"""

from __future__ import annotations

import warnings

import torch.nn as nn

from ..core.warnings import NothingToPatchWarning
from .adaln_out import AdaLNOut, check_options, submodules
from .block import AdaLNTransformerBlock, check_submodules
from .block import check_options as check_block_options
from .upstream import diffusers_class

PARTS = ("norm_out", "blocks")
LOOKED_FOR = {"norm_out": ("MiniMaxH3AdaLayerNormOut", AdaLNOut),
              "blocks": ("MiniMaxH3TransformerBlock", AdaLNTransformerBlock)}  # part: (diffusers class, ours)


def _check_model(function: str, model) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"adaln_lab.{function}: model must be a torch.nn.Module (say a diffusers "
                        f"MiniMaxH3Transformer3DModel), got {type(model).__name__}")


def _parts(parts) -> tuple[str, ...]:
    parts = (parts,) if isinstance(parts, str) else tuple(parts)
    if not parts or any(p not in PARTS for p in parts):
        raise ValueError(f"parts must be a non-empty collection of {PARTS}, got {parts!r}")
    return tuple(p for p in PARTS if p in parts)


def _refuse_hooks(name: str, module: nn.Module) -> None:
    """Hooks on the module to swap itself would be dropped with it: refused. Hooks on its submodules stay (the
    swapped module shares them, and runs diffusers' forward while they are there: `fallback`)."""
    where = name or "<root>"
    for attr in ("_diffusers_hook", "_hf_hook"):
        if getattr(module, attr, None) is not None:
            raise ValueError(f"{where} carries a {attr} (diffusers/accelerate hooks: offloading, layerwise casting, "
                             "context parallelism...); swapping the module would drop it. Patch before enabling "
                             "those features.")
    for attr in ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks"):
        if getattr(module, attr, None):
            raise ValueError(f"{where} has {attr[1:]} registered; swapping the module would drop them. Patch "
                             "before registering hooks.")


def _targets(model: nn.Module, match) -> list[tuple[str, nn.Module]]:
    targets = [(name, module) for name, module in model.named_modules(remove_duplicate=False) if match(module)]
    if any(name == "" for name, _ in targets):
        raise ValueError(f"model is itself a {type(model).__name__}; it cannot be swapped in place "
                         "(use from_diffusers / to_diffusers of AdaLNOut or AdaLNTransformerBlock)")
    return targets


def _swap(model: nn.Module, match, build) -> list[str]:
    """Replace every submodule of `model` for which `match(module)` holds by `build(module)`, in place.

    A module reachable under several names is built once and set under each of them; the root itself
    cannot be replaced in place (ValueError). Returns the qualified names replaced, in `named_modules` order.
    """
    targets = _targets(model, match)
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


def patch(model: nn.Module, *, parts=("norm_out", "blocks"), backend: str = "auto", table_backend: str = "cuda") -> list[str]:
    """Swap diffusers' MiniMax-H3 AdaLN modules inside `model` for adaln_lab's, in place.

    Args:
        parts: which modules: "norm_out" (every `MiniMaxH3AdaLayerNormOut` -> `AdaLNOut.from_diffusers`),
            "blocks" (every `MiniMaxH3TransformerBlock` -> `AdaLNTransformerBlock.from_diffusers`), or both:
            `parts=("norm_out", "blocks")` (the default).
        backend: "auto", "torch" or "cupy" (see `AdaLNOut`; the blocks take the same names, "cupy" refusing
            inputs their CUDA kernels cannot take, where "auto" falls back to torch code).
        table_backend: "cuda" (kernels_cu's fixed-order table) or "torch" (F.linear), for every swapped module.

    Returns the qualified names swapped, norm_out's first, then the blocks' (e.g. `["norm_out",
    "transformer_blocks.0", ...]` for a `MiniMaxH3Transformer3DModel`); modules already swapped are left
    as they are (patching twice returns `[]`). Nothing is swapped when an option or a module is refused.
    A model holding none of the modules looked for (nor their swapped versions: say an `nn.Linear`, or a
    model of another architecture) returns `[]` with a `NothingToPatchWarning` naming the classes.
    To change the backend of a patched model, set `backend` / `table_backend` on its swapped modules or
    `unpatch` and patch again.
    """
    _check_model("patch", model)
    parts = _parts(parts)
    check_options(backend, table_backend)  # everything is checked before anything is swapped
    swaps = []  # (match, what from_diffusers checks, build)
    if "norm_out" in parts:
        cls = diffusers_class("MiniMaxH3AdaLayerNormOut")
        swaps.append((lambda m: type(m) is cls, submodules,
                      lambda m: AdaLNOut.from_diffusers(m, backend=backend, table_backend=table_backend)))
    if "blocks" in parts:
        block_cls = diffusers_class("MiniMaxH3TransformerBlock")
        check_block_options(backend, table_backend)
        swaps.append((lambda m: type(m) is block_cls, check_submodules,
                      lambda m: AdaLNTransformerBlock.from_diffusers(m, backend=backend,
                                                                    table_backend=table_backend)))
    for match, check, _ in swaps:
        for name, module in _targets(model, match):
            _refuse_hooks(name, module)
            check(module)
    swapped = [name for match, _, build in swaps for name in _swap(model, match, build)]
    if not swapped and not any(isinstance(m, LOOKED_FOR[p][1]) for p in parts for m in model.modules()):
        looked_for = " or ".join(LOOKED_FOR[p][0] for p in parts)
        warnings.warn(f"patch swapped nothing: {type(model).__name__} holds no {looked_for} (diffusers' "
                      f"MiniMax-H3 modules, parts={parts}), nor any already swapped", NothingToPatchWarning,
                      stacklevel=2)
    return swapped


def unpatch(model: nn.Module, *, parts=PARTS) -> list[str]:
    """Put diffusers' modules back in place of adaln_lab's (`AdaLNOut` -> `MiniMaxH3AdaLayerNormOut`,
    `AdaLNTransformerBlock` -> `MiniMaxH3TransformerBlock`, sharing their submodules), for the given parts
    (default both). Returns the qualified names swapped back, norm_out's first."""
    _check_model("unpatch", model)
    parts = _parts(parts)
    diffusers_class("MiniMaxH3AdaLayerNormOut")
    names = []
    if "norm_out" in parts:
        names += _swap(model, lambda m: isinstance(m, AdaLNOut), lambda m: m.to_diffusers())
    if "blocks" in parts:
        names += _swap(model, lambda m: isinstance(m, AdaLNTransformerBlock), lambda m: m.to_diffusers())
    return names
