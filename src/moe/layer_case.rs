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
use crate::runner::protocol::{
    write_u16, CaseFiles, CheckSpec, GradientSpec, OutputSpec, TensorFile,
};
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

/// The forward (and with `backward` the backward) of one MoE layer: `tokens` tokens of width
/// `hidden` H, each routed by softmax top-k (`top_k` of `experts` E, dropless) to SwiGLU
/// experts of width `width` F; bf16 activations and weights.
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
    /// The forward and the backward (dx and every weight's gradient from the output's dy),
    /// not the forward alone.
    pub backward: bool,
}

/// Expert-width columns whose weight gradients a fwd+bwd case checks (the first two and the
/// last two of F): dW_down's rows and dW_gate / dW_up's columns at these indices.
pub fn checked_width_columns(f: usize) -> Vec<usize> {
    let mut j: Vec<usize> = [0, 1, f.saturating_sub(2), f.saturating_sub(1)]
        .into_iter()
        .filter(|&j| j < f)
        .collect();
    j.sort_unstable();
    j.dedup();
    j
}

/// Rows of H (dW_gate / dW_up's k-rows) a fwd+bwd case checks: [`super::files::DW_ROWS`]
/// evenly spaced, the first and the last among them.
pub fn checked_hidden_rows(h: usize) -> Vec<usize> {
    let n = super::files::DW_ROWS.min(h);
    let mut i: Vec<usize> = if n < 2 {
        vec![0]
    } else {
        (0..n).map(|r| r * (h - 1) / (n - 1)).collect()
    };
    i.dedup();
    i
}

impl LayerCase {
    /// The case as named parameters for a document row: `op` ([`OP`]), `tokens`, `experts`,
    /// `top_k`, `hidden`, `width`, `spread` ([`SPREAD`]), `dtype` (`bf16`), `pass` (`fwd` or
    /// `fwd+bwd`).
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
            if self.backward { "fwd+bwd" } else { "fwd" },
        )
    }

    /// The case named by `p` ([`LayerCase::params`]).
    ///
    /// # Errors
    /// Another op, a missing or mistyped parameter, a pass other than `fwd` or `fwd+bwd`, a
    /// dtype other than bf16, or sizes [`LayerCase::validate`] refuses.
    pub fn from_params(p: &BTreeMap<String, Param>) -> Result<LayerCase, String> {
        let int = |k: &str| crate::schema::param_size(p, k);
        let text = |k: &str| crate::schema::param_name(p, k);
        if text("op")? != OP {
            return Err(format!(
                "op `{}` is not the whole layer (`{OP}`)",
                text("op")?
            ));
        }
        let backward = match text("pass")? {
            "fwd" => false,
            "fwd+bwd" => true,
            other => return Err(format!("pass `{other}`: the layer runs `fwd` or `fwd+bwd`")),
        };
        if text("dtype")? != "bf16" {
            return Err(format!("dtype `{}`: the layer is bf16", text("dtype")?));
        }
        let c = LayerCase {
            tokens: int("tokens")?,
            experts: int("experts")?,
            top_k: int("top_k")?,
            hidden: int("hidden")?,
            width: int("width")?,
            backward,
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
    /// softmax, SwiGLU and the weighted sum, not counted); with the backward three times as
    /// many (each product's dX and dW as many again as its forward).
    pub fn flops(&self) -> f64 {
        let (t, e, k, h, f) = (
            self.tokens as f64,
            self.experts as f64,
            self.top_k as f64,
            self.hidden as f64,
            self.width as f64,
        );
        let passes = if self.backward { 3.0 } else { 1.0 };
        passes * (2.0 * t * h * e + 6.0 * t * k * h * f)
    }

    /// Bytes one call must move at least, bf16: x, the router and every expert's three
    /// matrices read once, the output written; with the backward also dy read and dx and the
    /// four weights' gradients written.
    pub fn bytes(&self) -> f64 {
        let (t, e, h, f) = (
            self.tokens as f64,
            self.experts as f64,
            self.hidden as f64,
            self.width as f64,
        );
        let fwd = 2.0 * (t * h + h * e + 3.0 * e * h * f + t * h);
        if self.backward {
            fwd + 2.0 * (2.0 * t * h + h * e + 3.0 * e * h * f)
        } else {
            fwd
        }
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
        let (h, f) = (c.hidden, c.width);
        let xr: Vec<f64> = self.x[tok * h..(tok + 1) * h]
            .iter()
            .map(|&b| val(b))
            .collect();
        let routing = self.routing_of(c, &xr);
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

    /// Token `tok`'s output row and its row of dL/dx in float64 (H values each) for the
    /// output's gradient `dy` `[T, H]` (L = Σ dy ⊙ out), by the chain rule of
    /// [`super::reference::moe_layer_backward`] restricted to the token: its experts' outputs
    /// give the gate weights' gradients, their backward the experts' share of dx, the softmax
    /// gates' backward and the router the rest.
    pub fn token_backward(&self, c: &LayerCase, dy: &[u16], tok: usize) -> (Vec<f64>, Vec<f64>) {
        let (e, h, f) = (c.experts, c.hidden, c.width);
        let xr: Vec<f64> = self.x[tok * h..(tok + 1) * h]
            .iter()
            .map(|&b| val(b))
            .collect();
        let dyr: Vec<f64> = dy[tok * h..(tok + 1) * h].iter().map(|&b| val(b)).collect();
        let routing = self.routing_of(c, &xr);
        let mut out = vec![0.0f64; h];
        let mut dx = vec![0.0f64; h];
        let mut dweights = Vec::with_capacity(c.top_k);
        for (&ex, &gw) in routing.experts.iter().zip(&routing.weights) {
            let wgu = &self.gate_up[ex * h * 2 * f..(ex + 1) * h * 2 * f];
            let wd = &self.down[ex * f * h..(ex + 1) * f * h];
            let mut gu = vec![0.0f64; 2 * f];
            for (i, &xv) in xr.iter().enumerate() {
                for (a, &w) in gu.iter_mut().zip(&wgu[i * 2 * f..(i + 1) * 2 * f]) {
                    *a += xv * val(w);
                }
            }
            let mut y = vec![0.0f64; h];
            let mut dgu = vec![0.0f64; 2 * f];
            for j in 0..f {
                let (g, u) = (gu[j], gu[f + j]);
                let s = 1.0 / (1.0 + (-g).exp());
                let row = &wd[j * h..(j + 1) * h];
                let mut dact = 0.0;
                for ((yv, &w), &d) in y.iter_mut().zip(row).zip(&dyr) {
                    *yv += g * s * u * val(w);
                    dact += val(w) * gw * d;
                }
                dgu[j] = dact * u * s * (1.0 + g * (1.0 - s));
                dgu[f + j] = dact * g * s;
            }
            for (o, &yv) in out.iter_mut().zip(&y) {
                *o += gw * yv;
            }
            dweights.push(y.iter().zip(&dyr).map(|(a, b)| a * b).sum::<f64>());
            for (i, d) in dx.iter_mut().enumerate() {
                *d += wgu[i * 2 * f..(i + 1) * 2 * f]
                    .iter()
                    .zip(&dgu)
                    .map(|(&w, g)| val(w) * g)
                    .sum::<f64>();
            }
        }
        let cw: f64 = routing
            .weights
            .iter()
            .zip(&dweights)
            .map(|(w, d)| w * d)
            .sum();
        for (j, &ex) in routing.experts.iter().enumerate() {
            let dl = routing.weights[j] * (dweights[j] - cw);
            for (i, d) in dx.iter_mut().enumerate() {
                *d += dl * val(self.router[i * e + ex]);
            }
        }
        (out, dx)
    }

    /// The routing of one token's row `xr` (H values): its logits x · W_router (the router's
    /// zero entries skipped) and the softmax top-k of [`route`].
    fn routing_of(&self, c: &LayerCase, xr: &[f64]) -> super::reference::Routing {
        let e = c.experts;
        let mut logits = vec![0.0f64; e];
        for (i, &xv) in xr.iter().enumerate() {
            for (l, &w) in logits.iter_mut().zip(&self.router[i * e..(i + 1) * e]) {
                if w != 0 {
                    *l += xv * val(w);
                }
            }
        }
        route(&logits, 1, e, c.top_k, Gate::Softmax)
            .expect("finite logits of one token, 1 ≤ top_k ≤ E (validated)")
    }

    /// Slices of the experts' weight gradients in float64 for the output's gradient `dy`:
    /// dW_gate_up `[E, H, 2F]` at the k-rows [`checked_hidden_rows`] and the gate and up
    /// columns [`checked_width_columns`], and dW_down `[E, F, H]` at the rows
    /// [`checked_width_columns`] (every column). Each element sums over all of the expert's
    /// tokens, so every token is routed and, per (token, expert), only the checked columns'
    /// gate, up and activation gradients are formed (about 4 · 4H multiply-adds each).
    /// Returns (ranges, values) for each, in the tensors' flat order.
    #[allow(clippy::type_complexity)]
    pub fn weight_grad_slices(
        &self,
        c: &LayerCase,
        dy: &[u16],
    ) -> ((Vec<[u64; 2]>, Vec<f64>), (Vec<[u64; 2]>, Vec<f64>)) {
        let (e, h, f) = (c.experts, c.hidden, c.width);
        let cols = checked_width_columns(f);
        let krows = checked_hidden_rows(h);
        // Each expert's tokens and gate weights, in token order.
        let routed: Vec<Vec<(usize, usize, f64)>> = (0..c.tokens)
            .into_par_iter()
            .map(|tok| {
                let xr: Vec<f64> = self.x[tok * h..(tok + 1) * h]
                    .iter()
                    .map(|&b| val(b))
                    .collect();
                let r = self.routing_of(c, &xr);
                r.experts
                    .iter()
                    .zip(&r.weights)
                    .map(|(&ex, &w)| (ex, tok, w))
                    .collect()
            })
            .collect();
        let mut by_expert: Vec<Vec<(usize, f64)>> = vec![Vec::new(); e];
        for (ex, tok, w) in routed.into_iter().flatten() {
            by_expert[ex].push((tok, w));
        }
        // Per expert: dW_gate_up's slice [krows, 2 · cols] and dW_down's rows [cols, H].
        let per_expert: Vec<(Vec<f64>, Vec<f64>)> = by_expert
            .par_iter()
            .enumerate()
            .map(|(ex, toks)| {
                let wgu = &self.gate_up[ex * h * 2 * f..(ex + 1) * h * 2 * f];
                let wd = &self.down[ex * f * h..(ex + 1) * f * h];
                let mut dgu = vec![0.0f64; krows.len() * 2 * cols.len()];
                let mut ddown = vec![0.0f64; cols.len() * h];
                for &(tok, gw) in toks {
                    let xr = &self.x[tok * h..(tok + 1) * h];
                    let dyr = &dy[tok * h..(tok + 1) * h];
                    for (ci, &j) in cols.iter().enumerate() {
                        let (mut g, mut u, mut dact) = (0.0f64, 0.0f64, 0.0f64);
                        for (i, &xb) in xr.iter().enumerate() {
                            let xv = val(xb);
                            g += xv * val(wgu[i * 2 * f + j]);
                            u += xv * val(wgu[i * 2 * f + f + j]);
                        }
                        for (&w, &d) in wd[j * h..(j + 1) * h].iter().zip(dyr) {
                            dact += val(w) * gw * val(d);
                        }
                        let s = 1.0 / (1.0 + (-g).exp());
                        let act = g * s * u;
                        for (o, &d) in ddown[ci * h..(ci + 1) * h].iter_mut().zip(dyr) {
                            *o += act * gw * val(d);
                        }
                        let dg = dact * u * s * (1.0 + g * (1.0 - s));
                        let du = dact * g * s;
                        for (ri, &i) in krows.iter().enumerate() {
                            let xv = val(xr[i]);
                            dgu[ri * 2 * cols.len() + ci] += xv * dg;
                            dgu[(ri * 2 + 1) * cols.len() + ci] += xv * du;
                        }
                    }
                }
                (dgu, ddown)
            })
            .collect();
        let (mut gu_ranges, mut gu_values) = (Vec::new(), Vec::new());
        let (mut d_ranges, mut d_values) = (Vec::new(), Vec::new());
        for (ex, (dgu, ddown)) in per_expert.iter().enumerate() {
            for (ri, &i) in krows.iter().enumerate() {
                // The gate columns, then the up columns (F further on), one element each.
                for half in 0..2 {
                    for (ci, &j) in cols.iter().enumerate() {
                        let at = (ex * h + i) * 2 * f + half * f + j;
                        gu_ranges.push([at as u64, 1]);
                        gu_values.push(dgu[(ri * 2 + half) * cols.len() + ci]);
                    }
                }
            }
            for (ci, &j) in cols.iter().enumerate() {
                d_ranges.push([((ex * f + j) * h) as u64, h as u64]);
                d_values.extend_from_slice(&ddown[ci * h..(ci + 1) * h]);
            }
        }
        ((gu_ranges, gu_values), (d_ranges, d_values))
    }
}

/// The call's arguments for the comparison modules: `tokens`, `experts`, `top_k`, `hidden`
/// (H), `width` (F), `gate` (`softmax`), `capacity` (null: dropless), `backward`.
pub fn arguments(c: &LayerCase) -> BTreeMap<String, serde_json::Value> {
    let mut m = BTreeMap::new();
    m.insert("tokens".into(), json!(c.tokens));
    m.insert("experts".into(), json!(c.experts));
    m.insert("top_k".into(), json!(c.top_k));
    m.insert("hidden".into(), json!(c.hidden));
    m.insert("width".into(), json!(c.width));
    m.insert("gate".into(), json!("softmax"));
    m.insert("capacity".into(), serde_json::Value::Null);
    m.insert("backward".into(), json!(c.backward));
    m
}

/// Writes case `c`'s inputs ([`LayerInputs::draw`] from `seed`; with the backward also dy
/// from `seed + 3`, uniform in [−1, 1)) and the float64 references of its checked output rows
/// into `dir`, and returns the files. With the backward the gradients are dx (the same token
/// rows, [`LayerInputs::token_backward`]), dW_gate_up and dW_down (slices,
/// [`LayerInputs::weight_grad_slices`]); the router's gradient is computed by every
/// implementation but not an output: its float64 reference needs every token's expert
/// outputs (T · top_k · 3 · H · F multiply-adds), which the GPU test checks at small sizes.
///
/// # Errors
/// I/O errors, with the path.
pub fn write_case(c: &LayerCase, seed: u64, check_rows: usize, dir: &Path) -> Result<CaseFiles> {
    let (t, e, h, f) = (c.tokens, c.experts, c.hidden, c.width);
    let inp = LayerInputs::draw(c, seed);
    let dy = if c.backward {
        uniform_bf16(t * h, seed + 3)
    } else {
        Vec::new()
    };
    let bf16 = "bf16".to_string();
    let mut inputs = Vec::new();
    let mut tensors = vec![
        ("x", &inp.x, vec![t, h]),
        ("router", &inp.router, vec![h, e]),
        ("gate_up", &inp.gate_up, vec![e, h, 2 * f]),
        ("down", &inp.down, vec![e, f, h]),
    ];
    if c.backward {
        tensors.push(("dy", &dy, vec![t, h]));
    }
    for (name, data, shape) in tensors {
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
    let (values, dx_values): (Vec<f64>, Vec<f64>) = if c.backward {
        let rows: Vec<(Vec<f64>, Vec<f64>)> = toks
            .par_iter()
            .map(|&tok| inp.token_backward(c, &dy, tok))
            .collect();
        (
            rows.iter().flat_map(|r| r.0.iter().copied()).collect(),
            rows.iter().flat_map(|r| r.1.iter().copied()).collect(),
        )
    } else {
        (
            toks.par_iter()
                .flat_map_iter(|&tok| inp.output_row(c, tok))
                .collect(),
            Vec::new(),
        )
    };
    let token_ranges: Vec<[u64; 2]> = toks
        .iter()
        .map(|&tok| [(tok * h) as u64, h as u64])
        .collect();
    let mut gradients = Vec::new();
    if c.backward {
        let dx_check = CheckSpec::write_float64(
            dir.join("reference_dx.f64"),
            &dx_values,
            token_ranges.clone(),
            TOLERANCE,
            format!("the same {} tokens' rows of dx", toks.len()),
        )?;
        let ((gu_ranges, gu_values), (d_ranges, d_values)) = inp.weight_grad_slices(c, &dy);
        let cols = checked_width_columns(f);
        let gu_check = CheckSpec::write_float64(
            dir.join("reference_dgate_up.f64"),
            &gu_values,
            gu_ranges,
            TOLERANCE,
            format!(
                "every expert's dW_gate and dW_up at {} k-rows × {} columns (the first and last two of F)",
                checked_hidden_rows(h).len(),
                cols.len()
            ),
        )?;
        let d_check = CheckSpec::write_float64(
            dir.join("reference_ddown.f64"),
            &d_values,
            d_ranges,
            TOLERANCE,
            format!(
                "every expert's dW_down at {} rows (the first and last two of F), every column",
                cols.len()
            ),
        )?;
        for (name, input, shape, check) in [
            ("dx", "x", vec![t, h], dx_check),
            ("dW_gate_up", "gate_up", vec![e, h, 2 * f], gu_check),
            ("dW_down", "down", vec![e, f, h], d_check),
        ] {
            gradients.push(GradientSpec {
                name: name.into(),
                input: input.into(),
                output: OutputSpec {
                    dtype: bf16.clone(),
                    shape,
                },
                check,
            });
        }
    }
    let check = CheckSpec::write_float64(
        dir.join("reference_out.f64"),
        &values,
        token_ranges,
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
        gradients,
        arguments: arguments(c),
        flops: Some(c.flops()),
        bytes: Some(c.bytes()),
        items: Some(t as f64),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::moe::reference::{moe_layer, moe_layer_backward, Experts};

    fn case() -> LayerCase {
        LayerCase {
            tokens: 40,
            experts: 8,
            top_k: 2,
            hidden: 24,
            width: 16,
            backward: false,
        }
    }

    /// The reference's experts from a case's drawn bf16 weights (gate and up split apart).
    fn experts_of(c: &LayerCase, inp: &LayerInputs) -> Experts {
        let f = c.width;
        let v = |b: &[u16]| -> Vec<f64> { b.iter().map(|&x| val(x)).collect() };
        let (mut gate, mut up) = (Vec::new(), Vec::new());
        for row in v(&inp.gate_up).chunks(2 * f) {
            gate.extend_from_slice(&row[..f]);
            up.extend_from_slice(&row[f..]);
        }
        Experts {
            experts: c.experts,
            hidden: c.hidden,
            width: f,
            gate,
            up,
            down: v(&inp.down),
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
            backward: false,
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
    fn backward_references_match_the_reference_layer() {
        let c = LayerCase {
            backward: true,
            ..case()
        };
        assert_eq!(LayerCase::from_params(&c.params()).unwrap(), c);
        assert_eq!(c.flops(), 3.0 * case().flops());
        let inp = LayerInputs::draw(&c, 4);
        let (e, h, f) = (c.experts, c.hidden, c.width);
        let v = |b: &[u16]| -> Vec<f64> { b.iter().map(|&x| val(x)).collect() };
        let experts = experts_of(&c, &inp);
        let dir = tempfile::tempdir().unwrap();
        let files = write_case(&c, 4, 5, dir.path()).unwrap();
        assert_eq!(files.inputs.last().unwrap().name, "dy");
        let dy = v(&crate::runner::protocol::read_u16(&files.inputs.last().unwrap().path).unwrap());
        let want = moe_layer_backward(
            &v(&inp.x),
            &v(&inp.router),
            &experts,
            c.top_k,
            Gate::Softmax,
            None,
            &dy,
        )
        .unwrap();
        let names: Vec<&str> = files.gradients.iter().map(|g| g.name.as_str()).collect();
        assert_eq!(names, ["dx", "dW_gate_up", "dW_down"]);
        // Each checked element against the reference's, by its flat index.
        let mut gate_up_want = Vec::new();
        for r in 0..e * h {
            gate_up_want.extend_from_slice(&want.gate[r * f..(r + 1) * f]);
            gate_up_want.extend_from_slice(&want.up[r * f..(r + 1) * f]);
        }
        for (g, full) in files
            .gradients
            .iter()
            .zip([&want.dx, &gate_up_want, &want.down])
        {
            let got = crate::runner::protocol::read_f64(&g.check.reference).unwrap();
            let mut at = 0;
            for &[start, len] in &g.check.ranges {
                for i in start..start + len {
                    let (a, b) = (got[at], full[i as usize]);
                    assert!(
                        (a - b).abs() <= 1e-10 * (1.0 + b.abs()),
                        "{} [{i}]: {a} vs {b}",
                        g.name
                    );
                    at += 1;
                }
            }
            assert_eq!(at, got.len(), "{}", g.name);
            assert!(at > 0 && got.iter().any(|&x| x != 0.0), "{}", g.name);
        }
        // Every expert's slices: 4 k-rows × (2 + 2 gate and up columns) and 4 rows of dW_down.
        assert_eq!(files.gradients[1].check.ranges.len(), e * 4 * 2 * 4);
        assert_eq!(files.gradients[2].check.ranges.len(), e * 4);
    }

    #[test]
    fn output_rows_match_the_reference_layer() {
        let c = case();
        let inp = LayerInputs::draw(&c, 3);
        let h = c.hidden;
        let v = |b: &[u16]| -> Vec<f64> { b.iter().map(|&x| val(x)).collect() };
        let experts = experts_of(&c, &inp);
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
