//! A grouped-GEMM case of the MoE grid (issue 14): its parameters, the group sizes its routing
//! gives, and its FLOP and byte counts.

use std::collections::BTreeMap;

use crate::schema::Param;

/// How the dispatched rows are spread over the experts ([`GroupedCase::group_counts`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Spread {
    /// Every expert gets ⌊rows / E⌋ rows, the first `rows mod E` experts one more.
    Balanced,
    /// Zipf's law over the experts in index order, exponent [`ZIPF_EXPONENT`], over the first
    /// E − ⌊E / 4⌋ experts; the last ⌊E / 4⌋ get no row (an empty group is part of every
    /// skewed case from 4 experts up). Counts by largest remainder, so they sum to the rows;
    /// then capped at the token count (a top-k router sends each token to an expert at most
    /// once), the excess going to the next experts with room.
    Zipf,
}

/// The `op` parameter of a grouped-GEMM case (the suite's later cases, dispatch, combine and
/// the whole layer, name theirs).
pub const OP: &str = "grouped_gemm";

/// The exponent s of [`Spread::Zipf`]: expert e (0-based) gets a share ∝ 1 / (e + 1)^s.
pub const ZIPF_EXPONENT: f64 = 1.2;

/// The parameters every MoE case names: `tokens`, `experts`, `top_k`, `hidden`, `width` (from
/// `sizes`, in that order), `op`, `spread`, `pass`, and `dtype` (`bf16`).
pub(crate) fn shape_params(
    sizes: [usize; 5],
    op: &str,
    spread: &str,
    pass: &str,
) -> BTreeMap<String, Param> {
    let mut p: BTreeMap<String, Param> = ["tokens", "experts", "top_k", "hidden", "width"]
        .into_iter()
        .zip(sizes)
        .map(|(k, v)| (k.to_string(), Param::Int(v as i64)))
        .collect();
    for (k, v) in [
        ("op", op),
        ("spread", spread),
        ("pass", pass),
        ("dtype", "bf16"),
    ] {
        p.insert(k.into(), Param::Text(v.into()));
    }
    p
}

impl Spread {
    /// Name in documents: `balanced`, `zipf`.
    pub fn as_str(self) -> &'static str {
        match self {
            Spread::Balanced => "balanced",
            Spread::Zipf => "zipf",
        }
    }

    /// The spread named `s`.
    pub fn parse(s: &str) -> Option<Spread> {
        [Spread::Balanced, Spread::Zipf]
            .into_iter()
            .find(|r| r.as_str() == s)
    }
}

/// One grouped GEMM: `tokens` tokens each sent to `top_k` experts, so M = tokens · top_k rows
/// of width K (`hidden`) in expert order, times each expert's K × N weights (`width` N); bf16
/// operands, float32 accumulation; the forward, or the forward and both backward products.
#[derive(Clone, Debug, PartialEq)]
pub struct GroupedCase {
    /// Tokens T.
    pub tokens: usize,
    /// Experts E.
    pub experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// The model width K.
    pub hidden: usize,
    /// The expert width N.
    pub width: usize,
    /// How the rows spread over the experts.
    pub spread: Spread,
    /// The forward and both backward products (dX and dW), not the forward alone.
    pub backward: bool,
}

impl GroupedCase {
    /// Dispatched rows M = tokens · top_k.
    pub fn rows(&self) -> usize {
        self.tokens * self.top_k
    }

    /// Rows per expert `[E]`, summing to [`GroupedCase::rows`] ([`Spread`] says how).
    pub fn group_counts(&self) -> Vec<usize> {
        let (m, e) = (self.rows(), self.experts);
        if e == 0 {
            return Vec::new();
        }
        match self.spread {
            Spread::Balanced => (0..e).map(|i| m / e + usize::from(i < m % e)).collect(),
            Spread::Zipf => {
                let live = e - e / 4;
                let share: Vec<f64> = (0..e)
                    .map(|i| {
                        if i < live {
                            1.0 / ((i + 1) as f64).powf(ZIPF_EXPONENT)
                        } else {
                            0.0
                        }
                    })
                    .collect();
                let total: f64 = share.iter().sum();
                let exact: Vec<f64> = share.iter().map(|s| s / total * m as f64).collect();
                let mut counts: Vec<usize> = exact.iter().map(|x| x.floor() as usize).collect();
                let short = m - counts.iter().sum::<usize>();
                // Largest remainders first (ties: the lower index), among the live experts.
                let mut order: Vec<usize> = (0..live).collect();
                order.sort_by(|&a, &b| {
                    (exact[b] - exact[b].floor()).total_cmp(&(exact[a] - exact[a].floor()))
                });
                for &i in order.iter().take(short) {
                    counts[i] += 1;
                }
                // A token picks top_k distinct experts, so no expert gets more rows than there
                // are tokens: cap each count there and hand the excess to the next experts in
                // index order with room (the live ones first, the empty quarter only when the
                // live ones cannot hold the rows, live · T < M).
                let cap = self.tokens;
                let mut excess: usize = counts.iter().map(|&c| c.saturating_sub(cap)).sum();
                for c in counts.iter_mut() {
                    *c = (*c).min(cap);
                }
                for i in (0..live).chain(live..e) {
                    let add = excess.min(cap - counts[i]);
                    counts[i] += add;
                    excess -= add;
                }
                counts
            }
        }
    }

    /// The case as named parameters for a document row: `op` ([`OP`]), `tokens`, `experts`,
    /// `top_k`, `hidden`, `width`, `spread`, `dtype` (`bf16`), `pass` (`fwd` or `fwd+bwd`).
    pub fn params(&self) -> BTreeMap<String, Param> {
        shape_params(
            [
                self.tokens,
                self.experts,
                self.top_k,
                self.hidden,
                self.width,
            ],
            OP,
            self.spread.as_str(),
            if self.backward { "fwd+bwd" } else { "fwd" },
        )
    }

    /// The case named by `p` ([`GroupedCase::params`]).
    ///
    /// # Errors
    /// A missing or mistyped parameter, an unknown spread or pass, a dtype other than bf16, or
    /// sizes [`GroupedCase::validate`] refuses.
    pub fn from_params(p: &BTreeMap<String, Param>) -> Result<GroupedCase, String> {
        let int = |k: &str| crate::schema::param_size(p, k);
        let text = |k: &str| crate::schema::param_name(p, k);
        if let Some(Param::Text(op)) = p.get("op") {
            if op != OP {
                return Err(format!("op `{op}` is not a grouped GEMM (`{OP}`)"));
            }
        }
        let spread = text("spread")?;
        let spread = Spread::parse(spread).ok_or_else(|| format!("unknown spread `{spread}`"))?;
        if text("dtype")? != "bf16" {
            return Err(format!(
                "dtype `{}`: the grouped GEMM takes bf16 operands",
                text("dtype")?
            ));
        }
        let backward = match text("pass")? {
            "fwd" => false,
            "fwd+bwd" => true,
            other => return Err(format!("unknown pass `{other}`")),
        };
        let c = GroupedCase {
            tokens: int("tokens")?,
            experts: int("experts")?,
            top_k: int("top_k")?,
            hidden: int("hidden")?,
            width: int("width")?,
            spread,
            backward,
        };
        c.validate()?;
        Ok(c)
    }

    /// Checks the sizes.
    ///
    /// # Errors
    /// No expert, `top_k` of 0 or above the experts, or a width of 0 (zero tokens are a case:
    /// every group empty).
    pub fn validate(&self) -> Result<(), String> {
        if self.experts == 0 || self.hidden == 0 || self.width == 0 {
            return Err(format!("a size is 0: {self:?}"));
        }
        if self.top_k == 0 || self.top_k > self.experts {
            return Err(format!(
                "top_k {} must be between 1 and the {} experts",
                self.top_k, self.experts
            ));
        }
        Ok(())
    }

    /// FLOPs of one call: 2 · M · K · N for the forward; the backward's dX = dY Wᵀ and
    /// dW = Xᵀ dY are as many each, so a `fwd+bwd` call counts 6 · M · K · N.
    pub fn flops(&self) -> f64 {
        let one = 2.0 * self.rows() as f64 * self.hidden as f64 * self.width as f64;
        if self.backward {
            3.0 * one
        } else {
            one
        }
    }

    /// Bytes one call must move at least, bf16: the forward reads X (M · K) and every expert's
    /// W (E · K · N) and writes Y (M · N); the backward also reads dY, X and W again and writes
    /// dX and dW.
    pub fn bytes(&self) -> f64 {
        let (m, k, n, e) = (
            self.rows() as f64,
            self.hidden as f64,
            self.width as f64,
            self.experts as f64,
        );
        let forward = m * k + e * k * n + m * n;
        let backward = if self.backward {
            // Read dY, X, W; write dX, dW.
            m * n + m * k + e * k * n + m * k + e * k * n
        } else {
            0.0
        };
        2.0 * (forward + backward)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn case(tokens: usize, experts: usize, top_k: usize, spread: Spread) -> GroupedCase {
        GroupedCase {
            tokens,
            experts,
            top_k,
            hidden: 2048,
            width: 1408,
            spread,
            backward: false,
        }
    }

    #[test]
    fn counts_sum_to_the_rows() {
        for spread in [Spread::Balanced, Spread::Zipf] {
            for (t, e, k) in [
                (4096, 8, 1),
                (16384, 64, 2),
                (131_072, 128, 8),
                (5, 8, 1),
                (0, 8, 2),
            ] {
                let c = case(t, e, k, spread);
                let counts = c.group_counts();
                assert_eq!(counts.len(), e);
                assert_eq!(counts.iter().sum::<usize>(), t * k, "{c:?}");
            }
        }
    }

    #[test]
    fn balanced_counts_differ_by_at_most_one() {
        let counts = case(1000, 64, 2, Spread::Balanced).group_counts();
        let (lo, hi) = (counts.iter().min().unwrap(), counts.iter().max().unwrap());
        assert!(hi - lo <= 1, "{counts:?}");
        assert_eq!(counts[0], 32);
        assert_eq!(counts[63], 31);
    }

    #[test]
    fn zipf_counts_are_a_possible_routing() {
        // No expert gets more rows than there are tokens, at every layer of the grid; the
        // rows still sum to T · top_k and the last quarter stays empty.
        for (tokens, experts, top_k) in [
            (4096, 64, 8),
            (16384, 128, 8),
            (65536, 128, 8),
            (131072, 128, 8),
            (131072, 8, 2),
            (4096, 8, 2),
            (100, 4, 4),
        ] {
            let counts = case(tokens, experts, top_k, Spread::Zipf).group_counts();
            assert_eq!(counts.iter().sum::<usize>(), tokens * top_k);
            assert!(counts.iter().all(|&c| c <= tokens), "{counts:?}");
            if (experts - experts / 4) * tokens >= tokens * top_k {
                assert!(
                    counts[experts - experts / 4..].iter().all(|&c| c == 0),
                    "{counts:?}"
                );
            }
            // Still skewed: the first expert is full or the largest.
            assert_eq!(counts[0], *counts.iter().max().unwrap());
        }
        // 4 experts, top-4: every token reaches every expert, the empty quarter included.
        assert_eq!(case(100, 4, 4, Spread::Zipf).group_counts(), vec![100; 4]);
    }

    #[test]
    fn zipf_counts_fall_and_leave_experts_empty() {
        let counts = case(16384, 64, 2, Spread::Zipf).group_counts();
        assert!(counts.windows(2).all(|w| w[0] >= w[1]), "{counts:?}");
        assert_eq!(&counts[48..], &[0; 16]);
        // Expert 0 gets 2^1.2 times expert 1's share, within one row of rounding.
        let ratio = counts[0] as f64 / counts[1] as f64;
        assert!((ratio - 2f64.powf(ZIPF_EXPONENT)).abs() < 0.01, "{ratio}");
    }

    #[test]
    fn params_name_the_case_back() {
        let mut c = case(8192, 8, 2, Spread::Zipf);
        c.backward = true;
        assert_eq!(GroupedCase::from_params(&c.params()).unwrap(), c);
        let mut p = c.params();
        p.insert("top_k".into(), Param::Int(9));
        assert!(GroupedCase::from_params(&p)
            .unwrap_err()
            .contains("top_k 9"));
        p.insert("dtype".into(), Param::Text("fp32".into()));
        assert!(GroupedCase::from_params(&p).unwrap_err().contains("bf16"));
    }

    #[test]
    fn counts_are_per_call() {
        let mut c = case(16384, 8, 1, Spread::Balanced);
        // Issue 14's comparison shape: M = 16384, K = 2048, N = 1408.
        assert_eq!(c.flops(), 2.0 * 16384.0 * 2048.0 * 1408.0);
        assert_eq!(
            c.bytes(),
            2.0 * (16384.0 * 2048.0 + 8.0 * 2048.0 * 1408.0 + 16384.0 * 1408.0)
        );
        c.backward = true;
        assert_eq!(c.flops(), 6.0 * 16384.0 * 2048.0 * 1408.0);
    }
}
