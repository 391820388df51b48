"""The evidence runner: `python -m adaln_lab.bench STEP[+STEP...] [STEP ...] --out DIR [--base REV|DIR]`.

Runs the steps (adaln_lab.bench.steps) in the order given, each under its own time limit (its commands in process
groups of their own, killed at the step's deadline); a failing, cut or skipped step does not stop the next. Steps
joined by `+` run side by side (only those that time nothing). A step that needs a CUDA GPU is skipped, with its
reason, where torch sees none. After each step: one MANIFEST.csv row per file it wrote (adaln_lab.bench.manifest),
the console's lines in OUT/bench_<steps>.log, and OUT packed into OUT/all.tgz (the machine hands back few files;
--pack-dir gets a copy). Exit 0 when every step passed, 1 when any failed, was cut or was skipped, 2 for a mistake
in the arguments (found before anything runs).

--base names the tree `compare` and `host-ab` compare this one with: a directory holding src/adaln_lab/, or
adaln_lab/ for a tree of the flat layout before the move to src/ (by default .old_tree/ for compare and .ab_tree/
for host-ab, copied along with the checkout), or a commit git knows here, exported with `git archive` into a
temporary folder (its COMMIT file names it) for the run. Each tree's processes get the folder holding its
adaln_lab/ on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

from . import manifest
from .compare_trees import holds_package, import_dir
from .context import Context, StepTimeout
from .steps import DEFAULT_BASE, SANITIZE_TOOLS, STEPS, UPSTREAM_RUNS

ROOT = Path(__file__).resolve().parents[3]  # the checkout: src/adaln_lab/bench/runner.py
BUDGET = 570  # seconds: one invocation inside the lent machine's 600 s per command
MIN_START = 20  # no step starts with less left of the budget


class Parser(argparse.ArgumentParser):
    """argparse, with a mistake said in one line (exit 2)."""

    def error(self, message):
        raise fail(f"{message} (--help lists the steps and options)")


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = Parser(
        prog="python -m adaln_lab.bench", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__.split("\n\n")[0],
        epilog="steps (default limit in seconds; *: may run beside another * step, STEP+STEP):\n" + "\n".join(
            f"  {s.name:<13} {s.limit:>4}{'*' if s.shares else ' '} {s.does}" for s in STEPS.values()))
    parser.add_argument("steps", nargs="+", metavar="STEP", help="a step, or steps joined by + to run side by side")
    parser.add_argument("--out", required=True, metavar="DIR", help="the folder the files and MANIFEST.csv go to")
    parser.add_argument("--base", metavar="REV|DIR", help="the tree compare and host-ab compare this one with "
                        f"(default: {DEFAULT_BASE['compare']}/ and {DEFAULT_BASE['host-ab']}/)")
    parser.add_argument("--budget", type=int, default=BUDGET, metavar="SECONDS",
                        help=f"for the whole run (default {BUDGET}; 0: none): no step starts with less than "
                             f"{MIN_START} s left, and each is cut at what is left")
    parser.add_argument("--limit", action="append", default=[], metavar="STEP=SECONDS",
                        help="a step's own limit instead of its default (repeatable)")
    parser.add_argument("--pack-dir", metavar="DIR", help="also copy all.tgz, MANIFEST.csv and the log there")
    parser.add_argument("--compare-args", default="", metavar="ARGS",
                        help='more arguments of compare_trees ("--device cpu --quick": the compare step on a CPU)')
    parser.add_argument("--sanitize-tools", default=",".join(SANITIZE_TOOLS), metavar="TOOLS",
                        help=f"comma-separated, of {', '.join(SANITIZE_TOOLS)} (default: all)")
    parser.add_argument("--sanitize-timeout", type=int, default=120, metavar="SECONDS", help="per tool (default 120)")
    parser.add_argument("--compute-sanitizer", metavar="PATH", help="default: on the PATH, else /usr/local/cuda/bin/")
    parser.add_argument("--upstream-runs", default=",".join(UPSTREAM_RUNS), metavar="RUNS",
                        help="comma-separated, of unpatched, patched (default: both)")
    parser.add_argument("--upstream-timeout", type=int, default=190, metavar="SECONDS", help="per run (default 190)")
    parser.add_argument("--host-ab-rounds", type=int, default=3, metavar="N",
                        help="rounds of host-ab, each the base tree then this one (default 3)")
    parser.add_argument("--dry-run", action="store_true", help="print each step's commands; run and write nothing")
    args = parser.parse_args(argv)
    args.groups = [group.split("+") for group in args.steps]
    for group in args.groups:
        for name in group:
            if name not in STEPS:
                parser.error(f"unknown step: {name!r} (steps: {', '.join(STEPS)})")
            if len(group) > 1 and not STEPS[name].shares:
                parser.error(f"{name} times the GPU: run it alone, not in {'+'.join(group)} (side by side: "
                             f"{', '.join(s.name for s in STEPS.values() if s.shares)})")
    args.limits = {}
    for item in args.limit:
        name, _, seconds = item.partition("=")
        if name not in STEPS or not seconds.isdigit() or int(seconds) < 1:
            parser.error(f"--limit {item!r}: STEP=SECONDS, a step of {', '.join(STEPS)} and a whole number >= 1")
        args.limits[name] = int(seconds)
    for option, chosen, allowed in (("--sanitize-tools", "sanitize_tools", SANITIZE_TOOLS),
                                    ("--upstream-runs", "upstream_runs", UPSTREAM_RUNS)):
        values = [v for v in getattr(args, chosen).split(",") if v]
        if not values or set(values) - set(allowed):
            parser.error(f"{option} {getattr(args, chosen)!r}: comma-separated, of {', '.join(allowed)}")
        setattr(args, chosen, values)
    if args.host_ab_rounds < 1:
        parser.error(f"--host-ab-rounds must be >= 1, got {args.host_ab_rounds}")
    if args.budget < 0:
        parser.error(f"--budget must be >= 0, got {args.budget}")
    return args


def resolve_base(value: str, root: Path, workdir: Path) -> tuple[Path, str | None]:
    """(tree, rev) for --base: an existing directory (rev None), else a commit git knows at `root`, exported into
    `workdir` with `git archive` (its COMMIT file names it). ValueError, naming --base, for anything else."""
    for candidate in (Path(value), root / value):
        if candidate.is_dir():
            if not holds_package(candidate):
                raise ValueError(f"--base {value}: the directory {candidate} holds no src/adaln_lab/ or adaln_lab/ "
                                 "(a tree of this project)")
            return candidate.resolve(), None
    if not (root / ".git").exists():
        raise ValueError(f"--base {value}: no such directory, and no .git in {root} to export a commit from")
    found = subprocess.run(["git", "-C", str(root), "rev-parse", "--verify", "--quiet", "--short", f"{value}^{{commit}}"],
                           capture_output=True, text=True)
    if found.returncode != 0:
        raise ValueError(f"--base {value}: neither a directory nor a commit git knows in {root}")
    rev = found.stdout.strip()
    tree = workdir / f"base-{rev}"
    tree.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(root), "archive", "--format=tar", rev], capture_output=True)
    if archive.returncode != 0:
        raise ValueError(f"--base {value}: git archive {rev} failed: {archive.stderr.decode()[-300:].strip()}")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        if hasattr(tarfile, "data_filter"):  # Python >= 3.12 (and recent 3.10 / 3.11 releases)
            tar.extractall(tree, filter="data")
        else:
            tar.extractall(tree)
    (tree / "COMMIT").write_text(rev + "\n")
    if not holds_package(tree):
        raise ValueError(f"--base {value}: commit {rev} holds no src/adaln_lab/ or adaln_lab/")
    return tree, rev


class Console:
    """Lines to stdout and, once `path` is set, to the run's log (thread-safe: side-by-side steps print too)."""

    def __init__(self):
        self.lock, self.path = threading.Lock(), None

    def __call__(self, line: str) -> None:
        with self.lock:
            print(line, flush=True)
            if self.path is not None:
                with self.path.open("a") as f:
                    f.write(line + "\n")


def fail(message: str) -> SystemExit:
    """A mistake in the arguments: one line on stderr, exit 2 (as argparse's own errors)."""
    print(f"python -m adaln_lab.bench: error: {message}", file=sys.stderr)
    return SystemExit(2)


def main(argv: list[str] | None = None, root: Path = ROOT) -> int:
    """Runs the command line `argv` (default: sys.argv[1:]) for the checkout at `root`; returns the exit status."""
    args = parse(argv)
    if not (root / "pyproject.toml").is_file():
        raise fail(f"the runner works in a checkout of adaln_lab (pyproject.toml beside src/): {root} is none")
    out = Path(args.out).resolve()
    if out.exists() and not out.is_dir():
        raise fail(f"--out {args.out}: exists and is not a directory")
    with tempfile.TemporaryDirectory(prefix="adaln_lab_bench_") as workdir:
        base, rev = None, None
        if args.base:
            try:
                base, rev = resolve_base(args.base, root, Path(workdir))
            except ValueError as error:
                raise fail(str(error)) from None
        if not args.dry_run:
            try:
                out.mkdir(parents=True, exist_ok=True)
            except OSError as error:
                raise fail(f"--out {args.out}: {error.strerror}") from None
        return Run(args, root, out, base, rev).all()


class Run:
    """One invocation: the environment, the console and log, the budget, the manifest and the packing."""

    def __init__(self, args, root: Path, out: Path, base: Path | None, rev: str | None):
        self.args, self.root, self.out, self.base, self.rev = args, root, out, base, rev
        self.say = Console()
        self.start = time.monotonic()
        commit, dirty = manifest.tree_commit(root)
        self.commit = commit + ("-dirty" if dirty else "")
        path, package = os.environ.get("PYTHONPATH", ""), str(import_dir(root))  # root/src: this tree's adaln_lab
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1",
                    "PYTHONPATH": path if package in path.split(os.pathsep) else os.pathsep.join(
                        p for p in (package, path) if p)}
        if commit != "unknown":
            self.env.setdefault("ADALN_LAB_COMMIT", commit)
        self.machine = manifest.machine(self.env)
        self.log = "bench_" + "_".join(s.replace("+", "_") for s in args.steps) + ".log"
        self.command = "python3 -m adaln_lab.bench " + " ".join(args.steps) + " --out ." + (
            f" --base {args.base}" if args.base else "")

    def all(self) -> int:
        a, m = self.args, self.machine
        if not a.dry_run:
            self.say.path = self.out / self.log
            self.say.path.unlink(missing_ok=True)
        self.say(f"adaln_lab.bench: commit {self.commit}, torch {m['torch']}, gpu {m['gpu']}, driver {m['driver']}, "
                 f"steps {' '.join(a.steps)}, out {self.out}, budget {f'{a.budget} s' if a.budget else 'none'}"
                 + (f", base {a.base} ({self.base if self.rev is None else 'commit ' + self.rev})" if a.base else ""))
        failed = 0
        for group in a.groups:
            threads, results = [], {}
            for name in group:
                limit = self.limit(name)
                if limit == 0:
                    self.say(f"{name}: skipped (the budget of {a.budget} s is spent)")
                    failed += 1
                    continue
                if a.dry_run:  # one after the other: the plan prints in order
                    self.step(name, limit, results)
                    continue
                thread = threading.Thread(target=self.step, args=(name, limit, results))
                thread.start()
                threads.append(thread)
            for thread in threads:
                thread.join()
            failed += sum(1 for rc in results.values() if rc)
            self.pack()
        self.say(f"adaln_lab.bench: done after {time.monotonic() - self.start:.0f} s, {failed} step(s) failed or "
                 "skipped" + (" (dry run: nothing ran)" if a.dry_run else ""))
        self.pack()
        return 1 if failed else 0

    def limit(self, name: str) -> int:
        """The step's limit, cut to what the budget leaves (0: too little left to start)."""
        limit = self.args.limits.get(name, STEPS[name].limit)
        if self.args.budget and not self.args.dry_run:
            left = self.args.budget - (time.monotonic() - self.start) - 10
            if left < MIN_START:
                return 0
            limit = min(limit, int(left))
        return limit

    def step(self, name: str, limit: int, results: dict) -> None:
        step, started = STEPS[name], time.monotonic()
        base = self.base or (self.root / DEFAULT_BASE[name] if name in DEFAULT_BASE else None)
        ctx = Context(name, self.root, self.out, self.env, started + limit, self.args, self.machine, self.say,
                      self.args.dry_run, base, self.rev)
        if self.args.dry_run:
            self.say(f"{name} (limit {limit} s){': needs a CUDA GPU, none here' if self.needs_gpu(step) else ''}:")
        elif self.needs_gpu(step):
            self.say(f"{name}: skipped: needs a CUDA GPU (torch {self.machine['torch']} sees none here)")
            results[name] = 2
            return
        try:
            rc = step.run(ctx)
        except StepTimeout:
            rc = 124
        except Exception as error:  # a step's own failure (a file it could not read, say): said, the next runs
            self.say(f"{name}: {type(error).__name__}: {error}")
            rc = 1
        results[name] = rc
        self.record(ctx)
        if not self.args.dry_run:
            self.say(f"{name}: exit {rc} after {time.monotonic() - started:.0f} s (limit {limit} s)")

    def needs_gpu(self, step) -> bool:
        return step.gpu(self.args) and not self.machine["gpus"]

    def record(self, ctx: Context) -> None:
        """Manifest rows for the files the step noted that exist and are not empty (a step that failed early)."""
        rows = [self.row(name, line) for name, line in ctx.recorded
                if (self.out / name).is_file() and (self.out / name).stat().st_size]
        if rows:
            manifest.record(self.out / manifest.NAME, list({row["file"]: row for row in rows}.values()))

    def row(self, name: str, command: str) -> dict:
        m = self.machine
        return {"file": name, "commit": self.commit, "command": command, "torch": m["torch"], "gpu": m["gpu"],
                "driver": m["driver"], "date": manifest.utc_now()}

    def pack(self) -> None:
        """The log's manifest row, then OUT (but all.tgz and hidden files) into OUT/all.tgz; a copy to --pack-dir."""
        if self.args.dry_run:
            return
        manifest.record(self.out / manifest.NAME, [self.row(self.log, self.command)])
        part = self.out / ".all.tgz.part"
        with tarfile.open(part, "w:gz") as tar:
            for path in sorted(self.out.rglob("*")):
                relative = path.relative_to(self.out)
                if path.is_file() and relative.as_posix() != "all.tgz" and not any(
                        p.startswith(".") for p in relative.parts):
                    tar.add(path, arcname=f"./{relative.as_posix()}")
        os.replace(part, self.out / "all.tgz")
        if self.args.pack_dir:
            pack = Path(self.args.pack_dir)
            pack.mkdir(parents=True, exist_ok=True)
            for name in ("all.tgz", manifest.NAME, self.log):
                shutil.copy2(self.out / name, pack / name)
