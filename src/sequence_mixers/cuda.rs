//! SSD on CUDA: `kernels/sequence_mixers/ssd.cu`, compiled by NVRTC at run time, the chunked
//! algorithm of [`super::chunked::ssd`] (Dao and Gu, 2024, §6) in chunks of [`CHUNK`] steps.
//! bf16 inputs whose sizes fit the tiles ([`tensor_core_path`]) take version 5, three launches:
//! walks of [`chunks_per_walk`] chunks, each summing its chunks' states on tensor cores
//! (mma.sync, bf16 operands, float32 accumulation) and storing the partial sums (bf16), the
//! walks' states passed from walk to walk (float32 running sum, bf16 entering states), then
//! each chunk's output on tensor cores, its entering state the walk's decayed and the partial
//! sum added. Every other case takes
//! version 1, float32 on CUDA cores in three launches: each chunk's own state, the states
//! passed from chunk to chunk, then each chunk's output from its inputs and its entering state.

use cudarc::driver::{
    CudaFunction, CudaSlice, CudaViewMut, DeviceRepr, LaunchConfig, PushKernelArg,
};

use super::reference::SsdShape;
use crate::gpu::{Gpu, GpuError};

/// The helpers every sequence-mixer kernel shares (`kernels/sequence_mixers/prelude.cuh`:
/// float32 and bf16 loads and stores), prepended to each source ([`with_prelude`]).
pub const PRELUDE_SRC: &str = include_str!("../../kernels/sequence_mixers/prelude.cuh");

/// A sequence-mixer kernel file as NVRTC compiles it: [`PRELUDE_SRC`], then `src`.
pub fn with_prelude(src: &str) -> String {
    format!("{PRELUDE_SRC}\n{src}")
}

/// The CUDA source of the SSD kernels, without the prelude ([`source`] has both;
/// [`entry_points`] names the kernels).
pub const SSD_SRC: &str = include_str!("../../kernels/sequence_mixers/ssd.cu");

/// What NVRTC compiles for SSD: the prelude and [`SSD_SRC`].
pub fn source() -> String {
    with_prelude(SSD_SRC)
}

/// Time steps per chunk (`SSD_CHUNK` in the source).
pub const CHUNK: usize = 64;

/// The largest head_dim and state of version 1 (its shared memory grows with both).
pub const MAX_DIM: usize = 256;

/// Threads per block of every SSD kernel (`SSD_THREADS` in the source).
pub const THREADS: u32 = 256;

/// Element type of X, B, C and Y on the device (Δ, A, D and the states are float32).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    /// float32.
    F32,
    /// bfloat16, as its 16 bits (`u16`), rounded to nearest even.
    Bf16,
}

impl Dtype {
    /// The entry points' suffix for this type: `f32` or `bf16`.
    pub(crate) fn tag(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::Bf16 => "bf16",
        }
    }
}

/// Every entry point of [`SSD_SRC`].
pub fn entry_points() -> Vec<String> {
    let mut v = vec!["ssd_state_passing".to_string()];
    for d in [Dtype::F32, Dtype::Bf16] {
        v.push(format!("ssd_chunk_state_{}", d.tag()));
        v.push(format!("ssd_chunk_scan_{}", d.tag()));
    }
    v.push("ssd_chunk_scan_bf16_f32out".to_string());
    v.push("ssd_chunk_states_tc".to_string());
    v.push("ssd_state_passing_bf16".to_string());
    for suffix in ["", "_p64n64", "_p128n128"] {
        for kernel in ["ssd_chunk_scan_tc", "ssd_chunk_scan_tc_f32out"] {
            v.push(format!("{kernel}{suffix}"));
        }
    }
    v
}

/// The suffix of the tensor-core chunk scans compiled with `shape`'s head_dim P and state N as
/// constants (`_p64n64`, `_p128n128`: the grid's sizes), or "" for the generic ones that read
/// them from their arguments.
pub fn tc_suffix(shape: SsdShape) -> &'static str {
    match (shape.head_dim, shape.state) {
        (64, 64) => "_p64n64",
        (128, 128) => "_p128n128",
        _ => "",
    }
}

/// Dynamic shared memory of the chunk-state and chunk-scan kernels for `shape`, bytes:
/// (L·P + L·N + L) and (L·N + (L + P)·(N | 1) + L·L + L·P + L) floats, L = [`CHUNK`] (the
/// chunk-scan kernel's B and entering-state rows are N | 1 floats, an odd stride, against bank
/// conflicts).
pub fn shared_bytes(shape: SsdShape) -> (u32, u32) {
    let (l, p, n) = (CHUNK, shape.head_dim, shape.state);
    let state = (l * p + l * n + l) * 4;
    let scan = (l * n + (l + p) * (n | 1) + l * l + l * p + l) * 4;
    (state as u32, scan as u32)
}

/// Dynamic shared memory of the tensor-core kernels (version 5, bf16 inputs) for `shape`,
/// bytes: the chunk states (`ssd_chunk_states_tc`: L float32 Δ, then bf16 rows: x L × (P + 8)
/// and B L × (N + 8), the same space then holding the state P × (N + 8)) and the chunk scan
/// (2·L float32, then bf16 rows: C and B L × (N + 8), x L × (P + 8), the entering state
/// P × (N + 8), M L × (L + 8)); rows padded by 8 halves so that the 8 rows of an ldmatrix fall
/// in distinct banks. `None` when the shape does not fit them (head_dim a multiple of 16 and
/// state of 32, both at most 128; other shapes take the float32 kernels).
pub fn tensor_core_shared_bytes(shape: SsdShape) -> Option<(u32, u32)> {
    let (l, p, n) = (CHUNK, shape.head_dim, shape.state);
    if !(p.is_multiple_of(16) && n.is_multiple_of(32) && p <= 128 && n <= 128) {
        return None;
    }
    let (ls, ns, ps) = (l + 8, n + 8, p + 8);
    let states = l * 4 + (l * ps + l * ns).max(p * ns) * 2;
    let scan = 2 * l * 4 + (2 * l * ns + l * ps + p * ns + l * ls) * 2;
    Some((states as u32, scan as u32))
}

/// The most chunks one block of the tensor-core chunk-state kernel walks ([`chunks_per_walk`]).
pub const MAX_WALK: usize = 8;

/// Blocks the tensor-core chunk-state kernel is given at least, where the shape has them
/// ([`chunks_per_walk`]): about four waves of two blocks per SM on the H200's 132 SMs.
pub const WALK_BLOCKS: usize = 1024;

/// Chunks each block of the tensor-core chunk-state kernel walks for `shape`: the walk's
/// partial sums are what the chunk scan adds to, and only the walks' own states pass through
/// the sequential state passing, so a walk of w chunks divides the passing's traffic by w. As
/// many as keep at least [`WALK_BLOCKS`] blocks (B · H · ⌈n_chunks / w⌉), between 1 (version
/// 4: every chunk a block of its own) and [`MAX_WALK`].
pub fn chunks_per_walk(shape: SsdShape) -> usize {
    let n_chunks = shape.seq_len.div_ceil(CHUNK).max(1);
    (shape.batch * shape.heads * n_chunks / WALK_BLOCKS).clamp(1, MAX_WALK)
}

/// Threads per block of the bf16 state passing (`SSD_PASS_THREADS`), each 8 adjacent elements
/// of a state.
const PASS_THREADS: u32 = 128;

/// The tensor-core kernels' shared memory ([`tensor_core_shared_bytes`]) when [`Ssd`] takes
/// them for `shape` and `dtype` (bf16 only), or `None` when it takes the float32 kernels.
pub fn tensor_core_path(shape: SsdShape, dtype: Dtype) -> Option<(u32, u32)> {
    match dtype {
        Dtype::Bf16 => tensor_core_shared_bytes(shape),
        Dtype::F32 => None,
    }
}

/// The shared memory one block may have on compute capability 9.0 (227 KiB). Version 1 needs
/// up to 176.25 KiB (head_dim 128 with state 128); a device with less (sm_80: 163 KiB) refuses
/// those shapes when the kernel's limit is raised (a driver error), smaller shapes run.
const MAX_SHARED: u32 = 227 * 1024;

/// Checks each `(buffer, elements, expected)` of a launch of `mixer` for `shape`; a buffer the
/// shape wants empty (seq_len 0) may hold one unread element, since the driver refuses
/// zero-byte allocations.
///
/// # Errors
/// [`GpuError::Config`] naming the first buffer whose length does not fit.
pub(crate) fn check_buffers(
    mixer: &str,
    shape: &dyn std::fmt::Debug,
    checks: &[(&str, usize, usize)],
) -> Result<(), GpuError> {
    for &(what, got, want) in checks {
        if got != want && !(want == 0 && got == 1) {
            return Err(GpuError::Config(format!(
                "{mixer}: {what} holds {got} elements, expected {want} for {shape:?}"
            )));
        }
    }
    Ok(())
}

/// An error unless `T` is the element of `dtype` (4 bytes for float32, 2 for bf16 bits).
pub(crate) fn check_element<T>(dtype: Dtype, what: &str) -> Result<(), GpuError> {
    let want = match dtype {
        Dtype::F32 => 4,
        Dtype::Bf16 => 2,
    };
    if std::mem::size_of::<T>() == want {
        Ok(())
    } else {
        Err(GpuError::Config(format!(
            "{what}: built for {dtype:?}, not {}-byte elements",
            std::mem::size_of::<T>()
        )))
    }
}

/// A call with no step: the final state is the initial one, or zeros without one.
///
/// # Errors
/// Driver errors from the copy.
pub(crate) fn no_step(
    gpu: &Gpu,
    initial: Option<&CudaSlice<f32>>,
    final_state: &mut CudaSlice<f32>,
) -> Result<(), GpuError> {
    match initial {
        Some(s0) => gpu.stream.memcpy_dtod(s0, final_state)?,
        None => gpu.stream.memset_zeros(final_state)?,
    }
    Ok(())
}

/// The shape checks SSD's forward ([`Ssd::new`]) and backward
/// ([`super::ssd_backward::SsdBackward::new`]) share, their messages starting with `what`.
///
/// # Errors
/// [`GpuError::Config`] for an empty dimension other than seq_len, heads not a multiple of
/// groups, head_dim or state past [`MAX_DIM`], a seq_len past 32-bit ints, or batch or heads
/// past 65,535 (grid limits).
pub(crate) fn check_shape(what: &str, s: SsdShape) -> Result<(), GpuError> {
    if s.batch == 0 || s.heads == 0 || s.head_dim == 0 || s.state == 0 || s.groups == 0 {
        return Err(GpuError::Config(format!(
            "{what}: empty dimension in {s:?}"
        )));
    }
    if !s.heads.is_multiple_of(s.groups) {
        return Err(GpuError::Config(format!(
            "{what}: heads {} is not a multiple of groups {}",
            s.heads, s.groups
        )));
    }
    if s.head_dim > MAX_DIM || s.state > MAX_DIM {
        return Err(GpuError::Config(format!(
            "{what}: head_dim {} and state {} must be at most {MAX_DIM}",
            s.head_dim, s.state
        )));
    }
    if s.seq_len + CHUNK > i32::MAX as usize || s.batch > 65_535 || s.heads > 65_535 {
        return Err(GpuError::Config(format!(
            "{what}: {s:?} does not fit 32-bit ints and the grid (batch and heads at most \
             65,535)"
        )));
    }
    Ok(())
}

/// SSD's compiled kernels and scratch for one shape: a state per chunk `[B, H, n_chunks, P, N]`
/// (float32 for the float32 kernels: the state entering each chunk; bf16 for the tensor-core
/// ones: the state entering each walk of [`chunks_per_walk`] chunks in its first chunk's slot,
/// in the others the partial sum of the walk's chunk states before them) and the chunks' log
/// decays `[B, H, n_chunks]` (float32; on the tensor-core path summed from the walk's start).
pub struct Ssd {
    shape: SsdShape,
    dtype: Dtype,
    chunk_state: CudaFunction,
    chunk_scan: CudaFunction,
    /// The chunk scan writing a float32 Y (`ssd_chunk_scan_bf16_f32out` for bf16; the f32 scan
    /// itself for f32).
    chunk_scan_f32out: CudaFunction,
    /// The state passing: float32 (`ssd_state_passing`), or bf16 on the tensor-core path
    /// (`ssd_state_passing_bf16`).
    passing: CudaFunction,
    /// Dynamic shared memory of the chunk-state and chunk-scan kernels chosen, bytes.
    smem: (u32, u32),
    /// Whether the kernels are version 5's tensor-core ones (bf16, shapes that fit):
    /// `chunk_state` is then `ssd_chunk_states_tc`, writing bf16 partial sums and walk states.
    tensor_cores: bool,
    /// Chunks per walk of the tensor-core kernels ([`chunks_per_walk`]; 1 on the float32 path).
    walk: usize,
    states: CudaSlice<f32>,
    decay: CudaSlice<f32>,
    states_bf16: CudaSlice<u16>,
    /// Stands in for D or the initial state when none is given (never read).
    unused: CudaSlice<f32>,
    /// NVRTC compile and module load time, s (0 when this process had compiled the source).
    pub compile_s: f64,
}

impl Ssd {
    /// Compiles the kernels and allocates the scratch for `shape` and `dtype`.
    ///
    /// # Errors
    /// [`GpuError::Config`] for a shape the reference refuses (an empty dimension other than
    /// seq_len, heads not a multiple of groups), head_dim or state past [`MAX_DIM`], a
    /// seq_len past 32-bit ints, batch or heads past 65,535 (grid limits), or P and N whose
    /// shared memory passes 227 KiB; [`GpuError::Compile`] with the NVRTC log; driver
    /// errors (out of memory).
    pub fn new(gpu: &Gpu, shape: SsdShape, dtype: Dtype) -> Result<Ssd, GpuError> {
        let s = shape;
        check_shape("ssd", s)?;
        let (state_smem, scan_smem) = shared_bytes(s);
        if scan_smem > MAX_SHARED {
            return Err(GpuError::Config(format!(
                "ssd: head_dim {} and state {} need {scan_smem} bytes of shared memory per \
                 block, more than {MAX_SHARED}",
                s.head_dim, s.state
            )));
        }
        let compiled = gpu.compile("ssd.cu", &source())?;
        let tc = tensor_core_path(s, dtype);
        let tag = dtype.tag();
        let (names, smem) = match tc {
            Some(sizes) => (
                [
                    "ssd_chunk_states_tc".to_string(),
                    format!("ssd_chunk_scan_tc{}", tc_suffix(s)),
                    format!("ssd_chunk_scan_tc_f32out{}", tc_suffix(s)),
                ],
                sizes,
            ),
            None => (
                [
                    format!("ssd_chunk_state_{tag}"),
                    format!("ssd_chunk_scan_{tag}"),
                    // For f32 the scan's y is float32 already.
                    match dtype {
                        Dtype::F32 => "ssd_chunk_scan_f32".to_string(),
                        Dtype::Bf16 => "ssd_chunk_scan_bf16_f32out".to_string(),
                    },
                ],
                (state_smem, scan_smem),
            ),
        };
        let chunk_state = gpu.function(&compiled.module, &names[0], smem.0)?;
        let chunk_scan = gpu.function(&compiled.module, &names[1], smem.1)?;
        let chunk_scan_f32out = gpu.function(&compiled.module, &names[2], smem.1)?;
        let passing = gpu.function(
            &compiled.module,
            if tc.is_some() {
                "ssd_state_passing_bf16"
            } else {
                "ssd_state_passing"
            },
            0,
        )?;
        let n_chunks = s.seq_len.div_ceil(CHUNK);
        let state_elems = s.batch * s.heads * n_chunks * s.head_dim * s.state;
        let (f32_elems, bf16_elems) = match tc {
            Some(_) => (1, state_elems.max(1)),
            None => (state_elems.max(1), 1),
        };
        let states = gpu.stream.alloc_zeros::<f32>(f32_elems)?;
        let decay = gpu
            .stream
            .alloc_zeros::<f32>((s.batch * s.heads * n_chunks).max(1))?;
        let states_bf16 = gpu.stream.alloc_zeros::<u16>(bf16_elems)?;
        let unused = gpu.stream.alloc_zeros::<f32>(1)?;
        Ok(Ssd {
            shape,
            dtype,
            chunk_state,
            chunk_scan,
            chunk_scan_f32out,
            passing,
            smem,
            tensor_cores: tc.is_some(),
            walk: if tc.is_some() { chunks_per_walk(s) } else { 1 },
            states,
            decay,
            states_bf16,
            unused,
            compile_s: compiled.compile_s,
        })
    }

    /// Whether the kernels are version 5's tensor-core ones ([`tensor_core_shared_bytes`]:
    /// bf16 and a shape that fits), rather than the float32 CUDA-core kernels.
    pub fn uses_tensor_cores(&self) -> bool {
        self.tensor_cores
    }

    /// Chunks per walk of the chunk-state kernel ([`chunks_per_walk`] on the tensor-core path,
    /// 1 on the float32 one).
    pub fn chunks_per_walk(&self) -> usize {
        self.walk
    }

    /// Bytes of scratch one call uses beyond its inputs and outputs (the other path's
    /// one-element placeholders counted too).
    pub fn temporary_bytes(&self) -> u64 {
        (self.states.len() + self.decay.len()) as u64 * 4 + self.states_bf16.len() as u64 * 2
    }

    /// Launches one SSD call: Y and the final state from X `[B, T, H, P]`, Δ `[B, T, H]`,
    /// A `[H]`, B and C `[B, T, G, N]`, D `[H]` (optional) and the initial state
    /// `[B, H, P, N]` (optional: zeros), the layouts of [`super::reference::ssd`]. X, B, C
    /// and Y are of the runner's [`Dtype`] (`f32`, or `u16` holding bf16 bits); the rest is
    /// float32. Asynchronous on [`Gpu::stream`].
    ///
    /// # Errors
    /// [`GpuError::Config`] for a buffer whose length does not fit the shape or an element
    /// type other than the runner's dtype; driver errors from the launches.
    #[allow(clippy::too_many_arguments)]
    pub fn launch<T: DeviceRepr>(
        &mut self,
        gpu: &Gpu,
        x: &CudaSlice<T>,
        dt: &CudaSlice<f32>,
        a: &CudaSlice<f32>,
        b: &CudaSlice<T>,
        c: &CudaSlice<T>,
        d: Option<&CudaSlice<f32>>,
        initial_state: Option<&CudaSlice<f32>>,
        y: &mut CudaViewMut<'_, T>,
        final_state: &mut CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        self.launch_into(
            gpu,
            (x, dt, a, b, c),
            d,
            initial_state,
            y,
            final_state,
            false,
        )
    }

    /// [`Ssd::launch`] with Y in float32 whatever the inputs' dtype: the linear branch of
    /// Based ([`super::based_cuda`]), which adds Y to its window branch before rounding.
    ///
    /// # Errors
    /// As [`Ssd::launch`].
    #[allow(clippy::too_many_arguments)]
    pub fn launch_f32_out<T: DeviceRepr>(
        &mut self,
        gpu: &Gpu,
        x: &CudaSlice<T>,
        dt: &CudaSlice<f32>,
        a: &CudaSlice<f32>,
        b: &CudaSlice<T>,
        c: &CudaSlice<T>,
        d: Option<&CudaSlice<f32>>,
        initial_state: Option<&CudaSlice<f32>>,
        y: &mut CudaViewMut<'_, f32>,
        final_state: &mut CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        self.launch_into(
            gpu,
            (x, dt, a, b, c),
            d,
            initial_state,
            y,
            final_state,
            true,
        )
    }

    /// The three launches of [`Ssd::launch`] into a Y of element type `Y`: `T` with
    /// `f32_out` false, f32 with it true.
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    fn launch_into<T: DeviceRepr, Y: DeviceRepr>(
        &mut self,
        gpu: &Gpu,
        (x, dt, a, b, c): (
            &CudaSlice<T>,
            &CudaSlice<f32>,
            &CudaSlice<f32>,
            &CudaSlice<T>,
            &CudaSlice<T>,
        ),
        d: Option<&CudaSlice<f32>>,
        initial_state: Option<&CudaSlice<f32>>,
        y: &mut CudaViewMut<'_, Y>,
        final_state: &mut CudaSlice<f32>,
        f32_out: bool,
    ) -> Result<(), GpuError> {
        let s = self.shape;
        let want = match self.dtype {
            Dtype::F32 => 4,
            Dtype::Bf16 => 2,
        };
        let want_y = if f32_out { 4 } else { want };
        if std::mem::size_of::<T>() != want || std::mem::size_of::<Y>() != want_y {
            return Err(GpuError::Config(format!(
                "ssd: the runner was built for {:?}, not {}-byte inputs and a {}-byte output",
                self.dtype,
                std::mem::size_of::<T>(),
                std::mem::size_of::<Y>()
            )));
        }
        let bt = s.batch * s.seq_len;
        let state_len = s.batch * s.heads * s.head_dim * s.state;
        let checks = [
            ("x", x.len(), bt * s.heads * s.head_dim),
            ("dt", dt.len(), bt * s.heads),
            ("a", a.len(), s.heads),
            ("b", b.len(), bt * s.groups * s.state),
            ("c", c.len(), bt * s.groups * s.state),
            ("d", d.map_or(s.heads, |d| d.len()), s.heads),
            (
                "initial_state",
                initial_state.map_or(state_len, |v| v.len()),
                state_len,
            ),
            ("y", y.len(), bt * s.heads * s.head_dim),
            ("final_state", final_state.len(), state_len),
        ];
        check_buffers("ssd", &s, &checks)?;
        if s.seq_len == 0 {
            return no_step(gpu, initial_state, final_state);
        }
        let n_chunks = s.seq_len.div_ceil(CHUNK);
        let (state_smem, scan_smem) = self.smem;
        let (t_len, heads, groups) = (s.seq_len as i32, s.heads as i32, s.groups as i32);
        let (p, n, chunks) = (s.head_dim as i32, s.state as i32, n_chunks as i32);
        let grid = (n_chunks as u32, s.heads as u32, s.batch as u32);
        let cfg = |smem: u32, grid: (u32, u32, u32)| LaunchConfig {
            grid_dim: grid,
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: smem,
        };
        let has_initial = i32::from(initial_state.is_some());
        let walk = self.walk as i32;
        let has_d = i32::from(d.is_some());
        let scan = if f32_out {
            &self.chunk_scan_f32out
        } else {
            &self.chunk_scan
        };
        // The chunks' own states and decays (float32), then the states passed from chunk to
        // chunk in place; on the tensor-core path each walk's partial sums and own state
        // (bf16) and the decays from the walk's start, then the states passed from walk to walk.
        let mut l = gpu.stream.launch_builder(&self.chunk_state);
        l.arg(x).arg(dt).arg(a).arg(b);
        if self.tensor_cores {
            l.arg(&mut self.states_bf16);
        } else {
            l.arg(&mut self.states);
        }
        l.arg(&mut self.decay)
            .arg(&t_len)
            .arg(&heads)
            .arg(&groups)
            .arg(&p)
            .arg(&n);
        let state_grid = if self.tensor_cores {
            l.arg(&walk);
            (n_chunks.div_ceil(self.walk) as u32, grid.1, grid.2)
        } else {
            grid
        };
        // SAFETY: ssd_chunk_state_<t>(const T* x, const float* dt, const float* A, const T* Bm,
        // float* states, float* chunk_log_decay, int T_len, int heads, int groups, int P,
        // int N), blocks (chunk, head, batch entry); or on the tensor-core path
        // ssd_chunk_states_tc, the same with u16 x, Bm and states and int walk (>= 1), blocks
        // (walk, head, batch entry), each walking chunks walk·k to min(n_chunks, walk·(k + 1))
        // - 1: the lengths were checked above and the scratch (B·H·n_chunks·P·N states of
        // the path's type, B·H·n_chunks decays) sized for this shape in `new`; blocks read
        // chunk rows below T only and write their own chunks' slices; the tensor-core kernel
        // takes P a multiple of 16 and N of 32, both at most 128 (`tensor_core_shared_bytes`).
        unsafe { l.launch(cfg(state_smem, state_grid))? };
        let mut l = gpu.stream.launch_builder(&self.passing);
        if self.tensor_cores {
            l.arg(&mut self.states_bf16);
        } else {
            l.arg(&mut self.states);
        }
        l.arg(&self.decay)
            .arg(initial_state.unwrap_or(&self.unused))
            .arg(&has_initial)
            .arg(&mut *final_state)
            .arg(&heads)
            .arg(&chunks)
            .arg(&p)
            .arg(&n);
        if self.tensor_cores {
            l.arg(&walk);
        }
        let passing = if self.tensor_cores {
            let slices = (s.head_dim * s.state / 8).div_ceil(PASS_THREADS as usize) as u32;
            LaunchConfig {
                grid_dim: (slices, s.heads as u32, s.batch as u32),
                block_dim: (PASS_THREADS, 1, 1),
                shared_mem_bytes: 0,
            }
        } else {
            let slices = (s.head_dim * s.state).div_ceil(THREADS as usize) as u32;
            cfg(0, (s.heads as u32, s.batch as u32, slices))
        };
        // SAFETY: ssd_state_passing(float* states, const float* chunk_log_decay,
        // const float* initial_state, int has_initial, float* final_state, int heads,
        // int n_chunks, int P, int N): blocks (head, batch entry, slice), ⌈P·N / 256⌉ slices
        // covering the P·N elements once; or ssd_state_passing_bf16, the same with u16 states
        // and int walk (the chunk-state launch's): blocks (slice, head, batch entry) of
        // PASS_THREADS threads, each 8 of the P·N elements (a multiple of 8: N % 32 == 0) in
        // the slots of chunks 0, walk, 2 walk, ... below n_chunks, threads past P·N return.
        // Over the checked buffers;
        // the initial state is read only when has_initial is 1, and then holds B·H·P·N floats.
        unsafe { l.launch(passing)? };
        let mut l = gpu.stream.launch_builder(scan);
        l.arg(x)
            .arg(dt)
            .arg(a)
            .arg(b)
            .arg(c)
            .arg(d.unwrap_or(&self.unused))
            .arg(&has_d);
        // The states entering each chunk: bf16 partial sums and the walks' entering states
        // with the chunks' log decays, or float32 from the passing.
        if self.tensor_cores {
            l.arg(&self.states_bf16).arg(&self.decay);
        } else {
            l.arg(&self.states);
        }
        l.arg(&mut *y)
            .arg(&t_len)
            .arg(&heads)
            .arg(&groups)
            .arg(&p)
            .arg(&n);
        if self.tensor_cores {
            l.arg(&walk);
        }
        // SAFETY: ssd_chunk_scan_<t>(const T* x, const float* dt, const float* A, const T* Bm,
        // const T* Cm, const float* D, int has_d, const float* states, T* y, int T_len,
        // int heads, int groups, int P, int N), or ssd_chunk_scan_bf16_f32out, the same with
        // float* y; on the tensor-core path ssd_chunk_scan_tc(_f32out)[tc_suffix], the same
        // with const u16* states followed by const float* chunk_log_decay, and int walk last,
        // P and N the constants of the suffix (the element sizes of T and Y were checked
        // against the function above): the checked buffers, the states and decays written by
        // the launches before (a chunk past a walk's first reads its walk's first slot and the
        // decays of the chunks between); D is read
        // only when has_d is 1 and then holds H floats; each block writes the rows of its chunk.
        unsafe { l.launch(cfg(scan_smem, grid))? };
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_memory_is_counted_in_floats() {
        let s = SsdShape {
            batch: 1,
            seq_len: 1,
            heads: 1,
            head_dim: 64,
            state: 128,
            groups: 1,
        };
        let (state, scan) = shared_bytes(s);
        assert_eq!(state, ((64 * 64 + 64 * 128 + 64) * 4) as u32);
        assert_eq!(
            scan,
            ((64 * 128 + (64 + 64) * 129 + 64 * 64 + 64 * 64 + 64) * 4) as u32
        );
        // head_dim 128 with state 128, the grid's largest, fits.
        let big = SsdShape { head_dim: 128, ..s };
        assert!(shared_bytes(big).1 <= MAX_SHARED);
        // The tensor-core kernels: 64 floats and 64 rows of 136 + 136 halves (x and B, then
        // the 128 rows of the state of 136); 128 floats and rows of 136, 136,
        // 136 (x), 136 (the state) and 72 halves.
        assert_eq!(
            tensor_core_shared_bytes(big),
            Some((
                (64 * 4 + 64 * (136 + 136) * 2) as u32,
                (128 * 4 + (128 * 136 + 64 * 136 + 128 * 136 + 64 * 72) * 2) as u32
            ))
        );
        assert!(tensor_core_shared_bytes(big).unwrap().1 <= MAX_SHARED);
        for (p, n) in [(8, 32), (64, 48), (144, 64), (64, 160)] {
            let odd = SsdShape {
                head_dim: p,
                state: n,
                ..s
            };
            assert_eq!(tensor_core_shared_bytes(odd), None, "{p} {n}");
        }
    }

    #[test]
    fn walks_keep_a_thousand_blocks() {
        let s = |batch, seq_len, heads| SsdShape {
            batch,
            seq_len,
            heads,
            head_dim: 128,
            state: 128,
            groups: 1,
        };
        // The grid's B4 H8: 256 chunks at T16384 give 8192 blocks of one chunk, 1024 of 8.
        assert_eq!(chunks_per_walk(s(4, 16384, 8)), 8);
        assert_eq!(chunks_per_walk(s(4, 65536, 8)), MAX_WALK);
        assert_eq!(chunks_per_walk(s(4, 4096, 8)), 2);
        assert_eq!(chunks_per_walk(s(4, 1024, 8)), 1);
        assert_eq!(chunks_per_walk(s(1, 0, 1)), 1);
        assert_eq!(chunks_per_walk(s(2, 16_484, 8)), 4);
    }

    #[test]
    fn entry_points_are_named_once() {
        let e = entry_points();
        assert_eq!(e.len(), 14);
        let mut seen = std::collections::HashSet::new();
        for name in &e {
            assert!(seen.insert(name), "{name} twice");
            // Each name is in the source as written, or made by a macro: the chunk scans with
            // constant sizes by SSD_SCAN_TC (one line per suffix), the float32 and bf16
            // CUDA-core kernels by SSD_ENTRIES (one line per type).
            let sized = ["_p64n64", "_p128n128"]
                .into_iter()
                .find_map(|x| name.strip_suffix(x).map(|base| (base, x)))
                .or_else(|| {
                    ["ssd_chunk_scan_tc", "ssd_chunk_scan_tc_f32out"]
                        .contains(&name.as_str())
                        .then_some((name.as_str(), ""))
                });
            let typed = ["f32", "bf16"]
                .into_iter()
                .find_map(|t| name.strip_suffix(t).map(|base| (base, t)));
            let found = if SSD_SRC.contains(&format!("{name}(")) {
                true
            } else if let Some((base, x)) = sized {
                SSD_SRC.contains(&format!("{base}##SUFFIX("))
                    && SSD_SRC.contains(&format!("SSD_SCAN_TC({x},"))
            } else if let Some((base, t)) = typed {
                SSD_SRC.contains(&format!("{base}##NAME("))
                    && SSD_SRC.contains(&format!("SSD_ENTRIES({t},"))
            } else {
                false
            };
            assert!(found, "{name}");
        }
        assert!(SSD_SRC.contains(&format!("#define SSD_PASS_THREADS {PASS_THREADS}")));
    }
}
