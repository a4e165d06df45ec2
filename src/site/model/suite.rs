//! The suite pages (Attention; Sequence mixers, kernel sums and MoE; Models): one table and
//! its figures per group of rows, drawn against the document's declared axes, with every
//! throughput the document declares.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use super::super::format;
use super::groups::{
    device_label, doc_id, group_id, group_rows, implementations, param_f64, primary_axis,
    throughput, x_label, Group, ImplHeader,
};
use super::overview::{BarOutcome, GlanceBar, GlanceChart, RatioWords};
use super::{measure_command, CommandView, FigureRef, Layout};
use crate::load::Loaded;
use crate::schema::{Document, Row, Status, Suite, Throughput, TimingMethod};

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
    /// The suite's tile sweeps (one per device), after its grids.
    pub tile_sweeps: Vec<super::tiles::TileSweepSection>,
}

/// The groups of one document.
#[derive(Debug, Serialize)]
pub struct DocSection {
    /// Anchor of its heading.
    pub anchor: String,
    /// Data file.
    pub file: String,
    /// Device name (and compute capability).
    pub device: String,
    /// What kind of run the document holds beyond the suite's grid (`decoding grid`, `masks
    /// grid`), or empty for the grid.
    pub kind: String,
    /// What each cell shows, in order: `median ms (q1–q3) · TFLOP/s · rel_err · compile s`,
    /// with the document's declared throughput units.
    pub cell_legend: String,
    /// Set when shards of the run are not in the data folder: which, and what that leaves out.
    pub incomplete: Option<String>,
    /// The commit the run measured (short): two cards' runs may differ in it.
    pub commit: String,
    /// Implementations the suite's other documents of the same kind of run, on a device of the
    /// same kind (GPU or CPU), have rows of and this run has none of (it did not compare them: its command says why), sorted: a column
    /// missing from these tables is not a row that failed.
    pub not_run: Vec<String>,
    /// Groups of rows sharing every parameter but the x parameter.
    pub groups: Vec<GroupView>,
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
    /// One figure per declared throughput against x.
    pub throughput_figures: Vec<FigureRef>,
    /// Figures against the document's later axes (`config.axes[1..]`), for the groups along
    /// them that share this group's parameters.
    pub other_axis_figures: Vec<FigureRef>,
    /// Peak memory against x, when some row recorded `memory.peak_mb`.
    pub memory_figure: Option<FigureRef>,
    /// Relative error against x with the tolerance, when some row recorded `accuracy`.
    pub error_figure: Option<FigureRef>,
    /// Each implementation's time over the default's, against x, when the group has a default
    /// and another implementation that ran beside it.
    pub ratio_figure: Option<FigureRef>,
    /// Per (x, implementation) that ran: spread, accuracy, compile time and memory.
    pub details: Vec<DetailRow>,
    /// How each implementation's `peak_mb` was read, once per implementation (the memory
    /// table would repeat it on every row).
    pub peak_methods: Vec<KeyText>,
}

/// Between two ways an implementation's peak memory was read, in a group's list (a method's
/// own text may hold `; `).
const PEAK_METHODS_SEP: &str = " | ";

/// An implementation and a text about it.
#[derive(Debug, Serialize)]
pub struct KeyText {
    /// Implementation.
    pub implementation: String,
    /// The text.
    pub text: String,
}

/// One table row.
#[derive(Debug, Serialize)]
pub struct TableRow {
    /// The x value.
    pub x: String,
    /// Its own anchor, for a case of the table of cases measured at one size (the anchor its
    /// group would have had, so links to the group still land on it).
    pub anchor: Option<String>,
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
    /// The declared throughputs, formatted, in declaration order.
    pub throughput: Vec<ThroughputCell>,
    /// True when rel_err > tolerance (the cell says so; the details table has the figures).
    pub above_tolerance: bool,
    /// How the median was timed, when not by back-to-back calls: `graph replay`.
    pub timing: Option<String>,
    /// For a graph-replayed row, the eager back-to-back median (`eager 0.0279 ms`).
    pub eager: Option<String>,
    /// Warnings on the timing: launch-bound, throttled, shared GPU.
    pub flags: Vec<String>,
    /// Status name.
    pub status: String,
    /// The row's message.
    pub message: Option<String>,
}

/// One throughput of a cell.
#[derive(Debug, Serialize)]
pub struct ThroughputCell {
    /// The value, three significant digits.
    pub value: String,
    /// Its unit, as the document declares it.
    pub unit: String,
    /// The value as a share of the device's ceiling (`41 %`), when the document records one.
    pub of_peak: Option<String>,
}

/// The details of one row that ran: spread, accuracy, compile time and memory.
#[derive(Debug, Serialize)]
pub struct DetailRow {
    /// The x value.
    pub x: String,
    /// Implementation.
    pub implementation: String,
    /// `q1–q3` ms.
    pub iqr: String,
    /// Relative error, or `—`.
    pub rel_err: String,
    /// Its tolerance, or `—`.
    pub tolerance: String,
    /// True when rel_err > tolerance.
    pub above_tolerance: bool,
    /// Compile (NVRTC, torch.compile, XLA) and load time, s, or `—`.
    pub compile_s: String,
    /// Wall time of the first call in a fresh process (frameworks), s, or `—`.
    pub first_call_s: String,
    /// `events` (back-to-back calls between two events) or `graph replay`.
    pub timing: String,
    /// Median host time to issue one call, ms, or `—`.
    pub host_ms: String,
    /// For graph-replayed rows, the eager back-to-back median, ms, or `—`.
    pub eager_ms: String,
    /// The spread of the runs' medians (`--runs k`), `min–max` ms, or `—` for one run.
    pub runs: String,
    /// SM clock / its maximum, MHz, temperature and power during the row, or `—`.
    pub machine: String,
    /// The row's notes and the warnings on its timing, joined.
    pub notes: String,
    /// Reserved peak (framework caching allocators), MB, or `—`.
    pub reserved_peak_mb: String,
    /// Library workspace held apart from the peak, MB, or `—`.
    pub workspace_mb: String,
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

/// One line figure: a measured quantity (time, throughput, peak memory or relative error)
/// against an axis; log x, and log y except for throughput.
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
    /// True for a logarithmic y axis; a linear one starts at 0.
    pub log_y: bool,
}

/// One implementation in a figure.
#[derive(Debug, Clone)]
pub struct Series {
    /// Legend label.
    pub name: String,
    /// Colour (CSS hex).
    pub colour: String,
    /// Point marker, fixed per implementation name.
    pub marker: Marker,
    /// Line pattern, fixed per implementation name.
    pub dash: Dash,
    /// True for the default implementation (drawn thicker).
    pub emphasis: bool,
    /// (x, value) of ok rows, x ascending.
    pub points: Vec<(f64, f64)>,
    /// (x, status) of rows that did not run.
    pub failed: Vec<(f64, String)>,
}

/// A suite page's table of contents: each suite (when the page holds several), each document
/// (device) of it, each group; then how to reproduce. Suites not measured get one entry.
pub fn toc(sections: &[SuiteSection]) -> Vec<super::TocEntry> {
    let mut out = Vec::new();
    let several = sections.len() > 1;
    for s in sections {
        if several {
            out.push(super::TocEntry {
                href: format!("#{}", s.anchor),
                label: if s.measured {
                    s.title.clone()
                } else {
                    format!("{} (not measured yet)", s.title)
                },
                depth: 1,
            });
        }
        for d in &s.documents {
            out.push(super::TocEntry {
                href: format!("#{}", d.anchor),
                label: if d.kind.is_empty() {
                    d.device.clone()
                } else {
                    format!("{}: {}", d.device, d.kind)
                },
                depth: if several { 2 } else { 1 },
            });
            for g in &d.groups {
                out.push(super::TocEntry {
                    href: format!("#{}", g.anchor),
                    label: g.title.clone(),
                    depth: if several { 3 } else { 2 },
                });
            }
        }
        for t in &s.tile_sweeps {
            out.push(super::TocEntry {
                href: format!("#{}", t.anchor),
                label: format!("Tile sweep: {}", t.device),
                depth: if several { 2 } else { 1 },
            });
            for g in &t.groups {
                out.push(super::TocEntry {
                    href: format!("#{}", g.anchor),
                    label: g.title.clone(),
                    depth: if several { 3 } else { 2 },
                });
            }
        }
    }
    out.push(super::TocEntry {
        href: "#how-to-reproduce".to_string(),
        label: "How to reproduce".to_string(),
        depth: 1,
    });
    out
}

/// The section of `suite` on its page, its figures pushed onto `figures` and the bar charts of
/// its cases measured at one size onto `charts`.
pub fn suite_section(
    docs: &[Loaded],
    suite: Suite,
    base: &str,
    colours: &BTreeMap<String, String>,
    figures: &mut Vec<FigureSpec>,
    charts: &mut Vec<GlanceChart>,
) -> SuiteSection {
    let of_suite: Vec<&Loaded> = docs
        .iter()
        .filter(|l| l.doc.suite == suite && !l.doc.rows.is_empty())
        .collect();
    let documents: Vec<DocSection> = of_suite
        .iter()
        .map(|l| {
            let mut d = doc_section(l, base, colours, figures, charts);
            let names = |l: &Loaded| -> BTreeSet<String> {
                l.doc
                    .rows
                    .iter()
                    .map(|r| r.implementation.clone())
                    .collect()
            };
            let own = names(l);
            let elsewhere: BTreeSet<String> = of_suite
                .iter()
                .filter(|o| {
                    o.doc.config.kind == l.doc.config.kind && o.doc.device.kind == l.doc.device.kind
                })
                .flat_map(|o| names(o))
                .collect();
            d.not_run = elsewhere.difference(&own).cloned().collect();
            d
        })
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
        tile_sweeps: Vec::new(),
    }
}

fn doc_section(
    loaded: &Loaded,
    base: &str,
    colours: &BTreeMap<String, String>,
    figures: &mut Vec<FigureSpec>,
    charts: &mut Vec<GlanceChart>,
) -> DocSection {
    let doc = &loaded.doc;
    let impls = implementations(doc, colours);
    let axis = primary_axis(doc);
    let decls = &doc.config.throughput;
    // Groups along the later axes, keyed by the parameters they share with a primary group.
    let mut later: Vec<(BTreeMap<String, crate::schema::Param>, FigureRef)> = Vec::new();
    for other in doc.config.axes.iter().skip(1) {
        for g in group_rows(doc, other) {
            let id = group_id(loaded, &g);
            let mut metrics = vec![Metric::Time];
            metrics.extend(decls.iter().map(Metric::Throughput));
            for metric in metrics {
                if let Some(spec) = figure_spec(doc, &g, &id, &impls, metric) {
                    let mut shared = g.params.clone();
                    shared.remove(axis);
                    later.push((shared, FigureRef::line(base, &spec)));
                    figures.push(spec);
                }
            }
        }
    }
    let grouped = group_rows(doc, axis);
    // Implementations that never share a case (a suite of several ops) get tables of their own:
    // a group's columns are the families of the implementations it has rows of.
    let families = super::groups::families(doc);
    let family_of: Vec<usize> = grouped
        .iter()
        .map(|g| {
            g.by_x
                .values()
                .flat_map(|(_, by)| by.keys())
                .filter_map(|n| families.get(*n).copied())
                .min()
                .unwrap_or(0)
        })
        .collect();
    let mut groups: Vec<GroupView> = grouped
        .iter()
        .zip(&family_of)
        .map(|(g, family)| {
            // The default is the group's: an implementation the dispatch picks for some other
            // cases of the document (math for fp32) is not the default of these.
            // A column of the family is left out where the implementation has no row of the
            // group's cases though the parts that measured them ran it elsewhere (a library that
            // runs only some of the suite's operations), where its cells could say only `not
            // measured`. It stays where a part left it out or the run was cut off in one of the
            // cases: its cells say so.
            let explained = |name: &str| {
                g.by_x.values().any(|(_, by)| {
                    let (cut_off, part) = case_context(loaded, by.values().next().copied());
                    cut_off || part.is_some_and(|p| !p.implementations.contains(name))
                })
            };
            let mut impls: Vec<ImplHeader> = impls
                .iter()
                .filter(|h| families.get(h.name.as_str()) == Some(family))
                .filter(|h| {
                    g.by_x
                        .values()
                        .any(|(_, by)| by.contains_key(h.name.as_str()))
                        || explained(&h.name)
                })
                .cloned()
                .map(|mut h| {
                    h.is_default = g
                        .by_x
                        .values()
                        .any(|(_, by)| by.get(h.name.as_str()).is_some_and(|r| r.default));
                    h
                })
                .collect();
            sort_columns(&mut impls);
            let id = group_id(loaded, g);
            // A case measured at one size has no line to draw: it joins the table of such cases.
            let single = g.by_x.len() < 2;
            let rows = g
                .by_x
                .values()
                .map(|(x, by_impl)| TableRow {
                    x: x_label(*x),
                    anchor: None,
                    cells: {
                        // A missing cell of a case the run was cut off in is a row never
                        // reached, unless the part of the run that measured the case never
                        // ran that implementation.
                        let (cut_off, part) =
                            case_context(loaded, by_impl.values().next().copied());
                        impls
                            .iter()
                            .map(|h| {
                                let row = by_impl.get(h.name.as_str()).copied();
                                cell(&h.name, row, doc, cut_off, part)
                            })
                            .collect()
                    },
                })
                .collect();
            let details = g
                .by_x
                .values()
                .flat_map(|(x, by_impl)| {
                    impls.iter().filter_map(move |h| {
                        let row = by_impl.get(h.name.as_str())?;
                        (row.status == Status::Ok).then(|| detail_row(x_label(*x), row, doc))
                    })
                })
                .collect();
            let mut add = |metric: Metric| {
                if single {
                    return None;
                }
                figure_spec(doc, g, &id, &impls, metric).map(|spec| {
                    let r = FigureRef::line(base, &spec);
                    figures.push(spec);
                    r
                })
            };
            let figure = add(Metric::Time);
            let throughput_figures = decls
                .iter()
                .filter_map(|d| add(Metric::Throughput(d)))
                .collect();
            let ratio_figure = add(Metric::RatioToDefault);
            let memory_figure = add(Metric::PeakMemory);
            let error_figure = add(Metric::RelErr);
            // A later-axis group belongs here when its parameters (less this axis) are ours.
            let other_axis_figures = later
                .iter()
                .filter(|(shared, _)| shared.iter().all(|(k, v)| g.params.get(k) == Some(v)))
                .map(|(_, f)| f.clone())
                .collect();
            let mut peak_methods: Vec<KeyText> = Vec::new();
            for h in &impls {
                let methods: std::collections::BTreeSet<&str> = g
                    .by_x
                    .values()
                    .filter_map(|(_, by)| by.get(h.name.as_str()))
                    .filter_map(|r| r.memory.as_ref()?.peak_method.as_deref())
                    .collect();
                if !methods.is_empty() {
                    peak_methods.push(KeyText {
                        implementation: h.name.clone(),
                        // A method's own text may hold `; `: methods are set apart by ` | `.
                        text: methods
                            .into_iter()
                            .collect::<Vec<_>>()
                            .join(PEAK_METHODS_SEP),
                    });
                }
            }
            GroupView {
                peak_methods,
                anchor: format!("g-{id}"),
                title: g.title(),
                x_name: axis.to_string(),
                implementations: impls.clone(),
                rows,
                figure,
                throughput_figures,
                other_axis_figures,
                memory_figure,
                error_figure,
                ratio_figure,
                details,
            }
        })
        .collect();
    merge_single_cases(loaded, &grouped, &mut groups, axis, &family_of);
    for g in &mut groups {
        if g.x_name == "case" && g.ratio_figure.is_none() {
            if let Some(chart) = single_cases_chart(loaded, &grouped, g) {
                g.ratio_figure = Some(FigureRef::glance(base, &chart));
                charts.push(chart);
            }
        }
    }
    let mut legend = vec!["median time per call, ms".to_string()];
    legend.extend(decls.iter().map(|d| {
        if let Some(c) = &d.ceiling {
            format!(
                "{} (share of {} {}, the device's peak as measured in the run)",
                d.unit,
                format::sig(c.value, 3),
                d.unit
            )
        } else {
            d.unit.clone()
        }
    }));
    DocSection {
        anchor: format!("d-{}", doc_id(loaded)),
        file: loaded.file_name(),
        device: device_label(doc),
        kind: match doc.config.kind {
            crate::schema::RunKind::Decode => "decoding grid".to_string(),
            crate::schema::RunKind::Masks => "masks grid (flex_attention)".to_string(),
            _ => String::new(),
        },
        cell_legend: legend.join(" · "),
        incomplete: incomplete_run(loaded),
        commit: format::short_commit(&doc.config.git_commit),
        not_run: Vec::new(),
        groups,
    }
}

/// The sentences saying which shards of `loaded`'s run the data folder lacks and whether the
/// run stopped before it finished (a document without `finished_at`), or `None` when neither.
pub fn incomplete_run(loaded: &Loaded) -> Option<String> {
    let missing = loaded.missing_shards_text().map(|missing| {
        format!(
            "Incomplete run: {} {} not in the data folder. The cases of a missing shard have no \
             rows here (a shard takes every n-th case of its part of the grid), so these tables \
             and the comparisons built on them cover part of the grid; measure the rest with \
             the same command and build (commit {}), changing only --shard and --output.",
            missing,
            if loaded.missing_shards.len() == 1 && loaded.missing_shards[0].missing.len() == 1 {
                "is"
            } else {
                "are"
            },
            format::short_commit(&loaded.doc.config.git_commit)
        )
    });
    let stopped = (!loaded.cut_off_cases.is_empty()).then(|| {
        // Which parts of the run (documents, told apart by their commands) were cut off; when
        // the run had other parts, they may hold cases the cut-off part never reached.
        let cut: BTreeSet<&str> = loaded
            .cut_off_cases
            .iter()
            .filter_map(|k| loaded.case_parts.get(k))
            .map(|p| p.command.as_str())
            .collect();
        let parts: BTreeSet<&str> = loaded
            .case_parts
            .values()
            .map(|p| p.command.as_str())
            .collect();
        if cut.is_empty() || cut.len() == parts.len() {
            return "The run stopped before it finished (a document of it has no finished_at, as \
                    when its time limit ran out): the cases it never reached have no rows, and \
                    where it reached a case for some implementations only, the others' cells say \
                    so."
            .to_string();
        }
        let one = cut.len() == 1;
        let names: Vec<String> = cut.iter().map(|c| format!("\"{c}\"")).collect();
        // "The other part" only when the run has two parts; with more, a case one cut-off part
        // missed may be in any other part, cut off or not.
        let others = if parts.len() == 2 {
            "the other part of the run measured them".to_string()
        } else {
            format!("another of the run's {} parts measured them", parts.len())
        };
        format!(
            "{} {}, stopped before {} finished ({} no finished_at, as when a time limit ran \
             out). Cases {} never reached have no rows unless {others}; where a case was \
             reached for some implementations only, the others' cells say so.",
            if one {
                "One part of the run,"
            } else {
                "Some parts of the run,"
            },
            names.join(", "),
            if one { "it" } else { "they" },
            if one {
                "its document has"
            } else {
                "their documents have"
            },
            if one { "that part" } else { "those parts" },
        )
    });
    match (missing, stopped) {
        (None, None) => None,
        (Some(m), None) => Some(m),
        (None, Some(s)) => Some(format!("Incomplete run: {}", lowercase_first(&s))),
        (Some(m), Some(s)) => Some(format!("{m} {s}")),
    }
}

/// `s` with its first letter in lower case.
fn lowercase_first(s: &str) -> String {
    let mut c = s.chars();
    match c.next() {
        Some(f) => f.to_lowercase().chain(c).collect(),
        None => String::new(),
    }
}

/// Replaces the groups measured at one size each (`groups[i]` is the view of `grouped[i]`) with
/// one table, placed after the sweeps: a row per case, labelled by the parameters in which the
/// cases differ (the ones they all share go to the title), columns as in every other table.
fn merge_single_cases(
    loaded: &Loaded,
    grouped: &[Group<'_>],
    groups: &mut Vec<GroupView>,
    axis: &str,
    family_of: &[usize],
) {
    let mut taken: Vec<Option<GroupView>> = std::mem::take(groups).into_iter().map(Some).collect();
    let mut merged = Vec::new();
    let families: std::collections::BTreeSet<usize> = family_of.iter().copied().collect();
    for family in families {
        let singles: Vec<usize> = (0..grouped.len())
            .filter(|&i| grouped[i].by_x.len() < 2 && family_of[i] == family)
            .collect();
        if singles.len() < 2 {
            continue;
        }
        let first = merged.is_empty();
        merged.push(merge_singles(
            loaded, grouped, &mut taken, axis, &singles, first,
        ));
    }
    let mut out: Vec<GroupView> = taken.into_iter().flatten().collect();
    out.extend(merged);
    *groups = out;
}

/// One table of the groups `singles` (taken out of `taken`), as [`merge_single_cases`] says.
fn merge_singles(
    loaded: &Loaded,
    grouped: &[Group<'_>],
    taken: &mut [Option<GroupView>],
    axis: &str,
    singles: &[usize],
    first: bool,
) -> GroupView {
    // Each case's parameters, the axis value included when it has one.
    let params: Vec<BTreeMap<String, String>> = singles
        .iter()
        .map(|&i| {
            let g = &grouped[i];
            let mut m: BTreeMap<String, String> = g
                .params
                .iter()
                .map(|(k, v)| (k.clone(), v.to_string()))
                .collect();
            if let Some(x) = g.by_x.values().next().and_then(|(x, _)| *x) {
                m.insert(axis.to_string(), x.to_string());
            }
            m
        })
        .collect();
    let shared: BTreeMap<String, String> = params[0]
        .iter()
        .filter(|(k, v)| params.iter().all(|p| p.get(*k) == Some(*v)))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let label = |p: &BTreeMap<String, String>| -> String {
        let parts: Vec<String> = p
            .iter()
            .filter(|(k, _)| !shared.contains_key(*k))
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        parts.join(", ")
    };
    // The columns: every group's (groups of one family may differ, by the implementations
    // with rows in them and by which is the default, which sorts first), the default of any
    // group first, then by name; each row's cells are placed under their implementation's.
    let mut impls: Vec<ImplHeader> = Vec::new();
    for &i in singles {
        for h in &taken[i].as_ref().expect("each group once").implementations {
            match impls.iter_mut().find(|k| k.name == h.name) {
                Some(k) => k.is_default |= h.is_default,
                None => impls.push(h.clone()),
            }
        }
    }
    sort_columns(&mut impls);
    let mut rows = Vec::new();
    let mut details = Vec::new();
    let mut peak_methods: Vec<KeyText> = Vec::new();
    for (&i, p) in singles.iter().zip(&params) {
        let g = taken[i].take().expect("each group once");
        let case = label(p);
        for mut r in g.rows {
            r.x = case.clone();
            r.anchor = Some(g.anchor.clone());
            let mut cells: Vec<Option<Cell>> = r.cells.into_iter().map(Some).collect();
            r.cells = impls
                .iter()
                .map(|h| {
                    cells
                        .iter_mut()
                        .find(|c| c.as_ref().is_some_and(|c| c.implementation == h.name))
                        .and_then(Option::take)
                        // No row of this case (its group had no such column).
                        .unwrap_or_else(|| {
                            let any = grouped[i].by_x.values().flat_map(|(_, by)| by.values());
                            let (cut_off, part) = case_context(loaded, any.copied().next());
                            cell(&h.name, None, &loaded.doc, cut_off, part)
                        })
                })
                .collect();
            rows.push(r);
        }
        for mut d in g.details {
            d.x = case.clone();
            details.push(d);
        }
        for m in g.peak_methods {
            match peak_methods
                .iter_mut()
                .find(|k| k.implementation == m.implementation)
            {
                Some(k) => {
                    // Each method once: the texts are whole methods set apart by the separator.
                    let mut all: Vec<&str> = k.text.split(PEAK_METHODS_SEP).collect();
                    for t in m.text.split(PEAK_METHODS_SEP) {
                        if !all.contains(&t) {
                            all.push(t);
                        }
                    }
                    k.text = all.join(PEAK_METHODS_SEP);
                }
                None => peak_methods.push(m),
            }
        }
    }
    let shared_text: Vec<String> = shared.iter().map(|(k, v)| format!("{k}={v}")).collect();
    GroupView {
        anchor: format!(
            "g-{:016x}",
            format::stable_hash(
                format!(
                    "{}\0single cases{}",
                    loaded.file_name(),
                    // The first table's anchor as before; another's names what it shares.
                    if first {
                        String::new()
                    } else {
                        shared_text.join(",")
                    }
                )
                .as_bytes()
            )
        ),
        title: {
            let mut t = if shared_text.is_empty() {
                "Cases measured at one size".to_string()
            } else {
                format!("Cases measured at one size ({})", shared_text.join(", "))
            };
            // In a run that stopped early or lacks shards, a case may be here only because its
            // other sizes were never reached.
            if !loaded.cut_off_cases.is_empty() || !loaded.missing_shards.is_empty() {
                t.push_str(": the run is incomplete, so some may lack sizes it never reached");
            }
            t
        },
        x_name: "case".to_string(),
        implementations: impls,
        rows,
        figure: None,
        throughput_figures: Vec::new(),
        other_axis_figures: Vec::new(),
        memory_figure: None,
        error_figure: None,
        ratio_figure: None,
        details,
        peak_methods,
    }
}

/// The bar chart of a table of cases measured at one size ([`merge_single_cases`]): for each
/// case (row of `view`) the fastest alternative that ran within its tolerance, its time ÷ the
/// default's, with the range from both interquartile ranges, or a cross where the default's
/// error is above its tolerance; no bar where either timing is launch-bound (as the overview's
/// chart). `None` without a default or any such case.
fn single_cases_chart(
    loaded: &Loaded,
    grouped: &[Group<'_>],
    view: &GroupView,
) -> Option<GlanceChart> {
    let default = view
        .implementations
        .iter()
        .find(|h| h.is_default)?
        .name
        .clone();
    // A merged row keeps its group's anchor: find each row's group by it.
    let by_anchor: BTreeMap<String, &Group<'_>> = grouped
        .iter()
        .map(|g| (format!("g-{}", group_id(loaded, g)), g))
        .collect();
    let mut bars = Vec::new();
    for r in &view.rows {
        let Some(g) = r.anchor.as_ref().and_then(|a| by_anchor.get(a)) else {
            continue;
        };
        let Some((_, by_impl)) = g.by_x.values().next() else {
            continue;
        };
        let Some(d) = by_impl
            .get(default.as_str())
            .filter(|d| d.status == Status::Ok && d.median_ms.is_some_and(|m| m > 0.0))
        else {
            continue;
        };
        // A launch-bound default measures the host, not the kernel: no ratio from it.
        if super::groups::launch_bound(d, &loaded.doc) {
            continue;
        }
        let inaccurate = |r: &Row| r.accuracy.as_ref().is_some_and(|a| a.rel_err > a.tolerance);
        // The fastest accurate alternative whose timing is not launch-bound, as the overview's
        // chart picks it.
        let Some((name, a)) = view
            .implementations
            .iter()
            .filter(|h| !h.is_default)
            .filter_map(|h| Some((h.name.as_str(), *by_impl.get(h.name.as_str())?)))
            .filter(|(_, a)| a.status == Status::Ok && super::groups::is_accurate(a))
            .filter(|(_, a)| !super::groups::launch_bound(a, &loaded.doc))
            .filter(|(_, a)| a.median_ms.is_some_and(|m| m > 0.0))
            .min_by(|x, y| {
                x.1.median_ms
                    .unwrap_or(f64::INFINITY)
                    .total_cmp(&y.1.median_ms.unwrap_or(f64::INFINITY))
                    .then_with(|| x.0.cmp(y.0))
            })
        else {
            continue;
        };
        let (Some(am), Some(dm)) = (a.median_ms, d.median_ms) else {
            continue;
        };
        let ratio = am / dm;
        let outcome = if inaccurate(d) {
            BarOutcome::DefaultInaccurate
        } else {
            let range = match (a.q1_ms, a.q3_ms, d.q1_ms, d.q3_ms) {
                (Some(a1), Some(a3), Some(d1), Some(d3)) if d1 > 0.0 && d3 > 0.0 => {
                    Some((a1 / d3, a3 / d1))
                }
                _ => None,
            };
            BarOutcome::Ratio { ratio, range }
        };
        bars.push(GlanceBar {
            label: format!("{}: vs {name}", r.x),
            outcome,
        });
    }
    if bars.is_empty() {
        return None;
    }
    let doc = &loaded.doc;
    let file = format!("figures/{}-{}-cases.svg", doc.suite.as_str(), view.anchor);
    let desc = format!(
        "Horizontal bars on a log scale, one per case, against the fastest accurate \
         alternative that ran beside {default}: {}. A bar right of 1 means {default} is \
         faster; a whisker spans the ratio's \
         range from the two implementations' quartiles; a cross marks a case where {default}'s \
         error is above its tolerance.",
        bars.iter()
            .map(|b| b.label.clone())
            .collect::<Vec<_>>()
            .join("; ")
    );
    let crosses = bars_have_crosses(&bars);
    Some(GlanceChart {
        file,
        title: format!(
            "{} on {}: fastest accurate alternative time ÷ {default}'s time, {}",
            doc.suite.title(),
            doc.device.name,
            lowercase_first(&view.title)
        ),
        desc,
        bars,
        words: RatioWords {
            axis: format!("fastest accurate alternative time ÷ {default}'s time (log scale)"),
            left: "← alternative faster".to_string(),
            right: format!("{default} faster →"),
            above: format!("{default} faster (ratio above 1)"),
            below: "alternative faster (ratio below 1)".to_string(),
            crosses,
        },
    })
}

/// Whether any bar is a cross (the legend then explains it).
fn bars_have_crosses(bars: &[GlanceBar]) -> bool {
    bars.iter()
        .any(|b| matches!(b.outcome, BarOutcome::DefaultInaccurate))
}

/// Why a cell of a case that a run cut off by a time limit (no `finished_at`) was measuring
/// has no row.
pub const CUT_OFF: &str = "the run was cut off (its document has no finished_at) before this row";

/// Why a cell has no row when the part of the run that measured its case has rows of the
/// implementation in other cases only (a library that runs only some of the suite's operations
/// or shapes; its documents record no row for this case).
pub const ELSEWHERE_ONLY: &str =
    "the part of the run that measured this case ran this implementation on other cases only";

/// Why a cell has no row when the part of the run that measured its case has no row of the
/// implementation in any case (parts of one run may compare different alternatives; a part cut
/// off before its first row of an implementation reads the same, and its command shows whether
/// it compared it).
pub fn left_out(part: &crate::load::CasePart) -> String {
    format!(
        "the part of the run that measured this case measured no case with this \
         implementation (its command: `{}`)",
        part.command
    )
}

/// Where the run stood for a case, from any of its rows: whether the run was cut off in it
/// ([`crate::load::Loaded::cut_off_cases`]) and the part of the run that measured it
/// ([`crate::load::Loaded::case_parts`]); `(false, None)` without a row.
fn case_context<'a>(
    loaded: &'a Loaded,
    row: Option<&Row>,
) -> (bool, Option<&'a crate::load::CasePart>) {
    let Some(k) = row.map(|r| crate::load::case_key(&r.case)) else {
        return (false, None);
    };
    (
        loaded.cut_off_cases.contains(&k),
        loaded.case_parts.get(&k).map(|p| &**p),
    )
}

/// Column order of a results table: the default(s) first, then by name.
fn sort_columns(impls: &mut [ImplHeader]) {
    impls.sort_by(|a, b| {
        b.is_default
            .cmp(&a.is_default)
            .then_with(|| a.name.cmp(&b.name))
    });
}

/// The table cell of `implementation`'s `row` (missing: `None`); `cut_off` when the case
/// belongs to a run that never finished ([`crate::load::Loaded::cut_off_cases`]); `part`, the
/// part of the run that measured the case ([`crate::load::Loaded::case_parts`]).
fn cell(
    implementation: &str,
    row: Option<&Row>,
    doc: &Document,
    cut_off: bool,
    part: Option<&crate::load::CasePart>,
) -> Cell {
    let decls = &doc.config.throughput;
    let mut c = Cell {
        kind: "missing",
        implementation: implementation.to_string(),
        median: None,
        throughput: Vec::new(),
        above_tolerance: false,
        timing: None,
        eager: None,
        flags: Vec::new(),
        status: "not measured".to_string(),
        message: None,
    };
    let Some(row) = row else {
        match part {
            Some(p) if !p.implementations.contains(implementation) => {
                c.message = Some(left_out(p));
            }
            _ if cut_off => c.message = Some(CUT_OFF.to_string()),
            Some(_) => c.message = Some(ELSEWHERE_ONLY.to_string()),
            None => {}
        }
        return c;
    };
    c.status = row.status.as_str().to_string();
    c.message = row.message.clone();
    if row.status != Status::Ok {
        c.kind = "failed";
        return c;
    }
    c.kind = "ok";
    c.median = row.median_ms.map(format::ms);
    c.throughput = decls
        .iter()
        .filter_map(|d| {
            let v = throughput(row, d)?;
            Some(ThroughputCell {
                value: format::sig(v, 3),
                unit: d.unit.clone(),
                of_peak: d
                    .ceiling
                    .as_ref()
                    .map(|c| format!("{} %", format::sig(100.0 * v / c.value, 2))),
            })
        })
        .collect();
    c.above_tolerance = super::groups::above_tolerance(row);
    if row.timing == Some(TimingMethod::GraphReplay) {
        c.timing = Some("graph replay".to_string());
        c.eager = row.eager_median_ms.map(|e| {
            format!(
                "eager {} ms{}",
                format::ms(e),
                if super::groups::eager_launch_bound(row, doc) {
                    ", launch-bound"
                } else {
                    ""
                }
            )
        });
    }
    if super::groups::launch_bound(row, doc) {
        c.flags
            .push("launch-bound: the host issuing calls, not the kernel".to_string());
    }
    c.flags.extend(super::groups::machine_flags(row));
    c
}

/// The details of an ok row.
fn detail_row(x: String, row: &Row, doc: &Document) -> DetailRow {
    let f = |v: Option<f64>| v.map(format::mb).unwrap_or_else(|| "—".to_string());
    let dash = || "—".to_string();
    let m = row.memory.clone().unwrap_or_default();
    let mut notes: Vec<String> = row.notes.clone();
    if super::groups::launch_bound(row, doc) {
        notes.push("launch-bound".to_string());
    }
    notes.extend(super::groups::machine_flags(row));
    let machine = row.machine.as_ref().map_or_else(dash, |mach| {
        let part = |v: Option<f64>, unit: &str| v.map(|v| format!("{} {unit}", format::sig(v, 3)));
        let clock = match (mach.sm_clock_mhz, mach.max_sm_clock_mhz) {
            (Some(c), Some(mx)) => {
                Some(format!("{}/{} MHz", format::sig(c, 4), format::sig(mx, 4)))
            }
            (Some(c), None) => Some(format!("{} MHz", format::sig(c, 4))),
            _ => None,
        };
        let parts: Vec<String> = [
            clock,
            part(mach.temperature_c, "°C"),
            part(mach.power_w, "W"),
        ]
        .into_iter()
        .flatten()
        .collect();
        if parts.is_empty() {
            dash()
        } else {
            parts.join(", ")
        }
    });
    let runs = match (
        row.runs_ms.iter().copied().reduce(f64::min),
        row.runs_ms.iter().copied().reduce(f64::max),
    ) {
        (Some(lo), Some(hi)) if row.runs_ms.len() > 1 => format::iqr(lo, hi),
        _ => dash(),
    };
    DetailRow {
        first_call_s: row
            .first_call_s
            .map(|t| format::sig(t, 2))
            .unwrap_or_else(dash),
        timing: match row.timing {
            Some(TimingMethod::GraphReplay) => "graph replay".to_string(),
            Some(TimingMethod::WallClock) => "wall clock".to_string(),
            Some(TimingMethod::Events) | None => "events".to_string(),
        },
        host_ms: row.host_ms.map(format::ms).unwrap_or_else(dash),
        eager_ms: row.eager_median_ms.map(format::ms).unwrap_or_else(dash),
        runs,
        machine,
        notes: notes.join("; "),
        reserved_peak_mb: f(m.reserved_peak_mb),
        workspace_mb: f(m.workspace_mb),
        x,
        implementation: row.implementation.clone(),
        iqr: match (row.q1_ms, row.q3_ms) {
            (Some(q1), Some(q3)) => format::iqr(q1, q3),
            _ => "—".to_string(),
        },
        rel_err: row
            .accuracy
            .as_ref()
            .map(|a| format::rel_err(a.rel_err))
            .unwrap_or_else(|| "—".to_string()),
        tolerance: row
            .accuracy
            .as_ref()
            .map(|a| format::rel_err(a.tolerance))
            .unwrap_or_else(|| "—".to_string()),
        above_tolerance: super::groups::above_tolerance(row),
        compile_s: row
            .compile_s
            .map(|t| format::sig(t, 2))
            .unwrap_or_else(|| "—".to_string()),
        arguments_mb: f(m.arguments_mb),
        outputs_mb: f(m.outputs_mb),
        temporaries_mb: f(m.temporaries_mb),
        residuals_mb: f(m.residuals_mb),
        peak_mb: f(m.peak_mb),
        peak_method: m.peak_method.unwrap_or_else(|| "—".to_string()),
    }
}

/// The marker of a series: a shape per implementation name, so lines stay apart without
/// colour.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Marker {
    /// A filled circle.
    Circle,
    /// A filled square.
    Square,
    /// A filled triangle.
    Triangle,
    /// A filled diamond.
    Diamond,
}

impl Marker {
    /// The marker of implementation `name` (a stable hash of the name).
    pub fn of(name: &str) -> Marker {
        [
            Marker::Circle,
            Marker::Square,
            Marker::Triangle,
            Marker::Diamond,
        ][(format::stable_hash(name.as_bytes()) % 4) as usize]
    }
}

/// The line pattern of a series.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dash {
    /// A solid line (the default implementation's).
    Solid,
    /// Long dashes.
    Dashed,
    /// Short dots.
    Dotted,
}

impl Dash {
    /// The pattern of implementation `name` other than the default (a stable hash).
    pub fn of(name: &str) -> Dash {
        [Dash::Solid, Dash::Dashed, Dash::Dotted]
            [((format::stable_hash(name.as_bytes()) >> 8) % 3) as usize]
    }

    /// (dash length, gap) in px; a solid line is one long dash.
    pub fn pattern(self) -> (u32, u32) {
        match self {
            Dash::Solid => (1000, 0),
            Dash::Dashed => (8, 4),
            Dash::Dotted => (2, 3),
        }
    }
}

/// What a line figure plots against its axis.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Metric<'a> {
    /// `median_ms` of ok rows.
    Time,
    /// A declared throughput of ok rows.
    Throughput(&'a Throughput),
    /// `memory.peak_mb` of ok rows.
    PeakMemory,
    /// `accuracy.rel_err` of ok rows, with each tolerance as a dashed line.
    RelErr,
    /// Each non-default implementation's median over the default's at the same x, where both
    /// ran, with a line at 1.
    RatioToDefault,
}

impl Metric<'_> {
    /// The value drawn for an ok row, when it has one that the axis can show (> 0).
    fn value(self, row: &Row) -> Option<f64> {
        let v = match self {
            Metric::Time => row.median_ms?,
            Metric::Throughput(d) => throughput(row, d)?,
            Metric::PeakMemory => row.memory.as_ref()?.peak_mb?,
            Metric::RelErr => row.accuracy.as_ref()?.rel_err,
            // Needs the default's row: computed by the caller.
            Metric::RatioToDefault => return None,
        };
        (v.is_finite() && v > 0.0).then_some(v)
    }

    fn format(self, v: f64) -> String {
        match self {
            Metric::Time => format!("{} ms", format::ms(v)),
            Metric::Throughput(d) => format!("{} {}", format::sig(v, 3), d.unit),
            Metric::PeakMemory => format!("{} MB", format::mb(v)),
            Metric::RelErr => format::rel_err(v),
            Metric::RatioToDefault => format::ratio(v),
        }
    }

    /// Suffix of the figure file after the group id.
    fn file_suffix(self) -> String {
        match self {
            Metric::Time => String::new(),
            Metric::Throughput(d) => format!("-{}", slug(&d.key)),
            Metric::PeakMemory => "-memory".to_string(),
            Metric::RelErr => "-error".to_string(),
            Metric::RatioToDefault => "-ratio".to_string(),
        }
    }

    /// What the title says is plotted.
    fn what(self) -> String {
        match self {
            Metric::Time => "median time".to_string(),
            Metric::Throughput(d) => d.unit.clone(),
            Metric::PeakMemory => "peak memory".to_string(),
            Metric::RelErr => "relative error".to_string(),
            Metric::RatioToDefault => "time ÷ the default's time".to_string(),
        }
    }

    fn y_label(self) -> String {
        match self {
            Metric::Time => "median time (ms)".to_string(),
            Metric::Throughput(d) => d.unit.clone(),
            Metric::PeakMemory => "peak memory (MB)".to_string(),
            Metric::RelErr => "relative error".to_string(),
            Metric::RatioToDefault => "time ÷ default's time (above 1: default faster)".to_string(),
        }
    }

    /// Throughput reads best on a linear axis from zero, where a 10 % gap looks like one.
    fn log_y(self) -> bool {
        !matches!(self, Metric::Throughput(_))
    }
}

/// `key` reduced to letters, digits, `-` and `_`, for file names.
fn slug(key: &str) -> String {
    key.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// The figure of `metric` for group `g`, or `None` when no row has a value to draw.
fn figure_spec(
    doc: &Document,
    g: &Group<'_>,
    id: &str,
    impls: &[ImplHeader],
    metric: Metric<'_>,
) -> Option<FigureSpec> {
    let axis = g.axis.as_str();
    let mut series = Vec::new();
    let mut any_point = false;
    let mut tolerances: Vec<f64> = Vec::new();
    let default = impls.iter().find(|h| h.is_default).map(|h| h.name.as_str());
    if metric == Metric::RatioToDefault && default.is_none() {
        return None;
    }
    for h in impls {
        if metric == Metric::RatioToDefault && Some(h.name.as_str()) == default {
            continue;
        }
        let mut s = Series {
            name: if h.is_default {
                format!("{} (default)", h.name)
            } else {
                h.name.clone()
            },
            colour: h.colour.clone(),
            marker: Marker::of(&h.name),
            dash: if h.is_default {
                Dash::Solid
            } else {
                Dash::of(&h.name)
            },
            emphasis: h.is_default,
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
            let v = match metric {
                Metric::RatioToDefault => default
                    .and_then(|d| by_impl.get(d))
                    .filter(|d| d.status == Status::Ok)
                    .and_then(|d| Some(row.median_ms? / d.median_ms?))
                    .filter(|v| v.is_finite() && *v > 0.0),
                _ => metric.value(row),
            };
            if let Some(v) = v {
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
    let mut reference_lines: Vec<(f64, String)> = tolerances
        .iter()
        .map(|t| (*t, format!("tolerance {}", format::rel_err(*t))))
        .collect();
    match metric {
        Metric::RatioToDefault => reference_lines.push((
            1.0,
            format!(
                "1: as fast as the default ({})",
                default.unwrap_or_default()
            ),
        )),
        Metric::Throughput(d) => {
            if let Some(c) = &d.ceiling {
                reference_lines.push((
                    c.value,
                    format!(
                        "device peak {} {} ({})",
                        format::sig(c.value, 3),
                        d.unit,
                        c.source
                    ),
                ));
            }
        }
        _ => {}
    }
    // Names every fixed parameter, as Triton's perf_report names its plots.
    let title = format!(
        "{} on {}: {} against {axis}; {}",
        doc.suite.title(),
        doc.device.name,
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
            "{} plot of {} on {}. {desc}.",
            if metric.log_y() { "Log-log" } else { "Log-x" },
            metric.y_label(),
            doc.device.name
        ),
        x_label: axis.to_string(),
        y_label: metric.y_label(),
        series,
        reference_lines,
        log_y: metric.log_y(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fixture with `math` the default at head_dim 128 (as the dispatch picks it for fp32
    /// in the real grid) and `flash` the default at 64.
    fn two_defaults() -> Loaded {
        let mut doc: Document = serde_json::from_str(include_str!(
            "../../../tests/fixtures/valid/gpu_attention.json"
        ))
        .expect("fixture");
        for r in &mut doc.rows {
            let d128 = r.case.get("head_dim") == Some(&crate::schema::Param::Int(128));
            match r.implementation.as_str() {
                "flash" => r.default = !d128,
                "math" => r.default = d128,
                _ => {}
            }
        }
        Loaded::new("gpu_attention.json".into(), doc)
    }

    #[test]
    fn a_run_names_the_alternatives_it_did_not_compare() {
        let full = two_defaults();
        let mut fewer = two_defaults();
        fewer.doc.device.name = "Another card".into();
        fewer.doc.rows.retain(|r| r.implementation != "torch_math");
        let mut cpu = two_defaults();
        cpu.doc.device.kind = crate::schema::DeviceKind::Cpu;
        cpu.doc.rows.retain(|r| r.implementation == "flash");
        let (mut figures, mut charts) = (Vec::new(), Vec::new());
        let section = suite_section(
            &[full, fewer, cpu],
            Suite::Attention,
            "",
            &BTreeMap::new(),
            &mut figures,
            &mut charts,
        );
        let not_run: Vec<&[String]> = section
            .documents
            .iter()
            .map(|d| d.not_run.as_slice())
            .collect();
        // The CPU run is held against CPU runs only.
        assert_eq!(not_run, [&[][..], &["torch_math".to_string()][..], &[][..]]);
    }

    #[test]
    fn a_group_marks_its_own_default_only() {
        let l = two_defaults();
        let (mut figures, mut charts) = (Vec::new(), Vec::new());
        let section = doc_section(&l, "", &BTreeMap::new(), &mut figures, &mut charts);
        let defaults = |g: &GroupView| -> Vec<String> {
            g.implementations
                .iter()
                .filter(|h| h.is_default)
                .map(|h| h.name.clone())
                .collect()
        };
        let (mut at64, mut at128) = (0, 0);
        for g in &section.groups {
            if g.title.contains("head_dim=128") {
                assert_eq!(defaults(g), ["math"], "{}", g.title);
                at128 += 1;
            } else {
                assert_eq!(defaults(g), ["flash"], "{}", g.title);
                at64 += 1;
            }
            // The default's column comes first.
            assert!(g.implementations[0].is_default, "{}", g.title);
        }
        assert!(at64 > 0 && at128 > 0, "both head dims have groups");
    }
}
