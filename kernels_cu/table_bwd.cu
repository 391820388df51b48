// table_bwd.cu: the projection backward, from the fp32 table gradient d_table (T, 2H):
//
//   d_weight[j, k] = bf16(sum_t d_table[t, j] * silu(temb[t, k]))        (t in order, one rounding)
//   dact[t, k]     = sum_j d_table[t, j] * weight[j, k]
//   d_temb[t, k]   = dact[t, k] * silu'(temb[t, k])                      (double, stored fp32)
// The activation is used unrounded (straight-through the declared bf16 cast, and closer to the
// exact gradient). weight is read once and d_weight written once.
//
// Geometry (adaln_lab/plan.py): block = ADALN_TB_THREADS (warps W = ADALN_TB_THREADS / 32), grid =
// plan.tb_grid = (D tiles of 256 columns, ceil(2H / ADALN_TB_ROWS) row blocks). Lane l of a block
// covers the 8 columns k of vector blockIdx.x * 32 + l, warp w the ADALN_TB_ROWS / W consecutive
// rows j from blockIdx.y * ADALN_TB_ROWS + w * ADALN_TB_ROWS / W. Each thread sums its rows in
// order; the W warps' sums are added in warp order and stored to dact_partials[blockIdx.y, t, k].
// The last block of a D tile to finish (a counter per tile, zeroed by reduce_partials.cu, which
// runs just before on the same stream) then forms d_temb of that tile: an ordered sum over the row
// blocks b (group_bounds: ADALN_SUM_GROUPS groups in row order, in double, then groups in order).
// Which block is last changes nothing but who adds: the order is fixed by the shapes.
// Run: adaln_lab.launchers.table_bwd(d_table, temb, weight, counters).

#define TB_WARPS (ADALN_TB_THREADS / 32)
#define TB_ROWS_PER_WARP (ADALN_TB_ROWS / TB_WARPS)
#define TB_QUADS (ADALN_TB_COLUMNS / 4)
static_assert(ADALN_TB_ROWS % TB_WARPS == 0, "ADALN_TB_ROWS must split evenly over the warps");
static_assert(ADALN_TB_COLUMNS == 32 * ADALN_VEC, "a D tile is one 8-wide vector per lane");

extern "C" __global__ void __launch_bounds__(ADALN_TB_THREADS)
table_bwd_bf16(const float* __restrict__ d_table, const float* __restrict__ temb, const bf16_t* __restrict__ weight,
               bf16_t* __restrict__ d_weight, float* __restrict__ dact_partials, float* __restrict__ d_temb,
               unsigned* __restrict__ counters) {
    // the warps' dact sums [TB_WARPS][TB_COLUMNS] floats, then (last block) group sums [SUM_GROUPS][TB_COLUMNS] doubles
    constexpr int SHARED_DOUBLES = (TB_WARPS * ADALN_TB_COLUMNS / 2 > ADALN_SUM_GROUPS * ADALN_TB_COLUMNS)
                                       ? TB_WARPS * ADALN_TB_COLUMNS / 2 : ADALN_SUM_GROUPS * ADALN_TB_COLUMNS;
    __shared__ double shared_raw[SHARED_DOUBLES];
    __shared__ bool last;
    float (*combine)[ADALN_TB_COLUMNS] = reinterpret_cast<float (*)[ADALN_TB_COLUMNS]>(shared_raw);
    double (*group_sums)[ADALN_TB_COLUMNS] = reinterpret_cast<double (*)[ADALN_TB_COLUMNS]>(shared_raw);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int kv = blockIdx.x * 32 + lane;
    const int k0 = blockIdx.x * ADALN_TB_COLUMNS;
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
        for (int c = threadIdx.x; c < ADALN_TB_COLUMNS; c += ADALN_TB_THREADS) {
            float s = 0.0f;
#pragma unroll
            for (int ww = 0; ww < TB_WARPS; ++ww) s += combine[ww][c];
            if (k0 + c < ADALN_D) dact_partials[((size_t)blockIdx.y * ADALN_T + t) * ADALN_D + k0 + c] = s;
        }
        __syncthreads();
    }

    // the last row block of this D tile forms d_temb of the tile
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(&counters[blockIdx.x], 1u) == gridDim.y - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    const int nb = gridDim.y;
#pragma unroll 1
    for (int t = 0; t < ADALN_T; ++t) {
        for (int p = threadIdx.x; p < TB_QUADS * ADALN_SUM_GROUPS; p += ADALN_TB_THREADS) {
            const int quad = p % TB_QUADS, g = p / TB_QUADS;
            int b0, b1;
            group_bounds(nb, g, b0, b1);
            double s[4] = {0.0, 0.0, 0.0, 0.0};
            if (k0 + quad * 4 < ADALN_D)
#pragma unroll 4
                for (int b = b0; b < b1; ++b) {
                    const float4 v = load_float4_cg(dact_partials + ((size_t)b * ADALN_T + t) * ADALN_D + k0 + quad * 4);
                    s[0] += (double)v.x;
                    s[1] += (double)v.y;
                    s[2] += (double)v.z;
                    s[3] += (double)v.w;
                }
#pragma unroll
            for (int e = 0; e < 4; ++e) group_sums[g][quad * 4 + e] = s[e];
        }
        __syncthreads();
        for (int c = threadIdx.x; c < ADALN_TB_COLUMNS; c += ADALN_TB_THREADS) {
            const int k = k0 + c;
            if (k < ADALN_D) {
                double total = 0.0;
#pragma unroll
                for (int g = 0; g < ADALN_SUM_GROUPS; ++g) total += group_sums[g][c];
                const double v = temb[t * ADALN_D + k], sg = 1.0 / (1.0 + exp(-v));
                d_temb[t * ADALN_D + k] = (float)(total * sg * (1.0 + v * (1.0 - sg)));
            }
        }
        __syncthreads();
    }
}
