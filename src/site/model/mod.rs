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
pub mod tiles;

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

pub use self::groups::{merge_shards, ImplHeader};
pub use self::hopper::{HopperImpl, HopperPage, HopperSuite};
pub use self::overview::{
    BarOutcome, DispatchView, GlanceBar, GlanceCell, GlanceChart, GlanceRow, GlanceTable,
    GlanceTableRow, IndexPage, Limitation, PageLink, RatioWords, SetupDoc, TimingView,
};
pub use self::suite::{
    Cell, Dash, DetailRow, DocSection, FigureSpec, GroupView, Marker, Series, SuitePage,
    SuiteSection, TableRow, ThroughputCell, CUT_OFF,
};
pub use self::tiles::{TileBar, TileChart, TileGroup, TileRow, TileSweepSection};
use super::format;
use super::templates::{NotesSource, TUNING_NOTES};
use crate::load::Loaded;
use crate::schema::{Document, Suite};

/// Command that produces the attention document.
pub const ATTENTION_COMMAND: &str =
    "cargo run --release --bin attention -- --compare torch --output data/gpu_attention.json";

/// Command that produces the GPU sequence-mixer document.
pub const SEQUENCE_MIXERS_COMMAND: &str =
    "cargo run --release --bin sequence_mixers -- --compare torch --output data/gpu_sequence_mixers.json";

/// Command that produces the GPU kernel-sum document.
pub const KERNEL_SUMS_COMMAND: &str =
    "cargo run --release --bin kernel_sums -- --compare torch,jax,ott,geomloss --output data/gpu_kernel_sums.json";

/// Command that measures the MoE suite on the GPU.
pub const MOE_COMMAND: &str =
    "cargo run --release --bin moe -- --compare torch --output data/gpu_moe.json";

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

/// The commands that reproduce `docs`, followed by the command that builds the site, pages and
/// figures, from them: one per document ([`reproduce_command`]), except that the shards of one
/// part of a run ([`shard_loop`]) share one command, a shell loop over their numbers.
pub(crate) fn reproduce_commands<'a>(docs: impl Iterator<Item = &'a Loaded>) -> Vec<CommandView> {
    let docs: Vec<&Loaded> = docs.collect();
    let mut out = Vec::new();
    for group in shard_groups(&docs) {
        match shard_loop(&group) {
            Some(view) => out.push(view),
            None => out.extend(group.iter().map(|l| CommandView {
                label: format!("{} ({})", l.file_name(), run_words(&[*l])),
                command: reproduce_command(l),
            })),
        }
    }
    out.push(CommandView {
        label: "the site, pages and figures".to_string(),
        command: DOCGEN_COMMAND.to_string(),
    });
    out
}

/// `docs` in groups, each the shards of one part of a run ([`same_part`], in shard order) or
/// one document, in the order of each group's first document.
pub(crate) fn shard_groups<'a>(docs: &[&'a Loaded]) -> Vec<Vec<&'a Loaded>> {
    let mut taken = vec![false; docs.len()];
    let mut out = Vec::new();
    for (k, l) in docs.iter().enumerate() {
        if taken[k] {
            continue;
        }
        let mut group = vec![*l];
        for (j, other) in docs.iter().enumerate().skip(k + 1) {
            if !taken[j] && same_part(l, other) {
                taken[j] = true;
                group.push(*other);
            }
        }
        group.sort_by_key(|l| crate::load::shard_of(&l.doc.config.command).map(|s| s.0));
        out.push(group);
    }
    out
}

/// The files of a group from [`shard_groups`]: `a.json`; `a_1.json to a_16.json (16 shards)`
/// when the shards are named alike and their numbers run without a gap; else each file
/// (`a_1.json, a_3.json`).
pub(crate) fn group_files(group: &[&Loaded]) -> String {
    let shards: Vec<(u32, &Loaded)> = group
        .iter()
        .filter_map(|l| Some((crate::load::shard_of(&l.doc.config.command)?.0, *l)))
        .collect();
    // A range reads right only for files named alike whose numbers run without a gap.
    let consecutive = shards.len() == group.len()
        && shards.windows(2).all(|w| w[1].0 == w[0].0 + 1)
        && name_pattern(&shards).is_some();
    match group {
        [one] => one.file_name(),
        [first, .., last] if consecutive => format!(
            "{} to {} ({} shards)",
            first.file_name(),
            last.file_name(),
            group.len()
        ),
        _ => group
            .iter()
            .map(|l| l.file_name())
            .collect::<Vec<_>>()
            .join(", "),
    }
}

/// Every library the documents of `group` recorded, with each distinct version in the order the
/// documents give them (the shards of one part may have run on machines set up differently).
pub(crate) fn library_versions(group: &[&Loaded]) -> BTreeMap<String, Vec<String>> {
    let mut versions: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for g in group {
        for (k, v) in &g.doc.config.libraries {
            let seen = versions.entry(k.clone()).or_default();
            if !seen.contains(v) {
                seen.push(v.clone());
            }
        }
    }
    versions
}

/// The suite, the card, the commit and the Python packages of `l`'s run, for a label: two runs
/// of one suite on two cards differ in the card and the commit.
/// For the shards of one part, the packages are those any of them recorded (a shard records
/// the libraries its cases loaded).
fn run_words(group: &[&Loaded]) -> String {
    let l = group[0];
    // Each library's versions (`2.11.0 / 2.12.0` where the shards differ).
    let libs: BTreeMap<String, String> = library_versions(group)
        .into_iter()
        .map(|(k, v)| (k, v.join(" / ")))
        .collect();
    format!(
        "{}, on the {} at commit {}{}",
        l.doc.suite.title(),
        l.doc.device.name,
        super::format::short_commit(&l.doc.config.git_commit),
        packages_of(&libs)
            .map(|p| format!("; its comparisons ran with {p}"))
            .unwrap_or_default()
    )
}

/// True when `a` and `b` are shards of one part of a run: one suite, card and commit, and one
/// command line but for `--shard i/n` (the same n) and `--output`.
fn same_part(a: &Loaded, b: &Loaded) -> bool {
    let (ca, cb) = (&a.doc.config, &b.doc.config);
    let shards = match (
        crate::load::shard_of(&ca.command),
        crate::load::shard_of(&cb.command),
    ) {
        (Some((i, n)), Some((j, m))) => n == m && i != j,
        _ => false,
    };
    shards
        && a.doc.suite == b.doc.suite
        && a.doc.device.name == b.doc.device.name
        && ca.git_commit == cb.git_commit
        && crate::load::command_without(&ca.command, &["--shard", "--output"])
            == crate::load::command_without(&cb.command, &["--shard", "--output"])
}

/// The file name of `shards` (number, document; sorted) around their numbers, when every
/// one is named alike but for it (`gpu_attention_bwd_` and `.json` for
/// `gpu_attention_bwd_7.json`): the number is the last run of digits in the first name that
/// is the first shard's.
fn name_pattern(shards: &[(u32, &Loaded)]) -> Option<(String, String)> {
    let first = shards.first()?.1.file_name();
    let number = shards[0].0.to_string();
    let at = first
        .rmatch_indices(number.as_str())
        .map(|(i, _)| i)
        .find(|&i| {
            let before = first[..i].chars().next_back();
            let after = first[i + number.len()..].chars().next();
            !before.is_some_and(|c| c.is_ascii_digit())
                && !after.is_some_and(|c| c.is_ascii_digit())
        })?;
    let (prefix, suffix) = (&first[..at], &first[at + number.len()..]);
    shards
        .iter()
        .all(|(i, l)| l.file_name() == format!("{prefix}{i}{suffix}"))
        .then(|| (prefix.to_string(), suffix.to_string()))
}

/// One command for the shards of one part of a run (`group`, [`same_part`], more than one):
/// `for i in $(seq 1 16); do cargo run ... --shard $i/16 --output "data/gpu_attention_bwd_$i.json" || break; done`
/// (the shards present, when not all of them), labelled with the first and last file. `None`
/// when the group is one document, or its files are not named alike but for the shard's number
/// (`gpu_attention_bwd_7.json`), or a name would need more than double quotes.
fn shard_loop(group: &[&Loaded]) -> Option<CommandView> {
    if group.len() < 2 {
        return None;
    }
    let mut shards: Vec<(u32, &Loaded)> = group
        .iter()
        .map(|l| Some((crate::load::shard_of(&l.doc.config.command)?.0, *l)))
        .collect::<Option<_>>()?;
    shards.sort_by_key(|s| s.0);
    let (_, count) = crate::load::shard_of(&shards[0].1.doc.config.command)?;
    let (prefix, suffix) = name_pattern(&shards)?;
    let (prefix, suffix) = (prefix.as_str(), suffix.as_str());
    let first = shards[0].1.file_name();
    // Inside double quotes nothing of the name may expand (`!` does in an interactive bash).
    let plain = |s: &str| !s.contains(['"', '$', '`', '\\', '\n', '!']);
    if !plain(prefix) || !plain(suffix) {
        return None;
    }
    // The first shard's command, its shard and output made the loop's.
    let mut words: Vec<String> = Vec::new();
    let mut args = shards[0].1.doc.config.command.iter();
    match args.next() {
        Some(bin) if *bin == shards[0].1.doc.config.runner => {
            words.extend(
                ["cargo", "run", "--release", "--bin", bin.as_str(), "--"]
                    .map(|w| super::format::shell_join(&[w.to_string()])),
            );
        }
        Some(other) => words.push(super::format::shell_join(std::slice::from_ref(other))),
        None => return None,
    }
    let shard = format!("$i/{count}");
    let output = format!("\"data/{prefix}$i{suffix}\"");
    let mut next: Option<&str> = None;
    for a in args {
        if let Some(option) = next.take() {
            words.push(if option == "--shard" {
                shard.clone()
            } else {
                output.clone()
            });
            continue;
        }
        if a == "--shard" || a == "--output" {
            next = Some(a.as_str());
            words.push(a.clone());
        } else if a.starts_with("--shard=") {
            words.push(format!("--shard={shard}"));
        } else if a.starts_with("--output=") {
            words.push(format!("--output={output}"));
        } else {
            words.push(super::format::shell_join(std::slice::from_ref(a)));
        }
    }
    // Without its own output file each shard would print its document: no loop then.
    if !words
        .iter()
        .any(|w| w == "--output" || w.starts_with("--output="))
    {
        return None;
    }
    let numbers: Vec<u32> = shards.iter().map(|s| s.0).collect();
    let whole = numbers.len() == count as usize && numbers.iter().copied().eq(1..=count);
    let list = if whole {
        format!("$(seq 1 {count})")
    } else {
        numbers
            .iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(" ")
    };
    let which = if whole {
        format!("all {count} shards of this command")
    } else {
        format!(
            "shards {} of {count} of this command, those in the data",
            numbers
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        )
    };
    let last = shards[shards.len() - 1].1.file_name();
    Some(CommandView {
        label: format!(
            "{first} to {last} ({which}; {})",
            run_words(&shards.iter().map(|s| s.1).collect::<Vec<_>>())
        ),
        command: format!("for i in {list}; do {} || break; done", words.join(" ")),
    })
}

/// The Python packages document `l`'s comparison scripts ran with, as recorded in its
/// `config.libraries`, under the names pip installs them by (`fla` is the `fla-core`
/// distribution), e.g. `Python 3.12.3, torch 2.11.0+cu130, triton 3.6.0, fla-core 0.6.0`; `None`
/// when the run compared with no Python library.
pub fn python_packages(l: &Loaded) -> Option<String> {
    packages_of(&l.doc.config.libraries)
}

/// [`python_packages`] of a `config.libraries` map.
fn packages_of(libs: &BTreeMap<String, String>) -> Option<String> {
    const PIP_NAMES: [(&str, &str); 8] = [
        ("torch", "torch"),
        ("triton", "triton"),
        ("fla", "fla-core"),
        ("jax", "jax"),
        ("jaxlib", "jaxlib"),
        ("jax_cuda13_plugin", "jax-cuda13-plugin"),
        ("ott-jax", "ott-jax"),
        ("geomloss", "geomloss"),
    ];
    // torch's wheels bring their cuDNN, whose version the cuDNN backend's rows depend on.
    let cudnn = libs
        .get("cudnn")
        .map(|v| format!(" (cuDNN {})", super::format::library_version("cudnn", v)))
        .unwrap_or_default();
    let packages: Vec<String> = PIP_NAMES
        .iter()
        .filter_map(|(key, pip)| {
            libs.get(*key).map(|v| {
                let extra = if *key == "torch" { cudnn.as_str() } else { "" };
                format!("{pip} {v}{extra}")
            })
        })
        .collect();
    if packages.is_empty() {
        return None;
    }
    let python = libs
        .get("python")
        .map(|v| format!("Python {v}, "))
        .unwrap_or_default();
    Some(format!("{python}{}", packages.join(", ")))
}

/// The command that measures `suite`, when its runner exists.
pub fn measure_command(suite: Suite) -> Option<&'static str> {
    match suite {
        Suite::Attention => Some(ATTENTION_COMMAND),
        Suite::SequenceMixers => Some(SEQUENCE_MIXERS_COMMAND),
        Suite::KernelSums => Some(KERNEL_SUMS_COMMAND),
        Suite::Moe => Some(MOE_COMMAND),
        Suite::Models => None,
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
    /// The tile sweeps' bar charts.
    pub tile_charts: Vec<TileChart>,
    /// The suite pages' bar charts of cases measured at one size (each case's time against
    /// the default's).
    pub case_charts: Vec<GlanceChart>,
    /// One page per kernel tuning notes file found ([`TUNING_NOTES`] order; `tuning.html` for
    /// the attention notes).
    pub tuning: Vec<NotesPage>,
    /// Where each notes file found is published: its repository path (`kernels/TUNING.md`)
    /// and its page's link, so that prose naming the file links to the page.
    pub notes_links: Vec<(String, String)>,
}

/// The navigation's label for the kernel tuning notes pages, and their titles' first words.
pub const NOTES_LABEL: &str = "Kernel tuning notes";

/// Links and names shared by every page.
#[derive(Debug, Serialize, Clone)]
pub struct Layout {
    /// Page title.
    pub title: String,
    /// This page's file name.
    pub file: String,
    /// Prefix of internal links: empty (relative) or the base URL ending in `/`.
    pub base: String,
    /// Navigation links to the pages that show data.
    pub nav: Vec<NavLink>,
    /// Navigation links to the pages with nothing measured yet, shown together on one line.
    pub nav_unmeasured: Vec<NavLink>,
    /// True when the page shows measured data (its footer then says where the figures come
    /// from).
    pub has_data: bool,
    /// The page's table of contents.
    pub toc: Vec<TocEntry>,
    /// True for a page of hand-written notes (its footer says so).
    pub hand_written: bool,
    /// Link to "What runs by default" on the overview, for the `default` badges.
    pub defaults_href: String,
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
    /// True when the page shows measured data; pages without are listed apart, on one line.
    pub measured: bool,
}

/// One entry of a page's table of contents.
#[derive(Debug, Serialize, Clone)]
pub struct TocEntry {
    /// `#anchor` on the page.
    pub href: String,
    /// Text.
    pub label: String,
    /// 1 for a section, 2 for a subsection, 3 below that.
    pub depth: u8,
}

/// One file of kernel tuning notes, rendered as a page of the site.
#[derive(Debug, Serialize)]
pub struct NotesPage {
    /// Layout.
    pub layout: Layout,
    /// The Markdown file it comes from, relative to the repository root (`kernels/TUNING.md`).
    pub source: String,
    /// Every notes page of the site, this one marked `current`, for moving between them.
    pub siblings: Vec<NavLink>,
    /// The notes as HTML, headings with ids.
    pub html: String,
}

/// A label and a value.
#[derive(Debug, Serialize, Clone)]
pub struct KeyValue {
    /// Label.
    pub key: String,
    /// Value.
    pub value: String,
}

/// Where a figure is, what it shows and the size it is drawn at (the `<img>`'s width and
/// height, so that the page keeps the figure's place before it loads, and lazy loading knows
/// where it is).
#[derive(Debug, Serialize, Clone)]
pub struct FigureRef {
    /// Link, base-prefixed.
    pub src: String,
    /// Alternative text.
    pub alt: String,
    /// Drawn width, px.
    pub width: u32,
    /// Drawn height, px.
    pub height: u32,
}

impl FigureRef {
    /// The line figure `spec` ([`super::figures::line_figure`]) under `base`.
    pub fn line(base: &str, spec: &FigureSpec) -> FigureRef {
        FigureRef::new(
            base,
            &spec.file,
            &spec.desc,
            super::figures::line_figure_size(spec),
        )
    }

    /// The bar chart `chart` ([`super::figures::glance_chart`]) under `base`.
    pub fn glance(base: &str, chart: &GlanceChart) -> FigureRef {
        FigureRef::new(
            base,
            &chart.file,
            &chart.desc,
            super::figures::glance_size(chart),
        )
    }

    /// The tile sweep chart `chart` ([`super::figures::tile_chart`]) under `base`.
    pub fn tile(base: &str, chart: &TileChart) -> FigureRef {
        FigureRef::new(
            base,
            &chart.file,
            &chart.desc,
            super::figures::tile_size(chart),
        )
    }

    /// The figure file `file` under `base`, described by `desc`, drawn at `(width, height)` px.
    fn new(base: &str, file: &str, desc: &str, (width, height): (u32, u32)) -> FigureRef {
        FigureRef {
            src: format!("{base}{file}"),
            alt: desc.to_string(),
            width,
            height,
        }
    }
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
/// Each of `tuning_notes` (a notes file and its Markdown) becomes a notes page; the navigation
/// links the first.
///
/// Setup, methodology and reproduction commands are per file (the shards of one part of a run
/// together, [`shard_groups`]); tables, figures, the At a glance
/// comparison, dispatch rules and limitations use the documents merged by [`merge_shards`].
pub fn build_model(
    all_docs: &[Loaded],
    base_url: Option<&str>,
    tuning_notes: &[(NotesSource, String)],
) -> SiteModel {
    let merged = merge_shards(all_docs);
    // Tile sweeps have their own section on their suite's page; every table, figure, comparison
    // and rule elsewhere reads the grids.
    let (sweeps, grids): (Vec<Loaded>, Vec<Loaded>) = merged
        .iter()
        .cloned()
        .partition(|l| l.doc.config.kind == crate::schema::RunKind::TileSweep);
    let docs: &[Loaded] = &grids;
    let base = match base_url {
        Some(b) if b.ends_with('/') => b.to_string(),
        Some(b) => format!("{b}/"),
        None => String::new(),
    };
    let colours = palette(docs);
    let hopper_title = hopper::title(docs);
    // Every page with whether it has data, in navigation order.
    let mut pages: Vec<(String, String, bool)> = vec![(
        "index.html".to_string(),
        "Overview".to_string(),
        !docs.is_empty(),
    )];
    for (f, t, suites) in SUITE_PAGES {
        // A page with only a tile sweep still shows measurements.
        let has = docs
            .iter()
            .chain(&sweeps)
            .any(|l| suites.contains(&l.doc.suite) && !l.doc.rows.is_empty());
        pages.push((f.to_string(), t.to_string(), has));
    }
    if let Some(t) = &hopper_title {
        pages.push((HOPPER_FILE.to_string(), t.clone(), true));
    }
    // The navigation has one entry for the notes: the first page, current on any of them.
    let notes_files: Vec<&str> = tuning_notes.iter().map(|(n, _)| n.file).collect();
    if let Some(first) = notes_files.first() {
        pages.push((first.to_string(), NOTES_LABEL.to_string(), true));
    }
    let layout = |file: &str, title: &str, toc: Vec<TocEntry>| {
        let has_data = pages
            .iter()
            .find(|(f, _, _)| f == file)
            .is_some_and(|p| p.2);
        let links = |measured: bool| {
            pages
                .iter()
                .filter(|p| p.2 == measured)
                .map(|(f, t, has)| NavLink {
                    href: format!("{base}{f}"),
                    label: t.clone(),
                    current: f == file
                        || (notes_files.contains(&f.as_str()) && notes_files.contains(&file)),
                    measured: *has,
                })
                .collect()
        };
        Layout {
            title: title.to_string(),
            file: file.to_string(),
            base: base.clone(),
            has_data: has_data && !notes_files.contains(&file),
            hand_written: notes_files.contains(&file),
            toc,
            defaults_href: format!("{base}index.html#what-runs-by-default"),
            nav: links(true),
            nav_unmeasured: links(false),
        }
    };

    let mut figures = Vec::new();
    let mut tile_charts = Vec::new();
    let mut case_charts = Vec::new();
    let suite_pages: Vec<SuitePage> = SUITE_PAGES
        .iter()
        .map(|(file, title, suites)| {
            let sections: Vec<SuiteSection> = suites
                .iter()
                .map(|s| {
                    let mut section = suite::suite_section(
                        docs,
                        *s,
                        &base,
                        &colours,
                        &mut figures,
                        &mut case_charts,
                    );
                    section.tile_sweeps =
                        tiles::tile_sweeps(&sweeps, docs, *s, &base, &mut tile_charts);
                    // Each sweep names its suite's notes, and links them where they are a page.
                    let notes = TUNING_NOTES.iter().find(|n| n.suite == *s);
                    let present = tuning_notes.iter().any(|(n, _)| Some(n) == notes);
                    for t in &mut section.tile_sweeps {
                        t.notes_path = notes.map(|n| n.path.to_string());
                        t.notes_href = notes
                            .filter(|_| present)
                            .map(|n| format!("{base}{}", n.file));
                    }
                    section.measured |= !section.tile_sweeps.is_empty();
                    section
                })
                .collect();
            SuitePage {
                layout: layout(file, title, suite::toc(&sections)),
                sections,
                reproduce: reproduce_commands(
                    all_docs.iter().filter(|l| suites.contains(&l.doc.suite)),
                ),
            }
        })
        .collect();

    let glance = overview::glance(docs, &base);
    let page_links = SUITE_PAGES
        .iter()
        .map(|(f, t, suites)| {
            (
                f.to_string(),
                t.to_string(),
                count_rows(docs, |d| suites.contains(&d.suite))
                    + count_rows(&sweeps, |d| suites.contains(&d.suite)),
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
    let mut index = overview::index_page(
        all_docs,
        docs,
        &base,
        layout("index.html", &overview_title(docs), overview::toc()),
        page_links,
        &glance,
    );
    let hopper = hopper_title.as_deref().map(|t| {
        let page = hopper::hopper_page(docs, all_docs, layout(HOPPER_FILE, t, Vec::new()));
        HopperPage {
            layout: Layout {
                toc: hopper::toc(&page),
                ..page.layout
            },
            ..page
        }
    });
    let notes_links: Vec<(String, String)> = tuning_notes
        .iter()
        .map(|(n, _)| (n.path.to_string(), format!("{base}{}", n.file)))
        .collect();
    let siblings = |current: &str| -> Vec<NavLink> {
        tuning_notes
            .iter()
            .map(|(n, _)| NavLink {
                href: format!("{base}{}", n.file),
                label: n.title.to_string(),
                current: n.file == current,
                measured: false,
            })
            .collect()
    };
    index.tuning_notes = siblings("");
    let tuning = tuning_notes
        .iter()
        .map(|(notes, md)| {
            // The page's own title stands for the notes' first heading when it is a title.
            let md = match md.trim_start().strip_prefix("# ") {
                Some(rest) => rest.split_once('\n').map_or("", |(_, body)| body),
                None => md.as_str(),
            };
            let (html, headings) = super::markdown::to_html_with_ids(md);
            // One notes file naming another links its page.
            let html = super::markdown::link_code_spans(&html, &notes_links);
            let toc = headings
                .into_iter()
                .filter(|(_, _, level)| *level == 2)
                .map(|(id, label, _)| TocEntry {
                    href: format!("#{id}"),
                    label,
                    depth: 1,
                })
                .collect();
            NotesPage {
                layout: layout(notes.file, &format!("{NOTES_LABEL}: {}", notes.title), toc),
                source: notes.path.to_string(),
                siblings: siblings(notes.file),
                html,
            }
        })
        .collect();
    SiteModel {
        index,
        suite_pages,
        hopper,
        figures,
        glance_chart: glance.chart,
        tile_charts,
        case_charts,
        tuning,
        notes_links,
    }
}

/// The overview's title, naming the kinds of device the documents measured (`GPU
/// performance`, `GPU and CPU performance`; `Performance` before any document).
fn overview_title(docs: &[Loaded]) -> String {
    use crate::schema::DeviceKind;
    let has = |k: DeviceKind| docs.iter().any(|l| l.doc.device.kind == k);
    match (has(DeviceKind::Gpu), has(DeviceKind::Cpu)) {
        (true, true) => "GPU and CPU performance".to_string(),
        (true, false) => "GPU performance".to_string(),
        (false, true) => "CPU performance".to_string(),
        (false, false) => "Performance".to_string(),
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
