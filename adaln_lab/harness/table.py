"""A markdown summary of a report JSON: the README's results table is this function's output."""

from __future__ import annotations

GRADS = ("x", "nw", "temb", "w", "b")


def markdown(report: dict) -> str:
    floor = report["memory_floor"]
    sizes = list(floor)
    head = ["candidate", "batch invariant", "params repeat"]
    for S in sizes:
        head += [f"fwd us @{S} (x floor)", f"fwd+bwd us @{S} (x floor)", f"grad err x/nw/temb/w/b @{S}"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, entry in report["results"]["plain"].items():
        invariance = entry["batch_invariance"]
        cells = [name, "yes" if invariance["batch_invariant"] else "no",
                 "yes" if invariance["params_repeatable"] else "no"]
        for S in sizes:
            a = entry["accuracy_latency"][S]
            cells += [f"{a['fwd_us']:.0f} ({a['fwd_us'] / floor[S]['fwd_us']:.2f}x)",
                      f"{a['fwd_bwd_us_pure']:.0f} ({a['fwd_bwd_us_pure'] / floor[S]['fwd_bwd_us']:.2f}x)",
                      " / ".join(f"{a['grad_rel_err'][g]:.2g}" for g in GRADS)]
        rows.append("| " + " | ".join(cells) + " |")
    floors = ", ".join(f"{S} rows: fwd {f['fwd_us']:.1f} us, fwd+bwd {f['fwd_bwd_us']:.1f} us" for S, f in floor.items())
    env = report["environment"]
    return "\n".join(rows) + (f"\n\n{env.get('gpu') or env.get('cpu')}, copy {report['copy_TBps']:.2f} TB/s; "
                              f"memory floor {floors}; commit {str(report.get('adaln_lab_commit'))[:7]}.")
