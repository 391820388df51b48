// reduce_partials.cu: the ordered reduction of norm_modulate_bwd's row_partials into the table
// gradient (fp32, kept unrounded for table_bwd.cu), d_norm_weight and d_bias.
//
//   A[t, h] = sum_b row_partials[b, t, 0, h]        B[t, h] = sum_b row_partials[b, t, 1, h]
//   d_shift[t, h]      = B[t, h]                                (fp32, at d_shift + t * d_stride + h)
//   d_scale[t, h]      = norm_weight[h] * A[t, h]               (fp32, at d_scale + t * d_stride + h)
//   d_norm_weight[h]   = bf16(sum_t (1 + scale[t, h]) * A[t, h])    scale from the fp32 table (row stride
//                                                                   table_stride, as norm_modulate_bwd.cu)
//   d_bias[j]          = bf16(sum_t d_table[t, j]),  d_table = d_shift | d_scale
// (norm_out: d_shift = d_table, d_scale = d_table + H, d_stride = 2H; a block's norm: two (T, H) arrays)
//
// Geometry (adaln_lab/plan.py): block (32, ADALN_SUM_GROUPS), grid = ceil(H / 32); one h per
// threadIdx.x. Reduction order: each A and B is an ordered sum over the row ranges b (group_bounds
// in adaln_common.cuh: ADALN_SUM_GROUPS groups in row order, in double, then the groups in order);
// then t = 0 .. T-1 in order, in double; each output rounded once. ADALN_RP_T timesteps (plan.rp_t:
// all of them up to TUNING's RP_T_MAX) are summed at once, so every thread has 2 * ADALN_RP_T loads in
// flight per row range; their group sums sit in dynamic shared memory (plan.rp_smem) and the warps add
// them up side by side, one (t, half) each, in group order; warp 0 then runs the t loop.
// Run: adaln_lab.launchers.launch_backward (its second kernel).

#define RP_C (2 * ADALN_RP_T)  // (t, half) sums of one pass

// Column h's table gradients from table row t's sums over rows, A = sum dy * xhat and B = sum dy (both
// kernels here): add() stores d_shift[t] and d_scale[t] and carries d_norm_weight's and d_bias's sums,
// called for t = 0 .. T-1 in order; store() rounds those once.
struct TableGradients {
    double w, d_nw, d_shift_sum, d_scale_sum;
    __device__ explicit TableGradients(double norm_weight) : w(norm_weight), d_nw(0.0), d_shift_sum(0.0),
                                                             d_scale_sum(0.0) {}
    __device__ void add(int t, int h, double a, double bsum, const float* table_f32, int table_stride,
                        float* d_shift, float* d_scale, int d_stride) {
        const float shift_grad = (float)bsum, scale_grad = (float)(w * a);
        d_shift[(size_t)t * d_stride + h] = shift_grad;
        d_scale[(size_t)t * d_stride + h] = scale_grad;
        d_nw += (1.0 + (double)table_f32[(size_t)t * table_stride + ADALN_H + h]) * a;
        d_shift_sum += (double)shift_grad;
        d_scale_sum += (double)scale_grad;
    }
    __device__ void store(int h, bf16_t* d_norm_weight, bf16_t* d_bias) const {
        d_norm_weight[h] = float_to_bf16((float)d_nw);
        d_bias[h] = float_to_bf16((float)d_shift_sum);
        d_bias[ADALN_H + h] = float_to_bf16((float)d_scale_sum);
    }
};

extern "C" __global__ void __launch_bounds__(32 * ADALN_SUM_GROUPS)
reduce_partials_bf16(const float* __restrict__ row_partials, const bf16_t* __restrict__ norm_weight,
                     const float* __restrict__ table_f32, float* __restrict__ d_shift,
                     float* __restrict__ d_scale, bf16_t* __restrict__ d_norm_weight, bf16_t* __restrict__ d_bias,
                     int nblocks, int table_stride, int d_stride) {
    // [ADALN_SUM_GROUPS][RP_C][32] the groups' sums, then [RP_C][32] their sums in group order
    extern __shared__ double rp_smem[];
    double* const group_sums = rp_smem;
    double* const combined = rp_smem + ADALN_SUM_GROUPS * RP_C * 32;
    const int h = blockIdx.x * 32 + threadIdx.x;
    const bool valid = h < ADALN_H;
    TableGradients grads(valid ? (double)bf16_to_float(norm_weight[h]) : 0.0);
    const size_t stride = (size_t)ADALN_T * 2 * ADALN_H;
    int b0, b1;
    group_bounds(nblocks, threadIdx.y, b0, b1);
#pragma unroll 1
    for (int t0 = 0; t0 < ADALN_T; t0 += ADALN_RP_T) {
        double s[RP_C];
#pragma unroll
        for (int c = 0; c < RP_C; ++c) s[c] = 0.0;
        if (valid)
#pragma unroll 2
            for (int b = b0; b < b1; ++b)
#pragma unroll
                for (int c = 0; c < RP_C; ++c)  // c = 2 * (t - t0) + half
                    if (t0 + c / 2 < ADALN_T)
                        s[c] += (double)row_partials[(size_t)b * stride + (size_t)(t0 + c / 2) * 2 * ADALN_H +
                                                     (c % 2) * ADALN_H + h];
#pragma unroll
        for (int c = 0; c < RP_C; ++c) group_sums[(threadIdx.y * RP_C + c) * 32 + threadIdx.x] = s[c];
        __syncthreads();
        for (int c = threadIdx.y; c < RP_C; c += ADALN_SUM_GROUPS) {
            double v = 0.0;
#pragma unroll
            for (int g = 0; g < ADALN_SUM_GROUPS; ++g) v += group_sums[(g * RP_C + c) * 32 + threadIdx.x];
            combined[c * 32 + threadIdx.x] = v;
        }
        __syncthreads();
        if (threadIdx.y == 0 && valid) {
#pragma unroll
            for (int tt = 0; tt < ADALN_RP_T; ++tt) {
                const int t = t0 + tt;
                if (t >= ADALN_T) break;
                grads.add(t, h, combined[(2 * tt) * 32 + threadIdx.x], combined[(2 * tt + 1) * 32 + threadIdx.x],
                          table_f32, table_stride, d_shift, d_scale, d_stride);
            }
        }
        // the next pass writes group_sums only after every warp has passed this pass's second barrier,
        // and combined only after warp 0, done with it, reaches the next pass's first barrier
    }
    if (threadIdx.y == 0 && valid) grads.store(h, d_norm_weight, d_bias);
}

// reduce_partials_sorted_bf16: the same outputs from the sorted row passes' partials (norm_modulate_bwd.cu:
// row_partials (bwd_ranges + T, 2, H), table row t of range b in slot b + t). A and B of table row t add the
// slots of the ranges that hold its positions (table_row_ranges), in range order, in double; then as above.
// Geometry: block (32, ADALN_SUM_GROUPS), grid = ceil(H / 32); the table rows in passes of RPS_T, in order (the
// same adds in the same order for every T); warp y takes a pass's (t, half) sums y, y + groups, ..
#define RPS_T 32  // reduce_partials_sorted_bf16: table rows of one pass (their sums in 16 KiB of shared memory)
extern "C" __global__ void __launch_bounds__(32 * ADALN_SUM_GROUPS)
reduce_partials_sorted_bf16(const float* __restrict__ row_partials, const bf16_t* __restrict__ norm_weight,
                            const float* __restrict__ table_f32, float* __restrict__ d_shift,
                            float* __restrict__ d_scale, bf16_t* __restrict__ d_norm_weight,
                            bf16_t* __restrict__ d_bias, const int* __restrict__ row_order, int batches,
                            int rows_per_range, int table_stride, int d_stride) {
    __shared__ double combined[2 * RPS_T][32];
    const int h = blockIdx.x * 32 + threadIdx.x;
    const bool valid = h < ADALN_H;
    TableGradients grads(valid ? (double)bf16_to_float(norm_weight[h]) : 0.0);
    for (int t0 = 0; t0 < ADALN_T; t0 += RPS_T) {  // the table rows in passes of RPS_T, in order
        const int tn = min(RPS_T, ADALN_T - t0);
        for (int c = threadIdx.y; c < 2 * tn; c += ADALN_SUM_GROUPS) {  // c = 2 * (t - t0) + half
            const int t = t0 + c / 2;
            double s = 0.0;
            int b0, b1;
            if (valid && table_row_ranges(row_order, t, batches, rows_per_range, b0, b1)) {
                const float* column = row_partials + ((size_t)(b0 + t) * 2 + c % 2) * ADALN_H + h;
#pragma unroll 4
                for (int b = 0; b <= b1 - b0; ++b) s += (double)column[(size_t)b * 2 * ADALN_H];
            }
            combined[c][threadIdx.x] = s;
        }
        __syncthreads();
        if (threadIdx.y == 0 && valid)
            for (int t = t0; t < t0 + tn; ++t)
                grads.add(t, h, combined[2 * (t - t0)][threadIdx.x], combined[2 * (t - t0) + 1][threadIdx.x],
                          table_f32, table_stride, d_shift, d_scale, d_stride);
        __syncthreads();  // the pass's sums read before the next pass writes them
    }
    if (threadIdx.y != 0 || !valid) return;
    grads.store(h, d_norm_weight, d_bias);
}
