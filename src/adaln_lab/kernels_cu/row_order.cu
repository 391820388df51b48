// row_order.cu: the rows of a batch in table-row order, for the blocks' backward row passes.
//
//   row_offsets[t] (T + 1,) int32: the first position of table row t; row_offsets[T] = S
//   order[p]       (S,) int32:     the positions s of row_index (S,) sorted by sort_key(row_index[s]) (an
//                                  index outside [0, T) sorts with table row 0), stable: s ascending inside
//                                  one table row
// A kernel over rows = batches * S rows walks the positions p of that order (fill_sorted_rows in
// adaln_common.cuh): table row by table row, inside one in row order. A range of positions then
// holds the rows of the few table rows it spans (one or two where each holds more rows than a range) instead
// of all T, so its partial sums are that many rows of (H,) instead of T (norm_modulate_bwd.cu's sorted passes, gated_residual.cu's backward): partial sums
// slot b + t of range b and table row t (unique: along the ranges t never falls and b + t grows).
// The order is a function of row_index alone: the same indices give the same order and the same sums.
//
// Geometry: one block of ROW_ORDER_THREADS threads; thread i owns the positions [i * chunk, (i + 1) * chunk),
// chunk = ceil(S / ROW_ORDER_THREADS) rounded up to a multiple of 16, a counting sort: (1) thread i counts its
// positions per table row in its own column of counts[t][i] (dynamic shared memory, plan.row_order_smem),
// (2) one exclusive scan of counts in (t, i) order (warp shuffles, then the warps' totals, then the table
// rows'), (3) thread i places its positions in order. Where S <= ROW_ORDER_KEYS_MAX the keys are first
// staged in shared memory as bytes (coalesced loads of row_index, read once; plan.row_order_smem(S) counts
// them) and each thread reads 16 at a time; else both passes load them from row_index (ROW_ORDER_BATCH in
// flight per thread). Integers only: the result does not depend on timing.
// Run: adaln_lab.core.launchers.launch_row_order (adaln_lab/ops/row_order/op.py, every block backward).

#define ROW_ORDER_THREADS ADALN_ROW_ORDER_THREADS
#define ROW_ORDER_BATCH 16
#define ROW_ORDER_KEYS_MAX ADALN_ROW_ORDER_KEYS_MAX
static_assert(ROW_ORDER_THREADS == 32 * 32, "row_order: one warp per lane in the scan of the warps' totals");
static_assert(ADALN_T <= 255 && ROW_ORDER_BATCH == 16, "row_order: a staged key is one byte, read 16 at a time");

// inclusive prefix sum of v over the lanes of a warp
__device__ __forceinline__ int warp_inclusive_scan(int v) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
        const int u = __shfl_up_sync(0xffffffffu, v, offset);
        if (lane >= offset) v += u;
    }
    return v;
}

// the table rows (sort_key) of positions p .. p + ROW_ORDER_BATCH - 1, -1 from p_end on: from the staged bytes
// (16 at a time: p is a multiple of 16) or from row_index
__device__ __forceinline__ void load_keys(int keys[ROW_ORDER_BATCH], const unsigned char* staged,
                                          const index_t* row_index, int p, int p_end) {
    if (staged != nullptr) {
        const uint4 raw = *reinterpret_cast<const uint4*>(staged + p);
        const unsigned words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
        for (int u = 0; u < ROW_ORDER_BATCH; ++u)
            keys[u] = p + u < p_end ? (int)((words[u / 4] >> (8 * (u % 4))) & 0xffu) : -1;
        return;
    }
#pragma unroll
    for (int u = 0; u < ROW_ORDER_BATCH; ++u) keys[u] = p + u < p_end ? sort_key(row_index[p + u]) : -1;
}

extern "C" __global__ void __launch_bounds__(ROW_ORDER_THREADS)
row_order(const index_t* __restrict__ row_index, int* __restrict__ row_offsets, int* __restrict__ order, int S) {
    extern __shared__ __align__(16) int counts[];  // [ADALN_T][ROW_ORDER_THREADS], then the staged keys [S] (bytes)
    __shared__ int warp_offsets[ADALN_T][ROW_ORDER_THREADS / 32];  // [t][warp]: the warps' totals, then offsets
    __shared__ int starts[ADALN_T];                            // table rows' totals, then first positions
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int chunk = ((S + ROW_ORDER_THREADS - 1) / ROW_ORDER_THREADS + 15) / 16 * 16;
    const int p_begin = (int)min((long long)S, (long long)tid * chunk), p_end = min(S, p_begin + chunk);
    unsigned char* const staged = S <= ROW_ORDER_KEYS_MAX ? reinterpret_cast<unsigned char*>(counts + ADALN_T *
                                                                                              ROW_ORDER_THREADS)
                                                          : nullptr;
    if (staged != nullptr) {
        for (int p = tid; p < S; p += ROW_ORDER_THREADS) staged[p] = (unsigned char)sort_key(row_index[p]);
        __syncthreads();
    }
    int* const mine = counts + tid;  // this thread's column: mine[t * ROW_ORDER_THREADS]
#pragma unroll
    for (int t = 0; t < ADALN_T; ++t) mine[t * ROW_ORDER_THREADS] = 0;
    for (int p = p_begin; p < p_end; p += ROW_ORDER_BATCH) {
        int keys[ROW_ORDER_BATCH];
        load_keys(keys, staged, row_index, p, p_end);
#pragma unroll
        for (int u = 0; u < ROW_ORDER_BATCH; ++u)
            if (keys[u] >= 0) ++mine[keys[u] * ROW_ORDER_THREADS];
    }
    int below[ADALN_T];  // per table row: the counts of the lanes below this one in its warp
#pragma unroll
    for (int t = 0; t < ADALN_T; ++t) {
        const int c = mine[t * ROW_ORDER_THREADS];
        const int inclusive = warp_inclusive_scan(c);
        below[t] = inclusive - c;
        if (lane == 31) warp_offsets[t][warp] = inclusive;
    }
    __syncthreads();
    if (warp < ADALN_T) {  // warp t: table row t's warps, in order
        const int c = warp_offsets[warp][lane];
        const int inclusive = warp_inclusive_scan(c);
        warp_offsets[warp][lane] = inclusive - c;
        if (lane == 31) starts[warp] = inclusive;
    }
    __syncthreads();
    if (warp == 0) {  // the table rows, in order
        const int c = lane < ADALN_T ? starts[lane] : 0;
        const int inclusive = warp_inclusive_scan(c);
        if (lane < ADALN_T) {
            starts[lane] = inclusive - c;
            row_offsets[lane] = inclusive - c;
        }
        if (lane == 0) row_offsets[ADALN_T] = S;
    }
    __syncthreads();
#pragma unroll
    for (int t = 0; t < ADALN_T; ++t) mine[t * ROW_ORDER_THREADS] = starts[t] + warp_offsets[t][warp] + below[t];
    for (int p = p_begin; p < p_end; p += ROW_ORDER_BATCH) {
        int keys[ROW_ORDER_BATCH];
        load_keys(keys, staged, row_index, p, p_end);
#pragma unroll
        for (int u = 0; u < ROW_ORDER_BATCH; ++u)
            if (keys[u] >= 0) order[mine[keys[u] * ROW_ORDER_THREADS]++] = p + u;
    }
}
