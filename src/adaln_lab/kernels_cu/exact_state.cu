// exact_state.cu: core/exact.py's ExactSum integer code on CUDA (the carries of the row passes' states, and
// ExactGradients.write's products and roundings): the same integers and the same roundings as the torch code, one
// thread an element of a state (L, n) int64, limb k of element i at k n + i, worth 2^(32 k + e_min).
//
// A state is carried when limbs 0 .. L - 2 lie in [0, 2^32) and the top limb holds the rest, signed: one form per
// integer, so any exact computation of an integer gives these limbs. L <= EXACT_STATE_LIMBS (a product state's
// 2 ADALN_EXACT_LIMBS).
//
// exact_carry: limbs (L, n), ExactSum._carry in place: from the lowest limb up, the carry v >> 32 (floor) joins the
//   next limb. Each limb below 2^62 in magnitude (the callers' bound) keeps every step inside int64.
// exact_products: core.exact.products: out (2L, n) carried = the integer of carried limbs (L, n) times float32
//   factors[i] as the integer factor 2^149 = |m| 2^shift (|m| < 2^24: the float's significand with its hidden bit,
//   shift its biased exponent less one; a subnormal: its fraction, shift 0). |n| as 32-bit words times |m| (each below
//   2^56), carried, moved up `shift` bits, the sign last (a negated magnitude, carried). Bits past the 2L limbs are
//   dropped, as the torch code drops them (none for a state within its bounds). Units 2^(2 e_min).
// exact_round: core.exact.rounded: out (n,) float64 = the integer N 2^e_min of carried limbs rounded once to
//   `precision` significant bits (float32's exponent range: the last kept bit at least 2^(-126 - precision + 1)), to
//   nearest, ties to even (the round bit and a sticky OR of every bit below it); inf past (2^precision - 1) 2^(128 -
//   precision); +0 for N = 0, -0 for a negative N that rounds to zero. The result has at most 25 significant bits, so
//   the float64 (ldexp) is exact.
// Run: adaln_lab.core.exact_kernels (ExactKernels).

#define EXACT_STATE_LIMBS (2 * ADALN_EXACT_LIMBS)
#define EXACT_STATE_WORDS (EXACT_STATE_LIMBS + 2)

// |N| of carried limbs as 32-bit words w[0 .. L] (the top limb's bits past 32 in w[L]); returns N < 0
__device__ __forceinline__ bool exact_magnitude(const long long* __restrict__ limbs, int L, int n, int i,
                                                unsigned long long* w) {
    const bool negative = limbs[(index_t)(L - 1) * n + i] < 0;
    long long carry = 0;
    for (int k = 0; k < L; ++k) {
        const long long limb = limbs[(index_t)k * n + i];
        long long v = (negative ? -limb : limb) + carry;
        if (k < L - 1) {
            carry = v >> 32;
            v -= carry * 4294967296LL;
            w[k] = (unsigned long long)v;
        } else {  // |N|'s top: v >= 0
            w[k] = (unsigned long long)v & 0xFFFFFFFFull;
            w[k + 1] = (unsigned long long)v >> 32;
        }
    }
    return negative;
}

__device__ __forceinline__ unsigned long long exact_word(const unsigned long long* w, int count, int j) {
    return (j >= 0 && j < count) ? w[j] : 0ull;
}

extern "C" __global__ void __launch_bounds__(256) exact_carry(long long* __restrict__ limbs, int L, int n) {
    const int i = blockIdx.x * 256 + threadIdx.x;
    if (i >= n) return;
    long long carry = 0;
    for (int k = 0; k < L; ++k) {
        long long v = limbs[(index_t)k * n + i] + carry;
        if (k < L - 1) {
            carry = v >> 32;
            v -= carry * 4294967296LL;
        }
        limbs[(index_t)k * n + i] = v;
    }
}

extern "C" __global__ void __launch_bounds__(256) exact_products(const long long* __restrict__ limbs,
                                                                 const float* __restrict__ factors,
                                                                 long long* __restrict__ out, int L, int n) {
    const int i = blockIdx.x * 256 + threadIdx.x;
    if (i >= n) return;
    unsigned long long w[EXACT_STATE_WORDS];
    const bool state_negative = exact_magnitude(limbs, L, n, i, w);
    const unsigned int bits = __float_as_uint(factors[i]);
    const unsigned int field = (bits >> 23) & 0xFFu;
    const unsigned long long m = field ? ((bits & 0x7FFFFFu) | 0x800000u) : (bits & 0x7FFFFFu);
    const int shift = field ? (int)field - 1 : 0;
    const bool negative = state_negative != ((bits >> 31) != 0u);  // a zero product is all zero limbs either way
    unsigned long long p[EXACT_STATE_WORDS];                         // |N| |m|: L + 2 words below 2^32
    unsigned long long carry = 0;
    for (int k = 0; k <= L; ++k) {
        const unsigned long long t = w[k] * m + carry;               // < 2^56 + 2^25
        p[k] = t & 0xFFFFFFFFull;
        carry = t >> 32;
    }
    p[L + 1] = carry;
    const int words = L + 2, step = shift >> 5, offset = shift & 31, wide = 2 * L;
    long long borrow = 0;
    for (int q = 0; q < wide; ++q) {  // word q of |N m| 2^shift, then negated where the product is negative
        unsigned long long word = exact_word(p, words, q - step) << offset;
        if (offset) word |= exact_word(p, words, q - step - 1) >> (32 - offset);
        long long v = (long long)(word & 0xFFFFFFFFull);
        if (negative) {
            v = -v + borrow;
            if (q < wide - 1) {
                borrow = v >> 32;
                v -= borrow * 4294967296LL;
            }
        }
        out[(index_t)q * n + i] = v;
    }
}

extern "C" __global__ void __launch_bounds__(256) exact_round(const long long* __restrict__ limbs,
                                                              double* __restrict__ out, int L, int n, int e_min,
                                                              int precision) {
    const int i = blockIdx.x * 256 + threadIdx.x;
    if (i >= n) return;
    unsigned long long w[EXACT_STATE_WORDS];
    const bool negative = exact_magnitude(limbs, L, n, i, w);
    const int words = L + 1;
    int lead = words - 1;
    while (lead >= 0 && w[lead] == 0ull) --lead;
    if (lead < 0) {
        out[i] = 0.0;
        return;
    }
    const int length = 32 * lead + (64 - __clzll((long long)w[lead]));  // |N|'s bit length
    const int top = length - 1 + e_min;                                  // the leading bit's exponent
    const int drop = max(max(top, -126) - (precision - 1) - e_min, 0);   // low bits of |N| below the last kept one
    const int j = drop >> 5, o = drop & 31;
    unsigned long long kept = exact_word(w, words, j) >> o;
    if (o) kept |= exact_word(w, words, j + 1) << (32 - o);  // |N| >> drop: below 2^precision
    if (drop > 0) {
        const int r = drop - 1, rj = r >> 5, ro = r & 31;
        const unsigned long long round_word = exact_word(w, words, rj);
        bool sticky = (round_word & ((1ull << ro) - 1ull)) != 0ull;
        for (int k = 0; k < rj && k < words; ++k) sticky |= w[k] != 0ull;
        if (((round_word >> ro) & 1ull) && (sticky || (kept & 1ull))) ++kept;
    }
    double value = ldexp((double)kept, drop + e_min);
    const double largest = ldexp((double)((1 << precision) - 1), 128 - precision);
    if (value > largest) value = __longlong_as_double(0x7FF0000000000000LL);  // inf
    out[i] = negative ? -value : value;
}
