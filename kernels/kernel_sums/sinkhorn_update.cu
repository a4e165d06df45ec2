// The epilogue of one half-step of Sinkhorn's iteration held on the device
// (src/kernel_sums/cuda.rs, DeviceSinkhorn): after the kernel log-sum-exp of this cloud's
// points against the other cloud's,
//     lse_i = log sum_j exp(h_j - |x_i - z_j|^2 / (2 eps))      (float32, kernel_lse_*),
// the soft-min potential and the weights this cloud gives the next log-sum-exp:
//     pot_i = -eps * lse_i                                       (float64)
//     h_i   = pot_i / eps + log w_i = log w_i - lse_i            (float32)
// the values the host path computes (src/kernel_sums/sinkhorn.rs, SoftMin::apply), up to
// float64 rounding. `copy`,
// when not null, receives pot as well (the runner's output buffer). One thread per point.

extern "C" __global__ void sinkhorn_update(const float* __restrict__ lse,
                                           const double* __restrict__ log_w,
                                           double neg_eps,
                                           double* __restrict__ pot,
                                           float* __restrict__ h,
                                           double* __restrict__ copy,
                                           long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    double l = (double)lse[i];
    double p = neg_eps * l;
    pot[i] = p;
    h[i] = (float)(log_w[i] - l);
    if (copy != nullptr) copy[i] = p;
}
