//! Measuring one of the project's CPU implementations inside its case process (`--device
//! cpu`): the inputs read from the runner's files, the first call timed by wall clock with the
//! output poisoned, the peak resident memory, the check over the whole output, then the timing
//! protocol of [`crate::harness`] with wall time as the sample time.
//!
//! On the CPU there is no device clock apart from the host's: a sample's time is the wall time
//! of `inner` back-to-back calls ([`std::time::Instant`]), and a row has no `host_ms` (the
//! host's time to issue a call is the call itself, so launch-boundness does not apply).
//!
//! A suite supplies a [`Launcher`] (its CPU code); everything else is shared.

use std::collections::BTreeMap;
use std::time::Instant;

use super::protocol::{
    check_output, dtype_bytes, read_f64, unix_now, Check, Job, Reply, TensorFile,
};
use crate::harness::{self, MeasureError, Sample, SampleTimer};
use crate::schema::{Accuracy, Memory, Row, Status};

/// How [`measure`] reads `peak_mb`.
pub const PEAK_METHOD: &str = "resident set high-water mark (VmHWM, reset through /proc/self/clear_refs before the inputs are read, read after the first call) minus the resident set at the reset, in a fresh process running only this case";

/// The note every row measured here carries.
pub const TIMING_NOTE: &str = "CPU: each sample is the wall time of back-to-back calls (no device clock apart from the host's; host_ms does not apply)";

/// A suite's CPU implementation for one case.
pub trait Launcher {
    /// One input set in memory.
    type Set;
    /// Reads the input tensors (the job's raw files, in argument order).
    ///
    /// # Errors
    /// Unreadable files or a dtype the implementation does not take.
    fn load(&self, inputs: &[TensorFile]) -> anyhow::Result<Self::Set>;
    /// A copy of `set` (distinct buffers, same values) for the cache rotation.
    fn replicate(&self, set: &Self::Set) -> Self::Set;
    /// Fills the output with NaN, so that an element a call does not write fails the check.
    fn poison(&mut self);
    /// One call on `set`, writing the output.
    ///
    /// # Errors
    /// What the implementation refuses (its message becomes the row's).
    fn call(&mut self, set: &Self::Set) -> anyhow::Result<()>;
    /// Output element `i` (flat, row-major) as float64.
    fn value(&self, i: usize) -> f64;
    /// Elements in the output.
    fn output_len(&self) -> usize;
    /// Element `i` of gradient `k` (the job's `gradients[k]`, in order), as float64. The
    /// default has no gradients: a forward + backward job then fails with a clear error.
    fn gradient_value(&self, k: usize, i: usize) -> f64 {
        let _ = (k, i);
        f64::NAN
    }
    /// Elements in gradient `k`; 0 (the default) when the implementation writes none.
    fn gradient_len(&self, k: usize) -> usize {
        let _ = k;
        0
    }
    /// Bytes of temporaries one call allocates beyond inputs and output.
    fn temporary_bytes(&self) -> u64;
}

struct Timer<'a, L: Launcher> {
    launcher: &'a mut L,
    sets: &'a [L::Set],
    next: usize,
}

impl<L: Launcher> SampleTimer for Timer<'_, L> {
    type Error = anyhow::Error;
    fn time_calls(&mut self, inner: u32) -> anyhow::Result<Sample> {
        let t0 = Instant::now();
        for _ in 0..inner {
            let s = &self.sets[self.next % self.sets.len()];
            self.next += 1;
            self.launcher.call(s)?;
        }
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        Ok(Sample {
            device_ms: ms,
            host_ms: ms,
        })
    }
}

/// Resident set size and its high-water mark, bytes (`/proc/self/status`).
fn rss() -> Option<(u64, u64)> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb = |key: &str| -> Option<u64> {
        s.lines()
            .find_map(|l| l.strip_prefix(key))?
            .split_whitespace()
            .next()?
            .parse::<u64>()
            .ok()
            .map(|k| k * 1024)
    };
    Some((kb("VmRSS:")?, kb("VmHWM:")?))
}

/// Resets the resident-set high-water mark to the current resident set (Linux ≥ 4.0) and
/// returns the resident set then; `None` where that cannot be done.
fn reset_peak_rss() -> Option<u64> {
    std::fs::write("/proc/self/clear_refs", "5").ok()?;
    rss().map(|(now, _)| now)
}

/// The 1-minute load average (`/proc/loadavg`).
pub fn load_average() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

fn mb(bytes: u64) -> f64 {
    bytes as f64 / 1e6
}

/// Measures `job` with the launcher `make` builds. Every failure becomes the reply's row.
pub fn measure<L: Launcher>(job: &Job, make: impl FnOnce() -> anyhow::Result<L>) -> Reply {
    let reply = |row: Row, window: Option<[f64; 2]>| Reply {
        row,
        window,
        libraries: BTreeMap::new(),
        pid: None,
    };
    let failed = |status: Status, msg: String| {
        Row::failed(
            job.case.clone(),
            &job.implementation,
            "",
            false,
            status,
            msg,
        )
    };
    match measure_inner(job, make) {
        Ok(r) => r,
        Err(e) => reply(failed(Status::Error, format!("{e:#}")), None),
    }
}

fn measure_inner<L: Launcher>(
    job: &Job,
    make: impl FnOnce() -> anyhow::Result<L>,
) -> anyhow::Result<Reply> {
    let failed = |status: Status, msg: String| {
        Row::failed(
            job.case.clone(),
            &job.implementation,
            "",
            false,
            status,
            msg,
        )
    };
    let references: Vec<Vec<f64>> = job
        .files
        .outputs()
        .iter()
        .map(|(_, _, check)| read_f64(&check.reference))
        .collect::<anyhow::Result<_>>()?;
    let load_before = load_average();

    // Peak memory: the resident set's high-water mark over the input set, the output and the
    // first call, from a reset just before them.
    let base = reset_peak_rss();
    let mut launcher = make()?;
    let set0 = launcher.load(&job.files.inputs)?;
    launcher.poison();
    let t0 = Instant::now();
    if let Err(e) = launcher.call(&set0) {
        return Ok(Reply {
            row: failed(Status::Unsupported, format!("{e:#}")),
            window: None,
            libraries: BTreeMap::new(),
            pid: None,
        });
    }
    let first_call_s = t0.elapsed().as_secs_f64();
    let peak = base.and_then(|b| rss().map(|(_, hwm)| hwm.saturating_sub(b)));

    // Accuracy on the first call's output and gradients: every element of each finite, then
    // the relative error of each over its checked elements; the row keeps the largest
    // (NaN-propagating), as the GPU case process does.
    let mut errors = Vec::new();
    for (k, ((name, _, check), reference)) in
        job.files.outputs().into_iter().zip(&references).enumerate()
    {
        let result = if k == 0 {
            check_output(
                launcher.output_len(),
                |i| launcher.value(i),
                &check.ranges,
                reference,
            )
        } else {
            let len = launcher.gradient_len(k - 1);
            anyhow::ensure!(
                len > 0,
                "{} writes no {name}: it has no backward",
                job.implementation
            );
            check_output(
                len,
                |i| launcher.gradient_value(k - 1, i),
                &check.ranges,
                reference,
            )
        };
        match result {
            Check::NonFinite { index, len } => {
                return Ok(Reply {
                    row: failed(
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
            Check::Error(e) => errors.push((name, e)),
        }
    }
    let rel_err = super::own::worst(errors.iter().map(|e| e.1));

    // Timing over enough input copies to exceed the last-level cache `l2_rotation_factor`
    // times (the job's `l2_bytes` is the CPU's last-level cache).
    let set_bytes = job.files.input_bytes();
    let (n_sets, reached) = super::rotation(set_bytes, job.l2_bytes, &job.timing);
    let mut sets = vec![set0];
    for _ in 1..n_sets {
        sets.push(launcher.replicate(&sets[0]));
    }
    let w0 = unix_now();
    let mut timer = Timer {
        launcher: &mut launcher,
        sets: &sets,
        next: 0,
    };
    let m = harness::measure(&mut timer, &job.timing);
    let window = Some([w0, unix_now()]);
    let m = match m {
        Ok(m) => m,
        Err(MeasureError::Timer(e)) => return Err(e),
        Err(MeasureError::Timeout { elapsed_s }) => {
            return Ok(Reply {
                row: failed(
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
        Err(MeasureError::BadTime(t)) => anyhow::bail!("wall clock returned {t} ms"),
    };

    let mut row = failed(Status::Ok, String::new());
    row.message = None;
    row.median_ms = Some(m.stats.median_ms);
    row.timing = Some(crate::schema::TimingMethod::WallClock);
    row.q1_ms = Some(m.stats.q1_ms);
    row.q3_ms = Some(m.stats.q3_ms);
    row.inner_calls = Some(m.inner);
    row.samples = Some(m.stats.samples);
    row.input_sets = Some(n_sets);
    row.l2_rotation_reached = Some(reached);
    row.first_call_s = Some(first_call_s);
    row.flops = job.files.flops;
    row.bytes = job.files.bytes;
    row.items = job.files.items;
    row.notes.push(TIMING_NOTE.into());
    if let Some(note) = load_note(load_before, load_average()) {
        row.notes.push(note);
    }
    if m.cut_short {
        row.notes.push(format!(
            "{} of {} samples: the {} s case limit stopped sampling",
            m.stats.samples, job.timing.repeats, job.timing.case_timeout_s
        ));
    }
    let out_bytes = launcher.output_len() as u64 * dtype_bytes(&job.files.output.dtype)
        + job
            .files
            .gradients
            .iter()
            .enumerate()
            .map(|(k, g)| launcher.gradient_len(k) as u64 * dtype_bytes(&g.output.dtype))
            .sum::<u64>();
    row.memory = Some(Memory {
        arguments_mb: Some(mb(set_bytes)),
        outputs_mb: Some(mb(out_bytes)),
        temporaries_mb: Some(mb(launcher.temporary_bytes())),
        peak_mb: peak.map(mb),
        peak_method: peak.map(|_| PEAK_METHOD.into()),
        ..Memory::default()
    });
    row.accuracy = Some(Accuracy {
        rel_err,
        metric: "rel_l2".into(),
        reference: job.files.check.reference_kind,
        tolerance: job.files.check.tolerance,
        checked: Some(super::own::checked_text(&job.files.check.checked, &errors)),
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

/// A remark on the CPU's load around a row: the 1-minute load average before and after, and
/// the hardware threads, so that a reader can tell a row timed on a busy machine.
pub fn load_note(before: Option<f64>, after: Option<f64>) -> Option<String> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let (b, a) = (before?, after?);
    Some(format!(
        "1-minute load average {b:.1} before and {a:.1} after this row, on {threads} hardware threads{}",
        if b.max(a) > threads as f64 + 0.5 {
            ": other processes shared the CPU"
        } else {
            ""
        }
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::harness::default_timing;
    use crate::runner::protocol::{write_f64, CaseFiles, CheckSpec, OutputSpec};
    use crate::schema::Reference;

    /// Doubles its one input; `hole` leaves an element unwritten.
    struct Double {
        out: Vec<f64>,
        hole: Option<usize>,
    }

    impl Launcher for Double {
        type Set = Vec<f64>;
        fn load(&self, inputs: &[TensorFile]) -> anyhow::Result<Vec<f64>> {
            read_f64(&inputs[0].path)
        }
        fn replicate(&self, set: &Vec<f64>) -> Vec<f64> {
            set.clone()
        }
        fn poison(&mut self) {
            self.out.fill(f64::NAN);
        }
        fn call(&mut self, set: &Vec<f64>) -> anyhow::Result<()> {
            for (i, (o, x)) in self.out.iter_mut().zip(set).enumerate() {
                if Some(i) != self.hole {
                    *o = 2.0 * x;
                }
            }
            std::hint::black_box(&self.out);
            Ok(())
        }
        fn value(&self, i: usize) -> f64 {
            self.out[i]
        }
        fn output_len(&self) -> usize {
            self.out.len()
        }
        fn temporary_bytes(&self) -> u64 {
            0
        }
    }

    fn job(dir: &std::path::Path) -> Job {
        let x: Vec<f64> = (0..1000).map(|i| i as f64).collect();
        write_f64(&dir.join("x.f64"), &x).unwrap();
        write_f64(&dir.join("ref.f64"), &[20.0, 22.0]).unwrap();
        Job {
            case: Default::default(),
            implementation: "double".into(),
            device: crate::runner::DeviceChoice::Cpu,
            timing: crate::schema::TimingConfig {
                warmup_ms: 1.0,
                repeats: 5,
                min_sample_ms: 0.1,
                ..default_timing()
            },
            l2_bytes: 1 << 20,
            files: CaseFiles {
                inputs: vec![TensorFile {
                    name: "x".into(),
                    dtype: "fp64".into(),
                    shape: vec![1000],
                    path: dir.join("x.f64"),
                }],
                output: OutputSpec {
                    dtype: "fp64".into(),
                    shape: vec![1000],
                },
                check: CheckSpec {
                    ranges: vec![[10, 2]],
                    reference: dir.join("ref.f64"),
                    reference_kind: Reference::Float64Cpu,
                    tolerance: 1e-9,
                    checked: "2 of 1000".into(),
                },
                flops: Some(1000.0),
                bytes: None,
                items: None,
                arguments: Default::default(),
                gradients: Vec::new(),
            },
        }
    }

    #[test]
    fn a_cpu_row_is_timed_checked_and_has_no_host_time() {
        let dir = tempfile::tempdir().unwrap();
        let j = job(dir.path());
        let r = measure(&j, || {
            Ok(Double {
                out: vec![0.0; 1000],
                hole: None,
            })
        });
        let row = &r.row;
        assert_eq!(row.status, Status::Ok, "{row:?}");
        assert_eq!(row.accuracy.as_ref().unwrap().rel_err, 0.0);
        assert!(row.host_ms.is_none() && row.compile_s.is_none());
        assert_eq!(row.timing, Some(crate::schema::TimingMethod::WallClock));
        assert!(row.q1_ms.unwrap() <= row.median_ms.unwrap());
        assert!(row.first_call_s.unwrap() >= 0.0);
        assert!(row.notes.iter().any(|n| n == TIMING_NOTE));
        // 8 kB per set against a 1 MiB cache: rotation capped at 64 sets.
        assert_eq!(row.input_sets, Some(harness::MAX_INPUT_SETS));
        let mem = row.memory.as_ref().unwrap();
        assert_eq!(mem.outputs_mb, Some(0.008));
        if std::path::Path::new("/proc/self/clear_refs").exists() {
            assert!(mem.peak_mb.is_some());
        }
        assert!(r.window.is_some());
    }

    #[test]
    fn an_unwritten_element_fails_the_row() {
        let dir = tempfile::tempdir().unwrap();
        let r = measure(&job(dir.path()), || {
            Ok(Double {
                out: vec![0.0; 1000],
                hole: Some(999),
            })
        });
        assert_eq!(r.row.status, Status::Error);
        assert!(r
            .row
            .message
            .unwrap()
            .contains("non-finite output at element 999 of 1000"));
    }

    #[test]
    fn load_note_flags_a_busy_machine() {
        let n = std::thread::available_parallelism().unwrap().get() as f64;
        assert!(load_note(Some(n + 2.0), Some(0.1))
            .unwrap()
            .ends_with("other processes shared the CPU"));
        assert!(!load_note(Some(0.0), Some(0.0)).unwrap().contains("shared"));
        assert!(load_note(None, Some(1.0)).is_none());
    }
}
