"""Where an eager call and a compiled one part: the one module that asks `torch.compiler.is_compiling()`.

- `library_op(name, mutates_args=...)`: a torch.library custom op whose body writes outputs the caller
  allocated (so its fake is a no-op: nothing for torch.compile to trace into), returned as a plain function that
  calls the body directly in eager code (the dispatcher's fixed cost skipped) and the custom op while
  torch.compile traces (an opaque node in the graph). Either way the body runs with its first tensor's CUDA device
  current, and the caller's current device is back after (a block on cuda:1 run while cuda:0 is current leaves
  cuda:0 current). Every op's one `autograd.Function` calls these, in eager and
  compiled code alike. A mutated argument takes no default (TypeError at registration): torch 2.11's
  ADInplaceOrView kernel indexes the mutated arguments by position without filling defaults, and dynamo drops an
  argument equal to its default, so every caller passes each one.
- `apply(function, *args)`: `function.apply(*args)` through the C++ apply where nothing needs the Python layer of
  `torch.autograd.Function.apply` (its default-argument binding and functorch's dead-wrapper unwrap, about 2 us a
  call): in eager code without a functorch transform. While tracing, and under a transform, `Function.apply`.
- `eager()`: whether the call runs eagerly (host values may be read, warnings raised), not under tracing.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable

import torch

_compiling = torch.compiler.is_compiling
_transforms_active = torch._C._are_functorch_transforms_active
_c_apply = torch._C._FunctionBase.__dict__["apply"]  # the C++ apply, called as _c_apply(cls, *args)
# torch's current CUDA device index, without torch.cuda.current_device's lazy-init check (asked only holding a CUDA
# tensor, so CUDA is initialised)
_get_device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)


def eager() -> bool:
    """True in eager code; False while torch.compile traces (no host reads, no warnings there)."""
    return not _compiling()


def library_op(name: str, *, mutates_args: Iterable[str], device_types: str | Iterable[str] | None = None
               ) -> Callable[[Callable], Callable]:
    """Decorator: `fn` (returning None, writing the tensors named in mutates_args) as the custom op `name`, with
    a no-op fake; the returned function calls `fn` in eager code and the op's overload under torch.compile.
    The custom op itself is the returned function's `op` (for `torch.library.opcheck`)."""

    mutated = tuple(mutates_args)

    def register(fn: Callable) -> Callable:
        parameters = inspect.signature(fn).parameters
        unknown = [n for n in mutated if n not in parameters]
        if unknown:
            raise TypeError(f"{name}: mutates_args names no argument of {fn.__name__}: {unknown}")
        defaulted = [n for n in mutated if parameters[n].default is not inspect.Parameter.empty]
        if defaulted:
            raise TypeError(f"{name}: mutated arguments take no default (every caller passes them), got {defaulted}")
        kept = _on_its_device(fn)
        op = torch.library.custom_op(name, kept, mutates_args=mutated, device_types=device_types)
        op.register_fake(_no_output)
        overload = op._opoverload  # dynamo inlines a plain function calling an OpOverload, also inside a Function

        @functools.wraps(fn)
        def call(*args):
            if _compiling():
                return overload(*args)
            first = args[0]
            if first.is_cuda and first.get_device() != _get_device():  # another device: bound around the body
                return kept(*args)
            return fn(*args)

        call.op = op
        call.body = fn  # for a launch body calling another from inside (past the switch, on its device)
        return call

    return register


def _on_its_device(fn: Callable) -> Callable:
    """fn run with its first tensor argument's CUDA device current (the custom op's body: the dispatcher binds no
    device for a Python custom op)."""

    @functools.wraps(fn)
    def on_its_device(first, *args):
        if not first.is_cuda or first.get_device() == _get_device():
            return fn(first, *args)
        with torch.cuda.device(first.device):
            return fn(first, *args)

    return on_its_device


def _no_output(*args) -> None:
    return None


def apply(function: type[torch.autograd.Function], *args):
    """function.apply(*args), through the C++ apply where nothing needs Function.apply's Python layer."""
    if _compiling() or _transforms_active():
        return function.apply(*args)
    return _c_apply(function, *args)
