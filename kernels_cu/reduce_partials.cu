// reduce_partials.cu: the ordered reduction of norm_modulate_bwd's row_partials into the table
// gradient (fp32, kept unrounded for table_bwd.cu), d_norm_weight and d_bias.
//
//   A[t, h] = sum_b row_partials[b, t, 0, h]        B[t, h] = sum_b row_partials[b, t, 1, h]
//   d_table[t, h]      = B[t, h]                                (d_shift, fp32)
//   d_table[t, H + h]  = norm_weight[h] * A[t, h]               (d_scale, fp32)
//   d_norm_weight[h]   = bf16(sum_t (1 + scale[t, h]) * A[t, h])    scale from the fp32 table
//   d_bias[j]          = bf16(sum_t d_table[t, j])
//
// Geometry (adaln_lab/plan.py): block (32, ADALN_SUM_GROUPS), grid = ceil(H / 32); one h per
// threadIdx.x. Reduction order: each A and B is an ordered sum over the row ranges b (group_bounds
// in adaln_common.cuh: ADALN_SUM_GROUPS groups in row order, in double, then the groups in order);
// then t = 0 .. T-1 in order, in double; each output rounded once. Up to RP_T timesteps are summed
// at once, so every thread has 2 * RP_T loads in flight per row range instead of one.
// Run: adaln_lab.launchers.launch_backward (its second kernel).

#define RP_T (ADALN_T < 4 ? ADALN_T : 4)

extern "C" __global__ void __launch_bounds__(32 * ADALN_SUM_GROUPS)
reduce_partials_bf16(const float* __restrict__ row_partials, const bf16_t* __restrict__ norm_weight,
                     const float* __restrict__ table_f32, float* __restrict__ d_table,
                     bf16_t* __restrict__ d_norm_weight, bf16_t* __restrict__ d_bias, int nblocks) {
    __shared__ double scratch[ADALN_SUM_GROUPS][2 * RP_T][32];
    const int h = blockIdx.x * 32 + threadIdx.x;
    const bool valid = h < ADALN_H;
    const double w = valid ? (double)bf16_to_float(norm_weight[h]) : 0.0;
    const size_t stride = (size_t)ADALN_T * 2 * ADALN_H;
    int b0, b1;
    group_bounds(nblocks, threadIdx.y, b0, b1);
    double d_nw = 0.0, d_shift_sum = 0.0, d_scale_sum = 0.0;
#pragma unroll 1
    for (int t0 = 0; t0 < ADALN_T; t0 += RP_T) {
        double s[2 * RP_T];
#pragma unroll
        for (int c = 0; c < 2 * RP_T; ++c) s[c] = 0.0;
        if (valid)
#pragma unroll 2
            for (int b = b0; b < b1; ++b)
#pragma unroll
                for (int c = 0; c < 2 * RP_T; ++c)  // c = 2 * (t - t0) + half
                    if (t0 + c / 2 < ADALN_T)
                        s[c] += (double)row_partials[(size_t)b * stride + (size_t)(t0 + c / 2) * 2 * ADALN_H +
                                                     (c % 2) * ADALN_H + h];
#pragma unroll
        for (int c = 0; c < 2 * RP_T; ++c) scratch[threadIdx.y][c][threadIdx.x] = s[c];
        __syncthreads();
        if (threadIdx.y == 0 && valid) {
#pragma unroll
            for (int tt = 0; tt < RP_T; ++tt) {
                const int t = t0 + tt;
                if (t >= ADALN_T) break;
                double a = 0.0, bsum = 0.0;
#pragma unroll
                for (int g = 0; g < ADALN_SUM_GROUPS; ++g) {
                    a += scratch[g][2 * tt][threadIdx.x];
                    bsum += scratch[g][2 * tt + 1][threadIdx.x];
                }
                const float d_shift = (float)bsum, d_scale = (float)(w * a);
                d_table[t * 2 * ADALN_H + h] = d_shift;
                d_table[t * 2 * ADALN_H + ADALN_H + h] = d_scale;
                d_nw += (1.0 + (double)table_f32[t * 2 * ADALN_H + ADALN_H + h]) * a;
                d_shift_sum += (double)d_shift;
                d_scale_sum += (double)d_scale;
            }
        }
        __syncthreads();
    }
    if (threadIdx.y == 0 && valid) {
        d_norm_weight[h] = float_to_bf16((float)d_nw);
        d_bias[h] = float_to_bf16((float)d_shift_sum);
        d_bias[ADALN_H + h] = float_to_bf16((float)d_scale_sum);
    }
}
