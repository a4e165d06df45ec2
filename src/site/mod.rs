//! The static site: [`build`] checks the output folder, loads `data/`, computes the page
//! [`model`], renders it ([`render`], [`figures`]) with the [`templates`] and [`write`]s it
//! atomically with its manifest.

pub mod check;
pub mod figures;
pub mod format;
pub mod markdown;
pub mod model;
pub mod prose;
pub mod render;
pub mod serve;
pub mod templates;
pub mod write;

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use sha2::{Digest, Sha256};

use self::templates::Sources;
use self::write::{Manifest, Protected};
use crate::load::Loaded;

/// What `docgen build` needs.
#[derive(Debug, Clone)]
pub struct BuildOptions {
    /// Folder of suite documents.
    pub data_dir: PathBuf,
    /// Site folder to create or replace (see [`write::check_output_dir`]).
    pub out_dir: PathBuf,
    /// Prefix for internal links; `None` gives relative links that work from `file://`.
    pub base_url: Option<String>,
    /// Folder of templates; `None` reads `templates/` when it exists and the built-in copies
    /// otherwise ([`Sources::find`]).
    pub templates_dir: Option<PathBuf>,
}

/// What a build read and wrote, for the command's report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BuildSummary {
    /// Documents read (path relative to the data folder) and their row counts.
    pub documents: Vec<(String, usize)>,
    /// HTML pages written, relative to the site root.
    pub pages: Vec<String>,
    /// Figures written.
    pub figures: usize,
    /// Every file written, the manifest included.
    pub files: usize,
    /// Where the templates came from.
    pub templates: String,
    /// Things the user may not expect, e.g. the tuning notes page left out.
    pub notes: Vec<String>,
}

/// Checks that `base_url` is absolute: a path from the root (`/docs/`) or a URL with a scheme
/// (`https://host/docs/`).
///
/// Errors: a relative prefix such as `docs/`, which would resolve differently on every page.
pub fn validate_base_url(base_url: &str) -> anyhow::Result<()> {
    let is_url = base_url.split_once("://").is_some_and(|(scheme, rest)| {
        !scheme.is_empty()
            && scheme
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c))
            && !rest.is_empty()
    });
    if base_url.starts_with('/') || is_url {
        Ok(())
    } else {
        anyhow::bail!(
            "--base-url {base_url:?} is relative; give a path from the site's root (`/docs/`) \
             or a full URL (`https://host/docs/`)"
        )
    }
}

/// The folders a build must never write over: the data folder and the templates folder.
pub fn protected<'a>(data_dir: &'a Path, sources: &'a Sources) -> Vec<Protected<'a>> {
    let mut v = vec![Protected {
        dir: data_dir,
        what: "the data folder",
    }];
    if let Some(t) = &sources.dir {
        v.push(Protected {
            dir: t,
            what: "the templates folder",
        });
    }
    v
}

/// Check the output folder, load, model, render, write.
///
/// Errors: the output folder is refused ([`write::UnsafeOutput`], before anything is read);
/// the base URL is relative; any document is refused; a template fails; or the site cannot be
/// written. The previous site is then left as it was.
pub fn build(opts: &BuildOptions) -> anyhow::Result<BuildSummary> {
    if let Some(b) = &opts.base_url {
        validate_base_url(b)?;
    }
    let sources = Sources::find(opts.templates_dir.as_deref())?;
    write::check_output_dir(&opts.out_dir, &protected(&opts.data_dir, &sources))?;
    let docs = crate::load::load_dir(&opts.data_dir)?;
    let renderer = render::Renderer::new(&sources)?;
    let files = render_files_with(&renderer, &sources, &docs, opts.base_url.as_deref())?;
    let manifest = manifest(&docs, &sources, opts.base_url.as_deref(), &files);
    write::write_site(&opts.out_dir, &files, &manifest)
        .with_context(|| format!("writing the site to {}", opts.out_dir.display()))?;
    Ok(BuildSummary {
        documents: docs
            .iter()
            .map(|l| (l.file_name(), l.doc.rows.len()))
            .collect(),
        pages: files
            .iter()
            .filter(|f| f.path.ends_with(".html"))
            .map(|f| f.path.clone())
            .collect(),
        figures: files
            .iter()
            .filter(|f| f.path.starts_with("figures/"))
            .count(),
        files: files.len() + 1,
        notes: match (&sources.dir, sources.tuning_notes.is_empty()) {
            // Some notes found: each becomes a page; a missing one is not worth a line.
            (_, false) => Vec::new(),
            (Some(d), true) => vec![format!(
                "no kernel tuning notes ({}) beside {}: the site has no tuning pages",
                templates::TUNING_NOTES.map(|n| n.path).join(", "),
                d.display()
            )],
            (None, true) => vec![format!(
                "built with the templates built into docgen (no {} folder here): the site has no \
                 kernel tuning notes page; run from the repository root, or pass --templates",
                templates::DEFAULT_DIR
            )],
        },
        templates: sources.origin(),
    })
}

/// Like [`build`], but writes only the figures (the files `build` writes under `figures/`), at
/// the root of `opts.out_dir`, with their own manifest. Returns how many figures were written.
///
/// Errors: those of [`build`].
pub fn build_figures(opts: &BuildOptions) -> anyhow::Result<usize> {
    let sources = Sources::find(opts.templates_dir.as_deref())?;
    write::check_output_dir(&opts.out_dir, &protected(&opts.data_dir, &sources))?;
    let docs = crate::load::load_dir(&opts.data_dir)?;
    let renderer = render::Renderer::new(&sources)?;
    let files: Vec<render::OutputFile> =
        render_files_with(&renderer, &sources, &docs, opts.base_url.as_deref())?
            .into_iter()
            .filter_map(|f| {
                let path = f.path.strip_prefix("figures/")?.to_string();
                Some(render::OutputFile {
                    path,
                    bytes: f.bytes,
                })
            })
            .collect();
    let manifest = manifest(&docs, &sources, opts.base_url.as_deref(), &files);
    write::write_site(&opts.out_dir, &files, &manifest)
        .with_context(|| format!("writing the figures to {}", opts.out_dir.display()))?;
    Ok(files.len())
}

/// The manifest of a site rendered from `docs` and `sources` into `files`.
pub fn manifest(
    docs: &[Loaded],
    sources: &Sources,
    base_url: Option<&str>,
    files: &[render::OutputFile],
) -> Manifest {
    Manifest {
        generator: Manifest::GENERATOR.to_string(),
        data_sha256: data_sha256(docs),
        templates_sha256: sources.sha256(),
        templates: match &sources.dir {
            Some(_) => "folder".to_string(),
            None => "built-in".to_string(),
        },
        base_url: base_url.map(str::to_string),
        files: files.iter().map(|f| f.path.clone()).collect(),
    }
}

/// SHA-256 (hex) over each document's path (relative to the data folder) and contents as
/// loaded.
pub fn data_sha256(docs: &[Loaded]) -> String {
    let mut h = Sha256::new();
    for l in docs {
        h.update(l.file_name().as_bytes());
        h.update([0]);
        h.update(serde_json::to_vec(&l.doc).unwrap_or_default());
        h.update([0]);
    }
    templates::hex(&h.finalize())
}

/// Model and render with the built-in templates, without touching the disk.
pub fn render_files(
    docs: &[Loaded],
    base_url: Option<&str>,
) -> anyhow::Result<Vec<render::OutputFile>> {
    let sources = Sources::built_in();
    let renderer = render::Renderer::new(&sources)?;
    render_files_with(&renderer, &sources, docs, base_url)
}

/// [`render_files`] with a given renderer and the sources it was made from (for the prose).
pub fn render_files_with(
    renderer: &render::Renderer,
    sources: &Sources,
    docs: &[Loaded],
    base_url: Option<&str>,
) -> anyhow::Result<Vec<render::OutputFile>> {
    let model = model::build_model(docs, base_url, &sources.tuning_notes);
    let mut prose = prose::render_site_prose(docs, sources)?;
    for html in [
        &mut prose.attention,
        &mut prose.mixers,
        &mut prose.limitations,
    ]
    .into_iter()
    .flatten()
    {
        *html = markdown::link_code_spans(html, &model.notes_links);
    }
    renderer.render_site(&model, &prose)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_url_must_be_absolute() {
        assert!(validate_base_url("/docs/").is_ok());
        assert!(validate_base_url("https://host/docs/").is_ok());
        assert!(validate_base_url("docs/").is_err());
        assert!(validate_base_url("").is_err());
        assert!(validate_base_url("://x").is_err());
    }
}
