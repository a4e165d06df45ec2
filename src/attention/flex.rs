//! Attention with generated masks and score modifications on the GPU (issue 10 §1): the
//! `flex_attention(q, k, v, score_mod, mask_mod)` interface of FlexAttention (He, Guessous,
//! Liang, Zhang and others, 2024), with the modifications given as small CUDA C expressions that
//! are generated into the forward (`kernels/flex_attn_fwd_sm90.cu` or `kernels/flex_attn_fwd.cu`:
//! [`FlexKernel`]) and the backward and compiled by NVRTC, and a float64 reference that applies
//! the same modification densely.
//!
//! A mask expression is a `bool` of `b, h, q_idx, kv_idx` (batch entry, query head, query
//! position, key position) and of `num_heads, seq_len_q, seq_len_kv` and `aux` (a `const int*`
//! the caller fills, e.g. document ids); a score expression is a `float` of `score` (the scaled
//! dot product q·k · scale, natural units) and the same names. Either may call CUDA's math
//! functions and `kp_tanh` (an approximate tanh on the multi-function unit). Both are compiled once per
//! (expressions, head_dim, dtype): the lengths are kernel arguments, so a sweep over seq_len
//! compiles once. The block mask (which key tiles each query tile needs, and which of them the
//! mask leaves whole) is computed on the device once per (mask, shape, `aux`, `kv_lens`) by
//! evaluating the mask over every pair; the forward then never loads a tile the mask empties
//! and evaluates the mask only in partial tiles.
//!
//! Shapes and dtypes: Q `[batch, heads, seq_len_q, head_dim]`, K and V `[batch, kv_heads,
//! seq_len_kv, head_dim]` (GQA: heads a multiple of kv_heads), O like Q, all bf16 or fp16 (16-bit
//! words); LSE `[batch, heads, seq_len_q]` f32, natural log, +∞ for a row that sees no key (its
//! output is 0, never NaN); `kv_lens` `[batch]` i32 (keys at or past it are never visible).
//! head_dim 64 or 128.
//!
//! The forward runs one of two kernels ([`FlexKernel`]): on compute capability 9.0 with a
//! positive scale, the modifications inside the wgmma forward (`kernels/flex_attn_fwd_sm90.cu`
//! on `kernels/attn_wgmma_sm90.cu`: 128 × 128 tiles by TMA, warp-specialised, FlashAttention-3's
//! overlaps); elsewhere the portable mma.sync kernel (`kernels/flex_attn_fwd.cu`, 128 × 64
//! tiles). The block mask is computed at the forward kernel's tiles. The backward
//! ([`FlexBwdKernel`]) follows: on compute capability 9.0 with a positive scale, the
//! modifications inside the wgmma backward (`kernels/flex_attn_bwd_sm90.cu` on
//! `kernels/attn_wgmma_bwd_sm90.cu`) unless [`BWD_SM90_ENV`] is `0`; elsewhere the portable
//! mma.sync kernel (`kernels/flex_attn_bwd.cu`).

use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig, PushKernelArg};

use super::cuda::{FLASH_BWD_SRC, PRELUDE_SRC};
use super::Dtype;
use crate::gpu::{Gpu, GpuError};

/// Source of the flex kernels (after [`PRELUDE_SRC`] and the generated functions).
pub const FLEX_SRC: &str = include_str!("../../kernels/flex_attn_fwd.cu");

/// Warps per CTA of the forward (`NW`).
pub const FLEX_WARPS: usize = 4;
/// 16-row groups per warp of the forward (`MT`): 4 × 2 (128-row CTAs, flash's tuned layout)
/// measured 3–20 % faster than 4 × 1 on five of the six named masks at head_dim 128 despite
/// spilling 88–124 bytes there, and 6 % slower on the document mask; 8 × 1 was slower than both
/// (kernels/TUNING.md, flex v1.1 and v1.2).
pub const FLEX_M_TILES: usize = 2;
/// Query rows per CTA of the forward (`BR` = 16 · MT · NW), also the block mask's query
/// granularity.
pub const FLEX_ROWS: usize = 16 * FLEX_M_TILES * FLEX_WARPS;
/// Keys per tile (`BCT`), also the block mask's key granularity.
pub const FLEX_KEYS: usize = 64;
/// Threads per CTA of both kernels.
const THREADS: usize = 32 * FLEX_WARPS;
/// Head dimensions the forward is instantiated for.
pub const FLEX_HEAD_DIMS: [usize; 2] = [64, 128];

/// Source of the flex forward on the wgmma kernel (after the wgmma source with no dense kernel
/// selected, the generated functions and [`FLEX_SRC`]).
pub const FLEX_SM90_SRC: &str = include_str!("../../kernels/flex_attn_fwd_sm90.cu");

/// Set to `0`, keeps flex's forward on the portable kernel on compute capability 9.0 too (to
/// time the two against each other).
pub const SM90_ENV: &str = "KP_FLEX_SM90";

/// Whether this process's [`SM90_ENV`] keeps flex's forward on the portable kernel (`0`).
pub fn sm90_forward_off() -> bool {
    std::env::var(SM90_ENV).is_ok_and(|v| v.trim() == "0")
}

/// Whether this process's [`BWD_SM90_ENV`] keeps flex's backward on the portable kernel (`0`).
pub fn sm90_backward_off() -> bool {
    std::env::var(BWD_SM90_ENV).is_ok_and(|v| v.trim() == "0")
}

/// Whether flex's wgmma kernels (forward and backward) can run `shape` on a device of
/// architecture `arch`: compute capability 9.0 (`sm_90a`) and a positive finite scale.
fn wgmma_applies(arch: &str, shape: &FlexShape) -> bool {
    arch == "sm_90a" && shape.scale > 0.0 && shape.scale.is_finite()
}

/// The forward kernel a [`FlexAttention`] runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlexKernel {
    /// `kernels/flex_attn_fwd.cu`: FlashAttention-2's forward on mma.sync (compute capability
    /// 8.0 or newer), [`FLEX_ROWS`] × [`FLEX_KEYS`] tiles, any scale.
    Portable,
    /// `kernels/flex_attn_fwd_sm90.cu`: the wgmma forward's version 3 (compute capability 9.0
    /// only; `sm90::Sm90Version::V3`), always with its ping-pong between consumers (the dense
    /// kernel's `KP_SM90_FWD_PINGPONG` switch does not reach it), one CTA per query tile,
    /// [`super::sm90::WS_ROWS`] × [`super::sm90::WS_KEYS`] tiles, a positive scale.
    Wgmma,
}

impl FlexKernel {
    /// The kernel [`FlexAttention::new`] picks on a device of architecture `arch` (e.g.
    /// `sm_90a`) for `shape`: the wgmma kernel on `sm_90a` with a positive finite scale unless
    /// [`SM90_ENV`] is `0`, the portable one otherwise.
    pub fn for_call(arch: &str, shape: &FlexShape) -> FlexKernel {
        if wgmma_applies(arch, shape) && !sm90_forward_off() {
            FlexKernel::Wgmma
        } else {
            FlexKernel::Portable
        }
    }

    /// (query rows, keys) per tile of the forward, also its block mask's granularity.
    pub fn tile(self) -> (usize, usize) {
        match self {
            FlexKernel::Portable => (FLEX_ROWS, FLEX_KEYS),
            FlexKernel::Wgmma => (super::sm90::WS_ROWS, super::sm90::WS_KEYS),
        }
    }

    /// Threads per CTA of the forward: 4 warps, or a producer and two consumer warpgroups.
    fn threads(self) -> usize {
        match self {
            FlexKernel::Portable => THREADS,
            FlexKernel::Wgmma => 128 * (1 + super::sm90::WS_ROWS / 64),
        }
    }

    /// The kernel in a row's note, e.g. `the wgmma forward (kernels/flex_attn_fwd_sm90.cu)`.
    pub fn describe(self) -> String {
        let (rows, keys) = self.tile();
        match self {
            FlexKernel::Portable => format!(
                "the portable mma.sync forward (kernels/flex_attn_fwd.cu, {rows} × {keys} tiles)"
            ),
            FlexKernel::Wgmma => format!(
                "the wgmma forward (kernels/flex_attn_fwd_sm90.cu, {rows} × {keys} tiles by TMA)"
            ),
        }
    }
}

/// Set to `0`, keeps flex's backward on the portable kernel on compute capability 9.0 too (to
/// time the two against each other; kernels/TUNING.md, "Flex's backward on the wgmma kernel").
pub const BWD_SM90_ENV: &str = "KP_FLEX_BWD_SM90";

/// The backward kernel a [`FlexAttention`] runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlexBwdKernel {
    /// `kernels/flex_attn_bwd.cu`: FlashAttention-2's backward on mma.sync (compute capability
    /// 8.0 or newer) over a transposed block mask of [`FLEX_BWD_ROWS`]-row query steps and
    /// [`FLEX_BWD_KEYS`]-key tiles, dQ summed with fp32 atomics.
    Portable,
    /// `kernels/flex_attn_bwd_sm90.cu` inside the wgmma backward (`attn_wgmma_bwd_sm90.cu`;
    /// compute capability 9.0 only): TMA loads, warp specialisation, dK and dV in registers,
    /// dQ by fp32 TMA reduce-adds; query steps of [`super::sm90::bwd_queries`] rows and 128-key
    /// tiles; a positive scale.
    Wgmma,
}

impl FlexBwdKernel {
    /// The backward [`FlexAttention::enable_backward`] picks on a device of architecture
    /// `arch` for `shape`: the wgmma one on `sm_90a` with a positive finite scale unless
    /// [`BWD_SM90_ENV`] is `0`, the portable one otherwise.
    pub fn for_call(arch: &str, shape: &FlexShape) -> FlexBwdKernel {
        if wgmma_applies(arch, shape) && !sm90_backward_off() {
            FlexBwdKernel::Wgmma
        } else {
            FlexBwdKernel::Portable
        }
    }

    /// (query rows, keys) per step of the backward, also its transposed block mask's tiles.
    pub fn tile(self, head_dim: usize) -> (usize, usize) {
        match self {
            FlexBwdKernel::Portable => (FLEX_BWD_ROWS, FLEX_BWD_KEYS),
            FlexBwdKernel::Wgmma => (super::sm90::bwd_queries(head_dim), super::sm90::BWD_KEYS),
        }
    }

    /// The kernel in a row's note, at `head_dim`.
    pub fn describe(self, head_dim: usize) -> String {
        let (rows, keys) = self.tile(head_dim);
        match self {
            FlexBwdKernel::Portable => format!(
                "the portable mma.sync backward (kernels/flex_attn_bwd.cu, {rows}-query steps, \
                 {keys}-key tiles)"
            ),
            FlexBwdKernel::Wgmma => format!(
                "the wgmma backward (kernels/flex_attn_bwd_sm90.cu, {rows}-query steps, {keys}-key \
                 tiles by TMA)"
            ),
        }
    }
}

/// Source of the flex backward on the wgmma kernel (after the wgmma backward's source without a
/// dense main kernel, the generated functions and [`FLEX_SRC`]).
pub const FLEX_BWD_SM90_SRC: &str = include_str!("../../kernels/flex_attn_bwd_sm90.cu");

/// The names of the wgmma flex backward's kernels (transposed block mask, preprocessing, main,
/// dQ conversion) and their source for `spec` at `head_dim` and `dtype` (bf16 or fp16).
///
/// # Errors
/// A score modification without its derivative (as [`flex_bwd_source`]).
///
/// # Panics
/// For fp32 (the flex shapes refuse it first).
pub fn flex_bwd_sm90_source(
    spec: &FlexSpec,
    head_dim: usize,
    dtype: Dtype,
) -> Result<([String; 4], String), String> {
    check_derivative(spec)?;
    let has_score = spec.score.is_some();
    let (rows, keys) = FlexBwdKernel::Wgmma.tile(head_dim);
    let names = [
        "flex_block_mask_t_sm90_kernel".to_string(),
        format!("attn_bwd_sm90_pre_d{head_dim}"),
        format!("flex_bwd_sm90_{}_d{head_dim}", dtype.as_str()),
        "attn_bwd_sm90_dq_convert".to_string(),
    ];
    // The wgmma backward's preprocessing and dQ conversion, without its dense main kernels.
    let bwd = super::sm90::bwd_source_for(Some(head_dim), dtype);
    let src = format!(
        "#define KP_SM90_BWD_NO_MAIN\n{bwd}\n{generated}\n{FLEX_SRC}\n{FLEX_BWD_SM90_SRC}\n\
         extern \"C\" __global__ void __launch_bounds__({BWD_MASK_THREADS}) {block}(const int* \
         kv_lens, const int* aux, int* q_count, int* q_index, unsigned char* q_full, int Tq, int \
         Tkv, int H) {{ flex_block_mask_t<{rows}, {keys}>(kv_lens, aux, q_count, q_index, \
         q_full, Tq, Tkv, H); }}\n\
         extern \"C\" __global__ void __launch_bounds__(384, 1) {main}(const __grid_constant__ \
         TmaMap tq, const __grid_constant__ TmaMap tk, const __grid_constant__ TmaMap tv, const \
         __grid_constant__ TmaMap tdo, const __grid_constant__ TmaMap tdq, const float* lse2, \
         const float* dsum, const int* kv_lens, const int* aux, const int* q_count, const int* \
         q_index, const unsigned char* q_full, u16* dK, u16* dV, int Tq, int Tkv, int H, int \
         KVH, int Tq_pad, float scale_log2, float scale, int B) {{ flex_bwd_sm90<{head_dim}, \
         {has_score}>(&tq, &tk, &tv, &tdo, &tdq, lse2, dsum, kv_lens, aux, q_count, q_index, \
         q_full, dK, dV, Tq, Tkv, H, KVH, Tq_pad, scale_log2, scale, B); }}\n",
        generated = generated_functions(spec),
        block = names[0],
        main = names[2],
    );
    Ok((names, src))
}

/// The modifications this project names, each as CUDA C for the kernel and as the float64
/// function the reference applies. `Causal` and the masks built on it align bottom-right (query
/// i sees key j when j ≤ i + seq_len_kv − seq_len_q), as the rest of the attention suite does.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum FlexMod {
    /// Causal (bottom-right).
    Causal,
    /// Causal sliding window of `w` keys (Longformer / Mistral's local attention): key j visible
    /// to query i when 0 ≤ (i + seq_len_kv − seq_len_q) − j < w.
    SlidingWindow(usize),
    /// Packed sequences (a document mask), causal within each document: `aux[b · seq_len_kv +
    /// t]` is the document of position t; query i (position i + seq_len_kv − seq_len_q) sees
    /// key j of the same document when causal allows it.
    Document,
    /// Prefix-LM (T5 / UniLM): the first `p` keys are visible to every query, the rest causally.
    PrefixLm(usize),
    /// ALiBi (Press, Smith and Lewis, 2022) with a causal mask: score + m_h · (j − i'), i' = i +
    /// seq_len_kv − seq_len_q, m_h = 2^(−8 (h + 1) / num_heads).
    Alibi,
    /// Logit soft-capping (Gemma 2): `cap · tanh(score / cap)`, no mask; the cap a finite number
    /// above 0.
    SoftCap(f32),
}

impl FlexMod {
    /// Name in documents and messages, e.g. `sliding_window(256)`.
    pub fn name(&self) -> String {
        match self {
            FlexMod::Causal => "causal".into(),
            FlexMod::SlidingWindow(w) => format!("sliding_window({w})"),
            FlexMod::Document => "document".into(),
            FlexMod::PrefixLm(p) => format!("prefix_lm({p})"),
            FlexMod::Alibi => "alibi".into(),
            FlexMod::SoftCap(c) => format!("softcap({c})"),
        }
    }

    /// The modification named `name` (as [`FlexMod::name`] writes it), or `None` for `none`
    /// (no mask, no modification).
    ///
    /// # Errors
    /// An unknown name or a bad argument, with the names this parses.
    pub fn parse(name: &str) -> Result<Option<FlexMod>, String> {
        let arg = |prefix: &str| {
            name.strip_prefix(prefix)
                .and_then(|r| r.strip_prefix('('))
                .and_then(|r| r.strip_suffix(')'))
        };
        let bad = || {
            format!(
                "unknown mask `{name}` (none, causal, sliding_window(W), document, prefix_lm(P), \
                 alibi, softcap(C))"
            )
        };
        Ok(Some(match name {
            "none" => return Ok(None),
            "causal" => FlexMod::Causal,
            "document" => FlexMod::Document,
            "alibi" => FlexMod::Alibi,
            _ => {
                if let Some(w) = arg("sliding_window") {
                    FlexMod::SlidingWindow(w.parse().ok().filter(|&w| w > 0).ok_or_else(bad)?)
                } else if let Some(p) = arg("prefix_lm") {
                    FlexMod::PrefixLm(p.parse().map_err(|_| bad())?)
                } else if let Some(c) = arg("softcap") {
                    let c: f32 = c.parse().map_err(|_| bad())?;
                    if !(c.is_finite() && c > 0.0) {
                        return Err(bad());
                    }
                    FlexMod::SoftCap(c)
                } else {
                    return Err(bad());
                }
            }
        }))
    }

    /// d [`FlexMod::modify`] / d score at `score`: 1, or 1 − tanh²(score / cap) for soft-capping.
    pub fn derivative(&self, score: f64) -> f64 {
        match *self {
            FlexMod::SoftCap(c) => {
                let t = (score / c as f64).tanh();
                1.0 - t * t
            }
            _ => 1.0,
        }
    }

    /// The CUDA C expressions of this modification.
    pub fn spec(&self) -> FlexSpec {
        const CAUSAL: &str = "kv_idx <= q_idx + (seq_len_kv - seq_len_q)";
        let (mask, score, score_grad) = match *self {
            FlexMod::Causal => (Some(CAUSAL.to_string()), None, None),
            FlexMod::SlidingWindow(w) => (
                Some(format!(
                    "{CAUSAL} && q_idx + (seq_len_kv - seq_len_q) - kv_idx < {w}"
                )),
                None,
                None,
            ),
            // `&`, not `&&`: both sides are evaluated, so the two loads from aux are not
            // behind a branch on the causal test and a tile's loads can be issued together
            // (with `&&` each pair's loads waited in turn: kernels/TUNING.md, "The document
            // mask's partial tiles"). Evaluated always, the query's index into aux is clamped at
            // 0: with more queries than keys the first rows' positions are negative (they see
            // no key: the causal test is false there whatever aux holds, so an entry's row may
            // read the previous entry's ids). Clamping the position alone instead spilled 4-44
            // bytes in the wgmma forward.
            FlexMod::Document => (
                Some(format!(
                    "({CAUSAL}) & (aux[b * seq_len_kv + kv_idx] == aux[max(b * seq_len_kv + \
                     q_idx + (seq_len_kv - seq_len_q), 0)])"
                )),
                None,
                None,
            ),
            FlexMod::PrefixLm(p) => (Some(format!("kv_idx < {p} || {CAUSAL}")), None, None),
            FlexMod::Alibi => (
                Some(CAUSAL.to_string()),
                Some(
                    "score + exp2f(-8.0f * (float)(h + 1) / (float)num_heads) * (float)(kv_idx - \
                     q_idx - (seq_len_kv - seq_len_q))"
                        .to_string(),
                ),
                Some("1.0f".to_string()),
            ),
            // tanh on the multi-function unit (kp_tanh): one instruction per score instead of
            // tanhf's exponential, reciprocal and branch. The division by the cap stays: as a
            // product by its float reciprocal it pushed the portable forward's spills at
            // head_dim 128 from 124 to 148 bytes, past tests/kernels_compile.rs's bound.
            FlexMod::SoftCap(c) => (
                None,
                Some(format!("{c:?}f * kp_tanh(score / {c:?}f)")),
                Some(format!(
                    "1.0f - kp_tanh(score / {c:?}f) * kp_tanh(score / {c:?}f)"
                )),
            ),
        };
        FlexSpec {
            name: self.name(),
            mask,
            score,
            score_grad,
        }
    }

    /// Whether query `q` of batch entry `b` sees key `kv` (the reference's mask; the named masks
    /// do not depend on the head).
    ///
    /// # Panics
    /// For [`FlexMod::Document`] when `aux` holds fewer than `(b + 1) · seq_len_kv` ids.
    #[allow(clippy::too_many_arguments)]
    pub fn visible(
        &self,
        b: usize,
        q: usize,
        kv: usize,
        seq_len_q: usize,
        seq_len_kv: usize,
        aux: &[i32],
    ) -> bool {
        let qi = (q + seq_len_kv) as i64 - seq_len_q as i64; // the query's position among keys
        let kv_i = kv as i64;
        let causal = kv_i <= qi;
        match *self {
            FlexMod::Causal | FlexMod::Alibi => causal,
            FlexMod::SlidingWindow(w) => causal && qi - kv_i < w as i64,
            FlexMod::Document => {
                causal && aux[b * seq_len_kv + kv] == aux[b * seq_len_kv + qi as usize]
            }
            FlexMod::PrefixLm(p) => kv < p || causal,
            FlexMod::SoftCap(_) => true,
        }
    }

    /// The modified score of `score` (scaled q·k, natural units) for query `q` of head `h` and
    /// key `kv` (the reference's score_mod, in float64).
    #[allow(clippy::too_many_arguments)]
    pub fn modify(
        &self,
        score: f64,
        h: usize,
        q: usize,
        kv: usize,
        heads: usize,
        seq_len_q: usize,
        seq_len_kv: usize,
    ) -> f64 {
        match *self {
            FlexMod::Alibi => {
                let slope = (-8.0 * (h + 1) as f64 / heads as f64).exp2();
                score + slope * (kv as f64 - q as f64 - (seq_len_kv as f64 - seq_len_q as f64))
            }
            FlexMod::SoftCap(c) => {
                let c = c as f64;
                c * (score / c).tanh()
            }
            _ => score,
        }
    }
}

/// A mask and a score modification as CUDA C expressions (see the module's documentation for
/// the names they may use); `None` is no mask (every key below `kv_lens`) or no modification.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FlexSpec {
    /// Name in documents and messages.
    pub name: String,
    /// `bool` expression: whether `q_idx` sees `kv_idx`.
    pub mask: Option<String>,
    /// `float` expression: the modified `score`.
    pub score: Option<String>,
    /// `float` expression: d `score` expression / d `score`, for the backward (same names);
    /// needed when `score` is given and the backward runs.
    pub score_grad: Option<String>,
}

/// The attention shape of a flex call.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FlexShape {
    /// Batch entries.
    pub batch: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (a divisor of `heads`).
    pub kv_heads: usize,
    /// Query rows per head.
    pub seq_len_q: usize,
    /// Key rows per head (the K/V buffers' length; `kv_lens` may be shorter).
    pub seq_len_kv: usize,
    /// Head dimension (64 or 128).
    pub head_dim: usize,
    /// bf16 or fp16.
    pub dtype: Dtype,
    /// Score scale (usually head_dim^−1/2).
    pub scale: f64,
}

impl FlexShape {
    /// The flex shape of `shape` in `dtype` with softmax scale `scale`.
    pub fn new(shape: &super::cpu_flash::Shape, dtype: Dtype, scale: f64) -> FlexShape {
        FlexShape {
            batch: shape.batch,
            heads: shape.heads,
            kv_heads: shape.kv_heads,
            seq_len_q: shape.seq_len_q,
            seq_len_kv: shape.seq_len_kv,
            head_dim: shape.head_dim,
            dtype,
            scale,
        }
    }

    /// Why the kernels cannot run this shape, or `None`.
    pub fn unsupported(&self) -> Option<String> {
        if !FLEX_HEAD_DIMS.contains(&self.head_dim) {
            return Some(format!(
                "flex_attention runs head_dim {FLEX_HEAD_DIMS:?}, not {}",
                self.head_dim
            ));
        }
        if !matches!(self.dtype, Dtype::Bf16 | Dtype::F16) {
            return Some(format!(
                "flex_attention runs bf16 or fp16, not {}",
                self.dtype.as_str()
            ));
        }
        if self.kv_heads == 0 || !self.heads.is_multiple_of(self.kv_heads) {
            return Some(format!(
                "heads {} not a multiple of kv_heads {}",
                self.heads, self.kv_heads
            ));
        }
        if self.seq_len_q == 0 || self.seq_len_kv == 0 || self.batch == 0 {
            return Some("an empty dimension".into());
        }
        None
    }

    /// Elements of Q (and O, dO, dQ) and of K (and V, dK, dV).
    fn elems(&self) -> (usize, usize) {
        (
            self.batch * self.heads * self.seq_len_q * self.head_dim,
            self.batch * self.kv_heads * self.seq_len_kv * self.head_dim,
        )
    }

    /// [`GpuError::Config`] naming the buffers whose lengths (`(name, length, words or floats
    /// wanted)`) do not fit this shape.
    fn check_lengths(&self, what: &str, lens: &[(&str, usize, usize)]) -> Result<(), GpuError> {
        let bad: Vec<String> = lens
            .iter()
            .filter(|(_, got, want)| got != want)
            .map(|(name, got, want)| format!("{name} {got} (wants {want})"))
            .collect();
        if bad.is_empty() {
            Ok(())
        } else {
            Err(GpuError::Config(format!(
                "{what}: buffer lengths do not fit the shape: {}",
                bad.join(", ")
            )))
        }
    }

    /// The kernels' scalar arguments: (Tq, Tkv, H, KVH, scale).
    fn kernel_args(&self) -> (i32, i32, i32, i32, f32) {
        (
            self.seq_len_q as i32,
            self.seq_len_kv as i32,
            self.heads as i32,
            self.kv_heads as i32,
            self.scale as f32,
        )
    }

    /// Query tiles of `rows` rows.
    fn query_tiles(&self, rows: usize) -> usize {
        self.seq_len_q.div_ceil(rows)
    }

    /// Key tiles of `keys` keys.
    fn key_tiles(&self, keys: usize) -> usize {
        self.seq_len_kv.div_ceil(keys)
    }
}

/// The names of the block-mask and forward kernels and their source for `spec` at `head_dim`
/// and `dtype` (bf16 or fp16).
pub fn flex_source(spec: &FlexSpec, head_dim: usize, dtype: Dtype) -> (String, String, String) {
    let bf = dtype == Dtype::Bf16;
    let has_score = spec.score.is_some();
    let block = "flex_block_mask_kernel".to_string();
    let fwd = format!("flex_fwd_{}_d{head_dim}", dtype.as_str());
    let src = format!(
        "{PRELUDE_SRC}\n{generated}\n\
         {FLEX_SRC}\n\
         extern \"C\" __global__ void __launch_bounds__({THREADS}) {block}(const int* kv_lens, \
         const int* aux, int* kv_count, int* kv_index, unsigned char* kv_full, int Tq, int Tkv, \
         int H) {{ flex_block_mask<{FLEX_ROWS}, {FLEX_KEYS}>(kv_lens, aux, kv_count, kv_index, \
         kv_full, Tq, Tkv, H); }}\n\
         extern \"C\" __global__ void __launch_bounds__({THREADS}) {fwd}(const u16* Q, const u16* \
         K, const u16* V, u16* O, float* LSE, const int* kv_lens, const int* aux, const int* \
         kv_count, const int* kv_index, const unsigned char* kv_full, int Tq, int Tkv, int H, \
         int KVH, float scale) {{ flex_fwd<{head_dim}, {FLEX_WARPS}, {FLEX_M_TILES}, {FLEX_KEYS}, {bf}, {has_score}>(Q, \
         K, V, O, LSE, kv_lens, aux, kv_count, kv_index, kv_full, Tq, Tkv, H, KVH, scale); }}\n",
        generated = generated_functions(spec)
    );
    (block, fwd, src)
}

/// The names of the block-mask and forward kernels of the wgmma flex forward
/// ([`FlexKernel::Wgmma`]) and their source for `spec` at `head_dim` and `dtype` (bf16 or fp16):
/// the wgmma source with no dense kernel selected, the generated functions, [`FLEX_SRC`] (for
/// its block-mask template, here at the wgmma kernel's tiles) and [`FLEX_SM90_SRC`].
///
/// # Panics
/// For fp32 (the flex shapes refuse it first).
pub fn flex_sm90_source(
    spec: &FlexSpec,
    head_dim: usize,
    dtype: Dtype,
) -> (String, String, String) {
    let has_score = spec.score.is_some();
    let (rows, keys) = FlexKernel::Wgmma.tile();
    let threads = FlexKernel::Wgmma.threads();
    let block = "flex_block_mask_sm90_kernel".to_string();
    let fwd = format!("flex_fwd_sm90_{}_d{head_dim}", dtype.as_str());
    // `KP_SM90_flex` selects no dense kernel: the module holds the two below.
    let wgmma = super::sm90::wgmma_source_with(Some("flex"), dtype, false, true);
    let src = format!(
        "{wgmma}\n{generated}\n{FLEX_SRC}\n{FLEX_SM90_SRC}\n\
         extern \"C\" __global__ void __launch_bounds__({THREADS}) {block}(const int* kv_lens, \
         const int* aux, int* kv_count, int* kv_index, unsigned char* kv_full, int Tq, int Tkv, \
         int H) {{ flex_block_mask<{rows}, {keys}>(kv_lens, aux, kv_count, kv_index, kv_full, Tq, \
         Tkv, H); }}\n\
         extern \"C\" __global__ void __launch_bounds__({threads}, 1) {fwd}(const \
         __grid_constant__ TmaMap tq, const __grid_constant__ TmaMap tk, const \
         __grid_constant__ TmaMap tv, const __grid_constant__ TmaMap to, u16* O, float* LSE, \
         const int* kv_lens, const int* aux, const int* kv_count, const int* kv_index, const \
         unsigned char* kv_full, int Tq, int Tkv, int H, int KVH, float scale, float \
         scale_log2) {{ flex_fwd_sm90<{head_dim}, {has_score}>(&tq, &tk, &tv, &to, O, LSE, \
         kv_lens, aux, kv_count, kv_index, kv_full, Tq, Tkv, H, KVH, scale, scale_log2); }}\n",
        generated = generated_functions(spec)
    );
    (block, fwd, src)
}

/// Dynamic shared memory of the wgmma flex forward, bytes: the dense version 3's (two 64-row Q
/// tiles, two stages of K and V tiles, the mbarriers, up to 1023 bytes of alignment).
pub fn flex_sm90_smem_bytes(head_dim: usize) -> usize {
    use super::sm90::{WS_KEYS, WS_ROWS, WS_STAGES};
    (WS_ROWS + 2 * WS_STAGES * WS_KEYS) * head_dim * 2 + 8 * (2 + 4 * WS_STAGES) + 1024
}

/// `kp_tanh(x)`, the helper the expressions may call: tanh on the multi-function unit (PTX
/// `tanh.approx.f32`, compute capability 7.5 and later), one instruction where `tanhf` takes an
/// exponential, a reciprocal and a branch; its relative error is about 2⁻¹¹ (PTX ISA), far below
/// a bf16 output's 2⁻⁸. Soft-capping uses it.
const KP_TANH: &str = "__device__ __forceinline__ float kp_tanh(float x) { float y; \
                       asm(\"tanh.approx.f32 %0, %1;\" : \"=f\"(y) : \"f\"(x)); return y; }\n";

/// `flex_visible(b, h, row, col, num_heads, seq_len_q, seq_len_kv, L, aux)`, the kernels' mask
/// test in a partial tile: the pair is in bounds (row below seq_len_q, col below the batch
/// entry's key length L) and `kp_mask` allows it. Without a branch: `kp_mask` sees the indices
/// clamped into bounds (an expression may index `aux` by them; a tile is listed only where L
/// is at least 1) and the tests are combined with `&`, so that the loads of a tile's pairs (the
/// document mask's two from `aux`) are issued together instead of one pair at a time behind
/// each pair's guard (kernels/TUNING.md, "The document mask's partial tiles").
const FLEX_VISIBLE: &str = "__device__ __forceinline__ bool flex_visible(int b, int h, int row, \
    int col, int num_heads, int seq_len_q, int seq_len_kv, int L, const int* aux) { return \
    (row < seq_len_q) & (col < L) & kp_mask(b, h, min(row, seq_len_q - 1), min(col, L - 1), \
    num_heads, seq_len_q, seq_len_kv, aux); }\n";

/// The generated device functions of `spec`: `kp_tanh` ([`KP_TANH`]), `kp_mask`, `kp_score`,
/// `kp_score_grad` (1 when no gradient expression is given) and `flex_visible`
/// ([`FLEX_VISIBLE`]).
fn generated_functions(spec: &FlexSpec) -> String {
    let mask = spec.mask.as_deref().unwrap_or("true");
    let score = spec.score.as_deref().unwrap_or("score");
    let grad = spec.score_grad.as_deref().unwrap_or("1.0f");
    let names = "int b, int h, int q_idx, int kv_idx, int num_heads, int seq_len_q, int \
                 seq_len_kv, const int* aux";
    format!(
        "// Generated: the mask and score modification of `{name}`.\n\
         {KP_TANH}\
         __device__ __forceinline__ bool kp_mask({names}) {{ return ({mask}); }}\n\
         __device__ __forceinline__ float kp_score(float score, {names}) {{ return ({score}); }}\n\
         __device__ __forceinline__ float kp_score_grad(float score, {names}) {{ return ({grad}); }}\n\
         {FLEX_VISIBLE}",
        name = spec.name
    )
}

/// Source of the flex backward kernel (after the prelude, the generated functions, [`FLEX_SRC`]
/// for its transposed block-mask template and `kernels/flash_attn_bwd.cu`, whose helpers it
/// uses).
pub const FLEX_BWD_SRC: &str = include_str!("../../kernels/flex_attn_bwd.cu");

/// Query rows per step of the backward (`BR`).
pub const FLEX_BWD_ROWS: usize = 64;
/// Warps per CTA of the backward, each owning 16 keys.
pub const FLEX_BWD_WARPS: usize = 8;
/// Keys per CTA of the backward (`BC` = 16 · NW), also its block mask's key granularity.
pub const FLEX_BWD_KEYS: usize = 16 * FLEX_BWD_WARPS;
/// Threads of the backward's block-mask kernel.
const BWD_MASK_THREADS: usize = 128;

/// Both backwards' check of `spec`: a score modification needs its derivative.
fn check_derivative(spec: &FlexSpec) -> Result<(), String> {
    if spec.score.is_some() && spec.score_grad.is_none() {
        return Err(format!(
            "flex_attention `{}`: the backward needs the score modification's derivative \
             (FlexSpec::score_grad)",
            spec.name
        ));
    }
    Ok(())
}

/// The kernels of the flex backward: (transposed block mask, preprocessing, main, dQ
/// conversion) names and their source for `spec` at `head_dim` and `dtype`.
///
/// # Errors
/// A score modification without its gradient expression (`score_grad`).
pub fn flex_bwd_source(
    spec: &FlexSpec,
    head_dim: usize,
    dtype: Dtype,
) -> Result<([String; 4], String), String> {
    check_derivative(spec)?;
    let bf = dtype == Dtype::Bf16;
    let has_score = spec.score.is_some();
    let dt = dtype.as_str();
    let names = [
        "flex_block_mask_t_kernel".to_string(),
        format!("flex_bwd_pre_{dt}_d{head_dim}"),
        format!("flex_bwd_{dt}_d{head_dim}"),
        format!("flex_bwd_dq_{dt}"),
    ];
    let src = format!(
        "{PRELUDE_SRC}\n{generated}\n{FLEX_SRC}\n{FLASH_BWD_SRC}\n{FLEX_BWD_SRC}\n\
         extern \"C\" __global__ void __launch_bounds__({BWD_MASK_THREADS}) {mask}(const int* \
         kv_lens, const int* aux, int* q_count, int* q_index, unsigned char* q_full, int Tq, int \
         Tkv, int H) {{ flex_block_mask_t<{FLEX_BWD_ROWS}, {FLEX_BWD_KEYS}>(kv_lens, aux, \
         q_count, q_index, q_full, Tq, Tkv, H); }}\n\
         extern \"C\" __global__ void __launch_bounds__(256) {pre}(const u16* O, const u16* dO, \
         float* Dsum, float* dQacc, int rows) {{ bwd_preprocess<{head_dim}, {bf}>(O, dO, Dsum, \
         dQacc, rows); }}\n\
         extern \"C\" __global__ void __launch_bounds__({threads}) {main}(const u16* Q, const \
         u16* K, const u16* V, const u16* dO, const float* LSE, const float* Dsum, const int* \
         kv_lens, const int* aux, const int* q_count, const int* q_index, const unsigned char* \
         q_full, float* dQacc, u16* dK, u16* dV, int Tq, int Tkv, int H, int KVH, float scale) \
         {{ flex_bwd<{head_dim}, {FLEX_BWD_WARPS}, {FLEX_BWD_ROWS}, {bf}, {has_score}>(Q, K, V, \
         dO, LSE, Dsum, kv_lens, aux, q_count, q_index, q_full, dQacc, dK, dV, Tq, Tkv, H, KVH, \
         scale); }}\n\
         extern \"C\" __global__ void __launch_bounds__(256) {conv}(const float* dQacc, u16* dQ, \
         unsigned long long n, float scale) {{ bwd_dq_convert<{bf}>(dQacc, dQ, n, scale); }}\n",
        generated = generated_functions(spec),
        mask = names[0],
        pre = names[1],
        main = names[2],
        conv = names[3],
        threads = 32 * FLEX_BWD_WARPS,
    );
    Ok((names, src))
}

/// Dynamic shared memory of the backward, bytes: the CTA's K and V (BC rows each), two buffers
/// of Q and dO (BR rows each), rows padded to head_dim + 8 elements of 2 bytes; the dS^T tile
/// (BC × (BR + 8) elements); two buffers of LSE and D (BR floats each).
pub fn flex_bwd_smem_bytes(head_dim: usize) -> usize {
    let (bc, br) = (FLEX_BWD_KEYS, FLEX_BWD_ROWS);
    (2 * bc + 4 * br) * (head_dim + 8) * 2 + bc * (br + 8) * 2 + 4 * br * 4
}

/// Dynamic shared memory of the forward, bytes: Q's [`FLEX_ROWS`] rows and two K and two V
/// tiles of [`FLEX_KEYS`] keys, rows padded to head_dim + 8 elements of 2 bytes.
pub fn flex_smem_bytes(head_dim: usize) -> usize {
    (FLEX_ROWS + 4 * FLEX_KEYS) * (head_dim + 8) * 2
}

/// The block mask of a shape: per (batch entry, head, query tile) the key tiles the mask
/// leaves any visible pair in, increasing, and whether each is whole (every pair visible and
/// every key below `kv_lens`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockMask {
    /// `[batch][heads][query tiles]` counts.
    pub count: Vec<i32>,
    /// `[batch][heads][query tiles][key tiles]` indices (the first `count` of each list).
    pub index: Vec<i32>,
    /// Like `index`: 1 for a whole tile, 0 for a partial one.
    pub full: Vec<u8>,
}

impl BlockMask {
    /// (tiles with a visible pair, whole tiles among them, all tiles) over the shape.
    pub fn tiles(&self, key_tiles: usize) -> (usize, usize, usize) {
        let mut visible = 0;
        let mut whole = 0;
        for (i, &n) in self.count.iter().enumerate() {
            visible += n as usize;
            whole += self.full[i * key_tiles..i * key_tiles + n as usize]
                .iter()
                .filter(|&&f| f == 1)
                .count();
        }
        (visible, whole, self.count.len() * key_tiles)
    }
}

/// The block mask of `m` over `shape` at the portable forward's tiles computed on the host
/// (what `flex_block_mask` computes on the device), for tests.
///
/// # Panics
/// When `kv_lens` does not hold one length per batch entry.
pub fn block_mask_host(
    shape: &FlexShape,
    m: &FlexMod,
    kv_lens: &[usize],
    aux: &[i32],
) -> BlockMask {
    block_mask_host_tiled(shape, m, kv_lens, aux, FlexKernel::Portable.tile())
}

/// [`block_mask_host`] at tiles of (`tile_rows` query rows, `tile_keys` keys), e.g. a
/// [`FlexKernel::tile`].
///
/// # Panics
/// When `kv_lens` does not hold one length per batch entry, or for an empty tile.
pub fn block_mask_host_tiled(
    shape: &FlexShape,
    m: &FlexMod,
    kv_lens: &[usize],
    aux: &[i32],
    (tile_rows, tile_keys): (usize, usize),
) -> BlockMask {
    assert_eq!(
        kv_lens.len(),
        shape.batch,
        "kv_lens: one length per batch entry"
    );
    assert!(tile_rows > 0 && tile_keys > 0, "an empty tile");
    let (nq, nk) = (shape.query_tiles(tile_rows), shape.key_tiles(tile_keys));
    let lists = shape.batch * shape.heads * nq;
    let mut bm = BlockMask {
        count: vec![0; lists],
        index: vec![0; lists * nk],
        full: vec![0; lists * nk],
    };
    for (b, &len) in kv_lens.iter().enumerate().take(shape.batch) {
        for h in 0..shape.heads {
            for qt in 0..nq {
                let list = (b * shape.heads + h) * nq + qt;
                let rows = (qt * tile_rows)..((qt + 1) * tile_rows).min(shape.seq_len_q);
                for kt in 0..nk {
                    let keys = (kt * tile_keys)..((kt + 1) * tile_keys).min(len);
                    let (mut any, mut all) = (false, true);
                    for q in rows.clone() {
                        for kv in keys.clone() {
                            let v = m.visible(b, q, kv, shape.seq_len_q, shape.seq_len_kv, aux);
                            any |= v;
                            all &= v;
                        }
                    }
                    if any {
                        let n = bm.count[list] as usize;
                        bm.index[list * nk + n] = kt as i32;
                        bm.full[list * nk + n] = u8::from(all && keys.len() == tile_keys);
                        bm.count[list] += 1;
                    }
                }
            }
        }
    }
    bm
}

/// The float64 reference: O `[batch, heads, seq_len_q, head_dim]` and LSE `[batch, heads,
/// seq_len_q]` (natural log, +∞ for a row with no visible key, whose output is 0) of
/// `softmax(m.modify(q·k · scale))` over the keys `m` leaves visible below `kv_lens[b]`. Q, K,
/// V as in the module's documentation, in f64.
///
/// # Panics
/// When `kv_lens` does not hold one length per batch entry.
pub fn flex_reference(
    shape: &FlexShape,
    m: &FlexMod,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    kv_lens: &[usize],
    aux: &[i32],
) -> (Vec<f64>, Vec<f64>) {
    assert_eq!(
        kv_lens.len(),
        shape.batch,
        "kv_lens: one length per batch entry"
    );
    let (tq, tkv, d) = (shape.seq_len_q, shape.seq_len_kv, shape.head_dim);
    let group = shape.heads / shape.kv_heads;
    let mut out = vec![0.0; shape.batch * shape.heads * tq * d];
    let mut lse = vec![f64::INFINITY; shape.batch * shape.heads * tq];
    let mut scores = vec![0.0; tkv];
    for (b, &len) in kv_lens.iter().enumerate().take(shape.batch) {
        for h in 0..shape.heads {
            let kvh = h / group;
            let kv_base = (b * shape.kv_heads + kvh) * tkv * d;
            for i in 0..tq {
                let row = (b * shape.heads + h) * tq + i;
                let qr = &q[row * d..(row + 1) * d];
                let mut mx = f64::NEG_INFINITY;
                for (j, sc) in scores.iter_mut().enumerate() {
                    *sc = f64::NEG_INFINITY;
                    if j < len && m.visible(b, i, j, tq, tkv, aux) {
                        let kr = &k[kv_base + j * d..kv_base + (j + 1) * d];
                        let dot: f64 = qr.iter().zip(kr).map(|(a, b)| a * b).sum();
                        *sc = m.modify(dot * shape.scale, h, i, j, shape.heads, tq, tkv);
                        mx = mx.max(*sc);
                    }
                }
                if mx == f64::NEG_INFINITY {
                    continue; // no visible key: O = 0, LSE = +inf
                }
                let mut total = 0.0;
                let o = &mut out[row * d..(row + 1) * d];
                for (j, &sc) in scores.iter().enumerate() {
                    if sc == f64::NEG_INFINITY {
                        continue;
                    }
                    let w = (sc - mx).exp();
                    total += w;
                    let vr = &v[kv_base + j * d..kv_base + (j + 1) * d];
                    for (a, &x) in o.iter_mut().zip(vr) {
                        *a += w * x;
                    }
                }
                o.iter_mut().for_each(|a| *a /= total);
                lse[row] = mx + total.ln();
            }
        }
    }
    (out, lse)
}

/// Document lengths of the packed-sequence cases, per batch entry, summing to `seq_len`: drawn
/// uniformly from [seq_len/16, 3·seq_len/16] (at least 1) by splitmix64 from (`seq_len`,
/// entry), the last one cut to fit. Deterministic: every implementation and the reference
/// rebuild the same documents from the shape.
pub fn document_lengths(batch: usize, seq_len: usize) -> Vec<Vec<usize>> {
    (0..batch)
        .map(|b| {
            let mut state = (seq_len as u64) << 8 ^ b as u64 ^ 0xd0c5;
            let (lo, span) = ((seq_len / 16).max(1), (seq_len / 8).max(1));
            let mut lens = Vec::new();
            let mut left = seq_len;
            while left > 0 {
                state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
                let mut z = state;
                z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                z ^= z >> 31;
                let n = (lo + (z % span as u64) as usize).min(left);
                lens.push(n);
                left -= n;
            }
            lens
        })
        .collect()
}

/// `aux` of [`FlexMod::Document`] for documents `lengths` (one list per batch entry, each
/// summing to `seq_len`): the document index of every position, `[batch][seq_len]`.
///
/// # Panics
/// When a batch entry's lengths do not sum to `seq_len`.
pub fn document_ids(lengths: &[Vec<usize>], seq_len: usize) -> Vec<i32> {
    let mut ids = Vec::with_capacity(lengths.len() * seq_len);
    for lens in lengths {
        assert_eq!(
            lens.iter().sum::<usize>(),
            seq_len,
            "document lengths must cover the sequence"
        );
        for (d, &n) in lens.iter().enumerate() {
            ids.extend(std::iter::repeat_n(d as i32, n));
        }
    }
    ids
}

/// What modification `m` reads as `aux` for `batch` entries of `seq_len_kv` positions: the
/// document ids of [`document_lengths`] for [`FlexMod::Document`], nothing otherwise. Every
/// implementation and the reference of the masks grid use these documents.
pub fn aux_for(m: Option<FlexMod>, batch: usize, seq_len_kv: usize) -> Vec<i32> {
    match m {
        Some(FlexMod::Document) => document_ids(&document_lengths(batch, seq_len_kv), seq_len_kv),
        _ => Vec::new(),
    }
}

/// A [`FlexMod`] (or none) over one shape, as the float64 reference's
/// [`super::cpu::ScoreRule`].
pub struct FlexRule<'a> {
    /// The modification; `None` sees every key.
    pub m: Option<FlexMod>,
    /// Query heads.
    pub heads: usize,
    /// Query rows.
    pub seq_len_q: usize,
    /// Key rows.
    pub seq_len_kv: usize,
    /// What the mask reads (document ids), `[batch][seq_len_kv]`.
    pub aux: &'a [i32],
}

impl super::cpu::ScoreRule for FlexRule<'_> {
    fn visible(&self, b: usize, _h: usize, i: usize, j: usize) -> bool {
        self.m
            .is_none_or(|m| m.visible(b, i, j, self.seq_len_q, self.seq_len_kv, self.aux))
    }
    fn modify(&self, raw: f64, h: usize, i: usize, j: usize) -> f64 {
        self.m.map_or(raw, |m| {
            m.modify(raw, h, i, j, self.heads, self.seq_len_q, self.seq_len_kv)
        })
    }
    fn derivative(&self, raw: f64, _h: usize, _i: usize, _j: usize) -> f64 {
        self.m.map_or(1.0, |m| m.derivative(raw))
    }
}

impl FlexRule<'_> {
    /// (query, key) pairs the rule leaves visible in batch entry `b` (one head; the named
    /// masks do not depend on the head), keys below `kv_len`.
    pub fn visible_pairs(&self, b: usize, kv_len: usize) -> u64 {
        use super::cpu::ScoreRule;
        (0..self.seq_len_q)
            .map(|i| (0..kv_len).filter(|&j| self.visible(b, 0, i, j)).count() as u64)
            .sum()
    }
}

/// Allocates and fills a block mask's tile lists on the device: per (batch entry, head, tile
/// of the outer axis) the count, the indices of the inner-axis tiles with a visible pair and
/// their whole-tile flags, `outer` × `inner` tiles (query × key tiles for the forward's mask,
/// key × query tiles for the backward's). `func` is `flex_block_mask_kernel` or
/// `flex_block_mask_t_kernel`: `(const int* kv_lens, const int* aux, int* count, int* index,
/// unsigned char* full, int Tq, int Tkv, int H)`, one CTA of `threads` per (outer tile, head,
/// batch entry).
///
/// # Errors
/// Driver errors.
#[allow(clippy::type_complexity)]
fn tile_lists(
    gpu: &Gpu,
    func: &CudaFunction,
    shape: &FlexShape,
    (kv_lens, aux): (&CudaSlice<i32>, &CudaSlice<i32>),
    (outer, inner): (usize, usize),
    threads: usize,
) -> Result<(CudaSlice<i32>, CudaSlice<i32>, CudaSlice<u8>), GpuError> {
    let lists = shape.batch * shape.heads * outer;
    let mut count = gpu.stream.alloc_zeros::<i32>(lists)?;
    let mut index = gpu.stream.alloc_zeros::<i32>(lists * inner)?;
    let mut full = gpu.stream.alloc_zeros::<u8>(lists * inner)?;
    let (tq, tkv, h) = (
        shape.seq_len_q as i32,
        shape.seq_len_kv as i32,
        shape.heads as i32,
    );
    let mut l = gpu.stream.launch_builder(func);
    l.arg(kv_lens)
        .arg(aux)
        .arg(&mut count)
        .arg(&mut index)
        .arg(&mut full)
        .arg(&tq)
        .arg(&tkv)
        .arg(&h);
    // SAFETY: the signature above; the lists were allocated here for `outer` × `inner` tiles of
    // this shape; kv_lens holds `batch` entries and `aux` what the mask reads (the callers'
    // contract, checked where the buffers are made).
    unsafe {
        l.launch(LaunchConfig {
            grid_dim: (outer as u32, shape.heads as u32, shape.batch as u32),
            block_dim: (threads as u32, 1, 1),
            shared_mem_bytes: 0,
        })?
    };
    Ok((count, index, full))
}

/// [`FlexAttention::launch_backward`] on the wgmma backward (lengths checked there): the wgmma
/// backward's preprocessing (D, LSE · log2 e, dQacc zeroed), the flex main kernel with Q, K, V,
/// dO and dQacc through tensor maps as the dense wgmma backward takes them, dQ converted.
#[allow(clippy::type_complexity)]
fn launch_backward_wgmma(
    gpu: &Gpu,
    fb: &mut FlexBwd,
    (s, kv_lens, aux): (&FlexShape, &CudaSlice<i32>, &CudaSlice<i32>),
    (q, k, v): (&CudaSlice<u16>, &CudaSlice<u16>, &CudaSlice<u16>),
    (o, lse, dout): (&CudaSlice<u16>, &CudaSlice<f32>, &CudaSlice<u16>),
    (dq, dk, dv): (
        &mut CudaSlice<u16>,
        &mut CudaSlice<u16>,
        &mut CudaSlice<u16>,
    ),
) -> Result<(), GpuError> {
    use super::sm90::{tma_map_16, tma_map_f32, BWD_KEYS};
    use cudarc::driver::{DevicePtr, DevicePtrMut};
    let d = s.head_dim;
    let (bm, _) = FlexBwdKernel::Wgmma.tile(d);
    let tq_pad = s.seq_len_q.div_ceil(bm) * bm;
    let padded = s.batch * s.heads * tq_pad;
    let (tq, tkv, h, kvh, scale) = s.kernel_args();
    let (tq_pad_i, batch_i) = (tq_pad as i32, s.batch as i32);
    let scale_log2 = (s.scale * std::f64::consts::LOG2_E) as f32;
    let lse2 = fb
        .lse2
        .as_mut()
        .expect("the wgmma backward allocates lse2 in enable_backward_with");
    // dsum and lse2 were allocated with `padded` rows (enable_backward_with).
    super::sm90::launch_bwd_pre(
        gpu,
        &fb.pre,
        (o, dout, lse),
        (&mut fb.dsum, lse2, &mut fb.dqacc),
        (tq, tq_pad_i, padded),
    )?;
    {
        // The guards live until after the launch (as in the forward's launch_wgmma).
        let (qp, _gq) = q.device_ptr(&gpu.stream);
        let (kp, _gk) = k.device_ptr(&gpu.stream);
        let (vp, _gv) = v.device_ptr(&gpu.stream);
        let (dop, _gdo) = dout.device_ptr(&gpu.stream);
        let (planes_q, planes_kv) = (s.batch * s.heads, s.batch * s.kv_heads);
        let maps = [
            tma_map_16(qp, (planes_q, s.seq_len_q, d), bm as u32, s.dtype)?,
            tma_map_16(kp, (planes_kv, s.seq_len_kv, d), BWD_KEYS as u32, s.dtype)?,
            tma_map_16(vp, (planes_kv, s.seq_len_kv, d), BWD_KEYS as u32, s.dtype)?,
            tma_map_16(dop, (planes_q, s.seq_len_q, d), bm as u32, s.dtype)?,
        ];
        let (dqp, _gdq) = fb.dqacc.device_ptr_mut(&gpu.stream);
        // Boxes of 64 rows of 32 columns (the steps of 64 and 128 queries, as the dense kernel).
        let dq_map = tma_map_f32(dqp, (planes_q, s.seq_len_q, d), 64)?;
        let lse2 = fb.lse2.as_ref().expect("allocated in enable_backward_with");
        let mut l = gpu.stream.launch_builder(&fb.main);
        l.arg(&maps[0])
            .arg(&maps[1])
            .arg(&maps[2])
            .arg(&maps[3])
            .arg(&dq_map)
            .arg(lse2)
            .arg(&fb.dsum)
            .arg(kv_lens)
            .arg(aux)
            .arg(&fb.q_count)
            .arg(&fb.q_index)
            .arg(&fb.q_full)
            .arg(&mut *dk)
            .arg(&mut *dv)
            .arg(&tq)
            .arg(&tkv)
            .arg(&h)
            .arg(&kvh)
            .arg(&tq_pad_i)
            .arg(&scale_log2)
            .arg(&scale)
            .arg(&batch_i);
        let ctas = s.seq_len_kv.div_ceil(BWD_KEYS) * s.kv_heads * s.batch;
        // SAFETY: `flex_bwd_sm90_*(TmaMap tq, TmaMap tk, TmaMap tv, TmaMap tdo, TmaMap tdq, const
        // float* lse2, const float* dsum, const int* kv_lens, const int* aux, const int*
        // q_count, const int* q_index, const unsigned char* q_full, u16* dK, u16* dV, int Tq,
        // int Tkv, int H, int KVH, int Tq_pad, float scale_log2, float scale, int B)`: the maps
        // describe q, k, v, dO and dQacc with the shapes launch_backward checked (TMA reads and
        // reduce-adds inside them only; reads past their ends zero-fill, adds there are
        // skipped); lse2 and dsum hold B·H·Tq_pad floats written by the preprocessing above;
        // the transposed block mask was computed at (bm, 128) tiles for this shape by
        // enable_backward_with; kv_lens `batch` entries (each at most seq_len_kv) and aux what
        // the expressions read; dK and dV B·KVH·Tkv·D words; 3 warpgroups per (128-key tile,
        // kv head, batch entry) in a 1-D grid, key tiles fastest.
        unsafe {
            l.launch(LaunchConfig {
                grid_dim: (ctas as u32, 1, 1),
                block_dim: (384, 1, 1),
                shared_mem_bytes: fb.smem,
            })?
        };
    }
    let n = (s.batch * s.heads * s.seq_len_q * d) as u64;
    let mut l = gpu.stream.launch_builder(&fb.convert);
    l.arg(&fb.dqacc).arg(&mut *dq).arg(&n).arg(&scale);
    // SAFETY: `attn_bwd_sm90_dq_convert(const float* dqacc, u16* dQ, unsigned long long n, float
    // scale)` with n = B·H·Tq·D elements in both; 2 elements per thread.
    unsafe {
        l.launch(LaunchConfig {
            grid_dim: ((n as usize).div_ceil(512).max(1) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        })?
    };
    Ok(())
}

/// The compiled backward kernels, the transposed block mask and the scratch of one flex call.
struct FlexBwd {
    kernel: FlexBwdKernel,
    pre: CudaFunction,
    main: CudaFunction,
    convert: CudaFunction,
    smem: u32,
    q_count: CudaSlice<i32>,
    q_index: CudaSlice<i32>,
    q_full: CudaSlice<u8>,
    /// D = rowsum(dO ∘ O): one per query row, or for the wgmma backward per row padded to whole
    /// steps (as `lse2`).
    dsum: CudaSlice<f32>,
    /// The wgmma backward's LSE · log2(e), padded to whole steps (+∞ in the padding).
    lse2: Option<CudaSlice<f32>>,
    dqacc: CudaSlice<f32>,
}

/// The compiled kernels and the block mask of one (spec, shape, `kv_lens`, `aux`).
pub struct FlexAttention {
    shape: FlexShape,
    spec: FlexSpec,
    bwd: Option<FlexBwd>,
    fwd: CudaFunction,
    kernel: FlexKernel,
    smem: u32,
    aux: CudaSlice<i32>,
    kv_lens: CudaSlice<i32>,
    kv_count: CudaSlice<i32>,
    kv_index: CudaSlice<i32>,
    kv_full: CudaSlice<u8>,
    /// NVRTC compile + load time, s.
    pub compile_s: f64,
}

impl FlexAttention {
    /// Compiles `spec` for `shape` with [`FlexKernel::for_call`]'s forward kernel, uploads the
    /// batch entries' key lengths `kv_lens` (one per entry, each at most seq_len_kv; every call
    /// uses them) and `aux` (as given; one zero word when empty: an expression that reads `aux`
    /// must be given what it reads), and computes the block mask on the device.
    ///
    /// # Errors
    /// [`GpuError::Config`] for an unsupported shape, key lengths that do not fit it, or a
    /// shape needing more shared memory than the device allows; NVRTC errors name the
    /// expressions' source; driver errors.
    pub fn new(
        gpu: &Gpu,
        shape: FlexShape,
        spec: &FlexSpec,
        kv_lens: &[usize],
        aux: &[i32],
    ) -> Result<FlexAttention, GpuError> {
        let kernel = FlexKernel::for_call(&gpu.arch(), &shape);
        FlexAttention::with_kernel(gpu, shape, spec, kv_lens, aux, kernel)
    }

    /// [`FlexAttention::new`] with the forward kernel given.
    ///
    /// # Errors
    /// As [`FlexAttention::new`]; [`GpuError::Config`] for [`FlexKernel::Wgmma`] on a device
    /// other than compute capability 9.0 or with a scale that is not positive.
    pub fn with_kernel(
        gpu: &Gpu,
        shape: FlexShape,
        spec: &FlexSpec,
        kv_lens: &[usize],
        aux: &[i32],
        kernel: FlexKernel,
    ) -> Result<FlexAttention, GpuError> {
        if kernel == FlexKernel::Wgmma && !wgmma_applies(&gpu.arch(), &shape) {
            return Err(GpuError::Config(format!(
                "flex's wgmma forward needs compute capability 9.0 (sm_90a, not {}) and a \
                 positive scale (not {})",
                gpu.arch(),
                shape.scale
            )));
        }
        if let Some(why) = shape.unsupported() {
            return Err(GpuError::Config(why));
        }
        if kv_lens.len() != shape.batch || kv_lens.iter().any(|&l| l > shape.seq_len_kv) {
            return Err(GpuError::Config(format!(
                "kv_lens {kv_lens:?}: one length per batch entry ({}), each at most seq_len_kv \
                 ({})",
                shape.batch, shape.seq_len_kv
            )));
        }
        let lens_i: Vec<i32> = kv_lens.iter().map(|&l| l as i32).collect();
        let kv_lens = gpu.stream.clone_htod(&lens_i)?;
        let (block_name, fwd_name, src) = match kernel {
            FlexKernel::Portable => flex_source(spec, shape.head_dim, shape.dtype),
            FlexKernel::Wgmma => flex_sm90_source(spec, shape.head_dim, shape.dtype),
        };
        let compiled = gpu.compile(&format!("{fwd_name}_{}.cu", spec.name), &src)?;
        let smem = match kernel {
            FlexKernel::Portable => flex_smem_bytes(shape.head_dim),
            FlexKernel::Wgmma => flex_sm90_smem_bytes(shape.head_dim),
        } as u32;
        super::cuda::check_smem(gpu, &fwd_name, smem)?;
        let fwd = gpu.function(&compiled.module, &fwd_name, smem)?;
        let block = gpu.function(&compiled.module, &block_name, 0)?;
        let aux_d = gpu
            .stream
            .clone_htod(if aux.is_empty() { &[0][..] } else { aux })?;
        let (rows, keys) = kernel.tile();
        let (nq, nk) = (shape.query_tiles(rows), shape.key_tiles(keys));
        // Per query tile the key tiles with a visible pair.
        let (kv_count, kv_index, kv_full) =
            tile_lists(gpu, &block, &shape, (&kv_lens, &aux_d), (nq, nk), THREADS)?;
        Ok(FlexAttention {
            shape,
            spec: spec.clone(),
            bwd: None,
            fwd,
            kernel,
            smem,
            aux: aux_d,
            kv_lens,
            kv_count,
            kv_index,
            kv_full,
            compile_s: compiled.compile_s,
        })
    }

    /// Compiles the backward [`FlexBwdKernel::for_call`] picks (a second NVRTC module; its time
    /// is added to `compile_s`), computes the transposed block mask on the device (per (batch
    /// entry, head, key tile) the query tiles with a visible pair, at the kernel's
    /// [`FlexBwdKernel::tile`]) and allocates the backward's scratch (D and the fp32 dQ
    /// accumulator, 4·B·H·Tq·(D + 1) bytes for the portable kernel; D padded to whole steps
    /// and a padded LSE · log2 e besides for the wgmma one: [`FlexAttention::backward_bytes`]).
    /// A second call with the same kernel does nothing.
    ///
    /// # Errors
    /// [`GpuError::Config`] for a score modification without its derivative or a device
    /// without the shared memory; NVRTC and driver errors.
    pub fn enable_backward(&mut self, gpu: &Gpu) -> Result<(), GpuError> {
        let kernel = FlexBwdKernel::for_call(&gpu.arch(), &self.shape);
        self.enable_backward_with(gpu, kernel)
    }

    /// [`FlexAttention::enable_backward`] with the backward kernel given (a later call with
    /// another kernel replaces the first's).
    ///
    /// # Errors
    /// As [`FlexAttention::enable_backward`]; [`GpuError::Config`] for
    /// [`FlexBwdKernel::Wgmma`] on a device other than compute capability 9.0 or with a scale
    /// that is not positive.
    pub fn enable_backward_with(
        &mut self,
        gpu: &Gpu,
        kernel: FlexBwdKernel,
    ) -> Result<(), GpuError> {
        if self.bwd.as_ref().is_some_and(|b| b.kernel == kernel) {
            return Ok(());
        }
        let s = self.shape;
        let wgmma = kernel == FlexBwdKernel::Wgmma;
        if wgmma && !wgmma_applies(&gpu.arch(), &s) {
            return Err(GpuError::Config(format!(
                "flex's wgmma backward needs compute capability 9.0 (sm_90a, not {}) and a \
                 positive scale (not {})",
                gpu.arch(),
                s.scale
            )));
        }
        let (names, src) = if wgmma {
            flex_bwd_sm90_source(&self.spec, s.head_dim, s.dtype)
        } else {
            flex_bwd_source(&self.spec, s.head_dim, s.dtype)
        }
        .map_err(GpuError::Config)?;
        let compiled = gpu.compile(&format!("{}_{}.cu", names[2], self.spec.name), &src)?;
        let (rows_per_step, keys) = kernel.tile(s.head_dim);
        // The wgmma kernel's plan and 8 bytes a stage past it, where its producer hands each
        // step's head, first query row and whole-tile flag to the consumers.
        let smem = if wgmma {
            super::sm90::bwd_smem_bytes(s.head_dim, rows_per_step) + 8 * super::sm90::BWD_STAGES
        } else {
            flex_bwd_smem_bytes(s.head_dim)
        } as u32;
        super::cuda::check_smem(gpu, &names[2], smem)?;
        let mask = gpu.function(&compiled.module, &names[0], 0)?;
        let (nq, nk) = (
            s.seq_len_q.div_ceil(rows_per_step),
            s.seq_len_kv.div_ceil(keys),
        );
        // Per key tile (the outer axis here) the query tiles with a visible pair.
        let (q_count, q_index, q_full) = tile_lists(
            gpu,
            &mask,
            &s,
            (&self.kv_lens, &self.aux),
            (nk, nq),
            BWD_MASK_THREADS,
        )?;
        let rows = s.batch * s.heads * s.seq_len_q;
        // The wgmma backward's per-row buffers hold whole steps of rows per (batch, head).
        let padded = s.batch * s.heads * nq * rows_per_step;
        self.bwd = Some(FlexBwd {
            kernel,
            pre: gpu.function(&compiled.module, &names[1], 0)?,
            main: gpu.function(&compiled.module, &names[2], smem)?,
            convert: gpu.function(&compiled.module, &names[3], 0)?,
            smem,
            q_count,
            q_index,
            q_full,
            dsum: gpu
                .stream
                .alloc_zeros::<f32>(if wgmma { padded } else { rows })?,
            lse2: if wgmma {
                Some(gpu.stream.alloc_zeros::<f32>(padded)?)
            } else {
                None
            },
            dqacc: gpu.stream.alloc_zeros::<f32>(rows * s.head_dim)?,
        });
        self.compile_s += compiled.compile_s;
        Ok(())
    }

    /// The backward kernel [`FlexAttention::enable_backward`] compiled (`None` before it).
    pub fn backward_kernel(&self) -> Option<FlexBwdKernel> {
        self.bwd.as_ref().map(|b| b.kernel)
    }

    /// Device bytes of the backward's transposed block mask and scratch (0 before
    /// [`FlexAttention::enable_backward`]).
    pub fn backward_bytes(&self) -> u64 {
        self.bwd.as_ref().map_or(0, |b| {
            let lse2 = b.lse2.as_ref().map_or(0, |l| l.len());
            ((b.q_count.len() + b.q_index.len() + b.dsum.len() + lse2 + b.dqacc.len()) * 4
                + b.q_full.len()) as u64
        })
    }

    /// Launches the backward on the stream: dQ (like Q), dK and dV (like K) of the loss
    /// Σ dO ∘ O for the forward's Q, K, V, its O and LSE ([`FlexAttention::launch`]) and dO
    /// (like O). Three kernels: D = rowsum(dO ∘ O) with dQacc zeroed, the main kernel
    /// (`kernels/flex_attn_bwd.cu`; dQ summed with fp32 atomics, so its last bit may vary from
    /// run to run), dQ converted.
    ///
    /// # Errors
    /// [`GpuError::Config`] before [`FlexAttention::enable_backward`] or for a buffer whose
    /// length does not fit the shape; driver errors.
    #[allow(clippy::too_many_arguments)]
    pub fn launch_backward(
        &mut self,
        gpu: &Gpu,
        (q, k, v): (&CudaSlice<u16>, &CudaSlice<u16>, &CudaSlice<u16>),
        o: &CudaSlice<u16>,
        lse: &CudaSlice<f32>,
        dout: &CudaSlice<u16>,
        dq: &mut CudaSlice<u16>,
        dk: &mut CudaSlice<u16>,
        dv: &mut CudaSlice<u16>,
    ) -> Result<(), GpuError> {
        let s = self.shape;
        let (qn, kn) = s.elems();
        let rows = s.batch * s.heads * s.seq_len_q;
        s.check_lengths(
            "flex backward",
            &[
                ("q", q.len(), qn),
                ("k", k.len(), kn),
                ("v", v.len(), kn),
                ("o", o.len(), qn),
                ("lse", lse.len(), rows),
                ("dout", dout.len(), qn),
                ("dq", dq.len(), qn),
                ("dk", dk.len(), kn),
                ("dv", dv.len(), kn),
            ],
        )?;
        let Some(fb) = self.bwd.as_mut() else {
            return Err(GpuError::Config(
                "flex backward: call enable_backward first".into(),
            ));
        };
        if fb.kernel == FlexBwdKernel::Wgmma {
            return launch_backward_wgmma(
                gpu,
                fb,
                (&s, &self.kv_lens, &self.aux),
                (q, k, v),
                (o, lse, dout),
                (dq, dk, dv),
            );
        }
        let rows = s.batch * s.heads * s.seq_len_q;
        let one_d = |n: usize, per: usize| LaunchConfig {
            grid_dim: (n.div_ceil(per).max(1) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let rows_i = rows as i32;
        let mut l = gpu.stream.launch_builder(&fb.pre);
        l.arg(o)
            .arg(dout)
            .arg(&mut fb.dsum)
            .arg(&mut fb.dqacc)
            .arg(&rows_i);
        // SAFETY: `flex_bwd_pre_*(const u16* O, const u16* dO, float* Dsum, float* dQacc, int
        // rows)`: O and dO hold rows·D elements, Dsum rows, dQacc rows·D; a warp per row.
        unsafe { l.launch(one_d(rows, 8))? };
        let (tq, tkv, h, kvh, scale) = s.kernel_args();
        let mut l = gpu.stream.launch_builder(&fb.main);
        l.arg(q)
            .arg(k)
            .arg(v)
            .arg(dout)
            .arg(lse)
            .arg(&fb.dsum)
            .arg(&self.kv_lens)
            .arg(&self.aux)
            .arg(&fb.q_count)
            .arg(&fb.q_index)
            .arg(&fb.q_full)
            .arg(&mut fb.dqacc)
            .arg(dk)
            .arg(dv)
            .arg(&tq)
            .arg(&tkv)
            .arg(&h)
            .arg(&kvh)
            .arg(&scale);
        // SAFETY: `flex_bwd_*(const u16* Q, const u16* K, const u16* V, const u16* dO, const
        // float* LSE, const float* Dsum, const int* kv_lens, const int* aux, const int* q_count,
        // const int* q_index, const unsigned char* q_full, float* dQacc, u16* dK, u16* dV, int
        // Tq, int Tkv, int H, int KVH, float scale)`, one CTA per (key tile, kv head, batch
        // entry) with the transposed block mask enable_backward computed for this shape; the
        // caller's buffers hold the shapes in the module's documentation.
        unsafe {
            l.launch(LaunchConfig {
                grid_dim: (
                    s.seq_len_kv.div_ceil(FLEX_BWD_KEYS) as u32,
                    s.kv_heads as u32,
                    s.batch as u32,
                ),
                block_dim: (32 * FLEX_BWD_WARPS as u32, 1, 1),
                shared_mem_bytes: fb.smem,
            })?
        };
        let n = (rows * s.head_dim) as u64;
        let mut l = gpu.stream.launch_builder(&fb.convert);
        l.arg(&fb.dqacc).arg(dq).arg(&n).arg(&scale);
        // SAFETY: `flex_bwd_dq_*(const float* dQacc, u16* dQ, unsigned long long n, float
        // scale)` with n = B·H·Tq·D elements in both; 2 elements per thread.
        unsafe { l.launch(one_d(n as usize, 512))? };
        Ok(())
    }

    /// The block mask computed on the device.
    ///
    /// # Errors
    /// Driver errors.
    pub fn block_mask(&self, gpu: &Gpu) -> Result<BlockMask, GpuError> {
        Ok(BlockMask {
            count: gpu.stream.clone_dtoh(&self.kv_count)?,
            index: gpu.stream.clone_dtoh(&self.kv_index)?,
            full: gpu.stream.clone_dtoh(&self.kv_full)?,
        })
    }

    /// Device bytes of the block mask (counts, indices and whole-tile flags), key lengths and
    /// `aux`: what a call reads beyond Q, K, V and writes beyond O and LSE.
    pub fn block_mask_bytes(&self) -> u64 {
        ((self.kv_count.len() + self.kv_index.len() + self.kv_lens.len() + self.aux.len()) * 4
            + self.kv_full.len()) as u64
    }

    /// Key tiles per query tile's list (the block mask's row length).
    pub fn key_tiles(&self) -> usize {
        self.shape.key_tiles(self.kernel.tile().1)
    }

    /// The forward kernel this call runs.
    pub fn kernel(&self) -> FlexKernel {
        self.kernel
    }

    /// Launches the forward on the stream: O and LSE (shapes in the module's documentation)
    /// for Q, K, V, with the key lengths and `aux` given to [`FlexAttention::new`].
    ///
    /// # Errors
    /// [`GpuError::Config`] for a buffer whose length does not fit the shape; driver errors.
    pub fn launch(
        &self,
        gpu: &Gpu,
        q: &CudaSlice<u16>,
        k: &CudaSlice<u16>,
        v: &CudaSlice<u16>,
        o: &mut CudaSlice<u16>,
        lse: &mut CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        let s = &self.shape;
        let (qn, kn) = s.elems();
        s.check_lengths(
            "flex forward",
            &[
                ("q", q.len(), qn),
                ("k", k.len(), kn),
                ("v", v.len(), kn),
                ("o", o.len(), qn),
                ("lse", lse.len(), s.batch * s.heads * s.seq_len_q),
            ],
        )?;
        if self.kernel == FlexKernel::Wgmma {
            return self.launch_wgmma(gpu, (q, k, v), o, lse);
        }
        let scalars = s.kernel_args();
        let mut l = gpu.stream.launch_builder(&self.fwd);
        l.arg(q).arg(k).arg(v).arg(o).arg(lse);
        self.push_mask_args(&mut l, &scalars);
        // SAFETY: `flex_fwd_*(const u16* Q, const u16* K, const u16* V, u16* O, float* LSE,
        // const int* kv_lens, const int* aux, const int* kv_count, const int* kv_index, const
        // unsigned char* kv_full, int Tq, int Tkv, int H, int KVH, float scale)`, one CTA per
        // (query tile, head, batch entry) with the block mask `new` computed for this shape; the
        // caller's buffers hold the shapes in the module's documentation.
        unsafe {
            l.launch(LaunchConfig {
                grid_dim: (
                    s.query_tiles(FLEX_ROWS) as u32,
                    s.heads as u32,
                    s.batch as u32,
                ),
                block_dim: (THREADS as u32, 1, 1),
                shared_mem_bytes: self.smem,
            })?
        };
        Ok(())
    }

    /// The arguments both forward kernels take after O and LSE: the key lengths, `aux`, the
    /// block mask's counts, indices and whole-tile flags, then Tq, Tkv, H, KVH and the scale
    /// ([`FlexShape::kernel_args`]).
    fn push_mask_args<'a>(
        &'a self,
        l: &mut cudarc::driver::LaunchArgs<'a>,
        (tq, tkv, h, kvh, scale): &'a (i32, i32, i32, i32, f32),
    ) {
        l.arg(&self.kv_lens)
            .arg(&self.aux)
            .arg(&self.kv_count)
            .arg(&self.kv_index)
            .arg(&self.kv_full)
            .arg(tq)
            .arg(tkv)
            .arg(h)
            .arg(kvh)
            .arg(scale);
    }

    /// [`FlexAttention::launch`] on the wgmma kernel (lengths checked there): Q, K, V and O
    /// through tensor maps as the dense wgmma forward takes them.
    fn launch_wgmma(
        &self,
        gpu: &Gpu,
        (q, k, v): (&CudaSlice<u16>, &CudaSlice<u16>, &CudaSlice<u16>),
        o: &mut CudaSlice<u16>,
        lse: &mut CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        use super::sm90::{tma_map_16, WS_KEYS};
        use cudarc::driver::{DevicePtr, DevicePtrMut};
        let s = &self.shape;
        let scalars = s.kernel_args();
        // With a score modification the kernel scores in natural units (kp_score's) and the
        // softmax takes log2 e; without one it scales the raw products as the dense kernel does.
        let scale_log2 = if self.spec.score.is_some() {
            std::f32::consts::LOG2_E
        } else {
            (s.scale * std::f64::consts::LOG2_E) as f32
        };
        let (rows, _) = self.kernel.tile();
        let d = s.head_dim;
        // The guards live until after the launch: dropping one records the buffer's use on this
        // stream, which must come after the kernel that reads or writes it through TMA.
        let (qp, _gq) = q.device_ptr(&gpu.stream);
        let (kp, _gk) = k.device_ptr(&gpu.stream);
        let (vp, _gv) = v.device_ptr(&gpu.stream);
        let (op, _go) = o.device_ptr_mut(&gpu.stream);
        let (planes_q, planes_kv) = (s.batch * s.heads, s.batch * s.kv_heads);
        let maps = [
            tma_map_16(qp, (planes_q, s.seq_len_q, d), 64, s.dtype)?,
            tma_map_16(kp, (planes_kv, s.seq_len_kv, d), WS_KEYS as u32, s.dtype)?,
            tma_map_16(vp, (planes_kv, s.seq_len_kv, d), WS_KEYS as u32, s.dtype)?,
            tma_map_16(op, (planes_q, s.seq_len_q, d), 64, s.dtype)?,
        ];
        let mut l = gpu.stream.launch_builder(&self.fwd);
        l.arg(&maps[0])
            .arg(&maps[1])
            .arg(&maps[2])
            .arg(&maps[3])
            .arg(&op)
            .arg(lse);
        self.push_mask_args(&mut l, &scalars);
        l.arg(&scale_log2);
        // SAFETY: `flex_fwd_sm90_*(TmaMap tq, TmaMap tk, TmaMap tv, TmaMap to, u16* O, float*
        // LSE, const int* kv_lens, const int* aux, const int* kv_count, const int* kv_index,
        // const unsigned char* kv_full, int Tq, int Tkv, int H, int KVH, float scale, float
        // scale_log2)`, one CTA of a producer and two consumer warpgroups per (query tile of
        // `rows`, head, batch entry) with the block mask `with_kernel` computed at this
        // kernel's tiles for this shape; the maps describe q, k, v and o with the shapes
        // `launch` checked (TMA reads inside them only, zero-filling past their ends, and
        // writes inside o only); lse holds batch · heads · seq_len_q floats, kv_lens `batch`
        // entries (each at most seq_len_kv, checked in `with_kernel`) and aux what the
        // expressions read (the caller's contract, as for the portable kernel); the guards
        // record the buffers' use on this stream after the launch.
        unsafe {
            l.launch(LaunchConfig {
                grid_dim: (s.query_tiles(rows) as u32, s.heads as u32, s.batch as u32),
                block_dim: (self.kernel.threads() as u32, 1, 1),
                shared_mem_bytes: self.smem,
            })?
        };
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::cpu::{modified_reference_values, reference_values, CheckPlan, Inputs};
    use crate::attention::{AttentionCase, Pass};

    fn shape(tq: usize, tkv: usize) -> FlexShape {
        FlexShape {
            batch: 2,
            heads: 4,
            kv_heads: 2,
            seq_len_q: tq,
            seq_len_kv: tkv,
            head_dim: 64,
            dtype: Dtype::Bf16,
            scale: 0.125,
        }
    }

    /// Every named modification, and none.
    fn all_mods() -> Vec<Option<FlexMod>> {
        vec![
            None,
            Some(FlexMod::Causal),
            Some(FlexMod::SlidingWindow(5)),
            Some(FlexMod::Document),
            Some(FlexMod::PrefixLm(3)),
            Some(FlexMod::Alibi),
            Some(FlexMod::SoftCap(2.5)),
        ]
    }

    #[test]
    fn names_parse_back_and_bad_names_are_refused() {
        for m in all_mods() {
            let name = m.map_or("none".to_string(), |m| m.name());
            assert_eq!(FlexMod::parse(&name), Ok(m), "{name}");
        }
        for bad in [
            "",
            "causal2",
            "sliding_window(0)",
            "softcap(-1)",
            "softcap(inf)",
            "prefix_lm",
        ] {
            let e = FlexMod::parse(bad).unwrap_err();
            assert!(e.contains(bad) && e.contains("sliding_window(W)"), "{e}");
        }
    }

    #[test]
    fn documents_cover_the_sequence_and_repeat() {
        for t in [1, 17, 1024, 4096] {
            let lens = document_lengths(3, t);
            assert_eq!(lens, document_lengths(3, t));
            for l in &lens {
                assert_eq!(l.iter().sum::<usize>(), t);
                assert!(l[..l.len() - 1].iter().all(|&n| n >= (t / 16).max(1)));
                assert!(l.iter().all(|&n| n <= (3 * t / 16).max(1)), "{t}: {l:?}");
            }
            let ids = document_ids(&lens, t);
            assert_eq!(ids.len(), 3 * t);
            assert_eq!(ids[t], 0);
            assert_eq!(ids[t - 1] as usize, lens[0].len() - 1);
        }
        assert_ne!(document_lengths(2, 4096)[0], document_lengths(2, 4096)[1]);
    }

    /// A small case, its inputs' words and their float64 values (q, k, v, dO).
    fn small_case(tq: usize, tkv: usize) -> (AttentionCase, Inputs, [Vec<f64>; 4]) {
        let c = AttentionCase {
            seq_len_q: tq,
            seq_len_kv: tkv,
            kv_heads: 1,
            pass: Pass::FwdBwd,
            ..AttentionCase::new(2, 2, 1, 16)
        };
        let inp = Inputs::random(&c, 7);
        let dec =
            |w: &[u16]| -> Vec<f64> { (0..w.len()).map(|i| c.dtype.decode(w, i) as f64).collect() };
        let f = [dec(&inp.q), dec(&inp.k), dec(&inp.v), dec(&inp.dout)];
        (c, inp, f)
    }

    fn flex_shape_of(c: &AttentionCase) -> FlexShape {
        FlexShape {
            batch: c.batch,
            heads: c.heads,
            kv_heads: c.kv_heads,
            seq_len_q: c.seq_len_q,
            seq_len_kv: c.seq_len_kv,
            head_dim: c.head_dim,
            dtype: c.dtype,
            scale: c.scale(),
        }
    }

    #[test]
    fn checked_rows_reference_matches_the_dense_reference_for_every_mod() {
        // 9 queries against 12 keys: bottom-right alignment matters, and causal masks leave
        // the first rows of nothing only when Tq > Tkv (the second shape).
        for (tq, tkv) in [(9, 12), (12, 9)] {
            let (c, inp, [q, k, v, _]) = small_case(tq, tkv);
            let docs = document_ids(&document_lengths(c.batch, tkv), tkv);
            let plan = CheckPlan::full(&c);
            for m in all_mods() {
                let rule = FlexRule {
                    m,
                    heads: c.heads,
                    seq_len_q: tq,
                    seq_len_kv: tkv,
                    aux: &docs,
                };
                let refs = modified_reference_values(&c, &inp, &plan, &rule);
                let dense = match m {
                    Some(m) => flex_reference(&flex_shape_of(&c), &m, &q, &k, &v, &[tkv; 2], &docs),
                    None => flex_reference(
                        &flex_shape_of(&c),
                        &FlexMod::SoftCap(1e30),
                        &q,
                        &k,
                        &v,
                        &[tkv; 2],
                        &docs,
                    ),
                };
                for (a, b) in refs.o.iter().zip(&dense.0) {
                    assert!((a - b).abs() < 1e-9, "{m:?} {tq}x{tkv}: {a} vs {b}");
                }
                assert_eq!(refs.lse.len(), dense.1.len());
                for (a, b) in refs.lse.iter().zip(&dense.1) {
                    assert!(a == b || (a - b).abs() < 1e-9, "{m:?}: lse {a} vs {b}");
                }
            }
        }
    }

    #[test]
    fn checked_rows_backward_matches_the_causal_reference_and_finite_differences() {
        // More queries than keys: bottom-right causal leaves the first 3 rows no key, whose
        // gradients must be 0 through both references.
        let (c, inp, _) = small_case(12, 9);
        let plan = CheckPlan::full(&c);
        let causal = AttentionCase {
            causal: true,
            ..c.clone()
        };
        let want = reference_values(&causal, &inp, &plan);
        let rule = FlexRule {
            m: Some(FlexMod::Causal),
            heads: c.heads,
            seq_len_q: 12,
            seq_len_kv: 9,
            aux: &[],
        };
        let got = modified_reference_values(&c, &inp, &plan, &rule);
        assert!(got.dq[..3 * 16].iter().all(|&x| x == 0.0), "empty rows' dQ");
        assert!(got.lse[..3].iter().all(|&x| x == f64::INFINITY));
        for (a, b) in got
            .dq
            .iter()
            .zip(&want.dq)
            .chain(got.dk.iter().zip(&want.dk))
        {
            assert!((a - b).abs() < 1e-9, "{a} vs {b}");
        }
        let (c, inp, [q, k, v, dout]) = small_case(9, 12);
        let plan = CheckPlan::full(&c);
        // Causal through the rule against the suite's own causal reference.
        let causal = AttentionCase {
            causal: true,
            ..c.clone()
        };
        let want = reference_values(&causal, &inp, &plan);
        let rule = |m| FlexRule {
            m,
            heads: c.heads,
            seq_len_q: 9,
            seq_len_kv: 12,
            aux: &[],
        };
        let got = modified_reference_values(&c, &inp, &plan, &rule(Some(FlexMod::Causal)));
        for (name, a, b) in [
            ("dq", &got.dq, &want.dq),
            ("dk", &got.dk, &want.dk),
            ("dv", &got.dv, &want.dv),
        ] {
            assert_eq!(a.len(), b.len());
            for (x, y) in a.iter().zip(b.iter()) {
                assert!((x - y).abs() < 1e-9, "{name}: {x} vs {y}");
            }
        }
        // Score modifications: central differences of the loss Σ dO·O through the dense
        // reference, at a few elements of Q and K.
        let shape = flex_shape_of(&c);
        for m in [
            FlexMod::Alibi,
            FlexMod::SoftCap(2.5),
            FlexMod::SlidingWindow(5),
        ] {
            let refs = modified_reference_values(&c, &inp, &plan, &rule(Some(m)));
            let loss = |q: &[f64], k: &[f64]| -> f64 {
                let (o, _) = flex_reference(&shape, &m, q, k, &v, &[12, 12], &[]);
                o.iter().zip(&dout).map(|(a, b)| a * b).sum()
            };
            let eps = 1e-6;
            for idx in [0, 16 * 5 + 3, q.len() - 1] {
                let (mut qp, mut qm) = (q.clone(), q.clone());
                qp[idx] += eps;
                qm[idx] -= eps;
                let fd = (loss(&qp, &k) - loss(&qm, &k)) / (2.0 * eps);
                assert!(
                    (fd - refs.dq[idx]).abs() < 1e-6 * (1.0 + fd.abs()),
                    "{m:?} dq[{idx}]: {fd} vs {}",
                    refs.dq[idx]
                );
            }
            for idx in [0, 16 * 7 + 9, k.len() - 1] {
                let (mut kp, mut km) = (k.clone(), k.clone());
                kp[idx] += eps;
                km[idx] -= eps;
                let fd = (loss(&q, &kp) - loss(&q, &km)) / (2.0 * eps);
                assert!(
                    (fd - refs.dk[idx]).abs() < 1e-6 * (1.0 + fd.abs()),
                    "{m:?} dk[{idx}]: {fd} vs {}",
                    refs.dk[idx]
                );
            }
        }
        // Visible pairs: causal 9 x 12 bottom-right is 9·12 − 9·8/2 = 72 per batch entry.
        assert_eq!(rule(Some(FlexMod::Causal)).visible_pairs(0, 12), 72);
        assert_eq!(rule(None).visible_pairs(1, 12), 108);
    }

    #[test]
    fn causal_block_mask_keeps_the_lower_triangle_of_tiles() {
        // Three query tiles and a bit; query tile t (rows r0..=r1) needs the key tiles that
        // start at or before r1, and a key tile is whole when it holds FLEX_KEYS keys below
        // the length and its last key is at or before r0. The last key tile (8 keys) is never
        // whole.
        let t = 3 * FLEX_ROWS + 8;
        let s = shape(t, t);
        let (nq, nk) = (t.div_ceil(FLEX_ROWS), t.div_ceil(FLEX_KEYS));
        let bm = block_mask_host(&s, &FlexMod::Causal, &[t, t], &[]);
        let (mut want_visible, mut want_whole) = (0, 0);
        for qt in 0..nq {
            let (r0, r1) = (qt * FLEX_ROWS, ((qt + 1) * FLEX_ROWS).min(t) - 1);
            let count = r1 / FLEX_KEYS + 1;
            assert_eq!(bm.count[qt], count as i32, "query tile {qt}");
            let want: Vec<u8> = (0..count)
                .map(|kt| {
                    u8::from((kt + 1) * FLEX_KEYS <= t && kt * FLEX_KEYS + FLEX_KEYS - 1 <= r0)
                })
                .collect();
            assert_eq!(
                &bm.full[qt * nk..qt * nk + count],
                &want[..],
                "query tile {qt}"
            );
            want_visible += count;
            want_whole += want.iter().filter(|&&w| w == 1).count();
        }
        let (visible, whole, all) = bm.tiles(nk);
        assert_eq!(
            (visible, whole, all),
            (2 * 4 * want_visible, 2 * 4 * want_whole, 2 * 4 * nq * nk)
        );
        assert!(want_whole > 0 && want_whole < want_visible);
        // A key length of 70 in batch entry 1 leaves two tiles, the second partial.
        let bm = block_mask_host(&s, &FlexMod::SoftCap(30.0), &[t, 70], &[]);
        let list = 4 * nq; // batch 1, head 0, query tile 0
        assert_eq!(bm.count[list], 2);
        assert_eq!(&bm.full[list * nk..list * nk + 2], &[1, 0]);
    }

    #[test]
    fn sliding_window_and_documents_skip_far_tiles() {
        let s = shape(512, 512);
        let bm = block_mask_host(&s, &FlexMod::SlidingWindow(64), &[512, 512], &[]);
        // Each query tile needs the key tiles of its own rows and the one before (a window of
        // 64 keys).
        let most = (FLEX_ROWS / FLEX_KEYS + 1) as i32;
        assert!(bm.count.iter().all(|&n| n <= most), "{:?}", bm.count);
        assert!(bm.count.iter().skip(1).any(|&n| n == most));
        let docs: Vec<i32> = (0..2 * 512).map(|t| (t % 512) / 100).collect();
        let bm = block_mask_host(&s, &FlexMod::Document, &[512, 512], &docs);
        let (visible, _, all) = bm.tiles(8);
        assert!(visible * 2 < all, "{visible} of {all}");
        // Rows that the mask empties: 4 queries against 2 keys, bottom-right causal: rows 0
        // and 1 see no key (q + 2 - 4 < 0).
        let r = shape(4, 2);
        let q = vec![0.5; 2 * 4 * 4 * 64];
        let kv = vec![0.25; 2 * 2 * 2 * 64];
        let (o, lse) = flex_reference(&r, &FlexMod::Causal, &q, &kv, &kv, &[2, 2], &[]);
        assert_eq!(lse[0], f64::INFINITY);
        assert!(o[..64].iter().all(|&x| x == 0.0));
        assert!(lse[2].is_finite() && lse[3].is_finite());
    }

    #[test]
    fn reference_applies_alibi_and_softcap() {
        // One key per query (causal, 1 x 1): the output is V whatever the score.
        let s = FlexShape {
            batch: 1,
            heads: 2,
            kv_heads: 1,
            seq_len_q: 1,
            seq_len_kv: 3,
            head_dim: 64,
            dtype: Dtype::Bf16,
            scale: 1.0,
        };
        let q = vec![0.0; 2 * 64];
        let k = vec![0.0; 3 * 64];
        let v: Vec<f64> = (0..3 * 64).map(|i| (i / 64) as f64).collect();
        // Q = 0: scores are 0 before the modification; ALiBi adds m_h (j - 2), so the weights
        // are 2^(m_h (j - 2)) in natural-exp terms: exp(m_h (j - 2)).
        let (o, _) = flex_reference(&s, &FlexMod::Alibi, &q, &k, &v, &[3], &[]);
        let m0 = (-8.0f64 / 2.0).exp2();
        let w: Vec<f64> = (0..3).map(|j| (m0 * (j as f64 - 2.0)).exp()).collect();
        let want = (w[1] + 2.0 * w[2]) / w.iter().sum::<f64>();
        assert!((o[0] - want).abs() < 1e-12, "{} vs {want}", o[0]);
        assert!((FlexMod::SoftCap(30.0).modify(300.0, 0, 0, 0, 1, 1, 1) - 30.0).abs() < 1e-6);
        // Every modification has CUDA C for the kernel.
        for m in [
            FlexMod::Causal,
            FlexMod::SlidingWindow(8),
            FlexMod::Document,
            FlexMod::PrefixLm(4),
            FlexMod::Alibi,
            FlexMod::SoftCap(30.0),
        ] {
            let spec = m.spec();
            assert!(spec.mask.is_some() || spec.score.is_some(), "{}", m.name());
            let (_, _, src) = flex_source(&spec, 64, Dtype::Bf16);
            // The expressions are the bodies of the generated functions.
            let mask = spec.mask.as_deref().unwrap_or("true");
            let score = spec.score.as_deref().unwrap_or("score");
            assert!(
                src.contains(&format!("return ({mask}); }}")),
                "{}",
                m.name()
            );
            assert!(
                src.contains(&format!("return ({score}); }}")),
                "{}",
                m.name()
            );
        }
    }
}
