// Flash-attention forward (FlashAttention-2 style: Dao, 2023, "FlashAttention-2: Faster
// Attention with Better Parallelism and Work Partitioning"), written for this project.
// Needs attn_prelude.cuh before it (the host concatenates the two).
//
// O = softmax(Q K^T * scale [+ masks]) V for Q [B, H, Tq, D], K/V [B, KVH, Tkv, D] (BHSD,
// contiguous, 16-bit: bf16 or fp16), O [B, H, Tq, D] in the same dtype, and the log-sum-exp
// LSE [B, H, Tq] in fp32 (natural log of sum_j exp(scale * q.k_j) over the visible keys; +inf for
// a row that sees no key), which the backward reads. Accumulation in fp32, so scores that
// overflow fp16 (e.g. q = k = 24, D = 128: 73 728) are exact.
//
// Masks (src/attention/mod.rs documents the function): batch entry b has L = kv_lens[b] valid
// keys (padded layout); with CAUSAL, query i sees key j iff j <= i + L - Tq (bottom-right
// alignment). A row that sees no key gets O = 0 and LSE = +inf.
//
// Any lengths Tq >= 1, Tkv >= 1 and 0 <= L <= Tkv: the last query tile and the last key tile
// may be partial. Their loads are zero-filled (cp.async with src-size 0), keys at or beyond a
// row's limit score -inf, nothing is stored beyond Tq. Warps whose 16-row groups lie wholly
// beyond Tq, or wholly before a causal key tile, skip its matrix work; in the last key tile the
// 8-key column blocks of Q K^T and the 16-key blocks of P V beyond the tile's last needed key are
// skipped, so a length one past a tile multiple costs about one 16-key block, not a full tile.
//
// One CTA of NW warps owns BR = 16 * MT * NW query rows of one (batch, head); each warp owns MT
// groups of 16 rows (FlashAttention-2's warp layout), so every K and V fragment read from shared
// memory feeds MT matrix products. K and V tiles of BCT keys stream through shared memory,
// double-buffered with cp.async; Q stays in shared memory and its fragments are re-read per key
// tile. S = Q K^T and O += P V use mma.sync.m16n8k16 (sm_80+), fragments loaded with ldmatrix
// (the .trans form for V). The softmax is the online one in the base-2 domain: m = running max,
// l = running sum, O rescaled by 2^(m_old - m_new); while a row has seen no key, m = -inf and
// the kernel subtracts 0 instead (FlashAttention-2's guard: -inf - -inf would be NaN).
//
// No atomics and a fixed order of every sum: outputs are bit-identical from run to run.
// Grid: (ceil(Tq / BR), H, B); block 32 * NW threads; dynamic shared memory
// (BR + 4 * BCT) * (D + 8) * 2 bytes. The host appends one `extern "C"` wrapper per
// instantiation it needs (`flash_instance` in src/attention/cuda.rs).

template <int D, int NW, int MT, int BCT, bool BF16, bool CAUSAL>
__device__ __forceinline__ void flash_fwd(const u16* __restrict__ Q, const u16* __restrict__ K,
                                          const u16* __restrict__ V, u16* __restrict__ O,
                                          float* __restrict__ LSE, const int* __restrict__ kv_lens,
                                          int Tq, int Tkv, int H, int KVH, float scale_log2) {
    constexpr int BR = 16 * MT * NW;
    constexpr int NTH = 32 * NW;
    constexpr int STR = D + 8;
    constexpr int DT = D / 8;
    constexpr int KC = D / 16;
    constexpr int NT = BCT / 8;
    static_assert(D % 32 == 0, "head_dim must be a multiple of 32");
    extern __shared__ __align__(16) u16 smem[];
    u16* sQ = smem;
    u16* sK = sQ + BR * STR;       // 2 buffers
    u16* sV = sK + 2 * BCT * STR;  // 2 buffers

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t4 = lane & 3;
    const int n_qt = gridDim.x;
    // Causal: heaviest query tiles first, so the tail of the grid is short work.
    const int qt = CAUSAL ? (n_qt - 1 - (int)blockIdx.x) : (int)blockIdx.x;
    const int h = blockIdx.y, b = blockIdx.z;
    const int kvh = h / (H / KVH);
    const int L = kv_lens[b];
    const int off = L - Tq;  // causal: key j visible to row i iff j <= i + off
    const int q0 = qt * BR;
    const int rows = min(BR, Tq - q0);
    // Keys any row of this tile sees: [0, n_keys).
    const int n_keys = CAUSAL ? max(0, min(L, q0 + rows + off)) : L;
    const int n_kt = (n_keys + BCT - 1) / BCT;
    const size_t q_off = ((size_t)(b * H + h) * Tq + q0) * D;
    const size_t kv_off = (size_t)(b * KVH + kvh) * Tkv * D;
    const int warp_row0 = warp * 16 * MT;  // first row of this warp within the tile
    const int warp_rows = min(16 * MT, rows - warp_row0);  // its rows below Tq (may be <= 0)
    // The key limits of the warp's first and last valid rows (keys [0, lim) are visible).
    const int lim_first = CAUSAL ? max(0, min(L, q0 + warp_row0 + off + 1)) : L;
    const int lim_last = CAUSAL ? max(0, min(L, q0 + warp_row0 + warp_rows + off)) : L;

    load_tile<BR, D, NTH>(sQ, Q + q_off, rows, tid);
    cp_async_commit();
    if (n_kt > 0) {
        load_tile<BCT, D, NTH>(sK, K + kv_off, n_keys, tid);
        load_tile<BCT, D, NTH>(sV, V + kv_off, n_keys, tid);
    }
    cp_async_commit();

    float o[MT][DT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int i = 0; i < DT; ++i) o[mt][i][0] = o[mt][i][1] = o[mt][i][2] = o[mt][i][3] = 0.f;
    float m_run[MT][2], l_run[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        m_run[mt][0] = m_run[mt][1] = NEG_INF;
        l_run[mt][0] = l_run[mt][1] = 0.f;
    }

    for (int kt = 0; kt < n_kt; ++kt) {
        const int buf = kt & 1;
        const int k0 = kt * BCT;
        if (kt + 1 < n_kt) {
            const int k1 = k0 + BCT;
            load_tile<BCT, D, NTH>(sK + (buf ^ 1) * BCT * STR, K + kv_off + (size_t)k1 * D, n_keys - k1, tid);
            load_tile<BCT, D, NTH>(sV + (buf ^ 1) * BCT * STR, V + kv_off + (size_t)k1 * D, n_keys - k1, tid);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const u16* k_s = sK + buf * BCT * STR;
        const u16* v_s = sV + buf * BCT * STR;
        const int rem = n_keys - k0;  // keys of this tile any row needs (>= 1)
        // Nothing to add: the warp has no row below Tq, or every key of the tile is past all its
        // rows' limits.
        const bool skip = warp_rows <= 0 || k0 >= lim_last;
        if (!skip) {
            float s[MT][NT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.f;
            qk_tile<MT, NT, KC, STR, BF16>(s, sQ, k_s, warp_row0, rem, lane);

            // Mask the tile when some key of it is at or past some row's limit.
            const bool mask = k0 + BCT > lim_first;
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        float x = s[mt][nt][e] * scale_log2;
                        if (mask) {
                            const int row = q0 + warp_row0 + mt * 16 + g + (e >> 1) * 8;
                            const int col = k0 + nt * 8 + 2 * t4 + (e & 1);
                            const int lim = CAUSAL ? min(L, row + off + 1) : L;
                            if (col >= lim) x = NEG_INF;
                        }
                        s[mt][nt][e] = x;
                    }
                }
                online_softmax_rows<MT, NT, DT, true>(s, m_run, l_run, o, mt);
            }

            // O += P V: P's accumulator layout is already the A-fragment layout of the next mma.
#pragma unroll
            for (int kc = 0; kc < BCT / 16; ++kc) {
                if (kc * 16 < rem) {
                    pv_step<MT, NT, DT, STR, BF16>(o, s, kc, v_s, kc * 16, lane);
                }
            }
        }
        __syncthreads();  // every warp is done with `buf` before it is refilled
    }
    cp_async_wait<0>();  // with no key tile (n_kt == 0) the Q copy is still in flight

    // Finish: the row sums were per-thread partials over the thread's columns.
    u16* o_base = O + q_off;
    float* lse_base = LSE + (size_t)(b * H + h) * Tq + q0;
    store_rows<MT, DT, BF16>(o, m_run, l_run, o_base, lse_base, warp_row0, rows, g, t4);
}
