"""When a patched module runs diffusers' own forward instead of adaln_lab's ops, and says so once.

adaln_lab's modules read their submodules' parameters (`linear.weight`, `norm.weight`, ...) and hand them to the
ops; they never call those submodules. Whatever lives on a submodule acts only when the submodule is called:
torch forward / backward hooks, diffusers' hook registry (layerwise casting, group offloading), accelerate's
hook (cpu / disk offload, device_map), an instance-level forward, a wrapper other than the PEFT LoRA layers that
`adapters` models. Where any of those sits on a submodule the module reads, a call runs diffusers' own forward on the same submodules (so
all of it acts, bit for bit as unpatched), and a one-time `AdaLNFallbackWarning` per module and reason names
what it found. Nothing is run around silently.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn
from torch.nn.modules import module as torch_module

from ..core.library import eager
from ..core.warnings import AdaLNFallbackWarning

_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_GLOBAL_HOOKS = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
                 "_global_backward_hooks")


def foreign(module: nn.Module, plain: dict[str, type | None]) -> str | None:
    """Why `module` cannot read these submodules' parameters itself, or None. `plain` maps each submodule name
    the module reads to the class it must be exactly (None: any class, only hooks are looked for)."""
    for attr in _GLOBAL_HOOKS:
        if getattr(torch_module, attr, None):
            return f"global module hooks are registered ({attr.strip('_')})"
    for name, cls in plain.items():
        sub = module.get_submodule(name)
        if cls is not None and type(sub) is not cls:
            return (f"{name} is a {type(sub).__name__}, not a plain {cls.__name__} (an adapter or wrapper: its own "
                    "forward must run)")
        for attr in _HOOK_DICTS:
            if getattr(sub, attr, None):
                return f"{name} has {attr.strip('_')} registered"
        if getattr(sub, "_diffusers_hook", None) is not None:
            return f"{name} carries a diffusers hook registry (layerwise casting, group offloading, ...)"
        if getattr(sub, "_hf_hook", None) is not None:
            return f"{name} carries an accelerate hook (cpu / disk offload, device_map)"
        if eager() and "forward" in sub.__dict__:  # (the registries above mark theirs)
            return f"{name}'s forward is replaced on the instance"
    return None


def warn_once(module: nn.Module, reason: str) -> None:
    """One AdaLNFallbackWarning per module and reason."""
    seen = module.__dict__.setdefault("_adaln_lab_fallbacks", set())
    if reason not in seen:
        seen.add(reason)
        warnings.warn(f"{type(module).__name__}: {reason}; this module runs diffusers' own forward on its "
                      "submodules (no adaln_lab kernels, diffusers' numerics and gradients)",
                      AdaLNFallbackWarning, stacklevel=3)
