// Token routing, dispatch and combine of the MoE layer (issue 14), after the sequence-mixer
// prelude (u16, u32, ld / st of bf16, pack_bf16). The float64 definitions they follow are
// src/moe/reference.rs's `route`, `plan`, `dispatch` and `combine`; written for this project.
//
// An assignment is a (token, slot) pair, index a = token · top_k + slot. The plan sorts the
// assignments by expert, stably (within an expert, by assignment index), keeping the first
// `capacity` of each expert (capacity < 0: dropless), without a dense one-hot matrix and
// deterministically (no atomics decide an order):
//   moe_chunk_counts: per chunk of MD_CHUNK assignments, the count of each expert;
//   moe_plan_offsets: one block: per expert the ranks before each chunk (a running sum over
//                     chunks), the kept count min(count, capacity), offsets[E + 1] (a scan);
//   moe_scatter:      per chunk, each assignment's rank in its expert = the chunk's base + the
//                     warps before it in the chunk + its lane's rank among equal experts in its
//                     warp (__match_any_sync): row_of[a] (or -1 when past the capacity) and
//                     rows[row] = a.
// Then moe_gather copies x's token rows into expert order and moe_combine sums each token's
// kept rows times their gate weights.

#define MD_CHUNK 1024     // assignments per block of the plan kernels (one per thread)
#define MD_MAX_EXPERTS 1024
#define MD_MAX_TOP_K 16
#define MD_LANE_EXPERTS 8  // experts per lane in moe_route: E <= 256
#define MD_NEG_INF_BITS ((int)0xff800000u)
#define MD_NAN_BITS ((int)0xffc00000u)

// Routing: one warp per token. logits [T, E] float32 (finite); experts [T, top_k] int32 in
// decreasing logit (ties: the lower expert first); weights [T, top_k] float32: the softmax
// over the chosen logits (sigmoid = 0), or each chosen logit's sigmoid over their sum
// (sigmoid = 1). E <= 32 · MD_LANE_EXPERTS, top_k <= min(E, MD_MAX_TOP_K).
extern "C" __global__ void moe_route(const float* __restrict__ logits, int* __restrict__ experts,
                                     float* __restrict__ weights, int T, int E, int top_k,
                                     int sigmoid) {
    const int lane = threadIdx.x % 32;
    const int t = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (t >= T) return;
    float v[MD_LANE_EXPERTS];
#pragma unroll
    for (int i = 0; i < MD_LANE_EXPERTS; ++i) {
        const int e = lane + 32 * i;
        v[i] = e < E ? logits[(long long)t * E + e] : __int_as_float(MD_NEG_INF_BITS);
    }
    float chosen_v[MD_MAX_TOP_K];
    int chosen_e[MD_MAX_TOP_K];
    for (int j = 0; j < top_k; ++j) {
        // The lane's best (highest value, lowest expert on ties), then the warp's.
        float best = __int_as_float(MD_NEG_INF_BITS);
        int best_e = 0x7fffffff;
        for (int i = 0; i < MD_LANE_EXPERTS; ++i) {
            const int e = lane + 32 * i;
            if (e < E && (v[i] > best || (v[i] == best && e < best_e))) {
                best = v[i];
                best_e = e;
            }
        }
        for (int d = 16; d >= 1; d /= 2) {
            const float ob = __shfl_xor_sync(0xffffffffu, best, d);
            const int oe = __shfl_xor_sync(0xffffffffu, best_e, d);
            if (ob > best || (ob == best && oe < best_e)) {
                best = ob;
                best_e = oe;
            }
        }
        chosen_v[j] = best;
        chosen_e[j] = best_e;
        // Out of the running: the lane holding it marks it NaN (never > or == anything).
        for (int i = 0; i < MD_LANE_EXPERTS; ++i)
            if (lane + 32 * i == best_e) v[i] = __int_as_float(MD_NAN_BITS);
    }
    if (lane == 0) {
        float s[MD_MAX_TOP_K], sum = 0.f;
        for (int j = 0; j < top_k; ++j) {
            s[j] = sigmoid ? 1.f / (1.f + expf(-chosen_v[j])) : expf(chosen_v[j] - chosen_v[0]);
            sum += s[j];
        }
        for (int j = 0; j < top_k; ++j) {
            experts[(long long)t * top_k + j] = chosen_e[j];
            weights[(long long)t * top_k + j] = s[j] / sum;
        }
    }
}

// Per chunk c (block c, MD_CHUNK threads): counts[c · E + e] = assignments of chunk c routed
// to expert e. Dynamic shared memory: E ints.
extern "C" __global__ void moe_chunk_counts(const int* __restrict__ experts, int n_assign, int E,
                                            int* __restrict__ counts) {
    extern __shared__ float smem[];
    int* c = reinterpret_cast<int*>(smem);
    for (int e = threadIdx.x; e < E; e += blockDim.x) c[e] = 0;
    __syncthreads();
    const long long a = (long long)blockIdx.x * MD_CHUNK + threadIdx.x;
    if (a < n_assign) atomicAdd(&c[experts[a]], 1);
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x)
        counts[(long long)blockIdx.x * E + e] = c[e];
}

// One block of MD_MAX_EXPERTS threads (dynamic shared memory: MD_MAX_EXPERTS ints): thread e turns counts[c · E + e] into the ranks of
// expert e before chunk c (in place), then offsets[e] = Σ_{e' < e} min(count_e', capacity)
// (capacity < 0: no limit), offsets[E] = the kept rows.
extern "C" __global__ void moe_plan_offsets(int* __restrict__ counts, int n_chunks, int E,
                                            int capacity, int* __restrict__ offsets) {
    extern __shared__ float smem[];
    int* kept = reinterpret_cast<int*>(smem);  // MD_MAX_EXPERTS ints (dynamic shared memory)
    const int e = threadIdx.x;
    int run = 0;
    if (e < E) {
        for (int c = 0; c < n_chunks; ++c) {
            const long long i = (long long)c * E + e;
            const int n = counts[i];
            counts[i] = run;
            run += n;
        }
    }
    kept[e] = e < E ? (capacity >= 0 ? min(run, capacity) : run) : 0;
    __syncthreads();
    // Inclusive scan of kept[] (Hillis-Steele over the block).
    for (int d = 1; d < MD_MAX_EXPERTS; d *= 2) {
        const int add = e >= d ? kept[e - d] : 0;
        __syncthreads();
        kept[e] += add;
        __syncthreads();
    }
    if (e < E) offsets[e + 1] = kept[e];
    if (e == 0) offsets[0] = 0;
}

// Per chunk (block c, MD_CHUNK threads, one assignment each): row_of[a] = offsets[e] + rank
// (rank < capacity) or -1, and rows[row] = a. ranks: what moe_plan_offsets left in counts.
// Dynamic shared memory: 32 · E ints (per warp, per expert).
extern "C" __global__ void moe_scatter(const int* __restrict__ experts, int n_assign, int E,
                                       int capacity, const int* __restrict__ ranks,
                                       const int* __restrict__ offsets, int* __restrict__ row_of,
                                       int* __restrict__ rows) {
    extern __shared__ float smem[];
    int* wc = reinterpret_cast<int*>(smem);  // [32 warps][E]
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int i = threadIdx.x; i < 32 * E; i += blockDim.x) wc[i] = 0;
    __syncthreads();
    const long long a = (long long)blockIdx.x * MD_CHUNK + threadIdx.x;
    const bool valid = a < n_assign;
    // Invalid lanes take expert -1: they match only each other.
    const int e = valid ? experts[a] : -1;
    const unsigned peers = __match_any_sync(0xffffffffu, e);
    const int in_warp = __popc(peers & ((1u << lane) - 1u));
    if (valid && in_warp == 0) wc[warp * E + e] = __popc(peers);
    __syncthreads();
    // Exclusive prefix over the warps, per expert.
    for (int x = threadIdx.x; x < E; x += blockDim.x) {
        int run = 0;
        for (int w = 0; w < 32; ++w) {
            const int n = wc[w * E + x];
            wc[w * E + x] = run;
            run += n;
        }
    }
    __syncthreads();
    if (!valid) return;
    const int rank = ranks[(long long)blockIdx.x * E + e] + wc[warp * E + e] + in_warp;
    if (capacity >= 0 && rank >= capacity) {
        row_of[a] = -1;
    } else {
        const int row = offsets[e] + rank;
        row_of[a] = row;
        rows[row] = (int)a;
    }
}

// x [T, H] bf16 -> xd [rows, H]: row r is the token of assignment rows[r], i.e. rows[r] / top_k.
// Grid-stride over 16-byte pieces (H a multiple of 8); `n_rows` = offsets[E] read on the device.
extern "C" __global__ void moe_gather(const u16* __restrict__ x, const int* __restrict__ rows,
                                      const int* __restrict__ n_rows, int H, int top_k,
                                      u16* __restrict__ xd) {
    const int pieces = H / 8;
    const long long total = (long long)(*n_rows) * pieces;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / pieces;
        const int p = (int)(i - r * pieces);
        const long long t = rows[r] / top_k;
        reinterpret_cast<uint4*>(xd + r * H)[p] = reinterpret_cast<const uint4*>(x + t * H)[p];
    }
}

// out [T, H] bf16: out[t] = Σ_slot weights[t · top_k + slot] · yd[row_of[t · top_k + slot]]
// over the kept slots (row_of >= 0), in slot order, float32, rounded once. Grid-stride over
// (token, pair of columns); H even.
extern "C" __global__ void moe_combine(const u16* __restrict__ yd, const int* __restrict__ row_of,
                                       const float* __restrict__ weights, int T, int top_k, int H,
                                       u16* __restrict__ out) {
    const int pairs = H / 2;
    const long long total = (long long)T * pairs;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long t = i / pairs;
        const int c = 2 * (int)(i - t * pairs);
        float s0 = 0.f, s1 = 0.f;
        for (int j = 0; j < top_k; ++j) {
            const int r = row_of[t * top_k + j];
            if (r < 0) continue;
            const float w = weights[t * top_k + j];
            const u32 v = *reinterpret_cast<const u32*>(yd + (long long)r * H + c);
            s0 += w * __uint_as_float(v << 16);
            s1 += w * __uint_as_float(v & 0xffff0000u);
        }
        *reinterpret_cast<u32*>(out + t * H + c) = pack_bf16(s0, s1);
    }
}

// The SwiGLU activation between the experts' two grouped GEMMs: gu [rows, 2F] bf16 holds per
// row the gate projection (columns 0 .. F-1) then the up projection (F .. 2F-1); act [rows, F]
// bf16 = silu(gate) · up, silu(z) = z / (1 + e^(-z)), in float32, rounded once. Grid-stride
// over (row, pair of columns); F even; `n_rows` = offsets[E] read on the device, clamped to
// [0, max_rows] (the buffers' rows).
extern "C" __global__ void moe_swiglu(const u16* __restrict__ gu, const int* __restrict__ n_rows,
                                      int max_rows, int F, u16* __restrict__ act) {
    const int pairs = F / 2;
    const long long total = (long long)min(max(*n_rows, 0), max_rows) * pairs;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / pairs;
        const int c = 2 * (int)(i - r * pairs);
        const u32 g = *reinterpret_cast<const u32*>(gu + r * 2 * F + c);
        const u32 u = *reinterpret_cast<const u32*>(gu + r * 2 * F + F + c);
        const float g0 = __uint_as_float(g << 16), g1 = __uint_as_float(g & 0xffff0000u);
        const float u0 = __uint_as_float(u << 16), u1 = __uint_as_float(u & 0xffff0000u);
        const float a0 = g0 / (1.f + __expf(-g0)) * u0;
        const float a1 = g1 / (1.f + __expf(-g1)) * u1;
        *reinterpret_cast<u32*>(act + r * F + c) = pack_bf16(a0, a1);
    }
}

// bf16 [n] -> float32 [n] (the router's logits, a bf16 GEMM's result, for moe_route).
extern "C" __global__ void moe_bf16_to_f32(const u16* __restrict__ x, long long n,
                                           float* __restrict__ y) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        y[i] = __uint_as_float((u32)x[i] << 16);
}

// ---- The backward (the layer's, src/moe/reference.rs `moe_layer_backward`) ----
// The permutation's inverse carries the gradients back: row_of[a] takes an assignment to its
// dispatched row, so the backward of the gather is a sum over each token's kept rows (as the
// combine's forward), and the backward of the combine writes each kept row from its token
// (as the gather's forward), scaled by the gate weight.

// Backward of moe_combine for out's gradient dy [T, H] bf16. Per assignment a (token
// t = a / top_k, row r = row_of[a]): dyd[r] = weights[a] · dy[t] (bf16, rounded once) and
// dweights[a] = Σ_h dy[t, h] · yd[r, h] (float32); a dropped assignment (r < 0) gets
// dweights[a] = 0 and writes no row. One warp per assignment; H even.
extern "C" __global__ void moe_combine_backward(const u16* __restrict__ dy,
                                                const u16* __restrict__ yd,
                                                const int* __restrict__ row_of,
                                                const float* __restrict__ weights, int n_assign,
                                                int top_k, int H, u16* __restrict__ dyd,
                                                float* __restrict__ dweights) {
    const int lane = threadIdx.x % 32;
    const long long a = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (a >= n_assign) return;
    const int r = row_of[a];
    if (r < 0) {
        if (lane == 0) dweights[a] = 0.f;
        return;
    }
    const long long t = a / top_k;
    const float w = weights[a];
    float dot = 0.f;
    for (int c = 2 * lane; c < H; c += 64) {
        const u32 g = *reinterpret_cast<const u32*>(dy + t * H + c);
        const u32 y = *reinterpret_cast<const u32*>(yd + (long long)r * H + c);
        const float g0 = __uint_as_float(g << 16), g1 = __uint_as_float(g & 0xffff0000u);
        dot += g0 * __uint_as_float(y << 16) + g1 * __uint_as_float(y & 0xffff0000u);
        *reinterpret_cast<u32*>(dyd + (long long)r * H + c) = pack_bf16(w * g0, w * g1);
    }
    for (int d = 16; d >= 1; d /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, d);
    if (lane == 0) dweights[a] = dot;
}

// Backward of moe_swiglu: dact [rows, F] and gu [rows, 2F] (bf16) to dgu [rows, 2F] (bf16):
// with s = sigmoid(gate), d gate = dact · up · s · (1 + gate · (1 − s)) and d up = dact ·
// gate · s, float32, rounded once. The plan's offsets[E] rows (clamped to max_rows), as
// moe_swiglu; F even.
extern "C" __global__ void moe_swiglu_backward(const u16* __restrict__ dact,
                                               const u16* __restrict__ gu,
                                               const int* __restrict__ n_rows, int max_rows,
                                               int F, u16* __restrict__ dgu) {
    const int pairs = F / 2;
    const long long total = (long long)min(max(*n_rows, 0), max_rows) * pairs;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / pairs;
        const int c = 2 * (int)(i - r * pairs);
        const u32 da = *reinterpret_cast<const u32*>(dact + r * F + c);
        const u32 g = *reinterpret_cast<const u32*>(gu + r * 2 * F + c);
        const u32 u = *reinterpret_cast<const u32*>(gu + r * 2 * F + F + c);
        float dg[2], du[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float d = __uint_as_float(h ? (da & 0xffff0000u) : (da << 16));
            const float z = __uint_as_float(h ? (g & 0xffff0000u) : (g << 16));
            const float v = __uint_as_float(h ? (u & 0xffff0000u) : (u << 16));
            const float s = 1.f / (1.f + __expf(-z));
            dg[h] = d * v * s * (1.f + z * (1.f - s));
            du[h] = d * z * s;
        }
        *reinterpret_cast<u32*>(dgu + r * 2 * F + c) = pack_bf16(dg[0], dg[1]);
        *reinterpret_cast<u32*>(dgu + r * 2 * F + F + c) = pack_bf16(du[0], du[1]);
    }
}

// Backward of moe_gather: dx [T, H] bf16 = base[t] (when base is not null: the router's share
// of x's gradient) + Σ_slot dxd[row_of[t · top_k + slot]] over the kept slots, float32 in slot
// order, rounded once. Grid-stride over (token, pair of columns); H even.
extern "C" __global__ void moe_gather_backward(const u16* __restrict__ dxd,
                                               const int* __restrict__ row_of,
                                               const u16* __restrict__ base, int T, int top_k,
                                               int H, u16* __restrict__ dx) {
    const int pairs = H / 2;
    const long long total = (long long)T * pairs;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long t = i / pairs;
        const int c = 2 * (int)(i - t * pairs);
        float s0 = 0.f, s1 = 0.f;
        if (base != nullptr) {
            const u32 v = *reinterpret_cast<const u32*>(base + t * H + c);
            s0 = __uint_as_float(v << 16);
            s1 = __uint_as_float(v & 0xffff0000u);
        }
        for (int j = 0; j < top_k; ++j) {
            const int r = row_of[t * top_k + j];
            if (r < 0) continue;
            const u32 v = *reinterpret_cast<const u32*>(dxd + (long long)r * H + c);
            s0 += __uint_as_float(v << 16);
            s1 += __uint_as_float(v & 0xffff0000u);
        }
        *reinterpret_cast<u32*>(dx + t * H + c) = pack_bf16(s0, s1);
    }
}

// Backward of moe_route: dlogits [T, E] bf16 from the gate weights' gradient dweights
// [T, top_k] (float32), the routing (experts, weights) and the logits [T, E] (float32). With
// c = Σ_k weights_k · dweights_k: softmax gates (sigmoid = 0) give chosen logit j
// weights_j · (dweights_j − c); sigmoid gates, s_j = sigmoid(logit_j) and S = Σ s, give
// s_j · (1 − s_j) · (dweights_j − c) / S. Experts not chosen get 0 (top-k selection passes no
// gradient). One warp per token.
extern "C" __global__ void moe_route_backward(const float* __restrict__ dweights,
                                              const int* __restrict__ experts,
                                              const float* __restrict__ weights,
                                              const float* __restrict__ logits, int T, int E,
                                              int top_k, int sigmoid,
                                              u16* __restrict__ dlogits) {
    const int lane = threadIdx.x % 32;
    const long long t = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (t >= T) return;
    float c = 0.f, S = 0.f;
    for (int j = 0; j < top_k; ++j) {
        c += weights[t * top_k + j] * dweights[t * top_k + j];
        if (sigmoid) S += 1.f / (1.f + expf(-logits[t * E + experts[t * top_k + j]]));
    }
    for (int e = lane; e < E; e += 32) {
        float g = 0.f;
        for (int j = 0; j < top_k; ++j) {
            if (experts[t * top_k + j] != e) continue;
            const float dw = dweights[t * top_k + j] - c;
            if (sigmoid) {
                const float s = 1.f / (1.f + expf(-logits[t * E + e]));
                g = s * (1.f - s) * dw / S;
            } else {
                g = weights[t * top_k + j] * dw;
            }
        }
        const u32 bits = pack_bf16(g, 0.f);
        dlogits[t * E + e] = (u16)(bits & 0xffffu);
    }
}
