"""Nothing moves in the numbers: this tree's outputs and gradients, bitwise, against an older tree's.

The inputs are the report's and the block report's, made by each tree's own harness:
- norm_out: `adaln_lab.final_adaln_out` (the report's adaln_lab candidate: eps 1e-5, backend "auto",
  check_indices=False; table_backend "cuda", the accuracy rows, and "torch", the forward parity rows) on
  `harness.inputs.make(1, S)`, backward with `harness.inputs.upstream(1, x)`: out, dx and the gradients of
  norm_weight, temb, weight and bias;
- block: `adaln_lab.block_adaln_path(x, temb, weight, bias, norm1_weight, norm2_weight, adaln_indices, attn, ff,
  EPS, EPS)` with the block report's pass-through attention and feed-forward (identity maps) on
  `harness.block_report.make_block(1, S)`, backward with the block report's dy: out and the six leaf gradients;
  where diffusers imports, the block report's own adaln_lab candidate (the module built from diffusers' block)
  on the same inputs too.
Sizes: S = 4097 and 32768 at H 5376, D 2688, T 3 (--quick: the harness's QUICK sizes, H 256, D 128).
The inputs' hashes are compared as well, so a difference in the data is told apart from one in the op.

Each tree runs in its own process (PYTHONPATH = the folder holding the tree's adaln_lab/: TREE/src, or TREE for
a tree of the flat layout before the move to src/; then the entries of this one's that hold no adaln_lab), which
writes {name: sha256 of the tensor's bytes, dtype, shape}; this process compares them and
writes one JSON: both trees' commits, each tensor's verdict, `unequal`, `all_equal`. Exit 0 when every tensor
is bitwise equal, 1 when any differs or is missing, 2 when a tree's process fails.

    python3 -m adaln_lab.bench.compare_trees --old .old_tree --out compare_6b65938.json     (on a GPU)
    python3 -m adaln_lab.bench.compare_trees --old .old_tree --device cpu --quick --out /tmp/compare.json
(on a CPU both trees run their torch code, not the kernels). The runner's `compare` step runs it against `--base`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]  # the checkout holding src/adaln_lab/
SEED = 1                                   # the report's accuracy_seed; the block report's seed
FULL = {"norm_out": {"sizes": (4097, 32768), "shape": {"H": 5376, "D": 2688, "T": 3}},
        "block": {"sizes": (4097, 32768), "shape": {"H": 5376, "D": 2688, "T": 3}}}
QUICK = {"norm_out": {"sizes": (65, 257), "shape": {"H": 256, "D": 128, "T": 3}},       # harness.protocol.QUICK
         "block": {"sizes": (257, 1024), "shape": {"H": 256, "D": 128, "T": 3}}}        # block_report.QUICK_*
NORM_OUT_GRADS = ("x", "norm_weight", "temb", "weight", "bias")
BLOCK_GRADS = ("x", "norm1_weight", "norm2_weight", "temb", "weight", "bias")


# ---- the child: one tree ---------------------------------------------------------------------------

def digest(t) -> dict | None:
    """sha256 of a tensor's bytes (as laid out contiguously), its dtype and shape; None for no tensor."""
    import torch

    if t is None:
        return None
    flat = t.detach().contiguous().reshape(-1)
    raw = flat.view(torch.uint8) if flat.numel() else flat.to(torch.uint8)
    return {"sha256": hashlib.sha256(raw.cpu().numpy().tobytes()).hexdigest(), "dtype": str(t.dtype).replace(
        "torch.", ""), "shape": list(t.shape)}


def _generator_fn(inputs_module):
    """harness.inputs' generator(device, s, salt): public in newer trees, `_generator` in older ones."""
    return getattr(inputs_module, "generator", None) or getattr(inputs_module, "_generator")


def norm_out_case(out: dict, device, sizes, shape) -> None:
    import torch

    import adaln_lab
    from adaln_lab.harness import candidates
    from adaln_lab.harness.inputs import make, upstream

    for S in sizes:
        inputs = make(SEED, S, device, **shape)
        dy = upstream(SEED, inputs.x)
        for name in (*NORM_OUT_GRADS, "timestep_indices"):
            out[f"norm_out/{S}/input/{name}"] = digest(getattr(inputs, name))
        out[f"norm_out/{S}/input/dy"] = digest(dy)
        for table_backend in ("cuda", "torch"):
            leaves = [t.detach().clone().requires_grad_(True) for t in inputs.leaves]
            y = adaln_lab.final_adaln_out(*leaves, inputs.timestep_indices, candidates.EPS, backend="auto",
                                          table_backend=table_backend, check_indices=False)
            y.backward(dy)
            if device.type == "cuda":
                torch.cuda.synchronize()
            key = f"norm_out/{S}/table_{table_backend}"
            out[f"{key}/out"] = digest(y)
            for name, leaf in zip(NORM_OUT_GRADS, leaves):
                out[f"{key}/grad_{name}"] = digest(leaf.grad)
        del inputs, dy, leaves, y
        if device.type == "cuda":
            torch.cuda.empty_cache()


def identity(h):
    """The block report's PassThrough as a plain map: attention and feed-forward return their input."""
    return h


def block_case(out: dict, device, sizes, shape, notes: dict) -> None:
    import torch

    import adaln_lab
    from adaln_lab.harness import block_report as br
    from adaln_lab.harness import inputs as inputs_module

    generator = _generator_fn(inputs_module)
    try:
        module_fn = br.CANDIDATES["adaln_lab"][1](shape["H"], shape["D"])  # needs diffusers
    except Exception as error:  # diffusers absent: the module case is left out, and the JSON says so
        module_fn = None
        notes["block_module"] = f"left out: {type(error).__name__}: {str(error)[:200]}"
    for S in sizes:
        b = br.make_block(SEED, S, device, **shape)
        dy = torch.randn(b.x.shape, generator=generator(device, SEED, br.SALTS["dy"]), device=device,
                         dtype=torch.float32).to(torch.bfloat16)
        for name in (*BLOCK_GRADS, "timestep_indices"):
            out[f"block/{S}/input/{'adaln_indices' if name == 'timestep_indices' else name}"] = digest(getattr(b, name))
        out[f"block/{S}/input/dy"] = digest(dy)
        leaves = dict(zip(BLOCK_GRADS, (t.detach().clone().requires_grad_(True) for t in b.leaves)))
        y = adaln_lab.block_adaln_path(leaves["x"], leaves["temb"], leaves["weight"], leaves["bias"],
                                       leaves["norm1_weight"], leaves["norm2_weight"], b.timestep_indices,
                                       identity, identity, br.EPS, br.EPS)
        y.backward(dy)
        if device.type == "cuda":
            torch.cuda.synchronize()
        out[f"block/{S}/path/out"] = digest(y)
        for name, leaf in leaves.items():
            out[f"block/{S}/path/grad_{name}"] = digest(leaf.grad)
        if module_fn is not None:
            y_m, grads = br.forward_backward(module_fn, b, dy)
            out[f"block/{S}/module/out"] = digest(y_m)
            for name in BLOCK_GRADS:
                out[f"block/{S}/module/grad_{name}"] = digest(grads[name])
            del y_m, grads
        del b, dy, leaves, y
        if device.type == "cuda":
            torch.cuda.empty_cache()


def child(args) -> int:
    import torch

    import adaln_lab

    device = torch.device(args.device)
    plan = QUICK if args.quick else FULL
    start = time.perf_counter()
    hashes, notes = {}, {}
    norm_out_case(hashes, device, plan["norm_out"]["sizes"], plan["norm_out"]["shape"])
    block_case(hashes, device, plan["block"]["sizes"], plan["block"]["shape"], notes)
    result = {"adaln_lab_file": adaln_lab.__file__, "torch": torch.__version__, "device": str(device),
              "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
              "seconds": round(time.perf_counter() - start, 1), "notes": notes, "tensors": hashes}
    Path(args.child).write_text(json.dumps(result, indent=1))
    return 0


# ---- the parent: both trees, compared ----------------------------------------------------------------

def tree_commit(tree: Path, given: str | None) -> str:
    """The commit a tree holds: --*-commit, else its COMMIT file, else git's short HEAD (+ '-dirty' when tracked
    files differ from it), else 'unknown'."""
    if given:
        return given
    if (tree / "COMMIT").is_file():
        return (tree / "COMMIT").read_text().strip()

    def git(*cmd):
        run = subprocess.run(["git", "-C", str(tree), *cmd], capture_output=True, text=True)
        return run.stdout.strip() if run.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != tree.resolve():
        return "unknown"  # not a checkout of its own (an ignored copy inside another one, say)
    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def import_dir(tree: Path) -> Path:
    """The folder holding a tree's adaln_lab/, which its processes get on PYTHONPATH: TREE/src (the src layout)
    where that holds the package, else TREE itself (the flat layout of the commits before the move, 8c7a04a's)."""
    src = tree / "src"
    return src if (src / "adaln_lab" / "__init__.py").is_file() else tree


def holds_package(tree: Path) -> bool:
    """Whether `tree` is a tree of this project, of either layout (src/adaln_lab/ or adaln_lab/)."""
    return (import_dir(tree) / "adaln_lab" / "__init__.py").is_file()


def child_path(tree: Path) -> str:
    """PYTHONPATH for a tree's process: the folder holding its adaln_lab/, then this process's entries that hold
    no adaln_lab."""
    keep = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
            if p and not (Path(p) / "adaln_lab" / "__init__.py").is_file()]
    return os.pathsep.join([str(import_dir(tree)), *keep])


def run_tree(tree: Path, args, workdir: Path, label: str) -> tuple[dict | None, str]:
    target = workdir / f"{label}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(target), "--device", args.device]
    if args.quick:
        cmd.append("--quick")
    env = {**os.environ, "PYTHONPATH": child_path(tree)}
    run = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=args.timeout)
    log = (run.stdout + run.stderr)[-4000:]
    if run.returncode != 0 or not target.is_file():
        return None, f"exit {run.returncode}: {log}"
    result = json.loads(target.read_text())
    if Path(result["adaln_lab_file"]).resolve().parents[1] != import_dir(tree).resolve():
        return None, f"imported adaln_lab from {result['adaln_lab_file']}, not from {import_dir(tree)}"
    return result, log


def compare(old: dict, new: dict) -> dict:
    verdicts = {}
    for name in sorted(set(old["tensors"]) | set(new["tensors"])):
        a, b = old["tensors"].get(name), new["tensors"].get(name)
        verdicts[name] = {"equal": a is not None and a == b, "old": a, "new": b}
    return verdicts


def parent(args) -> int:
    old_tree, new_tree = Path(args.old).resolve(), Path(args.new).resolve()
    report = {"kind": "adaln_lab_tree_comparison", "quick": args.quick, "device": args.device, "seed": SEED,
              "cases": QUICK if args.quick else FULL,
              "old": {"tree": args.old, "commit": tree_commit(old_tree, args.old_commit)},
              "new": {"tree": args.new, "commit": tree_commit(new_tree, args.new_commit)}}
    failed = False
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, tree in (("old", old_tree), ("new", new_tree)):
            start = time.perf_counter()
            result, log = run_tree(tree, args, Path(tmp), label)
            report[label]["seconds"] = round(time.perf_counter() - start, 1)
            if result is None:
                report[label]["error"] = log
                failed = True
                print(f"[compare] {label} tree ({tree}) failed: {log}", file=sys.stderr)
                continue
            results[label] = result
            report[label].update({k: result[k] for k in ("adaln_lab_file", "torch", "gpu", "notes")})
            print(f"[compare] {label} tree {report[label]['commit']}: {len(result['tensors'])} tensors "
                  f"in {report[label]['seconds']} s", file=sys.stderr)
    if not failed:
        verdicts = compare(results["old"], results["new"])
        report["unequal"] = [n for n, v in verdicts.items() if not v["equal"]]
        report["inputs_equal"] = all(v["equal"] for n, v in verdicts.items() if "/input/" in n)
        report["compared"] = len(verdicts)
        report["all_equal"] = not report["unequal"]
        report["tensors"] = verdicts
    else:
        report["all_equal"] = False
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    if failed:
        return 2
    print(f"[compare] {report['compared']} tensors, {len(report['unequal'])} unequal "
          f"({report['old']['commit']} vs {report['new']['commit']}, {args.device}"
          f"{', quick' if args.quick else ''}): all_equal {report['all_equal']}", file=sys.stderr)
    for name in report["unequal"]:
        print(f"[compare] UNEQUAL {name}", file=sys.stderr)
    return 0 if report["all_equal"] else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", default=str(ROOT / ".old_tree"),
                        help="the older tree (holds src/adaln_lab/, or adaln_lab/ in the flat layout)")
    parser.add_argument("--new", default=str(ROOT), help="the tree to check (default: this checkout)")
    parser.add_argument("--old-commit", default=None, help="default: OLD/COMMIT, else git, else 'unknown'")
    parser.add_argument("--new-commit", default=None, help="default: NEW/COMMIT, else git, else 'unknown'")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="small shapes (H 256, D 128): for CPUs")
    parser.add_argument("--out", default="compare.json")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per tree")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    return child(args) if args.child else parent(args)


if __name__ == "__main__":
    sys.exit(main())
