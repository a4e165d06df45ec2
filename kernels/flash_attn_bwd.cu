// Flash-attention backward (FlashAttention-2, Dao 2023, Algorithm 2), written for this project.
// Needs attn_prelude.cuh before it (the host concatenates the two).
//
// Inputs: Q, dO [B, H, Tq, D]; K, V [B, KVH, Tkv, D] (16-bit, bf16 or fp16); O [B, H, Tq, D]
// and LSE [B, H, Tq] (fp32, natural log, +inf for a row that sees no key) from the forward
// (kernels/flash_attn_fwd.cu); kv_lens [B]. Masks as in the forward (bottom-right causal,
// per-sequence key lengths). Outputs: dQ [B, H, Tq, D], dK and dV [B, KVH, Tkv, D] (16-bit), the
// gradients of the loss sum(dO * O).
//
// Three kernels per call (four for head_dim 256):
// 1. `bwd_preprocess`: D_i = sum_d dO_id * O_id (fp32, [B, H, Tq]) and dQacc = 0 (fp32,
//    [B, H, Tq, D]). One warp per row.
// 2. `flash_bwd`: one CTA per (key tile of BC = 16 * NW keys, kv head, batch entry). K and V of the
//    tile stay in shared memory; the CTA walks every query head of the kv head's group (GQA) and
//    every query tile of BR rows that sees a key of the tile, with Q, dO, LSE and D double-
//    buffered through shared memory (cp.async). Each warp owns 16 keys and recomputes, for
//    them, the transposed scores S^T = K Q^T, P^T = exp(S^T * scale - LSE) (masked), dP^T = V dO^T
//    and dS^T = P^T * (dP^T - D), then accumulates dV += P^T dO and dK += dS^T Q in registers
//    (fp32) over all query tiles: no atomics and a fixed order for dK and dV, which are
//    bit-identical from run to run. P^T and dS^T are rounded to the 16-bit dtype before their
//    matrix products, as the forward rounds P (FlashAttention-2 does the same).
//    dQ needs a sum over key tiles, which live in different CTAs: each CTA writes its dS^T tile
//    to shared memory and adds dQ_tile = dS K to dQacc with fp32 atomics (red.global.add.f32),
//    as FlashAttention-2 does. The alternative, a separate pass over query tiles that recomputes
//    S and dP, would run 7 matrix products per (query tile, key tile) instead of 5 (40 % more
//    tensor work); the atomics cost L2 traffic (Tq * D fp32 adds per key tile) and make dQ's
//    fp32 sum order, and so possibly its last bit, vary from run to run.
//    head_dim 256: the fp32 dK and dV accumulators of 16 keys x 256 columns would need 256
//    registers per thread, so the host launches the kernel twice, for columns [0, 128) and
//    [128, 256) of dK and dV (`dkv_off`), recomputing S and dP in the second launch; only the
//    first adds to dQ.
// 3. `bwd_dq_convert` (attn_prelude.cuh): dQ = scale * dQacc, rounded to the 16-bit dtype.
//
// The host appends `extern "C"` wrappers (`flash_bwd_instance` in src/attention/cuda.rs).
// flash_bwd grid: (ceil(Tkv / BC), KVH, B), block 32 * NW, dynamic shared memory
// (2 * BC + 4 * BR) * (D + 8) * 2 + BC * (BR + 8) * 2 + 4 * BR * 4 bytes.

template <int D, bool BF16>
__device__ __forceinline__ void bwd_preprocess(const u16* __restrict__ O, const u16* __restrict__ dO,
                                               float* __restrict__ Dsum, float* __restrict__ dQacc,
                                               int rows) {
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (warp >= rows) return;
    const size_t base = (size_t)warp * D;
    float acc = 0.f;
#pragma unroll
    for (int e = lane; e < D; e += 32) {
        acc += to_f32<BF16>(O[base + e]) * to_f32<BF16>(dO[base + e]);
        dQacc[base + e] = 0.f;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffff, acc, o);
    if (lane == 0) Dsum[warp] = acc;
}

// A warp's 16 x (N * 8) accumulator tile rounded to 16 bits, as the A fragments of the next
// matrix product (k = its columns): the accumulator layout of m16n8 pairs is the m16k16 A layout.
template <int N, bool BF16>
__device__ __forceinline__ void acc_to_a(const float (&c)[N][4], u32 (&a)[N / 2][4]) {
#pragma unroll
    for (int kc = 0; kc < N / 2; ++kc) {
        a[kc][0] = pack2<BF16>(c[2 * kc][0], c[2 * kc][1]);
        a[kc][1] = pack2<BF16>(c[2 * kc][2], c[2 * kc][3]);
        a[kc][2] = pack2<BF16>(c[2 * kc + 1][0], c[2 * kc + 1][1]);
        a[kc][3] = pack2<BF16>(c[2 * kc + 1][2], c[2 * kc + 1][3]);
    }
}

// acc (16 rows x NT*8 columns) += A (16 rows, from the warp's rows `a_rows` of shared memory,
// row stride STR, k = D columns) times B^T where B's rows are `b_rows` (NT * 8 rows of shared
// memory, k = D columns): the "row x col" product of two row-major tiles over their D columns.
// UNR: how many 32-column steps of the loop over D the compiler may unroll (1 keeps it rolled,
// which holds registers down; more lets ptxas issue the next step's ldmatrix under this step's
// mma, at the price of the registers those fragments take).
template <int D, int NT, int STR, bool BF16, int UNR>
__device__ __forceinline__ void mma_rows_rows(float (&acc)[NT][4], const u16* a_rows,
                                              const u16* b_rows, int lane) {
#pragma unroll UNR
    for (int kc = 0; kc < D / 16; kc += 2) {
        u32 af[2][4];
        const u16* pa = a_rows + (lane & 15) * STR + kc * 16 + (lane >> 4) * 8;
        ldmatrix_x4(af[0], smem_u32(pa));
        ldmatrix_x4(af[1], smem_u32(pa + 16));
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            u32 bf[4];
            const u16* pb = b_rows + (nt * 8 + (lane & 7)) * STR + kc * 16 + (lane >> 3) * 8;
            ldmatrix_x4(bf, smem_u32(pb));
            mma16816<BF16>(acc[nt], af[0], bf[0], bf[1]);
            mma16816<BF16>(acc[nt], af[1], bf[2], bf[3]);
        }
    }
}

// acc (16 x DT*8) += A (16 x K16*16, register fragments) times the tile `b` (K16*16 rows of shared
// memory, row stride STR, columns [0, DT*8)): B is read with ldmatrix.trans.
template <int K16, int DT, int STR, bool BF16>
__device__ __forceinline__ void mma_regs_rows(float (&acc)[DT][4], const u32 (&a)[K16][4],
                                              const u16* b, int lane) {
#pragma unroll
    for (int kc = 0; kc < K16; ++kc) {
#pragma unroll
        for (int dt = 0; dt < DT; dt += 2) {
            u32 bf[4];
            const u16* p = b + (kc * 16 + (lane & 15)) * STR + dt * 8 + (lane >> 4) * 8;
            ldmatrix_x4_trans(bf, smem_u32(p));
            mma16816<BF16>(acc[dt], a[kc], bf[0], bf[1]);
            mma16816<BF16>(acc[dt + 1], a[kc], bf[2], bf[3]);
        }
    }
}

// fp32 adds of two adjacent dQ columns: one vector reduction (`red.global.add.v2.f32`, 8 bytes)
// on compute capability 9.0 and newer when VRED, else two scalar ones. Both are unordered
// adds to L2; the vector form halves the instructions and the L2 requests.
template <bool VRED>
__device__ __forceinline__ void red_add2(float* p, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (VRED) {
        asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(p), "f"(a), "f"(b) : "memory");
        return;
    }
#endif
    atomicAdd(p, a);
    atomicAdd(p + 1, b);
}

// dQ_tile (BR x D) += dS (BR x BC, read transposed from the dS^T tile `sdS`: BC = 16 * NW key
// rows of BR + 8 elements) times K (the CTA's BC x D key tile `sK`, rows of STR elements),
// added to the fp32 rows of `dq_rows` (row-major, D per row: rows q0, q0 + 1, ... below Tq) with
// red_add2: warp (rg, cs) owns rows [16 rg, 16 rg + 16) and columns [cs * DQC, (cs + 1) * DQC),
// DQCH at a time.
template <int D, int NW, int BR, int STR, bool BF16, bool VRED>
__device__ __forceinline__ void dq_tile_add(const u16* sdS, const u16* sK, float* dq_rows,
                                            int q0, int Tq, int warp, int lane) {
    constexpr int BC = 16 * NW;
    constexpr int STRS = BR + 8;
    constexpr int RG = BR / 16;                    // 16-row groups of the query tile
    constexpr int CS = NW / RG;                    // column splits
    constexpr int DQC = D / CS;                    // columns per warp
    constexpr int DQCH = DQC % 32 == 0 ? 32 : 16;  // columns per pass
    static_assert(NW % RG == 0 && DQC % DQCH == 0, "dQ warp partition");
    const int g = lane >> 2, t4 = lane & 3;
    const int rg = warp % RG, cs = warp / RG;
#pragma unroll
    for (int c0 = 0; c0 < DQC; c0 += DQCH) {
        const int col0 = cs * DQC + c0;
        float acc[DQCH / 8][4];
#pragma unroll
        for (int i = 0; i < DQCH / 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk) {
            u32 af[4];
            const u16* pa2 = sdS + (kk * 16 + ((lane >> 4) << 3) + (lane & 7)) * STRS + rg * 16 +
                             ((lane >> 3) & 1) * 8;
            ldmatrix_x4_trans(af, smem_u32(pa2));
#pragma unroll
            for (int dt = 0; dt < DQCH / 8; dt += 2) {
                u32 bf[4];
                const u16* pb = sK + (kk * 16 + (lane & 15)) * STR + col0 + dt * 8 + (lane >> 4) * 8;
                ldmatrix_x4_trans(bf, smem_u32(pb));
                mma16816<BF16>(acc[dt], af, bf[0], bf[1]);
                mma16816<BF16>(acc[dt + 1], af, bf[2], bf[3]);
            }
        }
#pragma unroll
        for (int dt = 0; dt < DQCH / 8; ++dt) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int row = rg * 16 + g + r * 8;
                if (q0 + row < Tq) {
                    float* p2 = dq_rows + (size_t)row * D + col0 + dt * 8 + 2 * t4;
                    red_add2<VRED>(p2, acc[dt][2 * r], acc[dt][2 * r + 1]);
                }
            }
        }
    }
}

// UNR: unroll of the S^T and dP^T products' loop over D (mma_rows_rows); VRED: dQ adds as
// 8-byte vector reductions on sm_90 (red_add2); END_SYNC: the barrier that closes each step.
// It is redundant: Q, dO, LSE and D of step it are read only before the dS^T barrier, which
// every warp passes before any warp refills them (the prefetch of step it + 2 is issued at the
// top of step it + 1), and the next dS^T write comes after the next step's first barrier,
// which waits for every warp's dQ product. END_SYNC = false drops it (`d` in the config name).
template <int D, int DKV, int NW, int BR, bool BF16, bool CAUSAL, int UNR, bool VRED, bool END_SYNC>
__device__ __forceinline__ void flash_bwd(
    const u16* __restrict__ Q, const u16* __restrict__ K, const u16* __restrict__ V,
    const u16* __restrict__ dO, const float* __restrict__ LSE, const float* __restrict__ Dsum,
    const int* __restrict__ kv_lens, float* __restrict__ dQacc, u16* __restrict__ dK,
    u16* __restrict__ dV, int Tq, int Tkv, int H, int KVH, float scale_log2, float scale,
    int dkv_off, int do_dq) {
    constexpr int BC = 16 * NW;        // keys per CTA
    constexpr int NTH = 32 * NW;
    constexpr int STR = D + 8;
    constexpr int STRS = BR + 8;       // row stride of the dS^T tile
    constexpr int NQ = BR / 8;         // n8 tiles of a query tile
    constexpr int DTKV = DKV / 8;      // n8 tiles of the dK/dV accumulators
    static_assert(D % 32 == 0 && DKV % 16 == 0, "head_dim");
    extern __shared__ __align__(16) u16 smem[];
    u16* sK = smem;                     // BC x STR
    u16* sV = sK + BC * STR;            // BC x STR
    u16* sQ = sV + BC * STR;            // 2 x BR x STR
    u16* sdO = sQ + 2 * BR * STR;       // 2 x BR x STR
    u16* sdS = sdO + 2 * BR * STR;      // BC x STRS (dS^T: keys x queries)
    float* sL = reinterpret_cast<float*>(sdS + BC * STRS);  // 2 x BR: LSE * log2(e)
    float* sD = sL + 2 * BR;                                // 2 x BR: D

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t4 = lane & 3;
    const int kt = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
    const int group = H / KVH;
    const int L = kv_lens[b];
    const int off = L - Tq;
    const int k0 = kt * BC;
    const int kw0 = k0 + 16 * warp;  // this warp's first key
    const size_t kv_off = (size_t)(b * KVH + kvh) * Tkv * D;

    // Query rows that see a key of this tile: i >= k0 - off (causal), all rows otherwise.
    const int i_min = CAUSAL ? max(0, k0 - off) : 0;
    const int qt_first = i_min / BR;
    const int n_qt = (Tq + BR - 1) / BR;
    const int per_head = (L > k0 && qt_first < n_qt) ? n_qt - qt_first : 0;
    const int n_it = per_head * group;

    float dk[DTKV][4], dv[DTKV][4];
#pragma unroll
    for (int i = 0; i < DTKV; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) dk[i][e] = dv[i][e] = 0.f;

    auto prefetch = [&](int it, int buf) {
        const int h = kvh * group + it / per_head;
        const int q0 = (qt_first + it % per_head) * BR;
        const size_t q_off = ((size_t)(b * H + h) * Tq + q0) * D;
        load_tile<BR, D, NTH>(sQ + buf * BR * STR, Q + q_off, Tq - q0, tid);
        load_tile<BR, D, NTH>(sdO + buf * BR * STR, dO + q_off, Tq - q0, tid);
        for (int r = tid; r < BR; r += NTH) {
            const bool ok = q0 + r < Tq;
            const size_t row = (size_t)(b * H + h) * Tq + q0 + r;
            sL[buf * BR + r] = ok ? LSE[row] * 1.4426950408889634f : POS_INF;
            sD[buf * BR + r] = ok ? Dsum[row] : 0.f;
        }
    };

    if (n_it > 0) {
        const int valid = min(BC, L - k0);
        load_tile<BC, D, NTH>(sK, K + kv_off + (size_t)k0 * D, valid, tid);
        load_tile<BC, D, NTH>(sV, V + kv_off + (size_t)k0 * D, valid, tid);
        prefetch(0, 0);
    }
    cp_async_commit();

    for (int it = 0; it < n_it; ++it) {
        const int buf = it & 1;
        if (it + 1 < n_it) {
            prefetch(it + 1, buf ^ 1);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const int h = kvh * group + it / per_head;
        const int q0 = (qt_first + it % per_head) * BR;
        const u16* q_s = sQ + buf * BR * STR;
        const u16* do_s = sdO + buf * BR * STR;
        const float* l_s = sL + buf * BR;
        const float* d_s = sD + buf * BR;
        // The warp's 16 keys against this tile's rows: all invisible when its first key is at
        // or past the limit of the tile's last row (limits grow with the row).
        const int lim_last = CAUSAL ? max(0, min(L, min(q0 + BR, Tq) + off)) : L;
        const int lim_first = CAUSAL ? max(0, min(L, q0 + off + 1)) : L;
        u16* ds_w = sdS + (16 * warp) * STRS;
        if (kw0 >= lim_last) {
            // No contribution: dS^T rows of this warp are 0 for the dQ product.
            for (int i = lane; i < 16 * BR / 2; i += 32) {
                const int r = i / (BR / 2), c = (i % (BR / 2)) * 2;
                *reinterpret_cast<u32*>(ds_w + r * STRS + c) = 0u;
            }
        } else {
            // S^T = K Q^T (16 keys x BR queries), then P^T.
            float p[NQ][4];
#pragma unroll
            for (int i = 0; i < NQ; ++i) p[i][0] = p[i][1] = p[i][2] = p[i][3] = 0.f;
            mma_rows_rows<D, NQ, STR, BF16, UNR>(p, sK + 16 * warp * STR, q_s, lane);
            const bool mask = kw0 + 16 > lim_first;
#pragma unroll
            for (int nt = 0; nt < NQ; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int ql = nt * 8 + 2 * t4 + (e & 1);  // query within the tile
                    float x = fast_exp2(p[nt][e] * scale_log2 - l_s[ql]);
                    if (mask) {
                        const int key = kw0 + g + (e >> 1) * 8;
                        const int lim = CAUSAL ? min(L, q0 + ql + off + 1) : L;
                        if (key >= lim) x = 0.f;
                    }
                    p[nt][e] = x;
                }
            }
            // dP^T = V dO^T, then dS^T = P^T * (dP^T - D) in place.
            float ds[NQ][4];
#pragma unroll
            for (int i = 0; i < NQ; ++i) ds[i][0] = ds[i][1] = ds[i][2] = ds[i][3] = 0.f;
            mma_rows_rows<D, NQ, STR, BF16, UNR>(ds, sV + 16 * warp * STR, do_s, lane);
#pragma unroll
            for (int nt = 0; nt < NQ; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int ql = nt * 8 + 2 * t4 + (e & 1);
                    ds[nt][e] = p[nt][e] * (ds[nt][e] - d_s[ql]);
                }
            }
            u32 pa[NQ / 2][4], dsa[NQ / 2][4];
            acc_to_a<NQ, BF16>(p, pa);
            acc_to_a<NQ, BF16>(ds, dsa);
            // dV += P^T dO, dK += dS^T Q (columns [dkv_off, dkv_off + DKV)).
            mma_regs_rows<NQ / 2, DTKV, STR, BF16>(dv, pa, do_s + dkv_off, lane);
            mma_regs_rows<NQ / 2, DTKV, STR, BF16>(dk, dsa, q_s + dkv_off, lane);
            // dS^T to shared memory for dQ (rows = keys, 16-bit pairs of adjacent queries).
#pragma unroll
            for (int nt = 0; nt < NQ; ++nt) {
                *reinterpret_cast<u32*>(ds_w + g * STRS + nt * 8 + 2 * t4) = dsa[nt / 2][(nt & 1) * 2];
                *reinterpret_cast<u32*>(ds_w + (g + 8) * STRS + nt * 8 + 2 * t4) = dsa[nt / 2][(nt & 1) * 2 + 1];
            }
        }
        __syncthreads();  // the dS^T tile is complete
        if (do_dq)
            dq_tile_add<D, NW, BR, STR, BF16, VRED>(
                sdS, sK, dQacc + ((size_t)(b * H + h) * Tq + q0) * D, q0, Tq, warp, lane);
        if (END_SYNC) __syncthreads();  // every warp is done with `buf` and the dS^T tile
    }

    // Write this warp's 16 rows of dK (scaled) and dV; keys past L get 0 (no contribution).
    const size_t out_off = kv_off + (size_t)kw0 * D + dkv_off;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int key = kw0 + g + r * 8;
        if (key < Tkv) {
#pragma unroll
            for (int dt = 0; dt < DTKV; ++dt) {
                const size_t o = out_off + (size_t)(g + r * 8) * D + dt * 8 + 2 * t4;
                *reinterpret_cast<u32*>(dK + o) = pack2<BF16>(dk[dt][2 * r] * scale, dk[dt][2 * r + 1] * scale);
                *reinterpret_cast<u32*>(dV + o) = pack2<BF16>(dv[dt][2 * r], dv[dt][2 * r + 1]);
            }
        }
    }
}
