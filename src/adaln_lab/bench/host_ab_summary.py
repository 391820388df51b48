"""The verdict of a host A/B (the runner's `host-ab` step, host_ab.txt): each tree's figures against the identity floor
measured in the same round.

host_ab.txt holds rounds of `== TREE COMMIT` followed by host_breakdown's lines ("STEP NAME: host [cpu ]fwd[+bwd]
N us at R rows"), the base tree first in each round. The lent hosts' speed moves between rounds (the identity
floor, the same code in both trees, moved 164 to 358 us within one run), so a raw median compares rounds as much
as trees. Per step and measure this prints each tree's rounds, their median, and the median over rounds of the
figure divided by the same round's identity floor (host fwd+bwd and host cpu fwd+bwd; the forward has no floor of
its own, so its ratio is to the fwd+bwd floor); `no slower` holds where this tree's median ratio is at most the
base's.

    python3 -m adaln_lab.bench.host_ab_summary host_ab.txt
"""

from __future__ import annotations

import argparse
import re
import statistics
from collections import defaultdict
from pathlib import Path

HEADER = re.compile(r"^== (\S+) (\S+)")
FIGURE = re.compile(r"^(\w+) (adaln_lab|identity floor): host (cpu )?(fwd\+bwd|fwd) (\d+(?:\.\d+)?) us")


def parse(text: str) -> tuple[list[str], dict]:
    """(commits in order of first appearance, {(commit, step, name, clock, phase): [value of each round]}): step
    "final_adaln_out" or "block", name "adaln_lab" or "floor", clock "wall" or "cpu", phase "fwd+bwd" or "fwd"."""
    commits, figures, commit = [], defaultdict(list), None
    for line in text.splitlines():
        header = HEADER.match(line)
        if header:
            commit = header.group(2)
            if commit not in commits:
                commits.append(commit)
            continue
        figure = FIGURE.match(line)
        if figure and commit is not None:
            step, name, cpu, phase, value = figure.groups()
            name = "floor" if name == "identity floor" else name
            figures[(commit, step, name, "cpu" if cpu else "wall", phase)].append(float(value))
    return commits, figures


def rows(text: str) -> list[dict]:
    """One row per (step, clock, phase) of adaln_lab: for the base tree and this one, the rounds, their median and
    the median ratio to the same round's floor, and whether this tree's median ratio is at most the base's."""
    commits, figures = parse(text)
    if len(commits) != 2:
        raise ValueError(f"host_ab_summary: expected two trees in the file, found {commits or 'none'}")
    out = []
    for step in sorted({key[1] for key in figures}):
        for clock in ("wall", "cpu"):
            for phase in ("fwd+bwd", "fwd"):
                row = {"step": step, "clock": clock, "phase": phase}
                for label, commit in zip(("base", "this"), commits):
                    values = figures.get((commit, step, "adaln_lab", clock, phase), [])
                    floors = figures.get((commit, step, "floor", clock, "fwd+bwd"), [])
                    if not values or len(floors) != len(values):
                        break
                    row[label] = {"commit": commit, "rounds": values, "median": statistics.median(values),
                                  "ratio": statistics.median(v / f for v, f in zip(values, floors))}
                else:
                    row["no_slower"] = row["this"]["ratio"] <= row["base"]["ratio"]
                    out.append(row)
    return out


def table(text: str) -> str:
    """rows() as aligned text lines."""
    lines = []
    for r in rows(text):
        base, this = r["base"], r["this"]
        lines.append(f"{r['step']:16s} {r['clock']:4s} {r['phase']:7s} "
                     f"{base['commit']} median {base['median']:7.1f} us ({base['ratio']:.2f}x floor)  "
                     f"{this['commit']} median {this['median']:7.1f} us ({this['ratio']:.2f}x floor)  "
                     f"{'no slower' if r['no_slower'] else 'SLOWER'}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", type=Path, help="a host-ab step's host_ab.txt")
    args = parser.parse_args(argv)
    print(table(args.file.read_text()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
