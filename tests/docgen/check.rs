//! `docgen check`: passes on a fresh build of the fixture, and lists every problem (non-zero
//! exit) for a stale or hand-edited site, a broken link or anchor, a stale `schema.json` and a
//! document the JSON Schema refuses. Everything happens in temporary folders.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use kernelpages::load;
use kernelpages::site::check::{self, Area, CheckOptions, Problem};
use kernelpages::site::{self, BuildOptions};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// A data folder (fixture document and a fresh schema.json) and a site built from it.
struct Project {
    _tmp: tempfile::TempDir,
    data: PathBuf,
    site: PathBuf,
}

impl Project {
    fn new() -> Project {
        let tmp = tempfile::tempdir().unwrap();
        let data = tmp.path().join("data");
        fs::create_dir(&data).unwrap();
        fs::copy(
            fixtures().join("valid/gpu_attention.json"),
            data.join("gpu_attention.json"),
        )
        .unwrap();
        load::write_schema(&data).unwrap();
        let site = tmp.path().join("site");
        site::build(&BuildOptions {
            data_dir: data.clone(),
            out_dir: site.clone(),
            base_url: None,
            templates_dir: None,
        })
        .unwrap_or_else(|e| panic!("{e:#}"));
        Project {
            _tmp: tmp,
            data,
            site,
        }
    }

    fn check(&self) -> Vec<Problem> {
        check::check(&CheckOptions {
            data_dir: self.data.clone(),
            out_dir: self.site.clone(),
            base_url: None,
            templates_dir: None,
        })
    }

    fn docgen_check(&self) -> (bool, String) {
        let out = Command::new(env!("CARGO_BIN_EXE_docgen"))
            .arg("check")
            .arg("--data")
            .arg(&self.data)
            .arg("--out")
            .arg(&self.site)
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }
}

fn has(problems: &[Problem], area: Area, parts: &[&str]) -> bool {
    problems
        .iter()
        .any(|p| p.area == area && parts.iter().all(|s| p.message.contains(s)))
}

fn append(path: &Path, text: &str) {
    let mut s = fs::read_to_string(path).unwrap();
    s.push_str(text);
    fs::write(path, s).unwrap();
}

#[test]
fn a_fresh_build_passes() {
    let p = Project::new();
    assert_eq!(p.check(), []);
    let (ok, stderr) = p.docgen_check();
    assert!(ok, "{stderr}");
    assert!(stderr.contains("check passed"), "{stderr}");
}

#[test]
fn a_stale_site_lists_differing_missing_and_extra_files() {
    let p = Project::new();
    append(&p.site.join("index.html"), "<!-- edited by hand -->");
    fs::remove_file(p.site.join("style.css")).unwrap();
    fs::write(p.site.join("figures/old.svg"), "<svg/>").unwrap();
    let problems = p.check();
    assert!(
        has(&problems, Area::Site, &["index.html", "differs"]),
        "{problems:#?}"
    );
    assert!(
        has(&problems, Area::Site, &["style.css", "missing"]),
        "{problems:#?}"
    );
    assert!(
        has(&problems, Area::Site, &["figures/old.svg", "not part of"]),
        "{problems:#?}"
    );
    let (ok, stderr) = p.docgen_check();
    assert!(!ok);
    assert!(
        stderr.contains("index.html") && stderr.contains("style.css"),
        "{stderr}"
    );
    assert!(stderr.contains("problems"), "{stderr}");
}

#[test]
fn broken_links_and_anchors_are_listed() {
    let p = Project::new();
    append(
        &p.site.join("attention.html"),
        r##"<a href="nope.html">x</a><a href="index.html#no-such-section">y</a><img src="figures/missing.svg"><a href="index.html#methodology">fine</a>"##,
    );
    let problems = p.check();
    assert!(
        has(
            &problems,
            Area::Link,
            &["attention.html", "nope.html is not in the site"]
        ),
        "{problems:#?}"
    );
    assert!(
        has(
            &problems,
            Area::Link,
            &["no element with id \"no-such-section\""]
        ),
        "{problems:#?}"
    );
    assert!(
        has(
            &problems,
            Area::Link,
            &["<img src=\"figures/missing.svg\">"]
        ),
        "{problems:#?}"
    );
    assert!(
        !problems.iter().any(|q| q.message.contains("#methodology")),
        "{problems:#?}"
    );
    // The edit also makes the page differ from a fresh build: both are reported.
    assert!(
        has(&problems, Area::Site, &["attention.html"]),
        "{problems:#?}"
    );
    assert!(!p.docgen_check().0);
}

#[test]
fn a_stale_schema_fails() {
    let p = Project::new();
    fs::write(p.data.join("schema.json"), "{}\n").unwrap();
    let problems = p.check();
    assert_eq!(problems.len(), 1, "{problems:#?}");
    assert!(
        has(&problems, Area::Data, &["schema.json", "stale"]),
        "{problems:#?}"
    );
    let (ok, stderr) = p.docgen_check();
    assert!(!ok);
    assert!(stderr.contains("stale"), "{stderr}");

    fs::remove_file(p.data.join("schema.json")).unwrap();
    assert!(has(&p.check(), Area::Data, &["schema.json"]));
}

#[test]
fn a_document_the_schema_refuses_is_reported_with_every_other_problem() {
    let p = Project::new();
    fs::copy(
        fixtures().join("invalid/unknown_status/gpu_attention.json"),
        p.data.join("gpu_bad.json"),
    )
    .unwrap();
    append(&p.site.join("index.html"), r#"<a href="gone.html">x</a>"#);
    let problems = p.check();
    assert!(
        has(
            &problems,
            Area::Data,
            &["gpu_bad.json:123:", "JSON Schema", "rows[1].status"]
        ),
        "{problems:#?}"
    );
    // The site cannot be compared without the data, but its links are still checked.
    assert!(
        has(&problems, Area::Site, &["not compared"]),
        "{problems:#?}"
    );
    assert!(has(&problems, Area::Link, &["gone.html"]), "{problems:#?}");
}

#[test]
fn a_semantic_error_the_schema_allows_is_reported() {
    let p = Project::new();
    fs::copy(
        fixtures().join("invalid/negative_median/gpu_attention.json"),
        p.data.join("gpu_attention.json"),
    )
    .unwrap();
    let problems = p.check();
    assert!(
        has(&problems, Area::Data, &["gpu_attention.json", "median_ms"]),
        "{problems:#?}"
    );
}

/// `docgen figures` writes exactly the SVG files `build` writes under `figures/`.
#[test]
fn figures_command_writes_the_site_figures() {
    let tmp = tempfile::tempdir().unwrap();
    let site = tmp.path().join("site");
    let figs = tmp.path().join("figs");
    let docgen = env!("CARGO_BIN_EXE_docgen");
    let data = concat!(env!("CARGO_MANIFEST_DIR"), "/data");
    let ok = |args: &[&str]| {
        let st = std::process::Command::new(docgen)
            .args(args)
            .status()
            .unwrap();
        assert!(st.success(), "{args:?}");
    };
    ok(&["build", "--data", data, "--out", site.to_str().unwrap()]);
    ok(&["figures", "--data", data, "--out", figs.to_str().unwrap()]);
    // The figures and docgen's manifest.
    let mut names: Vec<_> = std::fs::read_dir(&figs)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .filter(|n| n != ".docgen-manifest.json")
        .collect();
    assert!(figs.join(".docgen-manifest.json").is_file());
    names.sort();
    assert!(!names.is_empty());
    let mut site_names: Vec<_> = std::fs::read_dir(site.join("figures"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    site_names.sort();
    assert_eq!(names, site_names);
    for n in &names {
        assert_eq!(
            std::fs::read(figs.join(n)).unwrap(),
            std::fs::read(site.join("figures").join(n)).unwrap(),
            "{n:?}"
        );
    }
}

/// Three problems in one file, and a schema error beside loader errors: all are reported,
/// each with file, line and JSON path.
#[test]
fn every_problem_of_every_file_is_reported() {
    let p = Project::new();
    let text = fs::read_to_string(p.data.join("gpu_attention.json")).unwrap();
    let mut doc: serde_json::Value = serde_json::from_str(&text).unwrap();
    doc["rows"][0]["median_ms"] = serde_json::json!(0.0);
    doc["rows"][1]["q1_ms"] = serde_json::json!(1e9);
    doc["rows"][2]["accuracy"]["rel_err"] = serde_json::json!(-1.0);
    fs::write(
        p.data.join("gpu_attention.json"),
        serde_json::to_string_pretty(&doc).unwrap(),
    )
    .unwrap();
    // A second file with a loader-only problem (a declared count missing on an ok row).
    doc["rows"][0]["median_ms"] = doc["rows"][3]["median_ms"].clone();
    doc["rows"][1]["q1_ms"] = doc["rows"][3]["q1_ms"].clone();
    doc["rows"][2]["accuracy"]["rel_err"] = serde_json::json!(0.001);
    doc["rows"][4].as_object_mut().unwrap().remove("flops");
    doc["device"]["name"] = serde_json::json!("Another GPU");
    fs::write(
        p.data.join("other.json"),
        serde_json::to_string_pretty(&doc).unwrap(),
    )
    .unwrap();
    let problems = p.check();
    for needle in [
        &["gpu_attention.json:", "rows[0].median_ms"][..],
        &[
            "gpu_attention.json:",
            "rows[1].q1_ms",
            "quartiles out of order",
        ],
        &["gpu_attention.json:", "rows[2].accuracy.rel_err"],
        &["other.json:", "rows[4]", "`flops` is missing"],
    ] {
        assert!(
            has(&problems, Area::Data, needle),
            "{needle:?}: {problems:#?}"
        );
    }
    // Each problem names a line.
    for q in problems.iter().filter(|q| q.area == Area::Data) {
        let after = q.message.split(".json:").nth(1).unwrap_or("");
        assert!(
            after
                .split(':')
                .next()
                .unwrap()
                .parse::<usize>()
                .is_ok_and(|l| l > 1),
            "{q:?}"
        );
    }
}

/// The site committed in `site/` is what `docgen build` makes of the committed `data/` and
/// `templates/`: publishing it publishes the data.
#[test]
fn the_committed_site_is_up_to_date() {
    let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let problems = check::check(&CheckOptions {
        data_dir: root.join("data"),
        out_dir: root.join("site"),
        base_url: None,
        templates_dir: Some(root.join("templates")),
    });
    // Warnings (a larger case faster than a smaller one: launch-bound JAX rows at tiny sizes,
    // cuBLAS choosing differently at 4092 and 4097) are observations about the measurements,
    // shown by `docgen check`; anything else means the site or the data is wrong.
    let (warnings, errors): (Vec<_>, Vec<_>) =
        problems.into_iter().partition(|p| p.area == Area::Warning);
    for w in &warnings {
        eprintln!("{w:?}");
    }
    assert!(
        errors.is_empty(),
        "rebuild it with `cargo run --release --bin docgen -- build`: {errors:#?}"
    );
}

/// A larger case faster than a smaller one beyond both IQRs, all else equal, is a warning:
/// reported with both sizes, and the check still passes.
#[test]
fn a_larger_case_faster_than_a_smaller_one_is_a_warning() {
    let p = Project::new();
    assert!(!p.check().iter().any(|q| q.area == Area::Warning));
    let path = p.data.join("gpu_attention.json");
    let mut doc: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(&path).unwrap()).unwrap();
    // flash at the second size of its first group takes a third of its time at the first.
    let rows = doc["rows"].as_array_mut().unwrap();
    let first = rows
        .iter()
        .position(|r| r["implementation"] == "flash" && r["status"] == "ok")
        .unwrap();
    let small = rows[first].clone();
    let later = rows
        .iter()
        .position(|r| {
            let mut a = r["case"].clone();
            let mut b = small["case"].clone();
            a.as_object_mut().unwrap().remove("seq_len");
            b.as_object_mut().unwrap().remove("seq_len");
            r["implementation"] == "flash"
                && r["status"] == "ok"
                && a == b
                && r["case"]["seq_len"].as_i64() > small["case"]["seq_len"].as_i64()
        })
        .unwrap();
    let m = small["median_ms"].as_f64().unwrap() / 3.0;
    for (k, f) in [("q1_ms", 0.99), ("median_ms", 1.0), ("q3_ms", 1.01)] {
        rows[later][k] = serde_json::json!(m * f);
    }
    fs::write(&path, serde_json::to_string_pretty(&doc).unwrap()).unwrap();
    site::build(&BuildOptions {
        data_dir: p.data.clone(),
        out_dir: p.site.clone(),
        base_url: None,
        templates_dir: None,
    })
    .unwrap();
    let problems = p.check();
    assert!(
        has(
            &problems,
            Area::Warning,
            &["flash is faster at seq_len =", "launch-bound or cached"]
        ),
        "{problems:#?}"
    );
    assert!(problems.iter().all(|q| !q.fails()), "{problems:#?}");
    let (ok, stderr) = p.docgen_check();
    assert!(ok, "{stderr}");
    assert!(
        stderr.contains("[warning]") && stderr.contains("1 warning"),
        "{stderr}"
    );
}
