// Mamba-1's selective scan (Gu and Dao, 2023, "Mamba: Linear-Time Sequence Modeling with
// Selective State Spaces", Algorithm 2, zero-order-hold A and Euler B as its reference code
// does) on CUDA cores in float32, version 1: correctness first, the sequential recurrence of
// src/sequence_mixers/reference.rs's selective_scan, one warp per (batch entry, channel d)
// (version 1.1: the inputs of the next steps prefetched into registers, below):
//
//   h_t = exp(dt_{t,d} A_d) * h_{t-1} + dt_{t,d} u_{t,d} B_t,  y_{t,d} = <C_t, h_t> + D_d u_{t,d}.
//
// The 32 lanes split the N state entries: lane l holds entries n = l + 32 k, k < S, in
// registers (S, the states per lane, is a compile-time 1, 2, 4 or 8 the host picks from N, so
// N <= 256; entries n >= N are idle). Each step, every lane updates its entries and sums its
// part of <C_t, h_t>; a shuffle reduction adds the 32 parts and lane 0 writes y_t. Lanes read
// consecutive n, so the B_t and C_t rows load coalesced (and stay in cache for the block's
// other channels, which read the same rows). SCAN_WARPS channels per block; the grid is
// (ceil(D / SCAN_WARPS), B), and a warp past the last channel returns (as a whole: no block
// barrier is used).
//
// Layouts (row-major, as src/sequence_mixers/reference.rs): u, delta, y [B, T, D]; A [D, N];
// Bm, Cm [B, T, N]; D [D]; initial and final state [B, D, N]. delta, A, D and the states are
// float32 (delta after the softplus); has_d and has_initial say whether D and the initial state
// are given (when 0 the pointer is any valid buffer and is not read: D = 0, zeros).
// scan_fwd_<t>_s<S>: <t> is f32 (float u, Bm, Cm and y) or bf16 (u, Bm, Cm and y as bf16 bits).
// T >= 1 (the host handles T = 0). Offsets are 64-bit. No headers (NVRTC).

#define SCAN_WARPS 8
#define SCAN_THREADS (32 * SCAN_WARPS)

// u16, ld and st: prelude.cuh, prepended by the host.

template <typename T, int S>
__device__ void scan_fwd(const T* __restrict__ u, const float* __restrict__ delta,
                         const float* __restrict__ A, const T* __restrict__ Bm,
                         const T* __restrict__ Cm, const float* __restrict__ D, int has_d,
                         const float* __restrict__ initial_state, int has_initial,
                         T* __restrict__ y, float* __restrict__ final_state, int T_len,
                         int channels, int N) {
    const int lane = threadIdx.x & 31;
    const int d = blockIdx.x * SCAN_WARPS + (threadIdx.x >> 5);
    const int b = blockIdx.y;
    if (d >= channels) return;  // the whole warp: d depends on the warp only
    // This (batch entry, channel)'s state row, [B, D, N].
    const long long row = ((long long)b * channels + d) * N;
    float a[S], h[S];
#pragma unroll
    for (int k = 0; k < S; ++k) {
        const int n = lane + 32 * k;
        const bool live = n < N;
        a[k] = live ? A[(long long)d * N + n] : 0.f;
        h[k] = (live && has_initial) ? initial_state[row + n] : 0.f;
    }
    const float skip = has_d ? D[d] : 0.f;
    // The steps' inputs come SCAN_AHEAD<S> steps at a time, each group loaded into registers
    // while the one before it is computed: a step's own loads no longer stall it.
    constexpr int AH = S <= 2 ? 8 : (S == 4 ? 4 : 2);
    float cu[AH], cd[AH], cb[AH][S], cc[AH][S];
    auto load = [&](int t0, float* lu, float* ldt, float (*lb)[S], float (*lc)[S]) {
#pragma unroll
        for (int j = 0; j < AH; ++j) {
            const int t = t0 + j;
            if (t < T_len) {
                const long long bt = (long long)b * T_len + t;
                const long long i = bt * channels + d;  // u, delta, y [B, T, D]
                lu[j] = ld(u, i);
                ldt[j] = delta[i];
#pragma unroll
                for (int k = 0; k < S; ++k) {
                    const int n = lane + 32 * k;
                    lb[j][k] = n < N ? ld(Bm, bt * N + n) : 0.f;  // B_t, C_t: [B, T, N]
                    lc[j][k] = n < N ? ld(Cm, bt * N + n) : 0.f;
                }
            }
        }
    };
    load(0, cu, cd, cb, cc);
    for (int t0 = 0; t0 < T_len; t0 += AH) {
        float nu[AH], nd[AH], nb[AH][S], nc[AH][S];
        load(t0 + AH, nu, nd, nb, nc);
#pragma unroll
        for (int j = 0; j < AH; ++j) {
            const int t = t0 + j;
            if (t < T_len) {
                const float du = cd[j] * cu[j];
                float part = 0.f;
#pragma unroll
                for (int k = 0; k < S; ++k) {
                    h[k] = __expf(cd[j] * a[k]) * h[k] + du * cb[j][k];
                    part += cc[j][k] * h[k];
                }
#pragma unroll
                for (int off = 16; off > 0; off >>= 1)
                    part += __shfl_xor_sync(0xffffffffu, part, off);
                if (lane == 0) st(y, ((long long)b * T_len + t) * channels + d, part + skip * cu[j]);
            }
        }
#pragma unroll
        for (int j = 0; j < AH; ++j) {
            cu[j] = nu[j];
            cd[j] = nd[j];
#pragma unroll
            for (int k = 0; k < S; ++k) {
                cb[j][k] = nb[j][k];
                cc[j][k] = nc[j][k];
            }
        }
    }
#pragma unroll
    for (int k = 0; k < S; ++k) {
        const int n = lane + 32 * k;
        if (n < N) final_state[row + n] = h[k];
    }
}

#define SCAN_ENTRY(NAME, T, S)                                                                 \
    extern "C" __global__ void __launch_bounds__(SCAN_THREADS, 2)                              \
    scan_fwd_##NAME##_s##S(const T* u, const float* delta, const float* A, const T* Bm,       \
                           const T* Cm, const float* D, int has_d, const float* initial_state, \
                           int has_initial, T* y, float* final_state, int T_len, int channels, \
                           int N) {                                                            \
        scan_fwd<T, S>(u, delta, A, Bm, Cm, D, has_d, initial_state, has_initial, y,          \
                       final_state, T_len, channels, N);                                       \
    }

SCAN_ENTRY(f32, float, 1)
SCAN_ENTRY(f32, float, 2)
SCAN_ENTRY(f32, float, 4)
SCAN_ENTRY(f32, float, 8)
SCAN_ENTRY(bf16, u16, 1)
SCAN_ENTRY(bf16, u16, 2)
SCAN_ENTRY(bf16, u16, 4)
SCAN_ENTRY(bf16, u16, 8)
