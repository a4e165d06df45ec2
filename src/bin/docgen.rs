//! `docgen`: builds the static performance site from `data/*.json`, or writes the JSON Schema
//! of the documents. All work is in [`kernelpages::site`] and [`kernelpages::load`].

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Builds the static performance site from the measured documents in `data/`, checks it before
/// publishing, serves it while you edit, and writes the documents' JSON Schema.
#[derive(Parser, Debug)]
#[command(name = "docgen", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Build the site from every suite document of the data folder.
    Build {
        /// Folder of suite documents (`*.json`, searched recursively; `schema.json` and `logs/`
        /// are skipped).
        #[arg(long, default_value = "data")]
        data: PathBuf,
        /// Site folder, replaced atomically on success. Refused (exit code 2, nothing touched)
        /// unless it is missing, empty or a site docgen wrote, and unless it is apart from the
        /// data and templates folders.
        #[arg(long, default_value = "site")]
        out: PathBuf,
        /// Prefix for internal links, absolute (`/perf/` or `https://host/perf/`); links are
        /// relative when not given.
        #[arg(long, value_parser = base_url)]
        base_url: Option<String>,
        /// Folder of templates and prose; default `templates/` when it exists, else the copies
        /// built into docgen.
        #[arg(long)]
        templates: Option<PathBuf>,
    },
    /// Build the site, serve it on 127.0.0.1, and rebuild when `data/` or `templates/` change;
    /// open pages reload after each rebuild (a failed rebuild keeps the last good site and
    /// prints the error).
    Serve {
        /// Folder of suite documents (`*.json`; `schema.json` is skipped).
        #[arg(long, default_value = "data")]
        data: PathBuf,
        /// Site folder, replaced atomically on every successful rebuild.
        #[arg(long, default_value = "site")]
        out: PathBuf,
        /// Port on 127.0.0.1 (0 picks a free one).
        #[arg(long, default_value_t = 8000)]
        port: u16,
        /// Folder of templates and prose, read at each build and watched; default `templates/`
        /// when it exists, else the copies built into docgen.
        #[arg(long)]
        templates: Option<PathBuf>,
        /// Prefix for internal links, absolute (`/perf/`); the site is then served under its
        /// path.
        #[arg(long, value_parser = base_url)]
        base_url: Option<String>,
    },
    /// Check before publishing: the documents against the JSON Schema and the loader, the
    /// schema file against the types, the site folder against a fresh build, every internal
    /// link and anchor, and every claim of the prose. Lists every problem; exits 1 if any.
    Check {
        /// Folder of suite documents and `schema.json`.
        #[arg(long, default_value = "data")]
        data: PathBuf,
        /// Site folder to verify.
        #[arg(long, default_value = "site")]
        out: PathBuf,
        /// The base URL the site was built with, if any.
        #[arg(long, value_parser = base_url)]
        base_url: Option<String>,
        /// Folder of templates and prose the site is built from; default `templates/` when it
        /// exists, else the copies built into docgen.
        #[arg(long)]
        templates: Option<PathBuf>,
    },
    /// Write only the figures (SVG) of the site into a folder of their own, replaced atomically:
    /// the same files `build` writes under `site/figures/`.
    Figures {
        /// Folder of suite documents (`*.json`; `schema.json` is skipped).
        #[arg(long, default_value = "data")]
        data: PathBuf,
        /// Folder for the SVG files; refused like `build --out`.
        #[arg(long, default_value = "figures")]
        out: PathBuf,
        /// Folder of templates and prose; default `templates/` when it exists.
        #[arg(long)]
        templates: Option<PathBuf>,
    },
    /// Write the JSON Schema of suite documents.
    Schema {
        /// Where to write it.
        #[arg(long, default_value = "data/schema.json")]
        out: PathBuf,
    },
}

/// clap value parser for `--base-url`: absolute paths and URLs only.
fn base_url(s: &str) -> Result<String, String> {
    kernelpages::site::validate_base_url(s)
        .map(|()| s.to_string())
        .map_err(|e| e.to_string())
}

/// What `build` wrote and how to look at it: the exact command that serves this folder (with
/// the base URL its links need), and, without a base URL, the page to open from disk.
fn report_build(
    out: &std::path::Path,
    summary: &kernelpages::site::BuildSummary,
    base_url: Option<&str>,
) {
    let rows: usize = summary.documents.iter().map(|(_, n)| n).sum();
    let docs: Vec<String> = summary
        .documents
        .iter()
        .map(|(d, n)| format!("{d} ({n} rows)"))
        .collect();
    eprintln!(
        "read {} document{} ({rows} rows): {}",
        summary.documents.len(),
        if summary.documents.len() == 1 {
            ""
        } else {
            "s"
        },
        docs.join(", ")
    );
    eprintln!(
        "wrote {}: {} pages ({}), {} figures, {} files in all; templates: {}",
        out.display(),
        summary.pages.len(),
        summary.pages.join(", "),
        summary.figures,
        summary.files,
        summary.templates
    );
    for note in &summary.notes {
        eprintln!("note: {note}");
    }
    let me = std::env::args()
        .next()
        .unwrap_or_else(|| "docgen".to_string());
    let mut serve = vec![me, "serve".to_string()];
    if out != std::path::Path::new("site") {
        serve.extend(["--out".to_string(), out.display().to_string()]);
    }
    if let Some(b) = base_url {
        serve.extend(["--base-url".to_string(), b.to_string()]);
    }
    let serve = kernelpages::site::format::shell_join(&serve);
    match base_url {
        None => eprintln!(
            "look at it: open {} in a browser, or run `{serve}` (http://127.0.0.1:8000/)",
            out.join("index.html").display()
        ),
        Some(b) => eprintln!(
            "look at it: run `{serve}` (its links start with {b}, so opening the files from disk \
             will not follow them)"
        ),
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Figures {
            data,
            out,
            templates,
        } => {
            let n = kernelpages::site::build_figures(&kernelpages::site::BuildOptions {
                data_dir: data,
                out_dir: out.clone(),
                base_url: None,
                templates_dir: templates,
            })?;
            eprintln!("wrote {n} figures to {}", out.display());
        }
        Command::Build {
            data,
            out,
            base_url,
            templates,
        } => {
            let opts = kernelpages::site::BuildOptions {
                data_dir: data,
                out_dir: out,
                base_url,
                templates_dir: templates,
            };
            let summary = kernelpages::site::build(&opts)?;
            report_build(&opts.out_dir, &summary, opts.base_url.as_deref());
        }
        Command::Serve {
            data,
            out,
            port,
            templates,
            base_url,
        } => {
            let templates = templates.or_else(|| {
                let d = PathBuf::from(kernelpages::site::templates::DEFAULT_DIR);
                d.is_dir().then_some(d)
            });
            let watch = std::iter::once(data.clone())
                .chain(templates.clone())
                .collect();
            let opts = kernelpages::site::serve::ServeOptions {
                build: kernelpages::site::BuildOptions {
                    data_dir: data,
                    out_dir: out,
                    base_url,
                    templates_dir: templates,
                },
                port,
                watch,
                debounce: kernelpages::site::serve::DEBOUNCE,
            };
            let mount = kernelpages::site::serve::mount_path(opts.build.base_url.as_deref());
            let server = kernelpages::site::serve::Server::start(opts)?;
            eprintln!(
                "serving on http://{}{mount}; pages reload after each rebuild (Ctrl-C to stop)",
                server.addr()
            );
            server.wait()?;
        }
        Command::Check {
            data,
            out,
            base_url,
            templates,
        } => {
            let problems =
                kernelpages::site::check::check(&kernelpages::site::check::CheckOptions {
                    data_dir: data,
                    out_dir: out.clone(),
                    base_url,
                    templates_dir: templates,
                });
            for p in &problems {
                eprintln!("{p}");
            }
            let failing = problems.iter().filter(|p| p.fails()).count();
            let warnings = problems.len() - failing;
            if failing > 0 {
                anyhow::bail!(
                    "check found {failing} problem{}{}",
                    if failing == 1 { "" } else { "s" },
                    match warnings {
                        0 => String::new(),
                        n => format!(" and {n} warning{}", if n == 1 { "" } else { "s" }),
                    }
                );
            }
            eprintln!(
                "check passed: data, schema, the site folder {} (up to date), links and prose{}",
                out.display(),
                match warnings {
                    0 => String::new(),
                    n => format!(", with {n} warning{} above", if n == 1 { "" } else { "s" }),
                }
            );
        }
        Command::Schema { out } => {
            kernelpages::site::write::check_schema_target(&out)?;
            kernelpages::load::write_schema_to(&out)?;
            eprintln!("wrote {}", out.display());
        }
    }
    Ok(())
}

/// Exit codes: 0 done; 1 failed (bad data, a template, a claim the data contradicts, I/O);
/// 2 refused before any work (an output folder docgen must not write to, or bad usage).
fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("Error: {e:#}");
            if e.downcast_ref::<kernelpages::site::write::UnsafeOutput>()
                .is_some()
            {
                ExitCode::from(2)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}
