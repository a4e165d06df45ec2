// The grouped GEMM of the MoE layer (issue 14) for compute capability 9.0 (`-arch=sm_90a`):
// the products of grouped_gemm.cu (forward y = x · w[e], dX = dy · w[e]ᵀ, dW[e] = x_eᵀ · dy_e,
// one launch each over every expert, groups ragged and any of them empty) on the Hopper
// instructions: operands brought by the tensor memory accelerator (TMA, `cp.async.bulk.tensor`
// on mbarriers, 128-byte swizzled tiles) and multiplied by `wgmma` from shared memory, a
// producer warpgroup and two consumer warpgroups (warp specialisation with register
// reallocation), and a persistent tile scheduler. Written for this project from the PTX ISA and
// the techniques of the FlashAttention-3 paper and CUTLASS's sm_90 grouped GEMM documentation;
// the TMA and mbarrier helpers are the attention suite's (attn_prelude.cuh), the descriptor
// helpers too (attn_wgmma_sm90.cu, which the host places before this file, after the prelude).
//
// Layouts as grouped_gemm.cu: row-major 16-bit values as u16 bits (bf16, or fp16 where the host
// defines KP_WG_BF16 as 0 before attn_wgmma_sm90.cu), float32 accumulation, 16-bit results
// rounded to nearest even; x [M, K] rows in expert order, w [E, K, N], offsets [E + 1] int32
// (clamped to [0, M] on the device). The host builds the tensor maps (3-D, innermost first,
// boxes of 64 columns = 128 bytes, 128-byte swizzle; boxes past a tensor's end read zeros):
//   MODE 0 (forward): map_a = x  as (K, M, 1),  box 64 x 128;  map_b = w  as (N, K, E), box 64 x 64
//   MODE 1 (dX):      map_a = dy as (N, M, 1),  box 64 x 128;  map_b = w  as (N, K, E), box 64 x 256
//   MODE 2 (dW):      map_a = x  as (K, M, 1),  box 64 x 64;   map_b = dy as (N, M, 1), box 64 x 64
//
// Tiles: C tiles of GS_BM x GS_BN (128 x 256), the reduction in steps of 64 through GS_ST
// stages. A stage holds A (16 KB: consumer c reads the 64-row half at c · 8 KB) and B (32 KB).
//   forward: A = x rows, K-major (one 128-row box); B = w[e] rows k.., MN-major (four 64-column
//            panels of 64 k-rows);
//   dX:      A = dy rows, K-major; B = w[e] rows n.. (dX's columns) with the reduction (w's
//            columns) contiguous, K-major (one 256-row box);
//   dW:      A = xᵀ: two boxes of 64 token rows x 64 of x's columns, MN-major; B = dy's token
//            rows, MN-major (four panels). Token rows past the group's end belong to the next
//            group (or are TMA's zeros past M); the consumers zero them in shared memory before
//            the last step's products, so a neighbour's values (even non-finite ones) never
//            reach this group's dW.
// Rows of a forward or dX tile past the group's end are read (they are the next group's) and
// multiplied but never stored, except that a consumer warpgroup whose rows all lie past the
// end skips its products (it only waits for each stage and releases it), and that a tile with
// at most 64 of the group's rows left and more than 128 columns is split: both consumers
// multiply those 64 rows, each against half of B's columns (SPLIT, below).
//
// Epilogue: each consumer rounds its 64 x 256 accumulators to bf16 (or fp16) and writes them, 64
// columns at a time, into one of its two 64 x 64 shared-memory buffers (128-byte swizzled, the
// layout TMA expects; conflict-free 4-byte stores), from which one thread stores the subtile to
// global memory with a TMA store (`map_c`: y as (N, M, 1), dX as (K, M, 1), dW as (N, K, E);
// columns past N and dW rows past K are clipped by the map). The consumers go on to the next tile
// while the stores drain; a buffer is rewritten only after its previous store has read it. A
// forward or dX tile whose 64 rows of one consumer run past the group's end (the next group's
// rows, which the map cannot clip) is stored from registers instead, row by row.
//
// The tall forward (TALL, entry grouped_gemm_sm90_fwd_tall; the host's dispatch runs it for the
// forward where N is an odd multiple of 128 and its cost model on the mean group size favours
// it, tall_pays in src/moe/sm90.rs): 256 x 128 tiles for N an odd multiple of 128, where the
// 128 x 256 tiles leave every row band's last column tile half empty. A stage holds two
// 128-row boxes of A (32 KB) and two 64-column panels of B (16 KB), the same 48 KB and maps;
// consumer c owns rows 128 c .. 128 c + 127 as two 64-row halves, each on m64n128k16 against
// the same B, into acc[0..63] and acc[64..127]; each half leaves as two 64 x 64 subtiles by
// TMA (from registers where the group's rows end inside it). A tall tile with at most 128 of
// the group's rows left (a group's last, or a small group's only, tile) is short: both
// consumers multiply the first A box, consumer c against B's panel c (two m64n64k16 a k-step),
// and each stores its 128 x 64 half, so that neither multiplies rows past the group's end
// while the other works (the producer brings only the first A box for it). The tall dW (entry
// grouped_gemm_sm90_dw_tall; run by the variant grouped_wgmma_tall, and by the dispatch with K
// rows a group once TALL_DW_DISPATCHED in src/moe/sm90.rs says so) is the same tile over K x N:
// a stage holds four 64-column panels of x (256 of C's rows) and two of dY; consumer c takes
// panels 2 c and 2 c + 1 (transposed, as dW's A always is) and, at a group's last partial step,
// zeroes the token rows past its end in those two and in dY's panel c.
//
// Block: 384 threads. Warpgroup 0 is the producer (one thread issues every TMA load; the
// warpgroup gives registers away with setmaxnreg); warpgroups 1 and 2 are the consumers, each
// owning 64 rows of the C tile with a 64 x 256 fp32 accumulator (128 registers a thread) on
// wgmma m64n256k16 (m64n128k16 for a tile whose columns end within 128, such as the last of
// N = 1408). Each stage has a "full" barrier (TMA's transaction bytes) and an "empty"
// one (one arrival per consumer warp once its products have read the stage). Both roles walk
// the same tile list (tiles blockIdx.x, + gridDim.x, ...; in the multicast variant MC below,
// pairs of row tiles from blockIdx.x / 2 by gridDim.x / 2), the groups' tiles one after another,
// within a group bands of GS_BAND row tiles before moving right (as grouped_gemm.cu); the stage
// ring runs on across tiles, so the producer fills the next tile's stages while the consumers
// store the last one.

#define GS_THREADS 384
#define GS_BM 128
#define GS_BN 256
#define GS_BK 64
#define GS_ST 4
#define GS_BAND 8
#define GS_A_BYTES (GS_BM * GS_BK * 2)
#define GS_B_BYTES (GS_BK * GS_BN * 2)
#define GS_STAGE_BYTES (GS_A_BYTES + GS_B_BYTES)
// One 64 x 64 16-bit subtile of the epilogue (two buffers per consumer).
#define GS_C_BYTES (64 * 64 * 2)
// From the 1024-aligned base: the stages, the epilogue buffers (consumer 0's two, then consumer
// 1's), the barriers (full then empty per stage), then the groups' tile prefix ((E + 1) ints).
#define GS_CBUF (GS_ST * GS_STAGE_BYTES)
#define GS_BARS (GS_CBUF + 4 * GS_C_BYTES)
#define GS_PREFIX (GS_BARS + 16 * GS_ST)

// The accumulator operands of m64n256k16 (128 fp32 registers a thread).
#define GS_REGS128                                                                               \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
    "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "  \
    "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "  \
    "%56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, "  \
    "%74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, "  \
    "%92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, "     \
    "%108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, "  \
    "%123, %124, %125, %126, %127}"
#define GS_ACC128(d) WG_ACC64(d), WG_ACC8(d, 64), WG_ACC8(d, 72), WG_ACC8(d, 80), WG_ACC8(d, 88), \
    WG_ACC8(d, 96), WG_ACC8(d, 104), WG_ACC8(d, 112), WG_ACC8(d, 120)

// D (64 x 256, fp32) += A (64 x 16) · B (16 x 256), both from shared memory; TRANS_A / TRANS_B
// = 1 for an MN-major operand. Issued, not waited for.
template <int TRANS_A, int TRANS_B>
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t desc_a,
                                                 uint64_t desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16" WG_AB
        GS_REGS128 ", %128, %129, p, 1, 1, %131, %132;\n}\n"
        : GS_ACC128(d)
        : "l"(desc_a), "l"(desc_b), "r"(1), "n"(TRANS_A), "n"(TRANS_B));
}

// As wgmma_m64n256k16 for a 64 x 128 D: the first 64 accumulators of the same layout (a tile
// whose columns end within its first 128 skips the empty half's products).
template <int TRANS_A, int TRANS_B>
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], uint64_t desc_a,
                                                 uint64_t desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16" WG_AB
        WG_REGS64 ", %64, %65, p, 1, 1, %67, %68;\n}\n"
        : WG_ACC64(d)
        : "l"(desc_a), "l"(desc_b), "r"(1), "n"(TRANS_A), "n"(TRANS_B));
}

// Stores the box at `src` (shared memory) to the tensor of `map` at element coordinates
// (c0, c1, c2) (TMA; elements outside the tensor are not written), as one bulk group.
__device__ __forceinline__ void gs_tma_store_3d(const TmaMap* map, u32 src, int c0, int c1,
                                                int c2) {
    asm volatile(
        "cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%1, %2, %3}], [%4];\n"
        ::"l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(src)
        : "memory");
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
// Waits until all but the newest N bulk groups this thread committed have read shared memory.
template <int N>
__device__ __forceinline__ void gs_bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}

// The 128 threads of consumer warpgroup `id` - 2 (ids 2 and 3; 1 is both consumers').
__device__ __forceinline__ void named_barrier_gs(int id) {
    asm volatile("bar.sync %0, 128;\n" ::"r"(id) : "memory");
}

// Two-block clusters (MC, the forward's multicast variant `grouped_gemm_sm90_fwd_mc`): the two
// blocks of a cluster take two row tiles of the same group and column band at once; each
// brings its own A and half of B (two of the four 64-column panels), which TMA multicasts into
// both blocks' shared memory at the same offset, signalling each block's "full" barrier there.
// A block's producer overwrites a stage in both blocks, so each "empty" barrier counts the
// arrivals of both blocks' consumer warps (16: its own 8, and the peer's by remote arrive).
// The block's rank in its cluster (0 or 1).
__device__ __forceinline__ u32 gs_cluster_rank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}
// Every non-exited thread of both blocks: barrier inits visible cluster-wide before any
// remote arrive or multicast, and at the end no block leaving while its peer may still write
// to its shared memory or arrive on its barriers.
__device__ __forceinline__ void gs_cluster_sync() {
    asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}
// Arrives on the barrier at shared-memory offset `bar` of block `rank` of the cluster.
__device__ __forceinline__ void gs_arrive_peer(u32 bar, u32 rank) {
    u32 remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(bar), "r"(rank));
    asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(remote)
                 : "memory");
}
// tma_load_3d into the shared memory of every block of `mask` at the same offset `dst`, each
// block's barrier at offset `bar` counting the bytes.
__device__ __forceinline__ void gs_tma_load_3d_mc(u32 dst, const TmaMap* map, u32 bar, int c0,
                                                  int c1, int c2, unsigned short mask) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        ".multicast::cluster [%0], [%1, {%2, %3, %4}], [%5], %6;\n" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar), "h"(mask)
        : "memory");
}
// mbar_wait, or with WATCH (the multicast variant, whose protocol spans two blocks) the same
// with a bound: after 2^22 polls (each poll's suspension is the hardware's choice: at 0.1 to
// 1 µs a poll, under a second to a few seconds; a stage never waits more than microseconds) it
// traps, so that a broken protocol fails the
// launch with an error instead of hanging the process.
template <bool WATCH>
__device__ __forceinline__ void gs_wait(u32 bar, u32 parity) {
    if constexpr (!WATCH) {
        mbar_wait(bar, parity);
    } else {
        u32 done;
        for (u32 polls = 0;; ++polls) {
            // Acquire at cluster scope: the "empty" barriers take the peer's release arrivals.
            asm volatile(
                "{\n.reg .pred p;\n"
                "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
                "selp.u32 %0, 1, 0, p;\n}\n"
                : "=r"(done)
                : "r"(bar), "r"(parity)
                : "memory");
            if (done) return;
            if (polls == (1u << 22)) __trap();
        }
    }
}
// A consumer warp's release of stage barrier `bar`: its own block's, and with MC the peer's.
template <bool MC>
__device__ __forceinline__ void gs_release(u32 bar, u32 peer) {
    mbar_arrive(bar);
    if constexpr (MC) gs_arrive_peer(bar, peer);
}

__device__ __forceinline__ int gs_offset(const int* offsets, int e, int M) {
    return min(max(offsets[e], 0), M);
}

// One tile of the launch's list: its group, the group's first row and row count, the tile's
// origin in C (m0 rows, n0 columns) and its reduction steps.
struct GsTile {
    int e, row0, rows, m0, n0, steps;
};

// The output tile of a launch: GS_BM x GS_BN, or with TALL (the forward's and dW's tiles for N
// an odd multiple of 128) 2 GS_BM x GS_BN / 2.
template <bool TALL>
struct GsShape {
    static constexpr int BM = TALL ? 2 * GS_BM : GS_BM;
    static constexpr int BN = TALL ? GS_BN / 2 : GS_BN;
};

// MC: `tile` numbers pairs of row tiles (a group's last pair may have one), and `rank` picks
// the block's tile of the pair (the second of a lone one lies past the group's rows).
template <int MODE, bool TALL, bool MC = false>
__device__ __forceinline__ GsTile gs_tile(int tile, const int* tiles_before,
                                          const int* __restrict__ offsets, int groups, int M,
                                          int K, int N, int rank = 0) {
    int lo = 0, hi = groups - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (tiles_before[mid] <= tile) lo = mid; else hi = mid - 1;
    }
    GsTile t;
    t.e = lo;
    t.row0 = gs_offset(offsets, lo, M);
    t.rows = max(gs_offset(offsets, lo + 1, M) - t.row0, 0);
    constexpr int BM = GsShape<TALL>::BM, BN = GsShape<TALL>::BN;
    const int c_rows = MODE == 2 ? K : t.rows;
    const int c_cols = MODE == 1 ? K : N;
    const int tiles_n = (c_cols + BN - 1) / BN;
    const int tiles_m = (c_rows + BM - 1) / BM;
    // The units of the row walk: row tiles, or (MC) pairs of them, in bands of GS_BAND rows.
    const int units_m = MC ? (tiles_m + 1) / 2 : tiles_m;
    constexpr int BAND = MC ? GS_BAND / 2 : GS_BAND;
    const int local = tile - tiles_before[lo];
    const int band = local / (BAND * tiles_n);
    const int band_m = min(BAND, units_m - band * BAND);
    const int in_band = local - band * BAND * tiles_n;
    const int unit = band * BAND + in_band % band_m;
    t.m0 = (MC ? 2 * unit + rank : unit) * BM;
    t.n0 = (in_band / band_m) * BN;
    const int red = MODE == 0 ? K : MODE == 1 ? N : t.rows;
    t.steps = (red + GS_BK - 1) / GS_BK;
    return t;
}

// One tile's reduction for one consumer warpgroup: its steps through the stage ring (`it` the
// ring position, carried across tiles), each step's four products issued while the previous
// step's stage is released, the accumulators `acc` (zeroed by the caller) left complete. HALF:
// the tile's columns end within 128, so m64n128k16 on the first 64 accumulators.
// TALL (forward and dW): the consumer's 128 rows of C as two 64-row halves of A, each on
// m64n128k16 against the same 128 columns of B, into acc[0..63] and acc[64..127].
// SHORT (the tall forward's tile with at most 128 of the group's rows left): both consumers
// take the first 128-row box of A, consumer cw B's panel cw (64 columns), as two m64n64k16
// into acc[0..31] and acc[64..95], so that the two share the tile's products.
// SPLIT (a wide forward or dX tile with at most 64 of the group's rows left and more than 128
// columns): both consumers take A's first 64 rows, consumer cw B's columns 128 cw ..
// 128 cw + 127, on m64n128k16 into acc[0..63], so that the two share the tile's products
// instead of one multiplying all 256 columns while the other waits.
// MC: the multicast variant (stage waits watched, releases to both blocks: peer's rank).
template <int MODE, bool HALF, bool TALL, bool SHORT = false, bool SPLIT = false, bool MC = false>
__device__ __forceinline__ void gs_mainloop(float (&acc)[128], const GsTile& t, int& it, u32 base,
                                            int cw, int ctid, int lane, u32 peer = 0) {
    static_assert(!TALL || (MODE != 1 && !HALF), "the tall tile is the forward's and dW's");
    static_assert(!SHORT || (TALL && MODE == 0), "the short tile is the tall forward's");
    static_assert(!SPLIT || (!TALL && !HALF && MODE != 2), "the split tile is a wide fwd or dX");
    auto full = [&](int s) { return base + GS_BARS + 8u * s; };
    auto empty = [&](int s) { return base + GS_BARS + 8u * (GS_ST + s); };
    int prev = -1;
    for (int ks = 0; ks < t.steps; ++ks, ++it) {
        const int s = it % GS_ST;
        gs_wait<MC>(full(s), (it / GS_ST) & 1);
        // A stage: A (GS_A_BYTES, 128 rows; TALL: twice that, 256 rows), then B (panels of 64
        // columns at 8 KB).
        const u32 sa =
            base + s * GS_STAGE_BYTES + (SHORT || SPLIT ? 0 : cw * (TALL ? 16384 : 8192));
        const u32 sb = base + s * GS_STAGE_BYTES + (TALL ? 2 : 1) * GS_A_BYTES;
        if (MODE == 2) {
            const int valid = t.rows - ks * GS_BK;
            if (valid < GS_BK) {
                // Zero token rows valid..63: the 128-byte line of each row in this
                // consumer's A panel and in B's panels 2 cw and 2 cw + 1 (TALL: its two A
                // panels and B's panel cw), 16 bytes a store.
                const int lines = GS_BK - valid;
                unsigned char* smem0 = dyn_smem + (base - smem_u32(dyn_smem));
                for (int i = ctid; i < 3 * lines * 8; i += 128) {
                    const int panel = i / (lines * 8), rest = i % (lines * 8);
                    const int line = valid + rest / 8, chunk = rest % 8;
                    const u32 at = TALL ? (panel < 2 ? sa + panel * 8192 : sb + cw * 8192)
                                        : (panel == 0 ? sa : sb + (2 * cw + panel - 1) * 8192);
                    *reinterpret_cast<uint4*>(smem0 + (at - base) + line * 128 + chunk * 16) =
                        make_uint4(0u, 0u, 0u, 0u);
                }
                fence_proxy_async();
                asm volatile("bar.sync 1, 256;\n" ::: "memory");
            }
        }
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            const uint64_t da = MODE == 2 ? smem_desc_sw128(sa + kk * 2048, 8192, 1024)
                                          : smem_desc_sw128(sa + kk * 32, 16, 1024);
            const uint64_t db = MODE == 1 ? smem_desc_sw128(sb + kk * 32, 16, 1024)
                                          : smem_desc_sw128(sb + kk * 2048, 8192, 1024);
            if constexpr (SPLIT) {
                // B's columns 128 cw ..: panels 2 cw and 2 cw + 1 of the forward's MN-major B,
                // rows 128 cw .. of dX's K-major B (one 256-row box); 16 KB on either way.
                const uint64_t dbs = MODE == 1
                                         ? smem_desc_sw128(sb + cw * 16384 + kk * 32, 16, 1024)
                                         : smem_desc_sw128(sb + cw * 16384 + kk * 2048, 8192, 1024);
                wgmma_m64n128k16<0, MODE == 1 ? 0 : 1>(reinterpret_cast<float(&)[64]>(acc), da,
                                                       dbs);
            } else if constexpr (SHORT) {
                const uint64_t da2 = smem_desc_sw128(sa + 8192 + kk * 32, 16, 1024);
                const uint64_t dbc = smem_desc_sw128(sb + cw * 8192 + kk * 2048, 8192, 1024);
                // Attention's m64n64k16 (A K-major, B N-major), accumulating (scale_d 1).
                wgmma_m64n64k16_ss<1>(reinterpret_cast<float(&)[32]>(acc), da, dbc, 1);
                wgmma_m64n64k16_ss<1>(*reinterpret_cast<float(*)[32]>(acc + 64), da2, dbc, 1);
            } else if constexpr (TALL) {
                // The second 64 rows: the next 128-row box's half (forward: A's rows 64..127
                // lie 8 KB on) or the next 64-row panel (dW: A's columns, 8 KB on).
                const uint64_t da2 = MODE == 2 ? smem_desc_sw128(sa + 8192 + kk * 2048, 8192, 1024)
                                               : smem_desc_sw128(sa + 8192 + kk * 32, 16, 1024);
                wgmma_m64n128k16<MODE == 2 ? 1 : 0, 1>(reinterpret_cast<float(&)[64]>(acc), da,
                                                       db);
                wgmma_m64n128k16<MODE == 2 ? 1 : 0, 1>(*reinterpret_cast<float(*)[64]>(acc + 64),
                                                       da2, db);
            } else if constexpr (HALF)
                wgmma_m64n128k16<MODE == 2 ? 1 : 0, MODE == 1 ? 0 : 1>(
                    reinterpret_cast<float(&)[64]>(acc), da, db);
            else
                wgmma_m64n256k16<MODE == 2 ? 1 : 0, MODE == 1 ? 0 : 1>(acc, da, db);
        }
        wgmma_commit();
        wgmma_wait<1>();
        if (prev >= 0 && lane == 0) gs_release<MC>(empty(prev), peer);
        prev = s;
    }
    wgmma_wait<0>();
    if (prev >= 0 && lane == 0) gs_release<MC>(empty(prev), peer);
}

// One tile's steps for a consumer warpgroup none of whose rows the tile stores (consumer 1 of a
// wide forward or dX tile with at most 64 of the group's rows left; a tall forward tile with at
// most 128 left is short instead, and dW's rows are K's): it waits for each stage and releases
// it without multiplying, so the ring stays in step with the producer and the other consumer.
// MC: as gs_mainloop's (a multicast pair's second tile past its group's rows drains too).
template <bool MC = false>
__device__ __forceinline__ void gs_drain(const GsTile& t, int& it, u32 base, int lane,
                                         u32 peer = 0) {
    for (int ks = 0; ks < t.steps; ++ks, ++it) {
        const int s = it % GS_ST;
        gs_wait<MC>(base + GS_BARS + 8u * s, (it / GS_ST) & 1);
        if (lane == 0) gs_release<MC>(base + GS_BARS + 8u * (GS_ST + s), peer);
    }
}

// One consumer's 64 rows of C, rounded to the 16-bit type, in pairs along the columns: its accumulators
// from acc[off] (four per group of 8 columns, as wgmma leaves them), columns n0 ..
// n0 + 64 NSUB - 1 (those below n0 + n_lim), C's rows row_c .. row_c + 63 (dW: K's rows of
// group e). When all 64 rows are C's (m_lim >= 64; dW's always, K being a multiple of 64) each
// 64 x 64 subtile goes through one of the consumer's two shared buffers (128-byte swizzled)
// and leaves by a TMA store, which clips columns past N; otherwise the first m_lim rows are
// stored from registers (the rest belong to the group's neighbour).
template <int MODE, int NSUB>
__device__ __forceinline__ void gs_store_rows(const float (&acc)[128], int off, int m_lim,
                                              int n_lim, int n0, int e, int row_c,
                                              u16* __restrict__ c, int ldc, const TmaMap* map_c,
                                              u32 base, int cw, int ctid, int& stores) {
    const int warp = (ctid >> 5) & 3, lane = ctid & 31;
    const int g = lane >> 2, t4 = lane & 3;
    if (m_lim >= 64 || (MODE == 2 && m_lim > 0)) {
#pragma unroll
        for (int sc = 0; sc < NSUB; ++sc) {
            if (64 * sc < n_lim) {
                const u32 buf = base + GS_CBUF + (2 * cw + (stores & 1)) * GS_C_BYTES;
                // The store that last read this buffer (two stores ago) is done.
                if (ctid == 0) gs_bulk_wait_read<1>();
                named_barrier_gs(2 + cw);
#pragma unroll
                for (int jj = 0; jj < 8; ++jj) {
                    const int j = 8 * sc + jj;
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int r = 16 * warp + g + 8 * h;
                        const u32 at = buf + r * 128 + ((jj ^ (r & 7)) << 4) + 4 * t4;
                        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(at),
                                     "r"(pack2<KP_WG_BF16>(acc[off + 4 * j + 2 * h],
                                                     acc[off + 4 * j + 2 * h + 1]))
                                     : "memory");
                    }
                }
                fence_proxy_async();
                named_barrier_gs(2 + cw);
                if (ctid == 0)
                    gs_tma_store_3d(map_c, buf, n0 + 64 * sc, row_c, MODE == 2 ? e : 0);
                ++stores;
            }
        }
    } else if (MODE != 2 && m_lim > 0) {
        u16* cp = c + (long long)row_c * ldc + n0;
#pragma unroll
        for (int j = 0; j < 8 * NSUB; ++j) {
            const int col = 8 * j + 2 * t4;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = 16 * warp + g + 8 * h;
                if (r < m_lim && col < n_lim)
                    *reinterpret_cast<u32*>(cp + (long long)r * ldc + col) =
                        pack2<KP_WG_BF16>(acc[off + 4 * j + 2 * h], acc[off + 4 * j + 2 * h + 1]);
            }
        }
    }
}

// MC: the forward's multicast variant (two-block clusters, above; wide tiles only).
template <int MODE, bool TALL, bool MC = false>
__device__ __forceinline__ void grouped_gemm_sm90_body(const TmaMap* map_a, const TmaMap* map_b,
                                                       const TmaMap* map_c, u16* __restrict__ c,
                                                       const int* __restrict__ offsets,
                                                       int groups, int M, int K, int N) {
    static_assert(!MC || (MODE == 0 && !TALL), "the multicast variant is the wide forward's");
    const u32 base = (smem_u32(dyn_smem) + 1023u) & ~1023u;
    int* tiles_before = reinterpret_cast<int*>(dyn_smem + (base - smem_u32(dyn_smem)) + GS_PREFIX);
    auto full = [&](int s) { return base + GS_BARS + 8u * s; };
    auto empty = [&](int s) { return base + GS_BARS + 8u * (GS_ST + s); };
    const int tid = threadIdx.x, wg = tid >> 7;
    constexpr int BM = GsShape<TALL>::BM, BN = GsShape<TALL>::BN;
    const int c_cols = MODE == 1 ? K : N;
    const int tiles_n = (c_cols + BN - 1) / BN;
    // MC: this block's rank in its cluster, its peer's, and the cluster as the tile walker.
    const int rank = MC ? (int)gs_cluster_rank() : 0;
    const u32 peer = (u32)(rank ^ 1);
    const int walker = MC ? blockIdx.x / 2 : blockIdx.x;
    const int walkers = MC ? gridDim.x / 2 : gridDim.x;

    if (tid < 32) {
        // The tile prefix over groups, in steps of 32 groups.
        const int lane = tid;
        int run = 0;
        if (lane == 0) tiles_before[0] = 0;
        for (int b0 = 0; b0 < groups; b0 += 32) {
            const int e = b0 + lane;
            int tiles = 0;
            if (e < groups) {
                const int rows =
                    MODE == 2 ? K : max(gs_offset(offsets, e + 1, M) - gs_offset(offsets, e, M), 0);
                const int tiles_m = (rows + BM - 1) / BM;
                tiles = (MC ? (tiles_m + 1) / 2 : tiles_m) * tiles_n;
            }
            int incl = tiles;
#pragma unroll
            for (int d = 1; d < 32; d *= 2) {
                const int up = __shfl_up_sync(0xffffffffu, incl, d);
                if (lane >= d) incl += up;
            }
            if (e < groups) tiles_before[e + 1] = run + incl;
            run += __shfl_sync(0xffffffffu, incl, 31);
        }
    } else if (tid == 32) {
        for (int s = 0; s < GS_ST; ++s) {
            mbar_init(full(s), 1);
            mbar_init(empty(s), MC ? 16 : 8);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    if constexpr (MC) gs_cluster_sync();
    const int total = tiles_before[groups];

    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
        if (tid == 0) {
            int it = 0;
            for (int tile = walker; tile < total; tile += walkers) {
                const GsTile t =
                    gs_tile<MODE, TALL, MC>(tile, tiles_before, offsets, groups, M, K, N, rank);
                for (int ks = 0; ks < t.steps; ++ks, ++it) {
                    const int s = it % GS_ST;
                    if (it >= GS_ST) gs_wait<MC>(empty(s), ((it / GS_ST) + 1) & 1);
                    const u32 sa = base + s * GS_STAGE_BYTES, sb = sa + GS_A_BYTES;
                    // A short tall tile (at most GS_BM of the group's rows left: the
                    // consumers' test below) reads only A's first box, so only that is brought.
                    const bool short_a = TALL && MODE == 0 && t.rows - t.m0 <= GS_BM;
                    // MC: a lone pair's second tile only relays its half of B (its consumers
                    // drain), so it brings no A either.
                    const bool no_a = MC && t.m0 >= t.rows;
                    mbar_expect_tx(full(s), short_a || no_a ? GS_STAGE_BYTES - GS_A_BYTES
                                                            : GS_STAGE_BYTES);
                    const int k0 = ks * GS_BK;
                    if (TALL && MODE == 0) {
                        // Two 128-row boxes of A (one for a short tile), two 64-column panels
                        // of B after them.
                        tma_load_3d(sa, map_a, full(s), k0, t.row0 + t.m0, 0);
                        if (!short_a)
                            tma_load_3d(sa + GS_A_BYTES, map_a, full(s), k0,
                                        t.row0 + t.m0 + GS_BM, 0);
#pragma unroll
                        for (int p = 0; p < 2; ++p)
                            tma_load_3d(sb + GS_A_BYTES + p * 8192, map_b, full(s), t.n0 + 64 * p,
                                        k0, t.e);
                    } else if (TALL) {
                        // dW: four 64-column panels of x (256 of C's rows), two of dY after them.
#pragma unroll
                        for (int h = 0; h < 4; ++h)
                            tma_load_3d(sa + h * 8192, map_a, full(s), t.m0 + 64 * h, t.row0 + k0, 0);
#pragma unroll
                        for (int p = 0; p < 2; ++p)
                            tma_load_3d(sb + GS_A_BYTES + p * 8192, map_b, full(s), t.n0 + 64 * p,
                                        t.row0 + k0, 0);
                    } else if (MC) {
                        // Its own A (none for a lone pair's second tile), and B's panels 2 rank
                        // and 2 rank + 1 into both blocks; the peer brings the other two.
                        if (!no_a) tma_load_3d(sa, map_a, full(s), k0, t.row0 + t.m0, 0);
#pragma unroll
                        for (int p = 2 * rank; p < 2 * rank + 2; ++p)
                            gs_tma_load_3d_mc(sb + p * 8192, map_b, full(s), t.n0 + 64 * p, k0,
                                              t.e, 0x3);
                    } else if (MODE == 0) {
                        tma_load_3d(sa, map_a, full(s), k0, t.row0 + t.m0, 0);
#pragma unroll
                        for (int p = 0; p < 4; ++p)
                            tma_load_3d(sb + p * 8192, map_b, full(s), t.n0 + 64 * p, k0, t.e);
                    } else if (MODE == 1) {
                        tma_load_3d(sa, map_a, full(s), k0, t.row0 + t.m0, 0);
                        tma_load_3d(sb, map_b, full(s), k0, t.n0, t.e);
                    } else {
#pragma unroll
                        for (int h = 0; h < 2; ++h)
                            tma_load_3d(sa + h * 8192, map_a, full(s), t.m0 + 64 * h, t.row0 + k0, 0);
#pragma unroll
                        for (int p = 0; p < 4; ++p)
                            tma_load_3d(sb + p * 8192, map_b, full(s), t.n0 + 64 * p, t.row0 + k0, 0);
                    }
                }
            }
        }
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
    const int cw = wg - 1;  // consumer: C rows 64 cw .. 64 cw + 63 of a wide tile (tall: 128 cw
                            // .. 128 cw + 127; short: columns 64 cw .. 64 cw + 63)
    const int ctid = tid & 127;  // the thread within its consumer warpgroup
    const int lane = tid & 31;
    const int ldc = MODE == 1 ? K : N;
    float acc[128];
    int it = 0;
    int stores = 0;  // TMA stores this consumer issued (its buffer: stores & 1)
    for (int tile = walker; tile < total; tile += walkers) {
        const GsTile t = gs_tile<MODE, TALL, MC>(tile, tiles_before, offsets, groups, M, K, N, rank);
#pragma unroll
        for (int i = 0; i < 128; ++i) acc[i] = 0.f;
        const int c_rows = MODE == 2 ? K : t.rows;
        const int n_lim = min(BN, c_cols - t.n0);
        const int left = min(BM, c_rows - t.m0);  // the tile's rows that are C's
        if constexpr (TALL && MODE == 0) {
            if (left <= GS_BM) {
                // A short tall tile: the two consumers split its 128 columns (SHORT above).
                gs_mainloop<MODE, false, true, true>(acc, t, it, base, cw, ctid, lane);
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int row_c = t.row0 + t.m0 + 64 * h;
                    gs_store_rows<MODE, 1>(acc, 64 * h, left - 64 * h, n_lim - 64 * cw,
                                           t.n0 + 64 * cw, t.e, row_c, c, ldc, map_c, base, cw,
                                           ctid, stores);
                }
                continue;
            }
        }
        if constexpr (!TALL && MODE != 2) {
            if (left > 0 && left <= 64 && n_lim > GS_BN / 2) {
                // A split wide tile: the two consumers share its columns (SPLIT above), each
                // storing its 64 x 128 part.
                gs_mainloop<MODE, false, false, false, true, MC>(acc, t, it, base, cw, ctid, lane,
                                                                 peer);
                gs_store_rows<MODE, 2>(acc, 0, left, n_lim - 128 * cw, t.n0 + 128 * cw, t.e,
                                       t.row0 + t.m0, c, ldc, map_c, base, cw, ctid, stores);
                continue;
            }
        }
        // This consumer's first row in the tile is past the group's end (with MC, every row of
        // a lone pair's second tile): nothing to store.
        if (MODE != 2 && left <= (TALL ? 128 : 64) * cw) {
            gs_drain<MC>(t, it, base, lane, peer);
            continue;
        }
        if constexpr (TALL) {
            gs_mainloop<MODE, false, true>(acc, t, it, base, cw, ctid, lane);
            // Two blocks of 64 rows (acc[0..63], acc[64..127]), 128 columns each.
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int m_lim = min(BM, c_rows - t.m0) - 128 * cw - 64 * h;
                const long long row_c =
                    (MODE == 2 ? 0ll : (long long)t.row0) + t.m0 + 128 * cw + 64 * h;
                gs_store_rows<MODE, 2>(acc, 64 * h, m_lim, n_lim, t.n0, t.e, (int)row_c, c, ldc,
                                       map_c, base, cw, ctid, stores);
            }
            continue;
        }
        // The width of the products is chosen per tile, outside the loop: a branch between
        // the two wgmma shapes inside it makes ptxas fence every wgmma (warning C7519).
        if (n_lim <= GS_BN / 2)
            gs_mainloop<MODE, true, false, false, false, MC>(acc, t, it, base, cw, ctid, lane,
                                                             peer);
        else
            gs_mainloop<MODE, false, false, false, false, MC>(acc, t, it, base, cw, ctid, lane,
                                                              peer);
        const int row_c = (MODE == 2 ? 0 : t.row0) + t.m0 + 64 * cw;
        gs_store_rows<MODE, 4>(acc, 0, left - 64 * cw, n_lim, t.n0, t.e, row_c, c, ldc, map_c,
                               base, cw, ctid, stores);
    }
    // Shared memory stays until the last stores have read it.
    if (ctid == 0) gs_bulk_wait_read<0>();
    // MC: neither block leaves while its peer may still multicast into it or arrive on its
    // barriers (the producers have exited: exited threads do not hold a cluster barrier).
    if constexpr (MC) gs_cluster_sync();
}

#define GS_ENTRY(NAME, MODE, TALL)                                                              \
    extern "C" __global__ void __launch_bounds__(GS_THREADS, 1)                                \
        NAME(const __grid_constant__ TmaMap map_a, const __grid_constant__ TmaMap map_b,        \
             const __grid_constant__ TmaMap map_c, u16* c, const int* offsets, int groups,      \
             int M, int K, int N) {                                                             \
        grouped_gemm_sm90_body<MODE, TALL>(&map_a, &map_b, &map_c, c, offsets, groups, M, K,    \
                                           N);                                                  \
    }

GS_ENTRY(grouped_gemm_sm90_fwd, 0, false)
GS_ENTRY(grouped_gemm_sm90_dx, 1, false)
GS_ENTRY(grouped_gemm_sm90_dw, 2, false)
// The forward on 256 x 128 tiles, for N an odd multiple of 128 (1408 = 11 x 128), where the
// 128 x 256 tiles leave the last column tile half empty.
GS_ENTRY(grouped_gemm_sm90_fwd_tall, 0, true)
// dW on 256 x 128 tiles (256 of K's rows, 128 of N's columns), for the same N.
GS_ENTRY(grouped_gemm_sm90_dw_tall, 2, true)
// The forward on 128 x 256 tiles in two-block clusters that multicast B (MC above; the variant
// grouped_wgmma_mc of src/moe/cuda.rs, not the dispatch's): launched with an even grid. Only
// in a module whose source defines GS_WITH_MC (the variant's), so that the dispatch's compile
// does not pay for it.
#if defined(GS_WITH_MC)
extern "C" __global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(GS_THREADS, 1)
    grouped_gemm_sm90_fwd_mc(const __grid_constant__ TmaMap map_a,
                             const __grid_constant__ TmaMap map_b,
                             const __grid_constant__ TmaMap map_c, u16* c, const int* offsets,
                             int groups, int M, int K, int N) {
    grouped_gemm_sm90_body<0, false, true>(&map_a, &map_b, &map_c, c, offsets, groups, M, K, N);
}
#endif
