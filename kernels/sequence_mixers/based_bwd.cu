// Based's backward, the window branch (version 1, float32 on CUDA cores, for f32 and bf16
// inputs). The linear branch's backward is SSD's (ssd_bwd.cu with dt 1, A 0, B = k, C = q,
// x = v and dy read times the scale: src/sequence_mixers/based_backward.rs), which writes
// dq, dk and dv whole; these two kernels, launched after it on the same stream, add the
// window branch's part. For each query t and the keys s of its window w(t) =
// [max(0, t - W + 1), t] (an empty initial cache, as the forward), with c the scale,
// P_ts = softmax_s(c q_t . k_s) and dy_t the cotangent of O_t (FlashAttention-2's backward,
// Dao 2023, restricted to the window):
//
//   dP_ts = dy_t . v_s,  D_t = sum_s P_ts dP_ts,  dS_ts = P_ts (dP_ts - D_t),
//   dq_t += c sum_s dS_ts k_s,  dk_s += c sum_t dS_ts q_t,  dv_s += sum_t P_ts dy_t.
//
// based_bwd_window_dq_<t>: a block per tile of BASED_TILE query rows (grid: row tile, head,
// batch entry) walks the keys its rows see, BASED_TILE per step, twice: first the row's
// running maximum m, sum l and sum of exp(score - m) dP (online, rescaled as m grows), from
// which lse_t = m + log l and D_t = that sum / l, written to lse and dsum [B, T, H]; then
// P and dS again, dq_t += c dS k. Thread (r, c) = (tid / 4, tid % 4) owns row r, score
// columns c, c + 4, ... and dq columns c, c + 4, ...; a row's 4 threads are lanes of one warp.
//
// based_bwd_window_dkv_<t>: a block per tile of BASED_TILE keys walks the queries that see
// them, [s0, s0 + keys - 1 + W - 1], BASED_TILE per step, with their lse and D: P and dS per
// (key, query), dv_s += P dy_t, dk_s += c dS q_t. Thread (r, c) owns key r and columns
// c, c + 4, ... of dk and dv. Each gradient element has one writer and a fixed order of
// terms: the same bits on every run.
//
// Layouts (row-major, as the forward): q, k [B, T, H, K]; v, dy [B, T, H, V] of type <t>;
// dq, dk [B, T, H, K] and dv [B, T, H, V] float32, read and written (added to); lse, dsum
// [B, T, H] float32. Dynamic shared memory (floats; the host computes it,
// src/sequence_mixers/based_backward.rs): dq kernel 2*L*(K|1) + 2*L*(V|1) + L*(L+1), dkv
// kernel 2*L*(K|1) + 2*L*(V|1) + 2*L*(L+1) + 2*L, L = BASED_TILE. Compiled after based.cu
// (its limits and tile). Offsets are 64-bit.

// The 16 dot products of row r of a (stride as) with rows c, c + 4, ..., c + 60 of b
// (stride bs) over n < len; rows of b at or past `cols` give 0.
__device__ __forceinline__ void based_dots(float* out, const float* a, int as, const float* b,
                                           int bs, int r, int c, int cols, int len) {
#pragma unroll
    for (int u = 0; u < BASED_TILE / 4; ++u) out[u] = 0.f;
    for (int n = 0; n < len; ++n) {
        const float an = a[r * as + n];
#pragma unroll
        for (int u = 0; u < BASED_TILE / 4; ++u)
            if (c + 4 * u < cols) out[u] += an * b[(c + 4 * u) * bs + n];
    }
}

// Loads rows [first, first + n) of a [B, T, H, width] array (batch entry's step 0 at row0)
// into shared rows of stride `stride`, as float.
template <typename T>
__device__ __forceinline__ void based_rows(float* dst, int stride, const T* __restrict__ src,
                                           long long row0, int first, int n, int heads, int h,
                                           int width) {
    for (int e = threadIdx.x; e < n * width; e += BASED_THREADS) {
        const int i = e / width, m = e % width;
        dst[i * stride + m] = ld(src, ((row0 + first + i) * heads + h) * width + m);
    }
}

template <typename T>
__device__ void window_bwd_dq(const T* __restrict__ q, const T* __restrict__ k,
                              const T* __restrict__ v, const T* __restrict__ dy, float scale,
                              float* __restrict__ lse, float* __restrict__ dsum,
                              float* __restrict__ dq, int T_len, int heads, int K, int V,
                              int W) {
    extern __shared__ float smem[];
    const int h = blockIdx.y, b = blockIdx.z;
    const int t0 = blockIdx.x * BASED_TILE;
    const int rows = min(BASED_TILE, T_len - t0);
    const int KP = K | 1, VP = V | 1, TP = BASED_TILE + 1;
    float* qt = smem;                   // [L][KP]: the tile's queries
    float* gt = qt + BASED_TILE * KP;   // [L][VP]: the tile's dy
    float* kt = gt + BASED_TILE * VP;   // [L][KP]: the step's keys
    float* vt = kt + BASED_TILE * KP;   // [L][VP]: the step's values
    float* ds = vt + BASED_TILE * VP;   // [L][TP]: the step's dS
    const float neg_inf = __int_as_float(0xff800000);
    const long long row0 = (long long)b * T_len;
    based_rows(qt, KP, q, row0, t0, rows, heads, h, K);
    based_rows(gt, VP, dy, row0, t0, rows, heads, h, V);
    const int r = threadIdx.x / 4, c = threadIdx.x % 4;
    const int t = t0 + r;
    const int first = max(0, t0 - W + 1), last = t0 + rows - 1;
    float sc[BASED_TILE / 4], dp[BASED_TILE / 4];
    // Pass 1: this thread's columns' running maximum, sum and sum of exp(score - m) dP.
    float m = neg_inf, l = 0.f, d = 0.f;
    for (int s0 = first; s0 <= last; s0 += BASED_TILE) {
        const int cols = min(BASED_TILE, last - s0 + 1);
        __syncthreads();  // the previous step's readers of kt and vt are done
        based_rows(kt, KP, k, row0, s0, cols, heads, h, K);
        based_rows(vt, VP, v, row0, s0, cols, heads, h, V);
        __syncthreads();
        based_dots(sc, qt, KP, kt, KP, r, c, cols, K);
        based_dots(dp, gt, VP, vt, VP, r, c, cols, V);
#pragma unroll
        for (int u = 0; u < BASED_TILE / 4; ++u) {
            const int s = s0 + c + 4 * u;
            if (c + 4 * u < cols && r < rows && s <= t && s > t - W) {
                const float x = scale * sc[u];
                if (x > m) {
                    const float fix = __expf(m - x);  // 0 while m is -inf
                    l *= fix;
                    d *= fix;
                    m = x;
                }
                const float e = __expf(x - m);
                l += e;
                d += e * dp[u];
            }
        }
    }
    // The row's 4 threads combine their (m, l, d).
    for (int o = 1; o <= 2; o <<= 1) {
        const float mo = __shfl_xor_sync(0xffffffffu, m, o);
        const float lo = __shfl_xor_sync(0xffffffffu, l, o);
        const float dd = __shfl_xor_sync(0xffffffffu, d, o);
        const float top = fmaxf(m, mo);
        const float a = m == neg_inf ? 0.f : __expf(m - top);
        const float e = mo == neg_inf ? 0.f : __expf(mo - top);
        l = l * a + lo * e;
        d = d * a + dd * e;
        m = top;
    }
    // Every row below T sees its own key: l > 0. Rows past T keep 0s and write nothing.
    const float row_lse = r < rows ? m + logf(l) : 0.f;
    const float row_d = r < rows ? d / l : 0.f;
    if (r < rows && c == 0) {
        const long long at = (row0 + t) * heads + h;
        lse[at] = row_lse;
        dsum[at] = row_d;
    }
    // Pass 2: dS, then dq += c dS k.
    float acc[BASED_MAX_DIM / 4];
#pragma unroll
    for (int j = 0; j < BASED_MAX_DIM / 4; ++j) acc[j] = 0.f;
    for (int s0 = first; s0 <= last; s0 += BASED_TILE) {
        const int cols = min(BASED_TILE, last - s0 + 1);
        __syncthreads();  // the previous step's readers of kt, vt and ds are done
        based_rows(kt, KP, k, row0, s0, cols, heads, h, K);
        based_rows(vt, VP, v, row0, s0, cols, heads, h, V);
        __syncthreads();
        based_dots(sc, qt, KP, kt, KP, r, c, cols, K);
        based_dots(dp, gt, VP, vt, VP, r, c, cols, V);
#pragma unroll
        for (int u = 0; u < BASED_TILE / 4; ++u) {
            const int j = c + 4 * u, s = s0 + j;
            const bool vis = j < cols && r < rows && s <= t && s > t - W;
            if (j < cols) ds[r * TP + j] = vis ? __expf(scale * sc[u] - row_lse) * (dp[u] - row_d) : 0.f;
        }
        __syncwarp();  // the row's dS come from the 4 lanes of this warp
        for (int j = 0; j < cols; ++j) {
            const float g = ds[r * TP + j];
#pragma unroll
            for (int mm = 0; mm < BASED_MAX_DIM / 4; ++mm) {
                if (mm * 4 >= K) break;
                if (mm * 4 + c < K) acc[mm] += g * kt[j * KP + mm * 4 + c];
            }
        }
    }
    if (r < rows) {
        const long long at = ((row0 + t) * heads + h) * K;
#pragma unroll
        for (int mm = 0; mm < BASED_MAX_DIM / 4; ++mm)
            if (mm * 4 + c < K) dq[at + mm * 4 + c] += scale * acc[mm];
    }
}

template <typename T>
__device__ void window_bwd_dkv(const T* __restrict__ q, const T* __restrict__ k,
                               const T* __restrict__ v, const T* __restrict__ dy, float scale,
                               const float* __restrict__ lse, const float* __restrict__ dsum,
                               float* __restrict__ dk, float* __restrict__ dv, int T_len,
                               int heads, int K, int V, int W) {
    extern __shared__ float smem[];
    const int h = blockIdx.y, b = blockIdx.z;
    const int s_first = blockIdx.x * BASED_TILE;
    const int keys = min(BASED_TILE, T_len - s_first);
    const int KP = K | 1, VP = V | 1, TP = BASED_TILE + 1;
    float* kt = smem;                   // [L][KP]: the tile's keys
    float* vt = kt + BASED_TILE * KP;   // [L][VP]: the tile's values
    float* qt = vt + BASED_TILE * VP;   // [L][KP]: the step's queries
    float* gt = qt + BASED_TILE * KP;   // [L][VP]: the step's dy
    float* pr = gt + BASED_TILE * VP;   // [L][TP]: P of (key, query)
    float* ds = pr + BASED_TILE * TP;   // [L][TP]: dS of (key, query)
    float* ls = ds + BASED_TILE * TP;   // [L]: the step's lse
    float* dd = ls + BASED_TILE;        // [L]: the step's D
    const long long row0 = (long long)b * T_len;
    based_rows(kt, KP, k, row0, s_first, keys, heads, h, K);
    based_rows(vt, VP, v, row0, s_first, keys, heads, h, V);
    const int r = threadIdx.x / 4, c = threadIdx.x % 4;
    const int s = s_first + r;
    const int last = min(T_len - 1, s_first + keys - 1 + W - 1);
    float sc[BASED_TILE / 4], dp[BASED_TILE / 4];
    float acc_k[BASED_MAX_DIM / 4], acc_v[BASED_MAX_DIM / 4];
#pragma unroll
    for (int j = 0; j < BASED_MAX_DIM / 4; ++j) acc_k[j] = acc_v[j] = 0.f;
    for (int q0 = s_first; q0 <= last; q0 += BASED_TILE) {
        const int cols = min(BASED_TILE, last - q0 + 1);
        __syncthreads();  // the previous step's readers of qt, gt, pr, ds, ls and dd are done
        based_rows(qt, KP, q, row0, q0, cols, heads, h, K);
        based_rows(gt, VP, dy, row0, q0, cols, heads, h, V);
        for (int j = threadIdx.x; j < cols; j += BASED_THREADS) {
            const long long at = (row0 + q0 + j) * heads + h;
            ls[j] = lse[at];
            dd[j] = dsum[at];
        }
        __syncthreads();
        based_dots(sc, kt, KP, qt, KP, r, c, cols, K);
        based_dots(dp, vt, VP, gt, VP, r, c, cols, V);
#pragma unroll
        for (int u = 0; u < BASED_TILE / 4; ++u) {
            const int j = c + 4 * u, t = q0 + j;
            if (j < cols) {
                const bool vis = r < keys && s <= t && s > t - W;
                const float p = vis ? __expf(scale * sc[u] - ls[j]) : 0.f;
                pr[r * TP + j] = p;
                ds[r * TP + j] = vis ? p * (dp[u] - dd[j]) : 0.f;
            }
        }
        __syncwarp();  // the key's P and dS come from the 4 lanes of this warp
        for (int j = 0; j < cols; ++j) {
            const float p = pr[r * TP + j], g = ds[r * TP + j];
#pragma unroll
            for (int mm = 0; mm < BASED_MAX_DIM / 4; ++mm) {
                if (mm * 4 < V && mm * 4 + c < V) acc_v[mm] += p * gt[j * VP + mm * 4 + c];
                if (mm * 4 < K && mm * 4 + c < K) acc_k[mm] += g * qt[j * KP + mm * 4 + c];
            }
        }
    }
    if (r < keys) {
        const long long at = (row0 + s) * heads + h;
#pragma unroll
        for (int mm = 0; mm < BASED_MAX_DIM / 4; ++mm) {
            if (mm * 4 + c < K) dk[at * K + mm * 4 + c] += scale * acc_k[mm];
            if (mm * 4 + c < V) dv[at * V + mm * 4 + c] += acc_v[mm];
        }
    }
}

#define BASED_BWD_ENTRIES(NAME, T)                                                             \
    extern "C" __global__ void __launch_bounds__(BASED_THREADS)                                \
    based_bwd_window_dq_##NAME(const T* q, const T* k, const T* v, const T* dy, float scale,  \
                               float* lse, float* dsum, float* dq, int T_len, int heads,       \
                               int K, int V, int W) {                                          \
        window_bwd_dq<T>(q, k, v, dy, scale, lse, dsum, dq, T_len, heads, K, V, W);           \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(BASED_THREADS)                                \
    based_bwd_window_dkv_##NAME(const T* q, const T* k, const T* v, const T* dy, float scale, \
                                const float* lse, const float* dsum, float* dk, float* dv,     \
                                int T_len, int heads, int K, int V, int W) {                   \
        window_bwd_dkv<T>(q, k, v, dy, scale, lse, dsum, dk, dv, T_len, heads, K, V, W);      \
    }

BASED_BWD_ENTRIES(f32, float)
BASED_BWD_ENTRIES(bf16, u16)

// Version 2 of the window's backward for bf16 with K and V multiples of 16 (based_bwd_window_
// dq_tc, based_bwd_window_dkv_tc): the same two kernels on tensor cores (mma.sync m16n8k16, bf16
// operands, float32 accumulation), 4 warps of 16 rows each, as the forward's based_window_tc.
// dq kernel: per key step S = Q Kᵀ and dP = dO Vᵀ (prelude's mma_rows), the first walk's row
// statistics as version 1 (each lane its own columns, the row's 4 lanes combined at the end),
// the second walk's dS rounded to bf16 into A fragments (from the accumulators, as the forward
// rounds P) and dQ += dS K (mma_k_block, K read by ldmatrix.trans). dk/dv kernel: per query step
// Sᵀ = K Qᵀ and dPᵀ = V dOᵀ for the tile's keys, Pᵀ and dSᵀ from the step's lse and D, rounded
// to bf16, dV += Pᵀ dO and dK += dSᵀ Q. Rows are staged by cp.async (zeros outside [0, T)).
// Dynamic shared memory (bf16 rows of K + 8 and V + 8): dq kernel 2 L (K + 8) + 2 L (V + 8)
// halves; dk/dv kernel the same plus 2 L floats (lse, D).

// Stages rows [first, first + n) (zeros for the rest of BASED_TILE) of a bf16 [B, T, H, width]
// array into shared rows of `stride` halves, 16 bytes per copy.
__device__ __forceinline__ void based_stage(u16* dst, int stride, const u16* __restrict__ src,
                                            long long row0, int first, int n, int heads, int h,
                                            int width) {
    const int per = width / 8;
    for (int e = threadIdx.x; e < BASED_TILE * per; e += BASED_TC_THREADS) {
        const int i = e / per, c = (e % per) * 8;
        const bool ok = i < n;
        cp_async16(dst + i * stride + c,
                   src + ((row0 + first + (ok ? i : 0)) * heads + h) * width + c, ok);
    }
}

extern "C" __global__ void __launch_bounds__(BASED_TC_THREADS)
based_bwd_window_dq_tc(const u16* __restrict__ q, const u16* __restrict__ k,
                       const u16* __restrict__ v, const u16* __restrict__ dy, float scale,
                       float* __restrict__ lse, float* __restrict__ dsum,
                       float* __restrict__ dq, int T_len, int heads, int K, int V, int W) {
    extern __shared__ float smem[];
    const int h = blockIdx.y, b = blockIdx.z;
    const int t0 = blockIdx.x * BASED_TILE;
    const int rows = min(BASED_TILE, T_len - t0);
    const int KS = K + 8, VS = V + 8;
    u16* qs = reinterpret_cast<u16*>(smem);  // [TILE][KS]: the tile's queries
    u16* gs = qs + BASED_TILE * KS;          // [TILE][VS]: the tile's dy
    u16* ks = gs + BASED_TILE * VS;          // [TILE][KS]: the step's keys
    u16* vs = ks + BASED_TILE * KS;          // [TILE][VS]: the step's values
    const float neg_inf = __int_as_float(0xff800000);
    const long long row0 = (long long)b * T_len;
    based_stage(qs, KS, q, row0, t0, rows, heads, h, K);
    based_stage(gs, VS, dy, row0, t0, rows, heads, h, V);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gi = lane / 4, ti = lane % 4;
    const int r0 = warp * 16;
    const int first = max(0, t0 - W + 1), last = t0 + rows - 1;
    float sc[BASED_TILE / 8][4], dp[BASED_TILE / 8][4];
    // Rows r0 + gi (half 0) and r0 + gi + 8 (half 1): this lane's maximum, sum and
    // sum of exp(score - m) dP over its columns.
    float m[2] = {neg_inf, neg_inf}, l[2] = {0.f, 0.f}, d[2] = {0.f, 0.f};
    for (int pass = 0; pass < 2; ++pass) {
        float row_lse[2], row_d[2];
        if (pass == 1) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                for (int o = 1; o <= 2; o <<= 1) {
                    const float mo = __shfl_xor_sync(0xffffffffu, m[half], o);
                    const float lo = __shfl_xor_sync(0xffffffffu, l[half], o);
                    const float dd = __shfl_xor_sync(0xffffffffu, d[half], o);
                    const float top = fmaxf(m[half], mo);
                    const float a = m[half] == neg_inf ? 0.f : __expf(m[half] - top);
                    const float e = mo == neg_inf ? 0.f : __expf(mo - top);
                    l[half] = l[half] * a + lo * e;
                    d[half] = d[half] * a + dd * e;
                    m[half] = top;
                }
                const int i = r0 + gi + 8 * half;
                row_lse[half] = i < rows ? m[half] + logf(l[half]) : 0.f;
                row_d[half] = i < rows ? d[half] / l[half] : 0.f;
                if (i < rows && ti == 0) {
                    const long long at = (row0 + t0 + i) * heads + h;
                    lse[at] = row_lse[half];
                    dsum[at] = row_d[half];
                }
            }
        }
        float acc[BASED_MAX_DIM / 8][4];
#pragma unroll
        for (int nt = 0; nt < BASED_MAX_DIM / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[nt][e] = 0.f;
        for (int s0 = first; s0 <= last; s0 += BASED_TILE) {
            const int cols = min(BASED_TILE, last - s0 + 1);
            __syncthreads();  // the previous step's readers of ks and vs are done
            based_stage(ks, KS, k, row0, s0, cols, heads, h, K);
            based_stage(vs, VS, v, row0, s0, cols, heads, h, V);
            cp_async_commit();
            cp_async_wait<0>();
            __syncthreads();
#pragma unroll
            for (int nt = 0; nt < BASED_TILE / 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) sc[nt][e] = dp[nt][e] = 0.f;
            mma_rows<BASED_TILE / 8>(sc, qs, KS, r0, ks, KS, 0, K / 16);
            mma_rows<BASED_TILE / 8>(dp, gs, VS, r0, vs, VS, 0, V / 16);
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int t = t0 + r0 + gi + 8 * half;
#pragma unroll
                for (int nt = 0; nt < BASED_TILE / 8; ++nt)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int j = nt * 8 + 2 * ti + e, s = s0 + j;
                        const bool vis = j < cols && t < T_len && s <= t && s > t - W;
                        const float x = scale * sc[nt][2 * half + e];
                        const float g = dp[nt][2 * half + e];
                        if (pass == 0) {
                            if (vis) {
                                if (x > m[half]) {
                                    const float fix = __expf(m[half] - x);
                                    l[half] *= fix;
                                    d[half] *= fix;
                                    m[half] = x;
                                }
                                const float p = __expf(x - m[half]);
                                l[half] += p;
                                d[half] += p * g;
                            }
                        } else {
                            // dS into the score accumulator (0 where not visible).
                            sc[nt][2 * half + e] =
                                vis ? __expf(x - row_lse[half]) * (g - row_d[half]) : 0.f;
                        }
                    }
            }
            if (pass == 1) {
                // dQ += dS K: dS's A fragment for keys 16 kc .. 16 kc + 15 is tiles 2 kc, 2 kc + 1.
#pragma unroll
                for (int kc = 0; kc < BASED_TILE / 16; ++kc) {
                    const u32 fa[4] = {pack_bf16(sc[2 * kc][0], sc[2 * kc][1]),
                                       pack_bf16(sc[2 * kc][2], sc[2 * kc][3]),
                                       pack_bf16(sc[2 * kc + 1][0], sc[2 * kc + 1][1]),
                                       pack_bf16(sc[2 * kc + 1][2], sc[2 * kc + 1][3])};
                    mma_k_block<BASED_MAX_DIM / 8>(acc, fa, ks, KS, kc, 0, K / 8);
                }
            }
        }
        if (pass == 1) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int i = r0 + gi + 8 * half;
                if (i < rows) {
                    const long long at = ((row0 + t0 + i) * heads + h) * K;
#pragma unroll
                    for (int nt = 0; nt < BASED_MAX_DIM / 8; ++nt)
                        if (nt < K / 8) {
                            const int c = nt * 8 + 2 * ti;
                            dq[at + c] += scale * acc[nt][2 * half];
                            dq[at + c + 1] += scale * acc[nt][2 * half + 1];
                        }
                }
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(BASED_TC_THREADS)
based_bwd_window_dkv_tc(const u16* __restrict__ q, const u16* __restrict__ k,
                        const u16* __restrict__ v, const u16* __restrict__ dy, float scale,
                        const float* __restrict__ lse, const float* __restrict__ dsum,
                        float* __restrict__ dk, float* __restrict__ dv, int T_len, int heads,
                        int K, int V, int W) {
    extern __shared__ float smem[];
    const int h = blockIdx.y, b = blockIdx.z;
    const int s_first = blockIdx.x * BASED_TILE;
    const int keys = min(BASED_TILE, T_len - s_first);
    const int KS = K + 8, VS = V + 8;
    u16* ks = reinterpret_cast<u16*>(smem);  // [TILE][KS]: the tile's keys
    u16* vs = ks + BASED_TILE * KS;          // [TILE][VS]: the tile's values
    u16* qs = vs + BASED_TILE * VS;          // [TILE][KS]: the step's queries
    u16* gs = qs + BASED_TILE * KS;          // [TILE][VS]: the step's dy
    float* ls = reinterpret_cast<float*>(gs + BASED_TILE * VS);  // [TILE]: the step's lse
    float* dd = ls + BASED_TILE;                                 // [TILE]: the step's D
    const long long row0 = (long long)b * T_len;
    based_stage(ks, KS, k, row0, s_first, keys, heads, h, K);
    based_stage(vs, VS, v, row0, s_first, keys, heads, h, V);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gi = lane / 4, ti = lane % 4;
    const int r0 = warp * 16;
    const int last = min(T_len - 1, s_first + keys - 1 + W - 1);
    float acc_k[BASED_MAX_DIM / 8][4], acc_v[BASED_MAX_DIM / 8][4];
#pragma unroll
    for (int nt = 0; nt < BASED_MAX_DIM / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_k[nt][e] = acc_v[nt][e] = 0.f;
    for (int q0 = s_first; q0 <= last; q0 += BASED_TILE) {
        const int cols = min(BASED_TILE, last - q0 + 1);
        __syncthreads();  // the previous step's readers of qs, gs, ls and dd are done
        based_stage(qs, KS, q, row0, q0, cols, heads, h, K);
        based_stage(gs, VS, dy, row0, q0, cols, heads, h, V);
        cp_async_commit();
        for (int j = threadIdx.x; j < BASED_TILE; j += BASED_TC_THREADS) {
            const long long at = (row0 + q0 + (j < cols ? j : 0)) * heads + h;
            ls[j] = j < cols ? lse[at] : 0.f;
            dd[j] = j < cols ? dsum[at] : 0.f;
        }
        cp_async_wait<0>();
        __syncthreads();
        float st[BASED_TILE / 8][4], dpt[BASED_TILE / 8][4];
#pragma unroll
        for (int nt = 0; nt < BASED_TILE / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) st[nt][e] = dpt[nt][e] = 0.f;
        mma_rows<BASED_TILE / 8>(st, ks, KS, r0, qs, KS, 0, K / 16);
        mma_rows<BASED_TILE / 8>(dpt, vs, VS, r0, gs, VS, 0, V / 16);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int s = s_first + r0 + gi + 8 * half;
#pragma unroll
            for (int nt = 0; nt < BASED_TILE / 8; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int j = nt * 8 + 2 * ti + e, t = q0 + j;
                    const bool vis = j < cols && s < T_len && s <= t && s > t - W;
                    const float p = vis ? __expf(scale * st[nt][2 * half + e] - ls[j]) : 0.f;
                    // Pᵀ into st, dSᵀ into dpt.
                    dpt[nt][2 * half + e] = vis ? p * (dpt[nt][2 * half + e] - dd[j]) : 0.f;
                    st[nt][2 * half + e] = p;
                }
        }
        // dV += Pᵀ dy and dK += dSᵀ Q; the A fragments for queries 16 kc .. 16 kc + 15.
#pragma unroll
        for (int kc = 0; kc < BASED_TILE / 16; ++kc) {
            const u32 fp[4] = {pack_bf16(st[2 * kc][0], st[2 * kc][1]),
                               pack_bf16(st[2 * kc][2], st[2 * kc][3]),
                               pack_bf16(st[2 * kc + 1][0], st[2 * kc + 1][1]),
                               pack_bf16(st[2 * kc + 1][2], st[2 * kc + 1][3])};
            mma_k_block<BASED_MAX_DIM / 8>(acc_v, fp, gs, VS, kc, 0, V / 8);
            const u32 fs[4] = {pack_bf16(dpt[2 * kc][0], dpt[2 * kc][1]),
                               pack_bf16(dpt[2 * kc][2], dpt[2 * kc][3]),
                               pack_bf16(dpt[2 * kc + 1][0], dpt[2 * kc + 1][1]),
                               pack_bf16(dpt[2 * kc + 1][2], dpt[2 * kc + 1][3])};
            mma_k_block<BASED_MAX_DIM / 8>(acc_k, fs, qs, KS, kc, 0, K / 8);
        }
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int i = r0 + gi + 8 * half;
        if (i < keys) {
            const long long at = (row0 + s_first + i) * heads + h;
#pragma unroll
            for (int nt = 0; nt < BASED_MAX_DIM / 8; ++nt) {
                const int c = nt * 8 + 2 * ti;
                if (nt < K / 8) {
                    dk[at * K + c] += scale * acc_k[nt][2 * half];
                    dk[at * K + c + 1] += scale * acc_k[nt][2 * half + 1];
                }
                if (nt < V / 8) {
                    dv[at * V + c] += acc_v[nt][2 * half];
                    dv[at * V + c + 1] += acc_v[nt][2 * half + 1];
                }
            }
        }
    }
}
