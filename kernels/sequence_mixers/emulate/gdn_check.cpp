// The gated delta rule's three kernels (delta.cu: chunk preparation, state pass, chunk output)
// emulated on the CPU (cuda_shim.h) against the float64 recurrence
// S_t = a_t S_{t-1} (I - b_t k_t k_t^T) + b_t v_t k_t^T, o_t = S_t q_t, from a given initial
// state: outputs and final state, a gate of exactly 0 at step 5, shapes with partial chunks,
// one step, K != V, state rows not a multiple of GDN_ROWS, and K = V = 128. Each argument is one case,
// "B,T,H,K,V,PREP_BYTES,PASS_BYTES,OUT_BYTES": the shape and the kernels' dynamic shared memory
// as the host computes it (tests/kernels_emulate.rs passes
// src/sequence_mixers/delta_cuda.rs's shared_bytes), then ",TC_PREP,TC_STATE,TC_OUT": the
// tensor-core kernels' (tc_shared_bytes; zeros where the host would not take them), then
// ",ROW_GROUPS,WALK": the tensor-core state walk's row groups per block and its kind
// (StateWalk::for_shape): 1 the fused walk (version 8, gdn_prepare_tcm_k128v128 then
// gdn_walk_out_w2_s3_k128v128, at K = V = 128), 2 the whole-row walk then the output
// (version 9, gdn_prepare_tc_k64v64, gdn_state_w1_s4_k64v64 and gdn_output_tc_k64v64, at
// K = V = 64), 3 the fused walk on wgmma (version 10, Hopper's: gdn_prepare_tcm_k<K>v<V> then
// gdn_walk_wg_r<16 ROW_GROUPS>_s<S>_k<K>v<V>, one warpgroup per 16 ROW_GROUPS value columns,
// at K = V = 64 and 128; wgmma as cuda_shim.h emulates it), 0 the others (gdn_prepare_tc,
// gdn_state_tc_r1_s2 or _r2_s4 and gdn_output_tc: 1 group of 4 warps with 2 stages or 2 with
// 4). Where they are given, the case runs a second
// time on q, k and v rounded to bf16 through those kernels, against the recurrence on the rounded values
// (bound 1e-2: W, U~, U, M and the entering states are rounded to bf16 inside, and O itself).
// Prints one line per run, then ALL OK or FAILED.
#include "cuda_shim.h"
#include <cstdio>
#include <random>
#include "prelude.cuh"
#include "delta.cu"
int main(int argc, char** argv) {
    int fails = argc < 2;
    for (int arg = 1; arg < argc; ++arg) {
        int B, T, H, K, V;
        size_t prep, pass, out, tprep, tpass, tout;
        int rg, kind;
        if (std::sscanf(argv[arg], "%d,%d,%d,%d,%d,%zu,%zu,%zu,%zu,%zu,%zu,%d,%d", &B, &T, &H, &K, &V,
                        &prep, &pass, &out, &tprep, &tpass, &tout, &rg, &kind) != 13 || (rg != 1 && rg != 2) || kind < 0 || kind > 3) {
            std::printf("bad case %s\n", argv[arg]);
            ++fails;
            continue;
        }
        for (int tc = 0; tc < (tpass ? 2 : 1); ++tc) {
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
        if (tc) {
            // bf16 q, k, v: the kernels read the bits, the reference their values.
            std::vector<u16> qb(q.size()), kb(k.size()), vb(v.size()), ob(o.size(), 0xffff);
            for (size_t i = 0; i < q.size(); ++i) { qb[i] = to_bf16(q[i]); q[i] = ld(qb.data(), i); }
            for (size_t i = 0; i < k.size(); ++i) { kb[i] = to_bf16(k[i]); k[i] = ld(kb.data(), i); }
            for (size_t i = 0; i < v.size(); ++i) { vb[i] = to_bf16(v[i]); v[i] = ld(vb.data(), i); }
            std::vector<u16> w16((size_t)B*H*nc*L*K, 0xffff), u16v((size_t)B*H*nc*L*V, 0xffff), st16((size_t)B*H*nc*V*K, 0xffff);
            // The kernels the host picks (delta_cuda.rs, dims_suffix and StateWalk::for_shape):
            // at K = V = 128 the fused preparation (with M) and walk (with the output), at 64
            // the whole-row walk between a preparation and an output with K and V compiled in;
            // else the three kernels for any K and V. M's blocks above the diagonal outside
            // the preparation's 16 x 32 warp blocks stay poisoned (neither written nor read).
            const bool d64 = K == 64 && V == 64, d128 = K == 128 && V == 128;
            std::vector<u16> m16((size_t)B*H*nc*L*L, 0xffff);
            launch(chunks, GDN_THREADS, [&] {
                if (kind == 2 && d64) gdn_prepare_tc_k64v64(kb.data(), vb.data(), al.data(), be.data(), w16.data(), u16v.data(), g.data(), T, H, K, V);
                else if (kind == 3 && d64) gdn_prepare_tcm_k64v64(qb.data(), kb.data(), vb.data(), al.data(), be.data(), w16.data(), u16v.data(), m16.data(), g.data(), T, H, K, V);
                else if ((kind == 1 || kind == 3) && d128) gdn_prepare_tcm_k128v128(qb.data(), kb.data(), vb.data(), al.data(), be.data(), w16.data(), u16v.data(), m16.data(), g.data(), T, H, K, V);
                else gdn_prepare_tc(kb.data(), vb.data(), al.data(), be.data(), w16.data(), u16v.data(), g.data(), T, H, K, V);
            }, tprep / 4);
            const unsigned walk_threads = kind == 3 ? 128 : (kind ? 32 : GDN_TC_THREADS) * rg;
            launch(dim3{(unsigned)(V / (GDN_TC_ROWS * rg)), (unsigned)H, (unsigned)B}, walk_threads, [&] {
                if (kind == 3 && d64 && rg == 1) gdn_walk_wg_r16_s4_k64v64(qb.data(), kb.data(), w16.data(), u16v.data(), m16.data(), g.data(), init.data(), 1, ob.data(), fin.data(), T, H, K, V, nc);
                else if (kind == 3 && d128 && rg == 2) gdn_walk_wg_r32_s3_k128v128(qb.data(), kb.data(), w16.data(), u16v.data(), m16.data(), g.data(), init.data(), 1, ob.data(), fin.data(), T, H, K, V, nc);
                else if (kind == 2 && d64 && rg == 1) gdn_state_w1_s4_k64v64(kb.data(), w16.data(), u16v.data(), g.data(), init.data(), 1, st16.data(), fin.data(), T, H, K, V, nc);
                else if (kind == 1 && d128 && rg == 2) gdn_walk_out_w2_s3_k128v128(qb.data(), kb.data(), w16.data(), u16v.data(), m16.data(), g.data(), init.data(), 1, ob.data(), fin.data(), T, H, K, V, nc);
                else if (kind) { std::printf("no whole-row walk %d for K%d V%d with %d warps\n", kind, K, V, rg); ++fails; }
                else if (rg == 2) gdn_state_tc_r2_s4(kb.data(), w16.data(), u16v.data(), g.data(), init.data(), 1, st16.data(), fin.data(), T, H, K, V, nc);
                else gdn_state_tc_r1_s2(kb.data(), w16.data(), u16v.data(), g.data(), init.data(), 1, st16.data(), fin.data(), T, H, K, V, nc);
            }, tpass / 4);
            if (kind != 1 && kind != 3)
                launch(chunks, GDN_THREADS, [&] {
                    if (kind == 2 && d64) gdn_output_tc_k64v64(qb.data(), kb.data(), u16v.data(), g.data(), st16.data(), ob.data(), T, H, K, V);
                    else gdn_output_tc(qb.data(), kb.data(), u16v.data(), g.data(), st16.data(), ob.data(), T, H, K, V);
                }, tout / 4);
            for (size_t i = 0; i < o.size(); ++i) o[i] = ld(ob.data(), i);
        } else {
        launch(chunks, GDN_THREADS, [&] { gdn_prepare<float>(k.data(), v.data(), al.data(), be.data(), w.data(), u.data(), g.data(), T, H, K, V); }, prep / 4);
        launch(dim3{(unsigned)((V + GDN_ROWS - 1) / GDN_ROWS), (unsigned)H, (unsigned)B}, GDN_THREADS, [&] { gdn_state_pass<float>(k.data(), w.data(), u.data(), g.data(), init.data(), 1, states.data(), fin.data(), T, H, K, V, nc); }, pass / 4);
        launch(chunks, GDN_THREADS, [&] { gdn_output<float>(q.data(), k.data(), u.data(), g.data(), states.data(), o.data(), T, H, K, V); }, out / 4);
        }
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
        std::printf("gated delta%s B%d T%d H%d K%d V%d: o %.3g final %.3g\n", tc ? (kind == 3 ? " tensor cores (bf16), wgmma walk" : " tensor cores (bf16)") : "", B, T, H, K, V, e1, e2);
        const double bound = tc ? 1e-2 : 1e-5;
        if (!(e1 < bound && e2 < bound) || g_overrun) ++fails;
        }
    }
    std::printf(fails ? "FAILED\n" : "ALL OK\n");
    return fails != 0;
}
