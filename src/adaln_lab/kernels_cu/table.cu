// table.cu: the modulation table  table[t, j] = bias[j] + sum_k bf16(silu(temb[t, k])) * weight[j, k], on tensor cores
//
// Two kernels: table_act writes act = bf16(silu(temb)) (T, D) once (the activations every block of table_bf16 reads:
// 2 bytes an element instead of 4 and no SiLU per block), then table_bf16, launched right after it with programmatic
// dependent launch (its first weight loads are issued before it waits for act).
//
// Computes, for all T timesteps at once, table (T, N) bf16 (diffusers' rounding: the SiLU output is rounded to bf16
// once, the fp32 dot product plus bias is rounded to bf16 once) and table_f32 (T, N) fp32: the same sums unrounded
// (final_adaln_out's backward uses them), or, with ADALN_TABLE_F32_ROUNDED, the bf16 values in fp32 (the blocks'
// modulation table, adaln_lab/ops/modulation_table/launch.py). N = ADALN_TABLE_N columns: 2H for norm_out
// (shift | scale), 18H for an H3 block's adaln_proj. With ADALN_TABLE_ROW_TABLES (a block's table) the bf16 output is
// instead the two (3T, 2H) row tables the block's norms read, one after the other: column c * H + h of modality m,
// c in 0..5 = shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp, goes to row 3t + m, column
// (c % 3) * H + h of table c / 3; the gates are not stored in bf16.
//
// Order of one sum (t, j), fixed by D alone (bench/NOTES.md v26):
// - k runs in S = ceil(D / 32) steps of 32, split into ADALN_TABLE_CHUNKS chunks: chunk c is the steps
//   [c S / CHUNKS, (c + 1) S / CHUNKS) (integer division).
// - A chunk is a chain of mma.sync.m16n8k16 (bf16 products, fp32 accumulation inside the tensor core, from 0), two per
//   step: in a step, lane l (g = l / 4, q = l % 4) holds the 8 k values 32 s + 8 q .. + 7 of its weight rows and
//   timesteps; the first mma takes values 0-3 of each lane's 8, the second values 4-7 (one permutation of k inside a
//   step, the same for weight and activations).
// - The chunks are added in order in fp32, ((c0 + c1) + c2) + ..., then the bias.
// So a (t, j) sum has the same terms in the same instructions whatever T, N, the tile it lands in, the tile shape
// (ADALN_TABLE_MT, _NT, _AHEAD: speed only) or the grid: rows are T-invariant and a slice of columns computed alone
// gives those columns' bits, as long as the tensor core adds an output element the same way at every position of its
// tile (tests/core/test_tensors.py checks rows alone against rows in a batch and every tile shape against the others).
//
// Work: a block of ADALN_TABLE_CHUNKS warps owns 16 MT consecutive rows j and 8 NT consecutive timesteps t; warp c
// computes chunk c of every sum of the tile, loading its weight rows straight into registers (ADALN_TABLE_AHEAD steps
// in flight, and as many of its act values); warps 1.. leave their chunk sums in shared memory and
// warp 0 adds them. Grid (ceil(T / 8 NT), ceil(N / 16 MT)): the t-blocks of one weight tile are neighbours. Rows past
// N and timesteps past T load zeros (exact zero products change no sum) and store nothing. D divisible by 8.
// table_act: plan.table_act_grid blocks of 256 threads, 8 elements a thread.
// Run: adaln_lab.core.tensors.table(temb, weight, bias) on CUDA tensors.

#define TABLE_MT ADALN_TABLE_MT
#define TABLE_NT ADALN_TABLE_NT
#define TABLE_P ADALN_TABLE_AHEAD
#define TABLE_CHUNKS ADALN_TABLE_CHUNKS

__device__ __forceinline__ void mma_bf16_16816(float c[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                               unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

extern "C" __global__ void __launch_bounds__(256)
table_act(const float* __restrict__ temb, bf16_t* __restrict__ act) {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;");  // table_bf16, launched after it with PDL, may start
#endif
    const int i = blockIdx.x * 256 + threadIdx.x;  // 8 elements each: T * D / 8 of them (D divisible by 8)
    if (i >= ADALN_T * ADALN_D / 8) return;
    const float4 lo = reinterpret_cast<const float4*>(temb)[2 * i];
    const float4 hi = reinterpret_cast<const float4*>(temb)[2 * i + 1];
    reinterpret_cast<uint4*>(act)[i] =
        make_uint4(float2_to_bf16x2(silu(lo.x), silu(lo.y)), float2_to_bf16x2(silu(lo.z), silu(lo.w)),
                   float2_to_bf16x2(silu(hi.x), silu(hi.y)), float2_to_bf16x2(silu(hi.z), silu(hi.w)));
}

__device__ __forceinline__ uint4 load16(const bf16_t* p, bool ok) {
    return ok ? __ldg(reinterpret_cast<const uint4*>(p)) : make_uint4(0, 0, 0, 0);
}

// the epilogue of one (t, j): bias added, both outputs stored
__device__ __forceinline__ void store_sum(float sum, int t, int j, bf16_t* __restrict__ table,
                                          float* __restrict__ table_f32) {
    table_f32[(size_t)t * ADALN_TABLE_N + j] = ADALN_TABLE_F32_ROUNDED ? round_bf16(sum) : sum;
#if ADALN_TABLE_ROW_TABLES
    constexpr int H = ADALN_TABLE_N / 18;
    const int m = j / (6 * H), c = (j % (6 * H)) / H, h = j % H;
    if (c != 2 && c != 5)
        table[((size_t)(c / 3) * 3 * ADALN_T + 3 * t + m) * 2 * H + (c % 3) * H + h] = float_to_bf16(sum);
#else
    table[(size_t)t * ADALN_TABLE_N + j] = float_to_bf16(sum);
#endif
}

extern "C" __global__ void __launch_bounds__(32 * TABLE_CHUNKS)
table_bf16(const bf16_t* __restrict__ act, const bf16_t* __restrict__ weight, const bf16_t* __restrict__ bias,
           bf16_t* __restrict__ table, float* __restrict__ table_f32) {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;");  // a kernel launched after it with PDL may start
#endif
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
    const int t0 = blockIdx.x * 8 * TABLE_NT, j0 = blockIdx.y * 16 * TABLE_MT;
    const bf16_t* wrow[TABLE_MT][2];
    bool wok[TABLE_MT][2];
#pragma unroll
    for (int m = 0; m < TABLE_MT; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int j = j0 + 16 * m + 8 * h + g;
            wok[m][h] = j < ADALN_TABLE_N;
            wrow[m][h] = weight + (size_t)(j < ADALN_TABLE_N ? j : 0) * ADALN_D + 8 * q;
        }
    const bf16_t* arow[TABLE_NT];
    bool aok[TABLE_NT];
#pragma unroll
    for (int n = 0; n < TABLE_NT; ++n) {
        const int t = t0 + 8 * n + g;
        aok[n] = t < ADALN_T;
        arow[n] = act + (size_t)(t < ADALN_T ? t : 0) * ADALN_D + 8 * q;
    }
    constexpr int STEPS = (ADALN_D + 31) / 32;
    const int first = warp * STEPS / TABLE_CHUNKS, end = (warp + 1) * STEPS / TABLE_CHUNKS;  // this warp's chunk
    auto in_d = [&](int s) { return s < end && 32 * s + 8 * q < ADALN_D; };

    float acc[TABLE_MT][TABLE_NT][4];
#pragma unroll
    for (int m = 0; m < TABLE_MT; ++m)
#pragma unroll
        for (int n = 0; n < TABLE_NT; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[m][n][e] = 0.0f;
    uint4 wbuf[TABLE_P][TABLE_MT][2], abuf[TABLE_P][TABLE_NT];  // steps s .. s + P - 1, in use order
#pragma unroll
    for (int p = 0; p < TABLE_P; ++p)  // the weight first: it does not wait for table_act
#pragma unroll
        for (int m = 0; m < TABLE_MT; ++m)
#pragma unroll
            for (int h = 0; h < 2; ++h)
                wbuf[p][m][h] = load16(wrow[m][h] + 32 * (first + p), in_d(first + p) && wok[m][h]);
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");  // table_act's act is written (a no-op without PDL)
#endif
#pragma unroll
    for (int p = 0; p < TABLE_P; ++p)
#pragma unroll
        for (int n = 0; n < TABLE_NT; ++n) abuf[p][n] = load16(arow[n] + 32 * (first + p), in_d(first + p) && aok[n]);

    for (int s0 = first; s0 < end; s0 += TABLE_P) {
#pragma unroll
        for (int p = 0; p < TABLE_P; ++p) {
            const int s = s0 + p;
            if (s >= end) break;
            uint4 w[TABLE_MT][2], a[TABLE_NT];
#pragma unroll
            for (int m = 0; m < TABLE_MT; ++m)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    w[m][h] = wbuf[p][m][h];
                    wbuf[p][m][h] = load16(wrow[m][h] + 32 * (s + TABLE_P), in_d(s + TABLE_P) && wok[m][h]);
                }
#pragma unroll
            for (int n = 0; n < TABLE_NT; ++n) {
                a[n] = abuf[p][n];
                abuf[p][n] = load16(arow[n] + 32 * (s + TABLE_P), in_d(s + TABLE_P) && aok[n]);
            }
#pragma unroll
            for (int m = 0; m < TABLE_MT; ++m)
#pragma unroll
                for (int n = 0; n < TABLE_NT; ++n) {
                    mma_bf16_16816(acc[m][n], w[m][0].x, w[m][1].x, w[m][0].y, w[m][1].y, a[n].x, a[n].y);
                    mma_bf16_16816(acc[m][n], w[m][0].z, w[m][1].z, w[m][0].w, w[m][1].w, a[n].z, a[n].w);
                }
        }
    }

    // the chunks in order: warps 1.. leave theirs in shared memory, warp 0 adds them to its own
    __shared__ float parts[TABLE_CHUNKS - 1][TABLE_MT * TABLE_NT * 4][32];
    if (warp > 0) {
#pragma unroll
        for (int m = 0; m < TABLE_MT; ++m)
#pragma unroll
            for (int n = 0; n < TABLE_NT; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) parts[warp - 1][(m * TABLE_NT + n) * 4 + e][lane] = acc[m][n][e];
    }
    __syncthreads();
    if (warp > 0) return;
#pragma unroll 1
    for (int c = 0; c < TABLE_CHUNKS - 1; ++c)
#pragma unroll
        for (int m = 0; m < TABLE_MT; ++m)
#pragma unroll
            for (int n = 0; n < TABLE_NT; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[m][n][e] += parts[c][(m * TABLE_NT + n) * 4 + e][lane];
    // acc[m][n][2 h + e]: row j0 + 16 m + 8 h + g, timestep t0 + 8 n + 2 q + e
#pragma unroll
    for (int m = 0; m < TABLE_MT; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int j = j0 + 16 * m + 8 * h + g;
            if (j >= ADALN_TABLE_N) continue;
            const float b = bf16_to_float(bias[j]);
#pragma unroll
            for (int n = 0; n < TABLE_NT; ++n)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int t = t0 + 8 * n + 2 * q + e;
                    if (t < ADALN_T) store_sum(acc[m][n][2 * h + e] + b, t, j, table, table_f32);
                }
        }
}
