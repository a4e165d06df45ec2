// Attention backward with generated masks and score modifications (the flex_attention
// interface), written for this project on the FlashAttention-2 backward of flash_attn_bwd.cu,
// whose helpers it uses (bwd_preprocess, bwd_dq_convert, mma_rows_rows, mma_regs_rows,
// acc_to_a, dq_tile_add). The host prepends attn_prelude.cuh, the generated functions and
// flex_attn_fwd.cu and flash_attn_bwd.cu (src/attention/flex.rs); besides kp_mask and kp_score
// the generated source has
//
//   float kp_score_grad(float score, int b, int h, int q_idx, int kv_idx, int num_heads,
//                       int seq_len_q, int seq_len_kv, const int* aux);
//
// d kp_score / d score at `score` (1 without a score modification).
//
// flex_block_mask_t (flex_attn_fwd.cu, beside flex_block_mask) lists, per key tile, the query
// tiles with a visible pair.
//
// flex_bwd: one CTA per (key tile of BC = 16 * NW keys, kv head, batch entry), as flash_bwd:
// K and V stay in shared memory; the CTA walks, for each query head of the kv head's group, the
// listed query tiles of that head (Q, dO, LSE and D double-buffered by cp.async). Per warp (16
// keys): S^T = K Q^T; x = S^T * scale, with SCORE x' = kp_score(x); P^T = exp(x' - LSE), 0 in a
// partial tile where the key is past kv_lens[b], the row past Tq or kp_mask false; dP^T = V dO^T;
// dS^T = P^T * (dP^T - D), with SCORE times kp_score_grad(x); dV += P^T dO, dK += dS^T Q in
// registers; dQ += dS K through fp32 atomics (as flash_bwd). dK is written times scale and dQ
// converted times scale (d x / d K = scale Q). Tiles the mask empties are never loaded.

template <int D, int NW, int BR, bool BF16, bool SCORE>
__device__ __forceinline__ void flex_bwd(
    const u16* __restrict__ Q, const u16* __restrict__ K, const u16* __restrict__ V,
    const u16* __restrict__ dO, const float* __restrict__ LSE, const float* __restrict__ Dsum,
    const int* __restrict__ kv_lens, const int* __restrict__ aux,
    const int* __restrict__ q_count, const int* __restrict__ q_index,
    const unsigned char* __restrict__ q_full, float* __restrict__ dQacc, u16* __restrict__ dK,
    u16* __restrict__ dV, int Tq, int Tkv, int H, int KVH, float scale) {
    constexpr int BC = 16 * NW;
    constexpr int NTH = 32 * NW;
    constexpr int STR = D + 8;
    constexpr int STRS = BR + 8;
    constexpr int NQ = BR / 8;
    constexpr int DT = D / 8;
    constexpr float LOG2E = 1.4426950408889634f;
    static_assert(D % 32 == 0, "head_dim");
    extern __shared__ __align__(16) u16 smem[];
    u16* sK = smem;
    u16* sV = sK + BC * STR;
    u16* sQ = sV + BC * STR;       // 2 x BR x STR
    u16* sdO = sQ + 2 * BR * STR;  // 2 x BR x STR
    u16* sdS = sdO + 2 * BR * STR; // BC x STRS
    float* sL = reinterpret_cast<float*>(sdS + BC * STRS);  // 2 x BR: LSE (natural log)
    float* sD = sL + 2 * BR;                                // 2 x BR: D

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t4 = lane & 3;
    const int kt = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
    const int group = H / KVH;
    const int L = min(kv_lens[b], Tkv);
    const int k0 = kt * BC;
    const int kw0 = k0 + 16 * warp;
    const int n_qt = (Tq + BR - 1) / BR;
    const size_t kv_off = (size_t)(b * KVH + kvh) * Tkv * D;
    // This key tile's list of head h: (b, h, kt).
    auto list_of = [&](int h) { return ((size_t)b * H + h) * gridDim.x + kt; };
    int n_it = 0;
    for (int r = 0; r < group; ++r) n_it += q_count[list_of(kvh * group + r)];
    if (k0 >= L) n_it = 0;
    // Iteration `it` -> (head, position in its list).
    auto locate = [&](int it, int& h, int& pos) {
        int r = 0;
        int n = q_count[list_of(kvh * group)];
        while (it >= n) {
            it -= n;
            ++r;
            n = q_count[list_of(kvh * group + r)];
        }
        h = kvh * group + r;
        pos = it;
    };

    float dk[DT][4], dv[DT][4];
#pragma unroll
    for (int i = 0; i < DT; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) dk[i][e] = dv[i][e] = 0.f;

    auto prefetch = [&](int it, int buf) {
        int h, pos;
        locate(it, h, pos);
        const int q0 = q_index[list_of(h) * n_qt + pos] * BR;
        const size_t q_off = ((size_t)(b * H + h) * Tq + q0) * D;
        load_tile<BR, D, NTH>(sQ + buf * BR * STR, Q + q_off, Tq - q0, tid);
        load_tile<BR, D, NTH>(sdO + buf * BR * STR, dO + q_off, Tq - q0, tid);
        for (int r = tid; r < BR; r += NTH) {
            const bool ok = q0 + r < Tq;
            const size_t row = (size_t)(b * H + h) * Tq + q0 + r;
            sL[buf * BR + r] = ok ? LSE[row] : POS_INF;
            sD[buf * BR + r] = ok ? Dsum[row] : 0.f;
        }
    };

    if (n_it > 0) {
        load_tile<BC, D, NTH>(sK, K + kv_off + (size_t)k0 * D, L - k0, tid);
        load_tile<BC, D, NTH>(sV, V + kv_off + (size_t)k0 * D, L - k0, tid);
        prefetch(0, 0);
    }
    cp_async_commit();

    for (int it = 0; it < n_it; ++it) {
        const int buf = it & 1;
        if (it + 1 < n_it) {
            prefetch(it + 1, buf ^ 1);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        int h, pos;
        locate(it, h, pos);
        const size_t at = list_of(h) * n_qt + pos;
        const int q0 = q_index[at] * BR;
        const bool partial = !q_full[at];
        const u16* q_s = sQ + buf * BR * STR;
        const u16* do_s = sdO + buf * BR * STR;
        const float* l_s = sL + buf * BR;
        const float* d_s = sD + buf * BR;
        u16* ds_w = sdS + (16 * warp) * STRS;
        if (kw0 >= L) {
            // Keys past kv_lens: no contribution; dS^T rows 0 for the dQ product.
            for (int i = lane; i < 16 * BR / 2; i += 32) {
                const int r = i / (BR / 2), c = (i % (BR / 2)) * 2;
                *reinterpret_cast<u32*>(ds_w + r * STRS + c) = 0u;
            }
        } else {
            // dP^T = V dO^T first, then S^T = K Q^T: the elementwise pass below makes P^T and
            // dS^T = P^T * (dP^T - D) * kp_score_grad(x) together, so the derivative is never
            // held across a matrix product.
            float ds[NQ][4];
#pragma unroll
            for (int i = 0; i < NQ; ++i) ds[i][0] = ds[i][1] = ds[i][2] = ds[i][3] = 0.f;
            mma_rows_rows<D, NQ, STR, BF16, 1>(ds, sV + 16 * warp * STR, do_s, lane);
            float p[NQ][4];
#pragma unroll
            for (int i = 0; i < NQ; ++i) p[i][0] = p[i][1] = p[i][2] = p[i][3] = 0.f;
            mma_rows_rows<D, NQ, STR, BF16, 1>(p, sK + 16 * warp * STR, q_s, lane);
#pragma unroll
            for (int nt = 0; nt < NQ; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int ql = nt * 8 + 2 * t4 + (e & 1);
                    const int row = q0 + ql;
                    const int key = kw0 + g + (e >> 1) * 8;
                    float x = p[nt][e] * scale;
                    float grad = 1.f;
                    if (SCORE && row < Tq && key < L) {
                        grad = kp_score_grad(x, b, h, row, key, H, Tq, Tkv, aux);
                        x = kp_score(x, b, h, row, key, H, Tq, Tkv, aux);
                    }
                    float pe = fast_exp2((x - l_s[ql]) * LOG2E);
                    if (partial && !flex_visible(b, h, row, key, H, Tq, Tkv, L, aux)) pe = 0.f;
                    p[nt][e] = pe;
                    ds[nt][e] = pe * (ds[nt][e] - d_s[ql]) * grad;
                }
            }
            u32 pa[NQ / 2][4], dsa[NQ / 2][4];
            acc_to_a<NQ, BF16>(p, pa);
            acc_to_a<NQ, BF16>(ds, dsa);
            mma_regs_rows<NQ / 2, DT, STR, BF16>(dv, pa, do_s, lane);
            mma_regs_rows<NQ / 2, DT, STR, BF16>(dk, dsa, q_s, lane);
#pragma unroll
            for (int nt = 0; nt < NQ; ++nt) {
                *reinterpret_cast<u32*>(ds_w + g * STRS + nt * 8 + 2 * t4) = dsa[nt / 2][(nt & 1) * 2];
                *reinterpret_cast<u32*>(ds_w + (g + 8) * STRS + nt * 8 + 2 * t4) = dsa[nt / 2][(nt & 1) * 2 + 1];
            }
        }
        __syncthreads();  // the dS^T tile is complete
        dq_tile_add<D, NW, BR, STR, BF16, true>(
            sdS, sK, dQacc + ((size_t)(b * H + h) * Tq + q0) * D, q0, Tq, warp, lane);
        // No closing barrier: the next step's first barrier orders the refills and the next
        // dS^T write after every warp's reads of this step (flash_bwd's END_SYNC = false).
    }

    const size_t out_off = kv_off + (size_t)kw0 * D;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int key = kw0 + g + r * 8;
        if (key < Tkv) {
#pragma unroll
            for (int dt = 0; dt < DT; ++dt) {
                const size_t o = out_off + (size_t)(g + r * 8) * D + dt * 8 + 2 * t4;
                *reinterpret_cast<u32*>(dK + o) = pack2<BF16>(dk[dt][2 * r] * scale, dk[dt][2 * r + 1] * scale);
                *reinterpret_cast<u32*>(dV + o) = pack2<BF16>(dv[dt][2 * r], dv[dt][2 * r + 1]);
            }
        }
    }
}
