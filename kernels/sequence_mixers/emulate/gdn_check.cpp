// The gated delta rule's three kernels (delta.cu: chunk preparation, state pass, chunk output)
// emulated on the CPU (cuda_shim.h) against the float64 recurrence
// S_t = a_t S_{t-1} (I - b_t k_t k_t^T) + b_t v_t k_t^T, o_t = S_t q_t, from a given initial
// state: outputs and final state, a gate of exactly 0 at step 5, shapes with partial chunks,
// one step, K != V, state rows not a multiple of GDN_ROWS, and K = V = 128. Each argument is one case,
// "B,T,H,K,V,PREP_BYTES,PASS_BYTES,OUT_BYTES": the shape and the kernels' dynamic shared memory
// as the host computes it (tests/kernels_emulate.rs passes
// src/sequence_mixers/delta_cuda.rs's shared_bytes). Prints one line per case, then ALL OK or
// FAILED.
#include "cuda_shim.h"
#include <cstdio>
#include <random>
#include "prelude.cuh"
#include "delta.cu"
int main(int argc, char** argv) {
    int fails = argc < 2;
    for (int arg = 1; arg < argc; ++arg) {
        int B, T, H, K, V;
        size_t prep, pass, out;
        if (std::sscanf(argv[arg], "%d,%d,%d,%d,%d,%zu,%zu,%zu", &B, &T, &H, &K, &V, &prep, &pass,
                        &out) != 8) {
            std::printf("bad case %s\n", argv[arg]);
            ++fails;
            continue;
        }
        std::mt19937 rng(3); std::normal_distribution<float> nd;
        std::uniform_real_distribution<float> ua(0.8f, 1.0f), ub(0.0f, 1.0f);
        const int L = GDN_CHUNK, nc = (T + L - 1) / L;
        std::vector<float> q(B*T*H*K), k(B*T*H*K), v(B*T*H*V), al(B*T*H), be(B*T*H), init(B*H*V*K);
        std::vector<float> o(B*T*H*V, NAN), fin(B*H*V*K, NAN);
        for (auto& x : q) x = nd(rng) / std::sqrt((float)K);
        for (int r = 0; r < B*T*H; ++r) {  // unit-norm keys, as the runner gives them
            double n2 = 0; for (int c = 0; c < K; ++c) { float x = nd(rng); k[r*K+c] = x; n2 += x*x; }
            for (int c = 0; c < K; ++c) k[r*K+c] /= std::sqrt(n2);
        }
        for (auto& x : v) x = nd(rng); for (auto& x : al) x = ua(rng); for (auto& x : be) x = ub(rng);
        for (auto& x : init) x = nd(rng) * 0.3f;
        if (al.size() > 5) al[5] = 0.f;  // a gate of exactly 0: the state is cleared
        std::vector<float> w((size_t)B*H*nc*L*K, NAN), u((size_t)B*H*nc*L*V, NAN), g((size_t)B*H*nc*L, NAN);
        std::vector<float> states((size_t)B*H*nc*V*K, NAN);
        const dim3 chunks{(unsigned)nc, (unsigned)H, (unsigned)B};
        launch(chunks, GDN_THREADS, [&] { gdn_prepare<float>(k.data(), v.data(), al.data(), be.data(), w.data(), u.data(), g.data(), T, H, K, V); }, prep / 4);
        launch(dim3{(unsigned)((V + GDN_ROWS - 1) / GDN_ROWS), (unsigned)H, (unsigned)B}, GDN_THREADS, [&] { gdn_state_pass<float>(k.data(), w.data(), u.data(), g.data(), init.data(), 1, states.data(), fin.data(), T, H, K, V, nc); }, pass / 4);
        launch(chunks, GDN_THREADS, [&] { gdn_output<float>(q.data(), k.data(), u.data(), g.data(), states.data(), o.data(), T, H, K, V); }, out / 4);
        double num = 0, den = 0, fnum = 0, fden = 0;
        for (int b = 0; b < B; ++b) for (int h = 0; h < H; ++h) {
            std::vector<double> S(V*K), sk(V);
            for (int e = 0; e < V*K; ++e) S[e] = init[(b*H+h)*V*K+e];
            for (int t = 0; t < T; ++t) {
                const long long r = ((long long)b*T + t)*H + h;
                const double a = al[r], bb = be[r];
                for (int i = 0; i < V; ++i) { double acc = 0; for (int c = 0; c < K; ++c) acc += S[i*K+c] * k[r*K+c]; sk[i] = acc; }
                for (int i = 0; i < V; ++i) {
                    const double uu = bb * (v[r*V+i] - a * sk[i]);
                    for (int c = 0; c < K; ++c) S[i*K+c] = a * S[i*K+c] + uu * k[r*K+c];
                }
                for (int i = 0; i < V; ++i) {
                    double acc = 0; for (int c = 0; c < K; ++c) acc += S[i*K+c] * q[r*K+c];
                    const double got = o[r*V+i];
                    num += (got-acc)*(got-acc); den += acc*acc;
                    if (!std::isfinite(got)) num = INFINITY;
                }
            }
            for (int e = 0; e < V*K; ++e) { double got = fin[(b*H+h)*V*K+e], want = S[e]; fnum += (got-want)*(got-want); fden += want*want; if (!std::isfinite(got)) fnum = INFINITY; }
        }
        const double e1 = std::sqrt(num/den), e2 = std::sqrt(fnum/fden);
        std::printf("gated delta B%d T%d H%d K%d V%d: o %.3g final %.3g\n", B, T, H, K, V, e1, e2);
        if (!(e1 < 1e-5 && e2 < 1e-5) || g_overrun) ++fails;
    }
    std::printf(fails ? "FAILED\n" : "ALL OK\n");
    return fails != 0;
}
