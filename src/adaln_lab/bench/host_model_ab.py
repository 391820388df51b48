"""The CPU host model of two trees, alternating, per phase: eager forward and backward apart, in thread CPU time.

`host_model` measures one tree's fwd+bwd in wall time; on a shared CPU the wall time of the same tree moves by
tens of percent between runs. This runs each tree's own host model (its `gpu_stood_in`: the CUDA glue on CPU
tensors, driver calls stood in for) in a process of its own, tree after tree for `--rounds` rounds, and times the
forward and the backward of norm_out's `final_adaln_out` and one block's `block_adaln_path` (identity attn and ff)
with `time.thread_time` (other processes' load does not count), the median of `--calls` calls after 200 warm-up
calls. It prints, per tree and step, the min and the median over the rounds of those medians, in us.

    python3 -m adaln_lab.bench.host_model_ab --base .ab_tree [--rounds 3] [--calls 2000] [--width H D]

A tree is a directory holding src/adaln_lab/ (its host model at src/adaln_lab/bench/host_model.py) or, flat,
adaln_lab/ (at bench/scripts/host_model.py, where trees before the src layout kept it). The default width is small
(H 64, D 32): the Python and autograd share, without the CPU allocations of full-width gradients.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r'''
import runpy, statistics, sys, time, torch
path, H, D, calls = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
stood_in = runpy.run_path(path, run_name="host_model")["gpu_stood_in"]
from adaln_lab import block_adaln_path, final_adaln_out
from adaln_lab.harness.block_report import EPS, make_block
from adaln_lab.harness.inputs import make
torch.set_num_threads(1)
i = make(3, 64, "cpu", H=H, D=D)
n_leaves = [t.detach().clone().requires_grad_(True) for t in i.leaves]
b = make_block(3, 64, "cpu", H=H, D=D)
b_leaves = [t.detach().clone().requires_grad_(True) for t in b.leaves]
x, n1, n2, temb, w, bias = b_leaves
same = lambda h: h
steps = (("norm_out", lambda: final_adaln_out(*n_leaves, i.timestep_indices, backend="cupy", check_indices=False),
          n_leaves, torch.ones_like(i.x)),
         ("block", lambda: block_adaln_path(x, temb, w, bias, n1, n2, b.timestep_indices, same, same, EPS, EPS,
                                            backend="cupy"), b_leaves, torch.ones_like(b.x)))
clock = time.thread_time
with stood_in():
    for name, step, leaves, grad_out in steps:
        forward, backward = [], []
        for k in range(200 + calls):
            for leaf in leaves:
                leaf.grad = None
            t0 = clock(); out = step(); t1 = clock(); out.backward(grad_out); t2 = clock()
            if k >= 200:
                forward.append(t1 - t0); backward.append(t2 - t1)
        print(name, statistics.median(forward) * 1e6, statistics.median(backward) * 1e6)
'''


def tree_layout(tree: Path) -> tuple[Path, Path]:
    """(the directory to put on PYTHONPATH, the tree's host model script) of a tree (module docstring)."""
    if (tree / "src" / "adaln_lab").is_dir():
        return tree / "src", tree / "src" / "adaln_lab" / "bench" / "host_model.py"
    if (tree / "adaln_lab").is_dir():
        return tree, tree / "bench" / "scripts" / "host_model.py"
    raise SystemExit(f"host_model_ab: {tree} holds neither src/adaln_lab/ nor adaln_lab/")


def run_tree(tree: Path, H: int, D: int, calls: int) -> dict:
    """{(step, phase): median us} of one run of a tree's host model in a process of its own."""
    path, script = tree_layout(tree)
    env = dict(os.environ, PYTHONPATH=str(path))
    done = subprocess.run([sys.executable, "-c", CHILD, str(script), str(H), str(D), str(calls)], env=env,
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"host_model_ab: the run of {tree} failed:\n{done.stderr[-3000:]}")
    found = {}
    for line in done.stdout.splitlines():
        name, forward, backward = line.split()
        found[(name, "forward")], found[(name, "backward")] = float(forward), float(backward)
    return found


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, default=Path(".ab_tree"), help="the tree to compare with")
    parser.add_argument("--tree", type=Path, default=Path("."), help="this tree (default: the working directory)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--width", type=int, nargs=2, default=(64, 32), metavar=("H", "D"))
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.calls < 1:
        parser.error(f"--rounds and --calls must be >= 1, got {args.rounds} and {args.calls}")
    trees = {"base": args.base.resolve(), "this": args.tree.resolve()}
    runs = {name: [] for name in trees}
    for round_ in range(1, args.rounds + 1):
        for name, tree in trees.items():
            runs[name].append(run_tree(tree, *args.width, args.calls))
            print(f"round {round_}/{args.rounds}: {name} ({tree}) done", file=sys.stderr, flush=True)
    print(f"host model A/B, thread CPU time, H {args.width[0]} D {args.width[1]}, {args.rounds} rounds of "
          f"{args.calls} calls: min / median of the rounds' medians, us")
    for key in runs["base"][0]:
        cells = []
        for name in trees:
            values = [run[key] for run in runs[name]]
            cells.append(f"{name} {min(values):7.1f} / {statistics.median(values):7.1f}")
        print(f"{key[0]:9s} {key[1]:9s} " + "   ".join(cells))


if __name__ == "__main__":
    main()
