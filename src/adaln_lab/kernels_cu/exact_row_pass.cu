// exact_row_pass.cu: the backward row passes with their column sums kept as exact integers: the row pass and the
// exact sums in one read of x and dy (the states, limbs and flags of exact_sums.cu, whose exact_split this file's
// windows use: that file comes first in the unit). ExactRowSums (or exact_row_windows.cu's DoubleRowSums, TUNING's
// EXACT_ROW_DOUBLE) for norm_out's pass and a block's sorted passes of its modulated norms; ExactGateSums for a
// block's gated residuals (gated_residual.cu's sorted pass).

// ExactRowSums: the backward row pass's two sums (norm_modulate_bwd.cu's FloatSums: A of dy xhat, B of dy) kept
// as the exact integers of exact_sums.cu's states instead, for norm_modulate_bwd_exact_bf16: the row pass and the
// exact sums in one read of x and dy. Each of this thread's VPT x 8 columns keeps, a sum, one int64 window: the sum
// of the terms since its last flush, all in limb pair (k, k + 1) (k in 4 bits of a packed word: registers)
// (`v = m << (k % 32)` of `exact_add`, |v| < 2^56), so 127 terms fit; a term in another pair, the 127th row since
// the last flush, or the end of a table row's pass sends the window out with integer atomics (its low 32 bits to
// limb k, the rest to k + 1 of table_limbs (LIMBS, T, 2H): A at column H + h, B at h, as exact_sums_bf16's).
// p = dy * xhat rounded once (exact_sums_bf16's term); the pass's dx is the plain pass's (the sums never touch it).
// A non-finite term sets flag bit 0, a row of no table row bit 1 (its terms went to table row 0's states, which the
// op then never reads).
struct ExactRowSums {
    long long acc[2][ADALN_BWD_VPT][ADALN_VEC];  // (A | B, vector, element): each window's sum since its flush
    unsigned long long pairs[ADALN_BWD_VPT];  // the windows' limb pairs k, 4 bits each (k <= 8): 16 a vector
    unsigned long long* table_limbs;
    int rows_since, bad;  // rows added since the windows' last flush; the flags

    __device__ __forceinline__ int pair(int q, int i, int e) const { return (pairs[i] >> (4 * (q * 8 + e))) & 15; }
    __device__ __forceinline__ void flush(int q, int i, int e) {  // the window to table row `current`'s limbs
        long long& w = acc[q][i][e];
        if (w != 0) {
            const size_t limb = (size_t)ADALN_T * 2 * ADALN_H;
            const int h = (threadIdx.x + i * ADALN_BWD_THREADS) * ADALN_VEC + e + (q == 0 ? ADALN_H : 0);
            unsigned long long* at = table_limbs + (size_t)current * 2 * ADALN_H + h + pair(q, i, e) * limb;
            const long long low = w & 0xffffffffLL, high = w >> 32;
            if (low) atomicAdd(at, (unsigned long long)low);  // two's complement: signed additions
            if (high) atomicAdd(at + limb, (unsigned long long)high);
        }
        w = 0;
    }
    __device__ __forceinline__ void term(int q, int i, int e, float f) {
        long long v;
        int limb;
        if (!exact_split(f, bad, v, limb)) return;
        if (limb != pair(q, i, e)) {
            flush(q, i, e);
            const int shift = 4 * (q * 8 + e);
            pairs[i] = (pairs[i] & ~(15ull << shift)) | ((unsigned long long)limb << shift);
        }
        acc[q][i][e] += v;
    }
    int current;  // the table row of the pass running

    __device__ __forceinline__ void begin(int t) {
        current = t;
#pragma unroll
        for (int q = 0; q < 2; ++q)
#pragma unroll
            for (int i = 0; i < ADALN_BWD_VPT; ++i)
#pragma unroll
                for (int e = 0; e < ADALN_VEC; ++e) acc[q][i][e] = 0;
#pragma unroll
        for (int i = 0; i < ADALN_BWD_VPT; ++i) pairs[i] = 0;
        rows_since = 0;
    }
    __device__ __forceinline__ void flush_all() {
#pragma unroll
        for (int q = 0; q < 2; ++q)
#pragma unroll
            for (int i = 0; i < ADALN_BWD_VPT; ++i)
                if (threadIdx.x + i * ADALN_BWD_THREADS < ADALN_NVEC_H)
#pragma unroll
                    for (int e = 0; e < ADALN_VEC; ++e) flush(q, i, e);
        rows_since = 0;
    }
    __device__ __forceinline__ void add(int i, int e, float dyv, float xhat) {
        if (i == 0 && e == 0 && ++rows_since == 127) flush_all();  // a row's first term: at most 127 a window
        term(0, i, e, __fmul_rn(dyv, xhat));
        term(1, i, e, dyv);
    }
    __device__ __forceinline__ void poison() { bad |= 2; }
    __device__ __forceinline__ float* slot(float*, size_t) const { return nullptr; }  // no partials
    __device__ __forceinline__ void store_none(float*) const {}
    __device__ __forceinline__ void store(float*, int) { flush_all(); }
    __device__ __forceinline__ void init(unsigned long long* limbs, int4*, int*, int) {
        table_limbs = limbs;  // no fixups: every term lands in its window
        bad = 0;
    }
    __device__ __forceinline__ void stage_closes(uint4*) {}  // its windows flush as they go: nothing to stage
};

// The row passes' exact sums: TUNING's EXACT_ROW_DOUBLE picks the windows (0 int64, 1 float64 checked at the close,
// exact_row_windows.cu: their 48 registers of windows leave no room for the modulation, whose 1 + scale takes the
// last stage's space instead, one row fewer in flight); the integers and dx are the same.
#if ADALN_EXACT_ROW_DOUBLE
typedef DoubleRowSums RowExactSums;
typedef SharedModulation RowExactModulation;
#define EXACT_MOD_STAGES 1
#else
typedef ExactRowSums RowExactSums;
typedef RegisterModulation RowExactModulation;
#define EXACT_MOD_STAGES 0
#endif

// norm_out's backward row pass (norm_modulate_bwd_bf16's: the same dx, the same grid) with its column sums exact
// (RowExactSums) into table_limbs (LIMBS, T, 2H) and flags (2,) int32 (the flags, or'd; the fixup entries appended
// to fixups (capacity,) int4 with EXACT_ROW_DOUBLE 1: exact_fixup_rows_bf16 adds them), both zeroed by the caller:
// no row_partials, no reduce. Run: adaln_lab.ops.final_adaln_out.exact.launch_row_sums.
extern "C" __global__ void __launch_bounds__(ADALN_BWD_THREADS)
norm_modulate_bwd_exact_bf16(const bf16_t* __restrict__ dy, const bf16_t* __restrict__ x,
                             const float* __restrict__ rstd,
                             const bf16_t* __restrict__ norm_weight, const float* __restrict__ table_f32,
                             const index_t* __restrict__ timestep_indices, bf16_t* __restrict__ dx,
                             unsigned long long* __restrict__ table_limbs, int* __restrict__ flags,
                             int4* __restrict__ fixups, int S, int rows, int rows_per_block, int table_stride,
                             int capacity) {
    extern __shared__ __align__(16) uint4 stages[];  // [ADALN_BWD_STAGES][2][ADALN_BWD_VPT][ADALN_BWD_THREADS]
    __shared__ float scratch[ADALN_BWD_THREADS / 32 + 1];
    __shared__ int timesteps[ADALN_ROW_LIST_MAX];
    __shared__ float row_rstd[ADALN_ROW_LIST_MAX];
    RowExactSums sums;
    sums.init(table_limbs, fixups, flags, capacity);
    sums.stage_closes(stages);  // the pipeline drains at each table row's close: the stages hold the windows then
    row_pass<2, ADALN_BWD_STAGES - EXACT_MOD_STAGES, RowExactSums, RowExactModulation>(
        sums, dy, x, nullptr, rstd, norm_weight, table_f32, timestep_indices, dx, nullptr, S, rows, rows_per_block,
        table_stride, stages, scratch, timesteps, row_rstd);
    if (sums.bad) atomicOr(flags, sums.bad);
}

// An H3 block's sorted row passes (norm_modulate_bwd_sorted_bf16, norm_modulate_bwd_residual_sorted_bf16: the same
// dx, the same grid and rows in table-row order) with their column sums exact (RowExactSums, sent out when the stream
// leaves a table row) into table_limbs (LIMBS, R, 2H) (R the plan's T: the block's 3T chunk rows) and flags (2,)
// int32 with fixups as norm_out's (exact_fixup_sorted_bf16 adds them), zeroed by the caller: no row_partials, no
// reduce. Run: adaln_lab.ops.row_sums.launch_sorted_row_sums.
// the two kernels' body: their shared arrays (the plain sorted kernels'), the pass with RowExactSums, the flags
template <int NIN, int STAGES>
__device__ __forceinline__ void sorted_exact_pass(const bf16_t* dy, const bf16_t* x, const bf16_t* d_residual,
                                                  const float* rstd, const bf16_t* norm_weight, const float* table_f32,
                                                  const index_t* row_index, const int* row_order, bf16_t* dx,
                                                  unsigned long long* table_limbs, int* flags, int4* fixups,
                                                  int S, int rows, int rows_per_block, int table_stride,
                                                  int capacity) {
    extern __shared__ __align__(16) uint4 stages[];  // [STAGES][NIN][ADALN_BWD_VPT][ADALN_BWD_THREADS]
    __shared__ float scratch[ADALN_BWD_THREADS / 32 + 1];
    __shared__ int timesteps[ADALN_ROW_LIST_MAX];
    __shared__ float row_rstd[ADALN_ROW_LIST_MAX];
    __shared__ int row_ids[ADALN_ROW_LIST_MAX];
    RowExactSums sums;
    sums.init(table_limbs, fixups, flags, capacity);
    sorted_row_pass<NIN, STAGES - EXACT_MOD_STAGES, RowExactSums, RowExactModulation>(
        sums, dy, x, d_residual, rstd, norm_weight, table_f32, row_index, row_order, dx, nullptr, S, rows,
        rows_per_block, table_stride, stages, scratch, timesteps, row_rstd, row_ids);
    if (sums.bad) atomicOr(flags, sums.bad);
}

extern "C" __global__ void __launch_bounds__(ADALN_BWD_THREADS)
norm_modulate_bwd_sorted_exact_bf16(const bf16_t* __restrict__ dy, const bf16_t* __restrict__ x,
                                    const float* __restrict__ rstd, const bf16_t* __restrict__ norm_weight,
                                    const float* __restrict__ table_f32, const index_t* __restrict__ row_index,
                                    const int* __restrict__ row_order, bf16_t* __restrict__ dx,
                                    unsigned long long* __restrict__ table_limbs, int* __restrict__ flags,
                                    int4* __restrict__ fixups, int S, int rows, int rows_per_block, int table_stride,
                                    int capacity) {
    sorted_exact_pass<2, ADALN_BWD_STAGES>(dy, x, nullptr, rstd, norm_weight, table_f32, row_index, row_order, dx,
                                           table_limbs, flags, fixups, S, rows, rows_per_block, table_stride,
                                           capacity);
}

extern "C" __global__ void __launch_bounds__(ADALN_BWD_THREADS)
norm_modulate_bwd_residual_sorted_exact_bf16(const bf16_t* __restrict__ dy, const bf16_t* __restrict__ x,
                                             const bf16_t* __restrict__ d_residual, const float* __restrict__ rstd,
                                             const bf16_t* __restrict__ norm_weight,
                                             const float* __restrict__ table_f32,
                                             const index_t* __restrict__ row_index,
                                             const int* __restrict__ row_order, bf16_t* __restrict__ dx,
                                             unsigned long long* __restrict__ table_limbs, int* __restrict__ flags,
                                             int4* __restrict__ fixups, int S, int rows, int rows_per_block,
                                             int table_stride, int capacity) {
    sorted_exact_pass<3, ADALN_BWD_RES_STAGES>(dy, x, d_residual, rstd, norm_weight, table_f32, row_index, row_order,
                                               dx, table_limbs, flags, fixups, S, rows, rows_per_block, table_stride,
                                               capacity);
}

// ExactGateSums: gated_residual.cu's FloatGateSums (the sorted pass's column sums of dout y, exact in float32: two
// bf16 numbers) kept as exact integers, ExactRowSums' windows for a thread's 8 columns c * 8 + e: one int64 window a
// column (its limb pair in 4 bits of `pairs`), sent by integer atomics to table_limbs (LIMBS, R, H) at column
// c * 8 + e when a term lands in another pair, after 127 rows, and when the rows leave a table row. A row of no table
// row sets flag bit 1 and adds nothing; a non-finite term bit 0.
struct ExactGateSums {
    long long acc[ADALN_VEC];
    unsigned long long pairs;
    unsigned long long* table_limbs;
    int current, rows_since, bad, c;

    __device__ __forceinline__ int pair(int e) const { return (pairs >> (4 * e)) & 15; }
    __device__ __forceinline__ void flush(int e) {
        long long& w = acc[e];
        if (w != 0) {
            const size_t limb = (size_t)ADALN_T * ADALN_H;
            unsigned long long* at = table_limbs + (size_t)current * ADALN_H + c * ADALN_VEC + e + pair(e) * limb;
            const long long low = w & 0xffffffffLL, high = w >> 32;
            if (low) atomicAdd(at, (unsigned long long)low);  // two's complement: signed additions
            if (high) atomicAdd(at + limb, (unsigned long long)high);
        }
        w = 0;
    }
    __device__ __forceinline__ void store(int) {  // every window out (the rows leave table row `current`)
#pragma unroll
        for (int e = 0; e < ADALN_VEC; ++e) flush(e);
        rows_since = 0;
    }
    __device__ __forceinline__ void init(unsigned long long* limbs, int4*, int*, int, int column) {
        table_limbs = limbs;  // no fixups: every term lands in its window
        c = column;
        bad = 0;
    }
    __device__ __forceinline__ void begin(int t) {  // the windows of table row t start empty
        current = t;
#pragma unroll
        for (int e = 0; e < ADALN_VEC; ++e) acc[e] = 0;
        pairs = 0;
        rows_since = 0;
    }
    __device__ __forceinline__ void add(int ts, const float dyv[ADALN_VEC], const float yv[ADALN_VEC]) {
        if (ts < 0) {
            bad |= 2;
            return;
        }
        if (++rows_since == 127) store(current);  // at most 127 terms a window
#pragma unroll
        for (int e = 0; e < ADALN_VEC; ++e) {
            long long v;
            int limb;
            if (!exact_split(__fmul_rn(dyv[e], yv[e]), bad, v, limb)) continue;
            if (limb != pair(e)) {
                flush(e);
                pairs = (pairs & ~(15ull << (4 * e))) | ((unsigned long long)limb << (4 * e));
            }
            acc[e] += v;
        }
    }
};

#if ADALN_EXACT_ROW_DOUBLE
typedef DoubleGateSums GateExactSums;  // exact_row_windows.cu's float64 windows (TUNING's EXACT_ROW_DOUBLE)
#else
typedef ExactGateSums GateExactSums;
#endif

// An H3 block's gated residual backward (gated_residual_bwd_sorted_bf16's d_y and grid, rows in table-row order) with
// its gate sums exact (GateExactSums) into table_limbs (LIMBS, R, H) and flags (2,) int32 with fixups as the row
// passes' (exact_fixup_gates_bf16 adds them), zeroed by the caller: no partials, no reduce. Run:
// adaln_lab.ops.gated_residual.launch.backward_exact.
extern "C" __global__ void __launch_bounds__(ADALN_GR_THREADS)
gated_residual_bwd_sorted_exact_bf16(const bf16_t* __restrict__ dout, const float* __restrict__ gate,
                                     const bf16_t* __restrict__ y, const index_t* __restrict__ row_index,
                                     const int* __restrict__ row_order, bf16_t* __restrict__ d_y,
                                     unsigned long long* __restrict__ table_limbs, int* __restrict__ flags,
                                     int4* __restrict__ fixups, int gate_stride, int S, int rows, int rows_per_range,
                                     int capacity) {
    const int c = blockIdx.y * ADALN_GR_THREADS + threadIdx.x;
    GateExactSums sums;
    sums.init(table_limbs, fixups, flags, capacity, c);
    gated_residual_sorted_pass(sums, dout, gate, y, row_index, row_order, d_y, gate_stride, S, rows, rows_per_range, c);
    if (sums.bad) atomicOr(flags, sums.bad);
}
