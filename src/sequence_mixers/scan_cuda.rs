//! Mamba's selective scan on CUDA: `kernels/sequence_mixers/scan.cu`, compiled by NVRTC at
//! run time. Version 1 runs the sequential recurrence of [`super::reference::selective_scan`]
//! (Gu and Dao, 2023, "Mamba: Linear-Time Sequence Modeling with Selective State Spaces",
//! Algorithm 2) on CUDA cores in float32, in one launch: one warp per (batch entry, channel),
//! its 32 lanes splitting the N state entries, held in registers ([`states_per_lane`] each), and
//! adding their parts of ⟨C_t, h_t⟩ with warp shuffles. Correctness first: no chunking of the
//! sequence, no prefetching of the next steps' inputs yet.

use cudarc::driver::{
    CudaFunction, CudaSlice, CudaViewMut, DeviceRepr, LaunchConfig, PushKernelArg,
};

use super::cuda::Dtype;
use super::reference::ScanShape;
use crate::gpu::{Gpu, GpuError};

/// The CUDA source of the selective-scan kernels ([`entry_points`] names them).
pub const SCAN_SRC: &str = include_str!("../../kernels/sequence_mixers/scan.cu");

/// What NVRTC compiles: the shared prelude ([`super::cuda::with_prelude`]) and [`SCAN_SRC`].
pub fn source() -> String {
    super::cuda::with_prelude(SCAN_SRC)
}

/// Channels (warps) per block (`SCAN_WARPS` in the source).
pub const WARPS: u32 = 8;

/// Threads per block (`SCAN_THREADS` in the source).
pub const THREADS: u32 = 32 * WARPS;

/// The state sizes the kernels hold in registers: 32 lanes × up to 8 entries each.
pub const MAX_STATE: usize = 256;

/// The states-per-lane variants compiled (`s<S>` in the entry points' names).
pub const STATES_PER_LANE: [usize; 4] = [1, 2, 4, 8];

/// The largest grid y dimension (batch entries per launch).
const MAX_GRID_Y: usize = 65_535;

/// Entries of the state each lane holds for state size `n` (1 ≤ n ≤ [`MAX_STATE`]): ⌈n/32⌉
/// rounded up to the next of [`STATES_PER_LANE`]; `None` past [`MAX_STATE`] or for 0.
pub fn states_per_lane(n: usize) -> Option<usize> {
    if n == 0 || n > MAX_STATE {
        return None;
    }
    Some(n.div_ceil(32).next_power_of_two())
}

/// The entry point that runs `dtype` with `states_per_lane` entries per lane.
pub fn entry_point(dtype: Dtype, states_per_lane: usize) -> String {
    format!("scan_fwd_{}_s{states_per_lane}", dtype.tag())
}

/// Every entry point of [`SCAN_SRC`].
pub fn entry_points() -> Vec<String> {
    let mut v = Vec::new();
    for d in [Dtype::F32, Dtype::Bf16] {
        for s in STATES_PER_LANE {
            v.push(entry_point(d, s));
        }
    }
    v
}

/// The selective scan's compiled kernel for one shape and dtype. It needs no scratch.
pub struct Scan {
    shape: ScanShape,
    dtype: Dtype,
    function: CudaFunction,
    /// Stands in for D or the initial state when none is given (never read).
    unused: CudaSlice<f32>,
    /// NVRTC compile and module load time, s (0 when this process had compiled the source).
    pub compile_s: f64,
}

impl Scan {
    /// Compiles the kernels and picks the one for `shape` (its states per lane) and `dtype`.
    ///
    /// # Errors
    /// [`GpuError::Config`] for a shape the reference refuses (an empty dimension other than
    /// seq_len), a state past [`MAX_STATE`], more than 65 535 batch entries (the grid's y),
    /// or seq_len and channels (rounded up to a multiple of [`WARPS`]) past 32-bit ints; [`GpuError::Compile`] with the NVRTC log;
    /// driver errors (out of memory).
    pub fn new(gpu: &Gpu, shape: ScanShape, dtype: Dtype) -> Result<Scan, GpuError> {
        let s = shape;
        if s.batch == 0 || s.channels == 0 || s.state == 0 {
            return Err(GpuError::Config(format!(
                "selective_scan: empty dimension in {s:?}"
            )));
        }
        let Some(per_lane) = states_per_lane(s.state) else {
            return Err(GpuError::Config(format!(
                "selective_scan: state {} is more than the {MAX_STATE} the kernel holds in \
                 registers",
                s.state
            )));
        };
        if s.batch > MAX_GRID_Y {
            return Err(GpuError::Config(format!(
                "selective_scan: batch {} is more than the grid's {MAX_GRID_Y}",
                s.batch
            )));
        }
        // The kernel's channel index runs to the grid's last warp, past channels by up to 7.
        let fits = |v: usize| v <= i32::MAX as usize;
        if !(fits(s.seq_len) && fits(s.channels.next_multiple_of(WARPS as usize))) {
            return Err(GpuError::Config(format!(
                "selective_scan: {s:?} does not fit 32-bit ints"
            )));
        }
        let compiled = gpu.compile("scan.cu", &source())?;
        let function = gpu.function(&compiled.module, &entry_point(dtype, per_lane), 0)?;
        let unused = gpu.stream.alloc_zeros::<f32>(1)?;
        Ok(Scan {
            shape,
            dtype,
            function,
            unused,
            compile_s: compiled.compile_s,
        })
    }

    /// Bytes of scratch one call uses beyond its inputs and outputs: none.
    pub fn temporary_bytes(&self) -> u64 {
        0
    }

    /// Launches one selective scan: y `[B, T, D]` and the final state `[B, D, N]` from u
    /// `[B, T, D]`, Δ `[B, T, D]` (after the softplus), A `[D, N]`, B and C `[B, T, N]`, D `[D]`
    /// (optional) and the initial state `[B, D, N]` (optional: zeros), the layouts of
    /// [`super::reference::selective_scan`]. u, B, C and y are of the runner's [`Dtype`]
    /// (`f32`, or `u16` holding bf16 bits); Δ, A, D and the states are float32. Asynchronous
    /// on [`Gpu::stream`].
    ///
    /// # Errors
    /// [`GpuError::Config`] for a buffer whose length does not fit the shape or an element
    /// type other than the runner's dtype; driver errors from the launch.
    #[allow(clippy::too_many_arguments)]
    pub fn launch<T: DeviceRepr>(
        &mut self,
        gpu: &Gpu,
        u: &CudaSlice<T>,
        delta: &CudaSlice<f32>,
        a: &CudaSlice<f32>,
        b: &CudaSlice<T>,
        c: &CudaSlice<T>,
        d: Option<&CudaSlice<f32>>,
        initial_state: Option<&CudaSlice<f32>>,
        y: &mut CudaViewMut<'_, T>,
        final_state: &mut CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        let s = self.shape;
        let want = match self.dtype {
            Dtype::F32 => 4,
            Dtype::Bf16 => 2,
        };
        if std::mem::size_of::<T>() != want {
            return Err(GpuError::Config(format!(
                "selective_scan: the runner was built for {:?}, not {}-byte elements",
                self.dtype,
                std::mem::size_of::<T>()
            )));
        }
        let bt = s.batch * s.seq_len;
        let state_len = s.batch * s.channels * s.state;
        let checks = [
            ("u", u.len(), bt * s.channels),
            ("delta", delta.len(), bt * s.channels),
            ("a", a.len(), s.channels * s.state),
            ("b", b.len(), bt * s.state),
            ("c", c.len(), bt * s.state),
            ("d", d.map_or(s.channels, |d| d.len()), s.channels),
            (
                "initial_state",
                initial_state.map_or(state_len, |v| v.len()),
                state_len,
            ),
            ("y", y.len(), bt * s.channels),
            ("final_state", final_state.len(), state_len),
        ];
        super::cuda::check_buffers("selective_scan", &s, &checks)?;
        if s.seq_len == 0 {
            return super::cuda::no_step(gpu, initial_state, final_state);
        }
        let has_d = i32::from(d.is_some());
        let has_initial = i32::from(initial_state.is_some());
        let (t_len, channels, n) = (s.seq_len as i32, s.channels as i32, s.state as i32);
        let cfg = LaunchConfig {
            grid_dim: (
                s.channels.div_ceil(WARPS as usize) as u32,
                s.batch as u32,
                1,
            ),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut l = gpu.stream.launch_builder(&self.function);
        l.arg(u)
            .arg(delta)
            .arg(a)
            .arg(b)
            .arg(c)
            .arg(d.unwrap_or(&self.unused))
            .arg(&has_d)
            .arg(initial_state.unwrap_or(&self.unused))
            .arg(&has_initial)
            .arg(&mut *y)
            .arg(&mut *final_state)
            .arg(&t_len)
            .arg(&channels)
            .arg(&n);
        // SAFETY: scan_fwd_<t>_s<S>(const T* u, const float* delta, const float* A,
        // const T* Bm, const T* Cm, const float* D, int has_d, const float* initial_state,
        // int has_initial, T* y, float* final_state, int T_len, int channels, int N): the
        // lengths and the element size were checked above, T_len ≥ 1, and `new` picked S with
        // 32·S ≥ N; each warp reads and writes the rows of its (batch entry, channel) only,
        // for channels below D; D and the initial state are read only when has_d and
        // has_initial are 1, and then hold D and B·D·N floats.
        unsafe { l.launch(cfg)? };
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_per_lane_covers_the_state() {
        assert_eq!(states_per_lane(0), None);
        assert_eq!(states_per_lane(1), Some(1));
        assert_eq!(states_per_lane(16), Some(1));
        assert_eq!(states_per_lane(32), Some(1));
        assert_eq!(states_per_lane(33), Some(2));
        assert_eq!(states_per_lane(64), Some(2));
        assert_eq!(states_per_lane(65), Some(4));
        assert_eq!(states_per_lane(100), Some(4));
        assert_eq!(states_per_lane(128), Some(4));
        assert_eq!(states_per_lane(129), Some(8));
        assert_eq!(states_per_lane(256), Some(8));
        assert_eq!(states_per_lane(257), None);
        for n in 1..=MAX_STATE {
            let s = states_per_lane(n).unwrap();
            assert!(STATES_PER_LANE.contains(&s), "{n}");
            assert!(32 * s >= n, "{n}");
        }
    }

    #[test]
    fn entry_points_are_named_once() {
        let e = entry_points();
        assert_eq!(e.len(), 8);
        assert_eq!(e[0], "scan_fwd_f32_s1");
        assert_eq!(e[7], "scan_fwd_bf16_s8");
        for (i, name) in e.iter().enumerate() {
            assert!(!e[..i].contains(name), "{name} twice");
        }
        // Each is one SCAN_ENTRY(<t>, <type>, <S>) line of the source.
        for d in [Dtype::F32, Dtype::Bf16] {
            for s in STATES_PER_LANE {
                let ty = if d == Dtype::F32 { "float" } else { "u16" };
                let line = format!("SCAN_ENTRY({}, {ty}, {s})", d.tag());
                assert!(SCAN_SRC.contains(&line), "{line}");
            }
        }
        assert!(SCAN_SRC.contains(&format!("#define SCAN_WARPS {WARPS}")));
    }
}
