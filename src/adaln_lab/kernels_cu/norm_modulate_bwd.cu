// norm_modulate_bwd.cu: the backward row pass: dx per row, and per-block partial sums over rows.
//
// With xhat = x * rstd, s1 = 1 + scale[t] (fp32 table, row t at table_f32 + t * table_stride: shift, then
// scale at + H) and g = dy * s1 * norm_weight:
//   dx[r]                    = bf16(rstd * (g - xhat * sum_h(g * xhat) / H))   per row, one rounding
//   row_partials[b, t, 0, h] = sum over the rows r of block b with timestep t of dy * xhat
//   row_partials[b, t, 1, h] = sum over the same rows of dy
// From these reduce_partials.cu forms d_shift[t] = sum_b [.,1], d_scale[t] = norm_weight * sum_b [.,0]
// and d_norm_weight = sum_t s1[t] * sum_b [.,0]. No atomics: each block owns its slice.
// A row whose index is outside [0, T) gets NaN in dx and NaN in its block's partials, so the
// error shows in every gradient (the op checks indices before launching unless told not to).
//
// Geometry (adaln_lab/plan.py): block = ADALN_BWD_THREADS x ADALN_BWD_VPT 8-wide vectors per thread
// (from H alone), grid = Rows.bwd_ranges ranges of Rows.bwd_rows_per_range consecutive rows
// (from the number of rows alone, never from the GPU).
// Dynamic shared memory: ADALN_BWD_STAGES rows of x and dy (plan.bwd_smem; the loader opts in).
// Pipeline: the block first copies its rows' timesteps and rstd to shared memory (a row's rstd read from
// global memory in the loop cost a load latency per row: its register was shifted down the ring of rows
// in flight, which waits for the load), then makes one pass
// per timestep t = 0 .. T-1 over its rows of that timestep (norm_weight and 1 + scale[t] held in
// registers for the pass; a pass without rows writes zero partials and reads nothing), with
// the next ADALN_BWD_STAGES rows' x and dy arriving through cp.async while a row is reduced.
// Reduction order: the row dot product uses block_sum (the forward's tree, so dx of a row never
// depends on the other rows); the partials add the block's rows of timestep t in row order.
// The H3 blocks' passes (norm_modulate_bwd_sorted_bf16, norm_modulate_bwd_residual_sorted_bf16) run the same
// row math over the rows in table-row order (row_order.cu; `row_order` = its row_offsets | order): a block
// owns Rows.bwd_rows_per_range consecutive positions of that order, one stream of rows through its stages
// (no pass per table row, so no refill of the stages per table row), and writes the sums of table row t
// over its rows of t (in that order, i.e. row order) to slot b + t of row_partials (bwd_ranges + T, 2, H):
// one slot per table row its positions span (one or two where each table row holds more rows than a range)
// instead of T (reduce_partials.cu's sorted kernel adds them up).
// The residual variant takes a third input d_residual (rows, H) bf16, the gradient that reached x by
// another path (an H3 block's residual stream), and writes
//   dx[r] = bf16(bf16(rstd * (g - xhat * sum_h(g * xhat) / H)) + d_residual[r])
// i.e. the bits of the plain kernel's dx added to d_residual in bf16 by torch (autograd's sum), with
// one pass over the rows instead of three. d_residual travels in the stages beside x and dy
// (ADALN_BWD_RES_STAGES of them: plan.bwd_res_smem). A row's dx is the same in every kernel here.
// Run: adaln_lab.launchers.launch_backward (its first kernel), launch_row_pass, launch_sorted_row_pass.

// this thread's vectors of row `row` of x, dy (and d_residual when NIN == 3) into stage buffer `stage`
// ([NIN][VPT][THREADS]), as one commit group (an empty group when the row is not present, so every
// iteration commits one)
template <int NIN>
__device__ __forceinline__ void fetch_row_inputs(uint4* stage, const bf16_t* x, const bf16_t* dy,
                                                 const bf16_t* d_residual, int row, bool present) {
    if (present) {
#pragma unroll
        for (int i = 0; i < ADALN_BWD_VPT; ++i) {
            const int v = threadIdx.x + i * ADALN_BWD_THREADS;
            if (v < ADALN_NVEC_H) {
                const size_t at = (size_t)row * ADALN_H + v * ADALN_VEC;
                copy_async16(stage + i * ADALN_BWD_THREADS + threadIdx.x, x + at);
                copy_async16(stage + (ADALN_BWD_VPT + i) * ADALN_BWD_THREADS + threadIdx.x, dy + at);
                if (NIN == 3) copy_async16(stage + (2 * ADALN_BWD_VPT + i) * ADALN_BWD_THREADS + threadIdx.x, d_residual + at);
            }
        }
    }
    copy_async_commit();
}

typedef float row_vectors[ADALN_BWD_VPT][ADALN_VEC];  // this thread's values of one row

// norm_weight and 1 + scale[t] (fp32 table) of this thread's columns
__device__ __forceinline__ void load_modulation(const bf16_t* norm_weight, const float* scale, row_vectors& w,
                                                row_vectors& s1) {
#pragma unroll
    for (int i = 0; i < ADALN_BWD_VPT; ++i) {
        const int v = threadIdx.x + i * ADALN_BWD_THREADS;
        if (v < ADALN_NVEC_H) {
            load8(norm_weight + v * ADALN_VEC, w[i]);
            const float4 sa = *reinterpret_cast<const float4*>(scale + v * ADALN_VEC);
            const float4 sb = *reinterpret_cast<const float4*>(scale + v * ADALN_VEC + 4);
            const float sc[ADALN_VEC] = {sa.x, sa.y, sa.z, sa.w, sb.x, sb.y, sb.z, sb.w};
#pragma unroll
            for (int e = 0; e < ADALN_VEC; ++e) s1[i][e] = 1.0f + sc[e];
        }
    }
}

// The modulation of this thread's columns (norm_weight w and 1 + scale[t]) as the row passes read it: load() at a
// table row's start, vector(i, w, s1) a vector's values for a row. RegisterModulation keeps them in registers (every
// plain pass); exact_row_pass.cu's float64 windows take SharedModulation (their registers hold the windows).
struct RegisterModulation {
    row_vectors w, s1;
    __device__ __forceinline__ void load(const bf16_t* norm_weight, const float* scale, uint4*) {
        load_modulation(norm_weight, scale, w, s1);
    }
    __device__ __forceinline__ void vector(int i, float (&wv)[ADALN_VEC], float (&sv)[ADALN_VEC]) const {
#pragma unroll
        for (int e = 0; e < ADALN_VEC; ++e) {
            wv[e] = w[i][e];
            sv[e] = s1[i][e];
        }
    }
};

// 1 + scale[t] in shared memory (`space`: one stage's room, [VPT][2][THREADS] float4, each thread its own slots, so
// no barrier), norm_weight read again from global memory a row (16 bytes a vector; every block reads the same H)
struct SharedModulation {
    float4* s1;
    const bf16_t* norm_weight;
    __device__ __forceinline__ void load(const bf16_t* weight, const float* scale, uint4* space) {
        norm_weight = weight;
        s1 = reinterpret_cast<float4*>(space);
        row_vectors w, s;  // load_modulation's values; w unused (its loads dropped)
        load_modulation(weight, scale, w, s);
#pragma unroll
        for (int i = 0; i < ADALN_BWD_VPT; ++i) {
            if (threadIdx.x + i * ADALN_BWD_THREADS < ADALN_NVEC_H) {
                s1[2 * i * ADALN_BWD_THREADS + threadIdx.x] = make_float4(s[i][0], s[i][1], s[i][2], s[i][3]);
                s1[(2 * i + 1) * ADALN_BWD_THREADS + threadIdx.x] = make_float4(s[i][4], s[i][5], s[i][6], s[i][7]);
            }
        }
    }
    __device__ __forceinline__ void vector(int i, float (&wv)[ADALN_VEC], float (&sv)[ADALN_VEC]) const {
        load8(norm_weight + (threadIdx.x + i * ADALN_BWD_THREADS) * ADALN_VEC, wv);
        const float4 a = s1[2 * i * ADALN_BWD_THREADS + threadIdx.x];
        const float4 b = s1[(2 * i + 1) * ADALN_BWD_THREADS + threadIdx.x];
        const float q[ADALN_VEC] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
        for (int e = 0; e < ADALN_VEC; ++e) sv[e] = q[e];
    }
};

// The row passes' per-table-row column sums of this thread's columns, in float32 registers: A = sum dy * xhat (one
// fma a row) and B = sum dy, in row order; store() writes them to `slot` (2, H): A, then B. (exact_row_pass.cu's
// ExactRowSums keeps the same two sums as exact integers instead: the row passes take either.)
struct FloatSums {
    row_vectors dy_xhat, dy;
    __device__ __forceinline__ void begin(int) {  // a table row's sums start at zero
#pragma unroll
        for (int i = 0; i < ADALN_BWD_VPT; ++i)
#pragma unroll
            for (int e = 0; e < ADALN_VEC; ++e) dy_xhat[i][e] = dy[i][e] = 0.0f;
    }
    __device__ __forceinline__ void add(int i, int e, float dyv, float xhat) {
        dy_xhat[i][e] = fmaf(dyv, xhat, dy_xhat[i][e]);
        dy[i][e] += dyv;
    }
    __device__ __forceinline__ void poison() {  // a row of no table row: NaN in every sum
#pragma unroll
        for (int i = 0; i < ADALN_BWD_VPT; ++i)
#pragma unroll
            for (int e = 0; e < ADALN_VEC; ++e) dy_xhat[i][e] = dy[i][e] = __int_as_float(0x7fc00000);
    }
    __device__ __forceinline__ float* slot(float* row_partials, size_t k) const {  // slot k of (., 2, H)
        return row_partials + k * 2 * ADALN_H;
    }
    __device__ __forceinline__ void store_none(float* slot) const {  // the block's threads write zeros to `slot`
        for (int i = threadIdx.x; i < 2 * ADALN_H / 4; i += ADALN_BWD_THREADS)
            reinterpret_cast<float4*>(slot)[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    __device__ __forceinline__ void store(float* slot, int) const {
#pragma unroll
        for (int i = 0; i < ADALN_BWD_VPT; ++i) {
            const int v = threadIdx.x + i * ADALN_BWD_THREADS;
            if (v < ADALN_NVEC_H) {
#pragma unroll
                for (int e = 0; e < ADALN_VEC; e += 4) {
                    *reinterpret_cast<float4*>(slot + v * ADALN_VEC + e) =
                        make_float4(dy_xhat[i][e], dy_xhat[i][e + 1], dy_xhat[i][e + 2], dy_xhat[i][e + 3]);
                    *reinterpret_cast<float4*>(slot + ADALN_H + v * ADALN_VEC + e) =
                        make_float4(dy[i][e], dy[i][e + 1], dy[i][e + 2], dy[i][e + 3]);
                }
            }
        }
    }
};

// One staged row (x, dy and, when NIN == 3, d_residual in `stage`): its dx stored at dx_row, its dy and xhat added
// to the sums (`sums.poison()` for an invalid row; dx_row nullptr: nothing stored). refill() runs as soon as this
// thread has read its slots of
// the stage (the next row's copies land there while the block sums the row's dot product).
template <int NIN, typename Sums, typename Mod, typename Refill>
__device__ __forceinline__ void reduce_row(const uint4* stage, float rstd_r, bool invalid, const Mod& mod,
                                           Sums& sums, bf16_t* dx_row, float* scratch, Refill refill) {
    float xhat[ADALN_BWD_VPT][ADALN_VEC], g[ADALN_BWD_VPT][ADALN_VEC];
    float dot = 0.0f;
#pragma unroll
    for (int i = 0; i < ADALN_BWD_VPT; ++i) {
        const int v = threadIdx.x + i * ADALN_BWD_THREADS;
        if (v < ADALN_NVEC_H) {
            float dyv[ADALN_VEC], w[ADALN_VEC], s1[ADALN_VEC];
            unpack8(stage[i * ADALN_BWD_THREADS + threadIdx.x], xhat[i]);
            unpack8(stage[(ADALN_BWD_VPT + i) * ADALN_BWD_THREADS + threadIdx.x], dyv);
            mod.vector(i, w, s1);
#pragma unroll
            for (int e = 0; e < ADALN_VEC; ++e) {
                xhat[i][e] *= rstd_r;
                g[i][e] = dyv[e] * s1[e] * w[e];
                dot = fmaf(g[i][e], xhat[i][e], dot);
                sums.add(i, e, dyv[e], xhat[i][e]);
            }
        }
    }
    uint4 res_raw[ADALN_BWD_VPT];
    if (NIN == 3) {
#pragma unroll
        for (int i = 0; i < ADALN_BWD_VPT; ++i)
            if (threadIdx.x + i * ADALN_BWD_THREADS < ADALN_NVEC_H)
                res_raw[i] = stage[(2 * ADALN_BWD_VPT + i) * ADALN_BWD_THREADS + threadIdx.x];
    }
    refill();  // dot depends on every x and dy value; res_raw was read before
    const float mean_dot = block_sum<ADALN_BWD_THREADS / 32>(dot, scratch) / (float)ADALN_H;
#pragma unroll
    for (int i = 0; i < ADALN_BWD_VPT; ++i) {
        const int v = threadIdx.x + i * ADALN_BWD_THREADS;
        if (v < ADALN_NVEC_H) {
            float d[ADALN_VEC];
#pragma unroll
            for (int e = 0; e < ADALN_VEC; ++e)
                d[e] = invalid ? __int_as_float(0x7fc00000) : rstd_r * (g[i][e] - xhat[i][e] * mean_dot);
            if (NIN == 3) {
                float res[ADALN_VEC];
                unpack8(res_raw[i], res);
#pragma unroll
                for (int e = 0; e < ADALN_VEC; ++e) d[e] = round_bf16(d[e]) + res[e];
            }
            if (dx_row != nullptr) store8(dx_row + v * ADALN_VEC, d);
        }
    }
    if (invalid) sums.poison();  // this row belongs to no table row
}

// NIN inputs per row (2: x, dy; 3: x, dy, d_residual), STAGES rows in flight; the block's rows in row order,
// one pass per timestep (norm_out's backward), each pass's sums stored by `sums.store(slot, t)`
template <int NIN, int STAGES, typename Sums, typename Mod = RegisterModulation>
__device__ __forceinline__ void row_pass(Sums& sums, const bf16_t* __restrict__ dy,
                                         const bf16_t* __restrict__ x,
                                         const bf16_t* __restrict__ d_residual, const float* __restrict__ rstd,
                                         const bf16_t* __restrict__ norm_weight, const float* __restrict__ table_f32,
                                         const index_t* __restrict__ timestep_indices, bf16_t* __restrict__ dx,
                                         float* __restrict__ row_partials, int S, int rows, int rows_per_block,
                                         int table_stride, uint4* stages, float* scratch, int* timesteps,
                                         float* row_rstd) {
    constexpr int STAGE_VECTORS = NIN * ADALN_BWD_VPT * ADALN_BWD_THREADS;
    const int r0 = blockIdx.x * rows_per_block;
    const int n = min(rows, r0 + rows_per_block) - r0;
    fill_row_timesteps(timesteps, timestep_indices, r0, n, S);
    for (int i = threadIdx.x; i < n; i += ADALN_BWD_THREADS) row_rstd[i] = rstd[r0 + i];
    __syncthreads();

#pragma unroll 1
    for (int t = 0; t < ADALN_T; ++t) {
        float* slot = sums.slot(row_partials, (size_t)blockIdx.x * ADALN_T + t);  // where store writes, if anywhere
        if (next_in_pass(timesteps, -1, n, t) >= n) {  // no row of this timestep here: zero sums, read nothing
            sums.store_none(slot);
            continue;
        }
        Mod mod;
        mod.load(norm_weight, table_f32 + (size_t)t * table_stride + ADALN_H, stages + STAGES * STAGE_VECTORS);
        sums.begin(t);

        int pos[STAGES + 1];      // pos[0]: the row being reduced; then the rows in flight
#pragma unroll
        for (int d = 0; d < STAGES; ++d) {
            pos[d] = next_in_pass(timesteps, d ? pos[d - 1] : -1, n, t);
            fetch_row_inputs<NIN>(stages + d * STAGE_VECTORS, x, dy, d_residual, r0 + pos[d], pos[d] < n);
        }
#pragma unroll 1
        for (int k = 0; pos[0] < n; ++k) {
            uint4* stage = stages + (k % STAGES) * STAGE_VECTORS;
            copy_async_wait<STAGES - 1>();
            const int row = r0 + pos[0];
            reduce_row<NIN>(stage, row_rstd[pos[0]], timesteps[pos[0]] < 0, mod, sums,
                            dx + (size_t)row * ADALN_H, scratch, [&] {
                                pos[STAGES] = next_in_pass(timesteps, pos[STAGES - 1], n, t);
                                fetch_row_inputs<NIN>(stage, x, dy, d_residual, r0 + pos[STAGES], pos[STAGES] < n);
                            });
#pragma unroll
            for (int d = 0; d < STAGES; ++d) pos[d] = pos[d + 1];
        }
        sums.store(slot, t);
    }
}

// The same rows' math over the positions of the rows in table-row order (row_order.cu): one stream of rows
// through the stages whatever their table rows, the partial sums of table row t stored (`sums.store`) to slot
// blockIdx.x + t when the stream leaves t (an H3 block's backward)
template <int NIN, int STAGES, typename Sums, typename Mod = RegisterModulation>
__device__ __forceinline__ void sorted_row_pass(Sums& sums, const bf16_t* __restrict__ dy,
                                                const bf16_t* __restrict__ x,
                                                const bf16_t* __restrict__ d_residual, const float* __restrict__ rstd,
                                                const bf16_t* __restrict__ norm_weight,
                                                const float* __restrict__ table_f32,
                                                const index_t* __restrict__ row_index, const int* __restrict__ row_order,
                                                bf16_t* __restrict__ dx, float* __restrict__ row_partials, int S,
                                                int rows, int rows_per_block, int table_stride, uint4* stages,
                                                float* scratch, int* timesteps, float* row_rstd, int* row_ids) {
    constexpr int STAGE_VECTORS = NIN * ADALN_BWD_VPT * ADALN_BWD_THREADS;
    const int p0 = blockIdx.x * rows_per_block;
    const int n = min(rows, p0 + rows_per_block) - p0;
    fill_sorted_rows(row_ids, timesteps, row_index, row_order, row_order + ADALN_T + 1, p0, n, S, S ? rows / S : 0);
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += ADALN_BWD_THREADS) row_rstd[i] = row_ids[i] >= 0 ? rstd[row_ids[i]] : 0.0f;
    __syncthreads();

    int t = sorted_table_row(timesteps[0]);
    Mod mod;
    uint4* const room = stages + STAGES * STAGE_VECTORS;  // SharedModulation's: the stage after the last in use
    mod.load(norm_weight, table_f32 + (size_t)t * table_stride + ADALN_H, room);
    sums.begin(t);
#pragma unroll
    for (int d = 0; d < STAGES; ++d)
        fetch_row_inputs<NIN>(stages + d * STAGE_VECTORS, x, dy, d_residual, d < n ? row_ids[d] : 0,
                              d < n && row_ids[d] >= 0);
#pragma unroll 1
    for (int k = 0; k < n; ++k) {
        uint4* stage = stages + (k % STAGES) * STAGE_VECTORS;
        copy_async_wait<STAGES - 1>();
        reduce_row<NIN>(stage, row_rstd[k], timesteps[k] < 0, mod, sums,
                        row_ids[k] >= 0 ? dx + (size_t)row_ids[k] * ADALN_H : nullptr, scratch, [&] {
                            const int next = k + STAGES;
                            fetch_row_inputs<NIN>(stage, x, dy, d_residual, next < n ? row_ids[next] : 0,
                                                  next < n && row_ids[next] >= 0);
                        });
        const int next_t = k + 1 < n ? sorted_table_row(timesteps[k + 1]) : -1;
        if (next_t != t) {  // the stream leaves table row t: its sums to slot blockIdx.x + t
            sums.store(sums.slot(row_partials, (size_t)blockIdx.x + t), t);
            if (next_t >= 0) {
                t = next_t;
                mod.load(norm_weight, table_f32 + (size_t)t * table_stride + ADALN_H, room);
                sums.begin(t);
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(ADALN_BWD_THREADS)
norm_modulate_bwd_bf16(const bf16_t* __restrict__ dy, const bf16_t* __restrict__ x, const float* __restrict__ rstd,
                       const bf16_t* __restrict__ norm_weight, const float* __restrict__ table_f32,
                       const index_t* __restrict__ timestep_indices, bf16_t* __restrict__ dx,
                       float* __restrict__ row_partials, int S, int rows, int rows_per_block, int table_stride) {
    extern __shared__ __align__(16) uint4 stages[];  // [ADALN_BWD_STAGES][2][ADALN_BWD_VPT][ADALN_BWD_THREADS]
    __shared__ float scratch[ADALN_BWD_THREADS / 32 + 1];
    __shared__ int timesteps[ADALN_ROW_LIST_MAX];
    __shared__ float row_rstd[ADALN_ROW_LIST_MAX];
    FloatSums sums;
    row_pass<2, ADALN_BWD_STAGES>(sums, dy, x, nullptr, rstd, norm_weight, table_f32, timestep_indices, dx,
                                  row_partials, S, rows, rows_per_block, table_stride, stages, scratch, timesteps,
                                  row_rstd);
}

// An H3 block's row passes: the rows in table-row order (`row_order`: row_order.cu's row_offsets | order,
// (T + 1 + S,) int32), partial sums per (range b, table row t) in slot b + t of row_partials (bwd_ranges + T, 2, H)
extern "C" __global__ void __launch_bounds__(ADALN_BWD_THREADS)
norm_modulate_bwd_sorted_bf16(const bf16_t* __restrict__ dy, const bf16_t* __restrict__ x,
                              const float* __restrict__ rstd, const bf16_t* __restrict__ norm_weight,
                              const float* __restrict__ table_f32, const index_t* __restrict__ row_index,
                              const int* __restrict__ row_order, bf16_t* __restrict__ dx,
                              float* __restrict__ row_partials, int S, int rows, int rows_per_block,
                              int table_stride) {
    extern __shared__ __align__(16) uint4 stages[];  // [ADALN_BWD_STAGES][2][ADALN_BWD_VPT][ADALN_BWD_THREADS]
    __shared__ float scratch[ADALN_BWD_THREADS / 32 + 1];
    __shared__ int timesteps[ADALN_ROW_LIST_MAX];
    __shared__ float row_rstd[ADALN_ROW_LIST_MAX];
    __shared__ int row_ids[ADALN_ROW_LIST_MAX];
    FloatSums sums;
    sorted_row_pass<2, ADALN_BWD_STAGES>(sums, dy, x, nullptr, rstd, norm_weight, table_f32, row_index, row_order,
                                         dx, row_partials, S, rows, rows_per_block, table_stride, stages, scratch,
                                         timesteps, row_rstd, row_ids);
}

extern "C" __global__ void __launch_bounds__(ADALN_BWD_THREADS)
norm_modulate_bwd_residual_sorted_bf16(const bf16_t* __restrict__ dy, const bf16_t* __restrict__ x,
                                       const bf16_t* __restrict__ d_residual, const float* __restrict__ rstd,
                                       const bf16_t* __restrict__ norm_weight, const float* __restrict__ table_f32,
                                       const index_t* __restrict__ row_index, const int* __restrict__ row_order,
                                       bf16_t* __restrict__ dx, float* __restrict__ row_partials, int S, int rows,
                                       int rows_per_block, int table_stride) {
    extern __shared__ __align__(16) uint4 stages[];  // [ADALN_BWD_RES_STAGES][3][ADALN_BWD_VPT][ADALN_BWD_THREADS]
    __shared__ float scratch[ADALN_BWD_THREADS / 32 + 1];
    __shared__ int timesteps[ADALN_ROW_LIST_MAX];
    __shared__ float row_rstd[ADALN_ROW_LIST_MAX];
    __shared__ int row_ids[ADALN_ROW_LIST_MAX];
    FloatSums sums;
    sorted_row_pass<3, ADALN_BWD_RES_STAGES>(sums, dy, x, d_residual, rstd, norm_weight, table_f32, row_index,
                                             row_order, dx, row_partials, S, rows, rows_per_block, table_stride,
                                             stages, scratch, timesteps, row_rstd, row_ids);
}
