// The gated delta rule forward (Gated DeltaNet; Yang, Kautz and Hatamizadeh, 2024, "Gated
// Delta Networks: Improving Mamba2 with Delta Rule") on CUDA cores in float32, version 2: the
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
