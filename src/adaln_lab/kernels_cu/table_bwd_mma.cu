// table_bwd_mma.cu: table_bwd.cu's two halves on tensor cores, from plan.tb_mma's T on (ADALN_TB_MMA):
//
//   d_weight[j, k]         = bf16(sum_t d_table[t, j] * silu(temb[t, k]))                 table_bwd_mma_d_weight
//   dact_partials[b, t, k] = sum over the rows j of row block b of d_table[t, j] * weight[j, k]   table_bwd_mma_dact
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
// The terms are split once, by table_bwd_mma_terms, into the workspace after dact_partials (plan.tb_bytes), as bf16,
// TP = T rounded up to 16 (timesteps past T are zeros), S = TP / 16 steps:
//   wa[p][s][j][i] = term p of d_table[16 s + i, j]       d_weight's A (rows j, k = t): one step of a row, 32 bytes
//   da[p][t][j]    = term p of d_table[t, j]              dact's A (rows t, k = j)
//   wb[p][s][k][i] = term p of silu(temb[16 s + i, k])    d_weight's B (columns k, k = t)
// With d_bias (the blocks' table) it also stores d_bias[j] = bf16(sum_t d_table[t, j]), in double, t in order
// (table_bwd.cu's sum). Block TBM_THREADS, grid plan.tbm_grids[0] = (ceil((N + D) / TBM_THREADS), S): step
// blockIdx.y, thread i < N the row j = i, the others the column k = i - N.
// table_bwd_mma_d_weight: block TBM_THREADS (4 warps, 2 x 2), grid plan.tbm_grids[1] = (ceil(D / 128), ceil(N /
// 64)): warp w the 32 rows jb + 32 (w / 2) .. (2 m-tiles) and the 64 columns kb + 64 (w % 2) .. (8 n-tiles). A k
// step's terms (64 rows of wa, 128 columns of wb: 18 KiB) are copied to shared memory (cp.async, the next step's in
// flight); the fragments are 8-byte loads from there. The tile leaves through shared memory as whole rows.
// table_bwd_mma_dact: block TBM_THREADS, grid plan.tbm_grids[2] = (ceil(D / 64), blocks_j = ceil(N / ADALN_TB_ROWS)):
// warp w the 16 columns k0 + 16 w .. (2 n-tiles), the timesteps in passes of TBM_MT m-tiles of 16; K = the block's
// rows j in steps of 16 (N and ADALN_TB_ROWS are multiples of 16), the weight's 16 x 64 tile of a step staged in shared
// memory (one 16-byte load a thread, the next one in flight), d_table's terms read from global memory, the next
// step's in flight.
// Run: adaln_lab.core.launchers.launch_table_bwd.

#if ADALN_TB_MMA
#define TBM_THREADS 128
#define TBM_TP ((ADALN_T + 15) / 16 * 16)  // timesteps rounded up to a step of 16
#define TBM_S (TBM_TP / 16)
#define TBM_MT (TBM_S < 2 ? TBM_S : 2)  // dact: m-tiles of 16 timesteps a pass (<= 2: A's two steps in registers)
static_assert(ADALN_TABLE_N % 16 == 0 && ADALN_TB_ROWS % 16 == 0, "dact's k steps of 16 rows (plan.tb_mma)");
static_assert(ADALN_D % 8 == 0, "whole n-tiles of 8 columns");

// v = v0 + v1 + v2, each bf16 (module comment)
__device__ __forceinline__ void split3(float v, bf16_t p[3]) {
    p[0] = float_to_bf16(v);
    const float r = v - bf16_to_float(p[0]);
    p[1] = float_to_bf16(r);
    p[2] = float_to_bf16(r - bf16_to_float(p[1]));
}

// the terms' three arrays (module comment), from the workspace's base
struct TbmTerms {
    bf16_t* wa;
    bf16_t* da;
    bf16_t* wb;
    __device__ explicit TbmTerms(bf16_t* base)
        : wa(base), da(base + (size_t)3 * TBM_TP * ADALN_TABLE_N), wb(base + (size_t)6 * TBM_TP * ADALN_TABLE_N) {}
};

// one thread's 16 values of a step (zeros past T), split, to its row of wa or wb; d_table's also to da
__device__ __forceinline__ void store_step(const float v[16], bf16_t* w, size_t stride, bf16_t* da, int s, int j) {
    bf16_t t[3][16];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        bf16_t p[3];
        split3(v[i], p);
        t[0][i] = p[0], t[1][i] = p[1], t[2][i] = p[2];
    }
#pragma unroll
    for (int p = 0; p < 3; ++p) {
        uint4* out = reinterpret_cast<uint4*>(w + (size_t)p * stride + (size_t)s * 16 * (stride / TBM_TP));
        const unsigned* u = reinterpret_cast<const unsigned*>(t[p]);
        out[0] = make_uint4(u[0], u[1], u[2], u[3]);
        out[1] = make_uint4(u[4], u[5], u[6], u[7]);
        if (da != nullptr)
#pragma unroll
            for (int i = 0; i < 16; ++i) da[((size_t)p * TBM_TP + 16 * s + i) * ADALN_TABLE_N + j] = t[p][i];
    }
}

extern "C" __global__ void __launch_bounds__(TBM_THREADS)
table_bwd_mma_terms(const float* __restrict__ d_table, const float* __restrict__ temb, bf16_t* __restrict__ terms,
                bf16_t* __restrict__ d_bias) {
    const TbmTerms tm(terms);
    const int i = blockIdx.x * TBM_THREADS + threadIdx.x, st = blockIdx.y;
    float v[16];
    if (i < ADALN_TABLE_N) {
        const int j = i;
#pragma unroll
        for (int u = 0; u < 16; ++u) {
            const int t = 16 * st + u;
            v[u] = t < ADALN_T ? d_table[(size_t)t * ADALN_TABLE_N + j] : 0.0f;
        }
        store_step(v, tm.wa + (size_t)j * 16, (size_t)TBM_TP * ADALN_TABLE_N, tm.da, st, j);
        if (d_bias != nullptr && st == 0) {
            double s = 0.0;
            for (int t = 0; t < ADALN_T; ++t) s += (double)d_table[(size_t)t * ADALN_TABLE_N + j];
            d_bias[j] = float_to_bf16((float)s);
        }
    } else if (i < ADALN_TABLE_N + ADALN_D) {
        const int k = i - ADALN_TABLE_N;
#pragma unroll
        for (int u = 0; u < 16; ++u) {
            const int t = 16 * st + u;
            v[u] = t < ADALN_T ? silu(temb[(size_t)t * ADALN_D + k]) : 0.0f;
        }
        store_step(v, tm.wb + (size_t)k * 16, (size_t)TBM_TP * ADALN_D, nullptr, st, k);
    }
}

__device__ __forceinline__ void mma_terms(float c[4], const unsigned a[4], unsigned b0, unsigned b1) {
    mma_bf16_16816(c, a[0], a[1], a[2], a[3], b0, b1);
}

// d_weight's block: the k step's A (64 rows) and B (128 columns) terms, staged in shared memory (two stages)
#define TBM_ROWS (64 + 128)
__device__ __forceinline__ void stage_d_weight(const TbmTerms& tm, bf16_t (*buf)[TBM_ROWS][16], int s, int jb, int kb) {
    for (int i = threadIdx.x; i < 3 * TBM_ROWS * 2; i += TBM_THREADS) {  // 16-byte chunks (term, row, half)
        const int p = i / (2 * TBM_ROWS), r = (i >> 1) % TBM_ROWS, h = i & 1;
        const bool a = r < 64, ok = a ? jb + r < ADALN_TABLE_N : kb + r - 64 < ADALN_D;
        const bf16_t* src = a ? tm.wa + (((size_t)p * TBM_S + s) * ADALN_TABLE_N + jb + r) * 16
                              : tm.wb + (((size_t)p * TBM_S + s) * ADALN_D + kb + r - 64) * 16;
        if (ok)
            copy_async16(&buf[p][r][8 * h], src + 8 * h);
        else
            *reinterpret_cast<uint4*>(&buf[p][r][8 * h]) = make_uint4(0, 0, 0, 0);  // rows past N, columns past D
    }
    copy_async_commit();
}

extern "C" __global__ void __launch_bounds__(TBM_THREADS, 4)
table_bwd_mma_d_weight(const bf16_t* __restrict__ terms, bf16_t* __restrict__ d_weight) {
    __shared__ __align__(16) bf16_t st[2][3][TBM_ROWS][16];  // 36 KiB: two k steps' terms
    const TbmTerms tm(const_cast<bf16_t*>(terms));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
    const int jb = blockIdx.y * 64, kb = blockIdx.x * 128, wj = 32 * (warp >> 1), wk = 64 * (warp & 1);
    float acc[2][8][4] = {};
    stage_d_weight(tm, st[0], 0, jb, kb);
    for (int s = 0; s < TBM_S; ++s) {
        if (s + 1 < TBM_S) {
            stage_d_weight(tm, st[(s + 1) & 1], s + 1, jb, kb);
            copy_async_wait<1>();
        } else {
            copy_async_wait<0>();
        }
        __syncthreads();
        bf16_t (*t)[TBM_ROWS][16] = st[s & 1];
        unsigned a[2][3][4];
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
            for (int p = 0; p < 3; ++p) {
                const uint2 lo = *reinterpret_cast<const uint2*>(&t[p][wj + 16 * m + g][4 * q]);
                const uint2 hi = *reinterpret_cast<const uint2*>(&t[p][wj + 16 * m + g + 8][4 * q]);
                a[m][p][0] = lo.x, a[m][p][1] = hi.x, a[m][p][2] = lo.y, a[m][p][3] = hi.y;
            }
#pragma unroll
        for (int n = 0; n < 8; ++n) {
            if (kb + wk + 8 * n >= ADALN_D) continue;  // the same for the whole warp (D % 8 == 0)
            unsigned b[3][2];
#pragma unroll
            for (int p = 0; p < 3; ++p) {
                const uint2 v = *reinterpret_cast<const uint2*>(&t[p][64 + wk + 8 * n + g][4 * q]);
                b[p][0] = v.x, b[p][1] = v.y;
            }
#pragma unroll
            for (int m = 0; m < 2; ++m) {
                mma_terms(acc[m][n], a[m][2], b[0][0], b[0][1]);
                mma_terms(acc[m][n], a[m][0], b[2][0], b[2][1]);
                mma_terms(acc[m][n], a[m][1], b[1][0], b[1][1]);
                mma_terms(acc[m][n], a[m][1], b[0][0], b[0][1]);
                mma_terms(acc[m][n], a[m][0], b[1][0], b[1][1]);
                mma_terms(acc[m][n], a[m][0], b[0][0], b[0][1]);
            }
        }
        __syncthreads();  // this stage read before the next step's copies overwrite it
    }
    // the block's 64 x 128 tile as bf16 through shared memory (rows padded: conflict-free), then whole rows out
    bf16_t (*c)[136] = reinterpret_cast<bf16_t (*)[136]>(&st[0][0][0][0]);
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int n = 0; n < 8; ++n) {
            const int r = wj + 16 * m + g, k = wk + 8 * n + 2 * q;
            *reinterpret_cast<unsigned*>(&c[r][k]) = float2_to_bf16x2(acc[m][n][0], acc[m][n][1]);
            *reinterpret_cast<unsigned*>(&c[r + 8][k]) = float2_to_bf16x2(acc[m][n][2], acc[m][n][3]);
        }
    __syncthreads();
    const bool wide = (reinterpret_cast<size_t>(d_weight) & 15) == 0;  // else bf16 stores (any bf16 alignment)
    for (int i = threadIdx.x; i < 64 * 16; i += TBM_THREADS) {
        const int r = i >> 4, k = 8 * (i & 15);
        if (jb + r >= ADALN_TABLE_N || kb + k >= ADALN_D) continue;
        const uint4 v = *reinterpret_cast<const uint4*>(&c[r][k]);
        bf16_t* out = d_weight + (size_t)(jb + r) * ADALN_D + kb + k;
        if (wide) {
            *reinterpret_cast<uint4*>(out) = v;
        } else {
            const bf16_t* e = reinterpret_cast<const bf16_t*>(&v);
#pragma unroll
            for (int u = 0; u < 8; ++u) out[u] = e[u];
        }
    }
}

// dact's A fragments of one k step (rows j .. j + 15) for the pass's m-tiles, from the terms
__device__ __forceinline__ void dact_a(const TbmTerms& tm, int m0, int j, int g, int q, unsigned a[][3][4]) {
#pragma unroll
    for (int mt = 0; mt < TBM_MT; ++mt) {
        if (m0 + 16 * mt >= ADALN_T) continue;  // the same for the whole warp
        const int t = m0 + 16 * mt + g;          // rows t < TP: zeros past T
#pragma unroll
        for (int p = 0; p < 3; ++p) {
            const bf16_t* d = tm.da + ((size_t)p * TBM_TP + t) * ADALN_TABLE_N + j + 4 * q;
            const uint2 lo = __ldg(reinterpret_cast<const uint2*>(d));
            const uint2 hi = __ldg(reinterpret_cast<const uint2*>(d + 8 * ADALN_TABLE_N));
            a[mt][p][0] = lo.x, a[mt][p][1] = hi.x, a[mt][p][2] = lo.y, a[mt][p][3] = hi.y;
        }
    }
}

extern "C" __global__ void __launch_bounds__(TBM_THREADS, 4)
table_bwd_mma_dact(const bf16_t* __restrict__ terms, const bf16_t* __restrict__ weight,
                   float* __restrict__ dact_partials) {
    const TbmTerms tm(const_cast<bf16_t*>(terms));
    __shared__ __align__(16) bf16_t w_s[16][72];  // weight[j + r, k0 + c] of a step at [r][c] (rows padded)
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
    const int k0 = blockIdx.x * 64, jb = blockIdx.y * ADALN_TB_ROWS;
    const int jend = min(jb + ADALN_TB_ROWS, ADALN_TABLE_N);
    const int lr = threadIdx.x >> 3, lc = (threadIdx.x & 7) * 8;  // this thread's 16 bytes of a step's tile
    const bool lok = k0 + lc < ADALN_D;                            // D divisible by 8: all 8 columns or none
    for (int m0 = 0; m0 < ADALN_T; m0 += 16 * TBM_MT) {
        float acc[TBM_MT][2][4] = {};
        uint4 next = lok ? __ldg(reinterpret_cast<const uint4*>(weight + (size_t)(jb + lr) * ADALN_D + k0 + lc))
                         : make_uint4(0, 0, 0, 0);
        unsigned a[TBM_MT][3][4], an[TBM_MT][3][4] = {};  // this step's A fragments, the next step's in flight
        dact_a(tm, m0, jb, g, q, a);
        for (int j = jb; j < jend; j += 16) {
            __syncthreads();  // the previous step's tile has been read
            *reinterpret_cast<uint4*>(&w_s[lr][lc]) = next;
            __syncthreads();
            if (j + 16 < jend) {
                if (lok)
                    next = __ldg(reinterpret_cast<const uint4*>(weight + (size_t)(j + 16 + lr) * ADALN_D + k0 + lc));
                dact_a(tm, m0, j + 16, g, q, an);
            }
            unsigned b[2][2];
#pragma unroll
            for (int n = 0; n < 2; ++n) {
                const int c = 16 * warp + 8 * n + g;
                b[n][0] = (unsigned)w_s[4 * q][c] | ((unsigned)w_s[4 * q + 1][c] << 16);
                b[n][1] = (unsigned)w_s[4 * q + 2][c] | ((unsigned)w_s[4 * q + 3][c] << 16);
            }
#pragma unroll
            for (int mt = 0; mt < TBM_MT; ++mt) {
                if (m0 + 16 * mt >= ADALN_T) continue;  // the same for the whole warp
#pragma unroll
                for (int n = 0; n < 2; ++n) {
                    mma_terms(acc[mt][n], a[mt][2], b[n][0], b[n][1]);
                    mma_terms(acc[mt][n], a[mt][1], b[n][0], b[n][1]);
                    mma_terms(acc[mt][n], a[mt][0], b[n][0], b[n][1]);
                }
            }
#pragma unroll
            for (int mt = 0; mt < TBM_MT; ++mt)
#pragma unroll
                for (int p = 0; p < 3; ++p)
#pragma unroll
                    for (int r = 0; r < 4; ++r) a[mt][p][r] = an[mt][p][r];
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
