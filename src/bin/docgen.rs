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
    /// Write the JSON Schema of suite documents.
    Schema {
        /// Where to write it.
        #[arg(long, default_value = "data/schema.json")]
        out: PathBuf,
    },
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
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
