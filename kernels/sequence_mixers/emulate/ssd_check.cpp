// SSD's three kernels (ssd.cu) emulated on the CPU (cuda_shim.h) against the float64
// recurrence h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T, y_t = C_t h_t + D x_t, from a given
// initial state: outputs and final state, shapes with partial chunks, groups, one step, and
// head_dim = state 128. Prints one line per shape, then ALL OK or FAILED.
#include "cuda_shim.h"
#include <cstdio>
#include <random>
#include "prelude.cuh"
#include "ssd.cu"
int main() {
    int fails = 0;
    struct Sh { int B, T, H, G, P, N; };
    for (Sh s : {Sh{1, 150, 2, 1, 16, 8}, Sh{2, 64, 4, 2, 32, 40}, Sh{1, 1, 2, 2, 8, 8}, Sh{1, 129, 2, 1, 64, 64}, Sh{1, 70, 1, 1, 128, 128}}) {
        std::mt19937 rng(1); std::normal_distribution<float> nd; std::uniform_real_distribution<float> ud(0.01f, 0.5f);
        int B = s.B, T = s.T, H = s.H, G = s.G, P = s.P, N = s.N, L = 64, nc = (T + L - 1) / L;
        std::vector<float> x(B*T*H*P), dt(B*T*H), A(H), Bm(B*T*G*N), Cm(B*T*G*N), D(H), y(B*T*H*P, NAN), init(B*H*P*N), fin(B*H*P*N, NAN);
        for (auto& v : x) v = nd(rng); for (auto& v : dt) v = ud(rng); for (auto& v : A) v = -ud(rng) * 4;
        for (auto& v : Bm) v = nd(rng); for (auto& v : Cm) v = nd(rng); for (auto& v : D) v = nd(rng); for (auto& v : init) v = nd(rng);
        std::vector<float> states(B*H*nc*P*N, NAN), cld(B*H*nc, NAN);
        launch(dim3{(unsigned)nc, (unsigned)H, (unsigned)B}, SSD_THREADS, [&] { chunk_state<float>(x.data(), dt.data(), A.data(), Bm.data(), states.data(), cld.data(), T, H, G, P, N); }, L*P + L*N + L);
        launch(dim3{(unsigned)H, (unsigned)B, 1}, SSD_THREADS, [&] { ssd_state_passing(states.data(), cld.data(), init.data(), 1, fin.data(), H, nc, P, N); });
        launch(dim3{(unsigned)nc, (unsigned)H, (unsigned)B}, SSD_THREADS, [&] { chunk_scan<float>(x.data(), dt.data(), A.data(), Bm.data(), Cm.data(), D.data(), 1, states.data(), y.data(), T, H, G, P, N); },
               /* the host's size: src/sequence_mixers/cuda.rs, shared_bytes */ L*N + (L + P)*(N + 1) + L*L + L*P + L);
        double num = 0, den = 0, fnum = 0, fden = 0;
        for (int b = 0; b < B; ++b) for (int h = 0; h < H; ++h) {
            int g = h / (H / G);
            std::vector<double> st(P*N); for (int e = 0; e < P*N; ++e) st[e] = init[(b*H+h)*P*N+e];
            for (int t = 0; t < T; ++t) {
                long long r = (long long)b*T + t; double d = dt[r*H+h], dec = std::exp(d * A[h]);
                for (int p = 0; p < P; ++p) {
                    double xv = x[(r*H+h)*P+p], acc = 0;
                    for (int n = 0; n < N; ++n) { double& v = st[p*N+n]; v = dec * v + d * xv * Bm[(r*G+g)*N+n]; acc += v * Cm[(r*G+g)*N+n]; }
                    acc += D[h] * xv;
                    double got = y[(r*H+h)*P+p]; num += (got-acc)*(got-acc); den += acc*acc;
                    if (!std::isfinite(got)) num = INFINITY;
                }
            }
            for (int e = 0; e < P*N; ++e) { double got = fin[(b*H+h)*P*N+e], w = st[e]; fnum += (got-w)*(got-w); fden += w*w; if (!std::isfinite(got)) fnum = INFINITY; }
        }
        double e1 = std::sqrt(num/den), e2 = std::sqrt(fnum/fden);
        std::printf("ssd B%d T%d H%d G%d P%d N%d: y %.3g final %.3g\n", B, T, H, G, P, N, e1, e2);
        if (!(e1 < 1e-5 && e2 < 1e-5) || g_overrun) ++fails;
    }
    std::printf(fails ? "FAILED\n" : "ALL OK\n");
    return fails != 0;
}
