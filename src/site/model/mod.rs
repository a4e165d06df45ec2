//! The page model: everything the pages and figures show, computed from the loaded documents.
//!
//! Every number on the site is formatted here from a row of `data/`; templates only lay the
//! model out, and figures only draw the [`FigureSpec`]s listed here. Nothing here touches the
//! disk. One module per page ([`overview`], [`suite`], [`hopper`]) over one shared grouping of
//! rows ([`groups`]).

pub mod groups;
pub mod hopper;
pub mod overview;
pub mod suite;

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

pub use self::groups::{merge_shards, ImplHeader};
pub use self::hopper::{HopperImpl, HopperPage, HopperSuite};
pub use self::overview::{
    BarOutcome, DispatchView, GlanceBar, GlanceCell, GlanceChart, GlanceRow, GlanceTable,
    GlanceTableRow, IndexPage, Limitation, PageLink, SetupDoc, TimingView,
};
pub use self::suite::{
    Cell, Dash, DocSection, FigureSpec, GroupView, Marker, MemoryRow, Series, SuitePage,
    SuiteSection, TableRow, ThroughputCell,
};
use super::format;
use crate::load::Loaded;
use crate::schema::{Document, Suite};

/// Command that produces the attention document.
pub const ATTENTION_COMMAND: &str =
    "cargo run --release --bin attention -- --compare torch --output data/gpu_attention.json";

/// Command that builds the site.
pub const DOCGEN_COMMAND: &str = "cargo run --release --bin docgen -- build";

/// The command that writes the figures alone.
pub const FIGURES_COMMAND: &str = "cargo run --release --bin docgen -- figures --out figures";

/// Colour-blind-safe palette (Okabe and Ito, 2008, with a grey and two darker tones): an
/// implementation named in [`FIXED_COLOURS`] keeps its colour whatever else is measured; any
/// other gets one of these from a stable hash of its name.
pub const PALETTE: [&str; 10] = [
    "#0072b2", "#e69f00", "#009e73", "#d55e00", "#cc79a7", "#56b4e9", "#7f7f7f", "#8c6d1f",
    "#004d40", "#882255",
];

/// Colours of the implementations the runners write today, by name, so that adding an
/// implementation never recolours another.
pub const FIXED_COLOURS: [(&str, &str); 12] = [
    ("flash", "#0072b2"),
    ("flash_sm80", "#56b4e9"),
    ("math", "#d55e00"),
    ("torch_cudnn", "#009e73"),
    ("torch_flash", "#e69f00"),
    ("torch_efficient", "#cc79a7"),
    ("torch_math", "#7f7f7f"),
    ("torch_flex", "#882255"),
    ("jax_cudnn", "#004d40"),
    ("jax_xla", "#8c6d1f"),
    ("cpu", "#000000"),
    ("torch_cpu", "#999999"),
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

/// File of the Hopper page.
pub const HOPPER_FILE: &str = "hopper.html";

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
pub(crate) fn reproduce_commands<'a>(docs: impl Iterator<Item = &'a Loaded>) -> Vec<CommandView> {
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
    /// `hopper.html`, when some document comes from a compute capability 9.x device.
    pub hopper: Option<HopperPage>,
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
    /// True when the page shows measured data (its footer then says where the figures come
    /// from).
    pub has_data: bool,
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

/// Where a figure is and what it shows.
#[derive(Debug, Serialize, Clone)]
pub struct FigureRef {
    /// Link, base-prefixed.
    pub src: String,
    /// Alternative text.
    pub alt: String,
}

/// A command to show, highlighted when rendered.
#[derive(Debug, Serialize, Clone)]
pub struct CommandView {
    /// What it does.
    pub label: String,
    /// The command line, shell-quoted.
    pub command: String,
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
    let hopper_title = hopper::title(docs);
    let layout = |file: &str, title: &str, has_data: bool| Layout {
        title: title.to_string(),
        file: file.to_string(),
        base: base.clone(),
        has_data,
        nav: std::iter::once(("index.html", "Overview"))
            .chain(SUITE_PAGES.iter().map(|(f, t, _)| (*f, *t)))
            .chain(hopper_title.as_deref().map(|t| (HOPPER_FILE, t)))
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
            layout: layout(
                file,
                title,
                docs.iter()
                    .any(|l| suites.contains(&l.doc.suite) && !l.doc.rows.is_empty()),
            ),
            sections: suites
                .iter()
                .map(|s| suite::suite_section(docs, *s, &base, &colours, &mut figures))
                .collect(),
            reproduce: reproduce_commands(
                all_docs.iter().filter(|l| suites.contains(&l.doc.suite)),
            ),
        })
        .collect();

    let glance = overview::glance(docs, &base);
    let pages = SUITE_PAGES
        .iter()
        .map(|(f, t, suites)| {
            (
                f.to_string(),
                t.to_string(),
                count_rows(docs, |d| suites.contains(&d.suite)),
            )
        })
        .chain(hopper_title.as_ref().map(|t| {
            (
                HOPPER_FILE.to_string(),
                t.clone(),
                count_rows(docs, hopper::is_hopper),
            )
        }))
        .map(|(f, title, rows)| PageLink {
            href: format!("{base}{f}"),
            title,
            rows,
        })
        .collect();
    let index = overview::index_page(
        all_docs,
        docs,
        &base,
        layout("index.html", "GPU and CPU performance", !docs.is_empty()),
        pages,
        &glance,
    );
    let hopper = hopper_title
        .as_deref()
        .map(|t| hopper::hopper_page(docs, layout(HOPPER_FILE, t, true)));
    SiteModel {
        index,
        suite_pages,
        hopper,
        figures,
        glance_chart: glance.chart,
    }
}

fn count_rows(docs: &[Loaded], pick: impl Fn(&Document) -> bool) -> usize {
    docs.iter()
        .filter(|l| pick(&l.doc))
        .map(|l| l.doc.rows.len())
        .sum()
}

/// The colour of implementation `name`: from [`FIXED_COLOURS`], else from [`PALETTE`] by a
/// stable hash of the name (so it never depends on what else was measured).
pub fn colour_of(name: &str) -> &'static str {
    FIXED_COLOURS
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, c)| *c)
        .unwrap_or_else(|| {
            PALETTE[(format::stable_hash(name.as_bytes()) % PALETTE.len() as u64) as usize]
        })
}

/// Colour per implementation of `docs` ([`colour_of`]).
fn palette(docs: &[Loaded]) -> BTreeMap<String, String> {
    let names: BTreeSet<&str> = docs
        .iter()
        .flat_map(|l| l.doc.rows.iter().map(|r| r.implementation.as_str()))
        .collect();
    names
        .into_iter()
        .map(|n| (n.to_string(), colour_of(n).to_string()))
        .collect()
}
