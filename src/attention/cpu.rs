//! CPU attention: inputs, the float64 reference (forward, log-sum-exp and backward), a float32
//! model of the GPU flash kernel, and the accuracy check every implementation's outputs go
//! through.
//!
//! The reference is the definition of the module documentation, computed in float64 on the
//! exact inputs the device saw (so only the device's arithmetic is measured):
//! - forward: O_i = Σ_j P_ij V_j with P_ij = exp(s_ij − lse_i), s_ij = scale · Q_i·K_j over the
//!   keys row i sees, lse_i = log Σ_j exp(s_ij) (+∞ and O_i = 0 for a row that sees no key);
//! - backward, for the loss Σ dO ∘ O: D_i = dO_i·O_i, dP_ij = dO_i·V_j,
//!   dS_ij = P_ij (dP_ij − D_i), dQ_i = scale Σ_j dS_ij K_j, dK_j = scale Σ_(h,i) dS_ij Q_i and
//!   dV_j = Σ_(h,i) P_ij dO_i, the sums over (h, i) running over every query head h of the key's
//!   group (GQA) and every row i that sees key j (Dao 2023, FlashAttention-2, Algorithm 2).

use std::collections::BTreeSet;

use super::{rel_l2, worst_error, AttentionCase, Dtype, Pass};

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

fn threads() -> usize {
    std::thread::available_parallelism()
        .map_or(1, |t| t.get())
        .min(32)
}

/// `n` standard-normal values (Box–Muller) rounded to `dtype`, as words ([`Dtype`]).
/// Deterministic in `seed` and independent of the thread count: chunk i of 1 Mi elements draws
/// from seed ⊕ i.
pub fn normal_bits(n: usize, dtype: Dtype, seed: u64) -> Vec<u16> {
    const CHUNK: usize = 1 << 20;
    let w = dtype.words();
    let mut out = vec![0u16; n * w];
    let chunks: Vec<(usize, &mut [u16])> = out.chunks_mut(CHUNK * w).enumerate().collect();
    let per = chunks.len().div_ceil(threads()).max(1);
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
                    let len = chunk.len() / w;
                    let mut i = 0;
                    while i < len {
                        let u1 = uniform01(&mut st);
                        let u2 = uniform01(&mut st);
                        let r = (-2.0 * u1.ln()).sqrt();
                        let th = 2.0 * std::f64::consts::PI * u2;
                        dtype.encode((r * th.cos()) as f32, &mut chunk[i * w..(i + 1) * w]);
                        if i + 1 < len {
                            dtype.encode(
                                (r * th.sin()) as f32,
                                &mut chunk[(i + 1) * w..(i + 2) * w],
                            );
                        }
                        i += 2;
                    }
                }
            });
        }
    });
    out
}

/// One input set of a case, as words in the case's dtype (layouts in the module
/// documentation of `attention`).
#[derive(Clone, Debug, PartialEq)]
pub struct Inputs {
    /// Q, `[B, H, Tq, D]`.
    pub q: Vec<u16>,
    /// K, `[B, KVH, Tkv, D]`.
    pub k: Vec<u16>,
    /// V, `[B, KVH, Tkv, D]`.
    pub v: Vec<u16>,
    /// dO, the gradient of the loss with respect to O, `[B, H, Tq, D]`; empty for a
    /// forward-only case.
    pub dout: Vec<u16>,
}

impl Inputs {
    /// Standard normals rounded to the dtype: Q from `seed`, K from `seed + 1`, V from
    /// `seed + 2`, and dO from `seed + 3` when the case is forward + backward. The runner's
    /// inputs.
    pub fn random(c: &AttentionCase, seed: u64) -> Inputs {
        Inputs {
            q: normal_bits(c.q_elems(), c.dtype, seed),
            k: normal_bits(c.kv_elems(), c.dtype, seed.wrapping_add(1)),
            v: normal_bits(c.kv_elems(), c.dtype, seed.wrapping_add(2)),
            dout: if c.pass == Pass::FwdBwd {
                normal_bits(c.q_elems(), c.dtype, seed.wrapping_add(3))
            } else {
                Vec::new()
            },
        }
    }

    /// Every element set to one value per tensor (rounded to the dtype): for tests with known
    /// answers. dO is filled only for forward + backward.
    pub fn constant(c: &AttentionCase, q: f32, k: f32, v: f32, dout: f32) -> Inputs {
        let fill = |n: usize, x: f32| c.dtype.encode_all(&vec![x; n]);
        Inputs {
            q: fill(c.q_elems(), q),
            k: fill(c.kv_elems(), k),
            v: fill(c.kv_elems(), v),
            dout: if c.pass == Pass::FwdBwd {
                fill(c.q_elems(), dout)
            } else {
                Vec::new()
            },
        }
    }
}

/// Element offset of row 0 of query head (`b`, `h`) in Q, O, dO and dQ.
pub fn q_offset(c: &AttentionCase, b: usize, h: usize) -> usize {
    (b * c.heads + h) * c.seq_len_q * c.head_dim
}

/// Element offset of row 0 of key/value head (`b`, `g`) in K, V, dK and dV.
pub fn kv_offset(c: &AttentionCase, b: usize, g: usize) -> usize {
    (b * c.kv_heads + g) * c.seq_len_kv * c.head_dim
}

/// `a · b` with four partial sums (vectorisable; float64 keeps the error far below anything
/// measured here).
fn dot(a: &[f64], b: &[f64]) -> f64 {
    let mut s = [0.0f64; 4];
    let (ca, cb) = (a.chunks_exact(4), b.chunks_exact(4));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for k in 0..4 {
            s[k] += x[k] * y[k];
        }
    }
    let mut t = (s[0] + s[1]) + (s[2] + s[3]);
    for (x, y) in ra.iter().zip(rb) {
        t += x * y;
    }
    t
}

fn axpy(y: &mut [f64], a: f64, x: &[f64]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += a * xi;
    }
}

/// Where the float64 values of a case's tensors come from: the words of an input set (decoded
/// per head), or float64 tensors (tests: finite differences).
enum Source<'a> {
    Words(&'a Inputs),
    #[cfg_attr(not(test), allow(dead_code))]
    F64 {
        q: &'a [f64],
        k: &'a [f64],
        v: &'a [f64],
        dout: &'a [f64],
    },
}

/// One query head: Q and dO rows (`Tq × D`; dO empty for forward only).
struct QHead {
    q: Vec<f64>,
    dout: Vec<f64>,
}

/// One key/value head: K and V rows (`Tkv × D`).
struct KvHead {
    k: Vec<f64>,
    v: Vec<f64>,
}

impl Source<'_> {
    fn q_head(&self, c: &AttentionCase, b: usize, h: usize) -> QHead {
        let (o, n) = (q_offset(c, b, h), c.seq_len_q * c.head_dim);
        match self {
            Source::Words(inp) => {
                let dec = |w: &[u16]| {
                    if w.is_empty() {
                        Vec::new()
                    } else {
                        (o..o + n).map(|i| c.dtype.decode(w, i) as f64).collect()
                    }
                };
                QHead {
                    q: dec(&inp.q),
                    dout: dec(&inp.dout),
                }
            }
            Source::F64 { q, dout, .. } => QHead {
                q: q[o..o + n].to_vec(),
                dout: if dout.is_empty() {
                    Vec::new()
                } else {
                    dout[o..o + n].to_vec()
                },
            },
        }
    }

    fn kv_head(&self, c: &AttentionCase, b: usize, g: usize) -> KvHead {
        let (o, n) = (kv_offset(c, b, g), c.seq_len_kv * c.head_dim);
        match self {
            Source::Words(inp) => {
                let dec = |w: &[u16]| (o..o + n).map(|i| c.dtype.decode(w, i) as f64).collect();
                KvHead {
                    k: dec(&inp.k),
                    v: dec(&inp.v),
                }
            }
            Source::F64 { k, v, .. } => KvHead {
                k: k[o..o + n].to_vec(),
                v: v[o..o + n].to_vec(),
            },
        }
    }
}

/// Forward of one query row against its first `n` visible keys: (O_i, lse_i), and the
/// probabilities P_ij (j < n) left in `p`. O_i = V_0 + Σ_j P_ij (V_j − V_0), the same sum
/// shifted by the first visible value row, which makes a constant V exact.
fn row_forward(
    qi: &[f64],
    kv: &KvHead,
    n: usize,
    d: usize,
    scale: f64,
    p: &mut Vec<f64>,
) -> (Vec<f64>, f64) {
    p.clear();
    if n == 0 {
        return (vec![0.0; d], f64::INFINITY);
    }
    let mut m = f64::NEG_INFINITY;
    for j in 0..n {
        let s = scale * dot(qi, &kv.k[j * d..(j + 1) * d]);
        p.push(s);
        m = m.max(s);
    }
    let mut l = 0.0;
    for s in p.iter_mut() {
        *s = (*s - m).exp();
        l += *s;
    }
    for s in p.iter_mut() {
        *s /= l;
    }
    let v0 = &kv.v[0..d];
    let mut acc = vec![0.0f64; d];
    for (j, &pj) in p.iter().enumerate().skip(1) {
        let vj = &kv.v[j * d..(j + 1) * d];
        for e in 0..d {
            acc[e] += pj * (vj[e] - v0[e]);
        }
    }
    let o = (0..d).map(|e| v0[e] + acc[e]).collect();
    (o, m + l.ln())
}

/// dQ_i of one row from its probabilities `p` (from [`row_forward`]) and D_i.
fn row_dq(doi: &[f64], dsum: f64, kv: &KvHead, p: &[f64], d: usize, scale: f64) -> Vec<f64> {
    let mut dq = vec![0.0f64; d];
    for (j, &pj) in p.iter().enumerate() {
        let dp = dot(doi, &kv.v[j * d..(j + 1) * d]);
        axpy(&mut dq, scale * pj * (dp - dsum), &kv.k[j * d..(j + 1) * d]);
    }
    dq
}

/// Per-row statistics of one query head over all its rows: the backward's inputs for dK, dV.
struct HeadStats {
    head: QHead,
    lse: Vec<f64>,
    dsum: Vec<f64>,
}

/// Runs `f` over `items` split into contiguous chunks on all host threads; results in order.
fn par_map<T: Send>(items: &[usize], f: impl Fn(&[usize]) -> Vec<T> + Sync) -> Vec<T> {
    if items.is_empty() {
        return Vec::new();
    }
    let per = items.len().div_ceil(threads()).max(1);
    let f = &f;
    std::thread::scope(|s| {
        let handles: Vec<_> = items.chunks(per).map(|ch| s.spawn(move || f(ch))).collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("reference thread"))
            .collect()
    })
}

/// Query rows and keys per block of [`head_stats`].
const STAT_ROWS: usize = 64;
const STAT_KEYS: usize = 256;

/// The log-sum-exp and D_i = dO_i·O_i of every query row of head (`b`, `h`): what dK and dV
/// need of every row. Blocks of [`STAT_ROWS`] rows in parallel, each through blocks of
/// [`STAT_KEYS`] keys with float64 matrix products (S = scale·Q Kᵀ, then O += P V) and an
/// online softmax, so the T² · head_dim work of a long head runs at the `gemm` crate's rate.
fn head_stats(c: &AttentionCase, src: &Source<'_>, kv: &KvHead, b: usize, h: usize) -> HeadStats {
    let head = src.q_head(c, b, h);
    let blocks: Vec<usize> = (0..c.seq_len_q.div_ceil(STAT_ROWS)).collect();
    let stats: Vec<(f64, f64)> = par_map(&blocks, |bs| {
        bs.iter()
            .flat_map(|&k| {
                let i0 = k * STAT_ROWS;
                block_stats(c, &head, kv, b, i0, (i0 + STAT_ROWS).min(c.seq_len_q))
            })
            .collect()
    });
    HeadStats {
        head,
        lse: stats.iter().map(|s| s.0).collect(),
        dsum: stats.iter().map(|s| s.1).collect(),
    }
}

/// (log-sum-exp, dO_i·O_i) of query rows `i0..i1` of one head ([`head_stats`]); a row that
/// sees no key gives (+∞, 0).
fn block_stats(
    c: &AttentionCase,
    head: &QHead,
    kv: &KvHead,
    b: usize,
    i0: usize,
    i1: usize,
) -> Vec<(f64, f64)> {
    use super::cpu_flash::{matmul, Mat};
    let d = c.head_dim;
    let rows = i1 - i0;
    let seen: Vec<usize> = (i0..i1).map(|i| c.visible_keys(b, i)).collect();
    let most = seen.iter().copied().max().unwrap_or(0);
    let mut m = vec![f64::NEG_INFINITY; rows];
    let mut l = vec![0.0f64; rows];
    let mut o = vec![0.0f64; rows * d];
    let mut p = vec![0.0f64; rows * STAT_KEYS];
    let q = &head.q[i0 * d..i1 * d];
    for j0 in (0..most).step_by(STAT_KEYS) {
        let bk = STAT_KEYS.min(most - j0);
        let k_t = Mat {
            data: &kv.k[j0 * d..(j0 + bk) * d],
            rs: 1,
            cs: d,
        };
        matmul(rows, bk, d, &mut p, false, Mat::row_major(q, d), k_t);
        for r in 0..rows {
            let row = &mut p[r * bk..(r + 1) * bk];
            let visible = seen[r].saturating_sub(j0).min(bk);
            if visible == 0 {
                row.fill(0.0);
                continue;
            }
            let mut top = m[r];
            for x in row[..visible].iter_mut() {
                *x *= c.scale();
                top = top.max(*x);
            }
            for x in row[..visible].iter_mut() {
                *x = (*x - top).exp();
            }
            row[visible..].fill(0.0);
            let alpha = (m[r] - top).exp();
            l[r] = l[r] * alpha + row[..visible].iter().sum::<f64>();
            for e in &mut o[r * d..(r + 1) * d] {
                *e *= alpha;
            }
            m[r] = top;
        }
        let v = Mat::row_major(&kv.v[j0 * d..(j0 + bk) * d], d);
        matmul(rows, d, bk, &mut o, true, Mat::row_major(&p, bk), v);
    }
    (0..rows)
        .map(|r| {
            if seen[r] == 0 {
                return (f64::INFINITY, 0.0);
            }
            let doi = &head.dout[(i0 + r) * d..(i0 + r + 1) * d];
            (m[r] + l[r].ln(), dot(doi, &o[r * d..(r + 1) * d]) / l[r])
        })
        .collect()
}

/// dK_j and dV_j of key `j` of kv head (`b`, ·) from the statistics of every query head of its
/// group.
fn key_grads(
    c: &AttentionCase,
    b: usize,
    j: usize,
    kv: &KvHead,
    heads: &[HeadStats],
) -> (Vec<f64>, Vec<f64>) {
    let d = c.head_dim;
    let (kj, vj) = (&kv.k[j * d..(j + 1) * d], &kv.v[j * d..(j + 1) * d]);
    let (mut dk, mut dv) = (vec![0.0f64; d], vec![0.0f64; d]);
    for hs in heads {
        for i in 0..c.seq_len_q {
            if c.visible_keys(b, i) <= j {
                continue;
            }
            let qi = &hs.head.q[i * d..(i + 1) * d];
            let doi = &hs.head.dout[i * d..(i + 1) * d];
            let p = (c.scale() * dot(qi, kj) - hs.lse[i]).exp();
            axpy(&mut dv, p, doi);
            let ds = p * (dot(doi, vj) - hs.dsum[i]);
            axpy(&mut dk, c.scale() * ds, qi);
        }
    }
    (dk, dv)
}

/// Which slices and rows an accuracy check covers.
#[derive(Clone, Debug, PartialEq)]
pub struct CheckPlan {
    /// (batch, head) slices of O and dQ.
    pub slices: Vec<(usize, usize)>,
    /// Query rows, ascending, the same for every slice.
    pub rows: Vec<usize>,
    /// (batch, kv head) slices of dK and dV: those the query slices read.
    pub kv_slices: Vec<(usize, usize)>,
    /// Key rows, ascending, the same for every kv slice.
    pub key_rows: Vec<usize>,
}

/// Every index below `n` when n ≤ `max`, else `max` distinct ones drawn from `seed` that
/// always include 0, n − 1 and `extra` (those below n).
fn sample_rows(n: usize, max: usize, seed: u64, extra: &[usize]) -> Vec<usize> {
    if n <= max {
        return (0..n).collect();
    }
    let mut set = BTreeSet::from([0, n - 1]);
    set.extend(extra.iter().copied().filter(|&x| x < n));
    let mut st = seed;
    while set.len() < max.max(2) {
        set.insert((splitmix64(&mut st) % n as u64) as usize);
    }
    set.into_iter().collect()
}

impl CheckPlan {
    /// The first and the last (batch, head) slice plus two drawn from `seed` (up to four
    /// distinct), and the kv heads they read; query rows by [`sample_rows`]-style sampling
    /// (every row when seq_len_q ≤ `max_rows`, else `max_rows` rows including 0 and the last);
    /// key rows likewise, including the last valid key and the first padded one of every
    /// `kv_lens` entry.
    pub fn new(c: &AttentionCase, max_rows: usize, seed: u64) -> CheckPlan {
        let n = c.batch * c.heads;
        let mut set = BTreeSet::from([0, n - 1]);
        let mut st = seed ^ 0x51ce;
        for _ in 0..2 {
            set.insert((splitmix64(&mut st) % n as u64) as usize);
        }
        let slices: Vec<(usize, usize)> = set
            .into_iter()
            .map(|i| (i / c.heads, i % c.heads))
            .collect();
        let bounds: Vec<usize> = c
            .kv_lens
            .iter()
            .flatten()
            .flat_map(|&l| [l.saturating_sub(1), l])
            .collect();
        CheckPlan::with_slices(
            c,
            slices,
            sample_rows(c.seq_len_q, max_rows, seed, &[]),
            sample_rows(c.seq_len_kv, max_rows, seed ^ 0x6b65, &bounds),
        )
    }

    /// Every slice and every row: the whole output (small cases).
    pub fn full(c: &AttentionCase) -> CheckPlan {
        let slices = (0..c.batch)
            .flat_map(|b| (0..c.heads).map(move |h| (b, h)))
            .collect();
        CheckPlan::with_slices(
            c,
            slices,
            (0..c.seq_len_q).collect(),
            (0..c.seq_len_kv).collect(),
        )
    }

    /// The given (batch, head) slices (row-major `[B, H]` indices, every one `< (batch,
    /// heads)`), query rows and key rows, ascending; the kv slices are those the query slices
    /// read (`h / group`).
    pub fn with_slices(
        c: &AttentionCase,
        slices: Vec<(usize, usize)>,
        rows: Vec<usize>,
        key_rows: Vec<usize>,
    ) -> CheckPlan {
        let kv: BTreeSet<(usize, usize)> =
            slices.iter().map(|&(b, h)| (b, h / c.group())).collect();
        CheckPlan {
            slices,
            rows,
            kv_slices: kv.into_iter().collect(),
            key_rows,
        }
    }

    /// Description for `Accuracy::checked`.
    pub fn describe(&self, c: &AttentionCase) -> String {
        let q = format!(
            "{} of {} (batch, head) slices x {} of {} query rows",
            self.slices.len(),
            c.batch * c.heads,
            self.rows.len(),
            c.seq_len_q
        );
        match c.pass {
            Pass::Fwd => q,
            Pass::FwdBwd => format!(
                "O and dQ: {q}; dK and dV: {} of {} (batch, kv head) slices x {} of {} key rows",
                self.kv_slices.len(),
                c.batch * c.kv_heads,
                self.key_rows.len(),
                c.seq_len_kv
            ),
        }
    }

    /// The checked elements of O (and of dQ) as `[start, len]` ranges of flat
    /// `[B, H, Tq, D]` indices, one per (slice, row), in the order of [`References::o`].
    pub fn ranges(&self, c: &AttentionCase) -> Vec<[u64; 2]> {
        let d = c.head_dim as u64;
        self.slices
            .iter()
            .flat_map(|&(b, h)| {
                let o = q_offset(c, b, h) as u64;
                self.rows.iter().map(move |&i| [o + i as u64 * d, d])
            })
            .collect()
    }

    /// The checked elements of dK and dV as ranges of flat `[B, KVH, Tkv, D]` indices, one per
    /// (kv slice, key row), in the order of [`References::dk`].
    pub fn kv_ranges(&self, c: &AttentionCase) -> Vec<[u64; 2]> {
        let d = c.head_dim as u64;
        self.kv_slices
            .iter()
            .flat_map(|&(b, g)| {
                let o = kv_offset(c, b, g) as u64;
                self.key_rows.iter().map(move |&j| [o + j as u64 * d, d])
            })
            .collect()
    }
}

/// Float64 reference values of a plan's elements.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct References {
    /// O at [`CheckPlan::ranges`].
    pub o: Vec<f64>,
    /// Log-sum-exp (natural log, +∞ for a row that sees no key) of each (slice, row) of the
    /// plan, in the order of its ranges.
    pub lse: Vec<f64>,
    /// dQ at [`CheckPlan::ranges`] (forward + backward only).
    pub dq: Vec<f64>,
    /// dK at [`CheckPlan::kv_ranges`] (forward + backward only).
    pub dk: Vec<f64>,
    /// dV at [`CheckPlan::kv_ranges`] (forward + backward only).
    pub dv: Vec<f64>,
}

impl References {
    /// Appends the (O row, lse, dQ row) of each checked query row, in plan order.
    fn push_rows(&mut self, rows: Vec<(Vec<f64>, f64, Vec<f64>)>) {
        for (o, lse, dq) in rows {
            self.o.extend(o);
            self.lse.push(lse);
            self.dq.extend(dq);
        }
    }
}

fn references(c: &AttentionCase, src: &Source<'_>, plan: &CheckPlan) -> References {
    let d = c.head_dim;
    let bwd = c.pass == Pass::FwdBwd;
    let mut r = References::default();
    for &(b, h) in &plan.slices {
        let head = src.q_head(c, b, h);
        let kv = src.kv_head(c, b, h / c.group());
        let rows: Vec<(Vec<f64>, f64, Vec<f64>)> = par_map(&plan.rows, |rs| {
            let mut p = Vec::new();
            rs.iter()
                .map(|&i| {
                    let n = c.visible_keys(b, i);
                    let (o, lse) =
                        row_forward(&head.q[i * d..(i + 1) * d], &kv, n, d, c.scale(), &mut p);
                    let dq = if bwd {
                        let doi = &head.dout[i * d..(i + 1) * d];
                        row_dq(doi, dot(doi, &o), &kv, &p, d, c.scale())
                    } else {
                        Vec::new()
                    };
                    (o, lse, dq)
                })
                .collect()
        });
        r.push_rows(rows);
    }
    if bwd {
        for &(b, g) in &plan.kv_slices {
            let kv = src.kv_head(c, b, g);
            let heads: Vec<HeadStats> = (g * c.group()..(g + 1) * c.group())
                .map(|h| head_stats(c, src, &kv, b, h))
                .collect();
            let grads: Vec<(Vec<f64>, Vec<f64>)> = par_map(&plan.key_rows, |js| {
                js.iter()
                    .map(|&j| key_grads(c, b, j, &kv, &heads))
                    .collect()
            });
            for (dk, dv) in grads {
                r.dk.extend(dk);
                r.dv.extend(dv);
            }
        }
    }
    r
}

/// Float64 reference values of the plan's elements (O and the log-sum-exp; dQ, dK and dV for
/// forward + backward), computed on all host threads from the input words.
pub fn reference_values(c: &AttentionCase, inp: &Inputs, plan: &CheckPlan) -> References {
    references(c, &Source::Words(inp), plan)
}

/// A mask and score modification the reference applies (flex_attention's `mask_mod` and
/// `score_mod`, He et al. 2024): which keys a query row sees and what its raw score
/// `scale · Q_i·K_j` becomes. The reference of [`modified_reference_values`] takes one.
pub trait ScoreRule: Sync {
    /// Whether query row `i` of head (`b`, `h`) sees key `j` (keys at or past the batch
    /// entry's key length are never seen, whatever this says).
    fn visible(&self, b: usize, h: usize, i: usize, j: usize) -> bool;
    /// The modified score of raw score `raw` (natural units).
    fn modify(&self, raw: f64, h: usize, i: usize, j: usize) -> f64;
    /// d modify / d raw at `raw`.
    fn derivative(&self, raw: f64, h: usize, i: usize, j: usize) -> f64;
}

/// Forward of query row `i` of head (`b`, `h`) under `rule`: (O_i, lse_i) and the (key,
/// probability, d modify/d raw) of every key it sees. A row that sees no key gives O_i = 0
/// and lse_i = +∞.
#[allow(clippy::type_complexity)]
fn rule_row(
    c: &AttentionCase,
    rule: &dyn ScoreRule,
    (b, h, i): (usize, usize, usize),
    qi: &[f64],
    kv: &KvHead,
) -> (Vec<f64>, f64, Vec<(usize, f64, f64)>) {
    let d = c.head_dim;
    let mut seen: Vec<(usize, f64, f64)> = Vec::new();
    let mut m = f64::NEG_INFINITY;
    for j in 0..c.kv_len(b) {
        if rule.visible(b, h, i, j) {
            let raw = c.scale() * dot(qi, &kv.k[j * d..(j + 1) * d]);
            let s = rule.modify(raw, h, i, j);
            m = m.max(s);
            seen.push((j, s, rule.derivative(raw, h, i, j)));
        }
    }
    if seen.is_empty() {
        return (vec![0.0; d], f64::INFINITY, seen);
    }
    let mut l = 0.0;
    for e in seen.iter_mut() {
        e.1 = (e.1 - m).exp();
        l += e.1;
    }
    let mut o = vec![0.0f64; d];
    for e in seen.iter_mut() {
        e.1 /= l;
        axpy(&mut o, e.1, &kv.v[e.0 * d..(e.0 + 1) * d]);
    }
    (o, m + l.ln(), seen)
}

/// Float64 reference values of the plan's elements under `rule` (O and the log-sum-exp; dQ, dK
/// and dV for forward + backward), computed on all host threads from the input words. The
/// definitions of the module documentation with s_ij = modify(scale · Q_i·K_j) over the keys
/// `rule` leaves visible, and dS_ij multiplied by d modify/d raw before it reaches dQ and dK.
///
/// # Panics
/// Where `rule` panics (e.g. a document mask given fewer document ids than the shape has
/// positions).
pub fn modified_reference_values(
    c: &AttentionCase,
    inp: &Inputs,
    plan: &CheckPlan,
    rule: &dyn ScoreRule,
) -> References {
    let d = c.head_dim;
    let bwd = c.pass == Pass::FwdBwd;
    let src = Source::Words(inp);
    let mut r = References::default();
    for &(b, h) in &plan.slices {
        let head = src.q_head(c, b, h);
        let kv = src.kv_head(c, b, h / c.group());
        let rows: Vec<(Vec<f64>, f64, Vec<f64>)> = par_map(&plan.rows, |rs| {
            rs.iter()
                .map(|&i| {
                    let (o, lse, seen) =
                        rule_row(c, rule, (b, h, i), &head.q[i * d..(i + 1) * d], &kv);
                    let mut dq = Vec::new();
                    if bwd {
                        let doi = &head.dout[i * d..(i + 1) * d];
                        let dsum = dot(doi, &o);
                        dq = vec![0.0f64; d];
                        for &(j, p, dmod) in &seen {
                            let dp = dot(doi, &kv.v[j * d..(j + 1) * d]);
                            let ds = p * (dp - dsum) * dmod;
                            axpy(&mut dq, c.scale() * ds, &kv.k[j * d..(j + 1) * d]);
                        }
                    }
                    (o, lse, dq)
                })
                .collect()
        });
        r.push_rows(rows);
    }
    if bwd {
        for &(b, g) in &plan.kv_slices {
            let kv = src.kv_head(c, b, g);
            // Per query head of the group: its rows, lse_i and D_i = dO_i·O_i.
            let heads: Vec<(usize, HeadStats)> = (g * c.group()..(g + 1) * c.group())
                .map(|h| {
                    let head = src.q_head(c, b, h);
                    let all: Vec<usize> = (0..c.seq_len_q).collect();
                    let stats: Vec<(f64, f64)> = par_map(&all, |rs| {
                        rs.iter()
                            .map(|&i| {
                                let (o, lse, _) =
                                    rule_row(c, rule, (b, h, i), &head.q[i * d..(i + 1) * d], &kv);
                                (lse, dot(&head.dout[i * d..(i + 1) * d], &o))
                            })
                            .collect()
                    });
                    let hs = HeadStats {
                        head,
                        lse: stats.iter().map(|s| s.0).collect(),
                        dsum: stats.iter().map(|s| s.1).collect(),
                    };
                    (h, hs)
                })
                .collect();
            let grads: Vec<(Vec<f64>, Vec<f64>)> = par_map(&plan.key_rows, |js| {
                js.iter()
                    .map(|&j| {
                        let (mut dk, mut dv) = (vec![0.0f64; d], vec![0.0f64; d]);
                        if j >= c.kv_len(b) {
                            return (dk, dv);
                        }
                        let (kj, vj) = (&kv.k[j * d..(j + 1) * d], &kv.v[j * d..(j + 1) * d]);
                        for (h, hs) in &heads {
                            for i in 0..c.seq_len_q {
                                if !rule.visible(b, *h, i, j) {
                                    continue;
                                }
                                let qi = &hs.head.q[i * d..(i + 1) * d];
                                let doi = &hs.head.dout[i * d..(i + 1) * d];
                                let raw = c.scale() * dot(qi, kj);
                                let p = (rule.modify(raw, *h, i, j) - hs.lse[i]).exp();
                                axpy(&mut dv, p, doi);
                                let ds = p * (dot(doi, vj) - hs.dsum[i]);
                                axpy(&mut dk, c.scale() * ds * rule.derivative(raw, *h, i, j), qi);
                            }
                        }
                        (dk, dv)
                    })
                    .collect()
            });
            for (dk, dv) in grads {
                r.dk.extend(dk);
                r.dv.extend(dv);
            }
        }
    }
    r
}

/// The whole float64 forward O, `[B, H, Tq, D]`, and log-sum-exp, `[B, H, Tq]` (small shapes).
pub fn forward_f64(c: &AttentionCase, inp: &Inputs) -> (Vec<f64>, Vec<f64>) {
    let fwd = AttentionCase {
        pass: Pass::Fwd,
        ..c.clone()
    };
    let r = reference_values(&fwd, inp, &CheckPlan::full(c));
    (r.o, r.lse)
}

/// The whole float64 gradients (dQ `[B, H, Tq, D]`, dK and dV `[B, KVH, Tkv, D]`) of the loss
/// Σ dO ∘ O (small shapes). `c.pass` must be forward + backward (dO is an input).
pub fn backward_f64(c: &AttentionCase, inp: &Inputs) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    assert_eq!(c.pass, Pass::FwdBwd, "backward_f64 needs dO");
    let r = reference_values(c, inp, &CheckPlan::full(c));
    (r.dq, r.dk, r.dv)
}

/// The elements of `words` (in `dtype`) at `ranges`, as float64, concatenated.
pub fn gather(dtype: Dtype, words: &[u16], ranges: &[[u64; 2]]) -> Vec<f64> {
    ranges
        .iter()
        .flat_map(|&[start, len]| {
            (start..start + len).map(|i| dtype.decode(words, i as usize) as f64)
        })
        .collect()
}

/// An implementation's outputs as words in the case's dtype (dQ, dK, dV empty for forward
/// only).
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Outputs {
    /// O, `[B, H, Tq, D]`.
    pub o: Vec<u16>,
    /// dQ, `[B, H, Tq, D]`.
    pub dq: Vec<u16>,
    /// dK, `[B, KVH, Tkv, D]`.
    pub dk: Vec<u16>,
    /// dV, `[B, KVH, Tkv, D]`.
    pub dv: Vec<u16>,
}

/// Relative L2 errors of each output against the float64 reference over a plan.
#[derive(Clone, Debug, PartialEq)]
pub struct Errors {
    /// Error of O.
    pub o: f64,
    /// Errors of dQ, dK and dV (forward + backward only).
    pub grads: Option<[f64; 3]>,
}

impl Errors {
    /// The largest error, NaN when any is NaN ([`worst_error`]).
    pub fn worst(&self) -> f64 {
        worst_error(std::iter::once(self.o).chain(self.grads.into_iter().flatten()))
    }
}

/// Relative L2 error of every output over the plan; NaN for an output with a non-finite
/// element anywhere (not only at the checked elements: an unwritten, poisoned element fails).
pub fn check_outputs(
    c: &AttentionCase,
    refs: &References,
    out: &Outputs,
    plan: &CheckPlan,
) -> Errors {
    let err = |words: &[u16], ranges: &[[u64; 2]], want: &[f64]| {
        let n = words.len() / c.dtype.words();
        if (0..n).any(|i| !c.dtype.decode(words, i).is_finite()) {
            return f64::NAN;
        }
        rel_l2(&gather(c.dtype, words, ranges), want)
    };
    let (q_ranges, kv_ranges) = (plan.ranges(c), plan.kv_ranges(c));
    Errors {
        o: err(&out.o, &q_ranges, &refs.o),
        grads: (c.pass == Pass::FwdBwd).then(|| {
            [
                err(&out.dq, &q_ranges, &refs.dq),
                err(&out.dk, &kv_ranges, &refs.dk),
                err(&out.dv, &kv_ranges, &refs.dv),
            ]
        }),
    }
}

/// Relative L2 error of the output O (words, `[B, H, Tq, D]`) against the float64 reference
/// over the plan's slices and rows; NaN when any element of `out` is non-finite.
pub fn check_output(c: &AttentionCase, inp: &Inputs, out: &[u16], plan: &CheckPlan) -> f64 {
    let fwd = AttentionCase {
        pass: Pass::Fwd,
        ..c.clone()
    };
    let refs = reference_values(&fwd, inp, plan);
    let outs = Outputs {
        o: out.to_vec(),
        ..Outputs::default()
    };
    check_outputs(&fwd, &refs, &outs, plan).o
}

/// A float32 model of the GPU flash forward for one (batch, head) slice: the same tiling
/// (`bc` keys per step), masks (partial last tile, bottom-right causal, key lengths), the
/// base-2 online softmax with its guard for rows that have seen no key yet, and P rounded to
/// the 16-bit dtype before P·V. Used to test the algorithm on the CPU; returns `Tq × D`
/// values.
pub fn flash_slice_f32(c: &AttentionCase, inp: &Inputs, b: usize, h: usize, bc: usize) -> Vec<f32> {
    let (tq, d) = (c.seq_len_q, c.head_dim);
    let (qo, kvo) = (q_offset(c, b, h), kv_offset(c, b, h / c.group()));
    let f = |w: &[u16], i: usize| c.dtype.decode(w, i);
    let round16 = |p: f32| match c.dtype {
        Dtype::F32 => p,
        dt => dt.from_bits(dt.to_bits(p)),
    };
    let scale_log2 = (c.scale() * std::f64::consts::LOG2_E) as f32;
    let l_b = c.kv_len(b);
    let mut out = vec![0.0f32; tq * d];
    for i in 0..tq {
        let lim = c.visible_keys(b, i);
        let (mut m, mut l) = (f32::NEG_INFINITY, 0.0f32);
        let mut acc = vec![0.0f32; d];
        let mut j0 = 0;
        // Every tile up to the key length is visited; masked keys score −∞.
        while j0 < l_b {
            let j1 = (j0 + bc).min(l_b);
            let s: Vec<f32> = (j0..j1)
                .map(|j| {
                    if j >= lim {
                        return f32::NEG_INFINITY;
                    }
                    let dot: f32 = (0..d)
                        .map(|e| f(&inp.q, qo + i * d + e) * f(&inp.k, kvo + j * d + e))
                        .sum();
                    dot * scale_log2
                })
                .collect();
            let mx = s.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let m_new = m.max(mx);
            // The guard: while a row has seen no key, subtract 0 instead of −∞ (−∞ − −∞ is NaN).
            let m_use = if m_new == f32::NEG_INFINITY {
                0.0
            } else {
                m_new
            };
            let alpha = (m - m_use).exp2();
            l *= alpha;
            for a in acc.iter_mut() {
                *a *= alpha;
            }
            for (jj, sj) in s.iter().enumerate() {
                let p = (sj - m_use).exp2();
                l += p;
                let p16 = round16(p);
                for (e, a) in acc.iter_mut().enumerate() {
                    *a += p16 * f(&inp.v, kvo + (j0 + jj) * d + e);
                }
            }
            m = m_new;
            j0 = j1;
        }
        let inv = if l > 0.0 { 1.0 / l } else { 0.0 };
        for e in 0..d {
            out[i * d + e] = acc[e] * inv;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The blocked statistics (float64 products, online softmax) against one row at a time
    /// through `row_forward`: causal with more queries than keys (empty rows), key lengths
    /// with 0 and 1, GQA, and lengths past one block of rows and of keys.
    #[test]
    fn blocked_head_statistics_equal_the_row_by_row_ones() {
        let cases = [
            AttentionCase {
                causal: true,
                seq_len_q: 300,
                seq_len_kv: 130,
                pass: Pass::FwdBwd,
                ..AttentionCase::new(1, 2, 1, 16)
            },
            AttentionCase {
                kv_lens: Some(vec![600, 0, 1]),
                seq_len_q: 70,
                seq_len_kv: 600,
                pass: Pass::FwdBwd,
                ..AttentionCase::new(3, 4, 1, 8)
            },
            AttentionCase {
                kv_heads: 2,
                causal: true,
                pass: Pass::FwdBwd,
                ..AttentionCase::new(1, 4, 517, 32)
            },
        ];
        for (n, c) in cases.iter().enumerate() {
            let inp = Inputs::random(c, 40 + n as u64);
            let src = Source::Words(&inp);
            let d = c.head_dim;
            for b in 0..c.batch {
                for h in 0..c.heads {
                    let kv = src.kv_head(c, b, h / c.group());
                    let got = head_stats(c, &src, &kv, b, h);
                    let mut p = Vec::new();
                    for i in 0..c.seq_len_q {
                        let n_i = c.visible_keys(b, i);
                        let qi = &got.head.q[i * d..(i + 1) * d];
                        let (o, lse) = row_forward(qi, &kv, n_i, d, c.scale(), &mut p);
                        let dsum = dot(&got.head.dout[i * d..(i + 1) * d], &o);
                        let (gl, gd) = (got.lse[i], got.dsum[i]);
                        if n_i == 0 {
                            assert!(gl == f64::INFINITY && gd == 0.0, "case {n} row {i}");
                            continue;
                        }
                        assert!(
                            (gl - lse).abs() <= 1e-12 * lse.abs().max(1.0),
                            "case {n} b {b} h {h} row {i}: lse {gl} vs {lse}"
                        );
                        assert!(
                            (gd - dsum).abs() <= 1e-12 * dsum.abs().max(1.0),
                            "case {n} b {b} h {h} row {i}: D {gd} vs {dsum}"
                        );
                    }
                }
            }
        }
    }

    fn small(causal: bool, dtype: Dtype) -> AttentionCase {
        AttentionCase {
            kv_heads: 1,
            causal,
            dtype,
            ..AttentionCase::new(2, 2, 96, 16)
        }
    }

    #[test]
    fn normals_are_deterministic_and_standard() {
        for dtype in [Dtype::Bf16, Dtype::F32] {
            let a = normal_bits(3_000_001, dtype, 7);
            assert_eq!(a.len(), 3_000_001 * dtype.words());
            assert_eq!(a, normal_bits(3_000_001, dtype, 7));
            assert_ne!(a, normal_bits(3_000_001, dtype, 8));
            let xs = dtype.decode_all(&a);
            let mean = xs.iter().sum::<f64>() / xs.len() as f64;
            let var = xs.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / xs.len() as f64;
            assert!(mean.abs() < 0.01, "mean {mean}");
            assert!((var - 1.0).abs() < 0.02, "var {var}");
            assert!(
                xs.iter().filter(|&&x| x == 0.0).count() < 100,
                "inputs are never zeros"
            );
        }
        // bf16 and fp32 draw the same normals (rounded differently).
        let b = Dtype::Bf16.decode_all(&normal_bits(10, Dtype::Bf16, 3));
        let f = Dtype::F32.decode_all(&normal_bits(10, Dtype::F32, 3));
        for (x, y) in b.iter().zip(&f) {
            assert!((x - y).abs() <= y.abs() / 128.0, "{x} {y}");
        }
    }

    #[test]
    fn causal_first_row_is_first_value_row() {
        let c = small(true, Dtype::Bf16);
        let inp = Inputs::random(&c, 1);
        let (o, lse) = forward_f64(&c, &inp);
        for (e, &x) in o.iter().take(c.head_dim).enumerate() {
            assert_eq!(x, c.dtype.decode(&inp.v, e) as f64);
        }
        // lse of row 0 is its single score.
        let s: f64 = (0..c.head_dim)
            .map(|e| c.dtype.decode(&inp.q, e) as f64 * c.dtype.decode(&inp.k, e) as f64)
            .sum::<f64>()
            * c.scale();
        assert!((lse[0] - s).abs() < 1e-12);
    }

    /// Issue 9 §2: Q = 0, seq_len_q = 2, seq_len_kv = 5, causal: row 0 = mean(V0..V3),
    /// row 1 = mean(V0..V4).
    #[test]
    fn bottom_right_causal_averages_the_visible_values() {
        let c = AttentionCase {
            seq_len_q: 2,
            seq_len_kv: 5,
            causal: true,
            ..AttentionCase::new(1, 1, 1, 8)
        };
        let mut inp = Inputs::random(&c, 2);
        inp.q = c.dtype.encode_all(&vec![0.0; c.q_elems()]);
        let (o, _) = forward_f64(&c, &inp);
        let v = c.dtype.decode_all(&inp.v);
        for (row, n) in [(0, 4), (1, 5)] {
            for e in 0..8 {
                let mean = (0..n).map(|j| v[j * 8 + e]).sum::<f64>() / n as f64;
                assert!((o[row * 8 + e] - mean).abs() < 1e-12, "row {row}");
            }
        }
    }

    /// Issue 9 §2: seq_len_q = 5 > seq_len_kv = 2, causal: rows 0–2 see no key and are exactly
    /// 0 (not NaN), with gradient 0; rows 3 and 4 are the usual causal rows.
    #[test]
    fn rows_that_see_no_key_are_zero() {
        let c = AttentionCase {
            seq_len_q: 5,
            seq_len_kv: 2,
            causal: true,
            pass: Pass::FwdBwd,
            ..AttentionCase::new(1, 2, 1, 8)
        };
        let inp = Inputs::random(&c, 3);
        let (o, lse) = forward_f64(&c, &inp);
        for h in 0..2 {
            let base = h * 5 * 8;
            assert!(o[base..base + 3 * 8].iter().all(|&x| x == 0.0));
            assert!(lse[h * 5..h * 5 + 3].iter().all(|&x| x == f64::INFINITY));
            for e in 0..8 {
                // Row 3 sees key 0 of its kv head only.
                assert_eq!(
                    o[base + 3 * 8 + e],
                    c.dtype.decode(&inp.v, h * 2 * 8 + e) as f64
                );
            }
            assert!(o[base + 4 * 8..base + 5 * 8].iter().all(|x| x.is_finite()));
        }
        let (dq, dk, dv) = backward_f64(&c, &inp);
        assert!(dq[..3 * 8].iter().all(|&x| x == 0.0));
        assert!(dq.iter().chain(&dk).chain(&dv).all(|x| x.is_finite()));
        // Key 1 is seen only by row 4.
        assert!(dv[8..16].iter().any(|&x| x != 0.0));
    }

    /// Issue 9 §2: V of kv head j filled with j → output of query head h is exactly
    /// ⌊h / group⌋, whatever Q and K are.
    #[test]
    fn gqa_heads_read_their_kv_head() {
        let c = AttentionCase {
            kv_heads: 4,
            causal: true,
            ..AttentionCase::new(2, 12, 33, 16)
        };
        let mut inp = Inputs::random(&c, 4);
        let per_head = c.seq_len_kv * c.head_dim;
        let vals: Vec<f32> = (0..c.kv_elems())
            .map(|i| ((i / per_head) % c.kv_heads) as f32)
            .collect();
        inp.v = c.dtype.encode_all(&vals);
        let (o, _) = forward_f64(&c, &inp);
        let per_q = c.seq_len_q * c.head_dim;
        for (i, &x) in o.iter().enumerate() {
            let h = (i / per_q) % c.heads;
            assert_eq!(x, (h / c.group()) as f64, "element {i}");
        }
    }

    /// Issue 9 §2: fp16 Q = K = 24.0 with head_dim 128: raw dot products 73 728 overflow fp16
    /// (max 65 504); the reference does not, and the result is the mean of V.
    #[test]
    fn fp16_overflowing_scores_give_the_mean_of_v() {
        let c = AttentionCase {
            dtype: Dtype::F16,
            ..AttentionCase::new(1, 2, 40, 128)
        };
        let mut inp = Inputs::constant(&c, 24.0, 24.0, 0.0, 0.0);
        inp.v = normal_bits(c.kv_elems(), c.dtype, 5);
        assert!(half::f16::from_f32(24.0 * 24.0 * 128.0).is_infinite());
        let (o, _) = forward_f64(&c, &inp);
        let v = c.dtype.decode_all(&inp.v);
        for h in 0..2 {
            for e in 0..128 {
                let mean = (0..40).map(|j| v[(h * 40 + j) * 128 + e]).sum::<f64>() / 40.0;
                for i in [0, 39] {
                    let x = o[(h * 40 + i) * 128 + e];
                    assert!(x.is_finite() && (x - mean).abs() < 1e-12, "{x} vs {mean}");
                }
            }
        }
    }

    #[test]
    fn variable_key_lengths_mask_the_padding() {
        let c = AttentionCase {
            seq_len_q: 6,
            seq_len_kv: 9,
            kv_lens: Some(vec![9, 0, 1, 4]),
            pass: Pass::FwdBwd,
            ..AttentionCase::new(4, 2, 1, 8)
        };
        let inp = Inputs::random(&c, 6);
        let (o, _) = forward_f64(&c, &inp);
        let (dq, dk, dv) = backward_f64(&c, &inp);
        let q_len = c.heads * 6 * 8;
        let kv_len = c.kv_heads * 9 * 8;
        // Zero-length entry: output and every gradient 0.
        assert!(o[q_len..2 * q_len].iter().all(|&x| x == 0.0));
        assert!(dq[q_len..2 * q_len].iter().all(|&x| x == 0.0));
        assert!(dk[kv_len..2 * kv_len].iter().all(|&x| x == 0.0));
        // One key: every row is V's first row of that entry.
        let v = c.dtype.decode_all(&inp.v);
        for h in 0..2 {
            for i in 0..6 {
                for e in 0..8 {
                    let got = o[2 * q_len + (h * 6 + i) * 8 + e];
                    assert_eq!(got, v[2 * kv_len + h * 9 * 8 + e]);
                }
            }
        }
        // Padded keys (beyond L = 4 in entry 3) get no gradient.
        for g in 0..2 {
            let base = 3 * kv_len + g * 9 * 8;
            assert!(dk[base + 4 * 8..base + 9 * 8].iter().all(|&x| x == 0.0));
            assert!(dv[base + 4 * 8..base + 9 * 8].iter().all(|&x| x == 0.0));
            assert!(dv[base..base + 4 * 8].iter().any(|&x| x != 0.0));
        }
        // The same as running entry 3 alone with 4 keys.
        let alone = AttentionCase {
            batch: 1,
            seq_len_kv: 4,
            kv_lens: None,
            ..c.clone()
        };
        let take = |w: &[u16], start: usize, rows: usize, stride: usize, heads: usize| {
            let mut out = Vec::new();
            for h in 0..heads {
                out.extend_from_slice(&w[start + h * stride..start + h * stride + rows * 8]);
            }
            out
        };
        let inp1 = Inputs {
            q: inp.q[3 * q_len..4 * q_len].to_vec(),
            dout: inp.dout[3 * q_len..4 * q_len].to_vec(),
            k: take(&inp.k, 3 * kv_len, 4, 9 * 8, 2),
            v: take(&inp.v, 3 * kv_len, 4, 9 * 8, 2),
        };
        let (o1, _) = forward_f64(&alone, &inp1);
        let (_, dk1, _) = backward_f64(&alone, &inp1);
        assert_eq!(&o[3 * q_len..4 * q_len], &o1[..]);
        assert_eq!(&dk[3 * kv_len..3 * kv_len + 4 * 8], &dk1[..4 * 8]);
    }

    #[test]
    fn scale_is_a_parameter() {
        let c = AttentionCase::new(1, 1, 9, 16);
        let inp = Inputs::random(&c, 7);
        let scaled = AttentionCase {
            scale: Some(0.3),
            ..c.clone()
        };
        let (a, _) = forward_f64(&c, &inp);
        let (b, _) = forward_f64(&scaled, &inp);
        assert_ne!(a, b);
        // Scaling Q by 0.3·√D under the default scale is the same function.
        let f32c = AttentionCase {
            dtype: Dtype::F32,
            ..c.clone()
        };
        let widen = |w: &[u16], by: f64| -> Vec<u16> {
            let xs: Vec<f32> = c
                .dtype
                .decode_all(w)
                .iter()
                .map(|&x| (x * by) as f32)
                .collect();
            Dtype::F32.encode_all(&xs)
        };
        let inp2 = Inputs {
            q: widen(&inp.q, 0.3 * 4.0),
            k: widen(&inp.k, 1.0),
            v: widen(&inp.v, 1.0),
            dout: Vec::new(),
        };
        let (b2, _) = forward_f64(&f32c, &inp2);
        assert!(rel_l2(&b, &b2) < 1e-6);
    }

    /// The float64 gradients against central finite differences of the loss Σ dO ∘ O, for
    /// GQA, bottom-right causal with fewer queries than keys and with more, and key lengths.
    #[test]
    fn gradients_match_finite_differences() {
        let cases = [
            AttentionCase {
                kv_heads: 1,
                seq_len_q: 3,
                seq_len_kv: 5,
                causal: true,
                ..AttentionCase::new(1, 2, 1, 4)
            },
            AttentionCase {
                seq_len_q: 5,
                seq_len_kv: 3,
                causal: true,
                scale: Some(0.7),
                ..AttentionCase::new(1, 1, 1, 4)
            },
            AttentionCase {
                seq_len_kv: 4,
                seq_len_q: 2,
                kv_lens: Some(vec![3, 1]),
                ..AttentionCase::new(2, 1, 1, 4)
            },
        ];
        for c in cases {
            let c = AttentionCase {
                pass: Pass::FwdBwd,
                dtype: Dtype::F32,
                ..c
            };
            let inp = Inputs::random(&c, 9);
            let (dq, dk, dv) = backward_f64(&c, &inp);
            let q = c.dtype.decode_all(&inp.q);
            let k = c.dtype.decode_all(&inp.k);
            let v = c.dtype.decode_all(&inp.v);
            let dout = c.dtype.decode_all(&inp.dout);
            let loss = |q: &[f64], k: &[f64], v: &[f64]| {
                let src = Source::F64 {
                    q,
                    k,
                    v,
                    dout: &dout,
                };
                let fwd = AttentionCase {
                    pass: Pass::Fwd,
                    ..c.clone()
                };
                let o = references(&fwd, &src, &CheckPlan::full(&c)).o;
                o.iter().zip(&dout).map(|(a, b)| a * b).sum::<f64>()
            };
            let h = 1e-6;
            for (which, grad) in [(0, &dq), (1, &dk), (2, &dv)] {
                for idx in 0..grad.len() {
                    let mut t = [q.clone(), k.clone(), v.clone()];
                    t[which][idx] += h;
                    let up = loss(&t[0], &t[1], &t[2]);
                    t[which][idx] -= 2.0 * h;
                    let down = loss(&t[0], &t[1], &t[2]);
                    let fd = (up - down) / (2.0 * h);
                    assert!(
                        (fd - grad[idx]).abs() < 1e-7 * (1.0 + fd.abs()),
                        "{c:?} tensor {which} element {idx}: {fd} vs {}",
                        grad[idx]
                    );
                }
            }
        }
    }

    #[test]
    fn gqa_gradients_sum_over_the_group() {
        // GQA equals MHA on K and V repeated per head, with dK and dV summed over the group.
        let c = AttentionCase {
            kv_heads: 2,
            causal: true,
            pass: Pass::FwdBwd,
            seq_len_q: 5,
            seq_len_kv: 7,
            ..AttentionCase::new(1, 6, 1, 8)
        };
        let inp = Inputs::random(&c, 10);
        let (dq, dk, dv) = backward_f64(&c, &inp);
        let mha = AttentionCase {
            kv_heads: 6,
            ..c.clone()
        };
        let per = 7 * 8;
        let rep = |w: &[u16]| -> Vec<u16> {
            (0..6)
                .flat_map(|h| w[(h / 3) * per..(h / 3 + 1) * per].to_vec())
                .collect()
        };
        let inp6 = Inputs {
            k: rep(&inp.k),
            v: rep(&inp.v),
            ..inp.clone()
        };
        let (dq6, dk6, dv6) = backward_f64(&mha, &inp6);
        assert!(rel_l2(&dq, &dq6) < 1e-13);
        for (g, six) in [(&dk, &dk6), (&dv, &dv6)] {
            let summed: Vec<f64> = (0..2 * per)
                .map(|i| {
                    (0..3)
                        .map(|r| six[((i / per) * 3 + r) * per + i % per])
                        .sum()
                })
                .collect();
            assert!(rel_l2(g, &summed) < 1e-13);
        }
    }

    #[test]
    fn flash_model_matches_reference() {
        let shapes = [
            small(false, Dtype::Bf16),
            small(true, Dtype::F16),
            // Partial tiles, bottom-right causal both ways, key lengths.
            AttentionCase {
                seq_len_q: 37,
                seq_len_kv: 70,
                causal: true,
                ..AttentionCase::new(1, 1, 1, 16)
            },
            AttentionCase {
                seq_len_q: 70,
                seq_len_kv: 37,
                causal: true,
                ..AttentionCase::new(1, 1, 1, 16)
            },
            AttentionCase {
                seq_len_kv: 50,
                kv_lens: Some(vec![50, 0, 33]),
                causal: true,
                ..AttentionCase::new(3, 1, 20, 16)
            },
        ];
        for c in shapes {
            let inp = Inputs::random(&c, 11);
            let (o, _) = forward_f64(&c, &inp);
            for b in 0..c.batch {
                let per = c.seq_len_q * c.head_dim;
                let start = q_offset(&c, b, 0);
                let want = &o[start..start + per];
                let got: Vec<f64> = flash_slice_f32(&c, &inp, b, 0, 32)
                    .into_iter()
                    .map(|x| x as f64)
                    .collect();
                assert!(got.iter().all(|x| x.is_finite()));
                if want.iter().all(|&x| x == 0.0) {
                    assert!(got.iter().all(|&x| x == 0.0));
                    continue;
                }
                let err = rel_l2(&got, want);
                assert!(err < c.dtype.tolerance() / 2.0, "{c:?} {err}");
            }
        }
    }

    #[test]
    fn check_catches_wrong_outputs() {
        let c = AttentionCase {
            pass: Pass::FwdBwd,
            ..small(true, Dtype::Bf16)
        };
        let inp = Inputs::random(&c, 5);
        let plan = CheckPlan::new(&c, 1000, 9);
        let refs = reference_values(&c, &inp, &plan);
        let round = |x: &[f64]| {
            c.dtype
                .encode_all(&x.iter().map(|&v| v as f32).collect::<Vec<_>>())
        };
        let (o, _) = forward_f64(&c, &inp);
        let (dq, dk, dv) = backward_f64(&c, &inp);
        let good = Outputs {
            o: round(&o),
            dq: round(&dq),
            dk: round(&dk),
            dv: round(&dv),
        };
        let e = check_outputs(&c, &refs, &good, &plan);
        assert!(e.worst() < 5e-3, "{e:?}");
        // A kernel that forgets the mask must fail the tolerance.
        let nc = AttentionCase {
            causal: false,
            ..c.clone()
        };
        let unmasked = Outputs {
            o: round(&forward_f64(&nc, &inp).0),
            ..good.clone()
        };
        assert!(check_outputs(&c, &refs, &unmasked, &plan).worst() > c.dtype.tolerance());
        // One NaN planted anywhere in any output fails the check, whatever the other errors:
        // the worst error is NaN, never the largest finite one (f64::max would pick that).
        for which in 0..4 {
            let mut bad = good.clone();
            let t = match which {
                0 => &mut bad.o,
                1 => &mut bad.dq,
                2 => &mut bad.dk,
                _ => &mut bad.dv,
            };
            let last = t.len() - 1;
            t[last] = Dtype::POISON_WORD;
            let e = check_outputs(&c, &refs, &bad, &plan);
            assert!(e.worst().is_nan(), "output {which}: {e:?}");
            assert!(e.worst().partial_cmp(&c.dtype.tolerance()).is_none());
        }
        // An unwritten O row fails the forward check too.
        let mut hole = good.o.clone();
        for x in &mut hole[0..c.head_dim] {
            *x = Dtype::POISON_WORD;
        }
        assert!(check_output(&c, &inp, &hole, &plan).is_nan());
        let mut swapped = good.o.clone();
        swapped.swap(3, 3 + c.head_dim * 7);
        assert!(check_output(&c, &inp, &swapped, &plan) > 0.0);
    }

    #[test]
    fn plan_samples_rows_with_extremes() {
        let c = AttentionCase {
            seq_len_q: 16384,
            seq_len_kv: 16384,
            ..small(true, Dtype::Bf16)
        };
        let p = CheckPlan::new(&c, 256, 1);
        assert_eq!(p.rows.len(), 256);
        assert_eq!(p.rows[0], 0);
        assert_eq!(*p.rows.last().unwrap(), 16383);
        assert!(p.slices.len() >= 2 && p.slices.len() <= 4);
        assert_eq!(p.slices[0], (0, 0));
        assert_eq!(*p.slices.last().unwrap(), (1, 1));
        assert_eq!(p.kv_slices, vec![(0, 0), (1, 0)]);
        let n = p.slices.len();
        assert!(p
            .describe(&c)
            .starts_with(&format!("{n} of 4 (batch, head) slices x 256 of 16384")));
        let bwd = AttentionCase {
            pass: Pass::FwdBwd,
            kv_lens: Some(vec![100, 16384]),
            ..c
        };
        let p = CheckPlan::new(&bwd, 256, 1);
        assert!(p.key_rows.contains(&99) && p.key_rows.contains(&100));
        assert!(p
            .describe(&bwd)
            .contains("dK and dV: 2 of 2 (batch, kv head) slices"));
        assert_eq!(p.kv_ranges(&bwd).len(), 2 * p.key_rows.len());
    }
}
