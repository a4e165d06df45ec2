//! Attention on the CPU, fast: forward and backward tiled as FlashAttention does them, on every
//! core.
//!
//! [`dot_product_attention`] computes O = softmax(scale · Q Kᵀ + mask) V for bf16, fp16 or fp32
//! inputs with float32 arithmetic throughout. The work is split over (batch, head, block of
//! [`BLOCK_Q`] query rows) with rayon; each task walks the keys in blocks of [`BLOCK_KV`], takes
//! S = Q·Kᵀ and acc += P·V as two matrix products through the `gemm` crate, and keeps an online
//! softmax (running row maximum and sum, base-2 exponentials) between them, so nothing of size
//! T_q × T_kv is ever held: memory beyond inputs and output is K and V widened to float32 (none
//! for fp32 inputs) and one tile per task.
//!
//! Layout: Q and O `[batch, heads, seq_len_q, head_dim]`, K and V `[batch, kv_heads, seq_len_kv,
//! head_dim]`, row-major, contiguous (the layout of PyTorch's `scaled_dot_product_attention`);
//! query head h reads key/value head h / (heads / kv_heads) (grouped-query attention). Causal
//! masking is aligned bottom-right, as FlashAttention-2 and cuDNN do: query i sees keys
//! j ≤ i + seq_len_kv − seq_len_q, and a query that sees no key gets a zero output row.
//!
//! [`dot_product_attention_backward`] is the FlashAttention-2 backward: with the log-sum-exp
//! the forward saved ([`dot_product_attention_lse_into`]) it recomputes P tile by tile and
//! accumulates dV = Pᵀ·dO, dK = scale·dSᵀ·Q (tasks over key blocks) and dQ = scale·dS·K (tasks
//! over query blocks): seven matrix products per (query block, key block) pair through `gemm`
//! (S and dP in each of the two passes, then dV, dK and dQ); [`dot_product_attention_vjp`] runs
//! forward and backward.
//!
//! [`reference`] is the same definition in float64, for the tests and the runner's check
//! ([`reference_gradients`] for the backward).
//! It agrees with [`super::cpu::forward_f64`] to 1e-13 (the order of float64 sums apart) on
//! the shapes both accept (tested), so the two definitions cannot drift apart unnoticed.

use std::borrow::Cow;

use rayon::prelude::*;

use super::cpu::CheckPlan;
use super::Dtype;

/// Query rows per task.
pub const BLOCK_Q: usize = 64;
/// Keys per step of the online softmax.
pub const BLOCK_KV: usize = 256;

/// An input element type the CPU attention reads and writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ElementType {
    /// bfloat16.
    Bf16,
    /// IEEE half precision.
    F16,
    /// IEEE single precision.
    F32,
}

impl ElementType {
    /// Name in documents: `bf16`, `fp16`, `fp32`.
    pub fn as_str(self) -> &'static str {
        match self {
            ElementType::Bf16 => "bf16",
            ElementType::F16 => "fp16",
            ElementType::F32 => "fp32",
        }
    }

    /// Parses `bf16`, `fp16` (or `f16`), `fp32` (or `f32`).
    pub fn parse(s: &str) -> Option<ElementType> {
        match s {
            "fp32" | "f32" => Some(ElementType::F32),
            _ => Dtype::parse(s).map(ElementType::from),
        }
    }

    /// Bytes per element.
    pub fn bytes(self) -> usize {
        match self {
            ElementType::Bf16 | ElementType::F16 => 2,
            ElementType::F32 => 4,
        }
    }

    /// Largest relative L2 error accepted against the float64 reference: the 16-bit types as
    /// [`Dtype::tolerance`]; fp32 1e-4 (float32 sums over 16k keys stay near 1e-5; a TF32
    /// matrix product, about 1e-3, fails it).
    pub fn tolerance(self) -> f64 {
        match self {
            ElementType::Bf16 => Dtype::Bf16.tolerance(),
            ElementType::F16 => Dtype::F16.tolerance(),
            ElementType::F32 => 1e-4,
        }
    }
}

impl From<ElementType> for Dtype {
    fn from(t: ElementType) -> Dtype {
        match t {
            ElementType::Bf16 => Dtype::Bf16,
            ElementType::F16 => Dtype::F16,
            ElementType::F32 => Dtype::F32,
        }
    }
}

impl From<Dtype> for ElementType {
    fn from(d: Dtype) -> ElementType {
        match d {
            Dtype::Bf16 => ElementType::Bf16,
            Dtype::F16 => ElementType::F16,
            Dtype::F32 => ElementType::F32,
        }
    }
}

/// A Rust element type of Q, K, V and O: `half::bf16`, `half::f16` or `f32`.
pub trait Element: Copy + Send + Sync + 'static {
    /// Which type this is.
    const TYPE: ElementType;
    /// Widens to float32 (exact).
    fn to_f32(self) -> f32;
    /// Rounds a float32 to this type (round to nearest even).
    fn from_f32(x: f32) -> Self;
    /// The value of `bytes` (this type's size, little-endian).
    fn from_le_bytes(bytes: &[u8]) -> Self;
    /// `xs` itself when the type is f32 (no widening copy needed).
    fn as_f32(xs: &[Self]) -> Option<&[f32]> {
        let _ = xs;
        None
    }
}

impl Element for half::bf16 {
    const TYPE: ElementType = ElementType::Bf16;
    fn to_f32(self) -> f32 {
        half::bf16::to_f32(self)
    }
    fn from_f32(x: f32) -> Self {
        half::bf16::from_f32(x)
    }
    fn from_le_bytes(b: &[u8]) -> Self {
        half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]]))
    }
}

impl Element for half::f16 {
    const TYPE: ElementType = ElementType::F16;
    fn to_f32(self) -> f32 {
        half::f16::to_f32(self)
    }
    fn from_f32(x: f32) -> Self {
        half::f16::from_f32(x)
    }
    fn from_le_bytes(b: &[u8]) -> Self {
        half::f16::from_bits(u16::from_le_bytes([b[0], b[1]]))
    }
}

impl Element for f32 {
    const TYPE: ElementType = ElementType::F32;
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(x: f32) -> Self {
        x
    }
    fn from_le_bytes(b: &[u8]) -> Self {
        f32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }
    fn as_f32(xs: &[f32]) -> Option<&[f32]> {
        Some(xs)
    }
}

/// Sizes of one attention call. Q and O hold `batch·heads·seq_len_q·head_dim` elements, K and V
/// `batch·kv_heads·seq_len_kv·head_dim`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Shape {
    /// Batch size B.
    pub batch: usize,
    /// Query heads H.
    pub heads: usize,
    /// Key/value heads; H must be a multiple of it (H for multi-head attention).
    pub kv_heads: usize,
    /// Query positions T_q.
    pub seq_len_q: usize,
    /// Key/value positions T_kv.
    pub seq_len_kv: usize,
    /// Head dimension D.
    pub head_dim: usize,
}

impl Shape {
    /// Self-attention: queries and keys share `seq_len`.
    pub fn self_attention(
        batch: usize,
        heads: usize,
        kv_heads: usize,
        seq_len: usize,
        head_dim: usize,
    ) -> Shape {
        Shape {
            batch,
            heads,
            kv_heads,
            seq_len_q: seq_len,
            seq_len_kv: seq_len,
            head_dim,
        }
    }

    /// The shape of an [`super::AttentionCase`].
    pub fn of_case(c: &super::AttentionCase) -> Shape {
        Shape {
            batch: c.batch,
            heads: c.heads,
            kv_heads: c.kv_heads,
            seq_len_q: c.seq_len_q,
            seq_len_kv: c.seq_len_kv,
            head_dim: c.head_dim,
        }
    }

    /// Elements of Q (and of O).
    pub fn q_elems(&self) -> usize {
        self.batch * self.heads * self.seq_len_q * self.head_dim
    }

    /// Elements of K (and of V).
    pub fn kv_elems(&self) -> usize {
        self.batch * self.kv_heads * self.seq_len_kv * self.head_dim
    }

    /// Number of keys query `i` sees: all of them, or under the bottom-right causal mask
    /// `clamp(i + 1 + seq_len_kv − seq_len_q, 0, seq_len_kv)`.
    pub fn visible_keys(&self, i: usize, causal: bool) -> usize {
        if !causal {
            return self.seq_len_kv;
        }
        let n = i as isize + 1 + self.seq_len_kv as isize - self.seq_len_q as isize;
        n.clamp(0, self.seq_len_kv as isize) as usize
    }

    /// Checks that the sizes describe an attention call.
    ///
    /// # Errors
    /// [`AttentionError::Shape`] when a size is 0 or heads is not a multiple of kv_heads.
    pub fn validate(&self) -> Result<(), AttentionError> {
        let s = *self;
        if s.batch == 0 || s.heads == 0 || s.kv_heads == 0 || s.head_dim == 0 {
            return Err(AttentionError::Shape(s, "a size is 0"));
        }
        if !s.heads.is_multiple_of(s.kv_heads) {
            return Err(AttentionError::Shape(
                s,
                "heads is not a multiple of kv_heads",
            ));
        }
        Ok(())
    }
}

/// What else a call takes besides the tensors.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Options {
    /// Causal mask, aligned bottom-right (see the module documentation).
    pub causal: bool,
    /// Softmax scale; `None` is 1/sqrt(head_dim).
    pub scale: Option<f64>,
}

impl Options {
    /// The scale in use for `shape`.
    pub fn scale_for(&self, shape: &Shape) -> f64 {
        self.scale
            .unwrap_or_else(|| 1.0 / (shape.head_dim as f64).sqrt())
    }
}

/// Why a call was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AttentionError {
    /// The sizes cannot describe an attention call.
    #[error("invalid attention shape {0:?}: {1}")]
    Shape(Shape, &'static str),
    /// A tensor's length does not match the shape.
    #[error("{name} has {got} elements; the shape needs {want}")]
    Length {
        /// `q`, `k`, `v` or `out`.
        name: &'static str,
        /// Elements given.
        got: usize,
        /// Elements the shape needs.
        want: usize,
    },
}

/// Checks `shape` and each tensor's length: `(name, elements given, elements wanted)`.
pub(crate) fn check_lengths(
    shape: &Shape,
    lens: &[(&'static str, usize, usize)],
) -> Result<(), AttentionError> {
    shape.validate()?;
    for &(name, got, want) in lens {
        if got != want {
            return Err(AttentionError::Length { name, got, want });
        }
    }
    Ok(())
}

/// Softmax attention on the CPU: O = softmax(scale · Q Kᵀ + mask) V, `[B, H, T_q, D]` in the
/// input type, computed in float32 on all of rayon's threads. See the module documentation for
/// layouts, grouped-query heads and the causal convention.
///
/// # Errors
/// A shape with a zero size or heads not a multiple of kv_heads; a tensor whose length does
/// not match the shape.
///
/// ```
/// use kernelpages::attention::cpu_flash::{dot_product_attention, Options, Shape};
/// let shape = Shape::self_attention(1, 2, 1, 3, 4);
/// let q = vec![0.0f32; shape.q_elems()];
/// let k = vec![1.0f32; shape.kv_elems()];
/// let v: Vec<f32> = (0..shape.kv_elems()).map(|i| (i / 4) as f32).collect();
/// // Q = 0: every visible key gets the same weight, so row i is the mean of V rows 0..=i.
/// let o = dot_product_attention(&q, &k, &v, &shape, &Options { causal: true, scale: None })?;
/// assert_eq!(&o[8..12], &[1.0; 4]);
/// # Ok::<(), kernelpages::attention::cpu_flash::AttentionError>(())
/// ```
pub fn dot_product_attention<T: Element>(
    q: &[T],
    k: &[T],
    v: &[T],
    shape: &Shape,
    options: &Options,
) -> Result<Vec<T>, AttentionError> {
    let mut out = vec![T::from_f32(0.0); shape.q_elems()];
    dot_product_attention_into(q, k, v, shape, options, &mut out)?;
    Ok(out)
}

/// [`dot_product_attention`] writing into `out` (`[B, H, T_q, D]`); every element is written.
///
/// # Errors
/// As [`dot_product_attention`].
pub fn dot_product_attention_into<T: Element>(
    q: &[T],
    k: &[T],
    v: &[T],
    shape: &Shape,
    options: &Options,
    out: &mut [T],
) -> Result<(), AttentionError> {
    check_lengths(
        shape,
        &[
            ("q", q.len(), shape.q_elems()),
            ("k", k.len(), shape.kv_elems()),
            ("v", v.len(), shape.kv_elems()),
            ("out", out.len(), shape.q_elems()),
        ],
    )?;
    let mut lse = vec![0.0f32; shape.batch * shape.heads * shape.seq_len_q];
    forward(q, k, v, shape, options, out, &mut lse);
    Ok(())
}

/// [`dot_product_attention_into`] that also writes the log-sum-exp of each query row's scores,
/// `lse[b, h, i] = ln Σ_j exp(scale · q_i·k_j)` over the keys row i sees (−∞ for a row that
/// sees none), `[B, H, T_q]`: what [`dot_product_attention_backward`] recomputes the
/// probabilities from.
///
/// # Errors
/// As [`dot_product_attention`]; `lse` of the wrong length.
pub fn dot_product_attention_lse_into<T: Element>(
    q: &[T],
    k: &[T],
    v: &[T],
    shape: &Shape,
    options: &Options,
    out: &mut [T],
    lse: &mut [f32],
) -> Result<(), AttentionError> {
    check_lengths(
        shape,
        &[
            ("q", q.len(), shape.q_elems()),
            ("k", k.len(), shape.kv_elems()),
            ("v", v.len(), shape.kv_elems()),
            ("out", out.len(), shape.q_elems()),
        ],
    )?;
    let want = shape.batch * shape.heads * shape.seq_len_q;
    if lse.len() != want {
        return Err(AttentionError::Length {
            name: "lse",
            got: lse.len(),
            want,
        });
    }
    forward(q, k, v, shape, options, out, lse);
    for x in lse.iter_mut() {
        *x *= std::f32::consts::LN_2;
    }
    Ok(())
}

/// The forward on checked arguments; `lse` receives the base-2 log-sum-exp of the base-2
/// scores (scale·log2(e)·q·k), `[B, H, T_q]`.
fn forward<T: Element>(
    q: &[T],
    k: &[T],
    v: &[T],
    shape: &Shape,
    options: &Options,
    out: &mut [T],
    lse: &mut [f32],
) {
    if shape.seq_len_q == 0 {
        return;
    }
    let kf = widen(k);
    let vf = widen(v);
    let s = *shape;
    let (tq, tkv, d) = (s.seq_len_q, s.seq_len_kv, s.head_dim);
    let group = s.heads / s.kv_heads;
    let scale_log2 = (options.scale_for(shape) * std::f64::consts::LOG2_E) as f32;
    let causal = options.causal;
    out.par_chunks_mut(tq * d)
        .zip(lse.par_chunks_mut(tq))
        .enumerate()
        .for_each(|(bh, (o_slice, lse_slice))| {
            let (b, h) = (bh / s.heads, bh % s.heads);
            let q_slice = &q[bh * tq * d..(bh + 1) * tq * d];
            let kv0 = (b * s.kv_heads + h / group) * tkv * d;
            let k_slice = &kf[kv0..kv0 + tkv * d];
            let v_slice = &vf[kv0..kv0 + tkv * d];
            o_slice
                .par_chunks_mut(BLOCK_Q * d)
                .zip(lse_slice.par_chunks_mut(BLOCK_Q))
                .enumerate()
                .for_each(|(blk, (o_block, lse_block))| {
                    let i0 = blk * BLOCK_Q;
                    let rows = o_block.len() / d;
                    let q_block = &q_slice[i0 * d..(i0 + rows) * d];
                    forward_block(
                        &s, causal, scale_log2, i0, q_block, k_slice, v_slice, o_block, lse_block,
                    );
                });
        });
}

/// dQ, dK and dV of one call: gradients of a loss with respect to Q, K and V, laid out as
/// they are.
#[derive(Clone, Debug, PartialEq)]
pub struct Gradients<T> {
    /// dL/dQ, `[B, H, T_q, D]`.
    pub dq: Vec<T>,
    /// dL/dK, `[B, KV, T_kv, D]` (summed over the query heads that share a key head).
    pub dk: Vec<T>,
    /// dL/dV, `[B, KV, T_kv, D]`.
    pub dv: Vec<T>,
}

/// The backward pass of [`dot_product_attention`], FlashAttention-2 style: the probabilities
/// are recomputed block by block from the forward's log-sum-exp (`lse`, from
/// [`dot_product_attention_lse_into`]), never stored. `out` is the forward's output and
/// `d_out` dL/dO, both `[B, H, T_q, D]`. dK and dV are computed in tasks over (batch, key
/// head, block of [`BLOCK_KV`] keys), each looping over its query heads and the query blocks
/// that see its keys; dQ in tasks over (batch, head, block of [`BLOCK_Q`] queries). Float32
/// arithmetic; results rounded to `T`.
///
/// # Errors
/// As [`dot_product_attention`]; `out`, `d_out` or `lse` of the wrong length.
#[allow(clippy::too_many_arguments)]
pub fn dot_product_attention_backward<T: Element>(
    q: &[T],
    k: &[T],
    v: &[T],
    out: &[T],
    d_out: &[T],
    lse: &[f32],
    shape: &Shape,
    options: &Options,
) -> Result<Gradients<T>, AttentionError> {
    let zero = T::from_f32(0.0);
    let mut g = Gradients {
        dq: vec![zero; shape.q_elems()],
        dk: vec![zero; shape.kv_elems()],
        dv: vec![zero; shape.kv_elems()],
    };
    dot_product_attention_backward_into(q, k, v, out, d_out, lse, shape, options, &mut g)?;
    Ok(g)
}

/// [`dot_product_attention_backward`] into caller-owned gradients (`g.dq` `[B, H, T_q, D]`,
/// `g.dk` and `g.dv` `[B, KV, T_kv, D]`, every element overwritten), for callers that run it
/// repeatedly without allocating the results each time.
///
/// # Errors
/// As [`dot_product_attention_backward`]; gradients of the wrong length.
#[allow(clippy::too_many_arguments)]
pub fn dot_product_attention_backward_into<T: Element>(
    q: &[T],
    k: &[T],
    v: &[T],
    out: &[T],
    d_out: &[T],
    lse: &[f32],
    shape: &Shape,
    options: &Options,
    g: &mut Gradients<T>,
) -> Result<(), AttentionError> {
    check_lengths(
        shape,
        &[
            ("q", q.len(), shape.q_elems()),
            ("k", k.len(), shape.kv_elems()),
            ("v", v.len(), shape.kv_elems()),
            ("out", out.len(), shape.q_elems()),
        ],
    )?;
    for (name, got, want) in [
        ("d_out", d_out.len(), shape.q_elems()),
        (
            "lse",
            lse.len(),
            shape.batch * shape.heads * shape.seq_len_q,
        ),
        ("dq", g.dq.len(), shape.q_elems()),
        ("dk", g.dk.len(), shape.kv_elems()),
        ("dv", g.dv.len(), shape.kv_elems()),
    ] {
        if got != want {
            return Err(AttentionError::Length { name, got, want });
        }
    }
    backward(q, k, v, out, d_out, lse, shape, options, g);
    Ok(())
}

/// Forward then backward: the output and the gradients for `d_out` (what a training step
/// runs; the `fwd+bwd` pass of the attention suite).
///
/// # Errors
/// As [`dot_product_attention_backward`].
pub fn dot_product_attention_vjp<T: Element>(
    q: &[T],
    k: &[T],
    v: &[T],
    d_out: &[T],
    shape: &Shape,
    options: &Options,
) -> Result<(Vec<T>, Gradients<T>), AttentionError> {
    let mut out = vec![T::from_f32(0.0); shape.q_elems()];
    let mut lse = vec![0.0f32; shape.batch * shape.heads * shape.seq_len_q];
    dot_product_attention_lse_into(q, k, v, shape, options, &mut out, &mut lse)?;
    let g = dot_product_attention_backward(q, k, v, &out, d_out, &lse, shape, options)?;
    Ok((out, g))
}

/// The backward on checked arguments (`lse` in natural-log units).
#[allow(clippy::too_many_arguments)]
fn backward<T: Element>(
    q: &[T],
    k: &[T],
    v: &[T],
    out: &[T],
    d_out: &[T],
    lse: &[f32],
    shape: &Shape,
    options: &Options,
    g: &mut Gradients<T>,
) {
    let s = *shape;
    let (tq, tkv, d) = (s.seq_len_q, s.seq_len_kv, s.head_dim);
    if tq == 0 || tkv == 0 {
        g.dq.fill(T::from_f32(0.0));
        g.dk.fill(T::from_f32(0.0));
        g.dv.fill(T::from_f32(0.0));
        return;
    }
    let (qf, kf, vf, dof) = (widen(q), widen(k), widen(v), widen(d_out));
    let group = s.heads / s.kv_heads;
    let scale = options.scale_for(shape) as f32;
    let scale_log2 = (options.scale_for(shape) * std::f64::consts::LOG2_E) as f32;
    let causal = options.causal;
    // Per query row: the base-2 log-sum-exp and D_i = dO_i · O_i.
    let lse2: Vec<f32> = lse.iter().map(|x| x * std::f32::consts::LOG2_E).collect();
    let mut delta = vec![0.0f32; lse.len()];
    delta.par_chunks_mut(1024).enumerate().for_each(|(c, dl)| {
        for (r, x) in dl.iter_mut().enumerate() {
            let row = (c * 1024 + r) * d;
            *x = out[row..row + d]
                .iter()
                .zip(&dof[row..row + d])
                .map(|(o, g)| o.to_f32() * g)
                .sum();
        }
    });
    let ctx = BackwardCtx {
        s,
        causal,
        scale_log2,
        lse2: &lse2,
        delta: &delta,
    };
    // dK, dV: one task per (batch, key head, key block).
    g.dk.par_chunks_mut(tkv * d)
        .zip(g.dv.par_chunks_mut(tkv * d))
        .enumerate()
        .for_each(|(bkv, (dk_s, dv_s))| {
            let b = bkv / s.kv_heads;
            let kv0 = bkv * tkv * d;
            let (k_s, v_s) = (&kf[kv0..kv0 + tkv * d], &vf[kv0..kv0 + tkv * d]);
            dk_s.par_chunks_mut(BLOCK_KV * d)
                .zip(dv_s.par_chunks_mut(BLOCK_KV * d))
                .enumerate()
                .for_each(|(blk, (dk_b, dv_b))| {
                    let j0 = blk * BLOCK_KV;
                    let bc = dk_b.len() / d;
                    let mut acc_dk = vec![0.0f32; bc * d];
                    let mut acc_dv = vec![0.0f32; bc * d];
                    let mut p = vec![0.0f32; BLOCK_Q * bc];
                    let mut dp = vec![0.0f32; BLOCK_Q * bc];
                    let k_b = &k_s[j0 * d..(j0 + bc) * d];
                    let v_b = &v_s[j0 * d..(j0 + bc) * d];
                    // The first query that sees key j0.
                    let first = if causal {
                        (j0 as isize - (tkv as isize - tq as isize)).max(0) as usize
                    } else {
                        0
                    };
                    for h in (bkv % s.kv_heads) * group..(bkv % s.kv_heads + 1) * group {
                        let bh = b * s.heads + h;
                        let q0 = bh * tq * d;
                        // Query blocks aligned to BLOCK_Q, from the one holding `first`.
                        let mut i0 = first / BLOCK_Q * BLOCK_Q;
                        while i0 < tq {
                            let br = BLOCK_Q.min(tq - i0);
                            let q_b = &qf[q0 + i0 * d..q0 + (i0 + br) * d];
                            let do_b = &dof[q0 + i0 * d..q0 + (i0 + br) * d];
                            let (p, dp) = (&mut p[..br * bc], &mut dp[..br * bc]);
                            ctx.probabilities_and_ds(
                                bh, i0, br, j0, bc, q_b, k_b, v_b, do_b, p, dp,
                            );
                            // dV += Pᵀ·dO; dK += dSᵀ·Q (dS is in dp).
                            let pt = Mat {
                                data: p,
                                rs: 1,
                                cs: bc,
                            };
                            matmul(bc, d, br, &mut acc_dv, true, pt, Mat::row_major(do_b, d));
                            let dst = Mat {
                                data: dp,
                                rs: 1,
                                cs: bc,
                            };
                            matmul(bc, d, br, &mut acc_dk, true, dst, Mat::row_major(q_b, d));
                            i0 += br;
                        }
                    }
                    for (o, a) in dk_b.iter_mut().zip(&acc_dk) {
                        *o = T::from_f32(a * scale);
                    }
                    for (o, a) in dv_b.iter_mut().zip(&acc_dv) {
                        *o = T::from_f32(*a);
                    }
                });
        });
    // dQ: one task per (batch, head, query block).
    g.dq.par_chunks_mut(tq * d)
        .enumerate()
        .for_each(|(bh, dq_s)| {
            let (b, h) = (bh / s.heads, bh % s.heads);
            let kv0 = (b * s.kv_heads + h / group) * tkv * d;
            let (k_s, v_s) = (&kf[kv0..kv0 + tkv * d], &vf[kv0..kv0 + tkv * d]);
            let q0 = bh * tq * d;
            dq_s.par_chunks_mut(BLOCK_Q * d)
                .enumerate()
                .for_each(|(blk, dq_b)| {
                    let i0 = blk * BLOCK_Q;
                    let br = dq_b.len() / d;
                    let q_b = &qf[q0 + i0 * d..q0 + (i0 + br) * d];
                    let do_b = &dof[q0 + i0 * d..q0 + (i0 + br) * d];
                    let mut acc = vec![0.0f32; br * d];
                    let mut p = vec![0.0f32; br * BLOCK_KV];
                    let mut dp = vec![0.0f32; br * BLOCK_KV];
                    let keys_end = s.visible_keys(i0 + br - 1, causal);
                    let mut j0 = 0;
                    while j0 < keys_end {
                        let bc = BLOCK_KV.min(keys_end - j0);
                        let k_b = &k_s[j0 * d..(j0 + bc) * d];
                        let v_b = &v_s[j0 * d..(j0 + bc) * d];
                        let (p, dp) = (&mut p[..br * bc], &mut dp[..br * bc]);
                        ctx.probabilities_and_ds(bh, i0, br, j0, bc, q_b, k_b, v_b, do_b, p, dp);
                        // dQ += dS·K.
                        matmul(
                            br,
                            d,
                            bc,
                            &mut acc,
                            true,
                            Mat::row_major(dp, bc),
                            Mat::row_major(k_b, d),
                        );
                        j0 += bc;
                    }
                    for (o, a) in dq_b.iter_mut().zip(&acc) {
                        *o = T::from_f32(a * scale);
                    }
                });
        });
}

/// What every backward tile reads.
struct BackwardCtx<'a> {
    s: Shape,
    causal: bool,
    scale_log2: f32,
    /// Base-2 log-sum-exp per query row, `[B, H, T_q]`.
    lse2: &'a [f32],
    /// D_i = dO_i · O_i per query row, `[B, H, T_q]`.
    delta: &'a [f32],
}

impl BackwardCtx<'_> {
    /// For query rows `i0..i0 + br` of slice `bh` against keys `j0..j0 + bc`: P (recomputed
    /// from the log-sum-exp, 0 where masked) into `p` and dS = P ∘ (dO·Vᵀ − D) into `ds`, both
    /// `br × bc` row-major.
    #[allow(clippy::too_many_arguments)]
    fn probabilities_and_ds(
        &self,
        bh: usize,
        i0: usize,
        br: usize,
        j0: usize,
        bc: usize,
        q_b: &[f32],
        k_b: &[f32],
        v_b: &[f32],
        do_b: &[f32],
        p: &mut [f32],
        ds: &mut [f32],
    ) {
        let d = self.s.head_dim;
        let row0 = bh * self.s.seq_len_q + i0;
        // S = Q·Kᵀ, P = 2^(scale·log2(e)·S − lse2).
        matmul(
            br,
            bc,
            d,
            p,
            false,
            Mat::row_major(q_b, d),
            Mat {
                data: k_b,
                rs: 1,
                cs: d,
            },
        );
        // dP = dO·Vᵀ.
        matmul(
            br,
            bc,
            d,
            ds,
            false,
            Mat::row_major(do_b, d),
            Mat {
                data: v_b,
                rs: 1,
                cs: d,
            },
        );
        for r in 0..br {
            let n_vis = self
                .s
                .visible_keys(i0 + r, self.causal)
                .saturating_sub(j0)
                .min(bc);
            let (pr, dr) = (&mut p[r * bc..(r + 1) * bc], &mut ds[r * bc..(r + 1) * bc]);
            if n_vis == 0 {
                pr.fill(0.0);
                dr.fill(0.0);
                continue;
            }
            simd::scale(&mut pr[..n_vis], self.scale_log2);
            simd::exp2_shifted(&mut pr[..n_vis], self.lse2[row0 + r]);
            pr[n_vis..].fill(0.0);
            let delta = self.delta[row0 + r];
            for (dv, pv) in dr.iter_mut().zip(pr.iter()) {
                *dv = pv * (*dv - delta);
            }
        }
    }
}

/// `x` as float32: borrowed for f32, else widened on all threads.
fn widen<T: Element>(x: &[T]) -> Cow<'_, [f32]> {
    if let Some(f) = T::as_f32(x) {
        return Cow::Borrowed(f);
    }
    let mut out = vec![0.0f32; x.len()];
    out.par_chunks_mut(1 << 16)
        .zip(x.par_chunks(1 << 16))
        .for_each(|(o, i)| {
            for (o, i) in o.iter_mut().zip(i) {
                *o = i.to_f32();
            }
        });
    Cow::Owned(out)
}

/// One task: query rows `i0..i0 + rows` of one (batch, head) slice against all its keys.
/// `q_block` is `rows × D` inputs, `k`/`v` the slice's `T_kv × D` keys and values in float32,
/// `o_block` the `rows × D` output.
#[allow(clippy::too_many_arguments)]
fn forward_block<T: Element>(
    s: &Shape,
    causal: bool,
    scale_log2: f32,
    i0: usize,
    q_block: &[T],
    k: &[f32],
    v: &[f32],
    o_block: &mut [T],
    lse_block: &mut [f32],
) {
    let d = s.head_dim;
    let rows = q_block.len() / d;
    // Q scaled by scale·log2(e): S then holds base-2 logits.
    let qf: Vec<f32> = q_block.iter().map(|x| x.to_f32() * scale_log2).collect();
    let mut acc = vec![0.0f32; rows * d];
    let mut m = vec![f32::NEG_INFINITY; rows];
    let mut l = vec![0.0f32; rows];
    let mut sc = vec![0.0f32; rows * BLOCK_KV];
    // The keys any row of the block sees: the last row sees the most.
    let keys_end = s.visible_keys(i0 + rows - 1, causal);
    let mut j0 = 0;
    while j0 < keys_end {
        let bc = BLOCK_KV.min(keys_end - j0);
        let sc = &mut sc[..rows * bc];
        // S = Q_blk · K_blkᵀ: K is row-major T_kv × D, so Kᵀ has row stride 1, column stride D.
        matmul(
            rows,
            bc,
            d,
            sc,
            false,
            Mat::row_major(&qf, d),
            Mat {
                data: &k[j0 * d..(j0 + bc) * d],
                rs: 1,
                cs: d,
            },
        );
        for r in 0..rows {
            let n_vis = s.visible_keys(i0 + r, causal).saturating_sub(j0).min(bc);
            let row = &mut sc[r * bc..(r + 1) * bc];
            if n_vis == 0 {
                row.fill(0.0);
                continue;
            }
            let m_new = m[r].max(simd::max(&row[..n_vis]));
            let alpha = (m[r] - m_new).exp2(); // 0 when m[r] is -inf
            let sum = simd::exp2_shifted(&mut row[..n_vis], m_new);
            row[n_vis..].fill(0.0);
            l[r] = l[r] * alpha + sum;
            m[r] = m_new;
            if alpha != 1.0 {
                simd::scale(&mut acc[r * d..(r + 1) * d], alpha);
            }
        }
        // acc += P · V_blk.
        matmul(
            rows,
            d,
            bc,
            &mut acc,
            true,
            Mat::row_major(sc, bc),
            Mat::row_major(&v[j0 * d..(j0 + bc) * d], d),
        );
        j0 += bc;
    }
    for r in 0..rows {
        // A row that saw no key (l = 0) is 0, not NaN.
        let inv = if l[r] > 0.0 { 1.0 / l[r] } else { 0.0 };
        lse_block[r] = if l[r] > 0.0 {
            m[r] + l[r].log2()
        } else {
            f32::NEG_INFINITY
        };
        for (o, a) in o_block[r * d..(r + 1) * d]
            .iter_mut()
            .zip(&acc[r * d..(r + 1) * d])
        {
            *o = T::from_f32(a * inv);
        }
    }
}

/// A read-only matrix view: element (i, j) at `data[i·rs + j·cs]`.
#[derive(Clone, Copy)]
pub(crate) struct Mat<'a, T = f32> {
    pub(crate) data: &'a [T],
    pub(crate) rs: usize,
    pub(crate) cs: usize,
}

impl<'a, T> Mat<'a, T> {
    pub(crate) fn row_major(data: &'a [T], cols: usize) -> Mat<'a, T> {
        Mat {
            data,
            rs: cols,
            cs: 1,
        }
    }

    /// True when every element of an `m × n` view lies inside `data`.
    fn holds(&self, m: usize, n: usize) -> bool {
        m == 0 || n == 0 || (m - 1) * self.rs + (n - 1) * self.cs < self.data.len()
    }
}

/// The element types [`matmul`] multiplies (float32 for the CPU implementation, float64 for
/// the reference's statistics).
pub(crate) trait Scalar: Copy + 'static {
    /// 1 in this type.
    const ONE: Self;
}

impl Scalar for f32 {
    const ONE: f32 = 1.0;
}

impl Scalar for f64 {
    const ONE: f64 = 1.0;
}

/// C = A·B, or C += A·B with `accumulate`, C `m × n` row-major (row stride n), A `m × k`,
/// B `k × n`, through the `gemm` crate on this thread.
///
/// # Panics
/// When a view does not fit its slice (a bug in the caller).
pub(crate) fn matmul<T: Scalar>(
    m: usize,
    n: usize,
    k: usize,
    c: &mut [T],
    accumulate: bool,
    a: Mat<T>,
    b: Mat<T>,
) {
    assert!(c.len() >= m * n, "C too short");
    assert!(a.holds(m, k) && b.holds(k, n), "matrix view out of bounds");
    if m == 0 || n == 0 {
        return;
    }
    // SAFETY: the asserts above keep every element the product reads (A: i·rs + p·cs for
    // i < m, p < k; B likewise) and writes (C: i·n + j) inside its slice; C is borrowed
    // mutably and does not alias A or B; the sizes and strides fit in isize (slices do).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            a.data.as_ptr(),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr(),
            b.cs as isize,
            b.rs as isize,
            T::ONE,
            T::ONE,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

/// Row-major contiguous C `[m, n]` = A `[m, k]` · B `[k, n]` in float32 on this thread
/// (the `mha` projections run it on row blocks in parallel).
pub(crate) fn matmul_f32(m: usize, n: usize, k: usize, c: &mut [f32], a: &[f32], b: &[f32]) {
    matmul(
        m,
        n,
        k,
        c,
        false,
        Mat::row_major(a, k),
        Mat::row_major(b, n),
    );
}

/// The element-wise steps of the online softmax, compiled for AVX2 + FMA where the CPU has
/// them (chosen at run time) and for the baseline target otherwise.
pub(crate) mod simd {
    /// Lanes of the partial reductions (so that the compiler vectorises them).
    const LANES: usize = 16;

    /// 2^x for x ≤ 0 in float32: rounding splits x = n + f with |f| ≤ 1/2, a degree-6 Taylor
    /// polynomial gives 2^f (relative error below 2e-7), the exponent bits add n. Below −125
    /// the result is 0.
    #[inline(always)]
    fn exp2_neg(x: f32) -> f32 {
        const MAGIC: f32 = 12_582_912.0; // 1.5 · 2^23: adding it rounds to an integer
        const C: [f32; 6] = [
            std::f32::consts::LN_2,
            0.240_226_5,
            0.055_504_11,
            0.009_618_129,
            0.001_333_355_8,
            0.000_154_035_3,
        ];
        let xc = x.max(-125.0);
        let t = xc + MAGIC;
        let n = t.to_bits() as i32 - MAGIC.to_bits() as i32;
        let f = xc - (t - MAGIC);
        let p = 1.0 + f * (C[0] + f * (C[1] + f * (C[2] + f * (C[3] + f * (C[4] + f * C[5])))));
        let r = f32::from_bits((p.to_bits() as i32).wrapping_add(n << 23) as u32);
        if x < -125.0 {
            0.0
        } else {
            r
        }
    }

    #[inline(always)]
    fn max_body(xs: &[f32]) -> f32 {
        let mut lanes = [f32::NEG_INFINITY; LANES];
        let mut chunks = xs.chunks_exact(LANES);
        for c in &mut chunks {
            for (l, x) in lanes.iter_mut().zip(c) {
                *l = l.max(*x);
            }
        }
        let tail = chunks
            .remainder()
            .iter()
            .fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        lanes.iter().fold(tail, |a, &b| a.max(b))
    }

    #[inline(always)]
    fn exp2_shifted_body(xs: &mut [f32], m: f32) -> f32 {
        let mut lanes = [0.0f32; LANES];
        let mut chunks = xs.chunks_exact_mut(LANES);
        for c in &mut chunks {
            for (l, x) in lanes.iter_mut().zip(c.iter_mut()) {
                *x = exp2_neg(*x - m);
                *l += *x;
            }
        }
        let mut sum = 0.0f32;
        for x in chunks.into_remainder() {
            *x = exp2_neg(*x - m);
            sum += *x;
        }
        lanes.iter().sum::<f32>() + sum
    }

    #[inline(always)]
    fn scale_body(xs: &mut [f32], a: f32) {
        for x in xs {
            *x *= a;
        }
    }

    #[cfg(target_arch = "x86_64")]
    mod x86 {
        #[target_feature(enable = "avx2,fma")]
        pub fn max(xs: &[f32]) -> f32 {
            super::max_body(xs)
        }
        #[target_feature(enable = "avx2,fma")]
        pub fn exp2_shifted(xs: &mut [f32], m: f32) -> f32 {
            super::exp2_shifted_body(xs, m)
        }
        #[target_feature(enable = "avx2,fma")]
        pub fn scale(xs: &mut [f32], a: f32) {
            super::scale_body(xs, a)
        }
    }

    fn have_avx2() -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            use std::sync::OnceLock;
            static HAVE: OnceLock<bool> = OnceLock::new();
            *HAVE
                .get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"))
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    }

    /// Largest element (−∞ for none).
    pub fn max(xs: &[f32]) -> f32 {
        #[cfg(target_arch = "x86_64")]
        if have_avx2() {
            // SAFETY: the CPU has AVX2 and FMA (checked at run time).
            return unsafe { x86::max(xs) };
        }
        max_body(xs)
    }

    /// Replaces each x by 2^(x − m) (x ≤ m) and returns their sum.
    pub fn exp2_shifted(xs: &mut [f32], m: f32) -> f32 {
        #[cfg(target_arch = "x86_64")]
        if have_avx2() {
            // SAFETY: the CPU has AVX2 and FMA (checked at run time).
            return unsafe { x86::exp2_shifted(xs, m) };
        }
        exp2_shifted_body(xs, m)
    }

    /// Multiplies each element by `a`.
    pub fn scale(xs: &mut [f32], a: f32) {
        #[cfg(target_arch = "x86_64")]
        if have_avx2() {
            // SAFETY: the CPU has AVX2 and FMA (checked at run time).
            return unsafe { x86::scale(xs, a) };
        }
        scale_body(xs, a)
    }

    #[cfg(test)]
    mod tests {
        #[test]
        fn exp2_is_accurate_and_zero_far_below() {
            let mut worst = 0.0f64;
            let mut x = -125.0f32;
            while x <= 0.0 {
                let want = (x as f64).exp2();
                let got = super::exp2_neg(x) as f64;
                worst = worst.max(((got - want) / want).abs());
                x += 0.0137;
            }
            assert!(worst < 3e-7, "worst relative error {worst}");
            assert_eq!(super::exp2_neg(0.0), 1.0);
            assert_eq!(super::exp2_neg(-200.0), 0.0);
            assert_eq!(super::exp2_neg(f32::NEG_INFINITY), 0.0);
            let mut xs: Vec<f32> = (0..37).map(|i| -(i as f32) * 0.25).collect();
            let want: f32 = xs.iter().map(|&x| (x - 0.5).exp2()).sum();
            assert_eq!(super::max(&xs), 0.0);
            let sum = super::exp2_shifted(&mut xs, 0.5);
            assert!((sum - want).abs() < 1e-5 * want, "{sum} {want}");
            assert!((xs[3] - (-1.25f32).exp2()).abs() < 1e-6);
        }
    }
}

/// The float64 definition for query `rows` of slice `(b, h)`: `rows.len() × head_dim`
/// values. A row that sees no key is 0.
pub fn reference_rows<T: Element>(
    q: &[T],
    k: &[T],
    v: &[T],
    shape: &Shape,
    options: &Options,
    (b, h): (usize, usize),
    rows: &[usize],
) -> Vec<f64> {
    let s = shape;
    let d = s.head_dim;
    let qo = (b * s.heads + h) * s.seq_len_q * d;
    let kvo = (b * s.kv_heads + h / (s.heads / s.kv_heads)) * s.seq_len_kv * d;
    let f = |x: &T| x.to_f32() as f64;
    let scale = options.scale_for(s);
    let mut out = vec![0.0f64; rows.len() * d];
    let mut sc = vec![0.0f64; s.seq_len_kv];
    for (ri, &i) in rows.iter().enumerate() {
        let n = s.visible_keys(i, options.causal);
        if n == 0 {
            continue;
        }
        let qi = &q[qo + i * d..qo + (i + 1) * d];
        let mut mx = f64::NEG_INFINITY;
        for (j, sj) in sc.iter_mut().enumerate().take(n) {
            let kj = &k[kvo + j * d..kvo + (j + 1) * d];
            *sj = qi.iter().zip(kj).map(|(a, b)| f(a) * f(b)).sum::<f64>() * scale;
            mx = mx.max(*sj);
        }
        let mut sum = 0.0;
        for sj in sc.iter_mut().take(n) {
            *sj = (*sj - mx).exp();
            sum += *sj;
        }
        let o = &mut out[ri * d..(ri + 1) * d];
        for (j, &p) in sc.iter().enumerate().take(n) {
            for (oe, ve) in o.iter_mut().zip(&v[kvo + j * d..kvo + (j + 1) * d]) {
                *oe += p * f(ve);
            }
        }
        for oe in o.iter_mut() {
            *oe /= sum;
        }
    }
    out
}

/// The float64 definition of the whole output, `[B, H, T_q, D]` (small shapes).
pub fn reference<T: Element>(
    q: &[T],
    k: &[T],
    v: &[T],
    shape: &Shape,
    options: &Options,
) -> Vec<f64> {
    let rows: Vec<usize> = (0..shape.seq_len_q).collect();
    let mut out = Vec::with_capacity(shape.q_elems());
    for b in 0..shape.batch {
        for h in 0..shape.heads {
            out.extend(reference_rows(q, k, v, shape, options, (b, h), &rows));
        }
    }
    out
}

/// The float64 gradients dQ, dK, dV for dL/dO = `d_out` (small shapes): P from the
/// definition, dV = Pᵀ·dO, dP = dO·Vᵀ, dS = P ∘ (dP − rowsum(dP ∘ P)), dQ = scale·dS·K,
/// dK = scale·dSᵀ·Q, dK and dV summed over the query heads sharing a key head.
pub fn reference_gradients<T: Element>(
    q: &[T],
    k: &[T],
    v: &[T],
    d_out: &[T],
    shape: &Shape,
    options: &Options,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let s = shape;
    let (tq, tkv, d) = (s.seq_len_q, s.seq_len_kv, s.head_dim);
    let f = |x: &T| x.to_f32() as f64;
    let scale = options.scale_for(s);
    let (mut dq, mut dk, mut dv) = (
        vec![0.0; s.q_elems()],
        vec![0.0; s.kv_elems()],
        vec![0.0; s.kv_elems()],
    );
    for b in 0..s.batch {
        for h in 0..s.heads {
            let qo = (b * s.heads + h) * tq * d;
            let kvo = (b * s.kv_heads + h / (s.heads / s.kv_heads)) * tkv * d;
            for i in 0..tq {
                let n = s.visible_keys(i, options.causal);
                if n == 0 {
                    continue;
                }
                let qi = &q[qo + i * d..qo + (i + 1) * d];
                let doi = &d_out[qo + i * d..qo + (i + 1) * d];
                let sc: Vec<f64> = (0..n)
                    .map(|j| {
                        let kj = &k[kvo + j * d..kvo + (j + 1) * d];
                        qi.iter().zip(kj).map(|(a, b)| f(a) * f(b)).sum::<f64>() * scale
                    })
                    .collect();
                let mx = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = sc.iter().map(|x| (x - mx).exp()).sum();
                let p: Vec<f64> = sc.iter().map(|x| (x - mx).exp() / sum).collect();
                let dp: Vec<f64> = (0..n)
                    .map(|j| {
                        let vj = &v[kvo + j * d..kvo + (j + 1) * d];
                        doi.iter().zip(vj).map(|(a, b)| f(a) * f(b)).sum()
                    })
                    .collect();
                let delta: f64 = p.iter().zip(&dp).map(|(a, b)| a * b).sum();
                for j in 0..n {
                    let ds = p[j] * (dp[j] - delta);
                    for e in 0..d {
                        dq[qo + i * d + e] += scale * ds * f(&k[kvo + j * d + e]);
                        dk[kvo + j * d + e] += scale * ds * f(&qi[e]);
                        dv[kvo + j * d + e] += p[j] * f(&doi[e]);
                    }
                }
            }
        }
    }
    (dq, dk, dv)
}

/// Float64 reference values of a check plan's elements, in [`CheckPlan::ranges`] order, on
/// all of rayon's threads (self-attention shapes, as the plan is).
pub fn reference_values<T: Element>(
    q: &[T],
    k: &[T],
    v: &[T],
    shape: &Shape,
    options: &Options,
    plan: &CheckPlan,
) -> Vec<f64> {
    let per = plan
        .rows
        .len()
        .div_ceil(rayon::current_num_threads())
        .max(1);
    plan.slices
        .iter()
        .flat_map(|&(b, h)| {
            plan.rows
                .par_chunks(per)
                .map(|rows| reference_rows(q, k, v, shape, options, (b, h), rows))
                .collect::<Vec<_>>()
        })
        .flatten()
        .collect()
}

/// Reads raw little-endian elements of `T` (a runner input file).
///
/// # Errors
/// I/O errors, with the path; a length that is not a whole number of elements.
pub fn read_elements<T: Element>(path: &std::path::Path) -> anyhow::Result<Vec<T>> {
    use anyhow::Context;
    let b = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let size = T::TYPE.bytes();
    anyhow::ensure!(
        b.len() % size == 0,
        "{}: {} bytes is not a whole number of {} elements",
        path.display(),
        b.len(),
        T::TYPE.as_str()
    );
    Ok(b.chunks_exact(size).map(T::from_le_bytes).collect())
}

/// `n` standard-normal float32 values (Box–Muller on a seeded `StdRng`), deterministic in
/// `seed`: the fp32 inputs of the CPU runner. The 16-bit types use
/// [`super::cpu::normal_bits`].
pub fn normal_f32(n: usize, seed: u64) -> Vec<f32> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut out = Vec::with_capacity(n + 1);
    while out.len() < n {
        let u1: f64 = 1.0 - rng.random::<f64>(); // (0, 1]
        let u2: f64 = rng.random();
        let r = (-2.0 * u1.ln()).sqrt();
        let th = 2.0 * std::f64::consts::PI * u2;
        out.push((r * th.cos()) as f32);
        out.push((r * th.sin()) as f32);
    }
    out.truncate(n);
    out
}

#[cfg(test)]
mod tests {
    use super::super::cpu::{self, normal_bits};
    use super::super::{rel_l2, AttentionCase};
    use super::*;

    fn bf16s(n: usize, seed: u64) -> Vec<half::bf16> {
        normal_bits(n, Dtype::Bf16, seed)
            .into_iter()
            .map(half::bf16::from_bits)
            .collect()
    }

    fn err<T: Element>(got: &[T], want: &[f64]) -> f64 {
        let g: Vec<f64> = got.iter().map(|x| x.to_f32() as f64).collect();
        rel_l2(&g, want)
    }

    fn check<T: Element>(
        shape: Shape,
        causal: bool,
        tol: f64,
        make: impl Fn(usize, u64) -> Vec<T>,
    ) {
        let (q, k, v) = (
            make(shape.q_elems(), 1),
            make(shape.kv_elems(), 2),
            make(shape.kv_elems(), 3),
        );
        let opts = Options {
            causal,
            scale: None,
        };
        let got = dot_product_attention(&q, &k, &v, &shape, &opts).unwrap();
        let want = reference(&q, &k, &v, &shape, &opts);
        let e = err(&got, &want);
        assert!(e < tol, "{shape:?} causal {causal} {:?}: {e}", T::TYPE);
    }

    #[test]
    fn matches_float64_for_every_type_and_ragged_shapes() {
        // Lengths that are not multiples of the blocks, several key blocks, GQA.
        for shape in [
            Shape::self_attention(2, 4, 2, 300, 32),
            Shape::self_attention(1, 3, 3, 65, 64),
            Shape::self_attention(1, 2, 1, 1, 16),
            Shape::self_attention(1, 1, 1, 7, 128),
        ] {
            for causal in [false, true] {
                check(shape, causal, 4e-3, bf16s);
                check(shape, causal, 1e-3, |n, s| {
                    normal_bits(n, Dtype::F16, s)
                        .into_iter()
                        .map(half::f16::from_bits)
                        .collect::<Vec<_>>()
                });
                check(shape, causal, 2e-6, normal_f32);
            }
        }
    }

    #[test]
    fn the_reference_is_the_projects_reference() {
        for (causal, kv_heads) in [(false, 2), (true, 1)] {
            let c = AttentionCase {
                kv_heads,
                causal,
                ..AttentionCase::new(2, 2, 40, 16)
            };
            let bits = |n, s| normal_bits(n, Dtype::Bf16, s);
            let (q, k, v) = (
                bits(c.q_elems(), 4),
                bits(c.kv_elems(), 5),
                bits(c.kv_elems(), 6),
            );
            let as_bf16 = |x: &[u16]| {
                x.iter()
                    .map(|&b| half::bf16::from_bits(b))
                    .collect::<Vec<_>>()
            };
            let opts = Options {
                causal,
                scale: None,
            };
            let mine = reference(
                &as_bf16(&q),
                &as_bf16(&k),
                &as_bf16(&v),
                &Shape::of_case(&c),
                &opts,
            );
            let inp = cpu::Inputs {
                q,
                k,
                v,
                dout: Vec::new(),
            };
            // The same float64 arithmetic up to the order of its sums.
            let e = rel_l2(&mine, &cpu::forward_f64(&c, &inp).0);
            assert!(e < 1e-13, "{e}");
        }
    }

    #[test]
    fn causal_is_bottom_right_and_unseen_rows_are_zero() {
        // Q = 0: equal scores, so each row is the mean of the V rows it sees.
        let v: Vec<f32> = (0..5).flat_map(|j| [j as f32, 10.0 * j as f32]).collect();
        let k = vec![0.5f32; 10];
        let opts = Options {
            causal: true,
            scale: None,
        };
        let shape = Shape {
            batch: 1,
            heads: 1,
            kv_heads: 1,
            seq_len_q: 2,
            seq_len_kv: 5,
            head_dim: 2,
        };
        let o = dot_product_attention(&[0.0f32; 4], &k, &v, &shape, &opts).unwrap();
        assert_eq!(o, vec![1.5, 15.0, 2.0, 20.0]); // mean of V0..V3, of V0..V4
        let shape = Shape {
            seq_len_q: 5,
            seq_len_kv: 2,
            ..shape
        };
        let o = dot_product_attention(&[0.0f32; 10], &k[..4], &v[..4], &shape, &opts).unwrap();
        assert_eq!(o, vec![0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5, 5.0]);
        assert_eq!(
            reference(&[0.0f32; 10], &k[..4], &v[..4], &shape, &opts),
            o.iter().map(|&x| x as f64).collect::<Vec<_>>()
        );
    }

    #[test]
    fn cross_attention_scale_and_gqa() {
        let shape = Shape {
            batch: 2,
            heads: 4,
            kv_heads: 2,
            seq_len_q: 33,
            seq_len_kv: 520,
            head_dim: 48,
        };
        for causal in [false, true] {
            let opts = Options {
                causal,
                scale: Some(0.3),
            };
            let (q, k, v) = (
                normal_f32(shape.q_elems(), 7),
                normal_f32(shape.kv_elems(), 8),
                normal_f32(shape.kv_elems(), 9),
            );
            let got = dot_product_attention(&q, &k, &v, &shape, &opts).unwrap();
            let e = err(&got, &reference(&q, &k, &v, &shape, &opts));
            assert!(e < 2e-6, "{causal} {e}");
        }
        // V of kv head j filled with j: query head h outputs h / group exactly.
        let shape = Shape::self_attention(1, 8, 2, 20, 8);
        let q = normal_f32(shape.q_elems(), 1);
        let k = normal_f32(shape.kv_elems(), 2);
        let v: Vec<f32> = (0..shape.kv_elems())
            .map(|i| (i / (20 * 8)) as f32)
            .collect();
        let o = dot_product_attention(&q, &k, &v, &shape, &Options::default()).unwrap();
        for (i, x) in o.iter().enumerate() {
            // Exact up to the float32 rounding of Σp·j / Σp (two summation orders).
            let want = ((i / (20 * 8)) / 4) as f32;
            assert!((x - want).abs() <= 1e-6 * want, "{i}: {x} vs {want}");
        }
    }

    #[test]
    fn overflowing_fp16_scores_give_the_mean() {
        // Q = K = 24 at head_dim 128: raw dot products 73728 overflow fp16 (max 65504); computed
        // in float32 the scores are equal and the output is the mean of V.
        let shape = Shape::self_attention(1, 1, 1, 16, 128);
        let x = vec![half::f16::from_f32(24.0); shape.q_elems()];
        let v: Vec<half::f16> = (0..shape.kv_elems())
            .map(|i| half::f16::from_f32((i / 128) as f32))
            .collect();
        let o = dot_product_attention(&x, &x, &v, &shape, &Options::default()).unwrap();
        assert!(o.iter().all(|y| y.to_f32() == 7.5), "{:?}", &o[..4]);
    }

    #[test]
    fn bad_shapes_and_lengths_are_errors() {
        let s = Shape::self_attention(1, 3, 2, 4, 4);
        let x = vec![0.0f32; 48];
        assert!(matches!(
            dot_product_attention(&x, &x, &x, &s, &Options::default()),
            Err(AttentionError::Shape(..))
        ));
        let s = Shape::self_attention(1, 2, 1, 4, 4);
        let e = dot_product_attention(&x[..32], &x[..15], &x[..16], &s, &Options::default())
            .unwrap_err();
        assert_eq!(
            e,
            AttentionError::Length {
                name: "k",
                got: 15,
                want: 16
            }
        );
    }

    #[test]
    fn gradients_match_float64() {
        for (shape, causal) in [
            (Shape::self_attention(2, 4, 2, 300, 32), true),
            (Shape::self_attention(1, 2, 2, 65, 64), false),
            (
                Shape {
                    batch: 1,
                    heads: 2,
                    kv_heads: 1,
                    seq_len_q: 70,
                    seq_len_kv: 20,
                    head_dim: 16,
                },
                true,
            ),
            (
                Shape {
                    batch: 1,
                    heads: 3,
                    kv_heads: 3,
                    seq_len_q: 5,
                    seq_len_kv: 300,
                    head_dim: 8,
                },
                true,
            ),
        ] {
            let opts = Options {
                causal,
                scale: Some(0.3),
            };
            let (q, k, v, g) = (
                normal_f32(shape.q_elems(), 1),
                normal_f32(shape.kv_elems(), 2),
                normal_f32(shape.kv_elems(), 3),
                normal_f32(shape.q_elems(), 4),
            );
            let (o, grads) = dot_product_attention_vjp(&q, &k, &v, &g, &shape, &opts).unwrap();
            let want_o = reference(&q, &k, &v, &shape, &opts);
            assert!(err(&o, &want_o) < 2e-6);
            let (dq, dk, dv) = reference_gradients(&q, &k, &v, &g, &shape, &opts);
            for (name, got, want) in [
                ("dq", &grads.dq, dq),
                ("dk", &grads.dk, dk),
                ("dv", &grads.dv, dv),
            ] {
                let e = err(got, &want);
                assert!(e < 1e-5, "{shape:?} causal {causal} {name}: {e}");
            }
            // bf16 inputs: results rounded to bf16.
            let to16 = |x: &[f32]| {
                x.iter()
                    .map(|&y| half::bf16::from_f32(y))
                    .collect::<Vec<_>>()
            };
            let (q, k, v, g) = (to16(&q), to16(&k), to16(&v), to16(&g));
            let (_, grads) = dot_product_attention_vjp(&q, &k, &v, &g, &shape, &opts).unwrap();
            let (dq, dk, dv) = reference_gradients(&q, &k, &v, &g, &shape, &opts);
            for (name, got, want) in [
                ("dq", &grads.dq, dq),
                ("dk", &grads.dk, dk),
                ("dv", &grads.dv, dv),
            ] {
                let e = err(got, &want);
                assert!(e < 1e-2, "bf16 {shape:?} causal {causal} {name}: {e}");
            }
        }
    }

    #[test]
    fn lse_is_the_log_sum_exp_and_unseen_rows_have_zero_gradients() {
        let shape = Shape {
            batch: 1,
            heads: 1,
            kv_heads: 1,
            seq_len_q: 5,
            seq_len_kv: 2,
            head_dim: 4,
        };
        let opts = Options {
            causal: true,
            scale: None,
        };
        let (q, k, v) = (normal_f32(20, 1), normal_f32(8, 2), normal_f32(8, 3));
        let mut o = vec![0.0f32; 20];
        let mut lse = vec![0.0f32; 5];
        dot_product_attention_lse_into(&q, &k, &v, &shape, &opts, &mut o, &mut lse).unwrap();
        assert_eq!(&lse[..3], &[f32::NEG_INFINITY; 3]);
        let s = |i: usize, j: usize| -> f64 {
            (0..4)
                .map(|e| q[i * 4 + e] as f64 * k[j * 4 + e] as f64)
                .sum::<f64>()
                * 0.5
        };
        let want4 = (s(4, 0).exp() + s(4, 1).exp()).ln();
        assert!((lse[3] as f64 - s(3, 0)).abs() < 1e-5 && (lse[4] as f64 - want4).abs() < 1e-5);
        let g = normal_f32(20, 4);
        let grads =
            dot_product_attention_backward(&q, &k, &v, &o, &g, &lse, &shape, &opts).unwrap();
        assert!(grads.dq[..12].iter().all(|&x| x == 0.0));
        assert!(grads
            .dq
            .iter()
            .chain(&grads.dk)
            .chain(&grads.dv)
            .all(|x| x.is_finite()));
    }

    #[test]
    fn output_is_deterministic() {
        let shape = Shape::self_attention(2, 2, 2, 200, 64);
        let (q, k, v) = (
            bf16s(shape.q_elems(), 1),
            bf16s(shape.kv_elems(), 2),
            bf16s(shape.kv_elems(), 3),
        );
        let opts = Options {
            causal: true,
            scale: None,
        };
        let a = dot_product_attention(&q, &k, &v, &shape, &opts).unwrap();
        for _ in 0..3 {
            assert_eq!(a, dot_product_attention(&q, &k, &v, &shape, &opts).unwrap());
        }
    }
}
