//! Float64 references of the sequence mixers, each the sequential recurrence its paper
//! defines, one time step after another (no chunking, no parallel scan; the independent
//! sequences, one per batch entry and head or channel, run on rayon's threads): slow, and what
//! the
//! chunked kernels and the alternatives are checked against. The file holds SSD, Mamba-2's
//! layer ([`ssd`]), Mamba's selective scan ([`selective_scan`]), Gated DeltaNet's gated delta
//! rule ([`gated_delta_rule`]) and Based's causal linear attention with a sliding-window
//! softmax branch ([`based`]). Every function takes an optional initial state and returns the
//! final state (for [`based`], the linear state and the window's cache of recent keys and
//! values, [`BasedState`]), so that a sequence run in two halves (the state of the first passed
//! to the second) equals one run over the whole sequence.
//!
//! Layouts are row-major, batch first, then time: `[batch, seq_len, heads, width]` for
//! per-head sequences (the layout of flash-linear-attention and of Mamba-2's reference code).
//! Value ranges the docs state (Δ > 0, A < 0, α in (0, 1], β in [0, 1]) are the models', not
//! checked: the recurrences are computed for any finite input. A sequence of length 0 returns
//! no output and the initial state.

use rayon::prelude::*;

/// Checks that `data` (the input named `what`) holds `want` elements; the error names it.
pub(super) fn check_len(what: &str, data: &[f64], want: usize) -> Result<(), String> {
    if data.len() == want {
        Ok(())
    } else {
        Err(format!(
            "{what}: {} elements, expected {want} for this shape",
            data.len()
        ))
    }
}

/// `given` (checked to hold `len` elements, `what` naming it in the error), or zeros: an
/// initial state, or the cotangent of a final state.
pub(super) fn or_zeros(what: &str, given: Option<&[f64]>, len: usize) -> Result<Vec<f64>, String> {
    match given {
        Some(v) => check_len(what, v, len).map(|()| v.to_vec()),
        None => Ok(vec![0.0; len]),
    }
}

/// Sizes of an SSD call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SsdShape {
    /// Batch entries, B.
    pub batch: usize,
    /// Time steps, T.
    pub seq_len: usize,
    /// Heads, H (a multiple of `groups`).
    pub heads: usize,
    /// Value width per head, P (head_dim).
    pub head_dim: usize,
    /// State size per head, N (d_state).
    pub state: usize,
    /// Groups of heads sharing B and C, G.
    pub groups: usize,
}

/// Inputs of [`ssd`], float64.
#[derive(Clone, Copy, Debug)]
pub struct SsdInputs<'a> {
    /// X, `[B, T, H, P]`.
    pub x: &'a [f64],
    /// Δ (the step, after the softplus; positive), `[B, T, H]`.
    pub dt: &'a [f64],
    /// A (one scalar per head; negative for a decaying state), `[H]`.
    pub a: &'a [f64],
    /// B (the input projection into the state), `[B, T, G, N]`.
    pub b: &'a [f64],
    /// C (the state's read-out), `[B, T, G, N]`.
    pub c: &'a [f64],
    /// D (the skip connection), `[H]`, or none.
    pub d: Option<&'a [f64]>,
    /// The state before the first step, `[B, H, P, N]`, or zeros.
    pub initial_state: Option<&'a [f64]>,
}

impl SsdShape {
    /// Checks `inp` against this shape: no empty dimension other than seq_len, heads a
    /// multiple of groups, and every input's length (the error names the input, or starts
    /// with `function` for the shape's fault).
    pub(super) fn check(&self, function: &str, inp: &SsdInputs) -> Result<(), String> {
        let s = *self;
        if s.batch == 0 || s.heads == 0 || s.head_dim == 0 || s.state == 0 || s.groups == 0 {
            return Err(format!("{function}: empty dimension in {s:?}"));
        }
        if !s.heads.is_multiple_of(s.groups) {
            return Err(format!(
                "{function}: heads {} is not a multiple of groups {}",
                s.heads, s.groups
            ));
        }
        let bt = s.batch * s.seq_len;
        check_len("x", inp.x, bt * s.heads * s.head_dim)?;
        check_len("dt", inp.dt, bt * s.heads)?;
        check_len("a", inp.a, s.heads)?;
        check_len("b", inp.b, bt * s.groups * s.state)?;
        check_len("c", inp.c, bt * s.groups * s.state)?;
        match inp.d {
            Some(d) => check_len("d", d, s.heads),
            None => Ok(()),
        }
    }
}

/// SSD, the state-space dual layer of Mamba-2 (Dao and Gu, 2024, "Transformers are SSMs:
/// Generalized Models and Efficient Algorithms Through Structured State Space Duality", the
/// scalar-times-identity A of its sections 3 and 7), as its recurrence: for each batch entry
/// and head h (group g = h / (H / G)), with the state S (P × N, float64),
///
/// S_t = exp(Δ_t A_h) S_{t−1} + Δ_t x_t B_tᵀ,  y_t = S_t C_t + D_h x_t.
///
/// Returns Y `[B, T, H, P]` and the final state `[B, H, P, N]`.
///
/// # Errors
/// A message naming the input whose length does not fit `shape`, or the shape's fault (heads
/// not a multiple of groups, an empty dimension other than seq_len).
pub fn ssd(shape: SsdShape, inp: SsdInputs) -> Result<(Vec<f64>, Vec<f64>), String> {
    let SsdShape {
        batch,
        seq_len: t_len,
        heads,
        head_dim: p_dim,
        state: n_dim,
        groups,
    } = shape;
    shape.check("ssd", &inp)?;
    let mut state = or_zeros(
        "initial_state",
        inp.initial_state,
        batch * heads * p_dim * n_dim,
    )?;
    let mut y = vec![0.0; batch * t_len * heads * p_dim];
    let per_group = heads / groups;
    // Each (batch entry, head) is its own sequence: computed in parallel, each in time order
    // with the same arithmetic as one after another, then scattered into Y.
    let outs: Vec<Vec<f64>> = state
        .par_chunks_mut(p_dim * n_dim)
        .enumerate()
        .map(|(task, s)| {
            let (b, h) = (task / heads, task % heads);
            let g = h / per_group;
            let mut out = vec![0.0; t_len * p_dim];
            for t in 0..t_len {
                let bt = b * t_len + t;
                let dt = inp.dt[bt * heads + h];
                let decay = (dt * inp.a[h]).exp();
                let x = &inp.x[(bt * heads + h) * p_dim..][..p_dim];
                let bv = &inp.b[(bt * groups + g) * n_dim..][..n_dim];
                let cv = &inp.c[(bt * groups + g) * n_dim..][..n_dim];
                let skip = inp.d.map_or(0.0, |d| d[h]);
                let o = &mut out[t * p_dim..][..p_dim];
                for p in 0..p_dim {
                    let row = &mut s[p * n_dim..][..n_dim];
                    let mut acc = 0.0;
                    for n in 0..n_dim {
                        row[n] = decay * row[n] + dt * x[p] * bv[n];
                        acc += row[n] * cv[n];
                    }
                    o[p] = acc + skip * x[p];
                }
            }
            out
        })
        .collect();
    for (task, out) in outs.iter().enumerate() {
        let (b, h) = (task / heads, task % heads);
        for t in 0..t_len {
            let dst = ((b * t_len + t) * heads + h) * p_dim;
            y[dst..dst + p_dim].copy_from_slice(&out[t * p_dim..][..p_dim]);
        }
    }
    Ok((y, state))
}

/// Sizes of a selective scan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScanShape {
    /// Batch entries, B.
    pub batch: usize,
    /// Time steps, T.
    pub seq_len: usize,
    /// Channels, D (d_inner).
    pub channels: usize,
    /// State size per channel, N (d_state).
    pub state: usize,
}

/// Inputs of [`selective_scan`], float64.
#[derive(Clone, Copy, Debug)]
pub struct ScanInputs<'a> {
    /// The input u, `[B, T, D]`.
    pub u: &'a [f64],
    /// Δ (the step, after the softplus; positive), `[B, T, D]`.
    pub delta: &'a [f64],
    /// A (diagonal, one row per channel; negative for a decaying state), `[D, N]`.
    pub a: &'a [f64],
    /// B (input-dependent, shared by the channels), `[B, T, N]`.
    pub b: &'a [f64],
    /// C (input-dependent, shared by the channels), `[B, T, N]`.
    pub c: &'a [f64],
    /// D (the skip connection), `[D]`, or none.
    pub d: Option<&'a [f64]>,
    /// The state before the first step, `[B, D, N]`, or zeros.
    pub initial_state: Option<&'a [f64]>,
}

impl ScanShape {
    /// Checks `inp` against this shape: no empty dimension other than seq_len, and every
    /// input's length (the error names the input, or starts with `function` for the shape's
    /// fault).
    pub(super) fn check(&self, function: &str, inp: &ScanInputs) -> Result<(), String> {
        let s = *self;
        if s.batch == 0 || s.channels == 0 || s.state == 0 {
            return Err(format!("{function}: empty dimension in {s:?}"));
        }
        let bt = s.batch * s.seq_len;
        check_len("u", inp.u, bt * s.channels)?;
        check_len("delta", inp.delta, bt * s.channels)?;
        check_len("a", inp.a, s.channels * s.state)?;
        check_len("b", inp.b, bt * s.state)?;
        check_len("c", inp.c, bt * s.state)?;
        match inp.d {
            Some(d) => check_len("d", d, s.channels),
            None => Ok(()),
        }
    }
}

/// The selective scan of Mamba (Gu and Dao, 2023, "Mamba: Linear-Time Sequence Modeling with
/// Selective State Spaces", Algorithm 2, zero-order-hold A and Euler B as its reference code
/// does), as its recurrence: for each batch entry and channel d, with the state h (N entries),
///
/// h_t = exp(Δ_{t,d} A_d) ∘ h_{t−1} + Δ_{t,d} u_{t,d} B_t,  y_{t,d} = ⟨C_t, h_t⟩ + D_d u_{t,d}.
///
/// (The block's gate, y ∘ silu(z), is outside the scan.) Returns y `[B, T, D]` and the final
/// state `[B, D, N]`.
///
/// # Errors
/// A message naming the input whose length does not fit `shape`, or an empty dimension other
/// than seq_len.
pub fn selective_scan(shape: ScanShape, inp: ScanInputs) -> Result<(Vec<f64>, Vec<f64>), String> {
    let ScanShape {
        batch,
        seq_len: t_len,
        channels,
        state: n_dim,
    } = shape;
    shape.check("selective_scan", &inp)?;
    let mut state = or_zeros("initial_state", inp.initial_state, batch * channels * n_dim)?;
    let mut y = vec![0.0; batch * t_len * channels];
    // Each (batch entry, channel) is its own sequence: computed in parallel, each in time
    // order with the same arithmetic as one after another, then scattered into y.
    let outs: Vec<Vec<f64>> = state
        .par_chunks_mut(n_dim)
        .enumerate()
        .map(|(task, h)| {
            let (b, ch) = (task / channels, task % channels);
            let a = &inp.a[ch * n_dim..][..n_dim];
            let mut out = vec![0.0; t_len];
            for (t, o) in out.iter_mut().enumerate() {
                let bt = b * t_len + t;
                let i = bt * channels + ch;
                let (u, dt) = (inp.u[i], inp.delta[i]);
                let bv = &inp.b[bt * n_dim..][..n_dim];
                let cv = &inp.c[bt * n_dim..][..n_dim];
                let mut acc = 0.0;
                for n in 0..n_dim {
                    h[n] = (dt * a[n]).exp() * h[n] + dt * u * bv[n];
                    acc += cv[n] * h[n];
                }
                *o = acc + inp.d.map_or(0.0, |d| d[ch]) * u;
            }
            out
        })
        .collect();
    for (task, out) in outs.iter().enumerate() {
        let (b, ch) = (task / channels, task % channels);
        for (t, v) in out.iter().enumerate() {
            y[(b * t_len + t) * channels + ch] = *v;
        }
    }
    Ok((y, state))
}

/// Sizes of a Gated DeltaNet call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeltaShape {
    /// Batch entries, B.
    pub batch: usize,
    /// Time steps, T.
    pub seq_len: usize,
    /// Heads, H.
    pub heads: usize,
    /// Query and key width per head, K.
    pub key_dim: usize,
    /// Value width per head, V.
    pub value_dim: usize,
}

/// Inputs of [`gated_delta_rule`], float64.
#[derive(Clone, Copy, Debug)]
pub struct DeltaInputs<'a> {
    /// Queries, `[B, T, H, K]` (any scale: the caller applies 1/√K if it wants one).
    pub q: &'a [f64],
    /// Keys, `[B, T, H, K]` (L2-normalised by the caller, as the paper's layer does).
    pub k: &'a [f64],
    /// Values, `[B, T, H, V]`.
    pub v: &'a [f64],
    /// The decay gate α in (0, 1], `[B, T, H]`.
    pub alpha: &'a [f64],
    /// The writing strength β in [0, 1], `[B, T, H]`.
    pub beta: &'a [f64],
    /// The state before the first step, `[B, H, V, K]` (value-major: the transpose of
    /// flash-linear-attention's `[B, H, K, V]` state), or zeros.
    pub initial_state: Option<&'a [f64]>,
}

impl DeltaShape {
    /// Checks `inp` against this shape: no empty dimension other than seq_len, and every
    /// input's length (the error names the input, or starts with `function` for the shape's
    /// fault).
    pub(super) fn check(&self, function: &str, inp: &DeltaInputs) -> Result<(), String> {
        let s = *self;
        if s.batch == 0 || s.heads == 0 || s.key_dim == 0 || s.value_dim == 0 {
            return Err(format!("{function}: empty dimension in {s:?}"));
        }
        let n = s.batch * s.seq_len * s.heads;
        check_len("q", inp.q, n * s.key_dim)?;
        check_len("k", inp.k, n * s.key_dim)?;
        check_len("v", inp.v, n * s.value_dim)?;
        check_len("alpha", inp.alpha, n)?;
        check_len("beta", inp.beta, n)
    }
}

/// The gated delta rule of Gated DeltaNet (Yang, Kautz and Hatamizadeh, 2024, "Gated Delta
/// Networks: Improving Mamba2 with Delta Rule", equation (10)), as its recurrence: for each
/// batch entry and head, with the state S (V × K, float64),
///
/// S_t = α_t S_{t−1} (I − β_t k_t k_tᵀ) + β_t v_t k_tᵀ,  o_t = S_t q_t.
///
/// Returns O `[B, T, H, V]` and the final state `[B, H, V, K]`.
///
/// # Errors
/// A message naming the input whose length does not fit `shape`, or an empty dimension other
/// than seq_len.
pub fn gated_delta_rule(
    shape: DeltaShape,
    inp: DeltaInputs,
) -> Result<(Vec<f64>, Vec<f64>), String> {
    let DeltaShape {
        batch,
        seq_len: t_len,
        heads,
        key_dim: kd,
        value_dim: vd,
    } = shape;
    shape.check("gated_delta_rule", &inp)?;
    let mut state = or_zeros("initial_state", inp.initial_state, batch * heads * vd * kd)?;
    let mut o = vec![0.0; batch * t_len * heads * vd];
    // Each (batch entry, head) is its own sequence: computed in parallel, each in time order
    // with the same arithmetic as one after another, then scattered into O.
    let outs: Vec<Vec<f64>> = state
        .par_chunks_mut(vd * kd)
        .enumerate()
        .map(|(task, s)| {
            let (b, h) = (task / heads, task % heads);
            let mut sk = vec![0.0; vd];
            let mut out = vec![0.0; t_len * vd];
            for t in 0..t_len {
                let i = (b * t_len + t) * heads + h;
                let (alpha, beta) = (inp.alpha[i], inp.beta[i]);
                let q = &inp.q[i * kd..][..kd];
                let k = &inp.k[i * kd..][..kd];
                let v = &inp.v[i * vd..][..vd];
                // S k with the old state, then S ← α S − α β (S k) kᵀ + β v kᵀ, row by row.
                for (r, skr) in sk.iter_mut().enumerate() {
                    *skr = (0..kd).map(|j| s[r * kd + j] * k[j]).sum();
                }
                let ot = &mut out[t * vd..][..vd];
                for r in 0..vd {
                    let row = &mut s[r * kd..][..kd];
                    let w = beta * (v[r] - alpha * sk[r]);
                    let mut acc = 0.0;
                    for j in 0..kd {
                        row[j] = alpha * row[j] + w * k[j];
                        acc += row[j] * q[j];
                    }
                    ot[r] = acc;
                }
            }
            out
        })
        .collect();
    for (task, out) in outs.iter().enumerate() {
        let (b, h) = (task / heads, task % heads);
        for t in 0..t_len {
            let dst = ((b * t_len + t) * heads + h) * vd;
            o[dst..dst + vd].copy_from_slice(&out[t * vd..][..vd]);
        }
    }
    Ok((o, state))
}

/// Sizes of a Based call (linear attention plus a sliding-window softmax branch).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BasedShape {
    /// Batch entries, B.
    pub batch: usize,
    /// Time steps, T.
    pub seq_len: usize,
    /// Heads, H.
    pub heads: usize,
    /// Query and key width per head, K (after the caller's feature map).
    pub key_dim: usize,
    /// Value width per head, V.
    pub value_dim: usize,
    /// Window, W ≥ 1: how many of the most recent keys the softmax branch sees, the current
    /// one included.
    pub window: usize,
}

/// The state [`based`] carries from one call to the next: the linear branch's state and the
/// window branch's cache of recent keys and values, in float64 here (`T` = `f64`, the
/// default) and in float32 for the public function ([`super::api::BasedStreamState`]).
#[derive(Clone, Debug, PartialEq)]
pub struct BasedState<T = f64> {
    /// The linear state S = Σ_s v_s k_sᵀ, `[B, H, V, K]` (value-major, as the delta rule's
    /// state above).
    pub s: Vec<T>,
    /// The last `cached` keys of each batch entry and head, oldest first, `[B, H, cached, K]`.
    pub keys: Vec<T>,
    /// The values that go with `keys`, oldest first, `[B, H, cached, V]`.
    pub values: Vec<T>,
    /// How many recent steps the cache holds, the same for every batch entry and head: at
    /// most W − 1 (the current key makes the W-th). After a call it is min(W − 1, the initial
    /// state's `cached` + T).
    pub cached: usize,
}

impl BasedState {
    /// The state before any step: S = 0 and an empty cache, for `shape`'s B, H, K and V.
    pub fn zeros(shape: BasedShape) -> Self {
        let BasedShape {
            batch,
            heads,
            key_dim,
            value_dim,
            ..
        } = shape;
        Self {
            s: vec![0.0; batch * heads * value_dim * key_dim],
            keys: Vec::new(),
            values: Vec::new(),
            cached: 0,
        }
    }
}

/// Inputs of [`based`], float64.
#[derive(Clone, Copy, Debug)]
pub struct BasedInputs<'a> {
    /// Queries, `[B, T, H, K]`, already through the feature map (see [`based`]).
    pub q: &'a [f64],
    /// Keys, `[B, T, H, K]`, already through the feature map.
    pub k: &'a [f64],
    /// Values, `[B, T, H, V]`.
    pub v: &'a [f64],
    /// The factor on both branches' scores q·k (1/√K if the caller wants the usual one).
    pub scale: f64,
    /// The state before the first step (see [`BasedState`]), or S = 0 and an empty cache.
    pub initial_state: Option<&'a BasedState>,
}

/// Causal linear attention with a sliding-window softmax branch, after the design of Based
/// (Arora et al., 2024, "Simple linear attention language models balance the
/// recall-throughput tradeoff"): a linear-attention branch plus exact softmax attention over
/// a short sliding window, here summed in one mixer. For each batch entry and head, with the
/// linear state S (V × K, float64), the window W and the scale c,
///
/// S_t = S_{t−1} + v_t k_tᵀ,  la_t = c · S_t q_t,
///
/// sw_t = Σ_{s = max(0, t−W+1)}^{t} softmax_s(c · q_t·k_s) v_s,
///
/// o_t = la_t + sw_t,
///
/// the softmax exact (max-subtracted) over those keys only, and the linear branch
/// unnormalised (as flash-linear-attention's `chunk_linear_attn` with `normalize=False`).
/// Based applies a Taylor feature map to q and k before the linear branch; this reference
/// leaves it to the caller: q and k arrive already mapped (K is the mapped width), so the
/// identity map is the reference's, and both branches read the same q and k. Keys and
/// values before the first step, up to W − 1 of them, come from the initial state's cache.
///
/// Returns O `[B, T, H, V]` and the final state: S `[B, H, V, K]` and the last
/// min(W − 1, cached + T) keys and values (see [`BasedState`]), so that a sequence run in two
/// parts, the first's state passed to the second, equals one run.
///
/// # Errors
/// A message naming the input whose length does not fit `shape` (`initial_state.s`,
/// `initial_state.keys` and `initial_state.values` for the state's fields), an initial cache
/// longer than W − 1, or an empty dimension other than seq_len (W = 0 included).
pub fn based(shape: BasedShape, inp: BasedInputs) -> Result<(Vec<f64>, BasedState), String> {
    let BasedShape {
        batch,
        seq_len: t_len,
        heads,
        key_dim: kd,
        value_dim: vd,
        window,
    } = shape;
    if batch == 0 || heads == 0 || kd == 0 || vd == 0 || window == 0 {
        return Err(format!("based: empty dimension in {shape:?}"));
    }
    check_len("q", inp.q, batch * t_len * heads * kd)?;
    check_len("k", inp.k, batch * t_len * heads * kd)?;
    check_len("v", inp.v, batch * t_len * heads * vd)?;
    let zeros;
    let s0 = match inp.initial_state {
        Some(s0) => s0,
        None => {
            zeros = BasedState::zeros(shape);
            &zeros
        }
    };
    let c0 = s0.cached;
    if c0 >= window {
        return Err(format!(
            "initial_state: {c0} cached steps, at most window − 1 = {} fit",
            window - 1
        ));
    }
    check_len("initial_state.s", &s0.s, batch * heads * vd * kd)?;
    check_len("initial_state.keys", &s0.keys, batch * heads * c0 * kd)?;
    check_len("initial_state.values", &s0.values, batch * heads * c0 * vd)?;
    let c1 = (c0 + t_len).min(window - 1);
    let mut state = BasedState {
        s: s0.s.clone(),
        keys: vec![0.0; batch * heads * c1 * kd],
        values: vec![0.0; batch * heads * c1 * vd],
        cached: c1,
    };
    let mut o = vec![0.0; batch * t_len * heads * vd];
    // Each (batch entry, head) is its own sequence: computed in parallel, each in time order
    // with the same arithmetic as one after another; its outputs and the cache it hands on are
    // scattered afterwards.
    type Part = (Vec<f64>, Vec<f64>, Vec<f64>);
    let parts: Vec<Part> = state
        .s
        .par_chunks_mut(vd * kd)
        .enumerate()
        .map(|(bh, s)| {
            let (b, h) = (bh / heads, bh % heads);
            // The cached keys and values followed by this call's, so that step t sits at
            // position c0 + t of the history.
            let mut hist_k = vec![0.0; (c0 + t_len) * kd];
            let mut hist_v = vec![0.0; (c0 + t_len) * vd];
            // At most min(W, keys in the history) scores per step (W may be far larger).
            let mut scores = vec![0.0; window.min(c0 + t_len)];
            let mut out_bh = vec![0.0; t_len * vd];
            hist_k[..c0 * kd].copy_from_slice(&s0.keys[bh * c0 * kd..][..c0 * kd]);
            hist_v[..c0 * vd].copy_from_slice(&s0.values[bh * c0 * vd..][..c0 * vd]);
            for t in 0..t_len {
                let i = (b * t_len + t) * heads + h;
                hist_k[(c0 + t) * kd..][..kd].copy_from_slice(&inp.k[i * kd..][..kd]);
                hist_v[(c0 + t) * vd..][..vd].copy_from_slice(&inp.v[i * vd..][..vd]);
            }
            for t in 0..t_len {
                let i = (b * t_len + t) * heads + h;
                let q = &inp.q[i * kd..][..kd];
                let k = &inp.k[i * kd..][..kd];
                let v = &inp.v[i * vd..][..vd];
                let out = &mut out_bh[t * vd..][..vd];
                // Linear branch: S ← S + v kᵀ, then c · S q, row by row.
                for r in 0..vd {
                    let row = &mut s[r * kd..][..kd];
                    let mut acc = 0.0;
                    for j in 0..kd {
                        row[j] += v[r] * k[j];
                        acc += row[j] * q[j];
                    }
                    out[r] = inp.scale * acc;
                }
                // Window branch: softmax over history positions [last + 1 − W, last].
                let last = c0 + t;
                let first = (last + 1).saturating_sub(window);
                let sc = &mut scores[..=last - first];
                for (e, p) in sc.iter_mut().zip(first..=last) {
                    let kp = &hist_k[p * kd..][..kd];
                    *e = inp.scale * (0..kd).map(|j| q[j] * kp[j]).sum::<f64>();
                }
                let top = sc.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x));
                sc.iter_mut().for_each(|e| *e = (*e - top).exp());
                let total: f64 = sc.iter().sum();
                for (e, p) in sc.iter().zip(first..=last) {
                    let w = e / total;
                    let vp = &hist_v[p * vd..][..vd];
                    for r in 0..vd {
                        out[r] += w * vp[r];
                    }
                }
            }
            // The cache to hand on: the last c1 positions of the history.
            let from = c0 + t_len - c1;
            let keys = hist_k[from * kd..][..c1 * kd].to_vec();
            let values = hist_v[from * vd..][..c1 * vd].to_vec();
            (out_bh, keys, values)
        })
        .collect();
    for (bh, (out_bh, keys, values)) in parts.iter().enumerate() {
        let (b, h) = (bh / heads, bh % heads);
        for t in 0..t_len {
            let dst = ((b * t_len + t) * heads + h) * vd;
            o[dst..dst + vd].copy_from_slice(&out_bh[t * vd..][..vd]);
        }
        state.keys[bh * c1 * kd..][..c1 * kd].copy_from_slice(keys);
        state.values[bh * c1 * vd..][..c1 * vd].copy_from_slice(values);
    }
    Ok((o, state))
}

#[cfg(test)]
mod tests {
    use super::super::test_util::{max_rel, uniform};
    use super::*;

    const SSD: SsdShape = SsdShape {
        batch: 2,
        seq_len: 9,
        heads: 4,
        head_dim: 3,
        state: 5,
        groups: 2,
    };

    struct SsdData {
        x: Vec<f64>,
        dt: Vec<f64>,
        a: Vec<f64>,
        b: Vec<f64>,
        c: Vec<f64>,
        d: Vec<f64>,
    }

    fn ssd_data(s: SsdShape, seed: u64) -> SsdData {
        let (bt, h) = (s.batch * s.seq_len, s.heads);
        SsdData {
            x: uniform(bt * h * s.head_dim, -1.0, 1.0, seed),
            dt: uniform(bt * h, 0.05, 0.5, seed + 1),
            a: uniform(h, -2.0, -0.1, seed + 2),
            b: uniform(bt * s.groups * s.state, -1.0, 1.0, seed + 3),
            c: uniform(bt * s.groups * s.state, -1.0, 1.0, seed + 4),
            d: uniform(h, -1.0, 1.0, seed + 5),
        }
    }

    fn ssd_inputs(d: &SsdData) -> SsdInputs<'_> {
        SsdInputs {
            x: &d.x,
            dt: &d.dt,
            a: &d.a,
            b: &d.b,
            c: &d.c,
            d: Some(&d.d),
            initial_state: None,
        }
    }

    /// The dual (quadratic, attention-like) form of the same layer, from a zero state:
    /// y_t = Σ_{s ≤ t} ⟨C_t, B_s⟩ exp(A Σ_{r=s+1..t} Δ_r) Δ_s x_s + D x_t.
    fn ssd_dual(s: SsdShape, d: &SsdData) -> Vec<f64> {
        let (t_len, heads, p_dim, n_dim, groups) =
            (s.seq_len, s.heads, s.head_dim, s.state, s.groups);
        let mut y = vec![0.0; s.batch * t_len * heads * p_dim];
        for b in 0..s.batch {
            for h in 0..heads {
                let g = h / (heads / groups);
                for t in 0..t_len {
                    for p in 0..p_dim {
                        let mut acc = 0.0;
                        for u in 0..=t {
                            let dt_sum: f64 =
                                (u + 1..=t).map(|r| d.dt[(b * t_len + r) * heads + h]).sum();
                            let cb: f64 = (0..n_dim)
                                .map(|n| {
                                    d.c[((b * t_len + t) * groups + g) * n_dim + n]
                                        * d.b[((b * t_len + u) * groups + g) * n_dim + n]
                                })
                                .sum();
                            let du = d.dt[(b * t_len + u) * heads + h];
                            acc += cb
                                * (d.a[h] * dt_sum).exp()
                                * du
                                * d.x[((b * t_len + u) * heads + h) * p_dim + p];
                        }
                        let xt = d.x[((b * t_len + t) * heads + h) * p_dim + p];
                        y[((b * t_len + t) * heads + h) * p_dim + p] = acc + d.d[h] * xt;
                    }
                }
            }
        }
        y
    }

    #[test]
    fn ssd_recurrence_equals_its_dual_quadratic_form() {
        let d = ssd_data(SSD, 1);
        let (y, _) = ssd(SSD, ssd_inputs(&d)).unwrap();
        let e = max_rel(&y, &ssd_dual(SSD, &d));
        assert!(e < 1e-12, "{e}");
        assert!(y.iter().any(|v| v.abs() > 1e-3), "a non-trivial output");
    }

    /// Runs the mixer (`run(t0, t1, initial_state)` over steps [t0, t1)) over the whole
    /// sequence, then over its first `cut` steps and the rest with the first part's final
    /// state: outputs and final states agree. `per_step` is [batch, outputs per step and batch
    /// entry].
    fn halves_agree<F>(t_len: usize, cut: usize, per_step: &[usize], run: F)
    where
        F: Fn(usize, usize, Option<&[f64]>) -> (Vec<f64>, Vec<f64>),
    {
        let (y, s) = run(0, t_len, None);
        let (y1, s1) = run(0, cut, None);
        let (y2, s2) = run(cut, t_len, Some(&s1));
        // Outputs are batch-major, `width` values per step.
        let (batch, width) = (per_step[0], per_step[1]);
        for b in 0..batch {
            let whole = &y[b * t_len * width..][..t_len * width];
            let first = &y1[b * cut * width..][..cut * width];
            let second = &y2[b * (t_len - cut) * width..][..(t_len - cut) * width];
            let e1 = max_rel(&whole[..cut * width], first);
            let e2 = max_rel(&whole[cut * width..], second);
            assert!(
                e1 < 1e-13 && e2 < 1e-13,
                "batch {b}: first part {e1}, second {e2}"
            );
        }
        let es = max_rel(&s2, &s);
        assert!(es < 1e-13, "final state {es}");
    }

    /// The time steps [t0, t1) of a `[B, T, rest]` tensor.
    fn steps(x: &[f64], batch: usize, t_len: usize, t0: usize, t1: usize) -> Vec<f64> {
        let rest = x.len() / (batch * t_len);
        (0..batch)
            .flat_map(|b| x[(b * t_len + t0) * rest..(b * t_len + t1) * rest].to_vec())
            .collect()
    }

    #[test]
    fn ssd_in_two_halves_equals_one_pass() {
        let d = ssd_data(SSD, 7);
        let t = SSD.seq_len;
        halves_agree(
            t,
            4,
            &[SSD.batch, SSD.heads * SSD.head_dim],
            |t0, t1, s0| {
                let sl = |v: &[f64]| steps(v, SSD.batch, t, t0, t1);
                let (x, dt, b, c) = (sl(&d.x), sl(&d.dt), sl(&d.b), sl(&d.c));
                let shape = SsdShape {
                    seq_len: t1 - t0,
                    ..SSD
                };
                ssd(
                    shape,
                    SsdInputs {
                        x: &x,
                        dt: &dt,
                        a: &d.a,
                        b: &b,
                        c: &c,
                        d: Some(&d.d),
                        initial_state: s0,
                    },
                )
                .unwrap()
            },
        );
    }

    /// With A the same for every state entry of a channel, B and C shared (one group) and the
    /// channels of a head stepping by the head's Δ, Mamba-1's scan is SSD.
    #[test]
    fn the_selective_scan_with_a_scalar_a_per_head_is_ssd() {
        let s = SsdShape { groups: 1, ..SSD };
        let d = ssd_data(s, 3);
        let (y, state) = ssd(s, ssd_inputs(&d)).unwrap();
        let channels = s.heads * s.head_dim;
        let delta: Vec<f64> = (0..s.batch * s.seq_len)
            .flat_map(|bt| (0..channels).map(move |ch| (bt, ch / s.head_dim)))
            .map(|(bt, h)| d.dt[bt * s.heads + h])
            .collect();
        let a: Vec<f64> = (0..channels)
            .flat_map(|ch| std::iter::repeat_n(d.a[ch / s.head_dim], s.state))
            .collect();
        let dd: Vec<f64> = (0..channels).map(|ch| d.d[ch / s.head_dim]).collect();
        let (y2, state2) = selective_scan(
            ScanShape {
                batch: s.batch,
                seq_len: s.seq_len,
                channels,
                state: s.state,
            },
            ScanInputs {
                u: &d.x,
                delta: &delta,
                a: &a,
                b: &d.b,
                c: &d.c,
                d: Some(&dd),
                initial_state: None,
            },
        )
        .unwrap();
        assert!(max_rel(&y2, &y) < 1e-13);
        assert!(max_rel(&state2, &state) < 1e-13);
    }

    /// Random inputs of a scan: u, Δ, A, B and C from seeds `seed` to `seed + 4`.
    fn scan_data(sh: ScanShape, seed: u64) -> [Vec<f64>; 5] {
        let bt = sh.batch * sh.seq_len;
        [
            uniform(bt * sh.channels, -1.0, 1.0, seed),
            uniform(bt * sh.channels, 0.05, 0.5, seed + 1),
            uniform(sh.channels * sh.state, -2.0, -0.1, seed + 2),
            uniform(bt * sh.state, -1.0, 1.0, seed + 3),
            uniform(bt * sh.state, -1.0, 1.0, seed + 4),
        ]
    }

    /// The scan against its closed form from a zero state, with a different A for every state
    /// entry: y_t = Σ_{s ≤ t} Σ_n C_t[n] exp(A_n Σ_{r=s+1..t} Δ_r) Δ_s B_s[n] u_s + D u_t.
    #[test]
    fn the_selective_scan_matches_its_closed_form() {
        let sh = ScanShape {
            batch: 2,
            seq_len: 7,
            channels: 3,
            state: 4,
        };
        let (t_len, ch, nd) = (sh.seq_len, sh.channels, sh.state);
        let [u, delta, a, b, c] = scan_data(sh, 70);
        let d = uniform(ch, -1.0, 1.0, 75);
        let (y, _) = selective_scan(
            sh,
            ScanInputs {
                u: &u,
                delta: &delta,
                a: &a,
                b: &b,
                c: &c,
                d: Some(&d),
                initial_state: None,
            },
        )
        .unwrap();
        for bb in 0..sh.batch {
            for t in 0..t_len {
                for k in 0..ch {
                    let at = |s: usize| (bb * t_len + s) * ch + k;
                    let mut want = d[k] * u[at(t)];
                    for s in 0..=t {
                        let dsum: f64 = (s + 1..=t).map(|r| delta[at(r)]).sum();
                        for n in 0..nd {
                            want += c[(bb * t_len + t) * nd + n]
                                * (a[k * nd + n] * dsum).exp()
                                * delta[at(s)]
                                * b[(bb * t_len + s) * nd + n]
                                * u[at(s)];
                        }
                    }
                    let got = y[at(t)];
                    assert!(
                        (got - want).abs() < 1e-12,
                        "b {bb} t {t} ch {k}: {got} vs {want}"
                    );
                }
            }
        }
    }

    #[test]
    fn the_selective_scan_in_two_halves_equals_one_pass() {
        let sh = ScanShape {
            batch: 2,
            seq_len: 11,
            channels: 6,
            state: 4,
        };
        let [u, delta, a, b, c] = scan_data(sh, 20);
        halves_agree(sh.seq_len, 5, &[sh.batch, sh.channels], |t0, t1, s0| {
            let sl = |v: &[f64]| steps(v, sh.batch, sh.seq_len, t0, t1);
            let (u, delta, b, c) = (sl(&u), sl(&delta), sl(&b), sl(&c));
            selective_scan(
                ScanShape {
                    seq_len: t1 - t0,
                    ..sh
                },
                ScanInputs {
                    u: &u,
                    delta: &delta,
                    a: &a,
                    b: &b,
                    c: &c,
                    d: None,
                    initial_state: s0,
                },
            )
            .unwrap()
        });
    }

    const DELTA: DeltaShape = DeltaShape {
        batch: 2,
        seq_len: 8,
        heads: 3,
        key_dim: 4,
        value_dim: 5,
    };

    fn unit_keys(n: usize, kd: usize, seed: u64) -> Vec<f64> {
        let mut k = uniform(n * kd, -1.0, 1.0, seed);
        for row in k.chunks_mut(kd) {
            let norm = row.iter().map(|x| x * x).sum::<f64>().sqrt();
            row.iter_mut().for_each(|x| *x /= norm);
        }
        k
    }

    /// With α = β = 1 and unit keys the delta rule replaces what the state holds for k_t by v_t:
    /// S_t k_t = v_t, so querying with the key returns the value just written.
    #[test]
    fn the_delta_rule_writes_the_value_under_its_key() {
        let s = DELTA;
        let n = s.batch * s.seq_len * s.heads;
        let k = unit_keys(n, s.key_dim, 30);
        let v = uniform(n * s.value_dim, -1.0, 1.0, 31);
        let ones = vec![1.0; n];
        let s0 = uniform(s.batch * s.heads * s.value_dim * s.key_dim, -1.0, 1.0, 32);
        let (o, _) = gated_delta_rule(
            s,
            DeltaInputs {
                q: &k,
                k: &k,
                v: &v,
                alpha: &ones,
                beta: &ones,
                initial_state: Some(&s0),
            },
        )
        .unwrap();
        assert!(max_rel(&o, &v) < 1e-12);
    }

    /// With β = 0 nothing is written: the state only decays, o_t = (Π_{r ≤ t} α_r) S_0 q_t.
    #[test]
    fn without_writes_the_gated_state_only_decays() {
        let s = DeltaShape {
            batch: 1,
            heads: 1,
            ..DELTA
        };
        let n = s.seq_len;
        let q = uniform(n * s.key_dim, -1.0, 1.0, 40);
        let k = unit_keys(n, s.key_dim, 41);
        let v = uniform(n * s.value_dim, -1.0, 1.0, 42);
        let alpha = uniform(n, 0.5, 1.0, 43);
        let zeros = vec![0.0; n];
        let s0 = uniform(s.value_dim * s.key_dim, -1.0, 1.0, 44);
        let (o, last) = gated_delta_rule(
            s,
            DeltaInputs {
                q: &q,
                k: &k,
                v: &v,
                alpha: &alpha,
                beta: &zeros,
                initial_state: Some(&s0),
            },
        )
        .unwrap();
        let mut decay = 1.0;
        for t in 0..n {
            decay *= alpha[t];
            for r in 0..s.value_dim {
                let want: f64 = decay
                    * (0..s.key_dim)
                        .map(|j| s0[r * s.key_dim + j] * q[t * s.key_dim + j])
                        .sum::<f64>();
                let got = o[t * s.value_dim + r];
                assert!((got - want).abs() < 1e-12, "t {t} r {r}: {got} vs {want}");
            }
        }
        let scaled: Vec<f64> = s0.iter().map(|x| x * decay).collect();
        assert!(max_rel(&last, &scaled) < 1e-12);
    }

    /// The recurrence against the paper's matrix form, computed as written: the transition
    /// M_t = α_t (I − β_t k_t k_tᵀ) as a K × K matrix, S_t = S_{t−1} M_t + β_t v_t k_tᵀ.
    #[test]
    fn the_gated_delta_rule_matches_its_matrix_form() {
        let s = DeltaShape {
            batch: 1,
            heads: 1,
            ..DELTA
        };
        let (n, kd, vd) = (s.seq_len, s.key_dim, s.value_dim);
        let q = uniform(n * kd, -1.0, 1.0, 60);
        let k = unit_keys(n, kd, 61);
        let v = uniform(n * vd, -1.0, 1.0, 62);
        let alpha = uniform(n, 0.3, 0.9, 63);
        let beta = uniform(n, 0.2, 1.0, 64);
        let s0 = uniform(vd * kd, -1.0, 1.0, 65);
        let (o, last) = gated_delta_rule(
            s,
            DeltaInputs {
                q: &q,
                k: &k,
                v: &v,
                alpha: &alpha,
                beta: &beta,
                initial_state: Some(&s0),
            },
        )
        .unwrap();
        let mut st = s0.clone();
        for t in 0..n {
            let kt = &k[t * kd..][..kd];
            let m: Vec<f64> = (0..kd * kd)
                .map(|e| {
                    let (i, j) = (e / kd, e % kd);
                    let id = if i == j { 1.0 } else { 0.0 };
                    alpha[t] * (id - beta[t] * kt[i] * kt[j])
                })
                .collect();
            let mut next = vec![0.0; vd * kd];
            for r in 0..vd {
                for j in 0..kd {
                    let sm: f64 = (0..kd).map(|i| st[r * kd + i] * m[i * kd + j]).sum();
                    next[r * kd + j] = sm + beta[t] * v[t * vd + r] * kt[j];
                }
            }
            st = next;
            for r in 0..vd {
                let want: f64 = (0..kd).map(|j| st[r * kd + j] * q[t * kd + j]).sum();
                assert!((o[t * vd + r] - want).abs() < 1e-12, "t {t} r {r}");
            }
        }
        assert!(max_rel(&last, &st) < 1e-12);
    }

    #[test]
    fn the_gated_delta_rule_in_two_halves_equals_one_pass() {
        let s = DELTA;
        let n = s.batch * s.seq_len * s.heads;
        let q = uniform(n * s.key_dim, -1.0, 1.0, 50);
        let k = unit_keys(n, s.key_dim, 51);
        let v = uniform(n * s.value_dim, -1.0, 1.0, 52);
        let alpha = uniform(n, 0.5, 1.0, 53);
        let beta = uniform(n, 0.0, 1.0, 54);
        halves_agree(
            s.seq_len,
            3,
            &[s.batch, s.heads * s.value_dim],
            |t0, t1, s0| {
                let sl = |x: &[f64]| steps(x, s.batch, s.seq_len, t0, t1);
                let (q, k, v, alpha, beta) = (sl(&q), sl(&k), sl(&v), sl(&alpha), sl(&beta));
                gated_delta_rule(
                    DeltaShape {
                        seq_len: t1 - t0,
                        ..s
                    },
                    DeltaInputs {
                        q: &q,
                        k: &k,
                        v: &v,
                        alpha: &alpha,
                        beta: &beta,
                        initial_state: s0,
                    },
                )
                .unwrap()
            },
        );
    }

    #[test]
    fn an_empty_sequence_returns_the_initial_state() {
        let s = SsdShape { seq_len: 0, ..SSD };
        let s0 = uniform(s.batch * s.heads * s.head_dim * s.state, -1.0, 1.0, 80);
        let (y, last) = ssd(
            s,
            SsdInputs {
                x: &[],
                dt: &[],
                a: &[-1.0; 4],
                b: &[],
                c: &[],
                d: None,
                initial_state: Some(&s0),
            },
        )
        .unwrap();
        assert!(y.is_empty());
        assert_eq!(last, s0);
    }

    #[test]
    fn bad_lengths_name_the_input() {
        let d = ssd_data(SSD, 9);
        let short = &d.b[1..];
        let e = ssd(
            SSD,
            SsdInputs {
                b: short,
                ..ssd_inputs(&d)
            },
        )
        .unwrap_err();
        assert!(e.starts_with("b:"), "{e}");
        let e = ssd(SsdShape { groups: 3, ..SSD }, ssd_inputs(&d)).unwrap_err();
        assert!(e.contains("multiple of groups"), "{e}");
        let e = gated_delta_rule(
            DELTA,
            DeltaInputs {
                q: &[],
                k: &[],
                v: &[],
                alpha: &[],
                beta: &[],
                initial_state: None,
            },
        )
        .unwrap_err();
        assert!(e.starts_with("q:"), "{e}");
    }

    const BASED: BasedShape = BasedShape {
        batch: 2,
        seq_len: 13,
        heads: 3,
        key_dim: 4,
        value_dim: 5,
        window: 4,
    };

    /// The scale the Based tests use, 1/√K for K = 4.
    const BASED_SCALE: f64 = 0.5;

    /// Random q, k and v of a Based call, from seeds `seed` to `seed + 2`.
    fn based_data(s: BasedShape, seed: u64) -> [Vec<f64>; 3] {
        let n = s.batch * s.seq_len * s.heads;
        [
            uniform(n * s.key_dim, -1.0, 1.0, seed),
            uniform(n * s.key_dim, -1.0, 1.0, seed + 1),
            uniform(n * s.value_dim, -1.0, 1.0, seed + 2),
        ]
    }

    fn based_run(
        s: BasedShape,
        [q, k, v]: &[Vec<f64>; 3],
        s0: Option<&BasedState>,
    ) -> (Vec<f64>, BasedState) {
        based(
            s,
            BasedInputs {
                q,
                k,
                v,
                scale: BASED_SCALE,
                initial_state: s0,
            },
        )
        .unwrap()
    }

    /// Full causal softmax attention, each output a direct sum over all earlier steps (no
    /// window, no max subtraction: the scores are small), `[B, T, H, V]`.
    fn causal_softmax(s: BasedShape, [q, k, v]: &[Vec<f64>; 3]) -> Vec<f64> {
        let (t_len, heads, kd, vd) = (s.seq_len, s.heads, s.key_dim, s.value_dim);
        let at = |b: usize, t: usize, h: usize| (b * t_len + t) * heads + h;
        let mut o = vec![0.0; s.batch * t_len * heads * vd];
        for b in 0..s.batch {
            for h in 0..heads {
                for t in 0..t_len {
                    let w: Vec<f64> = (0..=t)
                        .map(|u| {
                            let dot: f64 = (0..kd)
                                .map(|j| q[at(b, t, h) * kd + j] * k[at(b, u, h) * kd + j])
                                .sum();
                            (BASED_SCALE * dot).exp()
                        })
                        .collect();
                    let z: f64 = w.iter().sum();
                    for r in 0..vd {
                        o[at(b, t, h) * vd + r] =
                            (0..=t).map(|u| w[u] * v[at(b, u, h) * vd + r]).sum::<f64>() / z;
                    }
                }
            }
        }
        o
    }

    /// The linear branch in matrix form, scale · (Q Kᵀ ∘ M) V with M the causal mask
    /// (M[t, u] = 1 for u ≤ t), one batch entry and head at a time, `[B, T, H, V]`.
    fn linear_matrix_form(s: BasedShape, [q, k, v]: &[Vec<f64>; 3]) -> Vec<f64> {
        let (t_len, heads, kd, vd) = (s.seq_len, s.heads, s.key_dim, s.value_dim);
        let at = |b: usize, t: usize, h: usize| (b * t_len + t) * heads + h;
        let mut o = vec![0.0; s.batch * t_len * heads * vd];
        for b in 0..s.batch {
            for h in 0..heads {
                // A = Q Kᵀ ∘ M, T × T.
                let mut a = vec![0.0; t_len * t_len];
                for t in 0..t_len {
                    for u in 0..t_len {
                        let qk: f64 = (0..kd)
                            .map(|j| q[at(b, t, h) * kd + j] * k[at(b, u, h) * kd + j])
                            .sum();
                        a[t * t_len + u] = if u <= t { qk } else { 0.0 };
                    }
                }
                for t in 0..t_len {
                    for r in 0..vd {
                        let av: f64 = (0..t_len)
                            .map(|u| a[t * t_len + u] * v[at(b, u, h) * vd + r])
                            .sum();
                        o[at(b, t, h) * vd + r] = BASED_SCALE * av;
                    }
                }
            }
        }
        o
    }

    /// With W ≥ T the window sees every earlier key: the output is full causal softmax
    /// attention plus the linear branch's matrix form, the final S is Vᵀ K per head, and the
    /// cache holds the last min(W − 1, T) keys and values.
    #[test]
    fn based_with_a_window_covering_the_sequence_is_softmax_plus_linear_attention() {
        for window in [BASED.seq_len, BASED.seq_len + 5] {
            let s = BasedShape { window, ..BASED };
            let d = based_data(s, 90);
            let (o, last) = based_run(s, &d, None);
            let want: Vec<f64> = causal_softmax(s, &d)
                .iter()
                .zip(linear_matrix_form(s, &d))
                .map(|(a, b)| a + b)
                .collect();
            let e = max_rel(&o, &want);
            assert!(e < 1e-12, "window {window}: {e}");
            let (t_len, heads, kd, vd) = (s.seq_len, s.heads, s.key_dim, s.value_dim);
            let [_, k, v] = &d;
            let at = |b: usize, t: usize, h: usize| (b * t_len + t) * heads + h;
            let mut vk = vec![0.0; s.batch * heads * vd * kd];
            for b in 0..s.batch {
                for h in 0..heads {
                    for r in 0..vd {
                        for j in 0..kd {
                            vk[((b * heads + h) * vd + r) * kd + j] = (0..t_len)
                                .map(|t| v[at(b, t, h) * vd + r] * k[at(b, t, h) * kd + j])
                                .sum();
                        }
                    }
                }
            }
            assert!(max_rel(&last.s, &vk) < 1e-12, "window {window}: final S");
            let c = (window - 1).min(t_len);
            assert_eq!(last.cached, c);
            assert_eq!(last.keys, steps_per_head(k, s, kd, t_len - c));
            assert_eq!(last.values, steps_per_head(v, s, vd, t_len - c));
        }
    }

    /// Steps [from, T) of a `[B, T, H, width]` tensor, regrouped `[B, H, T − from, width]`.
    fn steps_per_head(x: &[f64], s: BasedShape, width: usize, from: usize) -> Vec<f64> {
        let (t_len, heads) = (s.seq_len, s.heads);
        let mut out = Vec::new();
        for b in 0..s.batch {
            for h in 0..heads {
                for t in from..t_len {
                    out.extend_from_slice(&x[((b * t_len + t) * heads + h) * width..][..width]);
                }
            }
        }
        out
    }

    /// With W = 1 the window holds only the current key, whose softmax weight is 1: the window
    /// branch is v_t, the output v_t plus the linear branch, and nothing is cached.
    #[test]
    fn based_with_a_window_of_one_returns_the_value() {
        let s = BasedShape { window: 1, ..BASED };
        let d = based_data(s, 100);
        let (o, last) = based_run(s, &d, None);
        let window_branch: Vec<f64> = o
            .iter()
            .zip(linear_matrix_form(s, &d))
            .map(|(a, b)| a - b)
            .collect();
        let e = max_rel(&window_branch, &d[2]);
        assert!(e < 1e-12, "{e}");
        assert_eq!(last.cached, 0);
        assert!(last.keys.is_empty() && last.values.is_empty());
    }

    /// Runs `s` over the whole sequence and over steps [0, cut) then [cut, T) with the first
    /// part's final state, both from `s0`: outputs and final states agree within 1e-12.
    fn based_halves_agree(s: BasedShape, cut: usize, s0: Option<&BasedState>, seed: u64) {
        let d = based_data(s, seed);
        let t_len = s.seq_len;
        let part = |t0: usize, t1: usize, init: Option<&BasedState>| {
            let sl = |x: &[f64]| steps(x, s.batch, t_len, t0, t1);
            let dd = [sl(&d[0]), sl(&d[1]), sl(&d[2])];
            based_run(
                BasedShape {
                    seq_len: t1 - t0,
                    ..s
                },
                &dd,
                init,
            )
        };
        let (o, last) = based_run(s, &d, s0);
        let (o1, last1) = part(0, cut, s0);
        let (o2, last2) = part(cut, t_len, Some(&last1));
        let width = s.heads * s.value_dim;
        let tag = format!("window {} cut {cut}", s.window);
        for b in 0..s.batch {
            let whole = &o[b * t_len * width..][..t_len * width];
            let first = &o1[b * cut * width..][..cut * width];
            let second = &o2[b * (t_len - cut) * width..][..(t_len - cut) * width];
            let e1 = max_rel(&whole[..cut * width], first);
            let e2 = max_rel(&whole[cut * width..], second);
            assert!(e1 < 1e-12 && e2 < 1e-12, "{tag}, batch {b}: {e1}, {e2}");
        }
        assert_eq!(last2.cached, last.cached, "{tag}");
        for (name, x, y) in [
            ("S", &last2.s, &last.s),
            ("keys", &last2.keys, &last.keys),
            ("values", &last2.values, &last.values),
        ] {
            let e = max_rel(x, y);
            assert!(e < 1e-12, "{tag}: final {name} {e}");
        }
    }

    /// Cuts at every step with W = 4 (inside the first W − 1 steps, at the ends and beyond),
    /// and windows longer than the first part, from a zero state and from a random state with
    /// a cache.
    #[test]
    fn based_in_two_parts_equals_one_pass() {
        for cut in 0..=BASED.seq_len {
            based_halves_agree(BASED, cut, None, 110);
        }
        for (window, cut) in [(9, 2), (9, 5), (9, 8), (15, 6), (2, 1), (2, 7)] {
            based_halves_agree(BasedShape { window, ..BASED }, cut, None, 111);
        }
        for (window, cached, cut) in [(4, 3, 1), (4, 2, 6), (9, 5, 3), (3, 1, 0)] {
            let s = BasedShape { window, ..BASED };
            let (bh, kd, vd) = (s.batch * s.heads, s.key_dim, s.value_dim);
            let s0 = BasedState {
                s: uniform(bh * vd * kd, -1.0, 1.0, 112),
                keys: uniform(bh * cached * kd, -1.0, 1.0, 113),
                values: uniform(bh * cached * vd, -1.0, 1.0, 114),
                cached,
            };
            based_halves_agree(s, cut, Some(&s0), 115);
        }
    }

    /// An initial linear state S0 (and no cache) adds scale · S0 q_t to every output and S0 to
    /// the final state.
    #[test]
    fn based_initial_linear_state_adds_its_read_out() {
        let s = BASED;
        let d = based_data(s, 120);
        let (t_len, heads, kd, vd) = (s.seq_len, s.heads, s.key_dim, s.value_dim);
        let s0 = BasedState {
            s: uniform(s.batch * heads * vd * kd, -1.0, 1.0, 123),
            ..BasedState::zeros(s)
        };
        let (o, last) = based_run(s, &d, None);
        let (o0, last0) = based_run(s, &d, Some(&s0));
        let q = &d[0];
        for b in 0..s.batch {
            for t in 0..t_len {
                for h in 0..heads {
                    let i = (b * t_len + t) * heads + h;
                    for r in 0..vd {
                        let read: f64 = (0..kd)
                            .map(|j| s0.s[((b * heads + h) * vd + r) * kd + j] * q[i * kd + j])
                            .sum();
                        let got = o0[i * vd + r] - o[i * vd + r];
                        let want = BASED_SCALE * read;
                        assert!(
                            (got - want).abs() < 1e-12,
                            "b {b} t {t} h {h} r {r}: {got} vs {want}"
                        );
                    }
                }
            }
        }
        let plus: Vec<f64> = last.s.iter().zip(&s0.s).map(|(a, b)| a + b).collect();
        assert!(max_rel(&last0.s, &plus) < 1e-12);
        assert_eq!((&last0.keys, &last0.values), (&last.keys, &last.values));
    }

    #[test]
    fn based_bad_lengths_name_the_input_and_an_empty_sequence_keeps_the_state() {
        let s = BASED;
        let [q, k, v] = based_data(s, 130);
        let inp = BasedInputs {
            q: &q,
            k: &k,
            v: &v,
            scale: BASED_SCALE,
            initial_state: None,
        };
        let err = |s: BasedShape, inp: BasedInputs| based(s, inp).unwrap_err();
        let e = err(s, BasedInputs { q: &q[1..], ..inp });
        assert!(e.starts_with("q:"), "{e}");
        let e = err(s, BasedInputs { k: &k[1..], ..inp });
        assert!(e.starts_with("k:"), "{e}");
        let e = err(s, BasedInputs { v: &q, ..inp });
        assert!(e.starts_with("v:"), "{e}");
        let e = err(BasedShape { window: 0, ..s }, inp);
        assert!(e.contains("empty dimension"), "{e}");
        let (bh, kd, vd) = (s.batch * s.heads, s.key_dim, s.value_dim);
        let good = BasedState {
            s: uniform(bh * vd * kd, -1.0, 1.0, 133),
            keys: uniform(bh * 2 * kd, -1.0, 1.0, 134),
            values: uniform(bh * 2 * vd, -1.0, 1.0, 135),
            cached: 2,
        };
        let bad = [
            (
                BasedState {
                    s: good.s[1..].to_vec(),
                    ..good.clone()
                },
                "initial_state.s:",
            ),
            (
                BasedState {
                    keys: good.keys[kd..].to_vec(),
                    ..good.clone()
                },
                "initial_state.keys:",
            ),
            (
                BasedState {
                    values: good.keys.clone(),
                    ..good.clone()
                },
                "initial_state.values:",
            ),
            (
                BasedState {
                    keys: uniform(bh * 4 * kd, -1.0, 1.0, 136),
                    values: uniform(bh * 4 * vd, -1.0, 1.0, 137),
                    cached: 4,
                    ..good.clone()
                },
                "initial_state:",
            ),
        ];
        for (state, name) in &bad {
            let e = err(
                s,
                BasedInputs {
                    initial_state: Some(state),
                    ..inp
                },
            );
            assert!(e.starts_with(name), "{name}: {e}");
        }
        let empty = BasedShape { seq_len: 0, ..s };
        let none = BasedInputs {
            q: &[],
            k: &[],
            v: &[],
            ..inp
        };
        let (o, last) = based(
            empty,
            BasedInputs {
                initial_state: Some(&good),
                ..none
            },
        )
        .unwrap();
        assert!(o.is_empty());
        assert_eq!(last, good);
        let (o, last) = based(empty, none).unwrap();
        assert!(o.is_empty());
        assert_eq!(last, BasedState::zeros(s));
    }
}
