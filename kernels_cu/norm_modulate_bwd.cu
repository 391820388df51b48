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
// norm_modulate_bwd_residual_bf16: the same pass with a third input d_residual (rows, H) bf16, the
// gradient that reached x by another path (an H3 block's residual stream): it writes
//   dx[r] = bf16(bf16(rstd * (g - xhat * sum_h(g * xhat) / H)) + d_residual[r])
// i.e. the bits of the plain kernel's dx added to d_residual in bf16 by torch (autograd's sum), with
// one pass over the rows instead of three. d_residual travels in the stages beside x and dy
// (ADALN_BWD_RES_STAGES of them: plan.bwd_res_smem).
// Run: adaln_lab.launchers.launch_backward (its first kernel), launch_row_pass.

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

// NIN inputs per row (2: x, dy; 3: x, dy, d_residual), STAGES rows in flight
template <int NIN, int STAGES>
__device__ __forceinline__ void row_pass(const bf16_t* __restrict__ dy, const bf16_t* __restrict__ x,
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
        float* slot = row_partials + ((size_t)blockIdx.x * ADALN_T + t) * 2 * ADALN_H;
        if (next_in_pass(timesteps, -1, n, t) >= n) {  // no row of this timestep here: zeros, read nothing
            for (int i = threadIdx.x; i < 2 * ADALN_H / 4; i += ADALN_BWD_THREADS)
                reinterpret_cast<float4*>(slot)[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            continue;
        }
        const float* scale = table_f32 + (size_t)t * table_stride + ADALN_H;
        float w[ADALN_BWD_VPT][ADALN_VEC], s1[ADALN_BWD_VPT][ADALN_VEC];  // norm_weight, 1 + scale[t] (fp32)
        float sum_dy_xhat[ADALN_BWD_VPT][ADALN_VEC], sum_dy[ADALN_BWD_VPT][ADALN_VEC];
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
#pragma unroll
            for (int e = 0; e < ADALN_VEC; ++e) sum_dy_xhat[i][e] = sum_dy[i][e] = 0.0f;
        }

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
            const bool invalid = timesteps[pos[0]] < 0;
            const float rstd_r = row_rstd[pos[0]];
            float xhat[ADALN_BWD_VPT][ADALN_VEC], g[ADALN_BWD_VPT][ADALN_VEC];
            float dot = 0.0f;
#pragma unroll
            for (int i = 0; i < ADALN_BWD_VPT; ++i) {
                const int v = threadIdx.x + i * ADALN_BWD_THREADS;
                if (v < ADALN_NVEC_H) {
                    float dyv[ADALN_VEC];
                    unpack8(stage[i * ADALN_BWD_THREADS + threadIdx.x], xhat[i]);
                    unpack8(stage[(ADALN_BWD_VPT + i) * ADALN_BWD_THREADS + threadIdx.x], dyv);
#pragma unroll
                    for (int e = 0; e < ADALN_VEC; ++e) {
                        xhat[i][e] *= rstd_r;
                        g[i][e] = dyv[e] * s1[i][e] * w[i][e];
                        dot = fmaf(g[i][e], xhat[i][e], dot);
                        sum_dy_xhat[i][e] = fmaf(dyv[e], xhat[i][e], sum_dy_xhat[i][e]);
                        sum_dy[i][e] += dyv[e];
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
            // each thread refills only the slots it read, after reading them (dot depends on every x and
            // dy value; res_raw is read before the refill is issued)
            pos[STAGES] = next_in_pass(timesteps, pos[STAGES - 1], n, t);
            fetch_row_inputs<NIN>(stage, x, dy, d_residual, r0 + pos[STAGES], pos[STAGES] < n);

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
                    store8(dx + (size_t)row * ADALN_H + v * ADALN_VEC, d);
                }
            }
            if (invalid) {  // poison: this row belongs to no timestep
#pragma unroll
                for (int i = 0; i < ADALN_BWD_VPT; ++i)
#pragma unroll
                    for (int e = 0; e < ADALN_VEC; ++e) sum_dy_xhat[i][e] = sum_dy[i][e] = __int_as_float(0x7fc00000);
            }
#pragma unroll
            for (int d = 0; d < STAGES; ++d) {
                pos[d] = pos[d + 1];
            }
        }
#pragma unroll
        for (int i = 0; i < ADALN_BWD_VPT; ++i) {
            const int v = threadIdx.x + i * ADALN_BWD_THREADS;
            if (v < ADALN_NVEC_H) {
#pragma unroll
                for (int e = 0; e < ADALN_VEC; e += 4) {
                    *reinterpret_cast<float4*>(slot + v * ADALN_VEC + e) =
                        make_float4(sum_dy_xhat[i][e], sum_dy_xhat[i][e + 1], sum_dy_xhat[i][e + 2], sum_dy_xhat[i][e + 3]);
                    *reinterpret_cast<float4*>(slot + ADALN_H + v * ADALN_VEC + e) =
                        make_float4(sum_dy[i][e], sum_dy[i][e + 1], sum_dy[i][e + 2], sum_dy[i][e + 3]);
                }
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
    row_pass<2, ADALN_BWD_STAGES>(dy, x, nullptr, rstd, norm_weight, table_f32, timestep_indices, dx, row_partials,
                                  S, rows, rows_per_block, table_stride, stages, scratch, timesteps, row_rstd);
}

extern "C" __global__ void __launch_bounds__(ADALN_BWD_THREADS)
norm_modulate_bwd_residual_bf16(const bf16_t* __restrict__ dy, const bf16_t* __restrict__ x,
                                const bf16_t* __restrict__ d_residual, const float* __restrict__ rstd,
                                const bf16_t* __restrict__ norm_weight, const float* __restrict__ table_f32,
                                const index_t* __restrict__ timestep_indices, bf16_t* __restrict__ dx,
                                float* __restrict__ row_partials, int S, int rows, int rows_per_block,
                                int table_stride) {
    extern __shared__ __align__(16) uint4 stages[];  // [ADALN_BWD_RES_STAGES][3][ADALN_BWD_VPT][ADALN_BWD_THREADS]
    __shared__ float scratch[ADALN_BWD_THREADS / 32 + 1];
    __shared__ int timesteps[ADALN_ROW_LIST_MAX];
    __shared__ float row_rstd[ADALN_ROW_LIST_MAX];
    row_pass<3, ADALN_BWD_RES_STAGES>(dy, x, d_residual, rstd, norm_weight, table_f32, timestep_indices, dx,
                                      row_partials, S, rows, rows_per_block, table_stride, stages, scratch, timesteps,
                                      row_rstd);
}
