//! The overview page: the at-a-glance comparison of each default with its fastest accurate
//! alternative, the setup of every document, the methodology, the dispatch rules, the known
//! limitations and how to reproduce it all.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use super::super::format;
use super::super::markdown::escape as md_text;
use super::groups::{
    above_tolerance, doc_id, group_id, group_rows, is_accurate, page_of, primary_axis, x_label,
};
use super::{reproduce_commands, CommandView, FigureRef, KeyValue, Layout, FIGURES_COMMAND};
use crate::load::Loaded;
use crate::schema::{Row, Status, TimingConfig};

/// The overview page.
#[derive(Debug, Serialize)]
pub struct IndexPage {
    /// Layout.
    pub layout: Layout,
    /// Links to the four suite pages.
    pub pages: Vec<PageLink>,
    /// True when no document was loaded.
    pub empty: bool,
    /// The same comparisons, one table per (suite, device, axis): a row per group, a column per
    /// size.
    pub glance_tables: Vec<GlanceTable>,
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
    /// The kernel tuning notes pages, one per suite family whose notes file is present, in the
    /// site's order (none current).
    pub tuning_notes: Vec<super::NavLink>,
}

/// The overview's table of contents: its fixed sections.
pub fn toc() -> Vec<super::TocEntry> {
    [
        ("at-a-glance", "At a glance"),
        ("setup", "Setup"),
        ("methodology", "Methodology"),
        ("what-runs-by-default", "What runs by default"),
        ("known-limitations", "Known limitations"),
        ("how-to-reproduce", "How to reproduce"),
    ]
    .into_iter()
    .map(|(id, label)| super::TocEntry {
        href: format!("#{id}"),
        label: label.to_string(),
        depth: 1,
    })
    .collect()
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
    /// The axis the sizes are measured along (the document's first axis).
    pub axis: String,
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
    /// The ratio as the site shows every ratio ([`format::time_ratio_html`]): value, direction
    /// and words.
    pub ratio_html: Option<String>,
    /// True when the default's error is above its tolerance: no ratio is shown for it.
    pub default_inaccurate: bool,
    /// Warnings on either row: throttled, shared GPU, an eager call launch-bound.
    pub flags: Vec<String>,
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

/// The at-a-glance comparisons of one (suite, device, axis): a row per group, a column per size.
#[derive(Debug, Serialize, Clone)]
pub struct GlanceTable {
    /// Suite title.
    pub suite: String,
    /// Device name.
    pub device: String,
    /// The axis of the columns.
    pub axis: String,
    /// Column headings: the sizes, ascending.
    pub sizes: Vec<String>,
    /// One row per group.
    pub rows: Vec<GlanceTableRow>,
}

/// One group in a [`GlanceTable`].
#[derive(Debug, Serialize, Clone)]
pub struct GlanceTableRow {
    /// Group parameters (those that vary between the table's groups).
    pub group: String,
    /// Link to the group's table.
    pub href: String,
    /// The default implementation.
    pub default_impl: String,
    /// One cell per size, in column order.
    pub cells: Vec<GlanceCell>,
}

/// One (group, size) in a [`GlanceTable`].
#[derive(Debug, Serialize, Clone)]
pub struct GlanceCell {
    /// The ratio's HTML, when there is one.
    pub ratio_html: Option<String>,
    /// The alternative it compares with.
    pub alternative: Option<String>,
    /// Why there is no ratio.
    pub note: Option<String>,
    /// True for the size the chart plots.
    pub representative: bool,
    /// Warnings on the rows compared (throttled, shared GPU, eager calls launch-bound).
    pub flags: Vec<String>,
}

/// What one document says about its machine and software.
#[derive(Debug, Serialize)]
pub struct SetupDoc {
    /// Data file name, or the files of the shards of one part of a run
    /// ([`super::group_files`]).
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
    /// Warm-up length, ms of calls.
    pub warmup_ms: String,
    /// Host time per call ÷ device time per call from which a row is launch-bound.
    pub launch_bound_ratio: String,
    /// Runs of the whole grid (`--runs`), in words: `once`, `3 times`.
    pub runs: String,
    /// True when the grid ran more than once.
    pub several_runs: bool,
    /// Fewest samples a row keeps when the time limit stops sampling
    /// ([`crate::harness::MIN_SAMPLES`]).
    pub min_samples: String,
    /// Most input copies rotated through ([`crate::harness::MAX_INPUT_SETS`]).
    pub max_input_sets: String,
    /// The share of free device memory the comparison scripts' copies may take, `50 %`.
    pub rotation_memory_share: String,
    /// The hard limit on a case process, as its formula and value
    /// (`1.5 × 180 s + 60 s = 330 s`).
    pub process_limit: String,
    /// How often the machine state is sampled, ms.
    pub machine_sample_ms: String,
    /// True when the documents record that each kernel source was compiled once per run and
    /// later case processes loaded its machine code (`protocol.kernels_compiled_once`).
    pub kernels_compiled_once: bool,
    /// The share of the maximum SM clock below which a row is marked throttled, `97 %`.
    pub throttled_share: String,
    /// Implementations reported from CUDA-graph replay, or empty.
    pub graph_replayed: String,
    /// Alternatives (rows with a `first_call_s`) whose rows also record a `compile_s` (a JIT
    /// compiler on their first call, e.g. `torch.compile`), or empty.
    pub alternative_compiles: String,
    /// Rows whose reported time is launch-bound, as `N of M rows`, followed by each device's
    /// `N of M` in parentheses when the documents come from more than one device and N > 0.
    pub launch_bound_rows: String,
    /// Rows reported from graph replay whose eager calls were launch-bound, as `N`, followed
    /// by each device's count in parentheses as for `launch_bound_rows`.
    pub eager_launch_bound_rows: String,
    /// Timed samples.
    pub repeats: String,
    /// Minimum sample length, ms.
    pub min_sample_ms: String,
    /// Cap on calls per sample.
    pub max_inner: String,
    /// False when the runs time one input copy (an L2 rotation factor of 0).
    pub inputs_rotated: bool,
    /// L2 rotation factor.
    pub l2_rotation_factor: String,
    /// Case timeout, s.
    pub case_timeout_s: String,
    /// Input sets seen in the rows (`2–8`), or `—`.
    pub input_sets: String,
    /// References seen in the rows.
    pub references: String,
    /// Samples the accuracy checks covered, as recorded: each distinct description once (the
    /// rows' own errors left out), the first few in natural order and the count of the rest.
    pub checked: String,
    /// How `peak_mb` was read, each method with the implementations that used it.
    pub peak_methods: String,
    /// The FLOP-counting rules the runners recorded (`config.flop_rule`), or empty.
    pub flop_rules: String,
    /// The throughputs the documents declare, each with the count it is computed from
    /// (`TFLOP/s from flops`), joined; empty when none is declared.
    pub throughputs: String,
}

/// One dispatch rule with its document.
#[derive(Debug, Serialize)]
pub struct DispatchView {
    /// Data file, with the card and the commit it was measured at.
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
    /// A ratio that ends the detail, as the site shows every ratio.
    pub ratio_html: Option<String>,
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
    /// What the axis, the sides of 1 and the legend say.
    pub words: RatioWords,
}

/// The words of a ratio bar chart ([`GlanceChart`]): its axis, the two sides of 1, the legend's
/// two colours, and whether the legend explains the cross of an inaccurate default.
#[derive(Debug, Clone, PartialEq)]
pub struct RatioWords {
    /// Axis description.
    pub axis: String,
    /// Above the plot, left of 1 (`← alternative faster`).
    pub left: String,
    /// Above the plot, right of 1 (`default faster →`).
    pub right: String,
    /// Legend of a ratio above 1.
    pub above: String,
    /// Legend of a ratio below 1.
    pub below: String,
    /// True when bars can be crosses (an inaccurate default).
    pub crosses: bool,
}

impl RatioWords {
    /// The at-a-glance chart's: the fastest accurate alternative's time over the default's.
    pub fn glance() -> RatioWords {
        RatioWords {
            axis: "fastest accurate alternative time ÷ default time (log scale)".into(),
            left: "← alternative faster".into(),
            right: "default faster →".into(),
            above: "default faster (ratio above 1)".into(),
            below: "alternative faster (ratio below 1)".into(),
            crosses: true,
        }
    }
}

/// One bar.
#[derive(Debug, Clone)]
pub struct GlanceBar {
    /// Label drawn above the bar: the group, the size and what it is compared with.
    pub label: String,
    /// What is drawn.
    pub outcome: BarOutcome,
}

/// What one bar of the at-a-glance chart shows.
#[derive(Debug, Clone, PartialEq)]
pub enum BarOutcome {
    /// alternative time ÷ default time, with the range of that ratio from both interquartile
    /// ranges ((alternative q1 ÷ default q3, alternative q3 ÷ default q1); `None` when a
    /// quartile is missing).
    Ratio {
        /// alternative ÷ default.
        ratio: f64,
        /// The range from both interquartile ranges.
        range: Option<(f64, f64)>,
    },
    /// The default's error is above its tolerance: a cross, no ratio.
    DefaultInaccurate,
}

/// The at-a-glance rows of `docs` and the chart of their representative rows.
/// The at-a-glance comparisons: every row, the tables, the chart.
pub struct Glance {
    /// Every (group, size) with a default.
    pub rows: Vec<GlanceRow>,
    /// A table per (suite, device, axis).
    pub tables: Vec<GlanceTable>,
    /// The chart of the representative rows, when any has a bar.
    pub chart: Option<GlanceChart>,
}

/// The at-a-glance comparisons of `docs`.
pub fn glance(docs: &[Loaded], base: &str) -> Glance {
    let mut glance = glance_rows(docs, base);
    mark_representatives(&mut glance);
    let tables = glance_tables(&glance, &group_sizes(docs, base));
    let picked: Vec<&GlanceRow> = glance.iter().filter(|g| g.representative).collect();
    // Parameters shared by every bar are said once in the title, not on each bar.
    let parts = |g: &GlanceRow| -> Vec<String> {
        let mut v = vec![g.suite.clone(), g.device.clone()];
        v.extend(g.group.split(", ").map(str::to_string));
        // A case without the axis (separate query and key lengths) has no size to name.
        if g.x != "—" {
            v.push(format!("{}={}", g.axis, g.x));
        }
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
            let place = format!(
                "{}{}",
                if g.cpu { "[CPU] " } else { "" },
                if own.is_empty() {
                    g.default_impl.clone()
                } else {
                    own.join(", ")
                }
            );
            if g.default_inaccurate {
                return Some(GlanceBar {
                    label: format!("{place}: default inaccurate, no ratio"),
                    outcome: BarOutcome::DefaultInaccurate,
                });
            }
            let ratio = g.ratio_value?;
            Some(GlanceBar {
                label: format!(
                    "{place}: {} vs {} ({})",
                    g.ratio.clone()?,
                    g.alternative.clone()?,
                    format::time_ratio_words(ratio, ratio, "default")
                ),
                outcome: BarOutcome::Ratio {
                    ratio,
                    range: g.ratio_range,
                },
            })
        })
        .collect();
    let shared_label = parts_in_order(&picked, &shared);
    let axes: BTreeSet<&str> = picked.iter().map(|g| g.axis.as_str()).collect();
    let axes = axes.into_iter().collect::<Vec<_>>().join(" or ");
    let chart = (!bars.is_empty()).then(|| GlanceChart {
        file: "figures/at-a-glance.svg".to_string(),
        title: if shared_label.is_empty() {
            "Fastest accurate alternative time ÷ default time".to_string()
        } else {
            format!("Fastest accurate alternative time ÷ default time ({shared_label})")
        },
        desc: format!(
            "Horizontal bars on a log scale, one per group at its largest {axes}: {}. \
             A bar right of 1 means the default is faster (bars are at least {} px long, so a \
             ratio near 1 still shows its colour); a whisker spans the ratio's range from the two \
             implementations' quartiles; a cross marks a default whose error is above its \
             tolerance.",
            bars.iter()
                .map(|b| b.label.clone())
                .collect::<Vec<_>>()
                .join("; "),
            crate::site::figures::GLANCE_MIN_BAR
        ),
        bars,
        words: RatioWords::glance(),
    });
    Glance {
        rows: glance,
        tables,
        chart,
    }
}

/// The link to group `g` of `l`'s table on its suite's page.
fn group_href(base: &str, l: &Loaded, g: &super::groups::Group<'_>) -> String {
    format!("{base}{}#g-{}", page_of(l.doc.suite), group_id(l, g))
}

/// Every (group link, size) that `docs` hold a case of, whether or not a default ran there:
/// what tells a size the group's grid lacks from one where nothing could be compared.
fn group_sizes(docs: &[Loaded], base: &str) -> BTreeSet<(String, String)> {
    let mut out = BTreeSet::new();
    for l in docs {
        for g in group_rows(&l.doc, primary_axis(&l.doc)) {
            let href = group_href(base, l, &g);
            for (x, _) in g.by_x.values() {
                out.insert((href.clone(), x_label(*x)));
            }
        }
    }
    out
}

/// The rows regrouped: a table per (suite, device, axis), a row per group, a column per size. The
/// group label keeps only the parameters that differ between the table's groups. A cell
/// without a row says `no case of this size` where the group's grid has no case there
/// (`present`: [`group_sizes`]), `not measured` otherwise.
fn glance_tables(rows: &[GlanceRow], present: &BTreeSet<(String, String)>) -> Vec<GlanceTable> {
    let mut tables: Vec<GlanceTable> = Vec::new();
    for r in rows {
        // A table per axis too: the decoding grid's seq_len_kv is not the grid's seq_len.
        let t = match tables
            .iter_mut()
            .position(|t| t.suite == r.suite && t.device == r.device && t.axis == r.axis)
        {
            Some(i) => &mut tables[i],
            None => {
                tables.push(GlanceTable {
                    suite: r.suite.clone(),
                    device: r.device.clone(),
                    axis: r.axis.clone(),
                    sizes: Vec::new(),
                    rows: Vec::new(),
                });
                tables.last_mut().expect("just pushed")
            }
        };
        if !t.sizes.contains(&r.x) {
            t.sizes.push(r.x.clone());
        }
        if !t.rows.iter().any(|g| g.href == r.href) {
            t.rows.push(GlanceTableRow {
                group: r.group.clone(),
                href: r.href.clone(),
                default_impl: r.default_impl.clone(),
                cells: Vec::new(),
            });
        }
    }
    for t in &mut tables {
        // Sizes ascending by their numeric value where they are numbers.
        t.sizes
            .sort_by(|a, b| match (a.parse::<f64>(), b.parse::<f64>()) {
                (Ok(x), Ok(y)) => x.total_cmp(&y),
                _ => a.cmp(b),
            });
        // Parameters every group of the table shares are said in its heading, not per row.
        let parts: Vec<Vec<&str>> = t
            .rows
            .iter()
            .map(|g| g.group.split(", ").collect())
            .collect();
        let shared: BTreeSet<&str> = parts
            .first()
            .map(|first| {
                first
                    .iter()
                    .copied()
                    .filter(|p| parts.iter().all(|q| q.contains(p)))
                    .collect()
            })
            .unwrap_or_default();
        let labels: Vec<String> = parts
            .iter()
            .map(|p| {
                p.iter()
                    .copied()
                    .filter(|x| !shared.contains(x) || parts.len() == 1)
                    .collect::<Vec<_>>()
                    .join(", ")
            })
            .collect();
        for (g, label) in t.rows.iter_mut().zip(labels) {
            g.cells = t
                .sizes
                .iter()
                .map(|x| {
                    let r = rows.iter().find(|r| {
                        r.href == g.href && &r.x == x && r.device == t.device && r.axis == t.axis
                    });
                    GlanceCell {
                        ratio_html: r.and_then(|r| r.ratio_html.clone()),
                        alternative: r.and_then(|r| r.alternative.clone()),
                        note: match r {
                            Some(r) => r.note.clone(),
                            None if !present.contains(&(g.href.clone(), x.clone())) => {
                                Some("no case of this size".to_string())
                            }
                            None => Some("not measured".to_string()),
                        },
                        representative: r.is_some_and(|r| r.representative),
                        flags: r.map(|r| r.flags.clone()).unwrap_or_default(),
                    }
                })
                .collect();
            g.group = label;
        }
    }
    tables
}

/// The overview page. `all_docs` as loaded (setup, methodology and commands are per file, the
/// shards of one part together),
/// `docs` with shards merged (comparisons).
pub fn index_page(
    all_docs: &[Loaded],
    docs: &[Loaded],
    base: &str,
    layout: Layout,
    pages: Vec<PageLink>,
    glance: &Glance,
) -> IndexPage {
    IndexPage {
        layout,
        pages,
        glance_tables: glance.tables.clone(),
        empty: docs.is_empty(),
        glance_figure: glance.chart.as_ref().map(|c| FigureRef::glance(base, c)),

        setup: super::shard_groups(&all_docs.iter().collect::<Vec<_>>())
            .iter()
            .map(|g| setup_doc(g))
            .collect(),
        methodology: methodology(all_docs),
        dispatch: docs
            .iter()
            .flat_map(|l| {
                l.doc.config.dispatch.iter().map(|d| DispatchView {
                    // The card and commit: each run records the rules of its own code.
                    file: format!(
                        "{} ({}, commit {})",
                        l.file_name(),
                        l.doc.device.name,
                        format::short_commit(&l.doc.config.git_commit)
                    ),
                    entry_point: d.entry_point.clone(),
                    device: d.device.clone(),
                    dtype: d.dtype.clone(),
                    rule: d.rule.clone(),
                    implementation: d.implementation.clone(),
                })
            })
            .collect(),
        limitations: limitations(docs, base),
        reproduce: reproduce_commands(all_docs.iter())
            .into_iter()
            .chain(std::iter::once(CommandView {
                label: "the figures alone (SVG files)".to_string(),
                command: FIGURES_COMMAND.to_string(),
            }))
            .collect(),
        tuning_notes: Vec::new(),
    }
}

/// The shared parts, in the order the first row lists them.
fn parts_in_order(picked: &[&GlanceRow], shared: &BTreeSet<String>) -> String {
    let Some(first) = picked.first() else {
        return String::new();
    };
    let mut v = vec![first.suite.clone(), first.device.clone()];
    v.extend(first.group.split(", ").map(str::to_string));
    if first.x != "—" {
        v.push(format!("{}={}", first.axis, first.x));
    }
    v.into_iter()
        .filter(|p| shared.contains(p))
        .collect::<Vec<_>>()
        .join(", ")
}

fn glance_rows(docs: &[Loaded], base: &str) -> Vec<GlanceRow> {
    let mut out = Vec::new();
    for l in docs {
        for g in group_rows(&l.doc, primary_axis(&l.doc)) {
            let href = group_href(base, l, &g);
            for (x, by_impl) in g.by_x.values() {
                let Some(default) = by_impl.values().find(|r| r.default) else {
                    continue;
                };
                let mut row = GlanceRow {
                    suite: l.doc.suite.title().to_string(),
                    device: l.doc.device.name.clone(),
                    group: g.title(),
                    axis: g.axis.clone(),
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
                    ratio_html: None,
                    flags: Vec::new(),
                    default_inaccurate: above_tolerance(default),
                    note: None,
                    representative: false,
                    ratio_value: None,
                    ratio_range: None,
                    cpu: l.doc.device.kind == crate::schema::DeviceKind::Cpu,
                };
                // Launch-bound timings measure the host, not the kernel: no ratio from them.
                let best = by_impl
                    .values()
                    .filter(|r| !r.default && r.status == Status::Ok && is_accurate(r))
                    .filter(|r| !super::groups::launch_bound(r, &l.doc))
                    .filter_map(|r| Some((r.median_ms?, *r)))
                    .min_by(|a, b| {
                        a.0.total_cmp(&b.0)
                            .then_with(|| a.1.implementation.cmp(&b.1.implementation))
                    });
                if let Some((alt_ms, alt)) = best {
                    row.alternative = Some(alt.implementation.clone());
                    row.alternative_ms = Some(format::ms(alt_ms));
                }
                let flags_of = |r: &Row| {
                    let mut f: Vec<String> = super::groups::machine_flags(r)
                        .into_iter()
                        .map(|m| {
                            format!(
                                "{}: {}",
                                r.implementation,
                                m.split(':').next().unwrap_or("")
                            )
                        })
                        .collect();
                    if super::groups::eager_launch_bound(r, &l.doc) {
                        f.push(format!("{}: eager calls launch-bound", r.implementation));
                    }
                    f
                };
                row.flags = flags_of(default);
                if let Some((_, alt)) = best {
                    row.flags.extend(flags_of(alt));
                }
                // An alternative left out for its error that is faster than the one compared
                // (or than the default, when none is): the cell says so rather than hide it.
                let bar = best.map(|(ms, _)| ms).or(default.median_ms);
                for r in by_impl.values().filter(|r| {
                    !r.default
                        && r.status == Status::Ok
                        && above_tolerance(r)
                        && r.median_ms.zip(bar).is_some_and(|(m, b)| m < b)
                }) {
                    row.flags.push(format!(
                        "{}: faster, but its error is above its tolerance",
                        r.implementation
                    ));
                }
                match (default.status, default.median_ms, best) {
                    (Status::Ok, _, _) if row.default_inaccurate => {
                        row.note = Some("default inaccurate (error above its tolerance)".into())
                    }
                    (Status::Ok, _, _) if super::groups::launch_bound(default, &l.doc) => {
                        row.note = Some("default's timing launch-bound".into())
                    }
                    (Status::Ok, Some(d), Some((a, alt))) if d > 0.0 => {
                        row.ratio_value = Some(a / d);
                        row.ratio = Some(format::ratio(a / d));
                        row.ratio_html = Some(format::time_ratio_html(
                            a / d,
                            a / d,
                            &alt.implementation,
                            &default.implementation,
                        ));
                        row.ratio_range = match (alt.q1_ms, alt.q3_ms, default.q1_ms, default.q3_ms)
                        {
                            (Some(aq1), Some(aq3), Some(dq1), Some(dq3)) if dq1 > 0.0 => {
                                Some((aq1 / dq3, aq3 / dq1))
                            }
                            _ => None,
                        };
                    }
                    (Status::Ok, _, None) => {
                        // Why there is no ratio: no alternative's row at all (the part of the
                        // run holding the case compared none), none that ran, or none usable.
                        let alternatives: Vec<&&Row> =
                            by_impl.values().filter(|r| !r.default).collect();
                        // A run cut off in this case before the row of an implementation that
                        // its part measured elsewhere: that alternative was never reached.
                        let key = crate::load::case_key(&default.case);
                        let unreached = l.cut_off_cases.contains(&key)
                            && l.case_parts.get(&key).is_some_and(|p| {
                                p.implementations.iter().any(|i| {
                                    i != &default.implementation
                                        && !by_impl.contains_key(i.as_str())
                                })
                            });
                        row.note = Some(
                            if unreached {
                                "the run was cut off before an alternative's row at this size"
                            } else if alternatives.is_empty() {
                                "no alternative measured at this size"
                            } else if alternatives.iter().all(|r| r.status != Status::Ok) {
                                "no alternative ran (each row says why)"
                            } else {
                                "no accurate alternative ran with a timing that is not launch-bound"
                            }
                            .to_string(),
                        )
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

/// Marks, per group, the row with the largest x that has a ratio or an inaccurate default.
fn mark_representatives(rows: &mut [GlanceRow]) {
    let mut last: BTreeMap<&str, usize> = BTreeMap::new();
    // Rows of a group are contiguous and in ascending x.
    for (i, r) in rows.iter().enumerate() {
        if r.ratio_value.is_some() || r.default_inaccurate {
            last.insert(r.href.as_str(), i);
        }
    }
    let picks: Vec<usize> = last.into_values().collect();
    for i in picks {
        rows[i].representative = true;
    }
}

/// The setup of one document, or of the shards of one part of a run ([`super::shard_groups`])
/// together: a fact the shards recorded differently (two machines of one kind, a driver
/// updated between sessions) lists each value; rows and flags are summed, times span them.
fn setup_doc(group: &[&Loaded]) -> SetupDoc {
    let l = group[0];
    let kv = |k: &str, v: String| KeyValue {
        key: k.to_string(),
        value: v,
    };
    let opt = |v: Option<String>| v.unwrap_or_else(|| "—".to_string());
    // Each shard's value, the distinct ones in shard order.
    let each = |f: &dyn Fn(&Loaded) -> String| -> String {
        let mut seen: Vec<String> = Vec::new();
        for g in group {
            let v = f(g);
            if !seen.contains(&v) {
                seen.push(v);
            }
        }
        seen.join("; ")
    };
    let mhz = |v: Option<f64>| v.map(|v| format!("{} MHz", format::sig(v, 4)));
    let mut device = vec![
        kv("Name", each(&|g| g.doc.device.name.clone())),
        kv(
            "Kind",
            each(&|g| format!("{:?}", g.doc.device.kind).to_lowercase()),
        ),
        kv(
            "Compute capability",
            each(&|g| opt(g.doc.device.compute_capability.clone())),
        ),
        kv(
            "SMs",
            each(&|g| opt(g.doc.device.sm_count.map(|v| v.to_string()))),
        ),
        kv(
            "Memory (MB)",
            each(&|g| opt(g.doc.device.memory_mb.map(format::mb))),
        ),
        kv(
            "L2 (MB)",
            each(&|g| opt(g.doc.device.l2_mb.map(format::mb))),
        ),
        kv(
            "Driver",
            each(&|g| opt(g.doc.device.driver_version.clone())),
        ),
        kv("CUDA", each(&|g| opt(g.doc.device.cuda_version.clone()))),
        kv(
            "NVRTC target architecture",
            each(&|g| opt(g.doc.device.nvrtc_arch.clone())),
        ),
        kv(
            "Max SM clock",
            each(&|g| opt(mhz(g.doc.device.max_sm_clock_mhz))),
        ),
        kv(
            "Max memory clock",
            each(&|g| opt(mhz(g.doc.device.max_mem_clock_mhz))),
        ),
        kv(
            "Power limit",
            each(&|g| {
                opt(g
                    .doc
                    .device
                    .power_limit_w
                    .map(|w| format!("{} W", format::sig(w, 3))))
            }),
        ),
        kv("Host CPU", each(&|g| opt(g.doc.device.host_cpu.clone()))),
    ];
    if group.iter().any(|g| g.doc.device.cpu_threads.is_some()) {
        device.push(kv(
            "CPU threads",
            each(&|g| opt(g.doc.device.cpu_threads.map(|t| t.to_string()))),
        ));
    }
    device.push(kv("OS", each(&|g| opt(g.doc.device.os.clone()))));
    let c = &l.doc.config;
    let rows: Vec<&crate::schema::Row> = group.iter().flat_map(|g| g.doc.rows.iter()).collect();
    // What the rows say of the machine while they ran.
    let throttled = rows
        .iter()
        .filter(|r| {
            super::groups::machine_flags(r)
                .iter()
                .any(|f| f.starts_with("throttled"))
        })
        .count();
    let shared = rows
        .iter()
        .filter(|r| {
            r.machine
                .as_ref()
                .is_some_and(|m| !m.other_processes.is_empty())
        })
        .count();
    let clocks: Vec<f64> = rows
        .iter()
        .filter_map(|r| r.machine.as_ref()?.sm_clock_mhz)
        .collect();
    // Every library any shard recorded, each with its versions.
    let libraries = super::library_versions(group)
        .into_iter()
        .map(|(k, versions)| {
            let shown: Vec<String> = versions
                .iter()
                .map(|v| format::library_version(&k, v))
                .collect();
            kv(&k, shown.join("; "))
        })
        .collect();
    let mut amendments: Vec<String> = Vec::new();
    for a in group.iter().flat_map(|g| g.doc.config.amendments.iter()) {
        let a = format!("{}: {} ({})", a.when, a.what, a.why);
        if !amendments.contains(&a) {
            amendments.push(a);
        }
    }
    let started = group.iter().map(|g| g.doc.config.started_at.clone()).min();
    // The last shard's end, unless one recorded none (it did not finish).
    let finished = group
        .iter()
        .map(|g| g.doc.config.finished_at.clone())
        .collect::<Option<Vec<_>>>()
        .and_then(|f| f.into_iter().max());
    SetupDoc {
        file: super::group_files(group),
        suite: l.doc.suite.title().to_string(),
        device,
        libraries,
        run: vec![
            kv("Runner", format!("{} {}", c.runner, c.runner_version)),
            kv("Git commit", c.git_commit.clone()),
            kv("Started", opt(started)),
            kv("Finished", opt(finished)),
            kv("Rows", rows.len().to_string()),
            kv(
                "Shards not in the data folder",
                l.missing_shards_text()
                    .unwrap_or_else(|| "none".to_string()),
            ),
            kv(
                "SM clock during the rows",
                match (
                    clocks.iter().copied().reduce(f64::min),
                    clocks.iter().copied().reduce(f64::max),
                ) {
                    (Some(lo), Some(hi)) => {
                        format!("{}–{} MHz", format::sig(lo, 4), format::sig(hi, 4))
                    }
                    _ => "not recorded".to_string(),
                },
            ),
            kv("Rows throttled", throttled.to_string()),
            kv("Rows with another process on the GPU", shared.to_string()),
            kv(
                "Changed after the run",
                if amendments.is_empty() {
                    "no".to_string()
                } else {
                    amendments.join("; ")
                },
            ),
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

/// A value the document recorded, or words saying it did not.
fn recorded(v: Option<String>) -> String {
    v.unwrap_or_else(|| "(not recorded in this document)".to_string())
}

fn timing_view(
    t: &TimingConfig,
    protocol: Option<&crate::schema::ProtocolConstants>,
    docs: &[&Loaded],
) -> TimingView {
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
    // The samplings, without the per-row errors some notes append (`rel_l2 …`, `largest …`):
    // each distinct description once.
    let checked: BTreeSet<String> = docs
        .iter()
        .flat_map(|l| {
            l.doc
                .rows
                .iter()
                .filter_map(|r| r.accuracy.as_ref()?.checked.as_deref())
        })
        .map(|c| {
            c.split("; ")
                .filter(|part| !part.starts_with("rel_l2 ") && !part.starts_with("largest "))
                .collect::<Vec<_>>()
                .join("; ")
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
    let mut checked: Vec<String> = checked.into_iter().collect();
    // Natural order: by the numbers in the text (2 of 32 ... 512 before 1024).
    checked.sort_by_key(|c| {
        c.split(|ch: char| !ch.is_ascii_digit())
            .filter_map(|n| n.parse::<u64>().ok())
            .collect::<Vec<_>>()
    });
    let mut throughputs: Vec<String> = Vec::new();
    for l in docs {
        for t in &l.doc.config.throughput {
            let s = format!(
                "{} = {} of one call ÷ median time (s) ÷ {:e}",
                t.unit,
                t.count.as_str(),
                t.per_second
            );
            if !throughputs.contains(&s) {
                throughputs.push(s);
            }
        }
    }
    // Per device (its name, in the order the documents come), then pooled.
    let mut per_card: Vec<(&str, usize, usize, usize)> = Vec::new();
    for l in docs {
        let name = l.doc.device.name.as_str();
        let i = match per_card.iter().position(|c| c.0 == name) {
            Some(i) => i,
            None => {
                per_card.push((name, 0, 0, 0));
                per_card.len() - 1
            }
        };
        for r in &l.doc.rows {
            per_card[i].1 += usize::from(r.status == Status::Ok);
            per_card[i].2 += usize::from(super::groups::launch_bound(r, &l.doc));
            per_card[i].3 += usize::from(super::groups::eager_launch_bound(r, &l.doc));
        }
    }
    let ok_rows: usize = per_card.iter().map(|c| c.1).sum();
    let launch_bound: usize = per_card.iter().map(|c| c.2).sum();
    let eager_launch_bound: usize = per_card.iter().map(|c| c.3).sum();
    // Each device's share, in parentheses, where the documents come from several devices and
    // the total is not 0.
    let by_device = |total: usize, count: fn(&(&str, usize, usize, usize)) -> String| {
        if per_card.len() < 2 || total == 0 {
            String::new()
        } else {
            format!(
                " ({})",
                per_card
                    .iter()
                    .map(|c| format!("{} on the {}", count(c), c.0))
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        }
    };
    let graph_replayed: BTreeSet<&str> = docs
        .iter()
        .flat_map(|l| l.doc.rows.iter())
        .filter(|r| r.timing == Some(crate::schema::TimingMethod::GraphReplay))
        .map(|r| r.implementation.as_str())
        .collect();
    let alternative_compiles: BTreeSet<&str> = docs
        .iter()
        .flat_map(|l| l.doc.rows.iter())
        // An alternative's first call is recorded apart (`first_call_s`); the project's rows
        // record their compile only.
        .filter(|r| r.first_call_s.is_some() && r.compile_s.is_some())
        .map(|r| r.implementation.as_str())
        .collect();
    TimingView {
        throughputs: md_text(&throughputs.join("; ")),
        flop_rules: md_text(&flop_rules.into_iter().collect::<Vec<_>>().join("; ")),
        peak_methods: md_text(&peak_methods),
        files: super::shard_groups(docs)
            .iter()
            .map(|g| super::group_files(g))
            .collect::<Vec<_>>()
            .join(", "),
        warmup_ms: format::sig(t.warmup_ms, 3),
        launch_bound_ratio: format::sig(t.launch_bound_ratio, 3),
        several_runs: t.runs > 1,
        runs: match t.runs {
            1 => "once".to_string(),
            n => format!("{n} times"),
        },
        min_samples: recorded(protocol.map(|p| p.min_samples.to_string())),
        max_input_sets: recorded(protocol.map(|p| p.max_input_sets.to_string())),
        rotation_memory_share: recorded(
            protocol.map(|p| format!("{} %", format::sig(100.0 * p.rotation_memory_fraction, 3))),
        ),
        process_limit: recorded(protocol.map(|p| {
            format!(
                "{} × {} s + {} s = {} s",
                format::sig(p.process_limit_factor, 3),
                format::sig(t.case_timeout_s, 3),
                format::sig(p.process_limit_margin_s, 3),
                format::sig(
                    p.process_limit_factor * t.case_timeout_s + p.process_limit_margin_s,
                    4
                )
            )
        })),
        machine_sample_ms: recorded(protocol.map(|p| format::sig(p.machine_sample_ms, 3))),
        kernels_compiled_once: protocol.is_some_and(|p| p.kernels_compiled_once),
        throttled_share: format!(
            "{} %",
            format::sig(100.0 * super::groups::THROTTLED_CLOCK_SHARE, 3)
        ),
        graph_replayed: md_text(&graph_replayed.into_iter().collect::<Vec<_>>().join(", ")),
        alternative_compiles: md_text(
            &alternative_compiles
                .into_iter()
                .collect::<Vec<_>>()
                .join(", "),
        ),
        launch_bound_rows: format!(
            "{launch_bound} of {ok_rows} rows{}",
            by_device(launch_bound, |c| format!("{} of {}", c.2, c.1))
        ),
        eager_launch_bound_rows: format!(
            "{eager_launch_bound}{}",
            by_device(eager_launch_bound, |c| c.3.to_string())
        ),
        repeats: t.repeats.to_string(),
        min_sample_ms: format::sig(t.min_sample_ms, 3),
        max_inner: t.max_inner.to_string(),
        l2_rotation_factor: format::sig(t.l2_rotation_factor, 3),
        inputs_rotated: t.l2_rotation_factor > 0.0,
        case_timeout_s: format::sig(t.case_timeout_s, 3),
        input_sets,
        references: if refs.is_empty() {
            "—".to_string()
        } else {
            refs.into_iter().collect::<Vec<_>>().join("; ")
        },
        checked: match checked.len() {
            0 => "every output element".to_string(),
            n if n <= CHECKED_SHOWN => md_text(&checked.join(" | ")),
            n => md_text(&format!(
                "{} | and {} more samplings (each row's accuracy note names its own)",
                checked[..CHECKED_SHOWN].join(" | "),
                n - CHECKED_SHOWN
            )),
        },
    }
}

/// One view per distinct timing configuration and protocol, in document order.
fn methodology(docs: &[Loaded]) -> Vec<TimingView> {
    type Key<'a> = (
        &'a TimingConfig,
        Option<&'a crate::schema::ProtocolConstants>,
    );
    let mut configs: Vec<(Key, Vec<&Loaded>)> = Vec::new();
    for l in docs {
        let key = (&l.doc.config.timing, l.doc.config.protocol.as_ref());
        match configs.iter_mut().find(|(k, _)| *k == key) {
            Some((_, v)) => v.push(l),
            None => configs.push((key, vec![l])),
        }
    }
    configs
        .iter()
        .map(|((t, p), v)| timing_view(t, *p, v))
        .collect()
}

/// How many of a methodology block's distinct accuracy samplings are written out; the rest are
/// counted.
const CHECKED_SHOWN: usize = 4;

/// One size at which an alternative beat the default: (x label, default row, alternative row).
type FasterAt<'a> = (String, &'a Row, &'a Row);

/// The library name the project's own rows carry: its implementations' failures are listed
/// as limitations.
pub const OWN_LIBRARY: &str = env!("CARGO_PKG_NAME");

fn limitations(docs: &[Loaded], base: &str) -> Vec<Limitation> {
    let mut out = Vec::new();
    for l in docs {
        let axis = primary_axis(&l.doc);
        if let Some(detail) = super::suite::incomplete_run(l) {
            out.push(Limitation {
                kind: "incomplete run".to_string(),
                place: format!(
                    "{} on {} ({})",
                    l.doc.suite.title(),
                    l.doc.device.name,
                    l.file_name()
                ),
                href: format!("{base}{}#d-{}", page_of(l.doc.suite), doc_id(l)),
                detail,
                ratio_html: None,
            });
        }
        out.extend(own_failures(l, axis, base));
        for g in group_rows(&l.doc, axis) {
            let href = group_href(base, l, &g);
            // Faster alternatives, gathered over the group's sizes: (size, default, alternative).
            let mut faster: BTreeMap<(String, String), Vec<FasterAt>> = BTreeMap::new();
            // Sizes where the default did not run while an alternative did, gathered over the
            // group per (default, status, message): (size, what ran there).
            let mut not_run: BTreeMap<(String, String, String), Vec<(String, String)>> =
                BTreeMap::new();
            for (x, by_impl) in g.by_x.values() {
                let mut place = format!(
                    "{} on {}, {}",
                    l.doc.suite.title(),
                    l.doc.device.name,
                    g.title()
                );
                // A case without the axis (separate query and key lengths) has no size to name.
                if let Some(x) = x {
                    place.push_str(&format!(", {axis}={x}"));
                }
                let lim = |kind: &str, detail: String| Limitation {
                    kind: kind.to_string(),
                    place: place.clone(),
                    href: href.clone(),
                    detail,
                    ratio_html: None,
                };
                let default = by_impl.values().find(|r| r.default);
                if let Some(d) = default {
                    if d.status == Status::Ok {
                        if let Some(d_q1) = d.q1_ms {
                            // An alternative whose output was not checked against the
                            // reference computes something else (a ceiling, such as MoE's
                            // dense GEMM of equal FLOPs): not an alternative to the default.
                            for r in by_impl.values().filter(|r| {
                                !r.default && r.status == Status::Ok && r.accuracy.is_some()
                            }) {
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
                            not_run
                                .entry((
                                    d.implementation.clone(),
                                    d.status.as_str().to_string(),
                                    d.message.clone().unwrap_or_default(),
                                ))
                                .or_default()
                                .push((x_label(*x), ran.join(", ")));
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
            for ((default, status, message), sizes) in not_run {
                let mut place = format!(
                    "{} on {}, {}",
                    l.doc.suite.title(),
                    l.doc.device.name,
                    g.title()
                );
                let detail = if let [(x, ran)] = &sizes[..] {
                    if x != "—" {
                        place.push_str(&format!(", {axis}={x}"));
                    }
                    format!("while {ran} ran")
                } else {
                    let at: Vec<String> =
                        sizes.iter().map(|(x, ran)| format!("{x}: {ran}")).collect();
                    format!(
                        "at {} of {} measured {axis} values, while others ran ({axis} {})",
                        sizes.len(),
                        g.by_x.len(),
                        at.join("; ")
                    )
                };
                let why = if message.is_empty() {
                    String::new()
                } else {
                    format!(" ({message})")
                };
                out.push(Limitation {
                    kind: "default did not run".to_string(),
                    place,
                    href: href.clone(),
                    detail: format!("the default {default} is {status}{why} {detail}"),
                    ratio_html: None,
                });
            }
            for ((default, alt), cases) in faster {
                // The site's direction: alternative ÷ default.
                let ratios: Vec<f64> = cases
                    .iter()
                    .filter_map(|(_, d, r)| Some(r.median_ms? / d.median_ms?))
                    .collect();
                let (lo, hi) = ratios.iter().fold((f64::INFINITY, 0.0f64), |(lo, hi), &q| {
                    (lo.min(q), hi.max(q))
                });
                // A group without the axis (separate query and key lengths) is one case: no
                // size to name.
                let axisless = g.by_x.keys().all(Option::is_none);
                let sizes: Vec<String> = cases
                    .iter()
                    .map(|(x, d, r)| {
                        format!(
                            "{}{} ms against the default's {} ms",
                            if axisless {
                                String::new()
                            } else {
                                format!("{x}: ")
                            },
                            r.median_ms.map(format::ms).unwrap_or_default(),
                            d.median_ms.map(format::ms).unwrap_or_default()
                        )
                    })
                    .collect();
                let at = if axisless {
                    format!("in this case ({})", sizes.join("; "))
                } else {
                    format!(
                        "at {} of {} measured {axis} values ({axis} {})",
                        cases.len(),
                        g.by_x.len(),
                        sizes.join("; ")
                    )
                };
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
                        "{alt} beats the default {default} by more than the spread of both (its q3 below the default's q1) {at}; {alt}'s time ÷ {default}'s:"
                    ),
                    ratio_html: Some(format::time_ratio_html(lo, hi, &alt, &default)),
                });
            }
        }
    }
    out
}

/// One limitation per (own implementation, status) that did not run: the smallest size where
/// it failed, its message there, and how many cases failed so ("math: oom from seq_len 32768").
fn own_failures(l: &Loaded, axis: &str, base: &str) -> Vec<Limitation> {
    // (implementation, status) -> failing rows, in document order.
    let mut failing: BTreeMap<(&str, Status), Vec<&Row>> = BTreeMap::new();
    for r in &l.doc.rows {
        if r.library == OWN_LIBRARY && r.status != Status::Ok {
            failing
                .entry((r.implementation.as_str(), r.status))
                .or_default()
                .push(r);
        }
    }
    let mut out = Vec::new();
    for ((implementation, status), rows) in failing {
        // The smallest size: by the axis value, then by the rest of the case.
        let Some(first) = rows.iter().min_by(|a, b| {
            let key = |r: &Row| r.case.get(axis).map(super::groups::param_key);
            key(a).cmp(&key(b)).then_with(|| {
                crate::load::case_label(&a.case).cmp(&crate::load::case_label(&b.case))
            })
        }) else {
            continue;
        };
        let g = group_rows(&l.doc, axis).into_iter().find(|g| {
            let mut params = first.case.clone();
            params.remove(axis);
            g.params == params
        });
        let href = match &g {
            Some(g) => group_href(base, l, g),
            None => format!("{base}{}", page_of(l.doc.suite)),
        };
        let size = x_label(first.case.get(axis));
        let what = match status {
            Status::Oom => "runs out of memory",
            Status::Unsupported => "does not support the case",
            Status::Error => "fails with an error",
            Status::Timeout => "runs past the time limit",
            Status::Ok => continue,
        };
        out.push(Limitation {
            kind: format!("{implementation}: {}", status.as_str()),
            place: format!(
                "{} on {}, {}",
                l.doc.suite.title(),
                l.doc.device.name,
                crate::load::case_label(&first.case)
            ),
            href,
            ratio_html: None,
            detail: format!(
                "{implementation} {what} {} ({} case{} in all){}",
                if size == "—" {
                    "in this case".to_string()
                } else {
                    format!("from {axis} = {size}")
                },
                rows.len(),
                if rows.len() == 1 { "" } else { "s" },
                first
                    .message
                    .as_deref()
                    .map(|m| format!(": {m}"))
                    .unwrap_or_default()
            ),
        });
    }
    out
}
