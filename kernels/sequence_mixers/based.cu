// Based (Arora et al., 2024, "Simple linear attention language models balance the
// recall-throughput tradeoff"): causal linear attention plus exact softmax attention over a
// sliding window, summed, on CUDA cores in float32, version 1.2: the recurrence of `based` in
// src/sequence_mixers/reference.rs (its docstring defines it). The linear branch is SSD's
// chunked algorithm with every step's dt = 1 and A = 0 (no decay), B = k, C = q, x = v, one
// group per head: the host runs ssd.cu's three kernels for it (src/sequence_mixers/based_cuda.rs),
// the chunks in parallel, into the float32 scratch lin_t = sum_{s<=t} (q_t . k_s) v_s + S_0 q_t.
// This file is the window branch, launched after them on the same stream:
//
// based_window_<t>: one block per tile of BASED_TILE query rows (a grid over (row tile, head,
// batch entry)): the softmax of scale q_t . k_s over s = max(0, t-W+1)..t, applied to those
// v_s, plus lin_scale * lin_t, into O, the keys taken BASED_TILE at a time (below).
//
// Version 1 starts from an empty window cache: keys and values before the first step are not
// read (the host API takes only the initial linear state S_0; a cache is a later version).
//
// Layouts (row-major, as the reference): q, k [B, T, H, K]; v, O [B, T, H, V]; lin
// [B, T, H, V] (float32). <t> is f32 (float q, k, v and O) or bf16 (q, k, v and O as bf16
// bits). Limits (the host checks them): K, V <= BASED_MAX_DIM (the accumulators: V / 4 per
// thread), W <= BASED_MAX_WINDOW.
// Dynamic shared memory (the host computes it: src/sequence_mixers/based_cuda.rs,
// window_shared_bytes): (2*L*(K | 1) + L*V + L*(L + 1)) floats, L = BASED_TILE.
// Offsets are 64-bit. No headers (NVRTC).

#define BASED_THREADS 256
#define BASED_MAX_DIM 128
#define BASED_MAX_WINDOW 256
#define BASED_TILE 64

// u16, ld and st: prelude.cuh, prepended by the host.

// Kernel 4 (version 1.1): a block per tile of BASED_TILE query rows (and head, batch entry)
// walks the keys its rows can see, [max(0, t0 - W + 1), t0 + rows - 1], BASED_TILE keys per
// step, with the tile's queries and the step's keys and values in shared memory (each key and
// value read once per tile, coalesced, where version 1 read each key once per query row, one
// row per lane). Per step: the scores of the visible (query, key) pairs (the rest -inf), then
// per row the running maximum and sum of the exact softmax (online, as flash attention does),
// then the row's accumulators rescaled and the step's probabilities times V added. Thread
// (r, c) = (tid / 4, tid % 4) owns query row r, score columns c, c + 4, ... and value columns
// c, c + 4, ... A row's running maximum and sum live in its 4 threads' registers, combined by
// shuffles within the warp. Rows of q and k are K | 1 floats and rows of the probabilities
// BASED_TILE + 1 (odd strides) against bank conflicts. Every row sees at least its own key, so
// its sum is positive at the end.
template <typename T>
__device__ void window_branch(const T* __restrict__ q, const T* __restrict__ k,
                              const T* __restrict__ v, float scale,
                              const float* __restrict__ lin, float lin_scale,
                              T* __restrict__ o, int T_len, int heads, int K, int V, int W) {
    extern __shared__ float smem[];
    const int h = blockIdx.y, b = blockIdx.z;
    const int t0 = blockIdx.x * BASED_TILE;
    const int rows = min(BASED_TILE, T_len - t0);
    const int KP = K | 1, TP = BASED_TILE + 1;  // odd row strides: no bank shared by rows
    float* qt = smem;                       // [TILE][KP]: the tile's queries
    float* kt = qt + BASED_TILE * KP;       // [TILE][KP]: the step's keys
    float* vt = kt + BASED_TILE * KP;       // [TILE][V]: the step's values
    float* pr = vt + BASED_TILE * V;        // [TILE][TP]: the step's probabilities
    const float neg_inf = __int_as_float(0xff800000);
    const long long row0 = (long long)b * T_len;  // step 0 of batch entry b
    for (int e = threadIdx.x; e < rows * K; e += BASED_THREADS) {
        const int i = e / K, n = e % K;
        qt[i * KP + n] = ld(q, ((row0 + t0 + i) * heads + h) * K + n);
    }
    const int r = threadIdx.x / 4, c = threadIdx.x % 4;
    // The row's running maximum and sum, the same in its 4 threads (lanes 4r..4r+3 of a warp).
    float run_max = neg_inf, run_sum = 0.f;
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
        // The row's 16 dot products at once, n outermost: one load of q per 16 of k.
        float dot[BASED_TILE / 4];
#pragma unroll
        for (int u = 0; u < BASED_TILE / 4; ++u) dot[u] = 0.f;
        for (int n = 0; n < K; ++n) {
            const float qn = qt[r * KP + n];
#pragma unroll
            for (int u = 0; u < BASED_TILE / 4; ++u)
                if (c + 4 * u < cols) dot[u] += qn * kt[(c + 4 * u) * KP + n];
        }
        // Scores of the visible pairs (the rest -inf), the row's maximum over its 4 threads.
        float top = neg_inf;
#pragma unroll
        for (int u = 0; u < BASED_TILE / 4; ++u) {
            const int j = c + 4 * u, t = t0 + r, s = s0 + j;
            dot[u] = j < cols && r < rows && s <= t && s > t - W ? scale * dot[u] : neg_inf;
            top = fmaxf(top, dot[u]);
        }
        top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 1));
        top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 2));
        top = fmaxf(top, run_max);
        // A row with no visible key yet (or past T) keeps max -inf, sum 0 and adds nothing.
        const float fix = top == neg_inf ? 1.f : __expf(run_max - top);
        float part = 0.f;
#pragma unroll
        for (int u = 0; u < BASED_TILE / 4; ++u) {
            const int j = c + 4 * u;
            const float e = top == neg_inf ? 0.f : __expf(dot[u] - top);
            if (j < cols) pr[r * TP + j] = e;
            part += e;
        }
        part += __shfl_xor_sync(0xffffffffu, part, 1);
        part += __shfl_xor_sync(0xffffffffu, part, 2);
        run_max = top;
        run_sum = run_sum * fix + part;
        // The row's probabilities come from the 4 lanes of this warp.
        __syncwarp();
        // Constant indices into acc (the loops over m unrolled) keep it in registers.
#pragma unroll
        for (int m = 0; m < BASED_MAX_DIM / 4; ++m) acc[m] *= fix;
        for (int j = 0; j < cols; ++j) {
            const float pj = pr[r * TP + j];
#pragma unroll
            for (int m = 0; m < BASED_MAX_DIM / 4; ++m) {
                if (m * 4 >= V) break;  // the same m for every thread
                if (m * 4 + c < V) acc[m] += pj * vt[j * V + m * 4 + c];
            }
        }
    }
    if (r < rows) {
        const long long at = ((row0 + t0 + r) * heads + h) * V;
        const float inv = 1.f / run_sum;
#pragma unroll
        for (int m = 0; m < BASED_MAX_DIM / 4; ++m)
            if (m * 4 + c < V)
                st(o, at + m * 4 + c, lin_scale * lin[at + m * 4 + c] + acc[m] * inv);
    }
}

#define BASED_ENTRIES(NAME, T)                                                                 \
    extern "C" __global__ void __launch_bounds__(BASED_THREADS)                                \
    based_window_##NAME(const T* q, const T* k, const T* v, float scale, const float* lin,    \
                        float lin_scale, T* o, int T_len, int heads, int K, int V, int W) {    \
        window_branch<T>(q, k, v, scale, lin, lin_scale, o, T_len, heads, K, V, W);           \
    }

BASED_ENTRIES(f32, float)
BASED_ENTRIES(bf16, u16)
