//! Times the whole site build (`docgen build`: load, model, render, write) from the committed
//! data and from a synthetic data set of 10,000 rows, and prints the median of several builds.
//! Not a test: run it with
//!
//! ```text
//! cargo run --release --example site_bench
//! ```
//!
//! The synthetic set repeats the committed rows over as many head counts as it takes to reach
//! 10,000 rows (each head count a new group, so new tables and figures), with times scaled per
//! copy; it is written to a temporary folder and removed afterwards. Targets on a 2-core
//! machine: under 100 ms for the committed data, under 1 s for 10,000 rows.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use kernelpages::site::{self, BuildOptions};
use serde_json::Value;

/// Rows of the synthetic data set.
const SYNTHETIC_ROWS: usize = 10_000;

fn main() -> anyhow::Result<()> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let data = root.join("data");
    let tmp = tempfile::tempdir().context("creating a temporary folder")?;

    // First, one build as `docgen build` makes it: in a fresh process, with the syntax and
    // theme tables still to load.
    println!("first build in this process, phase by phase (what one `docgen build` costs):");
    phases(&data, &tmp.path().join("site-committed-phases"))?;
    let committed = time_builds(&data, &tmp.path().join("site-committed"), 11)?;
    report(
        "committed data, later builds in the same process",
        &data,
        &committed,
        Duration::from_millis(100),
    );

    let synthetic = tmp.path().join("synthetic");
    std::fs::create_dir(&synthetic)?;
    let rows = write_synthetic(&data.join("gpu_attention.json"), &synthetic)?;
    let big = time_builds(&synthetic, &tmp.path().join("site-synthetic"), 5)?;
    report(
        &format!("synthetic data ({rows} rows)"),
        &synthetic,
        &big,
        Duration::from_secs(1),
    );
    phases(&synthetic, &tmp.path().join("site-phases"))?;
    Ok(())
}

/// One build of `data`, phase by phase, printed: where the time goes.
fn phases(data: &Path, out: &Path) -> anyhow::Result<()> {
    use kernelpages::site::{model, prose, render, templates::Sources, write};
    let mut t = Instant::now();
    let mut lap = |name: &str| {
        println!("  {name:<22} {:7.1} ms", t.elapsed().as_secs_f64() * 1e3);
        t = Instant::now();
    };
    let docs = kernelpages::load::load_dir(data)?;
    lap("load");
    let m = model::build_model(&docs, None, &[]);
    lap("model");
    let sources = Sources::find(None)?;
    let p = prose::render_site_prose(&docs, &sources)?;
    lap("prose");
    let renderer = render::Renderer::new(&sources)?;
    lap("renderer set-up");
    let files = renderer.render_site(&m, &p)?;
    lap("render (pages, figures)");
    let manifest = site::manifest(&docs, &sources, None, &files);
    write::write_site(out, &files, &manifest)?;
    lap("write");
    println!(
        "  ({} files, {} figures, {:.1} MB)",
        files.len(),
        m.figures.len(),
        files.iter().map(|f| f.bytes.len()).sum::<usize>() as f64 / 1e6
    );
    Ok(())
}

/// Builds `runs` times (after one warm-up build) and returns the sorted durations.
fn time_builds(data: &Path, out: &Path, runs: usize) -> anyhow::Result<Vec<Duration>> {
    let opts = BuildOptions {
        data_dir: data.to_path_buf(),
        out_dir: out.to_path_buf(),
        base_url: None,
        templates_dir: None,
    };
    site::build(&opts)?;
    let mut times = Vec::with_capacity(runs);
    for _ in 0..runs {
        let t0 = Instant::now();
        site::build(&opts)?;
        times.push(t0.elapsed());
    }
    times.sort();
    Ok(times)
}

fn report(what: &str, data: &Path, times: &[Duration], target: Duration) {
    let median = times[times.len() / 2];
    let verdict = if median < target { "meets" } else { "MISSES" };
    println!(
        "{what} ({}): median {:.1} ms of {} builds (min {:.1}, max {:.1}); {verdict} the {} ms target",
        data.display(),
        median.as_secs_f64() * 1e3,
        times.len(),
        times[0].as_secs_f64() * 1e3,
        times[times.len() - 1].as_secs_f64() * 1e3,
        target.as_millis()
    );
}

/// Writes `synthetic_attention.json` into `dir` from the rows of `source`; returns the count.
fn write_synthetic(source: &Path, dir: &Path) -> anyhow::Result<usize> {
    let text =
        std::fs::read_to_string(source).with_context(|| format!("reading {}", source.display()))?;
    let mut doc: Value = serde_json::from_str(&text)?;
    let base: Vec<Value> = doc["rows"]
        .as_array()
        .context("document without rows")?
        .clone();
    let mut rows = Vec::with_capacity(SYNTHETIC_ROWS);
    'fill: for copy in 0.. {
        let scale = 1.0 + copy as f64 * 0.01;
        for r in &base {
            if rows.len() == SYNTHETIC_ROWS {
                break 'fill;
            }
            let mut r = r.clone();
            r["case"]["heads"] = Value::from(1 + copy);
            r["case"]["kv_heads"] = Value::from(1 + copy);
            for key in ["median_ms", "q1_ms", "q3_ms"] {
                if let Some(v) = r[key].as_f64() {
                    r[key] = Value::from(v * scale);
                }
            }
            rows.push(r);
        }
    }
    let n = rows.len();
    doc["rows"] = Value::from(rows);
    doc["device"]["name"] = Value::from("Synthetic GPU (benchmark)");
    std::fs::write(
        dir.join("synthetic_attention.json"),
        serde_json::to_vec(&doc)?,
    )?;
    Ok(n)
}
