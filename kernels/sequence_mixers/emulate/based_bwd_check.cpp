// Based's backward emulated on the CPU (cuda_shim.h) as src/sequence_mixers/based_backward.rs
// launches it: SSD's backward kernels (ssd_bwd.cu) for the linear branch with dt 1, A 0, a
// group per head, B = k, C = q, x = v and dy read times the scale, then based_bwd.cu's window
// kernels adding the window branch's part, against a float64 adjoint of
// o_t = c S_t q_t + sum_{s in w(t)} softmax_s(c q_t . k_s) v_s, S_t = S_{t-1} + v_t k_t^T,
// itself checked against central finite differences of L = <dy, O> + <dfin, S_T> on a few
// entries of each input. Each case runs with an initial state and a final state's cotangent,
// then without (their flags 0, the buffers non-zero and unread). Each argument is one case
// "B,T,H,K,V,W,S1,S3,S5,S6,S7,DQ,DKV,TCQ,TCKV": the shape and the dynamic shared memory, bytes,
// the host gives SSD's backward kernels 1, 3, 5, 6 and 7, the window kernels (version 1) and the
// tensor-core window kernels (version 2; 0 where the host would not take them)
// (tests/kernels_emulate.rs passes src/sequence_mixers/based_backward.rs's sizes). Where the
// tensor-core sizes are given, each run is repeated on the inputs rounded to bf16 with version 2
// of the window kernels (the linear branch's kernels in float32 on the rounded values, as the
// device's bf16 path reads them), against the float64 adjoint of the rounded inputs, bound 1e-3
// (dS and P are rounded to bf16 for their products). Prints one line per run, then ALL OK or
// FAILED.
#include "cuda_shim.h"
#include <cstdio>
#include <random>
#include <algorithm>
#include "prelude.cuh"
#include "ssd.cu"
#include "ssd_bwd.cu"
#include "based.cu"
#include "based_bwd.cu"

struct In { int B, T, H, K, V, W; double c; std::vector<double> q, k, v, init, dy, dfin; };
struct Grad { std::vector<double> q, k, v, init; };

// The forward of one (b, h) into *loss (L's terms).
void forward(const In& s, int b, int h, double* loss) {
    const int K = s.K, V = s.V;
    std::vector<double> S(V * K);
    for (int e = 0; e < V * K; ++e) S[e] = s.init[((size_t)b * s.H + h) * V * K + e];
    auto at = [&](int t) { return ((size_t)b * s.T + t) * s.H + h; };
    for (int t = 0; t < s.T; ++t) {
        const double *q = &s.q[at(t) * K], *k = &s.k[at(t) * K], *v = &s.v[at(t) * V], *g = &s.dy[at(t) * V];
        const int first = std::max(0, t - s.W + 1);
        std::vector<double> p(t - first + 1);
        double top = -INFINITY, sum = 0;
        for (int j = first; j <= t; ++j) {
            double x = 0; for (int n = 0; n < K; ++n) x += q[n] * s.k[at(j) * K + n];
            p[j - first] = s.c * x; top = std::max(top, s.c * x);
        }
        for (auto& e : p) { e = std::exp(e - top); sum += e; }
        for (int r = 0; r < V; ++r) {
            double o = 0;
            for (int n = 0; n < K; ++n) { S[r * K + n] += v[r] * k[n]; o += S[r * K + n] * q[n]; }
            o *= s.c;
            for (int j = first; j <= t; ++j) o += p[j - first] / sum * s.v[at(j) * V + r];
            *loss += g[r] * o;
        }
    }
    for (int e = 0; e < V * K; ++e) *loss += s.dfin[((size_t)b * s.H + h) * V * K + e] * S[e];
}

double loss(const In& s) {
    double L = 0;
    for (int b = 0; b < s.B; ++b) for (int h = 0; h < s.H; ++h) forward(s, b, h, &L);
    return L;
}

Grad adjoint(const In& s) {
    Grad gr{std::vector<double>(s.q.size()), std::vector<double>(s.k.size()), std::vector<double>(s.v.size()),
            std::vector<double>(s.init.size())};
    const int K = s.K, V = s.V;
    for (int b = 0; b < s.B; ++b) for (int h = 0; h < s.H; ++h) {
        auto at = [&](int t) { return ((size_t)b * s.T + t) * s.H + h; };
        const size_t bh = ((size_t)b * s.H + h) * V * K;
        // Linear branch: dq_t = c S_t^T dy_t; G_t = dfin + c sum_{u>=t} dy_u q_u^T, dv = G k, dk = G^T v.
        std::vector<double> S(s.init.begin() + bh, s.init.begin() + bh + V * K), G(s.dfin.begin() + bh, s.dfin.begin() + bh + V * K);
        for (int t = 0; t < s.T; ++t)
            for (int r = 0; r < V; ++r)
                for (int n = 0; n < K; ++n) {
                    S[r * K + n] += s.v[at(t) * V + r] * s.k[at(t) * K + n];
                    gr.q[at(t) * K + n] += s.c * S[r * K + n] * s.dy[at(t) * V + r];
                }
        for (int t = s.T - 1; t >= 0; --t)
            for (int r = 0; r < V; ++r)
                for (int n = 0; n < K; ++n) {
                    double& g = G[r * K + n];
                    g += s.c * s.dy[at(t) * V + r] * s.q[at(t) * K + n];
                    gr.v[at(t) * V + r] += g * s.k[at(t) * K + n];
                    gr.k[at(t) * K + n] += g * s.v[at(t) * V + r];
                }
        for (int e = 0; e < V * K; ++e) gr.init[bh + e] = G[e];
        // Window branch.
        for (int t = 0; t < s.T; ++t) {
            const int first = std::max(0, t - s.W + 1), n_s = t - first + 1;
            std::vector<double> p(n_s), dp(n_s);
            double top = -INFINITY, sum = 0, D = 0;
            for (int j = 0; j < n_s; ++j) {
                double x = 0, y = 0;
                for (int n = 0; n < K; ++n) x += s.q[at(t) * K + n] * s.k[at(first + j) * K + n];
                for (int r = 0; r < V; ++r) y += s.dy[at(t) * V + r] * s.v[at(first + j) * V + r];
                p[j] = s.c * x; dp[j] = y; top = std::max(top, p[j]);
            }
            for (auto& e : p) { e = std::exp(e - top); sum += e; }
            for (int j = 0; j < n_s; ++j) { p[j] /= sum; D += p[j] * dp[j]; }
            for (int j = 0; j < n_s; ++j) {
                const double ds = p[j] * (dp[j] - D);
                for (int n = 0; n < K; ++n) {
                    gr.q[at(t) * K + n] += s.c * ds * s.k[at(first + j) * K + n];
                    gr.k[at(first + j) * K + n] += s.c * ds * s.q[at(t) * K + n];
                }
                for (int r = 0; r < V; ++r) gr.v[at(first + j) * V + r] += p[j] * s.dy[at(t) * V + r];
            }
        }
    }
    return gr;
}

double rel(const std::vector<float>& got, const std::vector<double>& want) {
    double num = 0, den = 0;
    for (size_t i = 0; i < want.size(); ++i) {
        if (!std::isfinite(got[i])) return INFINITY;
        num += (got[i] - want[i]) * (got[i] - want[i]); den += want[i] * want[i];
    }
    return std::sqrt(num / (den > 0 ? den : 1));
}

int main(int argc, char** argv) {
    int fails = argc < 2;
    for (int arg = 1; arg < argc; ++arg) {
        In s; size_t sm1, sm3, sm5, sm6, sm7, smq, smkv, tcq, tckv;
        if (std::sscanf(argv[arg], "%d,%d,%d,%d,%d,%d,%zu,%zu,%zu,%zu,%zu,%zu,%zu,%zu,%zu", &s.B, &s.T, &s.H, &s.K, &s.V, &s.W,
                        &sm1, &sm3, &sm5, &sm6, &sm7, &smq, &smkv, &tcq, &tckv) != 15) {
            std::printf("bad case %s\n", argv[arg]); ++fails; continue;
        }
        std::mt19937 rng(7); std::normal_distribution<double> nd;
        auto fill = [&](std::vector<double>& v, size_t n) { v.resize(n); for (auto& e : v) e = (double)(float)nd(rng); };
        const size_t bt = (size_t)s.B * s.T, st_len = (size_t)s.B * s.H * s.V * s.K;
        s.c = (double)(float)(1.0 / std::sqrt((double)s.K));
        fill(s.q, bt * s.H * s.K); fill(s.k, bt * s.H * s.K); fill(s.v, bt * s.H * s.V);
        fill(s.init, st_len); fill(s.dy, bt * s.H * s.V); fill(s.dfin, st_len);
        const In s32 = s;
        for (int run = 0; run < (tcq ? 4 : 2); ++run) {
            const int flags = 1 - run % 2, tc = run / 2;
            s = s32;
            if (tc) for (auto* a : {&s.q, &s.k, &s.v, &s.dy}) for (auto& x : *a) { u16 bits = to_bf16((float)x); x = ld(&bits, 0); }
            In y = s;
            if (!flags) { std::fill(y.init.begin(), y.init.end(), 0.0); std::fill(y.dfin.begin(), y.dfin.end(), 0.0); }
            const Grad want = adjoint(y);
            double fd_worst = 0;
            if (flags && !tc) {
                auto probe = [&](std::vector<double>& v, const std::vector<double>& gv) {
                    for (size_t k = 0; k < v.size(); k += 1 + v.size() / 4) {
                        const double keep = v[k], hh = 1e-6 * (1 + std::fabs(keep));
                        v[k] = keep + hh; const double lp = loss(y); v[k] = keep - hh; const double lm = loss(y); v[k] = keep;
                        const double fd = (lp - lm) / (2 * hh);
                        fd_worst = std::max(fd_worst, std::fabs(fd - gv[k]) / (1e-6 + std::fabs(fd) + std::fabs(gv[k])));
                    }
                };
                probe(y.q, want.q); probe(y.k, want.k); probe(y.v, want.v); probe(y.init, want.init);
            }
            auto f = [](const std::vector<double>& v) { return std::vector<float>(v.begin(), v.end()); };
            const auto q = f(s.q), k = f(s.k), v = f(s.v), init = f(s.init), dy = f(s.dy), dfin = f(s.dfin);
            const int B = s.B, T = s.T, H = s.H, K = s.K, V = s.V, W = s.W, nc = (T + SSD_CHUNK - 1) / SSD_CHUNK;
            const float c = (float)s.c;
            // SSD's view: P = V, N = K, G = H; dt 1, A 0.
            const int P = V, N = K, G = H;
            std::vector<float> ones(bt * H, 1.f), zeros(H, 0.f), unusedD(H, 7.f);
            std::vector<float> states((size_t)B * H * nc * P * N, NAN), cld((size_t)B * H * nc, NAN), fin(st_len, NAN),
                adj(states.size(), NAN), xu(bt * H, NAN), dyx(bt * H, NAN), cdc(bt * H, NAN),
                dbh(bt * H * N, NAN), dch(bt * H * N, NAN), pa((size_t)B * H, NAN), pd((size_t)B * H, NAN),
                bound(cld.size(), NAN), lse(bt * H, NAN), dsum(bt * H, NAN);
            std::vector<float> gv(v.size(), NAN), gdt(bt * H, NAN), gA(H, NAN), gk(k.size(), NAN), gq(q.size(), NAN),
                gD(H, NAN), gi(st_len, NAN);
            const dim3 chunks{(unsigned)nc, (unsigned)H, (unsigned)B};
            const dim3 slices{(unsigned)H, (unsigned)B, (unsigned)((P * N + SSD_THREADS - 1) / SSD_THREADS)};
            launch(chunks, SSD_THREADS, [&] { chunk_products<float, true>(v.data(), ones.data(), zeros.data(), k.data(), states.data(), cld.data(), 1.f, T, H, G, P, N); }, sm1 / 4);
            launch(slices, SSD_THREADS, [&] { ssd_state_passing(states.data(), cld.data(), init.data(), flags, fin.data(), H, nc, P, N); }, 0);
            launch(chunks, SSD_THREADS, [&] { chunk_products<float, false>(dy.data(), ones.data(), zeros.data(), q.data(), adj.data(), nullptr, c, T, H, G, P, N); }, sm3 / 4);
            launch(slices, SSD_THREADS, [&] { ssd_bwd_state_passing(adj.data(), cld.data(), dfin.data(), flags, gi.data(), H, nc, P, N); }, 0);
            launch(chunks, SSD_THREADS, [&] { bwd_dx<float>(v.data(), ones.data(), zeros.data(), k.data(), q.data(), unusedD.data(), 0, dy.data(), c, adj.data(), states.data(), fin.data(), gv.data(), xu.data(), dyx.data(), bound.data(), T, H, G, P, N); }, sm5 / 4);
            launch(chunks, SSD_THREADS, [&] { bwd_dbc<float, false>(v.data(), ones.data(), zeros.data(), q.data(), q.data(), dy.data(), c, adj.data(), dbh.data(), nullptr, T, H, G, P, N); }, sm6 / 4);
            launch(chunks, SSD_THREADS, [&] { bwd_dbc<float, true>(v.data(), ones.data(), zeros.data(), k.data(), q.data(), dy.data(), c, states.data(), dch.data(), cdc.data(), T, H, G, P, N); }, sm6 / 4);
            launch(dim3{(unsigned)H, (unsigned)B, 1}, SSD_THREADS, [&] { ssd_bwd_ddt(ones.data(), zeros.data(), xu.data(), dyx.data(), cdc.data(), bound.data(), gdt.data(), pa.data(), pd.data(), T, H, nc); }, sm7 / 4);
            launch(dim3{3, 1, 1}, SSD_THREADS, [&] { ssd_bwd_sum(dbh.data(), dch.data(), pa.data(), pd.data(), 0, gk.data(), gq.data(), gA.data(), gD.data(), (long long)bt, B, H, G, N); }, 0);
            const dim3 tiles{(unsigned)((T + BASED_TILE - 1) / BASED_TILE), (unsigned)H, (unsigned)B};
            if (tc) {
                std::vector<u16> qb(q.size()), kb(k.size()), vb(v.size()), gb(dy.size());
                for (size_t i = 0; i < q.size(); ++i) { qb[i] = to_bf16(q[i]); kb[i] = to_bf16(k[i]); }
                for (size_t i = 0; i < v.size(); ++i) { vb[i] = to_bf16(v[i]); gb[i] = to_bf16(dy[i]); }
                launch(tiles, BASED_TC_THREADS, [&] { based_bwd_window_dq_tc(qb.data(), kb.data(), vb.data(), gb.data(), c, lse.data(), dsum.data(), gq.data(), T, H, K, V, W); }, tcq / 4);
                launch(tiles, BASED_TC_THREADS, [&] { based_bwd_window_dkv_tc(qb.data(), kb.data(), vb.data(), gb.data(), c, lse.data(), dsum.data(), gk.data(), gv.data(), T, H, K, V, W); }, tckv / 4);
            } else {
                launch(tiles, BASED_THREADS, [&] { window_bwd_dq<float>(q.data(), k.data(), v.data(), dy.data(), c, lse.data(), dsum.data(), gq.data(), T, H, K, V, W); }, smq / 4);
                launch(tiles, BASED_THREADS, [&] { window_bwd_dkv<float>(q.data(), k.data(), v.data(), dy.data(), c, lse.data(), dsum.data(), gk.data(), gv.data(), T, H, K, V, W); }, smkv / 4);
            }
            const double e[4] = {rel(gq, want.q), rel(gk, want.k), rel(gv, want.v), rel(gi, want.init)};
            double worst = 0; for (double x : e) worst = std::max(worst, std::isfinite(x) ? x : INFINITY);
            std::printf("based backward B%d T%d H%d K%d V%d W%d %s %s: dq %.2g dk %.2g dv %.2g dS0 %.2g "
                        "(float64 adjoint vs finite differences %.2g)\n",
                        B, T, H, K, V, W, tc ? "bf16, window on tensor cores" : "float32",
                        flags ? "with S0, dfin" : "without", e[0], e[1], e[2], e[3], fd_worst);
            if (!(worst < (tc ? 1e-3 : 3e-5)) || !(fd_worst < 1e-5) || g_overrun) ++fails;
        }
    }
    std::printf(fails ? "FAILED\n" : "ALL OK\n");
    return fails != 0;
}
