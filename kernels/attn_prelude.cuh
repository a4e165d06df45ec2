// Helpers shared by the attention kernels (flash forward and backward): 16-bit packing, the
// tensor-core matrix product mma.sync m16n8k16 (sm_80+), ldmatrix, cp.async with zero fill,
// and tile loads with row bounds. The host prepends this file to each kernel source
// (src/attention/cuda.rs), so NVRTC needs no include path: 16-bit values are moved as raw bits
// and converted with PTX cvt instructions.

typedef unsigned short u16;
typedef unsigned int u32;

#define NEG_INF __int_as_float(0xff800000)
#define POS_INF __int_as_float(0x7f800000)
#define LN2 0.6931471805599453f

__device__ __forceinline__ u32 smem_u32(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}

// Packs two fp32 values as a pair of 16-bit values (round to nearest), `lo` in the low half.
template <bool BF16>
__device__ __forceinline__ u32 pack2(float lo, float hi) {
    u32 d;
    if (BF16) {
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    } else {
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    }
    return d;
}

// The last kernel of the flash backwards (portable, flex and wgmma): dQ = scale * dQacc (fp32,
// n elements) rounded to the 16-bit dtype, two elements per thread.
template <bool BF16>
__device__ __forceinline__ void bwd_dq_convert(const float* __restrict__ dQacc, u16* __restrict__ dQ,
                                               size_t n, float scale) {
    const size_t i = 2 * ((size_t)blockIdx.x * blockDim.x + threadIdx.x);
    if (i + 1 < n) {
        const float2 x = *reinterpret_cast<const float2*>(dQacc + i);
        *reinterpret_cast<u32*>(dQ + i) = pack2<BF16>(x.x * scale, x.y * scale);
    } else if (i < n) {
        dQ[i] = (u16)(pack2<BF16>(dQacc[i] * scale, 0.f) & 0xffff);
    }
}

// The 16-bit value `x` (bf16 or fp16 bits) as fp32.
template <bool BF16>
__device__ __forceinline__ float to_f32(u16 x) {
    if (BF16) {
        return __uint_as_float(((u32)x) << 16);
    } else {
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
        return f;
    }
}

// c += a * b for one 16x8x16 tile: a row-major 16x16, b column-major 16x8, c fp32 16x8.
template <bool BF16>
__device__ __forceinline__ void mma16816(float* c, const u32* a, u32 b0, u32 b1) {
    if (BF16) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
            "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
            "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

__device__ __forceinline__ void ldmatrix_x4(u32* r, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(u32* r, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// Byte offset of element (r, c) of a tile (c a multiple of 8: the start of its 16-byte chunk)
// stored as TMA's 128-byte-swizzled panels of 64 columns and ROWS rows: panel c / 64 at byte
// (c / 64) * ROWS * 128, row r of it at r * 128, chunk j of the row at chunk j ^ (r % 8) (the
// tile's base 1024-byte aligned, as the swizzle requires). ldmatrix's 8 row addresses of one
// column chunk then fall in 8 distinct bank groups without padding.
template <int ROWS>
__device__ __forceinline__ u32 sw128_offset(int r, int c) {
    return (u32)((c >> 6) * (ROWS * 128) + r * 128 + ((((c & 63) >> 3) ^ (r & 7)) << 4));
}

// O += P V over one 16-key step (the k16 of mma.m16n8k16), for each of MT 16-row tiles: P of
// row tile mt is the S accumulator of its 8-key column tiles 2 kc and 2 kc + 1, s[mt][2 kc]
// and s[mt][2 kc + 1], whose C layout packed to 16 bits is the A fragment; the 16 V rows are
// rows row0 .. row0 + 15 of the tile `v` and come by ldmatrix.trans, each V fragment serving
// every row tile. The tile's rows are padded to STR elements (STR > 0) or, with STR = -R, it
// is TMA's 128-byte-swizzled panels of R rows (sw128_offset<R>). o[mt][dt] is output column
// tile dt (DT = D / 8, even).
template <int MT, int NTILES, int DT, int STR, bool BF16>
__device__ __forceinline__ void pv_step(float (&o)[MT][DT][4], const float (&s)[MT][NTILES][4],
                                        int kc, const u16* v, int row0, int lane) {
    u32 pa[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        pa[mt][0] = pack2<BF16>(s[mt][2 * kc][0], s[mt][2 * kc][1]);
        pa[mt][1] = pack2<BF16>(s[mt][2 * kc][2], s[mt][2 * kc][3]);
        pa[mt][2] = pack2<BF16>(s[mt][2 * kc + 1][0], s[mt][2 * kc + 1][1]);
        pa[mt][3] = pack2<BF16>(s[mt][2 * kc + 1][2], s[mt][2 * kc + 1][3]);
    }
#pragma unroll
    for (int dt = 0; dt < DT; dt += 2) {
        u32 vb[4];
        if constexpr (STR > 0) {
            const u16* p = v + (row0 + (lane & 15)) * STR + dt * 8 + (lane >> 4) * 8;
            ldmatrix_x4_trans(vb, smem_u32(p));
        } else {
            ldmatrix_x4_trans(vb, smem_u32(v) + sw128_offset<-STR>(row0 + (lane & 15),
                                                                   dt * 8 + (lane >> 4) * 8));
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            mma16816<BF16>(o[mt][dt], pa[mt], vb[0], vb[1]);
            mma16816<BF16>(o[mt][dt + 1], pa[mt], vb[2], vb[3]);
        }
    }
}

// 16-byte asynchronous copy global -> shared; with `valid` false the 16 shared bytes are
// zero-filled and nothing is read (src-size 0; `g` must still be a valid address).
__device__ __forceinline__ void cp_async16(u32 saddr, const void* g, bool valid) {
    const int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(saddr), "l"(g), "r"(n));
}
// 16-byte asynchronous copy global -> shared of a row known to be in bounds (no src-size
// operand: the fast path's full tiles).
__device__ __forceinline__ void cp_async16_full(u32 saddr, const void* g) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(saddr), "l"(g));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// S = Q K^T for one key tile, for the warp's MT 16-row groups starting at row `row0` of the Q
// tile `q` (row stride STR elements) against the K tile `k` (row stride STR): s[mt][nt] is the
// accumulator of rows 16 mt .. 16 mt + 15 and keys 8 nt .. 8 nt + 7 (KC = D / 16 k-steps, even),
// fragments by ldmatrix, each K fragment serving every row group. Column blocks with
// nt * 8 >= n_cols are skipped (a partial last tile). The products add to s: the caller zeroes it.
template <int MT, int NT, int KC, int STR, bool BF16>
__device__ __forceinline__ void qk_tile(float (&s)[MT][NT][4], const u16* q, const u16* k,
                                        int row0, int n_cols, int lane) {
#pragma unroll
    for (int kc = 0; kc < KC; kc += 2) {
        u32 qf[MT][2][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            const u16* p = q + (row0 + mt * 16 + (lane & 15)) * STR + kc * 16 + (lane >> 4) * 8;
            ldmatrix_x4(qf[mt][0], smem_u32(p));
            ldmatrix_x4(qf[mt][1], smem_u32(p + 16));
        }
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            if (nt * 8 < n_cols) {
                u32 kb[4];
                const u16* p = k + (nt * 8 + (lane & 7)) * STR + kc * 16 + (lane >> 3) * 8;
                ldmatrix_x4(kb, smem_u32(p));
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma16816<BF16>(s[mt][nt], qf[mt][0], kb[0], kb[1]);
                    mma16816<BF16>(s[mt][nt], qf[mt][1], kb[2], kb[3]);
                }
            }
        }
    }
}

// The online-softmax step (Milakov and Gimelshein, 2018; FlashAttention-2's form) of row group
// mt over one tile of scores already in the log2 domain and masked (-inf): per row, over the
// quad that holds it, the new running max m, alpha = 2^(m_old - m), s -> p = 2^(s - m), l =
// l * alpha + sum p, and the output accumulator o scaled by alpha. GUARD: a row that has seen
// no key yet (m = -inf) subtracts 0 instead (-inf - -inf would be NaN); without it every row
// must see a key in its first tile.
template <int MT, int NT, int DT, bool GUARD>
__device__ __forceinline__ void online_softmax_rows(float (&s)[MT][NT][4],
                                                    float (&m_run)[MT][2],
                                                    float (&l_run)[MT][2],
                                                    float (&o)[MT][DT][4], int mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float mx = NEG_INF;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
            mx = fmaxf(mx, fmaxf(s[mt][nt][2 * r], s[mt][nt][2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
        const float m_new = fmaxf(m_run[mt][r], mx);
        const float m_use = GUARD && m_new == NEG_INF ? 0.f : m_new;
        const float alpha = fast_exp2(m_run[mt][r] - m_use);
        m_run[mt][r] = m_new;
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const float p0 = fast_exp2(s[mt][nt][2 * r] - m_use);
            const float p1 = fast_exp2(s[mt][nt][2 * r + 1] - m_use);
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

// The sum of `x` over the quad of lanes 4g .. 4g + 3 (one accumulator row's partial sums).
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffff, x, 1);
    return x + __shfl_xor_sync(0xffffffff, x, 2);
}

// A row's natural log-sum-exp from its running maximum `m` (log2 domain, scaled scores) and
// its sum `l` over the whole quad: (m + log2 l) ln 2, or +inf for a row that saw no key (l = 0).
__device__ __forceinline__ float row_lse(float m, float l) {
    return l > 0.f ? (m + log2f(l)) * LN2 : POS_INF;
}

// The end of a forward tile: the quad's row sums, O = o / l as 16-bit words (rows of the warp
// starting at `row0` below `rows`, row stride D = 8 DT elements, from `o_out`; g = lane / 4 and
// t4 = lane % 4 place the thread's fragment elements) and the natural
// log-sum-exp (m + log2 l) ln 2 into `lse_out` (+inf and O = 0 for a row that saw no key).
template <int MT, int DT, bool BF16>
__device__ __forceinline__ void store_rows(const float (&o)[MT][DT][4],
                                           const float (&m_run)[MT][2],
                                           const float (&l_run)[MT][2], u16* o_out,
                                           float* lse_out, int row0, int rows, int g, int t4) {
    constexpr int D = 8 * DT;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float l = quad_sum(l_run[mt][r]);
            const float inv = l > 0.f ? 1.f / l : 0.f;
            const int row = row0 + mt * 16 + g + r * 8;
            if (row < rows) {
#pragma unroll
                for (int dt = 0; dt < DT; ++dt) {
                    u32 v = pack2<BF16>(o[mt][dt][2 * r] * inv, o[mt][dt][2 * r + 1] * inv);
                    *reinterpret_cast<u32*>(o_out + (size_t)row * D + dt * 8 + 2 * t4) = v;
                }
                if (t4 == 0) lse_out[row] = row_lse(m_run[mt][r], l);
            }
        }
    }
}

// Copies rows [0, ROWS) of a tile from global (row stride D elements, starting at `g`) to
// shared (row stride D + 8) with 16-byte cp.async; rows >= `valid_rows` are zero-filled (and
// read nothing). The 8-element pad keeps ldmatrix's 8 row addresses in distinct bank groups.
template <int ROWS, int D, int NTHREADS>
__device__ __forceinline__ void load_tile(u16* s, const u16* g, int valid_rows, int tid) {
    constexpr int STR = D + 8;
    constexpr int CHUNKS = ROWS * D / 8;
#pragma unroll
    for (int i = tid; i < CHUNKS; i += NTHREADS) {
        const int r = i / (D / 8);
        const int c = (i % (D / 8)) * 8;
        const bool ok = r < valid_rows;
        cp_async16(smem_u32(s + r * STR + c), ok ? g + (size_t)r * D + c : g, ok);
    }
}

// Hopper (sm_90) building blocks: TMA tensor copies completing on mbarriers. Device functions
// are emitted only where a kernel calls them, so the sm_80 kernels compile past them; the
// wgmma kernels (attn_wgmma_sm90.cu), the grouped GEMM and the decoding kernel's TMA build
// (flash_decode.cu) use them.

// A CUtensorMap (cuTensorMapEncodeTiled's 128-byte opaque object), passed by value as a
// __grid_constant__ kernel parameter so that TMA can read it from parameter space.
struct __align__(64) TmaMap {
    unsigned long long w[16];
};

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// The producer's arrival that also announces `bytes` of TMA transactions for this phase.
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Waits until the phase with parity `parity` of the barrier has completed.
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    u32 done;
    do {
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
            "selp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    } while (!done);
}
// A 3-D box of shared memory at `src` (laid out as tma_load_3d leaves it) into the tensor map
// `map`'s tensor at element coordinates (c0, c1, c2), innermost first (TMA writes no element
// past the tensor's end), in the issuing thread's bulk async-group; then that group's commit and
// the wait until every committed group has been read out of shared memory (the writes to global
// memory may still be in flight; they complete before the kernel does).
__device__ __forceinline__ void tma_store_3d(const TmaMap* map, u32 src, int c0, int c1, int c2) {
    asm volatile(
        "cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];\n" ::"l"(
            reinterpret_cast<unsigned long long>(map)),
        "r"(src), "r"(c0), "r"(c1), "r"(c2)
        : "memory");
}
__device__ __forceinline__ void bulk_commit_and_wait_read() {
    asm volatile("cp.async.bulk.commit_group;\ncp.async.bulk.wait_group.read 0;\n" ::: "memory");
}
// A 3-D tile (box) of the tensor map `map` at element coordinates (c0, c1, c2), innermost
// first, into shared memory at `dst`; its bytes count towards barrier `bar`'s transactions.
__device__ __forceinline__ void tma_load_3d(u32 dst, const TmaMap* map, u32 bar, int c0, int c1,
                                            int c2) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
        "[%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
        "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
        : "memory");
}
