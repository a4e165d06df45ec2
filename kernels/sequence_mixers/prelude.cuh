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

// Two bf16 values packed as the tensor cores read them: lo in the low 16 bits.
__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
    return (u32)to_bf16(lo) | ((u32)to_bf16(hi) << 16);
}

// The warp-wide tensor-core product c += A B (mma.sync m16n8k16, bf16 in, float32 accumulate;
// sm_80+), g = lane / 4, t = lane % 4: A 16 x 16 row-major from a[0] = (row g, k 2t, 2t+1),
// a[1] = (g + 8, 2t..), a[2] = (g, 8 + 2t..), a[3] = (g + 8, 8 + 2t..); B 16 x 8 from
// b0 = (k 2t, 2t+1; column g), b1 = (k 8 + 2t..; column g); c = (g, 2t), (g, 2t + 1),
// (g + 8, 2t), (g + 8, 2t + 1). The CPU emulation (emulate/cuda_shim.h) defines its own.
#ifndef KP_EMULATE
__device__ __forceinline__ void mma_bf16(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
#endif
