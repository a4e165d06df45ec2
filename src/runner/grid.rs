//! The grid of cases: the cartesian product of named axes, narrowed by `--filter` (a case
//! expression such as `head_dim=128,seq_len>=4096`) and split by `--shard i/n`.
//!
//! A case is a named parameter map ([`Params`]), the same map a document row carries.

use std::collections::BTreeMap;
use std::fmt;

use crate::schema::Param;

/// A case as named parameters.
pub type Params = BTreeMap<String, Param>;

/// The cartesian product of `axes` (name, values), the first axis outermost, each case
/// extended by the `fixed` parameters.
pub fn expand(axes: &[(&str, Vec<Param>)], fixed: &Params) -> Vec<Params> {
    let mut cases = vec![fixed.clone()];
    for (name, values) in axes {
        let mut next = Vec::with_capacity(cases.len() * values.len());
        for c in &cases {
            for v in values {
                let mut c = c.clone();
                c.insert(name.to_string(), v.clone());
                next.push(c);
            }
        }
        cases = next;
    }
    cases
}

/// A comparison in a filter clause.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// `=` or `==`.
    Eq,
    /// `!=`.
    Ne,
    /// `<`.
    Lt,
    /// `<=`.
    Le,
    /// `>`.
    Gt,
    /// `>=`.
    Ge,
}

impl Op {
    fn as_str(self) -> &'static str {
        match self {
            Op::Eq => "=",
            Op::Ne => "!=",
            Op::Lt => "<",
            Op::Le => "<=",
            Op::Gt => ">",
            Op::Ge => ">=",
        }
    }
}

/// One clause: `key op value`.
#[derive(Clone, Debug, PartialEq)]
pub struct Clause {
    /// Case parameter name.
    pub key: String,
    /// Comparison.
    pub op: Op,
    /// Right-hand side, parsed as an integer, a number, `true`/`false`, or else text.
    pub value: Param,
}

/// A case expression: clauses separated by commas, all of which must hold.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Filter {
    /// The clauses, in the order written.
    pub clauses: Vec<Clause>,
}

impl fmt::Display for Filter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = self
            .clauses
            .iter()
            .map(|c| format!("{}{}{}", c.key, c.op.as_str(), c.value))
            .collect();
        f.write_str(&parts.join(","))
    }
}

fn parse_value(s: &str) -> Param {
    let s = s.trim();
    if let Ok(i) = s.parse::<i64>() {
        Param::Int(i)
    } else if let Ok(x) = s.parse::<f64>() {
        Param::Float(x)
    } else if s == "true" || s == "false" {
        Param::Bool(s == "true")
    } else {
        Param::Text(s.trim_matches(|c| c == '\'' || c == '"').to_string())
    }
}

impl Filter {
    /// Parses `key=value,key>=value,...` (operators `=`, `==`, `!=`, `<`, `<=`, `>`, `>=`).
    ///
    /// # Errors
    /// Names the clause that is not `key op value`.
    pub fn parse(s: &str) -> Result<Filter, String> {
        let mut clauses = Vec::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let pos = part.find(['=', '!', '<', '>']).ok_or_else(|| {
                format!("filter clause `{part}`: expected key=value, key>=value, ...")
            })?;
            let (key, rest) = part.split_at(pos);
            let (op, value) = [
                ("==", Op::Eq),
                ("!=", Op::Ne),
                ("<=", Op::Le),
                (">=", Op::Ge),
                ("=", Op::Eq),
                ("<", Op::Lt),
                (">", Op::Gt),
            ]
            .into_iter()
            .find_map(|(tok, op)| rest.strip_prefix(tok).map(|v| (op, v)))
            .ok_or_else(|| format!("filter clause `{part}`: unknown operator"))?;
            let key = key.trim();
            if key.is_empty() || value.trim().is_empty() {
                return Err(format!(
                    "filter clause `{part}`: expected key=value, key>=value, ..."
                ));
            }
            clauses.push(Clause {
                key: key.to_string(),
                op,
                value: parse_value(value),
            });
        }
        Ok(Filter { clauses })
    }

    /// `Err` naming a clause whose key is not a parameter of `case` (a typo would otherwise
    /// silently select nothing).
    pub fn check_keys(&self, case: &Params) -> Result<(), String> {
        for c in &self.clauses {
            if !case.contains_key(&c.key) {
                let known: Vec<&str> = case.keys().map(String::as_str).collect();
                return Err(format!(
                    "filter: `{}` is not a case parameter (known: {})",
                    c.key,
                    known.join(", ")
                ));
            }
        }
        Ok(())
    }

    /// True when every clause holds for `case`. A clause on a missing parameter, or comparing
    /// an ordering of values that have none (text, flags), does not hold.
    pub fn matches(&self, case: &Params) -> bool {
        self.clauses.iter().all(|c| {
            let Some(v) = case.get(&c.key) else {
                return false;
            };
            let ord = match (v, &c.value) {
                (Param::Int(a), Param::Int(b)) => a.partial_cmp(b),
                (Param::Int(a), Param::Float(b)) => (*a as f64).partial_cmp(b),
                (Param::Float(a), Param::Int(b)) => a.partial_cmp(&(*b as f64)),
                (Param::Float(a), Param::Float(b)) => a.partial_cmp(b),
                (Param::Bool(a), Param::Bool(b)) if matches!(c.op, Op::Eq | Op::Ne) => {
                    a.partial_cmp(b)
                }
                (Param::Text(a), Param::Text(b)) if matches!(c.op, Op::Eq | Op::Ne) => {
                    a.partial_cmp(b)
                }
                _ => None,
            };
            use std::cmp::Ordering::*;
            match (c.op, ord) {
                (_, None) => c.op == Op::Ne,
                (Op::Eq, Some(o)) => o == Equal,
                (Op::Ne, Some(o)) => o != Equal,
                (Op::Lt, Some(o)) => o == Less,
                (Op::Le, Some(o)) => o != Greater,
                (Op::Gt, Some(o)) => o == Greater,
                (Op::Ge, Some(o)) => o != Less,
            }
        })
    }
}

/// Shard `index` (1-based) of `count`, from `--shard index/count`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    /// 1-based shard number, `1..=count`.
    pub index: usize,
    /// Number of shards, at least 1.
    pub count: usize,
}

impl Shard {
    /// True when the case at 0-based grid position `position` belongs to this shard.
    pub fn takes(self, position: usize) -> bool {
        position % self.count == self.index - 1
    }

    /// Parses `i/n` with `1 <= i <= n`.
    ///
    /// # Errors
    /// Names what is wrong with the text.
    pub fn parse(s: &str) -> Result<Shard, String> {
        let (i, n) = s
            .split_once('/')
            .ok_or_else(|| format!("`{s}` is not of the form i/n (e.g. 1/2)"))?;
        let parse = |v: &str, what: &str| {
            v.trim()
                .parse::<usize>()
                .map_err(|e| format!("`{s}`: {what} `{v}` is not a whole number: {e}"))
        };
        let (index, count) = (parse(i, "shard")?, parse(n, "count")?);
        if count == 0 || index == 0 || index > count {
            return Err(format!("`{s}`: need 1 <= i <= n"));
        }
        Ok(Shard { index, count })
    }
}

/// The cases of `grid` that match `filter`, then those of `shard` among them (by position in
/// the filtered grid).
pub fn select(grid: Vec<Params>, filter: &Filter, shard: Option<Shard>) -> Vec<Params> {
    grid.into_iter()
        .filter(|c| filter.matches(c))
        .enumerate()
        .filter(|(i, _)| shard.is_none_or(|s| s.takes(*i)))
        .map(|(_, c)| c)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grid() -> Vec<Params> {
        let mut fixed = Params::new();
        fixed.insert("dtype".into(), Param::Text("bf16".into()));
        expand(
            &[
                ("head_dim", vec![Param::Int(64), Param::Int(128)]),
                ("causal", vec![Param::Bool(false), Param::Bool(true)]),
                ("seq_len", [512, 1024, 4096, 16384].map(Param::Int).to_vec()),
            ],
            &fixed,
        )
    }

    #[test]
    fn expansion_is_the_product_first_axis_outermost() {
        let g = grid();
        assert_eq!(g.len(), 16);
        assert_eq!(g[0]["head_dim"], Param::Int(64));
        assert_eq!(g[0]["seq_len"], Param::Int(512));
        assert_eq!(g[1]["seq_len"], Param::Int(1024));
        assert_eq!(g[15]["head_dim"], Param::Int(128));
        assert!(g.iter().all(|c| c["dtype"] == Param::Text("bf16".into())));
    }

    #[test]
    fn filter_selects_cases() {
        let f = Filter::parse("head_dim=128, seq_len>=4096").unwrap();
        assert_eq!(f.to_string(), "head_dim=128,seq_len>=4096");
        let kept = select(grid(), &f, None);
        assert_eq!(kept.len(), 4);
        assert!(kept.iter().all(|c| c["head_dim"] == Param::Int(128)
            && matches!(c["seq_len"], Param::Int(t) if t >= 4096)));
        let f = Filter::parse("causal=true,dtype==bf16,seq_len<1024").unwrap();
        assert_eq!(select(grid(), &f, None).len(), 2);
        let f = Filter::parse("dtype!=fp16,seq_len<=512").unwrap();
        assert_eq!(select(grid(), &f, None).len(), 4);
        assert_eq!(select(grid(), &Filter::default(), None).len(), 16);
        assert!(Filter::parse("seq_len").is_err());
        assert!(Filter::parse("=4").is_err());
        assert!(Filter::parse("seq_len>=").is_err());
        let typo = Filter::parse("seqlen=4").unwrap();
        assert!(typo.check_keys(&grid()[0]).unwrap_err().contains("seqlen"));
    }

    #[test]
    fn shard_parses_and_partitions_the_grid() {
        assert_eq!(Shard::parse("2/3"), Ok(Shard { index: 2, count: 3 }));
        for bad in ["0/2", "3/2", "1/0", "1", "a/2", "1/b"] {
            assert!(Shard::parse(bad).is_err(), "{bad}");
        }
        let shards: Vec<Shard> = (1..=3).map(|i| Shard { index: i, count: 3 }).collect();
        for pos in 0..20 {
            assert_eq!(shards.iter().filter(|s| s.takes(pos)).count(), 1);
        }
        let all: usize = shards
            .iter()
            .map(|s| select(grid(), &Filter::default(), Some(*s)).len())
            .sum();
        assert_eq!(all, 16);
    }
}
