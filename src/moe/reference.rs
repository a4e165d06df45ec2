//! The float64 definition of the MoE operations: written for clarity, one loop per formula,
//! what the kernels and the alternatives are checked against.
//!
//! - [`grouped_matmul`]: Y = X W_e for the rows of each expert e (the ragged grouped GEMM of
//!   MegaBlocks, Gale et al., MLSys 2023, and of `torch._grouped_mm`), and
//!   [`grouped_matmul_backward`]: dX = dY W_eᵀ per row, dW_e = X_eᵀ dY_e per expert.
//! - [`route`]: top-k routing from router logits, with softmax gates (Mixtral, Jiang et al.,
//!   2024: the softmax over the chosen experts' logits) or sigmoid gates normalised over the
//!   chosen experts (DeepSeek-V3, 2024).
//! - [`DispatchPlan`]: the permutation of (token, slot) assignments into expert order by a
//!   stable counting sort (not a one-hot matrix product), dropless or with a per-expert
//!   capacity (the first assignments in token order kept, as in GShard, Lepikhin et al., 2021);
//!   [`dispatch`] gathers the rows, [`combine`] scatters them back weighted by their gates.
//! - [`swiglu_experts`] and [`moe_layer`]: the expert MLP (SwiGLU, Shazeer, 2020:
//!   (silu(x W_gate) ⊙ x W_up) W_down) per expert and the whole layer.

use std::fmt;

/// What is wrong with the arguments of a reference call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShapeError(pub String);

impl fmt::Display for ShapeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "moe: {}", self.0)
    }
}

impl std::error::Error for ShapeError {}

fn check(what: &str, got: usize, want: usize) -> Result<(), ShapeError> {
    if got == want {
        Ok(())
    } else {
        Err(ShapeError(format!(
            "{what} holds {got} elements, expected {want}"
        )))
    }
}

/// Checks `offsets` `[E + 1]`: starts at 0, never decreases, ends at `rows`.
///
/// # Errors
/// [`ShapeError`] naming the first offset that breaks a rule.
pub fn check_offsets(offsets: &[usize], experts: usize, rows: usize) -> Result<(), ShapeError> {
    check("offsets", offsets.len(), experts + 1)?;
    if offsets[0] != 0 {
        return Err(ShapeError(format!("offsets[0] is {}, not 0", offsets[0])));
    }
    if let Some(e) = (0..experts).find(|&e| offsets[e + 1] < offsets[e]) {
        return Err(ShapeError(format!(
            "offsets[{}] = {} is below offsets[{e}] = {}",
            e + 1,
            offsets[e + 1],
            offsets[e]
        )));
    }
    if offsets[experts] != rows {
        return Err(ShapeError(format!(
            "offsets end at {}, not at the {rows} rows",
            offsets[experts]
        )));
    }
    Ok(())
}

/// The offsets `[E + 1]` of groups of `counts[e]` rows, in expert order.
pub fn offsets_of(counts: &[usize]) -> Vec<usize> {
    let mut offsets = Vec::with_capacity(counts.len() + 1);
    offsets.push(0);
    for &c in counts {
        offsets.push(offsets.last().copied().unwrap_or(0) + c);
    }
    offsets
}

/// The grouped GEMM: Y `[M, N]` with Y\[r\] = X\[r\] W_e for the rows r of expert e, from X
/// `[M, K]`, W `[E, K, N]` and `offsets` `[E + 1]` (M = offsets\[E\]; empty groups allowed).
///
/// # Errors
/// [`ShapeError`] for lengths that do not fit or offsets that are not a partition of the rows.
pub fn grouped_matmul(
    x: &[f64],
    w: &[f64],
    offsets: &[usize],
    k: usize,
    n: usize,
) -> Result<Vec<f64>, ShapeError> {
    let experts = offsets.len().saturating_sub(1);
    let m = offsets.last().copied().unwrap_or(0);
    check_offsets(offsets, experts, m)?;
    check("x", x.len(), m * k)?;
    check("w", w.len(), experts * k * n)?;
    let mut y = vec![0.0; m * n];
    for e in 0..experts {
        let we = &w[e * k * n..(e + 1) * k * n];
        for r in offsets[e]..offsets[e + 1] {
            for j in 0..n {
                y[r * n + j] = (0..k).map(|i| x[r * k + i] * we[i * n + j]).sum();
            }
        }
    }
    Ok(y)
}

/// The two products of the grouped GEMM's backward from dY `[M, N]`: dX `[M, K]` with
/// dX\[r\] = dY\[r\] W_eᵀ, and dW `[E, K, N]` with dW_e = X_eᵀ dY_e (zero for an empty group).
///
/// # Errors
/// As [`grouped_matmul`], and for dY's length.
pub fn grouped_matmul_backward(
    x: &[f64],
    w: &[f64],
    offsets: &[usize],
    dy: &[f64],
    k: usize,
    n: usize,
) -> Result<(Vec<f64>, Vec<f64>), ShapeError> {
    let experts = offsets.len().saturating_sub(1);
    let m = offsets.last().copied().unwrap_or(0);
    check_offsets(offsets, experts, m)?;
    check("x", x.len(), m * k)?;
    check("w", w.len(), experts * k * n)?;
    check("dy", dy.len(), m * n)?;
    let mut dx = vec![0.0; m * k];
    let mut dw = vec![0.0; experts * k * n];
    for e in 0..experts {
        let we = &w[e * k * n..(e + 1) * k * n];
        for r in offsets[e]..offsets[e + 1] {
            for i in 0..k {
                dx[r * k + i] = (0..n).map(|j| dy[r * n + j] * we[i * n + j]).sum();
            }
        }
        for i in 0..k {
            for j in 0..n {
                dw[(e * k + i) * n + j] = (offsets[e]..offsets[e + 1])
                    .map(|r| x[r * k + i] * dy[r * n + j])
                    .sum();
            }
        }
    }
    Ok((dx, dw))
}

/// How router scores become gate weights ([`route`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gate {
    /// The softmax over the chosen experts' logits (equal to the full softmax's top-k values
    /// renormalised to sum 1; Mixtral).
    Softmax,
    /// sigmoid(logit) of the chosen experts, divided by their sum (DeepSeek-V3).
    Sigmoid,
}

/// Each token's chosen experts and gate weights: `experts` and `weights` `[T, top_k]`, a
/// token's experts in decreasing logit (ties: the lower expert index first).
#[derive(Clone, Debug, PartialEq)]
pub struct Routing {
    /// Tokens routed.
    pub tokens: usize,
    /// Experts per token.
    pub top_k: usize,
    /// The chosen experts, `[T, top_k]`.
    pub experts: Vec<usize>,
    /// Their gate weights, `[T, top_k]`, summing to 1 per token.
    pub weights: Vec<f64>,
}

/// Top-k routing of `tokens` tokens from router logits `[T, E]`.
///
/// # Errors
/// [`ShapeError`] for a logits length other than T·E, `top_k` of 0 or above E, or a logit that
/// is not finite.
pub fn route(
    logits: &[f64],
    tokens: usize,
    experts: usize,
    top_k: usize,
    gate: Gate,
) -> Result<Routing, ShapeError> {
    check("logits", logits.len(), tokens * experts)?;
    if top_k == 0 || top_k > experts {
        return Err(ShapeError(format!(
            "top_k {top_k} must be between 1 and the {experts} experts"
        )));
    }
    if let Some(i) = logits.iter().position(|v| !v.is_finite()) {
        return Err(ShapeError(format!("logit {i} is {}", logits[i])));
    }
    let mut chosen = Vec::with_capacity(tokens * top_k);
    let mut weights = Vec::with_capacity(tokens * top_k);
    for t in 0..tokens {
        let row = &logits[t * experts..(t + 1) * experts];
        let mut order: Vec<usize> = (0..experts).collect();
        // Stable: equal logits keep the lower index first.
        order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
        let top = &order[..top_k];
        let scores: Vec<f64> = match gate {
            Gate::Softmax => {
                let max = row[top[0]];
                top.iter().map(|&e| (row[e] - max).exp()).collect()
            }
            Gate::Sigmoid => top.iter().map(|&e| 1.0 / (1.0 + (-row[e]).exp())).collect(),
        };
        let sum: f64 = scores.iter().sum();
        chosen.extend_from_slice(top);
        weights.extend(scores.iter().map(|s| s / sum));
    }
    Ok(Routing {
        tokens,
        top_k,
        experts: chosen,
        weights,
    })
}

/// The permutation of a [`Routing`]'s assignments into expert order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DispatchPlan {
    /// Experts.
    pub experts: usize,
    /// Experts per token of the routing planned.
    pub top_k: usize,
    /// Rows of each expert: expert e owns dispatched rows `offsets[e] .. offsets[e + 1]`.
    pub offsets: Vec<usize>,
    /// For each dispatched row, its assignment `token · top_k + slot`, in expert order and,
    /// within an expert, in token order.
    pub rows: Vec<usize>,
    /// For each assignment `token · top_k + slot`, its dispatched row, or `None` where the
    /// expert's capacity was full (the assignment is dropped: it adds nothing in [`combine`]).
    pub row_of: Vec<Option<usize>>,
}

impl DispatchPlan {
    /// Assignments the capacity dropped (no dispatched row).
    pub fn dropped(&self) -> usize {
        self.row_of.iter().filter(|r| r.is_none()).count()
    }
}

/// Sorts `routing`'s assignments by expert (a stable counting sort: within an expert, token
/// order), keeping at most `capacity` per expert (`None`: dropless).
///
/// # Errors
/// [`ShapeError`] for a routing whose lengths do not match or that names an expert ≥ `experts`.
pub fn plan(
    routing: &Routing,
    experts: usize,
    capacity: Option<usize>,
) -> Result<DispatchPlan, ShapeError> {
    let assignments = routing.tokens * routing.top_k;
    check("routing experts", routing.experts.len(), assignments)?;
    check("routing weights", routing.weights.len(), assignments)?;
    if let Some(a) = routing.experts.iter().position(|&e| e >= experts) {
        return Err(ShapeError(format!(
            "assignment {a} names expert {}, of {experts}",
            routing.experts[a]
        )));
    }
    let limit = capacity.unwrap_or(usize::MAX);
    let mut counts = vec![0usize; experts];
    let mut kept = vec![false; assignments];
    for (a, &e) in routing.experts.iter().enumerate() {
        if counts[e] < limit {
            counts[e] += 1;
            kept[a] = true;
        }
    }
    let offsets = offsets_of(&counts);
    let mut next = offsets[..experts].to_vec();
    let mut rows = vec![0; offsets[experts]];
    let mut row_of = vec![None; assignments];
    for (a, &e) in routing.experts.iter().enumerate() {
        if kept[a] {
            rows[next[e]] = a;
            row_of[a] = Some(next[e]);
            next[e] += 1;
        }
    }
    Ok(DispatchPlan {
        experts,
        top_k: routing.top_k,
        offsets,
        rows,
        row_of,
    })
}

/// Gathers the tokens' rows of `x` `[T, H]` into expert order: `[rows, H]`, row r the token of
/// assignment `plan.rows[r]`.
///
/// # Errors
/// [`ShapeError`] for an `x` whose length is not T·H, T the plan's tokens.
pub fn dispatch(x: &[f64], plan: &DispatchPlan, h: usize) -> Result<Vec<f64>, ShapeError> {
    let top_k = plan.top_k.max(1);
    let tokens = plan.row_of.len() / top_k;
    check("x", x.len(), tokens * h)?;
    let mut out = Vec::with_capacity(plan.rows.len() * h);
    for &a in &plan.rows {
        let t = a / top_k;
        out.extend_from_slice(&x[t * h..(t + 1) * h]);
    }
    Ok(out)
}

/// The weighted combine: out\[t\] = Σ_slot weight(t, slot) · y\[row of (t, slot)\] over the
/// kept assignments, from the experts' outputs `y` `[rows, H]` in the plan's order; `[T, H]`.
///
/// # Errors
/// [`ShapeError`] for a `y` whose length is not rows·H or a routing of another size.
pub fn combine(
    y: &[f64],
    plan: &DispatchPlan,
    routing: &Routing,
    h: usize,
) -> Result<Vec<f64>, ShapeError> {
    check("y", y.len(), plan.rows.len() * h)?;
    check("routing weights", routing.weights.len(), plan.row_of.len())?;
    let mut out = vec![0.0; routing.tokens * h];
    for (a, row) in plan.row_of.iter().enumerate() {
        if let Some(r) = row {
            let t = a / routing.top_k;
            let w = routing.weights[a];
            for j in 0..h {
                out[t * h + j] += w * y[r * h + j];
            }
        }
    }
    Ok(out)
}

/// The weights of E SwiGLU experts of width H and hidden width F: `gate` and `up` `[E, H, F]`,
/// `down` `[E, F, H]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Experts {
    /// Experts.
    pub experts: usize,
    /// Model width H.
    pub hidden: usize,
    /// Expert width F.
    pub width: usize,
    /// W_gate `[E, H, F]`.
    pub gate: Vec<f64>,
    /// W_up `[E, H, F]`.
    pub up: Vec<f64>,
    /// W_down `[E, F, H]`.
    pub down: Vec<f64>,
}

/// Each expert's SwiGLU MLP on its rows: out\[r\] = (silu(x\[r\] W_gate,e) ⊙ x\[r\] W_up,e) W_down,e,
/// silu(z) = z / (1 + e^(−z)), from rows `xs` `[M, H]` in expert order (`offsets` `[E + 1]`).
///
/// # Errors
/// [`ShapeError`] for lengths that do not fit.
pub fn swiglu_experts(
    xs: &[f64],
    experts: &Experts,
    offsets: &[usize],
) -> Result<Vec<f64>, ShapeError> {
    let (e, h, f) = (experts.experts, experts.hidden, experts.width);
    check("experts' gate", experts.gate.len(), e * h * f)?;
    check("experts' up", experts.up.len(), e * h * f)?;
    check("experts' down", experts.down.len(), e * f * h)?;
    let g = grouped_matmul(xs, &experts.gate, offsets, h, f)?;
    let u = grouped_matmul(xs, &experts.up, offsets, h, f)?;
    let act: Vec<f64> = g
        .iter()
        .zip(&u)
        .map(|(&z, &v)| z / (1.0 + (-z).exp()) * v)
        .collect();
    grouped_matmul(&act, &experts.down, offsets, f, h)
}

/// The whole MoE layer on `x` `[T, H]`: router logits x W_router (`router` `[H, E]`), [`route`],
/// [`plan`], [`dispatch`], [`swiglu_experts`], [`combine`]; returns `[T, H]` and the routing.
///
/// # Errors
/// [`ShapeError`] from any step.
pub fn moe_layer(
    x: &[f64],
    router: &[f64],
    experts: &Experts,
    top_k: usize,
    gate: Gate,
    capacity: Option<usize>,
) -> Result<(Vec<f64>, Routing), ShapeError> {
    let (e, h) = (experts.experts, experts.hidden);
    let routing = layer_routing(x, router, experts, top_k, gate)?;
    let plan = plan(&routing, e, capacity)?;
    let xs = dispatch(x, &plan, h)?;
    let ys = swiglu_experts(&xs, experts, &plan.offsets)?;
    Ok((combine(&ys, &plan, &routing, h)?, routing))
}

/// The gradients of [`moe_layer`]'s output against its inputs and weights
/// ([`moe_layer_backward`]).
#[derive(Clone, Debug, PartialEq)]
pub struct LayerGrads {
    /// dL/dx `[T, H]`: the experts' share through the gather's inverse plus the router's.
    pub dx: Vec<f64>,
    /// dL/dW_router `[H, E]`.
    pub router: Vec<f64>,
    /// dL/dW_gate `[E, H, F]`.
    pub gate: Vec<f64>,
    /// dL/dW_up `[E, H, F]`.
    pub up: Vec<f64>,
    /// dL/dW_down `[E, F, H]`.
    pub down: Vec<f64>,
}

/// The backward of [`moe_layer`] for the output's gradient `dy` `[T, H]` (the loss
/// L = Σ dy ⊙ out), by the chain rule through each step with the routing's choice held fixed
/// (top-k selection passes no gradient; a dropped assignment passes none): the combine's
/// backward (each kept row's gradient is its gate weight times its token's dy, each gate
/// weight's gradient is dy · that row), the experts' (SwiGLU: with s = sigmoid(g),
/// d/dg silu(g) = s (1 + g (1 − s)); the grouped GEMMs' by [`grouped_matmul_backward`]), the
/// gather's inverse (each token sums its kept rows' gradients), the gates' (softmax:
/// dl_j = w_j (dw_j − Σ_k w_k dw_k); sigmoid: s_j (1 − s_j)(dw_j − Σ_k w_k dw_k) / Σ_k s_k), and
/// the router's GEMM.
///
/// # Errors
/// [`ShapeError`] as [`moe_layer`], and for dy's length.
#[allow(clippy::too_many_arguments)]
pub fn moe_layer_backward(
    x: &[f64],
    router: &[f64],
    experts: &Experts,
    top_k: usize,
    gate: Gate,
    capacity: Option<usize>,
    dy: &[f64],
) -> Result<LayerGrads, ShapeError> {
    let routing = layer_routing(x, router, experts, top_k, gate)?;
    moe_layer_backward_routed(x, router, experts, &routing, gate, capacity, dy)
}

/// The layer's routing of x `[T, H]` by the router `[H, E]`: the shapes checked, the logits,
/// then [`route`] (what [`moe_layer`] and [`moe_layer_backward`] both start with).
fn layer_routing(
    x: &[f64],
    router: &[f64],
    experts: &Experts,
    top_k: usize,
    gate: Gate,
) -> Result<Routing, ShapeError> {
    let (e, h) = (experts.experts, experts.hidden);
    if h == 0 {
        return Err(ShapeError("hidden width 0".into()));
    }
    let tokens = x.len() / h;
    check("x", x.len(), tokens * h)?;
    check("router", router.len(), h * e)?;
    let logits = router_logits(x, router, tokens, h, e);
    route(&logits, tokens, e, top_k, gate)
}

/// x · W_router: `[T, E]` from x `[T, H]` and `router` `[H, E]`.
fn router_logits(x: &[f64], router: &[f64], tokens: usize, h: usize, e: usize) -> Vec<f64> {
    let mut logits = vec![0.0; tokens * e];
    for t in 0..tokens {
        for j in 0..e {
            logits[t * e + j] = (0..h).map(|i| x[t * h + i] * router[i * e + j]).sum();
        }
    }
    logits
}

/// [`moe_layer_backward`] with the routing given (the experts chosen and their gate weights,
/// for instance a device's, whose lower-precision logits may order near-ties otherwise); the
/// logits (for the sigmoid gates' slopes) are recomputed from x and the router.
///
/// # Errors
/// As [`moe_layer_backward`], and for a routing of another size.
#[allow(clippy::too_many_arguments)]
pub fn moe_layer_backward_routed(
    x: &[f64],
    router: &[f64],
    experts: &Experts,
    routing: &Routing,
    gate: Gate,
    capacity: Option<usize>,
    dy: &[f64],
) -> Result<LayerGrads, ShapeError> {
    let (e, h, f) = (experts.experts, experts.hidden, experts.width);
    if h == 0 {
        return Err(ShapeError("hidden width 0".into()));
    }
    let tokens = x.len() / h;
    let top_k = routing.top_k;
    check("x", x.len(), tokens * h)?;
    check("router", router.len(), h * e)?;
    check("dy", dy.len(), tokens * h)?;
    check("routing tokens", routing.tokens, tokens)?;
    check("experts' gate", experts.gate.len(), e * h * f)?;
    check("experts' up", experts.up.len(), e * h * f)?;
    check("experts' down", experts.down.len(), e * f * h)?;
    // The forward, keeping what the backward reads.
    let logits = router_logits(x, router, tokens, h, e);
    let plan = plan(routing, e, capacity)?;
    let xs = dispatch(x, &plan, h)?;
    let g = grouped_matmul(&xs, &experts.gate, &plan.offsets, h, f)?;
    let u = grouped_matmul(&xs, &experts.up, &plan.offsets, h, f)?;
    let sig: Vec<f64> = g.iter().map(|&z| 1.0 / (1.0 + (-z).exp())).collect();
    let act: Vec<f64> = (0..g.len()).map(|i| g[i] * sig[i] * u[i]).collect();
    let ys = grouped_matmul(&act, &experts.down, &plan.offsets, f, h)?;
    // The combine's backward.
    let rows = plan.rows.len();
    let mut dys = vec![0.0; rows * h];
    let mut dweights = vec![0.0; tokens * top_k];
    for (a, row) in plan.row_of.iter().enumerate() {
        if let Some(r) = *row {
            let t = a / top_k;
            let (dyt, yr) = (&dy[t * h..(t + 1) * h], &ys[r * h..(r + 1) * h]);
            dweights[a] = dyt.iter().zip(yr).map(|(p, q)| p * q).sum();
            for j in 0..h {
                dys[r * h + j] = routing.weights[a] * dyt[j];
            }
        }
    }
    // The experts.
    let (dact, ddown) = grouped_matmul_backward(&act, &experts.down, &plan.offsets, &dys, f, h)?;
    let dg: Vec<f64> = (0..g.len())
        .map(|i| dact[i] * u[i] * sig[i] * (1.0 + g[i] * (1.0 - sig[i])))
        .collect();
    let du: Vec<f64> = (0..g.len()).map(|i| dact[i] * g[i] * sig[i]).collect();
    let (dxs_g, dgate) = grouped_matmul_backward(&xs, &experts.gate, &plan.offsets, &dg, h, f)?;
    let (dxs_u, dup) = grouped_matmul_backward(&xs, &experts.up, &plan.offsets, &du, h, f)?;
    // The gather's inverse: each token sums its kept rows.
    let mut dx = vec![0.0; tokens * h];
    for (a, row) in plan.row_of.iter().enumerate() {
        if let Some(r) = *row {
            let t = a / top_k;
            for j in 0..h {
                dx[t * h + j] += dxs_g[r * h + j] + dxs_u[r * h + j];
            }
        }
    }
    // The gates, then the router's GEMM.
    let mut dlogits = vec![0.0; tokens * e];
    for t in 0..tokens {
        let slots = t * top_k..(t + 1) * top_k;
        let c: f64 = slots
            .clone()
            .map(|a| routing.weights[a] * dweights[a])
            .sum();
        let s = |a: usize| 1.0 / (1.0 + (-logits[t * e + routing.experts[a]]).exp());
        let total: f64 = slots.clone().map(s).sum();
        for a in slots {
            let dl = match gate {
                Gate::Softmax => routing.weights[a] * (dweights[a] - c),
                Gate::Sigmoid => s(a) * (1.0 - s(a)) * (dweights[a] - c) / total,
            };
            dlogits[t * e + routing.experts[a]] = dl;
        }
    }
    let mut drouter = vec![0.0; h * e];
    for t in 0..tokens {
        for i in 0..h {
            let xi = x[t * h + i];
            let mut back = 0.0;
            for j in 0..e {
                let d = dlogits[t * e + j];
                drouter[i * e + j] += xi * d;
                back += d * router[i * e + j];
            }
            dx[t * h + i] += back;
        }
    }
    Ok(LayerGrads {
        dx,
        router: drouter,
        gate: dgate,
        up: dup,
        down: ddown,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic values in [-1, 1) (a hash of the index and a seed).
    fn values(len: usize, seed: u64) -> Vec<f64> {
        (0..len as u64)
            .map(|i| {
                let mut z = i.wrapping_mul(0x9E37_79B9_7F4A_7C15)
                    ^ seed.wrapping_mul(0xD1B5_4A32_D192_ED03);
                z ^= z >> 29;
                z = z.wrapping_mul(0xBF58_476D_1CE4_E5B9);
                z ^= z >> 32;
                (z >> 11) as f64 / (1u64 << 52) as f64 - 1.0
            })
            .collect()
    }

    #[test]
    fn grouped_matmul_uses_each_rows_own_expert() {
        // Issue 14's ragged counts with empty experts; K = 3, N = 2; expert e's weights are
        // e + 1 times a fixed matrix, so row r's output is (its expert + 1) · x[r] W.
        let counts = [5, 0, 0, 3, 0, 1, 0, 7];
        let offsets = offsets_of(&counts);
        let (k, n) = (3, 2);
        let base = [1.0, -2.0, 0.5, 4.0, 3.0, 1.0];
        let w: Vec<f64> = (0..8)
            .flat_map(|e| base.iter().map(move |v| v * (e + 1) as f64))
            .collect();
        let m = offsets[8];
        let x = values(m * k, 1);
        let y = grouped_matmul(&x, &w, &offsets, k, n).unwrap();
        for e in 0..8 {
            for r in offsets[e]..offsets[e + 1] {
                for j in 0..n {
                    let want: f64 = (0..k).map(|i| x[r * k + i] * base[i * n + j]).sum::<f64>()
                        * (e + 1) as f64;
                    assert!((y[r * n + j] - want).abs() < 1e-12, "row {r} col {j}");
                }
            }
        }
        assert_eq!(y.len(), 16 * n);
    }

    #[test]
    fn empty_groups_and_no_rows_return() {
        let offsets = offsets_of(&[0; 8]);
        let y = grouped_matmul(&[], &vec![1.0; 8 * 4 * 4], &offsets, 4, 4).unwrap();
        assert!(y.is_empty());
        let (dx, dw) =
            grouped_matmul_backward(&[], &vec![1.0; 8 * 4 * 4], &offsets, &[], 4, 4).unwrap();
        assert!(dx.is_empty());
        assert!(dw.iter().all(|&v| v == 0.0));
        // One token in total.
        let offsets = offsets_of(&[0, 0, 1, 0]);
        let y = grouped_matmul(&[2.0, 3.0], &values(4 * 2 * 2, 2), &offsets, 2, 2).unwrap();
        assert_eq!(y.len(), 2);
    }

    #[test]
    fn offsets_that_are_not_a_partition_are_refused() {
        let err = grouped_matmul(&[0.0; 4], &[0.0; 8], &[0, 3, 2], 2, 2).unwrap_err();
        assert!(err.0.contains("offsets[2]"), "{err}");
        let err = grouped_matmul(&[0.0; 4], &[0.0; 8], &[1, 1, 2], 2, 2).unwrap_err();
        assert!(err.0.contains("offsets[0]"), "{err}");
        let err = grouped_matmul(&[0.0; 6], &[0.0; 8], &[0, 1, 2], 2, 2).unwrap_err();
        assert!(err.0.contains("x holds 6"), "{err}");
    }

    #[test]
    fn backward_matches_central_differences_on_skewed_groups() {
        let counts = [6, 0, 1, 2];
        let offsets = offsets_of(&counts);
        let (k, n) = (3, 4);
        let m = offsets[4];
        let x = values(m * k, 3);
        let w = values(4 * k * n, 4);
        let dy = values(m * n, 5);
        // L = Σ dy ⊙ Y, so dL/dx and dL/dw are the backward's dX and dW.
        let loss = |x: &[f64], w: &[f64]| -> f64 {
            let y = grouped_matmul(x, w, &offsets, k, n).unwrap();
            y.iter().zip(&dy).map(|(a, b)| a * b).sum()
        };
        let (dx, dw) = grouped_matmul_backward(&x, &w, &offsets, &dy, k, n).unwrap();
        let eps = 1e-6;
        for i in 0..x.len() {
            let (mut p, mut q) = (x.clone(), x.clone());
            p[i] += eps;
            q[i] -= eps;
            let fd = (loss(&p, &w) - loss(&q, &w)) / (2.0 * eps);
            assert!((fd - dx[i]).abs() < 1e-8, "dx[{i}] {} vs {fd}", dx[i]);
        }
        for i in 0..w.len() {
            let (mut p, mut q) = (w.clone(), w.clone());
            p[i] += eps;
            q[i] -= eps;
            let fd = (loss(&x, &p) - loss(&x, &q)) / (2.0 * eps);
            assert!((fd - dw[i]).abs() < 1e-8, "dw[{i}] {} vs {fd}", dw[i]);
        }
        // Expert 1 has no row: its dW is exactly zero.
        assert!(dw[k * n..2 * k * n].iter().all(|&v| v == 0.0));
    }

    #[test]
    fn layer_backward_matches_central_differences() {
        // 5 tokens, H 4, 4 experts of width 3, top-2, with and without a capacity (2 rows an
        // expert drops some assignments), softmax and sigmoid gates: L = Σ dy ⊙ out, every
        // gradient against central differences. The routing's choice is locally constant, so
        // the differences see the same experts (the logits' gaps are far above eps).
        let (t, h, e, f, k) = (5, 4, 4, 3, 2);
        let x: Vec<f64> = values(t * h, 11).iter().map(|v| 2.0 * v).collect();
        let router = values(h * e, 12);
        let ex = Experts {
            experts: e,
            hidden: h,
            width: f,
            gate: values(e * h * f, 13),
            up: values(e * h * f, 14),
            down: values(e * f * h, 15),
        };
        let dy = values(t * h, 16);
        for (gate, capacity) in [
            (Gate::Softmax, None),
            (Gate::Sigmoid, None),
            (Gate::Softmax, Some(2)),
        ] {
            let loss = |x: &[f64], router: &[f64], ex: &Experts| -> f64 {
                let (out, _) = moe_layer(x, router, ex, k, gate, capacity).unwrap();
                out.iter().zip(&dy).map(|(a, b)| a * b).sum()
            };
            let g = moe_layer_backward(&x, &router, &ex, k, gate, capacity, &dy).unwrap();
            let (_, routing) = moe_layer(&x, &router, &ex, k, gate, capacity).unwrap();
            let dropped = plan(&routing, e, capacity).unwrap().dropped();
            assert_eq!(
                dropped > 0,
                capacity.is_some(),
                "{gate:?} {capacity:?}: {dropped} dropped"
            );
            let eps = 1e-6;
            let fd = |v: &[f64], i: usize, l: &dyn Fn(&[f64]) -> f64| {
                let (mut p, mut q) = (v.to_vec(), v.to_vec());
                p[i] += eps;
                q[i] -= eps;
                (l(&p) - l(&q)) / (2.0 * eps)
            };
            let close = |what: &str, got: &[f64], want: Vec<f64>| {
                for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (a - b).abs() < 1e-7,
                        "{gate:?} {capacity:?} {what}[{i}]: {a} vs {b}"
                    );
                }
            };
            close(
                "dx",
                &g.dx,
                (0..x.len())
                    .map(|i| fd(&x, i, &|v| loss(v, &router, &ex)))
                    .collect(),
            );
            close(
                "router",
                &g.router,
                (0..router.len())
                    .map(|i| fd(&router, i, &|v| loss(&x, v, &ex)))
                    .collect(),
            );
            close(
                "gate",
                &g.gate,
                (0..ex.gate.len())
                    .map(|i| {
                        fd(&ex.gate, i, &|v| {
                            loss(
                                &x,
                                &router,
                                &Experts {
                                    gate: v.to_vec(),
                                    ..ex.clone()
                                },
                            )
                        })
                    })
                    .collect(),
            );
            close(
                "up",
                &g.up,
                (0..ex.up.len())
                    .map(|i| {
                        fd(&ex.up, i, &|v| {
                            loss(
                                &x,
                                &router,
                                &Experts {
                                    up: v.to_vec(),
                                    ..ex.clone()
                                },
                            )
                        })
                    })
                    .collect(),
            );
            close(
                "down",
                &g.down,
                (0..ex.down.len())
                    .map(|i| {
                        fd(&ex.down, i, &|v| {
                            loss(
                                &x,
                                &router,
                                &Experts {
                                    down: v.to_vec(),
                                    ..ex.clone()
                                },
                            )
                        })
                    })
                    .collect(),
            );
            // The router's gradient is not zero (the gates pass one).
            assert!(g.router.iter().any(|v| v.abs() > 1e-3), "{gate:?}");
        }
    }

    #[test]
    fn routing_picks_the_largest_logits_and_normalises_the_gates() {
        let logits = [0.1, 2.0, -1.0, 2.0, /* token 1 */ 3.0, 0.0, 1.0, -5.0];
        let r = route(&logits, 2, 4, 2, Gate::Softmax).unwrap();
        // Token 0: a tie between experts 1 and 3, the lower index first.
        assert_eq!(r.experts, vec![1, 3, 0, 2]);
        assert!((r.weights[0] - 0.5).abs() < 1e-15 && (r.weights[1] - 0.5).abs() < 1e-15);
        let want = 1.0 / (1.0 + (-2.0f64).exp());
        assert!((r.weights[2] - want).abs() < 1e-15, "{}", r.weights[2]);
        let s = route(&logits, 2, 4, 2, Gate::Sigmoid).unwrap();
        assert_eq!(s.experts, r.experts);
        let (a, b) = (1.0 / (1.0 + (-3.0f64).exp()), 1.0 / (1.0 + (-1.0f64).exp()));
        assert!((s.weights[2] - a / (a + b)).abs() < 1e-15);
        for t in 0..2 {
            assert!((s.weights[2 * t] + s.weights[2 * t + 1] - 1.0).abs() < 1e-15);
        }
        assert!(route(&logits, 2, 4, 5, Gate::Softmax).is_err());
        assert!(route(&[f64::NAN; 4], 1, 4, 1, Gate::Softmax).is_err());
    }

    #[test]
    fn dispatch_then_combine_with_identity_experts_returns_the_input() {
        // Gates of 1 (top-1 routing) and identity experts: exactly the input.
        let (tokens, e, h) = (37, 8, 5);
        let x = values(tokens * h, 6);
        let logits = values(tokens * e, 7);
        let r = route(&logits, tokens, e, 1, Gate::Softmax).unwrap();
        assert!(r.weights.iter().all(|&w| w == 1.0));
        let p = plan(&r, e, None).unwrap();
        let xs = dispatch(&x, &p, h).unwrap();
        // Rows are in expert order, and within an expert in token order.
        for w in p.rows.windows(2) {
            let (a, b) = (r.experts[w[0]], r.experts[w[1]]);
            assert!(a < b || (a == b && w[0] < w[1]));
        }
        assert_eq!(combine(&xs, &p, &r, h).unwrap(), x);
        // Top-2 with gates summing to 1: the input within rounding.
        let r2 = route(&logits, tokens, e, 2, Gate::Sigmoid).unwrap();
        let p2 = plan(&r2, e, None).unwrap();
        let back = combine(&dispatch(&x, &p2, h).unwrap(), &p2, &r2, h).unwrap();
        assert!(back.iter().zip(&x).all(|(a, b)| (a - b).abs() < 1e-15));
    }

    #[test]
    fn capacity_keeps_the_first_tokens_and_drops_the_rest() {
        // Every token prefers expert 2; capacity 3 keeps tokens 0, 1 and 2 there.
        let (tokens, e) = (6, 4);
        let mut logits = vec![0.0; tokens * e];
        for t in 0..tokens {
            logits[t * e + 2] = 1.0;
        }
        let r = route(&logits, tokens, e, 1, Gate::Softmax).unwrap();
        let p = plan(&r, e, Some(3)).unwrap();
        assert_eq!(p.offsets, vec![0, 0, 0, 3, 3]);
        assert_eq!(p.rows, vec![0, 1, 2]);
        assert_eq!(&p.row_of[3..], &[None, None, None]);
        let x = values(tokens * 2, 8);
        let out = combine(&dispatch(&x, &p, 2).unwrap(), &p, &r, 2).unwrap();
        assert_eq!(&out[..6], &x[..6]);
        assert!(out[6..].iter().all(|&v| v == 0.0));
    }

    #[test]
    fn the_layer_is_the_sum_of_each_tokens_experts() {
        let (tokens, e, h, f, top_k) = (9, 4, 3, 5, 2);
        let experts = Experts {
            experts: e,
            hidden: h,
            width: f,
            gate: values(e * h * f, 9),
            up: values(e * h * f, 10),
            down: values(e * f * h, 11),
        };
        let x = values(tokens * h, 12);
        let router = values(h * e, 13);
        let (out, routing) = moe_layer(&x, &router, &experts, top_k, Gate::Softmax, None).unwrap();
        // Token by token: each chosen expert's MLP on the token alone, weighted.
        for t in 0..tokens {
            let mut want = vec![0.0; h];
            for s in 0..top_k {
                let ex = routing.experts[t * top_k + s];
                let mut counts = vec![0; e];
                counts[ex] = 1;
                let y =
                    swiglu_experts(&x[t * h..(t + 1) * h], &experts, &offsets_of(&counts)).unwrap();
                for j in 0..h {
                    want[j] += routing.weights[t * top_k + s] * y[j];
                }
            }
            for j in 0..h {
                assert!((out[t * h + j] - want[j]).abs() < 1e-14, "token {t}");
            }
        }
    }
}
