//! The query language of data-checked prose: where-clauses over case parameters
//! (`seq_len >= 2048, causal = true`) and the row fields a query may read (`median_ms`, ...).
//!
//! Pure functions over [`Row`]s; [`super`] turns their errors into build failures that name
//! the prose file.

use std::cmp::Ordering;
use std::fmt;

use crate::schema::{Document, Param, Row, Status};
use crate::site::format;

/// A comparison operator of a where-clause.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// `=` or `==`.
    Eq,
    /// `!=` or `≠`.
    Ne,
    /// `<`.
    Lt,
    /// `<=` or `≤`.
    Le,
    /// `>`.
    Gt,
    /// `>=` or `≥`.
    Ge,
}

impl Op {
    /// Spellings, longest first so that `>=` is found before `>`.
    const SPELLINGS: [(&'static str, Op); 10] = [
        (">=", Op::Ge),
        ("<=", Op::Le),
        ("!=", Op::Ne),
        ("==", Op::Eq),
        ("≥", Op::Ge),
        ("≤", Op::Le),
        ("≠", Op::Ne),
        ("=", Op::Eq),
        ("<", Op::Lt),
        (">", Op::Gt),
    ];

    /// The symbol used when a clause is shown in prose.
    pub fn symbol(self) -> &'static str {
        match self {
            Op::Eq => "=",
            Op::Ne => "≠",
            Op::Lt => "<",
            Op::Le => "≤",
            Op::Gt => ">",
            Op::Ge => "≥",
        }
    }

    fn holds(self, ord: Ordering) -> bool {
        match self {
            Op::Eq => ord == Ordering::Equal,
            Op::Ne => ord != Ordering::Equal,
            Op::Lt => ord == Ordering::Less,
            Op::Le => ord != Ordering::Greater,
            Op::Gt => ord == Ordering::Greater,
            Op::Ge => ord != Ordering::Less,
        }
    }
}

/// The right-hand side of a comparison.
#[derive(Debug, Clone, PartialEq)]
pub enum Operand {
    /// A literal as written (`2048`, `true`, `bf16`).
    Literal(String),
    /// `max`: the largest value of the parameter among the rows the other conditions keep.
    Max,
    /// `min`: the smallest such value.
    Min,
    /// `none`: the row's case does not have the parameter (`scale = none`: the default
    /// scale; `scale != none`: a scale was given). Only `=` and `!=` apply.
    Absent,
}

/// One comparison `param op value`.
#[derive(Debug, Clone, PartialEq)]
pub struct Cond {
    /// Case parameter name.
    pub param: String,
    /// Operator.
    pub op: Op,
    /// Value.
    pub value: Operand,
}

impl fmt::Display for Cond {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let v = match &self.value {
            Operand::Literal(s) => s.as_str(),
            Operand::Max => "max",
            Operand::Min => "min",
            Operand::Absent => "none",
        };
        write!(f, "{} {} {v}", self.param, self.op.symbol())
    }
}

/// A conjunction of comparisons; empty matches every row.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Filter {
    /// The comparisons, all of which must hold.
    pub conds: Vec<Cond>,
}

impl fmt::Display for Filter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = self.conds.iter().map(|c| c.to_string()).collect();
        f.write_str(&parts.join(" and "))
    }
}

/// Parses `seq_len >= 2048, causal = true and head_dim = 128`: comparisons separated by `,`
/// or the word `and`. Values may be quoted with `'`; `max` and `min` pick the extreme value of
/// the parameter among the rows that the other comparisons keep; `none` (with `=` or `!=`)
/// matches the rows whose case lacks (has) the parameter.
///
/// Errors: the message names the clause that does not parse.
pub fn parse_filter(text: &str) -> Result<Filter, String> {
    let mut conds = Vec::new();
    for piece in text.split(',') {
        for clause in split_and(piece) {
            let clause = clause.trim();
            if clause.is_empty() {
                if text.trim().is_empty() {
                    continue;
                }
                return Err(format!("empty clause in `{text}`"));
            }
            conds.push(parse_clause(clause)?);
        }
    }
    Ok(Filter { conds })
}

/// Splits on the word `and` (surrounded by whitespace).
fn split_and(piece: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = piece;
    loop {
        let found = rest
            .match_indices("and")
            .find(|(i, _)| {
                let before = rest[..*i].chars().next_back();
                let after = rest[i + 3..].chars().next();
                before.is_some_and(char::is_whitespace) && after.is_some_and(char::is_whitespace)
            })
            .map(|(i, _)| i);
        match found {
            Some(i) => {
                out.push(&rest[..i]);
                rest = &rest[i + 3..];
            }
            None => {
                out.push(rest);
                return out;
            }
        }
    }
}

fn parse_clause(clause: &str) -> Result<Cond, String> {
    let (at, spelling, op) = Op::SPELLINGS
        .iter()
        .filter_map(|(s, op)| clause.find(s).map(|i| (i, *s, *op)))
        // The leftmost operator; at the same place the longest spelling (listed first).
        .min_by_key(|(i, _, _)| *i)
        .ok_or_else(|| format!("clause `{clause}` has no comparison (=, !=, <, <=, >, >=)"))?;
    let param = clause[..at].trim();
    let value = clause[at + spelling.len()..].trim();
    let value = value
        .strip_prefix('\'')
        .and_then(|v| v.strip_suffix('\''))
        .unwrap_or(value);
    if param.is_empty() || !param.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
        return Err(format!(
            "clause `{clause}`: `{param}` is not a parameter name"
        ));
    }
    if value.is_empty() {
        return Err(format!("clause `{clause}` has no value"));
    }
    if Op::SPELLINGS.iter().any(|(s, _)| value.starts_with(s)) {
        return Err(format!("clause `{clause}`: operator repeated"));
    }
    let value = match value {
        "max" => Operand::Max,
        "min" => Operand::Min,
        "none" if matches!(op, Op::Eq | Op::Ne) => Operand::Absent,
        "none" => return Err(format!("clause `{clause}`: only = and != apply to none")),
        v => Operand::Literal(v.to_string()),
    };
    Ok(Cond {
        param: param.to_string(),
        op,
        value,
    })
}

/// Compares a parameter with a literal; a literal of the wrong type is an error.
fn compare(param: &Param, literal: &str) -> Result<Ordering, String> {
    match param {
        Param::Int(i) => {
            if let Ok(v) = literal.parse::<i64>() {
                Ok(i.cmp(&v))
            } else {
                let v: f64 = literal
                    .parse()
                    .map_err(|_| format!("`{literal}` is not a number"))?;
                Ok((*i as f64).total_cmp(&v))
            }
        }
        Param::Float(x) => {
            let v: f64 = literal
                .parse()
                .map_err(|_| format!("`{literal}` is not a number"))?;
            Ok(x.total_cmp(&v))
        }
        Param::Bool(b) => match literal {
            "true" => Ok(b.cmp(&true)),
            "false" => Ok(b.cmp(&false)),
            _ => Err(format!("`{literal}` is not true or false")),
        },
        Param::Text(s) => Ok(s.as_str().cmp(literal)),
    }
}

/// Order of two parameter values: numbers numerically, flags and names as such.
pub fn param_order(a: &Param, b: &Param) -> Ordering {
    match (a, b) {
        (Param::Int(x), Param::Int(y)) => x.cmp(y),
        (Param::Bool(x), Param::Bool(y)) => x.cmp(y),
        (Param::Text(x), Param::Text(y)) => x.cmp(y),
        _ => match (num(a), num(b)) {
            (Some(x), Some(y)) => x.total_cmp(&y),
            _ => a.to_string().cmp(&b.to_string()),
        },
    }
}

fn num(p: &Param) -> Option<f64> {
    match p {
        Param::Int(i) => Some(*i as f64),
        Param::Float(x) => Some(*x),
        _ => None,
    }
}

impl Filter {
    /// The items whose case satisfies every comparison. `case_of` gives an item's case row.
    ///
    /// Errors: a parameter no item has (a misspelt name), a value of the wrong type (`seq_len
    /// = long`), an ordering on a flag or a name, or `max`/`min` when no item has the
    /// parameter.
    pub fn apply<'a, T>(
        &self,
        items: Vec<T>,
        case_of: impl Fn(&T) -> &'a Row,
    ) -> Result<Vec<T>, String> {
        for c in &self.conds {
            if c.value != Operand::Absent
                && !items.iter().any(|t| case_of(t).case.contains_key(&c.param))
            {
                let mut known: Vec<&str> = items
                    .iter()
                    .flat_map(|t| case_of(t).case.keys().map(String::as_str))
                    .collect();
                known.sort_unstable();
                known.dedup();
                return Err(format!(
                    "no row has a parameter `{}` (parameters: {})",
                    c.param,
                    known.join(", ")
                ));
            }
        }
        // Plain comparisons first, then max/min among what they keep.
        let mut kept = Vec::with_capacity(items.len());
        for t in items {
            let mut ok = true;
            for c in &self.conds {
                if c.value == Operand::Absent {
                    let has = case_of(&t).case.contains_key(&c.param);
                    if has != (c.op == Op::Ne) {
                        ok = false;
                        break;
                    }
                    continue;
                }
                let Operand::Literal(lit) = &c.value else {
                    continue;
                };
                let Some(p) = case_of(&t).case.get(&c.param) else {
                    ok = false;
                    break;
                };
                if matches!(p, Param::Bool(_) | Param::Text(_)) && !matches!(c.op, Op::Eq | Op::Ne)
                {
                    return Err(format!(
                        "clause `{c}`: `{}` is a {}, only = and != apply",
                        c.param,
                        if matches!(p, Param::Bool(_)) {
                            "flag"
                        } else {
                            "name"
                        }
                    ));
                }
                let ord = compare(p, lit).map_err(|e| format!("clause `{c}`: {e}"))?;
                if !c.op.holds(ord) {
                    ok = false;
                    break;
                }
            }
            if ok {
                kept.push(t);
            }
        }
        for c in &self.conds {
            let pick = match c.value {
                Operand::Max => Ordering::Greater,
                Operand::Min => Ordering::Less,
                Operand::Literal(_) | Operand::Absent => continue,
            };
            let extreme = kept
                .iter()
                .filter_map(|t| case_of(t).case.get(&c.param))
                .fold(None::<&Param>, |best, p| match best {
                    Some(b) if param_order(p, b) != pick => Some(b),
                    _ => Some(p),
                })
                .cloned();
            let Some(extreme) = extreme else {
                return Err(format!(
                    "clause `{c}`: no row left by the other clauses has `{}`",
                    c.param
                ));
            };
            kept.retain(|t| {
                case_of(t)
                    .case
                    .get(&c.param)
                    .is_some_and(|p| c.op.holds(param_order(p, &extreme)))
            });
        }
        Ok(kept)
    }

    /// The filter as words for a sentence: `seq_len ≥ 2048 and the largest head_dim`.
    pub fn describe(&self) -> String {
        let parts: Vec<String> = self
            .conds
            .iter()
            .map(|c| {
                let extreme = match c.value {
                    Operand::Max => "largest",
                    Operand::Min => "smallest",
                    Operand::Literal(_) => return c.to_string(),
                    Operand::Absent if c.op == Op::Eq => return format!("no {}", c.param),
                    Operand::Absent => return format!("a {}", c.param),
                };
                let relation = match c.op {
                    Op::Eq => return format!("the {extreme} {}", c.param),
                    Op::Ne => "other than",
                    Op::Lt => "below",
                    Op::Le => "up to",
                    Op::Gt => "above",
                    Op::Ge => "from",
                };
                format!("{} {relation} the {extreme}", c.param)
            })
            .collect();
        join_words(&parts)
    }

    /// The cases a claim compared, described by the values they hold of each parameter the
    /// filter names (in the filter's order): `head_dim 64 or 128, seq_len 1024 to 4096 and
    /// the default scale` where the filter said `head_dim >= 64, head_dim <= 128, head_dim !=
    /// 96, seq_len >= 1024, seq_len <= 4096, scale = none`. One value reads `name = value`,
    /// two or three `name a, b or c`, more `name lo to hi`; a parameter no case has
    /// reads `the default name`. Empty when the filter names nothing.
    pub fn describe_values(&self, cases: &[&std::collections::BTreeMap<String, Param>]) -> String {
        // A parameter the filter excludes a value of (`head_dim != 96`) lists its values: a
        // range would cover the excluded one.
        let listed: Vec<&str> = self
            .conds
            .iter()
            .filter(|c| c.op == Op::Ne)
            .map(|c| c.param.as_str())
            .collect();
        describe_params(&self.params(), cases, &listed)
    }

    /// The parameters that `cases` hold two values or more of, other than those the filter
    /// names, described as [`Filter::describe_values`] does (`causal false or true and
    /// kv_heads 1, 2 or 8`): what a claim's cases vary in beyond what its filter says. Empty
    /// when they vary in nothing else.
    pub fn describe_varying(&self, cases: &[&std::collections::BTreeMap<String, Param>]) -> String {
        let named = self.params();
        let mut varying: Vec<&str> = Vec::new();
        for c in cases {
            for key in c.keys() {
                if named.contains(&key.as_str()) || varying.contains(&key.as_str()) {
                    continue;
                }
                // Two values or more; one value where other cases lack the parameter is a
                // parameter of some operations only (`cols` of a matrix product), not a range.
                let mut values = cases.iter().filter_map(|o| o.get(key));
                let first = values.next();
                let differs =
                    first.is_some_and(|f| values.any(|v| param_order(v, f) != Ordering::Equal));
                if differs {
                    varying.push(key);
                }
            }
        }
        varying.sort_unstable();
        describe_params(&varying, cases, &[])
    }
}

/// [`Filter::describe_values`] for the parameters `names`, those in `listed` by their values
/// however many (never as a range).
fn describe_params(
    names: &[&str],
    cases: &[&std::collections::BTreeMap<String, Param>],
    listed: &[&str],
) -> String {
    let parts: Vec<String> = names
        .iter()
        .map(|&name| {
            let mut values: Vec<&Param> = Vec::new();
            let mut absent = false;
            for c in cases {
                match c.get(name) {
                    Some(v) => {
                        if !values.iter().any(|w| param_order(w, v) == Ordering::Equal) {
                            values.push(v);
                        }
                    }
                    None => absent = true,
                }
            }
            values.sort_by(|a, b| param_order(a, b));
            let shown: Vec<String> = values.iter().map(|v| v.to_string()).collect();
            let mut words = match shown.as_slice() {
                [] => return format!("the default {name}"),
                [one] => format!("{name} = {one}"),
                [a, b] => format!("{name} {a} or {b}"),
                [a, b, c] => format!("{name} {a}, {b} or {c}"),
                // Numbers as a range; names (a mask, an operation) each.
                [first, .., last]
                    if !listed.contains(&name) && values.iter().all(|v| num(v).is_some()) =>
                {
                    format!("{name} {first} to {last}")
                }
                [init @ .., last] => format!("{name} {} or {last}", init.join(", ")),
            };
            if absent {
                words.push_str(&format!(" (or the default {name})"));
            }
            words
        })
        .collect();
    join_words(&parts)
}

/// `a`, `a and b`, `a, b and c`.
fn join_words(parts: &[String]) -> String {
    match parts {
        [] => String::new(),
        [one] => one.clone(),
        [init @ .., last] => format!("{} and {last}", init.join(", ")),
    }
}

impl Filter {
    /// Parameter names the filter mentions, in order, each once.
    pub fn params(&self) -> Vec<&str> {
        let mut out: Vec<&str> = Vec::new();
        for c in &self.conds {
            if !out.contains(&c.param.as_str()) {
                out.push(&c.param);
            }
        }
        out
    }
}

/// A numeric field of a row that prose may quote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Field {
    /// `median_ms`.
    MedianMs,
    /// `q1_ms`.
    Q1Ms,
    /// `q3_ms`.
    Q3Ms,
    /// A throughput the row's document declares, by its key (`tflops`), computed from the
    /// row's count and median.
    Throughput(String),
    /// `compile_s`.
    CompileS,
    /// `rel_err` (accuracy).
    RelErr,
    /// `peak_mb` (memory).
    PeakMb,
    /// `temporaries_mb` (memory).
    TemporariesMb,
    /// `residuals_mb` (memory): what the forward keeps for the backward.
    ResidualsMb,
    /// `host_ms`: host time to issue one call.
    HostMs,
    /// `eager_median_ms`: the eager figure of a graph-replayed row.
    EagerMedianMs,
    /// `first_call_s`: the first call in a fresh process.
    FirstCallS,
    /// `input_sets`: copies of the inputs the timed calls cycled through (L2 rotation).
    InputSets,
}

impl Field {
    /// Every field stored in a row, with its name; any other name is a throughput key.
    pub const STORED: [(&'static str, Field); 12] = [
        ("median_ms", Field::MedianMs),
        ("q1_ms", Field::Q1Ms),
        ("q3_ms", Field::Q3Ms),
        ("compile_s", Field::CompileS),
        ("rel_err", Field::RelErr),
        ("peak_mb", Field::PeakMb),
        ("temporaries_mb", Field::TemporariesMb),
        ("residuals_mb", Field::ResidualsMb),
        ("host_ms", Field::HostMs),
        ("eager_median_ms", Field::EagerMedianMs),
        ("first_call_s", Field::FirstCallS),
        ("input_sets", Field::InputSets),
    ];

    /// Looks a field up by name: a stored field, or else the key of a declared throughput
    /// (checked against the row's document when read).
    ///
    /// Errors: the name is empty or not a plain identifier.
    pub fn parse(name: &str) -> Result<Field, String> {
        if let Some((_, f)) = Field::STORED.iter().find(|(n, _)| *n == name) {
            return Ok(f.clone());
        }
        if !name.is_empty()
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        {
            return Ok(Field::Throughput(name.to_string()));
        }
        let names: Vec<&str> = Field::STORED.iter().map(|(n, _)| *n).collect();
        Err(format!(
            "unknown field `{name}` (fields: {}, or the key of a throughput the document \
             declares)",
            names.join(", ")
        ))
    }

    /// The field's name.
    pub fn name(&self) -> String {
        match self {
            Field::Throughput(key) => key.clone(),
            other => Field::STORED
                .iter()
                .find(|(_, f)| f == other)
                .map(|(n, _)| n.to_string())
                .unwrap_or_else(|| "?".to_string()),
        }
    }

    /// The value in `row` of `doc`, when recorded.
    ///
    /// Errors: a throughput key the document does not declare.
    pub fn get(&self, row: &Row, doc: &Document) -> Result<Option<f64>, String> {
        let mem = row.memory.as_ref();
        Ok(match self {
            Field::MedianMs => row.median_ms,
            Field::Q1Ms => row.q1_ms,
            Field::Q3Ms => row.q3_ms,
            Field::Throughput(key) => {
                let decl = doc
                    .config
                    .throughput
                    .iter()
                    .find(|t| &t.key == key)
                    .ok_or_else(|| {
                        let keys: Vec<&str> = doc
                            .config
                            .throughput
                            .iter()
                            .map(|t| t.key.as_str())
                            .collect();
                        format!(
                            "unknown field `{key}`: not a stored field, and the document \
                             declares no throughput of that key (it declares: {})",
                            if keys.is_empty() {
                                "none".to_string()
                            } else {
                                keys.join(", ")
                            }
                        )
                    })?;
                super::super::model::groups::throughput(row, decl)
            }
            Field::CompileS => row.compile_s,
            Field::RelErr => row.accuracy.as_ref().map(|a| a.rel_err),
            Field::PeakMb => mem.and_then(|m| m.peak_mb),
            Field::TemporariesMb => mem.and_then(|m| m.temporaries_mb),
            Field::ResidualsMb => mem.and_then(|m| m.residuals_mb),
            Field::HostMs => row.host_ms,
            Field::EagerMedianMs => row.eager_median_ms,
            Field::FirstCallS => row.first_call_s,
            Field::InputSets => row.input_sets.map(f64::from),
        })
    }

    /// The value formatted as the tables show it.
    pub fn format(&self, x: f64) -> String {
        match self {
            Field::MedianMs | Field::Q1Ms | Field::Q3Ms | Field::HostMs | Field::EagerMedianMs => {
                format::ms(x)
            }
            Field::FirstCallS => format::sig(x, 2),
            Field::InputSets => format!("{x:.0}"),
            Field::Throughput(_) => format::sig(x, 3),
            Field::CompileS => format::sig(x, 3),
            Field::RelErr => format::rel_err(x),
            Field::PeakMb | Field::TemporariesMb | Field::ResidualsMb => format::mb(x),
        }
    }
}

/// The value of `field` in an `ok` row of `doc`.
///
/// Errors: the row did not run (its status and message), it lacks the field, or the field is a
/// throughput the document does not declare.
pub fn ok_value(row: &Row, doc: &Document, field: &Field) -> Result<f64, String> {
    if row.status != Status::Ok {
        return Err(format!(
            "the row ({}) has status {}{}",
            row.implementation,
            row.status.as_str(),
            row.message
                .as_deref()
                .map(|m| format!(": {m}"))
                .unwrap_or_default()
        ));
    }
    field.get(row, doc)?.ok_or_else(|| {
        format!(
            "the row ({}) records no {}",
            row.implementation,
            field.name()
        )
    })
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    #[test]
    fn compared_cases_are_named_by_their_values() {
        let f = parse_filter(
            "pass = fwd, head_dim >= 64, head_dim <= 128, head_dim != 96, seq_len >= 1024, \
             scale = none",
        )
        .unwrap();
        let case = |d: i64, t: i64| {
            BTreeMap::from([
                ("pass".to_string(), Param::Text("fwd".to_string())),
                ("head_dim".to_string(), Param::Int(d)),
                ("seq_len".to_string(), Param::Int(t)),
            ])
        };
        let cases: Vec<_> = [(128, 4096), (64, 1024), (64, 2048), (128, 16384)]
            .into_iter()
            .map(|(d, t)| case(d, t))
            .collect();
        let refs: Vec<_> = cases.iter().collect();
        assert_eq!(
            f.describe_values(&refs),
            "pass = fwd, head_dim 64 or 128, seq_len 1024 to 16384 and the default scale"
        );
        assert_eq!(
            f.describe_values(&refs[..3]),
            "pass = fwd, head_dim 64 or 128, seq_len 1024, 2048 or 4096 and the default scale"
        );
        let mut scaled = case(64, 1024);
        scaled.insert("scale".to_string(), Param::Float(0.3));
        let one = parse_filter("scale != 2").unwrap();
        assert_eq!(
            one.describe_values(&[&scaled, &cases[0]]),
            "scale = 0.3 (or the default scale)"
        );
        assert_eq!(Filter::default().describe_values(&refs), "");
        // Four values read as a range, unless the filter left one out in between.
        let dims: Vec<_> = [32, 64, 128, 256]
            .into_iter()
            .map(|d| case(d, 1024))
            .collect();
        let dims: Vec<_> = dims.iter().collect();
        assert_eq!(
            parse_filter("head_dim >= 32")
                .unwrap()
                .describe_values(&dims),
            "head_dim 32 to 256"
        );
        assert_eq!(
            parse_filter("head_dim != 96")
                .unwrap()
                .describe_values(&dims),
            "head_dim 32, 64, 128 or 256"
        );
        // Beyond the filter: what varies, names listed each, a parameter only some cases have
        // left out.
        let mut grid: Vec<BTreeMap<String, Param>> = Vec::new();
        for (mask, kv) in [
            ("causal", 8),
            ("alibi", 1),
            ("document", 8),
            ("softcap(30)", 8),
        ] {
            let mut c = case(64, 1024);
            c.insert("mask".to_string(), Param::Text(mask.to_string()));
            c.insert("kv_heads".to_string(), Param::Int(kv));
            grid.push(c);
        }
        grid[0].insert("window".to_string(), Param::Int(64));
        let refs: Vec<_> = grid.iter().collect();
        assert_eq!(
            parse_filter("pass = fwd").unwrap().describe_varying(&refs),
            "kv_heads 1 or 8 and mask alibi, causal, document or softcap(30)"
        );
        assert_eq!(
            parse_filter("kv_heads >= 1, mask != x")
                .unwrap()
                .describe_varying(&refs),
            ""
        );
    }

    fn row(seq_len: i64, causal: bool) -> Row {
        let mut case = BTreeMap::new();
        case.insert("seq_len".to_string(), Param::Int(seq_len));
        case.insert("causal".to_string(), Param::Bool(causal));
        case.insert("dtype".to_string(), Param::Text("bf16".to_string()));
        Row::failed(case, "x", "y", false, Status::Oom, "m")
    }

    fn seqs(f: &str, rows: &[Row]) -> Result<Vec<i64>, String> {
        let filter = parse_filter(f)?;
        let kept = filter.apply(rows.iter().collect(), |r| *r)?;
        Ok(kept.iter().map(|r| r.int("seq_len").unwrap()).collect())
    }

    #[test]
    fn parses_commas_and_and() {
        let f = parse_filter("seq_len >= 2048, causal = true and dtype == 'bf16'").unwrap();
        assert_eq!(f.conds.len(), 3);
        assert_eq!(f.conds[0].op, Op::Ge);
        assert_eq!(f.conds[2].value, Operand::Literal("bf16".into()));
        assert_eq!(
            f.to_string(),
            "seq_len ≥ 2048 and causal = true and dtype = bf16"
        );
        assert!(parse_filter("").unwrap().conds.is_empty());
    }

    #[test]
    fn none_matches_rows_without_the_parameter() {
        let mut rows: Vec<Row> = [512, 1024].iter().map(|&s| row(s, false)).collect();
        let mut scaled = row(2048, false);
        scaled.case.insert("scale".to_string(), Param::Float(0.3));
        rows.push(scaled);
        assert_eq!(seqs("scale = none", &rows).unwrap(), [512, 1024]);
        assert_eq!(seqs("scale != none", &rows).unwrap(), [2048]);
        // A parameter no row has: every row lacks it.
        assert_eq!(seqs("kv_lens = none", &rows).unwrap(), [512, 1024, 2048]);
        assert!(parse_filter("scale < none").unwrap_err().contains("none"));
        assert_eq!(
            parse_filter("scale = none, kv_lens != none")
                .unwrap()
                .describe(),
            "no scale and a kv_lens"
        );
    }

    #[test]
    fn parse_errors_name_the_clause() {
        for bad in [
            "seq_len 2048",
            "seq_len >=",
            ">= 3",
            "a >= 1,, b = 2",
            "x >> 3",
        ] {
            let e = parse_filter(bad).unwrap_err();
            assert!(e.contains('`'), "{bad}: {e}");
        }
        let e = parse_filter("seq_len >= 1, causal true").unwrap_err();
        assert!(e.contains("`causal true`"), "{e}");
    }

    #[test]
    fn filters_by_number_flag_name_and_extremes() {
        let rows: Vec<Row> = [512, 1024, 2048, 4096]
            .iter()
            .flat_map(|&s| [row(s, false), row(s, true)])
            .collect();
        assert_eq!(
            seqs("seq_len >= 2048, causal = true", &rows).unwrap(),
            [2048, 4096]
        );
        assert_eq!(
            seqs("seq_len = max and causal = false", &rows).unwrap(),
            [4096]
        );
        assert_eq!(seqs("seq_len = min, causal = true", &rows).unwrap(), [512]);
        assert_eq!(
            seqs("seq_len < 1024, dtype != bf16", &rows).unwrap(),
            [0; 0]
        );
        assert!(seqs("seqlen = 3", &rows).unwrap_err().contains("seqlen"));
        assert!(seqs("seq_len = long", &rows).unwrap_err().contains("long"));
        assert!(seqs("causal > false", &rows).unwrap_err().contains("flag"));
        // The extremes take every comparison: all but the largest, from the smallest up.
        assert_eq!(
            seqs("seq_len < max, causal = true", &rows).unwrap(),
            [512, 1024, 2048]
        );
        assert_eq!(
            seqs("seq_len != min, causal = false", &rows).unwrap(),
            [1024, 2048, 4096]
        );
        assert_eq!(
            parse_filter("seq_len < max, head_dim = min")
                .unwrap()
                .describe(),
            "seq_len below the largest and the smallest head_dim"
        );
    }
}
