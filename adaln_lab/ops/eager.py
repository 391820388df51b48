"""`apply(function, *args)`: an eager autograd node's apply without torch.autograd.Function.apply's Python layer.

Before the C++ apply, torch.autograd.Function.apply binds default arguments for setup_context-style Functions and
unwraps functorch's dead wrappers (a generator over every argument): about 2 us per call on a 2-core CPU, paid once
per op per eager call (bench/NOTES.md v14). The ops' Functions are forward(ctx, ...)-style, so where neither
torch.compile (dynamo traces Function.apply) nor a functorch transform is active they take the C++ apply directly
(`torch._C._FunctionBase.apply`, reached through super()); otherwise Function.apply.
"""

from __future__ import annotations

import torch

_transforms_active = torch._C._are_functorch_transforms_active
_compiling = torch.compiler.is_compiling


def apply(function: type[torch.autograd.Function], *args):
    """function.apply(*args), through the C++ apply where nothing needs Function.apply's Python layer."""
    if _compiling() or _transforms_active():
        return function.apply(*args)
    return super(torch.autograd.Function, function).apply(*args)
