//! The page model: everything the pages and figures show, computed from the loaded documents.
//!
//! Every number on the site is formatted here from a row of `data/`; templates only lay the
//! model out, and figures only draw the [`FigureSpec`]s listed here. Nothing here touches the
//! disk.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use super::format;
use crate::load::Loaded;
use crate::schema::{Document, Param, Row, Status, Suite, TimingConfig};

/// The case parameter drawn on the x axis and used as the table row key when present.
pub const X_PARAM: &str = "seq_len";

/// Command that produces the attention document.
pub const ATTENTION_COMMAND: &str =
    "cargo run --release --bin attention -- --compare torch --output data/gpu_attention.json";

/// Command that builds the site.
pub const DOCGEN_COMMAND: &str = "cargo run --release --bin docgen -- build";
/// The command that writes the figures alone.
pub const FIGURES_COMMAND: &str = "cargo run --release --bin docgen -- figures --out figures";

/// Fixed palette; implementation `i` of the site-wide sorted list gets colour `i % len`.
pub const PALETTE: [&str; 10] = [
    "#4e79a7", "#f28e2b", "#e15759", "#59a14f", "#b07aa1", "#76b7b2", "#9c755f", "#d37295",
    "#b8860b", "#555555",
];

/// The suite pages, in navigation order: file, title, suites shown.
pub const SUITE_PAGES: [(&str, &str, &[Suite]); 3] = [
    ("attention.html", "Attention", &[Suite::Attention]),
    (
        "mixers.html",
        "Sequence mixers, kernel sums and MoE",
        &[Suite::SequenceMixers, Suite::KernelSums, Suite::Moe],
    ),
    ("models.html", "Models", &[Suite::Models]),
];

/// File and title of the Hopper page.
pub const HOPPER_PAGE: (&str, &str) = ("hopper.html", "Hopper (H200)");

/// The command that reproduces document `l`: the recorded command line with the runner run
/// through cargo from the repository root and `--output` pointed at the document's own file in
/// `data/` (the recorded path was the measuring machine's).
pub fn reproduce_command(l: &Loaded) -> String {
    let argv = &l.doc.config.command;
    let mut out: Vec<String> = Vec::with_capacity(argv.len() + 5);
    let mut args = argv.iter();
    match args.next() {
        Some(bin) if *bin == l.doc.config.runner => {
            out.extend(
                ["cargo", "run", "--release", "--bin", bin.as_str(), "--"].map(String::from),
            );
        }
        Some(other) => out.push(other.clone()),
        None => return String::new(),
    }
    let mut replace_next = false;
    for a in args {
        if replace_next {
            out.push(format!("data/{}", l.file_name()));
            replace_next = false;
        } else if let Some(_path) = a.strip_prefix("--output=") {
            out.push(format!("--output=data/{}", l.file_name()));
        } else {
            replace_next = a == "--output";
            out.push(a.clone());
        }
    }
    format::shell_join(&out)
}

/// The commands that reproduce `docs` (one per document, [`reproduce_command`]) followed by the
/// command that builds the site, pages and figures, from them.
fn reproduce_commands<'a>(docs: impl Iterator<Item = &'a Loaded>) -> Vec<CommandView> {
    docs.map(|l| CommandView {
        label: format!("{} ({})", l.file_name(), l.doc.suite.title()),
        command: reproduce_command(l),
    })
    .chain(std::iter::once(CommandView {
        label: "the site, pages and figures".to_string(),
        command: DOCGEN_COMMAND.to_string(),
    }))
    .collect()
}

/// The command that measures `suite`, when its runner exists.
pub fn measure_command(suite: Suite) -> Option<&'static str> {
    match suite {
        Suite::Attention => Some(ATTENTION_COMMAND),
        _ => None,
    }
}

/// The whole site.
#[derive(Debug)]
pub struct SiteModel {
    /// `index.html`.
    pub index: IndexPage,
    /// One per entry of [`SUITE_PAGES`].
    pub suite_pages: Vec<SuitePage>,
    /// `hopper.html`.
    pub hopper: HopperPage,
    /// Every figure to draw, each written to its `file`.
    pub figures: Vec<FigureSpec>,
    /// The At a glance bar chart, when any ratio exists.
    pub glance_chart: Option<GlanceChart>,
}

/// Links and names shared by every page.
#[derive(Debug, Serialize, Clone)]
pub struct Layout {
    /// Page title.
    pub title: String,
    /// This page's file name.
    pub file: String,
    /// Prefix of internal links: empty (relative) or the base URL ending in `/`.
    pub base: String,
    /// Navigation links.
    pub nav: Vec<NavLink>,
}

/// One navigation link.
#[derive(Debug, Serialize, Clone)]
pub struct NavLink {
    /// Target, already prefixed with the base.
    pub href: String,
    /// Text.
    pub label: String,
    /// True on the page it points to.
    pub current: bool,
}

/// A label and a value.
#[derive(Debug, Serialize, Clone)]
pub struct KeyValue {
    /// Label.
    pub key: String,
    /// Value.
    pub value: String,
}

/// The overview page.
#[derive(Debug, Serialize)]
pub struct IndexPage {
    /// Layout.
    pub layout: Layout,
    /// Links to the four suite pages.
    pub pages: Vec<PageLink>,
    /// True when no document was loaded.
    pub empty: bool,
    /// Every (group, x) with a default implementation.
    pub glance: Vec<GlanceRow>,
    /// Site-relative path of the At a glance chart.
    pub glance_figure: Option<FigureRef>,
    /// One entry per document.
    pub setup: Vec<SetupDoc>,
    /// One entry per distinct timing configuration.
    pub methodology: Vec<TimingView>,
    /// Dispatch rules of every document.
    pub dispatch: Vec<DispatchView>,
    /// Generated list of limitations.
    pub limitations: Vec<Limitation>,
    /// Commands that reproduce the data, then the site.
    pub reproduce: Vec<CommandView>,
}

/// A link to a page with a short status.
#[derive(Debug, Serialize)]
pub struct PageLink {
    /// Target.
    pub href: String,
    /// Page title.
    pub title: String,
    /// Rows shown on it.
    pub rows: usize,
}

/// One (group, x) comparison of the default against the fastest accurate alternative.
#[derive(Debug, Serialize, Clone)]
pub struct GlanceRow {
    /// Suite title.
    pub suite: String,
    /// Device name.
    pub device: String,
    /// Group parameters.
    pub group: String,
    /// Link to the group's table.
    pub href: String,
    /// The x parameter value (`seq_len`), or `—`.
    pub x: String,
    /// Default implementation.
    pub default_impl: String,
    /// Its median, ms, or its status.
    pub default_ms: String,
    /// Fastest accurate alternative, when one ran.
    pub alternative: Option<String>,
    /// Its median, ms.
    pub alternative_ms: Option<String>,
    /// alternative time ÷ default time, formatted; above 1 means the default is faster.
    pub ratio: Option<String>,
    /// Why there is no ratio.
    pub note: Option<String>,
    /// True for the largest x of the group with a ratio (drawn in the chart).
    pub representative: bool,
    /// The ratio itself (for the chart).
    #[serde(skip)]
    pub ratio_value: Option<f64>,
    /// (alternative q1 ÷ default q3, alternative q3 ÷ default q1), when all four quartiles
    /// exist (for the chart's whisker).
    #[serde(skip)]
    pub ratio_range: Option<(f64, f64)>,
    /// True when the document was measured on the CPU (`device.kind == cpu`).
    #[serde(skip)]
    pub cpu: bool,
}

/// Where a figure is and what it shows.
#[derive(Debug, Serialize, Clone)]
pub struct FigureRef {
    /// Link, base-prefixed.
    pub src: String,
    /// Alternative text.
    pub alt: String,
}

/// What one document says about its machine and software.
#[derive(Debug, Serialize)]
pub struct SetupDoc {
    /// Data file name.
    pub file: String,
    /// Suite title.
    pub suite: String,
    /// Device facts.
    pub device: Vec<KeyValue>,
    /// Library versions.
    pub libraries: Vec<KeyValue>,
    /// Runner, commit and times.
    pub run: Vec<KeyValue>,
}

/// Timing parameters, formatted, with the documents that used them.
#[derive(Debug, Serialize, Clone, PartialEq)]
pub struct TimingView {
    /// Data files using these parameters.
    pub files: String,
    /// Warm-up calls.
    pub warmup_calls: String,
    /// Timed samples.
    pub repeats: String,
    /// Minimum sample length, ms.
    pub min_sample_ms: String,
    /// Cap on calls per sample.
    pub max_inner: String,
    /// L2 rotation factor.
    pub l2_rotation_factor: String,
    /// Case timeout, s.
    pub case_timeout_s: String,
    /// Input sets seen in the rows (`2–8`), or `—`.
    pub input_sets: String,
    /// References seen in the rows.
    pub references: String,
    /// Samples the accuracy checks covered, as recorded.
    pub checked: String,
    /// How `peak_mb` was read, each method with the implementations that used it.
    pub peak_methods: String,
    /// The FLOP-counting rules the runners recorded (`config.flop_rule`), or empty.
    pub flop_rules: String,
}

/// One dispatch rule with its document.
#[derive(Debug, Serialize)]
pub struct DispatchView {
    /// Data file.
    pub file: String,
    /// Entry point.
    pub entry_point: String,
    /// Device class.
    pub device: String,
    /// Dtypes.
    pub dtype: String,
    /// Shape rule.
    pub rule: String,
    /// Implementation picked.
    pub implementation: String,
}

/// One generated limitation.
#[derive(Debug, Serialize, Clone)]
pub struct Limitation {
    /// `faster alternative`, `default did not run` or `above tolerance`.
    pub kind: String,
    /// Where: suite, device, group and x.
    pub place: String,
    /// Link to the group's table.
    pub href: String,
    /// What the data says, with its figures.
    pub detail: String,
}

/// A command to show, highlighted when rendered.
#[derive(Debug, Serialize, Clone)]
pub struct CommandView {
    /// What it does.
    pub label: String,
    /// The command line, shell-quoted.
    pub command: String,
}

/// A suite page.
#[derive(Debug, Serialize)]
pub struct SuitePage {
    /// Layout.
    pub layout: Layout,
    /// One section per suite of the page.
    pub sections: Vec<SuiteSection>,
    /// The commands that reproduce this page's documents, then the page itself.
    pub reproduce: Vec<CommandView>,
}

/// One suite on a page.
#[derive(Debug, Serialize)]
pub struct SuiteSection {
    /// Suite title.
    pub title: String,
    /// Anchor.
    pub anchor: String,
    /// True when some document holds rows of the suite.
    pub measured: bool,
    /// Command that measures it, when a runner exists.
    pub command: Option<CommandView>,
    /// One entry per document of the suite.
    pub documents: Vec<DocSection>,
}

/// The groups of one document.
#[derive(Debug, Serialize)]
pub struct DocSection {
    /// Data file.
    pub file: String,
    /// Device name (and compute capability).
    pub device: String,
    /// Groups of rows sharing every parameter but the x parameter.
    pub groups: Vec<GroupView>,
}

/// Header of an implementation column.
#[derive(Debug, Serialize, Clone)]
pub struct ImplHeader {
    /// Implementation.
    pub name: String,
    /// Library providing it.
    pub library: String,
    /// True for the default implementation.
    pub is_default: bool,
    /// Its colour (CSS hex).
    pub colour: String,
}

/// One table: rows by x, columns by implementation.
#[derive(Debug, Serialize)]
pub struct GroupView {
    /// Anchor.
    pub anchor: String,
    /// Parameters shared by the group, `name=value` joined.
    pub title: String,
    /// Name of the x parameter.
    pub x_name: String,
    /// Columns.
    pub implementations: Vec<ImplHeader>,
    /// Rows.
    pub rows: Vec<TableRow>,
    /// The group's figure: median time against x.
    pub figure: Option<FigureRef>,
    /// Peak memory against x, when some row recorded `memory.peak_mb`.
    pub memory_figure: Option<FigureRef>,
    /// Relative error against x with the tolerance, when some row recorded `accuracy`.
    pub error_figure: Option<FigureRef>,
    /// Memory figures of rows that have them.
    pub memory: Vec<MemoryRow>,
}

/// One table row.
#[derive(Debug, Serialize)]
pub struct TableRow {
    /// The x value.
    pub x: String,
    /// One cell per implementation, in column order.
    pub cells: Vec<Cell>,
}

/// One table cell.
#[derive(Debug, Serialize)]
pub struct Cell {
    /// `ok`, `failed` (a row that did not run) or `missing` (no row).
    pub kind: &'static str,
    /// Implementation.
    pub implementation: String,
    /// Median ms.
    pub median: Option<String>,
    /// `q1–q3` ms.
    pub iqr: Option<String>,
    /// TFLOP/s.
    pub tflops: Option<String>,
    /// Relative error.
    pub rel_err: Option<String>,
    /// Tolerance, when above it.
    pub tolerance: Option<String>,
    /// True when rel_err > tolerance.
    pub above_tolerance: bool,
    /// Compile (or first-call) time, s.
    pub compile_s: Option<String>,
    /// Status name.
    pub status: String,
    /// The row's message.
    pub message: Option<String>,
}

/// Memory figures of one row.
#[derive(Debug, Serialize)]
pub struct MemoryRow {
    /// The x value.
    pub x: String,
    /// Implementation.
    pub implementation: String,
    /// Arguments MB.
    pub arguments_mb: String,
    /// Outputs MB.
    pub outputs_mb: String,
    /// Temporaries MB.
    pub temporaries_mb: String,
    /// Residuals MB.
    pub residuals_mb: String,
    /// Peak MB.
    pub peak_mb: String,
    /// How the peak was read.
    pub peak_method: String,
}

/// The Hopper page.
#[derive(Debug, Serialize)]
pub struct HopperPage {
    /// Layout.
    pub layout: Layout,
    /// True when some document ran on compute capability 9.x.
    pub measured: bool,
    /// Command that measures attention there.
    pub command: CommandView,
    /// Summary by suite.
    pub suites: Vec<HopperSuite>,
    /// The commands that reproduce the Hopper documents, then the page itself.
    pub reproduce: Vec<CommandView>,
}

/// Best throughput per implementation in one suite on Hopper.
#[derive(Debug, Serialize)]
pub struct HopperSuite {
    /// Suite title.
    pub title: String,
    /// Anchor (the suite's snake_case name).
    pub anchor: String,
    /// Devices.
    pub devices: String,
    /// One line per implementation.
    pub implementations: Vec<HopperImpl>,
}

/// One implementation's best row on Hopper.
#[derive(Debug, Serialize)]
pub struct HopperImpl {
    /// Implementation.
    pub name: String,
    /// Library.
    pub library: String,
    /// True for the default.
    pub is_default: bool,
    /// Best TFLOP/s, or `—`.
    pub best_tflops: String,
    /// Case of the best row.
    pub best_case: String,
    /// `ok rows / rows`.
    pub rows_ok: String,
}

/// One line figure: a measured quantity (time, peak memory or relative error) against x,
/// log-log.
#[derive(Debug, Clone)]
pub struct FigureSpec {
    /// Site-relative path, `figures/<suite>-<hash>.svg` (time), `…-memory.svg`, `…-error.svg`.
    pub file: String,
    /// SVG `<title>`.
    pub title: String,
    /// SVG `<desc>`.
    pub desc: String,
    /// x axis label.
    pub x_label: String,
    /// y axis label, with its unit.
    pub y_label: String,
    /// One line per implementation.
    pub series: Vec<Series>,
    /// Horizontal dashed lines (value, legend label), e.g. the accuracy tolerance.
    pub reference_lines: Vec<(f64, String)>,
}

/// One implementation in a figure.
#[derive(Debug, Clone)]
pub struct Series {
    /// Legend label.
    pub name: String,
    /// Colour (CSS hex).
    pub colour: String,
    /// (x, median ms) of ok rows, x ascending.
    pub points: Vec<(f64, f64)>,
    /// (x, status) of rows that did not run.
    pub failed: Vec<(f64, String)>,
}

/// The At a glance bar chart.
#[derive(Debug, Clone)]
pub struct GlanceChart {
    /// Site-relative path.
    pub file: String,
    /// SVG `<title>`.
    pub title: String,
    /// SVG `<desc>`.
    pub desc: String,
    /// One bar per representative comparison.
    pub bars: Vec<GlanceBar>,
}

/// One bar.
#[derive(Debug, Clone)]
pub struct GlanceBar {
    /// Label drawn beside the bar.
    pub label: String,
    /// alternative ÷ default.
    pub ratio: f64,
    /// Range of the ratio from both interquartile ranges: (alternative q1 ÷ default q3,
    /// alternative q3 ÷ default q1); `None` when a quartile is missing.
    pub range: Option<(f64, f64)>,
}

/// Sort key of a parameter value: numbers sort numerically, then text.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum ParamKey {
    Bool(bool),
    Num(i64, u64),
    Text(String),
}

fn param_key(p: &Param) -> ParamKey {
    match p {
        Param::Bool(b) => ParamKey::Bool(*b),
        Param::Int(i) => ParamKey::Num(*i, 0),
        Param::Float(x) => {
            // Total order on floats: integer part, then the fraction's bits.
            let fl = x.floor();
            let int = if fl.is_finite() { fl as i64 } else { 0 };
            ParamKey::Num(int, (x - fl).to_bits())
        }
        Param::Text(s) => ParamKey::Text(s.clone()),
    }
}

fn param_f64(p: &Param) -> Option<f64> {
    match p {
        Param::Int(i) => Some(*i as f64),
        Param::Float(x) => Some(*x),
        _ => None,
    }
}

/// Rows at one x value, by implementation, with the x parameter itself.
type RowsAtX<'a> = (Option<&'a Param>, BTreeMap<&'a str, &'a Row>);

/// Rows of one document sharing every parameter but [`X_PARAM`].
struct Group<'a> {
    /// The shared parameters.
    params: BTreeMap<String, Param>,
    /// x value (None when the rows have no x parameter) -> implementation -> row.
    by_x: BTreeMap<Option<ParamKey>, RowsAtX<'a>>,
}

impl Group<'_> {
    fn title(&self) -> String {
        crate::load::case_label(&self.params)
    }
}

fn group_rows(doc: &Document) -> Vec<Group<'_>> {
    let mut groups: BTreeMap<Vec<(String, ParamKey)>, Group<'_>> = BTreeMap::new();
    for row in &doc.rows {
        let mut params = row.case.clone();
        params.remove(X_PARAM);
        let key: Vec<(String, ParamKey)> = params
            .iter()
            .map(|(k, v)| (k.clone(), param_key(v)))
            .collect();
        let x = row.case.get(X_PARAM);
        let group = groups.entry(key).or_insert_with(|| Group {
            params,
            by_x: BTreeMap::new(),
        });
        let slot = group
            .by_x
            .entry(x.map(param_key))
            .or_insert_with(|| (x, BTreeMap::new()));
        slot.1.insert(row.implementation.as_str(), row);
    }
    groups.into_values().collect()
}

fn x_label(x: Option<&Param>) -> String {
    x.map(|p| p.to_string()).unwrap_or_else(|| "—".to_string())
}

/// Stable identifier of a group of a document, for anchors and figure names.
fn group_id(loaded: &Loaded, group: &Group<'_>) -> String {
    let mut s = String::new();
    s.push_str(loaded.doc.suite.as_str());
    s.push('\0');
    s.push_str(&loaded.doc.device.name);
    s.push('\0');
    s.push_str(&serde_json::to_string(&group.params).unwrap_or_default());
    format!("{:016x}", format::stable_hash(s.as_bytes()))
}

fn page_of(suite: Suite) -> &'static str {
    SUITE_PAGES
        .iter()
        .find(|(_, _, suites)| suites.contains(&suite))
        .map(|(file, _, _)| *file)
        .unwrap_or("index.html")
}

fn device_label(doc: &Document) -> String {
    match &doc.device.compute_capability {
        Some(cc) => format!("{} (compute capability {cc})", doc.device.name),
        None => doc.device.name.clone(),
    }
}

fn is_accurate(row: &Row) -> bool {
    row.accuracy
        .as_ref()
        .is_some_and(|a| a.rel_err <= a.tolerance)
}

fn above_tolerance(row: &Row) -> bool {
    row.status == Status::Ok
        && row
            .accuracy
            .as_ref()
            .is_some_and(|a| a.rel_err > a.tolerance)
}

/// Documents of one suite measured on devices of one name (shards of a grid, split by the
/// runner's `--shard i/n` or run on several GPUs of one model) merged into one: the rows of all,
/// in file order, with the first document's device and configuration, and a path whose file
/// name lists every file (`a.json + b.json`). Documents alone under their key are borrowed as
/// they are. The loader has already refused rows repeated across files.
pub fn merge_shards(docs: &[Loaded]) -> std::borrow::Cow<'_, [Loaded]> {
    let key = |l: &Loaded| (l.doc.suite, l.doc.device.name.clone());
    let keys: BTreeSet<(Suite, String)> = docs.iter().map(key).collect();
    if keys.len() == docs.len() {
        return std::borrow::Cow::Borrowed(docs);
    }
    let mut merged: Vec<Loaded> = Vec::with_capacity(keys.len());
    let mut names: Vec<Vec<String>> = Vec::with_capacity(keys.len());
    for l in docs {
        match merged.iter().position(|m| key(m) == key(l)) {
            Some(i) => {
                merged[i].doc.rows.extend(l.doc.rows.iter().cloned());
                names[i].push(l.file_name());
            }
            None => {
                merged.push(l.clone());
                names.push(vec![l.file_name()]);
            }
        }
    }
    for (m, n) in merged.iter_mut().zip(names) {
        m.path = m.path.with_file_name(n.join(" + "));
    }
    std::borrow::Cow::Owned(merged)
}

/// Builds the whole model. `base` is the link prefix: empty for relative links, or a base URL.
///
/// Setup, methodology and reproduction commands are per file; tables, figures, the At a glance
/// comparison, dispatch rules and limitations use the documents merged by [`merge_shards`].
pub fn build_model(all_docs: &[Loaded], base_url: Option<&str>) -> SiteModel {
    let merged = merge_shards(all_docs);
    let docs: &[Loaded] = &merged;
    let base = match base_url {
        Some(b) if b.ends_with('/') => b.to_string(),
        Some(b) => format!("{b}/"),
        None => String::new(),
    };
    let colours = palette(docs);
    let layout = |file: &str, title: &str| Layout {
        title: title.to_string(),
        file: file.to_string(),
        base: base.clone(),
        nav: std::iter::once(("index.html", "Overview"))
            .chain(SUITE_PAGES.iter().map(|(f, t, _)| (*f, *t)))
            .chain(std::iter::once(HOPPER_PAGE))
            .map(|(f, t)| NavLink {
                href: format!("{base}{f}"),
                label: t.to_string(),
                current: f == file,
            })
            .collect(),
    };

    let mut figures = Vec::new();
    let suite_pages: Vec<SuitePage> = SUITE_PAGES
        .iter()
        .map(|(file, title, suites)| SuitePage {
            layout: layout(file, title),
            sections: suites
                .iter()
                .map(|s| suite_section(docs, *s, &base, &colours, &mut figures))
                .collect(),
            reproduce: reproduce_commands(
                all_docs.iter().filter(|l| suites.contains(&l.doc.suite)),
            ),
        })
        .collect();

    let mut glance = glance_rows(docs, &base);
    mark_representatives(&mut glance);
    let picked: Vec<&GlanceRow> = glance.iter().filter(|g| g.representative).collect();
    // Parameters shared by every bar are said once in the title, not on each bar.
    let parts = |g: &GlanceRow| -> Vec<String> {
        let mut v = vec![g.suite.clone(), g.device.clone()];
        v.extend(g.group.split(", ").map(str::to_string));
        v.push(format!("{X_PARAM}={}", g.x));
        v
    };
    let shared: BTreeSet<String> = picked
        .first()
        .map(|first| {
            parts(first)
                .into_iter()
                .filter(|p| picked.iter().all(|g| parts(g).contains(p)))
                .collect()
        })
        .unwrap_or_default();
    let bars: Vec<GlanceBar> = picked
        .iter()
        .filter_map(|g| {
            let own: Vec<String> = parts(g)
                .into_iter()
                .filter(|p| !shared.contains(p))
                .collect();
            Some(GlanceBar {
                label: format!(
                    "{}{}{}{} vs {}",
                    if g.cpu { "[CPU] " } else { "" },
                    own.join(", "),
                    if own.is_empty() { "" } else { ": " },
                    g.ratio.clone()?,
                    g.alternative.clone()?,
                ),
                ratio: g.ratio_value?,
                range: g.ratio_range,
            })
        })
        .collect();
    let shared_label = parts_in_order(&picked, &shared);
    let glance_chart = (!bars.is_empty()).then(|| GlanceChart {
        file: "figures/at-a-glance.svg".to_string(),
        title: if shared_label.is_empty() {
            "Fastest accurate alternative time ÷ default time".to_string()
        } else {
            format!("Fastest accurate alternative time ÷ default time ({shared_label})")
        },
        desc: format!(
            "Horizontal bars on a log scale, one per group at its largest {X_PARAM}: {}. \
             A bar right of 1 means the default is faster.",
            bars.iter()
                .map(|b| b.label.clone())
                .collect::<Vec<_>>()
                .join("; ")
        ),
        bars,
    });

    let index = IndexPage {
        layout: layout("index.html", "GPU and CPU performance"),
        pages: SUITE_PAGES
            .iter()
            .map(|(f, t, suites)| {
                (
                    f.to_string(),
                    t.to_string(),
                    count_rows(docs, |d| suites.contains(&d.suite)),
                )
            })
            .chain(std::iter::once((
                HOPPER_PAGE.0.to_string(),
                HOPPER_PAGE.1.to_string(),
                count_rows(docs, is_hopper),
            )))
            .map(|(f, title, rows)| PageLink {
                href: format!("{base}{f}"),
                title,
                rows,
            })
            .collect(),
        empty: docs.is_empty(),
        glance_figure: glance_chart.as_ref().map(|c| FigureRef {
            src: format!("{base}{}", c.file),
            alt: c.desc.clone(),
        }),
        glance,
        setup: all_docs.iter().map(setup_doc).collect(),
        methodology: methodology(all_docs),
        dispatch: docs
            .iter()
            .flat_map(|l| {
                l.doc.config.dispatch.iter().map(|d| DispatchView {
                    file: l.file_name(),
                    entry_point: d.entry_point.clone(),
                    device: d.device.clone(),
                    dtype: d.dtype.clone(),
                    rule: d.rule.clone(),
                    implementation: d.implementation.clone(),
                })
            })
            .collect(),
        limitations: limitations(docs, &base),
        reproduce: reproduce_commands(all_docs.iter())
            .into_iter()
            .chain(std::iter::once(CommandView {
                label: "the figures alone (SVG files)".to_string(),
                command: FIGURES_COMMAND.to_string(),
            }))
            .collect(),
    };

    let hopper = hopper_page(docs, layout(HOPPER_PAGE.0, HOPPER_PAGE.1));
    SiteModel {
        index,
        suite_pages,
        hopper,
        figures,
        glance_chart,
    }
}

/// The shared parts, in the order the first row lists them.
fn parts_in_order(picked: &[&GlanceRow], shared: &BTreeSet<String>) -> String {
    let Some(first) = picked.first() else {
        return String::new();
    };
    let mut v = vec![first.suite.clone(), first.device.clone()];
    v.extend(first.group.split(", ").map(str::to_string));
    v.push(format!("{X_PARAM}={}", first.x));
    v.into_iter()
        .filter(|p| shared.contains(p))
        .collect::<Vec<_>>()
        .join(", ")
}

fn count_rows(docs: &[Loaded], pick: impl Fn(&Document) -> bool) -> usize {
    docs.iter()
        .filter(|l| pick(&l.doc))
        .map(|l| l.doc.rows.len())
        .sum()
}

fn is_hopper(doc: &Document) -> bool {
    doc.device
        .compute_capability
        .as_deref()
        .is_some_and(|cc| cc.starts_with("9."))
}

/// Colour per implementation: the site-wide sorted list of names indexes [`PALETTE`].
fn palette(docs: &[Loaded]) -> BTreeMap<String, String> {
    let names: BTreeSet<&str> = docs
        .iter()
        .flat_map(|l| l.doc.rows.iter().map(|r| r.implementation.as_str()))
        .collect();
    names
        .into_iter()
        .enumerate()
        .map(|(i, n)| (n.to_string(), PALETTE[i % PALETTE.len()].to_string()))
        .collect()
}

/// Implementations of a document: default(s) first, then by name.
fn implementations(doc: &Document, colours: &BTreeMap<String, String>) -> Vec<ImplHeader> {
    let mut seen: BTreeMap<&str, ImplHeader> = BTreeMap::new();
    for row in &doc.rows {
        let h = seen
            .entry(row.implementation.as_str())
            .or_insert_with(|| ImplHeader {
                name: row.implementation.clone(),
                library: row.library.clone(),
                is_default: false,
                colour: colours
                    .get(&row.implementation)
                    .cloned()
                    .unwrap_or_default(),
            });
        h.is_default |= row.default;
    }
    let mut v: Vec<ImplHeader> = seen.into_values().collect();
    v.sort_by(|a, b| {
        b.is_default
            .cmp(&a.is_default)
            .then_with(|| a.name.cmp(&b.name))
    });
    v
}

fn suite_section(
    docs: &[Loaded],
    suite: Suite,
    base: &str,
    colours: &BTreeMap<String, String>,
    figures: &mut Vec<FigureSpec>,
) -> SuiteSection {
    let documents: Vec<DocSection> = docs
        .iter()
        .filter(|l| l.doc.suite == suite && !l.doc.rows.is_empty())
        .map(|l| doc_section(l, base, colours, figures))
        .collect();
    SuiteSection {
        title: suite.title().to_string(),
        anchor: suite.as_str().to_string(),
        measured: !documents.is_empty(),
        command: measure_command(suite).map(|c| CommandView {
            label: format!("measure {}", suite.title().to_lowercase()),
            command: c.to_string(),
        }),
        documents,
    }
}

fn doc_section(
    loaded: &Loaded,
    base: &str,
    colours: &BTreeMap<String, String>,
    figures: &mut Vec<FigureSpec>,
) -> DocSection {
    let doc = &loaded.doc;
    let impls = implementations(doc, colours);
    let groups = group_rows(doc)
        .iter()
        .map(|g| {
            let id = group_id(loaded, g);
            let rows = g
                .by_x
                .values()
                .map(|(x, by_impl)| TableRow {
                    x: x_label(*x),
                    cells: impls
                        .iter()
                        .map(|h| cell(&h.name, by_impl.get(h.name.as_str()).copied()))
                        .collect(),
                })
                .collect();
            let memory = g
                .by_x
                .values()
                .flat_map(|(x, by_impl)| {
                    impls.iter().filter_map(move |h| {
                        let row = by_impl.get(h.name.as_str())?;
                        let m = row.memory.as_ref()?;
                        let f =
                            |v: Option<f64>| v.map(format::mb).unwrap_or_else(|| "—".to_string());
                        Some(MemoryRow {
                            x: x_label(*x),
                            implementation: h.name.clone(),
                            arguments_mb: f(m.arguments_mb),
                            outputs_mb: f(m.outputs_mb),
                            temporaries_mb: f(m.temporaries_mb),
                            residuals_mb: f(m.residuals_mb),
                            peak_mb: f(m.peak_mb),
                            peak_method: m.peak_method.clone().unwrap_or_else(|| "—".to_string()),
                        })
                    })
                })
                .collect();
            let mut add = |metric: Metric| {
                figure_spec(doc, g, &id, &impls, metric).map(|spec| {
                    let r = FigureRef {
                        src: format!("{base}{}", spec.file),
                        alt: spec.desc.clone(),
                    };
                    figures.push(spec);
                    r
                })
            };
            let figure = add(Metric::Time);
            let memory_figure = add(Metric::PeakMemory);
            let error_figure = add(Metric::RelErr);
            GroupView {
                anchor: format!("g-{id}"),
                title: g.title(),
                x_name: X_PARAM.to_string(),
                implementations: impls.clone(),
                rows,
                figure,
                memory_figure,
                error_figure,
                memory,
            }
        })
        .collect();
    DocSection {
        file: loaded.file_name(),
        device: device_label(doc),
        groups,
    }
}

fn cell(implementation: &str, row: Option<&Row>) -> Cell {
    let mut c = Cell {
        kind: "missing",
        implementation: implementation.to_string(),
        median: None,
        iqr: None,
        tflops: None,
        rel_err: None,
        tolerance: None,
        above_tolerance: false,
        compile_s: None,
        status: "not measured".to_string(),
        message: None,
    };
    let Some(row) = row else { return c };
    c.status = row.status.as_str().to_string();
    c.message = row.message.clone();
    if row.status != Status::Ok {
        c.kind = "failed";
        return c;
    }
    c.kind = "ok";
    c.median = row.median_ms.map(format::ms);
    if let (Some(q1), Some(q3)) = (row.q1_ms, row.q3_ms) {
        c.iqr = Some(format::iqr(q1, q3));
    }
    c.tflops = row.tflops.map(format::tflops);
    c.compile_s = row.compile_s.map(|t| format::sig(t, 2));
    if let Some(a) = &row.accuracy {
        c.rel_err = Some(format::rel_err(a.rel_err));
        c.above_tolerance = a.rel_err > a.tolerance;
        c.tolerance = Some(format::rel_err(a.tolerance));
    }
    c
}

/// What a line figure plots against [`X_PARAM`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Metric {
    /// `median_ms` of ok rows.
    Time,
    /// `memory.peak_mb` of ok rows.
    PeakMemory,
    /// `accuracy.rel_err` of ok rows, with each tolerance as a dashed line.
    RelErr,
}

impl Metric {
    /// The value drawn for an ok row, when it has one that a log axis can show (> 0).
    fn value(self, row: &Row) -> Option<f64> {
        let v = match self {
            Metric::Time => row.median_ms?,
            Metric::PeakMemory => row.memory.as_ref()?.peak_mb?,
            Metric::RelErr => row.accuracy.as_ref()?.rel_err,
        };
        (v.is_finite() && v > 0.0).then_some(v)
    }

    fn format(self, v: f64) -> String {
        match self {
            Metric::Time => format!("{} ms", format::ms(v)),
            Metric::PeakMemory => format!("{} MB", format::mb(v)),
            Metric::RelErr => format::rel_err(v),
        }
    }

    /// Suffix of the figure file after the group id.
    fn file_suffix(self) -> &'static str {
        match self {
            Metric::Time => "",
            Metric::PeakMemory => "-memory",
            Metric::RelErr => "-error",
        }
    }

    /// What the title says is plotted.
    fn what(self) -> &'static str {
        match self {
            Metric::Time => "median time",
            Metric::PeakMemory => "peak memory",
            Metric::RelErr => "relative error",
        }
    }

    fn y_label(self) -> &'static str {
        match self {
            Metric::Time => "median time (ms)",
            Metric::PeakMemory => "peak memory (MB)",
            Metric::RelErr => "relative error",
        }
    }
}

/// The figure of `metric` for group `g`, or `None` when no row has a value to draw.
fn figure_spec(
    doc: &Document,
    g: &Group<'_>,
    id: &str,
    impls: &[ImplHeader],
    metric: Metric,
) -> Option<FigureSpec> {
    let mut series = Vec::new();
    let mut any_point = false;
    let mut tolerances: Vec<f64> = Vec::new();
    for h in impls {
        let mut s = Series {
            name: if h.is_default {
                format!("{} (default)", h.name)
            } else {
                h.name.clone()
            },
            colour: h.colour.clone(),
            points: Vec::new(),
            failed: Vec::new(),
        };
        for (x, by_impl) in g.by_x.values() {
            let (Some(x), Some(row)) = (x.and_then(param_f64), by_impl.get(h.name.as_str())) else {
                continue;
            };
            if x <= 0.0 {
                continue;
            }
            if row.status != Status::Ok {
                s.failed.push((x, row.status.as_str().to_string()));
                continue;
            }
            if let Some(v) = metric.value(row) {
                s.points.push((x, v));
            }
            if metric == Metric::RelErr {
                if let Some(t) = row.accuracy.as_ref().map(|a| a.tolerance) {
                    if t.is_finite() && t > 0.0 && !tolerances.contains(&t) {
                        tolerances.push(t);
                    }
                }
            }
        }
        any_point |= !s.points.is_empty();
        if !s.points.is_empty() || !s.failed.is_empty() {
            series.push(s);
        }
    }
    if !any_point {
        return None;
    }
    tolerances.sort_by(f64::total_cmp);
    let reference_lines: Vec<(f64, String)> = tolerances
        .iter()
        .map(|t| (*t, format!("tolerance {}", format::rel_err(*t))))
        .collect();
    let title = format!(
        "{}: {} against {X_PARAM}, {}",
        doc.suite.title(),
        metric.what(),
        g.title()
    );
    let desc = series
        .iter()
        .map(|s| {
            let pts: Vec<String> = s
                .points
                .iter()
                .map(|(x, y)| format!("{x}: {}", metric.format(*y)))
                .chain(s.failed.iter().map(|(x, st)| format!("{x}: {st}")))
                .collect();
            format!("{}: {}", s.name, pts.join(", "))
        })
        .chain(
            reference_lines
                .iter()
                .map(|(_, l)| format!("dashed line: {l}")),
        )
        .collect::<Vec<_>>()
        .join("; ");
    Some(FigureSpec {
        file: format!(
            "figures/{}-{id}{}.svg",
            doc.suite.as_str(),
            metric.file_suffix()
        ),
        title,
        desc: format!(
            "Log-log plot of {} on {}. {desc}.",
            metric.y_label(),
            doc.device.name
        ),
        x_label: X_PARAM.to_string(),
        y_label: metric.y_label().to_string(),
        series,
        reference_lines,
    })
}

fn glance_rows(docs: &[Loaded], base: &str) -> Vec<GlanceRow> {
    let mut out = Vec::new();
    for l in docs {
        for g in group_rows(&l.doc) {
            let href = format!("{base}{}#g-{}", page_of(l.doc.suite), group_id(l, &g));
            for (x, by_impl) in g.by_x.values() {
                let Some(default) = by_impl.values().find(|r| r.default) else {
                    continue;
                };
                let mut row = GlanceRow {
                    suite: l.doc.suite.title().to_string(),
                    device: l.doc.device.name.clone(),
                    group: g.title(),
                    href: href.clone(),
                    x: x_label(*x),
                    default_impl: default.implementation.clone(),
                    default_ms: default
                        .median_ms
                        .map(format::ms)
                        .unwrap_or_else(|| default.status.as_str().to_string()),
                    alternative: None,
                    alternative_ms: None,
                    ratio: None,
                    note: None,
                    representative: false,
                    ratio_value: None,
                    ratio_range: None,
                    cpu: l.doc.device.kind == crate::schema::DeviceKind::Cpu,
                };
                let best = by_impl
                    .values()
                    .filter(|r| !r.default && r.status == Status::Ok && is_accurate(r))
                    .filter_map(|r| Some((r.median_ms?, *r)))
                    .min_by(|a, b| {
                        a.0.total_cmp(&b.0)
                            .then_with(|| a.1.implementation.cmp(&b.1.implementation))
                    });
                if let Some((alt_ms, alt)) = best {
                    row.alternative = Some(alt.implementation.clone());
                    row.alternative_ms = Some(format::ms(alt_ms));
                }
                match (default.status, default.median_ms, best) {
                    (Status::Ok, Some(d), Some((a, alt))) if d > 0.0 => {
                        row.ratio_value = Some(a / d);
                        row.ratio = Some(format::ratio(a / d));
                        row.ratio_range = match (alt.q1_ms, alt.q3_ms, default.q1_ms, default.q3_ms)
                        {
                            (Some(aq1), Some(aq3), Some(dq1), Some(dq3)) if dq1 > 0.0 => {
                                Some((aq1 / dq3, aq3 / dq1))
                            }
                            _ => None,
                        };
                    }
                    (Status::Ok, _, None) => {
                        row.note = Some("no accurate alternative ran".to_string())
                    }
                    (Status::Ok, _, _) => row.note = Some("default time is zero".to_string()),
                    (status, _, _) => {
                        row.note = Some(format!("default did not run ({})", status.as_str()))
                    }
                }
                out.push(row);
            }
        }
    }
    out
}

/// Marks, per group, the row with the largest x that has a ratio.
fn mark_representatives(rows: &mut [GlanceRow]) {
    let mut last: BTreeMap<&str, usize> = BTreeMap::new();
    // Rows of a group are contiguous and in ascending x.
    for (i, r) in rows.iter().enumerate() {
        if r.ratio_value.is_some() {
            last.insert(r.href.as_str(), i);
        }
    }
    let picks: Vec<usize> = last.into_values().collect();
    for i in picks {
        rows[i].representative = true;
    }
}

fn setup_doc(l: &Loaded) -> SetupDoc {
    let d = &l.doc.device;
    let kv = |k: &str, v: String| KeyValue {
        key: k.to_string(),
        value: v,
    };
    let mut device = vec![
        kv("Name", d.name.clone()),
        kv("Kind", format!("{:?}", d.kind).to_lowercase()),
    ];
    let opt = |v: Option<String>| v.unwrap_or_else(|| "—".to_string());
    device.push(kv("Compute capability", opt(d.compute_capability.clone())));
    device.push(kv("SMs", opt(d.sm_count.map(|v| v.to_string()))));
    device.push(kv("Memory (MB)", opt(d.memory_mb.map(format::mb))));
    device.push(kv("L2 (MB)", opt(d.l2_mb.map(format::mb))));
    device.push(kv("Driver", opt(d.driver_version.clone())));
    device.push(kv("CUDA", opt(d.cuda_version.clone())));
    if let Some(t) = d.cpu_threads {
        device.push(kv("CPU threads", t.to_string()));
    }
    let c = &l.doc.config;
    SetupDoc {
        file: l.file_name(),
        suite: l.doc.suite.title().to_string(),
        device,
        libraries: c.libraries.iter().map(|(k, v)| kv(k, v.clone())).collect(),
        run: vec![
            kv("Runner", format!("{} {}", c.runner, c.runner_version)),
            kv("Git commit", c.git_commit.clone()),
            kv("Started", c.started_at.clone()),
            kv("Finished", opt(c.finished_at.clone())),
            kv("Rows", l.doc.rows.len().to_string()),
        ],
    }
}

/// Words for an accuracy reference.
fn reference_label(r: crate::schema::Reference) -> &'static str {
    match r {
        crate::schema::Reference::Float64Cpu => "float64 on the CPU",
        crate::schema::Reference::Float64Device => "float64 on the device",
        crate::schema::Reference::Float32Device => "float32 (highest precision) on the device",
    }
}

/// Text from data made safe to splice into Markdown: HTML-escaped (pulldown-cmark passes raw
/// HTML through) and with Markdown's punctuation backslash-escaped.
fn md_text(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for ch in s.chars() {
        match ch {
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '&' => out.push_str("&amp;"),
            '"' => out.push_str("&quot;"),
            '\\' | '`' | '*' | '_' | '[' | ']' | '#' | '|' | '!' | '{' | '}' => {
                out.push('\\');
                out.push(ch);
            }
            c => out.push(c),
        }
    }
    out
}

fn timing_view(t: &TimingConfig, docs: &[&Loaded]) -> TimingView {
    let sets: BTreeSet<u32> = docs
        .iter()
        .flat_map(|l| l.doc.rows.iter().filter_map(|r| r.input_sets))
        .collect();
    let input_sets = match (sets.first(), sets.last()) {
        (Some(a), Some(b)) if a == b => a.to_string(),
        (Some(a), Some(b)) => format!("{a}–{b}"),
        _ => "—".to_string(),
    };
    let refs: BTreeSet<&'static str> = docs
        .iter()
        .flat_map(|l| l.doc.rows.iter().filter_map(|r| r.accuracy.as_ref()))
        .map(|a| reference_label(a.reference))
        .collect();
    let checked: BTreeSet<&str> = docs
        .iter()
        .flat_map(|l| {
            l.doc
                .rows
                .iter()
                .filter_map(|r| r.accuracy.as_ref()?.checked.as_deref())
        })
        .collect();
    let mut methods: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for l in docs {
        for r in &l.doc.rows {
            if let Some(m) = r.memory.as_ref().and_then(|m| m.peak_method.as_deref()) {
                methods
                    .entry(m)
                    .or_default()
                    .insert(r.implementation.as_str());
            }
        }
    }
    let peak_methods = if methods.is_empty() {
        "no row recorded a peak".to_string()
    } else {
        methods
            .into_iter()
            .map(|(m, imps)| format!("{m} ({})", imps.into_iter().collect::<Vec<_>>().join(", ")))
            .collect::<Vec<_>>()
            .join("; ")
    };
    let flop_rules: BTreeSet<&str> = docs
        .iter()
        .filter_map(|l| l.doc.config.flop_rule.as_deref())
        .collect();
    let mut checked: Vec<&str> = checked.into_iter().collect();
    // Natural order: by the numbers in the text (2 of 32 ... 512 before 1024).
    checked.sort_by_key(|c| {
        c.split(|ch: char| !ch.is_ascii_digit())
            .filter_map(|n| n.parse::<u64>().ok())
            .collect::<Vec<_>>()
    });
    TimingView {
        flop_rules: md_text(&flop_rules.into_iter().collect::<Vec<_>>().join("; ")),
        peak_methods: md_text(&peak_methods),
        files: docs
            .iter()
            .map(|l| l.file_name())
            .collect::<Vec<_>>()
            .join(", "),
        warmup_calls: t.warmup_calls.to_string(),
        repeats: t.repeats.to_string(),
        min_sample_ms: format::sig(t.min_sample_ms, 3),
        max_inner: t.max_inner.to_string(),
        l2_rotation_factor: format::sig(t.l2_rotation_factor, 3),
        case_timeout_s: format::sig(t.case_timeout_s, 3),
        input_sets,
        references: if refs.is_empty() {
            "—".to_string()
        } else {
            refs.into_iter().collect::<Vec<_>>().join("; ")
        },
        checked: if checked.is_empty() {
            "every output element".to_string()
        } else {
            md_text(&checked.join("; "))
        },
    }
}

/// One view per distinct timing configuration, in document order.
fn methodology(docs: &[Loaded]) -> Vec<TimingView> {
    let mut configs: Vec<(&TimingConfig, Vec<&Loaded>)> = Vec::new();
    for l in docs {
        match configs.iter_mut().find(|(t, _)| **t == l.doc.config.timing) {
            Some((_, v)) => v.push(l),
            None => configs.push((&l.doc.config.timing, vec![l])),
        }
    }
    configs.iter().map(|(t, v)| timing_view(t, v)).collect()
}

/// One size at which an alternative beat the default: (x label, default row, alternative row).
type FasterAt<'a> = (String, &'a Row, &'a Row);

fn limitations(docs: &[Loaded], base: &str) -> Vec<Limitation> {
    let mut out = Vec::new();
    for l in docs {
        for g in group_rows(&l.doc) {
            let href = format!("{base}{}#g-{}", page_of(l.doc.suite), group_id(l, &g));
            // Faster alternatives, gathered over the group's sizes: (size, default, alternative).
            let mut faster: BTreeMap<(String, String), Vec<FasterAt>> = BTreeMap::new();
            for (x, by_impl) in g.by_x.values() {
                let place = format!(
                    "{} on {}, {}, {X_PARAM}={}",
                    l.doc.suite.title(),
                    l.doc.device.name,
                    g.title(),
                    x_label(*x)
                );
                let lim = |kind: &str, detail: String| Limitation {
                    kind: kind.to_string(),
                    place: place.clone(),
                    href: href.clone(),
                    detail,
                };
                let default = by_impl.values().find(|r| r.default);
                if let Some(d) = default {
                    if d.status == Status::Ok {
                        if let Some(d_q1) = d.q1_ms {
                            for r in by_impl
                                .values()
                                .filter(|r| !r.default && r.status == Status::Ok)
                            {
                                if r.q3_ms.is_some_and(|q3| q3 < d_q1) {
                                    faster
                                        .entry((d.implementation.clone(), r.implementation.clone()))
                                        .or_default()
                                        .push((x_label(*x), d, r));
                                }
                            }
                        }
                    } else {
                        let ran: Vec<String> = by_impl
                            .values()
                            .filter(|r| !r.default && r.status == Status::Ok)
                            .map(|r| {
                                format!(
                                    "{} ({} ms)",
                                    r.implementation,
                                    r.median_ms.map(format::ms).unwrap_or_default()
                                )
                            })
                            .collect();
                        if !ran.is_empty() {
                            out.push(lim(
                                "default did not run",
                                format!(
                                    "the default {} is {}{} while {} ran",
                                    d.implementation,
                                    d.status.as_str(),
                                    d.message
                                        .as_deref()
                                        .map(|m| format!(" ({m})"))
                                        .unwrap_or_default(),
                                    ran.join(", ")
                                ),
                            ));
                        }
                    }
                }
                for r in by_impl.values().filter(|r| above_tolerance(r)) {
                    if let Some(a) = &r.accuracy {
                        out.push(lim(
                            "above tolerance",
                            format!(
                                "{} has rel_err {} above its tolerance {} (reference: {})",
                                r.implementation,
                                format::rel_err(a.rel_err),
                                format::rel_err(a.tolerance),
                                reference_label(a.reference)
                            ),
                        ));
                    }
                }
            }
            for ((default, alt), cases) in faster {
                let ratios: Vec<f64> = cases
                    .iter()
                    .filter_map(|(_, d, r)| Some(d.median_ms? / r.median_ms?))
                    .collect();
                let (lo, hi) = ratios.iter().fold((f64::INFINITY, 0.0f64), |(lo, hi), &q| {
                    (lo.min(q), hi.max(q))
                });
                let sizes: Vec<String> = cases
                    .iter()
                    .map(|(x, d, r)| {
                        format!(
                            "{x}: {} against {} ms",
                            d.median_ms.map(format::ms).unwrap_or_default(),
                            r.median_ms.map(format::ms).unwrap_or_default()
                        )
                    })
                    .collect();
                out.push(Limitation {
                    kind: "faster alternative".to_string(),
                    place: format!(
                        "{} on {}, {}",
                        l.doc.suite.title(),
                        l.doc.device.name,
                        g.title()
                    ),
                    href: href.clone(),
                    detail: format!(
                        "{alt} beats the default {default} by more than the spread of both (its q3 below the default's q1) at {} of {} measured {X_PARAM} values; {default} takes {}× to {}× as long ({X_PARAM} {})",
                        cases.len(),
                        g.by_x.len(),
                        format::sig(lo, 3),
                        format::sig(hi, 3),
                        sizes.join("; ")
                    ),
                });
            }
        }
    }
    out
}

fn hopper_page(docs: &[Loaded], layout: Layout) -> HopperPage {
    let hopper: Vec<&Loaded> = docs.iter().filter(|l| is_hopper(&l.doc)).collect();
    let mut suites = Vec::new();
    for suite in Suite::ALL {
        let in_suite: Vec<&&Loaded> = hopper.iter().filter(|l| l.doc.suite == suite).collect();
        if in_suite.is_empty() {
            continue;
        }
        let devices: BTreeSet<String> = in_suite.iter().map(|l| device_label(&l.doc)).collect();
        let mut by_impl: BTreeMap<&str, (Option<&Row>, usize, usize, &Row)> = BTreeMap::new();
        for l in &in_suite {
            for r in &l.doc.rows {
                let e = by_impl
                    .entry(r.implementation.as_str())
                    .or_insert((None, 0, 0, r));
                e.2 += 1;
                if r.status == Status::Ok {
                    e.1 += 1;
                    if let Some(t) = r.tflops {
                        if e.0.and_then(|b| b.tflops).is_none_or(|bt| t > bt) {
                            e.0 = Some(r);
                        }
                    }
                }
            }
        }
        let mut implementations: Vec<HopperImpl> = by_impl
            .into_iter()
            .map(|(name, (best, ok, total, any))| HopperImpl {
                name: name.to_string(),
                library: any.library.clone(),
                is_default: any.default,
                best_tflops: best
                    .and_then(|b| b.tflops)
                    .map(format::tflops)
                    .unwrap_or_else(|| "—".to_string()),
                best_case: best
                    .map(|b| crate::load::case_label(&b.case))
                    .unwrap_or_else(|| "—".to_string()),
                rows_ok: format!("{ok} / {total}"),
            })
            .collect();
        implementations.sort_by(|a, b| {
            b.is_default
                .cmp(&a.is_default)
                .then_with(|| a.name.cmp(&b.name))
        });
        suites.push(HopperSuite {
            title: suite.title().to_string(),
            anchor: suite.as_str().to_string(),
            devices: devices.into_iter().collect::<Vec<_>>().join(", "),
            implementations,
        });
    }
    HopperPage {
        layout,
        measured: !suites.is_empty(),
        command: CommandView {
            label: "measure attention on an H200".to_string(),
            command: ATTENTION_COMMAND.to_string(),
        },
        suites,
        reproduce: reproduce_commands(hopper.iter().copied()),
    }
}
