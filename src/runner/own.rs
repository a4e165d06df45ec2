//! Measuring one of the project's implementations inside its case process: compile, the first
//! call on the runner's input bits with every output poisoned (the output, and the gradients of
//! a forward + backward job), peak memory from the memory pool, the check over every whole
//! output, then the timing protocol over rotated input copies.
//!
//! A suite supplies a [`Launcher`] (its CUDA launch code); everything else is shared.

use std::collections::BTreeMap;

use cudarc::driver::CudaSlice;

use super::protocol::{
    check_output_par, decode, dtype_bytes, read_f64, read_u16, unix_now, Check, Job, Reply,
};
use crate::gpu::{Gpu, GpuError};
use crate::harness::{self, MeasureError, Sample, SampleTimer};
use crate::schema::{Accuracy, Memory, Row, Status, TimingMethod};

/// How [`measure`] reads `peak_mb` for the project's implementations.
pub const PEAK_METHOD: &str = "memory pool high-water mark (CU_MEMPOOL_ATTR_USED_MEM_HIGH, reset before the case's first allocation, read after its first call) in a fresh process running only this case; library workspaces apart";

/// A suite's compiled implementation for one case.
pub trait Launcher {
    /// One input set on the device.
    type Set;
    /// Uploads the input tensors (their bytes as 16-bit words, in the job's input order).
    fn upload(&self, gpu: &Gpu, host: &[Vec<u16>]) -> Result<Self::Set, GpuError>;
    /// A device copy of `set` (distinct buffers, same values) for the L2 rotation.
    fn replicate(&self, gpu: &Gpu, set: &Self::Set) -> Result<Self::Set, GpuError>;
    /// Launches one call on the stream, writing `outs`: the output, then the job's gradients,
    /// in [`super::protocol::CaseFiles::outputs`] order (words of their dtypes).
    fn launch(
        &mut self,
        gpu: &Gpu,
        set: &Self::Set,
        outs: &mut [CudaSlice<u16>],
    ) -> Result<(), GpuError>;
    /// Bytes of temporaries one call uses beyond inputs and outputs.
    fn temporary_bytes(&self) -> u64;
    /// Bytes the forward keeps for the backward (forward + backward jobs).
    fn residual_bytes(&self) -> Option<u64>;
    /// Bytes of library workspace allocated once and held across calls (cuBLAS).
    fn workspace_bytes(&self) -> u64;
    /// Whether a call can be captured in a CUDA graph: false for a call that waits on the
    /// host between its launches (a solver that tests convergence), which is then timed
    /// eagerly between events. True by default.
    fn capturable(&self) -> bool {
        true
    }
}

/// Replays a captured graph of the case's calls between two events.
struct ReplayTimer<'a> {
    gpu: &'a Gpu,
    graph: cudarc::driver::CudaGraph,
}

impl SampleTimer for ReplayTimer<'_> {
    type Error = GpuError;
    fn time_calls(&mut self, _inner: u32) -> Result<Sample, GpuError> {
        self.gpu.time_replay(&self.graph)
    }
}

struct Timer<'a, L: Launcher> {
    gpu: &'a Gpu,
    launcher: &'a mut L,
    sets: &'a [L::Set],
    outs: &'a mut [CudaSlice<u16>],
    next: usize,
}

impl<L: Launcher> SampleTimer for Timer<'_, L> {
    type Error = GpuError;
    fn time_calls(&mut self, inner: u32) -> Result<Sample, GpuError> {
        let (gpu, sets) = (self.gpu, self.sets);
        let launcher = &mut *self.launcher;
        let outs = &mut *self.outs;
        let next = &mut self.next;
        gpu.time_calls(inner, |_| {
            let s = &sets[*next % sets.len()];
            *next += 1;
            launcher.launch(gpu, s, outs)
        })
    }
}

fn mb(bytes: u64) -> f64 {
    bytes as f64 / 1e6
}

/// The largest of the errors, NaN when any is NaN (`f64::max` would drop a NaN).
pub fn worst(errors: impl IntoIterator<Item = f64>) -> f64 {
    let mut w = f64::NEG_INFINITY;
    for e in errors {
        if e.is_nan() {
            return f64::NAN;
        }
        w = if e > w { e } else { w };
    }
    w
}

/// `accuracy.checked` of a row: the suite's description, and with several outputs each one's
/// error and which is the largest (the row's `rel_err`).
pub fn checked_text(described: &str, errors: &[(&str, f64)]) -> String {
    if errors.len() < 2 {
        return described.to_string();
    }
    let each: Vec<String> = errors.iter().map(|(n, e)| format!("{n} {e:.2e}")).collect();
    let mut largest: Option<(&str, f64)> = None;
    for &(n, e) in errors {
        let take = match largest {
            None => true,
            Some((_, best)) => !best.is_nan() && (e.is_nan() || e > best),
        };
        if take {
            largest = Some((n, e));
        }
    }
    let largest = largest.map_or("", |x| x.0);
    format!("{described}; rel_l2 {}; largest {largest}", each.join(", "))
}

/// Measures `job` with the launcher `make` builds (it compiles and allocates its temporaries
/// and workspaces, and returns the compile + load time in s). Outputs are decoded by their
/// dtype names ([`decode`]). Every failure becomes the reply's row.
pub fn measure<L: Launcher>(
    job: &Job,
    make: impl FnOnce(&Gpu) -> Result<(L, f64), GpuError>,
) -> Reply {
    let fail = |status: Status, msg: String| Reply::failed(job, status, msg);
    match measure_inner(job, make) {
        Ok(r) => r,
        Err(Failure::Gpu(e)) => fail(
            if e.is_oom() {
                Status::Oom
            } else if matches!(e, GpuError::Unsupported(_)) {
                Status::Unsupported
            } else {
                Status::Error
            },
            e.to_string(),
        ),
        Err(Failure::Other(m)) => fail(Status::Error, m),
    }
}

enum Failure {
    Gpu(GpuError),
    Other(String),
}

impl From<GpuError> for Failure {
    fn from(e: GpuError) -> Self {
        Failure::Gpu(e)
    }
}

impl From<cudarc::driver::DriverError> for Failure {
    fn from(e: cudarc::driver::DriverError) -> Self {
        Failure::Gpu(e.into())
    }
}

fn measure_inner<L: Launcher>(
    job: &Job,
    make: impl FnOnce(&Gpu) -> Result<(L, f64), GpuError>,
) -> Result<Reply, Failure> {
    let other = |e: anyhow::Error| Failure::Other(format!("{e:#}"));
    let gpu = Gpu::open(0)?;
    let host: Vec<Vec<u16>> = job
        .files
        .inputs
        .iter()
        .map(|t| read_u16(&t.path))
        .collect::<anyhow::Result<_>>()
        .map_err(other)?;
    let specs = job.files.outputs();
    let references: Vec<Vec<f64>> = specs
        .iter()
        .map(|(_, _, check)| read_f64(&check.reference))
        .collect::<anyhow::Result<_>>()
        .map_err(other)?;
    // Output sizes in elements and in 16-bit words.
    let elems: Vec<usize> = specs
        .iter()
        .map(|(_, o, _)| o.shape.iter().product())
        .collect();
    let words: Vec<usize> = specs
        .iter()
        .zip(&elems)
        .map(|((_, o, _), n)| n * dtype_bytes(&o.dtype) as usize / 2)
        .collect();

    // Peak memory: the pool's high-water mark over compile (temporaries, workspaces), one
    // input set, the poisoned outputs and the first call.
    let base = gpu.pool_reset_peaks()?;
    let (mut launcher, compile_s) = make(&gpu)?;
    let set0 = launcher.upload(&gpu, &host)?;
    // Poison every output (0xFFFF words are NaN in bf16, fp16 and fp32) so an unwritten
    // element fails.
    let mut outs = words
        .iter()
        .map(|&n| gpu.poisoned_u16(n))
        .collect::<Result<Vec<_>, _>>()?;
    launcher.launch(&gpu, &set0, &mut outs)?;
    gpu.stream.synchronize()?;
    gpu.ctx.check_err()?;
    let (used, reserved) = gpu.pool_peaks(base)?;
    let workspace = launcher.workspace_bytes();

    // Accuracy on the first call's outputs: every element of each finite, then the relative
    // error of each over its checked elements; the row keeps the largest (NaN-propagating).
    let mut errors = Vec::with_capacity(specs.len());
    for (((name, spec, check), reference), out) in specs.iter().zip(&references).zip(&outs) {
        let got = gpu.stream.clone_dtoh(out)?;
        let value = |i: usize| decode(&spec.dtype, &got, i);
        match check_output_par(got.len() * 2 / dtype_bytes(&spec.dtype) as usize, value, &check.ranges, reference) {
            Check::NonFinite { index, len } => {
                return Ok(Reply {
                    row: Row::failed(
                        job.case.clone(),
                        &job.implementation,
                        "",
                        false,
                        Status::Error,
                        format!(
                            "non-finite output at element {index} of {len} of {name} (unwritten or overflowed) in the first call"
                        ),
                    ),
                    window: None,
                    libraries: BTreeMap::new(),
                    pid: None,
                })
            }
            Check::Error(e) => errors.push((*name, e)),
        }
    }
    let rel_err = worst(errors.iter().map(|e| e.1));
    drop(host);

    // Timing over enough input copies to exceed the L2 `l2_rotation_factor` times.
    let set_bytes = job.files.input_bytes();
    let (n_sets, reached) = super::rotation(set_bytes, job.l2_bytes, &job.timing);
    let mut sets = vec![set0];
    for _ in 1..n_sets {
        sets.push(launcher.replicate(&gpu, &sets[0])?);
    }
    gpu.stream.synchronize()?;
    let t0 = unix_now();
    // The case's time limit counts from here, for the eager timing and the replay alike (as
    // the comparison scripts count it).
    let timing_start = std::time::Instant::now();
    let mut timer = Timer {
        gpu: &gpu,
        launcher: &mut launcher,
        sets: &sets,
        outs: &mut outs,
        next: 0,
    };
    let m = harness::measure(&mut timer, &job.timing);
    let window = Some([t0, unix_now()]);
    let m = match m {
        Ok(m) => m,
        Err(MeasureError::Timer(e)) => return Err(e.into()),
        Err(MeasureError::Timeout { elapsed_s }) => {
            return Ok(Reply {
                row: Row::failed(
                    job.case.clone(),
                    &job.implementation,
                    "",
                    false,
                    Status::Timeout,
                    format!(
                        "timing passed the {:.0} s limit after {elapsed_s:.1} s with fewer than {} samples",
                        job.timing.case_timeout_s,
                        harness::MIN_SAMPLES
                    ),
                ),
                window,
                libraries: BTreeMap::new(),
                pid: None,
            })
        }
        Err(MeasureError::BadTime(t)) => {
            return Err(Failure::Other(format!("event timer returned {t} ms")))
        }
    };

    // Then, as for the alternatives, a CUDA graph of the same calls (a whole number of passes
    // over the input sets), replayed with the same sample count: the reported time, with the
    // eager back-to-back median beside it. Where capture fails, the eager time is reported.
    let eager = m;
    let calls = harness::graph_calls(eager.inner, n_sets);
    let mut next = 0usize;
    let mut notes = Vec::new();
    if !launcher.capturable() {
        notes.push("a call waits on the host between its launches, so it is timed eagerly between events, not replayed from a CUDA graph".to_string());
    }
    let captured = if !launcher.capturable() {
        Ok(None)
    } else {
        gpu.capture(|| {
            for _ in 0..calls {
                let s = &sets[next % sets.len()];
                next += 1;
                launcher.launch(&gpu, s, &mut outs)?;
            }
            Ok(())
        })
    };
    let graph = match captured {
        Ok(Some(graph)) => {
            let mut timer = ReplayTimer { gpu: &gpu, graph };
            match harness::measure_replay(&mut timer, &job.timing, calls, timing_start) {
                Ok(g) => Some(g),
                Err(MeasureError::Timer(e)) => return Err(e.into()),
                Err(MeasureError::Timeout { .. }) => {
                    notes.push("graph replay passed the case limit: timed eagerly".to_string());
                    None
                }
                Err(MeasureError::BadTime(t)) => {
                    return Err(Failure::Other(format!(
                        "graph replay timer returned {t} ms"
                    )))
                }
            }
        }
        Ok(None) if !launcher.capturable() => None,
        Ok(None) => {
            notes.push("CUDA graph capture recorded nothing: timed eagerly".to_string());
            None
        }
        Err(e) => {
            notes.push(format!("CUDA graph capture failed, timed eagerly: {e}"));
            None
        }
    };
    let window = Some([t0, unix_now()]);
    let (m, method) = match &graph {
        Some(g) => (g.clone(), TimingMethod::GraphReplay),
        None => (eager.clone(), TimingMethod::Events),
    };

    let mut row = Row::failed(
        job.case.clone(),
        &job.implementation,
        "",
        false,
        Status::Ok,
        "",
    );
    row.message = None;
    row.notes = notes;
    row.median_ms = Some(m.stats.median_ms);
    row.q1_ms = Some(m.stats.q1_ms);
    row.q3_ms = Some(m.stats.q3_ms);
    row.inner_calls = Some(m.inner);
    row.samples = Some(m.stats.samples);
    row.input_sets = Some(n_sets);
    row.l2_rotation_reached = Some(reached);
    row.compile_s = Some(compile_s);
    row.timing = Some(method);
    // The host time to issue one eager call, for every row.
    row.host_ms = Some(eager.host_ms);
    if graph.is_some() {
        row.eager_median_ms = Some(eager.stats.median_ms);
    }
    row.flops = job.files.flops;
    row.bytes = job.files.bytes;
    row.items = job.files.items;
    if m.cut_short || eager.cut_short {
        row.notes.push(format!(
            "{} of {} samples: the {} s case limit stopped sampling",
            m.stats.samples, job.timing.repeats, job.timing.case_timeout_s
        ));
    }
    let out_bytes = words.iter().sum::<usize>() as u64 * 2;
    // Temporaries as the comparison scripts measure theirs: the peak beyond the library
    // workspace, the arguments and the output (the launcher's own count where there is no pool).
    let temporaries = if gpu.has_pool() {
        used.saturating_sub(workspace + set_bytes + out_bytes)
    } else {
        launcher.temporary_bytes()
    };
    row.memory = Some(Memory {
        arguments_mb: Some(mb(set_bytes)),
        outputs_mb: Some(mb(out_bytes)),
        temporaries_mb: Some(mb(temporaries)),
        residuals_mb: launcher.residual_bytes().map(mb),
        peak_mb: gpu.has_pool().then(|| mb(used.saturating_sub(workspace))),
        peak_method: Some(PEAK_METHOD.into()),
        reserved_peak_mb: gpu
            .has_pool()
            .then(|| mb(reserved.saturating_sub(workspace))),
        workspace_mb: (workspace > 0).then(|| mb(workspace)),
    });
    row.accuracy = Some(Accuracy {
        rel_err,
        metric: "rel_l2".into(),
        reference: job.files.check.reference_kind,
        tolerance: job.files.check.tolerance,
        checked: Some(checked_text(&job.files.check.checked, &errors)),
    });
    if !rel_err.is_finite() {
        row.status = Status::Error;
        row.message = Some(format!("relative error is {rel_err} against the reference"));
    }
    Ok(Reply {
        row,
        window,
        libraries: BTreeMap::new(),
        pid: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_worst_error_keeps_a_nan() {
        assert!(worst([1e-3, f64::NAN, 2e-3]).is_nan());
        assert_eq!(worst([1e-3, 4e-3]), 4e-3);
        let t = checked_text("x", &[("O", 1e-3), ("dQ", 4e-3), ("dK", 2e-3)]);
        assert_eq!(t, "x; rel_l2 O 1.00e-3, dQ 4.00e-3, dK 2.00e-3; largest dQ");
        assert_eq!(checked_text("x", &[("O", 1e-3)]), "x");
    }
}
