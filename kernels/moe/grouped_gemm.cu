// The grouped GEMM of the MoE layer (issue 14), portable version (mma.sync, sm_80+): one launch
// multiplies every expert's rows by its own weights, the groups ragged and any of them empty.
// Written for this project after the tiling of a multistage tensor-core GEMM (cp.async stages
// into padded shared memory, ldmatrix fragments, mma.sync m16n8k16) and a persistent tile
// scheduler over all groups' tiles (the grouped GEMM of CUTLASS and of Triton's tutorial
// describe one; the code here is its own). Needs the sequence-mixer prelude before it
// (u16, u32, pack_bf16 / pack_f16, mma_bf16 / mma_f16, ldsm_x4 / ldsm_x4_t, cp_async16 and its
// waits).
//
// Layouts (row-major, 16-bit values as u16 bits, float32 accumulation, 16-bit results rounded to
// nearest even; the 16-bit type is GG_BF16's, below): rows in expert order, expert e owning rows
// offsets[e] .. offsets[e + 1] - 1 (int32, non-decreasing, offsets[0] = 0, offsets[E] = M).
//   MODE 0, the forward:  y[M, N]      = x[M, K] · w[e][K, N]          for each group's rows
//   MODE 1, dX:           dx[M, K]     = dy[M, N] · w[e][K, N]ᵀ        for each group's rows
//   MODE 2, dW:           dw[e][K, N]  = x[rows of e, K]ᵀ · dy[rows of e, N]  (zeros for an
//                                        empty group)
// Each is C = A · B for one tile of C at a time, A and B read through one of two layouts:
// A(m, k) at a[m · lda + k] (A_T = 0) or a[k · lda + m] (A_T = 1: dW's xᵀ); B(k, n) at
// b[k · ldb + n] (B_T = 0) or b[n · ldb + k] (B_T = 1: dX's wᵀ). K and N must be multiples
// of 8 (16-byte rows of the copies; the host checks).
//
// Block: 256 threads (8 warps, 2 along m by 4 along n), tile 128 x 128, k steps of 32 through
// GG_STAGES cp.async stages; each warp holds a 64 x 32 accumulator (4 x 4 mma tiles). The
// grid is persistent: block b takes tiles b, b + gridDim.x, ... of the launch's tile list, the
// groups' tiles one after another; within a group, tiles go down bands of GG_BAND row tiles
// before moving right, so that the blocks in flight share A rows and B columns in L2.

// The 16-bit type of operands and results: bf16 unless the source before this file defines
// GG_BF16 as 0 (fp16: the host's `moe::cuda::source_for(Dtype::F16)`).
#ifndef GG_BF16
#define GG_BF16 1
#endif
#if GG_BF16
#define gg_mma mma_bf16
#define gg_pack pack_bf16
#else
#define gg_mma mma_f16
#define gg_pack pack_f16
#endif

#define GG_THREADS 256
#define GG_BM 128
#define GG_BN 128
#define GG_BK 32
#define GG_STAGES 4
#define GG_BAND 8
// Padded row lengths (halves): 8 halves (16 bytes) past each row puts the 8 rows an ldmatrix
// reads in distinct banks.
#define GG_PAD_K (GG_BK + 8)    // rows of 32 along k (A untransposed, B transposed)
#define GG_PAD_MN (GG_BM + 8)   // rows of 128 along m or n (A transposed, B untransposed)
#define GG_A_HALVES (GG_BM * GG_PAD_K > GG_BK * GG_PAD_MN ? GG_BM * GG_PAD_K : GG_BK * GG_PAD_MN)
#define GG_B_HALVES GG_A_HALVES
#define GG_STAGE_HALVES (GG_A_HALVES + GG_B_HALVES)

// The tile prefix of the groups sits after the stages: (E + 1) ints.
#define GG_SMEM_TILE_BYTES (GG_STAGES * GG_STAGE_HALVES * 2)

// One stage's copies of the A tile (rows m0.., k0..) and the B tile (k0.., columns n0..), 16
// bytes per copy, zero-filled outside m_lim x k_len and k_len x n_lim (m_lim, n_lim, k_len
// counted from the tile's origin; column limits are multiples of 8).
template <int A_T, int B_T>
__device__ __forceinline__ void gg_load_stage(u16* as, u16* bs, const u16* a, long long lda,
                                              const u16* b, long long ldb, int m_lim, int n_lim,
                                              int k0, int k_len) {
    const int tid = threadIdx.x;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int c = tid + i * GG_THREADS;  // 512 copies of 16 bytes per operand
        if (A_T == 0) {
            const int r = c >> 2, kc = (c & 3) * 8;  // 128 rows of 4 copies
            const bool ok = r < m_lim && k0 + kc < k_len;
            const u16* src = ok ? a + (long long)r * lda + k0 + kc : a;
            cp_async16(as + r * GG_PAD_K + kc, src, ok);
        } else {
            const int r = c >> 4, mc = (c & 15) * 8;  // 32 k rows of 16 copies
            const bool ok = k0 + r < k_len && mc < m_lim;
            const u16* src = ok ? a + (long long)(k0 + r) * lda + mc : a;
            cp_async16(as + r * GG_PAD_MN + mc, src, ok);
        }
        if (B_T == 0) {
            const int r = c >> 4, nc = (c & 15) * 8;  // 32 k rows of 16 copies
            const bool ok = k0 + r < k_len && nc < n_lim;
            const u16* src = ok ? b + (long long)(k0 + r) * ldb + nc : b;
            cp_async16(bs + r * GG_PAD_MN + nc, src, ok);
        } else {
            const int r = c >> 2, kc = (c & 3) * 8;  // 128 n rows of 4 copies
            const bool ok = r < n_lim && k0 + kc < k_len;
            const u16* src = ok ? b + (long long)r * ldb + k0 + kc : b;
            cp_async16(bs + r * GG_PAD_K + kc, src, ok);
        }
    }
}

// One tile of C = A · B: A's origin `a` (row m0 of the tile), B's `b` (column n0), C's `c`
// (row m0, column n0, row length ldc); m_lim, n_lim the rows and columns of the tile inside C,
// k_len the reduction length (0 writes zeros). The stages must be free on entry (the caller's
// barrier).
template <int A_T, int B_T>
__device__ void gg_tile(u16* smem_h, const u16* a, long long lda, const u16* b, long long ldb,
                        u16* c, long long ldc, int m_lim, int n_lim, int k_len) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int wm = (warp >> 2) * 64, wn = (warp & 3) * 32;
    const int g = lane >> 2, t = lane & 3;
    float acc[4][4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

    const int k_tiles = (k_len + GG_BK - 1) / GG_BK;
#pragma unroll
    for (int s = 0; s < GG_STAGES - 1; ++s) {
        if (s < k_tiles) {
            u16* st = smem_h + s * GG_STAGE_HALVES;
            gg_load_stage<A_T, B_T>(st, st + GG_A_HALVES, a, lda, b, ldb, m_lim, n_lim, s * GG_BK,
                                    k_len);
        }
        cp_async_commit();
    }
    // The lane's ldmatrix row: matrix q = lane / 8, row lane % 8 of it.
    const int q = lane >> 3, r8 = lane & 7;
    for (int kt = 0; kt < k_tiles; ++kt) {
        cp_async_wait<GG_STAGES - 2>();
        __syncthreads();
        {
            const int nk = kt + GG_STAGES - 1;
            if (nk < k_tiles) {
                u16* st = smem_h + (nk % GG_STAGES) * GG_STAGE_HALVES;
                gg_load_stage<A_T, B_T>(st, st + GG_A_HALVES, a, lda, b, ldb, m_lim, n_lim,
                                        nk * GG_BK, k_len);
            }
            cp_async_commit();
        }
        const u16* as = smem_h + (kt % GG_STAGES) * GG_STAGE_HALVES;
        const u16* bs = as + GG_A_HALVES;
#pragma unroll
        for (int ks = 0; ks < GG_BK; ks += 16) {
            u32 af[4][4], bf[4][2];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int m0 = wm + i * 16;
                if (A_T == 0)
                    ldsm_x4(af[i], as + (m0 + (q & 1) * 8 + r8) * GG_PAD_K + ks + (q >> 1) * 8);
                else
                    ldsm_x4_t(af[i], as + (ks + (q >> 1) * 8 + r8) * GG_PAD_MN + m0 + (q & 1) * 8);
            }
#pragma unroll
            for (int j = 0; j < 4; j += 2) {
                const int n0 = wn + j * 8;
                u32 r[4];
                if (B_T == 0)
                    ldsm_x4_t(r, bs + (ks + (q & 1) * 8 + r8) * GG_PAD_MN + n0 + (q >> 1) * 8);
                else
                    ldsm_x4(r, bs + (n0 + (q >> 1) * 8 + r8) * GG_PAD_K + ks + (q & 1) * 8);
                bf[j][0] = r[0];
                bf[j][1] = r[1];
                bf[j + 1][0] = r[2];
                bf[j + 1][1] = r[3];
            }
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) gg_mma(acc[i][j], af[i], bf[j][0], bf[j][1]);
        }
    }
    cp_async_wait<0>();
    // The accumulators, rounded to the 16-bit type, in pairs along n (n_lim is even).
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int n = wn + j * 8 + 2 * t;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int m = wm + i * 16 + g + 8 * h;
                if (m < m_lim && n < n_lim)
                    *reinterpret_cast<u32*>(c + (long long)m * ldc + n) =
                        gg_pack(acc[i][j][2 * h], acc[i][j][2 * h + 1]);
            }
        }
}

// The grouped GEMM (MODE 0, 1, 2 as above) over `groups` groups of M rows in all (offsets
// clamped to [0, M]): x (MODE 0, 2) or dy (MODE 1)
// is `a_src`; w (MODE 0, 1) or dy (MODE 2) is `b_src`; `c` is y, dx or dw. K and N as in the
// forward (x is [M, K], w [E, K, N]). Tiles per group: MODE 0 ⌈rows/128⌉ · ⌈N/128⌉, MODE 1
// ⌈rows/128⌉ · ⌈K/128⌉, MODE 2 ⌈K/128⌉ · ⌈N/128⌉ whatever the rows. Dynamic shared memory:
// GG_SMEM_TILE_BYTES + (groups + 1) · 4.
// Offset e clamped to [0, M]: whatever the offsets hold, no tile reaches past row M (a group
// whose offsets decrease is empty).
__device__ __forceinline__ int gg_offset(const int* offsets, int e, int M) {
    return min(max(offsets[e], 0), M);
}

template <int MODE>
__device__ void grouped_gemm_body(const u16* __restrict__ a_src, const u16* __restrict__ b_src,
                                  u16* __restrict__ c, const int* __restrict__ offsets,
                                  int groups, int M, int K, int N) {
    extern __shared__ float smem[];
    u16* smem_h = reinterpret_cast<u16*>(smem);
    int* tiles_before = reinterpret_cast<int*>(reinterpret_cast<unsigned char*>(smem) +
                                               GG_SMEM_TILE_BYTES);
    // C's rows and columns per group.
    const int c_cols = MODE == 1 ? K : N;
    const int tiles_n = (c_cols + GG_BN - 1) / GG_BN;
    // The tile prefix over groups, by warp 0 in steps of 32 groups.
    if (threadIdx.x < 32) {
        int run = 0;
        const int lane = threadIdx.x;
        if (lane == 0) tiles_before[0] = 0;
        for (int base = 0; base < groups; base += 32) {
            const int e = base + lane;
            int tiles = 0;
            if (e < groups) {
                const int rows =
                    MODE == 2 ? K : max(gg_offset(offsets, e + 1, M) - gg_offset(offsets, e, M), 0);
                tiles = ((rows + GG_BM - 1) / GG_BM) * tiles_n;
            }
            int incl = tiles;
#pragma unroll
            for (int d = 1; d < 32; d *= 2) {
                const int up = __shfl_up_sync(0xffffffffu, incl, d);
                if (lane >= d) incl += up;
            }
            if (e < groups) tiles_before[e + 1] = run + incl;
            run += __shfl_sync(0xffffffffu, incl, 31);
        }
    }
    __syncthreads();
    const int total = tiles_before[groups];
    for (int tile = blockIdx.x; tile < total; tile += gridDim.x) {
        // The group: the last e with tiles_before[e] <= tile (binary search).
        int lo = 0, hi = groups - 1;
        while (lo < hi) {
            const int mid = (lo + hi + 1) >> 1;
            if (tiles_before[mid] <= tile) lo = mid; else hi = mid - 1;
        }
        const int e = lo;
        const int row0 = gg_offset(offsets, e, M);
        const int rows = max(gg_offset(offsets, e + 1, M) - row0, 0);
        const int c_rows = MODE == 2 ? K : rows;
        const int tiles_m = (c_rows + GG_BM - 1) / GG_BM;
        const int local = tile - tiles_before[e];
        const int band = local / (GG_BAND * tiles_n);
        const int band_m = min(GG_BAND, tiles_m - band * GG_BAND);
        const int in_band = local - band * GG_BAND * tiles_n;
        const int tm = band * GG_BAND + in_band % band_m, tn = in_band / band_m;
        const int m0 = tm * GG_BM, n0 = tn * GG_BN;
        const int m_lim = min(GG_BM, c_rows - m0), n_lim = min(GG_BN, c_cols - n0);
        __syncthreads();  // the previous tile's reads of the stages are done
        if (MODE == 0) {
            gg_tile<0, 0>(smem_h, a_src + (long long)(row0 + m0) * K, K,
                          b_src + (long long)e * K * N + n0, N, c + (long long)(row0 + m0) * N + n0,
                          N, m_lim, n_lim, K);
        } else if (MODE == 1) {
            // B(k = n_w, n = k_w) = w[e][k_w][n_w]: B_T, rows of w are B's columns.
            gg_tile<0, 1>(smem_h, a_src + (long long)(row0 + m0) * N, N,
                          b_src + (long long)e * K * N + (long long)n0 * N, N,
                          c + (long long)(row0 + m0) * K + n0, K, m_lim, n_lim, N);
        } else {
            // A(m = k_x, k = row) = x[row0 + row][k_x]: A_T over the group's rows.
            gg_tile<1, 0>(smem_h, a_src + (long long)row0 * K + m0, K,
                          b_src + (long long)row0 * N + n0, N,
                          c + (long long)e * K * N + (long long)m0 * N + n0, N, m_lim, n_lim, rows);
        }
    }
}

extern "C" __global__ void __launch_bounds__(GG_THREADS, 2)
grouped_gemm_fwd(const u16* __restrict__ x, const u16* __restrict__ w, u16* __restrict__ y,
                 const int* __restrict__ offsets, int groups, int M, int K, int N) {
    grouped_gemm_body<0>(x, w, y, offsets, groups, M, K, N);
}

extern "C" __global__ void __launch_bounds__(GG_THREADS, 2)
grouped_gemm_dx(const u16* __restrict__ dy, const u16* __restrict__ w, u16* __restrict__ dx,
                const int* __restrict__ offsets, int groups, int M, int K, int N) {
    grouped_gemm_body<1>(dy, w, dx, offsets, groups, M, K, N);
}

extern "C" __global__ void __launch_bounds__(GG_THREADS, 2)
grouped_gemm_dw(const u16* __restrict__ x, const u16* __restrict__ dy, u16* __restrict__ dw,
                const int* __restrict__ offsets, int groups, int M, int K, int N) {
    grouped_gemm_body<2>(x, dy, dw, offsets, groups, M, K, N);
}
