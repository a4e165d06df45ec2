//! The gated delta rule (Gated DeltaNet) forward on CUDA: `kernels/sequence_mixers/delta.cu`,
//! compiled by NVRTC at run time. Version 1 runs the chunked WY form of
//! [`super::chunked::gated_delta_rule`] (Yang, Kautz and Hatamizadeh, 2024, "Gated Delta
//! Networks: Improving Mamba2 with Delta Rule"; the WY form of Yang et al., 2024,
//! "Parallelizing Linear Transformers with the Delta Rule over Sequence Length", §3) on CUDA
//! cores in float32, in one launch: one block per (batch entry, head) walks the chunks of
//! [`CHUNK`] steps in order with the state in shared memory, and per chunk solves the
//! unit-lower-triangular system by forward substitution, then computes U, the output and the
//! next state. Correctness first: the products are plain loops over shared memory, not
//! tensor-core tiles, and the chunks of one (batch entry, head) run one after another.

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

/// The largest key and value width per head version 1 takes (`GDN_MAX_DIM` in the source):
/// the state (V × K floats) and the chunk's q, k, W and U stay in one block's shared memory.
pub const MAX_DIM: usize = 128;

/// The shared memory one block may have on compute capability 9.0 (227 KiB). K = V = 128
/// needs 210.25 KiB; a device with less (sm_80: 163 KiB) refuses the larger shapes when the
/// kernel's limit is raised (a driver error), smaller ones run (K = V = 64: 98 KiB).
const MAX_SHARED: u32 = 227 * 1024;

/// Every entry point of [`DELTA_SRC`]: `gdn_fwd_f32` and `gdn_fwd_bf16`.
pub fn entry_points() -> Vec<String> {
    [Dtype::F32, Dtype::Bf16]
        .into_iter()
        .map(|d| format!("gdn_fwd_{}", d.tag()))
        .collect()
}

/// Dynamic shared memory of the kernel for `shape`, bytes: V·(K+1) (the state) + 3·L·(K+1)
/// (the chunk's q, k and W) + L·V (U) + L·L (the triangular matrices) + 4·L (decays and β)
/// floats, L = [`CHUNK`]; rows of K floats are padded to K + 1 against bank conflicts.
pub fn shared_bytes(shape: DeltaShape) -> u32 {
    let (l, k, v) = (CHUNK, shape.key_dim, shape.value_dim);
    let floats = v * (k + 1) + 3 * l * (k + 1) + l * v + l * l + 4 * l;
    (floats * 4) as u32
}

/// The gated-delta-rule forward kernel compiled for one shape and dtype. No scratch: the state
/// lives in shared memory from the first chunk to the last.
pub struct GatedDelta {
    shape: DeltaShape,
    dtype: Dtype,
    forward: CudaFunction,
    /// Stands in for the initial state when none is given (never read).
    unused: CudaSlice<f32>,
    /// NVRTC compile and module load time, s (0 when this process had compiled the source).
    pub compile_s: f64,
}

impl GatedDelta {
    /// Compiles the kernel for `shape` and `dtype`.
    ///
    /// # Errors
    /// [`GpuError::Config`] for a shape the reference refuses (an empty dimension other than
    /// seq_len), a key or value width over [`MAX_DIM`], more than 65535 batch entries (the
    /// grid's y), or dimensions past 32-bit ints; [`GpuError::Compile`] with the NVRTC log;
    /// driver errors (a device whose blocks cannot have [`shared_bytes`]).
    pub fn new(gpu: &Gpu, shape: DeltaShape, dtype: Dtype) -> Result<GatedDelta, GpuError> {
        let s = shape;
        if s.batch == 0 || s.heads == 0 || s.key_dim == 0 || s.value_dim == 0 {
            return Err(GpuError::Config(format!(
                "gated_delta_rule: empty dimension in {s:?}"
            )));
        }
        if s.key_dim > MAX_DIM || s.value_dim > MAX_DIM {
            return Err(GpuError::Config(format!(
                "gated_delta_rule: key_dim {} and value_dim {} must be at most {MAX_DIM} \
                 (version 1 keeps the state in shared memory)",
                s.key_dim, s.value_dim
            )));
        }
        // The kernel's chunk start (an int) passes seq_len by up to one chunk.
        let fits = |v: usize| v <= i32::MAX as usize;
        if !(fits(s.seq_len + CHUNK) && fits(s.heads) && s.batch <= 65535) {
            return Err(GpuError::Config(format!(
                "gated_delta_rule: {s:?} does not fit 32-bit ints and the grid"
            )));
        }
        let smem = shared_bytes(s);
        if smem > MAX_SHARED {
            // Unreachable with K, V ≤ MAX_DIM; kept so that a larger MAX_DIM fails here.
            return Err(GpuError::Config(format!(
                "gated_delta_rule: key_dim {} and value_dim {} need {smem} bytes of shared \
                 memory per block, more than {MAX_SHARED}",
                s.key_dim, s.value_dim
            )));
        }
        let compiled = gpu.compile("delta.cu", &source())?;
        let forward = gpu.function(&compiled.module, &format!("gdn_fwd_{}", dtype.tag()), smem)?;
        let unused = gpu.stream.alloc_zeros::<f32>(1)?;
        Ok(GatedDelta {
            shape,
            dtype,
            forward,
            unused,
            compile_s: compiled.compile_s,
        })
    }

    /// Bytes of scratch one call uses beyond its inputs and outputs: none.
    pub fn temporary_bytes(&self) -> u64 {
        0
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
    /// type other than the runner's dtype; driver errors from the launch.
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
        let want = match self.dtype {
            Dtype::F32 => 4,
            Dtype::Bf16 => 2,
        };
        if std::mem::size_of::<T>() != want {
            return Err(GpuError::Config(format!(
                "gated_delta_rule: the runner was built for {:?}, not {}-byte elements",
                self.dtype,
                std::mem::size_of::<T>()
            )));
        }
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
        let has_initial = i32::from(initial_state.is_some());
        let (t_len, heads) = (s.seq_len as i32, s.heads as i32);
        let (kd, vd) = (s.key_dim as i32, s.value_dim as i32);
        let cfg = LaunchConfig {
            grid_dim: (s.heads as u32, s.batch as u32, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: shared_bytes(s),
        };
        let mut l = gpu.stream.launch_builder(&self.forward);
        l.arg(q)
            .arg(k)
            .arg(v)
            .arg(alpha)
            .arg(beta)
            .arg(initial_state.unwrap_or(&self.unused))
            .arg(&has_initial)
            .arg(&mut *o)
            .arg(&mut *final_state)
            .arg(&t_len)
            .arg(&heads)
            .arg(&kd)
            .arg(&vd);
        // SAFETY: gdn_fwd_<t>(const T* q, const T* k, const T* v, const float* alpha,
        // const float* beta, const float* initial_state, int has_initial, T* o,
        // float* final_state, int T_len, int heads, int K, int V): the lengths and the element
        // size were checked above; one block per (head, batch entry) reads its rows below T
        // only and writes its rows of o and its slice of final_state; the initial state is
        // read only when has_initial is 1, and then holds B·H·V·K floats; K, V ≤ MAX_DIM and
        // the shared memory is what `new` raised the kernel's limit to.
        unsafe { l.launch(cfg)? };
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
        assert_eq!(
            shared_bytes(shape(64, 32)),
            ((32 * 65 + 3 * l * 65 + l * 32 + l * l + 4 * l) * 4) as u32
        );
        // K = V = 64: 98 KiB; K = V = 128, the largest, fits in 227 KiB (210.25 KiB).
        assert_eq!(shared_bytes(shape(64, 64)), 100_352);
        assert_eq!(shared_bytes(shape(128, 128)), 215_296);
        assert!(shared_bytes(shape(MAX_DIM, MAX_DIM)) <= MAX_SHARED);
    }

    #[test]
    fn entry_points_are_named_once() {
        let e = entry_points();
        assert_eq!(e, ["gdn_fwd_f32", "gdn_fwd_bf16"]);
        for name in &e {
            let stem = name.trim_end_matches("_f32").trim_end_matches("_bf16");
            assert!(DELTA_SRC.contains(stem), "{name}");
        }
        assert!(DELTA_SRC.contains("GDN_ENTRY(f32, float)"));
        assert!(DELTA_SRC.contains("GDN_ENTRY(bf16, u16)"));
        // The constants agree with the source's.
        assert!(DELTA_SRC.contains(&format!("#define GDN_CHUNK {CHUNK}")));
        assert!(DELTA_SRC.contains(&format!("#define GDN_THREADS {THREADS}")));
        assert!(DELTA_SRC.contains(&format!("#define GDN_MAX_DIM {MAX_DIM}")));
    }
}
