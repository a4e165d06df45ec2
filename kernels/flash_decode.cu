// Decoding attention split over the key axis (flash-decoding: Dao, Haziza, Massa and Sizov,
// 2023) over a paged KV cache (vLLM's PagedAttention layout: Kwon et al., 2023), in two
// kernels. The host prepends attn_prelude.cuh (src/attention/decode_gpu.rs).
//
// flash_decode_split: one CTA of 128 threads per (split s, kv head and row block, sequence b).
// The G = H / KVH query heads that share the kv head, each with its Tq query rows, are G * Tq
// rows (row q = g * Tq + i: query head kvh * G + g, query i), taken R_MAX at a time: row block
// rb holds rows [rb * R_MAX, min(G * Tq, (rb + 1) * R_MAX)) (grid y = KVH * row blocks, y =
// kvh * row blocks + rb). A CTA attends its rows to the keys [s * keys_per_split,
// min(seq_lens[b], (s + 1) * keys_per_split)) of sequence b (the last split: to seq_lens[b]). Key t lives at
//   page_stride * block_table[b * max_pages + t / page_size] + row_stride * (t % page_size)
//   + head_stride * kvh
// so one kernel reads vLLM's pages [num_pages, page_size, KVH, D] (row_stride KVH * D,
// head_stride D) and a contiguous [B, KVH, T, D] cache (one page of T rows per sequence:
// page_stride KVH * T * D, row_stride D, head_stride T * D). K and V tiles of 64 keys are
// brought by 16-byte cp.async into two buffers (the next tile loads while this one is used);
// keys past the range are zero-filled, so a masked probability never meets garbage. Scores are
// computed in fp32 on CUDA cores in the log2 domain (Q pre-scaled by scale * log2 e), masked
// bottom-right when causal (query i of sequence b sees keys t <= i + seq_lens[b] - Tq), folded
// into each row's running max and sum (online softmax), and P·V is accumulated per (row,
// column) in registers. Each split writes its output normalised over its range, Opart
// [B, H, Tq, S, D] fp32, and its log2-domain log-sum-exp Lpart [B, H, Tq, S] (−inf when the
// split sees no key of the row, the output then 0).
//
// flash_decode_combine: one CTA per row (b, h, i) merges the S partials exactly:
// m = max Lpart, w_s = 2^(Lpart_s − m), O = Σ w_s Opart_s / Σ w_s, written as bf16/fp16, and
// LSE = (m + log2 Σ w_s) · ln 2 (natural log); a row with no visible key gets O = 0 and
// LSE = +inf.

// Keys [k0, k0 + KT) of one kv head into the K and V tile buffers `ks`, `vs` (rows padded to
// D + 8 elements), as 16-byte cp.async in one commit group; keys at or past `end` are
// zero-filled and read nothing. Key t is at `Kb`/`Vb` + page_stride * table[t / page_size] +
// row_stride * (t % page_size).
template <int D, int KT, int NT>
__device__ __forceinline__ void decode_load_tile(u16* ks, u16* vs, const u16* K, const u16* V,
                                                 const u16* Kb, const u16* Vb, const int* table,
                                                 int k0, int end, int page_size,
                                                 long long page_stride, long long row_stride,
                                                 int tid) {
    constexpr int STR = D + 8;
    for (int c = tid; c < KT * (D / 8); c += NT) {
        const int kr = c / (D / 8);
        const int col = (c % (D / 8)) * 8;
        const int key = k0 + kr;
        const bool ok = key < end;
        size_t off = 0;
        if (ok) {
            off = (size_t)table[key / page_size] * page_stride +
                  (size_t)(key % page_size) * row_stride + col;
        }
        cp_async16(smem_u32(ks + kr * STR + col), ok ? Kb + off : K, ok);
        cp_async16(smem_u32(vs + kr * STR + col), ok ? Vb + off : V, ok);
    }
    cp_async_commit();
}

template <int D, int R_MAX, bool BF16>
__device__ __forceinline__ void flash_decode_split(
    const u16* __restrict__ Q, const u16* __restrict__ K, const u16* __restrict__ V,
    const int* __restrict__ block_table, const int* __restrict__ seq_lens,
    float* __restrict__ Opart, float* __restrict__ Lpart, int Tq, int H, int KVH,
    int page_size, int max_pages, long long page_stride, long long row_stride,
    long long head_stride, int keys_per_split, float scale_log2, int causal) {
    constexpr int NT = 128;
    constexpr int KT = 64;
    constexpr int STR = D + 8;
    constexpr int ACC = R_MAX * D / NT;
    static_assert(R_MAX * D % NT == 0, "R_MAX * D must be a multiple of 128");
    const int s = blockIdx.x, b = blockIdx.z, tid = threadIdx.x;
    const int RB = gridDim.y / KVH;  // row blocks per kv head
    const int kvh = blockIdx.y / RB, r0 = (blockIdx.y % RB) * R_MAX;
    const int S = gridDim.x;
    const int G = H / KVH;
    const int R = min(R_MAX, G * Tq - r0);  // this CTA's rows: r0 + [0, R)
    const int L = seq_lens[b];
    const int start = s * keys_per_split;
    // The last split takes every key left, so a sequence longer than the plan's cover is
    // still attended whole.
    const int end = s == S - 1 ? L : min(L, start + keys_per_split);
    const int n_tiles = end > start ? (end - start + KT - 1) / KT : 0;

    extern __shared__ __align__(16) unsigned char smem_raw[];
    u16* ks = reinterpret_cast<u16*>(smem_raw);  // [2][KT][STR]
    u16* vs = ks + 2 * KT * STR;                 // [2][KT][STR]
    float* qs = reinterpret_cast<float*>(vs + 2 * KT * STR);  // [R][D], log2 domain
    float* ss = qs + R * D;   // [R][KT]: scores, then probabilities
    float* m_s = ss + R * KT; // [R]: running max
    float* l_s = m_s + R;     // [R]: running sum
    float* a_s = l_s + R;     // [R]: this tile's rescale of the accumulator
    int* vis_s = reinterpret_cast<int*>(a_s + R);  // [R]: keys < vis_s[r] are visible to row r

    const u16* Kb = K + (size_t)kvh * head_stride;
    const u16* Vb = V + (size_t)kvh * head_stride;
    const int* table = block_table + (size_t)b * max_pages;
    if (n_tiles > 0) {
        decode_load_tile<D, KT, NT>(ks, vs, K, V, Kb, Vb, table, start, end, page_size,
                                    page_stride, row_stride, tid);
    }
    for (int idx = tid; idx < R * D; idx += NT) {
        const int r = idx / D, d = idx % D;
        const int h = kvh * G + (r0 + r) / Tq, i = (r0 + r) % Tq;
        qs[idx] = to_f32<BF16>(Q[(((size_t)b * H + h) * Tq + i) * D + d]) * scale_log2;
    }
    for (int r = tid; r < R; r += NT) {
        m_s[r] = NEG_INF;
        l_s[r] = 0.f;
        vis_s[r] = causal ? (r0 + r) % Tq + L - Tq + 1 : L;
    }
    float acc[ACC];
#pragma unroll
    for (int j = 0; j < ACC; ++j) acc[j] = 0.f;
    __syncthreads();

    const int warp = tid / 32, lane = tid % 32;
    for (int t = 0; t < n_tiles; ++t) {
        const int buf = t & 1;
        if (t + 1 < n_tiles) {
            const int nb = (buf ^ 1) * KT * STR;
            decode_load_tile<D, KT, NT>(ks + nb, vs + nb, K, V, Kb, Vb, table,
                                        start + (t + 1) * KT, end, page_size, page_stride,
                                        row_stride, tid);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const int k0 = start + t * KT;
        // Scores of (row, key) pairs; a warp's 32 pairs share a row (KT is a multiple of 32),
        // so Q is a broadcast and the 32 key rows fall in distinct bank groups (STR pad).
        for (int p = tid; p < R * KT; p += NT) {
            const int r = p / KT, kk = p % KT;
            const int key = k0 + kk;
            float sc = NEG_INF;
            if (key < end && key < vis_s[r]) {
                const u16* kr = ks + (buf * KT + kk) * STR;
                const float* qr = qs + r * D;
                float dot = 0.f;
#pragma unroll
                for (int d = 0; d < D; d += 8) {
                    const uint4 w = *reinterpret_cast<const uint4*>(kr + d);
                    const float4 q0 = *reinterpret_cast<const float4*>(qr + d);
                    const float4 q1 = *reinterpret_cast<const float4*>(qr + d + 4);
                    dot += q0.x * to_f32<BF16>((u16)(w.x & 0xffff));
                    dot += q0.y * to_f32<BF16>((u16)(w.x >> 16));
                    dot += q0.z * to_f32<BF16>((u16)(w.y & 0xffff));
                    dot += q0.w * to_f32<BF16>((u16)(w.y >> 16));
                    dot += q1.x * to_f32<BF16>((u16)(w.z & 0xffff));
                    dot += q1.y * to_f32<BF16>((u16)(w.z >> 16));
                    dot += q1.z * to_f32<BF16>((u16)(w.w & 0xffff));
                    dot += q1.w * to_f32<BF16>((u16)(w.w >> 16));
                }
                sc = dot;
            }
            ss[r * KT + kk] = sc;
        }
        __syncthreads();
        // Online softmax, a warp per row: each lane holds keys lane and lane + 32.
        for (int r = warp; r < R; r += NT / 32) {
            const float x0 = ss[r * KT + lane], x1 = ss[r * KT + lane + 32];
            float mx = fmaxf(x0, x1);
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            const float m_old = m_s[r];
            const float m_new = fmaxf(m_old, mx);
            // A row with no visible key so far keeps base 0: every exp2 is of −inf, i.e. 0.
            const float base = m_new == NEG_INF ? 0.f : m_new;
            const float p0 = fast_exp2(x0 - base), p1 = fast_exp2(x1 - base);
            float sum = p0 + p1;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
            ss[r * KT + lane] = p0;
            ss[r * KT + lane + 32] = p1;
            __syncwarp();
            if (lane == 0) {
                const float alpha = fast_exp2(m_old - base);
                a_s[r] = alpha;
                l_s[r] = l_s[r] * alpha + sum;
                m_s[r] = m_new;
            }
        }
        __syncthreads();
        // P·V: accumulator j of this thread is element tid + 128 j of the [R, D] output, so a
        // warp reads 32 consecutive columns of one V row (no bank conflict) and one P value;
        // at head_dim <= 128 every accumulator of a thread has the same column, so one V load
        // serves them all. Keys outside, accumulators inside (fully unrolled): the
        // accumulators stay in registers.
        const u16* vt = vs + buf * KT * STR;
#pragma unroll
        for (int j = 0; j < ACC; ++j) {
            const int idx = tid + NT * j;
            if (idx < R * D) acc[j] *= a_s[idx / D];
        }
#pragma unroll 1
        for (int kk = 0; kk < KT; ++kk) {
#pragma unroll
            for (int j = 0; j < ACC; ++j) {
                const int idx = tid + NT * j;
                if (idx < R * D) {
                    const int r = idx / D, d = idx % D;
                    acc[j] += ss[r * KT + kk] * to_f32<BF16>(vt[kk * STR + d]);
                }
            }
        }
        // The next iteration's load overwrites the other buffer and the scores.
        __syncthreads();
    }

#pragma unroll
    for (int j = 0; j < ACC; ++j) {
        const int idx = tid + NT * j;
        if (idx < R * D) {
            const int r = idx / D, d = idx % D;
            const int h = kvh * G + (r0 + r) / Tq, i = (r0 + r) % Tq;
            const size_t row = ((size_t)b * H + h) * Tq + i;
            const float l = l_s[r];
            Opart[(row * S + s) * D + d] = l > 0.f ? __fdividef(acc[j], l) : 0.f;
        }
    }
    for (int r = tid; r < R; r += NT) {
        const int h = kvh * G + (r0 + r) / Tq, i = (r0 + r) % Tq;
        const size_t row = ((size_t)b * H + h) * Tq + i;
        const float l = l_s[r];
        Lpart[row * S + s] = l > 0.f ? m_s[r] + __log2f(l) : NEG_INF;
    }
}

template <int D, bool BF16>
__device__ __forceinline__ void flash_decode_combine(const float* __restrict__ Opart,
                                                     const float* __restrict__ Lpart,
                                                     u16* __restrict__ O, float* __restrict__ LSE,
                                                     int S) {
    const size_t row = blockIdx.x;
    const float* lp = Lpart + row * S;
    float m = NEG_INF;
    for (int s = 0; s < S; ++s) m = fmaxf(m, lp[s]);
    float total = 0.f;
    if (m != NEG_INF) {
        for (int s = 0; s < S; ++s) total += fast_exp2(lp[s] - m);
    }
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float o = 0.f;
        if (m != NEG_INF) {
            for (int s = 0; s < S; ++s) {
                const float w = fast_exp2(lp[s] - m);
                if (w > 0.f) o += w * Opart[(row * S + s) * D + d];
            }
            o /= total;
        }
        const u32 packed = pack2<BF16>(o, 0.f);
        O[row * D + d] = (u16)(packed & 0xffff);
    }
    if (threadIdx.x == 0) LSE[row] = m == NEG_INF ? POS_INF : (m + log2f(total)) * LN2;
}
