//! The measurement protocol, independent of any device: warm-up, choice of the inner call count,
//! repeated samples, median and inter-quartile range, and the number of input sets to rotate.
//!
//! The device side implements [`SampleTimer`] (CUDA events around `inner` back-to-back calls,
//! and the host's time to issue them); tests use a fake timer, as hyperfine tests its
//! scheduler with a mock executor. `runners/compare/timing.py` implements the same protocol for
//! the alternatives measured from Python, with the same constants.

use std::time::Instant;

use crate::schema::{TimingConfig, LAUNCH_BOUND_RATIO};

/// Warm-up length, ms of calls (event time) after load and the first call.
pub const WARMUP_MS: f64 = 100.0;

/// Fewest samples a row keeps when the time limit stops sampling early (enough for quartiles).
pub const MIN_SAMPLES: usize = 3;

/// Most input sets rotated through (the rotation stops short of its factor beyond this).
pub const MAX_INPUT_SETS: u32 = 64;

/// The hard limit on one case process is `PROCESS_LIMIT_FACTOR` × `case_timeout_s` +
/// [`PROCESS_LIMIT_MARGIN_S`] (the margin covers input upload and the checks); a process still
/// running then is killed and its row is `timeout`.
pub const PROCESS_LIMIT_FACTOR: f64 = 1.5;

/// See [`PROCESS_LIMIT_FACTOR`], s.
pub const PROCESS_LIMIT_MARGIN_S: f64 = 60.0;

/// The comparison scripts rotate input copies through at most this fraction of the free device
/// memory (the frameworks keep caches of their own); `runners/compare/timing.py` holds the same.
pub const ROTATION_MEMORY_FRACTION: f64 = 0.5;

/// How often the machine state (clocks, power, temperature, processes) is sampled while a row
/// is timed, ms.
pub const MACHINE_SAMPLE_MS: u64 = 25;

/// The hard limit on one case process, s ([`PROCESS_LIMIT_FACTOR`]).
pub fn process_limit_s(case_timeout_s: f64) -> f64 {
    case_timeout_s * PROCESS_LIMIT_FACTOR + PROCESS_LIMIT_MARGIN_S
}

/// The constants above, as a document records them.
pub fn protocol_constants() -> crate::schema::ProtocolConstants {
    crate::schema::ProtocolConstants {
        min_samples: MIN_SAMPLES as u32,
        max_input_sets: MAX_INPUT_SETS,
        rotation_memory_fraction: ROTATION_MEMORY_FRACTION,
        process_limit_factor: PROCESS_LIMIT_FACTOR,
        process_limit_margin_s: PROCESS_LIMIT_MARGIN_S,
        machine_sample_ms: MACHINE_SAMPLE_MS as f64,
        kernels_compiled_once: false,
    }
}

/// The timing defaults the runners use unless told otherwise.
pub fn default_timing() -> TimingConfig {
    TimingConfig {
        warmup_ms: WARMUP_MS,
        repeats: 15,
        min_sample_ms: 5.0,
        max_inner: 200,
        l2_rotation_factor: 3.0,
        case_timeout_s: 180.0,
        launch_bound_ratio: LAUNCH_BOUND_RATIO,
        runs: 1,
    }
}

/// Summary statistics of per-call times, in ms.
#[derive(Clone, Debug, PartialEq)]
pub struct Stats {
    /// Median of the samples.
    pub median_ms: f64,
    /// First quartile (25th percentile, linear interpolation).
    pub q1_ms: f64,
    /// Third quartile (75th percentile, linear interpolation).
    pub q3_ms: f64,
    /// Number of samples summarised.
    pub samples: u32,
}

/// Quantile `p` in \[0, 1\] of ascending `sorted` by linear interpolation between closest ranks
/// (the default of NumPy's `percentile`): h = (n − 1)·p, x\[⌊h⌋\] + (h − ⌊h⌋)(x\[⌊h⌋+1\] − x\[⌊h⌋\]).
///
/// # Panics
/// If `sorted` is empty.
pub fn quantile(sorted: &[f64], p: f64) -> f64 {
    assert!(!sorted.is_empty(), "quantile of no samples");
    let h = (sorted.len() - 1) as f64 * p.clamp(0.0, 1.0);
    let lo = h.floor() as usize;
    let hi = (lo + 1).min(sorted.len() - 1);
    sorted[lo] + (h - lo as f64) * (sorted[hi] - sorted[lo])
}

/// Median and quartiles of per-call times (ms). Returns `None` for an empty or non-finite input.
pub fn summarize(samples_ms: &[f64]) -> Option<Stats> {
    if samples_ms.is_empty() || samples_ms.iter().any(|x| !x.is_finite()) {
        return None;
    }
    let mut v = samples_ms.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    Some(Stats {
        median_ms: quantile(&v, 0.5),
        q1_ms: quantile(&v, 0.25),
        q3_ms: quantile(&v, 0.75),
        samples: v.len() as u32,
    })
}

/// What one sample of `inner` back-to-back calls cost.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sample {
    /// Device time between the two events around the calls, ms.
    pub device_ms: f64,
    /// Host wall time from before the first launch to after the last launch returned, ms.
    pub host_ms: f64,
}

/// Something that can run `inner` back-to-back calls and report their device and host time.
pub trait SampleTimer {
    /// The error a call can fail with.
    type Error;
    /// Runs `inner` calls back to back and returns their total device and host time.
    fn time_calls(&mut self, inner: u32) -> Result<Sample, Self::Error>;
}

/// Why a measurement stopped.
#[derive(Debug)]
pub enum MeasureError<E> {
    /// The timer failed (a launch or event error).
    Timer(E),
    /// The case ran past `case_timeout_s` with fewer than [`MIN_SAMPLES`] samples.
    Timeout {
        /// Seconds spent when the limit was hit.
        elapsed_s: f64,
    },
    /// The timer returned a non-finite or non-positive time.
    BadTime(f64),
}

/// Result of [`measure`].
#[derive(Clone, Debug, PartialEq)]
pub struct Measurement {
    /// Per-call device-time statistics over the samples.
    pub stats: Stats,
    /// Median host time to enqueue one call over the same samples, ms.
    pub host_ms: f64,
    /// Calls per sample.
    pub inner: u32,
    /// Calls made to warm up.
    pub warmup_calls: u32,
    /// Event time those warm-up calls took, ms (at least `warmup_ms`).
    pub warmup_ms: f64,
    /// True when the time limit stopped sampling before `repeats` samples.
    pub cut_short: bool,
}

impl Measurement {
    /// True when the host time per call is at least `ratio` × the device time per call.
    pub fn launch_bound(&self, ratio: f64) -> bool {
        self.host_ms >= ratio * self.stats.median_ms
    }
}

/// Calls per sample so that one sample lasts at least `min_sample_ms`, given one call's time.
pub fn choose_inner(one_call_ms: f64, min_sample_ms: f64, max_inner: u32) -> u32 {
    if one_call_ms.is_nan() || one_call_ms <= 0.0 {
        return max_inner.max(1);
    }
    let n = (min_sample_ms / one_call_ms).ceil();
    (n as u32).clamp(1, max_inner.max(1))
}

/// Runs the protocol of the site's Methodology section on `timer`, after the case's first call:
///
/// 1. **Warm-up by time**: batches of 1, 2, 4, … calls (at most `max_inner` a batch) until their
///    event time adds up to `warmup_ms`.
/// 2. `inner` = ⌈`min_sample_ms` ÷ the last warm-up batch's time per call⌉, clamped to
///    `1..=max_inner` (one timed call sizes it when `warmup_ms` is 0).
/// 3. `repeats` samples of `inner` back-to-back calls; each gives device time ÷ inner and host
///    enqueue time ÷ inner.
///
/// **Time limit** (counted from the first warm-up call): before each sample, when the sample
/// would end past `case_timeout_s` and [`MIN_SAMPLES`] samples exist, sampling stops and the
/// samples taken are kept; once the limit has passed with fewer, the case is a
/// [`MeasureError::Timeout`]. A sample in flight is never interrupted.
pub fn measure<T: SampleTimer>(
    timer: &mut T,
    cfg: &TimingConfig,
) -> Result<Measurement, MeasureError<T::Error>> {
    measure_with_clock(timer, cfg, &mut || Instant::now())
}

/// [`measure`] with an injected clock (tests).
pub fn measure_with_clock<T: SampleTimer>(
    timer: &mut T,
    cfg: &TimingConfig,
    now: &mut dyn FnMut() -> Instant,
) -> Result<Measurement, MeasureError<T::Error>> {
    let start = now();
    let limit_s = cfg.case_timeout_s.max(0.0);
    let elapsed = |t: Instant| t.duration_since(start).as_secs_f64();
    let timeout = |t: Instant| MeasureError::Timeout {
        elapsed_s: elapsed(t),
    };
    let check = |s: Sample| -> Result<Sample, MeasureError<T::Error>> {
        for v in [s.device_ms, s.host_ms] {
            if !v.is_finite() || v < 0.0 {
                return Err(MeasureError::BadTime(v));
            }
        }
        if s.device_ms <= 0.0 {
            return Err(MeasureError::BadTime(s.device_ms));
        }
        Ok(s)
    };
    let max_inner = cfg.max_inner.max(1);

    // 1. Warm-up by time.
    let (mut warm_calls, mut warm_ms) = (0u32, 0.0f64);
    let mut batch = 1u32;
    let mut last_per_call = f64::NAN;
    while warm_ms < cfg.warmup_ms {
        let t = now();
        if elapsed(t) > limit_s {
            return Err(timeout(t));
        }
        let s = check(timer.time_calls(batch).map_err(MeasureError::Timer)?)?;
        warm_calls += batch;
        warm_ms += s.device_ms;
        last_per_call = s.device_ms / batch as f64;
        batch = (batch * 2).min(max_inner);
    }
    // 2. Calls per sample.
    if last_per_call.is_nan() {
        let s = check(timer.time_calls(1).map_err(MeasureError::Timer)?)?;
        last_per_call = s.device_ms;
    }
    let inner = choose_inner(last_per_call, cfg.min_sample_ms, max_inner);
    // 3. Samples under the time limit.
    let mut device = Vec::with_capacity(cfg.repeats as usize);
    let mut host = Vec::with_capacity(cfg.repeats as usize);
    let mut cut_short = false;
    let mut expected_ms = last_per_call * inner as f64;
    for _ in 0..cfg.repeats.max(1) {
        let t = now();
        let projected = elapsed(t) + expected_ms * 1e-3;
        if projected > limit_s && device.len() >= MIN_SAMPLES {
            cut_short = true;
            break;
        }
        if elapsed(t) > limit_s {
            return Err(timeout(t));
        }
        let s = check(timer.time_calls(inner).map_err(MeasureError::Timer)?)?;
        expected_ms = s.device_ms.max(s.host_ms);
        device.push(s.device_ms / inner as f64);
        host.push(s.host_ms / inner as f64);
    }
    let stats = summarize(&device).expect("at least one finite sample");
    let host_ms = summarize(&host).expect("as many host samples").median_ms;
    Ok(Measurement {
        stats,
        host_ms,
        inner,
        warmup_calls: warm_calls,
        warmup_ms: warm_ms,
        cut_short,
    })
}

/// Calls one CUDA graph holds: `inner`, raised to a whole number of passes over the `n_sets`
/// input sets when there are more sets than calls, so that replaying it rotates through every
/// set (a graph replays the same calls on the same buffers each time).
/// `runners/compare/timing.py` `graph_calls` is the same rule.
pub fn graph_calls(inner: u32, n_sets: u32) -> u32 {
    let (inner, n_sets) = (inner.max(1), n_sets.max(1));
    if inner >= n_sets {
        inner
    } else {
        inner * n_sets.div_ceil(inner)
    }
}

/// The samples of [`measure`] (step 3) without its warm-up and sizing, for a timer whose calls
/// are already warm and whose sample size is fixed: a CUDA graph of `inner` calls, replayed.
/// The time limit counts from `start`, as in [`measure`].
pub fn measure_replay<T: SampleTimer>(
    timer: &mut T,
    cfg: &TimingConfig,
    inner: u32,
    start: Instant,
) -> Result<Measurement, MeasureError<T::Error>> {
    let limit_s = cfg.case_timeout_s.max(0.0);
    let elapsed = |t: Instant| t.duration_since(start).as_secs_f64();
    let mut device = Vec::with_capacity(cfg.repeats as usize);
    let mut host = Vec::with_capacity(cfg.repeats as usize);
    let mut cut_short = false;
    let mut expected_ms = 0.0f64;
    for _ in 0..cfg.repeats.max(1) {
        let t = Instant::now();
        if elapsed(t) + expected_ms * 1e-3 > limit_s && device.len() >= MIN_SAMPLES {
            cut_short = true;
            break;
        }
        if elapsed(t) > limit_s {
            return Err(MeasureError::Timeout {
                elapsed_s: elapsed(t),
            });
        }
        let s = timer.time_calls(inner).map_err(MeasureError::Timer)?;
        if !(s.device_ms.is_finite() && s.device_ms > 0.0) {
            return Err(MeasureError::BadTime(s.device_ms));
        }
        expected_ms = s.device_ms.max(s.host_ms);
        device.push(s.device_ms / inner as f64);
        host.push(s.host_ms / inner as f64);
    }
    let stats = summarize(&device).expect("at least one finite sample");
    let host_ms = summarize(&host).expect("as many host samples").median_ms;
    Ok(Measurement {
        stats,
        host_ms,
        inner,
        warmup_calls: 0,
        warmup_ms: 0.0,
        cut_short,
    })
}

/// Number of input sets to rotate through so that their total size is at least
/// `factor` × `l2_bytes`, at least 1 and at most `cap`.
pub fn input_sets(bytes_per_set: u64, l2_bytes: u64, factor: f64, cap: u32) -> u32 {
    if bytes_per_set == 0 {
        return 1;
    }
    let need = (factor * l2_bytes as f64 / bytes_per_set as f64).ceil();
    (need.max(1.0) as u32).clamp(1, cap.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_graph_rotates_through_every_set() {
        assert_eq!(graph_calls(2, 8), 8);
        assert_eq!(graph_calls(3, 8), 9);
        assert_eq!(graph_calls(17, 8), 17);
        assert_eq!(graph_calls(0, 0), 1);
    }

    #[test]
    fn quantiles_match_linear_interpolation() {
        let v = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(quantile(&v, 0.5), 2.5);
        assert_eq!(quantile(&v, 0.25), 1.75);
        assert_eq!(quantile(&v, 0.75), 3.25);
        assert_eq!(quantile(&[7.0], 0.3), 7.0);
        let s = summarize(&[5.0, 1.0, 3.0]).unwrap();
        assert_eq!((s.q1_ms, s.median_ms, s.q3_ms), (2.0, 3.0, 4.0));
        assert!(summarize(&[1.0, f64::NAN]).is_none());
        assert!(summarize(&[]).is_none());
    }

    /// A fake device (hyperfine's MockExecutor in spirit): each call costs `per_call` ms of
    /// device time and `host_per_call` ms of host time, plus a slow outlier every 5th sample.
    /// It records every batch it was asked for.
    struct Fake {
        per_call: f64,
        host_per_call: f64,
        calls: Vec<u32>,
    }

    impl Fake {
        fn new(per_call: f64, host_per_call: f64) -> Fake {
            Fake {
                per_call,
                host_per_call,
                calls: vec![],
            }
        }
    }

    impl SampleTimer for Fake {
        type Error = ();
        fn time_calls(&mut self, inner: u32) -> Result<Sample, ()> {
            self.calls.push(inner);
            let outlier = if self.calls.len().is_multiple_of(5) {
                10.0
            } else {
                0.0
            };
            let host_ms = self.host_per_call * inner as f64;
            // Back-to-back calls: the device cannot finish before the host issued them all.
            let device_ms = (self.per_call * inner as f64).max(host_ms) + outlier;
            Ok(Sample { device_ms, host_ms })
        }
    }

    fn cfg() -> TimingConfig {
        TimingConfig {
            repeats: 9,
            min_sample_ms: 5.0,
            max_inner: 100,
            case_timeout_s: 100.0,
            ..default_timing()
        }
    }

    #[test]
    fn warm_up_is_by_time_then_samples_of_inner_calls() {
        let mut t = Fake::new(0.5, 0.01);
        let m = measure(&mut t, &cfg()).unwrap();
        // Batches double until 100 ms of event time: 1+2+4+...+64 = 127 calls at 0.5 ms is
        // 63.5 ms (+ outlier), the next batch (100, capped at max_inner) passes 100 ms.
        let warm: Vec<u32> = t.calls[..t.calls.len() - 9].to_vec();
        assert_eq!(warm, vec![1, 2, 4, 8, 16, 32, 64, 100], "{:?}", t.calls);
        assert!(m.warmup_ms >= WARMUP_MS, "{m:?}");
        assert_eq!(m.warmup_calls, warm.iter().sum::<u32>());
        assert_eq!(m.inner, 10, "5 ms / 0.5 ms");
        assert!(t.calls[warm.len()..].iter().all(|&n| n == 10));
        assert!((m.stats.median_ms - 0.5).abs() < 1e-12, "{:?}", m.stats);
        assert!(m.stats.q3_ms >= m.stats.median_ms && m.stats.q1_ms <= m.stats.median_ms);
        assert!(!m.launch_bound(LAUNCH_BOUND_RATIO));
    }

    #[test]
    fn a_slow_call_warms_up_in_one_call() {
        // One call of 250 ms already covers the warm-up.
        let mut t = Fake::new(250.0, 0.01);
        let m = measure(&mut t, &cfg()).unwrap();
        assert_eq!(t.calls[0], 1);
        assert_eq!(m.warmup_calls, 1);
        assert_eq!(m.inner, 1);
    }

    #[test]
    fn no_warm_up_sizes_with_one_call() {
        let c = TimingConfig {
            warmup_ms: 0.0,
            ..cfg()
        };
        let mut t = Fake::new(0.5, 0.01);
        let m = measure(&mut t, &c).unwrap();
        assert_eq!(t.calls[0], 1);
        assert_eq!(m.warmup_calls, 0);
        assert_eq!(m.inner, 10);
    }

    #[test]
    fn host_bound_calls_are_flagged_launch_bound() {
        // The host needs 0.03 ms to issue a call the device runs in 0.01 ms: back to back, the
        // events see the host's pace, and host time ≈ device time per call.
        let mut t = Fake::new(0.01, 0.03);
        let m = measure(&mut t, &cfg()).unwrap();
        assert!((m.host_ms - 0.03).abs() < 1e-12, "{m:?}");
        assert!(m.launch_bound(LAUNCH_BOUND_RATIO), "{m:?}");
        // A device-bound case with the same host cost is not.
        let mut t = Fake::new(1.0, 0.03);
        let m = measure(&mut t, &cfg()).unwrap();
        assert!(!m.launch_bound(LAUNCH_BOUND_RATIO), "{m:?}");
        // The row flag reads the same rule.
        let mut row = crate::schema::Row::failed(
            Default::default(),
            "x",
            "y",
            false,
            crate::schema::Status::Ok,
            "",
        );
        row.median_ms = Some(0.01);
        row.host_ms = Some(0.03);
        assert!(row.launch_bound(LAUNCH_BOUND_RATIO));
        row.timing = Some(crate::schema::TimingMethod::GraphReplay);
        row.median_ms = Some(0.005);
        row.eager_median_ms = Some(0.1);
        assert!(
            !row.launch_bound(LAUNCH_BOUND_RATIO),
            "graph rows compare to eager"
        );
    }

    #[test]
    fn inner_is_clamped() {
        assert_eq!(choose_inner(10.0, 5.0, 100), 1);
        assert_eq!(choose_inner(0.001, 5.0, 100), 100);
        assert_eq!(choose_inner(1.0, 5.0, 100), 5);
        assert_eq!(choose_inner(0.0, 5.0, 7), 7);
    }

    #[test]
    fn timeout_is_reported() {
        let c = TimingConfig {
            warmup_ms: 0.0,
            repeats: 5,
            min_sample_ms: 1.0,
            max_inner: 1,
            case_timeout_s: 1.0,
            ..default_timing()
        };
        let base = Instant::now();
        let mut tick = 0u64;
        let mut clock = || {
            tick += 1;
            base + Duration::from_secs(tick * 2)
        };
        let mut t = Fake::new(1.0, 0.0);
        match measure_with_clock(&mut t, &c, &mut clock) {
            Err(MeasureError::Timeout { elapsed_s }) => assert!(elapsed_s > 1.0),
            other => panic!("expected timeout, got {other:?}"),
        }
    }

    #[test]
    fn the_limit_keeps_the_samples_taken_once_there_are_three() {
        let c = TimingConfig {
            warmup_ms: 0.0,
            repeats: 10,
            min_sample_ms: 1.0,
            max_inner: 1,
            case_timeout_s: 10.0,
            ..default_timing()
        };
        let base = Instant::now();
        let mut tick = 0u64;
        // Each clock read is 2 s later: samples at 2, 4, 6, 8 s; the fifth would start at 10 s
        // and end past the limit.
        let mut clock = || {
            let t = base + Duration::from_secs(tick * 2);
            tick += 1;
            t
        };
        let mut t = Fake::new(1.0, 0.0);
        let m = measure_with_clock(&mut t, &c, &mut clock).unwrap();
        assert!(m.cut_short);
        assert!(m.stats.samples as usize >= MIN_SAMPLES && m.stats.samples < 10);
    }

    #[test]
    fn rotation_covers_l2() {
        let l2 = 60_000_000;
        assert_eq!(input_sets(12_000_000, l2, 3.0, 64), 15);
        assert_eq!(input_sets(400_000_000, l2, 3.0, 64), 1);
        assert_eq!(input_sets(1, l2, 3.0, 64), 64);
        assert_eq!(input_sets(0, l2, 3.0, 64), 1);
    }
}
