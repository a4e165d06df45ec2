// Based (Arora et al., 2024, "Simple linear attention language models balance the
// recall-throughput tradeoff"): causal linear attention plus exact softmax attention over a
// sliding window, summed: the recurrence of `based` in
// src/sequence_mixers/reference.rs (its docstring defines it). The linear branch is SSD's
// chunked algorithm with every step's dt = 1 and A = 0 (no decay), B = k, C = q, x = v, one
// group per head: the host runs ssd.cu's three kernels for it (src/sequence_mixers/based_cuda.rs),
// the chunks in parallel, into the float32 scratch lin_t = sum_{s<=t} (q_t . k_s) v_s + S_0 q_t.
// (in bf16, on its tensor-core kernels where they take the shape). This file is the window
// branch, launched after them on the same stream: version 2 (based_window_tc, bf16 with K and V
// multiples of 16, on tensor cores, described before its code below) or version 1.2, on CUDA
// cores in float32:
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

// Version 2 of the window branch for bf16 (based_window_tc): the same walk over the keys a
// tile of BASED_TILE query rows sees, on tensor cores as flash attention's forward does
// (mma.sync m16n8k16, bf16 operands, float32 accumulation): 4 warps, each 16 query rows; per
// step of BASED_TILE keys the scores S = Q Kᵀ (K's rows read by ldmatrix), the visible pairs
// kept (the rest -inf), the online softmax of each row in the registers of its 4 lanes, and
// P V with P rounded to bf16 from the score accumulators and V by ldmatrix.trans. The tile's
// queries and the step's keys and values come by cp.async (zeros outside [0, T)). Needs K and
// V multiples of 16, at most BASED_MAX_DIM (the host checks). Dynamic shared memory:
// BASED_TILE ((K + 8) 2 + (V + 8)) bf16.
#define BASED_TC_THREADS 128

// A fragment of rows r0 .. r0 + 15, columns k0 .. k0 + 15 of a bf16 array (rows `stride` apart).
__device__ __forceinline__ void based_ld_a(u32* f, const u16* a, int stride, int r0, int k0) {
    const int lane = threadIdx.x % 32;
    ldsm_x4(f, a + (r0 + (lane & 15)) * stride + k0 + (lane >> 4) * 8);
}

extern "C" __global__ void __launch_bounds__(BASED_TC_THREADS)
based_window_tc(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                float scale, const float* __restrict__ lin, float lin_scale, u16* __restrict__ o,
                int T_len, int heads, int K, int V, int W) {
    extern __shared__ float smem[];
    const int h = blockIdx.y, b = blockIdx.z;
    const int t0 = blockIdx.x * BASED_TILE;
    const int rows = min(BASED_TILE, T_len - t0);
    const int KS = K + 8, VS = V + 8;
    u16* qs = reinterpret_cast<u16*>(smem);     // [TILE][KS]
    u16* ks = qs + BASED_TILE * KS;             // [TILE][KS]
    u16* vs = ks + BASED_TILE * KS;             // [TILE][VS]
    const float neg_inf = __int_as_float(0xff800000);
    const long long row0 = (long long)b * T_len;
    const int kp = K / 8, vp = V / 8;
    for (int e = threadIdx.x; e < BASED_TILE * kp; e += BASED_TC_THREADS) {
        const int i = e / kp, c = (e % kp) * 8;
        const bool ok = i < rows;
        cp_async16(qs + i * KS + c, q + ((row0 + t0 + (ok ? i : 0)) * heads + h) * K + c, ok);
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gi = lane / 4, ti = lane % 4;
    const int r0 = warp * 16;
    const int vt = V / 8;  // output tiles of 8 columns
    float acc[BASED_MAX_DIM / 8][4];
#pragma unroll
    for (int nt = 0; nt < BASED_MAX_DIM / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[nt][e] = 0.f;
    // Rows r0 + gi (half 0) and r0 + gi + 8 (half 1): running maximum and sum.
    float run_max[2] = {neg_inf, neg_inf}, run_sum[2] = {0.f, 0.f};
    const int first = max(0, t0 - W + 1), last = t0 + rows - 1;
    for (int s0 = first; s0 <= last; s0 += BASED_TILE) {
        const int cols = min(BASED_TILE, last - s0 + 1);
        __syncthreads();  // the previous step's readers of ks and vs are done
        for (int e = threadIdx.x; e < BASED_TILE * kp; e += BASED_TC_THREADS) {
            const int j = e / kp, c = (e % kp) * 8;
            const bool ok = j < cols;
            cp_async16(ks + j * KS + c, k + ((row0 + s0 + (ok ? j : 0)) * heads + h) * K + c, ok);
        }
        for (int e = threadIdx.x; e < BASED_TILE * vp; e += BASED_TC_THREADS) {
            const int j = e / vp, c = (e % vp) * 8;
            const bool ok = j < cols;
            cp_async16(vs + j * VS + c, v + ((row0 + s0 + (ok ? j : 0)) * heads + h) * V + c, ok);
        }
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();
        // S = Q Kᵀ for the warp's 16 rows and the step's 64 keys (8 tiles of 8).
        float sc[BASED_TILE / 8][4];
#pragma unroll
        for (int nt = 0; nt < BASED_TILE / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) sc[nt][e] = 0.f;
        for (int kk = 0; kk < K; kk += 16) {
            u32 f[4];
            based_ld_a(f, qs, KS, r0, kk);
            const int mi = lane >> 3;
#pragma unroll
            for (int nt = 0; nt < BASED_TILE / 8; nt += 2) {
                u32 bf[4];
                ldsm_x4(bf, ks + ((nt + (mi >= 2 ? 1 : 0)) * 8 + (lane & 7)) * KS + kk + (mi & 1) * 8);
                mma_bf16(sc[nt], f, bf[0], bf[1]);
                mma_bf16(sc[nt + 1], f, bf[2], bf[3]);
            }
        }
        // Visible pairs: key s in (t - W, t], s < T (every row t < T sees its own key).
        float fix[2], top[2];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int t = t0 + r0 + gi + 8 * half;
            float m = neg_inf;
#pragma unroll
            for (int nt = 0; nt < BASED_TILE / 8; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int j = nt * 8 + 2 * ti + e, s = s0 + j;
                    float& x = sc[nt][2 * half + e];
                    x = (j < cols && t < T_len && s <= t && s > t - W) ? scale * x : neg_inf;
                    m = fmaxf(m, x);
                }
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
            top[half] = fmaxf(m, run_max[half]);
            // A row with no visible key yet keeps max -inf, sum 0 and adds nothing.
            fix[half] = top[half] == neg_inf ? 1.f : __expf(run_max[half] - top[half]);
            float part = 0.f;
#pragma unroll
            for (int nt = 0; nt < BASED_TILE / 8; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    float& x = sc[nt][2 * half + e];
                    x = top[half] == neg_inf ? 0.f : __expf(x - top[half]);
                    part += x;
                }
            part += __shfl_xor_sync(0xffffffffu, part, 1);
            part += __shfl_xor_sync(0xffffffffu, part, 2);
            run_max[half] = top[half];
            run_sum[half] = run_sum[half] * fix[half] + part;
        }
#pragma unroll
        for (int nt = 0; nt < BASED_MAX_DIM / 8; ++nt) {
            acc[nt][0] *= fix[0];
            acc[nt][1] *= fix[0];
            acc[nt][2] *= fix[1];
            acc[nt][3] *= fix[1];
        }
        // O += P V: P's A fragment for keys 16 kc .. 16 kc + 15 is the score tiles 2 kc, 2 kc + 1.
#pragma unroll
        for (int kc = 0; kc < BASED_TILE / 16; ++kc) {
            const u32 pa[4] = {pack_bf16(sc[2 * kc][0], sc[2 * kc][1]),
                               pack_bf16(sc[2 * kc][2], sc[2 * kc][3]),
                               pack_bf16(sc[2 * kc + 1][0], sc[2 * kc + 1][1]),
                               pack_bf16(sc[2 * kc + 1][2], sc[2 * kc + 1][3])};
#pragma unroll
            for (int nt = 0; nt < BASED_MAX_DIM / 8; nt += 2) {
                if (nt < vt) {
                    u32 bf[4];
                    ldsm_x4_t(bf, vs + (kc * 16 + (lane & 15)) * VS + nt * 8 + (lane >> 4) * 8);
                    mma_bf16(acc[nt], pa, bf[0], bf[1]);
                    mma_bf16(acc[nt + 1], pa, bf[2], bf[3]);
                }
            }
        }
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int i = r0 + gi + 8 * half;
        if (i < rows) {
            const long long at = ((row0 + t0 + i) * heads + h) * V;
            const float inv = 1.f / run_sum[half];
#pragma unroll
            for (int nt = 0; nt < BASED_MAX_DIM / 8; ++nt) {
                if (nt < vt) {
                    const int c = nt * 8 + 2 * ti;
                    const float a = lin_scale * lin[at + c] + acc[nt][2 * half] * inv;
                    const float bb = lin_scale * lin[at + c + 1] + acc[nt][2 * half + 1] * inv;
                    *reinterpret_cast<u32*>(o + at + c) = pack_bf16(a, bb);
                }
            }
        }
    }
}
