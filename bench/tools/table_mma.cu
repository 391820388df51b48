// table_mma.cu: a candidate table kernel on tensor cores (bench/tools/table_mma.py times and checks it; not shipped)
//
//   table[t, j] = bias[j] + sum_k act[t, k] * weight[j, k],  act = bf16(silu(temb)) (silu_bf16, once per call)
//
// Math and order: the S = ceil(D / 32) steps of 32 k split into KS = 8 chunks, chunk c the steps [c S / 8, (c + 1) S /
// 8) (integer division: fixed by D alone). A block of 8 warps owns 16 MT consecutive rows j and 8 NT consecutive
// timesteps t; warp c walks chunk c, two mma.sync.m16n8k16 (bf16 in, fp32 accumulate, from 0) per step and m-tile, in
// step order; warp 0 then adds the chunks in order, ((c0 + c1) + c2) + ... + c7, and the bias. Within a step, lane l (g
// = l / 4, q = l % 4) loads the 16 bytes at k + 8q of weight rows j0 + g and j0 + g + 8 and of act row t0 + g; the
// first mma takes elements 0-3 of each lane's 8, the second 4-7 (a fixed permutation of k inside the step, the same for
// weight and act). So every (t, j) sum has the same terms in the same instructions whatever T, N, the tile it lands in
// or the grid: the order depends on D alone (T-invariant rows, column-slice invariant columns), as long as the tensor
// core adds each output element the same way at every position of its tile (checked on the GPU: rows computed alone
// against rows computed in a batch of 1024).
// Rounding: fp32 accumulation inside the tensor core (its own order and alignment), bias added in fp32, table_f32
// the sum, table the sum rounded to bf16 once.
// Tails: k past D, rows past N and timesteps past T load zeros (adding exact zero products changes no sum) and store
// nothing. D divisible by 8.
// Grid: (ceil(T / 8 NT), ceil(N / 16 MT)): the t-blocks of one weight tile are neighbours, so a large T reads the
// weight from DRAM about once.

typedef unsigned short bf16_t;

__device__ __forceinline__ bf16_t to_bf16(float f) {  // round to nearest even; NaN stays NaN
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

extern "C" __global__ void silu_bf16(const float* __restrict__ temb, bf16_t* __restrict__ act, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const float v = temb[i];
        act[i] = to_bf16(v / (1.0f + expf(-v)));
    }
}

__device__ __forceinline__ void mma16816(float c[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                                         unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint4 load16(const bf16_t* p, bool ok) {
    return ok ? __ldg(reinterpret_cast<const uint4*>(p)) : make_uint4(0, 0, 0, 0);
}

#define KS 8  // chunks of k, one warp each

template <int MT, int NT, int P>
__device__ __forceinline__ void table_tile(const bf16_t* __restrict__ act, const bf16_t* __restrict__ weight,
                                           const bf16_t* __restrict__ bias, bf16_t* __restrict__ table,
                                           float* __restrict__ table_f32, int T, int N, int D) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
    const int t0 = blockIdx.x * 8 * NT;
    const int j0 = blockIdx.y * 16 * MT;
    const bf16_t* wrow[MT][2];
    bool wok[MT][2];
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int j = j0 + 16 * m + 8 * h + g;
            wok[m][h] = j < N;
            wrow[m][h] = weight + (size_t)(j < N ? j : 0) * D + 8 * q;
        }
    const bf16_t* arow[NT];
    bool aok[NT];
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        const int t = t0 + 8 * n + g;
        aok[n] = t < T;
        arow[n] = act + (size_t)(t < T ? t : 0) * D + 8 * q;
    }
    float acc[MT][NT][4];
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[m][n][e] = 0.0f;

    const int all_steps = (D + 31) / 32;
    const int first = warp * all_steps / KS, steps = (warp + 1) * all_steps / KS;  // this warp's chunk: [first, steps)
    uint4 wbuf[P][MT][2], abuf[P][NT];
    auto issue = [&](uint4 w[MT][2], uint4 a[NT], int s) {
        const int k = 32 * s;
        const bool kin = s < steps && k + 8 * q < D;
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int h = 0; h < 2; ++h) w[m][h] = load16(wrow[m][h] + k, kin && wok[m][h]);
#pragma unroll
        for (int n = 0; n < NT; ++n) a[n] = load16(arow[n] + k, kin && aok[n]);
    };
#pragma unroll
    for (int p = 0; p < P; ++p) issue(wbuf[p], abuf[p], first + p);
    for (int s0 = first; s0 < steps; s0 += P) {
#pragma unroll
        for (int p = 0; p < P; ++p) {
            if (s0 + p >= steps) break;
            uint4 w[MT][2], a[NT];
#pragma unroll
            for (int m = 0; m < MT; ++m) w[m][0] = wbuf[p][m][0], w[m][1] = wbuf[p][m][1];
#pragma unroll
            for (int n = 0; n < NT; ++n) a[n] = abuf[p][n];
            issue(wbuf[p], abuf[p], s0 + p + P);
#pragma unroll
            for (int m = 0; m < MT; ++m)
#pragma unroll
                for (int n = 0; n < NT; ++n) {
                    mma16816(acc[m][n], w[m][0].x, w[m][1].x, w[m][0].y, w[m][1].y, a[n].x, a[n].y);
                    mma16816(acc[m][n], w[m][0].z, w[m][1].z, w[m][0].w, w[m][1].w, a[n].z, a[n].w);
                }
        }
    }
    // the chunks in order: warps 1..7 leave theirs in shared memory, warp 0 adds them to its own
    __shared__ float parts[KS - 1][MT * NT * 4][32];
    if (warp > 0) {
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int n = 0; n < NT; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) parts[warp - 1][(m * NT + n) * 4 + e][lane] = acc[m][n][e];
    }
    __syncthreads();
    if (warp > 0) return;
#pragma unroll 1
    for (int w = 0; w < KS - 1; ++w)
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int n = 0; n < NT; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[m][n][e] += parts[w][(m * NT + n) * 4 + e][lane];
    // c0, c1: row j0 + 16m + g, timesteps t0 + 8n + 2q + {0, 1}; c2, c3: row + 8, the same timesteps
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int j = j0 + 16 * m + 8 * h + g;
            if (j >= N) continue;
            const float b = __uint_as_float(((unsigned)bias[j]) << 16);
#pragma unroll
            for (int n = 0; n < NT; ++n)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int t = t0 + 8 * n + 2 * q + e;
                    if (t >= T) continue;
                    const float sum = acc[m][n][2 * h + e] + b;
                    table_f32[(size_t)t * N + j] = sum;
                    table[(size_t)t * N + j] = to_bf16(sum);
                }
        }
}

template <int MT, int NT, int P>
__global__ void __launch_bounds__(32 * KS) table_mma(const bf16_t* __restrict__ act, const bf16_t* __restrict__ weight,
                                                        const bf16_t* __restrict__ bias, bf16_t* __restrict__ table,
                                                        float* __restrict__ table_f32, int T, int N, int D) {
    table_tile<MT, NT, P>(act, weight, bias, table, table_f32, T, N, D);
}
