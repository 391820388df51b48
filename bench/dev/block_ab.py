"""Same-run A/B of two launch changes on one H3 block's AdaLN forward+backward (issue 11).

Variants, none of which changes any arithmetic, so each must give bitwise the output and gradients of
`shipped` (checked before it is timed):
- `table_bwd_batched`: bench/dev/experiments/table_bwd_batched.cu in place of kernels_cu/table_bwd.cu
  (each thread loads TB_BATCH = 4 weight rows before using them);
- `row_per_block`: TUNING["FWD_STAGED_MIN_BLOCKS"] = 2, so a plan whose staged forward fits one block per
  SM (the block's 9 table rows) uses the row-per-block kernel;
- `both`.
Times: CUDA-graph replay of forward+backward (harness.latency.graph_latency) at 4097 and 32768 rows.
Run (on a GPU):  python bench/dev/block_ab.py > block_ab.json
"""

import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from adaln_lab import launchers, loader
from adaln_lab import plan as plan_module
from adaln_lab.harness import block_report as br
from adaln_lab.harness.latency import graph_latency

EXPERIMENT = Path(__file__).resolve().parent / "experiments" / "table_bwd_batched.cu"
VARIANTS = {"shipped": (False, 1), "table_bwd_batched": (True, 1), "row_per_block": (False, 2), "both": (True, 2)}


def use(directory: Path, min_blocks: int) -> None:
    """Point the loader at `directory` (kernels_cu/ or a copy with the experiment in place), set the
    plan's knob, and forget every plan, compiled module and launcher."""
    loader.kernel_dir = lambda: directory
    plan_module.TUNING["FWD_STAGED_MIN_BLOCKS"] = min_blocks
    plan_module.clear_caches()
    loader.clear_caches()
    launchers.kernels.cache_clear()


def main():
    H, D, T = br.H_REAL, br.D_REAL, br.T_REAL
    original_dir = loader.kernel_dir
    shipped_dir = original_dir()
    with tempfile.TemporaryDirectory() as tmp:
        variant_dir = Path(tmp)
        for f in shipped_dir.iterdir():
            shutil.copy(f, variant_dir / f.name)
        shutil.copy(EXPERIMENT, variant_dir / "table_bwd.cu")
        inputs = {S: br.make_block(1, S, "cuda", H=H, D=D, T=T) for S in (4097, 32768)}
        dy = {S: torch.ones_like(batch.x) for S, batch in inputs.items()}
        fn = br.CANDIDATES["adaln_lab"][1](H, D)
        saved = dict(plan_module.TUNING)
        reference, report = {}, {"device": torch.cuda.get_device_name(), "variants": VARIANTS, "results": {}}
        try:
            for name, (batched, min_blocks) in VARIANTS.items():
                use(variant_dir if batched else shipped_dir, min_blocks)
                entry = {}
                for S, batch in inputs.items():
                    out, grads = br.forward_backward(fn, batch, dy[S])
                    got = [out, *grads.values()]
                    reference.setdefault(S, got)
                    entry[S] = {"bitwise_equal_to_shipped": all(torch.equal(a, b) for a, b in zip(got, reference[S]))}
                    if entry[S]["bitwise_equal_to_shipped"]:
                        entry[S].update(graph_latency(fn, batch, 5, 15))
                    print(name, S, json.dumps(entry[S]), file=sys.stderr, flush=True)
                report["results"][name] = entry
        finally:
            loader.kernel_dir = original_dir
            plan_module.TUNING.clear()
            plan_module.TUNING.update(saved)
            plan_module.clear_caches()
            loader.clear_caches()
            launchers.kernels.cache_clear()
    json.dump(report, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
