//! Renders the page model to files in memory: HTML through Tera, Markdown prose through Tera
//! then pulldown-cmark, commands through syntect, figures through [`super::figures`].
//!
//! Every template of a [`Sources`] is registered up front by [`Renderer::new`], which fails
//! naming the template that does not parse.

use std::sync::Arc;

use anyhow::{bail, Context as _};
use serde::Serialize;
use syntect::highlighting::ThemeSet;
use syntect::html::{css_for_theme_with_class_style, ClassStyle, ClassedHTMLGenerator};
use syntect::parsing::SyntaxSet;
use syntect::util::LinesWithEndings;
use tera::{Kwargs, State, Tera, Value};

use super::figures;
use super::markdown;
use super::model::{IndexPage, Layout, SiteModel, SuitePage, TimingView};
use super::prose;
use super::templates::Sources;

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
    /// Curated limitations ([`super::templates::LIMITATIONS_PROSE`]), HTML.
    limitations_prose: Option<&'a str>,
}

/// Context of `suite.html`: the page and the data-checked prose shown above its tables.
#[derive(Serialize)]
struct SuiteContext<'a> {
    #[serde(flatten)]
    page: &'a SuitePage,
    /// HTML from [`prose::SiteProse::for_page`].
    prose_html: Option<&'a str>,
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
    /// The handwritten stylesheet of the sources.
    style_css: String,
}

impl Renderer {
    /// Registers every template of `sources` and the `bash` filter (syntect-highlighted HTML).
    ///
    /// Errors: a template does not parse; the error names it and where it came from.
    pub fn new(sources: &Sources) -> anyhow::Result<Renderer> {
        let mut tera = Tera::new();
        // Built once per process and shared by every renderer.
        static SYNTAXES: std::sync::OnceLock<Arc<SyntaxSet>> = std::sync::OnceLock::new();
        let syntaxes = Arc::clone(SYNTAXES.get_or_init(|| Arc::new(command_syntaxes())));
        tera.register_filter(
            "bash",
            move |code: &str, _: Kwargs, _: &State| -> tera::TeraResult<Value> {
                highlight_bash(&syntaxes, code)
                    .map(|html| Value::safe_string(&html))
                    .map_err(|e| tera::Error::message(format!("highlighting a command: {e:#}")))
            },
        );
        // Tera's parse errors name the template and the line.
        let names: Vec<&str> = sources.templates.iter().map(|(n, _)| *n).collect();
        let names = names.join(", ");
        tera.add_raw_templates(
            sources
                .templates
                .iter()
                .map(|(n, s)| (*n, s.as_str()))
                .collect::<Vec<_>>(),
        )
        .with_context(|| format!("registering templates {names} from {}", sources.origin()))?;
        Ok(Renderer {
            tera,
            style_css: sources.style_css.clone(),
        })
    }

    fn render<T: Serialize>(&self, name: &str, context: &T) -> anyhow::Result<String> {
        let ctx = tera::Context::from_serialize(context)
            .with_context(|| format!("building the context of {name}"))?;
        self.tera
            .render(name, &ctx)
            .with_context(|| format!("rendering template {name}"))
    }

    /// Renders every page, figure and the stylesheet; `prose` is the data-checked prose
    /// ([`prose::render_site_prose`]) placed on the pages.
    pub fn render_site(
        &self,
        model: &SiteModel,
        prose: &prose::SiteProse,
    ) -> anyhow::Result<Vec<OutputFile>> {
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
            limitations_prose: prose.limitations.as_deref(),
        };
        out.push(file("index.html", self.render("index.html", &index)?));
        for page in &model.suite_pages {
            let context = SuiteContext {
                page,
                prose_html: prose.for_page(&page.layout.file),
            };
            out.push(file(
                &page.layout.file,
                self.render("suite.html", &context)?,
            ));
        }
        if let Some(hopper) = &model.hopper {
            out.push(file(
                &hopper.layout.file,
                self.render("hopper.html", hopper)?,
            ));
        }
        for notes in &model.tuning {
            out.push(file(&notes.layout.file, self.render("notes.html", notes)?));
        }
        for (spec, svg) in model
            .figures
            .iter()
            .zip(figures::line_figures(&model.figures)?)
        {
            out.push(file(&spec.file, svg));
        }
        for chart in &model.tile_charts {
            let svg =
                figures::tile_chart(chart).with_context(|| format!("drawing {}", chart.file))?;
            out.push(file(&chart.file, svg));
        }
        let hopper_charts = model.hopper.iter().flat_map(|h| h.charts.iter());
        for chart in model
            .glance_chart
            .iter()
            .chain(hopper_charts)
            .chain(&model.case_charts)
        {
            let svg =
                figures::glance_chart(chart).with_context(|| format!("drawing {}", chart.file))?;
            out.push(file(&chart.file, svg));
        }
        out.push(file("style.css", stylesheet_for(&self.style_css)?));
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
        Ok(markdown::to_html(&md))
    }
}

fn file(path: &str, text: String) -> OutputFile {
    OutputFile {
        path: path.to_string(),
        bytes: text.into_bytes(),
    }
}

/// A small grammar for the one-line shell commands the site shows (environment assignments,
/// the program, `--options`, quoted strings, `$VARIABLES`, comments, and the one-line `for i in
/// ...; do ...; done` that runs a part's shards), with the standard scope
/// names the themes colour. syntect's full Bash grammar compiles ~60 ms of regexes on first
/// use, most of a build's time; these few compile in well under a millisecond.
const COMMAND_SYNTAX: &str = r#"%YAML 1.2
---
name: Shell command
file_extensions: [sh]
scope: source.shell
contexts:
  main:
    - match: '#.*$'
      scope: comment.line.number-sign.shell
    - match: "'"
      scope: punctuation.definition.string.begin.shell
      push: single_quoted
    - match: '"'
      scope: punctuation.definition.string.begin.shell
      push: double_quoted
    - match: '^\s*(for)\s+([A-Za-z_][A-Za-z0-9_]*)\s+(in)\b'
      captures:
        1: keyword.control.loop.shell
        2: variable.other.readwrite.shell
        3: keyword.control.loop.shell
    - match: '(;)\s*(do)\s+([\w./-]+)'
      captures:
        1: keyword.operator.shell
        2: keyword.control.loop.shell
        3: variable.function.shell
    - match: '(;)\s*(done)\b'
      captures:
        1: keyword.operator.shell
        2: keyword.control.loop.shell
    - match: '\$\{?[A-Za-z_][A-Za-z0-9_]*\}?'
      scope: variable.other.readwrite.shell
    - match: '\b([A-Za-z_][A-Za-z0-9_]*)(=)'
      captures:
        1: variable.other.readwrite.assignment.shell
        2: keyword.operator.assignment.shell
    - match: '(?<![\w-])--?[A-Za-z][\w-]*'
      scope: variable.parameter.option.shell
    - match: '[|&;<>]+'
      scope: keyword.operator.shell
    - match: '^\s*[\w./-]+'
      scope: variable.function.shell
  single_quoted:
    - meta_scope: string.quoted.single.shell
    - match: "'"
      scope: punctuation.definition.string.end.shell
      pop: true
  double_quoted:
    - meta_scope: string.quoted.double.shell
    - match: '\$\{?[A-Za-z_][A-Za-z0-9_]*\}?'
      scope: variable.other.readwrite.shell
    - match: '"'
      scope: punctuation.definition.string.end.shell
      pop: true
"#;

/// The syntax set with [`COMMAND_SYNTAX`] (and plain text).
///
/// # Panics
/// If the grammar, a constant, does not load (a test loads it).
fn command_syntaxes() -> SyntaxSet {
    let mut builder = syntect::parsing::SyntaxSetBuilder::new();
    builder.add_plain_text_syntax();
    builder.add(
        syntect::parsing::SyntaxDefinition::load_from_str(COMMAND_SYNTAX, true, None)
            .expect("the command grammar is valid"),
    );
    builder.build()
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

/// The handwritten stylesheet `style_css`, then syntect's classes for a light theme and, under
/// `prefers-color-scheme: dark`, a dark one.
pub fn stylesheet_for(style_css: &str) -> anyhow::Result<String> {
    // The highlighting CSS depends on nothing but syntect's built-in themes: made once per
    // process (serve rebuilds many times).
    static HIGHLIGHT: std::sync::OnceLock<Result<(String, String), String>> =
        std::sync::OnceLock::new();
    let css = HIGHLIGHT.get_or_init(|| {
        let themes = ThemeSet::load_defaults();
        let css = |name: &str| -> anyhow::Result<String> {
            let theme = themes
                .themes
                .get(name)
                .with_context(|| format!("syntect has no theme {name}"))?;
            Ok(css_for_theme_with_class_style(theme, CLASS_STYLE)?)
        };
        css(LIGHT_THEME)
            .and_then(|light| Ok((light, css(DARK_THEME)?)))
            .map_err(|e| format!("{e:#}"))
    });
    let (light, dark) = css.as_ref().map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(format!(
        "{style_css}\n/* Command highlighting, generated by syntect ({LIGHT_THEME} / {DARK_THEME}). */\n{light}\n@media (prefers-color-scheme: dark) {{\n{dark}\n}}\n"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_are_highlighted_by_the_small_grammar() {
        let html = highlight_bash(
            &command_syntaxes(),
            "LD_LIBRARY_PATH=/x cargo run --bin attention -- --compare 'torch x' \"$OUT\"",
        )
        .unwrap();
        assert!(
            html.contains("sy-variable sy-parameter sy-option"),
            "{html}"
        );
        assert!(html.contains("sy-string sy-quoted sy-single"), "{html}");
        assert!(
            html.contains("sy-keyword sy-operator sy-assignment"),
            "{html}"
        );
        assert!(html.contains("--compare"), "{html}");
        // The text is escaped and kept whole.
        let text = scraper::Html::parse_fragment(&html)
            .root_element()
            .text()
            .collect::<String>();
        assert_eq!(
            text.trim(),
            "LD_LIBRARY_PATH=/x cargo run --bin attention -- --compare 'torch x' \"$OUT\""
        );
    }
}
