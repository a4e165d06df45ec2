//! The grouped GEMM's forward on x86-64 CPUs with AVX-512 BF16 (`vdpbf16ps`): bf16 operands
//! multiplied as they are, float32 accumulation and results, the layouts of
//! [`super::cpu::grouped_matmul_f32`] (x `[M, K]` in expert order, `offsets` `[E + 1]`, y
//! `[M, N]`).
//!
//! `vdpbf16ps` adds to each float32 lane i the products of the bf16 pairs (2i, 2i + 1) of its two
//! operands, so the reduction dimension K is taken two at a time: A's pair (x\[r\]\[k\],
//! x\[r\]\[k + 1\]) is one 32-bit broadcast, and B is packed once (weights are parameters: see
//! [`PackedWeights`]) into panels of [`NR`] columns whose k-pair row holds, for each column j,
//! (w\[k\]\[j\], w\[k + 1\]\[j\]): 64 bytes of B per 16 columns per k-pair, one load. The micro-kernel
//! keeps an [`MR`] × [`NR`] tile of C in 16 of the 32 zmm registers (the BLIS register-blocking
//! scheme: Van Zee and van de Geijn, "BLIS: A Framework for Rapidly Instantiating BLAS
//! Functionality", ACM TOMS 41(3), 2015). K must be even (every grid shape's is); the caller
//! falls back to the float32 path otherwise or where the CPU lacks the instructions
//! ([`available`]).

use rayon::prelude::*;

/// Rows of C per micro-kernel tile.
pub const MR: usize = 8;
/// Columns of C per micro-kernel tile (two zmm registers of 16 float32 lanes).
pub const NR: usize = 32;
/// Output rows per task (a block of one expert's rows on one thread).
pub const BLOCK_ROWS: usize = 64;

/// True when this CPU runs the AVX-512 BF16 path (`avx512f` and `avx512bf16`, detected at run
/// time); always false off x86-64.
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// True when the grouped GEMM of hidden size `k` and expert width `n` runs here on bf16
/// operands: [`available`], and K and N even (the pairs of the forward's and dX's reductions).
pub fn runs(k: usize, n: usize) -> bool {
    available() && k.is_multiple_of(2) && n.is_multiple_of(2)
}

/// Every expert's weights w `[E, K, N]` (bf16 bits) repacked for the micro-kernel: per expert,
/// ⌈N / NR⌉ panels, each `[K / 2][NR][2]` (column j's pair (w\[k\]\[j\], w\[k + 1\]\[j\]) at
/// `[k / 2][j][0..2]`), columns past N zero. Built once when the weights are loaded, as a
/// library packs parameters; 2·E·K·⌈N / NR⌉·NR bytes.
pub struct PackedWeights {
    data: Vec<u16>,
    experts: usize,
    k: usize,
    n: usize,
}

impl PackedWeights {
    /// Packs `w` `[E, K, N]` (bf16 bits).
    ///
    /// # Panics
    /// When K is odd or `w` does not hold E·K·N values.
    pub fn new(w: &[u16], experts: usize, k: usize, n: usize) -> PackedWeights {
        assert!(
            k.is_multiple_of(2),
            "K = {k} must be even for the bf16 pairs"
        );
        assert_eq!(w.len(), experts * k * n, "w is [E, K, N]");
        let per_expert = packed_len(k, n);
        let mut data = vec![0u16; experts * per_expert];
        data.par_chunks_mut(per_expert)
            .enumerate()
            .for_each(|(e, pe)| pack_panels(&w[e * k * n..(e + 1) * k * n], k, n, n, pe));
        PackedWeights {
            data,
            experts,
            k,
            n,
        }
    }

    /// Every expert's transpose, wᵀ `[E, N, K]`, packed (the B operand of dX = dY · wᵀ).
    ///
    /// # Panics
    /// When N is odd or `w` does not hold E·K·N values.
    pub fn transposed(w: &[u16], experts: usize, k: usize, n: usize) -> PackedWeights {
        assert_eq!(w.len(), experts * k * n, "w is [E, K, N]");
        let mut wt = vec![0u16; w.len()];
        wt.par_chunks_mut(k * n).enumerate().for_each(|(e, te)| {
            let we = &w[e * k * n..(e + 1) * k * n];
            for i in 0..k {
                for j in 0..n {
                    te[j * k + i] = we[i * n + j];
                }
            }
        });
        PackedWeights::new(&wt, experts, n, k)
    }

    /// Expert e's panels.
    fn expert(&self, e: usize) -> &[u16] {
        let per_expert = packed_len(self.k, self.n);
        &self.data[e * per_expert..(e + 1) * per_expert]
    }

    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        2 * self.data.len() as u64
    }
}

/// Length (bf16 values) of B `[red, n]` packed by [`pack_panels`]: ⌈n / NR⌉ panels of
/// ⌈red / 2⌉ pairs of NR columns.
fn packed_len(red: usize, n: usize) -> usize {
    n.div_ceil(NR) * red.div_ceil(2) * 2 * NR
}

/// Packs B `[red, n]` (bf16 bits, rows `ld` apart) into `out` ([`packed_len`] values, zeroed
/// here where B has no element: columns past n, the second of an odd last pair).
fn pack_panels(b: &[u16], red: usize, n: usize, ld: usize, out: &mut [u16]) {
    let pairs = red.div_ceil(2);
    for (p, panel) in out.chunks_mut(pairs * 2 * NR).enumerate() {
        let j0 = p * NR;
        let cols = NR.min(n - j0);
        for kp in 0..pairs {
            let row = &mut panel[kp * 2 * NR..(kp + 1) * 2 * NR];
            row.fill(0);
            for j in 0..cols {
                row[2 * j] = b[2 * kp * ld + j0 + j];
                if 2 * kp + 1 < red {
                    row[2 * j + 1] = b[(2 * kp + 1) * ld + j0 + j];
                }
            }
        }
    }
}

/// C `[m, n]` (rows `ldc` apart) = A `[m, red]` · B, A's rows `red` bf16 values apart (red
/// even), B packed by [`pack_panels`]; one thread.
fn matmul_packed(a: &[u16], m: usize, red: usize, b: &[u16], n: usize, c: &mut [f32], ldc: usize) {
    debug_assert!(red.is_multiple_of(2) && a.len() >= m * red && b.len() >= packed_len(red, n));
    let per_panel = red * NR;
    for p in 0..n.div_ceil(NR) {
        let panel = &b[p * per_panel..(p + 1) * per_panel];
        let cols = NR.min(n - p * NR);
        for i0 in (0..m).step_by(MR) {
            let mr = MR.min(m - i0);
            // SAFETY: the callers check `available()`; the tile reads rows i0..i0 + mr of A
            // (red values each), the panel's red / 2 pairs of NR columns, and writes rows
            // i0..i0 + mr, columns p·NR..p·NR + cols of C (row stride ldc).
            #[cfg(target_arch = "x86_64")]
            unsafe {
                tile(
                    &a[i0 * red..(i0 + mr) * red],
                    mr,
                    red,
                    panel,
                    &mut c[i0 * ldc + p * NR..],
                    ldc,
                    cols,
                )
            };
        }
    }
}

/// The (expert, first row, rows) blocks of at most [`BLOCK_ROWS`] of each group's rows, and
/// `out` (`[M, width]`) split to match.
#[allow(clippy::type_complexity)]
fn row_blocks<'a>(
    offsets: &[usize],
    out: &'a mut [f32],
    width: usize,
) -> Vec<(usize, usize, usize, &'a mut [f32])> {
    let mut rest = out;
    let mut parts = Vec::new();
    for e in 0..offsets.len().saturating_sub(1) {
        let mut r = offsets[e];
        while r < offsets[e + 1] {
            let rows = BLOCK_ROWS.min(offsets[e + 1] - r);
            let (head, tail) = std::mem::take(&mut rest).split_at_mut(rows * width);
            parts.push((e, r, rows, head));
            rest = tail;
            r += rows;
        }
    }
    parts
}

fn check_offsets(offsets: &[usize], experts: usize) -> usize {
    assert_eq!(offsets.len(), experts + 1, "offsets has E + 1 entries");
    assert!(
        offsets.windows(2).all(|p| p[0] <= p[1]) && offsets.first() == Some(&0),
        "offsets must rise from 0"
    );
    offsets[experts]
}

/// y `[M, N]` = x · w\[e\] for each group's rows (x bf16 bits `[M, K]`, float32 results), with
/// AVX-512 BF16.
///
/// # Panics
/// When the CPU lacks the instructions ([`available`]) or a length does not fit the shape.
pub fn grouped_matmul_bf16(x: &[u16], w: &PackedWeights, offsets: &[usize], y: &mut [f32]) {
    assert!(available(), "this CPU has no AVX-512 BF16");
    let (k, n) = (w.k, w.n);
    let m = check_offsets(offsets, w.experts);
    assert_eq!(x.len(), m * k, "x is [M, K]");
    assert_eq!(y.len(), m * n, "y is [M, N]");
    row_blocks(offsets, y, n)
        .into_par_iter()
        .for_each(|(e, r0, rows, yb)| {
            matmul_packed(&x[r0 * k..(r0 + rows) * k], rows, k, w.expert(e), n, yb, n)
        });
}

/// The backward of [`grouped_matmul_bf16`] from dY `[M, N]` (bf16 bits): dX `[M, K]` = dY ·
/// w\[e\]ᵀ with `wt` = [`PackedWeights::transposed`], and dW `[E, K, N]` = x_eᵀ · dY_e (zeros
/// for an empty group), x_eᵀ and dY_e packed in every call (their pairs run along the group's
/// rows, padded to an even count with zeros); float32 results.
///
/// # Panics
/// When the CPU lacks the instructions or a length does not fit the shape.
pub fn grouped_matmul_backward_bf16(
    x: &[u16],
    wt: &PackedWeights,
    dy: &[u16],
    offsets: &[usize],
    dx: &mut [f32],
    dw: &mut [f32],
) {
    assert!(available(), "this CPU has no AVX-512 BF16");
    // wt packs [E, N, K]: its "k" is N and its "n" is K.
    let (n, k) = (wt.k, wt.n);
    let m = check_offsets(offsets, wt.experts);
    assert_eq!(x.len(), m * k, "x is [M, K]");
    assert_eq!(dy.len(), m * n, "dY is [M, N]");
    assert_eq!(dx.len(), m * k, "dX is [M, K]");
    assert_eq!(dw.len(), wt.experts * k * n, "dW is [E, K, N]");
    row_blocks(offsets, dx, k)
        .into_par_iter()
        .for_each(|(e, r0, rows, dxb)| {
            matmul_packed(
                &dy[r0 * n..(r0 + rows) * n],
                rows,
                n,
                wt.expert(e),
                k,
                dxb,
                k,
            )
        });
    dw.par_chunks_mut(k * n).enumerate().for_each(|(e, dwe)| {
        let (r0, rows) = (offsets[e], offsets[e + 1] - offsets[e]);
        if rows == 0 {
            dwe.fill(0.0);
            return;
        }
        let red = rows + rows % 2;
        // x_eᵀ `[K, red]`: row i is feature i over the group's rows (a zero past them).
        let mut xt = vec![0u16; k * red];
        for r in 0..rows {
            for (i, v) in x[(r0 + r) * k..(r0 + r + 1) * k].iter().enumerate() {
                xt[i * red + r] = *v;
            }
        }
        let mut b = vec![0u16; packed_len(red, n)];
        pack_panels(&dy[r0 * n..(r0 + rows) * n], rows, n, n, &mut b);
        dwe.par_chunks_mut(BLOCK_ROWS * n)
            .enumerate()
            .for_each(|(blk, c)| {
                let i0 = blk * BLOCK_ROWS;
                let ks = c.len() / n;
                matmul_packed(&xt[i0 * red..(i0 + ks) * red], ks, red, &b, n, c, n);
            });
    });
}

/// One MR × NR tile: C\[0..mr\]\[0..cols\] = A\[0..mr\] · panel, A's rows `k` bf16 values apart,
/// C's `ldc` floats apart. Rows past `mr` repeat the last row (computed, never stored).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn tile(
    a: &[u16],
    mr: usize,
    k: usize,
    panel: &[u16],
    c: &mut [f32],
    ldc: usize,
    cols: usize,
) {
    use std::arch::x86_64::*;
    debug_assert!((1..=MR).contains(&mr) && a.len() >= mr * k && panel.len() >= k * NR);
    let mut acc = [[_mm512_setzero_ps(); 2]; MR];
    // Row r's pairs as 32-bit words (a row is K / 2 of them: K is even, rows 4-byte aligned
    // relative to the slice start only, so read unaligned).
    let rows: [*const u32; MR] =
        std::array::from_fn(|r| a.as_ptr().add(r.min(mr - 1) * k) as *const u32);
    let b = panel.as_ptr();
    for kp in 0..k / 2 {
        let b0: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.add(kp * 2 * NR) as *const _));
        let b1: __m512bh =
            std::mem::transmute(_mm512_loadu_si512(b.add(kp * 2 * NR + NR) as *const _));
        for r in 0..MR {
            let pair = rows[r].add(kp).read_unaligned();
            let av: __m512bh = std::mem::transmute(_mm512_set1_epi32(pair as i32));
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], av, b0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], av, b1);
        }
    }
    for (r, row) in acc.iter().enumerate().take(mr) {
        let out = c.as_mut_ptr().add(r * ldc);
        for (v, reg) in row.iter().enumerate() {
            let start = v * 16;
            if start >= cols {
                break;
            }
            let lanes = (cols - start).min(16);
            let mask: __mmask16 = if lanes == 16 {
                0xFFFF
            } else {
                (1u16 << lanes) - 1
            };
            _mm512_mask_storeu_ps(out.add(start), mask, *reg);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::moe::reference::{grouped_matmul, grouped_matmul_backward, offsets_of};

    fn bf16_values(n: usize, seed: u64) -> Vec<u16> {
        (0..n)
            .map(|i| {
                let v = (((i as u64 * 2654435761 + seed * 97) % 1000) as f32 / 500.0) - 1.0;
                half::bf16::from_f32(v).to_bits()
            })
            .collect()
    }

    /// The forward and the backward against the float64 products of the same bf16 values, with
    /// empty groups, row counts off the tile (odd ones among them: 1, 3, 5, 9, 65), column counts
    /// off the panel (40, 72, 6, 34, and 24: the second register's masked store): every element
    /// of y, dX and dW within float32 rounding. Runs only where the CPU has AVX-512 BF16 (it says so
    /// otherwise).
    #[test]
    fn matches_the_float64_reference_with_empty_groups() {
        if !available() {
            eprintln!("skipped: this CPU has no AVX-512 BF16 (the float32 path runs instead)");
            return;
        }
        for (counts, k, n) in [
            (vec![5, 0, 0, 3, 0, 1, 0, 7], 24, 40),
            (vec![0, 0], 8, 8),
            (vec![130, 0, 70], 16, 72),
            (vec![9, 1], 64, 6),
            (vec![3, 0, 65], 130, 34),
            (vec![4, 5], 16, 24),
        ] {
            let e = counts.len();
            let offsets = offsets_of(&counts);
            let m = offsets[e];
            let (x, w) = (bf16_values(m * k, 1), bf16_values(e * k * n, 2));
            let packed = PackedWeights::new(&w, e, k, n);
            let mut y = vec![f32::NAN; m * n];
            grouped_matmul_bf16(&x, &packed, &offsets, &mut y);
            let f = |v: &[u16]| -> Vec<f64> {
                v.iter()
                    .map(|&b| half::bf16::from_bits(b).to_f64())
                    .collect()
            };
            let want = grouped_matmul(&f(&x), &f(&w), &offsets, k, n).unwrap();
            let dy = bf16_values(m * n, 3);
            let (mut dx, mut dw) = (vec![f32::NAN; m * k], vec![f32::NAN; e * k * n]);
            let wt = PackedWeights::transposed(&w, e, k, n);
            grouped_matmul_backward_bf16(&x, &wt, &dy, &offsets, &mut dx, &mut dw);
            let (dx_ref, dw_ref) =
                grouped_matmul_backward(&f(&x), &f(&w), &offsets, &f(&dy), k, n).unwrap();
            for (got, want, what) in [(&y, &want, "y"), (&dx, &dx_ref, "dX"), (&dw, &dw_ref, "dW")]
            {
                for (i, (g, r)) in got.iter().zip(want.iter()).enumerate() {
                    assert!(
                        (*g as f64 - r).abs() <= 1e-5 * (1.0 + r.abs()),
                        "{what} {counts:?} k {k} n {n} element {i}: {g} vs {r}"
                    );
                }
            }
        }
    }
}
