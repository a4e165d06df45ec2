//! The entry points a user calls, one per mixer, with host float32 tensors in and out on the
//! CPU or a CUDA device: [`ssd`] (Mamba-2), [`selective_scan`] (Mamba-1), [`gated_delta_rule`]
//! (Gated DeltaNet) and [`based`] (linear attention with a sliding-window softmax). Each takes
//! an optional initial state and returns the final state beside the output, so that a long
//! sequence can be processed in pieces (chunked inference): running two halves back to back,
//! the second from the first's final state, gives the output of one run over the whole.
//!
//! What runs:
//! - **CPU**: SSD and the selective scan run the float32 recurrence of [`super::cpu`] on
//!   rayon's threads; the gated delta rule and Based have no CPU implementation (their
//!   float64 definitions are [`super::reference::gated_delta_rule`] and
//!   [`super::reference::based`]) and answer [`MixerError::Unsupported`].
//! - **CUDA**: the float32 kernels ([`super::cuda::Ssd`], [`super::scan_cuda::Scan`],
//!   [`super::delta_cuda::GatedDelta`], [`super::based_cuda::Based`]); bf16 inputs are reached
//!   through those types directly. Host tensors go to the device and back on every call: a loop
//!   over device buffers should keep the kernel object instead.
//!
//! Layouts are those of the float64 references in [`super::reference`].

use cudarc::driver::CudaSlice;

use super::based_cuda::Based;
use super::cpu::{scan_f32, ssd_f32, ScanArgs, SsdArgs};
use super::cuda::{Dtype, Ssd};
use super::delta_cuda::GatedDelta;
use super::reference::{BasedShape, DeltaShape, ScanShape, SsdShape};
use super::scan_cuda::Scan;
use crate::gpu::{Device, Gpu, GpuError};

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
pub enum MixerError {
    /// A shape or a tensor length that does not fit the call (the message names the tensor).
    #[error("{0}")]
    Invalid(String),
    /// No implementation on this device computes the call; the message says why.
    #[error("{0}")]
    Unsupported(String),
    /// A compile, launch or out-of-memory error on the device.
    #[error(transparent)]
    Gpu(#[from] GpuError),
}

impl From<cudarc::driver::DriverError> for MixerError {
    fn from(e: cudarc::driver::DriverError) -> MixerError {
        MixerError::Gpu(e.into())
    }
}

/// A mixer's results: the output and the state after the last step (float32).
#[derive(Clone, Debug, PartialEq)]
pub struct MixerOutput {
    /// Y or O, laid out as the function says.
    pub y: Vec<f32>,
    /// The state after the last step, laid out as the initial state.
    pub final_state: Vec<f32>,
}

/// Checks each `(name, length, expected)`; the error names the first tensor that is off.
fn lengths(function: &str, checks: &[(&str, usize, usize)]) -> Result<(), MixerError> {
    for &(name, got, want) in checks {
        if got != want {
            return Err(MixerError::Invalid(format!(
                "{function}: {name} has {got} elements; the shape needs {want}"
            )));
        }
    }
    Ok(())
}

/// Reads back a launch's output (the first `len` elements of `y`) and final state.
fn download(
    gpu: &Gpu,
    y: &CudaSlice<f32>,
    len: usize,
    final_state: &CudaSlice<f32>,
) -> Result<MixerOutput, MixerError> {
    let mut y = gpu.stream.clone_dtoh(y)?;
    y.truncate(len);
    Ok(MixerOutput {
        y,
        final_state: gpu.stream.clone_dtoh(final_state)?,
    })
}

/// Uploads an optional host tensor.
fn upload_opt(gpu: &Gpu, x: Option<&[f32]>) -> Result<Option<CudaSlice<f32>>, MixerError> {
    Ok(match x {
        Some(x) => Some(gpu.stream.clone_htod(x)?),
        None => None,
    })
}

/// SSD, the state-space dual layer of Mamba-2 (Dao and Gu, 2024, "Transformers are SSMs"):
/// for each batch entry and head h, with a scalar decay per head,
/// S_t = exp(Δ_t·A_h)·S_{t−1} + Δ_t·x_t·B_tᵀ and y_t = S_t·C_t + D_h·x_t, B and C shared by
/// the heads of a group. X `[B, T, H, P]`, Δ `[B, T, H]` (after the softplus), A `[H]`, B and C
/// `[B, T, G, N]`, D `[H]` or none, the initial state `[B, H, P, N]` or zeros; returns Y
/// `[B, T, H, P]` and the final state `[B, H, P, N]`, float32.
///
/// # Errors
/// [`MixerError::Invalid`] for an empty dimension, heads not a multiple of groups or a tensor of
/// the wrong length; [`MixerError::Gpu`] from the device.
pub fn ssd(device: Device, shape: SsdShape, args: SsdArgs) -> Result<MixerOutput, MixerError> {
    let s = shape;
    if s.batch == 0 || s.heads == 0 || s.head_dim == 0 || s.state == 0 || s.groups == 0 {
        return Err(MixerError::Invalid(format!(
            "ssd: empty dimension in {s:?}"
        )));
    }
    if !s.heads.is_multiple_of(s.groups) {
        return Err(MixerError::Invalid(format!(
            "ssd: {} heads are not a multiple of {} groups",
            s.heads, s.groups
        )));
    }
    let bt = s.batch * s.seq_len;
    let state_len = s.batch * s.heads * s.head_dim * s.state;
    let mut checks = vec![
        ("x", args.x.len(), bt * s.heads * s.head_dim),
        ("dt", args.dt.len(), bt * s.heads),
        ("a", args.a.len(), s.heads),
        ("b", args.b.len(), bt * s.groups * s.state),
        ("c", args.c.len(), bt * s.groups * s.state),
    ];
    if let Some(d) = args.d {
        checks.push(("d", d.len(), s.heads));
    }
    if let Some(s0) = args.initial_state {
        checks.push(("initial_state", s0.len(), state_len));
    }
    lengths("ssd", &checks)?;
    let mut y = vec![0.0f32; bt * s.heads * s.head_dim];
    match device {
        Device::Cpu => {
            let final_state = ssd_f32(shape, &args, &mut y);
            Ok(MixerOutput { y, final_state })
        }
        Device::Cuda(gpu) => {
            let mut k = Ssd::new(gpu, shape, Dtype::F32)?;
            let st = &gpu.stream;
            let (x, dt, a) = (
                st.clone_htod(args.x)?,
                st.clone_htod(args.dt)?,
                st.clone_htod(args.a)?,
            );
            let (b, c) = (st.clone_htod(args.b)?, st.clone_htod(args.c)?);
            let (d, s0) = (
                upload_opt(gpu, args.d)?,
                upload_opt(gpu, args.initial_state)?,
            );
            let mut y_dev = st.alloc_zeros::<f32>(y.len().max(1))?;
            let mut fs = st.alloc_zeros::<f32>(state_len)?;
            k.launch(
                gpu,
                &x,
                &dt,
                &a,
                &b,
                &c,
                d.as_ref(),
                s0.as_ref(),
                &mut y_dev.as_view_mut(),
                &mut fs,
            )?;
            download(gpu, &y_dev, y.len(), &fs)
        }
    }
}

/// Mamba's selective scan (Gu and Dao, 2023, "Mamba: Linear-Time Sequence Modeling with
/// Selective State Spaces"): for each batch entry and channel d, with a diagonal A per
/// channel, h_t = exp(Δ_t·A_d) ⊙ h_{t−1} + Δ_t·u_t·B_t and y_t = h_t·C_t + D_d·u_t. u and Δ
/// `[B, T, D]` (Δ after the softplus), A `[D, N]`, B and C `[B, T, N]`, D `[D]` or none, the
/// initial state `[B, D, N]` or zeros; returns y `[B, T, D]` and the final state `[B, D, N]`,
/// float32.
///
/// # Errors
/// As [`ssd`].
pub fn selective_scan(
    device: Device,
    shape: ScanShape,
    args: ScanArgs,
) -> Result<MixerOutput, MixerError> {
    let s = shape;
    if s.batch == 0 || s.channels == 0 || s.state == 0 {
        return Err(MixerError::Invalid(format!(
            "selective_scan: empty dimension in {s:?}"
        )));
    }
    let bt = s.batch * s.seq_len;
    let state_len = s.batch * s.channels * s.state;
    let mut checks = vec![
        ("u", args.u.len(), bt * s.channels),
        ("delta", args.delta.len(), bt * s.channels),
        ("a", args.a.len(), s.channels * s.state),
        ("b", args.b.len(), bt * s.state),
        ("c", args.c.len(), bt * s.state),
    ];
    if let Some(d) = args.d {
        checks.push(("d", d.len(), s.channels));
    }
    if let Some(s0) = args.initial_state {
        checks.push(("initial_state", s0.len(), state_len));
    }
    lengths("selective_scan", &checks)?;
    let mut y = vec![0.0f32; bt * s.channels];
    match device {
        Device::Cpu => {
            let final_state = scan_f32(shape, &args, &mut y);
            Ok(MixerOutput { y, final_state })
        }
        Device::Cuda(gpu) => {
            let mut k = Scan::new(gpu, shape, Dtype::F32)?;
            let st = &gpu.stream;
            let (u, delta, a) = (
                st.clone_htod(args.u)?,
                st.clone_htod(args.delta)?,
                st.clone_htod(args.a)?,
            );
            let (b, c) = (st.clone_htod(args.b)?, st.clone_htod(args.c)?);
            let (d, s0) = (
                upload_opt(gpu, args.d)?,
                upload_opt(gpu, args.initial_state)?,
            );
            let mut y_dev = st.alloc_zeros::<f32>(y.len().max(1))?;
            let mut fs = st.alloc_zeros::<f32>(state_len)?;
            k.launch(
                gpu,
                &u,
                &delta,
                &a,
                &b,
                &c,
                d.as_ref(),
                s0.as_ref(),
                &mut y_dev.as_view_mut(),
                &mut fs,
            )?;
            download(gpu, &y_dev, y.len(), &fs)
        }
    }
}

/// The float32 inputs of [`gated_delta_rule`], laid out as
/// [`super::reference::DeltaInputs`].
#[derive(Clone, Copy, Debug)]
pub struct DeltaArgs<'a> {
    /// Queries, `[B, T, H, K]`.
    pub q: &'a [f32],
    /// Keys, `[B, T, H, K]`, L2-normalised by the caller.
    pub k: &'a [f32],
    /// Values, `[B, T, H, V]`.
    pub v: &'a [f32],
    /// The gate α (the state's decay, in (0, 1]), `[B, T, H]`.
    pub alpha: &'a [f32],
    /// The write strength β, `[B, T, H]`.
    pub beta: &'a [f32],
    /// The state before the first step, `[B, H, V, K]` (value-major), or zeros.
    pub initial_state: Option<&'a [f32]>,
}

/// The gated delta rule of Gated DeltaNet (Yang, Kautz and Hatamizadeh, 2024, "Gated Delta
/// Networks: Improving Mamba2 with Delta Rule"): for each batch entry and head,
/// S_t = α_t·S_{t−1}·(I − β_t·k_t·k_tᵀ) + β_t·v_t·k_tᵀ and o_t = S_t·q_t, on CUDA in its
/// chunked WY form. Returns O `[B, T, H, V]` and the final state `[B, H, V, K]`, float32.
///
/// # Errors
/// As [`ssd`]; [`MixerError::Unsupported`] on the CPU (the float64 definition is
/// [`super::reference::gated_delta_rule`]).
pub fn gated_delta_rule(
    device: Device,
    shape: DeltaShape,
    args: DeltaArgs,
) -> Result<MixerOutput, MixerError> {
    let s = shape;
    if s.batch == 0 || s.heads == 0 || s.key_dim == 0 || s.value_dim == 0 {
        return Err(MixerError::Invalid(format!(
            "gated_delta_rule: empty dimension in {s:?}"
        )));
    }
    let n = s.batch * s.seq_len * s.heads;
    let state_len = s.batch * s.heads * s.value_dim * s.key_dim;
    let mut checks = vec![
        ("q", args.q.len(), n * s.key_dim),
        ("k", args.k.len(), n * s.key_dim),
        ("v", args.v.len(), n * s.value_dim),
        ("alpha", args.alpha.len(), n),
        ("beta", args.beta.len(), n),
    ];
    if let Some(s0) = args.initial_state {
        checks.push(("initial_state", s0.len(), state_len));
    }
    lengths("gated_delta_rule", &checks)?;
    if let Some(i) = args.alpha.iter().position(|&a| !(a > 0.0 && a <= 1.0)) {
        return Err(MixerError::Invalid(format!(
            "gated_delta_rule: alpha[{i}] = {} is not in (0, 1]",
            args.alpha[i]
        )));
    }
    let gpu = match device {
        Device::Cpu => return Err(MixerError::Unsupported(
            "gated_delta_rule: no CPU implementation (the CPU runs SSD and the selective scan); \
                 sequence_mixers::reference::gated_delta_rule computes it in float64"
                .into(),
        )),
        Device::Cuda(gpu) => gpu,
    };
    let mut kern = GatedDelta::new(gpu, shape, Dtype::F32)?;
    let st = &gpu.stream;
    let (q, k, v) = (
        st.clone_htod(args.q)?,
        st.clone_htod(args.k)?,
        st.clone_htod(args.v)?,
    );
    let (alpha, beta) = (st.clone_htod(args.alpha)?, st.clone_htod(args.beta)?);
    let s0 = upload_opt(gpu, args.initial_state)?;
    let o_len = n * s.value_dim;
    let mut o = st.alloc_zeros::<f32>(o_len.max(1))?;
    let mut fs = st.alloc_zeros::<f32>(state_len)?;
    kern.launch(
        gpu,
        &q,
        &k,
        &v,
        &alpha,
        &beta,
        s0.as_ref(),
        &mut o.as_view_mut(),
        &mut fs,
    )?;
    download(gpu, &o, o_len, &fs)
}

/// Based (Arora et al., 2024, "Simple linear attention language models balance the
/// recall-throughput tradeoff"): causal linear attention plus exact softmax attention over the
/// last W keys, summed, as [`super::reference::based`] defines it. q and k `[B, T, H, K]`
/// (through the caller's feature map), v `[B, T, H, V]`, the factor on both branches' scores,
/// and the initial linear state `[B, H, V, K]` or zeros; returns O `[B, T, H, V]` and the final
/// linear state, float32. The window's cache of recent keys and values is neither taken nor
/// returned: a second piece starts with an empty window, so two halves equal one run only for
/// the linear branch; [`based_with_state`] carries the cache too.
///
/// # Errors
/// As [`gated_delta_rule`].
#[allow(clippy::too_many_arguments)]
pub fn based(
    device: Device,
    shape: BasedShape,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    scale: f32,
    initial_linear_state: Option<&[f32]>,
) -> Result<MixerOutput, MixerError> {
    let s = shape;
    if s.batch == 0 || s.heads == 0 || s.key_dim == 0 || s.value_dim == 0 || s.window == 0 {
        return Err(MixerError::Invalid(format!(
            "based: empty dimension in {s:?}"
        )));
    }
    let n = s.batch * s.seq_len * s.heads;
    let state_len = s.batch * s.heads * s.value_dim * s.key_dim;
    let mut checks = vec![
        ("q", q.len(), n * s.key_dim),
        ("k", k.len(), n * s.key_dim),
        ("v", v.len(), n * s.value_dim),
    ];
    if let Some(s0) = initial_linear_state {
        checks.push(("initial_linear_state", s0.len(), state_len));
    }
    lengths("based", &checks)?;
    let gpu = match device {
        Device::Cpu => {
            return Err(MixerError::Unsupported(
                "based: no CPU implementation (the CPU runs SSD and the selective scan); \
                 sequence_mixers::reference::based computes it in float64"
                    .into(),
            ))
        }
        Device::Cuda(gpu) => gpu,
    };
    let mut kern = Based::new(gpu, shape, Dtype::F32)?;
    let st = &gpu.stream;
    let (qd, kd, vd) = (st.clone_htod(q)?, st.clone_htod(k)?, st.clone_htod(v)?);
    let s0 = upload_opt(gpu, initial_linear_state)?;
    let o_len = n * s.value_dim;
    let mut o = st.alloc_zeros::<f32>(o_len.max(1))?;
    let mut fs = st.alloc_zeros::<f32>(state_len)?;
    kern.launch(
        gpu,
        &qd,
        &kd,
        &vd,
        scale,
        s0.as_ref(),
        &mut o.as_view_mut(),
        &mut fs,
    )?;
    download(gpu, &o, o_len, &fs)
}

/// `x` widened to float64 (the references' element type).
fn widen(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| v as f64).collect()
}

/// `x`, if given, widened to float64.
fn widen_opt(x: Option<&[f32]>) -> Option<Vec<f64>> {
    x.map(widen)
}

/// The float64 reference ([`super::reference::ssd`]) of [`ssd`] on the same float32
/// arguments: Y `[B, T, H, P]` and the final state `[B, H, P, N]`, to check a result against.
///
/// # Errors
/// The reference's message for lengths that do not fit `shape`.
pub fn ssd_reference(shape: SsdShape, args: SsdArgs) -> Result<(Vec<f64>, Vec<f64>), String> {
    let (x, dt, a, b, c) = (
        widen(args.x),
        widen(args.dt),
        widen(args.a),
        widen(args.b),
        widen(args.c),
    );
    let (d, s0) = (widen_opt(args.d), widen_opt(args.initial_state));
    super::reference::ssd(
        shape,
        super::reference::SsdInputs {
            x: &x,
            dt: &dt,
            a: &a,
            b: &b,
            c: &c,
            d: d.as_deref(),
            initial_state: s0.as_deref(),
        },
    )
}

/// The float64 reference ([`super::reference::selective_scan`]) of [`selective_scan`] on the
/// same float32 arguments: y `[B, T, D]` and the final state `[B, D, N]`.
///
/// # Errors
/// The reference's message for lengths that do not fit `shape`.
pub fn selective_scan_reference(
    shape: ScanShape,
    args: ScanArgs,
) -> Result<(Vec<f64>, Vec<f64>), String> {
    let (u, delta, a, b, c) = (
        widen(args.u),
        widen(args.delta),
        widen(args.a),
        widen(args.b),
        widen(args.c),
    );
    let (d, s0) = (widen_opt(args.d), widen_opt(args.initial_state));
    super::reference::selective_scan(
        shape,
        super::reference::ScanInputs {
            u: &u,
            delta: &delta,
            a: &a,
            b: &b,
            c: &c,
            d: d.as_deref(),
            initial_state: s0.as_deref(),
        },
    )
}

/// The float64 reference ([`super::reference::gated_delta_rule`]) of [`gated_delta_rule`] on
/// the same float32 arguments: O `[B, T, H, V]` and the final state `[B, H, V, K]`.
///
/// # Errors
/// The reference's message for lengths that do not fit `shape`.
pub fn gated_delta_rule_reference(
    shape: DeltaShape,
    args: DeltaArgs,
) -> Result<(Vec<f64>, Vec<f64>), String> {
    let (q, k, v, alpha, beta) = (
        widen(args.q),
        widen(args.k),
        widen(args.v),
        widen(args.alpha),
        widen(args.beta),
    );
    let s0 = widen_opt(args.initial_state);
    super::reference::gated_delta_rule(
        shape,
        super::reference::DeltaInputs {
            q: &q,
            k: &k,
            v: &v,
            alpha: &alpha,
            beta: &beta,
            initial_state: s0.as_deref(),
        },
    )
}

/// What [`based_with_state`] carries from one call to the next, float32, laid out as
/// [`super::reference::BasedState`]: the linear state S `[B, H, V, K]` and the last `cached`
/// keys `[B, H, cached, K]` and values `[B, H, cached, V]` of each batch entry and head, oldest
/// first (at most W − 1: the softmax window's cache).
pub type BasedStreamState = super::reference::BasedState<f32>;

/// [`based`] with its whole state carried: the linear state and the softmax window's cache of
/// up to W − 1 recent keys and values, in and out, so that a sequence run in pieces (chunked
/// inference), each piece given the previous one's state, equals one run over the whole
/// sequence, both branches included. Shapes and the formula as [`based`] and
/// [`super::reference::based`]; `initial` `None` is the empty state. Returns O `[B, T, H, V]`
/// and the state after the last step (`cached` = min(W − 1, initial cached + T)).
///
/// How: the cached steps are put in front of the piece (their queries 0, their outputs
/// dropped), and the linear state handed to the kernel is the initial one less the cached
/// steps' v kᵀ (summed in float64), which the kernel adds back; the new cache is the last
/// steps of keys and values. The subtraction costs float32 rounding of the state's size, as
/// any chunked sum does.
///
/// # Errors
/// As [`based`]; [`MixerError::Invalid`] for a state whose lengths do not fit `shape` or
/// `cached`, or that caches W or more steps.
#[allow(clippy::too_many_arguments)]
pub fn based_with_state(
    device: Device,
    shape: BasedShape,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    scale: f32,
    initial: Option<&BasedStreamState>,
) -> Result<(Vec<f32>, BasedStreamState), MixerError> {
    based_pieces(shape, q, k, v, initial, |sh, q2, k2, v2, s0| {
        based(device, sh, q2, k2, v2, scale, Some(s0)).map(|o| (o.y, o.final_state))
    })
}

/// [`based_with_state`]'s rearrangement around `run` (shape, q, k, v, initial linear state →
/// O and the final linear state), so that a test can run it on the float64 reference.
fn based_pieces(
    shape: BasedShape,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    initial: Option<&BasedStreamState>,
    run: impl FnOnce(
        BasedShape,
        &[f32],
        &[f32],
        &[f32],
        &[f32],
    ) -> Result<(Vec<f32>, Vec<f32>), MixerError>,
) -> Result<(Vec<f32>, BasedStreamState), MixerError> {
    let BasedShape {
        batch: b,
        seq_len: t,
        heads: h,
        key_dim: kd,
        value_dim: vd,
        window,
    } = shape;
    if b == 0 || h == 0 || kd == 0 || vd == 0 || window == 0 {
        return Err(MixerError::Invalid(format!(
            "based_with_state: empty dimension in {shape:?}"
        )));
    }
    let state_len = b * h * vd * kd;
    let zeros;
    let st = match initial {
        Some(st) => st,
        None => {
            zeros = BasedStreamState {
                s: vec![0.0; state_len],
                keys: Vec::new(),
                values: Vec::new(),
                cached: 0,
            };
            &zeros
        }
    };
    let c0 = st.cached;
    if c0 >= window {
        return Err(MixerError::Invalid(format!(
            "based_with_state: the state caches {c0} steps, at most window − 1 = {} fit",
            window - 1
        )));
    }
    let n = b * t * h;
    lengths(
        "based_with_state",
        &[
            ("q", q.len(), n * kd),
            ("k", k.len(), n * kd),
            ("v", v.len(), n * vd),
            ("state.s", st.s.len(), state_len),
            ("state.keys", st.keys.len(), b * h * c0 * kd),
            ("state.values", st.values.len(), b * h * c0 * vd),
        ],
    )?;
    // The piece with the cached steps in front: [B, c0 + T, H, ·].
    let t2 = c0 + t;
    let (mut q2, mut k2, mut v2) = (
        vec![0.0f32; b * t2 * h * kd],
        vec![0.0f32; b * t2 * h * kd],
        vec![0.0f32; b * t2 * h * vd],
    );
    let mut s0 = st.s.clone();
    for bi in 0..b {
        for hi in 0..h {
            let bh = bi * h + hi;
            let mut sum = vec![0.0f64; vd * kd];
            for step in 0..c0 {
                let ck = &st.keys[(bh * c0 + step) * kd..][..kd];
                let cv = &st.values[(bh * c0 + step) * vd..][..vd];
                k2[((bi * t2 + step) * h + hi) * kd..][..kd].copy_from_slice(ck);
                v2[((bi * t2 + step) * h + hi) * vd..][..vd].copy_from_slice(cv);
                for (vi, &x) in cv.iter().enumerate() {
                    for (ki, &y) in ck.iter().enumerate() {
                        sum[vi * kd + ki] += x as f64 * y as f64;
                    }
                }
            }
            for (s, d) in s0[bh * vd * kd..][..vd * kd].iter_mut().zip(&sum) {
                *s = (*s as f64 - d) as f32;
            }
            for step in 0..t {
                let (from, to) = ((bi * t + step) * h + hi, (bi * t2 + c0 + step) * h + hi);
                q2[to * kd..][..kd].copy_from_slice(&q[from * kd..][..kd]);
                k2[to * kd..][..kd].copy_from_slice(&k[from * kd..][..kd]);
                v2[to * vd..][..vd].copy_from_slice(&v[from * vd..][..vd]);
            }
        }
    }
    let (y2, s_final) = run(
        BasedShape {
            seq_len: t2,
            ..shape
        },
        &q2,
        &k2,
        &v2,
        &s0,
    )?;
    // The piece's own outputs, and the last c1 steps as the next cache.
    let c1 = t2.min(window - 1);
    let mut y = vec![0.0f32; n * vd];
    let mut keys = vec![0.0f32; b * h * c1 * kd];
    let mut values = vec![0.0f32; b * h * c1 * vd];
    for bi in 0..b {
        for hi in 0..h {
            for step in 0..t {
                let (from, to) = ((bi * t2 + c0 + step) * h + hi, (bi * t + step) * h + hi);
                y[to * vd..][..vd].copy_from_slice(&y2[from * vd..][..vd]);
            }
            let bh = bi * h + hi;
            for j in 0..c1 {
                let from = (bi * t2 + t2 - c1 + j) * h + hi;
                keys[(bh * c1 + j) * kd..][..kd].copy_from_slice(&k2[from * kd..][..kd]);
                values[(bh * c1 + j) * vd..][..vd].copy_from_slice(&v2[from * vd..][..vd]);
            }
        }
    }
    Ok((
        y,
        BasedStreamState {
            s: s_final,
            keys,
            values,
            cached: c1,
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sequence_mixers::reference;

    /// Deterministic values in [lo, hi).
    fn draw(n: usize, seed: u64, lo: f32, hi: f32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                lo + (hi - lo) * ((s >> 40) as f32 / (1u64 << 24) as f32)
            })
            .collect()
    }

    /// `based_with_state`'s rearrangement on the float64 reference: a sequence in two pieces,
    /// each given the previous one's state, equals one run, the softmax window included
    /// (pieces shorter and longer than the window's cache), and the state matches the
    /// reference's; a state caching W steps is refused.
    #[test]
    fn based_in_pieces_equals_one_run() {
        let sh = BasedShape {
            batch: 2,
            seq_len: 13,
            heads: 2,
            key_dim: 4,
            value_dim: 3,
            window: 5,
        };
        let reference_run = |sh: BasedShape, q: &[f32], k: &[f32], v: &[f32], s0: &[f32]| {
            let init = reference::BasedState {
                s: widen(s0),
                ..reference::BasedState::zeros(sh)
            };
            let (qw, kw, vw) = (widen(q), widen(k), widen(v));
            let (o, st) = reference::based(
                sh,
                reference::BasedInputs {
                    q: &qw,
                    k: &kw,
                    v: &vw,
                    scale: 0.5,
                    initial_state: Some(&init),
                },
            )
            .map_err(MixerError::Invalid)?;
            let narrow = |x: &[f64]| x.iter().map(|&v| v as f32).collect::<Vec<f32>>();
            Ok((narrow(&o), narrow(&st.s)))
        };
        let per_step = |dim: usize| sh.heads * dim;
        let (q, k, v) = (
            draw(2 * 13 * per_step(4), 1, 0.0, 1.0),
            draw(2 * 13 * per_step(4), 2, 0.0, 1.0),
            draw(2 * 13 * per_step(3), 3, -1.0, 1.0),
        );
        let (whole, whole_state) = reference_run(sh, &q, &k, &v, &[0.0; 2 * 2 * 3 * 4]).unwrap();
        // Steps [from, to) of every batch entry.
        let part = |x: &[f32], dim: usize, from: usize, to: usize| -> Vec<f32> {
            (0..sh.batch)
                .flat_map(|b| {
                    x[(b * 13 + from) * per_step(dim)..(b * 13 + to) * per_step(dim)].to_vec()
                })
                .collect()
        };
        for split in [2, 6, 11] {
            let first = BasedShape {
                seq_len: split,
                ..sh
            };
            let second = BasedShape {
                seq_len: 13 - split,
                ..sh
            };
            let (y1, st1) = based_pieces(
                first,
                &part(&q, 4, 0, split),
                &part(&k, 4, 0, split),
                &part(&v, 3, 0, split),
                None,
                reference_run,
            )
            .unwrap();
            assert_eq!(st1.cached, split.min(4));
            let (y2, st2) = based_pieces(
                second,
                &part(&q, 4, split, 13),
                &part(&k, 4, split, 13),
                &part(&v, 3, split, 13),
                Some(&st1),
                reference_run,
            )
            .unwrap();
            assert_eq!(st2.cached, 4);
            let mut y = Vec::new();
            for b in 0..sh.batch {
                y.extend_from_slice(&y1[b * split * per_step(3)..][..split * per_step(3)]);
                y.extend_from_slice(
                    &y2[b * (13 - split) * per_step(3)..][..(13 - split) * per_step(3)],
                );
            }
            let err = rel(&y, &widen(&whole));
            assert!(err < 1e-6, "split {split}: {err}");
            let err = rel(&st2.s, &widen(&whole_state));
            assert!(err < 1e-6, "split {split}: state {err}");
            // The cache is the last 4 steps' keys, [B, H, 4, K].
            let (bi, hi, j) = (1, 1, 3);
            assert_eq!(
                st2.keys[((bi * 2 + hi) * 4 + j) * 4..][..4],
                k[((bi * 13 + 12) * 2 + hi) * 4..][..4]
            );
        }
        let full = BasedStreamState {
            s: vec![0.0; 2 * 2 * 3 * 4],
            keys: vec![0.0; 2 * 2 * 5 * 4],
            values: vec![0.0; 2 * 2 * 5 * 3],
            cached: 5,
        };
        let e = based_pieces(sh, &q, &k, &v, Some(&full), reference_run).unwrap_err();
        assert!(e.to_string().contains("at most window − 1 = 4"), "{e}");
    }

    fn rel(a: &[f32], b: &[f64]) -> f64 {
        let num: f64 = a.iter().zip(b).map(|(&x, y)| (x as f64 - y).powi(2)).sum();
        let den: f64 = b.iter().map(|y| y * y).sum();
        (num / den).sqrt()
    }

    /// SSD on the CPU with an initial state: Y and the final state match float64, and two
    /// halves back to back (the second from the first's final state) give the whole run.
    #[test]
    fn ssd_carries_its_state_and_halves_equal_the_whole() {
        let shape = SsdShape {
            batch: 2,
            seq_len: 40,
            heads: 4,
            head_dim: 6,
            state: 12,
            groups: 2,
        };
        let bt = shape.batch * shape.seq_len;
        let x = draw(bt * 4 * 6, 1, -1.0, 1.0);
        let dt = draw(bt * 4, 2, 0.01, 0.2);
        let a = draw(4, 3, -2.0, -0.5);
        let b = draw(bt * 2 * 12, 4, -1.0, 1.0);
        let c = draw(bt * 2 * 12, 5, -1.0, 1.0);
        let d = draw(4, 6, -1.0, 1.0);
        let s0 = draw(2 * 4 * 6 * 12, 7, -1.0, 1.0);
        let args = SsdArgs {
            x: &x,
            dt: &dt,
            a: &a,
            b: &b,
            c: &c,
            d: Some(&d),
            initial_state: Some(&s0),
        };
        let got = ssd(Device::Cpu, shape, args).unwrap();
        let (want_y, want_s) = ssd_reference(shape, args).unwrap();
        assert!(rel(&got.y, &want_y) < 1e-5, "{}", rel(&got.y, &want_y));
        assert!(rel(&got.final_state, &want_s) < 1e-5);
        // Batch 1 in two halves of 20 steps.
        let one = SsdShape { batch: 1, ..shape };
        let half = SsdShape { seq_len: 20, ..one };
        let step = |from: usize, to: usize, per: usize, v: &[f32]| v[from * per..to * per].to_vec();
        let run = |sh: SsdShape, t0: usize, t1: usize, s: Option<&[f32]>| {
            let (x1, dt1, b1, c1) = (
                step(t0, t1, 4 * 6, &x),
                step(t0, t1, 4, &dt),
                step(t0, t1, 2 * 12, &b),
                step(t0, t1, 2 * 12, &c),
            );
            ssd(
                Device::Cpu,
                sh,
                SsdArgs {
                    x: &x1,
                    dt: &dt1,
                    a: &a,
                    b: &b1,
                    c: &c1,
                    d: Some(&d),
                    initial_state: s,
                },
            )
            .unwrap()
        };
        let whole = run(one, 0, 40, None);
        let first = run(half, 0, 20, None);
        let second = run(half, 20, 40, Some(&first.final_state));
        let joined: Vec<f32> = first.y.iter().chain(&second.y).copied().collect();
        let close = |a: &[f32], b: &[f32]| {
            a.len() == b.len()
                && a.iter()
                    .zip(b)
                    .all(|(x, y)| (x - y).abs() <= 1e-5 * (1.0 + y.abs()))
        };
        assert!(close(&joined, &whole.y));
        assert!(close(&second.final_state, &whole.final_state));
    }

    /// The selective scan on the CPU with an initial state and without D matches float64.
    #[test]
    fn selective_scan_matches_float64_with_an_initial_state() {
        // 37 channels: a partial block of SCAN_BLOCK.
        let shape = ScanShape {
            batch: 2,
            seq_len: 30,
            channels: 37,
            state: 12,
        };
        let bt = shape.batch * shape.seq_len;
        let u = draw(bt * 37, 11, -1.0, 1.0);
        let delta = draw(bt * 37, 12, 0.01, 0.2);
        let a = draw(37 * 12, 13, -2.0, -0.5);
        let b = draw(bt * 12, 14, -1.0, 1.0);
        let c = draw(bt * 12, 15, -1.0, 1.0);
        let s0 = draw(2 * 37 * 12, 16, -1.0, 1.0);
        let args = ScanArgs {
            u: &u,
            delta: &delta,
            a: &a,
            b: &b,
            c: &c,
            d: None,
            initial_state: Some(&s0),
        };
        let got = selective_scan(Device::Cpu, shape, args).unwrap();
        let (want_y, want_s) = selective_scan_reference(shape, args).unwrap();
        assert!(rel(&got.y, &want_y) < 1e-5, "{}", rel(&got.y, &want_y));
        assert!(rel(&got.final_state, &want_s) < 1e-5);
    }

    /// Bad lengths name the tensor; the mixers without a CPU implementation say so.
    #[test]
    fn bad_inputs_and_the_cpu_gaps_are_clear_errors() {
        let shape = ScanShape {
            batch: 1,
            seq_len: 4,
            channels: 2,
            state: 3,
        };
        let z = vec![0.0f32; 64];
        let e = selective_scan(
            Device::Cpu,
            shape,
            ScanArgs {
                u: &z[..8],
                delta: &z[..8],
                a: &z[..5],
                b: &z[..12],
                c: &z[..12],
                d: None,
                initial_state: None,
            },
        )
        .unwrap_err();
        assert!(e.to_string().contains("a has 5 elements"), "{e}");
        let dshape = DeltaShape {
            batch: 1,
            seq_len: 2,
            heads: 1,
            key_dim: 2,
            value_dim: 2,
        };
        let ones = vec![1.0f32; 4];
        let args = DeltaArgs {
            q: &ones,
            k: &ones,
            v: &ones,
            alpha: &ones[..2],
            beta: &ones[..2],
            initial_state: None,
        };
        let e = gated_delta_rule(Device::Cpu, dshape, args).unwrap_err();
        assert!(matches!(e, MixerError::Unsupported(_)), "{e}");
        let bad = DeltaArgs {
            alpha: &z[..2],
            ..args
        };
        assert!(gated_delta_rule(Device::Cpu, dshape, bad)
            .unwrap_err()
            .to_string()
            .contains("alpha[0]"));
        let bshape = BasedShape {
            batch: 1,
            seq_len: 2,
            heads: 1,
            key_dim: 2,
            value_dim: 2,
            window: 2,
        };
        let e = based(Device::Cpu, bshape, &ones, &ones, &ones, 1.0, None).unwrap_err();
        assert!(e.to_string().contains("no CPU implementation"), "{e}");
    }
}
