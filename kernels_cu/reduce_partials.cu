// reduce_partials.cu: the ordered reduction of norm_modulate_bwd's row_partials into the table
// gradient (fp32, kept unrounded for table_bwd.cu), d_norm_weight and d_bias.
//
//   A[t, h] = sum_b row_partials[b, t, 0, h]        B[t, h] = sum_b row_partials[b, t, 1, h]
//   d_table[t, h]      = B[t, h]                                (d_shift, fp32)
//   d_table[t, H + h]  = norm_weight[h] * A[t, h]               (d_scale, fp32)
//   d_norm_weight[h]   = bf16(sum_t (1 + scale[t, h]) * A[t, h])    scale from the fp32 table
//   d_bias[j]          = bf16(sum_t d_table[t, j])
//
// Launch geometry (shapes only): block (32, ADALN_SUM_GROUPS), grid = ceil(H / 32); one h per
// threadIdx.x. Reduction order: ordered_column_sum over the blocks b (adaln_common.cuh), in
// double; then t = 0 .. T-1 in order, in double; each output rounded once.
// Run: adaln_lab.cupy_backend.reduce_partials(row_partials, norm_weight, table_f32).

extern "C" __global__ void __launch_bounds__(32 * ADALN_SUM_GROUPS)
reduce_partials_bf16(const float* __restrict__ row_partials, const bf16_t* __restrict__ norm_weight,
                     const float* __restrict__ table_f32, float* __restrict__ d_table,
                     bf16_t* __restrict__ d_norm_weight, bf16_t* __restrict__ d_bias, int nblocks) {
    __shared__ double scratch[ADALN_SUM_GROUPS][32];
    const int h = blockIdx.x * 32 + threadIdx.x;
    const bool valid = h < ADALN_H;
    const double w = valid ? (double)bf16_to_float(norm_weight[h]) : 0.0;
    const size_t stride = (size_t)ADALN_T * 2 * ADALN_H;
    double d_nw = 0.0, d_shift_sum = 0.0, d_scale_sum = 0.0;
#pragma unroll 1
    for (int t = 0; t < ADALN_T; ++t) {
        const double a = ordered_column_sum(row_partials + (size_t)t * 2 * ADALN_H + h, nblocks, stride, valid, scratch);
        const double b = ordered_column_sum(row_partials + (size_t)t * 2 * ADALN_H + ADALN_H + h, nblocks, stride,
                                            valid, scratch);
        if (threadIdx.y == 0 && valid) {
            const float d_shift = (float)b, d_scale = (float)(w * a);
            d_table[t * 2 * ADALN_H + h] = d_shift;
            d_table[t * 2 * ADALN_H + ADALN_H + h] = d_scale;
            d_nw += (1.0 + (double)table_f32[t * 2 * ADALN_H + ADALN_H + h]) * a;
            d_shift_sum += (double)d_shift;
            d_scale_sum += (double)d_scale;
        }
    }
    if (threadIdx.y == 0 && valid) {
        d_norm_weight[h] = float_to_bf16((float)d_nw);
        d_bias[h] = float_to_bf16((float)d_shift_sum);
        d_bias[ADALN_H + h] = float_to_bf16((float)d_scale_sum);
    }
}
