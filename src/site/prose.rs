//! Data-checked prose: Markdown under `templates/prose/` that quotes the measurements by query
//! and states claims the build verifies.
//!
//! A prose file is a Tera template rendered with these functions, then turned into HTML by
//! pulldown-cmark; the site's prose files start with the text of `prose/prelude.md`
//! ([`render_prose_after`]: `cards`, the cards the curated prose was written for, set once):
//!
//! - `value(suite, implementation, case, field)`: one row's field, formatted as the tables show
//!   it. `case` is a where-clause ([`query::parse_filter`]) that must match exactly one row.
//! - `ratio(suite, num, den, case, field="median_ms")`: `num`'s field over `den`'s, as `1.23×`.
//! - `claim(suite, faster=A | slower=A, than=B, where)` and
//!   `claim(suite, higher=A | lower=A, field, than=B, where)`: checked on every case the
//!   where-clause keeps in which both rows ran; renders a sentence fragment that says how many
//!   cases it covers and the range of the ratio.
//! - `case(suite, case, implementation?)`: the matched case, as the parameters the query names
//!   (`head_dim=128, seq_len=16384`).
//! - `largest(suite, param, where?, implementation?)`: the largest value of a parameter among
//!   the rows that ran.
//! - `values(suite, param, where?, implementation?)`: the distinct values of a parameter,
//!   ascending, joined with `, `.
//! - `measured(suite, where?, implementation?)`: whether any row of the suite (of that
//!   implementation, among those the where-clause keeps) ran, to guard prose about data that
//!   may be absent.
//! - `over_tolerance(suite, where?, implementation?)`: whether any of those rows that ran has
//!   an error above its tolerance (`accuracy.rel_err > accuracy.tolerance`: the rows the tables
//!   flag), to guard prose that explains such an error.
//! - `launch_bound(suite, implementation, where)`: the claim that an eager call of the
//!   implementation is launch-bound in every case kept, with the range of host ÷ device time.
//! - `dispatch_says(suite, implementation, text)`: whether a document's dispatch record (what
//!   runs by default) has a rule for the implementation whose words contain `text`, to guard
//!   prose about how the measured code works (a run from before a kernel changed keeps its own
//!   rules); false when there is no such document.
//! - `dispatch_dtypes(suite, implementation, on)`: the dtypes of the dispatch rule of the
//!   implementation for the device class that names `on` (e.g. `9.0`; a class "other than
//!   9.0" does not), as `bf16` or `bf16 and fp16`, so that a sentence on which dtypes a kernel
//!   takes follows the run; an error when no rule matches or the matching rules disagree.
//! - `cpu_device(suite)`: the device name of the suite's CPU documents, or an empty string
//!   when there are none (so that `measured(device=...)` on it is false): prose about CPU rows
//!   follows whichever CPU the documents in `data/` were measured on. CPU documents of one
//!   suite from two CPUs are an error (the prose would not know which to quote).
//! - `gpu_device(suite, among?)`: the same for the suite's GPU documents; with `among` (card
//!   names separated by `;`, in order of preference; `*` for any card), the first of them the
//!   suite has documents on, or empty: the curated prose names the cards it was written for,
//!   and follows a rerun on any of them (`among="*"` says whether there is a GPU document).
//! - `gpu_cards(suite)`: the names of every card the suite has GPU documents on (of the run
//!   kind `kind` picks), sorted, joined with `, `; empty when there are none: to say which card
//!   the sentences follow where the tables show several.
//! - `commits(suite, device?)`: the commits (7-character hashes, sorted, joined with `, `) of
//!   the documents picked: to say which code measured the rows a sentence is about.
//! - `failed(suite, text?, status?, where?, implementation?, every?)`: whether a row that did
//!   not run (of that implementation, among those the where-clause keeps) has that status and
//!   a message containing `text`, or with `every=true` whether every row kept is such a row:
//!   to guard prose that says why an alternative has no rows.
//!
//! Every function takes an optional `device` (the device name) and `kind` (`grid`, the default,
//! `decode`: the decoding grid's documents, or `masks`: the masks grid's) to pick documents. A query that
//! matches no row or several, a claim that any case contradicts or that covers no case, and a
//! where-clause that does not parse are all collected; the build then fails with
//! [`ProseError`], which lists each problem with its file, line, call and the offending rows.

pub mod query;

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex};

use tera::{Kwargs, State, Tera, Value};

use self::query::{ok_value, parse_filter, Field, Filter};
use super::templates::{Sources, ATTENTION_PROSE, LIMITATIONS_PROSE, MIXERS_PROSE, PROSE_PRELUDE};
use crate::load::{case_label, Loaded};
use crate::schema::{DeviceKind, Param, Row, Status, Suite};

/// Text that stands in for a failed call while the rest of the file is checked.
const FAILED: &str = "⟨failed⟩";

/// The site's prose rendered to HTML; `None` where a file rendered to nothing (its subject is
/// not measured).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SiteProse {
    /// From [`ATTENTION_PROSE`].
    pub attention: Option<String>,
    /// From [`MIXERS_PROSE`].
    pub mixers: Option<String>,
    /// From [`LIMITATIONS_PROSE`].
    pub limitations: Option<String>,
}

impl SiteProse {
    /// The prose shown at the top of the suite page `file` (`attention.html`), if any.
    pub fn for_page(&self, file: &str) -> Option<&str> {
        match file {
            "attention.html" => self.attention.as_deref(),
            "mixers.html" => self.mixers.as_deref(),
            _ => None,
        }
    }
}

/// Renders the prose files of `sources` against `docs`. Problems name each file by its path
/// under the templates folder it came from (`templates/prose/attention.md`).
///
/// Errors: every failed query and claim of every file ([`ProseError`]).
pub fn render_site_prose(docs: &[Loaded], sources: &Sources) -> Result<SiteProse, ProseError> {
    let prefix = match &sources.dir {
        Some(d) => format!("{}/", d.display()),
        None => "(built-in) ".to_string(),
    };
    let prelude = sources.prose_source(PROSE_PRELUDE).unwrap_or("");
    let pairs: Vec<(&str, &str)> = sources
        .prose
        .iter()
        .filter(|(n, _)| *n != PROSE_PRELUDE)
        .map(|(n, s)| (*n, s.as_str()))
        .collect();
    let mut rendered =
        render_prose_after(docs, (PROSE_PRELUDE, prelude), &pairs).map_err(|mut e| {
            for p in &mut e.problems {
                p.file = format!("{prefix}{}", p.file);
            }
            e
        })?;
    let mut take = |name: &str| rendered.remove(name).filter(|h| !h.trim().is_empty());
    Ok(SiteProse {
        attention: take(ATTENTION_PROSE),
        mixers: take(MIXERS_PROSE),
        limitations: take(LIMITATIONS_PROSE),
    })
}

/// One failed query, claim or template.
#[derive(Debug, Clone, PartialEq)]
pub struct ProseProblem {
    /// The prose file, as named to [`render_prose`].
    pub file: String,
    /// 1-based line of the call, when it could be found in the source.
    pub line: Option<usize>,
    /// The call as written, e.g. `claim(suite="attention", faster="flash", than="math")`.
    pub call: String,
    /// What is wrong, with the rows involved.
    pub message: String,
}

impl fmt::Display for ProseProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.line {
            Some(line) => write!(f, "{}:{line}: ", self.file)?,
            None => write!(f, "{}: ", self.file)?,
        }
        if self.call.is_empty() {
            write!(f, "{}", self.message)
        } else {
            write!(f, "{}: {}", self.call, self.message)
        }
    }
}

/// The prose does not agree with the data: every problem found, in file order.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub struct ProseError {
    /// The problems, at least one.
    pub problems: Vec<ProseProblem>,
}

impl fmt::Display for ProseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the prose does not agree with the data ({} problem{}):",
            self.problems.len(),
            if self.problems.len() == 1 { "" } else { "s" }
        )?;
        for p in &self.problems {
            let text = p.to_string().replace('\n', "\n    ");
            write!(f, "\n  - {text}")?;
        }
        Ok(())
    }
}

/// A call that failed while rendering; located in the source afterwards.
#[derive(Debug)]
struct Failure {
    function: &'static str,
    args: Vec<(String, String)>,
    message: String,
}

impl Failure {
    fn call(&self) -> String {
        format_call(self.function, &self.args)
    }
}

fn format_call(function: &str, args: &[(String, String)]) -> String {
    let args: Vec<String> = args.iter().map(|(k, v)| format!("{k}={v:?}")).collect();
    format!("{function}({})", args.join(", "))
}

/// Renders each `(name, source)` through Tera (with the prose functions) and pulldown-cmark.
/// Returns the HTML by name.
///
/// Errors: every template that does not parse or render, and every failed call, over all
/// files ([`ProseError`]).
pub fn render_prose(
    docs: &[Loaded],
    sources: &[(&str, &str)],
) -> Result<BTreeMap<String, String>, ProseError> {
    render_prose_after(docs, ("", ""), sources)
}

/// [`render_prose`] with `prelude` (its name and its text: Tera statements, such as `{% set
/// cards = ... %}`) put before each source (on a line of its own), so that every file sees what
/// it sets. The prelude is parsed and rendered alone first: its own problems are reported once,
/// under its name (a prelude that does not parse stops there); a file's problems keep the line
/// of the call in the file itself, and a file that does not parse says that Tera's line numbers
/// count the prelude's lines (named relative to the templates folder) first.
///
/// Errors: as [`render_prose`].
pub fn render_prose_after(
    docs: &[Loaded],
    (prelude_name, prelude): (&str, &str),
    sources: &[(&str, &str)],
) -> Result<BTreeMap<String, String>, ProseError> {
    let data = Arc::new(docs.to_vec());
    let failures: Arc<Mutex<Vec<Failure>>> = Arc::default();
    let mut tera = Tera::new();
    register(&mut tera, "value", &data, &failures, value);
    register(&mut tera, "ratio", &data, &failures, ratio);
    register(&mut tera, "claim", &data, &failures, claim);
    register(&mut tera, "case", &data, &failures, case);
    register(&mut tera, "largest", &data, &failures, largest);
    register(&mut tera, "values", &data, &failures, values);
    register(&mut tera, "measured", &data, &failures, measured);
    register(
        &mut tera,
        "over_tolerance",
        &data,
        &failures,
        over_tolerance,
    );
    register(&mut tera, "launch_bound", &data, &failures, launch_bound);
    register(&mut tera, "cpu_device", &data, &failures, cpu_device);
    register(&mut tera, "gpu_device", &data, &failures, gpu_device);
    register(&mut tera, "gpu_cards", &data, &failures, gpu_cards);
    register(&mut tera, "commits", &data, &failures, commits);
    register(&mut tera, "failed", &data, &failures, failed);
    register(&mut tera, "dispatch_says", &data, &failures, dispatch_says);
    register(
        &mut tera,
        "dispatch_dtypes",
        &data,
        &failures,
        dispatch_dtypes,
    );

    let mut problems = Vec::new();
    let mut out = BTreeMap::new();
    let take_failures = || -> Vec<Failure> {
        std::mem::take(
            &mut *failures
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    };
    let prelude = if prelude.is_empty() || prelude.ends_with('\n') {
        prelude.to_string()
    } else {
        format!("{prelude}\n")
    };
    if !prelude.is_empty() {
        let problem = |message: String| ProseProblem {
            file: prelude_name.to_string(),
            line: None,
            call: String::new(),
            message,
        };
        if let Err(e) = tera.add_raw_template(prelude_name, &prelude) {
            problems.push(problem(format!("template does not parse: {e}")));
            return Err(ProseError { problems });
        }
        let rendered = tera.render(prelude_name, &tera::Context::new());
        for f in take_failures() {
            problems.push(ProseProblem {
                file: prelude_name.to_string(),
                line: locate(&prelude, f.function, &f.args),
                call: f.call(),
                message: f.message,
            });
        }
        if let Err(e) = rendered {
            problems.push(problem(format!("template does not render: {e}")));
        }
    }
    for (name, source) in sources {
        let problem = |message: String| ProseProblem {
            file: name.to_string(),
            line: None,
            call: String::new(),
            message,
        };
        let combined = format!("{prelude}{source}");
        if let Err(e) = tera.add_raw_template(name, &combined) {
            problems.push(problem(if prelude.is_empty() {
                format!("template does not parse: {e}")
            } else {
                let n = prelude.lines().count();
                format!(
                    "template does not parse: {e} (Tera's line numbers count the {n} {} of \
                     {prelude_name} put before the file)",
                    if n == 1 { "line" } else { "lines" }
                )
            }));
            continue;
        }
        let rendered = tera.render(name, &tera::Context::new());
        for f in take_failures() {
            let line = locate(source, f.function, &f.args);
            if line.is_none() && locate(&prelude, f.function, &f.args).is_some() {
                // A call of the prelude's, reported once under its name above.
                continue;
            }
            problems.push(ProseProblem {
                file: name.to_string(),
                line,
                call: f.call(),
                message: f.message,
            });
        }
        match rendered {
            Ok(md) => {
                out.insert(name.to_string(), super::markdown::to_html(&md));
            }
            Err(e) => problems.push(problem(format!("template does not render: {e}"))),
        }
    }
    if problems.is_empty() {
        Ok(out)
    } else {
        Err(ProseError { problems })
    }
}

type Call = fn(&[Loaded], &Args) -> Result<Value, String>;

/// Registers `call` as Tera function `name`: a failure is recorded and the call renders as
/// [`FAILED`], so that one build reports every problem.
fn register(
    tera: &mut Tera,
    name: &'static str,
    data: &Arc<Vec<Loaded>>,
    failures: &Arc<Mutex<Vec<Failure>>>,
    call: Call,
) {
    let data = Arc::clone(data);
    let failures = Arc::clone(failures);
    tera.register_function(name, move |kwargs: Kwargs, _: &State| -> Value {
        let args = Args::from_kwargs(&kwargs);
        match call(&data, &args) {
            Ok(v) => v,
            Err(message) => {
                failures
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .push(Failure {
                        function: name,
                        args: args.pairs,
                        message,
                    });
                Value::from(FAILED)
            }
        }
    });
}

/// The 1-based line of the call of `function` in `source` whose text holds the most of the
/// quoted argument values; `None` when no call mentions any.
fn locate(source: &str, function: &str, args: &[(String, String)]) -> Option<usize> {
    let needle = format!("{function}(");
    let mut best: Option<(usize, usize)> = None;
    for (at, _) in source.match_indices(&needle) {
        // Only a whole name: not `my_value(`.
        if source[..at]
            .chars()
            .next_back()
            .is_some_and(|c| c.is_alphanumeric() || c == '_')
        {
            continue;
        }
        let rest = &source[at..];
        let span = &rest[..rest.find(')').map_or(rest.len(), |i| i + 1)];
        let score = args
            .iter()
            .filter(|(k, v)| span.contains(&format!("\"{v}\"")) && span.contains(k.as_str()))
            .count();
        if score > 0 && best.is_none_or(|(s, _)| score > s) {
            best = Some((score, source[..at].matches('\n').count() + 1));
        }
    }
    best.map(|(_, line)| line)
}

/// Keyword arguments of a call, as text, in the order given.
struct Args {
    pairs: Vec<(String, String)>,
}

/// The order arguments are shown in (Tera does not keep the order they were written in).
const ARG_ORDER: [&str; 15] = [
    "suite",
    "device",
    "kind",
    "implementation",
    "num",
    "den",
    "faster",
    "slower",
    "higher",
    "lower",
    "than",
    "param",
    "case",
    "where",
    "field",
];

impl Args {
    fn from_kwargs(kwargs: &Kwargs) -> Args {
        let mut pairs: Vec<(String, String)> = kwargs
            .iter()
            .map(|(k, v)| {
                let v = v
                    .as_str()
                    .map(str::to_string)
                    .unwrap_or_else(|| v.to_string());
                (k.to_string(), v)
            })
            .collect();
        let rank = |k: &str| {
            ARG_ORDER
                .iter()
                .position(|o| *o == k)
                .unwrap_or(ARG_ORDER.len())
        };
        pairs.sort_by(|a, b| rank(&a.0).cmp(&rank(&b.0)).then_with(|| a.0.cmp(&b.0)));
        Args { pairs }
    }

    fn get(&self, name: &str) -> Option<&str> {
        self.pairs
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    fn need(&self, name: &str) -> Result<&str, String> {
        self.get(name)
            .ok_or_else(|| format!("missing argument `{name}`"))
    }

    /// Errors on an argument not in `allowed` nor `kind`, which every function takes (a
    /// misspelt name would otherwise be ignored).
    fn only(&self, allowed: &[&str]) -> Result<(), String> {
        for (k, _) in &self.pairs {
            if k != "kind" && !allowed.contains(&k.as_str()) {
                return Err(format!(
                    "unknown argument `{k}` (arguments: {})",
                    allowed.join(", ")
                ));
            }
        }
        Ok(())
    }

    fn filter(&self, name: &str) -> Result<Filter, String> {
        parse_filter(self.get(name).unwrap_or(""))
            .map_err(|e| format!("{name}=\"{}\": {e}", self.get(name).unwrap_or("")))
    }

    fn field(&self, default: Option<Field>) -> Result<Field, String> {
        match (self.get("field"), default) {
            (Some(f), _) => Field::parse(f),
            (None, Some(d)) => Ok(d),
            (None, None) => Err("missing argument `field`".to_string()),
        }
    }
}

/// One row with the document it belongs to.
#[derive(Clone, Copy)]
struct Item<'a> {
    doc: &'a Loaded,
    row: &'a Row,
}

/// [`suite_rows`] for the functions that answer true or false (`measured`, `over_tolerance`,
/// `failed`): an unknown suite or a missing argument is an error, while no document of the
/// suite (on that device) is `None`, "nothing there", not an error.
fn rows_if_any<'a>(docs: &'a [Loaded], args: &Args) -> Result<Option<Vec<Item<'a>>>, String> {
    match suite_rows(docs, args) {
        Ok(items) => Ok(Some(items)),
        Err(e) if e.starts_with("unknown") || e.starts_with("missing") => Err(e),
        Err(_) => Ok(None),
    }
}

/// The rows of `suite` (on `device` when given) in its documents of run kind `kind` (`grid` when
/// not given; `decode` for the decoding grid, `masks` for the masks grid): a tile sweep has its own section, generated
/// whole from its rows, and is never read by prose.
///
/// Errors: the suite name is unknown, or no document matches.
fn suite_rows<'a>(docs: &'a [Loaded], args: &Args) -> Result<Vec<Item<'a>>, String> {
    Ok(suite_docs(docs, args)?
        .into_iter()
        .flat_map(|doc| doc.doc.rows.iter().map(move |row| Item { doc, row }))
        .collect())
}

/// The kind of run the `kind` argument picks (`grid`, the default, `decode` or `masks`).
fn run_kind(args: &Args) -> Result<crate::schema::RunKind, String> {
    use crate::schema::RunKind;
    match args.get("kind") {
        None | Some("grid") => Ok(RunKind::Grid),
        Some("decode") => Ok(RunKind::Decode),
        Some("masks") => Ok(RunKind::Masks),
        Some(other) => Err(format!(
            "unknown kind `{other}` (kinds: grid, decode, masks)"
        )),
    }
}

/// The documents of the call's `suite` (and `device`, `kind`).
///
/// Errors: an unknown suite or kind; no such document.
fn suite_docs<'a>(docs: &'a [Loaded], args: &Args) -> Result<Vec<&'a Loaded>, String> {
    let name = args.need("suite")?;
    let suite = Suite::ALL
        .into_iter()
        .find(|s| s.as_str() == name)
        .ok_or_else(|| {
            let names: Vec<&str> = Suite::ALL.iter().map(|s| s.as_str()).collect();
            format!("unknown suite `{name}` (suites: {})", names.join(", "))
        })?;
    let device = args.get("device");
    let kind = run_kind(args)?;
    let picked: Vec<&Loaded> = docs
        .iter()
        .filter(|l| {
            l.doc.suite == suite
                && l.doc.config.kind == kind
                && device.is_none_or(|d| l.doc.device.name == d)
        })
        .collect();
    if picked.is_empty() {
        return Err(match device {
            Some(d) => format!("no document of suite {name} on device `{d}`"),
            None => format!("no document of suite {name}"),
        });
    }
    Ok(picked)
}

/// Keeps the rows of `implementation`.
///
/// Errors: the suite has no row of it (the message lists those it has).
fn of_implementation<'a>(
    items: &[Item<'a>],
    implementation: &str,
) -> Result<Vec<Item<'a>>, String> {
    let kept: Vec<Item<'a>> = items
        .iter()
        .filter(|i| i.row.implementation == implementation)
        .copied()
        .collect();
    if kept.is_empty() {
        let mut names: Vec<&str> = items
            .iter()
            .map(|i| i.row.implementation.as_str())
            .collect();
        names.sort_unstable();
        names.dedup();
        return Err(format!(
            "no row of implementation `{implementation}` (implementations: {})",
            names.join(", ")
        ));
    }
    Ok(kept)
}

/// Where a row is: its case, and its device and file when several devices are involved.
fn place(item: &Item<'_>, several_devices: bool) -> String {
    if several_devices {
        format!(
            "{} on {} ({})",
            case_label(&item.row.case),
            item.doc.doc.device.name,
            item.doc.file_name()
        )
    } else {
        case_label(&item.row.case)
    }
}

fn spans_devices(items: &[Item<'_>]) -> bool {
    items
        .windows(2)
        .any(|w| w[0].doc.doc.device.name != w[1].doc.doc.device.name)
}

/// The single row of `implementation` that the `case` argument matches.
fn one_row<'a>(docs: &'a [Loaded], args: &Args, implementation: &str) -> Result<Item<'a>, String> {
    let all = suite_rows(docs, args)?;
    let rows = of_implementation(&all, implementation)?;
    let filter = args.filter("case")?;
    let total = rows.len();
    let many = spans_devices(&rows);
    let kept = filter.apply(rows, |i| i.row)?;
    match kept.as_slice() {
        [one] => Ok(*one),
        [] => Err(format!(
            "matches no row: none of the {total} rows of {implementation} has {}",
            if filter.conds.is_empty() {
                "any case".to_string()
            } else {
                filter.to_string()
            }
        )),
        several => {
            let listed: Vec<String> = several.iter().take(6).map(|i| place(i, many)).collect();
            Err(format!(
                "matches {} rows of {implementation}, not one: {}{}",
                several.len(),
                listed.join("; "),
                if several.len() > listed.len() {
                    "; ..."
                } else {
                    ""
                }
            ))
        }
    }
}

fn value(docs: &[Loaded], args: &Args) -> Result<Value, String> {
    args.only(&["suite", "device", "implementation", "case", "field"])?;
    let field = args.field(None)?;
    let item = one_row(docs, args, args.need("implementation")?)?;
    let v = ok_value(item.row, &item.doc.doc, &field)
        .map_err(|e| format!("{e} ({})", case_label(&item.row.case)))?;
    Ok(Value::from(field.format(v)))
}

fn ratio(docs: &[Loaded], args: &Args) -> Result<Value, String> {
    args.only(&["suite", "device", "num", "den", "case", "field"])?;
    let field = args.field(Some(Field::MedianMs))?;
    let num = one_row(docs, args, args.need("num")?)?;
    let den = one_row(docs, args, args.need("den")?)?;
    if num.row.case != den.row.case || num.doc.doc.device.name != den.doc.doc.device.name {
        return Err(format!(
            "num and den match different cases: {} and {}",
            place(&num, true),
            place(&den, true)
        ));
    }
    // The site's one direction: other ÷ reference, the reference being the default when it
    // is one of the two (so `num` and `den` may be given either way round).
    let (other, reference) = if num.row.default && !den.row.default {
        (den, num)
    } else {
        (num, den)
    };
    let at = |e: String| format!("{e} ({})", case_label(&num.row.case));
    let o = ok_value(other.row, &other.doc.doc, &field).map_err(at)?;
    let r = ok_value(reference.row, &reference.doc.doc, &field).map_err(at)?;
    if r == 0.0 {
        return Err(format!(
            "{} of {} is zero ({})",
            field.name(),
            reference.row.implementation,
            case_label(&reference.row.case)
        ));
    }
    // A time within noise (the faster side's q3 not below the other's q1, the rule of the
    // claims and the tables) says so instead of naming a faster side.
    let within_noise =
        matches!(field, Field::MedianMs) && !times_separate(other.row, o, reference.row, r);
    let html = ratio_html(
        &field,
        o / r,
        o / r,
        &other.row.implementation,
        &reference.row.implementation,
    );
    Ok(Value::safe_string(&if within_noise {
        super::format::within_noise_html(&html)
    } else {
        html
    }))
}

/// A ratio `other ÷ reference` of `field` (or a range of them) as the site shows every ratio:
/// times through [`format::time_ratio_html`], other fields as `r× reference's` with the same
/// marking.
fn ratio_html(field: &Field, lo: f64, hi: f64, other: &str, reference: &str) -> String {
    use super::format;
    match field {
        Field::MedianMs | Field::Q1Ms | Field::Q3Ms => {
            format::time_ratio_html(lo, hi, other, reference)
        }
        _ => {
            let value = if format::ratio(lo) == format::ratio(hi) {
                format::ratio(lo)
            } else {
                format!("{} to {}", format::ratio(lo), format::ratio(hi))
            };
            format!(
                "<span class=\"ratio\" data-ratio=\"{name} of other ÷ {name} of reference\" \
                 data-other=\"{}\" data-reference=\"{}\" data-lo=\"{lo}\" data-hi=\"{hi}\">{value}</span> \
                 ({}'s {name} over {}'s)",
                format::html_escape(other),
                format::html_escape(reference),
                format::html_escape(other),
                format::html_escape(reference),
                name = field.name(),
            )
        }
    }
}

fn case(docs: &[Loaded], args: &Args) -> Result<Value, String> {
    args.only(&["suite", "device", "implementation", "case"])?;
    let filter = args.filter("case")?;
    if filter.conds.is_empty() {
        return Err("missing argument `case`".to_string());
    }
    let all = suite_rows(docs, args)?;
    let rows = match args.get("implementation") {
        Some(i) => of_implementation(&all, i)?,
        None => all,
    };
    let kept = filter.apply(rows, |i| i.row)?;
    let names = filter.params();
    let mut labels: Vec<String> = kept
        .iter()
        .map(|i| {
            names
                .iter()
                .filter_map(|n| i.row.case.get(*n).map(|v| format!("{n}={v}")))
                .collect::<Vec<_>>()
                .join(", ")
        })
        .collect();
    labels.sort();
    labels.dedup();
    match labels.as_slice() {
        [one] => Ok(Value::from(one.as_str())),
        [] => Err(format!("matches no row with {filter}")),
        several => Err(format!(
            "matches {} different cases, not one: {}",
            several.len(),
            several.join("; ")
        )),
    }
}

fn largest(docs: &[Loaded], args: &Args) -> Result<Value, String> {
    args.only(&["suite", "device", "implementation", "param", "where"])?;
    let param = args.need("param")?;
    let filter = args.filter("where")?;
    let all = suite_rows(docs, args)?;
    let rows = match args.get("implementation") {
        Some(i) => of_implementation(&all, i)?,
        None => all,
    };
    let ran: Vec<Item<'_>> = rows
        .into_iter()
        .filter(|i| i.row.status == Status::Ok)
        .collect();
    let kept = filter.apply(ran, |i| i.row)?;
    let largest = kept
        .iter()
        .filter_map(|i| match i.row.case.get(param)? {
            Param::Int(v) => Some(*v as f64),
            Param::Float(v) => Some(*v),
            _ => None,
        })
        .max_by(f64::total_cmp)
        .ok_or_else(|| format!("no row that ran has a numeric `{param}`"))?;
    let shown = kept
        .iter()
        .filter_map(|i| i.row.case.get(param))
        .find(|p| {
            matches!(p, Param::Int(v) if *v as f64 == largest)
                || matches!(p, Param::Float(v) if *v == largest)
        })
        .map(|p| p.to_string())
        .unwrap_or_default();
    Ok(Value::from(shown))
}

fn values(docs: &[Loaded], args: &Args) -> Result<Value, String> {
    args.only(&["suite", "device", "implementation", "param", "where"])?;
    let param = args.need("param")?;
    let filter = args.filter("where")?;
    let all = suite_rows(docs, args)?;
    let rows = match args.get("implementation") {
        Some(i) => of_implementation(&all, i)?,
        None => all,
    };
    let kept = filter.apply(rows, |i| i.row)?;
    let mut seen: Vec<&Param> = kept.iter().filter_map(|i| i.row.case.get(param)).collect();
    if seen.is_empty() {
        return Err(format!("no row has a parameter `{param}`"));
    }
    seen.sort_by(|a, b| query::param_order(a, b));
    seen.dedup();
    let shown: Vec<String> = seen.iter().map(|p| p.to_string()).collect();
    Ok(Value::from(shown.join(", ")))
}

/// `launch_bound(suite, implementation, where)`: a claim that an eager caller of
/// `implementation` is launch-bound in every case the where-clause keeps (its host time to
/// issue a call is at least the document's ratio × the device time of an eager call).
/// Renders the case count and the range of host time ÷ eager device time.
fn launch_bound(docs: &[Loaded], args: &Args) -> Result<Value, String> {
    args.only(&["suite", "device", "implementation", "where"])?;
    let imp = args.need("implementation")?;
    let filter = args.filter("where")?;
    let all = suite_rows(docs, args)?;
    let rows = of_implementation(&all, imp)?;
    let kept = filter.apply(rows, |i| i.row)?;
    let ran: Vec<&Item<'_>> = kept.iter().filter(|i| i.row.status == Status::Ok).collect();
    if ran.is_empty() {
        return Err(format!(
            "no row of {imp} that ran matches {}",
            filter.describe()
        ));
    }
    let mut shares = Vec::new();
    let mut not = Vec::new();
    for i in &ran {
        let ratio = i.doc.doc.config.timing.launch_bound_ratio;
        let device = i.row.eager_median_ms.or(i.row.median_ms);
        match (i.row.host_ms, device) {
            (Some(h), Some(d)) if h >= ratio * d => shares.push(h / d),
            (Some(h), Some(d)) => not.push(format!(
                "{}: host {} ms per call against {} ms of device time (below {}×)",
                case_label(&i.row.case),
                super::format::ms(h),
                super::format::ms(d),
                ratio
            )),
            _ => not.push(format!(
                "{}: no host time recorded",
                case_label(&i.row.case)
            )),
        }
    }
    if !not.is_empty() {
        return Err(format!(
            "{imp} is not launch-bound in {} of {} cases:\n  {}",
            not.len(),
            ran.len(),
            not.join("\n  ")
        ));
    }
    let lo = shares.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = shares.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let range = if super::format::sig(lo, 2) == super::format::sig(hi, 2) {
        super::format::sig(lo, 2)
    } else {
        format!(
            "{} to {}",
            super::format::sig(lo, 2),
            super::format::sig(hi, 2)
        )
    };
    Ok(Value::from(format!(
        "an eager call of {imp} is launch-bound in every measured case {} ({} case{}; host time \
         to issue a call ÷ its device time: {range})",
        if filter.conds.is_empty() {
            String::new()
        } else {
            format!("with {}", filter.describe())
        },
        ran.len(),
        if ran.len() == 1 { "" } else { "s" }
    )))
}

fn cpu_device(docs: &[Loaded], args: &Args) -> Result<Value, String> {
    device_of_kind(docs, args, DeviceKind::Cpu)
}

fn gpu_device(docs: &[Loaded], args: &Args) -> Result<Value, String> {
    device_of_kind(docs, args, DeviceKind::Gpu)
}

/// The one device name of the suite's documents of `kind` (CPU or GPU) and of the run kind
/// the `kind` argument picks (`grid` by default), or an empty string when there are none:
/// `cpu_device` and `gpu_device`. Two names are an error, unless `among` (names separated by
/// `;`, in order of preference; `*` stands for any card, the first by name) is given: then
/// the first of them that has documents, or an empty string when none has.
fn device_of_kind(docs: &[Loaded], args: &Args, kind: DeviceKind) -> Result<Value, String> {
    args.only(&["suite", "kind", "among"])?;
    let (name, names) = device_names(docs, args, kind)?;
    let what = match kind {
        DeviceKind::Cpu => "CPU",
        DeviceKind::Gpu => "GPU",
    };
    // With `among`, the first listed card that has documents (cards not listed are left to
    // the tables and figures).
    if let Some(among) = args.get("among") {
        let first = among.split(';').map(str::trim).find_map(|card| match card {
            "" => None,
            "*" => names.first().copied(),
            card => names.contains(&card).then_some(card),
        });
        return Ok(Value::from(first.unwrap_or("")));
    }
    match names.len() {
        0 | 1 => Ok(Value::from(names.into_iter().next().unwrap_or(""))),
        _ => Err(format!(
            "suite {name} has {what} documents from several {what}s: {}",
            names.into_iter().collect::<Vec<_>>().join(", ")
        )),
    }
}

/// `gpu_cards(suite, kind?)`: every card name of the suite's GPU documents of the run kind,
/// sorted and joined with `, ` (empty when there are none).
fn gpu_cards(docs: &[Loaded], args: &Args) -> Result<Value, String> {
    args.only(&["suite", "kind"])?;
    let (_, names) = device_names(docs, args, DeviceKind::Gpu)?;
    Ok(Value::from(
        names.into_iter().collect::<Vec<_>>().join(", "),
    ))
}

/// The call's `suite` and the names of the devices of `kind` (CPU or GPU) its documents of the
/// run kind (`kind` argument, `grid` by default) were measured on, sorted.
///
/// Errors: an unknown suite or run kind.
fn device_names<'a>(
    docs: &'a [Loaded],
    args: &'a Args,
    kind: DeviceKind,
) -> Result<(&'a str, std::collections::BTreeSet<&'a str>), String> {
    let name = args.need("suite")?;
    if !Suite::ALL.iter().any(|s| s.as_str() == name) {
        return Err(format!("unknown suite `{name}`"));
    }
    let run = run_kind(args)?;
    let names = docs
        .iter()
        .filter(|l| {
            l.doc.suite.as_str() == name && l.doc.device.kind == kind && l.doc.config.kind == run
        })
        .map(|l| l.doc.device.name.as_str())
        .collect();
    Ok((name, names))
}

/// `commits(suite, device?, kind?)`: the short commits of the documents picked, sorted and
/// joined with `, `.
///
/// Errors: no such document.
fn commits(docs: &[Loaded], args: &Args) -> Result<Value, String> {
    args.only(&["suite", "device", "kind"])?;
    let picked = suite_docs(docs, args)?;
    let hashes: std::collections::BTreeSet<String> = picked
        .iter()
        .map(|l| super::format::short_commit(&l.doc.config.git_commit))
        .collect();
    Ok(Value::from(
        hashes.into_iter().collect::<Vec<_>>().join(", "),
    ))
}

/// Whether a row that did not run, of `implementation` among those the where-clause keeps,
/// has `status` (`oom`, `unsupported`, `error`, `timeout`; any of them when not given) and a
/// message containing `text` (any message when not given; one of the two is required): to
/// guard prose that explains why an alternative has no rows. With `every=true`, whether every
/// such row of those kept (whatever its status) is one: a sentence about all of them.
fn failed(docs: &[Loaded], args: &Args) -> Result<Value, String> {
    args.only(&[
        "suite",
        "device",
        "kind",
        "where",
        "implementation",
        "text",
        "status",
        "every",
    ])?;
    let filter = args.filter("where")?;
    let implementation = args.get("implementation");
    let text = args.get("text");
    let status = match args.get("status") {
        None => None,
        Some(s) => Some(
            [
                Status::Oom,
                Status::Unsupported,
                Status::Error,
                Status::Timeout,
            ]
            .into_iter()
            .find(|v| v.as_str() == s)
            .ok_or_else(|| {
                format!("unknown status `{s}` (statuses that did not run: oom, unsupported, error, timeout)")
            })?,
        ),
    };
    if text.is_none() && status.is_none() {
        return Err("failed() needs `text` or `status`".to_string());
    }
    let every = match args.get("every") {
        None | Some("false") => false,
        Some("true") => true,
        Some(other) => return Err(format!("`every` is true or false, not `{other}`")),
    };
    let Some(items) = rows_if_any(docs, args)? else {
        return Ok(Value::from(false));
    };
    let mine: Vec<_> = items
        .into_iter()
        .filter(|i| implementation.is_none_or(|imp| i.row.implementation == imp))
        .collect();
    if mine.is_empty() {
        return Ok(Value::from(false));
    }
    let kept = filter.apply(mine, |i| i.row)?;
    let is_failure = |row: &Row| {
        row.status != Status::Ok
            && status.is_none_or(|s| row.status == s)
            && text.is_none_or(|t| row.message.as_deref().is_some_and(|m| m.contains(t)))
    };
    Ok(Value::from(if every {
        !kept.is_empty() && kept.iter().all(|i| is_failure(i.row))
    } else {
        kept.iter().any(|i| is_failure(i.row))
    }))
}

fn dispatch_says(docs: &[Loaded], args: &Args) -> Result<Value, String> {
    args.only(&["suite", "device", "kind", "implementation", "text"])?;
    let implementation = args.need("implementation")?;
    let text = args.need("text")?;
    let picked = match suite_docs(docs, args) {
        Ok(picked) => picked,
        Err(e) if e.starts_with("unknown") || e.starts_with("missing") => return Err(e),
        Err(_) => return Ok(Value::from(false)),
    };
    Ok(Value::from(picked.iter().any(|l| {
        l.doc
            .config
            .dispatch
            .iter()
            .any(|d| d.implementation == implementation && d.rule.contains(text))
    })))
}

fn dispatch_dtypes(docs: &[Loaded], args: &Args) -> Result<Value, String> {
    args.only(&["suite", "device", "kind", "implementation", "on"])?;
    let implementation = args.need("implementation")?;
    let on = args.need("on")?;
    let mut found: Vec<&str> = suite_docs(docs, args)?
        .iter()
        .flat_map(|l| l.doc.config.dispatch.iter())
        .filter(|d| {
            d.implementation == implementation
                && d.device.contains(on)
                && !d.device.contains(&format!("other than {on}"))
        })
        .map(|d| d.dtype.as_str())
        .collect();
    found.sort_unstable();
    found.dedup();
    match found.as_slice() {
        [] => Err(format!(
            "no dispatch rule of `{implementation}` for a device class containing `{on}`"
        )),
        [one] => {
            let dtypes: Vec<&str> = one.split(',').map(str::trim).collect();
            Ok(Value::from(match dtypes.as_slice() {
                [.., last] if dtypes.len() > 1 => {
                    format!("{} and {last}", dtypes[..dtypes.len() - 1].join(", "))
                }
                _ => one.trim().to_string(),
            }))
        }
        several => Err(format!(
            "the dispatch rules of `{implementation}` on `{on}` disagree on dtypes: {}",
            several.join(" / ")
        )),
    }
}

fn measured(docs: &[Loaded], args: &Args) -> Result<Value, String> {
    ran_where(docs, args, |_| true)
}

fn over_tolerance(docs: &[Loaded], args: &Args) -> Result<Value, String> {
    ran_where(docs, args, |row| {
        row.accuracy
            .as_ref()
            .is_some_and(|a| a.rel_err > a.tolerance)
    })
}

/// Whether any row that ran (of `implementation`, kept by `where`) satisfies `keep`: `measured`
/// and `over_tolerance`.
fn ran_where(
    docs: &[Loaded],
    args: &Args,
    keep: impl Fn(&crate::schema::Row) -> bool,
) -> Result<Value, String> {
    args.only(&["suite", "device", "where", "implementation"])?;
    let filter = args.filter("where")?;
    let implementation = args.get("implementation");
    let Some(items) = rows_if_any(docs, args)? else {
        return Ok(Value::from(false));
    };
    let ok: Vec<_> = items
        .into_iter()
        .filter(|i| i.row.status == Status::Ok)
        .filter(|i| implementation.is_none_or(|imp| i.row.implementation == imp))
        .filter(|i| keep(i.row))
        .collect();
    if ok.is_empty() {
        return Ok(Value::from(false));
    }
    // A misspelt parameter is an error (the filter names it), not "not measured".
    let kept = filter.apply(ok, |i| i.row)?;
    Ok(Value::from(!kept.is_empty()))
}

/// Whether two rows' times `ta` and `tb` differ beyond the noise: the faster one's q3 below
/// the slower one's q1 (true when either row lacks its quartiles). The rule of the claims and
/// the ratios alike.
fn times_separate(a: &Row, ta: f64, b: &Row, tb: f64) -> bool {
    match (a.q1_ms, a.q3_ms, b.q1_ms, b.q3_ms) {
        (Some(aq1), Some(aq3), Some(bq1), Some(bq3)) => {
            if ta < tb {
                aq3 < bq1
            } else {
                bq3 < aq1
            }
        }
        _ => true,
    }
}

/// How a claim compares the two implementations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Relation {
    Faster,
    Slower,
    Higher,
    Lower,
}

fn claim(docs: &[Loaded], args: &Args) -> Result<Value, String> {
    args.only(&[
        "suite", "device", "faster", "slower", "higher", "lower", "than", "where", "field",
    ])?;
    let given: Vec<(Relation, &str)> = [
        (Relation::Faster, "faster"),
        (Relation::Slower, "slower"),
        (Relation::Higher, "higher"),
        (Relation::Lower, "lower"),
    ]
    .into_iter()
    .filter_map(|(r, k)| args.get(k).map(|a| (r, a)))
    .collect();
    let [(relation, a)] = given.as_slice() else {
        return Err("give exactly one of faster=, slower=, higher=, lower=".to_string());
    };
    let (relation, a) = (*relation, *a);
    let b = args.need("than")?;
    let field = match relation {
        Relation::Faster | Relation::Slower => {
            if args.get("field").is_some() {
                return Err("faster= and slower= compare median_ms; give no field".to_string());
            }
            Field::MedianMs
        }
        Relation::Higher | Relation::Lower => args.field(None)?,
    };
    let filter = args.filter("where")?;
    let where_text = if filter.conds.is_empty() {
        String::new()
    } else {
        format!(" with {}", filter.describe())
    };
    let statement = match relation {
        Relation::Faster => format!("{a} is faster than {b} in every measured case{where_text}"),
        Relation::Slower => format!("{a} is slower than {b} in every measured case{where_text}"),
        Relation::Higher => format!(
            "{a} has a higher {} than {b} in every measured case{where_text}",
            field.name()
        ),
        Relation::Lower => format!(
            "{a} has a lower {} than {b} in every measured case{where_text}",
            field.name()
        ),
    };

    let all = suite_rows(docs, args)?;
    let mut rows = of_implementation(&all, a)?;
    rows.extend(of_implementation(&all, b)?);
    let kept = filter.apply(rows, |i| i.row)?;
    let many = spans_devices(&kept);
    // Pair the rows of a and b by device and case (shards of one grid pair across files).
    let mut pairs: BTreeMap<(String, String), (Option<Item<'_>>, Option<Item<'_>>)> =
        BTreeMap::new();
    for item in &kept {
        let key = (
            item.doc.doc.device.name.clone(),
            serde_json::to_string(&item.row.case).unwrap_or_default(),
        );
        let slot = pairs.entry(key).or_default();
        if item.row.implementation == a {
            slot.0 = Some(*item);
        } else {
            slot.1 = Some(*item);
        }
    }
    // Each case where both ran: beyond the noise (the faster side's q3 below the other's
    // q1, for times), within it, not comparable (a launch-bound timing), or against the claim.
    let time = matches!(field, Field::MedianMs);
    let mut supported: Vec<(f64, bool)> = Vec::new();
    // The cases counted as measured (supported, within noise or launch-bound), for the words.
    let mut compared: Vec<&BTreeMap<String, Param>> = Vec::new();
    let mut within_noise = 0usize;
    let mut launch_bound = 0usize;
    let mut left_out = 0usize;
    let mut contradictions: Vec<String> = Vec::new();
    for (x, y) in pairs.values() {
        let (Some(x), Some(y)) = (x, y) else {
            left_out += 1;
            continue;
        };
        let (Some(vx), Some(vy)) = (
            ok_value(x.row, &x.doc.doc, &field).ok(),
            ok_value(y.row, &y.doc.doc, &field).ok(),
        ) else {
            left_out += 1;
            continue;
        };
        compared.push(&x.row.case);
        if time
            && (super::model::groups::launch_bound(x.row, &x.doc.doc)
                || super::model::groups::launch_bound(y.row, &y.doc.doc))
        {
            launch_bound += 1;
            continue;
        }
        let holds = match relation {
            Relation::Faster | Relation::Lower => vx < vy,
            Relation::Slower | Relation::Higher => vx > vy,
        };
        // For times, "faster" must hold beyond both interquartile ranges.
        let beyond = !time || times_separate(x.row, vx, y.row, vy);
        if !beyond {
            within_noise += 1;
            continue;
        }
        if holds {
            // other ÷ reference, the reference being the default when it is one of the two.
            let y_is_reference = y.row.default || !x.row.default;
            let r = if y_is_reference { vx / vy } else { vy / vx };
            supported.push((r, y_is_reference));
        } else {
            contradictions.push(format!(
                "{}: {a} {} {}, {b} {} {}",
                place(x, many),
                field.name(),
                field.format(vx),
                field.name(),
                field.format(vy)
            ));
        }
    }
    if !contradictions.is_empty() {
        return Err(format!(
            "claim \"{statement}\" does not hold in {} of {} cases:\n  {}",
            contradictions.len(),
            contradictions.len() + supported.len() + within_noise,
            contradictions.join("\n  ")
        ));
    }
    if supported.is_empty() {
        return Err(format!(
            "claim \"{statement}\" is supported by no measured case ({} matching case{}: \
             {within_noise} within the noise, {launch_bound} launch-bound, {left_out} where \
             either did not run)",
            pairs.len(),
            if pairs.len() == 1 { "" } else { "s" }
        ));
    }
    let lo = supported.iter().map(|s| s.0).fold(f64::INFINITY, f64::min);
    let hi = supported
        .iter()
        .map(|s| s.0)
        .fold(f64::NEG_INFINITY, f64::max);
    let b_is_reference = supported[0].1;
    let (other, reference) = if b_is_reference { (a, b) } else { (b, a) };
    let detail = ratio_html(&field, lo, hi, other, reference);
    let n = supported.len();
    // Published, the cases are named by the values they hold (`head_dim 64 or 128`), not by
    // the clause that picked them (`head_dim >= 64, head_dim <= 128, head_dim != 96`).
    let statement = if where_text.is_empty() {
        statement
    } else {
        statement.replacen(
            &where_text,
            &format!(
                " with {}",
                super::format::html_escape(&filter.describe_values(&compared))
            ),
            1,
        )
    };
    // What the cases vary in beyond the filter (GQA beside MHA, say), said beside the count,
    // so that a range is not read as the filter's cases alone.
    let varying = super::format::html_escape(&filter.describe_varying(&compared));
    let statement = if within_noise + launch_bound == 0 {
        statement
    } else {
        statement.replacen(
            "in every measured case",
            &format!(
                "in {n} of {} measured cases",
                n + within_noise + launch_bound
            ),
            1,
        )
    };
    let cases = if n == 1 { "case" } else { "cases" };
    let mut notes = Vec::new();
    if within_noise > 0 {
        notes.push(format!("within noise in {within_noise}"));
    }
    if launch_bound > 0 {
        notes.push(format!("launch-bound, so not compared, in {launch_bound}"));
    }
    match left_out {
        0 => {}
        1 => notes.push("one case where either did not run is left out".to_string()),
        k => notes.push(format!("{k} cases where either did not run are left out")),
    }
    let notes: String = notes.iter().map(|n| format!("; {n}")).collect();
    // `in 11 of 12 measured cases` already counts them.
    let count = if within_noise + launch_bound == 0 {
        format!("{n} {cases}")
    } else {
        String::new()
    };
    let scope = match (count.is_empty(), varying.is_empty()) {
        (false, true) => format!("{count}; "),
        (false, false) => format!("{count} across {varying}; "),
        (true, false) => format!("across {varying}; "),
        (true, true) => String::new(),
    };
    Ok(Value::safe_string(&format!(
        "{statement} ({scope}{detail}{notes})"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locate_finds_the_call_with_most_arguments() {
        let src = "a\n{{ claim(suite=\"attention\", faster=\"x\", than=\"y\") }}\n{{ claim(suite=\"attention\", faster=\"x\", than=\"z\") }}\n";
        let args = |than: &str| {
            vec![
                ("suite".to_string(), "attention".to_string()),
                ("faster".to_string(), "x".to_string()),
                ("than".to_string(), than.to_string()),
            ]
        };
        assert_eq!(locate(src, "claim", &args("y")), Some(2));
        assert_eq!(locate(src, "claim", &args("z")), Some(3));
        assert_eq!(locate(src, "value", &args("z")), None);
    }

    #[test]
    fn problem_display_names_file_line_and_call() {
        let p = ProseProblem {
            file: "p.md".into(),
            line: Some(3),
            call: format_call("value", &[("field".into(), "tflops".into())]),
            message: "matches no row".into(),
        };
        assert_eq!(
            p.to_string(),
            "p.md:3: value(field=\"tflops\"): matches no row"
        );
    }
}
