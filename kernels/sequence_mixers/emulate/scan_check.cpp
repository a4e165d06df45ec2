// The selective scan's forward (scan.cu, version 2: chunk end states, the pass between chunks,
// the chunks walked again for y) emulated on the CPU (cuda_shim.h) against the float64
// recurrence h_t = exp(dt_t A) h_{t-1} + dt_t u_t B_t, y_t = <C_t, h_t> + D u_t, from a given
// initial state: outputs and final state. Each argument is one case "B,T,D,N,L" with L the
// chunk length (a multiple of the staged steps); the host picks the threads per channel G and
// the staged steps as scan_cuda::threads_per_channel and scan_cuda::staged_steps do. Prints one
// line per case, then ALL OK or FAILED.
#include "cuda_shim.h"
#include <cstdio>
#include <random>
#include <type_traits>
#include "prelude.cuh"
#include "scan.cu"

int main(int argc, char** argv) {
    int fails = argc < 2;
    for (int arg = 1; arg < argc; ++arg) {
        int B, T, Dc, N, L;
        if (std::sscanf(argv[arg], "%d,%d,%d,%d,%d", &B, &T, &Dc, &N, &L) != 5) {
            std::printf("bad case %s\n", argv[arg]);
            ++fails;
            continue;
        }
        int G = 1;
        while (G * SCAN_NS < N) G *= 2;
        const int ts = G <= 4 ? 32 : (G == 8 ? 16 : 8);
        if (L % ts != 0) {
            std::printf("case %s: L is not a multiple of %d\n", argv[arg], ts);
            ++fails;
            continue;
        }
        const int per_block = SCAN_THREADS / G, chunks = (T + L - 1) / L;
        const size_t smem_floats = (size_t)ts * (2 * per_block + 2 * G * SCAN_NS);
        std::mt19937 rng(2); std::normal_distribution<float> nd; std::uniform_real_distribution<float> ud(0.01f, 0.5f);
        std::vector<float> u(B*T*Dc), dt(B*T*Dc), A(Dc*N), Bm(B*T*N), Cm(B*T*N), D(Dc), init(B*Dc*N);
        std::vector<float> y(B*T*Dc, NAN), fin(B*Dc*N, NAN);
        // The chunk scratch starts as NaN: every entry read must have been written.
        std::vector<float> cstate((size_t)B*chunks*Dc*N, NAN), cdt((size_t)B*chunks*Dc, NAN);
        for (auto& v : u) v = nd(rng); for (auto& v : dt) v = ud(rng); for (auto& v : A) v = -ud(rng) * 4;
        for (auto& v : Bm) v = nd(rng); for (auto& v : Cm) v = nd(rng); for (auto& v : D) v = nd(rng);
        for (auto& v : init) v = nd(rng);
        const dim3 grid{(unsigned)((Dc + per_block - 1) / per_block), (unsigned)chunks, (unsigned)B};
        auto walks = [&](auto g_const) {
            constexpr int GC = decltype(g_const)::value;
            launch(grid, SCAN_THREADS, [&] {
                scan_chunk<float, false, GC>(u.data(), dt.data(), A.data(), Bm.data(), Bm.data(),
                                             A.data(), 0, cstate.data(), cdt.data(), (float*)nullptr,
                                             T, Dc, N, L, ts);
            }, smem_floats);
            const long long threads = (long long)B * Dc * N;
            launch(dim3{(unsigned)((threads + 127) / 128), 1, 1}, 128, [&] {
                scan_pass<false>(A.data(), init.data(), 1, cstate.data(), cdt.data(), fin.data(), B, Dc, N, chunks);
            });
            launch(grid, SCAN_THREADS, [&] {
                scan_chunk<float, true, GC>(u.data(), dt.data(), A.data(), Bm.data(), Cm.data(),
                                            D.data(), 1, cstate.data(), (float*)nullptr, y.data(), T,
                                            Dc, N, L, ts);
            }, smem_floats);
        };
        switch (G) {
            case 1: walks(std::integral_constant<int, 1>{}); break;
            case 2: walks(std::integral_constant<int, 2>{}); break;
            case 4: walks(std::integral_constant<int, 4>{}); break;
            case 8: walks(std::integral_constant<int, 8>{}); break;
            default: walks(std::integral_constant<int, 16>{}); break;
        }
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
        std::printf("selective scan B%d T%d D%d N%d L%d (%d threads per channel, %d chunks): y %.3g final %.3g\n",
                    B, T, Dc, N, L, G, chunks, e1, e2);
        if (!(e1 < 1e-5 && e2 < 1e-5) || g_overrun) ++fails;
    }
    std::printf(fails ? "FAILED\n" : "ALL OK\n");
    return fails != 0;
}
