//! The JSON protocol between a suite runner, its case processes and the comparison modules
//! (`runners/compare/`): one [`Job`] per (case, implementation), one [`Reply`] back.
//!
//! The runner writes each case's inputs once, as raw little-endian files, with the float64
//! reference values of the checked output elements ([`CaseFiles`]); every implementation, the
//! project's and the alternatives', reads the same input bits and is checked against the same
//! reference values over the same elements. A forward + backward job adds an input (the
//! gradient of the loss with respect to the output, e.g. attention's `do`) and one
//! [`GradientSpec`] per gradient to produce and check. `runners/compare/protocol.py` is the
//! Python side; its module docstring is the protocol's full description for module authors.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::grid::Params;
use crate::schema::{Reference, Row, Status, TimingConfig};

/// One input tensor in a raw file: `shape` elements of `dtype`, row-major, little-endian.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct TensorFile {
    /// Argument name, e.g. `q`.
    pub name: String,
    /// Element type as documents spell it (`bf16`, `fp16`, `fp32`).
    pub dtype: String,
    /// Dimensions.
    pub shape: Vec<usize>,
    /// The raw file.
    pub path: PathBuf,
}

/// The output an implementation must produce.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct OutputSpec {
    /// Element type.
    pub dtype: String,
    /// Dimensions.
    pub shape: Vec<usize>,
}

/// Which output elements are checked, and against what.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct CheckSpec {
    /// `[start, len]` ranges of flat (row-major) output element indices.
    pub ranges: Vec<[u64; 2]>,
    /// The float64 reference values of those elements, concatenated in range order, as a raw
    /// little-endian file.
    pub reference: PathBuf,
    /// Where the reference came from.
    pub reference_kind: Reference,
    /// Largest accepted relative L2 error.
    pub tolerance: f64,
    /// What the ranges cover, in words (the row's `accuracy.checked`).
    pub checked: String,
}

impl CheckSpec {
    /// Writes `values`, the float64 reference of the elements in `ranges`, to `path` and
    /// returns the check against it (reference kind [`Reference::Float64Cpu`]).
    ///
    /// # Errors
    /// I/O errors, with the path.
    pub fn write_float64(
        path: PathBuf,
        values: &[f64],
        ranges: Vec<[u64; 2]>,
        tolerance: f64,
        checked: String,
    ) -> anyhow::Result<CheckSpec> {
        write_f64(&path, values)?;
        Ok(CheckSpec {
            ranges,
            reference: path,
            reference_kind: Reference::Float64Cpu,
            tolerance,
            checked,
        })
    }
}

/// A gradient a forward + backward job produces besides the output, and its check.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct GradientSpec {
    /// Display name, e.g. `dQ`.
    pub name: String,
    /// The input tensor it is the gradient of (a [`TensorFile::name`]), e.g. `q`.
    pub input: String,
    /// Its element type and dimensions (those of the input).
    pub output: OutputSpec,
    /// Its accuracy check, as for the output.
    pub check: CheckSpec,
}

/// Everything an implementation needs to run and check one case.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct CaseFiles {
    /// Input tensors, in argument order (a forward + backward job ends with the gradient of
    /// the loss with respect to the output).
    pub inputs: Vec<TensorFile>,
    /// The output.
    pub output: OutputSpec,
    /// The accuracy check.
    pub check: CheckSpec,
    /// The gradients a forward + backward job produces, in order; empty for a forward job.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gradients: Vec<GradientSpec>,
    /// The call's scalar arguments as the suite defines them (attention: `seq_len_q`,
    /// `seq_len_kv`, `scale`, `causal`, `kv_lens`, ...), so a module need not rebuild them
    /// from the case parameters.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub arguments: BTreeMap<String, serde_json::Value>,
    /// FLOPs of one call by the suite's rule.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flops: Option<f64>,
    /// Bytes one call must move.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes: Option<f64>,
    /// Items one call processes by the suite's rule (kernel sums: kernel evaluations).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub items: Option<f64>,
}

impl CaseFiles {
    /// Every output with its check: (`O`, the output) first, then the gradients.
    pub fn outputs(&self) -> Vec<(&str, &OutputSpec, &CheckSpec)> {
        std::iter::once(("O", &self.output, &self.check))
            .chain(
                self.gradients
                    .iter()
                    .map(|g| (g.name.as_str(), &g.output, &g.check)),
            )
            .collect()
    }

    /// Bytes of one input set (every input tensor), for the L2 rotation.
    pub fn input_bytes(&self) -> u64 {
        self.inputs
            .iter()
            .map(|t| t.shape.iter().product::<usize>() as u64 * dtype_bytes(&t.dtype))
            .sum()
    }
}

/// Bytes per element of a dtype name (`bf16`, `fp16`: 2, `fp32`: 4, `fp64`: 8).
pub fn dtype_bytes(dtype: &str) -> u64 {
    match dtype {
        "fp32" | "f32" | "float32" => 4,
        "fp64" | "f64" | "float64" => 8,
        _ => 2,
    }
}

/// Element `i` of `words` (a tensor's little-endian bytes as 16-bit words, as
/// [`read_u16`] returns them) in `dtype` (`bf16`, `fp16`, `fp32`, `fp64`), as float64.
///
/// # Panics
/// For another dtype name.
pub fn decode(dtype: &str, words: &[u16], i: usize) -> f64 {
    match dtype {
        "bf16" => half::bf16::from_bits(words[i]).to_f64(),
        "fp16" | "f16" => half::f16::from_bits(words[i]).to_f64(),
        "fp32" | "f32" => {
            f32::from_bits(words[2 * i] as u32 | (words[2 * i + 1] as u32) << 16) as f64
        }
        "fp64" | "f64" => f64::from_bits(
            (0..4).fold(0u64, |bits, k| bits | (words[4 * i + k] as u64) << (16 * k)),
        ),
        other => panic!("decode: unknown dtype `{other}`"),
    }
}

/// One (case, implementation) to measure.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Job {
    /// The case.
    pub case: Params,
    /// Implementation name.
    pub implementation: String,
    /// The device the run measures: a comparison module that can measure either (e.g.
    /// `torch_kernel_sums`) runs on this one. A job without it is a GPU run's.
    #[serde(default)]
    pub device: super::DeviceChoice,
    /// Timing parameters.
    pub timing: TimingConfig,
    /// L2 size of the device, bytes (for the rotation).
    pub l2_bytes: u64,
    /// Inputs, output and check.
    pub files: CaseFiles,
}

/// What a case process or comparison module sends back.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Reply {
    /// The row.
    pub row: Row,
    /// Wall-clock span of the timed calls (warm-up to last sample), seconds since the Unix
    /// epoch; the runner reads the device's state over it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window: Option<[f64; 2]>,
    /// Library versions the process saw (comparison modules).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub libraries: BTreeMap<String, String>,
    /// Process that measured the row, when not the one the runner started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
}

impl Reply {
    /// The reply of a job that produced no measurement: a row of `status` with `message`, for
    /// the job's case and implementation (library left empty: the runner fills it in).
    pub fn failed(job: &Job, status: Status, message: String) -> Reply {
        Reply {
            row: Row::failed(
                job.case.clone(),
                &job.implementation,
                "",
                false,
                status,
                message,
            ),
            window: None,
            libraries: BTreeMap::new(),
            pid: None,
        }
    }
}

/// Seconds since the Unix epoch, now.
pub fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Writes `values` as raw little-endian float64.
///
/// # Errors
/// I/O errors, with the path.
pub fn write_f64(path: &Path, values: &[f64]) -> anyhow::Result<()> {
    use anyhow::Context;
    let mut bytes = Vec::with_capacity(values.len() * 8);
    for v in values {
        bytes.extend_from_slice(&v.to_le_bytes());
    }
    std::fs::write(path, bytes).with_context(|| format!("writing {}", path.display()))
}

/// Reads raw little-endian float64.
///
/// # Errors
/// I/O errors, with the path; a length that is not a multiple of 8.
pub fn read_f64(path: &Path) -> anyhow::Result<Vec<f64>> {
    use anyhow::Context;
    let b = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    anyhow::ensure!(
        b.len().is_multiple_of(8),
        "{}: {} bytes is not a whole number of float64",
        path.display(),
        b.len()
    );
    Ok(b.chunks_exact(8)
        .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect())
}

/// Writes 16-bit values as raw little-endian.
///
/// # Errors
/// I/O errors, with the path.
pub fn write_u16(path: &Path, values: &[u16]) -> anyhow::Result<()> {
    use anyhow::Context;
    let mut bytes = Vec::with_capacity(values.len() * 2);
    for v in values {
        bytes.extend_from_slice(&v.to_le_bytes());
    }
    std::fs::write(path, bytes).with_context(|| format!("writing {}", path.display()))
}

/// Reads raw little-endian 16-bit values.
///
/// # Errors
/// I/O errors (a short read among them), with the path; an odd length; a file that grew while
/// it was read.
pub fn read_u16(path: &Path) -> anyhow::Result<Vec<u16>> {
    use anyhow::Context;
    use std::io::Read;
    let mut f = std::fs::File::open(path).with_context(|| format!("reading {}", path.display()))?;
    let bytes = f
        .metadata()
        .with_context(|| format!("reading {}", path.display()))?
        .len() as usize;
    anyhow::ensure!(
        bytes.is_multiple_of(2),
        "{}: odd length {bytes}",
        path.display()
    );
    // Read straight into the words (one buffer of the file's size, no second copy: the MoE
    // grid's inputs reach 4 GB), then put them in this machine's byte order.
    let mut words = vec![0u16; bytes / 2];
    f.read_exact(bytemuck::cast_slice_mut(&mut words))
        .with_context(|| format!("reading {}", path.display()))?;
    anyhow::ensure!(
        f.read(&mut [0u8; 1])
            .with_context(|| format!("reading {}", path.display()))?
            == 0,
        "{}: grew while being read",
        path.display()
    );
    for w in &mut words {
        *w = u16::from_le(*w);
    }
    Ok(words)
}

/// The outcome of checking an output.
#[derive(Clone, Debug, PartialEq)]
pub enum Check {
    /// Every element finite; relative L2 error over the checked ranges.
    Error(f64),
    /// Element `index` of `len` is NaN or infinite.
    NonFinite {
        /// Flat index of the first non-finite element.
        index: usize,
        /// Elements in the output.
        len: usize,
    },
}

/// Checks a whole output: every element must be finite (the scan covers all of it, so a NaN
/// outside the checked ranges fails too), then ‖out − ref‖₂ / ‖ref‖₂ over `ranges` against
/// `reference` (their values concatenated). `value(i)` is output element `i` as float64. When
/// the reference is all zeros there (rows that see no key; gradients of a softmax over one
/// key), it has no scale of its own and the error is the output's L2 norm there (an absolute
/// error: 0 for an exact zero, rounding residue stays small, a wrong output does not).
pub fn check_output(
    len: usize,
    value: impl Fn(usize) -> f64,
    ranges: &[[u64; 2]],
    reference: &[f64],
) -> Check {
    if let Some(index) = (0..len).find(|&i| !value(i).is_finite()) {
        return Check::NonFinite { index, len };
    }
    checked_error(value, ranges, reference)
}

/// As [`check_output`], the scan for non-finite elements on all cores (an output of 3.8
/// billion elements, the MoE grid's largest, takes seconds on one); the first non-finite index
/// is still the one reported. For a `value` that can be shared between threads.
pub fn check_output_par(
    len: usize,
    value: impl Fn(usize) -> f64 + Sync,
    ranges: &[[u64; 2]],
    reference: &[f64],
) -> Check {
    use rayon::prelude::*;
    if let Some(index) = (0..len)
        .into_par_iter()
        .with_min_len(1 << 16)
        .find_first(|&i| !value(i).is_finite())
    {
        return Check::NonFinite { index, len };
    }
    checked_error(value, ranges, reference)
}

/// ‖out − ref‖₂ / ‖ref‖₂ over `ranges` (or ‖out‖₂ there where the reference is all zeros), as
/// [`check_output`] describes.
fn checked_error(value: impl Fn(usize) -> f64, ranges: &[[u64; 2]], reference: &[f64]) -> Check {
    let (mut num, mut den) = (0.0f64, 0.0f64);
    let mut r = 0;
    for &[start, n] in ranges {
        for i in start..start + n {
            let (o, want) = (value(i as usize), reference[r]);
            r += 1;
            num += (o - want) * (o - want);
            den += want * want;
        }
    }
    Check::Error(if den > 0.0 {
        (num / den).sqrt()
    } else {
        num.sqrt()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_nan_outside_the_checked_ranges_fails() {
        let mut out = vec![1.0; 100];
        let ranges = [[10u64, 5u64], [50, 5]];
        let reference = vec![1.0; 10];
        assert_eq!(
            check_output(out.len(), |i| out[i], &ranges, &reference),
            Check::Error(0.0)
        );
        out[99] = f64::NAN;
        assert_eq!(
            check_output(out.len(), |i| out[i], &ranges, &reference),
            Check::NonFinite {
                index: 99,
                len: 100
            }
        );
        out[99] = 1.0;
        out[12] = 1.1;
        match check_output(out.len(), |i| out[i], &ranges, &reference) {
            Check::Error(e) => assert!((e - 0.1 / 10f64.sqrt()).abs() < 1e-12),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_parallel_scan_reports_the_first_non_finite_element_as_the_serial_one() {
        // Over several of the parallel scan's pieces (at least 65,536 elements each), a NaN
        // early in a late piece and an infinity in a later one: the first is the one reported,
        // as serially (on a one-thread pool this checks the result, not the parallel order).
        let len = 5 * (1 << 16) + 7;
        let mut out = vec![0.5f64; len];
        let ranges = [[3u64, 4u64]];
        let reference = vec![0.5; 4];
        assert_eq!(
            check_output_par(len, |i| out[i], &ranges, &reference),
            Check::Error(0.0)
        );
        out[len - 2] = f64::INFINITY;
        out[3 * (1 << 16) + 1] = f64::NAN;
        let want = Check::NonFinite {
            index: 3 * (1 << 16) + 1,
            len,
        };
        assert_eq!(check_output(len, |i| out[i], &ranges, &reference), want);
        assert_eq!(check_output_par(len, |i| out[i], &ranges, &reference), want);
        out[4] = 0.6;
        out[3 * (1 << 16) + 1] = 0.5;
        out[len - 2] = 0.5;
        assert_eq!(
            check_output_par(len, |i| out[i], &ranges, &reference),
            check_output(len, |i| out[i], &ranges, &reference)
        );
    }

    #[test]
    fn zero_references_and_decoding() {
        let zeros = [0.0; 4];
        assert_eq!(
            check_output(4, |i| zeros[i], &[[0, 4]], &zeros),
            Check::Error(0.0)
        );
        assert_eq!(
            check_output(4, |i| [0.0, 0.0, 1e-3, 0.0][i], &[[0, 4]], &zeros),
            Check::Error(1e-3)
        );
        let w = [0x3FC0u16, 0x3E00, 0x0000, 0x3FC0];
        assert_eq!(decode("bf16", &w, 0), 1.5);
        assert_eq!(decode("fp16", &w, 1), 1.5);
        assert_eq!(decode("fp32", &w, 1), 1.5);
        // float64 as four little-endian words: element 1 of [π, −1/3].
        let words: Vec<u16> = [std::f64::consts::PI, -1.0 / 3.0]
            .iter()
            .flat_map(|v| v.to_bits().to_le_bytes())
            .collect::<Vec<u8>>()
            .chunks(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect();
        assert_eq!(decode("fp64", &words, 1), -1.0 / 3.0);
        assert_eq!(decode("fp64", &words, 0), std::f64::consts::PI);
    }

    #[test]
    fn raw_files_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.f64");
        write_f64(&p, &[1.5, -2.0]).unwrap();
        assert_eq!(read_f64(&p).unwrap(), vec![1.5, -2.0]);
        let p = dir.path().join("x.u16");
        write_u16(&p, &[1, 0xFFFF]).unwrap();
        assert_eq!(read_u16(&p).unwrap(), vec![1, 0xFFFF]);
        assert_eq!(std::fs::read(&p).unwrap(), vec![1, 0, 0xFF, 0xFF]);
        // Little-endian words, whatever the order of the bytes' values; an empty file; an odd
        // length named as such.
        std::fs::write(&p, [0x34, 0x12, 0x00, 0x80]).unwrap();
        assert_eq!(read_u16(&p).unwrap(), vec![0x1234, 0x8000]);
        std::fs::write(&p, []).unwrap();
        assert_eq!(read_u16(&p).unwrap(), Vec::<u16>::new());
        std::fs::write(&p, [1, 2, 3]).unwrap();
        let e = read_u16(&p).unwrap_err().to_string();
        assert!(e.contains("odd length 3") && e.contains("x.u16"), "{e}");
    }
}
