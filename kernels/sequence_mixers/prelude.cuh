// What every sequence-mixer kernel shares, prepended to each source by the host
// (src/sequence_mixers/cuda.rs, `with_prelude`): loads and stores of float32 or bf16 (held as
// its 16 bits, u16) values as float32, the bf16 store rounding to nearest even. No headers
// (NVRTC).

typedef unsigned short u16;

__device__ __forceinline__ float ld(const float* p, long long i) { return p[i]; }
__device__ __forceinline__ float ld(const u16* p, long long i) {
    return __uint_as_float(((unsigned int)p[i]) << 16);
}
__device__ __forceinline__ void st(float* p, long long i, float v) { p[i] = v; }
// bf16 bits of v, rounded to nearest even (finite inputs; NaN stays NaN).
__device__ __forceinline__ u16 to_bf16(float v) {
    unsigned int u = __float_as_uint(v);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (u16)(u >> 16);
}
__device__ __forceinline__ void st(u16* p, long long i, float v) { p[i] = to_bf16(v); }

typedef unsigned int u32;

// Two 16-bit values packed as the tensor cores read them: lo in the low 16 bits, each rounded
// to nearest even. pack_bf16: bf16 (on the GPU one cvt.rn.bf16x2.f32, which gives the same bits
// as to_bf16 for finite values); pack_f16: IEEE half precision (cvt.rn.f16x2.f32; values past
// 65504 round to infinity), for the MoE grouped GEMM's fp16 instance.
#ifdef KP_EMULATE
// fp16 bits of v, rounded to nearest even, as cvt.rn.f16.f32 gives them.
__device__ __forceinline__ u16 to_f16(float v) {
    const u32 u = __float_as_uint(v), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (u16)(sign | 0x7e00u);  // NaN
    if (a >= 0x477ff000u) return (u16)(sign | 0x7c00u);  // at or past 65520: infinity
    if (a >= 0x38800000u) {                              // a normal half: rebias, round
        u32 r = a - 0x38000000u;
        r += 0xfffu + ((r >> 13) & 1u);
        return (u16)(sign | (r >> 13));
    }
    // A subnormal half (or zero): the value in units of 2^-24, rounded to nearest even.
    const u32 e = a >> 23;
    if (e < 102) return (u16)sign;  // below 2^-25: rounds to zero
    const u32 mant = (a & 0x7fffffu) | 0x800000u, shift = 126 - e;
    u32 m = mant >> shift;
    const u32 rem = mant & ((1u << shift) - 1), half = 1u << (shift - 1);
    m += (rem > half || (rem == half && (m & 1u))) ? 1u : 0u;
    return (u16)(sign | m);
}
#define KP_PACK2(NAME, CVT, TO16)                                                                 \
    __device__ __forceinline__ u32 NAME(float lo, float hi) {                                    \
        return (u32)TO16(lo) | ((u32)TO16(hi) << 16);                                            \
    }
#else
#define KP_PACK2(NAME, CVT, TO16)                                                                 \
    __device__ __forceinline__ u32 NAME(float lo, float hi) {                                    \
        u32 d;                                                                                   \
        asm(CVT " %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));                                    \
        return d;                                                                                \
    }
#endif
KP_PACK2(pack_bf16, "cvt.rn.bf16x2.f32", to_bf16)
KP_PACK2(pack_f16, "cvt.rn.f16x2.f32", to_f16)
#undef KP_PACK2

// The warp-wide tensor-core product c += A B (mma.sync m16n8k16, 16-bit operands, float32
// accumulate; sm_80+): mma_bf16 on bf16, mma_f16 on fp16 operands, the same fragment layout.
// g = lane / 4, t = lane % 4: A 16 x 16 row-major from a[0] = (row g, k 2t, 2t+1),
// a[1] = (g + 8, 2t..), a[2] = (g, 8 + 2t..), a[3] = (g + 8, 8 + 2t..); B 16 x 8 from
// b0 = (k 2t, 2t+1; column g), b1 = (k 8 + 2t..; column g); c = (g, 2t), (g, 2t + 1),
// (g + 8, 2t), (g + 8, 2t + 1). The CPU emulation (emulate/cuda_shim.h) defines its own.
#ifndef KP_EMULATE
#define KP_MMA16(NAME, T)                                                                         \
    __device__ __forceinline__ void NAME(float* c, const u32* a, u32 b0, u32 b1) {               \
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." T "." T ".f32 "                    \
                     "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"           \
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                            \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));            \
    }
KP_MMA16(mma_bf16, "bf16")
KP_MMA16(mma_f16, "f16")
#undef KP_MMA16
#endif

// The warp-wide tf32 product c += A B (mma.sync m16n8k8, tf32 operands as 32-bit words from
// to_tf32, float32 accumulate; sm_80+). g = lane / 4, t = lane % 4: A 16 x 8 row-major from
// a[0] = (row g, k t), a[1] = (g + 8, t), a[2] = (g, t + 4), a[3] = (g + 8, t + 4); B 8 x 8 from
// b0 = (k t, column g), b1 = (k t + 4, column g); c as mma_bf16's. to_tf32 rounds a float to
// tf32 (10 explicit mantissa bits, to nearest, ties away: cvt.rna). The CPU emulation
// (emulate/cuda_shim.h) defines its own.
#ifndef KP_EMULATE
__device__ __forceinline__ u32 to_tf32(float x) {
    u32 r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}
__device__ __forceinline__ void mma_tf32(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
#endif

// Shared-memory fragment loads and asynchronous copies (sm_80+). ldsm_x4 / ldsm_x4_t: the
// warp-wide ldmatrix.m8n8.x4 (.trans) of four 8 x 8 bf16 matrices, lane l giving `p`, the
// address of row l % 8 of matrix l / 8 (16 bytes, 16-byte aligned); register i of lane
// (g = lane / 4, t = lane % 4) receives row g, columns 2t and 2t + 1 of matrix i, or with .trans
// rows 2t and 2t + 1 of column g. cp_async4 / cp_async16: 4- or 16-byte copies global -> shared
// that zero-fill the destination instead of reading when `valid` is false (`g` must still be a
// valid address); cp_async_commit closes a group, cp_async_wait<n> waits until at most n groups
// are in flight; prefetch_l2 asks for a line of global memory in L2. The CPU emulation
// (emulate/cuda_shim.h) defines its own.
#ifndef KP_EMULATE
__device__ __forceinline__ u32 smem_addr(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void ldsm_x4(u32* r, const u16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldsm_x4_t(u32* r, const u16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}
__device__ __forceinline__ void cp_async4(void* s, const void* g, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(smem_addr(s)), "l"(g),
                 "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async16(void* s, const void* g, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr(s)), "l"(g),
                 "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
// Asks for the 128-byte line holding `g` to be brought into L2 (no register, no wait).
__device__ __forceinline__ void prefetch_l2(const void* g) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(g));
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
#endif

// Inclusive prefix sums over a warp of the pairs (v0, v1) each lane holds for steps 2 lane and
// 2 lane + 1: s0 = sum of steps <= 2 lane, s1 = sum of steps <= 2 lane + 1; returns the total.
__device__ __forceinline__ float warp_pair_scan(float v0, float v1, float& s0, float& s1) {
    const int lane = threadIdx.x % 32;
    float run = v0 + v1;
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
        const float up = __shfl_up_sync(0xffffffffu, run, d);
        if (lane >= d) run += up;
    }
    s1 = run;
    s0 = run - v1;
    return __shfl_sync(0xffffffffu, run, 31);
}

// Tile helpers of the tensor-core kernels (SSD version 3, the gated delta rule version 3): the
// operands are bf16 rows in shared memory, padded so that the 8 rows of a fragment load fall in
// distinct banks.
#define FULL_MASK 0xffffffffu

// Word (two bf16) at row r, column k (even) of a bf16 array with rows `stride` halves apart.
__device__ __forceinline__ u32 ld2(const u16* base, int r, int stride, int k) {
    return *reinterpret_cast<const u32*>(base + r * stride + k);
}

// The two bf16 of `v` times (lo, hi), rounded back to bf16.
__device__ __forceinline__ u32 scale_pair(u32 v, float lo, float hi) {
    return pack_bf16(__uint_as_float(v << 16) * lo, __uint_as_float(v & 0xffff0000u) * hi);
}

// Two adjacent elements of y (i even): a bf16 pair in one word, or two floats.
__device__ __forceinline__ void st2(u16* y, long long i, float a, float b) {
    *reinterpret_cast<u32*>(y + i) = pack_bf16(a, b);
}
__device__ __forceinline__ void st2(float* y, long long i, float a, float b) {
    y[i] = a;
    y[i + 1] = b;
}

// The A fragment of rows r0 .. r0 + 15 and columns k0 .. k0 + 15 of the bf16 array `a` (rows
// `stride` halves apart), by one ldmatrix.x4.
__device__ __forceinline__ void ld_a(u32* f, const u16* a, int stride, int r0, int k0) {
    const int lane = threadIdx.x % 32;
    ldsm_x4(f, a + (r0 + (lane & 15)) * stride + k0 + (lane >> 4) * 8);
}

// acc[nt] += A B over k_steps steps of 16 for the warp's 16 rows from r0: A's rows are rows of
// the bf16 array `a` (`a_stride` halves apart), B's columns n0 + 8 nt + (0..7) are rows of the
// bf16 array `b` (B transposed), for the first `tiles` of NT tiles of 8 columns.
template <int NT>
__device__ __forceinline__ void mma_rows(float (*acc)[4], const u16* a, int a_stride, int r0,
                                         const u16* b, int b_stride, int n0, int k_steps,
                                         int tiles = NT) {
    const int lane = threadIdx.x % 32, mi = lane >> 3;
    for (int ks = 0; ks < k_steps; ++ks) {
        u32 f[4];
        ld_a(f, a, a_stride, r0, ks * 16);
#pragma unroll
        for (int nt = 0; nt < NT; nt += 2) {
            if (nt < tiles) {
                // Matrices: tile nt's rows at k and k + 8, then the next tile's (an odd last
                // tile loads its own rows twice).
                const int pair = nt + 1 < tiles ? nt + 1 : nt;
                u32 bf[4];
                ldsm_x4(bf, b + (n0 + (mi >= 2 ? pair : nt) * 8 + (lane & 7)) * b_stride +
                                ks * 16 + (mi & 1) * 8);
                mma_bf16(acc[nt], f, bf[0], bf[1]);
                if (nt + 1 < tiles) mma_bf16(acc[nt + 1], f, bf[2], bf[3]);
            }
        }
    }
}

// acc[nt] += A f[ks] B for the 16-step block ks of k: B's rows k (16 of them from ks 16) are
// rows of the bf16 array `b` (`b_stride` halves apart; B not transposed, read by
// ldmatrix.trans), its columns n0 + 8 nt + (0..7) for the first `tiles` of NT tiles. An odd last
// tile loads its own columns twice (ldmatrix.x4 brings two tiles).
template <int NT>
__device__ __forceinline__ void mma_k_block(float (*acc)[4], const u32* f, const u16* b,
                                            int b_stride, int ks, int n0, int tiles) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int nt = 0; nt < NT; nt += 2) {
        if (nt < tiles) {
            const int pair = nt + 1 < tiles ? nt + 1 : nt;
            u32 bf[4];
            ldsm_x4_t(bf, b + (ks * 16 + (lane & 15)) * b_stride + n0 + ((lane >> 4) ? pair : nt) * 8);
            mma_bf16(acc[nt], f, bf[0], bf[1]);
            if (nt + 1 < tiles) mma_bf16(acc[nt + 1], f, bf[2], bf[3]);
        }
    }
}

