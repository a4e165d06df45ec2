//! Decoding attention over a paged KV cache, split over the key axis (issue 10 §2): the float64
//! reference that the split-KV kernels are checked against, and the combine step they share.
//!
//! Split-KV ("flash-decoding": Dao, Haziza, Massa and Sizov, 2023, "Flash-Decoding for
//! long-context inference") splits one query row's keys into `splits` contiguous ranges, runs
//! attention on each range alone and keeps its partial result: the output normalised over the
//! range, and the range's log-sum-exp. [`combine`] merges the partials exactly: with
//! lse* = log Σ exp(lseᵢ), O = Σ exp(lseᵢ − lse*) · Oᵢ. A range with no visible key contributes
//! nothing (lse −∞), so any split gives the one-pass result up to rounding.
//!
//! The paged cache follows vLLM's PagedAttention (Kwon et al., 2023, "Efficient Memory
//! Management for Large Language Model Serving with PagedAttention"): K and V are pools of
//! pages `[num_pages, page_size, kv_heads, head_dim]`; sequence b's key t lives in page
//! `block_table[b][t / page_size]` at row `t % page_size`; its length is `seq_lens[b]`.
//!
//! Layouts: Q and O `[batch, heads, seq_len_q, head_dim]` (BHSD, as the rest of
//! `crate::attention`); query head h reads kv head h / (heads / kv_heads) (GQA). Causal is
//! aligned bottom-right, as everywhere in this crate: query i of sequence b sees key j when
//! j ≤ i + seq_lens\[b\] − seq_len_q. A row that sees no key has output 0 (not NaN) and
//! log-sum-exp +∞ (the module's convention).

use std::ops::Range;

/// A paged KV cache in float64 (the reference's precision).
#[derive(Clone, Debug, PartialEq)]
pub struct PagedCache {
    /// Rows per page.
    pub page_size: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// Key pages, `[num_pages, page_size, kv_heads, head_dim]`.
    pub k: Vec<f64>,
    /// Value pages, like `k`.
    pub v: Vec<f64>,
    /// Per sequence, the pages holding its keys in order (at least ⌈seq_len / page_size⌉).
    pub block_table: Vec<Vec<usize>>,
    /// Per sequence, its number of keys.
    pub seq_lens: Vec<usize>,
}

impl PagedCache {
    /// A cache holding `k` and `v` given contiguously as `[batch, kv_heads, max_len, head_dim]`
    /// with lengths `seq_lens`, its pages allocated in the order `page_order` gives them (a
    /// permutation of the pages' indices, so that a test can scatter them); pages past a
    /// sequence's length are not allocated.
    ///
    /// # Panics
    /// `page_size` is 0, `page_order` is shorter than the pages needed, or a length exceeds
    /// `max_len`.
    #[allow(clippy::too_many_arguments)]
    pub fn from_contiguous(
        k: &[f64],
        v: &[f64],
        kv_heads: usize,
        max_len: usize,
        head_dim: usize,
        seq_lens: &[usize],
        page_size: usize,
        page_order: &[usize],
    ) -> PagedCache {
        assert!(page_size > 0, "page_size must be positive");
        let pages: usize = seq_lens.iter().map(|l| l.div_ceil(page_size)).sum();
        assert!(page_order.len() >= pages, "page_order holds too few pages");
        let page_elems = page_size * kv_heads * head_dim;
        let mut out_k = vec![0.0; pages * page_elems];
        let mut out_v = vec![0.0; pages * page_elems];
        let mut next = 0;
        let mut block_table = Vec::with_capacity(seq_lens.len());
        for (b, &len) in seq_lens.iter().enumerate() {
            assert!(
                len <= max_len,
                "seq_lens[{b}] = {len} exceeds max_len {max_len}"
            );
            let mut table = Vec::new();
            for p in 0..len.div_ceil(page_size) {
                let page = page_order[next];
                next += 1;
                table.push(page);
                for r in 0..page_size.min(len - p * page_size) {
                    let t = p * page_size + r;
                    for h in 0..kv_heads {
                        let src = ((b * kv_heads + h) * max_len + t) * head_dim;
                        let dst = ((page * page_size + r) * kv_heads + h) * head_dim;
                        out_k[dst..dst + head_dim].copy_from_slice(&k[src..src + head_dim]);
                        out_v[dst..dst + head_dim].copy_from_slice(&v[src..src + head_dim]);
                    }
                }
            }
            block_table.push(table);
        }
        PagedCache {
            page_size,
            kv_heads,
            head_dim,
            k: out_k,
            v: out_v,
            block_table,
            seq_lens: seq_lens.to_vec(),
        }
    }

    /// Offset of key `t` of sequence `b`, kv head `h`, in `k` and `v`.
    fn at(&self, b: usize, h: usize, t: usize) -> usize {
        let page = self.block_table[b][t / self.page_size];
        ((page * self.page_size + t % self.page_size) * self.kv_heads + h) * self.head_dim
    }
}

/// One range's attention for one query row: the output normalised over the range and the
/// range's log-sum-exp (natural log of Σ exp(score)); `lse` is −∞ and `o` zero when no key of
/// the range is visible.
#[derive(Clone, Debug, PartialEq)]
pub struct Partial {
    /// Output over the range, `[head_dim]`.
    pub o: Vec<f64>,
    /// Log-sum-exp of the range's visible scores.
    pub lse: f64,
}

/// Attention of one query row `q` (`[head_dim]`, sequence `b`, kv head `kvh`) over the keys
/// `range` of the cache, of which only keys `< visible` count (the causal bound).
pub fn attend_range(
    q: &[f64],
    cache: &PagedCache,
    b: usize,
    kvh: usize,
    range: Range<usize>,
    visible: usize,
    scale: f64,
) -> Partial {
    let d = cache.head_dim;
    let end = range.end.min(visible);
    let scores: Vec<(usize, f64)> = (range.start..end)
        .map(|t| {
            let k = &cache.k[cache.at(b, kvh, t)..][..d];
            (t, scale * q.iter().zip(k).map(|(a, b)| a * b).sum::<f64>())
        })
        .collect();
    let mut o = vec![0.0; d];
    let m = scores.iter().map(|s| s.1).fold(f64::NEG_INFINITY, f64::max);
    if scores.is_empty() {
        return Partial {
            o,
            lse: f64::NEG_INFINITY,
        };
    }
    let mut l = 0.0;
    for &(t, s) in &scores {
        let p = (s - m).exp();
        l += p;
        let v = &cache.v[cache.at(b, kvh, t)..][..d];
        for (acc, x) in o.iter_mut().zip(v) {
            *acc += p * x;
        }
    }
    for x in &mut o {
        *x /= l;
    }
    Partial { o, lse: m + l.ln() }
}

/// Merges the partials of disjoint key ranges of one query row into its output and
/// log-sum-exp: lse* = log Σ exp(lseᵢ), O = Σ exp(lseᵢ − lse*) · Oᵢ. Partials with lse −∞
/// contribute nothing; when every partial is empty the output is 0 and the log-sum-exp +∞
/// (a row that sees no key).
///
/// # Panics
/// `parts` is empty.
pub fn combine(parts: &[Partial]) -> (Vec<f64>, f64) {
    let d = parts.first().expect("at least one partial").o.len();
    let m = parts
        .iter()
        .map(|p| p.lse)
        .fold(f64::NEG_INFINITY, f64::max);
    if m == f64::NEG_INFINITY {
        return (vec![0.0; d], f64::INFINITY);
    }
    let weights: Vec<f64> = parts.iter().map(|p| (p.lse - m).exp()).collect();
    let total: f64 = weights.iter().sum();
    let mut o = vec![0.0; d];
    for (p, w) in parts.iter().zip(&weights) {
        for (acc, x) in o.iter_mut().zip(&p.o) {
            *acc += w / total * x;
        }
    }
    (o, m + total.ln())
}

/// The key ranges of a split of `len` keys into `splits` contiguous parts of near-equal size
/// (the first `len % splits` one longer); parts may be empty when `splits > len`.
///
/// # Panics
/// `splits` is 0.
pub fn split_ranges(len: usize, splits: usize) -> Vec<Range<usize>> {
    assert!(splits > 0, "splits must be positive");
    let (base, extra) = (len / splits, len % splits);
    let mut start = 0;
    (0..splits)
        .map(|i| {
            let n = base + usize::from(i < extra);
            let r = start..start + n;
            start += n;
            r
        })
        .collect()
}

/// Decoding attention in float64: Q `[batch, heads, seq_len_q, head_dim]` against `cache`,
/// each row's keys split into `splits` ranges ([`split_ranges`]) merged by [`combine`].
/// Returns O like Q and the log-sum-exp `[batch, heads, seq_len_q]`. `splits = 1` is the
/// one-pass reference.
///
/// # Panics
/// `q`'s length is not `batch · heads · seq_len_q · head_dim` for the cache's batch and head
/// dim, `heads` is not a multiple of the cache's kv heads, or `splits` is 0.
pub fn decode_split_kv(
    q: &[f64],
    heads: usize,
    seq_len_q: usize,
    cache: &PagedCache,
    scale: f64,
    causal: bool,
    splits: usize,
) -> (Vec<f64>, Vec<f64>) {
    let (batch, d) = (cache.seq_lens.len(), cache.head_dim);
    assert_eq!(q.len(), batch * heads * seq_len_q * d, "q's length");
    assert!(
        cache.kv_heads > 0 && heads.is_multiple_of(cache.kv_heads),
        "heads must be a multiple of kv_heads"
    );
    let group = heads / cache.kv_heads;
    let mut o = vec![0.0; q.len()];
    let mut lse = vec![0.0; batch * heads * seq_len_q];
    for b in 0..batch {
        let len = cache.seq_lens[b];
        for h in 0..heads {
            for i in 0..seq_len_q {
                // Bottom-right causal: query i sees keys j <= i + len - seq_len_q.
                let visible = if causal {
                    (i + len + 1).saturating_sub(seq_len_q)
                } else {
                    len
                };
                let row = (b * heads + h) * seq_len_q + i;
                let qr = &q[row * d..][..d];
                let parts: Vec<Partial> = split_ranges(len, splits)
                    .into_iter()
                    .map(|r| attend_range(qr, cache, b, h / group, r, visible, scale))
                    .collect();
                let (or, l) = combine(&parts);
                o[row * d..][..d].copy_from_slice(&or);
                lse[row] = l;
            }
        }
    }
    (o, lse)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Uniform values in [-2, 2) from `seed`.
    fn values(n: usize, seed: u64) -> Vec<f64> {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        (0..n).map(|_| rng.random_range(-2.0..2.0)).collect()
    }

    /// A cache of `batch` sequences of lengths `lens`, its pages scattered in reverse order.
    fn cache(lens: &[usize], kv_heads: usize, d: usize, page: usize, seed: u64) -> PagedCache {
        let max_len = lens.iter().copied().max().unwrap_or(0).max(1);
        let n = lens.len() * kv_heads * max_len * d;
        let pages: usize = lens.iter().map(|l| l.div_ceil(page)).sum();
        let order: Vec<usize> = (0..pages).rev().collect();
        PagedCache::from_contiguous(
            &values(n, seed),
            &values(n, seed + 1),
            kv_heads,
            max_len,
            d,
            lens,
            page,
            &order,
        )
    }

    fn max_diff(a: &[f64], b: &[f64]) -> f64 {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f64::max)
    }

    #[test]
    fn any_split_gives_the_one_pass_result() {
        // 4 sequences (GQA 8:2, head_dim 16, pages of 16), lengths including 1 and ones that
        // are not a multiple of the page size; 1, 2 and 8 query rows, both masks.
        let lens = [1, 37, 64, 300];
        let (heads, kv_heads, d) = (8, 2, 16);
        let c = cache(&lens, kv_heads, d, 16, 7);
        for tq in [1, 2, 8] {
            let q = values(lens.len() * heads * tq * d, 99);
            for causal in [false, true] {
                let (o1, l1) = decode_split_kv(&q, heads, tq, &c, 0.25, causal, 1);
                for splits in [2, 7, 64] {
                    let (o, l) = decode_split_kv(&q, heads, tq, &c, 0.25, causal, splits);
                    assert!(
                        max_diff(&o, &o1) < 1e-12,
                        "tq {tq} causal {causal} {splits}"
                    );
                    let finite: Vec<(f64, f64)> = l
                        .iter()
                        .zip(&l1)
                        .filter(|(a, _)| a.is_finite())
                        .map(|(a, b)| (*a, *b))
                        .collect();
                    assert!(finite.iter().all(|(a, b)| (a - b).abs() < 1e-12));
                    assert_eq!(
                        l.iter().filter(|x| x.is_infinite()).count(),
                        l1.iter().filter(|x| x.is_infinite()).count()
                    );
                }
            }
        }
    }

    #[test]
    fn the_paged_layout_reads_what_the_contiguous_one_holds() {
        // Same inputs, pages in order and scattered, pages of 16 and 1 row: one output.
        let lens = [5, 33];
        let (kv_heads, d, max_len) = (2, 8, 33);
        let n = lens.len() * kv_heads * max_len * d;
        let (k, v) = (values(n, 3), values(n, 4));
        let q = values(lens.len() * 4 * d, 5);
        let mut outs = Vec::new();
        for page in [16, 1] {
            let pages: usize = lens.iter().map(|l: &usize| l.div_ceil(page)).sum();
            for order in [
                (0..pages).collect::<Vec<_>>(),
                (0..pages).rev().collect::<Vec<_>>(),
            ] {
                let c =
                    PagedCache::from_contiguous(&k, &v, kv_heads, max_len, d, &lens, page, &order);
                outs.push(decode_split_kv(&q, 4, 1, &c, 0.3, false, 3).0);
            }
        }
        for o in &outs[1..] {
            assert!(max_diff(o, &outs[0]) < 1e-12);
        }
    }

    #[test]
    fn decoding_sees_the_bottom_right_keys_and_empty_rows_are_zero() {
        // Q = 0: every visible key weighs the same, so row i is the mean of V over its keys.
        let (d, len) = (4, 5);
        let c = cache(&[len], 1, d, 2, 11);
        let v_row = |t: usize| c.v[c.at(0, 0, t)..][..d].to_vec();
        let mean = |n: usize| -> Vec<f64> {
            (0..d)
                .map(|e| (0..n).map(|t| v_row(t)[e]).sum::<f64>() / n as f64)
                .collect()
        };
        // Two queries against five keys, causal: row 0 sees keys 0..=3, row 1 all five.
        let (o, _) = decode_split_kv(&vec![0.0; 2 * d], 1, 2, &c, 1.0, true, 2);
        assert!(max_diff(&o[..d], &mean(4)) < 1e-12);
        assert!(max_diff(&o[d..], &mean(5)) < 1e-12);
        // Seven queries against five keys, causal: rows 0 and 1 see no key: exactly 0, lse +∞.
        let (o, lse) = decode_split_kv(&vec![0.0; 7 * d], 1, 7, &c, 1.0, true, 3);
        assert!(o[..2 * d].iter().all(|x| *x == 0.0));
        assert_eq!(lse[..2], [f64::INFINITY, f64::INFINITY]);
        assert!(o.iter().all(|x| x.is_finite()));
        assert!(max_diff(&o[2 * d..3 * d], &mean(1)) < 1e-12);
    }

    #[test]
    fn split_kv_agrees_with_the_crates_float64_attention() {
        // The same bf16 inputs through `cpu::forward_f64` (padded K/V with per-sequence key
        // lengths) and through the paged split-KV reference: one function, two layouts.
        use crate::attention::cpu::{forward_f64, gather, Inputs};
        use crate::attention::{AttentionCase, Dtype};
        let c = AttentionCase {
            kv_heads: 2,
            seq_len_q: 2,
            seq_len_kv: 40,
            causal: true,
            dtype: Dtype::Bf16,
            scale: Some(0.3),
            kv_lens: Some(vec![1, 17, 40]),
            ..AttentionCase::new(3, 8, 40, 16)
        };
        let inp = Inputs::random(&c, 21);
        let all = |w: &[u16]| gather(c.dtype, w, &[[0, w.len() as u64]]);
        let (o_ref, lse_ref) = forward_f64(&c, &inp);
        let lens = c.kv_lens.clone().unwrap();
        let pages: usize = lens.iter().map(|l| l.div_ceil(16)).sum();
        let order: Vec<usize> = (0..pages).rev().collect();
        let cache = PagedCache::from_contiguous(
            &all(&inp.k),
            &all(&inp.v),
            c.kv_heads,
            c.seq_len_kv,
            c.head_dim,
            &lens,
            16,
            &order,
        );
        for splits in [1, 7] {
            let (o, lse) = decode_split_kv(&all(&inp.q), c.heads, 2, &cache, 0.3, true, splits);
            assert!(max_diff(&o, &o_ref) < 1e-12, "splits {splits}");
            for (a, b) in lse.iter().zip(&lse_ref) {
                assert!(a == b || (a - b).abs() < 1e-12, "lse {a} against {b}");
            }
        }
    }

    #[test]
    fn combine_ignores_empty_ranges_and_splits_cover_every_key_once() {
        let full = Partial {
            o: vec![1.0, 2.0],
            lse: 0.5,
        };
        let empty = Partial {
            o: vec![0.0, 0.0],
            lse: f64::NEG_INFINITY,
        };
        assert_eq!(
            combine(&[empty.clone(), full.clone()]),
            (vec![1.0, 2.0], 0.5)
        );
        assert_eq!(
            combine(std::slice::from_ref(&empty)),
            (vec![0.0, 0.0], f64::INFINITY)
        );
        for (len, splits) in [(0, 3), (1, 64), (37, 7), (64, 64), (300, 2)] {
            let r = split_ranges(len, splits);
            assert_eq!(r.len(), splits);
            assert_eq!(r.first().unwrap().start, 0);
            assert_eq!(r.last().unwrap().end, len);
            assert!(r.windows(2).all(|w| w[0].end == w[1].start));
            let sizes: Vec<usize> = r.iter().map(|x| x.len()).collect();
            assert!(sizes.iter().max().unwrap() - sizes.iter().min().unwrap() <= 1);
        }
    }
}
