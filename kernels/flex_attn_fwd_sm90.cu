// The flex_attention forward on compute capability 9.0: the generated mask and score
// modification (kp_mask, kp_score; src/attention/flex.rs) applied inside the wgmma forward of
// attn_wgmma_sm90.cu (version 3: a producer warpgroup bringing 128-key K and V tiles by TMA in
// two stages on mbarriers, two consumer warpgroups of 64 query rows on wgmma, the softmax of
// one key tile overlapped with the P V product of the previous one, the consumers taking turns
// to issue; O stored through shared memory by TMA). The host prepends that source with no
// dense kernel selected, the generated functions and flex_attn_fwd.cu (for flex_block_mask,
// instantiated here at the wgmma kernel's 128 x 128 tiles).
//
// Each CTA takes one 128-row query tile of one (head, batch entry) and walks the key tiles of
// its list from the block mask, as flex_fwd does: a tile the mask leaves whole runs the dense
// kernel's code; in a partial tile a score is -inf where the key is at or past kv_lens[b], the
// query row is past Tq, or kp_mask is false. With a score modification every in-bounds score
// is kp_score(q.k * scale) and the softmax takes it in natural units (the host passes
// scale_log2 = log2 e); without one the raw q.k are scaled in the softmax as in the dense
// kernel (scale_log2 = scale * log2 e, which must be positive). Shapes, the LSE and the rows
// that see no key (O = 0, LSE = +inf) as flex_fwd.

template <bool SCORE>
struct FlexHooks {
    enum { ON = 1 };
    // The score tile of one consumer warpgroup (64 rows x NT * 8 keys from k0, accumulator
    // layout; row0 the warp's first query row): the score modification, then the mask.
    template <int NT>
    __device__ static void tile(float (&s)[1][NT][4], int k0, int L, int row0, bool partial,
                                int b, int h, int Tq, int Tkv, int H, const FlexTiles& fx, int g,
                                int t4) {
        // kp_score and kp_mask see in-bounds pairs only (an expression may index aux by them).
        if constexpr (SCORE) {
            if (row0 + 15 < Tq && k0 + NT * 8 <= L) {
                // Every pair of the warp's 16 rows is in bounds: the modification runs as
                // straight-line code, where the compiler computes its parts that do not depend
                // on the pair (ALiBi's slope) once rather than behind each pair's guard.
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        s[0][nt][e] = kp_score(s[0][nt][e] * fx.scale, b, h,
                                               row0 + g + (e >> 1) * 8,
                                               k0 + nt * 8 + 2 * t4 + (e & 1), H, Tq, Tkv, fx.aux);
            } else {
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int row = row0 + g + (e >> 1) * 8;
                        const int col = k0 + nt * 8 + 2 * t4 + (e & 1);
                        if (row < Tq && col < L)
                            s[0][nt][e] = kp_score(s[0][nt][e] * fx.scale, b, h, row, col, H, Tq,
                                                   Tkv, fx.aux);
                    }
            }
        }
        if (!partial) return;
        // The mask of every pair without a branch: kp_mask sees the pair's indices clamped into
        // bounds (a tile is listed only where L >= 1) and the bounds tests are combined with
        // `&`, so an expression's loads from aux (the document mask's) are issued together for
        // the whole tile rather than one pair at a time behind each pair's guard.
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int row = row0 + g + (e >> 1) * 8;
                const int col = k0 + nt * 8 + 2 * t4 + (e & 1);
                if (!flex_visible(b, h, row, col, H, Tq, Tkv, L, fx.aux)) s[0][nt][e] = NEG_INF;
            }
    }
};

// One CTA of 384 threads (the producer and two consumers) per (128-row query tile, head, batch
// entry); Q, K, V and O through the tensor maps the host builds as for the dense kernel.
template <int D, bool SCORE>
__device__ __forceinline__ void flex_fwd_sm90(const TmaMap* tq, const TmaMap* tk,
                                              const TmaMap* tv, const TmaMap* to, u16* O,
                                              float* LSE, const int* kv_lens, const int* aux,
                                              const int* kv_count, const int* kv_index,
                                              const unsigned char* kv_full, int Tq, int Tkv,
                                              int H, int KVH, float scale, float scale_log2) {
    const FlexTiles fx{kv_count, kv_index, kv_full, aux, scale};
    attn_fwd_sm90_ws<D, WS_BC, 2, 2, false, true, false, FlexHooks<SCORE>>(
        tq, tk, tv, to, O, LSE, kv_lens, Tq, Tkv, H, KVH, scale_log2, 0, 0, nullptr, nullptr, 1,
        0, fx);
}
