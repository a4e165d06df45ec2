// Hopper (sm_90a) building blocks for the attention kernels of issue 11, written for this
// project from the PTX ISA's description of the warpgroup-level matrix instructions
// (`wgmma.mma_async`, shared-memory matrix descriptors, async-proxy fences), and a probe kernel
// that checks them on the device before any attention kernel relies on them. Needs
// attn_prelude.cuh before it (u16, u32, smem_u32, pack2) and `-arch=sm_90a`.
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

typedef unsigned long long uint64_t;

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

// D (64 x 64, fp32, the accumulator layout below) += A (64 x 16) * B (16 x 64): A and B from
// shared memory through descriptors; B K-major (TRANS_B = 0: B^T's rows are the 64 columns of
// B, 16 elements each) or N-major (TRANS_B = 1: B's 16 rows of 64 elements). SCALE_D = 0
// overwrites D.
template <int TRANS_B>
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[32], uint64_t desc_a, uint64_t desc_b,
                                                  int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, %35;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]),
          "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
          "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]),
          "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
          "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
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
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]),
          "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
          "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]),
          "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
          "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(TRANS_B));
}

// The probe: one warpgroup computes C (64 x 64, fp32, row-major) from bf16 inputs, with the
// descriptors' leading and stride byte offsets given (so that the host can try both readings).
// mode 0: C = A B^T, A and B both [64][K] row-major in global memory, both K-major in shared
//         memory (Q K^T's form).
// mode 1: C = A V, A [64][K] in registers (P's form), V [K][64] row-major, N-major in shared
//         memory (P V's form, transposed B).
// K is a multiple of 16 up to 128. Dynamic shared memory: 2 * 64 * K * 2 bytes.
extern "C" __global__ void __launch_bounds__(128) wgmma_probe(
    const u16* __restrict__ A, const u16* __restrict__ B, float* __restrict__ C, int K, int mode,
    u32 lead_a, u32 stride_a, u32 lead_b, u32 stride_b) {
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned char* sA = smem;
    unsigned char* sB = smem + 64 * K * 2;
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
    wgmma_fence();
    if (mode == 0) {
        for (int s = 0; s < K / 16; ++s) {
            const uint64_t da = smem_desc(sA + core_offset(0, 16 * s, K), lead_a, stride_a);
            const uint64_t db = smem_desc(sB + core_offset(0, 16 * s, K), lead_b, stride_b);
            wgmma_m64n64k16_ss<0>(d, da, db, 1);
        }
    } else {
        const int row = 16 * warp + g;
        for (int s = 0; s < K / 16; ++s) {
            const int c0 = 16 * s + 2 * t4;
            u32 a[4];
            a[0] = (u32)A[row * K + c0] | ((u32)A[row * K + c0 + 1] << 16);
            a[1] = (u32)A[(row + 8) * K + c0] | ((u32)A[(row + 8) * K + c0 + 1] << 16);
            a[2] = (u32)A[row * K + c0 + 8] | ((u32)A[row * K + c0 + 9] << 16);
            a[3] = (u32)A[(row + 8) * K + c0 + 8] | ((u32)A[(row + 8) * K + c0 + 9] << 16);
            const uint64_t db = smem_desc(sB + core_offset(16 * s, 0, 64), lead_b, stride_b);
            wgmma_m64n64k16_rs<1>(d, a, db, 1);
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
