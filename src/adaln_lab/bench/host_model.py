"""The eager path's own host cost, measured on a CPU: what the Python and autograd around the kernels cost.

The CUDA glue runs on CPU tensors with the GPU stood in for: each kernel is a real `launchers.Kernel` (its
argument block written as on a GPU) whose driver call is a no-op, `bind` and the current stream are no-ops,
and the kernel rule's "is it on CUDA" answers yes. Everything else is the shipped code: the checks, the
kernel rule, the plans, the autograd Functions, the allocations (CPU ones here) and the engine. What this
leaves out is what the GPU host adds per call: the driver's launch (about 6-8 us each on the lent hosts,
bench/NOTES.md v17) and the CUDA caching allocator instead of the CPU's. What it adds: the torch ops around the
kernels (the block's bf16 casts of its table chunks, autograd's cat of the chunks' gradients) compute on the CPU
here, where a GPU host only launches them. Read its figures as the Python and autograd share, against the
identity floor on the same CPU; the GPU host's own figures come from adaln_lab.bench.host_breakdown on the device.

Per step (norm_out's `final_adaln_out`, one H3 block's `block_adaln_path` with identity attn and ff) it prints
the median host time of forward+backward over `--calls` samples (grads reset outside the clock), the identity
autograd floor over the same leaves, the launches and allocations per call, and with --profile the cProfile
of our functions by own time.

    python3 -m adaln_lab.bench.host_model [--rows 64] [--calls 300] [--profile] [--width H D]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import io
import pstats
import statistics
import time
from types import SimpleNamespace

import torch

from adaln_lab import block_adaln_path, final_adaln_out
from adaln_lab.core import launchers, tensors
from adaln_lab.harness.block_report import EPS, make_block
from adaln_lab.harness.latency import identity_floor
from adaln_lab.harness.inputs import D_REAL, H_REAL, make
from adaln_lab.core import support

LAUNCHES: list[str] = []


@functools.lru_cache(maxsize=None)  # as launchers.kernels
def _stub_kernels(device_index, plan) -> dict:
    kernels = {}
    for name in launchers.SIGNATURES:
        kernel = launchers.Kernel(name, SimpleNamespace(kernel=SimpleNamespace(ptr=0)), programmatic=True)
        kernel._launch = lambda *args, name=name: LAUNCHES.append(name)  # the driver call, stood in for
        kernels[name] = kernel
    return kernels


def _stub_launch_ex():
    return lambda config, function, params, extra: LAUNCHES.append("programmatic") or 0


@contextlib.contextmanager
def gpu_stood_in():
    """The CUDA glue on CPU tensors: driver calls, device binding and stream lookup are no-ops."""
    saved = [(launchers, "kernels", launchers.kernels), (launchers, "bind", launchers.bind),
             (launchers, "_launch_kernel_ex", launchers._launch_kernel_ex),
             (tensors, "current_stream", tensors.current_stream), (support, "_not_cuda", support._not_cuda),
             (tensors, "gpu", tensors.gpu),
             (torch.cuda, "current_device", torch.cuda.current_device)]
    if hasattr(tensors, "current_device"):  # the glue's own device lookup, where it has one
        saved.append((tensors, "current_device", tensors.current_device))
        tensors.current_device = lambda: -1  # what get_device() gives a CPU tensor
    launchers.kernels, launchers.bind = _stub_kernels, (lambda device: None)
    launchers._launch_kernel_ex, tensors.current_stream = _stub_launch_ex, (lambda device: 0)
    support._not_cuda, torch.cuda.current_device = (lambda name, t: None), (lambda: None)
    tensors.gpu = lambda t: True
    tensors.context.cache_clear()
    _stub_kernels.cache_clear()
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
        tensors.context.cache_clear()


def host_us(step, prepare, calls: int, warmup: int = 20) -> float:
    """Median wall time (us) of step(), prepare() run before each sample outside the clock."""
    samples = []
    for i in range(warmup + calls):
        prepare()
        t0 = time.perf_counter()
        step()
        if i >= warmup:
            samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


def allocations(step, leaves) -> int:
    """Allocations of one step: aten::empty and aten::empty_strided calls (those inside aten ops included;
    empty_like is not counted apart, it allocates through empty_strided)."""
    from torch.profiler import ProfilerActivity, profile

    for leaf in leaves:
        leaf.grad = None
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return sum(e.count for e in prof.key_averages() if e.key in ("aten::empty", "aten::empty_strided"))


def reset(leaves) -> None:
    for leaf in leaves:
        leaf.grad = None


def own_time_profile(step, leaves, calls: int) -> str:
    prof = cProfile.Profile()
    for _ in range(calls):
        for leaf in leaves:
            leaf.grad = None
        prof.enable()
        step()
        prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(30)
    return out.getvalue()


def passthrough(h):
    return h


def measure(rows: int = 64, calls: int = 300, profile: bool = False, out=print, H: int = H_REAL,
            D: int = D_REAL) -> dict:
    """{step: {"us", "floor_us", "launches", "allocations"}} for norm_out and one block (module docstring)."""
    torch.set_num_threads(1)
    i = make(3, rows, "cpu", H=H, D=D)
    leaves = [t.detach().clone().requires_grad_(True) for t in i.leaves]
    idx, ones = i.timestep_indices, torch.ones_like(i.x)
    b = make_block(3, rows, "cpu", H=H, D=D)
    b_leaves = [t.detach().clone().requires_grad_(True) for t in b.leaves]
    x, n1, n2, temb, w, bias = b_leaves
    b_ones = torch.ones_like(b.x)

    def norm_out():
        final_adaln_out(*leaves, idx, backend="cupy", check_indices=False).backward(ones)

    def block():
        block_adaln_path(x, temb, w, bias, n1, n2, b.timestep_indices, passthrough, passthrough, EPS, EPS,
                         backend="cupy").backward(b_ones)

    out(f"host model on this CPU ({torch.__version__}), {rows} rows of H {H}, D {D}, median of {calls}; driver calls "
        "stood in for")
    found = {}
    with gpu_stood_in():
        for name, step, step_leaves, grad_out in (("final_adaln_out", norm_out, leaves, ones),
                                                  ("block_adaln_path", block, b_leaves, b_ones)):
            LAUNCHES.clear()
            step()
            launches = len(LAUNCHES)
            ours = host_us(step, lambda: reset(step_leaves), calls)
            base = host_us(*reversed(identity_floor(step_leaves, grad_out)), calls)
            reset(step_leaves)
            found[name] = {"us": ours, "floor_us": base, "launches": launches,
                           "allocations": allocations(step, step_leaves)}
            out(f"{name}: fwd+bwd {ours:.1f} us, identity floor {base:.1f} us ({ours / base:.2f}x, "
                f"+{ours - base:.1f} us); {launches} launches, {found[name]['allocations']} allocations per call")
            if profile:
                out(own_time_profile(step, step_leaves, calls))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--width", type=int, nargs=2, default=(H_REAL, D_REAL), metavar=("H", "D"),
                        help="hidden and embedding width (default MiniMax-H3's); smaller ones shrink the CPU work of "
                             "the torch ops, not the Python")
    args = parser.parse_args()
    measure(args.rows, args.calls, args.profile, H=args.width[0], D=args.width[1])


if __name__ == "__main__":
    main()
