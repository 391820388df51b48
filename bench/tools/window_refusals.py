"""How often the float64 windows' checks (exact_row_windows.cu) refuse a window, emulated on the CPU."""

# On exact_kernel_cost.py's inputs (H 5376, T 3; x ~ N(0, 1), dy ~ N(0, 1e-6) in bf16; the rows' timesteps at random)
# for the first --blocks blocks of norm_out's pass at each row count (rows a block as the plan's: ceil(rows / 132)):
# each window is a block's rows of one timestep; A (p = float32(dy float32(x rstd))) is refused when a partial sum in
# row order is not a float64 (what the kernel's rounded-down and rounded-up sums detect), B (dy) when its vector's
# bound n 2^(Emax - Emin) <= 2^45 fails. Prints the refusals, scaled to a call, and the widest A window (bits from
# the smallest term's last bit to the sum of magnitudes; 53 fit).
#
#     python3 bench/tools/window_refusals.py [--rows 4097,32768] [--blocks 3]

from __future__ import annotations

import argparse
import math
from fractions import Fraction

import numpy as np
import torch

H, T, RANGES, B_BITS = 5376, 3, 132, 45


def a_refused(column: np.ndarray) -> bool:
    """Whether some partial sum of the float32 terms, in order, is not a float64."""
    nz = column[column != 0].astype(np.float64)
    if nz.size == 0:
        return False
    ulp = int((np.frexp(nz)[1] - 24).min())  # the smallest term's last bit
    if float(np.abs(nz).sum()) < 2.0 ** (ulp + 53):
        return False  # every partial sum below 2^53 units of it
    s = 0
    for v in column:
        s += int(Fraction(float(v)) * 2 ** -ulp)
        low = abs(s) >> ((abs(s) & -abs(s)).bit_length() - 1) if s else 0
        if low.bit_length() > 53:
            return True
    return False


def b_refused(block: np.ndarray) -> bool:
    """Whether B's bound fails for one vector's rows (n, 8) of dy."""
    nz = np.abs(block[block != 0])
    if nz.size == 0:
        return False
    emax, emin = (max(int(v.view(np.uint32)) >> 23, 1) for v in (nz.max(), nz.min()))
    d = emax - emin
    return not (d <= B_BITS and (block.shape[0] << d) <= 2 ** B_BITS)


def measure(rows: int, blocks: int) -> dict:
    per = math.ceil(rows / RANGES)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(blocks * per, H, generator=g).bfloat16().float().numpy()
    dy = (torch.randn(blocks * per, H, generator=g) * 1e-3).bfloat16().float().numpy()
    idx = torch.randint(0, T, (blocks * per,), generator=g).numpy()
    rstd = (1 / np.sqrt((x.astype(np.float64) ** 2).mean(1) + 1e-5)).astype(np.float32)
    p = dy * (x * rstd[:, None])  # float32 products, each rounded once
    a = b = windows = 0
    widest = 0.0
    for block in range(blocks):
        for t in range(T):
            sel = np.nonzero(idx[block * per:(block + 1) * per] == t)[0] + block * per
            if sel.size == 0:
                continue
            windows += 1
            a += sum(a_refused(p[sel, h]) for h in range(H))
            b += sum(b_refused(dy[sel, 8 * v:8 * v + 8]) for v in range(H // 8))
            for h in range(H):
                nz = p[sel, h][p[sel, h] != 0].astype(np.float64)
                if nz.size:
                    widest = max(widest, math.log2(np.abs(nz).sum()) - int((np.frexp(nz)[1] - 24).min()))
    scale = math.ceil(rows / per) / blocks
    return {"rows": rows, "rows_a_block": per, "windows": windows, "a_columns": a, "b_vectors": b,
            "a_a_call": a * scale, "b_a_call": b * scale, "widest_bits": widest}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", default="4097,32768")
    parser.add_argument("--blocks", type=int, default=3)
    args = parser.parse_args()
    for rows in (int(r) for r in args.rows.split(",")):
        m = measure(rows, args.blocks)
        print(f"rows {rows} ({m['rows_a_block']} a block), {m['windows']} windows of {args.blocks} blocks: A "
              f"{m['a_columns']} columns and B {m['b_vectors']} vectors refused (a call: {m['a_a_call']:.0f} and "
              f"{m['b_a_call']:.0f}); the widest A window {m['widest_bits']:.1f} bits of 53", flush=True)


if __name__ == "__main__":
    main()
