// table_bwd_mma.cu: table_bwd.cu's two halves on tensor cores, from plan.tb_mma's T on (ADALN_TB_MMA):
//
//   d_weight[j, k]         = bf16(sum_t d_table[t, j] * silu(temb[t, k]))                 table_bwd_d_weight_bf16
//   dact_partials[b, t, k] = sum over the rows j of row block b of d_table[t, j] * weight[j, k]   table_bwd_dact_bf16
// (then table_bwd_reduce, table_bwd.cu: the row blocks added in double, times silu'). The activation is unrounded, as
// in table_bwd.cu.
//
// Products on tensor cores (mma.sync m16n8k16: bf16 in, fp32 sums): an fp32 operand v is split into three bf16
// terms, v = v0 + v1 + v2 exactly (v0 = bf16(v), v1 = bf16(v - v0), v2 = bf16(v - v0 - v1): 24 bits, for |v| >=
// 2^-110 and below bf16's largest finite value rounded up, 3.39e38, where v0 is inf and the sums NaN); the weight is
// bf16. d_weight takes the six products of terms i + j <= 2 (the three left out are below 2^-24 of the product),
// dact the three of d_table's terms with the weight. Every mma adds into the sums in one fixed order: the k steps in
// order, inside a step d_weight's (2, 0), (0, 2), (1, 1), (1, 0), (0, 1), (0, 0) and dact's 2, 1, 0. So a sum has
// the same instructions whatever the grid: the bits depend on the shapes alone, and a timestep's dact row on its own
// d_table row alone (rows T-invariant among the T this path takes).
// The k order inside a step of 16: lane l (g = l / 4, q = l % 4) holds k values 4q .. 4q + 3 of its rows (A registers
// 0 and 2 take 4q, 4q + 1 and 4q + 2, 4q + 3; B registers 0 and 1 the same): one fixed permutation of the 16, the
// same for both operands.
//
// table_bwd_d_weight_bf16: block TBM_THREADS (4 warps), grid plan.tbm_grids[0] = (ceil(D / 64), ceil(N / 64)): warp w
// the 16 rows j0 + 16 w .., all 64 columns (8 n-tiles of 8); K = t in steps of 16 (timesteps past T are zeros), each
// staged in shared memory transposed (a row's 16 values side by side), the SiLU taken there. With d_bias (the blocks'
// table) the blocks of the first column tile also store d_bias[j] = bf16(sum_t d_table[t, j]), in double, t in order
// (table_bwd.cu's sum).
// table_bwd_dact_bf16: block TBM_THREADS, grid plan.tbm_grids[1] = (ceil(D / 64), blocks_j = ceil(N / ADALN_TB_ROWS)):
// warp w the 16 columns k0 + 16 w .. (2 n-tiles), the timesteps in passes of TBM_MT m-tiles of 16; K = the block's
// rows j in steps of 16 (N and ADALN_TB_ROWS are multiples of 16), the weight's 16 x 64 tile of a step staged in shared
// memory (one 16-byte load a thread, the next one in flight), d_table read from global memory 4 values at a time.
// Run: adaln_lab.core.launchers.launch_table_bwd.

#if ADALN_TB_MMA
#define TBM_THREADS 128
#define TBM_TILE 64  // rows j (d_weight) or columns k (both) of one block
#define TBM_MT ((ADALN_T + 15) / 16 < 4 ? (ADALN_T + 15) / 16 : 4)  // dact: m-tiles of 16 timesteps a pass (<= 4)
static_assert(ADALN_TABLE_N % 16 == 0 && ADALN_TB_ROWS % 16 == 0, "dact's k steps of 16 rows (plan.tb_mma)");

// v = v0 + v1 + v2, each bf16 (module comment)
__device__ __forceinline__ void split3(float v, float p[3]) {
    p[0] = round_bf16(v);
    const float r = v - p[0];
    p[1] = round_bf16(r);
    p[2] = round_bf16(r - p[1]);
}

// A fragment terms of a 16 x 16 tile from row g's 4 values (lo) and row g + 8's (hi) at k 4q .. 4q + 3
__device__ __forceinline__ void a_terms(float4 lo, float4 hi, unsigned a[3][4]) {
    float l[4][3], h[4][3];
    split3(lo.x, l[0]), split3(lo.y, l[1]), split3(lo.z, l[2]), split3(lo.w, l[3]);
    split3(hi.x, h[0]), split3(hi.y, h[1]), split3(hi.z, h[2]), split3(hi.w, h[3]);
#pragma unroll
    for (int p = 0; p < 3; ++p) {
        a[p][0] = float2_to_bf16x2(l[0][p], l[1][p]);
        a[p][1] = float2_to_bf16x2(h[0][p], h[1][p]);
        a[p][2] = float2_to_bf16x2(l[2][p], l[3][p]);
        a[p][3] = float2_to_bf16x2(h[2][p], h[3][p]);
    }
}

__device__ __forceinline__ void mma_terms(float c[4], const unsigned a[4], unsigned b0, unsigned b1) {
    mma_bf16_16816(c, a[0], a[1], a[2], a[3], b0, b1);
}

extern "C" __global__ void __launch_bounds__(TBM_THREADS, 4)
table_bwd_d_weight_bf16(const float* __restrict__ d_table, const float* __restrict__ temb,
                        const bf16_t* __restrict__ weight, bf16_t* __restrict__ d_weight,
                        float* __restrict__ dact_partials, bf16_t* __restrict__ d_bias) {
    __shared__ __align__(16) float g_s[TBM_TILE][20];  // d_table[t0 + i, j0 + r] at [r][i] (rows padded: 4-way banks)
    __shared__ __align__(16) float a_s[TBM_TILE][20];  // silu(temb[t0 + i, k0 + c]) at [c][i]
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
    const int k0 = blockIdx.x * TBM_TILE, j0 = blockIdx.y * TBM_TILE;
    if (d_bias != nullptr && blockIdx.x == 0 && threadIdx.x < TBM_TILE && j0 + threadIdx.x < ADALN_TABLE_N) {
        double s = 0.0;
        for (int t = 0; t < ADALN_T; ++t) s += (double)d_table[(size_t)t * ADALN_TABLE_N + j0 + threadIdx.x];
        d_bias[j0 + threadIdx.x] = float_to_bf16((float)s);
    }
    float acc[8][4] = {};
    for (int t0 = 0; t0 < ADALN_T; t0 += 16) {
        for (int i = threadIdx.x; i < 16 * TBM_TILE; i += TBM_THREADS) {
            const int s = i / TBM_TILE, c = i % TBM_TILE, t = t0 + s;
            g_s[c][s] = t < ADALN_T && j0 + c < ADALN_TABLE_N ? d_table[(size_t)t * ADALN_TABLE_N + j0 + c] : 0.0f;
            a_s[c][s] = t < ADALN_T && k0 + c < ADALN_D ? silu(temb[(size_t)t * ADALN_D + k0 + c]) : 0.0f;
        }
        __syncthreads();
        unsigned a[3][4];
        a_terms(reinterpret_cast<const float4*>(g_s[16 * warp + g])[q],
                reinterpret_cast<const float4*>(g_s[16 * warp + g + 8])[q], a);
#pragma unroll
        for (int n = 0; n < 8; ++n) {
            const float4 v = reinterpret_cast<const float4*>(a_s[8 * n + g])[q];
            float x[4][3];
            split3(v.x, x[0]), split3(v.y, x[1]), split3(v.z, x[2]), split3(v.w, x[3]);
            unsigned b[3][2];
#pragma unroll
            for (int p = 0; p < 3; ++p)
                b[p][0] = float2_to_bf16x2(x[0][p], x[1][p]), b[p][1] = float2_to_bf16x2(x[2][p], x[3][p]);
            mma_terms(acc[n], a[2], b[0][0], b[0][1]);
            mma_terms(acc[n], a[0], b[2][0], b[2][1]);
            mma_terms(acc[n], a[1], b[1][0], b[1][1]);
            mma_terms(acc[n], a[1], b[0][0], b[0][1]);
            mma_terms(acc[n], a[0], b[1][0], b[1][1]);
            mma_terms(acc[n], a[0], b[0][0], b[0][1]);
        }
        __syncthreads();
    }
    const int r = j0 + 16 * warp + g;
#pragma unroll
    for (int n = 0; n < 8; ++n) {
        const int k = k0 + 8 * n + 2 * q;  // D is even: k < D holds for k + 1 too
        if (k >= ADALN_D) continue;
        if (r < ADALN_TABLE_N)
            *reinterpret_cast<unsigned*>(d_weight + (size_t)r * ADALN_D + k) = float2_to_bf16x2(acc[n][0], acc[n][1]);
        if (r + 8 < ADALN_TABLE_N)
            *reinterpret_cast<unsigned*>(d_weight + (size_t)(r + 8) * ADALN_D + k) =
                float2_to_bf16x2(acc[n][2], acc[n][3]);
    }
}

extern "C" __global__ void __launch_bounds__(TBM_THREADS, 4)
table_bwd_dact_bf16(const float* __restrict__ d_table, const float* __restrict__ temb,
                    const bf16_t* __restrict__ weight, bf16_t* __restrict__ d_weight,
                    float* __restrict__ dact_partials, bf16_t* __restrict__ d_bias) {
    __shared__ __align__(16) bf16_t w_s[16][72];  // weight[j + r, k0 + c] of a step at [r][c] (rows padded)
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
    const int k0 = blockIdx.x * TBM_TILE, jb = blockIdx.y * ADALN_TB_ROWS;
    const int jend = min(jb + ADALN_TB_ROWS, ADALN_TABLE_N);
    const int lr = threadIdx.x >> 3, lc = (threadIdx.x & 7) * 8;  // this thread's 16 bytes of a step's tile
    const bool lok = k0 + lc < ADALN_D;                            // D divisible by 8: all 8 columns or none
    for (int m0 = 0; m0 < ADALN_T; m0 += 16 * TBM_MT) {
        float acc[TBM_MT][2][4] = {};
        uint4 next = lok ? __ldg(reinterpret_cast<const uint4*>(weight + (size_t)(jb + lr) * ADALN_D + k0 + lc))
                         : make_uint4(0, 0, 0, 0);
        for (int j = jb; j < jend; j += 16) {
            __syncthreads();  // the previous step's tile has been read
            *reinterpret_cast<uint4*>(&w_s[lr][lc]) = next;
            __syncthreads();
            if (j + 16 < jend && lok)
                next = __ldg(reinterpret_cast<const uint4*>(weight + (size_t)(j + 16 + lr) * ADALN_D + k0 + lc));
            unsigned b[2][2];
#pragma unroll
            for (int n = 0; n < 2; ++n) {
                const int c = 16 * warp + 8 * n + g;
                b[n][0] = (unsigned)w_s[4 * q][c] | ((unsigned)w_s[4 * q + 1][c] << 16);
                b[n][1] = (unsigned)w_s[4 * q + 2][c] | ((unsigned)w_s[4 * q + 3][c] << 16);
            }
#pragma unroll
            for (int mt = 0; mt < TBM_MT; ++mt) {
                const int t = m0 + 16 * mt + g;
                if (m0 + 16 * mt >= ADALN_T) continue;  // the same for the whole warp
                float4 lo = make_float4(0.0f, 0.0f, 0.0f, 0.0f), hi = lo;  // timesteps past T: zeros
                if (t < ADALN_T)
                    lo = __ldg(reinterpret_cast<const float4*>(d_table + (size_t)t * ADALN_TABLE_N + j + 4 * q));
                if (t + 8 < ADALN_T)
                    hi = __ldg(reinterpret_cast<const float4*>(d_table + (size_t)(t + 8) * ADALN_TABLE_N + j + 4 * q));
                unsigned a[3][4];
                a_terms(lo, hi, a);
#pragma unroll
                for (int n = 0; n < 2; ++n) {
                    mma_terms(acc[mt][n], a[2], b[n][0], b[n][1]);
                    mma_terms(acc[mt][n], a[1], b[n][0], b[n][1]);
                    mma_terms(acc[mt][n], a[0], b[n][0], b[n][1]);
                }
            }
        }
#pragma unroll
        for (int mt = 0; mt < TBM_MT; ++mt)
#pragma unroll
            for (int n = 0; n < 2; ++n) {
                const int t = m0 + 16 * mt + g, k = k0 + 16 * warp + 8 * n + 2 * q;
                if (k >= ADALN_D) continue;
                float* out = dact_partials + ((size_t)blockIdx.y * ADALN_T + t) * ADALN_D + k;
                if (t < ADALN_T) *reinterpret_cast<float2*>(out) = make_float2(acc[mt][n][0], acc[mt][n][1]);
                if (t + 8 < ADALN_T)
                    *reinterpret_cast<float2*>(out + 8 * ADALN_D) = make_float2(acc[mt][n][2], acc[mt][n][3]);
            }
    }
}
#endif
