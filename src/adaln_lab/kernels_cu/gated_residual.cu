// gated_residual.cu: an H3 block's gated residual  out = x + gate[i] * y  and its backward.
//
// Rows r of x, y, out (rows, H) bf16 use table row i = row_index[r % S] of gate (R, H) fp32, row
// stride gate_stride floats (a column slice of the blocks' fp32 modulation table, whose values are
// bf16 numbers). Rounding as diffusers in bf16: g = bf16(gate), p = bf16(g * y), out = bf16(x + p).
//   gated_residual_fwd_bf16: elementwise; block = ADALN_GR_THREADS, one 8-wide vector per thread,
//     grid = ceil(rows * H / 8 / ADALN_GR_THREADS).
//   gated_residual_bwd_sorted_bf16 (`gated_residual_sorted_pass` with FloatGateSums; exact_row_pass.cu's
//     gated_residual_bwd_sorted_exact_bf16 runs it with exact sums): d_y = bf16(g * dout) per element, over the rows
//     in table-row order
//     (row_order.cu; `row_order` = its row_offsets | order); gate_partials[b + i, h] = sum over the rows of
//     range b (Rows.bwd_rows_per_range consecutive positions of that order) with table row i of dout * y (fp32,
//     in row order; the products of two bf16 numbers are exact in fp32). A thread keeps its 8 columns' sums
//     and gate values of the current table row in registers and writes the sums when its rows leave that
//     table row: a slot per table row the range spans. grid = (Rows.bwd_ranges, ceil(H / 8 / ADALN_GR_THREADS)),
//     the ranges of norm_modulate_bwd (from the number of rows alone).
//   gated_residual_reduce_sorted: d_gate[i, h] = the slots of table row i's ranges (table_row_ranges) in
//     range order, in double, stored fp32 at d_gate + i * d_stride + h (d_stride H for an (R, H) array, 6H
//     for the gate's columns of a block's table gradient). block (32, ADALN_SUM_GROUPS), grid ceil(H / 32).
// dx = dout needs no kernel. A row whose index lies outside [0, R) gets NaN in out and d_y and adds
// NaN to table row 0's sums, so the error shows in d_gate too.
// Run: adaln_lab.ops.gated_residual.launch.forward / backward (route "cupy").

#define GR_VECTORS_H (ADALN_H / ADALN_VEC)
#define GR_NAN __int_as_float(0x7fc00000)

__device__ __forceinline__ void load_gate8(const float* gate, float g[ADALN_VEC]) {
    const float4 a = *reinterpret_cast<const float4*>(gate), b = *reinterpret_cast<const float4*>(gate + 4);
    g[0] = round_bf16(a.x); g[1] = round_bf16(a.y); g[2] = round_bf16(a.z); g[3] = round_bf16(a.w);
    g[4] = round_bf16(b.x); g[5] = round_bf16(b.y); g[6] = round_bf16(b.z); g[7] = round_bf16(b.w);
}

extern "C" __global__ void __launch_bounds__(ADALN_GR_THREADS)
gated_residual_fwd_bf16(const bf16_t* __restrict__ x, const float* __restrict__ gate, const bf16_t* __restrict__ y,
                        const index_t* __restrict__ row_index, bf16_t* __restrict__ out, int gate_stride, int S,
                        int rows) {
    const size_t v = (size_t)blockIdx.x * ADALN_GR_THREADS + threadIdx.x;
    if (v >= (size_t)rows * GR_VECTORS_H) return;
    const int r = (int)(v / GR_VECTORS_H), c = (int)(v % GR_VECTORS_H);
    const int i = table_row(row_index, r, S);
    float xv[ADALN_VEC], yv[ADALN_VEC], g[ADALN_VEC], o[ADALN_VEC];
    load8(x + v * ADALN_VEC, xv);
    load8(y + v * ADALN_VEC, yv);
    load_gate8(gate + (size_t)(i < 0 ? 0 : i) * gate_stride + c * ADALN_VEC, g);
#pragma unroll
    for (int e = 0; e < ADALN_VEC; ++e) o[e] = i < 0 ? GR_NAN : xv[e] + round_bf16(g[e] * yv[e]);
    store8(out + v * ADALN_VEC, o);
}

#define GR_ROWS_IN_FLIGHT 4

// this thread's 8 sums of table row i to its columns of slot `slot` of gate_partials (slots of H floats)
__device__ __forceinline__ void store_gate_sums(float* gate_partials, size_t slot, int c, const float v[ADALN_VEC]) {
    float4* p = reinterpret_cast<float4*>(gate_partials + slot * ADALN_H + c * ADALN_VEC);
    p[0] = make_float4(v[0], v[1], v[2], v[3]);
    p[1] = make_float4(v[4], v[5], v[6], v[7]);
}

// The plain sums of the sorted pass: a thread's 8 column sums of dout * y of the current table row, in float32 (row
// order), written to slot blockIdx.x + i of gate_partials when the rows leave table row i; a row of no table row
// adds NaN. (exact_row_pass.cu's ExactGateSums keeps them as exact integers instead: the pass takes either.)
struct FloatGateSums {
    float sums[ADALN_VEC];
    float* gate_partials;
    int c;
    __device__ __forceinline__ void begin(int) {
#pragma unroll
        for (int e = 0; e < ADALN_VEC; ++e) sums[e] = 0.0f;
    }
    __device__ __forceinline__ void add(int ts, const float dyv[ADALN_VEC], const float yv[ADALN_VEC]) {
#pragma unroll
        for (int e = 0; e < ADALN_VEC; ++e) sums[e] += ts < 0 ? GR_NAN : dyv[e] * yv[e];
    }
    __device__ __forceinline__ void store(int i) { store_gate_sums(gate_partials, (size_t)blockIdx.x + i, c, sums); }
};

// d_y over the rows of range blockIdx.x in table-row order (the header's gated_residual_bwd_sorted_bf16), the column
// sums of each table row through `sums` (begin when the rows enter table row i, add a row, store when they leave it)
template <typename Sums>
__device__ __forceinline__ void gated_residual_sorted_pass(Sums& sums, const bf16_t* __restrict__ dout,
                                                           const float* __restrict__ gate,
                                                           const bf16_t* __restrict__ y,
                                                           const index_t* __restrict__ row_index,
                                                           const int* __restrict__ row_order, bf16_t* __restrict__ d_y,
                                                           int gate_stride, int S, int rows, int rows_per_range,
                                                           int c) {
    __shared__ int row_ids[ADALN_ROW_LIST_MAX], timesteps[ADALN_ROW_LIST_MAX];
    const int p0 = blockIdx.x * rows_per_range, n = min(rows, p0 + rows_per_range) - p0;
    fill_sorted_rows(row_ids, timesteps, row_index, row_order, row_order + ADALN_T + 1, p0, n, S, S ? rows / S : 0);
    __syncthreads();
    if (c >= GR_VECTORS_H) return;
    int i = sorted_table_row(timesteps[0]);
    float g[ADALN_VEC];
    load_gate8(gate + (size_t)i * gate_stride + c * ADALN_VEC, g);
    sums.begin(i);
#pragma unroll 1
    for (int k = 0; k < n; k += GR_ROWS_IN_FLIGHT) {
        uint4 dy_raw[GR_ROWS_IN_FLIGHT], y_raw[GR_ROWS_IN_FLIGHT];
#pragma unroll
        for (int q = 0; q < GR_ROWS_IN_FLIGHT; ++q) {  // every load of the group issued before any use
            const size_t at = (size_t)max(row_ids[min(k + q, n - 1)], 0) * ADALN_H + c * ADALN_VEC;
            dy_raw[q] = load_raw8(dout + at);
            y_raw[q] = load_raw8(y + at);
        }
#pragma unroll
        for (int q = 0; q < GR_ROWS_IN_FLIGHT; ++q) {
            if (k + q >= n) break;
            const int ts = timesteps[k + q];
            if (sorted_table_row(ts) != i) {  // the rows leave table row i
                sums.store(i);
                i = sorted_table_row(ts);
                load_gate8(gate + (size_t)i * gate_stride + c * ADALN_VEC, g);
                sums.begin(i);
            }
            float dyv[ADALN_VEC], yv[ADALN_VEC], dyy[ADALN_VEC];
            unpack8(dy_raw[q], dyv);
            unpack8(y_raw[q], yv);
#pragma unroll
            for (int e = 0; e < ADALN_VEC; ++e) dyy[e] = ts < 0 ? GR_NAN : g[e] * dyv[e];
            sums.add(ts, dyv, yv);
            if (row_ids[k + q] >= 0) store8(d_y + (size_t)row_ids[k + q] * ADALN_H + c * ADALN_VEC, dyy);
        }
    }
    sums.store(i);
}

extern "C" __global__ void __launch_bounds__(ADALN_GR_THREADS)
gated_residual_bwd_sorted_bf16(const bf16_t* __restrict__ dout, const float* __restrict__ gate,
                               const bf16_t* __restrict__ y, const index_t* __restrict__ row_index,
                               const int* __restrict__ row_order, bf16_t* __restrict__ d_y,
                               float* __restrict__ gate_partials, int gate_stride, int S, int rows,
                               int rows_per_range) {
    const int c = blockIdx.y * ADALN_GR_THREADS + threadIdx.x;
    FloatGateSums sums;
    sums.gate_partials = gate_partials;
    sums.c = c;
    gated_residual_sorted_pass(sums, dout, gate, y, row_index, row_order, d_y, gate_stride, S, rows, rows_per_range, c);
}

extern "C" __global__ void __launch_bounds__(32 * ADALN_SUM_GROUPS)
gated_residual_reduce_sorted(const float* __restrict__ gate_partials, float* __restrict__ d_gate,
                             const int* __restrict__ row_order, int batches, int rows_per_range, int d_stride) {
    const int h = blockIdx.x * 32 + threadIdx.x;
    if (h >= ADALN_H) return;
    for (int i = threadIdx.y; i < ADALN_T; i += ADALN_SUM_GROUPS) {
        double s = 0.0;
        int b0, b1;
        if (table_row_ranges(row_order, i, batches, rows_per_range, b0, b1)) {
            const float* column = gate_partials + (size_t)(b0 + i) * ADALN_H + h;
#pragma unroll 4
            for (int b = 0; b <= b1 - b0; ++b) s += (double)column[(size_t)b * ADALN_H];
        }
        d_gate[(size_t)i * d_stride + h] = (float)s;
    }
}
