//! `docgen check`: everything that must hold before the site is published, each problem
//! reported rather than the first.
//!
//! 1. **Data**: every document validates against the JSON Schema generated from
//!    [`crate::schema`] (with `jsonschema`) and passes the loader's semantic checks; the
//!    `schema.json` on disk equals the generated one.
//! 2. **Site**: a fresh build (in memory, the bytes `docgen build` would write) is
//!    byte-identical to the site folder: differing, missing and extra files are listed.
//! 3. **Links**: every `href` and `src` of every HTML page of the site folder resolves to a file
//!    of the site, and every `#anchor` to an `id` on the target page.
//! 4. **Prose**: every query and claim of the prose holds (a failed build; see
//!    [`super::prose`]).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};

use scraper::{Html, Selector};

use super::prose::ProseError;
use super::templates::Sources;
use super::write::Manifest;
use crate::load::{self, Loaded, SCHEMA_FILE_NAME};
use crate::schema;

/// What `docgen check` looks at.
#[derive(Debug, Clone)]
pub struct CheckOptions {
    /// Folder of suite documents and `schema.json`.
    pub data_dir: PathBuf,
    /// The built site to verify.
    pub out_dir: PathBuf,
    /// The base URL the site was built with (`None`: relative links).
    pub base_url: Option<String>,
    /// Folder of templates; `None` reads `templates/` when it exists, else the built-in copies.
    pub templates_dir: Option<PathBuf>,
}

/// Which check found a problem.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Area {
    /// The JSON Schema, a document's shape or its semantic checks.
    Data,
    /// The prose's queries and claims, or another build failure.
    Build,
    /// The site folder differs from a fresh build.
    Site,
    /// A link or asset that does not resolve.
    Link,
    /// Something in the data that is suspicious but may be true (a larger case faster than a
    /// smaller one): reported, but the check still passes.
    Warning,
}

impl Area {
    fn as_str(self) -> &'static str {
        match self {
            Area::Data => "data",
            Area::Build => "build",
            Area::Site => "site",
            Area::Link => "link",
            Area::Warning => "warning",
        }
    }
}

impl Problem {
    /// True for a problem that fails the check (every area but [`Area::Warning`]).
    pub fn fails(&self) -> bool {
        self.area != Area::Warning
    }
}

/// One problem found by [`check`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// The check that found it.
    pub area: Area,
    /// What is wrong, naming the file.
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[{}] {}", self.area.as_str(), self.message)
    }
}

fn problem(area: Area, message: impl Into<String>) -> Problem {
    Problem {
        area,
        message: message.into(),
    }
}

/// Runs every check; an empty list means the site may be published. Never stops at the first
/// problem, and turns I/O failures into problems too.
pub fn check(opts: &CheckOptions) -> Vec<Problem> {
    let mut problems = Vec::new();
    let docs = check_data(&opts.data_dir, &mut problems);
    let sources = match Sources::find(opts.templates_dir.as_deref()) {
        Ok(s) => Some(s),
        Err(e) => {
            problems.push(problem(Area::Build, format!("{e:#}")));
            None
        }
    };
    if let Some(docs) = &docs {
        problems.extend(suspicious_timings(docs));
    }
    match (docs, sources) {
        (Some(docs), Some(sources)) => {
            let rendered = super::render::Renderer::new(&sources).and_then(|r| {
                super::render_files_with(&r, &sources, &docs, opts.base_url.as_deref())
            });
            match rendered {
                Ok(mut files) => {
                    let manifest =
                        super::manifest(&docs, &sources, opts.base_url.as_deref(), &files);
                    let before = problems.len();
                    explain_manifest(&opts.out_dir, &manifest, &sources.origin(), &mut problems);
                    // Another base URL changes every link of every page: the one line that
                    // says so is the whole story.
                    let built_with = Manifest::read(&opts.out_dir).map(|m| m.base_url);
                    if built_with.is_some_and(|b| b != manifest.base_url) {
                        debug_assert!(problems.len() > before);
                        return problems;
                    }
                    files.push(manifest.to_file());
                    check_site(&opts.out_dir, &files, &mut problems);
                }
                Err(e) => match e.downcast_ref::<ProseError>() {
                    Some(prose) => problems.extend(
                        prose
                            .problems
                            .iter()
                            .map(|p| problem(Area::Build, p.to_string())),
                    ),
                    None => problems.push(problem(Area::Build, format!("the build fails: {e:#}"))),
                },
            }
        }
        _ => problems.push(problem(
            Area::Site,
            "the site was not compared with a fresh build: the data or the templates do not load",
        )),
    }
    check_links(&opts.out_dir, opts.base_url.as_deref(), &mut problems);
    problems
}

/// Warnings for timings that contradict the size of the work: within a group (every case
/// parameter equal but the document's first axis), an implementation faster at a larger size
/// than at a smaller one by more than both interquartile ranges (its q3 at the larger size
/// below its q1 at the smaller). That is what a launch-bound or cached timing looks like.
pub fn suspicious_timings(docs: &[Loaded]) -> Vec<Problem> {
    use super::model::groups::{group_rows, param_f64, primary_axis};
    let mut out = Vec::new();
    for l in docs {
        let axis = primary_axis(&l.doc);
        for g in group_rows(&l.doc, axis) {
            let sizes: Vec<_> = g.by_x.values().collect();
            let impls: BTreeSet<&str> = sizes
                .iter()
                .flat_map(|(_, by)| by.keys().copied())
                .collect();
            for imp in impls {
                let ok: Vec<(f64, &schema::Row)> = sizes
                    .iter()
                    .filter_map(|(x, by)| {
                        let r = by.get(imp)?;
                        (r.status == schema::Status::Ok).then_some(((*x).and_then(param_f64)?, *r))
                    })
                    .collect();
                for (i, (x_small, small)) in ok.iter().enumerate() {
                    for (x_large, large) in &ok[i + 1..] {
                        let (Some(q1_small), Some(q3_large)) = (small.q1_ms, large.q3_ms) else {
                            continue;
                        };
                        if x_large > x_small && q3_large < q1_small {
                            out.push(problem(
                                Area::Warning,
                                format!(
                                    "{}: {imp} is faster at {axis} = {x_large} ({} ms, q3 {} ms) \
                                     than at {axis} = {x_small} ({} ms, q1 {} ms), {}: a larger \
                                     case beating a smaller one beyond both IQRs is what a \
                                     launch-bound or cached timing looks like",
                                    l.file_name(),
                                    super::format::ms(large.median_ms.unwrap_or(f64::NAN)),
                                    super::format::ms(q3_large),
                                    super::format::ms(small.median_ms.unwrap_or(f64::NAN)),
                                    super::format::ms(q1_small),
                                    g.title()
                                ),
                            ));
                        }
                    }
                }
            }
        }
    }
    out
}

/// Says why the site differs when its manifest tells: another base URL, other templates, other
/// data.
fn explain_manifest(out: &Path, fresh: &Manifest, templates: &str, problems: &mut Vec<Problem>) {
    let Some(built) = Manifest::read(out) else {
        return;
    };
    let show = |b: &Option<String>| match b {
        Some(b) => format!("--base-url {b}"),
        None => "no --base-url".to_string(),
    };
    if built.base_url != fresh.base_url {
        problems.push(problem(
            Area::Site,
            format!(
                "{} was built with {}, and check ran with {}: that is the likely cause of the \
                 differences below; run check with the base URL the site was built with",
                out.display(),
                show(&built.base_url),
                show(&fresh.base_url)
            ),
        ));
    }
    if built.templates_sha256 != fresh.templates_sha256 {
        problems.push(problem(
            Area::Site,
            format!(
                "{} was built from other templates than this check reads ({templates}): a \
                 template or prose file changed since; rebuild it with `docgen build`",
                out.display()
            ),
        ));
    }
    if built.data_sha256 != fresh.data_sha256 {
        problems.push(problem(
            Area::Site,
            format!(
                "{} was built from other data than the data folder holds now; rebuild it with \
                 `docgen build`",
                out.display()
            ),
        ));
    }
}

/// Schema and loader checks of every document, every problem of every file; returns the
/// documents when all load.
fn check_data(data_dir: &Path, problems: &mut Vec<Problem>) -> Option<Vec<Loaded>> {
    let generated = schema::document_schema_json();
    let schema_path = data_dir.join(SCHEMA_FILE_NAME);
    match fs::read_to_string(&schema_path) {
        Ok(on_disk) if on_disk == generated => {}
        Ok(_) => problems.push(problem(
            Area::Data,
            format!(
                "{} is stale: it differs from the schema generated from src/schema.rs \
                 (run `docgen schema --out {}`)",
                schema_path.display(),
                schema_path.display()
            ),
        )),
        Err(e) => problems.push(problem(
            Area::Data,
            format!(
                "cannot read {}: {e} (run `docgen schema --out {}`)",
                schema_path.display(),
                schema_path.display()
            ),
        )),
    }
    let schema_value: serde_json::Value =
        serde_json::from_str(&generated).expect("the generated schema is JSON");
    let validator = match jsonschema::validator_for(&schema_value) {
        Ok(v) => v,
        Err(e) => {
            problems.push(problem(
                Area::Data,
                format!("the generated JSON Schema does not compile: {e}"),
            ));
            return None;
        }
    };

    let paths = match load::document_paths(data_dir) {
        Ok(p) => p,
        Err(e) => {
            problems.push(problem(Area::Data, e.to_string()));
            return None;
        }
    };
    let before = problems.len();
    for path in &paths {
        let bytes = match fs::read(path) {
            Ok(b) => b,
            Err(e) => {
                problems.push(problem(
                    Area::Data,
                    format!("cannot read {}: {e}", path.display()),
                ));
                continue;
            }
        };
        let value: serde_json::Value = match serde_json::from_slice(&bytes) {
            Ok(v) => v,
            Err(e) => {
                problems.push(problem(
                    Area::Data,
                    format!(
                        "{}:{}:{}: not JSON: {}",
                        path.display(),
                        e.line(),
                        e.column(),
                        e
                    ),
                ));
                continue;
            }
        };
        // The schema's errors, each located; then the loader's, except where the schema has
        // already said something about the same value.
        let mut flagged: BTreeSet<String> = BTreeSet::new();
        for e in validator.iter_errors(&value) {
            let at = load::locate(&bytes, &load::pointer_segments(e.instance_path().as_str()));
            problems.push(problem(
                Area::Data,
                format!(
                    "{}:{}: does not match the JSON Schema: {e} (at JSON path `{}`)",
                    path.display(),
                    at.line,
                    at.json_path
                ),
            ));
            flagged.insert(at.json_path);
        }
        if let Err(errors) = load::parse_document(path, &bytes) {
            for e in errors.0 {
                let at = match &e {
                    load::LoadError::Invalid { at, .. } => Some(at.json_path.clone()),
                    load::LoadError::Parse { json_path, .. } => Some(json_path.clone()),
                    _ => None,
                };
                if at.is_some_and(|p| flagged.contains(&p)) {
                    continue;
                }
                problems.push(problem(Area::Data, e.to_string()));
            }
        }
    }
    if problems.len() > before {
        return None;
    }
    // What holds between files: no two runs of one suite on one device, no repeated row, some
    // document with rows.
    match load::load_dir(data_dir) {
        Ok(docs) => Some(docs),
        Err(errors) => {
            problems.extend(
                errors
                    .0
                    .into_iter()
                    .map(|e| problem(Area::Data, e.to_string())),
            );
            None
        }
    }
}

/// Every file under `dir`, by `/`-separated relative path.
fn site_files(dir: &Path) -> Result<BTreeMap<String, PathBuf>, String> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let entries = fs::read_dir(&d).map_err(|e| format!("cannot list {}: {e}", d.display()))?;
        for entry in entries {
            let path = entry
                .map_err(|e| format!("cannot list {}: {e}", d.display()))?
                .path();
            if path.is_dir() {
                stack.push(path);
            } else if let Ok(rel) = path.strip_prefix(dir) {
                let rel: Vec<String> = rel
                    .components()
                    .map(|c| c.as_os_str().to_string_lossy().into_owned())
                    .collect();
                out.insert(rel.join("/"), path);
            }
        }
    }
    Ok(out)
}

/// Compares the site folder with freshly rendered files.
fn check_site(out: &Path, files: &[super::render::OutputFile], problems: &mut Vec<Problem>) {
    let rebuild = "rebuild it with `docgen build`";
    let on_disk = match site_files(out) {
        Ok(f) => f,
        Err(e) => {
            problems.push(problem(
                Area::Site,
                format!("the site {} cannot be read ({e}); {rebuild}", out.display()),
            ));
            return;
        }
    };
    let expected: BTreeSet<&str> = files.iter().map(|f| f.path.as_str()).collect();
    let (mut differ, mut missing) = (Vec::new(), Vec::new());
    for f in files {
        match on_disk.get(&f.path).map(fs::read) {
            None => missing.push(f.path.clone()),
            Some(Ok(bytes)) if bytes == f.bytes => {}
            Some(_) => differ.push(f.path.clone()),
        }
    }
    let extra: Vec<&String> = on_disk
        .keys()
        .filter(|p| !expected.contains(p.as_str()))
        .collect();
    for (what, list) in [
        (
            "differs from a fresh build",
            differ.iter().collect::<Vec<_>>(),
        ),
        ("is missing", missing.iter().collect()),
        ("is not part of a fresh build", extra),
    ] {
        for p in list {
            problems.push(problem(
                Area::Site,
                format!("{}/{p} {what}; {rebuild}", out.display()),
            ));
        }
    }
}

/// Checks every `href` and `src` of every HTML page under `out`.
fn check_links(out: &Path, base_url: Option<&str>, problems: &mut Vec<Problem>) {
    let Ok(files) = site_files(out) else {
        // check_site has reported the unreadable folder.
        return;
    };
    let base = base_url.map(|b| {
        if b.ends_with('/') {
            b.to_string()
        } else {
            format!("{b}/")
        }
    });
    let linked = Selector::parse("[href], [src]").expect("valid selector");
    let with_id = Selector::parse("[id], a[name]").expect("valid selector");
    let mut pages: BTreeMap<String, Html> = BTreeMap::new();
    for (rel, path) in &files {
        if rel.ends_with(".html") {
            match fs::read_to_string(path) {
                Ok(text) => {
                    pages.insert(rel.clone(), Html::parse_document(&text));
                }
                Err(e) => problems.push(problem(
                    Area::Link,
                    format!("cannot read {}: {e}", path.display()),
                )),
            }
        }
    }
    let ids: BTreeMap<&str, BTreeSet<&str>> = pages
        .iter()
        .map(|(rel, html)| {
            let set = html
                .select(&with_id)
                .filter_map(|e| e.value().attr("id").or_else(|| e.value().attr("name")))
                .collect();
            (rel.as_str(), set)
        })
        .collect();
    for (rel, html) in &pages {
        for element in html.select(&linked) {
            for attr in ["href", "src"] {
                let Some(link) = element.value().attr(attr) else {
                    continue;
                };
                if let Err(why) = resolve(rel, link, base.as_deref(), &files, &ids) {
                    problems.push(problem(
                        Area::Link,
                        format!(
                            "{}/{rel}: <{} {attr}=\"{link}\">: {why}",
                            out.display(),
                            element.value().name()
                        ),
                    ));
                }
            }
        }
    }
}

/// Resolves `link` found on page `page`; external links (with a scheme or `//`) are not
/// followed.
fn resolve(
    page: &str,
    link: &str,
    base: Option<&str>,
    files: &BTreeMap<String, PathBuf>,
    ids: &BTreeMap<&str, BTreeSet<&str>>,
) -> Result<(), String> {
    let (path, fragment) = match link.split_once('#') {
        Some((p, f)) => (p, Some(f)),
        None => (link, None),
    };
    let path = path.split('?').next().unwrap_or("");
    let scheme = path
        .find(':')
        .is_some_and(|i| !path[..i].contains(['/', '?']));
    let target = if let Some(rest) = base.and_then(|b| path.strip_prefix(b)) {
        normalise("", rest)?
    } else if scheme || path.starts_with("//") {
        // External: not followed.
        return Ok(());
    } else if path.starts_with('/') {
        return Err(format!(
            "absolute link outside the base URL {}",
            base.unwrap_or("(none: links should be relative)")
        ));
    } else if path.is_empty() {
        page.to_string()
    } else {
        let dir = page.rsplit_once('/').map_or("", |(d, _)| d);
        normalise(dir, path)?
    };
    let target = if target.is_empty() || target.ends_with('/') {
        format!("{target}index.html")
    } else {
        target
    };
    if !files.contains_key(&target) {
        return Err(format!("{target} is not in the site"));
    }
    if let Some(fragment) = fragment.filter(|f| !f.is_empty()) {
        match ids.get(target.as_str()) {
            Some(set) if set.contains(fragment) => {}
            Some(_) => return Err(format!("{target} has no element with id \"{fragment}\"")),
            None => {
                return Err(format!(
                    "{target} is not a page, so #{fragment} cannot resolve"
                ))
            }
        }
    }
    Ok(())
}

/// Joins `rel` onto folder `dir` (both `/`-separated, relative to the site root), folding `.`
/// and `..`.
///
/// Errors: the path climbs above the site root.
fn normalise(dir: &str, rel: &str) -> Result<String, String> {
    let mut parts: Vec<&str> = dir.split('/').filter(|p| !p.is_empty()).collect();
    for part in rel.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                if parts.pop().is_none() {
                    return Err("the link leaves the site".to_string());
                }
            }
            p => parts.push(p),
        }
    }
    let mut joined = parts.join("/");
    if rel.ends_with('/') && !joined.is_empty() {
        joined.push('/');
    }
    Ok(joined)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalise_folds_dots_and_refuses_escapes() {
        assert_eq!(normalise("a/b", "../c.html").unwrap(), "a/c.html");
        assert_eq!(normalise("", "./figures/x.svg").unwrap(), "figures/x.svg");
        assert!(normalise("", "../x").is_err());
    }

    #[test]
    fn resolve_checks_files_and_anchors() {
        let files: BTreeMap<String, PathBuf> = ["index.html", "a.html", "figures/f.svg"]
            .iter()
            .map(|f| (f.to_string(), PathBuf::from(f)))
            .collect();
        let mut ids = BTreeMap::new();
        ids.insert("index.html", BTreeSet::from(["top"]));
        ids.insert("a.html", BTreeSet::from(["g-1"]));
        assert!(resolve("index.html", "a.html#g-1", None, &files, &ids).is_ok());
        assert!(resolve("index.html", "#top", None, &files, &ids).is_ok());
        assert!(resolve("index.html", "figures/f.svg", None, &files, &ids).is_ok());
        assert!(resolve("index.html", "https://example.org/x", None, &files, &ids).is_ok());
        assert!(resolve("index.html", "b.html", None, &files, &ids).is_err());
        assert!(resolve("index.html", "a.html#g-2", None, &files, &ids).is_err());
        assert!(resolve("index.html", "/a.html", None, &files, &ids).is_err());
        assert!(resolve(
            "index.html",
            "/perf/a.html#g-1",
            Some("/perf/"),
            &files,
            &ids
        )
        .is_ok());
    }
}
