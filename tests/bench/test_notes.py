"""bench/NOTES.md is a performance log with one version sequence, and neither it nor bench/README.md names a path
that is gone.

- Versions: the rows of its version table (`| version | change | prediction | outcome |`) and its headings that
  start with one (`## vN: ...`, `### vN: ...`) read v1, v2, ... in order, none missing or repeated; no other
  heading starts with a version.
- Paths: a path (a token whose first part is a folder of the checkout, of src/, of src/adaln_lab/ or of bench/, e.g.
  `adaln_lab/bench/sweep.py`, `results/h100/`) exists; `REV:path` (a file of git's history) exists at REV; a bare file
  name (`table_bwd.cu`, `block_profile_33e296a.txt`) is a file of the checkout or sits in the folder of a `REV:path` of
  the same paragraph. A `REV:path` of a branch not merged into main names the branch in its paragraph (`branch NAME`):
  where a clone holds main alone, neither REV nor NAME is here and the reference, with the bare names of its
  paragraph, is left unchecked. The trees the runner's steps copy along (.old_tree/, .ab_tree/, .dtests/) are names,
  not paths of the checkout.
"""

from __future__ import annotations

import fnmatch
import re
import subprocess

import pytest

from adaln_lab.bench.steps import DEFAULT_BASE

from ..paths import PACKAGE, ROOT

NOTES = ROOT / "bench" / "NOTES.md"
README = ROOT / "bench" / "README.md"
BASES = (ROOT, ROOT / "bench", ROOT / "src", PACKAGE)
KNOWN = {p.name for base in BASES for p in base.iterdir() if p.is_dir()} | {"dev", "scripts"}
COPIED = {*(name.strip("/") for name in DEFAULT_BASE.values()), ".dtests"}
EXTENSIONS = r"(?:py|json|txt|cu|cuh|md|csv|sh|ipynb|tgz)"
GIT_REF = re.compile(r"\b([0-9a-f]{7,40}):((?:src|adaln_lab|bench|tests|kernels_cu|notebooks|docs)/[\w./*-]*)")
PATH = re.compile(r"(?<![\w./:<>-])(\.?[\w-]+/(?:[\w.*-]+/?)*)")
BARE = re.compile(rf"(?<![\w./:*-])([\w*-]+\.{EXTENSIONS})(?![\w/])")
BRANCH = re.compile(r"\bbranch ([\w.-]*\w)")
VERSION_HEADING = re.compile(r"^#+ v(\d+)\b")


def versions(text: str) -> list[int]:
    """The version numbers of the table rows and headings, in the order the log gives them."""
    found, in_table = [], False
    for line in text.splitlines():
        if line.startswith("| version |"):
            in_table = True
        elif not line.startswith("|"):
            in_table = False
        row = re.match(r"\| v(\d+) \|", line)
        if in_table and row:
            found.append(int(row.group(1)))
        heading = VERSION_HEADING.match(line)
        if heading:
            assert re.match(r"^#+ v\d+: ", line), f"a heading that starts with a version reads 'vN: ...': {line}"
            found.append(int(heading.group(1)))
    return found


def test_the_log_has_one_version_sequence():
    found = versions(NOTES.read_text())
    assert len(found) >= 20 and found == list(range(1, len(found) + 1)), found


def test_the_sequence_check_catches_a_restart_and_a_repeat():
    table = "| version | change | prediction | outcome |\n|---|---|---|---|\n| v1 | a | b | c |\n| v2 | a | b | c |\n"
    assert versions(table + "\n## v3: next\n") == [1, 2, 3]
    assert versions(table + "\n## v1: again\n") == [1, 2, 1]
    assert versions("## v4: one\n### v4: the same\n") == [4, 4]
    with pytest.raises(AssertionError, match="reads 'vN: ...'"):
        versions("### v9, a subsection\n")


def in_tree(path: str) -> bool:
    return any((base / path.rstrip("/")).exists() for base in BASES)


def paths(text: str) -> list[str]:
    """The tokens of `text` that name a path of the checkout (git refs and copied trees left out)."""
    text = GIT_REF.sub(" ", text)
    found = []
    for token in PATH.findall(text):
        token = token.rstrip(".,;:)")
        first = token.split("/")[0]
        if first in KNOWN and first not in COPIED and "*" not in token:
            found.append(token)
    return found


def git_exists(rev: str, path: str) -> bool:
    return git_ok("cat-file", "-e", f"{rev}:{path.rstrip('/')}")


def git_names(rev: str, folder: str) -> list[str]:
    done = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", f"{rev}:{folder}"], capture_output=True,
                          text=True)
    return done.stdout.split() if done.returncode == 0 else []


@pytest.mark.parametrize("document", [NOTES, README], ids=["NOTES.md", "README.md"])
def test_every_path_named_exists(document):
    named = paths(document.read_text())
    assert len(named) >= (20 if document == NOTES else 5)
    assert [p for p in named if not in_tree(p)] == []


def test_the_path_check_catches_the_paths_that_went():
    gone = "`bench/scripts/sweep.py`, `dev/variants.py`, `results/h200/report.json`, `cuda/launchers.py`"
    assert [p for p in paths(gone) if not in_tree(p)] == ["bench/scripts/sweep.py", "dev/variants.py",
                                                          "results/h200/report.json"]
    assert paths("`.old_tree/`, `/tmp/site`, `DIR/all.tgz`, TB/s, A/B, `1be521e:bench/results/h100/x.txt`") == []


def history() -> bool:
    """Whether git's history is here to look REV:path up in (not a copy without .git, not a shallow clone)."""
    done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--is-shallow-repository"], capture_output=True,
                          text=True)
    return done.returncode == 0 and done.stdout.strip() == "false"


def git_ok(*args: str) -> bool:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True).returncode == 0


def branch_here(name: str) -> bool:
    """Whether this clone has the branch (or any ref of that name)."""
    return any(git_ok("rev-parse", "--verify", "-q", f"{ref}^{{commit}}") for ref in (name, f"origin/{name}"))


def check_paragraph(paragraph: str, names: set[str]) -> tuple[int, list[str]]:
    """(references checked, references missing) of one paragraph of the log.

    A `REV:path` whose REV is not a commit of this clone counts as checked elsewhere only when the paragraph names
    the branch that holds it (`branch NAME`) and that branch is not here either (a clone of main alone); with the
    branch here, REV must be in it. Such a paragraph's bare names are then checked elsewhere too: the folder they sit
    in is not here to list."""
    checked, missing, away = 0, [], False
    refs = GIT_REF.findall(paragraph)
    for rev, path in refs:
        checked += 1
        if git_exists(rev, path):
            continue
        elsewhere = any(not branch_here(b) for b in BRANCH.findall(paragraph))  # only where a ref is missing
        if elsewhere and not git_ok("cat-file", "-e", f"{rev}^{{commit}}"):
            away = True
        else:
            missing.append(f"{rev}:{path}")
    folders = {(rev, path.rstrip("/") if path.endswith("/") else path.rsplit("/", 1)[0]) for rev, path in refs}
    beside = [name for rev, folder in folders for name in git_names(rev, folder)]
    for name in BARE.findall(GIT_REF.sub(" ", paragraph)):
        checked += 1
        if not (fnmatch.filter(names, name) or fnmatch.filter(beside, name) or away):
            missing.append(name)
    return checked, missing


@pytest.mark.skipif(not history(), reason="no full git history here: REV:path cannot be looked up")
def test_every_file_of_gits_history_and_every_bare_file_name_in_the_log_exists():
    checked, missing = 0, []
    names = {p.name for p in ROOT.rglob("*") if ".git" not in p.parts}
    for paragraph in re.split(r"\n\s*\n", NOTES.read_text()):
        done, gone = check_paragraph(paragraph, names)
        checked, missing = checked + done, missing + gone
    assert checked >= 60 and missing == []


@pytest.mark.skipif(not history(), reason="no full git history here: REV:path cannot be looked up")
def test_the_history_check_catches_a_missing_file_a_missing_commit_and_a_branch_that_lacks_it():
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    assert check_paragraph(f"{head}:src/adaln_lab/__init__.py", set()) == (1, [])
    assert check_paragraph(f"{head}:src/adaln_lab/gone.py", set()) == (1, [f"{head}:src/adaln_lab/gone.py"])
    assert check_paragraph("0000001:src/x.py", set()) == (1, ["0000001:src/x.py"])
    assert check_paragraph("on branch no-such-branch-here: 0000001:src/x.py", set()) == (1, [])
    assert check_paragraph("on branch HEAD: 0000001:src/x.py", set()) == (1, ["0000001:src/x.py"])
    assert check_paragraph("on branch no-such-branch-here: 0000001:bench/x.txt beside y.txt", set()) == (2, [])
    assert check_paragraph("0000001:bench/x.txt beside y.txt", set()) == (2, ["0000001:bench/x.txt", "y.txt"])
    assert check_paragraph(f"{head}:src/adaln_lab/__init__.py beside gone.txt", set()) == (2, ["gone.txt"])
    assert check_paragraph("table_bwd.cu and gone_away.cu", {"table_bwd.cu"}) == (2, ["gone_away.cu"])
