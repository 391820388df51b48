"""CPU costs around the op at 4097 rows (development aid for bench/NOTES.md).

Prints JSON: (a) the forward call split into its parts, after a sync and back to back;
(b) forward+backward of an identity autograd.Function on the same five leaves: what torch's
autograd costs with no kernel of ours; (c) one launch through CuPy against one through ctypes
cuLaunchKernel with prebuilt argument storage; (d) torch.empty on CUDA.
Run: python bench/dev/cpu_costs.py
"""

import ctypes
import json
import statistics
import time

import torch

from adaln_lab import cupy_backend as cb
from adaln_lab import op
from adaln_lab.harness.candidates import adaln_lab_candidate
from adaln_lab.harness.inputs import make

REPS = 50
med = statistics.median
spent: dict[str, list[float]] = {}


def timed(name, f):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            spent.setdefault(name, []).append((time.perf_counter() - t0) * 1e6)
    return wrapper


def wall(step, sync_each: bool):
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    samples = []
    for _ in range(REPS):
        if sync_each:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        samples.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return med(samples)


class Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, nw, temb, w, b):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        return dy, None, None, None, None


def main():
    i = make(1, 4097, "cuda")
    fn = adaln_lab_candidate().fn
    leaves = [t.detach().clone().requires_grad_(True) for t in i.leaves]
    ones = torch.ones_like(i.x)
    out = {}

    # (a) forward split
    op.validate = timed("validate", op.validate)
    for name in ("table", "norm_modulate", "_launch", "final_adaln_out"):
        setattr(cb, name, timed(name, getattr(cb, name)))
    cb.FinalAdaLNOut.forward = staticmethod(timed("Function.forward", cb.FinalAdaLNOut.forward))
    for mode, sync_each in (("after_sync", True), ("back_to_back", False)):
        spent.clear()
        total = wall(lambda: fn(*leaves, i.timestep_indices), sync_each)
        out[f"forward_{mode}"] = {"call_us": total, **{k: med(v) for k, v in spent.items()}}

    # (b) autograd alone
    def identity_step():
        for leaf in leaves:
            leaf.grad = None
        Identity.apply(*leaves).backward(ones)

    def ours_step():
        for leaf in leaves:
            leaf.grad = None
        fn(*leaves, i.timestep_indices).backward(ones)

    out["identity_fwd_bwd_us"] = {"after_sync": wall(identity_step, True), "back_to_back": wall(identity_step, False)}
    out["ours_fwd_bwd_us"] = {"after_sync": wall(ours_step, True), "back_to_back": wall(ours_step, False)}

    # (c) one launch: CuPy against ctypes cuLaunchKernel
    H, D, T = 5376, 2688, 3
    tab, tab32 = cb.table(i.temb, i.weight, i.bias)
    dtab = torch.zeros_like(tab32)
    nblocks = 42
    parts = torch.zeros(nblocks, T, D, device="cuda")
    d_temb = torch.empty(T, D, device="cuda")
    args = (parts.data_ptr(), i.temb.data_ptr(), d_temb.data_ptr())
    import numpy as np

    def cupy_launch():
        cb._launch(i.x.device, H, D, T, "table_bwd_reduce", (D // 32, T), (32, 16), (*args, np.int32(nblocks)))

    libcuda = ctypes.CDLL("libcuda.so.1")
    launch = libcuda.cuLaunchKernel
    launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                                                                  ctypes.c_void_p]
    launch.restype = ctypes.c_int
    function = cb._module(0, H, D, T)["table_bwd_reduce"].kernel.ptr
    store = [ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_int32()]
    params = (ctypes.c_void_p * 4)(*[ctypes.cast(ctypes.pointer(s), ctypes.c_void_p) for s in store])

    def ctypes_launch():
        for s, a in zip(store, (*args, nblocks)):
            s.value = a
        stream = torch._C._cuda_getCurrentRawStream(0)
        err = launch(function, D // 32, T, 1, 32, 16, 1, 0, stream, params, None)
        if err:
            raise RuntimeError(f"cuLaunchKernel error {err}")

    cupy_launch()
    torch.cuda.synchronize()
    ref = d_temb.clone()
    d_temb.zero_()
    ctypes_launch()
    torch.cuda.synchronize()
    out["ctypes_launch_same_result"] = bool(torch.equal(ref, d_temb))
    out["launch_us"] = {"cupy": wall(cupy_launch, False), "ctypes": wall(ctypes_launch, False)}
    out["torch_empty_us"] = wall(lambda: torch.empty(4097, 5376, dtype=torch.bfloat16, device="cuda"), False)
    out["torch_empty_like_us"] = wall(lambda: torch.empty_like(i.x), False)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
