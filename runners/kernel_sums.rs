//! `kernel_sums`: measures Gaussian kernel sums over point clouds (`rbf_mv`, `kde`,
//! `kernel_lse` and its gradient; [`kernelpages::kernel_sums`]) for the project's
//! implementation and, with `--compare torch,jax`, PyTorch's and JAX's dense formulations
//! (`runners/compare/torch_kernel_sums.py`: `cdist`, `exp`, matmul / `logsumexp`;
//! `runners/compare/jax_kernel_sums.py`: the same through a matrix product, jitted; both hold
//! the N × M matrix), with `--compare ott` ott-jax's Sinkhorn solver on the Sinkhorn cases
//! (`runners/compare/ott_sinkhorn.py`), with `--compare geomloss` geomloss's soft-min on the
//! Sinkhorn iteration cases (`runners/compare/geomloss_sinkhorn.py`), and writes one suite
//! document. The machinery (processes, order, timing records, progress, document) is `kernelpages::runner`; this file is the grid, the
//! implementations, the dispatch table and the counts.
//!
//! The project's implementations: `online` on a CUDA device (`kernels/kernel_sums/
//! kernel_sums.cu`, [`kernelpages::kernel_sums::cuda`]) and `cpu_tiled` on the CPU
//! (`--device cpu`, [`kernelpages::kernel_sums::cpu`]). The comparison modules measure on the
//! run's device (the job's `device`).
//!
//! ```text
//! kernel_sums --compare torch --output data/gpu_kernel_sums.json
//! kernel_sums --device cpu --compare torch,jax,ott,geomloss --output data/cpu_kernel_sums.json
//! kernel_sums --device cpu --quick --ops kernel_lse
//! ```

use std::path::Path;
use std::process::ExitCode;

#[path = "kernel_sums/sinkhorn.rs"]
mod sinkhorn;

use anyhow::{Context, Result};
use clap::Parser;

use cudarc::driver::CudaSlice;

use kernelpages::attention::cpu_flash::read_elements;
use kernelpages::attention::Dtype;
use kernelpages::gpu::{Gpu, GpuError};
use kernelpages::kernel_sums::cpu::{self as ks_cpu, BLOCK_COLS, BLOCK_ROWS, GEMM_DIM};
use kernelpages::kernel_sums::cuda::{self as ks_cuda, DeviceInputs, SMALL_DIMS, THREADS};
use kernelpages::kernel_sums::{files, Inputs, KernelSumCase, Op, Scale};
use kernelpages::runner::grid::Params;
use kernelpages::runner::protocol::{CaseFiles, Job, Reply, TensorFile};
use kernelpages::runner::{self, host, own, Alternative, Declared, DeviceChoice, RunnerArgs};
use kernelpages::schema::{Count, DispatchRule, RunKind, Status, Suite, Throughput};

/// Measure kernel sums on the GPU (or with --device cpu the CPU) and write a suite document.
#[derive(Parser, Debug)]
#[command(
    name = "kernel_sums",
    version,
    about = "Measure Gaussian kernel sums (rbf_mv, kde, kernel_lse) on the GPU (data/gpu_kernel_sums.json) or with --device cpu the CPU (data/cpu_kernel_sums.json) and write a suite document"
)]
struct Cli {
    #[command(flatten)]
    run: RunnerArgs,
    /// Operations: `rbf_mv`, `kde`, `kernel_lse`, `kernel_lse_grad` (the log-sum-exp and its
    /// gradient with respect to X), `sinkhorn` (one iteration and a solve, at dims ≤ 3; on the
    /// GPU by default at dim 3, both up to N = 10⁵: one iteration's float64 reference at 10⁶
    /// would be 2·10¹² pair evaluations on the host) [default: all].
    #[arg(long, value_delimiter = ',')]
    ops: Option<Vec<String>>,
    /// Point counts N = M [default: 1000,10000,100000,1000000 on the GPU (up to 100000 from
    /// dim 16), 1000,4000,16000 on the CPU; the smallest two (one on the CPU) with --quick].
    #[arg(long, value_delimiter = ',')]
    sizes: Option<Vec<usize>>,
    /// Point dimensions (kde runs at the ones ≤ 3) [default: 1,3,16,64 on the GPU, 3,64 on the
    /// CPU].
    #[arg(long, value_delimiter = ',')]
    dims: Option<Vec<usize>>,
    /// Columns of b for `rbf_mv`.
    #[arg(long, default_value_t = 1)]
    cols: usize,
    /// Output rows checked against float64 per case (evenly spaced, first and last included).
    #[arg(long, default_value_t = 256)]
    check_rows: usize,
}

/// The project's CPU implementation.
const CPU_IMPLEMENTATION: &str = "cpu_tiled";
/// The project's CUDA implementation.
const GPU_IMPLEMENTATION: &str = "online";

/// Point counts of the GPU grid.
const GPU_SIZES: [usize; 4] = [1000, 10_000, 100_000, 1_000_000];
/// Largest default N = M on the GPU from dim 16 (the feature kernels make ~1e11 evaluations/s,
/// so 10⁶ points would take ~10 s a call).
const GPU_FEATURE_MAX_SIZE: usize = 100_000;
/// Point dimensions of the GPU grid: point clouds (1, 3) and features (16, 64).
const GPU_DIMS: [usize; 4] = [1, 3, 16, 64];
/// Point dimensions of the CPU grid.
const CPU_DIMS: [usize; 2] = [3, 64];
/// Point counts of the GPU `--quick` grid.
const GPU_QUICK_SIZES: [usize; 2] = [1000, 10_000];

/// The alternatives `--compare` can add (each module measures on the run's device).
const ALTERNATIVES: [Alternative; 4] = [
    Alternative {
        name: "torch",
        module: "torch_kernel_sums",
        library: "PyTorch",
        implementations: &["torch_dense"],
    },
    Alternative {
        name: "jax",
        module: "jax_kernel_sums",
        library: "JAX",
        implementations: &["jax_dense"],
    },
    Alternative {
        name: "ott",
        module: "ott_sinkhorn",
        library: "ott-jax",
        implementations: &sinkhorn::OTT_IMPLEMENTATIONS,
    },
    Alternative {
        name: "geomloss",
        module: "geomloss_sinkhorn",
        library: "geomloss",
        implementations: &sinkhorn::GEOMLOSS_IMPLEMENTATIONS,
    },
];

/// Point counts of the CPU grid.
const CPU_SIZES: [usize; 3] = [1000, 4000, 16000];
/// Point counts of the CPU `--quick` grid.
const CPU_QUICK_SIZES: [usize; 1] = [1000];
/// Every operation name `--ops` takes.
const OPS: [&str; 5] = [
    "rbf_mv",
    "kde",
    "kernel_lse",
    "kernel_lse_grad",
    sinkhorn::OP,
];
/// Largest default N of the Sinkhorn `solve` rows on the CPU (a solve at 16000 points takes
/// minutes on a few cores: each sample repeats it).
const CPU_SOLVE_MAX_SIZE: usize = 4000;
/// Largest default N of the Sinkhorn `solve` rows on the GPU (at 10⁶ points an iteration takes
/// about a second, and a solve ~100 of them, each sample).
const GPU_SOLVE_MAX_SIZE: usize = 100_000;
/// Largest default N of the Sinkhorn `iteration` rows on the GPU. Their check is f after one
/// iteration in float64 on the host ([`sinkhorn::write_case`]): f needs every entry of g, and
/// each entry of g a sum over all N points, so the reference costs 2·N² float64 pair
/// evaluations whatever rows are checked. At 10⁶ points that is 2·10¹²: on 2026-12-05 that
/// case had no row after about 115 s on the H200 machine when the call's time ran out (the
/// runner writes a case's files, the reference among them, before its first row).
const GPU_ITERATION_MAX_SIZE: usize = 100_000;

/// How FLOPs are counted (the document's `flop_rule`).
const FLOP_RULE: &str = "per (x, y) pair: 3·dim for the squared distance, 1 for the exponential, 2·cols for the product with b (rbf_mv, kde) or 2 for the running sum (kernel_lse), 2·dim more for the gradient's Σ p·y; throughput counts kernel evaluations, N·M per call (2·N·M with the gradient)";

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match &cli.run.run_case {
        Some(job) => runner::child_main(job, |job| {
            if job.implementation == GPU_IMPLEMENTATION {
                match sinkhorn::SinkhornCase::from_params(&job.case) {
                    Ok(Some(c)) => sinkhorn::measure_gpu(job, c),
                    Ok(None) => measure_gpu(job),
                    Err(e) => Reply::failed(job, Status::Error, format!("{e:#}")),
                }
            } else {
                measure_cpu(job)
            }
        }),
        None => run(&cli),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("Error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// The cases of the grid (or the quick grid).
fn cases(cli: &Cli, quick: bool) -> Result<Vec<Params>> {
    let gpu = cli.run.device == DeviceChoice::Gpu;
    let ops: Vec<String> = cli
        .ops
        .clone()
        .unwrap_or_else(|| OPS.iter().map(|s| s.to_string()).collect());
    let sizes: Vec<usize> = match (&cli.sizes, quick, gpu) {
        (Some(s), _, _) => s.clone(),
        (None, true, true) => GPU_QUICK_SIZES.to_vec(),
        (None, false, true) => GPU_SIZES.to_vec(),
        (None, true, false) => CPU_QUICK_SIZES.to_vec(),
        (None, false, false) => CPU_SIZES.to_vec(),
    };
    let dims = match (&cli.dims, gpu) {
        (Some(d), _) => d.clone(),
        (None, true) => GPU_DIMS.to_vec(),
        (None, false) => CPU_DIMS.to_vec(),
    };
    let mut out = Vec::new();
    for op in &ops {
        if op == sinkhorn::OP {
            // On the GPU by default the 3-D clouds only (the suite's point-cloud case).
            let default_dim = |d: usize| !gpu || cli.dims.is_some() || d == 3;
            for &dim in dims.iter().filter(|&&d| d <= 3 && default_dim(d)) {
                for pass in [sinkhorn::Pass::Iteration, sinkhorn::Pass::Solve] {
                    for &n in &sizes {
                        let solve_max = if gpu {
                            GPU_SOLVE_MAX_SIZE
                        } else {
                            CPU_SOLVE_MAX_SIZE
                        };
                        if pass == sinkhorn::Pass::Solve && cli.sizes.is_none() && n > solve_max {
                            continue;
                        }
                        if pass == sinkhorn::Pass::Iteration
                            && gpu
                            && cli.sizes.is_none()
                            && n > GPU_ITERATION_MAX_SIZE
                        {
                            continue;
                        }
                        let c = sinkhorn::SinkhornCase {
                            n,
                            dim,
                            pass,
                            epsilon: sinkhorn::EPSILON,
                        };
                        out.push(c.params());
                    }
                }
            }
            continue;
        }
        let (op, grad) = match op.as_str() {
            "kernel_lse_grad" => (Op::KernelLse, true),
            name => (
                Op::parse(name)
                    .with_context(|| format!("--ops: unknown op `{name}` ({})", OPS.join(", ")))?,
                false,
            ),
        };
        for &dim in &dims {
            if op == Op::Kde && dim > 3 {
                continue;
            }
            for &n in &sizes {
                if gpu && cli.sizes.is_none() && dim > 3 && n > GPU_FEATURE_MAX_SIZE {
                    continue;
                }
                let c = KernelSumCase {
                    cols: if op == Op::RbfMv { cli.cols } else { 1 },
                    grad,
                    ..KernelSumCase::new(op, n, n, dim)
                };
                c.validate().map_err(anyhow::Error::msg)?;
                out.push(c.params());
            }
        }
    }
    Ok(out)
}

/// What the entry points run: on a CUDA device one kernel per (op, dim class, column tile),
/// on the CPU the tiled implementation.
fn dispatch_rules(device: DeviceChoice) -> Vec<DispatchRule> {
    if device == DeviceChoice::Gpu {
        let dims: Vec<String> = SMALL_DIMS.iter().map(|d| d.to_string()).collect();
        return vec![DispatchRule {
            entry_point: "kernel_sums::cuda::Runner, kernel_sums::cuda::compute".into(),
            device: "CUDA, compute capability 8.0 or newer".into(),
            dtype: "fp32".into(),
            rule: format!(
                "always: Y streamed through shared memory in tiles, never an N × M matrix; the base-2 exponential on the special-function unit (ex2.approx); dim {} compiled as constants, one thread per output row ({THREADS} per block) and 2 rows per thread; dim 4 to {tc_max}: the log-sum-exp (and its gradient, Σ p·y a second product on the same instructions), the KDE and the one-column matvec on tensor cores (x·y of {tc_rows}-row blocks against {tc_tile}-point tiles on mma.sync TF32, each operand split into two TF32 parts, three products each: about float32's accuracy; Y centred and prepared once per call), the matvec with several columns through the generic kernel (one thread per output row, distances on CUDA cores); any larger dim through the generic kernel; at dim {} and on tensor cores the log-sum-exp without the gradient, the KDE and the one-column matvec split Y into parts of whole tiles (at least {} points, but the last) when the row blocks are fewer than {}, and a second kernel merges each row's parts; Sinkhorn's iteration keeps its potentials on the device; a solve's float64 passes over the pairs (its convergence confirmation and final evaluation) run on the device in float64",
                dims.join(", "),
                dims.join(", "),
                ks_cuda::SPLIT_MIN_POINTS,
                ks_cuda::SPLIT_TARGET_BLOCKS,
                tc_max = ks_cuda::TC_MAX_DIM,
                tc_rows = ks_cuda::TC_ROWS,
                tc_tile = ks_cuda::TC_TILE,
            ),
            implementation: GPU_IMPLEMENTATION.into(),
        }];
    }
    vec![DispatchRule {
        entry_point: "kernel_sums::cpu::compute, kernel_sums::cpu::kernel_lse".into(),
        device: "CPU (x86-64 or any other target; AVX2 + FMA used where present)".into(),
        dtype: "fp32".into(),
        rule: format!(
            "always: rows of X in blocks of {BLOCK_ROWS} over rayon's threads, Y in tiles of {BLOCK_COLS} points, never an N × M matrix; squared distances directly below dim {GEMM_DIM}, through a gemm-crate matrix product from dim {GEMM_DIM}"
        ),
        implementation: CPU_IMPLEMENTATION.into(),
    }]
}

/// The document's throughput: kernel evaluations per second.
fn throughput_decls() -> Vec<Throughput> {
    vec![Throughput {
        key: "gevals".into(),
        unit: "G evaluations/s".into(),
        count: Count::Items,
        per_second: 1e9,
        ceiling: None,
    }]
}

struct KernelSums {
    check_rows: usize,
}

fn case_of(p: &Params) -> Result<KernelSumCase> {
    KernelSumCase::from_params(p).map_err(anyhow::Error::msg)
}

impl runner::Suite for KernelSums {
    fn suite(&self) -> Suite {
        Suite::KernelSums
    }

    /// X and Y uniform in the unit cube, b standard normal or g uniform in [−1, 1)
    /// ([`Inputs::random`]), and the float64 reference of `check_rows` rows; Sinkhorn cases
    /// as [`sinkhorn::write_case`].
    fn prepare(&self, p: &Params, seed: u64, dir: &Path) -> Result<CaseFiles> {
        if let Some(c) = sinkhorn::SinkhornCase::from_params(p)? {
            return sinkhorn::write_case(&c, seed, self.check_rows, dir);
        }
        files::write_case(&case_of(p)?, seed, self.check_rows, dir)
    }

    fn unsupported(&self, p: &Params, implementation: &str) -> Option<String> {
        match sinkhorn::SinkhornCase::from_params(p) {
            Ok(Some(_)) => {
                sinkhorn::unsupported(implementation, &[CPU_IMPLEMENTATION, GPU_IMPLEMENTATION])
            }
            Ok(None) => case_of(p).err().map(|e| format!("{e:#}")),
            Err(e) => Some(format!("{e:#}")),
        }
    }

    /// ott-jax's and geomloss's implementations compute Sinkhorn only: no rows on the
    /// kernel-sum cases.
    fn applies(&self, p: &Params, implementation: &str) -> bool {
        !sinkhorn::is_solver_library(implementation)
            || matches!(sinkhorn::SinkhornCase::from_params(p), Ok(Some(_)))
    }

    fn is_default(&self, _p: &Params, implementation: &str) -> bool {
        implementation == CPU_IMPLEMENTATION || implementation == GPU_IMPLEMENTATION
    }

    fn notes(&self, p: &Params, implementation: &str) -> Vec<String> {
        if let Ok(Some(c)) = sinkhorn::SinkhornCase::from_params(p) {
            let mut notes = vec![format!(
                "ε = {:e} (blur {:.2}), uniform weights, points uniform in the unit cube",
                c.epsilon,
                c.epsilon.sqrt()
            )];
            let own = implementation == CPU_IMPLEMENTATION || implementation == GPU_IMPLEMENTATION;
            if c.pass == sinkhorn::Pass::Iteration && own {
                notes.push("the iteration keeps its own centred copy of the points from the first call, so the input rotation does not reach it".into());
            }
            return notes;
        }
        let Ok(c) = case_of(p) else {
            return Vec::new();
        };
        let mut notes = Vec::new();
        if implementation == GPU_IMPLEMENTATION {
            notes.push("the time includes copying the output (N floats, N·(1 + dim) with the gradient) from the kernel's buffer into the runner's".into());
        }
        if implementation == CPU_IMPLEMENTATION && c.dim >= GEMM_DIM {
            notes.push(format!("dim ≥ {GEMM_DIM}: squared distances as ‖x‖² + ‖y‖² − 2 x·y with the cross term a float32 matrix product"));
        }
        notes
    }

    fn label(&self, p: &Params) -> String {
        if let Ok(Some(c)) = sinkhorn::SinkhornCase::from_params(p) {
            return c.label();
        }
        match case_of(p) {
            Ok(c) => format!(
                "{}{} N{} M{} D{}{}",
                c.op.as_str(),
                if c.grad { "+grad" } else { "" },
                c.n,
                c.m,
                c.dim,
                if c.op == Op::RbfMv {
                    format!(" C{}", c.cols)
                } else {
                    String::new()
                }
            ),
            Err(_) => format!("{p:?}"),
        }
    }
}

/// The GPU suite's L2 rotation factor when `--l2-rotation-factor` is not given: none. A kernel
/// sum reads Y from L2 once per block of rows (N/256 times a call) by design, so whether the
/// first read comes from HBM changes nothing, while rotating through 64 copies of small inputs
/// turns one CUDA graph of a 0.1–0.3 s call into 64 of them.
const GPU_L2_ROTATION_FACTOR: f64 = 0.0;

/// The run's arguments with the suite's own defaults filled in.
fn run_args(cli: &Cli) -> RunnerArgs {
    let mut args = cli.run.clone();
    if args.device == DeviceChoice::Gpu && args.l2_rotation_factor.is_none() {
        args.l2_rotation_factor = Some(GPU_L2_ROTATION_FACTOR);
    }
    args
}

fn run(cli: &Cli) -> Result<ExitCode> {
    let args = run_args(cli);
    let own = match cli.run.device {
        DeviceChoice::Gpu => GPU_IMPLEMENTATION,
        DeviceChoice::Cpu => CPU_IMPLEMENTATION,
    };
    let imps = runner::implementations(&[(own, "kernelpages")], &ALTERNATIVES, &cli.run.compare)?;
    let cases = cli.run.select(cases(cli, false)?, cases(cli, true)?)?;
    let declared = Declared {
        runner: "kernel_sums",
        flop_rule: Some(FLOP_RULE.into()),
        dispatch: dispatch_rules(cli.run.device),
        axes: vec!["n".into()],
        throughput: throughput_decls(),
        kind: RunKind::Grid,
    };
    let suite = KernelSums {
        check_rows: cli.check_rows,
    };
    runner::run(&suite, &args, declared, cases, imps, Vec::new())
}

/// `cpu_tiled` on one case, as the shared CPU case process drives it.
struct Launch {
    case: KernelSumCase,
    scale: Scale,
    out: Vec<f32>,
}

impl host::Launcher for Launch {
    type Set = Inputs;
    fn load(&self, inputs: &[TensorFile]) -> Result<Inputs> {
        for t in inputs {
            anyhow::ensure!(
                t.dtype == "fp32",
                "input {} is {}, expected fp32",
                t.name,
                t.dtype
            );
        }
        let read = |k: usize| -> Result<Vec<f32>> {
            match inputs.get(k) {
                Some(t) => read_elements(&t.path),
                None => Ok(Vec::new()),
            }
        };
        Ok(Inputs {
            x: read(0)?,
            y: read(1)?,
            w: read(2)?,
        })
    }
    fn replicate(&self, set: &Inputs) -> Inputs {
        set.clone()
    }
    fn poison(&mut self) {
        self.out.fill(f32::NAN);
    }
    fn call(&mut self, set: &Inputs) -> Result<()> {
        ks_cpu::compute(&self.case, set, self.scale, &mut self.out);
        Ok(())
    }
    fn value(&self, i: usize) -> f64 {
        self.out[i] as f64
    }
    fn output_len(&self) -> usize {
        self.case.output_len() - self.gradient_len(0)
    }
    fn gradient_value(&self, k: usize, i: usize) -> f64 {
        if k == 0 {
            self.out[self.output_len() + i] as f64
        } else {
            f64::NAN
        }
    }
    fn gradient_len(&self, k: usize) -> usize {
        if k == 0 && self.case.grad {
            self.case.n * self.case.dim
        } else {
            0
        }
    }
    fn temporary_bytes(&self) -> u64 {
        ks_cpu::temporary_bytes(&self.case, rayon::current_num_threads())
    }
}

/// The job's case and its σ and ε, the ones the runner wrote into the case's arguments (so
/// every implementation uses the same values).
///
/// # Errors
/// A case that does not parse, or arguments without σ or ε.
fn job_case(job: &Job) -> Result<(KernelSumCase, Scale)> {
    let case = case_of(&job.case)?;
    let arg = |k: &str| job.files.arguments.get(k).and_then(|v| v.as_f64());
    match (arg("sigma"), arg("epsilon")) {
        (Some(sigma), Some(epsilon)) => Ok((case, Scale { sigma, epsilon })),
        _ => anyhow::bail!("the case's arguments lack sigma or epsilon"),
    }
}

/// The case process for `cpu_tiled`.
fn measure_cpu(job: &Job) -> Reply {
    if job.implementation != CPU_IMPLEMENTATION {
        return Reply::failed(
            job,
            Status::Error,
            format!("unknown implementation `{}`", job.implementation),
        );
    }
    match sinkhorn::SinkhornCase::from_params(&job.case) {
        Ok(Some(c)) => return sinkhorn::measure_cpu(job, c),
        Ok(None) => {}
        Err(e) => return Reply::failed(job, Status::Error, format!("{e:#}")),
    }
    let (case, scale) = match job_case(job) {
        Ok(x) => x,
        Err(e) => return Reply::failed(job, Status::Error, format!("{e:#}")),
    };
    let len = case.output_len();
    host::measure(job, || {
        Ok(Launch {
            case,
            scale,
            out: vec![0.0; len],
        })
    })
}

/// `online` on one case, as the shared GPU case process drives it: the kernel writes one
/// float32 buffer (the output, then the gradient), copied into the runner's outputs.
struct GpuLaunch {
    runner: ks_cuda::Runner,
    case: KernelSumCase,
    scale: Scale,
    out: CudaSlice<f32>,
}

impl own::Launcher for GpuLaunch {
    type Set = DeviceInputs;
    fn upload(&self, gpu: &Gpu, host: &[Vec<u16>]) -> Result<DeviceInputs, GpuError> {
        let f = |k: usize| -> Vec<f32> {
            host.get(k).map_or(Vec::new(), |w| {
                Dtype::F32
                    .decode_all(w)
                    .into_iter()
                    .map(|x| x as f32)
                    .collect()
            })
        };
        ks_cuda::upload(
            gpu,
            &self.case,
            &Inputs {
                x: f(0),
                y: f(1),
                w: f(2),
            },
        )
    }
    fn replicate(&self, gpu: &Gpu, set: &DeviceInputs) -> Result<DeviceInputs, GpuError> {
        Ok(DeviceInputs {
            x: gpu.stream.clone_dtod(&set.x)?,
            y: gpu.stream.clone_dtod(&set.y)?,
            w: match &set.w {
                Some(w) => Some(gpu.stream.clone_dtod(w)?),
                None => None,
            },
        })
    }
    fn launch(
        &mut self,
        gpu: &Gpu,
        set: &DeviceInputs,
        outs: &mut [CudaSlice<u16>],
    ) -> Result<(), GpuError> {
        self.runner
            .launch(gpu, &self.case, self.scale, set, &mut self.out)?;
        let mut start = 0;
        for o in outs.iter_mut() {
            let len = o.len() / 2;
            if start + len > self.out.len() {
                return Err(GpuError::Config(format!(
                    "outputs of {} floats; the kernel writes {}",
                    start + len,
                    self.out.len()
                )));
            }
            // SAFETY: `o` holds 2·len 16-bit words, the bytes of `len` floats.
            let mut dst = unsafe { o.transmute_mut::<f32>(len) }
                .ok_or_else(|| GpuError::Config("output buffer too short".into()))?;
            gpu.stream
                .memcpy_dtod(&self.out.slice(start..start + len), &mut dst)?;
            start += len;
        }
        Ok(())
    }
    fn temporary_bytes(&self) -> u64 {
        // The kernel's own output buffer, apart from the runner's, a split kernel sum's
        // partials and the tensor-core kernels' prepared Y.
        self.case.output_len() as u64 * 4 + self.runner.workspace_bytes()
    }
    fn residual_bytes(&self) -> Option<u64> {
        None
    }
    fn workspace_bytes(&self) -> u64 {
        0
    }
}

/// The case process for `online`: σ and ε from the case's arguments, as for `cpu_tiled`.
fn measure_gpu(job: &Job) -> Reply {
    let (case, scale) = match job_case(job) {
        Ok(x) => x,
        Err(e) => return Reply::failed(job, Status::Error, format!("{e:#}")),
    };
    own::measure(job, |gpu| {
        let runner = ks_cuda::Runner::new(gpu, &case)?;
        let compile_s = runner.compile_s;
        // SAFETY: every element is written by the kernel before it is copied out.
        let out = unsafe { gpu.stream.alloc::<f32>(case.output_len())? };
        Ok((
            GpuLaunch {
                runner,
                case: case.clone(),
                scale,
                out,
            },
            compile_s,
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kernelpages::runner::Suite;

    #[test]
    fn the_cpu_grid_and_its_selection() {
        let cli = Cli::try_parse_from(["kernel_sums", "--device", "cpu"]).unwrap();
        let all = cases(&cli, false).unwrap();
        // rbf_mv, kernel_lse and its gradient at dims 3 and 64, kde at dim 3; 3 sizes each;
        // Sinkhorn at dim 3: an iteration at every size, a solve up to CPU_SOLVE_MAX_SIZE.
        let solves = CPU_SIZES
            .iter()
            .filter(|&&n| n <= CPU_SOLVE_MAX_SIZE)
            .count();
        assert_eq!(
            all.len(),
            (3 * 2 + 1) * CPU_SIZES.len() + CPU_SIZES.len() + solves
        );
        let sk: Vec<_> = all
            .iter()
            .filter_map(|p| sinkhorn::SinkhornCase::from_params(p).unwrap())
            .collect();
        assert_eq!(sk.len(), CPU_SIZES.len() + solves);
        assert!(sk
            .iter()
            .all(|c| c.dim == 3 && c.epsilon == sinkhorn::EPSILON));
        assert_eq!(
            sinkhorn::SinkhornCase::from_params(&sk[0].params()).unwrap(),
            Some(sk[0])
        );
        let cli = Cli::try_parse_from([
            "kernel_sums",
            "--device",
            "cpu",
            "--quick",
            "--filter",
            "op=kernel_lse,pass=fwd+bwd",
        ])
        .unwrap();
        let kept = cli
            .run
            .select(cases(&cli, false).unwrap(), cases(&cli, true).unwrap())
            .unwrap();
        assert_eq!(kept.len(), 2);
        assert!(
            Cli::try_parse_from(["kernel_sums", "--device", "cpu", "--ops", "sinc"])
                .map(|c| cases(&c, false).is_err())
                .unwrap()
        );
        // The GPU grid: the same ops over its own sizes and dims, the feature dims (16, 64)
        // without 10⁶ points; kde at dims 1 and 3; Sinkhorn at dim 3 only, an iteration up to
        // GPU_ITERATION_MAX_SIZE and a solve up to GPU_SOLVE_MAX_SIZE.
        let gpu = Cli::try_parse_from(["kernel_sums"]).unwrap();
        let gpu_cases = cases(&gpu, false).unwrap();
        let gpu_solves = GPU_SIZES
            .iter()
            .filter(|&&n| n <= GPU_SOLVE_MAX_SIZE)
            .count();
        let gpu_iterations = GPU_SIZES
            .iter()
            .filter(|&&n| n <= GPU_ITERATION_MAX_SIZE)
            .count();
        assert_eq!(
            gpu_cases.len(),
            3 * (2 * GPU_SIZES.len() + 2 * (GPU_SIZES.len() - 1))
                + 2 * GPU_SIZES.len()
                + gpu_iterations
                + gpu_solves
        );
        assert_eq!(
            gpu_iterations,
            GPU_SIZES.len() - 1,
            "no iteration at 10⁶ points"
        );
        let suite = KernelSums { check_rows: 16 };
        for p in &gpu_cases {
            let sk = sinkhorn::SinkhornCase::from_params(p).unwrap();
            assert!(sk.is_none_or(|c| c.dim == 3), "{p:?}");
            // ott-jax has rows on the Sinkhorn cases only; the others everywhere.
            assert_eq!(suite.applies(p, "ott_dense"), sk.is_some(), "{p:?}");
            assert_eq!(
                suite.applies(p, "geomloss_tensorized"),
                sk.is_some(),
                "{p:?}"
            );
            assert!(suite.applies(p, "torch_dense") && suite.applies(p, GPU_IMPLEMENTATION));
            assert_eq!(
                suite.unsupported(p, GPU_IMPLEMENTATION),
                None,
                "the GPU runs every case: {p:?}"
            );
        }
        assert_eq!(
            dispatch_rules(DeviceChoice::Gpu)[0].implementation,
            GPU_IMPLEMENTATION
        );
        // No L2 rotation on the GPU unless asked; the CPU keeps the shared default.
        assert_eq!(run_args(&gpu).timing().l2_rotation_factor, 0.0);
        let asked = Cli::try_parse_from(["kernel_sums", "--l2-rotation-factor", "2"]).unwrap();
        assert_eq!(run_args(&asked).timing().l2_rotation_factor, 2.0);
        assert_eq!(
            run_args(&cli).timing().l2_rotation_factor,
            kernelpages::harness::default_timing().l2_rotation_factor
        );
    }
}
