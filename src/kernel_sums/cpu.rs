//! Kernel sums on the CPU in float32, on every core, never holding the N × M kernel matrix.
//!
//! The rows of X are split into blocks of [`BLOCK_ROWS`] (one rayon task each); a task walks
//! Y in blocks of [`BLOCK_COLS`] points, computes the tile of squared distances (directly for
//! D < [`GEMM_DIM`]; as ‖x‖² + ‖y‖² − 2 x·y with the cross term a matrix product through the
//! `gemm` crate otherwise), turns it into kernel values with a vectorised base-2 exponential
//! (the one `cpu_flash` uses, relative error below 2e-7), and reduces it at once:
//! - `rbf_mv`: out_blk += K_tile · b_blk (a matrix product, C columns);
//! - `kde`: the row sums of K_tile, normalised at the end;
//! - `kernel_lse`: a running row maximum and rescaled sum (the online log-sum-exp of
//!   FlashAttention), and for the gradient a running Σ p·y (P_tile · Y_blk, a matrix product).
//!
//! Memory beyond inputs and output: per task one tile (BLOCK_ROWS × BLOCK_COLS) and, for the
//! matrix-product paths, the block's norms and accumulators ([`temporary_bytes`]).

use rayon::prelude::*;

use super::{Inputs, KernelSumCase, Op, Scale};
use crate::attention::cpu_flash::{matmul, simd, Mat};

/// Rows of X per task.
pub const BLOCK_ROWS: usize = 64;
/// Points of Y per tile.
pub const BLOCK_COLS: usize = 256;
/// From this dimension on, the cross term x·y of the squared distance is a matrix product.
pub const GEMM_DIM: usize = 8;

const LOG2E: f32 = std::f32::consts::LOG2_E;

/// Bytes of temporaries one call allocates beyond inputs and output, for `threads` tasks in
/// flight.
pub fn temporary_bytes(c: &KernelSumCase, threads: usize) -> u64 {
    let tile = BLOCK_ROWS * BLOCK_COLS;
    let norms = BLOCK_ROWS + BLOCK_COLS * GEMM_DIM;
    let acc = match c.op {
        Op::RbfMv => BLOCK_ROWS * c.cols,
        Op::Kde => BLOCK_ROWS,
        Op::KernelLse => 2 * BLOCK_ROWS + if c.grad { BLOCK_ROWS * c.dim } else { 0 },
    };
    ((tile + norms + acc) * 4 * threads) as u64
}

/// Squared distances of the rows of `xb` (`r × d`) to the rows of `yb` (`cols × d`) into
/// `t` (`r × cols`, row-major); `xn` (≥ r) and `yn` (≥ BLOCK_COLS · GEMM_DIM) are scratch.
fn sq_dists(xb: &[f32], yb: &[f32], d: usize, t: &mut [f32], xn: &mut [f32], yn: &mut [f32]) {
    let (r, cols) = (xb.len() / d, yb.len() / d);
    if d < GEMM_DIM {
        // Y's tile transposed (one row per axis, `yn` as scratch: cols ≤ BLOCK_COLS, d < 8
        // rows), so that each axis adds (x_a − y_a)² to a whole row of `t` at once, a loop
        // the compiler vectorises.
        let yt = &mut yn[..d * cols];
        for j in 0..cols {
            for a in 0..d {
                yt[a * cols + j] = yb[j * d + a];
            }
        }
        for i in 0..r {
            let row = &mut t[i * cols..(i + 1) * cols];
            row.fill(0.0);
            for a in 0..d {
                let xa = xb[i * d + a];
                for (o, y) in row.iter_mut().zip(&yt[a * cols..(a + 1) * cols]) {
                    let v = xa - y;
                    *o += v * v;
                }
            }
        }
        return;
    }
    let norm = |v: &[f32]| v.iter().map(|a| a * a).sum::<f32>();
    for (i, n) in xn[..r].iter_mut().enumerate() {
        *n = norm(&xb[i * d..(i + 1) * d]);
    }
    for (j, n) in yn[..cols].iter_mut().enumerate() {
        *n = norm(&yb[j * d..(j + 1) * d]);
    }
    // t = X_blk · Y_blkᵀ: Y_blkᵀ is the d × cols view of Y_blk with element (p, j) at j·d + p.
    matmul(
        r,
        cols,
        d,
        t,
        false,
        Mat::row_major(xb, d),
        Mat {
            data: yb,
            rs: 1,
            cs: d,
        },
    );
    for i in 0..r {
        for j in 0..cols {
            let v = &mut t[i * cols + j];
            *v = (xn[i] + yn[j] - 2.0 * *v).max(0.0);
        }
    }
}

/// Computes case `c` on `inp` with `s` into `out` (laid out as
/// [`KernelSumCase::output_len`]: N·C values for `rbf_mv`, N for `kde` and `kernel_lse`, then
/// the N × D gradient when the case has it).
///
/// # Panics
/// When a slice does not have the case's length (a bug in the caller).
pub fn compute(c: &KernelSumCase, inp: &Inputs, s: Scale, out: &mut [f32]) {
    let (n, m, d) = (c.n, c.m, c.dim);
    assert_eq!(inp.x.len(), n * d, "x");
    assert_eq!(inp.y.len(), m * d, "y");
    assert_eq!(out.len(), c.output_len(), "out");
    match c.op {
        Op::RbfMv => {
            assert_eq!(inp.w.len(), m * c.cols, "b");
            let k = LOG2E / (2.0 * (s.sigma * s.sigma) as f32);
            out.par_chunks_mut(BLOCK_ROWS * c.cols)
                .enumerate()
                .for_each(|(bi, ob)| {
                    let r0 = bi * BLOCK_ROWS;
                    let r = ob.len() / c.cols;
                    let xb = &inp.x[r0 * d..(r0 + r) * d];
                    let mut t = vec![0.0f32; r * BLOCK_COLS];
                    let (mut xn, mut yn) = (vec![0.0f32; r], vec![0.0f32; BLOCK_COLS * GEMM_DIM]);
                    ob.fill(0.0);
                    for j0 in (0..m).step_by(BLOCK_COLS) {
                        let cols = BLOCK_COLS.min(m - j0);
                        let t = &mut t[..r * cols];
                        sq_dists(xb, &inp.y[j0 * d..(j0 + cols) * d], d, t, &mut xn, &mut yn);
                        simd::scale(t, -k);
                        for row in t.chunks_exact_mut(cols) {
                            simd::exp2_shifted(row, 0.0);
                        }
                        matmul(
                            r,
                            c.cols,
                            cols,
                            ob,
                            true,
                            Mat::row_major(t, cols),
                            Mat::row_major(&inp.w[j0 * c.cols..(j0 + cols) * c.cols], c.cols),
                        );
                    }
                });
        }
        Op::Kde => {
            let k = LOG2E / (2.0 * (s.sigma * s.sigma) as f32);
            let norm = ((2.0 * std::f64::consts::PI * s.sigma * s.sigma).powf(-(d as f64) / 2.0)
                / m as f64) as f32;
            out.par_chunks_mut(BLOCK_ROWS)
                .enumerate()
                .for_each(|(bi, ob)| {
                    let r0 = bi * BLOCK_ROWS;
                    let r = ob.len();
                    let xb = &inp.x[r0 * d..(r0 + r) * d];
                    let mut t = vec![0.0f32; r * BLOCK_COLS];
                    let (mut xn, mut yn) = (vec![0.0f32; r], vec![0.0f32; BLOCK_COLS * GEMM_DIM]);
                    ob.fill(0.0);
                    for j0 in (0..m).step_by(BLOCK_COLS) {
                        let cols = BLOCK_COLS.min(m - j0);
                        let t = &mut t[..r * cols];
                        sq_dists(xb, &inp.y[j0 * d..(j0 + cols) * d], d, t, &mut xn, &mut yn);
                        simd::scale(t, -k);
                        for (o, row) in ob.iter_mut().zip(t.chunks_exact_mut(cols)) {
                            *o += simd::exp2_shifted(row, 0.0);
                        }
                    }
                    simd::scale(ob, norm);
                });
        }
        Op::KernelLse => {
            assert_eq!(inp.w.len(), m, "g");
            let (lse, grad) = out.split_at_mut(n);
            let grads: Vec<&mut [f32]> = if c.grad {
                grad.chunks_mut(BLOCK_ROWS * d).collect()
            } else {
                Vec::new()
            };
            let mut grads: Vec<Option<&mut [f32]>> = grads.into_iter().map(Some).collect();
            grads.resize_with(n.div_ceil(BLOCK_ROWS), || None);
            lse.par_chunks_mut(BLOCK_ROWS)
                .zip(grads.into_par_iter())
                .enumerate()
                .for_each(|(bi, (lb, gb))| {
                    lse_block(
                        &inp.x,
                        &inp.y,
                        &inp.w,
                        d,
                        s.epsilon,
                        bi * BLOCK_ROWS,
                        lb,
                        gb,
                    );
                });
        }
    }
}

/// The kernel log-sum-exp alone, out\[i\] = log Σ_j exp(−‖x_i − y_j‖² / ε + g_j) for X
/// `[N, dim]`, Y `[M, dim]`, g `[M]`, out `[N]` (what Sinkhorn iterates): [`compute`]'s
/// `kernel_lse` without building a case. A row whose every g_j is −∞ gets −∞.
///
/// # Panics
/// When the lengths disagree (a bug in the caller).
pub fn kernel_lse(x: &[f32], y: &[f32], g: &[f32], dim: usize, epsilon: f64, out: &mut [f32]) {
    assert_eq!(x.len(), out.len() * dim, "x");
    assert_eq!(y.len(), g.len() * dim, "y");
    out.par_chunks_mut(BLOCK_ROWS)
        .enumerate()
        .for_each(|(bi, lb)| lse_block(x, y, g, dim, epsilon, bi * BLOCK_ROWS, lb, None));
}

/// The log-sum-exp (and gradient) of rows r0..r0 + lb.len().
#[allow(clippy::too_many_arguments)]
fn lse_block(
    x: &[f32],
    y: &[f32],
    g: &[f32],
    d: usize,
    epsilon: f64,
    r0: usize,
    lb: &mut [f32],
    gb: Option<&mut [f32]>,
) {
    let m = g.len();
    let r = lb.len();
    let xb = &x[r0 * d..(r0 + r) * d];
    let k = LOG2E / epsilon as f32;
    let mut t = vec![0.0f32; r * BLOCK_COLS];
    let (mut xn, mut yn) = (vec![0.0f32; r], vec![0.0f32; BLOCK_COLS * GEMM_DIM]);
    let mut mx = vec![f32::NEG_INFINITY; r];
    let mut sum = vec![0.0f32; r];
    let mut acc = vec![0.0f32; if gb.is_some() { r * d } else { 0 }];
    for j0 in (0..m).step_by(BLOCK_COLS) {
        let cols = BLOCK_COLS.min(m - j0);
        let t = &mut t[..r * cols];
        let yb = &y[j0 * d..(j0 + cols) * d];
        sq_dists(xb, yb, d, t, &mut xn, &mut yn);
        // Base-2 exponents: (−d²/ε + g_j) · log2(e).
        let g = &g[j0..j0 + cols];
        for (i, row) in t.chunks_exact_mut(cols).enumerate() {
            for (v, gj) in row.iter_mut().zip(g) {
                *v = *gj * LOG2E - *v * k;
            }
            let tile_max = simd::max(row);
            if tile_max == f32::NEG_INFINITY {
                row.fill(0.0);
                continue;
            }
            let new = mx[i].max(tile_max);
            if new > mx[i] {
                let f = (mx[i] - new).exp2();
                sum[i] *= f;
                if !acc.is_empty() {
                    simd::scale(&mut acc[i * d..(i + 1) * d], f);
                }
                mx[i] = new;
            }
            sum[i] += simd::exp2_shifted(row, mx[i]);
        }
        if !acc.is_empty() {
            matmul(
                r,
                d,
                cols,
                &mut acc,
                true,
                Mat::row_major(t, cols),
                Mat::row_major(yb, d),
            );
        }
    }
    for i in 0..r {
        lb[i] = (mx[i] + sum[i].log2()) * std::f32::consts::LN_2;
    }
    if let Some(gb) = gb {
        let two_over_eps = 2.0 / epsilon as f32;
        for i in 0..r {
            for a in 0..d {
                gb[i * d + a] = -two_over_eps * (xb[i * d + a] - acc[i * d + a] / sum[i]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::reference;
    use super::*;
    use crate::attention::rel_l2;

    fn check(c: &KernelSumCase, tol: f64) -> f64 {
        let inp = Inputs::random(c, 7);
        let s = Scale::of(c, &inp);
        let mut out = vec![f32::NAN; c.output_len()];
        compute(c, &inp, s, &mut out);
        let want = reference(c, &inp, s);
        let got: Vec<f64> = out.iter().map(|&v| v as f64).collect();
        assert!(
            got.iter().all(|v| v.is_finite()),
            "{c:?}: non-finite output"
        );
        let e = if c.grad {
            let n = c.n;
            rel_l2(&got[..n], &want[..n]).max(rel_l2(&got[n..], &want[n..]))
        } else {
            rel_l2(&got, &want)
        };
        assert!(e <= tol, "{c:?}: error {e}");
        e
    }

    /// Sizes that are not multiples of either block, dimensions on both sides of GEMM_DIM;
    /// the bar for float32, 1e-5 relative to float64.
    #[test]
    fn every_op_matches_float64_at_odd_sizes() {
        for (n, m) in [(1, 1), (7, 1025), (1025, 7), (130, 300)] {
            for dim in [1, 3, 16, 64] {
                check(
                    &KernelSumCase {
                        cols: 3,
                        ..KernelSumCase::new(Op::RbfMv, n, m, dim)
                    },
                    1e-5,
                );
                // Scott's bandwidth shrinks with few points: at m = 7, dim = 64 the exponents
                // reach ~70, where a float32 squared distance (relative error ~1e-7) alone
                // moves the density by ~1e-5 whatever the order of the sums.
                if dim <= 16 {
                    check(&KernelSumCase::new(Op::Kde, n, m, dim), 1e-5);
                }
                check(&KernelSumCase::new(Op::KernelLse, n, m, dim), 1e-5);
                check(
                    &KernelSumCase {
                        grad: true,
                        ..KernelSumCase::new(Op::KernelLse, n, m, dim)
                    },
                    1e-5,
                );
            }
        }
    }

    /// Weights spread over ±1e4: the running maximum keeps every row finite and exact to
    /// 1e-6 relative (a direct exp would overflow).
    #[test]
    fn log_sum_exp_survives_a_wide_spread() {
        let c = KernelSumCase::new(Op::KernelLse, 300, 700, 3);
        let mut inp = Inputs::random(&c, 3);
        for (j, g) in inp.w.iter_mut().enumerate() {
            *g = if j % 2 == 0 { 1e4 } else { -1e4 } * (j as f32 / 700.0);
        }
        let s = Scale::of(&c, &inp);
        let mut out = vec![f32::NAN; c.output_len()];
        compute(&c, &inp, s, &mut out);
        let want = reference(&c, &inp, s);
        for (g, w) in out.iter().zip(&want) {
            assert!(g.is_finite());
            assert!(((*g as f64 - w) / w).abs() < 1e-6, "{g} vs {w}");
        }
    }
}
