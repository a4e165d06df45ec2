// SSD's backward (ssd_bwd.cu after ssd.cu: the forward's chunk states (on the backward's tiled
// products) and their passing, the
// chunks' own adjoints and their passing from the last chunk, dx, dB and dC per head, the
// suffix sums for dt, the sums over groups and batch) emulated on the CPU (cuda_shim.h) against
// a float64 adjoint of S_t = exp(dt_t A_h) S_{t-1} + dt_t x_t B_t^T, y_t = S_t C_t + D_h x_t,
// with an initial state and a cotangent of the final state: every gradient (x, dt, A, B, C, D,
// initial state). The float64 adjoint is itself checked against central finite differences of
// L = <dy, y> + <dfin, final state> on a few entries of each input; each case also runs
// without D, the initial state and d_final (their flags 0, their buffers non-zero and unread).
// Each argument is one case "B,T,H,G,P,N,S1,S3,S5,S6,S7": the shape and the dynamic shared
// memory, bytes, the host gives kernels 1 (the forward's chunk state), 3, 5, 6 and 7
// (src/sequence_mixers/ssd_backward.rs: tests/kernels_emulate.rs passes them). Prints one line
// per run, then ALL OK or FAILED.
#include "cuda_shim.h"
#include <cstdio>
#include <random>
#include <algorithm>
#include "prelude.cuh"
#include "ssd.cu"
#include "ssd_bwd.cu"

struct In { int B, T, H, G, P, N; std::vector<double> x, dt, A, Bm, Cm, D, init, dy, dfin; };

// The forward for one (b, h), its states S_0 .. S_T kept ([T + 1][P][N]); y added to *loss.
std::vector<double> forward(const In& s, int b, int h, double* loss) {
    const int P = s.P, N = s.N, g = h / (s.H / s.G);
    std::vector<double> st((size_t)(s.T + 1) * P * N);
    for (int e = 0; e < P * N; ++e) st[e] = s.init[((size_t)b * s.H + h) * P * N + e];
    for (int t = 0; t < s.T; ++t) {
        const size_t bt = (size_t)b * s.T + t;
        const double dt = s.dt[bt * s.H + h], a = std::exp(dt * s.A[h]);
        for (int p = 0; p < P; ++p) {
            const double xv = s.x[(bt * s.H + h) * P + p];
            double y = s.D[h] * xv;
            for (int n = 0; n < N; ++n) {
                double& v = st[((size_t)(t + 1) * P + p) * N + n];
                v = a * st[((size_t)t * P + p) * N + n] + dt * xv * s.Bm[(bt * s.G + g) * N + n];
                y += v * s.Cm[(bt * s.G + g) * N + n];
            }
            if (loss) *loss += s.dy[(bt * s.H + h) * P + p] * y;
        }
    }
    if (loss)
        for (int e = 0; e < P * N; ++e)
            *loss += s.dfin[((size_t)b * s.H + h) * P * N + e] * st[(size_t)s.T * P * N + e];
    return st;
}

double loss(const In& s) {
    double L = 0;
    for (int b = 0; b < s.B; ++b) for (int h = 0; h < s.H; ++h) forward(s, b, h, &L);
    return L;
}

struct Grad { std::vector<double> x, dt, A, Bm, Cm, D, init; };

// The adjoint walked back from the last step.
Grad adjoint(const In& s) {
    Grad gr{std::vector<double>(s.x.size()), std::vector<double>(s.dt.size()), std::vector<double>(s.A.size()),
            std::vector<double>(s.Bm.size()), std::vector<double>(s.Cm.size()), std::vector<double>(s.D.size()),
            std::vector<double>(s.init.size())};
    const int P = s.P, N = s.N;
    for (int b = 0; b < s.B; ++b) for (int h = 0; h < s.H; ++h) {
        const int g = h / (s.H / s.G);
        const std::vector<double> st = forward(s, b, h, nullptr);
        std::vector<double> adj(P * N);
        for (int e = 0; e < P * N; ++e) adj[e] = s.dfin[((size_t)b * s.H + h) * P * N + e];
        for (int t = s.T - 1; t >= 0; --t) {
            const size_t bt = (size_t)b * s.T + t, bth = bt * s.H + h;
            const double dt = s.dt[bth], a = std::exp(dt * s.A[h]);
            const double* Bv = &s.Bm[(bt * s.G + g) * N];
            const double* Cv = &s.Cm[(bt * s.G + g) * N];
            // adj += dy_t C_t^T (S_t's adjoint, whole).
            for (int p = 0; p < P; ++p)
                for (int n = 0; n < N; ++n) adj[p * N + n] += s.dy[bth * P + p] * Cv[n];
            double dl = 0;
            for (int p = 0; p < P; ++p) {
                const double xv = s.x[bth * P + p], gy = s.dy[bth * P + p];
                gr.D[h] += gy * xv;
                double u = 0;
                for (int n = 0; n < N; ++n) {
                    const double sa = adj[p * N + n];
                    u += sa * Bv[n];
                    gr.Bm[(bt * s.G + g) * N + n] += dt * sa * xv;
                    gr.Cm[(bt * s.G + g) * N + n] += st[((size_t)(t + 1) * P + p) * N + n] * gy;
                    dl += sa * a * st[((size_t)t * P + p) * N + n];
                }
                gr.x[bth * P + p] = dt * u + s.D[h] * gy;
                gr.dt[bth] += xv * u;
            }
            gr.dt[bth] += s.A[h] * dl;
            gr.A[h] += dt * dl;
            for (auto& v : adj) v *= a;
        }
        for (int e = 0; e < P * N; ++e) gr.init[((size_t)b * s.H + h) * P * N + e] = adj[e];
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
        In s; size_t sm1, sm3, sm5, sm6, sm7;
        if (std::sscanf(argv[arg], "%d,%d,%d,%d,%d,%d,%zu,%zu,%zu,%zu,%zu", &s.B, &s.T, &s.H, &s.G, &s.P, &s.N,
                        &sm1, &sm3, &sm5, &sm6, &sm7) != 11) {
            std::printf("bad case %s\n", argv[arg]); ++fails; continue;
        }
        std::mt19937 rng(5); std::normal_distribution<double> nd; std::uniform_real_distribution<double> ud(0.01, 0.3);
        auto fill = [&](std::vector<double>& v, size_t n, auto&& gen) { v.resize(n); for (auto& e : v) e = gen(); };
        auto r32 = [](double v) { return (double)(float)v; };
        const size_t bt = (size_t)s.B * s.T, st_len = (size_t)s.B * s.H * s.P * s.N;
        fill(s.x, bt * s.H * s.P, [&] { return r32(nd(rng)); }); fill(s.dt, bt * s.H, [&] { return r32(ud(rng)); });
        fill(s.A, s.H, [&] { return r32(-4 * ud(rng)); });
        fill(s.Bm, bt * s.G * s.N, [&] { return r32(nd(rng)); }); fill(s.Cm, bt * s.G * s.N, [&] { return r32(nd(rng)); });
        fill(s.D, s.H, [&] { return r32(nd(rng)); }); fill(s.init, st_len, [&] { return r32(nd(rng)); });
        fill(s.dy, bt * s.H * s.P, [&] { return r32(nd(rng)); }); fill(s.dfin, st_len, [&] { return r32(nd(rng)); });
        for (int flags = 1; flags >= 0; --flags) {
            In y = s;
            if (!flags) { std::fill(y.D.begin(), y.D.end(), 0.0); std::fill(y.init.begin(), y.init.end(), 0.0); std::fill(y.dfin.begin(), y.dfin.end(), 0.0); }
            const Grad want = adjoint(y);
            double fd_worst = 0;
            if (flags) {
                auto probe = [&](std::vector<double>& v, const std::vector<double>& gv) {
                    for (size_t k = 0; k < v.size(); k += 1 + v.size() / 3) {
                        const double keep = v[k], hh = 1e-6 * (1 + std::fabs(keep));
                        v[k] = keep + hh; const double lp = loss(y); v[k] = keep - hh; const double lm = loss(y); v[k] = keep;
                        const double fd = (lp - lm) / (2 * hh);
                        fd_worst = std::max(fd_worst, std::fabs(fd - gv[k]) / (1e-6 + std::fabs(fd) + std::fabs(gv[k])));
                    }
                };
                probe(y.x, want.x); probe(y.dt, want.dt); probe(y.A, want.A); probe(y.Bm, want.Bm);
                probe(y.Cm, want.Cm); probe(y.D, want.D); probe(y.init, want.init);
            }
            auto f = [](const std::vector<double>& v) { return std::vector<float>(v.begin(), v.end()); };
            const auto x = f(s.x), dt = f(s.dt), A = f(s.A), Bm = f(s.Bm), Cm = f(s.Cm), D = f(s.D), init = f(s.init),
                       dy = f(s.dy), dfin = f(s.dfin);
            const int B = s.B, T = s.T, H = s.H, G = s.G, P = s.P, N = s.N, nc = (T + SSD_CHUNK - 1) / SSD_CHUNK;
            // Scratch and outputs start as NaN: every entry read must have been written.
            std::vector<float> states((size_t)B * H * nc * P * N, NAN), cld((size_t)B * H * nc, NAN), fin(st_len, NAN),
                adj(states.size(), NAN), xu(bt * H, NAN), dyx(bt * H, NAN), cdc(bt * H, NAN),
                dbh(bt * H * N, NAN), dch(bt * H * N, NAN), pa((size_t)B * H, NAN), pd((size_t)B * H, NAN),
                bound(cld.size(), NAN);
            std::vector<float> gx(x.size(), NAN), gdt(dt.size(), NAN), gA(H, NAN), gB(Bm.size(), NAN), gC(Cm.size(), NAN),
                gD(H, NAN), gi(st_len, NAN);
            const dim3 chunks{(unsigned)nc, (unsigned)H, (unsigned)B};
            const dim3 slices{(unsigned)H, (unsigned)B, (unsigned)((P * N + SSD_THREADS - 1) / SSD_THREADS)};
            launch(chunks, SSD_THREADS, [&] { chunk_products<float, true>(x.data(), dt.data(), A.data(), Bm.data(), states.data(), cld.data(), 1.f, T, H, G, P, N); }, sm1 / 4);
            launch(slices, SSD_THREADS, [&] { ssd_state_passing(states.data(), cld.data(), init.data(), flags, fin.data(), H, nc, P, N); }, 0);
            launch(chunks, SSD_THREADS, [&] { chunk_products<float, false>(dy.data(), dt.data(), A.data(), Cm.data(), adj.data(), nullptr, 1.f, T, H, G, P, N); }, sm3 / 4);
            launch(slices, SSD_THREADS, [&] { ssd_bwd_state_passing(adj.data(), cld.data(), dfin.data(), flags, gi.data(), H, nc, P, N); }, 0);
            launch(chunks, SSD_THREADS, [&] { bwd_dx<float>(x.data(), dt.data(), A.data(), Bm.data(), Cm.data(), D.data(), flags, dy.data(), 1.f, adj.data(), states.data(), fin.data(), gx.data(), xu.data(), dyx.data(), bound.data(), T, H, G, P, N); }, sm5 / 4);
            launch(chunks, SSD_THREADS, [&] { bwd_dbc<float, false>(x.data(), dt.data(), A.data(), Cm.data(), Cm.data(), dy.data(), 1.f, adj.data(), dbh.data(), nullptr, T, H, G, P, N); }, sm6 / 4);
            launch(chunks, SSD_THREADS, [&] { bwd_dbc<float, true>(x.data(), dt.data(), A.data(), Bm.data(), Cm.data(), dy.data(), 1.f, states.data(), dch.data(), cdc.data(), T, H, G, P, N); }, sm6 / 4);
            launch(dim3{(unsigned)H, (unsigned)B, 1}, SSD_THREADS, [&] { ssd_bwd_ddt(dt.data(), A.data(), xu.data(), dyx.data(), cdc.data(), bound.data(), gdt.data(), pa.data(), pd.data(), T, H, nc); }, sm7 / 4);
            launch(dim3{3, 1, 1}, SSD_THREADS, [&] { ssd_bwd_sum(dbh.data(), dch.data(), pa.data(), pd.data(), flags, gB.data(), gC.data(), gA.data(), gD.data(), (long long)bt, B, H, G, N); }, 0);
            const double e[7] = {rel(gx, want.x), rel(gdt, want.dt), rel(gA, want.A), rel(gB, want.Bm),
                                 rel(gC, want.Cm), flags ? rel(gD, want.D) : 0.0, rel(gi, want.init)};
            // Without D, dD is written as zeros (the gradient of an input not given).
            if (!flags) for (float v : gD) if (v != 0.f) ++fails;
            double worst = 0; for (double v : e) worst = std::max(worst, std::isfinite(v) ? v : INFINITY);
            std::printf("ssd backward B%d T%d H%d G%d P%d N%d %s: dx %.2g ddt %.2g dA %.2g dB %.2g dC %.2g dD %.2g dS0 %.2g "
                        "(float64 adjoint vs finite differences %.2g)\n",
                        B, T, H, G, P, N, flags ? "with D, S0, dfin" : "without", e[0], e[1], e[2], e[3], e[4], e[5], e[6], fd_worst);
            if (!(worst < 2e-5) || !(fd_worst < 1e-5) || g_overrun) ++fails;
        }
    }
    std::printf(fails ? "FAILED\n" : "ALL OK\n");
    return fails != 0;
}
