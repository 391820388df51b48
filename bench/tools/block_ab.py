"""Same-run A/B of plan knobs and kernel text edits on one H3 block and norm_out, bitwise against shipped first."""

# Same-run A/B of launch and kernel choices on one H3 block's AdaLN forward+backward and on norm_out
# (issues 11 and 7).
#
# Variants: plan knobs and / or a checked text edit of a shipped kernel file. Those that keep every sum's
# order must give bitwise the outputs and gradients of `shipped` (checked before timing); those marked
# `reorders` (BWD_RANGES: the row ranges of the parameter sums) must give bitwise its outputs and row
# gradients (dx of the block: x's gradient) and parameter gradients within 2^-10 relative (l2) of shipped's,
# else they are not timed:
# - `shipped`: kernels_cu/ and the plan's TUNING as committed;
# - `fused_table_bwd`: TB_SPLIT_MIN_T beyond T_MAX: table_bwd_bf16 instead of its two halves
#   (table_bwd_d_weight_bf16, table_bwd_dact_bf16) wherever T >= 5, i.e. for `norm_out_T9` only;
# - `staged_forward`: FWD_STAGED_MIN_BLOCKS = 1: the block's 9-row table is staged in the forward (one
#   block per SM) instead of the row-per-block kernel;
# - `dact_on_stack`: table_bwd.cu with its combine loop over t not unrolled (`#pragma unroll 1`, made by a
#   checked text edit of the shipped file), so its dact accumulators live in local memory, as up to 9cf210c;
# - `gr96`, `gr128`: GR_THREADS_MAX = 96 / 128 (gated_residual.cu's block: 7 / 6 column tiles of 96 / 128
#   threads over the 672 vectors of H 5376; shipped: 256, i.e. 3 tiles of 224 threads, one wave of blocks;
#   128 was shipped up to 1d31f3d, whose A/B measured 224 3.1 % faster on the block at 32768 rows);
# - `bwd_threads384`, `bwd_threads256` (retree: another tree for the row backward's dot product, so dx
#   changes in its last bits; a screen, gradients within 2^-7 of shipped): BWD_THREADS_MAX = 384 / 256, i.e.
#   the row backward at H 5376 with 352 threads x 2 vectors / 224 x 3 instead of 672 x 1: the same bytes with
#   half / a third of the per-row bookkeeping and barrier participants (NOTES v13: the row pass looks bound
#   per row, not by bytes);
# - `bwd264`, `bwd264_s2` (reorders): BWD_RANGES = 264 (two row ranges per SM of an H200 for the norms' and
#   gated residuals' backward, twice the partial sums), the second with BWD_STAGES = 2 (less shared memory per
#   block, so two blocks of the norm's backward fit an SM with three staged inputs too).
# - `rp_t4`: RP_T_MAX = 4: reduce_partials sums 4 timesteps per pass (the block's 9 table rows in three
#   passes, as up to bd4d17b; shipped: all 9 in one pass; the same sums, the same bits);
# - `tb_rows128`, `tb_rows256`, `tb_threads512` (reorders: dact's partial sums over other row blocks, so
#   d_temb's bits): table_bwd with 128 weight rows per block for both kernels (v13's choice), 256 for the one
#   kernel, or 512 threads and 256 rows (shipped since v14: 512 rows for table_bwd_bf16, 256 for its halves; a
#   block's fixed work, d_table staging, SiLU of its columns, the dact combine, spread over more rows);
# - table.cu (v26: tensor cores, a block of TABLE_CHUNKS warps per tile of 16 MT rows x 8 NT timesteps, AHEAD weight
#   steps in flight; shipped: TABLE_TILES, (MT, NT, AHEAD) = (1, 1, 2) up to T = 8): `table_tile2x1`,
#   `table_tile4x1` (32 and 64 rows a tile), `table_ahead4` (four steps in flight). Every tile shape gives every
#   table element the same bits (the order is fixed by D alone), so all keep shipped's bits.
# - table_bwd.cu (v16: a warp whose rows all exist issues its first TB_EARLY = 4 weight loads before the block's
#   prologue, d_table staging and SiLU; the fused kernel capped at 128 registers, two blocks per SM): `tb_early0`
#   (none early), `tb_early8`. The same sums, the same bits.
# Times: CUDA-graph replay of forward+backward (harness.latency.graph_latency) at 4097 and 32768 rows,
# for the block (`block`: its table has T = 3 rows, so table_bwd is never split) and for norm_out's
# `final_adaln_out` at T = 3 (`norm_out`) and at T = 9 timesteps (`norm_out_T9`, where the split applies).
# Run (on a GPU):  python3 bench/tools/block_ab.py [VARIANT ...] > block_ab.json      (default: every variant)

import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from adaln_lab import final_adaln_out
from adaln_lab.core import launchers, loader, plan as plan_module
from adaln_lab.harness import block_report as br
from adaln_lab.harness.inputs import make
from adaln_lab.harness.latency import graph_latency


FUSED, STAGED = {"TB_SPLIT_MIN_T": plan_module.T_MAX + 1}, {"FWD_STAGED_MIN_BLOCKS": 1}
DACT_ON_STACK = {"table_bwd.cu": ("#pragma unroll\n        for (int t = 0; t < ADALN_T; ++t) {",
                                  "#pragma unroll 1\n        for (int t = 0; t < ADALN_T; ++t) {")}
VARIANTS = {  # name: (TUNING knobs, {kernel file: (text, replacement)})
    "shipped": ({}, {}),
    "fused_table_bwd": (FUSED, {}),
    "staged_forward": (STAGED, {}),
    "dact_on_stack": (FUSED, DACT_ON_STACK),
    "gr96": ({"GR_THREADS_MAX": 96}, {}),
    "gr128": ({"GR_THREADS_MAX": 128}, {}),
    "bwd264": ({"BWD_RANGES": 264}, {}),
    "bwd264_s2": ({"BWD_RANGES": 264, "BWD_STAGES": 2}, {}),
    "bwd_threads384": ({"BWD_THREADS_MAX": 384}, {}),
    "bwd_threads256": ({"BWD_THREADS_MAX": 256}, {}),
    "rp_t4": ({"RP_T_MAX": 4}, {}),
    "tb_rows128": ({"TB_ROWS": 128, "TB_SPLIT_ROWS": 128}, {}),
    "tb_rows256": ({"TB_ROWS": 256}, {}),
    "tb_threads512": ({"TB_THREADS": 512, "TB_ROWS": 256}, {}),
    "tb_early0": ({"TB_EARLY": 0}, {}),
    "tb_early8": ({"TB_EARLY": 8}, {}),
    "table_tile2x1": ({"TABLE_TILES": ((8, 2, 1, 2), (16, 2, 2, 4), (32, 2, 4, 3))}, {}),
    "table_tile4x1": ({"TABLE_TILES": ((8, 4, 1, 2), (16, 2, 2, 4), (32, 2, 4, 3))}, {}),
    "table_ahead4": ({"TABLE_TILES": ((8, 1, 1, 4), (16, 2, 2, 4), (32, 2, 4, 3))}, {}),
}
REORDERS = {"bwd264", "bwd264_s2", "tb_rows128", "tb_rows256", "tb_threads512"}
RETREES = {"bwd_threads384", "bwd_threads256"}
PARAMETER_RTOL = 2.0 ** -10
RETREE_RTOL = 2.0 ** -7
ROWS = (4097, 32768)


def use(knobs: dict, directory: Path, shipped: dict) -> None:
    """Kernels from `directory`, TUNING = `shipped` updated by `knobs`; forget every plan, module, launcher."""
    loader.kernel_dir = lambda: directory
    plan_module.TUNING.clear()
    plan_module.TUNING.update({**shipped, **knobs})
    launchers.forget_compiled()


def agrees(name: str, got: list, want: list, rows: int) -> bool:
    """got == want bitwise; for a `reorders` variant: the first `rows` tensors (output, row gradients) bitwise
    and the rest (parameter gradients) within PARAMETER_RTOL relative l2; for a `retrees` variant (another
    block tree for the row backward's dot product, so other dx bits): the output bitwise, every gradient
    within RETREE_RTOL relative l2 (a screen: adopting one needs the GPU tests' float64 bounds)."""
    if name in RETREES:
        return torch.equal(got[0], want[0]) and all(
            float((a.double() - b.double()).norm()) <= RETREE_RTOL * float(b.double().norm())
            for a, b in zip(got[1:], want[1:]))
    if name not in REORDERS:
        return all(torch.equal(a, b) for a, b in zip(got, want))
    exact = all(torch.equal(a, b) for a, b in zip(got[:rows], want[:rows]))
    return exact and all(float((a.double() - b.double()).norm()) <= PARAMETER_RTOL * float(b.double().norm())
                         for a, b in zip(got[rows:], want[rows:]))


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
    report = {"device": torch.cuda.get_device_name(),
              "variants": {k: [VARIANTS[k][0], VARIANTS[k][1]] for k in names},
              "reorders": sorted(REORDERS & set(names)), "retrees": sorted(RETREES & set(names)), "results": {}}
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
                    same = agrees(name, got, reference[(op, S)], 2)  # out, dx first in both kinds of case
                    result = {"agrees_with_shipped": same}
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
