// Based (Arora et al., 2024, "Simple linear attention language models balance the
// recall-throughput tradeoff"): causal linear attention plus exact softmax attention over a
// sliding window, summed, on CUDA cores in float32, version 1: correctness first, the
// recurrence of `based` in src/sequence_mixers/reference.rs (its docstring defines it) in two
// kernels, launched in this order on one stream:
//
// 1. based_linear_<t>: one block per (head, batch entry), sequentially over chunks of L steps
//    (the last one shorter), with the linear state S (V x K, value-major) in shared memory:
//    per chunk, lin_i = scale (sum_{j<=i} (q_i . k_j) v_j + S_in q_i) into `lin`, then
//    S += sum_j v_j k_j^T. S starts at the initial state (or zeros) and ends in final_state.
//    No decay: the chunked form of SSD (ssd.cu) with every log decay 0.
// 2. based_window_<t>: one warp per query row t (8 rows per block, a grid over (row block,
//    head, batch entry)): the max-subtracted softmax of scale q_t . k_s over
//    s = max(0, t-W+1)..t, applied to those v_s, plus lin_t, into O.
//
// Version 1 starts from an empty window cache: keys and values before the first step are not
// read (the host API takes only the initial linear state S_0; a cache is a later version).
//
// Layouts (row-major, as the reference): q, k [B, T, H, K]; v, O [B, T, H, V]; initial and
// final linear state [B, H, V, K] (float32); has_initial says whether the initial state is
// given (when 0 the pointer is any valid buffer and is not read: zeros); lin [B, T, H, V]
// (float32 scratch: the linear branch's output, written by kernel 1, read by kernel 2).
// <t> is f32 (float q, k, v and O) or bf16 (q, k, v and O as bf16 bits).
// Limits (the host checks them): K, V <= BASED_MAX_DIM, W <= BASED_MAX_WINDOW.
// Dynamic shared memory: kernel 1 ((V + L)*(K + 1) + L*K + L*V + L*L) floats (the host
// computes it: src/sequence_mixers/based_cuda.rs; the rows of S and of the chunk's keys are
// padded to K + 1 floats, since a warp's lanes read one column of them, a key j or a value
// index p per lane, and rows of K floats, K a multiple of 32, put them all on one bank); kernel 2 static, 8 * (BASED_MAX_DIM + BASED_MAX_WINDOW)
// floats (12 KiB). Offsets are 64-bit. No headers (NVRTC).

#define BASED_THREADS 256
#define BASED_CHUNK 64
#define BASED_MAX_DIM 128
#define BASED_MAX_WINDOW 256
#define BASED_WARPS (BASED_THREADS / 32)

// u16, ld and st: prelude.cuh, prepended by the host.

template <typename T>
__device__ void linear_branch(const T* __restrict__ q, const T* __restrict__ k,
                              const T* __restrict__ v, float scale,
                              const float* __restrict__ initial_state, int has_initial,
                              float* __restrict__ lin, float* __restrict__ final_state,
                              int T_len, int heads, int K, int V) {
    extern __shared__ float smem[];
    const int h = blockIdx.x, b = blockIdx.y;
    const long long bh = (long long)b * heads + h;
    const int KP = K + 1;                     // padded row of S and of the keys
    float* s = smem;                          // [V][KP]: the running linear state
    float* qs = s + V * KP;                   // [L][K]
    float* ks = qs + BASED_CHUNK * K;         // [L][KP]
    float* vs = ks + BASED_CHUNK * KP;        // [L][V]
    float* m = vs + BASED_CHUNK * V;          // [L][L]: q_i . k_j for j <= i, else 0
    for (int e = threadIdx.x; e < V * K; e += BASED_THREADS)
        s[(e / K) * KP + e % K] = has_initial ? initial_state[bh * V * K + e] : 0.f;
    const int n_chunks = (T_len + BASED_CHUNK - 1) / BASED_CHUNK;
    for (int c = 0; c < n_chunks; ++c) {
        // Row (b, c L + i) of the [B, T] steps.
        const long long t0 = (long long)b * T_len + (long long)c * BASED_CHUNK;
        const int l = min(BASED_CHUNK, T_len - c * BASED_CHUNK);
        for (int e = threadIdx.x; e < l * K; e += BASED_THREADS) {
            const int i = e / K, n = e % K;
            const long long at = ((t0 + i) * heads + h) * K + n;
            qs[e] = ld(q, at);
            ks[i * KP + n] = ld(k, at);
        }
        for (int e = threadIdx.x; e < l * V; e += BASED_THREADS) {
            const int i = e / V, p = e % V;
            vs[e] = ld(v, ((t0 + i) * heads + h) * V + p);
        }
        // Also orders the previous chunk's state update before this chunk's reads of s.
        __syncthreads();
        for (int e = threadIdx.x; e < l * l; e += BASED_THREADS) {
            const int i = e / l, j = e % l;
            float dot = 0.f;
            if (j <= i)
                for (int n = 0; n < K; ++n) dot += qs[i * K + n] * ks[j * KP + n];
            m[i * BASED_CHUNK + j] = dot;
        }
        __syncthreads();
        // lin_i = scale (sum_{j<=i} m_ij v_j + S_in q_i): S_in is s before this chunk's update.
        for (int e = threadIdx.x; e < l * V; e += BASED_THREADS) {
            const int i = e / V, p = e % V;
            float intra = 0.f;
            for (int j = 0; j <= i; ++j) intra += m[i * BASED_CHUNK + j] * vs[j * V + p];
            float inter = 0.f;
            for (int n = 0; n < K; ++n) inter += s[p * KP + n] * qs[i * K + n];
            lin[((t0 + i) * heads + h) * V + p] = scale * (intra + inter);
        }
        __syncthreads();
        // S += sum_j v_j k_j^T over the chunk's l steps.
        for (int e = threadIdx.x; e < V * K; e += BASED_THREADS) {
            const int p = e / K, n = e % K;
            float acc = 0.f;
            for (int j = 0; j < l; ++j) acc += vs[j * V + p] * ks[j * KP + n];
            s[p * KP + n] += acc;
        }
        // The next chunk overwrites qs, ks and vs, which the update above reads.
        __syncthreads();
    }
    for (int e = threadIdx.x; e < V * K; e += BASED_THREADS)
        final_state[bh * V * K + e] = s[(e / K) * KP + e % K];
}

template <typename T>
__device__ void window_branch(const T* __restrict__ q, const T* __restrict__ k,
                              const T* __restrict__ v, float scale,
                              const float* __restrict__ lin, T* __restrict__ o, int T_len,
                              int heads, int K, int V, int W) {
    __shared__ float q_row[BASED_WARPS][BASED_MAX_DIM];
    __shared__ float weight[BASED_WARPS][BASED_MAX_WINDOW];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int t = blockIdx.x * BASED_WARPS + warp;
    const int h = blockIdx.y, b = blockIdx.z;
    // A whole warp leaves together; the kernel has no block-wide barrier.
    if (t >= T_len) return;
    const long long row0 = (long long)b * T_len;  // step 0 of batch entry b
    const long long qt = (row0 + t) * heads + h;  // (b, t, h)
    float* qw = q_row[warp];
    float* w = weight[warp];
    for (int n = lane; n < K; n += 32) qw[n] = ld(q, qt * K + n);
    __syncwarp();
    // Keys first..t, held in w[0..count): lane r scores keys r, r + 32, ...
    const int first = max(0, t - W + 1);
    const int count = t - first + 1;
    float top = __int_as_float(0xff800000);  // -inf: a lane with no key scores none
    for (int r = lane; r < count; r += 32) {
        const long long at = ((row0 + first + r) * heads + h) * K;
        float dot = 0.f;
        for (int n = 0; n < K; ++n) dot += qw[n] * ld(k, at + n);
        const float score = scale * dot;
        w[r] = score;
        top = fmaxf(top, score);
    }
    for (int off = 16; off > 0; off >>= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, off));
    float total = 0.f;
    for (int r = lane; r < count; r += 32) {
        const float e = expf(w[r] - top);
        w[r] = e;
        total += e;
    }
    for (int off = 16; off > 0; off >>= 1) total += __shfl_xor_sync(0xffffffffu, total, off);
    __syncwarp();
    const float inv = 1.f / total;
    for (int p = lane; p < V; p += 32) {
        float acc = 0.f;
        for (int r = 0; r < count; ++r) acc += w[r] * ld(v, ((row0 + first + r) * heads + h) * V + p);
        st(o, qt * V + p, lin[qt * V + p] + acc * inv);
    }
}

#define BASED_ENTRIES(NAME, T)                                                                 \
    extern "C" __global__ void __launch_bounds__(BASED_THREADS)                                \
    based_linear_##NAME(const T* q, const T* k, const T* v, float scale,                      \
                        const float* initial_state, int has_initial, float* lin,               \
                        float* final_state, int T_len, int heads, int K, int V) {              \
        linear_branch<T>(q, k, v, scale, initial_state, has_initial, lin, final_state, T_len,  \
                         heads, K, V);                                                         \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(BASED_THREADS)                                \
    based_window_##NAME(const T* q, const T* k, const T* v, float scale, const float* lin,    \
                        T* o, int T_len, int heads, int K, int V, int W) {                     \
        window_branch<T>(q, k, v, scale, lin, o, T_len, heads, K, V, W);                      \
    }

BASED_ENTRIES(f32, float)
BASED_ENTRIES(bf16, u16)
