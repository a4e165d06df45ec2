// Based's four kernels (ssd.cu's chunk states, state passing and float32-output chunk scan for
// the linear branch, as src/sequence_mixers/based_cuda.rs launches them, then based.cu's window
// branch) emulated on the CPU (cuda_shim.h) against the float64 recurrence: o_t = scale (S_t q_t) + the softmax of
// scale q_t . k_s over s in [max(0, t - W + 1), t] applied to those v_s, with
// S_t = S_{t-1} + v_t k_t^T from a given S_0; outputs and final state, on shapes with partial
// chunks and tiles, one step, K != V, and windows of 1, 5, 64, 65 and 200 steps. Each argument
// is one case, "B,T,H,K,V,W,STATE_BYTES,SCAN_BYTES,WINDOW_BYTES": the shape and the chunk-state,
// chunk-scan and window kernels' dynamic shared memory as the host computes it
// (tests/kernels_emulate.rs passes src/sequence_mixers/based_cuda.rs's shared_bytes and
// window_shared_bytes). Prints one line
// per case, then ALL OK or FAILED.
#include "cuda_shim.h"
#include <cstdio>
#include <random>
#include "prelude.cuh"
#include "ssd.cu"
#include "based.cu"
int main(int argc, char** argv) {
    int fails = argc < 2;
    struct Sh { int B, T, H, K, V, W; size_t state_bytes, scan_bytes, window_bytes; };
    for (int arg = 1; arg < argc; ++arg) {
        Sh s{};
        if (std::sscanf(argv[arg], "%d,%d,%d,%d,%d,%d,%zu,%zu,%zu", &s.B, &s.T, &s.H, &s.K, &s.V,
                        &s.W, &s.state_bytes, &s.scan_bytes, &s.window_bytes) != 9) {
            std::printf("bad case %s\n", argv[arg]);
            ++fails;
            continue;
        }
        std::mt19937 rng(3); std::normal_distribution<float> nd;
        int B = s.B, T = s.T, H = s.H, K = s.K, V = s.V, W = s.W; float scale = 1.f / std::sqrt((float)K);
        std::vector<float> q(B*T*H*K), k(B*T*H*K), v(B*T*H*V), init(B*H*V*K), lin(B*T*H*V, NAN), fin(B*H*V*K, NAN), o(B*T*H*V, NAN);
        for (auto* a : {&q, &k, &v, &init}) for (auto& x : *a) x = nd(rng);
        const int nc = (T + SSD_CHUNK - 1) / SSD_CHUNK;
        std::vector<float> ones(B*T*H, 1.f), zeros(H, 0.f), states(B*H*nc*V*K, NAN), cld(B*H*nc, NAN);
        dim3 grid{(unsigned)nc, (unsigned)H, (unsigned)B};
        launch(grid, SSD_THREADS, [&] { chunk_state<float>(v.data(), ones.data(), zeros.data(), k.data(), states.data(), cld.data(), T, H, H, V, K); }, s.state_bytes / 4);
        launch(dim3{(unsigned)H, (unsigned)B, (unsigned)((V * K + SSD_THREADS - 1) / SSD_THREADS)}, SSD_THREADS, [&] { ssd_state_passing(states.data(), cld.data(), init.data(), 1, fin.data(), H, nc, V, K); });
        launch(grid, SSD_THREADS, [&] { chunk_scan<float, float>(v.data(), ones.data(), zeros.data(), k.data(), q.data(), zeros.data(), 0, states.data(), lin.data(), T, H, H, V, K); }, s.scan_bytes / 4);
        launch(dim3{(unsigned)((T + 63) / 64), (unsigned)H, (unsigned)B}, BASED_THREADS, [&] { window_branch<float>(q.data(), k.data(), v.data(), scale, lin.data(), scale, o.data(), T, H, K, V, W); }, s.window_bytes / 4);
        double num = 0, den = 0, fnum = 0, fden = 0;
        for (int b = 0; b < B; ++b) for (int h = 0; h < H; ++h) {
            std::vector<double> S(V*K); for (int e = 0; e < V*K; ++e) S[e] = init[(b*H+h)*V*K+e];
            for (int t = 0; t < T; ++t) {
                long long r = ((long long)b*T + t)*H + h;
                for (int p = 0; p < V; ++p) for (int n = 0; n < K; ++n) S[p*K+n] += (double)v[r*V+p] * k[r*K+n];
                int first = std::max(0, t - W + 1);
                std::vector<double> w(t - first + 1); double top = -INFINITY, total = 0;
                for (int u = first; u <= t; ++u) {
                    long long ru = ((long long)b*T + u)*H + h; double d = 0;
                    for (int n = 0; n < K; ++n) d += (double)q[r*K+n] * k[ru*K+n];
                    w[u - first] = scale * d; top = std::max(top, w[u - first]);
                }
                for (auto& x : w) { x = std::exp(x - top); total += x; }
                for (int p = 0; p < V; ++p) {
                    double acc = 0; for (int n = 0; n < K; ++n) acc += S[p*K+n] * q[r*K+n];
                    acc *= scale;
                    for (int u = first; u <= t; ++u) acc += w[u - first] / total * v[(((long long)b*T + u)*H + h)*V + p];
                    double got = o[r*V+p];
                    num += (got-acc)*(got-acc); den += acc*acc; if (!std::isfinite(got)) num = INFINITY;
                }
            }
            for (int e = 0; e < V*K; ++e) { double got = fin[(b*H+h)*V*K+e]; fnum += (got-S[e])*(got-S[e]); fden += S[e]*S[e]; if (!std::isfinite(got)) fnum = INFINITY; }
        }
        double e1 = std::sqrt(num/den), e2 = std::sqrt(fnum/fden);
        std::printf("based B%d T%d H%d K%d V%d W%d: o %.3g final %.3g\n", B, T, H, K, V, W, e1, e2);
        if (!(e1 < 1e-5 && e2 < 1e-5) || g_overrun) ++fails;
    }
    std::printf(fails ? "FAILED\n" : "ALL OK\n");
    return fails != 0;
}
