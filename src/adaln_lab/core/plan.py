"""The launch plan of one shape: every kernel's grid, block, shared memory and constant, computed once.

Read by the launchers, the Numba twin, the sweep and the profiler; the kernels receive the same
numbers as `#define ADALN_<NAME>` macros (`Plan.defines`), so nothing is written twice.

Rules (bench/NOTES.md has the measurements behind each number):
- Every number is a function of the shapes (H, D, T) and, for the row ranges only, of the number
  of rows; never of the GPU (no SM count is read anywhere).
- A row's reductions use the tree of its row kernel's block (`fwd_threads`, `fwd_vpt` and
  `bwd_threads`, `bwd_vpt`), a function of H alone; which rows share a block never changes a bit.

Shapes the CUDA path supports: H and D divisible by 8, H <= `H_MAX`, T <= `T_MAX`, at most 2^31 - 2^12 rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property, lru_cache

from .exact import LIMBS as EXACT_LIMBS
from .workspace import ALIGN, ROWS_MAX, Rows, aligned, forward_bytes, forward_workspace, layout, rows_of  # noqa: F401

# Constants of the kernels: the one place they live. Changing one changes the compiled unit
# (its text carries the values), and `launchers.forget_compiled()` forgets every derived plan and kernel.
TUNING = {
    "TABLE_CHUNKS": 8,          # table.cu: k in this many chunks of steps, one warp each, added in order: part of
                                # every table sum's order (changing it changes bits; fixed by D alone, never by T)
    "TABLE_TILES": ((8, 1, 1, 2), (16, 2, 2, 4), (32, 2, 4, 3), (3072, 1, 8, 2)),  # table.cu: (up to T, MT, NT,
                                # AHEAD): a block's tile of 16 MT rows j and 8 NT timesteps, AHEAD weight steps in
                                # flight per lane (past 32: 64 timesteps a block, the weight read T / 64 times); the
                                # first row whose T fits (speed only: every tile gives the same bits, NOTES v26)
    "FWD_THREADS_MAX": 256,     # norm_modulate.cu: row block size cap (H = 5376: 224 threads x 3 vectors)
    "FWD_RANGES": 264,          # norm_modulate.cu: row ranges of the staged kernel (a constant, not the SM count)
    "FWD_MIN_ROWS": 8,          # norm_modulate.cu: fewest rows of one range (the table staging is per range)
    "FWD_STAGES": 3,            # norm_modulate.cu: rows of x in flight per block (cp.async)
    "FWD_STAGED_MIN_BLOCKS": 2,  # norm_modulate.cu: stage the table only where this many blocks fit an SM
    "FWD_ROW_LIST_MAX": 1024,   # norm_modulate.cu: most rows of one range (their timesteps sit in shared memory)
    "FWD_WARP_VECTORS_MAX": 24,  # norm_modulate.cu: a row per warp where a lane's share of a row (fwd_threads / 32
                                # x fwd_vpt vectors) is at most this many (0: never)
    "FWD_WARP_THREADS": 256,    # norm_modulate.cu: block size of the row-per-warp kernel
    "FWD_PDL": 1,               # norm_modulate.cu: the row-per-warp kernel launched with PDL (overlaps the table)
    "BWD_THREADS_MAX": 1024,    # norm_modulate_bwd.cu: row block size cap (H = 5376: 672 threads x 1 vector)
    "BWD_RANGES": 132,          # norm_modulate_bwd.cu: row ranges (a constant, not the SM count)
    "BWD_STAGES": 4,            # norm_modulate_bwd.cu: rows of x and dy in flight (cp.async)
    "ROW_LIST_MAX": 2048,       # norm_modulate_bwd.cu: most rows of one range
    "BWD_SORTED_MIN_T": 10,     # norm_out's backward from this many timesteps on: the sorted row pass (plan.bwd_sorted)
    "TB_THREADS": 256,          # table_bwd.cu: block size
    "TB_ROWS": 512,             # table_bwd.cu: weight rows j per block (table_bwd_bf16, one kernel)
    "TB_SPLIT_ROWS": 256,       # table_bwd.cu: weight rows j per block of its two halves (T >= TB_SPLIT_MIN_T)
    "TB_EARLY": 4,              # table_bwd.cu: weight rows a warp loads before its block's prologue
    "TB_SPLIT_MIN_T": 5,        # table_bwd.cu: from this many table rows T on, d_weight and dact run as two kernels
    "TB_MMA_MIN_T": 10,         # table_bwd: from this many table rows T on, its halves on tensor cores (plan.tb_mma)
    "TB_ACC_MAX": 72,           # table_bwd.cu: most per-timestep accumulators of a thread (T x tb_vec columns)
    "SUM_GROUPS": 16,           # adaln_common.cuh: row groups of an ordered column sum
    "RP_T_MAX": 12,             # reduce_partials.cu: most timesteps summed in one pass (8 KiB of shared memory each)
    "GR_THREADS_MAX": 256,      # gated_residual.cu: block size cap (H = 5376: 3 column tiles of 224 threads)
    "EXACT_THREADS": 64,        # exact_sums.cu: block size (two columns a thread; its states 320 B a thread)
    "EXACT_AHEAD": 4,           # exact_sums.cu: rows whose x and dy a thread loads before adding their terms
    "EXACT_CHUNKS": 32,         # exact_sums.cu: most row chunks (integer sums: no bit depends on it)
    "EXACT_CACHE": 1,           # exact_sums.cu: every add in shared memory (0), each state's last limb pair in
                                # registers (1), or the pairs alone, sent out by integer atomics (2, no shared memory)
    "EXACT_ROW_DOUBLE": 1,      # exact_row_pass.cu: the exact passes' windows int64 (0) or float64 checked at their
                                # close (1, exact_row_windows.cu; plan.exact_row_double): the same integers
    "EXACT_CLOSE_STAGED": 0,    # exact_row_windows.cu: norm_out's windows out through its stages (1) or not (0)
    "EXACT_SORTED_MIN_T": 3073,  # norm_out's exact pass over its rows in table-row order from this many timesteps on
    "EXACT_FIXUP_BLOCKS": 64,   # exact_row_windows.cu: the fixup kernels' grid (256 threads, a warp an entry)
}
SMEM_BLOCK_MAX = 227 * 1024       # dynamic + static shared memory one block may opt in to (sm_90, sm_100)
BWD_STAGE_BUDGET = 200 * 1024     # dynamic shared memory of the backward's stages (static scratch beside it)
H_MAX = 50176                      # the largest H whose backward stage (x and dy rows) fits BWD_STAGE_BUDGET (tested)
T_MAX = 3072                       # table rows the GPU tests cover: a block's 3 x 1024 (row_order.cu wide past 32)
ROW_ORDER_THREADS = 1024           # row_order.cu: its one block (32 warps: one per lane of the scan of their totals)
TWIN_TABLE_THREADS = 512           # the Numba twin's table (its own GEMV order, ops/final_adaln_out/twin): block size,
TWIN_TABLE_ROWS_PER_WARP = 2       # and rows j of one warp's task (a row's sum is one warp's: bits do not depend on it)
ROW_ORDER_KEYS_MAX = 65536         # row_order.cu: most positions whose keys it stages in shared memory (bytes)


def row_geometry(H: int, threads_max: int) -> tuple[int, int]:
    """(threads, 8-wide vectors per thread) of a row kernel whose blocks hold at most threads_max, from H alone."""
    nvec = H // 8
    vpt = math.ceil(nvec / threads_max)
    threads = 32 * math.ceil(math.ceil(nvec / vpt) / 32)
    return threads, vpt


def gr_geometry(H: int, threads_max: int) -> int:
    """Threads of gated_residual.cu's blocks, from H alone: the fewest column tiles of at most threads_max
    threads (8 columns each), split evenly. A column's sums do not depend on it."""
    nvec = H // 8
    tiles = math.ceil(nvec / threads_max)
    return 32 * math.ceil(math.ceil(nvec / tiles) / 32)


def check_shapes(H: int, D: int, T: int) -> None:
    """The shapes the CUDA kernels support; a clear error (naming the argument) otherwise."""
    if H % 8 or H < 8:
        raise ValueError(f"the CUDA kernels need H (x.shape[-1]) divisible by 8, got {H}; use backend='torch'")
    if D % 8 or D < 8:
        raise ValueError(f"the CUDA kernels need D (temb.shape[1]) divisible by 8, got {D}; use backend='torch'")
    if H > H_MAX:
        raise ValueError(f"the CUDA kernels need H (x.shape[-1]) <= {H_MAX}, got {H}; use backend='torch'")
    if T > T_MAX:
        raise ValueError(f"the CUDA kernels need T (temb.shape[0]) <= {T_MAX}, got {T}; use backend='torch'")


def check_table(D: int, T: int, N: int) -> None:
    """The table kernels' limits for temb (T, D) and N columns (check_shapes' on D and T; N divisible by 8): a clear
    error naming the argument otherwise. No cache: torch.compile traces it where an op decides its route."""
    check_shapes(8, D, T)
    if N % 8 or N < 8:
        raise ValueError(f"the CUDA kernels need the table's columns (weight.shape[0]) divisible by 8, got {N}")


def supported(H: int, D: int, T: int) -> bool:
    """check_shapes as a yes / no."""
    try:
        check_shapes(H, D, T)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class Plan:
    """Geometry and constants of every kernel for one (H, D, T); see the module docstring."""

    H: int
    D: int
    T: int
    fwd_threads: int
    fwd_vpt: int
    fwd_stages: int          # 0: the row-per-block kernel (the staged one does not fit shared memory)
    bwd_threads: int
    bwd_vpt: int
    bwd_stages: int
    bwd_res_stages: int      # norm_modulate_bwd_residual_sorted_bf16: rows in flight (three inputs each); 0: unused
    table_grid: tuple[int, int]  # table.cu: (t-blocks of 8 NT timesteps, j-blocks of 16 MT rows)
    table_threads: int           # table.cu: 32 x TABLE_CHUNKS
    table_tile: tuple[int, int, int]  # table.cu: (MT, NT, AHEAD), from TABLE_TILES by T
    tb_threads: int
    sum_groups: int
    gr_threads: int
    tuning: tuple
    table_n: int = 0               # table.cu / table_bwd.cu: columns of the table (0: 2H, norm_out's)
    table_f32_rounded: bool = False  # table.cu: table_f32 holds the bf16 values (the blocks' table)
    table_row_tables: bool = False   # table.cu: the bf16 output is a block's two row tables (see `plan`)

    def __hash__(self) -> int:
        # computed once: a plan keys the row, kernel and module caches on every call (host time)
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.H, self.D, self.T, self.table_n, self.table_f32_rounded, self.table_row_tables,
                      self.tuning))
            object.__setattr__(self, "_hash", h)
        return h

    @cached_property
    def fwd_staged(self) -> bool:
        return self.fwd_stages > 0

    @cached_property
    def fwd_warp(self) -> bool:
        """norm_modulate_warp_bf16 runs the forward rows (a row per warp, the same tree as the row block's)."""
        return self.fwd_threads // 32 * self.fwd_vpt <= dict(self.tuning)["FWD_WARP_VECTORS_MAX"]

    @cached_property
    def fwd_pdl(self) -> bool:
        """The row-per-warp kernel starts while the table kernel ends (programmatic dependent launch)."""
        return bool(dict(self.tuning)["FWD_PDL"])

    @cached_property
    def fwd_warp_rows(self) -> int:
        """Rows of one norm_modulate_warp_bf16 block (a warp each)."""
        return dict(self.tuning)["FWD_WARP_THREADS"] // 32

    @cached_property
    def fwd_smem(self) -> int:
        """Dynamic shared memory of the staged forward: the modulation of every timestep, then the x stages."""
        return (2 * self.T + self.fwd_stages) * self.fwd_threads * self.fwd_vpt * 16

    @cached_property
    def bwd_smem(self) -> int:
        """Dynamic shared memory of norm_modulate_bwd: its stages, one row of x and one of dy each."""
        return self.bwd_stages * 2 * self.bwd_threads * self.bwd_vpt * 16

    @cached_property
    def bwd_res_smem(self) -> int:
        """Dynamic shared memory of norm_modulate_bwd_residual_sorted_bf16: its stages of x, dy and d_residual."""
        return self.bwd_res_stages * 3 * self.bwd_threads * self.bwd_vpt * 16

    @cached_property
    def rp_t(self) -> int:
        """reduce_partials.cu: timesteps summed in one pass (every one, up to RP_T_MAX)."""
        return min(self.T, dict(self.tuning)["RP_T_MAX"])

    @cached_property
    def rp_smem(self) -> int:
        """Dynamic shared memory of reduce_partials_bf16: a double per group, (t, half) and lane, then their sums."""
        return (self.sum_groups + 1) * 2 * self.rp_t * 32 * 8

    @cached_property
    def row_order_wide(self) -> bool:
        """row_order.cu's three kernels over chunks of positions past 32 table rows (a warp a row): the same order."""
        return self.T > 32

    def row_order_chunking(self, S: int) -> tuple[int, int]:
        """(chunk, chunks) of the wide row_order over S positions: chunks of at least 1024 positions, multiples of
        32, at most about 1024 chunks (its scratch: T x chunks ints); at least one chunk (S = 0: zero counts)."""
        chunk = max(1024, -(-(-(-S // 1024)) // 32) * 32)
        return chunk, max(1, -(-S // chunk))

    def row_order_scratch(self, S: int) -> int:
        """Bytes of the wide row_order's scratch over up to S positions (T x chunks ints, chunks <= 1024 and <=
        ceil(S / 1024): enough for every S' <= S; 0 for the one-block kernel)."""
        return 4 * self.T * min(1024, max(1, -(-S // 1024))) if self.row_order_wide else 0

    def row_order_smem(self, S: int) -> int:
        """Dynamic shared memory of row_order over S positions: one int per thread and table row, then the
        staged keys (one byte per position, padded to 16) where S <= ROW_ORDER_KEYS_MAX."""
        return self.T * ROW_ORDER_THREADS * 4 + (-(-S // 16) * 16 if S <= ROW_ORDER_KEYS_MAX else 0)

    @cached_property
    def tb_split(self) -> bool:
        """table_bwd.cu: d_weight and dact in two kernels from TB_SPLIT_MIN_T on (the same sums; the fused
        kernel's 2 x 8 x T accumulators took 255 registers at T = 9, where the split was 34 us faster, NOTES v4)."""
        return self.T >= dict(self.tuning)["TB_SPLIT_MIN_T"]

    @cached_property
    def tb_rows(self) -> int:
        """table_bwd.cu: weight rows j per block: TB_ROWS (the one kernel), TB_SPLIT_ROWS (its halves; NOTES v6)."""
        return dict(self.tuning)["TB_SPLIT_ROWS" if self.tb_split else "TB_ROWS"]

    @cached_property
    def bwd_sorted(self) -> bool:
        """norm_out's backward over the rows in timestep order from BWD_SORTED_MIN_T on (row_order.cu, the blocks'
        sorted pass and reduce: bwd_ranges + T partial slots, 7 MB not 180 at T 32, NOTES v28); the same dx bits."""
        return self.T >= dict(self.tuning)["BWD_SORTED_MIN_T"]

    @cached_property
    def tb_mma(self) -> bool:
        """table_bwd's halves on tensor cores (table_bwd_mma.cu) from TB_MMA_MIN_T on (on CUDA cores: 343 of
        norm_out's 628 us of fwd+bwd at T = 32, NOTES v28)."""
        t = dict(self.tuning)  # dact's k steps take 16 rows: N % 16 (else the CUDA-core halves)
        return self.T >= max(t["TB_MMA_MIN_T"], t["TB_SPLIT_MIN_T"]) and self.columns % 16 == 0

    @cached_property
    def tbm_grids(self) -> tuple[tuple[int, int], ...]:
        """table_bwd_mma.cu's grids: the terms' (columns N + D in blocks of 128, steps of 16 timesteps), d_weight's
        (D tiles of 128, N tiles of 64), dact's (D tiles of 64, blocks_j)."""
        N, D = self.columns, self.D
        return ((math.ceil((N + D) / 128), math.ceil(self.T / 16)), (math.ceil(D / 128), math.ceil(N / 64)),
                (math.ceil(D / 64), self.blocks_j))

    @cached_property
    def tb_terms_at(self) -> int:
        """table_bwd's workspace (tb_bytes): dact_partials (blocks_j, T, D) fp32, then from this byte on, on tensor
        cores (tb_mma), the operands' three bf16 terms (table_bwd_mma.cu): 2 x 3 x TP x N + 3 x TP x D, TP = T
        rounded up to 16."""
        return aligned(self.blocks_j * self.T * self.D * 4)

    @cached_property
    def tb_bytes(self) -> int:
        return self.tb_terms_at + (6 * math.ceil(self.T / 16) * 16 * (2 * self.columns + self.D) if self.tb_mma else 0)

    @cached_property
    def tb_vec(self) -> int:
        """table_bwd.cu: columns k of a lane, the most of 8, 4 (else 2) with T x tb_vec <= TB_ACC_MAX accumulators
        a half, half that in the one kernel (8 spilled from T = 10, NOTES v27); the same bits at every width."""
        acc = dict(self.tuning)["TB_ACC_MAX"] // (1 if self.tb_split else 2)
        return next((v for v in (8, 4) if self.T * v <= acc), 2)

    @cached_property
    def tb_columns(self) -> int:
        """table_bwd.cu: columns k of one block, a vector of tb_vec for each of the 32 lanes."""
        return 32 * self.tb_vec

    @cached_property
    def tb_grid(self) -> tuple[int, int]:
        """table_bwd.cu's grid: (D tiles of tb_columns columns, row blocks of tb_rows weight rows)."""
        return math.ceil(self.D / self.tb_columns), math.ceil(self.columns / self.tb_rows)

    @cached_property
    def blocks_j(self) -> int:
        return self.tb_grid[1]

    def rows(self, rows: int) -> Rows:
        return rows_of(self, rows)

    def defines(self) -> dict:
        """Every macro of the compiled unit, by name without the ADALN_ prefix."""
        t = dict(self.tuning)
        return dict(H=self.H, D=self.D, T=self.T, FWD_THREADS=self.fwd_threads, FWD_VPT=self.fwd_vpt,
                    FWD_STAGES=max(self.fwd_stages, 1), FWD_WARP=int(self.fwd_warp),
                    FWD_WARP_THREADS=t["FWD_WARP_THREADS"], BWD_THREADS=self.bwd_threads, BWD_VPT=self.bwd_vpt,
                    BWD_STAGES=self.bwd_stages, BWD_RES_STAGES=max(self.bwd_res_stages, 1),
                    TABLE_CHUNKS=t["TABLE_CHUNKS"], TABLE_MT=self.table_tile[0], TABLE_NT=self.table_tile[1],
                    TABLE_AHEAD=self.table_tile[2],
                    FWD_ROW_LIST_MAX=t["FWD_ROW_LIST_MAX"], ROW_LIST_MAX=t["ROW_LIST_MAX"],
                    TB_THREADS=t["TB_THREADS"], TB_ROWS=self.tb_rows, TB_SPLIT=int(self.tb_split),
                    TB_EARLY=t["TB_EARLY"], TB_COLUMNS=self.tb_columns, TB_VEC=self.tb_vec, TB_MMA=int(self.tb_mma),
                    ROW_ORDER_THREADS=ROW_ORDER_THREADS, ROW_ORDER_KEYS_MAX=ROW_ORDER_KEYS_MAX,
                    ROW_ORDER_WIDE=int(self.row_order_wide),
                    GR_THREADS=self.gr_threads, SUM_GROUPS=t["SUM_GROUPS"], RP_T=self.rp_t, TABLE_N=self.columns,
                    TABLE_F32_ROUNDED=int(self.table_f32_rounded), TABLE_ROW_TABLES=int(self.table_row_tables),
                    EXACT_THREADS=t["EXACT_THREADS"], EXACT_AHEAD=t["EXACT_AHEAD"], EXACT_LIMBS=EXACT_LIMBS,
                    EXACT_CACHE=t["EXACT_CACHE"], EXACT_ROW_DOUBLE=int(self.exact_row_double),
                    EXACT_CLOSE_STAGED=t["EXACT_CLOSE_STAGED"])

    @cached_property
    def exact_row_double(self) -> bool:
        """EXACT_ROW_DOUBLE where it fits: a vector a thread, <= 768 threads (80 registers), 3+ stages (1 + scale)."""
        return (bool(dict(self.tuning)["EXACT_ROW_DOUBLE"]) and self.bwd_vpt == 1 and self.bwd_threads <= 768
                and min(self.bwd_stages, self.bwd_res_stages) >= 3)

    @cached_property
    def exact_smem(self) -> int:
        """exact_sums.cu's dynamic shared memory: LIMBS int64 limbs, 2 sums x 2 columns a thread (EXACT_CACHE 2: 0)."""
        t = dict(self.tuning)
        return 0 if t["EXACT_CACHE"] == 2 else EXACT_LIMBS * 4 * t["EXACT_THREADS"] * 8

    def exact_grid(self, rows: int) -> tuple[int, int, int]:
        """exact_sums.cu's (column blocks, row chunks, rows a chunk) over `rows` rows: chunks of at least 64 rows, at
        most EXACT_CHUNKS (no chunk with no rows). Any geometry gives the same integers."""
        threads = dict(self.tuning)["EXACT_THREADS"]
        chunks = min(dict(self.tuning)["EXACT_CHUNKS"], -(-rows // 64))
        per_chunk = -(-rows // chunks) if chunks else 0
        return -(-self.H // (2 * threads)), (-(-rows // per_chunk) if chunks else 0), per_chunk

    @cached_property
    def table_act_grid(self) -> int:
        """table.cu's table_act: blocks of 256 threads, 8 of the T * D activations a thread."""
        return math.ceil(self.T * self.D / 8 / 256)

    @cached_property
    def columns(self) -> int:
        """N, the table's columns: 2H (norm_out) unless the plan was made with table_n."""
        return self.table_n or 2 * self.H


def row_tables_fit(table_n: int) -> bool:
    """Whether a table of table_n columns is an H3 block's, 18H with H divisible by 8 (table.cu's row tables)."""
    return table_n > 0 and table_n % 144 == 0


@lru_cache(maxsize=None)
def plan(H: int, D: int, T: int, table_n: int = 0, table_f32_rounded: bool = False,
         table_row_tables: bool = False) -> Plan:
    """The plan of one shape (checked first: an unsupported shape raises ValueError naming the argument).

    table_n: the table's columns N when not norm_out's 2H (an H3 block's adaln_proj: 18H), with
    `table_f32_rounded` the table_f32 output holds the bf16 values. `table_row_tables` (an H3 block's table, N =
    18 H', H' divisible by 8): table.cu's bf16 output is the two row tables (2, 3T, 2H') the block's norms read,
    norm1's shift_msa | scale_msa and norm2's shift_mlp | scale_mlp, row 3t + m for timestep t and modality m (the
    table's (3T, 6H') view), instead of the (T, N) table. A plan used only for its table kernels passes H = 8; one
    used only for its row kernels passes D = 8 (adaln_lab/core/tensors.py).
    """
    check_shapes(H, D, T)
    if table_n:
        check_table(D, T, table_n)
    if table_row_tables and not (table_f32_rounded and row_tables_fit(table_n)):
        raise ValueError(f"row tables need a block's table (columns 18H with H divisible by 8, table_f32_rounded), "
                         f"got {table_n} columns")
    N = table_n or 2 * H
    t = TUNING
    fwd_threads, fwd_vpt = row_geometry(H, t["FWD_THREADS_MAX"])
    bwd_threads, bwd_vpt = row_geometry(H, t["BWD_THREADS_MAX"])
    slot = fwd_threads * fwd_vpt * 16
    fwd_static = 4 * t["FWD_ROW_LIST_MAX"] + 4 * (fwd_threads // 32 + 1)
    fwd_stages = t["FWD_STAGES"]
    fwd_budget = SMEM_BLOCK_MAX // t["FWD_STAGED_MIN_BLOCKS"]  # 2: stage only where two blocks fit an SM
    while fwd_stages >= 2 and (2 * T + fwd_stages) * slot + fwd_static > fwd_budget:  # (bench/tools/block_ab.py)
        fwd_stages -= 1
    if fwd_stages < 2:
        fwd_stages = 0  # fall back to one row per block: same threads, same tree, same bits per row
    if BWD_STAGE_BUDGET + 12 * t["ROW_LIST_MAX"] + 4 * (bwd_threads // 32 + 1) > SMEM_BLOCK_MAX:
        raise ValueError(f"ROW_LIST_MAX {t['ROW_LIST_MAX']}: the backward's row list (row, timestep and rstd of "
                         f"each row, static shared memory) does not fit beside its stages")
    bwd_stage = 2 * bwd_threads * bwd_vpt * 16
    bwd_stages = min(t["BWD_STAGES"], BWD_STAGE_BUDGET // bwd_stage)  # a wide row keeps fewer stages
    # 0 where three rows do not fit (H > 33280): the gradient sum then runs as a torch add after the plain kernel
    bwd_res_stages = min(t["BWD_STAGES"], BWD_STAGE_BUDGET // (3 * bwd_threads * bwd_vpt * 16))
    if bwd_stages < 1:
        raise ValueError(f"the CUDA kernels need H (x.shape[-1]) <= {H_MAX}, got {H}; use backend='torch'")
    table_tile = next((tile[1:] for tile in t["TABLE_TILES"] if T <= tile[0]), t["TABLE_TILES"][-1][1:])
    return Plan(H=H, D=D, T=T, fwd_threads=fwd_threads, fwd_vpt=fwd_vpt, fwd_stages=fwd_stages,
                bwd_threads=bwd_threads, bwd_vpt=bwd_vpt, bwd_stages=bwd_stages, bwd_res_stages=bwd_res_stages,
                table_grid=(math.ceil(T / (8 * table_tile[1])), math.ceil(N / (16 * table_tile[0]))),
                table_threads=32 * t["TABLE_CHUNKS"], table_tile=table_tile,
                tb_threads=t["TB_THREADS"],
                sum_groups=t["SUM_GROUPS"], gr_threads=gr_geometry(H, t["GR_THREADS_MAX"]),
                tuning=tuple(sorted(t.items())), table_n=table_n,
                table_f32_rounded=table_f32_rounded, table_row_tables=table_row_tables)


def clear_caches() -> None:
    """Forget every plan, e.g. after changing TUNING (adaln_lab/bench/sweep.py); `launchers.forget_compiled()`
    forgets them with the compiled modules and the caches built on both (`core.tensors.context`)."""
    plan.cache_clear()
    rows_of.cache_clear()
