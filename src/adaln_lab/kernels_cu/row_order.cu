// row_order.cu: the rows of a batch in table-row order, for the blocks' backward row passes.
//
//   row_offsets[t] (T + 1,) int32: the first position of table row t; row_offsets[T] = S
//   order[p]       (S,) int32:     the positions s of row_index (S,) sorted by sort_key(row_index[s]) (an
//                                  index outside [0, T) sorts with table row 0), stable: s ascending inside
//                                  one table row
// A kernel over rows = batches * S rows walks the positions p of that order (fill_sorted_rows in
// adaln_common.cuh): table row by table row, inside one in row order. A range of positions then
// holds the rows of the few table rows it spans (one or two where each holds more rows than a range) instead
// of all T, so its partial sums are that many rows of (H,) instead of T (norm_modulate_bwd.cu's sorted passes,
// gated_residual.cu's backward): partial sums slot b + t of range b and table row t (unique: along the ranges t never falls and b + t grows).
// The order is a function of row_index alone: the same indices give the same order and the same sums.
//
// Geometry (T <= 32; more table rows at the end of this file): one block of ROW_ORDER_THREADS threads; thread i owns the positions [i * chunk, (i + 1) * chunk),
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

#if !ADALN_ROW_ORDER_WIDE
static_assert(ADALN_T <= 32 && ROW_ORDER_BATCH == 16, "row_order: a warp per table row in the scan; a staged key "
              "is one byte, read 16 at a time");

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
#else
// Many table rows (plan.row_order_wide: T > 32, the one-block kernel's warp per table row): the same outputs from
// three kernels over C chunks of `chunk` positions (plan.row_order_chunking(S)), with `scratch` (T x C ints,
// t-major):
// (1) row_order_count, a block a chunk: its counts per table row (shared-memory atomics: counts do not depend on
//     their order) to scratch[t * C + c];
// (2) row_order_scan, one block: the exclusive scan of scratch in (t, c) order, in place (each thread a
//     contiguous segment, then the threads' totals in order), and row_offsets;
// (3) row_order_scatter, a warp a chunk, 32 positions at a time in order: each lane's rank among the lanes of
//     the same table row below it (__match_any_sync), added to its chunk's running offset of that row (shared
//     memory): stable, as the one-block kernel. Integers only: the same order as the one-block kernel.
#define RO_WARPS 4  // row_order_scatter: chunks (warps) of a block; T ints of shared memory each

extern "C" __global__ void __launch_bounds__(256)
row_order_count(const index_t* __restrict__ row_index, int* __restrict__ scratch, int S, int chunk, int chunks) {
    extern __shared__ int hist[];  // [ADALN_T]
    for (int t = threadIdx.x; t < ADALN_T; t += blockDim.x) hist[t] = 0;
    __syncthreads();
    const long long p0 = (long long)blockIdx.x * chunk;
    const int n = (int)max(0LL, min((long long)chunk, (long long)S - p0));
    for (int i = threadIdx.x; i < n; i += blockDim.x) atomicAdd(&hist[sort_key(row_index[p0 + i])], 1);
    __syncthreads();
    for (int t = threadIdx.x; t < ADALN_T; t += blockDim.x) scratch[(size_t)t * chunks + blockIdx.x] = hist[t];
}

extern "C" __global__ void __launch_bounds__(ROW_ORDER_THREADS)
row_order_scan(int* __restrict__ scratch, int* __restrict__ row_offsets, int S, int chunks) {
    __shared__ int totals[ROW_ORDER_THREADS / 32];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const long long n = (long long)ADALN_T * chunks, per = (n + ROW_ORDER_THREADS - 1) / ROW_ORDER_THREADS;
    const long long i0 = min(n, tid * per), i1 = min(n, i0 + per);
    int sum = 0;
    for (long long i = i0; i < i1; ++i) sum += scratch[i];
    const int inclusive = warp_inclusive_scan(sum);
    if (lane == 31) totals[warp] = inclusive;
    __syncthreads();
    if (warp == 0) {
        const int c = totals[lane];
        totals[lane] = warp_inclusive_scan(c) - c;
    }
    __syncthreads();
    int run = totals[warp] + inclusive - sum;  // positions before this thread's segment
    for (long long i = i0; i < i1; ++i) {
        const int c = scratch[i];
        scratch[i] = run;
        if (i % chunks == 0) row_offsets[i / chunks] = run;  // table row i / chunks starts with its chunk 0
        run += c;
    }
    if (tid == 0) row_offsets[ADALN_T] = S;
}

extern "C" __global__ void __launch_bounds__(32 * RO_WARPS)
row_order_scatter(const index_t* __restrict__ row_index, const int* __restrict__ scratch, int* __restrict__ order,
                  int S, int chunk, int chunks) {
    extern __shared__ int running[];  // [RO_WARPS][ADALN_T]: each warp's chunk's next position per table row
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, c = blockIdx.x * RO_WARPS + warp;
    if (c >= chunks) return;  // the same for the whole warp; no barrier below
    int* const next = running + warp * ADALN_T;
    for (int t = lane; t < ADALN_T; t += 32) next[t] = scratch[(size_t)t * chunks + c];
    __syncwarp();
    const long long p0 = (long long)c * chunk;
    const int n = (int)max(0LL, min((long long)chunk, (long long)S - p0));
    for (int i = 0; i < n; i += 32) {
        const int key = i + lane < n ? sort_key(row_index[p0 + i + lane]) : -1;
        const unsigned peers = __match_any_sync(0xffffffffu, key);
        const int leader = __ffs(peers) - 1, rank = __popc(peers & ((1u << lane) - 1));
        int base = 0;
        if (lane == leader && key >= 0) {
            base = next[key];
            next[key] = base + __popc(peers);
        }
        base = __shfl_sync(0xffffffffu, base, leader);
        if (key >= 0) order[base + rank] = (int)(p0 + i + lane);
        __syncwarp();
    }
}
#endif
