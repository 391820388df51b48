// norm_modulate.cu: fused RMSNorm + modulation, one row per block, diffusers' rounding points.
//
//   rstd[r] = rsqrt(sum_h x[r,h]^2 / H + eps)                          fp32, saved for backward
//   n       = bf16(x * rstd * norm_weight)                              (F.rms_norm rounds once)
//   out     = bf16(bf16(n * bf16(1 + scale[t])) + shift[t]),  t = timestep_indices[r % S]
// with shift = table[t, :H], scale = table[t, H:] (bf16). A row whose index is outside [0, T)
// gets NaN (the op checks indices before launching unless told not to).
//
// Launch geometry (shapes only): grid = rows (= x.numel() / H), block = ADALN_FWD_THREADS
// (224 for H = 5376: 3 vectors per thread measured 1.3x faster than 1, bench/NOTES.md);
// thread i holds the 8-wide vectors i, i + ADALN_FWD_THREADS, ... (ADALN_FWD_VPT of them).
// Every load (x from DRAM; norm_weight, shift, scale from L2) is issued before the reduction.
// Reduction order: per thread in vector then element order, then block_sum (adaln_common.cuh):
// the same tree for every row, whatever the number of rows.
// Run: adaln_lab.cupy_backend.norm_modulate(x, norm_weight, table, timestep_indices, eps).

extern "C" __global__ void __launch_bounds__(ADALN_FWD_THREADS)
norm_modulate_bf16(const bf16_t* __restrict__ x, const bf16_t* __restrict__ norm_weight,
                   const bf16_t* __restrict__ table, const index_t* __restrict__ timestep_indices,
                   bf16_t* __restrict__ out, float* __restrict__ rstd, int S, float eps) {
    __shared__ float scratch[ADALN_FWD_THREADS / 32 + 1];
    const unsigned row = blockIdx.x;
    const bf16_t* xr = x + (size_t)row * ADALN_H;
    uint4 x_raw[ADALN_FWD_VPT], w_raw[ADALN_FWD_VPT], shift_raw[ADALN_FWD_VPT], scale_raw[ADALN_FWD_VPT];
#pragma unroll
    for (int i = 0; i < ADALN_FWD_VPT; ++i) {
        const int v = threadIdx.x + i * ADALN_FWD_THREADS;
        if (v < ADALN_NVEC_H) {
            x_raw[i] = load_raw8(xr + v * ADALN_VEC);
            w_raw[i] = load_raw8(norm_weight + v * ADALN_VEC);
        }
    }
    const index_t t = timestep_indices[row % (unsigned)S];
    const bool valid = t >= 0 && t < ADALN_T;
    const bf16_t* shift = table + (valid ? t : 0) * 2 * ADALN_H;
#pragma unroll
    for (int i = 0; i < ADALN_FWD_VPT; ++i) {
        const int v = threadIdx.x + i * ADALN_FWD_THREADS;
        if (v < ADALN_NVEC_H) {
            shift_raw[i] = load_raw8(shift + v * ADALN_VEC);
            scale_raw[i] = load_raw8(shift + ADALN_H + v * ADALN_VEC);
        }
    }

    float ss = 0.0f;
#pragma unroll
    for (int i = 0; i < ADALN_FWD_VPT; ++i) {
        const int v = threadIdx.x + i * ADALN_FWD_THREADS;
        if (v < ADALN_NVEC_H) {
            float xv[ADALN_VEC];
            unpack8(x_raw[i], xv);
#pragma unroll
            for (int e = 0; e < ADALN_VEC; ++e) ss = fmaf(xv[e], xv[e], ss);
        }
    }
    const float r = rsqrtf(block_sum<ADALN_FWD_THREADS / 32>(ss, scratch) / (float)ADALN_H + eps);
    if (threadIdx.x == 0) rstd[row] = r;

#pragma unroll
    for (int i = 0; i < ADALN_FWD_VPT; ++i) {
        const int v = threadIdx.x + i * ADALN_FWD_THREADS;
        if (v < ADALN_NVEC_H) {
            float xv[ADALN_VEC], w[ADALN_VEC], sh[ADALN_VEC], sc[ADALN_VEC], o[ADALN_VEC];
            unpack8(x_raw[i], xv);
            unpack8(w_raw[i], w);
            unpack8(shift_raw[i], sh);
            unpack8(scale_raw[i], sc);
#pragma unroll
            for (int e = 0; e < ADALN_VEC; ++e) {
                const float n = round_bf16((xv[e] * r) * w[e]);
                const float p = round_bf16(n * round_bf16(1.0f + sc[e]));
                o[e] = valid ? p + sh[e] : __int_as_float(0x7fc00000);
            }
            store8(out + (size_t)row * ADALN_H + v * ADALN_VEC, o);
        }
    }
}
