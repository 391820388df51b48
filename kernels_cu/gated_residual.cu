// gated_residual.cu: an H3 block's gated residual  out = x + gate[i] * y  and its backward.
//
// Rows r of x, y, out (rows, H) bf16 use table row i = row_index[r % S] of gate (R, H) fp32, row
// stride gate_stride floats (a column slice of the blocks' fp32 modulation table, whose values are
// bf16 numbers). Rounding as diffusers in bf16: g = bf16(gate), p = bf16(g * y), out = bf16(x + p).
//   gated_residual_fwd_bf16: elementwise; block = ADALN_GR_THREADS, one 8-wide vector per thread,
//     grid = ceil(rows * H / 8 / ADALN_GR_THREADS).
//   gated_residual_bwd_bf16: d_y = bf16(g * dout) per element; gate_partials[b, i, h] = sum over the
//     rows of range b with index i of dout * y (fp32, in row order; the products of two bf16 numbers
//     are exact in fp32). grid = (Rows.bwd_ranges, ceil(H / 8 / ADALN_GR_THREADS)), the same ranges
//     as norm_modulate_bwd (from the number of rows alone). Each thread keeps its 8 columns' sums for
//     every table row in dynamic shared memory (ADALN_T * ADALN_GR_THREADS * 8 floats) that only it
//     touches, and writes all of them, zeros included, at the end.
//   gated_residual_reduce: d_gate[i, h] = ordered_column_sum over the ranges (adaln_common.cuh), in
//     double, stored fp32. block (32, ADALN_SUM_GROUPS), grid (ceil(H / 32), ADALN_T).
// dx = dout needs no kernel. A row whose index lies outside [0, R) gets NaN in out and d_y and adds
// NaN to table row 0's sums, so the error shows in d_gate too.
// Run: adaln_lab.block_cuda.gated_residual_fwd / gated_residual_bwd on CUDA tensors.

#define GR_VECTORS_H (ADALN_H / ADALN_VEC)
#define GR_NAN __int_as_float(0x7fc00000)

__device__ __forceinline__ void load_gate8(const float* gate, float g[ADALN_VEC]) {
    const float4 a = *reinterpret_cast<const float4*>(gate), b = *reinterpret_cast<const float4*>(gate + 4);
    g[0] = round_bf16(a.x); g[1] = round_bf16(a.y); g[2] = round_bf16(a.z); g[3] = round_bf16(a.w);
    g[4] = round_bf16(b.x); g[5] = round_bf16(b.y); g[6] = round_bf16(b.z); g[7] = round_bf16(b.w);
}

__device__ __forceinline__ int table_row(const index_t* row_index, int r, int S) {
    const index_t i = row_index[(unsigned)r % (unsigned)S];
    return (i < 0 || i >= ADALN_T) ? -1 : (int)i;
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

extern "C" __global__ void __launch_bounds__(ADALN_GR_THREADS)
gated_residual_bwd_bf16(const bf16_t* __restrict__ dout, const float* __restrict__ gate,
                        const bf16_t* __restrict__ y, const index_t* __restrict__ row_index,
                        bf16_t* __restrict__ d_y, float* __restrict__ gate_partials, int gate_stride, int S,
                        int rows, int rows_per_range) {
    extern __shared__ float sums[];  // [ADALN_T][ADALN_VEC][ADALN_GR_THREADS]: this thread's column only
    const int c = blockIdx.y * ADALN_GR_THREADS + threadIdx.x;
    const bool valid = c < GR_VECTORS_H;
    const int r0 = blockIdx.x * rows_per_range, r1 = min(rows, r0 + rows_per_range);
#pragma unroll 1
    for (int k = 0; k < ADALN_T * ADALN_VEC; ++k) sums[k * ADALN_GR_THREADS + threadIdx.x] = 0.0f;
#pragma unroll 1
    for (int r = r0; valid && r < r1; r += GR_ROWS_IN_FLIGHT) {
        uint4 dy_raw[GR_ROWS_IN_FLIGHT], y_raw[GR_ROWS_IN_FLIGHT];
        int idx[GR_ROWS_IN_FLIGHT];
#pragma unroll
        for (int q = 0; q < GR_ROWS_IN_FLIGHT; ++q) {  // every load of the group issued before any use
            const bool here = r + q < r1;
            const size_t at = (size_t)(here ? r + q : r) * ADALN_H + c * ADALN_VEC;
            dy_raw[q] = load_raw8(dout + at);
            y_raw[q] = load_raw8(y + at);
            idx[q] = here ? table_row(row_index, r + q, S) : -2;
        }
#pragma unroll
        for (int q = 0; q < GR_ROWS_IN_FLIGHT; ++q) {
            if (idx[q] == -2) break;
            const int i = idx[q] < 0 ? 0 : idx[q];
            float dyv[ADALN_VEC], yv[ADALN_VEC], g[ADALN_VEC], dyy[ADALN_VEC];
            unpack8(dy_raw[q], dyv);
            unpack8(y_raw[q], yv);
            load_gate8(gate + (size_t)i * gate_stride + c * ADALN_VEC, g);
            float* s = sums + (size_t)i * ADALN_VEC * ADALN_GR_THREADS + threadIdx.x;
#pragma unroll
            for (int e = 0; e < ADALN_VEC; ++e) {
                dyy[e] = idx[q] < 0 ? GR_NAN : g[e] * dyv[e];
                s[e * ADALN_GR_THREADS] += idx[q] < 0 ? GR_NAN : dyv[e] * yv[e];
            }
            store8(d_y + (size_t)(r + q) * ADALN_H + c * ADALN_VEC, dyy);
        }
    }
    if (!valid) return;
    float* slot = gate_partials + (size_t)blockIdx.x * ADALN_T * ADALN_H + c * ADALN_VEC;
#pragma unroll 1
    for (int i = 0; i < ADALN_T; ++i) {
        float v[ADALN_VEC];
#pragma unroll
        for (int e = 0; e < ADALN_VEC; ++e) v[e] = sums[(i * ADALN_VEC + e) * ADALN_GR_THREADS + threadIdx.x];
        float4* p = reinterpret_cast<float4*>(slot + (size_t)i * ADALN_H);
        p[0] = make_float4(v[0], v[1], v[2], v[3]);
        p[1] = make_float4(v[4], v[5], v[6], v[7]);
    }
}

extern "C" __global__ void __launch_bounds__(32 * ADALN_SUM_GROUPS)
gated_residual_reduce(const float* __restrict__ gate_partials, float* __restrict__ d_gate, int nranges) {
    __shared__ double scratch[ADALN_SUM_GROUPS][32];
    const int h = blockIdx.x * 32 + threadIdx.x, i = blockIdx.y;
    const bool valid = h < ADALN_H;
    const double total = ordered_column_sum(gate_partials + (size_t)i * ADALN_H + h, nranges,
                                            (size_t)ADALN_T * ADALN_H, valid, scratch);
    if (threadIdx.y == 0 && valid) d_gate[(size_t)i * ADALN_H + h] = (float)total;
}
