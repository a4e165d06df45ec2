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
