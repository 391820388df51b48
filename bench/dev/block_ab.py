"""Same-run A/B of two launch-tuning changes on one H3 block's AdaLN forward+backward (issue 11).

Variants (adaln_lab.plan.TUNING overrides; neither changes any arithmetic, so every variant must give
bitwise the same output and gradients as `before`, checked before anything is timed):
- TB_BATCH: weight rows table_bwd.cu loads before using them (1 = one at a time, as before);
- FWD_STAGED_MIN_BLOCKS: the staged forward (table rows in shared memory) only when that many blocks fit an
  SM; the block's 9 table rows fit once only, so 2 sends its norms to the row-per-block kernel.
Times: CUDA-graph replay of forward+backward (harness.latency.graph_latency) at 4097 and 32768 rows.
Run (on a GPU):  python bench/dev/block_ab.py > block_ab.json
"""

import json
import sys

import torch

from adaln_lab import plan as plan_module
from adaln_lab.harness import block_report as br
from adaln_lab.harness.latency import graph_latency

VARIANTS = {"before": {"TB_BATCH": 1, "FWD_STAGED_MIN_BLOCKS": 1},
            "tb_batch_4": {"TB_BATCH": 4, "FWD_STAGED_MIN_BLOCKS": 1},
            "tb_batch_4_row_per_block": {"TB_BATCH": 4, "FWD_STAGED_MIN_BLOCKS": 2}}


def main():
    H, D, T = br.H_REAL, br.D_REAL, br.T_REAL
    inputs = {S: br.make_block(1, S, "cuda", H=H, D=D, T=T) for S in (4097, 32768)}
    dy = {S: torch.ones_like(batch.x) for S, batch in inputs.items()}
    fn = br.CANDIDATES["adaln_lab"][1](H, D)
    saved = dict(plan_module.TUNING)
    reference, report = {}, {"device": torch.cuda.get_device_name(), "variants": VARIANTS, "results": {}}
    try:
        for name, overrides in VARIANTS.items():
            plan_module.TUNING.update(overrides)
            plan_module.clear_caches()
            entry = {}
            for S, batch in inputs.items():
                out, grads = br.forward_backward(fn, batch, dy[S])
                got = [out, *grads.values()]
                reference.setdefault(S, got)
                same = all(torch.equal(a, b) for a, b in zip(got, reference[S]))
                entry[S] = {"bitwise_equal_to_before": same}
                if same:
                    entry[S].update(graph_latency(fn, batch, 5, 15))
                print(name, S, json.dumps(entry[S]), file=sys.stderr, flush=True)
            report["results"][name] = entry
    finally:
        plan_module.TUNING.clear()
        plan_module.TUNING.update(saved)
        plan_module.clear_caches()
    json.dump(report, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
