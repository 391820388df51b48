// EXPERIMENT, not shipped, not launched by adaln_lab (bench/NOTES.md, v6): a drop-in for
// kernels_cu/norm_modulate.cu that walks a range of rows per block, one pass per timestep, with x
// arriving through cp.async and shift / bf16(1 + scale) kept in shared memory. Its launcher needs
// grid = ceil(rows / rows_per_block), two more arguments (rows, rows_per_block) and dynamic shared
// memory of (ADALN_FWD_STAGES + 2) * FWD_THREADS * FWD_VPT * 16 bytes. The variant that kept
// shift and scale in registers (103 registers, 2 blocks per SM) measured 259.6 us against the
// shipped kernel's 226.6 at 32768 rows; this one has not run on a GPU yet.
//
// norm_modulate.cu: fused RMSNorm + modulation, diffusers' rounding points.
//
//   rstd[r] = rsqrt(sum_h x[r,h]^2 / H + eps)                          fp32, saved for backward
//   n       = bf16(x * rstd * norm_weight)                              (F.rms_norm rounds once)
//   out     = bf16(bf16(n * bf16(1 + scale[t])) + shift[t]),  t = timestep_indices[r % S]
// with shift = table[t, :H], scale = table[t, H:] (bf16). A row whose index is outside [0, T)
// gets NaN (the op checks indices before launching unless told not to).
//
// Launch geometry (shapes only): block = ADALN_FWD_THREADS (224 for H = 5376, thread i holds the
// 8-wide vectors i, i + ADALN_FWD_THREADS, ..., ADALN_FWD_VPT of them); each block owns a range of
// rows_per_block = min(ceil(rows / ADALN_FWD_RANGES), ADALN_ROW_LIST_MAX) consecutive rows,
// grid = ceil(rows / rows_per_block): from the number of rows alone, never from the GPU.
// Dynamic shared memory: shift and bf16(1 + scale) of one timestep, then ADALN_FWD_STAGES rows of x
// (the loader sets the size).
// Pipeline: one pass per timestep t over the block's rows of that timestep (rows with an invalid
// index go with pass 0). norm_weight sits in registers for the whole block, shift and
// bf16(1 + scale) in shared memory for the pass (each thread reads back only the slots it wrote, so
// no barrier), instead of being read from L2 for every row; a pass without rows reads nothing.
// x arrives through cp.async, ADALN_FWD_STAGES rows ahead of the one being normalised.
// Reduction order: per thread in vector then element order, then block_sum (adaln_common.cuh):
// the same tree for every row, whatever the number of rows or the order rows are visited in.
// Run: adaln_lab.cupy_backend.norm_modulate(x, norm_weight, table, timestep_indices, eps).

// this thread's vectors of row `row` of x into stage buffer `stage`, as one commit group (an empty
// group when pos >= n, so every iteration commits exactly one)
__device__ __forceinline__ void fetch_x(uint4* stage, const bf16_t* x, int row, bool present) {
    if (present) {
#pragma unroll
        for (int i = 0; i < ADALN_FWD_VPT; ++i) {
            const int v = threadIdx.x + i * ADALN_FWD_THREADS;
            if (v < ADALN_NVEC_H)
                copy_async16(stage + i * ADALN_FWD_THREADS + threadIdx.x, x + (size_t)row * ADALN_H + v * ADALN_VEC);
        }
    }
    copy_async_commit();
}

extern "C" __global__ void __launch_bounds__(ADALN_FWD_THREADS)
norm_modulate_bf16(const bf16_t* __restrict__ x, const bf16_t* __restrict__ norm_weight,
                   const bf16_t* __restrict__ table, const index_t* __restrict__ timestep_indices,
                   bf16_t* __restrict__ out, float* __restrict__ rstd, int S, float eps, int rows,
                   int rows_per_block) {
    // [2][ADALN_FWD_VPT][ADALN_FWD_THREADS] shift, bf16(1 + scale); then [ADALN_FWD_STAGES][ADALN_FWD_VPT][ADALN_FWD_THREADS] x
    extern __shared__ __align__(16) uint4 dynamic[];
    uint4* const shift_slots = dynamic;
    uint4* const scale1_slots = dynamic + ADALN_FWD_VPT * ADALN_FWD_THREADS;
    uint4* const stages = dynamic + 2 * ADALN_FWD_VPT * ADALN_FWD_THREADS;
    __shared__ float scratch[ADALN_FWD_THREADS / 32 + 1];
    __shared__ int timesteps[ADALN_ROW_LIST_MAX];
    const int r0 = blockIdx.x * rows_per_block;
    const int n = min(rows, r0 + rows_per_block) - r0;
    fill_row_timesteps(timesteps, timestep_indices, r0, n, S);
    uint4 w_raw[ADALN_FWD_VPT];
#pragma unroll
    for (int i = 0; i < ADALN_FWD_VPT; ++i) {
        const int v = threadIdx.x + i * ADALN_FWD_THREADS;
        if (v < ADALN_NVEC_H) w_raw[i] = load_raw8(norm_weight + v * ADALN_VEC);
    }
    __syncthreads();

#pragma unroll 1
    for (int t = 0; t < ADALN_T; ++t) {
        if (next_in_pass(timesteps, -1, n, t) >= n) continue;  // no row of this timestep here: read nothing
        const bf16_t* shift = table + t * 2 * ADALN_H;
#pragma unroll
        for (int i = 0; i < ADALN_FWD_VPT; ++i) {  // this thread's slots of shift and bf16(1 + scale)
            const int v = threadIdx.x + i * ADALN_FWD_THREADS;
            if (v < ADALN_NVEC_H) {
                shift_slots[i * ADALN_FWD_THREADS + threadIdx.x] = load_raw8(shift + v * ADALN_VEC);
                float sc[ADALN_VEC];
                load8(shift + ADALN_H + v * ADALN_VEC, sc);
#pragma unroll
                for (int e = 0; e < ADALN_VEC; ++e) sc[e] = 1.0f + sc[e];
                unsigned packed[4];
                pack8(sc, packed);
                scale1_slots[i * ADALN_FWD_THREADS + threadIdx.x] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
            }
        }
        int pos[ADALN_FWD_STAGES + 1];  // pos[0]: the row being normalised; then the rows in flight
#pragma unroll
        for (int d = 0; d < ADALN_FWD_STAGES; ++d) {
            pos[d] = next_in_pass(timesteps, d ? pos[d - 1] : -1, n, t);
            fetch_x(stages + d * ADALN_FWD_VPT * ADALN_FWD_THREADS, x, r0 + pos[d], pos[d] < n);
        }
#pragma unroll 1
        for (int k = 0; pos[0] < n; ++k) {
            uint4* stage = stages + (k % ADALN_FWD_STAGES) * ADALN_FWD_VPT * ADALN_FWD_THREADS;
            copy_async_wait<ADALN_FWD_STAGES - 1>();
            uint4 x_raw[ADALN_FWD_VPT];
            float ss = 0.0f;
#pragma unroll
            for (int i = 0; i < ADALN_FWD_VPT; ++i) {
                const int v = threadIdx.x + i * ADALN_FWD_THREADS;
                if (v < ADALN_NVEC_H) {
                    x_raw[i] = stage[i * ADALN_FWD_THREADS + threadIdx.x];
                    float xv[ADALN_VEC];
                    unpack8(x_raw[i], xv);
#pragma unroll
                    for (int e = 0; e < ADALN_VEC; ++e) ss = fmaf(xv[e], xv[e], ss);
                }
            }
            // ss depends on every value read from the stage, so the refill cannot overtake the reads
            pos[ADALN_FWD_STAGES] = next_in_pass(timesteps, pos[ADALN_FWD_STAGES - 1], n, t);
            fetch_x(stage, x, r0 + pos[ADALN_FWD_STAGES], pos[ADALN_FWD_STAGES] < n);

            const int row = r0 + pos[0];
            const bool valid = timesteps[pos[0]] >= 0;
            const float r = rsqrtf(block_sum<ADALN_FWD_THREADS / 32>(ss, scratch) / (float)ADALN_H + eps);
            if (threadIdx.x == 0) rstd[row] = r;
#pragma unroll
            for (int i = 0; i < ADALN_FWD_VPT; ++i) {
                const int v = threadIdx.x + i * ADALN_FWD_THREADS;
                if (v < ADALN_NVEC_H) {
                    float xv[ADALN_VEC], w[ADALN_VEC], sh[ADALN_VEC], sc1[ADALN_VEC], o[ADALN_VEC];
                    unpack8(x_raw[i], xv);
                    unpack8(w_raw[i], w);
                    unpack8(shift_slots[i * ADALN_FWD_THREADS + threadIdx.x], sh);
                    unpack8(scale1_slots[i * ADALN_FWD_THREADS + threadIdx.x], sc1);
#pragma unroll
                    for (int e = 0; e < ADALN_VEC; ++e) {
                        const float n_e = round_bf16((xv[e] * r) * w[e]);
                        o[e] = valid ? round_bf16(n_e * sc1[e]) + sh[e] : __int_as_float(0x7fc00000);
                    }
                    store8(out + (size_t)row * ADALN_H + v * ADALN_VEC, o);
                }
            }
#pragma unroll
            for (int d = 0; d < ADALN_FWD_STAGES; ++d) pos[d] = pos[d + 1];
        }
    }
}
