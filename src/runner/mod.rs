//! Runner machinery every suite shares: the grid and its selection (`--filter`, `--quick`,
//! `--shard`), one child process per (case, implementation) with a time limit, the comparison
//! modules of `runners/compare/` (one fresh process per case), interleaved order and `--runs`,
//! the device, library and machine-state records, progress on standard error, and the
//! document rewritten atomically after every row.
//!
//! A suite's binary (`runners/<suite>.rs`) declares its grid, its implementations and its
//! counts through [`Suite`], and hands them to [`run`]; its case processes call
//! [`child_main`] and measure with [`own`] (a CUDA implementation) or [`host`] (a CPU one,
//! `--device cpu`). The JSON between them is [`protocol`].

pub mod document;
pub mod grid;
pub mod host;
pub mod machine;
pub mod own;
pub mod process;
pub mod progress;
pub mod protocol;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::Duration;

use anyhow::{Context, Result};

use crate::harness::{self, default_timing};
use crate::schema::{self, Document, Row, RunConfig, Status, TimingConfig, SCHEMA_VERSION};
use grid::{Filter, Params, Shard};
use protocol::{CaseFiles, Job, Reply};

/// Options every suite runner takes (flattened into the suite's command line).
#[derive(clap::Args, Debug, Clone)]
pub struct RunnerArgs {
    /// Write the document here (atomically, after every row) instead of standard output.
    #[arg(long)]
    pub output: Option<PathBuf>,
    /// Also measure alternatives from Python (the suite lists them, e.g. `torch`).
    #[arg(long, value_delimiter = ',')]
    pub compare: Vec<String>,
    /// Where the project's implementations run: `gpu` (CUDA device 0) or `cpu` (the host's
    /// cores; the document's device is the CPU).
    #[arg(long, value_enum, default_value_t = DeviceChoice::Gpu)]
    pub device: DeviceChoice,
    /// Leave these implementations out (e.g. `torch_math,torch_efficient`), whatever
    /// `--compare` and the suite's own list name.
    #[arg(long, value_delimiter = ',')]
    pub exclude: Vec<String>,
    /// Measure only the cases matching this expression, e.g. `head_dim=128,seq_len>=4096`
    /// (clauses joined by commas, all must hold; `=`, `!=`, `<`, `<=`, `>`, `>=`).
    #[arg(long)]
    pub filter: Option<String>,
    /// A small grid for a smoke run (the suite's quick grid).
    #[arg(long)]
    pub quick: bool,
    /// Measure only shard `i` of `n` (`--shard 2/3`): the cases whose 0-based position in the
    /// (filtered) grid modulo `n` is `i - 1`. `docgen` merges the shards of one suite.
    #[arg(long, value_parser = Shard::parse)]
    pub shard: Option<Shard>,
    /// Measure the whole grid this many times; each row keeps every run's median.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub runs: u32,
    /// Warm-up, ms of calls after load and the first call.
    #[arg(long, default_value_t = default_timing().warmup_ms)]
    pub warmup_ms: f64,
    /// Timed samples per case.
    #[arg(long, default_value_t = default_timing().repeats)]
    pub repeats: u32,
    /// Smallest duration of one sample, ms (sets the inner call count).
    #[arg(long, default_value_t = default_timing().min_sample_ms)]
    pub min_sample_ms: f64,
    /// Per-case time limit, s.
    #[arg(long, default_value_t = default_timing().case_timeout_s)]
    pub case_timeout: f64,
    /// The timed calls cycle through copies of the inputs that together exceed this multiple
    /// of the L2 size (at most 64 copies); 0 times one copy [default: 3, or the suite's own].
    #[arg(long)]
    pub l2_rotation_factor: Option<f64>,
    /// Seed of the random inputs.
    #[arg(long, default_value_t = 20261129)]
    pub seed: u64,
    /// Python interpreter for `--compare`.
    #[arg(long, default_value = "python3")]
    pub python: String,
    /// Internal: measure the job in this JSON file in this process and print the reply.
    #[arg(long, hide = true)]
    pub run_case: Option<PathBuf>,
}

impl RunnerArgs {
    /// The timing parameters of the run.
    pub fn timing(&self) -> TimingConfig {
        TimingConfig {
            warmup_ms: self.warmup_ms,
            repeats: self.repeats,
            min_sample_ms: self.min_sample_ms,
            case_timeout_s: self.case_timeout,
            runs: self.runs,
            l2_rotation_factor: self
                .l2_rotation_factor
                .unwrap_or(default_timing().l2_rotation_factor),
            ..default_timing()
        }
    }

    /// The cases of `grid` (or `quick` under `--quick`) selected by `--filter` and `--shard`.
    ///
    /// # Errors
    /// A malformed filter, one naming a parameter the cases do not have, or a selection that
    /// leaves no case of a non-empty grid (the message names the filter and shard).
    pub fn select(&self, grid: Vec<Params>, quick: Vec<Params>) -> Result<Vec<Params>> {
        let grid = if self.quick { quick } else { grid };
        let filter = match &self.filter {
            Some(f) => Filter::parse(f).map_err(anyhow::Error::msg)?,
            None => Filter::default(),
        };
        // A filter may name a parameter only some cases carry (attention's `seq_len_q`): check
        // it against every key of the grid.
        let mut keys = Params::new();
        for case in &grid {
            for (k, v) in case {
                keys.entry(k.clone()).or_insert_with(|| v.clone());
            }
        }
        if !grid.is_empty() {
            filter.check_keys(&keys).map_err(anyhow::Error::msg)?;
        }
        let total = grid.len();
        let picked = grid::select(grid, &filter, self.shard);
        if picked.is_empty() && total > 0 {
            let mut how = Vec::new();
            if let Some(f) = &self.filter {
                how.push(format!("--filter '{f}'"));
            }
            if let Some(s) = self.shard {
                how.push(format!("--shard {}/{}", s.index, s.count));
            }
            anyhow::bail!(
                "the selection holds no case: {} left none of the {total} cases of the {}grid \
                 (a value the grid never takes, such as a seq_len it does not run, selects \
                 nothing); nothing to measure, no document written",
                how.join(" and "),
                if self.quick { "quick " } else { "" }
            );
        }
        Ok(picked)
    }
}

/// The device a run measures (`--device`); in a [`Job`] as `"gpu"` or `"cpu"`.
#[derive(
    clap::ValueEnum,
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    Default,
    serde::Serialize,
    serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum DeviceChoice {
    /// CUDA device 0; the runner exits with code 2 without one.
    #[default]
    Gpu,
    /// The host CPU, on all its hardware threads.
    Cpu,
}

/// Where an implementation runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    /// In a child process of the runner binary (`--run-case`).
    Own,
    /// In the comparison module `runners/compare/<module>.py`.
    Compare {
        /// Module name, e.g. `torch_sdpa`.
        module: String,
    },
}

/// One implementation the runner measures.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Implementation {
    /// Name in the document, e.g. `flash`, `torch_cudnn`.
    pub name: String,
    /// Library column, e.g. `kernelpages`, `PyTorch`.
    pub library: String,
    /// Where it runs.
    pub source: Source,
}

/// An alternative `--compare NAME` adds: one comparison module and its implementations.
#[derive(Clone, Copy, Debug)]
pub struct Alternative {
    /// The `--compare` name, e.g. `torch`.
    pub name: &'static str,
    /// The module under `runners/compare/`, e.g. `torch_sdpa`.
    pub module: &'static str,
    /// Library column.
    pub library: &'static str,
    /// Its implementations, in row order.
    pub implementations: &'static [&'static str],
}

/// What a suite gives the shared runner.
pub trait Suite {
    /// The document's suite.
    fn suite(&self) -> schema::Suite;
    /// Writes the case's inputs (raw files) and the float64 reference of its checked output
    /// elements into `dir`. `case` is the case's [`Suite::inputs_key`] (the whole case unless
    /// the suite says otherwise).
    ///
    /// # Errors
    /// I/O errors; a case the suite cannot build.
    fn prepare(&self, case: &Params, seed: u64, dir: &Path) -> Result<CaseFiles>;
    /// Why `implementation` cannot run `case`, when the runner can tell without starting it.
    fn unsupported(&self, case: &Params, implementation: &str) -> Option<String>;
    /// False when `implementation` computes another function than `case` (a suite of several
    /// ops: a grouped GEMM's implementations beside a whole layer's): the pair is not measured
    /// and has no row, unlike an [`Suite::unsupported`] one. True by default.
    fn applies(&self, _case: &Params, _implementation: &str) -> bool {
        true
    }
    /// True when `implementation` is what the project runs for `case` by default.
    fn is_default(&self, case: &Params, implementation: &str) -> bool;
    /// Remarks for an `ok` row (float32 accumulation, useful-work FLOPs, ...).
    fn notes(&self, case: &Params, implementation: &str) -> Vec<String>;
    /// The parameters that decide a case's prepared files: cases with equal keys share one
    /// [`Suite::prepare`] when they run one after the other (a tile sweep's configurations of
    /// one shape). The whole case by default.
    fn inputs_key(&self, case: &Params) -> Params {
        case.clone()
    }
    /// Short label of a case for progress lines.
    fn label(&self, case: &Params) -> String {
        case.iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(" ")
    }
}

/// Measures one job; the real one starts processes, tests use a fake.
pub trait Executor {
    /// Measures `job` with `implementation` and returns its reply (failures are rows).
    fn measure(&mut self, implementation: &Implementation, job: &Job) -> Reply;
}

/// The order of the measurements: for each run, for each case, every implementation in
/// order (the project's, then the alternatives'), so that the implementations of one case run
/// back to back under the same machine state. Returns (run, case, implementation) indices.
pub fn schedule(cases: usize, implementations: usize, runs: u32) -> Vec<(u32, usize, usize)> {
    let mut v = Vec::with_capacity(runs as usize * cases * implementations);
    for r in 0..runs {
        for c in 0..cases {
            for i in 0..implementations {
                v.push((r, c, i));
            }
        }
    }
    v
}

/// One row from the rows of several runs of the same (case, implementation): the `ok` run
/// whose median is the median of the runs (the lower middle for an even count), with every
/// `ok` run's median in `runs_ms` (run order) and a note for each run that failed. With one
/// run, that run's row unchanged.
pub fn merge_runs(rows: &[Row]) -> Row {
    assert!(!rows.is_empty(), "merge_runs of no rows");
    if rows.len() == 1 {
        return rows[0].clone();
    }
    let ok: Vec<&Row> = rows
        .iter()
        .filter(|r| r.status == Status::Ok && r.median_ms.is_some())
        .collect();
    let Some(_) = ok.first() else {
        return rows[rows.len() - 1].clone();
    };
    let mut sorted = ok.clone();
    sorted.sort_by(|a, b| a.median_ms.unwrap().total_cmp(&b.median_ms.unwrap()));
    let mut row = sorted[(sorted.len() - 1) / 2].clone();
    row.runs_ms = ok.iter().map(|r| r.median_ms.unwrap()).collect();
    for (i, r) in rows.iter().enumerate() {
        if r.status != Status::Ok {
            row.notes.push(format!(
                "run {} of {}: {} ({})",
                i + 1,
                rows.len(),
                r.status.as_str(),
                r.message.as_deref().unwrap_or("")
            ));
        }
    }
    row
}

/// Remarks every suite's rows get from the shared machinery: rotation capped (past `cache`,
/// e.g. `L2`), launch-bound.
pub fn common_notes(row: &Row, timing: &TimingConfig, cache: &str) -> Vec<String> {
    let mut notes = Vec::new();
    if row.status != Status::Ok {
        return notes;
    }
    if let (Some(reached), Some(sets)) = (row.l2_rotation_reached, row.input_sets) {
        if reached + 1e-9 < timing.l2_rotation_factor {
            notes.push(format!(
                "{cache} rotation capped at {sets} input sets: {reached:.2}× the {cache} of the {}× asked",
                timing.l2_rotation_factor
            ));
        }
    }
    if row.launch_bound(timing.launch_bound_ratio) {
        let device = row.eager_median_ms.or(row.median_ms).unwrap_or(f64::NAN);
        // A graph-replayed row's reported time is not launch-bound; its eager calls were.
        let what = if row.timing == Some(crate::schema::TimingMethod::GraphReplay) {
            "eager calls launch-bound (the graph-replayed time is not)"
        } else {
            "launch-bound"
        };
        notes.push(format!(
            "{what}: {:.4} ms of host time to issue a call ≥ {} × {:.4} ms of device time per eager call",
            row.host_ms.unwrap_or(f64::NAN),
            timing.launch_bound_ratio,
            device
        ));
    }
    notes
}

/// [`schedule`] without the pairs [`Suite::applies`] leaves out.
pub fn applicable(
    suite: &dyn Suite,
    cases: &[Params],
    implementations: &[Implementation],
    runs: u32,
) -> Vec<(u32, usize, usize)> {
    schedule(cases.len(), implementations.len(), runs)
        .into_iter()
        .filter(|&(_, ci, ii)| suite.applies(&cases[ci], &implementations[ii].name))
        .collect()
}

/// What [`measure_grid`] needs besides the executor.
pub struct Grid<'a> {
    /// The suite.
    pub suite: &'a dyn Suite,
    /// The cases, in order.
    pub cases: &'a [Params],
    /// The implementations, the project's first.
    pub implementations: &'a [Implementation],
    /// Timing parameters (`runs` included).
    pub timing: &'a TimingConfig,
    /// Seed of the inputs.
    pub seed: u64,
    /// The device measured (each job carries it).
    pub device: DeviceChoice,
    /// L2 size, bytes (a CPU's last-level cache on `--device cpu`).
    pub l2_bytes: u64,
    /// The cache `l2_bytes` measures, as the rows' notes name it: `L2`, `last-level cache`.
    pub cache: &'a str,
    /// Folder for the case files (one sub-folder per case, removed after it).
    pub scratch: &'a Path,
}

/// What happens as the grid runs, for the caller to show and save.
pub trait Sink {
    /// A measurement starts.
    fn start(&mut self, run: u32, case: &Params, implementation: &Implementation);
    /// A measurement ended with `reply`; `rows` are the document's rows so far (runs merged).
    fn row(&mut self, reply: &Reply, rows: &[Row]) -> Result<()>;
    /// The device's state over a span, when known (`None` without NVML).
    fn machine(&mut self, window: [f64; 2]) -> Option<schema::MachineState>;
    /// A remark every ok row should carry (e.g. NVML unavailable).
    fn machine_note(&self) -> Option<String>;
}

/// Runs the grid in [`schedule`] order: prepares each case's files once per run, measures
/// every implementation on them, and merges the runs. Returns the rows (case-major, in
/// implementation order).
///
/// # Errors
/// A case that cannot be prepared is a row per implementation, not an error; errors are from
/// the sink (saving the document).
pub fn measure_grid(
    g: &Grid<'_>,
    exec: &mut dyn Executor,
    sink: &mut dyn Sink,
) -> Result<Vec<Row>> {
    let n_imp = g.implementations.len();
    let mut runs: Vec<Vec<Row>> = vec![Vec::new(); g.cases.len() * n_imp];
    // The files of the last prepared case: its inputs key, run, files and folder.
    let mut prepared: Option<(Params, u32, Result<CaseFiles, String>, PathBuf)> = None;
    for (run, ci, ii) in applicable(g.suite, g.cases, g.implementations, g.timing.runs) {
        let case = &g.cases[ci];
        let imp = &g.implementations[ii];
        sink.start(run, case, imp);
        let failed = |status: Status, why: String| {
            Row::failed(
                case.clone(),
                &imp.name,
                &imp.library,
                g.suite.is_default(case, &imp.name),
                status,
                why,
            )
        };
        let reply = if let Some(why) = g.suite.unsupported(case, &imp.name) {
            Reply {
                row: failed(Status::Unsupported, why),
                window: None,
                libraries: BTreeMap::new(),
                pid: None,
            }
        } else {
            let key = g.suite.inputs_key(case);
            if !matches!(&prepared, Some((k, r, _, _)) if *k == key && *r == run) {
                if let Some((_, _, _, dir)) = prepared.take() {
                    let _ = std::fs::remove_dir_all(dir);
                }
                let dir = g.scratch.join(format!("case{ci}"));
                let files = std::fs::create_dir_all(&dir)
                    .map_err(anyhow::Error::from)
                    .and_then(|_| g.suite.prepare(&key, g.seed, &dir))
                    .map_err(|e| format!("{e:#}"));
                prepared = Some((key, run, files, dir));
            }
            match &prepared.as_ref().expect("prepared above").2 {
                Err(why) => Reply {
                    row: failed(Status::Error, format!("preparing the case failed: {why}")),
                    window: None,
                    libraries: BTreeMap::new(),
                    pid: None,
                },
                Ok(files) => {
                    let job = Job {
                        case: case.clone(),
                        implementation: imp.name.clone(),
                        device: g.device,
                        timing: g.timing.clone(),
                        l2_bytes: g.l2_bytes,
                        files: files.clone(),
                    };
                    exec.measure(imp, &job)
                }
            }
        };
        let mut reply = reply;
        let row = &mut reply.row;
        row.case = case.clone();
        row.implementation = imp.name.clone();
        row.library = imp.library.clone();
        row.default = g.suite.is_default(case, &imp.name);
        if let Some(w) = reply.window {
            row.machine = sink.machine(w);
        }
        if row.status == Status::Ok {
            for n in g
                .suite
                .notes(case, &imp.name)
                .into_iter()
                .chain(common_notes(row, g.timing, g.cache))
                .chain(sink.machine_note())
            {
                if !row.notes.contains(&n) {
                    row.notes.push(n);
                }
            }
        }
        runs[ci * n_imp + ii].push(reply.row.clone());
        let rows: Vec<Row> = runs
            .iter()
            .filter(|r| !r.is_empty())
            .map(|r| merge_runs(r))
            .collect();
        sink.row(&reply, &rows)?;
    }
    if let Some((_, _, _, dir)) = prepared.take() {
        let _ = std::fs::remove_dir_all(dir);
    }
    Ok(runs
        .iter()
        .filter(|r| !r.is_empty())
        .map(|r| merge_runs(r))
        .collect())
}

/// The real executor: the project's implementations in a child process of the runner binary,
/// the alternatives in their comparison module's server.
pub struct ProcessExecutor {
    exe: PathBuf,
    python: String,
    runners_dir: Option<PathBuf>,
    servers: BTreeMap<String, process::Server>,
    /// Extra environment for the case processes (e.g. the flash configuration).
    pub env: Vec<(String, String)>,
}

/// The hard limit on one case process ([`crate::harness::process_limit_s`]).
pub fn process_limit(timing: &TimingConfig) -> Duration {
    Duration::from_secs_f64(crate::harness::process_limit_s(timing.case_timeout_s))
}

/// The folder holding the `compare/` package: `$KP_RUNNERS_DIR` when set, else `runners/`
/// beside the current directory or in the source tree.
pub fn locate_runners_dir() -> Option<PathBuf> {
    std::env::var_os("KP_RUNNERS_DIR")
        .map(PathBuf::from)
        .into_iter()
        .chain([
            PathBuf::from("runners"),
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("runners"),
        ])
        .find(|p| p.join("compare").join("protocol.py").is_file())
}

impl ProcessExecutor {
    /// An executor starting `exe --run-case` for the project's implementations and `python`
    /// for the comparison modules found in `runners_dir`.
    pub fn new(exe: PathBuf, python: String, runners_dir: Option<PathBuf>) -> ProcessExecutor {
        ProcessExecutor {
            exe,
            python,
            runners_dir,
            servers: BTreeMap::new(),
            env: Vec::new(),
        }
    }

    fn own(&mut self, job: &Job) -> Result<Reply, (Status, String)> {
        let dir = job
            .files
            .check
            .reference
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_else(std::env::temp_dir);
        let path = dir.join(format!("job-{}.json", job.implementation));
        let text = serde_json::to_string(job).map_err(|e| (Status::Error, e.to_string()))?;
        std::fs::write(&path, text)
            .map_err(|e| (Status::Error, format!("writing {}: {e}", path.display())))?;
        let mut cmd = Command::new(&self.exe);
        // The kernels load as machine code; should any be PTX, the driver's JIT cache must not
        // make its compile look free.
        cmd.env("CUDA_CACHE_DISABLE", "1")
            .arg("--run-case")
            .arg(&path);
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        let limit = process_limit(&job.timing);
        let end = process::run_with_limit(cmd, limit).map_err(|e| {
            (
                Status::Error,
                format!("could not start the case process: {e}"),
            )
        })?;
        match end {
            process::ChildEnd::Killed { after_s, .. } => Err((
                Status::Timeout,
                format!(
                    "killed after {after_s:.0} s (limit {:.0} s)",
                    limit.as_secs_f64()
                ),
            )),
            process::ChildEnd::Exited {
                status,
                stdout,
                stderr,
            } => match process::last_reply(&stdout) {
                Some(Ok(reply)) => Ok(reply),
                Some(Err(e)) => Err((
                    Status::Error,
                    format!("case process printed a bad reply: {e}"),
                )),
                None => Err((
                    Status::Error,
                    format!(
                        "case process exited with {status} and no row; stderr: {}",
                        process::tail(&stderr, 600)
                    ),
                )),
            },
        }
    }

    fn compare(&mut self, module: &str, job: &Job) -> Result<Reply, (Status, String)> {
        let Some(dir) = self.runners_dir.clone() else {
            return Err((
                Status::Unsupported,
                "runners/compare/ not found (run from the repository root)".into(),
            ));
        };
        if let Some(s) = self.servers.get_mut(module) {
            if !s.alive() {
                self.servers.remove(module);
            }
        }
        if !self.servers.contains_key(module) {
            let s = process::Server::start(&self.python, &dir, module, &self.env).map_err(|e| {
                (
                    Status::Unsupported,
                    format!("`{}` could not be started: {e}", self.python),
                )
            })?;
            self.servers.insert(module.to_string(), s);
        }
        let server = self.servers.get_mut(module).expect("inserted");
        // The server enforces the case limit on its forked process; this is the backstop.
        let limit = process_limit(&job.timing) + Duration::from_secs(60);
        server.request(job, limit).map_err(|why| {
            let status = if why.contains("did not answer") {
                Status::Timeout
            } else {
                Status::Error
            };
            (status, why)
        })
    }
}

impl Executor for ProcessExecutor {
    fn measure(&mut self, implementation: &Implementation, job: &Job) -> Reply {
        let result = match &implementation.source {
            Source::Own => self.own(job),
            Source::Compare { module } => self.compare(&module.clone(), job),
        };
        result.unwrap_or_else(|(status, why)| Reply {
            row: Row::failed(
                job.case.clone(),
                &implementation.name,
                &implementation.library,
                false,
                status,
                why,
            ),
            window: None,
            libraries: BTreeMap::new(),
            pid: None,
        })
    }
}

/// The case-process side of [`ProcessExecutor`]: exits when the runner dies, reads the job
/// file, measures it with `measure` and prints the reply as the last line of standard output.
///
/// # Errors
/// An unreadable job file; `measure`'s own failures belong in the reply's row.
pub fn child_main(job_path: &Path, measure: impl FnOnce(&Job) -> Reply) -> Result<ExitCode> {
    process::exit_with_parent();
    let text = std::fs::read_to_string(job_path)
        .with_context(|| format!("reading {}", job_path.display()))?;
    let job: Job =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", job_path.display()))?;
    let reply = measure(&job);
    println!("{}", serde_json::to_string(&reply)?);
    Ok(ExitCode::SUCCESS)
}

/// The implementations of a run: the project's `own` (with their library), then each
/// alternative named by `--compare`.
///
/// # Errors
/// An unknown `--compare` name, listing the known ones.
pub fn implementations(
    own: &[(&str, &str)],
    alternatives: &[Alternative],
    compare: &[String],
) -> Result<Vec<Implementation>> {
    let mut v: Vec<Implementation> = own
        .iter()
        .map(|(n, l)| Implementation {
            name: n.to_string(),
            library: l.to_string(),
            source: Source::Own,
        })
        .collect();
    for c in compare {
        let alt = alternatives.iter().find(|a| a.name == c).with_context(|| {
            let known: Vec<&str> = alternatives.iter().map(|a| a.name).collect();
            format!(
                "--compare: unknown alternative `{c}` (known: {})",
                known.join(", ")
            )
        })?;
        v.extend(alt.implementations.iter().map(|n| Implementation {
            name: n.to_string(),
            library: alt.library.to_string(),
            source: Source::Compare {
                module: alt.module.to_string(),
            },
        }));
    }
    Ok(v)
}

/// Measures, once at the start of a run, the device's ceiling for each declared throughput
/// that has none: TFLOP/s from a dense bf16 cuBLAS GEMM, GB/s from a device-to-device copy.
/// A ceiling that cannot be measured is left out (the page then shows no share of it).
fn measure_ceilings(gpu: &crate::gpu::Gpu, throughput: &mut [schema::Throughput]) {
    const GEMM_N: usize = 8192;
    const COPY_BYTES: usize = 1 << 30;
    for t in throughput.iter_mut().filter(|t| t.ceiling.is_none()) {
        let measured = match t.count {
            schema::Count::Flops => gpu.bf16_gemm_tflops(GEMM_N, 20).ok().map(|tf| {
                (
                    tf * 1e12 / t.per_second,
                    format!(
                        "dense bf16 GEMM {GEMM_N}×{GEMM_N}×{GEMM_N} through cuBLAS (fp32 \
                         accumulation), median of 20 calls at the start of this run"
                    ),
                )
            }),
            schema::Count::Bytes => gpu.copy_gbps(COPY_BYTES, 20).ok().map(|gb| {
                (
                    gb * 1e9 / t.per_second,
                    format!(
                        "device-to-device copy of {} MB (bytes read + written), median of 20 \
                         copies at the start of this run",
                        COPY_BYTES / 1_000_000
                    ),
                )
            }),
            schema::Count::Items => None,
        };
        if let Some((value, source)) = measured.filter(|(v, _)| v.is_finite() && *v > 0.0) {
            eprintln!(
                "ceiling: {} {} ({source})",
                crate::site::format::sig(value, 3),
                t.unit
            );
            t.ceiling = Some(schema::Ceiling { value, source });
        }
    }
}

/// A short line for a finished row.
pub fn describe(row: &Row, throughput: &[schema::Throughput]) -> String {
    match row.status {
        Status::Ok => {
            let m = row.median_ms.unwrap_or(f64::NAN);
            let mut s = format!(
                "{:.4} ms [{:.4}, {:.4}]",
                m,
                row.q1_ms.unwrap_or(f64::NAN),
                row.q3_ms.unwrap_or(f64::NAN)
            );
            for t in throughput {
                if let Some(v) = t.of(row) {
                    s += &format!(" {v:.1} {}", t.unit);
                }
            }
            if let (Some(e), Some(h)) = (row.eager_median_ms, row.timing) {
                if h == schema::TimingMethod::GraphReplay {
                    s += &format!(" (graph; eager {e:.4} ms)");
                }
            }
            if let Some(h) = row.host_ms {
                s += &format!(" host {h:.4} ms");
            }
            if let Some(a) = &row.accuracy {
                s += &format!(" err {:.2e}", a.rel_err);
            }
            if let Some(p) = row.memory.as_ref().and_then(|m| m.peak_mb) {
                s += &format!(" peak {p:.1} MB");
            }
            if let Some(c) = row.compile_s {
                s += &format!(" compile {c:.2} s");
            }
            if let Some(c) = row.first_call_s {
                s += &format!(" first call {c:.3} s");
            }
            if let Some(m) = &row.machine {
                if let Some(c) = m.sm_clock_mhz {
                    s += &format!(" sm {c:.0} MHz");
                }
                if !m.other_processes.is_empty() {
                    s += &format!(" SHARED with {}", m.other_processes.join(", "));
                }
            }
            for n in &row.notes {
                s += &format!(" | {n}");
            }
            s
        }
        st => format!("{}: {}", st.as_str(), row.message.as_deref().unwrap_or("")),
    }
}

/// The document's fixed parts a suite declares.
pub struct Declared {
    /// Runner binary name.
    pub runner: &'static str,
    /// FLOP rule in words.
    pub flop_rule: Option<String>,
    /// Dispatch table.
    pub dispatch: Vec<schema::DispatchRule>,
    /// Figure axes.
    pub axes: Vec<String>,
    /// Throughputs.
    pub throughput: Vec<schema::Throughput>,
    /// What the run measures: the suite's grid, or a tile sweep.
    pub kind: schema::RunKind,
}

/// The standard sink: progress, NVML state (GPU runs), and the document saved after every row.
struct DocSink<'a> {
    doc: Document,
    output: Option<&'a Path>,
    progress: progress::Progress,
    /// The GPU's sampler; `None` on a CPU run.
    monitor: Option<&'a machine::Monitor>,
    suite: &'a dyn Suite,
    runs: u32,
    /// When the row in flight started (its case's preparation included).
    started: Option<std::time::Instant>,
}

impl Sink for DocSink<'_> {
    fn start(&mut self, run: u32, case: &Params, imp: &Implementation) {
        self.started = Some(std::time::Instant::now());
        let r = if self.runs > 1 {
            format!("run {}/{} ", run + 1, self.runs)
        } else {
            String::new()
        };
        self.progress
            .start(&format!("{r}{} {}", imp.name, self.suite.label(case)));
    }

    fn row(&mut self, reply: &Reply, rows: &[Row]) -> Result<()> {
        for (k, v) in &reply.libraries {
            self.doc.config.libraries.insert(k.clone(), v.clone());
        }
        self.doc.rows = rows.to_vec();
        let r = &reply.row;
        // Where a row's time went: all of it (preparation, process start, compile, check,
        // timing) and the timing window alone, for planning a grid's wall time.
        let spent = match (self.started, reply.window) {
            (Some(t), Some([a, b])) => {
                format!(
                    " [row {:.1} s, timed {:.1} s]",
                    t.elapsed().as_secs_f64(),
                    b - a
                )
            }
            (Some(t), None) => format!(" [row {:.1} s]", t.elapsed().as_secs_f64()),
            (None, _) => String::new(),
        };
        self.progress.done(&format!(
            "{:<16} {}: {}{spent}",
            r.implementation,
            self.suite.label(&r.case),
            describe(r, &self.doc.config.throughput)
        ));
        if let Some(p) = self.output {
            document::write_atomic(p, &self.doc)?;
        }
        Ok(())
    }

    fn machine(&mut self, window: [f64; 2]) -> Option<schema::MachineState> {
        self.monitor?.state(window)
    }

    fn machine_note(&self) -> Option<String> {
        self.monitor?.unavailable().map(|why| {
            format!("{why}: clocks, temperature, power and other processes not recorded")
        })
    }
}

/// Runs a suite: device facts, the grid in interleaved order under the NVML monitor, the
/// document saved after every row, then written to `--output` or standard output. Exit code 2
/// when there is no CUDA device.
///
/// # Errors
/// I/O errors writing the document; a missing device is a message and exit code 2.
pub fn run(
    suite: &dyn Suite,
    args: &RunnerArgs,
    declared: Declared,
    cases: Vec<Params>,
    implementations: Vec<Implementation>,
    env: Vec<(String, String)>,
) -> Result<ExitCode> {
    let started_at = document::now_rfc3339();
    let timing = args.timing();
    let mut implementations = implementations;
    implementations.retain(|i| !args.exclude.contains(&i.name));
    let mut declared = declared;
    let (device, libraries, l2_bytes, monitor) = match args.device {
        DeviceChoice::Gpu => match gpu_setup(declared.runner, &mut declared.throughput)? {
            Some((device, libraries, l2_bytes, monitor)) => {
                (device, libraries, l2_bytes, Some(monitor))
            }
            None => return Ok(ExitCode::from(2)),
        },
        DeviceChoice::Cpu => {
            let (device, llc) = machine::cpu_device();
            eprintln!(
                "CPU: {} ({} hardware threads); 1-minute load average {}",
                device.name,
                device.cpu_threads.unwrap_or(0),
                host::load_average().map_or("unknown".into(), |l| format!("{l:.1}"))
            );
            (device, machine::cpu_libraries(), llc, None)
        }
    };
    let mut command = vec![declared.runner.to_string()];
    command.extend(std::env::args().skip(1));
    let doc = Document {
        schema_version: SCHEMA_VERSION,
        suite: suite.suite(),
        device,
        config: RunConfig {
            runner: declared.runner.into(),
            runner_version: env!("CARGO_PKG_VERSION").into(),
            git_commit: document::git_commit(),
            libraries,
            timing: timing.clone(),
            command,
            started_at,
            finished_at: None,
            flop_rule: declared.flop_rule,
            dispatch: declared.dispatch,
            axes: declared.axes,
            throughput: declared.throughput,
            protocol: Some(crate::schema::ProtocolConstants {
                kernels_compiled_once: args.device == DeviceChoice::Gpu,
                ..crate::harness::protocol_constants()
            }),
            amendments: Vec::new(),
            kind: declared.kind,
        },
        rows: Vec::new(),
    };
    let scratch = fresh_scratch(declared.runner)?;
    let exe = std::env::current_exe().context("locating the runner binary")?;
    let mut exec = ProcessExecutor::new(exe, args.python.clone(), locate_runners_dir());
    exec.env = env;
    if args.device == DeviceChoice::Gpu {
        // Each kernel source compiles once per run; later case processes load its machine code.
        let kernels = scratch.join("kernels");
        if let Err(e) = std::fs::create_dir(&kernels) {
            let _ = std::fs::remove_dir_all(&scratch);
            return Err(e).with_context(|| format!("creating {}", kernels.display()));
        }
        exec.env.push((
            crate::gpu::KERNEL_CACHE_ENV.to_string(),
            kernels.display().to_string(),
        ));
    }
    let total = applicable(suite, &cases, &implementations, timing.runs).len();
    eprintln!(
        "{} cases × {} implementations × {} run(s): {total} measurements",
        cases.len(),
        implementations.len(),
        timing.runs
    );
    let mut sink = DocSink {
        doc,
        output: args.output.as_deref(),
        progress: progress::Progress::new(total as u64),
        monitor: monitor.as_ref(),
        suite,
        runs: timing.runs,
        started: None,
    };
    let grid = Grid {
        suite,
        cases: &cases,
        implementations: &implementations,
        timing: &timing,
        seed: args.seed,
        device: args.device,
        l2_bytes,
        cache: match args.device {
            DeviceChoice::Gpu => "L2",
            DeviceChoice::Cpu => "last-level cache",
        },
        scratch: &scratch,
    };
    let result = measure_grid(&grid, &mut exec, &mut sink);
    let _ = std::fs::remove_dir_all(&scratch);
    let rows = result?;
    sink.progress.finish();
    drop(exec);
    let mut doc = sink.doc;
    doc.rows = rows;
    doc.config.finished_at = Some(document::now_rfc3339());
    match &args.output {
        Some(p) => {
            document::write_atomic(p, &doc)?;
            eprintln!("wrote {} rows to {}", doc.rows.len(), p.display());
        }
        None => {
            use std::io::Write;
            let mut out = std::io::stdout().lock();
            serde_json::to_writer_pretty(&mut out, &doc)?;
            writeln!(out)?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// A new, empty scratch folder for one run, `kp-<runner>-<pid>-<n>` in the temporary directory:
/// created here (never one left behind by another run, whose files the run would read and then
/// delete), and removed by the run when it ends.
///
/// # Errors
/// When no such folder can be created.
fn fresh_scratch(runner: &str) -> Result<PathBuf> {
    let base = std::env::temp_dir();
    let mut last = None;
    for n in 0..1000u32 {
        let dir = base.join(format!("kp-{runner}-{}-{n}", std::process::id()));
        match std::fs::create_dir(&dir) {
            Ok(()) => return Ok(dir),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => last = Some(e),
            Err(e) => return Err(e).with_context(|| format!("creating {}", dir.display())),
        }
    }
    Err(last.expect("1000 attempts")).with_context(|| {
        format!(
            "creating a scratch folder kp-{runner}-{}-N in {}",
            std::process::id(),
            base.display()
        )
    })
}

/// What a GPU run starts from: the device's facts, library versions, L2 size and NVML sampler.
type GpuSetup = (
    schema::Device,
    BTreeMap<String, String>,
    u64,
    machine::Monitor,
);

/// The GPU's facts, library versions, L2 size and NVML sampler for a GPU run; `None` (after
/// saying why on standard error) when there is no CUDA device.
///
/// # Errors
/// A device that opens but cannot be described.
fn gpu_setup(runner: &str, throughput: &mut [schema::Throughput]) -> Result<Option<GpuSetup>> {
    // Device facts, from a short-lived context in this process (dropped before the children run).
    let (mut device, libraries, l2_bytes, pci) = match crate::gpu::Gpu::open(0) {
        Ok(g) => {
            measure_ceilings(&g, throughput);
            (
                g.describe()?,
                crate::gpu::library_versions(),
                g.l2_bytes()?,
                g.pci_bus_id(),
            )
        }
        Err(crate::gpu::GpuError::NoDevice(why)) => {
            eprintln!("no CUDA device: {why}");
            eprintln!(
                "The {runner} runner measures GPU kernels; run it on a machine with an NVIDIA GPU and driver, or with --device cpu where the suite has a CPU implementation."
            );
            return Ok(None);
        }
        Err(e) => return Err(e.into()),
    };
    let monitor = machine::Monitor::start(pci.as_deref());
    let facts = monitor.facts();
    device.power_limit_w = facts.power_limit_w;
    device.max_sm_clock_mhz = facts.max_sm_clock_mhz;
    device.max_mem_clock_mhz = facts.max_mem_clock_mhz;
    device.host_cpu = machine::host_cpu();
    device.os = machine::os();
    device.cpu_threads = std::thread::available_parallelism()
        .ok()
        .map(|n| n.get() as u32);
    if device.driver_version.is_none() {
        device.driver_version = facts.driver_version.clone();
    }
    let mut libraries = libraries;
    match monitor.unavailable() {
        Some(why) => {
            eprintln!("{why}; the rows will say so");
        }
        None => {
            libraries.insert("nvml".into(), "loaded".into());
            let others = monitor.other_processes_now();
            if others.is_empty() {
                eprintln!("no other process on the GPU at the start");
            } else {
                eprintln!(
                    "WARNING: other processes on the GPU at the start: {} (their rows will be flagged)",
                    others.join(", ")
                );
            }
        }
    }
    Ok(Some((device, libraries, l2_bytes, monitor)))
}

/// Input sets to rotate for a case: enough copies of `set_bytes` to cover
/// `l2_rotation_factor` × L2, at most [`harness::MAX_INPUT_SETS`]; and the L2 multiple reached.
pub fn rotation(set_bytes: u64, l2_bytes: u64, timing: &TimingConfig) -> (u32, f64) {
    let n = harness::input_sets(
        set_bytes,
        l2_bytes,
        timing.l2_rotation_factor,
        harness::MAX_INPUT_SETS,
    );
    let reached = if l2_bytes == 0 {
        timing.l2_rotation_factor
    } else {
        n as f64 * set_bytes as f64 / l2_bytes as f64
    };
    (n, reached)
}

#[cfg(test)]
mod tests;
