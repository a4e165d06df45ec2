//! GPU correctness of the sequence-mixer kernels against their float64 references
//! (`sequence_mixers::reference`).
//!
//! Runs on a machine with an NVIDIA GPU. Where build.rs found no CUDA driver (`kp_cuda`), the
//! tests are compiled as ignored, with the reason; on the GPU machine run them with
//! `cargo test --release --test gpu_sequence_mixers -- --include-ignored --test-threads 1`.
//! Outputs are filled with NaN before each launch, so an element the kernels never write fails
//! the finiteness check. Each case prints one line (`--nocapture`); a failing test names every
//! failing case.

#[path = "gpu_sequence_mixers/api.rs"]
mod api;
#[path = "gpu_sequence_mixers/based.rs"]
mod based;
#[path = "gpu_sequence_mixers/based_bwd.rs"]
mod based_bwd;
#[path = "gpu_sequence_mixers/delta.rs"]
mod delta;
#[path = "gpu_sequence_mixers/delta_bwd.rs"]
mod delta_bwd;
#[path = "gpu_sequence_mixers/large.rs"]
mod large;
#[path = "gpu_sequence_mixers/scan.rs"]
mod scan;
#[path = "common/spills.rs"]
mod spills;
#[path = "gpu_sequence_mixers/ssd_bwd.rs"]
mod ssd_bwd;

pub(crate) use spills::{compiles_without_spills, compiles_without_spills_on};

use std::sync::OnceLock;

use cudarc::driver::{CudaSlice, DeviceRepr};
use kernelpages::gpu::{self, Gpu};
use kernelpages::sequence_mixers::cuda::{tensor_core_path, Dtype, Ssd};
use kernelpages::sequence_mixers::reference::{self, SsdInputs, SsdShape};
use rand::{Rng, SeedableRng};

/// One device for the whole test binary, so the source compiles once.
pub(crate) fn gpu() -> &'static Gpu {
    static GPU: OnceLock<Gpu> = OnceLock::new();
    GPU.get_or_init(|| {
        if let Err(e) = gpu::detect() {
            panic!("{e}");
        }
        Gpu::open(0).expect("device opens")
    })
}

/// `v` on the device; an empty `v` as one element (the driver refuses a zero-byte
/// allocation; the launches accept one unread element where the shape wants none).
fn upload<T: DeviceRepr + Copy + Default>(v: &[T]) -> CudaSlice<T> {
    let g = gpu();
    if v.is_empty() {
        g.stream.clone_htod(&[T::default()]).unwrap()
    } else {
        g.stream.clone_htod(v).unwrap()
    }
}

pub(crate) fn uniform(n: usize, lo: f64, hi: f64, seed: u64) -> Vec<f64> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(lo..hi)).collect()
}

/// bf16 bits of `x`, rounded to nearest even (finite values).
pub(crate) fn bf16_bits(x: f64) -> u16 {
    half::bf16::from_f32(x as f32).to_bits()
}

pub(crate) fn bf16_value(b: u16) -> f64 {
    half::bf16::from_bits(b).to_f32() as f64
}

/// An element type of the mixers' X-like tensors on the device: float32, or bf16 as its bits.
pub(crate) trait Elem: DeviceRepr + Copy + Default {
    /// A NaN of this type, to poison outputs.
    const POISON: Self;
    /// `x` rounded to this type.
    fn from_f64(x: f64) -> Self;
    /// The value, exactly.
    fn to_f64(self) -> f64;
}

impl Elem for f32 {
    const POISON: f32 = f32::NAN;
    fn from_f64(x: f64) -> f32 {
        x as f32
    }
    fn to_f64(self) -> f64 {
        self as f64
    }
}

impl Elem for u16 {
    /// 0xFFFF is a NaN in bf16.
    const POISON: u16 = 0xFFFF;
    fn from_f64(x: f64) -> u16 {
        bf16_bits(x)
    }
    fn to_f64(self) -> f64 {
        bf16_value(self)
    }
}

/// `v` rounded to `T` on the device ([`upload`]).
pub(crate) fn up<T: Elem>(v: &[f64]) -> CudaSlice<T> {
    upload(&v.iter().map(|&x| T::from_f64(x)).collect::<Vec<T>>())
}

/// `n` poisoned elements on the device ([`upload`]).
pub(crate) fn poisoned<T: Elem>(n: usize) -> CudaSlice<T> {
    upload(&vec![T::POISON; n])
}

/// A device buffer's values.
pub(crate) fn down<T: Elem>(d: &CudaSlice<T>) -> Vec<f64> {
    gpu()
        .stream
        .clone_dtoh(d)
        .unwrap()
        .into_iter()
        .map(T::to_f64)
        .collect()
}

/// `v` as the device holds it in `dtype` (what the float64 reference must read).
pub(crate) fn rounded(dtype: Dtype, v: &[f64]) -> Vec<f64> {
    match dtype {
        Dtype::F32 => rounded_f32(v),
        Dtype::Bf16 => v.iter().map(|&x| bf16_value(bf16_bits(x))).collect(),
    }
}

/// `v` as the device holds it in float32.
pub(crate) fn rounded_f32(v: &[f64]) -> Vec<f64> {
    v.iter().map(|&x| x as f32 as f64).collect()
}

/// The larger of [`rel_l2`] over the whole output and over its last steps (the last 64, or
/// all of a shorter sequence) of every batch entry, for outputs laid out `[B, T, …]`: a tail
/// chunk computed wrong weighs only its share of a long sequence's whole-output error (one
/// wrong step in 65,537 passes a bf16 tolerance), so the tail is held to the same bound.
pub(crate) fn rel_l2_with_tail(got: &[f64], want: &[f64], batch: usize, seq_len: usize) -> f64 {
    let whole = rel_l2(got, want);
    if batch == 0 || seq_len == 0 || want.is_empty() {
        return whole;
    }
    let per_step = want.len() / (batch * seq_len);
    let tail = seq_len.min(64);
    let (mut g, mut w) = (Vec::new(), Vec::new());
    for b in 0..batch {
        let (start, end) = (
            (b * seq_len + seq_len - tail) * per_step,
            (b + 1) * seq_len * per_step,
        );
        g.extend_from_slice(&got[start..end]);
        w.extend_from_slice(&want[start..end]);
    }
    whole.max(rel_l2(&g, &w))
}

/// ‖got − want‖₂ / ‖want‖₂, NaN when any element of `got` is not finite.
pub(crate) fn rel_l2(got: &[f64], want: &[f64]) -> f64 {
    if got.iter().any(|x| !x.is_finite()) {
        return f64::NAN;
    }
    let num: f64 = got.iter().zip(want).map(|(a, b)| (a - b) * (a - b)).sum();
    let den: f64 = want.iter().map(|b| b * b).sum();
    (num / den.max(1e-300)).sqrt()
}

/// The largest error of the gradients `got` against `want` (in the order of `names`) and its
/// gradient's name: relative L2, or where `want` is exactly 0 (dA after one step from a zero
/// state) the largest absolute value, float32 rounding of terms that cancel; infinity for a
/// non-finite element.
pub(crate) fn worst_gradient_error<'a>(
    names: &[&'a str],
    got: &[Vec<f64>],
    want: &[Vec<f64>],
) -> (f64, &'a str) {
    let mut worst = (0.0f64, "none");
    for ((name, g), w) in names.iter().zip(got).zip(want) {
        let e = if w.iter().all(|&v| v == 0.0) {
            g.iter().fold(0.0f64, |m, v| m.max(v.abs()))
        } else {
            rel_l2(g, w)
        };
        let e = if e.is_nan() { f64::INFINITY } else { e };
        if e > worst.0 {
            worst = (e, name);
        }
    }
    worst
}

/// A backward's check against its float64 adjoint: `case(shape, dtype, optional, seed)` on
/// every shape, both dtypes, with and without the initial state and d_final_state
/// (`optional`), seeds `seed0 + 10 i` for shape i; prints each run's worst gradient
/// ([`worst_gradient_error`], labelled `label` and `states`) and asserts that none passes
/// `bound(shape, dtype)`, naming every failing run.
pub(crate) fn assert_backward_within<S: Copy + std::fmt::Debug>(
    label: &str,
    states: &str,
    names: &[&str],
    shapes: &[S],
    seed0: u64,
    bound: impl Fn(S, Dtype) -> f64,
    case: impl Fn(S, Dtype, bool, u64) -> (Vec<Vec<f64>>, Vec<Vec<f64>>),
) {
    let mut failures = Vec::new();
    for (i, &s) in shapes.iter().enumerate() {
        for dtype in [Dtype::F32, Dtype::Bf16] {
            for optional in [true, false] {
                let (got, want) = case(s, dtype, optional, seed0 + 10 * i as u64);
                let worst = worst_gradient_error(names, &got, &want);
                println!(
                    "{label} {s:?} {dtype:?} {states} {optional}: worst {} {:.2e}",
                    worst.1, worst.0
                );
                if worst.0 > bound(s, dtype) {
                    failures.push(format!(
                        "{s:?} {dtype:?} {optional}: {} {:.2e}",
                        worst.1, worst.0
                    ));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Asserts that two runs gave the same bits for every gradient (named by `names`).
pub(crate) fn assert_same_bits(names: &[&str], first: &[Vec<f64>], second: &[Vec<f64>]) {
    for ((name, a), b) in names.iter().zip(first).zip(second) {
        assert!(
            a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
            "{name} differs between runs"
        );
    }
}

/// `n` keys of width `kd` from [−1, 1) (`seed`), each scaled to L2 norm 1 as the layer
/// normalises them.
pub(crate) fn unit_keys(n: usize, kd: usize, seed: u64) -> Vec<f64> {
    let mut k = uniform(n * kd, -1.0, 1.0, seed);
    for row in k.chunks_mut(kd) {
        let norm = row.iter().map(|x| x * x).sum::<f64>().sqrt();
        row.iter_mut().for_each(|x| *x /= norm);
    }
    k
}

/// The SSD kernels compile ([`compiles_without_spills`]); runs in CI.
#[test]
#[cfg_attr(
    not(kp_nvrtc),
    ignore = "needs NVRTC 13 (libnvrtc.so.13) on the loader path; .ci/run installs it"
)]
fn ssd_kernels_compile_without_spills() {
    use kernelpages::sequence_mixers::cuda::{entry_points, source};
    compiles_without_spills("ssd.cu", &source(), &entry_points());
}

/// One SSD case on the device against the float64 recurrence on the same (rounded) inputs:
/// returns (error of Y, error of the final state).
fn ssd_case(shape: SsdShape, dtype: Dtype, skip: bool, start: bool, seed: u64) -> (f64, f64) {
    let g = gpu();
    let bt = shape.batch * shape.seq_len;
    let x = uniform(bt * shape.heads * shape.head_dim, -1.0, 1.0, seed);
    let dt = uniform(bt * shape.heads, 0.01, 0.2, seed + 1);
    let a = uniform(shape.heads, -4.0, -0.5, seed + 2);
    let b = uniform(bt * shape.groups * shape.state, -1.0, 1.0, seed + 3);
    let c = uniform(bt * shape.groups * shape.state, -1.0, 1.0, seed + 4);
    let d = uniform(shape.heads, -1.0, 1.0, seed + 5);
    let state_len = shape.batch * shape.heads * shape.head_dim * shape.state;
    let s0 = uniform(state_len, -1.0, 1.0, seed + 6);
    // The reference reads the values the device gets: float32 or bf16, and float32 Δ, A, D.
    let (xr, br, cr) = (rounded(dtype, &x), rounded(dtype, &b), rounded(dtype, &c));
    let (dtr, ar, dr, s0r) = (
        rounded_f32(&dt),
        rounded_f32(&a),
        rounded_f32(&d),
        rounded_f32(&s0),
    );
    let (y_ref, s_ref) = reference::ssd(
        shape,
        SsdInputs {
            x: &xr,
            dt: &dtr,
            a: &ar,
            b: &br,
            c: &cr,
            d: skip.then_some(&dr[..]),
            initial_state: start.then_some(&s0r[..]),
        },
    )
    .unwrap();
    let (dt_d, a_d, d_d, s0_d) = (up::<f32>(&dt), up::<f32>(&a), up::<f32>(&d), up::<f32>(&s0));
    let mut fin = poisoned::<f32>(state_len);
    let mut ssd = Ssd::new(g, shape, dtype).unwrap();
    // The dtype-typed tensors, launched and read back as `$t` (f32, or u16 holding bf16).
    macro_rules! run {
        ($t:ty) => {{
            let (x_d, b_d, c_d) = (up::<$t>(&x), up::<$t>(&b), up::<$t>(&c));
            let mut y_d = poisoned::<$t>(y_ref.len());
            ssd.launch(
                g,
                &x_d,
                &dt_d,
                &a_d,
                &b_d,
                &c_d,
                skip.then_some(&d_d),
                start.then_some(&s0_d),
                &mut y_d.as_view_mut(),
                &mut fin,
            )
            .unwrap();
            down(&y_d)
        }};
    }
    let y: Vec<f64> = match dtype {
        Dtype::F32 => run!(f32),
        Dtype::Bf16 => run!(u16),
    };
    let fin = down(&fin);
    (
        rel_l2_with_tail(&y, &y_ref, shape.batch, shape.seq_len),
        rel_l2(&fin, &s_ref),
    )
}

#[test]
#[cfg_attr(not(kp_cuda), ignore = "needs an NVIDIA GPU (libcuda.so.1)")]
fn ssd_matches_float64_on_every_shape() {
    let shape = |batch, seq_len, heads, head_dim, state, groups| SsdShape {
        batch,
        seq_len,
        heads,
        head_dim,
        state,
        groups,
    };
    let cases = [
        // One step, one partial chunk, exact chunks, and a partial last chunk.
        shape(1, 1, 1, 8, 4, 1),
        shape(2, 37, 4, 16, 8, 2),
        shape(2, 128, 4, 64, 64, 1),
        shape(1, 200, 8, 64, 128, 2),
        shape(1, 130, 2, 128, 128, 1),
        // Grouped B and C, one group per head.
        shape(1, 300, 6, 32, 16, 6),
        // Issue 12's lengths around the chunk of 64 and past 65,536 (a tail chunk once dropped
        // there by another library).
        shape(1, 63, 2, 16, 16, 1),
        shape(1, 65, 2, 16, 16, 1),
        shape(1, 65_537, 1, 16, 16, 1),
        // bf16 long enough for the tensor-core chunk states to walk 4 chunks per block
        // (`chunks_per_walk`: 2 · 8 · 258 chunks), the last walk 2 chunks.
        shape(2, 16_484, 8, 32, 32, 2),
    ];
    let mut failures = Vec::new();
    for (k, &s) in cases.iter().enumerate() {
        for dtype in [Dtype::F32, Dtype::Bf16] {
            for (skip, start) in [(false, false), (true, true)] {
                let (ey, es) = ssd_case(s, dtype, skip, start, 100 + k as u64);
                // float32 arithmetic on exact inputs: 1e-4 for the output and the state. bf16:
                // the output's rounding, 1e-2; the state 1e-4 from the float32 kernels, 1e-2
                // from the tensor-core ones (version 5, the cases `tensor_core_path` takes),
                // which round Δ·x, the chunk states and the products' operands to bf16 inside.
                let tol = if dtype == Dtype::F32 { 1e-4 } else { 1e-2 };
                let state_tol = if tensor_core_path(s, dtype).is_some() {
                    1e-2
                } else {
                    1e-4
                };
                println!("ssd {s:?} {dtype:?} D {skip} initial {start}: Y {ey:.2e} state {es:.2e}");
                if !(ey <= tol && es <= state_tol) {
                    failures.push(format!(
                        "{s:?} {dtype:?} D {skip} initial {start}: Y {ey:.2e}, state {es:.2e}"
                    ));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
#[cfg_attr(not(kp_cuda), ignore = "needs an NVIDIA GPU (libcuda.so.1)")]
fn ssd_with_no_step_returns_the_initial_state() {
    let s = SsdShape {
        batch: 1,
        seq_len: 0,
        heads: 2,
        head_dim: 4,
        state: 4,
        groups: 1,
    };
    let (_, es) = ssd_case(s, Dtype::F32, true, true, 7);
    assert_eq!(es, 0.0);
}

/// One wrong step at the end of 65,537 passes a 1e-2 bound on the whole output but not on the
/// tail (the check itself; runs without a GPU).
#[test]
fn the_tail_check_catches_a_wrong_last_step() {
    let (batch, seq_len, per_step) = (1, 65_537, 4);
    let want: Vec<f64> = (0..batch * seq_len * per_step)
        .map(|i| 1.0 + (i % 7) as f64)
        .collect();
    let mut got = want.clone();
    let n = got.len();
    got[n - per_step..].iter_mut().for_each(|v| *v *= 2.0);
    assert!(rel_l2(&got, &want) < 1e-2);
    assert!(rel_l2_with_tail(&got, &want, batch, seq_len) > 1e-2);
    assert_eq!(rel_l2_with_tail(&want, &want, batch, seq_len), 0.0);
}
