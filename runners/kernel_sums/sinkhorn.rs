//! The Sinkhorn rows of the `kernel_sums` runner: balanced entropic optimal transport between
//! two point clouds of N points each, uniform weights, built on the kernel log-sum-exp
//! ([`kernelpages::kernel_sums::sinkhorn`]).
//!
//! Two passes:
//! - `iteration`: one Sinkhorn iteration at the target ε (g from f, then f from g: two kernel
//!   log-sum-exps over N × N pairs, [`SinkhornIterations::step`]), timed call by call from the
//!   first update f⁰. The first call's f is checked against its float64 definition
//!   ([`first_step_reference`]) at the checked rows. Throughput counts 2·N² kernel
//!   evaluations per call.
//! - `solve`: [`sinkhorn_on`] from scratch to an L1 row-marginal error of [`SOLVE_TOL`], with
//!   ε-scaling (factor [`SCALING`]) from the clouds' squared diameter down to ε, its float64
//!   confirmation and evaluation included. A solve that ends [`Status::NotConverged`] is an
//!   `error` row with its iterations and the error reached, never a time. The output is the
//!   plan's row marginal r, evaluated in float64 from the final potentials, checked over
//!   **every** row against the weights a it must equal (1/N each); its tolerance is
//!   [`SOLVE_TOL`]·√N, what convergence implies for the relative L2 error
//!   (‖r − a‖₂ ≤ ‖r − a‖₁ ≤ tol and ‖a‖₂ = 1/√N). This repeats the solver's own float64
//!   confirmation rather than an independent reference; the row's notes give the iterations,
//!   the L1 error reached and the transport cost, and its `items` (set after the solve) count
//!   the float32 kernel evaluations it made.
//!
//! ε is [`EPSILON`] (blur 0.05 in geomloss's convention ε = blur², cost ‖x − y‖²/2), the
//! points uniform in the unit cube ([`Inputs::random`]).

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::path::Path;
use std::rc::Rc;

use anyhow::Result;
use serde_json::json;

use cudarc::driver::CudaSlice;
use kernelpages::attention::cpu_flash::read_elements;
use kernelpages::attention::Dtype;

use kernelpages::gpu::{Device, Gpu, GpuError};
use kernelpages::kernel_sums::cuda::DeviceSinkhorn;
use kernelpages::kernel_sums::files::checked_rows;
use kernelpages::kernel_sums::sinkhorn::{
    device_iterations, first_step_reference, sinkhorn_on, Cloud, Params as SolveParams,
    SinkhornError, SinkhornIterations, Status, Transport,
};
use kernelpages::kernel_sums::{Inputs, KernelSumCase, Op};
use kernelpages::runner::grid::Params;
use kernelpages::runner::protocol::{
    write_f64, write_u16, CaseFiles, CheckSpec, Job, OutputSpec, Reply, TensorFile,
};
use kernelpages::runner::{host, own};
use kernelpages::schema::{Param, Reference, Status as RowStatus};

/// The op name of the Sinkhorn rows.
pub const OP: &str = "sinkhorn";
/// Target ε, in the cost's unit (squared coordinates): blur 0.05.
pub const EPSILON: f64 = 2.5e-3;
/// L1 row-marginal tolerance of the `solve` rows.
pub const SOLVE_TOL: f64 = 1e-3;
/// ε-scaling factor of the `solve` rows.
pub const SCALING: f64 = 0.5;
/// Relative L2 tolerance of one iteration's f against float64.
pub const ITERATION_TOLERANCE: f64 = 1e-5;

/// What a Sinkhorn row times.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pass {
    /// One iteration at the target ε.
    Iteration,
    /// A whole solve to [`SOLVE_TOL`].
    Solve,
}

impl Pass {
    fn as_str(self) -> &'static str {
        match self {
            Pass::Iteration => "iteration",
            Pass::Solve => "solve",
        }
    }
}

/// One Sinkhorn case: N points against N, dimension `dim`, float32 coordinates.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SinkhornCase {
    /// Points per cloud.
    pub n: usize,
    /// Point dimension.
    pub dim: usize,
    /// What is timed.
    pub pass: Pass,
    /// Target ε.
    pub epsilon: f64,
}

impl SinkhornCase {
    /// The case's parameters: op, n, dim, dtype, pass, epsilon.
    pub fn params(&self) -> Params {
        let mut p = BTreeMap::new();
        p.insert("op".into(), Param::Text(OP.into()));
        p.insert("n".into(), Param::Int(self.n as i64));
        p.insert("dim".into(), Param::Int(self.dim as i64));
        p.insert("dtype".into(), Param::Text("fp32".into()));
        p.insert("pass".into(), Param::Text(self.pass.as_str().into()));
        p.insert("epsilon".into(), Param::Float(self.epsilon));
        p
    }

    /// The case `p` names, or `None` when `p` is not a Sinkhorn case.
    ///
    /// # Errors
    /// A Sinkhorn case with a missing or mistyped parameter.
    pub fn from_params(p: &Params) -> Result<Option<SinkhornCase>> {
        if p.get("op") != Some(&Param::Text(OP.into())) {
            return Ok(None);
        }
        let int = |k: &str| match p.get(k) {
            Some(Param::Int(i)) if *i > 0 => Ok(*i as usize),
            other => anyhow::bail!("sinkhorn parameter `{k}` is {other:?}, not a positive size"),
        };
        let pass = match p.get("pass") {
            Some(Param::Text(t)) if t == "iteration" => Pass::Iteration,
            Some(Param::Text(t)) if t == "solve" => Pass::Solve,
            other => {
                anyhow::bail!("sinkhorn parameter `pass` is {other:?}, not iteration or solve")
            }
        };
        let epsilon = match p.get("epsilon") {
            Some(Param::Float(e)) if *e > 0.0 => *e,
            other => anyhow::bail!("sinkhorn parameter `epsilon` is {other:?}, not > 0"),
        };
        Ok(Some(SinkhornCase {
            n: int("n")?,
            dim: int("dim")?,
            pass,
            epsilon,
        }))
    }

    /// Kernel evaluations of one iteration: 2·N² (the two log-sum-exps).
    pub fn evaluations_per_iteration(&self) -> f64 {
        2.0 * (self.n as f64) * (self.n as f64)
    }

    /// The label of progress lines.
    pub fn label(&self) -> String {
        format!(
            "sinkhorn {} N{} D{} eps {:e}",
            self.pass.as_str(),
            self.n,
            self.dim,
            self.epsilon
        )
    }

    /// The two clouds' points, uniform in the unit cube (as the kernel sums' X and Y).
    fn points(&self, seed: u64) -> (Vec<f32>, Vec<f32>) {
        let inp = Inputs::random(&KernelSumCase::new(Op::Kde, self.n, self.n, self.dim), seed);
        (inp.x, inp.y)
    }
}

/// Writes the case's points (`x`, `y`, float32 `[N, dim]`) and the float64 reference of its
/// check into `dir`: f after one iteration at [`checked_rows`] (`iteration`), or the uniform
/// weights 1/N the row marginal must meet (`solve`).
///
/// # Errors
/// I/O errors.
pub fn write_case(c: &SinkhornCase, seed: u64, check_rows: usize, dir: &Path) -> Result<CaseFiles> {
    let (x, y) = c.points(seed);
    let weights = vec![1.0 / c.n as f64; c.n];
    // A solve's marginal is checked on every row (the tolerance argument needs all of them).
    let rows = match c.pass {
        Pass::Iteration => checked_rows(c.n, check_rows),
        Pass::Solve => (0..c.n).collect(),
    };
    let (reference, tolerance, what) = match c.pass {
        Pass::Iteration => (
            first_step_reference(
                Cloud::new(&x, &weights),
                Cloud::new(&y, &weights),
                c.dim,
                c.epsilon,
                &rows,
            ),
            ITERATION_TOLERANCE,
            "f after one iteration",
        ),
        Pass::Solve => (
            vec![1.0 / c.n as f64; rows.len()],
            SOLVE_TOL * (c.n as f64).sqrt(),
            "the plan's row marginal (against the weights 1/N)",
        ),
    };
    let mut inputs = Vec::new();
    for (name, pts) in [("x", &x), ("y", &y)] {
        let path = dir.join(format!("{name}.bin"));
        write_u16(&path, &Dtype::F32.encode_all(pts))?;
        inputs.push(TensorFile {
            name: name.into(),
            dtype: "fp32".into(),
            shape: vec![c.n, c.dim],
            path,
        });
    }
    let ref_path = dir.join("reference.f64");
    write_f64(&ref_path, &reference)?;
    let mut arguments = BTreeMap::new();
    arguments.insert("op".into(), json!(OP));
    arguments.insert("n".into(), json!(c.n));
    arguments.insert("m".into(), json!(c.n));
    arguments.insert("dim".into(), json!(c.dim));
    arguments.insert("epsilon".into(), json!(c.epsilon));
    arguments.insert("weights".into(), json!("uniform"));
    arguments.insert("tol".into(), json!(SOLVE_TOL));
    arguments.insert("scaling".into(), json!(SCALING));
    let per_iteration = c.evaluations_per_iteration();
    Ok(CaseFiles {
        inputs,
        output: OutputSpec {
            dtype: "fp64".into(),
            shape: vec![c.n],
        },
        check: CheckSpec {
            ranges: rows.iter().map(|&i| [i as u64, 1]).collect(),
            reference: ref_path,
            reference_kind: Reference::Float64Cpu,
            tolerance,
            checked: format!("{} of {} rows of {what}", rows.len(), c.n),
        },
        gradients: Vec::new(),
        arguments,
        // Per iteration: the log-sum-exps' FLOPs (3·dim + 4 per pair) and their evaluations;
        // a solve's count depends on the iterations it takes, unknown before it runs.
        flops: (c.pass == Pass::Iteration).then_some(per_iteration * (3.0 * c.dim as f64 + 4.0)),
        bytes: Some(2.0 * 4.0 * (c.n * c.dim) as f64),
        items: (c.pass == Pass::Iteration).then_some(per_iteration),
    })
}

/// ott-jax's implementations (`runners/compare/ott_sinkhorn.py`, `--compare ott`).
pub const OTT_IMPLEMENTATIONS: [&str; 2] = ["ott_dense", "ott_online"];

/// geomloss's implementations (`runners/compare/geomloss_sinkhorn.py`, `--compare geomloss`):
/// its soft-min on the `iteration` rows; its `solve` rows are `unsupported` (a fixed annealing
/// schedule, no tolerance), which the module says.
pub const GEOMLOSS_IMPLEMENTATIONS: [&str; 2] = ["geomloss_tensorized", "geomloss_online"];

/// Whether `implementation` is a Sinkhorn library's (ott-jax's or geomloss's): rows on the
/// Sinkhorn cases only.
pub fn is_solver_library(implementation: &str) -> bool {
    OTT_IMPLEMENTATIONS.contains(&implementation)
        || GEOMLOSS_IMPLEMENTATIONS.contains(&implementation)
}

/// Why an implementation has no Sinkhorn row: the dense kernel-sum formulations have no
/// solver (the project's own, `own`, ott-jax's and geomloss's have).
pub fn unsupported(implementation: &str, own: &[&str]) -> Option<String> {
    if own.contains(&implementation) || is_solver_library(implementation) {
        return None;
    }
    Some(
        "no Sinkhorn in this library's dense kernel sums; ott-jax's solver is `--compare ott`, \
         geomloss's soft-min `--compare geomloss`"
            .into(),
    )
}

/// The CPU case process's calls: one iteration or one solve, the output f or the row
/// marginal.
struct Launch {
    case: SinkhornCase,
    weights: Vec<f64>,
    iterations: Option<SinkhornIterations<'static>>,
    out: Vec<f64>,
    /// The last solve's result, read after the measurement for the row's notes.
    last: Rc<RefCell<Option<Transport>>>,
}

impl host::Launcher for Launch {
    type Set = (Vec<f32>, Vec<f32>);
    fn load(&self, inputs: &[TensorFile]) -> Result<Self::Set> {
        anyhow::ensure!(
            inputs.len() == 2,
            "sinkhorn takes x and y, got {}",
            inputs.len()
        );
        Ok((
            read_elements(&inputs[0].path)?,
            read_elements(&inputs[1].path)?,
        ))
    }
    fn replicate(&self, set: &Self::Set) -> Self::Set {
        set.clone()
    }
    fn poison(&mut self) {
        self.out.fill(f64::NAN);
    }
    fn call(&mut self, set: &Self::Set) -> Result<()> {
        let c = self.case;
        let (x, y) = (
            Cloud::new(&set.0, &self.weights),
            Cloud::new(&set.1, &self.weights),
        );
        match c.pass {
            Pass::Iteration => {
                // The state starts from f⁰ on the first call's set and steps on from there:
                // the potentials do not depend on which copy of the points a call reads.
                if self.iterations.is_none() {
                    self.iterations = Some(SinkhornIterations::new(
                        Device::Cpu,
                        x,
                        y,
                        c.dim,
                        c.epsilon,
                    )?);
                }
                let it = self.iterations.as_mut().expect("set above");
                it.step()?;
                self.out.copy_from_slice(it.potentials().0);
            }
            Pass::Solve => {
                let p = SolveParams {
                    tol: SOLVE_TOL,
                    scaling: SCALING,
                    ..SolveParams::new(c.epsilon)
                };
                let t = sinkhorn_on(Device::Cpu, x, y, c.dim, &p)?;
                self.out.copy_from_slice(&t.row_marginal);
                *self.last.borrow_mut() = Some(t);
            }
        }
        Ok(())
    }
    fn value(&self, i: usize) -> f64 {
        self.out[i]
    }
    fn output_len(&self) -> usize {
        self.out.len()
    }
    fn temporary_bytes(&self) -> u64 {
        // What the solver allocates, counted from its buffers (N points per cloud, dim d):
        // the two clouds' normalised weights and log-weights and centred copies (2·(16 + 4d)
        // bytes a point), each soft-min's copies of both clouds, log-weights, h and sums
        // (2·(8d + 16)), the potentials f, g and the next f (24); a solve adds the final
        // evaluation's row and column passes (at most 6 float64 vectors, 48) and one float64
        // cost row per rayon thread (8·N each).
        let (n, d) = (self.case.n as u64, self.case.dim as u64);
        let per_point = 2 * (16 + 4 * d) + 2 * (8 * d + 16) + 24;
        let solve = match self.case.pass {
            Pass::Iteration => 0,
            Pass::Solve => 48 * n + 8 * n * rayon::current_num_threads() as u64,
        };
        per_point * n + solve
    }
}

/// The case process of a Sinkhorn case on the CPU (`cpu_tiled` kernel sums underneath).
pub fn measure_cpu(job: &Job, c: SinkhornCase) -> Reply {
    let weights = vec![1.0 / c.n as f64; c.n];
    let last = Rc::new(RefCell::new(None));
    let mut reply = host::measure(job, || {
        Ok(Launch {
            case: c,
            weights: weights.clone(),
            iterations: None,
            out: vec![0.0; c.n],
            last: Rc::clone(&last),
        })
    });
    finish_solve(job, c, &last, &mut reply);
    reply
}

/// What the GPU case process runs: the iteration held on the device (graph-captured), or a
/// whole solve whose kernel sums run on the device ([`sinkhorn_on`] with [`Device::Cuda`]).
enum GpuWork {
    Iteration(Box<DeviceSinkhorn>),
    Solve {
        x: Vec<f32>,
        y: Vec<f32>,
        /// The last solve's result, read after the measurement for the row's notes.
        last: Rc<RefCell<Option<Transport>>>,
    },
}

/// The `online` implementation's calls on a CUDA device.
struct GpuLaunch {
    case: SinkhornCase,
    weights: Vec<f64>,
    work: GpuWork,
}

impl own::Launcher for GpuLaunch {
    /// The points stay where the launcher put them (centred, in its own buffers): the input
    /// sets carry nothing.
    type Set = ();
    fn upload(&self, _gpu: &Gpu, _host: &[Vec<u16>]) -> Result<(), GpuError> {
        Ok(())
    }
    fn replicate(&self, _gpu: &Gpu, _set: &()) -> Result<(), GpuError> {
        Ok(())
    }
    fn launch(
        &mut self,
        gpu: &Gpu,
        _set: &(),
        outs: &mut [CudaSlice<u16>],
    ) -> Result<(), GpuError> {
        let out = &mut outs[0];
        match &mut self.work {
            GpuWork::Iteration(it) => it.step(gpu, Some(out)),
            GpuWork::Solve { x, y, last } => {
                let p = SolveParams {
                    tol: SOLVE_TOL,
                    scaling: SCALING,
                    ..SolveParams::new(self.case.epsilon)
                };
                let (x, y) = (Cloud::new(x, &self.weights), Cloud::new(y, &self.weights));
                let t = sinkhorn_on(Device::Cuda(gpu), x, y, self.case.dim, &p)
                    .map_err(|e| GpuError::Config(format!("sinkhorn_on: {e}")))?;
                let words: Vec<u16> = t
                    .row_marginal
                    .iter()
                    .flat_map(|v| {
                        let b = v.to_bits();
                        (0..4).map(move |k| (b >> (16 * k)) as u16)
                    })
                    .collect();
                gpu.stream.memcpy_htod(&words, out)?;
                *last.borrow_mut() = Some(t);
                Ok(())
            }
        }
    }
    fn temporary_bytes(&self) -> u64 {
        match &self.work {
            GpuWork::Iteration(it) => it.device_bytes(),
            // Two log-sum-exp sessions: both clouds twice, weights and sums per point, and
            // each split log-sum-exp's partials (2 floats per row and split); and the largest
            // float64 row pass (`cuda::sinkhorn_row_pass`, one at a time): both clouds' float32
            // points, β and the column weights (8 bytes a point each) and 3 doubles a row.
            GpuWork::Solve { .. } => {
                let (n, d) = (self.case.n as u64, self.case.dim as u64);
                let kc = KernelSumCase::new(Op::KernelLse, self.case.n, self.case.n, self.case.dim);
                let splits =
                    kernelpages::kernel_sums::cuda::entry_point(&kc).map_or(1, |p| p.splits as u64);
                2 * (2 * 4 * d * n + 8 * n + 8 * splits * n) + (2 * 4 * d * n + 16 * n + 24 * n)
            }
        }
    }
    fn residual_bytes(&self) -> Option<u64> {
        None
    }
    fn workspace_bytes(&self) -> u64 {
        0
    }
    fn capturable(&self) -> bool {
        matches!(self.work, GpuWork::Iteration(_))
    }
}

/// The case process of a Sinkhorn case on a CUDA device (`online`): an iteration held on the
/// device ([`device_iterations`]: four or six launches a step, timed from a CUDA graph), or a solve
/// ([`sinkhorn_on`] on the device: its kernel sums and its float64 passes over the pairs there,
/// the potentials and the float32 convergence estimate on the host, timed eagerly).
pub fn measure_gpu(job: &Job, c: SinkhornCase) -> Reply {
    let weights = vec![1.0 / c.n as f64; c.n];
    let last = Rc::new(RefCell::new(None));
    let points = (|| -> Result<(Vec<f32>, Vec<f32>)> {
        anyhow::ensure!(job.files.inputs.len() == 2, "sinkhorn takes x and y");
        Ok((
            read_elements(&job.files.inputs[0].path)?,
            read_elements(&job.files.inputs[1].path)?,
        ))
    })();
    let (x, y) = match points {
        Ok(p) => p,
        Err(e) => return Reply::failed(job, RowStatus::Error, format!("{e:#}")),
    };
    let mut reply = own::measure(job, |gpu| {
        let (work, compile_s) = match c.pass {
            Pass::Iteration => {
                let it = device_iterations(
                    gpu,
                    Cloud::new(&x, &weights),
                    Cloud::new(&y, &weights),
                    c.dim,
                    c.epsilon,
                )
                .map_err(|e| match e {
                    SinkhornError::Device(m) => GpuError::Config(m),
                    other => GpuError::Config(other.to_string()),
                })?;
                let s = it.compile_s;
                (GpuWork::Iteration(Box::new(it)), s)
            }
            Pass::Solve => {
                // The solve's log-sum-exp entry point, compiled here so that compile_s is its
                // (the solve's sessions then find it in the process's module cache).
                let kc = KernelSumCase::new(Op::KernelLse, c.n, c.n, c.dim);
                let compile_s = kernelpages::kernel_sums::cuda::Runner::new(gpu, &kc)?.compile_s;
                (
                    GpuWork::Solve {
                        x: x.clone(),
                        y: y.clone(),
                        last: Rc::clone(&last),
                    },
                    compile_s,
                )
            }
        };
        Ok((
            GpuLaunch {
                case: c,
                weights: weights.clone(),
                work,
            },
            compile_s,
        ))
    });
    finish_solve(job, c, &last, &mut reply);
    reply
}

/// A solve's row after the measurement: an `error` when it did not converge, else its count
/// of evaluations and the notes on how it went.
fn finish_solve(job: &Job, c: SinkhornCase, last: &RefCell<Option<Transport>>, reply: &mut Reply) {
    let last = last.borrow();
    let Some(t) = last.as_ref() else {
        return;
    };
    if t.status != Status::Converged {
        let why = format!(
            "not converged: {} iterations left an L1 row-marginal error of {:.2e} above the tolerance {SOLVE_TOL:e}",
            t.iterations, t.marginal_error
        );
        *reply = Reply::failed(job, RowStatus::Error, why);
        return;
    }
    if reply.row.status == RowStatus::Ok {
        // A solve's count is known once it has run: its float32 log-sum-exps, N² pairs
        // each (the first f, then two per iteration). The float64 confirmation and
        // evaluation passes are in the time but not in the count.
        reply.row.items = Some((1.0 + 2.0 * t.iterations as f64) * (c.n as f64).powi(2));
        reply.row.notes.push(solve_note(t));
        reply.row.notes.push("evaluations counted: the solve's float32 kernel log-sum-exps ((1 + 2 × iterations) × N² pairs); its float64 passes are timed but not counted".into());
    }
}

/// How a solve went: status, iterations, the marginal error and the transport cost.
fn solve_note(t: &Transport) -> String {
    format!(
        "{} in {} iterations (ε-scaling by {SCALING} from the squared diameter), L1 row-marginal error {:.2e} (tolerance {SOLVE_TOL:e}), transport cost <P, C> {:.6e} (of the plan rounded onto the marginals: {:.6e})",
        if t.status == Status::Converged {
            "converged"
        } else {
            "NOT converged"
        },
        t.iterations,
        t.marginal_error,
        t.plan_cost,
        t.transport_cost
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use kernelpages::harness::default_timing;
    use kernelpages::runner::DeviceChoice;
    use kernelpages::schema::TimingConfig;

    fn job(c: &SinkhornCase, dir: &Path) -> Job {
        Job {
            case: c.params(),
            implementation: "cpu_tiled".into(),
            device: DeviceChoice::Cpu,
            timing: TimingConfig {
                warmup_ms: 1.0,
                repeats: 3,
                min_sample_ms: 0.5,
                ..default_timing()
            },
            l2_bytes: 1 << 20,
            files: write_case(c, 7, 16, dir).unwrap(),
        }
    }

    /// Both passes end to end in the CPU case process: the files, the check against float64
    /// (one iteration) or the weights (a solve), and the solve's note.
    #[test]
    fn both_passes_run_and_pass_their_checks() {
        for pass in [Pass::Iteration, Pass::Solve] {
            let dir = tempfile::tempdir().unwrap();
            let c = SinkhornCase {
                n: 150,
                dim: 3,
                pass,
                epsilon: 1e-2,
            };
            assert_eq!(SinkhornCase::from_params(&c.params()).unwrap(), Some(c));
            let j = job(&c, dir.path());
            // An iteration checks the sampled rows; a solve every row.
            let checked = if pass == Pass::Iteration { 16 } else { 150 };
            assert_eq!(j.files.check.ranges.len(), checked);
            assert_eq!(
                j.files.items,
                (pass == Pass::Iteration).then_some(2.0 * 150.0 * 150.0)
            );
            let row = measure_cpu(&j, c).row;
            assert_eq!(row.status, RowStatus::Ok, "{pass:?}: {row:?}");
            // Every ok row carries its count (the document's throughput needs it).
            assert!(row.items.unwrap() >= 2.0 * 150.0 * 150.0, "{row:?}");
            let converged = row.notes.iter().any(|n| n.starts_with("converged in "));
            assert_eq!(converged, pass == Pass::Solve, "{:?}", row.notes);
            let acc = row.accuracy.unwrap();
            assert!(acc.rel_err <= acc.tolerance, "{pass:?}: {acc:?}");
        }
        let own = ["cpu_tiled", "online"];
        let not_ours = unsupported("torch_dense", &own).unwrap();
        assert!(not_ours.contains("--compare ott"));
        assert!(unsupported("ott_dense", &own).is_none());
        assert!(unsupported("online", &own).is_none());
    }

    /// The row the comparison module behind server `s` gives `implementation` on the 150-point
    /// 3-D Sinkhorn case of `pass` (ε = 1e-2), written by the runner's own `write_case`.
    fn module_row(
        s: &mut kernelpages::runner::process::Server,
        pass: Pass,
        implementation: &str,
    ) -> kernelpages::schema::Row {
        let dir = tempfile::tempdir().unwrap();
        let c = SinkhornCase {
            n: 150,
            dim: 3,
            pass,
            epsilon: 1e-2,
        };
        let mut j = job(&c, dir.path());
        j.implementation = implementation.into();
        s.request(&j, std::time::Duration::from_secs(300))
            .unwrap()
            .row
    }

    /// The comparison module `module` started as the runner starts it.
    fn server(module: &str) -> kernelpages::runner::process::Server {
        let runners = kernelpages::runner::locate_runners_dir().expect("runners/compare/");
        kernelpages::runner::process::Server::start("python3", &runners, module, &[]).unwrap()
    }

    /// An ok row checked within its tolerance, counting at least one iteration's evaluations.
    fn assert_checked(row: &kernelpages::schema::Row, pass: Pass) {
        assert_eq!(row.status, RowStatus::Ok, "{pass:?}: {row:?}");
        let acc = row.accuracy.clone().unwrap();
        assert!(acc.rel_err <= acc.tolerance, "{pass:?}: {acc:?}");
        assert!(row.items.unwrap() >= 2.0 * 150.0 * 150.0, "{row:?}");
        let per_iteration = row
            .notes
            .iter()
            .any(|n| n.contains("times are per iteration"));
        assert_eq!(per_iteration, pass == Pass::Iteration, "{:?}", row.notes);
    }

    /// geomloss's module on the CPU (`runners/compare/geomloss_sinkhorn.py`) on the runner's
    /// own files: the tensorized soft-min's iteration checked against the same float64
    /// reference as `cpu_tiled`'s, times per iteration; its solve is `unsupported` with the
    /// reason; `geomloss_online` is a row whatever happens (without pykeops: `unsupported`,
    /// saying so).
    #[test]
    #[cfg_attr(
        not(kp_geomloss),
        ignore = "needs geomloss (and torch) importable by python3 (the CPU build is enough)"
    )]
    fn geomloss_module_measures_the_iteration_on_the_cpu() {
        let mut s = server("geomloss_sinkhorn");
        let row = module_row(&mut s, Pass::Iteration, "geomloss_tensorized");
        assert_checked(&row, Pass::Iteration);
        assert_eq!(row.items, Some(2.0 * 150.0 * 150.0), "{row:?}");
        let solve = module_row(&mut s, Pass::Solve, "geomloss_tensorized");
        assert_eq!(solve.status, RowStatus::Unsupported, "{solve:?}");
        assert!(
            solve.message.as_deref().unwrap().contains("no tolerance"),
            "{solve:?}"
        );
        let online = module_row(&mut s, Pass::Iteration, "geomloss_online");
        assert!(
            online.status == RowStatus::Ok || online.message.is_some(),
            "{online:?}"
        );
    }

    /// ott-jax's module on the CPU (`runners/compare/ott_sinkhorn.py`) on the runner's own
    /// files: one iteration checked against the same float64 reference as `cpu_tiled`'s, a
    /// solve's row marginal against the weights, times per iteration; `ott_online` is a row
    /// whatever happens (an `error` with ott's message under JAX 0.10 and 0.11).
    #[test]
    #[cfg_attr(
        not(kp_ott),
        ignore = "needs ott-jax (and jax) importable by python3 (the CPU build is enough)"
    )]
    fn ott_module_measures_both_passes_on_the_cpu() {
        let mut s = server("ott_sinkhorn");
        for pass in [Pass::Iteration, Pass::Solve] {
            let row = module_row(&mut s, pass, "ott_dense");
            assert_checked(&row, pass);
            if pass == Pass::Solve {
                assert!(
                    row.notes.iter().any(|n| n.starts_with("converged in ")),
                    "{:?}",
                    row.notes
                );
            }
            let online = module_row(&mut s, pass, "ott_online");
            assert!(
                online.status == RowStatus::Ok || online.message.is_some(),
                "{online:?}"
            );
        }
    }
}
