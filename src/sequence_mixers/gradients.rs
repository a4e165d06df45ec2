//! Float64 backward references of SSD and the selective scan: the vector-Jacobian products of
//! [`super::reference::ssd`] (Mamba-2's state-space dual layer; Dao and Gu, 2024,
//! "Transformers are SSMs: Generalized Models and Efficient Algorithms Through Structured State
//! Space Duality") and [`super::reference::selective_scan`] (Mamba-1's selective scan; Gu and
//! Dao, 2023, "Mamba: Linear-Time Sequence Modeling with Selective State Spaces"), which the
//! backward kernels are checked against.
//!
//! Each is the adjoint of its recurrence, run one time step after another from the last step
//! back to the first while holding the adjoint of the state (∂L/∂S_t), as the papers' and
//! mamba_ssm's backward passes do, not a finite difference. The forward recurrence is
//! recomputed inside (SSD: from checkpoints every 256 steps, one task per batch entry and head
//! in parallel; the scan: its tasks' states kept whole), so
//! the functions take the forward's inputs ([`SsdInputs`], [`ScanInputs`]) and the cotangents
//! of its two outputs: dy (of Y) and, optionally, d_final_state (of the final state; zeros when
//! none). What they compute is the gradient of the scalar
//!
//! L = Σ dy ∘ Y + Σ d_final_state ∘ final_state
//!
//! with respect to every input, including the initial state (zeros when none was given: the
//! gradient is returned either way). Layouts are those of [`super::reference`]; gradients of
//! inputs shared across an axis (A and D across batch and time, B and C across the heads of a
//! group or the channels) are summed over it.

use rayon::prelude::*;

use super::reference::{check_len, or_zeros, ScanInputs, ScanShape, SsdInputs, SsdShape};

/// Gradients of SSD's inputs ([`ssd_backward`]), float64, in the layouts of [`SsdInputs`].
#[derive(Clone, Debug, PartialEq)]
pub struct SsdGradients {
    /// ∂L/∂X, `[B, T, H, P]`.
    pub dx: Vec<f64>,
    /// ∂L/∂Δ, `[B, T, H]` (with respect to Δ after the softplus).
    pub ddt: Vec<f64>,
    /// ∂L/∂A, `[H]`, summed over batch and time.
    pub da: Vec<f64>,
    /// ∂L/∂B, `[B, T, G, N]`, summed over the heads of each group.
    pub db: Vec<f64>,
    /// ∂L/∂C, `[B, T, G, N]`, summed over the heads of each group.
    pub dc: Vec<f64>,
    /// ∂L/∂D, `[H]`, summed over batch, time and P, when D was given; none otherwise.
    pub dd: Option<Vec<f64>>,
    /// ∂L/∂(initial state), `[B, H, P, N]`, whether or not an initial state was given.
    pub d_initial_state: Vec<f64>,
}

/// The backward of [`super::reference::ssd`] (Dao and Gu, 2024, Mamba-2's SSD with A a scalar
/// times the identity per head and B, C shared by groups of heads): the gradient of
/// L = ⟨dy, Y⟩ + ⟨d_final_state, final state⟩ with respect to every input, from the forward's
/// inputs `inp` (the forward is recomputed), `dy` `[B, T, H, P]` and `d_final_state`
/// `[B, H, P, N]` (zeros when none).
///
/// For each batch entry and head h (group g = h / (H / G)), the forward is, for t = 1 … T,
/// with S_0 the initial state and a_t = exp(Δ_t A_h),
///
/// S_t = a_t S_{t−1} + Δ_t x_t B_tᵀ,  y_t = S_t C_t + D_h x_t.
///
/// The adjoint Ŝ_t = ∂L/∂S_t (P × N) runs backwards from the final state's cotangent:
///
/// Ŝ_T = d_final_state + dy_T C_Tᵀ,  Ŝ_{t−1} = a_t Ŝ_t + dy_{t−1} C_{t−1}ᵀ (t > 1),
///
/// and the gradient of the initial state is a_1 Ŝ_1 (d_final_state itself when T = 0). At each
/// step, with ⟨·, ·⟩ the sum of the elementwise product,
///
/// - dx_t = Δ_t Ŝ_t B_t + D_h dy_t,
/// - dB_t = Σ_{h in g} Δ_t Ŝ_tᵀ x_t,  dC_t = Σ_{h in g} S_tᵀ dy_t,
/// - dΔ_t = A_h a_t ⟨Ŝ_t, S_{t−1}⟩ + x_tᵀ Ŝ_t B_t,
/// - dA_h = Σ_{b, t} Δ_t a_t ⟨Ŝ_t, S_{t−1}⟩,  dD_h = Σ_{b, t} ⟨dy_t, x_t⟩.
///
/// # Errors
/// A message naming the input whose length does not fit `shape` (`dy` and `d_final_state`
/// included), or the shape's fault (heads not a multiple of groups, an empty dimension other
/// than seq_len), as the forward reports them.
pub fn ssd_backward(
    shape: SsdShape,
    inp: SsdInputs,
    dy: &[f64],
    d_final_state: Option<&[f64]>,
) -> Result<SsdGradients, String> {
    let SsdShape {
        batch,
        seq_len: t_len,
        heads,
        head_dim: p_dim,
        state: n_dim,
        groups,
    } = shape;
    shape.check("ssd_backward", &inp)?;
    check_len("dy", dy, batch * t_len * heads * p_dim)?;
    let pn = p_dim * n_dim;
    let s0 = or_zeros("initial_state", inp.initial_state, batch * heads * pn)?;
    let d_final = or_zeros("d_final_state", d_final_state, batch * heads * pn)?;
    let per_group = heads / groups;
    // States are kept every SEGMENT steps (checkpoints); a segment's states are recomputed
    // from its checkpoint when the adjoint reaches it: memory (T / SEGMENT + SEGMENT)·P·N per
    // task rather than T·P·N, the forward run twice.
    const SEGMENT: usize = 256;
    // One task per (batch entry, head), in parallel; each returns its parts, gathered below.
    struct Task {
        dx: Vec<f64>,
        ddt: Vec<f64>,
        db: Vec<f64>,
        dc: Vec<f64>,
        da: f64,
        dd: f64,
        d_initial: Vec<f64>,
    }
    let tasks: Vec<Task> = (0..batch * heads)
        .into_par_iter()
        .map(|task| {
            let (b, h) = (task / heads, task % heads);
            let g = h / per_group;
            let bh = task * pn;
            let skip = inp.d.map_or(0.0, |d| d[h]);
            let a_h = inp.a[h];
            // One forward step from `prev` into `next`.
            let step = |t: usize, prev: &[f64], next: &mut [f64]| {
                let bt = b * t_len + t;
                let dt = inp.dt[bt * heads + h];
                let decay = (dt * a_h).exp();
                let x = &inp.x[(bt * heads + h) * p_dim..][..p_dim];
                let bv = &inp.b[(bt * groups + g) * n_dim..][..n_dim];
                for p in 0..p_dim {
                    for n in 0..n_dim {
                        next[p * n_dim + n] = decay * prev[p * n_dim + n] + dt * x[p] * bv[n];
                    }
                }
            };
            // The forward, keeping the state entering every segment.
            let segments = t_len.div_ceil(SEGMENT);
            let mut checkpoints = vec![0.0; segments.max(1) * pn];
            let mut cur = s0[bh..][..pn].to_vec();
            let mut next = vec![0.0; pn];
            for t in 0..t_len {
                if t % SEGMENT == 0 {
                    checkpoints[(t / SEGMENT) * pn..][..pn].copy_from_slice(&cur);
                }
                step(t, &cur, &mut next);
                std::mem::swap(&mut cur, &mut next);
            }
            let mut out = Task {
                dx: vec![0.0; t_len * p_dim],
                ddt: vec![0.0; t_len],
                db: vec![0.0; t_len * n_dim],
                dc: vec![0.0; t_len * n_dim],
                da: 0.0,
                dd: 0.0,
                d_initial: Vec::new(),
            };
            // The adjoint Ŝ, d_final_state to start with, a_1 Ŝ_1 once the loop is done.
            let mut s_adj = d_final[bh..][..pn].to_vec();
            // S_{t0} … S_{t1} of the segment the adjoint is in.
            let mut states = vec![0.0; (SEGMENT + 1) * pn];
            for seg in (0..segments).rev() {
                let (t0, t1) = (seg * SEGMENT, ((seg + 1) * SEGMENT).min(t_len));
                states[..pn].copy_from_slice(&checkpoints[seg * pn..][..pn]);
                for t in t0..t1 {
                    let (prev, rest) = states[(t - t0) * pn..].split_at_mut(pn);
                    step(t, prev, &mut rest[..pn]);
                }
                for t in (t0..t1).rev() {
                    let bt = b * t_len + t;
                    let dt = inp.dt[bt * heads + h];
                    let decay = (dt * a_h).exp();
                    let xi = (bt * heads + h) * p_dim;
                    let gi = (bt * groups + g) * n_dim;
                    let x = &inp.x[xi..][..p_dim];
                    let bv = &inp.b[gi..][..n_dim];
                    let cv = &inp.c[gi..][..n_dim];
                    let dyv = &dy[xi..][..p_dim];
                    let (prev, cur) = states[(t - t0) * pn..(t - t0 + 2) * pn].split_at(pn);
                    let (db_t, dc_t) = (
                        &mut out.db[(t * n_dim)..][..n_dim],
                        &mut out.dc[(t * n_dim)..][..n_dim],
                    );
                    // ⟨Ŝ_t, S_{t−1}⟩ and xᵀ Ŝ_t B.
                    let (mut s_prev, mut s_xb) = (0.0, 0.0);
                    for p in 0..p_dim {
                        let mut sb = 0.0;
                        for n in 0..n_dim {
                            let e = p * n_dim + n;
                            // Ŝ_t = (what came back from step t + 1) + dy_t C_tᵀ.
                            s_adj[e] += dyv[p] * cv[n];
                            let sa = s_adj[e];
                            dc_t[n] += cur[e] * dyv[p];
                            db_t[n] += dt * sa * x[p];
                            sb += sa * bv[n];
                            s_prev += sa * prev[e];
                            // What goes back to step t − 1.
                            s_adj[e] = decay * sa;
                        }
                        out.dx[t * p_dim + p] = dt * sb + skip * dyv[p];
                        s_xb += x[p] * sb;
                        out.dd += dyv[p] * x[p];
                    }
                    out.ddt[t] = a_h * decay * s_prev + s_xb;
                    out.da += dt * decay * s_prev;
                }
            }
            out.d_initial = s_adj;
            out
        })
        .collect();

    let mut dx = vec![0.0; batch * t_len * heads * p_dim];
    let mut ddt = vec![0.0; batch * t_len * heads];
    let mut da = vec![0.0; heads];
    let mut db = vec![0.0; batch * t_len * groups * n_dim];
    let mut dc = vec![0.0; batch * t_len * groups * n_dim];
    let mut dd = vec![0.0; heads];
    let mut adj = vec![0.0; batch * heads * pn];
    // Gathered in task order (batch entry, then head): the sums over heads and batch entries
    // are in the same order on every run.
    for (task, part) in tasks.into_iter().enumerate() {
        let (b, h) = (task / heads, task % heads);
        let g = h / per_group;
        for t in 0..t_len {
            let bt = b * t_len + t;
            dx[(bt * heads + h) * p_dim..][..p_dim].copy_from_slice(&part.dx[t * p_dim..][..p_dim]);
            ddt[bt * heads + h] = part.ddt[t];
            let gi = (bt * groups + g) * n_dim;
            for n in 0..n_dim {
                db[gi + n] += part.db[t * n_dim + n];
                dc[gi + n] += part.dc[t * n_dim + n];
            }
        }
        da[h] += part.da;
        dd[h] += part.dd;
        adj[task * pn..][..pn].copy_from_slice(&part.d_initial);
    }
    Ok(SsdGradients {
        dx,
        ddt,
        da,
        db,
        dc,
        dd: inp.d.map(|_| dd),
        d_initial_state: adj,
    })
}

/// Gradients of the selective scan's inputs ([`selective_scan_backward`]), float64, in the
/// layouts of [`ScanInputs`].
#[derive(Clone, Debug, PartialEq)]
pub struct ScanGradients {
    /// ∂L/∂u, `[B, T, D]`.
    pub du: Vec<f64>,
    /// ∂L/∂Δ, `[B, T, D]` (with respect to Δ after the softplus).
    pub ddelta: Vec<f64>,
    /// ∂L/∂A, `[D, N]`, summed over batch and time.
    pub da: Vec<f64>,
    /// ∂L/∂B, `[B, T, N]`, summed over the channels.
    pub db: Vec<f64>,
    /// ∂L/∂C, `[B, T, N]`, summed over the channels.
    pub dc: Vec<f64>,
    /// ∂L/∂D, `[D]`, summed over batch and time, when D was given; none otherwise.
    pub dd: Option<Vec<f64>>,
    /// ∂L/∂(initial state), `[B, D, N]`, whether or not an initial state was given.
    pub d_initial_state: Vec<f64>,
}

/// The backward of [`super::reference::selective_scan`] (Gu and Dao, 2023, Mamba's selective
/// scan, zero-order-hold A and Euler B): the gradient of
/// L = ⟨dy, y⟩ + ⟨d_final_state, final state⟩ with respect to every input, from the forward's
/// inputs `inp` (the forward is recomputed), `dy` `[B, T, D]` and `d_final_state` `[B, D, N]`
/// (zeros when none).
///
/// For each batch entry and channel d, the forward is, for t = 1 … T, with h_0 the initial
/// state and ā_t = exp(Δ_{t,d} A_d) (elementwise over the N state entries),
///
/// h_t = ā_t ∘ h_{t−1} + Δ_{t,d} u_{t,d} B_t,  y_{t,d} = ⟨C_t, h_t⟩ + D_d u_{t,d}.
///
/// The adjoint ĥ_t = ∂L/∂h_t (N entries) runs backwards from the final state's cotangent:
///
/// ĥ_T = d_final_state + dy_{T,d} C_T,  ĥ_{t−1} = ā_t ∘ ĥ_t + dy_{t−1,d} C_{t−1} (t > 1),
///
/// and the gradient of the initial state is ā_1 ∘ ĥ_1 (d_final_state itself when T = 0). At
/// each step,
///
/// - du_{t,d} = Δ_{t,d} ⟨ĥ_t, B_t⟩ + D_d dy_{t,d},
/// - dB_t = Σ_d Δ_{t,d} u_{t,d} ĥ_t,  dC_t = Σ_d dy_{t,d} h_t,
/// - dΔ_{t,d} = ⟨ĥ_t, A_d ∘ ā_t ∘ h_{t−1}⟩ + u_{t,d} ⟨ĥ_t, B_t⟩,
/// - dA_d = Σ_{b, t} Δ_{t,d} ĥ_t ∘ ā_t ∘ h_{t−1},  dD_d = Σ_{b, t} dy_{t,d} u_{t,d}.
///
/// # Errors
/// A message naming the input whose length does not fit `shape` (`dy` and `d_final_state`
/// included), or an empty dimension other than seq_len, as the forward reports them.
pub fn selective_scan_backward(
    shape: ScanShape,
    inp: ScanInputs,
    dy: &[f64],
    d_final_state: Option<&[f64]>,
) -> Result<ScanGradients, String> {
    let ScanShape {
        batch,
        seq_len: t_len,
        channels,
        state: n_dim,
    } = shape;
    shape.check("selective_scan_backward", &inp)?;
    check_len("dy", dy, batch * t_len * channels)?;
    let h0 = or_zeros("initial_state", inp.initial_state, batch * channels * n_dim)?;
    // The adjoint of the state, d_final_state to start with, ā_1 ∘ ĥ_1 once the loop is done.
    let mut adj = or_zeros("d_final_state", d_final_state, batch * channels * n_dim)?;

    // Tasks of (batch entry, group of channels) in parallel (rayon): enough groups per batch
    // entry to give every thread one, each task walking its channels one after another into
    // its own buffers (its columns of du and dΔ, its parts of dB and dC over the batch entry's
    // steps, of dA and dD, and its channels' adjoints), gathered afterwards.
    let groups = rayon::current_num_threads()
        .div_ceil(batch.max(1))
        .clamp(1, channels.max(1));
    let per_group = channels.div_ceil(groups).max(1);
    let tasks: Vec<(usize, usize, usize)> = (0..batch)
        .flat_map(|b| {
            (0..channels)
                .step_by(per_group)
                .map(move |c0| (b, c0, (c0 + per_group).min(channels)))
        })
        .collect();
    struct Part {
        b: usize,
        c0: usize,
        /// [T, width] columns of du and dΔ.
        du: Vec<f64>,
        ddelta: Vec<f64>,
        /// [T, N] sums over the task's channels.
        db: Vec<f64>,
        dc: Vec<f64>,
        /// [width, N], [width] and [width, N].
        da: Vec<f64>,
        dd: Vec<f64>,
        adj: Vec<f64>,
    }
    let parts: Vec<Part> = tasks
        .into_par_iter()
        .map(|(b, c0, c1)| {
            let width = c1 - c0;
            let mut part = Part {
                b,
                c0,
                du: vec![0.0; t_len * width],
                ddelta: vec![0.0; t_len * width],
                db: vec![0.0; t_len * n_dim],
                dc: vec![0.0; t_len * n_dim],
                da: vec![0.0; width * n_dim],
                dd: vec![0.0; width],
                adj: adj[(b * channels + c0) * n_dim..(b * channels + c1) * n_dim].to_vec(),
            };
            // h_0 … h_T of one channel.
            let mut states = vec![0.0; (t_len + 1) * n_dim];
            for ch in c0..c1 {
                let k = ch - c0;
                let bc = (b * channels + ch) * n_dim;
                let a = &inp.a[ch * n_dim..][..n_dim];
                let skip = inp.d.map_or(0.0, |d| d[ch]);

                // The forward, keeping every state.
                states[..n_dim].copy_from_slice(&h0[bc..][..n_dim]);
                for t in 0..t_len {
                    let bt = b * t_len + t;
                    let i = bt * channels + ch;
                    let (u, dt) = (inp.u[i], inp.delta[i]);
                    let bv = &inp.b[bt * n_dim..][..n_dim];
                    let (prev, next) = states[t * n_dim..(t + 2) * n_dim].split_at_mut(n_dim);
                    for n in 0..n_dim {
                        next[n] = (dt * a[n]).exp() * prev[n] + dt * u * bv[n];
                    }
                }

                // The adjoint, from the last step back to the first.
                let h_adj = &mut part.adj[k * n_dim..][..n_dim];
                let da_ch = &mut part.da[k * n_dim..][..n_dim];
                for t in (0..t_len).rev() {
                    let bt = b * t_len + t;
                    let i = bt * channels + ch;
                    let (u, dt, dyv) = (inp.u[i], inp.delta[i], dy[i]);
                    let bi = bt * n_dim;
                    // The task's rows of dB and dC start at the batch entry's first step.
                    let local = t * n_dim;
                    let bv = &inp.b[bi..][..n_dim];
                    let cv = &inp.c[bi..][..n_dim];
                    let (prev, cur) = states[t * n_dim..(t + 2) * n_dim].split_at(n_dim);
                    // ⟨ĥ_t, B_t⟩ and ⟨ĥ_t, A ∘ ā_t ∘ h_{t−1}⟩.
                    let (mut hb, mut h_decay) = (0.0, 0.0);
                    for n in 0..n_dim {
                        let decay = (dt * a[n]).exp();
                        // ĥ_t = (what came back from step t + 1) + dy_t C_t.
                        h_adj[n] += dyv * cv[n];
                        let ha = h_adj[n];
                        part.dc[local + n] += dyv * cur[n];
                        part.db[local + n] += dt * u * ha;
                        hb += ha * bv[n];
                        let through_decay = ha * decay * prev[n];
                        h_decay += a[n] * through_decay;
                        da_ch[n] += dt * through_decay;
                        // What goes back to step t − 1.
                        h_adj[n] = decay * ha;
                    }
                    let li = t * width + k;
                    part.du[li] = dt * hb + skip * dyv;
                    part.ddelta[li] = h_decay + u * hb;
                    part.dd[k] += dyv * u;
                }
            }
            part
        })
        .collect();
    let mut du = vec![0.0; batch * t_len * channels];
    let mut ddelta = vec![0.0; batch * t_len * channels];
    let mut db = vec![0.0; batch * t_len * n_dim];
    let mut dc = vec![0.0; batch * t_len * n_dim];
    let mut da = vec![0.0; channels * n_dim];
    let mut dd = vec![0.0; channels];
    for p in &parts {
        let width = p.dd.len();
        for t in 0..t_len {
            let at = (p.b * t_len + t) * channels + p.c0;
            du[at..at + width].copy_from_slice(&p.du[t * width..][..width]);
            ddelta[at..at + width].copy_from_slice(&p.ddelta[t * width..][..width]);
        }
        let rows = p.b * t_len * n_dim..(p.b + 1) * t_len * n_dim;
        db[rows.clone()]
            .iter_mut()
            .zip(&p.db)
            .for_each(|(x, y)| *x += y);
        dc[rows].iter_mut().zip(&p.dc).for_each(|(x, y)| *x += y);
        da[p.c0 * n_dim..][..width * n_dim]
            .iter_mut()
            .zip(&p.da)
            .for_each(|(x, y)| *x += y);
        dd[p.c0..][..width]
            .iter_mut()
            .zip(&p.dd)
            .for_each(|(x, y)| *x += y);
        let states = (p.b * channels + p.c0) * n_dim;
        adj[states..][..width * n_dim].copy_from_slice(&p.adj);
    }
    Ok(ScanGradients {
        du,
        ddelta,
        da,
        db,
        dc,
        dd: inp.d.map(|_| dd),
        d_initial_state: adj,
    })
}

#[cfg(test)]
mod tests {
    use super::super::reference::{selective_scan, ssd};
    use super::super::test_util::{max_rel_or_abs, uniform};
    use super::*;

    fn dot(a: &[f64], b: &[f64]) -> f64 {
        assert_eq!(a.len(), b.len());
        a.iter().zip(b).map(|(x, y)| x * y).sum()
    }

    /// The time steps [t0, t1) of a `[B, T, rest]` tensor.
    fn steps(x: &[f64], batch: usize, t_len: usize, t0: usize, t1: usize) -> Vec<f64> {
        let rest = x.len() / (batch * t_len);
        (0..batch)
            .flat_map(|b| x[(b * t_len + t0) * rest..(b * t_len + t1) * rest].to_vec())
            .collect()
    }

    /// The step of the central differences.
    const FD_STEP: f64 = 1e-6;
    /// Their tolerance, relative to the larger of the element and a hundredth of the largest
    /// element of the gradient (the differences' rounding is about 1e-16 |L| / FD_STEP).
    const FD_TOL: f64 = 1e-6;

    /// Checks `analytic`, the gradient of `loss` with respect to `vars[which]` (named `name`),
    /// against central finite differences, one per element.
    fn check_fd(
        name: &str,
        analytic: &[f64],
        vars: &mut [Vec<f64>],
        which: usize,
        loss: &dyn Fn(&[Vec<f64>]) -> f64,
    ) {
        assert_eq!(analytic.len(), vars[which].len(), "{name}: length");
        let scale = analytic.iter().fold(0.0f64, |m, x| m.max(x.abs()));
        assert!(scale > 1e-3, "{name}: a non-trivial gradient ({scale})");
        for (i, &got) in analytic.iter().enumerate() {
            let v = vars[which][i];
            vars[which][i] = v + FD_STEP;
            let up = loss(vars);
            vars[which][i] = v - FD_STEP;
            let down = loss(vars);
            vars[which][i] = v;
            let want = (up - down) / (2.0 * FD_STEP);
            let err = (got - want).abs() / got.abs().max(1e-2 * scale);
            assert!(err < FD_TOL, "{name}[{i}]: {got} vs {want} ({err:.1e})");
        }
    }

    const SSD: SsdShape = SsdShape {
        batch: 2,
        seq_len: 7,
        heads: 4,
        head_dim: 3,
        state: 5,
        groups: 2,
    };

    /// SSD's inputs in the order x, Δ, A, B, C, D, initial state, from seeds `seed` to
    /// `seed + 6` (Δ positive, A negative).
    fn ssd_vars(s: SsdShape, seed: u64) -> Vec<Vec<f64>> {
        let (bt, h) = (s.batch * s.seq_len, s.heads);
        let bgn = bt * s.groups * s.state;
        vec![
            uniform(bt * h * s.head_dim, -1.0, 1.0, seed),
            uniform(bt * h, 0.05, 0.5, seed + 1),
            uniform(h, -2.0, -0.1, seed + 2),
            uniform(bgn, -1.0, 1.0, seed + 3),
            uniform(bgn, -1.0, 1.0, seed + 4),
            uniform(h, -1.0, 1.0, seed + 5),
            uniform(s.batch * h * s.head_dim * s.state, -1.0, 1.0, seed + 6),
        ]
    }

    /// [`SsdInputs`] over `v` (as [`ssd_vars`] orders them), with or without D and the
    /// initial state.
    fn ssd_inputs(v: &[Vec<f64>], with_d: bool, with_s0: bool) -> SsdInputs<'_> {
        SsdInputs {
            x: &v[0],
            dt: &v[1],
            a: &v[2],
            b: &v[3],
            c: &v[4],
            d: with_d.then_some(&v[5][..]),
            initial_state: with_s0.then_some(&v[6][..]),
        }
    }

    /// Every gradient of [`ssd_backward`] against central differences of the forward's
    /// L = ⟨dy, Y⟩ + ⟨d_final, final state⟩: with D and an initial state, without D, and with
    /// neither nor a final state's cotangent (the initial state's gradient is then that of a
    /// zero state).
    /// Past one checkpoint segment (600 steps: three segments of 256, the last partial), every
    /// gradient's product with a random direction against the central difference of the loss
    /// along it: a checkpoint taken or restored one step off changes every such product.
    #[test]
    fn ssd_backward_across_checkpoint_segments() {
        let s = SsdShape {
            batch: 1,
            seq_len: 600,
            heads: 2,
            head_dim: 2,
            state: 3,
            groups: 1,
        };
        let vars = ssd_vars(s, 900);
        let dy = uniform(vars[0].len(), -1.0, 1.0, 907);
        let dfin = uniform(vars[6].len(), -1.0, 1.0, 908);
        let g = ssd_backward(s, ssd_inputs(&vars, true, true), &dy, Some(&dfin)).unwrap();
        let loss = |v: &[Vec<f64>]| {
            let (y, last) = ssd(s, ssd_inputs(v, true, true)).unwrap();
            dot(&dy, &y) + dot(&dfin, &last)
        };
        let grads = [
            &g.dx,
            &g.ddt,
            &g.da,
            &g.db,
            &g.dc,
            g.dd.as_ref().unwrap(),
            &g.d_initial_state,
        ];
        for (k, grad) in grads.iter().enumerate() {
            let dir = uniform(vars[k].len(), -1.0, 1.0, 950 + k as u64);
            let along = |sign: f64| {
                let mut v = vars.clone();
                v[k].iter_mut()
                    .zip(&dir)
                    .for_each(|(x, d)| *x += sign * FD_STEP * d);
                loss(&v)
            };
            let fd = (along(1.0) - along(-1.0)) / (2.0 * FD_STEP);
            let analytic = dot(grad, &dir);
            let err = (fd - analytic).abs() / analytic.abs().max(1e-3);
            assert!(err < 1e-6, "input {k}: {analytic} vs {fd} ({err:.1e})");
        }
    }

    #[test]
    fn ssd_gradients_match_finite_differences() {
        let s = SSD;
        for (case, (with_d, with_s0, with_dfin)) in [
            (true, true, true),
            (false, true, true),
            (false, false, false),
        ]
        .into_iter()
        .enumerate()
        {
            let seed = 100 + 10 * case as u64;
            let mut vars = ssd_vars(s, seed);
            if !with_s0 {
                vars[6].iter_mut().for_each(|v| *v = 0.0);
            }
            let dy = uniform(vars[0].len(), -1.0, 1.0, seed + 7);
            let dfin = uniform(vars[6].len(), -1.0, 1.0, seed + 8);
            let dfin = with_dfin.then_some(&dfin[..]);
            let grads = ssd_backward(s, ssd_inputs(&vars, with_d, with_s0), &dy, dfin).unwrap();
            assert_eq!(grads.dd.is_some(), with_d);
            // The differences always perturb a given initial state (zeros for the third case,
            // the same function as none).
            let loss = |v: &[Vec<f64>]| {
                let (y, last) = ssd(s, ssd_inputs(v, with_d, true)).unwrap();
                dot(&dy, &y) + dfin.map_or(0.0, |df| dot(df, &last))
            };
            let name = |n: &str| format!("case {case}: {n}");
            check_fd(&name("dx"), &grads.dx, &mut vars, 0, &loss);
            check_fd(&name("ddt"), &grads.ddt, &mut vars, 1, &loss);
            check_fd(&name("da"), &grads.da, &mut vars, 2, &loss);
            check_fd(&name("db"), &grads.db, &mut vars, 3, &loss);
            check_fd(&name("dc"), &grads.dc, &mut vars, 4, &loss);
            if let Some(dd) = &grads.dd {
                check_fd(&name("dd"), dd, &mut vars, 5, &loss);
            }
            check_fd(
                &name("d_initial_state"),
                &grads.d_initial_state,
                &mut vars,
                6,
                &loss,
            );
        }
    }

    const SCAN: ScanShape = ScanShape {
        batch: 2,
        seq_len: 7,
        channels: 3,
        state: 4,
    };

    /// The scan's inputs in the order u, Δ, A, B, C, D, initial state, from seeds `seed` to
    /// `seed + 6` (Δ positive, A negative).
    fn scan_vars(s: ScanShape, seed: u64) -> Vec<Vec<f64>> {
        let bt = s.batch * s.seq_len;
        vec![
            uniform(bt * s.channels, -1.0, 1.0, seed),
            uniform(bt * s.channels, 0.05, 0.5, seed + 1),
            uniform(s.channels * s.state, -2.0, -0.1, seed + 2),
            uniform(bt * s.state, -1.0, 1.0, seed + 3),
            uniform(bt * s.state, -1.0, 1.0, seed + 4),
            uniform(s.channels, -1.0, 1.0, seed + 5),
            uniform(s.batch * s.channels * s.state, -1.0, 1.0, seed + 6),
        ]
    }

    /// [`ScanInputs`] over `v` (as [`scan_vars`] orders them), with or without D and the
    /// initial state.
    fn scan_inputs(v: &[Vec<f64>], with_d: bool, with_s0: bool) -> ScanInputs<'_> {
        ScanInputs {
            u: &v[0],
            delta: &v[1],
            a: &v[2],
            b: &v[3],
            c: &v[4],
            d: with_d.then_some(&v[5][..]),
            initial_state: with_s0.then_some(&v[6][..]),
        }
    }

    /// Every gradient of [`selective_scan_backward`] against central differences, in the same
    /// three cases as SSD's.
    #[test]
    fn selective_scan_gradients_match_finite_differences() {
        let s = SCAN;
        for (case, (with_d, with_s0, with_dfin)) in [
            (true, true, true),
            (false, true, true),
            (false, false, false),
        ]
        .into_iter()
        .enumerate()
        {
            let seed = 200 + 10 * case as u64;
            let mut vars = scan_vars(s, seed);
            if !with_s0 {
                vars[6].iter_mut().for_each(|v| *v = 0.0);
            }
            let dy = uniform(vars[0].len(), -1.0, 1.0, seed + 7);
            let dfin = uniform(vars[6].len(), -1.0, 1.0, seed + 8);
            let dfin = with_dfin.then_some(&dfin[..]);
            let grads =
                selective_scan_backward(s, scan_inputs(&vars, with_d, with_s0), &dy, dfin).unwrap();
            assert_eq!(grads.dd.is_some(), with_d);
            let loss = |v: &[Vec<f64>]| {
                let (y, last) = selective_scan(s, scan_inputs(v, with_d, true)).unwrap();
                dot(&dy, &y) + dfin.map_or(0.0, |df| dot(df, &last))
            };
            let name = |n: &str| format!("case {case}: {n}");
            check_fd(&name("du"), &grads.du, &mut vars, 0, &loss);
            check_fd(&name("ddelta"), &grads.ddelta, &mut vars, 1, &loss);
            check_fd(&name("da"), &grads.da, &mut vars, 2, &loss);
            check_fd(&name("db"), &grads.db, &mut vars, 3, &loss);
            check_fd(&name("dc"), &grads.dc, &mut vars, 4, &loss);
            if let Some(dd) = &grads.dd {
                check_fd(&name("dd"), dd, &mut vars, 5, &loss);
            }
            check_fd(
                &name("d_initial_state"),
                &grads.d_initial_state,
                &mut vars,
                6,
                &loss,
            );
        }
    }

    /// Over no time steps the state passes through unchanged, so its cotangent does too:
    /// exactly, and nothing else has a gradient.
    #[test]
    fn over_no_steps_the_initial_states_gradient_is_the_final_states() {
        let s = SsdShape { seq_len: 0, ..SSD };
        let vars = ssd_vars(s, 300);
        let dfin = uniform(vars[6].len(), -1.0, 1.0, 301);
        let g = ssd_backward(s, ssd_inputs(&vars, true, true), &[], Some(&dfin)).unwrap();
        assert_eq!(g.d_initial_state, dfin);
        assert!(g.dx.is_empty() && g.ddt.is_empty() && g.db.is_empty() && g.dc.is_empty());
        assert_eq!(g.da, vec![0.0; s.heads]);
        assert_eq!(g.dd, Some(vec![0.0; s.heads]));

        let s = ScanShape { seq_len: 0, ..SCAN };
        let vars = scan_vars(s, 310);
        let dfin = uniform(vars[6].len(), -1.0, 1.0, 311);
        let g =
            selective_scan_backward(s, scan_inputs(&vars, true, true), &[], Some(&dfin)).unwrap();
        assert_eq!(g.d_initial_state, dfin);
        assert!(g.du.is_empty() && g.ddelta.is_empty() && g.db.is_empty() && g.dc.is_empty());
        assert_eq!(g.da, vec![0.0; s.channels * s.state]);
        assert_eq!(g.dd, Some(vec![0.0; s.channels]));
    }

    /// One backward's gradients, named: the per-step ones (`[B, T, …]`), A's and D's (summed
    /// over time), and the initial state's.
    type Parts<'a> = ([(&'static str, &'a [f64]); 4], [&'a [f64]; 2], &'a [f64]);

    /// Checks the gradients of a whole pass against those of two passes over its halves (the
    /// second's backward from the first's final state and the whole's d_final; the first's with
    /// the second's d_initial_state as its d_final): per-step gradients are the halves' joined
    /// along time, A's and D's the halves' sums, the initial state's the first half's.
    fn check_split(batch: usize, whole: Parts, first: Parts, second: Parts) {
        for k in 0..4 {
            let (name, w) = whole.0[k];
            let (f, s) = (first.0[k].1, second.0[k].1);
            let (wf, ws) = (f.len() / batch, s.len() / batch);
            let joined: Vec<f64> = (0..batch)
                .flat_map(|b| f[b * wf..][..wf].iter().chain(&s[b * ws..][..ws]))
                .copied()
                .collect();
            assert_eq!(joined.len(), w.len(), "{name}");
            assert!(w.iter().any(|v| v.abs() > 1e-3), "{name}: non-trivial");
            let e = max_rel_or_abs(&joined, w);
            assert!(e < 1e-12, "{name}: {e}");
        }
        for (k, name) in ["da", "dd"].iter().enumerate() {
            let summed: Vec<f64> = first.1[k]
                .iter()
                .zip(second.1[k])
                .map(|(a, b)| a + b)
                .collect();
            let e = max_rel_or_abs(&summed, whole.1[k]);
            assert!(e < 1e-12, "{name}: {e}");
        }
        let e = max_rel_or_abs(first.2, whole.2);
        assert!(e < 1e-12, "d_initial_state: {e}");
    }

    #[test]
    fn ssd_backward_in_two_halves_equals_one_pass() {
        let s = SSD;
        let (t_len, cut) = (s.seq_len, 3);
        let vars = ssd_vars(s, 400);
        let dy = uniform(vars[0].len(), -1.0, 1.0, 407);
        let dfin = uniform(vars[6].len(), -1.0, 1.0, 408);
        let whole = ssd_backward(s, ssd_inputs(&vars, true, true), &dy, Some(&dfin)).unwrap();

        // The halves' inputs: per-step ones cut along time, the rest shared.
        let half = |t0: usize, t1: usize| {
            let mut v = vars.clone();
            for k in [0, 1, 3, 4] {
                v[k] = steps(&vars[k], s.batch, t_len, t0, t1);
            }
            let shape = SsdShape {
                seq_len: t1 - t0,
                ..s
            };
            (shape, v, steps(&dy, s.batch, t_len, t0, t1))
        };
        let (s1, v1, dy1) = half(0, cut);
        let (s2, mut v2, dy2) = half(cut, t_len);
        let (_, mid_state) = ssd(s1, ssd_inputs(&v1, true, true)).unwrap();
        v2[6] = mid_state;
        let second = ssd_backward(s2, ssd_inputs(&v2, true, true), &dy2, Some(&dfin)).unwrap();
        let first = ssd_backward(
            s1,
            ssd_inputs(&v1, true, true),
            &dy1,
            Some(&second.d_initial_state),
        )
        .unwrap();
        fn parts(g: &SsdGradients) -> Parts<'_> {
            (
                [("dx", &g.dx), ("ddt", &g.ddt), ("db", &g.db), ("dc", &g.dc)],
                [&g.da, g.dd.as_deref().unwrap()],
                &g.d_initial_state,
            )
        }
        check_split(s.batch, parts(&whole), parts(&first), parts(&second));
    }

    /// The gradient split over (batch entry, channel group) tasks gathers the same values
    /// whatever the number of threads: one group per batch entry (one thread) against one
    /// channel per group (eight threads, 3 channels).
    #[test]
    fn selective_scan_backward_is_the_same_on_one_thread_and_on_eight() {
        let s = SCAN;
        let vars = scan_vars(s, 600);
        let dy = uniform(s.batch * s.seq_len * s.channels, -1.0, 1.0, 607);
        let dfin = uniform(vars[6].len(), -1.0, 1.0, 608);
        let run = |threads: usize| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap()
                .install(|| {
                    selective_scan_backward(s, scan_inputs(&vars, true, true), &dy, Some(&dfin))
                        .unwrap()
                })
        };
        let (one, eight) = (run(1), run(8));
        for (name, a, b) in [
            ("du", &one.du, &eight.du),
            ("ddelta", &one.ddelta, &eight.ddelta),
            ("da", &one.da, &eight.da),
            ("db", &one.db, &eight.db),
            ("dc", &one.dc, &eight.dc),
            ("dd", one.dd.as_ref().unwrap(), eight.dd.as_ref().unwrap()),
            (
                "d_initial_state",
                &one.d_initial_state,
                &eight.d_initial_state,
            ),
        ] {
            let e = max_rel_or_abs(a, b);
            assert!(e < 1e-12, "{name}: {e}");
            assert!(a.iter().any(|v| *v != 0.0), "{name} all zero");
        }
    }

    #[test]
    fn selective_scan_backward_in_two_halves_equals_one_pass() {
        let s = SCAN;
        let (t_len, cut) = (s.seq_len, 4);
        let vars = scan_vars(s, 500);
        let dy = uniform(vars[0].len(), -1.0, 1.0, 507);
        let dfin = uniform(vars[6].len(), -1.0, 1.0, 508);
        let whole =
            selective_scan_backward(s, scan_inputs(&vars, true, true), &dy, Some(&dfin)).unwrap();

        let half = |t0: usize, t1: usize| {
            let mut v = vars.clone();
            for k in [0, 1, 3, 4] {
                v[k] = steps(&vars[k], s.batch, t_len, t0, t1);
            }
            let shape = ScanShape {
                seq_len: t1 - t0,
                ..s
            };
            (shape, v, steps(&dy, s.batch, t_len, t0, t1))
        };
        let (s1, v1, dy1) = half(0, cut);
        let (s2, mut v2, dy2) = half(cut, t_len);
        let (_, mid_state) = selective_scan(s1, scan_inputs(&v1, true, true)).unwrap();
        v2[6] = mid_state;
        let second =
            selective_scan_backward(s2, scan_inputs(&v2, true, true), &dy2, Some(&dfin)).unwrap();
        let first = selective_scan_backward(
            s1,
            scan_inputs(&v1, true, true),
            &dy1,
            Some(&second.d_initial_state),
        )
        .unwrap();
        fn parts(g: &ScanGradients) -> Parts<'_> {
            (
                [
                    ("du", &g.du),
                    ("ddelta", &g.ddelta),
                    ("db", &g.db),
                    ("dc", &g.dc),
                ],
                [&g.da, g.dd.as_deref().unwrap()],
                &g.d_initial_state,
            )
        }
        check_split(s.batch, parts(&whole), parts(&first), parts(&second));
    }

    #[test]
    fn bad_lengths_name_the_input() {
        let vars = ssd_vars(SSD, 600);
        let inp = ssd_inputs(&vars, true, true);
        let dy = vec![0.0; vars[0].len()];
        let e = ssd_backward(SSD, inp, &dy[1..], None).unwrap_err();
        assert!(e.starts_with("dy:"), "{e}");
        let e = ssd_backward(SSD, inp, &dy, Some(&vars[6][1..])).unwrap_err();
        assert!(e.starts_with("d_final_state:"), "{e}");
        let short = SsdInputs {
            initial_state: Some(&vars[6][1..]),
            ..inp
        };
        let e = ssd_backward(SSD, short, &dy, None).unwrap_err();
        assert!(e.starts_with("initial_state:"), "{e}");
        let e = ssd_backward(
            SSD,
            SsdInputs {
                b: &vars[3][1..],
                ..inp
            },
            &dy,
            None,
        )
        .unwrap_err();
        assert!(e.starts_with("b:"), "{e}");
        let e = ssd_backward(SsdShape { groups: 3, ..SSD }, inp, &dy, None).unwrap_err();
        assert!(e.contains("multiple of groups"), "{e}");

        let vars = scan_vars(SCAN, 610);
        let inp = scan_inputs(&vars, true, true);
        let dy = vec![0.0; vars[0].len()];
        let e = selective_scan_backward(SCAN, inp, &dy[1..], None).unwrap_err();
        assert!(e.starts_with("dy:"), "{e}");
        let e = selective_scan_backward(SCAN, inp, &dy, Some(&vars[6][1..])).unwrap_err();
        assert!(e.starts_with("d_final_state:"), "{e}");
        let e = selective_scan_backward(
            SCAN,
            ScanInputs {
                a: &vars[2][1..],
                ..inp
            },
            &dy,
            None,
        )
        .unwrap_err();
        assert!(e.starts_with("a:"), "{e}");
    }
}
