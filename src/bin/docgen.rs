//! `docgen`: builds the static performance site from `data/*.json`, or writes the JSON Schema
//! of the documents. All work is in [`kernelpages::site`] and [`kernelpages::load`].

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Publishes the performance pages from the measurements in `data/`.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Build the site from every suite document of the data folder.
    Build {
        /// Folder of suite documents (`*.json`; `schema.json` is skipped).
        #[arg(long, default_value = "data")]
        data: PathBuf,
        /// Site folder, replaced atomically on success.
        #[arg(long, default_value = "site")]
        out: PathBuf,
        /// Prefix for internal links (e.g. `/perf/`); links are relative when not given.
        #[arg(long)]
        base_url: Option<String>,
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
        /// Folder of templates read at each build instead of the built-in ones, where present;
        /// also watched.
        #[arg(long, default_value = "templates")]
        templates: PathBuf,
        /// Prefix for internal links; the site is then served under its path.
        #[arg(long)]
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
        #[arg(long)]
        base_url: Option<String>,
    },
    /// Write only the figures (SVG) of the site into a folder of their own, replaced atomically:
    /// the same files `build` writes under `site/figures/`.
    Figures {
        /// Folder of suite documents (`*.json`; `schema.json` is skipped).
        #[arg(long, default_value = "data")]
        data: PathBuf,
        /// Folder for the SVG files.
        #[arg(long, default_value = "figures")]
        out: PathBuf,
    },
    /// Write the JSON Schema of suite documents.
    Schema {
        /// Where to write it.
        #[arg(long, default_value = "data/schema.json")]
        out: PathBuf,
    },
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Figures { data, out } => {
            let docs = kernelpages::load::load_dir(&data)?;
            let files: Vec<_> = kernelpages::site::render_files(&docs, None)?
                .into_iter()
                .filter_map(|f| {
                    let path = f.path.strip_prefix("figures/")?.to_string();
                    Some(kernelpages::site::render::OutputFile {
                        path,
                        bytes: f.bytes,
                    })
                })
                .collect();
            kernelpages::site::write::write_site(&out, &files)?;
            eprintln!("wrote {} figures to {}", files.len(), out.display());
        }
        Command::Build {
            data,
            out,
            base_url,
        } => {
            let opts = kernelpages::site::BuildOptions {
                data_dir: data,
                out_dir: out,
                base_url,
            };
            let n = kernelpages::site::build(&opts)?;
            eprintln!("wrote {n} files to {}", opts.out_dir.display());
        }
        Command::Serve {
            data,
            out,
            port,
            templates,
            base_url,
        } => {
            let watch = vec![data.clone(), templates.clone()];
            let opts = kernelpages::site::serve::ServeOptions {
                build: kernelpages::site::BuildOptions {
                    data_dir: data,
                    out_dir: out,
                    base_url,
                },
                port,
                watch,
                templates_dir: templates.is_dir().then_some(templates),
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
        } => {
            let problems =
                kernelpages::site::check::check(&kernelpages::site::check::CheckOptions {
                    data_dir: data,
                    out_dir: out.clone(),
                    base_url,
                });
            if !problems.is_empty() {
                for p in &problems {
                    eprintln!("{p}");
                }
                anyhow::bail!(
                    "check found {} problem{}",
                    problems.len(),
                    if problems.len() == 1 { "" } else { "s" }
                );
            }
            eprintln!(
                "check passed: data, schema, the site in {} (up to date), links and prose",
                out.display()
            );
        }
        Command::Schema { out } => {
            kernelpages::load::write_schema_to(&out)?;
            eprintln!("wrote {}", out.display());
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("Error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
