// Based's four kernels (ssd.cu's chunk states, state passing and float32-output chunk scan for
// the linear branch, as src/sequence_mixers/based_cuda.rs launches them, then based.cu's window
// branch) emulated on the CPU (cuda_shim.h) against the float64 recurrence: o_t = scale (S_t q_t) + the softmax of
// scale q_t . k_s over s in [max(0, t - W + 1), t] applied to those v_s, with
// S_t = S_{t-1} + v_t k_t^T from a given S_0; outputs and final state, on shapes with partial
// chunks and tiles, one step, K != V, and windows of 1, 5, 64, 65 and 200 steps. Each argument
// is one case, "B,T,H,K,V,W,STATE_BYTES,SCAN_BYTES,WINDOW_BYTES": the shape and the chunk-state,
// chunk-scan and window kernels' dynamic shared memory as the host computes it
// (tests/kernels_emulate.rs passes src/sequence_mixers/based_cuda.rs's shared_bytes and
// window_shared_bytes), and a tenth field, TC_WINDOW_BYTES: the tensor-core window kernel's
// (window_tc_shared_bytes; 0 where the host would not take it). Where it is given, the case
// runs a second time on the inputs rounded to bf16 with based_window_tc writing a bf16 O of the
// window branch alone (lin_scale 0, so that the linear branch's larger values do not hide its
// errors), against the window of the recurrence on the rounded values (bound 5e-3: the
// probabilities are rounded to bf16 for P V, and O itself). Prints one line per run, then ALL OK or FAILED.
#include "cuda_shim.h"
#include <cstdio>
#include <random>
#include "prelude.cuh"
#include "ssd.cu"
#include "based.cu"
int main(int argc, char** argv) {
    int fails = argc < 2;
    struct Sh { int B, T, H, K, V, W; size_t state_bytes, scan_bytes, window_bytes, tc_bytes; };
    for (int arg = 1; arg < argc; ++arg) {
        Sh s{};
        if (std::sscanf(argv[arg], "%d,%d,%d,%d,%d,%d,%zu,%zu,%zu,%zu", &s.B, &s.T, &s.H, &s.K, &s.V,
                        &s.W, &s.state_bytes, &s.scan_bytes, &s.window_bytes, &s.tc_bytes) != 10) {
            std::printf("bad case %s\n", argv[arg]);
            ++fails;
            continue;
        }
        for (int tc = 0; tc < (s.tc_bytes ? 2 : 1); ++tc) {
        std::mt19937 rng(3); std::normal_distribution<float> nd;
        int B = s.B, T = s.T, H = s.H, K = s.K, V = s.V, W = s.W; float scale = 1.f / std::sqrt((float)K);
        std::vector<float> q(B*T*H*K), k(B*T*H*K), v(B*T*H*V), init(B*H*V*K), lin(B*T*H*V, NAN), fin(B*H*V*K, NAN), o(B*T*H*V, NAN);
        for (auto* a : {&q, &k, &v, &init}) for (auto& x : *a) x = nd(rng);
        std::vector<u16> qb(q.size()), kb(k.size()), vb(v.size()), ob(o.size(), 0xffff);
        if (tc) {
            // bf16 inputs: the window kernel reads the bits, the linear branch (float32
            // kernels here) and the reference their values.
            for (size_t i = 0; i < q.size(); ++i) { qb[i] = to_bf16(q[i]); q[i] = ld(qb.data(), i); }
            for (size_t i = 0; i < k.size(); ++i) { kb[i] = to_bf16(k[i]); k[i] = ld(kb.data(), i); }
            for (size_t i = 0; i < v.size(); ++i) { vb[i] = to_bf16(v[i]); v[i] = ld(vb.data(), i); }
        }
        const int nc = (T + SSD_CHUNK - 1) / SSD_CHUNK;
        std::vector<float> ones(B*T*H, 1.f), zeros(H, 0.f), states(B*H*nc*V*K, NAN), cld(B*H*nc, NAN);
        dim3 grid{(unsigned)nc, (unsigned)H, (unsigned)B};
        launch(grid, SSD_THREADS, [&] { chunk_state<float>(v.data(), ones.data(), zeros.data(), k.data(), states.data(), cld.data(), T, H, H, V, K); }, s.state_bytes / 4);
        launch(dim3{(unsigned)H, (unsigned)B, (unsigned)((V * K + SSD_THREADS - 1) / SSD_THREADS)}, SSD_THREADS, [&] { ssd_state_passing(states.data(), cld.data(), init.data(), 1, fin.data(), H, nc, V, K); });
        launch(grid, SSD_THREADS, [&] { chunk_scan<float, float>(v.data(), ones.data(), zeros.data(), k.data(), q.data(), zeros.data(), 0, states.data(), lin.data(), T, H, H, V, K); }, s.scan_bytes / 4);
        if (tc) {
            launch(dim3{(unsigned)((T + 63) / 64), (unsigned)H, (unsigned)B}, BASED_TC_THREADS, [&] { based_window_tc(qb.data(), kb.data(), vb.data(), scale, lin.data(), 0.f, ob.data(), T, H, K, V, W); }, s.tc_bytes / 4);
            for (size_t i = 0; i < o.size(); ++i) o[i] = ld(ob.data(), i);
        } else {
            launch(dim3{(unsigned)((T + 63) / 64), (unsigned)H, (unsigned)B}, BASED_THREADS, [&] { window_branch<float>(q.data(), k.data(), v.data(), scale, lin.data(), scale, o.data(), T, H, K, V, W); }, s.window_bytes / 4);
        }
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
                    acc *= tc ? 0.0 : scale;  // the tensor-core run: the window branch alone
                    for (int u = first; u <= t; ++u) acc += w[u - first] / total * v[(((long long)b*T + u)*H + h)*V + p];
                    double got = o[r*V+p];
                    num += (got-acc)*(got-acc); den += acc*acc; if (!std::isfinite(got)) num = INFINITY;
                }
            }
            for (int e = 0; e < V*K; ++e) { double got = fin[(b*H+h)*V*K+e]; fnum += (got-S[e])*(got-S[e]); fden += S[e]*S[e]; if (!std::isfinite(got)) fnum = INFINITY; }
        }
        double e1 = std::sqrt(num/den), e2 = std::sqrt(fnum/fden);
        std::printf("based%s B%d T%d H%d K%d V%d W%d: o %.3g final %.3g\n", tc ? " tensor-core window (bf16)" : "", B, T, H, K, V, W, e1, e2);
        if (!(e1 < (tc ? 5e-3 : 1e-5) && e2 < 1e-5) || g_overrun) ++fails;
        }
    }
    std::printf(fails ? "FAILED\n" : "ALL OK\n");
    return fails != 0;
}
