//! The measurement protocol, independent of any device: warm-up, choice of the inner call count,
//! repeated samples, median and inter-quartile range, and the number of input sets to rotate.
//!
//! The device side implements [`SampleTimer`] (CUDA events around `inner` back-to-back calls);
//! tests use a fake timer, as hyperfine tests its scheduler with a mock executor.

use std::time::{Duration, Instant};

use crate::schema::TimingConfig;

/// The timing defaults the runners use unless told otherwise.
pub fn default_timing() -> TimingConfig {
    TimingConfig {
        warmup_calls: 3,
        repeats: 15,
        min_sample_ms: 5.0,
        max_inner: 200,
        l2_rotation_factor: 3.0,
        case_timeout_s: 180.0,
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

/// Something that can run `inner` back-to-back calls and report their total device time.
pub trait SampleTimer {
    /// The error a call can fail with.
    type Error;
    /// Runs `inner` calls back to back and returns their total elapsed time in ms.
    fn time_calls(&mut self, inner: u32) -> Result<f64, Self::Error>;
}

/// Why a measurement stopped.
#[derive(Debug)]
pub enum MeasureError<E> {
    /// The timer failed (a launch or event error).
    Timer(E),
    /// The case ran past `case_timeout_s`.
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
    /// Per-call statistics over the samples.
    pub stats: Stats,
    /// Calls per sample.
    pub inner: u32,
}

/// Calls per sample so that one sample lasts at least `min_sample_ms`, given one call's time.
pub fn choose_inner(one_call_ms: f64, min_sample_ms: f64, max_inner: u32) -> u32 {
    if one_call_ms.is_nan() || one_call_ms <= 0.0 {
        return max_inner.max(1);
    }
    let n = (min_sample_ms / one_call_ms).ceil();
    (n as u32).clamp(1, max_inner.max(1))
}

/// Runs the protocol of the site's Methodology section on `timer`:
/// `warmup_calls` calls, one timed call to choose `inner`, then `repeats` samples of `inner`
/// back-to-back calls; each sample gives time / inner. The whole measurement is bounded by
/// `case_timeout_s` (checked between samples; a sample in flight is never interrupted, and the
/// remaining samples are dropped when the next one would cross the limit).
pub fn measure<T: SampleTimer>(
    timer: &mut T,
    cfg: &TimingConfig,
) -> Result<Measurement, MeasureError<T::Error>> {
    measure_with_clock(timer, cfg, &mut || Instant::now())
}

fn measure_with_clock<T: SampleTimer>(
    timer: &mut T,
    cfg: &TimingConfig,
    now: &mut dyn FnMut() -> Instant,
) -> Result<Measurement, MeasureError<T::Error>> {
    let start = now();
    let limit = Duration::from_secs_f64(cfg.case_timeout_s.max(0.0));
    let check = |t: Instant| -> Result<(), MeasureError<T::Error>> {
        let e = t.duration_since(start);
        if e > limit {
            Err(MeasureError::Timeout {
                elapsed_s: e.as_secs_f64(),
            })
        } else {
            Ok(())
        }
    };
    if cfg.warmup_calls > 0 {
        timer
            .time_calls(cfg.warmup_calls)
            .map_err(MeasureError::Timer)?;
    }
    check(now())?;
    let one = timer.time_calls(1).map_err(MeasureError::Timer)?;
    if !one.is_finite() || one <= 0.0 {
        return Err(MeasureError::BadTime(one));
    }
    let inner = choose_inner(one, cfg.min_sample_ms, cfg.max_inner);
    let mut samples = Vec::with_capacity(cfg.repeats as usize);
    for _ in 0..cfg.repeats.max(1) {
        let t = now();
        // Stop early rather than cross the limit: keep the samples taken if there are 3 or more.
        let projected = t.duration_since(start).as_secs_f64() + one * inner as f64 * 1e-3;
        if projected > cfg.case_timeout_s && samples.len() >= 3 {
            break;
        }
        check(t)?;
        let total = timer.time_calls(inner).map_err(MeasureError::Timer)?;
        if !total.is_finite() || total <= 0.0 {
            return Err(MeasureError::BadTime(total));
        }
        samples.push(total / inner as f64);
    }
    let stats = summarize(&samples).expect("at least one finite sample");
    Ok(Measurement { stats, inner })
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

    /// A fake device: each call costs `per_call` ms, plus a slow outlier every `period` samples.
    struct Fake {
        per_call: f64,
        calls: Vec<u32>,
    }

    impl SampleTimer for Fake {
        type Error = ();
        fn time_calls(&mut self, inner: u32) -> Result<f64, ()> {
            self.calls.push(inner);
            let outlier = if self.calls.len().is_multiple_of(5) {
                10.0
            } else {
                0.0
            };
            Ok(self.per_call * inner as f64 + outlier)
        }
    }

    #[test]
    fn protocol_warms_up_then_times_inner_calls() {
        let cfg = TimingConfig {
            warmup_calls: 3,
            repeats: 9,
            min_sample_ms: 5.0,
            max_inner: 100,
            l2_rotation_factor: 3.0,
            case_timeout_s: 100.0,
        };
        let mut t = Fake {
            per_call: 0.5,
            calls: vec![],
        };
        let m = measure(&mut t, &cfg).unwrap();
        assert_eq!(t.calls[0], 3, "warm-up first");
        assert_eq!(t.calls[1], 1, "then one call to size the sample");
        assert_eq!(m.inner, 10, "5 ms / 0.5 ms");
        assert_eq!(t.calls.len(), 2 + 9);
        // Outliers (every 5th call) land above the median, which stays at the true per-call time.
        assert!((m.stats.median_ms - 0.5).abs() < 1e-12, "{:?}", m.stats);
        assert!(m.stats.q3_ms >= m.stats.median_ms && m.stats.q1_ms <= m.stats.median_ms);
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
        let cfg = TimingConfig {
            warmup_calls: 0,
            repeats: 5,
            min_sample_ms: 1.0,
            max_inner: 1,
            l2_rotation_factor: 1.0,
            case_timeout_s: 1.0,
        };
        let base = Instant::now();
        let mut tick = 0u64;
        let mut clock = || {
            tick += 1;
            base + Duration::from_secs(tick * 2)
        };
        let mut t = Fake {
            per_call: 1.0,
            calls: vec![],
        };
        match measure_with_clock(&mut t, &cfg, &mut clock) {
            Err(MeasureError::Timeout { elapsed_s }) => assert!(elapsed_s > 1.0),
            other => panic!("expected timeout, got {other:?}"),
        }
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
