// exact_products.cu: ExactGradients.write's float64 products of the projection's gradient, the bits of the torch
// code (ops/modulation_table/exact.py: weight_grad) on every device (a NaN's bits aside: torch's own casts differ
// there between its vector and scalar loops).
//
// exact_weight_products_f32 / _bf16: out (rows, D), row-major, = rows r0 .. r0 + rows - 1 of d_weight (N, D):
//   element (n, d) = the float64 sum over u = 0 .. U - 1, in that order, of g[u, n] * act[u, d], each product and
//   each add rounded once (__dmul_rn, __dadd_rn: never a fused multiply-add), then cast as torch casts float64:
//   to float32 (round to nearest even, subnormals kept), and for bf16 on from that float32 to bf16 (torch's
//   round_to_nearest_even on the bits: NaN -> 0x7FC0). g (U, N) and act (U, D) are float64 (g: the float32
//   d_table widened by torch, exactly). A thread holds one column d and WEIGHT_ROWS (8) rows' sums: it reads
//   act[u, d] once for all of them (a warp: consecutive columns), and g's values of those rows (the same for the
//   whole block: broadcast loads). Grid: x the blocks of 256 columns, y a stride loop over the tiles of rows.
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

#define WEIGHT_ROWS 8

template <typename Out>
__device__ __forceinline__ void weight_products(const double* __restrict__ g, const double* __restrict__ act,
                                                Out* __restrict__ out, int U, int N, int D, int r0, int rows) {
    const int d = blockIdx.x * blockDim.x + threadIdx.x;
    if (d >= D) return;
    for (int t = blockIdx.y * WEIGHT_ROWS; t < rows; t += gridDim.y * WEIGHT_ROWS) {
        const int m = min(WEIGHT_ROWS, rows - t);
        const double* g0 = g + r0 + t;
        double acc[WEIGHT_ROWS];
        const double a0 = act[d];
#pragma unroll
        for (int j = 0; j < WEIGHT_ROWS; ++j) acc[j] = j < m ? __dmul_rn(g0[j], a0) : 0.0;
        for (int u = 1; u < U; ++u) {
            const double a = act[(index_t)u * D + d];
            const double* gu = g0 + (index_t)u * N;
#pragma unroll
            for (int j = 0; j < WEIGHT_ROWS; ++j) {
                if (j < m) acc[j] = __dadd_rn(acc[j], __dmul_rn(gu[j], a));
            }
        }
#pragma unroll
        for (int j = 0; j < WEIGHT_ROWS; ++j) {
            if (j < m) store_product(out + (index_t)(t + j) * D + d, acc[j]);
        }
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

// exact_input_products_f32 / _bf16, then exact_input_fold: d_act (U, D) float64 = d_table weight, the bits of the
// torch code (ops/modulation_table/exact.py: input_grad): element (u, d) sums the N exact products g[u, n] w[n, d]
// (float64 from float32 times float32 or bf16: at most 48 significant bits, __dmul_rn exact) in one pairwise tree
// fixed by N: level sizes n_0 = N, n_(k+1) = ceil(n_k / 2); position j of level k + 1 is position j of level k plus
// (__dadd_rn) position j + n_(k+1) of level k where j < n_k - n_(k+1) (the upper half added onto the lower), else
// position j of level k (the odd middle row kept); the result is position 0 of the level of size 1.
// Each launch moves INPUT_FOLD (5) levels up: out (U, n', D) holds every position of the level 5 above its input
// level, one thread an element (d fastest: a warp reads consecutive columns), its subtree of at most 32 input
// positions evaluated by the template recursion below in the tree's order (levels past size 1 add nothing).
//   exact_input_products_*: the input level is the products (level 0: g (U, N) float64, w (N, D) row-major).
//   exact_input_fold: the input level is `in` (U, n, D), a previous launch's output.
// The caller launches products, then folds until the level has size 1: out[:, 0, :] is d_act.

#define INPUT_FOLD 5

__device__ __forceinline__ double widened(unsigned int bits) {
    // float32 bits as a float64, exactly: the unit's -ftz=true makes a float -> double conversion flush a subnormal
    // (cvt.ftz.f64.f32), so a subnormal (exponent field 0, zeros too) is its fraction times 2^-149 in integer code
    if ((bits & 0x7F800000u) == 0u) {
        const double m = (double)(bits & 0x007FFFFFu) * __longlong_as_double((long long)(1023 - 149) << 52);
        return (bits >> 31) ? -m : m;
    }
    return (double)__uint_as_float(bits);
}

__device__ __forceinline__ double weight_value(const float* w, index_t at) { return widened(__float_as_uint(w[at])); }
__device__ __forceinline__ double weight_value(const bf16_t* w, index_t at) {
    return widened((unsigned int)w[at] << 16);
}

template <typename W>
struct ProductLeaf {  // position j of level 0: the product g[j] w[j, d]
    const double* __restrict__ g;
    const W* __restrict__ w;
    int D, d;
    __device__ __forceinline__ double operator()(int j) const {
        return __dmul_rn(g[j], weight_value(w, (index_t)j * D + d));
    }
};

struct LevelLeaf {  // position j of a stored level (n, D)
    const double* __restrict__ level;
    int D, d;
    __device__ __forceinline__ double operator()(int j) const { return level[(index_t)j * D + d]; }
};

template <int K, typename Leaf>
struct InputFold {  // position j of level K above the leaves' (sizes[k]: level k's size)
    __device__ __forceinline__ static double at(const Leaf& leaf, const int* sizes, int j) {
        double v = InputFold<K - 1, Leaf>::at(leaf, sizes, j);
        if (j < sizes[K - 1] - sizes[K]) v = __dadd_rn(v, InputFold<K - 1, Leaf>::at(leaf, sizes, j + sizes[K]));
        return v;
    }
};

template <typename Leaf>
struct InputFold<0, Leaf> {
    __device__ __forceinline__ static double at(const Leaf& leaf, const int*, int j) { return leaf(j); }
};

template <typename Leaves>
__device__ __forceinline__ void fold_levels(double* __restrict__ out, int U, int n, int D, const Leaves& leaves) {
    int sizes[INPUT_FOLD + 1];
    sizes[0] = n;
#pragma unroll
    for (int k = 1; k <= INPUT_FOLD; ++k) sizes[k] = (sizes[k - 1] + 1) / 2;
    const int up = sizes[INPUT_FOLD];
    const index_t total = (index_t)U * up * D;
    for (index_t e = (index_t)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (index_t)gridDim.x * blockDim.x) {
        const int d = (int)(e % D);
        const index_t rest = e / D;
        out[e] = InputFold<INPUT_FOLD, decltype(leaves(0, 0))>::at(leaves((int)(rest / up), d), sizes,
                                                                   (int)(rest % up));
    }
}

template <typename W>
struct Products {  // the leaves of row u: its products
    const double* __restrict__ g;
    const W* __restrict__ w;
    int N, D;
    __device__ __forceinline__ ProductLeaf<W> operator()(int u, int d) const {
        return ProductLeaf<W>{g + (index_t)u * N, w, D, d};
    }
};

struct Level {  // the leaves of row u: its stored level
    const double* __restrict__ level;
    int n, D;
    __device__ __forceinline__ LevelLeaf operator()(int u, int d) const {
        return LevelLeaf{level + (index_t)u * n * D, D, d};
    }
};

extern "C" __global__ void __launch_bounds__(256) exact_input_products_f32(
    const double* __restrict__ g, const float* __restrict__ w, double* __restrict__ out, int U, int N, int D) {
    fold_levels(out, U, N, D, Products<float>{g, w, N, D});
}

extern "C" __global__ void __launch_bounds__(256) exact_input_products_bf16(
    const double* __restrict__ g, const bf16_t* __restrict__ w, double* __restrict__ out, int U, int N, int D) {
    fold_levels(out, U, N, D, Products<bf16_t>{g, w, N, D});
}

extern "C" __global__ void __launch_bounds__(256) exact_input_fold(const double* __restrict__ in,
                                                                   double* __restrict__ out, int U, int n, int D) {
    fold_levels(out, U, n, D, Level{in, n, D});
}
