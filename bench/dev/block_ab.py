"""Same-run A/B of launch and kernel choices on one H3 block's AdaLN forward+backward and on norm_out
(issues 11 and 7).

Variants (plan knobs, or a kernel file from bench/dev/experiments/ in place of kernels_cu's), none of
which changes any arithmetic, so each must give bitwise the outputs and gradients of `shipped` (checked
before it is timed):
- `shipped`: kernels_cu/ and the plan's TUNING as committed;
- `fused_table_bwd`: TB_SPLIT_MIN_T beyond T_MAX: table_bwd_bf16 instead of its two halves
  (table_bwd_d_weight_bf16, table_bwd_dact_bf16) wherever T >= 5, i.e. for `norm_out_T9` only;
- `staged_forward`: FWD_STAGED_MIN_BLOCKS = 1: the block's 9-row table is staged in the forward (one
  block per SM) instead of the row-per-block kernel;
- `dact_on_stack`: table_bwd.cu with its combine loop over t not unrolled (`#pragma unroll 1`, made by a
  checked text edit of the shipped file), so its dact accumulators live in local memory, as up to 9cf210c;
- `gr96`, `gr128`: GR_THREADS_MAX = 96 / 128 (gated_residual.cu's block: 7 / 6 column tiles of 96 / 128
  threads over the 672 vectors of H 5376; shipped: 256, i.e. 3 tiles of 224 threads, one wave of blocks;
  128 was shipped up to 1d31f3d, whose A/B measured 224 3.1 % faster on the block at 32768 rows);
- `9cf210c`: dact_on_stack with the staged forward: 9cf210c's launch choices, but on today's
  table_bwd.cu otherwise (d_table staged in shared memory, no bound check between a warp's rows), so
  not 9cf210c's kernels (those took 1705 / 4391 us at 4097 / 32768 rows in 9cf210c's own A/B run).
Times: CUDA-graph replay of forward+backward (harness.latency.graph_latency) at 4097 and 32768 rows,
for the block (`block`: its table has T = 3 rows, so table_bwd is never split) and for norm_out's
`final_adaln_out` at T = 3 (`norm_out`) and at T = 9 timesteps (`norm_out_T9`, where the split applies).
Run (on a GPU):  python bench/dev/block_ab.py [VARIANT ...] > block_ab.json      (default: every variant)
"""

import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from adaln_lab import final_adaln_out, launchers, loader
from adaln_lab import plan as plan_module
from adaln_lab.harness import block_report as br
from adaln_lab.harness.inputs import make
from adaln_lab.harness.latency import graph_latency

FUSED, STAGED = {"TB_SPLIT_MIN_T": plan_module.T_MAX + 1}, {"FWD_STAGED_MIN_BLOCKS": 1}
VARIANTS = {  # name: (TUNING knobs, {kernel file: (text, replacement)}: one checked edit of the shipped file)
    "shipped": ({}, {}),
    "fused_table_bwd": (FUSED, {}),
    "staged_forward": (STAGED, {}),
    "dact_on_stack": (FUSED, {"table_bwd.cu": ("#pragma unroll\n        for (int t = 0; t < ADALN_T; ++t) {",
                                                "#pragma unroll 1\n        for (int t = 0; t < ADALN_T; ++t) {")}),
    "9cf210c": ({**FUSED, **STAGED}, {"table_bwd.cu": ("#pragma unroll\n        for (int t = 0; t < ADALN_T; ++t) {",
                                                    "#pragma unroll 1\n        for (int t = 0; t < ADALN_T; ++t) {")}),
    "gr96": ({"GR_THREADS_MAX": 96}, {}),
    "gr128": ({"GR_THREADS_MAX": 128}, {}),
}
ROWS = (4097, 32768)


def use(knobs: dict, directory: Path, shipped: dict) -> None:
    """Kernels from `directory`, TUNING = `shipped` updated by `knobs`; forget every plan, module, launcher."""
    loader.kernel_dir = lambda: directory
    plan_module.TUNING.clear()
    plan_module.TUNING.update({**shipped, **knobs})
    launchers.forget_compiled()


def norm_out(x, norm_weight, temb, weight, bias, timestep_indices):
    return final_adaln_out(x, norm_weight, temb, weight, bias, timestep_indices)


def main():
    H, D, T = br.H_REAL, br.D_REAL, br.T_REAL
    torch.manual_seed(0)
    cases = {}
    for S in ROWS:
        batch = br.make_block(1, S, "cuda", H=H, D=D, T=T)
        cases[("block", S)] = (br.CANDIDATES["adaln_lab"][1](H, D), batch, torch.randn_like(batch.x))
        for op, T_ in (("norm_out", 3), ("norm_out_T9", 9)):
            inputs = make(1, S, "cuda", T=T_)
            cases[(op, S)] = (norm_out, inputs, torch.randn_like(inputs.x))
    original_dir = loader.kernel_dir
    shipped_dir, saved = original_dir(), dict(plan_module.TUNING)
    names = ["shipped", *[n for n in sys.argv[1:] if n != "shipped"]] if sys.argv[1:] else list(VARIANTS)
    unknown = set(names) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"unknown variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    report = {"device": torch.cuda.get_device_name(), "variants": {k: list(VARIANTS[k]) for k in names}, "results": {}}
    reference = {}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for name in names:
                knobs, files = VARIANTS[name]
                directory = shipped_dir
                if files:
                    directory = Path(tmp) / name
                    shutil.copytree(shipped_dir, directory)
                    for target, (old, new) in files.items():
                        text = (directory / target).read_text()
                        if text.count(old) != 1:
                            raise SystemExit(f"{name}: {old!r} is not in {target} exactly once")
                        (directory / target).write_text(text.replace(old, new))
                use(knobs, directory, saved)
                entry = {}
                for (op, S), (fn, batch, dy) in cases.items():
                    if op == "block":  # norm_out cases: final_adaln_out on Inputs
                        out, grads = br.forward_backward(fn, batch, dy)
                        got = [out, *grads.values()]
                    else:
                        leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in batch.args]
                        out = fn(*leaves)
                        out.backward(dy)
                        got = [out.detach()] + [t.grad for t in leaves if t.requires_grad]
                    reference.setdefault((op, S), got)
                    same = all(torch.equal(a, b) for a, b in zip(got, reference[(op, S)]))
                    result = {"bitwise_equal_to_shipped": same}
                    if same:
                        result.update(graph_latency(fn, batch, 5, 15))
                    entry[f"{op} {S}"] = result
                    print(name, op, S, json.dumps(result), file=sys.stderr, flush=True)
                report["results"][name] = entry
        finally:
            use({}, shipped_dir, saved)
            loader.kernel_dir = original_dir
    json.dump(report, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
