//! The gated delta rule's backward on CUDA (Gated DeltaNet; Yang, Kautz and Hatamizadeh, 2024,
//! "Gated Delta Networks: Improving Mamba2 with Delta Rule"): the vector-Jacobian product of
//! [`super::reference::gated_delta_rule`] for f32 and bf16 inputs, float32 gradients, checked
//! against the float64 [`super::delta_gradients::gated_delta_rule_backward`] (GPU tests) and,
//! on the CPU, by `kernels/sequence_mixers/emulate/gdn_bwd_check.cpp`.
//!
//! Version 1.1, float32 on CUDA cores (`kernels/sequence_mixers/delta_bwd.cu` derives it): the
//! forward's version-2 preparation and state pass run again (U, the log decays and the state
//! entering each chunk, float32, whatever path the forward took); each chunk then solves a
//! unit upper-triangular system for the parts of G_t = (dS_t + do_t q_tᵀ) k_t its own inputs
//! give; the state's gradient walks the chunks from the last, [`ROWS`] of its rows per block;
//! every chunk then gives dv, dβ (one kernel) and dq, dk, dα (another) at once. Six launches,
//! no atomics: the same bits on every run. dα is the gradient at the gate the forward uses
//! (ln α floored at −20) and is computed without dividing by α.

use cudarc::driver::{
    CudaEvent, CudaFunction, CudaSlice, CudaViewMut, DeviceRepr, LaunchConfig, PushKernelArg,
};

use super::cuda::Dtype;
use super::delta_cuda::{self, CHUNK, DELTA_SRC, ROWS, THREADS};
use super::reference::DeltaShape;
use crate::gpu::{Gpu, GpuError};

/// The CUDA source of the backward kernels (compiled after [`DELTA_SRC`]).
pub const DELTA_BWD_SRC: &str = include_str!("../../kernels/sequence_mixers/delta_bwd.cu");

/// What NVRTC compiles for the backward: the prelude, [`DELTA_SRC`] (the forward's preparation
/// and state pass, its limits) and [`DELTA_BWD_SRC`].
pub fn source() -> String {
    super::cuda::with_prelude(&format!("{DELTA_SRC}\n{DELTA_BWD_SRC}"))
}

/// Value rows per slice of the two gradient kernels (`GDN_VS` in the source).
pub const VALUE_SLICE: usize = 16;

/// The six launches of one backward, in order (what [`DeltaBackward::stage_times_ms`] names).
pub const STAGES: [&str; 6] = [
    "forward preparation (recomputed)",
    "forward state pass (recomputed)",
    "backward preparation",
    "backward state pass",
    "values (dv, dβ)",
    "keys (dq, dk, dα)",
];

/// The kernels [`DELTA_BWD_SRC`] adds, per dtype tag, in launch order.
const KERNELS: [&str; 4] = [
    "gdn_bwd_prepare",
    "gdn_bwd_state_pass",
    "gdn_bwd_values",
    "gdn_bwd_keys",
];

/// Every entry point [`DELTA_BWD_SRC`] adds: its four kernels for `f32` and `bf16`, in launch
/// order per dtype.
pub fn entry_points() -> Vec<String> {
    [Dtype::F32, Dtype::Bf16]
        .into_iter()
        .flat_map(|d| KERNELS.iter().map(move |k| format!("{k}_{}", d.tag())))
        .collect()
}

/// The shared memory one block may have on compute capability 9.0 (227 KiB).
const MAX_SHARED: u32 = 227 * 1024;

/// Dynamic shared memory of the four backward kernels for `shape`, bytes, in launch order,
/// with L = [`CHUNK`], KP = K | 1, RP = [`ROWS`] + 1, PP = L + 1 and SP = [`VALUE_SLICE`] + 1
/// (odd strides against bank conflicts):
/// - preparation: 3·L·KP (q, k, then W') + 2·L·V (R then G~, do) + L·PP (the triangular
///   matrices) + 2·L (g, β) floats;
/// - state pass: ROWS·KP (its rows of dS) + 3·L·KP (W', q, k) + 2·L·RP (G, do) + 2·L floats;
/// - values: 2·L·KP (q, k) + L·PP (the decayed k·k) + 2·VS·KP (rows of S_in and D) + 4·L·SP
///   (u, G, v, do) + 2·L + [`THREADS`] (a block sum) floats;
/// - keys: 5·L·PP (four products and Y) + max(2·L·KP, 4·L·SP + 2·VS·KP) (q and k over the
///   slices) + 4·L floats.
pub fn shared_bytes(shape: DeltaShape) -> [u32; 4] {
    let (l, k, v) = (CHUNK, shape.key_dim, shape.value_dim);
    let (kp, rp, pp, sp, vs) = (k | 1, ROWS + 1, l + 1, VALUE_SLICE + 1, VALUE_SLICE);
    [
        3 * l * kp + 2 * l * v + l * pp + 2 * l,
        ROWS * kp + 3 * l * kp + 2 * l * rp + 2 * l,
        2 * l * kp + l * pp + 2 * vs * kp + 4 * l * sp + 2 * l + THREADS as usize,
        5 * l * pp + (2 * l * kp).max(4 * l * sp + 2 * vs * kp) + 4 * l,
    ]
    .map(|floats| (floats * 4) as u32)
}

/// The gated delta rule's backward kernels and scratch for one shape and dtype (float32):
/// W then W' `[B, H, n_chunks, L, K]`; U, G and u′ `[B, H, n_chunks, L, V]`; the log decays
/// `[B, H, n_chunks, L]`; the state and its gradient at each chunk `[B, H, n_chunks, V, K]`;
/// three per-step sums `[B, H, n_chunks, 2L + 1]`; the recomputed final state.
pub struct DeltaBackward {
    shape: DeltaShape,
    dtype: Dtype,
    /// The forward's preparation and state pass (version 2), then [`KERNELS`].
    kernels: [CudaFunction; 6],
    smem: [u32; 6],
    w: CudaSlice<f32>,
    u: CudaSlice<f32>,
    g: CudaSlice<f32>,
    states: CudaSlice<f32>,
    final_state: CudaSlice<f32>,
    gv: CudaSlice<f32>,
    dstates: CudaSlice<f32>,
    uref: CudaSlice<f32>,
    terms: CudaSlice<f32>,
    /// Stands in for an absent initial state or final state's cotangent (never read).
    unused: CudaSlice<f32>,
    /// Events recorded before the first launch and after each ([`Self::time_stages`]).
    marks: Option<[CudaEvent; 7]>,
    /// NVRTC compile and module load time, s (0 when this process had compiled the source).
    pub compile_s: f64,
}

impl DeltaBackward {
    /// Compiles the kernels and allocates the scratch for `shape` and `dtype`.
    ///
    /// # Errors
    /// [`GpuError::Config`] for a shape the forward refuses ([`delta_cuda::GatedDelta::new`]'s limits: an
    /// empty dimension other than seq_len, K or V over [`delta_cuda::MAX_DIM`], batch or heads over
    /// 65,535, seq_len past 32-bit ints); [`GpuError::Compile`] with the NVRTC log; driver
    /// errors (out of memory).
    pub fn new(gpu: &Gpu, shape: DeltaShape, dtype: Dtype) -> Result<DeltaBackward, GpuError> {
        let s = shape;
        delta_cuda::check_shape(s)?;
        let [prep, pass, ..] = delta_cuda::shared_bytes(s);
        let [bp, bs, bv, bk] = shared_bytes(s);
        let smem = [prep, pass, bp, bs, bv, bk];
        if let Some(&most) = smem.iter().max().filter(|&&m| m > MAX_SHARED) {
            // Unreachable with K, V ≤ MAX_DIM (181,760 bytes at 128); kept for a larger one.
            return Err(GpuError::Config(format!(
                "gated delta backward: key_dim {} and value_dim {} need {most} bytes of shared \
                 memory per block, more than {MAX_SHARED}",
                s.key_dim, s.value_dim
            )));
        }
        let compiled = gpu.compile("delta_bwd.cu", &source())?;
        let tag = dtype.tag();
        let names = ["gdn_prepare", "gdn_state_pass"]
            .into_iter()
            .chain(KERNELS)
            .map(|k| format!("{k}_{tag}"))
            .collect::<Vec<_>>();
        let function = |i: usize| gpu.function(&compiled.module, &names[i], smem[i]);
        let kernels = [
            function(0)?,
            function(1)?,
            function(2)?,
            function(3)?,
            function(4)?,
            function(5)?,
        ];
        let chunks = s.batch * s.heads * s.seq_len.div_ceil(CHUNK);
        let alloc = |n: usize| gpu.stream.alloc_zeros::<f32>(n.max(1));
        Ok(DeltaBackward {
            shape,
            dtype,
            kernels,
            smem,
            w: alloc(chunks * CHUNK * s.key_dim)?,
            u: alloc(chunks * CHUNK * s.value_dim)?,
            g: alloc(chunks * CHUNK)?,
            states: alloc(chunks * s.value_dim * s.key_dim)?,
            final_state: alloc(s.batch * s.heads * s.value_dim * s.key_dim)?,
            gv: alloc(chunks * CHUNK * s.value_dim)?,
            dstates: alloc(chunks * s.value_dim * s.key_dim)?,
            uref: alloc(chunks * CHUNK * s.value_dim)?,
            terms: alloc(chunks * (2 * CHUNK + 1))?,
            unused: alloc(1)?,
            marks: None,
            compile_s: compiled.compile_s,
        })
    }

    /// From now on, records a device event before the first launch of each call and after each
    /// of its six ([`STAGES`]), for [`Self::stage_times_ms`]: for tuning notes, not for timed
    /// rows (the events are launches of their own).
    ///
    /// # Errors
    /// A driver error creating the events.
    pub fn time_stages(&mut self, gpu: &Gpu) -> Result<(), GpuError> {
        let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let mut marks = Vec::with_capacity(7);
        for _ in 0..7 {
            marks.push(gpu.ctx.new_event(flags)?);
        }
        self.marks = marks.try_into().ok();
        Ok(())
    }

    /// The device time of each launch of the last call, ms, named as in [`STAGES`]; waits for
    /// the call to finish.
    ///
    /// # Errors
    /// [`GpuError::Config`] unless [`Self::time_stages`] was called before the last call;
    /// driver errors.
    pub fn stage_times_ms(&self) -> Result<Vec<(&'static str, f32)>, GpuError> {
        let marks = self.marks.as_ref().ok_or_else(|| {
            GpuError::Config("gated delta backward: time_stages was not called".into())
        })?;
        let mut out = Vec::with_capacity(6);
        for (i, name) in STAGES.iter().enumerate() {
            out.push((*name, marks[i].elapsed_ms(&marks[i + 1])?));
        }
        Ok(out)
    }

    /// Records mark `i` on the stream when stage timing is on.
    fn mark(&self, gpu: &Gpu, i: usize) -> Result<(), GpuError> {
        if let Some(m) = &self.marks {
            m[i].record(&gpu.stream)?;
        }
        Ok(())
    }

    /// Bytes of scratch one call uses beyond its inputs and outputs (every buffer above,
    /// float32).
    pub fn temporary_bytes(&self) -> u64 {
        let words = [
            &self.w,
            &self.u,
            &self.g,
            &self.states,
            &self.final_state,
            &self.gv,
            &self.dstates,
            &self.uref,
            &self.terms,
            &self.unused,
        ]
        .iter()
        .map(|b| b.len())
        .sum::<usize>();
        4 * words as u64
    }

    /// Launches one backward: from the forward's inputs (as [`delta_cuda::GatedDelta::launch`] takes
    /// them: q and k `[B, T, H, K]`, keys L2-normalised, v `[B, T, H, V]` of the runner's
    /// dtype; α and β `[B, T, H]` float32, α positive; the initial state `[B, H, V, K]`
    /// optional), the output's cotangent `d_out` `[B, T, H, V]` (the runner's dtype) and the
    /// final state's `[B, H, V, K]` (float32, optional: zeros), the gradients into `grads`
    /// (float32: dq and dk `[B, T, H, K]`, dv `[B, T, H, V]`, dα and dβ `[B, T, H]`) and the
    /// initial state's into `d_initial_state` `[B, H, V, K]`, each written whole. Six
    /// launches, asynchronous on [`Gpu::stream`]; the same bits on every run.
    ///
    /// # Errors
    /// [`GpuError::Config`] for a buffer whose length does not fit the shape or an element
    /// type other than the runner's dtype; driver errors from the launches.
    #[allow(clippy::too_many_arguments)]
    pub fn launch_into<T: DeviceRepr>(
        &mut self,
        gpu: &Gpu,
        (q, k, v): (&CudaSlice<T>, &CudaSlice<T>, &CudaSlice<T>),
        (alpha, beta): (&CudaSlice<f32>, &CudaSlice<f32>),
        initial_state: Option<&CudaSlice<f32>>,
        d_out: &CudaSlice<T>,
        d_final_state: Option<&CudaSlice<f32>>,
        grads: &mut [CudaViewMut<'_, f32>; 5],
        d_initial_state: &mut CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        let s = self.shape;
        super::cuda::check_element::<T>(self.dtype, "gated delta backward")?;
        let n = s.batch * s.seq_len * s.heads;
        let state_len = s.batch * s.heads * s.value_dim * s.key_dim;
        let [dq, dk, dv, d_alpha, d_beta] = grads;
        let optional = |x: Option<&CudaSlice<f32>>| x.map_or(state_len, |x| x.len());
        let checks = [
            ("q", q.len(), n * s.key_dim),
            ("k", k.len(), n * s.key_dim),
            ("v", v.len(), n * s.value_dim),
            ("alpha", alpha.len(), n),
            ("beta", beta.len(), n),
            ("initial_state", optional(initial_state), state_len),
            ("d_out", d_out.len(), n * s.value_dim),
            ("d_final_state", optional(d_final_state), state_len),
            ("dq", dq.len(), n * s.key_dim),
            ("dk", dk.len(), n * s.key_dim),
            ("dv", dv.len(), n * s.value_dim),
            ("d_alpha", d_alpha.len(), n),
            ("d_beta", d_beta.len(), n),
            ("d_initial_state", d_initial_state.len(), state_len),
        ];
        super::cuda::check_buffers("gated delta backward", &s, &checks)?;
        if s.seq_len == 0 {
            return super::cuda::no_step(gpu, d_final_state, d_initial_state);
        }
        let n_chunks = s.seq_len.div_ceil(CHUNK);
        let smem = self.smem;
        let has_initial = i32::from(initial_state.is_some());
        let has_d_final = i32::from(d_final_state.is_some());
        let (t_len, heads, chunks) = (s.seq_len as i32, s.heads as i32, n_chunks as i32);
        let (kd, vd) = (s.key_dim as i32, s.value_dim as i32);
        let cfg = |grid: (u32, u32, u32), smem: u32| LaunchConfig {
            grid_dim: grid,
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: smem,
        };
        let per_chunk = (n_chunks as u32, s.heads as u32, s.batch as u32);
        let row_blocks = (
            s.value_dim.div_ceil(ROWS) as u32,
            s.heads as u32,
            s.batch as u32,
        );
        self.mark(gpu, 0)?;
        let mut l = gpu.stream.launch_builder(&self.kernels[0]);
        l.arg(k).arg(v).arg(alpha).arg(beta);
        l.arg(&mut self.w).arg(&mut self.u).arg(&mut self.g);
        l.arg(&t_len).arg(&heads).arg(&kd).arg(&vd);
        // SAFETY: gdn_prepare_<t>(const T* k, const T* v, const float* alpha,
        // const float* beta, float* w, float* u, float* g, int T_len, int heads, int K, int V):
        // the inputs were checked above, the scratch sized for this shape in `new`; blocks
        // (chunk, head, batch entry) write their chunk's slots.
        unsafe { l.launch(cfg(per_chunk, smem[0]))? };
        self.mark(gpu, 1)?;
        let mut l = gpu.stream.launch_builder(&self.kernels[1]);
        l.arg(k).arg(&self.w).arg(&mut self.u).arg(&self.g);
        l.arg(initial_state.unwrap_or(&self.unused))
            .arg(&has_initial);
        l.arg(&mut self.states).arg(&mut self.final_state);
        l.arg(&t_len).arg(&heads).arg(&kd).arg(&vd).arg(&chunks);
        // SAFETY: gdn_state_pass_<t>(const T* k, const float* w, float* u, const float* g,
        // const float* initial_state, int has_initial, float* states, float* final_state,
        // int T_len, int heads, int K, int V, int n_chunks): blocks own disjoint rows of the
        // state, U and the states scratch; the initial state is read only when has_initial is
        // 1 and then holds B·H·V·K floats (checked).
        unsafe { l.launch(cfg(row_blocks, smem[1]))? };
        self.mark(gpu, 2)?;
        let mut l = gpu.stream.launch_builder(&self.kernels[2]);
        l.arg(q).arg(k).arg(d_out).arg(beta).arg(&self.g);
        l.arg(&mut self.w).arg(&mut self.gv);
        l.arg(&t_len).arg(&heads).arg(&kd).arg(&vd);
        // SAFETY: gdn_bwd_prepare_<t>(const T* q, const T* k, const T* dout, const float* beta,
        // const float* g, float* wp, float* gv, int T_len, int heads, int K, int V): blocks
        // (chunk, head, batch entry) read their chunk's rows and write W' over its W (read by
        // the launch before on this stream, not after) and G~.
        unsafe { l.launch(cfg(per_chunk, smem[2]))? };
        self.mark(gpu, 3)?;
        let mut l = gpu.stream.launch_builder(&self.kernels[3]);
        l.arg(q).arg(k).arg(d_out).arg(beta).arg(&self.g);
        l.arg(&self.w).arg(&mut self.gv);
        l.arg(d_final_state.unwrap_or(&self.unused))
            .arg(&has_d_final);
        l.arg(&mut self.dstates).arg(&mut *d_initial_state);
        l.arg(&t_len).arg(&heads).arg(&kd).arg(&vd).arg(&chunks);
        // SAFETY: gdn_bwd_state_pass_<t>(const T* q, const T* k, const T* dout,
        // const float* beta, const float* g, const float* wp, float* gv, const float* d_final,
        // int has_d_final, float* dstates, float* d_initial, int T_len, int heads, int K,
        // int V, int n_chunks): blocks (row block, head, batch entry) own disjoint rows of dS,
        // G and dstates; d_final is read only when has_d_final is 1 (checked length); K ≤
        // MAX_DIM (`new`), which its per-thread item arrays assume.
        unsafe { l.launch(cfg(row_blocks, smem[3]))? };
        self.mark(gpu, 4)?;
        let mut l = gpu.stream.launch_builder(&self.kernels[4]);
        l.arg(q).arg(k).arg(v).arg(d_out).arg(beta).arg(&self.g);
        l.arg(&self.u)
            .arg(&self.states)
            .arg(&self.dstates)
            .arg(&self.gv);
        l.arg(&mut *dv).arg(&mut *d_beta);
        l.arg(&mut self.uref).arg(&mut self.terms);
        l.arg(&t_len).arg(&heads).arg(&kd).arg(&vd);
        // SAFETY: gdn_bwd_values_<t>(const T* q, const T* k, const T* v, const T* dout,
        // const float* beta, const float* g, const float* u, const float* states,
        // const float* dstates, const float* gv, float* dv, float* d_beta, float* uref,
        // float* terms, int T_len, int heads, int K, int V): blocks (chunk, head, batch entry)
        // read the scratch the launches before wrote for their chunk and write their chunk's
        // rows of dv, dβ, u′ and the sums.
        unsafe { l.launch(cfg(per_chunk, smem[4]))? };
        self.mark(gpu, 5)?;
        let mut l = gpu.stream.launch_builder(&self.kernels[5]);
        l.arg(q).arg(k).arg(d_out).arg(beta).arg(&self.g);
        l.arg(&self.u)
            .arg(&self.states)
            .arg(&self.dstates)
            .arg(&self.gv);
        l.arg(&self.uref).arg(&self.terms);
        l.arg(&mut *dq).arg(&mut *dk).arg(&mut *d_alpha);
        l.arg(&t_len).arg(&heads).arg(&kd).arg(&vd);
        // SAFETY: gdn_bwd_keys_<t>(const T* q, const T* k, const T* dout, const float* beta,
        // const float* g, const float* u, const float* states, const float* dstates,
        // const float* gv, const float* uref, const float* terms, float* dq, float* dk,
        // float* d_alpha, int T_len, int heads, int K, int V): as above; K ≤ MAX_DIM (its
        // register columns, MAX_DIM / 4 per thread).
        unsafe { l.launch(cfg(per_chunk, smem[5]))? };
        self.mark(gpu, 6)?;
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
    fn shared_memory_is_counted_in_floats_and_fits() {
        // K = 8 (KP 9), V = 4: the layouts of the source's header, by hand.
        assert_eq!(
            shared_bytes(shape(8, 4)),
            [
                (3 * 64 * 9 + 2 * 64 * 4 + 64 * 65 + 128) * 4,
                (16 * 9 + 3 * 64 * 9 + 2 * 64 * 17 + 128) * 4,
                (2 * 64 * 9 + 64 * 65 + 2 * 16 * 9 + 4 * 64 * 17 + 128 + 256) * 4,
                (5 * 64 * 65 + (4 * 64 * 17 + 2 * 16 * 9) + 256) * 4,
            ]
        );
        // The largest shape the forward takes fits one block on sm_90.
        let most = shared_bytes(shape(delta_cuda::MAX_DIM, delta_cuda::MAX_DIM));
        assert_eq!(most[0], 181_760);
        assert!(most.iter().all(|&b| b <= MAX_SHARED), "{most:?}");
    }

    #[test]
    fn entry_points_are_in_the_source() {
        let e = entry_points();
        assert_eq!(e.len(), 8);
        for k in KERNELS {
            assert!(DELTA_BWD_SRC.contains(&format!("{k}_##NAME(")), "{k}");
        }
        // The constants the host mirrors.
        assert!(DELTA_BWD_SRC.contains(&format!("#define GDN_VS {VALUE_SLICE}")));
    }
}
