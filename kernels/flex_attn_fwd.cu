// Attention forward with generated masks and score modifications (the flex_attention
// interface: He, Guessous, Liang, Zhang and others, "FlexAttention", 2024), written for this
// project on the FlashAttention-2 forward of flash_attn_fwd.cu. The host prepends
// attn_prelude.cuh and the two generated functions (src/attention/flex.rs):
//
//   bool  kp_mask(int b, int h, int q_idx, int kv_idx, int num_heads, int seq_len_q,
//                 int seq_len_kv, const int* aux);
//   float kp_score(float score, int b, int h, int q_idx, int kv_idx, int num_heads,
//                  int seq_len_q, int seq_len_kv, const int* aux);
//
// O = softmax(score_mod(Q K^T * scale) masked by mask_mod) V for Q [B, H, Tq, D], K/V
// [B, KVH, Tkv, D] (16-bit), O [B, H, Tq, D], LSE [B, H, Tq] fp32 natural log (+inf for a row
// that sees no key; its O is 0). Key j of batch entry b also needs j < kv_lens[b].
//
// flex_block_mask: one CTA of 128 threads per (query tile, head, batch entry) evaluates
// kp_mask over every (row, key) pair of every key tile (rows < Tq, keys < kv_lens[b]) and
// writes the tile list of that query tile: kv_count[b][h][qt] tiles, their indices in
// kv_index[b][h][qt][0 ..] in increasing order, and kv_full[...] = 1 for a tile whose every
// pair is visible and whose keys are all below kv_lens[b] (no mask needed), 0 for a partial
// one. Tiles with no visible pair are left out: the forward never loads them. Computed once per
// (mask, shape, aux, kv_lens) and kept.
//
// flex_fwd: one CTA of NW warps per (query tile of BR = 16 * MT * NW rows, head, batch entry),
// as flash_fwd; it walks its tile list, double-buffering K and V tiles of BCT keys by
// cp.async (a tile past kv_lens is zero-filled). Each score is x = Q.K * scale; with SCORE,
// x = kp_score(x, ...); in a partial tile x = -inf where the key is past kv_lens[b] or kp_mask
// is false. Then the online softmax in the base-2 domain (x * log2 e) and O += P V as in
// flash_fwd (mma.sync m16n8k16, ldmatrix; FlashAttention-2's guard for rows that have seen no
// key). No atomics: outputs are bit-identical from run to run.

// Whether any and whether every (row, key) pair of the tile at query row q0 and key k0 is
// visible (kp_mask), over its first `rows` rows and `keys` keys of BR x BC; the CTA's threads
// share the pairs and every thread gets both answers (two barriers: every thread calls it).
template <int BR, int BC>
__device__ __forceinline__ void flex_tile_visible(int b, int h, int q0, int k0, int rows,
                                                  int keys, int H, int Tq, int Tkv,
                                                  const int* __restrict__ aux, int& any,
                                                  int& all) {
    any = 0;
    all = 1;
    for (int e = threadIdx.x; e < BR * BC; e += blockDim.x) {
        const int r = e / BC, c = e % BC;
        if (r < rows && c < keys) {
            const bool v = kp_mask(b, h, q0 + r, k0 + c, H, Tq, Tkv, aux);
            any |= v;
            all &= v;
        }
    }
    any = __syncthreads_or(any);
    all = __syncthreads_and(all);
}

template <int BR, int BCT>
__device__ __forceinline__ void flex_block_mask(const int* __restrict__ kv_lens,
                                                const int* __restrict__ aux,
                                                int* __restrict__ kv_count,
                                                int* __restrict__ kv_index,
                                                unsigned char* __restrict__ kv_full, int Tq,
                                                int Tkv, int H) {
    const int qt = blockIdx.x, h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x;
    const int n_kt = (Tkv + BCT - 1) / BCT;
    const int L = min(kv_lens[b], Tkv);  // the host checks; a longer length never reads past
    const int q0 = qt * BR;
    const int rows = min(BR, Tq - q0);
    const size_t list = (((size_t)b * H + h) * gridDim.x + qt) * n_kt;
    int count = 0;  // thread 0's
    for (int kt = 0; kt < n_kt; ++kt) {
        const int k0 = kt * BCT;
        // Whether the tile holds BCT keys below L, from its own comparison: with `keys ==
        // BCT` after `max(0, min(BCT, L - k0))`, NVRTC 13.0 for sm_90a took the predicate of
        // the VIMNMX.RELU that computes `keys` and the H200 flagged exactly the wrong tiles
        // whole (a tile with 40 keys whole, one with 64 not).
        const int avail = L - k0;
        const bool whole_keys = avail >= BCT;
        const int keys = whole_keys ? BCT : max(avail, 0);
        int any, all;
        flex_tile_visible<BR, BCT>(b, h, q0, k0, rows, keys, H, Tq, Tkv, aux, any, all);
        if (tid == 0 && any) {
            kv_index[list + count] = kt;
            kv_full[list + count] = all && whole_keys;
            ++count;
        }
    }
    if (tid == 0) kv_count[((size_t)b * H + h) * gridDim.x + qt] = count;
}

// flex_block_mask_t: the block mask transposed, for the backwards (flex_attn_bwd.cu and
// flex_attn_bwd_sm90.cu): one CTA of 128 threads per (key tile of BC keys, head, batch entry)
// evaluates kp_mask over every (row, key) pair of every query tile of BR rows and lists the
// query tiles with a visible pair, increasing:
// q_count[b][h][kt], q_index[b][h][kt][0 ..], q_full[...] = 1 when every pair is visible, the
// tile has BR rows below Tq and the key tile BC keys below kv_lens[b].
//
template <int BR, int BC>
__device__ __forceinline__ void flex_block_mask_t(const int* __restrict__ kv_lens,
                                                  const int* __restrict__ aux,
                                                  int* __restrict__ q_count,
                                                  int* __restrict__ q_index,
                                                  unsigned char* __restrict__ q_full, int Tq,
                                                  int Tkv, int H) {
    const int kt = blockIdx.x, h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x;
    const int n_qt = (Tq + BR - 1) / BR;
    const int L = min(kv_lens[b], Tkv);
    const int k0 = kt * BC;
    const int avail = L - k0;
    const bool whole_keys = avail >= BC;  // its own comparison: see flex_block_mask
    const int keys = whole_keys ? BC : max(avail, 0);
    const size_t list = (((size_t)b * H + h) * gridDim.x + kt) * n_qt;
    int count = 0;  // thread 0's
    for (int qt = 0; qt < n_qt; ++qt) {
        const int q0 = qt * BR;
        const int rows = min(BR, Tq - q0);
        int any, all;
        flex_tile_visible<BR, BC>(b, h, q0, k0, rows, keys, H, Tq, Tkv, aux, any, all);
        if (tid == 0 && any) {
            q_index[list + count] = qt;
            q_full[list + count] = all && whole_keys && rows == BR;
            ++count;
        }
    }
    if (tid == 0) q_count[((size_t)b * H + h) * gridDim.x + kt] = count;
}

template <int D, int NW, int MT, int BCT, bool BF16, bool SCORE>
__device__ __forceinline__ void flex_fwd(const u16* __restrict__ Q, const u16* __restrict__ K,
                                         const u16* __restrict__ V, u16* __restrict__ O,
                                         float* __restrict__ LSE, const int* __restrict__ kv_lens,
                                         const int* __restrict__ aux,
                                         const int* __restrict__ kv_count,
                                         const int* __restrict__ kv_index,
                                         const unsigned char* __restrict__ kv_full, int Tq,
                                         int Tkv, int H, int KVH, float scale) {
    constexpr int BR = 16 * MT * NW;
    constexpr int NTH = 32 * NW;
    constexpr int STR = D + 8;
    constexpr int DT = D / 8;
    constexpr int KC = D / 16;
    constexpr int NT = BCT / 8;
    constexpr float LOG2E = 1.4426950408889634f;
    static_assert(D % 32 == 0, "head_dim must be a multiple of 32");
    extern __shared__ __align__(16) u16 smem[];
    u16* sQ = smem;
    u16* sK = sQ + BR * STR;       // 2 buffers
    u16* sV = sK + 2 * BCT * STR;  // 2 buffers

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t4 = lane & 3;
    const int qt = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int n_kt_all = (Tkv + BCT - 1) / BCT;
    const int kvh = h / (H / KVH);
    const int L = min(kv_lens[b], Tkv);
    const int q0 = qt * BR;
    const int rows = min(BR, Tq - q0);
    const size_t tile = ((size_t)b * H + h) * gridDim.x + qt;
    const int n_tiles = kv_count[tile];
    const int* idx = kv_index + tile * n_kt_all;
    const unsigned char* full = kv_full + tile * n_kt_all;
    const size_t q_off = ((size_t)(b * H + h) * Tq + q0) * D;
    const size_t kv_off = (size_t)(b * KVH + kvh) * Tkv * D;
    const int warp_row0 = warp * 16 * MT;
    const int warp_rows = min(16 * MT, rows - warp_row0);

    load_tile<BR, D, NTH>(sQ, Q + q_off, rows, tid);
    cp_async_commit();
    if (n_tiles > 0) {
        const int k0 = idx[0] * BCT;
        load_tile<BCT, D, NTH>(sK, K + kv_off + (size_t)k0 * D, L - k0, tid);
        load_tile<BCT, D, NTH>(sV, V + kv_off + (size_t)k0 * D, L - k0, tid);
    }
    cp_async_commit();

    float o[MT][DT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int i = 0; i < DT; ++i) o[mt][i][0] = o[mt][i][1] = o[mt][i][2] = o[mt][i][3] = 0.f;
    float m_run[MT][2], l_run[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        m_run[mt][0] = m_run[mt][1] = NEG_INF;
        l_run[mt][0] = l_run[mt][1] = 0.f;
    }

    for (int it = 0; it < n_tiles; ++it) {
        const int buf = it & 1;
        const int k0 = idx[it] * BCT;
        if (it + 1 < n_tiles) {
            const int k1 = idx[it + 1] * BCT;
            load_tile<BCT, D, NTH>(sK + (buf ^ 1) * BCT * STR, K + kv_off + (size_t)k1 * D, L - k1, tid);
            load_tile<BCT, D, NTH>(sV + (buf ^ 1) * BCT * STR, V + kv_off + (size_t)k1 * D, L - k1, tid);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const u16* k_s = sK + buf * BCT * STR;
        const u16* v_s = sV + buf * BCT * STR;
        const bool partial = !full[it];
        if (warp_rows > 0) {
            float s[MT][NT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.f;
            qk_tile<MT, NT, KC, STR, BF16>(s, sQ, k_s, warp_row0, BCT, lane);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int row = q0 + warp_row0 + mt * 16 + g + (e >> 1) * 8;
                        const int col = k0 + nt * 8 + 2 * t4 + (e & 1);
                        float x = s[mt][nt][e] * scale;
                        // Pairs past Tq or kv_lens are never visible; kp_score sees only
                        // pairs in bounds (an expression may index aux by them).
                        if (SCORE && row < Tq && col < L)
                            x = kp_score(x, b, h, row, col, H, Tq, Tkv, aux);
                        x *= LOG2E;
                        if (partial && !flex_visible(b, h, row, col, H, Tq, Tkv, L, aux))
                            x = NEG_INF;
                        s[mt][nt][e] = x;
                    }
                }
                online_softmax_rows<MT, NT, DT, true>(s, m_run, l_run, o, mt);
            }
#pragma unroll
            for (int kc = 0; kc < BCT / 16; ++kc) pv_step<MT, NT, DT, STR, BF16>(o, s, kc, v_s, kc * 16, lane);
        }
        __syncthreads();  // every warp is done with `buf` before it is refilled
    }
    cp_async_wait<0>();

    u16* o_base = O + q_off;
    float* lse_base = LSE + (size_t)(b * H + h) * Tq + q0;
    store_rows<MT, DT, BF16>(o, m_run, l_run, o_base, lse_base, warp_row0, rows, g, t4);
}
