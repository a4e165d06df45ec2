//! Based's backward on CUDA: the vector-Jacobian product of [`super::reference::based`] (Arora
//! et al., 2024, "Simple linear attention language models balance the recall-throughput
//! tradeoff"), for f32 and bf16 inputs, float32 gradients, checked against the float64 [`super::based_gradients::based_backward`] (GPU tests) and, on
//! the CPU, by `kernels/sequence_mixers/emulate/based_bwd_check.cpp`.
//!
//! The linear branch is SSD with every dt 1, A 0, B = k, C = q, x = v and a group per head
//! (as the forward, [`super::based_cuda`]), scaled by c: its backward is SSD's
//! ([`SsdBackward::launch_scaled_into`] with dy read times c), which writes dq (SSD's dC),
//! dk (dB), dv (dX) and dS₀ whole. The window branch's backward, `kernels/sequence_mixers/
//! based_bwd.cu`, then adds its part: a kernel per tile of query rows (the row's log-sum-exp
//! and D = Σ P dP, then dq) and one per tile of keys (dk, dv) — FlashAttention-2's backward
//! restricted to the window, without atomics: the same bits on every run. The window's
//! kernels are version 2 on tensor cores for bf16 with K and V multiples of 16
//! ([`window_backward_tc_shared_bytes`]; P and dS rounded to bf16 for their products) and
//! version 1, float32 on CUDA cores, otherwise; SSD's backward is float32 on CUDA cores.

use cudarc::driver::{
    CudaFunction, CudaSlice, CudaViewMut, DeviceRepr, LaunchConfig, PushKernelArg,
};

use super::based_cuda::{self, linear_shape, BASED_SRC, THREADS, TILE};
use super::cuda::Dtype;
use super::reference::BasedShape;
use super::ssd_backward::SsdBackward;
use crate::gpu::{Gpu, GpuError};

/// The CUDA source of the window branch's backward kernels (compiled after [`BASED_SRC`]).
pub const BASED_BWD_SRC: &str = include_str!("../../kernels/sequence_mixers/based_bwd.cu");

/// What NVRTC compiles for the window branch's backward: the prelude, [`BASED_SRC`] (its
/// limits and tile) and [`BASED_BWD_SRC`].
pub fn source() -> String {
    super::cuda::with_prelude(&format!("{BASED_SRC}\n{BASED_BWD_SRC}"))
}

/// Every entry point [`BASED_BWD_SRC`] adds.
pub fn entry_points() -> Vec<String> {
    let mut v = Vec::new();
    for d in [Dtype::F32, Dtype::Bf16] {
        for k in ["dq", "dkv"] {
            v.push(format!("based_bwd_window_{k}_{}", d.tag()));
        }
    }
    v.push("based_bwd_window_dq_tc".to_string());
    v.push("based_bwd_window_dkv_tc".to_string());
    v
}

/// Dynamic shared memory of the window's tensor-core backward kernels (version 2, bf16) for
/// `shape`, bytes: L rows of K + 8 and V + 8 bf16, twice each (the dq kernel: the tile's
/// queries and dy, the step's keys and values; the dk/dv kernel: the tile's keys and values,
/// the step's queries and dy), and for the dk/dv kernel 2·L floats (the step's log-sum-exp and
/// D), L = [`TILE`]; `None` when the shape does not fit them (bf16, K and V multiples of 16;
/// version 1 runs the rest).
pub fn window_backward_tc_shared_bytes(shape: BasedShape, dtype: Dtype) -> Option<[u32; 2]> {
    let (l, k, v) = (TILE, shape.key_dim, shape.value_dim);
    (dtype == Dtype::Bf16 && k.is_multiple_of(16) && v.is_multiple_of(16)).then(|| {
        let halves = 2 * l * (k + 8) + 2 * l * (v + 8);
        [(halves * 2) as u32, (halves * 2 + 2 * l * 4) as u32]
    })
}

/// The shared memory one block may have on compute capability 9.0 (227 KiB).
const MAX_SHARED: u32 = 227 * 1024;

/// Dynamic shared memory of the window's backward kernels for `shape`, bytes: the dq kernel
/// 2·L·(K | 1) + 2·L·(V | 1) + L·(L + 1) floats (the tile's queries and dy, the step's keys
/// and values, dS), the dk/dv kernel 2·L·(K | 1) + 2·L·(V | 1) + 2·L·(L + 1) + 2·L (the tile's
/// keys and values, the step's queries and dy, P and dS, the step's log-sum-exp and D),
/// L = [`TILE`].
pub fn window_backward_shared_bytes(shape: BasedShape) -> [u32; 2] {
    let (l, k, v) = (TILE, shape.key_dim | 1, shape.value_dim | 1);
    let rows = 2 * l * k + 2 * l * v;
    [
        ((rows + l * (l + 1)) * 4) as u32,
        ((rows + 2 * l * (l + 1) + 2 * l) * 4) as u32,
    ]
}

/// Based's backward kernels and scratch for one shape.
pub struct BasedBackward {
    shape: BasedShape,
    linear: SsdBackward,
    dq: CudaFunction,
    dkv: CudaFunction,
    /// The window kernels' threads per block and shared memory (version 2's on tensor cores,
    /// or version 1's).
    threads: u32,
    smem: [u32; 2],
    /// The linear branch's dt (all 1, `[B, T, H]`) and A (all 0, `[H]`).
    ones: CudaSlice<f32>,
    zeros: CudaSlice<f32>,
    /// Per query row, the window's log-sum-exp of its scores and D = Σ_s P dP, `[B, T, H]`.
    lse: CudaSlice<f32>,
    dsum: CudaSlice<f32>,
    /// SSD's gradients Based has no input for: dΔ `[B, T, H]`, dA and dD `[H]`.
    unused_grads: [CudaSlice<f32>; 3],
    /// NVRTC compile and module load time of both modules, s (0 for a module this process
    /// had compiled).
    pub compile_s: f64,
}

impl BasedBackward {
    /// Compiles the kernels and allocates the scratch for `shape` and `dtype`.
    ///
    /// # Errors
    /// [`GpuError::Config`] for a shape the forward refuses ([`based_cuda::Based::new`]) or
    /// whose shared memory passes 227 KiB; [`GpuError::Compile`] with the NVRTC log; driver
    /// errors (out of memory).
    pub fn new(gpu: &Gpu, shape: BasedShape, dtype: Dtype) -> Result<BasedBackward, GpuError> {
        let s = shape;
        based_cuda::check_shape(s)?;
        let (tag, threads, smem) = match window_backward_tc_shared_bytes(s, dtype) {
            Some(bytes) => ("tc", based_cuda::TC_THREADS, bytes),
            None => (dtype.tag(), THREADS, window_backward_shared_bytes(s)),
        };
        if let Some(&most) = smem.iter().max().filter(|&&m| m > MAX_SHARED) {
            return Err(GpuError::Config(format!(
                "based backward: key_dim {} and value_dim {} need {most} bytes of shared memory \
                 per block, more than {MAX_SHARED}",
                s.key_dim, s.value_dim
            )));
        }
        let linear = SsdBackward::new(gpu, linear_shape(s), dtype)?;
        let compiled = gpu.compile("based_bwd.cu", &source())?;
        let dq = gpu.function(
            &compiled.module,
            &format!("based_bwd_window_dq_{tag}"),
            smem[0],
        )?;
        let dkv = gpu.function(
            &compiled.module,
            &format!("based_bwd_window_dkv_{tag}"),
            smem[1],
        )?;
        let bth = (s.batch * s.seq_len * s.heads).max(1);
        let alloc = |len: usize| gpu.stream.alloc_zeros::<f32>(len.max(1));
        Ok(BasedBackward {
            shape,
            compile_s: linear.compile_s + compiled.compile_s,
            linear,
            dq,
            dkv,
            threads,
            smem,
            ones: gpu.stream.clone_htod(&vec![1f32; bth])?,
            zeros: alloc(s.heads)?,
            lse: alloc(bth)?,
            dsum: alloc(bth)?,
            unused_grads: [alloc(bth)?, alloc(s.heads)?, alloc(s.heads)?],
        })
    }

    /// Bytes of scratch one call uses beyond its inputs and outputs: SSD's backward's
    /// ([`SsdBackward::temporary_bytes`]), the linear branch's dt and A, two floats per query
    /// row and the gradients of SSD's inputs Based does not have.
    pub fn temporary_bytes(&self) -> u64 {
        let words = self.ones.len()
            + self.zeros.len()
            + self.lse.len()
            + self.dsum.len()
            + self.unused_grads.iter().map(|v| v.len()).sum::<usize>();
        self.linear.temporary_bytes() + 4 * words as u64
    }

    /// Launches one backward: from the forward's inputs (as [`based_cuda::Based::launch`]
    /// takes them: q and k `[B, T, H, K]`, v `[B, T, H, V]` of the runner's dtype, the scale,
    /// the initial linear state `[B, H, V, K]` optional), dy `[B, T, H, V]` (the runner's
    /// dtype) and the final linear state's cotangent `[B, H, V, K]` (float32, optional:
    /// zeros), the gradients into `grads` (float32: dq and dk `[B, T, H, K]`, dv
    /// `[B, T, H, V]`) and the initial state's into `d_initial_state` `[B, H, V, K]`, each
    /// written whole. Eleven launches, asynchronous on [`Gpu::stream`]; the same bits on every
    /// run (no atomics).
    ///
    /// # Errors
    /// [`GpuError::Config`] for a buffer whose length does not fit the shape or an element
    /// type other than the runner's dtype; driver errors from the launches.
    #[allow(clippy::too_many_arguments)]
    pub fn launch_into<T: DeviceRepr>(
        &mut self,
        gpu: &Gpu,
        (q, k, v): (&CudaSlice<T>, &CudaSlice<T>, &CudaSlice<T>),
        scale: f32,
        initial_state: Option<&CudaSlice<f32>>,
        dy: &CudaSlice<T>,
        d_final_state: Option<&CudaSlice<f32>>,
        grads: &mut [CudaViewMut<'_, f32>; 3],
        d_initial_state: &mut CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        let s = self.shape;
        let bth = s.batch * s.seq_len * s.heads;
        let [dq, dk, dv] = grads;
        let checks = [
            ("dq", dq.len(), bth * s.key_dim),
            ("dk", dk.len(), bth * s.key_dim),
            ("dv", dv.len(), bth * s.value_dim),
        ];
        super::cuda::check_buffers("based backward", &s, &checks)?;
        // The linear branch (SSD's backward checks the inputs, the state and the element
        // type): dX → dv, dB → dk, dC → dq, dy read times the scale.
        let [ddt, da, dd] = &mut self.unused_grads;
        self.linear.launch_scaled_into(
            gpu,
            (v, &self.ones, &self.zeros, k, q),
            None,
            initial_state,
            (dy, scale),
            d_final_state,
            &mut [
                dv.slice_mut(..),
                ddt.as_view_mut(),
                da.as_view_mut(),
                dk.slice_mut(..),
                dq.slice_mut(..),
                dd.as_view_mut(),
            ],
            d_initial_state,
        )?;
        if s.seq_len == 0 {
            return Ok(());
        }
        let (t_len, heads) = (s.seq_len as i32, s.heads as i32);
        let (kd, vd, w) = (s.key_dim as i32, s.value_dim as i32, s.window as i32);
        let cfg = |smem: u32| LaunchConfig {
            grid_dim: (
                s.seq_len.div_ceil(TILE) as u32,
                s.heads as u32,
                s.batch as u32,
            ),
            block_dim: (self.threads, 1, 1),
            shared_mem_bytes: smem,
        };
        let mut l = gpu.stream.launch_builder(&self.dq);
        l.arg(q).arg(k).arg(v).arg(dy).arg(&scale);
        l.arg(&mut self.lse).arg(&mut self.dsum).arg(&mut *dq);
        l.arg(&t_len).arg(&heads).arg(&kd).arg(&vd).arg(&w);
        // SAFETY: based_bwd_window_dq_<t>, or based_bwd_window_dq_tc with T u16 (chosen in `new`
        // for bf16 with K and V multiples of 16), (const T* q, const T* k, const T* v, const T* dy,
        // float scale, float* lse, float* dsum, float* dq, int T_len, int heads, int K, int V,
        // int W): q, k, v and dy were checked by SSD's backward (as C, B, X and dy), dq above;
        // lse and dsum hold B·T·H floats (`new`); `new` checked K, V ≤ 128 (the accumulators
        // per thread) and raised the kernel's shared-memory limit to this size; the block of
        // row tile i reads steps max(0, 64i − W + 1)..min(64i + 64, T) and adds to its rows of
        // dq (written whole by the linear branch's launches before it on this stream).
        unsafe { l.launch(cfg(self.smem[0]))? };
        let mut l = gpu.stream.launch_builder(&self.dkv);
        l.arg(q).arg(k).arg(v).arg(dy).arg(&scale);
        l.arg(&self.lse).arg(&self.dsum).arg(&mut *dk).arg(&mut *dv);
        l.arg(&t_len).arg(&heads).arg(&kd).arg(&vd).arg(&w);
        // SAFETY: based_bwd_window_dkv_<t> or based_bwd_window_dkv_tc (as above), (const T* q, const T* k, const T* v, const T* dy,
        // float scale, const float* lse, const float* dsum, float* dk, float* dv, int T_len,
        // int heads, int K, int V, int W): as above; the block of key tile i reads queries
        // 64i..min(64i + 63 + W − 1, T − 1) and their lse and dsum (written by the dq kernel
        // before it on this stream) and adds to its keys' rows of dk and dv.
        unsafe { l.launch(cfg(self.smem[1]))? };
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_memory_fits_the_grid_shapes() {
        let s = |k: usize, v: usize| BasedShape {
            batch: 1,
            seq_len: 1,
            heads: 1,
            key_dim: k,
            value_dim: v,
            window: 64,
        };
        assert_eq!(
            window_backward_shared_bytes(s(64, 32)),
            [
                ((2 * 64 * 65 + 2 * 64 * 33 + 64 * 65) * 4) as u32,
                ((2 * 64 * 65 + 2 * 64 * 33 + 2 * 64 * 65 + 128) * 4) as u32
            ]
        );
        // K = V = 128, the largest the forward takes, fits.
        assert!(window_backward_shared_bytes(s(128, 128))
            .iter()
            .all(|&b| b <= MAX_SHARED));
        // The tensor-core kernels: bf16 rows of K + 8 and V + 8, twice each, and 2·64 floats.
        let halves = 2 * 64 * 72 + 2 * 64 * 40;
        assert_eq!(
            window_backward_tc_shared_bytes(s(64, 32), Dtype::Bf16),
            Some([(halves * 2) as u32, (halves * 2 + 512) as u32])
        );
        assert_eq!(window_backward_tc_shared_bytes(s(64, 32), Dtype::F32), None);
        assert_eq!(
            window_backward_tc_shared_bytes(s(40, 32), Dtype::Bf16),
            None
        );
        assert!(
            BASED_BWD_SRC.contains("based_bwd_window_dq_tc(")
                && BASED_BWD_SRC.contains("based_bwd_window_dkv_tc(")
        );
    }

    #[test]
    fn entry_points_are_in_the_source() {
        let e = entry_points();
        assert_eq!(e.len(), 6);
        for name in e.iter().take(4) {
            let stem = name.trim_end_matches("_f32").trim_end_matches("_bf16");
            assert!(BASED_BWD_SRC.contains(&format!("{stem}_##NAME(")), "{name}");
        }
    }
}
