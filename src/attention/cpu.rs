//! CPU attention: inputs, the float64 reference, a float32 model of the GPU flash kernel, and
//! the accuracy check every implementation's output goes through.
//!
//! The reference is the definition, O = softmax(Q Kᵀ / sqrt(D) + mask) V, computed in float64 on
//! the exact 16-bit inputs the device saw (so only the device's arithmetic is measured).

use super::{rel_l2, AttentionCase, Dtype};

/// splitmix64 step (Steele, Lea, Flood 2014): a small, fast, well-mixed 64-bit generator.
fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn uniform01(state: &mut u64) -> f64 {
    // 53 random bits in (0, 1].
    ((splitmix64(state) >> 11) as f64 + 1.0) / (1u64 << 53) as f64
}

/// `n` standard-normal values (Box–Muller) rounded to `dtype`, as bits. Deterministic in
/// `seed` and independent of the thread count: chunk i of 1 Mi elements draws from seed ⊕ i.
pub fn normal_bits(n: usize, dtype: Dtype, seed: u64) -> Vec<u16> {
    const CHUNK: usize = 1 << 20;
    let mut out = vec![0u16; n];
    let threads = std::thread::available_parallelism()
        .map_or(1, |t| t.get())
        .min(32);
    let chunks: Vec<(usize, &mut [u16])> = out.chunks_mut(CHUNK).enumerate().collect();
    let per = chunks.len().div_ceil(threads).max(1);
    let mut groups: Vec<Vec<(usize, &mut [u16])>> = Vec::new();
    let mut it = chunks.into_iter().peekable();
    while it.peek().is_some() {
        groups.push(it.by_ref().take(per).collect());
    }
    std::thread::scope(|s| {
        for group in groups {
            s.spawn(move || {
                for (ci, chunk) in group {
                    let mut st = seed ^ (ci as u64).wrapping_mul(0xA076_1D64_78BD_642F);
                    let mut i = 0;
                    while i < chunk.len() {
                        let u1 = uniform01(&mut st);
                        let u2 = uniform01(&mut st);
                        let r = (-2.0 * u1.ln()).sqrt();
                        let th = 2.0 * std::f64::consts::PI * u2;
                        chunk[i] = dtype.to_bits((r * th.cos()) as f32);
                        if i + 1 < chunk.len() {
                            chunk[i + 1] = dtype.to_bits((r * th.sin()) as f32);
                        }
                        i += 2;
                    }
                }
            });
        }
    });
    out
}

/// Offsets of the (batch, head) slice of Q and of its K/V slice, in elements.
fn slice_offsets(c: &AttentionCase, b: usize, h: usize) -> (usize, usize) {
    let td = c.seq_len * c.head_dim;
    let kvh = h / (c.heads / c.kv_heads);
    ((b * c.heads + h) * td, (b * c.kv_heads + kvh) * td)
}

/// Float64 reference output for query `rows` of slice (`b`, `h`): `rows.len() × head_dim`
/// values, row-major. Inputs are the 16-bit bits in `c.dtype`, laid out as the module says.
pub fn reference_rows(
    c: &AttentionCase,
    q: &[u16],
    k: &[u16],
    v: &[u16],
    b: usize,
    h: usize,
    rows: &[usize],
) -> Vec<f64> {
    let d = c.head_dim;
    let (qo, kvo) = slice_offsets(c, b, h);
    let to = |x: u16| c.dtype.from_bits(x) as f64;
    let kf: Vec<f64> = k[kvo..kvo + c.seq_len * d].iter().map(|&x| to(x)).collect();
    let vf: Vec<f64> = v[kvo..kvo + c.seq_len * d].iter().map(|&x| to(x)).collect();
    let scale = c.scale();
    let mut out = vec![0.0f64; rows.len() * d];
    let mut s = vec![0.0f64; c.seq_len];
    for (ri, &i) in rows.iter().enumerate() {
        let qi: Vec<f64> = q[qo + i * d..qo + (i + 1) * d]
            .iter()
            .map(|&x| to(x))
            .collect();
        let n = if c.causal { i + 1 } else { c.seq_len };
        let mut mx = f64::NEG_INFINITY;
        for (j, sj) in s.iter_mut().enumerate().take(n) {
            let kj = &kf[j * d..(j + 1) * d];
            *sj = qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f64>() * scale;
            mx = mx.max(*sj);
        }
        let mut sum = 0.0;
        for sj in s.iter_mut().take(n) {
            *sj = (*sj - mx).exp();
            sum += *sj;
        }
        let o = &mut out[ri * d..(ri + 1) * d];
        for (j, &p) in s.iter().enumerate().take(n) {
            let vj = &vf[j * d..(j + 1) * d];
            for (oe, ve) in o.iter_mut().zip(vj) {
                *oe += p * ve;
            }
        }
        for oe in o.iter_mut() {
            *oe /= sum;
        }
    }
    out
}

/// The whole float64 forward, `[B, H, T, D]`: the CPU implementation (small shapes).
pub fn forward_f64(c: &AttentionCase, q: &[u16], k: &[u16], v: &[u16]) -> Vec<f64> {
    let rows: Vec<usize> = (0..c.seq_len).collect();
    let mut out = Vec::with_capacity(c.q_elems());
    for b in 0..c.batch {
        for h in 0..c.heads {
            out.extend(reference_rows(c, q, k, v, b, h, &rows));
        }
    }
    out
}

/// A float32 model of the GPU flash kernel for one slice: the same tiling (`bc` keys per
/// step), the base-2 online softmax and P rounded to the 16-bit dtype before P·V. Used to test
/// the algorithm on the CPU; returns `seq_len × head_dim` values.
pub fn flash_slice_f32(
    c: &AttentionCase,
    q: &[u16],
    k: &[u16],
    v: &[u16],
    b: usize,
    h: usize,
    bc: usize,
) -> Vec<f32> {
    let (t, d) = (c.seq_len, c.head_dim);
    let (qo, kvo) = slice_offsets(c, b, h);
    let f = |x: u16| c.dtype.from_bits(x);
    let scale_log2 = (c.scale() * std::f64::consts::LOG2_E) as f32;
    let mut out = vec![0.0f32; t * d];
    for i in 0..t {
        let mut m = f32::NEG_INFINITY;
        let mut l = 0.0f32;
        let mut acc = vec![0.0f32; d];
        let n_keys = if c.causal { i + 1 } else { t };
        let mut j0 = 0;
        while j0 < n_keys {
            let j1 = (j0 + bc).min(n_keys);
            let s: Vec<f32> = (j0..j1)
                .map(|j| {
                    let dot: f32 = (0..d)
                        .map(|e| f(q[qo + i * d + e]) * f(k[kvo + j * d + e]))
                        .sum();
                    dot * scale_log2
                })
                .collect();
            let mx = s.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let m_new = m.max(mx);
            let alpha = (m - m_new).exp2();
            l *= alpha;
            for a in acc.iter_mut() {
                *a *= alpha;
            }
            for (jj, sj) in s.iter().enumerate() {
                let p = (sj - m_new).exp2();
                l += p;
                let p16 = c.dtype.from_bits(c.dtype.to_bits(p));
                let j = j0 + jj;
                for (e, a) in acc.iter_mut().enumerate() {
                    *a += p16 * f(v[kvo + j * d + e]);
                }
            }
            m = m_new;
            j0 = j1;
        }
        for e in 0..d {
            out[i * d + e] = acc[e] / l;
        }
    }
    out
}

/// Which slices and query rows an accuracy check covers.
#[derive(Clone, Debug, PartialEq)]
pub struct CheckPlan {
    /// (batch, head) slices.
    pub slices: Vec<(usize, usize)>,
    /// Query rows, ascending, the same for every slice.
    pub rows: Vec<usize>,
}

impl CheckPlan {
    /// The first and the last slice plus two drawn from `seed` (up to four distinct); every
    /// row when seq_len ≤ `max_rows`, else `max_rows` distinct rows drawn from `seed` that
    /// always include rows 0 and seq_len − 1 (the causal extremes).
    pub fn new(c: &AttentionCase, max_rows: usize, seed: u64) -> CheckPlan {
        let n = c.batch * c.heads;
        let mut set = std::collections::BTreeSet::from([0, n - 1]);
        let mut st = seed ^ 0x51ce;
        for _ in 0..2 {
            set.insert((splitmix64(&mut st) % n as u64) as usize);
        }
        let slices: Vec<(usize, usize)> = set
            .into_iter()
            .map(|i| (i / c.heads, i % c.heads))
            .collect();
        let rows = if c.seq_len <= max_rows {
            (0..c.seq_len).collect()
        } else {
            let mut st = seed;
            let mut set = std::collections::BTreeSet::from([0, c.seq_len - 1]);
            while set.len() < max_rows {
                set.insert((splitmix64(&mut st) % c.seq_len as u64) as usize);
            }
            set.into_iter().collect()
        };
        CheckPlan { slices, rows }
    }

    /// Description for `Accuracy::checked`.
    pub fn describe(&self, c: &AttentionCase) -> String {
        format!(
            "{} of {} (batch, head) slices x {} of {} query rows",
            self.slices.len(),
            c.batch * c.heads,
            self.rows.len(),
            c.seq_len
        )
    }
}

impl CheckPlan {
    /// The checked output elements as `[start, len]` ranges of flat `[B, H, T, D]` indices, one
    /// per (slice, row), in the order of [`reference_values`].
    pub fn ranges(&self, c: &AttentionCase) -> Vec<[u64; 2]> {
        let d = c.head_dim;
        let mut v = Vec::with_capacity(self.slices.len() * self.rows.len());
        for &(b, h) in &self.slices {
            let (qo, _) = slice_offsets(c, b, h);
            for &i in &self.rows {
                v.push([(qo + i * d) as u64, d as u64]);
            }
        }
        v
    }
}

/// Float64 reference values of the plan's output elements, in [`CheckPlan::ranges`] order,
/// computed on all host threads.
pub fn reference_values(
    c: &AttentionCase,
    q: &[u16],
    k: &[u16],
    v: &[u16],
    plan: &CheckPlan,
) -> Vec<f64> {
    let threads = std::thread::available_parallelism()
        .map_or(1, |t| t.get())
        .min(32);
    let mut want = Vec::with_capacity(plan.slices.len() * plan.rows.len() * c.head_dim);
    for &(b, h) in &plan.slices {
        let per = plan.rows.len().div_ceil(threads).max(1);
        let parts: Vec<Vec<f64>> = std::thread::scope(|s| {
            let handles: Vec<_> = plan
                .rows
                .chunks(per)
                .map(|rows| s.spawn(move || reference_rows(c, q, k, v, b, h, rows)))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("reference thread"))
                .collect()
        });
        for p in parts {
            want.extend(p);
        }
    }
    want
}

/// Relative L2 error of `out` (16-bit bits, `[B, H, T, D]`) against the float64 reference over
/// the plan's slices and rows, computed on all host threads.
pub fn check_output(
    c: &AttentionCase,
    q: &[u16],
    k: &[u16],
    v: &[u16],
    out: &[u16],
    plan: &CheckPlan,
) -> f64 {
    let want = reference_values(c, q, k, v, plan);
    let got: Vec<f64> = plan
        .ranges(c)
        .iter()
        .flat_map(|&[start, len]| {
            out[start as usize..(start + len) as usize]
                .iter()
                .map(|&x| c.dtype.from_bits(x) as f64)
        })
        .collect();
    rel_l2(&got, &want)
}

#[cfg(test)]
mod tests {
    use super::super::Pass;
    use super::*;

    fn small(causal: bool, dtype: Dtype) -> AttentionCase {
        AttentionCase {
            batch: 2,
            heads: 2,
            kv_heads: 1,
            seq_len: 96,
            head_dim: 16,
            causal,
            dtype,
            pass: Pass::Fwd,
        }
    }

    fn inputs(c: &AttentionCase, seed: u64) -> (Vec<u16>, Vec<u16>, Vec<u16>) {
        (
            normal_bits(c.q_elems(), c.dtype, seed),
            normal_bits(c.kv_elems(), c.dtype, seed + 1),
            normal_bits(c.kv_elems(), c.dtype, seed + 2),
        )
    }

    #[test]
    fn normals_are_deterministic_and_standard() {
        let a = normal_bits(3_000_001, Dtype::Bf16, 7);
        assert_eq!(a, normal_bits(3_000_001, Dtype::Bf16, 7));
        assert_ne!(a, normal_bits(3_000_001, Dtype::Bf16, 8));
        let xs: Vec<f64> = a.iter().map(|&b| Dtype::Bf16.from_bits(b) as f64).collect();
        let mean = xs.iter().sum::<f64>() / xs.len() as f64;
        let var = xs.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / xs.len() as f64;
        assert!(mean.abs() < 0.01, "mean {mean}");
        assert!((var - 1.0).abs() < 0.02, "var {var}");
        assert!(
            xs.iter().filter(|&&x| x == 0.0).count() < 100,
            "inputs are never zeros"
        );
    }

    #[test]
    fn causal_first_row_is_first_value_row() {
        let c = small(true, Dtype::Bf16);
        let (q, k, v) = inputs(&c, 1);
        let o = reference_rows(&c, &q, &k, &v, 0, 0, &[0]);
        for e in 0..c.head_dim {
            assert_eq!(o[e], c.dtype.from_bits(v[e]) as f64);
        }
    }

    #[test]
    fn equal_scores_average_the_values() {
        // Q = 0 gives equal scores: every output row is the mean of the visible V rows.
        let c = small(false, Dtype::F16);
        let (_, k, v) = inputs(&c, 2);
        let q = vec![0u16; c.q_elems()];
        let o = reference_rows(&c, &q, &k, &v, 1, 1, &[5]);
        let (_, kvo) = slice_offsets(&c, 1, 1);
        for e in 0..c.head_dim {
            let mean: f64 = (0..c.seq_len)
                .map(|j| c.dtype.from_bits(v[kvo + j * c.head_dim + e]) as f64)
                .sum::<f64>()
                / c.seq_len as f64;
            assert!((o[e] - mean).abs() < 1e-12);
        }
    }

    #[test]
    fn gqa_heads_share_kv() {
        // heads 0 and 1 read kv head 0: same Q rows would give the same output.
        let c = small(false, Dtype::Bf16);
        let (mut q, k, v) = inputs(&c, 3);
        let td = c.seq_len * c.head_dim;
        let (head0, rest) = q.split_at_mut(td);
        rest[..td].copy_from_slice(head0);
        let a = reference_rows(&c, &q, &k, &v, 0, 0, &[3, 50]);
        let b = reference_rows(&c, &q, &k, &v, 0, 1, &[3, 50]);
        assert_eq!(a, b);
    }

    #[test]
    fn flash_model_matches_reference() {
        for causal in [false, true] {
            for dtype in [Dtype::Bf16, Dtype::F16] {
                let c = small(causal, dtype);
                let (q, k, v) = inputs(&c, 11);
                let want =
                    reference_rows(&c, &q, &k, &v, 1, 0, &(0..c.seq_len).collect::<Vec<_>>());
                let got: Vec<f64> = flash_slice_f32(&c, &q, &k, &v, 1, 0, 32)
                    .into_iter()
                    .map(|x| x as f64)
                    .collect();
                let err = rel_l2(&got, &want);
                assert!(err < dtype.tolerance() / 2.0, "{causal} {dtype:?} {err}");
            }
        }
    }

    #[test]
    fn check_catches_wrong_outputs() {
        let c = small(true, Dtype::Bf16);
        let (q, k, v) = inputs(&c, 5);
        let exact = forward_f64(&c, &q, &k, &v);
        let good: Vec<u16> = exact.iter().map(|&x| c.dtype.to_bits(x as f32)).collect();
        let plan = CheckPlan::new(&c, 1000, 9);
        let e = check_output(&c, &q, &k, &v, &good, &plan);
        assert!(e < 5e-3, "{e}");
        // A kernel that forgets the mask, or leaves a row unwritten, must fail the tolerance.
        let nc = AttentionCase {
            causal: false,
            ..c.clone()
        };
        let unmasked: Vec<u16> = forward_f64(&nc, &q, &k, &v)
            .iter()
            .map(|&x| c.dtype.to_bits(x as f32))
            .collect();
        assert!(check_output(&c, &q, &k, &v, &unmasked, &plan) > c.dtype.tolerance());
        let mut hole = good.clone();
        for x in &mut hole[0..c.head_dim] {
            *x = c.dtype.to_bits(f32::NAN);
        }
        assert!(check_output(&c, &q, &k, &v, &hole, &plan).is_nan());
        let mut swapped = good.clone();
        swapped.swap(3, 3 + c.head_dim * 7);
        assert!(check_output(&c, &q, &k, &v, &swapped, &plan) > 0.0);
    }

    #[test]
    fn plan_samples_rows_with_extremes() {
        let c = AttentionCase {
            seq_len: 16384,
            ..small(true, Dtype::Bf16)
        };
        let p = CheckPlan::new(&c, 256, 1);
        assert_eq!(p.rows.len(), 256);
        assert_eq!(p.rows[0], 0);
        assert_eq!(*p.rows.last().unwrap(), 16383);
        assert!(p.slices.len() >= 2 && p.slices.len() <= 4);
        assert_eq!(p.slices[0], (0, 0));
        assert_eq!(*p.slices.last().unwrap(), (1, 1));
        let n = p.slices.len();
        assert!(p
            .describe(&c)
            .starts_with(&format!("{n} of 4 (batch, head) slices x 256 of 16384")));
    }
}
