// Mamba-1's selective scan (Gu and Dao, 2023, "Mamba: Linear-Time Sequence Modeling with
// Selective State Spaces", Algorithm 2, zero-order-hold A and Euler B as its reference code
// does) on CUDA cores in float32, version 2: the sequence cut into chunks walked at once.
// The recurrence of src/sequence_mixers/reference.rs's selective_scan,
//
//   h_t = exp(dt_{t,d} A_d) * h_{t-1} + dt_{t,d} u_{t,d} B_t,  y_{t,d} = <C_t, h_t> + D_d u_{t,d},
//
// is affine in h, so a chunk of L steps maps the state entering it to the state leaving it as
// h -> exp(A_d * sum_t dt_{t,d}) * h + s, with s the chunk's end state from a zero start. Three
// launches (version 1 walked all T steps in one warp per (batch entry, channel)):
//   1. scan_chunk_state_<t>: every (batch entry, chunk, channel) at once walks its chunk from
//      a zero state; writes s ([B, chunks, D, N]) and the chunk's sum of dt ([B, chunks, D]).
//   2. scan_chunk_pass: one thread per (batch entry, channel, state entry) composes the chunk
//      maps in order from the initial state, overwriting each s with the state entering its
//      chunk, and writes the final state.
//   3. scan_chunk_out_<t>: every (batch entry, chunk, channel) walks its chunk again from the
//      state entering it and writes y.
// In 1 and 3 a block of SCAN_THREADS threads takes SCAN_THREADS / G channels of one chunk of
// one batch entry: G threads per channel (1, 2, 4, 8 or 16, from N: G * SCAN_NS >= N), thread
// j of a channel's group holding the state entries n = j + G k, k < SCAN_NS, in registers. The
// block stages the inputs of `ts` steps at a time in shared memory (u and dt as float32, one
// row per step with the block's channels contiguous, so the loads coalesce; B_t and C_t rows
// padded with zeros to G * SCAN_NS entries), then each thread walks them. The G threads of a
// channel add their parts of <C_t, h_t> with shuffles (a group is G adjacent lanes), and the
// first writes y_t. Dynamic shared memory: ts * (2 * channels per block + 2 * G * SCAN_NS)
// floats. Grid (ceil(D / (SCAN_THREADS / G)), chunks, B); L is a multiple of ts.
//
// Layouts (row-major, as src/sequence_mixers/reference.rs): u, delta, y [B, T, D]; A [D, N];
// Bm, Cm [B, T, N]; D [D]; initial and final state [B, D, N]. delta, A, D and the states are
// float32 (delta after the softplus); has_d and has_initial say whether D and the initial state
// are given (when 0 the pointer is any valid buffer and is not read: D = 0, zeros).
// <t> is f32 (float u, Bm, Cm and y) or bf16 (u, Bm, Cm and y as bf16 bits). T >= 1 (the host
// handles T = 0). Offsets are 64-bit. No headers (NVRTC).

#define SCAN_THREADS 128
#define SCAN_NS 16

// u16, ld and st: prelude.cuh, prepended by the host.

// Version 2.1: G a compile-time constant (the B and C entries of a thread at a fixed stride, the
// shuffles unrolled; at G = 1 the 16 entries read as four 16-byte loads), the staging loads
// issued SCAN_BATCH at a time before their stores, and the pass's loads likewise.
#define SCAN_BATCH 8

// Four consecutive floats from shared memory (16-byte aligned): one 16-byte load on the GPU.
__device__ __forceinline__ void lds4(const float* p, float* v) {
#ifdef KP_EMULATE
    v[0] = p[0], v[1] = p[1], v[2] = p[2], v[3] = p[3];
#else
    const float4 q = *reinterpret_cast<const float4*>(p);
    v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
#endif
}

// Stages `steps` (<= ts) steps from bt0 (= b * T_len + t0) for a block's channels d0 ...:
// x and delta ([B, T, D]) into sx and sdt ([ts][per_block], float32), the rows r1 and, when
// TWO, r2 ([B, T, N]) into s1 and s2 ([ts][G * SCAN_NS], zero-padded); entries past the steps
// or the channels are 0. The loads go SCAN_BATCH at a time before their stores.
template <typename T, int G, bool TWO>
__device__ __forceinline__ void scan_stage(const T* __restrict__ x,
                                           const float* __restrict__ delta,
                                           const T* __restrict__ r1, const T* __restrict__ r2,
                                           float* sx, float* sdt, float* s1, float* s2,
                                           long long bt0, int steps, int ts, int d0,
                                           int channels, int N) {
    constexpr int per_block = SCAN_THREADS / G;
    constexpr int np = G * SCAN_NS;
    for (int i0 = threadIdx.x; i0 < ts * per_block; i0 += SCAN_BATCH * SCAN_THREADS) {
        float vx[SCAN_BATCH], vd[SCAN_BATCH];
#pragma unroll
        for (int q = 0; q < SCAN_BATCH; ++q) {
            const int i = i0 + q * SCAN_THREADS;
            const int st_ = i / per_block, dd = d0 + i % per_block;
            const bool on = i < ts * per_block && st_ < steps && dd < channels;
            const long long at = (bt0 + st_) * channels + dd;
            vx[q] = on ? ld(x, at) : 0.f;
            vd[q] = on ? delta[at] : 0.f;
        }
#pragma unroll
        for (int q = 0; q < SCAN_BATCH; ++q) {
            const int i = i0 + q * SCAN_THREADS;
            if (i < ts * per_block) sx[i] = vx[q], sdt[i] = vd[q];
        }
    }
    for (int i0 = threadIdx.x; i0 < ts * np; i0 += SCAN_BATCH * SCAN_THREADS) {
        float v1[SCAN_BATCH], v2[SCAN_BATCH];
#pragma unroll
        for (int q = 0; q < SCAN_BATCH; ++q) {
            const int i = i0 + q * SCAN_THREADS;
            const int st_ = i / np, n = i % np;
            const bool on = i < ts * np && st_ < steps && n < N;
            const long long at = (bt0 + st_) * N + n;
            v1[q] = on ? ld(r1, at) : 0.f;
            v2[q] = (TWO && on) ? ld(r2, at) : 0.f;
        }
#pragma unroll
        for (int q = 0; q < SCAN_BATCH; ++q) {
            const int i = i0 + q * SCAN_THREADS;
            if (i < ts * np) {
                s1[i] = v1[q];
                if (TWO) s2[i] = v2[q];
            }
        }
    }
}

// Where a thread of a chunk walk (grid (channel blocks, chunks, B), G threads per channel)
// stands: its entry group j, channel d (live when below `channels`), the block's first channel
// d0, chunk c of `chunks`, batch entry b, the chunk's steps [t_begin, t_end), and cd, its
// (batch entry, chunk, channel) row of the [B, chunks, D, ...] scratch.
struct ChunkThread {
    int j, dl, d0, d, c, b, chunks, t_begin, t_end;
    bool live;
    long long cd;
};

template <int G>
__device__ __forceinline__ ChunkThread chunk_thread(int T_len, int channels, int L) {
    ChunkThread t;
    t.j = threadIdx.x % G;
    t.dl = threadIdx.x / G;
    t.d0 = blockIdx.x * (SCAN_THREADS / G);
    t.d = t.d0 + t.dl;
    t.c = blockIdx.y;
    t.b = blockIdx.z;
    t.chunks = gridDim.y;
    t.live = t.d < channels;
    t.t_begin = t.c * L;
    t.t_end = min(T_len, t.t_begin + L);
    t.cd = ((long long)t.b * t.chunks + t.c) * channels + t.d;
    return t;
}

// Steps 1 and 3: OUT false walks from zero and writes the chunk's end state and sum of dt;
// OUT true walks from the state entering the chunk (`chunk_state`, after step 2) and writes y.
// ts (the staged steps) is at most the host's staged_steps(G), which sized the shared memory.
template <typename T, bool OUT, int G>
__device__ void scan_chunk(const T* __restrict__ u, const float* __restrict__ delta,
                           const float* __restrict__ A, const T* __restrict__ Bm,
                           const T* __restrict__ Cm, const float* __restrict__ D, int has_d,
                           float* __restrict__ chunk_state, float* __restrict__ chunk_dt,
                           T* __restrict__ y, int T_len, int channels, int N, int L, int ts) {
    extern __shared__ __align__(16) float smem[];
    constexpr int per_block = SCAN_THREADS / G;  // channels per block
    constexpr int np = G * SCAN_NS;              // padded state row
    float* su = smem;                            // [ts][per_block]
    float* sdt = su + ts * per_block;            // [ts][per_block]
    float* sb = sdt + ts * per_block;            // [ts][np]
    float* sc = sb + ts * np;                    // [ts][np]
    const ChunkThread ct = chunk_thread<G>(T_len, channels, L);
    const int j = ct.j, dl = ct.dl, d0 = ct.d0, d = ct.d, b = ct.b;
    const bool live = ct.live;
    const int t_begin = ct.t_begin, t_end = ct.t_end;
    const long long cd = ct.cd;  // rows of the chunk states and sums of dt
    float a[SCAN_NS], h[SCAN_NS];
#pragma unroll
    for (int k = 0; k < SCAN_NS; ++k) {
        const int n = j + G * k;
        const bool on = live && n < N;
        a[k] = on ? A[(long long)d * N + n] : 0.f;
        h[k] = (OUT && on) ? chunk_state[cd * N + n] : 0.f;
    }
    const float skip = (OUT && live && has_d) ? D[d] : 0.f;
    float dt_sum = 0.f;
    for (int t0 = t_begin; t0 < t_end; t0 += ts) {
        const int steps = min(ts, t_end - t0);
        const long long bt0 = (long long)b * T_len + t0;
        scan_stage<T, G, OUT>(u, delta, Bm, Cm, su, sdt, sb, sc, bt0, steps, ts, d0, channels, N);
        __syncthreads();
        for (int s = 0; s < steps; ++s) {
            const float dt = sdt[s * per_block + dl];
            const float uu = su[s * per_block + dl];
            const float x = dt * uu;
            float bv[SCAN_NS], cv[SCAN_NS];
            if (G == 1) {
#pragma unroll
                for (int k = 0; k < SCAN_NS; k += 4) {
                    lds4(sb + s * np + k, bv + k);
                    if (OUT) lds4(sc + s * np + k, cv + k);
                }
            } else {
#pragma unroll
                for (int k = 0; k < SCAN_NS; ++k) {
                    bv[k] = sb[s * np + j + G * k];
                    cv[k] = OUT ? sc[s * np + j + G * k] : 0.f;
                }
            }
            float part = 0.f;
#pragma unroll
            for (int k = 0; k < SCAN_NS; ++k) {
                h[k] = __expf(dt * a[k]) * h[k] + x * bv[k];
                if (OUT) part += cv[k] * h[k];
            }
            if (OUT) {
#pragma unroll
                for (int off = G >> 1; off > 0; off >>= 1)
                    part += __shfl_xor_sync(0xffffffffu, part, off);
                if (live && j == 0)
                    st(y, (bt0 + s) * channels + d, part + skip * uu);
            } else {
                dt_sum += dt;
            }
        }
        __syncthreads();
    }
    if (!OUT && live) {
#pragma unroll
        for (int k = 0; k < SCAN_NS; ++k) {
            const int n = j + G * k;
            if (n < N) chunk_state[cd * N + n] = h[k];
        }
        if (j == 0) chunk_dt[cd] = dt_sum;
    }
}

// Step 2: thread i of B * D * N composes its (batch entry, channel d, entry n)'s chunk maps
// h -> exp(A_dn * chunk_dt) h + s in order from `start` (zeros unless has_start); each s is
// replaced by the value entering its chunk, and the value past the last goes to `last`.
// REV (the backward's adjoints, below) takes the chunks from the last to the first. The loads
// of SCAN_PASS_BATCH chunks are issued before their stores (the stores write the same array,
// so the compiler would not move a later load above them); version 2.2 raised it from 8 to 32,
// as only B * D * N threads (32 k at the grid's shape) walk the chunks, each latency-bound.
#define SCAN_PASS_BATCH 32
template <bool REV>
__device__ void scan_pass(const float* __restrict__ A, const float* __restrict__ start,
                          int has_start, float* __restrict__ chunk_state,
                          const float* __restrict__ chunk_dt, float* __restrict__ last,
                          int batch, int channels, int N, int chunks) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long per_batch = (long long)channels * N;
    if (i >= batch * per_batch) return;
    const long long b = i / per_batch, dn = i % per_batch;
    const long long d = dn / N, n = dn % N;
    const float a = A[dn];
    float h = has_start ? start[i] : 0.f;
    // The k-th chunk in the walk's order.
    auto chunk = [&](int k) { return REV ? chunks - 1 - k : k; };
    for (int k0 = 0; k0 < chunks; k0 += SCAN_PASS_BATCH) {
        float sv[SCAN_PASS_BATCH], dv[SCAN_PASS_BATCH];
#pragma unroll
        for (int q = 0; q < SCAN_PASS_BATCH; ++q) {
            const long long row = (b * chunks + chunk(min(k0 + q, chunks - 1))) * channels + d;
            sv[q] = chunk_state[row * N + n];
            dv[q] = chunk_dt[row];
        }
#pragma unroll
        for (int q = 0; q < SCAN_PASS_BATCH; ++q) {
            if (k0 + q < chunks) {
                const long long row = (b * chunks + chunk(k0 + q)) * channels + d;
                chunk_state[row * N + n] = h;
                h = __expf(a * dv[q]) * h + sv[q];
            }
        }
    }
    last[i] = h;
}

#define SCAN_ENTRY(NAME, T, G)                                                                 \
    extern "C" __global__ void __launch_bounds__(SCAN_THREADS)                                 \
    scan_chunk_state_##NAME##_g##G(const T* u, const float* delta, const float* A,            \
                                   const T* Bm, float* chunk_state, float* chunk_dt,           \
                                   int T_len, int channels, int N, int L, int ts) {           \
        scan_chunk<T, false, G>(u, delta, A, Bm, Bm, A, 0, chunk_state, chunk_dt, (T*)0,      \
                                T_len, channels, N, L, ts);                                    \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(SCAN_THREADS)                                 \
    scan_chunk_out_##NAME##_g##G(const T* u, const float* delta, const float* A, const T* Bm, \
                                 const T* Cm, const float* D, int has_d, float* chunk_state,  \
                                 T* y, int T_len, int channels, int N, int L, int ts) {       \
        scan_chunk<T, true, G>(u, delta, A, Bm, Cm, D, has_d, chunk_state, (float*)0, y,      \
                               T_len, channels, N, L, ts);                                     \
    }

SCAN_ENTRY(f32, float, 1)
SCAN_ENTRY(f32, float, 2)
SCAN_ENTRY(f32, float, 4)
SCAN_ENTRY(f32, float, 8)
SCAN_ENTRY(f32, float, 16)
SCAN_ENTRY(bf16, u16, 1)
SCAN_ENTRY(bf16, u16, 2)
SCAN_ENTRY(bf16, u16, 4)
SCAN_ENTRY(bf16, u16, 8)
SCAN_ENTRY(bf16, u16, 16)

extern "C" __global__ void scan_chunk_pass(const float* A, const float* initial_state,
                                           int has_initial, float* chunk_state,
                                           const float* chunk_dt, float* final_state, int batch,
                                           int channels, int N, int chunks) {
    scan_pass<false>(A, initial_state, has_initial, chunk_state, chunk_dt, final_state, batch,
                     channels, N, chunks);
}

// ---------------------------------------------------------------------------------------------
// The selective scan's backward, version 2: the vector-Jacobian product of the forward above,
// the adjoint of the recurrence walked from the last step back to the first as in
// src/sequence_mixers/gradients.rs's selective_scan_backward (and Mamba's own backward pass),
// with g_t = dL/dh_t:
//
//   g_t = C_t dy_t + exp(dt_{t+1} A) g_{t+1}           (g_T also takes d_final_state)
//   du_t = <g_t, dt_t B_t> + D dy_t                    ddt_t = <g_t, A e_t h_{t-1} + u_t B_t>
//   dB_t += g_t dt_t u_t  (summed over channels)      dC_t += dy_t h_t  (summed over channels)
//   dA += g_t dt_t e_t h_{t-1}                         dD += dy_t u_t,   dh_0 = e_1 g_1
//
// where e_t = exp(dt_t A). The adjoint is affine in g as the forward is in h, so the chunks of
// L steps are walked at once here too (version 1.1 walked every chunk in turn in one warp per
// channel). Six launches:
//   1, 2. the forward's scan_chunk_state and scan_chunk_pass with chunks of L steps: the state
//      entering every chunk ([B, chunks, D, N], the checkpoints) and each chunk's sum of dt;
//   3. scan_bwd_adjoint_<t>_g<G>: every (batch entry, chunk, channel) walks its chunk
//      backwards from a zero adjoint (g += C_t dy_t, then g *= e_t), leaving the adjoint the
//      chunk itself passes to the state before it ([B, chunks, D, N]);
//   4. scan_bwd_pass: scan_pass<true>, from d_final_state and the last chunk: each chunk's
//      entry replaced by the adjoint that reaches its last state from the later chunks, and
//      the adjoint of the initial state written;
//   5. scan_bwd_<t>_s<S>_l<LN>: one block of SCAN_BWD_WARPS warps per (chunk, batch entry),
//      its warps taking the channels in turn (two at once, one per half-warp, when N <= 16),
//      LN = 32 or 16 lanes splitting the N <= 64 state entries (S = 1 or 2 per lane): the
//      chunk's states h_{t-1} recomputed from the checkpoint into the
//      warp's shared rows ([L][N]), then its steps walked backwards from the adjoint of step
//      4, writing du and ddt. Each warp adds its terms of dB and dC into its own shared rows;
//      the block adds its warps' rows and writes dB and dC for its chunk's steps (it alone
//      covers them: no atomics). The parts of dA and dD of each (batch entry, chunk, channel)
//      go in place of its adjoint and of its chunk's sum of dt;
//   6. scan_bwd_sum, twice: dA and dD as the sums of their parts.
// Every gradient is float32. Dynamic shared memory of step 5: (32 / LN + 2) * SCAN_BWD_WARPS
// * L * N floats. L and the grids as the host's scan_cuda::ScanBackward says; T >= 1.

// Step 3 (the layout and staging of scan_chunk, walked backwards): dy and dt staged as the
// forward stages u and dt, the C rows as its B rows.
template <typename T, int G>
__device__ void scan_chunk_adjoint(const T* __restrict__ dy, const float* __restrict__ delta,
                                   const float* __restrict__ A, const T* __restrict__ Cm,
                                   float* __restrict__ chunk_adjoint, int T_len, int channels,
                                   int N, int L, int ts) {
    extern __shared__ __align__(16) float smem[];
    constexpr int per_block = SCAN_THREADS / G;
    constexpr int np = G * SCAN_NS;
    float* sy = smem;                  // [ts][per_block]
    float* sdt = sy + ts * per_block;  // [ts][per_block]
    float* sc = sdt + ts * per_block;  // [ts][np]
    const ChunkThread ct = chunk_thread<G>(T_len, channels, L);
    const int j = ct.j, dl = ct.dl, d0 = ct.d0, d = ct.d, b = ct.b;
    const bool live = ct.live;
    const int t_begin = ct.t_begin, t_end = ct.t_end;
    const long long cd = ct.cd;
    float a[SCAN_NS], g[SCAN_NS];
#pragma unroll
    for (int k = 0; k < SCAN_NS; ++k) {
        const int n = j + G * k;
        a[k] = (live && n < N) ? A[(long long)d * N + n] : 0.f;
        g[k] = 0.f;
    }
    // The chunk's tiles from the last (which may be partial) to the first.
    for (int t0 = t_begin + (t_end - 1 - t_begin) / ts * ts; t0 >= t_begin; t0 -= ts) {
        const int steps = min(ts, t_end - t0);
        const long long bt0 = (long long)b * T_len + t0;
        scan_stage<T, G, false>(dy, delta, Cm, Cm, sy, sdt, sc, sc, bt0, steps, ts, d0,
                                channels, N);
        __syncthreads();
        for (int s = steps - 1; s >= 0; --s) {
            const float dt = sdt[s * per_block + dl];
            const float yv = sy[s * per_block + dl];
            float cv[SCAN_NS];
            if (G == 1) {
#pragma unroll
                for (int k = 0; k < SCAN_NS; k += 4) lds4(sc + s * np + k, cv + k);
            } else {
#pragma unroll
                for (int k = 0; k < SCAN_NS; ++k) cv[k] = sc[s * np + j + G * k];
            }
#pragma unroll
            for (int k = 0; k < SCAN_NS; ++k) g[k] = (g[k] + cv[k] * yv) * __expf(dt * a[k]);
        }
        __syncthreads();
    }
    if (live) {
#pragma unroll
        for (int k = 0; k < SCAN_NS; ++k) {
            const int n = j + G * k;
            if (n < N) chunk_adjoint[cd * N + n] = g[k];
        }
    }
}

#define SCAN_ADJ_ENTRY(NAME, T, G)                                                             \
    extern "C" __global__ void __launch_bounds__(SCAN_THREADS)                                 \
    scan_bwd_adjoint_##NAME##_g##G(const T* dy, const float* delta, const float* A,           \
                                   const T* Cm, float* chunk_adjoint, int T_len, int channels, \
                                   int N, int L, int ts) {                                     \
        scan_chunk_adjoint<T, G>(dy, delta, A, Cm, chunk_adjoint, T_len, channels, N, L, ts); \
    }

SCAN_ADJ_ENTRY(f32, float, 1)
SCAN_ADJ_ENTRY(f32, float, 2)
SCAN_ADJ_ENTRY(f32, float, 4)
SCAN_ADJ_ENTRY(bf16, u16, 1)
SCAN_ADJ_ENTRY(bf16, u16, 2)
SCAN_ADJ_ENTRY(bf16, u16, 4)

extern "C" __global__ void scan_bwd_pass(const float* A, const float* d_final, int has_d_final,
                                         float* chunk_adjoint, const float* chunk_dt,
                                         float* d_initial, int batch, int channels, int N,
                                         int chunks) {
    scan_pass<true>(A, d_final, has_d_final, chunk_adjoint, chunk_dt, d_initial, batch,
                    channels, N, chunks);
}

#define SCAN_BWD_WARPS 8
#define SCAN_BWD_THREADS (32 * SCAN_BWD_WARPS)
#define SCAN_BWD_G 8  // steps whose inputs are loaded at once (version 1.1)

// LN lanes per channel: 32, or 16 when N <= 16 (S = 1), the warp then taking two channels at
// once (its halves), so that no lane idles at Mamba's N = 16 (version 2.1).
template <typename T, int S, int LN>
__device__ void scan_bwd(const T* __restrict__ u, const float* __restrict__ delta,
                         const float* __restrict__ A, const T* __restrict__ Bm,
                         const T* __restrict__ Cm, const float* __restrict__ D, int has_d,
                         const T* __restrict__ dy, const float* __restrict__ checkpoints,
                         float* __restrict__ chunk_adjoint, float* __restrict__ dd_part,
                         float* __restrict__ du, float* __restrict__ ddelta,
                         float* __restrict__ dBm, float* __restrict__ dCm, int T_len,
                         int channels, int N, int L) {
    constexpr int CPW = 32 / LN;  // channels per warp at once
    extern __shared__ float smem[];
    const int half = (threadIdx.x & 31) / LN;
    const int lane = threadIdx.x % LN;
    const int w = threadIdx.x >> 5;
    const int c = blockIdx.x;
    const int chunks = gridDim.x;
    const int b = blockIdx.y;
    const int t0 = c * L;
    const int len = min(L, T_len - t0);
    // [warps * CPW][L][N]: h_{t-1} per step, one row block per channel in flight.
    float* hs = smem + (long long)(w * CPW + half) * L * N;
    float* park_b = smem + (long long)SCAN_BWD_WARPS * CPW * L * N;  // [warps][L][N]: dB terms
    float* park_c = park_b + (long long)SCAN_BWD_WARPS * L * N;  // [warps][L][N]: dC terms
    for (int e = threadIdx.x; e < 2 * SCAN_BWD_WARPS * L * N; e += SCAN_BWD_THREADS)
        park_b[e] = 0.f;  // park_b and park_c, contiguous
    __syncthreads();
    // The block's warps take the channels SCAN_BWD_WARPS * CPW at a time; each warp adds its
    // terms of dB and dC into its own parked rows (the two halves' terms added first), so the
    // block ends with their sums over all channels.
    for (int dw = w * CPW; dw < channels; dw += SCAN_BWD_WARPS * CPW) {
        const int d = dw + half;
        const bool live = d < channels;  // both halves run every step (shuffles); a dead one
                                         // reads nothing and adds zeros
        // This (batch entry, chunk, channel)'s checkpoint and adjoint rows, [B, chunks, D, N].
        const long long cd = ((long long)b * chunks + c) * channels + d;
        const long long row = cd * N;
        float a[S], h[S], g[S], da[S];
#pragma unroll
        for (int k = 0; k < S; ++k) {
            const int n = lane + LN * k;
            const bool on = live && n < N;
            a[k] = on ? A[(long long)d * N + n] : 0.f;
            h[k] = on ? checkpoints[row + n] : 0.f;
            g[k] = on ? chunk_adjoint[row + n] : 0.f;
            da[k] = 0.f;
        }
        const float skip = (live && has_d) ? D[d] : 0.f;
        float dd_sum = 0.f;
        for (int j0 = 0; j0 < len; j0 += SCAN_BWD_G) {
            float gdt[SCAN_BWD_G], gdtu[SCAN_BWD_G], gb[SCAN_BWD_G][S];
#pragma unroll
            for (int q = 0; q < SCAN_BWD_G; ++q) {
                const long long bt = (long long)b * T_len + t0 + min(j0 + q, len - 1);
                const long long i = bt * channels + d;
                gdt[q] = live ? delta[i] : 0.f;
                gdtu[q] = live ? gdt[q] * ld(u, i) : 0.f;
#pragma unroll
                for (int k = 0; k < S; ++k) {
                    const int n = lane + LN * k;
                    gb[q][k] = n < N ? ld(Bm, bt * N + n) : 0.f;
                }
            }
#pragma unroll
            for (int q = 0; q < SCAN_BWD_G; ++q) {
                const int j = j0 + q;
                if (j < len) {
#pragma unroll
                    for (int k = 0; k < S; ++k) {
                        const int n = lane + LN * k;
                        if (n < N) {
                            hs[j * N + n] = h[k];  // each lane reads back only its own
                            h[k] = __expf(gdt[q] * a[k]) * h[k] + gdtu[q] * gb[q][k];
                        }
                    }
                }
            }
        }
        for (int j1 = len - 1; j1 >= 0; j1 -= SCAN_BWD_G) {
            // Steps j1, j1 - 1, ..., down to j1 - G + 1 (those >= 0), loaded first.
            float gdt[SCAN_BWD_G], gu[SCAN_BWD_G], gdy[SCAN_BWD_G], gb[SCAN_BWD_G][S],
                gc[SCAN_BWD_G][S];
#pragma unroll
            for (int q = 0; q < SCAN_BWD_G; ++q) {
                const long long bt = (long long)b * T_len + t0 + max(j1 - q, 0);
                const long long i = bt * channels + d;
                gdt[q] = live ? delta[i] : 0.f;
                gu[q] = live ? ld(u, i) : 0.f;
                gdy[q] = live ? ld(dy, i) : 0.f;
#pragma unroll
                for (int k = 0; k < S; ++k) {
                    const int n = lane + LN * k;
                    gb[q][k] = n < N ? ld(Bm, bt * N + n) : 0.f;
                    gc[q][k] = n < N ? ld(Cm, bt * N + n) : 0.f;
                }
            }
#pragma unroll
            for (int q = 0; q < SCAN_BWD_G; ++q) {
                const int j = j1 - q;
                if (j < 0) break;
                const long long i = ((long long)b * T_len + t0 + j) * channels + d;
                const float dt = gdt[q];
                const float uu = gu[q];
                const float dyy = gdy[q];
                float s_du = 0.f, s_ddt = 0.f;
#pragma unroll
                for (int k = 0; k < S; ++k) {
                    const int n = lane + LN * k;
                    const bool on = n < N;
                    const float bn = gb[q][k];
                    const float cn = gc[q][k];
                    const float e = __expf(dt * a[k]);
                    const float hp = on ? hs[j * N + n] : 0.f;
                    const float ht = e * hp + dt * uu * bn;
                    g[k] += cn * dyy;
                    float tc = dyy * ht, tb = g[k] * dt * uu;
                    if (CPW == 2) {  // the other half's channel, same step and entry
                        tc += __shfl_xor_sync(0xffffffffu, tc, 16);
                        tb += __shfl_xor_sync(0xffffffffu, tb, 16);
                    }
                    if (on && half == 0) {
                        park_c[((long long)w * L + j) * N + n] += tc;
                        park_b[((long long)w * L + j) * N + n] += tb;
                    }
                    s_du += g[k] * dt * bn;
                    s_ddt += g[k] * (a[k] * e * hp + uu * bn);
                    da[k] += g[k] * dt * e * hp;
                    g[k] *= e;
                }
#pragma unroll
                for (int off = LN / 2; off > 0; off >>= 1) {
                    s_du += __shfl_xor_sync(0xffffffffu, s_du, off);
                    s_ddt += __shfl_xor_sync(0xffffffffu, s_ddt, off);
                }
                if (lane == 0 && live) {
                    du[i] = s_du + skip * dyy;
                    ddelta[i] = s_ddt;
                    dd_sum += dyy * uu;
                }
            }
        }
        // This chunk's parts of dA and dD, in place of the adjoint just read (the same lanes'
        // row) and of the chunk's sum of dt (no longer needed); scan_bwd_sum adds them up.
        if (live) {
#pragma unroll
            for (int k = 0; k < S; ++k) {
                const int n = lane + LN * k;
                if (n < N) chunk_adjoint[row + n] = da[k];
            }
            if (lane == 0) dd_part[cd] = has_d ? dd_sum : 0.f;
        }
    }
    __syncthreads();
    // The block's sums of dB and dC for its chunk's steps: this block alone writes them.
    for (int e = threadIdx.x; e < len * N; e += SCAN_BWD_THREADS) {
        float sb = 0.f, sc = 0.f;
        for (int v = 0; v < SCAN_BWD_WARPS; ++v) {
            sb += park_b[(long long)v * L * N + e];
            sc += park_c[(long long)v * L * N + e];
        }
        const long long at = ((long long)b * T_len + t0) * N + e;  // [B, T, N]
        dBm[at] = sb;
        dCm[at] = sc;
    }
}

// Step 6: out[col] = sum over rows of part[row * cols + col] (dA from the chunks' parts,
// rows = B * chunks, cols = D * N; dD likewise with cols = D), or 0 when `enabled` is 0. A
// block of SCAN_BWD_THREADS takes 32 columns, its warps splitting the rows; dynamic shared
// memory: SCAN_BWD_WARPS * 32 floats.
extern "C" __global__ void __launch_bounds__(SCAN_BWD_THREADS)
scan_bwd_sum(const float* __restrict__ part, int rows, int cols, float* __restrict__ out,
             int enabled) {
    extern __shared__ float smem[];
    float(*sums)[32] = reinterpret_cast<float(*)[32]>(smem);
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int col = blockIdx.x * 32 + lane;
    float acc = 0.f;
    if (col < cols && enabled) {
#pragma unroll 8
        for (int r = w; r < rows; r += SCAN_BWD_WARPS) acc += part[(long long)r * cols + col];
    }
    sums[w][lane] = acc;
    __syncthreads();
    if (w == 0 && col < cols) {
        float total = 0.f;
        for (int v = 0; v < SCAN_BWD_WARPS; ++v) total += sums[v][lane];
        out[col] = total;
    }
}

#define SCAN_BWD_ENTRY(NAME, T, S, LN)                                                         \
    extern "C" __global__ void __launch_bounds__(SCAN_BWD_THREADS)                             \
    scan_bwd_##NAME##_s##S##_l##LN(const T* u, const float* delta, const float* A,            \
                                   const T* Bm, const T* Cm, const float* D, int has_d,        \
                                   const T* dy, const float* checkpoints,                      \
                                   float* chunk_adjoint, float* dd_part, float* du,            \
                                   float* ddelta, float* dBm, float* dCm, int T_len,           \
                                   int channels, int N, int L) {                               \
        scan_bwd<T, S, LN>(u, delta, A, Bm, Cm, D, has_d, dy, checkpoints, chunk_adjoint,     \
                           dd_part, du, ddelta, dBm, dCm, T_len, channels, N, L);              \
    }

SCAN_BWD_ENTRY(f32, float, 1, 16)
SCAN_BWD_ENTRY(f32, float, 1, 32)
SCAN_BWD_ENTRY(f32, float, 2, 32)
SCAN_BWD_ENTRY(bf16, u16, 1, 16)
SCAN_BWD_ENTRY(bf16, u16, 1, 32)
SCAN_BWD_ENTRY(bf16, u16, 2, 32)
