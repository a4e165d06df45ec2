//! The gated delta rule (Gated DeltaNet) forward on CUDA: `kernels/sequence_mixers/delta.cu`,
//! compiled by NVRTC at run time: the chunked WY form of
//! [`super::chunked::gated_delta_rule`] (Yang, Kautz and Hatamizadeh, 2024, "Gated Delta
//! Networks: Improving Mamba2 with Delta Rule"; the WY form of Yang et al., 2024,
//! "Parallelizing Linear Transformers with the Delta Rule over Sequence Length", §3), in
//! three launches: every chunk of [`CHUNK`] steps solves its unit-lower-triangular system at
//! once (W and U~ into scratch); the state then walks the chunks in order, [`ROWS`] of its rows
//! per block (U = U~ − W Sᵀ, the next state, and the state entering each chunk into scratch);
//! every chunk then computes its output at once. bf16 with K a multiple of 32 and V of 16
//! ([`tc_shared_bytes`]) takes the tensor-core kernels: the products on mma.sync (bf16
//! operands, float32 accumulation), the inverse by blocks of 16 rows (those below the diagonal
//! on tf32 mma.sync), the state walk as [`StateWalk::for_shape`] says, W, U~ and U in bf16 (U
//! written over U~); at K = V = 128 in two launches, compiled for that size ([`dims_suffix`]):
//! the solve also writes each chunk's decayed Q Kᵀ (M) and the state walk computes the output
//! itself, with no entering states or U in scratch (version 8); at K = V = 64 the three
//! kernels compiled for that size, the walk by one warp a block holding whole rows (version
//! 9). On a Hopper GPU (compute capability 9.0, compiled for sm_90a), where
//! [`wgmma_dispatched`] (not yet by default: no GPU has run it), both sizes take the two
//! launches of version 10 instead: the fused walk on wgmma, one warpgroup per 32 or 16 rows
//! of the state (value indices). Every other case takes version 2, plain float32 loops over shared
//! memory on CUDA cores.

use cudarc::driver::{
    CudaFunction, CudaSlice, CudaViewMut, DeviceRepr, LaunchConfig, PushKernelArg,
};

use super::cuda::Dtype;
use super::reference::DeltaShape;
use crate::gpu::{Gpu, GpuError};

/// The CUDA source of the gated-delta-rule kernels ([`entry_points`] names them).
pub const DELTA_SRC: &str = include_str!("../../kernels/sequence_mixers/delta.cu");

/// What NVRTC compiles: the shared prelude ([`super::cuda::with_prelude`]) and [`DELTA_SRC`].
pub fn source() -> String {
    super::cuda::with_prelude(DELTA_SRC)
}

/// Time steps per chunk (`GDN_CHUNK` in the source).
pub const CHUNK: usize = 64;

/// Threads per block (`GDN_THREADS` in the source).
pub const THREADS: u32 = 256;

/// Rows of the state (value indices) per block of the state pass (`GDN_ROWS` in the source).
pub const ROWS: usize = 16;

/// The largest key and value width per head version 2 takes (`GDN_MAX_DIM` in the source): a
/// chunk's q, k, U and the state entering it stay in one block's shared memory.
pub const MAX_DIM: usize = 128;

/// The shared memory one block may have on compute capability 9.0 (227 KiB). The output
/// kernel at K = V = 128 needs 177.25 KiB; a device with less (sm_80: 163 KiB) refuses the
/// larger shapes when the kernel's limit is raised (a driver error), smaller ones run.
const MAX_SHARED: u32 = 227 * 1024;

/// The kernels of [`DELTA_SRC`] for one dtype tag (`f32`, `bf16`), in launch order.
const KERNELS: [&str; 3] = ["gdn_prepare", "gdn_state_pass", "gdn_output"];

/// The tensor-core preparation and output kernels (version 3, bf16) for any K and V, around
/// one of [`TC_STATE_WALKS`], and with [`dims_suffix`]'s suffix around a walk of
/// [`WHOLE_ROW_WALKS`]; at [`FUSED_WALKS`]' sizes the preparation is [`TC_FUSED_PREPARE`] with
/// the suffix, then the fused walk, and no output kernel ([`StateWalk::for_shape`]).
const TC_KERNELS: [&str; 2] = ["gdn_prepare_tc", "gdn_output_tc"];

/// The preparation that also writes M for the fused walk (version 8), with K and V compiled
/// in ([`dims_suffix`]).
const TC_FUSED_PREPARE: &str = "gdn_prepare_tcm";

/// The sizes (K = V) [`TC_FUSED_PREPARE`] is compiled for: those of [`WGMMA_WALKS`] and
/// [`FUSED_WALKS`].
const FUSED_PREPARE_SIZES: [usize; 2] = [64, 128];

/// The suffixes of the entry points with K and V compiled in as constants: none (any K and V),
/// then the grid's sizes.
const DIMS_SUFFIXES: [&str; 3] = ["", "_k64v64", "_k128v128"];

/// The suffix of the kernels `shape` runs with K and V compiled in: `_k64v64` or `_k128v128`
/// where K and V are those sizes (the index arithmetic folds, the loops unroll; the output
/// since version 3.2, the preparation since 4.1, the whole-row walks since version 5; in
/// version 8 the fused preparation and walk only; since version 9 those at 128 and the three
/// kernels at 64), "" (K and V read from the arguments) otherwise.
pub fn dims_suffix(shape: DeltaShape) -> &'static str {
    match (shape.key_dim, shape.value_dim) {
        (64, 64) => DIMS_SUFFIXES[1],
        (128, 128) => DIMS_SUFFIXES[2],
        _ => DIMS_SUFFIXES[0],
    }
}

/// Threads per row group of `gdn_state_tc_r<G>_s<S>` (`GDN_TC_THREADS`).
const TC_STATE_THREADS: u32 = 128;

/// Rows of the state per row group of `gdn_state_tc_r<G>_s<S>` (`GDN_TC_ROWS`).
pub const TC_ROWS: usize = 16;

/// The tensor-core state walks of versions 3 and 4 the source instantiates for any K and V,
/// (row groups, stages), [`StateWalk::for_shape`]'s choices outside [`FUSED_WALKS`]' and
/// [`WHOLE_ROW_WALKS`]' sizes: 16 rows a block with 2 stages, 32 rows with 4.
pub const TC_STATE_WALKS: [(usize, usize); 2] = [(1, 2), (2, 4)];

/// The fused walks (version 8, `gdn_walk_out_w<W>_s<S>_k<K>v<V>`: whole rows per warp, as
/// version 5's walks were, and the output computed in the walk) the source instantiates,
/// (warps, stages, K = V): two warps of 16 rows at 128 with 3 stages (the stages of W, k, q,
/// U~ and M: 196 KB).
pub const FUSED_WALKS: [(usize, usize, usize); 1] = [(2, 3, 128)];

/// The whole-row walks without the output (version 9, `gdn_state_w<W>_s<S>_k<K>v<V>`, version
/// 5's walk again, then the output kernel with K and V compiled in) the source instantiates,
/// (warps, stages, K = V): one warp of 16 rows at 64 (4 blocks per head and batch entry) with
/// 4 stages, where version 8's fused walk was slower (one warp a block).
pub const WHOLE_ROW_WALKS: [(usize, usize, usize); 1] = [(1, 4, 64)];

/// The fused walks on Hopper's warpgroup matrix instructions (version 10,
/// `gdn_walk_wg_r<BV>_s<S>_k<K>v<V>`, compiled only for sm_90a) the source instantiates,
/// (rows of the state per block, stages, K = V): one warpgroup of 128 threads per BV rows of the
/// state (value indices), head and batch entry (4 blocks a head at both sizes), three stages at 128 (200 KB of
/// shared memory), four at 64. [`StateWalk::for_shape`] takes them on a compute capability 9.0
/// device, before [`FUSED_WALKS`] and [`WHOLE_ROW_WALKS`].
pub const WGMMA_WALKS: [(usize, usize, usize); 2] = [(32, 3, 128), (16, 4, 64)];

/// Whether [`GatedDelta::new`] takes version 10's walks ([`WGMMA_WALKS`]) on a compute
/// capability 9.0 device: off until their GPU test (`gated_delta_rule_matches_float64_on_every_shape`,
/// which runs both walks on a Hopper GPU whatever this says) has passed there; written
/// 2026-12-08 in a session the device lent no GPU to. [`wgmma_dispatched`] says what a process
/// does.
pub const WGMMA_DISPATCHED: bool = false;

/// The compute capability version 10's walks run on (sm_90a: Hopper's wgmma).
pub const WGMMA_CC: (i32, i32) = (9, 0);

/// The environment variable that makes this process take version 10's walks before
/// [`WGMMA_DISPATCHED`] does (value `1`): for measuring them (`runners/device_run.sh gdn`).
pub const WGMMA_ENV: &str = "KP_GDN_WGMMA";

/// [`WGMMA_DISPATCHED`], or this process's [`WGMMA_ENV`] set to `1`.
pub fn wgmma_dispatched() -> bool {
    WGMMA_DISPATCHED || std::env::var(WGMMA_ENV).is_ok_and(|v| v == "1")
}

/// How the state walk runs: `row_groups` groups of [`TC_ROWS`] rows per block, the chunks'
/// loads `stages − 1` chunks ahead; a group is 4 warps sharing the rows' K columns
/// (`gdn_state_tc_r<G>_s<S>`, versions 3 and 4) or, with `whole_rows`, one warp holding all
/// of them (no exchange between warps within a chunk; K and V compiled in): computing the
/// output too with `fused` (`gdn_walk_out_w<G>_s<S>_k<K>v<V>`, version 8: no output kernel),
/// else writing U and the entering states for it (`gdn_state_w<G>_s<S>_k<K>v<V>`, version 9).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StateWalk {
    /// Row groups per block (1 or 2).
    pub row_groups: usize,
    /// Stages of the ring of W, k, U~ and g tiles (and q and M, `fused`).
    pub stages: usize,
    /// A row group is one warp with all K columns of its rows (versions 8 and 9).
    pub whole_rows: bool,
    /// Version 8: a whole-row walk computing the output too (the preparation writes M; two
    /// launches, not three); version 10 with `wgmma`.
    pub fused: bool,
    /// Version 10: the fused walk on wgmma, one warpgroup per 16 `row_groups` rows of the
    /// state ([`WGMMA_WALKS`]; sm_90a only).
    pub wgmma: bool,
}

impl StateWalk {
    /// The walk for `shape`: at K = V = 128, version 8 ([`FUSED_WALKS`]); at 64, version 9
    /// ([`WHOLE_ROW_WALKS`]); else
    /// where V is a multiple of 32 above 64, version 4, two row groups (32 rows, 8 warps: the
    /// W and k tiles a block loads serve twice the rows) and 4 stages; otherwise version 3,
    /// one row group and 2 stages. Measured on an H100 at B4 H8 T16384 bf16
    /// (kernels/TUNING-sequence-mixers.md, "Gated delta rule state walk version 4"): version 4
    /// 8 % faster than 3 at K = V = 128, while 4 stages at 16 rows made it 11 % slower at
    /// K = V = 64 (4 warps sharing the rows' columns). Version 8 measured on an H100 at that
    /// shape (the notes' "Versions 5 to 8 on an H100"): 1.281 ms at K = V = 128 against
    /// version 7.1's 1.433 (a whole-row walk and a separate output kernel), but 1.017 ms at 64
    /// against 7.1's 0.872, where the walk is one warp a block: version 9 brings 7.1's pair
    /// back at 64 (emulated, not yet run on a GPU). With `hopper` (a compute capability 9.0
    /// device, where the source is compiled for sm_90a; [`GatedDelta::new`] asks for it only
    /// where [`wgmma_dispatched`]) version 10 ([`WGMMA_WALKS`]) at its sizes first (not yet run
    /// on a GPU).
    pub fn for_shape(shape: DeltaShape, hopper: bool) -> StateWalk {
        let (k, v) = (shape.key_dim, shape.value_dim);
        let fits = |w: &&(usize, usize, usize)| w.2 == k && w.2 == v;
        if let Some(&(columns, stages, _)) = WGMMA_WALKS.iter().find(fits).filter(|_| hopper) {
            return StateWalk {
                row_groups: columns / TC_ROWS,
                stages,
                whole_rows: false,
                fused: true,
                wgmma: true,
            };
        }
        for (walks, fused) in [(&FUSED_WALKS[..], true), (&WHOLE_ROW_WALKS[..], false)] {
            if let Some(&(warps, stages, _)) = walks.iter().find(fits) {
                return StateWalk {
                    row_groups: warps,
                    stages,
                    whole_rows: true,
                    fused,
                    wgmma: false,
                };
            }
        }
        let (row_groups, stages) = if v.is_multiple_of(32) && v > 64 {
            TC_STATE_WALKS[1]
        } else {
            TC_STATE_WALKS[0]
        };
        StateWalk {
            row_groups,
            stages,
            whole_rows: false,
            fused: false,
            wgmma: false,
        }
    }

    /// Rows of the state (value indices) per block.
    pub fn rows(self) -> usize {
        TC_ROWS * self.row_groups
    }

    /// Threads per block.
    pub fn threads(self) -> u32 {
        if self.wgmma {
            return 128;
        }
        let group = if self.whole_rows {
            32
        } else {
            TC_STATE_THREADS
        };
        group * self.row_groups as u32
    }

    /// The entry point before [`dims_suffix`]'s suffix, e.g. `gdn_state_tc_r2_s4` or
    /// `gdn_walk_out_w2_s3` (whose entry point always has the suffix).
    pub fn entry_point(self) -> String {
        if self.wgmma {
            format!("gdn_walk_wg_r{}_s{}", self.rows(), self.stages)
        } else if self.fused {
            format!("gdn_walk_out_w{}_s{}", self.row_groups, self.stages)
        } else if self.whole_rows {
            format!("gdn_state_w{}_s{}", self.row_groups, self.stages)
        } else {
            format!("gdn_state_tc_r{}_s{}", self.row_groups, self.stages)
        }
    }
}

/// Every entry point of [`DELTA_SRC`]: `gdn_prepare_<t>`, `gdn_state_pass_<t>` and
/// `gdn_output_<t>` for `f32` and `bf16`, then the tensor-core kernels: the preparations
/// (any K and V, the whole-row walks' sizes, then the fused walks' with M), the state walks
/// (versions 3 and 4 for any K and V, then versions 9 and 8 at their sizes) and the outputs
/// (any K and V, then the whole-row walks' sizes).
pub fn entry_points() -> Vec<String> {
    let square = square_suffix;
    let walk = |(row_groups, stages)| {
        StateWalk {
            row_groups,
            stages,
            whole_rows: false,
            fused: false,
            wgmma: false,
        }
        .entry_point()
    };
    [Dtype::F32, Dtype::Bf16]
        .into_iter()
        .flat_map(|d| KERNELS.iter().map(move |k| format!("{k}_{}", d.tag())))
        .chain([TC_KERNELS[0].to_string()])
        .chain(WHOLE_ROW_WALKS.map(|w| format!("{}{}", TC_KERNELS[0], square(w.2))))
        .chain(FUSED_PREPARE_SIZES.map(|d| format!("{TC_FUSED_PREPARE}{}", square(d))))
        .chain(TC_STATE_WALKS.map(walk))
        .chain(WHOLE_ROW_WALKS.map(|(w, s, d)| format!("gdn_state_w{w}_s{s}{}", square(d))))
        .chain(FUSED_WALKS.map(|(w, s, d)| format!("gdn_walk_out_w{w}_s{s}{}", square(d))))
        .chain(hopper_entry_points())
        .chain([TC_KERNELS[1].to_string()])
        .chain(WHOLE_ROW_WALKS.map(|w| format!("{}{}", TC_KERNELS[1], square(w.2))))
        .collect()
}

/// Whether `shape` and `dtype` take the tensor-core kernels (version 3 on: bf16, K a multiple
/// of 32 and V of 16), on any device ([`tc_shared_bytes`] is `Some`).
pub fn tensor_core_path(shape: DeltaShape, dtype: Dtype) -> bool {
    tc_shared_bytes(shape, dtype, false).is_some()
}

/// The entry points of [`entry_points`] compiled only for sm_90a (version 10's walks; the
/// source guards them with `__CUDA_ARCH_FEAT_SM90_ALL`).
pub fn hopper_entry_points() -> Vec<String> {
    WGMMA_WALKS
        .map(|(c, s, d)| format!("gdn_walk_wg_r{c}_s{s}{}", square_suffix(d)))
        .to_vec()
}

/// [`dims_suffix`] of the shape K = V = `d`.
fn square_suffix(d: usize) -> &'static str {
    dims_suffix(DeltaShape {
        batch: 1,
        seq_len: 1,
        heads: 1,
        key_dim: d,
        value_dim: d,
    })
}

/// Dynamic shared memory of the tensor-core kernels (version 3, bf16) for `shape`, bytes, in
/// launch order, or `None` when the shape does not fit them (K a multiple of 32, V of 16; the
/// float32 kernels run the others): the preparation's k and v (L rows of K + 8 and V + 8 bf16),
/// A and T (L × (L + 4) floats each; T in bf16 over A later), g, β and α (L floats each); the
/// state walk's ([`StateWalk::for_shape`], R rows per block) stages, each of g (L floats), its
/// R columns of U~ (L rows of R + 8 bf16) and W and k (L rows of K + 8 bf16 each; the fused
/// walk also q, L rows of K + 8, and M, L rows of L + 8 bf16), then (versions 3 and 4, not the
/// fused walk) its rows of the state (R × (K + 8) bf16) and the decayed U (L × (R + 8) bf16);
/// the output's g (L floats) and bf16 rows: q and k L × (K + 8), U L × (V + 8), the entering
/// state V × (K + 8), M L × (L + 8), or 0 where the fused walk leaves no output kernel.
/// Version 10's walk (`hopper`, [`WGMMA_WALKS`]' sizes) has stages of W, q and k (L × K bf16
/// each, no padding: wgmma's core-matrix layout), M (L × L), its BV columns of U~ (L × (BV +
/// 8)) and g, then the state (K × BV) and U and the decayed U (L × BV each), bf16.
pub fn tc_shared_bytes(shape: DeltaShape, dtype: Dtype, hopper: bool) -> Option<[u32; 3]> {
    let (l, k, v) = (CHUNK, shape.key_dim, shape.value_dim);
    if dtype != Dtype::Bf16 || !k.is_multiple_of(32) || !v.is_multiple_of(16) {
        return None;
    }
    let ks = k + 8;
    let walk = StateWalk::for_shape(shape, hopper);
    let r = walk.rows();
    let output = l * 4 + (2 * l * ks + l * (v + 8) + v * ks + l * (l + 8)) * 2;
    let (stage, exchange, output) = if walk.wgmma {
        (
            l * 4 + l * (r + 8) * 2 + (3 * l * k + l * l) * 2,
            (k * r + 2 * l * r) * 2,
            0,
        )
    } else if walk.fused {
        (
            l * 4 + l * (r + 8) * 2 + (3 * l * ks + l * (l + 8)) * 2,
            0,
            0,
        )
    } else if walk.whole_rows {
        (l * 4 + l * (r + 8) * 2 + 2 * l * ks * 2, 0, output)
    } else {
        (
            l * 4 + l * (r + 8) * 2 + 2 * l * ks * 2,
            r * ks * 2 + l * (r + 8) * 2,
            output,
        )
    };
    let state = walk.stages * stage + exchange;
    let prepare = l * ((k + 8) + (v + 8)) * 2 + (2 * l * (l + 4) + 3 * l) * 4;
    Some([prepare as u32, state as u32, output as u32])
}

/// Dynamic shared memory of the three kernels for `shape`, bytes, in launch order, with
/// L = [`CHUNK`], KP = K | 1 (rows of K floats padded to an odd stride against bank
/// conflicts) and RP = [`ROWS`] + 1:
/// - preparation: 2·L·KP (k, then W) + L·V (U~) + L·L (A) + 2·L (g, β) floats;
/// - state pass: ROWS·KP (its rows of the state) + 2·L·KP (W, k) + L·RP (U) + L (g) floats;
/// - output: 2·L·KP (q, k) + V·KP (the entering state) + L·V (U) + L·L (M) + L (g) floats.
pub fn shared_bytes(shape: DeltaShape) -> [u32; 3] {
    let (l, k, v) = (CHUNK, shape.key_dim, shape.value_dim);
    let (kp, rp) = (k | 1, ROWS + 1);
    [
        2 * l * kp + l * v + l * l + 2 * l,
        ROWS * kp + 2 * l * kp + l * rp + l,
        2 * l * kp + v * kp + l * v + l * l + l,
    ]
    .map(|floats| (floats * 4) as u32)
}

/// The shapes the forward and the backward ([`super::delta_backward`]) take.
///
/// # Errors
/// [`GpuError::Config`] for an empty dimension other than seq_len, a key or value width over
/// [`MAX_DIM`], more than 65,535 batch entries or heads (the grid's z and y), or a seq_len
/// past 32-bit ints.
pub(crate) fn check_shape(s: DeltaShape) -> Result<(), GpuError> {
    if s.batch == 0 || s.heads == 0 || s.key_dim == 0 || s.value_dim == 0 {
        return Err(GpuError::Config(format!(
            "gated_delta_rule: empty dimension in {s:?}"
        )));
    }
    if s.key_dim > MAX_DIM || s.value_dim > MAX_DIM {
        return Err(GpuError::Config(format!(
            "gated_delta_rule: key_dim {} and value_dim {} must be at most {MAX_DIM} \
             (version 2 keeps a chunk's state in shared memory)",
            s.key_dim, s.value_dim
        )));
    }
    // The kernels' chunk start (an int) passes seq_len by up to one chunk.
    if s.seq_len + CHUNK > i32::MAX as usize || s.batch > 65_535 || s.heads > 65_535 {
        return Err(GpuError::Config(format!(
            "gated_delta_rule: {s:?} does not fit 32-bit ints and the grid (batch and \
             heads at most 65,535)"
        )));
    }
    Ok(())
}

/// The gated-delta-rule forward kernels compiled for one shape and dtype, with their scratch
/// (float32): W `[B, H, n_chunks, L, K]`, U `[B, H, n_chunks, L, V]`, the chunks' cumulative log
/// decays `[B, H, n_chunks, L]` and the state entering each chunk `[B, H, n_chunks, V, K]`.
///
/// The tensor-core path (version 3, [`tc_shared_bytes`]) keeps W, the entering states and U~
/// (then U, which the state walk writes over it) as bf16 (`w16`, `states16`, `u16`) and g as
/// float32; with the fused walk ([`StateWalk::fused`]) W, U~ and M `[B, H, n_chunks, L, L]`
/// (`m16`) as bf16 and no entering states. The other buffers are then one-element
/// placeholders, as are the bf16 ones on the float32 path.
pub struct GatedDelta {
    shape: DeltaShape,
    dtype: Dtype,
    /// The preparation, the state walk and (unless `fused`) the output kernel.
    kernels: Vec<CudaFunction>,
    /// Shared memory of the kernels chosen, bytes (the third 0 when `fused`).
    smem: [u32; 3],
    tensor_cores: bool,
    /// The state walk on the tensor-core path ([`StateWalk::for_shape`] for this device).
    walk: StateWalk,
    w: CudaSlice<f32>,
    u: CudaSlice<f32>,
    g: CudaSlice<f32>,
    states: CudaSlice<f32>,
    w16: CudaSlice<u16>,
    u16: CudaSlice<u16>,
    states16: CudaSlice<u16>,
    m16: CudaSlice<u16>,
    /// Stands in for the initial state when none is given (never read).
    unused: CudaSlice<f32>,
    /// NVRTC compile and module load time, s (0 when this process had compiled the source).
    pub compile_s: f64,
}

impl GatedDelta {
    /// Compiles the kernels and allocates the scratch for `shape` and `dtype`.
    ///
    /// # Errors
    /// [`GpuError::Config`] for a shape the reference refuses (an empty dimension other than
    /// seq_len), a key or value width over [`MAX_DIM`], more than 65,535 batch entries or
    /// heads (the grid's z and y), or a seq_len past 32-bit ints; [`GpuError::Compile`] with
    /// the NVRTC log; driver errors (out of memory, a device whose blocks cannot have
    /// [`shared_bytes`]).
    pub fn new(gpu: &Gpu, shape: DeltaShape, dtype: Dtype) -> Result<GatedDelta, GpuError> {
        Self::with_walks(gpu, shape, dtype, gpu.cc == WGMMA_CC && wgmma_dispatched())
    }

    /// As [`GatedDelta::new`], with version 10's walks at their sizes when `hopper`
    /// ([`StateWalk::for_shape`]; the GPU test runs both).
    ///
    /// # Errors
    /// As [`GatedDelta::new`]'s, and [`GpuError::Config`] for `hopper` on a device other than
    /// compute capability 9.0 (the walks are compiled only for sm_90a).
    pub fn with_walks(
        gpu: &Gpu,
        shape: DeltaShape,
        dtype: Dtype,
        hopper: bool,
    ) -> Result<GatedDelta, GpuError> {
        if hopper && gpu.cc != WGMMA_CC {
            return Err(GpuError::Config(format!(
                "gated_delta_rule: version 10's walks need compute capability {}.{} \
                 (sm_90a), this device has {}.{}",
                WGMMA_CC.0, WGMMA_CC.1, gpu.cc.0, gpu.cc.1
            )));
        }
        let s = shape;
        check_shape(s)?;
        let smem = shared_bytes(s);
        if let Some(&over) = smem.iter().find(|&&b| b > MAX_SHARED) {
            // Unreachable with K, V ≤ MAX_DIM; kept so that a larger MAX_DIM fails here.
            return Err(GpuError::Config(format!(
                "gated_delta_rule: key_dim {} and value_dim {} need {over} bytes of shared \
                 memory per block, more than {MAX_SHARED}",
                s.key_dim, s.value_dim
            )));
        }
        let compiled = gpu.compile("delta.cu", &source())?;
        let tag = dtype.tag();
        let tc = tc_shared_bytes(s, dtype, hopper);
        let walk = StateWalk::for_shape(s, hopper);
        let fused = tc.is_some() && walk.fused;
        let (names, smem) = match tc {
            Some(bytes) => {
                let names = if fused {
                    vec![
                        format!("{TC_FUSED_PREPARE}{}", dims_suffix(s)),
                        format!("{}{}", walk.entry_point(), dims_suffix(s)),
                    ]
                } else {
                    // The whole-row walk's size also has its preparation and output with K
                    // and V compiled in (dims_suffix; "" for the generic walks' shapes).
                    let x = if walk.whole_rows { dims_suffix(s) } else { "" };
                    vec![
                        format!("{}{x}", TC_KERNELS[0]),
                        format!("{}{x}", walk.entry_point()),
                        format!("{}{x}", TC_KERNELS[1]),
                    ]
                };
                (names, bytes)
            }
            None => (KERNELS.map(|k| format!("{k}_{tag}")).to_vec(), smem),
        };
        let kernels = names
            .iter()
            .zip(smem)
            .map(|(name, bytes)| gpu.function(&compiled.module, name, bytes))
            .collect::<Result<Vec<_>, _>>()?;
        let rows = s.batch * s.heads * s.seq_len.div_ceil(CHUNK);
        let (w_len, u_len, g_len) = (
            rows * CHUNK * s.key_dim,
            rows * CHUNK * s.value_dim,
            rows * CHUNK,
        );
        let state_len = rows * s.value_dim * s.key_dim;
        let on = |yes: bool, n: usize| if yes { n.max(1) } else { 1 };
        let alloc = |n: usize| gpu.stream.alloc_zeros::<f32>(n);
        let alloc16 = |n: usize| gpu.stream.alloc_zeros::<u16>(n);
        let t = tc.is_some();
        let m_len = rows * CHUNK * CHUNK;
        Ok(GatedDelta {
            shape,
            dtype,
            kernels,
            smem,
            tensor_cores: t,
            walk,
            w: alloc(on(!t, w_len))?,
            u: alloc(on(!t, u_len))?,
            g: alloc(g_len.max(1))?,
            states: alloc(on(!t, state_len))?,
            w16: alloc16(on(t, w_len))?,
            u16: alloc16(on(t, u_len))?,
            states16: alloc16(on(t && !fused, state_len))?,
            m16: alloc16(on(fused, m_len))?,
            unused: alloc(1)?,
            compile_s: compiled.compile_s,
        })
    }

    /// Bytes of scratch one call uses beyond its inputs and outputs: W, U, the log decays and
    /// the chunks' entering states (float32; on the tensor-core path W, the states and U~,
    /// then U over it, in bf16 and g in float32; with the fused walk W, U~ and M in bf16, no
    /// states), every buffer allocated counted (the other paths' one-element placeholders too).
    pub fn temporary_bytes(&self) -> u64 {
        (self.w.len() + self.u.len() + self.g.len() + self.states.len()) as u64 * 4
            + (self.w16.len() + self.u16.len() + self.states16.len() + self.m16.len()) as u64 * 2
    }

    /// Whether the kernels are version 3's tensor-core ones ([`tc_shared_bytes`]).
    pub fn uses_tensor_cores(&self) -> bool {
        self.tensor_cores
    }

    /// Whether the tensor-core path runs a fused walk (two launches, no output kernel).
    fn fused(&self) -> bool {
        self.tensor_cores && self.walk.fused
    }

    /// The state walk the tensor-core path runs ([`StateWalk::for_shape`] for the device the
    /// kernels were compiled for), or `None` on the float32 path.
    pub fn state_walk(&self) -> Option<StateWalk> {
        self.tensor_cores.then_some(self.walk)
    }

    /// Launches one gated-delta-rule forward: O and the final state from q and k
    /// `[B, T, H, K]` (keys L2-normalised by the caller), v `[B, T, H, V]`, α and β
    /// `[B, T, H]` and the initial state `[B, H, V, K]` (value-major; optional: zeros), the
    /// layouts of [`super::reference::gated_delta_rule`]. q, k, v and O are of the runner's
    /// [`Dtype`] (`f32`, or `u16` holding bf16 bits); α, β and the states are float32. α must
    /// be positive (its logarithm is taken). Asynchronous on [`Gpu::stream`].
    ///
    /// # Errors
    /// [`GpuError::Config`] for a buffer whose length does not fit the shape or an element
    /// type other than the runner's dtype; driver errors from the launches.
    #[allow(clippy::too_many_arguments)]
    pub fn launch<T: DeviceRepr>(
        &mut self,
        gpu: &Gpu,
        q: &CudaSlice<T>,
        k: &CudaSlice<T>,
        v: &CudaSlice<T>,
        alpha: &CudaSlice<f32>,
        beta: &CudaSlice<f32>,
        initial_state: Option<&CudaSlice<f32>>,
        o: &mut CudaViewMut<'_, T>,
        final_state: &mut CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        let s = self.shape;
        super::cuda::check_element::<T>(self.dtype, "gated_delta_rule")?;
        let n = s.batch * s.seq_len * s.heads;
        let state_len = s.batch * s.heads * s.value_dim * s.key_dim;
        let checks = [
            ("q", q.len(), n * s.key_dim),
            ("k", k.len(), n * s.key_dim),
            ("v", v.len(), n * s.value_dim),
            ("alpha", alpha.len(), n),
            ("beta", beta.len(), n),
            (
                "initial_state",
                initial_state.map_or(state_len, |x| x.len()),
                state_len,
            ),
            ("o", o.len(), n * s.value_dim),
            ("final_state", final_state.len(), state_len),
        ];
        super::cuda::check_buffers("gated_delta_rule", &s, &checks)?;
        if s.seq_len == 0 {
            return super::cuda::no_step(gpu, initial_state, final_state);
        }
        let n_chunks = s.seq_len.div_ceil(CHUNK);
        let smem = self.smem;
        let has_initial = i32::from(initial_state.is_some());
        let (t_len, heads, chunks) = (s.seq_len as i32, s.heads as i32, n_chunks as i32);
        let (kd, vd) = (s.key_dim as i32, s.value_dim as i32);
        let cfg = |grid: (u32, u32, u32), threads: u32, smem: u32| LaunchConfig {
            grid_dim: grid,
            block_dim: (threads, 1, 1),
            shared_mem_bytes: smem,
        };
        let per_chunk = (n_chunks as u32, s.heads as u32, s.batch as u32);
        if self.fused() {
            let mut l = gpu.stream.launch_builder(&self.kernels[0]);
            l.arg(q).arg(k).arg(v).arg(alpha).arg(beta);
            l.arg(&mut self.w16).arg(&mut self.u16).arg(&mut self.m16);
            l.arg(&mut self.g).arg(&t_len).arg(&heads).arg(&kd).arg(&vd);
            // SAFETY: gdn_prepare_tcm_k<K>v<V>(const u16* q, const u16* k, const u16* v,
            // const float* alpha, const float* beta, u16* w, u16* u, u16* m, float* g,
            // int T_len, int heads, int K, int V), K and V the compiled-in sizes
            // (StateWalk::for_shape takes the fused walk only there; T is 2 bytes, checked
            // above): blocks (chunk, head, batch entry) read their chunk's rows below T of the
            // checked inputs and write their chunk's slots of the scratch `new` sized for this
            // shape; the shared memory is what `new` raised the limit to.
            unsafe { l.launch(cfg(per_chunk, THREADS, smem[0]))? };
            let walk = self.walk;
            let mut l = gpu.stream.launch_builder(&self.kernels[1]);
            l.arg(q)
                .arg(k)
                .arg(&self.w16)
                .arg(&self.u16)
                .arg(&self.m16)
                .arg(&self.g);
            l.arg(initial_state.unwrap_or(&self.unused))
                .arg(&has_initial)
                .arg(&mut *o)
                .arg(&mut *final_state)
                .arg(&t_len)
                .arg(&heads)
                .arg(&kd)
                .arg(&vd)
                .arg(&chunks);
            let row_blocks = (
                s.value_dim.div_ceil(walk.rows()) as u32,
                s.heads as u32,
                s.batch as u32,
            );
            // SAFETY: gdn_walk_out_w<G>_s<S>_k<K>v<V>, or on Hopper gdn_walk_wg_r<BV>_s<S>_k<K>v<V>
            // (version 10, the same arguments; rows() = BV rows of the state a block, 128 threads),
            // (const u16* q, const u16* k,
            // const u16* w, const u16* u, const u16* m, const float* g,
            // const float* initial_state, int has_initial, u16* o, float* final_state,
            // int T_len, int heads, int K, int V, int n_chunks): blocks (V / rows row blocks,
            // head, batch entry; V a multiple of the rows at these sizes) own disjoint columns
            // of o and rows of the final state and read the scratch the launch before filled
            // (same stream); the initial state is read only when has_initial is 1, and then
            // holds B·H·V·K floats.
            unsafe { l.launch(cfg(row_blocks, walk.threads(), smem[1]))? };
            return Ok(());
        }
        // The tensor-core path keeps W, U and the entering states in bf16 and walks the state
        // as StateWalk::for_shape says; version 2 all in float32, ROWS rows per block of
        // THREADS. The launches are otherwise the same.
        let tc = self.tensor_cores;
        let mut l = gpu.stream.launch_builder(&self.kernels[0]);
        l.arg(k).arg(v).arg(alpha).arg(beta);
        if tc {
            l.arg(&mut self.w16).arg(&mut self.u16);
        } else {
            l.arg(&mut self.w).arg(&mut self.u);
        }
        l.arg(&mut self.g).arg(&t_len).arg(&heads).arg(&kd).arg(&vd);
        // SAFETY: gdn_prepare_<t>(const T* k, const T* v, const float* alpha,
        // const float* beta, float* w, float* u, float* g, int T_len, int heads, int K,
        // int V), or gdn_prepare_tc, the same with bf16 k, v (T is 2 bytes, checked
        // above) and u16* w, u: blocks (chunk, head, batch entry) read their chunk's rows below T of the
        // checked inputs and write their chunk's slots of the scratch, which `new` sized for
        // this shape; K, V ≤ MAX_DIM and the shared memory is what `new` raised the limit to.
        unsafe { l.launch(cfg(per_chunk, THREADS, smem[0]))? };
        let mut l = gpu.stream.launch_builder(&self.kernels[1]);
        l.arg(k);
        if tc {
            l.arg(&self.w16).arg(&mut self.u16);
        } else {
            l.arg(&self.w).arg(&mut self.u);
        }
        l.arg(&self.g)
            .arg(initial_state.unwrap_or(&self.unused))
            .arg(&has_initial);
        if tc {
            l.arg(&mut self.states16);
        } else {
            l.arg(&mut self.states);
        }
        l.arg(&mut *final_state)
            .arg(&t_len)
            .arg(&heads)
            .arg(&kd)
            .arg(&vd)
            .arg(&chunks);
        let (rows, threads) = if tc {
            (self.walk.rows(), self.walk.threads())
        } else {
            (ROWS, THREADS)
        };
        let row_blocks = (
            s.value_dim.div_ceil(rows) as u32,
            s.heads as u32,
            s.batch as u32,
        );
        // SAFETY: gdn_state_pass_<t>(const T* k, const float* w, float* u, const float* g,
        // const float* initial_state, int has_initial, float* states, float* final_state,
        // int T_len, int heads, int K, int V, int n_chunks), or gdn_state_tc_r<G>_s<S>(const u16* k,
        // const u16* w, u16* u (U~ in, U out), const float* g, const float* initial_state,
        // int has_initial, u16* states, float* final_state, int T_len, int heads,
        // int K, int V, int n_chunks), or gdn_state_w<G>_s<S>_k<K>v<V> with the same
        // arguments, K and V the compiled-in sizes (StateWalk::for_shape takes it only there):
        // blocks (⌈V / rows⌉ row blocks, head, batch entry) own
        // disjoint rows of the state, of U and of the states scratch (V a multiple of 16 and K
        // of 32 on the tensor-core path, `tc_shared_bytes`, and of the walk's rows:
        // StateWalk::for_shape takes 32 only where V is a multiple of 32); the scratch is what the launch
        // before filled (same stream); the initial state is read only when has_initial is 1,
        // and then holds B·H·V·K floats.
        unsafe { l.launch(cfg(row_blocks, threads, smem[1]))? };
        let mut l = gpu.stream.launch_builder(&self.kernels[2]);
        l.arg(q).arg(k);
        if tc {
            l.arg(&self.u16).arg(&self.g).arg(&self.states16);
        } else {
            l.arg(&self.u).arg(&self.g).arg(&self.states);
        }
        l.arg(&mut *o).arg(&t_len).arg(&heads).arg(&kd).arg(&vd);
        // SAFETY: gdn_output_<t>(const T* q, const T* k, const float* u, const float* g,
        // const float* states, T* o, int T_len, int heads, int K, int V), or gdn_output_tc (or
        // gdn_output_tc_k<K>v<V> after a whole-row walk, K and V its compiled-in sizes), the
        // same with bf16 q, k, o and u16* u and states: blocks (chunk, head, batch entry) read
        // the scratch the two launches before wrote for their chunk and write their chunk's
        // rows of o below T.
        unsafe { l.launch(cfg(per_chunk, THREADS, smem[2]))? };
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(key_dim: usize, value_dim: usize) -> DeltaShape {
        DeltaShape {
            batch: 1,
            seq_len: 1,
            heads: 1,
            key_dim,
            value_dim,
        }
    }

    #[test]
    fn shared_memory_is_counted_in_floats() {
        let l = CHUNK;
        // K = 64 pads to 65 floats, K = 33 stays odd.
        assert_eq!(
            shared_bytes(shape(64, 32)),
            [
                ((2 * l * 65 + l * 32 + l * l + 2 * l) * 4) as u32,
                ((16 * 65 + 2 * l * 65 + l * 17 + l) * 4) as u32,
                ((2 * l * 65 + 32 * 65 + l * 32 + l * l + l) * 4) as u32,
            ]
        );
        assert_eq!(
            shared_bytes(shape(33, 8))[1],
            ((16 + 2 * l) * 33 + l * 17 + l) as u32 * 4
        );
        // K = V = 128, the largest: the output kernel's 177.25 KiB fit in 227 KiB.
        assert_eq!(shared_bytes(shape(128, 128))[2], 181_504);
        assert!(shared_bytes(shape(MAX_DIM, MAX_DIM))
            .iter()
            .all(|&b| b <= MAX_SHARED));
        // The tensor-core path at K = V = 128: the fused walk of 32 rows, three stages of 64
        // floats, 64 rows of 40 halves (U~), 3 × 64 of 136 (W, k, q) and 64 of 72 (M),
        // nothing else, and no output kernel.
        let tc = tc_shared_bytes(shape(128, 128), Dtype::Bf16, false).unwrap();
        assert_eq!(
            tc[1],
            (3 * (64 * 4 + 64 * 40 * 2 + 3 * 64 * 136 * 2 + 64 * 72 * 2)) as u32
        );
        assert_eq!(tc[2], 0);
        // The fused preparation loads q ([L][K + 8] bf16) over T's place ([L][L + 4] floats).
        for (_, _, d) in FUSED_WALKS {
            assert!(CHUNK * (d + 8) * 2 <= CHUNK * (CHUNK + 4) * 4, "K = {d}");
        }
        // At 64 version 9's walk: 16 rows, four stages of g, U~'s 16 columns, W and k, and
        // nothing after them; then the output kernel (g, q and k, U, the entering state, M).
        let [_, walk, output] = tc_shared_bytes(shape(64, 64), Dtype::Bf16, false).unwrap();
        assert_eq!(walk, (4 * (64 * 4 + 64 * 24 * 2 + 2 * 64 * 72 * 2)) as u32);
        assert_eq!(
            output,
            (64 * 4 + (2 * 64 * 72 + 64 * 72 + 64 * 72 + 64 * 72) * 2) as u32
        );
        // K = 64, V = 128: version 4's walk, its state rows and decayed U after the stages.
        assert_eq!(
            tc_shared_bytes(shape(64, 128), Dtype::Bf16, false).unwrap()[1],
            (4 * (64 * 4 + 64 * 40 * 2 + 2 * 64 * 72 * 2) + 32 * 72 * 2 + 64 * 40 * 2) as u32
        );
        // V = 64: 16 rows a block, two stages.
        assert_eq!(
            tc_shared_bytes(shape(128, 64), Dtype::Bf16, false).unwrap()[1],
            (2 * (64 * 4 + 64 * 24 * 2 + 2 * 64 * 136 * 2) + 16 * 136 * 2 + 64 * 24 * 2) as u32
        );
        // The output kernel where it runs, K = 128 and V = 96: g, q and k, U, the entering
        // state and M.
        assert_eq!(
            tc_shared_bytes(shape(128, 96), Dtype::Bf16, false).unwrap()[2],
            (64 * 4 + (2 * 64 * 136 + 64 * 104 + 96 * 136 + 64 * 72) * 2) as u32
        );
        assert!(tc.iter().all(|&b| b <= MAX_SHARED));
        // Version 10 on Hopper: stages of g, U~'s BV + 8 halves, W, q and k (L × K) and M
        // (L × L), then the state (K × BV) and U and U_dec (L × BV); under 227 KiB.
        for (bv, stages, d) in WGMMA_WALKS {
            let [_, walk, output] = tc_shared_bytes(shape(d, d), Dtype::Bf16, true).unwrap();
            let stage = 64 * 4 + 64 * (bv + 8) * 2 + (3 * 64 * d + 64 * 64) * 2;
            assert_eq!(walk, (stages * stage + (d * bv + 2 * 64 * bv) * 2) as u32);
            assert!(walk <= MAX_SHARED);
            assert_eq!(output, 0);
        }
        assert_eq!(tc_shared_bytes(shape(128, 128), Dtype::F32, false), None);
        assert_eq!(tc_shared_bytes(shape(48, 64), Dtype::Bf16, false), None);
        assert_eq!(tc_shared_bytes(shape(64, 40), Dtype::Bf16, false), None);
    }

    #[test]
    fn entry_points_are_named_once() {
        let e = entry_points();
        assert_eq!(
            e,
            [
                "gdn_prepare_f32",
                "gdn_state_pass_f32",
                "gdn_output_f32",
                "gdn_prepare_bf16",
                "gdn_state_pass_bf16",
                "gdn_output_bf16",
                "gdn_prepare_tc",
                "gdn_prepare_tc_k64v64",
                "gdn_prepare_tcm_k64v64",
                "gdn_prepare_tcm_k128v128",
                "gdn_state_tc_r1_s2",
                "gdn_state_tc_r2_s4",
                "gdn_state_w1_s4_k64v64",
                "gdn_walk_out_w2_s3_k128v128",
                "gdn_walk_wg_r32_s3_k128v128",
                "gdn_walk_wg_r16_s4_k64v64",
                "gdn_output_tc",
                "gdn_output_tc_k64v64"
            ]
        );
        for d in FUSED_PREPARE_SIZES {
            assert!(DELTA_SRC.contains(&format!("GDN_PREPARE_TCM(_k{d}v{d},")));
        }
        for (_, _, d) in FUSED_WALKS.iter().chain(&WGMMA_WALKS) {
            assert!(FUSED_PREPARE_SIZES.contains(d), "{d}");
        }
        for (c, s, d) in WGMMA_WALKS {
            assert!(DELTA_SRC.contains(&format!("GDN_WALK_WG({c}, {s}, {d}, {d})")));
            assert_eq!(d / c, 4, "four blocks a head");
        }
        for x in ["_k64v64,", ","] {
            assert!(DELTA_SRC.contains(&format!("GDN_PREPARE_TC({x}")), "{x}");
            assert!(DELTA_SRC.contains(&format!("GDN_OUTPUT_TC({x}")), "{x}");
        }
        assert_eq!(dims_suffix(shape(128, 128)), "_k128v128");
        assert_eq!(dims_suffix(shape(64, 64)), "_k64v64");
        assert_eq!(dims_suffix(shape(64, 128)), "");
        for (g, s) in TC_STATE_WALKS {
            assert!(DELTA_SRC.contains(&format!("GDN_STATE_TC({g}, {s})")));
        }
        for (w, s, d) in FUSED_WALKS {
            assert!(DELTA_SRC.contains(&format!("GDN_WALK_OUT({w}, {s}, {d}, {d})")));
        }
        for (w, s, d) in WHOLE_ROW_WALKS {
            assert!(DELTA_SRC.contains(&format!("GDN_STATE_W({w}, {s}, {d}, {d})")));
        }
        // Every shape with a constant-size suffix finds its walk instantiated with it: the
        // fused walk and its preparation with M at 128, version 9's walk with the preparation
        // and output compiled for it at 64.
        for (d, fused) in [(64, false), (128, true)] {
            let s = shape(d, d);
            let walk = StateWalk::for_shape(s, false);
            let name = format!("{}{}", walk.entry_point(), dims_suffix(s));
            assert!(e.contains(&name), "{name}");
            assert!(walk.whole_rows);
            assert_eq!(walk.fused, fused);
            let prepare = if fused {
                TC_FUSED_PREPARE
            } else {
                TC_KERNELS[0]
            };
            assert!(e.contains(&format!("{prepare}{}", dims_suffix(s))));
            assert_eq!(
                e.contains(&format!("{}{}", TC_KERNELS[1], dims_suffix(s))),
                !fused
            );
        }
        // On Hopper both sizes take version 10 (with the preparation that writes M); other
        // shapes the same walks as elsewhere.
        for d in [64, 128] {
            let s = shape(d, d);
            let walk = StateWalk::for_shape(s, true);
            assert!(walk.wgmma && walk.fused && !walk.whole_rows);
            assert_eq!((walk.threads(), d / walk.rows()), (128, 4));
            let name = format!("{}{}", walk.entry_point(), dims_suffix(s));
            assert!(e.contains(&name), "{name}");
            assert!(e.contains(&format!("{TC_FUSED_PREPARE}{}", dims_suffix(s))));
        }
        for hopper in [false, true] {
            let walk = StateWalk::for_shape(shape(128, 96), hopper);
            assert!(!walk.fused && !walk.whole_rows && !walk.wgmma);
        }
        assert!(DELTA_SRC.contains(&format!("#define GDN_TC_ROWS {TC_ROWS}")));
        assert!(DELTA_SRC.contains(&format!("#define GDN_TC_THREADS {TC_STATE_THREADS}")));
        for k in KERNELS {
            assert!(DELTA_SRC.contains(&format!("{k}_##NAME(")), "{k}");
        }
        assert!(DELTA_SRC.contains("GDN_ENTRIES(f32, float)"));
        assert!(DELTA_SRC.contains("GDN_ENTRIES(bf16, u16)"));
        // The constants agree with the source's.
        assert!(DELTA_SRC.contains(&format!("#define GDN_CHUNK {CHUNK}")));
        assert!(DELTA_SRC.contains(&format!("#define GDN_THREADS {THREADS}")));
        assert!(DELTA_SRC.contains(&format!("#define GDN_MAX_DIM {MAX_DIM}")));
        assert!(DELTA_SRC.contains(&format!("#define GDN_ROWS {ROWS}")));
    }
}
