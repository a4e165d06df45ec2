// The gated delta rule forward (Gated DeltaNet; Yang, Kautz and Hatamizadeh, 2024, "Gated
// Delta Networks: Improving Mamba2 with Delta Rule"). Two paths, chosen by the host
// (src/sequence_mixers/delta_cuda.rs, `tc_shared_bytes`): version 3 (3.1 to 8) for bf16 with
// K a multiple of 32 and V of 16, on tensor cores (kernels 1'-3', described before their code
// below); every other case version 2, on CUDA cores in float32, described here: the
// chunked WY form of src/sequence_mixers/chunked.rs (its docstring derives it; Yang et al.,
// 2024, "Parallelizing Linear Transformers with the Delta Rule over Sequence Length", section
// 3) in three kernels, so that only the state walks the chunks in order. Per chunk of l steps
// (GDN_CHUNK, the last one shorter), with g_i = ln a_0 + ... + ln a_i inside the chunk and
// gamma_i = exp(g_i):
//
// 1. gdn_prepare_<t>, a block per (chunk, head, batch entry), every chunk at once:
//    A_ij = beta_i exp(g_i - g_j) (k_i . k_j) for j < i; forward substitution of
//    (I + A) [U~ | W] = [diag(beta) V | diag(beta gamma) K] (one thread per column of the
//    V + K right-hand sides, rows in order); W, U~ and g into scratch.
// 2. gdn_state_pass_<t>, a block per GDN_ROWS rows of the state (V x K; its rows, one per value
//    index, evolve independently), head and batch entry, walking the chunks in order: the state
//    entering the chunk into `states`; U = U~ - W S^T (its rows' columns, written over U~);
//    S <- gamma_{l-1} S + sum_j exp(g_{l-1} - g_j) u_j k_j^T. The state after the last chunk is
//    the final state.
// 3. gdn_output_<t>, a block per (chunk, head, batch entry), every chunk at once:
//    M_ij = exp(g_i - g_j) (q_i . k_j) for j <= i; O_i = gamma_i S_in q_i + sum_{j<=i} M_ij u_j,
//    written in the dtype.
//
// Layouts (row-major, as src/sequence_mixers/reference.rs): q, k [B, T, H, K]; v, o
// [B, T, H, V]; alpha, beta [B, T, H] (float32); initial and final state [B, H, V, K]
// (float32, value-major); has_initial says whether the initial state is given (when 0 the
// pointer is any valid buffer and is not read: zeros). Scratch (float32): w [B, H, n_chunks,
// L, K], u [B, H, n_chunks, L, V], g [B, H, n_chunks, L] (rows past a short last chunk are
// neither written nor read) and states [B, H, n_chunks, V, K]. <t> is f32 (float q, k, v and
// o) or bf16 (q, k, v and o as bf16 bits). K, V <= GDN_MAX_DIM.
// Dynamic shared memory, floats (the host computes each: src/sequence_mixers/delta_cuda.rs),
// L = GDN_CHUNK, KP = K | 1, RP = GDN_ROWS + 1:
//   prepare 2*L*KP + L*V + L*L + 2*L;  state pass GDN_ROWS*KP + 2*L*KP + L*RP + L;
//   output 2*L*KP + V*KP + L*V + L*L + L.
// Rows of K floats are KP floats apart, an odd stride: where the lanes of a warp read one
// column of such rows (a step j or a state row r per lane) they hit distinct banks.
// Offsets into global memory are 64-bit. No headers (NVRTC).

#define GDN_THREADS 256
#define GDN_CHUNK 64
#define GDN_MAX_DIM 128
#define GDN_ROWS 16

// u16, ld and st: prelude.cuh, prepended by the host.

// The chunk's cumulative log decays into gs[0..l): the logarithms loaded by all threads, then
// summed in order by one. Every thread calls it; gs is ready after the caller's next barrier.
// ln alpha is floored at -20: alpha = 0 would give -inf, and -inf - -inf a NaN in the ratios
// exp(g_i - g_j), while a deep floor would make the g_i large and their differences lose float32
// digits (ulp(1e4) is 1e-3). A gate under exp(-20) = 2e-9 thus keeps 2e-9 of the state, below
// float32's resolution of the terms it is added to.
__device__ __forceinline__ void gdn_log_decays(const float* __restrict__ alpha, long long t0,
                                               int l, int heads, int h, float* gs) {
    for (int i = threadIdx.x; i < l; i += GDN_THREADS)
        gs[i] = fmaxf(logf(alpha[(t0 + i) * heads + h]), -20.f);
    __syncthreads();
    if (threadIdx.x == 0)
        for (int i = 1; i < l; ++i) gs[i] += gs[i - 1];
}

template <typename T>
__device__ void gdn_prepare(const T* __restrict__ k, const T* __restrict__ v,
                            const float* __restrict__ alpha, const float* __restrict__ beta,
                            float* __restrict__ w_out, float* __restrict__ u_out,
                            float* __restrict__ g_out, int T_len, int heads, int K, int V) {
    extern __shared__ float smem[];
    const int c = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int KP = K | 1;
    const long long t0 = (long long)b * T_len + (long long)c * GDN_CHUNK;
    const int l = min(GDN_CHUNK, T_len - c * GDN_CHUNK);
    float* ks = smem;                       // [L][KP]
    float* ws = ks + GDN_CHUNK * KP;        // [L][KP]: diag(beta gamma) K, then W
    float* us = ws + GDN_CHUNK * KP;        // [L][V]: diag(beta) V, then U~
    float* a = us + GDN_CHUNK * V;          // [L][L]: A (j < i)
    float* gs = a + GDN_CHUNK * GDN_CHUNK;  // [L]: g
    float* bs = gs + GDN_CHUNK;             // [L]: beta
    gdn_log_decays(alpha, t0, l, heads, h, gs);
    for (int i = threadIdx.x; i < l; i += GDN_THREADS) bs[i] = beta[(t0 + i) * heads + h];
    for (int e = threadIdx.x; e < l * K; e += GDN_THREADS) {
        const int i = e / K, col = e % K;
        ks[i * KP + col] = ld(k, ((t0 + i) * heads + h) * K + col);
    }
    for (int e = threadIdx.x; e < l * V; e += GDN_THREADS) {
        const int i = e / V, r = e % V;
        us[e] = ld(v, ((t0 + i) * heads + h) * V + r);
    }
    __syncthreads();
    for (int e = threadIdx.x; e < l * l; e += GDN_THREADS) {
        const int i = e / l, j = e % l;
        if (j < i) {
            float dot = 0.f;
            for (int col = 0; col < K; ++col) dot += ks[i * KP + col] * ks[j * KP + col];
            a[i * GDN_CHUNK + j] = bs[i] * expf(gs[i] - gs[j]) * dot;
        }
    }
    for (int e = threadIdx.x; e < l * V; e += GDN_THREADS) us[e] *= bs[e / V];
    for (int e = threadIdx.x; e < l * K; e += GDN_THREADS) {
        const int i = e / K, col = e % K;
        ws[i * KP + col] = bs[i] * expf(gs[i]) * ks[i * KP + col];
    }
    __syncthreads();
    // Forward substitution: column col of [U~ | W], row i minus sum_{j<i} A_ij row j.
    for (int col = threadIdx.x; col < V + K; col += GDN_THREADS) {
        float* x = col < V ? us + col : ws + (col - V);
        const int stride = col < V ? V : KP;
        for (int i = 1; i < l; ++i) {
            float acc = x[i * stride];
            for (int j = 0; j < i; ++j) acc -= a[i * GDN_CHUNK + j] * x[j * stride];
            x[i * stride] = acc;
        }
    }
    __syncthreads();
    const long long base = ((long long)b * heads + h) * gridDim.x + c;
    for (int e = threadIdx.x; e < l * K; e += GDN_THREADS)
        w_out[base * GDN_CHUNK * K + e] = ws[(e / K) * KP + e % K];
    for (int e = threadIdx.x; e < l * V; e += GDN_THREADS) u_out[base * GDN_CHUNK * V + e] = us[e];
    for (int i = threadIdx.x; i < l; i += GDN_THREADS) g_out[base * GDN_CHUNK + i] = gs[i];
}

template <typename T>
__device__ void gdn_state_pass(const T* __restrict__ k, const float* __restrict__ w_in,
                               float* __restrict__ u_io, const float* __restrict__ g_in,
                               const float* __restrict__ initial_state, int has_initial,
                               float* __restrict__ states, float* __restrict__ final_state,
                               int T_len, int heads, int K, int V, int n_chunks) {
    extern __shared__ float smem[];
    const int r0 = blockIdx.x * GDN_ROWS, h = blockIdx.y, b = blockIdx.z;
    const int rows = min(GDN_ROWS, V - r0);
    const int KP = K | 1, RP = GDN_ROWS + 1;
    const long long bh = (long long)b * heads + h;
    float* s = smem;                        // [ROWS][KP]: this block's rows of the state
    float* ws = s + GDN_ROWS * KP;          // [L][KP]: W
    float* ks = ws + GDN_CHUNK * KP;        // [L][KP]
    float* us = ks + GDN_CHUNK * KP;        // [L][RP]: U~, then exp(g_{l-1} - g_j) u_j
    float* gs = us + GDN_CHUNK * RP;        // [L]: g
    // Thread e holds the same element of s in every loop over rows * K below, so the first
    // chunk's copy to `states` reads what this thread wrote here.
    for (int e = threadIdx.x; e < rows * K; e += GDN_THREADS)
        s[(e / K) * KP + e % K] = has_initial ? initial_state[(bh * V + r0) * K + e] : 0.f;
    for (int c = 0; c < n_chunks; ++c) {
        const int l = min(GDN_CHUNK, T_len - c * GDN_CHUNK);
        const long long t0 = (long long)b * T_len + (long long)c * GDN_CHUNK;
        const long long base = bh * n_chunks + c;
        for (int e = threadIdx.x; e < rows * K; e += GDN_THREADS)
            states[(base * V + r0) * K + e] = s[(e / K) * KP + e % K];
        for (int e = threadIdx.x; e < l * K; e += GDN_THREADS) {
            const int i = e / K, col = e % K;
            ws[i * KP + col] = w_in[base * GDN_CHUNK * K + e];
            ks[i * KP + col] = ld(k, ((t0 + i) * heads + h) * K + col);
        }
        for (int e = threadIdx.x; e < l * rows; e += GDN_THREADS) {
            const int i = e / rows, r = e % rows;
            us[i * RP + r] = u_io[(base * GDN_CHUNK + i) * V + r0 + r];
        }
        for (int i = threadIdx.x; i < l; i += GDN_THREADS) gs[i] = g_in[base * GDN_CHUNK + i];
        __syncthreads();
        const float last = gs[l - 1];
        // U = U~ - W S^T on this block's rows, kept for the output kernel; shared memory keeps
        // it decayed to the chunk's end, as the state update below takes it.
        for (int e = threadIdx.x; e < l * rows; e += GDN_THREADS) {
            const int i = e / rows, r = e % rows;
            float dot = 0.f;
            for (int col = 0; col < K; ++col) dot += ws[i * KP + col] * s[r * KP + col];
            const float u = us[i * RP + r] - dot;
            us[i * RP + r] = expf(last - gs[i]) * u;
            u_io[(base * GDN_CHUNK + i) * V + r0 + r] = u;
        }
        __syncthreads();
        // S <- gamma_{l-1} S + sum_j exp(g_{l-1} - g_j) u_j k_j^T.
        const float keep = expf(last);
        for (int e = threadIdx.x; e < rows * K; e += GDN_THREADS) {
            const int r = e / K, col = e % K;
            float acc = keep * s[r * KP + col];
            for (int j = 0; j < l; ++j) acc += us[j * RP + r] * ks[j * KP + col];
            s[r * KP + col] = acc;
        }
        __syncthreads();
    }
    for (int e = threadIdx.x; e < rows * K; e += GDN_THREADS)
        final_state[(bh * V + r0) * K + e] = s[(e / K) * KP + e % K];
}

template <typename T>
__device__ void gdn_output(const T* __restrict__ q, const T* __restrict__ k,
                           const float* __restrict__ u_in, const float* __restrict__ g_in,
                           const float* __restrict__ states, T* __restrict__ o, int T_len,
                           int heads, int K, int V) {
    extern __shared__ float smem[];
    const int c = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int KP = K | 1;
    const long long t0 = (long long)b * T_len + (long long)c * GDN_CHUNK;
    const int l = min(GDN_CHUNK, T_len - c * GDN_CHUNK);
    const long long base = ((long long)b * heads + h) * gridDim.x + c;
    float* qs = smem;                       // [L][KP]
    float* ks = qs + GDN_CHUNK * KP;        // [L][KP]
    float* s_in = ks + GDN_CHUNK * KP;      // [V][KP]: the state entering the chunk
    float* us = s_in + V * KP;              // [L][V]: U
    float* m = us + GDN_CHUNK * V;          // [L][L]: M (j <= i)
    float* gs = m + GDN_CHUNK * GDN_CHUNK;  // [L]: g
    for (int e = threadIdx.x; e < l * K; e += GDN_THREADS) {
        const int i = e / K, col = e % K;
        const long long at = ((t0 + i) * heads + h) * K + col;
        qs[i * KP + col] = ld(q, at);
        ks[i * KP + col] = ld(k, at);
    }
    for (int e = threadIdx.x; e < V * K; e += GDN_THREADS)
        s_in[(e / K) * KP + e % K] = states[base * V * K + e];
    for (int e = threadIdx.x; e < l * V; e += GDN_THREADS) us[e] = u_in[base * GDN_CHUNK * V + e];
    for (int i = threadIdx.x; i < l; i += GDN_THREADS) gs[i] = g_in[base * GDN_CHUNK + i];
    __syncthreads();
    for (int e = threadIdx.x; e < l * l; e += GDN_THREADS) {
        const int i = e / l, j = e % l;
        if (j <= i) {
            float dot = 0.f;
            for (int col = 0; col < K; ++col) dot += qs[i * KP + col] * ks[j * KP + col];
            m[i * GDN_CHUNK + j] = expf(gs[i] - gs[j]) * dot;
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < l * V; e += GDN_THREADS) {
        const int i = e / V, r = e % V;
        float off = 0.f;
        for (int col = 0; col < K; ++col) off += s_in[r * KP + col] * qs[i * KP + col];
        float acc = expf(gs[i]) * off;
        for (int j = 0; j <= i; ++j) acc += m[i * GDN_CHUNK + j] * us[j * V + r];
        st(o, ((t0 + i) * heads + h) * V + r, acc);
    }
}

#define GDN_ENTRIES(NAME, T)                                                                   \
    extern "C" __global__ void __launch_bounds__(GDN_THREADS)                                  \
    gdn_prepare_##NAME(const T* k, const T* v, const float* alpha, const float* beta,         \
                       float* w, float* u, float* g, int T_len, int heads, int K, int V) {     \
        gdn_prepare<T>(k, v, alpha, beta, w, u, g, T_len, heads, K, V);                        \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(GDN_THREADS)                                  \
    gdn_state_pass_##NAME(const T* k, const float* w, float* u, const float* g,               \
                          const float* initial_state, int has_initial, float* states,          \
                          float* final_state, int T_len, int heads, int K, int V,              \
                          int n_chunks) {                                                      \
        gdn_state_pass<T>(k, w, u, g, initial_state, has_initial, states, final_state, T_len,  \
                          heads, K, V, n_chunks);                                              \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(GDN_THREADS)                                  \
    gdn_output_##NAME(const T* q, const T* k, const float* u, const float* g,                 \
                      const float* states, T* o, int T_len, int heads, int K, int V) {         \
        gdn_output<T>(q, k, u, g, states, o, T_len, heads, K, V);                              \
    }

GDN_ENTRIES(f32, float)
GDN_ENTRIES(bf16, u16)

// Version 3 for bf16 (tensor cores: mma.sync m16n8k16, bf16 operands, float32 accumulation;
// the operands by cp.async and ldmatrix, prelude.cuh's tile helpers): 1'. gdn_prepare_tc
// (below: the chunk's products and its inverse on tensor cores, W and U~ as bf16); then
// 2'. gdn_state_tc_r<RG>_s<STAGES>: a block of RG groups of 4 warps, each group GDN_TC_ROWS
//     rows of the state (value indices), per head and batch entry, holds its rows in the warps'
//     mma accumulators (float32; a warp owns a quarter of the K columns of its group's rows) and
//     walks the chunks in order, their W, k, U~ columns and g brought STAGES - 1 chunks ahead
//     (version 4; version 3 was RG = 1 and 2 stages): the entering state to `states` (bf16) and to shared
//     memory; U = U~ - W S^T (16 steps per warp) over U~ in `u` (bf16, for the output
//     kernel; a block reads and writes only its own columns, a chunk's U~ before its U) and,
//     decayed by exp(g_last - g_j), to shared memory; then S <- exp(g_last) S + U_decᵀ k.
//     The float32 state after the last chunk is the final state.
// 2''. gdn_walk_out_w<WARPS>_s<STAGES>_k<K>v<V> (version 8, at K = V = 128 instead of 2' and
//     3', after gdn_prepare_tcm_k<K>v<V>, which also writes M): the same walk with each warp
//     holding 16 whole rows (all K columns; version 5), no exchange between warps within a
//     chunk, and the output computed in it (described before its code below). At K = V = 64,
//     gdn_state_w1_s4_k64v64 (version 9) is that walk without the output, between
//     gdn_prepare_tc_k64v64 and gdn_output_tc_k64v64.
// 3'. gdn_output_tc: SSD's chunk scan (ssd.cu, kernel B) with C = q, B = k, x = U, no dt and
//     no D: M = (Q Kᵀ) masked to j <= i < l and scaled by exp(g_i - g_j) into shared memory as
//     bf16, then O = M U + exp(g_i) Q S_inᵀ, each of the 8 warps 16 rows and half of the V
//     columns.
// Needs K a multiple of 32 and V of 16, both at most GDN_MAX_DIM (the host checks). Scratch of
// this path: W [B, H, n_chunks, L, K] and U~, then U [B, H, n_chunks, L, V] bf16 (version 6;
// U~ was float32 in a buffer of its own before), g float32 as above, states
// [B, H, n_chunks, V, K] bf16; the fused walk instead M [B, H, n_chunks, L, L] bf16, and no
// states (U~ is then read, not written over). Dynamic shared memory, bytes (the host computes
// it), R = GDN_TC_ROWS RG: state STAGES (L 2 (K + 8) 2 + L (R + 8) 2 + L 4) + R (K + 8) 2 +
// L (R + 8) 2; whole-row walk (version 9) STAGES (L 2 (K + 8) 2 + L (R + 8) 2 + L 4), R = 16
// WARPS; fused walk STAGES (L 3 (K + 8) 2 + L (R + 8) 2 + L (L + 8) 2 + L 4);
// output L 4 + (2 L (K + 8) + L (V + 8) + V (K + 8) + L (L + 8)) 2.
// A row group of the state walk: GDN_TC_ROWS rows of the state, GDN_TC_THREADS threads.
#define GDN_TC_THREADS 128
#define GDN_TC_ROWS 16

// A warp's NT tiles of 8 state columns from n0 (the first `tiles` of them) for its 16 rows
// from row (mma C layout: row g / g + 8, columns 8 nt + 2 t and + 1), of a state [V][K]
// (float32, from `s`, value-major): read into acc, zeros where has_initial is 0 or past
// `tiles` (gdn_state_frags_load), or written from acc (gdn_state_frags_store).
template <int NT>
__device__ __forceinline__ void gdn_state_frags_load(float (*acc)[4], const float* s,
                                                     int has_initial, int row, int n0, int tiles,
                                                     int K) {
    const int gi = (threadIdx.x % 32) / 4, ti = threadIdx.x % 4;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int r = row + gi + (e >= 2 ? 8 : 0), col = n0 + nt * 8 + 2 * ti + (e & 1);
            acc[nt][e] = (nt < tiles && has_initial) ? s[(long long)r * K + col] : 0.f;
        }
}
template <int NT>
__device__ __forceinline__ void gdn_state_frags_store(float (*acc)[4], float* s, int row, int n0,
                                                      int tiles, int K) {
    const int gi = (threadIdx.x % 32) / 4, ti = threadIdx.x % 4;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int r = row + gi + (e >= 2 ? 8 : 0), col = n0 + nt * 8 + 2 * ti + (e & 1);
            if (nt < tiles) s[(long long)r * K + col] = acc[nt][e];
        }
}

// What a state walk's ring loads (gdn_ring_fill): k [B, T, H, K] and the preparation's W, U~
// (bf16) and g; for the fused walk (version 8, F) also q [B, T, H, K] and M (bf16
// [B, H, n_chunks, L, L]). The block's batch entry b, head h and first row r0; bh = b H + h.
struct GdnWalkSrc {
    const u16 *k, *w, *u, *q, *m;
    const float* g;
    long long bh;
    int b, h, r0, T_len, heads, n_chunks;
};

// Stage st of a state walk's ring (versions 4, 5 and 8) from `ring` in shared memory: g [L]
// (float32), then the block's R columns of U~ [L][R + 8], W and k [L][K + 8] and, with F,
// q [L][K + 8] and M [L][L + 8] (bf16).
struct GdnStage {
    float* gs;
    u16 *ut, *ws, *ks, *qs, *ms;
};
template <bool F>
__device__ __forceinline__ int gdn_stage_floats(int R, int K) {
    return GDN_CHUNK + GDN_CHUNK * (R + 8) / 2 + GDN_CHUNK * (K + 8) * (F ? 3 : 2) / 2 +
           (F ? GDN_CHUNK * (GDN_CHUNK + 8) / 2 : 0);
}
template <bool F>
__device__ __forceinline__ GdnStage gdn_stage(float* ring, int st, int R, int K) {
    GdnStage s;
    s.gs = ring + st * gdn_stage_floats<F>(R, K);
    s.ut = reinterpret_cast<u16*>(s.gs + GDN_CHUNK);
    s.ws = s.ut + GDN_CHUNK * (R + 8);
    s.ks = s.ws + GDN_CHUNK * (K + 8);
    s.qs = s.ks + GDN_CHUNK * (K + 8);
    s.ms = s.qs + GDN_CHUNK * (K + 8);
    return s;
}

// The loads of chunk c into stage s (NT threads; gdn_ring_fill): W, k and (F) q rows, the
// block's R columns of U~ from r0, (F) M's rows, g; zeros past a short last chunk.
template <int NT, int R, bool F>
__device__ __forceinline__ void gdn_state_load(const GdnWalkSrc& src, const GdnStage& s, int c,
                                               int K, int V) {
    const int KS = K + 8, UTS = R + 8, MS = GDN_CHUNK + 8;
    const long long t0 = (long long)src.b * src.T_len + (long long)c * GDN_CHUNK;
    const int l = min(GDN_CHUNK, src.T_len - c * GDN_CHUNK);
    const long long base = src.bh * src.n_chunks + c;
    const int pk = K / 8;
    for (int e = threadIdx.x; e < GDN_CHUNK * pk; e += NT) {
        const int i = e / pk, q8 = (e % pk) * 8;
        const bool ok = i < l;
        const long long at = ((t0 + (ok ? i : 0)) * src.heads + src.h) * K + q8;
        cp_async16(s.ws + i * KS + q8, src.w + (base * GDN_CHUNK + (ok ? i : 0)) * K + q8, ok);
        cp_async16(s.ks + i * KS + q8, src.k + at, ok);
        if (F) cp_async16(s.qs + i * KS + q8, src.q + at, ok);
    }
    for (int e = threadIdx.x; e < GDN_CHUNK * (R / 8); e += NT) {
        const int i = e / (R / 8), q8 = (e % (R / 8)) * 8;
        const bool ok = i < l;
        cp_async16(s.ut + i * UTS + q8,
                   src.u + (base * GDN_CHUNK + (ok ? i : 0)) * V + src.r0 + q8, ok);
    }
    if (F)
        for (int e = threadIdx.x; e < GDN_CHUNK * (GDN_CHUNK / 8); e += NT) {
            const int i = e / (GDN_CHUNK / 8), q8 = (e % (GDN_CHUNK / 8)) * 8;
            const bool ok = i < l;
            cp_async16(s.ms + i * MS + q8, src.m + (base * GDN_CHUNK + (ok ? i : 0)) * GDN_CHUNK + q8,
                       ok);
        }
    for (int i = threadIdx.x; i < GDN_CHUNK; i += NT)
        cp_async4(s.gs + i, src.g + base * GDN_CHUNK + (i < l ? i : 0), i < l);
}

// Chunk c's loads (gdn_state_load) into its stage of a ring of STAGES, as one commit group
// (empty past the last chunk, so that cp_async_wait<STAGES - 2> counts the same in the tail).
template <int NT, int R, int STAGES, bool F>
__device__ __forceinline__ void gdn_ring_fill(float* ring, int c, const GdnWalkSrc& src, int K,
                                              int V) {
    if (c < src.n_chunks)
        gdn_state_load<NT, R, F>(src, gdn_stage<F>(ring, c % STAGES, R, K), c, K, V);
    cp_async_commit();
}

// The ring's first STAGES - 1 chunks' loads (gdn_ring_fill), before the walk's loop.
template <int NT, int R, int STAGES, bool F>
__device__ __forceinline__ void gdn_ring_start(float* ring, const GdnWalkSrc& src, int K, int V) {
#pragma unroll
    for (int p = 0; p < STAGES - 1; ++p) gdn_ring_fill<NT, R, STAGES, F>(ring, p, src, K, V);
}

// Chunk c's turn in the walk's loop: waits until its stage has landed for every thread (so
// the stage chunk c - 1 used is free), issues chunk c + STAGES - 1's loads into that stage and
// returns chunk c's.
template <int NT, int R, int STAGES, bool F>
__device__ __forceinline__ GdnStage gdn_ring_next(float* ring, int c, const GdnWalkSrc& src,
                                                  int K, int V) {
    cp_async_wait<STAGES - 2>();  // chunk c's group landed (later ones may be in flight)
    __syncthreads();              // ... for every thread; chunk c - 1's stage is free
    gdn_ring_fill<NT, R, STAGES, F>(ring, c + STAGES - 1, src, K, V);
    return gdn_stage<F>(ring, c % STAGES, R, K);
}

// Kernel 2' (gdn_state_tc_r<R>_s<STAGES>): a block of RG groups of 4 warps per R = 16 RG rows
// of the state, head and batch entry; group rg owns rows 16 rg .. 16 rg + 15 of the block's,
// warp w of a group a quarter of the K columns. Chunk c + STAGES - 1's loads are issued while
// chunk c is worked on (a ring of STAGES stages). Version 3 is RG = 1 with 2 stages; version 4
// (where V allows: the host's StateWalk, src/sequence_mixers/delta_cuda.rs) RG = 2, so the
// block's W and k tiles serve 32 rows, and 4 stages.
template <int RG, int STAGES>
__device__ __forceinline__ void gdn_state_tc_body(
    const u16* __restrict__ k, const u16* __restrict__ w_in, u16* u,
    const float* __restrict__ g_in, const float* __restrict__ initial_state, int has_initial,
    u16* __restrict__ states, float* __restrict__ final_state, int T_len,
    int heads, int K, int V, int n_chunks) {
    constexpr int R = GDN_TC_ROWS * RG, NT = GDN_TC_THREADS * RG;
    extern __shared__ float smem[];
    const int r0 = blockIdx.x * R, h = blockIdx.y, b = blockIdx.z;
    const long long bh = (long long)b * heads + h;
    const GdnWalkSrc src{k, w_in, u, nullptr, nullptr, g_in, bh, b, h, r0, T_len, heads, n_chunks};
    const int KS = K + 8, UTS = R + 8, RS = R + 8;
    // Per stage (gdn_stage): g [L] (float32), U~ [L][UTS], W [L][KS], k [L][KS] (bf16).
    float* ring = smem;
    u16* ss = reinterpret_cast<u16*>(ring + STAGES * gdn_stage_floats<false>(R, K));  // [R][KS]: S
    u16* ud = ss + R * KS;                                           // [L][RS]: U decayed
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gi = lane / 4, ti = lane % 4;
    const int rg = warp / 4, wq = warp % 4, rr = 16 * rg;  // the warp's rows in the block
    const int tiles = K / 32, n0 = wq * (K / 4);
    float acc[4][4];
    gdn_state_frags_load<4>(acc, initial_state + bh * V * K, has_initial, r0 + rr, n0, tiles, K);
    gdn_ring_start<NT, R, STAGES, false>(ring, src, K, V);
    for (int c = 0; c < n_chunks; ++c) {
        const GdnStage st = gdn_ring_next<NT, R, STAGES, false>(ring, c, src, K, V);
        const u16 *ws = st.ws, *ks = st.ks, *ut = st.ut;
        const float* gs = st.gs;
        const int l = min(GDN_CHUNK, T_len - c * GDN_CHUNK);
        const float last = gs[l - 1];
        // The entering state, bf16: to `states` and to shared memory for U's product.
        u16* out = states + ((bh * n_chunks + c) * V + r0 + rr) * K;
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
            if (nt < tiles) {
                const int col = n0 + nt * 8 + 2 * ti;
                const u32 lo = pack_bf16(acc[nt][0], acc[nt][1]), hi = pack_bf16(acc[nt][2], acc[nt][3]);
                *reinterpret_cast<u32*>(ss + (rr + gi) * KS + col) = lo;
                *reinterpret_cast<u32*>(ss + (rr + gi + 8) * KS + col) = hi;
                *reinterpret_cast<u32*>(out + gi * K + col) = lo;
                *reinterpret_cast<u32*>(out + (gi + 8) * K + col) = hi;
            }
        }
        __syncthreads();
        {
            // U = U~ - W S^T: warp (rg, wq) steps 16 wq .. 16 wq + 15, rows rr .. rr + 15 of
            // the block's as columns.
            const int j0 = wq * 16;
            float ua[2][4] = {};
            mma_rows<2>(ua, ws, KS, j0, ss + rr * KS, KS, 0, K / 16);
            u16* uo = u + (bh * n_chunks + c) * GDN_CHUNK * V + r0;
#pragma unroll
            for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int j = j0 + gi + 8 * half, r = rr + nt * 8 + 2 * ti;
                    const u32 tp = *reinterpret_cast<const u32*>(ut + j * UTS + r);
                    const float u0 = __uint_as_float(tp << 16) - ua[nt][2 * half];
                    const float u1 = __uint_as_float(tp & 0xffff0000u) - ua[nt][2 * half + 1];
                    if (j < l) *reinterpret_cast<u32*>(uo + (long long)j * V + r) = pack_bf16(u0, u1);
                    const float dec = j < l ? __expf(last - gs[j]) : 0.f;
                    *reinterpret_cast<u32*>(ud + j * RS + r) = pack_bf16(dec * u0, dec * u1);
                }
        }
        __syncthreads();
        // S <- exp(g_last) S + U_decᵀ k: A = U_decᵀ (rows r, steps k) by ldmatrix.trans.
        const float keep = __expf(last);
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[nt][e] *= keep;
#pragma unroll
        for (int kb = 0; kb < GDN_CHUNK / 16; ++kb) {
            u32 af[4];
            const int mi = lane / 8;
            ldsm_x4_t(af, ud + (kb * 16 + lane % 8 + (mi >= 2 ? 8 : 0)) * RS + rr + (mi & 1) * 8);
            mma_k_block<4>(acc, af, ks, KS, kb, n0, tiles);
        }
    }
    gdn_state_frags_store<4>(acc, final_state + bh * V * K, r0 + rr, n0, tiles, K);
}

// The state walk's entry points (versions 3 and 4): rows per block and stages
// (gdn_state_tc_body); the host picks (src/sequence_mixers/delta_cuda.rs, StateWalk).
#define GDN_STATE_TC(RG, STAGES)                                                               \
    extern "C" __global__ void __launch_bounds__(GDN_TC_THREADS * RG)                          \
        gdn_state_tc_r##RG##_s##STAGES(                                                        \
            const u16* __restrict__ k, const u16* __restrict__ w_in,                           \
            u16* u, const float* __restrict__ g_in, const float* __restrict__ initial_state,    \
            int has_initial, u16* __restrict__ states, float* __restrict__ final_state,         \
            int T_len, int heads, int K, int V, int n_chunks) {                                \
        gdn_state_tc_body<RG, STAGES>(k, w_in, u, g_in, initial_state, has_initial, states,    \
                                      final_state, T_len, heads, K, V, n_chunks);              \
    }
GDN_STATE_TC(1, 2)
GDN_STATE_TC(2, 4)

// Kernel 2'' (gdn_walk_out_w<WARPS>_s<STAGES>_k<K>v<V>, version 8, at K = V = 128): the
// state walk with the output computed in it, so that neither the chunks' entering states nor
// U go to global memory and kernel 3' is not launched. Each warp owns 16 whole rows of the
// state (value indices; all K columns in its mma accumulators, C layout: row g / g + 8,
// columns 8 nt + 2 t and + 1; version 5's layout), WARPS warps (R = 16 WARPS rows) per block,
// per head and batch entry. The accumulators of two adjacent 8-column tiles, rounded to bf16,
// are the A fragment of a 16-column k step (mma.sync m16n8k16's C and A layouts agree, as
// FlashAttention-2 uses for P V), so per chunk, with S the entering state in bf16:
//   Uᵀ (16 rows x L steps) = S Wᵀ and Oᵀ = S Qᵀ   (A: S from registers, B: W's and q's rows),
//   U = U~ - (S Wᵀ)ᵀ,
//   Oᵀ <- Oᵀ diag(exp(g_i)) + Uᵀ Mᵀ               (A: Uᵀ in bf16 from registers, B: M's
//                                                  rows i, its blocks j <= i only),
//   S <- exp(g_last) S + U_decᵀ k                  (A: Uᵀ decayed by exp(g_last - g_j),
//                                                  B: k by ldmatrix.trans),
// O = Oᵀᵀ to `o` in pairs of value columns (lanes of rows r and r ^ 1 trade a value). M
// (M_ij = exp(g_i - g_j) (q_i . k_j), j <= i, bf16) comes from the preparation (kernel 1'
// with q), so every block of the head reads it instead of computing it. The output equals
// kernel 3''s up to the order of its sums: the same S, U and M in bf16. One barrier a chunk
// (the ring of STAGES stages of W, k, q, U~'s R columns, M and g, loaded STAGES - 1 chunks
// ahead by every thread). K and V compiled in (the host, StateWalk::for_shape, takes it at
// K = V = 128). Dynamic shared memory: STAGES (L 3 (K + 8) 2 + L (R + 8) 2 + L (L + 8) 2 +
// L 4). Without OUT (version 9's gdn_state_w, below): no q, M or O; U written over U~ and
// each chunk's entering state (bf16) to `states`, for kernel 3'; stages of L 2 (K + 8) 2 +
// L (R + 8) 2 + L 4 bytes.
template <int WARPS, int STAGES, int K, int V, bool OUT>
__device__ __forceinline__ void gdn_walk_out_body(
    const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ w_in, u16* u,
    const u16* __restrict__ m, const float* __restrict__ g_in,
    const float* __restrict__ initial_state, int has_initial, u16* __restrict__ o,
    u16* __restrict__ states, float* __restrict__ final_state, int T_len, int heads,
    int n_chunks) {
    constexpr int R = 16 * WARPS, NT = 32 * WARPS, KS = K + 8, UTS = R + 8, KN = K / 8;
    constexpr int MS = GDN_CHUNK + 8, LN = GDN_CHUNK / 8;  // 8-step tiles of a chunk
    extern __shared__ float smem[];
    const int r0 = blockIdx.x * R, h = blockIdx.y, b = blockIdx.z;
    const long long bh = (long long)b * heads + h;
    const GdnWalkSrc src{k, w_in, u, q, m, g_in, bh, b, h, r0, T_len, heads, n_chunks};
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gi = lane / 4, ti = lane % 4;
    const int rr = 16 * warp, mi = lane >> 3;
    const bool odd = gi & 1;  // the lane's row pair: it stores step + 1 of rows r - 1 and r
    float acc[KN][4];
    gdn_state_frags_load<KN>(acc, initial_state + bh * V * K, has_initial, r0 + rr, 0, KN, K);
    gdn_ring_start<NT, R, STAGES, OUT>(smem, src, K, V);
    for (int c = 0; c < n_chunks; ++c) {
        const GdnStage st = gdn_ring_next<NT, R, STAGES, OUT>(smem, c, src, K, V);
        const u16 *ws = st.ws, *ks = st.ks, *qs = st.qs, *ms = st.ms, *ut = st.ut;
        const float* gs = st.gs;
        const int l = min(GDN_CHUNK, T_len - c * GDN_CHUNK);
        const float last = gs[l - 1];
        // Uᵀ = S Wᵀ and (OUT) Oᵀ = S Qᵀ, S the entering state in bf16 (f: (row g, row g + 8)
        // pairs of tiles 2 ks8 and 2 ks8 + 1, the A fragment of a k step; without OUT also
        // stored to `states` for kernel 3'); tile jt: steps 8 jt .. + 7.
        float ua[LN][4] = {}, oa[LN][4] = {};
        u16* so = OUT ? nullptr : states + ((bh * n_chunks + c) * V + r0 + rr) * K;
#pragma unroll
        for (int ks8 = 0; ks8 < K / 16; ++ks8) {
            const u32 f[4] = {pack_bf16(acc[2 * ks8][0], acc[2 * ks8][1]),
                              pack_bf16(acc[2 * ks8][2], acc[2 * ks8][3]),
                              pack_bf16(acc[2 * ks8 + 1][0], acc[2 * ks8 + 1][1]),
                              pack_bf16(acc[2 * ks8 + 1][2], acc[2 * ks8 + 1][3])};
            if constexpr (!OUT) {
                const int col = ks8 * 16 + 2 * ti;
                *reinterpret_cast<u32*>(so + gi * K + col) = f[0];
                *reinterpret_cast<u32*>(so + (gi + 8) * K + col) = f[1];
                *reinterpret_cast<u32*>(so + gi * K + col + 8) = f[2];
                *reinterpret_cast<u32*>(so + (gi + 8) * K + col + 8) = f[3];
            }
#pragma unroll
            for (int jt = 0; jt < LN; jt += 2) {
                const int at = ((mi >= 2 ? jt + 1 : jt) * 8 + (lane & 7)) * KS + ks8 * 16 +
                               (mi & 1) * 8;
                u32 bw[4], bq[4];
                ldsm_x4(bw, ws + at);
                if constexpr (OUT) ldsm_x4(bq, qs + at);
                mma_bf16(ua[jt], f, bw[0], bw[1]);
                mma_bf16(ua[jt + 1], f, bw[2], bw[3]);
                if constexpr (OUT) {
                    mma_bf16(oa[jt], f, bq[0], bq[1]);
                    mma_bf16(oa[jt + 1], f, bq[2], bq[3]);
                }
            }
        }
        // U = U~ - (S Wᵀ)ᵀ, as the A fragments of Uᵀ Mᵀ (uf) and, decayed, of U_decᵀ k (ud);
        // Oᵀ's columns (steps i) scaled by exp(g_i). Without OUT, U to `u` over U~ (bf16;
        // steps past a short last chunk not written) in u32 pairs of rows: lanes of rows r and
        // r ^ 1 (4 lanes apart) trade, the even row's lane storing step j, the odd row's j + 1.
        u32 uf[LN][2], ud[LN][2];
        u16* uo = u + (bh * n_chunks + c) * GDN_CHUNK * V + r0 + rr;
#pragma unroll
        for (int jt = 0; jt < LN; ++jt) {
            const int j = jt * 8 + 2 * ti;
            const float d0 = j < l ? __expf(last - gs[j]) : 0.f;
            const float d1 = j + 1 < l ? __expf(last - gs[j + 1]) : 0.f;
            const float e0 = __expf(gs[j]), e1 = __expf(gs[j + 1]);
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int r = rr + gi + 8 * half;
                const float u0 = ld(ut, j * UTS + r) - ua[jt][2 * half];
                const float u1 = ld(ut, (j + 1) * UTS + r) - ua[jt][2 * half + 1];
                uf[jt][half] = pack_bf16(u0, u1);
                ud[jt][half] = pack_bf16(d0 * u0, d1 * u1);
                if constexpr (OUT) {
                    oa[jt][2 * half] *= e0;
                    oa[jt][2 * half + 1] *= e1;
                } else {
                    const int rl = gi + 8 * half;
                    const float got = __shfl_xor_sync(FULL_MASK, odd ? u0 : u1, 4);
                    const int js = odd ? j + 1 : j;
                    if (js < l)
                        *reinterpret_cast<u32*>(uo + (long long)js * V + (odd ? rl - 1 : rl)) =
                            odd ? pack_bf16(got, u1) : pack_bf16(u0, got);
                }
            }
        }
        // Oᵀ += Uᵀ Mᵀ: column tiles it, it + 1 (steps i 8 it .. 8 it + 15) need the steps
        // j < 8 it + 16 only (M is lower triangular), k blocks 0 .. it / 2.
#pragma unroll
        for (int it = 0; it < (OUT ? LN : 0); it += 2) {
#pragma unroll
            for (int kb = 0; kb <= it / 2; ++kb) {
                const u32 f[4] = {uf[2 * kb][0], uf[2 * kb][1], uf[2 * kb + 1][0],
                                  uf[2 * kb + 1][1]};
                u32 bf[4];
                ldsm_x4(bf, ms + ((mi >= 2 ? it + 1 : it) * 8 + (lane & 7)) * MS + kb * 16 +
                                (mi & 1) * 8);
                mma_bf16(oa[it], f, bf[0], bf[1]);
                mma_bf16(oa[it + 1], f, bf[2], bf[3]);
            }
        }
        // O to `o` (bf16; steps past a short last chunk not written) in u32 pairs of value
        // columns: lanes of rows r and r ^ 1 (4 lanes apart) trade, the even row's lane
        // storing step i, the odd row's step i + 1.
        u16* ob = OUT ? o + (((long long)b * T_len + (long long)c * GDN_CHUNK) * heads + h) * V +
                            r0 + rr
                      : nullptr;
#pragma unroll
        for (int jt = 0; jt < (OUT ? LN : 0); ++jt) {
            const int i = jt * 8 + 2 * ti;
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int r = gi + 8 * half;
                const float o0 = oa[jt][2 * half], o1 = oa[jt][2 * half + 1];
                const float got = __shfl_xor_sync(FULL_MASK, odd ? o0 : o1, 4);
                const int is = odd ? i + 1 : i;
                if (is < l)
                    *reinterpret_cast<u32*>(ob + (long long)is * heads * V + (odd ? r - 1 : r)) =
                        odd ? pack_bf16(got, o1) : pack_bf16(o0, got);
            }
        }
        // S <- exp(g_last) S + U_decᵀ k: k's rows are the k steps (ldmatrix.trans).
        const float keep = __expf(last);
#pragma unroll
        for (int nt = 0; nt < KN; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[nt][e] *= keep;
#pragma unroll
        for (int kb = 0; kb < GDN_CHUNK / 16; ++kb) {
            const u32 f[4] = {ud[2 * kb][0], ud[2 * kb][1], ud[2 * kb + 1][0], ud[2 * kb + 1][1]};
            mma_k_block<KN>(acc, f, ks, KS, kb, 0, KN);
        }
    }
    gdn_state_frags_store<KN>(acc, final_state + bh * V * K, r0 + rr, 0, KN, K);
}

// The fused walks' parameters (versions 8 and 10; the host passes K and V, equal to the
// compiled-in sizes).
#define GDN_FUSED_WALK_PARAMS                                                                  \
    const u16 *__restrict__ q, const u16 *__restrict__ k, const u16 *__restrict__ w_in,        \
        const u16 *__restrict__ u, const u16 *__restrict__ m, const float *__restrict__ g_in,  \
        const float *__restrict__ initial_state, int has_initial, u16 *__restrict__ o,         \
        float *__restrict__ final_state, int T_len, int heads, int K, int V, int n_chunks

// Version 8's entry points.
#define GDN_WALK_OUT(WARPS, STAGES, KT, VT)                                                    \
    extern "C" __global__ void __launch_bounds__(32 * WARPS)                                   \
        gdn_walk_out_w##WARPS##_s##STAGES##_k##KT##v##VT(GDN_FUSED_WALK_PARAMS) {              \
        gdn_walk_out_body<WARPS, STAGES, KT, VT, true>(q, k, w_in, const_cast<u16*>(u), m, g_in, \
                                                       initial_state, has_initial, o, nullptr, \
                                                       final_state, T_len, heads, n_chunks);   \
    }
GDN_WALK_OUT(2, 3, 128, 128)

// Version 5's whole-row walk again (version 9, at K = V = 64; the arguments of
// gdn_state_tc_r<RG>_s<STAGES>): gdn_walk_out_body without the output, writing U over U~ and
// each chunk's entering state for kernel 3'. At 64 the walk is one warp a block, and version
// 8's output on that warp's chain cost more than kernel 3' running every chunk at once
// (kernels/TUNING-sequence-mixers.md, "Versions 5 to 8 on an H100").
#define GDN_STATE_W(WARPS, STAGES, KT, VT)                                                     \
    extern "C" __global__ void __launch_bounds__(32 * WARPS)                                   \
        gdn_state_w##WARPS##_s##STAGES##_k##KT##v##VT(                                         \
            const u16* __restrict__ k, const u16* __restrict__ w_in, u16* u,                   \
            const float* __restrict__ g_in, const float* __restrict__ initial_state,           \
            int has_initial, u16* __restrict__ states, float* __restrict__ final_state,         \
            int T_len, int heads, int K, int V, int n_chunks) {                                \
        gdn_walk_out_body<WARPS, STAGES, KT, VT, false>(nullptr, k, w_in, u, nullptr, g_in,    \
                                                        initial_state, has_initial, nullptr,   \
                                                        states, final_state, T_len, heads,     \
                                                        n_chunks);                             \
    }
GDN_STATE_W(1, 4, 64, 64)

// ---------------------------------------------------------------------------------------------
// Kernel 2''' (gdn_walk_wg_r<BV>_s<STAGES>_k<K>v<V>, version 10, Hopper only: sm_90a's
// warpgroup matrix instructions, so compiled only where NVRTC defines
// __CUDA_ARCH_FEAT_SM90_ALL, and in the CPU emulation, which emulates them): the fused walk
// (version 8's arguments and output: no entering states or U in scratch, no output kernel) on
// wgmma. One warpgroup (128 threads) per BV rows of the state (value indices), head and batch
// entry (FlashLinearAttention's split of the state by value index: its rows evolve
// independently). The state is held transposed, Sᵀ (K x BV: key index x value index), in fp32
// wgmma accumulators: K / 64 m64nBV tiles, thread t of warp w
// holding rows 16 w + g (+ 8) of each and columns 8 j + 2 t4 (+ 1) (the accumulator layout of
// kernels/attn_wgmma_sm90.cu). Per chunk of L = 64 steps, with W, q, k (L x K), M (L x L) and
// the block's BV columns of U~ in a ring of STAGES stages (cp.async, STAGES - 1 chunks ahead):
//   U = U~ - W Sᵀ and P = Q Sᵀ          (m64nBV, A = W or q K-major, B = Sᵀ in bf16 N-major),
//   O = diag(exp(g_i)) P + M U           (A = M K-major, B = U in bf16 N-major),
//   Sᵀ <- exp(g_last) Sᵀ + Kᵀ U_dec      (A = k read M-major: Kᵀ; B = U_j exp(g_last - g_j)),
// each product a warpgroup's asynchronous wgmma over shared memory, against versions 5 to 9's
// one or two warps a block holding 16 rows each on mma.sync: there each SM had one or two of
// its four schedulers' tensor cores at work, here all four. Shared operands in the no-swizzle
// core-matrix layout (gdn_core: 8 x 8 blocks of 128 contiguous bytes, row-block-major), the
// descriptors' leading offset the distance between core matrices along the reduction
// dimension and the stride along M or N (as attention's probe established for K- and N-major
// operands; kernels/attn_wgmma_sm90.cu). M's 16 x 16 blocks above the diagonal (which the
// preparation leaves partly unwritten) are zeroed once and never loaded. The fills give 8
// consecutive threads the 8 rows of one core matrix (128 contiguous bytes of shared memory, no
// bank conflict; 64 contiguous bytes of each global row per warp). Dynamic shared memory:
// STAGES (3 L K 2 + L L 2 + L (BV + 8) 2 + L 4) + K BV 2 + 2 L BV 2 bytes (the host's
// tc_shared_bytes).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) || defined(KP_EMULATE)
typedef unsigned long long u64;

// Byte offset of element (r, c) of a 16-bit tile with `cols` columns in the core-matrix layout.
__device__ __forceinline__ u32 gdn_core(int r, int c, int cols) {
    return (u32)((((r >> 3) * (cols >> 3) + (c >> 3)) << 7) + ((r & 7) << 4) + ((c & 7) << 1));
}

// A shared-memory matrix descriptor without swizzling: address, leading and stride byte offsets.
__device__ __forceinline__ u64 gdn_desc(const void* p, u32 lead, u32 stride) {
    return (u64)((smem_addr(p) & 0x3FFFF) >> 4) | ((u64)((lead & 0x3FFFF) >> 4) << 16) |
           ((u64)((stride & 0x3FFFF) >> 4) << 32);
}

// D (64 x N, fp32, N / 2 per thread) (+)= A (64 x 16) B (16 x N), bf16 from shared memory: A
// K-major (TA = 0) or M-major (TA = 1), B N-major; `acc` 0 overwrites D. The CPU emulation
// (emulate/cuda_shim.h) computes it at issue and has nothing to fence, wait for or pin.
#ifdef KP_EMULATE
template <int N, int TA>
inline void gdn_wgmma(float (&d)[N / 2], u64 da, u64 db, int acc) {
    wgmma_emulated<N>(d, da, db, acc, TA, true);
}
inline void gdn_fence_async() {}
inline void gdn_wg_fence() {}
inline void gdn_wg_commit() {}
template <int N>
inline void gdn_wg_wait() {}
template <int N>
inline void gdn_wg_pin(float (&)[N]) {}
#else
#define GDN_WG_N16 "{%0, %1, %2, %3, %4, %5, %6, %7}"
#define GDN_WG_N32                                                                             \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define GDN_WG_D8(d, i)                                                                        \
    "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
        "+f"(d[i + 6]), "+f"(d[i + 7])
template <int N, int TA>
__device__ __forceinline__ void gdn_wgmma(float (&d)[N / 2], u64 da, u64 db, int acc) {
    if constexpr (N == 16) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 " GDN_WG_N16
            ", %8, %9, p, 1, 1, %11, 1;\n}\n"
            : GDN_WG_D8(d, 0)
            : "l"(da), "l"(db), "r"(acc), "n"(TA));
    } else {
        static_assert(N == 32, "m64n16 or m64n32");
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 " GDN_WG_N32
            ", %16, %17, p, 1, 1, %19, 1;\n}\n"
            : GDN_WG_D8(d, 0), GDN_WG_D8(d, 8)
            : "l"(da), "l"(db), "r"(acc), "n"(TA));
    }
}
__device__ __forceinline__ void gdn_fence_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void gdn_wg_fence() {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void gdn_wg_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void gdn_wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Pins accumulator registers in program order (an empty asm that reads and writes each): after
// a wait, so that no read of a product is moved above it; before gdn_wg_fence, so that the
// arithmetic on them (a scale) is not moved after it, where ptxas would have to serialise the
// products (warpgroup.arrive injected: the C7519 advisory).
template <int N>
__device__ __forceinline__ void gdn_wg_pin(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
#endif

// Chunk c's loads into stage `st` of the ring (128 threads; empty past the last chunk, one
// commit group either way): W, q, k and M's blocks on or below the diagonal in the core-matrix
// layout, the block's BV columns of U~ as rows of BV + 8, g; zeros past a short last chunk.
template <int BV, int K, int V>
__device__ __forceinline__ void gdn_wg_fill(unsigned char* st, const GdnWalkSrc& src, int c) {
    constexpr int L = GDN_CHUNK, TILE = L * K * 2, UTS = BV + 8;
    if (c < src.n_chunks) {
        unsigned char *ws = st, *qs = st + TILE, *ks = st + 2 * TILE, *ms = st + 3 * TILE;
        u16* ut = reinterpret_cast<u16*>(ms + L * L * 2);
        float* gs = reinterpret_cast<float*>(ut + L * UTS);
        const long long t0 = (long long)src.b * src.T_len + (long long)c * L;
        const int l = min(L, src.T_len - c * L);
        const long long base = src.bh * src.n_chunks + c;
        // Thread e: row 8 (e / K) + e % 8, 8 columns from 8 ((e / 8) % (K / 8)).
        for (int e = threadIdx.x; e < L * (K / 8); e += 128) {
            const int i = 8 * (e / K) + e % 8, c8 = ((e / 8) % (K / 8)) * 8;
            const bool ok = i < l;
            const int ii = ok ? i : 0;
            const long long at = ((t0 + ii) * src.heads + src.h) * K + c8;
            const u32 to = gdn_core(i, c8, K);
            cp_async16(ws + to, src.w + (base * L + ii) * K + c8, ok);
            cp_async16(qs + to, src.q + at, ok);
            cp_async16(ks + to, src.k + at, ok);
        }
        for (int e = threadIdx.x; e < L * (L / 8); e += 128) {
            const int i = 8 * (e / L) + e % 8, c8 = ((e / 8) % (L / 8)) * 8;
            if (c8 / 16 > i / 16) continue;  // above the diagonal blocks: zeros, never loaded
            const bool ok = i < l;
            cp_async16(ms + gdn_core(i, c8, L), src.m + (base * L + (ok ? i : 0)) * L + c8, ok);
        }
        for (int e = threadIdx.x; e < L * (BV / 8); e += 128) {
            const int i = e / (BV / 8), c8 = (e % (BV / 8)) * 8;
            const bool ok = i < l;
            cp_async16(ut + i * UTS + c8, src.u + (base * L + (ok ? i : 0)) * V + src.r0 + c8, ok);
        }
        for (int i = threadIdx.x; i < L; i += 128)
            cp_async4(gs + i, src.g + base * L + (i < l ? i : 0), i < l);
    }
    cp_async_commit();
}

template <int BV, int STAGES, int K, int V>
__device__ __forceinline__ void gdn_walk_wg_body(
    const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ w_in,
    const u16* __restrict__ u, const u16* __restrict__ m, const float* __restrict__ g_in,
    const float* __restrict__ initial_state, int has_initial, u16* __restrict__ o,
    float* __restrict__ final_state, int T_len, int heads, int n_chunks) {
    constexpr int L = GDN_CHUNK, NA = BV / 2, MB = K / 64, TILE = L * K * 2, UTS = BV + 8;
    constexpr int STAGE = 3 * TILE + L * L * 2 + L * UTS * 2 + L * 4;
    extern __shared__ float smem[];
    unsigned char* ring = reinterpret_cast<unsigned char*>(smem);
    unsigned char* s_st = ring + STAGES * STAGE;  // Sᵀ in bf16, K x BV, N-major
    unsigned char* s_u = s_st + K * BV * 2;       // U, L x BV
    unsigned char* s_d = s_u + L * BV * 2;        // U_dec, L x BV
    const int v0 = blockIdx.x * BV, h = blockIdx.y, b = blockIdx.z;
    const long long bh = (long long)b * heads + h;
    const GdnWalkSrc src{k, w_in, u, q, m, g_in, bh, b, h, v0, T_len, heads, n_chunks};
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gi = lane / 4, t4 = lane % 4;
    const int i0 = 16 * warp + gi;  // the thread's accumulator rows: i0 and i0 + 8
    // M's blocks above the diagonal, zero in every stage (the fills never write them).
    for (int st = 0; st < STAGES; ++st)
        for (int e = threadIdx.x; e < L * (L / 8); e += 128) {
            const int i = e / (L / 8), c8 = (e % (L / 8)) * 8;
            if (c8 / 16 > i / 16)
                *reinterpret_cast<uint4*>(ring + st * STAGE + 3 * TILE + gdn_core(i, c8, L)) =
                    uint4{0, 0, 0, 0};
        }
#pragma unroll
    for (int p = 0; p < STAGES - 1; ++p) gdn_wg_fill<BV, K, V>(ring + p * STAGE, src, p);
    // Sᵀ: element (key x, value index y) of accumulator tile mb, d[4 j + e]: x = 64 mb + i0
    // (+ 8 for e >= 2), y = 8 j + 2 t4 + (e & 1).
    float sa[MB][NA];
    // The offset of accumulator sa[mb][r] in a [B, H, V, K] state.
    auto at = [&](int mb, int r) {
        const int x = 64 * mb + i0 + ((r & 2) ? 8 : 0), y = 8 * (r / 4) + 2 * t4 + (r & 1);
        return (bh * V + v0 + y) * K + x;
    };
#pragma unroll
    for (int mb = 0; mb < MB; ++mb)
#pragma unroll
        for (int r = 0; r < NA; ++r) sa[mb][r] = has_initial ? initial_state[at(mb, r)] : 0.f;
    const u32 rows8 = 16 * K;  // bytes between the 8-row blocks of an [L][K] tile
    for (int c = 0; c < n_chunks; ++c) {
        // Sᵀ entering the chunk, bf16, to shared memory (B of U's and P's products).
#pragma unroll
        for (int mb = 0; mb < MB; ++mb)
#pragma unroll
            for (int j = 0; j < NA / 4; ++j)
#pragma unroll
                for (int hf = 0; hf < 2; ++hf)
                    *reinterpret_cast<u32*>(s_st + gdn_core(64 * mb + i0 + 8 * hf, 8 * j + 2 * t4, BV)) =
                        pack_bf16(sa[mb][4 * j + 2 * hf], sa[mb][4 * j + 2 * hf + 1]);
        cp_async_wait<STAGES - 2>();  // chunk c's loads landed (for this thread)
        gdn_fence_async();            // ... and the generic writes above, for wgmma
        __syncthreads();              // ... for every thread; chunk c - 1's stage is free
        gdn_wg_fill<BV, K, V>(ring + ((c + STAGES - 1) % STAGES) * STAGE, src, c + STAGES - 1);
        const unsigned char* st = ring + (c % STAGES) * STAGE;
        const unsigned char *ws = st, *qs = st + TILE, *ks = st + 2 * TILE, *ms = st + 3 * TILE;
        const u16* ut = reinterpret_cast<const u16*>(ms + L * L * 2);
        const float* gs = reinterpret_cast<const float*>(ut + L * UTS);
        const int l = min(L, T_len - c * L);
        float ua[NA], oa[NA];
        gdn_wg_fence();
#pragma unroll
        for (int kk = 0; kk < K / 16; ++kk) {
            const u64 db = gdn_desc(s_st + gdn_core(16 * kk, 0, BV), 16 * BV, 128);
            gdn_wgmma<BV, 0>(ua, gdn_desc(ws + gdn_core(0, 16 * kk, K), 128, rows8), db, kk);
            gdn_wgmma<BV, 0>(oa, gdn_desc(qs + gdn_core(0, 16 * kk, K), 128, rows8), db, kk);
        }
        gdn_wg_commit();
        // While the products run: the rows' decays (zero past a short last chunk).
        const float last = gs[l - 1];
        float eg[2], dec[2];
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int i = i0 + 8 * hf;
            eg[hf] = __expf(gs[i]);
            dec[hf] = i < l ? __expf(last - gs[i]) : 0.f;
        }
        const float keep = __expf(last);
        gdn_wg_wait<0>();
        gdn_wg_pin(ua);
        gdn_wg_pin(oa);
        // U = U~ - W Sᵀ and U_dec to shared memory (bf16, N-major: B of the next products);
        // P's rows scaled by exp(g_i).
#pragma unroll
        for (int j = 0; j < NA / 4; ++j)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const int i = i0 + 8 * hf, y = 8 * j + 2 * t4, r = 4 * j + 2 * hf;
                const u32 tp = *reinterpret_cast<const u32*>(ut + i * UTS + y);
                const float u0 = __uint_as_float(tp << 16) - ua[r];
                const float u1 = __uint_as_float(tp & 0xffff0000u) - ua[r + 1];
                *reinterpret_cast<u32*>(s_u + gdn_core(i, y, BV)) = pack_bf16(u0, u1);
                *reinterpret_cast<u32*>(s_d + gdn_core(i, y, BV)) =
                    pack_bf16(dec[hf] * u0, dec[hf] * u1);
                oa[r] *= eg[hf];
                oa[r + 1] *= eg[hf];
            }
#pragma unroll
        for (int mb = 0; mb < MB; ++mb)
#pragma unroll
            for (int r = 0; r < NA; ++r) sa[mb][r] *= keep;
        gdn_wg_pin(oa);
#pragma unroll
        for (int mb = 0; mb < MB; ++mb) gdn_wg_pin(sa[mb]);
        gdn_fence_async();
        __syncthreads();  // every warp's rows of U and U_dec
        gdn_wg_fence();
        // O += M U (the first group), then Sᵀ += Kᵀ U_dec (k M-major: Kᵀ's 64-row tiles mb).
#pragma unroll
        for (int kb = 0; kb < L / 16; ++kb)
            gdn_wgmma<BV, 0>(oa, gdn_desc(ms + gdn_core(0, 16 * kb, L), 128, 16 * L),
                             gdn_desc(s_u + gdn_core(16 * kb, 0, BV), 16 * BV, 128), 1);
        gdn_wg_commit();
#pragma unroll
        for (int mb = 0; mb < MB; ++mb)
#pragma unroll
            for (int kb = 0; kb < L / 16; ++kb)
                gdn_wgmma<BV, 1>(sa[mb], gdn_desc(ks + gdn_core(16 * kb, 64 * mb, K), rows8, 128),
                                 gdn_desc(s_d + gdn_core(16 * kb, 0, BV), 16 * BV, 128), 1);
        gdn_wg_commit();
        gdn_wg_wait<1>();  // O's group done; the state's may still run
        gdn_wg_pin(oa);
        u16* ob = o + (((long long)b * T_len + (long long)c * L) * heads + h) * V + v0;
#pragma unroll
        for (int j = 0; j < NA / 4; ++j)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const int i = i0 + 8 * hf, r = 4 * j + 2 * hf;
                if (i < l)
                    *reinterpret_cast<u32*>(ob + (long long)i * heads * V + 8 * j + 2 * t4) =
                        pack_bf16(oa[r], oa[r + 1]);
            }
        gdn_wg_wait<0>();
#pragma unroll
        for (int mb = 0; mb < MB; ++mb) gdn_wg_pin(sa[mb]);
    }
    cp_async_wait<0>();
#pragma unroll
    for (int mb = 0; mb < MB; ++mb)
#pragma unroll
        for (int r = 0; r < NA; ++r) final_state[at(mb, r)] = sa[mb][r];
}

// Version 10's entry points (version 8's parameters; the host launches V / BV blocks of 128
// threads per head and batch entry).
#define GDN_WALK_WG(BV, STAGES, KT, VT)                                                        \
    extern "C" __global__ void __launch_bounds__(128, 1)                                       \
        gdn_walk_wg_r##BV##_s##STAGES##_k##KT##v##VT(GDN_FUSED_WALK_PARAMS) {                  \
        gdn_walk_wg_body<BV, STAGES, KT, VT>(q, k, w_in, u, m, g_in, initial_state,            \
                                             has_initial, o, final_state, T_len, heads,        \
                                             n_chunks);                                        \
    }
GDN_WALK_WG(32, 3, 128, 128)
GDN_WALK_WG(16, 4, 64, 64)
#endif

// Kernel 3' (gdn_output_tc), with K and V read from the arguments (KT = VT = 0), for any K and
// V the tensor-core path takes outside the fused walk's size, or compiled in at K = V = 64
// (gdn_output_tc_k64v64, after version 9's walk; versions 3.2 to 7 had 64 and 128 so, until
// the fused walk 2'' took those sizes in version 8).
template <int KT, int VT>
__device__ __forceinline__ void gdn_output_tc_body(
    const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ u,
    const float* __restrict__ g_in, const u16* __restrict__ states, u16* __restrict__ o,
    int T_len, int heads, int K_arg, int V_arg) {
    const int K = KT > 0 ? KT : K_arg, V = VT > 0 ? VT : V_arg;
    extern __shared__ float smem[];
    const int c = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int n_chunks = gridDim.x;
    const long long t0 = (long long)b * T_len + (long long)c * GDN_CHUNK;
    const int l = min(GDN_CHUNK, T_len - c * GDN_CHUNK);
    const long long base = ((long long)b * heads + h) * n_chunks + c;
    const int KS = K + 8, VS = V + 8, LS = GDN_CHUNK + 8;
    float* gs = smem;                                        // [L]: g
    u16* qs = reinterpret_cast<u16*>(gs + GDN_CHUNK);        // [L][KS]
    u16* kk = qs + GDN_CHUNK * KS;                           // [L][KS]
    u16* us = kk + GDN_CHUNK * KS;                           // [L][VS]: U
    u16* s_in = us + GDN_CHUNK * VS;                         // [V][KS]: entering state
    u16* m = s_in + V * KS;                                  // [L][LS]: M
    const int pk = K / 8, pv = V / 8;
    for (int e = threadIdx.x; e < GDN_CHUNK * pk; e += GDN_THREADS) {
        const int i = e / pk, c8 = (e % pk) * 8;
        const bool ok = i < l;
        const long long at = ((t0 + (ok ? i : 0)) * heads + h) * K + c8;
        cp_async16(qs + i * KS + c8, q + at, ok);
        cp_async16(kk + i * KS + c8, k + at, ok);
    }
    for (int e = threadIdx.x; e < GDN_CHUNK * pv; e += GDN_THREADS) {
        const int i = e / pv, c8 = (e % pv) * 8;
        const bool ok = i < l;
        cp_async16(us + i * VS + c8, u + (base * GDN_CHUNK + (ok ? i : 0)) * V + c8, ok);
    }
    for (int e = threadIdx.x; e < V * pk; e += GDN_THREADS) {
        const int r = e / pk, c8 = (e % pk) * 8;
        cp_async16(s_in + r * KS + c8, states + (base * V + r) * K + c8, true);
    }
    for (int i = threadIdx.x; i < GDN_CHUNK; i += GDN_THREADS)
        cp_async4(gs + i, g_in + base * GDN_CHUNK + (i < l ? i : 0), i < l);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gi = lane / 4, ti = lane % 4;
    const int r0 = (warp % 4) * 16;
    {
        const int c0 = (warp / 4) * 32;
        float acc[4][4] = {};
        if (c0 <= r0 + 15) mma_rows<4>(acc, qs, KS, r0, kk, KS, c0, K / 16);
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
            for (int e = 0; e < 4; e += 2) {
                const int i = r0 + gi + (e >= 2 ? 8 : 0), j = c0 + nt * 8 + 2 * ti;
                const float v0 = (j <= i && i < l) ? acc[nt][e] * __expf(gs[i] - gs[j]) : 0.f;
                const float v1 = (j + 1 <= i && i < l) ? acc[nt][e + 1] * __expf(gs[i] - gs[j + 1]) : 0.f;
                *reinterpret_cast<u32*>(m + i * LS + j) = pack_bf16(v0, v1);
            }
    }
    __syncthreads();
    const int tiles = V / 16, p0 = (warp / 4) * (V / 2);
    float diag[8][4] = {}, off[8][4] = {};
    for (int ks = 0; ks <= r0 / 16; ++ks) {
        u32 f[4];
        ld_a(f, m, LS, r0, ks * 16);
        mma_k_block<8>(diag, f, us, VS, ks, p0, tiles);
    }
    mma_rows<8>(off, qs, KS, r0, s_in, KS, p0, K / 16, tiles);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
        if (nt >= tiles) continue;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int i = r0 + gi + 8 * half, p = p0 + nt * 8 + 2 * ti;
            if (i < l) {
                const float gamma = __expf(gs[i]);
                const float o0 = diag[nt][2 * half] + gamma * off[nt][2 * half];
                const float o1 = diag[nt][2 * half + 1] + gamma * off[nt][2 * half + 1];
                *reinterpret_cast<u32*>(o + ((t0 + i) * heads + h) * V + p) = pack_bf16(o0, o1);
            }
        }
    }
}
#define GDN_OUTPUT_TC(SUFFIX, KT, VT)                                                          \
    extern "C" __global__ void __launch_bounds__(GDN_THREADS) gdn_output_tc##SUFFIX(          \
        const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ u,       \
        const float* __restrict__ g_in, const u16* __restrict__ states, u16* __restrict__ o,   \
        int T_len, int heads, int K, int V) {                                                  \
        gdn_output_tc_body<KT, VT>(q, k, u, g_in, states, o, T_len, heads, K, V);              \
    }
GDN_OUTPUT_TC(, 0, 0)
GDN_OUTPUT_TC(_k64v64, 64, 64)


// The four diagonal 16 x 16 blocks of T = (I + A)⁻¹ for a strictly lower triangular A
// [GDN_CHUNK][ap] (float32, shared memory; ap a multiple of 4, a 16-byte aligned: rows are read
// as float4) into t [GDN_CHUNK][ap], by forward substitution in registers (version 7): warp w
// (0 or 1), half h = lane / 16, takes block 2 w + h and lane c = lane % 16 its column c,
// t_ic = [i == c] - sum_{j < i} a_ij t_jc with t_jc = 0 for j < c, A's rows read as float4
// broadcasts within the half-warp (version 3.3 had every thread of the block on it, 4 lanes
// to a column, summing over shared memory with two shuffles a row). Zeros above the diagonal
// within the block. Warps 0 and 1 call it; t's blocks are complete after the caller's next
// barrier.
__device__ __forceinline__ void gdn_diagonal_inverse(const float* a, float* t, int ap) {
    const int lane = threadIdx.x % 32, c = lane % 16;
    const int cb = 16 * (2 * (threadIdx.x / 32) + lane / 16);
    float x[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        const float* row = a + (cb + i) * ap + cb;
        // Two partial sums: half the dependent chain of additions.
        float s0 = 0.f, s1 = 0.f;
#pragma unroll
        for (int j4 = 0; j4 < i; j4 += 4) {
            const float4 r = *reinterpret_cast<const float4*>(row + j4);
            s0 += r.x * x[j4];
            if (j4 + 1 < i) s1 += r.y * x[j4 + 1];
            if (j4 + 2 < i) s0 += r.z * x[j4 + 2];
            if (j4 + 3 < i) s1 += r.w * x[j4 + 3];
        }
        x[i] = i < c ? 0.f : (i == c ? 1.f : -(s0 + s1));
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) t[(cb + i) * ap + cb + c] = x[i];
}

// The blocks of T = (I + A)⁻¹ below the diagonal (A and t as gdn_diagonal_inverse's, ap even,
// t 8-byte aligned: pairs of T are stored as float2), once the diagonal blocks are in t, one
// block row at a time (as flash-linear-attention's solve does),
// T_bi,bj = -T_bi,bi sum_{bj <= k < bi} A_bi,k T_k,bj (from (I + A) T = I, block row bi),
// both products on tensor cores in tf32 (version 3.3; 3.1 summed them element by element on
// CUDA cores, the shared-memory traffic that bound the kernel), the sum parked in the block
// row's own place in t. Blocks above the diagonal are neither written nor read. Every thread
// of the block (GDN_THREADS = 256, 8 warps) calls it, its first barrier ordering the diagonal
// blocks' stores before their reads; t is complete after the caller's next barrier.
__device__ __forceinline__ void gdn_lower_blocks(const float* a, float* t, int ap) {
    // The blocks below the diagonal on tensor cores (tf32 operands, float32 accumulation:
    // finer than the bf16 that T is rounded to for W and U~). Block row bi: warp 2 bj + half
    // (bj < bi, half the 8-column half) owns columns 16 bj + 8 half .. + 7 of the block row.
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
    for (int bi = 1; bi < GDN_CHUNK / 16; ++bi) {
        __syncthreads();
        const int bj = warp / 2, c0 = 16 * bj + 8 * (warp % 2), r0 = 16 * bi;
        if (bj < bi) {
            // X = sum_{bj <= k < bi} A_bi,k T_k,bj (16 x 8), into t's block row bi.
            float x[4] = {};
            for (int k8 = 2 * bj; k8 < 2 * bi; ++k8) {
                const int j = 8 * k8;
                const u32 fa[4] = {to_tf32(a[(r0 + g) * ap + j + q]),
                                   to_tf32(a[(r0 + g + 8) * ap + j + q]),
                                   to_tf32(a[(r0 + g) * ap + j + q + 4]),
                                   to_tf32(a[(r0 + g + 8) * ap + j + q + 4])};
                mma_tf32(x, fa, to_tf32(t[(j + q) * ap + c0 + g]),
                         to_tf32(t[(j + q + 4) * ap + c0 + g]));
            }
            *reinterpret_cast<float2*>(t + (r0 + g) * ap + c0 + 2 * q) = make_float2(x[0], x[1]);
            *reinterpret_cast<float2*>(t + (r0 + g + 8) * ap + c0 + 2 * q) = make_float2(x[2], x[3]);
            __syncwarp();
            // T_bi,bj = -T_bi,bi X: X's columns are this warp's alone, read before written.
            float y[4] = {};
#pragma unroll
            for (int s8 = 0; s8 < 2; ++s8) {
                const int j = 8 * s8;
                const u32 fa[4] = {to_tf32(t[(r0 + g) * ap + r0 + j + q]),
                                   to_tf32(t[(r0 + g + 8) * ap + r0 + j + q]),
                                   to_tf32(t[(r0 + g) * ap + r0 + j + q + 4]),
                                   to_tf32(t[(r0 + g + 8) * ap + r0 + j + q + 4])};
                mma_tf32(y, fa, to_tf32(t[(r0 + j + q) * ap + c0 + g]),
                         to_tf32(t[(r0 + j + q + 4) * ap + c0 + g]));
            }
            __syncwarp();
            *reinterpret_cast<float2*>(t + (r0 + g) * ap + c0 + 2 * q) = make_float2(-y[0], -y[1]);
            *reinterpret_cast<float2*>(t + (r0 + g + 8) * ap + c0 + 2 * q) = make_float2(-y[2], -y[3]);
        }
    }
}

// out rows row0 + r0 .. row0 + r0 + 15 (of `width` columns; the chunk's first l rows only) =
// rows r0 .. r0 + 15 of T (bf16 [GDN_CHUNK][ts], lower triangular: the product stops at the
// rows' own 16-step block) times x (bf16 [GDN_CHUNK][xs]), the calling warp's half `half` of
// the columns, on tensor cores; out (W or U~) is bf16, stored in pairs.
__device__ __forceinline__ void gdn_t_times(u16* out, long long row0, const u16* tb, int ts,
                                            const u16* x, int xs, int width, int r0, int half,
                                            int l) {
    const int lane = threadIdx.x % 32, gi = lane / 4, ti = lane % 4;
    const int tiles = width / 16, p0 = half * (width / 2);
    float acc[8][4] = {};
    for (int kb = 0; kb <= r0 / 16; ++kb) {
        u32 f[4];
        ld_a(f, tb, ts, r0, kb * 16);
        mma_k_block<8>(acc, f, x, xs, kb, p0, tiles);
    }
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
        if (nt >= tiles) continue;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int i = r0 + gi + 8 * h, p = p0 + nt * 8 + 2 * ti;
            if (i < l) st2(out, (row0 + i) * width + p, acc[nt][2 * h], acc[nt][2 * h + 1]);
        }
    }
}

// Kernel 1' (gdn_prepare_tc), a block of 8 warps per (chunk, head, batch entry): g by a warp
// scan of the floored ln α; A = β_i exp(g_i - g_j) (k_i . k_j) (j < i) from K Kᵀ on tensor
// cores (float32 in shared memory); T = (I + A)⁻¹ by blocks of 16 rows
// (gdn_diagonal_inverse, in registers since version 7, then gdn_lower_blocks: version 3.3's
// blocks below the diagonal on tf32 tensor cores; version 3 ran one forward substitution down
// all 64 rows, 4 lanes per column); then W = T (β γ K) and
// U~ = T (β V) on tensor cores with T and the scaled rows rounded to bf16, as
// flash-linear-attention's chunked WY form does. W to `w` and U~ to `u` as bf16 (U~ as
// float32 before version 6), g as float32. With MO (version 8, for the fused walk 2'') also
// M = exp(g_i - g_j) (q_i . k_j) for j <= i < l (0 elsewhere; output kernel 3''s M) to `m`
// as bf16 [B, H, n_chunks, L, L], from q loaded over T's place before the inverse (L (K + 8)
// bf16 fit in L (L + 4) floats for K <= 128: the host's unit test checks it); of the 16 x 16
// blocks above the diagonal only those inside a warp's 16 x 32 block are written (zeros),
// the other four not (the walk reads none).
// Dynamic shared memory: L ((K + 8) + (V + 8)) bf16 + 2 L (L + 4) + 3 L floats (the host
// computes it: src/sequence_mixers/delta_cuda.rs; q's L (K + 8) bf16 fit in T's place).
template <int KT, int VT, bool MO>
__device__ __forceinline__ void gdn_prepare_tc_body(
    const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
    const float* __restrict__ alpha, const float* __restrict__ beta, u16* __restrict__ w_out,
    u16* __restrict__ u_out, u16* __restrict__ m_out, float* __restrict__ g_out, int T_len,
    int heads, int K_arg, int V_arg) {
    extern __shared__ float smem[];
    const int K = KT > 0 ? KT : K_arg, V = VT > 0 ? VT : V_arg;
    const int c = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const long long t0 = (long long)b * T_len + (long long)c * GDN_CHUNK;
    const int l = min(GDN_CHUNK, T_len - c * GDN_CHUNK);
    const long long base = ((long long)b * heads + h) * gridDim.x + c;
    // A's and T's rows GDN_CHUNK + 4 floats apart (version 4.2; + 1 before): the tf32 fragment
    // loads of A (row g, column q of a lane) fall in bank 4 g + q, all 32 distinct, and T's
    // (row q, column g) at most 2-way; rows an even number of floats apart let T's conversion
    // to bf16 read float2.
    const int KS = K + 8, VS = V + 8, AP = GDN_CHUNK + 4, TS = GDN_CHUNK + 8;
    float* af = smem;                                 // [L][AP]: A, then T in bf16 ([L][TS])
    float* tf = af + GDN_CHUNK * AP;                  // [L][AP]: T
    float* gs = tf + GDN_CHUNK * AP;                  // [L]: g
    float* bs = gs + GDN_CHUNK;                       // [L]: beta
    float* la = bs + GDN_CHUNK;                       // [L]: alpha
    u16* ks = reinterpret_cast<u16*>(la + GDN_CHUNK); // [L][KS]: k, then beta gamma k
    u16* vs = ks + GDN_CHUNK * KS;                    // [L][VS]: v, then beta v
    u16* tb = reinterpret_cast<u16*>(af);             // [L][TS]: T in bf16 (over A)
    u16* qs = reinterpret_cast<u16*>(tf);             // [L][KS]: q (MO), before T
    const int pk = K / 8, pv = V / 8;
    for (int e = threadIdx.x; e < GDN_CHUNK * pk; e += GDN_THREADS) {
        const int i = e / pk, q8 = (e % pk) * 8;
        const bool ok = i < l;
        const long long at = ((t0 + (ok ? i : 0)) * heads + h) * K + q8;
        cp_async16(ks + i * KS + q8, k + at, ok);
        if (MO) cp_async16(qs + i * KS + q8, q + at, ok);
    }
    for (int e = threadIdx.x; e < GDN_CHUNK * pv; e += GDN_THREADS) {
        const int i = e / pv, q = (e % pv) * 8;
        const bool ok = i < l;
        cp_async16(vs + i * VS + q, v + ((t0 + (ok ? i : 0)) * heads + h) * V + q, ok);
    }
    for (int i = threadIdx.x; i < GDN_CHUNK; i += GDN_THREADS) {
        cp_async4(la + i, alpha + (t0 + (i < l ? i : 0)) * heads + h, i < l);
        cp_async4(bs + i, beta + (t0 + (i < l ? i : 0)) * heads + h, i < l);
    }
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gi = lane / 4, ti = lane % 4;
    if (warp == 0) {
        // ln alpha floored at -20 (gdn_log_decays says why); 0 past a short chunk.
        const float l0 = 2 * lane < l ? fmaxf(logf(la[2 * lane]), -20.f) : 0.f;
        const float l1 = 2 * lane + 1 < l ? fmaxf(logf(la[2 * lane + 1]), -20.f) : 0.f;
        float s0, s1;
        warp_pair_scan(l0, l1, s0, s1);
        gs[2 * lane] = s0;
        gs[2 * lane + 1] = s1;
    }
    __syncthreads();
    const int r0 = (warp % 4) * 16;
    {
        // A = K Kᵀ, masked and scaled: warp (r0, c0) its 16 x 32 block.
        const int c0 = (warp / 4) * 32;
        float acc[4][4] = {};
        if (c0 <= r0 + 15) mma_rows<4>(acc, ks, KS, r0, ks, KS, c0, K / 16);
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int i = r0 + gi + 8 * half, j = c0 + nt * 8 + 2 * ti;
                const float beta_i = bs[i], g_i = gs[i];
                float2 x;
                x.x = j < i ? beta_i * __expf(g_i - gs[j]) * acc[nt][2 * half] : 0.f;
                x.y = j + 1 < i ? beta_i * __expf(g_i - gs[j + 1]) * acc[nt][2 * half + 1] : 0.f;
                *reinterpret_cast<float2*>(af + i * AP + j) = x;
            }
        if (MO && c0 <= r0 + 15) {
            // M = Q Kᵀ masked to j <= i < l and scaled by exp(g_i - g_j), the same block.
            float mq[4][4] = {};
            mma_rows<4>(mq, qs, KS, r0, ks, KS, c0, K / 16);
            u16* mb = m_out + base * GDN_CHUNK * GDN_CHUNK;
#pragma unroll
            for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int i = r0 + gi + 8 * half, j = c0 + nt * 8 + 2 * ti;
                    const float v0 = j <= i && i < l ? mq[nt][2 * half] * __expf(gs[i] - gs[j]) : 0.f;
                    const float v1 =
                        j + 1 <= i && i < l ? mq[nt][2 * half + 1] * __expf(gs[i] - gs[j + 1]) : 0.f;
                    *reinterpret_cast<u32*>(mb + i * GDN_CHUNK + j) = pack_bf16(v0, v1);
                }
        }
    }
    __syncthreads();
    if (warp < 2) {
        gdn_diagonal_inverse(af, tf, AP);
    } else {
        // Meanwhile (version 7) the other 6 warps scale the right-hand sides in place (K Kᵀ
        // is done): beta gamma k and beta v.
        constexpr int NS = GDN_THREADS - 64;
        for (int e = threadIdx.x - 64; e < GDN_CHUNK * (K / 2); e += NS) {
            const int i = e / (K / 2), q = 2 * (e % (K / 2));
            const float f = bs[i] * __expf(gs[i]);
            u32* p = reinterpret_cast<u32*>(ks + i * KS + q);
            *p = scale_pair(*p, f, f);
        }
        for (int e = threadIdx.x - 64; e < GDN_CHUNK * (V / 2); e += NS) {
            const int i = e / (V / 2), q = 2 * (e % (V / 2));
            u32* p = reinterpret_cast<u32*>(vs + i * VS + q);
            *p = scale_pair(*p, bs[i], bs[i]);
        }
    }
    gdn_lower_blocks(af, tf, AP);
    __syncthreads();
    // T to bf16 (over A; the lower blocks only, all that W's and U~'s products read).
    for (int e = threadIdx.x; e < GDN_CHUNK * GDN_CHUNK / 2; e += GDN_THREADS) {
        const int i = e / (GDN_CHUNK / 2), j = 2 * (e % (GDN_CHUNK / 2));
        if (j / 16 > i / 16) continue;
        const float2 x = *reinterpret_cast<const float2*>(tf + i * AP + j);
        *reinterpret_cast<u32*>(tb + i * TS + j) = pack_bf16(x.x, x.y);
    }
    __syncthreads();
    // W = T (beta gamma K) and U~ = T (beta V), the same work for every warp (version 7.1):
    // warp w takes one product (w / 4: W, then U~), half of its columns ((w / 2) % 2) and the
    // blocks of 16 rows p = w % 2 and 3 - p, whose products over T's lower blocks take p + 1
    // and 4 - p k steps, 5 in all (before, warp w took both products for rows 16 (w % 4):
    // from 2 k steps for the first rows to 8 for the last).
    {
        const int half = (warp / 2) % 2, p = warp % 2;
        for (int n = 0; n < 2; ++n) {
            const int rows = 16 * (n ? 3 - p : p);
            if (warp < 4)
                gdn_t_times(w_out, base * GDN_CHUNK, tb, TS, ks, KS, K, rows, half, l);
            else
                gdn_t_times(u_out, base * GDN_CHUNK, tb, TS, vs, VS, V, rows, half, l);
        }
    }
    for (int i = threadIdx.x; i < l; i += GDN_THREADS) g_out[base * GDN_CHUNK + i] = gs[i];
}

// The entry points of kernel 1': K and V from the arguments (gdn_prepare_tc) or compiled in
// for version 9's whole-row walk (gdn_prepare_tc_k64v64), or compiled in with M for the fused
// walk (gdn_prepare_tcm_k128v128; version 8: its q and m arguments first and after u), picked
// as the walk's (src/sequence_mixers/delta_cuda.rs).
#define GDN_PREPARE_TC(SUFFIX, KT, VT)                                                         \
    extern "C" __global__ void __launch_bounds__(GDN_THREADS) gdn_prepare_tc##SUFFIX(         \
        const u16* __restrict__ k, const u16* __restrict__ v, const float* __restrict__ alpha, \
        const float* __restrict__ beta, u16* __restrict__ w_out, u16* __restrict__ u_out,      \
        float* __restrict__ g_out, int T_len, int heads, int K, int V) {                       \
        gdn_prepare_tc_body<KT, VT, false>(nullptr, k, v, alpha, beta, w_out, u_out, nullptr,  \
                                           g_out, T_len, heads, K, V);                         \
    }
GDN_PREPARE_TC(, 0, 0)
GDN_PREPARE_TC(_k64v64, 64, 64)
#define GDN_PREPARE_TCM(SUFFIX, KT, VT)                                                        \
    extern "C" __global__ void __launch_bounds__(GDN_THREADS) gdn_prepare_tcm##SUFFIX(        \
        const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,       \
        const float* __restrict__ alpha, const float* __restrict__ beta,                       \
        u16* __restrict__ w_out, u16* __restrict__ u_out, u16* __restrict__ m_out,             \
        float* __restrict__ g_out, int T_len, int heads, int K, int V) {                       \
        gdn_prepare_tc_body<KT, VT, true>(q, k, v, alpha, beta, w_out, u_out, m_out, g_out,    \
                                          T_len, heads, K, V);                                 \
    }
GDN_PREPARE_TCM(_k64v64, 64, 64)
GDN_PREPARE_TCM(_k128v128, 128, 128)
