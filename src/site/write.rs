//! Puts a rendered site in place atomically: every file is written into a sibling folder
//! `<out>.tmp-<pid>`, and only when all are written is the old site renamed away and the new
//! one renamed in. On any error the temporary folder is removed and `<out>` is untouched.

use std::fs;
use std::path::{Component, Path, PathBuf};

use anyhow::{bail, Context as _};

use super::render::OutputFile;

/// Checks that `rel` is a plain relative path (no `..`, no root, no empty part).
fn safe_relative(rel: &str) -> anyhow::Result<PathBuf> {
    let p = Path::new(rel);
    if rel.is_empty() || !p.components().all(|c| matches!(c, Component::Normal(_))) {
        bail!("refusing to write {rel:?}: not a plain relative path");
    }
    Ok(p.to_path_buf())
}

fn sibling(out: &Path, suffix: &str) -> anyhow::Result<PathBuf> {
    let name = out
        .file_name()
        .with_context(|| format!("output folder {} has no name", out.display()))?;
    let mut sib = name.to_os_string();
    sib.push(format!(".{suffix}-{}", std::process::id()));
    Ok(out.with_file_name(sib))
}

/// Writes `files` as the site at `out`, replacing what was there only once all are written.
///
/// Errors: `out` exists and is not a folder; a file cannot be written; a rename fails. The
/// error names the path.
pub fn write_site(out: &Path, files: &[OutputFile]) -> anyhow::Result<()> {
    if out.exists() && !out.is_dir() {
        bail!("output {} exists and is not a folder", out.display());
    }
    if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
        fs::create_dir_all(parent)
            .with_context(|| format!("cannot create {}", parent.display()))?;
    }
    let tmp = sibling(out, "tmp")?;
    if tmp.exists() {
        fs::remove_dir_all(&tmp)
            .with_context(|| format!("cannot remove stale {}", tmp.display()))?;
    }
    let written = write_all(&tmp, files);
    if let Err(e) = written {
        let _ = fs::remove_dir_all(&tmp);
        return Err(e);
    }
    swap_in(&tmp, out).inspect_err(|_| {
        let _ = fs::remove_dir_all(&tmp);
    })
}

fn write_all(dir: &Path, files: &[OutputFile]) -> anyhow::Result<()> {
    fs::create_dir(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    for f in files {
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
        let old = sibling(out, "old")?;
        if old.exists() {
            fs::remove_dir_all(&old)
                .with_context(|| format!("cannot remove stale {}", old.display()))?;
        }
        fs::rename(out, &old)
            .with_context(|| format!("cannot move {} away to {}", out.display(), old.display()))?;
        if let Err(e) = fs::rename(tmp, out) {
            // Put the old site back before reporting.
            let _ = fs::rename(&old, out);
            return Err(e)
                .with_context(|| format!("cannot move {} to {}", tmp.display(), out.display()));
        }
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
}
