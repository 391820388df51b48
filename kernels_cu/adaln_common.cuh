// adaln_common.cuh: what every kernel of adaln_lab shares, written once.
//
// - bf16 <-> fp32 without cuda_bf16.h (so NVRTC needs no toolkit headers): bf16 is the upper
//   half of an fp32 word; float -> bf16 is the hardware cvt.rn (round to nearest even, the
//   rounding of __float2bfloat16_rn and of torch's bf16 casts).
// - 16-byte vector loads and stores of 8 bf16 values.
// - block_sum: THE reduction tree of a row. Each thread first sums its own values in a fixed
//   order; then a butterfly inside each warp (offsets 16, 8, 4, 2, 1) whose lane-0 value is
//   kept; then warp 0 sums the per-warp values in the same butterfly. The tree depends only on
//   blockDim (a function of H), never on the number of rows or the GPU.
//
// Shape constants come from the loader as macros: ADALN_H, ADALN_D, ADALN_T (the problem),
// ADALN_FWD_THREADS, ADALN_FWD_VPT (the forward row kernel's block size and 8-wide vectors per
// thread) and ADALN_BWD_THREADS, ADALN_BWD_VPT (the same for the backward row pass). All four
// are functions of H alone (adaln_lab/cupy_backend.py: row_geometry).

typedef unsigned short bf16_t;
typedef long long index_t;

#define ADALN_VEC 8
#define ADALN_NVEC_H (ADALN_H / ADALN_VEC)
#define ADALN_NVEC_D (ADALN_D / ADALN_VEC)

__device__ __forceinline__ float bf16_to_float(bf16_t v) { return __uint_as_float(((unsigned)v) << 16); }

__device__ __forceinline__ bf16_t float_to_bf16(float f) {
    unsigned short r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
}

// two floats to one word of two bf16 (lo in the low half), one instruction on sm_80+
__device__ __forceinline__ unsigned float2_to_bf16x2(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// round to bf16 and back: the rounding point of an op done "in the stream dtype"
__device__ __forceinline__ float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

__device__ __forceinline__ uint4 load_raw8(const bf16_t* p) { return *reinterpret_cast<const uint4*>(p); }

__device__ __forceinline__ void unpack8(uint4 raw, float v[ADALN_VEC]) {
    unsigned w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        v[2 * i] = __uint_as_float(w[i] << 16);
        v[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}

__device__ __forceinline__ void load8(const bf16_t* p, float v[ADALN_VEC]) { unpack8(load_raw8(p), v); }

__device__ __forceinline__ void store8(bf16_t* p, const float v[ADALN_VEC]) {
    unsigned w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
        w[i] = float2_to_bf16x2(v[2 * i], v[2 * i + 1]);
    *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
}

__device__ __forceinline__ float warp_sum_lane0(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return __shfl_sync(0xffffffffu, v, 0);  // every lane takes lane 0's association order
}

// Sum of one value per thread over a block of WARPS warps, same bits in every thread. `scratch`
// holds WARPS + 1 floats of shared memory; the function syncs before reusing it.
template <int WARPS>
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum_lane0(v);
    __syncthreads();  // scratch may still be read from a previous call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float w = lane < WARPS ? scratch[lane] : 0.0f;
        w = warp_sum_lane0(w);
        if (lane == 0) scratch[WARPS] = w;
    }
    __syncthreads();
    return scratch[WARPS];
}

// SiLU as torch computes it in fp32: v / (1 + exp(-v)).
__device__ __forceinline__ float silu(float v) { return v / (1.0f + expf(-v)); }

// Ordered sum down one column of a (n, ...) fp32 array, for block shape (32, SUM_GROUPS):
// threadIdx.x picks the column, threadIdx.y one of SUM_GROUPS contiguous row ranges, each summed
// in row order in double; the group sums are then added in group order. The order depends on n
// alone. Every thread of the block must call it; the result is meaningful where threadIdx.y == 0.
#define SUM_GROUPS 16
__device__ __forceinline__ double ordered_column_sum(const float* column, int n, size_t stride, bool valid,
                                                     double (*scratch)[32]) {
    const int per = (n + SUM_GROUPS - 1) / SUM_GROUPS;
    const int b0 = threadIdx.y * per, b1 = min(n, b0 + per);
    double s = 0.0;
    if (valid)
#pragma unroll 8
        for (int b = b0; b < b1; ++b) s += (double)column[(size_t)b * stride];  // loads issued 8 at a time
    scratch[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    double total = 0.0;
    if (threadIdx.y == 0)
#pragma unroll
        for (int g = 0; g < SUM_GROUPS; ++g) total += scratch[g][threadIdx.x];
    __syncthreads();
    return total;
}
