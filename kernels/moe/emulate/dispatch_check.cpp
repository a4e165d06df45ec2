// The MoE routing, plan, gather and combine kernels (dispatch.cu) emulated on the CPU (the
// sequence-mixer shim, cuda_shim.h) against a direct float64 / integer reference of
// src/moe/reference.rs's route, plan (stable counting sort, capacity), dispatch and combine.
// Each argument is one case "T,E,TOP_K,CAPACITY,H,SIGMOID" (CAPACITY -1: dropless). Logits
// are drawn with ties (a few values repeat) so the tie rule is exercised. Checks: the chosen
// experts and the plan (offsets, rows, row_of) exactly; gate weights within 1e-6; the gathered
// rows bit for bit; the combine within bf16 rounding (4e-3 relative) of the float64 sum, and
// exactly x where top_k = 1 with a gate of 1; the SwiGLU activation on the gathered rows (as
// [M, 2F], F = H / 2) within 4e-3 of float64 and nothing past row M written; the bf16 to
// float32 copy exact. Prints one line per case, then ALL OK or FAILED.
#include "cuda_shim.h"
#include <algorithm>
#include <cstdio>
#include <numeric>
#include <random>
#include "prelude.cuh"
#include "dispatch.cu"

int main(int argc, char** argv) {
    int fails = argc < 2;
    for (int arg = 1; arg < argc; ++arg) {
        int T, E, K, cap, H, sig;
        if (std::sscanf(argv[arg], "%d,%d,%d,%d,%d,%d", &T, &E, &K, &cap, &H, &sig) != 6) {
            std::printf("bad case %s\n", argv[arg]);
            ++fails;
            continue;
        }
        std::mt19937 rng(5);
        std::uniform_int_distribution<int> tie(0, 3);
        std::normal_distribution<float> nd;
        std::vector<float> logits((size_t)T * E);
        for (auto& v : logits) v = tie(rng) == 0 ? 0.5f : nd(rng);
        // Reference routing.
        std::vector<int> ref_e((size_t)T * K);
        std::vector<double> ref_w((size_t)T * K);
        for (int t = 0; t < T; ++t) {
            std::vector<int> order(E);
            std::iota(order.begin(), order.end(), 0);
            const float* row = &logits[(size_t)t * E];
            std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return row[a] > row[b]; });
            double sum = 0;
            std::vector<double> s(K);
            for (int j = 0; j < K; ++j) {
                const double l = row[order[j]];
                s[j] = sig ? 1 / (1 + std::exp(-l)) : std::exp(l - row[order[0]]);
                sum += s[j];
            }
            for (int j = 0; j < K; ++j) { ref_e[t * K + j] = order[j]; ref_w[t * K + j] = s[j] / sum; }
        }
        // Reference plan.
        const int n = T * K;
        std::vector<int> cnt(E, 0), ref_row_of(n, -1);
        std::vector<char> kept(n, 0);
        for (int a = 0; a < n; ++a) if (cap < 0 || cnt[ref_e[a]] < cap) { cnt[ref_e[a]]++; kept[a] = 1; }
        std::vector<int> ref_off(E + 1, 0);
        for (int e = 0; e < E; ++e) ref_off[e + 1] = ref_off[e] + cnt[e];
        std::vector<int> next(ref_off.begin(), ref_off.end() - 1), ref_rows(ref_off[E]);
        for (int a = 0; a < n; ++a) if (kept[a]) { ref_rows[next[ref_e[a]]] = a; ref_row_of[a] = next[ref_e[a]]++; }
        // Device side.
        std::vector<int> ex(n, -7), off(E + 1, -7), rows(n, -7), row_of(n, -7);
        std::vector<float> w(n, NAN);
        const int warps = 4;
        launch(dim3{(unsigned)((T + warps - 1) / warps), 1, 1}, 32 * warps,
               [&] { moe_route(logits.data(), ex.data(), w.data(), T, E, K, sig); });
        const int chunks = std::max(1, (n + MD_CHUNK - 1) / MD_CHUNK);
        std::vector<int> counts((size_t)chunks * E, -7);
        launch(dim3{(unsigned)chunks, 1, 1}, MD_CHUNK,
               [&] { moe_chunk_counts(ex.data(), n, E, counts.data()); }, E);
        launch(dim3{1, 1, 1}, MD_MAX_EXPERTS,
               [&] { moe_plan_offsets(counts.data(), chunks, E, cap, off.data()); }, MD_MAX_EXPERTS);
        launch(dim3{(unsigned)chunks, 1, 1}, MD_CHUNK,
               [&] { moe_scatter(ex.data(), n, E, cap, counts.data(), off.data(), row_of.data(), rows.data()); }, 32 * E);
        const int M = off[E];
        std::vector<u16> x((size_t)T * H), xd((size_t)std::max(M, 1) * H, 0xffff), out((size_t)T * H, 0xffff);
        for (auto& b : x) b = to_bf16(nd(rng));
        launch(dim3{3, 1, 1}, 128, [&] { moe_gather(x.data(), rows.data(), &off[E], H, K, xd.data()); });
        // Identity experts: combine the gathered rows themselves.
        launch(dim3{5, 1, 1}, 128, [&] { moe_combine(xd.data(), row_of.data(), w.data(), T, K, H, out.data()); });
        bool route_ok = ex == ref_e, w_ok = true;
        for (int i = 0; i < n; ++i) w_ok &= std::fabs(w[i] - ref_w[i]) <= 1e-6;
        const bool plan_ok = off == ref_off && row_of == ref_row_of &&
                             std::equal(ref_rows.begin(), ref_rows.end(), rows.begin());
        bool gather_ok = true;
        for (int r = 0; r < M; ++r)
            for (int c = 0; c < H; ++c) gather_ok &= xd[(size_t)r * H + c] == x[(size_t)(ref_rows[r] / K) * H + c];
        double err = 0, scale = 0;
        bool exact = true;
        for (int t = 0; t < T; ++t)
            for (int c = 0; c < H; ++c) {
                double s = 0;
                for (int j = 0; j < K; ++j)
                    if (ref_row_of[t * K + j] >= 0) s += ref_w[t * K + j] * ld(x.data(), (size_t)t * H + c);
                const double o = ld(out.data(), (size_t)t * H + c);
                err = std::max(err, std::fabs(o - s)); scale = std::max(scale, std::fabs(s));
                if (K == 1 && cap < 0) exact &= out[(size_t)t * H + c] == x[(size_t)t * H + c];
            }
        const double rel = scale > 0 ? err / scale : err;
        // SwiGLU on the gathered rows seen as [M, 2F] (F = H / 2): silu(gate) * up against
        // float64; rows past M (capacity) untouched. Then the logits' bf16 -> float32 copy.
        const int F = H / 2;
        std::vector<u16> act((size_t)std::max(M, 1) * F + F, 0xffff);
        launch(dim3{3, 1, 1}, 128, [&] { moe_swiglu(xd.data(), &off[E], std::max(M, 1), F, act.data()); });
        double act_err = 0, act_scale = 0;
        for (int r = 0; r < M; ++r)
            for (int c = 0; c < F; ++c) {
                const double g = ld(xd.data(), (size_t)r * H + c), u = ld(xd.data(), (size_t)r * H + F + c);
                const double a = g / (1 + std::exp(-g)) * u;
                act_err = std::max(act_err, std::fabs(ld(act.data(), (size_t)r * F + c) - a));
                act_scale = std::max(act_scale, std::fabs(a));
            }
        const bool act_ok = (act_scale > 0 ? act_err / act_scale : act_err) <= 4e-3 &&
                            act[(size_t)M * F] == 0xffff;
        std::vector<float> xf(x.size(), NAN);
        launch(dim3{2, 1, 1}, 64, [&] { moe_bf16_to_f32(x.data(), (long long)x.size(), xf.data()); });
        bool f32_ok = true;
        for (size_t i = 0; i < x.size(); ++i) f32_ok &= xf[i] == ld(x.data(), (long long)i);
        // The backward. Combine: dy random, the experts' outputs the gathered rows xd;
        // dyd[r] = w · dy[t] within bf16 rounding, dweights against the float64 dot product,
        // a dropped assignment's dweights 0 and rows past M untouched.
        std::vector<u16> dy((size_t)T * H), dyd((size_t)std::max(M, 1) * H + H, 0xffff);
        for (auto& b : dy) b = to_bf16(nd(rng));
        std::vector<float> dwt(n, NAN);
        launch(dim3{(unsigned)((n + 7) / 8), 1, 1}, 256,
               [&] { moe_combine_backward(dy.data(), xd.data(), row_of.data(), w.data(), n, K, H, dyd.data(), dwt.data()); });
        double cb_err = 0, cb_scale = 0, dw_err = 0, dw_scale = 0;
        bool cb_ok = dyd[(size_t)std::max(M, 1) * H] == 0xffff;
        for (int a = 0; a < n; ++a) {
            const int r = ref_row_of[a], t = a / K;
            if (r < 0) { cb_ok &= dwt[a] == 0.f; continue; }
            double dot = 0;
            for (int c = 0; c < H; ++c) {
                const double g = ld(dy.data(), (size_t)t * H + c);
                dot += g * ld(xd.data(), (size_t)r * H + c);
                const double want = ref_w[a] * g;
                cb_err = std::max(cb_err, std::fabs(ld(dyd.data(), (size_t)r * H + c) - want));
                cb_scale = std::max(cb_scale, std::fabs(want));
            }
            dw_err = std::max(dw_err, std::fabs(dwt[a] - dot));
            dw_scale = std::max(dw_scale, std::fabs(dot));
        }
        cb_ok &= (cb_scale > 0 ? cb_err / cb_scale : cb_err) <= 4e-3 &&
                 (dw_scale > 0 ? dw_err / dw_scale : dw_err) <= 1e-5;
        // SwiGLU backward on the same [M, 2F] view: dact random, against float64.
        std::vector<u16> dact((size_t)std::max(M, 1) * F), dgu((size_t)std::max(M, 1) * H + H, 0xffff);
        for (auto& b : dact) b = to_bf16(nd(rng));
        launch(dim3{3, 1, 1}, 128, [&] { moe_swiglu_backward(dact.data(), xd.data(), &off[E], std::max(M, 1), F, dgu.data()); });
        double sb_err = 0, sb_scale = 0;
        for (int r = 0; r < M; ++r)
            for (int c = 0; c < F; ++c) {
                const double d = ld(dact.data(), (size_t)r * F + c);
                const double g = ld(xd.data(), (size_t)r * H + c), u = ld(xd.data(), (size_t)r * H + F + c);
                const double sg = 1 / (1 + std::exp(-g));
                const double want_g = d * u * sg * (1 + g * (1 - sg)), want_u = d * g * sg;
                sb_err = std::max({sb_err, std::fabs(ld(dgu.data(), (size_t)r * H + c) - want_g),
                                   std::fabs(ld(dgu.data(), (size_t)r * H + F + c) - want_u)});
                sb_scale = std::max({sb_scale, std::fabs(want_g), std::fabs(want_u)});
            }
        const bool sb_ok = (sb_scale > 0 ? sb_err / sb_scale : sb_err) <= 4e-3 &&
                           dgu[(size_t)std::max(M, 1) * H] == 0xffff;
        // Gather backward: dxd = dyd's rows, base = dy (the router's share) and none.
        std::vector<u16> dx((size_t)T * H, 0xffff), dx0((size_t)T * H, 0xffff);
        launch(dim3{4, 1, 1}, 128, [&] { moe_gather_backward(dyd.data(), row_of.data(), dy.data(), T, K, H, dx.data()); });
        launch(dim3{4, 1, 1}, 128, [&] { moe_gather_backward(dyd.data(), row_of.data(), nullptr, T, K, H, dx0.data()); });
        double gb_err = 0, gb_scale = 0;
        for (int t = 0; t < T; ++t)
            for (int c = 0; c < H; ++c) {
                double s0 = 0;
                for (int j = 0; j < K; ++j)
                    if (ref_row_of[t * K + j] >= 0) s0 += ld(dyd.data(), (size_t)ref_row_of[t * K + j] * H + c);
                const double s1 = s0 + ld(dy.data(), (size_t)t * H + c);
                gb_err = std::max({gb_err, std::fabs(ld(dx0.data(), (size_t)t * H + c) - s0),
                                   std::fabs(ld(dx.data(), (size_t)t * H + c) - s1)});
                gb_scale = std::max({gb_scale, std::fabs(s0), std::fabs(s1)});
            }
        const bool gb_ok = (gb_scale > 0 ? gb_err / gb_scale : gb_err) <= 4e-3;
        // Route backward against central differences of the float64 gate weights in the
        // chosen logits (the selection held fixed), L = Σ_j dweights_j · w_j; 0 elsewhere.
        // Its own dweights: above, a token's slots all combine the same gathered row, so
        // theirs are equal and the gates' gradient would be 0.
        for (auto& v : dwt) v = nd(rng);
        std::vector<u16> dlog((size_t)T * E, 0xffff);
        launch(dim3{(unsigned)((T + 3) / 4), 1, 1}, 128,
               [&] { moe_route_backward(dwt.data(), ex.data(), w.data(), logits.data(), T, E, K, sig, dlog.data()); });
        double rb_err = 0, rb_scale = 0;
        bool rb_zero = true;
        for (int t = 0; t < T; ++t) {
            const float* row = &logits[(size_t)t * E];
            auto loss = [&](int jj, double eps) {
                std::vector<double> s(K);
                double sum = 0;
                for (int j = 0; j < K; ++j) {
                    const double l = row[ref_e[t * K + j]] + (j == jj ? eps : 0.0);
                    s[j] = sig ? 1 / (1 + std::exp(-l)) : std::exp(l);
                    sum += s[j];
                }
                double L = 0;
                for (int j = 0; j < K; ++j) L += (double)dwt[t * K + j] * s[j] / sum;
                return L;
            };
            std::vector<char> chosen(E, 0);
            for (int j = 0; j < K; ++j) {
                const int e = ref_e[t * K + j];
                chosen[e] = 1;
                const double want = (loss(j, 1e-6) - loss(j, -1e-6)) / 2e-6;
                rb_err = std::max(rb_err, std::fabs(ld(dlog.data(), (size_t)t * E + e) - want));
                rb_scale = std::max(rb_scale, std::fabs(want));
            }
            for (int e = 0; e < E; ++e) if (!chosen[e]) rb_zero &= dlog[(size_t)t * E + e] == 0;
        }
        // (At top_k = 1 with softmax gates the gradient is 0: the scale's floor keeps the
        // differences' rounding from counting as an error.)
        rb_scale = std::max(rb_scale, 1e-3);
        const bool rb_ok = rb_zero && rb_err / rb_scale <= 8e-3;
        std::printf("  backward: combine %s (dyd %.1e, dweights %.1e), swiglu %s (%.1e), gather %s (%.1e), route %s (%.1e%s)\n",
                    cb_ok ? "ok" : "WRONG", cb_scale > 0 ? cb_err / cb_scale : cb_err, dw_scale > 0 ? dw_err / dw_scale : dw_err,
                    sb_ok ? "ok" : "WRONG", sb_scale > 0 ? sb_err / sb_scale : sb_err, gb_ok ? "ok" : "WRONG",
                    gb_scale > 0 ? gb_err / gb_scale : gb_err, rb_ok ? "ok" : "WRONG",
                    rb_err / rb_scale, rb_zero ? "" : ", NOT ZERO off the chosen");
        const bool ok = route_ok && w_ok && plan_ok && gather_ok && rel <= 4e-3 && exact &&
                        act_ok && f32_ok && cb_ok && sb_ok && gb_ok && rb_ok && g_overrun == 0;
        std::printf("%s T=%d E=%d top_k=%d capacity=%d H=%d %s: route %s, weights %s, plan %s (rows %d), gather %s, combine %.2e%s, swiglu %s, to_f32 %s\n",
                    ok ? "ok" : "FAIL", T, E, K, cap, H, sig ? "sigmoid" : "softmax", route_ok ? "ok" : "WRONG",
                    w_ok ? "ok" : "WRONG", plan_ok ? "ok" : "WRONG", M, gather_ok ? "ok" : "WRONG", rel,
                    K == 1 && cap < 0 ? (exact ? ", exact" : ", NOT EXACT") : "", act_ok ? "ok" : "WRONG",
                    f32_ok ? "ok" : "WRONG");
        fails += !ok;
    }
    std::printf(fails ? "FAILED\n" : "ALL OK\n");
    return fails ? 1 : 0;
}
