// Moves tensors between the token-major layout a projection writes, [B, T, H, D] (each token a
// row of H·D elements), and the head-major layout attention reads, [B, H, T, D]. Elements are
// W 16-bit words (1: bf16/fp16, 2: fp32), copied verbatim. One thread per destination element,
// grid-stride, 64-bit indices (B·T·H·D may pass 2^31).

template <int W>
__device__ __forceinline__ void move_heads(const unsigned short* __restrict__ src,
                                           unsigned short* __restrict__ dst, long long B,
                                           long long T, long long H, long long D,
                                           bool to_heads) {
    const long long n = B * T * H * D;
    const long long step = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) {
        const long long d = i % D;
        const long long r = i / D;
        long long s;
        if (to_heads) {
            // dst row r = (b·H + h)·T + t  <-  src row (b·T + t)·H + h
            const long long t = r % T, bh = r / T;
            const long long h = bh % H, b = bh / H;
            s = ((b * T + t) * H + h) * D + d;
        } else {
            // dst row r = (b·T + t)·H + h  <-  src row (b·H + h)·T + t
            const long long h = r % H, bt = r / H;
            const long long t = bt % T, b = bt / T;
            s = ((b * H + h) * T + t) * D + d;
        }
#pragma unroll
        for (int w = 0; w < W; ++w) dst[i * W + w] = src[s * W + w];
    }
}

// [B, T, H, D] -> [B, H, T, D]
extern "C" __global__ void split_heads_w1(const unsigned short* src, unsigned short* dst,
                                          long long B, long long T, long long H, long long D) {
    move_heads<1>(src, dst, B, T, H, D, true);
}
extern "C" __global__ void split_heads_w2(const unsigned short* src, unsigned short* dst,
                                          long long B, long long T, long long H, long long D) {
    move_heads<2>(src, dst, B, T, H, D, true);
}
// [B, H, T, D] -> [B, T, H, D]
extern "C" __global__ void merge_heads_w1(const unsigned short* src, unsigned short* dst,
                                          long long B, long long T, long long H, long long D) {
    move_heads<1>(src, dst, B, T, H, D, false);
}
extern "C" __global__ void merge_heads_w2(const unsigned short* src, unsigned short* dst,
                                          long long B, long long T, long long H, long long D) {
    move_heads<2>(src, dst, B, T, H, D, false);
}
