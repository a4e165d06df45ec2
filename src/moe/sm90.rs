//! The grouped GEMM on Hopper (compute capability 9.0, `sm_90a`): `kernels/moe/grouped_gemm_sm90.cu`,
//! the same three products as [`super::cuda::GroupedGemm`] (forward `y = x · w[e]`, `dX = dY ·
//! w[e]ᵀ`, `dW[e] = x_eᵀ · dY_e`, one launch each for all experts, ragged and empty groups) on
//! `wgmma` with TMA loads, a producer warpgroup and two consumer warpgroups, 128 × 256 output
//! tiles (256 × 128 for the forward, and dW where [`TALL_DW_DISPATCHED`], where N is an odd
//! multiple of 128 and [`tall_pays`]: [`TALL_ENTRY`], [`TALL_DW_ENTRY`]) on a persistent grid
//! of one block per SM. Layouts are
//! [`super::reference::grouped_matmul`]'s: `x` `[M, K]` rows in expert order, `w` `[E, K, N]`,
//! `offsets` `[E + 1]` int32, bf16 or fp16 operands ([`super::cuda::Dtype`], chosen when the
//! kernels are compiled) as their bits (`u16`), float32 accumulation, results in the operands'
//! type rounded to nearest even. K and N must be multiples of 64 (the TMA boxes' width);
//! [`takes`] says when it runs, and the portable kernel runs everything else.

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use super::cuda::{Dtype, Product};
use crate::attention::cuda::PRELUDE_SRC;
use crate::attention::sm90::{tma_map_bf16, WGMMA_SRC};
use crate::gpu::{Gpu, GpuError};

/// The kernel source (`kernels/moe/grouped_gemm_sm90.cu`).
pub const GROUPED_GEMM_SM90_SRC: &str = include_str!("../../kernels/moe/grouped_gemm_sm90.cu");

/// What NVRTC compiles for bf16 (for `sm_90a` only): the attention prelude, the Hopper building
/// blocks of `kernels/attn_wgmma_sm90.cu` (TMA, mbarriers, descriptors; none of its kernels),
/// then [`GROUPED_GEMM_SM90_SRC`].
pub fn source() -> String {
    format!("{PRELUDE_SRC}\n{WGMMA_SRC}\n{GROUPED_GEMM_SM90_SRC}\n")
}

/// [`source`] for `dtype`: fp16 defines `KP_WG_BF16` as 0 first (the wgmma instructions then
/// take `.f16` operands and the epilogue rounds to fp16; the tensor maps only move 16-bit
/// elements, so they are the same for both types).
pub fn source_for(dtype: Dtype) -> String {
    match dtype {
        Dtype::Bf16 => source(),
        Dtype::F16 => format!("#define KP_WG_BF16 0\n{}", source()),
    }
}

/// [`source`] (bf16) with the multicast forward ([`MC_ENTRY`]) too (`GS_WITH_MC`): the variant
/// `grouped_wgmma_mc`'s module; the dispatch's leaves it out (it would add about a fifth to
/// every process's compile).
pub fn source_with_multicast() -> String {
    source_with_multicast_for(Dtype::Bf16)
}

/// [`source_with_multicast`] for `dtype` (as [`source_for`]).
pub fn source_with_multicast_for(dtype: Dtype) -> String {
    format!("#define GS_WITH_MC\n{}", source_for(dtype))
}

/// The kernels' names: the forward, dX, dW.
pub const ENTRY_POINTS: [&str; 3] = [
    "grouped_gemm_sm90_fwd",
    "grouped_gemm_sm90_dx",
    "grouped_gemm_sm90_dw",
];

/// The forward on 256 × 128 tiles (`TALL` in the kernel): for N an odd multiple of
/// 128 (N = 1408 = 11 × 128, the small experts of the grid), where the 128 × 256 tiles leave
/// the last column tile half empty (which the probe in `kernels/TUNING-moe.md` found to cost
/// 17–19 %); [`HopperGroupedGemm::new`] runs it for the forward wherever [`tall_pays`],
/// [`HopperGroupedGemm::with_tall_use`] as told ([`TallUse`]).
pub const TALL_ENTRY: &str = "grouped_gemm_sm90_fwd_tall";
/// dW on 256 × 128 tiles (256 of K's rows, 128 of N's columns; `TALL` with MODE 2), for the
/// same N and by the same rule ([`tall_pays`] with every group's K rows).
pub const TALL_DW_ENTRY: &str = "grouped_gemm_sm90_dw_tall";
/// Whether the dispatch ([`TallUse::CostModel`]) runs dW on the tall tiles: yes since the GPU
/// tests passed with [`TALL_DW_ENTRY`] (84cbece) and the probe in `kernels/TUNING-moe.md` timed
/// it 1.01–1.13× faster than the wide tiles at N = 1408 on every shape it ran.
pub const TALL_DW_DISPATCHED: bool = true;
/// The forward on 128 × 256 tiles in two-block clusters (`MC` in the kernel): the two blocks of
/// a cluster take two row tiles of one group and column band, each brings its own A and half
/// of B, which TMA multicasts into both (`.multicast::cluster`), halving B's reads from L2 (the
/// weights, re-read by every row tile of a group). Run by the variant `grouped_wgmma_mc`
/// ([`HopperGroupedGemm::with_multicast`]), not by the dispatch: written after the 8-expert
/// rows' clocks (`kernels/TUNING-moe.md`), to be measured in the probe first.
pub const MC_ENTRY: &str = "grouped_gemm_sm90_fwd_mc";
/// The tall tiles' shape, rows × columns (the forward's and dW's, [`TALL_ENTRY`] and
/// [`TALL_DW_ENTRY`]).
pub const TALL_TILE: (usize, usize) = (256, 128);

/// True when the tall tiles ([`TALL_TILE`]) cover N with whole tiles where the 128 × 256 tiles
/// do not: N an odd multiple of 128.
pub fn tall_fits(n: usize) -> bool {
    n.is_multiple_of(TALL_TILE.1) && !n.is_multiple_of(TILE.1)
}

/// The cost of a 128 × 256 tile whose last 128 columns are past N (run as m64n128k16), in
/// whole tiles: the probe in `kernels/TUNING-moe.md` ran N = 1408 (5.5 × 256) 1.10–1.13×
/// faster on the tall tiles than on the wide ones at 2,048 and 8,192 rows a group, which puts
/// the half tile at about 1.1 whole ones (5 + h = 1.11 × 5.5).
const HALF_TILE_COST: f64 = 1.1;

/// True when the tall tiles are expected to beat the wide ones for `rows` rows of C over
/// `groups` groups (the forward's rows, or K · groups for dW), N = `n` ([`tall_fits`] must
/// hold too): a cost model in whole-tile times, with every group taken at the mean size
/// r = rows / groups (the forward's group sizes stay on the device),
/// ⌈r / 256⌉ · N / 128 tall tiles against ⌈r / 128⌉ · (⌊N / 256⌋ + [`HALF_TILE_COST`]) wide
/// ones. Fitted before the short tall tile (a last tile of at most 128 rows split between the
/// consumers by columns), when the tall tiles lost where a group's last 256 rows were mostly
/// empty: at 384 rows a group (N = 1408) the probe measured them 1.26× slower (522 against 656
/// TFLOP/s), at 256 and 512 rows 1.04–1.05× faster. The short tile left that unchanged (522
/// against 658 at 84cbece: it still loads 256 rows of A for 128 rows of products), so the model
/// stands as fitted.
pub fn tall_pays(rows: usize, groups: usize, n: usize) -> bool {
    if groups == 0 || !tall_fits(n) {
        return false;
    }
    let r = rows.div_ceil(groups).max(1);
    let tall = (r.div_ceil(TALL_TILE.0) * (n / TALL_TILE.1)) as f64;
    let wide = r.div_ceil(TILE.0) as f64 * ((n / TILE.1) as f64 + HALF_TILE_COST);
    tall < wide
}

/// Threads per block (`GS_THREADS`: a producer and two consumer warpgroups).
pub const THREADS: u32 = 384;
/// The output tile, rows × columns (`GS_BM`, `GS_BN`).
pub const TILE: (usize, usize) = (128, 256);
/// Reduction elements per stage (`GS_BK`) and stages (`GS_ST`).
const STEP: usize = 64;
const STAGES: usize = 4;

/// The epilogue's shared-memory buffers: two 64 × 64 16-bit subtiles per consumer warpgroup.
const EPILOGUE_BYTES: usize = 2 * 2 * 64 * 64 * 2;

/// Dynamic shared memory of a launch over `groups` groups: up to 1023 bytes to align the base
/// for the 128-byte swizzle, the stages (a 128 × 64 and a 64 × 256 16-bit tile each), the
/// epilogue's four 64 × 64 16-bit buffers, two mbarriers a stage and the groups' tile prefix
/// (`groups + 1` int32).
pub fn shared_bytes(groups: usize) -> u32 {
    let stage = 2 * (TILE.0 * STEP + STEP * TILE.1);
    (1024 + STAGES * stage + EPILOGUE_BYTES + 16 * STAGES + 4 * (groups + 1)) as u32
}

/// An upper bound on the output tiles of `product` over `groups` groups holding `rows` rows in
/// all (the exact count needs the offsets, which stay on the device).
pub fn max_tiles(product: Product, rows: usize, groups: usize, k: usize, n: usize) -> usize {
    super::cuda::tiles_bound(product, rows, groups, k, n, TILE)
}

/// The most groups a launch takes: their tile prefix shares the block's 227 KB of shared
/// memory with the stages and the epilogue's buffers.
pub const MAX_GROUPS: usize = 256;

/// True when [`HopperGroupedGemm`] runs a grouped GEMM over up to `groups` groups of K × N
/// weights on a device of architecture `arch` ([`Gpu::arch`]): `sm_90a`, at most
/// [`MAX_GROUPS`] groups and [`shape_ok`].
pub fn takes(arch: &str, groups: usize, k: usize, n: usize) -> bool {
    arch == "sm_90a" && groups <= MAX_GROUPS && shape_ok(k, n)
}

/// K and N positive multiples of 64 (the TMA boxes' width), the shapes the kernels take.
pub fn shape_ok(k: usize, n: usize) -> bool {
    k > 0 && n > 0 && k.is_multiple_of(STEP) && n.is_multiple_of(STEP)
}

/// Where the forward and dW run on the tall tiles ([`TALL_ENTRY`], [`TALL_DW_ENTRY`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TallUse {
    /// Never: 128 × 256 tiles whatever N and the group sizes (`grouped_wgmma_wide`).
    Never,
    /// Where [`tall_pays`] (the dispatch, `grouped_wgmma`; dW only if [`TALL_DW_DISPATCHED`]).
    CostModel,
    /// Wherever [`tall_fits`] N, whatever the group sizes (`grouped_wgmma_tall`).
    Always,
}

/// The compiled Hopper kernels.
pub struct HopperGroupedGemm {
    k: super::cuda::ProductKernels,
    /// The tall forward ([`TALL_ENTRY`]) and dW ([`TALL_DW_ENTRY`]).
    tall: [cudarc::driver::CudaFunction; 2],
    /// Where the forward and dW run on them.
    tall_use: TallUse,
    /// The multicast forward ([`MC_ENTRY`]), where this instance runs the forward on it.
    mc: Option<cudarc::driver::CudaFunction>,
    /// The operands' and results' type.
    dtype: Dtype,
    /// NVRTC compile and module load time, s (0 when this process had compiled the source).
    pub compile_s: f64,
}

impl HopperGroupedGemm {
    /// Compiles the kernels (once per process) for launches over up to `max_groups` groups;
    /// the forward runs on the tall tiles ([`TALL_ENTRY`]) wherever [`tall_pays`], and dW
    /// ([`TALL_DW_ENTRY`]) by the same rule where [`TALL_DW_DISPATCHED`].
    ///
    /// # Errors
    /// [`GpuError::Config`] on a device that is not compute capability 9.0 or for more than
    /// [`MAX_GROUPS`] groups; NVRTC's log; driver errors from loading.
    pub fn new(gpu: &Gpu, max_groups: usize, dtype: Dtype) -> Result<HopperGroupedGemm, GpuError> {
        if gpu.arch() != "sm_90a" {
            return Err(GpuError::Config(format!(
                "the wgmma grouped GEMM needs compute capability 9.0 (sm_90a), not {}",
                gpu.arch()
            )));
        }
        if max_groups > MAX_GROUPS {
            return Err(GpuError::Config(format!(
                "the wgmma grouped GEMM takes up to {MAX_GROUPS} groups, not {max_groups}"
            )));
        }
        let k = super::cuda::ProductKernels::load(
            gpu,
            "grouped_gemm_sm90.cu",
            &source_for(dtype),
            ENTRY_POINTS,
            shared_bytes(max_groups),
            max_groups,
        )?;
        // The same source: the compile is the cached one.
        let compiled = gpu.compile("grouped_gemm_sm90.cu", &source_for(dtype))?;
        let tall = [
            gpu.function(&compiled.module, TALL_ENTRY, shared_bytes(max_groups))?,
            gpu.function(&compiled.module, TALL_DW_ENTRY, shared_bytes(max_groups))?,
        ];
        Ok(HopperGroupedGemm {
            compile_s: k.compile_s,
            k,
            tall,
            tall_use: TallUse::CostModel,
            mc: None,
            dtype,
        })
    }

    /// As [`HopperGroupedGemm::new`], with the forward on the multicast kernel ([`MC_ENTRY`],
    /// 128 × 256 tiles whatever N: the variant `grouped_wgmma_mc`); dX and dW as the dispatch.
    ///
    /// # Errors
    /// As [`HopperGroupedGemm::new`].
    pub fn with_multicast(
        gpu: &Gpu,
        max_groups: usize,
        dtype: Dtype,
    ) -> Result<HopperGroupedGemm, GpuError> {
        let mut k = HopperGroupedGemm::with_tall_use(gpu, max_groups, TallUse::Never, dtype)?;
        let compiled = gpu.compile("grouped_gemm_sm90_mc.cu", &source_with_multicast_for(dtype))?;
        k.mc = Some(gpu.function(&compiled.module, MC_ENTRY, shared_bytes(max_groups))?);
        k.compile_s += compiled.compile_s;
        Ok(k)
    }

    /// The operands' and results' type.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// Whether this instance runs the forward on the multicast kernel.
    pub fn multicast(&self) -> bool {
        self.mc.is_some()
    }

    /// As [`HopperGroupedGemm::new`], with the forward's and dW's tiles chosen by `tall_use` (the
    /// variants `grouped_wgmma_wide` and `grouped_wgmma_tall`, which tests and the probe run
    /// beside the dispatch).
    ///
    /// # Errors
    /// As [`HopperGroupedGemm::new`].
    pub fn with_tall_use(
        gpu: &Gpu,
        max_groups: usize,
        tall_use: TallUse,
        dtype: Dtype,
    ) -> Result<HopperGroupedGemm, GpuError> {
        let mut k = HopperGroupedGemm::new(gpu, max_groups, dtype)?;
        k.tall_use = tall_use;
        Ok(k)
    }

    /// Where this instance runs the forward and dW on the tall tiles.
    pub fn tall_use(&self) -> TallUse {
        self.tall_use
    }

    /// Launches one product (asynchronous on [`Gpu::stream`]), arguments as
    /// [`super::cuda::GroupedGemm::launch`]: `a` is x (forward, dW) or dy (dX), `b` w (forward,
    /// dX) or dy (dW), `c` y `[M, N]`, dx `[M, K]` or dw `[E, K, N]`; the kernels clamp each
    /// offset to [0, M] on the device.
    ///
    /// # Errors
    /// [`GpuError::Config`] for K or N not a positive multiple of 64, more groups than
    /// [`HopperGroupedGemm::new`] was given, or a buffer whose length does not fit; the driver's
    /// errors from encoding the tensor maps and launching.
    #[allow(clippy::too_many_arguments)]
    pub fn launch(
        &self,
        gpu: &Gpu,
        product: Product,
        a: &CudaSlice<u16>,
        b: &CudaSlice<u16>,
        c: &mut CudaSlice<u16>,
        offsets: &CudaSlice<i32>,
        rows: usize,
        k: usize,
        n: usize,
    ) -> Result<(), GpuError> {
        let groups = offsets.len().saturating_sub(1);
        if !shape_ok(k, n) {
            return Err(GpuError::Config(format!(
                "wgmma grouped GEMM: K = {k} and N = {n} must be positive multiples of 64"
            )));
        }
        super::cuda::check_buffers(
            "wgmma grouped GEMM",
            product,
            (a.len(), b.len(), c.len()),
            (groups, self.k.groups_cap),
            (rows, k, n),
        )?;
        // The forward's C rows are the groups' rows; dW's are K in every group.
        let c_rows = match product {
            Product::Forward => Some(rows),
            Product::Dw => Some(k * groups),
            Product::Dx => None,
        };
        let dispatched = product == Product::Forward || TALL_DW_DISPATCHED;
        let use_tall = match (self.tall_use, c_rows) {
            (TallUse::CostModel, Some(r)) => dispatched && tall_pays(r, groups, n),
            (TallUse::Always, Some(_)) => tall_fits(n),
            _ => false,
        };
        let tall = use_tall.then(|| &self.tall[usize::from(product == Product::Dw)]);
        let tiles = if tall.is_some() {
            super::cuda::tiles_bound(product, rows, groups, k, n, TALL_TILE)
        } else {
            max_tiles(product, rows, groups, k, n)
        };
        if tiles == 0 {
            return Ok(());
        }
        // A tensor map needs a dimension of at least one row: an empty x or dy (M = 0) has
        // no tile to load (tiles = 0 above for forward and dX; dW's tiles all have no step).
        let m_map = rows.max(1);
        let (a_ptr, _ga) = a.device_ptr(&gpu.stream);
        let (b_ptr, _gb) = b.device_ptr(&gpu.stream);
        // C travels as its address (the kernel stores to it through map_c and directly).
        let (c_ptr, _gc) = c.device_ptr_mut(&gpu.stream);
        // The epilogue stores 64 × 64 subtiles of C.
        let (map_a, map_b, map_c) = match product {
            Product::Forward => (
                tma_map_bf16(a_ptr, (1, m_map, k), TILE.0 as u32)?,
                tma_map_bf16(b_ptr, (groups, k, n), STEP as u32)?,
                tma_map_bf16(c_ptr, (1, m_map, n), STEP as u32)?,
            ),
            Product::Dx => (
                tma_map_bf16(a_ptr, (1, m_map, n), TILE.0 as u32)?,
                tma_map_bf16(b_ptr, (groups, k, n), TILE.1 as u32)?,
                tma_map_bf16(c_ptr, (1, m_map, k), STEP as u32)?,
            ),
            Product::Dw => (
                tma_map_bf16(a_ptr, (1, m_map, k), STEP as u32)?,
                tma_map_bf16(b_ptr, (1, m_map, n), STEP as u32)?,
                tma_map_bf16(c_ptr, (groups, k, n), STEP as u32)?,
            ),
        };
        // The tall forward reads A in the same 128-row boxes (two a stage) and B in the same
        // 64-column panels (two a stage), the tall dW x and dY in the same 64-wide panels (four
        // and two a stage), and both store the same 64 × 64 subtiles: the same maps.
        let mc = self
            .mc
            .as_ref()
            .filter(|_| product == Product::Forward && tall.is_none());
        let f = mc.unwrap_or_else(|| tall.unwrap_or_else(|| self.k.of(product)));
        // The multicast kernel's grid is whole two-block clusters, each walking pairs of row
        // tiles (at most `tiles` of them).
        let blocks = if mc.is_some() {
            2 * tiles.min(self.k.sm_count / 2).max(1) as u32
        } else {
            tiles.min(self.k.sm_count) as u32
        };
        // Within int32: check_buffers above.
        let (m_i, groups_i, k_i, n_i) = (rows as i32, groups as i32, k as i32, n as i32);
        let mut l = gpu.stream.launch_builder(f);
        l.arg(&map_a)
            .arg(&map_b)
            .arg(&map_c)
            .arg(&c_ptr)
            .arg(offsets)
            .arg(&groups_i)
            .arg(&m_i)
            .arg(&k_i)
            .arg(&n_i);
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: shared_bytes(groups),
        };
        // SAFETY: grouped_gemm_sm90_<fwd|dx|dw|fwd_tall|dw_tall|fwd_mc>(TmaMap map_a, TmaMap map_b,
        // TmaMap map_c, u16* c, const int* offsets, int groups, int M, int K, int N) (the tall
        // ones only for their product where tall_fits(n), over the tall tiles' bound above;
        // dw_tall stores only through map_c): the maps
        // describe `a`, `b`
        // and `c` with the shapes their lengths were checked against (TMA reads and writes
        // nothing outside them; loads fill zeros past their ends, stores skip those elements),
        // except at M = 0, where a map of x or dy spans one row over a one-element buffer: then
        // no tile has a reduction step or a row (forward and dX have no tile, dW's tiles have no
        // step), so TMA reads nothing through it; the kernels store (through map_c or `c`) only
        // rows below M (forward, dX) or below K in each of the `groups` planes (dW), columns
        // below N (or K for dX); offsets holds groups + 1 ints, each clamped to [0, M]; the
        // shared memory was raised to shared_bytes(groups_cap) ≥ shared_bytes(groups) in `new`.
        unsafe { l.launch(cfg)? };
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constants_match_the_kernel_source() {
        let def = |name: &str| -> usize {
            crate::moe::source_define(GROUPED_GEMM_SM90_SRC, name)
                .unwrap_or_else(|| panic!("{name} not defined"))
        };
        assert_eq!((def("GS_BM"), def("GS_BN")), TILE);
        assert_eq!((def("GS_BK"), def("GS_ST")), (STEP, STAGES));
        assert_eq!(def("GS_THREADS"), THREADS as usize);
    }

    #[test]
    fn shared_memory_fits_one_block_per_sm() {
        // 227 KB of dynamic shared memory per block on Hopper.
        assert!(shared_bytes(MAX_GROUPS) <= 227 * 1024);
        assert_eq!(shared_bytes(0), 1024 + 4 * 49152 + 4 * 8192 + 64 + 4);
    }

    #[test]
    fn takes_sm_90a_at_multiples_of_64() {
        assert!(takes("sm_90a", 64, 2048, 1408));
        assert!(takes("sm_90a", MAX_GROUPS, 2048, 1408));
        assert!(!takes("sm_90a", MAX_GROUPS + 1, 2048, 1408));
        assert!(!takes("sm_90a", 64, 2048, 1400));
        assert!(!takes("sm_90a", 64, 0, 64));
        assert!(!takes("sm_80", 64, 2048, 1408));
    }

    #[test]
    fn tile_bounds_cover_every_split_of_the_rows() {
        for counts in [
            vec![5, 0, 0, 3, 0, 1, 0, 7],
            vec![300, 1, 129],
            vec![128; 4],
        ] {
            let rows: usize = counts.iter().sum();
            let exact: usize = counts.iter().map(|c| c.div_ceil(TILE.0)).sum();
            assert!(exact * 2 <= max_tiles(Product::Forward, rows, counts.len(), 256, 512));
        }
        assert_eq!(max_tiles(Product::Dw, 0, 3, 256, 384), 3 * 2 * 2);
    }

    #[test]
    fn the_tall_tiles_run_where_the_cost_model_favours_them() {
        // N = 1408: the grid's groups (256 to 8192 rows) on the tall tiles; 384 rows a group
        // (where the probe measured the tall tiles 1.26x slower) and 128 on the wide ones.
        for per in [256, 512, 1024, 2048, 8192] {
            assert!(tall_pays(64 * per, 64, 1408), "{per}");
        }
        for per in [128, 384] {
            assert!(!tall_pays(64 * per, 64, 1408), "{per}");
        }
        // Never where N is a multiple of 256 or for no group.
        assert!(!tall_pays(64 * 2048, 64, 1536) && !tall_pays(0, 0, 1408));
    }

    #[test]
    fn the_tall_forward_is_for_odd_multiples_of_128() {
        assert!(tall_fits(1408) && tall_fits(128) && tall_fits(384));
        assert!(!tall_fits(1536) && !tall_fits(256) && !tall_fits(192) && !tall_fits(1400));
        assert!(GROUPED_GEMM_SM90_SRC.contains(&format!("GS_ENTRY({TALL_ENTRY}, 0, true)")));
        assert!(GROUPED_GEMM_SM90_SRC.contains(&format!("GS_ENTRY({TALL_DW_ENTRY}, 2, true)")));
        // Its stage holds two 128-row boxes of A and two 64-column panels of B: the same
        // bytes as the 128 × 256 tile's stage.
        assert_eq!(
            2 * (TALL_TILE.0 * STEP + STEP * TALL_TILE.1),
            2 * (TILE.0 * STEP + STEP * TILE.1)
        );
    }
}
