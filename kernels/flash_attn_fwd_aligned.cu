// The fast path of the flash forward: the measured v3 kernel of kernels/TUNING.md, for equal
// query and key lengths T (any T >= 1), head_dim 64 or 128, every key valid; with LSE_OUT it
// also writes the log-sum-exp the backward needs (fp32 [B, H, T], natural log, as the general
// kernel writes it; every row sees at least one key here, so it is finite). The general kernel (flash_attn_fwd.cu) bounds every load, mask and
// store by the lengths, which cost 30 % on aligned shapes (kernels/TUNING.md, "aligned fast
// path"); here the instance with EVEN = true (T a multiple of the 128-row query tile) has no
// bounds at all, and the EVEN = false instance bounds only the last query and key tiles.
// Dispatch (src/attention/cuda.rs, `flash_fast_path`) sends such forwards here and every other
// case (separate lengths, key lengths, other head dims, another configuration) there.
//
// Flash-attention forward (FlashAttention-2 style: Dao, 2023, "FlashAttention-2: Faster
// Attention with Better Parallelism and Work Partitioning"), written for this project.
//
// O = softmax(Q K^T * scale [+ causal mask]) V for Q [B, H, T, D], K/V [B, KVH, T, D] (BHSD,
// contiguous, 16-bit: bf16 or fp16), O [B, H, T, D] in the same dtype. Accumulation in fp32.
//
// One CTA of NW warps owns BR = 16 * MT * NW query rows of one (batch, head); each warp owns
// MT blocks of 16 rows. K and V tiles of BCT keys stream through shared memory,
// double-buffered with cp.async. S = Q K^T and O += P V use the tensor cores through
// mma.sync.m16n8k16 (sm_80+); fragments are loaded with ldmatrix (the .trans form for V). The
// softmax is the online (streaming) one in the base-2 domain: m = running max, l = running
// sum, O rescaled by 2^(m_old - m_new).
//
// Requirements (checked by the host): D in {64, 128}, H % KVH == 0, (16 * MT * NW) % BCT == 0;
// with EVEN, T % (16 * MT * NW) == 0. The host prepends kernels/attn_prelude.cuh (16-bit
// packing, mma.sync, ldmatrix, cp.async, the bounded tile load), so NVRTC needs no include path.
//
// The host appends one `extern "C"` wrapper per instantiation it needs
// (`flash_fast_instance` in src/attention/cuda.rs).

// Copies a ROWS x D tile known to lie within the sequence from global (row stride D) to shared
// (row stride D + 8) with 16-byte cp.async and no bounds (the prelude's load_tile bounds every
// row); the 8-element pad keeps ldmatrix's 8 row addresses in distinct bank groups.
template <int ROWS, int D, int NTHREADS>
__device__ __forceinline__ void load_tile_full(u16* s, const u16* g, int tid) {
    constexpr int STR = D + 8;
    constexpr int CHUNKS = ROWS * D / 8;
#pragma unroll
    for (int i = tid; i < CHUNKS; i += NTHREADS) {
        int r = i / (D / 8);
        int c = (i % (D / 8)) * 8;
        cp_async16_full(smem_u32(s + r * STR + c), g + (size_t)r * D + c);
    }
}

// A tile that may run past the sequence end: rows r >= `valid` are zero-filled (the prelude's
// bounded load_tile) and read nothing. Only the last tile takes the bounds (a uniform branch);
// with EVEN the bound is known to hold and this is load_tile_full.
template <int ROWS, int D, int NTHREADS, bool EVEN>
__device__ __forceinline__ void load_tile_bounded(u16* s, const u16* g, int tid, int valid) {
    if (EVEN || valid >= ROWS) {
        load_tile_full<ROWS, D, NTHREADS>(s, g, tid);
        return;
    }
    load_tile<ROWS, D, NTHREADS>(s, g, valid, tid);
}

// One key tile of flash_fwd_v3 (its loop body): prefetch tile kt + 1, wait for tile kt, then
// S = Q K^T, the mask, the online softmax and O += P V for this warp's MT row groups. TAIL
// (non-causal, non-EVEN instances only, for the last key tile alone) masks keys >= T;
// PF_BOUNDED lets the prefetched tile be the partial last one (zero-filled past T). The loop's
// tiles run with both false, so the loop carries neither the mask nor the bounded loads and is
// the EVEN instance's loop (kernels/TUNING.md, "Fast path tail v3").
template <int D, int NW, int MT, int BCT, bool BF16, bool CAUSAL, bool EVEN, bool TAIL,
          bool PF_BOUNDED>
__device__ __forceinline__ void flash_fwd_v3_step(
    int kt, int n_kt, int T, int qt, int tid, int lane, int g, int t4, int warp_row0, int warp_last,
    float scale_log2, const u16* __restrict__ K, const u16* __restrict__ V, size_t kv_off,
    const u16* sQ, u16* sK, u16* sV, float (&o)[MT][D / 8][4], float (&m_run)[MT][2],
    float (&l_run)[MT][2]) {
    constexpr int BR = 16 * MT * NW;
    constexpr int NTH = 32 * NW;
    constexpr int STR = D + 8;
    constexpr int DT = D / 8;
    constexpr int KC = D / 16;
    constexpr int NT = BCT / 8;
    const int buf = kt & 1;
    if (kt + 1 < n_kt) {
        const int rest = T - (kt + 1) * BCT;  // keys left from the next tile on
        load_tile_bounded<BCT, D, NTH, EVEN || !PF_BOUNDED>(
            sK + (buf ^ 1) * BCT * STR, K + kv_off + (size_t)(kt + 1) * BCT * D, tid, rest);
        load_tile_bounded<BCT, D, NTH, EVEN || !PF_BOUNDED>(
            sV + (buf ^ 1) * BCT * STR, V + kv_off + (size_t)(kt + 1) * BCT * D, tid, rest);
        cp_async_commit();
        cp_async_wait<1>();
    } else {
        cp_async_wait<0>();
    }
    __syncthreads();
    const u16* k_s = sK + buf * BCT * STR;
    const u16* v_s = sV + buf * BCT * STR;
    // Causal: every key of this tile comes after every row of this warp -> nothing to add.
    const bool skip = CAUSAL && (kt * BCT > warp_last);
    if (!skip) {
        float s[MT][NT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.f;
#pragma unroll
        for (int kc = 0; kc < KC; kc += 2) {
            u32 qf[MT][2][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                const u16* p = sQ + (warp_row0 + mt * 16 + (lane & 15)) * STR + kc * 16 + (lane >> 4) * 8;
                ldmatrix_x4(qf[mt][0], smem_u32(p));
                ldmatrix_x4(qf[mt][1], smem_u32(p + 16));
            }
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                u32 kb[4];
                const u16* p = k_s + (nt * 8 + (lane & 7)) * STR + kc * 16 + (lane >> 3) * 8;
                ldmatrix_x4(kb, smem_u32(p));
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma16816<BF16>(s[mt][nt], qf[mt][0], kb[0], kb[1]);
                    mma16816<BF16>(s[mt][nt], qf[mt][1], kb[2], kb[3]);
                }
            }
        }

        const bool diag = CAUSAL && (kt * BCT + BCT - 1 > qt * BR + warp_row0);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    float x = s[mt][nt][e] * scale_log2;
                    if (diag) {
                        int row = qt * BR + warp_row0 + mt * 16 + g + (e >> 1) * 8;
                        int col = kt * BCT + nt * 8 + 2 * t4 + (e & 1);
                        if (col > row) x = NEG_INF;
                    }
                    s[mt][nt][e] = x;
                }
            }
            // Keys past T: only the peeled last key tile of a non-causal tail instance.
            if (TAIL) {
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        if (kt * BCT + nt * 8 + 2 * t4 + (e & 1) >= T) s[mt][nt][e] = NEG_INF;
            }
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float mx = NEG_INF;
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
                    mx = fmaxf(mx, fmaxf(s[mt][nt][2 * r], s[mt][nt][2 * r + 1]));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
                const float m_new = fmaxf(m_run[mt][r], mx);
                const float alpha = fast_exp2(m_run[mt][r] - m_new);
                m_run[mt][r] = m_new;
                float sum = 0.f;
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    float p0 = fast_exp2(s[mt][nt][2 * r] - m_new);
                    float p1 = fast_exp2(s[mt][nt][2 * r + 1] - m_new);
                    s[mt][nt][2 * r] = p0;
                    s[mt][nt][2 * r + 1] = p1;
                    sum += p0 + p1;
                }
                l_run[mt][r] = l_run[mt][r] * alpha + sum;
#pragma unroll
                for (int dt = 0; dt < DT; ++dt) {
                    o[mt][dt][2 * r] *= alpha;
                    o[mt][dt][2 * r + 1] *= alpha;
                }
            }
        }

#pragma unroll
        for (int kc = 0; kc < BCT / 16; ++kc) {
            pv_step<MT, NT, DT, STR, BF16>(o, s, kc, v_s, kc * 16, lane);
        }
    }
    __syncthreads();
}

// Version 3: each warp owns MT groups of 16 query rows (FlashAttention-2's layout for large
// tiles), so every K and V fragment read from shared memory feeds MT matrix products instead of
// one: the shared-memory bytes per FLOP fall by up to MT. Q stays in shared memory and its
// fragments are re-read per key tile (registers go to the MT-fold accumulators instead).
// BCT keys per tile (32 or 64). A warp whose rows all precede a causal tile skips its work.
// EVEN: T is a multiple of the query tile (so of BCT). Without it any T >= 1 runs: the last query
// and key tiles are loaded zero-filled past T, keys >= T score -inf (on the last key tile only;
// with CAUSAL the mask already removes them for every stored row), rows >= T are not stored.
// Requirements: (16 * MT * NW) % BCT == 0; with EVEN, T % (16 * MT * NW) == 0.
// LSE_OUT: write the log-sum-exp of every stored row to LSE (otherwise LSE is not touched).
template <int D, int NW, int MT, int BCT, bool BF16, bool CAUSAL, bool EVEN, bool LSE_OUT>
__device__ __forceinline__ void flash_fwd_v3(const u16* __restrict__ Q, const u16* __restrict__ K,
                                             const u16* __restrict__ V, u16* __restrict__ O,
                                             float* __restrict__ LSE, int T, int H, int KVH,
                                             float scale_log2) {
    constexpr int BR = 16 * MT * NW;
    constexpr int NTH = 32 * NW;
    constexpr int STR = D + 8;
    constexpr int DT = D / 8;
    constexpr int KC = D / 16;
    constexpr int NT = BCT / 8;
    static_assert(BR % BCT == 0, "query tile must be a multiple of the key tile");
    extern __shared__ __align__(16) u16 smem[];
    u16* sQ = smem;
    u16* sK = sQ + BR * STR;       // 2 buffers
    u16* sV = sK + 2 * BCT * STR;  // 2 buffers

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t4 = lane & 3;
    const int n_qt = EVEN ? T / BR : (T + BR - 1) / BR;
    const int qt = CAUSAL ? (n_qt - 1 - (int)blockIdx.x) : (int)blockIdx.x;
    const int h = blockIdx.y, b = blockIdx.z;
    const int kvh = h / (H / KVH);
    const size_t q_off = ((size_t)(b * H + h) * T + (size_t)qt * BR) * D;
    const size_t kv_off = (size_t)(b * KVH + kvh) * T * D;
    const int n_kt_all = EVEN ? T / BCT : (T + BCT - 1) / BCT;  // key tiles in the sequence
    const int n_kt = CAUSAL ? min(((qt + 1) * BR) / BCT, n_kt_all) : n_kt_all;
    const int warp_row0 = warp * 16 * MT;            // first row of this warp within the tile
    const int warp_last = qt * BR + warp_row0 + 16 * MT - 1;  // its last global query row

    load_tile_bounded<BR, D, NTH, EVEN>(sQ, Q + q_off, tid, T - qt * BR);
    cp_async_commit();
    load_tile_bounded<BCT, D, NTH, EVEN>(sK, K + kv_off, tid, T);
    load_tile_bounded<BCT, D, NTH, EVEN>(sV, V + kv_off, tid, T);
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

    // The partial last key tile (T % BCT != 0) is touched by two iterations: the one that
    // prefetches it (kt = n_kt - 2) and the one that computes it (kt = n_kt - 1). Non-causal:
    // both are peeled off the loop, so the loop's code is the EVEN instance's (no bounded load,
    // no key mask).
    // Causal instances keep the bounded prefetch in the loop instead: peeling it measured the
    // same on the H200 and tripled the head_dim 128 instance's spills.
    const bool partial = !EVEN && !CAUSAL && (T % BCT != 0) && n_kt == n_kt_all;
    const int n_loop = partial ? max(n_kt - 2, 0) : n_kt;
    for (int kt = 0; kt < n_loop; ++kt)
        flash_fwd_v3_step<D, NW, MT, BCT, BF16, CAUSAL, EVEN, false, CAUSAL && !EVEN>(
            kt, n_kt, T, qt, tid, lane, g, t4, warp_row0, warp_last, scale_log2, K, V, kv_off, sQ,
            sK, sV, o, m_run, l_run);
    if (!EVEN && !CAUSAL && partial) {
        if (n_kt >= 2)
            flash_fwd_v3_step<D, NW, MT, BCT, BF16, CAUSAL, EVEN, false, true>(
                n_kt - 2, n_kt, T, qt, tid, lane, g, t4, warp_row0, warp_last, scale_log2, K, V,
                kv_off, sQ, sK, sV, o, m_run, l_run);
        flash_fwd_v3_step<D, NW, MT, BCT, BF16, CAUSAL, EVEN, !EVEN && !CAUSAL, true>(
            n_kt - 1, n_kt, T, qt, tid, lane, g, t4, warp_row0, warp_last, scale_log2, K, V,
            kv_off, sQ, sK, sV, o, m_run, l_run);
    }

    u16* o_base = O + q_off;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float l = l_run[mt][r];
            l += __shfl_xor_sync(0xffffffff, l, 1);
            l += __shfl_xor_sync(0xffffffff, l, 2);
            const float inv = 1.f / l;
            const int row = warp_row0 + mt * 16 + g + r * 8;
            if (!EVEN && qt * BR + row >= T) continue;  // past the sequence end: not stored
            if (LSE_OUT && t4 == 0)
                LSE[(size_t)(b * H + h) * T + (size_t)qt * BR + row] = (m_run[mt][r] + log2f(l)) * LN2;
#pragma unroll
            for (int dt = 0; dt < DT; ++dt) {
                u32 v = pack2<BF16>(o[mt][dt][2 * r] * inv, o[mt][dt][2 * r + 1] * inv);
                *reinterpret_cast<u32*>(o_base + (size_t)row * D + dt * 8 + 2 * t4) = v;
            }
        }
    }
}
