//! One sequence-mixer case as the runner protocol's files ([`crate::runner::protocol::CaseFiles`]):
//! the inputs as raw files (sequence inputs in the case's dtype, the rest in float32), the float64
//! reference of the checked tokens' outputs, and the call's arguments, so that the project's
//! implementations and the comparison modules read the same bits and are checked against the
//! same values.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::Result;
use serde_json::json;

use super::case::{Mixer, MixerCase, MixerDtype, MixerInputs, MixerPass};
use crate::runner::protocol::{
    write_f64, write_u16, CaseFiles, CheckSpec, GradientSpec, OutputSpec, TensorFile,
};
use crate::schema::Reference;

/// Largest accepted relative L2 error against float64 with float32 inputs and output.
pub const TOLERANCE_FP32: f64 = 1e-4;
/// The same with bf16 inputs and output (the output's rounding alone is about 2⁻⁹ relative).
pub const TOLERANCE_BF16: f64 = 1e-2;

/// The tokens (flat `b·T + t` indices) whose outputs are checked: every token when B·T ≤
/// `check_tokens`, else `check_tokens` of them evenly spaced from the first to the last (the
/// last step of the last sequence included, where a dropped tail chunk would show).
pub fn checked_tokens(tokens: usize, check_tokens: usize) -> Vec<usize> {
    if tokens <= check_tokens {
        return (0..tokens).collect();
    }
    if check_tokens < 2 {
        return vec![tokens - 1];
    }
    (0..check_tokens)
        .map(|k| k * (tokens - 1) / (check_tokens - 1))
        .collect()
}

/// The call's arguments for the comparison modules: the case's parameters
/// ([`MixerCase::params`]), and for Based the score factor `scale` of `inp`.
pub fn arguments(c: &MixerCase, inp: &MixerInputs) -> BTreeMap<String, serde_json::Value> {
    let mut m: BTreeMap<String, serde_json::Value> = c
        .params()
        .into_iter()
        .map(|(k, v)| (k, serde_json::to_value(v).unwrap_or(json!(null))))
        .collect();
    if c.mixer == Mixer::Based {
        m.insert("scale".into(), json!(inp.scale));
    }
    m
}

/// Writes case `c`'s inputs ([`MixerInputs::random`] from `seed`) and the float64 reference
/// of [`checked_tokens`] into `dir`, and returns the files; a forward and backward case also
/// gets dy among its inputs and its gradients' references
/// ([`MixerInputs::gradient_references`]: the same tokens, dA and dD whole), float32 outputs.
///
/// # Errors
/// I/O errors, with the path; inputs the reference refuses.
pub fn write_case(c: &MixerCase, seed: u64, check_tokens: usize, dir: &Path) -> Result<CaseFiles> {
    let inp = MixerInputs::random(c, seed);
    let y = inp.reference(c).map_err(anyhow::Error::msg)?;
    let (bsz, t) = (c.batch, c.seq_len);
    let w = c.width();
    let mut inputs = Vec::new();
    for tensor in &inp.tensors {
        let path = dir.join(format!("{}.bin", tensor.name));
        write_u16(&path, &tensor.dtype.codec().encode_all(&tensor.values))?;
        inputs.push(TensorFile {
            name: tensor.name.into(),
            dtype: tensor.dtype.as_str().into(),
            shape: tensor.shape.clone(),
            path,
        });
    }
    let tokens = checked_tokens(bsz * t, check_tokens);
    let values: Vec<f64> = tokens
        .iter()
        .flat_map(|&k| y[k * w..(k + 1) * w].iter().copied())
        .collect();
    let reference = dir.join("reference.f64");
    write_f64(&reference, &values)?;
    let check = CheckSpec {
        ranges: tokens.iter().map(|&k| [(k * w) as u64, w as u64]).collect(),
        reference,
        reference_kind: Reference::Float64Cpu,
        tolerance: match c.dtype {
            MixerDtype::Fp32 => TOLERANCE_FP32,
            MixerDtype::Bf16 => TOLERANCE_BF16,
        },
        checked: format!(
            "{} of {} tokens (every output of each; the last token included), from a zero \
             state",
            tokens.len(),
            bsz * t
        ),
    };
    let tolerance = check.tolerance;
    let mut gradients = Vec::new();
    if c.pass == MixerPass::FwdBwd {
        // Each gradient checked where the output is (the same tokens) when it has a token
        // axis, whole otherwise (dA, dD); float32, as the kernels write them.
        for (name, input, values, shape) in
            inp.gradient_references(c).map_err(anyhow::Error::msg)?
        {
            // A gradient with a token axis is [B, T, ...]: its values per token are the
            // product of the dimensions after T.
            let per_token = shape.len() >= 3;
            let (ranges, picked): (Vec<[u64; 2]>, Vec<f64>) = if per_token {
                let width: usize = shape[2..].iter().product();
                (
                    tokens
                        .iter()
                        .map(|&k| [(k * width) as u64, width as u64])
                        .collect(),
                    tokens
                        .iter()
                        .flat_map(|&k| values[k * width..(k + 1) * width].iter().copied())
                        .collect(),
                )
            } else {
                (vec![[0, values.len() as u64]], values.clone())
            };
            let reference = dir.join(format!("reference_{name}.f64"));
            write_f64(&reference, &picked)?;
            gradients.push(GradientSpec {
                name: name.into(),
                input: input.into(),
                output: OutputSpec {
                    dtype: MixerDtype::Fp32.as_str().into(),
                    shape,
                },
                check: CheckSpec {
                    ranges,
                    reference,
                    reference_kind: Reference::Float64Cpu,
                    tolerance,
                    checked: if per_token {
                        format!("{} of {} tokens, from a zero state", tokens.len(), bsz * t)
                    } else {
                        "every element".into()
                    },
                },
            });
        }
    }
    let out_shape = match c.mixer {
        Mixer::SelectiveScan => vec![bsz, t, w],
        Mixer::Ssd | Mixer::GatedDelta | Mixer::Based => vec![bsz, t, c.heads, c.head_dim],
    };
    Ok(CaseFiles {
        inputs,
        output: OutputSpec {
            dtype: c.dtype.as_str().into(),
            shape: out_shape,
        },
        check,
        gradients,
        arguments: arguments(c, &inp),
        flops: Some(c.flops()),
        bytes: Some(c.bytes()),
        items: Some(c.tokens()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checked_tokens_include_the_last() {
        assert_eq!(checked_tokens(3, 256), vec![0, 1, 2]);
        assert_eq!(checked_tokens(1001, 3), vec![0, 500, 1000]);
        assert_eq!(checked_tokens(10, 1), vec![9]);
    }

    #[test]
    fn a_case_writes_mixed_dtype_inputs_and_its_reference() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = MixerCase::ssd(2, 5, 2, 3, 4);
        c.dtype = MixerDtype::Bf16;
        let f = write_case(&c, 7, 4, dir.path()).unwrap();
        let kinds: Vec<(&str, &str)> = f
            .inputs
            .iter()
            .map(|t| (t.name.as_str(), t.dtype.as_str()))
            .collect();
        assert_eq!(
            kinds,
            [
                ("x", "bf16"),
                ("dt", "fp32"),
                ("a", "fp32"),
                ("b", "bf16"),
                ("c", "bf16"),
                ("d", "fp32")
            ]
        );
        // 10 tokens, 4 checked: 0, 3, 6, 9, each its 6 outputs.
        assert_eq!(f.check.ranges, vec![[0, 6], [18, 6], [36, 6], [54, 6]]);
        let r = crate::runner::protocol::read_f64(&f.check.reference).unwrap();
        assert_eq!(r.len(), 24);
        assert_eq!(f.output.dtype, "bf16");
        assert_eq!(f.arguments["mixer"], json!("ssd"));
        assert_eq!(f.arguments["head_dim"], json!(3));
        assert_eq!(f.check.tolerance, TOLERANCE_BF16);
        let b = write_case(&MixerCase::based(1, 3, 2, 4, 2), 7, 8, dir.path()).unwrap();
        let names: Vec<&str> = b.inputs.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["q", "k", "v"]);
        assert_eq!(b.arguments["scale"], json!(0.5));
        assert_eq!(b.output.shape, vec![1, 3, 2, 4]);
    }

    #[test]
    fn a_backward_case_writes_dy_and_its_gradients() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = MixerCase::scan(2, 5, 3, 4);
        c.pass = MixerPass::FwdBwd;
        let f = write_case(&c, 7, 4, dir.path()).unwrap();
        let names: Vec<&str> = f.inputs.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["u", "delta", "a", "b", "c", "d", "dy"]);
        let g: Vec<(&str, &str)> = f
            .gradients
            .iter()
            .map(|g| (g.name.as_str(), g.input.as_str()))
            .collect();
        assert_eq!(
            g,
            [
                ("du", "u"),
                ("ddelta", "delta"),
                ("dA", "a"),
                ("dB", "b"),
                ("dC", "c"),
                ("dD", "d")
            ]
        );
        // du: the 4 checked tokens of 10, 3 channels each; dA whole (3 × 4).
        assert_eq!(
            f.gradients[0].check.ranges,
            vec![[0, 3], [9, 3], [18, 3], [27, 3]]
        );
        assert_eq!(f.gradients[2].check.ranges, vec![[0, 12]]);
        assert_eq!(f.gradients[3].output.shape, vec![2, 5, 4]);
        // The references are the float64 adjoint's on the written inputs.
        let inp = MixerInputs::random(&c, 7);
        let want = inp.gradient_references(&c).unwrap();
        let da = crate::runner::protocol::read_f64(&f.gradients[2].check.reference).unwrap();
        assert_eq!(da, want[2].2);
        assert!(da.iter().any(|&x| x != 0.0));
        // A forward case has neither.
        c.pass = MixerPass::Fwd;
        let f = write_case(&c, 7, 4, dir.path()).unwrap();
        assert!(f.gradients.is_empty() && f.inputs.len() == 6);
    }

    #[test]
    fn an_ssd_backward_case_checks_whole_tokens_of_its_4d_gradients() {
        let dir = tempfile::tempdir().unwrap();
        // B2 T5 H4 P3 N2, one group.
        let mut c = MixerCase::ssd(2, 5, 4, 3, 2);
        c.pass = MixerPass::FwdBwd;
        let f = write_case(&c, 9, 4, dir.path()).unwrap();
        let g: Vec<(&str, &str)> = f
            .gradients
            .iter()
            .map(|g| (g.name.as_str(), g.input.as_str()))
            .collect();
        assert_eq!(
            g,
            [
                ("dx", "x"),
                ("ddt", "dt"),
                ("dA", "a"),
                ("dB", "b"),
                ("dC", "c"),
                ("dD", "d")
            ]
        );
        // dX [2, 5, 4, 3]: 12 values per token, the 4 checked tokens of 10; dΔ 4 per token;
        // dB [2, 5, 1, 2]: 2 per token; dA whole.
        assert_eq!(f.gradients[0].output.shape, vec![2, 5, 4, 3]);
        // dy has the output's shape (PyTorch's autograd checks it against y's).
        let dy = f.inputs.iter().find(|t| t.name == "dy").unwrap();
        assert_eq!(dy.shape, f.output.shape);
        assert_eq!(
            f.gradients[0].check.ranges,
            vec![[0, 12], [36, 12], [72, 12], [108, 12]]
        );
        assert_eq!(f.gradients[1].check.ranges[1], [12, 4]);
        assert_eq!(f.gradients[3].check.ranges[3], [18, 2]);
        assert_eq!(f.gradients[2].check.ranges, vec![[0, 4]]);
        let dx = crate::runner::protocol::read_f64(&f.gradients[0].check.reference).unwrap();
        assert_eq!(dx.len(), 48);
        assert!(dx.iter().any(|&x| x != 0.0));
    }
}
