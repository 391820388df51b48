"""Debug: each backward kernel's output against torch, launched through launchers.Kernel and through CuPy."""
import sys

import torch

from adaln_lab import launchers, loader
from adaln_lab.cuda_op import current_stream, forward_tensors
from adaln_lab.harness.inputs import make, upstream
from adaln_lab.plan import plan as make_plan

H, D, T = int(sys.argv[2]), int(sys.argv[3]), 3
S = int(sys.argv[1]) if len(sys.argv) > 1 else 300
i = make(1, S, "cuda", H=H, D=D, T=T)
dy = upstream(1, i.x)
p = make_plan(H, D, T)
r = p.rows(S)
out, saved = forward_tensors(*i.args, 1e-5, "cuda")
_, _, keep, table_f32, rstd = saved
ws = keep
tf32 = ws[r.fwd_offsets["table_f32"]:][: T * 2 * H * 4].view(torch.float32).view(T, 2 * H)
rs = ws[r.fwd_offsets["rstd"]:][: S * 4].view(torch.float32)
k = launchers.kernels(0, p)
raw = loader.module(0, p)
s = current_stream(0)
bws = torch.full((r.bwd_bytes,), 0xFF, dtype=torch.uint8, device="cuda")  # NaN everywhere
o = r.bwd_offsets
dx = torch.empty_like(i.x)
k["norm_modulate_bwd_bf16"]((r.bwd_ranges, 1, 1), (p.bwd_threads, 1, 1), p.bwd_smem, s, dy.data_ptr(), i.x.data_ptr(),
                            rstd, i.norm_weight.data_ptr(), table_f32, i.timestep_indices.data_ptr(), dx.data_ptr(),
                            bws.data_ptr(), S, S, r.bwd_rows_per_range)
torch.cuda.synchronize()
parts = bws[: r.bwd_ranges * T * 2 * H * 4].view(torch.float32).view(r.bwd_ranges, T, 2, H)
xhat = i.x.float() * rs[:, None]
A = torch.zeros(T, H, device="cuda").index_add_(0, i.timestep_indices, dy.float() * xhat)
B = torch.zeros(T, H, device="cuda").index_add_(0, i.timestep_indices, dy.float())
print("partials NaN", int(torch.isnan(parts).sum()), "A err", float((parts[:, :, 0].sum(0) - A).abs().max()), "B err", float((parts[:, :, 1].sum(0) - B).abs().max()))
d_nw, d_b = torch.zeros_like(i.norm_weight), torch.zeros_like(i.bias)
for mode in ("Kernel", "cupy"):
    d_table = bws[o["d_table"]:][: T * 2 * H * 4].view(torch.float32).view(T, 2 * H)
    d_table.zero_(); d_nw.zero_(); d_b.zero_()
    args = (bws.data_ptr(), i.norm_weight.data_ptr(), table_f32, bws.data_ptr() + o["d_table"], d_nw.data_ptr(),
            d_b.data_ptr(), r.bwd_ranges, bws.data_ptr() + o["counters"])
    if mode == "Kernel":
        k["reduce_partials_bf16"]((-(-H // 32), 1, 1), (32, p.sum_groups, 1), 0, s, *args)
    else:
        import cupy
        import numpy as np
        f = raw["reduce_partials_bf16"]
        f((-(-H // 32),), (32, p.sum_groups), tuple(np.int32(a) if j == 6 else np.uint64(a) for j, a in enumerate(args)),
          stream=cupy.cuda.ExternalStream(s))
    torch.cuda.synchronize()
    ref_table = torch.cat([B, i.norm_weight.float() * A], dim=1)
    print(mode, "d_table err", float((d_table - ref_table).abs().max()), "max", float(ref_table.abs().max()),
          "d_nw", d_nw[:4].tolist(), "d_b", d_b[:4].tolist(), "ref_b", ref_table.sum(0)[:4].tolist())

d_table_before = d_table.clone(); nw_before = d_nw.clone(); b_before = d_b.clone()
d_w, d_temb = torch.empty_like(i.weight), torch.empty_like(i.temb)
k["table_bwd_bf16"]((p.d_tiles, p.blocks_j, 1), (p.tb_threads, 1, 1), 0, s, bws.data_ptr() + o["d_table"],
                    i.temb.data_ptr(), i.weight.data_ptr(), d_w.data_ptr(), bws.data_ptr() + o["dact_partials"],
                    d_temb.data_ptr(), bws.data_ptr() + o["counters"])
torch.cuda.synchronize()
print("after table_bwd: d_table same", torch.equal(d_table, d_table_before), "d_nw same", torch.equal(d_nw, nw_before),
      "d_b same", torch.equal(d_b, b_before))
act = torch.nn.functional.silu(i.temb.double())
ref_w = d_table.double().T @ act
sig = torch.sigmoid(i.temb.double())
ref_temb = (d_table.double() @ i.weight.double()) * sig * (1 + i.temb.double() * (1 - sig))
print("d_weight err", float((d_w.double() - ref_w).abs().max() / ref_w.abs().max()),
      "d_temb err", float((d_temb.double() - ref_temb).abs().max() / ref_temb.abs().max()),
      "counters", bws[o["counters"]:o["counters"] + 4 * p.d_tiles].view(torch.int32).tolist())
ws2 = torch.full((r.bwd_bytes,), 0xFF, dtype=torch.uint8, device="cuda")
g2 = [torch.empty_like(t) for t in (i.x, i.norm_weight, i.temb, i.weight, i.bias)]
launchers.launch_backward(k, p, r, s, dy=dy.data_ptr(), x=i.x.data_ptr(), rstd=rstd, norm_weight=i.norm_weight.data_ptr(),
                          table_f32=table_f32, timestep_indices=i.timestep_indices.data_ptr(), temb=i.temb.data_ptr(),
                          weight=i.weight.data_ptr(), workspace=ws2.data_ptr(), dx=g2[0].data_ptr(),
                          d_norm_weight=g2[1].data_ptr(), d_temb=g2[2].data_ptr(), d_weight=g2[3].data_ptr(),
                          d_bias=g2[4].data_ptr(), S=S)
torch.cuda.synchronize()
print("launch_backward equal to stepwise: dx", torch.equal(g2[0], dx), "nw", torch.equal(g2[1], d_nw), "temb",
      torch.equal(g2[2], d_temb), "w", torch.equal(g2[3], d_w), "b", torch.equal(g2[4], d_b))
from adaln_lab.harness.candidates import adaln_lab_candidate
leaves = [t.detach().clone().requires_grad_(True) for t in i.leaves]
adaln_lab_candidate().fn(*leaves, i.timestep_indices).backward(dy)
torch.cuda.synchronize()
print("autograd equal to stepwise: dx", torch.equal(leaves[0].grad, dx), "nw", torch.equal(leaves[1].grad, d_nw),
      "temb", torch.equal(leaves[2].grad, d_temb), "w", torch.equal(leaves[3].grad, d_w), "b", torch.equal(leaves[4].grad, d_b))
