// Based's linear-branch kernel (based.cu) emulated on the CPU (cuda_shim.h) against the float64
// recurrence lin_t = scale (S_t q_t), S_t = S_{t-1} + v_t k_t^T from a given S_0: outputs and
// final state, shapes with partial chunks, one step, K != V. The window kernel's warp
// shuffles are not emulated (it is unchanged by the padding this checks). Prints one line per
// shape, then ALL OK or FAILED.
#include "cuda_shim.h"
#include <cstdio>
#include <random>
#include "prelude.cuh"
#define __shfl_xor_sync(m, v, o) (v)
#define __syncwarp()
#include "based.cu"
int main() {
    int fails = 0;
    struct Sh { int B, T, H, K, V; };
    for (Sh s : {Sh{1, 150, 2, 16, 8}, Sh{2, 64, 2, 64, 32}, Sh{1, 1, 1, 8, 8}, Sh{1, 130, 1, 64, 64}, Sh{1, 70, 1, 40, 72}}) {
        std::mt19937 rng(3); std::normal_distribution<float> nd;
        int B = s.B, T = s.T, H = s.H, K = s.K, V = s.V; float scale = 1.f / std::sqrt((float)K);
        std::vector<float> q(B*T*H*K), k(B*T*H*K), v(B*T*H*V), init(B*H*V*K), lin(B*T*H*V, NAN), fin(B*H*V*K, NAN);
        for (auto* a : {&q, &k, &v, &init}) for (auto& x : *a) x = nd(rng);
        launch(dim3{(unsigned)H, (unsigned)B, 1}, BASED_THREADS, [&] { linear_branch<float>(q.data(), k.data(), v.data(), scale, init.data(), 1, lin.data(), fin.data(), T, H, K, V); },
               /* the host's size: src/sequence_mixers/based_cuda.rs, shared_bytes */ (V + 64)*(K + 1) + 64*K + 64*V + 64*64);
        double num = 0, den = 0, fnum = 0, fden = 0;
        for (int b = 0; b < B; ++b) for (int h = 0; h < H; ++h) {
            std::vector<double> S(V*K); for (int e = 0; e < V*K; ++e) S[e] = init[(b*H+h)*V*K+e];
            for (int t = 0; t < T; ++t) {
                long long r = ((long long)b*T + t)*H + h;
                for (int p = 0; p < V; ++p) for (int n = 0; n < K; ++n) S[p*K+n] += (double)v[r*V+p] * k[r*K+n];
                for (int p = 0; p < V; ++p) {
                    double acc = 0; for (int n = 0; n < K; ++n) acc += S[p*K+n] * q[r*K+n];
                    acc *= scale; double got = lin[r*V+p];
                    num += (got-acc)*(got-acc); den += acc*acc; if (!std::isfinite(got)) num = INFINITY;
                }
            }
            for (int e = 0; e < V*K; ++e) { double got = fin[(b*H+h)*V*K+e]; fnum += (got-S[e])*(got-S[e]); fden += S[e]*S[e]; if (!std::isfinite(got)) fnum = INFINITY; }
        }
        double e1 = std::sqrt(num/den), e2 = std::sqrt(fnum/fden);
        std::printf("based linear B%d T%d H%d K%d V%d: lin %.3g final %.3g\n", B, T, H, K, V, e1, e2);
        if (!(e1 < 1e-5 && e2 < 1e-5) || g_overrun) ++fails;
    }
    std::printf(fails ? "FAILED\n" : "ALL OK\n");
    return fails != 0;
}
