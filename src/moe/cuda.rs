//! The grouped GEMM on CUDA: `kernels/moe/grouped_gemm.cu` (mma.sync, sm_80+), compiled by
//! NVRTC at run time with the sequence-mixer prelude, launched on a persistent grid: the
//! forward `y = x · w[e]`, and the backward's `dX = dY · w[e]ᵀ` and `dW[e] = x_eᵀ · dY_e`, one
//! launch each for all experts whatever their row counts (empty groups included). Layouts are
//! [`super::reference::grouped_matmul`]'s: `x` `[M, K]` rows in expert order, `w` `[E, K, N]`,
//! `offsets` `[E + 1]` (int32), bf16 or fp16 operands ([`Dtype`], chosen when the kernels are
//! compiled) held as their bits (`u16`), float32 accumulation, results in the operands' type
//! rounded to nearest even.

use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig, PushKernelArg};

use crate::gpu::{Gpu, GpuError};
use crate::sequence_mixers::cuda::with_prelude;

/// The kernel source (`kernels/moe/grouped_gemm.cu`).
pub const GROUPED_GEMM_SRC: &str = include_str!("../../kernels/moe/grouped_gemm.cu");

/// What NVRTC compiles for bf16: the sequence-mixer prelude (16-bit packing, mma.sync,
/// ldmatrix, cp.async), then [`GROUPED_GEMM_SRC`].
pub fn source() -> String {
    with_prelude(GROUPED_GEMM_SRC)
}

/// [`source`] for `dtype`: fp16 defines `GG_BF16` as 0 first (the kernels then multiply on
/// `mma.sync ... .f16.f16` and round their results to fp16).
pub fn source_for(dtype: Dtype) -> String {
    match dtype {
        Dtype::Bf16 => source(),
        Dtype::F16 => format!("#define GG_BF16 0\n{}", source()),
    }
}

/// The 16-bit element type of a grouped GEMM's operands and results, held as their bits
/// (`u16`); products accumulate in float32 and results are rounded to nearest even.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Dtype {
    /// bfloat16 (8 exponent bits, 7 mantissa bits).
    #[default]
    Bf16,
    /// IEEE half precision, fp16 (5 exponent bits, 10 mantissa bits; finite up to 65504).
    F16,
}

impl Dtype {
    /// The type's name as case parameters and documents spell dtypes: `bf16` or `fp16`.
    pub fn name(self) -> &'static str {
        match self {
            Dtype::Bf16 => "bf16",
            Dtype::F16 => "fp16",
        }
    }

    /// The type named `name` ([`Dtype::name`]), if any.
    pub fn parse(name: &str) -> Option<Dtype> {
        match name {
            "bf16" => Some(Dtype::Bf16),
            "fp16" => Some(Dtype::F16),
            _ => None,
        }
    }

    /// The bits of `v` in this type, rounded to nearest even.
    pub fn bits_from_f64(self, v: f64) -> u16 {
        match self {
            Dtype::Bf16 => half::bf16::from_f64(v).to_bits(),
            Dtype::F16 => half::f16::from_f64(v).to_bits(),
        }
    }

    /// The value of `bits` in this type (exact).
    pub fn to_f64(self, bits: u16) -> f64 {
        match self {
            Dtype::Bf16 => half::bf16::from_bits(bits).to_f64(),
            Dtype::F16 => half::f16::from_bits(bits).to_f64(),
        }
    }
}

/// The kernels' names: the forward, dX, dW.
pub const ENTRY_POINTS: [&str; 3] = ["grouped_gemm_fwd", "grouped_gemm_dx", "grouped_gemm_dw"];

/// Threads per block (`GG_THREADS`).
pub const THREADS: u32 = 256;
/// The output tile, rows and columns (`GG_BM`, `GG_BN`).
pub const TILE: usize = 128;
/// Blocks per SM the persistent grid launches (the kernels' `__launch_bounds__` minimum).
pub const BLOCKS_PER_SM: usize = 2;
/// Shared memory of the pipeline's stages, bytes (`GG_SMEM_TILE_BYTES`: 4 stages of a
/// 128 × 40 and a 32 × 136 bf16 tile, each the larger of the two).
const STAGE_BYTES: u32 = 4 * 2 * 2 * 128 * 40;

/// Dynamic shared memory of a launch over `groups` groups: the stages and the groups' tile
/// prefix (`groups + 1` int32).
pub fn shared_bytes(groups: usize) -> u32 {
    STAGE_BYTES + 4 * (groups as u32 + 1)
}

/// The three products of a grouped GEMM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Product {
    /// `y[M, N] = x[M, K] · w[e][K, N]` per group.
    Forward,
    /// `dx[M, K] = dy[M, N] · w[e]ᵀ` per group.
    Dx,
    /// `dw[e][K, N] = x_eᵀ · dy_e` (zeros for an empty group).
    Dw,
}

/// An upper bound on the output tiles of `product` over `groups` groups holding `rows` rows
/// in all (the exact count needs the offsets, which stay on the device): the persistent grid
/// never launches more blocks than this.
pub fn max_tiles(product: Product, rows: usize, groups: usize, k: usize, n: usize) -> usize {
    tiles_bound(product, rows, groups, k, n, (TILE, TILE))
}

/// [`max_tiles`] for output tiles of `bm` rows × `bn` columns: ⌈rows_e / bm⌉ ≤ rows_e / bm + 1
/// for each non-empty group, summed.
pub(crate) fn tiles_bound(
    product: Product,
    rows: usize,
    groups: usize,
    k: usize,
    n: usize,
    (bm, bn): (usize, usize),
) -> usize {
    let row_tiles = rows / bm + groups.min(rows);
    match product {
        Product::Forward => row_tiles * n.div_ceil(bn),
        Product::Dx => row_tiles * k.div_ceil(bn),
        Product::Dw => groups * k.div_ceil(bm) * n.div_ceil(bn),
    }
}

/// The launch checks both kernels share: 1 to `groups_cap` groups, M, K, N within int32, and
/// buffer lengths `lens`
/// (a, b, c) that fit `product`'s shape at `rows` × K × N over `groups` groups (an empty tensor
/// travels as one unread element: the driver refuses zero bytes). `kernel` names the kernel in
/// the error.
pub(crate) fn check_buffers(
    kernel: &str,
    product: Product,
    lens: (usize, usize, usize),
    (groups, groups_cap): (usize, usize),
    (rows, k, n): (usize, usize, usize),
) -> Result<(), GpuError> {
    if groups == 0 || groups > groups_cap {
        return Err(GpuError::Config(format!(
            "{kernel}: {groups} groups, this instance takes 1 to {groups_cap}"
        )));
    }
    // The kernels take M, K, N and the group count as int32.
    if [rows, k, n, groups]
        .iter()
        .any(|&v| i32::try_from(v).is_err())
    {
        return Err(GpuError::Config(format!(
            "{kernel}: M = {rows}, K = {k}, N = {n} or {groups} groups above i32::MAX"
        )));
    }
    let want = match product {
        Product::Forward => (rows * k, groups * k * n, rows * n),
        Product::Dx => (rows * n, groups * k * n, rows * k),
        Product::Dw => (rows * k, rows * n, groups * k * n),
    };
    for (what, have, want) in [
        ("a", lens.0, want.0),
        ("b", lens.1, want.1),
        ("c", lens.2, want.2),
    ] {
        if have != want && !(want == 0 && have == 1) {
            return Err(GpuError::Config(format!(
                "{kernel} {product:?}: `{what}` holds {have} elements, the shape needs {want}"
            )));
        }
    }
    Ok(())
}

/// The three compiled products of one grouped-GEMM source (forward, dX, dW), what both
/// kernels' launches need beside them.
pub(crate) struct ProductKernels {
    fwd: CudaFunction,
    dx: CudaFunction,
    dw: CudaFunction,
    /// SMs of the device (the persistent grids are sized by it).
    pub(crate) sm_count: usize,
    /// The dynamic shared memory the functions were raised to (their tile prefix's groups).
    pub(crate) groups_cap: usize,
    /// NVRTC compile and module load time, s (0 when this process had compiled the source).
    pub(crate) compile_s: f64,
}

impl ProductKernels {
    /// Compiles `src` (as file `name`) and loads `entries` (forward, dX, dW) with their
    /// dynamic shared memory raised to `smem` bytes, for launches over up to `max_groups`.
    pub(crate) fn load(
        gpu: &Gpu,
        name: &str,
        src: &str,
        entries: [&str; 3],
        smem: u32,
        max_groups: usize,
    ) -> Result<ProductKernels, GpuError> {
        let compiled = gpu.compile(name, src)?;
        let f = |entry: &str| gpu.function(&compiled.module, entry, smem);
        Ok(ProductKernels {
            fwd: f(entries[0])?,
            dx: f(entries[1])?,
            dw: f(entries[2])?,
            sm_count: gpu.describe()?.sm_count.map_or(1, |n| n as usize),
            groups_cap: max_groups,
            compile_s: compiled.compile_s,
        })
    }

    /// The function of `product`.
    pub(crate) fn of(&self, product: Product) -> &CudaFunction {
        match product {
            Product::Forward => &self.fwd,
            Product::Dx => &self.dx,
            Product::Dw => &self.dw,
        }
    }
}

/// The compiled kernels.
pub struct GroupedGemm {
    k: ProductKernels,
    /// The operands' and results' type.
    dtype: Dtype,
    /// NVRTC compile and module load time, s (0 when this process had compiled the source).
    pub compile_s: f64,
}

impl GroupedGemm {
    /// Compiles the kernels for `dtype` operands (once per process; [`Gpu::compile`] caches)
    /// for launches over up to `max_groups` groups.
    ///
    /// # Errors
    /// [`GpuError::Compile`] with NVRTC's log; driver errors from loading.
    pub fn new(gpu: &Gpu, max_groups: usize, dtype: Dtype) -> Result<GroupedGemm, GpuError> {
        let k = ProductKernels::load(
            gpu,
            "grouped_gemm.cu",
            &source_for(dtype),
            ENTRY_POINTS,
            shared_bytes(max_groups),
            max_groups,
        )?;
        Ok(GroupedGemm {
            compile_s: k.compile_s,
            k,
            dtype,
        })
    }

    /// Launches one product (asynchronous on [`Gpu::stream`]). `a` is x (forward, dW) or dy
    /// (dX); `b` is w (forward, dX) or dy (dW); `c` the output y `[M, N]`, dx `[M, K]` or dw
    /// `[E, K, N]`. `offsets` `[E + 1]` should be non-decreasing from 0 to M = `rows`; the
    /// kernels read it on the device and clamp each offset to [0, M] (a group whose offsets
    /// decrease is empty), so bad offsets give wrong rows, never an access out of bounds.
    ///
    /// # Errors
    /// [`GpuError::Config`] for a K or N not a multiple of 8, more groups than [`GroupedGemm::new`]
    /// was given, or a buffer whose length does not fit; driver errors from the launch.
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
        if !k.is_multiple_of(8) || !n.is_multiple_of(8) || k == 0 || n == 0 {
            return Err(GpuError::Config(format!(
                "grouped GEMM: K = {k} and N = {n} must be positive multiples of 8"
            )));
        }
        check_buffers(
            "grouped GEMM",
            product,
            (a.len(), b.len(), c.len()),
            (groups, self.k.groups_cap),
            (rows, k, n),
        )?;
        let tiles = max_tiles(product, rows, groups, k, n);
        if tiles == 0 {
            return Ok(());
        }
        let blocks = tiles.min(self.k.sm_count * BLOCKS_PER_SM) as u32;
        let f = self.k.of(product);
        // Within int32: check_buffers above.
        let (m_i, groups_i, k_i, n_i) = (rows as i32, groups as i32, k as i32, n as i32);
        let mut l = gpu.stream.launch_builder(f);
        l.arg(a)
            .arg(b)
            .arg(c)
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
        // SAFETY: grouped_gemm_<fwd|dx|dw>(const u16* a, const u16* b, u16* c, const int*
        // offsets, int groups, int M, int K, int N): the buffer lengths were checked against
        // the shape above (M = rows), K and N are multiples of 8 (16-byte copies), the shared
        // memory holds the stages and groups + 1 ints, and the function's limit was raised to
        // it in `new` (groups ≤ groups_cap). The kernels read offsets[0..=groups] and clamp
        // each to [0, M], so whatever the offsets hold no row at or past M is read or written.
        unsafe { l.launch(cfg)? };
        Ok(())
    }
}

/// The grouped GEMM a launch runs: the Hopper kernel ([`super::sm90::HopperGroupedGemm`],
/// `grouped_wgmma`) where [`super::sm90::takes`] says so, the portable one ([`GroupedGemm`],
/// `grouped_mma_sync`) elsewhere. Both take the same arguments.
pub enum GroupedKernel {
    /// `kernels/moe/grouped_gemm.cu` (mma.sync, sm_80+).
    MmaSync(GroupedGemm),
    /// `kernels/moe/grouped_gemm_sm90.cu` (wgmma and TMA, sm_90a).
    Wgmma(super::sm90::HopperGroupedGemm),
}

/// The names of the two kernels: the Hopper one (in the notes of `grouped_matmul`'s rows on
/// compute capability 9.0), the portable one (also an implementation of its own in documents).
pub const IMPLEMENTATIONS: [&str; 2] = ["grouped_wgmma", "grouped_mma_sync"];

/// The Hopper kernel with its forward and dW on 128 × 256 tiles whatever N
/// ([`super::sm90::TallUse::Never`], the dispatch before the tall tiles): a variant for tests
/// and probes, taken by [`GroupedKernel::named`] and never by the dispatch.
pub const WIDE_VARIANT: &str = "grouped_wgmma_wide";
/// The Hopper kernel with its forward and dW on 256 × 128 tiles wherever N is an odd multiple of 128
/// ([`super::sm90::TallUse::Always`], whatever the group sizes): a variant for tests and probes.
pub const TALL_VARIANT: &str = "grouped_wgmma_tall";
/// The Hopper kernel with its forward on two-block clusters that multicast the weights
/// ([`super::sm90::MC_ENTRY`], 128 × 256 tiles whatever N; dX and dW as the dispatch): a variant
/// for tests and probes.
pub const MC_VARIANT: &str = "grouped_wgmma_mc";

impl GroupedKernel {
    /// The dispatch: compiles the kernel that runs K × N weights of `dtype` on this device for
    /// up to `max_groups` groups (wgmma on compute capability 9.0 when K and N are multiples of
    /// 64 and the groups at most [`super::sm90::MAX_GROUPS`], mma.sync otherwise; the same rule
    /// for bf16 and fp16).
    ///
    /// # Errors
    /// NVRTC's log; driver errors from loading.
    pub fn for_shape(
        gpu: &Gpu,
        max_groups: usize,
        k: usize,
        n: usize,
        dtype: Dtype,
    ) -> Result<GroupedKernel, GpuError> {
        if super::sm90::takes(&gpu.arch(), max_groups, k, n) {
            Ok(GroupedKernel::Wgmma(super::sm90::HopperGroupedGemm::new(
                gpu, max_groups, dtype,
            )?))
        } else {
            Ok(GroupedKernel::MmaSync(GroupedGemm::new(
                gpu, max_groups, dtype,
            )?))
        }
    }

    /// The kernel by implementation name ([`IMPLEMENTATIONS`], [`WIDE_VARIANT`],
    /// [`TALL_VARIANT`] or [`MC_VARIANT`]) for `dtype` operands.
    ///
    /// # Errors
    /// [`GpuError::Config`] for another name, or a wgmma kernel (`grouped_wgmma` or either
    /// variant) off compute capability 9.0; NVRTC's log; driver errors.
    pub fn named(
        gpu: &Gpu,
        name: &str,
        max_groups: usize,
        dtype: Dtype,
    ) -> Result<GroupedKernel, GpuError> {
        match name {
            "grouped_wgmma" => Ok(GroupedKernel::Wgmma(super::sm90::HopperGroupedGemm::new(
                gpu, max_groups, dtype,
            )?)),
            "grouped_mma_sync" => Ok(GroupedKernel::MmaSync(GroupedGemm::new(
                gpu, max_groups, dtype,
            )?)),
            MC_VARIANT => Ok(GroupedKernel::Wgmma(
                super::sm90::HopperGroupedGemm::with_multicast(gpu, max_groups, dtype)?,
            )),
            WIDE_VARIANT | TALL_VARIANT => {
                let tall_use = if name == WIDE_VARIANT {
                    super::sm90::TallUse::Never
                } else {
                    super::sm90::TallUse::Always
                };
                Ok(GroupedKernel::Wgmma(
                    super::sm90::HopperGroupedGemm::with_tall_use(
                        gpu, max_groups, tall_use, dtype,
                    )?,
                ))
            }
            other => Err(GpuError::Config(format!(
                "no grouped GEMM kernel named `{other}` (kernels: {IMPLEMENTATIONS:?} and the variants {WIDE_VARIANT}, {TALL_VARIANT}, {MC_VARIANT})"
            ))),
        }
    }

    /// The implementation's name in documents.
    pub fn implementation(&self) -> &'static str {
        match self {
            GroupedKernel::Wgmma(k) if k.multicast() => MC_VARIANT,
            GroupedKernel::Wgmma(k) => match k.tall_use() {
                super::sm90::TallUse::Never => WIDE_VARIANT,
                super::sm90::TallUse::CostModel => IMPLEMENTATIONS[0],
                super::sm90::TallUse::Always => TALL_VARIANT,
            },
            GroupedKernel::MmaSync(_) => IMPLEMENTATIONS[1],
        }
    }

    /// The operands' and results' type.
    pub fn dtype(&self) -> Dtype {
        match self {
            GroupedKernel::Wgmma(k) => k.dtype(),
            GroupedKernel::MmaSync(k) => k.dtype,
        }
    }

    /// NVRTC compile and module load time, s.
    pub fn compile_s(&self) -> f64 {
        match self {
            GroupedKernel::Wgmma(k) => k.compile_s,
            GroupedKernel::MmaSync(k) => k.compile_s,
        }
    }

    /// One product, as [`GroupedGemm::launch`] (the Hopper kernel also needs K and N multiples
    /// of 64). The buffers must hold bits of the kernel's [`GroupedKernel::dtype`]: both types
    /// travel as `u16`, so bits of the other one are not detected (the results are then wrong).
    ///
    /// # Errors
    /// As the kernel's `launch`.
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
        match self {
            GroupedKernel::Wgmma(g) => g.launch(gpu, product, a, b, c, offsets, rows, k, n),
            GroupedKernel::MmaSync(g) => g.launch(gpu, product, a, b, c, offsets, rows, k, n),
        }
    }
}

/// `grouped_matmul` on the device: y `[M, N]` = x `[M, K]` · w\[e\] `[K, N]` for each group's
/// rows (`offsets` `[E + 1]` int32 on the device, M = `rows`), operands and result in the
/// kernel's [`Dtype`] (bf16 or fp16, [`GroupedKernel::dtype`]; bits of the other type are not
/// detected) as their bits, float32 accumulation, by `kernel` (usually [`GroupedKernel::for_shape`]'s pick); y is
/// allocated on the stream. The float64 definition is [`super::reference::grouped_matmul`].
///
/// # Errors
/// As [`GroupedKernel::launch`]; an out-of-memory error from the allocation.
#[allow(clippy::too_many_arguments)]
pub fn grouped_matmul(
    gpu: &Gpu,
    kernel: &GroupedKernel,
    x: &CudaSlice<u16>,
    w: &CudaSlice<u16>,
    offsets: &CudaSlice<i32>,
    rows: usize,
    k: usize,
    n: usize,
) -> Result<CudaSlice<u16>, GpuError> {
    let mut y = gpu.stream.alloc_zeros::<u16>((rows * n).max(1))?;
    if rows == 0 {
        return Ok(y);
    }
    kernel.launch(gpu, Product::Forward, x, w, &mut y, offsets, rows, k, n)?;
    Ok(y)
}

/// The backward of [`grouped_matmul`] for the output gradient `dy` `[M, N]`: dX `[M, K]` =
/// dy · w\[e\]ᵀ per group and dW `[E, K, N]` = x_eᵀ · dy_e (zeros for an empty group), both
/// allocated on the stream. The float64 definition is
/// [`super::reference::grouped_matmul_backward`].
///
/// # Errors
/// As [`GroupedKernel::launch`]; an out-of-memory error from the allocations.
#[allow(clippy::too_many_arguments)]
pub fn grouped_matmul_backward(
    gpu: &Gpu,
    kernel: &GroupedKernel,
    x: &CudaSlice<u16>,
    w: &CudaSlice<u16>,
    dy: &CudaSlice<u16>,
    offsets: &CudaSlice<i32>,
    rows: usize,
    k: usize,
    n: usize,
) -> Result<(CudaSlice<u16>, CudaSlice<u16>), GpuError> {
    let groups = offsets.len().saturating_sub(1);
    let mut dx = gpu.stream.alloc_zeros::<u16>((rows * k).max(1))?;
    let mut dw = gpu.stream.alloc_zeros::<u16>((groups * k * n).max(1))?;
    if rows > 0 {
        kernel.launch(gpu, Product::Dx, dy, w, &mut dx, offsets, rows, k, n)?;
    }
    kernel.launch(gpu, Product::Dw, x, dy, &mut dw, offsets, rows, k, n)?;
    Ok((dx, dw))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dtypes_name_round_and_decode() {
        for t in [Dtype::Bf16, Dtype::F16] {
            assert_eq!(Dtype::parse(t.name()), Some(t));
            assert_eq!(t.to_f64(t.bits_from_f64(1.5)), 1.5);
        }
        assert_eq!(Dtype::parse("fp32"), None);
        // fp16 keeps 10 mantissa bits and overflows past 65504; bf16 keeps 7 and the range.
        assert_eq!(
            Dtype::F16.to_f64(Dtype::F16.bits_from_f64(1.0 + 1.0 / 1024.0)),
            1.0 + 1.0 / 1024.0
        );
        assert_eq!(
            Dtype::Bf16.to_f64(Dtype::Bf16.bits_from_f64(1.0 + 1.0 / 1024.0)),
            1.0
        );
        assert!(Dtype::F16
            .to_f64(Dtype::F16.bits_from_f64(70000.0))
            .is_infinite());
        assert_eq!(
            Dtype::Bf16.to_f64(Dtype::Bf16.bits_from_f64(65536.0)),
            65536.0
        );
        // The fp16 source defines the kernels' type first; bf16 is the file as it is.
        assert_eq!(source_for(Dtype::Bf16), source());
        assert!(source_for(Dtype::F16).starts_with("#define GG_BF16 0\n"));
        assert!(GROUPED_GEMM_SRC.contains("#define gg_mma mma_f16"));
    }

    #[test]
    fn constants_match_the_kernel_source() {
        let def = |name: &str| -> usize {
            crate::moe::source_define(GROUPED_GEMM_SRC, name)
                .unwrap_or_else(|| panic!("{name} not defined"))
        };
        let (bm, bn, bk, stages) = (def("GG_BM"), def("GG_BN"), def("GG_BK"), def("GG_STAGES"));
        assert_eq!((bm, bn, def("GG_THREADS")), (TILE, TILE, THREADS as usize));
        // Each operand's tile is the larger of its two padded layouts (GG_A_HALVES).
        let halves = (bm * (bk + 8)).max(bk * (bm + 8));
        assert_eq!(STAGE_BYTES as usize, stages * 2 * halves * 2);
        assert!(
            GROUPED_GEMM_SRC.contains(&format!("__launch_bounds__(GG_THREADS, {BLOCKS_PER_SM})"))
        );
    }

    #[test]
    fn launch_checks_name_the_buffer_and_the_groups() {
        let ok = check_buffers(
            "k",
            Product::Dw,
            (6 * 8, 6 * 16, 2 * 8 * 16),
            (2, 4),
            (6, 8, 16),
        );
        assert!(ok.is_ok(), "{ok:?}");
        // No rows: x and dy travel as one element each; dW is still E · K · N.
        assert!(check_buffers("k", Product::Dw, (1, 1, 2 * 8 * 16), (2, 4), (0, 8, 16)).is_ok());
        let e = check_buffers(
            "k",
            Product::Forward,
            (6 * 8, 2 * 8 * 16, 6 * 15),
            (2, 4),
            (6, 8, 16),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("`c` holds 90 elements, the shape needs 96"),
            "{e}"
        );
        let e = check_buffers("k", Product::Dx, (0, 0, 0), (5, 4), (0, 8, 16))
            .unwrap_err()
            .to_string();
        assert!(e.contains("5 groups, this instance takes 1 to 4"), "{e}");
    }

    #[test]
    fn shared_memory_fits_two_blocks_per_sm() {
        // 228 KB per SM on Hopper, 1 KB of it reserved per block.
        assert!(2 * (shared_bytes(128) + 1024) <= 228 * 1024);
        assert_eq!(shared_bytes(0), STAGE_BYTES + 4);
    }

    #[test]
    fn tile_bounds_cover_every_split_of_the_rows() {
        // Each group's ⌈rows_e / 128⌉ ≤ rows_e / 128 + 1 for a non-empty group, so the bound
        // holds for any split; check it against a few.
        for counts in [
            vec![5, 0, 0, 3, 0, 1, 0, 7],
            vec![0, 0],
            vec![300, 1, 129],
            vec![128; 4],
        ] {
            let rows: usize = counts.iter().sum();
            let exact: usize = counts.iter().map(|c| c.div_ceil(TILE)).sum();
            let bound = max_tiles(Product::Forward, rows, counts.len(), 256, 256);
            assert!(exact * 2 <= bound, "{counts:?}: {exact} x 2 > {bound}");
        }
        assert_eq!(max_tiles(Product::Dw, 0, 3, 256, 384), 3 * 2 * 3);
        assert_eq!(max_tiles(Product::Forward, 0, 3, 256, 384), 0);
    }
}
