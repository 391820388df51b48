"""Latency of any candidate, the copy-bandwidth ceiling, the memory floor and the autograd floor.

Samples: CUDA events around each call on torch's current stream (wall clock on CPU); the median
of `iters` samples after `warmup` calls. Per size and candidate (each function's docstring says
exactly what it times):
- `latency`: `fwd_us`, the forward alone, leaves requiring grad (the graph is dropped unused);
  `fwd_bwd_us` (seed protocol): cloning the five leaves, the forward and a backward with an
  all-ones gradient, all inside the timed region; `fwd_bwd_us_pure`: the forward and the backward
  only, on prepared leaves whose grads are reset.
- `inference_latency`: `fwd_us_inference`, the forward under `torch.inference_mode()`.
- `host_latency`: `host_fwd_us`, `host_fwd_bwd_us`, CPU wall time to issue one call, nothing
  waited on (the host side alone: Python, dispatch, autograd, launches).
- `graph_latency`: `fwd_us_graph`, `fwd_bwd_us_graph`, the same calls captured once in a CUDA
  graph and replayed (the GPU's own time, no host overhead); null plus the reason when the capture
  fails or there is no CUDA.
Once per run, `autograd_floor`: `autograd_floor_us`, `autograd_floor_host_us`, forward+backward of
an identity autograd.Function over the five leaves (what torch autograd alone costs a call).

Spread: `latency`, `inference_latency`, `host_latency` and `graph_latency` take an optional dict
`spread`; given one, they put in it, per figure they return, `summary` of its samples (min, p25,
median, p75, max, n), so a noisy figure shows as such beside its median.
"""

from __future__ import annotations

import statistics
import time

import torch

from .inputs import Inputs


def summary(samples: list[float]) -> dict:
    """{min, p25, median, p75, max, n} of timing samples (us); quartiles by `statistics.quantiles`
    (inclusive method), both equal to the sample for a single one."""
    ordered = sorted(samples)
    p25, _, p75 = statistics.quantiles(ordered, n=4, method="inclusive") if len(ordered) > 1 else ordered * 3
    return {"min": ordered[0], "p25": p25, "median": statistics.median(ordered), "p75": p75, "max": ordered[-1],
            "n": len(ordered)}


def _median(samples: list[float], spread: dict | None, key: str) -> float:
    """The median of `samples`; their `summary` into `spread[key]` when `spread` is a dict."""
    if spread is not None:
        spread[key] = summary(samples)
    return statistics.median(samples)


class _Timer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, step, warmup: int, iters: int, spread: dict | None = None, key: str = "") -> float:
        for _ in range(warmup):
            step()
        samples = []
        for _ in range(iters):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                start.record()
                step()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) * 1e3)
            else:
                t0 = time.perf_counter()
                step()
                samples.append((time.perf_counter() - t0) * 1e6)
        return _median(samples, spread, key)


def latency(fn, inputs: Inputs, warmup: int, iters: int, spread: dict | None = None) -> dict:
    timer = _Timer(inputs.x.device)
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs.leaves]
    idx = inputs.timestep_indices
    ones = torch.ones_like(inputs.x)

    def forward():
        fn(*leaves, idx)

    def fwd_bwd_seed():
        fresh = [t.detach().clone().requires_grad_(True) for t in inputs.leaves]
        fn(*fresh, idx).backward(ones)

    def fwd_bwd_pure():
        for leaf in leaves:
            leaf.grad = None
        fn(*leaves, idx).backward(ones)

    return {"fwd_us": timer(forward, warmup, iters, spread, "fwd_us"),
            "fwd_bwd_us": timer(fwd_bwd_seed, warmup, iters, spread, "fwd_bwd_us"),
            "fwd_bwd_us_pure": timer(fwd_bwd_pure, warmup, iters, spread, "fwd_bwd_us_pure")}


NO_CUDA = "no CUDA"
GRAPH_REPLAYS = 10


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _host_timer(step, warmup: int, iters: int, device: torch.device, prepare=None, spread: dict | None = None,
                key: str = "") -> float:
    """Median CPU wall time (us) of `step()` alone: `prepare()` and a device synchronize run
    before each sample, outside the timed region; `step`'s return value is dropped after the clock
    stops (freeing it is not part of the call)."""
    for _ in range(warmup):
        if prepare is not None:
            prepare()
        step()
    samples = []
    for _ in range(iters):
        if prepare is not None:
            prepare()
        _sync(device)
        t0 = time.perf_counter()
        result = step()
        samples.append((time.perf_counter() - t0) * 1e6)
        del result
    _sync(device)
    return _median(samples, spread, key)


def inference_latency(fn, inputs: Inputs, warmup: int, iters: int, spread: dict | None = None) -> float:
    """`fwd_us_inference`: the forward alone under `torch.inference_mode()`, on the inputs as made
    (no leaf requires grad), timed like `fwd_us`: CUDA events around each call after a synchronize
    (wall clock on CPU), median of `iters` samples after `warmup` calls."""
    timer = _Timer(inputs.x.device)
    with torch.inference_mode():
        return timer(lambda: fn(*inputs.args), warmup, iters, spread, "fwd_us_inference")


def host_latency(fn, inputs: Inputs, warmup: int, iters: int, spread: dict | None = None) -> dict:
    """`host_fwd_us`, `host_fwd_bwd_us`: CPU wall time (time.perf_counter) to issue one call with
    nothing waited on. Each sample synchronizes the device first (outside the clock), then times
    only the Python call: the forward on leaves requiring grad; or the forward and `.backward()`
    with an all-ones gradient (until `.backward()` returns) on prepared leaves whose grads are
    reset to None outside the clock. Median of `iters` samples after `warmup` calls. On a CPU the
    work itself runs inside the call, so these equal the eager times there."""
    device = inputs.x.device
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs.leaves]
    idx = inputs.timestep_indices
    ones = torch.ones_like(inputs.x)

    def reset():
        for leaf in leaves:
            leaf.grad = None

    def fwd_bwd():
        fn(*leaves, idx).backward(ones)

    return {"host_fwd_us": _host_timer(lambda: fn(*leaves, idx), warmup, iters, device, spread=spread,
                                       key="host_fwd_us"),
            "host_fwd_bwd_us": _host_timer(fwd_bwd, warmup, iters, device, prepare=reset, spread=spread,
                                           key="host_fwd_bwd_us")}


def _reason(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:400]


def _graph_time(step, leaves, warmup: int, iters: int, replays: int, spread: dict | None = None,
                key: str = "") -> float:
    """Capture `step` once in a CUDA graph and time replays (us per replay, median of samples)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream (lazy init, autotuning, caches)
        for _ in range(max(warmup, 3)):
            for leaf in leaves:
                leaf.grad = None
            step()  # the output, and its autograd graph, is dropped here
    torch.cuda.current_stream().wait_stream(side)
    for leaf in leaves:
        leaf.grad = None  # grads are made inside the capture; replays rewrite those tensors
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kept = step()
    try:
        for _ in range(warmup):
            graph.replay()
        samples = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(replays):
                graph.replay()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3 / replays)
        return _median(samples, spread, key)
    finally:
        del kept
        for leaf in leaves:
            leaf.grad = None
        graph.reset()


def graph_latency(fn, inputs: Inputs, warmup: int, iters: int, replays: int = GRAPH_REPLAYS,
                  spread: dict | None = None) -> dict:
    """`fwd_us_graph`, `fwd_bwd_us_graph`: the GPU's own time of one call, host overhead removed.

    The forward alone on leaves requiring grad, and separately the forward plus `.backward()` with
    an all-ones gradient on prepared leaves whose `.grad` is None (like `fwd_bwd_us_pure`), each
    captured once in a `torch.cuda.CUDAGraph` after `max(warmup, 3)` eager calls on a side stream
    (their outputs dropped before the capture). For backward the gradients are made inside the
    capture, so every replay rewrites the same `.grad` tensors. After `warmup` replays, each of
    `iters` samples synchronizes, then times `replays` back-to-back replays between two CUDA events
    and divides by `replays`; the value is the median sample, in us.

    A capture that raises (e.g. torch.compile's candidate) gives null for that field and the
    reason in `fwd_us_graph_error` / `fwd_bwd_us_graph_error` (null when the capture worked); with
    no CUDA both fields are null with reason "no CUDA". A failed capture can leave the process's
    CUDA RNG unusable: make every input (`inputs.make`) before calling this.
    """
    out = {"fwd_us_graph": None, "fwd_bwd_us_graph": None,
           "fwd_us_graph_error": NO_CUDA, "fwd_bwd_us_graph_error": NO_CUDA}
    if inputs.x.device.type != "cuda":
        return out
    idx = inputs.timestep_indices
    ones = torch.ones_like(inputs.x)
    for key, backward in (("fwd_us_graph", False), ("fwd_bwd_us_graph", True)):
        leaves = [t.detach().clone().requires_grad_(True) for t in inputs.leaves]

        def step(leaves=leaves, backward=backward):
            result = fn(*leaves, idx)
            if backward:
                result.backward(ones)
                return None
            return result

        try:
            out[key], out[key + "_error"] = _graph_time(step, leaves, warmup, iters, replays, spread, key), None
        except Exception as error:  # noqa: BLE001 - any capture failure is a finding, not a crash
            out[key], out[key + "_error"] = None, _reason(error)
            try:
                torch.cuda.synchronize()
            except Exception:  # noqa: BLE001
                pass
        del leaves
    return out


def identity_floor(leaves: list[torch.Tensor], grad_out: torch.Tensor):
    """(prepare, step) of the autograd floor over `leaves` (tensors requiring grad): `step()` runs forward+backward
    of an identity `torch.autograd.Function` over them, with gradient `grad_out` (leaves[0]'s shape).

    Its forward returns `leaves[0].view_as(leaves[0])` (no GPU work); its backward returns one preallocated
    gradient per leaf (zeros_like, made here), so AccumulateGrad runs once per leaf. `prepare()` moves each leaf's
    `.grad` back into the list the backward returns and sets `.grad = None`: the returned tensors are then
    referenced nowhere else, AccumulateGrad steals them (no copy) and the same storages go round every iteration,
    never written to. `step.leaves` is `leaves`.
    """
    pending: list[torch.Tensor] = []

    class Identity(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            return inputs[0].view_as(inputs[0])

        @staticmethod
        def backward(ctx, dy):
            grads = tuple(pending)
            pending.clear()
            return grads

    for leaf in leaves:
        leaf.grad = torch.zeros_like(leaf)

    def prepare():
        pending[:] = [leaf.grad for leaf in leaves]
        for leaf in leaves:
            leaf.grad = None

    def step():
        Identity.apply(*leaves).backward(grad_out)

    step.leaves = leaves
    return prepare, step


def identity_floor_step(inputs: Inputs):
    """`identity_floor` over copies of the five leaves of `inputs` (requiring grad), gradient all ones."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs.leaves]
    return identity_floor(leaves, torch.ones_like(inputs.x))


def autograd_floor(inputs: Inputs, warmup: int, iters: int) -> dict:
    """`autograd_floor_us`, `autograd_floor_host_us`: what torch autograd alone costs one call.

    forward+backward of an identity autograd.Function over the five leaves (see
    `identity_floor_step`; no GPU work, five AccumulateGrad). `autograd_floor_us` is timed like
    `fwd_bwd_us_pure` (CUDA events around grad reset, forward and backward after a synchronize;
    wall clock on CPU); `autograd_floor_host_us` like `host_fwd_bwd_us` (CPU wall time of the
    forward and `.backward()` alone, the reset outside the clock). Medians of `iters` samples.
    """
    device = inputs.x.device
    prepare, step = identity_floor_step(inputs)

    def pure():
        prepare()
        step()

    return {"autograd_floor_us": _Timer(device)(pure, warmup, iters),
            "autograd_floor_host_us": _host_timer(step, warmup, iters, device, prepare=prepare)}


def copy_bandwidth(device: torch.device, nbytes: int, iters: int = 20) -> float:
    """Device-to-device (or host memory) copy bandwidth in TB/s: (read + write) / median time."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).fill_(1)
    dst = torch.empty_like(src)
    seconds = _Timer(device)(lambda: dst.copy_(src), warmup=3, iters=iters) * 1e-6
    return 2 * nbytes / seconds / 1e12


def floor_bytes(S: int, H: int, D: int, T: int, x_bytes: int = 2, w_bytes: int = 2) -> dict:
    """Bytes of each input read once and each output written once, forward and forward+backward.

    Forward: x, norm_weight, temb, weight, bias, timestep_indices in; out. Backward: dy, x,
    norm_weight, temb, weight, bias, timestep_indices (and the saved rstd) in; dx and the four
    parameter gradients out.
    """
    rows = S * H * x_bytes
    params = H * x_bytes + T * D * 4 + 2 * H * D * w_bytes + 2 * H * w_bytes
    fwd = rows + params + S * 8 + rows
    bwd = 2 * rows + params + S * 8 + S * 4 + rows + params
    return {"fwd_bytes": fwd, "fwd_bwd_bytes": fwd + bwd}


def memory_floor(S: int, H: int, D: int, T: int, copy_TBps: float) -> dict:
    nbytes = floor_bytes(S, H, D, T)
    return {**nbytes, "fwd_us": nbytes["fwd_bytes"] / copy_TBps / 1e6,
            "fwd_bwd_us": nbytes["fwd_bwd_bytes"] / copy_TBps / 1e6}
