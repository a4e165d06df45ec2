// SSD (Mamba-2's state-space dual layer; Dao and Gu, 2024, "Transformers are SSMs", the block
// decomposition of section 6). Two paths, chosen by the host (src/sequence_mixers/cuda.rs,
// `tensor_core_path`): version 5 for bf16 inputs whose sizes fit the tensor-core tiles, three
// kernels (two on mma.sync) described before their code below; and version 1, every other case
// (fp32 inputs among them), on CUDA cores in float32: the chunked algorithm of
// src/sequence_mixers/chunked.rs (its docstring derives it) in three kernels, each a grid over
// (chunk, head, batch entry) or (head, batch entry):
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
#define SSD_PASS_AHEAD 8

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

// The walk over the chunks of ssd_state_passing, in order (REVERSE false) or from the last
// chunk back to the first (REVERSE true: the backward's adjoints, ssd_bwd.cu): each chunk's
// slot of `states` gets the running value entering it, then running = exp(decay_c) running +
// (the slot's old value); `start` (or zeros when has_start is 0) begins the walk and `end`
// gets the value after it.
template <bool REVERSE>
__device__ void pass_chunks(float* __restrict__ states, const float* __restrict__ chunk_log_decay,
                            const float* __restrict__ start, int has_start,
                            float* __restrict__ end, int heads, int n_chunks, int P, int N) {
    // Blocks (h, b, z) share the P x N state elements of (batch entry, head) by z: enough
    // threads walking the chunks at once that the loads of successive chunks overlap.
    const int h = blockIdx.x, b = blockIdx.y;
    const long long bh = (long long)b * heads + h;
    float* s = states + bh * n_chunks * P * N;
    const float* decay = chunk_log_decay + bh * n_chunks;
    for (int e = blockIdx.z * SSD_THREADS + threadIdx.x; e < P * N; e += SSD_THREADS * gridDim.z) {
        float running = has_start ? start[bh * P * N + e] : 0.f;
        // The loads of SSD_PASS_AHEAD chunks are issued together, then the chain runs over
        // them: one memory latency per group rather than per chunk.
        for (int k0 = 0; k0 < n_chunks; k0 += SSD_PASS_AHEAD) {
            float local[SSD_PASS_AHEAD], keep[SSD_PASS_AHEAD];
#pragma unroll
            for (int k = 0; k < SSD_PASS_AHEAD; ++k) {
                const int c = REVERSE ? n_chunks - 1 - (k0 + k) : k0 + k;
                const bool in = k0 + k < n_chunks;
                local[k] = in ? s[(long long)c * P * N + e] : 0.f;
                keep[k] = in ? __expf(decay[c]) : 0.f;
            }
#pragma unroll
            for (int k = 0; k < SSD_PASS_AHEAD; ++k) {
                if (k0 + k < n_chunks) {
                    const int c = REVERSE ? n_chunks - 1 - (k0 + k) : k0 + k;
                    s[(long long)c * P * N + e] = running;
                    running = keep[k] * running + local[k];
                }
            }
        }
        end[bh * P * N + e] = running;
    }
}

extern "C" __global__ void __launch_bounds__(SSD_THREADS)
ssd_state_passing(float* __restrict__ states, const float* __restrict__ chunk_log_decay,
                  const float* __restrict__ initial_state, int has_initial,
                  float* __restrict__ final_state, int heads, int n_chunks, int P, int N) {
    pass_chunks<false>(states, chunk_log_decay, initial_state, has_initial, final_state, heads,
                       n_chunks, P, N);
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

// Version 5 for bf16 inputs: three kernels, the chunk states and the chunk outputs on tensor
// cores (mma.sync m16n8k16, bf16 operands, float32 accumulation; prelude.cuh's mma_bf16), the
// operands brought by cp.async and read by ldmatrix. Needs P % 16 == 0, N % 32 == 0 and P, N <=
// 128 (the host checks; other shapes take the float32 kernels). The chunks are taken in walks
// of `walk` chunks (the host's chunks_per_walk: up to 8, keeping about 1024 blocks), so that
// only one state per walk goes through the sequential passing (version 4, every chunk its own
// block, passed 0.5 GB of states at P = N = 128, T16384: 0.136 ms of 0.585).
//
// A1. ssd_chunk_states_tc: a block of 8 warps per (walk, head, batch entry), the walk's chunks in
//     order: each chunk's x and B rows and dt by cp.async (the next chunk's x rows asked into L2
//     meanwhile), the cumulative log decays by every warp for itself (warp_pair_scan), then
//     the running sum S = exp(cs_last) S + (decayed Δ x)ᵀ B (P × N, float32 in the warps'
//     accumulators: warp w a 16-row tile of P and its share of N's 8-column tiles, 8 / (P / 16)
//     warps per row tile in integer division: at P = 48 and 80 to 112 one to three warps get
//     no tile), the steps' weights exp(cs_last - cs_j) dt_j applied to x's fragments as they
//     come out of ldmatrix (version 4.2). After each chunk the sum is rounded to bf16, staged in
//     shared memory over the x and B rows and written with 16-byte stores: into the next
//     chunk's slot of `states` (the sum of the walk's chunks before it), or after the walk's
//     last chunk into the walk's first chunk's slot (the walk's own state). chunk_log_decay[c]
//     gets the log decay from the walk's start through chunk c.
// A2. ssd_state_passing_bf16: the walk over the walks in order, each thread 8 adjacent elements
//     of one (batch entry, head)'s state in float32 registers: it writes the state entering
//     walk k over its own state (bf16, in its first chunk's slot) and carries
//     exp(walk decay) S + S_k on. The loads of the next SSD_PASS_AHEAD walks are issued before
//     the stores of the current ones. The float32 state after the last walk is the final state.
// (Version 3 walked all the chunks in one kernel with the state in mma accumulators, 512 blocks
// of 4 warps at P = N = 128: bound by its per-chunk instructions and barriers, 0.49 ms at
// T16384; kernels/TUNING-sequence-mixers.md.)
// B. ssd_chunk_scan_tc (and _f32out): a block of 8 warps per (chunk, head, batch entry), as
//    version 2 (C, B and dt loaded first, x and the chunk's slot of `states` in a second cp.async
//    group that lands during M's product: version 4.3): M = (C Bᵀ) masked to j <= i < l and
//    scaled by exp(cs_i - cs_j) dt_j (bf16 in shared memory), then the entering state S_in:
//    the slot itself for a walk's first chunk, else the slot (the walk's partial sum) plus
//    exp(chunk_log_decay[c - 1]) times the walk's entering state (loaded into registers,
//    added by each thread to the pieces its own copies brought), then Y = M x + exp(cs_i)
//    C S_inᵀ + D x, each warp 16 rows and half of the P columns (the M product over the
//    16-step blocks at or left of the diagonal only).
// Shared rows are padded by 8 halves so that the 8 rows of an ldmatrix or fragment load fall
// in distinct banks. Dynamic shared memory, bytes (the host computes both:
// src/sequence_mixers/cuda.rs): A1 L 4 + max(L (P + 8) + L (N + 8), P (N + 8)) 2; B 2 L 4 +
// (2 L (N + 8) + L (P + 8) + P (N + 8) + L (L + 8)) 2.
#define SSD_TC_MAX_TILES 8
#define SSD_TC_STATE_TILES 16
#define SSD_PASS_THREADS 128
// 16-byte pieces of the entering state per thread in the chunk scan: P·N / 8 / 256 at most.
#define SSD_TC_CARRY 8

extern "C" __global__ void __launch_bounds__(SSD_THREADS)
ssd_chunk_states_tc(const u16* __restrict__ x, const float* __restrict__ dt,
                    const float* __restrict__ A, const u16* __restrict__ Bm,
                    u16* __restrict__ states, float* __restrict__ chunk_log_decay, int T_len,
                    int heads, int groups, int P, int N, int walk) {
    extern __shared__ float smem[];
    const int h = blockIdx.y, b = blockIdx.z;
    const int n_chunks = (T_len + SSD_CHUNK - 1) / SSD_CHUNK;
    const int first = blockIdx.x * walk, end = min(n_chunks, first + walk);
    const int g = h / (heads / groups);
    const long long bh = (long long)b * heads + h;
    const int PS = P + 8, NS = N + 8;
    float* d = smem;                                  // [L]: dt
    u16* xs = reinterpret_cast<u16*>(d + SSD_CHUNK);  // [L][PS]: x
    u16* bs = xs + SSD_CHUNK * PS;                    // [L][NS]: B
    u16* out = xs;                                    // [P][NS]: the running sum, staged
    const int pp = P / 8, pn = N / 8;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gi = lane / 4, ti = lane % 4;
    // Warp w: rows r0 .. r0 + 15 of P and `tiles` 8-column tiles of N from n0.
    const int row_tiles = P / 16, per_row = SSD_THREADS / 32 / row_tiles;
    const int r0 = (warp % row_tiles) * 16, part = warp / row_tiles;
    const int all_tiles = N / 8, share = (all_tiles + per_row - 1) / per_row;
    const int n0 = part * share * 8, tiles = max(0, min(share, all_tiles - part * share));
    // The running sum of the walk's chunk states, decayed chunk by chunk (float32), and the
    // walk's log decay so far.
    float acc[SSD_TC_STATE_TILES][4] = {};
    float walk_decay = 0.f;
    for (int c = first; c < end; ++c) {
        const long long t0 = (long long)b * T_len + (long long)c * SSD_CHUNK;
        const int l = min(SSD_CHUNK, T_len - c * SSD_CHUNK);
        // The previous chunk's staged sum is stored before its rows are overwritten.
        if (c > first) __syncthreads();
        {
            // One division per thread: thread t copies 16-byte piece t % pp of rows t / pp,
            // t / pp + 256 / pp, ... (the threads past the last whole row of pieces idle).
            const int step = SSD_THREADS / pp, r = threadIdx.x / pp, q = (threadIdx.x % pp) * 8;
            if (r < step)
                for (int i = r; i < SSD_CHUNK; i += step) {
                    const bool ok = i < l;
                    cp_async16(xs + i * PS + q, x + ((t0 + (ok ? i : 0)) * heads + h) * P + q, ok);
                }
        }
        {
            const int step = SSD_THREADS / pn, r = threadIdx.x / pn, q = (threadIdx.x % pn) * 8;
            if (r < step)
                for (int i = r; i < SSD_CHUNK; i += step) {
                    const bool ok = i < l;
                    cp_async16(bs + i * NS + q, Bm + ((t0 + (ok ? i : 0)) * groups + g) * N + q, ok);
                }
        }
        for (int i = threadIdx.x; i < SSD_CHUNK; i += SSD_THREADS)
            cp_async4(d + i, dt + (t0 + (i < l ? i : 0)) * heads + h, i < l);
        cp_async_commit();
        // The next chunk's x rows asked into L2 meanwhile (P · 2 bytes a row, 128-byte lines:
        // thread t the line t % lines of row t / lines), so its copies above wait on L2 only.
        if (c + 1 < end) {
            const int lines = (P * 2 + 127) / 128, i = threadIdx.x / lines;
            if (i < SSD_CHUNK && t0 + SSD_CHUNK + i < (long long)(b + 1) * T_len)
                prefetch_l2(x + ((t0 + SSD_CHUNK + i) * heads + h) * P + (threadIdx.x % lines) * 64);
        }
        cp_async_wait<0>();
        __syncthreads();
        // Every warp scans the chunk's log decays itself (no barrier): lane m holds steps 2m
        // and 2m + 1 and their weights exp(cs_last - cs_j) dt_j (dt zero past a short chunk,
        // so their weights are 0 and the last cumulative decay is the chunk's total).
        float w0, w1;
        {
            const float a_h = A[h], d0 = d[2 * lane], d1 = d[2 * lane + 1];
            float s0, s1;
            const float last = warp_pair_scan(d0 * a_h, d1 * a_h, s0, s1);
            w0 = __expf(last - s0) * d0;
            w1 = __expf(last - s1) * d1;
            walk_decay += last;
            if (threadIdx.x == 0) chunk_log_decay[bh * n_chunks + c] = walk_decay;
            // The sum so far decays over this chunk before its own state is added.
            if (c > first) {
                const float keep = __expf(last);
#pragma unroll
                for (int nt = 0; nt < SSD_TC_STATE_TILES; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc[nt][e] *= keep;
            }
        }
        if (tiles > 0) {
#pragma unroll
            for (int ks = 0; ks < SSD_CHUNK / 16; ++ks) {
                // A = (decayed Δ x)ᵀ: rows p, steps k; x's rows are steps, so ldmatrix.trans:
                // registers 0 and 1 hold steps 16 ks + 2 ti and + 1, registers 2 and 3 the same
                // plus 8, each scaled here by its steps' weights (lanes 8 ks + ti and + 4 hold
                // them) and rounded to bf16 once, as x's value times its weight.
                u32 af[4];
                const int mi = lane / 8;
                ldsm_x4_t(af, xs + (ks * 16 + lane % 8 + (mi >= 2 ? 8 : 0)) * PS + r0 + (mi & 1) * 8);
                const float wa0 = __shfl_sync(FULL_MASK, w0, ks * 8 + ti);
                const float wa1 = __shfl_sync(FULL_MASK, w1, ks * 8 + ti);
                const float wb0 = __shfl_sync(FULL_MASK, w0, ks * 8 + 4 + ti);
                const float wb1 = __shfl_sync(FULL_MASK, w1, ks * 8 + 4 + ti);
                af[0] = scale_pair(af[0], wa0, wa1);
                af[1] = scale_pair(af[1], wa0, wa1);
                af[2] = scale_pair(af[2], wb0, wb1);
                af[3] = scale_pair(af[3], wb0, wb1);
                mma_k_block<SSD_TC_STATE_TILES>(acc, af, bs, NS, ks, n0, tiles);
            }
        }
        __syncthreads();
#pragma unroll
        for (int nt = 0; nt < SSD_TC_STATE_TILES; ++nt) {
            if (nt < tiles) {
                const int n = n0 + nt * 8 + 2 * ti;
                *reinterpret_cast<u32*>(out + (r0 + gi) * NS + n) = pack_bf16(acc[nt][0], acc[nt][1]);
                *reinterpret_cast<u32*>(out + (r0 + gi + 8) * NS + n) = pack_bf16(acc[nt][2], acc[nt][3]);
            }
        }
        __syncthreads();
        // The sum after chunk c is what enters chunk c + 1 from within the walk; after the
        // walk's last chunk it is the walk's own state, in its first chunk's slot.
        u16* dst = states + (bh * n_chunks + (c + 1 < end ? c + 1 : first)) * P * N;
        {
            const int step = SSD_THREADS / pn, r = threadIdx.x / pn, q = (threadIdx.x % pn) * 8;
            if (r < step)
                for (int i = r; i < P; i += step)
                    *reinterpret_cast<uint4*>(dst + i * N + q) = *reinterpret_cast<const uint4*>(out + i * NS + q);
        }
    }
}

// The states entering the walks from the walks' own (A2 above): blocks (slice of P·N / 8
// groups of 8 elements, head, batch entry), SSD_PASS_THREADS threads; P·N a multiple of 8. The
// arguments are ssd_state_passing's, with bf16 states, plus `walk`: the walk over chunks
// `walk` k to `walk` (k + 1) - 1 has its own state in chunk `walk` k's slot, and there the
// state entering that chunk replaces it; its log decay is its last chunk's entry of
// `chunk_log_decay` (kernel A1 writes each chunk's sum from its walk's start).
extern "C" __global__ void __launch_bounds__(SSD_PASS_THREADS)
ssd_state_passing_bf16(u16* __restrict__ states, const float* __restrict__ chunk_log_decay,
                       const float* __restrict__ initial_state, int has_initial,
                       float* __restrict__ final_state, int heads, int n_chunks, int P, int N,
                       int walk) {
    const int PN = P * N;
    const int h = blockIdx.y, b = blockIdx.z;
    const long long bh = (long long)b * heads + h;
    const int e = (blockIdx.x * SSD_PASS_THREADS + threadIdx.x) * 8;
    if (e >= PN) return;
    const int n_walks = (n_chunks + walk - 1) / walk;
    const long long stride = (long long)walk * PN;
    u16* s = states + bh * n_chunks * PN + e;
    const float* decay = chunk_log_decay + bh * n_chunks;
    float run[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) run[k] = has_initial ? initial_state[bh * PN + e + k] : 0.f;
    uint4 cur[SSD_PASS_AHEAD] = {};
#pragma unroll
    for (int k = 0; k < SSD_PASS_AHEAD; ++k)
        if (k < n_walks) cur[k] = *reinterpret_cast<const uint4*>(s + k * stride);
    for (int c0 = 0; c0 < n_walks; c0 += SSD_PASS_AHEAD) {
        uint4 next[SSD_PASS_AHEAD] = {};
#pragma unroll
        for (int k = 0; k < SSD_PASS_AHEAD; ++k) {
            const int c = c0 + SSD_PASS_AHEAD + k;
            if (c < n_walks) next[k] = *reinterpret_cast<const uint4*>(s + c * stride);
        }
#pragma unroll
        for (int k = 0; k < SSD_PASS_AHEAD; ++k) {
            const int c = c0 + k;
            if (c < n_walks) {
                const float keep = __expf(decay[min(n_chunks, (c + 1) * walk) - 1]);
                uint4 o;
                o.x = pack_bf16(run[0], run[1]);
                o.y = pack_bf16(run[2], run[3]);
                o.z = pack_bf16(run[4], run[5]);
                o.w = pack_bf16(run[6], run[7]);
                *reinterpret_cast<uint4*>(s + c * stride) = o;
                const u32 v[4] = {cur[k].x, cur[k].y, cur[k].z, cur[k].w};
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    run[2 * q] = keep * run[2 * q] + __uint_as_float(v[q] << 16);
                    run[2 * q + 1] = keep * run[2 * q + 1] + __uint_as_float(v[q] & 0xffff0000u);
                }
            }
        }
#pragma unroll
        for (int k = 0; k < SSD_PASS_AHEAD; ++k) cur[k] = next[k];
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) final_state[bh * PN + e + k] = run[k];
}

template <typename TY, int PT = 0, int NT = 0>
__device__ void chunk_scan_tc(const u16* __restrict__ x, const float* __restrict__ dt,
                              const float* __restrict__ A, const u16* __restrict__ Bm,
                              const u16* __restrict__ Cm, const float* __restrict__ D, int has_d,
                              const u16* __restrict__ states,
                              const float* __restrict__ chunk_log_decay, TY* __restrict__ y,
                              int T_len, int heads, int groups, int P_arg, int N_arg, int walk) {
    extern __shared__ float smem[];
    const int P = PT > 0 ? PT : P_arg, N = NT > 0 ? NT : N_arg;
    const int c = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int n_chunks = gridDim.x;
    const int g = h / (heads / groups);
    const long long t0 = (long long)b * T_len + (long long)c * SSD_CHUNK;
    const int l = min(SSD_CHUNK, T_len - c * SSD_CHUNK);
    const int NS = N + 8, PS = P + 8, LS = SSD_CHUNK + 8;
    float* dts = smem;                                         // [L]: dt
    float* cum = dts + SSD_CHUNK;                              // [L]: cs
    u16* cm = reinterpret_cast<u16*>(cum + SSD_CHUNK);         // [L][NS]: C
    u16* bm = cm + SSD_CHUNK * NS;                             // [L][NS]: B
    u16* xs = bm + SSD_CHUNK * NS;                             // [L][PS]: x
    u16* s_in = xs + SSD_CHUNK * PS;                           // [P][NS]: entering state
    u16* m = s_in + P * NS;                                    // [L][LS]: M
    const int pn = N / 8, pp = P / 8;
    for (int e = threadIdx.x; e < SSD_CHUNK * pn; e += SSD_THREADS) {
        const int i = e / pn, q = (e % pn) * 8;
        const bool ok = i < l;
        const long long at = ((t0 + (ok ? i : 0)) * groups + g) * N + q;
        cp_async16(cm + i * NS + q, Cm + at, ok);
        cp_async16(bm + i * NS + q, Bm + at, ok);
    }
    for (int i = threadIdx.x; i < SSD_CHUNK; i += SSD_THREADS)
        cp_async4(dts + i, dt + (t0 + (i < l ? i : 0)) * heads + h, i < l);
    cp_async_commit();
    // x and the entering state in a second group, still in flight during M's product.
    for (int e = threadIdx.x; e < SSD_CHUNK * pp; e += SSD_THREADS) {
        const int i = e / pp, q = (e % pp) * 8;
        const bool ok = i < l;
        cp_async16(xs + i * PS + q, x + ((t0 + (ok ? i : 0)) * heads + h) * P + q, ok);
    }
    // The chunk's slot: the state entering it when it starts a walk, else the sum of the walk's
    // states before it, to which the state entering the walk is added below, decayed over the
    // walk's chunks before this one (loaded into registers after M's product: version 5.3).
    const long long bh = (long long)b * heads + h;
    const u16* src = states + (bh * n_chunks + c) * P * N;
    for (int e = threadIdx.x; e < P * pn; e += SSD_THREADS) {
        const int r = e / pn, q = (e % pn) * 8;
        cp_async16(s_in + r * NS + q, src + r * N + q, true);
    }
    cp_async_commit();
    const int start = c - c % walk;
    cp_async_wait<1>();
    __syncthreads();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gi = lane / 4, ti = lane % 4;
    if (warp == 0) {
        const float a_h = A[h];
        float s0, s1;
        warp_pair_scan(dts[2 * lane] * a_h, dts[2 * lane + 1] * a_h, s0, s1);
        cum[2 * lane] = s0;
        cum[2 * lane + 1] = s1;
    }
    __syncthreads();
    const int r0 = (warp % 4) * 16;
    {
        const int c0 = (warp / 4) * 32;
        float acc[4][4] = {};
        // Blocks right of the diagonal are masked whole.
        if (c0 <= r0 + 15) mma_rows<4>(acc, cm, NS, r0, bm, NS, c0, N / 16);
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
            for (int e = 0; e < 4; e += 2) {
                const int i = r0 + gi + (e >= 2 ? 8 : 0), j = c0 + nt * 8 + 2 * ti;
                const float v0 = (j <= i && i < l) ? acc[nt][e] * __expf(cum[i] - cum[j]) * dts[j] : 0.f;
                const float v1 = (j + 1 <= i && i < l) ? acc[nt][e + 1] * __expf(cum[i] - cum[j + 1]) * dts[j + 1] : 0.f;
                *reinterpret_cast<u32*>(m + i * LS + j) = pack_bf16(v0, v1);
            }
    }
    // Each thread adds the carry to the pieces of the entering state its own copies brought
    // (the same e = thread + 256 k), so one barrier after it serves both.
    uint4 carry[SSD_TC_CARRY] = {};
    float carry_log = 0.f;
    if (c != start) {
        // The walk's log decay from its start to this chunk's (kernel A1's running sums).
        carry_log = chunk_log_decay[bh * n_chunks + c - 1];
        const u16* from = states + (bh * n_chunks + start) * P * N;
#pragma unroll
        for (int k = 0; k < SSD_TC_CARRY; ++k) {
            const int e = threadIdx.x + k * SSD_THREADS;
            if (e < P * pn) carry[k] = *reinterpret_cast<const uint4*>(from + e * 8);
        }
    }
    cp_async_wait<0>();
    if (c != start) {
        const float carry_decay = __expf(carry_log);
#pragma unroll
        for (int k = 0; k < SSD_TC_CARRY; ++k) {
            const int e = threadIdx.x + k * SSD_THREADS;
            if (e < P * pn) {
                uint4* at = reinterpret_cast<uint4*>(s_in + (e / pn) * NS + (e % pn) * 8);
                const uint4 pv = *at;
                const u32 p[4] = {pv.x, pv.y, pv.z, pv.w};
                const u32 v[4] = {carry[k].x, carry[k].y, carry[k].z, carry[k].w};
                u32 o[4];
#pragma unroll
                for (int q = 0; q < 4; ++q)
                    o[q] = pack_bf16(
                        __uint_as_float(p[q] << 16) + carry_decay * __uint_as_float(v[q] << 16),
                        __uint_as_float(p[q] & 0xffff0000u) + carry_decay * __uint_as_float(v[q] & 0xffff0000u));
                const uint4 ov = {o[0], o[1], o[2], o[3]};
                *at = ov;
            }
        }
    }
    __syncthreads();
    const int tiles = P / 16, p0 = (warp / 4) * (P / 2);
    float diag[SSD_TC_MAX_TILES][4] = {}, off[SSD_TC_MAX_TILES][4] = {};
    // M's blocks right of the diagonal are zero: the product stops at the rows' own block.
    for (int ks = 0; ks <= r0 / 16; ++ks) {
        u32 f[4];
        ld_a(f, m, LS, r0, ks * 16);
        mma_k_block<SSD_TC_MAX_TILES>(diag, f, xs, PS, ks, p0, tiles);
    }
    mma_rows<SSD_TC_MAX_TILES>(off, cm, NS, r0, s_in, NS, p0, N / 16, tiles);
    const float skip = has_d ? D[h] : 0.f;
    // The decays of the lane's two rows, once rather than per tile.
    const float decays[2] = {__expf(cum[r0 + gi]), __expf(cum[r0 + gi + 8])};
#pragma unroll
    for (int nt = 0; nt < SSD_TC_MAX_TILES; ++nt) {
        if (nt >= tiles) continue;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int i = r0 + gi + 8 * half, p = p0 + nt * 8 + 2 * ti;
            if (i < l) {
                const float decay = decays[half];
                const u32 xv = ld2(xs, i, PS, p);
                const float y0 = diag[nt][2 * half] + decay * off[nt][2 * half] + skip * __uint_as_float(xv << 16);
                const float y1 = diag[nt][2 * half + 1] + decay * off[nt][2 * half + 1] + skip * __uint_as_float(xv & 0xffff0000u);
                st2(y, ((t0 + i) * heads + h) * P + p, y0, y1);
            }
        }
    }
}

// Kernel B's entry points (bf16 inputs; y as bf16 or float32), compiled for any P and N the
// tensor-core path takes (PT = NT = 0: the sizes read from the arguments) and again with the
// grid's sizes as constants (P = N = 64 and P = N = 128, suffixes _p64n64 and _p128n128: the
// index arithmetic folds, the loops unroll); the host picks by shape
// (src/sequence_mixers/cuda.rs, `tc_suffix`) and passes P and N to both. (Kernel A1 compiled
// the same way spilled at P = N = 128: it stays generic.)
#define SSD_SCAN_TC(SUFFIX, PT, NT)                                                            \
    extern "C" __global__ void __launch_bounds__(SSD_THREADS)                                  \
    ssd_chunk_scan_tc##SUFFIX(const u16* x, const float* dt, const float* A, const u16* Bm,   \
                              const u16* Cm, const float* D, int has_d, const u16* states,     \
                              const float* chunk_log_decay, u16* y, int T_len, int heads,      \
                              int groups, int P, int N, int walk) {                            \
        chunk_scan_tc<u16, PT, NT>(x, dt, A, Bm, Cm, D, has_d, states, chunk_log_decay, y,     \
                                   T_len, heads, groups, P, N, walk);                          \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(SSD_THREADS)                                  \
    ssd_chunk_scan_tc_f32out##SUFFIX(const u16* x, const float* dt, const float* A,           \
                                     const u16* Bm, const u16* Cm, const float* D, int has_d,  \
                                     const u16* states, const float* chunk_log_decay,          \
                                     float* y, int T_len, int heads, int groups, int P, int N, \
                                     int walk) {                                               \
        chunk_scan_tc<float, PT, NT>(x, dt, A, Bm, Cm, D, has_d, states, chunk_log_decay, y,   \
                                     T_len, heads, groups, P, N, walk);                        \
    }
SSD_SCAN_TC(, 0, 0)
SSD_SCAN_TC(_p64n64, 64, 64)
SSD_SCAN_TC(_p128n128, 128, 128)
