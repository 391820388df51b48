// norm_modulate.cu: fused RMSNorm + modulation, diffusers' rounding points.
//
//   rstd[r] = rsqrt(sum_h x[r,h]^2 / H + eps)                          fp32, saved for backward
//   n       = bf16(x * rstd * norm_weight)                              (F.rms_norm rounds once)
//   out     = bf16(bf16(n * bf16(1 + scale[t])) + shift[t]),  t = timestep_indices[r % S]
// with shift = table[t, :H], scale = table[t, H:] (bf16). A row whose index is outside [0, T)
// reads nothing outside the table and gets NaN.
//
// Thread i of a row's block holds the 8-wide vectors i, i + ADALN_FWD_THREADS, ... (ADALN_FWD_VPT
// of them); ADALN_FWD_THREADS and ADALN_FWD_VPT come from H alone (adaln_lab/core/plan.py). Reduction
// order: per thread in vector then element order, then block_sum (adaln_common.cuh): the same tree
// for every row, whatever the number of rows, their order, or which block owns them. The three kernels
// below share that tree and the per-vector functions, so they give the same bits for every row; the plan
// picks one from the shapes (cuda/launchers.py: launch_norm_modulate):
//
// norm_modulate_warp_bf16 (where a row fits a warp's registers: plan.fwd_warp, H <= 6144): one row per
// warp, each lane playing the row block's threads l, l + 32, ... (bench/NOTES.md v12: 3.7 TB/s at 32768 rows
// on the H200, against 3.2 for the staged kernel). With plan.fwd_pdl (TUNING FWD_PDL) it is launched right after
// the table kernel with programmatic dependent launch, so its x loads and sums of squares overlap the table's tail.
// norm_modulate_bf16 (staged): each block owns a range of rows_per_range consecutive rows
// (plan: Rows.fwd_rows_per_range; grid = ranges) and keeps in dynamic shared memory the shift and
// bf16(1 + scale) of EVERY timestep, staged once per block (the row-per-block kernel read them from
// L2 for every row: three times the DRAM bytes), with ADALN_FWD_STAGES rows of x arriving through
// cp.async ahead of the row being normalised. Each thread reads back only the slots it wrote.
// norm_modulate_rowwise_bf16: one row per block, every load issued before the reduction; used when
// neither fits (a wide row with more timesteps than the staged kernel's shared memory holds).
// Run: adaln_lab.core.tensors.norm_modulate(x, norm_weight, table, timestep_indices, eps, D).

#define FWD_SLOTS (ADALN_FWD_VPT * ADALN_FWD_THREADS)  // uint4 slots of one row in shared memory

// this thread's share of sum(x^2) of one row
__device__ __forceinline__ float row_sum_squares(const uint4 x_raw[ADALN_FWD_VPT]) {
    float ss = 0.0f;
#pragma unroll
    for (int i = 0; i < ADALN_FWD_VPT; ++i) {
        if (threadIdx.x + i * ADALN_FWD_THREADS < ADALN_NVEC_H) {
            float xv[ADALN_VEC];
            unpack8(x_raw[i], xv);
#pragma unroll
            for (int e = 0; e < ADALN_VEC; ++e) ss = fmaf(xv[e], xv[e], ss);
        }
    }
    return ss;
}

// out of one vector: n = bf16(x * r * w), p = bf16(n * s1), out = bf16(p + shift); NaN if !valid
__device__ __forceinline__ void modulate_store(bf16_t* out, uint4 x_raw, uint4 w_raw, uint4 shift_raw, uint4 s1_raw,
                                               float r, bool valid) {
    float xv[ADALN_VEC], w[ADALN_VEC], sh[ADALN_VEC], s1[ADALN_VEC], o[ADALN_VEC];
    unpack8(x_raw, xv);
    unpack8(w_raw, w);
    unpack8(shift_raw, sh);
    unpack8(s1_raw, s1);
#pragma unroll
    for (int e = 0; e < ADALN_VEC; ++e) {
        const float n = round_bf16((xv[e] * r) * w[e]);
        o[e] = valid ? round_bf16(n * s1[e]) + sh[e] : __int_as_float(0x7fc00000);
    }
    store8(out, o);
}

// bf16(1 + scale) of one vector of the bf16 table
__device__ __forceinline__ uint4 one_plus(uint4 scale_raw) {
    float sc[ADALN_VEC];
    unpack8(scale_raw, sc);
#pragma unroll
    for (int e = 0; e < ADALN_VEC; ++e) sc[e] = 1.0f + sc[e];
    unsigned packed[4];
    pack8(sc, packed);
    return make_uint4(packed[0], packed[1], packed[2], packed[3]);
}

// this thread's vectors of row `row` of x into stage buffer `stage`, as one commit group (an empty
// group when the row is not present, so every iteration commits exactly one)
__device__ __forceinline__ void fetch_x(uint4* stage, const bf16_t* x, size_t row, bool present) {
    if (present) {
#pragma unroll
        for (int i = 0; i < ADALN_FWD_VPT; ++i) {
            const int v = threadIdx.x + i * ADALN_FWD_THREADS;
            if (v < ADALN_NVEC_H) copy_async16(stage + i * ADALN_FWD_THREADS + threadIdx.x, x + row * ADALN_H + v * ADALN_VEC);
        }
    }
    copy_async_commit();
}

extern "C" __global__ void __launch_bounds__(ADALN_FWD_THREADS)
norm_modulate_bf16(const bf16_t* __restrict__ x, const bf16_t* __restrict__ norm_weight,
                   const bf16_t* __restrict__ table, const index_t* __restrict__ timestep_indices,
                   bf16_t* __restrict__ out, float* __restrict__ rstd, int S, float eps, int rows,
                   int rows_per_range) {
    // [T][2][FWD_SLOTS] shift, bf16(1 + scale) of every timestep; then [ADALN_FWD_STAGES][FWD_SLOTS] x
    extern __shared__ __align__(16) uint4 dynamic_smem[];
    uint4* const modulation = dynamic_smem;
    uint4* const stages = dynamic_smem + 2 * ADALN_T * FWD_SLOTS;
    __shared__ float scratch[ADALN_FWD_THREADS / 32 + 1];
    __shared__ int timesteps[ADALN_FWD_ROW_LIST_MAX];
    const int r0 = blockIdx.x * rows_per_range;
    const int n = min(rows, r0 + rows_per_range) - r0;

#pragma unroll
    for (int d = 0; d < ADALN_FWD_STAGES; ++d) fetch_x(stages + d * FWD_SLOTS, x, (size_t)r0 + d, d < n);
    uint4 w_raw[ADALN_FWD_VPT];
#pragma unroll
    for (int i = 0; i < ADALN_FWD_VPT; ++i) {
        const int v = threadIdx.x + i * ADALN_FWD_THREADS;
        if (v < ADALN_NVEC_H) w_raw[i] = load_raw8(norm_weight + v * ADALN_VEC);
    }
#pragma unroll 1
    for (int t = 0; t < ADALN_T; ++t) {
        const bf16_t* shift = table + t * 2 * ADALN_H;
#pragma unroll
        for (int i = 0; i < ADALN_FWD_VPT; ++i) {
            const int v = threadIdx.x + i * ADALN_FWD_THREADS;
            if (v < ADALN_NVEC_H) {
                modulation[(2 * t) * FWD_SLOTS + i * ADALN_FWD_THREADS + threadIdx.x] = load_raw8(shift + v * ADALN_VEC);
                modulation[(2 * t + 1) * FWD_SLOTS + i * ADALN_FWD_THREADS + threadIdx.x] =
                    one_plus(load_raw8(shift + ADALN_H + v * ADALN_VEC));
            }
        }
    }
    fill_row_timesteps(timesteps, timestep_indices, r0, n, S);
    __syncthreads();

#pragma unroll 1
    for (int k = 0; k < n; ++k) {
        uint4* stage = stages + (k % ADALN_FWD_STAGES) * FWD_SLOTS;
        copy_async_wait<ADALN_FWD_STAGES - 1>();
        uint4 x_raw[ADALN_FWD_VPT];
#pragma unroll
        for (int i = 0; i < ADALN_FWD_VPT; ++i)
            if (threadIdx.x + i * ADALN_FWD_THREADS < ADALN_NVEC_H) x_raw[i] = stage[i * ADALN_FWD_THREADS + threadIdx.x];
        const float ss = row_sum_squares(x_raw);
        // ss depends on every value read from the stage, so the refill cannot overtake the reads
        fetch_x(stage, x, (size_t)r0 + k + ADALN_FWD_STAGES, k + ADALN_FWD_STAGES < n);

        const size_t row = (size_t)r0 + k;
        const float r = rsqrtf(block_sum<ADALN_FWD_THREADS / 32>(ss, scratch) / (float)ADALN_H + eps);
        if (threadIdx.x == 0) rstd[row] = r;
        const int ts = timesteps[k];
        const uint4* shift_slots = modulation + (2 * max(ts, 0)) * FWD_SLOTS;
#pragma unroll
        for (int i = 0; i < ADALN_FWD_VPT; ++i) {
            const int v = threadIdx.x + i * ADALN_FWD_THREADS;
            if (v < ADALN_NVEC_H) {
                const int slot = i * ADALN_FWD_THREADS + threadIdx.x;
                modulate_store(out + row * ADALN_H + v * ADALN_VEC, x_raw[i], w_raw[i], shift_slots[slot],
                               shift_slots[FWD_SLOTS + slot], r, ts >= 0);
            }
        }
    }
}

// One row's rstd and out from its x (this thread's vectors, already loaded): loads norm_weight and the
// row's modulation, reduces, stores. The row-per-block kernels' body (gated_residual_norm.cu's too).
__device__ __forceinline__ void norm_modulate_row(const uint4 x_raw[ADALN_FWD_VPT], size_t row,
                                                  const bf16_t* __restrict__ norm_weight,
                                                  const bf16_t* __restrict__ table, index_t t,
                                                  bf16_t* __restrict__ out, float* __restrict__ rstd, float eps,
                                                  float* scratch) {
    uint4 w_raw[ADALN_FWD_VPT], shift_raw[ADALN_FWD_VPT], scale_raw[ADALN_FWD_VPT];
    const bool valid = t >= 0 && t < ADALN_T;
    const bf16_t* shift = table + (valid ? t : 0) * 2 * ADALN_H;
#pragma unroll
    for (int i = 0; i < ADALN_FWD_VPT; ++i) {
        const int v = threadIdx.x + i * ADALN_FWD_THREADS;
        if (v < ADALN_NVEC_H) {
            w_raw[i] = load_raw8(norm_weight + v * ADALN_VEC);
            shift_raw[i] = load_raw8(shift + v * ADALN_VEC);
            scale_raw[i] = load_raw8(shift + ADALN_H + v * ADALN_VEC);
        }
    }
    const float r = rsqrtf(block_sum<ADALN_FWD_THREADS / 32>(row_sum_squares(x_raw), scratch) / (float)ADALN_H + eps);
    if (threadIdx.x == 0) rstd[row] = r;
#pragma unroll
    for (int i = 0; i < ADALN_FWD_VPT; ++i) {
        const int v = threadIdx.x + i * ADALN_FWD_THREADS;
        if (v < ADALN_NVEC_H)
            modulate_store(out + row * ADALN_H + v * ADALN_VEC, x_raw[i], w_raw[i], shift_raw[i], one_plus(scale_raw[i]),
                           r, valid);
    }
}

extern "C" __global__ void __launch_bounds__(ADALN_FWD_THREADS)
norm_modulate_rowwise_bf16(const bf16_t* __restrict__ x, const bf16_t* __restrict__ norm_weight,
                           const bf16_t* __restrict__ table, const index_t* __restrict__ timestep_indices,
                           bf16_t* __restrict__ out, float* __restrict__ rstd, int S, float eps, int rows,
                           int rows_per_range) {
    __shared__ float scratch[ADALN_FWD_THREADS / 32 + 1];
    const size_t row = blockIdx.x;
    uint4 x_raw[ADALN_FWD_VPT];
#pragma unroll
    for (int i = 0; i < ADALN_FWD_VPT; ++i) {
        const int v = threadIdx.x + i * ADALN_FWD_THREADS;
        if (v < ADALN_NVEC_H) x_raw[i] = load_raw8(x + row * ADALN_H + v * ADALN_VEC);
    }
    norm_modulate_row(x_raw, row, norm_weight, table, timestep_indices[row % (unsigned)S], out, rstd, eps, scratch);
}

// norm_modulate_warp_bf16: one row per warp, the whole row in the warp's registers (plan.fwd_warp: where a
// lane's share, ADALN_FWD_THREADS / 32 * ADALN_FWD_VPT vectors, is at most TUNING's FWD_WARP_VECTORS_MAX). Lane l
// plays the threads l, l + 32, l + 64, ... of the row block above (one per warp w of that block): it
// loads their vectors, sums each thread's squares in that thread's order, runs each warp's butterfly
// (warp_sum_lane0) on those 32 sums, then block_sum's last step on the warp sums placed in lanes
// 0 .. WARPS - 1: the same tree, so the same bits as the kernels above. No shared memory and no barrier;
// x is read once with an L1 no-allocate load, norm_weight and the table through L1 (they are reused by
// every row). Block = ADALN_FWD_WARP_THREADS, grid = ceil(rows / warps per block): warp k of block b
// owns row b * warps + k. Launched right after the table kernel with programmatic dependent launch
// (plan.fwd_pdl), it loads x and reduces before `griddepcontrol.wait`, then reads the table with volatile loads
// that cannot be hoisted above the wait.
#define FWD_WARPS (ADALN_FWD_THREADS / 32)

__device__ __forceinline__ uint4 load_stream8(const bf16_t* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

// a load of what the previous kernel wrote: volatile and ordered after griddepcontrol.wait (a non-volatile asm
// load could be hoisted above it), through the coherent path
__device__ __forceinline__ uint4 load_after_wait8(const bf16_t* p) {
    uint4 r;
    asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p) : "memory");
    return r;
}

__device__ __forceinline__ uint4 load_cached8(const bf16_t* p) {
    uint4 r;
    asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

extern "C" __global__ void __launch_bounds__(ADALN_FWD_WARP_THREADS)
norm_modulate_warp_bf16(const bf16_t* __restrict__ x, const bf16_t* __restrict__ norm_weight,
                        const bf16_t* __restrict__ table, const index_t* __restrict__ timestep_indices,
                        bf16_t* __restrict__ out, float* __restrict__ rstd, int S, float eps, int rows,
                        int rows_per_range) {
#if ADALN_FWD_WARP  // compiled only where the plan uses it (a wide row would not fit a warp's registers)
    const int lane = threadIdx.x & 31;
    const long long row = (long long)blockIdx.x * (ADALN_FWD_WARP_THREADS / 32) + (threadIdx.x >> 5);
    if (row >= rows) return;
    const bf16_t* xr = x + (size_t)row * ADALN_H;
    uint4 x_raw[FWD_WARPS][ADALN_FWD_VPT];
#pragma unroll
    for (int i = 0; i < ADALN_FWD_VPT; ++i)
#pragma unroll
        for (int w = 0; w < FWD_WARPS; ++w) {
            const int v = 32 * w + lane + i * ADALN_FWD_THREADS;
            if (v < ADALN_NVEC_H) x_raw[w][i] = load_stream8(xr + v * ADALN_VEC);
        }
    const index_t t = timestep_indices[(unsigned long long)row % (unsigned)S];
    // the row block's per-thread sums, then its per-warp butterflies: warp w's sum sits in every lane
    float warp_sums[FWD_WARPS];
#pragma unroll
    for (int w = 0; w < FWD_WARPS; ++w) {
        float ss = 0.0f;
#pragma unroll
        for (int i = 0; i < ADALN_FWD_VPT; ++i) {
            if (32 * w + lane + i * ADALN_FWD_THREADS < ADALN_NVEC_H) {
                float xv[ADALN_VEC];
                unpack8(x_raw[w][i], xv);
#pragma unroll
                for (int e = 0; e < ADALN_VEC; ++e) ss = fmaf(xv[e], xv[e], ss);
            }
        }
        warp_sums[w] = warp_sum_lane0(ss);
    }
    // block_sum's last step: warp 0's lane k holds warp k's sum (0 past the last warp)
    float placed = 0.0f;
#pragma unroll
    for (int w = 0; w < FWD_WARPS; ++w) placed = lane == w ? warp_sums[w] : placed;
    const float r = rsqrtf(warp_sum_lane0(placed) / (float)ADALN_H + eps);
    if (lane == 0) rstd[row] = r;

#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");  // the table kernel's writes (a no-op without PDL)
#endif
    const bool valid = t >= 0 && t < ADALN_T;
    const bf16_t* shift = table + (valid ? t : 0) * 2 * ADALN_H;
    bf16_t* orow = out + (size_t)row * ADALN_H;
#pragma unroll
    for (int i = 0; i < ADALN_FWD_VPT; ++i)
#pragma unroll
        for (int w = 0; w < FWD_WARPS; ++w) {
            const int v = 32 * w + lane + i * ADALN_FWD_THREADS;
            if (v < ADALN_NVEC_H)
                modulate_store(orow + v * ADALN_VEC, x_raw[w][i], load_cached8(norm_weight + v * ADALN_VEC),
                               load_after_wait8(shift + v * ADALN_VEC),
                               one_plus(load_after_wait8(shift + ADALN_H + v * ADALN_VEC)),
                               r, valid);
        }
#endif
}
