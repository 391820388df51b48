// table_bwd.cu: the projection backward, from the fp32 table gradient d_table (T, N), N = ADALN_TABLE_N:
//
//   d_weight[j, k] = bf16(sum_t d_table[t, j] * silu(temb[t, k]))        (t in order, one rounding)
//   dact[t, k]     = sum_j d_table[t, j] * weight[j, k]
//   d_temb[t, k]   = dact[t, k] * silu'(temb[t, k])                      (double, stored fp32)
//   d_bias[j]      = bf16(sum_t d_table[t, j])          (t in order, in double; only where d_bias is given:
//                    the blocks' table, by the blocks of the first D tile; norm_out's comes from reduce_partials)
// The activation is used unrounded (straight-through the declared bf16 cast, and closer to the
// exact gradient). weight is read once and d_weight written once, by table_bwd_bf16 or its two halves.
//
// table_bwd_bf16 geometry (adaln_lab/plan.py; table_bwd_d_weight_bf16 and table_bwd_dact_bf16, its halves,
// take the same): block = ADALN_TB_THREADS (W = ADALN_TB_THREADS / 32
// warps), grid = plan.tb_grid = (D tiles of ADALN_TB_COLUMNS = 32 x V columns, ceil(N / ADALN_TB_ROWS) row blocks),
// V = ADALN_TB_VEC (plan.tb_vec: 8, 4 or 2 by T, so that T x V accumulators stay in registers). Lane l
// covers the V columns k of vector blockIdx.x * 32 + l, warp w the ADALN_TB_ROWS / W consecutive rows j
// from blockIdx.y * ADALN_TB_ROWS + w * ADALN_TB_ROWS / W. Each thread sums its rows in order; the W
// warps' sums are added in warp order (any block size: threads stride over the tile's 32 V columns)
// and stored to dact_partials[blockIdx.y, t, k].
// table_bwd_reduce geometry: block (32, ADALN_SUM_GROUPS), grid = (ceil(D / 32), T): one (t, k) per
// threadIdx.x, ordered_column_sum over the row blocks (adaln_common.cuh), in double.
// Run: adaln_lab.launchers.launch_backward (its third and fourth kernels).

#define TB_WARPS (ADALN_TB_THREADS / 32)
#define TB_ROWS_PER_WARP (ADALN_TB_ROWS / TB_WARPS)
#define TB_EARLY (ADALN_TB_EARLY < TB_ROWS_PER_WARP ? ADALN_TB_EARLY : TB_ROWS_PER_WARP)
static_assert(ADALN_TB_ROWS % TB_WARPS == 0, "ADALN_TB_ROWS must split evenly over the warps");
#define TB_VEC ADALN_TB_VEC
#define TB_TP ((ADALN_T + 3) / 4 * 4)  // a row's T d_table values in shared memory, padded to whole float4
static_assert(ADALN_TB_COLUMNS == 32 * TB_VEC, "a D tile is one V-wide vector per lane");
static_assert(TB_VEC == 8 || TB_VEC == 4 || TB_VEC == 2, "a lane loads 16, 8 or 4 bytes of a weight row");
static_assert(ADALN_D % TB_VEC == 0, "D is a whole number of lane vectors");

// V bf16 of a weight row, loaded in one instruction; unpacked to floats; V floats stored as bf16
struct tb_raw { unsigned w[TB_VEC / 2]; };
__device__ __forceinline__ tb_raw tb_load(const bf16_t* p) {
    tb_raw r;
    if constexpr (TB_VEC == 8) {
        const uint4 v = *reinterpret_cast<const uint4*>(p);
        r.w[0] = v.x; r.w[1] = v.y; r.w[2] = v.z; r.w[3] = v.w;
    } else if constexpr (TB_VEC == 4) {
        const uint2 v = *reinterpret_cast<const uint2*>(p);
        r.w[0] = v.x; r.w[1] = v.y;
    } else {
        r.w[0] = *reinterpret_cast<const unsigned*>(p);
    }
    return r;
}
__device__ __forceinline__ void tb_unpack(const tb_raw& raw, float v[TB_VEC]) {
#pragma unroll
    for (int i = 0; i < TB_VEC / 2; ++i) {
        v[2 * i] = __uint_as_float(raw.w[i] << 16);
        v[2 * i + 1] = __uint_as_float(raw.w[i] & 0xffff0000u);
    }
}
__device__ __forceinline__ void tb_store(bf16_t* p, const float v[TB_VEC]) {
    unsigned w[TB_VEC / 2];
#pragma unroll
    for (int i = 0; i < TB_VEC / 2; ++i) w[i] = float2_to_bf16x2(v[2 * i], v[2 * i + 1]);
    if constexpr (TB_VEC == 8) *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
    else if constexpr (TB_VEC == 4) *reinterpret_cast<uint2*>(p) = make_uint2(w[0], w[1]);
    else *reinterpret_cast<unsigned*>(p) = w[0];
}

// One block's tile: D_WEIGHT stores d_weight's rows, DACT stores the block's dact_partials. Both in
// one kernel (table_bwd_bf16) or one each (table_bwd_d_weight_bf16, table_bwd_dact_bf16, from
// plan.tb_split's T on: the fused kernel keeps 2 x V x T fp32 accumulators per thread, capped at 128 registers
// for two blocks per SM (ptxas: no spill at T = 3, 12 bytes at T = 4), the halves 128 each; the split measured
// faster at T = 9, bench/NOTES.md v4; each half V x T, which plan.tb_vec keeps <= TB_ACC_MAX). Every sum has the
// same terms in the same order either way, and whatever V is, so the bits do not depend on them.
// The block's d_table slice (T x ADALN_TB_ROWS fp32) is staged in shared memory first, transposed (a row's T
// values side by side, padded to TB_TP, read 4 at a time: at T = 32 and V = 2 a row's 32 scalar reads cost as
// much as its 64 fma, NOTES v27); a warp whose rows all exist issues its first ADALN_TB_EARLY weight loads
// before that (they do not need it).
template <bool D_WEIGHT, bool DACT>
__device__ __forceinline__ void table_bwd_tile(const float* __restrict__ d_table, const float* __restrict__ temb,
                                               const bf16_t* __restrict__ weight, bf16_t* __restrict__ d_weight,
                                               float* __restrict__ dact_partials, bf16_t* __restrict__ d_bias) {
    __shared__ float combine[DACT ? TB_WARPS : 1][ADALN_TB_COLUMNS];
    __shared__ __align__(16) float g_tile[ADALN_TB_ROWS][TB_TP];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int kv = blockIdx.x * 32 + lane;
    const int k0 = blockIdx.x * ADALN_TB_COLUMNS;
    const int j0 = blockIdx.y * ADALN_TB_ROWS;
    const bool valid = kv < ADALN_D / TB_VEC;
    const int r0 = warp * TB_ROWS_PER_WARP;
    const int nrows = valid ? min(TB_ROWS_PER_WARP, ADALN_TABLE_N - (j0 + r0)) : 0;
    const bool full = nrows == TB_ROWS_PER_WARP;  // every row of the warp exists: no bound checks between the loads
    tb_raw early[TB_EARLY > 0 ? TB_EARLY : 1];      // a full warp's first weight rows, loaded before the prologue
    if (DACT && full) {
#pragma unroll
        for (int i = 0; i < TB_EARLY; ++i) early[i] = tb_load(weight + (size_t)(j0 + r0 + i) * ADALN_D + kv * TB_VEC);
    }
    for (int i = threadIdx.x; i < TB_TP * ADALN_TB_ROWS; i += ADALN_TB_THREADS) {  // the padding zeroed
        const int t = i / ADALN_TB_ROWS, r = i % ADALN_TB_ROWS;
        g_tile[r][t] = t < ADALN_T && j0 + r < ADALN_TABLE_N ? d_table[t * ADALN_TABLE_N + j0 + r] : 0.0f;
    }
    __syncthreads();
    if (D_WEIGHT && d_bias != nullptr && blockIdx.x == 0) {
        for (int r = threadIdx.x; r < ADALN_TB_ROWS && j0 + r < ADALN_TABLE_N; r += ADALN_TB_THREADS) {
            double s = 0.0;
#pragma unroll
            for (int t = 0; t < ADALN_T; ++t) s += (double)g_tile[r][t];
            d_bias[j0 + r] = float_to_bf16((float)s);
        }
    }
    float act[D_WEIGHT ? ADALN_T : 1][TB_VEC], dact[DACT ? ADALN_T : 1][TB_VEC];
#pragma unroll
    for (int t = 0; t < ADALN_T; ++t)
#pragma unroll
        for (int e = 0; e < TB_VEC; ++e) {
            if constexpr (D_WEIGHT) act[t][e] = valid ? silu(temb[t * ADALN_D + kv * TB_VEC + e]) : 0.0f;
            if constexpr (DACT) dact[t][e] = 0.0f;
        }
    auto row = [&](int i, const tb_raw* loaded) {  // row j = j0 + r0 + i of the tile (its weight `loaded` early)
        const int j = j0 + r0 + i;
        float g[TB_TP];
#pragma unroll
        for (int q = 0; q < TB_TP / 4; ++q) {
            const float4 v = reinterpret_cast<const float4*>(g_tile[r0 + i])[q];
            g[4 * q] = v.x, g[4 * q + 1] = v.y, g[4 * q + 2] = v.z, g[4 * q + 3] = v.w;
        }
        if constexpr (DACT) {
            float w[TB_VEC];
            tb_unpack(loaded != nullptr ? *loaded : tb_load(weight + (size_t)j * ADALN_D + kv * TB_VEC), w);
#pragma unroll
            for (int e = 0; e < TB_VEC; ++e)
#pragma unroll
                for (int t = 0; t < ADALN_T; ++t) dact[t][e] = fmaf(g[t], w[e], dact[t][e]);
        }
        if constexpr (D_WEIGHT) {
            float dw[TB_VEC];
#pragma unroll
            for (int e = 0; e < TB_VEC; ++e) {
                float s = 0.0f;
#pragma unroll
                for (int t = 0; t < ADALN_T; ++t) s = fmaf(g[t], act[t][e], s);
                dw[e] = s;
            }
            tb_store(d_weight + (size_t)j * ADALN_D + kv * TB_VEC, dw);
        }
    };
    if (full) {
#pragma unroll
        for (int i = 0; i < TB_ROWS_PER_WARP; ++i) row(i, DACT && i < TB_EARLY ? &early[i] : nullptr);
    } else {
#pragma unroll 1
        for (int i = 0; i < nrows; ++i) row(i, nullptr);
    }
    if constexpr (DACT) {  // unrolled over t: a runtime t would put dact on the stack (local memory)
#pragma unroll
        for (int t = 0; t < ADALN_T; ++t) {
#pragma unroll
            for (int e = 0; e < TB_VEC; ++e) combine[warp][lane * TB_VEC + e] = dact[t][e];
            __syncthreads();
            for (int c = threadIdx.x; c < ADALN_TB_COLUMNS; c += ADALN_TB_THREADS) {
                float s = 0.0f;
#pragma unroll
                for (int ww = 0; ww < TB_WARPS; ++ww) s += combine[ww][c];
                if (k0 + c < ADALN_D) dact_partials[((size_t)blockIdx.y * ADALN_T + t) * ADALN_D + k0 + c] = s;
            }
            __syncthreads();
        }
    }
}

// One kernel or its two halves, as the plan launches them (plan.tb_split: ADALN_TB_SPLIT), so that the unit compiles
// only the one it runs (the fused kernel unrolled over a large T took most of the unit's compile time). From
// plan.tb_mma's T on (ADALN_TB_MMA) the halves are table_bwd_mma.cu's, on tensor cores.
#if !ADALN_TB_SPLIT
extern "C" __global__ void __launch_bounds__(ADALN_TB_THREADS, 2)
table_bwd_bf16(const float* __restrict__ d_table, const float* __restrict__ temb, const bf16_t* __restrict__ weight,
               bf16_t* __restrict__ d_weight, float* __restrict__ dact_partials, bf16_t* __restrict__ d_bias) {
    table_bwd_tile<true, true>(d_table, temb, weight, d_weight, dact_partials, d_bias);
}
#elif !ADALN_TB_MMA
extern "C" __global__ void __launch_bounds__(ADALN_TB_THREADS, 2)
table_bwd_d_weight_bf16(const float* __restrict__ d_table, const float* __restrict__ temb,
                        const bf16_t* __restrict__ weight, bf16_t* __restrict__ d_weight,
                        float* __restrict__ dact_partials, bf16_t* __restrict__ d_bias) {
    table_bwd_tile<true, false>(d_table, temb, weight, d_weight, dact_partials, d_bias);
}

extern "C" __global__ void __launch_bounds__(ADALN_TB_THREADS, 2)
table_bwd_dact_bf16(const float* __restrict__ d_table, const float* __restrict__ temb,
                    const bf16_t* __restrict__ weight, bf16_t* __restrict__ d_weight,
                    float* __restrict__ dact_partials, bf16_t* __restrict__ d_bias) {
    table_bwd_tile<false, true>(d_table, temb, weight, d_weight, dact_partials, d_bias);
}
#endif

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
