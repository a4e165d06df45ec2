//! The one grouping of rows every page uses: a document's rows split by every case parameter
//! but one axis ([`group_rows`]), with the facts about a row that several pages need (its
//! throughputs, whether it is accurate, its device's label, its group's anchor).

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use super::super::format;
use super::SUITE_PAGES;
use crate::load::Loaded;
use crate::schema::{Document, Param, Row, Status, Suite, Throughput, TimingMethod};

/// The axis a document's tables and main figures are drawn against: the first of
/// `config.axes` (the loader refuses a document that declares none).
pub fn primary_axis(doc: &Document) -> &str {
    doc.config.axes.first().map(String::as_str).unwrap_or("")
}

/// True when the row's reported time is bound by the host issuing the calls rather than the
/// device running them (host time per call ≥ `launch_bound_ratio` × device time per call, for
/// a row timed by back-to-back calls), so it cannot support a "faster" claim. A row reported
/// from CUDA-graph replay is not: the replay issues no calls from the host; its eager figure
/// may be ([`eager_launch_bound`]). Rows that record no host time are not launch-bound.
pub fn launch_bound(row: &Row, doc: &Document) -> bool {
    row.timing != Some(TimingMethod::GraphReplay)
        && row.launch_bound(doc.config.timing.launch_bound_ratio)
}

/// True for a row reported from CUDA-graph replay whose eager back-to-back calls were
/// launch-bound: what a caller issuing eager calls gets is the host's time.
pub fn eager_launch_bound(row: &Row, doc: &Document) -> bool {
    row.timing == Some(TimingMethod::GraphReplay)
        && row.launch_bound(doc.config.timing.launch_bound_ratio)
}

/// Share of the maximum SM clock below which a row counts as throttled.
pub const THROTTLED_CLOCK_SHARE: f64 = 0.97;

/// Why the row's timing may not show the device at full speed: its SM clock below
/// [`THROTTLED_CLOCK_SHARE`] of the maximum (with NVML's reasons), or another process on the
/// GPU. Empty when neither.
pub fn machine_flags(row: &Row) -> Vec<String> {
    let mut out = Vec::new();
    let Some(m) = &row.machine else {
        return out;
    };
    if let (Some(clock), Some(max)) = (m.sm_clock_mhz, m.max_sm_clock_mhz) {
        if clock < THROTTLED_CLOCK_SHARE * max {
            let why = if m.throttle_reasons.is_empty() {
                String::new()
            } else {
                format!(", {}", m.throttle_reasons.join(", "))
            };
            out.push(format!(
                "throttled: SM clock {} of {} MHz{why}",
                format::sig(clock, 4),
                format::sig(max, 4)
            ));
        }
    }
    if !m.other_processes.is_empty() {
        out.push(format!("shared GPU: {}", m.other_processes.join(", ")));
    }
    out
}

/// `decl`'s value for `row`: its count over its median time, in `decl.unit`; `None` when the
/// row has no median or no such count.
pub fn throughput(row: &Row, decl: &Throughput) -> Option<f64> {
    decl.of(row)
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

/// Sort key of a parameter value: numbers sort numerically, then text.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum ParamKey {
    /// A flag.
    Bool(bool),
    /// A number: integer part, then the fraction's bits.
    Num(i64, u64),
    /// A name.
    Text(String),
}

/// The sort key of `p`.
pub fn param_key(p: &Param) -> ParamKey {
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

/// `p` as a number, when it is one.
pub fn param_f64(p: &Param) -> Option<f64> {
    match p {
        Param::Int(i) => Some(*i as f64),
        Param::Float(x) => Some(*x),
        _ => None,
    }
}

/// Rows at one x value, by implementation, with the x parameter itself.
pub type RowsAtX<'a> = (Option<&'a Param>, BTreeMap<&'a str, &'a Row>);

/// Rows of one document sharing every parameter but the axis.
pub struct Group<'a> {
    /// The axis the group is drawn against.
    pub axis: String,
    /// The shared parameters.
    pub params: BTreeMap<String, Param>,
    /// x value (None when the rows have no x parameter) -> implementation -> row.
    pub by_x: BTreeMap<Option<ParamKey>, RowsAtX<'a>>,
}

impl Group<'_> {
    /// The shared parameters as `name=value` pairs.
    pub fn title(&self) -> String {
        crate::load::case_label(&self.params)
    }
}

/// The rows of `doc` grouped by every case parameter but `axis`, groups in parameter order and
/// each group's sizes ascending.
pub fn group_rows<'a>(doc: &'a Document, axis: &str) -> Vec<Group<'a>> {
    let mut groups: BTreeMap<Vec<(String, ParamKey)>, Group<'a>> = BTreeMap::new();
    for row in &doc.rows {
        let mut params = row.case.clone();
        params.remove(axis);
        let key: Vec<(String, ParamKey)> = params
            .iter()
            .map(|(k, v)| (k.clone(), param_key(v)))
            .collect();
        let x = row.case.get(axis);
        let group = groups.entry(key).or_insert_with(|| Group {
            axis: axis.to_string(),
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

/// An axis value for display, `—` when absent.
pub fn x_label(x: Option<&Param>) -> String {
    x.map(|p| p.to_string()).unwrap_or_else(|| "—".to_string())
}

/// Stable identifier of a group of a document, for anchors and figure names.
pub fn group_id(loaded: &Loaded, group: &Group<'_>) -> String {
    let mut s = String::new();
    if group.axis != primary_axis(&loaded.doc) {
        // Groups along a later axis: their own ids (the primary axis keeps the ids it had).
        s.push_str(&group.axis);
        s.push('\0');
    }
    s.push_str(loaded.doc.suite.as_str());
    s.push('\0');
    s.push_str(&loaded.doc.device.name);
    s.push('\0');
    s.push_str(&serde_json::to_string(&group.params).unwrap_or_default());
    format!("{:016x}", format::stable_hash(s.as_bytes()))
}

/// Stable identifier of a document (its file and device), for the anchor of its section.
pub fn doc_id(loaded: &Loaded) -> String {
    format!(
        "{:016x}",
        format::stable_hash(
            format!("{}\0{}", loaded.file_name(), loaded.doc.device.name).as_bytes()
        )
    )
}

/// The page a suite is shown on.
pub fn page_of(suite: Suite) -> &'static str {
    SUITE_PAGES
        .iter()
        .find(|(_, _, suites)| suites.contains(&suite))
        .map(|(file, _, _)| *file)
        .unwrap_or("index.html")
}

/// The device's name with its compute capability, when it has one.
pub fn device_label(doc: &Document) -> String {
    match &doc.device.compute_capability {
        Some(cc) => format!("{} (compute capability {cc})", doc.device.name),
        None => doc.device.name.clone(),
    }
}

/// True when the row's error is within its tolerance.
pub fn is_accurate(row: &Row) -> bool {
    row.accuracy
        .as_ref()
        .is_some_and(|a| a.rel_err <= a.tolerance)
}

/// True for an ok row whose error is above its tolerance.
pub fn above_tolerance(row: &Row) -> bool {
    row.status == Status::Ok
        && row
            .accuracy
            .as_ref()
            .is_some_and(|a| a.rel_err > a.tolerance)
}

/// Documents of one suite measured on devices of one name (shards of a grid, split by the
/// runner's `--shard i/n` or run on several GPUs of one model) merged into one: the rows of all,
/// in file order, with the first document's device and configuration (without `finished_at`
/// when any shard lacks it: the run was cut off), the cut-off shards' cases, and a `rel_path`
/// that lists every file (`a.json + b.json`; a part's shards named alike as `a_1.json to
/// a_16.json (16 shards)`), and each throughput's ceiling the highest the
/// parts measured (its source says so and gives the range). Documents alone under their key are
/// borrowed as they are. The loader has already refused rows repeated across files.
pub fn merge_shards(docs: &[Loaded]) -> std::borrow::Cow<'_, [Loaded]> {
    let key = |l: &Loaded| (l.doc.suite, l.doc.device.name.clone(), l.doc.config.kind);
    let keys: BTreeSet<(Suite, String, crate::schema::RunKind)> = docs.iter().map(key).collect();
    if keys.len() == docs.len() {
        return std::borrow::Cow::Borrowed(docs);
    }
    let mut merged: Vec<Loaded> = Vec::with_capacity(keys.len());
    let mut names: Vec<Vec<String>> = Vec::with_capacity(keys.len());
    for l in docs {
        match merged.iter().position(|m| key(m) == key(l)) {
            Some(i) => {
                merged[i].doc.rows.extend(l.doc.rows.iter().cloned());
                merged[i]
                    .cut_off_cases
                    .extend(l.cut_off_cases.iter().cloned());
                merged[i]
                    .case_parts
                    .extend(l.case_parts.iter().map(|(k, p)| (k.clone(), p.clone())));
                // One shard cut off leaves the merged run unfinished.
                if l.doc.config.finished_at.is_none() {
                    merged[i].doc.config.finished_at = None;
                }
                names[i].push(l.file_name());
            }
            None => {
                merged.push(l.clone());
                names.push(vec![l.file_name()]);
            }
        }
    }
    for (m, n) in merged.iter_mut().zip(names) {
        // The shards of one part named together (`a_1.json to a_16.json (16 shards)`).
        let parts: Vec<&Loaded> = docs.iter().filter(|l| key(l) == key(m)).collect();
        m.rel_path = if n.len() > 1 {
            super::shard_groups(&parts)
                .iter()
                .map(|g| super::group_files(g))
                .collect::<Vec<_>>()
                .join(" + ")
        } else {
            n.join(" + ")
        };
    }
    // Each part measured its own ceiling (a GEMM or a copy at the start of its run): the merged
    // run's shares are taken of the highest, so that no row's share is overstated.
    for m in &mut merged {
        let parts: Vec<&Loaded> = docs.iter().filter(|l| key(l) == key(m)).collect();
        if parts.len() < 2 {
            continue;
        }
        for t in &mut m.doc.config.throughput {
            // The ceilings the parts measured for this throughput.
            let measured: Vec<&crate::schema::Ceiling> = parts
                .iter()
                .filter_map(|l| {
                    let d = l.doc.config.throughput.iter().find(|d| d.key == t.key)?;
                    d.ceiling.as_ref()
                })
                .collect();
            let values: Vec<f64> = measured.iter().map(|c| c.value).collect();
            let (lo, hi) = values
                .iter()
                .fold((f64::INFINITY, 0.0_f64), |(lo, hi), &v| {
                    (lo.min(v), hi.max(v))
                });
            // The first part may have measured none (the runner leaves a failed measurement
            // out): the ceiling and its source are then the highest part's.
            if t.ceiling.is_none() {
                t.ceiling = measured
                    .into_iter()
                    .max_by(|a, b| a.value.total_cmp(&b.value))
                    .cloned();
            }
            if let Some(c) = t.ceiling.as_mut() {
                if values.len() > 1 && hi > lo {
                    c.value = hi;
                    c.source = format!(
                        "{}; the highest of the {} measurements of the {} parts ({} to {})",
                        c.source,
                        values.len(),
                        parts.len(),
                        format::sig(lo, 3),
                        format::sig(hi, 3)
                    );
                }
            }
        }
    }
    std::borrow::Cow::Owned(merged)
}

/// The families of a document's implementations: two implementations are of one family when
/// both have a row (of any status) of one case, and families are joined through such links.
/// Returns each implementation's family, numbered by its first row's place in the document; a
/// suite of one op has one family, a suite of several ops (the MoE suite's grouped GEMM and
/// whole layer) one per op.
pub fn families(doc: &Document) -> BTreeMap<&str, usize> {
    let mut family: BTreeMap<&str, usize> = BTreeMap::new();
    let mut by_case: BTreeMap<String, Vec<&str>> = BTreeMap::new();
    for row in &doc.rows {
        let next = family.len();
        family.entry(row.implementation.as_str()).or_insert(next);
        by_case
            .entry(crate::load::case_key(&row.case))
            .or_default()
            .push(row.implementation.as_str());
    }
    // Join until nothing changes: every implementation of a case takes the case's lowest.
    loop {
        let mut changed = false;
        for names in by_case.values() {
            let low = names.iter().map(|n| family[n]).min().unwrap_or(0);
            for n in names {
                let old = family[n];
                if old != low {
                    // The whole family of n moves to low.
                    for f in family.values_mut() {
                        if *f == old {
                            *f = low;
                        }
                    }
                    changed = true;
                }
            }
        }
        if !changed {
            return family;
        }
    }
}

/// Implementations of a document: default(s) first, then by name.
pub fn implementations(doc: &Document, colours: &BTreeMap<String, String>) -> Vec<ImplHeader> {
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
