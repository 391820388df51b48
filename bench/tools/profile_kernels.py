"""Where the time of the CUDA op goes at the seed sizes: graph, eager and host time, host parts, registers."""

# - the whole op: forward and forward+backward as CUDA-graph replays (GPU time), back to back (20 calls between two
#   CUDA events), and the host's time to issue one call;
# - host costs of the parts: validate, torch.empty, one kernel launch, an identity autograd.Function over the five
#   leaves (returning the same gradient list each call, so AccumulateGrad copies: a higher floor than the report's
#   `autograd_floor_host_us`, whose gradients are stolen);
# - registers and spill bytes of every kernel. Per-kernel times: src/adaln_lab/bench/sweep.py.
# Run (on a GPU): python3 bench/tools/profile_kernels.py > profile_kernels.json

import json
import statistics
import sys
import time

import torch

from adaln_lab import final_adaln_out, validate
from adaln_lab.bench.timing import gpu_us, graph_us
from adaln_lab.core import launchers, loader
from adaln_lab.core.plan import plan as make_plan
from adaln_lab.core.tensors import current_stream
from adaln_lab.harness.inputs import make


def host_us(step, reps: int = 50) -> float:
    """Median CPU time to issue one call (synchronised before each, nothing waited on inside)."""
    for _ in range(5):
        step()
    samples = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        samples.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(samples)


class Identity(torch.autograd.Function):
    """torch's own floor: five leaves in, x out, a prepared gradient for each leaf back."""

    @staticmethod
    def forward(ctx, x, norm_weight, temb, weight, bias, grads):
        ctx.grads = grads
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        return (*ctx.grads, None)


def main():
    H, D, T = 5376, 2688, 3
    plan = make_plan(H, D, T)
    out = {"resources": loader.kernel_resources(0, plan)}
    for S in (4097, 32768):
        i = make(1, S, "cuda")
        leaves = [t.detach().clone().requires_grad_(True) for t in i.leaves]
        ones = torch.ones_like(i.x)

        def fwd():
            return final_adaln_out(*leaves, i.timestep_indices)

        def fwd_bwd():
            for leaf in leaves:
                leaf.grad = None
            final_adaln_out(*leaves, i.timestep_indices).backward(ones)

        def fwd_inference():
            with torch.inference_mode():
                final_adaln_out(*i.args)

        grads = [torch.zeros_like(t) for t in i.leaves]

        def floor():
            for leaf in leaves:
                leaf.grad = None
            Identity.apply(*leaves, grads).backward(ones)

        entry = {"graph_fwd_us": graph_us(lambda: fwd()), "graph_fwd_bwd_us": graph_us(fwd_bwd),
                 "eager_fwd_back_to_back_us": gpu_us(fwd), "eager_fwd_bwd_back_to_back_us": gpu_us(fwd_bwd),
                 "host_fwd_us": host_us(fwd), "host_fwd_bwd_us": host_us(fwd_bwd),
                 "host_fwd_inference_us": host_us(fwd_inference),
                 "host_autograd_floor_us": host_us(floor), "gpu_autograd_floor_us": gpu_us(floor)}
        if S == 4097:
            stream = current_stream(0)
            k = launchers.kernels(0, plan)
            rows = plan.rows(S)
            ws = torch.zeros(rows.bwd_bytes, dtype=torch.uint8, device="cuda")
            o, b = rows.bwd_offsets, ws.data_ptr()
            table_f32 = torch.zeros(T, 2 * H, device="cuda")
            d_nw, d_bias = torch.empty_like(i.norm_weight), torch.empty_like(i.bias)

            def one_launch():  # reduce_partials over zeros: the host cost of one launch
                launchers.launch_reduce_partials(k, plan, rows, stream, b + o["row_partials"], i.norm_weight.data_ptr(),
                                                 table_f32.data_ptr(), b + o["d_table"], d_nw.data_ptr(),
                                                 d_bias.data_ptr())

            entry["host_parts_us"] = {
                "validate": host_us(lambda: validate(*i.args, 1e-5, check_indices=False)),
                "torch_empty_small": host_us(lambda: torch.empty(1024, device="cuda")),
                "torch_empty_like_x": host_us(lambda: torch.empty_like(i.x)),
                "kernel_launch": host_us(one_launch),
                "current_device": host_us(torch.cuda.current_device),
            }
        out[S] = {k: (round(v, 2) if isinstance(v, float) else v) for k, v in entry.items()}
        print(S, json.dumps(out[S]), file=sys.stderr, flush=True)
    json.dump(out, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
