// SSD's backward (version 1: float32 on CUDA cores), compiled after ssd.cu in one module
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
// where dl_t = dL/d(dt_t A) is the suffix sum over the whole sequence of
//   dcum_t = C_t . (S_t^T dy_t) - dt_t x_t . u_t   (+ <d_final, S_T> from every step),
// the gradient of the cumulative log decay at t: it enters every y_t' and the final state
// through exp(cum_t' - cum_s) with s <= t <= t' (the first term: all of S_t C_t decays through
// step t), and leaves through the input it scales (the second).
//
// Kernels, in launch order after the forward's ssd_chunk_state_<t> and ssd_state_passing:
// 3. ssd_bwd_chunk_adjoint_<t>   (chunk, head, batch): Q_c into adj.
// 4. ssd_bwd_state_passing       (head, batch, slice): adj[c] = R_c, d_initial = R_{-1}.
// 5. ssd_bwd_dx_<t>              (chunk, head, batch): dx, and per step x . u and dy . x.
// 6. ssd_bwd_db_<t>, ssd_bwd_dc_<t> (chunk, head, batch): dB and dC per head (summed over
//    the group by kernel 8), and per step C . (S^T dy).
// 7. ssd_bwd_ddt                 (head, batch): the suffix sums dl, ddt, and per (b, h) the
//    parts of dA and dD.
// 8. ssd_bwd_sum                 (elements): dB and dC over the group's heads; dA and dD over
//    the batch. Every sum is in a fixed order: the gradients are the same bits on every run.
// Layouts: those of ssd.cu; dy [B, T, H, P] of type <t>; gradients float32: dx [B, T, H, P],
// ddt [B, T, H], dA, dD [H], dB, dC [B, T, G, N], d_initial [B, H, P, N]; scratch float32:
// adj [B, H, n_chunks, P, N], per step xu, dyx, cdc [B, T, H], per head dBh, dCh [B, T, H, N],
// per (b, h) pa, pd [B, H]. Dynamic shared memory (floats; the host computes it,
// src/sequence_mixers/ssd_backward.rs): kernel 3 as ssd.cu's kernel 1; kernel 5
// L*N + L*(N|1) + L*P + P*(N|1) + L*L + L; kernel 6 2*L*(P|1) + L*L + L*N + P*N + 2*L.

#define SSD_WARPS (SSD_THREADS / 32)

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Kernel 3: Q_c = sum_s exp(cum_s) dy_s C_s^T, the chunk's own part of the adjoint it passes
// to the chunk before it.
template <typename T>
__device__ void chunk_adjoint(const T* __restrict__ dy, const float* __restrict__ dt,
                              const float* __restrict__ A, const T* __restrict__ Cm,
                              float* __restrict__ adj, int T_len, int heads, int groups, int P,
                              int N) {
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
    for (int e = threadIdx.x; e < l * P; e += SSD_THREADS) dys[e] *= __expf(cum[e / P]);
    __syncthreads();
    float* out = adj + (((long long)b * heads + h) * n_chunks + c) * P * N;
    for (int e = threadIdx.x; e < P * N; e += SSD_THREADS) {
        const int p = e / N, n = e % N;
        float acc = 0.f;
        for (int j = 0; j < l; ++j) acc += dys[j * P + p] * cs_[j * N + n];
        out[e] = acc;
    }
}

// Kernel 4: the adjoints passed from the last chunk back to the first (ssd_state_passing run
// in reverse): on entry adj[c] holds Q_c, on exit R_c; d_initial gets R_{-1}.
extern "C" __global__ void __launch_bounds__(SSD_THREADS)
ssd_bwd_state_passing(float* __restrict__ adj, const float* __restrict__ chunk_log_decay,
                      const float* __restrict__ d_final, int has_d_final,
                      float* __restrict__ d_initial, int heads, int n_chunks, int P, int N) {
    const int h = blockIdx.x, b = blockIdx.y;
    const long long bh = (long long)b * heads + h;
    float* s = adj + bh * n_chunks * P * N;
    const float* decay = chunk_log_decay + bh * n_chunks;
    for (int e = blockIdx.z * SSD_THREADS + threadIdx.x; e < P * N; e += SSD_THREADS * gridDim.z) {
        float running = has_d_final ? d_final[bh * P * N + e] : 0.f;
        for (int k0 = 0; k0 < n_chunks; k0 += SSD_PASS_AHEAD) {
            float local[SSD_PASS_AHEAD], keep[SSD_PASS_AHEAD];
#pragma unroll
            for (int k = 0; k < SSD_PASS_AHEAD; ++k) {
                const int c = n_chunks - 1 - (k0 + k);
                local[k] = c >= 0 ? s[(long long)c * P * N + e] : 0.f;
                keep[k] = c >= 0 ? __expf(decay[c]) : 0.f;
            }
#pragma unroll
            for (int k = 0; k < SSD_PASS_AHEAD; ++k) {
                const int c = n_chunks - 1 - (k0 + k);
                if (c >= 0) {
                    s[(long long)c * P * N + e] = running;
                    running = keep[k] * running + local[k];
                }
            }
        }
        d_initial[bh * P * N + e] = running;
    }
}

// Kernel 5: u_t = S^_t B_t from the chunk's C, B, dy and R_c; dx_t = dt_t u_t + D dy_t; per
// step x_t . u_t into xu and dy_t . x_t into dyx. A warp per step t, its lanes over p.
template <typename T>
__device__ void bwd_dx(const T* __restrict__ x, const float* __restrict__ dt,
                       const float* __restrict__ A, const T* __restrict__ Bm,
                       const T* __restrict__ Cm, const float* __restrict__ D, int has_d,
                       const T* __restrict__ dy, const float* __restrict__ adj,
                       float* __restrict__ dx, float* __restrict__ xu, float* __restrict__ dyx,
                       int T_len, int heads, int groups, int P, int N) {
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
    chunk_cumsum(dt, A[h], t0, l, heads, h, cum);
    for (int e = threadIdx.x; e < l * N; e += SSD_THREADS) {
        const int i = e / N, n = e % N;
        const long long at = ((t0 + i) * groups + g) * N + n;
        cs_[e] = ld(Cm, at);
        bs[i * NP + n] = ld(Bm, at);
    }
    for (int e = threadIdx.x; e < l * P; e += SSD_THREADS)
        dys[e] = ld(dy, ((t0 + e / P) * heads + h) * P + e % P);
    const float* src = adj + (((long long)b * heads + h) * n_chunks + c) * P * N;
    for (int e = threadIdx.x; e < P * N; e += SSD_THREADS) r[(e / N) * NP + e % N] = src[e];
    __syncthreads();
    for (int e = threadIdx.x; e < l * l; e += SSD_THREADS) {
        const int s = e / l, t = e % l;
        float v = 0.f;
        if (s >= t) {
            for (int n = 0; n < N; ++n) v += cs_[s * N + n] * bs[t * NP + n];
            v *= __expf(cum[s] - cum[t]);
        }
        m[s * SSD_CHUNK + t] = v;
    }
    __syncthreads();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const float skip = has_d ? D[h] : 0.f;
    const float last = cum[l - 1];
    for (int t = warp; t < l; t += SSD_WARPS) {
        const float step = dt[(t0 + t) * heads + h];
        const float carry = __expf(last - cum[t]);
        float part_xu = 0.f, part_dyx = 0.f;
        for (int p = lane; p < P; p += 32) {
            float acc = 0.f;
            for (int s = t; s < l; ++s) acc += m[s * SSD_CHUNK + t] * dys[s * P + p];
            float rb = 0.f;
            for (int n = 0; n < N; ++n) rb += r[p * NP + n] * bs[t * NP + n];
            const float u = acc + carry * rb;
            const long long at = ((t0 + t) * heads + h) * P + p;
            const float xv = ld(x, at), g_y = dys[t * P + p];
            dx[at] = step * u + skip * g_y;
            part_xu += xv * u;
            part_dyx += g_y * xv;
        }
        part_xu = warp_sum(part_xu);
        part_dyx = warp_sum(part_dyx);
        if (lane == 0) {
            xu[(t0 + t) * heads + h] = part_xu;
            dyx[(t0 + t) * heads + h] = part_dyx;
        }
    }
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
                        const T* __restrict__ Cm, const T* __restrict__ dy,
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
        dys[i * PP + p] = ld(dy, at);
        xs[i * PP + p] = ld(x, at);
    }
    const float* src = mats + (((long long)b * heads + h) * n_chunks + c) * P * N;
    for (int e = threadIdx.x; e < P * N; e += SSD_THREADS) ms[e] = src[e];
    __syncthreads();
    for (int e = threadIdx.x; e < l * N; e += SSD_THREADS) {
        const float v = ld(Z, ((t0 + e / N) * groups + g) * N + e % N);
        zs[e] = FOR_C ? v * dts[e / N] : v;
    }
    for (int e = threadIdx.x; e < l * l; e += SSD_THREADS) {
        const int i = e / l, j = e % l;
        float v = 0.f;
        if (j <= i)
            for (int p = 0; p < P; ++p) v += dys[i * PP + p] * xs[j * PP + p];
        gm[i * SSD_CHUNK + j] = v;
    }
    __syncthreads();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const float last = cum[l - 1];
    const float* v_row = FOR_C ? dys : xs;
    for (int t = warp; t < l; t += SSD_WARPS) {
        const float carry = FOR_C ? __expf(cum[t]) : __expf(last - cum[t]);
        float part = 0.f;
        for (int n = lane; n < N; n += 32) {
            float acc = 0.f;
            if (FOR_C) {
                for (int s = 0; s <= t; ++s)
                    acc += __expf(cum[t] - cum[s]) * gm[t * SSD_CHUNK + s] * zs[s * N + n];
            } else {
                for (int s = t; s < l; ++s)
                    acc += __expf(cum[s] - cum[t]) * gm[s * SSD_CHUNK + t] * zs[s * N + n];
            }
            float mv = 0.f;
            for (int p = 0; p < P; ++p) mv += ms[p * N + n] * v_row[t * PP + p];
            float v = acc + carry * mv;
            if (!FOR_C) v *= dts[t];
            out[((t0 + t) * heads + h) * N + n] = v;
            if (FOR_C) part += ld(Cm, ((t0 + t) * groups + g) * N + n) * v;
        }
        if (FOR_C) {
            part = warp_sum(part);
            if (lane == 0) cdc[(t0 + t) * heads + h] = part;
        }
    }
}

// Kernel 7: per (head, batch entry), the suffix sums dl_t of dcum_t = cdc_t - dt_t xu_t plus
// <d_final, S_T> over the whole sequence; ddt_t = A dl_t + xu_t; the parts of dA
// (sum dt_t dl_t) and dD (sum dyx_t) into pa and pd [B, H]. Each thread walks a contiguous
// segment of the steps; the segments' sums are added in a fixed order. Dynamic shared memory:
// SSD_THREADS + 2 * SSD_WARPS floats.
extern "C" __global__ void __launch_bounds__(SSD_THREADS)
ssd_bwd_ddt(const float* __restrict__ dt, const float* __restrict__ A,
            const float* __restrict__ xu, const float* __restrict__ dyx,
            const float* __restrict__ cdc, const float* __restrict__ d_final, int has_d_final,
            const float* __restrict__ final_state, float* __restrict__ ddt,
            float* __restrict__ pa, float* __restrict__ pd, int T_len, int heads, int P, int N) {
    extern __shared__ float smem[];
    float* seg_sum = smem;                 // [SSD_THREADS]
    float* red = seg_sum + SSD_THREADS;    // [2][SSD_WARPS]
    const int h = blockIdx.x, b = blockIdx.y;
    const long long bh = (long long)b * heads + h;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    // <d_final, S_T>: every step's dl carries it.
    float base = 0.f;
    if (has_d_final) {
        float part = 0.f;
        for (int e = threadIdx.x; e < P * N; e += SSD_THREADS)
            part += d_final[bh * P * N + e] * final_state[bh * P * N + e];
        part = warp_sum(part);
        if (lane == 0) red[warp] = part;
        __syncthreads();
        for (int w = 0; w < SSD_WARPS; ++w) base += red[w];
        __syncthreads();
    }
    const float a = A[h];
    const int seg = (T_len + SSD_THREADS - 1) / SSD_THREADS;
    const int lo = min(T_len, (int)threadIdx.x * seg), hi = min(T_len, lo + seg);
    auto at = [&](int t) { return ((long long)b * T_len + t) * heads + h; };
    float own = 0.f;
    for (int t = lo; t < hi; ++t) own += cdc[at(t)] - dt[at(t)] * xu[at(t)];
    seg_sum[threadIdx.x] = own;
    __syncthreads();
    float run = base;
    for (int k = SSD_THREADS - 1; k > (int)threadIdx.x; --k) run += seg_sum[k];
    float part_a = 0.f, part_d = 0.f;
    for (int t = hi - 1; t >= lo; --t) {
        const long long i = at(t);
        const float u = xu[i], step = dt[i];
        run += cdc[i] - step * u;
        ddt[i] = a * run + u;
        part_a += step * run;
        part_d += dyx[i];
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
    ssd_bwd_chunk_adjoint_##NAME(const T* dy, const float* dt, const float* A, const T* Cm,   \
                                 float* adj, int T_len, int heads, int groups, int P, int N) { \
        chunk_adjoint<T>(dy, dt, A, Cm, adj, T_len, heads, groups, P, N);                      \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(SSD_THREADS)                                  \
    ssd_bwd_dx_##NAME(const T* x, const float* dt, const float* A, const T* Bm, const T* Cm,  \
                      const float* D, int has_d, const T* dy, const float* adj, float* dx,     \
                      float* xu, float* dyx, int T_len, int heads, int groups, int P, int N) { \
        bwd_dx<T>(x, dt, A, Bm, Cm, D, has_d, dy, adj, dx, xu, dyx, T_len, heads, groups, P,   \
                  N);                                                                          \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(SSD_THREADS)                                  \
    ssd_bwd_db_##NAME(const T* x, const float* dt, const float* A, const T* Cm, const T* dy,  \
                      const float* adj, float* dbh, int T_len, int heads, int groups, int P,   \
                      int N) {                                                                 \
        bwd_dbc<T, false>(x, dt, A, Cm, Cm, dy, adj, dbh, (float*)0, T_len, heads, groups, P,  \
                          N);                                                                  \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(SSD_THREADS)                                  \
    ssd_bwd_dc_##NAME(const T* x, const float* dt, const float* A, const T* Bm, const T* Cm,  \
                      const T* dy, const float* states, float* dch, float* cdc, int T_len,     \
                      int heads, int groups, int P, int N) {                                   \
        bwd_dbc<T, true>(x, dt, A, Bm, Cm, dy, states, dch, cdc, T_len, heads, groups, P, N);  \
    }

SSD_BWD_ENTRIES(f32, float)
SSD_BWD_ENTRIES(bf16, u16)
