"""README.md runs as written on a CPU: every ```python block, in order, in one namespace (as a newcomer pastes
them into one session), in a fresh interpreter started at the checkout's root. No block is skipped; a block
that needs a GPU has to be written to run on a CPU too, or not be a python block."""

import os
import re
import subprocess
import sys

from tests.paths import ROOT

README = ROOT / "README.md"
FENCE = re.compile(r"^```(\S*)\n(.*?)^```$", flags=re.S | re.M)
LANGUAGES = {"python", "bash", "text"}  # the fences the README may use; only python blocks are code to run

RUNNER = """
import sys
blocks = {blocks!r}
namespace = {{"__name__": "__main__"}}
for line, source in blocks:
    print(f"README.md block at line {{line}}", file=sys.stderr, flush=True)
    exec(compile(source, f"README.md:{{line}}", "exec"), namespace)
print("ran", len(blocks), "blocks")
"""


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(line of the opening fence, source) of every ```python block, in order."""
    return [(text.count("\n", 0, m.start()) + 1, m.group(2)) for m in FENCE.finditer(text) if m.group(1) == "python"]


def test_readme_fences_are_known_languages_and_python_blocks_exist():
    text = README.read_text()
    languages = [m.group(1) for m in FENCE.finditer(text)]
    assert set(languages) <= LANGUAGES, f"unexpected fence languages: {set(languages) - LANGUAGES}"
    assert text.count("```") == 2 * len(languages), "an unpaired ``` fence"
    assert len(python_blocks(text)) >= 5


def test_readme_python_blocks_run_in_order_on_a_cpu():
    blocks = python_blocks(README.read_text())
    result = subprocess.run([sys.executable, "-c", RUNNER.format(blocks=blocks)], cwd=ROOT, capture_output=True,
                            text=True, timeout=540, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 0, f"{result.stderr[-4000:]}"
    assert result.stdout.strip().splitlines()[-1] == f"ran {len(blocks)} blocks"
    assert "timestep_indices holds 3, outside [0, T) = [0, 3)" in result.stdout
