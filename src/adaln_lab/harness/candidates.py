"""The implementations the report knows by name, each as a plain callable.

A candidate is any callable `fn(x, norm_weight, temb, weight, bias, timestep_indices) -> out`
that torch autograd can differentiate (shapes as in `adaln_lab.final_adaln_out`, eps = 1e-5).
Users can hand the harness their own callable; the names below are the built-in ones.

Each built-in says what it really runs on the device it is built for: `source` goes into the
report, and `warning` (when set) is printed by the report because the row is not what its name
suggests (the adaln_lab row on a CPU runs the torch replay; the diffusers row without diffusers
installed is the replay too).

CUDA only (`resolve` refuses them on another device, naming them): torch_compile, and adaln_lab_numba
(backend "numba": the Numba-CUDA twin of the kernels; off CUDA it runs only in numba's CUDA
simulator, thousands of threads a second, far too slow for any report).
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Callable

import torch

from ..reference.final_adaln_out import replay

EPS = 1e-5
REPLAY_ROW = "diffusers_replay"
Candidate = Callable[..., torch.Tensor]


@dataclass
class Named:
    """A candidate: its row `name`, what it runs (`source`), the callable, a warning to print, and
    `replay_of`: the library whose code it stands in for (set on adaln_lab's replay of diffusers)."""

    name: str
    source: str
    fn: Candidate
    warning: str | None = None
    replay_of: str | None = None


def diffusers_missing() -> str | None:
    """None when diffusers' MiniMax-H3 module imports, else why not (one line: the exception's type and text)."""
    try:
        import diffusers  # noqa: F401 - first: a None in sys.modules raises here, as a missing package does
        importlib.import_module("diffusers.models.transformers.transformer_minimax_h3")
    except Exception as error:  # noqa: BLE001 - missing, too old or broken: all mean "no diffusers rows"
        text = str(error).strip().splitlines()
        return f"{type(error).__name__}: {text[0] if text else ''}"[:200]
    return None


@functools.lru_cache(maxsize=None)
def _diffusers_module(H: int, D: int):
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3AdaLayerNormOut

    with torch.device("meta"):
        return MiniMaxH3AdaLayerNormOut(H, D, eps=EPS)


def diffusers_candidate(device: str | torch.device | None = None) -> Named:
    """The real diffusers module through `torch.func.functional_call`; without diffusers, adaln_lab's replay
    of it in a row named `REPLAY_ROW` ("diffusers_replay"), said in its source and warning too."""
    why = diffusers_missing()
    if why is not None:
        return Named(REPLAY_ROW, f"diffusers REPLAYED by adaln_lab (diffusers not importable: {why}): "
                     "adaln_lab.reference.replay, the op-for-op replay of MiniMaxH3AdaLayerNormOut",
                     lambda *a: replay(*a, eps=EPS), replay_of="diffusers",
                     warning=f"diffusers is not importable ({why}): the row '{REPLAY_ROW}' is adaln_lab's "
                             "op-for-op replay of diffusers' module, not diffusers; "
                             "pip install 'diffusers>=0.42,<0.43' for the real one")
    import diffusers

    def call(x, norm_weight, temb, weight, bias, timestep_indices):
        module = _diffusers_module(x.shape[-1], temb.shape[-1])
        params = {"norm.weight": norm_weight, "linear.weight": weight, "linear.bias": bias}
        return torch.func.functional_call(module, params, (x, temb, timestep_indices))

    return Named("diffusers", f"diffusers {diffusers.__version__} MiniMaxH3AdaLayerNormOut "
                 "(real module via torch.func.functional_call)", call)


def torch_compile_candidate(device: str | torch.device | None = None) -> Named:
    compiled = torch.compile(functools.partial(replay, eps=EPS))
    return Named("torch_compile", "torch.compile (default mode) of the op-for-op replay", compiled)


def adaln_lab_candidate(table_backend: str = "cuda", device: str | torch.device | None = "cuda") -> Named:
    """`final_adaln_out` with backend "auto": the CUDA kernels for CUDA tensors, else the torch replay.

    `device` is where the candidate will be called; its `source` (and, off CUDA, `warning`) say
    which of the two runs there.
    """
    from ..ops.final_adaln_out import final_adaln_out

    def call(x, norm_weight, temb, weight, bias, timestep_indices):
        return final_adaln_out(x, norm_weight, temb, weight, bias, timestep_indices, EPS,
                               backend="auto", table_backend=table_backend, check_indices=False)

    if device is not None and torch.device(device).type != "cuda":
        kind = torch.device(device).type
        return Named("adaln_lab", f"adaln_lab final_adaln_out (backend auto -> torch on {kind}: runs the "
                     "op-for-op torch replay, NOT the CUDA kernels; table_backend unused; check_indices=False)",
                     call, warning=f"the 'adaln_lab' row on {kind} runs the torch replay (backend auto falls "
                                   "back to torch off CUDA), not the CUDA kernels")
    return Named("adaln_lab", f"adaln_lab final_adaln_out (backend auto -> cupy CUDA kernels, "
                 f"table_backend={table_backend}, check_indices=False)", call)


def adaln_lab_numba_candidate(table_backend: str = "cuda", device: str | torch.device | None = "cuda") -> Named:
    """`final_adaln_out` with backend "numba": the Numba-CUDA twin of kernels_cu (adaln_lab.ops.final_adaln_out.twin.forward,
    adaln_lab.ops.final_adaln_out.twin.backward) through numba-cuda, on torch's current stream.

    Raises ValueError (naming the candidate) where it cannot run: numba-cuda not importable, or
    `device` not CUDA while numba is not in its simulator, or CUDA while it is (the simulator takes
    CPU tensors only). Under the simulator (NUMBA_ENABLE_CUDASIM=1) a CPU candidate is built, with a
    warning, for tests; `resolve` refuses it off CUDA all the same.
    """
    from ..ops.final_adaln_out import final_adaln_out

    kind = torch.device(device).type if device is not None else "cuda"
    try:
        from ..ops.final_adaln_out.twin.op import simulating

        simulated = simulating()
    except Exception as error:  # numba-cuda missing or broken: say so before any row is measured
        raise ValueError(f"candidate 'adaln_lab_numba' needs numba-cuda (the test extra): "
                         f"{type(error).__name__}: {error}") from error
    if simulated != (kind != "cuda"):
        raise ValueError("candidate 'adaln_lab_numba' runs on CUDA only (use --device cuda)" if not simulated else
                         "candidate 'adaln_lab_numba': numba's CUDA simulator is on (NUMBA_ENABLE_CUDASIM=1), "
                         "which takes CPU tensors only; unset it to run on the GPU")

    def call(x, norm_weight, temb, weight, bias, timestep_indices):
        return final_adaln_out(x, norm_weight, temb, weight, bias, timestep_indices, EPS,
                               backend="numba", table_backend=table_backend, check_indices=False)

    source = (f"adaln_lab final_adaln_out (backend numba: the Numba-CUDA twin of the kernels_cu kernels, "
              f"adaln_lab.ops.final_adaln_out.twin.forward / adaln_lab.ops.final_adaln_out.twin.backward, through numba-cuda on torch's stream, "
              f"table_backend={table_backend}, check_indices=False)")
    if simulated:
        return Named("adaln_lab_numba", source.replace("through numba-cuda on torch's stream",
                                                       f"in numba's CUDA simulator on {kind}"), call,
                     warning="the 'adaln_lab_numba' row runs numba's CUDA simulator on the CPU (tests only)")
    return Named("adaln_lab_numba", source, call)


BUILTIN = {
    "diffusers": diffusers_candidate,
    "torch_compile": torch_compile_candidate,
    "adaln_lab": adaln_lab_candidate,
    "adaln_lab_numba": adaln_lab_numba_candidate,
}
CUDA_ONLY = ("torch_compile", "adaln_lab_numba")


def callable_name(fn) -> str:
    """`module:qualname` of a callable (a functools.partial names its function), else its repr."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if qualname is None and not isinstance(fn, type):  # an instance with __call__: name its class
        module, qualname = type(fn).__module__, type(fn).__qualname__
    return f"{module}:{qualname}" if module and qualname else repr(fn)


def from_callable(fn, name: str | None = None) -> Named:
    """A user's callable `fn(x, norm_weight, temb, weight, bias, timestep_indices) -> out` as a candidate,
    named `name` or `module:qualname`. Raises TypeError when `fn` is not callable."""
    if not callable(fn):
        raise TypeError(f"a candidate must be callable or the name of a built-in ({', '.join(BUILTIN)}); "
                        f"got {type(fn).__name__} {fn!r:.80}")
    label = name or callable_name(fn)
    return Named(label, f"user callable {callable_name(fn)}", fn)


def load_candidate(spec: str) -> Named:
    """The candidate `pkg.mod:fn` (or `pkg.mod:Class.attr`): import the module, take the attribute.

    Raises ValueError naming `spec` when it is not `module:attribute`, the module cannot be imported,
    the attribute is missing or it is not callable.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--candidate {spec!r}: expected module:attribute, e.g. my_pkg.kernels:my_adaln")
    try:
        target = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"--candidate {spec!r}: cannot import module {module_name!r}: "
                         f"{type(error).__name__}: {error}") from error
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ValueError(f"--candidate {spec!r}: {getattr(target, '__name__', module_name)!r} has no "
                             f"attribute {part!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"--candidate {spec!r}: {attr!r} is a {type(target).__name__}, not callable")
    return Named(spec, f"user callable {spec}", target)


def resolve(candidates: list, device: torch.device) -> list[Named]:
    """Build the candidates: a built-in name (a GPU-only one, CUDA_ONLY, asked for off CUDA is an
    error naming it), a `Named`, or any callable (`from_callable`: named module:qualname). Rows
    with the same name get `#2`, `#3` appended."""
    out = []
    for candidate in candidates:
        if isinstance(candidate, Named):
            built = candidate
        elif isinstance(candidate, str):
            if candidate not in BUILTIN:
                raise ValueError(f"unknown candidate {candidate!r}; known: {', '.join(BUILTIN)} "
                                 "(or pass a callable, or module:function)")
            if candidate in CUDA_ONLY and device.type != "cuda":
                raise ValueError(f"candidate {candidate!r} runs on CUDA only (use --device cuda)")
            built = BUILTIN[candidate](device=device)
        else:
            built = from_callable(candidate)
        taken = {c.name for c in out}
        if built.name in taken:
            k = 2
            while f"{built.name}#{k}" in taken:
                k += 1
            built = Named(f"{built.name}#{k}", built.source, built.fn, built.warning, built.replay_of)
        out.append(built)
    return out
