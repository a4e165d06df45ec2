//! One grouped-GEMM case as the runner protocol's files ([`crate::runner::protocol::CaseFiles`]):
//! x `[M, K]`, w `[E, K, N]` and, for the backward, dY `[M, N]` as raw bf16 files, the float64
//! reference values of the checked elements of Y (and of dX and dW), and the call's arguments
//! (the group counts and offsets), so that the project's kernels and the comparison modules
//! read the same bits and are checked against the same values.
//!
//! Inputs are uniform in [−1, 1) before rounding to bf16 (which can reach ±1), drawn by a counter-based generator
//! (SplitMix64 of the seed and the element's index), so that any slice of a multi-gigabyte
//! tensor is generated in parallel with the same bits as serially.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::Result;
use rayon::prelude::*;
use serde_json::json;

use super::case::GroupedCase;
use super::reference::offsets_of;
use crate::runner::protocol::{
    write_u16, CaseFiles, CheckSpec, GradientSpec, OutputSpec, TensorFile,
};

/// Largest accepted relative L2 error of a bf16 grouped GEMM against float64 (bf16 rounding
/// of the result is 2⁻⁹ relative on average).
pub const TOLERANCE: f64 = 1e-2;

/// Columns of dW checked per checked (expert, k) row, half the first ones and half the last
/// ones (every column when N is smaller): slices, since each element is a sum over the
/// expert's rows, at both ends so that the first and the last column tiles are checked.
pub const DW_COLUMNS: usize = 256;

/// (k) rows of dW checked per expert.
pub const DW_ROWS: usize = 4;

/// SplitMix64's output for `z` (Steele, Lea and Flood, "Fast splittable pseudorandom number
/// generators", 2014).
pub(crate) fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// `n` bf16 bits of values uniform in [−1, 1) (24 random bits each), rounded to nearest even
/// (so ±1 can occur), the
/// i-th from SplitMix64 of (`seed`, i).
pub fn uniform_bf16(n: usize, seed: u64) -> Vec<u16> {
    let base = splitmix64(seed);
    let mut out = vec![0u16; n];
    out.par_chunks_mut(1 << 16)
        .enumerate()
        .for_each(|(c, chunk)| {
            for (j, o) in chunk.iter_mut().enumerate() {
                let i = (c << 16) + j;
                let r = splitmix64(base ^ (i as u64).wrapping_mul(0xD1B5_4A32_D192_ED03));
                let u = (r >> 40) as f32 / (1u64 << 24) as f32; // [0, 1)
                *o = half::bf16::from_f32(2.0 * u - 1.0).to_bits();
            }
        });
    out
}

/// The value of bf16 bits.
pub(crate) fn val(b: u16) -> f64 {
    f64::from(f32::from_bits(u32::from(b) << 16))
}

/// The rows of Y (and dX) checked against float64: `check_rows` evenly spaced over all M rows
/// (every row when M ≤ `check_rows`) and the first and last row of every non-empty group,
/// sorted, each once.
pub fn checked_rows(offsets: &[usize], check_rows: usize) -> Vec<usize> {
    let m = offsets.last().copied().unwrap_or(0);
    let mut rows: Vec<usize> = if m <= check_rows {
        (0..m).collect()
    } else if check_rows < 2 {
        vec![0]
    } else {
        (0..check_rows)
            .map(|i| i * (m - 1) / (check_rows - 1))
            .collect()
    };
    for w in offsets.windows(2) {
        if w[1] > w[0] {
            rows.push(w[0]);
            rows.push(w[1] - 1);
        }
    }
    rows.sort_unstable();
    rows.dedup();
    rows
}

/// The expert owning row `r`.
fn expert_of(offsets: &[usize], r: usize) -> usize {
    offsets.partition_point(|&o| o <= r) - 1
}

/// Y's checked rows in float64: for each row r of expert e, x[r] · w[e] (N values).
fn y_rows(x: &[u16], w: &[u16], offsets: &[usize], rows: &[usize], k: usize, n: usize) -> Vec<f64> {
    rows.par_iter()
        .flat_map_iter(|&r| {
            let we = &w[expert_of(offsets, r) * k * n..];
            let mut acc = vec![0.0f64; n];
            for i in 0..k {
                let xv = val(x[r * k + i]);
                for (a, &b) in acc.iter_mut().zip(&we[i * n..(i + 1) * n]) {
                    *a += xv * val(b);
                }
            }
            acc
        })
        .collect()
}

/// dX's checked rows in float64: dY[r] · w[e]ᵀ (K values).
fn dx_rows(
    dy: &[u16],
    w: &[u16],
    offsets: &[usize],
    rows: &[usize],
    k: usize,
    n: usize,
) -> Vec<f64> {
    rows.par_iter()
        .flat_map_iter(|&r| {
            let we = &w[expert_of(offsets, r) * k * n..];
            let d = &dy[r * n..(r + 1) * n];
            (0..k)
                .map(|i| {
                    we[i * n..(i + 1) * n]
                        .iter()
                        .zip(d)
                        .map(|(&a, &b)| val(a) * val(b))
                        .sum::<f64>()
                })
                .collect::<Vec<f64>>()
        })
        .collect()
}

/// The column ranges `[start, len]` of a dW row checked ([`DW_COLUMNS`]): the first and the
/// last half of them, or the whole row when N ≤ [`DW_COLUMNS`].
fn dw_columns(n: usize) -> Vec<(usize, usize)> {
    if n <= DW_COLUMNS {
        vec![(0, n)]
    } else {
        vec![(0, DW_COLUMNS / 2), (n - DW_COLUMNS / 2, DW_COLUMNS / 2)]
    }
}

/// dW's checked elements: for every expert, [`DW_ROWS`] k rows evenly spaced, each with the
/// columns of [`dw_columns`]: `(ranges, values)`; an empty expert's are zeros.
fn dw_slices(
    x: &[u16],
    dy: &[u16],
    offsets: &[usize],
    k: usize,
    n: usize,
) -> (Vec<[u64; 2]>, Vec<f64>) {
    let cols = dw_columns(n);
    let ks: Vec<usize> = if k <= DW_ROWS {
        (0..k).collect()
    } else {
        (0..DW_ROWS).map(|i| i * (k - 1) / (DW_ROWS - 1)).collect()
    };
    let experts = offsets.len() - 1;
    let pairs: Vec<(usize, usize)> = (0..experts)
        .flat_map(|e| ks.iter().map(move |&i| (e, i)))
        .collect();
    let ranges = pairs
        .iter()
        .flat_map(|&(e, i)| {
            cols.iter()
                .map(move |&(c0, len)| [((e * k + i) * n + c0) as u64, len as u64])
        })
        .collect();
    let values = pairs
        .par_iter()
        .flat_map_iter(|&(e, i)| {
            let mut out = Vec::new();
            for &(c0, len) in &cols {
                let mut acc = vec![0.0f64; len];
                for r in offsets[e]..offsets[e + 1] {
                    let xv = val(x[r * k + i]);
                    for (a, &b) in acc.iter_mut().zip(&dy[r * n + c0..r * n + c0 + len]) {
                        *a += xv * val(b);
                    }
                }
                out.extend(acc);
            }
            out
        })
        .collect();
    (ranges, values)
}

/// The call's arguments for the comparison modules: `rows` (M), `experts`, `hidden` (K),
/// `width` (N), `counts` (rows per expert), `offsets` (E + 1 cumulative), `backward`.
pub fn arguments(c: &GroupedCase) -> BTreeMap<String, serde_json::Value> {
    let counts = c.group_counts();
    let mut m = BTreeMap::new();
    m.insert("rows".into(), json!(c.rows()));
    m.insert("experts".into(), json!(c.experts));
    m.insert("hidden".into(), json!(c.hidden));
    m.insert("width".into(), json!(c.width));
    m.insert("offsets".into(), json!(offsets_of(&counts)));
    m.insert("counts".into(), json!(counts));
    m.insert("backward".into(), json!(c.backward));
    m
}

/// The group counts a job's arguments carry ([`arguments`]).
///
/// # Errors
/// Missing or malformed `counts`.
pub fn counts_of(args: &BTreeMap<String, serde_json::Value>) -> Result<Vec<usize>> {
    let v = args
        .get("counts")
        .and_then(|v| v.as_array())
        .ok_or_else(|| anyhow::anyhow!("the case's arguments lack `counts`"))?;
    v.iter()
        .map(|c| {
            c.as_u64()
                .map(|c| c as usize)
                .ok_or_else(|| anyhow::anyhow!("`counts` holds {c}, not a row count"))
        })
        .collect()
}

/// Writes case `c`'s inputs (x from `seed`, w from `seed + 1`, dY from `seed + 2`) and the
/// float64 references of the checked elements into `dir`, and returns the files.
///
/// # Errors
/// I/O errors, with the path.
pub fn write_case(c: &GroupedCase, seed: u64, check_rows: usize, dir: &Path) -> Result<CaseFiles> {
    let (m, k, n, e) = (c.rows(), c.hidden, c.width, c.experts);
    let offsets = offsets_of(&c.group_counts());
    let x = uniform_bf16(m * k, seed);
    let w = uniform_bf16(e * k * n, seed + 1);
    let dy = if c.backward {
        uniform_bf16(m * n, seed + 2)
    } else {
        Vec::new()
    };
    let bf16 = "bf16".to_string();
    let mut inputs = Vec::new();
    let mut tensors = vec![("x", &x, vec![m, k]), ("w", &w, vec![e, k, n])];
    if c.backward {
        tensors.push(("dy", &dy, vec![m, n]));
    }
    for (name, bits, shape) in tensors {
        let path = dir.join(format!("{name}.bin"));
        write_u16(&path, bits)?;
        inputs.push(TensorFile {
            name: name.into(),
            dtype: bf16.clone(),
            shape,
            path,
        });
    }
    let rows = checked_rows(&offsets, check_rows);
    let row_ranges = |width: usize| -> Vec<[u64; 2]> {
        rows.iter()
            .map(|&r| [(r * width) as u64, width as u64])
            .collect()
    };
    let check = |file: &str, vals: &[f64], ranges: Vec<[u64; 2]>, checked: String| {
        CheckSpec::write_float64(dir.join(file), vals, ranges, TOLERANCE, checked)
    };
    let y_check = check(
        "reference_y.f64",
        &y_rows(&x, &w, &offsets, &rows, k, n),
        row_ranges(n),
        format!(
            "{} of {m} rows of Y (evenly spaced, and each expert's first and last; every element of each)",
            rows.len()
        ),
    )?;
    let mut gradients = Vec::new();
    if c.backward {
        let dx_check = check(
            "reference_dx.f64",
            &dx_rows(&dy, &w, &offsets, &rows, k, n),
            row_ranges(k),
            format!("the same {} rows of dX", rows.len()),
        )?;
        let (ranges, values) = dw_slices(&x, &dy, &offsets, k, n);
        let dw_check = check(
            "reference_dw.f64",
            &values,
            ranges,
            format!(
                "{} columns (the first and last) of {} k-rows of every expert's dW (empty experts' zeros included)",
                DW_COLUMNS.min(n),
                DW_ROWS.min(k)
            ),
        )?;
        gradients.push(GradientSpec {
            name: "dX".into(),
            input: "x".into(),
            output: OutputSpec {
                dtype: bf16.clone(),
                shape: vec![m, k],
            },
            check: dx_check,
        });
        gradients.push(GradientSpec {
            name: "dW".into(),
            input: "w".into(),
            output: OutputSpec {
                dtype: bf16.clone(),
                shape: vec![e, k, n],
            },
            check: dw_check,
        });
    }
    Ok(CaseFiles {
        inputs,
        output: OutputSpec {
            dtype: bf16,
            shape: vec![m, n],
        },
        check: y_check,
        gradients,
        arguments: arguments(c),
        flops: Some(c.flops()),
        bytes: Some(c.bytes()),
        items: Some(c.tokens as f64),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::moe::case::Spread;
    use crate::moe::reference::{grouped_matmul, grouped_matmul_backward};

    #[test]
    fn the_generator_is_uniform_deterministic_and_chunk_independent() {
        let a = uniform_bf16(200_000, 3);
        assert_eq!(a, uniform_bf16(200_000, 3));
        assert_ne!(a[..100], uniform_bf16(100, 4)[..]);
        // A prefix is the same bits as a shorter draw (chunking does not matter).
        assert_eq!(a[..70_000], uniform_bf16(70_000, 3)[..]);
        let v: Vec<f64> = a.iter().map(|&b| val(b)).collect();
        assert!(v.iter().all(|&x| (-1.0..=1.0).contains(&x)));
        let mean = v.iter().sum::<f64>() / v.len() as f64;
        let var = v.iter().map(|x| x * x).sum::<f64>() / v.len() as f64;
        assert!(mean.abs() < 0.01, "{mean}");
        assert!((var - 1.0 / 3.0).abs() < 0.01, "{var}");
    }

    #[test]
    fn checked_rows_cover_each_groups_ends() {
        assert_eq!(checked_rows(&[0, 2, 2, 5], 256), vec![0, 1, 2, 3, 4]);
        let r = checked_rows(&[0, 500, 500, 1000], 3);
        assert_eq!(r, vec![0, 499, 500, 999]);
        assert!(checked_rows(&[0, 0, 0], 8).is_empty());
    }

    #[test]
    fn references_agree_with_the_float64_definition() {
        let c = GroupedCase {
            tokens: 40,
            experts: 8,
            top_k: 2,
            hidden: 24,
            width: 16,
            spread: Spread::Zipf,
            backward: true,
        };
        let dir = tempfile::tempdir().unwrap();
        let f = write_case(&c, 9, 5, dir.path()).unwrap();
        let offsets = offsets_of(&c.group_counts());
        let (m, k, n) = (c.rows(), c.hidden, c.width);
        let x: Vec<f64> = uniform_bf16(m * k, 9).into_iter().map(val).collect();
        let w: Vec<f64> = uniform_bf16(8 * k * n, 10).into_iter().map(val).collect();
        let dy: Vec<f64> = uniform_bf16(m * n, 11).into_iter().map(val).collect();
        let y = grouped_matmul(&x, &w, &offsets, k, n).unwrap();
        let (dx, dw) = grouped_matmul_backward(&x, &w, &offsets, &dy, k, n).unwrap();
        for ((_, _, check), full) in f.outputs().into_iter().zip([&y, &dx, &dw]) {
            let got = crate::runner::protocol::read_f64(&check.reference).unwrap();
            let want: Vec<f64> = check
                .ranges
                .iter()
                .flat_map(|&[s, l]| full[s as usize..(s + l) as usize].iter().copied())
                .collect();
            assert_eq!(got.len(), want.len());
            for (a, b) in got.iter().zip(&want) {
                assert!((a - b).abs() <= 1e-12 * (1.0 + b.abs()), "{a} vs {b}");
            }
        }
        // Every expert's dW is checked, the empty ones (zipf's last quarter) as zeros.
        // (N = 16: each checked k-row whole.)
        assert_eq!(f.gradients[1].check.ranges.len(), 8 * DW_ROWS);
        assert_eq!(dw_columns(1408), vec![(0, 128), (1280, 128)]);
        assert_eq!(f.arguments["counts"].as_array().unwrap().len(), 8);
        assert_eq!(counts_of(&f.arguments).unwrap(), c.group_counts());
        assert_eq!(f.input_bytes(), 2 * (m * k + 8 * k * n + m * n) as u64);
    }
}
