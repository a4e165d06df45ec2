//! The entry points a user calls: [`dot_product_attention`] (and its training form
//! [`dot_product_attention_vjp`]), attention with generated masks and score modifications
//! [`flex_attention`], and the multi-head attention layer [`mha`], on the CPU or on a CUDA
//! device, with host tensors in and out.
//!
//! Which implementation runs is decided per call by [`implementation`] from the device, the
//! element type and the shape; the runners record the same rules in every document
//! (`config.dispatch`), which the site's "What runs by default" table shows:
//! - **CPU**: `cpu_flash` ([`super::cpu_flash`]), every shape, bf16/fp16/fp32 computed in
//!   float32 on all of rayon's threads.
//! - **CUDA**: [`super::cuda::dispatch`]: `flash` (the project's kernels) for bf16/fp16 at the
//!   head dims it is built for, `math` (cuBLAS GEMMs around softmax kernels, no TF32) for
//!   fp32 and every other head_dim.
//!
//! Layouts are those of [`super::cpu_flash`] (and PyTorch's `scaled_dot_product_attention`):
//! Q and O `[batch, heads, seq_len_q, head_dim]`, K and V `[batch, kv_heads, seq_len_kv,
//! head_dim]`, row-major; grouped-query heads; causal masks aligned bottom-right; a query that
//! sees no key gets a zero row. Host tensors go to the device and back on every call: a loop
//! over device buffers should keep a [`super::cuda::Runner`] instead.

use cudarc::cublas::sys::{cublasMath_t, cublasOperation_t, cudaDataType_t};
use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};
use rayon::prelude::*;

use super::cpu::{modified_reference_values, CheckPlan, Inputs};
use super::cpu_flash::{
    self, check_lengths, AttentionError, Element, ElementType, Gradients, Options, Shape,
};
use super::cuda::{self, DeviceInputs, Gemm};
use super::decode_gpu;
use super::flex::{flex_reference, FlexAttention, FlexMod, FlexRule, FlexShape, FlexSpec};
use super::{AttentionCase, Dtype, Pass};
use crate::gpu::{Gpu, GpuError};

pub use crate::gpu::Device;

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The shape is invalid or a tensor's length does not match it.
    #[error(transparent)]
    Invalid(#[from] AttentionError),
    /// No implementation on this device computes the call; the message gives each one's
    /// reason.
    #[error("no implementation on this device supports the call: {0}")]
    Unsupported(String),
    /// A compile, launch, cuBLAS or out-of-memory error on the device.
    #[error(transparent)]
    Gpu(#[from] GpuError),
}

impl From<cudarc::driver::DriverError> for Error {
    fn from(e: cudarc::driver::DriverError) -> Error {
        Error::Gpu(e.into())
    }
}

/// The name the CPU implementation has in documents.
pub const CPU_IMPLEMENTATION: &str = "cpu_flash";

/// Checks `shape` and the lengths of Q, K and V against it.
fn check_qkv<T>(shape: &Shape, q: &[T], k: &[T], v: &[T]) -> Result<(), AttentionError> {
    check_lengths(
        shape,
        &[
            ("q", q.len(), shape.q_elems()),
            ("k", k.len(), shape.kv_elems()),
            ("v", v.len(), shape.kv_elems()),
        ],
    )
}

/// The attention case of a call with `pass`.
fn case_of(dtype: ElementType, shape: &Shape, options: &Options, pass: Pass) -> AttentionCase {
    AttentionCase {
        batch: shape.batch,
        heads: shape.heads,
        kv_heads: shape.kv_heads,
        seq_len_q: shape.seq_len_q,
        seq_len_kv: shape.seq_len_kv,
        head_dim: shape.head_dim,
        causal: options.causal,
        dtype: dtype.into(),
        pass,
        scale: options.scale,
        kv_lens: None,
    }
}

/// The implementation a call with these arguments runs on `device`: `cpu_flash` on the CPU;
/// on CUDA the split-KV kernel (`flash_decode`) for a decoding shape it takes
/// ([`decode_gpu::takes`]: at most 16 query rows against at least 1024 keys, forward, bf16 or
/// fp16, head_dim 64, 128 or 256), else what [`super::cuda::dispatch`] picks (`flash` or
/// `math`; `flash` on compute capability 9.0 runs the wgmma forward (and backward) where
/// [`super::sm90::takes`] the call, the portable kernels otherwise).
///
/// # Errors
/// [`Error::Invalid`] for an invalid shape; [`Error::Unsupported`] when no CUDA
/// implementation supports the call (the message names each one's reason).
pub fn implementation(
    device: Device,
    dtype: ElementType,
    shape: &Shape,
    options: &Options,
) -> Result<&'static str, Error> {
    shape.validate()?;
    match device {
        Device::Cpu => Ok(CPU_IMPLEMENTATION),
        Device::Cuda(_) => {
            let c = case_of(dtype, shape, options, Pass::Fwd);
            if decode_gpu::takes(&c) {
                return Ok(decode_gpu::IMPLEMENTATION);
            }
            cuda_implementation(&c).map(|i| i.name())
        }
    }
}

fn cuda_implementation(c: &AttentionCase) -> Result<cuda::Implementation, Error> {
    cuda::dispatch(c).ok_or_else(|| {
        let why: Vec<String> = cuda::Implementation::ALL
            .into_iter()
            .filter_map(|i| i.supports(c).err().map(|e| format!("{}: {e}", i.name())))
            .collect();
        Error::Unsupported(why.join("; "))
    })
}

/// Host elements as the device's 16-bit words ([`Dtype`]: one per bf16/fp16 element, two per
/// fp32 element).
fn to_words<T: Element>(xs: &[T]) -> Vec<u16> {
    let d = Dtype::from(T::TYPE);
    let mut out = vec![0u16; xs.len() * d.words()];
    for (x, o) in xs.iter().zip(out.chunks_exact_mut(d.words())) {
        d.encode(x.to_f32(), o);
    }
    out
}

/// The inverse of [`to_words`] (exact).
fn from_words<T: Element>(w: &[u16]) -> Vec<T> {
    let d = Dtype::from(T::TYPE);
    (0..w.len() / d.words())
        .map(|i| T::from_f32(d.decode(w, i)))
        .collect()
}

/// Runs case `c` on the device with the implementation the dispatch picks, on outputs
/// poisoned with NaN; returns the outputs ([O] or [O, dQ, dK, dV]) still on the device.
fn run_on_device(
    gpu: &Gpu,
    c: &AttentionCase,
    inp: &DeviceInputs,
) -> Result<Vec<CudaSlice<u16>>, Error> {
    let mut outs = cuda::poisoned_outputs(gpu, c)?;
    if decode_gpu::takes(c) {
        decode_gpu::forward(gpu, c, inp, &mut outs[0])?;
        return Ok(outs);
    }
    cuda_implementation(c)?;
    cuda::forward(gpu, c, inp, &mut outs)?;
    Ok(outs)
}

fn download<T: Element>(gpu: &Gpu, buf: &CudaSlice<u16>) -> Result<Vec<T>, GpuError> {
    let words = gpu.stream.clone_dtoh(buf)?;
    gpu.stream.synchronize()?;
    Ok(from_words(&words))
}

/// Softmax attention, O = softmax(scale · Q Kᵀ + mask) V, `[B, H, T_q, D]` in the input type,
/// on `device` with the implementation [`implementation`] names. Every shape on the CPU; on
/// CUDA, a decoding shape on the split-KV kernel (`flash_decode`), the rest on what `flash` or
/// `math` supports (every shape for bf16, fp16 and fp32 today); on compute capability 9.0 the
/// bf16 forward at head_dim 64 and 128 runs the wgmma kernel ([`super::sm90`]).
///
/// # Errors
/// [`Error::Invalid`] for a zero size, heads not a multiple of kv_heads, or a tensor whose
/// length does not match `shape`; [`Error::Unsupported`] and [`Error::Gpu`] on a device.
///
/// ```
/// use kernelpages::attention::api::{dot_product_attention, Device};
/// use kernelpages::attention::cpu_flash::{Options, Shape};
/// let shape = Shape::self_attention(1, 4, 2, 5, 8); // GQA: 4 query heads on 2 key heads
/// let q = vec![half::bf16::from_f32(0.0); shape.q_elems()];
/// let k = vec![half::bf16::from_f32(0.5); shape.kv_elems()];
/// let v = vec![half::bf16::from_f32(2.0); shape.kv_elems()];
/// let o = dot_product_attention(Device::Cpu, &q, &k, &v, &shape, &Options::default())?;
/// assert!(o.iter().all(|x| x.to_f32() == 2.0));
/// # Ok::<(), kernelpages::attention::api::Error>(())
/// ```
pub fn dot_product_attention<T: Element>(
    device: Device,
    q: &[T],
    k: &[T],
    v: &[T],
    shape: &Shape,
    options: &Options,
) -> Result<Vec<T>, Error> {
    match device {
        Device::Cpu => Ok(cpu_flash::dot_product_attention(q, k, v, shape, options)?),
        Device::Cuda(gpu) => {
            check_qkv(shape, q, k, v)?;
            let c = case_of(T::TYPE, shape, options, Pass::Fwd);
            let inp = cuda::upload(
                gpu,
                &c,
                &Inputs {
                    q: to_words(q),
                    k: to_words(k),
                    v: to_words(v),
                    dout: Vec::new(),
                },
            )?;
            let outs = run_on_device(gpu, &c, &inp)?;
            Ok(download(gpu, &outs[0])?)
        }
    }
}

/// The mask and score modification of a [`flex_attention`] call: one the project names (with
/// a float64 reference, so it runs on the CPU too) or CUDA C expressions of your own (CUDA only;
/// the names they may use are in [`super::flex`]'s documentation).
#[derive(Clone, Debug, PartialEq)]
pub enum FlexMods {
    /// Causal, sliding window, document, prefix-LM, ALiBi or soft-capping.
    Named(FlexMod),
    /// A mask and/or score modification as CUDA C expressions.
    Custom(FlexSpec),
}

/// The checks [`flex_attention`] and [`flex_attention_vjp`] share; the flex shape (scale
/// resolved) and every batch entry's key length.
#[allow(clippy::too_many_arguments)]
fn flex_checks<T: Element>(
    q: &[T],
    k: &[T],
    v: &[T],
    shape: &Shape,
    scale: Option<f64>,
    mods: &FlexMods,
    aux: &[i32],
) -> Result<(FlexShape, Vec<usize>), Error> {
    check_qkv(shape, q, k, v)?;
    if shape.seq_len_q == 0 || shape.seq_len_kv == 0 {
        return Err(AttentionError::Shape(*shape, "a length is 0").into());
    }
    if let FlexMods::Named(FlexMod::SoftCap(c)) = mods {
        if !(c.is_finite() && *c > 0.0) {
            return Err(Error::Unsupported(format!(
                "soft-capping needs a finite cap above 0, not {c}"
            )));
        }
    }
    let scale = Options {
        causal: false,
        scale,
    }
    .scale_for(shape);
    if mods == &FlexMods::Named(FlexMod::Document) && aux.len() < shape.batch * shape.seq_len_kv {
        return Err(Error::Unsupported(format!(
            "the document mask reads aux [batch, seq_len_kv] = {} entries; {} given",
            shape.batch * shape.seq_len_kv,
            aux.len()
        )));
    }
    let fshape = FlexShape::new(shape, Dtype::from(T::TYPE), scale);
    let lens = vec![shape.seq_len_kv; shape.batch];
    Ok((fshape, lens))
}

/// Attention with a generated mask and score modification (FlexAttention's `flex_attention(q,
/// k, v, score_mod, mask_mod)`; He, Guessous, Liang, Zhang and others, 2024):
/// O = softmax(score_mod(scale · Q Kᵀ) where mask_mod, else −∞) V, `[B, H, T_q, D]` in the input
/// type, layouts as [`dot_product_attention`]. `aux` is what the expressions may index (for
/// [`FlexMod::Document`], the document of every position, `[B, T_kv]`); a query that sees no key
/// gets a zero row. On CUDA (bf16 or fp16, head_dim 64 or 128) the modifications are compiled
/// into the forward once per (modification, head_dim, dtype): on compute capability 9.0 with a
/// positive scale the wgmma kernel (`kernels/flex_attn_fwd_sm90.cu`; the environment variable
/// `KP_FLEX_SM90=0` keeps the portable one there too), elsewhere the portable one
/// (`kernels/flex_attn_fwd.cu`; [`super::flex::FlexKernel`]), and the block mask
/// is computed on every call (keep a [`super::flex::FlexAttention`] to reuse it); on the CPU a
/// named modification runs the float64 reference.
///
/// # Errors
/// [`Error::Invalid`] for a zero size, heads not a multiple of kv_heads or a tensor whose length
/// does not match `shape`; [`Error::Unsupported`] for a custom modification on the CPU, another
/// dtype or head_dim on CUDA, a document mask with too few `aux` entries or a soft-cap that is
/// not a finite number above 0; [`Error::Gpu`] for NVRTC (an expression that does not compile
/// names it) and driver errors. A custom expression that reads `aux` must be given what it
/// reads: nothing checks it.
///
/// ```
/// use kernelpages::attention::api::{flex_attention, Device, FlexMods};
/// use kernelpages::attention::cpu_flash::Shape;
/// use kernelpages::attention::flex::FlexMod;
/// // One query row against 3 keys, V rows 0, 1, 2, Q = 0: a sliding window of 2 keys averages
/// // the last two.
/// let shape = Shape { seq_len_q: 1, ..Shape::self_attention(1, 1, 1, 3, 64) };
/// let q = vec![0.0f32; 64];
/// let k = vec![0.0f32; 3 * 64];
/// let v: Vec<f32> = (0..3 * 64).map(|i| (i / 64) as f32).collect();
/// let mods = FlexMods::Named(FlexMod::SlidingWindow(2));
/// let o = flex_attention(Device::Cpu, &q, &k, &v, &shape, None, &mods, &[])?;
/// assert!(o.iter().all(|&x| (x - 1.5).abs() < 1e-6));
/// # Ok::<(), kernelpages::attention::api::Error>(())
/// ```
#[allow(clippy::too_many_arguments)]
pub fn flex_attention<T: Element>(
    device: Device,
    q: &[T],
    k: &[T],
    v: &[T],
    shape: &Shape,
    scale: Option<f64>,
    mods: &FlexMods,
    aux: &[i32],
) -> Result<Vec<T>, Error> {
    let (fshape, lens) = flex_checks(q, k, v, shape, scale, mods, aux)?;
    match device {
        Device::Cpu => {
            let FlexMods::Named(m) = mods else {
                return Err(Error::Unsupported(
                    "a custom flex modification is CUDA C: it runs on CUDA only".into(),
                ));
            };
            let wide = |x: &[T]| -> Vec<f64> { x.iter().map(|&e| e.to_f32() as f64).collect() };
            let (o, _) = flex_reference(&fshape, m, &wide(q), &wide(k), &wide(v), &lens, aux);
            Ok(o.iter().map(|&x| T::from_f32(x as f32)).collect())
        }
        Device::Cuda(gpu) => {
            if let Some(why) = fshape.unsupported() {
                return Err(Error::Unsupported(format!("flex: {why}")));
            }
            let spec = match mods {
                FlexMods::Named(m) => m.spec(),
                FlexMods::Custom(s) => s.clone(),
            };
            let flex = FlexAttention::new(gpu, fshape, &spec, &lens, aux)?;
            let up = |x: &[T]| gpu.stream.clone_htod(&to_words(x));
            let (qd, kd, vd) = (up(q)?, up(k)?, up(v)?);
            let rows = shape.batch * shape.heads * shape.seq_len_q;
            let mut o = gpu.stream.alloc_zeros::<u16>(rows * shape.head_dim)?;
            let mut lse = gpu.stream.alloc_zeros::<f32>(rows)?;
            flex.launch(gpu, &qd, &kd, &vd, &mut o, &mut lse)?;
            Ok(download(gpu, &o)?)
        }
    }
}

/// `flex_attention` forward then backward: O `[B, H, T_q, D]` and dQ (like Q), dK and dV (like
/// K and V, `[B, KVH, T_kv, D]`, summed over the query heads that share a key head) for dL/dO =
/// `d_out` (`[B, H, T_q, D]`), with the same modification in both passes (the mask removes
/// pairs; a score modification's derivative scales dS: ALiBi's is 1, soft-capping's
/// 1 − tanh²(score / cap); a custom one needs [`super::flex::FlexSpec::score_grad`]). `aux` as in
/// [`flex_attention`] (the document mask's `[B, T_kv]` document ids). On CUDA (bf16 or fp16,
/// head_dim 64 or 128), the forward as [`flex_attention`]'s, then the backward
/// [`super::flex::FlexBwdKernel::for_call`] picks: the wgmma one on compute capability 9.0 with
/// a positive finite scale unless [`super::flex::BWD_SM90_ENV`] is `0` (dQ by fp32 TMA
/// reduce-adds), `kernels/flex_attn_bwd.cu` otherwise (FlashAttention-2's backward over a
/// transposed block mask; dQ summed with fp32 atomics); either way dQ's last bit may vary from
/// run to run. On the CPU a named modification runs the float64 reference.
///
/// # Errors
/// As [`flex_attention`]; `d_out` of the wrong length; [`Error::Unsupported`] for a custom score
/// modification without its derivative.
#[allow(clippy::too_many_arguments)]
pub fn flex_attention_vjp<T: Element>(
    device: Device,
    q: &[T],
    k: &[T],
    v: &[T],
    d_out: &[T],
    shape: &Shape,
    scale: Option<f64>,
    mods: &FlexMods,
    aux: &[i32],
) -> Result<(Vec<T>, Gradients<T>), Error> {
    check_lengths(shape, &[("d_out", d_out.len(), shape.q_elems())])?;
    let (fshape, lens) = flex_checks(q, k, v, shape, scale, mods, aux)?;
    match device {
        Device::Cpu => {
            let FlexMods::Named(m) = mods else {
                return Err(Error::Unsupported(
                    "a custom flex modification is CUDA C: it runs on CUDA only".into(),
                ));
            };
            let c = AttentionCase {
                scale: Some(fshape.scale),
                ..case_of(T::TYPE, shape, &Options::default(), Pass::FwdBwd)
            };
            let inp = Inputs {
                q: to_words(q),
                k: to_words(k),
                v: to_words(v),
                dout: to_words(d_out),
            };
            let rule = FlexRule {
                m: Some(*m),
                heads: shape.heads,
                seq_len_q: shape.seq_len_q,
                seq_len_kv: shape.seq_len_kv,
                aux,
            };
            let r = modified_reference_values(&c, &inp, &CheckPlan::full(&c), &rule);
            let back = |x: &[f64]| -> Vec<T> { x.iter().map(|&e| T::from_f32(e as f32)).collect() };
            Ok((
                back(&r.o),
                Gradients {
                    dq: back(&r.dq),
                    dk: back(&r.dk),
                    dv: back(&r.dv),
                },
            ))
        }
        Device::Cuda(gpu) => {
            if let Some(why) = fshape.unsupported() {
                return Err(Error::Unsupported(format!("flex: {why}")));
            }
            let spec = match mods {
                FlexMods::Named(m) => m.spec(),
                FlexMods::Custom(s) => s.clone(),
            };
            if spec.score.is_some() && spec.score_grad.is_none() {
                return Err(Error::Unsupported(format!(
                    "flex `{}`: the backward needs the score modification's derivative \
                     (FlexSpec::score_grad)",
                    spec.name
                )));
            }
            let mut flex = FlexAttention::new(gpu, fshape, &spec, &lens, aux)?;
            flex.enable_backward(gpu)?;
            let up = |x: &[T]| gpu.stream.clone_htod(&to_words(x));
            let (qd, kd, vd, dod) = (up(q)?, up(k)?, up(v)?, up(d_out)?);
            let rows = shape.batch * shape.heads * shape.seq_len_q;
            let mut o = gpu.stream.alloc_zeros::<u16>(rows * shape.head_dim)?;
            let mut lse = gpu.stream.alloc_zeros::<f32>(rows)?;
            let mut dq = gpu.stream.alloc_zeros::<u16>(q.len())?;
            let mut dk = gpu.stream.alloc_zeros::<u16>(k.len())?;
            let mut dv = gpu.stream.alloc_zeros::<u16>(v.len())?;
            flex.launch(gpu, &qd, &kd, &vd, &mut o, &mut lse)?;
            flex.launch_backward(
                gpu,
                (&qd, &kd, &vd),
                &o,
                &lse,
                &dod,
                &mut dq,
                &mut dk,
                &mut dv,
            )?;
            Ok((
                download(gpu, &o)?,
                Gradients {
                    dq: download(gpu, &dq)?,
                    dk: download(gpu, &dk)?,
                    dv: download(gpu, &dv)?,
                },
            ))
        }
    }
}

/// Forward then backward (a training step's attention): the output O and dQ, dK, dV for
/// dL/dO = `d_out` (`[B, H, T_q, D]`). dK and dV are summed over the query heads that share a
/// key head. On CUDA the backward recomputes the probabilities from the forward's
/// log-sum-exp (FlashAttention-2) for `flash`, and keeps them for `math`.
///
/// # Errors
/// As [`dot_product_attention`]; `d_out` of the wrong length.
pub fn dot_product_attention_vjp<T: Element>(
    device: Device,
    q: &[T],
    k: &[T],
    v: &[T],
    d_out: &[T],
    shape: &Shape,
    options: &Options,
) -> Result<(Vec<T>, Gradients<T>), Error> {
    match device {
        Device::Cpu => Ok(cpu_flash::dot_product_attention_vjp(
            q, k, v, d_out, shape, options,
        )?),
        Device::Cuda(gpu) => {
            check_lengths(
                shape,
                &[
                    ("q", q.len(), shape.q_elems()),
                    ("k", k.len(), shape.kv_elems()),
                    ("v", v.len(), shape.kv_elems()),
                    ("d_out", d_out.len(), shape.q_elems()),
                ],
            )?;
            let c = case_of(T::TYPE, shape, options, Pass::FwdBwd);
            let inp = cuda::upload(
                gpu,
                &c,
                &Inputs {
                    q: to_words(q),
                    k: to_words(k),
                    v: to_words(v),
                    dout: to_words(d_out),
                },
            )?;
            let outs = run_on_device(gpu, &c, &inp)?;
            let o = download(gpu, &outs[0])?;
            let g = Gradients {
                dq: download(gpu, &outs[1])?,
                dk: download(gpu, &outs[2])?,
                dv: download(gpu, &outs[3])?,
            };
            Ok((o, g))
        }
    }
}

/// Sizes of one multi-head attention layer ([`mha`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MhaShape {
    /// Batch size B.
    pub batch: usize,
    /// Query tokens T_q.
    pub seq_len_q: usize,
    /// Key/value tokens T_kv (T_q for self-attention).
    pub seq_len_kv: usize,
    /// Model width (the size of each token's vector).
    pub d_model: usize,
    /// Query heads H.
    pub heads: usize,
    /// Key/value heads (H for multi-head attention, fewer for GQA).
    pub kv_heads: usize,
    /// Head dimension D.
    pub head_dim: usize,
}

impl MhaShape {
    /// The attention call inside the layer.
    pub fn attention(&self) -> Shape {
        Shape {
            batch: self.batch,
            heads: self.heads,
            kv_heads: self.kv_heads,
            seq_len_q: self.seq_len_q,
            seq_len_kv: self.seq_len_kv,
            head_dim: self.head_dim,
        }
    }

    /// FLOPs of one layer call: the four projections (2 per multiply-add) plus the attention
    /// ([`AttentionCase::flops`], causal pairs counted as such).
    pub fn flops(&self, causal: bool) -> f64 {
        let (b, tq, tkv, dm) = (
            self.batch as f64,
            self.seq_len_q as f64,
            self.seq_len_kv as f64,
            self.d_model as f64,
        );
        let (hd, kvd) = (
            (self.heads * self.head_dim) as f64,
            (self.kv_heads * self.head_dim) as f64,
        );
        let proj = 2.0 * b * (tq * dm * hd * 2.0 + tkv * dm * kvd * 2.0);
        let mut c = case_of(
            ElementType::Bf16,
            &self.attention(),
            &Options::default(),
            Pass::Fwd,
        );
        c.causal = causal;
        proj + c.flops()
    }
}

/// The four projection matrices of a layer, row-major `[in, out]` (y = x·W): `wq` `[d_model,
/// H·D]`, `wk` and `wv` `[d_model, KVH·D]`, `wo` `[H·D, d_model]`. Head h owns columns
/// h·D..(h+1)·D of `wq` (and key head g those of `wk`, `wv`) and rows h·D..(h+1)·D of `wo`.
#[derive(Clone, Copy, Debug)]
pub struct MhaWeights<'a, T> {
    /// Query projection.
    pub wq: &'a [T],
    /// Key projection.
    pub wk: &'a [T],
    /// Value projection.
    pub wv: &'a [T],
    /// Output projection.
    pub wo: &'a [T],
}

/// A multi-head attention layer without biases (Vaswani et al., 2017, "Attention Is All You
/// Need", §3.2.2; grouped-query heads as in Ainslie et al., 2023):
/// Y = concat_h(attention(X_q W_q^h, X_kv W_k^g(h), X_kv W_v^g(h))) · W_o, with
/// `x_q` `[B, T_q, d_model]` and `x_kv` `[B, T_kv, d_model]` (pass the same slice twice for
/// self-attention), returning `[B, T_q, d_model]` in the input type.
///
/// Each projection is one matrix product over all B·T tokens with float32 accumulation, its
/// result rounded to the input type (as a framework's bf16 layer stores it); the heads are
/// moved to the `[B, H, T, D]` layout, attention runs through [`dot_product_attention`]'s
/// dispatch, and the heads are moved back for the output projection. On CUDA the products
/// are cuBLAS GEMMs (`cublasGemmEx`, 16-bit operands with float32 compute; fp32 with pedantic
/// math, so no TF32) and the head moves are `kernels/heads_layout.cu`; on the CPU the products
/// run through the `gemm` crate on rayon's threads.
///
/// # Errors
/// [`Error::Invalid`] when a size is 0, heads is not a multiple of kv_heads, or a tensor's
/// length does not match `shape` (named `x_q`, `x_kv`, `wq`, `wk`, `wv`, `wo`); device errors
/// as [`dot_product_attention`].
pub fn mha<T: Element>(
    device: Device,
    x_q: &[T],
    x_kv: &[T],
    weights: &MhaWeights<T>,
    shape: &MhaShape,
    options: &Options,
) -> Result<Vec<T>, Error> {
    let s = *shape;
    let att = s.attention();
    let (hd, kvd) = (s.heads * s.head_dim, s.kv_heads * s.head_dim);
    if s.d_model == 0 {
        return Err(AttentionError::Shape(att, "d_model is 0").into());
    }
    check_lengths(
        &att,
        &[
            ("x_q", x_q.len(), s.batch * s.seq_len_q * s.d_model),
            ("x_kv", x_kv.len(), s.batch * s.seq_len_kv * s.d_model),
            ("wq", weights.wq.len(), s.d_model * hd),
            ("wk", weights.wk.len(), s.d_model * kvd),
            ("wv", weights.wv.len(), s.d_model * kvd),
            ("wo", weights.wo.len(), hd * s.d_model),
        ],
    )?;
    match device {
        Device::Cpu => Ok(mha_cpu(x_q, x_kv, weights, &s, options)),
        Device::Cuda(gpu) => mha_cuda(gpu, x_q, x_kv, weights, &s, options),
    }
}

/// Row-major `[rows, k]` · `[k, n]` in float32 on rayon's threads, rounded to `T`.
fn project_cpu<T: Element>(x: &[T], w: &[T], rows: usize, k: usize, n: usize) -> Vec<T> {
    let widen = |xs: &[T]| -> Vec<f32> { xs.iter().map(|x| x.to_f32()).collect() };
    let (x32, w32) = (widen(x), widen(w));
    const ROWS: usize = 64;
    let mut out = vec![0.0f32; rows * n];
    if n > 0 {
        out.par_chunks_mut(ROWS * n).enumerate().for_each(|(i, c)| {
            let r0 = i * ROWS;
            let m = c.len() / n;
            cpu_flash::matmul_f32(m, n, k, c, &x32[r0 * k..(r0 + m) * k], &w32);
        });
    }
    out.into_iter().map(T::from_f32).collect()
}

/// `[B, T, H, D]` → `[B, H, T, D]` (`to_heads`) or back.
fn move_heads<T: Copy>(
    src: &[T],
    b: usize,
    t: usize,
    h: usize,
    d: usize,
    to_heads: bool,
) -> Vec<T> {
    let mut out = Vec::with_capacity(src.len());
    if to_heads {
        for bi in 0..b {
            for hi in 0..h {
                for ti in 0..t {
                    let s = ((bi * t + ti) * h + hi) * d;
                    out.extend_from_slice(&src[s..s + d]);
                }
            }
        }
    } else {
        for bi in 0..b {
            for ti in 0..t {
                for hi in 0..h {
                    let s = ((bi * h + hi) * t + ti) * d;
                    out.extend_from_slice(&src[s..s + d]);
                }
            }
        }
    }
    out
}

fn mha_cpu<T: Element>(
    x_q: &[T],
    x_kv: &[T],
    w: &MhaWeights<T>,
    s: &MhaShape,
    options: &Options,
) -> Vec<T> {
    let (hd, kvd) = (s.heads * s.head_dim, s.kv_heads * s.head_dim);
    let (rq, rkv) = (s.batch * s.seq_len_q, s.batch * s.seq_len_kv);
    let q = project_cpu(x_q, w.wq, rq, s.d_model, hd);
    let k = project_cpu(x_kv, w.wk, rkv, s.d_model, kvd);
    let v = project_cpu(x_kv, w.wv, rkv, s.d_model, kvd);
    let q = move_heads(&q, s.batch, s.seq_len_q, s.heads, s.head_dim, true);
    let k = move_heads(&k, s.batch, s.seq_len_kv, s.kv_heads, s.head_dim, true);
    let v = move_heads(&v, s.batch, s.seq_len_kv, s.kv_heads, s.head_dim, true);
    let o = cpu_flash::dot_product_attention(&q, &k, &v, &s.attention(), options)
        .expect("lengths checked by mha");
    let o = move_heads(&o, s.batch, s.seq_len_q, s.heads, s.head_dim, false);
    project_cpu(&o, w.wo, rq, hd, s.d_model)
}

/// The source of the head-layout kernels ([`mha`] on CUDA).
pub const HEADS_LAYOUT_SRC: &str = include_str!("../../kernels/heads_layout.cu");

/// Row-major C `[m, n]` = A `[m, k]` · B `[k, n]` on the device, elements of `dtype`
/// (float32 accumulation, the result rounded to `dtype`).
fn project_cuda(
    gpu: &Gpu,
    blas: &CudaBlas,
    dtype: Dtype,
    a: &CudaSlice<u16>,
    b: &CudaSlice<u16>,
    (m, k, n): (usize, usize, usize),
) -> Result<CudaSlice<u16>, GpuError> {
    let elem = match dtype {
        Dtype::Bf16 => cudaDataType_t::CUDA_R_16BF,
        Dtype::F16 => cudaDataType_t::CUDA_R_16F,
        Dtype::F32 => cudaDataType_t::CUDA_R_32F,
    };
    // SAFETY: every element is written by the GEMM below before it is read.
    let mut c = unsafe { gpu.stream.alloc::<u16>(m * n * dtype.words())? };
    {
        let (ap, _ga) = a.device_ptr(&gpu.stream);
        let (bp, _gb) = b.device_ptr(&gpu.stream);
        let (cp, _gc) = c.device_ptr_mut(&gpu.stream);
        // Row-major C = A·B is column-major Cᵀ (n × m) = Bᵀ (n × k) · Aᵀ (k × m): cuBLAS's A is
        // our B (ld n), its B our A (ld k), its C ours (ld n).
        let g = Gemm {
            ta: cublasOperation_t::CUBLAS_OP_N,
            tb: cublasOperation_t::CUBLAS_OP_N,
            m: n,
            n: m,
            k,
            alpha: 1.0,
            a: bp,
            lda: n,
            sa: 0,
            b: ap,
            ldb: k,
            sb: 0,
            c: cp,
            ldc: n,
            sc: 0,
            batch: 1,
            ab_type: elem,
            c_type: elem,
        };
        // SAFETY: A holds m·k, B k·n and C m·n elements of `dtype`, live for the call (the
        // guards above keep them so on this stream).
        unsafe { g.run(blas)? };
    }
    Ok(c)
}

/// Moves `src` between `[B, T, H, D]` and `[B, H, T, D]` on the device (`to_heads`: towards
/// the head-major layout).
fn move_heads_cuda(
    gpu: &Gpu,
    dtype: Dtype,
    src: &CudaSlice<u16>,
    (b, t, h, d): (usize, usize, usize, usize),
    to_heads: bool,
) -> Result<CudaSlice<u16>, GpuError> {
    let compiled = gpu.compile("heads_layout.cu", HEADS_LAYOUT_SRC)?;
    let name = format!(
        "{}_heads_w{}",
        if to_heads { "split" } else { "merge" },
        dtype.words()
    );
    let f = gpu.function(&compiled.module, &name, 0)?;
    let n = b * t * h * d;
    // SAFETY: the kernel writes every destination element.
    let mut dst = unsafe { gpu.stream.alloc::<u16>(n * dtype.words())? };
    let blocks = n.div_ceil(256).clamp(1, 1 << 16) as u32;
    let cfg = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let dims = [b as i64, t as i64, h as i64, d as i64];
    let mut l = gpu.stream.launch_builder(&f);
    l.arg(src).arg(&mut dst);
    for x in &dims {
        l.arg(x);
    }
    // SAFETY: the arguments match `*_heads_wN(const u16* src, u16* dst, long long B, T, H,
    // D)`; src and dst hold B·T·H·D elements of N words each.
    unsafe { l.launch(cfg)? };
    Ok(dst)
}

fn mha_cuda<T: Element>(
    gpu: &Gpu,
    x_q: &[T],
    x_kv: &[T],
    w: &MhaWeights<T>,
    s: &MhaShape,
    options: &Options,
) -> Result<Vec<T>, Error> {
    let dtype = Dtype::from(T::TYPE);
    let c = case_of(T::TYPE, &s.attention(), options, Pass::Fwd);
    cuda_implementation(&c)?;
    let (hd, kvd) = (s.heads * s.head_dim, s.kv_heads * s.head_dim);
    let (rq, rkv) = (s.batch * s.seq_len_q, s.batch * s.seq_len_kv);
    let up = |xs: &[T]| gpu.stream.clone_htod(&to_words(xs));
    let (xq, xkv) = (up(x_q)?, up(x_kv)?);
    let (wq, wk, wv, wo) = (up(w.wq)?, up(w.wk)?, up(w.wv)?, up(w.wo)?);
    let blas = CudaBlas::new(gpu.stream.clone()).map_err(|e| GpuError::Cublas(format!("{e:?}")))?;
    let mode = if dtype == Dtype::F32 {
        cublasMath_t::CUBLAS_PEDANTIC_MATH
    } else {
        cublasMath_t::CUBLAS_DEFAULT_MATH
    };
    // SAFETY: the handle is live; the mode is a valid enumerator.
    unsafe {
        cudarc::cublas::sys::cublasSetMathMode(*blas.handle(), mode)
            .result()
            .map_err(|e| GpuError::Cublas(format!("cublasSetMathMode: {e:?}")))?;
    }
    let q = project_cuda(gpu, &blas, dtype, &xq, &wq, (rq, s.d_model, hd))?;
    let k = project_cuda(gpu, &blas, dtype, &xkv, &wk, (rkv, s.d_model, kvd))?;
    let v = project_cuda(gpu, &blas, dtype, &xkv, &wv, (rkv, s.d_model, kvd))?;
    let inp = DeviceInputs {
        q: move_heads_cuda(
            gpu,
            dtype,
            &q,
            (s.batch, s.seq_len_q, s.heads, s.head_dim),
            true,
        )?,
        k: move_heads_cuda(
            gpu,
            dtype,
            &k,
            (s.batch, s.seq_len_kv, s.kv_heads, s.head_dim),
            true,
        )?,
        v: move_heads_cuda(
            gpu,
            dtype,
            &v,
            (s.batch, s.seq_len_kv, s.kv_heads, s.head_dim),
            true,
        )?,
        dout: gpu.stream.clone_htod(&[0u16])?,
        kv_lens: gpu.stream.clone_htod(&vec![s.seq_len_kv as i32; s.batch])?,
    };
    let outs = run_on_device(gpu, &c, &inp)?;
    let o = move_heads_cuda(
        gpu,
        dtype,
        &outs[0],
        (s.batch, s.seq_len_q, s.heads, s.head_dim),
        false,
    )?;
    let y = project_cuda(gpu, &blas, dtype, &o, &wo, (rq, hd, s.d_model))?;
    Ok(download(gpu, &y)?)
}

/// The float64 definition of [`mha`] (small shapes, for tests): the projections in float64
/// without rounding, attention through [`cpu_flash::reference`] on them (rounded to float32
/// only as its input, about 6e-8 relative), the output projection in float64.
pub fn mha_reference<T: Element>(
    x_q: &[T],
    x_kv: &[T],
    w: &MhaWeights<T>,
    s: &MhaShape,
    options: &Options,
) -> Vec<f64> {
    let f = |xs: &[T]| -> Vec<f64> { xs.iter().map(|x| x.to_f32() as f64).collect() };
    let mm = |a: &[f64], b: &[f64], m: usize, k: usize, n: usize| -> Vec<f64> {
        let mut c = vec![0.0f64; m * n];
        for i in 0..m {
            for p in 0..k {
                let x = a[i * k + p];
                for j in 0..n {
                    c[i * n + j] += x * b[p * n + j];
                }
            }
        }
        c
    };
    let (hd, kvd) = (s.heads * s.head_dim, s.kv_heads * s.head_dim);
    let (rq, rkv) = (s.batch * s.seq_len_q, s.batch * s.seq_len_kv);
    let narrow = |xs: Vec<f64>| -> Vec<f32> { xs.into_iter().map(|x| x as f32).collect() };
    let q = narrow(mm(&f(x_q), &f(w.wq), rq, s.d_model, hd));
    let k = narrow(mm(&f(x_kv), &f(w.wk), rkv, s.d_model, kvd));
    let v = narrow(mm(&f(x_kv), &f(w.wv), rkv, s.d_model, kvd));
    let q = move_heads(&q, s.batch, s.seq_len_q, s.heads, s.head_dim, true);
    let k = move_heads(&k, s.batch, s.seq_len_kv, s.kv_heads, s.head_dim, true);
    let v = move_heads(&v, s.batch, s.seq_len_kv, s.kv_heads, s.head_dim, true);
    let o = cpu_flash::reference(&q, &k, &v, &s.attention(), options);
    let o = move_heads(&o, s.batch, s.seq_len_q, s.heads, s.head_dim, false);
    mm(&o, &f(w.wo), rq, hd, s.d_model)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::rel_l2;
    use half::bf16;

    fn shape() -> MhaShape {
        MhaShape {
            batch: 2,
            seq_len_q: 7,
            seq_len_kv: 13,
            d_model: 24,
            heads: 4,
            kv_heads: 2,
            head_dim: 8,
        }
    }

    fn random<T: Element>(n: usize, seed: u64, scale: f32) -> Vec<T> {
        cpu_flash::normal_f32(n, seed)
            .into_iter()
            .map(|x| T::from_f32(x * scale))
            .collect()
    }

    #[test]
    fn flex_attention_on_the_cpu_is_the_reference_and_refuses_cuda_c() {
        // Causal flex equals causal dot_product_attention on the CPU (both against float32
        // inputs; the flex reference computes in float64).
        let shape = Shape::self_attention(2, 4, 2, 9, 16);
        let q: Vec<f32> = random(shape.q_elems(), 1, 1.0);
        let k: Vec<f32> = random(shape.kv_elems(), 2, 1.0);
        let v: Vec<f32> = random(shape.kv_elems(), 3, 1.0);
        let causal = Options {
            causal: true,
            scale: None,
        };
        let want = dot_product_attention(Device::Cpu, &q, &k, &v, &shape, &causal).unwrap();
        let named = FlexMods::Named(FlexMod::Causal);
        let got = flex_attention(Device::Cpu, &q, &k, &v, &shape, None, &named, &[]).unwrap();
        let wide = |x: &[f32]| -> Vec<f64> { x.iter().map(|&e| e as f64).collect() };
        assert!(rel_l2(&wide(&got), &wide(&want)) < 1e-5);
        // CUDA C has no CPU form; a document mask needs its document ids.
        let custom = FlexMods::Custom(FlexMod::Causal.spec());
        let e = flex_attention(Device::Cpu, &q, &k, &v, &shape, None, &custom, &[]).unwrap_err();
        assert!(e.to_string().contains("CUDA only"), "{e}");
        let docs = FlexMods::Named(FlexMod::Document);
        let e = flex_attention(Device::Cpu, &q, &k, &v, &shape, None, &docs, &[0; 5]).unwrap_err();
        assert!(e.to_string().contains("18 entries"), "{e}");
        // A soft-cap must be a finite number above 0; lengths must not be 0.
        let cap = FlexMods::Named(FlexMod::SoftCap(f32::INFINITY));
        let e = flex_attention(Device::Cpu, &q, &k, &v, &shape, None, &cap, &[]).unwrap_err();
        assert!(e.to_string().contains("finite cap"), "{e}");
        let empty = Shape {
            seq_len_q: 0,
            ..shape
        };
        let e = flex_attention(Device::Cpu, &[], &k, &v, &empty, None, &named, &[]).unwrap_err();
        assert!(matches!(e, Error::Invalid(_)), "{e}");
        // A wrong tensor length is refused with its name.
        let e =
            flex_attention(Device::Cpu, &q[1..], &k, &v, &shape, None, &named, &[]).unwrap_err();
        assert!(e.to_string().contains('q'), "{e}");
    }

    #[test]
    fn flex_attention_vjp_on_the_cpu_matches_the_causal_vjp() {
        // Causal flex forward + backward equals causal dot_product_attention_vjp on the CPU.
        let shape = Shape::self_attention(2, 4, 2, 9, 16);
        let q: Vec<f32> = random(shape.q_elems(), 1, 1.0);
        let k: Vec<f32> = random(shape.kv_elems(), 2, 1.0);
        let v: Vec<f32> = random(shape.kv_elems(), 3, 1.0);
        let d_out: Vec<f32> = random(shape.q_elems(), 4, 1.0);
        let causal = Options {
            causal: true,
            scale: None,
        };
        let (wo, wg) =
            dot_product_attention_vjp(Device::Cpu, &q, &k, &v, &d_out, &shape, &causal).unwrap();
        let named = FlexMods::Named(FlexMod::Causal);
        let (go, gg) =
            flex_attention_vjp(Device::Cpu, &q, &k, &v, &d_out, &shape, None, &named, &[]).unwrap();
        let wide = |x: &[f32]| -> Vec<f64> { x.iter().map(|&e| e as f64).collect() };
        for (name, a, b) in [
            ("o", &go, &wo),
            ("dq", &gg.dq, &wg.dq),
            ("dk", &gg.dk, &wg.dk),
            ("dv", &gg.dv, &wg.dv),
        ] {
            let e = rel_l2(&wide(a), &wide(b));
            assert!(e < 1e-5, "{name}: {e}");
        }
        // Soft-capping changes the gradients (its derivative is below 1), and a wrong d_out
        // length is refused with its name.
        let cap = FlexMods::Named(FlexMod::SoftCap(0.5));
        let (_, cg) =
            flex_attention_vjp(Device::Cpu, &q, &k, &v, &d_out, &shape, None, &cap, &[]).unwrap();
        assert!(rel_l2(&wide(&cg.dq), &wide(&wg.dq)) > 1e-2);
        let e = flex_attention_vjp(
            Device::Cpu,
            &q,
            &k,
            &v,
            &d_out[1..],
            &shape,
            None,
            &cap,
            &[],
        )
        .unwrap_err();
        assert!(e.to_string().contains("d_out"), "{e}");
    }

    struct Layer<T> {
        x_q: Vec<T>,
        x_kv: Vec<T>,
        wq: Vec<T>,
        wk: Vec<T>,
        wv: Vec<T>,
        wo: Vec<T>,
    }

    impl<T: Element> Layer<T> {
        fn random(s: &MhaShape) -> Layer<T> {
            let (hd, kvd) = (s.heads * s.head_dim, s.kv_heads * s.head_dim);
            let ws = 1.0 / (s.d_model as f32).sqrt();
            Layer {
                x_q: random(s.batch * s.seq_len_q * s.d_model, 1, 1.0),
                x_kv: random(s.batch * s.seq_len_kv * s.d_model, 2, 1.0),
                wq: random(s.d_model * hd, 3, ws),
                wk: random(s.d_model * kvd, 4, ws),
                wv: random(s.d_model * kvd, 5, ws),
                wo: random(hd * s.d_model, 6, 1.0 / (hd as f32).sqrt()),
            }
        }
        fn weights(&self) -> MhaWeights<'_, T> {
            MhaWeights {
                wq: &self.wq,
                wk: &self.wk,
                wv: &self.wv,
                wo: &self.wo,
            }
        }
    }

    fn widen<T: Element>(xs: &[T]) -> Vec<f64> {
        xs.iter().map(|x| x.to_f32() as f64).collect()
    }

    /// Q = 0 makes every visible key equally likely; with V = X_kv (W_v the identity, one
    /// head per d_model slice) and W_o the identity, output row i is the mean of the x_kv rows
    /// it sees: a bottom-right causal mask gives prefix means.
    #[test]
    fn uniform_attention_gives_the_mean_of_the_visible_rows() {
        let s = MhaShape {
            batch: 1,
            seq_len_q: 3,
            seq_len_kv: 5,
            d_model: 4,
            heads: 2,
            kv_heads: 2,
            head_dim: 2,
        };
        let eye: Vec<f32> = (0..16)
            .map(|i| if i / 4 == i % 4 { 1.0 } else { 0.0 })
            .collect();
        let zero = vec![0.0f32; 16];
        let x_kv: Vec<f32> = (0..20)
            .map(|i| (i / 4) as f32 + 0.25 * (i % 4) as f32)
            .collect();
        let x_q = vec![1.0f32; 12];
        let w = MhaWeights {
            wq: &zero,
            wk: &eye,
            wv: &eye,
            wo: &eye,
        };
        for causal in [false, true] {
            let opts = Options {
                causal,
                scale: None,
            };
            let y = mha(Device::Cpu, &x_q, &x_kv, &w, &s, &opts).unwrap();
            for i in 0..3 {
                // Query i sees keys 0..=i + 2 under the bottom-right mask, all 5 otherwise.
                let n = if causal { i + 3 } else { 5 };
                for c in 0..4 {
                    let want = (0..n).map(|j| x_kv[j * 4 + c]).sum::<f32>() / n as f32;
                    assert!(
                        (y[i * 4 + c] - want).abs() < 1e-6,
                        "causal {causal} row {i} col {c}: {} vs {want}",
                        y[i * 4 + c]
                    );
                }
            }
        }
    }

    #[test]
    fn mha_matches_the_float64_definition() {
        let s = shape();
        for causal in [false, true] {
            let opts = Options {
                causal,
                scale: Some(0.3),
            };
            let l = Layer::<f32>::random(&s);
            let y = mha(Device::Cpu, &l.x_q, &l.x_kv, &l.weights(), &s, &opts).unwrap();
            let r = mha_reference(&l.x_q, &l.x_kv, &l.weights(), &s, &opts);
            let e = rel_l2(&widen(&y), &r);
            assert!(e < 1e-5, "fp32 causal {causal}: error {e}");
            let l = Layer::<bf16>::random(&s);
            let y = mha(Device::Cpu, &l.x_q, &l.x_kv, &l.weights(), &s, &opts).unwrap();
            let r = mha_reference(&l.x_q, &l.x_kv, &l.weights(), &s, &opts);
            let e = rel_l2(&widen(&y), &r);
            assert!(e < 2e-2, "bf16 causal {causal}: error {e}");
        }
    }

    #[test]
    fn mha_names_the_tensor_of_the_wrong_length() {
        let s = shape();
        let l = Layer::<f32>::random(&s);
        let short = &l.wo[1..];
        let w = MhaWeights {
            wo: short,
            ..l.weights()
        };
        let e = mha(Device::Cpu, &l.x_q, &l.x_kv, &w, &s, &Options::default()).unwrap_err();
        assert!(e.to_string().starts_with("wo has"), "{e}");
        let bad = MhaShape { kv_heads: 3, ..s };
        let e = mha(
            Device::Cpu,
            &l.x_q,
            &l.x_kv,
            &l.weights(),
            &bad,
            &Options::default(),
        )
        .unwrap_err();
        assert!(e.to_string().contains("not a multiple of kv_heads"), "{e}");
        let zero = MhaShape { d_model: 0, ..s };
        assert!(mha(
            Device::Cpu,
            &[],
            &[],
            &l.weights(),
            &zero,
            &Options::default()
        )
        .is_err());
    }

    #[test]
    fn heads_move_and_come_back() {
        let (b, t, h, d) = (2, 3, 4, 5);
        let x: Vec<u32> = (0..(b * t * h * d) as u32).collect();
        let y = move_heads(&x, b, t, h, d, true);
        // Element (b=1, h=2, t=1, d=3) of the head-major layout is (b=1, t=1, h=2, d=3).
        assert_eq!(y[((h + 2) * t + 1) * d + 3], x[((t + 1) * h + 2) * d + 3]);
        assert_eq!(move_heads(&y, b, t, h, d, false), x);
    }

    #[test]
    fn words_round_trip_exactly() {
        let xs: Vec<f32> = vec![1.5, -0.0, 3.1e-5, f32::MAX, -7.25];
        assert_eq!(from_words::<f32>(&to_words(&xs)), xs);
        let bs: Vec<bf16> = xs.iter().map(|&x| bf16::from_f32(x)).collect();
        assert_eq!(from_words::<bf16>(&to_words(&bs)), bs);
        assert_eq!(to_words(&bs).len(), 5);
        assert_eq!(to_words(&xs).len(), 10);
    }

    #[test]
    fn the_cpu_runs_cpu_flash_and_refuses_bad_shapes() {
        let s = Shape::self_attention(1, 4, 2, 9, 8);
        let got = implementation(Device::Cpu, ElementType::Bf16, &s, &Options::default());
        assert_eq!(got.unwrap(), CPU_IMPLEMENTATION);
        let bad = Shape { heads: 0, ..s };
        assert!(implementation(Device::Cpu, ElementType::F32, &bad, &Options::default()).is_err());
        let q = vec![0.0f32; s.q_elems() - 1];
        let kv = vec![0.0f32; s.kv_elems()];
        let e =
            dot_product_attention(Device::Cpu, &q, &kv, &kv, &s, &Options::default()).unwrap_err();
        assert!(e.to_string().starts_with("q has"), "{e}");
    }
}
