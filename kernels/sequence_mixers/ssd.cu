// SSD (Mamba-2's state-space dual layer; Dao and Gu, 2024, "Transformers are SSMs", the block
// decomposition of section 6) on CUDA cores in float32, version 1: correctness first, the
// chunked algorithm of src/sequence_mixers/chunked.rs (its docstring derives it) in three
// kernels, each a grid over (chunk, head, batch entry) or (head, batch entry):
//
// 1. ssd_chunk_state_<t>: per chunk of L steps (the last one shorter), the cumulative log
//    decays cs_i = sum_{j<=i} dt_j A_h, the chunk's own state contribution
//    S_c = sum_j exp(cs_last - cs_j) (dt_j x_j) B_j^T (P x N) into `states`, and cs_last into
//    `chunk_log_decay`.
// 2. ssd_state_passing: per (batch entry, head) and slice of the state's elements (a grid over
//    (head, batch entry, slice)), sequentially over chunks: the state entering
//    chunk c replaces S_c in `states` (so kernel 3 reads it), running = exp(cs_last_c) running
//    + S_c; the state after the last chunk is the final state.
// 3. ssd_chunk_scan_<t>: per chunk, y_i = sum_{j<=i} (C_i . B_j) exp(cs_i - cs_j) (dt_j x_j)
//    + exp(cs_i) S_in C_i + D_h x_i.
//
// Layouts (row-major, as src/sequence_mixers/reference.rs): x, y [B, T, H, P]; dt [B, T, H]
// (float32, after the softplus); A, D [H] (float32); Bm, Cm [B, T, G, N];
// initial and final state [B, H, P, N] (float32); has_d and has_initial say whether D and the
// initial state are given (when 0 the pointer is any valid buffer and is not read: D = 0, zeros);
// states [B, H, n_chunks, P, N] and chunk_log_decay [B, H, n_chunks] (float32 scratch).
// <t> is f32 (float inputs and output) or bf16 (x, Bm, Cm and y as bf16 bits).
// Dynamic shared memory: kernel 1 (L*P + L*N + L) floats, kernel 3
// (L*N + (L + P)*(N | 1) + L*L + L*P + L) floats (the host computes both:
// src/sequence_mixers/cuda.rs). Kernel 3's B and entering-state rows are N | 1 floats, an odd
// stride: its threads read one column of them at a time (a step j, or a head_dim index p, per
// lane), which with rows of N floats (N a multiple of 32) put every lane of a warp on one bank.
// Offsets are 64-bit. No headers (NVRTC).

#define SSD_THREADS 256
#define SSD_CHUNK 64

// u16, ld and st: prelude.cuh, prepended by the host.

// The cumulative log decays of one chunk into cs[0..l), l <= SSD_CHUNK steps: the steps' dt a
// loaded by all threads at once, then summed in order by one (a single thread loading them one
// after another waited on global memory l times per block). Every thread calls it; cs is ready
// after the caller's next barrier.
__device__ __forceinline__ void chunk_cumsum(const float* dt, float a, long long t0, int l,
                                             int heads, int h, float* cs) {
    for (int i = threadIdx.x; i < l; i += SSD_THREADS) cs[i] = dt[(t0 + i) * heads + h] * a;
    __syncthreads();
    if (threadIdx.x == 0)
        for (int i = 1; i < l; ++i) cs[i] += cs[i - 1];
}

template <typename T>
__device__ void chunk_state(const T* __restrict__ x, const float* __restrict__ dt,
                            const float* __restrict__ A, const T* __restrict__ Bm,
                            float* __restrict__ states, float* __restrict__ chunk_log_decay,
                            int T_len, int heads, int groups, int P, int N) {
    extern __shared__ float smem[];
    const int c = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int n_chunks = gridDim.x;
    const int g = h / (heads / groups);
    const long long t0 = (long long)b * T_len + (long long)c * SSD_CHUNK;
    const int l = min(SSD_CHUNK, T_len - c * SSD_CHUNK);
    float* dx = smem;                      // [L][P]
    float* bs = dx + SSD_CHUNK * P;        // [L][N]
    float* cs = bs + SSD_CHUNK * N;        // [L]
    chunk_cumsum(dt, A[h], t0, l, heads, h, cs);
    for (int e = threadIdx.x; e < l * P; e += SSD_THREADS) {
        const int i = e / P, p = e % P;
        dx[e] = dt[(t0 + i) * heads + h] * ld(x, ((t0 + i) * heads + h) * P + p);
    }
    for (int e = threadIdx.x; e < l * N; e += SSD_THREADS) {
        const int i = e / N, n = e % N;
        bs[e] = ld(Bm, ((t0 + i) * groups + g) * N + n);
    }
    __syncthreads();
    const float last = cs[l - 1];
    // The decay from each step to the chunk's end, folded into dt x once (not per (p, n)).
    for (int e = threadIdx.x; e < l * P; e += SSD_THREADS) dx[e] *= __expf(last - cs[e / P]);
    __syncthreads();
    float* out = states + (((long long)b * heads + h) * n_chunks + c) * P * N;
    for (int e = threadIdx.x; e < P * N; e += SSD_THREADS) {
        const int p = e / N, n = e % N;
        float acc = 0.f;
        for (int j = 0; j < l; ++j) acc += dx[j * P + p] * bs[j * N + n];
        out[e] = acc;
    }
    if (threadIdx.x == 0) chunk_log_decay[((long long)b * heads + h) * n_chunks + c] = last;
}

// TY, the type of y: T, or float32 for ssd_chunk_scan_bf16_f32out.
template <typename T, typename TY>
__device__ void chunk_scan(const T* __restrict__ x, const float* __restrict__ dt,
                           const float* __restrict__ A, const T* __restrict__ Bm,
                           const T* __restrict__ Cm, const float* __restrict__ D, int has_d,
                           const float* __restrict__ states, TY* __restrict__ y, int T_len,
                           int heads, int groups, int P, int N) {
    extern __shared__ float smem[];
    const int c = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int n_chunks = gridDim.x;
    const int g = h / (heads / groups);
    const long long t0 = (long long)b * T_len + (long long)c * SSD_CHUNK;
    const int l = min(SSD_CHUNK, T_len - c * SSD_CHUNK);
    const int NP = N | 1;                   // odd row of B and of the entering state
    float* cs_ = smem;                      // [L][N]: C
    float* bs = cs_ + SSD_CHUNK * N;        // [L][NP]: B
    float* s_in = bs + SSD_CHUNK * NP;      // [P][NP]: the state entering the chunk
    float* m = s_in + P * NP;               // [L][L]: (C_i . B_j) exp(cs_i - cs_j), j <= i
    float* dx = m + SSD_CHUNK * SSD_CHUNK;  // [L][P]
    float* cum = dx + SSD_CHUNK * P;        // [L]
    chunk_cumsum(dt, A[h], t0, l, heads, h, cum);
    for (int e = threadIdx.x; e < l * N; e += SSD_THREADS) {
        const int i = e / N, n = e % N;
        const long long at = ((t0 + i) * groups + g) * N + n;
        cs_[e] = ld(Cm, at);
        bs[i * NP + n] = ld(Bm, at);
    }
    const float* src = states + (((long long)b * heads + h) * n_chunks + c) * P * N;
    for (int e = threadIdx.x; e < P * N; e += SSD_THREADS) s_in[(e / N) * NP + e % N] = src[e];
    for (int e = threadIdx.x; e < l * P; e += SSD_THREADS) {
        const int i = e / P, p = e % P;
        dx[e] = dt[(t0 + i) * heads + h] * ld(x, ((t0 + i) * heads + h) * P + p);
    }
    __syncthreads();
    for (int e = threadIdx.x; e < l * l; e += SSD_THREADS) {
        const int i = e / l, j = e % l;
        float v = 0.f;
        if (j <= i) {
            for (int n = 0; n < N; ++n) v += cs_[i * N + n] * bs[j * NP + n];
            v *= __expf(cum[i] - cum[j]);
        }
        m[i * SSD_CHUNK + j] = v;
    }
    __syncthreads();
    const float skip = has_d ? D[h] : 0.f;
    for (int e = threadIdx.x; e < l * P; e += SSD_THREADS) {
        const int i = e / P, p = e % P;
        float acc = 0.f;
        for (int j = 0; j <= i; ++j) acc += m[i * SSD_CHUNK + j] * dx[j * P + p];
        float off = 0.f;
        for (int n = 0; n < N; ++n) off += s_in[p * NP + n] * cs_[i * N + n];
        const long long at = ((t0 + i) * heads + h) * P + p;
        st(y, at, acc + __expf(cum[i]) * off + skip * ld(x, at));
    }
}

// Version 2 for bf16 inputs: kernels 1 and 3 with their products on tensor cores
// (mma.sync m16n8k16, bf16 operands, float32 accumulation; prelude.cuh's mma_bf16). The
// operands are staged in shared memory as bf16 rows of an even stride (N + 8 or L + 8 halves,
// so that the 8 rows a fragment load touches start 4 banks apart): B, C and x exactly, and
// rounded to bf16 where the CUDA-core kernels keep float32: Δ x (decayed to the chunk's end in
// kernel 1), the masked decayed C Bᵀ, and the state entering the chunk. Rows past a short
// last chunk are zero. Needs P % 16 == 0, N % 32 == 0 and P, N <= 128 (the host checks; other
// shapes take the float32 kernels). 8 warps.
#define SSD_TC_MAX_TILES 8

// Word (two bf16) at row r, column k (even) of a bf16 array with rows `stride` halves apart.
__device__ __forceinline__ u32 ld2(const u16* base, int r, int stride, int k) {
    return *reinterpret_cast<const u32*>(base + r * stride + k);
}

// acc[nt] += A B over k_steps steps of 16 for the warp's 16 rows from r0: A's rows are rows of
// the bf16 array `a` (`a_stride` halves apart), B's columns n0 + 8 nt + (0..7) are rows of the
// bf16 array `b` (B transposed), for the first `tiles` of NT tiles of 8 columns.
template <int NT>
__device__ __forceinline__ void mma_rows(float (*acc)[4], const u16* a, int a_stride, int r0,
                                         const u16* b, int b_stride, int n0, int k_steps,
                                         int tiles = NT) {
    const int lane = threadIdx.x % 32, gi = lane / 4, ti = lane % 4;
    for (int ks = 0; ks < k_steps; ++ks) {
        const int k = ks * 16 + 2 * ti;
        const u32 f[4] = {ld2(a, r0 + gi, a_stride, k), ld2(a, r0 + gi + 8, a_stride, k),
                          ld2(a, r0 + gi, a_stride, k + 8), ld2(a, r0 + gi + 8, a_stride, k + 8)};
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            if (nt < tiles) {
                const int n = n0 + nt * 8 + gi;
                mma_bf16(acc[nt], f, ld2(b, n, b_stride, k), ld2(b, n, b_stride, k + 8));
            }
        }
    }
}

// Rows [0, L) of a chunk's B or C (global rows of N bf16 at `src`, row i at i * row_stride)
// into shared rows of `stride` halves, zeros past l.
__device__ __forceinline__ void stage_rows(const u16* __restrict__ src, long long row_stride,
                                           int l, int N, u16* dst, int stride) {
    const int half = N / 2;
    for (int e = threadIdx.x; e < SSD_CHUNK * half; e += SSD_THREADS) {
        const int i = e / half, k = 2 * (e % half);
        u32 w = 0;
        if (i < l) w = *reinterpret_cast<const u32*>(src + i * row_stride + k);
        *reinterpret_cast<u32*>(dst + i * stride + k) = w;
    }
}

// Kernel 1 on tensor cores: S_c[p][n] = sum_j (exp(cs_last - cs_j) dt_j x_j[p]) B_j[n], the
// (P x L)(L x N) product with A = the decayed Δ x transposed ([P][L + 8]) and B's columns as
// rows ([N][L + 8], B transposed). Each warp takes 16 x 32 output tiles in turn.
__device__ void chunk_state_tc(const u16* __restrict__ x, const float* __restrict__ dt,
                               const float* __restrict__ A, const u16* __restrict__ Bm,
                               float* __restrict__ states, float* __restrict__ chunk_log_decay,
                               int T_len, int heads, int groups, int P, int N) {
    extern __shared__ float smem[];
    const int c = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int n_chunks = gridDim.x;
    const int g = h / (heads / groups);
    const long long t0 = (long long)b * T_len + (long long)c * SSD_CHUNK;
    const int l = min(SSD_CHUNK, T_len - c * SSD_CHUNK);
    const int LS = SSD_CHUNK + 8;
    float* cs = smem;                                          // [L]
    u16* dxt = reinterpret_cast<u16*>(cs + SSD_CHUNK);         // [P][LS]
    u16* bt = dxt + P * LS;                                    // [N][LS]
    chunk_cumsum(dt, A[h], t0, l, heads, h, cs);
    __syncthreads();
    const float last = cs[l - 1];
    for (int e = threadIdx.x; e < SSD_CHUNK * P; e += SSD_THREADS) {
        const int j = e / P, p = e % P;
        float v = 0.f;
        if (j < l) v = dt[(t0 + j) * heads + h] * __expf(last - cs[j]) * ld(x, ((t0 + j) * heads + h) * P + p);
        dxt[p * LS + j] = to_bf16(v);
    }
    for (int e = threadIdx.x; e < SSD_CHUNK * N; e += SSD_THREADS) {
        const int j = e / N, n = e % N;
        bt[n * LS + j] = j < l ? Bm[((t0 + j) * groups + g) * N + n] : (u16)0;
    }
    __syncthreads();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gi = lane / 4, ti = lane % 4;
    float* out = states + (((long long)b * heads + h) * n_chunks + c) * P * N;
    const int col_groups = N / 32, units = (P / 16) * col_groups;
    for (int u = warp; u < units; u += SSD_THREADS / 32) {
        const int r0 = (u / col_groups) * 16, c0 = (u % col_groups) * 32;
        float acc[4][4] = {};
        mma_rows<4>(acc, dxt, LS, r0, bt, LS, c0, SSD_CHUNK / 16);
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int p = r0 + gi + (e >= 2 ? 8 : 0), n = c0 + nt * 8 + 2 * ti + (e & 1);
                out[p * N + n] = acc[nt][e];
            }
    }
    if (threadIdx.x == 0) chunk_log_decay[((long long)b * heads + h) * n_chunks + c] = last;
}

// Kernel 3 on tensor cores. Each warp owns 16 rows of the chunk (w % 4) and half of the P
// columns (w / 4): first its 16 x 32 block of M = (C Bᵀ) masked (j <= i < l) and decayed
// (exp(cs_i - cs_j)) into shared memory as bf16, then, after a barrier, its block of
// Y = M (Δ x) + exp(cs_i) C S_inᵀ + D x (the M product over the 16-step blocks at or left of
// the diagonal only).
template <typename TY>
__device__ void chunk_scan_tc(const u16* __restrict__ x, const float* __restrict__ dt,
                              const float* __restrict__ A, const u16* __restrict__ Bm,
                              const u16* __restrict__ Cm, const float* __restrict__ D, int has_d,
                              const float* __restrict__ states, TY* __restrict__ y, int T_len,
                              int heads, int groups, int P, int N) {
    extern __shared__ float smem[];
    const int c = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int n_chunks = gridDim.x;
    const int g = h / (heads / groups);
    const long long t0 = (long long)b * T_len + (long long)c * SSD_CHUNK;
    const int l = min(SSD_CHUNK, T_len - c * SSD_CHUNK);
    const int NS = N + 8, LS = SSD_CHUNK + 8;
    float* cum = smem;                                         // [L]
    u16* cs_ = reinterpret_cast<u16*>(cum + SSD_CHUNK);        // [L][NS]: C
    u16* bs = cs_ + SSD_CHUNK * NS;                            // [L][NS]: B
    u16* s_in = bs + SSD_CHUNK * NS;                           // [P][NS]: entering state
    u16* dxt = s_in + P * NS;                                  // [P][LS]: (Δ x)ᵀ
    u16* m = dxt + P * LS;                                     // [L][LS]: M
    chunk_cumsum(dt, A[h], t0, l, heads, h, cum);
    const long long row_stride = (long long)groups * N;
    stage_rows(Cm + (t0 * groups + g) * N, row_stride, l, N, cs_, NS);
    stage_rows(Bm + (t0 * groups + g) * N, row_stride, l, N, bs, NS);
    const float* src = states + (((long long)b * heads + h) * n_chunks + c) * P * N;
    for (int e = threadIdx.x; e < P * N / 2; e += SSD_THREADS) {
        const int p = e / (N / 2), k = 2 * (e % (N / 2));
        *reinterpret_cast<u32*>(s_in + p * NS + k) = pack_bf16(src[p * N + k], src[p * N + k + 1]);
    }
    for (int e = threadIdx.x; e < SSD_CHUNK * P; e += SSD_THREADS) {
        const int j = e / P, p = e % P;
        float v = 0.f;
        if (j < l) v = dt[(t0 + j) * heads + h] * ld(x, ((t0 + j) * heads + h) * P + p);
        dxt[p * LS + j] = to_bf16(v);
    }
    __syncthreads();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gi = lane / 4, ti = lane % 4;
    const int r0 = (warp % 4) * 16;
    {
        const int c0 = (warp / 4) * 32;
        float acc[4][4] = {};
        mma_rows<4>(acc, cs_, NS, r0, bs, NS, c0, N / 16);
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
            for (int e = 0; e < 4; e += 2) {
                const int i = r0 + gi + (e >= 2 ? 8 : 0), j = c0 + nt * 8 + 2 * ti;
                const float v0 = (j <= i && i < l) ? acc[nt][e] * __expf(cum[i] - cum[j]) : 0.f;
                const float v1 = (j + 1 <= i && i < l) ? acc[nt][e + 1] * __expf(cum[i] - cum[j + 1]) : 0.f;
                *reinterpret_cast<u32*>(m + i * LS + j) = pack_bf16(v0, v1);
            }
    }
    __syncthreads();
    const int tiles = P / 16, p0 = (warp / 4) * (P / 2);
    float diag[SSD_TC_MAX_TILES][4] = {}, off[SSD_TC_MAX_TILES][4] = {};
    // M's blocks right of the diagonal are zero: the product stops at the rows' own block.
    mma_rows<SSD_TC_MAX_TILES>(diag, m, LS, r0, dxt, LS, p0, r0 / 16 + 1, tiles);
    mma_rows<SSD_TC_MAX_TILES>(off, cs_, NS, r0, s_in, NS, p0, N / 16, tiles);
    const float skip = has_d ? D[h] : 0.f;
#pragma unroll
    for (int nt = 0; nt < SSD_TC_MAX_TILES; ++nt) {
        if (nt >= tiles) continue;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int i = r0 + gi + (e >= 2 ? 8 : 0), p = p0 + nt * 8 + 2 * ti + (e & 1);
            if (i < l) {
                const long long at = ((t0 + i) * heads + h) * P + p;
                st(y, at, diag[nt][e] + __expf(cum[i]) * off[nt][e] + skip * ld(x, at));
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(SSD_THREADS)
ssd_state_passing(float* __restrict__ states, const float* __restrict__ chunk_log_decay,
                  const float* __restrict__ initial_state, int has_initial,
                  float* __restrict__ final_state, int heads, int n_chunks, int P, int N) {
    // Blocks (h, b, z) share the P x N state elements of (batch entry, head) by z: enough
    // threads walking the chunks at once that the loads of successive chunks overlap.
    const int h = blockIdx.x, b = blockIdx.y;
    const long long bh = (long long)b * heads + h;
    float* s = states + bh * n_chunks * P * N;
    const float* decay = chunk_log_decay + bh * n_chunks;
    for (int e = blockIdx.z * SSD_THREADS + threadIdx.x; e < P * N; e += SSD_THREADS * gridDim.z) {
        float running = has_initial ? initial_state[bh * P * N + e] : 0.f;
        for (int c = 0; c < n_chunks; ++c) {
            const float local = s[(long long)c * P * N + e];
            s[(long long)c * P * N + e] = running;
            running = __expf(decay[c]) * running + local;
        }
        final_state[bh * P * N + e] = running;
    }
}

#define SSD_ENTRIES(NAME, T)                                                                   \
    extern "C" __global__ void __launch_bounds__(SSD_THREADS)                                  \
    ssd_chunk_state_##NAME(const T* x, const float* dt, const float* A, const T* Bm,          \
                           float* states, float* chunk_log_decay, int T_len, int heads,        \
                           int groups, int P, int N) {                                         \
        chunk_state<T>(x, dt, A, Bm, states, chunk_log_decay, T_len, heads, groups, P, N);     \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(SSD_THREADS)                                  \
    ssd_chunk_scan_##NAME(const T* x, const float* dt, const float* A, const T* Bm,           \
                          const T* Cm, const float* D, int has_d, const float* states, T* y,  \
                          int T_len, int heads, int groups, int P, int N) {                    \
        chunk_scan<T, T>(x, dt, A, Bm, Cm, D, has_d, states, y, T_len, heads, groups, P, N);   \
    }

SSD_ENTRIES(f32, float)
SSD_ENTRIES(bf16, u16)

// The chunk scan with a float32 y from bf16 inputs (Based's linear branch, which adds y to its
// window branch before rounding: src/sequence_mixers/based_cuda.rs).
extern "C" __global__ void __launch_bounds__(SSD_THREADS)
ssd_chunk_scan_bf16_f32out(const u16* x, const float* dt, const float* A, const u16* Bm,
                           const u16* Cm, const float* D, int has_d, const float* states,
                           float* y, int T_len, int heads, int groups, int P, int N) {
    chunk_scan<u16, float>(x, dt, A, Bm, Cm, D, has_d, states, y, T_len, heads, groups, P, N);
}

// Version 2's entry points (bf16 only; the tensor-core kernels above).
extern "C" __global__ void __launch_bounds__(SSD_THREADS)
ssd_chunk_state_tc(const u16* x, const float* dt, const float* A, const u16* Bm, float* states,
                   float* chunk_log_decay, int T_len, int heads, int groups, int P, int N) {
    chunk_state_tc(x, dt, A, Bm, states, chunk_log_decay, T_len, heads, groups, P, N);
}
extern "C" __global__ void __launch_bounds__(SSD_THREADS)
ssd_chunk_scan_tc(const u16* x, const float* dt, const float* A, const u16* Bm, const u16* Cm,
                  const float* D, int has_d, const float* states, u16* y, int T_len, int heads,
                  int groups, int P, int N) {
    chunk_scan_tc<u16>(x, dt, A, Bm, Cm, D, has_d, states, y, T_len, heads, groups, P, N);
}
extern "C" __global__ void __launch_bounds__(SSD_THREADS)
ssd_chunk_scan_tc_f32out(const u16* x, const float* dt, const float* A, const u16* Bm,
                         const u16* Cm, const float* D, int has_d, const float* states, float* y,
                         int T_len, int heads, int groups, int P, int N) {
    chunk_scan_tc<float>(x, dt, A, Bm, Cm, D, has_d, states, y, T_len, heads, groups, P, N);
}
