//! The Hopper page: what ran on devices of compute capability 9.x, summarised by suite: each
//! implementation's best row, the dispatch rules specific to the device, and each
//! device-specific implementation against its portable kernel on the same card. The page
//! exists only when such a document is present, and its title names the device found.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use super::super::format;
use super::groups::{device_label, throughput};
use super::overview::{BarOutcome, GlanceBar, GlanceChart, RatioWords};
use super::{reproduce_commands, CommandView, FigureRef, Layout};
use crate::load::Loaded;
use crate::schema::{DispatchRule, Document, Row, Status, Suite};

/// The Hopper page.
#[derive(Debug, Serialize)]
pub struct HopperPage {
    /// Layout.
    pub layout: Layout,
    /// Summary by suite.
    pub suites: Vec<HopperSuite>,
    /// Every device with documents in the data folder, Hopper or not, one line each.
    pub devices: Vec<DeviceLine>,
    /// The gain charts the page shows (drawn by the renderer).
    #[serde(skip)]
    pub charts: Vec<GlanceChart>,
    /// The commands that reproduce the Hopper documents, then the page itself.
    pub reproduce: Vec<CommandView>,
}

/// One device of the comparison table: what its documents record about it.
#[derive(Debug, Serialize, PartialEq)]
pub struct DeviceLine {
    /// Device name.
    pub name: String,
    /// `GPU` or `CPU`.
    pub kind: String,
    /// Compute capability (GPU), or `—`.
    pub compute_capability: String,
    /// Streaming multiprocessors (GPU) or hardware threads (CPU), or `—`.
    pub units: String,
    /// Device memory in GB (GPU), or `—`.
    pub memory_gb: String,
    /// L2 cache in MB (GPU), or `—`.
    pub l2_mb: String,
    /// The architecture NVRTC compiled the project's kernels for, or `—`.
    pub arch: String,
    /// Suites measured on it (titles).
    pub suites: String,
    /// `ok rows / rows` over its documents.
    pub rows_ok: String,
}

/// The device comparison table: one line per device name over all of `docs`, in the order
/// of first appearance (GPUs first); the first document of a device gives its details.
pub fn device_lines(docs: &[Loaded]) -> Vec<DeviceLine> {
    let mut names: Vec<&str> = Vec::new();
    for l in docs {
        if !names.contains(&l.doc.device.name.as_str()) {
            names.push(&l.doc.device.name);
        }
    }
    let dash = || "—".to_string();
    let mut lines: Vec<(bool, DeviceLine)> = names
        .into_iter()
        .map(|name| {
            let of: Vec<&Loaded> = docs.iter().filter(|l| l.doc.device.name == name).collect();
            let d = &of[0].doc.device;
            let gpu = d.kind == crate::schema::DeviceKind::Gpu;
            let suites: BTreeSet<&str> = of.iter().map(|l| l.doc.suite.title()).collect();
            let rows: usize = of.iter().map(|l| l.doc.rows.len()).sum();
            let ok: usize = of
                .iter()
                .map(|l| l.doc.rows.iter().filter(|r| r.status == Status::Ok).count())
                .sum();
            let units = if gpu {
                d.sm_count.map(|n| format!("{n} SMs"))
            } else {
                d.cpu_threads.map(|n| format!("{n} threads"))
            };
            (
                gpu,
                DeviceLine {
                    name: name.to_string(),
                    kind: if gpu { "GPU" } else { "CPU" }.to_string(),
                    compute_capability: d.compute_capability.clone().unwrap_or_else(dash),
                    units: units.unwrap_or_else(dash),
                    memory_gb: d
                        .memory_mb
                        .map(|m| format::sig(m / 1000.0, 3))
                        .unwrap_or_else(dash),
                    l2_mb: d.l2_mb.map(|m| format::sig(m, 3)).unwrap_or_else(dash),
                    arch: d.nvrtc_arch.clone().unwrap_or_else(dash),
                    suites: suites.into_iter().collect::<Vec<_>>().join(", "),
                    rows_ok: format!("{ok} / {rows}"),
                },
            )
        })
        .collect();
    lines.sort_by_key(|(gpu, _)| !*gpu);
    lines.into_iter().map(|(_, l)| l).collect()
}

/// Best throughput per implementation in one suite on one Hopper device.
#[derive(Debug, Serialize)]
pub struct HopperSuite {
    /// Suite title.
    pub title: String,
    /// Anchor (the suite's snake_case name).
    pub anchor: String,
    /// The device of this section's documents, with its compute capability (a suite
    /// measured on several Hopper cards has a section per card).
    pub devices: String,
    /// The commits its documents were measured at (short hashes, comma-separated).
    pub commits: String,
    /// Unit of the throughput ranked by (the first the documents declare), or empty when they
    /// declare none (the fastest median then ranks).
    pub unit: String,
    /// One line per implementation.
    pub implementations: Vec<HopperImpl>,
    /// The documents' dispatch rules for compute capability 9 ([`is_hopper_rule`]): the
    /// kernels specific to this device and when they run.
    pub rules: Vec<HopperRule>,
    /// Each device-specific implementation against its portable counterpart measured in the
    /// same document ([`portable_counterpart`]).
    pub gains: Vec<PortableGain>,
}

/// The name suffix of an implementation that measures the portable kernel of another: rows of
/// `flash_sm80` are `flash`'s portable (compute capability 8.0) kernel on the cases where
/// `flash` runs a device-specific one.
pub const PORTABLE_SUFFIX: &str = "_sm80";

/// One dispatch rule specific to compute capability 9.
#[derive(Debug, Serialize, PartialEq)]
pub struct HopperRule {
    /// Public entry points.
    pub entry_point: String,
    /// Device class as the document words it.
    pub device: String,
    /// Dtypes.
    pub dtype: String,
    /// When it applies, in words.
    pub rule: String,
    /// Implementation it picks.
    pub implementation: String,
}

/// A device-specific implementation against its portable counterpart on the same card.
#[derive(Debug, Serialize)]
pub struct PortableGain {
    /// The implementation (what the dispatch runs).
    pub implementation: String,
    /// Its portable counterpart ([`portable_counterpart`]).
    pub portable: String,
    /// Unit of the two value columns (the suite's throughput, or `ms` for medians).
    pub unit: String,
    /// `1.51–1.98× over 24 cases` (device-specific over portable), or why there is none.
    pub summary: String,
    /// One line per case where both ran.
    pub cases: Vec<GainCase>,
    /// The bar chart of the gains, when there are cases.
    pub figure: Option<FigureRef>,
    /// Cases without a comparison, with the rows' status, reason and count: where the
    /// portable counterpart did not run (`unsupported`: the device-specific path does not
    /// apply there; or a failure), and where the device-specific implementation failed.
    pub not_measured: Vec<String>,
}

/// One case of a [`PortableGain`].
#[derive(Debug, Serialize)]
pub struct GainCase {
    /// Case label.
    pub case: String,
    /// The device-specific implementation's value.
    pub specific: String,
    /// The portable kernel's value.
    pub portable: String,
    /// How many times faster the device-specific implementation is (`1.97×`).
    pub gain: String,
}

/// One implementation's best row on Hopper.
#[derive(Debug, Serialize)]
pub struct HopperImpl {
    /// Implementation.
    pub name: String,
    /// Library.
    pub library: String,
    /// True when the dispatch picks it for some of the section's cases (any row the default).
    pub is_default: bool,
    /// `default` when every row of it is the default's, `default in N of M rows` when some
    /// are, else `None`.
    pub default_label: Option<String>,
    /// Best throughput in the suite's unit (or the best median, ms, when none is declared),
    /// or `—`: among the rows where it is the default when it is the default anywhere and one
    /// of those has a score (what the device's dispatch reaches, not a case where another
    /// implementation runs by default), among all its rows otherwise.
    pub best: String,
    /// Case of the best row.
    pub best_case: String,
    /// `ok rows / rows`.
    pub rows_ok: String,
}

/// Per implementation: its best row with its score, rows ok, rows in all, any row (for the
/// library), how many of its rows are the default's, and its best row among those.
type Tally<'a> = (
    Option<(f64, &'a Row)>,
    usize,
    usize,
    &'a Row,
    usize,
    Option<(f64, &'a Row)>,
);

/// True for a document measured on compute capability 9.x.
pub fn is_hopper(doc: &Document) -> bool {
    doc.device
        .compute_capability
        .as_deref()
        .is_some_and(|cc| cc.starts_with("9."))
}

/// True for a dispatch rule that names compute capability 9 (`compute capability 9.0`,
/// `sm_90a`): a kernel specific to Hopper.
pub fn is_hopper_rule(r: &DispatchRule) -> bool {
    r.device.contains("capability 9") || r.device.contains("sm_90")
}

/// The implementation whose rows measure `base`'s portable kernel on the same cases, if any:
/// `base` + [`PORTABLE_SUFFIX`] when such rows exist (`flash_sm80`), or else, when `base` has a
/// rule of its own for compute capability 9, an implementation with rows that `base`'s rule for
/// other devices names (MoE's `grouped_matmul` runs "the portable kernel (grouped_gemm.cu), as
/// grouped_mma_sync" off compute capability 9.0).
pub fn portable_counterpart(
    base: &str,
    names: &BTreeSet<&str>,
    rules: &[&DispatchRule],
) -> Option<String> {
    if base.ends_with(PORTABLE_SUFFIX) {
        return None;
    }
    let suffixed = format!("{base}{PORTABLE_SUFFIX}");
    if names.contains(suffixed.as_str()) {
        return Some(suffixed);
    }
    // Only an implementation with a rule of its own for compute capability 9 is
    // device-specific.
    if !rules
        .iter()
        .any(|r| r.implementation == base && is_hopper_rule(r))
    {
        return None;
    }
    rules
        .iter()
        .filter(|r| r.implementation == base && !is_hopper_rule(r))
        .flat_map(|r| {
            r.rule
                .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        })
        .find(|w| *w != base && names.contains(w))
        .map(str::to_string)
}

/// The device-specific implementations of `docs` (one suite's Hopper documents) against their
/// portable counterparts, case by case: `score` ranks rows (higher is better) and `unit` names
/// it; `ms` marks a median, where the gain is portable ÷ specific.
fn portable_gains(
    docs: &[&&Loaded],
    score: &dyn Fn(&Row) -> Option<f64>,
    unit: &str,
) -> Vec<(PortableGain, Vec<GlanceBar>)> {
    let names: BTreeSet<&str> = docs
        .iter()
        .flat_map(|l| l.doc.rows.iter().map(|r| r.implementation.as_str()))
        .collect();
    let rules: Vec<&DispatchRule> = docs
        .iter()
        .flat_map(|l| l.doc.config.dispatch.iter())
        .collect();
    let mut out = Vec::new();
    for &base in &names {
        let Some(portable) = portable_counterpart(base, &names, &rules) else {
            continue;
        };
        let portable = portable.as_str();
        let mut gains = Vec::new();
        // Per case: its parameters as sort keys (numbers numerically), its table line and its
        // bar; the table and the chart list the cases in that order, not in the documents'
        // (shard) order.
        type Key = Vec<(String, super::groups::ParamKey)>;
        let mut entries: Vec<(Key, GainCase, GlanceBar)> = Vec::new();
        let mut reasons: BTreeMap<String, usize> = BTreeMap::new();
        for l in docs {
            let by_case: BTreeMap<String, &Row> = l
                .doc
                .rows
                .iter()
                .filter(|r| r.implementation == base)
                .map(|r| (crate::load::case_key(&r.case), r))
                .collect();
            let said = |r: &Row| {
                format!(
                    "{} {}: {}",
                    r.implementation,
                    r.status.as_str(),
                    r.message.as_deref().unwrap_or("no message")
                )
            };
            for p in l.doc.rows.iter().filter(|r| r.implementation == *portable) {
                if p.status != Status::Ok {
                    *reasons.entry(said(p)).or_default() += 1;
                    continue;
                }
                let Some(b) = by_case.get(&crate::load::case_key(&p.case)) else {
                    continue;
                };
                if b.status != Status::Ok {
                    *reasons.entry(said(b)).or_default() += 1;
                    continue;
                }
                let (Some(vb), Some(vp)) = (score(b), score(p)) else {
                    continue;
                };
                if vb == 0.0 || vp == 0.0 {
                    continue;
                }
                // Scores are throughputs (higher is better) or negated medians.
                let gain = vb / vp;
                let gain = if vb < 0.0 { 1.0 / gain } else { gain };
                gains.push(gain);
                // The range from both quartiles, in time: portable q1 ÷ specific q3 to portable
                // q3 ÷ specific q1 (the gain is the time ratio for either score).
                let range = match (p.q1_ms, p.q3_ms, b.q1_ms, b.q3_ms) {
                    (Some(p1), Some(p3), Some(b1), Some(b3)) if b1 > 0.0 && b3 > 0.0 => {
                        Some((p1 / b3, p3 / b1))
                    }
                    _ => None,
                };
                entries.push((
                    p.case
                        .iter()
                        .map(|(k, v)| (k.clone(), super::groups::param_key(v)))
                        .collect(),
                    GainCase {
                        case: crate::load::case_label(&p.case),
                        specific: format::sig(vb.abs(), 3),
                        portable: format::sig(vp.abs(), 3),
                        gain: format!("{}×", format::sig(gain, 3)),
                    },
                    GlanceBar {
                        label: crate::load::case_label(&p.case),
                        outcome: BarOutcome::Ratio { ratio: gain, range },
                    },
                ));
            }
        }
        entries.sort_by(|a, b| a.0.cmp(&b.0));
        let (cases, bars): (Vec<GainCase>, Vec<GlanceBar>) =
            entries.into_iter().map(|(_, c, b)| (c, b)).unzip();
        let summary = match (
            gains.iter().copied().reduce(f64::min),
            gains.iter().copied().reduce(f64::max),
        ) {
            (Some(lo), Some(hi)) => format!(
                "{base} is {}–{}× as fast as its portable kernel over {} cases, each pair measured in the same run",
                format::sig(lo, 3),
                format::sig(hi, 3),
                gains.len()
            ),
            _ => format!("no case where both {base} and {portable} ran"),
        };
        out.push((
            PortableGain {
                implementation: base.to_string(),
                portable: portable.to_string(),
                unit: unit.to_string(),
                summary,
                cases,
                figure: None,
                not_measured: reasons
                    .into_iter()
                    .map(|(why, n)| format!("{n} case{}: {why}", if n == 1 { "" } else { "s" }))
                    .collect(),
            },
            bars,
        ));
    }
    out
}

/// A device name without its vendor prefix (`H200` for `NVIDIA H200`).
fn short_name(name: &str) -> &str {
    name.strip_prefix("NVIDIA ").unwrap_or(name)
}

/// The page's title, naming the Hopper devices present (`Hopper (H200)`); `None` when no
/// document comes from one, and then there is no page.
pub fn title(docs: &[Loaded]) -> Option<String> {
    let names: BTreeSet<&str> = docs
        .iter()
        .filter(|l| is_hopper(&l.doc))
        .map(|l| short_name(&l.doc.device.name))
        .collect();
    (!names.is_empty()).then(|| {
        format!(
            "Hopper ({})",
            names.into_iter().collect::<Vec<_>>().join(", ")
        )
    })
}

/// The Hopper page's table of contents: a section per suite, then how to reproduce.
pub fn toc(page: &HopperPage) -> Vec<super::TocEntry> {
    page.suites
        .iter()
        .map(|s| super::TocEntry {
            href: format!("#{}", s.anchor),
            label: s.title.clone(),
            depth: 1,
        })
        .chain([
            super::TocEntry {
                href: "#devices".to_string(),
                label: "Devices compared".to_string(),
                depth: 1,
            },
            super::TocEntry {
                href: "#how-to-reproduce".to_string(),
                label: "How to reproduce".to_string(),
                depth: 1,
            },
        ])
        .collect()
}

/// The Hopper page of `docs` (shards merged), its reproduce commands from `parts` (the
/// documents as loaded, one command each).
pub fn hopper_page(docs: &[Loaded], parts: &[Loaded], layout: Layout) -> HopperPage {
    let hopper: Vec<&Loaded> = docs.iter().filter(|l| is_hopper(&l.doc)).collect();
    let mut suites = Vec::new();
    let mut charts = Vec::new();
    for suite in Suite::ALL {
        let of_suite: Vec<&&Loaded> = hopper.iter().filter(|l| l.doc.suite == suite).collect();
        // One section per device: a best row, a dispatch rule or a gain is a fact about one
        // card (and one run), never a pooled one.
        let names: BTreeSet<&str> = of_suite
            .iter()
            .map(|l| l.doc.device.name.as_str())
            .collect();
        let several = names.len() > 1;
        for name in names {
            let in_suite: Vec<&&Loaded> = of_suite
                .iter()
                .copied()
                .filter(|l| l.doc.device.name == name)
                .collect();
            let first = in_suite[0];
            let decl = first.doc.config.throughput.first();
            // With several Hopper cards in one suite, anchors and figure names carry the card's.
            let tag = if several {
                format!("{}-{}", suite.as_str(), crate::site::markdown::slug(name))
            } else {
                suite.as_str().to_string()
            };
            // Higher is better for a throughput; for a bare median, lower is.
            let score = |r: &Row| -> Option<f64> {
                match decl {
                    Some(d) => throughput(r, d),
                    None => r.median_ms.map(|m| -m),
                }
            };
            let mut by_impl: BTreeMap<&str, Tally<'_>> = BTreeMap::new();
            for l in &in_suite {
                for r in &l.doc.rows {
                    let e = by_impl
                        .entry(r.implementation.as_str())
                        .or_insert((None, 0, 0, r, 0, None));
                    e.2 += 1;
                    e.4 += usize::from(r.default);
                    if r.status == Status::Ok {
                        e.1 += 1;
                        if let Some(v) = score(r) {
                            if e.0.is_none_or(|(b, _)| v > b) {
                                e.0 = Some((v, r));
                            }
                            if r.default && e.5.is_none_or(|(b, _)| v > b) {
                                e.5 = Some((v, r));
                            }
                        }
                    }
                }
            }
            let mut implementations: Vec<HopperImpl> = by_impl
                .into_iter()
                .map(
                    |(name, (best_any, ok, total, any, default, best_default))| {
                        // A default none of whose default rows has a score keeps its best row.
                        let best = if default > 0 && best_default.is_some() {
                            best_default
                        } else {
                            best_any
                        };
                        HopperImpl {
                            name: name.to_string(),
                            library: any.library.clone(),
                            is_default: default > 0,
                            default_label: match default {
                                0 => None,
                                d if d == total => Some("default".to_string()),
                                d => Some(format!("default in {d} of {total} rows")),
                            },
                            best: best
                                .map(|(v, _)| format::sig(v.abs(), 3))
                                .unwrap_or_else(|| "—".to_string()),
                            best_case: best
                                .map(|(_, b)| crate::load::case_label(&b.case))
                                .unwrap_or_else(|| "—".to_string()),
                            rows_ok: format!("{ok} / {total}"),
                        }
                    },
                )
                .collect();
            implementations.sort_by(|a, b| {
                b.is_default
                    .cmp(&a.is_default)
                    .then_with(|| a.name.cmp(&b.name))
            });
            let mut rules: Vec<HopperRule> = Vec::new();
            for r in in_suite
                .iter()
                .flat_map(|l| l.doc.config.dispatch.iter())
                .filter(|r| is_hopper_rule(r))
            {
                let rule = HopperRule {
                    entry_point: r.entry_point.clone(),
                    device: r.device.clone(),
                    dtype: r.dtype.clone(),
                    rule: r.rule.clone(),
                    implementation: r.implementation.clone(),
                };
                if !rules.contains(&rule) {
                    rules.push(rule);
                }
            }
            let unit = decl.map(|d| d.unit.clone()).unwrap_or_default();
            let mut gains = Vec::new();
            for (mut g, bars) in portable_gains(
                &in_suite,
                &score,
                if unit.is_empty() { "ms" } else { &unit },
            ) {
                if !bars.is_empty() {
                    let file = format!("figures/hopper-{tag}-{}.svg", g.implementation);
                    let title = format!(
                        "{} time ÷ {} time, {}, {}",
                        g.portable,
                        g.implementation,
                        suite.title(),
                        short_name(name)
                    );
                    let desc = format!(
                    "Horizontal bars on a log scale, one per case where both ran: {}. A bar right \
                     of 1 means {} (the device-specific kernel) is faster; a whisker spans the \
                     ratio's range from the two implementations' quartiles.",
                    bars.iter()
                        .map(|b| b.label.clone())
                        .collect::<Vec<_>>()
                        .join("; "),
                    g.implementation
                );
                    let chart = GlanceChart {
                        file,
                        title,
                        desc,
                        bars,
                        words: RatioWords {
                            axis: format!(
                                "{} time ÷ {} time (log scale)",
                                g.portable, g.implementation
                            ),
                            left: format!("← {} faster", g.portable),
                            right: format!("{} faster →", g.implementation),
                            above: format!("{} faster (ratio above 1)", g.implementation),
                            below: format!("{} faster (ratio below 1)", g.portable),
                            crosses: false,
                        },
                    };
                    g.figure = Some(FigureRef::glance(&layout.base, &chart));
                    charts.push(chart);
                }
                gains.push(g);
            }
            suites.push(HopperSuite {
                title: if several {
                    format!("{} on the {}", suite.title(), short_name(name))
                } else {
                    suite.title().to_string()
                },
                anchor: tag,
                devices: device_label(&first.doc),
                commits: in_suite
                    .iter()
                    .map(|l| format::short_commit(&l.doc.config.git_commit))
                    .collect::<BTreeSet<_>>()
                    .into_iter()
                    .collect::<Vec<_>>()
                    .join(", "),
                unit,
                implementations,
                rules,
                gains,
            });
        }
    }
    HopperPage {
        layout,
        suites,
        devices: device_lines(docs),
        charts,
        // From the documents as measured (each shard and part its own `--output`), not the
        // merged run: one command per document, one loop per part's shards.
        reproduce: reproduce_commands(parts.iter().filter(|l| is_hopper(&l.doc))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The synthetic fixture (a compute capability 9.0 document) with `flash_sm80` rows: each of
    /// flash's ok rows again at twice the median, and one case not measured, with its reason.
    fn with_portable_rows() -> Loaded {
        let mut doc: Document = serde_json::from_str(include_str!(
            "../../../tests/fixtures/valid/gpu_attention.json"
        ))
        .expect("fixture");
        let mut extra: Vec<Row> = doc
            .rows
            .iter()
            .filter(|r| r.implementation == "flash" && r.status == Status::Ok)
            .map(|r| {
                let mut p = r.clone();
                p.implementation = "flash_sm80".into();
                p.default = false;
                p.median_ms = r.median_ms.map(|m| 2.0 * m);
                p
            })
            .collect();
        let mut skipped = extra.pop().expect("a flash row");
        skipped.status = Status::Unsupported;
        skipped.median_ms = None;
        skipped.message = Some("flash runs this same portable kernel here".into());
        extra.push(skipped);
        doc.rows.extend(extra);
        doc.config.dispatch.push(DispatchRule {
            entry_point: "attention::dot_product_attention".into(),
            device: "CUDA, compute capability 9.0 (sm_90a)".into(),
            dtype: "bf16".into(),
            rule: "the forward at head_dim 64 or 128".into(),
            implementation: "flash".into(),
        });
        Loaded {
            path: "gpu_attention.json".into(),
            rel_path: "gpu_attention.json".into(),
            doc,
            cut_off_cases: BTreeSet::new(),
            missing_shards: Vec::new(),
            case_parts: Default::default(),
        }
    }

    #[test]
    fn the_device_specific_implementation_is_set_against_its_portable_kernel() {
        let l = with_portable_rows();
        let docs = [&l];
        let in_suite: Vec<&&Loaded> = docs.iter().collect();
        let ok_flash = l
            .doc
            .rows
            .iter()
            .filter(|r| r.implementation == "flash" && r.status == Status::Ok)
            .count();
        let gains = portable_gains(&in_suite, &|r: &Row| r.median_ms.map(|m| -m), "ms");
        assert_eq!(gains.len(), 1);
        let (g, bars) = &gains[0];
        assert_eq!(bars.len(), g.cases.len());
        assert!(bars.iter().all(
            |b| matches!(b.outcome, BarOutcome::Ratio { ratio, .. } if (ratio - 2.0).abs() < 1e-9)
        ));
        assert_eq!(
            (g.implementation.as_str(), g.portable.as_str()),
            ("flash", "flash_sm80")
        );
        assert_eq!(g.cases.len(), ok_flash - 1);
        assert!(g.cases.iter().all(|c| c.gain == "2.00×"), "{:?}", g.cases);
        assert!(
            g.summary.contains(&format!(
                "2.00–2.00× as fast as its portable kernel over {}",
                ok_flash - 1
            )),
            "{}",
            g.summary
        );
        assert_eq!(
            g.not_measured,
            vec![
                "1 case: flash_sm80 unsupported: flash runs this same portable kernel here"
                    .to_string()
            ]
        );
        // A device-specific failure is listed, not dropped.
        let mut failing = with_portable_rows();
        let first = failing
            .doc
            .rows
            .iter_mut()
            .find(|r| r.implementation == "flash" && r.status == Status::Ok)
            .expect("a flash row");
        first.status = Status::Error;
        first.message = Some("boom".into());
        let docs = [&failing];
        let in_suite: Vec<&&Loaded> = docs.iter().collect();
        let g = &portable_gains(&in_suite, &|r: &Row| r.median_ms.map(|m| -m), "ms")[0].0;
        assert_eq!(g.cases.len(), ok_flash - 2);
        assert!(
            g.not_measured
                .contains(&"1 case: flash error: boom".to_string()),
            "{:?}",
            g.not_measured
        );
        // The rules: the fixture's own are not specific to compute capability 9; the added
        // one is.
        let specific: Vec<&DispatchRule> = l
            .doc
            .config
            .dispatch
            .iter()
            .filter(|r| is_hopper_rule(r))
            .collect();
        assert_eq!(specific.len(), 1);
        assert_eq!(specific[0].implementation, "flash");
        // Without the portable rows there is nothing to set against.
        let plain: Loaded = Loaded {
            doc: serde_json::from_str(include_str!(
                "../../../tests/fixtures/valid/gpu_attention.json"
            ))
            .expect("fixture"),
            ..with_portable_rows()
        };
        let docs = [&plain];
        let in_suite: Vec<&&Loaded> = docs.iter().collect();
        assert!(portable_gains(&in_suite, &|r: &Row| r.median_ms.map(|m| -m), "ms").is_empty());
    }

    /// The counterpart is the `_sm80` rows where they exist, else the implementation that
    /// `base`'s rule for other devices names; never `base` itself, nor a name without rows, nor
    /// one named only by a Hopper rule.
    #[test]
    fn the_portable_counterpart_comes_from_the_suffix_or_the_dispatch_rule() {
        let rule = |imp: &str, device: &str, words: &str| DispatchRule {
            entry_point: "moe::grouped_matmul".into(),
            device: device.into(),
            dtype: "bf16".into(),
            rule: words.into(),
            implementation: imp.into(),
        };
        let hopper = rule(
            "grouped_matmul",
            "CUDA, compute capability 9.0 (sm_90a)",
            "the wgmma kernel, unlike grouped_mma_sync",
        );
        let other = rule(
            "grouped_matmul",
            "CUDA, compute capability 8.0 or newer (other than 9.0)",
            "always: the portable kernel (grouped_gemm.cu), as grouped_mma_sync",
        );
        let names: BTreeSet<&str> = ["grouped_matmul", "grouped_mma_sync", "cublas_loop"].into();
        assert_eq!(
            portable_counterpart("grouped_matmul", &names, &[&hopper, &other]).as_deref(),
            Some("grouped_mma_sync")
        );
        assert_eq!(
            portable_counterpart("grouped_matmul", &names, &[&hopper]),
            None
        );
        // Without a Hopper rule of its own, an implementation is not device-specific.
        assert_eq!(
            portable_counterpart("grouped_matmul", &names, &[&other]),
            None
        );
        let fewer: BTreeSet<&str> = ["grouped_matmul", "cublas_loop"].into();
        assert_eq!(
            portable_counterpart("grouped_matmul", &fewer, &[&hopper, &other]),
            None
        );
        let with_suffix: BTreeSet<&str> = ["flash", "flash_sm80", "grouped_mma_sync"].into();
        let flash_other = rule(
            "flash",
            "CUDA, compute capability 8.0",
            "as grouped_mma_sync",
        );
        assert_eq!(
            portable_counterpart("flash", &with_suffix, &[&flash_other]).as_deref(),
            Some("flash_sm80")
        );
        assert_eq!(portable_counterpart("flash_sm80", &with_suffix, &[]), None);
    }

    #[test]
    fn each_hopper_card_gets_its_own_section_anchor_and_figure() {
        let mut h200 = with_portable_rows();
        h200.doc.device.name = "NVIDIA H200".into();
        let mut h100 = with_portable_rows();
        h100.doc.device.name = "NVIDIA H100 80GB HBM3".into();
        // Rows in reverse (shard-like) order: the page sorts the cases.
        h100.doc.rows.reverse();
        // The H100's flash twice as fast as the H200's: a pooled table would show its best.
        for r in h100
            .doc
            .rows
            .iter_mut()
            .filter(|r| r.implementation == "flash")
        {
            r.median_ms = r.median_ms.map(|m| m / 2.0);
        }
        let layout = super::super::Layout {
            title: String::new(),
            file: "hopper.html".into(),
            base: String::new(),
            nav: Vec::new(),
            nav_unmeasured: Vec::new(),
            has_data: true,
            toc: Vec::new(),
            hand_written: false,
            defaults_href: String::new(),
        };
        let docs = [h100.clone(), h200.clone()];
        let page = hopper_page(&docs, &docs, layout.clone());
        let anchors: Vec<&str> = page.suites.iter().map(|s| s.anchor.as_str()).collect();
        assert_eq!(
            anchors,
            ["attention-nvidia-h100-80gb-hbm3", "attention-nvidia-h200"]
        );
        assert_eq!(page.suites[0].title, "Attention on the H100 80GB HBM3");
        assert!(page.suites[1].devices.starts_with("NVIDIA H200 "));
        let best = |i: usize| {
            page.suites[i]
                .implementations
                .iter()
                .find(|x| x.name == "flash")
                .map(|x| x.best.clone())
                .expect("flash")
        };
        assert_ne!(best(0), best(1), "each card's own best row");
        // An implementation that is the default somewhere shows its best row among those: a
        // faster row where it is not the default (a masks grid's hand-written causal mask
        // beside flex, say) is not what the dispatch reaches.
        let mut mixed = h100.clone();
        let flash_rows: Vec<usize> = mixed
            .doc
            .rows
            .iter()
            .enumerate()
            .filter(|(_, r)| r.implementation == "flash" && r.status == Status::Ok)
            .map(|(i, _)| i)
            .collect();
        assert!(flash_rows.len() >= 2);
        for &i in &flash_rows {
            mixed.doc.rows[i].default = true;
        }
        let fast = flash_rows[0];
        mixed.doc.rows[fast].default = false;
        mixed.doc.rows[fast].median_ms = mixed.doc.rows[fast].median_ms.map(|m| m / 100.0);
        let mixed_page = hopper_page(
            std::slice::from_ref(&mixed),
            std::slice::from_ref(&mixed),
            layout.clone(),
        );
        let flash = mixed_page.suites[0]
            .implementations
            .iter()
            .find(|x| x.name == "flash")
            .expect("flash");
        assert!(
            flash
                .default_label
                .as_deref()
                .unwrap()
                .starts_with("default in"),
            "{:?}",
            flash.default_label
        );
        let fast_case = crate::load::case_label(&mixed.doc.rows[fast].case);
        assert_ne!(
            flash.best_case, fast_case,
            "the row where flash is not the default"
        );
        // The H100's flash is 4x its portable kernel, the H200's 2x: never pooled.
        assert!(page.suites[0].gains[0]
            .cases
            .iter()
            .all(|c| c.gain == "4.00×"));
        assert!(page.suites[1].gains[0]
            .cases
            .iter()
            .all(|c| c.gain == "2.00×"));
        // Cases in order of their parameters, seq_len numerically (not the documents' order).
        let lens: Vec<i64> = page.suites[0].gains[0]
            .cases
            .iter()
            .filter(|c| c.case.contains("head_dim=64") && c.case.contains("causal=false"))
            .map(|c| {
                let at = c.case.find("seq_len=").expect("seq_len") + "seq_len=".len();
                c.case[at..]
                    .split(',')
                    .next()
                    .and_then(|v| v.trim().parse().ok())
                    .expect("a length")
            })
            .collect();
        assert!(
            lens.len() > 1 && lens.windows(2).all(|w| w[0] < w[1]),
            "{lens:?}"
        );
        let files: BTreeSet<&str> = page.charts.iter().map(|c| c.file.as_str()).collect();
        assert_eq!(files.len(), 2, "{files:?}");
        // One card alone keeps the suite's plain anchor and figure name.
        let page = hopper_page(&docs[1..], &docs[1..], layout);
        assert_eq!(page.suites[0].anchor, "attention");
        assert_eq!(page.suites[0].title, "Attention");
        assert_eq!(page.charts[0].file, "figures/hopper-attention-flash.svg");
    }

    #[test]
    fn the_device_table_has_one_line_per_device_gpus_first() {
        let gpu = with_portable_rows();
        let mut cpu_doc = gpu.doc.clone();
        cpu_doc.device.kind = crate::schema::DeviceKind::Cpu;
        cpu_doc.device.name = "Some CPU".into();
        cpu_doc.device.compute_capability = None;
        cpu_doc.device.cpu_threads = Some(8);
        cpu_doc.rows.truncate(3);
        let cpu = Loaded {
            doc: cpu_doc,
            ..with_portable_rows()
        };
        let lines = device_lines(&[cpu, gpu.clone()]);
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0].kind, "GPU");
        assert_eq!(lines[0].name, gpu.doc.device.name);
        assert_eq!(lines[0].compute_capability, "9.0");
        let ok = gpu
            .doc
            .rows
            .iter()
            .filter(|r| r.status == Status::Ok)
            .count();
        assert_eq!(lines[0].rows_ok, format!("{ok} / {}", gpu.doc.rows.len()));
        assert_eq!(
            (lines[1].kind.as_str(), lines[1].units.as_str()),
            ("CPU", "8 threads")
        );
        assert!(lines[1].rows_ok.ends_with("/ 3"));
    }
}
