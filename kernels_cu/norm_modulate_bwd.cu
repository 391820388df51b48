// norm_modulate_bwd.cu: the backward row pass: dx per row, and per-block partial sums over rows.
//
// With xhat = x * rstd, s1 = 1 + scale[t] (fp32 table) and g = dy * s1 * norm_weight:
//   dx[r]                    = bf16(rstd * (g - xhat * sum_h(g * xhat) / H))   per row, one rounding
//   row_partials[b, t, 0, h] = sum over the rows r of block b with timestep t of dy * xhat
//   row_partials[b, t, 1, h] = sum over the same rows of dy
// From these reduce_partials.cu forms d_shift[t] = sum_b [.,1], d_scale[t] = norm_weight * sum_b [.,0]
// and d_norm_weight = sum_t s1[t] * sum_b [.,0]. No atomics: each block owns its slice.
// A row whose index is outside [0, T) gets NaN in dx and NaN in its block's partials, so the
// error shows in every gradient (the op checks indices before launching unless told not to).
//
// Launch geometry: block = ADALN_BWD_THREADS (672 for H = 5376, one 8-wide vector per thread),
// grid = ceil(rows / rows_per_block), rows_per_block = min(ceil(rows / 132), ROW_LIST_MAX),
// chosen by the loader from the number of rows alone, never from the GPU.
// Pipeline: the block first copies its rows' timesteps to shared memory, then makes one pass
// per timestep t = 0 .. T-1 over its rows of that timestep, with the next two rows' x and dy
// already in flight while a row is reduced.
// Reduction order: the row dot product uses block_sum (the forward's tree, so dx of a row never
// depends on the other rows); the partials add the block's rows of timestep t in row order.
// Run: adaln_lab.cupy_backend.norm_modulate_bwd(dy, x, rstd, norm_weight, table_f32, timestep_indices).

#define ROW_LIST_MAX 2048

struct RowData {
    uint4 x[ADALN_BWD_VPT], dy[ADALN_BWD_VPT];
    float rstd;
};

__device__ __forceinline__ void load_row(RowData& d, const bf16_t* x, const bf16_t* dy, const float* rstd, int row) {
#pragma unroll
    for (int i = 0; i < ADALN_BWD_VPT; ++i) {
        const int v = threadIdx.x + i * ADALN_BWD_THREADS;
        if (v < ADALN_NVEC_H) {
            d.x[i] = load_raw8(x + (size_t)row * ADALN_H + v * ADALN_VEC);
            d.dy[i] = load_raw8(dy + (size_t)row * ADALN_H + v * ADALN_VEC);
        }
    }
    d.rstd = rstd[row];
}

// the next position after `i` in the block's row list that belongs to pass t (n when none)
__device__ __forceinline__ int next_in_pass(const int* timesteps, int i, int n, int t) {
    for (++i; i < n; ++i) {
        const int ts = timesteps[i];
        if (ts == t || (ts < 0 && t == 0)) break;
    }
    return i;
}

extern "C" __global__ void __launch_bounds__(ADALN_BWD_THREADS)
norm_modulate_bwd_bf16(const bf16_t* __restrict__ dy, const bf16_t* __restrict__ x, const float* __restrict__ rstd,
                       const bf16_t* __restrict__ norm_weight, const float* __restrict__ table_f32,
                       const index_t* __restrict__ timestep_indices, bf16_t* __restrict__ dx,
                       float* __restrict__ row_partials, int S, int rows, int rows_per_block) {
    __shared__ float scratch[ADALN_BWD_THREADS / 32 + 1];
    __shared__ int timesteps[ROW_LIST_MAX];
    const int r0 = blockIdx.x * rows_per_block;
    const int n = min(rows, r0 + rows_per_block) - r0;
    for (int i = threadIdx.x; i < n; i += ADALN_BWD_THREADS) {
        const index_t ts = timestep_indices[(unsigned)(r0 + i) % (unsigned)S];
        timesteps[i] = (ts < 0 || ts >= ADALN_T) ? -1 : (int)ts;
    }
    __syncthreads();

#pragma unroll 1
    for (int t = 0; t < ADALN_T; ++t) {
        const float* scale = table_f32 + t * 2 * ADALN_H + ADALN_H;
        float sum_dy_xhat[ADALN_BWD_VPT][ADALN_VEC], sum_dy[ADALN_BWD_VPT][ADALN_VEC];
#pragma unroll
        for (int i = 0; i < ADALN_BWD_VPT; ++i)
#pragma unroll
            for (int e = 0; e < ADALN_VEC; ++e) sum_dy_xhat[i][e] = sum_dy[i][e] = 0.0f;

        RowData cur, next1, next2;
        int i0 = next_in_pass(timesteps, -1, n, t);
        int i1 = next_in_pass(timesteps, i0, n, t);
        if (i0 < n) load_row(cur, x, dy, rstd, r0 + i0);
        if (i1 < n) load_row(next1, x, dy, rstd, r0 + i1);
#pragma unroll 1
        while (i0 < n) {
            const int i2 = next_in_pass(timesteps, i1, n, t);
            if (i2 < n) load_row(next2, x, dy, rstd, r0 + i2);
            const int row = r0 + i0;
            const bool invalid = timesteps[i0] < 0;
            float xhat[ADALN_BWD_VPT][ADALN_VEC], g[ADALN_BWD_VPT][ADALN_VEC];
            float dot = 0.0f;
#pragma unroll
            for (int i = 0; i < ADALN_BWD_VPT; ++i) {
                const int v = threadIdx.x + i * ADALN_BWD_THREADS;
                if (v < ADALN_NVEC_H) {
                    float dyv[ADALN_VEC], w[ADALN_VEC];
                    unpack8(cur.x[i], xhat[i]);
                    unpack8(cur.dy[i], dyv);
                    load8(norm_weight + v * ADALN_VEC, w);
                    const float4 sa = *reinterpret_cast<const float4*>(scale + v * ADALN_VEC);
                    const float4 sb = *reinterpret_cast<const float4*>(scale + v * ADALN_VEC + 4);
                    const float s1[ADALN_VEC] = {sa.x, sa.y, sa.z, sa.w, sb.x, sb.y, sb.z, sb.w};
#pragma unroll
                    for (int e = 0; e < ADALN_VEC; ++e) {
                        xhat[i][e] *= cur.rstd;
                        g[i][e] = dyv[e] * (1.0f + s1[e]) * w[e];
                        dot = fmaf(g[i][e], xhat[i][e], dot);
                        sum_dy_xhat[i][e] = fmaf(dyv[e], xhat[i][e], sum_dy_xhat[i][e]);
                        sum_dy[i][e] += dyv[e];
                    }
                }
            }
            const float mean_dot = block_sum<ADALN_BWD_THREADS / 32>(dot, scratch) / (float)ADALN_H;
#pragma unroll
            for (int i = 0; i < ADALN_BWD_VPT; ++i) {
                const int v = threadIdx.x + i * ADALN_BWD_THREADS;
                if (v < ADALN_NVEC_H) {
                    float d[ADALN_VEC];
#pragma unroll
                    for (int e = 0; e < ADALN_VEC; ++e)
                        d[e] = invalid ? __int_as_float(0x7fc00000) : cur.rstd * (g[i][e] - xhat[i][e] * mean_dot);
                    store8(dx + (size_t)row * ADALN_H + v * ADALN_VEC, d);
                }
            }
            if (invalid) {  // poison: this row belongs to no timestep
#pragma unroll
                for (int i = 0; i < ADALN_BWD_VPT; ++i)
#pragma unroll
                    for (int e = 0; e < ADALN_VEC; ++e) sum_dy_xhat[i][e] = sum_dy[i][e] = __int_as_float(0x7fc00000);
            }
            cur = next1;
            next1 = next2;
            i0 = i1;
            i1 = i2;
        }
        float* slot = row_partials + ((size_t)blockIdx.x * ADALN_T + t) * 2 * ADALN_H;
#pragma unroll
        for (int i = 0; i < ADALN_BWD_VPT; ++i) {
            const int v = threadIdx.x + i * ADALN_BWD_THREADS;
            if (v < ADALN_NVEC_H) {
#pragma unroll
                for (int e = 0; e < ADALN_VEC; e += 4) {
                    *reinterpret_cast<float4*>(slot + v * ADALN_VEC + e) =
                        make_float4(sum_dy_xhat[i][e], sum_dy_xhat[i][e + 1], sum_dy_xhat[i][e + 2], sum_dy_xhat[i][e + 3]);
                    *reinterpret_cast<float4*>(slot + ADALN_H + v * ADALN_VEC + e) =
                        make_float4(sum_dy[i][e], sum_dy[i][e + 1], sum_dy[i][e + 2], sum_dy[i][e + 3]);
                }
            }
        }
    }
}
