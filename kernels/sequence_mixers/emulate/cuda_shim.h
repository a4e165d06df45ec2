// A CPU emulation of the CUDA subset the sequence-mixer kernels' block-wide code uses, so
// their index logic runs on any machine with a C++20 compiler (tests/kernels_emulate.rs): each
// CUDA thread of a block is a fiber (a ucontext with its own stack) on the one host thread,
// __syncthreads and the warps' exchanges are barriers at which a fiber yields until every
// thread of the barrier has arrived, the blocks of a grid one after another, shared memory
// filled with all-ones bits before each block (a NaN as float32 and as either bf16 half, so a
// read of what no thread wrote poisons the output) and guarded past the size the host gives the
// kernel (a write there is counted in g_overrun). The fibers run in turn from one barrier to
// the next, in a new random order on every pass (deterministic: seeded by the block), so a read
// that a missing barrier leaves unordered against another thread's write comes first on some
// pass and reads the poison; a barrier that some thread never reaches stops the program, naming
// the block and how many threads wait. Only whole segments between barriers are reordered: a
// fiber is never interrupted inside one, so a lost update of a non-atomic read-modify-write by
// several threads is not seen. Float arithmetic is the host's; the GPU tests check the device's.
//
// Fibers replace one std::thread per CUDA thread (until 2026-12-04): with 128-256 threads a
// block on a 2-core machine, every warp shuffle woke 32 sleeping threads, and the emulation
// tests spent most of their time in the kernel's scheduler.
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <cstring>
#include <functional>
#include <utility>
#include <limits>
#include <memory>
#include <vector>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>
struct dim3 { unsigned x = 0, y = 0, z = 0; };
// CUDA's 16-byte vector of four unsigned ints (16-byte loads and stores).
struct alignas(16) uint4 { unsigned x, y, z, w; };
// CUDA's 8-byte vector of two floats (8-byte loads and stores) and its constructor.
struct alignas(8) float2 { float x, y; };
inline float2 make_float2(float x, float y) { return {x, y}; }
// CUDA's 16-byte vector of four floats (16-byte loads).
struct alignas(16) float4 { float x, y, z, w; };
dim3 threadIdx, blockIdx, gridDim, blockDim;
// A barrier of `n` fibers: the last to arrive opens it (a new generation); every fiber that
// arrives yields to the scheduler in `launch`, the others until the generation they wait on
// has passed, so that the code after the barrier runs in the scheduler's order for all.
struct FiberBarrier {
    unsigned n, arrived = 0;
    unsigned long generation = 0;
    explicit FiberBarrier(unsigned count) : n(count) {}
    void arrive_and_wait();
};
// One CUDA thread: its context, the barrier it waits at (null when runnable) and the generation.
struct Fiber {
    ucontext_t ctx;
    const FiberBarrier* waits = nullptr;
    unsigned long generation = 0;
    bool done = false;
};
std::vector<Fiber> g_fibers;
unsigned g_current = 0;
ucontext_t g_scheduler;
void FiberBarrier::arrive_and_wait() {
    Fiber& f = g_fibers[g_current];
    if (++arrived == n) {
        arrived = 0;
        ++generation;
        f.waits = nullptr;
    } else {
        f.waits = this;
        f.generation = generation;
    }
    swapcontext(&f.ctx, &g_scheduler);
}
FiberBarrier* g_bar = nullptr;
inline void __syncthreads() { g_bar->arrive_and_wait(); }
// A warp: its 32 threads meet at a barrier of their own; shuffles exchange through `vals`. Every
// lane of the warp must reach each __syncwarp and shuffle (full-mask use only).
struct Warp {
    FiberBarrier bar{32};
    float vals[32];
    const unsigned short* rows[32];
};
std::vector<std::unique_ptr<Warp>> g_warps;
void g_mma_reset(unsigned warps);
inline void __syncwarp() { g_warps[threadIdx.x / 32]->bar.arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int lane_mask) {
    Warp& w = *g_warps[threadIdx.x / 32];
    const unsigned lane = threadIdx.x % 32;
    w.vals[lane] = v;
    w.bar.arrive_and_wait();
    const float got = w.vals[lane ^ lane_mask];
    w.bar.arrive_and_wait();
    return got;
}
inline float warp_exchange(float v, int src) {
    Warp& w = *g_warps[threadIdx.x / 32];
    w.vals[threadIdx.x % 32] = v;
    w.bar.arrive_and_wait();
    const float got = w.vals[src];
    w.bar.arrive_and_wait();
    return got;
}
inline float __shfl_sync(unsigned, float v, int src) { return warp_exchange(v, src & 31); }
inline float __shfl_up_sync(unsigned, float v, int delta) {
    const int lane = threadIdx.x % 32;
    const float got = warp_exchange(v, lane >= delta ? lane - delta : lane);
    return got;
}
// The int shuffles (the grouped GEMM's tile prefix, the MoE routing), through the float ones'
// exchange.
inline int __shfl_sync(unsigned m, int v, int src) {
    float f; std::memcpy(&f, &v, 4); f = __shfl_sync(m, f, src); std::memcpy(&v, &f, 4); return v;
}
inline int __shfl_xor_sync(unsigned m, int v, int lane_mask) {
    float f; std::memcpy(&f, &v, 4); f = __shfl_xor_sync(m, f, lane_mask); std::memcpy(&v, &f, 4); return v;
}
inline int __shfl_up_sync(unsigned m, int v, int delta) {
    float f; std::memcpy(&f, &v, 4); f = __shfl_up_sync(m, f, delta); std::memcpy(&v, &f, 4); return v;
}
// __match_any_sync over ints (the MoE plan): the lanes holding the same value as this one.
inline unsigned __match_any_sync(unsigned, int v) {
    unsigned m = 0;
    for (int src = 0; src < 32; ++src) m |= (unsigned)(__shfl_sync(0xffffffffu, v, src) == v) << src;
    return m;
}
inline int __popc(unsigned v) { return __builtin_popcount(v); }
// ldmatrix.m8n8.x4 (.trans) over b16 rows: every lane deposits its row address (lane l: row
// l % 8 of matrix l / 8), then reads its words: register i of lane (g, t) is row g, columns
// 2t, 2t + 1 of matrix i, or with trans rows 2t, 2t + 1 of column g. Addresses must be 16-byte
// aligned, as on the GPU.
inline void ldsm_emulated(unsigned* r, const unsigned short* p, bool trans) {
    Warp& w = *g_warps[threadIdx.x / 32];
    const unsigned lane = threadIdx.x % 32;
    if (reinterpret_cast<std::uintptr_t>(p) % 16 != 0) { std::fprintf(stderr, "ldmatrix: unaligned row\n"); std::abort(); }
    w.rows[lane] = p;
    w.bar.arrive_and_wait();
    const unsigned g = lane / 4, t = lane % 4;
    for (int i = 0; i < 4; ++i) {
        const unsigned short* const* m = w.rows + 8 * i;
        unsigned lo, hi;
        if (trans) { lo = m[2 * t][g]; hi = m[2 * t + 1][g]; }
        else { lo = m[g][2 * t]; hi = m[g][2 * t + 1]; }
        r[i] = lo | (hi << 16);
    }
    w.bar.arrive_and_wait();
}
inline void ldsm_x4(unsigned* r, const unsigned short* p) { ldsm_emulated(r, p, false); }
inline void ldsm_x4_t(unsigned* r, const unsigned short* p) { ldsm_emulated(r, p, true); }
// cp.async: copied at once (zeros when not valid); the waits have nothing to wait for.
// Alignment as on the GPU (the size of the copy).
inline void cp_async_emulated(void* s, const void* g, bool valid, size_t n) {
    if (reinterpret_cast<std::uintptr_t>(s) % n != 0 || reinterpret_cast<std::uintptr_t>(g) % n != 0) {
        std::fprintf(stderr, "cp.async: unaligned %zu-byte copy\n", n); std::abort();
    }
    if (valid) std::memcpy(s, g, n); else std::memset(s, 0, n);
}
inline void cp_async4(void* s, const void* g, bool valid) { cp_async_emulated(s, g, valid, 4); }
inline void cp_async16(void* s, const void* g, bool valid) { cp_async_emulated(s, g, valid, 16); }
inline void cp_async_commit() {}
inline void prefetch_l2(const void*) {}
template <int N> inline void cp_async_wait() {}
#define KP_EMULATE 1
#define __device__
#define __global__
#define __forceinline__ inline
#define __restrict__
#define __launch_bounds__(...)
#define __shared__
#define __align__(x)
alignas(16) float smem[1 << 17];
// A shared-memory address as the GPU's: the byte offset into the block's shared memory
// (`smem`), which wgmma's matrix descriptors carry.
inline unsigned smem_addr(const void* p) {
    return (unsigned)(static_cast<const char*>(p) - reinterpret_cast<const char*>(smem));
}
// Element (mn, k) of a wgmma operand in shared memory through its descriptor without swizzling
// (start address, leading byte offset: between the 8 x 16-byte core matrices along K, stride
// byte offset: along M or N; each stored >> 4 in bits 0-13, 16-29 and 32-45): a core matrix
// holds 8 rows of 16 contiguous bytes, the 8 elements of a row along K (K-major) or along M or
// N (`mn_major`), as the PTX ISA lays the no-swizzle operand out.
inline float wgmma_operand(unsigned long long desc, int mn, int k, bool mn_major) {
    const unsigned start = (unsigned)(desc & 0x3FFF) << 4;
    const unsigned lead = (unsigned)((desc >> 16) & 0x3FFF) << 4;
    const unsigned stride = (unsigned)((desc >> 32) & 0x3FFF) << 4;
    const unsigned off = mn_major
        ? start + (k / 8) * lead + (k % 8) * 16 + (mn / 8) * stride + (mn % 8) * 2
        : start + (mn / 8) * stride + (mn % 8) * 16 + (k / 8) * lead + (k % 8) * 2;
    if (off + 2 > sizeof(smem)) { std::fprintf(stderr, "wgmma: operand past shared memory\n"); std::abort(); }
    unsigned short bits;
    std::memcpy(&bits, reinterpret_cast<const char*>(smem) + off, 2);
    const unsigned u = (unsigned)bits << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
// wgmma.mma_async.m64nNk16 with bf16 A (64 x 16; K-major, or M-major with ta) and B (16 x N;
// K-major, or N-major with tb) from shared memory and float32 D, by each thread of the
// warpgroup for its own accumulators (thread t: warp w = t / 32 % 4, g = t % 32 / 4,
// t4 = t % 4; d[4 j + e] is row 16 w + g + 8 (e / 2), column 8 j + 2 t4 + e % 2), at issue: the
// operands are read then, not up to the wait as on the GPU. `acc` 0 overwrites D.
template <int N>
inline void wgmma_emulated(float* d, unsigned long long da, unsigned long long db, int acc,
                           bool ta, bool tb) {
    const unsigned t = threadIdx.x % 128, w = t / 32, g = (t % 32) / 4, t4 = t % 4;
    for (int j = 0; j < N / 8; ++j)
        for (int e = 0; e < 4; ++e) {
            const int row = 16 * w + g + 8 * (e / 2), col = 8 * j + 2 * t4 + e % 2;
            float sum = acc ? d[4 * j + e] : 0.f;
            for (int k = 0; k < 16; ++k) sum += wgmma_operand(da, row, k, ta) * wgmma_operand(db, col, k, tb);
            d[4 * j + e] = sum;
        }
}
inline float __expf(float x) { return std::exp(x); }
// The threads of a block are fibers of one host thread (blocks one after another): an add.
inline float atomicAdd(float* p, float v) { const float old = *p; *p = old + v; return old; }
inline int atomicAdd(int* p, int v) { const int old = *p; *p = old + v; return old; }
inline float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned int __float_as_uint(float f) { unsigned int u; std::memcpy(&u, &f, 4); return u; }
inline float __int_as_float(int u) { float f; std::memcpy(&f, &u, 4); return f; }
using std::min; using std::max;
int g_overrun = 0;
// Each fiber's stack (1 MB, far more than the kernels' frames of a few KB, rounded up to whole
// pages), above a page that may not be touched, so that an overflow stops the program instead
// of writing into the next fiber's stack. Mapped once per launch without reserving swap; pages
// are committed only as frames grow.
struct FiberStacks {
    size_t page = 0, stack_bytes = 0, bytes = 0;
    char* base = nullptr;
    explicit FiberStacks(unsigned threads) {
        page = (size_t)sysconf(_SC_PAGESIZE);
        stack_bytes = (1024 * 1024 + page - 1) / page * page;
        bytes = (stack_bytes + page) * threads;
        void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED) { std::perror("mmap of the fibers' stacks"); std::abort(); }
        base = static_cast<char*>(p);
        for (unsigned t = 0; t < threads; ++t)
            if (mprotect(base + (stack_bytes + page) * t, page, PROT_NONE) != 0) { std::perror("mprotect"); std::abort(); }
    }
    char* stack(unsigned t) const { return base + (stack_bytes + page) * t + page; }
    FiberStacks(const FiberStacks&) = delete;
    FiberStacks& operator=(const FiberStacks&) = delete;
    ~FiberStacks() { munmap(base, bytes); }
};
std::function<void()>* g_kernel = nullptr;
void fiber_main() {
    (*g_kernel)();
    g_fibers[g_current].done = true;
}
// smem_floats: the dynamic shared memory the host gives the kernel; a write past it is counted.
template <class F> void launch(dim3 grid, unsigned threads, F kernel, size_t smem_floats = 1 << 17) {
    gridDim = grid; blockDim = dim3{threads, 1, 1};
    std::function<void()> body = kernel;
    g_kernel = &body;
    const FiberStacks stacks(threads);
    for (unsigned z = 0; z < grid.z; ++z) for (unsigned y = 0; y < grid.y; ++y)
    for (unsigned x = 0; x < grid.x; ++x) {
        blockIdx = dim3{x, y, z};
        // All ones: a NaN as a float and as either bf16 half of one.
        std::memset(smem, 0xff, sizeof smem);
        FiberBarrier bar(threads); g_bar = &bar;
        g_warps.clear();
        for (unsigned w = 0; w < (threads + 31) / 32; ++w) g_warps.push_back(std::make_unique<Warp>());
        g_mma_reset((threads + 31) / 32);
        for (size_t i = smem_floats; i < (1u << 17); ++i) smem[i] = -12345.f;
        g_fibers.assign(threads, Fiber{});
        for (unsigned t = 0; t < threads; ++t) {
            Fiber& f = g_fibers[t];
            getcontext(&f.ctx);
            f.ctx.uc_stack.ss_sp = stacks.stack(t);
            f.ctx.uc_stack.ss_size = stacks.stack_bytes;
            f.ctx.uc_link = &g_scheduler;
            makecontext(&f.ctx, fiber_main, 0);
        }
        // Passes over the fibers, each in a new random order (xorshift, seeded by the block),
        // each running every runnable one to its next barrier or its end.
        unsigned left = threads;
        std::vector<unsigned> order(threads);
        for (unsigned t = 0; t < threads; ++t) order[t] = t;
        uint64_t seed = 0x9e3779b97f4a7c15ull ^ (((uint64_t)z << 42) | ((uint64_t)y << 21) | x);
        auto next = [&seed] { seed ^= seed << 13; seed ^= seed >> 7; seed ^= seed << 17; return seed; };
        for (unsigned pass = 0; left > 0; ++pass) {
            bool ran = false;
            for (unsigned i = threads; i > 1; --i) std::swap(order[i - 1], order[next() % i]);
            for (unsigned i = 0; i < threads; ++i) {
                const unsigned t = order[i];
                Fiber& f = g_fibers[t];
                if (f.done || (f.waits != nullptr && f.waits->generation == f.generation)) continue;
                f.waits = nullptr;
                g_current = t;
                threadIdx = dim3{t, 0, 0};
                swapcontext(&g_scheduler, &f.ctx);
                ran = true;
                if (g_fibers[t].done) --left;
            }
            if (!ran) {
                std::fprintf(stderr, "block (%u, %u, %u): %u of %u threads wait at a barrier that the others never reach\n",
                             x, y, z, left, threads);
                std::abort();
            }
        }
        for (size_t i = smem_floats; i < (1u << 17); ++i) if (smem[i] != -12345.f) { ++g_overrun; break; }
    }
    g_kernel = nullptr;
}
// mma.sync m16n8k16 bf16 -> float32 (prelude.cuh's mma_bf16, whose comment gives the fragment
// layout): every lane of the warp deposits its fragments, then computes its own four outputs
// from the whole A and B in float64 of the bf16 values, rounded once to float32.
struct MmaFrags { unsigned a[32][4], b[32][2]; };
std::vector<std::unique_ptr<MmaFrags>> g_mma;
inline float bf16_float(unsigned bits16) { return __uint_as_float((bits16 & 0xffffu) << 16); }
// IEEE half-precision bits (the low 16) as float32, exactly (subnormals, infinities, NaN).
inline float f16_float(unsigned bits16) {
    const unsigned h = bits16 & 0xffffu, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    const float v = e == 0 ? std::ldexp((float)m, -24)
                  : e == 31 ? (m ? NAN : INFINITY)
                            : std::ldexp((float)(m | 0x400u), (int)e - 25);
    return (h & 0x8000u) ? -v : v;
}
// Every lane of the calling warp deposits its fragments; returns the warp's once all have.
inline MmaFrags& mma_gather(const unsigned* a, unsigned b0, unsigned b1) {
    const unsigned lane = threadIdx.x % 32, w = threadIdx.x / 32;
    MmaFrags& f = *g_mma[w];
    for (int j = 0; j < 4; ++j) f.a[lane][j] = a[j];
    f.b[lane][0] = b0; f.b[lane][1] = b1;
    g_warps[w]->bar.arrive_and_wait();
    return f;
}
// After every lane has decoded the whole A (16 x K) and B (K x 8) from the gathered fragments:
// the calling lane's four outputs c += A B, in float64 rounded once to float32.
template <int K>
inline void mma_outputs(float* c, const float (&A)[16][K], const float (&B)[K][8]) {
    const unsigned lane = threadIdx.x % 32;
    g_warps[threadIdx.x / 32]->bar.arrive_and_wait();
    const int g = lane / 4, t = lane % 4;
    const int rn[4][2] = {{g, 2 * t}, {g, 2 * t + 1}, {g + 8, 2 * t}, {g + 8, 2 * t + 1}};
    for (int e = 0; e < 4; ++e) {
        double acc = 0;
        for (int k = 0; k < K; ++k) acc += (double)A[rn[e][0]][k] * B[k][rn[e][1]];
        c[e] = (float)(c[e] + acc);
    }
}
// The product over one warp's fragments whose 16-bit halves DECODE turns into floats:
// mma_bf16 and mma_f16 (prelude.cuh's mma_f16, the same layout with fp16 operands) below.
template <float (*DECODE)(unsigned)>
inline void mma_emulated(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    const MmaFrags& f = mma_gather(a, b0, b1);
    float A[16][16], B[16][8];
    for (int l = 0; l < 32; ++l) {
        const int g = l / 4, t = l % 4;
        const int rk[4][2] = {{g, 2 * t}, {g + 8, 2 * t}, {g, 8 + 2 * t}, {g + 8, 8 + 2 * t}};
        for (int j = 0; j < 4; ++j) {
            A[rk[j][0]][rk[j][1]] = DECODE(f.a[l][j]);
            A[rk[j][0]][rk[j][1] + 1] = DECODE(f.a[l][j] >> 16);
        }
        B[2 * t][g] = DECODE(f.b[l][0]); B[2 * t + 1][g] = DECODE(f.b[l][0] >> 16);
        B[8 + 2 * t][g] = DECODE(f.b[l][1]); B[8 + 2 * t + 1][g] = DECODE(f.b[l][1] >> 16);
    }
    mma_outputs<16>(c, A, B);
}
inline void mma_bf16(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    mma_emulated<bf16_float>(c, a, b0, b1);
}
inline void mma_f16(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    mma_emulated<f16_float>(c, a, b0, b1);
}
// tf32 (prelude.cuh's to_tf32): the float rounded to 10 explicit mantissa bits, to nearest with
// ties away from zero (cvt.rna), as its 32-bit pattern (infinities and NaN kept).
inline unsigned to_tf32(float x) {
    unsigned u = __float_as_uint(x);
    if ((u & 0x7f800000u) == 0x7f800000u) return u;
    u += 0x1000u;  // half of the 13 dropped bits: ties go away from zero in magnitude
    return u & 0xffffe000u;
}
// mma.sync m16n8k8 tf32 -> float32 (prelude.cuh's mma_tf32, whose comment gives the layout):
// as mma_emulated, on the fragments' tf32 values in float64.
inline void mma_tf32(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    const MmaFrags& f = mma_gather(a, b0, b1);
    float A[16][8], B[8][8];
    for (int l = 0; l < 32; ++l) {
        const int g = l / 4, t = l % 4;
        A[g][t] = __uint_as_float(f.a[l][0]); A[g + 8][t] = __uint_as_float(f.a[l][1]);
        A[g][t + 4] = __uint_as_float(f.a[l][2]); A[g + 8][t + 4] = __uint_as_float(f.a[l][3]);
        B[t][g] = __uint_as_float(f.b[l][0]); B[t + 4][g] = __uint_as_float(f.b[l][1]);
    }
    mma_outputs<8>(c, A, B);
}
void g_mma_reset(unsigned warps) {
    g_mma.clear();
    for (unsigned w = 0; w < warps; ++w) g_mma.push_back(std::make_unique<MmaFrags>());
}
