// The gated delta rule's backward (Gated DeltaNet; Yang, Kautz and Hatamizadeh, 2024), version
// 1.1: float32 on CUDA cores (1.1: each thread's items summed side by side in the preparation,
// the state pass and the values kernel, instead of one dependent chain after another), chunked
// like the forward's version 2 (delta.cu), compiled after delta.cu in one module
// (src/sequence_mixers/delta_backward.rs). The host first reruns the forward's gdn_prepare_<t>
// and gdn_state_pass_<t> (float32 scratch: the cumulative log decays g, the
// pseudo-values U, with S_t = gamma_t S_in + sum_{j<=t} exp(g_t - g_j) u_j k_j^T inside a chunk,
// and the state S_in entering each chunk), then launches the four kernels below.
//
// The adjoint (src/sequence_mixers/delta_gradients.rs derives it step by step): with
// Gb_t = dS_t + do_t q_t^T the whole gradient with respect to S_t and G_t = Gb_t k_t (a V-vector),
// dS_{t-1} = a_t (Gb_t - b_t G_t k_t^T). Unrolled over a chunk of l steps (local t = 0..l-1,
// g_t = ln a_0 + ... + ln a_t, D = dS at the chunk's last step, the gradient leaving it):
//   dS_t = exp(g_{l-1} - g_t) D + sum_{i>t} exp(g_i - g_t) (do_i q_i^T - b_i G_i k_i^T),
// so the G_j solve a unit upper-triangular system per chunk,
//   G_j + sum_{i>j} B_ji G_i = exp(g_{l-1} - g_j) D k_j + R_j,
//   B_ji = b_i exp(g_i - g_j) (k_i . k_j),  R_j = sum_{i>=j} exp(g_i - g_j) (q_i . k_j) do_i,
// that is G = W' D^T + G~ with W' = (I + B)^-1 diag(exp(g_{l-1} - g)) K and G~ = (I + B)^-1 R
// (a chunk's own inputs only: kernel 1, every chunk at once), and the gradient entering the chunk
//   dS_in = exp(g_{l-1}) D + sum_j exp(g_j) (do_j q_j^T - b_j G_j k_j^T)
// walks the chunks from the last to the first (kernel 2). With the state entering the chunk S_in
// and D known for every chunk, each chunk then gives its gradients at once (kernels 3 and 4):
//   dv_t = b_t G_t;  db_t = G_t . u'_t with u'_t = v_t - a_t S_{t-1} k_t
//        = v_t - gamma_t S_in k_t - sum_{j<t} exp(g_t - g_j) (k_j . k_t) u_j;
//   dq_t = S_t^T do_t = gamma_t S_in^T do_t + sum_{j<=t} exp(g_t - g_j) (u_j . do_t) k_j;
//   dk_t = b_t Gb_t^T u'_t - b_t a_t S_{t-1}^T G_t
//        = b_t [exp(g_{l-1} - g_t) D^T u'_t + sum_{j>=t} exp(g_j - g_t) (do_j . u'_t) q_j
//               - sum_{j>t} exp(g_j - g_t) b_j (G_j . u'_t) k_j - gamma_t S_in^T G_t
//               - sum_{j<t} exp(g_t - g_j) (u_j . G_t) k_j];
//   da_t = <Gb_t, S_{t-1}> - b_t G_t . (S_{t-1} k_t), with p_i = exp(g_i - g_t) (i >= t) and
//   m_j = exp(g_{t-1} - g_j) (j < t; g_{-1} = 0), every factor at most 1 and no division by a_t:
//   da_t = exp(g_{t-1}) [exp(g_{l-1} - g_t) <D, S_in> + sum_{i>=t} p_i z_i]
//          + exp(g_{l-1} - g_t) sum_{j<t} m_j y_j + sum_{j<t} m_j sum_{i>=t} p_i Y_ij,
//   z_i = do_i . (S_in q_i) - b_i G_i . (S_in k_i),  y_j = u_j . (D k_j),
//   Y_ij = (do_i . u_j) (q_i . k_j) - b_i (G_i . u_j) (k_i . k_j).
// (u_j here is the forward kernels' pseudo-value, b_j times delta_gradients.rs's u_j.) The
// gradient of the initial state is dS_in of the first chunk. The forward floors ln a at -20
// (gdn_log_decays), so these are the gradients at the floored gate.
//
// 1. gdn_bwd_prepare_<t>, a block per (chunk, head, batch entry): B and the decayed q . k in one
//    L x L array (B above the diagonal, exp(g_i - g_j) q_i . k_j on and below), R, then back
//    substitution for [G~ | W'], one thread per column; W' over the forward's W (no longer read),
//    G~ into `gv`.
// 2. gdn_bwd_state_pass_<t>, a block per GDN_ROWS rows of dS, head and batch entry, walking the
//    chunks from the last: D into `dstates`, G = G~ + W' D^T on its rows (over G~), then dS_in.
//    The gradient entering the first chunk is d_initial_state.
// 3. gdn_bwd_values_<t>, a block per (chunk, head, batch entry), the value rows GDN_VS at a time:
//    S_in k_i, S_in q_i and D k_i per row; u' into `uref`; dv, db; z, y and <D, S_in> into
//    `terms`.
// 4. gdn_bwd_keys_<t>, a block per (chunk, head, batch entry): the four L x L products
//    do . u, G . u, u' . do, u' . G and the L x K products S_in^T do, D^T u', S_in^T G summed
//    over the value rows GDN_VS at a time, then dq, dk and da.
//
// Layouts: q, k [B, T, H, K]; v, do [B, T, H, V] (the dtype <t>: f32, or bf16 bits); alpha, beta
// [B, T, H] float32; d_final_state, d_initial_state [B, H, V, K] float32 (has_d_final 0: zeros,
// the pointer not read); dq, dk [B, T, H, K], dv [B, T, H, V], d_alpha, d_beta [B, T, H], all
// float32. Scratch (float32): w (W, then W') [B, H, n_chunks, L, K]; u, gv, uref
// [B, H, n_chunks, L, V]; g [B, H, n_chunks, L]; states, dstates [B, H, n_chunks, V, K];
// terms [B, H, n_chunks, 2L + 1] (z, y, <D, S_in>). Dynamic shared memory, floats (the host:
// delta_backward.rs), L = GDN_CHUNK, KP = K | 1, RP = GDN_ROWS + 1, PP = L + 1, SP = GDN_VS + 1:
//   prepare 3*L*KP + 2*L*V + L*PP + 2*L;  state pass GDN_ROWS*KP + 3*L*KP + 2*L*RP + 2*L;
//   values 2*L*KP + L*PP + 2*GDN_VS*KP + 4*L*SP + 2*L + GDN_THREADS;
//   keys 5*L*PP + max(2*L*KP, 4*L*SP + 2*GDN_VS*KP) + 4*L.
// Offsets into global memory are 64-bit. No headers (NVRTC).

#define GDN_VS 16
#define GDN_PP (GDN_CHUNK + 1)
#define GDN_SP (GDN_VS + 1)
#define GDN_MAX_COLS (GDN_MAX_DIM / 4)
// Items per thread in the backward state pass's two loops (the most a chunk can give).
#define GDN_G_ITEMS (GDN_CHUNK * GDN_ROWS / GDN_THREADS)
#define GDN_D_ITEMS (GDN_ROWS * GDN_MAX_DIM / GDN_THREADS)

// Loads a chunk's l rows of q and k (from step t0 of head h) into qs and ks, [L][KP] floats.
// Every thread calls it; the rows are ready after the caller's next barrier.
template <typename T>
__device__ __forceinline__ void gdn_load_qk(const T* __restrict__ q, const T* __restrict__ k,
                                            float* qs, float* ks, long long t0, int l, int heads,
                                            int h, int K) {
    const int KP = K | 1;
    for (int e = threadIdx.x; e < l * K; e += GDN_THREADS) {
        const int i = e / K, col = e % K;
        const long long at = ((t0 + i) * heads + h) * K + col;
        qs[i * KP + col] = ld(q, at);
        ks[i * KP + col] = ld(k, at);
    }
}

template <typename T>
__device__ void gdn_bwd_prepare(const T* __restrict__ q, const T* __restrict__ k,
                                const T* __restrict__ dout, const float* __restrict__ beta,
                                const float* __restrict__ g_in, float* __restrict__ wp_out,
                                float* __restrict__ gv_out, int T_len, int heads, int K,
                                int V) {
    extern __shared__ float smem[];
    const int c = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int KP = K | 1;
    const long long t0 = (long long)b * T_len + (long long)c * GDN_CHUNK;
    const int l = min(GDN_CHUNK, T_len - c * GDN_CHUNK);
    const long long base = ((long long)b * heads + h) * gridDim.x + c;
    float* qs = smem;                       // [L][KP]
    float* ks = qs + GDN_CHUNK * KP;        // [L][KP]
    float* wp = ks + GDN_CHUNK * KP;        // [L][KP]: diag(exp(g_{l-1} - g)) K, then W'
    float* gt = wp + GDN_CHUNK * KP;        // [L][V]: R, then G~
    float* dos = gt + GDN_CHUNK * V;        // [L][V]
    float* a = dos + GDN_CHUNK * V;         // [L][PP]: B above the diagonal, M on and below
    float* gs = a + GDN_CHUNK * GDN_PP;     // [L]: g
    float* bs = gs + GDN_CHUNK;             // [L]: beta
    gdn_load_qk(q, k, qs, ks, t0, l, heads, h, K);
    for (int e = threadIdx.x; e < l * V; e += GDN_THREADS)
        dos[e] = ld(dout, ((t0 + e / V) * heads + h) * V + e % V);
    for (int i = threadIdx.x; i < l; i += GDN_THREADS) {
        gs[i] = g_in[base * GDN_CHUNK + i];
        bs[i] = beta[(t0 + i) * heads + h];
    }
    __syncthreads();
    const float last = gs[l - 1];
    // Version 1.1: the l (l + 1) / 2 pairs j <= i numbered in rows (pair e: i the largest with
    // i (i + 1) / 2 <= e), four per thread side by side (8 independent dot products).
    const int pairs = l * (l + 1) / 2;
    for (int e0 = threadIdx.x; e0 < pairs; e0 += 4 * GDN_THREADS) {
        int ii[4], jj[4];
        float qk[4], kk[4];
#pragma unroll
        for (int m = 0; m < 4; ++m) {
            const int e = min(e0 + m * GDN_THREADS, pairs - 1);
            int i = (int)((sqrtf(8.f * e + 1.f) - 1.f) * 0.5f);
            while (i * (i + 1) / 2 > e) --i;
            while ((i + 1) * (i + 2) / 2 <= e) ++i;
            ii[m] = i;
            jj[m] = e - i * (i + 1) / 2;
            qk[m] = kk[m] = 0.f;
        }
        for (int col = 0; col < K; ++col) {
#pragma unroll
            for (int m = 0; m < 4; ++m) {
                const float kj = ks[jj[m] * KP + col];
                qk[m] += qs[ii[m] * KP + col] * kj;
                kk[m] += ks[ii[m] * KP + col] * kj;
            }
        }
#pragma unroll
        for (int m = 0; m < 4; ++m) {
            if (e0 + m * GDN_THREADS >= pairs) continue;
            const int i = ii[m], j = jj[m];
            const float decay = expf(gs[i] - gs[j]);
            a[i * GDN_PP + j] = decay * qk[m];
            if (j < i) a[j * GDN_PP + i] = bs[i] * decay * kk[m];
        }
    }
    for (int e = threadIdx.x; e < l * K; e += GDN_THREADS) {
        const int j = e / K, col = e % K;
        wp[j * KP + col] = expf(last - gs[j]) * ks[j * KP + col];
    }
    __syncthreads();
    // R_j = sum_{i >= j} M_ij do_i, four items per thread side by side (their sums start at
    // different i: each term is taken only from its own j on).
    for (int e0 = threadIdx.x; e0 < l * V; e0 += 4 * GDN_THREADS) {
        int jj[4], rr[4];
        float acc[4];
        int first = l;
#pragma unroll
        for (int m = 0; m < 4; ++m) {
            const int e = min(e0 + m * GDN_THREADS, l * V - 1);
            jj[m] = e / V;
            rr[m] = e % V;
            acc[m] = 0.f;
            first = min(first, jj[m]);
        }
        for (int i = first; i < l; ++i) {
#pragma unroll
            for (int m = 0; m < 4; ++m)
                if (i >= jj[m]) acc[m] += a[i * GDN_PP + jj[m]] * dos[i * V + rr[m]];
        }
#pragma unroll
        for (int m = 0; m < 4; ++m)
            if (e0 + m * GDN_THREADS < l * V) gt[jj[m] * V + rr[m]] = acc[m];
    }
    __syncthreads();
    // Back substitution, column col of [G~ | W']: row j minus sum_{i > j} B_ji row i.
    for (int col = threadIdx.x; col < V + K; col += GDN_THREADS) {
        float* x = col < V ? gt + col : wp + (col - V);
        const int stride = col < V ? V : KP;
        for (int j = l - 2; j >= 0; --j) {
            // Four partial sums, so that the multiply-adds do not wait on each other.
            float p0 = x[j * stride], p1 = 0.f, p2 = 0.f, p3 = 0.f;
            int i = j + 1;
            for (; i + 3 < l; i += 4) {
                p0 -= a[j * GDN_PP + i] * x[i * stride];
                p1 -= a[j * GDN_PP + i + 1] * x[(i + 1) * stride];
                p2 -= a[j * GDN_PP + i + 2] * x[(i + 2) * stride];
                p3 -= a[j * GDN_PP + i + 3] * x[(i + 3) * stride];
            }
            for (; i < l; ++i) p0 -= a[j * GDN_PP + i] * x[i * stride];
            x[j * stride] = (p0 + p1) + (p2 + p3);
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < l * K; e += GDN_THREADS)
        wp_out[base * GDN_CHUNK * K + e] = wp[(e / K) * KP + e % K];
    for (int e = threadIdx.x; e < l * V; e += GDN_THREADS) gv_out[base * GDN_CHUNK * V + e] = gt[e];
}

template <typename T>
__device__ void gdn_bwd_state_pass(const T* __restrict__ q, const T* __restrict__ k,
                                   const T* __restrict__ dout, const float* __restrict__ beta,
                                   const float* __restrict__ g_in, const float* __restrict__ wp_in,
                                   float* __restrict__ gv_io, const float* __restrict__ d_final,
                                   int has_d_final, float* __restrict__ dstates,
                                   float* __restrict__ d_initial, int T_len, int heads, int K,
                                   int V, int n_chunks) {
    extern __shared__ float smem[];
    const int r0 = blockIdx.x * GDN_ROWS, h = blockIdx.y, b = blockIdx.z;
    const int rows = min(GDN_ROWS, V - r0);
    const int KP = K | 1, RP = GDN_ROWS + 1;
    const long long bh = (long long)b * heads + h;
    float* d = smem;                        // [ROWS][KP]: this block's rows of dS
    float* wps = d + GDN_ROWS * KP;         // [L][KP]: W'
    float* qs = wps + GDN_CHUNK * KP;       // [L][KP]
    float* ks = qs + GDN_CHUNK * KP;        // [L][KP]
    float* gvs = ks + GDN_CHUNK * KP;       // [L][RP]: G~, then G
    float* dos = gvs + GDN_CHUNK * RP;      // [L][RP]
    float* eg = dos + GDN_CHUNK * RP;       // [L]: exp(g)
    float* bs = eg + GDN_CHUNK;             // [L]: beta
    // Thread e holds the same element of d in every loop over rows * K below.
    for (int e = threadIdx.x; e < rows * K; e += GDN_THREADS)
        d[(e / K) * KP + e % K] = has_d_final ? d_final[(bh * V + r0) * K + e] : 0.f;
    for (int c = n_chunks - 1; c >= 0; --c) {
        const int l = min(GDN_CHUNK, T_len - c * GDN_CHUNK);
        const long long t0 = (long long)b * T_len + (long long)c * GDN_CHUNK;
        const long long base = bh * n_chunks + c;
        for (int e = threadIdx.x; e < rows * K; e += GDN_THREADS)
            dstates[(base * V + r0) * K + e] = d[(e / K) * KP + e % K];
        for (int e = threadIdx.x; e < l * K; e += GDN_THREADS) {
            const int i = e / K, col = e % K;
            const long long at = ((t0 + i) * heads + h) * K + col;
            wps[i * KP + col] = wp_in[base * GDN_CHUNK * K + e];
            qs[i * KP + col] = ld(q, at);
            ks[i * KP + col] = ld(k, at);
        }
        for (int e = threadIdx.x; e < l * rows; e += GDN_THREADS) {
            const int i = e / rows, r = e % rows;
            gvs[i * RP + r] = gv_io[(base * GDN_CHUNK + i) * V + r0 + r];
            dos[i * RP + r] = ld(dout, ((t0 + i) * heads + h) * V + r0 + r);
        }
        for (int i = threadIdx.x; i < l; i += GDN_THREADS) {
            eg[i] = expf(g_in[base * GDN_CHUNK + i]);
            bs[i] = beta[(t0 + i) * heads + h];
        }
        __syncthreads();
        // G = G~ + W' D^T on this block's rows, kept for the gradient kernels. Version 1.1: a
        // thread's GDN_G_ITEMS items (e = thread + m * GDN_THREADS) summed side by side, so
        // that their dot products are independent chains (version 1 ran them one after the
        // other); items past l * rows are computed on clamped indices and not stored.
        {
            float acc[GDN_G_ITEMS];
            int ii[GDN_G_ITEMS], rr[GDN_G_ITEMS];
#pragma unroll
            for (int m = 0; m < GDN_G_ITEMS; ++m) {
                const int e = min((int)threadIdx.x + m * GDN_THREADS, l * rows - 1);
                ii[m] = e / rows;
                rr[m] = e % rows;
                // A clamped item starts from 0: its owner may be writing gvs[e] already.
                acc[m] = (int)threadIdx.x + m * GDN_THREADS < l * rows ? gvs[ii[m] * RP + rr[m]]
                                                                       : 0.f;
            }
            for (int col = 0; col < K; ++col) {
#pragma unroll
                for (int m = 0; m < GDN_G_ITEMS; ++m)
                    acc[m] += wps[ii[m] * KP + col] * d[rr[m] * KP + col];
            }
#pragma unroll
            for (int m = 0; m < GDN_G_ITEMS; ++m) {
                if ((int)threadIdx.x + m * GDN_THREADS < l * rows) {
                    gvs[ii[m] * RP + rr[m]] = acc[m];
                    gv_io[(base * GDN_CHUNK + ii[m]) * V + r0 + rr[m]] = acc[m];
                }
            }
        }
        __syncthreads();
        // dS_in = exp(g_{l-1}) D + sum_j exp(g_j) (do_j q_j^T - b_j G_j k_j^T), the thread's
        // GDN_D_ITEMS elements side by side (each thread reads and writes only its own).
        {
            const float keep = eg[l - 1];
            // The items a thread has for this K (8 at K = 128, 4 at 64): the loop below skips
            // the rest (the test is the same for the whole block).
            const int items = (rows * K + GDN_THREADS - 1) / GDN_THREADS;
            float acc[GDN_D_ITEMS];
            int rr[GDN_D_ITEMS], cc[GDN_D_ITEMS];
#pragma unroll
            for (int m = 0; m < GDN_D_ITEMS; ++m) {
                const int e = min((int)threadIdx.x + m * GDN_THREADS, rows * K - 1);
                rr[m] = e / K;
                cc[m] = e % K;
                acc[m] = keep * d[rr[m] * KP + cc[m]];
            }
            for (int j = 0; j < l; ++j) {
                const float ej = eg[j], bj = eg[j] * bs[j];
#pragma unroll
                for (int m = 0; m < GDN_D_ITEMS; ++m)
                    if (m < items)
                        acc[m] += ej * dos[j * RP + rr[m]] * qs[j * KP + cc[m]] -
                                  bj * gvs[j * RP + rr[m]] * ks[j * KP + cc[m]];
            }
            __syncthreads();  // every thread's clamped reads of d done before any write
#pragma unroll
            for (int m = 0; m < GDN_D_ITEMS; ++m)
                if ((int)threadIdx.x + m * GDN_THREADS < rows * K) d[rr[m] * KP + cc[m]] = acc[m];
        }
        __syncthreads();
    }
    for (int e = threadIdx.x; e < rows * K; e += GDN_THREADS)
        d_initial[(bh * V + r0) * K + e] = d[(e / K) * KP + e % K];
}

// Value rows r0 .. r0 + GDN_VS of a chunk, rows past V as zeros; every thread calls each.
// gdn_load_rows: one float32 scratch array [.., L, V] (chunk offset `base`) into an [L][SP]
// slice; gdn_load_state_rows: one state-like array [.., V, K] into a [VS][KP] slice;
// gdn_load_value_rows: one input [B, T, H, V] of type T into an [L][SP] slice.
__device__ __forceinline__ void gdn_load_rows(const float* __restrict__ src, float* dst,
                                              long long base, int l, int V, int r0) {
    for (int e = threadIdx.x; e < l * GDN_VS; e += GDN_THREADS) {
        const int i = e / GDN_VS, rr = e % GDN_VS, r = r0 + rr;
        dst[i * GDN_SP + rr] = r < V ? src[(base * GDN_CHUNK + i) * V + r] : 0.f;
    }
}
__device__ __forceinline__ void gdn_load_state_rows(const float* __restrict__ src, float* dst,
                                                    long long base, int K, int V, int r0) {
    const int KP = K | 1;
    for (int e = threadIdx.x; e < GDN_VS * K; e += GDN_THREADS) {
        const int rr = e / K, col = e % K, r = r0 + rr;
        dst[rr * KP + col] = r < V ? src[(base * V + r) * K + col] : 0.f;
    }
}
template <typename T>
__device__ __forceinline__ void gdn_load_value_rows(const T* __restrict__ src, float* dst,
                                                    long long t0, int l, int heads, int h, int V,
                                                    int r0) {
    for (int e = threadIdx.x; e < l * GDN_VS; e += GDN_THREADS) {
        const int i = e / GDN_VS, rr = e % GDN_VS, r = r0 + rr;
        dst[i * GDN_SP + rr] = r < V ? ld(src, ((t0 + i) * heads + h) * V + r) : 0.f;
    }
}

template <typename T>
__device__ void gdn_bwd_values(const T* __restrict__ q, const T* __restrict__ k,
                               const T* __restrict__ v, const T* __restrict__ dout,
                               const float* __restrict__ beta, const float* __restrict__ g_in,
                               const float* __restrict__ u_in, const float* __restrict__ states,
                               const float* __restrict__ dstates, const float* __restrict__ gv,
                               float* __restrict__ dv, float* __restrict__ d_beta,
                               float* __restrict__ uref, float* __restrict__ terms, int T_len,
                               int heads, int K, int V) {
    extern __shared__ float smem[];
    const int c = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int KP = K | 1;
    const long long t0 = (long long)b * T_len + (long long)c * GDN_CHUNK;
    const int l = min(GDN_CHUNK, T_len - c * GDN_CHUNK);
    const long long base = ((long long)b * heads + h) * gridDim.x + c;
    float* qs = smem;                       // [L][KP]
    float* ks = qs + GDN_CHUNK * KP;        // [L][KP]
    float* kk = ks + GDN_CHUNK * KP;        // [L][PP]: exp(g_i - g_j) k_i . k_j, j < i
    float* se = kk + GDN_CHUNK * GDN_PP;    // [VS][KP]: rows of S_in
    float* ds = se + GDN_VS * KP;           // [VS][KP]: rows of D
    float* us = ds + GDN_VS * KP;           // [L][SP]: u
    float* gvs = us + GDN_CHUNK * GDN_SP;   // [L][SP]: G
    float* vs = gvs + GDN_CHUNK * GDN_SP;   // [L][SP]: v
    float* dos = vs + GDN_CHUNK * GDN_SP;   // [L][SP]: do
    float* eg = dos + GDN_CHUNK * GDN_SP;   // [L]: exp(g)
    float* bs = eg + GDN_CHUNK;             // [L]: beta
    float* red = bs + GDN_CHUNK;            // [THREADS]: <D, S_in> partial sums
    gdn_load_qk(q, k, qs, ks, t0, l, heads, h, K);
    for (int i = threadIdx.x; i < l; i += GDN_THREADS) {
        eg[i] = g_in[base * GDN_CHUNK + i];  // g for now, exp(g) after the next barrier
        bs[i] = beta[(t0 + i) * heads + h];
    }
    __syncthreads();
    for (int e = threadIdx.x; e < l * l; e += GDN_THREADS) {
        const int i = e / l, j = e % l;
        if (j < i) {
            float dot = 0.f;
            for (int col = 0; col < K; ++col) dot += ks[i * KP + col] * ks[j * KP + col];
            kk[i * GDN_PP + j] = expf(eg[i] - eg[j]) * dot;
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < l; i += GDN_THREADS) eg[i] = expf(eg[i]);
    // Thread (step i, rows rq + 4 m of each slice): its four rows' sums in registers, the four
    // threads of a step summed by shuffles at the end.
    const int i = threadIdx.x >> 2, rq = threadIdx.x & 3;
    float z = 0.f, y = 0.f, dbeta = 0.f, inner = 0.f;
    for (int r0 = 0; r0 < V; r0 += GDN_VS) {
        __syncthreads();
        gdn_load_state_rows(states, se, base, K, V, r0);
        gdn_load_state_rows(dstates, ds, base, K, V, r0);
        gdn_load_rows(u_in, us, base, l, V, r0);
        gdn_load_rows(gv, gvs, base, l, V, r0);
        gdn_load_value_rows(v, vs, t0, l, heads, h, V, r0);
        gdn_load_value_rows(dout, dos, t0, l, heads, h, V, r0);
        __syncthreads();
        for (int e = threadIdx.x; e < GDN_VS * K; e += GDN_THREADS)
            inner += ds[(e / K) * KP + e % K] * se[(e / K) * KP + e % K];
        if (i < l) {
            // Version 1.1: the four rows' dot products side by side (12 independent sums per
            // column), then their u' sums likewise; rows past V computed on zeros, not stored.
            float sk[GDN_VS / 4], sq[GDN_VS / 4], dk[GDN_VS / 4], ur[GDN_VS / 4];
#pragma unroll
            for (int m = 0; m < GDN_VS / 4; ++m) sk[m] = sq[m] = dk[m] = 0.f;
            for (int col = 0; col < K; ++col) {
                const float kc = ks[i * KP + col], qc = qs[i * KP + col];
#pragma unroll
                for (int m = 0; m < GDN_VS / 4; ++m) {
                    const int rr = rq + 4 * m;
                    const float sv = se[rr * KP + col];
                    sk[m] += sv * kc;
                    sq[m] += sv * qc;
                    dk[m] += ds[rr * KP + col] * kc;
                }
            }
#pragma unroll
            for (int m = 0; m < GDN_VS / 4; ++m) ur[m] = vs[i * GDN_SP + rq + 4 * m] - eg[i] * sk[m];
            for (int j = 0; j < i; ++j) {
                const float w = kk[i * GDN_PP + j];
#pragma unroll
                for (int m = 0; m < GDN_VS / 4; ++m) ur[m] -= w * us[j * GDN_SP + rq + 4 * m];
            }
#pragma unroll
            for (int m = 0; m < GDN_VS / 4; ++m) {
                const int rr = rq + 4 * m, r = r0 + rr;
                if (r >= V) continue;
                const float G = gvs[i * GDN_SP + rr];
                dbeta += G * ur[m];
                z += dos[i * GDN_SP + rr] * sq[m] - bs[i] * G * sk[m];
                y += us[i * GDN_SP + rr] * dk[m];
                uref[(base * GDN_CHUNK + i) * V + r] = ur[m];
                dv[((t0 + i) * heads + h) * V + r] = bs[i] * G;
            }
        }
    }
    for (int mask = 1; mask <= 2; mask <<= 1) {
        z += __shfl_xor_sync(0xffffffffu, z, mask);
        y += __shfl_xor_sync(0xffffffffu, y, mask);
        dbeta += __shfl_xor_sync(0xffffffffu, dbeta, mask);
    }
    red[threadIdx.x] = inner;
    if (i < l && rq == 0) {
        terms[base * (2 * GDN_CHUNK + 1) + i] = z;
        terms[base * (2 * GDN_CHUNK + 1) + GDN_CHUNK + i] = y;
        d_beta[(t0 + i) * heads + h] = dbeta;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float sum = 0.f;
        for (int e = 0; e < GDN_THREADS; ++e) sum += red[e];
        terms[base * (2 * GDN_CHUNK + 1) + 2 * GDN_CHUNK] = sum;
    }
}

template <typename T>
__device__ void gdn_bwd_keys(const T* __restrict__ q, const T* __restrict__ k,
                             const T* __restrict__ dout, const float* __restrict__ beta,
                             const float* __restrict__ g_in, const float* __restrict__ u_in,
                             const float* __restrict__ states, const float* __restrict__ dstates,
                             const float* __restrict__ gv, const float* __restrict__ uref,
                             const float* __restrict__ terms, float* __restrict__ dq,
                             float* __restrict__ dk, float* __restrict__ d_alpha, int T_len,
                             int heads, int K, int V) {
    extern __shared__ float smem[];
    const int c = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int KP = K | 1;
    const long long t0 = (long long)b * T_len + (long long)c * GDN_CHUNK;
    const int l = min(GDN_CHUNK, T_len - c * GDN_CHUNK);
    const long long base = ((long long)b * heads + h) * gridDim.x + c;
    float* p1 = smem;                       // [L][PP]: do_i . u_j, j <= i
    float* p2 = p1 + GDN_CHUNK * GDN_PP;    // [L][PP]: G_i . u_j, j < i
    float* p3 = p2 + GDN_CHUNK * GDN_PP;    // [L][PP]: u'_i . do_j, j >= i
    float* p4 = p3 + GDN_CHUNK * GDN_PP;    // [L][PP]: u'_i . G_j, j > i
    float* yy = p4 + GDN_CHUNK * GDN_PP;    // [L][PP]: Y_ij, j < i
    float* region = yy + GDN_CHUNK * GDN_PP;
    // The slices (loop over the value rows), then q and k over them.
    float* us = region;                     // [L][SP]: u
    float* dos = us + GDN_CHUNK * GDN_SP;   // [L][SP]: do
    float* gvs = dos + GDN_CHUNK * GDN_SP;  // [L][SP]: G
    float* urs = gvs + GDN_CHUNK * GDN_SP;  // [L][SP]: u'
    float* se = urs + GDN_CHUNK * GDN_SP;   // [VS][KP]: rows of S_in
    float* ds = se + GDN_VS * KP;           // [VS][KP]: rows of D
    float* qs = region;                     // [L][KP]
    float* ks = qs + GDN_CHUNK * KP;        // [L][KP]
    const int region_floats = max(2 * GDN_CHUNK * KP, 4 * GDN_CHUNK * GDN_SP + 2 * GDN_VS * KP);
    float* gs = region + region_floats;     // [L]: g
    float* eg = gs + GDN_CHUNK;             // [L]: exp(g)
    float* bs = eg + GDN_CHUNK;             // [L]: beta
    float* tz = bs + GDN_CHUNK;             // [L]: z
    for (int e = threadIdx.x; e < GDN_CHUNK * GDN_PP; e += GDN_THREADS)
        p1[e] = p2[e] = p3[e] = p4[e] = 0.f;
    for (int i = threadIdx.x; i < l; i += GDN_THREADS) {
        gs[i] = g_in[base * GDN_CHUNK + i];
        eg[i] = expf(gs[i]);
        bs[i] = beta[(t0 + i) * heads + h];
        tz[i] = terms[base * (2 * GDN_CHUNK + 1) + i];
    }
    // Thread (step i, columns cq + 4 m): S_in^T do_i and exp(g_{l-1} - g_i) D^T u'_i -
    // gamma_i S_in^T G_i in registers.
    const int i = threadIdx.x >> 2, cq = threadIdx.x & 3;
    float aq[GDN_MAX_COLS], ak[GDN_MAX_COLS];
#pragma unroll
    for (int m = 0; m < GDN_MAX_COLS; ++m) aq[m] = ak[m] = 0.f;
    for (int r0 = 0; r0 < V; r0 += GDN_VS) {
        __syncthreads();
        gdn_load_rows(u_in, us, base, l, V, r0);
        gdn_load_rows(gv, gvs, base, l, V, r0);
        gdn_load_rows(uref, urs, base, l, V, r0);
        gdn_load_value_rows(dout, dos, t0, l, heads, h, V, r0);
        gdn_load_state_rows(states, se, base, K, V, r0);
        gdn_load_state_rows(dstates, ds, base, K, V, r0);
        __syncthreads();
        for (int e = threadIdx.x; e < l * l; e += GDN_THREADS) {
            const int a = e / l, j = e % l;
            float s1 = 0.f, s2 = 0.f, s3 = 0.f, s4 = 0.f;
#pragma unroll
            for (int rr = 0; rr < GDN_VS; ++rr) {
                s1 += dos[a * GDN_SP + rr] * us[j * GDN_SP + rr];
                s2 += gvs[a * GDN_SP + rr] * us[j * GDN_SP + rr];
                s3 += urs[a * GDN_SP + rr] * dos[j * GDN_SP + rr];
                s4 += urs[a * GDN_SP + rr] * gvs[j * GDN_SP + rr];
            }
            if (j <= a) p1[a * GDN_PP + j] += s1;
            if (j < a) p2[a * GDN_PP + j] += s2;
            if (j >= a) p3[a * GDN_PP + j] += s3;
            if (j > a) p4[a * GDN_PP + j] += s4;
        }
        if (i < l) {
            const float tail = expf(gs[l - 1] - gs[i]);
            for (int rr = 0; rr < GDN_VS; ++rr) {
                const float fd = dos[i * GDN_SP + rr], fu = tail * urs[i * GDN_SP + rr];
                const float fg = eg[i] * gvs[i * GDN_SP + rr];
#pragma unroll
                for (int m = 0; m < GDN_MAX_COLS; ++m) {
                    const int col = cq + 4 * m;
                    if (col < K) {
                        const float s = se[rr * KP + col];
                        aq[m] += fd * s;
                        ak[m] += fu * ds[rr * KP + col] - fg * s;
                    }
                }
            }
        }
    }
    __syncthreads();
    gdn_load_qk(q, k, qs, ks, t0, l, heads, h, K);
    __syncthreads();
    // Y from the raw products, then the products decayed for dq and dk.
    for (int e = threadIdx.x; e < l * l; e += GDN_THREADS) {
        const int a = e / l, j = e % l;
        if (j < a) {
            float qk = 0.f, kk = 0.f;
            for (int col = 0; col < K; ++col) {
                qk += qs[a * KP + col] * ks[j * KP + col];
                kk += ks[a * KP + col] * ks[j * KP + col];
            }
            yy[a * GDN_PP + j] = p1[a * GDN_PP + j] * qk - bs[a] * p2[a * GDN_PP + j] * kk;
        }
        if (j <= a) {
            const float decay = expf(gs[a] - gs[j]);
            p1[a * GDN_PP + j] *= decay;
            p2[a * GDN_PP + j] *= decay;
        }
        if (j >= a) {
            const float decay = expf(gs[j] - gs[a]);
            p3[a * GDN_PP + j] *= decay;
            p4[a * GDN_PP + j] *= decay * bs[j];
        }
    }
    __syncthreads();
    if (i < l) {
        // dq_i = gamma_i S_in^T do_i + sum_{j <= i} exp(g_i - g_j) (u_j . do_i) k_j.
#pragma unroll
        for (int m = 0; m < GDN_MAX_COLS; ++m) aq[m] *= eg[i];
        for (int j = 0; j <= i; ++j) {
            const float p = p1[i * GDN_PP + j];
#pragma unroll
            for (int m = 0; m < GDN_MAX_COLS; ++m) {
                const int col = cq + 4 * m;
                if (col < K) aq[m] += p * ks[j * KP + col];
            }
        }
        // dk_i / b_i = the register sum + sum_{j >= i} p3 q_j - sum_{j > i} p4 k_j
        //              - sum_{j < i} p2 k_j (p3, p4 and p2 decayed, p4 times b_j).
        for (int j = 0; j < l; ++j) {
            const float pq = j >= i ? p3[i * GDN_PP + j] : 0.f;
            const float pk = j > i ? p4[i * GDN_PP + j] : (j < i ? p2[i * GDN_PP + j] : 0.f);
#pragma unroll
            for (int m = 0; m < GDN_MAX_COLS; ++m) {
                const int col = cq + 4 * m;
                if (col < K) ak[m] += pq * qs[j * KP + col] - pk * ks[j * KP + col];
            }
        }
#pragma unroll
        for (int m = 0; m < GDN_MAX_COLS; ++m) {
            const int col = cq + 4 * m;
            if (col < K) {
                const long long at = ((t0 + i) * heads + h) * K + col;
                dq[at] = aq[m];
                dk[at] = bs[i] * ak[m];
            }
        }
    }
    __syncthreads();
    // da_t, one thread per step; m_j = exp(g_{t-1} - g_j) in row t of p3 (no longer read).
    if (threadIdx.x < l) {
        const int t = threadIdx.x;
        const float prev = t > 0 ? gs[t - 1] : 0.f;
        const float tail = expf(gs[l - 1] - gs[t]);
        const float* tm = terms + base * (2 * GDN_CHUNK + 1);
        float* mj = p3 + t * GDN_PP;
        float sy = 0.f;
        for (int j = 0; j < t; ++j) {
            mj[j] = expf(prev - gs[j]);
            sy += mj[j] * tm[GDN_CHUNK + j];
        }
        float sz = 0.f, sY = 0.f;
        for (int a = t; a < l; ++a) {
            const float p = expf(gs[a] - gs[t]);
            sz += p * tz[a];
            float row = 0.f;
            for (int j = 0; j < t; ++j) row += mj[j] * yy[a * GDN_PP + j];
            sY += p * row;
        }
        d_alpha[(t0 + t) * heads + h] =
            expf(prev) * (tail * tm[2 * GDN_CHUNK] + sz) + tail * sy + sY;
    }
}

#define GDN_BWD_ENTRIES(NAME, T)                                                               \
    extern "C" __global__ void __launch_bounds__(GDN_THREADS)                                  \
    gdn_bwd_prepare_##NAME(const T* q, const T* k, const T* dout, const float* beta,          \
                           const float* g, float* wp, float* gv, int T_len, int heads, int K,  \
                           int V) {                                                            \
        gdn_bwd_prepare<T>(q, k, dout, beta, g, wp, gv, T_len, heads, K, V);                   \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(GDN_THREADS)                                  \
    gdn_bwd_state_pass_##NAME(const T* q, const T* k, const T* dout, const float* beta,       \
                              const float* g, const float* wp, float* gv,                      \
                              const float* d_final, int has_d_final, float* dstates,           \
                              float* d_initial, int T_len, int heads, int K, int V,            \
                              int n_chunks) {                                                  \
        gdn_bwd_state_pass<T>(q, k, dout, beta, g, wp, gv, d_final, has_d_final, dstates,      \
                              d_initial, T_len, heads, K, V, n_chunks);                        \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(GDN_THREADS)                                  \
    gdn_bwd_values_##NAME(const T* q, const T* k, const T* v, const T* dout,                  \
                          const float* beta, const float* g, const float* u,                   \
                          const float* states, const float* dstates, const float* gv,          \
                          float* dv, float* d_beta, float* uref, float* terms, int T_len,      \
                          int heads, int K, int V) {                                           \
        gdn_bwd_values<T>(q, k, v, dout, beta, g, u, states, dstates, gv, dv, d_beta, uref,    \
                          terms, T_len, heads, K, V);                                          \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(GDN_THREADS)                                  \
    gdn_bwd_keys_##NAME(const T* q, const T* k, const T* dout, const float* beta,             \
                        const float* g, const float* u, const float* states,                   \
                        const float* dstates, const float* gv, const float* uref,              \
                        const float* terms, float* dq, float* dk, float* d_alpha, int T_len,   \
                        int heads, int K, int V) {                                             \
        gdn_bwd_keys<T>(q, k, dout, beta, g, u, states, dstates, gv, uref, terms, dq, dk,      \
                        d_alpha, T_len, heads, K, V);                                          \
    }

GDN_BWD_ENTRIES(f32, float)
GDN_BWD_ENTRIES(bf16, u16)
