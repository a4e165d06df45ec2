// The shim itself (cuda_shim.h): a block-wide sum through shared memory, __syncthreads and
// warp shuffles comes out exact; reads that a missing barrier leaves unordered against another
// thread's write, of a higher or a lower thread's slot, read the poison on some pass; a barrier
// that one thread skips stops the program. One argument: `sum`, `race_up`, `race_down` or
// `deadlock`. Prints "ALL OK" when the shim behaved as it should (`deadlock` never returns).
#include "cuda_shim.h"

#include <string>

constexpr unsigned kThreads = 128;

// Every thread's value t + 1 summed: warp shuffles, then the warps' sums through shared memory.
void block_sum(float* out) {
    const unsigned t = threadIdx.x;
    float v = (float)(t + 1);
    for (int m = 16; m > 0; m /= 2) v += __shfl_xor_sync(0xffffffffu, v, m);
    if (t % 32 == 0) smem[t / 32] = v;
    __syncthreads();
    if (t == 0) {
        float s = 0;
        for (unsigned w = 0; w < kThreads / 32; ++w) s += smem[w];
        out[blockIdx.x] = s;
    }
}

// Each thread writes its slot and reads a neighbour's with no barrier between; counts the
// reads that found the poison (NaN).
void racy_neighbour(int step, int* poisoned) {
    const int t = (int)threadIdx.x, u = t + step;
    __syncthreads();
    smem[t] = (float)t;
    if (u >= 0 && u < (int)kThreads && std::isnan(smem[u])) atomicAdd(poisoned, 1);
    __syncthreads();
}

// Thread 0 skips the barrier the others wait at.
void skips_a_barrier() {
    if (threadIdx.x != 0) __syncthreads();
}

int main(int argc, char** argv) {
    if (argc != 2) { std::fprintf(stderr, "usage: shim_check sum|race_up|race_down|deadlock\n"); return 2; }
    const std::string mode = argv[1];
    if (mode == "sum") {
        std::vector<float> out(3, -1.f);
        launch(dim3{3, 1, 1}, kThreads, [&] { block_sum(out.data()); });
        const float want = (float)(kThreads * (kThreads + 1) / 2);
        for (float s : out) if (s != want) { std::printf("sum %g, want %g\n", s, want); return 1; }
        std::printf("sum %g in each of 3 blocks\n", want);
    } else if (mode == "race_up" || mode == "race_down") {
        int poisoned = 0;
        launch(dim3{4, 1, 1}, kThreads, [&] { racy_neighbour(mode == "race_up" ? 1 : -1, &poisoned); });
        std::printf("%s: %d of %u reads found the poison\n", mode.c_str(), poisoned, 4 * (kThreads - 1));
        if (poisoned == 0) return 1;
    } else if (mode == "deadlock") {
        launch(dim3{1, 1, 1}, kThreads, [] { skips_a_barrier(); });
        std::printf("the skipped barrier went unnoticed\n");
        return 1;
    } else {
        std::fprintf(stderr, "unknown mode %s\n", mode.c_str());
        return 2;
    }
    std::printf("ALL OK\n");
    return 0;
}
