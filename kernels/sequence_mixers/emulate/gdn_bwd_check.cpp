// The gated delta rule's backward emulated on the CPU (cuda_shim.h) as
// src/sequence_mixers/delta_backward.rs launches it: the forward's gdn_prepare and gdn_state_pass
// (delta.cu, float32), then delta_bwd.cu's four kernels, against a float64 adjoint of
// S_t = a_t S_{t-1} (I - b_t k_t k_t^T) + b_t v_t k_t^T, o_t = S_t q_t, itself checked against
// central finite differences of L = <do, O> + <dfin, S_T> on a few entries of each input. Each
// case runs with an initial state and a final state's cotangent, then without (their flags 0, the
// buffers non-zero and unread); the gate is exactly 0 at step 5 where there is one. Each argument
// is one case "B,T,H,K,V,PREP,PASS,BPREP,BPASS,BVAL,BKEY": the shape and the dynamic shared
// memory, bytes, the host gives the forward's two kernels and the backward's four
// (tests/kernels_emulate.rs passes src/sequence_mixers/delta_backward.rs's sizes). Prints one
// line per run, then ALL OK or FAILED.
#include "cuda_shim.h"
#include <cstdio>
#include <random>
#include "prelude.cuh"
#include "delta.cu"
#include "delta_bwd.cu"

struct In { int B, T, H, K, V; std::vector<double> q, k, v, al, be, init, dout, dfin; };
struct Grad { std::vector<double> q, k, v, al, be, init; };

double loss(const In& s) {
    const int K = s.K, V = s.V;
    double L = 0;
    for (int b = 0; b < s.B; ++b) for (int h = 0; h < s.H; ++h) {
        std::vector<double> S(s.init.begin() + ((size_t)b * s.H + h) * V * K, s.init.begin() + ((size_t)b * s.H + h + 1) * V * K), sk(V);
        for (int t = 0; t < s.T; ++t) {
            const size_t r = ((size_t)b * s.T + t) * s.H + h;
            const double a = s.al[r], be = s.be[r];
            for (int i = 0; i < V; ++i) { double x = 0; for (int c = 0; c < K; ++c) x += S[i * K + c] * s.k[r * K + c]; sk[i] = x; }
            for (int i = 0; i < V; ++i) {
                const double u = be * (s.v[r * V + i] - a * sk[i]);
                double o = 0;
                for (int c = 0; c < K; ++c) { S[i * K + c] = a * S[i * K + c] + u * s.k[r * K + c]; o += S[i * K + c] * s.q[r * K + c]; }
                L += s.dout[r * V + i] * o;
            }
        }
        for (int e = 0; e < V * K; ++e) L += s.dfin[((size_t)b * s.H + h) * V * K + e] * S[e];
    }
    return L;
}

// The adjoint recurrence of src/sequence_mixers/delta_gradients.rs, step by step.
Grad adjoint(const In& s) {
    const int K = s.K, V = s.V;
    Grad g{std::vector<double>(s.q.size()), std::vector<double>(s.k.size()), std::vector<double>(s.v.size()),
           std::vector<double>(s.al.size()), std::vector<double>(s.be.size()), std::vector<double>(s.init.size())};
    for (int b = 0; b < s.B; ++b) for (int h = 0; h < s.H; ++h) {
        const size_t bh = ((size_t)b * s.H + h) * V * K;
        auto at = [&](int t) { return ((size_t)b * s.T + t) * s.H + h; };
        std::vector<std::vector<double>> St(s.T + 1, std::vector<double>(V * K));
        for (int e = 0; e < V * K; ++e) St[0][e] = s.init[bh + e];
        for (int t = 0; t < s.T; ++t) {
            const size_t r = at(t);
            for (int i = 0; i < V; ++i) {
                double sk = 0; for (int c = 0; c < K; ++c) sk += St[t][i * K + c] * s.k[r * K + c];
                const double u = s.be[r] * (s.v[r * V + i] - s.al[r] * sk);
                for (int c = 0; c < K; ++c) St[t + 1][i * K + c] = s.al[r] * St[t][i * K + c] + u * s.k[r * K + c];
            }
        }
        std::vector<double> dS(s.dfin.begin() + bh, s.dfin.begin() + bh + V * K), Gb(V * K), gv(V), sk(V), u(V);
        for (int t = s.T - 1; t >= 0; --t) {
            const size_t r = at(t);
            const double a = s.al[r], be = s.be[r];
            const std::vector<double>& P = St[t];
            for (int i = 0; i < V; ++i) {
                double x = 0, y = 0;
                for (int c = 0; c < K; ++c) {
                    Gb[i * K + c] = dS[i * K + c] + s.dout[r * V + i] * s.q[r * K + c];
                    x += Gb[i * K + c] * s.k[r * K + c];
                    y += P[i * K + c] * s.k[r * K + c];
                }
                gv[i] = x; sk[i] = y; u[i] = s.v[r * V + i] - a * y;
            }
            for (int c = 0; c < K; ++c) {
                double dq = 0, dk = 0;
                for (int i = 0; i < V; ++i) {
                    dq += St[t + 1][i * K + c] * s.dout[r * V + i];
                    dk += be * Gb[i * K + c] * u[i] - a * be * P[i * K + c] * gv[i];
                }
                g.q[r * K + c] = dq; g.k[r * K + c] = dk;
            }
            double da = 0, db = 0;
            for (int i = 0; i < V; ++i) {
                g.v[r * V + i] = be * gv[i];
                db += gv[i] * u[i];
                da -= be * gv[i] * sk[i];
                for (int c = 0; c < K; ++c) da += Gb[i * K + c] * P[i * K + c];
            }
            g.al[r] = da; g.be[r] = db;
            for (int i = 0; i < V; ++i)
                for (int c = 0; c < K; ++c) dS[i * K + c] = a * (Gb[i * K + c] - be * gv[i] * s.k[r * K + c]);
        }
        for (int e = 0; e < V * K; ++e) g.init[bh + e] = dS[e];
    }
    return g;
}

double rel(const std::vector<float>& got, const std::vector<double>& want) {
    double num = 0, den = 0;
    for (size_t i = 0; i < want.size(); ++i) {
        if (!std::isfinite(got[i])) return INFINITY;
        num += (got[i] - want[i]) * (got[i] - want[i]); den += want[i] * want[i];
    }
    return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

int main(int argc, char** argv) {
    int fails = argc < 2;
    for (int arg = 1; arg < argc; ++arg) {
        int B, T, H, K, V;
        size_t prep, pass, bprep, bpass, bval, bkey;
        if (std::sscanf(argv[arg], "%d,%d,%d,%d,%d,%zu,%zu,%zu,%zu,%zu,%zu", &B, &T, &H, &K, &V,
                        &prep, &pass, &bprep, &bpass, &bval, &bkey) != 11) {
            std::printf("bad case %s\n", argv[arg]);
            ++fails;
            continue;
        }
        for (int with_states = 1; with_states >= 0; --with_states) {
            std::mt19937 rng(7); std::normal_distribution<double> nd;
            std::uniform_real_distribution<double> ua(0.8, 1.0), ub(0.0, 1.0);
            In s{B, T, H, K, V};
            const size_t n = (size_t)B * T * H, sl = (size_t)B * H * V * K;
            s.q.resize(n * K); s.k.resize(n * K); s.v.resize(n * V); s.al.resize(n); s.be.resize(n);
            s.init.resize(sl); s.dout.resize(n * V); s.dfin.resize(sl);
            for (auto& x : s.q) x = (float)(nd(rng) / std::sqrt((double)K));
            for (size_t r = 0; r < n; ++r) {  // unit-norm keys, as the runner gives them
                double n2 = 0; for (int c = 0; c < K; ++c) { double x = nd(rng); s.k[r * K + c] = x; n2 += x * x; }
                for (int c = 0; c < K; ++c) s.k[r * K + c] = (float)(s.k[r * K + c] / std::sqrt(n2));
            }
            for (auto& x : s.v) x = (float)nd(rng);
            for (auto& x : s.al) x = (float)ua(rng);
            for (auto& x : s.be) x = (float)ub(rng);
            for (auto& x : s.dout) x = (float)nd(rng);
            std::vector<float> initf(sl), dfinf(sl);
            for (size_t e = 0; e < sl; ++e) { initf[e] = (float)(nd(rng) * 0.3); dfinf[e] = (float)(nd(rng) * 0.3); }
            if (n > 5) s.al[5] = 0.0;  // a gate of exactly 0
            for (size_t e = 0; e < sl; ++e) {
                s.init[e] = with_states ? initf[e] : 0.0;
                s.dfin[e] = with_states ? dfinf[e] : 0.0;
            }
            // Finite differences of the adjoint on a few entries of each input (first case only).
            const Grad want = adjoint(s);
            double fd_err = 0;
            if (arg == 1 && with_states) {
                auto probe = [&](std::vector<double>& x, const std::vector<double>& gx, size_t i) {
                    const double h = 1e-5, keep = x[i];
                    x[i] = keep + h; const double lp = loss(s);
                    x[i] = keep - h; const double lm = loss(s);
                    x[i] = keep;
                    const double fd = (lp - lm) / (2 * h);
                    fd_err = std::max(fd_err, std::abs(fd - gx[i]) / (1 + std::abs(fd)));
                };
                for (size_t i : {(size_t)0, s.q.size() / 2, s.q.size() - 1}) { probe(s.q, want.q, i); probe(s.k, want.k, i); }
                for (size_t i : {(size_t)0, s.v.size() - 1}) probe(s.v, want.v, i);
                for (size_t i : {(size_t)0, n / 2, n - 1}) { probe(s.al, want.al, i); probe(s.be, want.be, i); }
                if (n > 5) probe(s.al, want.al, 5);
                for (size_t i : {(size_t)0, sl - 1}) probe(s.init, want.init, i);
            }
            std::vector<float> q(s.q.begin(), s.q.end()), k(s.k.begin(), s.k.end()), v(s.v.begin(), s.v.end());
            std::vector<float> al(s.al.begin(), s.al.end()), be(s.be.begin(), s.be.end()), dout(s.dout.begin(), s.dout.end());
            const int L = GDN_CHUNK, nc = (T + L - 1) / L;
            const size_t per = (size_t)B * H * nc;
            std::vector<float> w(per * L * K, NAN), u(per * L * V, NAN), g(per * L, NAN), states(per * V * K, NAN);
            std::vector<float> fin(sl, NAN), gv(per * L * V, NAN), dstates(per * V * K, NAN), uref(per * L * V, NAN);
            std::vector<float> terms(per * (2 * L + 1), NAN);
            std::vector<float> dq(n * K, NAN), dk(n * K, NAN), dv(n * V, NAN), da(n, NAN), db(n, NAN), dinit(sl, NAN);
            const dim3 chunks{(unsigned)nc, (unsigned)H, (unsigned)B};
            const dim3 rowblocks{(unsigned)((V + GDN_ROWS - 1) / GDN_ROWS), (unsigned)H, (unsigned)B};
            const int hs = with_states;
            launch(chunks, GDN_THREADS, [&] { gdn_prepare<float>(k.data(), v.data(), al.data(), be.data(), w.data(), u.data(), g.data(), T, H, K, V); }, prep / 4);
            launch(rowblocks, GDN_THREADS, [&] { gdn_state_pass<float>(k.data(), w.data(), u.data(), g.data(), initf.data(), hs, states.data(), fin.data(), T, H, K, V, nc); }, pass / 4);
            launch(chunks, GDN_THREADS, [&] { gdn_bwd_prepare<float>(q.data(), k.data(), dout.data(), be.data(), g.data(), w.data(), gv.data(), T, H, K, V); }, bprep / 4);
            launch(rowblocks, GDN_THREADS, [&] { gdn_bwd_state_pass<float>(q.data(), k.data(), dout.data(), be.data(), g.data(), w.data(), gv.data(), dfinf.data(), hs, dstates.data(), dinit.data(), T, H, K, V, nc); }, bpass / 4);
            launch(chunks, GDN_THREADS, [&] { gdn_bwd_values<float>(q.data(), k.data(), v.data(), dout.data(), be.data(), g.data(), u.data(), states.data(), dstates.data(), gv.data(), dv.data(), db.data(), uref.data(), terms.data(), T, H, K, V); }, bval / 4);
            launch(chunks, GDN_THREADS, [&] { gdn_bwd_keys<float>(q.data(), k.data(), dout.data(), be.data(), g.data(), u.data(), states.data(), dstates.data(), gv.data(), uref.data(), terms.data(), dq.data(), dk.data(), da.data(), T, H, K, V); }, bkey / 4);
            const double e[6] = {rel(dq, want.q), rel(dk, want.k), rel(dv, want.v), rel(da, want.al), rel(db, want.be), rel(dinit, want.init)};
            double worst = fd_err;
            for (double x : e) worst = std::max(worst, std::isfinite(x) ? x : INFINITY);
            std::printf("gated delta backward B%d T%d H%d K%d V%d%s: dq %.3g dk %.3g dv %.3g dalpha %.3g dbeta %.3g dinit %.3g (adjoint vs finite differences %.3g)\n",
                        B, T, H, K, V, with_states ? " with states" : "", e[0], e[1], e[2], e[3], e[4], e[5], fd_err);
            if (!(worst < 1e-4) || g_overrun) ++fails;
        }
    }
    std::printf(fails ? "FAILED\n" : "ALL OK\n");
    return fails != 0;
}
