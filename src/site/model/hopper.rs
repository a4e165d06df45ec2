//! The Hopper page: what ran on devices of compute capability 9.x, summarised by suite. The
//! page exists only when such a document is present, and its title names the device found.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use super::super::format;
use super::groups::{device_label, throughput};
use super::{reproduce_commands, CommandView, Layout};
use crate::load::Loaded;
use crate::schema::{Document, Row, Status, Suite};

/// The Hopper page.
#[derive(Debug, Serialize)]
pub struct HopperPage {
    /// Layout.
    pub layout: Layout,
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
    /// Unit of the throughput ranked by (the first the documents declare), or empty when they
    /// declare none (the fastest median then ranks).
    pub unit: String,
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
    /// Best throughput in the suite's unit (or the best median, ms, when none is declared),
    /// or `—`.
    pub best: String,
    /// Case of the best row.
    pub best_case: String,
    /// `ok rows / rows`.
    pub rows_ok: String,
}

/// Per implementation: its best row with its score, rows ok, rows in all, and any row (for
/// the library and default flag).
type Tally<'a> = (Option<(f64, &'a Row)>, usize, usize, &'a Row);

/// True for a document measured on compute capability 9.x.
pub fn is_hopper(doc: &Document) -> bool {
    doc.device
        .compute_capability
        .as_deref()
        .is_some_and(|cc| cc.starts_with("9."))
}

/// The page's title, naming the Hopper devices present (`Hopper (H200)`); `None` when no
/// document comes from one, and then there is no page.
pub fn title(docs: &[Loaded]) -> Option<String> {
    let names: BTreeSet<&str> = docs
        .iter()
        .filter(|l| is_hopper(&l.doc))
        .map(|l| {
            let n = l.doc.device.name.as_str();
            n.strip_prefix("NVIDIA ").unwrap_or(n)
        })
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
        .chain(std::iter::once(super::TocEntry {
            href: "#how-to-reproduce".to_string(),
            label: "How to reproduce".to_string(),
            depth: 1,
        }))
        .collect()
}

/// The Hopper page of `docs`.
pub fn hopper_page(docs: &[Loaded], layout: Layout) -> HopperPage {
    let hopper: Vec<&Loaded> = docs.iter().filter(|l| is_hopper(&l.doc)).collect();
    let mut suites = Vec::new();
    for suite in Suite::ALL {
        let in_suite: Vec<&&Loaded> = hopper.iter().filter(|l| l.doc.suite == suite).collect();
        let Some(first) = in_suite.first() else {
            continue;
        };
        let decl = first.doc.config.throughput.first();
        let devices: BTreeSet<String> = in_suite.iter().map(|l| device_label(&l.doc)).collect();
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
                    .or_insert((None, 0, 0, r));
                e.2 += 1;
                if r.status == Status::Ok {
                    e.1 += 1;
                    if let Some(v) = score(r) {
                        if e.0.is_none_or(|(b, _)| v > b) {
                            e.0 = Some((v, r));
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
                best: best
                    .map(|(v, _)| format::sig(v.abs(), 3))
                    .unwrap_or_else(|| "—".to_string()),
                best_case: best
                    .map(|(_, b)| crate::load::case_label(&b.case))
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
            unit: decl.map(|d| d.unit.clone()).unwrap_or_default(),
            implementations,
        });
    }
    HopperPage {
        layout,
        suites,
        reproduce: reproduce_commands(hopper.iter().copied()),
    }
}
