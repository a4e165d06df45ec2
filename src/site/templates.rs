//! The site's templates, stylesheet and data-checked prose: read from a folder on disk
//! (`templates/`, as Zola and mdBook read theirs, so an edit shows without recompiling), with
//! the copies built into the binary as the fallback for an installed `docgen` that has no such
//! folder.

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use sha2::{Digest, Sha256};

/// The page templates, by name, as built into the binary.
pub const BUILT_IN_TEMPLATES: [(&str, &str); 6] = [
    ("base.html", include_str!("../../templates/base.html")),
    ("notes.html", include_str!("../../templates/notes.html")),
    ("index.html", include_str!("../../templates/index.html")),
    ("suite.html", include_str!("../../templates/suite.html")),
    ("hopper.html", include_str!("../../templates/hopper.html")),
    (
        "prose/methodology.md",
        include_str!("../../templates/prose/methodology.md"),
    ),
];

/// The handwritten stylesheet as built into the binary.
pub const BUILT_IN_STYLE: &str = include_str!("../../templates/style.css");

/// Prose shown on the Attention page (a path under the templates folder).
pub const ATTENTION_PROSE: &str = "prose/attention.md";
/// Prose shown on the Sequence mixers, kernel sums and MoE page.
pub const MIXERS_PROSE: &str = "prose/mixers.md";
/// Prose shown under Known limitations on the overview.
pub const LIMITATIONS_PROSE: &str = "prose/limitations.md";
/// Tera statements every other prose file starts with ([`super::prose::render_site_prose`] puts
/// its text before each; it renders nothing itself): what the files share, such as `cards`, the
/// cards the curated prose was written for.
pub const PROSE_PRELUDE: &str = "prose/prelude.md";

/// The data-checked prose files ([`super::prose`]) and their prelude, by path under the
/// templates folder, as built into the binary.
pub const BUILT_IN_PROSE: [(&str, &str); 4] = [
    (
        PROSE_PRELUDE,
        include_str!("../../templates/prose/prelude.md"),
    ),
    (
        ATTENTION_PROSE,
        include_str!("../../templates/prose/attention.md"),
    ),
    (
        MIXERS_PROSE,
        include_str!("../../templates/prose/mixers.md"),
    ),
    (
        LIMITATIONS_PROSE,
        include_str!("../../templates/prose/limitations.md"),
    ),
];

/// The default templates folder, used when it exists and `--templates` is not given.
pub const DEFAULT_DIR: &str = "templates";

/// One suite's kernel tuning notes: a hand-written Markdown file of the repository, rendered as
/// a page of the site when present.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NotesSource {
    /// The Markdown file, relative to the folder that holds the templates folder (the
    /// repository root), e.g. `kernels/TUNING.md`.
    pub path: &'static str,
    /// The page it becomes, e.g. `tuning.html`.
    pub file: &'static str,
    /// What the notes cover, for links between the notes pages (e.g. `Attention`).
    pub title: &'static str,
    /// The suite whose kernels they tune (a tile sweep of that suite points to them).
    pub suite: crate::schema::Suite,
}

/// The kernel tuning notes, one file per suite family, in the order the site lists them: the
/// first present one is the page the navigation links to.
pub const TUNING_NOTES: [NotesSource; 4] = [
    NotesSource {
        path: "kernels/TUNING.md",
        file: "tuning.html",
        title: "Attention",
        suite: crate::schema::Suite::Attention,
    },
    NotesSource {
        path: "kernels/TUNING-sequence-mixers.md",
        file: "tuning-sequence-mixers.html",
        title: "Sequence mixers",
        suite: crate::schema::Suite::SequenceMixers,
    },
    NotesSource {
        path: "kernels/TUNING-kernel-sums.md",
        file: "tuning-kernel-sums.html",
        title: "Kernel sums",
        suite: crate::schema::Suite::KernelSums,
    },
    NotesSource {
        path: "kernels/TUNING-moe.md",
        file: "tuning-moe.html",
        title: "MoE",
        suite: crate::schema::Suite::Moe,
    },
];

/// Every source a build renders with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sources {
    /// Page templates: name and source.
    pub templates: Vec<(&'static str, String)>,
    /// The handwritten stylesheet.
    pub style_css: String,
    /// Prose files: path under the templates folder and source.
    pub prose: Vec<(&'static str, String)>,
    /// Where they came from: the folder, or `None` for the built-in copies.
    pub dir: Option<PathBuf>,
    /// The kernel tuning notes found beside the templates folder ([`TUNING_NOTES`], in that
    /// order), each with its Markdown.
    pub tuning_notes: Vec<(NotesSource, String)>,
}

impl Sources {
    /// The copies built into the binary.
    pub fn built_in() -> Sources {
        Sources {
            templates: BUILT_IN_TEMPLATES
                .iter()
                .map(|(n, s)| (*n, s.to_string()))
                .collect(),
            style_css: BUILT_IN_STYLE.to_string(),
            prose: BUILT_IN_PROSE
                .iter()
                .map(|(n, s)| (*n, s.to_string()))
                .collect(),
            dir: None,
            tuning_notes: Vec::new(),
        }
    }

    /// Every template, the stylesheet and the prose read from `dir`, each file that `dir` lacks
    /// taken from the built-in copy (so a folder holding only `style.css` restyles the site);
    /// and the kernel tuning notes of [`TUNING_NOTES`] beside `dir`, those that are there.
    ///
    /// Errors: `dir` is not a folder, or a file in it cannot be read; the error names it.
    pub fn from_dir(dir: &Path) -> anyhow::Result<Sources> {
        if !dir.is_dir() {
            anyhow::bail!("templates folder {} does not exist", dir.display());
        }
        let read = |name: &str, built_in: &str| -> anyhow::Result<String> {
            let path = dir.join(name);
            if path.is_file() {
                std::fs::read_to_string(&path)
                    .with_context(|| format!("cannot read template {}", path.display()))
            } else {
                Ok(built_in.to_string())
            }
        };
        let pairs = |list: &[(&'static str, &'static str)]| {
            list.iter()
                .map(|(name, built_in)| Ok((*name, read(name, built_in)?)))
                .collect::<anyhow::Result<Vec<_>>>()
        };
        let mut tuning_notes = Vec::new();
        if let Some(root) = dir.parent() {
            for notes in TUNING_NOTES {
                let p = root.join(notes.path);
                if p.is_file() {
                    let md = std::fs::read_to_string(&p)
                        .with_context(|| format!("cannot read {}", p.display()))?;
                    tuning_notes.push((notes, md));
                }
            }
        }
        Ok(Sources {
            templates: pairs(&BUILT_IN_TEMPLATES)?,
            style_css: read("style.css", BUILT_IN_STYLE)?,
            prose: pairs(&BUILT_IN_PROSE)?,
            dir: Some(dir.to_path_buf()),
            tuning_notes,
        })
    }

    /// [`Sources::from_dir`] for `dir` when given, else for [`DEFAULT_DIR`] when it exists,
    /// else [`Sources::built_in`].
    ///
    /// Errors: those of [`Sources::from_dir`].
    pub fn find(dir: Option<&Path>) -> anyhow::Result<Sources> {
        match dir {
            Some(d) => Sources::from_dir(d),
            None if Path::new(DEFAULT_DIR).is_dir() => Sources::from_dir(Path::new(DEFAULT_DIR)),
            None => Ok(Sources::built_in()),
        }
    }

    /// Where the sources came from, for messages and the manifest: the folder, or `built-in`.
    pub fn origin(&self) -> String {
        match &self.dir {
            Some(d) => d.display().to_string(),
            None => "built-in".to_string(),
        }
    }

    /// SHA-256 (hex) over every name and source, in a fixed order.
    pub fn sha256(&self) -> String {
        let mut h = Sha256::new();
        for (name, src) in self.templates.iter().chain(self.prose.iter()) {
            h.update(name.as_bytes());
            h.update([0]);
            h.update(src.as_bytes());
            h.update([0]);
        }
        h.update(b"style.css\0");
        h.update(self.style_css.as_bytes());
        for (notes, md) in &self.tuning_notes {
            h.update(b"\0tuning notes\0");
            h.update(notes.path.as_bytes());
            h.update([0]);
            h.update(md.as_bytes());
        }
        hex(&h.finalize())
    }

    /// The source of prose file `name` ([`ATTENTION_PROSE`], ...).
    pub fn prose_source(&self, name: &str) -> Option<&str> {
        self.prose
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, s)| s.as_str())
    }
}

/// Lower-case hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_folder_overrides_only_what_it_holds() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("prose")).unwrap();
        std::fs::write(dir.path().join("prose/attention.md"), "edited").unwrap();
        let s = Sources::from_dir(dir.path()).unwrap();
        assert_eq!(s.prose_source(ATTENTION_PROSE), Some("edited"));
        assert_eq!(s.style_css, BUILT_IN_STYLE);
        assert_ne!(s.sha256(), Sources::built_in().sha256());
        assert!(Sources::from_dir(&dir.path().join("missing")).is_err());
    }

    /// Every tuning notes file of the repository has a page: a new `kernels/TUNING*.md` must be
    /// listed in [`TUNING_NOTES`], or the site would silently leave it out.
    #[test]
    fn every_tuning_notes_file_is_listed() {
        let kernels = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
        let mut found: Vec<String> = std::fs::read_dir(&kernels)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("TUNING") && n.ends_with(".md"))
            .map(|n| format!("kernels/{n}"))
            .collect();
        found.sort();
        let mut listed: Vec<String> = TUNING_NOTES.iter().map(|n| n.path.to_string()).collect();
        listed.sort();
        assert_eq!(found, listed);
        let files: std::collections::BTreeSet<&str> = TUNING_NOTES.iter().map(|n| n.file).collect();
        assert_eq!(files.len(), TUNING_NOTES.len(), "two notes on one page");
    }
}
