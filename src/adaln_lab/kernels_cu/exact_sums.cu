// exact_sums.cu: norm_out's cross-row sums as exact integers (the contract of adaln_lab.nn.ExactGradients).
//
// Per row r (table row t = timestep_indices[r % S]) and column h, the two float32 terms the row alone gives
// (ops/final_adaln_out/exact.py's, with this kernel's rstd: the forward's saved one), each product rounded once, no
// contraction:
//   xhat = x * rstd[r]      shift term dy      scale term p = dy * xhat
// (the backward row pass's own partial sums, norm_modulate_bwd.cu; the gradients are fixed exact functions of these
// sums: d_scale = norm_weight A, d_norm_weight = sum_t (1 + scale[t]) A[t], formed by the caller).
// A finite float32 is m 2^(k - 149) with |m| < 2^24 and 0 <= k < 277 (core/exact.py's `decompose`): the term is
// the integer v = m << (k % 32) (|v| < 2^56) in limb k / 32 of a state that counts in units of 2^-149, added as
// core/exact.py's ExactSum.add adds it: v's low 32 bits (unsigned) to limb k / 32, v >> 32 (signed) to the next.
// Outputs (zeroed by the caller; LIMBS = ADALN_EXACT_LIMBS, uncarried: the caller carries them):
//   table_limbs (LIMBS, T, 2H) int64: limb l of table row t's sums, dy at column h, p at H + h
//   flags       (1,) int32:           bit 0 a non-finite term, bit 1 a timestep index outside [0, T) (its row left
//                                     out): the op raises on either, it never returns a wrong sum
// Order: none matters. Each thread keeps its two columns' states in shared memory (its own slots), adds its rows'
// terms there (through a register cache of the limb pair last used, ADALN_EXACT_CACHE), and adds a table row's
// limbs to the outputs with integer atomics when the rows' table row changes and at the end: integer addition is
// associative, so the blocks, rows and chunks may meet in any order and the sums are the same integers. Bounds: a
// limb gains less than 2^32 a term, so a call of at most 2^30 rows (the op refuses more) keeps every limb below
// 2^62 in magnitude.
//
// Geometry (core/plan.py): block ADALN_EXACT_THREADS threads, two columns each; grid (ceil(H / (2 threads)),
// chunks), chunk c taking positions [c * rows_per_chunk, (c + 1) * rows_per_chunk) of row_order (rows,) int32, the
// rows in table-row order (the caller's stable sort), so that a chunk's timestep changes at most T times: a table
// row's limbs go out once a chunk, not once a row (rows in their own order sent them out at every change of t,
// 64-bit atomics on the same addresses from every chunk: 5.4 ms at 32768 rows, exact_kernel_cost.json at 483b579).
// Dynamic shared memory: LIMBS x 2 sums x 2 columns x threads int64 (plan.exact_smem; none with
// ADALN_EXACT_CACHE 2, whose caches go straight to the outputs). ADALN_EXACT_AHEAD rows' x
// and dy are loaded before their terms are added (their loads in flight together).
// Run: adaln_lab.ops.row_sums.launch_sums (norm_out's T table rows; a block's row op whose own pass ran without exact
// sums, with the 3T rows of its chunks as T: a modulated norm's rows, or a gated residual's with x = y, rstd = 1).

#define EXACT_SLOTS (2 * 2)  // (sum, column) states of a thread: shift, scale x its two columns

// One state's register cache (ADALN_EXACT_CACHE): the limb pair (k, k + 1) the last term landed in and what the
// terms since added to them; a term in another pair first moves the cache into the shared-memory state. Terms of one
// column mostly share a pair (32 binades), so most adds touch no shared memory. k < 0: empty.
struct ExactCache {
    int k;
    long long lo, hi;
};

__device__ __forceinline__ void cache_spill(ExactCache& c, long long* st, int stride) {
    if (c.k >= 0) {
        st[c.k * stride] += c.lo;
        st[(c.k + 1) * stride] += c.hi;
    }
    c.k = -1;
    c.lo = 0;
    c.hi = 0;
}

// ADALN_EXACT_CACHE 2: no shared-memory state; a cache leaving its pair adds it to the output at g (limb l at
// g[l * gstride]) with integer atomics instead (rare where a column's terms share a pair).
__device__ __forceinline__ void cache_out(ExactCache& c, unsigned long long* g, size_t gstride) {
    if (c.k >= 0) {
        if (c.lo) atomicAdd(g + c.k * gstride, (unsigned long long)c.lo);  // two's complement: signed addition
        if (c.hi) atomicAdd(g + (c.k + 1) * gstride, (unsigned long long)c.hi);
    }
    c.k = -1;
    c.lo = 0;
    c.hi = 0;
}

// float32 term f as v (|v| < 2^56) in limb pair (limb, limb + 1) of a state in units of 2^-149 (the header's v and
// k / 32); false for a zero term (nothing to add) and for inf or NaN (flag bit 0: no exact sum exists)
__device__ __forceinline__ bool exact_split(float f, int& flags, long long& v, int& limb) {
    const unsigned bits = __float_as_uint(f);
    const unsigned k = ((bits >> 23) & 0xffu) - 1u;  // a normal f is m 2^(k - 149), m with the implicit bit, k < 254
    if (k < 254u) {
        // v = f 2^(149 - 32 limb) = +-m 2^(k % 32): f's bits with 149 - 32 limb added to the exponent field (giving
        // 150 .. 181: no carry into the sign bit), a float holding an integer below 2^56, which the conversion to
        // int64 gives exactly, sign included (one F2I in place of the 64-bit shift and negation)
        limb = (int)(k >> 5);
        v = __float2ll_rz(__uint_as_float(bits + ((149u - 32u * (k >> 5)) << 23)));
        return true;
    }
    if (k == 254u) {  // inf or NaN: no exact sum exists
        flags |= 1;
        return false;
    }
    const long long m = (long long)(bits & 0x7fffffu);  // zero or subnormal: m 2^-149, limb 0
    if (m == 0) return false;
    v = (bits >> 31) ? -m : m;
    limb = 0;
    return true;
}

// float32 term f into cache c, which goes out to the output at g (limb l at g[l * gstride]) by integer atomics when
// the term lands in another pair (ADALN_EXACT_CACHE 2's add; exact_row_windows.cu's fixups)
__device__ __forceinline__ void cache_term(ExactCache& c, unsigned long long* g, size_t gstride, float f, int& flags) {
    long long v;
    int limb;
    if (!exact_split(f, flags, v, limb)) return;
    if (limb != c.k) {
        cache_out(c, g, gstride);
        c.k = limb;
    }
    c.lo += v & 0xffffffffLL;
    c.hi += v >> 32;
}

// add float32 term f exactly to the state whose limb l sits at st[l * stride] (slots of one thread), through its
// cache c (ADALN_EXACT_CACHE 2: to the output at g through c)
__device__ __forceinline__ void exact_add(ExactCache& c, long long* st, int stride, unsigned long long* g,
                                          size_t gstride, float f, int& flags) {
#if ADALN_EXACT_CACHE == 2
    cache_term(c, g, gstride, f, flags);
#else
    long long v;
    int limb;
    if (!exact_split(f, flags, v, limb)) return;
#if ADALN_EXACT_CACHE
    if (limb != c.k) {
        cache_spill(c, st, stride);
        c.k = limb;
    }
    c.lo += v & 0xffffffffLL;
    c.hi += v >> 32;
#else
    long long* at = st + limb * stride;
    at[0] += v & 0xffffffffLL;
    at[stride] += v >> 32;
#endif
#endif
}

__device__ __forceinline__ void exact_flush(long long* st, int stride, unsigned long long* out, size_t out_stride) {
#pragma unroll 1
    for (int l = 0; l < ADALN_EXACT_LIMBS; ++l) {
        const long long v = st[l * stride];
        if (v != 0) {
            atomicAdd(out + l * out_stride, (unsigned long long)v);  // two's complement: a signed integer addition
            st[l * stride] = 0;
        }
    }
}

// Table row t's sums of this thread's two columns (h, h + 1), caches and states, added to table_limbs and cleared
__device__ __forceinline__ void send_table_row(ExactCache (&cache)[2][2], long long* mine, int stride,
                                               unsigned long long* table_limbs, int t, int h) {
    const size_t table_size = (size_t)ADALN_T * 2 * ADALN_H;  // one limb of table_limbs
#pragma unroll
    for (int c = 0; c < 2; ++c) {
        unsigned long long* row = table_limbs + (size_t)t * 2 * ADALN_H + h + c;
#pragma unroll
        for (int q = 0; q < 2; ++q) {
#if ADALN_EXACT_CACHE == 2
            cache_out(cache[q][c], row + q * ADALN_H, table_size);
#else
            cache_spill(cache[q][c], mine + (q * 2 + c) * ADALN_EXACT_THREADS, stride);
            exact_flush(mine + (q * 2 + c) * ADALN_EXACT_THREADS, stride, row + q * ADALN_H, table_size);
#endif
        }
    }
}

extern "C" __global__ void __launch_bounds__(ADALN_EXACT_THREADS)
exact_sums_bf16(const bf16_t* __restrict__ x, const bf16_t* __restrict__ dy, const float* __restrict__ rstd,
                const index_t* __restrict__ timestep_indices, const int* __restrict__ row_order,
                unsigned long long* __restrict__ table_limbs, int* __restrict__ flags, int rows, int S,
                int rows_per_chunk) {
    extern __shared__ long long exact_smem[];  // [LIMBS][EXACT_SLOTS][threads]
    const int stride = EXACT_SLOTS * ADALN_EXACT_THREADS;  // from one limb to the next of one state
    long long* const mine = exact_smem + threadIdx.x;
#if ADALN_EXACT_CACHE != 2
    for (int i = 0; i < ADALN_EXACT_LIMBS * EXACT_SLOTS; ++i) mine[i * ADALN_EXACT_THREADS] = 0;
#endif
    const int h = 2 * (blockIdx.x * ADALN_EXACT_THREADS + threadIdx.x);
    const bool valid = h < ADALN_H;
    int bad = 0;
    const size_t table_size = (size_t)ADALN_T * 2 * ADALN_H;  // one limb of table_limbs
    const int r0 = blockIdx.y * rows_per_chunk;
    const int r1 = min(rows, r0 + rows_per_chunk);
    int current = -1;  // the table row whose sums the states hold
    ExactCache cache[2][2];  // (sum, column)
#pragma unroll
    for (int q = 0; q < 2; ++q) {
#pragma unroll
        for (int c = 0; c < 2; ++c) cache[q][c] = ExactCache{-1, 0, 0};
    }
    for (int base = r0; base < r1; base += ADALN_EXACT_AHEAD) {
        unsigned xs[ADALN_EXACT_AHEAD], ds[ADALN_EXACT_AHEAD];
        float rs[ADALN_EXACT_AHEAD];
        int ts[ADALN_EXACT_AHEAD];
#pragma unroll
        for (int j = 0; j < ADALN_EXACT_AHEAD; ++j) {
            const bool here = base + j < r1;
            const int r = here ? row_order[base + j] : 0;
            const index_t ti = here ? timestep_indices[r % S] : -1;
            ts[j] = (ti < 0 || ti >= ADALN_T) ? -1 : (int)ti;  // the int64 index checked before it narrows
            rs[j] = here ? rstd[r] : 0.0f;
            const bool load = here && valid;
            xs[j] = load ? *reinterpret_cast<const unsigned*>(x + (size_t)r * ADALN_H + h) : 0u;
            ds[j] = load ? *reinterpret_cast<const unsigned*>(dy + (size_t)r * ADALN_H + h) : 0u;
        }
#pragma unroll
        for (int j = 0; j < ADALN_EXACT_AHEAD; ++j) {
            if (base + j >= r1) break;
            const int t = ts[j];
            if (t < 0) {  // outside [0, T): the row left out, the flag set
                bad |= 2;
                continue;
            }
            if (t != current) {
                if (current >= 0 && valid) send_table_row(cache, mine, stride, table_limbs, current, h);
                current = t;
            }
            if (!valid) continue;
            const float xv[2] = {__uint_as_float(xs[j] << 16), __uint_as_float(xs[j] & 0xffff0000u)};
            const float dv[2] = {__uint_as_float(ds[j] << 16), __uint_as_float(ds[j] & 0xffff0000u)};
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const float p = __fmul_rn(dv[c], __fmul_rn(xv[c], rs[j]));
                unsigned long long* row = table_limbs + (size_t)t * 2 * ADALN_H + h + c;
                exact_add(cache[0][c], mine + (0 * 2 + c) * ADALN_EXACT_THREADS, stride, row, table_size, dv[c], bad);
                exact_add(cache[1][c], mine + (1 * 2 + c) * ADALN_EXACT_THREADS, stride, row + ADALN_H, table_size,
                          p, bad);
            }
        }
    }
    if (valid && current >= 0) send_table_row(cache, mine, stride, table_limbs, current, h);
    if (bad) atomicOr(flags, bad);
}
