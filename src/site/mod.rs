//! The static site: [`build`] loads `data/`, computes the page [`model`], renders it
//! ([`render`], [`figures`]) and [`write`]s it atomically.

pub mod check;
pub mod figures;
pub mod format;
pub mod model;
pub mod prose;
pub mod render;
pub mod serve;
pub mod write;

use std::path::PathBuf;

use anyhow::Context as _;

/// What `docgen build` needs.
#[derive(Debug, Clone)]
pub struct BuildOptions {
    /// Folder of suite documents.
    pub data_dir: PathBuf,
    /// Site folder to create or replace.
    pub out_dir: PathBuf,
    /// Prefix for internal links; `None` gives relative links that work from `file://`.
    pub base_url: Option<String>,
}

/// Load, model, render, write. Returns the number of files written.
///
/// Errors: any document is refused, a template fails, or the site cannot be written; the
/// previous site is then left as it was.
pub fn build(opts: &BuildOptions) -> anyhow::Result<usize> {
    let docs = crate::load::load_dir(&opts.data_dir)?;
    let files = render_files(&docs, opts.base_url.as_deref())?;
    write::write_site(&opts.out_dir, &files)
        .with_context(|| format!("writing the site to {}", opts.out_dir.display()))?;
    Ok(files.len())
}

/// Like [`build`], with the page templates and `style.css` read from `templates_dir` where
/// present there ([`render::Renderer::from_dir`]); `docgen serve` uses it.
pub fn build_with_templates(
    opts: &BuildOptions,
    templates_dir: &std::path::Path,
) -> anyhow::Result<usize> {
    let docs = crate::load::load_dir(&opts.data_dir)?;
    let renderer = render::Renderer::from_dir(templates_dir)?;
    let files = render_files_with(&renderer, &docs, opts.base_url.as_deref())?;
    write::write_site(&opts.out_dir, &files)
        .with_context(|| format!("writing the site to {}", opts.out_dir.display()))?;
    Ok(files.len())
}

/// Model and render, without touching the disk.
pub fn render_files(
    docs: &[crate::load::Loaded],
    base_url: Option<&str>,
) -> anyhow::Result<Vec<render::OutputFile>> {
    let renderer = render::Renderer::new()?;
    render_files_with(&renderer, docs, base_url)
}

/// [`render_files`] with a given renderer.
pub fn render_files_with(
    renderer: &render::Renderer,
    docs: &[crate::load::Loaded],
    base_url: Option<&str>,
) -> anyhow::Result<Vec<render::OutputFile>> {
    let model = model::build_model(docs, base_url);
    let prose = prose::render_site_prose_from(docs, renderer.prose_sources())?;
    renderer.render_site(&model, &prose)
}
