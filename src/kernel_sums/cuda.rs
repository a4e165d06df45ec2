//! Kernel sums on CUDA in float32: `kernels/kernel_sums/kernel_sums.cu`, compiled by NVRTC at
//! run time, one entry point per case.
//!
//! The kernels follow the map-reduce scheme of KeOps (Charlier, Feydy, Glaunès, Collin, Durif,
//! "Kernel Operations on the GPU, with Autodiff, without Memory Overflows", JMLR 22(74), 2021):
//! each thread owns one or two rows of X in registers, the block streams Y through shared
//! memory in tiles, and every (i, j) pair is reduced at once, so nothing of size N × M exists,
//! on the device or anywhere else. `kernel_lse` keeps a running maximum (base-2 exponentials,
//! rescaled when the maximum grows) and accumulates Σ p·(y − x) alongside for the gradient
//! (Σ p·y in the any-dimension kernel); each tile's or chunk's partial sums are added to the
//! totals with Kahan compensation (up to 4 columns of b; the any-dimension gradient, kept in
//! global memory, adds plainly).
//!
//! Entry points ([`entry_point`]): `rbf_mv_d{1,2,3}_c{1,4,16,64}`, `kde_d{1,2,3}`,
//! `kernel_lse_d{1,2,3}`, `kernel_lse_grad_d{1,2,3}` with the dimension a compile-time
//! constant (point clouds), and `rbf_mv_dn_c{1,4,16,64}`, `kde_dn`, `kernel_lse_dn`,
//! `kernel_lse_grad_dn` for any dimension (features). For 4 ≤ D ≤ [`TC_MAX_DIM`] the sums
//! with one column of b and the log-sum-exp with or without its gradient run instead on
//! tensor cores (`rbf_mv_tc`, `kde_tc`, `kernel_lse_tc`, `kernel_lse_grad_tc` and the
//! `_split_tc` forms, [`uses_tensor_cores`]): the squared distance expanded around a centre c
//! (the mean of Y's first 256 points) as ‖x − c‖² + ‖y − c‖² − 2 (x − c)·(y − c), the cross
//! terms a GEMM tile on `mma.sync` TF32 with each operand split into two TF32 parts (3 MMAs per
//! product, about float32's accuracy; the split follows the "3xTF32" emulation of float32 GEMMs
//! that CUTLASS ships), and the gradient's Σ p·(y − c) a second such product. `c{CT}` is the column tile of `rbf_mv`:
//! the smallest of 1, 4, 16, 64 that holds C, and tiles of 64 columns (one grid row each) past
//! 64. `kernels/TUNING-kernel-sums.md` has the cost model, ptxas's register counts and what is
//! not measured yet.

use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig, PushKernelArg};

use super::{Inputs, KernelSumCase, Op, Scale};
use crate::gpu::{Gpu, GpuError};

/// The CUDA source of every kernel-sum entry point ([`entry_points`] names them).
pub const KERNEL_SUMS_SRC: &str = include_str!("../../kernels/kernel_sums/kernel_sums.cu");

/// Threads per block of every entry point (`KS_THREADS` in the source).
pub const THREADS: u32 = 128;

/// Dimensions with their own compile-time entry points; every other dimension takes the `_dn`
/// kernels.
pub const SMALL_DIMS: [usize; 3] = [1, 2, 3];

/// Column tiles of `rbf_mv` (columns per thread, `CT` in the source).
pub const COLUMN_TILES: [usize; 4] = [1, 4, 16, 64];

const LOG2E: f64 = std::f64::consts::LOG2_E;

/// Every entry point of [`KERNEL_SUMS_SRC`], in the order the source defines them.
pub fn entry_points() -> Vec<String> {
    let mut v = Vec::new();
    for d in SMALL_DIMS {
        for ct in COLUMN_TILES {
            v.push(format!("rbf_mv_d{d}_c{ct}"));
        }
    }
    for d in SMALL_DIMS {
        v.push(format!("kde_d{d}"));
    }
    for d in SMALL_DIMS {
        v.push(format!("kernel_lse_d{d}"));
        v.push(format!("kernel_lse_grad_d{d}"));
    }
    for d in SMALL_DIMS {
        v.push(format!("kernel_lse_split_d{d}"));
    }
    v.push(COMBINE.to_string());
    for d in SMALL_DIMS {
        v.push(format!("rbf_mv_split_d{d}"));
    }
    for d in SMALL_DIMS {
        v.push(format!("kde_split_d{d}"));
    }
    v.push(SUM_COMBINE.to_string());
    for ct in COLUMN_TILES {
        v.push(format!("rbf_mv_dn_c{ct}"));
    }
    v.extend(["kde_dn", "kernel_lse_dn", "kernel_lse_grad_dn"].map(String::from));
    v.extend(
        [
            "rbf_mv_tc",
            "kde_tc",
            "kernel_lse_tc",
            "rbf_mv_split_tc",
            "kde_split_tc",
            "kernel_lse_split_tc",
            "kernel_lse_grad_tc",
            TC_CENTER,
            TC_PREP,
        ]
        .map(String::from),
    );
    v
}

/// The entry point that computes the tensor-core kernels' centre (the mean of Y's first
/// 256 points), launched first and compiled with each `*_tc` entry point.
pub const TC_CENTER: &str = "kernel_sum_tc_center";

/// The entry point that prepares Y for the tensor-core kernels (centred, split into TF32
/// parts, with each point's exponent term and weight), launched second.
pub const TC_PREP: &str = "kernel_sum_tc_prep";

/// Largest dimension the tensor-core feature kernels (`*_tc`) take; past it the `_dn`
/// kernels run (`KS_TC_DMAX`).
pub const TC_MAX_DIM: usize = 128;

/// Rows of X per block of the tensor-core kernels (`KS_TC_ROWS`: 16 per warp).
pub const TC_ROWS: usize = 64;

/// Points of Y per tile of the tensor-core kernels (`KS_TC_TILE`).
pub const TC_TILE: usize = 64;

/// Whether case `c` runs on the tensor-core feature kernels: 4 ≤ D ≤ [`TC_MAX_DIM`], and the
/// Gaussian matvec with one column, the KDE, or the log-sum-exp with or without its gradient
/// (several columns of b stay on the `_dn` kernels).
pub fn uses_tensor_cores(c: &KernelSumCase) -> bool {
    !SMALL_DIMS.contains(&c.dim)
        && c.dim <= TC_MAX_DIM
        && match c.op {
            Op::RbfMv => c.cols == 1,
            Op::Kde | Op::KernelLse => true,
        }
}

/// The tensor-core kernels' padded sizes (Dp, Mp): `dim` rounded up to 8 features and `m`
/// up to [`TC_TILE`] points (`Dp` and `Mp` in the source).
fn tc_padded(dim: usize, m: usize) -> (usize, usize) {
    (dim.div_ceil(8) * 8, m.div_ceil(TC_TILE) * TC_TILE)
}

/// Dynamic shared memory of a tensor-core kernel at dimension `dim`, bytes: X's block as
/// float32 and two stages of Y's tile as TF32 high and low parts, each row padded to D rounded
/// up to 8, plus 4; and per stage the tile's exponent terms and weights (the layout `ks_tc` in
/// the source describes).
pub fn tc_smem_bytes(dim: usize) -> u32 {
    let stride = tc_padded(dim, 0).0 + 4;
    (((TC_ROWS + 4 * TC_TILE) * stride + 4 * TC_TILE) * 4) as u32
}

/// Y prepared for the tensor-core kernels on the device ([`TC_PREP`]): the centre `[Dp]`, the
/// centred points' TF32 parts `[Mp, Dp]` (Dp = D rounded up to 8, Mp = M rounded up to
/// [`TC_TILE`]), each point's exponent term and weight `[Mp]`; and the two pre-pass kernels.
struct TcWork {
    center: CudaFunction,
    prep: CudaFunction,
    c: CudaSlice<f32>,
    yh: CudaSlice<u32>,
    yl: CudaSlice<u32>,
    yn: CudaSlice<f32>,
    wt: CudaSlice<f32>,
}

impl TcWork {
    fn bytes(&self) -> u64 {
        4 * (self.c.len() + self.yh.len() + self.yl.len() + self.yn.len() + self.wt.len()) as u64
    }
}

/// How one case is launched: the entry point, rows of X per block, the column tile and the
/// grid.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// Entry point name in [`KERNEL_SUMS_SRC`].
    pub entry: String,
    /// Rows of X one block computes: 256 for the small-dimension kernels (2 rows per thread)
    /// except `rbf_mv` with 64-column tiles (128), 128 for the `_dn` kernels and
    /// [`TC_ROWS`] for the tensor-core kernels.
    pub rows_per_block: usize,
    /// Columns of `b` per thread (1 for `kde` and `kernel_lse`).
    pub column_tile: usize,
    /// Grid: (⌈N / rows_per_block⌉, ⌈C / column_tile⌉ or [`Plan::splits`], 1); blocks of
    /// [`THREADS`].
    pub grid: (u32, u32, u32),
    /// Parts Y is split into (`kernel_lse_split_d*`, then [`COMBINE`]; `rbf_mv_split_d*` and
    /// `kde_split_d*`, then [`SUM_COMBINE`]); 1 for every other entry point.
    pub splits: usize,
    /// Points of Y per split (a multiple of the tile, [`TILE`]); M when there is one.
    pub split_len: usize,
    /// Dynamic shared memory per block, bytes ([`tc_smem_bytes`] for the tensor-core
    /// kernels, 0 for the others).
    pub smem_bytes: u32,
}

/// The entry point that merges the split log-sum-exp's partials.
pub const COMBINE: &str = "kernel_lse_combine";

/// The entry point that adds the split Gaussian matvec's and KDE's partial sums.
pub const SUM_COMBINE: &str = "kernel_sum_combine";

impl Plan {
    /// The main kernel's launch: the plan's grid, blocks of [`THREADS`], its dynamic shared
    /// memory.
    pub fn launch_config(&self) -> LaunchConfig {
        LaunchConfig {
            grid_dim: self.grid,
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: self.smem_bytes,
        }
    }

    /// The entry point that merges this plan's partials ([`COMBINE`] or [`SUM_COMBINE`]), and
    /// the floats each row and split leaves (2: maximum and sum; 1: a sum); `None` unsplit.
    pub fn combine(&self) -> Option<(&'static str, usize)> {
        if self.splits <= 1 {
            None
        } else if self.entry.starts_with("kernel_lse_split_") {
            Some((COMBINE, 2))
        } else {
            Some((SUM_COMBINE, 1))
        }
    }
}

/// Y points per shared-memory tile of the small-dimension kernels (`KS_TILE`).
pub const TILE: usize = 128;

/// Blocks a split kernel sum aims for (about eight per SM of an H100 or H200) before it stops
/// splitting Y.
pub const SPLIT_TARGET_BLOCKS: usize = 1024;

/// Fewest points of Y a split takes (two tiles).
pub const SPLIT_MIN_POINTS: usize = 2 * TILE;

/// How many parts a kernel sum at dim ≤ 3 (the log-sum-exp without the gradient, the KDE, the
/// one-column Gaussian matvec) of `row_blocks` blocks of rows over `m` points splits Y into,
/// and the points per part: none (1, m) when the row blocks alone reach
/// [`SPLIT_TARGET_BLOCKS`]; else enough parts to reach it, each (but the last, which takes
/// what remains) at least [`SPLIT_MIN_POINTS`] long and a whole number of tiles. The same rule as
/// `kernels/kernel_sums/emulate_kernel_sums.py`'s `splits`.
pub fn y_splits(row_blocks: usize, m: usize) -> (usize, usize) {
    let want = SPLIT_TARGET_BLOCKS.div_ceil(row_blocks.max(1));
    let most = (m / SPLIT_MIN_POINTS).max(1);
    let parts = want.min(most);
    if parts <= 1 {
        return (1, m);
    }
    let len = m.div_ceil(parts).div_ceil(TILE) * TILE;
    (m.div_ceil(len), len)
}

/// The entry point and launch geometry of case `c`.
///
/// # Errors
/// [`GpuError::Config`] for an invalid case ([`KernelSumCase::validate`]) or one whose grid
/// does not fit CUDA's limits (more than 2³¹ − 1 row blocks or 65,535 column tiles), or whose
/// D or C does not fit a 32-bit int.
pub fn entry_point(c: &KernelSumCase) -> Result<Plan, GpuError> {
    c.validate().map_err(GpuError::Config)?;
    if c.dim > i32::MAX as usize || c.cols > i32::MAX as usize {
        return Err(GpuError::Config(format!(
            "dim {} or cols {} does not fit a 32-bit int",
            c.dim, c.cols
        )));
    }
    let small = SMALL_DIMS.contains(&c.dim);
    let dim = if small {
        format!("d{}", c.dim)
    } else {
        "dn".to_string()
    };
    let column_tile = match c.op {
        Op::RbfMv => COLUMN_TILES
            .into_iter()
            .find(|&t| t >= c.cols)
            .unwrap_or(64),
        Op::Kde | Op::KernelLse => 1,
    };
    let tc = uses_tensor_cores(c);
    let rows_per_thread = if small && column_tile < 64 { 2 } else { 1 };
    let rows_per_block = if tc {
        TC_ROWS
    } else {
        THREADS as usize * rows_per_thread
    };
    let blocks = c.n.div_ceil(rows_per_block);
    let splittable = match c.op {
        Op::KernelLse => !c.grad,
        Op::Kde => true,
        Op::RbfMv => c.cols == 1,
    };
    let (splits, split_len) = if (small || tc) && splittable {
        y_splits(blocks, c.m)
    } else {
        (1, c.m)
    };
    let dim = if tc { "tc".to_string() } else { dim };
    let entry = match (c.op, c.grad) {
        (Op::RbfMv, _) if tc && splits == 1 => "rbf_mv_tc".to_string(),
        (Op::RbfMv, _) if splits > 1 => format!("rbf_mv_split_{dim}"),
        (Op::RbfMv, _) => format!("rbf_mv_{dim}_c{column_tile}"),
        (Op::Kde, _) if splits > 1 => format!("kde_split_{dim}"),
        (Op::Kde, _) => format!("kde_{dim}"),
        (Op::KernelLse, false) if splits > 1 => format!("kernel_lse_split_{dim}"),
        (Op::KernelLse, false) => format!("kernel_lse_{dim}"),
        (Op::KernelLse, true) => format!("kernel_lse_grad_{dim}"),
    };
    let tiles = c.cols.div_ceil(column_tile).max(splits);
    if blocks > i32::MAX as usize || tiles > 65_535 {
        return Err(GpuError::Config(format!(
            "grid of {blocks} × {tiles} blocks is past CUDA's limits (2³¹ − 1 × 65,535)"
        )));
    }
    Ok(Plan {
        entry,
        rows_per_block,
        column_tile,
        grid: (blocks as u32, tiles as u32, 1),
        splits,
        split_len,
        smem_bytes: if tc { tc_smem_bytes(c.dim) } else { 0 },
    })
}

/// The source NVRTC compiles for one entry point: [`KERNEL_SUMS_SRC`] with `KS_ONLY` and
/// `KS_ENTRY_<entry>` defined, so only that entry point (and the templates it uses) is
/// compiled (~0.1–0.6 s instead of ~8 s for all of them).
pub fn entry_source(entry: &str) -> String {
    format!("#define KS_ONLY\n#define KS_ENTRY_{entry}\n{KERNEL_SUMS_SRC}")
}

/// The case's inputs on the device, uploaded once: X `[N, D]`, Y `[M, D]` and the weights
/// (b `[M, C]` for `rbf_mv`, g `[M]` for `kernel_lse`, none for `kde`), float32 row-major.
pub struct DeviceInputs {
    /// X, `[N, D]`.
    pub x: CudaSlice<f32>,
    /// Y, `[M, D]`.
    pub y: CudaSlice<f32>,
    /// b or g; `None` for `kde`.
    pub w: Option<CudaSlice<f32>>,
}

/// Uploads `inp` for case `c`.
///
/// # Errors
/// [`GpuError::Config`] when a host slice does not have the case's length; driver errors
/// (out of memory).
pub fn upload(gpu: &Gpu, c: &KernelSumCase, inp: &Inputs) -> Result<DeviceInputs, GpuError> {
    check_inputs(c, inp)?;
    Ok(DeviceInputs {
        x: gpu.stream.clone_htod(&inp.x)?,
        y: gpu.stream.clone_htod(&inp.y)?,
        w: if c.op == Op::Kde {
            None
        } else {
            Some(gpu.stream.clone_htod(&inp.w)?)
        },
    })
}

fn check_inputs(c: &KernelSumCase, inp: &Inputs) -> Result<(), GpuError> {
    inp.check(c).map_err(GpuError::Config)
}

/// The float32 scalars of a launch: the base-2 exponent scale k (log₂e / 2σ² for `rbf_mv` and
/// `kde`, log₂e / ε for `kernel_lse`) and the second scalar (the `kde` normalisation
/// (2πσ²)^(−D/2) / M, or 2/ε for `kernel_lse`; unused by `rbf_mv`), computed in float64.
///
/// # Errors
/// [`GpuError::Config`] for a σ or ε that is not positive and finite, or scalars that are not
/// finite in float32.
pub fn scalars(c: &KernelSumCase, s: Scale) -> Result<(f32, f32), GpuError> {
    let (k, second) = match c.op {
        Op::RbfMv | Op::Kde => {
            if !(s.sigma > 0.0 && s.sigma.is_finite()) {
                return Err(GpuError::Config(format!("sigma {} is not > 0", s.sigma)));
            }
            let two_s2 = 2.0 * s.sigma * s.sigma;
            let norm = (std::f64::consts::PI * two_s2).powf(-(c.dim as f64) / 2.0) / c.m as f64;
            (LOG2E / two_s2, if c.op == Op::Kde { norm } else { 1.0 })
        }
        Op::KernelLse => {
            if !(s.epsilon > 0.0 && s.epsilon.is_finite()) {
                return Err(GpuError::Config(format!(
                    "epsilon {} is not > 0",
                    s.epsilon
                )));
            }
            (LOG2E / s.epsilon, 2.0 / s.epsilon)
        }
    };
    let (k, second) = (k as f32, second as f32);
    if !(k.is_finite() && second.is_finite()) {
        return Err(GpuError::Config(format!(
            "scalars k = {k}, {second} are not finite in float32 (sigma {}, epsilon {})",
            s.sigma, s.epsilon
        )));
    }
    Ok((k, second))
}

/// One case's compiled entry point and launch geometry. The caller owns the inputs
/// ([`upload`]) and the output; a split kernel sum ([`Plan::splits`] > 1) also holds its
/// partials (2·splits·N floats for the log-sum-exp, splits·N for the others) and the entry
/// point that merges them ([`Plan::combine`]); a tensor-core kernel ([`uses_tensor_cores`])
/// holds Y prepared for it (8·Mp·Dp + 8·Mp + 4·Dp bytes) and its two pre-pass kernels.
pub struct Runner {
    func: CudaFunction,
    plan: Plan,
    /// The merge of a split kernel sum and its partials ([`Plan::combine`]'s floats per row and
    /// split).
    combine: Option<(CudaFunction, CudaSlice<f32>)>,
    /// The tensor-core kernels' prepared Y ([`uses_tensor_cores`]).
    tc: Option<TcWork>,
    /// NVRTC compile and module load time of the entry point, s (0 when this process had
    /// compiled it already).
    pub compile_s: f64,
}

impl Runner {
    /// Compiles the entry point of `c` ([`entry_point`], [`entry_source`]) and loads it.
    ///
    /// # Errors
    /// [`GpuError::Config`] for an invalid case; [`GpuError::Compile`] with the NVRTC log;
    /// driver errors from loading.
    pub fn new(gpu: &Gpu, c: &KernelSumCase) -> Result<Runner, GpuError> {
        let plan = entry_point(c)?;
        let compiled = gpu.compile(
            &format!("kernel_sums_{}.cu", plan.entry),
            &entry_source(&plan.entry),
        )?;
        let func = gpu.function(&compiled.module, &plan.entry, plan.smem_bytes)?;
        let combine = match plan.combine() {
            Some((entry, per_row)) => {
                let part = gpu.stream.alloc_zeros::<f32>(per_row * plan.splits * c.n)?;
                Some((gpu.function(&compiled.module, entry, 0)?, part))
            }
            None => None,
        };
        let tc = if uses_tensor_cores(c) {
            let (dp, mp) = tc_padded(c.dim, c.m);
            Some(TcWork {
                center: gpu.function(&compiled.module, TC_CENTER, 0)?,
                prep: gpu.function(&compiled.module, TC_PREP, 0)?,
                c: gpu.stream.alloc_zeros::<f32>(dp)?,
                yh: gpu.stream.alloc_zeros::<u32>(mp * dp)?,
                yl: gpu.stream.alloc_zeros::<u32>(mp * dp)?,
                yn: gpu.stream.alloc_zeros::<f32>(mp)?,
                wt: gpu.stream.alloc_zeros::<f32>(mp)?,
            })
        } else {
            None
        };
        Ok(Runner {
            func,
            plan,
            combine,
            tc,
            compile_s: compiled.compile_s,
        })
    }

    /// Device bytes the runner holds: a split kernel sum's partials and the tensor-core
    /// kernels' prepared Y (8·Mp·Dp + 8·Mp + 4·Dp bytes).
    pub fn workspace_bytes(&self) -> u64 {
        self.combine.as_ref().map_or(0, |(_, p)| 4 * p.len() as u64)
            + self.tc.as_ref().map_or(0, TcWork::bytes)
    }

    /// The launch geometry.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// Launches one call of `c` on `inp` with scale `s`, writing every element of `out`
    /// (float32, [`KernelSumCase::output_len`] elements: `[N, C]`, `[N]`, or `[N]` then the
    /// `[N, D]` gradient). Asynchronous on [`Gpu::stream`].
    ///
    /// # Errors
    /// [`GpuError::Config`] for buffers of the wrong length, a case other than the runner's
    /// entry point, or a bad σ or ε ([`scalars`]); driver errors from the launch.
    pub fn launch(
        &mut self,
        gpu: &Gpu,
        c: &KernelSumCase,
        s: Scale,
        inp: &DeviceInputs,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        let plan = entry_point(c)?;
        if plan != self.plan {
            return Err(GpuError::Config(format!(
                "the runner was compiled for {}, not {}",
                self.plan.entry, plan.entry
            )));
        }
        let w_len = match c.op {
            Op::RbfMv => c.m * c.cols,
            Op::Kde => 0,
            Op::KernelLse => c.m,
        };
        let lens_ok = inp.x.len() == c.n * c.dim
            && inp.y.len() == c.m * c.dim
            && inp.w.as_ref().map_or(0, |w| w.len()) == w_len
            && (c.op == Op::Kde) == inp.w.is_none()
            && out.len() == c.output_len();
        if !lens_ok {
            return Err(GpuError::Config(format!(
                "device buffers do not match {c:?} (x {}, y {}, w {:?}, out {})",
                inp.x.len(),
                inp.y.len(),
                inp.w.as_ref().map(|w| w.len()),
                out.len()
            )));
        }
        let per_row = self.plan.combine().map_or(0, |(_, f)| f);
        if let Some((_, part)) = &self.combine {
            // The partials were sized for the case `new` was given; another N with the same
            // plan (same row blocks) must not write past them.
            if part.len() < per_row * self.plan.splits * c.n {
                return Err(GpuError::Config(format!(
                    "the runner's partials hold {} floats, {} rows × {} splits need {}",
                    part.len(),
                    c.n,
                    self.plan.splits,
                    per_row * self.plan.splits * c.n
                )));
            }
        }
        let (k, second) = scalars(c, s)?;
        let (n, m) = (c.n as i64, c.m as i64);
        let d = c.dim as i32;
        let cfg = self.plan.launch_config();
        let split_len = self.plan.split_len as i64;
        let split = self.combine.is_some();
        if let Some(tc) = &mut self.tc {
            let (dp, mp) = tc_padded(c.dim, c.m);
            if tc.c.len() != dp || tc.yn.len() != mp {
                return Err(GpuError::Config(format!(
                    "the runner's prepared Y holds {} points of {} floats, {c:?} needs {mp} of {dp}",
                    tc.yn.len(),
                    tc.c.len()
                )));
            }
            let one = LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = gpu.stream.launch_builder(&tc.center);
            b.arg(&inp.y).arg(&m).arg(&d).arg(&mut tc.c);
            // SAFETY: kernel_sum_tc_center(const float* Y, long long M, int D, float* C): Y
            // holds M·D floats (checked above), C the Dp floats it writes (checked above).
            unsafe { b.launch(one)? };
            let op: i32 = match c.op {
                Op::RbfMv => 0,
                Op::Kde => 1,
                Op::KernelLse => 2,
            };
            let mp64 = mp as i64;
            // The KDE reads no weights; Y stands in for the unused pointer.
            let w = inp.w.as_ref().unwrap_or(&inp.y);
            let cfg_prep = LaunchConfig {
                grid_dim: (mp.div_ceil(THREADS as usize) as u32, 1, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = gpu.stream.launch_builder(&tc.prep);
            b.arg(&inp.y)
                .arg(w)
                .arg(&tc.c)
                .arg(&m)
                .arg(&mp64)
                .arg(&d)
                .arg(&k)
                .arg(&op)
                .arg(&mut tc.yh)
                .arg(&mut tc.yl)
                .arg(&mut tc.yn)
                .arg(&mut tc.wt);
            // SAFETY: kernel_sum_tc_prep(const float* Y, const float* W, const float* C,
            // long long M, long long Mp, int D, float k, int op, unsigned* YH, unsigned* YL,
            // float* YN, float* WT): one thread per point j < Mp (guarded), reading Y[j·D + a]
            // and W[j] only for j < M (W is b with one column or g, M floats, checked above;
            // the KDE, op 1, never reads it) and C[0..Dp); writing YH, YL [Mp·Dp] and YN, WT
            // [Mp], the sizes allocated in `new` and checked above.
            unsafe { b.launch(cfg_prep)? };
            // The KDE's normalisation, or 2/ε for the gradient.
            let out_scale = if c.op == Op::Kde || c.grad {
                second
            } else {
                1.0f32
            };
            let mut b = gpu.stream.launch_builder(&self.func);
            b.arg(&inp.x)
                .arg(&tc.c)
                .arg(&tc.yh)
                .arg(&tc.yl)
                .arg(&tc.yn)
                .arg(&tc.wt);
            match &mut self.combine {
                Some((_, part)) => b.arg(part),
                None => b.arg(&mut *out),
            };
            b.arg(&n)
                .arg(&mp64)
                .arg(&d)
                .arg(&k)
                .arg(&out_scale)
                .arg(&split_len);
            // SAFETY: every *_tc entry point takes (const float* X, const float* C,
            // const unsigned* YH, const unsigned* YL, const float* YN, const float* WT,
            // float* out, long long N, long long Mp, int D, float k, float out_scale,
            // long long split_len): X holds N·D floats, the prepared Y the sizes above; a block
            // reads rows [64·blockIdx.x, +64) of X (guarded by N) and prepared points
            // [0, Mp) unsplit, [blockIdx.y·split_len, min(Mp, +split_len)) split, in whole
            // 64-point tiles (split_len a
            // multiple of 128, Mp of 64); it writes out[i] (i < N) unsplit (and, for
            // kernel_lse_grad_tc, out[N + i·D + a] for a < D: out holds N + N·D floats), or
            // part[blockIdx.y·N + i] (one float, two for the log-sum-exp) split, which holds
            // per_row·splits·N floats (checked above).
            unsafe { b.launch(cfg)? };
        } else {
            self.launch_cuda_cores(gpu, c, inp, out, (k, second), split)?;
        }
        self.launch_combine(gpu, c, out, second, per_row)
    }

    /// The launch of every entry point but the tensor-core ones (their arguments differ).
    fn launch_cuda_cores(
        &mut self,
        gpu: &Gpu,
        c: &KernelSumCase,
        inp: &DeviceInputs,
        out: &mut CudaSlice<f32>,
        (k, second): (f32, f32),
        split: bool,
    ) -> Result<(), GpuError> {
        let (n, m) = (c.n as i64, c.m as i64);
        let (d, cols) = (c.dim as i32, c.cols as i32);
        let split_len = self.plan.split_len as i64;
        let cfg = self.plan.launch_config();
        let mut b = gpu.stream.launch_builder(&self.func);
        b.arg(&inp.x).arg(&inp.y);
        if let Some(w) = &inp.w {
            b.arg(w);
        }
        match &mut self.combine {
            Some((_, part)) => b.arg(part),
            None => b.arg(&mut *out),
        };
        b.arg(&n).arg(&m).arg(&d);
        match c.op {
            Op::RbfMv => {
                b.arg(&cols).arg(&k);
            }
            Op::Kde | Op::KernelLse => {
                b.arg(&k).arg(&second);
            }
        }
        if split {
            b.arg(&split_len);
        }
        // SAFETY: the arguments match the entry point's signature in kernel_sums.cu:
        // rbf_mv_* (const float* X, const float* Y, const float* B, float* out, long long N,
        // long long M, int D, int C, float k); kde_* (X, Y, out, N, M, D, k, norm);
        // kernel_lse* (X, Y, G, out, N, M, D, k, two_over_eps). The lengths were checked
        // above: X holds N·D floats, Y M·D, B M·C, G M, out output_len(); the kernels read and
        // write only inside those (64-bit offsets, guarded rows, points and columns), and the
        // grid is the plan's, which covers every row and column tile. A split entry point
        // (kernel_lse_split_d*: X, Y, G, float2* part, N, M, D, k, two_over_eps,
        // long long split_len; rbf_mv_split_d*: X, Y, B, float* part, N, M, D, C = 1, k,
        // split_len; kde_split_d*: X, Y, float* part, N, M, D, k, norm, split_len) writes
        // part[q·N + i] for its split q < grid.y = splits, whose points
        // [q·split_len, min(M, (q+1)·split_len)) lie in Y; the partials hold
        // per_row·splits·N floats (allocated in `new` for this case's N, checked above).
        unsafe { b.launch(cfg)? };
        Ok(())
    }

    /// The merge of a split kernel sum's partials into `out` (nothing unsplit).
    fn launch_combine(
        &mut self,
        gpu: &Gpu,
        c: &KernelSumCase,
        out: &mut CudaSlice<f32>,
        second: f32,
        per_row: usize,
    ) -> Result<(), GpuError> {
        let n = c.n as i64;
        if let Some((combine, part)) = &self.combine {
            let splits = self.plan.splits as i32;
            let cfg = LaunchConfig {
                grid_dim: (c.n.div_ceil(THREADS as usize) as u32, 1, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            // The KDE's normalisation (`second`; 1 for the matvec) scales the merged sums.
            let mut b = gpu.stream.launch_builder(combine);
            b.arg(part).arg(&mut *out).arg(&n).arg(&splits);
            if per_row == 1 {
                b.arg(&second);
            }
            // SAFETY: kernel_lse_combine(const float2* part, float* out, long long N,
            // int splits) and kernel_sum_combine(const float* part, float* out, long long N,
            // int splits, float scale): part holds per_row·splits·N floats (written by the
            // launch above, on the same stream), out at least N floats (checked above: N for
            // the log-sum-exp and the KDE, N·C with C = 1 for the matvec); one thread per row,
            // guarded by N.
            unsafe { b.launch(cfg)? };
        }
        Ok(())
    }
}

/// Repeated kernel log-sum-exp calls over fixed points with new weights each call, as
/// Sinkhorn's soft-min makes them: X `[n, dim]` and Y `[m, dim]` uploaded once and the entry
/// point compiled once; each [`LseSession::call`] copies g `[m]` in, launches, and copies
/// out\[i\] = log Σ_j exp(−‖x_i − y_j‖² / ε + g_j) `[n]` back (synchronising the stream).
pub struct LseSession<'g> {
    gpu: &'g Gpu,
    case: KernelSumCase,
    runner: Runner,
    inp: DeviceInputs,
    out: CudaSlice<f32>,
}

impl<'g> LseSession<'g> {
    /// Uploads `x` `[n, dim]` and `y` `[m, dim]` (float32, row-major) and compiles the entry
    /// point of `kernel_lse` for (n, m, dim).
    ///
    /// # Errors
    /// [`GpuError::Config`] for lengths that are not whole points or an empty cloud; compile
    /// and driver errors.
    pub fn new(gpu: &'g Gpu, x: &[f32], y: &[f32], dim: usize) -> Result<Self, GpuError> {
        if dim == 0
            || x.is_empty()
            || y.is_empty()
            || !x.len().is_multiple_of(dim)
            || !y.len().is_multiple_of(dim)
        {
            return Err(GpuError::Config(format!(
                "LseSession: {} and {} coordinates are not whole, non-empty clouds of dimension {dim}",
                x.len(),
                y.len()
            )));
        }
        let case = KernelSumCase::new(Op::KernelLse, x.len() / dim, y.len() / dim, dim);
        let runner = Runner::new(gpu, &case)?;
        let inp = DeviceInputs {
            x: gpu.stream.clone_htod(x)?,
            y: gpu.stream.clone_htod(y)?,
            w: Some(gpu.stream.alloc_zeros::<f32>(case.m)?),
        };
        let out = gpu.stream.alloc_zeros::<f32>(case.n)?;
        Ok(LseSession {
            gpu,
            case,
            runner,
            inp,
            out,
        })
    }

    /// One call with weights `g` `[m]` and temperature `epsilon`, into `out` `[n]`.
    ///
    /// # Errors
    /// [`GpuError::Config`] for slices of the wrong length or a bad ε ([`scalars`]); driver
    /// errors.
    pub fn call(&mut self, g: &[f32], epsilon: f64, out: &mut [f32]) -> Result<(), GpuError> {
        if g.len() != self.case.m || out.len() != self.case.n {
            return Err(GpuError::Config(format!(
                "LseSession::call: g has {} values for {} points, out {} for {}",
                g.len(),
                self.case.m,
                out.len(),
                self.case.n
            )));
        }
        let stream = &self.gpu.stream;
        stream.memcpy_htod(g, self.inp.w.as_mut().expect("kernel_lse has weights"))?;
        let s = Scale {
            sigma: 1.0,
            epsilon,
        };
        self.runner
            .launch(self.gpu, &self.case, s, &self.inp, &mut self.out)?;
        stream.memcpy_dtoh(&self.out, out)?;
        stream.synchronize()?;
        Ok(())
    }
}

/// The CUDA source of the float64 evaluation of a Sinkhorn plan's rows (`sinkhorn_row_pass`).
pub const SINKHORN_EVAL_SRC: &str = include_str!("../../kernels/kernel_sums/sinkhorn_eval.cu");

/// Rows per block of `sinkhorn_row_pass` (one warp each).
const EVAL_ROWS: usize = 4;

/// The float64 row pass of a Sinkhorn plan on the device, for X `[n, dim]` against Z
/// `[m, dim]` (float32, row-major), β `[m]` and an optional w `[m]` (float64): per row i,
/// (l_i, pc_i, wc_i) with C_ij = ‖x_i − z_j‖²/2, l_i = log Σ_j exp(β_j − C_ij/ε),
/// pc_i = Σ_j p_ij C_ij for p_ij = exp(β_j − C_ij/ε − l_i), and wc_i = Σ_j w_j C_ij (0 without
/// w); (−∞, 0, 0) for a row whose every β_j is −∞. All in float64 (`sinkhorn_eval.cu`), the
/// values `sinkhorn`'s host pass computes, up to the order of the float64 sums. Synchronises.
///
/// # Errors
/// [`GpuError::Config`] when dim is 0, the lengths disagree or ε is not positive and finite;
/// compile and driver errors.
pub fn sinkhorn_row_pass(
    gpu: &Gpu,
    x: &[f32],
    z: &[f32],
    dim: usize,
    beta: &[f64],
    eps: f64,
    w: Option<&[f64]>,
) -> Result<Vec<(f64, f64, f64)>, GpuError> {
    let m = beta.len();
    if dim == 0
        || dim > i32::MAX as usize
        || !x.len().is_multiple_of(dim)
        || z.len() != m * dim
        || w.is_some_and(|w| w.len() != m)
        || !(eps > 0.0 && eps.is_finite())
    {
        return Err(GpuError::Config(format!(
            "sinkhorn_row_pass: x {} and z {} floats, dim {dim}, β {m}, w {:?}, ε {eps}",
            x.len(),
            z.len(),
            w.map(<[f64]>::len)
        )));
    }
    let n = x.len() / dim;
    if n == 0 {
        return Ok(Vec::new());
    }
    let compiled = gpu.compile("sinkhorn_eval.cu", SINKHORN_EVAL_SRC)?;
    let func = gpu.function(&compiled.module, "sinkhorn_row_pass", 0)?;
    let xd = gpu.stream.clone_htod(x)?;
    let zd = gpu.stream.clone_htod(z)?;
    let bd = gpu.stream.clone_htod(beta)?;
    let wd = match w {
        Some(w) => Some(gpu.stream.clone_htod(w)?),
        None => None,
    };
    let mut out = gpu.stream.alloc_zeros::<f64>(3 * n)?;
    let (n64, m64, d32) = (n as i64, m as i64, dim as i32);
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(EVAL_ROWS) as u32, 1, 1),
        block_dim: (32 * EVAL_ROWS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = gpu.stream.launch_builder(&func);
    b.arg(&xd).arg(&zd).arg(&bd);
    let null: u64 = 0;
    match &wd {
        Some(w) => b.arg(w),
        None => b.arg(&null),
    };
    b.arg(&n64).arg(&m64).arg(&d32).arg(&eps).arg(&mut out);
    // SAFETY: sinkhorn_row_pass(const float* X, const float* Z, const double* beta,
    // const double* w, long long n, long long m, int dim, double eps, double* out): X holds
    // n·dim floats, Z m·dim, beta m doubles, w m doubles or is null (a zero pointer, which the
    // kernel tests before reading), out 3·n doubles (checked above); one warp per row i < n
    // (guarded), reading points j < m only.
    unsafe { b.launch(cfg)? };
    let flat = gpu.stream.clone_dtoh(&out)?;
    Ok(flat.chunks_exact(3).map(|r| (r[0], r[1], r[2])).collect())
}

/// The CUDA source of the Sinkhorn half-step epilogue (`sinkhorn_update`).
pub const SINKHORN_UPDATE_SRC: &str = include_str!("../../kernels/kernel_sums/sinkhorn_update.cu");

/// Threads per block of `sinkhorn_update`.
const UPDATE_THREADS: u32 = 256;

/// One direction of the iteration: this cloud's points against the other's, with the other
/// cloud's weights h in `inp.w`.
struct HalfStep {
    case: KernelSumCase,
    runner: Runner,
    /// X = this cloud, Y = the other, w = the other cloud's h.
    inp: DeviceInputs,
    /// log w of this cloud, float64.
    log_w: CudaSlice<f64>,
    /// The log-sum-exp, float32, one per point of this cloud.
    lse: CudaSlice<f32>,
    /// This cloud's potential, float64.
    pot: CudaSlice<f64>,
}

/// Sinkhorn's iteration at one ε held on the device (what the `kernel_sums` runner times per
/// iteration): the same updates as [`super::sinkhorn::SinkhornIterations`] on the CPU, with
/// nothing copied through the host, so that a step is a few asynchronous launches on
/// [`Gpu::stream`] that a CUDA graph can capture.
///
/// A half-step is one kernel log-sum-exp (this cloud against the other, the other's weights
/// h_j = pot_j/ε + log w_j, ε' = 2ε: the cost is ‖x − z‖²/2) and `sinkhorn_update`, which
/// writes this cloud's potential pot_i = −ε·lse_i (float64) and its own h_i. [`DeviceSinkhorn::new`]
/// ends with f⁰ (the x half-step against g = 0); each [`DeviceSinkhorn::step`] updates g from
/// f, then f from g (Cuturi 2013, in the log domain): four launches, six when the
/// log-sum-exps split Y ([`y_splits`]).
///
/// Memory on the device: both clouds twice (float32, `[n, dim]` and `[m, dim]`), and per point
/// its log-weight and potential (float64), h and the log-sum-exp (float32).
pub struct DeviceSinkhorn {
    /// Rows of x: computes f.
    on_x: HalfStep,
    /// Rows of y: computes g.
    on_y: HalfStep,
    update: CudaFunction,
    epsilon: f64,
    /// NVRTC compile and load time of the three entry points, s (0 for those this process had
    /// compiled already).
    pub compile_s: f64,
}

impl DeviceSinkhorn {
    /// Uploads the clouds (`x` `[n, dim]`, `y` `[m, dim]`, float32, already centred as the
    /// caller wants them), their log-weights `log_wx` `[n]` and `log_wy` `[m]`, compiles the
    /// kernels, and computes f⁰ (the soft-min of g = 0) on the stream.
    ///
    /// # Errors
    /// [`GpuError::Config`] for clouds that are not whole non-empty point sets of `dim`,
    /// log-weights of the wrong length, or an ε that is not positive and finite; compile and
    /// driver errors.
    pub fn new(
        gpu: &Gpu,
        x: &[f32],
        y: &[f32],
        dim: usize,
        log_wx: &[f64],
        log_wy: &[f64],
        epsilon: f64,
    ) -> Result<DeviceSinkhorn, GpuError> {
        let whole = |c: &[f32], w: &[f64]| {
            dim > 0 && !c.is_empty() && c.len().is_multiple_of(dim) && c.len() / dim == w.len()
        };
        if !(whole(x, log_wx) && whole(y, log_wy) && epsilon > 0.0 && epsilon.is_finite()) {
            return Err(GpuError::Config(format!(
                "DeviceSinkhorn: {} and {} coordinates with {} and {} log-weights are not two clouds of dimension {dim}, or epsilon {epsilon} is not > 0",
                x.len(),
                y.len(),
                log_wx.len(),
                log_wy.len()
            )));
        }
        let (n, m) = (log_wx.len(), log_wy.len());
        let half = |this: &[f32], other: &[f32], log_w: &[f64], other_log_w: &[f64]| {
            let case = KernelSumCase::new(Op::KernelLse, this.len() / dim, other.len() / dim, dim);
            let runner = Runner::new(gpu, &case)?;
            // The other cloud's h at g = 0 (or f = 0): its log-weights.
            let h: Vec<f32> = other_log_w.iter().map(|v| *v as f32).collect();
            Ok::<_, GpuError>(HalfStep {
                runner,
                inp: DeviceInputs {
                    x: gpu.stream.clone_htod(this)?,
                    y: gpu.stream.clone_htod(other)?,
                    w: Some(gpu.stream.clone_htod(&h)?),
                },
                log_w: gpu.stream.clone_htod(log_w)?,
                lse: gpu.stream.alloc_zeros::<f32>(case.n)?,
                pot: gpu.stream.alloc_zeros::<f64>(case.n)?,
                case,
            })
        };
        let on_x = half(x, y, log_wx, log_wy)?;
        let on_y = half(y, x, log_wy, log_wx)?;
        debug_assert_eq!((on_x.case.n, on_y.case.n), (n, m));
        let compiled = gpu.compile("sinkhorn_update.cu", SINKHORN_UPDATE_SRC)?;
        let update = gpu.function(&compiled.module, "sinkhorn_update", 0)?;
        let mut s = DeviceSinkhorn {
            compile_s: on_x.runner.compile_s + on_y.runner.compile_s + compiled.compile_s,
            on_x,
            on_y,
            update,
            epsilon,
        };
        s.half_step(gpu, true, None)?;
        Ok(s)
    }

    /// One half-step: f from g (`on_x`) or g from f; the new h goes into the other
    /// direction's weights. `copy` also receives the potential.
    fn half_step(
        &mut self,
        gpu: &Gpu,
        on_x: bool,
        copy: Option<&mut CudaSlice<u16>>,
    ) -> Result<(), GpuError> {
        let (this, other) = if on_x {
            (&mut self.on_x, &mut self.on_y)
        } else {
            (&mut self.on_y, &mut self.on_x)
        };
        let s = Scale {
            sigma: 1.0,
            epsilon: 2.0 * self.epsilon,
        };
        if let Some(c) = &copy {
            if c.len() != 4 * this.case.n {
                return Err(GpuError::Config(format!(
                    "the potential's copy holds {} 16-bit words, not 4 × {}",
                    c.len(),
                    this.case.n
                )));
            }
        }
        this.runner
            .launch(gpu, &this.case, s, &this.inp, &mut this.lse)?;
        let n = this.case.n as i64;
        let h = other.inp.w.as_mut().expect("kernel_lse has weights");
        let neg_eps = -self.epsilon;
        let null = 0u64;
        let cfg = LaunchConfig {
            grid_dim: ((this.case.n as u32).div_ceil(UPDATE_THREADS), 1, 1),
            block_dim: (UPDATE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = gpu.stream.launch_builder(&self.update);
        b.arg(&this.lse)
            .arg(&this.log_w)
            .arg(&neg_eps)
            .arg(&mut this.pot)
            .arg(h);
        match copy {
            Some(c) => b.arg(c),
            None => b.arg(&null),
        };
        b.arg(&n);
        // SAFETY: sinkhorn_update(const float* lse, const double* log_w, double neg_eps,
        // double* pot, float* h, double* copy, long long n): lse, log_w and pot hold this
        // cloud's n points, h (the other direction's weights, `[n]` as its Y has n points)
        // too, and copy, when given, n float64 values (4n 16-bit words, checked above); one
        // thread per point, guarded by n.
        unsafe { b.launch(cfg)? };
        Ok(())
    }

    /// One iteration, enqueued on the stream: g from f, then f from g; with `copy`, f is also
    /// written there (float64 as 16-bit words, `[4n]`).
    ///
    /// # Errors
    /// [`GpuError::Config`] for a copy of the wrong length; driver errors from the launches.
    pub fn step(&mut self, gpu: &Gpu, copy: Option<&mut CudaSlice<u16>>) -> Result<(), GpuError> {
        self.half_step(gpu, false, None)?;
        self.half_step(gpu, true, copy)
    }

    /// The potentials (f `[n]`, g `[m]`), read back after the stream's work (synchronises).
    ///
    /// # Errors
    /// Driver errors.
    pub fn potentials(&self, gpu: &Gpu) -> Result<(Vec<f64>, Vec<f64>), GpuError> {
        let f = gpu.stream.clone_dtoh(&self.on_x.pot)?;
        let g = gpu.stream.clone_dtoh(&self.on_y.pot)?;
        gpu.stream.synchronize()?;
        Ok((f, g))
    }

    /// Device bytes the iteration holds: both clouds twice, per point 8 + 8 + 4 + 4, and the
    /// split log-sum-exps' partials.
    pub fn device_bytes(&self) -> u64 {
        let (n, m, d) = (
            self.on_x.case.n as u64,
            self.on_y.case.n as u64,
            self.on_x.case.dim as u64,
        );
        2 * 4 * d * (n + m)
            + 24 * (n + m)
            + self.on_x.runner.workspace_bytes()
            + self.on_y.runner.workspace_bytes()
    }
}

/// Computes case `c` on `inp` with `s` on the device: uploads the inputs, fills the output
/// with NaN (so an element the kernel never writes shows), launches once, waits and
/// downloads. The output is laid out as [`KernelSumCase::output_len`] (float32), like
/// [`super::cpu::compute`]. For tests and checks; a timed runner keeps the [`Runner`] and the
/// device buffers instead.
///
/// # Errors
/// [`GpuError::Config`] for an invalid case or inputs of the wrong length; compile and driver
/// errors (the launch's own errors show at the synchronisation).
pub fn compute(gpu: &Gpu, c: &KernelSumCase, inp: &Inputs, s: Scale) -> Result<Vec<f32>, GpuError> {
    let mut runner = Runner::new(gpu, c)?;
    let dev = upload(gpu, c, inp)?;
    let mut out = gpu.stream.clone_htod(&vec![f32::NAN; c.output_len()])?;
    runner.launch(gpu, c, s, &dev, &mut out)?;
    gpu.stream.synchronize()?;
    gpu.ctx.check_err()?;
    Ok(gpu.stream.clone_dtoh(&out)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn case(op: Op, dim: usize, cols: usize, grad: bool) -> KernelSumCase {
        KernelSumCase {
            cols,
            grad,
            ..KernelSumCase::new(op, 1000, 10, dim)
        }
    }

    #[test]
    fn every_case_has_an_entry_point_in_the_source() {
        let names = entry_points();
        assert_eq!(names.len(), 48);
        // The launch's block size and tile are the ones the kernels are written for.
        assert!(KERNEL_SUMS_SRC.contains(&format!("#define KS_THREADS {THREADS}\n")));
        assert!(KERNEL_SUMS_SRC.contains(&format!("#define KS_TILE {TILE}\n")));
        let launched_with_others = [COMBINE, SUM_COMBINE, TC_CENTER, TC_PREP];
        for name in names
            .iter()
            .filter(|n| !launched_with_others.contains(&n.as_str()))
        {
            // Each entry point has its own selection guard (entry_source relies on it); the
            // combines are compiled with their split entry points.
            assert!(
                KERNEL_SUMS_SRC.contains(&format!("defined(KS_ENTRY_{name})")),
                "{name} has no KS_ENTRY guard"
            );
        }
        for op in Op::ALL {
            for dim in [1, 2, 3, 4, 16, 64, 200] {
                for cols in [1, 2, 3, 4, 5, 16, 17, 64, 65, 300] {
                    if op != Op::RbfMv && cols > 1 {
                        continue;
                    }
                    for grad in [false, true] {
                        if grad && op != Op::KernelLse {
                            continue;
                        }
                        let p = entry_point(&case(op, dim, cols, grad)).unwrap();
                        assert!(names.contains(&p.entry), "{p:?}");
                        assert!(p.column_tile >= cols.min(64), "{p:?}");
                        assert_eq!(p.grid.1 as usize, cols.div_ceil(p.column_tile));
                        assert_eq!(p.grid.0 as usize, 1000usize.div_ceil(p.rows_per_block));
                    }
                }
            }
        }
    }

    #[test]
    fn small_row_counts_split_the_log_sum_exp() {
        // Two row blocks over 1000 points: three splits of three tiles (the emulator's case).
        assert_eq!(y_splits(2, 1000), (3, 384));
        // A Sinkhorn iteration at 10⁴ points: 40 row blocks, 20 splits of 512 points.
        assert_eq!(y_splits(40, 10_000), (20, 512));
        // Enough row blocks, or too few points for two tiles per split: no split.
        assert_eq!(y_splits(SPLIT_TARGET_BLOCKS, 1_000_000), (1, 1_000_000));
        assert_eq!(y_splits(1, 300), (1, 300));
        for (n, m) in [(10_000, 10_000), (100_000, 100_000), (1000, 700), (7, 5000)] {
            let p = entry_point(&KernelSumCase::new(Op::KernelLse, n, m, 3)).unwrap();
            let (splits, len) = y_splits(n.div_ceil(256), m);
            assert_eq!((p.splits, p.split_len), (splits, len), "{n} {m}");
            assert_eq!(p.grid.1 as usize, splits);
            assert_eq!(
                p.entry,
                if splits > 1 {
                    "kernel_lse_split_d3"
                } else {
                    "kernel_lse_d3"
                }
            );
            // Every point of Y in exactly one split, none empty, whole tiles but the last.
            assert!(len % TILE == 0 || splits == 1);
            assert!((splits - 1) * len < m && m <= splits * len, "{n} {m} {p:?}");
            // The gradient never splits, nor the generic dimensions past the tensor-core
            // kernels; those split by the same rule over their 64-row blocks.
            let g = KernelSumCase {
                grad: true,
                ..KernelSumCase::new(Op::KernelLse, n, m, 3)
            };
            assert_eq!(entry_point(&g).unwrap().splits, 1);
            let dn = KernelSumCase::new(Op::KernelLse, n, m, 200);
            assert_eq!(entry_point(&dn).unwrap().splits, 1);
            let tc = entry_point(&KernelSumCase::new(Op::KernelLse, n, m, 16)).unwrap();
            let (splits, len) = y_splits(n.div_ceil(TC_ROWS), m);
            assert_eq!((tc.splits, tc.split_len), (splits, len), "{n} {m}");
            let want = if splits > 1 {
                "kernel_lse_split_tc"
            } else {
                "kernel_lse_tc"
            };
            assert_eq!(tc.entry, want);
        }
        // The `#if` line that selects a combine: the last one before its definition.
        let guard_of = |combine: &str| {
            KERNEL_SUMS_SRC
                .split(&format!("{combine}("))
                .next()
                .unwrap()
                .rsplit("#if ")
                .next()
                .unwrap()
                .to_string()
        };
        let combine_guard = guard_of(COMBINE);
        for d in SMALL_DIMS {
            assert!(combine_guard.contains(&format!("defined(KS_ENTRY_kernel_lse_split_d{d})")));
        }
        assert!(combine_guard.contains("defined(KS_ENTRY_kernel_lse_split_tc)"));
        // The matvec (one column) and the KDE split by the same rule, into SUM_COMBINE; the
        // matvec with more columns (grid.y is its column tiles) never splits.
        for (n, m) in [
            (10_000usize, 10_000),
            (1000, 700),
            (7, 5000),
            (300_000, 300_000),
        ] {
            let (splits, len) = y_splits(n.div_ceil(256), m);
            for (op, cols, entry) in [
                (Op::RbfMv, 1, "rbf_mv_split_d2"),
                (Op::Kde, 1, "kde_split_d2"),
            ] {
                let c = KernelSumCase {
                    cols,
                    ..KernelSumCase::new(op, n, m, 2)
                };
                let p = entry_point(&c).unwrap();
                assert_eq!((p.splits, p.split_len), (splits, len), "{op:?} {n} {m}");
                assert_eq!(p.grid.1 as usize, splits);
                if splits > 1 {
                    assert_eq!(p.entry, entry);
                    assert_eq!(p.combine(), Some((SUM_COMBINE, 1)));
                } else {
                    assert_eq!(p.combine(), None);
                }
            }
            let wide = KernelSumCase {
                cols: 4,
                ..KernelSumCase::new(Op::RbfMv, n, m, 2)
            };
            assert_eq!(entry_point(&wide).unwrap().splits, 1);
        }
        let lse = entry_point(&KernelSumCase::new(Op::KernelLse, 10_000, 10_000, 1)).unwrap();
        assert_eq!(lse.combine(), Some((COMBINE, 2)));
        let sum_guard = guard_of(SUM_COMBINE);
        for d in ["d1", "d2", "d3", "tc"] {
            for op in ["rbf_mv", "kde"] {
                assert!(sum_guard.contains(&format!("defined(KS_ENTRY_{op}_split_{d})")));
            }
        }
    }

    #[test]
    fn plans_pick_dimension_columns_and_rows() {
        let p = entry_point(&case(Op::RbfMv, 3, 3, false)).unwrap();
        assert_eq!(
            (p.entry.as_str(), p.column_tile, p.rows_per_block, p.grid),
            ("rbf_mv_d3_c4", 4, 256, (4, 1, 1))
        );
        let p = entry_point(&case(Op::RbfMv, 3, 64, false)).unwrap();
        assert_eq!((p.entry.as_str(), p.rows_per_block), ("rbf_mv_d3_c64", 128));
        let p = entry_point(&case(Op::RbfMv, 16, 130, false)).unwrap();
        assert_eq!(
            (p.entry.as_str(), p.rows_per_block, p.grid, p.smem_bytes),
            ("rbf_mv_dn_c64", 128, (8, 3, 1), 0)
        );
        // One column of b at dimension 4 to 128: the tensor-core kernel, 64 rows per block,
        // its shared memory for D rounded up to 8 (plus 4 floats a row) over 64 + 4·64 rows,
        // and 4·64 floats of per-point terms.
        // M = 10 is too short to split.
        let p = entry_point(&case(Op::RbfMv, 16, 1, false)).unwrap();
        assert_eq!(
            (p.entry.as_str(), p.rows_per_block, p.grid, p.smem_bytes),
            ("rbf_mv_tc", 64, (16, 1, 1), (320 * 20 + 256) * 4)
        );
        assert_eq!(tc_smem_bytes(5), (320 * 12 + 256) * 4);
        assert_eq!(tc_smem_bytes(TC_MAX_DIM), 169_984);
        assert_eq!(
            entry_point(&case(Op::Kde, 64, 1, false)).unwrap().entry,
            "kde_tc"
        );
        assert_eq!(
            entry_point(&case(Op::KernelLse, 128, 1, false))
                .unwrap()
                .entry,
            "kernel_lse_tc"
        );
        assert_eq!(
            entry_point(&case(Op::KernelLse, 129, 1, false))
                .unwrap()
                .entry,
            "kernel_lse_dn"
        );
        // The kernels' own sizes are the host's.
        for (name, v) in [
            ("KS_TC_DMAX", TC_MAX_DIM),
            ("KS_TC_ROWS", TC_ROWS),
            ("KS_TC_TILE", TC_TILE),
            ("KS_TC_CENTER", 256),
        ] {
            assert!(
                KERNEL_SUMS_SRC.contains(&format!("#define {name} {v}\n")),
                "{name}"
            );
        }
        assert_eq!(
            entry_point(&case(Op::Kde, 2, 1, false)).unwrap().entry,
            "kde_d2"
        );
        assert_eq!(
            entry_point(&case(Op::KernelLse, 64, 1, true))
                .unwrap()
                .entry,
            "kernel_lse_grad_tc"
        );
        assert_eq!(
            entry_point(&case(Op::KernelLse, 200, 1, true))
                .unwrap()
                .entry,
            "kernel_lse_grad_dn"
        );
        assert!(entry_point(&case(Op::Kde, 3, 1, true)).is_err());
        assert!(entry_point(&KernelSumCase::new(Op::Kde, 0, 3, 3)).is_err());
        assert!(entry_source("kde_d3").starts_with("#define KS_ONLY\n#define KS_ENTRY_kde_d3\n"));
    }

    #[test]
    fn scalars_are_the_base_2_scales() {
        let s = Scale {
            sigma: 0.5,
            epsilon: 0.25,
        };
        let (k, one) = scalars(&case(Op::RbfMv, 3, 1, false), s).unwrap();
        assert!((k as f64 - LOG2E / 0.5).abs() < 1e-6 && one == 1.0);
        let c = KernelSumCase::new(Op::Kde, 5, 10, 2);
        let (_, norm) = scalars(&c, s).unwrap();
        // (2π · 0.25)^(−1) / 10
        assert!((norm as f64 - 1.0 / (std::f64::consts::PI * 0.5) / 10.0).abs() < 1e-7);
        let (k, two_over_eps) = scalars(&case(Op::KernelLse, 3, 1, true), s).unwrap();
        assert!((k as f64 - LOG2E * 4.0).abs() < 1e-6 && two_over_eps == 8.0);
        let bad = Scale {
            sigma: 0.0,
            epsilon: f64::NAN,
        };
        assert!(scalars(&case(Op::RbfMv, 3, 1, false), bad).is_err());
        assert!(scalars(&case(Op::KernelLse, 3, 1, false), bad).is_err());
    }
}
