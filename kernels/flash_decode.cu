// Decoding attention split over the key axis (flash-decoding: Dao, Haziza, Massa and Sizov,
// 2023) over a paged KV cache (vLLM's PagedAttention layout: Kwon et al., 2023), in one
// kernel. The host prepends attn_prelude.cuh (src/attention/decode_gpu.rs).
//
// flash_decode_split: one CTA of 128 threads (4 warps) per (split s, kv head and row block,
// sequence b). The G = H / KVH query heads that share the kv head, each with its Tq query rows,
// are G * Tq rows (row q = g * Tq + i: query head kvh * G + g, query i), taken RM = 16 * MT at
// a time (MT mma row tiles; MT = 2 at head_dim <= 128 when a group has more than 16 rows): row
// block rb holds rows [rb * RM, min(G * Tq, rb * RM + RM)) (grid y = KVH * row blocks,
// y = kvh * row blocks + rb); rows past the block's end are zero in shared memory and never
// written. A CTA attends its rows to the keys
// [s * keys_per_split, min(seq_lens[b], (s + 1) * keys_per_split)) of sequence b (the last
// split: to seq_lens[b]). Key t lives at
//   page_stride * block_table[b * max_pages + t / page_size] + row_stride * (t % page_size)
//   + head_stride * kvh
// so one kernel reads vLLM's pages [num_pages, page_size, KVH, D] (row_stride KVH * D,
// head_stride D) and a contiguous [B, KVH, T, D] cache (one page of T rows per sequence:
// page_stride KVH * T * D, row_stride D, head_stride T * D).
//
// K and V tiles of 64 keys stream through a ring of NS stages (3 at head_dim <= 128, 2 at 256)
// by 16-byte cp.async, NS - 1 tiles in flight while one is used; keys past the range are
// zero-filled, so a masked probability never meets garbage. The TMA build (sm_90; see
// flash_decode_split) brings the same tiles by tensor copies instead. Warp w owns keys
// 16w..16w+15 of every tile and keeps its own online softmax (running max and sum per row) and
// output accumulator over them: S = Q K^T (RM rows x 16 keys) and O += P V on the tensor cores
// (mma.sync m16n8k16, fp32 accumulation; fragments by ldmatrix as in flash_attn_fwd.cu), in
// the log2 domain (S scaled by scale * log2 e), masked bottom-right when causal (query i of
// sequence b sees keys t <= i + seq_lens[b] - Tq) and at the range's end. After the last tile
// the four warps' (max, sum, output) merge exactly in shared memory. With one split the CTA
// writes O (bf16/fp16) and LSE itself. Otherwise each split writes its output normalised over
// its range, Opart [B, H, Tq, S, D] fp32, and its log2-domain log-sum-exp Lpart [B, H, Tq, S]
// (-inf when the split sees no key of the row, the output 0), then counts itself done on
// `counters[b][y]`; the CTA that finishes last merges the S partials of its rows exactly (the
// combine: m = max Lpart, w_s = 2^(Lpart_s - m), O = sum w_s Opart_s / sum w_s, LSE = (m +
// log2 sum w_s) * ln 2, natural log; a row with no visible key gets O = 0 and LSE = +inf) and
// sets the counter back to 0 for the next call (threadfence reduction, as in CUDA's
// threadFenceReduction sample).

// A thread's place in its range's key stream for the loader below: the key of its next 16-byte
// chunk, that key's page and place in the page, and the chunk's K and V addresses. The loader
// carries it from one tile to the next (a thread's chunks of consecutive tiles are consecutive
// in the stream), so a call divides by the page size once, and the 64-bit offset products run
// only where a chunk enters a page; within a page both addresses advance by a constant.
struct DecodeCursor {
    const u16* k;
    const u16* v;
    int key, page, within;
};

// Points `c` at column `col` of its key (page c.page, row c.within of it) in the kv head's K and
// V bases `Kb`, `Vb`; a key at or past `end` (whose page the table need not hold) at the bases.
__device__ __forceinline__ void decode_seek(DecodeCursor& c, const u16* Kb, const u16* Vb,
                                            const int* table, int col, int end,
                                            long long page_stride, long long row_stride) {
    const long long off = c.key < end ? (long long)table[c.page] * page_stride +
                                            (long long)c.within * row_stride + col
                                      : 0;
    c.k = Kb + off;
    c.v = Vb + off;
}

// The cursor of thread `tid` at key `k0` (a range's first key): chunk c = tid + NT * i of a tile
// is key c / (D / 8), column (c % (D / 8)) * 8.
template <int D>
__device__ __forceinline__ DecodeCursor decode_cursor(const u16* Kb, const u16* Vb,
                                                      const int* table, int k0, int end,
                                                      int page_size, long long page_stride,
                                                      long long row_stride, int tid) {
    constexpr int CPR = D / 8;  // 16-byte chunks per key row
    DecodeCursor c;
    c.key = k0 + tid / CPR;
    c.page = c.key / page_size;
    c.within = c.key - c.page * page_size;
    decode_seek(c, Kb, Vb, table, (tid % CPR) * 8, end, page_stride, row_stride);
    return c;
}

// The next KT keys of the cursor's stream (one kv head) into the K and V tile buffers `ks`, `vs`
// (rows padded to D + 8 elements) as 16-byte cp.async (the caller commits); keys at or past
// `end` are zero-filled and read nothing (the copy ignores its source). Key t is at `Kb`/`Vb` +
// page_stride * table[t / page_size] + row_stride * (t % page_size). A thread's chunks share a
// column and step KSTEP = NT / (D / 8) keys: within a page the addresses advance by KSTEP *
// row_stride elements; a chunk that enters a new page looks the page up.
template <int D, int KT, int NT>
__device__ __forceinline__ void decode_load_tile(u16* ks, u16* vs, const u16* Kb, const u16* Vb,
                                                 const int* table, DecodeCursor& c, int end,
                                                 int page_size, long long page_stride,
                                                 long long row_stride, int tid) {
    constexpr int STR = D + 8;
    constexpr int CPR = D / 8;         // 16-byte chunks per key row
    constexpr int KSTEP = NT / CPR;    // keys between a thread's chunks
    constexpr int PER_THREAD = KT / KSTEP;
    static_assert(NT % CPR == 0 && KT % KSTEP == 0, "whole chunks per thread");
    const int kr0 = tid / CPR, col = (tid % CPR) * 8;
    const long long step = (long long)KSTEP * row_stride;
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i) {
        const int kr = kr0 + KSTEP * i;
        const bool ok = c.key < end;
        cp_async16(smem_u32(ks + kr * STR + col), c.k, ok);
        cp_async16(smem_u32(vs + kr * STR + col), c.v, ok);
        c.key += KSTEP;
        c.within += KSTEP;
        c.k += step;
        c.v += step;
        if (c.within >= page_size) {
            do {  // once when page_size >= KSTEP
                c.within -= page_size;
                ++c.page;
            } while (c.within >= page_size);
            decode_seek(c, Kb, Vb, table, col, end, page_stride, row_stride);
        }
    }
}

// Shared memory of the split kernel, bytes: the ring's NS stages of a K and a V tile, then Q
// (RM = 16 MT rows, padded to D + 8 elements), then (TMA) the stages' mbarriers, then one word
// (the last-CTA flag, in 16 bytes). The ring's tiles have rows padded to D + 8 elements (cp.async)
// or are TMA's 128-byte-swizzled panels of 64 columns (sw128_offset<KT>), the ring then placed
// at the first 1024-byte boundary (BYTES holds the 1 KiB that may cost). The warps' partials
// and the combine's weights reuse the ring at the end.
template <int D, int MT, bool TMA>
struct DecodeSmem {
    static constexpr int KT = 64, RM = 16 * MT, STR = D + 8, NS = D <= 128 ? 3 : 2;
    static constexpr int TILE = TMA ? KT * D : KT * STR;  // elements of one K or V tile
    static constexpr int Q = NS * 2 * TILE * 2;           // byte offsets
    static constexpr int BARS = Q + RM * STR * 2;
    static constexpr int FLAG = BARS + (TMA ? NS * 8 : 0);
    static constexpr int BYTES = FLAG + 16 + (TMA ? 1024 : 0);
    static constexpr int RING_FLOATS = NS * 2 * TILE / 2;
    static_assert((4 * RM * D + 8 * RM) * 4 <= NS * 2 * TILE * 2, "partials fit the ring");
};

// Tile `k0` (KT keys) of kv head `kvh`'s K and V by TMA into the stage at shared address
// `stage` (K's D / 64 swizzled panels of KT rows, then V's), completing on mbarrier `bar`; run by
// the whole warp 0 (`lane`). Contiguous cache (`rows` 0): one box of 64 columns x KT keys per
// panel from the [planes][T][D] tensor maps at plane `plane` (keys at or past T read zeros).
// Paged cache (`rows` > 0: rows = min(page_size, KT), KT a multiple of rows or rows = KT within a
// page of a multiple of KT keys): the tile's KT / rows chunks of `rows` keys, lane j the j-th,
// each from its page's rows of the [pages * page_size][KVH][D] tensor maps in boxes of 64 columns
// x 1 head x rows keys; chunks past `end` are not brought (their rows keep what the stage held:
// the caller masks those keys' scores and zeroes their V rows).
template <int D, int KT>
__device__ __forceinline__ void decode_tma_tile(u32 stage, u32 bar, const TmaMap* tmk,
                                                const TmaMap* tmv, int k0, int end, int plane,
                                                int kvh, const int* table, int page_size,
                                                int rows, int lane) {
    constexpr int PANEL = KT * 128, NP = D / 64;
    const int chunk = rows > 0 ? rows : KT;
    const int chunks = min(KT / chunk, (end - k0 + chunk - 1) / chunk);
    if (lane == 0) mbar_expect_tx(bar, 2 * NP * chunks * chunk * 128);
    __syncwarp();
    if (lane < chunks) {
        const int key = k0 + lane * chunk;
        int c1 = key, c2 = plane;
        if (rows > 0) {
            const int page = key / page_size;
            c1 = kvh;
            c2 = table[page] * page_size + (key - page * page_size);
        }
        const u32 dst = stage + lane * chunk * 128;
#pragma unroll
        for (int p = 0; p < NP; ++p) tma_load_3d(dst + p * PANEL, tmk, bar, 64 * p, c1, c2);
#pragma unroll
        for (int p = 0; p < NP; ++p) tma_load_3d(dst + (NP + p) * PANEL, tmv, bar, 64 * p, c1, c2);
    }
}

// The combine of one CTA's R rows (row r: query head kvh * G + (r0 + r) / Tq, query (r0 + r)
// % Tq of sequence b) over S partials, by the CTA's 128 threads; `ws` holds RM * S floats.
// Warp w takes rows w, w + 4, ...: its lanes read the row's S log-sum-exps, reduce max and sum
// by shuffles and keep the normalised weights w_s / sum w in `ws`; then every thread sums
// four adjacent columns of one row over the splits (16-byte loads, L2: __ldcg, since the other
// splits wrote them from other SMs).
template <int D, int RM, bool BF16>
__device__ __forceinline__ void decode_combine_rows(const float* __restrict__ Opart,
                                                    const float* __restrict__ Lpart,
                                                    u16* __restrict__ O, float* __restrict__ LSE,
                                                    float* ws, int R, int b, int kvh, int r0,
                                                    int G, int Tq, int H, int S, int tid) {
    constexpr int NT = 128, NW = NT / 32;
    const int warp = tid >> 5, lane = tid & 31;
    for (int r = warp; r < R; r += NW) {
        const int h = kvh * G + (r0 + r) / Tq, i = (r0 + r) % Tq;
        const size_t row = ((size_t)b * H + h) * Tq + i;
        // The row's log-sum-exps are read from L2 once, kept in `ws` for the weights.
        float m = NEG_INF;
        for (int s = lane; s < S; s += 32) {
            const float l = __ldcg(Lpart + row * S + s);
            ws[r * S + s] = l;
            m = fmaxf(m, l);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        float total = 0.f;
        for (int s = lane; s < S; s += 32) {
            const float w = m == NEG_INF ? 0.f : fast_exp2(ws[r * S + s] - m);
            ws[r * S + s] = w;
            total += w;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
        const float inv = total > 0.f ? 1.f / total : 0.f;
        for (int s = lane; s < S; s += 32) ws[r * S + s] *= inv;
        if (lane == 0) LSE[row] = m == NEG_INF ? POS_INF : (m + log2f(total)) * LN2;
    }
    __syncthreads();
    for (int idx = tid; idx < R * (D / 4); idx += NT) {
        const int r = idx / (D / 4), c = (idx % (D / 4)) * 4;
        const int h = kvh * G + (r0 + r) / Tq, i = (r0 + r) % Tq;
        const size_t row = ((size_t)b * H + h) * Tq + i;
        const float* op = Opart + row * S * D + c;
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        // The partials' L2 reads in flight 32 at a time (32 splits: one round at batch 1); the
        // sum's order is the splits' whatever the unroll.
#pragma unroll 32
        for (int s = 0; s < S; ++s) {
            const float w = ws[r * S + s];
            const float4 x = __ldcg(reinterpret_cast<const float4*>(op + (size_t)s * D));
            acc.x += w * x.x;
            acc.y += w * x.y;
            acc.z += w * x.z;
            acc.w += w * x.w;
        }
        const u32 lo = pack2<BF16>(acc.x, acc.y), hi = pack2<BF16>(acc.z, acc.w);
        *reinterpret_cast<uint2*>(O + row * D + c) = make_uint2(lo, hi);
    }
}

// MT: 16-row tiles of query rows per CTA (1, or 2 at head_dim <= 128: the accumulators of
// 32 rows fit the registers there, and both row tiles share each K and V fragment, so a GQA
// group of 32 rows reads the cache once instead of once per 16 rows). O [B, H, Tq, D] and LSE
// [B, H, Tq] are the results; Opart, Lpart and counters (B * gridDim.y words, zero before the
// first call and left zero by every call) serve the combine when gridDim.x > 1, whose S
// partials of RM rows must fit the ring (RM * S <= RING_FLOATS: the host checks).
//
// TMA (sm_90): K and V tiles come by TMA tensor copies from `tmk`, `tmv`, issued by warp 0 and
// completing on one mbarrier per stage, instead of every thread's cp.async: with `tma_rows` 0
// the contiguous cache (one page of T keys per sequence, maps of [planes][T][D], plane =
// block_table[b * max_pages] * KVH + kvh), else vLLM's pages (maps of [pages * page_size][KVH][D],
// a copy per `tma_rows` keys of a page: decode_tma_tile). Keys past the range are masked out of
// S and their V rows zeroed in the last tile (the cache may hold anything there). Q still comes
// by cp.async.
template <int D, int MT, bool BF16, bool TMA>
__device__ __forceinline__ void flash_decode_split(
    const u16* __restrict__ Q, const u16* __restrict__ K, const u16* __restrict__ V,
    const int* __restrict__ block_table, const int* __restrict__ seq_lens,
    float* __restrict__ Opart, float* __restrict__ Lpart, int* __restrict__ counters,
    u16* __restrict__ O, float* __restrict__ LSE, int Tq, int H, int KVH, int page_size,
    int max_pages, long long page_stride, long long row_stride, long long head_stride,
    int keys_per_split, float scale_log2, int causal, const TmaMap* tmk, const TmaMap* tmv,
    int tma_rows) {
    using SM = DecodeSmem<D, MT, TMA>;
    constexpr int NT = 128, KT = SM::KT, RM = SM::RM, STR = SM::STR, NS = SM::NS;
    constexpr int TILE = SM::TILE, DT = D / 8, NW = NT / 32;
    static_assert(MT == 1 || (MT == 2 && D <= 128), "two row tiles only at head_dim <= 128");
    const int s = blockIdx.x, b = blockIdx.z, tid = threadIdx.x;
    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
    const int RB = gridDim.y / KVH;  // row blocks per kv head
    const int kvh = blockIdx.y / RB, r0 = (blockIdx.y % RB) * RM;
    const int S = gridDim.x;
    const int G = H / KVH;
    const int R = min(RM, G * Tq - r0);  // this CTA's rows: r0 + [0, R)
    const int L = seq_lens[b];
    const int start = s * keys_per_split;
    // The last split takes every key left, so a sequence longer than the plan's cover is
    // still attended whole.
    const int end = s == S - 1 ? L : min(L, start + keys_per_split);
    const int n_tiles = end > start ? (end - start + KT - 1) / KT : 0;

    extern __shared__ __align__(16) unsigned char smem_raw[];
    unsigned char* sbase = smem_raw + (TMA ? (1024 - (smem_u32(smem_raw) & 1023)) & 1023 : 0);
    u16* ring = reinterpret_cast<u16*>(sbase);  // [NS][K tile, V tile]
    u16* qs = reinterpret_cast<u16*>(sbase + SM::Q);  // [RM][STR]
    int* last_flag = reinterpret_cast<int*>(sbase + SM::FLAG);
    const u32 bars = smem_u32(sbase + SM::BARS);  // TMA: stage st's mbarrier at bars + 8 st

    const u16* Kb = K + (size_t)kvh * head_stride;
    const u16* Vb = V + (size_t)kvh * head_stride;
    const int* table = block_table + (size_t)b * max_pages;
    // Q's rows (zero past R).
    for (int c = tid; c < RM * DT; c += NT) {
        const int r = c / DT, col = (c % DT) * 8;
        const bool ok = r < R;
        size_t off = 0;
        if (ok) {
            const int h = kvh * G + (r0 + r) / Tq, i = (r0 + r) % Tq;
            off = (((size_t)b * H + h) * Tq + i) * D + col;
        }
        cp_async16(smem_u32(qs + r * STR + col), Q + off, ok);
    }
    // Q's rows travel in the first commit group (with tile 0 unless TMA brings the tiles).
    DecodeCursor cur{};  // the cp.async loader's (the TMA build copies by tile coordinates)
    if constexpr (!TMA)
        cur = decode_cursor<D>(Kb, Vb, table, start, end, page_size, page_stride, row_stride, tid);
    const int plane = TMA && tma_rows == 0 ? table[0] * KVH + kvh : 0;
    if constexpr (TMA) {
        cp_async_commit();
        if (tid == 0) {
            for (int st = 0; st < NS; ++st) mbar_init(bars + 8 * st, 1);
            asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        }
        __syncthreads();
        if (warp == 0) {
            for (int st = 0; st < NS - 1 && st < n_tiles; ++st)
                decode_tma_tile<D, KT>(smem_u32(ring + st * 2 * TILE), bars + 8 * st, tmk, tmv,
                                       start + st * KT, end, plane, kvh, table, page_size,
                                       tma_rows, lane);
        }
    } else {
#pragma unroll
        for (int st = 0; st < NS - 1; ++st) {
            if (st < n_tiles) {
                decode_load_tile<D, KT, NT>(ring + st * 2 * TILE, ring + st * 2 * TILE + TILE, Kb,
                                            Vb, table, cur, end, page_size, page_stride,
                                            row_stride, tid);
            }
            cp_async_commit();
        }
    }

    // This thread's rows of row tile mt's mma fragments: 16 mt + g and 16 mt + g + 8. Keys at
    // or past lim[mt][r] are masked (the range's end, and the causal bound).
    int lim[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int q = r0 + 16 * mt + g + 8 * r;
            lim[mt][r] = causal ? min(end, q % Tq + L - Tq + 1) : end;
        }
    }
    float o[MT][DT][4];
    float m_run[MT][2], l_run[MT][2];  // l_run: this thread's columns; the quad sums at the end
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) o[mt][dt][0] = o[mt][dt][1] = o[mt][dt][2] = o[mt][dt][3] = 0.f;
        m_run[mt][0] = m_run[mt][1] = NEG_INF;
        l_run[mt][0] = l_run[mt][1] = 0.f;
    }

    for (int t = 0; t < n_tiles; ++t) {
        const int nxt = t + NS - 1;  // loads into the stage tile t - 1 used
        if constexpr (TMA) {
            if (t == 0) cp_async_wait<0>();               // Q
            mbar_wait(bars + 8 * (t % NS), (t / NS) & 1);  // tile t has landed
            __syncthreads();  // Q for every thread; every warp is done with tile t - 1
            if (warp == 0 && nxt < n_tiles)
                decode_tma_tile<D, KT>(smem_u32(ring + (nxt % NS) * 2 * TILE),
                                       bars + 8 * (nxt % NS), tmk, tmv, start + nxt * KT, end,
                                       plane, kvh, table, page_size, tma_rows, lane);
        } else {
            cp_async_wait<NS - 2>();  // tile t has landed
            __syncthreads();  // ... for every thread, and every warp is done with tile t - 1
            if (nxt < n_tiles) {
                u16* st = ring + (nxt % NS) * 2 * TILE;
                decode_load_tile<D, KT, NT>(st, st + TILE, Kb, Vb, table, cur, end, page_size,
                                            page_stride, row_stride, tid);
            }
            cp_async_commit();
        }
        const u16* ks = ring + (t % NS) * 2 * TILE;
        u16* vs = ring + (t % NS) * 2 * TILE + TILE;
        const int kw = start + t * KT + warp * 16;  // this warp's first key
        if (kw >= end) continue;                    // warp-uniform: no key of the warp's 16
        if constexpr (TMA) {
            // The range's last tile: the cache's rows past `end` (up to T, or the next
            // sequence's) may hold anything, NaN included, and P = 0 times NaN is NaN. The warp
            // zeroes its own V rows past `end` (the K rows' scores are masked below). These
            // generic-proxy writes need no proxy fence only because no later TMA copy lands in
            // this stage (it is the range's last tile); a ring reused past it would need
            // fence.proxy.async first.
            if (kw + 16 > end) {
                constexpr int CHUNKS = 16 * (D / 64) * 8;  // 16-byte chunks of the warp's rows
#pragma unroll
                for (int i = lane; i < CHUNKS; i += 32) {
                    const int r = warp * 16 + i / ((D / 64) * 8), p = (i / 8) % (D / 64);
                    if (kw - warp * 16 + r >= end)
                        *reinterpret_cast<uint4*>(reinterpret_cast<unsigned char*>(vs) +
                                                  p * KT * 128 + r * 128 + (i % 8) * 16) =
                            make_uint4(0u, 0u, 0u, 0u);
                }
                __syncwarp();
            }
        }
        // S = Q K^T for the warp's 16 keys: per row tile, two 8-key column tiles; each K
        // fragment serves every row tile.
        float sc[MT][2][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < 2; ++nt)
                sc[mt][nt][0] = sc[mt][nt][1] = sc[mt][nt][2] = sc[mt][nt][3] = 0.f;
#pragma unroll
        for (int kc = 0; kc < D / 16; kc += 2) {
            u32 qa[MT][4], qb[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                const u16* pq = qs + (16 * mt + (lane & 15)) * STR + kc * 16 + (lane >> 4) * 8;
                ldmatrix_x4(qa[mt], smem_u32(pq));
                ldmatrix_x4(qb[mt], smem_u32(pq + 16));
            }
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
                u32 kb[4];
                const int kr = warp * 16 + nt * 8 + (lane & 7), kcol = kc * 16 + (lane >> 3) * 8;
                if constexpr (TMA) {
                    ldmatrix_x4(kb, smem_u32(ks) + sw128_offset<KT>(kr, kcol));
                } else {
                    ldmatrix_x4(kb, smem_u32(ks + kr * STR + kcol));
                }
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma16816<BF16>(sc[mt][nt], qa[mt], kb[0], kb[1]);
                    mma16816<BF16>(sc[mt][nt], qb[mt], kb[2], kb[3]);
                }
            }
        }
        // Online softmax per row: element e of column tile nt is row 16 mt + g + 8 (e >> 1),
        // key kw + nt * 8 + 2 * t4 + (e & 1); the row's 16 keys are spread over the quad.
        float alpha[MT][2];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float mx = NEG_INF;
#pragma unroll
                for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int key = kw + nt * 8 + 2 * t4 + e;
                        float x = sc[mt][nt][2 * r + e] * scale_log2;
                        if (key >= lim[mt][r]) x = NEG_INF;
                        sc[mt][nt][2 * r + e] = x;
                        mx = fmaxf(mx, x);
                    }
                }
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                const float m_new = fmaxf(m_run[mt][r], mx);
                // A row with no visible key so far keeps base 0: every exp2 is of -inf, i.e. 0.
                const float base = m_new == NEG_INF ? 0.f : m_new;
                alpha[mt][r] = fast_exp2(m_run[mt][r] - base);
                m_run[mt][r] = m_new;
                float sum = 0.f;
#pragma unroll
                for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const float p = fast_exp2(sc[mt][nt][2 * r + e] - base);
                        sc[mt][nt][2 * r + e] = p;
                        sum += p;
                    }
                }
                l_run[mt][r] = l_run[mt][r] * alpha[mt][r] + sum;
            }
        }
        // The accumulators' rescale, skipped by the whole warp when no row's maximum moved
        // (every alpha exactly 1: the products would change nothing). After a cache's first
        // tiles the running maxima rarely move, and the rescale is DT * 4 * MT multiplies.
        bool moved = false;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) moved |= alpha[mt][0] != 1.f || alpha[mt][1] != 1.f;
        if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
                for (int dt = 0; dt < DT; ++dt) {
                    o[mt][dt][0] *= alpha[mt][0];
                    o[mt][dt][1] *= alpha[mt][0];
                    o[mt][dt][2] *= alpha[mt][1];
                    o[mt][dt][3] *= alpha[mt][1];
                }
            }
        }
        // O += P V over the warp's 16 keys (pv_step: P's accumulator layout is the A fragment).
        pv_step<MT, 2, DT, TMA ? -KT : STR, BF16>(o, sc, 0, vs, warp * 16, lane);
    }
    cp_async_wait<0>();
    __syncthreads();  // the ring is free: it takes the warps' partials

    float* ob = reinterpret_cast<float*>(sbase);  // [NW][RM][D]: unnormalised outputs
    float* mw = ob + NW * RM * D;                    // [NW][RM]: running maxima
    float* lw = mw + NW * RM;                        // [NW][RM]: running sums
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float l = l_run[mt][r];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            const int row = 16 * mt + g + 8 * r;
            if (t4 == 0) {
                mw[warp * RM + row] = m_run[mt][r];
                lw[warp * RM + row] = l;
            }
#pragma unroll
            for (int dt = 0; dt < DT; ++dt) {
                *reinterpret_cast<float2*>(ob + (warp * RM + row) * D + dt * 8 + 2 * t4) =
                    make_float2(o[mt][dt][2 * r], o[mt][dt][2 * r + 1]);
            }
        }
    }
    __syncthreads();
    // Merge the warps exactly: M = max_w m_w, f_w = 2^(m_w - M), O = sum f_w O_w / sum f_w l_w.
    // One split: the results. Else this split's partials.
    for (int idx = tid; idx < R * D; idx += NT) {
        const int r = idx / D, d = idx % D;
        float m = NEG_INF;
#pragma unroll
        for (int w = 0; w < NW; ++w) m = fmaxf(m, mw[w * RM + r]);
        float l = 0.f, acc = 0.f;
        if (m != NEG_INF) {
#pragma unroll
            for (int w = 0; w < NW; ++w) {
                const float f = fast_exp2(mw[w * RM + r] - m);
                l += f * lw[w * RM + r];
                acc += f * ob[(w * RM + r) * D + d];
            }
        }
        const int h = kvh * G + (r0 + r) / Tq, i = (r0 + r) % Tq;
        const size_t row = ((size_t)b * H + h) * Tq + i;
        const float out = l > 0.f ? __fdividef(acc, l) : 0.f;
        if (S == 1) {
            O[row * D + d] = (u16)(pack2<BF16>(out, 0.f) & 0xffff);
            if (d == 0) LSE[row] = row_lse(m, l);  // as the combine
        } else {
            Opart[(row * S + s) * D + d] = out;
            if (d == 0) Lpart[row * S + s] = l > 0.f ? m + __log2f(l) : NEG_INF;
        }
    }
    if (S == 1) return;
    // The combine, by the split of (b, y) that finishes last.
    __threadfence();  // this CTA's partials are visible device-wide before it counts itself
    __syncthreads();
    int* counter = counters + (size_t)b * gridDim.y + blockIdx.y;
    if (tid == 0) {
        const int before = atomicAdd(counter, 1);
        __threadfence();  // acquire: the other splits' partials before this CTA reads them
        *last_flag = before == S - 1;
        if (before == S - 1) *counter = 0;  // every split has counted: ready for the next call
    }
    __syncthreads();
    if (!*last_flag) return;
    __threadfence();
    decode_combine_rows<D, RM, BF16>(Opart, Lpart, O, LSE, reinterpret_cast<float*>(sbase), R,
                                     b, kvh, r0, G, Tq, H, S, tid);
}
