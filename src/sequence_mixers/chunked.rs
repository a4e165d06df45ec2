//! The chunked forms of the sequence mixers, in float64 on the CPU: the algorithms the CUDA
//! kernels follow, written as the matrix products a kernel runs per chunk, and checked here
//! against the sequential recurrences of [`super::reference`]. A kernel's tiling is then a
//! question of where these products run, not of what they compute.

use super::reference::{or_zeros, DeltaInputs, DeltaShape, SsdInputs, SsdShape};

/// SSD (Mamba-2's state-space dual layer, scalar decay per head, B and C shared by groups of
/// heads) computed chunk by chunk, as Dao and Gu (2024, "Transformers are SSMs", §6, the block
/// decomposition of the semiseparable matrix) compute it: the same function as
/// [`super::reference::ssd`], same inputs, outputs and layouts, with the sequence cut into
/// chunks of `chunk` time steps (the last one shorter when T is not a multiple).
///
/// For one (batch entry, head h, group g) and a chunk of l steps starting from the state S₀
/// (P × N), with a_i = Δ_i A_h and the cumulative sums cs_i = a_0 + … + a_i inside the chunk:
///
/// - the scores G = C Bᵀ (l × l, one per group: every head of the group shares them), masked
///   and decayed: M_ij = G_ij · exp(cs_i − cs_j) for j ≤ i, 0 above the diagonal;
/// - within the chunk: Y_diag = M (Δ ∘ X), an (l × l)(l × P) product;
/// - from the earlier chunks: Y_off_i = exp(cs_i) · S₀ C_i, an (l × N)(N × P) product;
/// - y = Y_diag + Y_off + D_h x;
/// - the state passed on: S_l = exp(cs_{l−1}) S₀ + Σ_j exp(cs_{l−1} − cs_j) Δ_j x_j B_jᵀ, a
///   (P × l)(l × N) product.
///
/// Unrolling the recurrence S_i = exp(a_i) S_{i−1} + Δ_i x_i B_iᵀ gives these terms exactly;
/// only the order of the sums differs, so the two agree to rounding.
///
/// # Errors
/// As [`super::reference::ssd`] (a message naming the input whose length does not fit
/// `shape`, or the shape's fault), and a chunk of 0 steps.
pub fn ssd(shape: SsdShape, inp: SsdInputs, chunk: usize) -> Result<(Vec<f64>, Vec<f64>), String> {
    let SsdShape {
        batch,
        seq_len: t_len,
        heads,
        head_dim: p_dim,
        state: n_dim,
        groups,
    } = shape;
    if chunk == 0 {
        return Err("ssd: chunk of 0 time steps".into());
    }
    shape.check("ssd", &inp)?;
    let states = batch * heads * p_dim * n_dim;
    let mut state = or_zeros("initial_state", inp.initial_state, states)?;
    let mut y = vec![0.0; batch * t_len * heads * p_dim];
    let per_group = heads / groups;
    // Per-chunk scratch, reused.
    let mut scores = vec![0.0; chunk * chunk];
    let mut cs = vec![0.0; chunk];
    let mut dx = vec![0.0; chunk * p_dim];
    for b in 0..batch {
        for c0 in (0..t_len).step_by(chunk) {
            let l = chunk.min(t_len - c0);
            let row = |i: usize| b * t_len + c0 + i;
            for g in 0..groups {
                let b_of = |i: usize| &inp.b[(row(i) * groups + g) * n_dim..][..n_dim];
                let c_of = |i: usize| &inp.c[(row(i) * groups + g) * n_dim..][..n_dim];
                // G = C Bᵀ over the chunk, lower triangle: once per group.
                for i in 0..l {
                    for j in 0..=i {
                        scores[i * chunk + j] = dot(c_of(i), b_of(j));
                    }
                }
                for h in g * per_group..(g + 1) * per_group {
                    let mut acc = 0.0;
                    for (i, c) in cs.iter_mut().take(l).enumerate() {
                        acc += inp.dt[row(i) * heads + h] * inp.a[h];
                        *c = acc;
                    }
                    for i in 0..l {
                        let dt = inp.dt[row(i) * heads + h];
                        let x = &inp.x[(row(i) * heads + h) * p_dim..][..p_dim];
                        for (o, &xv) in dx[i * p_dim..][..p_dim].iter_mut().zip(x) {
                            *o = dt * xv;
                        }
                    }
                    let s = &mut state[(b * heads + h) * p_dim * n_dim..][..p_dim * n_dim];
                    let skip = inp.d.map_or(0.0, |d| d[h]);
                    for i in 0..l {
                        let out = &mut y[(row(i) * heads + h) * p_dim..][..p_dim];
                        // Y_diag_i = Σ_{j ≤ i} M_ij (Δ x)_j.
                        for j in 0..=i {
                            let m = scores[i * chunk + j] * (cs[i] - cs[j]).exp();
                            for (o, &v) in out.iter_mut().zip(&dx[j * p_dim..][..p_dim]) {
                                *o += m * v;
                            }
                        }
                        // Y_off_i = exp(cs_i) S₀ C_i, and the skip.
                        let decay = cs[i].exp();
                        let ci = c_of(i);
                        let x = &inp.x[(row(i) * heads + h) * p_dim..][..p_dim];
                        for p in 0..p_dim {
                            out[p] += decay * dot(&s[p * n_dim..][..n_dim], ci) + skip * x[p];
                        }
                    }
                    // S_l = exp(cs_{l−1}) S₀ + Σ_j exp(cs_{l−1} − cs_j) (Δ x)_j B_jᵀ.
                    let last = cs[l - 1];
                    for v in s.iter_mut() {
                        *v *= last.exp();
                    }
                    for j in 0..l {
                        let w = (last - cs[j]).exp();
                        let bj = b_of(j);
                        for p in 0..p_dim {
                            let coef = w * dx[j * p_dim + p];
                            for (sv, &bv) in s[p * n_dim..][..n_dim].iter_mut().zip(bj) {
                                *sv += coef * bv;
                            }
                        }
                    }
                }
            }
        }
    }
    Ok((y, state))
}

/// The gated delta rule (Gated DeltaNet, Yang, Kautz and Hatamizadeh, 2024) computed chunk by
/// chunk in the WY form of Yang et al. (2024, "Parallelizing Linear Transformers with the
/// Delta Rule over Sequence Length", §3, with the decay of Gated DeltaNet §3.3): the same
/// function as [`super::reference::gated_delta_rule`], same inputs, outputs and layouts, with
/// the sequence cut into chunks of `chunk` time steps.
///
/// For one (batch entry, head) and a chunk of l steps starting from the state S₀ (V × K), with
/// the cumulative decays γ_i = α_0 ⋯ α_i inside the chunk (γ_i/γ_j = exp(g_i − g_j), g the
/// cumulative sum of ln α), the state after step i is
///
/// S_i = γ_i S₀ + Σ_{j ≤ i} (γ_i/γ_j) u_j k_jᵀ,  u_i = β_i (v_i − α_i S_{i−1} k_i),
///
/// and substituting S_{i−1} into u_i gives a unit lower-triangular system (I + A) U = R with
/// A_ij = β_i (γ_i/γ_j) (k_i·k_j) for j < i. Hence, with T = (I + A)⁻¹:
///
/// - per chunk, independent of S₀: Ũ = T diag(β) V (l × V) and W = T diag(β γ) K (l × K), by
///   forward substitution (a kernel inverts the l × l block instead);
/// - U = Ũ − W S₀ᵀ;
/// - O = diag(γ) Q S₀ᵀ + (Q Kᵀ ∘ Γ) U, Γ_ij = γ_i/γ_j for j ≤ i and 0 above the diagonal;
/// - the state passed on: S_l = γ_{l−1} S₀ + Uᵀ diag(γ_{l−1}/γ) K.
///
/// Every step is a matrix product over the chunk except the l × l solve. Unrolling the
/// recurrence gives these terms exactly; the two agree to rounding.
///
/// # Errors
/// As [`super::reference::gated_delta_rule`], and a chunk of 0 steps.
pub fn gated_delta_rule(
    shape: DeltaShape,
    inp: DeltaInputs,
    chunk: usize,
) -> Result<(Vec<f64>, Vec<f64>), String> {
    let DeltaShape {
        batch,
        seq_len: t_len,
        heads,
        key_dim: kd,
        value_dim: vd,
    } = shape;
    if chunk == 0 {
        return Err("gated_delta_rule: chunk of 0 time steps".into());
    }
    shape.check("gated_delta_rule", &inp)?;
    let states = batch * heads * vd * kd;
    let mut state = or_zeros("initial_state", inp.initial_state, states)?;
    let mut o = vec![0.0; batch * t_len * heads * vd];
    // Per-chunk scratch: g (cumulative ln α), U (l × V), W (l × K).
    let mut g = vec![0.0; chunk];
    let mut u = vec![0.0; chunk * vd];
    let mut w = vec![0.0; chunk * kd];
    for b in 0..batch {
        for h in 0..heads {
            let s = &mut state[(b * heads + h) * vd * kd..][..vd * kd];
            for c0 in (0..t_len).step_by(chunk) {
                let l = chunk.min(t_len - c0);
                let at = |i: usize| (b * t_len + c0 + i) * heads + h;
                let q_of = |i: usize| &inp.q[at(i) * kd..][..kd];
                let k_of = |i: usize| &inp.k[at(i) * kd..][..kd];
                let v_of = |i: usize| &inp.v[at(i) * vd..][..vd];
                let mut acc = 0.0;
                for (i, gi) in g.iter_mut().take(l).enumerate() {
                    // ln α floored at −20, as the kernel does (delta.cu says why): α = 0
                    // would make the ratios γ_i/γ_j = exp(g_i − g_j) NaN.
                    acc += inp.alpha[at(i)].ln().max(-20.0);
                    *gi = acc;
                }
                // Right-hand sides diag(β) V and diag(β γ) K, then forward substitution with
                // A_ij = β_i (γ_i/γ_j) (k_i·k_j): row i minus Σ_{j<i} A_ij row j.
                for i in 0..l {
                    let beta = inp.beta[at(i)];
                    let gamma = g[i].exp();
                    for (x, &v) in u[i * vd..][..vd].iter_mut().zip(v_of(i)) {
                        *x = beta * v;
                    }
                    for (x, &k) in w[i * kd..][..kd].iter_mut().zip(k_of(i)) {
                        *x = beta * gamma * k;
                    }
                    for j in 0..i {
                        let a = beta * (g[i] - g[j]).exp() * dot(k_of(i), k_of(j));
                        let (done, row) = u.split_at_mut(i * vd);
                        for (x, &y) in row[..vd].iter_mut().zip(&done[j * vd..][..vd]) {
                            *x -= a * y;
                        }
                        let (done, row) = w.split_at_mut(i * kd);
                        for (x, &y) in row[..kd].iter_mut().zip(&done[j * kd..][..kd]) {
                            *x -= a * y;
                        }
                    }
                }
                // U = Ũ − W S₀ᵀ: u_i[r] −= Σ_c W_ic S₀[r][c].
                for i in 0..l {
                    for r in 0..vd {
                        u[i * vd + r] -= dot(&w[i * kd..][..kd], &s[r * kd..][..kd]);
                    }
                }
                // O = diag(γ) Q S₀ᵀ + (Q Kᵀ ∘ Γ) U.
                for i in 0..l {
                    let gamma = g[i].exp();
                    let qi = q_of(i);
                    let out = &mut o[at(i) * vd..][..vd];
                    for (r, x) in out.iter_mut().enumerate() {
                        *x = gamma * dot(qi, &s[r * kd..][..kd]);
                    }
                    for j in 0..=i {
                        let m = (g[i] - g[j]).exp() * dot(qi, k_of(j));
                        for (x, &y) in out.iter_mut().zip(&u[j * vd..][..vd]) {
                            *x += m * y;
                        }
                    }
                }
                // S_l = γ_{l−1} S₀ + Uᵀ diag(γ_{l−1}/γ) K.
                let last = g[l - 1];
                for x in s.iter_mut() {
                    *x *= last.exp();
                }
                for j in 0..l {
                    let decay = (last - g[j]).exp();
                    let kj = k_of(j);
                    for r in 0..vd {
                        let coef = decay * u[j * vd + r];
                        for (x, &k) in s[r * kd..][..kd].iter_mut().zip(kj) {
                            *x += coef * k;
                        }
                    }
                }
            }
        }
    }
    Ok((o, state))
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

#[cfg(test)]
mod tests {
    use super::super::reference;
    use super::super::test_util::{max_rel, uniform};
    use super::*;

    struct Data {
        x: Vec<f64>,
        dt: Vec<f64>,
        a: Vec<f64>,
        b: Vec<f64>,
        c: Vec<f64>,
        d: Vec<f64>,
        s0: Vec<f64>,
    }

    fn data(s: SsdShape, seed: u64) -> Data {
        let (bt, h) = (s.batch * s.seq_len, s.heads);
        Data {
            x: uniform(bt * h * s.head_dim, -1.0, 1.0, seed),
            dt: uniform(bt * h, 0.05, 0.5, seed + 1),
            a: uniform(h, -3.0, -0.2, seed + 2),
            b: uniform(bt * s.groups * s.state, -1.0, 1.0, seed + 3),
            c: uniform(bt * s.groups * s.state, -1.0, 1.0, seed + 4),
            d: uniform(h, -1.0, 1.0, seed + 5),
            s0: uniform(s.batch * h * s.head_dim * s.state, -1.0, 1.0, seed + 6),
        }
    }

    fn inputs(d: &Data, skip: bool, start: bool) -> SsdInputs<'_> {
        SsdInputs {
            x: &d.x,
            dt: &d.dt,
            a: &d.a,
            b: &d.b,
            c: &d.c,
            d: skip.then_some(&d.d[..]),
            initial_state: start.then_some(&d.s0[..]),
        }
    }

    #[test]
    fn chunked_ssd_equals_the_recurrence_for_every_chunk_size() {
        let shape = SsdShape {
            batch: 2,
            seq_len: 11,
            heads: 4,
            head_dim: 3,
            state: 5,
            groups: 2,
        };
        let d = data(shape, 17);
        for (skip, start) in [(false, false), (true, true), (true, false)] {
            let inp = inputs(&d, skip, start);
            let (y_ref, s_ref) = reference::ssd(shape, inp).unwrap();
            // 1 (the recurrence itself), sizes that do and do not divide T, T, and more.
            for chunk in [1, 2, 3, 4, 11, 16] {
                let (y, s) = ssd(shape, inp, chunk).unwrap();
                assert!(max_rel(&y, &y_ref) < 1e-13, "chunk {chunk}: y");
                assert!(max_rel(&s, &s_ref) < 1e-13, "chunk {chunk}: state");
            }
        }
    }

    #[test]
    fn one_group_per_head_and_one_group_for_all() {
        for groups in [1, 6] {
            let shape = SsdShape {
                batch: 1,
                seq_len: 9,
                heads: 6,
                head_dim: 2,
                state: 3,
                groups,
            };
            let d = data(shape, 5 + groups as u64);
            let inp = inputs(&d, true, true);
            let (y_ref, s_ref) = reference::ssd(shape, inp).unwrap();
            let (y, s) = ssd(shape, inp, 4).unwrap();
            assert!(max_rel(&y, &y_ref) < 1e-13, "groups {groups}");
            assert!(max_rel(&s, &s_ref) < 1e-13, "groups {groups}");
        }
    }

    #[test]
    fn bad_chunk_and_lengths_are_named() {
        let shape = SsdShape {
            batch: 1,
            seq_len: 4,
            heads: 2,
            head_dim: 2,
            state: 2,
            groups: 1,
        };
        let d = data(shape, 3);
        let inp = inputs(&d, false, false);
        assert!(ssd(shape, inp, 0).unwrap_err().contains("chunk"));
        let short = &d.b[1..];
        let bad = SsdInputs { b: short, ..inp };
        assert!(ssd(shape, bad, 2).unwrap_err().starts_with("b:"));
        // seq_len 0: no output, the initial state back.
        let empty = SsdShape {
            seq_len: 0,
            ..shape
        };
        let s0 = vec![0.5; 8];
        let inp0 = SsdInputs {
            x: &[],
            dt: &[],
            b: &[],
            c: &[],
            initial_state: Some(&s0),
            ..inp
        };
        let (y, s) = ssd(empty, inp0, 3).unwrap();
        assert!(y.is_empty());
        assert_eq!(s, s0);
    }
    #[test]
    fn chunked_delta_rule_equals_the_recurrence_for_every_chunk_size() {
        let shape = DeltaShape {
            batch: 2,
            seq_len: 13,
            heads: 2,
            key_dim: 4,
            value_dim: 3,
        };
        let n = shape.batch * shape.seq_len * shape.heads;
        let q = uniform(n * 4, -1.0, 1.0, 31);
        // Unit keys, as the layer normalises them.
        let mut k = uniform(n * 4, -1.0, 1.0, 32);
        for row in k.chunks_mut(4) {
            let norm = row.iter().map(|x| x * x).sum::<f64>().sqrt();
            row.iter_mut().for_each(|x| *x /= norm);
        }
        let v = uniform(n * 3, -1.0, 1.0, 33);
        let alpha = uniform(n, 0.6, 1.0, 34);
        let beta = uniform(n, 0.0, 1.0, 35);
        let s0 = uniform(shape.batch * shape.heads * 3 * 4, -1.0, 1.0, 36);
        for start in [false, true] {
            let inp = DeltaInputs {
                q: &q,
                k: &k,
                v: &v,
                alpha: &alpha,
                beta: &beta,
                initial_state: start.then_some(&s0[..]),
            };
            let (o_ref, s_ref) = reference::gated_delta_rule(shape, inp).unwrap();
            for chunk in [1, 2, 4, 5, 13, 64] {
                let (o, s) = gated_delta_rule(shape, inp, chunk).unwrap();
                assert!(max_rel(&o, &o_ref) < 1e-12, "chunk {chunk}: o");
                assert!(max_rel(&s, &s_ref) < 1e-12, "chunk {chunk}: state");
            }
        }
        let inp = DeltaInputs {
            q: &q,
            k: &k,
            v: &v,
            alpha: &alpha,
            beta: &beta,
            initial_state: None,
        };
        assert!(gated_delta_rule(shape, inp, 0)
            .unwrap_err()
            .contains("chunk"));
        let bad = DeltaInputs {
            beta: &beta[1..],
            ..inp
        };
        assert!(gated_delta_rule(shape, bad, 4)
            .unwrap_err()
            .starts_with("beta:"));
    }
}
