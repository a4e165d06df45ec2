//! Hopper (compute capability 9.0, `sm_90a`) attention kernels of issue 11: `wgmma` (warpgroup
//! matrix multiply-accumulate) with operands in shared memory through matrix descriptors, a
//! probe kernel that checks them on the device, the attention forward on them
//! ([`HopperForward`], `kernels/attn_wgmma_sm90.cu`) and the backward ([`HopperBackward`],
//! `kernels/attn_wgmma_bwd_sm90.cu`). `flash` dispatches to both where [`takes`] says so
//! (`attention::cuda`). The probe establishes the descriptor layout (which of the two
//! core-matrix distances the descriptor's "leading" and "stride" byte offsets take, per operand
//! majorness) and the accumulator and register-operand layouts; GPU tests check the forward and
//! the backward against float64.
//!
//! Shapes: the probe computes one 64 × 64 fp32 tile `C` (row-major) from bf16 words: mode 0,
//! `C = A Bᵀ` with `A` and `B` both `[64][K]` (Q Kᵀ's form, both K-major in shared memory);
//! mode 1, `C = A V` with `A` `[64][K]` from registers and `V` `[K][64]` (P V's form, V N-major
//! in shared memory). K is a multiple of 16 up to 128.

use cudarc::driver::{sys, CudaFunction, CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr};
use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::cuda::PRELUDE_SRC;
use super::{AttentionCase, Dtype};
use crate::gpu::{Gpu, GpuError};

/// Whether the dispatch ([`takes`]) runs fp16 cases on the wgmma kernels too
/// ([`HopperForward::with_dtype`], [`HopperBackward::with_dtype`]: the same instructions on
/// `f16` operands). On since their GPU test (`wgmma_fp16_forward_and_backward_match_float64`,
/// the backward test's 28 cases against float64) passed on the H200 at 64f179b
/// (`data/logs/gpu_attention_wgmma_fp16_tests_64f179b.log`); `false` puts fp16 back on the
/// portable kernels ([`fp16_dispatched`] says what a process does).
pub const FP16_DISPATCHED: bool = true;

/// The environment variable that makes this process dispatch fp16 to the wgmma kernels before
/// [`FP16_DISPATCHED`] does (value `1`): for the GPU tests and probes of that path.
pub const FP16_ENV: &str = "KP_SM90_FP16";

/// [`FP16_DISPATCHED`], or this process's [`FP16_ENV`] set to `1`.
pub fn fp16_dispatched() -> bool {
    FP16_DISPATCHED || std::env::var(FP16_ENV).is_ok_and(|v| v == "1")
}

/// True when `flash` (the dispatch of `attention::cuda`) runs the wgmma forward
/// ([`HopperForward`]) for case `c` on a device of architecture `arch` ([`Gpu::arch`]):
/// compute capability 9.0 (`sm_90a`), bf16 (and fp16 where [`fp16_dispatched`]), head_dim 64
/// or 128, a positive finite scale; the forward alone, or with the wgmma backward
/// ([`HopperBackward`]) after it. Everything else (other head dims, other devices, fp32, fp16
/// when not [`fp16_dispatched`]) runs the portable sm_80 kernels.
pub fn takes(arch: &str, c: &AttentionCase) -> bool {
    let scale = c.scale();
    arch == "sm_90a"
        && (c.dtype == Dtype::Bf16 || (c.dtype == Dtype::F16 && fp16_dispatched()))
        && (c.head_dim == 64 || c.head_dim == 128)
        && scale > 0.0
        && scale.is_finite()
}

/// Source of the sm_90a building blocks, the probe and the wgmma forwards (after
/// [`PRELUDE_SRC`]); it declares a kernel only where the source before it defines
/// `KP_SM90_ALL` or `KP_SM90_<kernel name>` ([`wgmma_source`]).
pub const WGMMA_SRC: &str = include_str!("../../kernels/attn_wgmma_sm90.cu");

/// The whole source of a module of [`WGMMA_SRC`]'s kernels: [`PRELUDE_SRC`], then the kernel
/// `entry` alone (each process compiles the one forward it runs), or every kernel for `None`;
/// bf16 ([`wgmma_source_for`] takes the dtype).
pub fn wgmma_source(entry: Option<&str>) -> String {
    wgmma_source_for(entry, Dtype::Bf16)
}

/// The line that sets the wgmma kernels' 16-bit type (`KP_WG_BF16`: 1 for bf16, 0 for fp16).
///
/// # Panics
/// For fp32, which the wgmma kernels do not take (the constructors refuse it first).
fn dtype_define(dtype: Dtype) -> &'static str {
    match dtype {
        Dtype::Bf16 => "#define KP_WG_BF16 1",
        Dtype::F16 => "#define KP_WG_BF16 0",
        Dtype::F32 => panic!("the wgmma kernels take bf16 or fp16"),
    }
}

/// [`wgmma_source`] for `dtype` (bf16 or fp16: the kernels' operands and results).
///
/// # Panics
/// For fp32.
pub fn wgmma_source_for(entry: Option<&str>, dtype: Dtype) -> String {
    wgmma_source_with(entry, dtype, false, true)
}

/// [`wgmma_source_for`], with the warp-specialised forwards' persistent instantiation (V2 to
/// V5; [`PERSIST_ENV`]) compiled in when `persistent`, and the ping-pong between consumers
/// (V3 to V5; [`PINGPONG_ENV`]) compiled out unless `pingpong`.
///
/// # Panics
/// For fp32.
pub fn wgmma_source_with(
    entry: Option<&str>,
    dtype: Dtype,
    persistent: bool,
    pingpong: bool,
) -> String {
    let select = match entry {
        Some(name) => format!("#define KP_SM90_{name}"),
        None => "#define KP_SM90_ALL".to_string(),
    };
    let persist = if persistent {
        "#define KP_SM90_PERSIST\n"
    } else {
        ""
    };
    let turns = if pingpong {
        ""
    } else {
        "#define KP_SM90_NO_PINGPONG\n"
    };
    format!(
        "{PRELUDE_SRC}\n{}\n{persist}{turns}{select}\n{WGMMA_SRC}\n",
        dtype_define(dtype)
    )
}

/// The wgmma kernels' 16-bit types, as [`Dtype`]s; anything else is refused.
fn check_dtype(what: &str, dtype: Dtype) -> Result<(), GpuError> {
    if matches!(dtype, Dtype::Bf16 | Dtype::F16) {
        Ok(())
    } else {
        Err(GpuError::Config(format!(
            "the wgmma {what} runs bf16 or fp16, not {}",
            dtype.as_str()
        )))
    }
}

/// The probe's operand forms.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProbeMode {
    /// `C = A Bᵀ`, both operands K-major in shared memory.
    KMajor,
    /// `C = A V`, A from registers, V N-major in shared memory (transposed B).
    RegistersTimesNMajor,
}

/// A reading of the no-swizzle descriptor: the leading and stride byte offsets of A and of B.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DescriptorReading {
    /// Leading byte offset of A (unused in register mode).
    pub lead_a: u32,
    /// Stride byte offset of A.
    pub stride_a: u32,
    /// Leading byte offset of B.
    pub lead_b: u32,
    /// Stride byte offset of B.
    pub stride_b: u32,
}

/// The two readings of the descriptor the probe tries for `mode` at reduction length `k`: the
/// first is the one the kernels are to use (the PTX ISA's: for K-major without swizzling, the
/// leading offset is the distance between the two core matrices along K, 128 bytes here, and
/// the stride offset the distance between 8-row blocks, k · 16 bytes; for N-major, the leading
/// offset is the distance between core matrices along K, 64 · 16 bytes here, and the stride
/// offset the distance along N, 128 bytes), the second swaps each operand's pair.
pub fn readings(mode: ProbeMode, k: usize) -> [DescriptorReading; 2] {
    let kmaj = (128u32, 16 * k as u32);
    let b = match mode {
        ProbeMode::KMajor => kmaj,
        ProbeMode::RegistersTimesNMajor => (64 * 16, 128),
    };
    let first = DescriptorReading {
        lead_a: kmaj.0,
        stride_a: kmaj.1,
        lead_b: b.0,
        stride_b: b.1,
    };
    let swapped = DescriptorReading {
        lead_a: kmaj.1,
        stride_a: kmaj.0,
        lead_b: b.1,
        stride_b: b.0,
    };
    [first, swapped]
}

/// Runs the probe once on `gpu`: `a` `[64][k]` and `b` (`[64][k]` for
/// [`ProbeMode::KMajor`], `[k][64]` otherwise) as bf16 words, with `reading`; returns `C`,
/// 64 × 64 fp32, row-major.
///
/// # Errors
/// [`GpuError::Config`] on a device that is not compute capability 9.0 or for a `k` that is
/// not a multiple of 16 up to 128, or inputs of the wrong length; NVRTC and driver errors.
pub fn wgmma_probe(
    gpu: &Gpu,
    mode: ProbeMode,
    a: &[u16],
    b: &[u16],
    k: usize,
    reading: DescriptorReading,
) -> Result<Vec<f32>, GpuError> {
    if gpu.arch() != "sm_90a" {
        return Err(GpuError::Config(format!(
            "the wgmma probe needs compute capability 9.0 (sm_90a), not {}",
            gpu.arch()
        )));
    }
    if k == 0 || !k.is_multiple_of(16) || k > 128 || a.len() != 64 * k || b.len() != 64 * k {
        return Err(GpuError::Config(format!(
            "wgmma probe: k = {k} must be a multiple of 16 up to 128, with 64 * k words in a ({}) \
             and b ({})",
            a.len(),
            b.len()
        )));
    }
    let compiled = gpu.compile("attn_wgmma_sm90.cu", &wgmma_source(Some("wgmma_probe")))?;
    let smem = (2 * 64 * k * 2) as u32;
    let f = gpu.function(&compiled.module, "wgmma_probe", smem)?;
    let (ad, bd) = (gpu.stream.clone_htod(a)?, gpu.stream.clone_htod(b)?);
    let mut c = gpu.stream.alloc_zeros::<f32>(64 * 64)?;
    let (k_i, mode_i) = (
        k as i32,
        match mode {
            ProbeMode::KMajor => 0i32,
            ProbeMode::RegistersTimesNMajor => 1,
        },
    );
    let mut l = gpu.stream.launch_builder(&f);
    l.arg(&ad)
        .arg(&bd)
        .arg(&mut c)
        .arg(&k_i)
        .arg(&mode_i)
        .arg(&reading.lead_a)
        .arg(&reading.stride_a)
        .arg(&reading.lead_b)
        .arg(&reading.stride_b);
    // SAFETY: `wgmma_probe(const u16* A, const u16* B, float* C, int K, int mode, u32 lead_a,
    // u32 stride_a, u32 lead_b, u32 stride_b)`, one warpgroup; A and B hold 64 * K words, C
    // 64 * 64 floats; the dynamic shared memory holds both operands.
    unsafe {
        l.launch(LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: smem,
        })?
    };
    let out = gpu.stream.clone_dtoh(&c)?;
    gpu.stream.synchronize()?;
    Ok(out)
}

/// Query rows per CTA of [`Sm90Version::V1`] (one warpgroup; wgmma's M).
pub const SM90_ROWS: usize = 64;
/// Keys per tile of [`Sm90Version::V1`].
pub const SM90_KEYS: usize = 64;
/// Query rows per CTA of [`Sm90Version::V2`], V3 and V5 (two consumer warpgroups of 64 rows).
pub const WS_ROWS: usize = 128;
/// Keys per tile of [`Sm90Version::V2`] to V5 (`WS_BC` in the kernel source).
pub const WS_KEYS: usize = 128;
/// K and V stages of [`Sm90Version::V2`] to V4 (V5: 3).
pub const WS_STAGES: usize = 2;

/// The fewest queries for which [`Sm90Version::for_shape`] picks V4 at head_dim 64.
pub const V4_MIN_QUERIES: usize = 2048;

/// Which wgmma forward kernel [`HopperForward`] runs (both in `kernels/attn_wgmma_sm90.cu`;
/// `kernels/TUNING.md` has each version's measurements).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sm90Version {
    /// One warpgroup per 64-row query tile, K and V by cp.async (no swizzle), 64 keys per tile,
    /// every GEMM waited for before the softmax.
    V1,
    /// Three warpgroups per 128-row query tile: a producer that brings Q, K and V by TMA (128-byte
    /// swizzle, [`WS_STAGES`] stages on mbarriers, registers handed to the consumers with
    /// `setmaxnreg`) and two consumers of 64 rows each, [`WS_KEYS`] keys per tile.
    V2,
    /// V2 with FlashAttention-3's intra-warpgroup overlap: tile j's S = Q Kᵀ and tile j−1's
    /// O += P V issued together, the softmax of tile j while P V is in flight; causal query
    /// tiles heaviest first; and its ping-pong between the consumers, which take turns to
    /// issue their products on named barriers ([`PINGPONG_ENV`]; not on the persistent grid).
    /// V4 and V5 inherit both.
    V3,
    /// V3 with three consumer warpgroups (192-row query tiles, 512 threads; registers 32 for
    /// the producer, 160 for each consumer): FlashAttention-3's shape for head_dim 64, the
    /// only head_dim it runs.
    V4,
    /// V3 with three K and V stages instead of two (225 KB of shared memory at head_dim 128,
    /// the only head_dim it runs).
    V5,
}

impl Sm90Version {
    /// Query rows per CTA: 64 (V1), 128 (V2, V3, V5), 192 (V4).
    pub fn rows(self) -> usize {
        match self {
            Sm90Version::V1 => SM90_ROWS,
            Sm90Version::V2 | Sm90Version::V3 | Sm90Version::V5 => WS_ROWS,
            Sm90Version::V4 => 192,
        }
    }

    /// K and V stages: [`WS_STAGES`], 3 for V5 (V1 double-buffers by cp.async: 2).
    pub fn stages(self) -> usize {
        if self == Sm90Version::V5 {
            3
        } else {
            WS_STAGES
        }
    }

    /// The name of this version's kernel for `head_dim` in `kernels/attn_wgmma_sm90.cu` (V1
    /// `attn_fwd_sm90_d<head_dim>`, V2 `attn_fwd_sm90_ws_d…`, V3 `…_wsp_…`, V4 `…_wsp3_…`, V5
    /// `…_wsps3_…`), or `None` where the source has no such kernel: head dims other than 64
    /// and 128, V4 other than at 64, V5 other than at 128.
    pub fn kernel_name(self, head_dim: usize) -> Option<String> {
        let tag = match (self, head_dim) {
            (_, d) if d != 64 && d != 128 => return None,
            (Sm90Version::V4, 128) | (Sm90Version::V5, 64) => return None,
            (Sm90Version::V1, _) => "",
            (Sm90Version::V2, _) => "ws_",
            (Sm90Version::V3, _) => "wsp_",
            (Sm90Version::V4, _) => "wsp3_",
            (Sm90Version::V5, _) => "wsps3_",
        };
        Some(format!("attn_fwd_sm90_{tag}d{head_dim}"))
    }

    /// The version [`HopperForward::new`] picks for `head_dim` and `seq_len_q`: V4 at head_dim
    /// 64 with at least 2048 queries, otherwise V3. Measured on the H200 (10ffead, B4 H8,
    /// forward): at head_dim 64 V4 beats V3 from T = 2048 up (382 against 336 TFLOP/s there, 483
    /// against 388 at 16384), and loses below (247 against 285 at T = 1024: a 192-row tile
    /// leaves a third of the last CTA of each head idle and fewer CTAs fill the SMs).
    pub fn for_shape(head_dim: usize, seq_len_q: usize) -> Sm90Version {
        if head_dim == 64 && seq_len_q >= V4_MIN_QUERIES {
            Sm90Version::V4
        } else {
            Sm90Version::V3
        }
    }
}

/// A forward's (batch, heads, kv_heads, seq_len_q, seq_len_kv).
pub type FwdShape = (usize, usize, usize, usize, usize);

/// Set to `0`, turns the wgmma forward's tail split ([`fwd_tail_split`]) off in every
/// [`HopperForward`] the process builds (for timing it against the unsplit kernel).
pub const TAIL_ENV: &str = "KP_SM90_FWD_TAIL";

/// The wgmma forward's `(items, ctas)` for `tiles` query tiles, the tail split `split` (`(whole,
/// parts)`: tiles `whole ..` run as `parts` items each) and `sms` SMs: every tile or part is
/// an item, and the CTAs are one per item, or with `persistent` at most one per SM (each takes
/// items `c, c + ctas, …`).
pub fn fwd_grid(
    tiles: usize,
    split: Option<(usize, usize)>,
    sms: usize,
    persistent: bool,
) -> (usize, usize) {
    let items = split.map_or(tiles, |(whole, parts)| whole + (tiles - whole) * parts);
    (
        items,
        if persistent {
            items.min(sms.max(1))
        } else {
            items
        },
    )
}

/// Set to `1`, every [`HopperForward`] the process builds compiles the persistent instantiation
/// of its kernel and runs non-causal shapes on it (for timing against the default; off
/// otherwise): at most one CTA per SM takes the query tiles (or tail-split parts) in turn, each
/// one's Q and first K and V tiles brought while the previous one ends. Not the default: three
/// H100 calls on 2026-12-06 measured it within the run-to-run spread of one CTA per tile (D64
/// T4096 −4.1 %, −2.5 %, +0.5 %; D128 T2048 +2 %), and it costs 41–49 % more compile time on
/// the device (kernels/TUNING.md, "The persistent forward").
pub const PERSIST_ENV: &str = "KP_SM90_FWD_PERSIST";

/// Set to `0`, every [`HopperForward`] the process builds (V3 to V5, the forwards that overlap
/// within a warpgroup) compiles its kernel without FlashAttention-3's ping-pong between the
/// consumer warpgroups (Shah et al., 2024, section 3.1), which is otherwise on: the consumers
/// take turns to issue their wgmma through named barriers, so one's softmax overlaps another's
/// products by construction. For timing against the kernel without it: on an H100 on
/// 2026-12-06 the ping-pong made the forward 1–15 % faster on every case tried (kernels/TUNING.md,
/// "The ping-pong between consumer warpgroups"). The persistent grid ([`PERSIST_ENV`]) runs
/// without it.
pub const PINGPONG_ENV: &str = "KP_SM90_FWD_PINGPONG";

/// What this process's environment asks of every [`HopperForward`] it builds: the persistent
/// grid ([`PERSIST_ENV`] = `1`), the ping-pong ([`PINGPONG_ENV`] = `0` turns it off) and the
/// tail split ([`TAIL_ENV`] = `0` turns it off). The one place these variables are read, so
/// that the kernels and the runner's account of them agree.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FwdEnv {
    /// Non-causal shapes on the persistent grid.
    pub persistent: bool,
    /// The ping-pong between consumers compiled in.
    pub pingpong: bool,
    /// The tail split on.
    pub tail_split: bool,
}

impl FwdEnv {
    /// Reads [`PERSIST_ENV`], [`PINGPONG_ENV`] and [`TAIL_ENV`] (unset: the defaults).
    pub fn read() -> FwdEnv {
        let is = |name: &str, value: &str| std::env::var(name).is_ok_and(|v| v == value);
        FwdEnv {
            persistent: is(PERSIST_ENV, "1"),
            pingpong: !is(PINGPONG_ENV, "0"),
            tail_split: !is(TAIL_ENV, "0"),
        }
    }
}

/// Largest number of parts [`fwd_tail_split`] cuts a tile's keys into (the combine's
/// `KP_TAIL_MAX_PARTS` in kernels/attn_wgmma_sm90.cu, which a unit test compares).
pub const TAIL_MAX_PARTS: usize = 4;

/// Fewest key tiles ([`WS_KEYS`] keys each) per part of a split tile in [`fwd_tail_split`].
pub const TAIL_MIN_PART_KEY_TILES: usize = 4;

/// The wgmma forward's tail split: for `tiles` query tiles of one CTA each (one CTA per SM, so
/// `sms` of them make a wave) whose keys span `key_tiles` tiles of [`WS_KEYS`], `Some((whole,
/// parts))` when the last wave is short and the split pays: tiles `0 .. whole` run over all
/// their keys, and each of the last `tiles - whole` tiles runs as `parts` CTAs over a slice of
/// its keys each, which a second kernel merges by their log-sum-exps (flash-decoding's combine,
/// Dao et al., 2023, applied to the last wave only). The last wave, otherwise `tail = tiles %
/// sms` CTAs on `sms` SMs, then takes about 1 / parts of a whole tile's time.
///
/// `None` for causal masks (their tiles differ in work and run heaviest first: no wave
/// structure to fix), fewer tiles than SMs (one wave), a whole last wave, and where `parts =
/// min(sms / tail, TAIL_MAX_PARTS, key_tiles / TAIL_MIN_PART_KEY_TILES)` is below 2 (a tail of
/// more than half the SMs, or too few key tiles to repay the combine).
pub fn fwd_tail_split(
    tiles: usize,
    sms: usize,
    key_tiles: usize,
    causal: bool,
) -> Option<(usize, usize)> {
    if causal || sms == 0 || tiles < sms {
        return None;
    }
    let tail = tiles % sms;
    if tail == 0 {
        return None;
    }
    let parts = (sms / tail)
        .min(TAIL_MAX_PARTS)
        .min(key_tiles / TAIL_MIN_PART_KEY_TILES);
    (parts >= 2).then_some((tiles - tail, parts))
}

/// A `CUtensorMap` (the driver's 128-byte tensor-map object, 64-byte aligned) as a kernel
/// argument: the kernels take it by value as a `__grid_constant__` parameter.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub struct TmaMap(sys::CUtensorMap);

// SAFETY: a plain 128-byte value; the kernel's parameter is the same 128 bytes (`TmaMap` in
// kernels/attn_wgmma_sm90.cu, `__align__(64)`).
unsafe impl DeviceRepr for TmaMap {}

/// The tensor map of a bf16 tensor `[planes][rows][head_dim]` at device address `ptr` for TMA
/// boxes of 64 columns (128 bytes, the 128-byte swizzle's width) × `box_rows` rows × 1 plane,
/// 128-byte swizzled in shared memory; boxes past the tensor's end read zeros.
///
/// # Errors
/// [`GpuError::Config`] for a head_dim that is not a multiple of 64 or a box of more than 256
/// rows; the driver's error for what it refuses.
pub fn tma_map_bf16(
    ptr: sys::CUdeviceptr,
    shape: (usize, usize, usize),
    box_rows: u32,
) -> Result<TmaMap, GpuError> {
    tma_map_16(ptr, shape, box_rows, Dtype::Bf16)
}

/// Launches the wgmma backward's preprocessing (`attn_bwd_sm90_pre_d*`, `pre`), shared by the
/// dense backward and flex's: from O, dO (bf16 or fp16 words, `[rows, D]`) and the forward's
/// LSE (`[rows]`, natural log), Dsum = rowsum(dO ∘ O) and LSE in base 2 for each of the
/// `rows_pad` padded rows (float32, `rows_pad` each; the padding rows get values that empty
/// them: LSE2 = +inf, Dsum = 0), and dQ's float32 accumulator zeroed (`[rows, D]`). `(tq, tq_pad, rows_pad)`: the query
/// length, the length padded to the step's queries, and batch · heads · tq_pad.
///
/// # Errors
/// Driver errors.
pub(super) fn launch_bwd_pre(
    gpu: &Gpu,
    pre: &CudaFunction,
    (o, dout, lse): (&CudaSlice<u16>, &CudaSlice<u16>, &CudaSlice<f32>),
    (dsum, lse2, dqacc): (
        &mut CudaSlice<f32>,
        &mut CudaSlice<f32>,
        &mut CudaSlice<f32>,
    ),
    (tq, tq_pad, rows_pad): (i32, i32, usize),
) -> Result<(), GpuError> {
    let rows_pad_i = rows_pad as i32;
    let mut b = gpu.stream.launch_builder(pre);
    b.arg(o)
        .arg(dout)
        .arg(lse)
        .arg(dsum)
        .arg(lse2)
        .arg(dqacc)
        .arg(&tq)
        .arg(&tq_pad)
        .arg(&rows_pad_i);
    // SAFETY: `attn_bwd_sm90_pre_d*(const u16* O, const u16* dO, const float* LSE, float* dsum,
    // float* lse2, float* dqacc, int Tq, int Tq_pad, int rows_pad)`: the callers allocate O and
    // dO with rows · D words, LSE rows, dsum and lse2 at least rows_pad floats, dqacc rows · D;
    // one warp per padded row, 8 per 256-thread block.
    unsafe {
        b.launch(LaunchConfig {
            grid_dim: (rows_pad.div_ceil(8) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        })?
    };
    Ok(())
}

/// [`tma_map_bf16`] for a tensor of 16-bit `dtype` (bf16 or fp16: the map's element type).
///
/// # Errors
/// As [`tma_map_bf16`]; [`GpuError::Config`] for fp32.
pub fn tma_map_16(
    ptr: sys::CUdeviceptr,
    (planes, rows, head_dim): (usize, usize, usize),
    box_rows: u32,
    dtype: Dtype,
) -> Result<TmaMap, GpuError> {
    if !head_dim.is_multiple_of(64) || box_rows == 0 || box_rows > 256 {
        return Err(GpuError::Config(format!(
            "tensor map: head_dim {head_dim} must be a multiple of 64 and the box 1..=256 rows \
             (not {box_rows})"
        )));
    }
    tma_map_16_box(ptr, (planes, rows, head_dim), [64, box_rows, 1], dtype)
}

/// A tensor map of a 16-bit `dtype` tensor `[planes][rows][cols]` at `ptr` with boxes of
/// `bx` = [columns, rows, planes] (columns 64: the 128-byte swizzle's width; each at most 256),
/// 128-byte swizzled in shared memory; boxes past the tensor's end read zeros. The decoding
/// kernel's paged cache takes boxes of one row (a kv head) across several planes (keys).
///
/// # Errors
/// [`GpuError::Config`] for cols not a multiple of 64, a box not 64 columns wide or of more
/// than 256 in a dimension, fp32; the driver's error for what it refuses.
pub fn tma_map_16_box(
    ptr: sys::CUdeviceptr,
    (planes, rows, cols): (usize, usize, usize),
    bx: [u32; 3],
    dtype: Dtype,
) -> Result<TmaMap, GpuError> {
    check_dtype("tensor map", dtype)?;
    if !cols.is_multiple_of(64) || bx[0] != 64 || bx.iter().any(|&b| b == 0 || b > 256) {
        return Err(GpuError::Config(format!(
            "tensor map: {cols} columns must be a multiple of 64 and the box 64 columns by \
             1..=256 rows and planes (not {bx:?})"
        )));
    }
    tma_map_3d(
        ptr,
        if dtype == Dtype::F16 {
            sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16
        } else {
            sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
        },
        2,
        (planes, rows, cols),
        bx,
    )
}

/// The tensor map of an fp32 tensor `[planes][rows][cols]` at `ptr` for boxes of 32 columns
/// (128 bytes) × `box_rows` rows × 1 plane, 128-byte swizzled in shared memory (the wgmma
/// backward's dQ accumulator, for TMA reduce-adds; elements past the tensor's end are skipped).
///
/// # Errors
/// [`GpuError::Config`] for `cols` not a multiple of 32 or a box of more than 256 rows; the
/// driver's error for what it refuses.
pub fn tma_map_f32(
    ptr: sys::CUdeviceptr,
    (planes, rows, cols): (usize, usize, usize),
    box_rows: u32,
) -> Result<TmaMap, GpuError> {
    if !cols.is_multiple_of(32) || box_rows == 0 || box_rows > 256 {
        return Err(GpuError::Config(format!(
            "tensor map: {cols} columns must be a multiple of 32 and the box 1..=256 rows (not \
             {box_rows})"
        )));
    }
    tma_map_3d(
        ptr,
        sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
        4,
        (planes, rows, cols),
        [32, box_rows, 1],
    )
}

/// A 3-D tiled tensor map (innermost dimension `cols`, 128-byte swizzle, boxes of `bx[0]`
/// columns × `bx[1]` rows × `bx[2]` planes) over elements of `bytes` bytes.
fn tma_map_3d(
    ptr: sys::CUdeviceptr,
    dtype: sys::CUtensorMapDataType,
    bytes: usize,
    (planes, rows, cols): (usize, usize, usize),
    bx: [u32; 3],
) -> Result<TmaMap, GpuError> {
    let dims = [cols as u64, rows as u64, planes as u64];
    let strides = [(cols * bytes) as u64, (rows * cols * bytes) as u64];
    let boxes = bx;
    let element_strides = [1u32; 3];
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
    // SAFETY: `map` is a writable CUtensorMap; the arrays hold `rank` (3) entries (strides 2:
    // the innermost is implied) and live across the call; `ptr` is a device allocation of at
    // least planes · rows · cols elements (the caller's buffer, checked against the shape by
    // the launch).
    unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            dtype,
            3,
            ptr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            element_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
        .result()?;
        Ok(TmaMap(map.assume_init()))
    }
}

/// The attention forward on wgmma (issue 11): bf16 Q `[batch, heads, seq_len_q, head_dim]`, K
/// and V `[batch, kv_heads, seq_len_kv, head_dim]` (GQA: heads a multiple of kv_heads), O like
/// Q, LSE `[batch, heads, seq_len_q]` f32 natural log (+∞ and O = 0 for a row that sees no
/// key); per-sequence key lengths `kv_lens` `[batch]` i32 on the device; causal aligned
/// bottom-right; head_dim 64 or 128. S = Q Kᵀ and O += P V on wgmma, FlashAttention-2's online
/// softmax in between (Dao, 2023); [`Sm90Version`] says how the tiles are brought and who
/// computes them. V2 to V5 write O through shared memory with one TMA store per 64-column
/// panel where each query tile has its own CTA (from registers on the persistent grid and for
/// the tail split's parts).
///
/// Non-causal shapes whose last wave of CTAs is short run with [`fwd_tail_split`]'s split
/// (V2 to V5; [`HopperForward::set_tail_split`] and [`TAIL_ENV`] turn it off): the split
/// tiles' parts go to an fp32 workspace this type keeps ([`HopperForward::tail_bytes`]), and
/// the kernel's `_combine` writes their rows of O and LSE.
pub struct HopperForward {
    func: CudaFunction,
    /// The tail split's combine (`<kernel>_combine`; V2 to V5).
    combine: Option<CudaFunction>,
    smem: u32,
    head_dim: usize,
    version: Sm90Version,
    dtype: Dtype,
    /// SMs on the device: one wave of CTAs.
    sms: usize,
    tail_split: bool,
    /// Non-causal shapes (V2 to V5) on a persistent grid ([`PERSIST_ENV`]).
    persistent: bool,
    /// Whether the module holds the persistent instantiation ([`wgmma_source_with`]).
    has_persistent: bool,
    /// Causal (V3 to V5): the chunk size [`HopperForward::set_causal_chunk`] forced, or `None`
    /// for [`fwd_causal_chunk`]'s.
    causal_chunk: Option<usize>,
    /// Half the device's L2 cache, bytes: [`fwd_causal_chunk`]'s budget.
    l2_budget: usize,
    /// The last shape's chunk size (a simulation per launch would cost host time).
    chunk_memo: Option<(FwdShape, usize)>,
    /// The split parts' outputs (fp32 `[tail, parts, rows, head_dim]`) and log2-domain
    /// log-sum-exps (`[tail, parts, rows]`), grown on demand.
    tail_ws: Option<(CudaSlice<f32>, CudaSlice<f32>)>,
    /// The loaded module (read by [`HopperForward::trace`]).
    module: std::sync::Arc<cudarc::driver::CudaModule>,
    /// NVRTC compile + load time, s.
    pub compile_s: f64,
}

/// The probe switches [`HopperForward::with_probe`] takes, each `#define`d before the kernel's
/// source: [`TRACE_DEFINE`] records where each CTA's time goes ([`HopperForward::trace`]);
/// `KP_SM90_NO_TMA_STORE` writes O from registers rather than through shared memory and TMA;
/// `KP_SM90_PERSIST` runs non-causal shapes on the persistent grid (as
/// [`HopperForward::with_persistence`]), and `KP_SM90_PERSIST_PINGPONG` gives that grid the
/// ping-pong between consumers.
pub const PROBE_DEFINES: [&str; 4] = [
    TRACE_DEFINE,
    "KP_SM90_NO_TMA_STORE",
    "KP_SM90_PERSIST",
    "KP_SM90_PERSIST_PINGPONG",
];

/// The probe switch that compiles the forward's trace in ([`HopperForward::trace`]).
pub const TRACE_DEFINE: &str = "KP_SM90_TRACE";

/// The most CTAs of one launch the forward's trace holds (the kernel's `KP_TRACE_CTAS`).
pub const TRACE_CTAS: usize = 8192;

/// Moments of a CTA's life the forward's trace records (the kernel's `KP_TRACE_EVENTS`): its
/// start, its mbarriers set up, the producer's last load issued, consumer 0's Q landed, its
/// first S = Q Kᵀ landed, its last P V landed, its stores of O and LSE issued, and the same
/// for the last consumer.
pub const TRACE_EVENTS: usize = 8;

/// One CTA of a traced forward launch ([`HopperForward::trace`]): the SM it ran on and, for
/// each of [`TRACE_EVENTS`] moments, the device's global timer (ns) and the SM's cycle counter
/// (`clock64`); 0 for a moment the CTA did not reach (a CTA with no key tile has no products,
/// and V2, which does not overlap within a warpgroup, records neither its first S nor its last
/// P V). The stores' moment comes after the TMA store's read of shared memory where O leaves
/// that way, after the stores' issue where it leaves from registers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FwdCtaTrace {
    /// `%smid`.
    pub sm: u32,
    /// `%globaltimer` at each moment, ns.
    pub ns: [u64; TRACE_EVENTS],
    /// `clock64()` at each moment, cycles of the CTA's SM.
    pub cycles: [u64; TRACE_EVENTS],
}

impl HopperForward {
    /// Compiles the kernel of [`Sm90Version::for_shape`]'s version for `head_dim` and
    /// `seq_len_q` (once per process).
    ///
    /// # Errors
    /// As [`HopperForward::with_version`].
    pub fn new(gpu: &Gpu, head_dim: usize, seq_len_q: usize) -> Result<HopperForward, GpuError> {
        HopperForward::with_version(gpu, head_dim, Sm90Version::for_shape(head_dim, seq_len_q))
    }

    /// Compiles `version`'s kernel for `head_dim` (once per process; that kernel alone).
    ///
    /// # Errors
    /// [`GpuError::Config`] on a device that is not compute capability 9.0, for a head_dim
    /// other than 64 and 128, [`Sm90Version::V4`] at head_dim 128 or V5 at 64; NVRTC and driver
    /// errors.
    pub fn with_version(
        gpu: &Gpu,
        head_dim: usize,
        version: Sm90Version,
    ) -> Result<HopperForward, GpuError> {
        HopperForward::with_dtype(gpu, head_dim, version, Dtype::Bf16)
    }

    /// [`HopperForward::with_version`] for Q, K, V and O of 16-bit `dtype` (bf16 or fp16; the
    /// same kernels on `f16` operands for fp16).
    ///
    /// # Errors
    /// As [`HopperForward::with_version`]; [`GpuError::Config`] for fp32.
    pub fn with_dtype(
        gpu: &Gpu,
        head_dim: usize,
        version: Sm90Version,
        dtype: Dtype,
    ) -> Result<HopperForward, GpuError> {
        HopperForward::build(gpu, head_dim, version, dtype, false, true, &[])
    }

    /// [`HopperForward::with_dtype`] with probe switches ([`PROBE_DEFINES`]) compiled in: for
    /// probes that ask where the kernel's time goes or what a change is worth, never for the
    /// documents.
    ///
    /// # Errors
    /// As [`HopperForward::with_version`]; [`GpuError::Config`] for a switch not in
    /// [`PROBE_DEFINES`].
    pub fn with_probe(
        gpu: &Gpu,
        head_dim: usize,
        version: Sm90Version,
        dtype: Dtype,
        switches: &[&str],
    ) -> Result<HopperForward, GpuError> {
        if let Some(bad) = switches.iter().find(|s| !PROBE_DEFINES.contains(s)) {
            return Err(GpuError::Config(format!(
                "the wgmma forward has no probe switch {bad} (it has {PROBE_DEFINES:?})"
            )));
        }
        // The persistent grid's instantiation is wgmma_source_with's to define.
        let persist = switches.contains(&"KP_SM90_PERSIST");
        let rest: Vec<&str> = switches
            .iter()
            .copied()
            .filter(|s| *s != "KP_SM90_PERSIST")
            .collect();
        let mut f = HopperForward::build(gpu, head_dim, version, dtype, persist, true, &rest)?;
        f.persistent = persist && f.has_persistent;
        Ok(f)
    }

    /// The trace a forward built [`HopperForward::with_probe`] with [`TRACE_DEFINE`] recorded
    /// since the last read: each moment holds the last launch that reached it (one launch
    /// between reads gives that launch's trace). Its first `ctas` CTAs (at most
    /// [`TRACE_CTAS`]; numbered x fastest, then y, then z), once the launches have finished
    /// (waits for the stream); cleared after reading. Only CTAs of one query tile each record:
    /// launches on the persistent grid leave the trace as it was.
    ///
    /// # Errors
    /// [`GpuError::Config`] for a forward built without the trace (its module has no
    /// `kp_fwd_trace`), `ctas` past [`TRACE_CTAS`] or a trace whose size disagrees with
    /// [`TRACE_CTAS`] and [`TRACE_EVENTS`]; the driver's.
    pub fn trace(&self, gpu: &Gpu, ctas: usize) -> Result<Vec<FwdCtaTrace>, GpuError> {
        if ctas > TRACE_CTAS {
            return Err(GpuError::Config(format!(
                "the forward's trace holds {TRACE_CTAS} CTAs, not {ctas}"
            )));
        }
        let words = |name: &str, bytes: usize| -> Result<Vec<u8>, GpuError> {
            let mut view = self
                .module
                .get_global(name, &gpu.stream)
                .map_err(|e| match e.0 {
                    sys::CUresult::CUDA_ERROR_NOT_FOUND => GpuError::Config(format!(
                        "this wgmma forward was built without its trace ({TRACE_DEFINE})"
                    )),
                    _ => GpuError::Driver(e),
                })?;
            let got = gpu.stream.clone_dtoh(&view)?;
            if got.len() != bytes {
                return Err(GpuError::Config(format!(
                    "the forward's {name} holds {} bytes, not {bytes}",
                    got.len()
                )));
            }
            gpu.stream.memset_zeros(&mut view)?;
            Ok(got)
        };
        let times = words("kp_fwd_trace", 8 * TRACE_CTAS * 2 * TRACE_EVENTS)?;
        let sms = words("kp_fwd_trace_sm", 4 * TRACE_CTAS)?;
        let u64_at =
            |i: usize| u64::from_le_bytes(times[8 * i..8 * i + 8].try_into().expect("8 bytes"));
        Ok((0..ctas)
            .map(|c| {
                let row = c * 2 * TRACE_EVENTS;
                FwdCtaTrace {
                    sm: u32::from_le_bytes(sms[4 * c..4 * c + 4].try_into().expect("4 bytes")),
                    ns: std::array::from_fn(|e| u64_at(row + e)),
                    cycles: std::array::from_fn(|e| u64_at(row + TRACE_EVENTS + e)),
                }
            })
            .collect())
    }

    /// [`HopperForward::with_dtype`] compiled without the ping-pong between consumer
    /// warpgroups ([`PINGPONG_ENV`] = `0` does the same; it changes the versions that overlap
    /// within a warpgroup, V3 to V5, whose persistent grid never has it): for comparing with
    /// the default.
    ///
    /// # Errors
    /// As [`HopperForward::with_version`].
    pub fn without_pingpong(
        gpu: &Gpu,
        head_dim: usize,
        version: Sm90Version,
        dtype: Dtype,
    ) -> Result<HopperForward, GpuError> {
        HopperForward::build(gpu, head_dim, version, dtype, false, false, &[])
    }

    /// [`HopperForward::with_dtype`] with the persistent instantiation compiled in (V2 to V5)
    /// and `on` as the starting choice ([`HopperForward::set_persistent`] switches it).
    ///
    /// # Errors
    /// As [`HopperForward::with_version`].
    pub fn with_persistence(
        gpu: &Gpu,
        head_dim: usize,
        version: Sm90Version,
        dtype: Dtype,
        on: bool,
    ) -> Result<HopperForward, GpuError> {
        let mut f = HopperForward::build(gpu, head_dim, version, dtype, true, true, &[])?;
        f.persistent = on && f.has_persistent;
        Ok(f)
    }

    /// The constructors' common body: `persist` compiles the persistent instantiation in
    /// (as [`PERSIST_ENV`] = `1` does) and starts with it on; `pingpong` false compiles the
    /// ping-pong between consumers out (as [`PINGPONG_ENV`] = `0` does); `probe` is
    /// [`PROBE_DEFINES`]' switches to define.
    fn build(
        gpu: &Gpu,
        head_dim: usize,
        version: Sm90Version,
        dtype: Dtype,
        persist: bool,
        pingpong: bool,
        probe: &[&str],
    ) -> Result<HopperForward, GpuError> {
        check_dtype("forward", dtype)?;
        if gpu.arch() != "sm_90a" {
            return Err(GpuError::Config(format!(
                "the wgmma forward needs compute capability 9.0 (sm_90a), not {}",
                gpu.arch()
            )));
        }
        if head_dim != 64 && head_dim != 128 {
            return Err(GpuError::Config(format!(
                "the wgmma forward runs head_dim 64 or 128, not {head_dim}"
            )));
        }
        let Some(name) = version.kernel_name(head_dim) else {
            return Err(GpuError::Config(format!(
                "the wgmma forward {version:?} runs head_dim {}, not {head_dim}",
                if version == Sm90Version::V4 { 64 } else { 128 }
            )));
        };
        let smem = match version {
            Sm90Version::V1 => ((SM90_ROWS + 4 * SM90_KEYS) * head_dim * 2) as u32,
            // One 64-row Q tile per consumer, the K and V stages, 8-byte mbarriers (Q full, four
            // per stage, Q empty), and up to 1023 bytes to align the base for the 128-byte
            // swizzle.
            _ => {
                ((version.rows() + 2 * version.stages() * WS_KEYS) * head_dim * 2
                    + 8 * (2 + 4 * version.stages())
                    + 1024) as u32
            }
        };
        super::cuda::check_smem(gpu, &name, smem)?;
        let env = FwdEnv::read();
        let persistent = version != Sm90Version::V1 && (persist || env.persistent);
        let switches: String = probe.iter().map(|d| format!("#define {d}\n")).collect();
        let compiled = gpu.compile(
            "attn_wgmma_sm90.cu",
            &(switches
                + &wgmma_source_with(Some(&name), dtype, persistent, pingpong && env.pingpong)),
        )?;
        let func = gpu.function(&compiled.module, &name, smem)?;
        let combine = if version == Sm90Version::V1 {
            None
        } else {
            Some(gpu.function(&compiled.module, &format!("{name}_combine"), 0)?)
        };
        Ok(HopperForward {
            func,
            combine,
            smem,
            head_dim,
            version,
            dtype,
            sms: gpu.sm_count()?,
            tail_split: env.tail_split,
            persistent,
            has_persistent: persistent,
            causal_chunk: None,
            l2_budget: (gpu.l2_bytes()? / 2) as usize,
            chunk_memo: None,
            tail_ws: None,
            module: compiled.module.clone(),
            compile_s: compiled.compile_s,
        })
    }

    /// Turns the tail split on (the default, unless [`TAIL_ENV`] is `0`) or off.
    pub fn set_tail_split(&mut self, on: bool) {
        self.tail_split = on;
    }

    /// Runs non-causal shapes on the persistent grid or on one CTA per query tile (or split
    /// part); the default is [`PERSIST_ENV`]'s.
    ///
    /// # Errors
    /// [`GpuError::Config`] for `on` where the kernel was compiled without its persistent
    /// instantiation (see [`HopperForward::with_persistence`]).
    pub fn set_persistent(&mut self, on: bool) -> Result<(), GpuError> {
        if on && !self.has_persistent {
            return Err(GpuError::Config(
                "this wgmma forward was compiled without its persistent grid".into(),
            ));
        }
        self.persistent = on;
        Ok(())
    }

    /// The CTAs of a launch of V2 to V5 for `shape` = (batch, heads, seq_len_q, seq_len_kv)
    /// and `causal`: `(items, ctas)`, the work items (query tiles, or with the tail split its
    /// whole tiles and parts) and the CTAs that take them; `items = ctas` without the
    /// persistent grid, else `ctas = min(items, SMs)` (non-causal only).
    pub fn grid_plan(&self, shape: (usize, usize, usize, usize), causal: bool) -> (usize, usize) {
        let tiles = self.query_tiles(shape.0, shape.1, shape.2);
        fwd_grid(
            tiles,
            self.tail_plan(shape, causal),
            self.sms,
            self.persistent && !causal,
        )
    }

    /// The causal CTA order of V3 to V5 ([`fwd_causal_tile`]): `None` (the default) in
    /// [`fwd_causal_chunk`]'s chunks, `Some(c)` in chunks of `c` pairs (at least 1; 1 is each
    /// head's tiles heaviest first a head at a time, the order before 2026-12-06), to time
    /// against.
    pub fn set_causal_chunk(&mut self, chunk: Option<usize>) {
        self.causal_chunk = chunk.map(|c| c.clamp(1, i32::MAX as usize));
        self.chunk_memo = None;
    }

    /// The chunk size the causal forward of `shape` = (batch, heads, kv_heads, seq_len_q,
    /// seq_len_kv) runs in: the forced one, or [`fwd_causal_chunk`]'s for this device (a pair's
    /// K and V counted once per query head sharing them).
    pub fn causal_chunk(&self, (batch, heads, kv_heads, seq_len_q, seq_len_kv): FwdShape) -> usize {
        self.causal_chunk.unwrap_or_else(|| {
            let pair_bytes = 2 * seq_len_kv * self.head_dim * 2 * kv_heads.max(1) / heads.max(1);
            fwd_causal_chunk(
                (seq_len_q.div_ceil(self.version.rows()), self.version.rows()),
                heads * batch,
                (seq_len_q, seq_len_kv),
                self.sms,
                (pair_bytes, self.l2_budget),
            )
        })
    }

    /// The split [`HopperForward::launch`] runs for `shape` = (batch, heads, seq_len_q,
    /// seq_len_kv) and `causal`: [`fwd_tail_split`]'s `(whole, parts)` over this version's
    /// query tiles, `None` when the split is off, V1, or the shape's last wave is not short.
    pub fn tail_plan(
        &self,
        (batch, heads, seq_len_q, seq_len_kv): (usize, usize, usize, usize),
        causal: bool,
    ) -> Option<(usize, usize)> {
        if !self.tail_split || self.combine.is_none() {
            return None;
        }
        let tiles = self.query_tiles(batch, heads, seq_len_q);
        fwd_tail_split(tiles, self.sms, seq_len_kv.div_ceil(WS_KEYS), causal)
    }

    /// Query tiles (one CTA each without a split) of `batch · heads` heads of `seq_len_q` rows.
    fn query_tiles(&self, batch: usize, heads: usize, seq_len_q: usize) -> usize {
        seq_len_q.div_ceil(self.version.rows()) * heads * batch
    }

    /// Rows of the tail split's workspace for `shape` and `causal` (every part's rows of every
    /// split tile; 0 without a split).
    fn tail_rows(&self, shape: (usize, usize, usize, usize), causal: bool) -> usize {
        self.tail_plan(shape, causal).map_or(0, |(whole, parts)| {
            let tiles = self.query_tiles(shape.0, shape.1, shape.2);
            (tiles - whole) * parts * self.version.rows()
        })
    }

    /// Bytes of workspace the tail split needs for `shape` (as [`HopperForward::tail_plan`]):
    /// fp32 outputs and log-sum-exps of every part's rows; 0 without a split.
    pub fn tail_bytes(&self, shape: (usize, usize, usize, usize), causal: bool) -> u64 {
        (self.tail_rows(shape, causal) * (self.head_dim + 1) * 4) as u64
    }

    /// Allocates the tail split's workspace for `shape` and `causal` now (as
    /// [`HopperForward::tail_plan`]) rather than in the first launch: before a CUDA graph
    /// captures the launches.
    ///
    /// # Errors
    /// Allocation errors.
    pub fn reserve_tail(
        &mut self,
        gpu: &Gpu,
        shape: (usize, usize, usize, usize),
        causal: bool,
    ) -> Result<(), GpuError> {
        let rows = self.tail_rows(shape, causal);
        if rows == 0 || self.tail_ws.as_ref().is_some_and(|(_, l)| l.len() >= rows) {
            return Ok(());
        }
        // SAFETY: each part writes every row of its slice that the combine reads (rows past
        // seq_len_q are neither written nor read).
        let o = unsafe { gpu.stream.alloc::<f32>(rows * self.head_dim)? };
        // SAFETY: as above.
        let l = unsafe { gpu.stream.alloc::<f32>(rows)? };
        self.tail_ws = Some((o, l));
        Ok(())
    }

    /// Launches one forward on the stream (shapes in the type's documentation; `shape` is
    /// (batch, heads, kv_heads, seq_len_q, seq_len_kv)): one kernel, or with the tail split
    /// ([`HopperForward::tail_plan`]) the kernel and its combine, allocating the split's
    /// workspace first if [`HopperForward::reserve_tail`] has not.
    ///
    /// # Errors
    /// [`GpuError::Config`] for heads not a multiple of kv_heads, an empty dimension or a buffer
    /// whose length does not fit the shape; driver errors.
    #[allow(clippy::too_many_arguments)]
    pub fn launch(
        &mut self,
        gpu: &Gpu,
        (batch, heads, kv_heads, seq_len_q, seq_len_kv): (usize, usize, usize, usize, usize),
        (q, k, v): (&CudaSlice<u16>, &CudaSlice<u16>, &CudaSlice<u16>),
        kv_lens: &CudaSlice<i32>,
        causal: bool,
        scale: f64,
        o: &mut CudaSlice<u16>,
        lse: &mut CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        if batch == 0 || seq_len_q == 0 || seq_len_kv == 0 || kv_heads == 0 || heads % kv_heads != 0
        {
            return Err(GpuError::Config(format!(
                "wgmma forward: batch {batch}, heads {heads}, kv_heads {kv_heads}, seq_len_q \
                 {seq_len_q}, seq_len_kv {seq_len_kv}"
            )));
        }
        let d = self.head_dim;
        let (q_len, kv_len) = (
            batch * heads * seq_len_q * d,
            batch * kv_heads * seq_len_kv * d,
        );
        if q.len() != q_len
            || o.len() != q_len
            || k.len() != kv_len
            || v.len() != kv_len
            || lse.len() != batch * heads * seq_len_q
            || kv_lens.len() != batch
        {
            return Err(GpuError::Config(format!(
                "wgmma forward: buffer lengths q {}, k {}, v {}, o {}, lse {}, kv_lens {} do not \
                 fit the shape (q and o {q_len}, k and v {kv_len}, lse {}, kv_lens {batch})",
                q.len(),
                k.len(),
                v.len(),
                o.len(),
                lse.len(),
                kv_lens.len(),
                batch * heads * seq_len_q
            )));
        }
        let (tq, tkv, h, kvh) = (
            seq_len_q as i32,
            seq_len_kv as i32,
            heads as i32,
            kv_heads as i32,
        );
        let scale_log2 = (scale * std::f64::consts::LOG2_E) as f32;
        let causal_i = i32::from(causal);
        if self.version != Sm90Version::V1 {
            if !(scale > 0.0 && scale.is_finite()) {
                // The kernels take each row's maximum over the raw scores and scale it after
                // (one FFMA per score): right for a positive scale only.
                return Err(GpuError::Config(format!(
                    "the wgmma forward {:?} takes a positive finite scale, not {scale}",
                    self.version
                )));
            }
            let plan = self.tail_plan((batch, heads, seq_len_q, seq_len_kv), causal);
            if plan.is_some() {
                self.reserve_tail(gpu, (batch, heads, seq_len_q, seq_len_kv), causal)?;
            }
            let (whole, parts) = plan.unwrap_or((0, 0));
            let tail = self.query_tiles(batch, heads, seq_len_q) - whole;
            // The guards live until after the launch: dropping one records the buffer's read
            // on this stream, which must come after the kernel that reads it through TMA.
            let (qp, _gq) = q.device_ptr(&gpu.stream);
            let (kp, _gk) = k.device_ptr(&gpu.stream);
            let (vp, _gv) = v.device_ptr(&gpu.stream);
            // O's address for the kernel's pointer and its tensor map (the epilogue's TMA
            // store); the guard records the write when it drops, after the launch.
            let (o_ptr, o_guard) = o.device_ptr_mut(&gpu.stream);
            let maps = [
                tma_map_16(qp, (batch * heads, seq_len_q, d), 64, self.dtype)?,
                tma_map_16(
                    kp,
                    (batch * kv_heads, seq_len_kv, d),
                    WS_KEYS as u32,
                    self.dtype,
                )?,
                tma_map_16(
                    vp,
                    (batch * kv_heads, seq_len_kv, d),
                    WS_KEYS as u32,
                    self.dtype,
                )?,
                tma_map_16(o_ptr, (batch * heads, seq_len_q, d), 64, self.dtype)?,
            ];
            let (whole_i, parts_i, tail_i) = (whole as i32, parts as i32, tail as i32);
            let (items, ctas) = self.grid_plan((batch, heads, seq_len_q, seq_len_kv), causal);
            // 0: one CTA per item; else the item count, taken in turn by `ctas` CTAs.
            let items_i = if self.persistent && !causal {
                i32::try_from(items).map_err(|_| {
                    GpuError::Config(format!("wgmma forward: {items} work items overflow i32"))
                })?
            } else {
                0
            };
            let shape5 = (batch, heads, kv_heads, seq_len_q, seq_len_kv);
            let chunk = match self.chunk_memo {
                _ if !causal => 1,
                Some((s, c)) if s == shape5 => c,
                _ => {
                    let c = self.causal_chunk(shape5);
                    self.chunk_memo = Some((shape5, c));
                    c
                }
            }
            // At most every pair (the kernel's chunks never exceed the grid), at least 1.
            .clamp(1, (heads * batch).clamp(1, i32::MAX as usize)) as i32;
            // The workspace's device addresses (0 without a split: the kernel never reads them).
            let mut ws_guards = None;
            let (op, lp) = match (plan, self.tail_ws.as_mut()) {
                (Some(_), Some((wo, wl))) => {
                    let (op, go) = wo.device_ptr_mut(&gpu.stream);
                    let (lp, gl) = wl.device_ptr_mut(&gpu.stream);
                    ws_guards = Some((go, gl));
                    (op, lp)
                }
                _ => (0, 0),
            };
            let mut l = gpu.stream.launch_builder(&self.func);
            l.arg(&maps[0])
                .arg(&maps[1])
                .arg(&maps[2])
                .arg(&maps[3])
                .arg(&o_ptr)
                .arg(&mut *lse)
                .arg(kv_lens)
                .arg(&tq)
                .arg(&tkv)
                .arg(&h)
                .arg(&kvh)
                .arg(&scale_log2)
                .arg(&causal_i)
                .arg(&whole_i)
                .arg(&parts_i)
                .arg(&op)
                .arg(&lp)
                .arg(&chunk)
                .arg(&items_i);
            let grid_dim = if items_i > 0 {
                (ctas as u32, 1, 1)
            } else if plan.is_some() {
                ((whole + tail * parts) as u32, 1, 1)
            } else {
                (
                    seq_len_q.div_ceil(self.version.rows()) as u32,
                    heads as u32,
                    batch as u32,
                )
            };
            // SAFETY: `attn_fwd_sm90_ws_d*(TmaMap tq, TmaMap tk, TmaMap tv, TmaMap to, u16* O,
            // float* LSE, const int* kv_lens, int Tq, int Tkv, int H, int KVH, float
            // scale_log2, int causal, int whole, int parts, float* Opart, float* Lpart, int
            // chunk, int items)`,
            // 1 + rows / 64 warpgroups a CTA, one CTA per (query tile, head, batch entry) on a
            // (qtiles, H, B) grid, or with a split (parts > 0) one per whole tile or split part
            // on a 1-D grid, or (items > 0, not causal) `ctas` CTAs taking the `items` work
            // items (tiles, or whole tiles and split parts) in turn; the maps describe q, k and v
            // with the shapes checked above (TMA reads inside them only, zero-filling past their
            // ends; `to` describes o, which TMA writes inside only), o (`o_ptr`) and lse hold
            // those shapes, kv_lens `batch` entries, Opart and Lpart (with
            // a split) the rows of `tail * parts` tiles (reserve_tail sized them for this
            // shape); q, k and v stay borrowed, and their read events are recorded on this
            // stream after the launch (the guards above), like the other arguments'.
            unsafe {
                l.launch(LaunchConfig {
                    grid_dim,
                    block_dim: (128 * (self.version.rows() / 64 + 1) as u32, 1, 1),
                    shared_mem_bytes: self.smem,
                })?
            };
            // O's write recorded on the stream, after the kernel; the combine borrows o next.
            drop(o_guard);
            if let (Some(_), Some(combine)) = (plan, self.combine.as_ref()) {
                let warps = tail * self.version.rows();
                let mut l = gpu.stream.launch_builder(combine);
                l.arg(&op)
                    .arg(&lp)
                    .arg(o)
                    .arg(lse)
                    .arg(&whole_i)
                    .arg(&parts_i)
                    .arg(&tail_i)
                    .arg(&tq);
                // SAFETY: `<kernel>_combine(const float* Opart, const float* Lpart, u16* O,
                // float* LSE, int whole, int parts, int tail, int Tq)`, one warp per row of the
                // `tail` split tiles (8 warps a CTA, extra warps return); it reads the rows the
                // kernel above wrote to the workspace (same stream, after it) and writes those
                // rows of o and lse, whose shapes were checked above.
                unsafe {
                    l.launch(LaunchConfig {
                        grid_dim: (warps.div_ceil(8) as u32, 1, 1),
                        block_dim: (256, 1, 1),
                        shared_mem_bytes: 0,
                    })?
                };
            }
            drop(ws_guards);
            return Ok(());
        }
        let kmaj = (128u32, 16 * d as u32);
        let nmaj = (16 * d as u32, 128u32);
        let mut l = gpu.stream.launch_builder(&self.func);
        l.arg(q)
            .arg(k)
            .arg(v)
            .arg(o)
            .arg(lse)
            .arg(kv_lens)
            .arg(&tq)
            .arg(&tkv)
            .arg(&h)
            .arg(&kvh)
            .arg(&scale_log2)
            .arg(&kmaj.0)
            .arg(&kmaj.1)
            .arg(&nmaj.0)
            .arg(&nmaj.1)
            .arg(&causal_i);
        // SAFETY: `attn_fwd_sm90_d*(const u16* Q, const u16* K, const u16* V, u16* O, float*
        // LSE, const int* kv_lens, int Tq, int Tkv, int H, int KVH, float scale_log2, u32
        // lead_k, u32 stride_k, u32 lead_v, u32 stride_v, int causal)`, one warpgroup per (query
        // tile, head, batch entry); the caller's buffers hold the shapes of the type's
        // documentation and kv_lens `batch` entries of at most seq_len_kv.
        unsafe {
            l.launch(LaunchConfig {
                grid_dim: (
                    seq_len_q.div_ceil(SM90_ROWS) as u32,
                    heads as u32,
                    batch as u32,
                ),
                block_dim: (128, 1, 1),
                shared_mem_bytes: self.smem,
            })?
        };
        Ok(())
    }
}

/// Source of the wgmma backward (after [`PRELUDE_SRC`] and [`WGMMA_SRC`]); its kernels need a
/// `KP_SM90_BWD_D<head_dim>` or `KP_SM90_BWD_ALL` define before it ([`bwd_source`]).
pub const WGMMA_BWD_SRC: &str = include_str!("../../kernels/attn_wgmma_bwd_sm90.cu");

/// The wgmma backward's whole source: [`PRELUDE_SRC`], the helpers of [`WGMMA_SRC`] without any
/// of its kernels (nothing selects one), [`WGMMA_BWD_SRC`] with the kernels of `head_dim` (the
/// preprocessing and main kernels; the dQ conversion is always there), or of both head dims for
/// `None`. At head_dim 128 the main kernel is the one of 64 queries a step, which a process at
/// the default steps does not compile ([`bwd_source_wide`] with [`BWD_WIDE_DEFAULT`]).
pub fn bwd_source(head_dim: Option<usize>) -> String {
    bwd_source_for(head_dim, Dtype::Bf16)
}

/// [`bwd_source`] for `dtype` (bf16 or fp16).
///
/// # Panics
/// For fp32.
pub fn bwd_source_for(head_dim: Option<usize>, dtype: Dtype) -> String {
    bwd_source_wide(head_dim, dtype, (64, 64))
}

/// [`bwd_source_for`] with, at head_dim 128, the main kernels of the query steps in `wide`
/// (`(without the causal mask, with it)`, as [`BwdEnv::wide`]): `attn_bwd_sm90_d128_m80` where
/// either is 80, `attn_bwd_sm90_d128` (64 queries) where either is 64, so that a process
/// compiles only what it launches. Other head dims ignore `wide`; `None` holds every kernel.
///
/// # Panics
/// For fp32.
pub fn bwd_source_wide(head_dim: Option<usize>, dtype: Dtype, wide: (usize, usize)) -> String {
    let has = |bm: usize| wide.0 == bm || wide.1 == bm;
    let select = match head_dim {
        Some(128) => {
            let mut s = "#define KP_SM90_BWD_D128".to_string();
            if has(80) {
                s.push_str("\n#define KP_SM90_BWD_M80");
            }
            if !has(64) {
                s.push_str("\n#define KP_SM90_BWD_NO_M64");
            }
            s
        }
        Some(d) => format!("#define KP_SM90_BWD_D{d}"),
        None => "#define KP_SM90_BWD_ALL".to_string(),
    };
    format!(
        "{PRELUDE_SRC}\n{}\n{WGMMA_SRC}\n{select}\n{WGMMA_BWD_SRC}\n",
        dtype_define(dtype)
    )
}

/// Keys per CTA of the wgmma backward (`BW_BN` in the kernel source).
pub const BWD_KEYS: usize = 128;
/// Query rows per step of the wgmma backward's `attn_bwd_sm90_d<head_dim>` kernel (`BwShape::BM`
/// in the kernel source): 128 at head_dim 64, 64 at 128 (where S^T and dP^T of 128 queries would
/// not fit in the registers beside dK and dV). At 128 the `_m80` kernel's 80 is the default
/// ([`BwdEnv`], [`bwd_step_queries`]).
pub fn bwd_queries(head_dim: usize) -> usize {
    if head_dim == 64 {
        128
    } else {
        64
    }
}
/// Set to `64`, `80` or `80c`: the queries per step of the wgmma backward at head_dim 128 in
/// every [`HopperBackward`] the process builds (for timing them against each other; unset:
/// [`BWD_WIDE_DEFAULT`]): `64` under both masks, `80` without the causal mask and 64 under it,
/// `80c` 80 under both. 80 is FlashAttention-3's choice without the mask (Shah et al., 2024;
/// `hopper/flash_bwd_launch_template.h`): a fifth fewer steps, barriers and dQ tiles per key
/// tile, with dQ computed transposed (the `_m80` kernel).
pub const BWD_BM_ENV: &str = "KP_SM90_BWD_BM";
/// The queries per step of the wgmma backward at head_dim 128 when [`BWD_BM_ENV`] is unset,
/// `(without the causal mask, with it)`: 80 under both, measured on an H100 on 2026-12-07 (the
/// main kernel at B4 H8 T16384 D128 without the mask 21.20 ms at 64, 19.21 at 80; causal T4096
/// MHA 0.692 and 0.658, GQA 32:8 2.779 and 2.531; kernels/TUNING.md).
pub const BWD_WIDE_DEFAULT: (usize, usize) = (80, 80);

/// What this process's environment asks of every [`HopperBackward`] it builds, read in this one
/// place (as [`FwdEnv`] for the forward), so that the kernels and the runner's account of them
/// agree.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BwdEnv {
    /// The queries per step at head_dim 128, `(without the causal mask, with it)`:
    /// [`BWD_BM_ENV`]'s (`64`: (64, 64), `80`: (80, 64), `80c`: (80, 80)), else
    /// [`BWD_WIDE_DEFAULT`].
    pub wide: (usize, usize),
    /// Whether launches take the tail split ([`bwd_tail_split`]): [`BWD_TAIL_ENV`] when it is
    /// `1` or `0`, else [`BWD_TAIL_DEFAULT`].
    pub tail_split: bool,
}

impl BwdEnv {
    /// Reads [`BWD_BM_ENV`] and [`BWD_TAIL_ENV`] (unset or another value: the defaults).
    pub fn read() -> BwdEnv {
        let wide = match std::env::var(BWD_BM_ENV).as_deref() {
            Ok("80") => (80, 64),
            Ok("80c") => (80, 80),
            Ok("64") => (64, 64),
            _ => BWD_WIDE_DEFAULT,
        };
        let tail_split = match std::env::var(BWD_TAIL_ENV).as_deref() {
            Ok("1") => true,
            Ok("0") => false,
            _ => BWD_TAIL_DEFAULT,
        };
        BwdEnv { wide, tail_split }
    }
}

/// Query rows per step of the wgmma backward for `head_dim` and the mask, `wide` being
/// [`BwdEnv::wide`]: [`bwd_queries`] except at head_dim 128, where it is `wide.0` without
/// the causal mask and `wide.1` under it (64 or 80 each).
pub fn bwd_step_queries(head_dim: usize, causal: bool, wide: (usize, usize)) -> usize {
    match (head_dim, causal) {
        (128, false) => wide.0,
        (128, true) => wide.1,
        _ => bwd_queries(head_dim),
    }
}

/// Rows of the wgmma backward's D and LSE buffers for `(batch, heads, seq_len_q)`: the query
/// rows of each (batch entry, head) padded to a whole number of steps, for every step size a
/// [`HopperBackward`] of `head_dim` may take (`wide` as in [`bwd_step_queries`]).
pub fn bwd_padded_rows(
    (batch, heads, seq_len_q): (usize, usize, usize),
    head_dim: usize,
    wide: (usize, usize),
) -> usize {
    let per = [true, false]
        .iter()
        .map(|&causal| {
            let bm = bwd_step_queries(head_dim, causal, wide);
            seq_len_q.div_ceil(bm) * bm
        })
        .max()
        .unwrap_or(0);
    batch * heads * per
}

/// Bytes of the wgmma backward's per-row fp32 buffers beyond one D per query row: D padded to
/// [`bwd_padded_rows`] and the padded copy of LSE · log2(e) the main kernel reads, for
/// `(batch, heads, seq_len_q)` at `head_dim` with the query steps `wide` ([`BwdEnv::wide`]).
pub fn bwd_row_bytes(
    (batch, heads, seq_len_q): (usize, usize, usize),
    head_dim: usize,
    wide: (usize, usize),
) -> u64 {
    let padded = bwd_padded_rows((batch, heads, seq_len_q), head_dim, wide) as u64;
    (2 * padded - (batch * heads * seq_len_q) as u64) * 4
}

/// Dynamic shared memory of the wgmma backward's main kernel at `head_dim` with `bm` queries per
/// step, bytes: K and V, the Q and dO stages (bm rows), two dS buffers (128 × bm, 16-bit), LSE
/// and D per stage (bm floats each), each consumer's fp32 dQ staging tile (64 rows × 64
/// columns: half the columns at head_dim 128 with 64 queries, half the rows at 64 with 128;
/// with 80, all 80 rows × 64 columns), the mbarriers, and up to 1023 bytes to align the base
/// (`BwPlan::BYTES` + 1024 in the kernel source).
pub fn bwd_smem_bytes(head_dim: usize, bm: usize) -> usize {
    let dq_tile = match bm {
        64 => 64 * (head_dim / 2),
        80 => 80 * 64,
        _ => 64 * head_dim,
    };
    2 * BWD_KEYS * head_dim * 2
        + 2 * BWD_STAGES * bm * head_dim * 2
        + 2 * BWD_KEYS * bm * 2
        + 2 * bm * 4 * BWD_STAGES
        + 2 * dq_tile * 4
        + 8 * (1 + 2 * BWD_STAGES)
        + 1024
}

/// Q and dO stages of the wgmma backward (`BW_ST`).
pub const BWD_STAGES: usize = 2;

/// The SM count [`bwd_head_splits`] plans for: the H200's 132 (one CTA of the wgmma backward
/// fits per SM). A constant rather than the device's count, so that the temporaries a case
/// needs ([`bwd_split_bytes`]) follow from its shape alone.
pub const BWD_SPLIT_SMS: usize = 132;
/// The most CTAs one (128-key tile, kv head, batch entry) is split into.
pub const BWD_MAX_SPLITS: usize = 4;

/// How many CTAs the wgmma backward deals each (128-key tile, kv head, batch entry)'s query
/// heads out to: 1 (every query head of the group in one CTA, dK and dV in its registers)
/// unless the group has at least 2 heads and the grid is small against [`BWD_SPLIT_SMS`]:
/// - causal: fewer than two waves (264 CTAs) get enough splits to reach two. The work of a key
///   tile's CTA grows with the queries that see it, so in one wave the first key tile's CTA
///   sets the time; MQA is the case: at B4 H8:1 T4096, 32 key tiles × 1 kv head × 4 is 128
///   CTAs, and the first walks all 4,096 queries of 8 heads while the last walks 128 (measured
///   0.63× of cuDNN, kernels/TUNING.md). Split 3 ways, each CTA walks 2 or 3 heads.
/// - not causal (every CTA the same work): as many splits as still fit one wave, so a grid of
///   128 stays whole (two waves would only add the combine) and one of 32 becomes 128.
///
/// At most the group size and [`BWD_MAX_SPLITS`]. Each split's fp32 partial dK and dV go to
/// their own slice of a buffer ([`bwd_split_bytes`]), summed in slice order by
/// `attn_bwd_sm90_dkv_combine`, so dK and dV stay deterministic.
pub fn bwd_head_splits(
    batch: usize,
    heads: usize,
    kv_heads: usize,
    seq_len_kv: usize,
    causal: bool,
) -> usize {
    if kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
        return 1;
    }
    let group = heads / kv_heads;
    let ctas = seq_len_kv.div_ceil(BWD_KEYS) * kv_heads * batch;
    if group < 2 || ctas == 0 {
        return 1;
    }
    let splits = if !causal {
        BWD_SPLIT_SMS / ctas
    } else if ctas >= 2 * BWD_SPLIT_SMS {
        1
    } else {
        (2 * BWD_SPLIT_SMS).div_ceil(ctas)
    };
    splits.clamp(1, group.min(BWD_MAX_SPLITS))
}

/// Set to `1` or `0`, turns the wgmma backward's tail split ([`bwd_tail_split`]) on or off in
/// every [`HopperBackward`] the process builds (for timing it against the unsplit grid; unset:
/// [`BWD_TAIL_DEFAULT`]).
pub const BWD_TAIL_ENV: &str = "KP_SM90_BWD_TAIL";
/// Whether the wgmma backward takes its tail split when [`BWD_TAIL_ENV`] is unset: yes,
/// measured on an H100 on 2026-12-07 (the main kernel at B4 H8 T16384 D128 without the mask,
/// 16 parts for the last wave's 4 CTAs: 21.20 → 20.47 ms at 64 queries a step, 19.21 → 18.71
/// at 80; kernels/TUNING.md).
pub const BWD_TAIL_DEFAULT: bool = true;

/// Most parts [`bwd_tail_split`] cuts one CTA's work into.
pub const BWD_TAIL_MAX_PARTS: usize = 16;
/// Fewest query steps per part of a CTA [`bwd_tail_split`] cuts.
pub const BWD_TAIL_MIN_STEPS: usize = 4;

/// The wgmma backward's tail split for a grid of `ctas` CTAs (one per SM, [`BWD_SPLIT_SMS`] a
/// wave) of `steps` query steps each: `Some((whole, parts))` when the grid is not causal, its
/// heads are not split (`splits` = 1), its last wave is short (`tail = ctas % sms` CTAs) and
/// `parts = min(sms / tail, BWD_TAIL_MAX_PARTS, steps / BWD_TAIL_MIN_STEPS)` is at least 2:
/// CTAs `0 .. whole = ctas - tail` run as before, and each of the last `tail` runs as `parts`
/// CTAs over a contiguous share of its steps, writing fp32 partial dK and dV that a combine adds
/// in part order (flash-decoding's split applied to the keys' tiles of the last wave, as
/// [`fwd_tail_split`] does for the forward's query tiles). `None` otherwise. Under the causal
/// mask the CTAs differ in work and start longest first, so the tail is short already.
pub fn bwd_tail_split(
    ctas: usize,
    steps: usize,
    causal: bool,
    splits: usize,
) -> Option<(usize, usize)> {
    let sms = BWD_SPLIT_SMS;
    let tail = ctas % sms;
    if causal || splits != 1 || tail == 0 {
        return None;
    }
    let parts = (sms / tail)
        .min(BWD_TAIL_MAX_PARTS)
        .min(steps / BWD_TAIL_MIN_STEPS);
    (parts >= 2).then_some((ctas - tail, parts))
}

/// The wgmma backward's grid for a shape and `bm` queries per step: `(ctas, steps, splits)`, the
/// CTAs of one (128-key tile, kv head · split, batch entry) each, the query steps of one CTA
/// whose keys are all valid without the causal mask, and [`bwd_head_splits`].
pub fn bwd_grid(
    (batch, heads, kv_heads): (usize, usize, usize),
    (seq_len_q, seq_len_kv): (usize, usize),
    causal: bool,
    bm: usize,
) -> (usize, usize, usize) {
    let splits = bwd_head_splits(batch, heads, kv_heads, seq_len_kv, causal);
    let ctas = seq_len_kv
        .div_ceil(BWD_KEYS)
        .saturating_mul(kv_heads * splits)
        .saturating_mul(batch);
    let group = heads / kv_heads.max(1);
    let steps = seq_len_q.div_ceil(bm.max(1)) * group.div_ceil(splits.max(1));
    (ctas, steps, splits)
}

/// Bytes of the wgmma backward's tail-split buffer for a shape at `head_dim` (the partial dK and
/// dV of every part, fp32, 128 keys × head_dim each) with the split on: 0 where
/// [`bwd_tail_split`] does not split. `wide` as in [`bwd_step_queries`].
pub fn bwd_tail_bytes(
    (batch, heads, kv_heads): (usize, usize, usize),
    (seq_len_q, seq_len_kv): (usize, usize),
    head_dim: usize,
    causal: bool,
    wide: (usize, usize),
) -> u64 {
    let bm = bwd_step_queries(head_dim, causal, wide);
    let (ctas, steps, splits) = bwd_grid(
        (batch, heads, kv_heads),
        (seq_len_q, seq_len_kv),
        causal,
        bm,
    );
    bwd_tail_split(ctas, steps, causal, splits).map_or(0, |split| {
        (bwd_tail_floats(ctas, split, head_dim) * 4) as u64
    })
}

/// fp32 values of the tail-split buffer for a grid of `ctas` CTAs split as `(whole, parts)`
/// ([`bwd_tail_split`]): every part of every tail CTA's partial dK and dV, 128 keys × head_dim
/// each.
fn bwd_tail_floats(ctas: usize, (whole, parts): (usize, usize), head_dim: usize) -> usize {
    (ctas - whole) * parts * 2 * BWD_KEYS * head_dim
}

/// Bytes of the wgmma backward's split buffer for a shape: `splits · 2 · batch · kv_heads ·
/// seq_len_kv · head_dim` fp32 values (a partial dK and dV per split) where
/// [`bwd_head_splits`] is above 1, else 0.
pub fn bwd_split_bytes(
    batch: usize,
    heads: usize,
    kv_heads: usize,
    seq_len_kv: usize,
    head_dim: usize,
    causal: bool,
) -> u64 {
    match bwd_head_splits(batch, heads, kv_heads, seq_len_kv, causal) {
        1 => 0,
        s => (s * 2 * batch * kv_heads * seq_len_kv * head_dim * 4) as u64,
    }
}

/// The order in which the wgmma backward's CTAs start (`kernels/attn_wgmma_bwd_sm90.cu`, CTA
/// order): how a CTA's index in its 1-D grid maps to its (128-key tile, kv head · split, batch
/// entry). The hardware starts CTAs in index order as SMs free up, so under the causal mask,
/// where the first key tiles' CTAs have the most queries, the order sets how long the grid's
/// tail is. A *pair* below is one (kv head · split, batch entry): the CTAs that share its Q
/// and dO.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BwdCtaOrder {
    /// Key tiles fastest: a pair's CTAs start together and share its Q and dO in L2.
    KeyTilesFastest = 0,
    /// Key tiles slowest: every CTA of key tile 0 starts before any of tile 1 (longest
    /// processing time first, the list-scheduling rule whose tail is the shortest jobs).
    KeyTilesSlowest = 1,
    /// Batch entries slowest, then key tiles: longest first within each batch entry.
    BatchThenKeyTiles = 2,
    /// Pairs in chunks of [`bwd_chunk`] (the last one may be smaller), the chunks one after
    /// the other, key tiles slowest within a chunk: longest first where it sets the tail, while
    /// only a chunk's pairs share L2 at a time.
    KeyTilesSlowestInChunks = 3,
}

impl BwdCtaOrder {
    /// Every order, for probes that compare them.
    pub const ALL: [BwdCtaOrder; 4] = [
        BwdCtaOrder::KeyTilesFastest,
        BwdCtaOrder::KeyTilesSlowest,
        BwdCtaOrder::BatchThenKeyTiles,
        BwdCtaOrder::KeyTilesSlowestInChunks,
    ];
}

/// The most CTAs [`bwd_chunk`] simulates a schedule of; larger grids keep
/// [`BwdCtaOrder::KeyTilesFastest`] (their heaviest CTA is a small part of an SM's share).
pub const BWD_SCHEDULE_MAX_CTAS: usize = 1 << 15;

/// The work of each CTA of the wgmma backward's main kernel under the causal mask, in (query
/// head, query step) steps of `bm` queries (the launch's [`bwd_step_queries`]: 128 at head_dim
/// 64, 80 or 64 at 128) plus one for its K/V load and dK/dV store, indexed by key tile ·
/// splits plus split, for `(heads, kv_heads)`, `(seq_len_q, seq_len_kv)` and `splits` splits of
/// a kv head's query heads: every key of the tile valid (seq_len_kv for every batch entry; per-entry
/// key lengths are not modelled), bottom-right causal as the kernel masks (a last partial step
/// is a whole step, as in the kernel). Until 2026-12-07 this counted steps of 64 at head_dim
/// 128 whatever the launch took; with steps of 80 the orders of the shapes measured that day
/// (B4 causal MHA H8 T1024-16384, GQA 32:8 and MQA 8:1 at T4096) are the same either way.
///
/// # Panics
/// For `bm` = 0.
pub fn bwd_causal_cta_work(
    (heads, kv_heads): (usize, usize),
    (seq_len_q, seq_len_kv): (usize, usize),
    bm: usize,
    splits: usize,
) -> Vec<usize> {
    let n_kt = seq_len_kv.div_ceil(BWD_KEYS);
    let n_qt = seq_len_q.div_ceil(bm);
    let off = seq_len_kv as isize - seq_len_q as isize;
    let group = heads / kv_heads.max(1);
    (0..n_kt)
        .flat_map(|kt| {
            let i_min = ((kt * BWD_KEYS) as isize - off).max(0) as usize;
            let per_head = n_qt.saturating_sub(i_min / bm);
            (0..splits).map(move |sp| {
                let heads_here = (sp + 1) * group / splits - sp * group / splits;
                per_head * heads_here + 1
            })
        })
        .collect()
}

/// The (query tile, head, batch entry) of CTA `i` (launch order, x fastest) of the causal wgmma
/// forward V3 to V5 on its (`qtiles`, `heads`, `batch`) grid in chunks of `chunk` (head, batch
/// entry) pairs, as `attn_fwd_sm90_ws` maps it: the pairs `b · heads + h` in consecutive chunks
/// (the last may be smaller), and within a chunk the query tiles slowest and from the last (the
/// most keys under the causal mask) down, so each chunk's heaviest tiles start first and its
/// lightest last (list scheduling's longest-first rule; [`makespan`] simulates it). `chunk` 1 is
/// each head's tiles heaviest first, a head at a time; `heads · batch`, the whole grid's
/// heaviest first. `i` must be below `qtiles · heads · batch` and `chunk` at least 1.
pub fn fwd_causal_tile(
    i: usize,
    (qtiles, heads, batch): (usize, usize, usize),
    chunk: usize,
) -> (usize, usize, usize) {
    let hb = heads * batch;
    let c0 = i / (qtiles * chunk) * chunk;
    let g = chunk.min(hb - c0);
    let j = i - c0 * qtiles;
    let pair = c0 + j % g;
    (qtiles - 1 - j / g, pair % heads, pair / heads)
}

/// The chunk size [`HopperForward`] runs the causal forward in ([`fwd_causal_tile`]) for
/// `qtiles` query tiles of `rows` rows, `pairs` (head, batch entry) pairs, `(seq_len_q,
/// seq_len_kv)` (bottom-right causal) on `sms` SMs, where one pair's K and V take `pair_bytes`
/// and at most `l2_budget` bytes of them should be in flight: of the candidates (1, 2, 3, 4, 6,
/// 8, 12, 16, 24, 32, 48, 64 and all pairs) that keep `chunk · pair_bytes` within the budget
/// (1 always), the smallest whose simulated makespan ([`makespan`], a CTA's work its key tiles
/// plus one for its prologue and epilogue) is within 0.5 % of the best. Measured on an H100
/// (2026-12-06, kernels/TUNING.md): the whole grid heaviest first took D64 T4096 B4 H8 13 %
/// under a head at a time; at D128 T16384 it once took 36 % over it (not seen again in a
/// second call), which the L2 budget is there for (32 heads' K and V are 256 MB against a 50 MB
/// L2, a head at a time 8 MB): a hypothesis, not a measurement. Grids of more than
/// [`BWD_SCHEDULE_MAX_CTAS`] CTAs are not simulated: the largest chunk the budget allows.
pub fn fwd_causal_chunk(
    (qtiles, rows): (usize, usize),
    pairs: usize,
    (seq_len_q, seq_len_kv): (usize, usize),
    sms: usize,
    (pair_bytes, l2_budget): (usize, usize),
) -> usize {
    let fits = |c: usize| c == 1 || c * pair_bytes <= l2_budget;
    let mut candidates: Vec<usize> = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
        .into_iter()
        .filter(|&c| c < pairs && fits(c))
        .collect();
    if pairs > 0 && fits(pairs) {
        candidates.push(pairs);
    }
    if qtiles * pairs > BWD_SCHEDULE_MAX_CTAS {
        return candidates.last().copied().unwrap_or(1);
    }
    let n_kt = seq_len_kv.div_ceil(WS_KEYS);
    let off = seq_len_kv as isize - seq_len_q as isize;
    let work = |q: usize| {
        let last = (((q + 1) * rows).min(seq_len_q) as isize - 1 + off).max(-1);
        (((last + 1) as usize).div_ceil(WS_KEYS)).min(n_kt) + 1
    };
    let span = |c: usize| {
        makespan(
            (0..qtiles * pairs).map(|i| work(fwd_causal_tile(i, (qtiles, pairs, 1), c).0)),
            sms,
        )
    };
    let spans: Vec<(usize, usize)> = candidates.into_iter().map(|c| (c, span(c))).collect();
    smallest_near_best(spans).map_or(1, |(c, _)| c)
}

/// When the last CTA of `work` (in launch order) ends on `sms` SMs that each take the next CTA
/// as they free up (list scheduling, one CTA per SM at a time, as the wgmma backward runs).
pub fn makespan(work: impl IntoIterator<Item = usize>, sms: usize) -> usize {
    use std::cmp::Reverse;
    let mut free: std::collections::BinaryHeap<Reverse<usize>> =
        (0..sms.max(1)).map(|_| Reverse(0)).collect();
    for w in work {
        let Reverse(t) = free.pop().unwrap_or(Reverse(0));
        free.push(Reverse(t + w));
    }
    free.into_iter().map(|Reverse(t)| t).max().unwrap_or(0)
}

/// The (key tile, kv head · split, batch entry) of CTA `i` of the wgmma backward's main kernel
/// in `order` (`attn_bwd_sm90`'s first lines, mirrored), for `n_kt` key tiles, `n_y` kv heads ·
/// splits, `batch` entries and chunks of `chunk` pairs ([`BwdCtaOrder::KeyTilesSlowestInChunks`]
/// only; 0 counts as 1, more than `n_y · batch` as one chunk of all). `i` must be below `n_kt ·
/// n_y · batch` (all three nonzero): past it the result means nothing (the kernel is never
/// launched with such a CTA).
/// The host passes the kernel 1 ≤ chunk ≤ `n_y · batch` (the kernel divides by it).
pub fn bwd_cta_coords(
    order: BwdCtaOrder,
    chunk: usize,
    i: usize,
    (n_kt, n_y, batch): (usize, usize, usize),
) -> (usize, usize, usize) {
    match order {
        BwdCtaOrder::KeyTilesFastest => (i % n_kt, (i / n_kt) % n_y, i / n_kt / n_y),
        BwdCtaOrder::KeyTilesSlowest => (i / n_y / batch, i % n_y, (i / n_y) % batch),
        BwdCtaOrder::BatchThenKeyTiles => ((i / n_y) % n_kt, i % n_y, i / n_y / n_kt),
        BwdCtaOrder::KeyTilesSlowestInChunks => {
            let chunk = chunk.max(1);
            let (ch, r) = (i / (chunk * n_kt), i % (chunk * n_kt));
            let first = ch * chunk;
            let here = chunk.min(n_y * batch - first);
            let p = first + r % here;
            (r / here, p % n_y, p / n_y)
        }
    }
}

/// The simulated makespan ([`makespan`] on [`BWD_SPLIT_SMS`] SMs) of the wgmma backward's main
/// kernel whose CTAs have the work `work` ([`bwd_causal_cta_work`] for `splits` splits) and
/// start in `order` (chunks of `chunk` pairs for [`BwdCtaOrder::KeyTilesSlowestInChunks`]) on a
/// grid of `(n_kt, n_y, batch)` ([`bwd_cta_coords`]).
pub fn bwd_order_makespan(
    work: &[usize],
    splits: usize,
    dims: (usize, usize, usize),
    order: BwdCtaOrder,
    chunk: usize,
) -> usize {
    let (n_kt, n_y, batch) = dims;
    makespan(
        (0..n_kt * n_y * batch).map(|i| {
            let (kt, y, _) = bwd_cta_coords(order, chunk, i, dims);
            work[kt * splits + y % splits]
        }),
        BWD_SPLIT_SMS,
    )
}

/// The fewest pairs in a chunk of [`BwdCtaOrder::KeyTilesSlowestInChunks`] (unless the grid
/// has fewer): on the H200, B4 H8 T8192 D128 causal forward + backward took 4.046 ms in chunks
/// of 2 and 3.991 in chunks of 4, whose simulated makespans are equal (1026 and 1025 steps;
/// on an H100 chunks of 2 were 4 % slower than key tiles fastest there), and at T4096 chunks of
/// 2, 3 and 6 measured as badly as their simulated makespans say (kernels/TUNING.md).
pub const BWD_MIN_CHUNK: usize = 4;

/// The chunk size of [`BwdCtaOrder::KeyTilesSlowestInChunks`] for a causal shape (`batch`,
/// `heads`, `kv_heads`, `(seq_len_q, seq_len_kv)`, `bm` queries a step), and the simulated
/// makespans (in
/// steps of [`bwd_causal_cta_work`],
/// [`makespan`] on [`BWD_SPLIT_SMS`] SMs) of that order and of
/// [`BwdCtaOrder::KeyTilesFastest`]: of the candidate sizes ([`BWD_MIN_CHUNK`], 5, 6, 8, 12,
/// 16, 24, 32, 48, 64 pairs and all of them) the smallest whose makespan is within 0.5 % of the
/// best (fewer pairs at a time share L2 better). Grids of more than [`BWD_SCHEDULE_MAX_CTAS`]
/// CTAs are not simulated: chunks of 1 (the key tiles fastest order), both makespans 0.
pub fn bwd_chunk(
    batch: usize,
    heads: usize,
    kv_heads: usize,
    (seq_len_q, seq_len_kv): (usize, usize),
    bm: usize,
) -> (usize, usize, usize) {
    let splits = bwd_head_splits(batch, heads, kv_heads, seq_len_kv, true);
    let n_kt = seq_len_kv.div_ceil(BWD_KEYS);
    let n_y = kv_heads * splits;
    let pairs = n_y * batch;
    if n_kt * pairs > BWD_SCHEDULE_MAX_CTAS || pairs == 0 {
        return (1, 0, 0);
    }
    let work = bwd_causal_cta_work((heads, kv_heads), (seq_len_q, seq_len_kv), bm, splits);
    let dims = (n_kt, n_y, batch);
    let span = |order, chunk| bwd_order_makespan(&work, splits, dims, order, chunk);
    let fastest = span(BwdCtaOrder::KeyTilesFastest, 1);
    let mut candidates: Vec<usize> = [BWD_MIN_CHUNK, 5, 6, 8, 12, 16, 24, 32, 48, 64]
        .into_iter()
        .filter(|&c| c < pairs)
        .collect();
    candidates.push(pairs);
    let spans: Vec<(usize, usize)> = candidates
        .into_iter()
        .map(|c| (c, span(BwdCtaOrder::KeyTilesSlowestInChunks, c)))
        .collect();
    let (chunk, m) = smallest_near_best(spans).unwrap_or((1, fastest));
    (chunk, m, fastest)
}

/// The first of `spans` ((chunk size, simulated makespan), smallest chunk first) whose makespan
/// is within 0.5 % of the least of them: the smallest chunk that balances about as well as the
/// best (fewer pairs at a time share L2 better). `None` for no spans.
fn smallest_near_best(spans: Vec<(usize, usize)>) -> Option<(usize, usize)> {
    let best = spans.iter().map(|&(_, m)| m).min()?;
    spans.into_iter().find(|&(_, m)| m * 1000 <= best * 1005)
}

/// The CTA order and chunk size the wgmma backward runs by default for `(batch, heads,
/// kv_heads, (seq_len_q, seq_len_kv), bm, causal)` (`bm`: the launch's queries a step,
/// [`bwd_step_queries`]): not causal, every CTA has the same
/// work and [`BwdCtaOrder::KeyTilesFastest`] keeps a pair's CTAs together in L2; causal,
/// [`BwdCtaOrder::KeyTilesSlowestInChunks`] with [`bwd_chunk`]'s size where its simulated
/// makespan is at least 2 % under key tiles fastest's, else key tiles fastest. Measured
/// (kernels/TUNING.md): at causal MQA B4 H8:1 T4096 (3 splits, 384 CTAs) list scheduling ends
/// after 184 head-tile steps of 128 queries with key tiles fastest and 133 slowest (the model
/// before [`bwd_causal_cta_work`]'s, which counts 371 and 269), and forward + backward
/// went from 1.370 to 1.181 ms on an H100; at GQA B4 H32:8 key tiles slowest (every pair at
/// once, 256 MB of Q and dO against a 50 MB L2) measured 13 % slower than fastest there, and
/// chunks of 4 pairs 0.4 % faster than fastest (4.442 against 4.459 ms; on the H200 4.208
/// against 4.296); in the runner, causal T4096 forward + backward 5–6 % faster than with key
/// tiles fastest (MHA H8 D128 1.207 → 1.149 ms, D64 0.761 → 0.712, GQA 4.665 → 4.378).
pub fn bwd_cta_order(
    batch: usize,
    heads: usize,
    kv_heads: usize,
    lens: (usize, usize),
    bm: usize,
    causal: bool,
) -> (BwdCtaOrder, usize) {
    if !causal {
        return (BwdCtaOrder::KeyTilesFastest, 1);
    }
    let (chunk, chunked, fastest) = bwd_chunk(batch, heads, kv_heads, lens, bm);
    // Both makespans are 0 for a grid too large to simulate: key tiles fastest.
    if fastest > 0 && chunked * 100 <= fastest * 98 {
        (BwdCtaOrder::KeyTilesSlowestInChunks, chunk)
    } else {
        (BwdCtaOrder::KeyTilesFastest, 1)
    }
}

/// A backward launch's `(batch, heads, kv_heads, seq_len_q, seq_len_kv, causal)`.
type BwdShape = (usize, usize, usize, usize, usize, bool);

/// The attention backward on wgmma (issue 11; `kernels/attn_wgmma_bwd_sm90.cu` says how): bf16,
/// head_dim 64 or 128, the shapes and masks of [`HopperForward`], after a forward that wrote O
/// and its log-sum-exp (natural log, +∞ for a row that sees no key; either forward). dQ `[batch,
/// heads, seq_len_q, head_dim]`, dK and dV `[batch, kv_heads, seq_len_kv, head_dim]`, the
/// gradients of `sum(dO ∘ O)`. FlashAttention-2's algorithm (Dao, 2023) with FlashAttention-3's
/// warp specialisation (Shah et al., 2024): one CTA per 128 keys keeps dK and dV in registers,
/// dQ is summed over key tiles in fp32 by TMA reduce-adds (their order, and so possibly dQ's
/// last bit, varies from run to run; dK and dV do not). Where that grid would be small (MQA,
/// few key tiles) a kv head's query heads are split over up to [`BWD_MAX_SPLITS`] CTAs per key
/// tile ([`bwd_head_splits`]), their partial dK and dV added in a fixed order by a fourth
/// kernel.
pub struct HopperBackward {
    pre: CudaFunction,
    /// The main kernel of [`bwd_queries`] queries per step and its shared memory, where this
    /// backward takes them (always at head_dim 64; at 128 per [`BwdEnv::wide`]).
    main: Option<(CudaFunction, u32)>,
    convert: CudaFunction,
    combine: CudaFunction,
    /// The split buffer ([`bwd_split_bytes`]), allocated by the first launch of a shape that
    /// splits and kept (grown when a later shape needs more).
    part: Option<CudaSlice<f32>>,
    /// The main kernel of 80 queries per step and its shared memory, where this backward takes
    /// them at head_dim 128 ([`BwdEnv::wide`]).
    main_m80: Option<(CudaFunction, u32)>,
    /// [`BwdEnv::wide`] when this backward was built.
    wide: (usize, usize),
    /// Whether launches take the tail split ([`BwdEnv::tail_split`]), its combine, and its buffer
    /// (allocated by the first launch that splits, and kept).
    tail_on: bool,
    tail_combine: CudaFunction,
    tail_buf: Option<CudaSlice<f32>>,
    head_dim: usize,
    dtype: Dtype,
    /// The CTA order every launch uses instead of [`bwd_cta_order`]'s (probes; `None`: the
    /// rule's).
    cta_order: Option<BwdCtaOrder>,
    /// The chunk size [`BwdCtaOrder::KeyTilesSlowestInChunks`] uses instead of [`bwd_chunk`]'s
    /// (probes; `None`: the rule's).
    cta_chunk: Option<usize>,
    /// The last shape's `(batch, heads, kv_heads, seq_len_q, seq_len_kv, causal)`, its default
    /// order and chunk size, and [`bwd_chunk`]'s size where a probe forced the chunked order
    /// ([`bwd_cta_order`] and [`bwd_chunk`] simulate schedules: once per shape).
    schedule: Option<(BwdShape, (BwdCtaOrder, usize), Option<usize>)>,
    /// Events recorded around each launch's kernels ([`HopperBackward::set_stage_timing`];
    /// probes only, `None` otherwise).
    stage_events: Option<Vec<cudarc::driver::CudaEvent>>,
    /// Whether the last launch recorded all five events (false from its start until its last
    /// kernel is queued), and whether it split the heads (launched the combine).
    stage_done: bool,
    stage_split: bool,
    /// D = rowsum(dO ∘ O), fp32, [`bwd_padded_rows`] long; a launch uses `[batch · heads,
    /// seq_len_q padded to a multiple of its step]` of it.
    dsum: CudaSlice<f32>,
    /// LSE · log2(e), fp32, padded as `dsum` (+∞ in the padding).
    lse2: CudaSlice<f32>,
    /// The fp32 dQ accumulator, `[batch, heads, seq_len_q, head_dim]`.
    dqacc: CudaSlice<f32>,
    /// NVRTC compile + load time, s.
    pub compile_s: f64,
}

impl HopperBackward {
    /// Compiles the kernels and allocates the temporaries for `(batch, heads, seq_len_q)` rows
    /// at `head_dim`.
    ///
    /// # Errors
    /// [`GpuError::Config`] on a device that is not compute capability 9.0 or a head_dim other
    /// than 64 and 128; NVRTC, driver and out-of-memory errors.
    pub fn new(
        gpu: &Gpu,
        head_dim: usize,
        rows: (usize, usize, usize),
    ) -> Result<HopperBackward, GpuError> {
        HopperBackward::with_dtype(gpu, head_dim, rows, Dtype::Bf16)
    }

    /// [`HopperBackward::new`] for Q, K, V, dO and the gradients of 16-bit `dtype` (bf16 or
    /// fp16; the same kernels on `f16` operands for fp16).
    ///
    /// # Errors
    /// As [`HopperBackward::new`]; [`GpuError::Config`] for fp32.
    pub fn with_dtype(
        gpu: &Gpu,
        head_dim: usize,
        (batch, heads, seq_len_q): (usize, usize, usize),
        dtype: Dtype,
    ) -> Result<HopperBackward, GpuError> {
        check_dtype("backward", dtype)?;
        if gpu.arch() != "sm_90a" {
            return Err(GpuError::Config(format!(
                "the wgmma backward needs compute capability 9.0 (sm_90a), not {}",
                gpu.arch()
            )));
        }
        if head_dim != 64 && head_dim != 128 {
            return Err(GpuError::Config(format!(
                "the wgmma backward runs head_dim 64 or 128, not {head_dim}"
            )));
        }
        let env = BwdEnv::read();
        let wide = env.wide;
        let uses = |bm: usize| (0..2).any(|c| bwd_step_queries(head_dim, c == 1, wide) == bm);
        let m80 = uses(80);
        let src = bwd_source_wide(Some(head_dim), dtype, wide);
        let compiled = gpu.compile("attn_wgmma_bwd_sm90.cu", &src)?;
        let name = format!("attn_bwd_sm90_d{head_dim}");
        let main = if uses(bwd_queries(head_dim)) {
            let smem = bwd_smem_bytes(head_dim, bwd_queries(head_dim)) as u32;
            super::cuda::check_smem(gpu, &name, smem)?;
            Some((gpu.function(&compiled.module, &name, smem)?, smem))
        } else {
            None
        };
        let main_m80 = if m80 {
            let name = format!("{name}_m80");
            let smem = bwd_smem_bytes(head_dim, 80) as u32;
            super::cuda::check_smem(gpu, &name, smem)?;
            Some((gpu.function(&compiled.module, &name, smem)?, smem))
        } else {
            None
        };
        let padded = bwd_padded_rows((batch, heads, seq_len_q), head_dim, wide);
        Ok(HopperBackward {
            wide,
            tail_on: env.tail_split,
            tail_combine: gpu.function(
                &compiled.module,
                &format!("attn_bwd_sm90_tail_combine_d{head_dim}"),
                0,
            )?,
            tail_buf: None,
            pre: gpu.function(
                &compiled.module,
                &format!("attn_bwd_sm90_pre_d{head_dim}"),
                0,
            )?,
            convert: gpu.function(&compiled.module, "attn_bwd_sm90_dq_convert", 0)?,
            combine: gpu.function(&compiled.module, "attn_bwd_sm90_dkv_combine", 0)?,
            part: None,
            main,
            main_m80,
            head_dim,
            dtype,
            cta_order: None,
            cta_chunk: None,
            schedule: None,
            stage_events: None,
            stage_done: false,
            stage_split: false,
            // SAFETY: the preprocessing kernel writes all three before the main kernel reads
            // them.
            dsum: unsafe { gpu.stream.alloc::<f32>(padded)? },
            lse2: unsafe { gpu.stream.alloc::<f32>(padded)? },
            dqacc: unsafe {
                gpu.stream
                    .alloc::<f32>(batch * heads * seq_len_q * head_dim)?
            },
            compile_s: compiled.compile_s,
        })
    }

    /// Bytes of the per-row buffers this backward holds beyond the `seq_len_q` rows of D that
    /// [`super::cuda::Implementation::temporary_bytes`] counts for every backward: D's padding
    /// to whole query steps ([`bwd_padded_rows`]) and the padded copy of LSE · log2(e), both
    /// fp32, for `(batch, heads, seq_len_q)`.
    pub fn row_bytes(&self, rows: (usize, usize, usize)) -> u64 {
        bwd_row_bytes(rows, self.head_dim, self.wide)
    }

    /// Bytes of the tail-split buffer a launch of this backward uses for the shape
    /// ([`bwd_tail_bytes`]; 0 with the split off).
    pub fn tail_bytes(
        &self,
        (batch, heads, kv_heads): (usize, usize, usize),
        (seq_len_q, seq_len_kv): (usize, usize),
        causal: bool,
    ) -> u64 {
        if !self.tail_on {
            return 0;
        }
        bwd_tail_bytes(
            (batch, heads, kv_heads),
            (seq_len_q, seq_len_kv),
            self.head_dim,
            causal,
            self.wide,
        )
    }

    /// Makes every later launch start its main kernel's CTAs in `order` (`None`: the default,
    /// [`bwd_cta_order`]), for probes that time the orders against each other
    /// ([`BwdCtaOrder::KeyTilesSlowestInChunks`] in [`bwd_chunk`]'s chunks). dK and dV do not
    /// depend on the order (each CTA's sums are its own); dQ's reduce-adds may land in another
    /// order.
    pub fn set_cta_order(&mut self, order: Option<BwdCtaOrder>) {
        self.cta_order = order;
    }

    /// Makes [`BwdCtaOrder::KeyTilesSlowestInChunks`], when [`HopperBackward::set_cta_order`]
    /// picks it, use chunks of `chunk` pairs (`None`: [`bwd_chunk`]'s size; a chunk of more
    /// pairs than the grid has is one chunk of all), for probes that sweep the size.
    pub fn set_cta_chunk(&mut self, chunk: Option<usize>) {
        self.cta_chunk = chunk;
    }

    /// Makes every later launch record events before and after each of its kernels (`on`), or
    /// stop doing so, for probes that ask where the backward's time goes
    /// ([`HopperBackward::stage_ms`]). Not for launches captured into a CUDA graph: events
    /// recorded during a capture become the graph's dependencies and carry no time, so
    /// `stage_ms` fails on them (the runner's graph replay never turns this on).
    ///
    /// # Errors
    /// The driver's, creating the events.
    pub fn set_stage_timing(&mut self, gpu: &Gpu, on: bool) -> Result<(), GpuError> {
        let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        // Five events: before the preprocessing, then after each of the four kernels.
        self.stage_events = if on {
            Some(
                (0..5)
                    .map(|_| gpu.ctx.new_event(flags))
                    .collect::<Result<_, _>>()?,
            )
        } else {
            None
        };
        self.stage_done = false;
        Ok(())
    }

    /// The device time of the last launch's kernels, ms, once it has finished (waits for it):
    /// the preprocessing (D = rowsum(dO ∘ O), LSE scaled, dQ's accumulator zeroed), the main
    /// kernel (dK, dV, dQ's reduce-adds), the split's combine (exactly 0 where the launch did
    /// not split) and dQ's conversion. Each span runs from one event to the next, so it also
    /// holds any gap between the kernels (the host encodes the tensor maps after the
    /// preprocessing is queued: hidden while the GPU is busy with earlier work). `None` unless
    /// [`HopperBackward::set_stage_timing`] is on.
    ///
    /// # Errors
    /// [`GpuError::Config`] when no launch since timing was turned on reached its last kernel
    /// (one that failed midway leaves no times); the driver's, reading the events.
    pub fn stage_ms(&self) -> Result<Option<BwdStageMs>, GpuError> {
        let Some(ev) = &self.stage_events else {
            return Ok(None);
        };
        if !self.stage_done {
            return Err(GpuError::Config(
                "wgmma backward stage times: no launch completed since timing was turned on".into(),
            ));
        }
        let span = |a: usize, b: usize| ev[a].elapsed_ms(&ev[b]);
        Ok(Some(BwdStageMs {
            preprocess: span(0, 1)?,
            main: span(1, 2)?,
            combine: if self.stage_split { span(2, 3)? } else { 0.0 },
            dq_convert: span(3, 4)?,
        }))
    }

    /// Launches the backward on the stream: `shape` is (batch, heads, kv_heads, seq_len_q,
    /// seq_len_kv) as at [`HopperBackward::new`], `o` and `lse` the forward's, `dout` dO (like
    /// Q), `grads` = dQ, dK, dV.
    ///
    /// # Errors
    /// [`GpuError::Config`] for a shape other than the one allocated for, an empty dimension,
    /// heads not a multiple of kv_heads, a buffer whose length does not fit, a grid past the
    /// device's limits (more than 2^31 − 1 CTAs, 2^27 padded rows), a
    /// non-positive or non-finite scale; driver errors.
    #[allow(clippy::too_many_arguments)]
    pub fn launch(
        &mut self,
        gpu: &Gpu,
        (batch, heads, kv_heads, seq_len_q, seq_len_kv): (usize, usize, usize, usize, usize),
        (q, k, v, dout): (
            &CudaSlice<u16>,
            &CudaSlice<u16>,
            &CudaSlice<u16>,
            &CudaSlice<u16>,
        ),
        kv_lens: &CudaSlice<i32>,
        causal: bool,
        scale: f64,
        (o, lse): (&CudaSlice<u16>, &CudaSlice<f32>),
        [dq, dk, dv]: [&mut CudaSlice<u16>; 3],
    ) -> Result<(), GpuError> {
        let d = self.head_dim;
        let rows = batch * heads * seq_len_q;
        let wide = self.wide;
        let bm = bwd_step_queries(d, causal, wide);
        let (main, smem) = match (&self.main_m80, &self.main, bm) {
            (Some((f, s)), _, 80) => (f, *s),
            (_, Some((f, s)), b) if b == bwd_queries(d) => (f, *s),
            _ => unreachable!("new() loads the kernel of every step size `wide` takes"),
        };
        let padded = bwd_padded_rows((batch, heads, seq_len_q), d, wide);
        let (q_len, kv_len) = (rows * d, batch * kv_heads * seq_len_kv * d);
        if batch == 0
            || heads == 0
            || seq_len_q == 0
            || kv_heads == 0
            || heads % kv_heads != 0
            || seq_len_kv == 0
            || self.dqacc.len() != q_len
            || self.dsum.len() != padded
            || [q.len(), dout.len(), o.len(), dq.len()] != [q_len; 4]
            || [k.len(), v.len(), dk.len(), dv.len()] != [kv_len; 4]
            || lse.len() != rows
            || kv_lens.len() != batch
        {
            return Err(GpuError::Config(format!(
                "wgmma backward: batch {batch}, heads {heads}, kv_heads {kv_heads}, seq_len_q \
                 {seq_len_q}, seq_len_kv {seq_len_kv} do not fit the buffers (q {}, k {}, dO {}, \
                 lse {}, accumulator {})",
                q.len(),
                k.len(),
                dout.len(),
                lse.len(),
                self.dqacc.len()
            )));
        }
        if !(scale > 0.0 && scale.is_finite()) {
            return Err(GpuError::Config(format!(
                "the wgmma backward takes a positive finite scale, not {scale}"
            )));
        }
        // The preprocessing kernel numbers its threads (32 per padded row) in 32 bits, and the
        // main kernel's 1-D grid holds key tiles × kv heads · splits × batch CTAs.
        let (ctas, steps, splits) = bwd_grid(
            (batch, heads, kv_heads),
            (seq_len_q, seq_len_kv),
            causal,
            bm,
        );
        // The tail split: CTAs `whole ..` of the grid run as `parts` CTAs each.
        let tail = if self.tail_on {
            bwd_tail_split(ctas, steps, causal, splits)
        } else {
            None
        };
        let grid = tail.map_or(ctas, |(whole, parts)| whole + (ctas - whole) * parts);
        if padded.saturating_mul(32) > u32::MAX as usize
            || grid > i32::MAX as usize
            || seq_len_kv > i32::MAX as usize
        {
            return Err(GpuError::Config(format!(
                "wgmma backward: {padded} padded query rows, {ctas} CTAs ({kv_heads} kv heads × \
                 {splits} splits, batch {batch}, seq_len_kv {seq_len_kv}): past the kernels' \
                 index and grid limits"
            )));
        }
        let shape = (batch, heads, kv_heads, seq_len_q, seq_len_kv, causal);
        if !matches!(self.schedule, Some((s, _, _)) if s == shape) {
            let rule = bwd_cta_order(batch, heads, kv_heads, (seq_len_q, seq_len_kv), bm, causal);
            self.schedule = Some((shape, rule, None));
        }
        let Some((_, (rule, rule_chunk), simulated)) = &mut self.schedule else {
            unreachable!("filled above")
        };
        let (order, chunk) = match self.cta_order {
            None => (*rule, *rule_chunk),
            Some(BwdCtaOrder::KeyTilesSlowestInChunks) => (
                BwdCtaOrder::KeyTilesSlowestInChunks,
                match self.cta_chunk {
                    Some(c) => c,
                    None => *simulated.get_or_insert_with(|| {
                        bwd_chunk(batch, heads, kv_heads, (seq_len_q, seq_len_kv), bm).0
                    }),
                }
                .clamp(1, kv_heads * splits * batch),
            ),
            Some(o) => (o, 1),
        };
        let (tq, tkv, h, kvh) = (
            seq_len_q as i32,
            seq_len_kv as i32,
            heads as i32,
            kv_heads as i32,
        );
        let tq_pad = (seq_len_q.div_ceil(bm) * bm) as i32;
        // The rows this launch's step size pads to (the buffers may hold more: the other size's).
        let used = batch * heads * seq_len_q.div_ceil(bm) * bm;
        let scale_log2 = (scale * std::f64::consts::LOG2_E) as f32;
        let scale_f = scale as f32;
        // The main kernel's CTA layout, which the tail combine maps back to tiles the same way.
        let (batch_i, order_i) = (batch as i32, order as i32);
        let chunk_i = chunk.min(i32::MAX as usize) as i32;
        let (tail_whole, tail_parts) = match tail {
            Some((w, p)) => (w as i32, p as i32),
            None => (ctas as i32, 1),
        };
        self.stage_done = false;
        self.stage_split = splits > 1 || tail.is_some();
        let stage = |i: usize| -> Result<(), GpuError> {
            if let Some(ev) = &self.stage_events {
                ev[i].record(&gpu.stream)?;
            }
            Ok(())
        };
        stage(0)?;
        launch_bwd_pre(
            gpu,
            &self.pre,
            (o, dout, lse),
            (&mut self.dsum, &mut self.lse2, &mut self.dqacc),
            (tq, tq_pad, used),
        )?;
        stage(1)?;
        {
            // The guards live until after the launch (as in HopperForward::launch).
            let (qp, _gq) = q.device_ptr(&gpu.stream);
            let (kp, _gk) = k.device_ptr(&gpu.stream);
            let (vp, _gv) = v.device_ptr(&gpu.stream);
            let (dop, _gdo) = dout.device_ptr(&gpu.stream);
            let maps = [
                tma_map_16(qp, (batch * heads, seq_len_q, d), bm as u32, self.dtype)?,
                tma_map_16(
                    kp,
                    (batch * kv_heads, seq_len_kv, d),
                    BWD_KEYS as u32,
                    self.dtype,
                )?,
                tma_map_16(
                    vp,
                    (batch * kv_heads, seq_len_kv, d),
                    BWD_KEYS as u32,
                    self.dtype,
                )?,
                tma_map_16(dop, (batch * heads, seq_len_q, d), bm as u32, self.dtype)?,
            ];
            // The guard records the kernel's reduce-adds into dqacc on drop.
            let (dqp, _gdq) = self.dqacc.device_ptr_mut(&gpu.stream);
            // Boxes of 64 rows (32 columns), or of all bm rows with 80 queries per step.
            let dq_rows = if bm == 80 { 80 } else { 64 };
            let dq_map = tma_map_f32(dqp, (batch * heads, seq_len_q, d), dq_rows)?;
            let causal_i = i32::from(causal);
            // The split buffer where the group's heads are split (never read otherwise: 0).
            let part_len = splits * 2 * kv_len;
            if splits > 1 && self.part.as_ref().is_none_or(|p| p.len() < part_len) {
                // SAFETY: with splits > 1 every CTA writes its slice's values for every key
                // below seq_len_kv of its tile, so the main kernel writes the whole buffer
                // before the combine reads it.
                self.part = Some(unsafe { gpu.stream.alloc::<f32>(part_len)? });
            }
            let (part_ptr, _gpart) = match (&mut self.part, splits > 1) {
                (Some(p), true) => {
                    let (ptr, g) = p.device_ptr_mut(&gpu.stream);
                    (ptr, Some(g))
                }
                _ => (0u64, None),
            };
            // The tail split's buffer: every part of every tail CTA writes its whole slot.
            let tail_len = tail.map_or(0, |split| bwd_tail_floats(ctas, split, d));
            if tail_len > 0 && self.tail_buf.as_ref().is_none_or(|p| p.len() < tail_len) {
                // SAFETY: with the tail split each part CTA writes its partial dK and dV for
                // all 128 keys of its tile (zeros where it has no step), so the main kernel
                // writes the used part of the buffer before the tail combine reads it.
                self.tail_buf = Some(unsafe { gpu.stream.alloc::<f32>(tail_len)? });
            }
            let (tail_ptr, _gtail) = match (&mut self.tail_buf, tail_len > 0) {
                (Some(p), true) => {
                    let (ptr, g) = p.device_ptr_mut(&gpu.stream);
                    (ptr, Some(g))
                }
                _ => (0u64, None),
            };
            let splits_i = splits as i32;
            let mut b = gpu.stream.launch_builder(main);
            b.arg(&maps[0])
                .arg(&maps[1])
                .arg(&maps[2])
                .arg(&maps[3])
                .arg(&dq_map)
                .arg(&self.lse2)
                .arg(&self.dsum)
                .arg(kv_lens)
                .arg(&mut *dk)
                .arg(&mut *dv)
                .arg(&part_ptr)
                .arg(&splits_i)
                .arg(&tq)
                .arg(&tkv)
                .arg(&h)
                .arg(&kvh)
                .arg(&tq_pad)
                .arg(&scale_log2)
                .arg(&scale_f)
                .arg(&causal_i)
                .arg(&batch_i)
                .arg(&order_i)
                .arg(&chunk_i)
                .arg(&tail_whole)
                .arg(&tail_parts)
                .arg(&tail_ptr);
            // SAFETY: `attn_bwd_sm90_d*(TmaMap tq, TmaMap tk, TmaMap tv, TmaMap tdo, TmaMap
            // tdq, const float* lse2, const float* dsum, const int* kv_lens, u16* dK, u16* dV,
            // float* dkv_part, int splits, int Tq, int Tkv, int H, int KVH, int Tq_pad, float
            // scale_log2, float scale, int causal, int B, int order, int chunk, int tail_whole,
            // int tail_parts, float* tail_buf)`: the maps describe q, k,
            // v, dO and dqacc with the shapes checked above
            // (TMA reads and reduce-adds inside them only; reads past their ends zero-fill,
            // adds there are skipped), lse2 and dsum hold B·H·Tq_pad floats (whole slices of
            // queries-per-step floats for the bulk copies), dK and dV B·KVH·Tkv·D words,
            // kv_lens `batch` entries, dkv_part (splits > 1 only; 0 and never read otherwise)
            // splits · 2 · B·KVH·Tkv·D floats; 3 warpgroups per (128-key tile, kv head · splits,
            // batch entry) in a 1-D grid of all of them (B = batch; order a BwdCtaOrder, 1 ≤
            // chunk ≤ kv_heads · splits · batch: clamped above), splits
            // ≤ the group size (bwd_head_splits); with the tail split (splits = 1) the grid is
            // whole + (ctas − whole) · parts CTAs and tail_buf holds (ctas − whole) · parts · 2 ·
            // 128 · D floats, else tail_parts = 1 and tail_buf is 0 (never read).
            unsafe {
                b.launch(LaunchConfig {
                    grid_dim: (grid as u32, 1, 1),
                    block_dim: (384, 1, 1),
                    shared_mem_bytes: smem,
                })?
            };
        }
        stage(2)?;
        if splits > 1 {
            let part = self.part.as_ref().expect("allocated above for splits > 1");
            let (n, splits_i, scale_f) = (kv_len as u64, splits as i32, scale as f32);
            let mut b = gpu.stream.launch_builder(&self.combine);
            b.arg(part)
                .arg(&mut *dk)
                .arg(&mut *dv)
                .arg(&n)
                .arg(&splits_i)
                .arg(&scale_f);
            // SAFETY: `attn_bwd_sm90_dkv_combine(const float* part, u16* dK, u16* dV, unsigned
            // long long n, int splits, float scale)`: part holds at least splits · 2 · n floats
            // (allocated above), dK and dV n = B·KVH·Tkv·D words (checked), n even (D is); 2
            // elements per thread.
            unsafe { b.launch(two_per_thread(kv_len))? };
        }
        if let Some((whole, _)) = tail {
            let buf = self
                .tail_buf
                .as_ref()
                .expect("allocated above for the tail split");
            let mut b = gpu.stream.launch_builder(&self.tail_combine);
            b.arg(buf)
                .arg(&mut *dk)
                .arg(&mut *dv)
                .arg(&tail_whole)
                .arg(&tail_parts)
                .arg(&tkv)
                .arg(&kvh)
                .arg(&batch_i)
                .arg(&order_i)
                .arg(&chunk_i)
                .arg(&scale_f);
            // SAFETY: `attn_bwd_sm90_tail_combine_d*(const float* buf, u16* dK, u16* dV, int
            // tail_whole, int parts, int Tkv, int KVH, int B, int order, int chunk, float
            // scale)`: buf holds (ctas - whole) · parts · 2 · 128 · D floats (allocated above),
            // the main kernel's order and chunk map each tail CTA to its tile inside dK and dV
            // (B·KVH·Tkv·D words, checked; splits = 1); blockIdx.y a tail CTA, 2 elements per
            // thread over its 128 · D.
            unsafe {
                b.launch(LaunchConfig {
                    grid_dim: (
                        (BWD_KEYS * d / 2).div_ceil(256) as u32,
                        (ctas - whole) as u32,
                        1,
                    ),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                })?
            };
        }
        stage(3)?;
        let n = q_len as u64;
        let mut b = gpu.stream.launch_builder(&self.convert);
        b.arg(&self.dqacc).arg(dq).arg(&n).arg(&scale_f);
        // SAFETY: `attn_bwd_sm90_dq_convert(const float* dqacc, u16* dQ, unsigned long long n,
        // float scale)` with n = B·H·Tq·D elements in both; 2 elements per thread.
        unsafe { b.launch(two_per_thread(q_len))? };
        stage(4)?;
        self.stage_done = true;
        Ok(())
    }
}

/// Where one launch of [`HopperBackward`] spent its device time, ms (CUDA events between its
/// kernels: [`HopperBackward::stage_ms`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BwdStageMs {
    /// `attn_bwd_sm90_pre_d*`: D = rowsum(dO ∘ O), the LSE in base 2, dQ's accumulator zeroed.
    pub preprocess: f32,
    /// `attn_bwd_sm90_d*`: dK and dV (or a split's partials) and dQ's fp32 reduce-adds.
    pub main: f32,
    /// `attn_bwd_sm90_dkv_combine`: a split's partial dK, dV added and rounded (exactly 0
    /// without a split: nothing launched).
    pub combine: f32,
    /// `attn_bwd_sm90_dq_convert`: dQ scaled and rounded from its fp32 accumulator.
    pub dq_convert: f32,
}

/// The launch of an elementwise kernel over `n` elements, two per thread in blocks of 256
/// (the backward's dQ conversion and dK/dV combine).
fn two_per_thread(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(2 * 256) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::Pass;

    #[test]
    fn every_cta_order_covers_the_grid_once_and_the_causal_split_one_starts_long_ctas_first() {
        for dims in [(32, 3, 4), (1, 1, 1), (5, 2, 3), (7, 16, 1)] {
            let (n_kt, n_y, batch) = dims;
            for order in BwdCtaOrder::ALL {
                for chunk in [1, 2, 3, 5, 64] {
                    let mut seen: Vec<_> = (0..n_kt * n_y * batch)
                        .map(|i| bwd_cta_coords(order, chunk, i, dims))
                        .collect();
                    seen.sort_unstable();
                    seen.dedup();
                    assert_eq!(seen.len(), n_kt * n_y * batch, "{order:?} {chunk} {dims:?}");
                    assert!(seen
                        .iter()
                        .all(|&(k, y, b)| k < n_kt && y < n_y && b < batch));
                }
            }
            // Longest first: every CTA of key tile 0 before any of tile 1; in chunks of 2
            // pairs, the first chunk's tile 0, its tile 1, … then the next chunk's.
            let first: Vec<_> = (0..n_y * batch)
                .map(|i| bwd_cta_coords(BwdCtaOrder::KeyTilesSlowest, 1, i, dims).0)
                .collect();
            assert!(first.iter().all(|&k| k == 0), "{dims:?}");
            let chunked: Vec<_> = (0..n_kt * n_y * batch)
                .map(|i| bwd_cta_coords(BwdCtaOrder::KeyTilesSlowestInChunks, 2, i, dims))
                .collect();
            let pair = |&(_, y, b): &(usize, usize, usize)| y + n_y * b;
            let pairs = n_y * batch;
            assert!(chunked[..n_kt * 2.min(pairs)].iter().all(|c| pair(c) < 2));
            if pairs >= 2 {
                assert_eq!(
                    chunked[..4.min(n_kt * 2)],
                    [
                        (0, 0, 0),
                        (0, 1 % n_y, 1 / n_y),
                        (1, 0, 0),
                        (1, 1 % n_y, 1 / n_y)
                    ][..4.min(n_kt * 2)]
                );
            }
        }
        // In chunks of 1 pair the order is key tiles fastest; in one chunk of all, slowest.
        let dims = (5, 2, 3);
        for i in 0..30 {
            let c = |o, ch| bwd_cta_coords(o, ch, i, dims);
            assert_eq!(
                c(BwdCtaOrder::KeyTilesSlowestInChunks, 1),
                c(BwdCtaOrder::KeyTilesFastest, 1)
            );
            assert_eq!(
                c(BwdCtaOrder::KeyTilesSlowestInChunks, 6),
                c(BwdCtaOrder::KeyTilesSlowest, 1)
            );
        }
        // Steps of 64 queries (head_dim 128 before 2026-12-07) below.
        // Causal MQA at B4 H8:1 T4096: 3 splits of 2, 3 and 3 heads, key tile kt walking
        // 64 − 2 kt query tiles of 64 per head at head_dim 128, plus one step per CTA; list
        // scheduling on 132 SMs: every pair at once (key tiles slowest, what the H100 measured
        // better than fastest) is the best, 27 % under fastest (184 and 133 steps of 128 queries).
        let splits = bwd_head_splits(4, 8, 1, 4096, true);
        assert_eq!(splits, 3);
        let (chunk, chunked, fastest) = bwd_chunk(4, 8, 1, (4096, 4096), 64);
        assert_eq!((chunk, chunked, fastest), (12, 269, 371));
        assert_eq!(
            bwd_cta_order(4, 8, 1, (4096, 4096), 64, true),
            (BwdCtaOrder::KeyTilesSlowestInChunks, 12)
        );
        assert_eq!(
            bwd_cta_order(4, 8, 1, (4096, 4096), 64, false),
            (BwdCtaOrder::KeyTilesFastest, 1)
        );
        // MHA B4 H8 T4096 and GQA B4 H32:8: 32 pairs, a pair's first key tile the heaviest;
        // key tiles fastest leaves that CTA of the last pairs for the tail (14 % over the
        // average); chunks of 4 pairs end within 1 % of it while keeping a fastest order's L2
        // footprint (about 4 pairs at a time).
        for (heads, kv) in [(8, 8), (32, 8)] {
            let (chunk, chunked, fastest) = bwd_chunk(4, heads, kv, (4096, 4096), 64);
            let average = (0..32)
                .map(|kt| (64 - 2 * kt) * heads / kv + 1)
                .sum::<usize>()
                * 32
                / 132;
            assert_eq!(chunk, 4, "H{heads}:{kv}");
            assert!(chunked * 100 <= average * 101, "{chunked} {average}");
            assert!(fastest * 100 >= average * 112, "{fastest} {average}");
        }
        // T8192: chunks of 2 and of 4 simulate alike; the floor takes 4 (measured faster).
        assert_eq!(bwd_chunk(4, 8, 8, (8192, 8192), 64).0, BWD_MIN_CHUNK);
        // Long sequences: the tail is small whatever the order, fastest stays (L2).
        assert_eq!(
            bwd_cta_order(4, 8, 8, (16384, 16384), 64, true).0,
            BwdCtaOrder::KeyTilesFastest
        );
        // A grid past the simulation's size: fastest, not simulated.
        assert_eq!(bwd_chunk(64, 64, 64, (8192, 8192), 64), (1, 0, 0));
        assert_eq!(
            bwd_cta_order(64, 64, 64, (8192, 8192), 64, true),
            (BwdCtaOrder::KeyTilesFastest, 1)
        );
        // Steps of 80 (head_dim 128's default since 2026-12-07) order the shapes measured with
        // the model of 64 as it did: the measurements hold for both.
        for (heads, kv, lens) in [
            (8, 8, (4096, 4096)),
            (8, 8, (16384, 16384)),
            (8, 8, (1024, 4096)),
            (8, 8, (4096, 1024)),
            (8, 1, (4096, 4096)),
            (32, 8, (4096, 4096)),
        ] {
            assert_eq!(
                bwd_cta_order(4, heads, kv, lens, 80, true),
                bwd_cta_order(4, heads, kv, lens, 64, true),
                "H{heads}:{kv} {lens:?}"
            );
        }
        // makespan: list scheduling.
        assert_eq!(makespan([4, 3, 3, 2, 2], 2), 8);
        assert_eq!(makespan([5, 1, 1, 1, 1, 1], 2), 5);
        assert_eq!(makespan([], 3), 0);
    }

    #[test]
    fn the_causal_forward_runs_every_tile_once_heaviest_first_in_chunks() {
        // Every (query tile, head, batch entry) exactly once; within a chunk the tiles never
        // increase; chunk 1 is each pair's tiles in turn.
        for (qtiles, heads, batch) in [(1, 1, 1), (22, 8, 4), (3, 5, 2), (7, 1, 3)] {
            let n = qtiles * heads * batch;
            for chunk in [1, 2, 3, 7, heads * batch, 100] {
                let tiles: Vec<_> = (0..n)
                    .map(|i| fwd_causal_tile(i, (qtiles, heads, batch), chunk))
                    .collect();
                let set: std::collections::BTreeSet<_> = tiles.iter().copied().collect();
                assert_eq!(set.len(), n);
                assert!(tiles
                    .iter()
                    .all(|&(q, h, b)| q < qtiles && h < heads && b < batch));
                for (c, part) in tiles.chunks(qtiles * chunk).enumerate() {
                    assert!(part.windows(2).all(|w| w[0].0 >= w[1].0), "{chunk}");
                    assert!(part.iter().all(|&(_, h, b)| (b * heads + h) / chunk == c));
                }
                if chunk == 1 {
                    assert!(tiles.iter().enumerate().all(|(i, &(q, h, b))| {
                        q == qtiles - 1 - i % qtiles && b * heads + h == i / qtiles
                    }));
                }
            }
        }
        // D64 (V4: 192-row tiles) B4 H8 T4096 causal on 132 SMs, work in key tiles of 128: a
        // head at a time ends 111 key tiles in, the whole grid heaviest first 94, 1 over the 93.1
        // of a perfect split.
        let work = |q: usize| ((q + 1) * 192).min(4096).div_ceil(128);
        let span = |c| {
            makespan(
                (0..704).map(|i| work(fwd_causal_tile(i, (22, 8, 4), c).0)),
                132,
            )
        };
        assert_eq!((span(1), span(32)), (111, 94));
        // The chunk: within 0.5 % of the best allowed span, the smallest; the L2 budget caps it.
        let mb = 1 << 20;
        let pick = |qt, rows, t, d, budget| {
            fwd_causal_chunk((qt, rows), 32, (t, t), 132, (2 * t * d * 2, budget))
        };
        let c64 = pick(22, 192, 4096, 64, 25 * mb);
        assert!(c64 > 1 && c64 * 2 * 4096 * 64 * 2 <= 25 * mb, "{c64}");
        // D128 T16384: a pair's K and V are 8 MiB, so chunks of at most 3 in 25 MiB, and a head
        // at a time (128 tiles of up to 128 key tiles) is within 0.5 % of the best of them.
        assert_eq!(pick(128, 128, 16384, 128, 25 * mb), 1);
        // A budget below one pair: a head at a time.
        assert_eq!(pick(128, 128, 16384, 128, mb), 1);
        // Without a budget, D64 T4096 in chunks that balance about as well as the whole grid.
        let free = fwd_causal_chunk((22, 192), 32, (4096, 4096), 132, (1, usize::MAX));
        assert!(span(free) * 100 <= span(32) * 103, "{free}: {}", span(free));
    }

    #[test]
    fn the_combine_takes_as_many_parts_as_the_host_splits_into() {
        assert!(WGMMA_SRC.contains(&format!("#define KP_TAIL_MAX_PARTS {TAIL_MAX_PARTS}\n")));
    }

    #[test]
    fn the_trace_reader_and_the_kernel_agree_on_its_size() {
        assert!(WGMMA_SRC.contains(&format!("#define KP_TRACE_CTAS {TRACE_CTAS}\n")));
        assert!(WGMMA_SRC.contains(&format!("#define KP_TRACE_EVENTS {TRACE_EVENTS}\n")));
        assert!(WGMMA_SRC.contains(&format!("#ifdef {TRACE_DEFINE}\n")));
    }

    #[test]
    fn the_persistent_forward_runs_every_item_on_at_most_one_cta_per_sm() {
        // D128 T4096 B4 H8: 1,024 tiles, no split: 132 CTAs take 7 or 8 tiles each.
        assert_eq!(fwd_grid(1024, None, 132, true), (1024, 132));
        assert_eq!(fwd_grid(1024, None, 132, false), (1024, 1024));
        // A split of the last 20 tiles of 152 into 4 parts: 132 + 80 items.
        assert_eq!(fwd_grid(152, Some((132, 4)), 132, true), (212, 132));
        assert_eq!(fwd_grid(152, Some((132, 4)), 132, false), (212, 212));
        // Fewer items than SMs: one CTA each.
        assert_eq!(fwd_grid(40, None, 132, true), (40, 40));
        // Each CTA c takes items c, c + ctas, ...: every item exactly once.
        for (tiles, split) in [(1024, None), (152, Some((132, 4))), (7, None)] {
            let (items, ctas) = fwd_grid(tiles, split, 132, true);
            let mut seen = vec![0; items];
            for c in 0..ctas {
                for i in (c..items).step_by(ctas) {
                    seen[i] += 1;
                }
            }
            assert!(seen.iter().all(|&n| n == 1));
        }
    }

    #[test]
    fn the_forward_splits_a_short_last_wave_only() {
        // D64 (V4, 192-row tiles) B4 H8 T4096: 22 × 32 = 704 tiles on 132 SMs, a last wave of
        // 44: 132 / 44 = 3 parts of 32 key tiles.
        assert_eq!(fwd_tail_split(704, 132, 32, false), Some((660, 3)));
        // D128 (V3) B4 H8 T16384: 4096 tiles, a last wave of 4: at most TAIL_MAX_PARTS.
        assert_eq!(fwd_tail_split(4096, 132, 128, false), Some((4092, 4)));
        // A last wave of more than half the SMs (D128 T4096: 1024 tiles, 100 left), a whole
        // last wave, one wave or less, causal, too few key tiles: no split.
        assert_eq!(fwd_tail_split(1024, 132, 32, false), None);
        assert_eq!(fwd_tail_split(660, 132, 32, false), None);
        assert_eq!(fwd_tail_split(100, 132, 32, false), None);
        assert_eq!(fwd_tail_split(704, 132, 32, true), None);
        assert_eq!(fwd_tail_split(704, 132, 7, false), None);
        assert_eq!(fwd_tail_split(704, 132, 8, false), Some((660, 2)));
        assert_eq!(fwd_tail_split(704, 0, 32, false), None);
        // Every split leaves whole waves before it, fits its parts in one wave and cuts each
        // tile's keys into 2 to TAIL_MAX_PARTS parts of at least 4 key tiles.
        for sms in [1, 2, 78, 114, 132] {
            for tiles in 0..600 {
                for key_tiles in [1, 8, 13, 64] {
                    if let Some((whole, parts)) = fwd_tail_split(tiles, sms, key_tiles, false) {
                        let tail = tiles - whole;
                        assert!(whole % sms == 0 && whole >= sms && tail > 0 && tail < sms);
                        assert!(tail * parts <= sms && (2..=TAIL_MAX_PARTS).contains(&parts));
                        assert!(
                            key_tiles >= TAIL_MIN_PART_KEY_TILES * parts,
                            "{tiles} {sms} {key_tiles}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn the_backward_steps_fit_shared_memory_and_pad_for_either_step() {
        // What the kernel's BwPlan adds up to (K, V, two stages of Q and dO, two dS buffers,
        // the staging tiles, LSE and D stages, barriers) plus the alignment slack, within the
        // 227 KiB a block may opt into on compute capability 9.0.
        assert_eq!(bwd_smem_bytes(128, 64), 198_696);
        assert_eq!(bwd_smem_bytes(64, 128), 199_720);
        assert_eq!(bwd_smem_bytes(128, 80), 231_720);
        for (d, bm) in [(64, 128), (128, 64), (128, 80)] {
            assert!(bwd_smem_bytes(d, bm) <= 227 * 1024, "{d} {bm}");
        }
        // 80 queries a step only at head_dim 128: without the causal mask with `80`, under both
        // with `80c` (the default).
        assert_eq!(bwd_step_queries(128, false, (80, 64)), 80);
        assert_eq!(bwd_step_queries(128, true, (80, 64)), 64);
        assert_eq!(bwd_step_queries(128, true, (80, 80)), 80);
        assert_eq!(bwd_step_queries(64, false, (80, 80)), 128);
        assert_eq!(bwd_step_queries(128, false, (64, 64)), 64);
        // The D and LSE buffers hold the longer padding of the two steps: 1000 queries pad to
        // 1024 in steps of 64 and 1040 in steps of 80.
        assert_eq!(bwd_padded_rows((2, 3, 1000), 128, (80, 64)), 6 * 1040);
        assert_eq!(bwd_padded_rows((2, 3, 1000), 128, (64, 64)), 6 * 1024);
        assert_eq!(bwd_padded_rows((2, 3, 1025), 128, (80, 64)), 6 * 1088);
        assert_eq!(bwd_padded_rows((2, 3, 1025), 128, (80, 80)), 6 * 1040);
        assert_eq!(bwd_padded_rows((1, 1, 1), 64, (80, 80)), 128);
        // Reported beyond the 6,000 rows of D every backward counts: D's 240 padding rows and
        // the 6,240 of LSE · log2(e), 4 bytes each.
        assert_eq!(bwd_row_bytes((2, 3, 1000), 128, (80, 80)), (240 + 6240) * 4);
        assert_eq!(bwd_row_bytes((2, 3, 1024), 128, (64, 64)), 6144 * 4);
    }

    #[test]
    fn the_backward_splits_only_a_short_last_wave_without_the_mask() {
        // B4 H8 T16384 D128 full: 4,096 CTAs, 31 waves of 132 and 4; 256 steps of 64 queries
        // each, so the 4 are cut into 16 parts (the cap; 132 / 4 = 33).
        let (ctas, steps, splits) = bwd_grid((4, 8, 8), (16384, 16384), false, 64);
        assert_eq!((ctas, steps, splits), (4096, 256, 1));
        assert_eq!(bwd_tail_split(ctas, steps, false, splits), Some((4092, 16)));
        assert_eq!(
            bwd_tail_bytes((4, 8, 8), (16384, 16384), 128, false, (64, 64)),
            4 * 16 * 2 * 128 * 128 * 4
        );
        // Causal, or a group split over CTAs: never.
        assert_eq!(bwd_tail_split(ctas, steps, true, 1), None);
        assert_eq!(bwd_tail_split(ctas, steps, false, 2), None);
        assert_eq!(
            bwd_tail_bytes((4, 8, 8), (16384, 16384), 128, true, (64, 64)),
            0
        );
        // A last wave of 100 (T4096) or 68 (T8192) of 132 CTAs: parts would be 1.
        let (c4, s4, _) = bwd_grid((4, 8, 8), (4096, 4096), false, 64);
        assert_eq!(bwd_tail_split(c4, s4, false, 1), None);
        let (c8, s8, _) = bwd_grid((4, 8, 8), (8192, 8192), false, 64);
        assert_eq!((c8, bwd_tail_split(c8, s8, false, 1)), (2048, None));
        // One short wave: 64 CTAs of 8 steps (128 queries a step at head_dim 64) in halves;
        // 2 steps each would leave parts of fewer than BWD_TAIL_MIN_STEPS.
        assert_eq!(bwd_grid((1, 8, 8), (1024, 1024), false, 128).1, 8);
        assert_eq!(bwd_tail_split(64, 8, false, 1), Some((0, 2)));
        assert_eq!(bwd_tail_split(64, 7, false, 1), None);
        // No tail at all.
        assert_eq!(bwd_tail_split(264, 100, false, 1), None);
        // 80 queries a step: 205 steps at T16384, GQA heads counted per kv head.
        assert_eq!(
            bwd_grid((4, 32, 8), (16384, 16384), false, 80),
            (4096, 205 * 4, 1)
        );
    }

    #[test]
    fn the_backward_splits_a_group_only_where_its_grid_is_small() {
        // MQA at B4 H8:1 T4096: 32 key tiles × 1 × 4 = 128 CTAs. Causal: 3 splits reach 384 ≥
        // 264; not causal: 128 already fills one wave of 132, no split.
        assert_eq!(bwd_head_splits(4, 8, 1, 4096, true), 3);
        assert_eq!(
            bwd_split_bytes(4, 8, 1, 4096, 128, true),
            3 * 2 * 4 * 4096 * 128 * 4
        );
        assert_eq!(bwd_head_splits(4, 8, 1, 4096, false), 1);
        assert_eq!(bwd_split_bytes(4, 8, 1, 4096, 128, false), 0);
        // 32 CTAs not causal: 4 splits (128 CTAs, one wave); causal 4 too (at most 4).
        assert_eq!(bwd_head_splits(1, 8, 1, 4096, false), 4);
        assert_eq!(bwd_head_splits(1, 8, 1, 4096, true), 4);
        // GQA H32:8 at T4096, causal: 256 CTAs at batch 1 (2 splits), 1024 at batch 4 (none).
        assert_eq!(bwd_head_splits(1, 32, 8, 4096, true), 2);
        assert_eq!(bwd_head_splits(4, 32, 8, 4096, true), 1);
        assert_eq!(bwd_head_splits(1, 32, 8, 4096, false), 1);
        // No group to split (H = KVH), or a causal grid of two waves already.
        assert_eq!(bwd_head_splits(1, 24, 24, 300, true), 1);
        assert_eq!(bwd_head_splits(4, 8, 1, 128 * 66, true), 1);
        // At most the group size and BWD_MAX_SPLITS, 1 for shapes the kernels refuse.
        assert_eq!(bwd_head_splits(1, 2, 1, 1, false), 2);
        assert_eq!(bwd_head_splits(1, 64, 1, 1, true), BWD_MAX_SPLITS);
        assert_eq!(bwd_head_splits(1, 8, 3, 100, true), 1);
        assert_eq!(bwd_head_splits(1, 8, 0, 100, true), 1);
        // Every split has at least one of the group's heads (the kernel's [h_lo, h_hi)).
        for group in 1..=16 {
            for causal in [false, true] {
                let splits = bwd_head_splits(1, group, 1, 1, causal);
                for sp in 0..splits {
                    assert!(
                        (sp + 1) * group / splits > sp * group / splits,
                        "{group} {sp}"
                    );
                }
            }
        }
    }

    #[test]
    fn the_wgmma_forward_takes_bf16_at_head_dim_64_and_128_on_sm_90a_only() {
        let c = AttentionCase::new(1, 2, 100, 128);
        assert!(takes("sm_90a", &c));
        assert!(takes("sm_90a", &AttentionCase::new(1, 2, 100, 64)));
        assert!(takes(
            "sm_90a",
            &AttentionCase {
                pass: Pass::FwdBwd,
                ..c.clone()
            }
        ));
        assert!(!takes("sm_89", &c));
        assert!(!takes("sm_100", &c));
        assert!(!takes("sm_90a", &AttentionCase::new(1, 2, 100, 256)));
        // fp16 as the process dispatches it (FP16_DISPATCHED, or KP_SM90_FP16=1).
        let fp16 = AttentionCase {
            dtype: Dtype::F16,
            ..c.clone()
        };
        assert_eq!(takes("sm_90a", &fp16), fp16_dispatched());
        for other in [
            AttentionCase {
                dtype: Dtype::F32,
                ..c.clone()
            },
            AttentionCase {
                scale: Some(-0.1),
                ..c.clone()
            },
            AttentionCase {
                scale: Some(0.0),
                ..c.clone()
            },
        ] {
            assert!(!takes("sm_90a", &other), "{other:?}");
        }
    }

    #[test]
    fn the_two_readings_swap_each_pair() {
        for mode in [ProbeMode::KMajor, ProbeMode::RegistersTimesNMajor] {
            let [a, b] = readings(mode, 64);
            assert_eq!((a.lead_a, a.stride_a), (b.stride_a, b.lead_a));
            assert_eq!((a.lead_b, a.stride_b), (b.stride_b, b.lead_b));
            assert_eq!(a.lead_a, 128);
            assert_eq!(a.stride_a, 64 * 16);
        }
    }
}
