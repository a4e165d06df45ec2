// Row softmax for the "math" attention path: P = softmax(S) row by row, with the causal mask.
//
// S: fp32 [rows, T] (already scaled by 1/sqrt(head_dim) in the GEMM that produced it),
// P: bf16 or fp16 [rows, T]. Row r is query i = r % T of its (batch, head) slice; with CAUSAL,
// keys j > i get probability 0. One CTA of 256 threads per row, three passes over the row
// (max, sum of exponentials, write), 16-byte loads; T % 4 == 0 (checked by the host).
//
// No headers: 16-bit outputs are produced with PTX cvt instructions.

typedef unsigned short u16;
typedef unsigned int u32;

#define THREADS 256
#define NEG_INF __int_as_float(0xff800000)
#define LOG2E 1.4426950408889634f

template <bool BF16>
__device__ __forceinline__ u32 pack2(float lo, float hi) {
    u32 d;
    if (BF16) {
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    } else {
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    }
    return d;
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

template <bool BF16, bool CAUSAL>
__device__ __forceinline__ void softmax_rows(const float* __restrict__ S, u16* __restrict__ P,
                                             int T) {
    __shared__ float scratch[THREADS / 32];
    const size_t r = blockIdx.x;
    const int i = (int)(r % (size_t)T);
    const int valid = CAUSAL ? i + 1 : T;  // keys 0..valid-1 take part
    const float4* s4 = reinterpret_cast<const float4*>(S + r * (size_t)T);
    u32* p2 = reinterpret_cast<u32*>(P + r * (size_t)T);

    float mx = NEG_INF;
    for (int c = threadIdx.x; c * 4 < valid; c += THREADS) {
        float4 x = s4[c];
        int j = c * 4;
        mx = fmaxf(mx, x.x);
        if (j + 1 < valid) mx = fmaxf(mx, x.y);
        if (j + 2 < valid) mx = fmaxf(mx, x.z);
        if (j + 3 < valid) mx = fmaxf(mx, x.w);
    }
    mx = block_reduce<true>(mx, scratch);

    float sum = 0.f;
    for (int c = threadIdx.x; c * 4 < valid; c += THREADS) {
        float4 x = s4[c];
        int j = c * 4;
        sum += exp2f((x.x - mx) * LOG2E);
        if (j + 1 < valid) sum += exp2f((x.y - mx) * LOG2E);
        if (j + 2 < valid) sum += exp2f((x.z - mx) * LOG2E);
        if (j + 3 < valid) sum += exp2f((x.w - mx) * LOG2E);
    }
    sum = block_reduce<false>(sum, scratch);
    const float inv = 1.f / sum;

    for (int c = threadIdx.x; c * 4 < T; c += THREADS) {
        int j = c * 4;
        float4 x = s4[c];
        float e0 = j < valid ? exp2f((x.x - mx) * LOG2E) * inv : 0.f;
        float e1 = j + 1 < valid ? exp2f((x.y - mx) * LOG2E) * inv : 0.f;
        float e2 = j + 2 < valid ? exp2f((x.z - mx) * LOG2E) * inv : 0.f;
        float e3 = j + 3 < valid ? exp2f((x.w - mx) * LOG2E) * inv : 0.f;
        p2[2 * c] = pack2<BF16>(e0, e1);
        p2[2 * c + 1] = pack2<BF16>(e2, e3);
    }
}

extern "C" __global__ void __launch_bounds__(THREADS) softmax_rows_bf16_full(const float* S, u16* P, int T) {
    softmax_rows<true, false>(S, P, T);
}
extern "C" __global__ void __launch_bounds__(THREADS) softmax_rows_bf16_causal(const float* S, u16* P, int T) {
    softmax_rows<true, true>(S, P, T);
}
extern "C" __global__ void __launch_bounds__(THREADS) softmax_rows_f16_full(const float* S, u16* P, int T) {
    softmax_rows<false, false>(S, P, T);
}
extern "C" __global__ void __launch_bounds__(THREADS) softmax_rows_f16_causal(const float* S, u16* P, int T) {
    softmax_rows<false, true>(S, P, T);
}
