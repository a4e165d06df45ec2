//! Renders the page model to files in memory: HTML through Tera, Markdown prose through Tera
//! then pulldown-cmark, commands through syntect, figures through [`super::figures`].
//!
//! Templates are embedded with `include_str!` and all registered by [`Renderer::new`], which
//! fails naming the template that does not parse.

use std::sync::Arc;

use anyhow::{bail, Context as _};
use serde::Serialize;
use syntect::highlighting::ThemeSet;
use syntect::html::{css_for_theme_with_class_style, ClassStyle, ClassedHTMLGenerator};
use syntect::parsing::SyntaxSet;
use syntect::util::LinesWithEndings;
use tera::{Kwargs, State, Tera, Value};

use super::figures;
use super::model::{IndexPage, Layout, SiteModel, TimingView};

/// Templates, by name, as embedded in the binary.
pub const TEMPLATES: [(&str, &str); 5] = [
    ("base.html", include_str!("../../templates/base.html")),
    ("index.html", include_str!("../../templates/index.html")),
    ("suite.html", include_str!("../../templates/suite.html")),
    ("hopper.html", include_str!("../../templates/hopper.html")),
    (
        "prose/methodology.md",
        include_str!("../../templates/prose/methodology.md"),
    ),
];

/// The handwritten stylesheet; syntect's classes are appended to it.
pub const STYLE_CSS: &str = include_str!("../../templates/style.css");

/// Prefix of syntect's CSS classes, so they cannot clash with the site's own.
const CLASS_STYLE: ClassStyle = ClassStyle::SpacedPrefixed { prefix: "sy-" };
const LIGHT_THEME: &str = "InspiredGitHub";
const DARK_THEME: &str = "base16-ocean.dark";

/// One file of the site: path relative to the site root (`/`-separated) and its bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutputFile {
    /// Relative path, e.g. `figures/attention-0123456789abcdef.svg`.
    pub path: String,
    /// Contents.
    pub bytes: Vec<u8>,
}

/// Context of `index.html`.
#[derive(Serialize)]
struct IndexContext<'a> {
    layout: &'a Layout,
    page: &'a IndexPage,
    /// Rendered methodology prose, one block per timing configuration.
    methodology: Vec<ProseBlock>,
}

/// Prose rendered to HTML, with the data files it describes.
#[derive(Serialize)]
struct ProseBlock {
    files: String,
    html: String,
}

/// Context of `prose/methodology.md`.
#[derive(Serialize)]
struct MethodologyContext<'a> {
    timing: Option<&'a TimingView>,
}

/// Tera with every template registered, and the highlighter.
pub struct Renderer {
    tera: Tera,
}

impl Renderer {
    /// Registers every template and the `bash` filter (syntect-highlighted HTML).
    ///
    /// Errors: a template does not parse; the error names it.
    pub fn new() -> anyhow::Result<Renderer> {
        let mut tera = Tera::new();
        let syntaxes = Arc::new(SyntaxSet::load_defaults_newlines());
        tera.register_filter(
            "bash",
            move |code: &str, _: Kwargs, _: &State| -> tera::TeraResult<Value> {
                highlight_bash(&syntaxes, code)
                    .map(|html| Value::safe_string(&html))
                    .map_err(|e| tera::Error::message(format!("highlighting a command: {e:#}")))
            },
        );
        // Tera's parse errors name the template and the line.
        tera.add_raw_templates(TEMPLATES).with_context(|| {
            let names: Vec<&str> = TEMPLATES.iter().map(|(n, _)| *n).collect();
            format!("registering templates {}", names.join(", "))
        })?;
        Ok(Renderer { tera })
    }

    fn render<T: Serialize>(&self, name: &str, context: &T) -> anyhow::Result<String> {
        let ctx = tera::Context::from_serialize(context)
            .with_context(|| format!("building the context of {name}"))?;
        self.tera
            .render(name, &ctx)
            .with_context(|| format!("rendering template {name}"))
    }

    /// Renders every page, figure and the stylesheet.
    pub fn render_site(&self, model: &SiteModel) -> anyhow::Result<Vec<OutputFile>> {
        let mut out = Vec::new();
        let methodology = if model.index.methodology.is_empty() {
            vec![ProseBlock {
                files: String::new(),
                html: self.prose(None)?,
            }]
        } else {
            model
                .index
                .methodology
                .iter()
                .map(|t| {
                    Ok(ProseBlock {
                        files: t.files.clone(),
                        html: self.prose(Some(t))?,
                    })
                })
                .collect::<anyhow::Result<Vec<_>>>()?
        };
        let index = IndexContext {
            layout: &model.index.layout,
            page: &model.index,
            methodology,
        };
        out.push(file("index.html", self.render("index.html", &index)?));
        for page in &model.suite_pages {
            out.push(file(&page.layout.file, self.render("suite.html", page)?));
        }
        out.push(file(
            &model.hopper.layout.file,
            self.render("hopper.html", &model.hopper)?,
        ));
        for spec in &model.figures {
            let svg =
                figures::line_figure(spec).with_context(|| format!("drawing {}", spec.file))?;
            out.push(file(&spec.file, svg));
        }
        if let Some(chart) = &model.glance_chart {
            let svg =
                figures::glance_chart(chart).with_context(|| format!("drawing {}", chart.file))?;
            out.push(file(&chart.file, svg));
        }
        out.push(file("style.css", stylesheet()?));
        out.sort_by(|a, b| a.path.cmp(&b.path));
        for pair in out.windows(2) {
            if pair[0].path == pair[1].path {
                bail!("two outputs would be written to {}", pair[0].path);
            }
        }
        Ok(out)
    }

    /// The methodology Markdown filled from `timing`, rendered to HTML.
    fn prose(&self, timing: Option<&TimingView>) -> anyhow::Result<String> {
        let md = self.render("prose/methodology.md", &MethodologyContext { timing })?;
        Ok(markdown_to_html(&md))
    }
}

fn file(path: &str, text: String) -> OutputFile {
    OutputFile {
        path: path.to_string(),
        bytes: text.into_bytes(),
    }
}

/// CommonMark (with tables) to HTML.
pub fn markdown_to_html(md: &str) -> String {
    let parser = pulldown_cmark::Parser::new_ext(md, pulldown_cmark::Options::ENABLE_TABLES);
    let mut html = String::new();
    pulldown_cmark::html::push_html(&mut html, parser);
    html
}

/// A shell command as HTML spans with `sy-` classes (text escaped), in a `<pre><code>`.
pub fn highlight_bash(syntaxes: &SyntaxSet, code: &str) -> anyhow::Result<String> {
    let syntax = syntaxes
        .find_syntax_by_extension("sh")
        .unwrap_or_else(|| syntaxes.find_syntax_plain_text());
    let mut generator = ClassedHTMLGenerator::new_with_class_style(syntax, syntaxes, CLASS_STYLE);
    let code = if code.ends_with('\n') {
        code.to_string()
    } else {
        format!("{code}\n")
    };
    for line in LinesWithEndings::from(&code) {
        generator.parse_html_for_line_which_includes_newline(line)?;
    }
    Ok(format!(
        "<pre class=\"sy-code\"><code>{}</code></pre>",
        generator.finalize()
    ))
}

/// The handwritten stylesheet, then syntect's classes for a light theme and, under
/// `prefers-color-scheme: dark`, a dark one.
pub fn stylesheet() -> anyhow::Result<String> {
    let themes = ThemeSet::load_defaults();
    let theme = |name: &str| {
        themes
            .themes
            .get(name)
            .with_context(|| format!("syntect has no theme {name}"))
    };
    let light = css_for_theme_with_class_style(theme(LIGHT_THEME)?, CLASS_STYLE)?;
    let dark = css_for_theme_with_class_style(theme(DARK_THEME)?, CLASS_STYLE)?;
    Ok(format!(
        "{STYLE_CSS}\n/* Command highlighting, generated by syntect ({LIGHT_THEME} / {DARK_THEME}). */\n{light}\n@media (prefers-color-scheme: dark) {{\n{dark}\n}}\n"
    ))
}
