// gated_residual_norm.cu: an H3 block's first gated residual fused with its second modulated RMSNorm,
// one pass over the rows instead of two:
//   x_out[r] = bf16(x + bf16(bf16(gate[i]) * y))          (gated_residual.cu's forward, same roundings)
//   out[r], rstd[r] = norm_modulate_row(x_out[r])            (norm_modulate.cu's row-per-block body)
// with i = row_index[r % S] for both the gate and the norm's modulation (table: (R, 2H) bf16 shift |
// scale, as norm_modulate.cu; gate: (R, H) fp32 with row stride gate_stride floats, as gated_residual.cu).
// x_out is rounded to bf16 before the norm reads it, so every output has the bits of the two kernels
// run one after the other, and each row's reduction uses the forward's tree (block = ADALN_FWD_THREADS
// threads x ADALN_FWD_VPT vectors, from H alone). A row whose index lies outside [0, R) gets NaN in
// x_out and out. grid = rows (one row per block).
// The backward needs no kernel of its own: norm_modulate_bwd_residual_sorted_bf16 (the norm's dx plus the
// gradient that reached x_out through the residual), then gated_residual_bwd_sorted_bf16.
// Run: adaln_lab.ops.gated_residual_norm.launch.forward (route "cupy").

extern "C" __global__ void __launch_bounds__(ADALN_FWD_THREADS)
gated_residual_norm_bf16(const bf16_t* __restrict__ x, const float* __restrict__ gate, const bf16_t* __restrict__ y,
                         const index_t* __restrict__ row_index, const bf16_t* __restrict__ norm_weight,
                         const bf16_t* __restrict__ table, bf16_t* __restrict__ x_out, bf16_t* __restrict__ out,
                         float* __restrict__ rstd, int gate_stride, int S, float eps, int rows) {
    __shared__ float scratch[ADALN_FWD_THREADS / 32 + 1];
    const size_t row = blockIdx.x;
    const index_t t = row_index[row % (unsigned)S];
    const int i = (t < 0 || t >= ADALN_T) ? -1 : (int)t;
    const float* gate_row = gate + (size_t)(i < 0 ? 0 : i) * gate_stride;
    uint4 x_raw[ADALN_FWD_VPT], y_raw[ADALN_FWD_VPT];
#pragma unroll
    for (int k = 0; k < ADALN_FWD_VPT; ++k) {
        const int v = threadIdx.x + k * ADALN_FWD_THREADS;
        if (v < ADALN_NVEC_H) {
            x_raw[k] = load_raw8(x + row * ADALN_H + v * ADALN_VEC);
            y_raw[k] = load_raw8(y + row * ADALN_H + v * ADALN_VEC);
        }
    }
#pragma unroll
    for (int k = 0; k < ADALN_FWD_VPT; ++k) {
        const int v = threadIdx.x + k * ADALN_FWD_THREADS;
        if (v < ADALN_NVEC_H) {
            float xv[ADALN_VEC], yv[ADALN_VEC], g[ADALN_VEC], o[ADALN_VEC];
            unpack8(x_raw[k], xv);
            unpack8(y_raw[k], yv);
            load_gate8(gate_row + v * ADALN_VEC, g);
#pragma unroll
            for (int e = 0; e < ADALN_VEC; ++e) o[e] = i < 0 ? GR_NAN : xv[e] + round_bf16(g[e] * yv[e]);
            unsigned packed[4];
            pack8(o, packed);
            x_raw[k] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
            *reinterpret_cast<uint4*>(x_out + row * ADALN_H + v * ADALN_VEC) = x_raw[k];
        }
    }
    norm_modulate_row(x_raw, row, norm_weight, table, t, out, rstd, eps, scratch);
}
