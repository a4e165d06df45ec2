//! One attention case as the runner protocol's files ([`crate::runner::protocol::CaseFiles`]):
//! the input tensors the runner draws, the float64 reference values of the checked elements of
//! O (and of dQ, dK, dV for forward + backward), and the call's arguments. The runner and the
//! comparison-module tests write cases through this, so every implementation sees the same
//! bits and the same reference.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::Result;
use serde_json::json;

use super::cpu::{modified_reference_values, reference_values, CheckPlan, Inputs, References};
use super::flex::{aux_for, document_lengths, FlexMod, FlexRule};
use super::{AttentionCase, Pass};
use crate::runner::protocol::{
    write_f64, write_u16, CaseFiles, CheckSpec, GradientSpec, OutputSpec, TensorFile,
};
use crate::schema::Reference;

/// The call's arguments for the comparison modules (`CaseFiles::arguments`): `batch`, `heads`,
/// `kv_heads`, `head_dim`, `seq_len_q`, `seq_len_kv`, `causal`, `causal_alignment`
/// (`"bottom_right"`), `scale` (the value used, default included) and `kv_lens` (a list, or
/// null when every entry has seq_len_kv keys).
pub fn arguments(c: &AttentionCase) -> BTreeMap<String, serde_json::Value> {
    let mut m = BTreeMap::new();
    m.insert("batch".into(), json!(c.batch));
    m.insert("heads".into(), json!(c.heads));
    m.insert("kv_heads".into(), json!(c.kv_heads));
    m.insert("head_dim".into(), json!(c.head_dim));
    m.insert("seq_len_q".into(), json!(c.seq_len_q));
    m.insert("seq_len_kv".into(), json!(c.seq_len_kv));
    m.insert("causal".into(), json!(c.causal));
    m.insert("causal_alignment".into(), json!("bottom_right"));
    m.insert("scale".into(), json!(c.scale()));
    m.insert("kv_lens".into(), json!(c.kv_lens));
    m
}

/// Writes case `c`'s inputs ([`Inputs::random`] from `seed`: `q`, `k`, `v`, and `do` for
/// forward + backward) and the float64 references of a [`CheckPlan`] of up to four
/// (batch, head) slices × `check_rows` rows into `dir`, and returns the files.
///
/// # Errors
/// I/O errors, with the path.
pub fn write_case(
    c: &AttentionCase,
    seed: u64,
    check_rows: usize,
    dir: &Path,
) -> Result<CaseFiles> {
    let inp = Inputs::random(c, seed);
    let plan = CheckPlan::new(c, check_rows, seed ^ 0x5eed);
    let refs = reference_values(c, &inp, &plan);
    write_files(c, &inp, &plan, &refs, dir, arguments(c), c.flops())
}

/// Every Q and K element of [`write_overflow_case`]: at head_dim 128 each raw dot product
/// q·k is 24² · 128 = 73,728, past fp16's largest finite value (65,504), while every score is
/// the same, so the attention output is the mean of V over the visible keys.
pub const OVERFLOW_QK: f32 = 24.0;

/// The `inputs` argument [`write_overflow_case`] adds (and the runner's case parameter that
/// selects it).
pub const OVERFLOW_INPUTS: &str = "qk_24";

/// Like [`write_case`], with every element of Q and K set to [`OVERFLOW_QK`] (V and dO stay
/// [`Inputs::random`]'s), the float64 reference of those inputs, and the argument `inputs` =
/// [`OVERFLOW_INPUTS`]: issue 9's fp16 inputs whose raw dot products overflow fp16. A path that
/// forms q·k in fp16 gets inf and then NaN, which the runner's scan of the whole output turns
/// into an `error` row; the others give the mean of V. Meant for the forward: with every key
/// equal the exact dQ is 0, so a relative error of dQ has nothing to be relative to.
///
/// # Errors
/// I/O errors, with the path.
pub fn write_overflow_case(
    c: &AttentionCase,
    seed: u64,
    check_rows: usize,
    dir: &Path,
) -> Result<CaseFiles> {
    let mut inp = Inputs::random(c, seed);
    inp.q = c.dtype.encode_all(&vec![OVERFLOW_QK; c.q_elems()]);
    inp.k = c.dtype.encode_all(&vec![OVERFLOW_QK; c.kv_elems()]);
    let plan = CheckPlan::new(c, check_rows, seed ^ 0x5eed);
    let refs = reference_values(c, &inp, &plan);
    let mut args = arguments(c);
    args.insert("inputs".into(), json!(OVERFLOW_INPUTS));
    write_files(c, &inp, &plan, &refs, dir, args, c.flops())
}

/// The FLOP rule of the masks grid's cases ([`write_masked_case`]), in words.
pub const MASKED_FLOP_RULE: &str = "4·H·D per (query, key) pair the mask leaves visible, counted exactly over the batch, ×3.5 for forward + backward (causal: T(T+1)/2 pairs per head; a score modification adds nothing)";

/// Like [`write_case`] for a case of the masks grid: the float64 reference applies `mask`
/// ([`FlexMod`], `None` for no mask) through [`modified_reference_values`], the FLOPs count the
/// visible pairs ([`MASKED_FLOP_RULE`]), and the arguments add `mask` (its name) and, for the
/// document mask, `documents` (each batch entry's document lengths, [`document_lengths`]).
/// `c.causal` is true exactly for the causal mask, and `c.kv_lens` unset.
///
/// # Errors
/// I/O errors, with the path; a case that breaks those two rules.
pub fn write_masked_case(
    c: &AttentionCase,
    mask: Option<FlexMod>,
    seed: u64,
    check_rows: usize,
    dir: &Path,
) -> Result<CaseFiles> {
    anyhow::ensure!(
        c.causal == (mask == Some(FlexMod::Causal)) && c.kv_lens.is_none(),
        "a masks-grid case is causal exactly when its mask is `causal`, and has no kv_lens"
    );
    let inp = Inputs::random(c, seed);
    let plan = CheckPlan::new(c, check_rows, seed ^ 0x5eed);
    let aux = aux_for(mask, c.batch, c.seq_len_kv);
    let refs = modified_reference_values(c, &inp, &plan, &rule_of(c, mask, &aux));
    let mut args = arguments(c);
    args.insert(
        "mask".into(),
        json!(mask.map_or("none".to_string(), |m| m.name())),
    );
    if mask == Some(FlexMod::Document) {
        args.insert(
            "documents".into(),
            json!(document_lengths(c.batch, c.seq_len_kv)),
        );
    }
    write_files(c, &inp, &plan, &refs, dir, args, masked_flops(c, mask))
}

/// FLOPs of a masks-grid case by [`MASKED_FLOP_RULE`].
pub fn masked_flops(c: &AttentionCase, mask: Option<FlexMod>) -> f64 {
    let aux = aux_for(mask, c.batch, c.seq_len_kv);
    let rule = rule_of(c, mask, &aux);
    let pairs: u64 = std::thread::scope(|s| {
        let rule = &rule;
        let hs: Vec<_> = (0..c.batch)
            .map(|b| s.spawn(move || rule.visible_pairs(b, c.kv_len(b))))
            .collect();
        hs.into_iter().map(|h| h.join().expect("pair count")).sum()
    });
    let f = 4.0 * c.heads as f64 * c.head_dim as f64 * pairs as f64;
    if c.pass == Pass::FwdBwd {
        f * 3.5
    } else {
        f
    }
}

/// The reference's rule for `mask` over case `c`'s shape, reading `aux`.
fn rule_of<'a>(c: &AttentionCase, mask: Option<FlexMod>, aux: &'a [i32]) -> FlexRule<'a> {
    FlexRule {
        m: mask,
        heads: c.heads,
        seq_len_q: c.seq_len_q,
        seq_len_kv: c.seq_len_kv,
        aux,
    }
}

/// Writes the inputs, the references of `plan` and the call's description.
fn write_files(
    c: &AttentionCase,
    inp: &Inputs,
    plan: &CheckPlan,
    refs: &References,
    dir: &Path,
    args: BTreeMap<String, serde_json::Value>,
    flops: f64,
) -> Result<CaseFiles> {
    let dtype = c.dtype.as_str().to_string();
    let q_shape = vec![c.batch, c.heads, c.seq_len_q, c.head_dim];
    let kv_shape = vec![c.batch, c.kv_heads, c.seq_len_kv, c.head_dim];
    let mut inputs = Vec::new();
    let mut tensors = vec![
        ("q", &inp.q, &q_shape),
        ("k", &inp.k, &kv_shape),
        ("v", &inp.v, &kv_shape),
    ];
    if c.pass == Pass::FwdBwd {
        tensors.push(("do", &inp.dout, &q_shape));
    }
    for (name, words, shape) in tensors {
        let path = dir.join(format!("{name}.bin"));
        write_u16(&path, words)?;
        inputs.push(TensorFile {
            name: name.into(),
            dtype: dtype.clone(),
            shape: shape.clone(),
            path,
        });
    }
    let check = |file: &str, values: &[f64], ranges: Vec<[u64; 2]>, checked: String| {
        let path = dir.join(file);
        write_f64(&path, values).map(|_| CheckSpec {
            ranges,
            reference: path,
            reference_kind: Reference::Float64Cpu,
            tolerance: c.dtype.tolerance(),
            checked,
        })
    };
    let o_check = check("reference.f64", &refs.o, plan.ranges(c), plan.describe(c))?;
    let mut gradients = Vec::new();
    if c.pass == Pass::FwdBwd {
        let fwd = AttentionCase {
            pass: Pass::Fwd,
            ..c.clone()
        };
        let q_text = plan.describe(&fwd);
        let kv_text = format!(
            "{} of {} (batch, kv head) slices x {} of {} key rows",
            plan.kv_slices.len(),
            c.batch * c.kv_heads,
            plan.key_rows.len(),
            c.seq_len_kv
        );
        for (name, input, values, ranges, text, shape) in [
            ("dQ", "q", &refs.dq, plan.ranges(c), &q_text, &q_shape),
            ("dK", "k", &refs.dk, plan.kv_ranges(c), &kv_text, &kv_shape),
            ("dV", "v", &refs.dv, plan.kv_ranges(c), &kv_text, &kv_shape),
        ] {
            gradients.push(GradientSpec {
                name: name.into(),
                input: input.into(),
                output: OutputSpec {
                    dtype: dtype.clone(),
                    shape: shape.clone(),
                },
                check: check(
                    &format!("reference_{}.f64", name.to_lowercase()),
                    values,
                    ranges,
                    text.clone(),
                )?,
            });
        }
    }
    Ok(CaseFiles {
        inputs,
        output: OutputSpec {
            dtype,
            shape: q_shape,
        },
        check: o_check,
        gradients,
        arguments: args,
        flops: Some(flops),
        bytes: c.is_decoding().then(|| c.bytes_moved()),
        items: None,
    })
}
