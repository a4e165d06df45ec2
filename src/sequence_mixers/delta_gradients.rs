//! Float64 backward reference of the gated delta rule of Gated DeltaNet (Yang, Kautz and
//! Hatamizadeh, 2024, "Gated Delta Networks: Improving Mamba2 with Delta Rule", equation
//! (10)), whose forward is [`gated_delta_rule`](super::reference::gated_delta_rule): the
//! vector-Jacobian product of its output O and final state with respect to every input,
//! computed as the adjoint of the sequential recurrence, one time step after another from the
//! last to the first. Slow, and what the backward kernels are checked against.
//!
//! The adjoint recurrence is derived here from the forward recurrence (the equations are in
//! [`gated_delta_rule_backward`]'s documentation). flash-linear-attention's chunked backward
//! (`chunk_gated_delta_rule_bwd`) computes the same gradients by a different route: within a
//! chunk it uses the WY representation of the product of the transitions (a triangular solve
//! for the pseudo-values u and the keys w), and it carries the state's adjoint only between
//! chunks. The project's chunked kernels (`delta_backward`) are checked against this file. When
//! comparing, mind three differences of convention: its state is key-major (`[B, H, K, V]`,
//! the transpose of this file's `[B, H, V, K]`), its gate is g = log α (so its dg_t is
//! α_t · dα_t here), and it multiplies q by a scale inside (here q is used as given).
//!
//! Layouts and conventions are those of [`super::reference`]: row-major, batch first, then
//! time, `[B, T, H, K]` for q and k, `[B, T, H, V]` for v and O, `[B, T, H]` for α and β, and
//! an optional initial state in (zeros when absent), whose gradient is always returned.

use rayon::prelude::*;

use super::reference::{check_len, or_zeros, DeltaInputs, DeltaShape};

/// Gradients of a scalar loss with respect to the inputs of
/// [`gated_delta_rule`](super::reference::gated_delta_rule), as
/// [`gated_delta_rule_backward`] returns them: float64, in the layouts of the inputs.
#[derive(Clone, Debug, PartialEq)]
pub struct DeltaGradients {
    /// dL/dq, `[B, T, H, K]`.
    pub d_q: Vec<f64>,
    /// dL/dk, `[B, T, H, K]` (with respect to k as given: no projection onto unit keys).
    pub d_k: Vec<f64>,
    /// dL/dv, `[B, T, H, V]`.
    pub d_v: Vec<f64>,
    /// dL/dα, `[B, T, H]` (with respect to α itself; the gradient with respect to log α is
    /// α · dL/dα).
    pub d_alpha: Vec<f64>,
    /// dL/dβ, `[B, T, H]`.
    pub d_beta: Vec<f64>,
    /// dL/dS_0, the gradient of the initial state, `[B, H, V, K]` (value-major), returned
    /// whether or not an initial state was given (it is the adjoint carried past the first
    /// step, what an earlier segment of the sequence takes as its `d_final_state`).
    pub d_initial_state: Vec<f64>,
}

/// The backward of the gated delta rule: given the forward's inputs `inp`, the gradient
/// `d_out` of a loss L with respect to the output O (`[B, T, H, V]`) and, optionally, its
/// gradient `d_final_state` with respect to the final state (`[B, H, V, K]`; zeros when
/// absent), returns dL with respect to q, k, v, α, β and the initial state (see
/// [`DeltaGradients`]). All float64.
///
/// The forward, per batch entry and head, with the state S (V × K) and S_0 the initial state:
///
/// S_t = α_t S_{t−1} (I − β_t k_t k_tᵀ) + β_t v_t k_tᵀ = α_t S_{t−1} + β_t u_t k_tᵀ,
/// u_t = v_t − α_t S_{t−1} k_t,  o_t = S_t q_t,  t = 1..T.
///
/// The forward runs first, keeping every 64th state (`SEGMENT`); the adjoint then runs
/// backwards from dS_T = `d_final_state`, recomputing one segment's states at a time from its
/// first. One task per (batch entry, head) on rayon's threads. At step t, with do_t the slice of `d_out`:
///
/// - Ḡ_t = dS_t + do_t q_tᵀ (V × K), the whole gradient of L with respect to S_t;
///   g_t = Ḡ_t k_t (V), the gradient with respect to β_t u_t; sk_t = S_{t−1} k_t (V);
/// - dq_t = S_tᵀ do_t;
/// - dv_t = β_t g_t;
/// - dβ_t = g_tᵀ u_t;
/// - dα_t = ⟨Ḡ_t, S_{t−1}⟩ − β_t g_tᵀ sk_t = ⟨Ḡ_t, S_{t−1} (I − β_t k_t k_tᵀ)⟩;
/// - dk_t = β_t Ḡ_tᵀ v_t − α_t β_t (Ḡ_tᵀ sk_t + S_{t−1}ᵀ g_t) = β_t Ḡ_tᵀ u_t − α_t β_t
///   S_{t−1}ᵀ g_t: the write term β v kᵀ gives β Ḡᵀ v, and the erase term −α β S_{t−1} k kᵀ,
///   quadratic in k, gives −α β (Ḡᵀ S_{t−1} k + S_{t−1}ᵀ Ḡ k);
/// - dS_{t−1} = α_t Ḡ_t (I − β_t k_t k_tᵀ) = α_t (Ḡ_t − β_t g_t k_tᵀ), the transpose of the
///   transition applied to the adjoint;
///
/// and `d_initial_state` is dS_0. A sequence of length 0 returns empty gradients of the
/// per-step inputs and `d_final_state` (or zeros) as dS_0.
///
/// # Errors
/// A message naming the input whose length does not fit `shape` (`q`, `k`, `v`, `alpha`,
/// `beta`, `initial_state`, `d_out`, `d_final_state`), or an empty dimension other than
/// seq_len.
pub fn gated_delta_rule_backward(
    shape: DeltaShape,
    inp: DeltaInputs,
    d_out: &[f64],
    d_final_state: Option<&[f64]>,
) -> Result<DeltaGradients, String> {
    let DeltaShape {
        batch,
        seq_len: t_len,
        heads,
        key_dim: kd,
        value_dim: vd,
    } = shape;
    shape.check("gated_delta_rule_backward", &inp)?;
    let steps = batch * t_len * heads;
    check_len("d_out", d_out, steps * vd)?;
    let state_len = batch * heads * vd * kd;
    let s0 = or_zeros("initial_state", inp.initial_state, state_len)?;
    // The adjoint of the state, dS_T at the start, dS_0 at the end.
    let mut d_state = or_zeros("d_final_state", d_final_state, state_len)?;

    let sq = vd * kd;
    // One task per (batch entry, head) on rayon's threads, each with its own gradients in
    // time order, scattered into the [B, T, H, ·] layouts after.
    let tasks: Vec<TaskGradients> = (0..batch * heads)
        .into_par_iter()
        .map(|task| {
            let (b, h) = (task / heads, task % heads);
            let bh = task * sq;
            adjoint_of_one(
                &inp,
                d_out,
                (kd, vd, t_len),
                |t| (b * t_len + t) * heads + h,
                &s0[bh..bh + sq],
                d_state[bh..bh + sq].to_vec(),
            )
        })
        .collect();
    let mut grads = DeltaGradients {
        d_q: vec![0.0; steps * kd],
        d_k: vec![0.0; steps * kd],
        d_v: vec![0.0; steps * vd],
        d_alpha: vec![0.0; steps],
        d_beta: vec![0.0; steps],
        d_initial_state: Vec::new(),
    };
    for (task, tg) in tasks.into_iter().enumerate() {
        let (b, h) = (task / heads, task % heads);
        for t in 0..t_len {
            let i = (b * t_len + t) * heads + h;
            grads.d_q[i * kd..][..kd].copy_from_slice(&tg.d_q[t * kd..][..kd]);
            grads.d_k[i * kd..][..kd].copy_from_slice(&tg.d_k[t * kd..][..kd]);
            grads.d_v[i * vd..][..vd].copy_from_slice(&tg.d_v[t * vd..][..vd]);
            grads.d_alpha[i] = tg.d_alpha[t];
            grads.d_beta[i] = tg.d_beta[t];
        }
        d_state[task * sq..][..sq].copy_from_slice(&tg.d_state);
    }
    grads.d_initial_state = d_state;
    Ok(grads)
}

/// Steps between the states one task keeps: the backward recomputes the states of one
/// segment at a time from the segment's first (memory O((T / SEGMENT + SEGMENT)·V·K) per
/// task instead of O(T·V·K): 8.6 GB of float64 per (batch entry, head) at T = 65,536 and
/// K = V = 128 otherwise).
const SEGMENT: usize = 64;

/// One (batch entry, head)'s gradients in time order (`[T, K]`, `[T, V]`, `[T]`) and its
/// dS_0.
struct TaskGradients {
    d_q: Vec<f64>,
    d_k: Vec<f64>,
    d_v: Vec<f64>,
    d_alpha: Vec<f64>,
    d_beta: Vec<f64>,
    d_state: Vec<f64>,
}

/// S_t = α S_{t−1} + β (v − α S_{t−1} k) kᵀ, from `prev` into `next` (V × K, row-major).
fn forward_step(prev: &[f64], next: &mut [f64], k: &[f64], v: &[f64], alpha: f64, beta: f64) {
    let kd = k.len();
    for (r, &vr) in v.iter().enumerate() {
        let row = &prev[r * kd..][..kd];
        let skr: f64 = row.iter().zip(k).map(|(s, kj)| s * kj).sum();
        let w = beta * (vr - alpha * skr);
        for j in 0..kd {
            next[r * kd + j] = alpha * row[j] + w * k[j];
        }
    }
}

/// The adjoint recurrence of [`gated_delta_rule_backward`] for one (batch entry, head): `at(t)`
/// is step t's row in the `[B, T, H]` layouts, `s0` its initial state, `ds` its dS_T.
fn adjoint_of_one(
    inp: &DeltaInputs,
    d_out: &[f64],
    (kd, vd, t_len): (usize, usize, usize),
    at: impl Fn(usize) -> usize,
    s0: &[f64],
    mut ds: Vec<f64>,
) -> TaskGradients {
    let sq = vd * kd;
    let mut out = TaskGradients {
        d_q: vec![0.0; t_len * kd],
        d_k: vec![0.0; t_len * kd],
        d_v: vec![0.0; t_len * vd],
        d_alpha: vec![0.0; t_len],
        d_beta: vec![0.0; t_len],
        d_state: Vec::new(),
    };
    // The state entering every segment.
    let n_seg = t_len.div_ceil(SEGMENT);
    let mut checkpoints = vec![0.0; n_seg.max(1) * sq];
    checkpoints[..sq].copy_from_slice(s0);
    let mut cur = s0.to_vec();
    let mut next = vec![0.0; sq];
    for t in 0..t_len {
        if t % SEGMENT == 0 {
            checkpoints[(t / SEGMENT) * sq..][..sq].copy_from_slice(&cur);
        }
        let i = at(t);
        let (k, v) = (&inp.k[i * kd..][..kd], &inp.v[i * vd..][..vd]);
        forward_step(&cur, &mut next, k, v, inp.alpha[i], inp.beta[i]);
        std::mem::swap(&mut cur, &mut next);
    }
    let (mut sk, mut u, mut g) = (vec![0.0; vd], vec![0.0; vd], vec![0.0; vd]);
    let mut local = vec![0.0; (SEGMENT + 1) * sq];
    for seg in (0..n_seg).rev() {
        let (t0, t1) = (seg * SEGMENT, ((seg + 1) * SEGMENT).min(t_len));
        // S_{t0} .. S_{t1} of the segment.
        local[..sq].copy_from_slice(&checkpoints[seg * sq..][..sq]);
        for t in t0..t1 {
            let i = at(t);
            let (before, after) = local.split_at_mut((t - t0 + 1) * sq);
            forward_step(
                &before[(t - t0) * sq..],
                &mut after[..sq],
                &inp.k[i * kd..][..kd],
                &inp.v[i * vd..][..vd],
                inp.alpha[i],
                inp.beta[i],
            );
        }
        for t in (t0..t1).rev() {
            let i = at(t);
            let (alpha, beta) = (inp.alpha[i], inp.beta[i]);
            let q = &inp.q[i * kd..][..kd];
            let k = &inp.k[i * kd..][..kd];
            let v = &inp.v[i * vd..][..vd];
            let d_o = &d_out[i * vd..][..vd];
            let prev = &local[(t - t0) * sq..][..sq];
            let cur = &local[(t - t0 + 1) * sq..][..sq];
            // dq_t = S_tᵀ do_t, and Ḡ_t = dS_t + do_t q_tᵀ in place.
            let dq = &mut out.d_q[t * kd..][..kd];
            for r in 0..vd {
                for j in 0..kd {
                    dq[j] += cur[r * kd + j] * d_o[r];
                    ds[r * kd + j] += d_o[r] * q[j];
                }
            }
            for r in 0..vd {
                let (gr, pr) = (&ds[r * kd..][..kd], &prev[r * kd..][..kd]);
                g[r] = gr.iter().zip(k).map(|(x, kj)| x * kj).sum();
                sk[r] = pr.iter().zip(k).map(|(x, kj)| x * kj).sum();
                u[r] = v[r] - alpha * sk[r];
            }
            for (dv, gr) in out.d_v[t * vd..][..vd].iter_mut().zip(&g) {
                *dv = beta * gr;
            }
            out.d_beta[t] = (0..vd).map(|r| g[r] * u[r]).sum();
            let g_dot_prev: f64 = ds.iter().zip(prev).map(|(x, s)| x * s).sum();
            let g_dot_sk: f64 = (0..vd).map(|r| g[r] * sk[r]).sum();
            out.d_alpha[t] = g_dot_prev - beta * g_dot_sk;
            let dk = &mut out.d_k[t * kd..][..kd];
            for (j, dkj) in dk.iter_mut().enumerate() {
                let write: f64 = (0..vd).map(|r| ds[r * kd + j] * u[r]).sum();
                let erase: f64 = (0..vd).map(|r| prev[r * kd + j] * g[r]).sum();
                *dkj = beta * write - alpha * beta * erase;
            }
            // dS_{t−1} = α_t (Ḡ_t − β_t g_t k_tᵀ).
            for r in 0..vd {
                for j in 0..kd {
                    let x = &mut ds[r * kd + j];
                    *x = alpha * (*x - beta * g[r] * k[j]);
                }
            }
        }
    }
    out.d_state = ds;
    out
}

#[cfg(test)]
mod tests {
    use super::super::test_util::{max_rel, uniform};
    use super::*;
    use crate::sequence_mixers::reference::gated_delta_rule;

    /// `n` random keys of width `kd`, each of L2 norm 1.
    fn unit_keys(n: usize, kd: usize, seed: u64) -> Vec<f64> {
        let mut k = uniform(n * kd, -1.0, 1.0, seed);
        for row in k.chunks_mut(kd) {
            let norm = row.iter().map(|x| x * x).sum::<f64>().sqrt();
            row.iter_mut().for_each(|x| *x /= norm);
        }
        k
    }

    const SHAPE: DeltaShape = DeltaShape {
        batch: 2,
        seq_len: 7,
        heads: 2,
        key_dim: 4,
        value_dim: 3,
    };

    /// The inputs of one forward, and the loss's gradients with respect to its outputs.
    #[derive(Clone)]
    struct Data {
        q: Vec<f64>,
        k: Vec<f64>,
        v: Vec<f64>,
        alpha: Vec<f64>,
        beta: Vec<f64>,
        s0: Vec<f64>,
        d_out: Vec<f64>,
        d_final: Vec<f64>,
    }

    /// Random data as the model has it: unit keys, α and β in (0, 1).
    fn data(s: DeltaShape, seed: u64) -> Data {
        let n = s.batch * s.seq_len * s.heads;
        let state = s.batch * s.heads * s.value_dim * s.key_dim;
        Data {
            q: uniform(n * s.key_dim, -1.0, 1.0, seed),
            k: unit_keys(n, s.key_dim, seed + 1),
            v: uniform(n * s.value_dim, -1.0, 1.0, seed + 2),
            alpha: uniform(n, 0.4, 0.99, seed + 3),
            beta: uniform(n, 0.05, 0.95, seed + 4),
            s0: uniform(state, -1.0, 1.0, seed + 5),
            d_out: uniform(n * s.value_dim, -1.0, 1.0, seed + 6),
            d_final: uniform(state, -1.0, 1.0, seed + 7),
        }
    }

    fn inputs(d: &Data) -> DeltaInputs<'_> {
        DeltaInputs {
            q: &d.q,
            k: &d.k,
            v: &d.v,
            alpha: &d.alpha,
            beta: &d.beta,
            initial_state: Some(&d.s0),
        }
    }

    fn dot(a: &[f64], b: &[f64]) -> f64 {
        a.iter().zip(b).map(|(x, y)| x * y).sum()
    }

    /// L = Σ d_out · O + Σ d_final · S_T, with the forward reference.
    fn loss(s: DeltaShape, d: &Data) -> f64 {
        let (o, last) = gated_delta_rule(s, inputs(d)).unwrap();
        dot(&d.d_out, &o) + dot(&d.d_final, &last)
    }

    /// Every gradient against central differences of the forward reference's loss, one
    /// element at a time, on 7 steps and on 150 (three recomputed segments).
    #[test]
    fn gradients_match_finite_differences_of_the_forward() {
        // SHAPE, and 150 steps: three of the backward's recomputed segments, the last partial.
        let long = DeltaShape {
            batch: 1,
            seq_len: 2 * SEGMENT + 22,
            heads: 2,
            key_dim: 3,
            value_dim: 2,
        };
        for s in [SHAPE, long] {
            finite_differences_agree(s);
        }
    }

    fn finite_differences_agree(s: DeltaShape) {
        let d = data(s, 100);
        let grads = gated_delta_rule_backward(s, inputs(&d), &d.d_out, Some(&d.d_final)).unwrap();
        type Field = fn(&mut Data) -> &mut Vec<f64>;
        let fields: [(&str, Field, &[f64]); 6] = [
            ("q", |d| &mut d.q, &grads.d_q),
            ("k", |d| &mut d.k, &grads.d_k),
            ("v", |d| &mut d.v, &grads.d_v),
            ("alpha", |d| &mut d.alpha, &grads.d_alpha),
            ("beta", |d| &mut d.beta, &grads.d_beta),
            ("initial_state", |d| &mut d.s0, &grads.d_initial_state),
        ];
        let step = 1e-6;
        for (name, field, got) in fields {
            let mut work = d.clone();
            let n = field(&mut work).len();
            assert_eq!(got.len(), n, "{name}");
            let fd: Vec<f64> = (0..n)
                .map(|e| {
                    let x = field(&mut work)[e];
                    field(&mut work)[e] = x + step;
                    let up = loss(s, &work);
                    field(&mut work)[e] = x - step;
                    let down = loss(s, &work);
                    field(&mut work)[e] = x;
                    (up - down) / (2.0 * step)
                })
                .collect();
            let err = max_rel(got, &fd);
            assert!(err < 1e-6, "{name}: relative error {err}");
            assert!(
                fd.iter().any(|x| x.abs() > 1e-2),
                "{name}: a non-trivial gradient"
            );
        }
    }

    /// With β = 0 the state only decays, S_t = (Π_{τ ≤ t} α_τ) S_0, so L is linear in S_0:
    /// dS_0 = Σ_t P_t do_t q_tᵀ + P_T d_final with P_t = Π_{τ ≤ t} α_τ; and with c_t =
    /// ⟨do_t q_tᵀ, S_0⟩, c_f = ⟨d_final, S_0⟩, dα_s = (Σ_{t ≥ s} P_t c_t + P_T c_f) / α_s;
    /// nothing is written, so dv = 0.
    #[test]
    fn without_writes_the_gradients_have_the_gated_linear_closed_form() {
        let s = SHAPE;
        let mut d = data(s, 200);
        d.beta.iter_mut().for_each(|b| *b = 0.0);
        let grads = gated_delta_rule_backward(s, inputs(&d), &d.d_out, Some(&d.d_final)).unwrap();
        let (t_len, kd, vd) = (s.seq_len, s.key_dim, s.value_dim);
        let sq = vd * kd;
        let mut want_s0 = vec![0.0; d.s0.len()];
        let mut want_alpha = vec![0.0; d.alpha.len()];
        for b in 0..s.batch {
            for h in 0..s.heads {
                let at = |t: usize| (b * t_len + t) * s.heads + h;
                let bh = (b * s.heads + h) * sq;
                let s0 = &d.s0[bh..bh + sq];
                let d_final = &d.d_final[bh..bh + sq];
                let want = &mut want_s0[bh..bh + sq];
                let mut p = 1.0;
                let mut terms = Vec::new();
                for t in 0..t_len {
                    let i = at(t);
                    p *= d.alpha[i];
                    let mut c = 0.0;
                    for r in 0..vd {
                        for j in 0..kd {
                            let outer = d.d_out[i * vd + r] * d.q[i * kd + j];
                            want[r * kd + j] += p * outer;
                            c += outer * s0[r * kd + j];
                        }
                    }
                    terms.push(p * c);
                }
                for (w, f) in want.iter_mut().zip(d_final) {
                    *w += p * f;
                }
                let last = p * dot(d_final, s0);
                for st in 0..t_len {
                    let later: f64 = terms[st..].iter().sum();
                    want_alpha[at(st)] = (later + last) / d.alpha[at(st)];
                }
            }
        }
        let e = max_rel(&grads.d_initial_state, &want_s0);
        assert!(e < 1e-12, "d_initial_state {e}");
        let e = max_rel(&grads.d_alpha, &want_alpha);
        assert!(e < 1e-12, "d_alpha {e}");
        assert!(grads.d_v.iter().all(|x| *x == 0.0));
    }

    /// The time steps [t0, t1) of a `[B, T, rest]` tensor.
    fn steps(x: &[f64], batch: usize, t_len: usize, t0: usize, t1: usize) -> Vec<f64> {
        let rest = x.len() / (batch * t_len);
        (0..batch)
            .flat_map(|b| x[(b * t_len + t0) * rest..(b * t_len + t1) * rest].to_vec())
            .collect()
    }

    /// Steps [t0, t1) of `d` as a sequence of its own, starting from `s0`, ending in
    /// `d_final`.
    fn part(s: DeltaShape, d: &Data, t0: usize, t1: usize, s0: &[f64], d_final: &[f64]) -> Data {
        let sl = |x: &[f64]| steps(x, s.batch, s.seq_len, t0, t1);
        Data {
            q: sl(&d.q),
            k: sl(&d.k),
            v: sl(&d.v),
            alpha: sl(&d.alpha),
            beta: sl(&d.beta),
            s0: s0.to_vec(),
            d_out: sl(&d.d_out),
            d_final: d_final.to_vec(),
        }
    }

    /// The backward over two parts, the second started from the first's final state and
    /// the first ended with the second's dS_0, equals one pass over the whole sequence.
    #[test]
    fn the_backward_in_two_halves_equals_one_pass() {
        let s = SHAPE;
        let d = data(s, 300);
        let cut = 3;
        let whole = gated_delta_rule_backward(s, inputs(&d), &d.d_out, Some(&d.d_final)).unwrap();
        let s1 = DeltaShape { seq_len: cut, ..s };
        let s2 = DeltaShape {
            seq_len: s.seq_len - cut,
            ..s
        };
        let first_fwd = part(s, &d, 0, cut, &d.s0, &[]);
        let (_, mid_state) = gated_delta_rule(s1, inputs(&first_fwd)).unwrap();
        let second = part(s, &d, cut, s.seq_len, &mid_state, &d.d_final);
        let g2 =
            gated_delta_rule_backward(s2, inputs(&second), &second.d_out, Some(&second.d_final))
                .unwrap();
        let first = part(s, &d, 0, cut, &d.s0, &g2.d_initial_state);
        let g1 = gated_delta_rule_backward(s1, inputs(&first), &first.d_out, Some(&first.d_final))
            .unwrap();
        let per_step = |g: &DeltaGradients| -> [Vec<f64>; 5] {
            [
                g.d_q.clone(),
                g.d_k.clone(),
                g.d_v.clone(),
                g.d_alpha.clone(),
                g.d_beta.clone(),
            ]
        };
        let names = ["q", "k", "v", "alpha", "beta"];
        let (w, a, b) = (per_step(&whole), per_step(&g1), per_step(&g2));
        for (e, name) in names.iter().enumerate() {
            let e1 = max_rel(&a[e], &steps(&w[e], s.batch, s.seq_len, 0, cut));
            let e2 = max_rel(&b[e], &steps(&w[e], s.batch, s.seq_len, cut, s.seq_len));
            assert!(e1 < 1e-12 && e2 < 1e-12, "{name}: first {e1}, second {e2}");
        }
        let e = max_rel(&g1.d_initial_state, &whole.d_initial_state);
        assert!(e < 1e-12, "d_initial_state {e}");
    }

    /// A sequence of length 0 passes d_final_state through as the initial state's gradient.
    #[test]
    fn an_empty_sequence_passes_the_final_gradient_through() {
        let s = DeltaShape {
            seq_len: 0,
            ..SHAPE
        };
        let d = data(s, 400);
        let g = gated_delta_rule_backward(s, inputs(&d), &[], Some(&d.d_final)).unwrap();
        assert!(g.d_q.is_empty() && g.d_alpha.is_empty());
        assert_eq!(g.d_initial_state, d.d_final);
    }

    #[test]
    fn bad_lengths_name_the_input() {
        let s = SHAPE;
        let d = data(s, 500);
        let run = |d_out: &[f64], d_final: Option<&[f64]>| {
            gated_delta_rule_backward(s, inputs(&d), d_out, d_final).unwrap_err()
        };
        let e = run(&d.d_out[1..], Some(&d.d_final));
        assert!(e.starts_with("d_out:"), "{e}");
        let e = run(&d.d_out, Some(&d.d_final[1..]));
        assert!(e.starts_with("d_final_state:"), "{e}");
        let long = [d.d_final.as_slice(), &[0.0]].concat();
        let e = run(&d.d_out, Some(&long));
        assert!(e.starts_with("d_final_state:"), "{e}");
        let short_s0 = &d.s0[1..];
        let e = gated_delta_rule_backward(
            s,
            DeltaInputs {
                initial_state: Some(short_s0),
                ..inputs(&d)
            },
            &d.d_out,
            None,
        )
        .unwrap_err();
        assert!(e.starts_with("initial_state:"), "{e}");
        let e = gated_delta_rule_backward(
            s,
            DeltaInputs {
                q: &d.q[1..],
                ..inputs(&d)
            },
            &d.d_out,
            None,
        )
        .unwrap_err();
        assert!(e.starts_with("q:"), "{e}");
        let e =
            gated_delta_rule_backward(DeltaShape { key_dim: 0, ..s }, inputs(&d), &d.d_out, None)
                .unwrap_err();
        assert!(e.contains("empty dimension"), "{e}");
    }
}
