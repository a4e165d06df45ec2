//! Softmax attention: the case description shared by the runner and the site, FLOP counting,
//! the CPU implementations (float64 reference forward and backward, a tiled float32 flash
//! model in `cpu`, the multi-threaded float32 attention in `cpu_flash`), the CUDA
//! implementations (`flash`, the default, and `math`, cuBLAS GEMMs around softmax kernels), and
//! `decode`: the float64 reference of split-KV decoding over a paged KV cache (issue 10).
//!
//! Layout everywhere: Q `[batch, heads, seq_len_q, head_dim]`, K and V
//! `[batch, kv_heads, seq_len_kv, head_dim]`, O and dO like Q, dQ like Q, dK and dV like K;
//! row-major, contiguous (BHSD, the layout of PyTorch's `scaled_dot_product_attention`).
//! Query head h reads key/value head h / (heads / kv_heads) (GQA; MQA when kv_heads = 1).
//!
//! The function: O = softmax(scale · Q Kᵀ + mask) V with scale 1/√head_dim unless the case
//! names another. Masks:
//! - **Variable key lengths** (`kv_lens`, one per batch entry, padded layout): batch entry b
//!   sees only its first L_b = kv_lens\[b\] keys; the rest of K and V is padding (any value).
//!   Without `kv_lens`, L_b = seq_len_kv.
//! - **Causal, aligned bottom-right** (as FlashAttention-2 and cuDNN do): query i sees key j
//!   when j ≤ i + L_b − seq_len_q. With equal lengths that is the usual j ≤ i; with fewer
//!   queries than keys the last query sees every key (decoding); with more queries than keys
//!   the first seq_len_q − L_b queries see none.
//!
//! A query row that sees no key has output exactly 0 (not NaN), gradient 0, and log-sum-exp
//! +∞ (the convention of FlashAttention-2's `softmax_lse`).

use std::collections::BTreeMap;

use crate::schema::Param;

pub mod api;
pub mod cpu;
pub mod cpu_flash;
pub mod cuda;
pub mod decode;
pub mod decode_gpu;
pub mod files;
pub mod flex;
pub mod sm90;

pub use api::{
    dot_product_attention, dot_product_attention_vjp, mha, Device, MhaShape, MhaWeights,
};
pub use cuda::{dispatch, forward};

/// Element type of Q, K, V, O and the gradients.
///
/// Host copies of tensors are vectors of 16-bit words holding the tensor's little-endian bytes
/// (one word per bf16/fp16 element, two per fp32 element, low half first): the runner's raw
/// files and the device buffers carry the same bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dtype {
    /// bfloat16 (8-bit exponent, 7-bit mantissa).
    Bf16,
    /// IEEE half precision.
    F16,
    /// IEEE single precision.
    F32,
}

impl Dtype {
    /// Name in documents: `bf16`, `fp16` or `fp32`.
    pub fn as_str(self) -> &'static str {
        match self {
            Dtype::Bf16 => "bf16",
            Dtype::F16 => "fp16",
            Dtype::F32 => "fp32",
        }
    }

    /// Parses `bf16`, `fp16` (or `f16`), `fp32` (or `f32`).
    pub fn parse(s: &str) -> Option<Dtype> {
        match s {
            "bf16" => Some(Dtype::Bf16),
            "fp16" | "f16" => Some(Dtype::F16),
            "fp32" | "f32" => Some(Dtype::F32),
            _ => None,
        }
    }

    /// Bytes per element.
    pub fn bytes(self) -> usize {
        match self {
            Dtype::Bf16 | Dtype::F16 => 2,
            Dtype::F32 => 4,
        }
    }

    /// 16-bit words per element (1 or 2).
    pub fn words(self) -> usize {
        self.bytes() / 2
    }

    /// Machine epsilon of the dtype: the gap between 1.0 and the next larger value
    /// (2⁻⁷ for bf16, 2⁻¹⁰ for fp16, 2⁻²³ for fp32).
    pub fn epsilon(self) -> f64 {
        match self {
            Dtype::Bf16 => 2f64.powi(-7),
            Dtype::F16 => 2f64.powi(-10),
            Dtype::F32 => 2f64.powi(-23),
        }
    }

    /// Largest relative L2 error accepted against the float64 reference, for the output and
    /// for the gradients: bf16 operands land between 1e-3 and 1e-2 (7-bit mantissa), fp16
    /// about 8x lower; fp32 arithmetic lands far under 1e-4, while TF32 tensor cores (10-bit
    /// mantissa, about 3e-4) would fail it.
    pub fn tolerance(self) -> f64 {
        match self {
            Dtype::Bf16 => 1e-2,
            Dtype::F16 => 5e-3,
            Dtype::F32 => 1e-4,
        }
    }

    /// Rounds an f32 to this 16-bit dtype and returns its bits.
    ///
    /// # Panics
    /// For [`Dtype::F32`] (two words: use [`Dtype::encode`]).
    pub fn to_bits(self, x: f32) -> u16 {
        match self {
            Dtype::Bf16 => half::bf16::from_f32(x).to_bits(),
            Dtype::F16 => half::f16::from_f32(x).to_bits(),
            Dtype::F32 => panic!("fp32 is two 16-bit words: use Dtype::encode"),
        }
    }

    /// Value of 16-bit `bits` in this dtype.
    ///
    /// # Panics
    /// For [`Dtype::F32`] (use [`Dtype::decode`]).
    pub fn from_bits(self, bits: u16) -> f32 {
        match self {
            Dtype::Bf16 => half::bf16::from_bits(bits).to_f32(),
            Dtype::F16 => half::f16::from_bits(bits).to_f32(),
            Dtype::F32 => panic!("fp32 is two 16-bit words: use Dtype::decode"),
        }
    }

    /// Writes `x` rounded to this dtype into `out` ([`Dtype::words`] words).
    pub fn encode(self, x: f32, out: &mut [u16]) {
        match self {
            Dtype::F32 => {
                let b = x.to_bits();
                out[0] = b as u16;
                out[1] = (b >> 16) as u16;
            }
            _ => out[0] = self.to_bits(x),
        }
    }

    /// Element `i` of the words `w` as f32.
    pub fn decode(self, w: &[u16], i: usize) -> f32 {
        match self {
            Dtype::F32 => f32::from_bits(w[2 * i] as u32 | (w[2 * i + 1] as u32) << 16),
            _ => self.from_bits(w[i]),
        }
    }

    /// `xs` rounded to this dtype, as words.
    pub fn encode_all(self, xs: &[f32]) -> Vec<u16> {
        let n = self.words();
        let mut out = vec![0u16; xs.len() * n];
        for (x, o) in xs.iter().zip(out.chunks_exact_mut(n)) {
            self.encode(*x, o);
        }
        out
    }

    /// Every element of the words `w` as f64.
    pub fn decode_all(self, w: &[u16]) -> Vec<f64> {
        (0..w.len() / self.words())
            .map(|i| self.decode(w, i) as f64)
            .collect()
    }

    /// The words of one element that is NaN in this dtype (the poison of unwritten outputs):
    /// 0xFFFF is NaN in bf16 and fp16, 0xFFFF_FFFF in fp32.
    pub const POISON_WORD: u16 = 0xFFFF;
}

/// Forward only, or forward then backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Pass {
    /// Forward.
    Fwd,
    /// Forward and backward.
    FwdBwd,
}

impl Pass {
    /// Name in documents: `fwd` or `fwd+bwd`.
    pub fn as_str(self) -> &'static str {
        match self {
            Pass::Fwd => "fwd",
            Pass::FwdBwd => "fwd+bwd",
        }
    }

    /// Parses `fwd` or `fwd+bwd`.
    pub fn parse(s: &str) -> Option<Pass> {
        match s {
            "fwd" => Some(Pass::Fwd),
            "fwd+bwd" => Some(Pass::FwdBwd),
            _ => None,
        }
    }
}

/// One attention case (see the module documentation for layouts and masks).
#[derive(Clone, Debug, PartialEq)]
pub struct AttentionCase {
    /// Batch size B.
    pub batch: usize,
    /// Query heads H.
    pub heads: usize,
    /// Key/value heads (H for multi-head attention, fewer for GQA, 1 for MQA;
    /// H % kv_heads == 0).
    pub kv_heads: usize,
    /// Query sequence length (≥ 1).
    pub seq_len_q: usize,
    /// Key/value sequence length (≥ 1): the padded length when `kv_lens` is set.
    pub seq_len_kv: usize,
    /// Head dimension D.
    pub head_dim: usize,
    /// Causal mask, aligned bottom-right.
    pub causal: bool,
    /// Element type of inputs, output and gradients.
    pub dtype: Dtype,
    /// Pass.
    pub pass: Pass,
    /// Softmax scale; `None` is the default 1/√head_dim.
    pub scale: Option<f64>,
    /// Valid key length of each batch entry (each ≤ seq_len_kv, 0 allowed); `None`: every
    /// entry has seq_len_kv keys.
    pub kv_lens: Option<Vec<usize>>,
}

impl AttentionCase {
    /// Self-attention of `seq_len` tokens: multi-head (kv_heads = heads), not causal, bf16,
    /// forward, default scale, no variable lengths. Change the rest with struct update syntax.
    pub fn new(batch: usize, heads: usize, seq_len: usize, head_dim: usize) -> AttentionCase {
        AttentionCase {
            batch,
            heads,
            kv_heads: heads,
            seq_len_q: seq_len,
            seq_len_kv: seq_len,
            head_dim,
            causal: false,
            dtype: Dtype::Bf16,
            pass: Pass::Fwd,
            scale: None,
            kv_lens: None,
        }
    }

    /// The case as named parameters for a document row: `batch`, `heads`, `kv_heads`,
    /// `head_dim`, `causal`, `dtype`, `pass`; `seq_len` when query and key lengths are equal,
    /// else `seq_len_q` and `seq_len_kv`; `scale` (a float) only when it is not the default;
    /// `kv_lens` (text, comma-separated) only when set.
    pub fn params(&self) -> BTreeMap<String, Param> {
        let mut m = BTreeMap::new();
        let int = |x: usize| Param::Int(x as i64);
        m.insert("batch".into(), int(self.batch));
        m.insert("heads".into(), int(self.heads));
        m.insert("kv_heads".into(), int(self.kv_heads));
        if self.seq_len_q == self.seq_len_kv {
            m.insert("seq_len".into(), int(self.seq_len_q));
        } else {
            m.insert("seq_len_q".into(), int(self.seq_len_q));
            m.insert("seq_len_kv".into(), int(self.seq_len_kv));
        }
        m.insert("head_dim".into(), int(self.head_dim));
        m.insert("causal".into(), Param::Bool(self.causal));
        m.insert("dtype".into(), Param::Text(self.dtype.as_str().into()));
        m.insert("pass".into(), Param::Text(self.pass.as_str().into()));
        if let Some(s) = self
            .scale
            .filter(|s| s.to_bits() != self.default_scale().to_bits())
        {
            m.insert("scale".into(), Param::Float(s));
        }
        if let Some(l) = &self.kv_lens {
            let text: Vec<String> = l.iter().map(|x| x.to_string()).collect();
            m.insert("kv_lens".into(), Param::Text(text.join(",")));
        }
        m
    }

    /// Reads a case back from named parameters ([`AttentionCase::params`]'s forms) and checks
    /// it ([`AttentionCase::validate`]).
    ///
    /// # Errors
    /// Names the missing, mistyped or inconsistent parameter.
    pub fn from_params(p: &BTreeMap<String, Param>) -> Result<AttentionCase, String> {
        let int = |k: &str| match p.get(k) {
            Some(Param::Int(i)) if *i > 0 => Ok(*i as usize),
            other => Err(format!(
                "case parameter `{k}` must be a positive integer, got {other:?}"
            )),
        };
        let causal = match p.get("causal") {
            Some(Param::Bool(b)) => *b,
            other => {
                return Err(format!(
                    "case parameter `causal` must be a boolean, got {other:?}"
                ))
            }
        };
        let dtype = match p.get("dtype") {
            Some(Param::Text(s)) => Dtype::parse(s).ok_or(format!("unknown dtype `{s}`"))?,
            other => {
                return Err(format!(
                    "case parameter `dtype` must be text, got {other:?}"
                ))
            }
        };
        let pass = match p.get("pass") {
            Some(Param::Text(s)) if Pass::parse(s).is_some() => Pass::parse(s).expect("checked"),
            other => {
                return Err(format!(
                    "case parameter `pass` must be fwd or fwd+bwd, got {other:?}"
                ))
            }
        };
        let (seq_len_q, seq_len_kv) = match (
            p.contains_key("seq_len"),
            p.contains_key("seq_len_q") || p.contains_key("seq_len_kv"),
        ) {
            (true, false) => (int("seq_len")?, int("seq_len")?),
            (false, true) => (int("seq_len_q")?, int("seq_len_kv")?),
            (true, true) => {
                return Err(
                    "give either `seq_len` or `seq_len_q` and `seq_len_kv`, not both".into(),
                )
            }
            (false, false) => {
                return Err(
                    "case parameter `seq_len` (or `seq_len_q` and `seq_len_kv`) is missing".into(),
                )
            }
        };
        let scale = match p.get("scale") {
            None => None,
            Some(Param::Float(x)) => Some(*x),
            Some(Param::Int(i)) => Some(*i as f64),
            other => {
                return Err(format!(
                    "case parameter `scale` must be a number, got {other:?}"
                ))
            }
        };
        let kv_lens = match p.get("kv_lens") {
            None => None,
            Some(Param::Text(s)) => Some(
                s.split(',')
                    .map(|x| {
                        x.trim()
                            .parse::<usize>()
                            .map_err(|_| format!("case parameter `kv_lens`: `{x}` is not a length"))
                    })
                    .collect::<Result<Vec<usize>, String>>()?,
            ),
            other => {
                return Err(format!(
                    "case parameter `kv_lens` must be comma-separated lengths, got {other:?}"
                ))
            }
        };
        let c = AttentionCase {
            batch: int("batch")?,
            heads: int("heads")?,
            kv_heads: int("kv_heads")?,
            seq_len_q,
            seq_len_kv,
            head_dim: int("head_dim")?,
            causal,
            dtype,
            pass,
            scale,
            kv_lens,
        };
        c.validate()?;
        Ok(c)
    }

    /// Checks the case's consistency.
    ///
    /// # Errors
    /// A zero size, heads not a multiple of kv_heads, a non-finite or non-positive scale,
    /// `kv_lens` of the wrong count or with a length beyond seq_len_kv.
    pub fn validate(&self) -> Result<(), String> {
        for (name, v) in [
            ("batch", self.batch),
            ("heads", self.heads),
            ("kv_heads", self.kv_heads),
            ("seq_len_q", self.seq_len_q),
            ("seq_len_kv", self.seq_len_kv),
            ("head_dim", self.head_dim),
        ] {
            if v == 0 {
                return Err(format!("{name} must be at least 1"));
            }
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return Err(format!(
                "heads ({}) must be a multiple of kv_heads ({})",
                self.heads, self.kv_heads
            ));
        }
        if let Some(s) = self.scale {
            if !(s.is_finite() && s > 0.0) {
                return Err(format!("scale must be finite and positive, got {s}"));
            }
        }
        if let Some(l) = &self.kv_lens {
            if l.len() != self.batch {
                return Err(format!(
                    "kv_lens has {} lengths for batch {}",
                    l.len(),
                    self.batch
                ));
            }
            if let Some(x) = l.iter().find(|&&x| x > self.seq_len_kv) {
                return Err(format!(
                    "kv_lens entry {x} exceeds seq_len_kv {}",
                    self.seq_len_kv
                ));
            }
        }
        Ok(())
    }

    /// Query heads per key/value head.
    pub fn group(&self) -> usize {
        self.heads / self.kv_heads
    }

    /// Valid keys of batch entry `b` (L_b).
    pub fn kv_len(&self, b: usize) -> usize {
        self.kv_lens.as_ref().map_or(self.seq_len_kv, |l| l[b])
    }

    /// Keys query `i` of batch entry `b` sees: keys `0..n` (the mask is a prefix).
    pub fn visible_keys(&self, b: usize, i: usize) -> usize {
        let l = self.kv_len(b);
        if self.causal {
            (i as i64 + l as i64 - self.seq_len_q as i64 + 1).clamp(0, l as i64) as usize
        } else {
            l
        }
    }

    /// Elements of Q (and of O, dO, dQ).
    pub fn q_elems(&self) -> usize {
        self.batch * self.heads * self.seq_len_q * self.head_dim
    }

    /// Elements of K (and of V, dK, dV).
    pub fn kv_elems(&self) -> usize {
        self.batch * self.kv_heads * self.seq_len_kv * self.head_dim
    }

    /// Bytes of the inputs: Q, K and V, and dO for forward + backward.
    pub fn input_bytes(&self) -> u64 {
        let dout = if self.pass == Pass::FwdBwd {
            self.q_elems()
        } else {
            0
        };
        (self.dtype.bytes() * (self.q_elems() + 2 * self.kv_elems() + dout)) as u64
    }

    /// (query, key) pairs batch entry `b` computes per head, by the FLOP convention: Tq·L_b,
    /// or for causal the area of the visible trapezoid m·L_b − m²/2 with m = min(Tq, L_b)
    /// (T²/2 for square self-attention, the FlashAttention papers' halving).
    pub fn pairs(&self, b: usize) -> f64 {
        let (tq, l) = (self.seq_len_q as f64, self.kv_len(b) as f64);
        if self.causal {
            let m = tq.min(l);
            m * l - m * m / 2.0
        } else {
            tq * l
        }
    }

    /// FLOPs of one call: 4·H·D per (query, key) pair ([`AttentionCase::pairs`]) for the two
    /// matrix products (2 FLOPs per multiply-add), summed over the batch, ×3.5 for forward +
    /// backward (the backward does 2.5× the forward's matrix work). For square
    /// self-attention: 4·B·H·T²·D, halved when causal, the convention of the FlashAttention
    /// papers' benchmarks.
    pub fn flops(&self) -> f64 {
        let pairs: f64 = (0..self.batch).map(|b| self.pairs(b)).sum();
        let mut f = 4.0 * self.heads as f64 * self.head_dim as f64 * pairs;
        if self.pass == Pass::FwdBwd {
            f *= 3.5;
        }
        f
    }

    /// True for a decoding shape: at most [`AttentionCase::DECODE_MAX_QUERIES`] query rows
    /// against a cache of at least [`AttentionCase::DECODE_MIN_KEYS`] keys, forward only. Such
    /// a call is a stream through the KV cache (a few FLOPs per byte), so its rows carry
    /// [`AttentionCase::bytes_moved`] and GB/s besides TFLOP/s.
    pub fn is_decoding(&self) -> bool {
        self.pass == Pass::Fwd
            && self.seq_len_q <= Self::DECODE_MAX_QUERIES
            && self.seq_len_kv >= Self::DECODE_MIN_KEYS
    }

    /// Most query rows of a decoding shape ([`AttentionCase::is_decoding`]).
    pub const DECODE_MAX_QUERIES: usize = 16;

    /// Fewest cache keys of a decoding shape ([`AttentionCase::is_decoding`]).
    pub const DECODE_MIN_KEYS: usize = 1024;

    /// Bytes one forward call must move through device memory at least: Q and O
    /// (B·H·seq_len_q·D elements each) and K and V over each sequence's keys
    /// (2·KVH·D·Σ_b kv_len(b) elements), at the dtype's size. The figure GB/s is computed
    /// from for decoding shapes.
    pub fn bytes_moved(&self) -> f64 {
        let qo = 2 * self.batch * self.heads * self.seq_len_q * self.head_dim;
        let keys: usize = (0..self.batch).map(|b| self.kv_len(b)).sum();
        let kv = 2 * self.kv_heads * self.head_dim * keys;
        ((qo + kv) * self.dtype.bytes()) as f64
    }

    /// The byte-counting rule of [`AttentionCase::bytes_moved`], in words, for the document.
    pub fn byte_rule() -> String {
        format!(
            "decoding shapes (at most {} query rows, at least {} cache keys, forward): Q and O \
             (B·H·seq_len_q·D elements each) plus K and V over each sequence's keys \
             (2·KVH·D·Σ kv_len), at the dtype's size",
            Self::DECODE_MAX_QUERIES,
            Self::DECODE_MIN_KEYS
        )
    }

    /// The FLOP-counting rule of [`AttentionCase::flops`], in words, for the document.
    pub const FLOP_RULE: &'static str =
        "4·B·H·T²·D (two matrix products, 2 FLOPs per multiply-add), halved when causal, ×3.5 for forward + backward; with seq_len_q ≠ seq_len_kv or per-sequence key lengths, 4·H·D per computed (query, key) pair summed over the batch, the causal pairs counted as the area of the bottom-right-aligned triangle (m·L − m²/2, m = min(seq_len_q, L))";

    /// The case parameters the attention figures are drawn against (`config.axes`).
    pub const AXES: [&'static str; 1] = ["seq_len"];

    /// The throughputs attention rows carry (`config.throughput`): TFLOP/s from
    /// [`AttentionCase::flops`].
    pub fn throughput_decls() -> Vec<crate::schema::Throughput> {
        vec![crate::schema::Throughput {
            key: "tflops".into(),
            unit: "TFLOP/s".into(),
            count: crate::schema::Count::Flops,
            per_second: 1e12,
            ceiling: None,
        }]
    }

    /// [`AttentionCase::throughput_decls`] plus GB/s from [`AttentionCase::bytes_moved`], for
    /// a run that holds decoding shapes ([`AttentionCase::is_decoding`]).
    pub fn decoding_throughput_decls() -> Vec<crate::schema::Throughput> {
        let mut t = Self::throughput_decls();
        t.push(crate::schema::Throughput {
            key: "gbps".into(),
            unit: "GB/s".into(),
            count: crate::schema::Count::Bytes,
            per_second: 1e9,
            ceiling: None,
        });
        t
    }

    /// The default softmax scale, 1/√D.
    pub fn default_scale(&self) -> f64 {
        1.0 / (self.head_dim as f64).sqrt()
    }

    /// The softmax scale: the case's, else 1/√D.
    pub fn scale(&self) -> f64 {
        self.scale.unwrap_or_else(|| self.default_scale())
    }
}

/// ‖out − ref‖₂ / ‖ref‖₂. NaN when any element of either is non-finite, so a NaN can never
/// pass a `<= tolerance` check. When `reference` is all zeros (no scale of its own) it is the
/// absolute error ‖out‖₂, as the runner's check (`runner::protocol::check_output`) does.
pub fn rel_l2(out: &[f64], reference: &[f64]) -> f64 {
    assert_eq!(out.len(), reference.len(), "rel_l2 of different lengths");
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (o, r) in out.iter().zip(reference) {
        if !o.is_finite() || !r.is_finite() {
            return f64::NAN;
        }
        num += (o - r) * (o - r);
        den += r * r;
    }
    if den == 0.0 {
        // A reference of zeros has no scale: the absolute error (as the runner's check).
        return num.sqrt();
    }
    (num / den).sqrt()
}

/// The largest of several errors, NaN when any is NaN. (`f64::max` returns the other operand
/// when one is NaN, so folding errors with it would let a NaN output pass.)
pub fn worst_error(errors: impl IntoIterator<Item = f64>) -> f64 {
    let mut worst = f64::NEG_INFINITY;
    for e in errors {
        if e.is_nan() {
            return f64::NAN;
        }
        if e > worst {
            worst = e;
        }
    }
    worst
}

#[cfg(test)]
mod tests {
    use super::*;

    fn case() -> AttentionCase {
        AttentionCase::new(4, 8, 16384, 128)
    }

    #[test]
    fn flops_follow_the_convention() {
        let c = case();
        assert_eq!(c.flops(), 4.0 * 32.0 * 16384.0 * 16384.0 * 128.0);
        let causal = AttentionCase {
            causal: true,
            ..c.clone()
        };
        assert_eq!(causal.flops(), c.flops() / 2.0);
        let bwd = AttentionCase {
            pass: Pass::FwdBwd,
            ..c.clone()
        };
        assert_eq!(bwd.flops(), c.flops() * 3.5);
        // Decoding: 1 query, 20 keys; causal bottom-right sees all 20 keys, counted as 20 − ½.
        let dec = AttentionCase {
            seq_len_q: 1,
            seq_len_kv: 20,
            ..AttentionCase::new(4, 32, 1, 128)
        };
        assert_eq!(dec.flops(), 4.0 * 4.0 * 32.0 * 128.0 * 20.0);
        // More queries than keys, causal: only the triangle of the last L rows.
        let tall = AttentionCase {
            seq_len_q: 5,
            seq_len_kv: 2,
            causal: true,
            ..AttentionCase::new(1, 1, 1, 8)
        };
        assert_eq!(tall.pairs(0), 2.0);
        // Variable lengths count each entry's own keys; an empty entry costs nothing.
        let var = AttentionCase {
            kv_lens: Some(vec![0, 10]),
            seq_len_kv: 16,
            seq_len_q: 4,
            ..AttentionCase::new(2, 1, 1, 8)
        };
        assert_eq!(var.flops(), 4.0 * 8.0 * 40.0);
    }

    #[test]
    fn params_roundtrip() {
        let c = case();
        let p = c.params();
        assert!(p.contains_key("seq_len") && !p.contains_key("seq_len_q"));
        assert!(!p.contains_key("scale") && !p.contains_key("kv_lens"));
        assert_eq!(AttentionCase::from_params(&p).unwrap(), c);
        let mut p = c.params();
        p.remove("seq_len");
        assert!(AttentionCase::from_params(&p)
            .unwrap_err()
            .contains("seq_len"));
        // Different lengths carry both; a scale other than the default and kv_lens are kept.
        let cross = AttentionCase {
            seq_len_q: 7,
            seq_len_kv: 20,
            scale: Some(0.3),
            kv_lens: Some(vec![20, 0, 1, 13]),
            dtype: Dtype::F32,
            pass: Pass::FwdBwd,
            ..case()
        };
        let p = cross.params();
        assert_eq!(p.get("seq_len_q"), Some(&Param::Int(7)));
        assert_eq!(p.get("seq_len_kv"), Some(&Param::Int(20)));
        assert!(!p.contains_key("seq_len"));
        assert_eq!(p.get("scale"), Some(&Param::Float(0.3)));
        assert_eq!(p.get("kv_lens"), Some(&Param::Text("20,0,1,13".into())));
        assert_eq!(AttentionCase::from_params(&p).unwrap(), cross);
        // The default scale written out is not recorded.
        let dflt = AttentionCase {
            scale: Some(1.0 / 128f64.sqrt()),
            ..case()
        };
        assert!(!dflt.params().contains_key("scale"));
        // Inconsistent cases are refused with the reason.
        let mut both = cross.params();
        both.insert("seq_len".into(), Param::Int(7));
        assert!(AttentionCase::from_params(&both)
            .unwrap_err()
            .contains("not both"));
        let long = AttentionCase {
            kv_lens: Some(vec![21, 0, 1, 13]),
            ..cross.clone()
        };
        assert!(AttentionCase::from_params(&long.params())
            .unwrap_err()
            .contains("exceeds"));
        let gqa = AttentionCase {
            kv_heads: 3,
            ..case()
        };
        assert!(gqa.validate().unwrap_err().contains("multiple"));
    }

    #[test]
    fn causal_is_aligned_bottom_right() {
        let c = AttentionCase {
            seq_len_q: 2,
            seq_len_kv: 5,
            causal: true,
            ..AttentionCase::new(1, 1, 1, 8)
        };
        assert_eq!((c.visible_keys(0, 0), c.visible_keys(0, 1)), (4, 5));
        let tall = AttentionCase {
            seq_len_q: 5,
            seq_len_kv: 2,
            ..c.clone()
        };
        let seen: Vec<usize> = (0..5).map(|i| tall.visible_keys(0, i)).collect();
        assert_eq!(seen, vec![0, 0, 0, 1, 2]);
        let var = AttentionCase {
            kv_lens: Some(vec![3]),
            ..c
        };
        assert_eq!((var.visible_keys(0, 0), var.visible_keys(0, 1)), (2, 3));
    }

    #[test]
    fn rel_l2_detects_nan_and_error() {
        assert_eq!(rel_l2(&[1.0, 2.0], &[1.0, 2.0]), 0.0);
        assert!(rel_l2(&[f64::NAN, 2.0], &[1.0, 2.0]).is_nan());
        let e = rel_l2(&[1.1, 2.0], &[1.0, 2.0]);
        assert!((e - 0.1 / 5f64.sqrt()).abs() < 1e-12);
        // f64::max would hide the NaN; worst_error does not.
        assert_eq!(f64::NAN.max(1e-3), 1e-3);
        assert!(worst_error([1e-3, f64::NAN, 2e-3]).is_nan());
        assert_eq!(worst_error([1e-3, 4e-3, 2e-3]), 4e-3);
    }

    #[test]
    fn dtype_bits_roundtrip() {
        for d in [Dtype::Bf16, Dtype::F16, Dtype::F32] {
            let w = d.encode_all(&[1.5, -0.25]);
            assert_eq!(w.len(), 2 * d.words());
            assert_eq!(d.decode_all(&w), vec![1.5, -0.25]);
        }
        let w = Dtype::F32.encode_all(&[0.1]);
        assert_eq!(Dtype::F32.decode(&w, 0), 0.1f32);
        assert!(Dtype::F32
            .decode(&[Dtype::POISON_WORD, Dtype::POISON_WORD], 0)
            .is_nan());
        assert!(Dtype::Bf16.decode(&[Dtype::POISON_WORD], 0).is_nan());
        assert!(Dtype::F16.decode(&[Dtype::POISON_WORD], 0).is_nan());
    }
}
