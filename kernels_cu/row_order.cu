// row_order.cu: the rows of a batch in table-row order, for the blocks' backward row passes.
//
//   row_offsets[t] (T + 1,) int32: the first position of table row t; row_offsets[T] = S
//   order[p]       (S,) int32:     the positions s of row_index (S,) sorted by sort_key(row_index[s]) (an
//                                  index outside [0, T) sorts with table row 0), stable: s ascending inside
//                                  one table row
// A kernel over rows = batches * S rows walks the positions p of that order (fill_sorted_rows in
// adaln_common.cuh): table row by table row, inside one the rows in row order. A range of positions then
// holds the rows of one or two table rows instead of all T, so its partial sums are one or two rows of
// (H,) instead of T (norm_modulate_bwd.cu's sorted pass, gated_residual.cu's backward): partial sums
// slot b + t of range b and table row t (unique: along the ranges t never falls and b + t grows).
// The order is a function of row_index alone: the same indices give the same order and the same sums.
//
// Geometry: one block of 1024 threads (32 warps); warp w counts, then places, the positions of its segment
// [w * seg, (w + 1) * seg), seg = 32 * ceil(S / 1024): counts by ballot (lane t keeps table row t's), one
// exclusive scan over (t, warp) by warp 0, then ranks inside a warp by __match_any_sync, segments in order.
// Every count is an integer, so the result does not depend on timing. Loads: ROW_ORDER_BATCH keys per lane
// in flight. Run: adaln_lab.launchers.launch_row_order (adaln_lab/block_cuda.py, every block backward).

#define ROW_ORDER_BATCH 8

extern "C" __global__ void __launch_bounds__(1024)
row_order(const index_t* __restrict__ row_index, int* __restrict__ row_offsets, int* __restrict__ order, int S) {
    __shared__ int counts[32][33];  // [warp][table row]: the counts, then each warp's next position per table row
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int seg = 32 * ((S + 1023) / 1024);
    const int p_begin = min(S, warp * seg), p_end = min(S, p_begin + seg);
    int count = 0;  // lane t: the positions of table row t in this warp's segment
    for (int p = p_begin; p < p_end; p += 32 * ROW_ORDER_BATCH) {
        int keys[ROW_ORDER_BATCH];
#pragma unroll
        for (int u = 0; u < ROW_ORDER_BATCH; ++u) {
            const int pos = p + 32 * u + lane;
            keys[u] = pos < p_end ? sort_key(row_index[pos]) : -1;
        }
#pragma unroll
        for (int u = 0; u < ROW_ORDER_BATCH; ++u)
            for (int t = 0; t < ADALN_T; ++t) {
                const unsigned hits = __ballot_sync(0xffffffffu, keys[u] == t);
                if (lane == t) count += __popc(hits);
            }
    }
    if (lane < ADALN_T) counts[warp][lane] = count;
    __syncthreads();
    if (warp == 0) {
        int total = 0;
        if (lane < ADALN_T)
            for (int w = 0; w < 32; ++w) total += counts[w][lane];
        int inclusive = total;
#pragma unroll
        for (int offset = 1; offset < 32; offset <<= 1) {
            const int v = __shfl_up_sync(0xffffffffu, inclusive, offset);
            if (lane >= offset) inclusive += v;
        }
        if (lane < ADALN_T) {
            int next = inclusive - total;
            row_offsets[lane] = next;
            for (int w = 0; w < 32; ++w) {
                const int c = counts[w][lane];
                counts[w][lane] = next;
                next += c;
            }
        }
        if (lane == 0) row_offsets[ADALN_T] = S;
    }
    __syncthreads();
    const unsigned lanes_below = (1u << lane) - 1u;
    for (int p = p_begin; p < p_end; p += 32 * ROW_ORDER_BATCH) {
        int keys[ROW_ORDER_BATCH];
#pragma unroll
        for (int u = 0; u < ROW_ORDER_BATCH; ++u) {
            const int pos = p + 32 * u + lane;
            keys[u] = pos < p_end ? sort_key(row_index[pos]) : -1;
        }
#pragma unroll
        for (int u = 0; u < ROW_ORDER_BATCH; ++u) {
            const unsigned same = __match_any_sync(0xffffffffu, keys[u]);
            if (keys[u] >= 0) order[counts[warp][keys[u]] + __popc(same & lanes_below)] = p + 32 * u + lane;
            __syncwarp();
            if (keys[u] >= 0 && (same & lanes_below) == 0) counts[warp][keys[u]] += __popc(same);
            __syncwarp();
        }
    }
}
