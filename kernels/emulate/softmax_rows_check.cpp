// The math path's row kernels (softmax_rows.cu: softmax_rows forward, softmax_bwd_rows)
// emulated on the CPU (the sequence-mixer shim, cuda_shim.h: a fiber per CUDA thread, blocks one
// after another) for bf16, fp16 and fp32 P, against float64:
// - the softmax: P within the dtype's rounding of the float64 softmax over the keys a row sees
//   (key lengths, bottom-right causal), exactly 0 at every other column up to ld (the padding
//   included), all 0 for a row that sees no key; S's padding columns hold NaN beforehand (they
//   may be unwritten on the GPU) and must not leak;
// - the backward: dS = P (dP - D) over the P the forward wrote, bit for bit the float32 product
//   rounded to the dtype for every column below Tkv, and 0 at the padding, with dP's padding
//   and dS's (P's before the call) NaN.
// - the padded copies of K and V (pad_rows_t, unpad_rows_t) in both units, at each case's Tkv.
// Each argument is one case "Tq,Tkv,L,causal" (one head, one batch entry with L keys; the rows
// are the Tq queries; ld = Tkv rounded up to a multiple of 8). Prints one line per case, then
// ALL OK or FAILED.
#include "cuda_shim.h"
#include <cstdio>
#include <random>
#include <vector>
#include "prelude.cuh"

// CUDA's vector types, as the kernels use them (16- and 8-byte aligned; float4 is the shim's).
struct alignas(8) uint2 {
    unsigned x, y;
};
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return uint2{x, y}; }
// A kernel's __shared__ array is one per block: blocks run one after another here, so one
// static array per instantiation serves every fiber of the block.
#undef __shared__
#define __shared__ static
#include "softmax_rows.cu"

// The value of element j of a row of dtype OUT (16-bit words), and v rounded to it.
template <int OUT>
static float value(const std::vector<u16>& row, size_t j) {
    if (OUT == 2) {
        float f;
        std::memcpy(&f, &row[2 * j], 4);
        return f;
    }
    return OUT == 0 ? bf16_float(row[j]) : f16_float(row[j]);
}

template <int OUT>
static int check(int Tq, int Tkv, int L, bool causal) {
    constexpr int W = OUT == 2 ? 2 : 1;
    const int ld = (Tkv + 7) / 8 * 8;
    // The dtype's unit roundoff, relative (2^-8 for bf16, 2^-11 for fp16, with room for
    // float32's own exp2f and sum; 1e-5 for fp32), and half of fp16's smallest subnormal,
    // absolute.
    const double tol = OUT == 0 ? 4.5e-3 : OUT == 1 ? 6e-4 : 1e-5;
    const double abs_tol = OUT == 1 ? 3.1e-8 : 1e-30;
    std::mt19937 rng(Tq * 131 + Tkv * 7 + L + causal);
    std::normal_distribution<float> nd;
    std::vector<float> S((size_t)Tq * ld, NAN), dP((size_t)Tq * ld, NAN), D(Tq);
    for (int i = 0; i < Tq; ++i)
        for (int j = 0; j < Tkv; ++j) {
            S[(size_t)i * ld + j] = 3.f * nd(rng);
            dP[(size_t)i * ld + j] = nd(rng);
        }
    for (auto& d : D) d = nd(rng);
    std::vector<u16> P((size_t)Tq * ld * W, 0xffff);  // NaN in every dtype until written
    const int kv_lens[1] = {L};
    const int H = 1;
    launch(dim3{(unsigned)Tq, 1, 1}, THREADS, [&] {
        if (causal) {
            softmax_rows<OUT, true>(S.data(), P.data(), kv_lens, Tq, Tkv, ld, H);
        } else {
            softmax_rows<OUT, false>(S.data(), P.data(), kv_lens, Tq, Tkv, ld, H);
        }
    });
    int bad = 0;
    double worst = 0;
    for (int i = 0; i < Tq; ++i) {
        const int valid = causal ? std::max(0, std::min(L, i + L - Tq + 1)) : L;
        double mx = -INFINITY, sum = 0;
        for (int j = 0; j < valid; ++j) mx = std::max(mx, (double)S[(size_t)i * ld + j]);
        for (int j = 0; j < valid; ++j) sum += std::exp((double)S[(size_t)i * ld + j] - mx);
        std::vector<u16> row(P.begin() + (size_t)i * ld * W, P.begin() + (size_t)(i + 1) * ld * W);
        for (int j = 0; j < ld; ++j) {
            const double want = j < valid ? std::exp((double)S[(size_t)i * ld + j] - mx) / sum : 0.0;
            const double got = value<OUT>(row, j);
            const bool ok = j < valid ? std::fabs(got - want) <= tol * want + abs_tol
                                      : got == 0.0 && !std::signbit(got);
            if (j < valid && want > 1e-4) worst = std::max(worst, std::fabs(got - want) / want);
            if (!ok && bad++ < 3)
                std::printf("  softmax row %d col %d: %g, want %g\n", i, j, got, want);
        }
    }
    // The backward over the P just written, its padding columns poisoned (NaN in every dtype)
    // so that the kernel must write them.
    std::vector<u16> dS = P;
    for (int i = 0; i < Tq; ++i)
        for (size_t w = (size_t)Tkv * W; w < (size_t)ld * W; ++w) dS[(size_t)i * ld * W + w] = 0xffff;
    launch(dim3{(unsigned)Tq, 1, 1}, THREADS,
           [&] { softmax_bwd_rows<OUT>(dP.data(), dS.data(), D.data(), Tkv, ld); });
    for (int i = 0; i < Tq; ++i) {
        std::vector<u16> prow(P.begin() + (size_t)i * ld * W, P.begin() + (size_t)(i + 1) * ld * W);
        std::vector<u16> row(dS.begin() + (size_t)i * ld * W, dS.begin() + (size_t)(i + 1) * ld * W);
        for (int j = 0; j < ld; ++j) {
            const float p = value<OUT>(prow, j);
            float want = 0.f;
            if (j < Tkv) {
                const float f = p * (dP[(size_t)i * ld + j] - D[i]);
                want = OUT == 2 ? f : OUT == 0 ? bf16_float(to_bf16(f)) : f16_float(to_f16(f));
            }
            const float got = value<OUT>(row, j);
            if (!(got == want && std::signbit(got) == std::signbit(want)) && bad++ < 6)
                std::printf("  backward row %d col %d: %g, want %g\n", i, j, got, want);
        }
    }
    std::printf("%s Tq %d Tkv %d (ld %d) L %d %s: softmax worst relative error (P > 1e-4) %.2e, %s\n",
                OUT == 0 ? "bf16" : OUT == 1 ? "fp16" : "fp32", Tq, Tkv, ld, L,
                causal ? "causal" : "full", worst, bad ? "FAILED" : "ok");
    return bad != 0;
}

// pad_rows_t and unpad_rows_t over 3 heads of Tkv rows of `words` 16-bit words (U = uint4 for
// 16 words, 8 to a unit; U = u32 otherwise, 2 to a unit), on a grid smaller than the work (2
// blocks in x, 2 in y for 3 heads) so that both strides run: K and V copied into buffers that
// hold NaN beforehand (the padding must be written 0); then the buffers overwritten with a
// pattern (the backward's dK and dV, padding rows included) and copied out to dK and dV, which
// must get each head's first Tkv rows and nothing else (their tails hold a sentinel).
template <typename U>
static int check_pad(int Tkv, int words) {
    constexpr int per = sizeof(U) / 2;
    const int heads = 3, ld = (Tkv + 7) / 8 * 8, row = words / per;
    const size_t n = (size_t)heads * Tkv * words, np = (size_t)heads * ld * words;
    // One row of sentinels past each padded buffer: a write past it is an error.
    std::vector<u16> k(n), v(n), kp(np + words, 0xffff), vp(np + words, 0xffff);
    for (size_t i = 0; i < n; ++i) k[i] = (u16)(i * 7 + 1), v[i] = (u16)(i * 13 + 5);
    const dim3 grid{2, 2, 2};
    launch(grid, THREADS, [&] {
        pad_rows_t<U>((const U*)k.data(), (const U*)v.data(), (U*)kp.data(), (U*)vp.data(), heads,
                      Tkv, ld, row);
    });
    int bad = 0;
    for (int h = 0; h < heads; ++h)
        for (int r = 0; r < ld; ++r)
            for (int w = 0; w < words; ++w) {
                const size_t at = ((size_t)h * ld + r) * words + w, src = ((size_t)h * Tkv + r) * words + w;
                const u16 wk = r < Tkv ? k[src] : 0, wv = r < Tkv ? v[src] : 0;
                if ((kp[at] != wk || vp[at] != wv) && bad++ < 3)
                    std::printf("  pad head %d row %d word %d: %04x %04x, want %04x %04x\n", h, r, w,
                                kp[at], vp[at], wk, wv);
            }
    for (size_t i = np; i < np + words; ++i)
        if ((kp[i] != 0xffff || vp[i] != 0xffff) && bad++ < 4) std::printf("  pad wrote past Kp or Vp\n");
    for (size_t i = 0; i < np; ++i) kp[i] = (u16)(i * 3 + 2), vp[i] = (u16)(i * 5 + 3);
    std::vector<u16> dk(n + words, 0xabcd), dv(n + words, 0xabcd);
    launch(grid, THREADS, [&] {
        unpad_rows_t<U>((const U*)kp.data(), (const U*)vp.data(), (U*)dk.data(), (U*)dv.data(),
                        heads, Tkv, ld, row);
    });
    for (int h = 0; h < heads; ++h)
        for (int r = 0; r < Tkv; ++r)
            for (int w = 0; w < words; ++w) {
                const size_t at = ((size_t)h * Tkv + r) * words + w, src = ((size_t)h * ld + r) * words + w;
                if ((dk[at] != kp[src] || dv[at] != vp[src]) && bad++ < 6)
                    std::printf("  unpad head %d row %d word %d: %04x %04x, want %04x %04x\n", h, r,
                                w, dk[at], dv[at], kp[src], vp[src]);
            }
    for (size_t i = n; i < n + words; ++i)
        if ((dk[i] != 0xabcd || dv[i] != 0xabcd) && bad++ < 8) std::printf("  unpad wrote past dK or dV\n");
    std::printf("pad and unpad Tkv %d (ld %d), %d words a row in %d-byte units: %s\n", Tkv, ld,
                words, (int)sizeof(U), bad ? "FAILED" : "ok");
    return bad != 0;
}

int main(int argc, char** argv) {
    int fails = argc < 2;
    for (int arg = 1; arg < argc; ++arg) {
        int Tq, Tkv, L, causal;
        if (std::sscanf(argv[arg], "%d,%d,%d,%d", &Tq, &Tkv, &L, &causal) != 4 || L > Tkv) {
            std::printf("bad case %s\n", argv[arg]);
            ++fails;
            continue;
        }
        fails += check<0>(Tq, Tkv, L, causal != 0);
        fails += check<1>(Tq, Tkv, L, causal != 0);
        fails += check<2>(Tq, Tkv, L, causal != 0);
        fails += check_pad<uint4>(Tkv, 16);
        fails += check_pad<u32>(Tkv, 6);
    }
    if (g_overrun) {
        std::printf("shared memory written past its size\n");
        ++fails;
    }
    std::printf(fails ? "FAILED\n" : "ALL OK\n");
    return fails != 0;
}
