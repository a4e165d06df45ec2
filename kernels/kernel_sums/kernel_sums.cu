// Kernel sums in float32 on CUDA cores, never holding the N x M kernel matrix: each thread owns
// one or a few rows i of X (registers), the block streams Y through shared memory in tiles,
// and every (i, j) pair is reduced into the thread's accumulators as soon as it is computed
// (the map-reduce scheme of KeOps: Charlier, Feydy, Glaunes, Collin, Durif, "Kernel Operations
// on the GPU, with Autodiff, without Memory Overflows", JMLR 22(74), 2021).
//
// Operations (all float32, row-major, natural-log outputs; src/kernel_sums/mod.rs defines them
// in float64):
// - rbf_mv:     out[i, c] = sum_j exp(-|x_i - y_j|^2 / (2 sigma^2)) b[j, c]   out [N, C]
// - kde:        out[i]    = norm * sum_j exp(-|x_i - y_j|^2 / (2 sigma^2))     out [N]
//               (norm = (2 pi sigma^2)^(-D/2) / M, computed by the caller)
// - kernel_lse: out[i]    = log sum_j exp(-|x_i - y_j|^2 / eps + g_j)          out [N]
//   and with the gradient, out[N + i*D + a] = -(2/eps) (x_ia - sum_j p_ij y_ja), p_ij the
//   softmax weights of row i: the layout of KernelSumCase::output_len (N values, then N x D).
//
// Arguments, the same for every dimension so the host launches them alike:
//   rbf_mv_*     (const float* X, const float* Y, const float* B, float* out,
//                 long long N, long long M, int D, int C, float k)
//   kde_*        (const float* X, const float* Y, float* out,
//                 long long N, long long M, int D, float k, float norm)
//   kernel_lse*_ (const float* X, const float* Y, const float* G, float* out,
//                 long long N, long long M, int D, float k, float two_over_eps)
//   kernel_lse_split_d* (X, Y, G, float2* part, N, M, D, k, two_over_eps,
//                 long long split_len), then kernel_lse_combine (const float2* part,
//                 float* out, long long N, int splits)
//   rbf_mv_split_d* (X, Y, B, float* part, N, M, D, C = 1, k, long long split_len) and
//   kde_split_d* (X, Y, float* part, N, M, D, k, norm, long long split_len), then
//                 kernel_sum_combine (const float* part, float* out, long long N,
//                 int splits, float scale)
// with k = log2(e) / (2 sigma^2) for rbf_mv and kde, k = log2(e) / eps for kernel_lse: every
// exponent is computed in base 2 and exponentiated with ex2.approx.ftz.f32: one MUFU.EX2. CUDA's
// exp2f is the same instruction plus a fix-up for results below 2^-126 (NVRTC 13's SASS), and
// the CUDA Programming Guide lists exp2f at 2 ulp, so about 2.4e-7 relative; here subnormal
// results flush to 0, which only drops terms below 2^-126 (relative to the running maximum for
// kernel_lse). The _d1/_d2/_d3 kernels ignore `D` (it is their template parameter); the _dn
// kernels take any D >= 1.
//
// Launch (src/kernel_sums/cuda.rs): KS_THREADS threads per block; grid.x = ceil(N / rows per
// block), grid.y = ceil(C / CT) column tiles for rbf_mv, the number of splits of Y for
// the *_split_d* kernels (1 otherwise); no dynamic shared memory. Rows per block: KS_THREADS * R for the small-D kernels (R rows per thread,
// rows t, t + KS_THREADS, ... of the block so stores stay coalesced), KS_THREADS for _dn.
// Offsets into X, Y, B and out are 64-bit (N*D and N*C may pass 2^31); any N, M >= 1 works:
// Y tiles past M are padded with points that contribute exactly 0 (weight 0, or g = -inf), rows
// past N are computed on zeros and never stored.
//
// No headers (NVRTC): INFINITY is spelled with its bits.

#define KS_THREADS 128
// Y points per shared-memory tile of the small-D kernels: one per thread to load.
#define KS_TILE 128
// Y points per online-max step of kernel_lse (small D): the running maximum is updated once
// per row per chunk.
#define KS_CHUNK 16
// The largest chunk sum (in units of 2^running maximum) kernel_lse's lazy step keeps: 2^8, as
// FlashAttention-4's rescaling threshold of 8 octaves. A chunk past it (or inf, or NaN) is
// taken again exactly against its own maximum. The bound keeps the terms' exponents e - mx
// below 8 and the row's log2(sum) below 8 + log2(M/16), so their float32 rounding stays that of
// the exact step: in a float32 simulation (400 x 4096 points in the unit cube, D3, eps 0.002)
// the rel_l2 error against float64 was 5.9e-7 against the exact step's 5.7e-7, where a bound
// of 2^64 gave 1.0e-6, and 1.2 % of the chunks took the exact step. Terms that flush to 0
// against a stale maximum are below 2^-126 of a sum that already holds a term of 1.
#define KS_LSE_LAZY_MAX 256.f
// Y points per tile and features per chunk of the generic-D kernels.
#define KS_DN_TILE 32
#define KS_DN_KD 16
// Row stride of the staged X chunk: KS_DN_KD + 4 floats keeps the 16-byte row reads of eight
// consecutive threads in distinct bank groups.
#define KS_DN_XS (KS_DN_KD + 4)

#define KS_NEG_INF __int_as_float(0xff800000)
#define KS_LOG2E 1.4426950408889634f
#define KS_LN2 0.6931471805599453f

// 2^x, one MUFU.EX2.
__device__ __forceinline__ float ks_ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// s += v, compensated (Kahan 1965): c carries the low-order bits the running sum has lost, so
// the total's error stays a few ulp whatever the number of additions (a plain float32 sum over
// M = 10^6 terms drifts by ~sqrt(M) ulp, ~1e-4 relative). Only additions: nothing to contract
// into a fused multiply-add.
__device__ __forceinline__ void ks_kahan_add(float& s, float& c, float v) {
    const float y = v - c;
    const float t = s + y;
    c = (t - s) - y;
    s = t;
}

// Point j of Y (D <= 3) multiplied by s, as (y0, y1, y2) with zeros past D, and w in .w.
template <int D>
__device__ __forceinline__ float4 ks_point(const float* __restrict__ Y, long long j, float s,
                                           float w) {
    const float* p = Y + j * D;
    float4 v;
    v.x = p[0] * s;
    v.y = D > 1 ? p[1] * s : 0.f;
    v.z = D > 2 ? p[2] * s : 0.f;
    v.w = w;
    return v;
}

// -|x - p|^2 + p.w for a point p from ks_point (x and p both scaled by s = sqrt(k), so the
// result is the base-2 exponent): D subtractions and D fused multiply-adds.
template <int D>
__device__ __forceinline__ float ks_neg_sq(const float* x, float4 p, float start) {
    const float d0 = x[0] - p.x;
    float q = fmaf(-d0, d0, start);
    if (D > 1) {
        const float d1 = x[1] - p.y;
        q = fmaf(-d1, d1, q);
    }
    if (D > 2) {
        const float d2 = x[2] - p.z;
        q = fmaf(-d2, d2, q);
    }
    return q;
}

// ca += p * (y - x) over the first D coordinates (the gradient's running sum, small D).
template <int D>
__device__ __forceinline__ void ks_grad_add(float* ca, float p, float4 y, const float* x) {
    ca[0] = fmaf(p, y.x - x[0], ca[0]);
    if (D > 1) ca[D > 1 ? 1 : 0] = fmaf(p, y.y - x[D > 1 ? 1 : 0], ca[D > 1 ? 1 : 0]);
    if (D > 2) ca[D > 2 ? 2 : 0] = fmaf(p, y.z - x[D > 2 ? 2 : 0], ca[D > 2 ? 2 : 0]);
}

// ---------------------------------------------------------------------------------------------
// Small D (1, 2, 3): coordinates in registers, Y tiles as float4 broadcasts.
//
// Both X and Y are scaled by s = sqrt(k) once (X when loaded, Y when staged), so a pair costs
// D FADD + D FFMA for its exponent, one MUFU.EX2, and its reduction (one FFMA per column for
// rbf_mv). The scaling moves the exponent by at most ~2^-23 * 2k |x| |x - y| (rounding of the
// scaled coordinates), the same order as the float32 exponent itself for points near the
// origin.

// rbf_mv and kde: CT output columns per thread (a column tile; grid.y = ceil(C / CT)), R rows.
// With CT == 1 the weight b[j, c0] (1 for kde, 0 past M) rides in the point's .w; with CT > 1
// the tile's weights [KS_TILE][CT] (0 past M or C) are staged in shared memory and read as
// float4 broadcasts.
//
// SPLIT (CT == 1 and C == 1 only): grid.y splits Y instead of the columns, as lse_small's
// split: the block sums points [yb, ye) of Y, yb = blockIdx.y * split_len, and writes each
// row's compensated partial sum, unscaled, to part[blockIdx.y * N + i]; kernel_sum_combine adds
// a row's grid.y partials and scales them (the KDE's normalisation). It fills the SMs when N
// alone gives few blocks (N = 10^4: 40 blocks of 256 rows for 132 SMs).
template <int D, int CT, int R, bool KDE, bool SPLIT>
__device__ __forceinline__ void rbf_small(const float* __restrict__ X, const float* __restrict__ Y,
                                          const float* __restrict__ B, float* __restrict__ out,
                                          long long N, long long M, int C, float k,
                                          float out_scale, float* __restrict__ part,
                                          long long split_len) {
    static_assert(!SPLIT || CT == 1, "the split takes one column");
    __shared__ float4 ys[KS_TILE];
    __shared__ __align__(16) float bs[CT > 1 ? KS_TILE * CT : 4];
    const int t = threadIdx.x;
    const float s = sqrtf(k);
    const long long row0 = (long long)blockIdx.x * (KS_THREADS * R) + t;
    const int c0 = SPLIT ? 0 : blockIdx.y * CT;
    // This block's points of Y: [yb, ye).
    const long long yb = SPLIT ? (long long)blockIdx.y * split_len : 0;
    const long long ye = SPLIT ? (yb + split_len < M ? yb + split_len : M) : M;

    // Each tile's terms are summed apart (tacc), then added to the row's total (acc),
    // compensated (comp) up to 4 columns; 16 and 64 columns add plainly (the registers of a
    // third accumulator per column would spill), so their error grows with M / KS_TILE.
    constexpr bool KAHAN = CT <= 4;
    float x[R][D];
    float acc[R][CT], tacc[R][CT], comp[R][KAHAN ? CT : 1];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const long long i = row0 + (long long)r * KS_THREADS;
#pragma unroll
        for (int a = 0; a < D; ++a) x[r][a] = i < N ? X[i * D + a] * s : 0.f;
#pragma unroll
        for (int c = 0; c < CT; ++c) acc[r][c] = 0.f;
#pragma unroll
        for (int c = 0; c < (KAHAN ? CT : 1); ++c) comp[r][c] = 0.f;
    }

    // The thread's point of the next tile, loaded while the current one is consumed.
    long long j = yb + t;
    float4 next = make_float4(0.f, 0.f, 0.f, 0.f);
    if (j < ye) next = ks_point<D>(Y, j, s, KDE ? 1.f : (CT == 1 ? B[j * C + c0] : 0.f));

    for (long long j0 = yb; j0 < ye; j0 += KS_TILE) {
        __syncthreads();  // every thread is done with the previous tile
        ys[t] = next;
        if (CT > 1) {
            for (int q = t; q < KS_TILE * CT; q += KS_THREADS) {
                const int jj = q / CT, c = q % CT;
                const long long jb = j0 + jj;
                bs[q] = (jb < M && c0 + c < C) ? B[jb * C + c0 + c] : 0.f;
            }
        }
        __syncthreads();
        j = j0 + KS_TILE + t;
        next = make_float4(0.f, 0.f, 0.f, 0.f);
        if (j < ye) next = ks_point<D>(Y, j, s, KDE ? 1.f : (CT == 1 ? B[j * C + c0] : 0.f));

#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int c = 0; c < CT; ++c) tacc[r][c] = 0.f;
#pragma unroll(CT == 1 ? 8 : 4)
        for (int jj = 0; jj < KS_TILE; ++jj) {
            const float4 p = ys[jj];
            float kv[R];
#pragma unroll
            for (int r = 0; r < R; ++r) kv[r] = ks_ex2(ks_neg_sq<D>(x[r], p, 0.f));
            if (CT == 1) {
#pragma unroll
                for (int r = 0; r < R; ++r) tacc[r][0] = fmaf(kv[r], p.w, tacc[r][0]);
            } else {
                const float4* b4 = reinterpret_cast<const float4*>(bs + jj * CT);
#pragma unroll
                for (int c4 = 0; c4 < CT / 4; ++c4) {
                    const float4 b = b4[c4];
#pragma unroll
                    for (int r = 0; r < R; ++r) {
                        tacc[r][4 * c4 + 0] = fmaf(kv[r], b.x, tacc[r][4 * c4 + 0]);
                        tacc[r][4 * c4 + 1] = fmaf(kv[r], b.y, tacc[r][4 * c4 + 1]);
                        tacc[r][4 * c4 + 2] = fmaf(kv[r], b.z, tacc[r][4 * c4 + 2]);
                        tacc[r][4 * c4 + 3] = fmaf(kv[r], b.w, tacc[r][4 * c4 + 3]);
                    }
                }
            }
        }
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int c = 0; c < CT; ++c) {
                if (KAHAN)
                    ks_kahan_add(acc[r][c], comp[r][KAHAN ? c : 0], tacc[r][c]);
                else
                    acc[r][c] += tacc[r][c];
            }
    }

#pragma unroll
    for (int r = 0; r < R; ++r) {
        const long long i = row0 + (long long)r * KS_THREADS;
        if (SPLIT) {
            if (i < N) part[(long long)blockIdx.y * N + i] = acc[r][0];
        } else if (i < N) {
#pragma unroll
            for (int c = 0; c < CT; ++c)
                if (c0 + c < C) out[i * C + c0 + c] = acc[r][c] * out_scale;
        }
    }
}

// One chunk of KS_CHUNK points of Y (`ys`, scaled, g log2 e in .w) for R rows, exactly: each
// row's exponents, their maximum, the row's sums (and its sum of p * (y - x)) rescaled once if
// the maximum grew, then 2^(e - max) added compensated. D FADD + D FFMA, one FMNMX, one FADD,
// one MUFU.EX2 and one FADD per pair (+ D FADD + D FFMA for the gradient). acc and acc_c are
// read only with GRAD.
template <int D, int R, bool GRAD>
__device__ __forceinline__ void lse_chunk_exact(const float4* ys, float (*x)[D], float* mx,
                                                float* sum, float* sum_c, float (*acc)[D],
                                                float (*acc_c)[D]) {
    float e[R][KS_CHUNK];
#pragma unroll
    for (int c = 0; c < KS_CHUNK; ++c) {
        const float4 p = ys[c];
#pragma unroll
        for (int r = 0; r < R; ++r) e[r][c] = ks_neg_sq<D>(x[r], p, p.w);
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
        float cm = e[r][0];
#pragma unroll
        for (int c = 1; c < KS_CHUNK; ++c) cm = fmaxf(cm, e[r][c]);
        if (cm > mx[r]) {
            // 2^(-inf) = 0 when the row had no finite term yet.
            const float f = ks_ex2(mx[r] - cm);
            sum[r] *= f;
            sum_c[r] *= f;
            if (GRAD) {
#pragma unroll
                for (int a = 0; a < D; ++a) {
                    acc[r][a] *= f;
                    acc_c[r][a] *= f;
                }
            }
            mx[r] = cm;
        }
        // A row whose terms are all -inf so far adds 2^(-inf - 0) = 0, not NaN.
        const float ref = mx[r] == KS_NEG_INF ? 0.f : mx[r];
        float cs = 0.f, ca[D];
#pragma unroll
        for (int a = 0; a < D; ++a) ca[a] = 0.f;
#pragma unroll
        for (int c = 0; c < KS_CHUNK; ++c) {
            const float p = ks_ex2(e[r][c] - ref);
            cs += p;
            if (GRAD) ks_grad_add<D>(ca, p, ys[c], x[r]);
        }
        ks_kahan_add(sum[r], sum_c[r], cs);
        if (GRAD) {
#pragma unroll
            for (int a = 0; a < D; ++a) ks_kahan_add(acc[r][a], acc_c[r][a], ca[a]);
        }
    }
}

// kernel_lse (and its gradient): R rows per thread. The point's .w holds g_j log2(e) (-inf
// past M). Without the gradient, per chunk of KS_CHUNK points a row sums 2^(e - mx) against
// its running maximum mx as it stood before the chunk (the lazy step: D FADD + D FFMA, one
// FADD, one MUFU.EX2 and one FADD per pair, not lse_chunk_exact's FMNMX per pair) and adds the
// chunk's sum to the total compensated. The sums are in units of 2^mx whatever the terms' own
// maximum, so the lazy step is exact as long as nothing overflows: a chunk whose sum is not at
// most KS_LSE_LAZY_MAX (the row's first, where mx = -inf, and any whose terms rose 8 octaves
// or more past mx) is taken again by lse_chunk_exact. The maximum only has to come from a term the sum
// holds (so that the sum is at least 1): the conditional rescaling described for
// FlashAttention-4, with the overflow itself as the condition. With the gradient every chunk
// is exact (the lazy step's second pass would need the gradient's registers twice: 127
// registers became 183 when tried).
//
// SPLIT (without the gradient): the block reduces only points [jb, je) of Y, jb = blockIdx.y *
// split_len, and writes each row's partial (running maximum, sum) as a float2 to
// part[blockIdx.y * N + i], in the base-2 units of the loop; kernel_lse_combine merges the
// grid.y partials of a row into out[i]. This fills the SMs when N alone gives few blocks (a
// Sinkhorn iteration at N = 10^4: 40 blocks of 256 rows on 132 SMs).
template <int D, int R, bool GRAD, bool SPLIT>
__device__ __forceinline__ void lse_small(const float* __restrict__ X, const float* __restrict__ Y,
                                          const float* __restrict__ G, float* __restrict__ out,
                                          long long N, long long M, float k, float two_over_eps,
                                          float2* __restrict__ part, long long split_len) {
    __shared__ float4 ys[KS_TILE];
    const int t = threadIdx.x;
    const float s = sqrtf(k);
    const long long row0 = (long long)blockIdx.x * (KS_THREADS * R) + t;
    // This block's points of Y: [jb, je).
    const long long jb = SPLIT ? (long long)blockIdx.y * split_len : 0;
    const long long je = SPLIT ? (jb + split_len < M ? jb + split_len : M) : M;

    // Each chunk's terms are summed apart, then added to the row's totals compensated
    // (sum_c, acc_c; ks_kahan_add). The gradient accumulates p (y - x), centred on the row's
    // own point, so dX = (2 / eps) sum_j p (y_j - x) / sum_j p takes no difference of two
    // nearly equal sums (x - sum_j p y_j / sum_j p cancels where x sits near the weighted
    // mean).
    float x[R][D], mx[R], sum[R], sum_c[R], acc[R][D], acc_c[R][D];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const long long i = row0 + (long long)r * KS_THREADS;
#pragma unroll
        for (int a = 0; a < D; ++a) {
            x[r][a] = i < N ? X[i * D + a] * s : 0.f;
            acc[r][a] = 0.f;
            acc_c[r][a] = 0.f;
        }
        mx[r] = KS_NEG_INF;
        sum[r] = 0.f;
        sum_c[r] = 0.f;
    }

    long long j = jb + t;
    float4 next = make_float4(0.f, 0.f, 0.f, KS_NEG_INF);
    if (j < je) next = ks_point<D>(Y, j, s, G[j] * KS_LOG2E);

    for (long long j0 = jb; j0 < je; j0 += KS_TILE) {
        __syncthreads();
        ys[t] = next;
        __syncthreads();
        j = j0 + KS_TILE + t;
        next = make_float4(0.f, 0.f, 0.f, KS_NEG_INF);
        if (j < je) next = ks_point<D>(Y, j, s, G[j] * KS_LOG2E);

#pragma unroll 1
        for (int jc = 0; jc < KS_TILE; jc += KS_CHUNK) {
            if (GRAD) {
                lse_chunk_exact<D, R, GRAD>(ys + jc, x, mx, sum, sum_c, acc, acc_c);
                continue;
            }
            // The lazy step: every term against the row's running maximum as it stood before
            // the chunk, with no maximum taken per pair.
            float cs[R];
#pragma unroll
            for (int r = 0; r < R; ++r) cs[r] = 0.f;
#pragma unroll
            for (int c = 0; c < KS_CHUNK; ++c) {
                const float4 y = ys[jc + c];
#pragma unroll
                for (int r = 0; r < R; ++r) cs[r] += ks_ex2(ks_neg_sq<D>(x[r], y, y.w) - mx[r]);
            }
#pragma unroll
            for (int r = 0; r < R; ++r) {
                if (cs[r] <= KS_LSE_LAZY_MAX) {
                    ks_kahan_add(sum[r], sum_c[r], cs[r]);
                } else {
                    // The exact step, for the rows the lazy one cannot serve: a row's first
                    // finite chunk (mx = -inf: its terms are 2^inf, or 2^NaN while every term
                    // is -inf), and a chunk whose terms rose past the running maximum enough to
                    // overflow or to pass KS_LSE_LAZY_MAX.
                    lse_chunk_exact<D, 1, false>(ys + jc, &x[r], &mx[r], &sum[r], &sum_c[r],
                                                 nullptr, nullptr);
                }
            }
        }
    }

#pragma unroll
    for (int r = 0; r < R; ++r) {
        const long long i = row0 + (long long)r * KS_THREADS;
        if (SPLIT) {
            if (i < N) part[(long long)blockIdx.y * N + i] = make_float2(mx[r], sum[r]);
        } else if (i < N) {
            out[i] = (mx[r] + log2f(sum[r])) * KS_LN2;
            if (GRAD) {
                // acc holds sum_j p (y_j - x) * s: undo the scaling with the normalisation.
                const float inv = 1.f / (sum[r] * s);
#pragma unroll
                for (int a = 0; a < D; ++a) out[N + i * D + a] = two_over_eps * (acc[r][a] * inv);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Any D (the feature path, 16-128 in the benchmarks): one row per thread. Per tile of
// KS_DN_TILE points, the features are walked in chunks of KS_DN_KD: the block stages its rows'
// chunk of X ([KS_THREADS][KS_DN_XS]) and the tile's chunk of Y ([KS_DN_TILE][KS_DN_KD]), zero
// past N, M and D, and every thread adds (x_a - y_ja)^2 into its KS_DN_TILE squared distances
// (16-byte reads: x its own row, y a broadcast). Then the tile is reduced as above. Unscaled
// coordinates: the exponent is -k * |x - y|^2, computed once per pair.

// Stages features [d0, d0 + KS_DN_KD) of rows [rb, rb + KS_THREADS) of X and of points
// [j0, j0 + KS_DN_TILE) of Y (zeros outside).
__device__ __forceinline__ void ks_stage(float (*xs)[KS_DN_XS], float (*ys)[KS_DN_KD],
                                         const float* __restrict__ X,
                                         const float* __restrict__ Y, long long rb, long long N,
                                         long long j0, long long M, int D, int d0, bool with_x) {
    const int t = threadIdx.x;
    if (with_x) {
        for (int q = t; q < KS_THREADS * KS_DN_KD; q += KS_THREADS) {
            const int rr = q / KS_DN_KD, a = q % KS_DN_KD;
            const long long i = rb + rr;
            xs[rr][a] = (i < N && d0 + a < D) ? X[i * D + d0 + a] : 0.f;
        }
    }
    for (int q = t; q < KS_DN_TILE * KS_DN_KD; q += KS_THREADS) {
        const int jj = q / KS_DN_KD, a = q % KS_DN_KD;
        const long long jy = j0 + jj;
        ys[jj][a] = (jy < M && d0 + a < D) ? Y[jy * D + d0 + a] : 0.f;
    }
}

// sq[jj] = |x_i - y_(j0+jj)|^2 for the tile at j0 (every thread of the block calls it: it
// synchronises).
__device__ __forceinline__ void ks_tile_sq(float (*xs)[KS_DN_XS], float (*ys)[KS_DN_KD],
                                           const float* __restrict__ X,
                                           const float* __restrict__ Y, long long rb, long long N,
                                           long long j0, long long M, int D,
                                           float sq[KS_DN_TILE]) {
    const int t = threadIdx.x;
#pragma unroll
    for (int jj = 0; jj < KS_DN_TILE; ++jj) sq[jj] = 0.f;
    for (int d0 = 0; d0 < D; d0 += KS_DN_KD) {
        __syncthreads();  // the previous chunk (or tile) is consumed
        ks_stage(xs, ys, X, Y, rb, N, j0, M, D, d0, true);
        __syncthreads();
#pragma unroll
        for (int a4 = 0; a4 < KS_DN_KD / 4; ++a4) {
            const float4 xv = *reinterpret_cast<const float4*>(&xs[t][4 * a4]);
#pragma unroll
            for (int jj = 0; jj < KS_DN_TILE; ++jj) {
                const float4 yv = *reinterpret_cast<const float4*>(&ys[jj][4 * a4]);
                float d = xv.x - yv.x;
                sq[jj] = fmaf(d, d, sq[jj]);
                d = xv.y - yv.y;
                sq[jj] = fmaf(d, d, sq[jj]);
                d = xv.z - yv.z;
                sq[jj] = fmaf(d, d, sq[jj]);
                d = xv.w - yv.w;
                sq[jj] = fmaf(d, d, sq[jj]);
            }
        }
    }
}

// rbf_mv and kde, any D: CT columns per thread. The tile's weights [KS_DN_TILE][CT] (0 past M
// or C) are staged at the start of each tile, before the distance chunks (whose first barrier
// orders them after the previous tile's reads and before this tile's).
template <int CT, bool KDE>
__device__ __forceinline__ void rbf_dn(const float* __restrict__ X, const float* __restrict__ Y,
                                       const float* __restrict__ B, float* __restrict__ out,
                                       long long N, long long M, int D, int C, float k,
                                       float out_scale) {
    __shared__ __align__(16) float xs[KS_THREADS][KS_DN_XS];
    __shared__ __align__(16) float ys[KS_DN_TILE][KS_DN_KD];
    __shared__ __align__(16) float bs[KS_DN_TILE][CT];
    const int t = threadIdx.x;
    const long long rb = (long long)blockIdx.x * KS_THREADS;
    const long long i = rb + t;
    const int c0 = blockIdx.y * CT;

    // Tile partials added to the totals compensated up to 4 columns, as in rbf_small.
    constexpr bool KAHAN = CT <= 4;
    float acc[CT], tacc[CT], comp[KAHAN ? CT : 1];
#pragma unroll
    for (int c = 0; c < CT; ++c) acc[c] = 0.f;
#pragma unroll
    for (int c = 0; c < (KAHAN ? CT : 1); ++c) comp[c] = 0.f;

    for (long long j0 = 0; j0 < M; j0 += KS_DN_TILE) {
        __syncthreads();  // the previous tile's weights are consumed
        for (int q = t; q < KS_DN_TILE * CT; q += KS_THREADS) {
            const int jj = q / CT, c = q % CT;
            const long long jb = j0 + jj;
            float w = 0.f;
            if (jb < M && c0 + c < C) w = KDE ? 1.f : B[jb * C + c0 + c];
            bs[jj][c] = w;
        }
        float sq[KS_DN_TILE];
        ks_tile_sq(xs, ys, X, Y, rb, N, j0, M, D, sq);
#pragma unroll
        for (int c = 0; c < CT; ++c) tacc[c] = 0.f;
#pragma unroll
        for (int jj = 0; jj < KS_DN_TILE; ++jj) {
            const float kv = ks_ex2(-k * sq[jj]);
            if (CT == 1) {
                tacc[0] = fmaf(kv, bs[jj][0], tacc[0]);
            } else {
#pragma unroll
                for (int c4 = 0; c4 < CT / 4; ++c4) {
                    const float4 b = *reinterpret_cast<const float4*>(&bs[jj][4 * c4]);
                    tacc[4 * c4 + 0] = fmaf(kv, b.x, tacc[4 * c4 + 0]);
                    tacc[4 * c4 + 1] = fmaf(kv, b.y, tacc[4 * c4 + 1]);
                    tacc[4 * c4 + 2] = fmaf(kv, b.z, tacc[4 * c4 + 2]);
                    tacc[4 * c4 + 3] = fmaf(kv, b.w, tacc[4 * c4 + 3]);
                }
            }
        }
#pragma unroll
        for (int c = 0; c < CT; ++c) {
            if (KAHAN)
                ks_kahan_add(acc[c], comp[KAHAN ? c : 0], tacc[c]);
            else
                acc[c] += tacc[c];
        }
    }
    if (i < N) {
#pragma unroll
        for (int c = 0; c < CT; ++c)
            if (c0 + c < C) out[i * C + c0 + c] = acc[c] * out_scale;
    }
}

// kernel_lse, any D. One online-max step per tile. The gradient's running sum of p * y has D
// entries, more than a thread's registers for large D: it is kept in the thread's own output
// row out[N + i*D ...] (only that thread touches it), added to once per tile and feature chunk
// after a second pass over the tile's Y chunks, rescaled in place when the maximum grows, and
// turned into the gradient at the end.
template <bool GRAD>
__device__ __forceinline__ void lse_dn(const float* __restrict__ X, const float* __restrict__ Y,
                                       const float* __restrict__ G, float* __restrict__ out,
                                       long long N, long long M, int D, float k,
                                       float two_over_eps) {
    __shared__ __align__(16) float xs[KS_THREADS][KS_DN_XS];
    __shared__ __align__(16) float ys[KS_DN_TILE][KS_DN_KD];
    __shared__ float gs[KS_DN_TILE];
    const int t = threadIdx.x;
    const long long rb = (long long)blockIdx.x * KS_THREADS;
    const long long i = rb + t;
    float* grad = out + N + i * D;  // dereferenced only when i < N

    if (GRAD && i < N)
        for (int a = 0; a < D; ++a) grad[a] = 0.f;
    float mx = KS_NEG_INF, sum = 0.f, sum_c = 0.f;  // sum_c: ks_kahan_add's compensation

    for (long long j0 = 0; j0 < M; j0 += KS_DN_TILE) {
        __syncthreads();  // the previous tile's g values are consumed
        if (t < KS_DN_TILE) gs[t] = j0 + t < M ? G[j0 + t] * KS_LOG2E : KS_NEG_INF;
        float e[KS_DN_TILE];
        ks_tile_sq(xs, ys, X, Y, rb, N, j0, M, D, e);
        float cm = KS_NEG_INF;
#pragma unroll
        for (int jj = 0; jj < KS_DN_TILE; ++jj) {
            e[jj] = fmaf(-k, e[jj], gs[jj]);
            cm = fmaxf(cm, e[jj]);
        }
        if (cm > mx) {
            const float f = ks_ex2(mx - cm);
            sum *= f;
            sum_c *= f;
            if (GRAD && i < N)
                for (int a = 0; a < D; ++a) grad[a] *= f;
            mx = cm;
        }
        const float ref = mx == KS_NEG_INF ? 0.f : mx;
        float ts = 0.f;
#pragma unroll
        for (int jj = 0; jj < KS_DN_TILE; ++jj) {
            e[jj] = ks_ex2(e[jj] - ref);  // now p_j, unnormalised
            ts += e[jj];
        }
        ks_kahan_add(sum, sum_c, ts);
        if (GRAD) {
            for (int d0 = 0; d0 < D; d0 += KS_DN_KD) {
                __syncthreads();
                ks_stage(xs, ys, X, Y, rb, N, j0, M, D, d0, false);
                __syncthreads();
#pragma unroll
                for (int a4 = 0; a4 < KS_DN_KD / 4; ++a4) {
                    float4 py = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
                    for (int jj = 0; jj < KS_DN_TILE; ++jj) {
                        const float4 yv = *reinterpret_cast<const float4*>(&ys[jj][4 * a4]);
                        py.x = fmaf(e[jj], yv.x, py.x);
                        py.y = fmaf(e[jj], yv.y, py.y);
                        py.z = fmaf(e[jj], yv.z, py.z);
                        py.w = fmaf(e[jj], yv.w, py.w);
                    }
                    const int a = d0 + 4 * a4;
                    if (i < N) {
                        if (a + 0 < D) grad[a + 0] += py.x;
                        if (a + 1 < D) grad[a + 1] += py.y;
                        if (a + 2 < D) grad[a + 2] += py.z;
                        if (a + 3 < D) grad[a + 3] += py.w;
                    }
                }
            }
        }
    }
    if (i < N) {
        out[i] = (mx + log2f(sum)) * KS_LN2;
        if (GRAD) {
            const float inv = 1.f / sum;
            for (int a = 0; a < D; ++a) grad[a] = -two_over_eps * (X[i * D + a] - grad[a] * inv);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Tensor-core feature path (4 <= D <= KS_TC_DMAX; the host's pick for the kernel sums with one
// column of b, and the log-sum-exp with or without its gradient): the squared distance expanded as |x - c|^2 + |y - c|^2 - 2 (x - c).(y - c)
// around a common centre c, with the cross terms of a block as a GEMM tile on mma.sync m16n8k8
// TF32. TF32 keeps 10 of float32's 23 mantissa bits, so each operand is split into
// hi = tf32(v) and lo = tf32(v - hi) and the product taken as hi.hi + hi.lo + lo.hi (lo.lo is
// below float32's rounding): the "3xTF32" emulation of a float32 GEMM, three MMAs per k-step,
// still several times the CUDA-core rate of the _dn kernels (two instructions per feature per
// pair). The expansion cancels when |x - y| << |x - c|: the exponent's absolute error is about
// 2^-22 k (|x - c|^2 + |y - c|^2), so the centre (the mean of Y's first KS_TC_CENTER points)
// cuts it about fourfold for a cloud away from the origin (points in the unit cube: |x|^2 ~ D/3,
// |x - c|^2 ~ D/12).
//
// Three launches per call (src/kernel_sums/cuda.rs):
// 1. kernel_sum_tc_center (one block): c[a] = mean of Y[0..min(M, KS_TC_CENTER), a], 0 past D;
//    Dp = D rounded up to 8 floats.
// 2. kernel_sum_tc_prep (one thread per point of Y, Mp = M rounded up to KS_TC_TILE): Y - c
//    split into TF32 parts YH, YL [Mp][Dp] (zeros past M and D), YN[j] = -k |y_j - c|^2 (plus
//    g_j log2 e for kernel_lse; -inf past M) and WT[j] = b_j (1 for kde; 0 past M). These depend
//    on Y, b or g and k only, so every row block reads them instead of converting Y again.
// 3. the entry point: block = KS_THREADS (4 warps), KS_TC_ROWS = 64 rows of X (16 per warp,
//    one m16 tile) staged once in shared memory as float32 minus c, with a row stride of Dp + 4
//    floats: with the stride 4 mod 8 words, the eight rows and four columns an MMA fragment reads
//    fall in 32 distinct banks. Y streams through in tiles of KS_TC_TILE = 64 prepared points,
//    copied by cp.async into two stages (the next tile lands while this one is computed). Each
//    warp computes its 16 x 64 tile of (x - c).(y - c) (8 n-tiles of m16n8, Dp / 8 k-steps),
//    then per pair
//      rbf_mv / kde: e = min(2k s + YN[j] + XN[i], 0) (the clamp is |x - y|^2 >= 0), one
//                    MUFU.EX2, one FFMA with WT[j] into the row's tile sum (added to the total
//                    compensated);
//      kernel_lse:   e' = 2k s + YN[j], an online maximum per tile (reduced over the four lanes
//                    that share a row), one MUFU.EX2 and one FADD; the row's own
//                    XN[i] = -k |x_i - c|^2 is added once at the end.
//
// Fragments (PTX ISA, mma.m16n8k8 with .tf32; g = lane / 4, q = lane % 4): A (row-major 16 x 8)
// a0 = (g, q), a1 = (g + 8, q), a2 = (g, q + 4), a3 = (g + 8, q + 4); B (8 x 8, column-major:
// B[k][n] = y_n[k]) b0 = (q, g), b1 = (q + 4, g); C c0 = (g, 2q), c1 = (g, 2q + 1), c2 = (g + 8, 2q),
// c3 = (g + 8, 2q + 1).
//
// SPLIT: as the small-D split kernels, grid.y splits the Mp prepared points into parts of
// split_len (a multiple of KS_TC_TILE); the block writes each row's unscaled partial sum
// (rbf_mv, kde) or its (maximum, sum) in base 2 (kernel_lse) to part[blockIdx.y * N + i], merged
// by kernel_sum_combine or kernel_lse_combine.
//
// Arguments of every *_tc entry point: (const float* X, const float* C, const unsigned* YH,
// const unsigned* YL, const float* YN, const float* WT, float* out_or_part, long long N,
// long long Mp, int D, float k, float out_scale, long long split_len); out_scale is the KDE's
// normalisation, 2 / eps for kernel_lse_grad_tc (1 otherwise), split_len is ignored unsplit. Dynamic shared memory:
// (KS_TC_ROWS + 4 KS_TC_TILE) (Dp + 4) + 4 KS_TC_TILE floats (cuda.rs's tc_smem_bytes).

#define KS_TC_DMAX 128
#define KS_TC_ROWS 64
#define KS_TC_TILE 64
#define KS_TC_CENTER 256

#if !defined(KS_ONLY) || defined(KS_ENTRY_rbf_mv_tc) || defined(KS_ENTRY_kde_tc) ||         \
    defined(KS_ENTRY_kernel_lse_tc) || defined(KS_ENTRY_rbf_mv_split_tc) ||                    \
    defined(KS_ENTRY_kde_split_tc) || defined(KS_ENTRY_kernel_lse_split_tc) ||                 \
    defined(KS_ENTRY_kernel_lse_grad_tc)
#define KS_TC 1
#else
#define KS_TC 0
#endif

#if KS_TC
// The TF32 value nearest x (round to nearest, ties away), as the bits mma.sync takes.
__device__ __forceinline__ unsigned ks_tf32(float x) {
    unsigned r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}

// x = hi + lo (to ~22 bits), both TF32.
__device__ __forceinline__ void ks_split(float x, unsigned& hi, unsigned& lo) {
    hi = ks_tf32(x);
    lo = ks_tf32(x - __uint_as_float(hi));
}

// c += A B for one m16n8k8 TF32 tile (fragments as above).
__device__ __forceinline__ void ks_mma_tf32(float c[4], const unsigned a[4], unsigned b0,
                                            unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 16 bytes global -> shared, asynchronously (L2 only: the tile is read once per block).
__device__ __forceinline__ void ks_cp16(void* smem, const void* gmem) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(a), "l"(gmem));
}
__device__ __forceinline__ void ks_cp_commit() { asm volatile("cp.async.commit_group;"); }
template <int PENDING>
__device__ __forceinline__ void ks_cp_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(PENDING));
}

extern "C" __global__ void __launch_bounds__(KS_THREADS)
    kernel_sum_tc_center(const float* __restrict__ Y, long long M, int D, float* __restrict__ C) {
    const int Dp = (D + 7) & ~7;
    const long long cnt = M < KS_TC_CENTER ? M : KS_TC_CENTER;
    for (int a = threadIdx.x; a < Dp; a += KS_THREADS) {
        float s = 0.f;
        if (a < D)
            for (long long j = 0; j < cnt; ++j) s += Y[j * D + a];
        C[a] = a < D ? s / (float)cnt : 0.f;
    }
}

// OP: 0 rbf_mv (W = b, one column), 1 kde (W unused), 2 kernel_lse (W = g).
extern "C" __global__ void __launch_bounds__(KS_THREADS)
    kernel_sum_tc_prep(const float* __restrict__ Y, const float* __restrict__ W,
                       const float* __restrict__ C, long long M, long long Mp, int D, float k,
                       int op, unsigned* __restrict__ YH, unsigned* __restrict__ YL,
                       float* __restrict__ YN, float* __restrict__ WT) {
    const long long j = (long long)blockIdx.x * KS_THREADS + threadIdx.x;
    if (j >= Mp) return;
    const int Dp = (D + 7) & ~7;
    float n2 = 0.f;
    for (int a = 0; a < Dp; ++a) {
        const float v = (j < M && a < D) ? Y[j * D + a] - C[a] : 0.f;
        n2 = fmaf(v, v, n2);
        unsigned h, l;
        ks_split(v, h, l);
        YH[j * Dp + a] = h;
        YL[j * Dp + a] = l;
    }
    if (op == 2) {
        YN[j] = j < M ? fmaf(-k, n2, W[j] * KS_LOG2E) : KS_NEG_INF;
    } else {
        YN[j] = -k * n2;
    }
    WT[j] = j < M ? (op == 0 ? W[j] : 1.f) : 0.f;
}

// Copies prepared points [j0, j0 + KS_TC_TILE) into stage buffers (16-byte pieces).
__device__ __forceinline__ void ks_tc_load(unsigned* yh, unsigned* yl, float* yn, float* wt,
                                           const unsigned* __restrict__ YH,
                                           const unsigned* __restrict__ YL,
                                           const float* __restrict__ YN,
                                           const float* __restrict__ WT, long long j0, int Dp,
                                           int S) {
    const int per_row = Dp / 4;
    for (int e = threadIdx.x; e < KS_TC_TILE * per_row; e += KS_THREADS) {
        const int jj = e / per_row, a = 4 * (e - jj * per_row);
        ks_cp16(yh + jj * S + a, YH + (j0 + jj) * Dp + a);
        ks_cp16(yl + jj * S + a, YL + (j0 + jj) * Dp + a);
    }
    if (threadIdx.x < KS_TC_TILE / 4) {
        ks_cp16(yn + 4 * threadIdx.x, YN + j0 + 4 * threadIdx.x);
    } else if (threadIdx.x < KS_TC_TILE / 2) {
        const int o = 4 * (threadIdx.x - KS_TC_TILE / 4);
        ks_cp16(wt + o, WT + j0 + o);
    }
}

// GRAD (kernel_lse only, never SPLIT): also the gradient -(2/eps) (x_i - sum_j p_ij y_j), with
// sum_j p_ij (y_j - c) a second GEMM per tile on the same instructions: the tile's p (the C
// fragments of the distance GEMM, split into TF32 parts) times the tile's prepared Y. The
// points of each k-step are taken in the order 0, 2, 4, 6, 1, 3, 5, 7 (slot q is point 2q,
// slot q + 4 point 2q + 1), so a lane's C fragment (c0, c1, c2, c3) is its A fragment
// (a0, a2, a1, a3) as it stands, with no shuffle (the register reuse of FlashAttention-2), and
// B is read as b0 = (y_(2q) - c)[g], b1 = (y_(2q+1) - c)[g]: with the row stride 4 mod 8 words,
// 32 distinct banks again. Accumulators: 16 rows x Dp features per warp, Dp / 2 floats per
// thread (at most 64), rescaled with the sum when the maximum grows; out_scale carries 2 / eps.
//
// OP: 0 rbf_mv and kde (weights WT), 2 kernel_lse. part is a float* (OP 0) or float2* (OP 2)
// when SPLIT.
template <int OP, bool SPLIT, bool GRAD>
__device__ __forceinline__ void ks_tc(const float* __restrict__ X, const float* __restrict__ C,
                                      const unsigned* __restrict__ YH,
                                      const unsigned* __restrict__ YL,
                                      const float* __restrict__ YN,
                                      const float* __restrict__ WT, float* __restrict__ out,
                                      long long N, long long Mp, int D, float k, float out_scale,
                                      long long split_len) {
    extern __shared__ __align__(16) float ks_dyn[];
    __shared__ float xn[KS_TC_ROWS];  // -k |x_i - c|^2
    const int Dp = (D + 7) & ~7, S = Dp + 4;
    float* xs = ks_dyn;
    // Stage st: high parts [KS_TC_TILE][S], low parts, exponent terms [KS_TC_TILE], weights.
    unsigned* const stage0 = reinterpret_cast<unsigned*>(xs + KS_TC_ROWS * S);
    const int stage_words = 2 * KS_TC_TILE * S + 2 * KS_TC_TILE;
#define KS_TC_YH(st) (stage0 + (st) * stage_words)
#define KS_TC_YL(st) (KS_TC_YH(st) + KS_TC_TILE * S)
#define KS_TC_YN(st) reinterpret_cast<float*>(KS_TC_YH(st) + 2 * KS_TC_TILE * S)
#define KS_TC_WT(st) (KS_TC_YN(st) + KS_TC_TILE)
    const int t = threadIdx.x, warp = t >> 5, lane = t & 31, g = lane >> 2, q = lane & 3;
    const long long rb = (long long)blockIdx.x * KS_TC_ROWS;
    long long jb = 0, je = Mp;
    if (SPLIT) {
        jb = (long long)blockIdx.y * split_len;
        je = jb + split_len < Mp ? jb + split_len : Mp;
    }

    ks_tc_load(KS_TC_YH(0), KS_TC_YL(0), KS_TC_YN(0), KS_TC_WT(0), YH, YL, YN, WT, jb, Dp, S);
    ks_cp_commit();
    for (int e = t; e < KS_TC_ROWS * Dp; e += KS_THREADS) {
        const int r = e / Dp, a = e - r * Dp;
        const long long i = rb + r;
        xs[r * S + a] = (i < N && a < D) ? X[i * D + a] - C[a] : 0.f;
    }
    __syncthreads();
    if (t < KS_TC_ROWS) {
        float n2 = 0.f;
        for (int a = 0; a < Dp; ++a) n2 = fmaf(xs[t * S + a], xs[t * S + a], n2);
        xn[t] = -k * n2;
    }

    const float two_k = 2.f * k;
    const float* xw = xs + warp * 16 * S;
    // Rows g and g + 8 of the warp's 16: tile sums and their compensations (rbf_mv, kde), or
    // the running maximum and sum (kernel_lse; identical across the four lanes of a row).
    float acc0 = 0.f, acc1 = 0.f, cmp0 = 0.f, cmp1 = 0.f;
    float mx0 = KS_NEG_INF, mx1 = KS_NEG_INF;
    // GRAD: sum_j p_ij (y_j - c) for rows g (elements 0, 1) and g + 8 (2, 3), features
    // 8 f + 2q and 8 f + 2q + 1 of feature tile f < Dp / 8.
    constexpr int GT = GRAD ? KS_TC_DMAX / 8 : 1;
    float gacc[GT][4];
#pragma unroll
    for (int f = 0; f < GT; ++f) gacc[f][0] = gacc[f][1] = gacc[f][2] = gacc[f][3] = 0.f;

    int st = 0;
    for (long long j0 = jb; j0 < je; j0 += KS_TC_TILE, st ^= 1) {
        if (j0 + KS_TC_TILE < je) {
            // The other stage was consumed before the barrier that ended the last tile.
            ks_tc_load(KS_TC_YH(st ^ 1), KS_TC_YL(st ^ 1), KS_TC_YN(st ^ 1), KS_TC_WT(st ^ 1), YH,
                       YL, YN, WT, j0 + KS_TC_TILE, Dp, S);
            ks_cp_commit();
            ks_cp_wait<1>();
        } else {
            ks_cp_wait<0>();
        }
        __syncthreads();  // this tile's copies (and, first time, xs and xn) are visible
        const unsigned* bh = KS_TC_YH(st);
        const unsigned* bl = KS_TC_YL(st);

        float s[8][4];
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
        for (int kk = 0; kk < Dp; kk += 8) {
            unsigned ah[4], al[4];
            ks_split(xw[g * S + kk + q], ah[0], al[0]);
            ks_split(xw[(g + 8) * S + kk + q], ah[1], al[1]);
            ks_split(xw[g * S + kk + q + 4], ah[2], al[2]);
            ks_split(xw[(g + 8) * S + kk + q + 4], ah[3], al[3]);
#pragma unroll
            for (int nt = 0; nt < 8; ++nt) {
                const int o = (nt * 8 + g) * S + kk + q;
                const unsigned bh0 = bh[o], bh1 = bh[o + 4], bl0 = bl[o], bl1 = bl[o + 4];
                // The small terms first.
                ks_mma_tf32(s[nt], al, bh0, bh1);
                ks_mma_tf32(s[nt], ah, bl0, bl1);
                ks_mma_tf32(s[nt], ah, bh0, bh1);
            }
        }

        const float* ynt = KS_TC_YN(st);
        const float* wtt = KS_TC_WT(st);
        const float x0 = xn[warp * 16 + g], x1 = xn[warp * 16 + g + 8];
        if (OP == 0) {
            float ta0 = 0.f, ta1 = 0.f;
#pragma unroll
            for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int jj = nt * 8 + 2 * q + h;
                    const float yv = ynt[jj], w = wtt[jj];
                    const float e0 = fminf(fmaf(two_k, s[nt][h], yv) + x0, 0.f);
                    const float e1 = fminf(fmaf(two_k, s[nt][2 + h], yv) + x1, 0.f);
                    ta0 = fmaf(ks_ex2(e0), w, ta0);
                    ta1 = fmaf(ks_ex2(e1), w, ta1);
                }
            }
            ks_kahan_add(acc0, cmp0, ta0);
            ks_kahan_add(acc1, cmp1, ta1);
        } else {
            float cm0 = KS_NEG_INF, cm1 = KS_NEG_INF;
#pragma unroll
            for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const float yv = ynt[nt * 8 + 2 * q + h];
                    s[nt][h] = fmaf(two_k, s[nt][h], yv);
                    s[nt][2 + h] = fmaf(two_k, s[nt][2 + h], yv);
                    cm0 = fmaxf(cm0, s[nt][h]);
                    cm1 = fmaxf(cm1, s[nt][2 + h]);
                }
            }
#pragma unroll
            for (int o = 1; o <= 2; o <<= 1) {
                cm0 = fmaxf(cm0, __shfl_xor_sync(0xffffffffu, cm0, o));
                cm1 = fmaxf(cm1, __shfl_xor_sync(0xffffffffu, cm1, o));
            }
            if (cm0 > mx0) {
                const float f = ks_ex2(mx0 - cm0);
                acc0 *= f;
                cmp0 *= f;
                mx0 = cm0;
                if (GRAD) {
#pragma unroll
                    for (int ft = 0; ft < GT; ++ft) {
                        gacc[ft][0] *= f;
                        gacc[ft][1] *= f;
                    }
                }
            }
            if (cm1 > mx1) {
                const float f = ks_ex2(mx1 - cm1);
                acc1 *= f;
                cmp1 *= f;
                mx1 = cm1;
                if (GRAD) {
#pragma unroll
                    for (int ft = 0; ft < GT; ++ft) {
                        gacc[ft][2] *= f;
                        gacc[ft][3] *= f;
                    }
                }
            }
            const float ref0 = mx0 == KS_NEG_INF ? 0.f : mx0;
            const float ref1 = mx1 == KS_NEG_INF ? 0.f : mx1;
            float ts0 = 0.f, ts1 = 0.f;
#pragma unroll
            for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    s[nt][h] = ks_ex2(s[nt][h] - ref0);  // now p, unnormalised
                    s[nt][2 + h] = ks_ex2(s[nt][2 + h] - ref1);
                    ts0 += s[nt][h];
                    ts1 += s[nt][2 + h];
                }
            }
            ks_kahan_add(acc0, cmp0, ts0);
            ks_kahan_add(acc1, cmp1, ts1);
            if (GRAD) {
                // The tile's product goes into a zeroed fragment, added to the running total
                // by CUDA-core FADDs: the tensor cores' own accumulation over thousands of
                // tiles lost bits (relative error 4e-5 to 6.5e-5 at N = 10^5 in v5.3).
                unsigned ph[8][4], pl[8][4];
#pragma unroll
                for (int kt = 0; kt < 8; ++kt) {
                    ks_split(s[kt][0], ph[kt][0], pl[kt][0]);
                    ks_split(s[kt][2], ph[kt][1], pl[kt][1]);
                    ks_split(s[kt][1], ph[kt][2], pl[kt][2]);
                    ks_split(s[kt][3], ph[kt][3], pl[kt][3]);
                }
#pragma unroll
                for (int ft = 0; ft < GT; ++ft) {
                    if (8 * ft < Dp) {
                        float t4[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                        for (int kt = 0; kt < 8; ++kt) {
                            const int o = (kt * 8 + 2 * q) * S + g + 8 * ft;
                            const unsigned bh0 = bh[o], bh1 = bh[o + S], bl0 = bl[o],
                                           bl1 = bl[o + S];
                            ks_mma_tf32(t4, pl[kt], bh0, bh1);
                            ks_mma_tf32(t4, ph[kt], bl0, bl1);
                            ks_mma_tf32(t4, ph[kt], bh0, bh1);
                        }
#pragma unroll
                        for (int e = 0; e < 4; ++e) gacc[ft][e] += t4[e];
                    }
                }
            }
        }
        __syncthreads();  // this stage is consumed before the next iteration refills it
    }
#undef KS_TC_YH
#undef KS_TC_YL
#undef KS_TC_YN
#undef KS_TC_WT

    // The four lanes of a row hold a quarter of its columns each.
#pragma unroll
    for (int o = 1; o <= 2; o <<= 1) {
        acc0 += __shfl_xor_sync(0xffffffffu, acc0, o);
        acc1 += __shfl_xor_sync(0xffffffffu, acc1, o);
    }
    if (GRAD) {
        // Every lane holds its own features of rows g and g + 8; xs holds x - c.
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = warp * 16 + g + 8 * h;
            const long long i = rb + r;
            if (i >= N) continue;
            const float inv = 1.f / (h ? acc1 : acc0);
            float* grad = out + N + i * D;
#pragma unroll
            for (int ft = 0; ft < GT; ++ft) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int a = 8 * ft + 2 * q + e;
                    if (a < D)
                        grad[a] = -out_scale * (xs[r * S + a] - gacc[ft][2 * h + e] * inv);
                }
            }
        }
    }
    if (q != 0) return;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = warp * 16 + g + 8 * h;
        const long long i = rb + r;
        if (i >= N) continue;
        const float acc = h ? acc1 : acc0;
        if (OP == 2) {
            // The row's -k |x - c|^2, left out of the loop's exponents.
            const float m = (h ? mx1 : mx0) + xn[r];
            if (SPLIT)
                reinterpret_cast<float2*>(out)[(long long)blockIdx.y * N + i] =
                    make_float2(m, acc);
            else
                out[i] = (m + log2f(acc)) * KS_LN2;
        } else {
            if (SPLIT)
                out[(long long)blockIdx.y * N + i] = acc;
            else
                out[i] = acc * out_scale;
        }
    }
}
#endif

// ---------------------------------------------------------------------------------------------
// Entry points. Small D: rows per thread R = 2 (1 for 64 columns, whose accumulators fill the
// registers). Column tiles CT of rbf_mv: 1, 4, 16, 64 (the host takes the smallest >= C, and
// 64-column tiles past 64).
//
// Compiled as it is, the source defines every entry point (the NVRTC compile test does this).
// The host compiles one at a time (all of them take ~8 s of NVRTC and ptxas): it puts
// `#define KS_ONLY` and `#define KS_ENTRY_<name>` before the source, and only that entry point
// and the templates it instantiates are compiled.

#ifdef KS_ONLY
#define KS_ALL 0
#else
#define KS_ALL 1
#endif

#define KS_RBF_SMALL(D, CT, R)                                                                 \
    extern "C" __global__ void __launch_bounds__(KS_THREADS)                                  \
        rbf_mv_d##D##_c##CT(const float* X, const float* Y, const float* B, float* out,       \
                            long long N, long long M, int Dn, int C, float k) {                \
        rbf_small<D, CT, R, false, false>(X, Y, B, out, N, M, C, k, 1.f, nullptr, 0);         \
    }
#define KS_RBF_SPLIT_SMALL(D)                                                                  \
    extern "C" __global__ void __launch_bounds__(KS_THREADS)                                  \
        rbf_mv_split_d##D(const float* X, const float* Y, const float* B, float* part,        \
                          long long N, long long M, int Dn, int C, float k,                    \
                          long long split_len) {                                              \
        rbf_small<D, 1, 2, false, true>(X, Y, B, nullptr, N, M, C, k, 1.f, part, split_len);   \
    }
#define KS_KDE_SMALL(D)                                                                        \
    extern "C" __global__ void __launch_bounds__(KS_THREADS)                                  \
        kde_d##D(const float* X, const float* Y, float* out, long long N, long long M, int Dn, \
                 float k, float norm) {                                                        \
        rbf_small<D, 1, 2, true, false>(X, Y, nullptr, out, N, M, 1, k, norm, nullptr, 0);     \
    }
#define KS_KDE_SPLIT_SMALL(D)                                                                  \
    extern "C" __global__ void __launch_bounds__(KS_THREADS)                                  \
        kde_split_d##D(const float* X, const float* Y, float* part, long long N, long long M,  \
                       int Dn, float k, float norm, long long split_len) {                    \
        rbf_small<D, 1, 2, true, true>(X, Y, nullptr, nullptr, N, M, 1, k, 1.f, part,          \
                                       split_len);                                            \
    }
#define KS_LSE_SMALL(D)                                                                        \
    extern "C" __global__ void __launch_bounds__(KS_THREADS)                                  \
        kernel_lse_d##D(const float* X, const float* Y, const float* G, float* out,           \
                        long long N, long long M, int Dn, float k, float two_over_eps) {       \
        lse_small<D, 2, false, false>(X, Y, G, out, N, M, k, two_over_eps, nullptr, 0);        \
    }
#define KS_LSE_SPLIT_SMALL(D)                                                                  \
    extern "C" __global__ void __launch_bounds__(KS_THREADS)                                  \
        kernel_lse_split_d##D(const float* X, const float* Y, const float* G, float2* part,   \
                              long long N, long long M, int Dn, float k, float two_over_eps,   \
                              long long split_len) {                                          \
        lse_small<D, 2, false, true>(X, Y, G, nullptr, N, M, k, two_over_eps, part,           \
                                     split_len);                                              \
    }
#define KS_LSE_GRAD_SMALL(D)                                                                   \
    extern "C" __global__ void __launch_bounds__(KS_THREADS)                                  \
        kernel_lse_grad_d##D(const float* X, const float* Y, const float* G, float* out,      \
                             long long N, long long M, int Dn, float k, float two_over_eps) {  \
        lse_small<D, 2, true, false>(X, Y, G, out, N, M, k, two_over_eps, nullptr, 0);         \
    }
#define KS_RBF_DN(CT)                                                                          \
    extern "C" __global__ void __launch_bounds__(KS_THREADS)                                  \
        rbf_mv_dn_c##CT(const float* X, const float* Y, const float* B, float* out,           \
                        long long N, long long M, int D, int C, float k) {                     \
        rbf_dn<CT, false>(X, Y, B, out, N, M, D, C, k, 1.f);                                   \
    }

#if KS_ALL || defined(KS_ENTRY_rbf_mv_d1_c1)
KS_RBF_SMALL(1, 1, 2)
#endif
#if KS_ALL || defined(KS_ENTRY_rbf_mv_d1_c4)
KS_RBF_SMALL(1, 4, 2)
#endif
#if KS_ALL || defined(KS_ENTRY_rbf_mv_d1_c16)
KS_RBF_SMALL(1, 16, 2)
#endif
#if KS_ALL || defined(KS_ENTRY_rbf_mv_d1_c64)
KS_RBF_SMALL(1, 64, 1)
#endif
#if KS_ALL || defined(KS_ENTRY_rbf_mv_d2_c1)
KS_RBF_SMALL(2, 1, 2)
#endif
#if KS_ALL || defined(KS_ENTRY_rbf_mv_d2_c4)
KS_RBF_SMALL(2, 4, 2)
#endif
#if KS_ALL || defined(KS_ENTRY_rbf_mv_d2_c16)
KS_RBF_SMALL(2, 16, 2)
#endif
#if KS_ALL || defined(KS_ENTRY_rbf_mv_d2_c64)
KS_RBF_SMALL(2, 64, 1)
#endif
#if KS_ALL || defined(KS_ENTRY_rbf_mv_d3_c1)
KS_RBF_SMALL(3, 1, 2)
#endif
#if KS_ALL || defined(KS_ENTRY_rbf_mv_d3_c4)
KS_RBF_SMALL(3, 4, 2)
#endif
#if KS_ALL || defined(KS_ENTRY_rbf_mv_d3_c16)
KS_RBF_SMALL(3, 16, 2)
#endif
#if KS_ALL || defined(KS_ENTRY_rbf_mv_d3_c64)
KS_RBF_SMALL(3, 64, 1)
#endif
#if KS_ALL || defined(KS_ENTRY_kde_d1)
KS_KDE_SMALL(1)
#endif
#if KS_ALL || defined(KS_ENTRY_kde_d2)
KS_KDE_SMALL(2)
#endif
#if KS_ALL || defined(KS_ENTRY_kde_d3)
KS_KDE_SMALL(3)
#endif
#if KS_ALL || defined(KS_ENTRY_kernel_lse_d1)
KS_LSE_SMALL(1)
#endif
#if KS_ALL || defined(KS_ENTRY_kernel_lse_grad_d1)
KS_LSE_GRAD_SMALL(1)
#endif
#if KS_ALL || defined(KS_ENTRY_kernel_lse_d2)
KS_LSE_SMALL(2)
#endif
#if KS_ALL || defined(KS_ENTRY_kernel_lse_grad_d2)
KS_LSE_GRAD_SMALL(2)
#endif
#if KS_ALL || defined(KS_ENTRY_kernel_lse_d3)
KS_LSE_SMALL(3)
#endif
#if KS_ALL || defined(KS_ENTRY_kernel_lse_grad_d3)
KS_LSE_GRAD_SMALL(3)
#endif
#if KS_ALL || defined(KS_ENTRY_kernel_lse_split_d1)
KS_LSE_SPLIT_SMALL(1)
#endif
#if KS_ALL || defined(KS_ENTRY_kernel_lse_split_d2)
KS_LSE_SPLIT_SMALL(2)
#endif
#if KS_ALL || defined(KS_ENTRY_kernel_lse_split_d3)
KS_LSE_SPLIT_SMALL(3)
#endif
// Merges the `splits` partials (reference m_k, sum s_k in units of 2^m_k; base 2) of each row
// that kernel_lse_split_d* wrote: out[i] = (m + log2(sum_k s_k 2^(m_k - m))) ln 2 with m =
// max_k m_k, and -inf when every m_k is (as the unsplit kernel gives). m_k is the part's
// running maximum (its lazy step may leave it below the part's largest term, with s_k up to
// 2^8 per chunk), and nothing here needs it to be the true maximum. One thread per row; grid.x =
// ceil(N / KS_THREADS). Compiled with each split entry point (the host launches the pair).
#if KS_ALL || defined(KS_ENTRY_kernel_lse_split_d1) || defined(KS_ENTRY_kernel_lse_split_d2) || \
    defined(KS_ENTRY_kernel_lse_split_d3) || defined(KS_ENTRY_kernel_lse_split_tc)
extern "C" __global__ void __launch_bounds__(KS_THREADS)
    kernel_lse_combine(const float2* __restrict__ part, float* __restrict__ out, long long N,
                       int splits) {
    const long long i = (long long)blockIdx.x * KS_THREADS + threadIdx.x;
    if (i >= N) return;
    float m = KS_NEG_INF;
    for (int q = 0; q < splits; ++q) m = fmaxf(m, part[(long long)q * N + i].x);
    // As in the main loop: a row with no finite term adds 2^(-inf - 0) = 0 and ends at
    // -inf + log2(0) = -inf; a NaN sum stays NaN. The parts are added compensated.
    const float ref = m == KS_NEG_INF ? 0.f : m;
    float sum = 0.f, sum_c = 0.f;
    for (int q = 0; q < splits; ++q) {
        const float2 p = part[(long long)q * N + i];
        ks_kahan_add(sum, sum_c, p.y * ks_ex2(p.x - ref));
    }
    out[i] = (m + log2f(sum)) * KS_LN2;
}
#endif
#if KS_ALL || defined(KS_ENTRY_rbf_mv_split_d1)
KS_RBF_SPLIT_SMALL(1)
#endif
#if KS_ALL || defined(KS_ENTRY_rbf_mv_split_d2)
KS_RBF_SPLIT_SMALL(2)
#endif
#if KS_ALL || defined(KS_ENTRY_rbf_mv_split_d3)
KS_RBF_SPLIT_SMALL(3)
#endif
#if KS_ALL || defined(KS_ENTRY_kde_split_d1)
KS_KDE_SPLIT_SMALL(1)
#endif
#if KS_ALL || defined(KS_ENTRY_kde_split_d2)
KS_KDE_SPLIT_SMALL(2)
#endif
#if KS_ALL || defined(KS_ENTRY_kde_split_d3)
KS_KDE_SPLIT_SMALL(3)
#endif
// Adds the `splits` partial sums of each row that rbf_mv_split_d* and kde_split_d* wrote
// (compensated, in split order) and scales the total: out[i] = scale * sum_q part[q * N + i]
// (scale 1 for rbf_mv, the KDE's normalisation for kde). One thread per row; grid.x =
// ceil(N / KS_THREADS). Compiled with each of those entry points (the host launches the pair).
#if KS_ALL || defined(KS_ENTRY_rbf_mv_split_d1) || defined(KS_ENTRY_rbf_mv_split_d2) ||       \
    defined(KS_ENTRY_rbf_mv_split_d3) || defined(KS_ENTRY_kde_split_d1) ||                    \
    defined(KS_ENTRY_kde_split_d2) || defined(KS_ENTRY_kde_split_d3) ||                      \
    defined(KS_ENTRY_rbf_mv_split_tc) || defined(KS_ENTRY_kde_split_tc)
extern "C" __global__ void __launch_bounds__(KS_THREADS)
    kernel_sum_combine(const float* __restrict__ part, float* __restrict__ out, long long N,
                       int splits, float scale) {
    const long long i = (long long)blockIdx.x * KS_THREADS + threadIdx.x;
    if (i >= N) return;
    float sum = 0.f, sum_c = 0.f;
    for (int q = 0; q < splits; ++q) ks_kahan_add(sum, sum_c, part[(long long)q * N + i]);
    out[i] = sum * scale;
}
#endif
#if KS_ALL || defined(KS_ENTRY_rbf_mv_dn_c1)
KS_RBF_DN(1)
#endif
#if KS_ALL || defined(KS_ENTRY_rbf_mv_dn_c4)
KS_RBF_DN(4)
#endif
#if KS_ALL || defined(KS_ENTRY_rbf_mv_dn_c16)
KS_RBF_DN(16)
#endif
#if KS_ALL || defined(KS_ENTRY_rbf_mv_dn_c64)
KS_RBF_DN(64)
#endif
#if KS_ALL || defined(KS_ENTRY_kde_dn)
extern "C" __global__ void __launch_bounds__(KS_THREADS)
    kde_dn(const float* X, const float* Y, float* out, long long N, long long M, int D, float k,
           float norm) {
    rbf_dn<1, true>(X, Y, nullptr, out, N, M, D, 1, k, norm);
}
#endif
#if KS_ALL || defined(KS_ENTRY_kernel_lse_dn)
extern "C" __global__ void __launch_bounds__(KS_THREADS)
    kernel_lse_dn(const float* X, const float* Y, const float* G, float* out, long long N,
                  long long M, int D, float k, float two_over_eps) {
    lse_dn<false>(X, Y, G, out, N, M, D, k, two_over_eps);
}
#endif
#if KS_ALL || defined(KS_ENTRY_kernel_lse_grad_dn)
extern "C" __global__ void __launch_bounds__(KS_THREADS)
    kernel_lse_grad_dn(const float* X, const float* Y, const float* G, float* out, long long N,
                       long long M, int D, float k, float two_over_eps) {
    lse_dn<true>(X, Y, G, out, N, M, D, k, two_over_eps);
}
#endif
// The tensor-core feature path (ks_tc): the prepared points of kernel_sum_tc_prep.
#define KS_TC_ENTRY(NAME, OP, SPLIT, GRAD)                                                     \
    extern "C" __global__ void __launch_bounds__(KS_THREADS)                                  \
        NAME(const float* X, const float* C, const unsigned* YH, const unsigned* YL,           \
             const float* YN, const float* WT, float* out, long long N, long long Mp, int D,   \
             float k, float out_scale, long long split_len) {                                  \
        ks_tc<OP, SPLIT, GRAD>(X, C, YH, YL, YN, WT, out, N, Mp, D, k, out_scale, split_len);  \
    }
#if KS_ALL || defined(KS_ENTRY_rbf_mv_tc)
KS_TC_ENTRY(rbf_mv_tc, 0, false, false)
#endif
#if KS_ALL || defined(KS_ENTRY_kde_tc)
KS_TC_ENTRY(kde_tc, 0, false, false)
#endif
#if KS_ALL || defined(KS_ENTRY_kernel_lse_tc)
KS_TC_ENTRY(kernel_lse_tc, 2, false, false)
#endif
#if KS_ALL || defined(KS_ENTRY_rbf_mv_split_tc)
KS_TC_ENTRY(rbf_mv_split_tc, 0, true, false)
#endif
#if KS_ALL || defined(KS_ENTRY_kde_split_tc)
KS_TC_ENTRY(kde_split_tc, 0, true, false)
#endif
#if KS_ALL || defined(KS_ENTRY_kernel_lse_split_tc)
KS_TC_ENTRY(kernel_lse_split_tc, 2, true, false)
#endif
#if KS_ALL || defined(KS_ENTRY_kernel_lse_grad_tc)
KS_TC_ENTRY(kernel_lse_grad_tc, 2, false, true)
#endif
