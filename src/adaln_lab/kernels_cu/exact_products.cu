// exact_products.cu: ExactGradients.write's float64 products of the projection's gradient, the bits of the torch
// code (ops/modulation_table/exact.py: weight_grad) on every device (a NaN's bits aside: torch's own casts differ
// there between its vector and scalar loops).
//
// exact_weight_products_f32 / _bf16: out (rows, D), row-major, = rows r0 .. r0 + rows - 1 of d_weight (N, D):
//   element (n, d) = the float64 sum over u = 0 .. U - 1, in that order, of g[u, n] * act[u, d], each product and
//   each add rounded once (__dmul_rn, __dadd_rn: never a fused multiply-add), then cast as torch casts float64:
//   to float32 (round to nearest even, subnormals kept), and for bf16 on from that float32 to bf16 (torch's
//   round_to_nearest_even on the bits: NaN -> 0x7FC0). g (U, N) and act (U, D) are float64 (g: the float32
//   d_table widened by torch, exactly). One thread an element in a grid-stride loop over rows * D (row-major, so a
//   warp writes consecutive columns); the U values of g a row and act's U * D values stay in the caches.
//   The conversions are integer code or double-precision instructions: the unit's -ftz=true (float32 only) never
//   flushes a subnormal result here.
// Run: adaln_lab.ops.modulation_table.exact.weight_grad (launch_weight_products).

__device__ __forceinline__ unsigned int f32_bits_of_double(double v) {
    // float32 bits of v rounded to nearest even. Below FLT_MIN in magnitude: the subnormal (or FLT_MIN) by an
    // integer rounding of v * 2^149 (exact scaling; at most 2^23, so the bits are the pattern itself)
    const double a = fabs(v);
    const unsigned int sign = (unsigned int)(__double2hiint(v) >> 31) << 31;
    if (a < 1.1754943508222875e-38) {
        return sign | (unsigned int)__double2ll_rn(a * 7.1362384635297994e+44);  // 2^149
    }
    return __float_as_uint(__double2float_rn(v));  // a normal result (or inf / NaN): no flush
}

__device__ __forceinline__ void store_product(float* out, double v) { *out = __uint_as_float(f32_bits_of_double(v)); }

__device__ __forceinline__ void store_product(bf16_t* out, double v) {
    const unsigned int u = f32_bits_of_double(v);
    const bool nan = (u & 0x7F800000u) == 0x7F800000u && (u & 0x007FFFFFu);
    *out = nan ? (bf16_t)0x7FC0 : (bf16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

template <typename Out>
__device__ __forceinline__ void weight_products(const double* __restrict__ g, const double* __restrict__ act,
                                                Out* __restrict__ out, int U, int N, int D, int r0, int rows) {
    const index_t total = (index_t)rows * D;
    for (index_t i = (index_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (index_t)gridDim.x * blockDim.x) {
        const int r = (int)(i / D);
        const int d = (int)(i - (index_t)r * D);
        const int n = r0 + r;
        double acc = __dmul_rn(g[n], act[d]);
        for (int u = 1; u < U; ++u) {
            acc = __dadd_rn(acc, __dmul_rn(g[(index_t)u * N + n], act[(index_t)u * D + d]));
        }
        store_product(out + i, acc);
    }
}

extern "C" __global__ void __launch_bounds__(256) exact_weight_products_f32(
    const double* __restrict__ g, const double* __restrict__ act, float* __restrict__ out, int U, int N, int D,
    int r0, int rows) {
    weight_products(g, act, out, U, N, D, r0, rows);
}

extern "C" __global__ void __launch_bounds__(256) exact_weight_products_bf16(
    const double* __restrict__ g, const double* __restrict__ act, bf16_t* __restrict__ out, int U, int N, int D,
    int r0, int rows) {
    weight_products(g, act, out, U, N, D, r0, rows);
}
