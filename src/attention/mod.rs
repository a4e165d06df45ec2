//! Softmax attention: the case description shared by the runner and the site, FLOP counting,
//! the CPU implementations (float64 reference and a tiled float32 flash model in `cpu`, the
//! multi-threaded float32 attention in `cpu_flash`), and the CUDA implementations (`flash`, the
//! default, and `math`, cuBLAS GEMMs around a softmax kernel).
//!
//! Layout everywhere: Q `[batch, heads, seq_len, head_dim]`, K and V
//! `[batch, kv_heads, seq_len, head_dim]`, O like Q; row-major, contiguous (BHSD, the layout
//! of PyTorch's `scaled_dot_product_attention`). Self-attention: queries and keys share seq_len.
//! Scale 1/sqrt(head_dim). Causal means query i sees keys 0..=i.

use std::collections::BTreeMap;

use crate::schema::Param;

pub mod cpu;
pub mod cpu_flash;
pub mod cuda;

pub use cuda::{dispatch, forward};

/// Element type of Q, K, V and O.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dtype {
    /// bfloat16 (8-bit exponent, 7-bit mantissa).
    Bf16,
    /// IEEE half precision.
    F16,
}

impl Dtype {
    /// Name in documents: `bf16` or `fp16`.
    pub fn as_str(self) -> &'static str {
        match self {
            Dtype::Bf16 => "bf16",
            Dtype::F16 => "fp16",
        }
    }

    /// Parses `bf16`, `fp16` (or `f16`).
    pub fn parse(s: &str) -> Option<Dtype> {
        match s {
            "bf16" => Some(Dtype::Bf16),
            "fp16" | "f16" => Some(Dtype::F16),
            _ => None,
        }
    }

    /// Largest relative L2 error accepted against the float64 reference: bf16 operands land
    /// between 1e-3 and 1e-2 (7-bit mantissa), fp16 about 8x lower.
    pub fn tolerance(self) -> f64 {
        match self {
            Dtype::Bf16 => 1e-2,
            Dtype::F16 => 5e-3,
        }
    }

    /// Rounds an f32 to this dtype and returns its bits.
    pub fn to_bits(self, x: f32) -> u16 {
        match self {
            Dtype::Bf16 => half::bf16::from_f32(x).to_bits(),
            Dtype::F16 => half::f16::from_f32(x).to_bits(),
        }
    }

    /// Value of 16-bit `bits` in this dtype.
    pub fn from_bits(self, bits: u16) -> f32 {
        match self {
            Dtype::Bf16 => half::bf16::from_bits(bits).to_f32(),
            Dtype::F16 => half::f16::from_bits(bits).to_f32(),
        }
    }
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
}

/// One attention case.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct AttentionCase {
    /// Batch size B.
    pub batch: usize,
    /// Query heads H.
    pub heads: usize,
    /// Key/value heads (H for multi-head attention, fewer for GQA; H % kv_heads == 0).
    pub kv_heads: usize,
    /// Sequence length T (queries and keys).
    pub seq_len: usize,
    /// Head dimension D.
    pub head_dim: usize,
    /// Causal mask.
    pub causal: bool,
    /// Element type.
    pub dtype: Dtype,
    /// Pass.
    pub pass: Pass,
}

impl AttentionCase {
    /// The case as named parameters for a document row.
    pub fn params(&self) -> BTreeMap<String, Param> {
        let mut m = BTreeMap::new();
        m.insert("batch".into(), Param::Int(self.batch as i64));
        m.insert("heads".into(), Param::Int(self.heads as i64));
        m.insert("kv_heads".into(), Param::Int(self.kv_heads as i64));
        m.insert("seq_len".into(), Param::Int(self.seq_len as i64));
        m.insert("head_dim".into(), Param::Int(self.head_dim as i64));
        m.insert("causal".into(), Param::Bool(self.causal));
        m.insert("dtype".into(), Param::Text(self.dtype.as_str().into()));
        m.insert("pass".into(), Param::Text(self.pass.as_str().into()));
        m
    }

    /// Reads a case back from named parameters.
    ///
    /// # Errors
    /// Names the missing or mistyped parameter.
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
            Some(Param::Text(s)) if s == "fwd" => Pass::Fwd,
            Some(Param::Text(s)) if s == "fwd+bwd" => Pass::FwdBwd,
            other => {
                return Err(format!(
                    "case parameter `pass` must be fwd or fwd+bwd, got {other:?}"
                ))
            }
        };
        Ok(AttentionCase {
            batch: int("batch")?,
            heads: int("heads")?,
            kv_heads: int("kv_heads")?,
            seq_len: int("seq_len")?,
            head_dim: int("head_dim")?,
            causal,
            dtype,
            pass,
        })
    }

    /// Elements of Q (and O).
    pub fn q_elems(&self) -> usize {
        self.batch * self.heads * self.seq_len * self.head_dim
    }

    /// Elements of K (and of V).
    pub fn kv_elems(&self) -> usize {
        self.batch * self.kv_heads * self.seq_len * self.head_dim
    }

    /// Bytes of Q, K and V together (2 bytes per element).
    pub fn input_bytes(&self) -> u64 {
        2 * (self.q_elems() + 2 * self.kv_elems()) as u64
    }

    /// FLOPs of one call: 4·B·H·T²·D for the two matrix products (2 FLOPs per multiply-add),
    /// halved when causal, ×3.5 for forward + backward (the backward does 2.5× the forward's
    /// matrix work). The convention of the FlashAttention papers' benchmarks.
    pub fn flops(&self) -> f64 {
        let t = self.seq_len as f64;
        let mut f = 4.0 * (self.batch * self.heads) as f64 * t * t * self.head_dim as f64;
        if self.causal {
            f /= 2.0;
        }
        if self.pass == Pass::FwdBwd {
            f *= 3.5;
        }
        f
    }

    /// The FLOP-counting rule of [`AttentionCase::flops`], in words, for the document.
    pub const FLOP_RULE: &'static str =
        "4·B·H·T²·D (two matrix products, 2 FLOPs per multiply-add), halved when causal, ×3.5 for forward + backward";

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

    /// Softmax scale 1/sqrt(D).
    pub fn scale(&self) -> f64 {
        1.0 / (self.head_dim as f64).sqrt()
    }
}

/// ‖out − ref‖₂ / ‖ref‖₂. NaN when any element is non-finite or `reference` is all zeros.
pub fn rel_l2(out: &[f64], reference: &[f64]) -> f64 {
    assert_eq!(out.len(), reference.len(), "rel_l2 of different lengths");
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (o, r) in out.iter().zip(reference) {
        if !o.is_finite() {
            return f64::NAN;
        }
        num += (o - r) * (o - r);
        den += r * r;
    }
    if den == 0.0 {
        return f64::NAN;
    }
    (num / den).sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn case() -> AttentionCase {
        AttentionCase {
            batch: 4,
            heads: 8,
            kv_heads: 8,
            seq_len: 16384,
            head_dim: 128,
            causal: false,
            dtype: Dtype::Bf16,
            pass: Pass::Fwd,
        }
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
    }

    #[test]
    fn params_roundtrip() {
        let c = case();
        assert_eq!(AttentionCase::from_params(&c.params()).unwrap(), c);
        let mut p = c.params();
        p.remove("seq_len");
        assert!(AttentionCase::from_params(&p)
            .unwrap_err()
            .contains("seq_len"));
    }

    #[test]
    fn rel_l2_detects_nan_and_error() {
        assert_eq!(rel_l2(&[1.0, 2.0], &[1.0, 2.0]), 0.0);
        assert!(rel_l2(&[f64::NAN, 2.0], &[1.0, 2.0]).is_nan());
        let e = rel_l2(&[1.1, 2.0], &[1.0, 2.0]);
        assert!((e - 0.1 / 5f64.sqrt()).abs() < 1e-12);
    }

    #[test]
    fn dtype_bits_roundtrip() {
        for d in [Dtype::Bf16, Dtype::F16] {
            assert_eq!(d.from_bits(d.to_bits(1.5)), 1.5);
        }
    }
}
