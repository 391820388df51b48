// table_bwd.cu: the projection backward, from the fp32 table gradient d_table (T, 2H):
//
//   d_weight[j, k] = bf16(sum_t d_table[t, j] * silu(temb[t, k]))        (t in order, one rounding)
//   dact[t, k]     = sum_j d_table[t, j] * weight[j, k]
//   d_temb[t, k]   = dact[t, k] * silu'(temb[t, k])                      (fp32)
// The activation is used unrounded (straight-through the declared bf16 cast, and closer to the
// exact gradient). weight is read once and d_weight written once, by table_bwd_bf16.
//
// table_bwd_bf16 geometry (shapes only): block = 256 threads = 8 warps; grid = (ceil(D / 256),
// ceil(2H / 64)); lane l of the block covers the 8 columns k of vector blockIdx.x * 32 + l, warp w
// the rows j = blockIdx.y * 64 + 8w .. 8w + 7. Each thread sums its 8 rows in order; the 8 warps'
// sums are added in warp order and stored to dact_partials[blockIdx.y, t, k].
// table_bwd_reduce geometry: block (32, ADALN_SUM_GROUPS), grid = (ceil(D / 32), T): one (t, k) per
// threadIdx.x, ordered_column_sum over the ceil(2H / 64) row blocks, in double.
// Run: adaln_lab.cupy_backend.table_bwd(d_table, temb, weight).

#define TB_ROWS_PER_WARP (ADALN_TB_ROWS / (ADALN_TB_THREADS / 32))
// the combine step gives each thread 32 * 8 / ADALN_TB_THREADS whole columns: more threads than
// columns would leave dact_partials unwritten (4e05566 ran 512 threads and got garbage d_temb)
static_assert(ADALN_TB_THREADS <= 32 * ADALN_VEC && (32 * ADALN_VEC) % ADALN_TB_THREADS == 0,
              "table_bwd_bf16 needs ADALN_TB_THREADS to divide 256");
static_assert(ADALN_TB_ROWS % (ADALN_TB_THREADS / 32) == 0, "ADALN_TB_ROWS must split evenly over the warps");

extern "C" __global__ void __launch_bounds__(ADALN_TB_THREADS)
table_bwd_bf16(const float* __restrict__ d_table, const float* __restrict__ temb, const bf16_t* __restrict__ weight,
               bf16_t* __restrict__ d_weight, float* __restrict__ dact_partials) {
    __shared__ float combine[ADALN_TB_THREADS / 32][32 * ADALN_VEC];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int kv = blockIdx.x * 32 + lane;
    const bool valid = kv < ADALN_NVEC_D;
    float act[ADALN_T][ADALN_VEC], dact[ADALN_T][ADALN_VEC];
#pragma unroll
    for (int t = 0; t < ADALN_T; ++t)
#pragma unroll
        for (int e = 0; e < ADALN_VEC; ++e) {
            act[t][e] = valid ? silu(temb[t * ADALN_D + kv * ADALN_VEC + e]) : 0.0f;
            dact[t][e] = 0.0f;
        }
#pragma unroll
    for (int i = 0; i < TB_ROWS_PER_WARP; ++i) {
        const int j = blockIdx.y * ADALN_TB_ROWS + warp * TB_ROWS_PER_WARP + i;
        if (!valid || j >= 2 * ADALN_H) break;
        float w[ADALN_VEC], dw[ADALN_VEC], g[ADALN_T];
        load8(weight + (size_t)j * ADALN_D + kv * ADALN_VEC, w);
#pragma unroll
        for (int t = 0; t < ADALN_T; ++t) g[t] = d_table[t * 2 * ADALN_H + j];
#pragma unroll
        for (int e = 0; e < ADALN_VEC; ++e) {
            float s = 0.0f;
#pragma unroll
            for (int t = 0; t < ADALN_T; ++t) {
                s = fmaf(g[t], act[t][e], s);
                dact[t][e] = fmaf(g[t], w[e], dact[t][e]);
            }
            dw[e] = s;
        }
        store8(d_weight + (size_t)j * ADALN_D + kv * ADALN_VEC, dw);
    }
#pragma unroll 1
    for (int t = 0; t < ADALN_T; ++t) {
#pragma unroll
        for (int e = 0; e < ADALN_VEC; ++e) combine[warp][lane * ADALN_VEC + e] = dact[t][e];
        __syncthreads();
        const int k = blockIdx.x * 32 * ADALN_VEC + threadIdx.x * (32 * ADALN_VEC / ADALN_TB_THREADS);
        for (int c = 0; c < 32 * ADALN_VEC / ADALN_TB_THREADS; ++c) {
            float s = 0.0f;
#pragma unroll
            for (int ww = 0; ww < ADALN_TB_THREADS / 32; ++ww) s += combine[ww][threadIdx.x + c];
            if (k + c < ADALN_D) dact_partials[((size_t)blockIdx.y * ADALN_T + t) * ADALN_D + k + c] = s;
        }
        __syncthreads();
    }
}

extern "C" __global__ void __launch_bounds__(32 * ADALN_SUM_GROUPS)
table_bwd_reduce(const float* __restrict__ dact_partials, const float* __restrict__ temb,
                 float* __restrict__ d_temb, int nblocks) {
    __shared__ double scratch[ADALN_SUM_GROUPS][32];
    const int k = blockIdx.x * 32 + threadIdx.x, t = blockIdx.y;
    const bool valid = k < ADALN_D;
    const double dact = ordered_column_sum(dact_partials + (size_t)t * ADALN_D + k, nblocks,
                                           (size_t)ADALN_T * ADALN_D, valid, scratch);
    if (threadIdx.y == 0 && valid) {
        const double v = temb[t * ADALN_D + k], s = 1.0 / (1.0 + exp(-v));
        d_temb[t * ADALN_D + k] = (float)(dact * s * (1.0 + v * (1.0 - s)));
    }
}
