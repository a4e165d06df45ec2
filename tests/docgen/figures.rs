//! Figures and shards: the SVGs built from the committed data and the fixtures are parsed
//! (scraper) and checked against the documents; shard documents are made from the valid
//! fixture and must give the same tables as the whole.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

use kernelpages::load;
use kernelpages::site::{self, BuildOptions};
use scraper::{ElementRef, Html};
use serde_json::Value;

use super::{page, sel, text};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn valid_dir() -> PathBuf {
    root().join("tests/fixtures/valid")
}

fn build_site(data: &Path) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("site");
    let opts = BuildOptions {
        data_dir: data.to_path_buf(),
        out_dir: out.clone(),
        base_url: None,
        templates_dir: None,
    };
    site::build(&opts).unwrap_or_else(|e| panic!("build failed: {e:#}"));
    (tmp, out)
}

fn svg(path: &Path) -> Html {
    Html::parse_fragment(&fs::read_to_string(path).unwrap())
}

/// Every `<text>` of an SVG.
fn texts(doc: &Html) -> Vec<String> {
    doc.select(&sel("text")).map(text).collect()
}

fn attr_f64(e: ElementRef<'_>, name: &str) -> f64 {
    e.value().attr(name).unwrap().parse().unwrap()
}

fn figures(site: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = fs::read_dir(site.join("figures"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    v.sort();
    v
}

#[test]
fn time_figures_label_only_the_measured_x_values() {
    let (_tmp, site) = build_site(&root().join("data"));
    let docs = load::load_dir(&root().join("data")).unwrap();
    // A group is a case with seq_len left out (the x axis), per device; its sizes. Only the
    // attention documents draw on attention.html.
    let mut groups_in_data: BTreeMap<(String, &str, String), BTreeSet<String>> = BTreeMap::new();
    // Tile sweeps have a section of their own (`section.tile-group`), not groups; decoding runs
    // draw groups along seq_len_kv, the masks grid along seq_len.
    use kernelpages::schema::RunKind;
    for l in docs.iter().filter(|l| {
        l.doc.suite == kernelpages::schema::Suite::Attention
            && matches!(
                l.doc.config.kind,
                RunKind::Grid | RunKind::Decode | RunKind::Masks
            )
    }) {
        let axis = if l.doc.config.kind == RunKind::Decode {
            "seq_len_kv"
        } else {
            "seq_len"
        };
        for r in &l.doc.rows {
            let mut c = r.case.clone();
            let x = c.remove(axis).map(|p| p.to_string());
            groups_in_data
                .entry((
                    l.doc.device.name.clone(),
                    l.doc.config.kind.as_str(),
                    serde_json::to_string(&c).unwrap(),
                ))
                .or_default()
                .insert(x.unwrap_or_default());
        }
    }
    // Groups of one size share one table per device and kind of run ("Cases measured at one
    // size"; a kind with one such group draws it as a group of its own: a decoding case whose
    // longer caches a time limit cut off).
    let mut singles: BTreeMap<(String, &str), usize> = BTreeMap::new();
    let mut sweeps = 0;
    for ((device, kind, _), xs) in &groups_in_data {
        if xs.len() < 2 {
            *singles.entry((device.clone(), kind)).or_default() += 1;
        } else {
            sweeps += 1;
        }
    }
    let tables = singles
        .values()
        .map(|&n| if n >= 2 { 1 } else { n })
        .sum::<usize>();
    let doc = page(&site, "attention.html");
    let groups: Vec<ElementRef<'_>> = doc.select(&sel("section.group")).collect();
    assert_eq!(groups.len(), sweeps + tables);
    let mut single_rows = 0;
    for g in groups {
        let title = text(g.select(&sel("h3")).next().unwrap());
        if title.starts_with("Cases measured at one size") {
            // One row per case, no line figure (a single point draws no line): at most the bar
            // chart of the cases against the default.
            single_rows += g.select(&sel("table.results tbody tr")).count();
            assert!(
                g.select(&sel("figure img")).all(|i| i
                    .value()
                    .attr("src")
                    .is_some_and(|s| s.ends_with("-cases.svg"))),
                "{title}"
            );
            continue;
        }
        // The sizes this group measured: the rows of its results table.
        let xs: BTreeSet<String> = g
            .select(&sel("table.results tbody th[scope=row]"))
            .map(text)
            .collect();
        assert!(!xs.is_empty());
        if xs.len() == 1 {
            // A group of its own at one size (see above): its table, no figure.
            assert_eq!(g.select(&sel("figure")).count(), 0, "{title}");
            continue;
        }
        let srcs: Vec<String> = g
            .select(&sel("figure img"))
            .map(|i| i.value().attr("src").unwrap().to_string())
            .collect();
        // Time, TFLOP/s and the ratio to the default.
        for src in &srcs[..3] {
            let f = site.join(src);
            let doc = svg(&f);
            let t = texts(&doc);
            for x in &xs {
                assert!(t.contains(x), "{}: no tick {x} in {t:?}", f.display());
            }
            // The x axis labels only the measured sizes: every number on the x axis's line (the
            // line most of the measured sizes' labels sit on; the y axis's labels sit on other
            // lines) is measured.
            let mut lines: Vec<(String, usize)> = Vec::new();
            for e in doc.select(&sel("text")).filter(|e| xs.contains(&text(*e))) {
                let y = e.value().attr("y").unwrap().to_string();
                match lines.iter_mut().find(|(l, _)| *l == y) {
                    Some((_, n)) => *n += 1,
                    None => lines.push((y, 1)),
                }
            }
            let baseline: f64 = lines
                .iter()
                .max_by_key(|(_, n)| *n)
                .map(|(y, _)| y.parse().unwrap())
                .unwrap();
            let on_x_axis: Vec<String> = doc
                .select(&sel("text"))
                .filter(|e| attr_f64(*e, "y") == baseline)
                .map(text)
                .filter(|l| l.parse::<f64>().is_ok())
                .collect();
            assert_eq!(on_x_axis.len(), xs.len(), "{}: {on_x_axis:?}", f.display());
            for label in &on_x_axis {
                assert!(
                    xs.contains(label),
                    "{}: unmeasured tick {label}",
                    f.display()
                );
            }
            // A light grid: a line per tick, not a band of minor lines.
            let lines = doc.select(&sel("line")).count();
            assert!(lines < 40, "{}: {lines} lines", f.display());
        }
    }
    let cases_alone: usize = singles.values().filter(|&&n| n >= 2).sum();
    assert_eq!(single_rows, cases_alone);
}

#[test]
fn every_group_has_memory_and_error_figures() {
    let (_tmp, site) = build_site(&valid_dir());
    let doc = page(&site, "attention.html");
    let groups: Vec<ElementRef<'_>> = doc.select(&sel("section.group")).collect();
    assert_eq!(groups.len(), 4);
    for g in groups {
        let srcs: Vec<String> = g
            .select(&sel("figure img"))
            .map(|i| i.value().attr("src").unwrap().to_string())
            .collect();
        assert_eq!(srcs.len(), 5, "{srcs:?}");
        assert!(srcs[1].ends_with("-tflops.svg"), "{srcs:?}");
        assert!(srcs[2].ends_with("-ratio.svg"), "{srcs:?}");
        assert!(srcs[3].ends_with("-memory.svg") && srcs[4].ends_with("-error.svg"));
        let ratio = svg(&site.join(&srcs[2]));
        let legend = texts(&ratio);
        assert!(
            legend
                .iter()
                .any(|t| t.starts_with("1: as fast as the default")),
            "{legend:?}"
        );
        // Throughput on a linear axis, its unit from the document's declaration.
        let tput = svg(&site.join(&srcs[1]));
        let title = text(tput.select(&sel("svg > title")).next().unwrap());
        assert!(title.contains("TFLOP/s against seq_len"), "{title}");
        let desc = text(tput.select(&sel("svg > desc")).next().unwrap());
        assert!(desc.starts_with("Log-x plot of TFLOP/s"), "{desc}");
        let memory = svg(&site.join(&srcs[3]));
        let title = text(memory.select(&sel("svg > title")).next().unwrap());
        assert!(title.contains("peak memory against seq_len"), "{title}");
        let error = svg(&site.join(&srcs[4]));
        let desc = text(error.select(&sel("svg > desc")).next().unwrap());
        assert!(desc.contains("dashed line: tolerance"), "{desc}");
        assert!(
            texts(&error).iter().any(|t| t.starts_with("tolerance ")),
            "no tolerance in the legend"
        );
    }
}

#[test]
fn cases_that_did_not_run_are_crosses_named_in_the_legend() {
    let (_tmp, site) = build_site(&valid_dir());
    // The fixture has math out of memory at seq_len 4096 for head_dim=128, causal=false.
    let all: Vec<String> = figures(&site).iter().flat_map(|f| texts(&svg(f))).collect();
    assert!(
        all.iter()
            .any(|t| t == "math: did not run: oom at seq_len 4096"),
        "{all:?}"
    );
}

#[test]
fn every_figure_has_title_desc_and_a_dark_theme() {
    let (_tmp, site) = build_site(&root().join("data"));
    for f in figures(&site) {
        let doc = svg(&f);
        for part in ["svg > title", "svg > desc", "svg > style"] {
            assert!(
                doc.select(&sel(part)).next().is_some(),
                "{}: no {part}",
                f.display()
            );
        }
        let style = text(doc.select(&sel("svg > style")).next().unwrap());
        assert!(
            style.contains("prefers-color-scheme: dark"),
            "{}",
            f.display()
        );
        // The colours the dark rule recolours are the ones written.
        let s = fs::read_to_string(&f).unwrap();
        assert!(s.contains("fill=\"#1D1F21\"") && s.contains("fill=\"#FFFFFF\""));
    }
}

/// Every figure's `<img>` carries the width and height its SVG is drawn at (the page keeps its
/// place before it loads, and the layout test measures figures against them with images off),
/// and loads lazily, except the overview's chart at the top of its page. Checked on the
/// committed site (`tests/docgen/check.rs` fails when it is not what the data builds).
#[test]
fn every_img_has_its_svgs_size_and_loads_lazily_below_the_top() {
    let site = root().join("site");
    // The root element's width and height: its first tag, before any child.
    let svg_size = |path: &Path| -> (String, String) {
        let s = fs::read_to_string(path).unwrap();
        let start = s
            .find("<svg")
            .unwrap_or_else(|| panic!("{}: no <svg", path.display()));
        let tag = &s[start..start + s[start..].find('>').unwrap()];
        let attr = |name: &str| {
            let at = tag.find(&format!(" {name}=\"")).unwrap() + name.len() + 3;
            tag[at..at + tag[at..].find('"').unwrap()].to_string()
        };
        (attr("width"), attr("height"))
    };
    let mut checked = 0;
    for entry in fs::read_dir(&site).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "html") {
            continue;
        }
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let doc = Html::parse_document(&fs::read_to_string(&path).unwrap());
        for (i, img) in doc.select(&sel("img")).enumerate() {
            let src = img.value().attr("src").unwrap();
            let (w, h) = svg_size(&site.join(src));
            assert_eq!(
                (img.value().attr("width"), img.value().attr("height")),
                (Some(w.as_str()), Some(h.as_str())),
                "{name}: {src}"
            );
            let top = name == "index.html" && i == 0;
            assert_eq!(
                img.value().attr("loading"),
                (!top).then_some("lazy"),
                "{name}: {src}"
            );
            checked += 1;
        }
    }
    assert!(checked > 100, "{checked} figures");
}

/// The At a glance chart's bars: (left, right) pixel edges and fill.
fn bars(doc: &Html) -> Vec<(f64, f64, String)> {
    doc.select(&sel("rect"))
        .filter_map(|r| {
            let fill = r.value().attr("fill")?.to_string();
            // Bars, not the legend's swatches (10 px high).
            let tall = attr_f64(r, "height") > 12.0;
            (tall && (fill == "#0072B2" || fill == "#E69F00")).then(|| {
                let x = attr_f64(r, "x");
                (x, x + attr_f64(r, "width"), fill)
            })
        })
        .collect()
}

#[test]
fn at_a_glance_range_comes_from_the_data_and_holds_one() {
    let (_tmp, site) = build_site(&root().join("data"));
    let index = page(&site, "index.html");
    // (ratio, alternative) of each cell the chart plots.
    let representatives: Vec<(String, String)> = index
        .select(&sel("table.glance td.representative"))
        .filter_map(|td| {
            let span = td.select(&sel(".ratio")).next()?;
            Some((text(span), span.value().attr("data-other")?.to_string()))
        })
        .collect();
    let doc = svg(&site.join("figures/at-a-glance.svg"));
    let found = bars(&doc);
    assert_eq!(found.len(), representatives.len());
    assert!(!found.is_empty());
    let t = texts(&doc);
    let ticks: Vec<f64> = t.iter().filter_map(|s| s.parse::<f64>().ok()).collect();
    assert!(ticks.contains(&1.0), "{t:?}");
    assert!(ticks.iter().any(|v| *v < 1.0), "no tick left of 1: {t:?}");
    assert!(ticks.iter().any(|v| *v > 1.0), "no tick right of 1: {t:?}");
    // Every bar starts or ends at the line at 1 (the tick label "1" is centred on it).
    let one_x = doc
        .select(&sel("text"))
        .find(|e| text(*e) == "1")
        .map(|e| attr_f64(e, "x"))
        .unwrap();
    for (left, right, fill) in &found {
        let at_one = if fill == "#E69F00" { right } else { left };
        assert!((at_one - one_x).abs() <= 1.5, "{left}..{right} vs {one_x}");
    }
    // One label per representative row, naming the alternative and its ratio.
    for (ratio, alt) in &representatives {
        assert!(
            t.iter()
                .any(|s| s.contains(&format!("{ratio} vs {alt} (default "))),
            "no label for {ratio} vs {alt} in {t:?}"
        );
    }
    // Whiskers: three path pieces per bar with quartiles.
    assert!(doc.select(&sel("polyline")).count() >= 3 * found.len());
}

/// Writes `docs` as JSON files named by the keys into a fresh folder.
fn write_docs(docs: &BTreeMap<&str, Value>) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for (name, doc) in docs {
        fs::write(
            dir.path().join(name),
            serde_json::to_string_pretty(doc).unwrap(),
        )
        .unwrap();
    }
    dir
}

fn valid_json() -> Value {
    serde_json::from_str(&fs::read_to_string(valid_dir().join("gpu_attention.json")).unwrap())
        .unwrap()
}

#[test]
fn cpu_rows_are_marked_in_the_chart() {
    let mut doc = valid_json();
    doc["device"]["kind"] = Value::from("cpu");
    doc["device"]["name"] = Value::from("Test CPU");
    let data = write_docs(&BTreeMap::from([("cpu_attention.json", doc)]));
    let (_tmp, site) = build_site(data.path());
    let chart = svg(&site.join("figures/at-a-glance.svg"));
    let labels: Vec<String> = texts(&chart)
        .into_iter()
        .filter(|t| t.contains(" vs "))
        .collect();
    assert!(!labels.is_empty());
    assert!(labels.iter().all(|l| l.starts_with("[CPU] ")), "{labels:?}");
}

/// The valid fixture split into `n` shards the way `attention --shard i/n` splits the grid:
/// case `k` (in order of first appearance) goes to shard `k % n + 1`.
fn shards(n: usize) -> Vec<Value> {
    let whole = valid_json();
    let rows = whole["rows"].as_array().unwrap();
    let mut cases: Vec<&Value> = Vec::new();
    for r in rows {
        if !cases.contains(&&r["case"]) {
            cases.push(&r["case"]);
        }
    }
    (0..n)
        .map(|i| {
            let mut doc = whole.clone();
            let mine: Vec<Value> = rows
                .iter()
                .filter(|r| cases.iter().position(|c| *c == &r["case"]).unwrap() % n == i)
                .cloned()
                .collect();
            doc["rows"] = Value::from(mine);
            let mut command = doc["config"]["command"].as_array().unwrap().clone();
            command.push(Value::from("--shard"));
            command.push(Value::from(format!("{}/{n}", i + 1)));
            doc["config"]["command"] = Value::from(command);
            doc
        })
        .collect()
}

/// Text of every results table, by group title.
fn tables(site: &Path) -> BTreeMap<String, String> {
    let doc = page(site, "attention.html");
    doc.select(&sel("section.group"))
        .map(|g| {
            (
                text(g.select(&sel("h3")).next().unwrap()),
                text(g.select(&sel("table.results")).next().unwrap()),
            )
        })
        .collect()
}

#[test]
fn shards_of_one_device_merge_into_one_page() {
    let parts = shards(2);
    let data = write_docs(&BTreeMap::from([
        ("gpu_attention.json", parts[0].clone()),
        ("gpu_attention.shard2.json", parts[1].clone()),
    ]));
    let (_a, merged) = build_site(data.path());
    let (_b, whole) = build_site(&valid_dir());
    assert_eq!(tables(&merged), tables(&whole));
    let figure_names = |site: &Path| -> Vec<String> {
        figures(site)
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect()
    };
    assert_eq!(figure_names(&merged), figure_names(&whole));
    // One device section naming both files.
    let attention = page(&merged, "attention.html");
    let headings: Vec<String> = attention
        .select(&sel("main h2"))
        .map(text)
        .filter(|h| h != "How to reproduce")
        .collect();
    assert_eq!(headings.len(), 1, "{headings:?}");
    assert!(
        // The two shards of one command, not named alike: each file (shards named alike but
        // for their numbers read `a_1.json to a_2.json (2 shards)`).
        headings[0].contains("(gpu_attention.json, gpu_attention.shard2.json;"),
        "{headings:?}"
    );
    // The At a glance table is the whole one; each shard's command is listed to reproduce it.
    let glance = |site: &Path| {
        text(
            page(site, "index.html")
                .select(&sel("table.glance"))
                .next()
                .unwrap(),
        )
    };
    assert_eq!(glance(&merged), glance(&whole));
    let index = text(
        page(&merged, "index.html")
            .select(&sel("main"))
            .next()
            .unwrap(),
    );
    assert!(index.contains("--shard 1/2") && index.contains("--shard 2/2"));
}

#[test]
fn cases_merged_into_one_table_keep_each_cell_under_its_column() {
    let mut doc = valid_json();
    let rows = doc["rows"].as_array_mut().unwrap();
    let len = rows[0]["case"]["seq_len"].clone();
    // One size per group: every group is a single case, merged into one table.
    rows.retain(|r| r["case"]["seq_len"] == len);
    // math is the default at head_dim 128 (it sorts first there), flash at 64; torch_efficient
    // has no row at head_dim 64.
    for r in rows.iter_mut() {
        let d128 = r["case"]["head_dim"] == 128;
        let imp = r["implementation"].as_str().unwrap().to_string();
        r["default"] = serde_json::json!((imp == "math" && d128) || (imp == "flash" && !d128));
    }
    rows.retain(|r| !(r["implementation"] == "torch_efficient" && r["case"]["head_dim"] == 64));
    let data = write_docs(&BTreeMap::from([("gpu_attention.json", doc)]));
    let (_a, site) = build_site(data.path());
    let attention = page(&site, "attention.html");
    let table = attention
        .select(&sel("section.group"))
        .find(|g| {
            text(g.select(&sel("h3")).next().unwrap()).starts_with("Cases measured at one size")
        })
        .expect("a table of single cases");
    // Each column's implementation: the first text of its header cell.
    let header: Vec<String> = table
        .select(&sel("table.results thead th[scope=col]"))
        .skip(1)
        .map(|h| {
            h.text()
                .map(str::trim)
                .find(|t| !t.is_empty())
                .unwrap()
                .to_string()
        })
        .collect();
    assert!(
        header.contains(&"torch_efficient".to_string()),
        "{header:?}"
    );
    let mut n = 0;
    for row in table.select(&sel("table.results tbody tr")) {
        let cells: Vec<&str> = row
            .select(&sel("td"))
            .map(|c| c.value().attr("data-impl").unwrap())
            .collect();
        assert_eq!(cells.len(), header.len(), "{cells:?} under {header:?}");
        for (c, h) in cells.iter().zip(&header) {
            assert_eq!(c, h, "{cells:?} under {header:?}");
        }
        n += 1;
    }
    assert!(n >= 4, "{n} rows");
}

#[test]
fn a_column_a_part_of_the_run_left_out_stays_and_says_so() {
    // Two parts split by --filter: the causal part ran without torch_efficient.
    let whole = valid_json();
    let base = whole["config"]["command"].as_array().unwrap().clone();
    let part = |causal: bool| {
        let mut doc = whole.clone();
        let rows: Vec<Value> = whole["rows"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["case"]["causal"] == causal)
            .filter(|r| !(causal && r["implementation"] == "torch_efficient"))
            .cloned()
            .collect();
        doc["rows"] = Value::from(rows);
        let mut c = base.clone();
        c.push(Value::from("--filter"));
        c.push(Value::from(format!("causal={causal}")));
        doc["config"]["command"] = Value::from(c);
        doc
    };
    let data = write_docs(&BTreeMap::from([
        ("a.json", part(false)),
        ("b.json", part(true)),
    ]));
    let (_a, site) = build_site(data.path());
    let attention = page(&site, "attention.html");
    let mut causal_groups = 0;
    for g in attention.select(&sel("section.group")) {
        let title = text(g.select(&sel("h3")).next().unwrap());
        if !title.contains("causal=true") {
            continue;
        }
        causal_groups += 1;
        let cells: Vec<String> = g
            .select(&sel("table.results td[data-impl=\"torch_efficient\"]"))
            .map(text)
            .collect();
        assert!(!cells.is_empty(), "{title}: the column was dropped");
        assert!(
            cells
                .iter()
                .all(|c| c.contains("measured no case with this implementation")),
            "{cells:?}"
        );
    }
    assert!(causal_groups > 0);
}

#[test]
fn a_group_has_no_column_for_an_implementation_without_rows_in_it() {
    let mut doc = valid_json();
    let rows = doc["rows"].as_array_mut().unwrap();
    let in_group = |r: &Value| r["case"]["head_dim"] == 64 && r["case"]["causal"] == false;
    rows.retain(|r| !(r["implementation"] == "torch_efficient" && in_group(r)));
    let data = write_docs(&BTreeMap::from([("gpu_attention.json", doc)]));
    let (_a, site) = build_site(data.path());
    let attention = page(&site, "attention.html");
    let mut with = 0;
    let mut without = 0;
    for g in attention.select(&sel("section.group")) {
        let title = text(g.select(&sel("h3")).next().unwrap());
        let has = g
            .select(&sel("table.results td[data-impl=\"torch_efficient\"]"))
            .next()
            .is_some();
        if title.contains("head_dim=64") && title.contains("causal=false") {
            assert!(
                !has,
                "{title}: a column of cells that could only say `not measured`"
            );
            without += 1;
        } else {
            assert!(has, "{title}");
            with += 1;
        }
    }
    assert!(with > 0 && without > 0, "{with} {without}");
}

#[test]
fn merged_shards_take_shares_of_the_highest_ceiling_they_measured() {
    let ceiling = |doc: &mut Value, v: f64| {
        doc["config"]["throughput"][0]["ceiling"] =
            serde_json::json!({"value": v, "source": "a GEMM at the start of this run"});
    };
    let mut parts = shards(2);
    ceiling(&mut parts[0], 500.0);
    ceiling(&mut parts[1], 600.0);
    let data = write_docs(&BTreeMap::from([
        ("gpu_attention.json", parts[0].clone()),
        ("gpu_attention.shard2.json", parts[1].clone()),
    ]));
    let mut whole = valid_json();
    ceiling(&mut whole, 600.0);
    let whole_data = write_docs(&BTreeMap::from([("gpu_attention.json", whole)]));
    let (_a, merged) = build_site(data.path());
    let (_b, whole) = build_site(whole_data.path());
    // Every share is of 600, as in one run that measured 600, and the tables say so.
    assert_eq!(tables(&merged), tables(&whole));
    let attention = text(
        page(&merged, "attention.html")
            .select(&sel("main"))
            .next()
            .unwrap(),
    );
    assert!(attention.contains("share of 600 TFLOP/s"), "{attention}");
    assert!(tables(&merged).values().any(|t| t.contains('%')));
    let svgs: String = figures(&merged)
        .iter()
        .map(|p| std::fs::read_to_string(p).unwrap())
        .collect();
    assert!(
        svgs.contains("the highest of the 2 measurements of the 2 parts")
            && svgs.contains("500 to 600"),
        "no figure names the parts' range"
    );
}

/// The text of every missing cell of the Attention page built from two shards, `parts[0]` and
/// `parts[1]`.
fn missing_cells_of_two_shards(parts: &[Value]) -> Vec<String> {
    let data = write_docs(&BTreeMap::from([
        ("gpu_attention.json", parts[0].clone()),
        ("gpu_attention.shard2.json", parts[1].clone()),
    ]));
    let (_tmp, site) = build_site(data.path());
    page(&site, "attention.html")
        .select(&sel("table.results td.missing"))
        .map(text)
        .collect()
}

/// A shard cut off by a time limit (no `finished_at`) leaves the cells it never reached
/// "not measured" with that reason; a missing cell of a finished shard (here shard 1, merged
/// with the cut-off shard 2) gives none.
#[test]
fn cells_a_cut_off_shard_never_reached_say_so() {
    let reason = kernelpages::site::model::CUT_OFF;
    // (missing cells giving the reason, missing cells not giving it)
    let build = |cut: bool| {
        let mut parts = shards(2);
        for part in parts.iter_mut() {
            part["rows"].as_array_mut().unwrap().pop();
        }
        if cut {
            parts[1]["config"]
                .as_object_mut()
                .unwrap()
                .remove("finished_at");
        }
        let missing = missing_cells_of_two_shards(&parts);
        let with = missing.iter().filter(|c| c.contains(reason)).count();
        (with, missing.len() - with)
    };
    let (with, without) = build(true);
    assert!(with >= 1, "the cut-off shard's cell says so");
    assert!(without >= 1, "the finished shard's cell does not");
    assert_eq!(
        build(false),
        (0, with + without),
        "no run cut off, no reason"
    );
}

/// Parts of one run may compare different alternatives (an expensive one left to some parts):
/// the site builds, and a cell of an implementation that the part holding its case never ran
/// says so with that part's command, while the other part's cells keep their numbers.
#[test]
fn parts_comparing_different_alternatives_say_which_part_left_a_cell_out() {
    let mut parts = shards(2);
    let left_out = parts[1]["rows"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["default"] == false)
        .expect("an alternative's row")["implementation"]
        .as_str()
        .unwrap()
        .to_string();
    let rows = parts[1]["rows"].as_array_mut().unwrap();
    let before = rows.len();
    rows.retain(|r| r["implementation"] != left_out.as_str());
    assert!(rows.len() < before);
    let command = parts[1]["config"]["command"].as_array_mut().unwrap();
    command.push(Value::from("--exclude"));
    command.push(Value::from(left_out.as_str()));
    let missing = missing_cells_of_two_shards(&parts);
    let says = missing
        .iter()
        .filter(|c| {
            c.contains("measured no case with this implementation")
                && c.contains(&format!("--exclude {left_out}"))
                && c.contains("--shard 2/2")
        })
        .count();
    assert!(says >= 1, "{missing:?}");
    // Shard 1 measured the implementation: none of its cells points at shard 2's command.
    assert!(
        !missing.iter().any(|c| c.contains("--shard 1/2")),
        "{missing:?}"
    );
    // The same alternatives left out by a second run of the same cases is still two runs.
    let mut again = valid_json();
    let command = again["config"]["command"].as_array_mut().unwrap();
    command.push(Value::from("--exclude"));
    command.push(Value::from(left_out.as_str()));
    let data = write_docs(&BTreeMap::from([
        ("gpu_attention.json", valid_json()),
        ("gpu_attention.again.json", again),
    ]));
    let out = tempfile::tempdir().unwrap();
    let opts = BuildOptions {
        data_dir: data.path().to_path_buf(),
        out_dir: out.path().join("site"),
        base_url: None,
        templates_dir: None,
    };
    let err = site::build(&opts).err().map(|e| format!("{e:#}"));
    assert!(
        err.as_deref()
            .is_some_and(|e| e.contains("not shards of one run")),
        "{err:?}"
    );
}

#[test]
fn shards_of_two_devices_are_two_sections_of_one_page() {
    let mut parts = shards(2);
    parts[1]["device"]["name"] = Value::from("Second Test GPU");
    let data = write_docs(&BTreeMap::from([
        ("gpu_attention.json", parts[0].clone()),
        ("gpu_attention.gpu2.json", parts[1].clone()),
    ]));
    let (_tmp, site) = build_site(data.path());
    let attention = page(&site, "attention.html");
    let headings: Vec<String> = attention
        .select(&sel("main h2"))
        .map(text)
        .filter(|h| h != "How to reproduce")
        .collect();
    assert_eq!(headings.len(), 2, "{headings:?}");
    assert!(headings.iter().any(|h| h.contains("Second Test GPU")));
}

#[test]
fn conflicting_shards_name_both_files() {
    let mut parts = shards(2);
    // The first row of shard 1 again in shard 2, with another time.
    let mut dup = parts[0]["rows"][0].clone();
    dup["median_ms"] = Value::from(dup["median_ms"].as_f64().unwrap() * 2.0);
    dup["q3_ms"] = Value::from(dup["q3_ms"].as_f64().unwrap() * 2.0);
    parts[1]["rows"].as_array_mut().unwrap().push(dup);
    let data = write_docs(&BTreeMap::from([
        ("gpu_attention.json", parts[0].clone()),
        ("gpu_attention.shard2.json", parts[1].clone()),
    ]));
    let err = load::load_dir(data.path()).unwrap_err();
    let s = format!("{err:#}");
    assert!(
        s.contains("gpu_attention.json") && s.contains("gpu_attention.shard2.json"),
        "{s}"
    );
    let tmp = tempfile::tempdir().unwrap();
    let opts = BuildOptions {
        data_dir: data.path().to_path_buf(),
        out_dir: tmp.path().join("site"),
        base_url: None,
        templates_dir: None,
    };
    assert!(site::build(&opts).is_err());
    assert!(!tmp.path().join("site").exists());
}

/// Text in every figure is at least 11 px at the size the page shows it (figures are shown at
/// the size they are drawn: tests/docgen/layout.rs).
#[test]
fn every_figure_text_is_at_least_11_px() {
    let (_tmp, site) = build_site(&root().join("data"));
    let mut sizes = 0;
    for f in figures(&site) {
        let text = fs::read_to_string(&f).unwrap();
        for part in text.split("font-size=\"").skip(1) {
            let size: f64 = part.split('"').next().unwrap().parse().unwrap();
            assert!(size >= 11.0, "{}: font-size {size}", f.display());
            sizes += 1;
        }
    }
    assert!(sizes > 100, "{sizes}");
}

/// The table of cases measured at one size has a bar chart: at most one bar per case of the
/// table, each label a case of the table against one of the table's implementations.
#[test]
fn cases_measured_at_one_size_have_a_ratio_chart() {
    let (_tmp, site) = build_site(&root().join("data"));
    let attention = page(&site, "attention.html");
    let group = attention
        .select(&sel("section.group"))
        .find(|g| {
            g.select(&sel("h3"))
                .next()
                .is_some_and(|h| text(h).starts_with("Cases measured at one size"))
        })
        .expect("the committed attention data has cases measured at one size");
    let cases: BTreeSet<String> = group
        .select(&sel("table.results tbody th[scope=row]"))
        .map(text)
        .collect();
    let columns: BTreeSet<String> = group.select(&sel("table thead th")).map(text).collect();
    let src = group
        .select(&sel("figure img"))
        .filter_map(|i| i.value().attr("src"))
        .find(|s| s.ends_with("-cases.svg"))
        .expect("a chart of the cases");
    let doc = svg(&site.join(src));
    let found = bars(&doc);
    assert!(!found.is_empty());
    assert!(
        found.len() <= cases.len(),
        "{} bars, {} cases",
        found.len(),
        cases.len()
    );
    for (left, right, fill) in &found {
        assert!(left < right, "{left}..{right} {fill}");
    }
    let desc: String = doc.select(&sel("desc")).map(text).collect();
    let mut named = 0;
    for case in &cases {
        let key = format!("{case}: vs ");
        // The first label follows the description's opening words and a colon.
        let at = |p: &str| {
            p.find(&key)
                .filter(|&i| i == 0 || p[..i].ends_with(": "))
                .map(|i| i + key.len())
        };
        for (part, start) in desc.split("; ").filter_map(|p| Some((p, at(p)?))) {
            let alt = part[start..]
                .split_whitespace()
                .next()
                .unwrap_or_default()
                .trim_end_matches('.');
            assert!(
                columns.iter().any(|c| c.starts_with(alt)),
                "{alt} is not a column: {columns:?}"
            );
            named += 1;
        }
    }
    assert_eq!(
        named,
        found.len(),
        "labels naming a case of the table, bars"
    );
}
