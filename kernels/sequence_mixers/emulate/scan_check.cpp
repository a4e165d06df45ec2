// The selective scan's kernel (scan.cu) emulated on the CPU (cuda_shim.h) against the float64
// recurrence h_t = exp(dt_t A) h_{t-1} + dt_t u_t B_t, y_t = <C_t, h_t> + D u_t, from a given
// initial state: outputs and final state, for each states-per-lane variant, lengths shorter
// than, equal to and not a multiple of the prefetch group, channels not a multiple of the
// block's warps. Each argument is one case "B,T,D,N" (the host picks the states per lane from
// N as scan_cuda::states_per_lane does: 1, 2, 4 or 8 for N up to 32, 64, 128, 256). Prints one
// line per case, then ALL OK or FAILED.
#include "cuda_shim.h"
#include <cstdio>
#include <random>
#include "prelude.cuh"
#include "scan.cu"

template <int S>
void run(const float* u, const float* dt, const float* A, const float* Bm, const float* Cm,
         const float* D, const float* init, float* y, float* fin, int B, int T, int Dc, int N) {
    launch(dim3{(unsigned)((Dc + SCAN_WARPS - 1) / SCAN_WARPS), (unsigned)B, 1}, SCAN_THREADS,
           [&] { scan_fwd<float, S>(u, dt, A, Bm, Cm, D, 1, init, 1, y, fin, T, Dc, N); });
}

int main(int argc, char** argv) {
    int fails = argc < 2;
    for (int arg = 1; arg < argc; ++arg) {
        int B, T, Dc, N;
        if (std::sscanf(argv[arg], "%d,%d,%d,%d", &B, &T, &Dc, &N) != 4) {
            std::printf("bad case %s\n", argv[arg]);
            ++fails;
            continue;
        }
        std::mt19937 rng(2); std::normal_distribution<float> nd; std::uniform_real_distribution<float> ud(0.01f, 0.5f);
        std::vector<float> u(B*T*Dc), dt(B*T*Dc), A(Dc*N), Bm(B*T*N), Cm(B*T*N), D(Dc), init(B*Dc*N);
        std::vector<float> y(B*T*Dc, NAN), fin(B*Dc*N, NAN);
        for (auto& v : u) v = nd(rng); for (auto& v : dt) v = ud(rng); for (auto& v : A) v = -ud(rng) * 4;
        for (auto& v : Bm) v = nd(rng); for (auto& v : Cm) v = nd(rng); for (auto& v : D) v = nd(rng);
        for (auto& v : init) v = nd(rng);
        const int S = N <= 32 ? 1 : N <= 64 ? 2 : N <= 128 ? 4 : 8;
        auto go = [&](auto f) { f(u.data(), dt.data(), A.data(), Bm.data(), Cm.data(), D.data(), init.data(), y.data(), fin.data(), B, T, Dc, N); };
        if (S == 1) go(run<1>); else if (S == 2) go(run<2>); else if (S == 4) go(run<4>); else go(run<8>);
        double num = 0, den = 0, fnum = 0, fden = 0;
        for (int b = 0; b < B; ++b) for (int d = 0; d < Dc; ++d) {
            std::vector<double> h(N); for (int n = 0; n < N; ++n) h[n] = init[(b*Dc+d)*N+n];
            for (int t = 0; t < T; ++t) {
                const long long i = ((long long)b*T + t)*Dc + d, r = (long long)b*T + t;
                double acc = 0;
                for (int n = 0; n < N; ++n) {
                    h[n] = std::exp((double)dt[i] * A[d*N+n]) * h[n] + (double)dt[i] * u[i] * Bm[r*N+n];
                    acc += Cm[r*N+n] * h[n];
                }
                acc += D[d] * (double)u[i];
                const double got = y[i]; num += (got-acc)*(got-acc); den += acc*acc;
                if (!std::isfinite(got)) num = INFINITY;
            }
            for (int n = 0; n < N; ++n) { const double got = fin[(b*Dc+d)*N+n]; fnum += (got-h[n])*(got-h[n]); fden += h[n]*h[n]; if (!std::isfinite(got)) fnum = INFINITY; }
        }
        const double e1 = std::sqrt(num/den), e2 = std::sqrt(fnum/fden);
        std::printf("selective scan B%d T%d D%d N%d (%d per lane): y %.3g final %.3g\n", B, T, Dc, N, S, e1, e2);
        if (!(e1 < 1e-5 && e2 < 1e-5) || g_overrun) ++fails;
    }
    std::printf(fails ? "FAILED\n" : "ALL OK\n");
    return fails != 0;
}
