// Row kernels of the "math" attention path (cuBLAS GEMMs do the matrix products):
// - softmax_rows: P = softmax(S) row by row with the masks, and rows that see no key set to 0;
// - softmax_bwd_rows: dS = P * (dP - D_row), in place over P (the backward);
// - rowdot: D_row = sum_d dO * O (the backward's preprocessing);
// - pad_rows_v16/_v4, unpad_rows_v16/_v4: K and V into zero-padded buffers and dK, dV out of
//   them (below).
//
// S and dP: fp32 [rows, ld] with rows = B * H * Tq (S already scaled by the softmax scale in
// the GEMM that produced it); P and dS: the case's dtype (bf16, fp16 or fp32; OUT = 0, 1, 2),
// [rows, ld] likewise; O and dO: [rows, D]. Each row holds Tkv keys followed by ld - Tkv padding
// columns: ld is Tkv rounded up to a multiple of 8, so that every row of S and P starts on a
// 16-byte boundary whatever Tkv is (cuBLAS's tensor-core GEMMs over P and the 16-byte loads
// here need it). When Tkv is not a multiple of 8 the GEMMs also run over ld keys, on K and V
// copied into zero-padded buffers (pad_rows_*): cuBLAS's aligned kernels want the contiguous
// extent of each operand, here the key count of P, a multiple of 8 elements too.
// Row r is query i = r % Tq of head (r / Tq) % H of batch entry b = r / (Tq * H); that entry
// has L = kv_lens[b] valid keys and, with CAUSAL, query i sees key j iff j <= i + L - Tq
// (bottom-right alignment). One CTA of 256 threads per row, 16-byte loads of S and dP.
//
// No headers: 16-bit values are produced with PTX cvt instructions (on the CPU emulation,
// kernels/emulate/softmax_rows_check.cpp with KP_EMULATE, by the sequence-mixer prelude's
// rounding functions, which give the same bits).

typedef unsigned short u16;
typedef unsigned int u32;

#define THREADS 256
#define NEG_INF __int_as_float(0xff800000)
#define LOG2E 1.4426950408889634f

// Two fp32 values as bf16 (OUT 0) or fp16 (OUT 1) bits, `lo` in the low half.
template <int OUT>
__device__ __forceinline__ u32 pack2(float lo, float hi) {
#ifdef KP_EMULATE
    return OUT == 0 ? pack_bf16(lo, hi) : pack_f16(lo, hi);
#else
    u32 d;
    if (OUT == 0) {
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    } else {
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    }
    return d;
#endif
}

// fp16 bits as fp32 (exact).
__device__ __forceinline__ float half_to_f32(u16 x) {
#ifdef KP_EMULATE
    return f16_float(x);
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
    return f;
#endif
}

// Element j of a row of the case's dtype, as fp32.
template <int OUT>
__device__ __forceinline__ float load_elem(const u16* row, size_t j) {
    if (OUT == 2) return reinterpret_cast<const float*>(row)[j];
    const u16 x = row[j];
    if (OUT == 0) return __uint_as_float(((u32)x) << 16);
    return half_to_f32(x);
}

template <int OUT>
__device__ __forceinline__ void store4(u16* row, int c, float a, float b, float x, float y) {
    if (OUT == 2) {
        reinterpret_cast<float4*>(row)[c] = make_float4(a, b, x, y);
    } else {
        u32* p2 = reinterpret_cast<u32*>(row);
        p2[2 * c] = pack2<OUT>(a, b);
        p2[2 * c + 1] = pack2<OUT>(x, y);
    }
}

// Reduces `v` over the CTA with `op`; every thread gets the result.
template <bool MAX>
__device__ __forceinline__ float block_reduce(float v, float* scratch) {
    for (int o = 16; o > 0; o >>= 1) {
        float w = __shfl_xor_sync(0xffffffff, v, o);
        v = MAX ? fmaxf(v, w) : v + w;
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = scratch[lane < THREADS / 32 ? lane : 0];
    if (lane >= THREADS / 32) v = MAX ? NEG_INF : 0.f;
    for (int o = 16; o > 0; o >>= 1) {
        float w = __shfl_xor_sync(0xffffffff, v, o);
        v = MAX ? fmaxf(v, w) : v + w;
    }
    __syncthreads();
    return v;
}

// Keys row `r` sees: [0, valid).
template <bool CAUSAL>
__device__ __forceinline__ int visible(const int* kv_lens, size_t r, int Tq, int H) {
    const int i = (int)(r % (size_t)Tq);
    const int b = (int)(r / ((size_t)Tq * H));
    const int L = kv_lens[b];
    return CAUSAL ? max(0, min(L, i + L - Tq + 1)) : L;
}

template <int OUT, bool CAUSAL>
__device__ __forceinline__ void softmax_rows(const float* __restrict__ S, u16* __restrict__ P,
                                             const int* __restrict__ kv_lens, int Tq, int Tkv,
                                             int ld, int H) {
    __shared__ float scratch[THREADS / 32];
    constexpr int W = OUT == 2 ? 2 : 1;  // 16-bit words per element
    const size_t r = blockIdx.x;
    const int valid = visible<CAUSAL>(kv_lens, r, Tq, H);
    const float* s = S + r * (size_t)ld;
    u16* p = P + r * (size_t)ld * W;
    const float4* s4 = reinterpret_cast<const float4*>(s);
    if (valid == 0) {
        for (int c = threadIdx.x; c * 4 < ld; c += THREADS) store4<OUT>(p, c, 0.f, 0.f, 0.f, 0.f);
        return;
    }
    // The last vector of a row may reach into the padding (read, never used: the `valid`
    // tests below keep it out).
    float mx = NEG_INF;
    for (int c = threadIdx.x; c * 4 < valid; c += THREADS) {
        const float4 x = s4[c];
        const int j = c * 4;
        mx = fmaxf(mx, x.x);
        if (j + 1 < valid) mx = fmaxf(mx, x.y);
        if (j + 2 < valid) mx = fmaxf(mx, x.z);
        if (j + 3 < valid) mx = fmaxf(mx, x.w);
    }
    mx = block_reduce<true>(mx, scratch);

    float sum = 0.f;
    for (int c = threadIdx.x; c * 4 < valid; c += THREADS) {
        const float4 x = s4[c];
        const int j = c * 4;
        sum += exp2f((x.x - mx) * LOG2E);
        if (j + 1 < valid) sum += exp2f((x.y - mx) * LOG2E);
        if (j + 2 < valid) sum += exp2f((x.z - mx) * LOG2E);
        if (j + 3 < valid) sum += exp2f((x.w - mx) * LOG2E);
    }
    sum = block_reduce<false>(sum, scratch);
    const float inv = 1.f / sum;

    // Columns from `valid` on, the padding up to ld included, are written as 0 (P·V may run
    // over the padded key count).
    for (int c = threadIdx.x; c * 4 < ld; c += THREADS) {
        const int j = c * 4;
        const float4 x = s4[c];
        const float e0 = j < valid ? exp2f((x.x - mx) * LOG2E) * inv : 0.f;
        const float e1 = j + 1 < valid ? exp2f((x.y - mx) * LOG2E) * inv : 0.f;
        const float e2 = j + 2 < valid ? exp2f((x.z - mx) * LOG2E) * inv : 0.f;
        const float e3 = j + 3 < valid ? exp2f((x.w - mx) * LOG2E) * inv : 0.f;
        store4<OUT>(p, c, e0, e1, e2, e3);
    }
}

// Elements 4c .. 4c + 3 of a row of the case's dtype, as fp32 (one 16-byte load for fp32,
// one 8-byte load for 16-bit types; rows start on 16 bytes, ld being a multiple of 8).
template <int OUT>
__device__ __forceinline__ float4 load4(const u16* row, int c) {
    if (OUT == 2) return reinterpret_cast<const float4*>(row)[c];
    const uint2 w = reinterpret_cast<const uint2*>(row)[c];
    if (OUT == 0) {
        return make_float4(__uint_as_float(w.x << 16), __uint_as_float(w.x & 0xffff0000u),
                           __uint_as_float(w.y << 16), __uint_as_float(w.y & 0xffff0000u));
    }
    return make_float4(half_to_f32((u16)(w.x & 0xffff)), half_to_f32((u16)(w.x >> 16)),
                       half_to_f32((u16)(w.y & 0xffff)), half_to_f32((u16)(w.y >> 16)));
}

// dS = P * (dP - D_row), written over P. Masked entries have P = 0, so dS = 0 there. Vectors
// of 4 over the whole row, the padding up to ld included, written as 0 past Tkv (P is 0 there
// already; dP's padding is never read as a value: it may be unwritten where the GEMMs ran over
// Tkv keys). One 16-byte load of dP and one load and one store of P per vector: the scalar
// version (2-byte accesses) ran 10 % slower at Tkv = 4092 than at 4096 (kernels/TUNING.md).
template <int OUT>
__device__ __forceinline__ void softmax_bwd_rows(const float* __restrict__ dP, u16* __restrict__ P,
                                                 const float* __restrict__ Dsum, int Tkv,
                                                 int ld) {
    constexpr int W = OUT == 2 ? 2 : 1;
    const size_t r = blockIdx.x;
    const float d = Dsum[r];
    const float4* dp4 = reinterpret_cast<const float4*>(dP + r * (size_t)ld);
    u16* p = P + r * (size_t)ld * W;
    for (int c = threadIdx.x; c * 4 < ld; c += THREADS) {
        const int j = c * 4;
        const float4 g = dp4[c];
        const float4 v = load4<OUT>(p, c);
        const float a = j < Tkv ? v.x * (g.x - d) : 0.f;
        const float b = j + 1 < Tkv ? v.y * (g.y - d) : 0.f;
        const float x = j + 2 < Tkv ? v.z * (g.z - d) : 0.f;
        const float y = j + 3 < Tkv ? v.w * (g.w - d) : 0.f;
        if (OUT == 2) {
            reinterpret_cast<float4*>(p)[c] = make_float4(a, b, x, y);
        } else {
            reinterpret_cast<uint2*>(p)[c] = make_uint2(pack2<OUT>(a, b), pack2<OUT>(x, y));
        }
    }
}

// D_row = sum_d dO * O, one warp per row of D elements.
template <int OUT>
__device__ __forceinline__ void rowdot(const u16* __restrict__ O, const u16* __restrict__ dO,
                                       float* __restrict__ Dsum, int rows, int D) {
    constexpr int W = OUT == 2 ? 2 : 1;
    const int row = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const u16* o = O + (size_t)row * D * W;
    const u16* g = dO + (size_t)row * D * W;
    float acc = 0.f;
    for (int e = lane; e < D; e += 32) acc += load_elem<OUT>(o, e) * load_elem<OUT>(g, e);
    for (int k = 16; k > 0; k >>= 1) acc += __shfl_xor_sync(0xffffffff, acc, k);
    if (lane == 0) Dsum[row] = acc;
}

#define SOFTMAX(NAME, OUT, CAUSAL)                                                              \
    extern "C" __global__ void __launch_bounds__(THREADS)                                      \
        NAME(const float* S, u16* P, const int* kv_lens, int Tq, int Tkv, int ld, int H) {     \
        softmax_rows<OUT, CAUSAL>(S, P, kv_lens, Tq, Tkv, ld, H);                              \
    }
SOFTMAX(softmax_rows_bf16_full, 0, false)
SOFTMAX(softmax_rows_bf16_causal, 0, true)
SOFTMAX(softmax_rows_f16_full, 1, false)
SOFTMAX(softmax_rows_f16_causal, 1, true)
SOFTMAX(softmax_rows_f32_full, 2, false)
SOFTMAX(softmax_rows_f32_causal, 2, true)

// Each head's rows between [heads][Tkv][D] and the padded [heads][ld][D], K's (z = 0) and V's
// (z = 1) in one launch, in units of U: 16 bytes (uint4) when a row of K is a multiple of 16
// bytes, else 4 (u32; the host pads only when a row is a whole number of 32-bit words). Head
// h's first `kept` units go from src + h * src_head to dst + h * dst_head, and units kept ..
// filled - 1 of dst's head are written 0. Blocks stride over heads in y and over a head's
// units in x: no 64-bit division per element.
template <typename U>
__device__ __forceinline__ void copy_rows_t(const U* __restrict__ k, const U* __restrict__ v,
                                            U* __restrict__ dk, U* __restrict__ dv,
                                            long long heads, long long src_head,
                                            long long dst_head, long long kept,
                                            long long filled) {
    const U* src = blockIdx.z == 0 ? k : v;
    U* dst = blockIdx.z == 0 ? dk : dv;
    const U zero{};
    for (long long h = blockIdx.y; h < heads; h += gridDim.y) {
        const U* s = src + h * src_head;
        U* d = dst + h * dst_head;
        for (long long j = (long long)blockIdx.x * THREADS + threadIdx.x; j < filled;
             j += (long long)gridDim.x * THREADS) {
            d[j] = j < kept ? s[j] : zero;
        }
    }
}

// pad_rows: K and V into the padded Kp and Vp, rows Tkv..ld-1 written 0, so the GEMMs can run
// over ld keys, a multiple of 8, when Tkv is not, and whatever the previous call's backward
// left in the padding rows (its dK and dV go there) is zero again. `row`: units a row.
template <typename U>
__device__ __forceinline__ void pad_rows_t(const U* __restrict__ k, const U* __restrict__ v,
                                           U* __restrict__ kp, U* __restrict__ vp,
                                           long long heads, int Tkv, int ld, int row) {
    const long long kept = (long long)Tkv * row, per_head = (long long)ld * row;
    copy_rows_t<U>(k, v, kp, vp, heads, kept, per_head, kept, per_head);
}

// unpad_rows: the backward's dK and dV run over ld keys too (their output rows are the keys,
// P's and dS's contiguous extent), into the padded buffers (pad_rows's, free by then); each
// head's first Tkv rows of both are copied out to dK and dV [heads][Tkv][D]. The padding rows
// are left as they are: the next call's pad_rows zeroes them.
template <typename U>
__device__ __forceinline__ void unpad_rows_t(const U* __restrict__ kp, const U* __restrict__ vp,
                                             U* __restrict__ dk, U* __restrict__ dv,
                                             long long heads, int Tkv, int ld, int row) {
    const long long kept = (long long)Tkv * row, per_head = (long long)ld * row;
    copy_rows_t<U>(kp, vp, dk, dv, heads, per_head, kept, kept, kept);
}

#define PAD_ROWS(SUFFIX, U)                                                                     \
    extern "C" __global__ void __launch_bounds__(THREADS)                                      \
        pad_rows_##SUFFIX(const U* __restrict__ k, const U* __restrict__ v,                   \
                          U* __restrict__ kp, U* __restrict__ vp, long long heads, int Tkv,    \
                          int ld, int row) {                                                   \
        pad_rows_t<U>(k, v, kp, vp, heads, Tkv, ld, row);                                      \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(THREADS)                                      \
        unpad_rows_##SUFFIX(const U* __restrict__ kp, const U* __restrict__ vp,               \
                            U* __restrict__ dk, U* __restrict__ dv, long long heads, int Tkv,  \
                            int ld, int row) {                                                 \
        unpad_rows_t<U>(kp, vp, dk, dv, heads, Tkv, ld, row);                                  \
    }
PAD_ROWS(v16, uint4)
PAD_ROWS(v4, u32)

#define ROWS_BWD(DT, OUT)                                                                       \
    extern "C" __global__ void __launch_bounds__(THREADS)                                      \
        softmax_bwd_rows_##DT(const float* dP, u16* P, const float* Dsum, int Tkv, int ld) {   \
        softmax_bwd_rows<OUT>(dP, P, Dsum, Tkv, ld);                                           \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(THREADS)                                      \
        rowdot_##DT(const u16* O, const u16* dO, float* Dsum, int rows, int D) {              \
        rowdot<OUT>(O, dO, Dsum, rows, D);                                                     \
    }
ROWS_BWD(bf16, 0)
ROWS_BWD(f16, 1)
ROWS_BWD(f32, 2)
