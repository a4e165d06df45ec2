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
// Round to nearest even (finite inputs; NaN stays NaN).
__device__ __forceinline__ void st(u16* p, long long i, float v) {
    unsigned int u = __float_as_uint(v);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        p[i] = (u16)((u >> 16) | 0x40);
        return;
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    p[i] = (u16)(u >> 16);
}
