"""Where ExactGradients.write spends its host time in the full-width train step (cProfile, torch.profiler)."""

# Issue 41 (NOTES v66, v67): the train step's exact variant spends 11-13 ms after the backward in write, almost all
# of it host time. This builds train_step's model (autocast, fp32 masters, or --precision bf16), runs its exact step
# --warmup times, then profiles its `with`'s end (the parts' fold) and write in --steps more: cProfile's functions
# by own time and by cumulative time (the host's Python and the torch calls it makes, a wait for the device counted
# where it happens), then torch.profiler's operators and CUDA runtime calls by their own CPU time
# (cudaStreamSynchronize, cudaMemcpyAsync, cudaHostAlloc, cudaMalloc: which calls wait or allocate). With --no-wait,
# core.transfers.NO_WAIT 1.
#
#     python3 bench/tools/write_profile.py [--precision autocast|bf16] [--no-wait] [--steps 3] > write_profile.txt

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

import adaln_lab
from adaln_lab.bench import train_step
from adaln_lab.core import transfers
from adaln_lab.nn import ExactGradients


def exact_step(model, inputs, dys, autocast: bool):
    """The exact step up to its `with`'s end: its accumulator, still open (`finish` ends it and writes), the
    backward done on the device."""
    model.zero_grad(set_to_none=True)
    acc = ExactGradients()
    acc.__enter__()
    with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
        out = model(**inputs)
    torch.autograd.backward([out.sample, out.audio_sample], [d.to(out.sample.dtype) for d in dys])
    torch.cuda.synchronize()  # the fold's and write's own waits only: the backward's queue drained first
    return acc


def finish(acc) -> None:
    """The `with`'s end (the parts' fold) and write."""
    acc.__exit__(None, None, None)
    acc.write()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--precision", choices=("autocast", "bf16"), default="autocast")
    parser.add_argument("--no-wait", action="store_true")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=35)
    args = parser.parse_args()
    transfers.NO_WAIT = int(args.no_wait)
    autocast = args.precision == "autocast"
    model = train_step.build(args.precision)
    inputs, dys = train_step.make_inputs(model)
    adaln_lab.patch(model)
    for _ in range(args.warmup):
        finish(exact_step(model, inputs, dys, autocast))
    torch.cuda.synchronize()
    walls, profiler = [], cProfile.Profile()
    for _ in range(args.steps):
        acc = exact_step(model, inputs, dys, autocast)
        start = time.perf_counter()
        profiler.enable()
        finish(acc)
        torch.cuda.synchronize()
        profiler.disable()
        walls.append(1e3 * (time.perf_counter() - start))
    print(f"the with's end and write (cProfile on), the backward drained first: "
          f"{', '.join(f'{w:.2f}' for w in walls)} ms "
          f"(NO_WAIT {transfers.NO_WAIT}, {args.precision})")
    for key in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(args.top)
        print(f"\n== cProfile by {key}\n{text.getvalue()}")
    acc = exact_step(model, inputs, dys, autocast)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        finish(acc)
        torch.cuda.synchronize()
    print("\n== torch.profiler, one fold and write, by own CPU time")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=60))
    print("\n== torch.profiler, one fold and write, by device time")
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=20, max_name_column_width=60))


if __name__ == "__main__":
    main()
