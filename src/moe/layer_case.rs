//! A whole-layer case of the MoE grid (issue 14): the forward of [`super::reference::moe_layer`]
//! (router, softmax top-k, dispatch, SwiGLU experts, combine), its FLOP and byte counts, and
//! its inputs and float64 references as the runner protocol's files.
//!
//! The inputs make every implementation route alike: the first E features of each token are a
//! random permutation of the levels 0, 1/E, …, (E − 1)/E (exact in bf16) and the router is
//! 4 · I on those features and 0 elsewhere, so each token's logits are 4 · its levels, exact in
//! bf16 whatever the accumulation order, and distinct (spaced 4/E): no implementation can
//! pick another top-k by rounding. Each token's experts are a uniform random draw, so the groups
//! are balanced up to sampling. The rest of x is uniform in [−1, 1); the experts' weights are
//! uniform in [−1, 1) times 1/√H (gate and up) and 1/√F (down), rounded to bf16.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::Result;
use rayon::prelude::*;
use serde_json::json;

use super::files::{checked_rows, splitmix64, uniform_bf16, val, TOLERANCE};
use super::reference::{route, Gate};
use crate::runner::protocol::{write_u16, CaseFiles, CheckSpec, OutputSpec, TensorFile};
use crate::schema::Param;

/// The `op` parameter of a whole-layer case.
pub const OP: &str = "layer";
/// The `spread` parameter of a whole-layer case: the router decides the groups.
pub const SPREAD: &str = "routed";
/// The router's weight on a token's routing features (its logits are this times the levels).
pub const ROUTER_SCALE: f64 = 4.0;
/// The most experts a layer case takes: the levels l/E, l < E ≤ 256, have at most 8
/// significant bits, exact in bf16.
pub const MAX_EXPERTS: usize = 256;

/// The forward of one MoE layer: `tokens` tokens of width `hidden` H, each routed by softmax
/// top-k (`top_k` of `experts` E, dropless) to SwiGLU experts of width `width` F; bf16
/// activations and weights.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerCase {
    /// Tokens T.
    pub tokens: usize,
    /// Experts E.
    pub experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// The model width H.
    pub hidden: usize,
    /// The expert width F.
    pub width: usize,
}

impl LayerCase {
    /// The case as named parameters for a document row: `op` ([`OP`]), `tokens`, `experts`,
    /// `top_k`, `hidden`, `width`, `spread` ([`SPREAD`]), `dtype` (`bf16`), `pass` (`fwd`).
    pub fn params(&self) -> BTreeMap<String, Param> {
        super::case::shape_params(
            [
                self.tokens,
                self.experts,
                self.top_k,
                self.hidden,
                self.width,
            ],
            OP,
            SPREAD,
            "fwd",
        )
    }

    /// The case named by `p` ([`LayerCase::params`]).
    ///
    /// # Errors
    /// Another op, a missing or mistyped parameter, a pass other than `fwd`, a dtype other
    /// than bf16, or sizes [`LayerCase::validate`] refuses.
    pub fn from_params(p: &BTreeMap<String, Param>) -> Result<LayerCase, String> {
        let int = |k: &str| crate::schema::param_size(p, k);
        let text = |k: &str| crate::schema::param_name(p, k);
        if text("op")? != OP {
            return Err(format!(
                "op `{}` is not the whole layer (`{OP}`)",
                text("op")?
            ));
        }
        if text("pass")? != "fwd" {
            return Err(format!(
                "pass `{}`: the layer's rows are forwards",
                text("pass")?
            ));
        }
        if text("dtype")? != "bf16" {
            return Err(format!("dtype `{}`: the layer is bf16", text("dtype")?));
        }
        let c = LayerCase {
            tokens: int("tokens")?,
            experts: int("experts")?,
            top_k: int("top_k")?,
            hidden: int("hidden")?,
            width: int("width")?,
        };
        c.validate()?;
        Ok(c)
    }

    /// Checks the sizes.
    ///
    /// # Errors
    /// A size of 0, `top_k` above E, more than [`MAX_EXPERTS`] experts (the levels l/E stop
    /// being exact in bf16's 8 significant bits), or H below E (the routing features are H's
    /// first E).
    pub fn validate(&self) -> Result<(), String> {
        if self.experts > MAX_EXPERTS {
            return Err(format!(
                "{} experts: the routing levels l/E are exact in bf16 up to {MAX_EXPERTS}",
                self.experts
            ));
        }
        if self.tokens == 0 || self.experts == 0 || self.hidden == 0 || self.width == 0 {
            return Err(format!("a size is 0: {self:?}"));
        }
        if self.top_k == 0 || self.top_k > self.experts {
            return Err(format!(
                "top_k {} must be between 1 and the {} experts",
                self.top_k, self.experts
            ));
        }
        if self.hidden < self.experts {
            return Err(format!(
                "hidden {} below the {} experts: the routing features are the first E of H",
                self.hidden, self.experts
            ));
        }
        Ok(())
    }

    /// FLOPs of one forward: the router 2 · T · H · E, the gate and up projections
    /// 2 · T · k · H · 2F, the down projection 2 · T · k · F · H (the element-wise steps,
    /// softmax, SwiGLU and the weighted sum, not counted).
    pub fn flops(&self) -> f64 {
        let (t, e, k, h, f) = (
            self.tokens as f64,
            self.experts as f64,
            self.top_k as f64,
            self.hidden as f64,
            self.width as f64,
        );
        2.0 * t * h * e + 6.0 * t * k * h * f
    }

    /// Bytes one forward must move at least, bf16: x, the router and every expert's three
    /// matrices read once, the output written.
    pub fn bytes(&self) -> f64 {
        let (t, e, h, f) = (
            self.tokens as f64,
            self.experts as f64,
            self.hidden as f64,
            self.width as f64,
        );
        2.0 * (t * h + h * e + 3.0 * e * h * f + t * h)
    }
}

/// A token's routing features: a permutation of 0..E from `seed` and the token's index
/// (Fisher–Yates on a SplitMix64 stream).
fn levels(experts: usize, seed: u64, token: usize) -> Vec<usize> {
    let mut state = seed
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(token as u64)
        .wrapping_mul(0xBF58_476D_1CE4_E5B9);
    let mut next = || {
        let z = splitmix64(state);
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z
    };
    let mut p: Vec<usize> = (0..experts).collect();
    for i in (1..experts).rev() {
        let j = (next() % (i as u64 + 1)) as usize;
        p.swap(i, j);
    }
    p
}

/// bf16 bits of `v` (round to nearest even; the values here are finite).
fn bits(v: f64) -> u16 {
    half::bf16::from_f64(v).to_bits()
}

/// Uniform bf16 values in [−1, 1) from `seed`, times `scale`, rounded to bf16.
fn scaled(n: usize, seed: u64, scale: f64) -> Vec<u16> {
    uniform_bf16(n, seed)
        .into_par_iter()
        .map(|b| bits(val(b) * scale))
        .collect()
}

/// The layer's inputs, as bf16 bits: x `[T, H]`, the router `[H, E]`, the gate and up
/// projections side by side `[E, H, 2F]`, the down projection `[E, F, H]` (the module's
/// description says how they are drawn).
pub struct LayerInputs {
    /// x `[T, H]`.
    pub x: Vec<u16>,
    /// W_router `[H, E]`.
    pub router: Vec<u16>,
    /// W_gate and W_up, `[E, H, 2F]` (row i of expert e: F gate values then F up values).
    pub gate_up: Vec<u16>,
    /// W_down `[E, F, H]`.
    pub down: Vec<u16>,
}

impl LayerInputs {
    /// Draws case `c`'s inputs from `seed` (x), `seed + 1` (gate and up), `seed + 2` (down).
    pub fn draw(c: &LayerCase, seed: u64) -> LayerInputs {
        let (t, e, h, f) = (c.tokens, c.experts, c.hidden, c.width);
        let mut x = uniform_bf16(t * h, seed);
        x.par_chunks_mut(h).enumerate().for_each(|(tok, row)| {
            for (j, l) in levels(e, seed, tok).into_iter().enumerate() {
                row[j] = bits(l as f64 / e as f64);
            }
        });
        let mut router = vec![0u16; h * e];
        for j in 0..e {
            router[j * e + j] = bits(ROUTER_SCALE);
        }
        LayerInputs {
            x,
            router,
            gate_up: scaled(e * h * 2 * f, seed + 1, (1.0 / h as f64).sqrt()),
            down: scaled(e * f * h, seed + 2, (1.0 / f as f64).sqrt()),
        }
    }

    /// The layer's output for token `tok` in float64 (H values): its logits x · W_router, the
    /// softmax top-k of [`route`], and the gate-weighted sum of its experts' SwiGLU MLPs.
    pub fn output_row(&self, c: &LayerCase, tok: usize) -> Vec<f64> {
        let (e, h, f) = (c.experts, c.hidden, c.width);
        let xr: Vec<f64> = self.x[tok * h..(tok + 1) * h]
            .iter()
            .map(|&b| val(b))
            .collect();
        let mut logits = vec![0.0f64; e];
        for (i, &xv) in xr.iter().enumerate() {
            for (l, &w) in logits.iter_mut().zip(&self.router[i * e..(i + 1) * e]) {
                *l += xv * val(w);
            }
        }
        let routing = route(&logits, 1, e, c.top_k, Gate::Softmax)
            .expect("finite logits of one token, 1 ≤ top_k ≤ E (validated)");
        let mut out = vec![0.0f64; h];
        for (&ex, &gw) in routing.experts.iter().zip(&routing.weights) {
            let mut gu = vec![0.0f64; 2 * f];
            let wgu = &self.gate_up[ex * h * 2 * f..(ex + 1) * h * 2 * f];
            for (i, &xv) in xr.iter().enumerate() {
                for (a, &w) in gu.iter_mut().zip(&wgu[i * 2 * f..(i + 1) * 2 * f]) {
                    *a += xv * val(w);
                }
            }
            let wd = &self.down[ex * f * h..(ex + 1) * f * h];
            for j in 0..f {
                let z = gu[j];
                let act = z / (1.0 + (-z).exp()) * gu[f + j];
                for (o, &w) in out.iter_mut().zip(&wd[j * h..(j + 1) * h]) {
                    *o += gw * act * val(w);
                }
            }
        }
        out
    }
}

/// The call's arguments for the comparison modules: `tokens`, `experts`, `top_k`, `hidden`
/// (H), `width` (F), `gate` (`softmax`), `capacity` (null: dropless).
pub fn arguments(c: &LayerCase) -> BTreeMap<String, serde_json::Value> {
    let mut m = BTreeMap::new();
    m.insert("tokens".into(), json!(c.tokens));
    m.insert("experts".into(), json!(c.experts));
    m.insert("top_k".into(), json!(c.top_k));
    m.insert("hidden".into(), json!(c.hidden));
    m.insert("width".into(), json!(c.width));
    m.insert("gate".into(), json!("softmax"));
    m.insert("capacity".into(), serde_json::Value::Null);
    m
}

/// Writes case `c`'s inputs ([`LayerInputs::draw`] from `seed`) and the float64 references of
/// its checked output rows into `dir`, and returns the files.
///
/// # Errors
/// I/O errors, with the path.
pub fn write_case(c: &LayerCase, seed: u64, check_rows: usize, dir: &Path) -> Result<CaseFiles> {
    let (t, e, h, f) = (c.tokens, c.experts, c.hidden, c.width);
    let inp = LayerInputs::draw(c, seed);
    let bf16 = "bf16".to_string();
    let mut inputs = Vec::new();
    for (name, data, shape) in [
        ("x", &inp.x, vec![t, h]),
        ("router", &inp.router, vec![h, e]),
        ("gate_up", &inp.gate_up, vec![e, h, 2 * f]),
        ("down", &inp.down, vec![e, f, h]),
    ] {
        let path = dir.join(format!("{name}.bin"));
        write_u16(&path, data)?;
        inputs.push(TensorFile {
            name: name.into(),
            dtype: bf16.clone(),
            shape,
            path,
        });
    }
    // Evenly spaced tokens: the rows of one group of T.
    let toks = checked_rows(&[0, t], check_rows);
    let values: Vec<f64> = toks
        .par_iter()
        .flat_map_iter(|&tok| inp.output_row(c, tok))
        .collect();
    let check = CheckSpec::write_float64(
        dir.join("reference_out.f64"),
        &values,
        toks.iter()
            .map(|&tok| [(tok * h) as u64, h as u64])
            .collect(),
        TOLERANCE,
        format!(
            "{} of {t} tokens' output rows (evenly spaced; every element of each)",
            toks.len()
        ),
    )?;
    Ok(CaseFiles {
        inputs,
        output: OutputSpec {
            dtype: bf16,
            shape: vec![t, h],
        },
        check,
        gradients: Vec::new(),
        arguments: arguments(c),
        flops: Some(c.flops()),
        bytes: Some(c.bytes()),
        items: Some(t as f64),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::moe::reference::{moe_layer, Experts};

    fn case() -> LayerCase {
        LayerCase {
            tokens: 40,
            experts: 8,
            top_k: 2,
            hidden: 24,
            width: 16,
        }
    }

    #[test]
    fn params_round_trip_and_other_ops_are_refused() {
        let c = case();
        assert_eq!(LayerCase::from_params(&c.params()).unwrap(), c);
        let mut p = c.params();
        p.insert("op".into(), Param::Text("grouped_gemm".into()));
        assert!(LayerCase::from_params(&p)
            .unwrap_err()
            .contains("not the whole layer"));
        let small = LayerCase { hidden: 4, ..c };
        assert!(small.validate().unwrap_err().contains("routing features"));
        let many = LayerCase {
            experts: MAX_EXPERTS + 8,
            hidden: 1024,
            ..c
        };
        assert!(many.validate().unwrap_err().contains("exact in bf16"));
        // At the largest E every level is exact in bf16.
        for l in 0..MAX_EXPERTS {
            let v = l as f64 / MAX_EXPERTS as f64;
            assert_eq!(val(bits(v)), v, "level {l}");
        }
        // 2·T·H·E + 6·T·k·H·F.
        assert_eq!(
            case().flops(),
            2.0 * 40.0 * 24.0 * 8.0 + 6.0 * 40.0 * 2.0 * 24.0 * 16.0
        );
    }

    #[test]
    fn every_token_routes_by_its_levels_with_distinct_logits() {
        let c = LayerCase {
            tokens: 300,
            experts: 64,
            top_k: 8,
            hidden: 128,
            width: 16,
        };
        let inp = LayerInputs::draw(&c, 5);
        let mut counts = vec![0usize; c.experts];
        for tok in 0..c.tokens {
            let row = &inp.x[tok * c.hidden..tok * c.hidden + c.experts];
            let mut seen: Vec<u16> = row.to_vec();
            seen.sort_unstable();
            seen.dedup();
            assert_eq!(seen.len(), c.experts, "token {tok}'s levels are distinct");
            // The top-8 are the experts holding the 8 highest levels.
            let mut by_level: Vec<usize> = (0..c.experts).collect();
            by_level.sort_by(|&a, &b| val(row[b]).total_cmp(&val(row[a])));
            for &ex in &by_level[..c.top_k] {
                counts[ex] += 1;
            }
        }
        // 2400 assignments over 64 experts: every expert gets some (37.5 expected each).
        assert!(counts.iter().all(|&n| n > 10), "{counts:?}");
    }

    #[test]
    fn output_rows_match_the_reference_layer() {
        let c = case();
        let inp = LayerInputs::draw(&c, 3);
        let (e, h, f) = (c.experts, c.hidden, c.width);
        let v = |b: &[u16]| -> Vec<f64> { b.iter().map(|&x| val(x)).collect() };
        let gu = v(&inp.gate_up);
        let (mut gate, mut up) = (Vec::new(), Vec::new());
        for row in gu.chunks(2 * f) {
            gate.extend_from_slice(&row[..f]);
            up.extend_from_slice(&row[f..]);
        }
        let experts = Experts {
            experts: e,
            hidden: h,
            width: f,
            gate,
            up,
            down: v(&inp.down),
        };
        let (want, _) = moe_layer(
            &v(&inp.x),
            &v(&inp.router),
            &experts,
            c.top_k,
            Gate::Softmax,
            None,
        )
        .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let files = write_case(&c, 3, 5, dir.path()).unwrap();
        let got = crate::runner::protocol::read_f64(&files.check.reference).unwrap();
        let toks = checked_rows(&[0, c.tokens], 5);
        assert_eq!(toks, vec![0, 9, 19, 29, 39]);
        assert_eq!(got.len(), toks.len() * h);
        for (i, &tok) in toks.iter().enumerate() {
            for j in 0..h {
                let (a, b) = (got[i * h + j], want[tok * h + j]);
                assert!((a - b).abs() <= 1e-12 * (1.0 + b.abs()), "{a} vs {b}");
            }
        }
        assert_eq!(files.inputs.len(), 4);
        assert_eq!(
            files.input_bytes(),
            2 * (40 * 24 + 24 * 8 + 8 * 24 * 32 + 8 * 16 * 24)
        );
    }
}
