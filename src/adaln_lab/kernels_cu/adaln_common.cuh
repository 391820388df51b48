// adaln_common.cuh: what every kernel of adaln_lab shares, written once.
//
// - bf16 <-> fp32 without cuda_bf16.h (so NVRTC needs no toolkit headers): bf16 is the upper
//   half of an fp32 word; float -> bf16 is the hardware cvt.rn (round to nearest even, the
//   rounding of __float2bfloat16_rn and of torch's bf16 casts).
// - 16-byte vector loads and stores of 8 bf16 values; cp.async copies in commit groups.
// - block_sum: THE reduction tree of a row. Each thread first sums its own values in a fixed
//   order; then a butterfly inside each warp (offsets 16, 8, 4, 2, 1) whose lane-0 value is
//   kept; then warp 0 sums the per-warp values in the same butterfly. The tree depends only on
//   blockDim (a function of H), never on the number of rows or the GPU.
// - The ordered sum of a column over n partial rows: ADALN_SUM_GROUPS contiguous groups, each
//   summed in row order in double, then the group sums in group order (group_bounds).
//
// Every ADALN_* macro comes from the launch plan (adaln_lab/plan.py: Plan.defines): the problem's
// shapes (H, D, T), the row kernels' block sizes (functions of H alone) and the constants of TUNING.

typedef unsigned short bf16_t;
typedef long long index_t;

#define ADALN_VEC 8
#define ADALN_NVEC_H (ADALN_H / ADALN_VEC)
#define ADALN_NVEC_D (ADALN_D / ADALN_VEC)

__device__ __forceinline__ float bf16_to_float(bf16_t v) { return __uint_as_float(((unsigned)v) << 16); }

__device__ __forceinline__ bf16_t float_to_bf16(float f) {
    unsigned short r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
}

// two floats to one word of two bf16 (lo in the low half), one instruction on sm_80+
__device__ __forceinline__ unsigned float2_to_bf16x2(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// round to bf16 and back: the rounding point of an op done "in the stream dtype"
__device__ __forceinline__ float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

__device__ __forceinline__ uint4 load_raw8(const bf16_t* p) { return *reinterpret_cast<const uint4*>(p); }

__device__ __forceinline__ void unpack8(uint4 raw, float v[ADALN_VEC]) {
    unsigned w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        v[2 * i] = __uint_as_float(w[i] << 16);
        v[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}

__device__ __forceinline__ void load8(const bf16_t* p, float v[ADALN_VEC]) { unpack8(load_raw8(p), v); }

// Asynchronous 16-byte copies global -> shared (cp.async, sm_80+), in commit groups. A thread
// that waits for its own group may read what it copied without a barrier.
__device__ __forceinline__ void copy_async16(void* shared, const void* global) {
    unsigned address;
    asm("{ .reg .u64 p; cvta.to.shared.u64 p, %1; cvt.u32.u64 %0, p; }" : "=r"(address) : "l"(shared));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(address), "l"(global) : "memory");
}
__device__ __forceinline__ void copy_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// wait until at most `pending` of this thread's newest groups are still in flight
template <int pending>
__device__ __forceinline__ void copy_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(pending) : "memory"); }

__device__ __forceinline__ void pack8(const float v[ADALN_VEC], unsigned w[4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = float2_to_bf16x2(v[2 * i], v[2 * i + 1]);
}

__device__ __forceinline__ void store8(bf16_t* p, const float v[ADALN_VEC]) {
    unsigned w[4];
    pack8(v, w);
    *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
}

__device__ __forceinline__ float warp_sum_lane0(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return __shfl_sync(0xffffffffu, v, 0);  // every lane takes lane 0's association order
}

// Sum of one value per thread over a block of WARPS warps, same bits in every thread. `scratch`
// holds WARPS + 1 floats of shared memory; the function syncs before reusing it.
template <int WARPS>
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum_lane0(v);
    __syncthreads();  // scratch may still be read from a previous call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float w = lane < WARPS ? scratch[lane] : 0.0f;
        w = warp_sum_lane0(w);
        if (lane == 0) scratch[WARPS] = w;
    }
    __syncthreads();
    return scratch[WARPS];
}

// SiLU as torch computes it in fp32: v / (1 + exp(-v)).
__device__ __forceinline__ float silu(float v) { return v / (1.0f + expf(-v)); }

// Rows [b0, b1) of group g of an ordered sum over n rows: ADALN_SUM_GROUPS contiguous groups.
__device__ __forceinline__ void group_bounds(int n, int g, int& b0, int& b1) {
    const int per = (n + ADALN_SUM_GROUPS - 1) / ADALN_SUM_GROUPS;
    b0 = min(n, g * per);
    b1 = min(n, b0 + per);
}

// Ordered sum down one column of a (n, ...) fp32 array, for block shape (32, ADALN_SUM_GROUPS):
// threadIdx.x picks the column, threadIdx.y one group of group_bounds, summed in row order in double;
// the group sums are then added in group order. The order depends on n alone. Every thread of the
// block must call it; the result is meaningful where threadIdx.y == 0.
__device__ __forceinline__ double ordered_column_sum(const float* column, int n, size_t stride, bool valid,
                                                     double (*scratch)[32]) {
    int b0, b1;
    group_bounds(n, threadIdx.y, b0, b1);
    double s = 0.0;
    if (valid)
#pragma unroll 8
        for (int b = b0; b < b1; ++b) s += (double)column[(size_t)b * stride];  // loads issued 8 at a time
    scratch[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    double total = 0.0;
    if (threadIdx.y == 0)
#pragma unroll
        for (int g = 0; g < ADALN_SUM_GROUPS; ++g) total += scratch[g][threadIdx.x];
    __syncthreads();
    return total;
}

// The table row of row r (row_index[r % S]), -1 where the index lies outside [0, T).
__device__ __forceinline__ int table_row(const index_t* row_index, int r, int S) {
    const index_t i = row_index[(unsigned)r % (unsigned)S];
    return (i < 0 || i >= ADALN_T) ? -1 : (int)i;
}

// The row list of a block that owns rows r0 .. r0 + n - 1: each row's timestep, -1 where the index
// lies outside [0, T). Called by every thread; the caller syncs before reading it.
__device__ __forceinline__ void fill_row_timesteps(int* timesteps, const index_t* timestep_indices, int r0, int n,
                                                   int S) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) timesteps[i] = table_row(timestep_indices, r0 + i, S);
}

// Whether a row of timestep ts (-1: an index outside [0, T)) belongs to the pass of timestep t: rows with an
// invalid index go with pass 0.
__device__ __forceinline__ bool in_pass(int ts, int t) { return ts == t || (ts < 0 && t == 0); }

// The next position after `i` in a block's row list that belongs to the pass of timestep t; n when none.
__device__ __forceinline__ int next_in_pass(const int* timesteps, int i, int n, int t) {
    for (++i; i < n; ++i)
        if (in_pass(timesteps[i], t)) break;
    return min(i, n);
}

// The table row a row's index sorts with (row_order.cu): its own, or 0 where it lies outside [0, T).
__device__ __forceinline__ int sort_key(index_t i) { return (i < 0 || i >= ADALN_T) ? 0 : (int)i; }

// The row list of a block that owns positions p0 .. p0 + n - 1 of the rows in table-row order
// (row_order.cu: `row_offsets` (T + 1,) and `order` (S,) over the S positions of row_index; the
// rows = batches * S rows run table row by table row, inside one in row order). row_ids[i] is the
// row at position p0 + i; timesteps[i] the table row t of its position, or -(t + 1) for a row to poison:
// its index lies outside [0, T) (such rows sort with table row 0) or differs from t (an order that is not
// row_index's). A poisoned row keeps its position's t, so its NaN sums land in this range's slot of t, never
// in another range's; an order whose offsets give no row for the position (a count <= 0, a position or row
// out of range) yields row -1, poisoned: the kernels read and write nothing of it (never out of bounds).
// sorted_table_row() reads t back.
// sorted_row_at gives one position's entries (the row, -1 for none; its timesteps entry in `code`), fill_sorted_rows
// a block's. Called by every thread; the caller syncs before reading the lists.
__device__ __forceinline__ int sorted_row_at(long long p, const index_t* row_index, const int* row_offsets,
                                             const int* order, int S, int batches, int& code) {
    int t = 0;  // the table row whose positions [batches * row_offsets[t], batches * row_offsets[t + 1]) hold p
#if ADALN_T <= 32
#pragma unroll
    for (int k = 1; k < ADALN_T; ++k) t += (long long)batches * row_offsets[k] <= p;  // loads side by side
#else
    for (int hi = ADALN_T - 1; t < hi;) {  // the last k with batches * row_offsets[k] <= p: a binary search
        const int mid = (t + hi + 1) / 2;
        if ((long long)batches * row_offsets[mid] <= p) t = mid; else hi = mid - 1;
    }
#endif
    const int begin = row_offsets[t], count = row_offsets[t + 1] - begin;
    const long long q = p - (long long)batches * begin;
    const int at = count > 0 && q >= 0 ? begin + (int)(q % count) : -1;
    const int s = at >= 0 && at < S ? order[at] : -1;
    const long long row = s >= 0 && s < S ? (q / count) * S + s : -1;
    const bool usable = row >= 0 && row < (long long)batches * S;
    code = usable && row_index[s] == t ? t : -(t + 1);
    return usable ? (int)row : -1;
}

__device__ __forceinline__ void fill_sorted_rows(int* row_ids, int* timesteps, const index_t* row_index,
                                                 const int* row_offsets, const int* order, int p0, int n, int S,
                                                 int batches) {
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        row_ids[i] = sorted_row_at((long long)p0 + i, row_index, row_offsets, order, S, batches, timesteps[i]);
}

// The table row of a position from fill_sorted_rows' timesteps entry (poisoned or not).
__device__ __forceinline__ int sorted_table_row(int timestep) { return timestep >= 0 ? timestep : -timestep - 1; }

// The first range b0 and the last b1 of the ranges of `per` positions that hold table row t's positions
// (row_order.cu's layout, as fill_sorted_rows): false when t has no rows.
__device__ __forceinline__ bool table_row_ranges(const int* row_offsets, int t, int batches, int per, int& b0,
                                                 int& b1) {
    const long long first = (long long)batches * row_offsets[t], end = (long long)batches * row_offsets[t + 1];
    b0 = (int)(first / per);
    b1 = (int)((end - 1) / per);
    return end > first;
}
