// The grouped GEMM's kernels (grouped_gemm.cu) emulated on the CPU (the sequence-mixer
// shim, cuda_shim.h: a fiber per CUDA thread, mma.sync and ldmatrix lane by lane, shared
// memory poisoned before each block) against float64 products of the same bf16 values: the
// forward, dX and dW, every element, outputs poisoned with NaN beforehand. Each argument is one
// case "K,N,BLOCKS,c0:c1:...": the widths, the persistent grid's blocks (fewer than the tiles,
// so that blocks take several) and the rows of each expert (empty groups allowed; all zeros
// allowed). Bound: max |error| ≤ 8e-3 · max |reference| per output (bf16 rounding of the
// result; 1e-3 for fp16), dW of an empty group exactly zero. Compiled with -DGG_BF16=0 it
// checks the fp16 instance (operands drawn and decoded as fp16). Prints one line per case,
// then ALL OK or FAILED.
#include "cuda_shim.h"
#include <cstdio>
#include <random>
#include <string>
#include "prelude.cuh"
#include "grouped_gemm.cu"

// The 16-bit type's value of b, and v rounded to it.
static float bf(u16 b) { return GG_BF16 ? ld(&b, 0) : f16_float(b); }
static u16 to16(float v) { return GG_BF16 ? to_bf16(v) : to_f16(v); }
static const double BOUND = GG_BF16 ? 8e-3 : 1e-3;

// max |out - ref| / max |ref| over one output, NaN if any output is not finite.
static double rel_error(const std::vector<u16>& out, const std::vector<double>& ref) {
    double err = 0, scale = 0;
    for (size_t i = 0; i < out.size(); ++i) {
        const double o = bf(out[i]);
        if (!std::isfinite(o)) return NAN;
        err = std::max(err, std::fabs(o - ref[i]));
        scale = std::max(scale, std::fabs(ref[i]));
    }
    return scale > 0 ? err / scale : err;
}

int main(int argc, char** argv) {
    int fails = argc < 2;
    for (int arg = 1; arg < argc; ++arg) {
        int K = 0, N = 0, blocks = 0, used = 0;
        if (std::sscanf(argv[arg], "%d,%d,%d,%n", &K, &N, &blocks, &used) != 3) {
            std::printf("bad case %s\n", argv[arg]);
            ++fails;
            continue;
        }
        std::vector<int> offsets{0};
        for (std::string rest = argv[arg] + used; !rest.empty();) {
            const size_t colon = rest.find(':');
            offsets.push_back(offsets.back() + std::stoi(rest.substr(0, colon)));
            rest = colon == std::string::npos ? "" : rest.substr(colon + 1);
        }
        const int E = (int)offsets.size() - 1, M = offsets[E];
        std::mt19937 rng(7);
        std::normal_distribution<float> nd;
        auto random_bf16 = [&](size_t n) {
            std::vector<u16> v(n);
            for (auto& b : v) b = to16(nd(rng));
            return v;
        };
        const std::vector<u16> x = random_bf16((size_t)M * K), w = random_bf16((size_t)E * K * N),
                               dy = random_bf16((size_t)M * N);
        std::vector<double> y_ref((size_t)M * N, 0), dx_ref((size_t)M * K, 0),
            dw_ref((size_t)E * K * N, 0);
        for (int e = 0; e < E; ++e)
            for (int r = offsets[e]; r < offsets[e + 1]; ++r)
                for (int k = 0; k < K; ++k)
                    for (int n = 0; n < N; ++n) {
                        const double we = bf(w[((size_t)e * K + k) * N + n]);
                        y_ref[(size_t)r * N + n] += (double)bf(x[(size_t)r * K + k]) * we;
                        dx_ref[(size_t)r * K + k] += (double)bf(dy[(size_t)r * N + n]) * we;
                        dw_ref[((size_t)e * K + k) * N + n] +=
                            (double)bf(x[(size_t)r * K + k]) * bf(dy[(size_t)r * N + n]);
                    }
        std::vector<u16> y((size_t)M * N, 0xffff), dx((size_t)M * K, 0xffff),
            dw((size_t)E * K * N, 0xffff);
        const size_t smem_floats = (GG_SMEM_TILE_BYTES + (E + 1) * 4 + 3) / 4;
        const dim3 grid{(unsigned)blocks, 1, 1};
        launch(grid, GG_THREADS, [&] { grouped_gemm_fwd(x.data(), w.data(), y.data(), offsets.data(), E, M, K, N); }, smem_floats);
        launch(grid, GG_THREADS, [&] { grouped_gemm_dx(dy.data(), w.data(), dx.data(), offsets.data(), E, M, K, N); }, smem_floats);
        launch(grid, GG_THREADS, [&] { grouped_gemm_dw(x.data(), dy.data(), dw.data(), offsets.data(), E, M, K, N); }, smem_floats);
        const double ey = rel_error(y, y_ref), edx = rel_error(dx, dx_ref), edw = rel_error(dw, dw_ref);
        bool empty_zero = true;
        for (int e = 0; e < E; ++e)
            if (offsets[e] == offsets[e + 1])
                for (size_t i = 0; i < (size_t)K * N; ++i) empty_zero &= dw[(size_t)e * K * N + i] == 0;
        const bool ok = ey <= BOUND && edx <= BOUND && edw <= BOUND && empty_zero && g_overrun == 0;
        std::printf("%s %s E=%d M=%d K=%d N=%d blocks=%d: y %.2e, dx %.2e, dw %.2e, empty dw zero %s, overrun %d\n",
                    ok ? "ok" : "FAIL", GG_BF16 ? "bf16" : "fp16", E, M, K, N, blocks, ey, edx, edw, empty_zero ? "yes" : "no", g_overrun);
        fails += !ok;
    }
    std::printf(fails ? "FAILED\n" : "ALL OK\n");
    return fails ? 1 : 0;
}
