//! The tile sweep section of a suite page: one kernel in each configuration tried while tuning
//! it ([`RunKind::TileSweep`] documents), per shape a bar chart and a table ranked by
//! throughput, the configuration the dispatch picks marked, and a sentence from the data
//! saying whether it is the fastest.

use serde::Serialize;

use super::super::format;
use super::groups::{device_label, doc_id, group_id, group_rows, throughput};
use super::FigureRef;
use crate::load::{case_label, Loaded};
use crate::schema::{Document, Param, Row, RunKind, Status, Suite, TILE_CONFIG_PARAM};

/// The tile sweeps of one suite on its page, one per device.
#[derive(Debug, Serialize)]
pub struct TileSweepSection {
    /// Anchor of its heading.
    pub anchor: String,
    /// Data file(s).
    pub file: String,
    /// Device name (and compute capability).
    pub device: String,
    /// The sweep's commit, short.
    pub commit: String,
    /// When the suite's grid on the same device ran at another commit: that commit, short.
    pub grid_commit: Option<String>,
    /// When that grid also has rows of the sweep's implementation with `_sm80` appended (the
    /// portable kernel, run beside a device-specific default): that name, for the page to say
    /// that the sweep's configurations are the portable kernel's.
    pub portable_name: Option<String>,
    /// The unit of `value` (the document's first declared throughput, else `ms`).
    pub unit: String,
    /// One entry per shape.
    pub groups: Vec<TileGroup>,
    /// The tuning notes of the sweep's suite (e.g. `kernels/TUNING.md`), when it has a notes
    /// file; set by the page's builder.
    pub notes_path: Option<String>,
    /// The page those notes became, when the site has it; set by the page's builder.
    pub notes_href: Option<String>,
}

/// The configurations of one shape.
#[derive(Debug, Serialize)]
pub struct TileGroup {
    /// Anchor.
    pub anchor: String,
    /// The shape: every case parameter but the configuration.
    pub title: String,
    /// The bar chart.
    pub figure: FigureRef,
    /// What the data says about the default, one sentence.
    pub verdict: String,
    /// The notes the runner gave the shape's rows, each once, in row order (for example that
    /// on this device the dispatch runs another kernel than the swept one).
    pub notes: Vec<String>,
    /// Rows, fastest first; rows that did not run last.
    pub rows: Vec<TileRow>,
}

/// One configuration of a shape.
#[derive(Debug, Serialize, Clone)]
pub struct TileRow {
    /// The configuration's name (the case parameter `config`).
    pub config: String,
    /// True for the configuration the dispatch picks.
    pub is_default: bool,
    /// `ok`, or the status of a row that did not run.
    pub status: String,
    /// The failure message, for a row that did not run.
    pub message: Option<String>,
    /// Median time per call, ms.
    pub median: String,
    /// Interquartile range, ms.
    pub iqr: String,
    /// Throughput in the section's unit.
    pub value: String,
    /// This row's time over the default's (`1.04×`), when both ran.
    pub vs_default: String,
    /// Relative error against the reference.
    pub rel_err: String,
    /// Compile time, s.
    pub compile_s: String,
    /// Peak device memory, MB.
    pub peak_mb: String,
}

/// One bar chart to draw.
#[derive(Debug, Clone)]
pub struct TileChart {
    /// Site-relative path.
    pub file: String,
    /// SVG `<title>`.
    pub title: String,
    /// SVG `<desc>`.
    pub desc: String,
    /// The value axis' label.
    pub x_label: String,
    /// One bar per configuration, in table order.
    pub bars: Vec<TileBar>,
}

/// One bar: a configuration's throughput (or time) with its interquartile range.
#[derive(Debug, Clone)]
pub struct TileBar {
    /// The configuration.
    pub label: String,
    /// Its value, `None` for a row that did not run (its status then labels the slot).
    pub value: Option<f64>,
    /// The value's range from the interquartile range of the time.
    pub range: Option<(f64, f64)>,
    /// True for the configuration the dispatch picks.
    pub is_default: bool,
    /// Status of a row that did not run.
    pub status: Option<String>,
}

/// A row's value in the section's measure: the first declared throughput, else the median
/// time; with the range from the quartiles of the time.
fn measure(row: &Row, doc: &Document) -> Option<(f64, Option<(f64, f64)>)> {
    if row.status != Status::Ok {
        return None;
    }
    match doc.config.throughput.first() {
        Some(decl) => {
            let v = throughput(row, decl)?;
            let m = row.median_ms?;
            let range = match (row.q1_ms, row.q3_ms) {
                (Some(q1), Some(q3)) if q1 > 0.0 && q3 > 0.0 => Some((v * m / q3, v * m / q1)),
                _ => None,
            };
            Some((v, range))
        }
        None => Some((row.median_ms?, row.q1_ms.zip(row.q3_ms))),
    }
}

/// The tile sweeps of `suite` in `docs` (shards already merged), their charts pushed onto
/// `charts`. `grids` are the grid documents, to say when a sweep ran at another commit.
pub fn tile_sweeps(
    docs: &[Loaded],
    grids: &[Loaded],
    suite: Suite,
    base: &str,
    charts: &mut Vec<TileChart>,
) -> Vec<TileSweepSection> {
    docs.iter()
        .filter(|l| {
            l.doc.suite == suite
                && l.doc.config.kind == RunKind::TileSweep
                && !l.doc.rows.is_empty()
        })
        .map(|l| sweep_section(l, grids, base, charts))
        .collect()
}

/// The text of a cell without a value.
fn dash() -> String {
    "—".to_string()
}

/// The notes of `rows`, each once, in the order they first appear.
fn distinct_notes(rows: &[&Row]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for n in rows.iter().flat_map(|r| r.notes.iter()) {
        if !out.contains(n) {
            out.push(n.clone());
        }
    }
    out
}

fn sweep_section(
    loaded: &Loaded,
    grids: &[Loaded],
    base: &str,
    charts: &mut Vec<TileChart>,
) -> TileSweepSection {
    let doc = &loaded.doc;
    let higher_is_better = !doc.config.throughput.is_empty();
    let unit = doc
        .config
        .throughput
        .first()
        .map_or_else(|| "ms".to_string(), |d| d.unit.clone());
    let grid_commit = grids
        .iter()
        .find(|g| {
            g.doc.suite == doc.suite
                && g.doc.device.name == doc.device.name
                && g.doc.config.kind == RunKind::Grid
        })
        .map(|g| g.doc.config.git_commit.as_str())
        .filter(|c| *c != doc.config.git_commit)
        .map(format::short_commit);
    let portable_name = doc.rows.first().and_then(|r| {
        let name = format!("{}_sm80", r.implementation);
        grids
            .iter()
            .filter(|g| {
                g.doc.suite == doc.suite
                    && g.doc.device.name == doc.device.name
                    && g.doc.config.kind == RunKind::Grid
            })
            .any(|g| g.doc.rows.iter().any(|x| x.implementation == name))
            .then_some(name)
    });
    let mut groups = Vec::new();
    for g in group_rows(doc, TILE_CONFIG_PARAM) {
        // The group's id along its own axis, `config`: distinct from every grid group's.
        let id = group_id(loaded, &g);
        // One row per configuration (a sweep measures one implementation).
        let mut rows: Vec<&Row> = g
            .by_x
            .values()
            .flat_map(|(_, by_impl)| by_impl.values().copied())
            .collect();
        let key = |r: &Row| measure(r, doc).map(|(v, _)| v);
        rows.sort_by(|a, b| match (key(a), key(b)) {
            (Some(x), Some(y)) if higher_is_better => y.total_cmp(&x),
            (Some(x), Some(y)) => x.total_cmp(&y),
            (Some(_), None) => std::cmp::Ordering::Less,
            (None, Some(_)) => std::cmp::Ordering::Greater,
            (None, None) => std::cmp::Ordering::Equal,
        });
        let config_of = |r: &Row| match r.case.get(TILE_CONFIG_PARAM) {
            Some(Param::Text(t)) => t.clone(),
            Some(p) => p.to_string(),
            None => "—".to_string(),
        };
        let default = rows
            .iter()
            .find(|r| r.default && r.status == Status::Ok)
            .copied();
        let title = case_label(&g.params);
        let views: Vec<TileRow> = rows
            .iter()
            .map(|r| {
                let ok = r.status == Status::Ok;
                TileRow {
                    config: config_of(r),
                    is_default: r.default,
                    status: r.status.as_str().to_string(),
                    message: r.message.clone().filter(|_| !ok),
                    median: r
                        .median_ms
                        .filter(|_| ok)
                        .map(format::ms)
                        .unwrap_or_else(dash),
                    iqr: r
                        .q1_ms
                        .zip(r.q3_ms)
                        .filter(|_| ok)
                        .map(|(a, b)| format::iqr(a, b))
                        .unwrap_or_else(dash),
                    value: measure(r, doc)
                        .map(|(v, _)| format::sig(v, 4))
                        .unwrap_or_else(dash),
                    vs_default: default
                        .and_then(|d| Some(r.median_ms? / d.median_ms?))
                        .filter(|_| ok)
                        .map(|x| format!("{}×", format::sig(x, 3)))
                        .unwrap_or_else(dash),
                    rel_err: r
                        .accuracy
                        .as_ref()
                        .filter(|_| ok)
                        .map(|a| format::rel_err(a.rel_err))
                        .unwrap_or_else(dash),
                    compile_s: r
                        .compile_s
                        .filter(|_| ok)
                        .map(|s| format::sig(s, 2))
                        .unwrap_or_else(dash),
                    peak_mb: r
                        .memory
                        .as_ref()
                        .and_then(|m| m.peak_mb)
                        .filter(|_| ok)
                        .map(format::mb)
                        .unwrap_or_else(dash),
                }
            })
            .collect();
        // The measure of the table: throughput, else the median time.
        let shown = |r: &Row| match measure(r, doc) {
            Some((v, _)) if higher_is_better => format!("{} {unit}", format::sig(v, 4)),
            _ => format!("{} ms", format::ms(r.median_ms.unwrap_or(f64::NAN))),
        };
        let verdict = verdict(&rows, default, shown, config_of);
        let file = format!("figures/tiles-{id}.svg");
        let x_label = if higher_is_better {
            format!("{unit} (higher is faster); whiskers: from the time's interquartile range")
        } else {
            "median time per call, ms (lower is faster); whiskers: interquartile range".to_string()
        };
        let chart_title = format!("{} — {title}", device_label(doc));
        let desc = format!(
            "{} configurations of one shape ({title}), {unit} each: {}",
            rows.len(),
            views
                .iter()
                .map(|v| if v.status == "ok" {
                    format!(
                        "{}{} {}",
                        v.config,
                        if v.is_default { " (default)" } else { "" },
                        v.value
                    )
                } else {
                    format!("{} {}", v.config, v.status)
                })
                .collect::<Vec<_>>()
                .join(", ")
        );
        let chart = TileChart {
            file: file.clone(),
            title: chart_title,
            desc: desc.clone(),
            x_label,
            bars: rows
                .iter()
                .map(|r| {
                    let m = measure(r, doc);
                    TileBar {
                        label: config_of(r),
                        value: m.map(|(v, _)| v),
                        range: m.and_then(|(_, range)| range),
                        is_default: r.default,
                        status: (r.status != Status::Ok).then(|| r.status.as_str().to_string()),
                    }
                })
                .collect(),
        };
        let figure = FigureRef::tile(base, &chart);
        charts.push(chart);
        groups.push(TileGroup {
            anchor: format!("t-{id}"),
            title,
            figure,
            verdict,
            notes: distinct_notes(&rows),
            rows: views,
        });
    }
    TileSweepSection {
        anchor: format!("tiles-{}", doc_id(loaded)),
        file: loaded.file_name(),
        device: device_label(doc),
        commit: format::short_commit(&doc.config.git_commit),
        grid_commit,
        portable_name,
        unit,
        groups,
        notes_path: None,
        notes_href: None,
    }
}

/// True when the two rows' interquartile ranges of time overlap (neither is faster beyond
/// both spreads); false when a quartile is missing.
fn within_spread(a: &Row, b: &Row) -> bool {
    match (a.q1_ms, a.q3_ms, b.q1_ms, b.q3_ms) {
        (Some(a1), Some(a3), Some(b1), Some(b3)) => a1 <= b3 && b1 <= a3,
        _ => false,
    }
}

/// One sentence on the default of a shape, from the rows (`rows` ranked, fastest first):
/// whether it is the fastest that ran, by how much, and whether the lead is beyond both
/// interquartile ranges.
fn verdict(
    rows: &[&Row],
    default: Option<&Row>,
    shown: impl Fn(&Row) -> String,
    config_of: impl Fn(&Row) -> String,
) -> String {
    let ran = rows.iter().filter(|r| r.status == Status::Ok).count();
    let Some(d) = default else {
        return match rows.iter().find(|r| r.default) {
            Some(r) => format!(
                "The default configuration, {}, did not run here (see its row).",
                config_of(r)
            ),
            None => "No configuration of this shape is marked as the default.".to_string(),
        };
    };
    let times = |a: &Row, b: &Row| {
        format::sig(
            a.median_ms.unwrap_or(f64::NAN) / b.median_ms.unwrap_or(f64::NAN),
            3,
        )
    };
    let Some(best) = rows.first().copied() else {
        return String::new();
    };
    if std::ptr::eq(best, d) {
        let second = rows
            .iter()
            .copied()
            .find(|r| !std::ptr::eq(*r, d) && r.status == Status::Ok);
        match second {
            Some(r) if within_spread(d, r) => format!(
                "The default, {}, and {} are the fastest of the {ran} configurations that \
                 ran, within each other's interquartile range: {} and {}.",
                config_of(d),
                config_of(r),
                shown(d),
                shown(r)
            ),
            Some(r) => format!(
                "The default, {}, is the fastest of the {ran} configurations that ran: {} \
                 against {} for the next, {}, which takes {} times as long.",
                config_of(d),
                shown(d),
                shown(r),
                config_of(r),
                times(r, d)
            ),
            None => format!(
                "The default, {}, is the only configuration that ran.",
                config_of(d)
            ),
        }
    } else if within_spread(d, best) {
        format!(
            "The default, {}, is within the interquartile range of the fastest of the {ran} \
             configurations that ran, {}: {} against {}.",
            config_of(d),
            config_of(best),
            shown(d),
            shown(best)
        )
    } else {
        format!(
            "The default, {}, is not the fastest here: {} reaches {} against the default's {} \
             (the default takes {} times its time, beyond both interquartile ranges).",
            config_of(d),
            config_of(best),
            shown(best),
            shown(d),
            times(d, best)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    /// A row of configuration `name` with median `ms` and quartiles ±`spread` ms.
    fn row(name: &str, ms: Option<f64>, spread: f64, default: bool) -> Row {
        let case = BTreeMap::from([(TILE_CONFIG_PARAM.to_string(), Param::Text(name.into()))]);
        let status = if ms.is_some() {
            Status::Ok
        } else {
            Status::Unsupported
        };
        let mut r = Row::failed(case, "flash", "kernelpages", default, status, "");
        r.message = None;
        r.median_ms = ms;
        r.q1_ms = ms.map(|m| m - spread);
        r.q3_ms = ms.map(|m| m + spread);
        r
    }

    fn say(rows: &[Row]) -> String {
        let refs: Vec<&Row> = rows.iter().collect();
        let default = refs
            .iter()
            .copied()
            .find(|r| r.default && r.status == Status::Ok);
        let config = |r: &Row| match r.case.get(TILE_CONFIG_PARAM) {
            Some(Param::Text(t)) => t.clone(),
            _ => unreachable!(),
        };
        verdict(
            &refs,
            default,
            |r| format!("{} ms", r.median_ms.unwrap()),
            config,
        )
    }

    #[test]
    fn a_shapes_notes_are_listed_once_in_row_order() {
        let mut a = row("a", Some(1.0), 0.0, true);
        let mut b = row("b", Some(2.0), 0.0, false);
        a.notes = vec!["portable".into(), "dQ".into()];
        b.notes = vec!["dQ".into(), "other".into()];
        assert_eq!(distinct_notes(&[&a, &b]), ["portable", "dQ", "other"]);
        assert!(distinct_notes(&[&row("c", None, 0.0, false)]).is_empty());
    }

    #[test]
    fn the_verdict_says_what_the_ranked_rows_show() {
        // Rows come ranked, fastest first.
        let lead = say(&[
            row("a", Some(1.0), 0.01, true),
            row("b", Some(1.2), 0.01, false),
        ]);
        assert!(
            lead.contains("a, is the fastest of the 2") && lead.contains("1.20 times as long"),
            "{lead}"
        );
        let tie = say(&[
            row("a", Some(1.0), 0.05, true),
            row("b", Some(1.02), 0.05, false),
        ]);
        assert!(
            tie.contains("within each other's interquartile range"),
            "{tie}"
        );
        let near = say(&[
            row("b", Some(1.0), 0.05, false),
            row("a", Some(1.02), 0.05, true),
        ]);
        assert!(
            near.contains("a, is within the interquartile range of the fastest"),
            "{near}"
        );
        let behind = say(&[
            row("b", Some(0.8), 0.01, false),
            row("a", Some(1.0), 0.01, true),
        ]);
        assert!(
            behind.contains("not the fastest") && behind.contains("1.25 times its time"),
            "{behind}"
        );
        let alone = say(&[row("a", Some(1.0), 0.01, true), row("b", None, 0.0, false)]);
        assert!(alone.contains("only configuration that ran"), "{alone}");
        let failed = say(&[row("b", Some(1.0), 0.01, false), row("a", None, 0.0, true)]);
        assert!(
            failed.contains("default configuration, a, did not run"),
            "{failed}"
        );
        let none = say(&[row("b", Some(1.0), 0.01, false)]);
        assert!(none.contains("No configuration"), "{none}");
    }
}
