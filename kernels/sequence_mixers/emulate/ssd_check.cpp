// SSD's kernels (ssd.cu) emulated on the CPU (cuda_shim.h) against the float64 recurrence
// h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T, y_t = C_t h_t + D x_t, from a given initial
// state: outputs and final state, shapes with partial chunks, groups, one step, and
// head_dim = state 128. Each argument is one case,
// "B,T,H,G,P,N,STATE_BYTES,SCAN_BYTES,TC_STATE_BYTES,TC_SCAN_BYTES": the shape and the
// kernels' dynamic shared memory as the host computes it (tests/kernels_emulate.rs passes
// src/sequence_mixers/cuda.rs's shared_bytes and tensor_core_shared_bytes; the tensor-core sizes are 0
// where the host would not take that path). The float32 kernels run on float32 inputs (error
// bound 1e-5); where the tensor-core sizes are given, the bf16 kernels (version 5:
// ssd_chunk_states_tc, ssd_state_passing_bf16, chunk_scan_tc with a float32 y; walks of 1, 3
// and 8 chunks) run on the inputs rounded to bf16, against the
// recurrence on those rounded values (bound 5e-3: Δ x, the masked C Bᵀ dt, the walks' partial sums and own
// states, the states entering the walks and each chunk's entering state are rounded to bf16 inside), and the scan once more writing bf16 y (within 4e-3 of the float32 y). Prints one line per run, then ALL OK or FAILED.
#include "cuda_shim.h"
#include <cstdio>
#include <random>
#include "prelude.cuh"
#include "ssd.cu"

static u16 bf16_of(float v) { return to_bf16(v); }

int main(int argc, char** argv) {
    int fails = argc < 2;
    struct Sh { int B, T, H, G, P, N; size_t state_bytes, scan_bytes, tc_state, tc_scan; };
    for (int arg = 1; arg < argc; ++arg) {
        Sh s{};
        if (std::sscanf(argv[arg], "%d,%d,%d,%d,%d,%d,%zu,%zu,%zu,%zu", &s.B, &s.T, &s.H, &s.G,
                        &s.P, &s.N, &s.state_bytes, &s.scan_bytes, &s.tc_state,
                        &s.tc_scan) != 10) {
            std::printf("bad case %s\n", argv[arg]);
            ++fails;
            continue;
        }
        // Run 0: the float32 kernels; runs 1 to 3 (tensor-core sizes given): the bf16 kernels
        // walking 1, 3 and 8 chunks per block (partial walks at the end where n_chunks is not
        // a multiple).
        for (int run = 0; run < (s.tc_state ? 4 : 1); ++run) {
            const int tc = run > 0, walk = run == 1 ? 1 : run == 2 ? 3 : 8;
            std::mt19937 rng(1); std::normal_distribution<float> nd; std::uniform_real_distribution<float> ud(0.01f, 0.5f);
            int B = s.B, T = s.T, H = s.H, G = s.G, P = s.P, N = s.N, L = 64, nc = (T + L - 1) / L;
            std::vector<float> x(B*T*H*P), dt(B*T*H), A(H), Bm(B*T*G*N), Cm(B*T*G*N), D(H), y(B*T*H*P, NAN), init(B*H*P*N), fin(B*H*P*N, NAN);
            for (auto& v : x) v = nd(rng); for (auto& v : dt) v = ud(rng); for (auto& v : A) v = -ud(rng) * 4;
            for (auto& v : Bm) v = nd(rng); for (auto& v : Cm) v = nd(rng); for (auto& v : D) v = nd(rng); for (auto& v : init) v = nd(rng);
            std::vector<float> states(B*H*nc*P*N, NAN), cld(B*H*nc, NAN);
            const dim3 chunks{(unsigned)nc, (unsigned)H, (unsigned)B};
            const dim3 slices{(unsigned)H, (unsigned)B, (unsigned)((P * N + SSD_THREADS - 1) / SSD_THREADS)};
            if (tc) {
                // bf16 inputs: the kernels read the bits, the reference their values.
                std::vector<u16> xb(x.size()), bb(Bm.size()), cb(Cm.size());
                for (size_t i = 0; i < x.size(); ++i) { xb[i] = bf16_of(x[i]); x[i] = ld(xb.data(), i); }
                for (size_t i = 0; i < Bm.size(); ++i) { bb[i] = bf16_of(Bm[i]); Bm[i] = ld(bb.data(), i); }
                for (size_t i = 0; i < Cm.size(); ++i) { cb[i] = bf16_of(Cm[i]); Cm[i] = ld(cb.data(), i); }
                // Version 5: the walks' partial sums and own states, the walks' states passed
                // on in bf16 (8 elements per thread), then the chunk scan adding the walk's
                // entering state to the partial sum.
                std::vector<u16> st16(B*H*nc*P*N, 0xffff);
                // The host's choice (cuda.rs, tc_suffix): the scan with P and N as constants for the
                // grid's sizes.
                const bool p64 = P == 64 && N == 64, p128 = P == 128 && N == 128;
                auto scan_f32 = p64 ? ssd_chunk_scan_tc_f32out_p64n64 : p128 ? ssd_chunk_scan_tc_f32out_p128n128 : ssd_chunk_scan_tc_f32out;
                auto scan_bf16 = p64 ? ssd_chunk_scan_tc_p64n64 : p128 ? ssd_chunk_scan_tc_p128n128 : ssd_chunk_scan_tc;
                const dim3 walks{(unsigned)((nc + walk - 1) / walk), (unsigned)H, (unsigned)B};
                launch(walks, SSD_THREADS, [&] { ssd_chunk_states_tc(xb.data(), dt.data(), A.data(), bb.data(), st16.data(), cld.data(), T, H, G, P, N, walk); }, s.tc_state / 4);
                const dim3 groups{(unsigned)((P * N / 8 + SSD_PASS_THREADS - 1) / SSD_PASS_THREADS), (unsigned)H, (unsigned)B};
                launch(groups, SSD_PASS_THREADS, [&] { ssd_state_passing_bf16(st16.data(), cld.data(), init.data(), 1, fin.data(), H, nc, P, N, walk); }, 0);
                launch(chunks, SSD_THREADS, [&] { scan_f32(xb.data(), dt.data(), A.data(), bb.data(), cb.data(), D.data(), 1, st16.data(), cld.data(), y.data(), T, H, G, P, N, walk); }, s.tc_scan / 4);
                // The same scan writing bf16 y (ssd_chunk_scan_tc): within one bf16 rounding of
                // the float32 y above.
                std::vector<u16> yb(y.size(), 0xffff);
                launch(chunks, SSD_THREADS, [&] { scan_bf16(xb.data(), dt.data(), A.data(), bb.data(), cb.data(), D.data(), 1, st16.data(), cld.data(), yb.data(), T, H, G, P, N, walk); }, s.tc_scan / 4);
                double bnum = 0, bden = 0;
                for (size_t i = 0; i < y.size(); ++i) { double got = ld(yb.data(), i), want = y[i]; bnum += (got-want)*(got-want); bden += want*want; if (!std::isfinite(got)) bnum = INFINITY; }
                const double eb = std::sqrt(bnum / bden);
                std::printf("ssd tensor cores, bf16 y against float32 y: %.3g\n", eb);
                if (!(eb < 4e-3)) ++fails;
            } else {
                launch(chunks, SSD_THREADS, [&] { chunk_state<float>(x.data(), dt.data(), A.data(), Bm.data(), states.data(), cld.data(), T, H, G, P, N); }, s.state_bytes / 4);
                launch(slices, SSD_THREADS, [&] { ssd_state_passing(states.data(), cld.data(), init.data(), 1, fin.data(), H, nc, P, N); });
                launch(chunks, SSD_THREADS, [&] { chunk_scan<float, float>(x.data(), dt.data(), A.data(), Bm.data(), Cm.data(), D.data(), 1, states.data(), y.data(), T, H, G, P, N); }, s.scan_bytes / 4);
            }
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
            double e1 = std::sqrt(num/den), e2 = std::sqrt(fnum/fden), bound = tc ? 5e-3 : 1e-5;
            std::printf("ssd%s B%d T%d H%d G%d P%d N%d walk %d: y %.3g final %.3g\n", tc ? " tensor cores (bf16)" : "", B, T, H, G, P, N, tc ? walk : 1, e1, e2);
            if (!(e1 < bound && e2 < bound) || g_overrun) ++fails;
        }
    }
    std::printf(fails ? "FAILED\n" : "ALL OK\n");
    return fails != 0;
}
