"""Development A/B of kernel variants (cupy_backend.TUNING) in one process, on the same inputs.

Each config is a full TUNING; every kernel is timed under every config (back-to-back GPU time,
profile_kernels.gpu_us) at 4097 and 32768 rows, and its outputs are compared bitwise with the
first config's. When bench/dev/v4_kernels holds the previous session's kernels (ignored by git:
`git show 3a1c845:kernels_cu/<file>` for each, carried to the device), they are timed in the same
process as the baseline. Not evidence: it picks what TUNING should hold.
Run: python bench/dev/sweep.py > sweep.json
"""

import json
import sys
from pathlib import Path

import torch

from adaln_lab import cupy_backend as cb
from adaln_lab.harness.inputs import make, upstream

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from profile_kernels import gpu_us  # noqa: E402

H, D, T = 5376, 2688, 3
BASE = dict(cb.TUNING)
CONFIGS = {  # TUNING overrides
    "default": {},
    "s3": dict(BWD_STAGES=3, TABLE_THREADS=1024),
    "s6": dict(BWD_STAGES=6, TB_ROWS=256),  # TB_THREADS > 256 no longer compiles (table_bwd.cu static_assert)
}
V4_DIR = Path(__file__).resolve().parent / "v4_kernels"


def v4_timings(i, dy, tab, tab32, rstd) -> dict:
    """The previous session's table, norm_modulate and norm_modulate_bwd (bench/dev/v4_kernels), timed in
    this process with their own launch convention: the baseline of this sweep."""
    import cupy
    import numpy as np

    S = i.x.shape[-2]
    rows = i.x.numel() // H
    parts = []
    for name in cb.KERNEL_FILES:
        text = (V4_DIR / name).read_text().replace(cb.INCLUDE_LINE, "")
        parts.append(f'#line 1 "v4/{name}"\n{text}')
    defines = (f"#define ADALN_H {H}\n#define ADALN_D {D}\n#define ADALN_T {T}\n#define ADALN_FWD_THREADS 224\n"
               "#define ADALN_FWD_VPT 3\n#define ADALN_BWD_THREADS 672\n#define ADALN_BWD_VPT 1\n")
    module = cupy.RawModule(code=defines + "\n".join(parts), options=cb.COMPILE_OPTIONS)
    k = {n: module.get_function(n).kernel for n in ("table_bf16", "norm_modulate_bf16", "norm_modulate_bwd_bf16")}
    stream = cb._stream(i.x.device)
    out, rstd4 = torch.empty_like(i.x), torch.empty_like(rstd)
    t_bf16, t_f32 = torch.empty_like(tab), torch.empty_like(tab32)
    per = max(1, min(2048, -(-rows // 132)))
    dx = torch.empty_like(i.x)
    row_partials = torch.empty(-(-rows // per), T, 2, H, device="cuda")
    p = lambda t: t.data_ptr()  # noqa: E731
    steps = {
        "table": lambda: k["table_bf16"]((336,), (256,), (p(i.temb), p(i.weight), p(i.bias), p(t_bf16), p(t_f32)),
                                         stream=stream),
        "norm_modulate": lambda: k["norm_modulate_bf16"](
            (rows,), (224,), (p(i.x), p(i.norm_weight), p(tab), p(i.timestep_indices), p(out), p(rstd4),
                              np.int32(S), np.float32(1e-5)), stream=stream),
        "norm_modulate_bwd": lambda: k["norm_modulate_bwd_bf16"](
            (-(-rows // per),), (672,), (p(dy), p(i.x), p(rstd), p(i.norm_weight), p(tab32), p(i.timestep_indices),
                                         p(dx), p(row_partials), np.int32(S), np.int32(rows), np.int32(per)),
            stream=stream),
    }
    return {name: round(gpu_us(step), 2) for name, step in steps.items()}


def use(config: dict):
    cb.TUNING.clear()
    cb.TUNING.update(BASE, **config)
    cb.clear_caches()


def run_all(i, dy):
    tab, tab32 = cb.table(i.temb, i.weight, i.bias)
    y, rstd = cb.norm_modulate(i.x, i.norm_weight, tab, i.timestep_indices, 1e-5, D)
    dx, parts = cb.norm_modulate_bwd(dy, i.x, rstd, i.norm_weight, tab32, i.timestep_indices, D)
    dtab, dnw, db = cb.reduce_partials(parts, i.norm_weight, tab32, D)
    dw, dtemb = cb.table_bwd(dtab, i.temb, i.weight)
    torch.cuda.synchronize()
    return dict(table=tab, table_f32=tab32, out=y, rstd=rstd, dx=dx, row_partials=parts, d_table=dtab,
                d_norm_weight=dnw, d_bias=db, d_weight=dw, d_temb=dtemb)


def main():
    configs = dict(CONFIGS)
    result = {}
    for S in (4097, 32768):
        i = make(1, S, "cuda")
        dy = upstream(1, i.x)
        reference = None
        for name, config in configs.items():
            use(config)
            try:
                outs = run_all(i, dy)
            except Exception as error:  # a variant that does not compile or launch: say so, go on
                result[f"{S} {name}"] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
                print(name, "failed", error, file=sys.stderr, flush=True)
                continue
            if reference is None:
                reference = outs
            same = {k: bool(torch.equal(v, reference[k])) for k, v in outs.items()}
            dtemb_diff = float((outs["d_temb"] - reference["d_temb"]).abs().max() /
                               reference["d_temb"].abs().max())
            tab, tab32 = outs["table"], outs["table_f32"]
            rstd, parts, dtab = outs["rstd"], outs["row_partials"], outs["d_table"]
            timings = {
                "table": gpu_us(lambda: cb.table(i.temb, i.weight, i.bias)),
                "norm_modulate": gpu_us(lambda: cb.norm_modulate(i.x, i.norm_weight, tab, i.timestep_indices, 1e-5, D)),
                "norm_modulate_bwd": gpu_us(lambda: cb.norm_modulate_bwd(dy, i.x, rstd, i.norm_weight, tab32,
                                                                         i.timestep_indices, D)),
                "reduce_partials": gpu_us(lambda: cb.reduce_partials(parts, i.norm_weight, tab32, D)),
                "table_bwd": gpu_us(lambda: cb.table_bwd(dtab, i.temb, i.weight)),
            }
            regs = {k: [v["registers"], v["local_bytes"]] for k, v in cb.kernel_resources(0, H, D, T).items()}
            entry = {"us": {k: round(v, 2) for k, v in timings.items()}, "bitwise_same": same,
                     "d_temb_rel_diff": dtemb_diff, "regs_spill": regs, "tuning": dict(cb.TUNING)}
            result[f"{S} {name}"] = entry
            print(S, name, json.dumps(entry["us"]), [k for k, v in same.items() if not v], file=sys.stderr, flush=True)
        if V4_DIR.is_dir():
            use({})
            outs = run_all(i, dy)
            result[f"{S} v4"] = {"us": v4_timings(i, dy, outs["table"], outs["table_f32"], outs["rstd"])}
            print(S, "v4", json.dumps(result[f"{S} v4"]["us"]), file=sys.stderr, flush=True)
    use({})
    json.dump(result, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
