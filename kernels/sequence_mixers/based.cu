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
// 2. based_window_<t>: one block per tile of BASED_TILE query rows (a grid over (row tile,
//    head, batch entry)): the softmax of scale q_t . k_s over s = max(0, t-W+1)..t, applied
//    to those v_s, plus lin_t, into O, the keys taken BASED_TILE at a time (below).
//
// Version 1 starts from an empty window cache: keys and values before the first step are not
// read (the host API takes only the initial linear state S_0; a cache is a later version).
//
// Layouts (row-major, as the reference): q, k [B, T, H, K]; v, O [B, T, H, V]; initial and
// final linear state [B, H, V, K] (float32); has_initial says whether the initial state is
// given (when 0 the pointer is any valid buffer and is not read: zeros); lin [B, T, H, V]
// (float32 scratch: the linear branch's output, written by kernel 1, read by kernel 2).
// <t> is f32 (float q, k, v and O) or bf16 (q, k, v and O as bf16 bits).
// Limits (the host checks them): K, V <= BASED_MAX_DIM (kernel 2's accumulators: V / 4 per
// thread), W <= BASED_MAX_WINDOW.
// Dynamic shared memory (the host computes both: src/sequence_mixers/based_cuda.rs): kernel 1
// ((V + L)*(K + 1) + L*K + L*V + L*L) floats, the rows of S and of the chunk's keys padded to
// K + 1 floats (a warp's lanes read one column of them, a key j or a value index p per lane,
// and rows of K floats, K a multiple of 32, would put them all on one bank); kernel 2
// (2*L*(K + 1) + L*V + L*(L + 1) + 3*L) floats, L = BASED_TILE = BASED_CHUNK.
// Offsets are 64-bit. No headers (NVRTC).

#define BASED_THREADS 256
#define BASED_CHUNK 64
#define BASED_MAX_DIM 128
#define BASED_MAX_WINDOW 256
#define BASED_TILE 64

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

// Kernel 2, version 1.1: a block per tile of BASED_TILE query rows (and head, batch entry)
// walks the keys its rows can see, [max(0, t0 - W + 1), t0 + rows - 1], BASED_TILE keys per
// step, with the tile's queries and the step's keys and values in shared memory (each key and
// value read once per tile, coalesced, where version 1 read each key once per query row, one
// row per lane). Per step: the scores of the visible (query, key) pairs (the rest -inf), then
// per row the running maximum and sum of the exact softmax (online, as flash attention does),
// then the row's accumulators rescaled and the step's probabilities times V added. Thread
// (r, c) = (tid / 4, tid % 4) owns query row r, score columns c, c + 4, ... and value columns
// c, c + 4, ... Rows of q, k and the probabilities are padded by one float against bank
// conflicts. Every row sees at least its own key, so its sum is positive at the end.
template <typename T>
__device__ void window_branch(const T* __restrict__ q, const T* __restrict__ k,
                              const T* __restrict__ v, float scale,
                              const float* __restrict__ lin, T* __restrict__ o, int T_len,
                              int heads, int K, int V, int W) {
    extern __shared__ float smem[];
    const int h = blockIdx.y, b = blockIdx.z;
    const int t0 = blockIdx.x * BASED_TILE;
    const int rows = min(BASED_TILE, T_len - t0);
    const int KP = K + 1, TP = BASED_TILE + 1;
    float* qt = smem;                       // [TILE][KP]: the tile's queries
    float* kt = qt + BASED_TILE * KP;       // [TILE][KP]: the step's keys
    float* vt = kt + BASED_TILE * KP;       // [TILE][V]: the step's values
    float* pr = vt + BASED_TILE * V;        // [TILE][TP]: scores, then probabilities
    float* row_max = pr + BASED_TILE * TP;  // [TILE]
    float* row_sum = row_max + BASED_TILE;  // [TILE]
    float* row_fix = row_sum + BASED_TILE;  // [TILE]: exp(old max - new max)
    const float neg_inf = __int_as_float(0xff800000);
    const long long row0 = (long long)b * T_len;  // step 0 of batch entry b
    for (int e = threadIdx.x; e < rows * K; e += BASED_THREADS) {
        const int i = e / K, n = e % K;
        qt[i * KP + n] = ld(q, ((row0 + t0 + i) * heads + h) * K + n);
    }
    for (int i = threadIdx.x; i < BASED_TILE; i += BASED_THREADS) {
        row_max[i] = neg_inf;
        row_sum[i] = 0.f;
    }
    const int r = threadIdx.x / 4, c = threadIdx.x % 4;
    float acc[BASED_MAX_DIM / 4];
    for (int m = 0; m < BASED_MAX_DIM / 4; ++m) acc[m] = 0.f;
    const int first = max(0, t0 - W + 1), last = t0 + rows - 1;
    for (int s0 = first; s0 <= last; s0 += BASED_TILE) {
        const int cols = min(BASED_TILE, last - s0 + 1);
        // The previous step's readers of kt, vt and pr are done (and, the first time, the
        // tile's queries and row statistics are written).
        __syncthreads();
        for (int e = threadIdx.x; e < cols * K; e += BASED_THREADS) {
            const int j = e / K, n = e % K;
            kt[j * KP + n] = ld(k, ((row0 + s0 + j) * heads + h) * K + n);
        }
        for (int e = threadIdx.x; e < cols * V; e += BASED_THREADS) {
            const int j = e / V, p = e % V;
            vt[j * V + p] = ld(v, ((row0 + s0 + j) * heads + h) * V + p);
        }
        __syncthreads();
        for (int j = c; j < cols; j += 4) {
            const int t = t0 + r, s = s0 + j;
            float score = neg_inf;
            if (r < rows && s <= t && s > t - W) {
                float dot = 0.f;
                for (int n = 0; n < K; ++n) dot += qt[r * KP + n] * kt[j * KP + n];
                score = scale * dot;
            }
            pr[r * TP + j] = score;
        }
        __syncthreads();
        if (threadIdx.x < BASED_TILE) {
            const int i = threadIdx.x;
            float top = row_max[i];
            for (int j = 0; j < cols; ++j) top = fmaxf(top, pr[i * TP + j]);
            // A row with no visible key yet (or past T) keeps max -inf, sum 0 and adds nothing.
            const float fix = top == neg_inf ? 1.f : __expf(row_max[i] - top);
            float total = row_sum[i] * fix;
            for (int j = 0; j < cols; ++j) {
                const float e = top == neg_inf ? 0.f : __expf(pr[i * TP + j] - top);
                pr[i * TP + j] = e;
                total += e;
            }
            row_max[i] = top;
            row_sum[i] = total;
            row_fix[i] = fix;
        }
        __syncthreads();
        // Constant indices into acc (the loops over m unrolled) keep it in registers.
        const float fix = row_fix[r];
#pragma unroll
        for (int m = 0; m < BASED_MAX_DIM / 4; ++m) acc[m] *= fix;
        for (int j = 0; j < cols; ++j) {
            const float pj = pr[r * TP + j];
#pragma unroll
            for (int m = 0; m < BASED_MAX_DIM / 4; ++m)
                if (m * 4 + c < V) acc[m] += pj * vt[j * V + m * 4 + c];
        }
    }
    if (r < rows) {
        const long long at = ((row0 + t0 + r) * heads + h) * V;
        const float inv = 1.f / row_sum[r];
#pragma unroll
        for (int m = 0; m < BASED_MAX_DIM / 4; ++m)
            if (m * 4 + c < V) st(o, at + m * 4 + c, lin[at + m * 4 + c] + acc[m] * inv);
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
