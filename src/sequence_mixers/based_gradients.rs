//! Float64 backward reference of Based ([`super::reference::based`]; Arora et al., 2024,
//! "Simple linear attention language models balance the recall-throughput tradeoff"): the
//! vector-Jacobian product the CUDA backward (`super::based_backward`) is checked against.
//!
//! It is the adjoint of the two branches, written out, not a finite difference: the linear
//! branch's state adjoint walked from the last step back to the first, and the window
//! branch's softmax backward (as FlashAttention's: dS = P ∘ (dP − rowsum(P ∘ dP))) per query.
//! The gradient is that of the scalar
//!
//! L = Σ dy ∘ O + Σ d_final_state ∘ S_T
//!
//! with respect to q, k, v and the initial linear state S_0 (zeros when none was given: the
//! gradient is returned either way). The window's cache is not differentiated: the initial
//! state's cache must be empty (the CUDA forward takes none either), and the final state's
//! cached keys and values, copies of the last steps' k and v, take no cotangent here (a
//! caller with one adds it to those steps' dk and dv).

use rayon::prelude::*;

use super::reference::{check_len, BasedInputs, BasedShape};

/// Gradients of Based's inputs ([`based_backward`]), float64, in the layouts of
/// [`BasedInputs`].
#[derive(Clone, Debug, PartialEq)]
pub struct BasedGradients {
    /// ∂L/∂q, `[B, T, H, K]`.
    pub dq: Vec<f64>,
    /// ∂L/∂k, `[B, T, H, K]`.
    pub dk: Vec<f64>,
    /// ∂L/∂v, `[B, T, H, V]`.
    pub dv: Vec<f64>,
    /// ∂L/∂S_0, `[B, H, V, K]`, whether or not an initial state was given.
    pub d_initial_state: Vec<f64>,
}

/// The backward of [`super::reference::based`]: the gradient of
/// L = ⟨dy, O⟩ + ⟨d_final_state, S_T⟩ with respect to q, k, v and S_0, from the forward's
/// inputs `inp`, `dy` `[B, T, H, V]` and `d_final_state` `[B, H, V, K]` (the linear state's
/// cotangent; zeros when none).
///
/// Per batch entry and head, with the scale c, S_t = S_0 + Σ_{s≤t} v_s k_sᵀ and
/// o_t = c S_t q_t + Σ_{s ∈ w(t)} P_ts v_s, w(t) = [max(0, t − W + 1), t],
/// P_t· = softmax(c q_t·k_s):
///
/// - linear branch: dq_t = c S_tᵀ dy_t; with G_t = d_final_state + c Σ_{u≥t} dy_u q_uᵀ
///   (V × K), dv_t = G_t k_t, dk_t = G_tᵀ v_t and dS_0 = G_0 (d_final_state when T = 0);
/// - window branch: dP_ts = dy_t·v_s, D_t = Σ_s P_ts dP_ts, dS_ts = P_ts (dP_ts − D_t);
///   dq_t += c Σ_s dS_ts k_s, dk_s += c dS_ts q_t, dv_s += P_ts dy_t.
///
/// # Errors
/// A message naming the input whose length does not fit `shape` (`dy`, `d_final_state` and
/// `initial_state.s` included), an initial state with cached keys (the cache is not
/// differentiated), or an empty dimension other than seq_len (W = 0 included).
pub fn based_backward(
    shape: BasedShape,
    inp: BasedInputs,
    dy: &[f64],
    d_final_state: Option<&[f64]>,
) -> Result<BasedGradients, String> {
    let BasedShape {
        batch,
        seq_len: t_len,
        heads,
        key_dim: kd,
        value_dim: vd,
        window,
    } = shape;
    if batch == 0 || heads == 0 || kd == 0 || vd == 0 || window == 0 {
        return Err(format!("based backward: empty dimension in {shape:?}"));
    }
    check_len("q", inp.q, batch * t_len * heads * kd)?;
    check_len("k", inp.k, batch * t_len * heads * kd)?;
    check_len("v", inp.v, batch * t_len * heads * vd)?;
    check_len("dy", dy, batch * t_len * heads * vd)?;
    let state_len = batch * heads * vd * kd;
    if let Some(d) = d_final_state {
        check_len("d_final_state", d, state_len)?;
    }
    if let Some(s0) = inp.initial_state {
        check_len("initial_state.s", &s0.s, state_len)?;
        if s0.cached != 0 {
            return Err(format!(
                "initial_state: {} cached steps; the backward takes an empty cache",
                s0.cached
            ));
        }
    }
    let c = inp.scale;
    let at = |b: usize, t: usize, h: usize| (b * t_len + t) * heads + h;
    // One task per (batch entry, head); its gradients are scattered afterwards.
    type Part = (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>);
    let parts: Vec<Part> = (0..batch * heads)
        .into_par_iter()
        .map(|bh| {
            let (b, h) = (bh / heads, bh % heads);
            // Step t's row of a [B, T, H, w] array.
            let row = |t: usize, w: usize| {
                let i = at(b, t, h) * w;
                i..i + w
            };
            let mut dq = vec![0.0; t_len * kd];
            let mut dk = vec![0.0; t_len * kd];
            let mut dv = vec![0.0; t_len * vd];
            // Linear branch, forward sweep: S_t, then dq_t = c S_tᵀ dy_t.
            let mut s = match inp.initial_state {
                Some(s0) => s0.s[bh * vd * kd..][..vd * kd].to_vec(),
                None => vec![0.0; vd * kd],
            };
            for t in 0..t_len {
                let (k, v, g) = (&inp.k[row(t, kd)], &inp.v[row(t, vd)], &dy[row(t, vd)]);
                for r in 0..vd {
                    let sr = &mut s[r * kd..][..kd];
                    for j in 0..kd {
                        sr[j] += v[r] * k[j];
                        dq[t * kd + j] += c * sr[j] * g[r];
                    }
                }
            }
            // Backward sweep: G_t = G_{t+1} + c dy_t q_tᵀ, dv_t = G_t k_t, dk_t = G_tᵀ v_t.
            let mut gs = match d_final_state {
                Some(d) => d[bh * vd * kd..][..vd * kd].to_vec(),
                None => vec![0.0; vd * kd],
            };
            for t in (0..t_len).rev() {
                let (q, k, v, g) = (
                    &inp.q[row(t, kd)],
                    &inp.k[row(t, kd)],
                    &inp.v[row(t, vd)],
                    &dy[row(t, vd)],
                );
                for r in 0..vd {
                    let gr = &mut gs[r * kd..][..kd];
                    let mut acc = 0.0;
                    for j in 0..kd {
                        gr[j] += c * g[r] * q[j];
                        acc += gr[j] * k[j];
                        dk[t * kd + j] += gr[j] * v[r];
                    }
                    dv[t * vd + r] += acc;
                }
            }
            // Window branch: the softmax's backward per query row.
            let mut p = vec![0.0; window.min(t_len)];
            let mut dp = vec![0.0; window.min(t_len)];
            for t in 0..t_len {
                let first = (t + 1).saturating_sub(window);
                let q = &inp.q[row(t, kd)];
                let g = &dy[row(t, vd)];
                let n = t - first + 1;
                for (e, s_) in (first..=t).enumerate() {
                    let k = &inp.k[row(s_, kd)];
                    let v = &inp.v[row(s_, vd)];
                    p[e] = c * (0..kd).map(|j| q[j] * k[j]).sum::<f64>();
                    dp[e] = (0..vd).map(|r| g[r] * v[r]).sum::<f64>();
                }
                let top = p[..n].iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x));
                p[..n].iter_mut().for_each(|e| *e = (*e - top).exp());
                let sum: f64 = p[..n].iter().sum();
                p[..n].iter_mut().for_each(|e| *e /= sum);
                let d: f64 = (0..n).map(|e| p[e] * dp[e]).sum();
                for (e, s_) in (first..=t).enumerate() {
                    let ds = p[e] * (dp[e] - d);
                    let k = &inp.k[row(s_, kd)];
                    for j in 0..kd {
                        dq[t * kd + j] += c * ds * k[j];
                        dk[s_ * kd + j] += c * ds * q[j];
                    }
                    for r in 0..vd {
                        dv[s_ * vd + r] += p[e] * g[r];
                    }
                }
            }
            (dq, dk, dv, gs)
        })
        .collect();
    let mut out = BasedGradients {
        dq: vec![0.0; batch * t_len * heads * kd],
        dk: vec![0.0; batch * t_len * heads * kd],
        dv: vec![0.0; batch * t_len * heads * vd],
        d_initial_state: vec![0.0; state_len],
    };
    for (bh, (dq, dk, dv, ds0)) in parts.into_iter().enumerate() {
        let (b, h) = (bh / heads, bh % heads);
        for t in 0..t_len {
            let i = at(b, t, h);
            out.dq[i * kd..][..kd].copy_from_slice(&dq[t * kd..][..kd]);
            out.dk[i * kd..][..kd].copy_from_slice(&dk[t * kd..][..kd]);
            out.dv[i * vd..][..vd].copy_from_slice(&dv[t * vd..][..vd]);
        }
        out.d_initial_state[bh * vd * kd..][..vd * kd].copy_from_slice(&ds0);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sequence_mixers::reference::{based, BasedState};

    fn values(n: usize, seed: u64) -> Vec<f64> {
        // A small LCG: reproducible inputs in (-1, 1) without a dependency.
        let mut x = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((x >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
            })
            .collect()
    }

    #[allow(clippy::too_many_arguments)]
    fn loss(
        shape: BasedShape,
        q: &[f64],
        k: &[f64],
        v: &[f64],
        s0: &BasedState,
        scale: f64,
        dy: &[f64],
        dfin: &[f64],
    ) -> f64 {
        let inp = BasedInputs {
            q,
            k,
            v,
            scale,
            initial_state: Some(s0),
        };
        let (o, fin) = based(shape, inp).unwrap();
        let a: f64 = o.iter().zip(dy).map(|(x, y)| x * y).sum();
        a + fin.s.iter().zip(dfin).map(|(x, y)| x * y).sum::<f64>()
    }

    /// Every gradient against central differences of L, on shapes where the window is shorter
    /// than, equal to and longer than the sequence, with an initial state and d_final_state.
    #[test]
    fn matches_finite_differences() {
        for (i, &(batch, seq_len, heads, kd, vd, window)) in [
            (1, 9, 2, 3, 2, 3),
            (2, 5, 1, 4, 3, 5),
            (1, 4, 1, 2, 5, 8),
            (1, 1, 1, 3, 3, 1),
        ]
        .iter()
        .enumerate()
        {
            let shape = BasedShape {
                batch,
                seq_len,
                heads,
                key_dim: kd,
                value_dim: vd,
                window,
            };
            let seed = 10 * i as u64;
            let n_qk = batch * seq_len * heads * kd;
            let n_v = batch * seq_len * heads * vd;
            let mut q = values(n_qk, seed + 1);
            let mut k = values(n_qk, seed + 2);
            let mut v = values(n_v, seed + 3);
            let mut s0 = BasedState::zeros(shape);
            s0.s = values(s0.s.len(), seed + 4);
            let dy = values(n_v, seed + 5);
            let dfin = values(s0.s.len(), seed + 6);
            let scale = 0.7;
            let g = based_backward(
                shape,
                BasedInputs {
                    q: &q,
                    k: &k,
                    v: &v,
                    scale,
                    initial_state: Some(&s0),
                },
                &dy,
                Some(&dfin),
            )
            .unwrap();
            let h = 1e-6;
            let mut check = |which: usize, e: usize, want: f64| {
                let bump = |d: f64,
                            q: &mut Vec<f64>,
                            k: &mut Vec<f64>,
                            v: &mut Vec<f64>,
                            s: &mut BasedState| {
                    match which {
                        0 => q[e] += d,
                        1 => k[e] += d,
                        2 => v[e] += d,
                        _ => s.s[e] += d,
                    }
                };
                bump(h, &mut q, &mut k, &mut v, &mut s0);
                let lp = loss(shape, &q, &k, &v, &s0, scale, &dy, &dfin);
                bump(-2.0 * h, &mut q, &mut k, &mut v, &mut s0);
                let lm = loss(shape, &q, &k, &v, &s0, scale, &dy, &dfin);
                bump(h, &mut q, &mut k, &mut v, &mut s0);
                let fd = (lp - lm) / (2.0 * h);
                assert!(
                    (fd - want).abs() <= 1e-6 * (1.0 + fd.abs()),
                    "{shape:?} input {which} entry {e}: adjoint {want}, finite difference {fd}"
                );
            };
            for e in 0..n_qk {
                check(0, e, g.dq[e]);
                check(1, e, g.dk[e]);
            }
            for e in 0..n_v {
                check(2, e, g.dv[e]);
            }
            for e in 0..g.d_initial_state.len() {
                check(3, e, g.d_initial_state[e]);
            }
        }
    }

    #[test]
    fn refuses_a_cache_and_wrong_lengths() {
        let shape = BasedShape {
            batch: 1,
            seq_len: 3,
            heads: 1,
            key_dim: 2,
            value_dim: 2,
            window: 3,
        };
        let x = vec![0.5; 6];
        let mut s0 = BasedState::zeros(shape);
        s0.cached = 1;
        s0.keys = vec![0.1; 2];
        s0.values = vec![0.1; 2];
        let inp = BasedInputs {
            q: &x,
            k: &x,
            v: &x,
            scale: 1.0,
            initial_state: Some(&s0),
        };
        let e = based_backward(shape, inp, &x, None).unwrap_err();
        assert!(e.contains("cache"), "{e}");
        let inp = BasedInputs {
            initial_state: None,
            ..inp
        };
        let e = based_backward(shape, inp, &x[..5], None).unwrap_err();
        assert!(e.contains("dy"), "{e}");
    }
}
