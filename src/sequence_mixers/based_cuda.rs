//! Based on CUDA: SSD's kernels ([`super::cuda`]) and `kernels/sequence_mixers/based.cu`,
//! compiled by NVRTC at run time: the forward of [`super::reference::based`] (Arora et al.,
//! 2024, "Simple linear attention language models balance the recall-throughput tradeoff"):
//! causal linear attention plus exact softmax attention over a sliding window of W keys, summed.
//! The linear branch is SSD's chunked algorithm ([`Ssd::launch_f32_out`]) with no decay (every
//! dt 1, A 0; B = k, C = q, x = v, a group per head), on SSD's tensor-core kernels in bf16
//! where they take the shape and its float32 kernels otherwise, the chunks in parallel, into a
//! float32 scratch. Then the window branch, one block per tile of [`TILE`] query rows walking
//! the keys they see [`TILE`] at a time (an online softmax per row), which adds the scaled
//! scratch and writes O: version 2 on tensor cores for bf16 with K and V multiples of 16
//! ([`window_tc_shared_bytes`]), version 1.2 in float32 on CUDA cores otherwise.
//!
//! Every version starts every call from an empty window cache: the reference's
//! [`BasedState`](super::reference::BasedState) also carries the last W − 1 keys and values
//! into the next call, which a later version will read; this API takes only the initial linear
//! state S₀ (so it has nothing to refuse) and returns only the final linear state, not the
//! cache (the last W − 1 keys and values are the tail of the caller's own k and v).

use cudarc::driver::{
    CudaFunction, CudaSlice, CudaViewMut, DeviceRepr, LaunchConfig, PushKernelArg,
};

use super::cuda::{Dtype, Ssd};
use super::reference::{BasedShape, SsdShape};
use crate::gpu::{Gpu, GpuError};

/// The CUDA source of the Based kernels ([`entry_points`] names them).
pub const BASED_SRC: &str = include_str!("../../kernels/sequence_mixers/based.cu");

/// What NVRTC compiles for the window kernel: the shared prelude
/// ([`super::cuda::with_prelude`]) and [`BASED_SRC`] (the linear branch is SSD's module,
/// [`super::cuda::source`]).
pub fn source() -> String {
    super::cuda::with_prelude(BASED_SRC)
}

/// Time steps per chunk of the linear branch (SSD's [`super::cuda::CHUNK`]).
pub const CHUNK: usize = super::cuda::CHUNK;

/// Threads per block of the window kernel (`BASED_THREADS` in the source).
pub const THREADS: u32 = 256;

/// Query rows per block of the window kernel, and keys per step (`BASED_TILE` in the source).
pub const TILE: usize = 64;

/// The largest key and value width, K and V (`BASED_MAX_DIM` in the source).
pub const MAX_DIM: usize = 128;

/// The largest window W (`BASED_MAX_WINDOW` in the source).
pub const MAX_WINDOW: usize = 256;

/// The largest batch and head counts: they are grid dimensions y and z.
const MAX_GRID_YZ: usize = 65_535;

/// Every entry point of [`BASED_SRC`].
pub fn entry_points() -> Vec<String> {
    let mut v: Vec<String> = [Dtype::F32, Dtype::Bf16]
        .iter()
        .map(|d| format!("based_window_{}", d.tag()))
        .collect();
    v.push("based_window_tc".to_string());
    v
}

/// Threads per block of the tensor-core window kernel (`BASED_TC_THREADS`).
pub const TC_THREADS: u32 = 128;

/// Dynamic shared memory of the tensor-core window kernel (version 2, bf16) for `shape`,
/// bytes: L rows of K + 8 (queries, keys) and V + 8 (values) bf16, L = [`TILE`], or `None`
/// when the shape does not fit it (K and V multiples of 16; the float32 kernel runs those).
pub fn window_tc_shared_bytes(shape: BasedShape, dtype: Dtype) -> Option<u32> {
    let (l, k, v) = (TILE, shape.key_dim, shape.value_dim);
    (dtype == Dtype::Bf16 && k.is_multiple_of(16) && v.is_multiple_of(16))
        .then(|| (l * (2 * (k + 8) + v + 8) * 2) as u32)
}

/// The linear branch as SSD sees it: head_dim = V, state = K, a group per head.
pub fn linear_shape(shape: BasedShape) -> SsdShape {
    SsdShape {
        batch: shape.batch,
        seq_len: shape.seq_len,
        heads: shape.heads,
        head_dim: shape.value_dim,
        state: shape.key_dim,
        groups: shape.heads,
    }
}

/// Dynamic shared memory of the linear branch's chunk-state and chunk-scan kernels for `shape`,
/// bytes: SSD's ([`super::cuda::shared_bytes`]) for [`linear_shape`].
pub fn shared_bytes(shape: BasedShape) -> (u32, u32) {
    super::cuda::shared_bytes(linear_shape(shape))
}

/// Dynamic shared memory of the window kernel for `shape`, bytes:
/// (2·L·(K | 1) + L·V + L·(L + 1)) floats, L = [`TILE`] (the tile's queries and the step's
/// keys, rows of an odd stride; the step's values; its probabilities, rows padded).
pub fn window_shared_bytes(shape: BasedShape) -> u32 {
    let (l, k, v) = (TILE, shape.key_dim, shape.value_dim);
    ((2 * l * (k | 1) + l * v + l * (l + 1)) * 4) as u32
}

/// The shared memory one block may have on compute capability 9.0 (227 KiB). The linear branch
/// needs up to 177 KiB (K = V = 128), the window kernel 114 KiB; a device with less (sm_80:
/// 163 KiB) refuses the largest shapes when the kernel's limit is raised (a driver error),
/// smaller shapes run.
const MAX_SHARED: u32 = 227 * 1024;

/// The shapes version 1 runs: the reference's (no empty dimension other than seq_len, W ≥ 1),
/// K and V ≤ [`MAX_DIM`], W ≤ [`MAX_WINDOW`], T within a 32-bit int, B and H within a grid
/// dimension (65 535).
pub(crate) fn check_shape(s: BasedShape) -> Result<(), GpuError> {
    if s.batch == 0 || s.heads == 0 || s.key_dim == 0 || s.value_dim == 0 || s.window == 0 {
        return Err(GpuError::Config(format!("based: empty dimension in {s:?}")));
    }
    if s.key_dim > MAX_DIM || s.value_dim > MAX_DIM {
        return Err(GpuError::Config(format!(
            "based: key_dim {} and value_dim {} must be at most {MAX_DIM} (version 1)",
            s.key_dim, s.value_dim
        )));
    }
    if s.window > MAX_WINDOW {
        return Err(GpuError::Config(format!(
            "based: window {} is more than {MAX_WINDOW} (version 1)",
            s.window
        )));
    }
    if s.seq_len + CHUNK > i32::MAX as usize || s.batch > MAX_GRID_YZ || s.heads > MAX_GRID_YZ {
        return Err(GpuError::Config(format!(
            "based: {s:?} does not fit 32-bit ints and the grid (batch and heads at most \
             {MAX_GRID_YZ})"
        )));
    }
    let smem = shared_bytes(s).1.max(window_shared_bytes(s));
    if smem > MAX_SHARED {
        return Err(GpuError::Config(format!(
            "based: key_dim {} and value_dim {} need {smem} bytes of shared memory per block, \
             more than {MAX_SHARED}",
            s.key_dim, s.value_dim
        )));
    }
    Ok(())
}

/// Based's compiled kernels and scratch for one shape: the linear branch as an [`Ssd`] of
/// [`linear_shape`] (its chunk states), its dt (all 1, `[B, T, H]`) and A (all 0, `[H]`), its
/// output `lin` `[B, T, H, V]` (float32), and the window kernel, which reads `lin`.
pub struct Based {
    shape: BasedShape,
    dtype: Dtype,
    linear: Ssd,
    window: CudaFunction,
    /// The window kernel's threads and shared memory (version 2's on tensor cores, or version
    /// 1.2's).
    window_cfg: (u32, u32),
    ones: CudaSlice<f32>,
    zeros: CudaSlice<f32>,
    lin: CudaSlice<f32>,
    /// NVRTC compile and module load time of both modules, s (0 for a module this process
    /// had compiled).
    pub compile_s: f64,
}

impl Based {
    /// Compiles the kernels and allocates the scratch for `shape` and `dtype`.
    ///
    /// # Errors
    /// [`GpuError::Config`] for a shape the reference refuses (an empty dimension other than
    /// seq_len, W = 0 included), K or V above [`MAX_DIM`], W above [`MAX_WINDOW`], T past a
    /// 32-bit int, or B or H past 65 535; [`GpuError::Compile`] with the NVRTC log; driver
    /// errors (out of memory).
    pub fn new(gpu: &Gpu, shape: BasedShape, dtype: Dtype) -> Result<Based, GpuError> {
        check_shape(shape)?;
        let s = shape;
        let linear = Ssd::new(gpu, linear_shape(s), dtype)?;
        let compiled = gpu.compile("based.cu", &source())?;
        let (name, window_cfg) = match window_tc_shared_bytes(s, dtype) {
            Some(bytes) => ("based_window_tc".to_string(), (TC_THREADS, bytes)),
            None => (
                format!("based_window_{}", dtype.tag()),
                (THREADS, window_shared_bytes(s)),
            ),
        };
        let window = gpu.function(&compiled.module, &name, window_cfg.1)?;
        let ones = gpu
            .stream
            .clone_htod(&vec![1f32; (s.batch * s.seq_len * s.heads).max(1)])?;
        let zeros = gpu.stream.alloc_zeros::<f32>(s.heads)?;
        let lin = gpu
            .stream
            .alloc_zeros::<f32>((s.batch * s.seq_len * s.heads * s.value_dim).max(1))?;
        Ok(Based {
            shape,
            dtype,
            compile_s: linear.compile_s + compiled.compile_s,
            linear,
            window,
            window_cfg,
            ones,
            zeros,
            lin,
        })
    }

    /// Bytes of scratch one call uses beyond its inputs and outputs.
    pub fn temporary_bytes(&self) -> u64 {
        self.linear.temporary_bytes()
            + (self.ones.len() + self.zeros.len() + self.lin.len()) as u64 * 4
    }

    /// Launches one Based forward: O `[B, T, H, V]` and the final linear state `[B, H, V, K]`
    /// from q and k `[B, T, H, K]` (already through the caller's feature map), v
    /// `[B, T, H, V]`, the scale on both branches' scores and the initial linear state S₀
    /// `[B, H, V, K]` (optional: zeros), the layouts of [`super::reference::based`], with an
    /// empty initial window cache (version 1). q, k, v and O are of the runner's [`Dtype`]
    /// (`f32`, or `u16` holding bf16 bits); the states are float32. Asynchronous on
    /// [`Gpu::stream`].
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
        scale: f32,
        initial_linear_state: Option<&CudaSlice<f32>>,
        o: &mut CudaViewMut<'_, T>,
        final_linear_state: &mut CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        let s = self.shape;
        let want = match self.dtype {
            Dtype::F32 => 4,
            Dtype::Bf16 => 2,
        };
        if std::mem::size_of::<T>() != want {
            return Err(GpuError::Config(format!(
                "based: the runner was built for {:?}, not {}-byte elements",
                self.dtype,
                std::mem::size_of::<T>()
            )));
        }
        let bth = s.batch * s.seq_len * s.heads;
        let state_len = s.batch * s.heads * s.value_dim * s.key_dim;
        let checks = [
            ("q", q.len(), bth * s.key_dim),
            ("k", k.len(), bth * s.key_dim),
            ("v", v.len(), bth * s.value_dim),
            (
                "initial_linear_state",
                initial_linear_state.map_or(state_len, |x| x.len()),
                state_len,
            ),
            ("o", o.len(), bth * s.value_dim),
            ("final_linear_state", final_linear_state.len(), state_len),
        ];
        super::cuda::check_buffers("based", &s, &checks)?;
        if s.seq_len == 0 {
            return super::cuda::no_step(gpu, initial_linear_state, final_linear_state);
        }
        // The linear branch: SSD with x = v, dt = 1, A = 0, B = k, C = q, a group per head,
        // no D; its float32 Y is the unscaled lin, its states S (V × K per head).
        self.linear.launch_f32_out(
            gpu,
            v,
            &self.ones,
            &self.zeros,
            k,
            q,
            None,
            initial_linear_state,
            &mut self.lin.as_view_mut(),
            final_linear_state,
        )?;
        let (t_len, heads) = (s.seq_len as i32, s.heads as i32);
        let (kd, vd, w) = (s.key_dim as i32, s.value_dim as i32, s.window as i32);
        let lin_scale = scale;
        let mut l = gpu.stream.launch_builder(&self.window);
        l.arg(q)
            .arg(k)
            .arg(v)
            .arg(&scale)
            .arg(&self.lin)
            .arg(&lin_scale)
            .arg(&mut *o)
            .arg(&t_len)
            .arg(&heads)
            .arg(&kd)
            .arg(&vd)
            .arg(&w);
        let cfg = LaunchConfig {
            grid_dim: (
                s.seq_len.div_ceil(TILE) as u32,
                s.heads as u32,
                s.batch as u32,
            ),
            block_dim: (self.window_cfg.0, 1, 1),
            shared_mem_bytes: self.window_cfg.1,
        };
        // SAFETY: based_window_<t>(const T* q, const T* k, const T* v, float scale,
        // const float* lin, float lin_scale, T* o, int T_len, int heads, int K, int V, int W),
        // or based_window_tc with T u16 (chosen in `new` for bf16 with K and V multiples of
        // 16): the checked buffers and the scratch the linear branch filled (same stream, so it
        // has finished); `new` checked K, V ≤ 128 (the accumulators per thread) and raised the
        // kernel's shared-memory limit to the size passed here; the block of tile i reads
        // queries, keys and values of steps max(0, 64i − W + 1)..min(64i + 64, T) and writes
        // the rows of O in its tile below T.
        unsafe { l.launch(cfg)? };
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(key_dim: usize, value_dim: usize, window: usize) -> BasedShape {
        BasedShape {
            batch: 1,
            seq_len: 1,
            heads: 1,
            key_dim,
            value_dim,
            window,
        }
    }

    #[test]
    fn shared_memory_is_counted_in_floats() {
        // The linear branch is SSD's kernels with head_dim = V and state = K: chunk state
        // (L·V + L·K + L), chunk scan (L·K + (L + V)·(K | 1) + L·L + L·V + L) floats.
        assert_eq!(
            shared_bytes(shape(64, 32, 4)),
            (
                ((64 * 32 + 64 * 64 + 64) * 4) as u32,
                ((64 * 64 + (64 + 32) * 65 + 64 * 64 + 64 * 32 + 64) * 4) as u32
            )
        );
        assert_eq!(
            linear_shape(shape(64, 32, 4)).groups,
            1,
            "a group per head (one head here)"
        );
        // K = V = 128, the largest, fits.
        let big = shared_bytes(shape(MAX_DIM, MAX_DIM, 4));
        assert!(big.0 <= MAX_SHARED && big.1 <= MAX_SHARED);
        // The window kernel: queries and keys [64][K | 1], values [64][V], probabilities
        // [64][65].
        assert_eq!(
            window_shared_bytes(shape(64, 32, 4)),
            ((2 * 64 * 65 + 64 * 32 + 64 * 65) * 4) as u32
        );
        assert!(window_shared_bytes(shape(MAX_DIM, MAX_DIM, 4)) <= MAX_SHARED);
        // The tensor-core window kernel: bf16 rows of K + 8 (twice) and V + 8.
        assert_eq!(
            window_tc_shared_bytes(shape(64, 32, 4), Dtype::Bf16),
            Some((64 * (2 * 72 + 40) * 2) as u32)
        );
        assert_eq!(window_tc_shared_bytes(shape(64, 32, 4), Dtype::F32), None);
        assert_eq!(window_tc_shared_bytes(shape(40, 32, 4), Dtype::Bf16), None);
    }

    #[test]
    fn shapes_past_version_1_are_refused() {
        assert!(check_shape(shape(128, 128, 256)).is_ok());
        assert!(check_shape(BasedShape {
            seq_len: 0,
            ..shape(4, 4, 1)
        })
        .is_ok());
        for bad in [
            shape(0, 4, 1),
            shape(4, 0, 1),
            shape(4, 4, 0),
            shape(129, 4, 1),
            shape(4, 129, 1),
            shape(4, 4, 257),
            BasedShape {
                batch: 0,
                ..shape(4, 4, 1)
            },
            BasedShape {
                heads: 65_536,
                ..shape(4, 4, 1)
            },
        ] {
            assert!(
                matches!(check_shape(bad), Err(GpuError::Config(_))),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn entry_points_are_named_once() {
        let e = entry_points();
        assert_eq!(e.len(), 3);
        assert!(BASED_SRC.contains("based_window_tc("));
        for name in e.iter().take(2) {
            let stem = name.trim_end_matches("_f32").trim_end_matches("_bf16");
            assert!(BASED_SRC.contains(&format!("{stem}_##NAME(")), "{name}");
        }
    }
}
