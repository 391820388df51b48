// What exact cross-row sums cost in a row pass (issue 40; bench/tools/exact_cost.py runs these).
//
// A stand-in for norm_out's backward row pass at one timestep: each block takes a contiguous range of rows, each
// thread 8 columns (H / 8 threads); per row it reads x and dy (bf16, 16 bytes each) and rstd, forms the terms
//     g = dy,  p = dy * (x * rstd),  s = p * norm_weight,  w = p * (1 + scale)      (each product rounded, fp32)
// writes bf16(p) as the row's dx stand-in (the pass's write bytes), and adds g, s, w over its rows:
//   pass_f32:    in fp32, in row order (today's partials);
//   pass_exact:  D = sum g and P = sum p as exact integers in a window (two sums: s and w follow from P, NOTES v34):
//                a quantum 2^q per sum (`quanta`); g (bf16) scaled and converted to one int64 state; p split into
//                hi = p rounded to a multiple of 2^(q + 40) (the 1.5 * 2^(q + 63) extraction) and lo = p - hi
//                (exact), each scaled by a power of two and converted to int64 (exact when p has no bit below 2^q
//                and |p| < 2^(q + 62)); a term outside its window sets the block's flag (the op would raise or take
//                a wider path: never a wrong sum). P = hi 2^(q + 40) + lo 2^q exactly; states of any split add as
//                integers.
//   pass_exact_wide: pass_exact with P as one 128-bit integer a column, from the float's bits (a window of 88
//                binades below the top: a flag is then as rare as a term 2^-88 of the largest);
//   amax_dy:     the pass an exact mode needs first for its quanta: each column's largest |dy| (as the exponent
//                bits of a float, atomicMax over blocks), reading dy alone.
// Partials: f32 (blocks, 3, H) (g, s, w); exact (blocks, 3, H) int64 (D, then P's two words: hi, lo or the
// 128-bit low, high); flags (blocks,) int.

#include <cuda_bf16.h>

#define H_COLS 5376

__device__ __forceinline__ void unpack8(const uint4 v, float* out) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float2 f = __bfloat1622float2(h[i]);
        out[2 * i] = f.x;
        out[2 * i + 1] = f.y;
    }
}

__device__ __forceinline__ uint4 pack8(const float* in) {
    uint4 v;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(in[2 * i], in[2 * i + 1]);
    return v;
}

// row r's terms of columns c0 .. c0 + 7: g = dy and p = dy (x rstd), each product rounded (no fma)
__device__ __forceinline__ void row_terms(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ dy,
                                          const float* __restrict__ rstd, const int r, const int c0, float* g,
                                          float* p) {
    float xf[8];
    unpack8(*reinterpret_cast<const uint4*>(x + (size_t)r * H_COLS + c0), xf);
    unpack8(*reinterpret_cast<const uint4*>(dy + (size_t)r * H_COLS + c0), g);
    const float rs = rstd[r];
#pragma unroll
    for (int j = 0; j < 8; ++j) p[j] = __fmul_rn(g[j], __fmul_rn(xf[j], rs));
}

extern "C" __global__ void pass_f32(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ dy,
                                    const float* __restrict__ rstd, const float* __restrict__ nw,
                                    const float* __restrict__ scale1, __nv_bfloat16* __restrict__ dx,
                                    float* __restrict__ partials, int rows, int rows_per) {
    const int c0 = threadIdx.x * 8;
    float ag[8], as_[8], aw[8], n[8], s1[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) { ag[j] = 0.f; as_[j] = 0.f; aw[j] = 0.f; n[j] = nw[c0 + j]; s1[j] = scale1[c0 + j]; }
    const int r0 = blockIdx.x * rows_per, r1 = min(rows, r0 + rows_per);
    for (int r = r0; r < r1; ++r) {
        float g[8], p[8];
        row_terms(x, dy, rstd, r, c0, g, p);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            ag[j] = __fadd_rn(ag[j], g[j]);
            as_[j] = __fadd_rn(as_[j], __fmul_rn(p[j], n[j]));
            aw[j] = __fadd_rn(aw[j], __fmul_rn(p[j], s1[j]));
        }
        *reinterpret_cast<uint4*>(dx + (size_t)r * H_COLS + c0) = pack8(p);
    }
    float* out = partials + (size_t)blockIdx.x * 3 * H_COLS + c0;
#pragma unroll
    for (int j = 0; j < 8; ++j) { out[j] = ag[j]; out[H_COLS + j] = as_[j]; out[2 * H_COLS + j] = aw[j]; }
}

struct Window {  // one sum's quantum 2^q, as the constants the split needs
    float c;        // 1.5 * 2^(q + 63): v + c - c rounds v to a multiple of 2^(q + 40)
    float to_hi;    // 2^-(q + 40)
    float to_lo;    // 2^-q
    float limit;    // 2^(q + 62): |v| below it
};

__device__ __forceinline__ Window window_of(int q) {
    Window w;
    w.c = ldexpf(1.5f, q + 63);
    w.to_hi = ldexpf(1.f, -(q + 40));
    w.to_lo = ldexpf(1.f, -q);
    w.limit = ldexpf(1.f, q + 62);
    return w;
}

// v (float32) into two int64 states of quanta 2^(q + 40) and 2^q: exact for |v| < 2^(q + 62) with no bit below 2^q
__device__ __forceinline__ void add_two(long long& hi, long long& lo, int& bad, const float v, const Window& w) {
    const float h = __fsub_rn(__fadd_rn(v, w.c), w.c);
    const float l = __fsub_rn(v, h);
    const float ls = __fmul_rn(l, w.to_lo);
    const long long nl = __float2ll_rz(ls);
    hi += __float2ll_rz(__fmul_rn(h, w.to_hi));
    lo += nl;
    bad |= (__ll2float_rz(nl) != ls) | (fabsf(v) >= w.limit);
}

// a bf16 value (8 significant bits) into one int64 state of quantum 2^q: exact for |v| < 2^(q + 47) with no bit
// below 2^q (headroom 2^15 terms a state)
__device__ __forceinline__ void add_one(long long& st, int& bad, const float v, const float to, const float limit) {
    const float s = __fmul_rn(v, to);
    const long long n = __float2ll_rz(s);
    st += n;
    bad |= (__ll2float_rz(n) != s) | (fabsf(v) >= limit);
}

// v (float32) as a 128-bit integer in units of 2^q added to st: v = +-m 2^E with m < 2^24 its significand and E its
// lowest bit's exponent; exact when E >= q and m 2^(E - q) < 2^112 (headroom 2^15 terms a state): a window of 88
// binades below the top, from the float's bits (no extraction), where two int64 states of spacing 40 give 39
__device__ __forceinline__ void add_wide(__int128& st, int& bad, const float v, const int q) {
    const unsigned bits = __float_as_uint(v);
    const int e = (bits >> 23) & 0xff;
    const unsigned m = (bits & 0x7fffffu) | (e ? 0x800000u : 0u);
    const int s = max(e, 1) - 150 - q;
    bad |= (m != 0u) & ((s < 0) | (s > 88));
    const __int128 t = (__int128)m << (s & 127);
    st += (bits >> 31) ? -t : t;
}

// P's state a thread, for its 8 columns: two int64 words of quanta 2^(q + 40) and 2^q (add_two), stored as (hi, lo)
struct TwoStates {
    long long hi[8], lo[8];
    Window w;
    __device__ __forceinline__ TwoStates(int q) : w(window_of(q)) {
#pragma unroll
        for (int j = 0; j < 8; ++j) { hi[j] = 0; lo[j] = 0; }
    }
    __device__ __forceinline__ void add(int j, int& bad, float v) { add_two(hi[j], lo[j], bad, v, w); }
    __device__ __forceinline__ void store(long long* out, int j) const {
        out[H_COLS + j] = hi[j];
        out[2 * H_COLS + j] = lo[j];
    }
};

// P's state a thread: one 128-bit integer a column in units of 2^q (add_wide), stored as (low word, high word)
struct WideState {
    __int128 s[8];
    int q;
    __device__ __forceinline__ WideState(int q_) : q(q_) {
#pragma unroll
        for (int j = 0; j < 8; ++j) s[j] = 0;
    }
    __device__ __forceinline__ void add(int j, int& bad, float v) { add_wide(s[j], bad, v, q); }
    __device__ __forceinline__ void store(long long* out, int j) const {
        out[H_COLS + j] = (long long)(unsigned long long)s[j];  // low word, two's complement
        out[2 * H_COLS + j] = (long long)(s[j] >> 64);          // high word, signed
    }
};

// Two sums, not three (NOTES v34's first cheaper form): D = sum of g and P = sum of p per column, exact;
// d_scale = norm_weight P and d_norm_weight = sum_t (1 + scale_t) P_t follow from them exactly off the pass.
// quanta: (q_g, q_p), one per sum for every column (a per-tensor anchor). D in one int64 state (add_one), P in the
// State's; partials (blocks, 3, H) int64 (D, then P's two words), a flag a block.
template <class State>
__device__ __forceinline__ void exact_pass(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ dy,
                                           const float* __restrict__ rstd, const int* __restrict__ quanta,
                                           __nv_bfloat16* __restrict__ dx, long long* __restrict__ partials,
                                           int* __restrict__ flags, int rows, int rows_per) {
    const int c0 = threadIdx.x * 8;
    long long sg[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) sg[j] = 0;
    State sp(quanta[1]);
    const float g_to = ldexpf(1.f, -quanta[0]), g_limit = ldexpf(1.f, quanta[0] + 47);
    int bad = 0;
    const int r0 = blockIdx.x * rows_per, r1 = min(rows, r0 + rows_per);
    for (int r = r0; r < r1; ++r) {
        float g[8], p[8];
        row_terms(x, dy, rstd, r, c0, g, p);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            add_one(sg[j], bad, g[j], g_to, g_limit);
            sp.add(j, bad, p[j]);
        }
        *reinterpret_cast<uint4*>(dx + (size_t)r * H_COLS + c0) = pack8(p);
    }
    long long* out = partials + (size_t)blockIdx.x * 3 * H_COLS + c0;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        out[j] = sg[j];
        sp.store(out, j);
    }
    if (__syncthreads_or(bad) && threadIdx.x == 0) flags[blockIdx.x] = 1;
}

#define EXACT_PASS_ARGS                                                                                       \
    const __nv_bfloat16 *__restrict__ x, const __nv_bfloat16 *__restrict__ dy, const float *__restrict__ rstd, \
        const int *__restrict__ quanta, __nv_bfloat16 *__restrict__ dx, long long *__restrict__ partials,     \
        int *__restrict__ flags, int rows, int rows_per

extern "C" __global__ void pass_exact(EXACT_PASS_ARGS) {
    exact_pass<TwoStates>(x, dy, rstd, quanta, dx, partials, flags, rows, rows_per);
}

// pass_exact with P as one 128-bit integer a column (add_wide: a window of 88 binades)
extern "C" __global__ void pass_exact_wide(EXACT_PASS_ARGS) {
    exact_pass<WideState>(x, dy, rstd, quanta, dx, partials, flags, rows, rows_per);
}

extern "C" __global__ void amax_dy(const __nv_bfloat16* __restrict__ dy, int* __restrict__ amax, int rows,
                                   int rows_per) {
    const int c0 = threadIdx.x * 8;
    float m[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) m[j] = 0.f;
    const int r0 = blockIdx.x * rows_per, r1 = min(rows, r0 + rows_per);
    for (int r = r0; r < r1; ++r) {
        float g[8];
        unpack8(*reinterpret_cast<const uint4*>(dy + (size_t)r * H_COLS + c0), g);
#pragma unroll
        for (int j = 0; j < 8; ++j) m[j] = fmaxf(m[j], fabsf(g[j]));
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) atomicMax(amax + c0 + j, __float_as_int(m[j]));
}
