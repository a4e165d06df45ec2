//! docgen never loses a file it did not write: `build`, `figures` and `serve` replace an output
//! folder only when it is missing, empty or a site docgen wrote, and never one that is, holds
//! or lies inside the data or templates folder. Every refusal exits with code 2, names the
//! folder and the reason, and leaves every file as it was. End to end, through the binary.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn docgen() -> Command {
    Command::new(env!("CARGO_BIN_EXE_docgen"))
}

/// Every file under `dir` (hidden ones and `.git` included) with its bytes.
fn snapshot(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    walkdir::WalkDir::new(dir)
        .into_iter()
        .map(|e| e.unwrap())
        .filter(|e| e.file_type().is_file())
        .map(|e| (e.path().to_path_buf(), fs::read(e.path()).unwrap()))
        .collect()
}

/// A project folder: `data/` with the committed GPU attention run, optionally a git
/// repository with it committed.
struct Project {
    dir: tempfile::TempDir,
}

impl Project {
    fn new(git: bool) -> Project {
        let dir = tempfile::tempdir().unwrap();
        fs::create_dir(dir.path().join("data")).unwrap();
        // The committed GPU run: its parts (the prose needs all of them).
        for e in fs::read_dir(root().join("data")).unwrap() {
            let name = e.unwrap().file_name().into_string().unwrap();
            if name.starts_with("gpu_attention") && name.ends_with(".json") {
                fs::copy(
                    root().join("data").join(&name),
                    dir.path().join("data").join(&name),
                )
                .unwrap();
            }
        }
        if git {
            let git = |args: &[&str]| {
                let ok = Command::new("git")
                    .args(args)
                    .current_dir(dir.path())
                    .output()
                    .map(|o| o.status.success())
                    .unwrap_or(false);
                assert!(ok, "git {args:?}");
            };
            git(&["init", "-q"]);
            git(&["add", "data"]);
            git(&[
                "-c",
                "user.name=t",
                "-c",
                "user.email=t@t",
                "commit",
                "-qm",
                "data",
            ]);
        }
        Project { dir }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Runs docgen in the project folder; returns (exit code, stderr).
    fn docgen(&self, args: &[&str]) -> (Option<i32>, String) {
        let out = docgen()
            .args(args)
            .current_dir(self.path())
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// Asserts that `args` is refused with code 2, naming `reason`, and that no file changed.
    fn refused(&self, args: &[&str], reason: &str) {
        let before = snapshot(self.path());
        let (code, stderr) = self.docgen(args);
        assert_eq!(code, Some(2), "{args:?}: {stderr}");
        assert!(
            stderr.contains("refusing to write to"),
            "{args:?}: {stderr}"
        );
        assert!(stderr.contains(reason), "{args:?}: {stderr}");
        assert!(stderr.contains("Nothing was changed"), "{stderr}");
        assert_eq!(snapshot(self.path()), before, "{args:?} changed files");
        // No temporary folder left beside anything.
        let hidden: Vec<_> = walkdir::WalkDir::new(self.path())
            .into_iter()
            .map(|e| e.unwrap())
            .filter(|e| e.file_name().to_string_lossy().contains(".tmp-"))
            .collect();
        assert!(hidden.is_empty(), "{hidden:?}");
    }
}

#[test]
fn build_into_a_git_repository_that_holds_the_data_is_refused() {
    let p = Project::new(true);
    let here = p.path().to_str().unwrap().to_string();
    p.refused(&["build", "--out", &here], "holds the data folder");
    p.refused(&["build", "--out", "."], "holds the data folder");
    assert!(p.path().join(".git").is_dir());
    assert!(p.path().join("data/gpu_attention_fwd_1.json").is_file());
    // With the data elsewhere, the repository is still refused as a git work tree.
    let elsewhere = tempfile::tempdir().unwrap();
    fs::rename(p.path().join("data"), elsewhere.path().join("data")).unwrap();
    let data = elsewhere.path().join("data");
    p.refused(
        &["build", "--data", data.to_str().unwrap(), "--out", &here],
        "is a git work tree",
    );
    assert!(p.path().join(".git").is_dir());
}

#[test]
fn build_and_figures_into_the_data_folder_are_refused() {
    let p = Project::new(false);
    p.refused(&["build", "--out", "data"], "it is the data folder");
    p.refused(&["figures", "--out", "data"], "it is the data folder");
    p.refused(
        &["build", "--out", "data/site"],
        "lies inside the data folder",
    );
    p.refused(
        &["figures", "--out", "./data/../data"],
        "it is the data folder",
    );
    assert!(p.path().join("data/gpu_attention_fwd_1.json").is_file());
}

#[test]
fn the_parent_of_the_data_folder_and_unrelated_files_are_refused() {
    let p = Project::new(false);
    fs::create_dir_all(p.path().join("work/data")).unwrap();
    fs::copy(
        p.path().join("data/gpu_attention_fwd_1.json"),
        p.path().join("work/data/gpu_attention_fwd_1.json"),
    )
    .unwrap();
    p.refused(
        &["build", "--data", "work/data", "--out", "work"],
        "holds the data folder",
    );
    fs::create_dir(p.path().join("notes")).unwrap();
    fs::write(p.path().join("notes/todo.txt"), "mine").unwrap();
    p.refused(&["build", "--out", "notes"], "not a docgen site");
    p.refused(&["figures", "--out", "notes"], "not a docgen site");
    fs::write(p.path().join("a-file"), "mine").unwrap();
    p.refused(&["build", "--out", "a-file"], "not a folder");
}

#[test]
fn the_templates_folder_is_protected_like_the_data() {
    let p = Project::new(false);
    fs::create_dir_all(p.path().join("theme/prose")).unwrap();
    fs::copy(
        root().join("templates/style.css"),
        p.path().join("theme/style.css"),
    )
    .unwrap();
    for (out, reason) in [
        ("theme", "it is the templates folder"),
        ("theme/site", "lies inside the templates folder"),
        (".", "holds the"),
    ] {
        p.refused(&["build", "--templates", "theme", "--out", out], reason);
    }
}

#[test]
fn a_docgen_site_with_a_file_the_user_added_is_refused() {
    let p = Project::new(false);
    let (code, stderr) = p.docgen(&["build", "--out", "site"]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(p.path().join("site/.docgen-manifest.json").is_file());
    fs::write(p.path().join("site/CNAME"), "perf.example.org").unwrap();
    p.refused(&["build", "--out", "site"], "CNAME");
    fs::remove_file(p.path().join("site/CNAME")).unwrap();
    // Its own site, as it wrote it, is replaced.
    let (code, stderr) = p.docgen(&["build", "--out", "site"]);
    assert_eq!(code, Some(0), "{stderr}");
}

#[test]
fn missing_and_empty_folders_are_written() {
    let p = Project::new(false);
    let (code, stderr) = p.docgen(&["build", "--out", "new/site"]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(p.path().join("new/site/index.html").is_file());
    fs::create_dir(p.path().join("empty")).unwrap();
    let (code, stderr) = p.docgen(&["figures", "--out", "empty"]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(p.path().join("empty/at-a-glance.svg").is_file());
    // What build says it wrote, and how to look at it.
    let (_, stderr) = p.docgen(&["build", "--out", "new/site"]);
    let documents = fs::read_dir(p.path().join("data")).unwrap().count();
    let read = format!("read {documents} documents");
    for needle in [
        read.as_str(),
        "gpu_attention_fwd_1.json",
        "pages (",
        "figures",
        "docgen serve",
        "index.html",
    ] {
        assert!(stderr.contains(needle), "{needle}: {stderr}");
    }
}

#[test]
fn the_refusal_comes_before_any_work() {
    // Broken data and a forbidden output: the output is what is reported.
    let p = Project::new(false);
    fs::write(p.path().join("data/broken.json"), "{").unwrap();
    p.refused(&["build", "--out", "data"], "it is the data folder");
}

#[test]
fn serve_refuses_the_same_folders() {
    let p = Project::new(false);
    p.refused(
        &["serve", "--port", "0", "--out", "data"],
        "it is the data folder",
    );
}

#[test]
fn a_relative_base_url_is_refused_and_check_names_a_base_url_mismatch() {
    let p = Project::new(false);
    let (code, stderr) = p.docgen(&["build", "--base-url", "docs/"]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("/docs/"), "{stderr}");
    assert!(!p.path().join("site").exists());
    let (code, stderr) = p.docgen(&["build", "--base-url", "/docs/"]);
    assert_eq!(code, Some(0), "{stderr}");
    fs::copy(
        root().join("data/schema.json"),
        p.path().join("data/schema.json"),
    )
    .unwrap();
    let (code, stderr) = p.docgen(&["check", "--base-url", "/docs/"]);
    assert_eq!(code, Some(0), "{stderr}");
    let (code, stderr) = p.docgen(&["check"]);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.contains("was built with --base-url /docs/") && stderr.contains("likely cause"),
        "{stderr}"
    );
}

#[test]
fn check_calls_the_site_stale_after_a_template_edit() {
    let p = Project::new(false);
    fs::create_dir_all(p.path().join("templates/prose")).unwrap();
    fs::copy(
        root().join("templates/prose/attention.md"),
        p.path().join("templates/prose/attention.md"),
    )
    .unwrap();
    fs::copy(
        root().join("data/schema.json"),
        p.path().join("data/schema.json"),
    )
    .unwrap();
    let (code, stderr) = p.docgen(&["build"]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stderr.contains("templates: templates"), "{stderr}");
    let (code, stderr) = p.docgen(&["check"]);
    assert_eq!(code, Some(0), "{stderr}");
    let md = p.path().join("templates/prose/attention.md");
    let text = fs::read_to_string(&md).unwrap();
    fs::write(&md, format!("{text}\nAn edited sentence.\n")).unwrap();
    let (code, stderr) = p.docgen(&["check"]);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("other templates"), "{stderr}");
    // The next build shows the edit.
    let (code, stderr) = p.docgen(&["build"]);
    assert_eq!(code, Some(0), "{stderr}");
    let page = fs::read_to_string(p.path().join("site/attention.html")).unwrap();
    assert!(page.contains("An edited sentence."));
}

#[test]
fn version_names_docgen() {
    let out = docgen().arg("--version").output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.starts_with("docgen "), "{text}");
}

#[test]
fn schema_replaces_only_a_schema_docgen_wrote() {
    let p = Project::new(false);
    fs::write(p.path().join("notes.txt"), "mine").unwrap();
    p.refused(&["schema", "--out", "notes.txt"], "not a document schema");
    let (code, stderr) = p.docgen(&["schema", "--out", "data/schema.json"]);
    assert_eq!(code, Some(0), "{stderr}");
    let (code, stderr) = p.docgen(&["schema", "--out", "data/schema.json"]);
    assert_eq!(code, Some(0), "its own schema is replaced: {stderr}");
}

#[test]
fn figures_inside_a_docgen_site_say_so() {
    let p = Project::new(false);
    let (code, stderr) = p.docgen(&["build", "--out", "site"]);
    assert_eq!(code, Some(0), "{stderr}");
    p.refused(
        &["figures", "--out", "site/figures"],
        "lies inside the docgen site",
    );
}

#[test]
fn the_build_says_how_to_serve_what_it_wrote() {
    let p = Project::new(false);
    let (_, stderr) = p.docgen(&["build", "--out", "elsewhere", "--base-url", "/docs/"]);
    assert!(
        stderr.contains("serve --out elsewhere --base-url /docs/"),
        "{stderr}"
    );
    assert!(!stderr.contains("index.html in a browser"), "{stderr}");
}

#[test]
fn a_copied_document_is_one_error_not_one_per_row() {
    let p = Project::new(false);
    fs::create_dir(p.path().join("data/h200")).unwrap();
    fs::copy(
        p.path().join("data/gpu_attention_fwd_1.json"),
        p.path().join("data/h200/gpu_attention_fwd_1.json"),
    )
    .unwrap();
    let (code, stderr) = p.docgen(&["build", "--out", "site"]);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("not shards of one run"), "{stderr}");
    assert!(!stderr.contains("duplicate row"), "{stderr}");
}
