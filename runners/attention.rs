//! `attention`: measures every case of the attention grid for the project's kernels (`flash`,
//! the default, and `math`) and, with `--compare torch`, for PyTorch's SDPA backends through
//! `runners/compare_attention.py`, and writes one suite document.
//!
//! Each (case, implementation) runs in a fresh child process of this binary (`--run-case`), so
//! that its device peak memory is read alone, a crash or a poisoned CUDA context takes down
//! only that row, and a case past its time limit is killed and recorded as `timeout`.
//! The document is rewritten atomically after every row.
//!
//! ```text
//! attention > data/gpu_attention.json
//! attention --compare torch --output data/gpu_attention.json
//! ```

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use serde::{Deserialize, Serialize};

use kernelpages::attention::cpu::{check_output, normal_bits, CheckPlan};
use kernelpages::attention::cuda::{replicate, upload, FlashConfig, Implementation, Runner};
use kernelpages::attention::{AttentionCase, Dtype, Pass};
use kernelpages::gpu::{self, Gpu, GpuError};
use kernelpages::harness::{self, MeasureError, SampleTimer};
use kernelpages::schema::{
    Accuracy, DispatchRule, Document, Memory, Reference, Row, RunConfig, Status, Suite,
    TimingConfig, SCHEMA_VERSION,
};

/// Measure attention implementations on the GPU and write a suite document.
#[derive(Parser, Debug)]
#[command(
    name = "attention",
    version,
    about = "Measure attention implementations on the GPU and write a suite document (data/gpu_attention.json)"
)]
struct Cli {
    /// Write the document here (atomically, after every row) instead of standard output.
    #[arg(long)]
    output: Option<PathBuf>,
    /// Also measure alternatives from Python: `torch` (PyTorch SDPA: flash, cuDNN, efficient,
    /// math backends).
    #[arg(long, value_delimiter = ',')]
    compare: Vec<String>,
    /// Implementations of this project to run.
    #[arg(long, value_delimiter = ',', default_value = "flash,math")]
    implementations: Vec<String>,
    /// Batch size.
    #[arg(long, default_value_t = 4)]
    batch: usize,
    /// Query heads.
    #[arg(long, default_value_t = 8)]
    heads: usize,
    /// Key/value heads (defaults to --heads; fewer is GQA).
    #[arg(long)]
    kv_heads: Option<usize>,
    /// Head dimensions.
    #[arg(long, value_delimiter = ',', default_value = "64,128")]
    head_dims: Vec<usize>,
    /// Sequence lengths.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "512,1024,2048,4096,8192,16384"
    )]
    seq_lens: Vec<usize>,
    /// Masks to run: `full`, `causal`.
    #[arg(long, value_delimiter = ',', default_value = "full,causal")]
    masks: Vec<String>,
    /// Element types: `bf16`, `fp16`.
    #[arg(long, value_delimiter = ',', default_value = "bf16")]
    dtypes: Vec<String>,
    /// Warm-up calls before timing.
    #[arg(long, default_value_t = harness::default_timing().warmup_calls)]
    warmup: u32,
    /// Timed samples per case.
    #[arg(long, default_value_t = harness::default_timing().repeats)]
    repeats: u32,
    /// Smallest duration of one sample, ms (sets the inner call count).
    #[arg(long, default_value_t = harness::default_timing().min_sample_ms)]
    min_sample_ms: f64,
    /// Per-case time limit, s.
    #[arg(long, default_value_t = harness::default_timing().case_timeout_s)]
    case_timeout: f64,
    /// Seed of the random inputs.
    #[arg(long, default_value_t = 20261129)]
    seed: u64,
    /// Query rows per checked slice for the float64 reference.
    #[arg(long, default_value_t = 256)]
    check_rows: usize,
    /// Read the alternatives' peak memory in a fresh process per case (`subprocess`, slower:
    /// each one imports torch) or in the comparison process after resetting the allocator's
    /// peak statistics (`in-process`).
    #[arg(long, default_value = "subprocess", value_parser = ["subprocess", "in-process"])]
    compare_memory: String,
    /// Flash kernel configuration per head_dim, e.g. `64=v2w4,128=v3w4m2b32` (see
    /// `kernels/TUNING.md`); the measured defaults otherwise.
    #[arg(long)]
    flash_config: Option<String>,
    /// Python interpreter for --compare.
    #[arg(long, default_value = "python3")]
    python: String,
    /// Measure only shard `i` of `n` (`--shard 2/3`): the cases of the grid whose 0-based
    /// index modulo `n` is `i - 1`. The shards of one grid, written to separate documents (e.g.
    /// `gpu_attention.shard2.json`), are merged by `docgen` into one page; the option is
    /// recorded in the document's `config.command` with the rest of the command line.
    #[arg(long, value_parser = parse_shard)]
    shard: Option<Shard>,
    /// Internal: run one case in this process and print its row (JSON) on stdout.
    #[arg(long, hide = true)]
    run_case: Option<String>,
}

/// Shard `index` (1-based) of `count`, from `--shard index/count`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Shard {
    /// 1-based shard number, `1..=count`.
    index: usize,
    /// Number of shards, at least 1.
    count: usize,
}

impl Shard {
    /// True when the case at 0-based grid position `position` belongs to this shard.
    fn takes(self, position: usize) -> bool {
        position % self.count == self.index - 1
    }
}

/// Parses `i/n` with `1 <= i <= n`.
fn parse_shard(s: &str) -> Result<Shard, String> {
    let (i, n) = s
        .split_once('/')
        .ok_or_else(|| format!("`{s}` is not of the form i/n (e.g. 1/2)"))?;
    let parse = |v: &str, what: &str| {
        v.trim()
            .parse::<usize>()
            .map_err(|e| format!("`{s}`: {what} `{v}` is not a whole number: {e}"))
    };
    let (index, count) = (parse(i, "shard")?, parse(n, "count")?);
    if count == 0 || index == 0 || index > count {
        return Err(format!("`{s}`: need 1 <= i <= n"));
    }
    Ok(Shard { index, count })
}

/// What the parent sends a `--run-case` child.
#[derive(Serialize, Deserialize)]
struct CaseJob {
    case: BTreeMap<String, kernelpages::schema::Param>,
    implementation: String,
    timing: TimingConfig,
    seed: u64,
    check_rows: usize,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = if let Some(job) = &cli.run_case {
        run_child(job)
    } else {
        run(cli)
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("Error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn timing_from(cli: &Cli) -> TimingConfig {
    TimingConfig {
        warmup_calls: cli.warmup,
        repeats: cli.repeats,
        min_sample_ms: cli.min_sample_ms,
        case_timeout_s: cli.case_timeout,
        ..harness::default_timing()
    }
}

fn grid(cli: &Cli) -> Result<Vec<AttentionCase>> {
    let mut cases = Vec::new();
    for dt in &cli.dtypes {
        let dtype = Dtype::parse(dt).with_context(|| format!("--dtypes: unknown dtype `{dt}`"))?;
        for &head_dim in &cli.head_dims {
            for mask in &cli.masks {
                let causal = match mask.as_str() {
                    "full" => false,
                    "causal" => true,
                    m => bail!("--masks: unknown mask `{m}` (full or causal)"),
                };
                for &seq_len in &cli.seq_lens {
                    cases.push(AttentionCase {
                        batch: cli.batch,
                        heads: cli.heads,
                        kv_heads: cli.kv_heads.unwrap_or(cli.heads),
                        seq_len,
                        head_dim,
                        causal,
                        dtype,
                        pass: Pass::Fwd,
                    });
                }
            }
        }
    }
    Ok(cases)
}

fn now_rfc3339() -> String {
    // Seconds since the epoch to a UTC civil date (Howard Hinnant's days_from_civil inverse).
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    let (days, rem) = (secs.div_euclid(86400), secs.rem_euclid(86400));
    let z = days + 719468;
    let era = z.div_euclid(146097);
    let doe = z - era * 146097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        (rem % 3600) / 60,
        rem % 60
    )
}

/// The commit the binary was built from, as `build.rs` recorded it (`-dirty` with uncommitted
/// changes), or `unknown` when it was built outside a git checkout.
fn git_commit() -> String {
    option_env!("KP_GIT_COMMIT")
        .filter(|c| !c.is_empty())
        .unwrap_or("unknown")
        .to_string()
}

fn dispatch_rules() -> Vec<DispatchRule> {
    let flash64 = FlashConfig::for_head_dim(64).expect("checked at start");
    let flash128 = FlashConfig::for_head_dim(128).expect("checked at start");
    vec![
        DispatchRule {
            entry_point: "attention::forward".into(),
            device: "CUDA, compute capability 8.0 or newer".into(),
            dtype: "bf16, fp16".into(),
            rule: format!(
                "head_dim 64 with seq_len % {} == 0 (config {}), or head_dim 128 with seq_len % {} == 0 (config {})",
                flash64.query_tile(),
                flash64.name(),
                flash128.query_tile(),
                flash128.name()
            ),
            implementation: Implementation::Flash.name().into(),
        },
        DispatchRule {
            entry_point: "attention::forward".into(),
            device: "CUDA, compute capability 8.0 or newer".into(),
            dtype: "bf16, fp16".into(),
            rule: "otherwise, when kv_heads == heads and seq_len % 4 == 0".into(),
            implementation: Implementation::Math.name().into(),
        },
        DispatchRule {
            entry_point: "attention::cpu::forward_f64".into(),
            device: "CPU".into(),
            dtype: "any (computed in float64)".into(),
            rule: "always".into(),
            implementation: "cpu_reference".into(),
        },
    ]
}

/// Writes `doc` to `path` atomically (temporary file beside it, then rename).
fn write_atomic(path: &Path, doc: &Document) -> Result<()> {
    let text = serde_json::to_string_pretty(doc)? + "\n";
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let tmp = dir.join(format!(
        ".{}.tmp-{}",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("doc"),
        std::process::id()
    ));
    std::fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path)
        .with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))?;
    Ok(())
}

fn run(cli: Cli) -> Result<ExitCode> {
    let started_at = now_rfc3339();
    if let Some(spec) = &cli.flash_config {
        // Children inherit the environment; FlashConfig::for_head_dim reads it.
        std::env::set_var("KP_FLASH_CONFIG", spec);
    }
    for d in [64, 128] {
        FlashConfig::for_head_dim(d)
            .map_err(anyhow::Error::msg)
            .context("--flash-config")?;
    }
    let timing = timing_from(&cli);
    let mut cases = grid(&cli)?;
    if let Some(shard) = cli.shard {
        let all = cases.len();
        cases = cases
            .into_iter()
            .enumerate()
            .filter(|(i, _)| shard.takes(*i))
            .map(|(_, c)| c)
            .collect();
        eprintln!(
            "shard {}/{}: {} of {all} cases",
            shard.index,
            shard.count,
            cases.len()
        );
    }
    let imps: Vec<Implementation> = cli
        .implementations
        .iter()
        .map(|n| {
            Implementation::parse(n)
                .with_context(|| format!("--implementations: unknown `{n}` (flash, math)"))
        })
        .collect::<Result<_>>()?;
    for c in &cli.compare {
        if c != "torch" {
            bail!("--compare: unknown alternative `{c}` (known: torch)");
        }
    }

    let script = if cli.compare.iter().any(|c| c == "torch") {
        Some(locate_script()?)
    } else {
        None
    };
    // Device facts, from a short-lived context in this process (dropped before the children run).
    let (device, mut libraries, l2_bytes) = match Gpu::open(0) {
        Ok(g) => {
            let d = g.describe()?;
            let l2 = g.l2_bytes()?;
            (d, gpu::library_versions(), l2)
        }
        Err(GpuError::NoDevice(why)) => {
            eprintln!("no CUDA device: {why}");
            eprintln!("The attention runner measures GPU kernels; run it on a machine with an NVIDIA GPU and driver.");
            return Ok(ExitCode::from(2));
        }
        Err(e) => return Err(e.into()),
    };
    let mut command = vec!["attention".to_string()];
    command.extend(std::env::args().skip(1));
    let mut doc = Document {
        schema_version: SCHEMA_VERSION,
        suite: Suite::Attention,
        device,
        config: RunConfig {
            runner: "attention".into(),
            runner_version: env!("CARGO_PKG_VERSION").into(),
            git_commit: git_commit(),
            libraries: libraries.clone(),
            timing: timing.clone(),
            command,
            started_at,
            finished_at: None,
            flop_rule: Some(AttentionCase::FLOP_RULE.into()),
            dispatch: dispatch_rules(),
            axes: AttentionCase::AXES.iter().map(|a| a.to_string()).collect(),
            throughput: AttentionCase::throughput_decls(),
            amendments: Vec::new(),
        },
        rows: Vec::new(),
    };
    let save = |doc: &Document| -> Result<()> {
        match &cli.output {
            Some(p) => write_atomic(p, doc),
            None => Ok(()),
        }
    };
    let exe = std::env::current_exe().context("locating the runner binary")?;
    let total = cases.len() * imps.len();
    let mut done = 0;
    for c in &cases {
        for &imp in &imps {
            done += 1;
            let row = run_in_child(&exe, c, imp, &timing, &cli);
            log_row(done, total, &row);
            doc.rows.push(row);
            save(&doc)?;
        }
    }

    if let Some(script) = &script {
        let (rows, libs) = compare_torch(&cli, script, &cases, &timing, l2_bytes);
        for r in rows {
            log_row(0, 0, &r);
            doc.rows.push(r);
        }
        libraries.extend(libs);
        doc.config.libraries = libraries;
        save(&doc)?;
    }

    doc.config.finished_at = Some(now_rfc3339());
    match &cli.output {
        Some(p) => {
            write_atomic(p, &doc)?;
            eprintln!("wrote {} rows to {}", doc.rows.len(), p.display());
        }
        None => {
            let mut out = std::io::stdout().lock();
            serde_json::to_writer_pretty(&mut out, &doc)?;
            writeln!(out)?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn log_row(i: usize, n: usize, r: &Row) {
    let case = r
        .case
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(" ");
    let what = match r.status {
        Status::Ok => format!(
            "{:.4} ms [{:.4}, {:.4}] {:.1} TFLOP/s err {:.2e} peak {:.0} MB compile {:.2} s",
            r.median_ms.unwrap_or(f64::NAN),
            r.q1_ms.unwrap_or(f64::NAN),
            r.q3_ms.unwrap_or(f64::NAN),
            match (r.flops, r.median_ms) {
                (Some(f), Some(m)) => f / (m * 1e-3) / 1e12,
                _ => f64::NAN,
            },
            r.accuracy.as_ref().map_or(f64::NAN, |a| a.rel_err),
            r.memory
                .as_ref()
                .and_then(|m| m.peak_mb)
                .unwrap_or(f64::NAN),
            r.compile_s.unwrap_or(f64::NAN),
        ),
        s => format!("{}: {}", s.as_str(), r.message.as_deref().unwrap_or("")),
    };
    if n > 0 {
        eprintln!("[{i}/{n}] {:<8} {case}: {what}", r.implementation);
    } else {
        eprintln!("[compare] {:<16} {case}: {what}", r.implementation);
    }
}

/// Runs one (case, implementation) in a child process with a time limit; any failure of the
/// child becomes a row.
fn run_in_child(
    exe: &Path,
    c: &AttentionCase,
    imp: Implementation,
    timing: &TimingConfig,
    cli: &Cli,
) -> Row {
    let fail = |status: Status, msg: String| {
        Row::failed(
            c.params(),
            imp.name(),
            imp.library(),
            imp.is_default_for(c),
            status,
            msg,
        )
    };
    if let Err(why) = imp.supports(c) {
        return fail(Status::Unsupported, why);
    }
    let job = CaseJob {
        case: c.params(),
        implementation: imp.name().into(),
        timing: timing.clone(),
        seed: cli.seed,
        check_rows: cli.check_rows,
    };
    let job = serde_json::to_string(&job).expect("job serialises");
    let child = Command::new(exe)
        // Cold compiles: without this the driver's JIT cache makes every compile after the
        // first of a source look free.
        .env("CUDA_CACHE_DISABLE", "1")
        .arg("--run-case")
        .arg(&job)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let mut child = match child {
        Ok(ch) => ch,
        Err(e) => {
            return fail(
                Status::Error,
                format!("could not start the case process: {e}"),
            )
        }
    };
    // Generous limit for the child: the timing budget plus input generation and reference.
    let limit = Duration::from_secs_f64(timing.case_timeout_s * 1.5 + 60.0);
    let t0 = Instant::now();
    let mut stdout = child.stdout.take().expect("piped");
    let mut stderr = child.stderr.take().expect("piped");
    let out_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stdout.read_to_string(&mut s);
        s
    });
    let err_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    let status = match wait_with_limit(&mut child, t0, limit, Duration::from_millis(20)) {
        Ok(st) => st,
        Err(e) => return fail(Status::Error, format!("waiting for the case process: {e}")),
    };
    let out = out_reader.join().unwrap_or_default();
    let err = err_reader.join().unwrap_or_default();
    let Some(status) = status else {
        return fail(
            Status::Timeout,
            format!(
                "killed after {:.0} s (limit {:.0} s)",
                t0.elapsed().as_secs_f64(),
                limit.as_secs_f64()
            ),
        );
    };
    if let Some(line) = out.lines().rev().find(|l| l.starts_with('{')) {
        match serde_json::from_str::<Row>(line) {
            Ok(row) => return row,
            Err(e) => {
                return fail(
                    Status::Error,
                    format!("case process printed a bad row: {e}"),
                )
            }
        }
    }
    let tail: String = err
        .chars()
        .rev()
        .take(600)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    fail(
        Status::Error,
        format!(
            "case process exited with {status} and no row; stderr: {}",
            tail.trim()
        ),
    )
}

/// Waits for `child`, polling every `poll`; kills it once `limit` has passed since `t0`.
/// Returns its exit status, or `None` when it was killed.
fn wait_with_limit(
    child: &mut std::process::Child,
    t0: Instant,
    limit: Duration,
    poll: Duration,
) -> std::io::Result<Option<std::process::ExitStatus>> {
    loop {
        if let Some(st) = child.try_wait()? {
            return Ok(Some(st));
        }
        if t0.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            return Ok(None);
        }
        std::thread::sleep(poll);
    }
}

/// Event timer over one prepared implementation, rotating among the input sets.
struct CaseTimer<'a> {
    gpu: &'a Gpu,
    case: &'a AttentionCase,
    runner: &'a mut Runner,
    sets: &'a [kernelpages::attention::cuda::DeviceInputs],
    out: &'a mut cudarc::driver::CudaSlice<u16>,
    next: usize,
}

impl SampleTimer for CaseTimer<'_> {
    type Error = GpuError;
    fn time_calls(&mut self, inner: u32) -> Result<f64, GpuError> {
        let (gpu, case, sets) = (self.gpu, self.case, self.sets);
        let runner = &mut *self.runner;
        let out = &mut *self.out;
        let next = &mut self.next;
        gpu.time_calls(inner, |_| {
            let s = &sets[*next % sets.len()];
            *next += 1;
            runner.launch(gpu, case, s, out)
        })
    }
}

fn mb(bytes: u64) -> f64 {
    bytes as f64 / 1e6
}

/// The child: compile, read peak memory, time, check accuracy; print the row.
fn run_child(job: &str) -> Result<ExitCode> {
    let job: CaseJob = serde_json::from_str(job).context("parsing --run-case job")?;
    let c = AttentionCase::from_params(&job.case).map_err(anyhow::Error::msg)?;
    let imp = Implementation::parse(&job.implementation).context("unknown implementation")?;
    let row = match measure_case(&c, imp, &job) {
        Ok(row) => row,
        Err(e) => {
            let status = if e.is_oom() {
                Status::Oom
            } else {
                Status::Error
            };
            Row::failed(
                c.params(),
                imp.name(),
                imp.library(),
                imp.is_default_for(&c),
                status,
                e.to_string(),
            )
        }
    };
    println!("{}", serde_json::to_string(&row)?);
    Ok(ExitCode::SUCCESS)
}

fn measure_case(c: &AttentionCase, imp: Implementation, job: &CaseJob) -> Result<Row, GpuError> {
    let gpu = Gpu::open(0)?;
    // Inputs on the host: fresh standard normals, rounded to the dtype.
    let q = normal_bits(c.q_elems(), c.dtype, job.seed);
    let k = normal_bits(c.kv_elems(), c.dtype, job.seed.wrapping_add(1));
    let v = normal_bits(c.kv_elems(), c.dtype, job.seed.wrapping_add(2));

    // Peak: device memory in use above the baseline after context creation, for one input set,
    // the output, the implementation's temporaries and one call.
    let base = gpu.used_bytes()?;
    let (mut runner, compile_s) = Runner::new(&gpu, imp, c)?;
    let set0 = upload(&gpu, &q, &k, &v)?;
    // Poison the output (0xFFFF is NaN in bf16 and fp16) so an unwritten element fails the check.
    let mut out = gpu.stream.clone_htod(&vec![0xFFFFu16; c.q_elems()])?;
    runner.launch(&gpu, c, &set0, &mut out)?;
    gpu.stream.synchronize()?;
    let peak = gpu.used_bytes()?.saturating_sub(base);

    // Accuracy on the first call's output: every element must be finite (the output was
    // poisoned with NaN, so this also proves every element was written), then the float64
    // reference on a sample of slices and rows.
    let got = gpu.stream.clone_dtoh(&out)?;
    if let Some(i) = got.iter().position(|&x| !c.dtype.from_bits(x).is_finite()) {
        return Ok(Row::failed(
            c.params(),
            imp.name(),
            imp.library(),
            imp.is_default_for(c),
            Status::Error,
            format!(
                "non-finite output at element {i} of {} (unwritten or overflowed)",
                got.len()
            ),
        ));
    }
    let plan = CheckPlan::new(c, job.check_rows, job.seed ^ 0x5eed);
    let rel_err = check_output(c, &q, &k, &v, &got, &plan);

    // Timing over enough input copies to exceed the L2 `l2_rotation_factor` times.
    let l2 = gpu.l2_bytes()?;
    let n_sets = harness::input_sets(c.input_bytes(), l2, job.timing.l2_rotation_factor, 64);
    let mut sets = vec![set0];
    for _ in 1..n_sets {
        sets.push(replicate(&gpu, &sets[0])?);
    }
    let mut timer = CaseTimer {
        gpu: &gpu,
        case: c,
        runner: &mut runner,
        sets: &sets,
        out: &mut out,
        next: 0,
    };
    let m = match harness::measure(&mut timer, &job.timing) {
        Ok(m) => m,
        Err(MeasureError::Timer(e)) => return Err(e),
        Err(MeasureError::Timeout { elapsed_s }) => {
            return Ok(Row::failed(
                c.params(),
                imp.name(),
                imp.library(),
                imp.is_default_for(c),
                Status::Timeout,
                format!(
                    "timing passed the {:.0} s limit after {elapsed_s:.1} s",
                    job.timing.case_timeout_s
                ),
            ))
        }
        Err(MeasureError::BadTime(t)) => {
            return Ok(Row::failed(
                c.params(),
                imp.name(),
                imp.library(),
                imp.is_default_for(c),
                Status::Error,
                format!("event timer returned {t} ms"),
            ))
        }
    };

    let flops = c.flops();
    let arg_bytes = c.input_bytes();
    let out_bytes = 2 * c.q_elems() as u64;
    let tol = c.dtype.tolerance();
    let mut row = Row {
        case: c.params(),
        implementation: imp.name().into(),
        library: imp.library().into(),
        default: imp.is_default_for(c),
        status: Status::Ok,
        message: None,
        median_ms: Some(m.stats.median_ms),
        q1_ms: Some(m.stats.q1_ms),
        q3_ms: Some(m.stats.q3_ms),
        inner_calls: Some(m.inner),
        samples: Some(m.stats.samples),
        input_sets: Some(n_sets),
        compile_s: Some(compile_s),
        memory: Some(Memory {
            arguments_mb: Some(mb(arg_bytes)),
            outputs_mb: Some(mb(out_bytes)),
            temporaries_mb: Some(mb(imp.temporary_bytes(c))),
            residuals_mb: None,
            peak_mb: Some(mb(peak)),
            peak_method: Some(
                "cuMemGetInfo: device memory in use after one call minus in use after context creation, in a fresh process running only this case".into(),
            ),
        }),
        accuracy: None,
        flops: Some(flops),
        bytes: None,
        items: None,
    };
    if rel_err.is_finite() {
        row.accuracy = Some(Accuracy {
            rel_err,
            metric: "rel_l2".into(),
            reference: Reference::Float64Cpu,
            tolerance: tol,
            checked: Some(plan.describe(c)),
        });
    } else {
        row.status = Status::Error;
        row.message = Some(
            "non-finite output: some element is NaN or infinite (unwritten or overflowed)".into(),
        );
    }
    Ok(row)
}

/// A `Stdio` writing to this process's standard error.
fn stderr_stdio() -> Stdio {
    use std::os::fd::AsFd;
    match std::io::stderr().as_fd().try_clone_to_owned() {
        Ok(fd) => Stdio::from(fd),
        Err(_) => Stdio::null(),
    }
}

fn locate_script() -> Result<PathBuf> {
    let candidates = [
        PathBuf::from("runners/compare_attention.py"),
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("runners/compare_attention.py"),
    ];
    candidates
        .into_iter()
        .find(|p| p.is_file())
        .context("runners/compare_attention.py not found (run from the repository root)")
}

/// Output of the comparison script.
#[derive(Deserialize)]
struct CompareOutput {
    #[serde(default)]
    libraries: BTreeMap<String, String>,
    rows: Vec<Row>,
}

const TORCH_IMPLS: [&str; 4] = [
    "torch_flash",
    "torch_cudnn",
    "torch_efficient",
    "torch_math",
];

/// Runs the Python comparison script; any failure becomes rows with the reason.
fn compare_torch(
    cli: &Cli,
    script: &Path,
    cases: &[AttentionCase],
    timing: &TimingConfig,
    l2_bytes: u64,
) -> (Vec<Row>, BTreeMap<String, String>) {
    let all_failed = |status: Status, why: &str| -> Vec<Row> {
        cases
            .iter()
            .flat_map(|c| TORCH_IMPLS.iter().map(move |i| (c, i)))
            .map(|(c, i)| Row::failed(c.params(), i, "PyTorch", false, status, why))
            .collect()
    };
    let dir = std::env::temp_dir().join(format!("kp-compare-{}", std::process::id()));
    if let Err(e) = std::fs::create_dir_all(&dir) {
        return (
            all_failed(Status::Error, &format!("temp dir: {e}")),
            BTreeMap::new(),
        );
    }
    let req_path = dir.join("request.json");
    let out_path = dir.join("rows.json");
    let request = serde_json::json!({
        "timing": timing,
        "l2_bytes": l2_bytes,
        "seed": cli.seed,
        "implementations": TORCH_IMPLS,
        "memory_subprocess": cli.compare_memory == "subprocess",
        "check_rows": cli.check_rows,
        "check_slices": 2,
        "cases": cases.iter().map(|c| c.params()).collect::<Vec<_>>(),
    });
    if let Err(e) = std::fs::write(&req_path, request.to_string()) {
        return (
            all_failed(Status::Error, &format!("writing request: {e}")),
            BTreeMap::new(),
        );
    }
    let child = Command::new(&cli.python)
        .arg(script)
        .arg("--request")
        .arg(&req_path)
        .arg("--output")
        .arg(&out_path)
        // Its stdout goes to our stderr: our stdout may be the document itself.
        .stdout(stderr_stdio())
        .stderr(Stdio::inherit())
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) => {
            return (
                all_failed(
                    Status::Unsupported,
                    &format!("`{}` could not be started: {e}", cli.python),
                ),
                BTreeMap::new(),
            )
        }
    };
    let limit = Duration::from_secs_f64(
        timing.case_timeout_s * 2.0 * (cases.len() * TORCH_IMPLS.len()) as f64 + 120.0,
    );
    let t0 = Instant::now();
    let waited = wait_with_limit(&mut child, t0, limit, Duration::from_millis(200));
    let killed = matches!(waited, Ok(None));
    let status = waited.ok().flatten();
    let parsed: Option<CompareOutput> = std::fs::read_to_string(&out_path)
        .ok()
        .and_then(|s| serde_json::from_str(&s).ok());
    let (mut rows, libs) = match parsed {
        Some(o) => (o.rows, o.libraries),
        None => (Vec::new(), BTreeMap::new()),
    };
    // Every (case, implementation) gets a row: the ones the script did not write say why.
    let why = if killed {
        (
            Status::Timeout,
            format!(
                "comparison script killed after {:.0} s",
                t0.elapsed().as_secs_f64()
            ),
        )
    } else {
        (
            Status::Error,
            format!(
                "comparison script ended ({}) before writing this row",
                status.map_or("unknown".into(), |s| s.to_string())
            ),
        )
    };
    let mut missing = Vec::new();
    for c in cases {
        let p = c.params();
        for i in TORCH_IMPLS {
            if !rows.iter().any(|r| r.case == p && r.implementation == i) {
                missing.push(Row::failed(
                    p.clone(),
                    i,
                    "PyTorch",
                    false,
                    why.0,
                    why.1.clone(),
                ));
            }
        }
    }
    rows.extend(missing);
    let _ = std::fs::remove_dir_all(&dir);
    (rows, libs)
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_child_past_its_limit_is_killed() {
        let t0 = Instant::now();
        let mut slow = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        let waited = wait_with_limit(
            &mut slow,
            t0,
            Duration::from_millis(100),
            Duration::from_millis(10),
        );
        assert!(matches!(waited, Ok(None)), "{waited:?}");
        assert!(t0.elapsed() < Duration::from_secs(4));
        let mut quick = std::process::Command::new("true").spawn().unwrap();
        let waited = wait_with_limit(
            &mut quick,
            Instant::now(),
            Duration::from_secs(5),
            Duration::from_millis(10),
        );
        assert!(waited.unwrap().unwrap().success());
    }

    use super::*;

    #[test]
    fn shard_parses_and_partitions_the_grid() {
        assert_eq!(parse_shard("2/3"), Ok(Shard { index: 2, count: 3 }));
        for bad in ["0/2", "3/2", "1/0", "1", "a/2", "1/b"] {
            assert!(parse_shard(bad).is_err(), "{bad}");
        }
        // Every position lands in exactly one shard.
        let shards: Vec<Shard> = (1..=3).map(|i| Shard { index: i, count: 3 }).collect();
        for pos in 0..20 {
            assert_eq!(shards.iter().filter(|s| s.takes(pos)).count(), 1);
        }
        assert!(Shard { index: 1, count: 1 }.takes(7));
    }

    #[test]
    fn shard_option_parses_without_touching_the_grid() {
        let cli = Cli::try_parse_from(["attention", "--shard", "1/2"]).unwrap();
        assert_eq!(cli.shard, Some(Shard { index: 1, count: 2 }));
        let grid_all = grid(&cli).unwrap();
        assert_eq!(grid_all.len(), 2 * 2 * 6);
    }
}
