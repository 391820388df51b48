"""A/B of kernel variants (adaln_lab.core.plan.TUNING) in one process, on the same inputs.

Nothing is timed before it is validated: every config's forward and gradients are first held to
the float64 golden with the GPU tests' bounds (tests/ops/test_final_adaln_out.py) and compared bitwise with
the first config; a config that fails is reported and not timed. Then each kernel is timed back to
back (adaln_lab.bench.timing.gpu_us) and the whole forward / forward+backward as CUDA-graph replays.
`default` alone is the evidence of the shipped kernels (sweep.json: each kernel timed alone, what
adaln_lab.lab.latency_sweep.sweep_kernels reads); the other configs pick what TUNING should hold.
Run (on a GPU): python3 -m adaln_lab.bench.sweep [CONFIG ...] > sweep.json
"""

import json
import sys

import torch

from adaln_lab.bench.timing import gpu_us, graph_us
from adaln_lab.core import launchers, loader, plan as plan_module
from adaln_lab.core.tensors import current_stream
from adaln_lab.harness.accuracy import GRAD_KEYS, SEED_GRAD_BOUNDS, correctly_rounded, golden_result, rel_err
from adaln_lab.harness.inputs import make, upstream

H, D, T = 5376, 2688, 3
BASE = dict(plan_module.TUNING)
CONFIGS = {  # TUNING overrides, each against the first (bench/NOTES.md v20, v21 have the last run of each)
    "default": {},
    "staged": dict(FWD_WARP_VECTORS_MAX=0),          # the staged row-block forward (v8 to v19)
    "no_pdl": dict(FWD_PDL=0),                       # the row-per-warp forward launched plainly after the table (v20)
    "table_4x4": dict(TABLE_TILES=((32, 4, 1, 2),)),  # norm_out's table (T = 3) on 64-row tiles
    "table_ahead4": dict(TABLE_TILES=((32, 1, 1, 4),)),  # four weight steps in flight instead of two
    "tb512x256": dict(TB_THREADS=512, TB_ROWS=256),
    "bwd_s3": dict(BWD_STAGES=3),
}


def use(config: dict):
    plan_module.TUNING.clear()
    plan_module.TUNING.update(BASE, **config)
    launchers.forget_compiled()


class Op:
    """The op's kernels on fixed buffers, for one config and one input."""

    def __init__(self, i, dy):
        self.i, self.dy = i, dy
        self.p = plan_module.plan(H, D, T)
        self.r = self.p.rows(i.x.shape[0])
        self.k = launchers.kernels(0, self.p)
        dev = i.x.device
        self.out, self.dx = torch.empty_like(i.x), torch.empty_like(i.x)
        self.fwd_ws = torch.empty(self.r.fwd_bytes, dtype=torch.uint8, device=dev)
        self.bwd_ws = torch.empty(self.r.bwd_bytes, dtype=torch.uint8, device=dev)
        self.d_nw, self.d_temb = torch.empty_like(i.norm_weight), torch.empty_like(i.temb)
        self.d_w, self.d_b = torch.empty_like(i.weight), torch.empty_like(i.bias)
        o, b = self.r.fwd_offsets, self.fwd_ws.data_ptr()
        self.table, self.table_f32, self.rstd = b + o["table"], b + o["table_f32"], b + o["rstd"]
        self.act = torch.empty(i.temb.shape, dtype=torch.bfloat16, device=dev)  # table.cu's scratch

    @property
    def s(self) -> int:
        """torch's current stream, read at each launch (a graph capture's stream while capturing)."""
        return current_stream(0)

    def table_step(self):
        i = self.i
        launchers.launch_table(self.k, self.p, self.s, i.temb.data_ptr(), i.weight.data_ptr(), i.bias.data_ptr(),
                               self.table, self.table_f32, self.act.data_ptr())

    def rows_step(self, after_table=False):
        i = self.i
        launchers.launch_norm_modulate(self.k, self.p, self.r, self.s, i.x.data_ptr(), i.norm_weight.data_ptr(),
                                       self.table, i.timestep_indices.data_ptr(), self.out.data_ptr(), self.rstd,
                                       i.x.shape[0], 1e-5, after_table=after_table)

    def backward(self):
        i = self.i
        launchers.launch_backward(
            self.k, self.p, self.r, self.s, dy=self.dy.data_ptr(), x=i.x.data_ptr(), rstd=self.rstd,
            norm_weight=i.norm_weight.data_ptr(), table_f32=self.table_f32,
            timestep_indices=i.timestep_indices.data_ptr(), temb=i.temb.data_ptr(), weight=i.weight.data_ptr(),
            workspace=self.bwd_ws.data_ptr(), dx=self.dx.data_ptr(), d_norm_weight=self.d_nw.data_ptr(),
            d_temb=self.d_temb.data_ptr(), d_weight=self.d_w.data_ptr(), d_bias=self.d_b.data_ptr(), S=i.x.shape[0])

    def forward(self):
        self.table_step()
        self.rows_step(after_table=True)

    def fwd_bwd(self):
        self.forward()
        self.backward()

    def results(self):
        rstd = self.fwd_ws[self.r.fwd_offsets["rstd"]:][: self.r.rows * 4].view(torch.float32)
        return {"out": self.out.clone(), "rstd": rstd.clone(), "x": self.dx.clone(), "norm_weight": self.d_nw.clone(),
                "temb": self.d_temb.clone(), "weight": self.d_w.clone(), "bias": self.d_b.clone()}

    def step_timings(self):
        """Back-to-back GPU us of each launcher, and graph replays of the forward and forward+backward."""
        o = self.r.bwd_offsets
        ws = self.bwd_ws.data_ptr()
        i = self.i

        def row_pass():
            launchers.launch_row_pass(self.k, self.p, self.r, self.s, self.dy.data_ptr(), i.x.data_ptr(), self.rstd,
                                      i.norm_weight.data_ptr(), self.table_f32, i.timestep_indices.data_ptr(),
                                      self.dx.data_ptr(), ws + o["row_partials"], i.x.shape[0])

        def reduce():
            launchers.launch_reduce_partials(self.k, self.p, self.r, self.s, ws + o["row_partials"],
                                             i.norm_weight.data_ptr(), self.table_f32, ws + o["d_table"],
                                             self.d_nw.data_ptr(), self.d_b.data_ptr())

        def table_bwd():
            launchers.launch_table_bwd(self.k, self.p, self.s, ws + o["d_table"], i.temb.data_ptr(),
                                       i.weight.data_ptr(), self.d_w.data_ptr(), ws + o["dact_partials"],
                                       self.d_temb.data_ptr())

        us = {"table": gpu_us(self.table_step), "norm_modulate": gpu_us(self.rows_step),
              "norm_modulate_bwd": gpu_us(row_pass), "reduce_partials": gpu_us(reduce),
              "table_bwd+reduce": gpu_us(table_bwd),
              "graph_fwd": graph_us(self.forward), "graph_fwd_bwd": graph_us(self.fwd_bwd)}
        return {k: round(v, 2) for k, v in us.items()}


def check(results: dict, gold_out, gold_grads, i) -> dict:
    """Errors against the float64 golden and whether each is within the GPU tests' bounds."""
    errs = {"fwd": rel_err(results["out"], gold_out)}
    errs.update({k: rel_err(results[k], gold_grads[k]) for k in ("x", "norm_weight", "temb", "weight", "bias")})
    errs["bias_correctly_rounded"] = correctly_rounded(results["bias"], gold_grads["bias"])
    ok = (errs["fwd"] <= 0.01 and errs["bias_correctly_rounded"] >= 0.999
          and all(errs[name] <= SEED_GRAD_BOUNDS[key] for name, key in GRAD_KEYS.items()
                  if key in SEED_GRAD_BOUNDS)
          and all(bool(torch.isfinite(v.float()).all()) for v in results.values()))
    return {"ok": ok, **{k: float(f"{v:.4g}") for k, v in errs.items()}}


def main():
    names = [a for a in sys.argv[1:] if a in CONFIGS] or list(CONFIGS)
    result = {}
    for S in (4097, 32768):
        i = make(1, S, "cuda")
        dy = upstream(1, i.x)
        gold_out, gold_grads = golden_result(i, dy)
        reference = None
        for name in names:
            use(CONFIGS[name])
            key = f"{S} {name}"
            try:
                op = Op(i, dy)
                op.fwd_bwd()
                torch.cuda.synchronize()
            except Exception as error:  # a variant that does not compile or launch: say so, go on
                result[key] = {"error": f"{type(error).__name__}: {str(error)[:400]}"}
                print(key, "failed", error, file=sys.stderr, flush=True)
                continue
            res = op.results()
            again = (op.fwd_bwd(), torch.cuda.synchronize(), op.results())[2]
            entry = {"check": check(res, gold_out, gold_grads, i),
                     "repeatable": all(torch.equal(res[k].view(torch.uint8) if res[k].dtype != torch.uint8 else res[k],
                                                   again[k].view(torch.uint8)) for k in res)}
            if reference is None:
                reference = res
            entry["bitwise_same_as_first"] = {k: bool(torch.equal(v, reference[k])) for k, v in res.items()}
            if entry["check"]["ok"] and entry["repeatable"]:
                entry["us"] = op.step_timings()
            res_regs = loader.kernel_resources(0, op.p)
            entry["regs_spill"] = {k: [v["registers"], v["local_bytes"]] for k, v in res_regs.items()}
            result[key] = entry
            print(key, json.dumps(entry.get("us")), json.dumps(entry["check"]),
                  [k for k, v in entry["bitwise_same_as_first"].items() if not v], file=sys.stderr, flush=True)
            del op
        del i, dy, gold_out, gold_grads
        torch.cuda.empty_cache()
    use({})
    json.dump(result, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
