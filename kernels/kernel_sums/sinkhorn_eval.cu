// The float64 evaluation of a Sinkhorn plan's rows on the device (src/kernel_sums/sinkhorn.rs,
// row_pass: the convergence check and the final evaluation of the transport cost, which the
// host did in float64 over all n x m pairs). For each row i of X against the points Z,
//     C_ij = |x_i - z_j|^2 / 2                  (float64 from the float32 coordinates)
//     l_i  = log sum_j exp(beta_j - C_ij / eps)
//     pc_i = sum_j p_ij C_ij,   p_ij = exp(beta_j - C_ij / eps - l_i)
//     wc_i = sum_j w_j C_ij     (0 when w is null)
// written to out[3 i], out[3 i + 1], out[3 i + 2]; a row whose every beta_j is -inf gets
// (-inf, 0, 0), as on the host. One warp per row: the lanes take j = lane, lane + 32, ...;
// a first pass takes the maximum of beta_j - C_ij / eps, a second the sums relative to it,
// each reduced over the warp by shuffles (so the float64 sums are added in another order than
// the host's, a difference of a few float64 ulps). Launch: 128 threads a block (4 rows),
// grid.x = ceil(n / 4). No headers (NVRTC): -inf is spelled with its bits.

#define SE_ROWS 4
#define SE_NEG_INF __longlong_as_double(0xfff0000000000000ll)

__device__ __forceinline__ double se_cost(const float* __restrict__ x,
                                          const float* __restrict__ z, int dim) {
    double c = 0.0;
    for (int a = 0; a < dim; ++a) {
        const double d = (double)x[a] - (double)z[a];
        c = fma(d, d, c);
    }
    return 0.5 * c;
}

extern "C" __global__ void __launch_bounds__(32 * SE_ROWS)
    sinkhorn_row_pass(const float* __restrict__ X, const float* __restrict__ Z,
                      const double* __restrict__ beta, const double* __restrict__ w,
                      long long n, long long m, int dim, double eps, double* __restrict__ out) {
    const long long i = (long long)blockIdx.x * SE_ROWS + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (i >= n) return;  // the whole warp: i is the same for its lanes
    const float* xi = X + i * dim;
    const double inv_eps = 1.0 / eps;
    double mx = SE_NEG_INF;
    for (long long j = lane; j < m; j += 32)
        mx = fmax(mx, beta[j] - se_cost(xi, Z + j * dim, dim) * inv_eps);
    for (int o = 16; o > 0; o >>= 1) mx = fmax(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    if (mx == SE_NEG_INF) {
        if (lane == 0) {
            out[3 * i] = SE_NEG_INF;
            out[3 * i + 1] = 0.0;
            out[3 * i + 2] = 0.0;
        }
        return;
    }
    double s = 0.0, sc = 0.0, wc = 0.0;
    for (long long j = lane; j < m; j += 32) {
        const double c = se_cost(xi, Z + j * dim, dim);
        const double e = exp(beta[j] - c * inv_eps - mx);
        s += e;
        sc = fma(e, c, sc);
        if (w != nullptr) wc = fma(w[j], c, wc);
    }
    for (int o = 16; o > 0; o >>= 1) {
        s += __shfl_xor_sync(0xffffffffu, s, o);
        sc += __shfl_xor_sync(0xffffffffu, sc, o);
        wc += __shfl_xor_sync(0xffffffffu, wc, o);
    }
    if (lane == 0) {
        out[3 * i] = mx + log(s);
        out[3 * i + 1] = sc / s;
        out[3 * i + 2] = wc;
    }
}
