"""What the integration layers cost (eager Function, custom op, bare kernels) and each kernel's share of the graph."""

# One process, H200 sizes (H 5376, D 2688, T 3), 4097 and 32768 rows (issues 8 and 7):
# - for three ways to call the same kernels: `function` (the op's one autograd.Function, its launch ops called
#   directly as in eager code), `custom_op` (the same node with the launch ops through the dispatcher, as
#   torch.ops.adaln_lab.final_adaln_out_fwd / _bwd, what a compiled graph calls) and `kernels` (the launch ops on
#   preallocated outputs, no autograd at all): CUDA-graph replay time of forward and forward+backward
#   (harness.latency.graph_latency; `kernels` by the same capture), and for the two autograd paths the host time to
#   issue one call (harness.latency.host_latency); the same run's autograd floor (harness.latency.autograd_floor);
# - leave-one-out: the kernel sequence of one forward+backward captured in a graph with each kernel left out in
#   turn, and each kernel alone in a graph, so the graph's total can be split per kernel with the L2 state of the
#   real sequence.
# Each path is first checked bitwise against the `function` path.
# Run (on a GPU): python3 bench/tools/integration_cost.py > integration_cost.json

import json
import sys

import torch

from adaln_lab.bench.timing import graph_us
from adaln_lab.core import launchers
from adaln_lab.core.plan import plan as make_plan
from adaln_lab.core.tensors import current_stream
from adaln_lab.harness.inputs import make
from adaln_lab.harness.latency import autograd_floor, graph_latency, host_latency
from adaln_lab.core.plan import forward_workspace
from adaln_lab.ops.final_adaln_out import launch
from adaln_lab.ops.final_adaln_out.op import FinalAdaLNOut

EPS = 1e-5
WARMUP, ITERS = 5, 30


def function_path(*args):
    return FinalAdaLNOut.apply(*args, EPS, "cupy", "cuda")


class _Dispatched(torch.autograd.Function):
    """FinalAdaLNOut with its launch ops called through the dispatcher (torch.ops.adaln_lab.*)."""

    @staticmethod
    def forward(ctx, x, nw, temb, weight, bias, idx):
        H, (T, D) = x.shape[-1], temb.shape
        out = torch.empty_like(x)
        workspace = torch.empty(forward_workspace(T, H, x.numel() // H, D)[1], dtype=torch.uint8, device=x.device)
        launch.forward.op(x, nw, temb, weight, bias, idx, EPS, "cupy", "cuda", out, workspace)
        ctx.save_for_backward(x, nw, temb, weight, idx, workspace)
        return out

    @staticmethod
    def backward(ctx, dy):
        x, nw, temb, weight, idx, workspace = ctx.saved_tensors
        grads = (torch.empty_like(x), torch.empty_like(nw), torch.empty_like(temb), torch.empty_like(weight),
                 weight.new_empty(weight.shape[:1]))
        launch.backward.op(dy.contiguous(), x, nw, temb, weight, idx, workspace, "cupy", *grads)
        return (*grads, None)


def custom_op_path(*args):
    return _Dispatched.apply(*args)


def kernel_sequence(inputs, plan):
    """{kernel name: launch()} of one forward+backward on preallocated buffers, in launch order."""
    H = plan.H
    x, nw, temb, weight, bias = (t.detach() for t in inputs.leaves)
    idx = inputs.timestep_indices
    S = x.shape[-2]
    rows = plan.rows(x.numel() // H)
    k = launchers.kernels(x.device.index, plan)
    device_index = x.device.index

    def stream():  # read at launch time: inside a capture, torch's current stream is the capturing one
        return current_stream(device_index)

    fwd_ws = torch.empty(rows.fwd_bytes, dtype=torch.uint8, device=x.device)
    bwd_ws = torch.empty(rows.bwd_bytes, dtype=torch.uint8, device=x.device)
    fo, bo = rows.fwd_offsets, rows.bwd_offsets
    table, table_f32, rstd = (fwd_ws.data_ptr() + fo[name] for name in ("table", "table_f32", "rstd"))
    out, dx, dy = torch.empty_like(x), torch.empty_like(x), torch.ones_like(x)
    act = torch.empty(temb.shape, dtype=torch.bfloat16, device=x.device)  # table.cu's scratch
    grads = [torch.empty_like(t) for t in (nw, temb, weight, bias)]
    d_nw, d_temb, d_weight, d_bias = (g.data_ptr() for g in grads)
    row_partials, d_table, dact = (bwd_ws.data_ptr() + bo[n] for n in ("row_partials", "d_table", "dact_partials"))
    keep = (fwd_ws, bwd_ws, out, dx, dy, act, grads)
    return keep, {
        "table": lambda: launchers.launch_table(k, plan, stream(), temb.data_ptr(), weight.data_ptr(), bias.data_ptr(),
                                                table, table_f32, act.data_ptr()),
        "norm_modulate": lambda: launchers.launch_norm_modulate(k, plan, rows, stream(), x.data_ptr(), nw.data_ptr(),
                                                                table, idx.data_ptr(), out.data_ptr(), rstd, S, EPS),
        "row_pass": lambda: launchers.launch_row_pass(k, plan, rows, stream(), dy.data_ptr(), x.data_ptr(), rstd,
                                                      nw.data_ptr(), table_f32, idx.data_ptr(), dx.data_ptr(),
                                                      row_partials, S),
        "reduce_partials": lambda: launchers.launch_reduce_partials(k, plan, rows, stream(), row_partials, nw.data_ptr(),
                                                                    table_f32, d_table, d_nw, d_bias),
        "table_bwd": lambda: launchers.launch_table_bwd(k, plan, stream(), d_table, temb.data_ptr(), weight.data_ptr(),
                                                        d_weight, dact, d_temb),
    }


def leave_one_out(inputs, plan) -> dict:
    keep, launches = kernel_sequence(inputs, plan)
    names = list(launches)
    out = {"all": graph_us(lambda: [launches[n]() for n in names])}
    for left in names:
        out[f"without_{left}"] = graph_us(lambda: [launches[n]() for n in names if n != left])
        out[f"only_{left}"] = graph_us(launches[left])
    del keep
    return out


def kernels_only(inputs) -> dict:
    """Graph time of the launch ops on preallocated outputs, no autograd; outputs checked against `function`."""
    x, nw, temb, weight, bias = (t.detach() for t in inputs.leaves)
    idx = inputs.timestep_indices
    ones = torch.ones_like(x)
    H, (T, D) = x.shape[-1], temb.shape
    out = torch.empty_like(x)
    workspace = torch.empty(forward_workspace(T, H, x.numel() // H, D)[1], dtype=torch.uint8, device=x.device)
    grads = (torch.empty_like(x), torch.empty_like(nw), torch.empty_like(temb), torch.empty_like(weight),
             torch.empty_like(bias))

    def fwd():
        launch.forward(x, nw, temb, weight, bias, idx, EPS, "cupy", "cuda", out, workspace)
        return out

    def fwd_bwd():
        fwd()
        launch.backward(ones, x, nw, temb, weight, idx, workspace, "cupy", *grads)
        return out, grads

    leaves = [t.detach().clone().requires_grad_(True) for t in inputs.leaves]
    reference = function_path(*leaves, idx)
    reference.backward(ones)
    out, grads = fwd_bwd()
    same = torch.equal(out, reference) and all(torch.equal(g, leaf.grad) for g, leaf in zip(grads, leaves))
    return {"bitwise_equal_to_function": same,
            "fwd_us_graph": graph_us(fwd), "fwd_bwd_us_graph": graph_us(fwd_bwd)}


def check_custom_op(inputs) -> bool:
    idx = inputs.timestep_indices
    ones = torch.ones_like(inputs.x)
    results = []
    for path in (function_path, custom_op_path):
        leaves = [t.detach().clone().requires_grad_(True) for t in inputs.leaves]
        out = path(*leaves, idx)
        out.backward(ones)
        results.append([out.detach()] + [leaf.grad for leaf in leaves])
    return all(torch.equal(a, b) for a, b in zip(*results))


def main():
    H, D, T = 5376, 2688, 3
    plan = make_plan(H, D, T)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "sizes": {}}
    for S in (4097, 32768):
        inputs = make(1, S, "cuda")
        entry = {"custom_op_bitwise_equal_to_function": check_custom_op(inputs),
                 "kernels": kernels_only(inputs), "floor": autograd_floor(inputs, WARMUP, ITERS)}
        for name, path in (("function", function_path), ("custom_op", custom_op_path)):
            entry[name] = {**graph_latency(path, inputs, WARMUP, ITERS), **host_latency(path, inputs, WARMUP, ITERS)}
        entry["leave_one_out"] = leave_one_out(inputs, plan)
        report["sizes"][S] = entry
        print(S, json.dumps(entry), file=sys.stderr, flush=True)
    json.dump(report, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
