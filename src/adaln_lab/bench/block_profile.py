"""Where one H3 block's AdaLN forward+backward spends GPU time (issue 11): torch.profiler, per kernel.

For each candidate of the block report (adaln_lab by default) at 4097 and 32768 rows (H 5376, D 2688,
T 3): 5 warm-up calls, then 10 profiled forward+backward calls (`adaln_lab.lab.latency_sweep.kernel_profile`,
what the latency notebook profiles); prints each CUDA kernel's time per call (us) and count per call,
sorted, beside the block's memory floor. Run (on a GPU):
    python3 -m adaln_lab.bench.block_profile [candidate ...] > block_profile.txt
"""

import sys

from adaln_lab.harness import block_report as br
from adaln_lab.lab.latency_sweep import kernel_profile

CALLS = 10


def main(names):
    H, D, T = br.H_REAL, br.D_REAL, br.T_REAL
    for S in (4097, 32768):
        inputs = br.make_block(1, S, "cuda", H=H, D=D, T=T)
        floor = br.block_floor_bytes(S, H, D, T)
        print(f"== S={S}: floor {floor['fwd_bwd_bytes'] / 4.2e6:.0f} us fwd+bwd at 4.2 TB/s")
        for name in names:
            rows = kernel_profile(br.CANDIDATES[name][1](H, D), inputs, iters=CALLS, warmup=5)
            print(f"-- {name}: kernels sum {sum(r['us'] for r in rows):.0f} us per call")
            for r in rows:
                print(f"{r['us']:9.1f} us  x{r['calls']:4.1f}  {r['name'][:110]}")
        sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1:] or ["adaln_lab"])
