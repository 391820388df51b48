// table.cu: the modulation table  table[t, j] = bias[j] + sum_k bf16(silu(temb[t, k])) * weight[j, k]
//
// Computes, for all T timesteps at once, table (T, N) bf16 (diffusers' rounding: the SiLU output
// is rounded to bf16 once, the fp32 dot product plus bias is rounded to bf16 once) and table_f32
// (T, N) fp32: the same sums unrounded (final_adaln_out's backward uses them), or, with
// ADALN_TABLE_F32_ROUNDED, the bf16 values in fp32 (the blocks' modulation table, adaln_lab/ops/modulation_table/launch.py).
// N = ADALN_TABLE_N columns: 2H for norm_out (shift | scale), 18H for an H3 block's adaln_proj. With
// ADALN_TABLE_ROW_TABLES (a block's table) the bf16 output is instead the two (3T, 2H) row tables the block's norms
// read, one after the other: column c * H + h of modality m, c in 0..5 = shift_msa, scale_msa, gate_msa, shift_mlp,
// scale_mlp, gate_mlp, goes to row 3t + m, column (c % 3) * H + h of table c / 3; the gates are not stored in bf16.
//
// Work: a task is ADALN_TABLE_ROWS_PER_WARP consecutive output rows j (their weight rows loaded side by
// side), done by one warp. Two schedules (plan.table_persistent, from the shapes):
// - one task per warp (a small table: fewer than TABLE_PERSISTENT_MIN_ROUNDS x TABLE_BLOCKS blocks of tasks):
//   grid = plan.table_grid, block b's warp w does task b * warps + w, loads issued in its loop (unroll 2);
// - persistent (a large table, e.g. an H3 block's 18H rows): grid = TABLE_BLOCKS (a constant of the plan: 132,
//   one per SM of an H200), warp w of block b takes tasks w * gridDim + b, then + gridDim * warps, ...
//   (interleaved, so the last round's tasks spread over every SM); the activations' prologue runs once per
//   block, and each lane keeps ADALN_TABLE_AHEAD weight steps in flight, across the end of a task into its
//   next one, the first ones issued before the prologue.
// Measured (bench/NOTES.md v8): the persistent schedule is 25 us faster on a block's table at T = 3, the
// other 5 us faster on norm_out's (10752 rows: 1.3 rounds).
// Block = ADALN_TABLE_THREADS. Static shared memory: the T * D bf16 activations (plan.check_shapes keeps
// them within 48 KiB).
// Reduction order of one (t, j): lane l sums the 8-wide k-vectors l, l + 32, l + 64, ... in that
// order (fmaf over the 8 elements in k order); the 32 lane sums go through warp_sum_lane0.
// Each timestep has its own accumulator, so row t has the same bits whatever T is and whichever
// other timesteps are present; a row's sums are one warp's whatever the grid, so the grid never changes a
// bit. weight is read once.
// Run: adaln_lab.core.tensors.table(temb, weight, bias) on CUDA tensors.

#define TABLE_R ADALN_TABLE_ROWS_PER_WARP
#define TABLE_WARPS (ADALN_TABLE_THREADS / 32)
#define TABLE_TASKS ((ADALN_TABLE_N + TABLE_R - 1) / TABLE_R)

__device__ __forceinline__ void load_weight_step(uint4 w_raw[TABLE_R], const bf16_t* weight, int first, int kv) {
#pragma unroll
    for (int r = 0; r < TABLE_R; ++r)
        w_raw[r] = first + r < ADALN_TABLE_N ? load_raw8(weight + (size_t)(first + r) * ADALN_D + kv * ADALN_VEC)
                                           : make_uint4(0, 0, 0, 0);
}

__device__ __forceinline__ void accumulate_step(float acc[TABLE_R][ADALN_T], const uint4 w_raw[TABLE_R],
                                                const bf16_t* act, int kv) {
#pragma unroll
    for (int t = 0; t < ADALN_T; ++t) {
        float a[ADALN_VEC];
        load8(act + t * ADALN_D + kv * ADALN_VEC, a);
#pragma unroll
        for (int r = 0; r < TABLE_R; ++r) {
            float w[ADALN_VEC];
            unpack8(w_raw[r], w);
#pragma unroll
            for (int e = 0; e < ADALN_VEC; ++e) acc[r][t] = fmaf(w[e], a[e], acc[r][t]);
        }
    }
}

// The weight steps of one lane in the order it uses them: step i of task `task` is vector lane + 32 i of its
// rows, for i < steps (the lane's share of the D / 8 vectors), then the next task of the warp.
struct WeightStream {
    int task, i, steps, stride;
    __device__ __forceinline__ void issue(uint4 w_raw[TABLE_R], const bf16_t* weight, int lane) {
        if (task < TABLE_TASKS) load_weight_step(w_raw, weight, task * TABLE_R, lane + 32 * i);
        if (++i == steps) {
            i = 0;
            task += stride;
        }
    }
};

// The epilogue of a task: each (row j, timestep t) sum of the warp to lane 0, plus bias, stored.
__device__ __forceinline__ void store_task(float acc[TABLE_R][ADALN_T], int first, int lane,
                                           const bf16_t* __restrict__ bias, bf16_t* __restrict__ table,
                                           float* __restrict__ table_f32) {
#pragma unroll
    for (int r = 0; r < TABLE_R; ++r) {
        const int j = first + r;
        if (j >= ADALN_TABLE_N) break;
        const float b = bf16_to_float(bias[j]);
#pragma unroll
        for (int t = 0; t < ADALN_T; ++t) {
            const float sum = warp_sum_lane0(acc[r][t]) + b;
            if (lane == 0) {
                table_f32[t * ADALN_TABLE_N + j] = ADALN_TABLE_F32_ROUNDED ? round_bf16(sum) : sum;
#if ADALN_TABLE_ROW_TABLES
                constexpr int H = ADALN_TABLE_N / 18;
                const int m = j / (6 * H), c = (j % (6 * H)) / H, h = j % H;
                if (c != 2 && c != 5)
                    table[((size_t)(c / 3) * 3 * ADALN_T + 3 * t + m) * 2 * H + (c % 3) * H + h] = float_to_bf16(sum);
#else
                table[t * ADALN_TABLE_N + j] = float_to_bf16(sum);
#endif
            }
        }
    }
}

__device__ __forceinline__ void zero(float acc[TABLE_R][ADALN_T]) {
#pragma unroll
    for (int r = 0; r < TABLE_R; ++r)
#pragma unroll
        for (int t = 0; t < ADALN_T; ++t) acc[r][t] = 0.0f;
}

template <bool PERSISTENT>
__device__ __forceinline__ void table_schedule(const float* __restrict__ temb, const bf16_t* __restrict__ weight,
                                               const bf16_t* __restrict__ bias, bf16_t* __restrict__ table,
                                               float* __restrict__ table_f32) {
    __shared__ __align__(16) bf16_t act[ADALN_T * ADALN_D];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if constexpr (!PERSISTENT) {  // a block per TABLE_WARPS tasks: task b * warps + w, loads in the loop
        const int first = (blockIdx.x * TABLE_WARPS + warp) * TABLE_R;
        for (int i = threadIdx.x; i < ADALN_T * ADALN_D; i += ADALN_TABLE_THREADS)
            act[i] = float_to_bf16(silu(temb[i]));
        __syncthreads();
        float acc[TABLE_R][ADALN_T];
        zero(acc);
#pragma unroll 2
        for (int kv = lane; kv < ADALN_NVEC_D; kv += 32) {
            uint4 w_raw[TABLE_R];
            load_weight_step(w_raw, weight, first, kv);
            accumulate_step(acc, w_raw, act, kv);
        }
        store_task(acc, first, lane, bias, table, table_f32);
    } else {
        const int stride = gridDim.x * TABLE_WARPS;
        const int steps = lane < ADALN_NVEC_D ? (ADALN_NVEC_D - lane + 31) / 32 : 0;
        WeightStream stream{warp * (int)gridDim.x + (int)blockIdx.x, 0, steps, stride};
        uint4 ahead[ADALN_TABLE_AHEAD][TABLE_R];  // the next weight steps of this lane, in use order
#pragma unroll
        for (int a = 0; a < ADALN_TABLE_AHEAD; ++a)
            if (steps > 0) stream.issue(ahead[a], weight, lane);
        for (int i = threadIdx.x; i < ADALN_T * ADALN_D; i += ADALN_TABLE_THREADS) act[i] = float_to_bf16(silu(temb[i]));
        __syncthreads();

        for (int task = warp * gridDim.x + blockIdx.x; task < TABLE_TASKS; task += stride) {
            float acc[TABLE_R][ADALN_T];
            zero(acc);
            for (int kv = lane; kv < ADALN_NVEC_D; kv += 32) {
                uint4 w_raw[TABLE_R];
#pragma unroll
                for (int r = 0; r < TABLE_R; ++r) w_raw[r] = ahead[0][r];
#pragma unroll
                for (int a = 0; a + 1 < ADALN_TABLE_AHEAD; ++a)
#pragma unroll
                    for (int r = 0; r < TABLE_R; ++r) ahead[a][r] = ahead[a + 1][r];
                stream.issue(ahead[ADALN_TABLE_AHEAD - 1], weight, lane);
                accumulate_step(acc, w_raw, act, kv);
            }
            store_task(acc, task * TABLE_R, lane, bias, table, table_f32);
        }
    }
}

extern "C" __global__ void __launch_bounds__(ADALN_TABLE_THREADS, ADALN_TABLE_MIN_BLOCKS)
table_bf16(const float* __restrict__ temb, const bf16_t* __restrict__ weight, const bf16_t* __restrict__ bias,
           bf16_t* __restrict__ table, float* __restrict__ table_f32) {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;");  // a kernel launched after it with PDL may start
#endif
    table_schedule<ADALN_TABLE_PERSISTENT != 0>(temb, weight, bias, table, table_f32);
}
