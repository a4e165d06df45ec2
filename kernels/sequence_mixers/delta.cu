// The gated delta rule forward (Gated DeltaNet; Yang, Kautz and Hatamizadeh, 2024, "Gated
// Delta Networks: Improving Mamba2 with Delta Rule") on CUDA cores in float32, version 1:
// correctness first, the chunked WY form of src/sequence_mixers/chunked.rs (its docstring
// derives it; Yang et al., 2024, "Parallelizing Linear Transformers with the Delta Rule over
// Sequence Length", section 3) in one kernel, gdn_fwd_<t>: one block per (head, batch entry)
// walks the chunks of GDN_CHUNK steps in order (the last one shorter) with the state S
// (V x K) in shared memory. Per chunk of l steps, with g_i = ln a_0 + ... + ln a_i and
// gamma_i = exp(g_i):
//
// 1. load q, k, v (as float), beta, and g (one thread);
// 2. A_ij = beta_i exp(g_i - g_j) (k_i . k_j) for j < i; the right-hand sides diag(beta) V
//    and W0 = diag(beta gamma) K;
// 3. forward substitution, (I + A) [U~ | W] = [diag(beta) V | W0]: one thread per column of
//    the V + K right-hand sides, rows in order (a column needs only its own earlier rows);
// 4. U = U~ - W S^T; M_ij = exp(g_i - g_j) (q_i . k_j) for j <= i (over A, which step 3 used);
// 5. O_i = gamma_i S q_i + sum_{j <= i} M_ij u_j, written in the dtype;
// 6. S <- gamma_{l-1} S + sum_j exp(g_{l-1} - g_j) u_j k_j^T.
//
// Layouts (row-major, as src/sequence_mixers/reference.rs): q, k [B, T, H, K]; v, o
// [B, T, H, V]; alpha, beta [B, T, H] (float32); initial and final state [B, H, V, K]
// (float32, value-major); has_initial says whether the initial state is given (when 0 the
// pointer is any valid buffer and is not read: zeros). <t> is f32 (float q, k, v and o) or
// bf16 (q, k, v and o as bf16 bits). K, V <= GDN_MAX_DIM.
// Dynamic shared memory, floats (the host computes it: src/sequence_mixers/delta_cuda.rs):
// V*(K+1) (S) + 3*L*(K+1) (q, k, W) + L*V (U) + L*L (A, then M) + 4*L (g, beta, gamma, the
// state decays), L = GDN_CHUNK; rows of S, q, k and W are padded to K+1 floats so that
// threads reading one column of them hit distinct banks.
// Offsets into global memory are 64-bit. No headers (NVRTC).

#define GDN_THREADS 256
#define GDN_CHUNK 64
#define GDN_MAX_DIM 128

// u16, ld and st: prelude.cuh, prepended by the host.

template <typename T>
__device__ void gdn_fwd(const T* __restrict__ q, const T* __restrict__ k,
                        const T* __restrict__ v, const float* __restrict__ alpha,
                        const float* __restrict__ beta, const float* __restrict__ initial_state,
                        int has_initial, T* __restrict__ o, float* __restrict__ final_state,
                        int T_len, int heads, int K, int V) {
    extern __shared__ float smem[];
    const int h = blockIdx.x, b = blockIdx.y;
    const int KP = K + 1;                   // padded row of S, q, k, W
    const long long bh = (long long)b * heads + h;
    float* s = smem;                        // [V][KP]: the state
    float* qs = s + V * KP;                 // [L][KP]
    float* ks = qs + GDN_CHUNK * KP;        // [L][KP]
    float* ws = ks + GDN_CHUNK * KP;        // [L][KP]: W
    float* us = ws + GDN_CHUNK * KP;        // [L][V]: V, then U~, then U
    float* m = us + GDN_CHUNK * V;          // [L][L]: A (j < i), then M (j <= i)
    float* gs = m + GDN_CHUNK * GDN_CHUNK;  // [L]: g
    float* bs = gs + GDN_CHUNK;             // [L]: beta
    float* gam = bs + GDN_CHUNK;            // [L]: gamma_i = exp(g_i)
    float* dk = gam + GDN_CHUNK;            // [L]: exp(g_{l-1} - g_i)
    for (int e = threadIdx.x; e < V * K; e += GDN_THREADS) {
        const int r = e / K, c = e % K;
        s[r * KP + c] = has_initial ? initial_state[bh * V * K + e] : 0.f;
    }
    for (int c0 = 0; c0 < T_len; c0 += GDN_CHUNK) {
        const int l = min(GDN_CHUNK, T_len - c0);
        // Row i of the chunk is time step t0 + i of batch entry b; its (t, h) index.
        const long long t0 = (long long)b * T_len + c0;
        // 1. Loads (the __syncthreads at the end of the previous chunk guards the overwrite).
        for (int e = threadIdx.x; e < l * K; e += GDN_THREADS) {
            const int i = e / K, c = e % K;
            const long long at = ((t0 + i) * heads + h) * K + c;
            qs[i * KP + c] = ld(q, at);
            ks[i * KP + c] = ld(k, at);
        }
        for (int e = threadIdx.x; e < l * V; e += GDN_THREADS) {
            const int i = e / V, r = e % V;
            us[e] = ld(v, ((t0 + i) * heads + h) * V + r);
        }
        if (threadIdx.x == 0) {
            float acc = 0.f;
            for (int i = 0; i < l; ++i) {
                const long long at = (t0 + i) * heads + h;
                acc += logf(alpha[at]);
                gs[i] = acc;
                bs[i] = beta[at];
            }
        }
        __syncthreads();
        // 2. A, the right-hand sides, and the decays.
        const float last = gs[l - 1];
        for (int e = threadIdx.x; e < l * l; e += GDN_THREADS) {
            const int i = e / l, j = e % l;
            if (j < i) {
                float dot = 0.f;
                for (int c = 0; c < K; ++c) dot += ks[i * KP + c] * ks[j * KP + c];
                m[i * GDN_CHUNK + j] = bs[i] * expf(gs[i] - gs[j]) * dot;
            }
        }
        for (int e = threadIdx.x; e < l * V; e += GDN_THREADS) us[e] *= bs[e / V];
        for (int e = threadIdx.x; e < l * K; e += GDN_THREADS) {
            const int i = e / K, c = e % K;
            ws[i * KP + c] = bs[i] * expf(gs[i]) * ks[i * KP + c];
        }
        for (int i = threadIdx.x; i < l; i += GDN_THREADS) {
            gam[i] = expf(gs[i]);
            dk[i] = expf(last - gs[i]);
        }
        __syncthreads();
        // 3. Forward substitution: column col of [U~ | W], row i minus sum_{j<i} A_ij row j.
        for (int col = threadIdx.x; col < V + K; col += GDN_THREADS) {
            float* x = col < V ? us + col : ws + (col - V);
            const int stride = col < V ? V : KP;
            for (int i = 1; i < l; ++i) {
                float acc = x[i * stride];
                for (int j = 0; j < i; ++j) acc -= m[i * GDN_CHUNK + j] * x[j * stride];
                x[i * stride] = acc;
            }
        }
        __syncthreads();
        // 4. U = U~ - W S^T (S is the state entering the chunk), and M over A.
        for (int e = threadIdx.x; e < l * V; e += GDN_THREADS) {
            const int i = e / V, r = e % V;
            float dot = 0.f;
            for (int c = 0; c < K; ++c) dot += ws[i * KP + c] * s[r * KP + c];
            us[e] -= dot;
        }
        for (int e = threadIdx.x; e < l * l; e += GDN_THREADS) {
            const int i = e / l, j = e % l;
            if (j <= i) {
                float dot = 0.f;
                for (int c = 0; c < K; ++c) dot += qs[i * KP + c] * ks[j * KP + c];
                m[i * GDN_CHUNK + j] = expf(gs[i] - gs[j]) * dot;
            }
        }
        __syncthreads();
        // 5. O_i = gamma_i S q_i + sum_{j <= i} M_ij u_j.
        for (int e = threadIdx.x; e < l * V; e += GDN_THREADS) {
            const int i = e / V, r = e % V;
            float off = 0.f;
            for (int c = 0; c < K; ++c) off += s[r * KP + c] * qs[i * KP + c];
            float acc = gam[i] * off;
            for (int j = 0; j <= i; ++j) acc += m[i * GDN_CHUNK + j] * us[j * V + r];
            st(o, ((t0 + i) * heads + h) * V + r, acc);
        }
        __syncthreads();
        // 6. S <- gamma_{l-1} S + sum_j exp(g_{l-1} - g_j) u_j k_j^T.
        const float keep = gam[l - 1];
        for (int e = threadIdx.x; e < V * K; e += GDN_THREADS) {
            const int r = e / K, c = e % K;
            float acc = keep * s[r * KP + c];
            for (int j = 0; j < l; ++j) acc += dk[j] * us[j * V + r] * ks[j * KP + c];
            s[r * KP + c] = acc;
        }
        __syncthreads();
    }
    float* out = final_state + bh * V * K;
    for (int e = threadIdx.x; e < V * K; e += GDN_THREADS) {
        const int r = e / K, c = e % K;
        out[e] = s[r * KP + c];
    }
}

#define GDN_ENTRY(NAME, T)                                                                     \
    extern "C" __global__ void __launch_bounds__(GDN_THREADS)                                  \
    gdn_fwd_##NAME(const T* q, const T* k, const T* v, const float* alpha, const float* beta, \
                   const float* initial_state, int has_initial, T* o, float* final_state,      \
                   int T_len, int heads, int K, int V) {                                       \
        gdn_fwd<T>(q, k, v, alpha, beta, initial_state, has_initial, o, final_state, T_len,    \
                   heads, K, V);                                                               \
    }

GDN_ENTRY(f32, float)
GDN_ENTRY(bf16, u16)
