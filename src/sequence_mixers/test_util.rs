//! Helpers the sequence-mixer unit tests share.

use rand::{Rng, SeedableRng};

/// `n` values drawn uniformly from [lo, hi) by a generator seeded with `seed`.
pub(crate) fn uniform(n: usize, lo: f64, hi: f64, seed: u64) -> Vec<f64> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(lo..hi)).collect()
}

/// The largest |a − b| over the largest |b| (a zero `b` divides by 1e-300: any difference
/// fails).
pub(crate) fn max_rel(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0.0f64, |m, x| m.max(x.abs())).max(1e-300);
    max_abs(a, b) / scale
}

/// As [`max_rel`], but an all-zero `b` gives the absolute difference.
pub(crate) fn max_rel_or_abs(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0.0f64, |m, x| m.max(x.abs()));
    max_abs(a, b) / if scale > 0.0 { scale } else { 1.0 }
}

fn max_abs(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .fold(0.0f64, |m, (x, y)| m.max((x - y).abs()))
}
