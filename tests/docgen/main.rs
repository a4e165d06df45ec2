//! End-to-end tests of `docgen build`: a site is built from the fixture documents into a
//! temporary folder and its pages and figures are parsed (scraper), not grepped.

// The site's other integration tests, one module per concern, in this one test binary: one
// link instead of ten, and CI's two cores run the tests of all of them side by side.
mod check;
mod figures;
mod fixtures;
mod layout;
mod loading;
mod output;
mod prose;
mod screenshot;
mod serve;

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use kernelpages::load::{self, case_label};
use kernelpages::schema::{Row, Status};
use kernelpages::site::{self, format, BuildOptions};
use scraper::{ElementRef, Html, Selector};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn valid_dir() -> PathBuf {
    fixtures().join("valid")
}

/// Builds a site from `data` into a fresh temporary folder; returns the folder and the site.
fn build_site(data: &Path, base_url: Option<&str>) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("site");
    let opts = BuildOptions {
        data_dir: data.to_path_buf(),
        out_dir: out.clone(),
        base_url: base_url.map(String::from),
        templates_dir: None,
    };
    site::build(&opts).unwrap_or_else(|e| panic!("build failed: {e:#}"));
    (tmp, out)
}

/// Headless Chromium on `PATH` (`chromium`, `chromium-browser` or `google-chrome`), for the
/// layout and screenshot tests (build.rs's `kp_chromium` says whether there is one).
fn chromium() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    ["chromium", "chromium-browser", "google-chrome"]
        .iter()
        .flat_map(|name| std::env::split_paths(&path).map(move |d| d.join(name)))
        .find(|p| p.is_file())
}

/// The flags both browser tests start Chromium with: headless, without a sandbox, the GPU or
/// anything fetched from the network.
const CHROMIUM_FLAGS: [&str; 8] = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
];

/// The page `name` of the site in `site`, parsed.
fn page(site: &Path, name: &str) -> Html {
    let text = fs::read_to_string(site.join(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
    Html::parse_document(&text)
}

fn sel(s: &str) -> Selector {
    Selector::parse(s).unwrap()
}

fn text(e: ElementRef<'_>) -> String {
    e.text()
        .collect::<String>()
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

/// Every file under `dir`, relative path -> bytes.
fn snapshot(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.insert(
                    p.strip_prefix(dir).unwrap().to_path_buf(),
                    fs::read(&p).unwrap(),
                );
            }
        }
    }
    out
}

const PAGES: [&str; 5] = [
    "index.html",
    "attention.html",
    "mixers.html",
    "models.html",
    "hopper.html",
];

#[test]
fn index_has_six_sections_and_four_page_links() {
    let (_tmp, site) = build_site(&valid_dir(), None);
    let doc = page(&site, "index.html");
    let h1 = doc.select(&sel("h1")).next().unwrap();
    assert_eq!(text(h1), "GPU performance");
    let headings: Vec<String> = doc.select(&sel("main > section > h2")).map(text).collect();
    assert_eq!(
        headings,
        [
            "At a glance",
            "Setup",
            "Methodology",
            "What runs by default",
            "Known limitations",
            "How to reproduce"
        ]
    );
    let links: BTreeSet<String> = doc
        .select(&sel("nav.pages a"))
        .filter_map(|a| a.value().attr("href").map(String::from))
        .collect();
    for p in [
        "attention.html",
        "mixers.html",
        "models.html",
        "hopper.html",
    ] {
        assert!(links.contains(p), "missing link to {p}: {links:?}");
    }
}

#[test]
fn attention_tables_show_the_fixture_values() {
    let (_tmp, site) = build_site(&valid_dir(), None);
    let docs = load::load_dir(&valid_dir()).unwrap();
    let rows: Vec<&Row> = docs.iter().flat_map(|l| l.doc.rows.iter()).collect();
    let doc = page(&site, "attention.html");
    // Group sections by their title (every parameter but seq_len).
    let mut groups = BTreeMap::new();
    for g in doc.select(&sel("section.group")) {
        groups.insert(text(g.select(&sel("h3")).next().unwrap()), g);
    }
    assert_eq!(groups.len(), 4, "{:?}", groups.keys());
    let impls: BTreeSet<&str> = rows.iter().map(|r| r.implementation.as_str()).collect();
    for (title, g) in &groups {
        let headers: Vec<String> = g.select(&sel("th.impl")).map(text).collect();
        for i in &impls {
            assert!(
                headers.iter().any(|h| h.starts_with(i)),
                "{title}: no column {i} in {headers:?}"
            );
        }
        let default = g
            .select(&sel("th.impl.default"))
            .map(text)
            .collect::<Vec<_>>();
        assert_eq!(default.len(), 1);
        assert!(
            default[0].starts_with("flash") && default[0].contains("default"),
            "{default:?}"
        );
    }
    let cell = |r: &Row| {
        let mut params = r.case.clone();
        let seq_len = params.remove("seq_len").unwrap().to_string();
        let g = groups
            .get(&case_label(&params))
            .unwrap_or_else(|| panic!("no group for {:?}", r.case));
        let tr = g
            .select(&sel("table.results tbody tr"))
            .find(|tr| text(tr.select(&sel("th")).next().unwrap()) == seq_len)
            .unwrap_or_else(|| panic!("no row {seq_len}"));
        let sel_td = format!("td[data-impl=\"{}\"]", r.implementation);
        tr.select(&sel(&sel_td)).next().unwrap()
    };
    let detail = |r: &Row| {
        let mut params = r.case.clone();
        let seq_len = params.remove("seq_len").unwrap().to_string();
        let g = &groups[&case_label(&params)];
        g.select(&sel("table.details tbody tr"))
            .find(|tr| {
                let tds: Vec<String> = tr.select(&sel("td")).map(text).collect();
                tds[0] == seq_len && tds[1] == r.implementation
            })
            .unwrap_or_else(|| panic!("no details for {:?}", r.case))
    };
    let mut seen = BTreeSet::new();
    for r in &rows {
        let td = cell(r);
        let first = |s: &str| td.select(&sel(s)).next().map(text);
        match r.status {
            Status::Ok => {
                assert_eq!(
                    first(".median"),
                    Some(format::ms(r.median_ms.unwrap())),
                    "{r:?}"
                );
                let tflops = r.flops.unwrap() / (r.median_ms.unwrap() * 1e-3) / 1e12;
                assert_eq!(first(".throughput"), Some(format::sig(tflops, 3)));
                let acc = r.accuracy.as_ref().unwrap();
                assert_eq!(
                    td.select(&sel(".relerr.bad")).next().is_some(),
                    acc.rel_err > acc.tolerance
                );
                // Spread and error in the group's details table.
                let d = detail(r);
                let col = |i: usize| text(d.select(&sel("td")).nth(i).unwrap());
                assert_eq!(col(2), format::iqr(r.q1_ms.unwrap(), r.q3_ms.unwrap()));
                assert_eq!(col(3), format::rel_err(acc.rel_err));
                assert_eq!(
                    d.select(&sel("td.relerr.bad")).next().is_some(),
                    acc.rel_err > acc.tolerance
                );
            }
            other => {
                assert_eq!(first(".status"), Some(other.as_str().to_string()));
                assert_eq!(first(".message"), r.message.clone());
            }
        }
        seen.insert(r.status.as_str());
    }
    assert!(seen.contains("oom") && seen.contains("unsupported"));
    // A (case, implementation) pair without a row says so, and why: the run measured the
    // implementation on other cases only.
    let missing: Vec<String> = doc.select(&sel("td.missing")).map(text).collect();
    assert!(!missing.is_empty());
    assert!(
        missing.iter().all(|m| m.starts_with("not measured")
            && m.ends_with(kernelpages::site::model::suite::ELSEWHERE_ONLY)),
        "{missing:?}"
    );
    // Details tables (spread, error, compile time, memory) are there.
    assert!(doc.select(&sel("table.details")).next().is_some());
}

#[test]
fn at_a_glance_ratio_comes_from_the_data() {
    let (_tmp, site) = build_site(&valid_dir(), None);
    let docs = load::load_dir(&valid_dir()).unwrap();
    let doc = page(&site, "index.html");
    let all: Vec<&Row> = docs.iter().flat_map(|l| l.doc.rows.iter()).collect();
    let headers: Vec<String> = doc
        .select(&sel("table.glance thead th"))
        .map(text)
        .collect();
    let mut seen = 0;
    for tr in doc.select(&sel("table.glance tbody tr")) {
        let group = text(tr.select(&sel("th")).next().unwrap());
        for (i, td) in tr.select(&sel("td")).skip(1).enumerate() {
            let Some(span) = td.select(&sel(".ratio")).next() else {
                continue;
            };
            let x = headers[i + 2].trim_start_matches("seq_len ").to_string();
            let other = span.value().attr("data-other").unwrap();
            // Recompute: fastest ok, accurate non-default over default, same group and size.
            let same = |r: &&&Row| {
                let mut p = r.case.clone();
                let rx = p.remove("seq_len").unwrap().to_string();
                group.split(", ").all(|g| case_label(&p).contains(g)) && rx == x
            };
            let in_case: Vec<&&Row> = all.iter().filter(same).collect();
            let d = in_case.iter().find(|r| r.default).unwrap();
            assert_eq!(
                span.value().attr("data-reference"),
                Some(d.implementation.as_str())
            );
            let best = in_case
                .iter()
                .filter(|r| !r.default && r.status == Status::Ok)
                .filter(|r| {
                    r.accuracy
                        .as_ref()
                        .is_some_and(|a| a.rel_err <= a.tolerance)
                })
                .map(|r| (r.median_ms.unwrap(), r.implementation.clone()))
                .min_by(|a, b| a.0.total_cmp(&b.0))
                .unwrap();
            assert_eq!(other, best.1);
            let r = best.0 / d.median_ms.unwrap();
            assert_eq!(text(span), format::ratio(r));
            let words = format::time_ratio_words(r, r, &d.implementation);
            assert!(text(td).contains(&words), "{}", text(td));
            seen += 1;
        }
    }
    assert!(seen > 10, "{seen}");
    assert!(site.join("figures/at-a-glance.svg").is_file());
}

/// Tags open and close in order (self-closing and `<?...?>` ignored): a well-formedness check.
fn assert_balanced_xml(name: &str, s: &str) {
    let mut stack: Vec<String> = Vec::new();
    let mut rest = s;
    while let Some(i) = rest.find('<') {
        rest = &rest[i + 1..];
        let end = rest
            .find('>')
            .unwrap_or_else(|| panic!("{name}: unclosed tag"));
        let tag = &rest[..end];
        rest = &rest[end + 1..];
        if tag.starts_with('?') || tag.starts_with('!') || tag.ends_with('/') {
            continue;
        }
        let tag_name = |t: &str| t.split_whitespace().next().unwrap_or("").to_string();
        if let Some(closing) = tag.strip_prefix('/') {
            assert_eq!(
                stack.pop().as_deref(),
                Some(closing),
                "{name}: mismatched </{closing}>"
            );
        } else {
            stack.push(tag_name(tag));
        }
    }
    assert!(stack.is_empty(), "{name}: unclosed {stack:?}");
}

#[test]
fn figures_are_svg_with_title_and_desc() {
    let (_tmp, site) = build_site(&valid_dir(), None);
    let figures: Vec<PathBuf> = fs::read_dir(site.join("figures"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    // Five per group (time, TFLOP/s, ratio to the default, peak memory, relative error) plus
    // the At a glance chart.
    assert_eq!(figures.len(), 21, "{figures:?}");
    for f in figures {
        let s = fs::read_to_string(&f).unwrap();
        assert_balanced_xml(&f.display().to_string(), &s);
        let svg = Html::parse_fragment(&s);
        assert!(svg.select(&sel("svg")).next().is_some(), "{}", f.display());
        let title = svg
            .select(&sel("svg > title"))
            .next()
            .map(text)
            .unwrap_or_default();
        assert!(!title.is_empty(), "{} has no <title>", f.display());
        assert!(svg.select(&sel("svg > desc")).next().is_some());
    }
}

#[test]
fn script_in_a_message_is_shown_as_text() {
    let (_tmp, site) = build_site(&valid_dir(), None);
    for name in PAGES {
        let doc = page(&site, name);
        assert!(
            doc.select(&sel("script")).next().is_none(),
            "{name} has a <script> element"
        );
    }
    let doc = page(&site, "attention.html");
    let messages: Vec<String> = doc.select(&sel(".message")).map(text).collect();
    assert!(
        messages
            .iter()
            .any(|m| m.contains("<script>alert(1)</script>")),
        "{messages:?}"
    );
}

#[test]
fn every_internal_link_and_asset_exists() {
    let (_tmp, site) = build_site(&valid_dir(), None);
    let mut checked = 0;
    for name in PAGES {
        let doc = page(&site, name);
        for e in doc.select(&sel("a[href], img[src], link[href]")) {
            let target = e.value().attr("href").or(e.value().attr("src")).unwrap();
            if target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            let (file, fragment) = match target.split_once('#') {
                Some((f, frag)) => (if f.is_empty() { name } else { f }, Some(frag)),
                None => (target, None),
            };
            let path = site.join(file);
            assert!(path.is_file(), "{name} links to missing {target}");
            if let Some(frag) = fragment {
                let linked = page(&site, file);
                let id = format!("[id=\"{frag}\"]");
                assert!(
                    linked.select(&sel(&id)).next().is_some(),
                    "{name}: no #{frag} in {file}"
                );
            }
            checked += 1;
        }
    }
    assert!(checked > 20, "only {checked} links checked");
}

#[test]
fn base_url_prefixes_internal_links() {
    let (_tmp, site) = build_site(&valid_dir(), Some("/perf"));
    let doc = page(&site, "index.html");
    for e in doc.select(&sel("header nav a[href], link[href], img[src]")) {
        let target = e.value().attr("href").or(e.value().attr("src")).unwrap();
        assert!(target.starts_with("/perf/"), "{target}");
    }
    // The table of contents links within the page.
    for e in doc.select(&sel("nav.toc a[href]")) {
        assert!(e.value().attr("href").unwrap().starts_with('#'));
    }
}

#[test]
fn two_builds_are_byte_identical() {
    let (_a, site_a) = build_site(&valid_dir(), None);
    let (_b, site_b) = build_site(&valid_dir(), None);
    let (a, b) = (snapshot(&site_a), snapshot(&site_b));
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    for (k, v) in &a {
        assert!(v == &b[k], "{} differs between builds", k.display());
    }
}

fn docgen() -> Command {
    Command::new(env!("CARGO_BIN_EXE_docgen"))
}

#[test]
fn malformed_document_fails_and_leaves_the_site_alone() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("site");
    // A previous site docgen wrote, so that only the data can make the build fail.
    assert!(docgen()
        .arg("build")
        .arg("--data")
        .arg(valid_dir())
        .arg("--out")
        .arg(&out)
        .status()
        .unwrap()
        .success());
    let before = snapshot(&out);
    for case in fs::read_dir(fixtures().join("invalid")).unwrap() {
        let data = case.unwrap().path();
        let output = docgen()
            .arg("build")
            .arg("--data")
            .arg(&data)
            .arg("--out")
            .arg(&out)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            !output.status.success(),
            "{}: build succeeded",
            data.display()
        );
        assert!(stderr.starts_with("Error: "), "{stderr}");
        assert!(
            stderr.contains("gpu_attention"),
            "{}: {stderr}",
            data.display()
        );
        assert_eq!(snapshot(&out), before, "{}: site changed", data.display());
        let leftovers: Vec<_> = fs::read_dir(tmp.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(leftovers.len(), 1, "temporary folders left: {leftovers:?}");
    }
    // The truncated document's error carries file:line:column.
    let data = fixtures().join("invalid/truncated");
    let output = docgen()
        .arg("build")
        .arg("--data")
        .arg(&data)
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    let after = stderr
        .split("gpu_attention.json:")
        .nth(1)
        .unwrap_or_else(|| panic!("{stderr}"));
    let mut parts = after.splitn(3, ':');
    let line: usize = parts
        .next()
        .unwrap()
        .parse()
        .unwrap_or_else(|_| panic!("no line in {stderr}"));
    let column: usize = parts
        .next()
        .unwrap()
        .parse()
        .unwrap_or_else(|_| panic!("no column in {stderr}"));
    assert!(line > 1 && column > 0);
}

#[test]
fn duplicate_rows_name_both_files() {
    let err = load::load_dir(&fixtures().join("invalid/duplicate")).unwrap_err();
    let s = format!("{err:#}");
    assert!(
        s.contains("gpu_attention.json") && s.contains("gpu_attention_rerun.json"),
        "{s}"
    );
}

#[test]
fn successful_build_replaces_the_previous_site() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("site");
    fs::create_dir_all(&out).unwrap();
    // A site an earlier docgen wrote: its manifest lists the page that is no longer built.
    fs::write(out.join("stale.html"), "old").unwrap();
    fs::write(
        out.join(".docgen-manifest.json"),
        r#"{"generator": "docgen", "data_sha256": "", "templates_sha256": "",
            "templates": "built-in", "files": ["stale.html"]}"#,
    )
    .unwrap();
    let status = docgen()
        .arg("build")
        .arg("--data")
        .arg(valid_dir())
        .arg("--out")
        .arg(&out)
        .status()
        .unwrap();
    assert!(status.success());
    assert!(!out.join("stale.html").exists());
    assert!(out.join("index.html").is_file());
    let entries: Vec<_> = fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(entries, vec![std::ffi::OsString::from("site")]);
}

#[test]
fn pages_without_data_say_not_measured_yet() {
    let (_tmp, site) = build_site(&valid_dir(), None);
    for name in ["mixers.html", "models.html"] {
        let body = text(page(&site, name).select(&sel("main")).next().unwrap());
        assert!(
            body.to_lowercase().contains("not measured yet"),
            "{name}: {body}"
        );
        // Every suite of the mixers page has a runner (MoE's since issue 14); the Models
        // page's does not exist yet.
        if name == "models.html" {
            assert!(
                body.contains("runner for this suite does not exist yet"),
                "{name}: {body}"
            );
        } else {
            assert!(
                body.contains("--bin moe -- --compare torch"),
                "{name}: {body}"
            );
        }
        // No claim that the page's figures come from data it does not have.
        let footer = text(page(&site, name).select(&sel("footer")).next().unwrap());
        assert!(!footer.contains("Every figure on this page"), "{footer}");
    }
    let attention = text(
        page(&site, "attention.html")
            .select(&sel("footer"))
            .next()
            .unwrap(),
    );
    assert!(
        attention.contains("Every figure on this page"),
        "{attention}"
    );
}

/// Runs `docgen build` on `data` into a fresh folder; returns (exit code, stderr, out).
fn build_cli(data: &Path) -> (Option<i32>, String, tempfile::TempDir) {
    let tmp = tempfile::tempdir().unwrap();
    let out = docgen()
        .arg("build")
        .arg("--data")
        .arg(data)
        .arg("--out")
        .arg(tmp.path().join("site"))
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
        tmp,
    )
}

#[test]
fn a_data_folder_without_documents_is_an_error() {
    // Empty but for the schema file.
    let data = tempfile::tempdir().unwrap();
    load::write_schema(data.path()).unwrap();
    let (code, stderr, tmp) = build_cli(data.path());
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("no suite documents in"), "{stderr}");
    assert!(!tmp.path().join("site").exists());
    // Only documents with no rows.
    let text = fs::read_to_string(valid_dir().join("gpu_attention.json")).unwrap();
    let mut doc: serde_json::Value = serde_json::from_str(&text).unwrap();
    doc["rows"] = serde_json::json!([]);
    fs::write(data.path().join("gpu_attention.json"), doc.to_string()).unwrap();
    let (code, stderr, _tmp) = build_cli(data.path());
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("no suite documents in"), "{stderr}");
    assert!(stderr.contains("with no rows"), "{stderr}");
}

#[test]
fn extensions_match_case_insensitively_and_folders_are_read_recursively() {
    let data = tempfile::tempdir().unwrap();
    fs::create_dir_all(data.path().join("h200/logs")).unwrap();
    fs::copy(
        valid_dir().join("gpu_attention.json"),
        data.path().join("h200/GPU.JSON"),
    )
    .unwrap();
    // Logs are never read, whatever they hold.
    fs::write(data.path().join("h200/logs/broken.json"), "{").unwrap();
    load::write_schema(data.path()).unwrap();
    let docs = load::load_dir(data.path()).unwrap();
    assert_eq!(docs.len(), 1);
    assert_eq!(docs[0].file_name(), "h200/GPU.JSON");
}

#[test]
fn two_runs_of_one_suite_on_one_device_are_refused_with_both_paths() {
    let data = tempfile::tempdir().unwrap();
    let text = fs::read_to_string(valid_dir().join("gpu_attention.json")).unwrap();
    let mut doc: serde_json::Value = serde_json::from_str(&text).unwrap();
    let rows = doc["rows"].as_array().unwrap().clone();
    let (a, b) = rows.split_at(rows.len() / 2);
    doc["rows"] = serde_json::json!(a);
    fs::write(data.path().join("first.json"), doc.to_string()).unwrap();
    doc["rows"] = serde_json::json!(b);
    fs::write(data.path().join("second.json"), doc.to_string()).unwrap();
    let err = load::load_dir(data.path()).unwrap_err().to_string();
    assert!(
        err.contains("first.json") && err.contains("second.json") && err.contains("not shards"),
        "{err}"
    );
    // The same halves written as two shards of one run load together.
    let original = doc["config"]["command"].as_array().unwrap().clone();
    let command = |i: u32| {
        let mut c = original.clone();
        c.extend([
            serde_json::json!("--shard"),
            serde_json::json!(format!("{i}/2")),
        ]);
        c
    };
    doc["rows"] = serde_json::json!(a);
    doc["config"]["command"] = serde_json::json!(command(1));
    fs::write(data.path().join("first.json"), doc.to_string()).unwrap();
    doc["rows"] = serde_json::json!(b);
    doc["config"]["command"] = serde_json::json!(command(2));
    fs::write(data.path().join("second.json"), doc.to_string()).unwrap();
    let loaded = load::load_dir(data.path()).unwrap();
    assert_eq!(loaded.len(), 2);
    assert!(loaded.iter().all(|l| l.missing_shards.is_empty()));
}

/// The text of the body of page `name` of the site in `site`.
fn text_of(site: &Path, name: &str) -> String {
    let html = page(site, name);
    let body = html.select(&sel("body")).next().unwrap();
    text(body)
}

/// A document without `finished_at` (its run stopped early, as a runner killed by its time
/// limit leaves it): the Attention page and the overview's Known limitations say the run
/// stopped before it finished; with `finished_at` back, neither does.
#[test]
fn a_run_that_stopped_early_is_named_on_the_pages() {
    let source = fs::read_to_string(valid_dir().join("gpu_attention.json")).unwrap();
    let mut doc: serde_json::Value = serde_json::from_str(&source).unwrap();
    let said = "The run stopped before it finished";
    let data = tempfile::tempdir().unwrap();
    assert!(
        doc["config"]["finished_at"].is_string(),
        "the fixture finished"
    );
    fs::write(data.path().join("gpu_attention.json"), doc.to_string()).unwrap();
    let (_tmp, site) = build_site(data.path(), None);
    assert!(!text_of(&site, "attention.html")
        .to_lowercase()
        .contains(&said.to_lowercase()));
    doc["config"].as_object_mut().unwrap().remove("finished_at");
    fs::write(data.path().join("gpu_attention.json"), doc.to_string()).unwrap();
    let (_tmp2, site) = build_site(data.path(), None);
    for name in ["attention.html", "index.html"] {
        let t = text_of(&site, name).to_lowercase();
        assert!(t.contains(&said.to_lowercase()), "{name}: {t}");
    }
}

/// Writes the fixture's cases split over `cut.len()` parts (`--filter part_i`), part i without
/// `finished_at` when `cut[i]`, and returns the Attention page's text.
fn attention_text_of_parts(cut: &[bool]) -> String {
    let source = fs::read_to_string(valid_dir().join("gpu_attention.json")).unwrap();
    let doc: serde_json::Value = serde_json::from_str(&source).unwrap();
    let rows = doc["rows"].as_array().unwrap().clone();
    let mut cases: Vec<&serde_json::Value> = Vec::new();
    for r in &rows {
        if !cases.contains(&&r["case"]) {
            cases.push(&r["case"]);
        }
    }
    assert!(cases.len() >= cut.len(), "the fixture has a case per part");
    let data = tempfile::tempdir().unwrap();
    for (i, &stopped) in cut.iter().enumerate() {
        let mut part = doc.clone();
        let mut c = doc["config"]["command"].as_array().unwrap().clone();
        c.extend([
            serde_json::json!("--filter"),
            serde_json::json!(format!("part_{i}")),
        ]);
        part["config"]["command"] = serde_json::json!(c);
        part["rows"] = serde_json::json!(rows
            .iter()
            .filter(|r| cases.iter().position(|c| *c == &r["case"]).unwrap() % cut.len() == i)
            .cloned()
            .collect::<Vec<_>>());
        if stopped {
            part["config"]
                .as_object_mut()
                .unwrap()
                .remove("finished_at");
        }
        fs::write(
            data.path().join(format!("gpu_attention_{}.json", i + 1)),
            part.to_string(),
        )
        .unwrap();
    }
    let (_tmp, site) = build_site(data.path(), None);
    text_of(&site, "attention.html")
}

/// Two of three parts stopped early: both are named, the sentence is in the plural, and the
/// count of the run's parts is given.
#[test]
fn the_parts_of_a_run_that_stopped_early_are_named() {
    let t = attention_text_of_parts(&[true, false, true]);
    let said = t
        .split("Incomplete run: some parts of the run,")
        .nth(1)
        .unwrap_or_else(|| panic!("no parts named as stopped: {t}"));
    let said = &said[..said.find("measured them").expect("the sentence goes on")];
    assert!(said.contains("--filter part_0"), "{said}");
    assert!(said.contains("--filter part_2"), "{said}");
    assert!(!said.contains("part_1"), "{said}");
    assert!(
        said.contains("stopped before they finished (their documents have"),
        "{said}"
    );
    assert!(said.ends_with("another of the run's 3 parts "), "{said}");
}

/// A run in two parts (two documents, two `--filter`s) of which one stopped early: the page
/// names the part that stopped, by its command, and says another part may hold the cases it
/// never reached; the part that finished is not named as stopped.
#[test]
fn the_part_of_a_run_that_stopped_early_is_named() {
    let t = attention_text_of_parts(&[false, true]);
    let said = t
        .split("Incomplete run: one part of the run,")
        .nth(1)
        .unwrap_or_else(|| panic!("no part named as stopped: {t}"));
    let said = &said[..said.find("measured them").expect("the sentence goes on")];
    assert!(said.contains("--filter part_1"), "{said}");
    assert!(said.contains("stopped before it finished"), "{said}");
    assert!(!said.contains("part_0"), "{said}");
    assert!(
        said.ends_with("unless the other part of the run "),
        "{said}"
    );
}

/// Shards 1 and 3 of 4 in the data folder: the run is incomplete, and the Attention page, the
/// overview's Known limitations and its setup record say which shards are missing; with all
/// four there, none of them does.
#[test]
fn missing_shards_of_a_run_are_named_on_the_pages() {
    let source = fs::read_to_string(valid_dir().join("gpu_attention.json")).unwrap();
    let mut doc: serde_json::Value = serde_json::from_str(&source).unwrap();
    let rows = doc["rows"].as_array().unwrap().clone();
    let original = doc["config"]["command"].as_array().unwrap().clone();
    let data = tempfile::tempdir().unwrap();
    let write_shard = |doc: &mut serde_json::Value, i: usize| {
        let mut c = original.clone();
        c.extend([
            serde_json::json!("--filter"),
            serde_json::json!("pass=fwd"),
            serde_json::json!(format!("--shard={i}/4")),
        ]);
        doc["config"]["command"] = serde_json::json!(c);
        // Every 4th case from the i-th, as `--shard i/4` takes them.
        let mut cases: Vec<&serde_json::Value> = Vec::new();
        for r in &rows {
            if !cases.contains(&&r["case"]) {
                cases.push(&r["case"]);
            }
        }
        let part: Vec<_> = rows
            .iter()
            .filter(|r| cases.iter().position(|c| *c == &r["case"]).unwrap() % 4 == i - 1)
            .cloned()
            .collect();
        doc["rows"] = serde_json::json!(part);
        fs::write(
            data.path().join(format!("gpu_attention_{i}.json")),
            doc.to_string(),
        )
        .unwrap();
    };
    write_shard(&mut doc, 1);
    write_shard(&mut doc, 3);
    let (_tmp, site) = build_site(data.path(), None);
    let attention = text_of(&site, "attention.html");
    let expected =
        "shards 2, 4 of 4 of the part measured with --filter pass=fwd are not in the data folder";
    assert!(attention.contains(expected), "{attention}");
    // Said before the page's text and tables, and again above the document's tables.
    assert_eq!(attention.matches(expected).count(), 2, "{attention}");
    let html = page(&site, "attention.html");
    let first = html
        .select(&sel("main p.notice.incomplete"))
        .next()
        .expect("a notice");
    assert!(text(first).contains("The text below describes the cases measured so far"));
    let index = text_of(&site, "index.html");
    assert!(index.contains("incomplete run"), "{index}");
    assert!(index.contains(expected), "{index}");
    // Every reproduce command writes one file: a merged run's joined name is never an
    // `--output` (the Hopper page once printed `--output 'a.json + b.json'`).
    for name in ["index.html", "attention.html", "hopper.html"] {
        if site.join(name).exists() {
            let t = text_of(&site, name);
            for (at, _) in t.match_indices("--output ") {
                // Quoted singly, or doubly in the loop over a part's shards.
                let rest = t[at + "--output ".len()..].trim_start_matches(['\'', '"']);
                let path = rest.split(['\'', '"', ' ']).next().unwrap_or_default();
                let after = &rest[path.len()..];
                assert!(
                    path.ends_with(".json") && !after.starts_with(" + "),
                    "{name}: --output {path}{}",
                    &after[..after.len().min(60)]
                );
            }
        }
    }
    assert!(
        site.join("hopper.html").exists(),
        "the fixture is a compute capability 9.0 run"
    );
    // The shards of the part share one command under How to reproduce, a loop over those
    // present.
    let reproduce = |site: &Path| -> Vec<(String, String)> {
        let html = page(site, "index.html");
        let section = html.select(&sel("#how-to-reproduce")).next().unwrap();
        let labels: Vec<String> = section
            .select(&sel("p"))
            .map(text)
            .filter(|p| p.starts_with("To produce"))
            .collect();
        let commands: Vec<String> = section.select(&sel("pre")).map(text).collect();
        assert_eq!(labels.len(), commands.len());
        labels.into_iter().zip(commands).collect()
    };
    let loops: Vec<_> = reproduce(&site)
        .into_iter()
        .filter(|(l, _)| l.contains("gpu_attention_"))
        .collect();
    assert_eq!(loops.len(), 1, "{loops:?}");
    assert!(
        loops[0].0.starts_with(
            "To produce gpu_attention_1.json to gpu_attention_3.json (shards 1, 3 of 4 of this \
             command, those in the data; Attention, on the "
        ),
        "{loops:?}"
    );
    assert!(loops[0]
        .1
        .starts_with("for i in 1 3; do cargo run --release --bin attention -- "));
    // And one setup block, their rows summed.
    let index = page(&site, "index.html");
    let setups: Vec<String> = index.select(&sel("#setup h3")).map(text).collect();
    let ours: Vec<_> = setups
        .iter()
        .filter(|h| h.contains("gpu_attention_"))
        .collect();
    assert_eq!(
        ours,
        ["gpu_attention_1.json, gpu_attention_3.json (Attention)"],
        "{setups:?}"
    );
    assert!(
        loops[0].1.ends_with(
            "--output \"data/gpu_attention_$i.json\" --note 'fixture run'\\''s note' --filter \
             pass=fwd --shard=$i/4 || break; done"
        ),
        "{loops:?}"
    );
    write_shard(&mut doc, 2);
    write_shard(&mut doc, 4);
    let (_tmp, site) = build_site(data.path(), None);
    for name in ["attention.html", "index.html"] {
        let t = text_of(&site, name);
        assert!(
            !t.contains("Incomplete run") && !t.contains("incomplete run"),
            "{t}"
        );
    }
    let all = reproduce(&site);
    let whole: Vec<_> = all
        .iter()
        .filter(|(l, _)| l.contains("gpu_attention_"))
        .collect();
    assert_eq!(whole.len(), 1, "{all:?}");
    assert!(whole[0]
        .0
        .contains("gpu_attention_4.json (all 4 shards of this command;"));
    assert!(
        whole[0].1.starts_with("for i in $(seq 1 4); do "),
        "{whole:?}"
    );
    // Named alike and without a gap, the four read as a range in the setup and the heading.
    let index = page(&site, "index.html");
    assert!(index
        .select(&sel("#setup h3"))
        .map(text)
        .any(|h| h == "gpu_attention_1.json to gpu_attention_4.json (4 shards) (Attention)"));
    assert!(text_of(&site, "attention.html")
        .contains("(gpu_attention_1.json to gpu_attention_4.json (4 shards); commit"));
}

#[test]
fn the_hopper_table_says_in_how_many_rows_an_implementation_is_the_default() {
    let source = fs::read_to_string(valid_dir().join("gpu_attention.json")).unwrap();
    let mut doc: serde_json::Value = serde_json::from_str(&source).unwrap();
    let rows = doc["rows"].as_array_mut().unwrap();
    let defaults: Vec<String> = rows
        .iter()
        .filter(|r| r["default"] == true)
        .map(|r| r["implementation"].as_str().unwrap().to_string())
        .collect();
    let name = defaults
        .first()
        .expect("the fixture has default rows")
        .clone();
    let total = rows.iter().filter(|r| r["implementation"] == name).count();
    assert!(total > 1);
    // Only the first of its rows stays the default.
    let mut first = true;
    for r in rows.iter_mut().filter(|r| r["implementation"] == name) {
        r["default"] = serde_json::json!(first);
        first = false;
    }
    let data = tempfile::tempdir().unwrap();
    fs::write(data.path().join("gpu_attention.json"), doc.to_string()).unwrap();
    let (_tmp, site) = build_site(data.path(), None);
    let hopper = page(&site, "hopper.html");
    let badges: Vec<String> = hopper.select(&sel("td span.badge")).map(text).collect();
    assert!(
        badges.contains(&format!("default in 1 of {total} rows")),
        "{badges:?}"
    );
    assert!(!badges.contains(&"default".to_string()), "{badges:?}");
}

#[test]
fn schema_subcommand_writes_json_schema() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("schema.json");
    let status = docgen()
        .arg("schema")
        .arg("--out")
        .arg(&out)
        .status()
        .unwrap();
    assert!(status.success());
    let v: serde_json::Value = serde_json::from_str(&fs::read_to_string(&out).unwrap()).unwrap();
    assert!(v.get("properties").is_some());
}

/// A document of another suite shape: its own axis (`n`), a second axis, and GB/s from
/// `bytes`. The pages draw and tabulate what it declares, and nothing of attention's.
#[test]
fn axes_and_throughputs_come_from_the_document() {
    let source = fs::read_to_string(valid_dir().join("gpu_attention.json")).unwrap();
    let mut doc: serde_json::Value = serde_json::from_str(&source).unwrap();
    doc["suite"] = serde_json::json!("kernel_sums");
    doc["config"]["axes"] = serde_json::json!(["n", "head_dim"]);
    doc["config"]["throughput"] = serde_json::json!([
        {"key": "gb_per_s", "unit": "GB/s", "count": "bytes", "per_second": 1e9}
    ]);
    for r in doc["rows"].as_array_mut().unwrap() {
        let case = r["case"].as_object_mut().unwrap();
        let n = case.remove("seq_len").unwrap();
        case.insert("n".to_string(), n.clone());
        let bytes = n.as_f64().unwrap() * 1e3;
        r.as_object_mut().unwrap().remove("flops");
        r["bytes"] = serde_json::json!(bytes);
    }
    let data = tempfile::tempdir().unwrap();
    fs::write(data.path().join("gpu_kernel_sums.json"), doc.to_string()).unwrap();
    let (_tmp, site) = build_site(data.path(), None);
    let page_html = fs::read_to_string(site.join("mixers.html")).unwrap();
    let main = text(
        page(&site, "mixers.html")
            .select(&sel("main"))
            .next()
            .unwrap(),
    );
    assert!(
        !main.contains("seq_len") && !main.contains("TFLOP"),
        "{main}"
    );
    assert!(main.contains("GB/s"), "{main}");
    // The table's row key is the first axis.
    let doc_html = Html::parse_document(&page_html);
    let first_th = doc_html
        .select(&sel("table.results thead th"))
        .next()
        .map(text)
        .unwrap();
    assert_eq!(first_th, "n");
    // GB/s = bytes / median, formatted as the table shows it.
    let loaded = load::load_dir(data.path()).unwrap();
    let r = loaded[0]
        .doc
        .rows
        .iter()
        .find(|r| r.status == Status::Ok)
        .unwrap();
    let gbs = r.bytes.unwrap() / (r.median_ms.unwrap() * 1e-3) / 1e9;
    assert!(
        main.contains(&format!("{} GB/s", format::sig(gbs, 3))),
        "{main}"
    );
    // Figures against n (time and GB/s), and against the second axis, head_dim.
    let titles: Vec<String> = fs::read_dir(site.join("figures"))
        .unwrap()
        .map(|e| fs::read_to_string(e.unwrap().path()).unwrap())
        .filter_map(|svg| {
            let t = svg.split("<title>").nth(1)?.split("</title>").next()?;
            Some(t.to_string())
        })
        .collect();
    assert!(
        titles.iter().any(|t| t.contains("GB/s against n")),
        "{titles:?}"
    );
    assert!(
        titles.iter().any(|t| t.contains("against head_dim")),
        "{titles:?}"
    );
    assert!(!titles
        .iter()
        .any(|t| t.contains("seq_len") || t.contains("TFLOP")));
}

/// The project's own implementations that fail are known limitations: one entry per
/// (implementation, status), from the smallest size where it fails, with the message.
#[test]
fn own_failures_are_listed_as_limitations() {
    let (_tmp, site) = build_site(&valid_dir(), None);
    let docs = load::load_dir(&valid_dir()).unwrap();
    let failing: Vec<&Row> = docs[0]
        .doc
        .rows
        .iter()
        .filter(|r| r.library == "kernelpages" && r.status != Status::Ok)
        .collect();
    assert!(!failing.is_empty(), "the fixture has an own failure");
    let items: Vec<String> = page(&site, "index.html")
        .select(&sel(".limitations li"))
        .map(text)
        .collect();
    for r in failing {
        let kind = format!("{}: {}", r.implementation, r.status.as_str());
        let entry = items
            .iter()
            .find(|i| i.contains(&kind))
            .unwrap_or_else(|| panic!("no entry for {kind}: {items:?}"));
        assert!(
            entry.contains(&format!("from seq_len = {}", r.case["seq_len"])),
            "{entry}"
        );
        assert!(entry.contains(r.message.as_deref().unwrap()), "{entry}");
    }
}

/// A default that did not run at several sizes of one group while alternatives did is one known
/// limitation for the group, naming each size and what ran there (not one entry per size).
#[test]
fn a_default_that_did_not_run_is_one_limitation_per_group() {
    use kernelpages::schema::{Document, Param};
    let data = tempfile::tempdir().unwrap();
    let json = fs::read_to_string(valid_dir().join("gpu_attention.json")).unwrap();
    let mut doc: Document = serde_json::from_str(&json).unwrap();
    let mut n = 0;
    for r in doc.rows.iter_mut().filter(|r| {
        r.default
            && r.case.get("head_dim") == Some(&Param::Int(64))
            && r.case.get("causal") == Some(&Param::Bool(false))
            && r.case.get("pass") == Some(&Param::Text("fwd".into()))
            && matches!(r.case.get("seq_len"), Some(Param::Int(512 | 1024)))
    }) {
        *r = Row::failed(
            r.case.clone(),
            &r.implementation,
            &r.library,
            true,
            Status::Unsupported,
            "no kernel for this test",
        );
        n += 1;
    }
    assert_eq!(n, 2, "the fixture's group has seq_len 512 and 1024");
    fs::write(
        data.path().join("gpu_attention.json"),
        serde_json::to_string(&doc).unwrap(),
    )
    .unwrap();
    let (_tmp, site) = build_site(data.path(), None);
    let items: Vec<String> = page(&site, "index.html")
        .select(&sel(".limitations li"))
        .map(text)
        .collect();
    let hits: Vec<&String> = items
        .iter()
        .filter(|i| i.contains("default did not run") && i.contains("no kernel for this test"))
        .collect();
    assert_eq!(hits.len(), 1, "{hits:?}");
    let entry = hits[0];
    assert!(
        entry.contains("at 2 of") && entry.contains("512:") && entry.contains("1024:"),
        "{entry}"
    );
}

/// The Methodology names the alternatives whose rows record a compile time beside their first
/// call (a compiler on the first call), and says nothing of it when none does.
#[test]
fn methodology_names_alternatives_that_compile() {
    let data = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data");
    for dir in [data, valid_dir()] {
        let (_tmp, site) = build_site(&dir, None);
        let docs = load::load_dir(&dir).unwrap();
        let compiling: BTreeSet<&str> = docs
            .iter()
            .flat_map(|l| l.doc.rows.iter())
            .filter(|r| r.first_call_s.is_some() && r.compile_s.is_some())
            .map(|r| r.implementation.as_str())
            .collect();
        let body = text(
            page(&site, "index.html")
                .select(&sel("body"))
                .next()
                .unwrap(),
        );
        if compiling.is_empty() {
            assert!(
                !body.contains("compiles on its first call"),
                "{}",
                dir.display()
            );
        } else {
            let names: Vec<&str> = compiling.into_iter().collect();
            assert!(
                body.contains(&format!(
                    "compiles on its first call (here: {})",
                    names.join(", ")
                )),
                "{}: {names:?}",
                dir.display()
            );
        }
    }
}

/// The generator names no suite's parameters or units: those come from the documents.
#[test]
fn the_generator_names_no_axis_or_unit() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let mut files: Vec<PathBuf> = walkdir::WalkDir::new(root.join("src/site"))
        .into_iter()
        .map(|e| e.unwrap().into_path())
        .filter(|p| p.extension().is_some_and(|e| e == "rs"))
        .collect();
    files.extend(
        fs::read_dir(root.join("templates"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "html")),
    );
    for f in files {
        let text = fs::read_to_string(&f).unwrap();
        // Unit tests may use attention's names as sample data, and comments as examples.
        let code: String = text
            .split("#[cfg(test)]")
            .next()
            .unwrap()
            .lines()
            .filter(|l| !l.trim_start().starts_with("//"))
            .collect::<Vec<_>>()
            .join("\n");
        for word in ["seq_len", "TFLOP"] {
            assert!(!code.contains(word), "{} names {word}", f.display());
        }
    }
}

/// Every ratio on every page goes one way, the other implementation's time over the
/// reference's (the default whenever the default is one of the two), and the words beside it
/// say which is faster.
#[test]
fn every_ratio_uses_the_same_direction() {
    let data = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data");
    let (_tmp, site) = build_site(&data, None);
    let docs = load::load_dir(&data).unwrap();
    let defaults: BTreeSet<&str> = docs
        .iter()
        .flat_map(|l| l.doc.rows.iter())
        .filter(|r| r.default)
        .map(|r| r.implementation.as_str())
        .collect();
    let mut seen = 0;
    for name in ["index.html", "attention.html", "hopper.html"] {
        let html = fs::read_to_string(site.join(name)).unwrap();
        let body = text(page(&site, name).select(&sel("main")).next().unwrap());
        // The other direction's wording is gone.
        assert!(
            !body.contains("as long as") && !body.contains("× as long"),
            "{name}"
        );
        let doc = Html::parse_document(&html);
        for span in doc.select(&sel(".ratio")) {
            let v = span.value();
            let reference = v.attr("data-reference").unwrap();
            let other = v.attr("data-other").unwrap();
            let direction = v.attr("data-ratio").unwrap();
            assert!(
                direction.ends_with("of other ÷ time of reference")
                    || direction.contains("of other ÷"),
                "{direction}"
            );
            if defaults.contains(other) {
                assert!(
                    defaults.contains(reference),
                    "{name}: the default {other} is not the reference of {}",
                    text(span)
                );
            }
            if direction.starts_with("time") {
                let lo: f64 = v.attr("data-lo").unwrap().parse().unwrap();
                let hi: f64 = v.attr("data-hi").unwrap().parse().unwrap();
                // The words follow the span: "(flash 1.61× slower)".
                let after: String = span
                    .next_sibling()
                    .and_then(|n| n.value().as_text().map(|t| t.to_string()))
                    .unwrap_or_default();
                let words = format::time_ratio_words(lo, hi, reference);
                // Or, for two times whose quartiles overlap, that they are within noise: the
                // ratio then lies between the quartile ratios, either side of 1 allowed.
                if after.starts_with(" (within noise)") {
                    assert!(
                        (0.8..1.25).contains(&lo),
                        "{name}: {lo} called within noise"
                    );
                    continue;
                }
                assert!(after.starts_with(&format!(" ({words})")), "{after}");
                if lo > 1.0 {
                    // A ratio that rounds to 1.00× reads "as fast".
                    let even = format::ratio(hi) == format::ratio(1.0);
                    assert!(
                        words.ends_with(if even { "as fast" } else { "faster" }),
                        "{words}"
                    );
                } else if hi < 1.0 {
                    assert!(words.ends_with("slower"), "{words}");
                }
            }
            seen += 1;
        }
    }
    assert!(seen > 20, "{seen} ratios");
}

/// The Methodology names no number of its own: each comes from the document or the runner's
/// constants, so the text and the code cannot disagree.
#[test]
fn the_methodology_reads_every_number_from_the_code_or_the_data() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let source = fs::read_to_string(root.join("templates/prose/methodology.md")).unwrap();
    // Outside template expressions and comments, no number stands alone ("float64", "q1_ms",
    // "L2" are names, not numbers).
    let mut plain = String::new();
    let mut rest = source.as_str();
    while let Some(i) = rest.find(['{']) {
        plain.push_str(&rest[..i]);
        let close = match &rest[i..i + 2] {
            "{{" => "}}",
            "{%" => "%}",
            "{#" => "#}",
            _ => {
                plain.push('{');
                rest = &rest[i + 1..];
                continue;
            }
        };
        let end = rest[i..].find(close).unwrap() + i + 2;
        rest = &rest[end..];
    }
    plain.push_str(rest);
    for word in plain.split(|c: char| !(c.is_alphanumeric() || c == '.' || c == '_')) {
        let word = word.trim_matches('.');
        assert!(
            word.is_empty() || !word.chars().next().unwrap().is_ascii_digit(),
            "methodology.md types the number {word:?}"
        );
    }
    // And the numbers it shows are the code's and the document's.
    let (_tmp, site) = build_site(&root.join("data"), None);
    let text_of = text(
        page(&site, "index.html")
            .select(&sel("#methodology"))
            .next()
            .unwrap(),
    );
    let docs = load::load_dir(&root.join("data")).unwrap();
    let t = &docs[0].doc.config.timing;
    let mut expected = vec![
        format!("{} ms", format::sig(t.warmup_ms, 3)),
        format!("{} samples", t.repeats),
        format!("{}×", format::sig(t.launch_bound_ratio, 3)),
        format!("{} s", format::sig(t.case_timeout_s, 3)),
    ];
    // The protocol's constants as the document recorded them (the runner records
    // kernelpages::harness::protocol_constants()).
    match &docs[0].doc.config.protocol {
        Some(p) => expected.extend([
            format!("at least {} samples", p.min_samples),
            format!("at most {} copies", p.max_input_sets),
            format!(
                "{} s",
                format::sig(
                    p.process_limit_factor * t.case_timeout_s + p.process_limit_margin_s,
                    4
                )
            ),
            format!("every {} ms", format::sig(p.machine_sample_ms, 3)),
        ]),
        None => expected.push("(not recorded in this document)".to_string()),
    }
    for expected in expected {
        assert!(text_of.contains(&expected), "no {expected:?} in {text_of}");
    }
}

/// The Methodology says kernels compile once per run exactly when the document records it
/// (`config.protocol.kernels_compiled_once`, set by GPU runs that keep a kernel cache).
#[test]
fn methodology_says_kernels_compile_once_per_run_only_when_recorded() {
    let source = fs::read_to_string(valid_dir().join("gpu_attention.json")).unwrap();
    let methodology = |compiled_once: Option<bool>| {
        let data = tempfile::tempdir().unwrap();
        let mut doc: serde_json::Value = serde_json::from_str(&source).unwrap();
        if let Some(once) = compiled_once {
            let mut p = serde_json::to_value(kernelpages::harness::protocol_constants()).unwrap();
            p["kernels_compiled_once"] = serde_json::json!(once);
            doc["config"]["protocol"] = p;
        }
        fs::write(data.path().join("gpu_attention.json"), doc.to_string()).unwrap();
        let (_tmp, site) = build_site(data.path(), None);
        text(
            page(&site, "index.html")
                .select(&sel("#methodology"))
                .next()
                .unwrap(),
        )
    };
    let said = "Each kernel source is compiled once per runner process";
    assert!(methodology(Some(true)).contains(said));
    assert!(!methodology(Some(false)).contains(said));
    assert!(!methodology(None).contains(said));
}

#[test]
fn methodology_lists_each_sampling_once_without_the_rows_errors() {
    let source = fs::read_to_string(valid_dir().join("gpu_attention.json")).unwrap();
    let mut doc: serde_json::Value = serde_json::from_str(&source).unwrap();
    // Six shapes' samplings, each row's note ending in its own errors.
    for (i, row) in doc["rows"].as_array_mut().unwrap().iter_mut().enumerate() {
        if let Some(a) = row.get_mut("accuracy").filter(|a| a.is_object()) {
            a["checked"] = serde_json::json!(format!(
                "2 of 64 slices x {} query rows; rel_l2 O {i}.5e-3; largest O",
                100 + i % 6
            ));
        }
    }
    let data = tempfile::tempdir().unwrap();
    fs::write(data.path().join("gpu_attention.json"), doc.to_string()).unwrap();
    let (_tmp, site) = build_site(data.path(), None);
    let m = text(
        page(&site, "index.html")
            .select(&sel("#methodology"))
            .next()
            .unwrap(),
    );
    assert!(!m.contains("rel_l2 O") && !m.contains("largest O"), "{m}");
    // The first four in natural order, then the count of the other two.
    for n in 100..104 {
        assert_eq!(m.matches(&format!("x {n} query rows")).count(), 1, "{m}");
    }
    assert!(!m.contains("x 104 query rows"), "{m}");
    assert!(m.contains("and 2 more samplings"), "{m}");
}

/// A decoding document (`config.kind = decode`, rows with `bytes`, GB/s declared, drawn
/// against `seq_len_kv`) loads beside the grid of the same suite and device and gets its own
/// groups with a GB/s figure; every ok row of it must carry `bytes`.
#[test]
fn a_decoding_document_is_drawn_in_gb_per_s_beside_the_grid() {
    let data = tempfile::tempdir().unwrap();
    let source = fs::read_to_string(valid_dir().join("gpu_attention.json")).unwrap();
    fs::write(data.path().join("gpu_attention.json"), &source).unwrap();
    let mut doc: serde_json::Value = serde_json::from_str(&source).unwrap();
    doc["config"]["kind"] = serde_json::json!("decode");
    doc["config"]["axes"] = serde_json::json!(["seq_len_kv"]);
    doc["config"]["throughput"].as_array_mut().unwrap().push(
        serde_json::json!({"key": "gbps", "unit": "GB/s", "count": "bytes", "per_second": 1e9}),
    );
    let template: Vec<serde_json::Value> = doc["rows"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["status"] == "ok")
        .cloned()
        .collect();
    let mut rows = Vec::new();
    for len in [4096u64, 32768] {
        for r in template.iter().take(3) {
            let mut r = r.clone();
            r["case"] = serde_json::json!({"batch": 1, "causal": true, "dtype": "bf16",
                "head_dim": 128, "heads": 32, "kv_heads": 8, "pass": "fwd",
                "seq_len_q": 1, "seq_len_kv": len});
            r["bytes"] = serde_json::json!((2 * 8 * len * 128 * 2) as f64);
            rows.push(r);
        }
    }
    doc["rows"] = serde_json::json!(rows);
    let decode = data.path().join("gpu_attention_decode.json");
    fs::write(&decode, doc.to_string()).unwrap();
    let (_tmp, site) = build_site(data.path(), None);
    let html = fs::read_to_string(site.join("attention.html")).unwrap();
    assert!(
        html.contains("gpu_attention_decode.json"),
        "no decode section"
    );
    let gbps: Vec<_> = fs::read_dir(site.join("figures"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with("-gbps.svg"))
        .collect();
    assert!(!gbps.is_empty(), "no GB/s figure");
    // An ok row without bytes is refused, naming the throughput.
    doc["rows"][0].as_object_mut().unwrap().remove("bytes");
    fs::write(&decode, doc.to_string()).unwrap();
    let err = load::load_dir(data.path()).unwrap_err().to_string();
    assert!(err.contains("`bytes` is missing"), "{err}");
}

/// Single cases merged into one table (decoding shapes that differ in batch, one cache length
/// each) list each implementation's peak-memory method once, though the method's own text holds
/// `; ` (it was repeated once per case).
#[test]
fn merged_single_cases_name_each_peak_method_once() {
    let data = tempfile::tempdir().unwrap();
    let source = fs::read_to_string(valid_dir().join("gpu_attention.json")).unwrap();
    let mut doc: serde_json::Value = serde_json::from_str(&source).unwrap();
    doc["config"]["kind"] = serde_json::json!("decode");
    doc["config"]["axes"] = serde_json::json!(["seq_len_kv"]);
    let template: Vec<serde_json::Value> = doc["rows"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["status"] == "ok" && r["memory"].is_object())
        .cloned()
        .collect();
    let method = "pool high-water mark; workspaces apart";
    let mut rows = Vec::new();
    for batch in [1u64, 2, 4] {
        for r in template.iter().take(2) {
            let mut r = r.clone();
            r["case"] = serde_json::json!({"batch": batch, "causal": true, "dtype": "bf16",
                "head_dim": 128, "heads": 32, "kv_heads": 8, "pass": "fwd",
                "seq_len_q": 1, "seq_len_kv": 32768});
            r["memory"]["peak_method"] = serde_json::json!(method);
            rows.push(r);
        }
    }
    doc["rows"] = serde_json::json!(rows);
    fs::write(
        data.path().join("gpu_attention_decode.json"),
        doc.to_string(),
    )
    .unwrap();
    let (_tmp, site) = build_site(data.path(), None);
    let html = page(&site, "attention.html");
    let items: Vec<String> = html.select(&sel("ul.methods li")).map(text).collect();
    assert!(!items.is_empty(), "no peak methods listed");
    for item in &items {
        assert_eq!(item.matches(method).count(), 1, "{item}");
    }
}

/// A run split over several calls by `--filter` (one machine call each) is one run: its parts
/// load together; the same parts from two commits do not.
#[test]
fn parts_of_one_run_split_by_filter_load_together() {
    let data = tempfile::tempdir().unwrap();
    let source = fs::read_to_string(valid_dir().join("gpu_attention.json")).unwrap();
    let mut doc: serde_json::Value = serde_json::from_str(&source).unwrap();
    let rows = doc["rows"].as_array().unwrap().clone();
    let (full, causal): (Vec<_>, Vec<_>) =
        rows.into_iter().partition(|r| r["case"]["causal"] == false);
    let base = doc["config"]["command"].as_array().unwrap().clone();
    let with_filter = |f: &str| {
        let mut c = base.clone();
        c.extend([serde_json::json!("--filter"), serde_json::json!(f)]);
        c
    };
    doc["rows"] = serde_json::json!(full);
    doc["config"]["command"] = serde_json::json!(with_filter("causal=false"));
    fs::write(data.path().join("a.json"), doc.to_string()).unwrap();
    doc["rows"] = serde_json::json!(causal);
    doc["config"]["command"] = serde_json::json!(with_filter("causal=true"));
    fs::write(data.path().join("b.json"), doc.to_string()).unwrap();
    assert_eq!(load::load_dir(data.path()).unwrap().len(), 2);
    // Another commit: two runs, refused.
    doc["config"]["git_commit"] = serde_json::json!("1111111111111111111111111111111111111111");
    fs::write(data.path().join("b.json"), doc.to_string()).unwrap();
    let err = load::load_dir(data.path()).unwrap_err().to_string();
    assert!(err.contains("not shards of one run"), "{err}");
}

/// A tile sweep made from the fixture's first flash row: configurations `a` (the default, the
/// row's time), `b` (faster: 0.8 of it), `c` (slower: 1.25) and `d` (unsupported), at commit
/// `commit`.
fn tile_sweep(commit: &str) -> serde_json::Value {
    let source = fs::read_to_string(valid_dir().join("gpu_attention.json")).unwrap();
    let mut doc: serde_json::Value = serde_json::from_str(&source).unwrap();
    let flash = doc["rows"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["implementation"] == "flash" && r["status"] == "ok")
        .unwrap()
        .clone();
    let rows: Vec<serde_json::Value> = [
        ("a", Some(1.0)),
        ("b", Some(0.8)),
        ("c", Some(1.25)),
        ("d", None),
    ]
    .into_iter()
    .map(|(name, scale)| {
        let mut r = flash.clone();
        r["case"]["config"] = serde_json::json!(name);
        r["default"] = serde_json::json!(name == "a");
        match scale {
            Some(s) => {
                for k in ["median_ms", "q1_ms", "q3_ms"] {
                    r[k] = serde_json::json!(r[k].as_f64().unwrap() * s);
                }
            }
            None => {
                r = serde_json::json!({
                    "case": r["case"].clone(), "implementation": "flash",
                    "library": r["library"].clone(), "default": false,
                    "status": "unsupported", "message": "configuration d needs head_dim 128",
                });
            }
        }
        r
    })
    .collect();
    doc["rows"] = serde_json::json!(rows);
    doc["config"]["kind"] = serde_json::json!("tile_sweep");
    doc["config"]["git_commit"] = serde_json::json!(commit);
    doc
}

/// A new data folder with the valid fixture's attention grid (`gpu_attention.json`) and a tile
/// sweep at `commit` beside it (`gpu_attention_tiles.json`).
fn grid_and_tile_sweep(commit: &str) -> tempfile::TempDir {
    let data = tempfile::tempdir().unwrap();
    fs::copy(
        valid_dir().join("gpu_attention.json"),
        data.path().join("gpu_attention.json"),
    )
    .unwrap();
    fs::write(
        data.path().join("gpu_attention_tiles.json"),
        tile_sweep(commit).to_string(),
    )
    .unwrap();
    data
}

#[test]
fn a_tile_sweep_names_the_grids_commit_not_another_kinds() {
    let data = grid_and_tile_sweep("2222222222222222222222222222222222222222");
    // A masks grid at a third commit whose file sorts before the grid's.
    let mut other: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(valid_dir().join("gpu_attention.json")).unwrap())
            .unwrap();
    other["config"]["kind"] = serde_json::json!("masks");
    other["config"]["git_commit"] = serde_json::json!("4444444444444444444444444444444444444444");
    for row in other["rows"].as_array_mut().unwrap() {
        // Cases of its own: no row repeats the grid's.
        row["case"]["heads"] = serde_json::json!(99);
        row["case"]["kv_heads"] = serde_json::json!(99);
    }
    fs::write(data.path().join("a_masks.json"), other.to_string()).unwrap();
    assert_eq!(load::load_dir(data.path()).unwrap().len(), 3);
    let (_tmp, site) = build_site(data.path(), None);
    let attention = page(&site, "attention.html");
    let section = attention.select(&sel("section.tile-sweep")).next().unwrap();
    let t = text(section);
    assert!(
        t.contains("2222222") && t.contains("0000000") && !t.contains("4444444"),
        "the sweep names its own commit and the grid's: {t}"
    );
    // The grid has no flash_sm80 rows: flash is the kernel the sweep measured.
    assert!(!t.contains("the portable kernel's"), "{t}");
    // Once the grid runs flash_sm80 beside flash, the sweep is said to be the portable kernel's.
    let mut grid: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(valid_dir().join("gpu_attention.json")).unwrap())
            .unwrap();
    let rows = grid["rows"].as_array_mut().unwrap();
    let mut portable = rows
        .iter()
        .find(|r| r["implementation"] == "flash")
        .unwrap()
        .clone();
    portable["implementation"] = serde_json::json!("flash_sm80");
    portable["default"] = serde_json::json!(false);
    rows.push(portable);
    fs::write(data.path().join("gpu_attention.json"), grid.to_string()).unwrap();
    let (_tmp, site) = build_site(data.path(), None);
    let attention = page(&site, "attention.html");
    let section = attention.select(&sel("section.tile-sweep")).next().unwrap();
    let t = text(section);
    assert!(
        t.contains("these configurations are the portable kernel's, flash_sm80"),
        "{t}"
    );
}

#[test]
fn a_tile_sweep_is_a_run_of_its_own_with_its_own_section() {
    let sweep_commit = "2222222222222222222222222222222222222222";
    let data = grid_and_tile_sweep(sweep_commit);
    // Another commit than the grid's, yet not a second run of the grid.
    assert_eq!(load::load_dir(data.path()).unwrap().len(), 2);
    let (_tmp, site) = build_site(data.path(), None);
    let attention = page(&site, "attention.html");
    let sections: Vec<_> = attention.select(&sel("section.tile-sweep")).collect();
    assert_eq!(sections.len(), 1, "one sweep, one section");
    let section = sections[0];
    assert!(
        text(section).contains("2222222") && text(section).contains("0000000"),
        "the section names both commits: {}",
        text(section)
    );
    let configs: Vec<String> = section
        .select(&sel("table.tiles tbody th"))
        .map(|th| text(th))
        .collect();
    assert_eq!(
        configs,
        ["b", "a default", "c", "d"],
        "fastest first, failed last"
    );
    let verdict = text(
        section
            .select(&sel("section.tile-group > p"))
            .next()
            .unwrap(),
    );
    assert!(
        verdict.contains("not the fastest")
            && verdict.contains("b reaches")
            && verdict.contains("1.25"),
        "{verdict}"
    );
    assert!(text(section).contains("configuration d needs head_dim 128"));
    // The table of contents leads to the sweep and to its shape.
    let toc: Vec<String> = attention
        .select(&sel("nav a, aside a"))
        .filter_map(|a| a.value().attr("href").map(String::from))
        .collect();
    for id in [
        section.value().id().unwrap(),
        section
            .select(&sel("section.tile-group"))
            .next()
            .unwrap()
            .value()
            .id()
            .unwrap(),
    ] {
        assert!(toc.contains(&format!("#{id}")), "{id} not in {toc:?}");
    }
    let img = section.select(&sel("img")).next().unwrap();
    let svg = fs::read_to_string(site.join(img.value().attr("src").unwrap())).unwrap();
    assert!(
        svg.contains("<desc>") && svg.contains("a (default)"),
        "{svg}"
    );
    // Each configuration's name sits beside its own bar, in table order (b, a, c), with the
    // default's bar in its own colour; d did not run and has no bar.
    let attr = |tag: &str, name: &str| -> f64 {
        let k = tag.find(&format!(" {name}=\"")).unwrap() + name.len() + 3;
        tag[k..].split('"').next().unwrap().parse().unwrap()
    };
    let bars: Vec<(f64, f64, bool)> = svg
        .split("<rect ")
        .skip(1)
        .map(|r| r.split('>').next().unwrap())
        .filter(|r| attr(r, "height") < 40.0)
        .map(|r| {
            (
                attr(r, "y"),
                attr(r, "height"),
                r.contains("fill=\"#0072B2\""),
            )
        })
        .collect();
    assert_eq!(bars.len(), 3, "{bars:?}");
    assert_eq!(bars.iter().filter(|b| b.2).count(), 1, "one default bar");
    let label_y = |label: &str| -> f64 {
        let at = svg.find(&format!(">\n{label}\n</text>")).unwrap();
        let tag = &svg[svg[..at].rfind("<text").unwrap()..at];
        attr(tag, "y")
    };
    for (label, (y, h, default)) in ["b", "a (default)", "c"].iter().zip(&bars) {
        let ly = label_y(label);
        assert!(
            *y <= ly && ly <= y + h,
            "{label} at y {ly}, its bar {y}..{}",
            y + h
        );
        assert_eq!(*default, label.contains("default"), "{label}");
    }
    // The grid's tables hold no configuration rows: no group title names `config`, and the
    // grid's groups are as many as without the sweep.
    let grid_groups: Vec<String> = attention
        .select(&sel("section.group h3"))
        .map(|h| text(h))
        .collect();
    assert!(
        grid_groups.iter().all(|t| !t.contains("config=")),
        "{grid_groups:?}"
    );
    let (_tmp2, alone) = build_site(&valid_dir(), None);
    assert_eq!(
        grid_groups.len(),
        page(&alone, "attention.html")
            .select(&sel("section.group"))
            .count()
    );

    // A sweep alone (no grid): its page is measured and shows it; the sweep names no grid
    // commit; no prose sentence reads its rows (the build would fail on an ambiguous row).
    let only = tempfile::tempdir().unwrap();
    fs::write(
        only.path().join("gpu_attention_tiles.json"),
        tile_sweep(sweep_commit).to_string(),
    )
    .unwrap();
    let (_tmp3, site_only) = build_site(only.path(), None);
    let attention_only = page(&site_only, "attention.html");
    let section = attention_only
        .select(&sel("section.tile-sweep"))
        .next()
        .expect("the sweep's section");
    assert!(!text(section).contains("tables above"), "{}", text(section));
    let footer = text(attention_only.select(&sel("footer")).next().unwrap());
    assert!(footer.contains("computed from"), "{footer}");
    assert_eq!(attention_only.select(&sel("section.group")).count(), 0);

    // Two sweeps of one suite on one device from two commits are two runs.
    fs::write(
        data.path().join("gpu_attention_tiles_2.json"),
        tile_sweep("3333333333333333333333333333333333333333").to_string(),
    )
    .unwrap();
    let err = load::load_dir(data.path()).unwrap_err().to_string();
    assert!(
        err.contains("tile_sweep") && err.contains("not shards"),
        "{err}"
    );
    fs::remove_file(data.path().join("gpu_attention_tiles_2.json")).unwrap();

    // A sweep's row must name its configuration.
    let mut bad = tile_sweep(sweep_commit);
    bad["rows"][1]["case"]
        .as_object_mut()
        .unwrap()
        .remove("config");
    fs::write(
        data.path().join("gpu_attention_tiles.json"),
        bad.to_string(),
    )
    .unwrap();
    let err = load::load_dir(data.path()).unwrap_err().to_string();
    assert!(
        err.contains("gpu_attention_tiles.json") && err.contains("`config`"),
        "{err}"
    );
}

/// The text of the at-a-glance table of a site built from `doc` alone.
fn glance_of(doc: &kernelpages::schema::Document) -> String {
    let data = tempfile::tempdir().unwrap();
    fs::write(
        data.path().join("gpu_attention.json"),
        serde_json::to_string(doc).unwrap(),
    )
    .unwrap();
    let (_tmp, site) = build_site(data.path(), None);
    text(
        page(&site, "index.html")
            .select(&sel("table.glance"))
            .next()
            .unwrap(),
    )
}

/// An at-a-glance cell without a ratio says why: no alternative's row at that size, no
/// alternative that ran, or none accurate and not launch-bound.
#[test]
fn a_glance_cell_without_a_ratio_says_which_reason() {
    use kernelpages::schema::{Document, Param};
    let json = fs::read_to_string(valid_dir().join("gpu_attention.json")).unwrap();
    let mut doc: Document = serde_json::from_str(&json).unwrap();
    let group = |r: &Row, t: i64| {
        r.case.get("head_dim") == Some(&Param::Int(64))
            && r.case.get("causal") == Some(&Param::Bool(false))
            && r.case.get("pass") == Some(&Param::Text("fwd".into()))
            && r.case.get("seq_len") == Some(&Param::Int(t))
    };
    // At 512 no alternative has a row; at 1024 every alternative's row is unsupported.
    let before = doc.rows.len();
    doc.rows.retain(|r| r.default || !group(r, 512));
    assert!(doc.rows.len() < before);
    let mut failed = 0;
    for r in doc.rows.iter_mut().filter(|r| !r.default && group(r, 1024)) {
        *r = Row::failed(
            r.case.clone(),
            &r.implementation,
            &r.library,
            false,
            Status::Unsupported,
            "not for this test",
        );
        failed += 1;
    }
    assert!(failed >= 1);
    let glance = glance_of(&doc);
    assert!(
        glance.contains("no alternative measured at this size"),
        "{glance}"
    );
    assert!(
        glance.contains("no alternative ran (each row says why)"),
        "{glance}"
    );
    // The same rows from a run cut off by its time limit: the alternatives missing at 512 were
    // measured elsewhere in that run, so the run never reached them there.
    doc.config.finished_at = None;
    let glance = glance_of(&doc);
    assert!(
        glance.contains("the run was cut off before an alternative's row at this size"),
        "{glance}"
    );
    assert!(
        !glance.contains("no alternative measured at this size"),
        "{glance}"
    );
}

/// An at-a-glance cell with no comparison tells a size the group's grid has no case of (`no case
/// of this size`) from one whose case has rows but no default among them (`not measured`).
#[test]
fn a_glance_cell_tells_a_missing_size_from_a_missing_default() {
    use kernelpages::schema::{Document, Param};
    let json = fs::read_to_string(valid_dir().join("gpu_attention.json")).unwrap();
    let mut doc: Document = serde_json::from_str(&json).unwrap();
    let group = |r: &Row, t: i64| {
        r.case.get("head_dim") == Some(&Param::Int(64))
            && r.case.get("causal") == Some(&Param::Bool(false))
            && r.case.get("pass") == Some(&Param::Text("fwd".into()))
            && r.case.get("seq_len") == Some(&Param::Int(t))
    };
    let sizes: BTreeSet<i64> = doc
        .rows
        .iter()
        .filter_map(|r| match r.case.get("seq_len") {
            Some(Param::Int(t)) if group(r, *t) => Some(*t),
            _ => None,
        })
        .collect();
    let (&small, &large) = (sizes.first().unwrap(), sizes.last().unwrap());
    assert!(small < large, "{sizes:?}");
    let whole = glance_of(&doc);
    assert!(
        !whole.contains("not measured") && !whole.contains("no case of this size"),
        "{whole}"
    );
    // The smallest size: no row of the group at all; the largest: its rows, but none default.
    let before = doc.rows.len();
    doc.rows.retain(|r| !group(r, small));
    assert!(doc.rows.len() < before);
    let mut undefaulted = 0;
    for r in doc.rows.iter_mut().filter(|r| group(r, large) && r.default) {
        r.default = false;
        undefaulted += 1;
    }
    assert!(undefaulted >= 1);
    // The group's own row of the table: the cell at the smallest size and at the largest.
    let data = tempfile::tempdir().unwrap();
    fs::write(
        data.path().join("gpu_attention.json"),
        serde_json::to_string(&doc).unwrap(),
    )
    .unwrap();
    let (_tmp, site) = build_site(data.path(), None);
    let index = page(&site, "index.html");
    let table = index.select(&sel("table.glance")).next().unwrap();
    let heads: Vec<String> = table.select(&sel("thead th")).map(text).collect();
    let column = |t: i64| {
        heads
            .iter()
            .position(|h| h.trim() == format!("seq_len {t}"))
            .unwrap_or_else(|| panic!("no column {t}: {heads:?}"))
    };
    let row = table
        .select(&sel("tbody tr"))
        .find(|tr| {
            let label = tr.select(&sel("th")).next().map(text).unwrap_or_default();
            label.contains("head_dim=64")
                && label.contains("causal=false")
                && !label.contains("fwd+bwd")
        })
        .expect("the group's row");
    let cells: Vec<String> = row.select(&sel("th, td")).map(text).collect();
    assert!(
        cells[column(small)].contains("no case of this size"),
        "{cells:?}"
    );
    assert!(cells[column(large)].contains("not measured"), "{cells:?}");
}

/// An alternative faster than the one an at-a-glance cell compares with, but left out for its
/// error, is named in the cell.
#[test]
fn a_faster_alternative_above_its_tolerance_is_named_at_a_glance() {
    use kernelpages::schema::Document;
    let json = fs::read_to_string(valid_dir().join("gpu_attention.json")).unwrap();
    let mut doc: Document = serde_json::from_str(&json).unwrap();
    let flag = "faster, but its error is above its tolerance";
    // The first case with an ok default and an ok alternative: the alternative made ten times
    // faster than the default and ten times over its tolerance.
    let (case, default_ms) = doc
        .rows
        .iter()
        .filter(|r| r.default && r.status == Status::Ok)
        .find_map(|d| {
            let alt = doc.rows.iter().any(|r| {
                !r.default && r.case == d.case && r.status == Status::Ok && r.accuracy.is_some()
            });
            alt.then(|| (d.case.clone(), d.median_ms.unwrap()))
        })
        .expect("a case with an ok alternative");
    let alt = doc
        .rows
        .iter_mut()
        .find(|r| !r.default && r.case == case && r.status == Status::Ok && r.accuracy.is_some())
        .unwrap();
    alt.median_ms = Some(default_ms / 10.0);
    alt.q1_ms = Some(default_ms / 10.0);
    alt.q3_ms = Some(default_ms / 10.0);
    let acc = alt.accuracy.as_mut().unwrap();
    acc.rel_err = acc.tolerance * 10.0;
    let name = alt.implementation.clone();
    let glance = glance_of(&doc);
    assert!(glance.contains(&format!("{name}: {flag}")), "{glance}");
    // The committed fixture has no such row.
    let (_tmp, site) = build_site(&valid_dir(), None);
    assert!(!text_of(&site, "index.html").contains(flag));
}

/// The fixture's attention document cut to its smallest seq_len: every case at one size.
fn attention_fixture_at_one_size() -> kernelpages::schema::Document {
    use kernelpages::schema::{Document, Param};
    let json = fs::read_to_string(valid_dir().join("gpu_attention.json")).unwrap();
    let mut doc: Document = serde_json::from_str(&json).unwrap();
    let smallest = doc
        .rows
        .iter()
        .filter_map(|r| match r.case.get("seq_len") {
            Some(Param::Int(t)) => Some(*t),
            _ => None,
        })
        .min()
        .unwrap();
    doc.rows
        .retain(|r| r.case.get("seq_len") == Some(&Param::Int(smallest)));
    doc
}

/// The table of cases measured at one size says, in a run that stopped early, that some may
/// lack sizes the run never reached; a finished run's table does not.
#[test]
fn single_size_cases_of_an_incomplete_run_say_so() {
    use kernelpages::schema::Document;
    let mut doc = attention_fixture_at_one_size();
    let phrase = "the run is incomplete, so some may lack sizes it never reached";
    let titles = |doc: &Document| {
        let data = tempfile::tempdir().unwrap();
        fs::write(
            data.path().join("gpu_attention.json"),
            serde_json::to_string(doc).unwrap(),
        )
        .unwrap();
        let (_tmp, site) = build_site(data.path(), None);
        page(&site, "attention.html")
            .select(&sel("section.group h3"))
            .map(text)
            .filter(|t| t.starts_with("Cases measured at one size"))
            .collect::<Vec<String>>()
    };
    let finished = titles(&doc);
    assert!(
        !finished.is_empty(),
        "the fixture cut to one size has single cases"
    );
    assert!(finished.iter().all(|t| !t.contains(phrase)), "{finished:?}");
    doc.config.finished_at = None;
    let cut = titles(&doc);
    assert!(
        !cut.is_empty() && cut.iter().all(|t| t.contains(phrase)),
        "{cut:?}"
    );
}

/// Implementations that never share a case (a suite of two ops, as the MoE suite's grouped
/// GEMM and whole layer) get tables of their own: in a run cut to one size, the cases measured
/// at one size make one table per family of implementations, each with only its family's
/// columns (no column of "not measured" cells for the other op's implementations).
#[test]
fn implementations_that_share_no_case_get_tables_of_their_own() {
    use kernelpages::schema::Param;
    let mut doc = attention_fixture_at_one_size();
    // The causal cases become another op's, measured by other implementations.
    let causal = Param::Bool(true);
    let mut renamed = 0;
    for r in doc.rows.iter_mut() {
        if r.case.get("causal") == Some(&causal) {
            r.implementation = format!("layer_{}", r.implementation);
            r.case.insert("op".into(), Param::Text("layer".into()));
            renamed += 1;
        } else {
            r.case.insert("op".into(), Param::Text("attention".into()));
        }
    }
    assert!(
        renamed > 0 && renamed < doc.rows.len(),
        "both ops have rows"
    );
    let data = tempfile::tempdir().unwrap();
    fs::write(
        data.path().join("gpu_attention.json"),
        serde_json::to_string(&doc).unwrap(),
    )
    .unwrap();
    let (_tmp, site) = build_site(data.path(), None);
    let html = page(&site, "attention.html");
    let singles: Vec<(String, Vec<String>)> = html
        .select(&sel("section.group"))
        .map(|g| {
            (
                text(g.select(&sel("h3")).next().unwrap()),
                g.select(&sel("th.impl")).map(text).collect(),
            )
        })
        .filter(|(t, _)| t.starts_with("Cases measured at one size"))
        .collect();
    assert_eq!(singles.len(), 2, "{singles:?}");
    for (title, headers) in &singles {
        let layer = title.contains("op=layer");
        assert!(
            !headers.is_empty() && headers.iter().all(|h| h.starts_with("layer_") == layer),
            "{title}: {headers:?}"
        );
    }
    // Two different anchors.
    let anchors: BTreeSet<String> = html
        .select(&sel("section.group"))
        .filter_map(|g| g.value().attr("id").map(String::from))
        .collect();
    assert_eq!(
        anchors.len(),
        html.select(&sel("section.group")).count(),
        "every table has its own anchor"
    );
    // The whole fixture, every case at several sizes: each sweep's table has its family's
    // columns only.
    let json = fs::read_to_string(valid_dir().join("gpu_attention.json")).unwrap();
    let mut doc: kernelpages::schema::Document = serde_json::from_str(&json).unwrap();
    for r in doc.rows.iter_mut() {
        if r.case.get("causal") == Some(&causal) {
            r.implementation = format!("layer_{}", r.implementation);
        }
    }
    fs::write(
        data.path().join("gpu_attention.json"),
        serde_json::to_string(&doc).unwrap(),
    )
    .unwrap();
    let (_tmp2, site) = build_site(data.path(), None);
    let html = page(&site, "attention.html");
    let mut sweeps = 0;
    for g in html.select(&sel("section.group")) {
        let title = text(g.select(&sel("h3")).next().unwrap());
        let headers: Vec<String> = g.select(&sel("th.impl")).map(text).collect();
        let layer = title.contains("causal=true");
        assert!(
            !headers.is_empty() && headers.iter().all(|h| h.starts_with("layer_") == layer),
            "{title}: {headers:?}"
        );
        sweeps += 1;
    }
    assert!(sweeps >= 2, "the fixture has sweeps of both families");
}

/// How to reproduce names the Python packages a document's comparisons ran with, from its
/// `config.libraries`, under their pip names (`fla` → `fla-core`); a run with no Python
/// library gets no such note.
#[test]
fn reproduce_commands_name_the_python_packages_recorded() {
    let source = fs::read_to_string(valid_dir().join("gpu_attention.json")).unwrap();
    let mut doc: serde_json::Value = serde_json::from_str(&source).unwrap();
    let data = tempfile::tempdir().unwrap();
    let libs = doc["config"]["libraries"].as_object_mut().unwrap();
    for k in [
        "torch",
        "triton",
        "fla",
        "jax",
        "jaxlib",
        "jax_cuda13_plugin",
        "python",
    ] {
        libs.remove(k);
    }
    fs::write(data.path().join("gpu_attention.json"), doc.to_string()).unwrap();
    let (_tmp, site) = build_site(data.path(), None);
    assert!(!text_of(&site, "attention.html").contains("its comparisons ran with"));
    let libs = doc["config"]["libraries"].as_object_mut().unwrap();
    libs.insert("python".into(), serde_json::json!("3.12.3"));
    libs.insert("torch".into(), serde_json::json!("2.11.0+cu130"));
    libs.insert("fla".into(), serde_json::json!("0.6.0"));
    fs::write(data.path().join("gpu_attention.json"), doc.to_string()).unwrap();
    let (_tmp2, site) = build_site(data.path(), None);
    let t = text_of(&site, "attention.html");
    assert!(
        t.contains("its comparisons ran with Python 3.12.3, torch 2.11.0+cu130, fla-core 0.6.0"),
        "{t}"
    );
    // The cuDNN that torch brought, beside torch.
    let libs = doc["config"]["libraries"].as_object_mut().unwrap();
    libs.insert("cudnn".into(), serde_json::json!("91900"));
    fs::write(data.path().join("gpu_attention.json"), doc.to_string()).unwrap();
    let (_tmp3, site) = build_site(data.path(), None);
    let t = text_of(&site, "attention.html");
    assert!(
        t.contains("torch 2.11.0+cu130 (cuDNN 9.19.0), fla-core 0.6.0"),
        "{t}"
    );
}

/// An alternative faster than the default beyond both spreads is a known limitation, unless its
/// output was not checked against the reference (no accuracy: a ceiling computing something
/// else, such as MoE's dense GEMM of equal FLOPs), which is then not listed.
#[test]
fn only_checked_alternatives_are_listed_as_faster() {
    use kernelpages::schema::Document;
    let json = fs::read_to_string(valid_dir().join("gpu_attention.json")).unwrap();
    let mut doc: Document = serde_json::from_str(&json).unwrap();
    // One case with an ok default and an ok alternative: make the alternative 10x faster.
    let (case, alt) = doc
        .rows
        .iter()
        .filter(|r| !r.default && r.status == Status::Ok && r.accuracy.is_some())
        .find_map(|r| {
            doc.rows
                .iter()
                .find(|d| d.default && d.status == Status::Ok && d.case == r.case)
                .map(|_| (r.case.clone(), r.implementation.clone()))
        })
        .expect("the fixture has a case with an ok default and an ok alternative");
    let d_q1 = doc
        .rows
        .iter()
        .find(|d| d.default && d.case == case)
        .and_then(|d| d.q1_ms)
        .unwrap();
    for r in doc
        .rows
        .iter_mut()
        .filter(|r| r.case == case && r.implementation == alt)
    {
        r.median_ms = Some(d_q1 / 10.0);
        r.q1_ms = Some(d_q1 / 11.0);
        r.q3_ms = Some(d_q1 / 9.0);
    }
    let entries = |doc: &Document| -> Vec<String> {
        let data = tempfile::tempdir().unwrap();
        fs::write(
            data.path().join("gpu_attention.json"),
            serde_json::to_string(doc).unwrap(),
        )
        .unwrap();
        let (_tmp, site) = build_site(data.path(), None);
        page(&site, "index.html")
            .select(&sel(".limitations li"))
            .map(text)
            .filter(|i| i.contains("faster alternative") && i.contains(&format!("{alt} beats")))
            .collect()
    };
    assert_eq!(entries(&doc).len(), 1, "{alt} made faster is listed");
    for r in doc
        .rows
        .iter_mut()
        .filter(|r| r.case == case && r.implementation == alt)
    {
        r.accuracy = None;
    }
    assert!(
        entries(&doc).is_empty(),
        "{alt} without a check is not listed"
    );
}

/// A copy of the suite documents in `data` (its top-level `*.json`) in a new temporary folder,
/// each GPU document's device renamed to `rename(suite, name)` where that gives a name: the
/// folder (kept alive by the returned guard), the copy's path and how many were renamed.
fn with_gpus_renamed(
    data: &Path,
    rename: impl Fn(&str, &str) -> Option<&'static str>,
) -> (tempfile::TempDir, PathBuf, usize) {
    let tmp = tempfile::tempdir().unwrap();
    let copy = tmp.path().join("data");
    fs::create_dir(&copy).unwrap();
    let mut renamed = 0;
    for entry in fs::read_dir(data).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("json") {
            continue;
        }
        let text = fs::read_to_string(&path).unwrap();
        let mut doc: serde_json::Value = serde_json::from_str(&text).unwrap();
        if doc["device"]["kind"] == "gpu" {
            let suite = doc["suite"].as_str().unwrap_or_default().to_string();
            let name = doc["device"]["name"].as_str().unwrap().to_string();
            if let Some(new) = rename(&suite, &name) {
                doc["device"]["name"] = serde_json::Value::from(new);
                renamed += 1;
            }
        }
        fs::write(
            copy.join(path.file_name().unwrap()),
            serde_json::to_string(&doc).unwrap(),
        )
        .unwrap();
    }
    (tmp, copy, renamed)
}

/// The text of a page's `<main>`, white space folded.
fn main_text(site: &Path, name: &str) -> String {
    let body = Selector::parse("main").unwrap();
    page(site, name)
        .select(&body)
        .map(text)
        .collect::<Vec<_>>()
        .join(" ")
}

/// The prose follows the card the documents were measured on, among the cards it was written
/// for (`cards` in templates/prose/prelude.md: the H200 and the H100 80GB HBM3): the committed data
/// (its top level, where each suite has one card) with the two cards' names swapped in every GPU
/// document builds the same pages with the names swapped, no sentence lost or gained and no
/// card named by hand. (On 2026-12-05 the
/// kernel sums, rerun on an H100, lost their whole GPU section, whose templates named the H200,
/// and kept a sentence saying the kernels had no GPU rows yet; the build passed.)
#[test]
fn the_prose_follows_the_card_the_documents_name() {
    const H200: &str = "NVIDIA H200";
    const H100: &str = "NVIDIA H100 80GB HBM3";
    let data = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data");
    let (_tmp, renamed, swapped) = with_gpus_renamed(&data, |_, name| match name {
        H200 => Some(H100),
        H100 => Some(H200),
        other => panic!("a GPU document on {other}: add it to the swap"),
    });
    assert!(swapped > 0, "the committed data has GPU documents");
    // The copy holds the data folder's top level only, one card per suite (`data/h100/` adds
    // the H100 beside the H200's attention documents, and the swap would then only trade which
    // card's rows the prose describes): the committed pages are built from the same copy.
    let (_c, top_level, _) = with_gpus_renamed(&data, |_, _| None);
    let (_a, before) = build_site(&top_level, None);
    let (_b, after) = build_site(&renamed, None);
    for name in ["index.html", "attention.html", "mixers.html", "hopper.html"] {
        let of = |site: &Path| main_text(site, name);
        // Lists of both cards come sorted by name, which the swap reverses.
        let unordered = |t: String| {
            t.replace("H100 80GB HBM3, H200", "\u{2}")
                .replace("H200, H100 80GB HBM3", "\u{2}")
        };
        let (a, b) = (unordered(of(&before)), of(&after));
        assert!(
            a.contains("H200") || a.contains("H100"),
            "{name}: no card on the page"
        );
        // The renamed pages with the names swapped back, short names included.
        let b = b
            .replace("H100 80GB HBM3", "\u{1}")
            .replace("H200", "H100 80GB HBM3")
            .replace('\u{1}', "H200");
        let b = unordered(b);
        if a != b {
            let at = a
                .char_indices()
                .zip(b.chars())
                .find(|((_, x), y)| x != y)
                .map_or(a.len().min(b.len()), |((i, _), _)| i);
            // Char boundaries around the first difference (str::floor_char_boundary is newer
            // than the crate's rust-version).
            let window = |t: &str| -> String {
                t.char_indices()
                    .skip_while(|(i, _)| *i + 200 < at)
                    .take_while(|(i, _)| *i < at + 300)
                    .map(|(_, ch)| ch)
                    .collect()
            };
            panic!(
                "{name}: the text changes with the cards' names at byte {at}:\n committed: {}\n swapped:   {}",
                window(&a),
                window(&b)
            );
        }
    }
}

/// A suite measured on a card the curated prose does not list (`cards`) gets its tables and
/// figures and a sentence saying why it has no others, but neither the sentences about that
/// card's rows nor the ones for a suite without GPU rows ("no rows here yet"): the committed
/// kernel sums renamed to another card.
#[test]
fn a_card_the_prose_does_not_list_gets_no_sentences_either_way() {
    const OTHER: &str = "NVIDIA A100-SXM4-80GB";
    let data = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data");
    let (_tmp, renamed, moved) =
        with_gpus_renamed(&data, |suite, _| (suite == "kernel_sums").then_some(OTHER));
    assert!(moved > 0, "the committed data has kernel-sum GPU documents");
    let of = main_text;
    let (_a, before) = build_site(&data, None);
    let (_b, after) = build_site(&renamed, None);
    let (mixers_before, mixers) = (of(&before, "mixers.html"), of(&after, "mixers.html"));
    let index = of(&after, "index.html");
    assert!(mixers_before.contains("Kernel sums on the H100 80GB HBM3"));
    assert!(
        !mixers.contains("Kernel sums on the"),
        "the curated section stayed"
    );
    assert!(mixers.contains(OTHER), "the card's tables are on the page");
    // What stands in for the sentences says why.
    assert!(
        mixers.contains(&format!(
            "The kernel-sum GPU rows here were measured on the {OTHER}. This page's sentences \
             about GPU rows are written for the NVIDIA H200 and NVIDIA H100 80GB HBM3"
        )),
        "no word on why the section has no sentences"
    );
    assert!(!mixers_before.contains("GPU rows here were measured on the"));
    for sentence in [
        "have no rows here yet",
        "Kernel sums are measured on the CPU only",
    ] {
        assert!(
            !mixers.contains(sentence) && !index.contains(sentence),
            "{sentence:?} on a page while the suite has GPU rows"
        );
    }
}

/// The at-a-glance tables of the committed data: one per (suite, card, axis), so the decoding
/// grid's seq_len_kv is never a column of the grid's seq_len; cases without the axis (separate
/// query and key lengths) sit under "other shapes", and no sentence of the page names a size
/// "—" (on 2026-12-06 the H200's table had a "seq_len —" column and seq_len_kv values under
/// seq_len).
#[test]
fn glance_tables_keep_one_axis_each_and_name_no_missing_size() {
    let data = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data");
    let (_tmp, site) = build_site(&data, None);
    let html = page(&site, "index.html");
    let table = Selector::parse("table.glance").unwrap();
    let th = Selector::parse("thead th").unwrap();
    let mut axes = 0;
    for t in html.select(&table) {
        let heads: Vec<String> = t.select(&th).skip(2).map(text).collect();
        let axis = heads
            .iter()
            .find(|h| *h != "other shapes")
            .and_then(|h| h.split_whitespace().next())
            .expect("a size column")
            .to_string();
        for h in &heads {
            assert!(
                h == "other shapes" || h.split_whitespace().next() == Some(axis.as_str()),
                "{h} in a table by {axis}"
            );
        }
        axes += usize::from(axis == "seq_len_kv");
    }
    assert!(axes > 0, "the decoding grid has a table of its own");
    let body = main_text(&site, "index.html");
    for named in [" —:", "= —", "=—"] {
        assert!(!body.contains(named), "a size named — ({named:?})");
    }
}

/// Every kernel tuning notes file beside the templates folder becomes a page (a missing one
/// none); the navigation has one entry for them, current on each, and each notes page names
/// its file and links the others; prose and notes that name a published notes file in a code
/// span link its page, and one not published stays plain; the overview's pointer to the notes
/// links every notes page.
#[test]
fn each_tuning_notes_file_is_a_page_and_prose_links_it() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    fs::create_dir_all(root.join("templates/prose")).unwrap();
    fs::create_dir_all(root.join("kernels")).unwrap();
    fs::write(
        root.join("templates/prose/limitations.md"),
        "- See `kernels/TUNING-moe.md`, and `kernels/TUNING-kernel-sums.md`.\n",
    )
    .unwrap();
    fs::write(
        root.join("kernels/TUNING.md"),
        "# Attention notes\n\n## v1 tiles\n\nThe grouped GEMM is in `kernels/TUNING-moe.md`.\n",
    )
    .unwrap();
    fs::write(
        root.join("kernels/TUNING-moe.md"),
        "# MoE notes\n\n## v1 grouped\n\nOne CTA per expert tile.\n",
    )
    .unwrap();
    let out = root.join("site");
    site::build(&BuildOptions {
        data_dir: valid_dir(),
        out_dir: out.clone(),
        base_url: None,
        templates_dir: Some(root.join("templates")),
    })
    .unwrap_or_else(|e| panic!("build failed: {e:#}"));
    assert!(out.join("tuning.html").is_file());
    assert!(out.join("tuning-moe.html").is_file());
    assert!(!out.join("tuning-kernel-sums.html").exists());
    assert!(!out.join("tuning-sequence-mixers.html").exists());
    let nav = sel("nav[aria-label=Pages] a");
    for (file, source, title) in [
        ("tuning.html", "kernels/TUNING.md", "Attention"),
        ("tuning-moe.html", "kernels/TUNING-moe.md", "MoE"),
    ] {
        let html = page(&out, file);
        let notes: Vec<_> = html
            .select(&nav)
            .filter(|a| text(*a) == "Kernel tuning notes")
            .collect();
        assert_eq!(notes.len(), 1, "{file}: one navigation entry for the notes");
        assert_eq!(notes[0].value().attr("href"), Some("tuning.html"));
        assert_eq!(
            notes[0].value().attr("aria-current"),
            Some("page"),
            "{file}"
        );
        let notice = html.select(&sel("p.notice code")).next().map(text);
        assert_eq!(notice.as_deref(), Some(source), "{file}");
        let switch = html.select(&sel("nav.notes-pages")).next().expect(file);
        let current: Vec<String> = switch
            .select(&sel("[aria-current=page]"))
            .map(text)
            .collect();
        assert_eq!(current, [title], "{file}");
        let others: Vec<(String, String)> = switch
            .select(&sel("a"))
            .map(|a| (text(a), a.value().attr("href").unwrap().to_string()))
            .collect();
        assert_eq!(others.len(), 1, "{file}: {others:?}");
        assert_ne!(others[0].0, title);
        let title_tag = html.select(&sel("title")).next().map(text).unwrap();
        assert!(title_tag.contains(title), "{file}: {title_tag}");
        // The notes' own title (`# MoE notes`) gives way to the page's: one h1.
        let h1: Vec<String> = html.select(&sel("h1")).map(text).collect();
        assert_eq!(h1, std::slice::from_ref(&title_tag), "{file}");
        assert!(html.select(&sel("h2")).any(|h| text(h).starts_with("v1 ")));
    }
    let code_link = sel("a > code");
    let linked = |html: &Html| -> Vec<(String, String)> {
        html.select(&code_link)
            .map(|c| {
                let a = ElementRef::wrap(c.parent().unwrap()).unwrap();
                (text(c), a.value().attr("href").unwrap().to_string())
            })
            .collect()
    };
    let attention_notes = page(&out, "tuning.html");
    assert!(linked(&attention_notes).contains(&(
        "kernels/TUNING-moe.md".to_string(),
        "tuning-moe.html".to_string()
    )));
    let index = page(&out, "index.html");
    let links = linked(&index);
    assert!(
        links.contains(&(
            "kernels/TUNING-moe.md".to_string(),
            "tuning-moe.html".to_string()
        )),
        "{links:?}"
    );
    assert!(
        !links
            .iter()
            .any(|(c, _)| c == "kernels/TUNING-kernel-sums.md"),
        "a notes file without a page stays plain: {links:?}"
    );
    assert!(main_text(&out, "index.html").contains("kernels/TUNING-kernel-sums.md"));
    // The limitations' pointer names every notes page present, not the first alone.
    let why = index
        .select(&sel("p"))
        .find(|p| text(*p).contains("Why the kernels stand where they do"))
        .expect("the pointer to the notes");
    let notes: Vec<(String, String)> = why
        .select(&sel("a"))
        .map(|a| (text(a), a.value().attr("href").unwrap().to_string()))
        .collect();
    assert_eq!(
        notes,
        [
            ("Attention".to_string(), "tuning.html".to_string()),
            ("MoE".to_string(), "tuning-moe.html".to_string())
        ]
    );
}

/// A tile sweep names its own suite's notes file and links its page only where that file is a
/// page: with only another suite's notes beside the templates, the attention sweep names
/// `kernels/TUNING.md` unlinked rather than linking the other suite's page.
#[test]
fn a_tile_sweep_links_its_own_suites_notes() {
    let data = grid_and_tile_sweep("2222222222222222222222222222222222222222");
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    fs::create_dir_all(root.join("templates")).unwrap();
    fs::create_dir_all(root.join("kernels")).unwrap();
    fs::write(root.join("kernels/TUNING-moe.md"), "# MoE notes\n\n## v1\n").unwrap();
    let build = |out: &Path| {
        site::build(&BuildOptions {
            data_dir: data.path().to_path_buf(),
            out_dir: out.to_path_buf(),
            base_url: None,
            templates_dir: Some(root.join("templates")),
        })
        .unwrap_or_else(|e| panic!("build failed: {e:#}"));
        let html = page(out, "attention.html");
        let section = html.select(&sel("section.tile-sweep")).next().unwrap();
        let codes: Vec<String> = section.select(&sel("p code")).map(text).collect();
        let links: Vec<String> = section
            .select(&sel("p a"))
            .filter_map(|a| a.value().attr("href").map(str::to_string))
            .collect();
        (codes, links)
    };
    let (codes, links) = build(&root.join("site1"));
    assert!(codes.iter().any(|c| c == "kernels/TUNING.md"), "{codes:?}");
    assert!(
        !links.iter().any(|l| l.starts_with("tuning")),
        "no notes page of attention: {links:?}"
    );
    fs::write(
        root.join("kernels/TUNING.md"),
        "# Attention notes\n\n## v1\n",
    )
    .unwrap();
    let (_, links) = build(&root.join("site2"));
    assert!(links.iter().any(|l| l == "tuning.html"), "{links:?}");
    assert!(!links.iter().any(|l| l == "tuning-moe.html"), "{links:?}");
}

/// A copy of the data folder `data` (its sub-folders too) with `edit` applied to each JSON
/// document whose path relative to `data` starts with `prefix`.
fn data_with_edits(
    data: &Path,
    prefix: &str,
    edit: impl Fn(&mut serde_json::Value),
) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let copy = tmp.path().join("data");
    for entry in walkdir::WalkDir::new(data) {
        let entry = entry.unwrap();
        let rel = entry.path().strip_prefix(data).unwrap();
        let to = copy.join(rel);
        if entry.file_type().is_dir() {
            fs::create_dir_all(&to).unwrap();
        } else if rel.to_string_lossy().starts_with(prefix)
            && rel.extension().and_then(|e| e.to_str()) == Some("json")
        {
            let mut doc: serde_json::Value =
                serde_json::from_str(&fs::read_to_string(entry.path()).unwrap()).unwrap();
            edit(&mut doc);
            fs::write(&to, serde_json::to_string(&doc).unwrap()).unwrap();
        } else {
            fs::copy(entry.path(), &to).unwrap();
        }
    }
    (tmp, copy)
}

/// The committed data's masks grids: the H100's ran flex's forward and backward on the wgmma
/// kernels, so the Attention page states that card's ratios against PyTorch's flex, forward and
/// forward + backward (checked claims), and no limitation names a portable backward. The same
/// documents with the backward's dispatch rule made the portable one's (and flex's forward +
/// backward times tripled, as the portable backward trailed PyTorch's) list flex's portable
/// backward under that card and claim PyTorch's flex faster there; without the H100's
/// documents (the top level only, where the H200's masks grid predates flex's backward) that
/// item goes.
#[test]
fn flex_wgmma_rows_get_claims_and_the_portable_backward_a_limitation() {
    let data = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data");
    let item = "flex's backward in the masks rows is the portable kernel.";
    let (_tmp, site) = build_site(&data, None);
    let attention = main_text(&site, "attention.html");
    assert!(
        attention.contains(
            "ran flex's forward on the wgmma kernel and its backward inside the wgmma backward \
             (kernels/flex_attn_bwd_sm90.cu). There, forward, flex is faster than torch_flex"
        ),
        "no claims for the wgmma masks grid"
    );
    assert!(
        attention.contains("Forward + backward, flex is faster than torch_flex"),
        "no forward + backward claim"
    );
    assert!(!main_text(&site, "index.html").contains(item));

    let (_p, portable) = data_with_edits(&data, "h100/gpu_attention_masks", |doc| {
        for rule in doc["config"]["dispatch"].as_array_mut().unwrap() {
            if let Some(text) = rule["rule"].as_str() {
                if let Some(at) = text.find("; the backward on the wgmma backward") {
                    rule["rule"] = format!("{}; the backward as below", &text[..at]).into();
                }
            }
        }
        for row in doc["rows"].as_array_mut().unwrap() {
            if row["implementation"] == "flex" && row["case"]["pass"] == "fwd+bwd" {
                for field in ["median_ms", "q1_ms", "q3_ms"] {
                    row[field] = (row[field].as_f64().unwrap() * 3.0).into();
                }
            }
        }
    });
    let (_b, site) = build_site(&portable, None);
    let attention = main_text(&site, "attention.html");
    let index = main_text(&site, "index.html");
    assert!(attention.contains("ran flex's forward on the wgmma kernel. There, forward,"));
    assert!(attention.contains(
        "Those rows' backward is the portable kernel, and, forward + backward, torch_flex is \
         faster than flex"
    ));
    assert!(index.contains(item), "the portable backward is not listed");
    assert!(
        index.contains("So on the NVIDIA H100 80GB HBM3, forward + backward, torch_flex"),
        "the item names the card whose rows it quotes"
    );
    let (_c, top_level, _) = with_gpus_renamed(&data, |_, _| None);
    let (_d, without) = build_site(&top_level, None);
    assert!(
        !main_text(&without, "index.html").contains(item),
        "listed with no card's flex forward + backward rows"
    );
}

/// The committed sequence-mixer documents' SSD rule is an earlier forward's, so the overview
/// lists the rows as predating the kernels' later versions; the same documents whose rule is
/// the runner's current one (the walks of chunks) do not get the item.
#[test]
fn sequence_mixer_rows_older_than_the_runners_kernels_are_a_limitation() {
    let data = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data");
    let item = "sequence-mixer rows predate the kernels' later versions.";
    let (_tmp, site) = build_site(&data, None);
    assert!(main_text(&site, "index.html").contains(item));
    let (_c, current) = data_with_edits(&data, "gpu_sequence_mixers", |doc| {
        for rule in doc["config"]["dispatch"].as_array_mut().unwrap() {
            if rule["entry_point"] == "sequence_mixers::cuda::Ssd" {
                let text = rule["rule"].as_str().unwrap().to_string();
                rule["rule"] = format!("{text}; the walks' states passed from walk to walk").into();
            }
        }
    });
    let (_d, site) = build_site(&current, None);
    assert!(!main_text(&site, "index.html").contains(item));
}
