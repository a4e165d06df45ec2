//! CUDA attention implementations: `flash` (the project's kernels, the default: forward
//! `kernels/flash_attn_fwd.cu`, backward `kernels/flash_attn_bwd.cu`) and `math` (cuBLAS GEMMs
//! around the project's row kernels `kernels/softmax_rows.cu`).
//!
//! Kernels are embedded here and compiled by NVRTC at run time for the device's architecture;
//! each case compiles only the instantiations it needs. Both implementations compute every
//! shape of [`AttentionCase`] (any lengths, separate query and key lengths with bottom-right
//! causal, per-sequence key lengths, GQA/MQA, any scale) except that `flash` takes no fp32
//! ([`Implementation::supports`] says why) and head dims other than
//! [`FLASH_HEAD_DIMS`].

use cudarc::cublas::sys::{
    cublasComputeType_t, cublasGemmAlgo_t, cublasMath_t, cublasOperation_t, cudaDataType_t,
};
use cudarc::cublas::CudaBlas;
use cudarc::driver::{
    CudaFunction, CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
};

use super::cpu::Inputs;
use super::{AttentionCase, Dtype, Pass};
use crate::gpu::{Gpu, GpuError};

/// Helpers every flash kernel source starts with (16-bit packing, mma.sync, ldmatrix,
/// cp.async).
pub const PRELUDE_SRC: &str = include_str!("../../kernels/attn_prelude.cuh");
/// Source of the flash forward kernel (after [`PRELUDE_SRC`]).
pub const FLASH_SRC: &str = include_str!("../../kernels/flash_attn_fwd.cu");
/// The fast path of the forward for equal query and key lengths
/// (`kernels/flash_attn_fwd_aligned.cu`, after [`PRELUDE_SRC`]).
pub const FLASH_FAST_SRC: &str = include_str!("../../kernels/flash_attn_fwd_aligned.cu");

/// True when the forward of `c` can take the fast path ([`flash_fast_instance`]): equal query
/// and key lengths (any length ≥ 1: a length that is not a multiple of the 128-row query tile
/// takes the instance with a masked last tile), head_dim 64 or 128, every key valid, 16-bit, in
/// any configuration [`FlashConfig::parse`] accepts. For forward + backward the instance also
/// writes the log-sum-exp.
pub fn flash_fast_path(c: &AttentionCase, fc: FlashConfig) -> bool {
    c.dtype != Dtype::F32
        && c.seq_len_q == c.seq_len_kv
        && (c.head_dim == 64 || c.head_dim == 128)
        && c.kv_lens.is_none()
        && c.heads.is_multiple_of(c.kv_heads.max(1))
        && fc.query_tile().is_multiple_of(fc.key_tile)
        && c.seq_len_q >= 1
}

/// True when `c`'s length is a multiple of `fc`'s query tile, so the fast path needs no masked
/// last tile (the `EVEN` instance of `flash_fwd_v3`).
pub fn flash_even(c: &AttentionCase, fc: FlashConfig) -> bool {
    c.seq_len_q.is_multiple_of(fc.query_tile()) && c.seq_len_kv.is_multiple_of(fc.key_tile)
}

/// The kernel name and the NVRTC source of the fast-path forward for `c` (`flash_fwd_v3` of
/// `kernels/flash_attn_fwd_aligned.cu` with configuration `fc`, `EVEN` from [`flash_even`]: one
/// compile serves every non-aligned length; `LSE_OUT` for forward + backward); its arguments
/// are `(Q, K, V, O, LSE, T, H, KVH, scale_log2)`.
pub fn flash_fast_instance(c: &AttentionCase, fc: FlashConfig) -> (String, String) {
    let dt = dtype_tag(c.dtype);
    let mask = if c.causal { "causal" } else { "full" };
    let even = flash_even(c, fc);
    let lse = c.pass == Pass::FwdBwd;
    let name = format!(
        "flash_fwd_aligned_{dt}_d{}_{mask}_{}{}{}",
        c.head_dim,
        fc.name(),
        if even { "" } else { "_tail" },
        if lse { "_lse" } else { "" }
    );
    let (bf, causal, d) = (c.dtype == Dtype::Bf16, c.causal, c.head_dim);
    let src = format!(
        "{PRELUDE_SRC}\n{FLASH_FAST_SRC}\nextern \"C\" __global__ void __launch_bounds__({threads}) {name}(\
         const u16* Q, const u16* K, const u16* V, u16* O, float* LSE, int T, int H, int KVH, \
         float scale_log2) {{ flash_fwd_v3<{d}, {w}, {m}, {k}, {bf}, {causal}, {even}, {lse}>(Q, K, V, O, \
         LSE, T, H, KVH, scale_log2); }}\n",
        threads = 32 * fc.warps,
        w = fc.warps,
        m = fc.m_tiles,
        k = fc.key_tile,
    );
    (name, src)
}
/// Source of the flash backward kernels (after [`PRELUDE_SRC`]).
pub const FLASH_BWD_SRC: &str = include_str!("../../kernels/flash_attn_bwd.cu");
/// Source of the row kernels of the math path (softmax, its backward, row dot products).
pub const SOFTMAX_SRC: &str = include_str!("../../kernels/softmax_rows.cu");

/// Head dimensions the flash kernels are instantiated for.
pub const FLASH_HEAD_DIMS: [usize; 5] = [32, 64, 96, 128, 256];

/// The forward configurations the tile sweep measures (`attention --grids tiles`, the document
/// `gpu_attention_tiles.json`), head_dim 64 and 128, each on the fast path
/// ([`flash_fast_path`]).
pub const FWD_SWEEP: [&str; 5] = [
    "v3w4m2b64",
    "v3w4m2b32",
    "v3w4m1b64",
    "v3w8m1b64",
    "v3w8m2b32",
];

/// The backward configurations the tile sweep measures (forward + backward, the forward in its
/// default configuration); [`BwdConfig::check`] drops those a head dim cannot run.
pub const BWD_SWEEP: [&str; 10] = [
    "w8r32", "w8r32v", "w8r32u2v", "w8r16v", "w8r16u2v", "w4r32v", "w8r64", "w8r64v", "w8r64dv",
    "w4r32dv",
];

/// Why `flash` does not take fp32 inputs, in the words of an `unsupported` row.
pub const FLASH_FP32_REASON: &str = "fp32 inputs: the flash kernels run on mma.sync m16n8k16 with 16-bit (bf16/fp16) operands; fp32 would need TF32 tensor cores (10-bit mantissa, about 3e-4 error, not an fp32 result) or a CUDA-core kernel; `math` computes fp32 with cuBLAS SGEMM";

/// A flash forward configuration: warps per CTA, 16-row groups per warp and keys per tile,
/// written `v3w4m2b64` (4 warps, 2 row groups per warp, 64-key tiles: 128 query rows per CTA).
/// `kernels/flash_attn_fwd.cu` documents the kernel and `kernels/TUNING.md` the measurements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlashConfig {
    /// Warps per CTA (4 or 8).
    pub warps: usize,
    /// Groups of 16 query rows per warp (1 or 2).
    pub m_tiles: usize,
    /// Keys per K/V tile (32 or 64).
    pub key_tile: usize,
}

/// True when `flash` runs the wgmma kernels for case `c` on a device of architecture `arch`:
/// where [`super::sm90::takes`] the case, unless a configuration names the portable kernels
/// (`named_fwd`: a forward or backward configuration given to [`Runner::with_configs`], or a
/// forward one in `KP_FLASH_CONFIG`; `named_bwd`: a backward one in `KP_FLASH_BWD_CONFIG`,
/// which counts for forward + backward only).
fn wgmma_path(arch: &str, c: &AttentionCase, named_fwd: bool, named_bwd: bool) -> bool {
    let named = named_fwd || (named_bwd && c.pass == Pass::FwdBwd);
    !named && super::sm90::takes(arch, c)
}

/// Reads `head_dim=config` pairs from the environment variable `var`, returning the config for
/// `head_dim` when one is named.
fn env_config(var: &str, head_dim: usize) -> Result<Option<String>, String> {
    let Ok(spec) = std::env::var(var) else {
        return Ok(None);
    };
    for part in spec.split(',').filter(|p| !p.is_empty()) {
        let (d, c) = part
            .split_once('=')
            .ok_or_else(|| format!("{var} part `{part}`: expected head_dim=config"))?;
        if d.trim().parse::<usize>().ok() == Some(head_dim) {
            return Ok(Some(c.trim().to_string()));
        }
    }
    Ok(None)
}

impl FlashConfig {
    /// Parses `v3w{4,8}m{1,2}b{32,64}` (the query tile must be a multiple of the key tile).
    ///
    /// # Errors
    /// Names the string and the accepted forms.
    pub fn parse(s: &str) -> Result<FlashConfig, String> {
        let bad = || format!("flash config `{s}`: expected v3w<4|8>m<1|2>b<32|64>");
        let num = |t: &str| t.parse::<usize>().map_err(|_| bad());
        let rest = s.strip_prefix("v3w").ok_or_else(bad)?;
        let (w, rest) = rest.split_once('m').ok_or_else(bad)?;
        let (m, b) = rest.split_once('b').ok_or_else(bad)?;
        let c = FlashConfig {
            warps: num(w)?,
            m_tiles: num(m)?,
            key_tile: num(b)?,
        };
        let ok =
            matches!(c.warps, 4 | 8) && matches!(c.m_tiles, 1 | 2) && matches!(c.key_tile, 32 | 64);
        if !ok || !c.query_tile().is_multiple_of(c.key_tile) {
            return Err(bad());
        }
        Ok(c)
    }

    /// The written form, e.g. `v3w4m2b64`.
    pub fn name(&self) -> String {
        format!("v3w{}m{}b{}", self.warps, self.m_tiles, self.key_tile)
    }

    /// Query rows per CTA.
    pub fn query_tile(&self) -> usize {
        16 * self.warps * self.m_tiles
    }

    /// Dynamic shared memory for `head_dim`, bytes: a Q tile and two K and two V tiles, rows
    /// padded by 8 elements.
    pub fn smem_bytes(&self, head_dim: usize) -> u32 {
        ((self.query_tile() + 4 * self.key_tile) * (head_dim + 8) * 2) as u32
    }

    /// The default for `head_dim` (see `kernels/TUNING.md`), unless the environment variable
    /// `KP_FLASH_CONFIG` (`64=v3w4m2b64,128=v3w4m2b32`, set by the runner's `--flash-config`)
    /// names another.
    ///
    /// # Errors
    /// A malformed `KP_FLASH_CONFIG`.
    pub fn for_head_dim(head_dim: usize) -> Result<FlashConfig, String> {
        if let Some(c) = env_config("KP_FLASH_CONFIG", head_dim)? {
            return FlashConfig::parse(&c);
        }
        // v3w4m2b64 was the fastest correct configuration for head dims 64 and 128 on the H200
        // (kernels/TUNING.md, v3); at 256 its fp32 accumulators alone would take 256
        // registers, so one 16-row group per warp and 32-key tiles (241 registers, no spills).
        Ok(if head_dim > 128 {
            FlashConfig {
                warps: 8,
                m_tiles: 1,
                key_tile: 32,
            }
        } else {
            FlashConfig {
                warps: 4,
                m_tiles: 2,
                key_tile: 64,
            }
        })
    }
}

/// A flash backward configuration: warps per CTA (each owns 16 keys, so a CTA owns
/// 16 · warps keys), query rows per step, the unroll of the S^T and dP^T products' loop over
/// head_dim, and whether dQ's fp32 adds are 8-byte vector reductions; written `w8r32`,
/// `w8r32u2` or `w8r32u2v` (`kernels/flash_attn_bwd.cu` documents the kernel).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BwdConfig {
    /// Warps per CTA (4 or 8).
    pub warps: usize,
    /// Query rows per step (16, 32 or 64); the dQ product splits them over the warps, so
    /// `warps` must be a multiple of rows / 16.
    pub query_rows: usize,
    /// 32-column steps of the products' loop over head_dim the compiler may unroll (1, 2 or
    /// 4; 1 keeps it rolled).
    pub unroll: usize,
    /// dQ's adds as `red.global.add.v2.f32` on compute capability 9.0 and newer (two scalar
    /// adds elsewhere).
    pub vec_red: bool,
    /// Drops the redundant barrier that closes each step (`d` in the name; the kernel's
    /// comment on `END_SYNC` says why it is redundant).
    pub drop_end_sync: bool,
}

impl BwdConfig {
    /// Parses `w{4,8}r{16,32,64}[u{1,2,4}][d][v]`.
    ///
    /// # Errors
    /// Names the string and the accepted forms.
    pub fn parse(s: &str) -> Result<BwdConfig, String> {
        let bad =
            || format!("flash backward config `{s}`: expected w<4|8>r<16|32|64>[u<1|2|4>][d][v]");
        let rest = s.strip_prefix('w').ok_or_else(bad)?;
        let (w, rest) = rest.split_once('r').ok_or_else(bad)?;
        let (rest, vec_red) = match rest.strip_suffix('v') {
            Some(r) => (r, true),
            None => (rest, false),
        };
        let (rest, drop_end_sync) = match rest.strip_suffix('d') {
            Some(r) => (r, true),
            None => (rest, false),
        };
        let (r, u) = match rest.split_once('u') {
            Some((r, u)) => (r, u.parse().map_err(|_| bad())?),
            None => (rest, 1),
        };
        let c = BwdConfig {
            warps: w.parse().map_err(|_| bad())?,
            query_rows: r.parse().map_err(|_| bad())?,
            unroll: u,
            vec_red,
            drop_end_sync,
        };
        let ok = matches!(c.warps, 4 | 8)
            && matches!(c.query_rows, 16 | 32 | 64)
            && matches!(c.unroll, 1 | 2 | 4)
            && c.warps.is_multiple_of(c.query_rows / 16);
        if !ok {
            return Err(bad());
        }
        Ok(c)
    }

    /// The written form, e.g. `w8r32` (unroll 1, scalar adds) or `w8r32u2v`.
    pub fn name(&self) -> String {
        let mut s = format!("w{}r{}", self.warps, self.query_rows);
        if self.unroll != 1 {
            s += &format!("u{}", self.unroll);
        }
        if self.drop_end_sync {
            s.push('d');
        }
        if self.vec_red {
            s.push('v');
        }
        s
    }

    /// Keys per CTA.
    pub fn key_tile(&self) -> usize {
        16 * self.warps
    }

    /// Checks that the configuration can run `head_dim`: the dQ product gives each warp
    /// head_dim / (warps / (rows / 16)) columns, which must be a multiple of 16.
    ///
    /// # Errors
    /// Names the configuration and the head dim.
    pub fn check(&self, head_dim: usize) -> Result<(), String> {
        let cols = head_dim / (self.warps / (self.query_rows / 16));
        if cols == 0 || !cols.is_multiple_of(16) {
            return Err(format!(
                "flash backward config {} cannot run head_dim {head_dim} (each warp's dQ columns, {cols}, must be a multiple of 16)",
                self.name()
            ));
        }
        Ok(())
    }

    /// Columns of dK and dV one launch accumulates: the head dim up to 128, else 128 (two
    /// launches).
    pub fn dkv_cols(head_dim: usize) -> usize {
        head_dim.min(128)
    }

    /// Dynamic shared memory for `head_dim`, bytes: K and V tiles, two Q and two dO tiles, the
    /// dS^T tile, and LSE and D for two query tiles.
    pub fn smem_bytes(&self, head_dim: usize) -> u32 {
        let (bc, br) = (self.key_tile(), self.query_rows);
        ((2 * bc + 4 * br) * (head_dim + 8) * 2 + bc * (br + 8) * 2 + 4 * br * 4) as u32
    }

    /// The default for `head_dim`, unless `KP_FLASH_BWD_CONFIG` (`128=w8r64`) names another:
    /// the fastest configuration of the tile sweep on the H200 (`data/gpu_attention_tiles.json`,
    /// kernels/TUNING.md, "Backward `d` measured"): w8r64dv up to head_dim 128 (at 128,
    /// T = 16384, it measured 222.2 TFLOP/s non-causal and 224.4 causal, against w8r64v's 214.3
    /// and 219.5 and w4r32v's 206.6 and 204.2); w4r32v at 256 (the only one that fits sm_80's
    /// 163 KB of shared memory without spilling).
    ///
    /// # Errors
    /// A malformed `KP_FLASH_BWD_CONFIG`.
    pub fn for_head_dim(head_dim: usize) -> Result<BwdConfig, String> {
        if let Some(c) = env_config("KP_FLASH_BWD_CONFIG", head_dim)? {
            let c = BwdConfig::parse(&c)?;
            c.check(head_dim)?;
            return Ok(c);
        }
        Ok(match head_dim {
            d if d <= 128 => BwdConfig {
                warps: 8,
                query_rows: 64,
                unroll: 1,
                vec_red: true,
                drop_end_sync: true,
            },
            _ => BwdConfig {
                warps: 4,
                query_rows: 32,
                unroll: 1,
                vec_red: true,
                drop_end_sync: false,
            },
        })
    }
}

/// The project's CUDA implementations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Implementation {
    /// Tiled flash attention with tensor-core matrix products and an online softmax (the
    /// default): mma.sync kernels for compute capability 8.0 and newer, and on 9.0 the wgmma
    /// forward where [`super::sm90::takes`] says so.
    Flash,
    /// Materialised attention: cuBLAS GEMMs around softmax kernels.
    Math,
}

impl Implementation {
    /// Every implementation, default first.
    pub const ALL: [Implementation; 2] = [Implementation::Flash, Implementation::Math];

    /// Name in documents.
    pub fn name(self) -> &'static str {
        match self {
            Implementation::Flash => "flash",
            Implementation::Math => "math",
        }
    }

    /// Parses a name.
    pub fn parse(s: &str) -> Option<Implementation> {
        Self::ALL.into_iter().find(|i| i.name() == s)
    }

    /// Library column of the document.
    pub fn library(self) -> &'static str {
        match self {
            Implementation::Flash => "kernelpages",
            Implementation::Math => "cuBLAS + kernelpages softmax",
        }
    }

    /// True when `api::dot_product_attention` runs this implementation for `c`: what
    /// [`dispatch`] picks, unless the case is a decoding shape the split-KV kernel takes
    /// ([`super::decode_gpu::takes`]: then neither is the default).
    pub fn is_default_for(self, c: &AttentionCase) -> bool {
        !super::decode_gpu::takes(c) && dispatch(c) == Some(self)
    }

    /// `Err(reason)` when the implementation rejects the case: an inconsistent case for both;
    /// fp32 ([`FLASH_FP32_REASON`]) and head dims other than [`FLASH_HEAD_DIMS`] for `flash`.
    /// `math` takes every valid case (memory permitting: it materialises B·H·Tq·Tkv scores,
    /// rows padded to [`math_row_stride`]).
    pub fn supports(self, c: &AttentionCase) -> Result<(), String> {
        c.validate()?;
        match self {
            Implementation::Flash => {
                if c.dtype == Dtype::F32 {
                    return Err(FLASH_FP32_REASON.into());
                }
                if !FLASH_HEAD_DIMS.contains(&c.head_dim) {
                    return Err(format!(
                        "head_dim {} not compiled (32, 64, 96, 128 and 256 are)",
                        c.head_dim
                    ));
                }
                FlashConfig::for_head_dim(c.head_dim)?;
                if c.pass == Pass::FwdBwd {
                    BwdConfig::for_head_dim(c.head_dim)?;
                }
            }
            Implementation::Math => {}
        }
        Ok(())
    }

    /// Bytes of device temporaries one call uses beyond inputs and outputs (the forward's
    /// residuals included): `flash` the log-sum-exp (fp32 per query row), and for the backward
    /// D (fp32 per row) and the fp32 dQ accumulator; `math` the fp32 scores S (reused for dP)
    /// and the probabilities P (overwritten by dS), rows [`math_row_stride`] apart, the padded
    /// copies of K and V when that stride is not `seq_len_kv` ([`MathPad`]), and D for the
    /// backward.
    pub fn temporary_bytes(self, c: &AttentionCase) -> u64 {
        let rows = (c.batch * c.heads * c.seq_len_q) as u64;
        let bwd = c.pass == Pass::FwdBwd;
        match self {
            Implementation::Flash => {
                let mut b = rows * 4;
                if bwd {
                    b += rows * 4 + rows * c.head_dim as u64 * 4;
                }
                b
            }
            Implementation::Math => {
                let n = rows * math_row_stride(c.seq_len_kv) as u64;
                n * 4
                    + n * c.dtype.bytes() as u64
                    + math_pad_bytes(c)
                    + if bwd { rows * 4 } else { 0 }
            }
        }
    }

    /// Bytes the forward keeps for the backward (forward + backward only): O and the
    /// log-sum-exp for `flash` (the backward recomputes P from them); O, the whole probability
    /// matrix P (B·H·Tq rows of [`math_row_stride`]`(Tkv)` elements of the dtype) and the padded
    /// K and V copies where there are some ([`math_pads_keys`]) for `math`.
    pub fn residual_bytes(self, c: &AttentionCase) -> u64 {
        let rows = (c.batch * c.heads * c.seq_len_q) as u64;
        let o = (c.q_elems() * c.dtype.bytes()) as u64;
        match self {
            Implementation::Flash => o + rows * 4,
            Implementation::Math => {
                o + rows * math_row_stride(c.seq_len_kv) as u64 * c.dtype.bytes() as u64
                    + math_pad_bytes(c)
            }
        }
    }
}

/// Row stride, in elements, of the `math` path's score matrix S (fp32) and probability matrix
/// P (the case's dtype): `seq_len_kv` rounded up to a multiple of 8, so that every row starts
/// on a 16-byte boundary for any key length: the softmax kernels load S by float4 at every
/// length, and the GEMMs' leading dimensions are 16-byte multiples. Measured on the H200 at
/// 6a4333b, the stride alone did not recover the path's throughput at non-aligned lengths
/// (40–49 % below 4096 at 4092 and 4097), so when the stride is not `seq_len_kv` the GEMMs over
/// keys also run over the stride's keys, on zero-padded copies of K and V ([`MathPad`];
/// kernels/TUNING.md): the padding columns of S then hold scores of zero keys, which the
/// softmax masks, and P's are written as 0 (at 9a3c050 the forward then lost 1.6 % at 4092 and
/// 5.8 % at 4097, forward + backward 17 % and 21 %). The backward's dV and dK products run over
/// the stride's keys too, into the padded copies, from which `unpad_rows_*` copies the gradients
/// out.
pub fn math_row_stride(seq_len_kv: usize) -> usize {
    seq_len_kv.div_ceil(8) * 8
}

/// Whether the `math` path runs its GEMMs over keys on zero-padded copies of K and V
/// ([`MathPad`]): when [`math_row_stride`] is not `seq_len_kv`, and a row of K is a whole number
/// of 32-bit words (`pad_rows_*` copies in 16-byte or 32-bit units; an odd head_dim in a 16-bit
/// dtype runs unpadded).
pub fn math_pads_keys(c: &AttentionCase) -> bool {
    math_row_stride(c.seq_len_kv) != c.seq_len_kv
        && (c.head_dim * c.dtype.words()).is_multiple_of(2)
}

/// Bytes of the padded K and V copies ([`math_pads_keys`]), 0 when there are none.
fn math_pad_bytes(c: &AttentionCase) -> u64 {
    if math_pads_keys(c) {
        2 * (c.batch * c.kv_heads * math_row_stride(c.seq_len_kv) * c.head_dim * c.dtype.bytes())
            as u64
    } else {
        0
    }
}

/// The unit `pad_rows_*` and `unpad_rows_*` copy the padded K and V in, and a row of K in
/// those units: `("v16", …)` (16 bytes) when a row is a multiple of 16 bytes, else `("v4", …)`
/// (32-bit words; [`math_pads_keys`] holds a row a whole number of them).
fn math_pad_units(c: &AttentionCase) -> (&'static str, usize) {
    let row_bytes = c.head_dim * c.dtype.bytes();
    if row_bytes.is_multiple_of(16) {
        ("v16", row_bytes / 16)
    } else {
        ("v4", row_bytes / 4)
    }
}

/// The grid of `pad_rows_*` and `unpad_rows_*`: z = 2 (K and V), y over the heads (at most
/// 65,535; the kernels stride over the rest), x over a head's `units` (256 threads a block),
/// capped so that x · y · 2 ≤ 2,112 (16 blocks for each SM of a 132-SM card) while heads ≤
/// 1,056; past that x is 1 and the launch has 2 · y blocks.
fn pad_launch(heads: usize, units: usize) -> LaunchConfig {
    let y = heads.clamp(1, 65_535);
    let x = units.div_ceil(256).clamp(1, (132 * 16 / (2 * y)).max(1));
    LaunchConfig {
        grid_dim: (x as u32, y as u32, 2),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn dtype_tag(d: Dtype) -> &'static str {
    match d {
        Dtype::Bf16 => "bf16",
        Dtype::F16 => "f16",
        Dtype::F32 => "f32",
    }
}

fn mask_tag(c: &AttentionCase) -> &'static str {
    if c.causal {
        "causal"
    } else {
        "full"
    }
}

/// The kernel name and the `extern "C"` wrapper of the flash forward instantiation for case
/// `c` (its dtype, head dim and mask) with configuration `fc`.
///
/// # Panics
/// For fp32 (no instantiation; [`Implementation::supports`] refuses it first).
pub fn flash_wrapper(c: &AttentionCase, fc: FlashConfig) -> (String, String) {
    assert!(c.dtype != Dtype::F32, "{FLASH_FP32_REASON}");
    let name = format!(
        "flash_fwd_{}_d{}_{}_{}",
        dtype_tag(c.dtype),
        c.head_dim,
        mask_tag(c),
        fc.name()
    );
    let src = format!(
        "extern \"C\" __global__ void __launch_bounds__({threads}) {name}(\
         const u16* Q, const u16* K, const u16* V, u16* O, float* LSE, const int* kv_lens, \
         int Tq, int Tkv, int H, int KVH, float scale_log2) {{ \
         flash_fwd<{d}, {w}, {m}, {bc}, {bf}, {causal}>(Q, K, V, O, LSE, kv_lens, Tq, Tkv, H, KVH, scale_log2); }}\n",
        threads = 32 * fc.warps,
        d = c.head_dim,
        w = fc.warps,
        m = fc.m_tiles,
        bc = fc.key_tile,
        bf = c.dtype == Dtype::Bf16,
        causal = c.causal,
    );
    (name, src)
}

/// The kernel name and the NVRTC source (prelude, kernel file and [`flash_wrapper`]) of the
/// flash forward instantiation for case `c` with configuration `fc`.
///
/// # Panics
/// For fp32, as [`flash_wrapper`].
pub fn flash_instance(c: &AttentionCase, fc: FlashConfig) -> (String, String) {
    let (name, wrapper) = flash_wrapper(c, fc);
    (name, format!("{PRELUDE_SRC}\n{FLASH_SRC}\n{wrapper}"))
}

/// Names of the three backward kernels of one instantiation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BwdNames {
    /// D = rowsum(dO ∘ O) and dQacc = 0 (per dtype and head dim).
    pub preprocess: String,
    /// The main kernel (dK, dV, and dQacc by atomics).
    pub main: String,
    /// dQ = scale · dQacc, rounded (per dtype).
    pub convert: String,
}

/// The kernel names and `extern "C"` wrappers, (name, source) each, of the flash backward
/// instantiation for case `c` with configuration `bc`: preprocessing, main kernel, dQ
/// conversion. The first and last are shared by every mask and configuration of a dtype and
/// head dim, so a source holding several instantiations keeps one of each name.
///
/// # Panics
/// For fp32, as [`flash_wrapper`].
pub fn flash_bwd_wrappers(c: &AttentionCase, bc: BwdConfig) -> (BwdNames, Vec<(String, String)>) {
    assert!(c.dtype != Dtype::F32, "{FLASH_FP32_REASON}");
    let (dt, d) = (dtype_tag(c.dtype), c.head_dim);
    let bf = c.dtype == Dtype::Bf16;
    let names = BwdNames {
        preprocess: format!("flash_bwd_pre_{dt}_d{d}"),
        main: format!("flash_bwd_{dt}_d{d}_{}_{}", mask_tag(c), bc.name()),
        convert: format!("flash_bwd_dq_{dt}"),
    };
    let pre = format!(
        "extern \"C\" __global__ void __launch_bounds__(256) {}(const u16* O, const u16* dO, \
         float* Dsum, float* dQacc, int rows) {{ bwd_preprocess<{d}, {bf}>(O, dO, Dsum, dQacc, rows); }}\n",
        names.preprocess
    );
    let conv = format!(
        "extern \"C\" __global__ void __launch_bounds__(256) {}(const float* dQacc, u16* dQ, \
         unsigned long long n, float scale) {{ bwd_dq_convert<{bf}>(dQacc, dQ, n, scale); }}\n",
        names.convert
    );
    let main = format!(
        "extern \"C\" __global__ void __launch_bounds__({threads}) {name}(const u16* Q, const u16* K, \
         const u16* V, const u16* dO, const float* LSE, const float* Dsum, const int* kv_lens, \
         float* dQacc, u16* dK, u16* dV, int Tq, int Tkv, int H, int KVH, float scale_log2, \
         float scale, int dkv_off, int do_dq) {{ flash_bwd<{d}, {dkv}, {w}, {br}, {bf}, {causal}, {u}, {vr}, {es}>(\
         Q, K, V, dO, LSE, Dsum, kv_lens, dQacc, dK, dV, Tq, Tkv, H, KVH, scale_log2, scale, \
         dkv_off, do_dq); }}\n",
        name = names.main,
        threads = 32 * bc.warps,
        dkv = BwdConfig::dkv_cols(d),
        w = bc.warps,
        br = bc.query_rows,
        causal = c.causal,
        u = bc.unroll,
        vr = bc.vec_red,
        es = !bc.drop_end_sync,
    );
    let wrappers = vec![
        (names.preprocess.clone(), pre),
        (names.main.clone(), main),
        (names.convert.clone(), conv),
    ];
    (names, wrappers)
}

/// The kernel names and the NVRTC source (prelude, `kernels/flash_attn_bwd.cu` and the three
/// [`flash_bwd_wrappers`]) of the flash backward instantiation for case `c` with
/// configuration `bc`.
///
/// # Panics
/// For fp32, as [`flash_wrapper`].
pub fn flash_bwd_instance(c: &AttentionCase, bc: BwdConfig) -> (BwdNames, String) {
    let (names, wrappers) = flash_bwd_wrappers(c, bc);
    let mut src = format!("{PRELUDE_SRC}\n{FLASH_BWD_SRC}\n");
    for (_, w) in wrappers {
        src.push_str(&w);
    }
    (names, src)
}

/// The implementation [`forward`] runs for `c`: `flash` when it supports the case, else
/// `math` when it does, else none (the reason is in [`Implementation::supports`]). Which
/// kernels `flash` runs depends on the device: on compute capability 9.0 the cases
/// [`super::sm90::takes`] names run the wgmma forward (and backward), everything else the
/// portable sm_80 kernels ([`Runner::with_configs`]).
pub fn dispatch(c: &AttentionCase) -> Option<Implementation> {
    Implementation::ALL
        .into_iter()
        .find(|i| i.supports(c).is_ok())
}

/// Attention on the device with the implementation [`dispatch`] picks: compiles it, launches
/// one call on `inp` writing `outs` ([`Runner::launch`]: O, and dQ, dK, dV for forward +
/// backward), and returns which implementation ran. For repeated calls, keep the [`Runner`].
///
/// # Errors
/// [`GpuError::Config`] when no implementation supports the case (with every reason);
/// compile, launch and out-of-memory errors otherwise.
pub fn forward(
    gpu: &Gpu,
    c: &AttentionCase,
    inp: &DeviceInputs,
    outs: &mut [CudaSlice<u16>],
) -> Result<Implementation, GpuError> {
    let Some(imp) = dispatch(c) else {
        let why: Vec<String> = Implementation::ALL
            .into_iter()
            .filter_map(|i| i.supports(c).err().map(|e| format!("{}: {e}", i.name())))
            .collect();
        return Err(GpuError::Config(format!(
            "no implementation supports this case ({})",
            why.join("; ")
        )));
    };
    let (mut runner, _) = Runner::new(gpu, imp, c)?;
    runner.launch(gpu, c, inp, outs)?;
    Ok(imp)
}

/// One input set on the device (words of the case's dtype, see [`Dtype`]).
pub struct DeviceInputs {
    /// Q.
    pub q: CudaSlice<u16>,
    /// K.
    pub k: CudaSlice<u16>,
    /// V.
    pub v: CudaSlice<u16>,
    /// dO (forward + backward; empty otherwise).
    pub dout: CudaSlice<u16>,
    /// Valid keys per batch entry (`kv_lens`, or seq_len_kv for every entry), `[B]`.
    pub kv_lens: CudaSlice<i32>,
}

/// Uploads one input set of case `c`.
///
/// # Errors
/// Out-of-memory and driver errors.
pub fn upload(gpu: &Gpu, c: &AttentionCase, inp: &Inputs) -> Result<DeviceInputs, GpuError> {
    let lens: Vec<i32> = (0..c.batch).map(|b| c.kv_len(b) as i32).collect();
    // An empty dO still gets one word, so every buffer is a real allocation.
    let dout: &[u16] = if inp.dout.is_empty() { &[0] } else { &inp.dout };
    Ok(DeviceInputs {
        q: gpu.stream.clone_htod(&inp.q)?,
        k: gpu.stream.clone_htod(&inp.k)?,
        v: gpu.stream.clone_htod(&inp.v)?,
        dout: gpu.stream.clone_htod(dout)?,
        kv_lens: gpu.stream.clone_htod(&lens)?,
    })
}

/// Device copies of `src` (distinct buffers, same values) for L2 rotation.
///
/// # Errors
/// Out-of-memory and driver errors.
pub fn replicate(gpu: &Gpu, src: &DeviceInputs) -> Result<DeviceInputs, GpuError> {
    Ok(DeviceInputs {
        q: gpu.stream.clone_dtod(&src.q)?,
        k: gpu.stream.clone_dtod(&src.k)?,
        v: gpu.stream.clone_dtod(&src.v)?,
        dout: gpu.stream.clone_dtod(&src.dout)?,
        kv_lens: gpu.stream.clone_dtod(&src.kv_lens)?,
    })
}

/// Allocates poisoned outputs for case `c` (every word 0xFFFF, NaN in every dtype): `[O]`, or
/// `[O, dQ, dK, dV]` for forward + backward, the order [`Runner::launch`] writes.
///
/// # Errors
/// Out-of-memory and driver errors.
pub fn poisoned_outputs(gpu: &Gpu, c: &AttentionCase) -> Result<Vec<CudaSlice<u16>>, GpuError> {
    let w = c.dtype.words();
    let mut lens = vec![c.q_elems() * w];
    if c.pass == Pass::FwdBwd {
        lens.extend([c.q_elems() * w, c.kv_elems() * w, c.kv_elems() * w]);
    }
    lens.into_iter().map(|n| gpu.poisoned_u16(n)).collect()
}

/// The flash backward's kernels and buffers.
pub struct FlashBwd {
    preprocess: CudaFunction,
    main: CudaFunction,
    convert: CudaFunction,
    main_cfg: LaunchConfig,
    /// D = rowsum(dO ∘ O), fp32 `[B, H, Tq]`.
    dsum: CudaSlice<f32>,
    /// The fp32 dQ accumulator, `[B, H, Tq, D]`.
    dqacc: CudaSlice<f32>,
}

impl FlashBwd {
    /// Compiles the backward of case `c` in configuration `config` (the default for its
    /// head_dim when `None`) and allocates its temporaries; returns it with the NVRTC compile
    /// + load time in s.
    ///
    /// # Errors
    /// [`GpuError::Config`] when the configuration cannot run the head dim or needs more
    /// shared memory than the device has; compile errors; out-of-memory.
    fn new(
        gpu: &Gpu,
        c: &AttentionCase,
        config: Option<BwdConfig>,
    ) -> Result<(Box<FlashBwd>, f64), GpuError> {
        let rows = c.batch * c.heads * c.seq_len_q;
        let bc = match config {
            Some(bc) => {
                bc.check(c.head_dim).map_err(GpuError::Config)?;
                bc
            }
            None => BwdConfig::for_head_dim(c.head_dim).map_err(GpuError::Config)?,
        };
        let (names, src) = flash_bwd_instance(c, bc);
        let smem = bc.smem_bytes(c.head_dim);
        check_smem(gpu, &names.main, smem)?;
        let compiled = gpu.compile(&format!("{}.cu", names.main), &src)?;
        let main = gpu.function(&compiled.module, &names.main, smem)?;
        Ok((
            Box::new(FlashBwd {
                preprocess: gpu.function(&compiled.module, &names.preprocess, 0)?,
                convert: gpu.function(&compiled.module, &names.convert, 0)?,
                main,
                main_cfg: LaunchConfig {
                    grid_dim: (
                        c.seq_len_kv.div_ceil(bc.key_tile()) as u32,
                        c.kv_heads as u32,
                        c.batch as u32,
                    ),
                    block_dim: (32 * bc.warps as u32, 1, 1),
                    shared_mem_bytes: smem,
                },
                // SAFETY: the preprocessing kernel writes both before the main kernel reads
                // them.
                dsum: unsafe { gpu.stream.alloc::<f32>(rows)? },
                dqacc: unsafe { gpu.stream.alloc::<f32>(rows * c.head_dim)? },
            }),
            compiled.compile_s,
        ))
    }

    /// Launches the backward of case `c` on the stream after a forward that wrote `o` and its
    /// log-sum-exp `lse` (fp32 `[B, H, Tq]`, natural log, +∞ for a row that sees no key: the
    /// portable and the wgmma forwards write the same), with dO from `inp`, writing `grads` =
    /// dQ, dK, dV (words of the case's dtype).
    ///
    /// # Errors
    /// Launch errors.
    fn launch(
        &mut self,
        gpu: &Gpu,
        c: &AttentionCase,
        inp: &DeviceInputs,
        o: &CudaSlice<u16>,
        lse: &CudaSlice<f32>,
        grads: &mut [CudaSlice<u16>],
    ) -> Result<(), GpuError> {
        let (tq, tkv) = (c.seq_len_q as i32, c.seq_len_kv as i32);
        let (h, kvh) = (c.heads as i32, c.kv_heads as i32);
        let scale_log2 = (c.scale() * std::f64::consts::LOG2_E) as f32;
        let scale = c.scale() as f32;
        let rows = c.batch * c.heads * c.seq_len_q;
        let FlashBwd {
            preprocess,
            main,
            convert,
            main_cfg,
            dsum,
            dqacc,
        } = self;
        let rows_i = rows as i32;
        {
            let mut b = gpu.stream.launch_builder(preprocess);
            b.arg(o)
                .arg(&inp.dout)
                .arg(&mut *dsum)
                .arg(&mut *dqacc)
                .arg(&rows_i);
            // SAFETY: `flash_bwd_pre_*(const u16* O, const u16* dO, float* Dsum,
            // float* dQacc, int rows)`: O and dO hold rows·D elements, Dsum rows, dQacc
            // rows·D; one warp per row, 8 rows per 256-thread block.
            unsafe { b.launch(grid_1d(rows, 8))? };
        }
        let [dq, dk, dv] = grads else {
            unreachable!("checked: four outputs")
        };
        let passes: &[(i32, i32)] = if c.head_dim > 128 {
            &[(0, 1), (128, 0)]
        } else {
            &[(0, 1)]
        };
        for &(dkv_off, do_dq) in passes {
            let mut b = gpu.stream.launch_builder(main);
            b.arg(&inp.q)
                .arg(&inp.k)
                .arg(&inp.v)
                .arg(&inp.dout)
                .arg(lse)
                .arg(&*dsum)
                .arg(&inp.kv_lens)
                .arg(&mut *dqacc)
                .arg(&mut *dk)
                .arg(&mut *dv)
                .arg(&tq)
                .arg(&tkv)
                .arg(&h)
                .arg(&kvh)
                .arg(&scale_log2)
                .arg(&scale)
                .arg(&dkv_off)
                .arg(&do_dq);
            // SAFETY: the arguments match `flash_bwd_*(const u16* Q, const u16* K,
            // const u16* V, const u16* dO, const float* LSE, const float* Dsum,
            // const int* kv_lens, float* dQacc, u16* dK, u16* dV, int Tq, int Tkv,
            // int H, int KVH, float scale_log2, float scale, int dkv_off, int do_dq)`
            // with the sizes of the forward's launch; dK and dV hold B·KVH·Tkv·D; the
            // grid covers ⌈Tkv/BC⌉ key tiles × KVH × B; dkv_off + 128 ≤ D when D > 128.
            unsafe { b.launch(*main_cfg)? };
        }
        let n = (rows * c.head_dim) as u64;
        let mut b = gpu.stream.launch_builder(convert);
        b.arg(&*dqacc).arg(dq).arg(&n).arg(&scale);
        // SAFETY: `flash_bwd_dq_*(const float* dQacc, u16* dQ, unsigned long long n,
        // float scale)` with n = B·H·Tq·D elements in both; 2 elements per thread.
        unsafe { b.launch(grid_1d(n as usize, 512))? };
        Ok(())
    }
}

/// The math backward's row kernels and buffer.
pub struct MathBwd {
    rowdot: CudaFunction,
    ds: CudaFunction,
    /// D = rowsum(dO ∘ O), fp32 `[B, H, Tq]`.
    dsum: CudaSlice<f32>,
}

/// A compiled implementation with its temporaries, ready to launch on any input set.
pub enum Runner {
    /// Flash kernels.
    Flash {
        /// The forward instantiation for this case.
        func: CudaFunction,
        /// Grid (⌈Tq/BR⌉, H, B), 32·warps threads, dynamic shared memory.
        cfg: LaunchConfig,
        /// The log-sum-exp the forward writes, fp32 `[B, H, Tq]`.
        lse: CudaSlice<f32>,
        /// The backward (forward + backward cases).
        bwd: Option<Box<FlashBwd>>,
        /// True when `func` is the fast path ([`flash_fast_path`]): other arguments.
        fast: bool,
        /// True when the forward writes `lse`: always for the general kernel, for forward +
        /// backward on the fast path.
        writes_lse: bool,
    },
    /// The wgmma forward on compute capability 9.0 ([`super::sm90::takes`]), then for forward
    /// + backward the wgmma backward on its log-sum-exp.
    Hopper {
        /// The kernel [`super::sm90::Sm90Version::for_shape`] picks.
        fwd: Box<super::sm90::HopperForward>,
        /// The log-sum-exp it writes, fp32 `[B, H, Tq]`.
        lse: CudaSlice<f32>,
        /// The backward (forward + backward cases).
        bwd: Option<Box<super::sm90::HopperBackward>>,
    },
    /// cuBLAS + row kernels.
    Math {
        /// cuBLAS handle bound to the stream.
        blas: Box<CudaBlas>,
        /// Softmax instantiation.
        softmax: CudaFunction,
        /// fp32 scores, `[B·H·Tq, ld]` with ld = [`math_row_stride`]`(Tkv)` (dP in the
        /// backward).
        s: CudaSlice<f32>,
        /// Probabilities in the dtype, `[B·H·Tq, ld]`, zero past each row's visible keys (dS in
        /// the backward, in place).
        p: CudaSlice<u16>,
        /// The cuBLAS workspace given to the handle ([`CUBLAS_WORKSPACE_BYTES`]).
        workspace: CudaSlice<u8>,
        /// The backward (forward + backward cases).
        bwd: Option<Box<MathBwd>>,
        /// Zero-padded copies of K and V when `seq_len_kv` is not a multiple of 8.
        pad: Option<Box<MathPad>>,
    },
}

/// K and V copied to `[B·KVH, ld, D]` with ld = [`math_row_stride`]`(Tkv)` and rows Tkv..ld
/// zero (`pad_rows_*` in `kernels/softmax_rows.cu`, both in one launch each call), so that the
/// `math` path's GEMMs run over ld keys, a multiple of 8, when Tkv is not: the softmax writes
/// P's padding columns as 0, so the extra keys add nothing.
pub struct MathPad {
    /// `pad_rows_v16` (16-byte units, when a row of K is a multiple of 16 bytes) or
    /// `pad_rows_v4` (32-bit units).
    pad_rows: CudaFunction,
    /// The backward's way back (`unpad_rows_*`, same units): dK and dV, computed over ld keys
    /// into `k` and `v`, copied out to the case's `[B·KVH, Tkv, D]` gradients.
    unpad_rows: CudaFunction,
    /// A row of K in the kernels' units (16 or 4 bytes each).
    row_units: i32,
    k: CudaSlice<u16>,
    v: CudaSlice<u16>,
}

/// The cuBLAS workspace the `math` path gives its handle (`cublasSetWorkspace`): 32 MiB, the
/// size cuBLAS recommends for Hopper. Allocated once per runner, so a memory reading can keep it
/// apart from the call's own memory.
pub const CUBLAS_WORKSPACE_BYTES: usize = 32 << 20;

/// The math mode of the `math` path's cuBLAS handle for fp32 cases: pedantic, so neither TF32
/// tensor cores nor fp32 emulation are used (the rows' note says so); the default mode for
/// 16-bit cases (fp32 accumulation, `CUBLAS_COMPUTE_32F`).
pub const MATH_FP32_NOTE: &str = "cuBLAS SGEMM with CUBLAS_COMPUTE_32F in CUBLAS_PEDANTIC_MATH mode: TF32 tensor cores not allowed";

fn grid_1d(n: usize, per_block: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(per_block).max(1) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The largest dynamic shared memory a CTA may opt into on this device, bytes.
fn smem_limit(gpu: &Gpu) -> Result<u32, GpuError> {
    use cudarc::driver::sys::CUdevice_attribute as A;
    Ok(gpu
        .ctx
        .attribute(A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)? as u32)
}

/// [`GpuError::Config`] naming `what` when `bytes` of shared memory per CTA exceed what the
/// device allows.
pub(crate) fn check_smem(gpu: &Gpu, what: &str, bytes: u32) -> Result<(), GpuError> {
    let limit = smem_limit(gpu)?;
    if bytes > limit {
        return Err(GpuError::Config(format!(
            "{what} needs {bytes} bytes of shared memory per CTA; this device allows {limit}"
        )));
    }
    Ok(())
}

/// One strided-batched GEMM of the math path, column-major as cuBLAS sees it:
/// C = alpha · op(A) op(B), batch `batch`.
pub(crate) struct Gemm {
    pub(crate) ta: cublasOperation_t,
    pub(crate) tb: cublasOperation_t,
    pub(crate) m: usize,
    pub(crate) n: usize,
    pub(crate) k: usize,
    pub(crate) alpha: f32,
    pub(crate) a: u64,
    pub(crate) lda: usize,
    pub(crate) sa: usize,
    pub(crate) b: u64,
    pub(crate) ldb: usize,
    pub(crate) sb: usize,
    pub(crate) c: u64,
    pub(crate) ldc: usize,
    pub(crate) sc: usize,
    pub(crate) batch: usize,
    pub(crate) ab_type: cudaDataType_t,
    pub(crate) c_type: cudaDataType_t,
}

impl Gemm {
    /// # Safety
    /// `a`, `b` and `c` are live device allocations holding `batch` matrices at the given
    /// strides and leading dimensions, of the given types.
    pub(crate) unsafe fn run(&self, blas: &CudaBlas) -> Result<(), GpuError> {
        let zero = 0.0f32;
        let i = |x: usize| -> Result<i32, GpuError> {
            i32::try_from(x).map_err(|_| GpuError::Config(format!("GEMM size {x} exceeds i32")))
        };
        cudarc::cublas::result::gemm_strided_batched_ex(
            *blas.handle(),
            self.ta,
            self.tb,
            i(self.m)?,
            i(self.n)?,
            i(self.k)?,
            &self.alpha as *const f32 as *const _,
            self.a as *const _,
            self.ab_type,
            i(self.lda)?,
            self.sa as i64,
            self.b as *const _,
            self.ab_type,
            i(self.ldb)?,
            self.sb as i64,
            &zero as *const f32 as *const _,
            self.c as *mut _,
            self.c_type,
            i(self.ldc)?,
            self.sc as i64,
            i(self.batch)?,
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
        .map_err(|e| GpuError::Cublas(format!("{e:?}")))
    }
}

impl Runner {
    /// Compiles what `imp` needs for `c` and allocates its temporaries, in the default
    /// configurations ([`FlashConfig::for_head_dim`], [`BwdConfig::for_head_dim`]). Returns the
    /// runner and the NVRTC compile + load time in s.
    ///
    /// # Errors
    /// [`GpuError::Config`] for a case `imp` does not support or a configuration that needs
    /// more shared memory than the device has; compile errors with the NVRTC log;
    /// out-of-memory for the temporaries.
    pub fn new(
        gpu: &Gpu,
        imp: Implementation,
        c: &AttentionCase,
    ) -> Result<(Runner, f64), GpuError> {
        Runner::with_configs(gpu, imp, c, None, None)
    }

    /// As [`Runner::new`], with the flash forward configuration `fwd` and the backward
    /// configuration `bwd` where given (the defaults where `None`; `math` ignores both): the
    /// tile sweep's entry. `flash` with neither given (and no forward configuration for the
    /// head dim in `KP_FLASH_CONFIG`, nor for forward + backward in `KP_FLASH_BWD_CONFIG`) runs
    /// the wgmma forward and backward where [`super::sm90::takes`] the case on this device; a
    /// configuration given always runs the portable kernels (the runner's `flash_sm80` passes
    /// the default one).
    ///
    /// # Errors
    /// As [`Runner::new`]; [`GpuError::Config`] when `bwd` cannot run the head dim.
    pub fn with_configs(
        gpu: &Gpu,
        imp: Implementation,
        c: &AttentionCase,
        fwd: Option<FlashConfig>,
        bwd_config: Option<BwdConfig>,
    ) -> Result<(Runner, f64), GpuError> {
        imp.supports(c).map_err(GpuError::Config)?;
        let rows = c.batch * c.heads * c.seq_len_q;
        let bwd = c.pass == Pass::FwdBwd;
        match imp {
            // A forward configuration given here or by `KP_FLASH_CONFIG` (the runner's
            // `--flash-config`), or for forward + backward a backward one (`KP_FLASH_BWD_CONFIG`,
            // `--flash-bwd-config`), names the portable kernels, which then run.
            Implementation::Flash
                if wgmma_path(
                    &gpu.arch(),
                    c,
                    fwd.is_some()
                        || bwd_config.is_some()
                        || env_config("KP_FLASH_CONFIG", c.head_dim)
                            .map_err(GpuError::Config)?
                            .is_some(),
                    c.pass == Pass::FwdBwd
                        && env_config("KP_FLASH_BWD_CONFIG", c.head_dim)
                            .map_err(GpuError::Config)?
                            .is_some(),
                ) =>
            {
                let mut hopper = super::sm90::HopperForward::with_dtype(
                    gpu,
                    c.head_dim,
                    super::sm90::Sm90Version::for_shape(c.head_dim, c.seq_len_q),
                    c.dtype,
                )?;
                // The tail split's workspace now, not inside a captured graph.
                hopper.reserve_tail(
                    gpu,
                    (c.batch, c.heads, c.seq_len_q, c.seq_len_kv),
                    c.causal,
                )?;
                let mut compile_s = hopper.compile_s;
                // SAFETY: the forward writes every row of the LSE before anything reads it.
                let lse = unsafe { gpu.stream.alloc::<f32>(rows)? };
                let bwd = if bwd {
                    let hb = super::sm90::HopperBackward::with_dtype(
                        gpu,
                        c.head_dim,
                        (c.batch, c.heads, c.seq_len_q),
                        c.dtype,
                    )?;
                    compile_s += hb.compile_s;
                    Some(Box::new(hb))
                } else {
                    None
                };
                Ok((
                    Runner::Hopper {
                        fwd: Box::new(hopper),
                        lse,
                        bwd,
                    },
                    compile_s,
                ))
            }
            Implementation::Flash => {
                let fc = match fwd {
                    Some(fc) => fc,
                    None => FlashConfig::for_head_dim(c.head_dim).map_err(GpuError::Config)?,
                };
                let fast = flash_fast_path(c, fc);
                let (name, src) = if fast {
                    flash_fast_instance(c, fc)
                } else {
                    flash_instance(c, fc)
                };
                let smem = fc.smem_bytes(c.head_dim);
                check_smem(gpu, &name, smem)?;
                let compiled = gpu.compile(&format!("{name}.cu"), &src)?;
                let mut compile_s = compiled.compile_s;
                let func = gpu.function(&compiled.module, &name, smem)?;
                let cfg = LaunchConfig {
                    grid_dim: (
                        c.seq_len_q.div_ceil(fc.query_tile()) as u32,
                        c.heads as u32,
                        c.batch as u32,
                    ),
                    block_dim: (32 * fc.warps as u32, 1, 1),
                    shared_mem_bytes: smem,
                };
                // SAFETY: the forward writes every row of the LSE before anything reads it.
                let lse = unsafe { gpu.stream.alloc::<f32>(rows)? };
                let bwd = if bwd {
                    let (fb, s) = FlashBwd::new(gpu, c, bwd_config)?;
                    compile_s += s;
                    Some(fb)
                } else {
                    None
                };
                Ok((
                    Runner::Flash {
                        func,
                        cfg,
                        lse,
                        bwd,
                        fast,
                        writes_lse: !fast || c.pass == Pass::FwdBwd,
                    },
                    compile_s,
                ))
            }
            Implementation::Math => {
                let compiled = gpu.compile("softmax_rows.cu", SOFTMAX_SRC)?;
                let dt = dtype_tag(c.dtype);
                let softmax = gpu.function(
                    &compiled.module,
                    &format!("softmax_rows_{dt}_{}", mask_tag(c)),
                    0,
                )?;
                let blas = CudaBlas::new(gpu.stream.clone())
                    .map_err(|e| GpuError::Cublas(format!("{e:?}")))?;
                let mode = if c.dtype == Dtype::F32 {
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
                // SAFETY: cuBLAS only writes its workspace.
                let mut workspace = unsafe { gpu.stream.alloc::<u8>(CUBLAS_WORKSPACE_BYTES)? };
                {
                    let (wp, _gw) = workspace.device_ptr_mut(&gpu.stream);
                    // SAFETY: the workspace outlives the handle's use of it (both live in the
                    // same Runner, and the handle is only used by `launch` on this stream).
                    unsafe {
                        cudarc::cublas::sys::cublasSetWorkspace_v2(
                            *blas.handle(),
                            wp as *mut std::ffi::c_void,
                            CUBLAS_WORKSPACE_BYTES,
                        )
                        .result()
                        .map_err(|e| GpuError::Cublas(format!("cublasSetWorkspace: {e:?}")))?;
                    }
                }
                let n = rows * math_row_stride(c.seq_len_kv);
                // SAFETY: S is written by the first GEMM over its first `keys` columns (Tkv, or
                // ld with MathPad) and P by the softmax over all ld columns before either is
                // read (and dP, dS likewise in the backward). S's unwritten padding (without
                // MathPad) is only taken in by the softmax's last float4 load and discarded.
                let s = unsafe { gpu.stream.alloc::<f32>(n)? };
                let p = unsafe { gpu.stream.alloc::<u16>(n * c.dtype.words())? };
                let ld = math_row_stride(c.seq_len_kv);
                let pad = if !math_pads_keys(c) {
                    None
                } else {
                    let words = c.batch * c.kv_heads * ld * c.head_dim * c.dtype.words();
                    let (unit, row_units) = math_pad_units(c);
                    Some(Box::new(MathPad {
                        pad_rows: gpu.function(&compiled.module, &format!("pad_rows_{unit}"), 0)?,
                        unpad_rows: gpu.function(
                            &compiled.module,
                            &format!("unpad_rows_{unit}"),
                            0,
                        )?,
                        row_units: row_units as i32,
                        // SAFETY: pad_rows writes every element (rows and padding) each call
                        // before a GEMM reads them.
                        k: unsafe { gpu.stream.alloc::<u16>(words)? },
                        v: unsafe { gpu.stream.alloc::<u16>(words)? },
                    }))
                };
                let bwd = if bwd {
                    Some(Box::new(MathBwd {
                        rowdot: gpu.function(&compiled.module, &format!("rowdot_{dt}"), 0)?,
                        ds: gpu.function(&compiled.module, &format!("softmax_bwd_rows_{dt}"), 0)?,
                        // SAFETY: written by rowdot before the dS kernel reads it.
                        dsum: unsafe { gpu.stream.alloc::<f32>(rows)? },
                    }))
                } else {
                    None
                };
                Ok((
                    Runner::Math {
                        blas: Box::new(blas),
                        softmax,
                        s,
                        p,
                        workspace,
                        bwd,
                        pad,
                    },
                    compiled.compile_s,
                ))
            }
        }
    }

    /// Bytes of device temporaries one call uses beyond [`Implementation::temporary_bytes`]
    /// that depend on the kernel the dispatch picked for the case: on the wgmma path the
    /// forward's tail-split workspace ([`super::sm90::HopperForward::tail_bytes`]) and the
    /// backward's split buffers ([`super::sm90::bwd_split_bytes`] and
    /// [`super::sm90::HopperBackward::tail_bytes`]) and its padded D and LSE rows
    /// ([`super::sm90::HopperBackward::row_bytes`]), forward + backward; else 0.
    pub fn dispatch_temporary_bytes(&self, c: &AttentionCase) -> u64 {
        match self {
            Runner::Hopper { fwd, bwd, .. } => {
                let split = fwd.tail_bytes((c.batch, c.heads, c.seq_len_q, c.seq_len_kv), c.causal);
                split
                    + bwd.as_ref().map_or(0, |b| {
                        super::sm90::bwd_split_bytes(
                            c.batch,
                            c.heads,
                            c.kv_heads,
                            c.seq_len_kv,
                            c.head_dim,
                            c.causal,
                        ) + b.tail_bytes(
                            (c.batch, c.heads, c.kv_heads),
                            (c.seq_len_q, c.seq_len_kv),
                            c.causal,
                        ) + b.row_bytes((c.batch, c.heads, c.seq_len_q))
                    })
            }
            _ => 0,
        }
    }

    /// Bytes of library workspace held across calls (the cuBLAS workspace of `math`).
    pub fn workspace_bytes(&self) -> u64 {
        match self {
            Runner::Flash { .. } | Runner::Hopper { .. } => 0,
            Runner::Math { workspace, .. } => workspace.len() as u64,
        }
    }

    /// The log-sum-exp the flash forward wrote in the last call (fp32 `[B, H, Tq]`, natural
    /// log, +∞ for rows that see no key); `None` for `math` and for a fast-path forward
    /// without backward, which writes none.
    pub fn lse(&self) -> Option<&CudaSlice<f32>> {
        match self {
            Runner::Flash {
                lse,
                writes_lse: true,
                ..
            } => Some(lse),
            Runner::Hopper { lse, .. } => Some(lse),
            Runner::Flash { .. } | Runner::Math { .. } => None,
        }
    }

    /// Launches one call on the stream (asynchronously): the forward, writing `outs[0]` = O,
    /// and for a forward + backward case the backward with dO from `inp`, writing
    /// `outs[1..4]` = dQ, dK, dV (words of the case's dtype; [`poisoned_outputs`] allocates
    /// them).
    ///
    /// # Errors
    /// [`GpuError::Config`] for a wrong number or size of outputs; launch or cuBLAS errors.
    pub fn launch(
        &mut self,
        gpu: &Gpu,
        c: &AttentionCase,
        inp: &DeviceInputs,
        outs: &mut [CudaSlice<u16>],
    ) -> Result<(), GpuError> {
        let bwd = c.pass == Pass::FwdBwd;
        let w = c.dtype.words();
        let want = if bwd {
            vec![
                c.q_elems() * w,
                c.q_elems() * w,
                c.kv_elems() * w,
                c.kv_elems() * w,
            ]
        } else {
            vec![c.q_elems() * w]
        };
        let got: Vec<usize> = outs.iter().map(|o| o.len()).collect();
        if got != want {
            return Err(GpuError::Config(format!(
                "outputs of {got:?} words; this case writes {want:?}"
            )));
        }
        if bwd && inp.dout.len() != c.q_elems() * w {
            return Err(GpuError::Config("forward + backward needs dO".into()));
        }
        let (tq, tkv) = (c.seq_len_q as i32, c.seq_len_kv as i32);
        let (h, kvh) = (c.heads as i32, c.kv_heads as i32);
        let scale_log2 = (c.scale() * std::f64::consts::LOG2_E) as f32;
        let scale = c.scale() as f32;
        let rows = c.batch * c.heads * c.seq_len_q;
        match self {
            Runner::Hopper { fwd, lse, bwd: fb } => {
                let (o, grads) = outs.split_at_mut(1);
                let o = &mut o[0];
                fwd.launch(
                    gpu,
                    (c.batch, c.heads, c.kv_heads, c.seq_len_q, c.seq_len_kv),
                    (&inp.q, &inp.k, &inp.v),
                    &inp.kv_lens,
                    c.causal,
                    c.scale(),
                    o,
                    lse,
                )?;
                match (fb, grads) {
                    (Some(fb), [dq, dk, dv]) => fb.launch(
                        gpu,
                        (c.batch, c.heads, c.kv_heads, c.seq_len_q, c.seq_len_kv),
                        (&inp.q, &inp.k, &inp.v, &inp.dout),
                        &inp.kv_lens,
                        c.causal,
                        c.scale(),
                        (o, lse),
                        [dq, dk, dv],
                    ),
                    (Some(_), _) => unreachable!("checked: four outputs"),
                    (None, _) => Ok(()),
                }
            }
            Runner::Flash {
                func,
                cfg,
                lse,
                bwd: fb,
                fast,
                ..
            } => {
                let (o, grads) = outs.split_at_mut(1);
                let o = &mut o[0];
                if *fast {
                    let mut b = gpu.stream.launch_builder(func);
                    b.arg(&inp.q)
                        .arg(&inp.k)
                        .arg(&inp.v)
                        .arg(&mut *o)
                        .arg(&mut *lse)
                        .arg(&tq)
                        .arg(&h)
                        .arg(&kvh)
                        .arg(&scale_log2);
                    // SAFETY: the arguments match `flash_fwd_aligned_*(const u16* Q, const u16*
                    // K, const u16* V, u16* O, float* LSE, int T, int H, int KVH, float)`; Q
                    // and O hold B·H·T·D elements, K and V B·KVH·T·D, LSE B·H·T
                    // (`flash_fast_path` holds Tq = Tkv = T, every key valid); the grid covers
                    // ⌈T/BR⌉ query tiles and a non-EVEN instance bounds its loads and stores by T.
                    unsafe { b.launch(*cfg)? };
                } else {
                    let mut b = gpu.stream.launch_builder(func);
                    b.arg(&inp.q)
                        .arg(&inp.k)
                        .arg(&inp.v)
                        .arg(&mut *o)
                        .arg(&mut *lse)
                        .arg(&inp.kv_lens)
                        .arg(&tq)
                        .arg(&tkv)
                        .arg(&h)
                        .arg(&kvh)
                        .arg(&scale_log2);
                    // SAFETY: the arguments match `flash_fwd_*(const u16* Q, const u16* K,
                    // const u16* V, u16* O, float* LSE, const int* kv_lens, int Tq, int Tkv,
                    // int H, int KVH, float)`; Q and O hold B·H·Tq·D elements, K and V
                    // B·KVH·Tkv·D, LSE B·H·Tq, kv_lens B entries ≤ Tkv (all allocated from the
                    // same case, checked above); the grid covers ⌈Tq/BR⌉ query tiles × H × B and
                    // the kernel bounds every access by Tq and kv_lens.
                    unsafe { b.launch(*cfg)? };
                }
                match fb {
                    Some(fb) => fb.launch(gpu, c, inp, o, lse, grads),
                    None => Ok(()),
                }
            }
            Runner::Math {
                blas,
                softmax,
                s,
                p,
                bwd: mb,
                pad,
                ..
            } => {
                let stream = gpu.stream.clone();
                let (d, g) = (c.head_dim, c.group());
                let (tq_u, tkv_u) = (c.seq_len_q, c.seq_len_kv);
                // S and P rows are `ld` apart (Tkv padded to a multiple of 8 elements).
                let ld = math_row_stride(tkv_u);
                let ld_i = ld as i32;
                let batch = c.batch * c.kv_heads;
                let elem = match c.dtype {
                    Dtype::Bf16 => cudaDataType_t::CUDA_R_16BF,
                    Dtype::F16 => cudaDataType_t::CUDA_R_16F,
                    Dtype::F32 => cudaDataType_t::CUDA_R_32F,
                };
                let f32t = cudaDataType_t::CUDA_R_32F;
                // Every kv head's G query heads are contiguous in Q, O, dO, dQ, S and P
                // ([B, H, Tq, ·] with h = kvh·G + r), so one GEMM per (batch, kv head) covers
                // the group: M = G·Tq rows.
                let gq = g * tq_u;
                let (op_n, op_t) = (
                    cublasOperation_t::CUBLAS_OP_N,
                    cublasOperation_t::CUBLAS_OP_T,
                );
                let (qp, _g1) = inp.q.device_ptr(&stream);
                let (kp, _g2) = inp.k.device_ptr(&stream);
                let (vp, _g3) = inp.v.device_ptr(&stream);
                // The key count the GEMMs over keys run on, and the K and V they read: ld
                // and the padded copies when Tkv is not a multiple of 8, else Tkv and the inputs.
                // With the padding also how the backward copies dK and dV back (`unpad_rows_*`,
                // its function and arguments).
                let (keys, kp, vp, _gk, _gv, unpad) = match pad {
                    Some(pad) => {
                        let heads = (c.batch * c.kv_heads) as i64;
                        let tkv_i = tkv_u as i32;
                        let cfg = pad_launch(heads as usize, ld * pad.row_units as usize);
                        let mut lb = stream.launch_builder(&pad.pad_rows);
                        lb.arg(&inp.k)
                            .arg(&inp.v)
                            .arg(&mut pad.k)
                            .arg(&mut pad.v)
                            .arg(&heads)
                            .arg(&tkv_i)
                            .arg(&ld_i)
                            .arg(&pad.row_units);
                        // SAFETY: `pad_rows_*(const U* k, const U* v, U* kp, U* vp, long long
                        // heads, int Tkv, int ld, int row)` with U the unit `math_pad_units`
                        // chose for this case (a row of K is `row` whole units): k and v hold
                        // heads·Tkv·D elements of the dtype (the case's K and V), kp and vp
                        // heads·ld·D (allocated in `new` for this case), all allocation starts
                        // (256-byte aligned); z = 2 picks K or V, y strides over heads and x
                        // over a head's ld·row units.
                        unsafe { lb.launch(cfg)? };
                        // Written below as well (the backward's dK and dV, unpad_rows_*).
                        let (pk, gk) = pad.k.device_ptr_mut(&stream);
                        let (pv, gv) = pad.v.device_ptr_mut(&stream);
                        let unpad = (pad.unpad_rows.clone(), heads, tkv_i, pad.row_units);
                        (ld, pk, pv, Some(gk), Some(gv), Some(unpad))
                    }
                    None => (tkv_u, kp, vp, None, None, None),
                };
                let (dop, _g4) = inp.dout.device_ptr(&stream);
                let (sp, _g5) = s.device_ptr_mut(&stream);
                let (pp, _g6) = p.device_ptr_mut(&stream);
                let (first, grads) = outs.split_at_mut(1);
                let (op, _g7) = first[0].device_ptr_mut(&stream);
                // S (row-major G·Tq × Tkv) = scale · Q_blk Kᵀ; column-major: Sᵀ = op(K)=Kᵀ...
                // i.e. C (keys × G·Tq) = Aᵀ B with A = K (D × keys, lda D), B = Q (D × G·Tq).
                let s_gemm = |a: u64, b: u64, alpha: f32| Gemm {
                    ta: op_t,
                    tb: op_n,
                    m: keys,
                    n: gq,
                    k: d,
                    alpha,
                    a,
                    lda: d,
                    sa: keys * d,
                    b,
                    ldb: d,
                    sb: gq * d,
                    c: sp,
                    ldc: ld,
                    sc: gq * ld,
                    batch,
                    ab_type: elem,
                    c_type: f32t,
                };
                // O_blk (G·Tq × D) = P_blk V: column-major Oᵀ (D × G·Tq) = Vᵀ Pᵀ, A = V
                // (D × keys, lda D), B = P (keys × G·Tq, ldb ld).
                let o_gemm = |a: u64, c_out: u64, alpha: f32| Gemm {
                    ta: op_n,
                    tb: op_n,
                    m: d,
                    n: gq,
                    k: keys,
                    alpha,
                    a,
                    lda: d,
                    sa: keys * d,
                    b: pp,
                    ldb: ld,
                    sb: gq * ld,
                    c: c_out,
                    ldc: d,
                    sc: gq * d,
                    batch,
                    ab_type: elem,
                    c_type: elem,
                };
                // SAFETY: every pointer is a live allocation of the case's sizes (S and P
                // B·H·Tq·ld, inputs and outputs as checked above), strides per (batch, kv
                // head) block; alpha is a host f32 matching CUBLAS_COMPUTE_32F.
                unsafe { s_gemm(kp, qp, scale).run(blas)? };
                let cfg = LaunchConfig {
                    grid_dim: (rows as u32, 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                };
                let mut lb = stream.launch_builder(softmax);
                lb.arg(&sp)
                    .arg(&pp)
                    .arg(&inp.kv_lens)
                    .arg(&tq)
                    .arg(&tkv)
                    .arg(&ld_i)
                    .arg(&h);
                // SAFETY: `softmax_rows_*(const float* S, u16* P, const int* kv_lens, int Tq,
                // int Tkv, int ld, int H)` with S and P of B·H·Tq·ld elements, ld a multiple of
                // 8 ≥ Tkv (16-byte aligned rows for its float4 loads); one CTA per row.
                unsafe { lb.launch(cfg)? };
                // SAFETY: as for S.
                unsafe { o_gemm(vp, op, 1.0).run(blas)? };
                let Some(mb) = mb else {
                    return Ok(());
                };
                let [dq, dk, dv] = grads else {
                    unreachable!("checked: four outputs")
                };
                let (dqp, _g8) = dq.device_ptr_mut(&stream);
                let (dkp, _g9) = dk.device_ptr_mut(&stream);
                let (dvp, _g10) = dv.device_ptr_mut(&stream);
                let (dsp, _g11) = mb.dsum.device_ptr_mut(&stream);
                let rows_i = rows as i32;
                let d_i = d as i32;
                let mut lb = stream.launch_builder(&mb.rowdot);
                lb.arg(&op).arg(&dop).arg(&dsp).arg(&rows_i).arg(&d_i);
                // SAFETY: `rowdot_*(const u16* O, const u16* dO, float* Dsum, int rows, int D)`
                // with O and dO of rows·D elements and Dsum of rows; one warp per row.
                unsafe { lb.launch(grid_1d(rows, 8))? };
                // dV (keys × D) = P_blkᵀ dO_blk: column-major dVᵀ (D × keys) = dOᵀ (D × G·Tq) ·
                // P (G·Tq × keys): A = dO (lda D), B = P read transposed (ldb ld). With the
                // padding the keys are ld (P's contiguous extent, which cuBLAS's aligned kernels
                // want a multiple of 8, as in the forward) and dK, dV go to the padded buffers,
                // copied out afterwards; their rows past Tkv come out 0 (P's and dS's padding
                // columns are).
                let dkv_gemm = |a: u64, b: u64, c_out: u64, alpha: f32| Gemm {
                    ta: op_n,
                    tb: op_t,
                    m: d,
                    n: keys,
                    k: gq,
                    alpha,
                    a,
                    lda: d,
                    sa: gq * d,
                    b,
                    ldb: ld,
                    sb: gq * ld,
                    c: c_out,
                    ldc: d,
                    sc: keys * d,
                    batch,
                    ab_type: elem,
                    c_type: elem,
                };
                // Where dK and dV are written: the padded K and V buffers when there are some
                // (V's is free once dP below has read it, K's once dQ has), else the outputs.
                let (dk_to, dv_to) = if unpad.is_some() {
                    (kp, vp)
                } else {
                    (dkp, dvp)
                };
                // dP = dO_blk Vᵀ, into S.
                // SAFETY: as for S.
                unsafe { s_gemm(vp, dop, 1.0).run(blas)? };
                // SAFETY: as above; dv_to holds B·KVH·keys·D elements (the output, or the
                // padded V copy, which dP has already read: the stream orders them).
                unsafe { dkv_gemm(dop, pp, dv_to, 1.0).run(blas)? };
                let mut lb = stream.launch_builder(&mb.ds);
                lb.arg(&sp).arg(&pp).arg(&dsp).arg(&tkv).arg(&ld_i);
                // SAFETY: `softmax_bwd_rows_*(const float* dP, u16* P, const float* Dsum,
                // int Tkv, int ld)`: dP and P of rows·ld elements, ld a multiple of 8 ≥ Tkv
                // (16-byte aligned rows for its vector loads and stores), Dsum of rows; one CTA
                // per row.
                unsafe { lb.launch(cfg)? };
                // dQ_blk = scale · dS_blk K (the O product with V → K); dK = scale · dSᵀ Q.
                // SAFETY: as above; dQ holds B·H·Tq·D, dk_to B·KVH·keys·D elements (the
                // padded K copy is written after dQ has read it).
                unsafe { o_gemm(kp, dqp, scale).run(blas)? };
                unsafe { dkv_gemm(qp, pp, dk_to, scale).run(blas)? };
                if let Some((unpad_rows, heads, tkv_i, row_units)) = unpad {
                    let cfg = pad_launch(heads as usize, tkv_u * row_units as usize);
                    let mut lb = stream.launch_builder(&unpad_rows);
                    lb.arg(&kp)
                        .arg(&vp)
                        .arg(&dkp)
                        .arg(&dvp)
                        .arg(&heads)
                        .arg(&tkv_i)
                        .arg(&ld_i)
                        .arg(&row_units);
                    // SAFETY: `unpad_rows_*(const U* kp, const U* vp, U* dk, U* dv, long long
                    // heads, int Tkv, int ld, int row)`, the units as in pad_rows: kp and vp are
                    // the padded buffers (heads·ld·D elements of the dtype, holding dK and dV),
                    // dk and dv the case's gradients (heads·Tkv·D), allocation starts; the
                    // stream orders it after the dK and dV GEMMs.
                    unsafe { lb.launch(cfg)? };
                }
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_math_pad_copies_pick_their_units_and_grid() {
        let case = |d, dtype| AttentionCase {
            dtype,
            ..AttentionCase::new(1, 1, 65, d)
        };
        assert_eq!(math_pad_units(&case(64, Dtype::Bf16)), ("v16", 8));
        assert_eq!(math_pad_units(&case(6, Dtype::Bf16)), ("v4", 3));
        assert_eq!(math_pad_units(&case(36, Dtype::F16)), ("v4", 18));
        assert_eq!(math_pad_units(&case(4, Dtype::F32)), ("v16", 1));
        assert_eq!(math_pad_units(&case(65, Dtype::F32)), ("v4", 65));
        // Heads past the grid's y limit are strided over; x shrinks as heads grow.
        let g = pad_launch(70_000, 1000).grid_dim;
        assert_eq!(g, (1, 65_535, 2));
        assert_eq!(pad_launch(1, 1_000_000).grid_dim, (1056, 1, 2));
        assert_eq!(pad_launch(24, 4096 * 8).grid_dim, (44, 24, 2));
        assert_eq!(pad_launch(2, 3).grid_dim, (1, 2, 2));
    }

    #[test]
    fn the_math_rows_start_on_16_bytes_for_every_key_length() {
        for tkv in 1..=300 {
            let ld = math_row_stride(tkv);
            assert!(ld >= tkv && ld < tkv + 8, "{tkv} -> {ld}");
            // bf16/fp16 P (2 bytes) and fp32 S (4 bytes) rows.
            assert_eq!((ld * 2) % 16, 0, "{tkv} -> {ld}");
        }
        assert_eq!(math_row_stride(4096), 4096);
        assert_eq!(math_row_stride(4092), 4096);
        assert_eq!(math_row_stride(4097), 4104);
        // Same queries, 4092 against 4096 keys: the same padded S and P, and at 4092 the
        // zero-padded copies of K and V (2 × 1·2·4096·64 bf16).
        let padded = AttentionCase::new(1, 2, 4096, 64);
        let c = AttentionCase {
            seq_len_kv: 4092,
            ..padded.clone()
        };
        assert_eq!(
            Implementation::Math.temporary_bytes(&c),
            Implementation::Math.temporary_bytes(&padded) + 2 * 2 * 4096 * 64 * 2
        );
        assert!(math_pads_keys(&c) && !math_pads_keys(&padded));
        // An odd head_dim in a 16-bit dtype is not a whole number of 32-bit words: unpadded.
        let odd = AttentionCase {
            head_dim: 65,
            ..c.clone()
        };
        assert!(!math_pads_keys(&odd));
        assert!(math_pads_keys(&AttentionCase {
            dtype: Dtype::F32,
            ..odd
        }));
    }

    #[test]
    fn a_named_configuration_sends_flash_to_the_portable_kernels() {
        let fwd = AttentionCase::new(2, 4, 300, 128);
        let bwd = AttentionCase {
            pass: Pass::FwdBwd,
            ..fwd.clone()
        };
        for c in [&fwd, &bwd] {
            assert!(wgmma_path("sm_90a", c, false, false), "{c:?}");
            assert!(!wgmma_path("sm_90a", c, true, false), "{c:?}");
            assert!(!wgmma_path("sm_89", c, false, false), "{c:?}");
        }
        // A backward configuration matters where a backward runs.
        assert!(!wgmma_path("sm_90a", &bwd, false, true));
        assert!(wgmma_path("sm_90a", &fwd, false, true));
        // The rest follows sm90::takes: fp16 as bf16 (FP16_DISPATCHED), fp32 never.
        let fp16 = AttentionCase {
            dtype: Dtype::F16,
            ..bwd.clone()
        };
        assert_eq!(
            wgmma_path("sm_90a", &fp16, false, false),
            crate::attention::sm90::FP16_DISPATCHED
        );
        let fp32 = AttentionCase {
            dtype: Dtype::F32,
            ..bwd.clone()
        };
        assert!(!wgmma_path("sm_90a", &fp32, false, false));
    }
}
