// Hopper (sm_90a) building blocks for the attention kernels of issue 11, written for this
// project from the PTX ISA's description of the warpgroup-level matrix instructions
// (`wgmma.mma_async`, shared-memory matrix descriptors, async-proxy fences), and a probe kernel
// that checks them on the device before any attention kernel relies on them. Needs
// attn_prelude.cuh before it (u16, u32, smem_u32, pack2; TmaMap, the mbarrier and TMA load
// helpers) and `-arch=sm_90a`. It declares a
// kernel only where the source before it defines KP_SM90_ALL or KP_SM90_<the kernel's name>
// (the host compiles the one forward it runs, and the backward's source reuses the helpers
// without compiling any forward).
//
// Shared-memory operand layout used here ("no swizzle"): a tile of 16-bit elements with `cols`
// columns is stored as 8 x 8 core matrices of 128 contiguous bytes (8 rows of 16 bytes), the
// core matrices in row-block-major order: element (r, c) at byte
// ((r / 8) * (cols / 8) + c / 8) * 128 + (r % 8) * 16 + (c % 8) * 2 (core_offset). A K-major
// operand (rows = M or N, cols = K) then has, within one k16 step, its two core matrices along
// K 128 bytes apart and its 8-row blocks cols * 16 bytes apart; an N-major B (rows = K, cols =
// N) has its core matrices along N 128 bytes apart and its two 8-row blocks along K N * 16
// bytes apart. Which of the two distances the descriptor's "leading" and "stride" fields take
// is what the probe establishes on the device (the PTX ISA words it per majorness and swizzle).
//
// Accumulator layout of wgmma m64nNk16 (fp32): thread t of the warpgroup, warp w = t / 32,
// g = (t % 32) / 4, t4 = t % 4, holds for each 8-column block j: d[4j] (row 16w + g, column
// 8j + 2 t4), d[4j + 1] (same row, column + 1), d[4j + 2] (row + 8, column 8j + 2 t4),
// d[4j + 3] (row + 8, column + 1): per warp, mma.sync's m16n8 layout.

// The 16-bit element type of the wgmma kernels (operands and results): bf16 unless the source
// before this file defines KP_WG_BF16 as 0 (fp16; the host's `wgmma_source` and `bwd_source`
// do for fp16 cases). WG_AB is the instructions' operand types, KP_WG_BF16 the template
// argument of the prelude's pack2, to_f32, store_rows and bwd_dq_convert.
#ifndef KP_WG_BF16
#define KP_WG_BF16 1
#endif
#if KP_WG_BF16
#define WG_AB ".f32.bf16.bf16 "
#else
#define WG_AB ".f32.f16.f16 "
#endif

typedef unsigned long long uint64_t;

// The dynamic shared memory of the kernels below (one declaration: a function-scope one in a
// template conflicts with another's linkage).
extern __shared__ __align__(128) unsigned char dyn_smem[];

__device__ __forceinline__ u32 core_offset(int r, int c, int cols) {
    return (u32)((((r >> 3) * (cols >> 3) + (c >> 3)) << 7) + ((r & 7) << 4) + ((c & 7) << 1));
}

// A shared-memory matrix descriptor without swizzling: start address, leading and stride byte
// offsets (each 16-byte aligned, below 256 KB), base offset 0.
__device__ __forceinline__ uint64_t smem_desc(const void* p, u32 lead_bytes, u32 stride_bytes) {
    uint64_t d = (uint64_t)((smem_u32(p) & 0x3FFFF) >> 4);
    d |= (uint64_t)((lead_bytes & 0x3FFFF) >> 4) << 16;
    d |= (uint64_t)((stride_bytes & 0x3FFFF) >> 4) << 32;
    return d;
}

// Generic-proxy writes to shared memory become visible to the async proxy (which wgmma reads
// through); then a barrier.
__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// The accumulator operands of one warpgroup's m64n64 (32 fp32 registers per thread) and
// m64n128 (64) wgmma: the register list of the PTX string and the matching in-out constraints
// on `d` (the wrappers below share them).
#define WG_REGS32                                                                                \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
    "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define WG_REGS64                                                                                \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
    "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "  \
    "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "  \
    "%56, %57, %58, %59, %60, %61, %62, %63}"
#define WG_ACC8(d, i)                                                                            \
    "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
        "+f"(d[i + 6]), "+f"(d[i + 7])
#define WG_ACC32(d) WG_ACC8(d, 0), WG_ACC8(d, 8), WG_ACC8(d, 16), WG_ACC8(d, 24)
#define WG_ACC64(d) WG_ACC32(d), WG_ACC8(d, 32), WG_ACC8(d, 40), WG_ACC8(d, 48), WG_ACC8(d, 56)

// D (64 x 64, fp32, the accumulator layout below) += A (64 x 16) * B (16 x 64): A and B from
// shared memory through descriptors; B K-major (TRANS_B = 0: B^T's rows are the 64 columns of
// B, 16 elements each) or N-major (TRANS_B = 1: B's 16 rows of 64 elements). SCALE_D = 0
// overwrites D.
template <int TRANS_B>
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[32], uint64_t desc_a, uint64_t desc_b,
                                                  int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16" WG_AB
        WG_REGS32 ", %32, %33, p, 1, 1, 0, %35;\n}\n"
        : WG_ACC32(d)
        : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TRANS_B));
}

// As wgmma_m64n64k16_ss with A from registers: the warpgroup's 64 x 16 A in the m16k16 fragment
// layout of mma.sync per warp (warp w holds rows 16 w .. 16 w + 15; a[0..3] as acc_to_a packs
// them), B from shared memory.
template <int TRANS_B>
__device__ __forceinline__ void wgmma_m64n64k16_rs(float (&d)[32], const u32 (&a)[4],
                                                  uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16" WG_AB
        WG_REGS32 ", {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
        : WG_ACC32(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(TRANS_B));
}

// As wgmma_m64n64k16_rs for a 64 x 128 D (64 accumulators per thread).
template <int TRANS_B>
__device__ __forceinline__ void wgmma_m64n128k16_rs(float (&d)[64], const u32 (&a)[4],
                                                   uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16" WG_AB
        WG_REGS64 ", {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
        : WG_ACC64(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(TRANS_B));
}

// The probe: one warpgroup computes C (64 x 64, fp32, row-major) from bf16 inputs, with the
// descriptors' leading and stride byte offsets given (so that the host can try both readings).
// mode 0: C = A B^T, A and B both [64][K] row-major in global memory, both K-major in shared
//         memory (Q K^T's form).
// mode 1: C = A V, A [64][K] in registers (P's form), V [K][64] row-major, N-major in shared
//         memory (P V's form, transposed B).
// K is a multiple of 16 up to 128. Dynamic shared memory: 2 * 64 * K * 2 bytes.
#if defined(KP_SM90_ALL) || defined(KP_SM90_wgmma_probe)
extern "C" __global__ void __launch_bounds__(128) wgmma_probe(
    const u16* __restrict__ A, const u16* __restrict__ B, float* __restrict__ C, int K, int mode,
    u32 lead_a, u32 stride_a, u32 lead_b, u32 stride_b) {
    unsigned char* sA = dyn_smem;
    unsigned char* sB = dyn_smem + 64 * K * 2;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t4 = lane & 3;
    for (int e = tid; e < 64 * K; e += 128) {
        const int r = e / K, c = e % K;
        *reinterpret_cast<u16*>(sA + core_offset(r, c, K)) = A[e];
        if (mode == 0) {
            *reinterpret_cast<u16*>(sB + core_offset(r, c, K)) = B[e];
        } else {
            // V [K][64]: element e = k * 64 + n.
            const int k = e / 64, n = e % 64;
            *reinterpret_cast<u16*>(sB + core_offset(k, n, 64)) = B[e];
        }
    }
    fence_proxy_async();
    __syncthreads();
    float d[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) d[i] = 0.f;
    // Register A: every k-step's fragments are written before the fence, and none is written
    // again before the wait (a register an in-flight wgmma reads must not change).
    u32 a[8][4];
    if (mode == 1) {
        const int row = 16 * warp + g;
#pragma unroll
        for (int s = 0; s < 8; ++s) {
            const int c0 = 16 * s + 2 * t4;
            const bool in = 16 * s < K;
            a[s][0] = in ? (u32)A[row * K + c0] | ((u32)A[row * K + c0 + 1] << 16) : 0u;
            a[s][1] = in ? (u32)A[(row + 8) * K + c0] | ((u32)A[(row + 8) * K + c0 + 1] << 16) : 0u;
            a[s][2] = in ? (u32)A[row * K + c0 + 8] | ((u32)A[row * K + c0 + 9] << 16) : 0u;
            a[s][3] = in ? (u32)A[(row + 8) * K + c0 + 8] | ((u32)A[(row + 8) * K + c0 + 9] << 16) : 0u;
        }
    }
    wgmma_fence();
    if (mode == 0) {
        for (int s = 0; s < K / 16; ++s) {
            const uint64_t da = smem_desc(sA + core_offset(0, 16 * s, K), lead_a, stride_a);
            const uint64_t db = smem_desc(sB + core_offset(0, 16 * s, K), lead_b, stride_b);
            wgmma_m64n64k16_ss<0>(d, da, db, 1);
        }
    } else {
#pragma unroll
        for (int s = 0; s < 8; ++s) {
            if (16 * s < K) {
                const uint64_t db = smem_desc(sB + core_offset(16 * s, 0, 64), lead_b, stride_b);
                wgmma_m64n64k16_rs<1>(d, a[s], db, 1);
            }
        }
    }
    wgmma_commit();
    wgmma_wait<0>();
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const int r = 16 * warp + g, c = 8 * j + 2 * t4;
        C[r * 64 + c] = d[4 * j];
        C[r * 64 + c + 1] = d[4 * j + 1];
        C[(r + 8) * 64 + c] = d[4 * j + 2];
        C[(r + 8) * 64 + c + 1] = d[4 * j + 3];
    }
}
#endif

// Copies rows [0, ROWS) of a [rows][D] 16-bit tile from global memory (row stride D, from `g`)
// into shared memory in the core-matrix layout (core_offset) with 16-byte cp.async; rows at or
// past `valid_rows` are zero-filled and read nothing. Every 8-element chunk of a row is 16
// contiguous bytes of one core matrix.
template <int ROWS, int D, int NTH>
__device__ __forceinline__ void load_tile_core(unsigned char* s, const u16* g, int valid_rows,
                                               int tid) {
    constexpr int CHUNKS = ROWS * D / 8;
#pragma unroll
    for (int i = tid; i < CHUNKS; i += NTH) {
        const int r = i / (D / 8);
        const int c = (i % (D / 8)) * 8;
        const bool ok = r < valid_rows;
        cp_async16(smem_u32(s + core_offset(r, c, D)), ok ? g + (size_t)r * D + c : g, ok);
    }
}

// P (the 64 x NT*8 probabilities in the accumulator layout) as bf16 register A operands of
// wgmma, one per 16 keys: mma.sync's A fragment per warp, from the 8-column blocks 2 kc, 2 kc+1.
template <int NT>
__device__ __forceinline__ void pack_p(const float (&s)[1][NT][4], u32 (&pa)[NT / 2][4]) {
#pragma unroll
    for (int kc = 0; kc < NT / 2; ++kc) {
        pa[kc][0] = pack2<KP_WG_BF16>(s[0][2 * kc][0], s[0][2 * kc][1]);
        pa[kc][1] = pack2<KP_WG_BF16>(s[0][2 * kc][2], s[0][2 * kc][3]);
        pa[kc][2] = pack2<KP_WG_BF16>(s[0][2 * kc + 1][0], s[0][2 * kc + 1][1]);
        pa[kc][3] = pack2<KP_WG_BF16>(s[0][2 * kc + 1][2], s[0][2 * kc + 1][3]);
    }
}

// O (64 x D) += P (64 x 64 keys, registers: pa[ks] the A fragment of keys 16 ks .. 16 ks + 15)
// times V (64 keys x D, N-major in shared memory at `sv`).
template <int D>
__device__ __forceinline__ void pv_wgmma(float (&o)[D / 2], const u32 (&pa)[4][4],
                                         const unsigned char* sv, u32 lead_v, u32 stride_v) {
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
        const uint64_t db = smem_desc(sv + core_offset(16 * ks, 0, D), lead_v, stride_v);
        if constexpr (D == 128) {
            wgmma_m64n128k16_rs<1>(o, pa[ks], db, 1);
        } else {
            wgmma_m64n64k16_rs<1>(o, pa[ks], db, 1);
        }
    }
}

// Attention forward on wgmma, v1 (issue 11's first step; bf16, head_dim 64 or 128): one
// warpgroup (128 threads) per (64-row query tile, head, batch entry). Q, K and V tiles are
// brought by cp.async into the core-matrix layout (K and V double-buffered, 64 keys per tile),
// S = Q K^T on wgmma with both operands in shared memory, the online softmax in registers
// (FlashAttention-2's, in the accumulator's m16n8 layout per warp: online_softmax_rows), P
// packed to the register A operand and O += P V on wgmma with V N-major in shared memory.
// Masks as flash_fwd: keys at or past kv_lens[b] and, when CAUSAL, bottom-right causal; a row
// that sees no key gets O = 0 and LSE = +inf. The descriptor offsets come from the host (what
// the probe established): K-major Q and K (lead_k, stride_k), N-major V (lead_v, stride_v).
// Not yet: TMA, a producer warp, warp-group ping-pong, swizzled layouts.
template <int D, bool CAUSAL>
__device__ __forceinline__ void attn_fwd_sm90(const u16* __restrict__ Q, const u16* __restrict__ K,
                                              const u16* __restrict__ V, u16* __restrict__ O,
                                              float* __restrict__ LSE,
                                              const int* __restrict__ kv_lens, int Tq, int Tkv,
                                              int H, int KVH, float scale_log2, u32 lead_k,
                                              u32 stride_k, u32 lead_v, u32 stride_v) {
    constexpr int BR = 64, BC = 64, NTH = 128, DT = D / 8, TILE = BC * D * 2;
    unsigned char* sQ = dyn_smem;
    unsigned char* sK = sQ + BR * D * 2;  // 2 buffers
    unsigned char* sV = sK + 2 * TILE;    // 2 buffers
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t4 = lane & 3;
    const int qt = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int kvh = h / (H / KVH);
    const int L = min(kv_lens[b], Tkv);
    const int off = L - Tq;  // bottom-right: row i sees keys j <= i + off
    const int q0 = qt * BR;
    const int rows = min(BR, Tq - q0);
    int n_kt = (L + BC - 1) / BC;
    if (CAUSAL) n_kt = min(n_kt, max(0, (q0 + rows - 1 + off) / BC + 1));
    if (CAUSAL && q0 + rows - 1 + off < 0) n_kt = 0;
    const size_t q_off = ((size_t)(b * H + h) * Tq + q0) * D;
    const size_t kv_off = (size_t)(b * KVH + kvh) * Tkv * D;

    load_tile_core<BR, D, NTH>(sQ, Q + q_off, rows, tid);
    if (n_kt > 0) {
        load_tile_core<BC, D, NTH>(sK, K + kv_off, L, tid);
        load_tile_core<BC, D, NTH>(sV, V + kv_off, L, tid);
    }
    cp_async_commit();

    float o[1][DT][4];
    float s[1][8][4];
#pragma unroll
    for (int i = 0; i < DT; ++i) o[0][i][0] = o[0][i][1] = o[0][i][2] = o[0][i][3] = 0.f;
    float m_run[1][2] = {{NEG_INF, NEG_INF}}, l_run[1][2] = {{0.f, 0.f}};
    float(&of)[D / 2] = reinterpret_cast<float(&)[D / 2]>(o);
    float(&sf)[32] = reinterpret_cast<float(&)[32]>(s);

    for (int it = 0; it < n_kt; ++it) {
        const int buf = it & 1;
        const int k0 = it * BC;
        if (it + 1 < n_kt) {
            const int k1 = k0 + BC;
            load_tile_core<BC, D, NTH>(sK + (buf ^ 1) * TILE, K + kv_off + (size_t)k1 * D, L - k1, tid);
            load_tile_core<BC, D, NTH>(sV + (buf ^ 1) * TILE, V + kv_off + (size_t)k1 * D, L - k1, tid);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        fence_proxy_async();
        __syncthreads();
        const unsigned char* k_s = sK + buf * TILE;
        const unsigned char* v_s = sV + buf * TILE;
        // S = Q K^T over D / 16 k-steps.
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
            const uint64_t da = smem_desc(sQ + core_offset(0, 16 * ks, D), lead_k, stride_k);
            const uint64_t db = smem_desc(k_s + core_offset(0, 16 * ks, D), lead_k, stride_k);
            wgmma_m64n64k16_ss<0>(sf, da, db, ks > 0);
        }
        wgmma_commit();
        wgmma_wait<0>();
        // Scale to the log2 domain and mask (the last tile past L, the causal diagonal).
        const bool edge = k0 + BC > L || (CAUSAL && k0 + BC - 1 > q0 + off);
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float x = s[0][nt][e] * scale_log2;
                if (edge) {
                    const int row = q0 + 16 * warp + g + (e >> 1) * 8;
                    const int col = k0 + nt * 8 + 2 * t4 + (e & 1);
                    if (col >= L || (CAUSAL && col > row + off)) x = NEG_INF;
                }
                s[0][nt][e] = x;
            }
        }
        online_softmax_rows<1, 8, DT, true>(s, m_run, l_run, o, 0);
        u32 pa[4][4];
        pack_p<8>(s, pa);
        wgmma_fence();
        pv_wgmma<D>(of, pa, v_s, lead_v, stride_v);
        wgmma_commit();
        wgmma_wait<0>();
        __syncthreads();  // every warp is done with `buf` before it is refilled
    }
    cp_async_wait<0>();
    store_rows<1, DT, KP_WG_BF16>(o, m_run, l_run, O + q_off, LSE + (size_t)(b * H + h) * Tq + q0,
                            16 * warp, rows, g, t4);
}

#define V1_ENTRY(NAME, D)                                                                       \
    extern "C" __global__ void __launch_bounds__(128)                                           \
        NAME(const u16* Q, const u16* K, const u16* V, u16* O, float* LSE, const int* kv_lens,  \
             int Tq, int Tkv, int H, int KVH, float scale_log2, u32 lead_k, u32 stride_k,       \
             u32 lead_v, u32 stride_v, int causal) {                                            \
        if (causal)                                                                             \
            attn_fwd_sm90<D, true>(Q, K, V, O, LSE, kv_lens, Tq, Tkv, H, KVH, scale_log2,       \
                                   lead_k, stride_k, lead_v, stride_v);                         \
        else                                                                                    \
            attn_fwd_sm90<D, false>(Q, K, V, O, LSE, kv_lens, Tq, Tkv, H, KVH, scale_log2,      \
                                    lead_k, stride_k, lead_v, stride_v);                        \
    }

#if defined(KP_SM90_ALL) || defined(KP_SM90_attn_fwd_sm90_d64)
V1_ENTRY(attn_fwd_sm90_d64, 64)
#endif
#if defined(KP_SM90_ALL) || defined(KP_SM90_attn_fwd_sm90_d128)
V1_ENTRY(attn_fwd_sm90_d128, 128)
#endif

// ---------------------------------------------------------------------------------------------
// v2: the tensor memory accelerator, mbarriers, warp specialisation and 128-byte swizzling.
//
// Shared-memory tiles here are TMA's 128-byte-swizzled layout: a tile of R rows x D columns of
// 16-bit elements is stored as D / 64 column panels of R rows x 128 bytes (panel p at byte
// p * R * 128), and within a panel the 16-byte chunk c of row r sits at chunk c ^ (r % 8) of
// that row (the hardware swizzles on the way in, and wgmma unswizzles on the way out, given a
// 1024-byte-aligned panel). Descriptors (layout type 1, 128-byte swizzle): a K-major operand
// (Q, K: rows = M or N, columns = the reduction) advances along K by 32 bytes per k16 step
// inside a panel, its stride offset is the 1024 bytes between 8-row groups and its leading
// offset is unused; an MN-major operand (V: rows = keys = the reduction, columns = head_dim =
// N) advances along K by 2048 bytes (16 rows) per k16 step, its stride offset is the 1024 bytes
// between 8-row groups along K and its leading offset the distance between 64-column panels
// along N (CUTLASS's canonical GMMA layouts name the same two strides).

__device__ __forceinline__ uint64_t smem_desc_sw128(u32 saddr, u32 lead_bytes, u32 stride_bytes) {
    uint64_t d = (uint64_t)((saddr & 0x3FFFF) >> 4);
    d |= (uint64_t)((lead_bytes & 0x3FFFF) >> 4) << 16;
    d |= (uint64_t)((stride_bytes & 0x3FFFF) >> 4) << 32;
    d |= 1ull << 62;
    return d;
}

// D (64 x 128, fp32) += A (64 x 16) * B (16 x 128), both from shared memory, B K-major (S = Q
// K^T with 128 keys per tile).
__device__ __forceinline__ void wgmma_m64n128k16_ss(float (&d)[64], uint64_t desc_a,
                                                    uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16" WG_AB
        WG_REGS64 ", %64, %65, p, 1, 1, 0, 0;\n}\n"
        : WG_ACC64(d)
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// Shared-memory plan of attn_fwd_sm90_ws (bytes from the 1024-aligned base): NC 64-row Q
// tiles (one per consumer warpgroup), ST stages of K and of V (BC keys each), then the
// mbarriers.
template <int D, int BC, int ST, int NC>
struct WsPlan {
    static constexpr u32 Q_TILE = 64 * D * 2;
    static constexpr u32 KV_TILE = BC * D * 2;
    static constexpr u32 Q = 0;
    static constexpr u32 K = NC * Q_TILE;
    static constexpr u32 V = K + ST * KV_TILE;
    static constexpr u32 BARS = V + ST * KV_TILE;
    // Q, then per stage: K full, V full, K empty, V empty; then Q empty.
    static constexpr u32 BYTES = BARS + 8 * (2 + 4 * ST);
};

// The score tile of one consumer warpgroup, 64 rows x BC keys, in the accumulator layout:
// masks it (keys at or past L, bottom-right causal with offset `off`; raw scores, so -inf
// stays -inf after the scale) when the tile touches an edge.
template <int NT, bool CAUSAL>
__device__ __forceinline__ void ws_mask(float (&s)[1][NT][4], int k0, int L, int off, int row0,
                                        bool edge, int g, int t4) {
    if (!edge) return;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int row = row0 + g + (e >> 1) * 8;
            const int col = k0 + nt * 8 + 2 * t4 + (e & 1);
            if (col >= L || (CAUSAL && col > row + off)) s[0][nt][e] = NEG_INF;
        }
}

// The online softmax (FlashAttention-2's) over one raw score tile, without touching O: per row
// (two per thread, reduced over the quad), the new running max in the log2 domain, alpha =
// 2^(m_old - m_new) for the caller to rescale O with once the P V product that reads O has
// finished, p = 2^(s * scale_log2 - m) (one FFMA and one EX2 per score), l = l alpha + sum p.
// A row that has seen no key (m = -inf) subtracts 0 instead.
template <int NT>
__device__ __forceinline__ void ws_softmax(float (&s)[1][NT][4], float (&m_run)[1][2],
                                           float (&l_run)[1][2], float (&alpha)[2],
                                           float scale_log2) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float mx = NEG_INF;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) mx = fmaxf(mx, fmaxf(s[0][nt][2 * r], s[0][nt][2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
        const float m_new = fmaxf(m_run[0][r], mx * scale_log2);
        const float m_use = m_new == NEG_INF ? 0.f : m_new;
        alpha[r] = fast_exp2(m_run[0][r] - m_use);
        m_run[0][r] = m_new;
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const float p0 = fast_exp2(fmaf(s[0][nt][2 * r], scale_log2, -m_use));
            const float p1 = fast_exp2(fmaf(s[0][nt][2 * r + 1], scale_log2, -m_use));
            s[0][nt][2 * r] = p0;
            s[0][nt][2 * r + 1] = p1;
            sum += p0 + p1;
        }
        l_run[0][r] = l_run[0][r] * alpha[r] + sum;
    }
}

// O *= alpha per row (the two rows a thread holds), after the P V product reading O landed.
template <int DT>
__device__ __forceinline__ void ws_rescale(float (&o)[1][DT][4], const float (&alpha)[2]) {
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) {
        o[0][dt][0] *= alpha[0];
        o[0][dt][1] *= alpha[0];
        o[0][dt][2] *= alpha[1];
        o[0][dt][3] *= alpha[1];
    }
}

// S (64 x BC) = Q K^T for one consumer warpgroup: D / 16 k-steps, both operands K-major and
// 128-byte swizzled (Q's panels 64 rows apart, K's BC rows), issued, not waited for.
template <int D, int BC>
__device__ __forceinline__ void ws_qk(float (&sf)[BC / 2], u32 sq, u32 sk) {
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
        const u32 koff = (u32)(ks & 3) * 32u;
        const uint64_t da = smem_desc_sw128(sq + (ks >> 2) * 64 * 128 + koff, 16, 1024);
        const uint64_t db = smem_desc_sw128(sk + (ks >> 2) * BC * 128 + koff, 16, 1024);
        wgmma_m64n128k16_ss(sf, da, db, ks > 0);
    }
}

// O (64 x D) += P (registers) V (BC keys x D, MN-major, 128-byte swizzled: panels BC rows
// apart), issued, not waited for.
template <int D, int BC>
__device__ __forceinline__ void ws_pv(float (&of)[D / 2], const u32 (&pa)[BC / 16][4], u32 sv) {
#pragma unroll
    for (int ks = 0; ks < BC / 16; ++ks) {
        const uint64_t db = smem_desc_sw128(sv + ks * 16 * 128, BC * 128, 1024);
        if constexpr (D == 128) {
            wgmma_m64n128k16_rs<1>(of, pa[ks], db, 1);
        } else {
            wgmma_m64n64k16_rs<1>(of, pa[ks], db, 1);
        }
    }
}


// store_rows for one part of a split tile: the output normalised over the part's keys, fp32
// (o_out: rows of D floats), and its log-sum-exp in the log2 domain (-inf where the part saw
// no key of the row, the output 0); rows at or past `rows` are not written.
template <int DT>
__device__ __forceinline__ void store_rows_f32(const float (&o)[1][DT][4], const float (&m_run)[1][2],
                                               const float (&l_run)[1][2], float* o_out,
                                               float* lse_out, int row0, int rows, int g, int t4) {
    constexpr int D = 8 * DT;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float l = quad_sum(l_run[0][r]);
        const float inv = l > 0.f ? 1.f / l : 0.f;
        const int row = row0 + g + r * 8;
        if (row < rows) {
#pragma unroll
            for (int dt = 0; dt < DT; ++dt)
                *reinterpret_cast<float2*>(o_out + (size_t)row * D + dt * 8 + 2 * t4) =
                    make_float2(o[0][dt][2 * r] * inv, o[0][dt][2 * r + 1] * inv);
            if (t4 == 0) lse_out[row] = l > 0.f ? m_run[0][r] + log2f(l) : NEG_INF;
        }
    }
}

// Attention forward on wgmma, v2 to v5 (issue 11; bf16, head_dim 64 or 128): 1 + NC
// warpgroups per 64 NC-row query tile. Warpgroup 0 is the producer: it gives up registers
// (setmaxnreg) and one of its threads brings Q (once per query tile) and K and V tiles (BC
// keys) through ST stages by TMA, each stage with a "full" mbarrier (TMA's transaction count)
// and an "empty" one (every consumer thread arrives when its warpgroup's wgmma has read the
// tile). Warpgroups 1 .. NC are consumers, with more registers, each owning 64 query rows:
// S = Q K^T on wgmma (both operands from shared memory), FlashAttention-2's online softmax in
// registers, O += P V on wgmma with P from registers. v2's consumers run independently, so
// the scheduler overlaps one's softmax with another's products; v3 to v5 add an explicit
// ping-pong between them (below). NC = 2 (v2, v3) or 3 (v4, FlashAttention-3's 192-row tile
// for head_dim 64).
// PIPE = false (v2): each tile's S is waited for, then its softmax, then its P V, waited for.
// PIPE = true (v3, FlashAttention-3's intra-warpgroup overlap): tile j's S = Q K^T and tile
// j-1's O += P V are issued together, the softmax of tile j runs while P V is in flight, and O
// is rescaled after it lands; causal query tiles go heaviest first within chunks of (head,
// batch entry) pairs (sm90::fwd_causal_chunk picks the chunk).
// Masks as attn_fwd_sm90: keys at or past kv_lens[b], bottom-right causal; a row that sees no
// key gets O = 0 and LSE = +inf. Rows and keys past the tensor's end are TMA's zero fill.
// scale_log2 must be positive (ws_softmax scales each row's raw maximum).
// The consumers' setmaxnreg.inc succeeds only if ptxas allocated the whole per-thread cap of
// the launch bounds (168 registers at NC = 2, 128 at NC = 3): the compile test checks it.
// FlashAttention-3's ping-pong between the consumer warpgroups (Shah et al., 2024, section
// 3.1), in the versions with the intra-warpgroup overlap (PIPE) unless the source defines
// KP_SM90_NO_PINGPONG (sm90::PINGPONG_ENV = 0, for timing against the kernel without it; on an
// H100 the ping-pong saved 1-15 % of the forward's time, kernels/TUNING.md): the consumers
// take turns to issue their wgmma, consumer c waiting on named barrier
// 1 + c and then arriving on the next one's, so one consumer's softmax runs while the tensor
// cores work on another's products rather than as the warp schedulers happen to interleave
// them. Each consumer of a CTA issues the same n_kt + 1 times (S of tile 0, then S of tile j
// with P V of tile j - 1, then the last P V): the last consumer starts the ring by one
// arrival and leaves out its last one, so every barrier's arrivals match its waits. This needs
// every consumer of a CTA to walk the same key tiles (item_at gives them per CTA, not per
// consumer: a per-consumer causal count would deadlock the ring). The persistent
// instantiation runs without it.
#ifdef KP_SM90_NO_PINGPONG
#define KP_SM90_PINGPONG_ON false
#else
#define KP_SM90_PINGPONG_ON true
#endif
// A probe switch (sm90::HopperForward::with_probe): the ping-pong on the persistent grid too.
#ifdef KP_SM90_PERSIST_PINGPONG
#define KP_SM90_PERSIST_PP_ON true
#else
#define KP_SM90_PERSIST_PP_ON false
#endif
__device__ __forceinline__ void named_sync(int id, int count) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int count) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

// Where a CTA's time goes (a probe; compiled in only where the source defines KP_SM90_TRACE,
// sm90::HopperForward::with_probe): for each of the first KP_TRACE_CTAS CTAs of a launch (one
// CTA per item, not the persistent grid), KP_TRACE_EVENTS moments as %globaltimer (ns, words
// 0 .. 7 of its row) and clock64 (the SM's cycles, words 8 .. 15), and the SM it ran on. The
// events: 0 the CTA's start, 1 its mbarriers set up, 2 the producer's last load issued, 3
// consumer 0's Q landed, 4 its first S = Q K^T landed, 5 its last P V landed, 6 its stores of O
// and LSE issued, 7 the same for the last consumer. An event a CTA does not reach stays 0.
#define KP_TRACE_CTAS 8192
#define KP_TRACE_EVENTS 8
#ifdef KP_SM90_TRACE
__device__ unsigned long long kp_fwd_trace[KP_TRACE_CTAS * 2 * KP_TRACE_EVENTS];
__device__ unsigned int kp_fwd_trace_sm[KP_TRACE_CTAS];
__device__ __forceinline__ void fwd_trace(int event) {
    const unsigned cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    if (cta >= KP_TRACE_CTAS) return;
    unsigned long long ns;
    asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(ns));
    kp_fwd_trace[cta * 2 * KP_TRACE_EVENTS + event] = ns;
    kp_fwd_trace[cta * 2 * KP_TRACE_EVENTS + KP_TRACE_EVENTS + event] = clock64();
    if (event == 0) {
        unsigned sm;
        asm volatile("mov.u32 %0, %%smid;\n" : "=r"(sm));
        kp_fwd_trace_sm[cta] = sm;
    }
}
#define KP_FWD_TRACE(on, event) \
    do {                         \
        if (on) fwd_trace(event); \
    } while (0)
#else
#define KP_FWD_TRACE(on, event) \
    do {                         \
        (void)(on);              \
    } while (0)
#endif

// The forward's epilogue through TMA (not on the persistent grid, whose producer refills Q's
// buffer early): consumer c's O (64 rows x D in the accumulator layout) divided by its row sums,
// as 16-bit words into its own Q tile's shared memory `sq` (free once its last S = Q K^T has
// landed), laid out as TMA brought Q (64-column panels of 64 rows x 128 bytes, 128-byte
// swizzle: the 16-byte chunk k of row r at chunk k ^ (r % 8), so the stores of a warp hit 32
// distinct banks); then, after the async-proxy fence and a barrier of the warpgroup's 128
// threads (named barrier 4 + c; the ping-pong has 1 .. NC), one thread stores the panels
// through the tensor map `to` (O's shape, as Q's map) at rows q0 .. q0 + 63 of plane `plane`,
// where TMA writes no row past Tq, and waits until they have been read. The O words and the
// LSE (natural log, +inf for a row that saw no key, rows below `rows` only) are store_rows'.
// On an H100 at B4 H8 D128 T4096 the epilogue from registers (32 four-byte stores a thread,
// eight rows of 16 bytes a warp instruction) took 2.05 us of a CTA's 54.8 and this one 1.28
// (the trace probe): the forward 2-5 % faster at D128 T2048 to 16384, about 0.3 % at D64, and
// 0.14-0.26 us slower where each CTA walks one key tile (kernels/TUNING.md).
// KP_SM90_NO_TMA_STORE (a probe switch) keeps store_rows.
#ifdef KP_SM90_NO_TMA_STORE
#define KP_SM90_TMA_STORE_ON false
#else
#define KP_SM90_TMA_STORE_ON true
#endif
template <int DT>
__device__ __forceinline__ void store_o_tma(const float (&o)[1][DT][4],
                                            const float (&m_run)[1][2],
                                            const float (&l_run)[1][2], u32 sq,
                                            const TmaMap* to, float* __restrict__ lse_out,
                                            int q0, int plane, int rows, int c, int warp, int g,
                                            int t4) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float l = quad_sum(l_run[0][r]);
        const float inv = l > 0.f ? 1.f / l : 0.f;
        const int row = 16 * warp + g + 8 * r;
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
            const u32 at = sq + (dt / 8) * (64 * 128) + row * 128 + (((dt % 8) ^ (row % 8)) << 4) +
                           4 * t4;
            const u32 v = pack2<KP_WG_BF16>(o[0][dt][2 * r] * inv, o[0][dt][2 * r + 1] * inv);
            asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(at), "r"(v) : "memory");
        }
        if (t4 == 0 && row < rows) lse_out[row] = row_lse(m_run[0][r], l);
    }
    fence_proxy_async();
    named_sync(4 + c, 128);
    if ((threadIdx.x & 127) == 0) {
#pragma unroll
        for (int p = 0; p < DT / 8; ++p) tma_store_3d(to, sq + p * 64 * 128, 64 * p, q0, plane);
        bulk_commit_and_wait_read();
    }
}

// The flex_attention hooks of attn_fwd_sm90_ws (kernels/flex_attn_fwd_sm90.cu defines the
// generated ones): the dense kernels take NoFlex, whose ON is false, and an empty FlexTiles.
// With ON, a CTA walks its query tile's list of key tiles from flex_block_mask (count[tile]
// tiles, their indices in index[tile * n_kt_all ..], full[...] = 1 for a tile the mask leaves
// whole), FX::tile applies the mask to a partial tile (and a score modification, where the
// hooks have one, to every tile), and everything else is the dense kernel's.
struct FlexTiles {
    const int* count;
    const int* index;
    const unsigned char* full;
    const int* aux;
    float scale;
};
// NoFlex needs no `tile`: its calls sit in branches `if constexpr (FX::ON)` discards.
struct NoFlex {
    enum { ON = 0 };  // an enum: a static constexpr member would leave a symbol in the cubin
};

template <int D, int BC, int ST, int NC, bool CAUSAL, bool PIPE, bool PERSIST, class FX = NoFlex>
__device__ __forceinline__ void attn_fwd_sm90_ws(const TmaMap* tq, const TmaMap* tk,
                                                 const TmaMap* tv, const TmaMap* to,
                                                 u16* __restrict__ O,
                                                 float* __restrict__ LSE,
                                                 const int* __restrict__ kv_lens, int Tq,
                                                 int Tkv, int H, int KVH, float scale_log2,
                                                 int whole, int parts, float* __restrict__ Opart,
                                                 float* __restrict__ Lpart, int chunk,
                                                 int items, const FlexTiles& fx = FlexTiles{}) {
    using P = WsPlan<D, BC, ST, NC>;
    static_assert(!FX::ON || (!CAUSAL && PIPE && !PERSIST), "flex: the one-CTA-per-tile grid");
    constexpr int PANELS = D / 64, DT = D / 8, NT = BC / 8, BR = 64 * NC;
    const u32 base = (smem_u32(dyn_smem) + 1023u) & ~1023u;
    const u32 bar_q = base + P::BARS;
    auto full_k = [&](int s) { return base + P::BARS + 8u * (1 + 4 * s); };
    auto full_v = [&](int s) { return base + P::BARS + 8u * (2 + 4 * s); };
    auto empty_k = [&](int s) { return base + P::BARS + 8u * (3 + 4 * s); };
    auto empty_v = [&](int s) { return base + P::BARS + 8u * (4 + 4 * s); };
    const u32 empty_q = base + P::BARS + 8u * (1 + 4 * ST);
    const int tid = threadIdx.x, wg = tid >> 7;
    // Work items. !PERSIST: one per CTA. Tiles are numbered (b * H + h) * qtiles + qt.
    // parts = 0: the grid is (qtiles, H, B). parts > 0 (the tail split, not causal): a 1-D
    // grid, CTA i < whole takes tile i over all its keys and CTA whole + j part j % parts of
    // tile whole + j / parts.
    // PIPE && CAUSAL: the (head, batch entry) pairs b H + h go in chunks of `chunk` (>= 1), and
    // CTA i (launch order, x fastest) of a chunk of g pairs takes query tile qtiles - 1 - j / g
    // of its pair j % g, j = i - (the chunk's first CTA): within a chunk the heaviest tiles of
    // every pair first, the lightest last (sm90::fwd_causal_tile mirrors it; chunk 1 is each
    // head's tiles heaviest first, a head at a time).
    // PERSIST (not causal): a 1-D grid of at most one CTA per SM; CTA c takes items c,
    // c + gridDim.x, ... below `items`, item i numbered as a CTA of the tail split (parts = 0:
    // every item a whole tile). The K and V stages run on from one item to the next, and the
    // producer brings the next item's Q as soon as the consumers' last S = Q K^T of the
    // current one has landed (the empty_q barrier), so an item's start overlaps the previous
    // item's last P V and its stores.
    const int qtiles = (Tq + BR - 1) / BR;
    struct Item {
        int qt, h, b, split, kt0, n_kt, L;
    };
    // flex: the first word of a query tile's list of key tiles.
    const int n_kt_all = (Tkv + BC - 1) / BC;
    auto tile_at = [&](const Item& w) { return (w.b * H + w.h) * qtiles + w.qt; };
    auto list_at = [&](const Item& w) { return (size_t)tile_at(w) * n_kt_all; };
    auto item_at = [&](int i) {
        Item w;
        w.split = -1;
        if (!PERSIST && PIPE && CAUSAL) {
            const int hb = gridDim.y * gridDim.z, nq = gridDim.x;
            const int c = blockIdx.x + nq * (blockIdx.y + gridDim.y * blockIdx.z);
            const int c0 = c / (nq * chunk) * chunk;  // the chunk's first pair
            const int g = min(chunk, hb - c0);
            const int j = c - c0 * nq;
            w.qt = nq - 1 - j / g;
            const int pair = c0 + j % g;
            w.h = pair % gridDim.y;
            w.b = pair / gridDim.y;
        } else if (!PERSIST && parts == 0) {
            w.qt = blockIdx.x;
            w.h = blockIdx.y;
            w.b = blockIdx.z;
        } else {
            int tile = PERSIST ? i : (int)blockIdx.x;
            if (parts > 0 && tile >= whole) {
                w.split = tile - whole;
                tile = whole + w.split / parts;
            }
            w.qt = tile % qtiles;
            w.h = (tile / qtiles) % H;
            w.b = tile / (qtiles * H);
        }
        w.L = min(kv_lens[w.b], Tkv);
        const int off = w.L - Tq, q0 = w.qt * BR, rows_cta = min(BR, Tq - q0);
        w.n_kt = FX::ON ? fx.count[tile_at(w)] : (w.L + BC - 1) / BC;
        if (CAUSAL)
            w.n_kt = q0 + rows_cta - 1 + off < 0 ? 0
                                                 : min(w.n_kt, (q0 + rows_cta - 1 + off) / BC + 1);
        // A part of a split tile takes key tiles kt0 .. kt0 + n_kt - 1 (possibly none).
        w.kt0 = 0;
        if (w.split >= 0) {
            const int p = w.split % parts;
            w.kt0 = w.n_kt * p / parts;
            w.n_kt = w.n_kt * (p + 1) / parts - w.kt0;
        }
        return w;
    };
    const int first = PERSIST ? (int)blockIdx.x : 0;
    const int stride = PERSIST ? (int)gridDim.x : 1;
    const int end = PERSIST ? items : 1;
    // The first item's coordinates before the barriers' set-up (its key length's load in
    // flight meanwhile); later items' where they are taken.
    KP_FWD_TRACE(!PERSIST && tid == 0, 0);
    const Item item0 = item_at(first);
    auto item = [&](int i) { return !PERSIST || i == first ? item0 : item_at(i); };

    if (tid == 0) {
        mbar_init(bar_q, 1);
        mbar_init(empty_q, 128 * NC);
        for (int s = 0; s < ST; ++s) {
            mbar_init(full_k(s), 1);
            mbar_init(full_v(s), 1);
            mbar_init(empty_k(s), 128 * NC);
            mbar_init(empty_v(s), 128 * NC);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    KP_FWD_TRACE(!PERSIST && tid == 0, 1);

    if (wg == 0) {
        // 128 x 40 + 256 x 232 (NC = 2) and 128 x 32 + 384 x 160 (NC = 3): at most the 64 K
        // registers of one SM.
        if constexpr (NC == 2) {
            asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
        } else {
            asm volatile("setmaxnreg.dec.sync.aligned.u32 32;\n" ::: "memory");
        }
        if (tid == 0) {
            int gi = 0, t = 0;  // K/V tiles and items brought so far
            for (int i = first; i < end; i += stride, ++t) {
                const Item w = item(i);
                const int kvh = w.h / (H / KVH);
                if (PERSIST && t > 0) mbar_wait(empty_q, (t - 1) & 1);
                mbar_expect_tx(bar_q, NC * P::Q_TILE);
#pragma unroll
                for (int c = 0; c < NC; ++c)
#pragma unroll
                    for (int p = 0; p < PANELS; ++p)
                        tma_load_3d(base + P::Q + c * P::Q_TILE + p * 64 * 128, tq, bar_q, 64 * p,
                                    w.qt * BR + 64 * c, w.b * H + w.h);
                for (int it = 0; it < w.n_kt; ++it, ++gi) {
                    const int s = gi % ST;
                    const u32 ph = ((gi / ST) + 1) & 1;
                    const int key = (FX::ON ? fx.index[list_at(w) + it] : w.kt0 + it) * BC,
                              plane = w.b * KVH + kvh;
                    if (gi >= ST) mbar_wait(empty_k(s), ph);
                    mbar_expect_tx(full_k(s), P::KV_TILE);
#pragma unroll
                    for (int p = 0; p < PANELS; ++p)
                        tma_load_3d(base + P::K + s * P::KV_TILE + p * BC * 128, tk, full_k(s),
                                    64 * p, key, plane);
                    if (gi >= ST) mbar_wait(empty_v(s), ph);
                    mbar_expect_tx(full_v(s), P::KV_TILE);
#pragma unroll
                    for (int p = 0; p < PANELS; ++p)
                        tma_load_3d(base + P::V + s * P::KV_TILE + p * BC * 128, tv, full_v(s),
                                    64 * p, key, plane);
                }
            }
            KP_FWD_TRACE(!PERSIST, 2);
        }
        return;
    }

    if constexpr (NC == 2) {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 160;\n" ::: "memory");
    }
    const int c = wg - 1;                 // consumer warpgroup: query rows 64 c .. 64 c + 63
    const int warp = (tid >> 5) & 3, lane = tid & 31;
    const int g = lane >> 2, t4 = lane & 3;
    const u32 sq = base + P::Q + c * P::Q_TILE;
    auto k_at = [&](int j) { return base + P::K + (j % ST) * P::KV_TILE; };
    auto v_at = [&](int j) { return base + P::V + (j % ST) * P::KV_TILE; };
    float o[1][DT][4];
    float s[1][NT][4];
    float(&of)[D / 2] = reinterpret_cast<float(&)[D / 2]>(o);
    float(&sf)[BC / 2] = reinterpret_cast<float(&)[BC / 2]>(s);
    u32 pa[BC / 16][4];
    int gi = 0;  // K/V tiles consumed so far

    for (int i = first; i < end; i += stride) {
        // Items consumed so far, from i (a register fewer than counting them: V4 is at its
        // 128 without a spill).
        const int t = PERSIST ? (i - first) / stride : 0;
        int L, n_kt, kt0, q0w;
        {
            const Item w = item(i);
            L = w.L;
            n_kt = w.n_kt;
            kt0 = w.kt0;
            q0w = w.qt * BR + 64 * c;
        }
        // The tile count (from a load) and the running tile count, broadcast from lane 0 to
        // tell ptxas that they are the same in every thread: the barrier waits' parities and
        // the wgmma descriptors' stages then stay uniform. Without the broadcasts ptxas
        // serialised every wgmma (a wait after each; no advisory), 25 % slower at T = 16384.
        if constexpr (PERSIST) {
            n_kt = __shfl_sync(0xffffffffu, n_kt, 0);
            gi = __shfl_sync(0xffffffffu, gi, 0);
        }
        if constexpr (FX::ON) n_kt = __shfl_sync(0xffffffffu, n_kt, 0);  // from a load too
        const int off = L - Tq, row0 = q0w + 16 * warp;
        auto edge_at = [&](int k0) {
            return k0 + BC > L || (CAUSAL && k0 + BC - 1 > q0w + off);
        };
        // Key tile `it` of the item: flex reads its first key and whether it is partial from
        // the tile list (`flex_at`, loaded before the wait for the tile's S so that the load's
        // latency hides behind it); `mask_tile` masks the score tile, or applies flex's hooks.
        struct FlexAt {
            int k0;
            bool partial;
        };
        auto flex_at = [&](int it) {
            FlexAt f{0, false};
            if constexpr (FX::ON) {
                const size_t at = list_at(item0) + it;
                f.k0 = fx.index[at] * BC;
                f.partial = !fx.full[at];
            }
            return f;
        };
        auto mask_tile = [&](int it, FlexAt f) {
            if constexpr (FX::ON) {
                FX::template tile<NT>(s, f.k0, L, row0, f.partial, item0.b, item0.h, Tq, Tkv, H,
                                      fx, g, t4);
            } else {
                const int k0 = (kt0 + it) * BC;
                ws_mask<NT, CAUSAL>(s, k0, L, off, row0, edge_at(k0), g, t4);
            }
        };
#pragma unroll
        for (int d = 0; d < DT; ++d) o[0][d][0] = o[0][d][1] = o[0][d][2] = o[0][d][3] = 0.f;
        float m_run[1][2] = {{NEG_INF, NEG_INF}}, l_run[1][2] = {{0.f, 0.f}};
        float alpha[2];

        mbar_wait(bar_q, t & 1);
        const bool traced = !PERSIST && tid == 128;  // consumer 0's first thread
        KP_FWD_TRACE(traced, 3);
        if constexpr (!PIPE) {
            for (int it = 0; it < n_kt; ++it) {
                const int j = gi + it;
                const u32 ph = (j / ST) & 1;
                const FlexAt fa = flex_at(it);
                mbar_wait(full_k(j % ST), ph);
                wgmma_fence();
                ws_qk<D, BC>(sf, sq, k_at(j));
                wgmma_commit();
                wgmma_wait<0>();
                mbar_arrive(empty_k(j % ST));
                mask_tile(it, fa);
                ws_softmax<NT>(s, m_run, l_run, alpha, scale_log2);
                ws_rescale<DT>(o, alpha);
                pack_p<NT>(s, pa);
                mbar_wait(full_v(j % ST), ph);
                wgmma_fence();
                ws_pv<D, BC>(of, pa, v_at(j));
                wgmma_commit();
                wgmma_wait<0>();
                mbar_arrive(empty_v(j % ST));
            }
            if constexpr (PERSIST) mbar_arrive(empty_q);
        } else if (n_kt > 0) {
            // The ping-pong's turns (no-ops under KP_SM90_NO_PINGPONG): wait for this consumer's
            // turn before issuing, hand it on after.
            constexpr bool PP = KP_SM90_PINGPONG_ON && (!PERSIST || KP_SM90_PERSIST_PP_ON);
            auto turn = [&]() {
                if constexpr (PP) named_sync(1 + c, 256);
            };
            auto hand_on = [&](bool last) {
                if constexpr (PP)
                    if (!(last && c == NC - 1)) named_arrive(1 + (c + 1) % NC, 256);
            };
            if constexpr (PP)
                if (c == NC - 1) named_arrive(1, 256);  // consumer 0 goes first
            // Tile 0: S alone (O is zero, nothing to rescale).
            const FlexAt fa0 = flex_at(0);
            mbar_wait(full_k(gi % ST), (gi / ST) & 1);
            turn();
            wgmma_fence();
            ws_qk<D, BC>(sf, sq, k_at(gi));
            wgmma_commit();
            hand_on(false);
            wgmma_wait<0>();
            KP_FWD_TRACE(traced, 4);
            mbar_arrive(empty_k(gi % ST));
            mask_tile(0, fa0);
            ws_softmax<NT>(s, m_run, l_run, alpha, scale_log2);
            pack_p<NT>(s, pa);
            for (int it = 1; it < n_kt; ++it) {
                const int j = gi + it, prev = j - 1;
                const FlexAt fa = flex_at(it);
                mbar_wait(full_k(j % ST), (j / ST) & 1);
                turn();
                wgmma_fence();
                ws_qk<D, BC>(sf, sq, k_at(j));
                wgmma_commit();
                mbar_wait(full_v(prev % ST), (prev / ST) & 1);
                ws_pv<D, BC>(of, pa, v_at(prev));
                wgmma_commit();
                hand_on(false);
                wgmma_wait<1>();  // S of tile it has landed; P V of tile it-1 may be in flight
                mbar_arrive(empty_k(j % ST));
                mask_tile(it, fa);
                ws_softmax<NT>(s, m_run, l_run, alpha, scale_log2);
                wgmma_wait<0>();  // P V of tile it-1 has landed: O and pa are free
                mbar_arrive(empty_v(prev % ST));
                ws_rescale<DT>(o, alpha);
                pack_p<NT>(s, pa);
            }
            // Every S of this item has landed: Q's buffer is free for the next item.
            if constexpr (PERSIST) mbar_arrive(empty_q);
            const int last = gi + n_kt - 1;
            mbar_wait(full_v(last % ST), (last / ST) & 1);
            turn();
            wgmma_fence();
            ws_pv<D, BC>(of, pa, v_at(last));
            wgmma_commit();
            hand_on(true);
            wgmma_wait<0>();
            KP_FWD_TRACE(traced, 5);
            mbar_arrive(empty_v(last % ST));
        } else if constexpr (PERSIST) {
            mbar_arrive(empty_q);
        }
        gi += n_kt;
        // A later item's coordinates again rather than kept live through the loop (registers).
        const Item w = PERSIST ? item_at(i) : item0;
        const int rows_w = max(0, min(64, Tq - q0w));
        if (rows_w > 0 && w.split >= 0)
            store_rows_f32<DT>(o, m_run, l_run, Opart + ((size_t)w.split * BR + 64 * c) * D,
                               Lpart + (size_t)w.split * BR + 64 * c, 16 * warp, rows_w, g, t4);
        else if (rows_w > 0 && !PERSIST && KP_SM90_TMA_STORE_ON)
            store_o_tma<DT>(o, m_run, l_run, sq, to, LSE + (size_t)(w.b * H + w.h) * Tq + q0w,
                            q0w, w.b * H + w.h, rows_w, c, warp, g, t4);
        else if (rows_w > 0)
            store_rows<1, DT, KP_WG_BF16>(o, m_run, l_run,
                                          O + ((size_t)(w.b * H + w.h) * Tq + q0w) * D,
                                          LSE + (size_t)(w.b * H + w.h) * Tq + q0w, 16 * warp,
                                          rows_w, g, t4);
        KP_FWD_TRACE(traced, 6);
        KP_FWD_TRACE(!PERSIST && tid == 128 * NC, 7);
    }
}

// The most parts the host splits a tile into (sm90::TAIL_MAX_PARTS; a unit test compares them).
#define KP_TAIL_MAX_PARTS 4

// The tail split's combine (attn_fwd_sm90_ws with parts > 0), one warp per row of the split
// tiles (tail of them, BR rows each): row r of split tile j (tile whole + j) merges its parts'
// normalised outputs Opart [tail][parts][BR][D] f32 with weights 2^(Lpart - m) / sum, where
// Lpart [tail][parts][BR] is each part's log2-domain log-sum-exp (-inf for a part that saw no
// key of the row) and m their maximum: O (bf16/fp16) and LSE (natural log; O = 0 and LSE = +inf
// for a row that saw no key), as the unsplit kernel writes them. Rows past Tq are skipped.
template <int D, int BR>
__device__ __forceinline__ void fwd_tail_combine(const float* __restrict__ Opart,
                                                 const float* __restrict__ Lpart,
                                                 u16* __restrict__ O, float* __restrict__ LSE,
                                                 int whole, int parts, int tail, int Tq) {
    constexpr int CPL = D / 32;  // columns per lane: 2 or 4
    const int wid = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5), lane = threadIdx.x & 31;
    if (wid >= tail * BR) return;
    const int j = wid / BR, r = wid % BR;
    const int qtiles = (Tq + BR - 1) / BR, tile = whole + j;
    const int row = (tile % qtiles) * BR + r;
    if (row >= Tq) return;
    const size_t out_row = (size_t)(tile / qtiles) * Tq + row;  // (b * H + h) * Tq + row
    float lp[KP_TAIL_MAX_PARTS], m = NEG_INF;
#pragma unroll
    for (int p = 0; p < KP_TAIL_MAX_PARTS; ++p) {
        lp[p] = p < parts ? Lpart[(size_t)(j * parts + p) * BR + r] : NEG_INF;
        m = fmaxf(m, lp[p]);
    }
    float acc[CPL] = {};
    float total = 0.f;
#pragma unroll
    for (int p = 0; p < KP_TAIL_MAX_PARTS; ++p) {
        const float w = m == NEG_INF || p >= parts ? 0.f : fast_exp2(lp[p] - m);
        total += w;
        if (w == 0.f) continue;
        const float* src = Opart + ((size_t)(j * parts + p) * BR + r) * D + lane * CPL;
#pragma unroll
        for (int e = 0; e < CPL; ++e) acc[e] += w * src[e];
    }
    const float inv = total > 0.f ? 1.f / total : 0.f;
    u16* dst = O + out_row * D + lane * CPL;
#pragma unroll
    for (int e = 0; e < CPL; e += 2)
        *reinterpret_cast<u32*>(dst + e) = pack2<KP_WG_BF16>(acc[e] * inv, acc[e + 1] * inv);
    if (lane == 0) LSE[out_row] = m == NEG_INF ? POS_INF : (m + log2f(total)) * LN2;
}

// Keys per tile of attn_fwd_sm90_ws (the host's WS_KEYS agrees).
#define WS_BC 128

// Each version's entry NAME and its tail split's combine NAME_combine (256 threads a CTA).
// causal: one CTA per query tile (heaviest first with PIPE); otherwise, with items > 0 the
// persistent grid, else one CTA per query tile or tail-split part. The persistent instantiation
// is compiled only where the source defines KP_SM90_PERSIST (sm90::HopperForward asks for it
// on request only: it costs 41-49 % more compile time on the device and measured no gain
// beyond noise; the host passes items > 0 only then).
#ifdef KP_SM90_PERSIST
#define KP_SM90_PERSIST_ON true
#else
#define KP_SM90_PERSIST_ON false
#endif
#define WS_ENTRY(NAME, D, NC, ST, PIPE)                                                     \
    extern "C" __global__ void __launch_bounds__(128 * (NC + 1), 1)                         \
        NAME(const __grid_constant__ TmaMap tq, const __grid_constant__ TmaMap tk,          \
             const __grid_constant__ TmaMap tv, const __grid_constant__ TmaMap to, u16* O,  \
             float* LSE, const int* kv_lens, int Tq, int Tkv, int H, int KVH,               \
             float scale_log2, int causal, int whole,                                       \
             int parts, float* Opart, float* Lpart, int chunk, int items) {                 \
        if (causal)                                                                         \
            attn_fwd_sm90_ws<D, WS_BC, ST, NC, true, PIPE, false>(                          \
                &tq, &tk, &tv, &to, O, LSE, kv_lens, Tq, Tkv, H, KVH, scale_log2, whole,    \
                parts, Opart, Lpart, chunk, 0);                                             \
        else if (KP_SM90_PERSIST_ON && items > 0)                                           \
            attn_fwd_sm90_ws<D, WS_BC, ST, NC, false, PIPE, KP_SM90_PERSIST_ON>(            \
                &tq, &tk, &tv, &to, O, LSE, kv_lens, Tq, Tkv, H, KVH, scale_log2, whole,    \
                parts, Opart, Lpart, chunk, items);                                         \
        else                                                                                \
            attn_fwd_sm90_ws<D, WS_BC, ST, NC, false, PIPE, false>(                         \
                &tq, &tk, &tv, &to, O, LSE, kv_lens, Tq, Tkv, H, KVH, scale_log2, whole,    \
                parts, Opart, Lpart, chunk, 0);                                             \
    }                                                                                       \
    extern "C" __global__ void __launch_bounds__(256)                                       \
        NAME##_combine(const float* Opart, const float* Lpart, u16* O, float* LSE, int whole, \
                       int parts, int tail, int Tq) {                                       \
        fwd_tail_combine<D, 64 * NC>(Opart, Lpart, O, LSE, whole, parts, tail, Tq);         \
    }

// v2: attn_fwd_sm90_ws_d*; v3 (the intra-warpgroup overlap): attn_fwd_sm90_wsp_d*; v4 (v3
// with three consumer warpgroups): attn_fwd_sm90_wsp3_d*; v5 (v3 with three K/V stages,
// 225 KB of shared memory at head_dim 128): attn_fwd_sm90_wsps3_d*. Consumers, stages:
#if defined(KP_SM90_ALL) || defined(KP_SM90_attn_fwd_sm90_ws_d64)
WS_ENTRY(attn_fwd_sm90_ws_d64, 64, 2, 2, false)
#endif
#if defined(KP_SM90_ALL) || defined(KP_SM90_attn_fwd_sm90_ws_d128)
WS_ENTRY(attn_fwd_sm90_ws_d128, 128, 2, 2, false)
#endif
#if defined(KP_SM90_ALL) || defined(KP_SM90_attn_fwd_sm90_wsp_d64)
WS_ENTRY(attn_fwd_sm90_wsp_d64, 64, 2, 2, true)
#endif
#if defined(KP_SM90_ALL) || defined(KP_SM90_attn_fwd_sm90_wsp_d128)
WS_ENTRY(attn_fwd_sm90_wsp_d128, 128, 2, 2, true)
#endif
#if defined(KP_SM90_ALL) || defined(KP_SM90_attn_fwd_sm90_wsp3_d64)
WS_ENTRY(attn_fwd_sm90_wsp3_d64, 64, 3, 2, true)
#endif
#if defined(KP_SM90_ALL) || defined(KP_SM90_attn_fwd_sm90_wsps3_d128)
WS_ENTRY(attn_fwd_sm90_wsps3_d128, 128, 2, 3, true)
#endif
