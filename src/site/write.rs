//! Puts a rendered site in place without ever losing a file docgen did not write.
//!
//! Before any work, [`check_output_dir`] refuses an output folder that is, holds or lies inside
//! the data or templates folder, that is a git work tree, or that holds anything docgen did not
//! write: a folder is replaced only when it is missing, empty, or carries docgen's manifest
//! ([`MANIFEST_FILE`]) and nothing the manifest does not list. [`write_site`] then writes every
//! file into a fresh hidden sibling folder and, only when all are written, moves the old site
//! aside and the new one in; on any error the new folder is removed and the old site is
//! untouched.

use std::fs;
use std::path::{Component, Path, PathBuf};

use anyhow::{bail, Context as _};
use serde::{Deserialize, Serialize};

use super::render::OutputFile;

/// Name of the manifest docgen writes at the root of every site (and figures folder) it builds.
pub const MANIFEST_FILE: &str = ".docgen-manifest.json";

/// What a site folder holds and what it was built from; written as [`MANIFEST_FILE`].
/// Deterministic: two builds from the same inputs write the same bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// Always `docgen`: marks the folder as one docgen may replace.
    pub generator: String,
    /// SHA-256 (hex) of the documents read, by path relative to the data folder.
    pub data_sha256: String,
    /// SHA-256 (hex) of the templates, stylesheet and prose used.
    pub templates_sha256: String,
    /// Where the templates came from: `folder` (a templates folder) or `built-in`.
    pub templates: String,
    /// The `--base-url` the links were built with, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_url: Option<String>,
    /// Every file written, relative to the site root, sorted (the manifest itself excluded).
    pub files: Vec<String>,
}

impl Manifest {
    /// The generator name every manifest carries.
    pub const GENERATOR: &'static str = "docgen";

    /// Reads the manifest of `dir`, if it has a readable one.
    pub fn read(dir: &Path) -> Option<Manifest> {
        let bytes = fs::read(dir.join(MANIFEST_FILE)).ok()?;
        serde_json::from_slice::<Manifest>(&bytes)
            .ok()
            .filter(|m| m.generator == Self::GENERATOR)
    }

    /// The manifest as a file of the site.
    pub fn to_file(&self) -> OutputFile {
        let mut text = serde_json::to_string_pretty(self).expect("a manifest serialises");
        text.push('\n');
        OutputFile {
            path: MANIFEST_FILE.to_string(),
            bytes: text.into_bytes(),
        }
    }
}

/// An output folder docgen refuses to write to: nothing was touched. `docgen` exits with
/// code 2 on it.
#[derive(Debug, thiserror::Error)]
#[error("refusing to write to {}: {reason}. Nothing was changed; pick a new or empty folder, or one docgen built, with --out", dir.display())]
pub struct UnsafeOutput {
    /// The folder as given.
    pub dir: PathBuf,
    /// Why, in words.
    pub reason: String,
}

/// Refuses to overwrite a file at `path` that is not a JSON Schema docgen wrote (`docgen
/// schema` replaces only its own output).
///
/// Errors: [`UnsafeOutput`] naming the file, when it exists and is anything else.
pub fn check_schema_target(path: &Path) -> Result<(), UnsafeOutput> {
    let Ok(bytes) = fs::read(path) else {
        if path.is_dir() {
            return Err(UnsafeOutput {
                dir: path.to_path_buf(),
                reason: "it is a folder; name the schema file to write".to_string(),
            });
        }
        return Ok(());
    };
    let ours = serde_json::from_slice::<serde_json::Value>(&bytes).is_ok_and(|v| {
        v.get("$schema").is_some() && v.get("title").and_then(|t| t.as_str()) == Some("Document")
    });
    if ours {
        Ok(())
    } else {
        Err(UnsafeOutput {
            dir: path.to_path_buf(),
            reason: "it exists and is not a document schema docgen wrote".to_string(),
        })
    }
}

/// A folder that must not be written over, and what it is (`data`, `templates`).
#[derive(Debug, Clone)]
pub struct Protected<'a> {
    /// The folder.
    pub dir: &'a Path,
    /// What it is, for the message (`the data folder`).
    pub what: &'a str,
}

/// `p` made absolute, with `.` and `..` resolved and every part that exists resolved through
/// symbolic links, so that two spellings of one folder compare equal.
pub fn resolve(p: &Path) -> PathBuf {
    let abs = std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf());
    let mut lexical = PathBuf::new();
    for c in abs.components() {
        match c {
            Component::ParentDir => {
                lexical.pop();
            }
            Component::CurDir => {}
            other => lexical.push(other),
        }
    }
    // Canonicalize the longest existing ancestor, then put the rest back.
    let mut existing = lexical.clone();
    let mut rest = Vec::new();
    while !existing.exists() {
        match existing.file_name() {
            Some(name) => {
                rest.push(name.to_os_string());
                existing.pop();
            }
            None => break,
        }
    }
    let mut out = fs::canonicalize(&existing).unwrap_or(existing);
    for name in rest.into_iter().rev() {
        out.push(name);
    }
    out
}

/// Refuses `out` unless docgen may replace it: see the module docs. Call before any work.
///
/// Errors: [`UnsafeOutput`] naming the folder and the reason: it is, holds or lies inside a
/// protected folder; it is not a folder; it is a git work tree; it is not empty and holds no
/// docgen manifest; it holds files its manifest does not list.
pub fn check_output_dir(out: &Path, protected: &[Protected<'_>]) -> Result<(), UnsafeOutput> {
    let refuse = |reason: String| UnsafeOutput {
        dir: out.to_path_buf(),
        reason,
    };
    let out_abs = resolve(out);
    if out_abs.parent().is_none() {
        return Err(refuse("it is the root of the file system".to_string()));
    }
    for p in protected {
        let p_abs = resolve(p.dir);
        if out_abs == p_abs {
            return Err(refuse(format!("it is {} ({})", p.what, p.dir.display())));
        }
        if p_abs.starts_with(&out_abs) {
            return Err(refuse(format!("it holds {} ({})", p.what, p.dir.display())));
        }
        if out_abs.starts_with(&p_abs) {
            return Err(refuse(format!(
                "it lies inside {} ({})",
                p.what,
                p.dir.display()
            )));
        }
    }
    let meta = match fs::symlink_metadata(out) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(refuse(format!("it cannot be inspected ({e})"))),
    };
    if !meta.is_dir() {
        return Err(refuse("it exists and is not a folder".to_string()));
    }
    if out.join(".git").exists() {
        return Err(refuse("it is a git work tree (it holds .git)".to_string()));
    }
    let Some(manifest) = Manifest::read(out) else {
        // Not ours: only its first few entries are needed to say so.
        let present =
            files_under(out, Some(6)).map_err(|e| refuse(format!("it cannot be listed ({e})")))?;
        if present.is_empty() {
            return Ok(());
        }
        if let Some(site) = out
            .ancestors()
            .skip(1)
            .find(|a| Manifest::read(a).is_some())
        {
            return Err(refuse(format!(
                "it lies inside the docgen site {} (its manifest does not list this folder as \
                 one docgen writes alone); write elsewhere, or rebuild that site",
                site.display()
            )));
        }
        return Err(refuse(format!(
            "it is not a docgen site: it holds {} and no {MANIFEST_FILE}",
            some_names(&present)
        )));
    };
    let present =
        files_under(out, None).map_err(|e| refuse(format!("it cannot be listed ({e})")))?;
    let listed: std::collections::BTreeSet<&str> =
        manifest.files.iter().map(String::as_str).collect();
    let extra: Vec<String> = present
        .into_iter()
        .filter(|f| f != MANIFEST_FILE && !listed.contains(f.as_str()))
        .collect();
    if !extra.is_empty() {
        return Err(refuse(format!(
            "it holds files docgen did not write ({}): move them elsewhere first",
            some_names(&extra)
        )));
    }
    Ok(())
}

/// Up to five names, then how many more.
fn some_names(names: &[String]) -> String {
    let shown: Vec<&str> = names.iter().take(5).map(String::as_str).collect();
    match names.len() {
        n if n > 5 => format!("{} and more", shown.join(", ")),
        _ => shown.join(", "),
    }
}

/// Every entry under `dir` that is not a folder (files, links), and every empty folder,
/// relative and `/`-separated, sorted; at most `limit` of them when given.
fn files_under(dir: &Path, limit: Option<usize>) -> std::io::Result<Vec<String>> {
    let mut out = Vec::new();
    for entry in walkdir::WalkDir::new(dir).min_depth(1).sort_by_file_name() {
        if limit.is_some_and(|n| out.len() >= n) {
            break;
        }
        let entry = entry.map_err(std::io::Error::other)?;
        let is_empty_dir = entry.file_type().is_dir()
            && fs::read_dir(entry.path())
                .map(|mut d| d.next().is_none())
                .unwrap_or(false);
        if entry.file_type().is_dir() && !is_empty_dir {
            continue;
        }
        let rel = entry.path().strip_prefix(dir).unwrap_or(entry.path());
        let mut s = rel
            .components()
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .collect::<Vec<_>>()
            .join("/");
        if is_empty_dir {
            s.push('/');
        }
        out.push(s);
    }
    Ok(out)
}

/// Checks that `rel` is a plain relative path (no `..`, no root, no empty part).
fn safe_relative(rel: &str) -> anyhow::Result<PathBuf> {
    let p = Path::new(rel);
    if rel.is_empty() || !p.components().all(|c| matches!(c, Component::Normal(_))) {
        bail!("refusing to write {rel:?}: not a plain relative path");
    }
    Ok(p.to_path_buf())
}

/// Whether `path` is `out` or inside it, or inside one of the sibling folders a build of `out`
/// writes and removes ([`fresh_sibling`]: `.<name>.tmp-…`, `.<name>.old-…`).
pub fn is_build_output(out: &Path, path: &Path) -> bool {
    if path.starts_with(out) {
        return true;
    }
    let (Some(name), Some(parent)) = (out.file_name(), out.parent()) else {
        return false;
    };
    let name = name.to_string_lossy();
    let prefixes = [format!(".{name}.tmp-"), format!(".{name}.old-")];
    path.ancestors()
        .filter(|a| a.parent() == Some(parent))
        .filter_map(|a| a.file_name())
        .any(|f| {
            let f = f.to_string_lossy();
            prefixes.iter().any(|p| f.starts_with(p.as_str()))
        })
}

/// A sibling of `out` that does not exist yet: `.<name>.<what>-<pid>-<n>`.
fn fresh_sibling(out: &Path, what: &str) -> anyhow::Result<PathBuf> {
    let name = out
        .file_name()
        .with_context(|| format!("output folder {} has no name", out.display()))?;
    for n in 0u32.. {
        let mut sib = std::ffi::OsString::from(".");
        sib.push(name);
        sib.push(format!(".{what}-{}-{n}", std::process::id()));
        let p = out.with_file_name(sib);
        if fs::symlink_metadata(&p).is_err() {
            return Ok(p);
        }
    }
    unreachable!("u32 range exhausted")
}

/// Writes `files` and `manifest` as the site at `out`, replacing what was there only once all
/// are written. The caller has checked `out` with [`check_output_dir`]; this checks again that
/// it is still safe just before the swap.
///
/// Errors: a file cannot be written; a rename fails; `out` became unsafe. The error names the
/// path; the previous site is then as it was.
pub fn write_site(out: &Path, files: &[OutputFile], manifest: &Manifest) -> anyhow::Result<()> {
    let out = if out.file_name().is_none() {
        // `.` or `..`: work with the resolved name so that a sibling can be named.
        resolve(out)
    } else {
        out.to_path_buf()
    };
    if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
        fs::create_dir_all(parent)
            .with_context(|| format!("cannot create {}", parent.display()))?;
    }
    let tmp = fresh_sibling(&out, "tmp")?;
    let written = write_all(&tmp, files, manifest);
    if let Err(e) = written {
        let _ = fs::remove_dir_all(&tmp);
        return Err(e);
    }
    if let Err(e) = check_output_dir(&out, &[]) {
        let _ = fs::remove_dir_all(&tmp);
        return Err(e.into());
    }
    swap_in(&tmp, &out).inspect_err(|_| {
        let _ = fs::remove_dir_all(&tmp);
    })
}

fn write_all(dir: &Path, files: &[OutputFile], manifest: &Manifest) -> anyhow::Result<()> {
    fs::create_dir(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let manifest_file = manifest.to_file();
    for f in files.iter().chain(std::iter::once(&manifest_file)) {
        let path = dir.join(safe_relative(&f.path)?);
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent)
                .with_context(|| format!("cannot create {}", parent.display()))?;
        }
        fs::write(&path, &f.bytes).with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}

fn swap_in(tmp: &Path, out: &Path) -> anyhow::Result<()> {
    if out.exists() {
        let old = fresh_sibling(out, "old")?;
        fs::rename(out, &old)
            .with_context(|| format!("cannot move {} away to {}", out.display(), old.display()))?;
        if let Err(e) = fs::rename(tmp, out) {
            // Put the old site back before reporting.
            let _ = fs::rename(&old, out);
            return Err(e)
                .with_context(|| format!("cannot move {} to {}", tmp.display(), out.display()));
        }
        // `old` holds only what check_output_dir allowed: docgen's own files, or nothing.
        fs::remove_dir_all(&old)
            .with_context(|| format!("cannot remove the previous site {}", old.display()))?;
    } else {
        fs::rename(tmp, out)
            .with_context(|| format!("cannot move {} to {}", tmp.display(), out.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_escaping_paths() {
        assert!(safe_relative("../x").is_err());
        assert!(safe_relative("/etc/x").is_err());
        assert!(safe_relative("").is_err());
        assert!(safe_relative("figures/a.svg").is_ok());
    }

    #[test]
    fn resolve_compares_spellings() {
        let dir = tempfile::tempdir().unwrap();
        fs::create_dir(dir.path().join("a")).unwrap();
        assert_eq!(
            resolve(&dir.path().join("a/../a/./b")),
            resolve(&dir.path().join("a")).join("b")
        );
    }
}
