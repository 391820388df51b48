// exact_row_windows.cu: the exact row passes' two column sums kept as float64 windows checked when they close
// (DoubleRowSums, TUNING's EXACT_ROW_DOUBLE 1; exact_row_pass.cu's ExactRowSums, int64 windows, with 0), a gated
// residual's gate sums likewise (DoubleGateSums: A's windows alone, its terms dout y), and the fixup kernels that add
// the terms of a window the check refused one by one. Comes after exact_sums.cu (its exact_split and ExactCache) and
// before exact_row_pass.cu (whose kernels take either struct).
//
// A window: one (sum, column) of a table row's pass over a block's rows (norm_out's pass of table row t, a sorted
// pass's run of table row t), opened by begin(t) and closed by store(). The terms are ExactRowSums' (A: p = dy xhat
// rounded once to float32; B: dy, a bf16 number in a float32), each widened exactly to float64 (cvt.f64.f32 without
// .ftz: a subnormal term is kept, as exact_split keeps it).
//   A: two float64 sums of the terms in row order, one rounded down at each addition (lo), one up (hi). lo <= the
//      exact partial sum <= hi at every step, and once an addition rounds they differ for good (lo below, hi above
//      the exact value from then on); so lo == hi, finite, at the close means the exact sum is lo.
//   B: one float64 sum rounded to nearest. A nonzero term of float32 exponent field E (E_ >= 1 below: E, or 1 for a
//      subnormal) is a multiple of 2^(E_ - 134) below 2^(E_ - 126) (8 significant bits); with Emin the least E_ of the
//      vector's nonzero terms (its 8 columns, the window's rows) and Emax the largest, every partial sum is a
//      multiple of 2^(Emin - 134) below n 2^(Emax - 126) (n rows), so it is a float64 when n 2^(Emax - Emin + 8) <=
//      2^53: each addition is then exact, and the sum too.
// A window that passes adds its sum (a multiple of 2^-149, the states' unit) to table_limbs (LIMBS, T, 2H) as up to
// three 32-bit pieces (double_limbs) with integer atomics: A at column H + h, B at h, as ExactRowSums. A window that
// fails (or a non-finite sum) goes to the fixup: an entry (block, table row, vector of 8 columns, the columns whose A
// and B failed) appended to `fixups` (capacity int4), counted at flags[1] (flags (2,) int32, zeroed by the caller);
// exact_fixup_*_bf16 then adds those windows' terms as exact_split's integers (`window_terms`), setting flag bit 0
// for a non-finite term as ExactRowSums does. The caller's capacity is every window's vectors up to 2^20
// (ops/row_sums.fixup_capacity); an entry with no room sets flag bit 2 (the op raises, never a wrong sum). Integer
// additions in any order: the states are ExactRowSums' integers, whatever passes, fails or lands where.
// Cost a term (the row loop): A one FMUL, one conversion, two DADD; B one conversion, one DADD and two min / max a
// term for the vector's exponents (ExactRowSums: about 14 integer instructions and an F2I a term). The windows take
// 48 registers a vector, so these passes keep 1 + scale in shared memory (norm_modulate_bwd.cu's SharedModulation,
// in the last stage's room: one row fewer in flight) and read the norm weight again each row.
// The closes' atomics (each window's sum in up to 3 pieces): a thread's 8 columns are adjacent, so a warp's atomic
// falls on columns 8 apart, one 32-byte sector a lane. norm_out's pass (row_pass: its pipeline drains before each
// close) with TUNING's EXACT_CLOSE_STAGED 1 lays each sum's passing windows out in its free stages (H doubles: the
// stages hold at least 3 rows of x and dy, 12H bytes) and sends them out a column a lane (close_staged): a warp's
// atomic on 32 adjacent columns, the same integers. A sorted pass's rows stay in flight at its closes: close_all.

#define EXACT_B_BITS 45  // 53 - 8: B's bound n 2^(Emax - Emin) <= 2^EXACT_B_BITS

__device__ __forceinline__ double widen(float f) {  // exact, a subnormal kept whatever -ftz says
    double d;
    asm("cvt.f64.f32 %0, %1;" : "=d"(d) : "f"(f));
    return d;
}

// The exact sum s (finite, nonzero, a multiple of 2^-149) added to the limbs at g (limb l at g[l * stride]): s =
// m 2^k units with m < 2^53, k >= 0, so |s| in units is m << k, up to three 32-bit pieces from limb k / 32 on.
__device__ __forceinline__ void double_limbs(double s, unsigned long long* g, size_t stride) {
    const unsigned long long bits = (unsigned long long)__double_as_longlong(s);
    const int be = (int)((bits >> 52) & 0x7ff);  // normal: s at least 2^-149
    unsigned long long m = (bits & 0xfffffffffffffull) | (1ull << 52);
    int k = be - 1075 + 149;  // m's last bit in units of 2^-149
    if (k < 0) {  // m's low -k bits are zero (s a multiple of the unit)
        m >>= -k;
        k = 0;
    }
    const int limb = k >> 5, shift = k & 31;
    const unsigned long long low = m << shift, high = shift ? m >> (64 - shift) : 0ull;
    const unsigned long long piece[3] = {low & 0xffffffffull, low >> 32, high};
    const bool negative = bits >> 63;
#pragma unroll
    for (int j = 0; j < 3; ++j)
        if (piece[j]) atomicAdd(g + (limb + j) * stride, negative ? 0ull - piece[j] : piece[j]);  // two's complement
}

// Where a window's rows and terms are: norm_out's row pass (row_order nullptr: block b's rows r0 + k, table row
// timestep_indices[r % S], a row of no table row in pass 0) or a sorted pass (positions p0 + k of row_order.cu's
// order, row and table row from sorted_row_at); the limbs' rows `width` wide, A at column width - H + h and B at h
// (the row passes: 2H; a gated residual's gate sums: H, A alone, x = y and no rstd: its term dout y).
struct WindowRows {
    const bf16_t* x;
    const bf16_t* dy;
    const float* rstd;     // or nullptr: xhat = x
    const index_t* index;  // timestep_indices or row_index (S,)
    const int* row_order;  // row_order.cu's row_offsets | order, or nullptr
    int S, rows, per_block, width;

    __device__ __forceinline__ int row(int b, int k, int t) const {  // position k's row if in table row t's window
        const long long p = (long long)b * per_block + k;
        if (row_order == nullptr) return in_pass(table_row(index, (int)p, S), t) ? (int)p : -1;  // fill_row_timesteps
        int code;
        const int r = sorted_row_at(p, index, row_order, row_order + ADALN_T + 1, S, S ? rows / S : 0, code);
        return sorted_table_row(code) == t ? r : -1;
    }
};

// The terms of one entry's refused windows (block b, table row t, vector v; the columns e with bit e of a_mask, A,
// or b_mask, B), exactly: positions lane, lane + lanes, ... of the block, as exact_split's integers into the limbs.
__device__ __forceinline__ void window_terms(const WindowRows& w, unsigned long long* table_limbs, int b, int t, int v,
                                             int a_mask, int b_mask, int lane, int lanes, int& bad) {
    const size_t limb = (size_t)ADALN_T * w.width;
    const int n = min(w.rows - b * w.per_block, w.per_block);
#pragma unroll 1
    for (int e = 0; e < ADALN_VEC; ++e) {
        const bool a = (a_mask >> e) & 1, s = (b_mask >> e) & 1;
        if (!a && !s) continue;
        const int h = v * ADALN_VEC + e;
        unsigned long long* g = table_limbs + (size_t)t * w.width + h;
        ExactCache ca{-1, 0, 0}, cb{-1, 0, 0};
#pragma unroll 1
        for (int k = lane; k < n; k += lanes) {
            const int r = w.row(b, k, t);
            if (r < 0) continue;
            const float dyv = bf16_to_float(w.dy[(size_t)r * ADALN_H + h]);
            const float xv = bf16_to_float(w.x[(size_t)r * ADALN_H + h]);
            const float xhat = w.rstd ? xv * w.rstd[r] : xv;  // reduce_row's (the gates' y as it is)
            if (a) cache_term(ca, g + w.width - ADALN_H, limb, __fmul_rn(dyv, xhat), bad);
            if (s) cache_term(cb, g, limb, dyv, bad);
        }
        cache_out(ca, g + w.width - ADALN_H, limb);
        cache_out(cb, g, limb);
    }
}

// Appends entry (block, table row t, vector v, refused columns) to the list, or flags bit 2 where it is full.
__device__ __forceinline__ void append_fixup(int4* fixups, int* flags, int capacity, int t, int v, int mask,
                                             int& bad) {
    const unsigned at = (unsigned)atomicAdd(flags + 1, 1);  // past 2^31: unsigned, still no room
    if (at < (unsigned)capacity)
        fixups[at] = make_int4(blockIdx.x, t, v, mask);
    else
        bad |= 4;  // no room: more windows refused than the list holds (the op raises)
}

struct DoubleRowSums {
    double lo[ADALN_BWD_VPT][ADALN_VEC], hi[ADALN_BWD_VPT][ADALN_VEC], sb[ADALN_BWD_VPT][ADALN_VEC];
    float b_max[ADALN_BWD_VPT];     // the vector's largest |dy|
    unsigned b_min[ADALN_BWD_VPT];  // the least of 2 bits(dy) - 1 (mod 2^32): the smallest nonzero |dy|, 0 -> ~0u
    unsigned long long* table_limbs;
    int4* fixups;
    int* flags;  // (2,): the flags, the entries appended
    double* staged;  // norm_out's pass: its stages, free at each close (close_staged), or nullptr
    int capacity, current, rows_since, bad;

    __device__ __forceinline__ void init(unsigned long long* limbs, int4* entries, int* flag_words, int cap) {
        table_limbs = limbs;
        fixups = entries;
        flags = flag_words;
        capacity = cap;
        staged = nullptr;
        bad = 0;
    }
    // row_pass's closes (its pipeline drained at each, every thread there) through the stages (TUNING's
    // EXACT_CLOSE_STAGED 1); a sorted pass's rows stay in flight at a close: never called there
    __device__ __forceinline__ void stage_closes(uint4* stages) {
        staged = ADALN_EXACT_CLOSE_STAGED ? reinterpret_cast<double*>(stages) : nullptr;
    }
    __device__ __forceinline__ void begin(int t) {
        current = t;
        rows_since = 0;
#pragma unroll
        for (int i = 0; i < ADALN_BWD_VPT; ++i) {
            b_max[i] = 0.0f;
            b_min[i] = ~0u;
#pragma unroll
            for (int e = 0; e < ADALN_VEC; ++e) lo[i][e] = hi[i][e] = sb[i][e] = 0.0;
        }
    }
    __device__ __forceinline__ void add(int i, int e, float dyv, float xhat) {
        if (i == 0 && e == 0) ++rows_since;
        const double p = widen(__fmul_rn(dyv, xhat)), d = widen(dyv);
        lo[i][e] = __dadd_rd(lo[i][e], p);
        hi[i][e] = __dadd_ru(hi[i][e], p);
        sb[i][e] = __dadd_rn(sb[i][e], d);
        b_max[i] = fmaxf(b_max[i], fabsf(dyv));
        b_min[i] = min(b_min[i], __float_as_uint(dyv) * 2u - 1u);
    }
    // B's bound for vector i over the window's rows (the header's n 2^(Emax - Emin + 8) <= 2^53)
    __device__ __forceinline__ bool b_exact(int i) const {
        const int emax = max((int)(__float_as_uint(b_max[i]) >> 23), 1);
        const int emin = max((int)((b_min[i] + 1u) >> 24), 1);
        const int d = emax - emin;
        return d <= EXACT_B_BITS && ((unsigned long long)rows_since << max(d, 0)) <= (1ull << EXACT_B_BITS);
    }
    __device__ __forceinline__ void close_all() {
        if (staged != nullptr) return close_staged();
        const size_t limb = (size_t)ADALN_T * 2 * ADALN_H;
#pragma unroll
        for (int i = 0; i < ADALN_BWD_VPT; ++i) {
            const int v = threadIdx.x + i * ADALN_BWD_THREADS;
            if (v >= ADALN_NVEC_H) continue;
            unsigned long long* g = table_limbs + (size_t)current * 2 * ADALN_H + v * ADALN_VEC;
            const bool any_b = b_min[i] != ~0u, b_ok = !any_b || b_exact(i);
            int a_mask = 0, b_mask = 0;
#pragma unroll
            for (int e = 0; e < ADALN_VEC; ++e) {
                if (lo[i][e] == hi[i][e] && isfinite(lo[i][e])) {
                    if (lo[i][e] != 0.0) double_limbs(lo[i][e], g + ADALN_H + e, limb);
                } else {
                    a_mask |= 1 << e;
                }
                if (b_ok && isfinite(sb[i][e])) {
                    if (sb[i][e] != 0.0) double_limbs(sb[i][e], g + e, limb);
                } else {
                    b_mask |= 1 << e;
                }
            }
            if (a_mask | b_mask) append_fixup(fixups, flags, capacity, current, v, a_mask | (b_mask << 8), bad);
        }
        rows_since = 0;
    }
    // close_all's windows, checked by their owners, then each sum's passing windows through `staged` (H doubles, a
    // refused or zero window 0) so that a warp's atomics fall on 32 consecutive columns (close_all's fall 8 apart)
    __device__ __forceinline__ void close_staged() {
        const size_t limb = (size_t)ADALN_T * 2 * ADALN_H;
        unsigned long long* g = table_limbs + (size_t)current * 2 * ADALN_H;
        const int v = threadIdx.x;  // one vector a thread (plan.exact_row_double)
        int a_mask = 0, b_mask = 0;
        if (v < ADALN_NVEC_H) {
            const bool b_ok = b_min[0] == ~0u || b_exact(0);
#pragma unroll
            for (int e = 0; e < ADALN_VEC; ++e) {
                if (!(lo[0][e] == hi[0][e] && isfinite(lo[0][e]))) a_mask |= 1 << e;
                if (!(b_ok && isfinite(sb[0][e]))) b_mask |= 1 << e;
            }
            if (a_mask | b_mask) append_fixup(fixups, flags, capacity, current, v, a_mask | (b_mask << 8), bad);
        }
#pragma unroll 1
        for (int q = 0; q < 2; ++q) {  // A to columns H + h, then B to h
            __syncthreads();  // q 0: the pass's last reads of the stages done; q 1: A's reads of `staged` done
            if (v < ADALN_NVEC_H)
#pragma unroll
                for (int e = 0; e < ADALN_VEC; ++e)
                    staged[v * ADALN_VEC + e] = ((q ? b_mask : a_mask) >> e) & 1 ? 0.0 : (q ? sb[0][e] : lo[0][e]);
            __syncthreads();
            for (int h = threadIdx.x; h < ADALN_H; h += ADALN_BWD_THREADS) {
                const double s = staged[h];
                if (s != 0.0) double_limbs(s, g + (q ? 0 : ADALN_H) + h, limb);
            }
        }
        __syncthreads();  // B's reads done before the next pass's modulation and rows land in the stages
        rows_since = 0;
    }
    __device__ __forceinline__ void poison() { bad |= 2; }
    __device__ __forceinline__ float* slot(float*, size_t) const { return nullptr; }  // no partials
    __device__ __forceinline__ void store_none(float*) const {}
    __device__ __forceinline__ void store(float*, int) { close_all(); }
};

// exact_row_pass.cu's ExactGateSums (a gated residual's sums of dout y a table row, a thread's 8 columns c * 8 + e,
// table_limbs (LIMBS, R, H)) as DoubleRowSums' A windows: two float64 sums a column, rounded down and up, closed when
// the rows leave a table row; a refused column goes to exact_fixup_gates_bf16. A row of no table row sets flag bit 1
// and adds nothing, as ExactGateSums (the fixup would add its terms: the op raises on bit 1 either way).
struct DoubleGateSums {
    double lo[ADALN_VEC], hi[ADALN_VEC];
    unsigned long long* table_limbs;
    int4* fixups;
    int* flags;
    int capacity, current, bad, c;

    __device__ __forceinline__ void init(unsigned long long* limbs, int4* entries, int* flag_words, int cap,
                                         int column) {
        table_limbs = limbs;
        fixups = entries;
        flags = flag_words;
        capacity = cap;
        c = column;
        bad = 0;
    }
    __device__ __forceinline__ void begin(int t) {
        current = t;
#pragma unroll
        for (int e = 0; e < ADALN_VEC; ++e) lo[e] = hi[e] = 0.0;
    }
    __device__ __forceinline__ void add(int ts, const float dyv[ADALN_VEC], const float yv[ADALN_VEC]) {
        if (ts < 0) {
            bad |= 2;
            return;
        }
#pragma unroll
        for (int e = 0; e < ADALN_VEC; ++e) {
            const double p = widen(__fmul_rn(dyv[e], yv[e]));
            lo[e] = __dadd_rd(lo[e], p);
            hi[e] = __dadd_ru(hi[e], p);
        }
    }
    __device__ __forceinline__ void store(int) {
        const size_t limb = (size_t)ADALN_T * ADALN_H;
        unsigned long long* g = table_limbs + (size_t)current * ADALN_H + c * ADALN_VEC;
        int mask = 0;
#pragma unroll
        for (int e = 0; e < ADALN_VEC; ++e) {
            if (lo[e] == hi[e] && isfinite(lo[e])) {
                if (lo[e] != 0.0) double_limbs(lo[e], g + e, limb);
            } else {
                mask |= 1 << e;
            }
        }
        if (mask) append_fixup(fixups, flags, capacity, current, c, mask, bad);
    }
};

// The entries appended by a pass (flags[1] of them, at most `capacity` in fixups), one warp an entry: the windows'
// terms added exactly (window_terms, lanes over the block's positions). Any grid: integer additions.
__device__ __forceinline__ void fixup_entries(const WindowRows& w, const int4* fixups, int* flags,
                                              unsigned long long* table_limbs, int capacity) {
    const int count = (int)min((unsigned)flags[1], (unsigned)capacity);
    const int warps = gridDim.x * (blockDim.x / 32), lane = threadIdx.x & 31;
    int bad = 0;
    for (int j = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; j < count; j += warps) {
        const int4 f = fixups[j];
        window_terms(w, table_limbs, f.x, f.y, f.z, f.w & 0xff, f.w >> 8, lane, 32, bad);
    }
    if (bad) atomicOr(flags, bad);
}

// norm_out's pass (norm_modulate_bwd_exact_bf16's entries). Run: ops/final_adaln_out/exact.launch_row_sums.
extern "C" __global__ void exact_fixup_rows_bf16(const bf16_t* __restrict__ x, const bf16_t* __restrict__ dy,
                                                 const float* __restrict__ rstd,
                                                 const index_t* __restrict__ timestep_indices,
                                                 const int4* __restrict__ fixups, int* __restrict__ flags,
                                                 unsigned long long* __restrict__ table_limbs, int S, int rows,
                                                 int rows_per_block, int capacity) {
    const WindowRows w{x, dy, rstd, timestep_indices, nullptr, S, rows, rows_per_block, 2 * ADALN_H};
    fixup_entries(w, fixups, flags, table_limbs, capacity);
}

// A block's sorted passes (norm_modulate_bwd_(residual_)sorted_exact_bf16's entries). Run:
// ops/row_sums.launch_sorted_row_sums.
extern "C" __global__ void exact_fixup_sorted_bf16(const bf16_t* __restrict__ x, const bf16_t* __restrict__ dy,
                                                   const float* __restrict__ rstd,
                                                   const index_t* __restrict__ row_index,
                                                   const int* __restrict__ row_order,
                                                   const int4* __restrict__ fixups, int* __restrict__ flags,
                                                   unsigned long long* __restrict__ table_limbs, int S, int rows,
                                                   int rows_per_block, int capacity) {
    const WindowRows w{x, dy, rstd, row_index, row_order, S, rows, rows_per_block, 2 * ADALN_H};
    fixup_entries(w, fixups, flags, table_limbs, capacity);
}

// A block's gated residual pass (gated_residual_bwd_sorted_exact_bf16's entries: DoubleGateSums). Run:
// ops/gated_residual/launch.backward_exact.
extern "C" __global__ void exact_fixup_gates_bf16(const bf16_t* __restrict__ dout, const bf16_t* __restrict__ y,
                                                  const index_t* __restrict__ row_index,
                                                  const int* __restrict__ row_order,
                                                  const int4* __restrict__ fixups, int* __restrict__ flags,
                                                  unsigned long long* __restrict__ table_limbs, int S, int rows,
                                                  int rows_per_block, int capacity) {
    const WindowRows w{y, dout, nullptr, row_index, row_order, S, rows, rows_per_block, ADALN_H};
    fixup_entries(w, fixups, flags, table_limbs, capacity);
}
