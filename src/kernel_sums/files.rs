//! One kernel-sum case as the runner protocol's files ([`crate::runner::protocol::CaseFiles`]):
//! X, Y and the weights as raw float32 files, the float64 reference values of the checked rows
//! of the output (and of the gradient dX), and the call's arguments, so that the project's
//! implementations and the comparison modules read the same bits and are checked against the
//! same values.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::Result;
use serde_json::json;

use super::{reference_rows, Inputs, KernelSumCase, Op, Scale};
use crate::attention::Dtype;
use crate::runner::protocol::{
    write_u16, CaseFiles, CheckSpec, GradientSpec, OutputSpec, TensorFile,
};

/// Largest accepted relative L2 error of a float32 kernel sum against float64 (the issue's
/// bar).
pub const TOLERANCE: f64 = 1e-5;

/// The rows checked against float64: every row when N ≤ `check_rows`, else `check_rows` rows
/// evenly spaced from the first to the last.
pub fn checked_rows(n: usize, check_rows: usize) -> Vec<usize> {
    if n <= check_rows {
        return (0..n).collect();
    }
    if check_rows < 2 {
        return vec![0];
    }
    (0..check_rows)
        .map(|k| k * (n - 1) / (check_rows - 1))
        .collect()
}

/// The call's arguments for the comparison modules: `op`, `n`, `m`, `dim`, `cols`, `grad`,
/// `sigma` (the bandwidth used; `kde`: Scott's rule on Y) and `epsilon`.
pub fn arguments(c: &KernelSumCase, s: Scale) -> BTreeMap<String, serde_json::Value> {
    let mut m = BTreeMap::new();
    m.insert("op".into(), json!(c.op.as_str()));
    m.insert("n".into(), json!(c.n));
    m.insert("m".into(), json!(c.m));
    m.insert("dim".into(), json!(c.dim));
    m.insert("cols".into(), json!(c.cols));
    m.insert("grad".into(), json!(c.grad));
    m.insert("sigma".into(), json!(s.sigma));
    m.insert("epsilon".into(), json!(s.epsilon));
    m
}

/// Writes case `c`'s inputs ([`Inputs::random`] from `seed`: `x`, `y`, and `b` or `g`) and
/// the float64 references of [`checked_rows`] into `dir`, and returns the files.
///
/// # Errors
/// I/O errors, with the path.
pub fn write_case(
    c: &KernelSumCase,
    seed: u64,
    check_rows: usize,
    dir: &Path,
) -> Result<CaseFiles> {
    let inp = Inputs::random(c, seed);
    let s = Scale::of(c, &inp);
    let rows = checked_rows(c.n, check_rows);
    let values = reference_rows(c, &inp, s, &rows);
    let fp32 = "fp32".to_string();
    let mut inputs = Vec::new();
    let mut tensors = vec![
        ("x", &inp.x, vec![c.n, c.dim]),
        ("y", &inp.y, vec![c.m, c.dim]),
    ];
    match c.op {
        Op::RbfMv => tensors.push(("b", &inp.w, vec![c.m, c.cols])),
        Op::KernelLse => tensors.push(("g", &inp.w, vec![c.m])),
        Op::Kde => {}
    }
    for (name, xs, shape) in tensors {
        let path = dir.join(format!("{name}.bin"));
        write_u16(&path, &Dtype::F32.encode_all(xs))?;
        inputs.push(TensorFile {
            name: name.into(),
            dtype: fp32.clone(),
            shape,
            path,
        });
    }
    let width = if c.op == Op::RbfMv { c.cols } else { 1 };
    let out_vals = rows.len() * width;
    let described = |what: &str| {
        format!(
            "{} of {} rows of {what} (every element of each)",
            rows.len(),
            c.n
        )
    };
    let ranges =
        |w: usize| -> Vec<[u64; 2]> { rows.iter().map(|&i| [(i * w) as u64, w as u64]).collect() };
    let check = |file: &str, vals: &[f64], ranges: Vec<[u64; 2]>, checked: String| {
        CheckSpec::write_float64(dir.join(file), vals, ranges, TOLERANCE, checked)
    };
    let o_check = check(
        "reference.f64",
        &values[..out_vals],
        ranges(width),
        described("the output"),
    )?;
    let mut gradients = Vec::new();
    if c.grad {
        gradients.push(GradientSpec {
            name: "dX".into(),
            input: "x".into(),
            output: OutputSpec {
                dtype: fp32.clone(),
                shape: vec![c.n, c.dim],
            },
            check: check(
                "reference_dx.f64",
                &values[out_vals..],
                ranges(c.dim),
                described("dX"),
            )?,
        });
    }
    Ok(CaseFiles {
        inputs,
        output: OutputSpec {
            dtype: fp32,
            shape: if c.op == Op::RbfMv {
                vec![c.n, c.cols]
            } else {
                vec![c.n]
            },
        },
        check: o_check,
        gradients,
        arguments: arguments(c, s),
        flops: Some(c.flops()),
        bytes: Some(c.bytes()),
        items: Some(c.evaluations()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checked_rows_span_the_output() {
        assert_eq!(checked_rows(3, 256), vec![0, 1, 2]);
        let r = checked_rows(1000, 5);
        assert_eq!(r, vec![0, 249, 499, 749, 999]);
        assert_eq!(checked_rows(1000, 1), vec![0]);
    }

    #[test]
    fn a_case_writes_its_inputs_references_and_gradient() {
        let dir = tempfile::tempdir().unwrap();
        let c = KernelSumCase {
            grad: true,
            ..KernelSumCase::new(Op::KernelLse, 10, 7, 3)
        };
        let f = write_case(&c, 5, 4, dir.path()).unwrap();
        let names: Vec<&str> = f.inputs.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["x", "y", "g"]);
        assert_eq!(f.check.ranges, vec![[0, 1], [3, 1], [6, 1], [9, 1]]);
        assert_eq!(f.gradients[0].check.ranges[1], [9, 3]);
        assert_eq!(f.items, Some(2.0 * 70.0));
        let r = crate::runner::protocol::read_f64(&f.gradients[0].check.reference).unwrap();
        assert_eq!(r.len(), 12);
        assert_eq!(f.input_bytes(), 4 * (30 + 21 + 7));
    }
}
