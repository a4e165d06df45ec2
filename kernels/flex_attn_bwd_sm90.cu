// The flex_attention backward on compute capability 9.0: the generated mask and score
// modification (kp_mask, kp_score, kp_score_grad, flex_visible; src/attention/flex.rs) applied
// inside the wgmma backward of attn_wgmma_bwd_sm90.cu (a TMA producer warpgroup, two consumer
// warpgroups of 64 keys keeping dK and dV in registers, dQ summed in fp32 by TMA reduce-adds).
// The host prepends the wgmma backward's source without a dense main kernel
// (KP_SM90_BWD_NO_MAIN: its preprocessing and dQ conversion are this backward's too), the
// generated functions and flex_attn_fwd.cu (for flex_block_mask_t, instantiated at the main
// kernel's BM queries x 128 keys).
//
// One CTA per (128-key tile, kv head, batch entry) walks, for each query head of the group, the
// query tiles the transposed block mask lists for its key tile (tiles the mask empties are
// never loaded). Per score of S^T: x = S^T * scale, with a score modification x' = kp_score(x)
// (natural units; P^T = 2^(x' log2 e - LSE2)) and dS^T = P^T (dP^T - D) kp_score_grad(x);
// without one P^T = 2^(S^T scale log2 e - LSE2) as in the dense kernel. In a partial tile P^T
// is 0 where flex_visible is false (the key at or past kv_lens[b], the row past Tq, or kp_mask
// false). dK is written times the scale and dQ converted times the scale (d x / d K = scale Q).

template <bool S>
struct FlexBwdHooks {
    enum { ON = 1 };  // an enum: a static constexpr member would leave a symbol in the cubin
    // P^T of one score (st = S^T's entry: key `key`, query row `q` of head h, batch entry b;
    // lse2 = the row's LSE · log2 e), 0 where `partial` and flex_visible is false; `grad` the
    // score modification's derivative (1 without one). kp_score and kp_score_grad see the
    // pair's indices clamped into bounds (an expression may index aux by them): a pair out of
    // bounds is in a partial tile (whole tiles have BM rows below Tq and 128 keys below L) or a
    // padding row, whose LSE2 is +inf, so its P^T is 0 either way.
    __device__ static float prob(float st, float lse2, bool partial, int b, int h, int q, int key,
                                 int Tq, int Tkv, int H, int L, float scale_log2,
                                 const FlexTiles& fx, float& grad) {
        float x;
        if constexpr (S) {
            constexpr float LOG2E = 1.4426950408889634f;
            const float sc = st * fx.scale;
            const int qc = min(q, Tq - 1), kc = min(key, L - 1);
            grad = kp_score_grad(sc, b, h, qc, kc, H, Tq, Tkv, fx.aux);
            x = fast_exp2(fmaf(kp_score(sc, b, h, qc, kc, H, Tq, Tkv, fx.aux), LOG2E, -lse2));
        } else {
            grad = 1.f;
            x = fast_exp2(fmaf(st, scale_log2, -lse2));
        }
        if (partial && !flex_visible(b, h, q, key, H, Tq, Tkv, L, fx.aux)) x = 0.f;
        return x;
    }
};

// The main kernel: Q, K, V, dO and dQacc through the tensor maps the host builds as for the
// dense backward (BM-row boxes for Q and dO, 128-row for K and V, fp32 dQacc boxes of 32
// columns); lse2 and dsum from the preprocessing (B · H · Tq_pad floats); the transposed block
// mask at (BM queries, 128 keys); dK and dV [B, KVH, Tkv, D].
template <int D, bool SCORE>
__device__ __forceinline__ void flex_bwd_sm90(const TmaMap* tq, const TmaMap* tk,
                                              const TmaMap* tv, const TmaMap* tdo,
                                              const TmaMap* tdq, const float* lse2,
                                              const float* dsum, const int* kv_lens,
                                              const int* aux, const int* q_count,
                                              const int* q_index, const unsigned char* q_full,
                                              u16* dK, u16* dV, int Tq, int Tkv, int H, int KVH,
                                              int Tq_pad, float scale_log2, float scale, int B) {
    const FlexTiles fx{q_count, q_index, q_full, aux, scale};
    // No head split (splits 1, no partial buffer), CTA order 0 (key tiles fastest), no tail
    // split (tail_parts 1).
    attn_bwd_sm90<D, BwShape<D>::BM, false, FlexBwdHooks<SCORE>>(
        tq, tk, tv, tdo, tdq, lse2, dsum, kv_lens, dK, dV, nullptr, 1, Tq, Tkv, H, KVH, Tq_pad,
        scale_log2, scale, B, 0, 1, 0, 1, nullptr, fx);
}
