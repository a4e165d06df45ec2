// SSD's backward (version 1.1: float32 on CUDA cores, its products register-tiled from shared
// memory by mm_tile), compiled after ssd.cu in one module
// (src/sequence_mixers/ssd_backward.rs): the vector-Jacobian product of
// S_t = a_t S_{t-1} + dt_t x_t B_t^T, y_t = S_t C_t + D x_t (a_t = exp(dt_t A_h)) for
// L = <dy, y> + <d_final, S_T>, in chunks of SSD_CHUNK steps, checked against the float64
// adjoint of src/sequence_mixers/gradients.rs (ssd_backward) and, on the CPU,
// emulate/ssd_bwd_check.cpp.
//
// Derivation. Within a chunk, with cum_i the inclusive cumulative sum of dt A over the chunk's
// steps (chunk_cumsum) and cum_e its last value, the state and its adjoint
// S^_t = dL/dS_t are
//   S_t  = exp(cum_t) S_in + sum_{s<=t} exp(cum_t - cum_s) dt_s x_s B_s^T,
//   S^_t = exp(cum_e - cum_t) R_c + sum_{s>=t} exp(cum_s - cum_t) dy_s C_s^T,
// S_in the state entering the chunk (the forward's kernels 1 and 2, recomputed) and R_c the
// adjoint entering it from the next chunk, a_{e+1} S^_{e+1} (d_final for the last chunk). R is
// passed backwards like the forward's states: R_{c-1} = exp(cum_e) R_c + Q_c with
// Q_c = sum_s exp(cum_s) dy_s C_s^T, and R_{-1} is the initial state's gradient. Per step:
//   u_t  = S^_t B_t                              dx_t = dt_t u_t + D dy_t
//   dB_t = sum_{h in g} dt_t S^_t^T x_t          dC_t = sum_{h in g} S_t^T dy_t
//   ddt_t = A dl_t + x_t . u_t                   dA = sum_{b,t} dt_t dl_t, dD = sum_{b,t} dy_t . x_t
// where dl_t = dL/d(dt_t A) = <S^_t, a_t S_{t-1}> is the suffix sum over the sequence of
//   dcum_t = C_t . (S_t^T dy_t) - dt_t x_t . u_t   (+ <d_final, S_T> from every step),
// the gradient of the cumulative log decay at t: it enters every y_t' and the final state
// through exp(cum_t' - cum_s) with s <= t <= t' (the first term: all of S_t C_t decays through
// step t), and leaves through the input it scales (the second). The sum is not run over the
// whole sequence in float32 (its error grew with T: 5e-4 on dA at 4,097 steps): everything
// after chunk c adds up to dl_{e+1} = <R_c, S_e>, S_e the state at the chunk's last step, so
// dl_t = <R_c, S_e> + sum_{t<=t'<=e} dcum_t', at most SSD_CHUNK terms.
//
// Kernels, in launch order:
// 1. ssd_bwd_chunk_state_<t>     (chunk, head, batch): the forward's kernel 1 (ssd.cu) on tiled
//    products.
// 2. ssd_state_passing           (head, batch, slice): ssd.cu's, the states entering each chunk.
// 3. ssd_bwd_chunk_adjoint_<t>   (chunk, head, batch): Q_c into adj.
// 4. ssd_bwd_state_passing       (head, batch, slice): adj[c] = R_c, d_initial = R_{-1}.
// 5. ssd_bwd_dx_<t>              (chunk, head, batch): dx, per step x . u and dy . x, and per
//    chunk <R_c, S_e> into bound.
// 6. ssd_bwd_db_<t>, ssd_bwd_dc_<t> (chunk, head, batch): dB and dC per head (summed over
//    the group by kernel 8), and per step C . (S^T dy).
// 7. ssd_bwd_ddt                 (head, batch): dl per chunk from bound and the chunk's suffix
//    sums, ddt, and per (b, h) the parts of dA and dD.
// 8. ssd_bwd_sum                 (elements): dB and dC over the group's heads; dA and dD over
//    the batch. Every sum is in a fixed order: the gradients are the same bits on every run.
// dy_scale (kernels 3, 5 and 6): dy is read times it (1 for SSD; Based's linear branch, whose
// output is its scale times SSD's y, passes that scale: src/sequence_mixers/based_backward.rs).
// Layouts: those of ssd.cu; dy [B, T, H, P] of type <t>; gradients float32: dx [B, T, H, P],
// ddt [B, T, H], dA, dD [H], dB, dC [B, T, G, N], d_initial [B, H, P, N]; scratch float32:
// adj [B, H, n_chunks, P, N], bound [B, H, n_chunks], per step xu, dyx, cdc [B, T, H], per
// head dBh, dCh [B, T, H, N], per (b, h) pa, pd [B, H]. Dynamic shared memory (floats; the host computes it,
// src/sequence_mixers/ssd_backward.rs): kernel 3 as ssd.cu's kernel 1; kernel 5
// L*N + L*(N|1) + L*P + P*(N|1) + L*L + L + SSD_WARPS; kernel 6 2*L*(P|1) + L*L + L*N + P*N +
// 2*L; kernel 7 2*SSD_WARPS.

#define SSD_WARPS (SSD_THREADS / 32)

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Version 1.1's products from shared memory: each thread accumulates an R x C tile of
// out(i, j) += sum_{k0<=k<k1} a(i, k) b(k, j), its rows i = i_base + r * SSD_WARPS (i_base:
// the pass's first row plus the warp: a warp's lanes share their rows, so a(i, k) is one
// broadcast read) and columns j = j_base + c * 32 (j_base: the pass's first column plus the
// lane: a row of b is read by consecutive lanes). Rows and columns past `rows` and `cols`
// are computed on the last valid ones (clamped) and must not be stored by the caller. One
// shared read of a and of b per R and C multiply-adds (the loops it replaces read two per
// multiply-add).
template <int R, int C, class FA, class FB>
__device__ __forceinline__ void mm_tile(float (&acc)[R][C], int i_base, int rows, int j_base,
                                        int cols, int k0, int k1, FA a, FB b) {
    int ii[R], jj[C];
#pragma unroll
    for (int r = 0; r < R; ++r) ii[r] = min(i_base + r * SSD_WARPS, rows - 1);
#pragma unroll
    for (int c = 0; c < C; ++c) jj[c] = min(j_base + c * 32, cols - 1);
    for (int k = k0; k < k1; ++k) {
        float av[R], bv[C];
#pragma unroll
        for (int r = 0; r < R; ++r) av[r] = a(ii[r], k);
#pragma unroll
        for (int c = 0; c < C; ++c) bv[c] = b(k, jj[c]);
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int c = 0; c < C; ++c) acc[r][c] += av[r] * bv[c];
    }
}

// Expands F(C) with C = 1, 2 or 4 columns per lane: the fewest that cover `cols` in one pass
// of 32 lanes, 4 past 64 columns (more passes past 128).
#define SSD_BY_COLS(cols, F)                                                                   \
    do {                                                                                       \
        if ((cols) <= 32) {                                                                    \
            F(1);                                                                              \
        } else if ((cols) <= 64) {                                                             \
            F(2);                                                                              \
        } else {                                                                               \
            F(4);                                                                              \
        }                                                                                      \
    } while (0)

// Kernels 1 and 3 on tiled products (mm_tile), STATE true: the forward's chunk_state
// (ssd.cu's kernel 1: S_c = sum_j exp(cum_e - cum_j) dt_j x_j B_j^T into adj, cum_e into
// chunk_log_decay), run by the backward in its place; STATE false: Q_c = sum_s exp(cum_s)
// dy_s C_s^T, the chunk's own part of the adjoint it passes to the chunk before it (rows from
// dy, columns from Cm). Shared memory as ssd.cu's kernel 1.
template <typename T, bool STATE>
__device__ void chunk_products(const T* __restrict__ dy, const float* __restrict__ dt,
                               const float* __restrict__ A, const T* __restrict__ Cm,
                               float* __restrict__ adj, float* __restrict__ chunk_log_decay,
                               float scale, int T_len, int heads, int groups, int P, int N) {
    extern __shared__ float smem[];
    const int c = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int n_chunks = gridDim.x;
    const int g = h / (heads / groups);
    const long long t0 = (long long)b * T_len + (long long)c * SSD_CHUNK;
    const int l = min(SSD_CHUNK, T_len - c * SSD_CHUNK);
    float* dys = smem;                     // [L][P]
    float* cs_ = dys + SSD_CHUNK * P;      // [L][N]
    float* cum = cs_ + SSD_CHUNK * N;      // [L]
    chunk_cumsum(dt, A[h], t0, l, heads, h, cum);
    for (int e = threadIdx.x; e < l * P; e += SSD_THREADS)
        dys[e] = ld(dy, ((t0 + e / P) * heads + h) * P + e % P);
    for (int e = threadIdx.x; e < l * N; e += SSD_THREADS)
        cs_[e] = ld(Cm, ((t0 + e / N) * groups + g) * N + e % N);
    __syncthreads();
    const float last = cum[l - 1];
    for (int e = threadIdx.x; e < l * P; e += SSD_THREADS) {
        const int j = e / P;
        dys[e] *= STATE ? dt[(t0 + j) * heads + h] * __expf(last - cum[j]) : scale * __expf(cum[j]);
    }
    __syncthreads();
    float* out = adj + (((long long)b * heads + h) * n_chunks + c) * P * N;
    if (STATE && threadIdx.x == 0) chunk_log_decay[((long long)b * heads + h) * n_chunks + c] = last;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    constexpr int R = 4;
#define SSD_ADJ_PASS(CC)                                                                       \
    for (int i0 = 0; i0 < P; i0 += SSD_WARPS * R)                                              \
        for (int j0 = 0; j0 < N; j0 += 32 * CC) {                                              \
            float acc[R][CC] = {};                                                             \
            mm_tile<R, CC>(                                                                    \
                acc, i0 + warp, P, j0 + lane, N, 0, l,                                         \
                [&](int p, int j) { return dys[j * P + p]; },                                  \
                [&](int j, int n) { return cs_[j * N + n]; });                                 \
            for (int r = 0; r < R; ++r)                                                        \
                for (int cc = 0; cc < CC; ++cc) {                                              \
                    const int p = i0 + warp + r * SSD_WARPS, n = j0 + lane + cc * 32;          \
                    if (p < P && n < N) out[p * N + n] = acc[r][cc];                           \
                }                                                                              \
        }
    SSD_BY_COLS(N, SSD_ADJ_PASS);
#undef SSD_ADJ_PASS
}

// Kernel 4: the adjoints passed from the last chunk back to the first (ssd_state_passing run
// in reverse): on entry adj[c] holds Q_c, on exit R_c; d_initial gets R_{-1}.
extern "C" __global__ void __launch_bounds__(SSD_THREADS)
ssd_bwd_state_passing(float* __restrict__ adj, const float* __restrict__ chunk_log_decay,
                      const float* __restrict__ d_final, int has_d_final,
                      float* __restrict__ d_initial, int heads, int n_chunks, int P, int N) {
    pass_chunks<true>(adj, chunk_log_decay, d_final, has_d_final, d_initial, heads, n_chunks, P,
                      N);
}

// Kernel 5: u_t = S^_t B_t from the chunk's C, B, dy and R_c; dx_t = dt_t u_t + D dy_t; per
// step x_t . u_t into xu and dy_t . x_t into dyx (a warp per step t, its lanes over p); and
// <R_c, S_e> into bound, S_e the state entering the next chunk (`states`, the forward's
// passing) or, for the last, the final state.
template <typename T>
__device__ void bwd_dx(const T* __restrict__ x, const float* __restrict__ dt,
                       const float* __restrict__ A, const T* __restrict__ Bm,
                       const T* __restrict__ Cm, const float* __restrict__ D, int has_d,
                       const T* __restrict__ dy, float dy_scale, const float* __restrict__ adj,
                       const float* __restrict__ states, const float* __restrict__ final_state,
                       float* __restrict__ dx, float* __restrict__ xu, float* __restrict__ dyx,
                       float* __restrict__ bound, int T_len, int heads, int groups, int P,
                       int N) {
    extern __shared__ float smem[];
    const int c = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int n_chunks = gridDim.x;
    const int g = h / (heads / groups);
    const long long t0 = (long long)b * T_len + (long long)c * SSD_CHUNK;
    const int l = min(SSD_CHUNK, T_len - c * SSD_CHUNK);
    const int NP = N | 1;
    float* cs_ = smem;                      // [L][N]: C
    float* bs = cs_ + SSD_CHUNK * N;        // [L][NP]: B
    float* dys = bs + SSD_CHUNK * NP;       // [L][P]: dy
    float* r = dys + SSD_CHUNK * P;         // [P][NP]: R_c
    float* m = r + P * NP;                  // [L][L]: m[s][t] = (C_s . B_t) exp(cum_s - cum_t)
    float* cum = m + SSD_CHUNK * SSD_CHUNK; // [L]
    float* red = cum + SSD_CHUNK;           // [SSD_WARPS]
    chunk_cumsum(dt, A[h], t0, l, heads, h, cum);
    for (int e = threadIdx.x; e < l * N; e += SSD_THREADS) {
        const int i = e / N, n = e % N;
        const long long at = ((t0 + i) * groups + g) * N + n;
        cs_[e] = ld(Cm, at);
        bs[i * NP + n] = ld(Bm, at);
    }
    for (int e = threadIdx.x; e < l * P; e += SSD_THREADS)
        dys[e] = dy_scale * ld(dy, ((t0 + e / P) * heads + h) * P + e % P);
    const long long bh = (long long)b * heads + h;
    const float* src = adj + (bh * n_chunks + c) * P * N;
    const float* s_end = c + 1 < n_chunks ? states + (bh * n_chunks + c + 1) * P * N
                                          : final_state + bh * P * N;
    float part_bound = 0.f;
    for (int e = threadIdx.x; e < P * N; e += SSD_THREADS) {
        const float v = src[e];
        r[(e / N) * NP + e % N] = v;
        part_bound += v * s_end[e];
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    part_bound = warp_sum(part_bound);
    if (lane == 0) red[warp] = part_bound;
    __syncthreads();
    if (threadIdx.x == 0) {
        float total = 0.f;
        for (int w = 0; w < SSD_WARPS; ++w) total += red[w];
        bound[bh * n_chunks + c] = total;
    }
    // m[s][t] = (C_s . B_t) exp(cum_s - cum_t) for s >= t, else 0: rows s, columns t.
    for (int i0 = 0; i0 < SSD_CHUNK; i0 += SSD_WARPS * 4) {
        float acc[4][2] = {};
        mm_tile<4, 2>(
            acc, i0 + warp, l, lane, l, 0, N, [&](int s, int n) { return cs_[s * N + n]; },
            [&](int n, int t) { return bs[t * NP + n]; });
        for (int q = 0; q < 4; ++q)
            for (int cc = 0; cc < 2; ++cc) {
                const int s = i0 + warp + q * SSD_WARPS, t = lane + cc * 32;
                if (s < l && t < l)
                    m[s * SSD_CHUNK + t] = s >= t ? acc[q][cc] * __expf(cum[s] - cum[t]) : 0.f;
            }
    }
    __syncthreads();
    const float skip = has_d ? D[h] : 0.f;
    const float last = cum[l - 1];
    constexpr int R = 4;
    // Rows t (R per thread, a warp's lanes sharing them), columns p: u = M^T dy + carry (B R^T).
#define SSD_DX_PASS(CC)                                                                        \
    for (int i0 = 0; i0 < l; i0 += SSD_WARPS * R) {                                            \
        float part_xu[R] = {}, part_dyx[R] = {};                                               \
        for (int j0 = 0; j0 < P; j0 += 32 * CC) {                                              \
            float acc[R][CC] = {}, rb[R][CC] = {};                                             \
            mm_tile<R, CC>(                                                                    \
                acc, i0 + warp, l, j0 + lane, P, 0, l,                                         \
                [&](int t, int s) { return m[s * SSD_CHUNK + t]; },                            \
                [&](int s, int p) { return dys[s * P + p]; });                                 \
            mm_tile<R, CC>(                                                                    \
                rb, i0 + warp, l, j0 + lane, P, 0, N,                                          \
                [&](int t, int n) { return bs[t * NP + n]; },                                  \
                [&](int n, int p) { return r[p * NP + n]; });                                  \
            for (int q = 0; q < R; ++q) {                                                      \
                const int t = i0 + warp + q * SSD_WARPS;                                       \
                if (t >= l) continue;                                                          \
                const float step = dt[(t0 + t) * heads + h];                                   \
                const float carry = __expf(last - cum[t]);                                     \
                for (int cc = 0; cc < CC; ++cc) {                                              \
                    const int p = j0 + lane + cc * 32;                                         \
                    if (p >= P) continue;                                                      \
                    const float u = acc[q][cc] + carry * rb[q][cc];                            \
                    const long long at = ((t0 + t) * heads + h) * P + p;                       \
                    const float xv = ld(x, at), g_y = dys[t * P + p];                          \
                    dx[at] = step * u + skip * g_y;                                            \
                    part_xu[q] += xv * u;                                                      \
                    part_dyx[q] += g_y * xv;                                                   \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        for (int q = 0; q < R; ++q) {                                                          \
            const int t = i0 + warp + q * SSD_WARPS;                                           \
            const float su = warp_sum(part_xu[q]), sd = warp_sum(part_dyx[q]);                 \
            if (lane == 0 && t < l) {                                                          \
                xu[(t0 + t) * heads + h] = su;                                                 \
                dyx[(t0 + t) * heads + h] = sd;                                                \
            }                                                                                  \
        }                                                                                      \
    }
    SSD_BY_COLS(P, SSD_DX_PASS);
#undef SSD_DX_PASS
}

// Kernel 6, FOR_C false: dB_t per head, dt_t (S^_t^T x_t) =
//   dt_t [sum_{s>=t} exp(cum_s - cum_t) (dy_s . x_t) C_s + exp(cum_e - cum_t) R_c^T x_t];
// FOR_C true: dC_t per head, S_t^T dy_t =
//   sum_{s<=t} exp(cum_t - cum_s) (dy_t . x_s) dt_s B_s + exp(cum_t) S_in^T dy_t,
// and C_t . dC_t into cdc. Both from the Gram matrix gm[i][j] = dy_i . x_j (j <= i); a warp
// per step t, its lanes over n.
template <typename T, bool FOR_C>
__device__ void bwd_dbc(const T* __restrict__ x, const float* __restrict__ dt,
                        const float* __restrict__ A, const T* __restrict__ Z,
                        const T* __restrict__ Cm, const T* __restrict__ dy, float dy_scale,
                        const float* __restrict__ mats, float* __restrict__ out,
                        float* __restrict__ cdc, int T_len, int heads, int groups, int P,
                        int N) {
    extern __shared__ float smem[];
    const int c = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int n_chunks = gridDim.x;
    const int g = h / (heads / groups);
    const long long t0 = (long long)b * T_len + (long long)c * SSD_CHUNK;
    const int l = min(SSD_CHUNK, T_len - c * SSD_CHUNK);
    const int PP = P | 1;                   // odd rows: lanes over j read x[j][p] apart
    float* dys = smem;                      // [L][PP]
    float* xs = dys + SSD_CHUNK * PP;       // [L][PP]
    float* gm = xs + SSD_CHUNK * PP;        // [L][L]
    float* zs = gm + SSD_CHUNK * SSD_CHUNK; // [L][N]: C (dB), or dt B (dC)
    float* ms = zs + SSD_CHUNK * N;         // [P][N]: R_c (dB), or S_in (dC)
    float* cum = ms + P * N;                // [L]
    float* dts = cum + SSD_CHUNK;           // [L]
    chunk_cumsum(dt, A[h], t0, l, heads, h, cum);
    for (int i = threadIdx.x; i < l; i += SSD_THREADS) dts[i] = dt[(t0 + i) * heads + h];
    for (int e = threadIdx.x; e < l * P; e += SSD_THREADS) {
        const int i = e / P, p = e % P;
        const long long at = ((t0 + i) * heads + h) * P + p;
        dys[i * PP + p] = dy_scale * ld(dy, at);
        xs[i * PP + p] = ld(x, at);
    }
    const float* src = mats + (((long long)b * heads + h) * n_chunks + c) * P * N;
    for (int e = threadIdx.x; e < P * N; e += SSD_THREADS) ms[e] = src[e];
    __syncthreads();
    for (int e = threadIdx.x; e < l * N; e += SSD_THREADS) {
        const float v = ld(Z, ((t0 + e / N) * groups + g) * N + e % N);
        zs[e] = FOR_C ? v * dts[e / N] : v;
    }
    // gm[i][j] = exp(cum_i - cum_j) (dy_i . x_j) for j <= i, 0 above the diagonal: dB reads
    // it as gm[s][t] (s >= t), dC as gm[t][s] (s <= t).
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int i0 = 0; i0 < SSD_CHUNK; i0 += SSD_WARPS * 4) {
        float acc[4][2] = {};
        mm_tile<4, 2>(
            acc, i0 + warp, l, lane, l, 0, P, [&](int i, int p) { return dys[i * PP + p]; },
            [&](int p, int j) { return xs[j * PP + p]; });
        for (int q = 0; q < 4; ++q)
            for (int cc = 0; cc < 2; ++cc) {
                const int i = i0 + warp + q * SSD_WARPS, j = lane + cc * 32;
                if (i < l && j < l)
                    gm[i * SSD_CHUNK + j] = j <= i ? acc[q][cc] * __expf(cum[i] - cum[j]) : 0.f;
            }
    }
    __syncthreads();
    const float last = cum[l - 1];
    const float* v_row = FOR_C ? dys : xs;
    constexpr int R = 4;
    // Rows t (R per thread), columns n: the chunk's own part from gm and zs, the carried part
    // from the state matrix ms.
#define SSD_DBC_PASS(CC)                                                                       \
    for (int i0 = 0; i0 < l; i0 += SSD_WARPS * R) {                                            \
        float part[R] = {};                                                                    \
        for (int j0 = 0; j0 < N; j0 += 32 * CC) {                                              \
            float acc[R][CC] = {}, mv[R][CC] = {};                                             \
            mm_tile<R, CC>(                                                                    \
                acc, i0 + warp, l, j0 + lane, N, 0, l,                                         \
                [&](int t, int s) {                                                            \
                    return FOR_C ? gm[t * SSD_CHUNK + s] : gm[s * SSD_CHUNK + t];              \
                },                                                                             \
                [&](int s, int n) { return zs[s * N + n]; });                                  \
            mm_tile<R, CC>(                                                                    \
                mv, i0 + warp, l, j0 + lane, N, 0, P,                                          \
                [&](int t, int p) { return v_row[t * PP + p]; },                               \
                [&](int p, int n) { return ms[p * N + n]; });                                  \
            for (int q = 0; q < R; ++q) {                                                      \
                const int t = i0 + warp + q * SSD_WARPS;                                       \
                if (t >= l) continue;                                                          \
                const float carry = FOR_C ? __expf(cum[t]) : __expf(last - cum[t]);            \
                for (int cc = 0; cc < CC; ++cc) {                                              \
                    const int n = j0 + lane + cc * 32;                                         \
                    if (n >= N) continue;                                                      \
                    float v = acc[q][cc] + carry * mv[q][cc];                                  \
                    if (!FOR_C) v *= dts[t];                                                   \
                    out[((t0 + t) * heads + h) * N + n] = v;                                   \
                    if (FOR_C) part[q] += ld(Cm, ((t0 + t) * groups + g) * N + n) * v;         \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        if (FOR_C)                                                                             \
            for (int q = 0; q < R; ++q) {                                                      \
                const int t = i0 + warp + q * SSD_WARPS;                                       \
                const float sum = warp_sum(part[q]);                                           \
                if (lane == 0 && t < l) cdc[(t0 + t) * heads + h] = sum;                       \
            }                                                                                  \
    }
    SSD_BY_COLS(N, SSD_DBC_PASS);
#undef SSD_DBC_PASS
}

// Kernel 7: per (head, batch entry), dl_t = bound_c + sum_{t<=t'<=e} dcum_t' with
// dcum_t = cdc_t - dt_t xu_t, chunk by chunk (a thread per chunk, its steps from the last);
// ddt_t = A dl_t + xu_t; the parts of dA (sum dt_t dl_t) and dD (sum dyx_t) into pa and pd
// [B, H], each thread's sums added in a fixed order. Dynamic shared memory: 2 * SSD_WARPS
// floats.
extern "C" __global__ void __launch_bounds__(SSD_THREADS)
ssd_bwd_ddt(const float* __restrict__ dt, const float* __restrict__ A,
            const float* __restrict__ xu, const float* __restrict__ dyx,
            const float* __restrict__ cdc, const float* __restrict__ bound,
            float* __restrict__ ddt, float* __restrict__ pa, float* __restrict__ pd, int T_len,
            int heads, int n_chunks) {
    extern __shared__ float smem[];
    float* red = smem;                     // [2][SSD_WARPS]
    const int h = blockIdx.x, b = blockIdx.y;
    const long long bh = (long long)b * heads + h;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const float a = A[h];
    float part_a = 0.f, part_d = 0.f;
    for (int c = threadIdx.x; c < n_chunks; c += SSD_THREADS) {
        float run = bound[bh * n_chunks + c];
        const int t_lo = c * SSD_CHUNK, t_hi = min(T_len, t_lo + SSD_CHUNK);
        for (int t = t_hi - 1; t >= t_lo; --t) {
            const long long i = ((long long)b * T_len + t) * heads + h;
            const float u = xu[i], step = dt[i];
            run += cdc[i] - step * u;
            ddt[i] = a * run + u;
            part_a += step * run;
            part_d += dyx[i];
        }
    }
    part_a = warp_sum(part_a);
    part_d = warp_sum(part_d);
    if (lane == 0) {
        red[warp] = part_a;
        red[SSD_WARPS + warp] = part_d;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float sa = 0.f, sd = 0.f;
        for (int w = 0; w < SSD_WARPS; ++w) {
            sa += red[w];
            sd += red[SSD_WARPS + w];
        }
        pa[bh] = sa;
        pd[bh] = sd;
    }
}

// Kernel 8: dB and dC [B, T, G, N] as the sums of dBh and dCh over the heads of each group;
// dA[h] and dD[h] (0 without D) as the sums of pa and pd over the batch (block 0's threads).
extern "C" __global__ void __launch_bounds__(SSD_THREADS)
ssd_bwd_sum(const float* __restrict__ dbh, const float* __restrict__ dch,
            const float* __restrict__ pa, const float* __restrict__ pd, int has_d,
            float* __restrict__ db, float* __restrict__ dc, float* __restrict__ da,
            float* __restrict__ dd, long long rows, int batch, int heads, int groups, int N) {
    const int per = heads / groups;
    const long long total = rows * groups * N;
    for (long long e = (long long)blockIdx.x * SSD_THREADS + threadIdx.x; e < total;
         e += (long long)gridDim.x * SSD_THREADS) {
        const long long bt = e / ((long long)groups * N);
        const int g = (int)(e / N % groups), n = (int)(e % N);
        float sb = 0.f, sc = 0.f;
        for (int k = 0; k < per; ++k) {
            const long long i = (bt * heads + g * per + k) * N + n;
            sb += dbh[i];
            sc += dch[i];
        }
        db[e] = sb;
        dc[e] = sc;
    }
    if (blockIdx.x == 0) {
        for (int h = threadIdx.x; h < heads; h += SSD_THREADS) {
            float sa = 0.f, sd = 0.f;
            for (int bb = 0; bb < batch; ++bb) {
                sa += pa[(long long)bb * heads + h];
                sd += pd[(long long)bb * heads + h];
            }
            da[h] = sa;
            dd[h] = has_d ? sd : 0.f;
        }
    }
}

#define SSD_BWD_ENTRIES(NAME, T)                                                               \
    extern "C" __global__ void __launch_bounds__(SSD_THREADS)                                  \
    ssd_bwd_chunk_state_##NAME(const T* x, const float* dt, const float* A, const T* Bm,      \
                               float* states, float* chunk_log_decay, int T_len, int heads,    \
                               int groups, int P, int N) {                                     \
        chunk_products<T, true>(x, dt, A, Bm, states, chunk_log_decay, 1.f, T_len, heads,      \
                                groups, P, N);                                                 \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(SSD_THREADS)                                  \
    ssd_bwd_chunk_adjoint_##NAME(const T* dy, float dy_scale, const float* dt, const float* A, \
                                 const T* Cm, float* adj, int T_len, int heads, int groups,    \
                                 int P, int N) {                                               \
        chunk_products<T, false>(dy, dt, A, Cm, adj, (float*)0, dy_scale, T_len, heads, groups, \
                                 P, N);                                                        \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(SSD_THREADS)                                  \
    ssd_bwd_dx_##NAME(const T* x, const float* dt, const float* A, const T* Bm, const T* Cm,  \
                      const float* D, int has_d, const T* dy, float dy_scale,                  \
                      const float* adj, const float* states, const float* final_state,         \
                      float* dx, float* xu, float* dyx, float* bound, int T_len, int heads,    \
                      int groups, int P, int N) {                                              \
        bwd_dx<T>(x, dt, A, Bm, Cm, D, has_d, dy, dy_scale, adj, states, final_state, dx, xu,  \
                  dyx, bound, T_len, heads, groups, P, N);                                     \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(SSD_THREADS)                                  \
    ssd_bwd_db_##NAME(const T* x, const float* dt, const float* A, const T* Cm, const T* dy,  \
                      float dy_scale, const float* adj, float* dbh, int T_len, int heads,      \
                      int groups, int P, int N) {                                              \
        bwd_dbc<T, false>(x, dt, A, Cm, Cm, dy, dy_scale, adj, dbh, (float*)0, T_len, heads,   \
                          groups, P, N);                                                       \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(SSD_THREADS)                                  \
    ssd_bwd_dc_##NAME(const T* x, const float* dt, const float* A, const T* Bm, const T* Cm,  \
                      const T* dy, float dy_scale, const float* states, float* dch,            \
                      float* cdc, int T_len, int heads, int groups, int P, int N) {            \
        bwd_dbc<T, true>(x, dt, A, Bm, Cm, dy, dy_scale, states, dch, cdc, T_len, heads,       \
                         groups, P, N);                                                        \
    }

SSD_BWD_ENTRIES(f32, float)
SSD_BWD_ENTRIES(bf16, u16)
