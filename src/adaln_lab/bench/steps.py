"""The evidence runner's steps: what each runs and writes (bench/README.md has the table).

Each step is a function of a `context.Context` that returns an exit status (0: done; 2: it could not start, and
said why) and prints a few lines of what its files hold. Every command runs from the checkout's root with this
interpreter; the files go to the output folder.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import sys
import time
from dataclasses import dataclass
from typing import Callable

from .context import BASE_MARK, STDOUT, TIMED_OUT, Context
from .host_ab_summary import table as host_ab_table

PY = sys.executable
SANITIZE_TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")
UPSTREAM_RUNS = ("unpatched", "patched")
UPSTREAM_TEST = "tests/models/transformers/test_models_transformer_minimax_h3.py"
DEFAULT_BASE = {"compare": ".old_tree", "host-ab": ".ab_tree"}  # trees copied along with the checkout


@dataclass(frozen=True)
class Step:
    """`limit`: default seconds; `shares`: times nothing, so it may run beside another such step (STEP+STEP);
    `gpu(options)`: whether it needs a CUDA GPU; `does`: one line for --help."""

    name: str
    run: Callable[[Context], int]
    limit: int
    does: str
    shares: bool = False
    gpu: Callable[[object], bool] = lambda options: True


def xdist(workers: int) -> list[str]:
    """pytest-xdist's arguments for `workers` processes, none where it is not installed."""
    return ["-n", str(workers)] if importlib.util.find_spec("xdist") else []


def module(name: str, *args: str) -> list[str]:
    return [PY, "-m", name, *args]


def tests(ctx: Context) -> int:
    if not xdist(8):
        ctx.say("tests: pytest-xdist missing: the tests run in one process")
    rc = ctx.run(["pytest_gpu.txt"], module("pytest", "-q", "-m", "gpu", *xdist(8), "-p", "no:cacheprovider",
                                            "--durations=20", "tests"), stdout="pytest_gpu.txt", stderr=STDOUT)
    ctx.show_tail("pytest_gpu.txt", 3)
    return rc


def base_tree(ctx: Context) -> int:
    """0 when the step's tree to compare with (--base, else its default folder) holds src/adaln_lab/ (or, flat,
    adaln_lab/), else 2."""
    from .compare_trees import holds_package

    if ctx.base is not None and holds_package(ctx.base):
        return 0
    default = DEFAULT_BASE[ctx.step]
    ctx.say(f"{ctx.step}: no tree to compare with: give --base REV|DIR, or copy one along at {default}/")
    return 2


def base_commit(ctx: Context) -> str:
    """The base tree's commit: its COMMIT file, else git's (a checkout of its own), else "unknown"."""
    from .compare_trees import tree_commit

    return tree_commit(ctx.base, None)


def compare(ctx: Context) -> int:
    if base_tree(ctx):
        return 2
    old = base_commit(ctx)
    extra = shlex.split(ctx.options.compare_args)
    report = f"compare_{old}.json"
    rc = ctx.run([report, "compare.log"],
                 module("adaln_lab.bench.compare_trees", "--old", str(ctx.base), "--old-commit", old, *extra,
                        "--out", str(ctx.out / report)), stdout="compare.log", stderr=STDOUT)
    ctx.show_tail("compare.log", 4)
    return rc


def report(ctx: Context) -> int:
    rc = ctx.run(["report.json", "report.log"],
                 module("adaln_lab", "report", "--out", str(ctx.out / "report.json")), stdout="report.log",
                 stderr=STDOUT)
    ctx.show_tail("report.log", 2)
    table = ctx.run(["report.md"], module("adaln_lab", "table", str(ctx.out / "report.json")), stdout="report.md")
    return rc or (1 if table else 0)


def block_report(ctx: Context) -> int:
    rc = ctx.run(["block_report.json", "block_report.log"],
                 module("adaln_lab", "block-report", "--out", str(ctx.out / "block_report.json")),
                 stdout="block_report.log", stderr=STDOUT)
    ctx.show_tail("block_report.log", 2)
    return rc


def lab(ctx: Context) -> int:
    rc = ctx.run(["lab_errors.json", "lab_invariance.json", "lab_latency.json", "lab.log"],
                 module("adaln_lab.lab", "--out", str(ctx.out)), stdout="lab.log", stderr=STDOUT)
    ctx.show_matching("lab.log", "wrote")
    return rc


def sanitize(ctx: Context) -> int:
    """compute-sanitizer, one tool at a time, over adaln_lab.bench.sanitize_calls (every kernel at small shapes, 0 and
    1 rows included). The plain run first: it must pass, and it fills CuPy's kernel cache so no tool run compiles.
    Each tool runs with --error-exitcode 1; its summary line (exit, errors, racecheck's warnings, seconds) goes to
    sanitize/sanitize_summary.txt. No --leak-check: torch's caching allocator keeps its pool until exit by design,
    and the leak check counts each of its blocks. Fails if any tool exited non-zero, timed out, left no summary,
    counted an error or did not finish the workload."""
    workload, summary = module("adaln_lab.bench.sanitize_calls"), "sanitize/sanitize_summary.txt"
    sanitizer = sanitizer_path(ctx.options)
    lines = []

    def line(text):
        if not ctx.dry_run:
            ctx.say(text)
            lines.append(text)
            (ctx.out / summary).write_text("".join(f"{x}\n" for x in lines))

    if not ctx.dry_run:
        (ctx.out / "sanitize").mkdir(exist_ok=True)
        ctx.note(summary, "python3 -m adaln_lab.bench sanitize --out . (its summary lines)")
    if not shutil.which(sanitizer) and not ctx.dry_run:
        line(f"compute-sanitizer not found at {sanitizer} (give --compute-sanitizer)")
        return 2
    start = time.monotonic()
    plain = "sanitize/sanitize_plain.txt"
    if ctx.run([plain], workload, stdout=plain, stderr=STDOUT, timeout=ctx.within(300)):
        line(f"plain run failed ({time.monotonic() - start:.0f} s): see {plain}")
        ctx.show_tail(plain, 5)
        return 2
    line(f"plain run: ok ({time.monotonic() - start:.0f} s)")
    failed = 0
    for tool in ctx.options.sanitize_tools:
        log = f"sanitize/sanitize_{tool}.txt"
        if ctx.within(ctx.options.sanitize_timeout) < 15:
            line(f"{tool}: skipped (the step's time is spent)")
            failed = 1
            continue
        start = time.monotonic()
        code = ctx.run([log], [sanitizer, "--tool", tool, "--error-exitcode", "1", "--target-processes", "all",
                               *workload], stdout=log, stderr=STDOUT, timeout=ctx.within(ctx.options.sanitize_timeout))
        if ctx.dry_run:
            continue
        verdict = sanitizer_verdict(ctx.lines(log))
        seconds = time.monotonic() - start
        note = (f" TIMED OUT after {seconds:.0f} s" if code == TIMED_OUT else "") + verdict["note"]
        warnings = f" warnings {verdict['warnings']}" if verdict["warnings"] is not None else ""
        line(f"{tool:<9} exit {code:<3} errors {verdict['errors'] if verdict['errors'] is not None else '?':<4}"
             f"{warnings} {seconds:4.0f} s{note}  ({log})")
        if code or verdict["errors"] != 0 or note:
            failed = 1
    return failed


def sanitizer_verdict(lines: list[str]) -> dict:
    """{"errors", "warnings" (None where the summary gives none), "note"} of one tool's log: its last summary line
    ("ERROR SUMMARY: 0 errors" / "RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)"); the note says
    when there is no summary or the workload did not finish."""
    summaries = [x for x in lines if re.search(r"(ERROR|RACECHECK) SUMMARY", x)]
    last = summaries[-1] if summaries else ""

    def count(word):
        found = re.findall(rf"([0-9,]+) {word}s?\b", last)
        return int(found[-1].replace(",", "")) if found else None

    note = ("" if last else " NO SUMMARY") + ("" if any("small calls done" in x for x in lines)
                                              else " WORKLOAD DID NOT FINISH")
    return {"errors": count("error"), "warnings": count("warning"), "note": note}


def profile(ctx: Context) -> int:
    rc = ctx.run(["block_profile.txt"], module("adaln_lab.bench.block_profile", "adaln_lab"),
                 stdout="block_profile.txt", stderr=STDOUT)
    ctx.show_matching("block_profile.txt", r"^(==|--)")
    return rc


def host(ctx: Context) -> int:
    rc = ctx.run(["host_breakdown.txt"], module("adaln_lab.bench.host_breakdown", "--bounds"),
                 stdout="host_breakdown.txt", stderr=STDOUT)
    ctx.show_matching("host_breakdown.txt", r"host fwd\+bwd")
    return rc


def host_ab(ctx: Context) -> int:
    """Rounds (--host-ab-rounds, default 3) alternating the base tree and this one: this checkout's
    host_breakdown.py, run from each tree with the folder holding that tree's adaln_lab/ (TREE/src, or TREE for the
    flat layout) first on the path, so both are timed by the same code in one run."""
    if base_tree(ctx):
        return 2
    from .compare_trees import import_dir
    from .manifest import tree_commit

    commit, dirty = tree_commit(ctx.root)
    script = str(import_dir(ctx.root) / "adaln_lab" / "bench" / "host_breakdown.py")
    run_file = "import runpy, sys; runpy.run_path(sys.argv.pop(1), run_name='__main__')"
    base = ctx.word(str(ctx.base)).replace(BASE_MARK, "$BASE")
    trees = ((base, ctx.base, base_commit(ctx)), (".", ctx.root, commit + ("-dirty" if dirty else "")))
    rounds = ctx.options.host_ab_rounds
    shown = (f"script=$PWD/{ctx.word(script)}; for round in $(seq {rounds}); do for tree in {base} .; do "
             'echo "== $tree $(cat $tree/COMMIT 2>/dev/null || git rev-parse --short HEAD)"; (cd $tree && '
             'PYTHONPATH=$(test -d src/adaln_lab && echo $PWD/src || echo $PWD) '
             f'python3 -c "{run_file}" $script --no-profile) || exit 1; done; done > host_ab.txt 2>&1')
    if ctx.dry_run:
        ctx.say(f"  {shown}")
        return 0
    (ctx.out / "host_ab.txt").unlink(missing_ok=True)
    for _ in range(rounds):
        for label, tree, tree_commit_ in trees:
            path = {"PYTHONPATH": os.pathsep.join(p for p in (str(import_dir(tree)), ctx.env.get("PYTHONPATH")) if p)}
            rc = ctx.run(["host_ab.txt"], [PY, "-c", run_file, script, "--no-profile"], stdout="host_ab.txt",
                         stderr=STDOUT, cwd=tree, env=path, header=f"== {label} {tree_commit_}\n", append=True,
                         shown=shown)
            if rc:
                ctx.show_tail("host_ab.txt", 5)
                return rc
    ctx.show_matching("host_ab.txt", r"^==|host (cpu )?fwd\+bwd")
    try:  # each tree against its rounds' identity floor
        verdict = host_ab_table((ctx.out / "host_ab.txt").read_text())
    except ValueError as error:
        ctx.say(f"host-ab: {error}")
        return 1
    for line in verdict.splitlines():
        ctx.say(line)
    return 0


def trace(ctx: Context) -> int:
    rc = ctx.run(["host_trace.txt"], module("adaln_lab.bench.host_trace"), stdout="host_trace.txt", stderr=STDOUT)
    if not ctx.dry_run:
        for line in ctx.lines("host_trace.txt")[:8]:
            ctx.say(line)
    return rc


def train(ctx: Context) -> int:
    command = module("adaln_lab.bench.train_step", "--row-form", "0", "--no-wait")
    rc = ctx.run(["train_step.json", "train_step.log"], command,
                 stdout="train_step.json", stderr="train_step.log")
    ctx.show_tail("train_step.log", 20)
    return rc


def multi(ctx: Context) -> int:
    world = max(1, ctx.machine.get("gpus", 0))
    rc = ctx.run(["multi_gpu.json", "multi_gpu.log"],
                 module("adaln_lab.bench.multi_gpu", "--device", "cuda", "--world", str(world), "--out",
                        str(ctx.out / "multi_gpu.json")), stderr="multi_gpu.log")
    if not ctx.dry_run:
        for line in [x for x in ctx.lines("multi_gpu.log") if not x.startswith("[rank")][-8:]:
            ctx.say(line)
    return rc


def upstream(ctx: Context) -> int:
    """diffusers' own MiniMax-H3 model tests, from a diffusers checkout's tests/ copied along at .dtests/tests (its
    COMMIT file names the commit): unpatched, then every model patched (adaln_lab.bench.diffusers_patch_plugin)."""
    dtests = ctx.root / ".dtests"
    if not (dtests / UPSTREAM_TEST).is_file():
        ctx.say("upstream: no diffusers tests at .dtests/tests (a diffusers checkout's tests/ must travel with the "
                "checkout)")
        return 2
    named = dtests / "COMMIT"
    header = f"diffusers tests/ of commit {named.read_text().strip() if named.is_file() else 'unknown'}\n"
    rc = 0
    for run in ctx.options.upstream_runs:
        name = f"diffusers_h3_tests_{run}.txt"
        plugin = ["-p", "adaln_lab.bench.diffusers_patch_plugin"] if run == "patched" else []
        argv = module("pytest", "-q", "-rfEX", "-p", "no:cacheprovider", *xdist(4), *plugin, UPSTREAM_TEST)
        rc = ctx.run([name], argv, stdout=name, stderr=STDOUT, cwd=dtests, header=header,
                     timeout=ctx.within(ctx.options.upstream_timeout)) or rc
        ctx.show_tail(name, 1)
    return 1 if rc else 0


def sweep(ctx: Context) -> int:
    rc = ctx.run(["sweep.json", "sweep.log"], module("adaln_lab.bench.sweep", "default"), stdout="sweep.json",
                 stderr="sweep.log")
    ctx.show_tail("sweep.log", 2)
    return rc


def memory(ctx: Context) -> int:
    rc = ctx.run(["memory_figures.json", "memory_figures.log"], module("adaln_lab.bench.memory_figures"),
                 stdout="memory_figures.json", stderr="memory_figures.log")
    ctx.show_matching("memory_figures.json", r'"(peak_over_budget|growth_bytes)"')
    return rc


def exact(ctx: Context) -> int:
    """The exact route's checks and cost (bench/tools/exact_kernel_cost.py; a block's, bench/tools/block_exact_cost.py,
    again with the float64 windows, --row-double 1) and its gradients' errors against float64 beside the plain ones'
    (bench/tools/exact_accuracy.py at 4097 rows)."""
    tools = ctx.root / "bench" / "tools"
    rc = ctx.run(["exact_kernel_cost.json", "exact_kernel_cost.log"],
                 [PY, str(tools / "exact_kernel_cost.py"), "--out", str(ctx.out / "exact_kernel_cost.json")],
                 stdout="exact_kernel_cost.log", stderr=STDOUT)
    ctx.show_tail("exact_kernel_cost.log", 2)
    block = ctx.run(["block_exact_cost.json", "block_exact_cost.log"],
                    [PY, str(tools / "block_exact_cost.py"), "--out", str(ctx.out / "block_exact_cost.json")],
                    stdout="block_exact_cost.log", stderr=STDOUT)
    ctx.show_tail("block_exact_cost.log", 2)
    double = ctx.run(["block_exact_cost_double.json", "block_exact_cost_double.log"],
                     [PY, str(tools / "block_exact_cost.py"), "--row-double", "1", "--out",
                      str(ctx.out / "block_exact_cost_double.json")], stdout="block_exact_cost_double.log",
                     stderr=STDOUT)
    ctx.show_tail("block_exact_cost_double.log", 2)
    accuracy = ctx.run(["exact_accuracy.json", "exact_accuracy.log"],
                       [PY, str(tools / "exact_accuracy.py"), "--rows", "4097", "--out",
                        str(ctx.out / "exact_accuracy.json")], stdout="exact_accuracy.log", stderr=STDOUT)
    ctx.show_tail("exact_accuracy.log", 2)
    return rc or block or double or accuracy


def compare_needs_gpu(options) -> bool:
    args = shlex.split(options.compare_args)
    return not any(a == "cpu" and b == "--device" for b, a in zip(args, args[1:])) and "--device=cpu" not in args


STEPS = {s.name: s for s in (
    Step("tests", tests, 480, "every GPU test (pytest -m gpu, 8 xdist workers): pytest_gpu.txt", shares=True),
    Step("compare", compare, 300, "outputs and gradients bitwise against the base tree: compare_<base commit>.json, "
         "compare.log", shares=True, gpu=compare_needs_gpu),
    Step("report", report, 420, "python3 -m adaln_lab report, and its table: report.json, report.log, report.md"),
    Step("block-report", block_report, 240, "python3 -m adaln_lab block-report: block_report.json, block_report.log"),
    Step("lab", lab, 560, "python3 -m adaln_lab.lab (what the notebooks read): lab_*.json, lab.log"),
    Step("sanitize", sanitize, 560, "compute-sanitizer's four tools over adaln_lab.bench.sanitize_calls: sanitize/",
         shares=True),
    Step("profile", profile, 150, "the block's kernels per call (torch.profiler): block_profile.txt"),
    Step("host", host, 150, "host time against diffusers and the identity floor, bounds, cProfile: "
         "host_breakdown.txt"),
    Step("host-ab", host_ab, 300, "host time, three rounds alternating the base tree and this one: host_ab.txt"),
    Step("trace", trace, 150, "what grows with the rows in an eager call's host time: host_trace.txt"),
    Step("train", train, 300, "a full-width 2-block train step, bf16 and fp32 master + autocast: train_step.json, "
         "train_step.log"),
    Step("multi", multi, 300, "FSDP2 and context parallelism over every visible GPU: multi_gpu.json, multi_gpu.log"),
    Step("upstream", upstream, 400, "diffusers' MiniMax-H3 model tests unpatched and patched (from .dtests/tests): "
         "diffusers_h3_tests_*.txt", shares=True, gpu=lambda options: False),
    Step("sweep", sweep, 200, "each shipped kernel timed alone: sweep.json, sweep.log"),
    Step("memory", memory, 120, "peak memory and growth over 1000 calls: memory_figures.json, memory_figures.log",
         shares=True),
    Step("exact", exact, 480, "the exact route's checks, cost and accuracy: exact_kernel_cost.json, "
         "block_exact_cost.json, block_exact_cost_double.json, exact_accuracy.json and their logs"),
)}


def sanitizer_path(options) -> str:
    return options.compute_sanitizer or shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
