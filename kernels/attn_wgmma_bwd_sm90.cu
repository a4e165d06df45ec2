// Attention backward on wgmma for compute capability 9.0 (issue 11), written for this project
// after the FlashAttention-2 backward (Dao, 2023, Algorithm 2) with FlashAttention-3's Hopper
// arrangement (Shah et al., 2024: a TMA producer warpgroup, consumer warpgroups that keep dK and
// dV in registers, dQ accumulated in fp32 by TMA reduce-adds). Needs attn_prelude.cuh and
// attn_wgmma_sm90.cu before it (descriptors, mbarriers, TMA, the wgmma wrappers) and
// `-arch=sm_90a`.
//
// Inputs: Q, dO [B, H, Tq, D] and K, V [B, KVH, Tkv, D], bf16, through 3-D tensor maps
// (128-byte swizzle; BM-row boxes for Q and dO, 128-row boxes for K and V); LSE [B, H, Tq]
// (fp32, natural log, +inf for a row that sees no key) and O from the forward; kv_lens [B].
// Masks as the forwards: keys at or past kv_lens[b], bottom-right causal. Outputs dQ (through the
// fp32 accumulator dQacc [B, H, Tq, D] and the convert kernel), dK, dV [B, KVH, Tkv, D] (bf16).
//
// Three kernels per call (four or five with the splits below). BM, the queries per step, is
// 128 at head_dim 64 and 64 at 128 (BwShape), or 80 at 128 in the `_m80` entry (dQ then
// computed transposed, BwShape::DQT), which the host runs at 128 by default (sm90::BwdEnv):
// 1. `attn_bwd_sm90_pre_d*`: per query row, Dsum = sum(dO * O) and LSE2 = LSE * log2(e) into
//    buffers padded to Tq_pad = BM * ceil(Tq / BM) rows per (batch, head) (padding rows get
//    LSE2 = +inf, so their P is 0, and Dsum = 0), so that the main kernel brings each BM-row
//    slice with one bulk copy; dQacc = 0.
// 2. `attn_bwd_sm90_d*`: one CTA per (128-key tile, kv head, batch entry), 3 warpgroups, in
//    the CTA order below.
//    Warpgroup 0, the producer (setmaxnreg down to 24): one thread brings the K and V tile once,
//    then per step the BM-row tiles of Q and dO and the BM LSE2 and Dsum values through BW_ST
//    stages (full/empty mbarriers). Warpgroups 1 and 2, the consumers (setmaxnreg up to 240),
//    own 64 keys each and walk every query head of the kv head's group (GQA) and every BM-row
//    query tile that sees one of the CTA's keys. Per step, for its 64 keys:
//      S^T = K Q^T and dP^T = V dO^T (m64nBM, both operands from shared memory),
//      P^T = 2^(S^T * scale * log2(e) - LSE2) masked, dS^T = P^T (dP^T - Dsum),
//      dV += P^T dO and dK += dS^T Q with P^T and dS^T rounded to bf16 as register A operands,
//    then dS^T goes to shared memory (double-buffered) for dQ = dS K over all 128 keys, after a
//    named barrier over both consumers: at BM = 64 each consumer takes half of dQ's columns, at
//    BM = 128 half of its rows. The fp32 dQ tile goes to dQacc by TMA reduce-adds from a
//    shared-memory staging tile, as FlashAttention-3 does (kernels/TUNING.md has the register
//    atomics this replaced): every CTA of the same (batch, head) adds to the same rows, so the
//    sum's order, and possibly dQ's last bit, vary from run to run (as the portable backward's
//    and FlashAttention's). The alternative, a second pass over query
//    tiles that recomputes S and dP, costs 7 matrix products per tile pair instead of 5. dK and
//    dV are written once at the end (dK times the scale).
// 3. `attn_bwd_sm90_dq_convert`: dQ = scale * dQacc in bf16.
// With SPLITS > 1 (the host's choice where one CTA per key tile, kv head and batch entry would
// leave most SMs idle, as with MQA: src/attention/sm90.rs, bwd_head_splits), the query heads of
// a kv head's group are dealt out to SPLITS CTAs per key tile (grid.y = KVH * SPLITS), each
// writing its fp32 partial dK (unscaled) and dV to its own slice of dkv_part
// [SPLITS][2][B * KVH * Tkv * D], and 4. `attn_bwd_sm90_dkv_combine` adds the slices in slice
// order (a fixed order: dK and dV still repeat bit for bit) into dK (times the scale) and dV.
// The tail split (sm90::bwd_tail_split, not causal, SPLITS = 1): the CTAs of a short last wave
// run as parts over shares of their query steps, writing fp32 partial dK and dV that
// 5. `attn_bwd_sm90_tail_combine_d*` adds in part order.
// CTA order: the main kernel's grid is 1-D, n_kt key tiles × KVH · SPLITS × B CTAs, and the
// `order` argument says how a CTA's index maps to its (key tile, kv head · split, batch entry).
// The hardware starts CTAs in index order as SMs free up, so under the causal mask, where key
// tile kt is seen by the query tiles from kt on and the first tiles' CTAs have the most work,
// order matters once the grid is a few waves: 0 runs a (kv head, batch entry)'s key tiles
// together (tile fastest; their Q and dO reads share L2), 1 starts every CTA of key tile 0
// before any of tile 1 (longest first: the tail is the shortest CTAs), 2 does that within each
// batch entry, 3 within each chunk of `chunk` (kv head · split, batch entry) pairs, so that
// only a chunk's Q and dO are read at a time. The host picks (sm90::bwd_cta_order simulates
// the schedules).

// 128 keys per CTA, stages of Q/dO/LSE2/Dsum; queries per step (BM): 128 at head_dim 64; at 128,
// 80 in the `_m80` entry (FlashAttention-3's step without the causal mask; the host's default
// under both masks since 2026-12-07) or 64 in the plain entry (KP_SM90_BWD_BM=64; the registers
// of S^T and dP^T, 2 x BM / 2 per thread beside dK and dV's D, rule out 128).
#define BW_BN 128
#define BW_ST 2
template <int D, int BM_ = (D == 64 ? 128 : 64)>
struct BwShape {
    static constexpr int BM = BM_;  // queries per step
    // BM = 80 is not a multiple of wgmma's 64 rows, so dQ is computed transposed there: dQ^T =
    // K^T dS (D x BM per step), each consumer 64 of its rows (head_dim columns), dS in shared
    // memory query-major ([query][key], K-major for the product).
    static constexpr bool DQT = BM % 64 != 0;
    // dQ of a step per consumer: BM = 64, half of the columns for all 64 rows; BM = 128, all
    // columns for the consumer's half of the rows (64 each); BM = 80 (DQT), 64 columns for all
    // BM rows. 64 columns in every case.
    static constexpr int DQN = DQT ? 64 : (BM == 64 ? D / 2 : D);
    static_assert(DQN == 64, "dQ's product is 64 head_dim columns per consumer");
    static_assert(!DQT || (D == 128 && BM % 16 == 0 && BM <= 256), "dQ^T: head_dim 128, BM % 16");
};

// Shared-memory plan of attn_bwd_sm90 (bytes from the 1024-aligned base): the K and V tile,
// BW_ST stages of Q and of dO (BM rows), two dS^T buffers (128 keys x BM queries, BM / 64
// 128-byte panels; with DQT, dS as BM query rows x 2 panels of 64 keys), BW_ST stages of LSE2
// and Dsum (BM floats each), two fp32 dQ staging tiles, then the mbarriers (K/V, then per stage
// full and empty). With DQT the LSE2/Dsum stages (BW_ST x 640 bytes, not a multiple of 1024)
// follow the staging tiles, which must stay 1024-aligned.
template <int D, int BM_ = BwShape<D>::BM>
struct BwPlan {
    static constexpr int BM = BM_;
    static constexpr bool DQT = BwShape<D, BM>::DQT;
    static constexpr u32 KV_TILE = BW_BN * D * 2;
    static constexpr u32 Q_TILE = BM * D * 2;
    static constexpr u32 DS_TILE = BW_BN * BM * 2;
    static constexpr u32 LD_STAGE = 2 * BM * 4;
    static constexpr u32 K = 0;
    static constexpr u32 V = KV_TILE;
    static constexpr u32 Q = 2 * KV_TILE;
    static constexpr u32 DO = Q + BW_ST * Q_TILE;
    static constexpr u32 DS = DO + BW_ST * Q_TILE;
    // Each consumer's fp32 dQ tile (64 rows x DQN columns, or with DQT BM rows x 64 columns)
    // for the TMA reduce-add, in boxes of 32 columns (128-byte swizzled rows), 1024-aligned.
    static constexpr u32 DQ_TILE = (DQT ? BM : 64) * BwShape<D, BM>::DQN * 4;
    static constexpr u32 LD = DQT ? DS + 2 * DS_TILE + 2 * DQ_TILE : DS + 2 * DS_TILE;
    static constexpr u32 DQ = DQT ? DS + 2 * DS_TILE : LD + BW_ST * LD_STAGE;
    static constexpr u32 BARS = DQT ? LD + BW_ST * LD_STAGE : DQ + 2 * DQ_TILE;
    static constexpr u32 BYTES = BARS + 8 * (1 + 2 * BW_ST);
    static_assert(DQ % 1024 == 0 && DS % 1024 == 0 && Q_TILE % 1024 == 0, "swizzled tiles");
};

// D (64 x 80, fp32: 40 accumulators per thread) += A (64 x 16) * B (16 x 80), both from shared
// memory, A K-major (TRANS_A = 0) or M-major (1), B K-major (TRANS_B = 0) or N-major (1).
#define WG_REGS40                                                                                \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
    "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "  \
    "%38, %39}"
template <int TRANS_A, int TRANS_B>
__device__ __forceinline__ void wgmma_m64n80k16_ss(float (&d)[40], uint64_t desc_a,
                                                   uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %42, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n80k16" WG_AB
        WG_REGS40 ", %40, %41, p, 1, 1, %43, %44;\n}\n"
        : WG_ACC32(d), WG_ACC8(d, 32)
        : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TRANS_A), "n"(TRANS_B));
}

// Four 8 x 8 matrices of 16-bit values from registers (r[i]: this lane's pair of matrix i, in
// the mma fragment layout: row lane / 4, columns 2 (lane % 4) and + 1) to shared memory
// transposed: row j of matrix i (column j of the fragment) goes to the 16 bytes at `addr` of
// lane 8 i + j.
__device__ __forceinline__ void stmatrix_x4_trans(u32 addr, const u32 (&r)[4]) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(
                     addr),
                 "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
                 : "memory");
}

// D (64 x 64, fp32) += A (64 x 16) * B (16 x 64), both from shared memory and both MN-major
// (transposed): A's 64 rows contiguous per k, B's 64 columns contiguous per k.
__device__ __forceinline__ void wgmma_m64n64k16_ss_tt(float (&d)[32], uint64_t desc_a,
                                                      uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16" WG_AB
        WG_REGS32 ", %32, %33, p, 1, 1, 1, 1;\n}\n"
        : WG_ACC32(d)
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// A bulk copy of `bytes` (a multiple of 16, 16-byte aligned both ends) from global memory into
// shared memory, counted towards barrier `bar`'s transactions.
__device__ __forceinline__ void bulk_load(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
        ::"r"(dst), "l"(src), "r"(bytes), "r"(bar)
        : "memory");
}

// Adds the fp32 box at `src` (shared memory) into the tensor of `map` at element coordinates
// (c0, c1, c2) (TMA reduce-add; out-of-bounds elements are skipped), as one bulk group.
__device__ __forceinline__ void tma_reduce_add_3d(const TmaMap* map, u32 src, int c0, int c1,
                                                  int c2) {
    asm volatile(
        "cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group "
        "[%0, {%1, %2, %3}], [%4];\n" ::"l"(reinterpret_cast<uint64_t>(map)),
        "r"(c0), "r"(c1), "r"(c2), "r"(src)
        : "memory");
}
__device__ __forceinline__ void bulk_commit() {
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
// Waits until every bulk group this thread committed has finished reading shared memory.
__device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}

// A barrier over `count` threads (a multiple of 32) with id `id` (1..15; 0 is __syncthreads).
__device__ __forceinline__ void named_barrier(int id, int count) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

// One warp per padded query row r of [B * H][Tq_pad]: Dsum and LSE2 as the file's header says;
// the row's dQacc zeroed.
template <int D>
__device__ __forceinline__ void attn_bwd_sm90_pre(const u16* __restrict__ O,
                                                  const u16* __restrict__ dO,
                                                  const float* __restrict__ LSE,
                                                  float* __restrict__ dsum, float* __restrict__ lse2,
                                                  float* __restrict__ dqacc, int Tq, int Tq_pad,
                                                  int rows_pad) {
    const int r = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (r >= rows_pad) return;
    const int bh = r / Tq_pad, i = r % Tq_pad;
    if (i >= Tq) {
        if (lane == 0) {
            dsum[r] = 0.f;
            lse2[r] = POS_INF;
        }
        return;
    }
    const size_t row = (size_t)bh * Tq + i;
    float acc = 0.f;
#pragma unroll
    for (int e = lane; e < D; e += 32) {
        acc += to_f32<KP_WG_BF16>(O[row * D + e]) * to_f32<KP_WG_BF16>(dO[row * D + e]);
        dqacc[row * D + e] = 0.f;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffff, acc, o);
    if (lane == 0) {
        dsum[r] = acc;
        lse2[r] = LSE[row] * 1.4426950408889634f;
    }
}

// The (key tile kt, kv head · split y, batch entry b) of the main kernel's CTA i in a 1-D grid
// of n_kt x n_y x B, which the hardware starts in index order (the file's header, CTA order):
// order 0 runs the key tiles fastest, 1 slowest (longest first under the causal mask), 2 the
// batch entries slowest, then the key tiles, 3 key tiles slowest within chunks of `chunk` pairs.
__device__ __forceinline__ void bwd_cta_coords(unsigned i, int order, int chunk, unsigned n_kt,
                                               unsigned n_y, int B, int& kt, int& y, int& b) {
    if (order == 1) {
        y = i % n_y;
        b = (i / n_y) % B;
        kt = i / n_y / B;
    } else if (order == 2) {
        y = i % n_y;
        kt = (i / n_y) % n_kt;
        b = i / n_y / n_kt;
    } else if (order == 3) {
        // Pairs p = y + n_y b in chunks of `chunk` (the last may hold fewer), key tiles slowest
        // within a chunk.
        const unsigned per = (unsigned)chunk * n_kt;
        const unsigned first = i / per * chunk, r = i % per;
        const unsigned here = min((unsigned)chunk, n_y * (unsigned)B - first);
        const unsigned p = first + r % here;
        kt = r / here;
        y = p % n_y;
        b = p / n_y;
    } else {
        kt = i % n_kt;
        y = (i / n_kt) % n_y;
        b = i / n_kt / n_y;
    }
}

// The main kernel (the file's header, 2.), BM queries per step (BwShape). FX: the dense
// kernels take NoFlex (attn_wgmma_sm90.cu); flex_attn_bwd_sm90.cu passes hooks whose ON is true
// and the transposed block mask in `fx` (FlexTiles: count[(b H + h) n_kt + kt] query tiles
// listed for key tile kt, at index[((b H + h) n_kt + kt) n_qt ..], full[...] = 1 where the mask
// leaves the tile whole). A CTA then walks, head after head of its group, the listed query
// tiles only; FX::prob gives P^T (the mask in partial tiles, the score modification where the
// hooks have one) and the derivative dS^T takes; everything else is the dense kernel's, with
// one CTA per (key tile, kv head, batch entry): no head split, no tail split.
template <int D, int BM, bool CAUSAL, class FX = NoFlex>
__device__ __forceinline__ void attn_bwd_sm90(const TmaMap* tq, const TmaMap* tk, const TmaMap* tv,
                                              const TmaMap* tdo, const TmaMap* tdq,
                                              const float* __restrict__ lse2,
                                              const float* __restrict__ dsum,
                                              const int* __restrict__ kv_lens,
                                              u16* __restrict__ dK,
                                              u16* __restrict__ dV, float* __restrict__ dkv_part,
                                              int splits, int Tq, int Tkv, int H, int KVH,
                                              int Tq_pad, float scale_log2, float scale, int B,
                                              int order, int chunk, int tail_whole,
                                              int tail_parts, float* __restrict__ tail_buf,
                                              const FlexTiles& fx = FlexTiles{}) {
    using P = BwPlan<D, BM>;
    static_assert(!FX::ON || !CAUSAL, "flex: the mask is the generated one");
    constexpr int PANELS = D / 64, DT = D / 8;
    constexpr int NQ = BM / 8, DQN = BwShape<D, BM>::DQN;
    constexpr bool DQT = P::DQT;
    const u32 base = (smem_u32(dyn_smem) + 1023u) & ~1023u;
    const u32 bar_kv = base + P::BARS;
    auto full = [&](int s) { return base + P::BARS + 8u * (1 + 2 * s); };
    auto empty = [&](int s) { return base + P::BARS + 8u * (2 + 2 * s); };
    const int tid = threadIdx.x, wg = tid >> 7;
    // The CTA's (key tile, kv head · split, batch entry) from its place in the 1-D grid
    // (bwd_cta_coords). The tail split (the host's sm90::bwd_tail_split, without the causal
    // mask and the head split): CTAs from `tail_whole` on are `tail_parts` parts of each of the
    // last n_cta - tail_whole CTAs' work (part p of CTA tail_whole + t at tail_whole + p * tail
    // + t), each over a contiguous share of its steps, writing fp32 partial dK (unscaled) and dV
    // to tail_buf for the tail combine.
    const unsigned n_y = KVH * splits;
    const unsigned n_kt = ((unsigned)Tkv + BW_BN - 1) / BW_BN;
    unsigned vi = blockIdx.x;
    int part = 0, tail_t = 0;
    if (tail_parts > 1 && vi >= (unsigned)tail_whole) {
        const unsigned tail = n_kt * n_y * (unsigned)B - (unsigned)tail_whole;
        part = (vi - tail_whole) / tail;
        tail_t = (vi - tail_whole) % tail;
        vi = tail_whole + tail_t;
    }
    int kt, y, b;
    bwd_cta_coords(vi, order, chunk, n_kt, n_y, B, kt, y, b);
    const int kvh = y / splits, sp = y % splits;
    const int group = H / KVH;
    // This CTA's query heads of the group: [h_lo, h_hi) (all of them without a split).
    const int h_lo = sp * group / splits, h_hi = (sp + 1) * group / splits;
    const int L = min(kv_lens[b], Tkv);
    const int off = L - Tq;  // bottom-right: row i sees keys j <= i + off
    const int k0 = kt * BW_BN;
    const int i_min = CAUSAL ? max(0, k0 - off) : 0;
    const int qt_first = i_min / BM;
    const int n_qt = (Tq + BM - 1) / BM;
    const int per_head = (L > k0 && qt_first < n_qt) ? n_qt - qt_first : 0;
    int n_all = per_head * (h_hi - h_lo);
    if constexpr (FX::ON) {
        n_all = 0;
        for (int hh = h_lo; hh < h_hi; ++hh)
            n_all += fx.count[((size_t)b * H + kvh * group + hh) * n_kt + kt];
    }
    // flex: the next listed step of the producer's walker (head hh of the group, its list's
    // entry i): its head, first query row and whether the mask leaves the tile whole. Called
    // only for a step that exists, so the loop over empty lists ends. The producer hands the
    // three to the consumers through shared memory past the dense plan (8 bytes a stage at
    // flex_info, written before the stage's arrive, read after its wait; the host allocates
    // them), so that the consumers hold no walker and load no list.
    struct FlexWalk {
        int hh, i;
    };
    const u32 flex_info = base + P::BYTES;
    auto flex_step = [&](FlexWalk& w, int& h, int& q0, bool& whole) {
        size_t cell = ((size_t)b * H + kvh * group + w.hh) * n_kt + kt;
        while (fx.count[cell] <= w.i) {
            ++w.hh;
            w.i = 0;
            cell += n_kt;
        }
        h = kvh * group + w.hh;
        const size_t at = cell * n_qt + w.i;
        q0 = fx.index[at] * BM;
        whole = fx.full[at] != 0;
        ++w.i;
    };
    // This CTA's steps [it_lo, it_lo + n_it) of the n_all its (key tile, kv head, batch entry)
    // has: all of them unless the tail split cut it into parts.
    const int nparts = (tail_parts > 1 && blockIdx.x >= (unsigned)tail_whole) ? tail_parts : 1;
    const int it_lo = (int)((long long)part * n_all / nparts);
    const int n_it = (int)((long long)(part + 1) * n_all / nparts) - it_lo;

    if (tid == 0) {
        mbar_init(bar_kv, 1);
        for (int s = 0; s < BW_ST; ++s) {
            mbar_init(full(s), 1);
            mbar_init(empty(s), 256);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (wg == 0) {
        // 128 x 24 + 256 x 240 registers: at most the 64 K of one SM.
        asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n" ::: "memory");
        if (tid == 0 && n_it > 0) {
            mbar_expect_tx(bar_kv, 2 * P::KV_TILE);
#pragma unroll
            for (int p = 0; p < PANELS; ++p) {
                tma_load_3d(base + P::K + p * BW_BN * 128, tk, bar_kv, 64 * p, k0, b * KVH + kvh);
                tma_load_3d(base + P::V + p * BW_BN * 128, tv, bar_kv, 64 * p, k0, b * KVH + kvh);
            }
            FlexWalk walk{h_lo, 0};
            for (int it = 0; it < n_it; ++it) {
                const int s = it % BW_ST;
                if (it >= BW_ST) mbar_wait(empty(s), ((it / BW_ST) + 1) & 1);
                int h, q0;
                if constexpr (FX::ON) {
                    bool whole;
                    flex_step(walk, h, q0, whole);
                    asm volatile("st.shared.v2.u32 [%0], {%1, %2};\n" ::"r"(flex_info + 8 * s),
                                 "r"(h), "r"(2 * q0 + (whole ? 1 : 0))
                                 : "memory");
                } else {
                    h = kvh * group + h_lo + (it_lo + it) / per_head;
                    q0 = (qt_first + (it_lo + it) % per_head) * BM;
                }
                mbar_expect_tx(full(s), 2 * P::Q_TILE + P::LD_STAGE);
#pragma unroll
                for (int p = 0; p < PANELS; ++p) {
                    tma_load_3d(base + P::Q + s * P::Q_TILE + p * BM * 128, tq, full(s), 64 * p,
                                q0, b * H + h);
                    tma_load_3d(base + P::DO + s * P::Q_TILE + p * BM * 128, tdo, full(s),
                                64 * p, q0, b * H + h);
                }
                const size_t lrow = (size_t)(b * H + h) * Tq_pad + q0;
                bulk_load(base + P::LD + s * P::LD_STAGE, lse2 + lrow, BM * 4, full(s));
                bulk_load(base + P::LD + s * P::LD_STAGE + BM * 4, dsum + lrow, BM * 4, full(s));
            }
        }
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n" ::: "memory");
    const int c = wg - 1;  // consumer: keys k0 + 64 c .. k0 + 64 c + 63
    const int warp = (tid >> 5) & 3, lane = tid & 31;
    const int g = lane >> 2, t4 = lane & 3;
    const int kc0 = k0 + 64 * c;
    const int key0 = kc0 + 16 * warp + g;  // this thread's keys: key0, key0 + 8
    const u32 sk = base + P::K + 64 * c * 128;  // this consumer's 64 rows of K (panel 0)
    const u32 sv = base + P::V + 64 * c * 128;

    float dk[1][DT][4], dv[1][DT][4];
#pragma unroll
    for (int i = 0; i < DT; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) dk[0][i][e] = dv[0][i][e] = 0.f;
    float(&dkf)[D / 2] = reinterpret_cast<float(&)[D / 2]>(dk);
    float(&dvf)[D / 2] = reinterpret_cast<float(&)[D / 2]>(dv);

    // This consumer's part of a step's dQ: rows [dq_r0, dq_r0 + 64) and columns [dq_c0,
    // dq_c0 + DQN) of the step's BM x D tile (BwShape), as an m64 accumulator; with DQT, all BM
    // rows of columns [64 c, 64 c + 64) as the m64nBM accumulator of dQ^T.
    const int dq_r0 = (BM == 64 || DQT) ? 0 : 64 * c;
    const int dq_c0 = (BM == 64 || DQT) ? DQN * c : 0;
    float dq[DQT ? BM / 2 : DQN / 2];
    // dQ's operands: A = dS, the dS^T buffer read transposed (panel c when BM = 128); B = K's
    // columns [dq_c0, dq_c0 + 64): panel c at head_dim 128, panel 0 at 64. With DQT, dQ^T's A
    // is that panel of K read transposed and B the dS buffer (query-major).
    const u32 sds_off = (BM == 64 || DQT) ? 0u : (u32)c * BW_BN * 128;
    const u32 sk_dq = base + P::K + (dq_c0 / 64) * BW_BN * 128;
    // This consumer's dQ staging tile (fp32, boxes of 32 columns); its elected thread issues
    // the reduce-adds.
    const u32 sdq = base + P::DQ + c * P::DQ_TILE;
    const bool elected = (tid & 127) == 0;

    float st[1][NQ][4], dpt[1][NQ][4];
    // The order of a step's last three products. At head_dim 128, FlashAttention-3's: dV
    // before the dS^T store and barrier (it needs only P^T), then dQ and dK, the dQ tile stored
    // while dK runs. At 64, dV, dK and dQ issued together after the barrier and waited for
    // before the dQ tile goes out: FlashAttention-3's order measured 2-3 % slower there without
    // the mask (kernels/TUNING.md, "FlashAttention-3's product order").
    constexpr bool FA3_ORDER = D == 128;
    // One step: the queries [q0, q0 + 8 NS) of step `it`.
    auto step = [&](int it) {
        constexpr int NS = NQ;
        constexpr int SQ = 8 * NS;  // queries computed
        float(&sts)[1][NS][4] = reinterpret_cast<float(&)[1][NS][4]>(st);
        float(&dps)[1][NS][4] = reinterpret_cast<float(&)[1][NS][4]>(dpt);
        float(&stf)[SQ / 2] = reinterpret_cast<float(&)[SQ / 2]>(st);
        float(&dpf)[SQ / 2] = reinterpret_cast<float(&)[SQ / 2]>(dpt);
        const int s = it % BW_ST;
        int h = 0, q0 = 0;
        bool whole = true;
        if constexpr (!FX::ON) {
            h = kvh * group + h_lo + (it_lo + it) / per_head;
            q0 = (qt_first + (it_lo + it) % per_head) * BM;
        }
        const u32 sq = base + P::Q + s * P::Q_TILE;
        const u32 sdo = base + P::DO + s * P::Q_TILE;
        const u32 sds = base + P::DS + (it & 1) * P::DS_TILE;
        const float* l_s = reinterpret_cast<const float*>(dyn_smem + (base - smem_u32(dyn_smem)) +
                                                          P::LD + s * P::LD_STAGE);
        const float* d_s = l_s + BM;
        mbar_wait(full(s), (it / BW_ST) & 1);
        if constexpr (FX::ON) {
            u32 hh, qw;
            asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n"
                         : "=r"(hh), "=r"(qw)
                         : "r"(flex_info + 8 * s)
                         : "memory");
            h = (int)hh;
            q0 = (int)(qw >> 1);
            whole = qw & 1;
        }

        // S^T = K Q^T and dP^T = V dO^T (64 keys x SQ queries each), two commit groups.
        auto kq = [&](float(&acc)[SQ / 2], u32 sa, u32 sb) {
            wgmma_fence();
#pragma unroll
            for (int ks = 0; ks < D / 16; ++ks) {
                const u32 koff = (u32)(ks & 3) * 32u;
                const uint64_t da =
                    smem_desc_sw128(sa + (ks >> 2) * BW_BN * 128 + koff, 16, 1024);
                const uint64_t db = smem_desc_sw128(sb + (ks >> 2) * BM * 128 + koff, 16, 1024);
                if constexpr (SQ == 128) {
                    wgmma_m64n128k16_ss(acc, da, db, ks > 0);
                } else if constexpr (SQ == 80) {
                    wgmma_m64n80k16_ss<0, 0>(acc, da, db, ks > 0);
                } else {
                    wgmma_m64n64k16_ss<0>(acc, da, db, ks > 0);
                }
            }
            wgmma_commit();
        };
        kq(stf, sk, sq);
        kq(dpf, sv, sdo);

        if constexpr (FX::ON) {
            // flex: P^T from FX::prob and dS^T = P^T (dP^T - Dsum) times the score
            // modification's derivative in one pass once both products are in (with dP^T's
            // accumulators in flight as well, the mask's partial tiles spilled at head_dim 64).
            wgmma_wait<0>();
#pragma unroll
            for (int j = 0; j < NS; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int ql = 8 * j + 2 * t4 + (e & 1);
                    float grad;
                    const float x =
                        FX::prob(sts[0][j][e], l_s[ql], !whole, b, h, q0 + ql,
                                 key0 + (e >> 1) * 8, Tq, Tkv, H, L, scale_log2, fx, grad);
                    sts[0][j][e] = x;
                    dps[0][j][e] = x * (dps[0][j][e] - d_s[ql]) * grad;
                }
        } else {
            // P^T = 2^(S^T scale log2(e) - LSE2), masked (keys at or past L, bottom-right causal),
            // while dP^T is in flight.
            wgmma_wait<1>();
            const bool edge = kc0 + 64 > L || (CAUSAL && kc0 + 63 > q0 + off);
#pragma unroll
            for (int j = 0; j < NS; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int ql = 8 * j + 2 * t4 + (e & 1);
                    float x = fast_exp2(fmaf(sts[0][j][e], scale_log2, -l_s[ql]));
                    if (edge) {
                        const int key = key0 + (e >> 1) * 8;
                        if (key >= L || (CAUSAL && key > q0 + ql + off)) x = 0.f;
                    }
                    sts[0][j][e] = x;
                }
            wgmma_wait<0>();
            // dS^T = P^T (dP^T - Dsum), both rounded to bf16 as register A operands.
#pragma unroll
            for (int j = 0; j < NS; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int ql = 8 * j + 2 * t4 + (e & 1);
                    dps[0][j][e] = sts[0][j][e] * (dps[0][j][e] - d_s[ql]);
                }
        }
        u32 pa[SQ / 16][4], dsa[SQ / 16][4];
        pack_p<NS>(sts, pa);
        pack_p<NS>(dps, dsa);
        // acc += A B for one k-step: dV += P^T dO and dK += dS^T Q (queries = the reduction),
        // A = P^T or dS^T as register operands, B = dO or Q (MN-major) at descriptor `desc`.
        auto mma_rs = [&](float(&acc)[D / 2], u32(&a)[4], uint64_t desc) {
            if constexpr (D == 128) {
                wgmma_m64n128k16_rs<1>(acc, a, desc, 1);
            } else {
                wgmma_m64n64k16_rs<1>(acc, a, desc, 1);
            }
        };
        // The k-step ks descriptors of dO and Q.
        auto desc_do = [&](int ks) { return smem_desc_sw128(sdo + ks * 16 * 128, BM * 128, 1024); };
        auto desc_q = [&](int ks) { return smem_desc_sw128(sq + ks * 16 * 128, BM * 128, 1024); };
        // dQ = dS K (both operands transposed from shared memory), or with DQT dQ^T = K^T dS:
        // A = K's panel c (keys x 64 columns) read transposed, B = the dS buffer's BM query rows
        // (K-major: 16-key step ks in panel ks / 4).
        auto mma_dq = [&]() {
            if constexpr (DQT) {
#pragma unroll
                for (int ks = 0; ks < BW_BN / 16; ++ks) {
                    const uint64_t da = smem_desc_sw128(sk_dq + ks * 16 * 128, BW_BN * 128, 1024);
                    const uint64_t db = smem_desc_sw128(
                        sds + (ks >> 2) * BM * 128 + (u32)(ks & 3) * 32u, 16, 1024);
                    wgmma_m64n80k16_ss<1, 0>(dq, da, db, ks > 0);
                }
            } else {
#pragma unroll
                for (int ks = 0; ks < BW_BN / 16; ++ks) {
                    const uint64_t da =
                        smem_desc_sw128(sds + sds_off + ks * 16 * 128, 64 * 128, 1024);
                    const uint64_t db =
                        smem_desc_sw128(sk_dq + ks * 16 * 128, BW_BN * 128, 1024);
                    wgmma_m64n64k16_ss_tt(dq, da, db, ks > 0);
                }
            }
        };
        if constexpr (FA3_ORDER) {
            // dV first: it needs only P^T, so it runs while dS^T goes to shared memory and the
            // consumers meet at the barrier below.
            wgmma_fence();
#pragma unroll
            for (int ks = 0; ks < SQ / 16; ++ks) mma_rs(dvf, pa[ks], desc_do(ks));
            wgmma_commit();
        }
        // The previous step's reduce-add has read the staging tile before anyone passes the
        // barrier below (and so before the tile is written again).
        if (elected) bulk_wait_read();
        // dS^T to its buffer (panels of 64 queries; 128-byte swizzle: 16-byte chunk k of key row
        // r at k ^ (r % 8)), visible to wgmma and to both consumers. With DQT, dS (query rows,
        // this consumer's 64 keys = panel c) by transposing stores: 8 x 8 block i of 16 keys x
        // 16 queries kc goes to query rows 16 kc + 8 (i / 2) + j, keys 16 warp + 8 (i % 2) + 0..7,
        // chunk (2 warp + i % 2) ^ (row % 8): conflict-free.
        if constexpr (DQT) {
            const int i = lane >> 3, j = lane & 7;
            const u32 chunk = (u32)((2 * warp + (i & 1)) ^ j) << 4;
#pragma unroll
            for (int kc = 0; kc < NS / 2; ++kc) {
                const int q = 16 * kc + 8 * (i >> 1) + j;
                stmatrix_x4_trans(sds + (u32)c * (BM * 128) + (u32)q * 128 + chunk, dsa[kc]);
            }
        } else {
            const int r0 = 64 * c + 16 * warp + g;
#pragma unroll
            for (int j = 0; j < NS; ++j)
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    const int r = r0 + 8 * hf;
                    const u32 addr = sds + (j >> 3) * (BW_BN * 128) + r * 128 +
                                     (((j & 7) ^ (r & 7)) << 4) + 4 * t4;
                    const u32 w = dsa[j >> 1][(j & 1) * 2 + hf];
                    asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(w) : "memory");
                }
        }
        fence_proxy_async();
        named_barrier(1, 256);
        // With DQT, dV is waited for before dQ^T starts, so that P^T's registers are free
        // before dQ^T's 40 accumulators are live: with both (128 + 40 + 2 x 20 beside the
        // addresses) ptxas found too few of the 240 registers and waited after every wgmma of
        // the kernel (advisory C7512). dV has had the dS^T stores and the barrier to finish.
        if constexpr (DQT) wgmma_wait<0>();

        wgmma_fence();
        if constexpr (FA3_ORDER) {
            // dQ, then dK, each its own group; wait for dV and dQ only: dK runs while the dQ
            // tile goes out below, and is waited for before the stage is released.
            mma_dq();
            wgmma_commit();
#pragma unroll
            for (int ks = 0; ks < SQ / 16; ++ks) mma_rs(dkf, dsa[ks], desc_q(ks));
            wgmma_commit();
            wgmma_wait<1>();
        } else {
            // Both descriptors before both products, as measured.
#pragma unroll
            for (int ks = 0; ks < SQ / 16; ++ks) {
                const uint64_t ddo = desc_do(ks), dqo = desc_q(ks);
                mma_rs(dvf, pa[ks], ddo);
                mma_rs(dkf, dsa[ks], dqo);
            }
            mma_dq();
            wgmma_commit();
            wgmma_wait<0>();
            mbar_arrive(empty(s));
        }
        // The dQ tile to shared memory (boxes of 32 columns, 16-byte chunk k of row r at
        // k ^ (r % 8)), then one TMA reduce-add per box (rows past Tq are out of the tensor
        // map's bounds: skipped). An 8-byte store is served a half-warp at a time, and there
        // lanes g and g ^ 1 (rows r and r ^ 1) would put the same two columns' chunk at the same
        // swizzled place: 2-way bank conflicts. So in store j a lane writes the column block
        // jj = j ^ (g % 4) of its aligned group of four (the same 32-column box): the half-warp's
        // 8 (row, chunk) pairs then fill 8 distinct chunk places, all 32 banks.
        if constexpr (DQT) {
            // dQ^T's element (column 16 warp + g + 8 hf of the consumer's 64, query 8 j + 2 t4
            // + e) at query row q of box (warp / 2), chunk ((column % 32) / 4) ^ (q % 8): 4-byte
            // stores, the warp's 32 lanes on 32 banks (the chunk is C ^ 2 t4 ^ (g / 4 ^ e) with C
            // even, word g % 4).
#pragma unroll
            for (int j = 0; j < BM / 8; ++j)
#pragma unroll
                for (int hf = 0; hf < 2; ++hf)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int col = 16 * (warp & 1) + g + 8 * hf, q = 8 * j + 2 * t4 + e;
                        const u32 addr = sdq + (warp >> 1) * (BM * 128) + q * 128 +
                                         ((((col >> 2) ^ (q & 7))) << 4) + (col & 3) * 4;
                        asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(addr),
                                     "f"(dq[4 * j + 2 * hf + e])
                                     : "memory");
                    }
        } else {
            const int sw = g & 3;
#pragma unroll
            for (int j = 0; j < DQN / 8; ++j)
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    const int r = 16 * warp + g + 8 * hf;
                    const int jj = j ^ sw;
                    const int col = 8 * jj + 2 * t4, cc = col & 31;
                    const u32 addr = sdq + (col >> 5) * (64 * 128) + r * 128 +
                                     (((cc >> 2) ^ (r & 7)) << 4) + (cc & 3) * 4;
                    // dq[4 jj + 2 hf + e] without indexing registers at run time: a select
                    // over the group's four blocks.
                    float v[2];
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int o = 4 * (j & ~3) + 2 * hf + e;
                        const float a0 = dq[o + 4 * (0 ^ (j & 3))];
                        const float a1 = dq[o + 4 * (1 ^ (j & 3))];
                        const float a2 = dq[o + 4 * (2 ^ (j & 3))];
                        const float a3 = dq[o + 4 * (3 ^ (j & 3))];
                        const float lo = (sw & 1) ? a1 : a0, hi = (sw & 1) ? a3 : a2;
                        v[e] = (sw & 2) ? hi : lo;
                    }
                    asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(v[0]),
                                 "f"(v[1])
                                 : "memory");
                }
        }
        fence_proxy_async();
        named_barrier(2 + c, 128);
        if (elected) {
#pragma unroll
            for (int bx = 0; bx < DQN / 32; ++bx)
                tma_reduce_add_3d(tdq, sdq + bx * ((DQT ? BM : 64) * 128), dq_c0 + 32 * bx,
                                  q0 + dq_r0, b * H + h);
            bulk_commit();
        }
        if constexpr (FA3_ORDER) {
            wgmma_wait<0>();
            mbar_arrive(empty(s));
        }
    };

    if (n_it > 0) mbar_wait(bar_kv, 0);
    // Every step whole, the last partial one too (its rows past Tq are TMA's zeros and add
    // nothing). A half step for a last tile of at most 64 rows at head_dim 64 (until
    // 2026-12-06) made ptxas wait after every wgmma of the kernel, the whole steps' too.
    for (int it = 0; it < n_it; ++it) step(it);
    if (elected) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");

    // dK (scaled) and dV, this thread's two keys; keys past L hold 0 (no contribution). With
    // a split, this CTA's fp32 partial sums (dK unscaled) to its slice of dkv_part instead,
    // every key of the tile below Tkv written (zeros where its heads saw none), so that the
    // combine reads a whole slice.
    if (nparts > 1) {
        // The tail split's partial sums: all 128 keys of the tile (the combine skips those
        // past Tkv), [key][D] per (tail CTA, part), dK then dV.
        float* const tk_ = tail_buf + ((size_t)tail_t * nparts + part) * 2 * (BW_BN * D);
        float* const tv_ = tk_ + BW_BN * D;
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int kl = 64 * c + 16 * warp + g + 8 * hf;
#pragma unroll
            for (int j = 0; j < DT; ++j) {
                const int o = kl * D + 8 * j + 2 * t4;
                *reinterpret_cast<float2*>(tk_ + o) =
                    make_float2(dk[0][j][2 * hf], dk[0][j][2 * hf + 1]);
                *reinterpret_cast<float2*>(tv_ + o) =
                    make_float2(dv[0][j][2 * hf], dv[0][j][2 * hf + 1]);
            }
        }
        return;
    }
    const size_t kv_base = (size_t)(b * KVH + kvh) * Tkv * D;
    const size_t n_kv = (size_t)B * KVH * Tkv * D;
    float* const pk = dkv_part + (size_t)(2 * sp) * n_kv;
    float* const pv = pk + n_kv;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        const int key = key0 + 8 * hf;
        if (key < Tkv) {
#pragma unroll
            for (int j = 0; j < DT; ++j) {
                const size_t o = kv_base + (size_t)key * D + 8 * j + 2 * t4;
                if (splits > 1) {
                    *reinterpret_cast<float2*>(pk + o) =
                        make_float2(dk[0][j][2 * hf], dk[0][j][2 * hf + 1]);
                    *reinterpret_cast<float2*>(pv + o) =
                        make_float2(dv[0][j][2 * hf], dv[0][j][2 * hf + 1]);
                } else {
                    *reinterpret_cast<u32*>(dK + o) = pack2<KP_WG_BF16>(
                        dk[0][j][2 * hf] * scale, dk[0][j][2 * hf + 1] * scale);
                    *reinterpret_cast<u32*>(dV + o) =
                        pack2<KP_WG_BF16>(dv[0][j][2 * hf], dv[0][j][2 * hf + 1]);
                }
            }
        }
    }
}

#define BW_PRE_ENTRY(D)                                                                          \
    extern "C" __global__ void __launch_bounds__(256) attn_bwd_sm90_pre_d##D(                   \
        const u16* O, const u16* dO, const float* LSE, float* dsum, float* lse2, float* dqacc,  \
        int Tq, int Tq_pad, int rows_pad) {                                                      \
        attn_bwd_sm90_pre<D>(O, dO, LSE, dsum, lse2, dqacc, Tq, Tq_pad, rows_pad);              \
    }

// The main kernel of head_dim D and BM queries per step as `attn_bwd_sm90_d<D><SUFFIX>`.
#define BW_ENTRY_BM(D, BM, SUFFIX)                                                               \
    extern "C" __global__ void __launch_bounds__(384, 1) attn_bwd_sm90_d##D##SUFFIX(            \
        const __grid_constant__ TmaMap tq, const __grid_constant__ TmaMap tk,                    \
        const __grid_constant__ TmaMap tv, const __grid_constant__ TmaMap tdo,                   \
        const __grid_constant__ TmaMap tdq, const float* lse2, const float* dsum,                \
        const int* kv_lens, u16* dK, u16* dV, float* dkv_part, int splits, int Tq, int Tkv,      \
        int H, int KVH, int Tq_pad, float scale_log2, float scale, int causal, int B,             \
        int order, int chunk, int tail_whole, int tail_parts, float* tail_buf) {                 \
        if (causal)                                                                              \
            attn_bwd_sm90<D, BM, true>(&tq, &tk, &tv, &tdo, &tdq, lse2, dsum, kv_lens, dK, dV,   \
                                       dkv_part, splits, Tq, Tkv, H, KVH, Tq_pad, scale_log2,    \
                                       scale, B, order, chunk, tail_whole, tail_parts, tail_buf); \
        else                                                                                     \
            attn_bwd_sm90<D, BM, false>(&tq, &tk, &tv, &tdo, &tdq, lse2, dsum, kv_lens, dK, dV,  \
                                        dkv_part, splits, Tq, Tkv, H, KVH, Tq_pad, scale_log2,   \
                                        scale, B, order, chunk, tail_whole, tail_parts,          \
                                        tail_buf);                                               \
    }
#define BW_ENTRY(D) BW_ENTRY_BM(D, BwShape<D>::BM, )

// The kernels of head_dim D where the source before this defines KP_SM90_BWD_ALL or
// KP_SM90_BWD_D<D> (the host compiles the head_dim it runs); at head_dim 128 with
// KP_SM90_BWD_M80 as well, `attn_bwd_sm90_d128_m80`, 80 queries per step, and with
// KP_SM90_BWD_NO_M64 without the kernel of 64 (sm90::bwd_source_wide); with KP_SM90_BWD_NO_MAIN
// without a dense main kernel (flex's module: src/attention/flex.rs).
#if defined(KP_SM90_BWD_ALL) || defined(KP_SM90_BWD_D64)
BW_PRE_ENTRY(64)
#if !defined(KP_SM90_BWD_NO_MAIN)
BW_ENTRY(64)
#endif
#endif
#if defined(KP_SM90_BWD_ALL) || defined(KP_SM90_BWD_D128)
BW_PRE_ENTRY(128)
#if defined(KP_SM90_BWD_ALL) || !(defined(KP_SM90_BWD_NO_M64) || defined(KP_SM90_BWD_NO_MAIN))
BW_ENTRY(128)
#endif
#if defined(KP_SM90_BWD_ALL) || defined(KP_SM90_BWD_M80)
BW_ENTRY_BM(128, 80, _m80)
#endif
#endif

// dK = scale * (sum of the slices' partial dK) and dV = sum of theirs, in 16 bits: the slices of
// dkv_part ([splits][2][n] floats, the main kernel's with splits > 1) added in slice order, two
// elements per thread (n even: D is).
extern "C" __global__ void attn_bwd_sm90_dkv_combine(const float* __restrict__ part,
                                                     u16* __restrict__ dK, u16* __restrict__ dV,
                                                     unsigned long long n, int splits,
                                                     float scale) {
    const size_t i = 2 * ((size_t)blockIdx.x * blockDim.x + threadIdx.x);
    if (i >= n) return;
    float2 k = make_float2(0.f, 0.f), v = make_float2(0.f, 0.f);
    for (int sp = 0; sp < splits; ++sp) {
        const float2 a = *reinterpret_cast<const float2*>(part + (size_t)(2 * sp) * n + i);
        const float2 c = *reinterpret_cast<const float2*>(part + (size_t)(2 * sp + 1) * n + i);
        k.x += a.x;
        k.y += a.y;
        v.x += c.x;
        v.y += c.y;
    }
    *reinterpret_cast<u32*>(dK + i) = pack2<KP_WG_BF16>(k.x * scale, k.y * scale);
    *reinterpret_cast<u32*>(dV + i) = pack2<KP_WG_BF16>(v.x, v.y);
}

// The tail split's dK (times the scale) and dV: for the CTA tail_whole + t of the main grid
// (blockIdx.y = t), its parts' partial sums (tail_buf [tail][parts][2][128 x D]) added in part
// order, in 16 bits, keys below Tkv; two elements per thread, blockIdx.x over the tile's.
template <int D>
__device__ __forceinline__ void attn_bwd_sm90_tail_combine(const float* __restrict__ buf,
                                                           u16* __restrict__ dK,
                                                           u16* __restrict__ dV, int tail_whole,
                                                           int parts, int Tkv, int KVH, int B,
                                                           int order, int chunk, float scale) {
    const int e = 2 * (blockIdx.x * blockDim.x + threadIdx.x);
    if (e >= BW_BN * D) return;
    const unsigned n_kt = ((unsigned)Tkv + BW_BN - 1) / BW_BN;
    int kt, y, b;
    bwd_cta_coords(tail_whole + blockIdx.y, order, chunk, n_kt, KVH, B, kt, y, b);
    const int key = kt * BW_BN + e / D;
    if (key >= Tkv) return;
    float2 k = make_float2(0.f, 0.f), v = make_float2(0.f, 0.f);
    const float* p = buf + (size_t)blockIdx.y * parts * 2 * (BW_BN * D) + e;
    for (int i = 0; i < parts; ++i, p += 2 * (BW_BN * D)) {
        const float2 a = *reinterpret_cast<const float2*>(p);
        const float2 c = *reinterpret_cast<const float2*>(p + BW_BN * D);
        k.x += a.x;
        k.y += a.y;
        v.x += c.x;
        v.y += c.y;
    }
    const size_t o = ((size_t)(b * KVH + y) * Tkv + key) * D + e % D;
    *reinterpret_cast<u32*>(dK + o) = pack2<KP_WG_BF16>(k.x * scale, k.y * scale);
    *reinterpret_cast<u32*>(dV + o) = pack2<KP_WG_BF16>(v.x, v.y);
}
#define BW_TAIL_ENTRY(D)                                                                         \
    extern "C" __global__ void __launch_bounds__(256) attn_bwd_sm90_tail_combine_d##D(          \
        const float* buf, u16* dK, u16* dV, int tail_whole, int parts, int Tkv, int KVH, int B,  \
        int order, int chunk, float scale) {                                                     \
        attn_bwd_sm90_tail_combine<D>(buf, dK, dV, tail_whole, parts, Tkv, KVH, B, order, chunk, \
                                      scale);                                                    \
    }
#if defined(KP_SM90_BWD_ALL) || defined(KP_SM90_BWD_D64)
BW_TAIL_ENTRY(64)
#endif
#if defined(KP_SM90_BWD_ALL) || defined(KP_SM90_BWD_D128)
BW_TAIL_ENTRY(128)
#endif

// dQ = scale * dQacc in bf16 (the prelude's bwd_dq_convert).
extern "C" __global__ void attn_bwd_sm90_dq_convert(const float* __restrict__ dqacc,
                                                    u16* __restrict__ dQ, unsigned long long n,
                                                    float scale) {
    bwd_dq_convert<KP_WG_BF16>(dqacc, dQ, n, scale);
}
