// The selective scan's backward (scan.cu, version 2: the forward's chunk states and pass, the
// chunks' own adjoints, the pass of the adjoints from the last chunk, then scan_bwd per chunk) emulated on the CPU (cuda_shim.h)
// against a float64 adjoint of the recurrence h_t = exp(dt_t A) h_{t-1} + dt_t u_t B_t,
// y_t = <C_t, h_t> + D u_t, with an initial state and a cotangent of the final state: every
// gradient (u, dt, A, B, C, D, initial state). The float64 adjoint is itself checked against
// central finite differences of L = <dy, y> + <dfin, final state> on a few entries of each
// input; each case also runs without D, the initial state and d_final_state (their flags 0).
// Each argument is one case "B,T,D,N,L" (L: steps per chunk, as the host picks it).
// Prints one line per case, then ALL OK or FAILED.
#include "cuda_shim.h"
#include <cstdio>
#include <random>
#include <type_traits>
#include <algorithm>
#include "prelude.cuh"
#include "scan.cu"

struct In { int B, T, Dc, N; std::vector<double> u, dt, A, Bm, Cm, D, init, dy, dfin; };

// L = <dy, y> + <dfin, final> in float64.
double loss(const In& x) {
    double L = 0;
    for (int b = 0; b < x.B; ++b) for (int d = 0; d < x.Dc; ++d) {
        std::vector<double> h(x.N);
        for (int n = 0; n < x.N; ++n) h[n] = x.init[(b*x.Dc+d)*x.N+n];
        for (int t = 0; t < x.T; ++t) {
            const long long i = ((long long)b*x.T + t)*x.Dc + d, r = (long long)b*x.T + t;
            double y = x.D[d] * x.u[i];
            for (int n = 0; n < x.N; ++n) {
                h[n] = std::exp(x.dt[i] * x.A[d*x.N+n]) * h[n] + x.dt[i] * x.u[i] * x.Bm[r*x.N+n];
                y += x.Cm[r*x.N+n] * h[n];
            }
            L += x.dy[i] * y;
        }
        for (int n = 0; n < x.N; ++n) L += x.dfin[(b*x.Dc+d)*x.N+n] * h[n];
    }
    return L;
}

struct Grad { std::vector<double> u, dt, A, Bm, Cm, D, init; };

// The adjoint: the forward kept whole, then walked back.
Grad adjoint(const In& x) {
    Grad g{std::vector<double>(x.u.size()), std::vector<double>(x.dt.size()), std::vector<double>(x.A.size()),
           std::vector<double>(x.Bm.size()), std::vector<double>(x.Cm.size()), std::vector<double>(x.D.size()),
           std::vector<double>(x.init.size())};
    const int N = x.N;
    for (int b = 0; b < x.B; ++b) for (int d = 0; d < x.Dc; ++d) {
        std::vector<double> hs((x.T + 1) * N);
        for (int n = 0; n < N; ++n) hs[n] = x.init[(b*x.Dc+d)*N+n];
        for (int t = 0; t < x.T; ++t) {
            const long long i = ((long long)b*x.T + t)*x.Dc + d, r = (long long)b*x.T + t;
            for (int n = 0; n < N; ++n)
                hs[(t+1)*N+n] = std::exp(x.dt[i] * x.A[d*N+n]) * hs[t*N+n] + x.dt[i] * x.u[i] * x.Bm[r*N+n];
        }
        std::vector<double> gh(N);
        for (int n = 0; n < N; ++n) gh[n] = x.dfin[(b*x.Dc+d)*N+n];
        for (int t = x.T - 1; t >= 0; --t) {
            const long long i = ((long long)b*x.T + t)*x.Dc + d, r = (long long)b*x.T + t;
            g.D[d] += x.dy[i] * x.u[i];
            g.u[i] += x.D[d] * x.dy[i];
            for (int n = 0; n < N; ++n) {
                const double e = std::exp(x.dt[i] * x.A[d*N+n]), hp = hs[t*N+n], ht = hs[(t+1)*N+n];
                gh[n] += x.Cm[r*N+n] * x.dy[i];
                g.Cm[r*N+n] += x.dy[i] * ht;
                g.Bm[r*N+n] += gh[n] * x.dt[i] * x.u[i];
                g.u[i] += gh[n] * x.dt[i] * x.Bm[r*N+n];
                g.dt[i] += gh[n] * (x.A[d*N+n] * e * hp + x.u[i] * x.Bm[r*N+n]);
                g.A[d*N+n] += gh[n] * x.dt[i] * e * hp;
                gh[n] *= e;
            }
        }
        for (int n = 0; n < N; ++n) g.init[(b*x.Dc+d)*N+n] = gh[n];
    }
    return g;
}

// flags: 1 passes D, the initial state and d_final_state; 0 passes their (non-zero) buffers
// with has_d = has_initial = has_d_final = 0, which the kernel must not read.
template <int S>
void run(const In& x, int L, int flags, std::vector<float>& out_u, std::vector<float>& out_dt, std::vector<float>& out_A,
         std::vector<float>& out_B, std::vector<float>& out_C, std::vector<float>& out_D, std::vector<float>& out_init) {
    auto f = [](const std::vector<double>& v) { return std::vector<float>(v.begin(), v.end()); };
    const auto u = f(x.u), dt = f(x.dt), A = f(x.A), Bm = f(x.Bm), Cm = f(x.Cm), D = f(x.D), init = f(x.init), dy = f(x.dy), dfin = f(x.dfin);
    const int chunks = (x.T + L - 1) / L;
    // Scratch starts as NaN: every entry read must have been written.
    std::vector<float> ck((size_t)x.B * chunks * x.Dc * x.N, NAN), adj(ck.size(), NAN),
        cdt((size_t)x.B * chunks * x.Dc, NAN), fin(init.size(), NAN);
    out_u.assign(u.size(), NAN); out_dt.assign(u.size(), NAN); out_init.assign(init.size(), NAN);
    out_A.assign(A.size(), NAN); out_B.assign(Bm.size(), NAN); out_C.assign(Cm.size(), NAN); out_D.assign(D.size(), NAN);
    int G = 1;
    while (G * SCAN_NS < x.N) G *= 2;
    const int ts = std::min(G <= 4 ? 32 : (G == 8 ? 16 : 8), L);
    const int per_block = SCAN_THREADS / G;
    const size_t walk_smem = (size_t)ts * (2 * per_block + 2 * G * SCAN_NS);
    const dim3 walk_grid{(unsigned)((x.Dc + per_block - 1) / per_block), (unsigned)chunks, (unsigned)x.B};
    const long long threads = (long long)x.B * x.Dc * x.N;
    const dim3 pass_grid{(unsigned)((threads + 127) / 128), 1, 1};
    auto walks = [&](auto g_const) {
        constexpr int GC = decltype(g_const)::value;
        launch(walk_grid, SCAN_THREADS, [&] {
            scan_chunk<float, false, GC>(u.data(), dt.data(), A.data(), Bm.data(), Bm.data(), A.data(), 0,
                                         ck.data(), cdt.data(), (float*)nullptr, x.T, x.Dc, x.N, L, ts);
        }, walk_smem);
        launch(pass_grid, 128, [&] {
            scan_pass<false>(A.data(), init.data(), flags, ck.data(), cdt.data(), fin.data(), x.B, x.Dc, x.N, chunks);
        });
        launch(walk_grid, SCAN_THREADS, [&] {
            scan_chunk_adjoint<float, GC>(dy.data(), dt.data(), A.data(), Cm.data(), adj.data(), x.T, x.Dc, x.N, L, ts);
        }, walk_smem);
    };
    switch (G) {
        case 1: walks(std::integral_constant<int, 1>{}); break;
        case 2: walks(std::integral_constant<int, 2>{}); break;
        default: walks(std::integral_constant<int, 4>{}); break;
    }
    launch(pass_grid, 128, [&] {
        scan_pass<true>(A.data(), dfin.data(), flags, adj.data(), cdt.data(), out_init.data(), x.B, x.Dc, x.N, chunks);
    });
    // dB and dC start as NaN too: the blocks write them whole.
    std::fill(out_B.begin(), out_B.end(), NAN); std::fill(out_C.begin(), out_C.end(), NAN);
    const int ln = x.N <= 16 ? 16 : 32;  // as the host: half-warps when N <= 16
    auto bwd = [&](auto ln_const) {
        constexpr int LC = decltype(ln_const)::value;
        launch(dim3{(unsigned)chunks, (unsigned)x.B, 1}, SCAN_BWD_THREADS,
               [&] { scan_bwd<float, S, LC>(u.data(), dt.data(), A.data(), Bm.data(), Cm.data(), D.data(), flags, dy.data(),
                                            ck.data(), adj.data(), cdt.data(), out_u.data(), out_dt.data(),
                                            out_B.data(), out_C.data(), x.T, x.Dc, x.N, L); },
               (size_t)(32 / LC + 2) * SCAN_BWD_WARPS * L * x.N);
    };
    if (ln == 16) bwd(std::integral_constant<int, 16>{}); else bwd(std::integral_constant<int, 32>{});
    const int rows = x.B * chunks;
    launch(dim3{(unsigned)((x.Dc * x.N + 31) / 32), 1, 1}, SCAN_BWD_THREADS,
           [&] { scan_bwd_sum(adj.data(), rows, x.Dc * x.N, out_A.data(), 1); });
    launch(dim3{(unsigned)((x.Dc + 31) / 32), 1, 1}, SCAN_BWD_THREADS,
           [&] { scan_bwd_sum(cdt.data(), rows, x.Dc, out_D.data(), flags); });
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
        In x; int L;
        if (std::sscanf(argv[arg], "%d,%d,%d,%d,%d", &x.B, &x.T, &x.Dc, &x.N, &L) != 5) {
            std::printf("bad case %s\n", argv[arg]); ++fails; continue;
        }
        std::mt19937 rng(3); std::normal_distribution<double> nd; std::uniform_real_distribution<double> ud(0.01, 0.5);
        auto fill = [&](std::vector<double>& v, size_t n, auto&& gen) { v.resize(n); for (auto& e : v) e = gen(); };
        const size_t btd = (size_t)x.B * x.T * x.Dc, btn = (size_t)x.B * x.T * x.N, st = (size_t)x.B * x.Dc * x.N;
        // Inputs rounded to float32, so the kernel and the float64 adjoint see the same values.
        auto r32 = [](double v) { return (double)(float)v; };
        fill(x.u, btd, [&] { return r32(nd(rng)); }); fill(x.dt, btd, [&] { return r32(ud(rng)); });
        fill(x.A, (size_t)x.Dc * x.N, [&] { return r32(-4 * ud(rng)); });
        fill(x.Bm, btn, [&] { return r32(nd(rng)); }); fill(x.Cm, btn, [&] { return r32(nd(rng)); });
        fill(x.D, x.Dc, [&] { return r32(nd(rng)); }); fill(x.init, st, [&] { return r32(nd(rng)); });
        fill(x.dy, btd, [&] { return r32(nd(rng)); }); fill(x.dfin, st, [&] { return r32(nd(rng)); });
        for (int flags = 1; flags >= 0; --flags) {
        // Without the optional inputs the reference sees D, the initial state and d_final as 0.
        In y = x;
        if (!flags) { std::fill(y.D.begin(), y.D.end(), 0.0); std::fill(y.init.begin(), y.init.end(), 0.0); std::fill(y.dfin.begin(), y.dfin.end(), 0.0); }
        const Grad want = adjoint(y);
        // The adjoint against finite differences, a few entries of every input.
        double fd_worst = 0;
        if (flags) {
        auto probe = [&](std::vector<double>& v, const std::vector<double>& gv) {
            for (size_t k = 0; k < v.size(); k += 1 + v.size() / 3) {
                const double keep = v[k], h = 1e-6 * (1 + std::fabs(keep));
                v[k] = keep + h; const double lp = loss(x); v[k] = keep - h; const double lm = loss(x); v[k] = keep;
                const double fd = (lp - lm) / (2 * h);
                fd_worst = std::max(fd_worst, std::fabs(fd - gv[k]) / (1e-6 + std::fabs(fd) + std::fabs(gv[k])));
            }
        };
        probe(x.u, want.u); probe(x.dt, want.dt); probe(x.A, want.A); probe(x.Bm, want.Bm);
        probe(x.Cm, want.Cm); probe(x.D, want.D); probe(x.init, want.init);
        }
        std::vector<float> gu, gdt, gA, gB, gC, gD, gi;
        const int S = x.N <= 32 ? 1 : 2;
        if (S == 1) run<1>(x, L, flags, gu, gdt, gA, gB, gC, gD, gi); else run<2>(x, L, flags, gu, gdt, gA, gB, gC, gD, gi);
        const double e[7] = {rel(gu, want.u), rel(gdt, want.dt), rel(gA, want.A), rel(gB, want.Bm),
                             rel(gC, want.Cm), flags ? rel(gD, want.D) : 0.0, rel(gi, want.init)};
        // Without D, dD is written as zeros (scan_bwd_sum with enabled = has_d = 0 over a NaN start).
        if (!flags) for (float v : gD) if (v != 0.f) ++fails;
        double worst = 0; for (double v : e) worst = std::max(worst, std::isfinite(v) ? v : INFINITY);
        std::printf("scan backward B%d T%d D%d N%d L%d %s: du %.2g ddt %.2g dA %.2g dB %.2g dC %.2g dD %.2g dh0 %.2g "
                    "(float64 adjoint vs finite differences %.2g)\n",
                    x.B, x.T, x.Dc, x.N, L, flags ? "with D, h0, dfin" : "without", e[0], e[1], e[2], e[3], e[4], e[5], e[6], fd_worst);
        if (!(worst < 1e-5) || !(fd_worst < 1e-5) || g_overrun) ++fails;
        }
    }
    std::printf(fails ? "FAILED\n" : "ALL OK\n");
    return fails != 0;
}
