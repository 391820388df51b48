// norm_modulate.cu: fused RMSNorm + modulation, two rows per block, diffusers' rounding points.
//
//   rstd[r] = rsqrt(sum_h x[r,h]^2 / H + eps)                          fp32, saved for backward
//   n       = bf16(x * rstd * norm_weight)                              (F.rms_norm rounds once)
//   out     = bf16(bf16(n * bf16(1 + scale[t])) + shift[t]),  t = timestep_indices[r % S]
// with shift = table[t, :H], scale = table[t, H:] (bf16). A row whose index is outside [0, T)
// gets NaN (the op checks indices before launching unless told not to).
//
// Launch geometry (shapes only): grid = ceil(rows / 2), block = ADALN_ROW_THREADS; block b owns
// rows 2b and 2b + 1 (the second absent when rows is odd); thread i holds the 8-wide vectors
// i, i + ADALN_ROW_THREADS, ... (ADALN_ROW_VPT of them) of both rows. Every load (x from DRAM;
// norm_weight, shift, scale from L2) is issued before the reduction, two rows deep.
// Reduction order: per thread in vector then element order, then block_sum2 (adaln_common.cuh),
// which gives each row exactly the bits of block_sum: the same tree for every row, whatever the
// number of rows and whichever row shares its block.
// Run: adaln_lab.cupy_backend.norm_modulate(x, norm_weight, table, timestep_indices, eps).

#define FWD_ROWS 2

extern "C" __global__ void __launch_bounds__(ADALN_ROW_THREADS)
norm_modulate_bf16(const bf16_t* __restrict__ x, const bf16_t* __restrict__ norm_weight,
                   const bf16_t* __restrict__ table, const index_t* __restrict__ timestep_indices,
                   bf16_t* __restrict__ out, float* __restrict__ rstd, int S, int rows, float eps) {
    __shared__ float2 scratch[ADALN_ROW_WARPS + 1];
    uint4 x_raw[FWD_ROWS][ADALN_ROW_VPT], w_raw[ADALN_ROW_VPT];
    uint4 shift_raw[FWD_ROWS][ADALN_ROW_VPT], scale_raw[FWD_ROWS][ADALN_ROW_VPT];
    bool present[FWD_ROWS], valid[FWD_ROWS];
    float ss[FWD_ROWS];
#pragma unroll
    for (int k = 0; k < FWD_ROWS; ++k) {
        const unsigned row = blockIdx.x * FWD_ROWS + k;
        present[k] = row < (unsigned)rows;
        ss[k] = 0.0f;
#pragma unroll
        for (int i = 0; i < ADALN_ROW_VPT; ++i) {
            const int v = threadIdx.x + i * ADALN_ROW_THREADS;
            if (present[k] && v < ADALN_NVEC_H) x_raw[k][i] = load_raw8(x + (size_t)row * ADALN_H + v * ADALN_VEC);
        }
    }
#pragma unroll
    for (int i = 0; i < ADALN_ROW_VPT; ++i) {
        const int v = threadIdx.x + i * ADALN_ROW_THREADS;
        if (v < ADALN_NVEC_H) w_raw[i] = load_raw8(norm_weight + v * ADALN_VEC);
    }
#pragma unroll
    for (int k = 0; k < FWD_ROWS; ++k) {
        const unsigned row = blockIdx.x * FWD_ROWS + k;
        const index_t t = present[k] ? timestep_indices[row % (unsigned)S] : 0;
        valid[k] = t >= 0 && t < ADALN_T;
        const bf16_t* shift = table + (valid[k] ? t : 0) * 2 * ADALN_H;
#pragma unroll
        for (int i = 0; i < ADALN_ROW_VPT; ++i) {
            const int v = threadIdx.x + i * ADALN_ROW_THREADS;
            if (present[k] && v < ADALN_NVEC_H) {
                shift_raw[k][i] = load_raw8(shift + v * ADALN_VEC);
                scale_raw[k][i] = load_raw8(shift + ADALN_H + v * ADALN_VEC);
            }
        }
#pragma unroll
        for (int i = 0; i < ADALN_ROW_VPT; ++i) {
            const int v = threadIdx.x + i * ADALN_ROW_THREADS;
            if (present[k] && v < ADALN_NVEC_H) {
                float xv[ADALN_VEC];
                unpack8(x_raw[k][i], xv);
#pragma unroll
                for (int e = 0; e < ADALN_VEC; ++e) ss[k] = fmaf(xv[e], xv[e], ss[k]);
            }
        }
    }
    const float2 sums = block_sum2(ss[0], ss[1], scratch);
    const float r[FWD_ROWS] = {rsqrtf(sums.x / (float)ADALN_H + eps), rsqrtf(sums.y / (float)ADALN_H + eps)};

#pragma unroll
    for (int k = 0; k < FWD_ROWS; ++k) {
        const size_t row = (size_t)blockIdx.x * FWD_ROWS + k;
        if (!present[k]) continue;
        if (threadIdx.x == 0) rstd[row] = r[k];
#pragma unroll
        for (int i = 0; i < ADALN_ROW_VPT; ++i) {
            const int v = threadIdx.x + i * ADALN_ROW_THREADS;
            if (v < ADALN_NVEC_H) {
                float xv[ADALN_VEC], w[ADALN_VEC], sh[ADALN_VEC], sc[ADALN_VEC], o[ADALN_VEC];
                unpack8(x_raw[k][i], xv);
                unpack8(w_raw[i], w);
                unpack8(shift_raw[k][i], sh);
                unpack8(scale_raw[k][i], sc);
#pragma unroll
                for (int e = 0; e < ADALN_VEC; ++e) {
                    const float n = round_bf16((xv[e] * r[k]) * w[e]);
                    const float p = round_bf16(n * round_bf16(1.0f + sc[e]));
                    o[e] = valid[k] ? p + sh[e] : __int_as_float(0x7fc00000);
                }
                store8(out + row * ADALN_H + v * ADALN_VEC, o);
            }
        }
    }
}
