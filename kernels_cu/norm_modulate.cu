// norm_modulate.cu: fused RMSNorm + modulation, one row per block, diffusers' rounding points.
//
//   rstd[r] = rsqrt(sum_h x[r,h]^2 / H + eps)                          fp32, saved for backward
//   n       = bf16(x * rstd * norm_weight)                              (F.rms_norm rounds once)
//   out     = bf16(bf16(n * bf16(1 + scale[t])) + shift[t]),  t = timestep_indices[r % S]
// with shift = table[t, :H], scale = table[t, H:] (bf16). A row whose index is outside [0, T)
// gets NaN (the op checks indices before launching unless told not to).
//
// Launch geometry (shapes only): grid = rows (= x.numel() / H), block = ADALN_ROW_THREADS;
// thread i holds the 8-wide vectors i, i + ADALN_ROW_THREADS, ... (ADALN_ROW_VPT of them).
// Reduction order: per thread in vector then element order, then block_sum (adaln_common.cuh):
// the same tree for every row, whatever the number of rows.
// Run: adaln_lab.cupy_backend.norm_modulate(x, norm_weight, table, timestep_indices, eps).

extern "C" __global__ void __launch_bounds__(ADALN_ROW_THREADS)
norm_modulate_bf16(const bf16_t* __restrict__ x, const bf16_t* __restrict__ norm_weight,
                   const bf16_t* __restrict__ table, const index_t* __restrict__ timestep_indices,
                   bf16_t* __restrict__ out, float* __restrict__ rstd, int S, float eps) {
    __shared__ float scratch[ADALN_ROW_WARPS + 1];
    const size_t row = blockIdx.x;
    const bf16_t* xr = x + row * ADALN_H;
    const index_t t = timestep_indices[row % S];

    float xv[ADALN_ROW_VPT][ADALN_VEC];
    float ss = 0.0f;
#pragma unroll
    for (int i = 0; i < ADALN_ROW_VPT; ++i) {
        const int v = threadIdx.x + i * ADALN_ROW_THREADS;
        if (v < ADALN_NVEC_H) {
            load8(xr + v * ADALN_VEC, xv[i]);
#pragma unroll
            for (int e = 0; e < ADALN_VEC; ++e) ss = fmaf(xv[i][e], xv[i][e], ss);
        }
    }
    const float r = rsqrtf(block_sum(ss, scratch) / (float)ADALN_H + eps);
    if (threadIdx.x == 0) rstd[row] = r;
    const bool valid = t >= 0 && t < ADALN_T;
    const bf16_t* shift = table + (valid ? t : 0) * 2 * ADALN_H;
    const bf16_t* scale = shift + ADALN_H;

#pragma unroll
    for (int i = 0; i < ADALN_ROW_VPT; ++i) {
        const int v = threadIdx.x + i * ADALN_ROW_THREADS;
        if (v < ADALN_NVEC_H) {
            float w[ADALN_VEC], sh[ADALN_VEC], sc[ADALN_VEC], o[ADALN_VEC];
            load8(norm_weight + v * ADALN_VEC, w);
            load8(shift + v * ADALN_VEC, sh);
            load8(scale + v * ADALN_VEC, sc);
#pragma unroll
            for (int e = 0; e < ADALN_VEC; ++e) {
                const float n = round_bf16((xv[i][e] * r) * w[e]);
                const float p = round_bf16(n * round_bf16(1.0f + sc[e]));
                o[e] = valid ? p + sh[e] : __int_as_float(0x7fc00000);
            }
            store8(out + row * ADALN_H + v * ADALN_VEC, o);
        }
    }
}
