"""README.md and the pages of docs/ run as written on a CPU: every ```python block, in order, in one namespace per
file (as a newcomer pastes a page's blocks into one session), in a fresh interpreter started at the checkout's
root. No block is skipped; a block that needs a GPU has to be written to run on a CPU too, or not be a python
block. And the README holds what a newcomer needs and nothing stale: at most 200 lines; the requirements (GPU,
driver, CUDA, torch); the kernels' limits as core/plan.py has them; one results table of at most six columns,
read off the committed evidence (figures, GPU, torch and commit); a layout that matches the tree."""

import csv
import json
import os
import re
import subprocess
import sys

import pytest

from adaln_lab.core import plan
from tests.paths import PACKAGE, ROOT

README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = ("training.md", "lab.md")  # the pages the README sends training and the lab to
EVIDENCE = ROOT / "bench" / "results" / "h100"
FENCE = re.compile(r"^```(\S*)\n(.*?)^```$", flags=re.S | re.M)
LANGUAGES = {"python", "bash", "text"}  # the fences the pages may use; only python blocks are code to run
MAX_LINES = 200
MAX_COLUMNS = 6
STATUS_PROSE = ("was lent", "host was slow", "lies on disk", "this session", "has not run on")

RUNNER = """
import sys
name, blocks = {name!r}, {blocks!r}
namespace = {{"__name__": "__main__"}}
for line, source in blocks:
    print(f"{{name}} block at line {{line}}", file=sys.stderr, flush=True)
    exec(compile(source, f"{{name}}:{{line}}", "exec"), namespace)
print("ran", len(blocks), "blocks")
"""


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(line of the opening fence, source) of every ```python block, in order."""
    return [(text.count("\n", 0, m.start()) + 1, m.group(2)) for m in FENCE.finditer(text) if m.group(1) == "python"]


def section(text: str, title: str) -> str:
    """The body of the `## title` section of a markdown text ('' when absent)."""
    parts = text.split(f"\n## {title}\n", 1)
    return parts[1].split("\n## ", 1)[0] if len(parts) == 2 else ""


def run_blocks(path) -> subprocess.CompletedProcess:
    """Every python block of `path`, in order, in one namespace, in a fresh interpreter at the root, without CUDA."""
    blocks = python_blocks(path.read_text())
    name = str(path.relative_to(ROOT))
    return subprocess.run([sys.executable, "-c", RUNNER.format(name=name, blocks=blocks)], cwd=ROOT,
                          capture_output=True, text=True, timeout=540, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})


def doc_pages() -> list:
    return sorted(DOCS.glob("*.md"))


@pytest.mark.parametrize("path", [README, *doc_pages()], ids=lambda p: str(p.relative_to(ROOT)))
def test_fences_are_known_languages_and_paired(path):
    text = path.read_text()
    languages = [m.group(1) for m in FENCE.finditer(text)]
    assert set(languages) <= LANGUAGES, f"unexpected fence languages: {set(languages) - LANGUAGES}"
    assert text.count("```") == 2 * len(languages), "an unpaired ``` fence"


def test_the_readme_has_python_blocks_and_sends_training_and_the_lab_to_docs_pages_that_have_some_too():
    readme = README.read_text()
    assert len(python_blocks(readme)) >= 5
    for page in PAGES:
        assert (DOCS / page).is_file() and f"docs/{page}" in readme, page
        assert python_blocks((DOCS / page).read_text()), f"docs/{page} has no python block"
    assert not section(readme, "Training"), "the training section lives in docs/training.md"


@pytest.mark.integration
def test_readme_python_blocks_run_in_order_on_a_cpu():
    result = run_blocks(README)
    assert result.returncode == 0, f"{result.stderr[-4000:]}"
    assert result.stdout.strip().splitlines()[-1] == f"ran {len(python_blocks(README.read_text()))} blocks"
    assert "timestep_indices holds 3, outside [0, T) = [0, 3)" in result.stdout


@pytest.mark.integration
@pytest.mark.parametrize("path", doc_pages(), ids=lambda p: p.name)
def test_docs_python_blocks_run_in_order_on_a_cpu(path):
    result = run_blocks(path)
    assert result.returncode == 0, f"{result.stderr[-4000:]}"
    assert result.stdout.strip().splitlines()[-1] == f"ran {len(python_blocks(path.read_text()))} blocks"


def test_readme_is_at_most_200_lines_and_names_the_requirements():
    readme = README.read_text()
    assert readme.count("\n") <= MAX_LINES, f"README.md has {readme.count(chr(10))} lines"
    pin = re.search(r'"torch==([\d.]+)"', section(readme, "Install and test"))
    assert pin, "the install command pins torch"
    requirements = " ".join(section(readme, "Requirements").split())
    for needed in ("NVIDIA GPU", "compute capability", "driver", "CUDA 13", "cupy-cuda13x", "sm_90", "sm_100",
                   f"torch {pin.group(1)}", "diffusers"):
        assert needed in requirements, f"the Requirements section does not name {needed!r}"


def test_readme_states_the_kernels_limits_as_the_plan_has_them():
    limits = " ".join(section(README.read_text(), "Limits").split())
    for limit in (f"H <= {plan.H_MAX}", f"T <= {plan.T_MAX}", "divisible by 8",
                  f"T <= {plan.T_MAX // 3}"):  # a block's table has 3 rows per timestep
        assert limit in limits, f"the Limits section does not say {limit!r}"
    assert 2 ** 31 - 2 ** 15 == plan.ROWS_MAX and "2^31 - 2^15 rows" in limits


@pytest.mark.parametrize("path", [README, *doc_pages()], ids=lambda p: str(p.relative_to(ROOT)))
def test_tables_are_narrow_and_there_is_no_run_status_prose(path):
    text = path.read_text()
    for line in text.splitlines():
        if line.startswith("|"):
            assert line.count("|") - 1 <= MAX_COLUMNS, f"a table wider than {MAX_COLUMNS} columns: {line[:80]}"
    for phrase in STATUS_PROSE:
        assert phrase not in text.lower(), f"run-status prose: {phrase!r}"


# ----- the results table, read off the committed evidence -----

NAMES = ("diffusers", "torch_compile", "adaln_lab")
HEADER = "| workload | rows | diffusers | torch.compile | adaln_lab (x floor) | gradients repeat bitwise |"


def repeat_text(repeating: list[str]) -> str:
    if repeating == list(NAMES):
        return "all"
    if not repeating:
        return "none"
    return f"{repeating[0]} only" if len(repeating) == 1 else ", ".join(repeating)


def row(workload: str, size, times: dict, floor_us: float, repeating: list[str]) -> str:
    us = [f"{times[name]:.0f}" for name in NAMES]
    return (f"| {workload} | {size} | {us[0]} | {us[1]} | {us[2]} ({times['adaln_lab'] / floor_us:.2f}x) "
            f"| {repeat_text(repeating)} |")


def expected_rows() -> list[str]:
    """The table's rows from report.json (norm_out) and block_report.json (one H3 block's AdaLN): forward +
    backward CUDA-graph time per candidate, adaln_lab's over the memory floor, who repeats bitwise."""
    report = json.loads((EVIDENCE / "report.json").read_text())
    block = json.loads((EVIDENCE / "block_report.json").read_text())
    rows = []
    results = report["results"]["plain"]
    for size in report["protocol"]["accuracy_sizes"]:
        times = {name: results[name]["accuracy_latency"][str(size)]["fwd_bwd_us_graph"] for name in NAMES}
        repeating = [name for name in NAMES if results[name]["batch_invariance"]["params_repeatable"]]
        rows.append(row("norm_out", size, times, report["memory_floor"][str(size)]["fwd_bwd_us"], repeating))
    for size, figures in block["sizes"].items():
        candidates = figures["candidates"]
        times = {name: candidates[name]["fwd_bwd_us_graph"] for name in NAMES}
        repeating = [name for name in NAMES if candidates[name]["grads_repeat_bitwise"]]
        rows.append(row("H3 block AdaLN", size, times, figures["floor"]["fwd_bwd_us"], repeating))
    return rows


def manifest_rows() -> list[dict]:
    with open(EVIDENCE / "MANIFEST.csv", newline="") as f:
        rows = {r["file"]: r for r in csv.DictReader(f)}
    return [rows["report.json"], rows["block_report.json"]]


def test_readme_results_table_is_read_off_the_evidence_and_names_its_gpu_torch_and_commit():
    results = section(README.read_text(), "Results")
    lines = results.splitlines()
    assert lines.count(HEADER) == 1, "one results table"
    start = lines.index(HEADER) + 2
    expected = expected_rows()
    assert len(expected) == 4  # norm_out and the block, at two sizes each
    table = [line for line in lines[start:] if line.startswith("|")][:len(expected) + 1]
    assert table == expected
    text = " ".join(results.split())
    for made in manifest_rows():
        for column in ("gpu", "torch", "commit"):
            assert made[column] in text, f"the Results section does not name the evidence's {column} {made[column]!r}"
    pin = re.search(r'"torch==([\d.]+)"', README.read_text()).group(1)
    if not all(made["torch"].startswith(pin) for made in manifest_rows()):
        assert f"The pin is torch {pin}; these figures were not made with it." in text


# ----- the layout -----

ENTRY = re.compile(r"^( {0,4})(\S+)(.*)$")
FILE_TOKEN = re.compile(r"(?<![\w/.-])([\w-]+\.(?:py|md|sh|cuh|cu))\b")
DIR_TOKEN = re.compile(r"(?<![\w/.-])([\w-]+(?:/[\w-]+)*/)")


def layout_entries() -> dict:
    """{path relative to the root: its description} of the README's Layout block (entries indented 0, 2 or 4
    spaces under the last entry one level up; deeper-indented lines continue the description)."""
    blocks = [m.group(2) for m in FENCE.finditer(section(README.read_text(), "Layout")) if m.group(1) == "text"]
    assert len(blocks) == 1, "one ```text block in the Layout section"
    entries, stack, current = {}, [], None
    for line in blocks[0].splitlines():
        match = ENTRY.match(line)
        if match and len(match.group(1)) % 2 == 0 and (len(match.group(3)) == 0 or match.group(3).startswith("  ")):
            depth = len(match.group(1)) // 2
            stack = stack[:depth]
            current = "".join(stack) + match.group(2)
            if match.group(2).endswith("/"):
                stack.append(match.group(2))
            entries[current] = match.group(3)
        else:
            entries[current] += " " + line.strip()
    return entries


def test_readme_layout_names_only_what_exists_and_every_top_folder_and_package_folder():
    entries = layout_entries()
    for path, description in entries.items():
        assert (ROOT / path).exists(), f"the layout names {path}, which does not exist"
        where = ROOT / path if path.endswith("/") else ROOT
        for token in FILE_TOKEN.findall(description) + DIR_TOKEN.findall(description):
            found = (where / token).exists() or (ROOT / token).exists() or (PACKAGE / token).exists() or any(
                where.rglob(token.rstrip("/")))
            assert found, f"the layout's {path} mentions {token}, which is not there"
    for top in ("src/adaln_lab/", "src/adaln_lab/kernels_cu/", "docs/", "notebooks/", "bench/", "tests/"):
        assert top in entries, f"the layout leaves out {top}"
    for child in PACKAGE.iterdir():
        if child.name == "__pycache__" or child.name == "__init__.py" or child.suffix not in ("", ".py"):
            continue
        name = f"src/adaln_lab/{child.name}/" if child.is_dir() else f"src/adaln_lab/{child.name}"
        assert name in entries, f"the layout leaves out {name}"
    ops = entries["src/adaln_lab/ops/"]
    for op in (p.name for p in (PACKAGE / "ops").iterdir() if p.is_dir() and p.name != "__pycache__"):
        assert re.search(rf"\b{op}\b", ops), f"the layout's ops/ leaves out {op}"
