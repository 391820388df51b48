"""Where one H3 block's AdaLN forward+backward spends GPU time (issue 11): torch.profiler, per kernel.

For each candidate of the block report (adaln_lab by default) at 4097 and 32768 rows (H 5376, D 2688,
T 3): 5 warm-up calls, then 10 profiled forward+backward calls; prints each CUDA kernel's total time per
call (us) and count per call, sorted, beside the block's memory floor. Run (on a GPU):
    python bench/dev/block_profile.py [candidate ...] > block_profile.txt
"""

import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from adaln_lab.harness import block_report as br

CALLS = 10


def kernel_table(fn, inputs) -> list[tuple[str, float, float]]:
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs.leaves]
    ones = torch.ones_like(inputs.x)

    def call():
        for leaf in leaves:
            leaf.grad = None
        fn(*leaves, inputs.timestep_indices).backward(ones)

    for _ in range(5):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            call()
        torch.cuda.synchronize()
    total, count = defaultdict(float), defaultdict(int)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            total[event.name] += event.device_time
            count[event.name] += 1
    rows = [(name[:110], total[name] / CALLS, count[name] / CALLS) for name in total]
    return sorted(rows, key=lambda r: -r[1])


def main(names):
    H, D, T = br.H_REAL, br.D_REAL, br.T_REAL
    for S in (4097, 32768):
        inputs = br.make_block(1, S, "cuda", H=H, D=D, T=T)
        floor = br.block_floor_bytes(S, H, D, T)
        print(f"== S={S}: floor {floor['fwd_bwd_bytes'] / 4.2e6:.0f} us fwd+bwd at 4.2 TB/s")
        for name in names:
            rows = kernel_table(br.CANDIDATES[name][1](H, D), inputs)
            print(f"-- {name}: kernels sum {sum(r[1] for r in rows):.0f} us per call")
            for kernel, us, n in rows:
                print(f"{us:9.1f} us  x{n:4.1f}  {kernel}")
        sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1:] or ["adaln_lab"])
