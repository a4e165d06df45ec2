//! The grouped GEMM on the CPU (`cpu_grouped`): float32 products of the bf16 operands
//! (decoded to float32 once, when the inputs are loaded), float32 results, through the `gemm`
//! crate on blocks of 64 output rows spread over rayon's threads. Layouts are
//! [`super::reference::grouped_matmul`]'s: x `[M, K]` in expert order, w `[E, K, N]`,
//! `offsets` `[E + 1]`; the backward's dX `[M, K]` = dY · wᵀ per group and dW `[E, K, N]` =
//! xᵀ · dY per group (zero for an empty expert).

use rayon::prelude::*;

use crate::attention::cpu_flash::{matmul, Mat};

/// Output rows per task (a block of C's rows, one `gemm` call on one thread).
pub const BLOCK_ROWS: usize = 64;

/// Checks the lengths against the offsets (M = `offsets[E]`).
///
/// # Panics
/// When a length does not fit the shape (the caller's bug).
fn check(x: usize, w: usize, offsets: &[usize], k: usize, n: usize) -> (usize, usize) {
    let e = offsets.len().saturating_sub(1);
    let m = offsets.last().copied().unwrap_or(0);
    assert!(
        offsets.windows(2).all(|p| p[0] <= p[1]) && offsets.first() == Some(&0),
        "offsets must rise from 0"
    );
    assert_eq!(x, m * k, "x is [M, K]");
    assert_eq!(w, e * k * n, "w is [E, K, N]");
    (e, m)
}

/// `out`, a `[rows, width]` row-major buffer, split at the group boundaries of `offsets`:
/// expert e's rows.
fn by_group<'a>(mut out: &'a mut [f32], offsets: &[usize], width: usize) -> Vec<&'a mut [f32]> {
    let mut parts = Vec::with_capacity(offsets.len().saturating_sub(1));
    for p in offsets.windows(2) {
        let (head, tail) = std::mem::take(&mut out).split_at_mut((p[1] - p[0]) * width);
        parts.push(head);
        out = tail;
    }
    parts
}

/// y `[M, N]` = x · w\[e\] for each group's rows.
///
/// # Panics
/// When a length does not fit the shape.
pub fn grouped_matmul_f32(
    x: &[f32],
    w: &[f32],
    offsets: &[usize],
    k: usize,
    n: usize,
    y: &mut [f32],
) {
    let (_, m) = check(x.len(), w.len(), offsets, k, n);
    assert_eq!(y.len(), m * n, "y is [M, N]");
    by_group(y, offsets, n)
        .into_par_iter()
        .enumerate()
        .for_each(|(e, ye)| {
            let we = &w[e * k * n..(e + 1) * k * n];
            ye.par_chunks_mut(BLOCK_ROWS * n)
                .enumerate()
                .for_each(|(b, yb)| {
                    let r0 = offsets[e] + b * BLOCK_ROWS;
                    let rows = yb.len() / n;
                    let xb = &x[r0 * k..(r0 + rows) * k];
                    matmul(
                        rows,
                        n,
                        k,
                        yb,
                        false,
                        Mat::row_major(xb, k),
                        Mat::row_major(we, n),
                    );
                });
        });
}

/// The backward of [`grouped_matmul_f32`] from dY `[M, N]`: dX `[M, K]` = dY · w\[e\]ᵀ and
/// dW `[E, K, N]` = x_eᵀ · dY_e (zeros for an empty group).
///
/// # Panics
/// When a length does not fit the shape.
#[allow(clippy::too_many_arguments)]
pub fn grouped_matmul_backward_f32(
    x: &[f32],
    w: &[f32],
    dy: &[f32],
    offsets: &[usize],
    k: usize,
    n: usize,
    dx: &mut [f32],
    dw: &mut [f32],
) {
    let (e_count, m) = check(x.len(), w.len(), offsets, k, n);
    assert_eq!(dy.len(), m * n, "dY is [M, N]");
    assert_eq!(dx.len(), m * k, "dX is [M, K]");
    assert_eq!(dw.len(), e_count * k * n, "dW is [E, K, N]");
    by_group(dx, offsets, k)
        .into_par_iter()
        .enumerate()
        .for_each(|(e, dxe)| {
            let we = &w[e * k * n..(e + 1) * k * n];
            dxe.par_chunks_mut(BLOCK_ROWS * k)
                .enumerate()
                .for_each(|(b, dxb)| {
                    let r0 = offsets[e] + b * BLOCK_ROWS;
                    let rows = dxb.len() / k;
                    // wᵀ: element (j, i) of the N × K view is w[i][j].
                    let wt = Mat {
                        data: we,
                        rs: 1,
                        cs: n,
                    };
                    let dyb = &dy[r0 * n..(r0 + rows) * n];
                    matmul(rows, k, n, dxb, false, Mat::row_major(dyb, n), wt);
                });
        });
    dw.par_chunks_mut(k * n).enumerate().for_each(|(e, dwe)| {
        let (r0, rows) = (offsets[e], offsets[e + 1] - offsets[e]);
        dwe.par_chunks_mut(BLOCK_ROWS * n)
            .enumerate()
            .for_each(|(b, dwb)| {
                if rows == 0 {
                    dwb.fill(0.0);
                    return;
                }
                let i0 = b * BLOCK_ROWS;
                let ks = dwb.len() / n;
                // x_eᵀ's rows i0.. : element (i, r) of the view is x[r0 + r][i0 + i].
                let xt = Mat {
                    data: &x[r0 * k + i0..(r0 + rows - 1) * k + i0 + ks],
                    rs: 1,
                    cs: k,
                };
                let dye = &dy[r0 * n..(r0 + rows) * n];
                matmul(ks, n, rows, dwb, false, xt, Mat::row_major(dye, n));
            });
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::moe::reference::{grouped_matmul, grouped_matmul_backward, offsets_of};

    fn values(n: usize, seed: u64) -> Vec<f32> {
        (0..n)
            .map(|i| (((i as u64 * 2654435761 + seed * 97) % 1000) as f32 / 500.0) - 1.0)
            .collect()
    }

    #[test]
    fn matches_the_float64_reference_with_empty_groups() {
        for (counts, k, n) in [
            (vec![5, 0, 0, 3, 0, 1, 0, 7], 24, 40),
            (vec![0, 0], 8, 8),
            (vec![130, 0, 70], 16, 72),
        ] {
            let e = counts.len();
            let offsets = offsets_of(&counts);
            let m = offsets[e];
            let (x, w, dy) = (values(m * k, 1), values(e * k * n, 2), values(m * n, 3));
            let mut y = vec![f32::NAN; m * n];
            grouped_matmul_f32(&x, &w, &offsets, k, n, &mut y);
            let (mut dx, mut dw) = (vec![f32::NAN; m * k], vec![f32::NAN; e * k * n]);
            grouped_matmul_backward_f32(&x, &w, &dy, &offsets, k, n, &mut dx, &mut dw);
            let f = |v: &[f32]| v.iter().map(|&a| a as f64).collect::<Vec<f64>>();
            let y_ref = grouped_matmul(&f(&x), &f(&w), &offsets, k, n).unwrap();
            let (dx_ref, dw_ref) =
                grouped_matmul_backward(&f(&x), &f(&w), &offsets, &f(&dy), k, n).unwrap();
            for (got, want, what) in [
                (&y, &y_ref, "y"),
                (&dx, &dx_ref, "dX"),
                (&dw, &dw_ref, "dW"),
            ] {
                for (g, r) in got.iter().zip(want.iter()) {
                    assert!(
                        (*g as f64 - r).abs() <= 1e-4 * (1.0 + r.abs()),
                        "{what} {counts:?}: {g} vs {r}"
                    );
                }
            }
        }
    }
}
