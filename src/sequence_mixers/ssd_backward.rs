//! SSD's backward on CUDA: `kernels/sequence_mixers/ssd_bwd.cu` compiled after `ssd.cu` in one
//! NVRTC module, the vector-Jacobian product of Mamba-2's SSD (Dao and Gu, 2024, "Transformers
//! are SSMs", the scalar-times-identity A) in chunks of [`CHUNK`] steps, float32 on CUDA cores
//! (version 1.1: the products register-tiled from shared memory), for f32 and bf16 inputs.
//! The forward's chunk states are recomputed in float32 (whichever path the forward itself
//! took), the adjoint of the state is passed from the last chunk back to the first the same
//! way, and every gradient is formed per chunk from the two; `ssd_bwd.cu`'s header derives
//! it. Checked against the float64 adjoint
//! [`super::gradients::ssd_backward`] (GPU tests) and, on the CPU, by
//! `kernels/sequence_mixers/emulate/ssd_bwd_check.cpp`.

use cudarc::driver::{
    CudaFunction, CudaSlice, CudaViewMut, DeviceRepr, LaunchConfig, PushKernelArg,
};

use super::cuda::{
    check_buffers, check_shape, shared_bytes, Dtype, CHUNK, PRELUDE_SRC, SSD_SRC, THREADS,
};
use super::reference::SsdShape;
use crate::gpu::{Gpu, GpuError};

/// The CUDA source of SSD's backward kernels (compiled after [`SSD_SRC`], whose forward
/// kernels and helpers it uses).
pub const SSD_BWD_SRC: &str = include_str!("../../kernels/sequence_mixers/ssd_bwd.cu");

/// What NVRTC compiles for SSD's backward: the prelude, [`SSD_SRC`], then [`SSD_BWD_SRC`].
pub fn source() -> String {
    format!("{PRELUDE_SRC}\n{SSD_SRC}\n{SSD_BWD_SRC}")
}

/// Every entry point [`SSD_BWD_SRC`] adds.
pub fn entry_points() -> Vec<String> {
    let mut v: Vec<String> = ["ssd_bwd_state_passing", "ssd_bwd_ddt", "ssd_bwd_sum"]
        .map(String::from)
        .to_vec();
    for d in [Dtype::F32, Dtype::Bf16] {
        for k in ["chunk_state", "chunk_adjoint", "dx", "db", "dc"] {
            v.push(format!("ssd_bwd_{k}_{}", d.tag()));
        }
    }
    v
}

/// The shared memory one block may have on compute capability 9.0 (227 KiB).
const MAX_SHARED: u32 = 227 * 1024;

/// Warps per block (`SSD_WARPS`).
const WARPS: usize = THREADS as usize / 32;

/// Dynamic shared memory of the backward's kernels for `shape`, bytes, in launch order: the
/// forward's chunk state and the chunks' own adjoints (the same: L·P + L·N + L floats), dx
/// (L·N + L·(N | 1) + L·P + P·(N | 1) + L·L + L + warps), dB and dC (2·L·(P | 1) + L·L + L·N +
/// P·N + 2·L) and the sums for dΔ (2·warps floats), L = [`CHUNK`], 8 warps.
pub fn backward_shared_bytes(shape: SsdShape) -> [u32; 4] {
    let (l, p, n) = (CHUNK, shape.head_dim, shape.state);
    let dx = l * n + l * (n | 1) + l * p + p * (n | 1) + l * l + l + WARPS;
    let dbc = 2 * l * (p | 1) + l * l + l * n + p * n + 2 * l;
    let ddt = 2 * WARPS;
    [
        shared_bytes(shape).0,
        (dx * 4) as u32,
        (dbc * 4) as u32,
        (ddt * 4) as u32,
    ]
}

/// SSD's backward kernels and scratch for one shape.
pub struct SsdBackward {
    shape: SsdShape,
    dtype: Dtype,
    chunk_state: CudaFunction,
    passing: CudaFunction,
    adjoint: CudaFunction,
    adjoint_passing: CudaFunction,
    dx: CudaFunction,
    db: CudaFunction,
    dc: CudaFunction,
    ddt: CudaFunction,
    sum: CudaFunction,
    smem: [u32; 4],
    /// The state entering each chunk, `[B, H, n_chunks, P, N]`.
    states: CudaSlice<f32>,
    /// Each chunk's log decay, `[B, H, n_chunks]`.
    decay: CudaSlice<f32>,
    /// The adjoint entering each chunk from the next, `[B, H, n_chunks, P, N]`.
    adjoints: CudaSlice<f32>,
    /// The forward's final state `[B, H, P, N]` (for the final state's cotangent).
    final_state: CudaSlice<f32>,
    /// Per step and head: x·u, dy·x and C·(Sᵀ dy), `[B, T, H]` each.
    per_step: [CudaSlice<f32>; 3],
    /// Per chunk, ⟨R_c, S_e⟩: the part of dl from every step after the chunk, `[B, H, n_chunks]`.
    bound: CudaSlice<f32>,
    /// dB and dC per head before the group's sum, `[B, T, H, N]` each.
    per_head: [CudaSlice<f32>; 2],
    /// The parts of dA and dD per batch entry and head, `[B, H]` each.
    parts: [CudaSlice<f32>; 2],
    /// Stands in for D, the initial state or d_final_state when none is given (never read).
    unused: CudaSlice<f32>,
    /// NVRTC compile and module load time, s (0 when this process had compiled the source).
    pub compile_s: f64,
}

impl SsdBackward {
    /// Compiles the kernels and allocates the scratch for `shape` and `dtype`.
    ///
    /// # Errors
    /// [`GpuError::Config`] for an empty dimension other than seq_len, heads not a multiple
    /// of groups, head_dim or state past [`MAX_DIM`](super::cuda::MAX_DIM), sizes past
    /// 32-bit ints or the grid, or P and N whose shared memory passes 227 KiB;
    /// [`GpuError::Compile`] with the NVRTC log; driver errors (out of memory).
    pub fn new(gpu: &Gpu, shape: SsdShape, dtype: Dtype) -> Result<SsdBackward, GpuError> {
        let s = shape;
        check_shape("ssd backward", s)?;
        let smem = backward_shared_bytes(s);
        if let Some(&most) = smem.iter().max().filter(|&&m| m > MAX_SHARED) {
            return Err(GpuError::Config(format!(
                "ssd backward: head_dim {} and state {} need {most} bytes of shared memory per \
                 block, more than {MAX_SHARED}",
                s.head_dim, s.state
            )));
        }
        let compiled = gpu.compile("ssd_bwd.cu", &source())?;
        let tag = dtype.tag();
        let f = |name: &str, bytes: u32| gpu.function(&compiled.module, name, bytes);
        let n_chunks = s.seq_len.div_ceil(CHUNK);
        let bt = s.batch * s.seq_len;
        let alloc = |len: usize| gpu.stream.alloc_zeros::<f32>(len.max(1));
        let chunk_states = s.batch * s.heads * n_chunks * s.head_dim * s.state;
        Ok(SsdBackward {
            shape,
            dtype,
            chunk_state: f(&format!("ssd_bwd_chunk_state_{tag}"), smem[0])?,
            passing: f("ssd_state_passing", 0)?,
            adjoint: f(&format!("ssd_bwd_chunk_adjoint_{tag}"), smem[0])?,
            adjoint_passing: f("ssd_bwd_state_passing", 0)?,
            dx: f(&format!("ssd_bwd_dx_{tag}"), smem[1])?,
            db: f(&format!("ssd_bwd_db_{tag}"), smem[2])?,
            dc: f(&format!("ssd_bwd_dc_{tag}"), smem[2])?,
            ddt: f("ssd_bwd_ddt", smem[3])?,
            sum: f("ssd_bwd_sum", 0)?,
            smem,
            states: alloc(chunk_states)?,
            decay: alloc(s.batch * s.heads * n_chunks)?,
            adjoints: alloc(chunk_states)?,
            final_state: alloc(s.batch * s.heads * s.head_dim * s.state)?,
            per_step: [
                alloc(bt * s.heads)?,
                alloc(bt * s.heads)?,
                alloc(bt * s.heads)?,
            ],
            bound: alloc(s.batch * s.heads * n_chunks)?,
            per_head: [
                alloc(bt * s.heads * s.state)?,
                alloc(bt * s.heads * s.state)?,
            ],
            parts: [alloc(s.batch * s.heads)?, alloc(s.batch * s.heads)?],
            unused: alloc(1)?,
            compile_s: compiled.compile_s,
        })
    }

    /// Bytes of scratch one call uses beyond its inputs and outputs: the chunks' states and
    /// adjoints, their log decays and one more value per chunk, the forward's final state,
    /// three float32 values per step and head, dB and dC per head, and the parts of dA and dD.
    pub fn temporary_bytes(&self) -> u64 {
        let words = self.states.len()
            + self.decay.len()
            + self.adjoints.len()
            + self.final_state.len()
            + self.bound.len()
            + self.per_step.iter().map(|v| v.len()).sum::<usize>()
            + self.per_head.iter().map(|v| v.len()).sum::<usize>()
            + self.parts.iter().map(|v| v.len()).sum::<usize>();
        4 * words as u64
    }

    /// Launches one backward: from the forward's inputs (as [`super::cuda::Ssd::launch`]
    /// takes them: X `[B, T, H, P]`, Δ `[B, T, H]`, A `[H]`, B and C `[B, T, G, N]`, D `[H]`
    /// optional, the initial state `[B, H, P, N]` optional), dy `[B, T, H, P]` (the runner's
    /// dtype) and d_final_state `[B, H, P, N]` (float32, optional: zeros), every gradient into
    /// `grads` (float32: dX `[B, T, H, P]`, dΔ `[B, T, H]`, dA `[H]`, dB and dC
    /// `[B, T, G, N]`, dD `[H]`, zeros without D) and the initial state's into
    /// `d_initial_state` `[B, H, P, N]`, each written whole. Nine launches, asynchronous on
    /// [`Gpu::stream`]; the same bits on every run (no atomics).
    ///
    /// # Errors
    /// [`GpuError::Config`] for a buffer whose length does not fit the shape or an element
    /// type other than the runner's dtype; driver errors from the launches.
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    pub fn launch_into<T: DeviceRepr>(
        &mut self,
        gpu: &Gpu,
        inputs: (
            &CudaSlice<T>,
            &CudaSlice<f32>,
            &CudaSlice<f32>,
            &CudaSlice<T>,
            &CudaSlice<T>,
        ),
        d: Option<&CudaSlice<f32>>,
        initial_state: Option<&CudaSlice<f32>>,
        dy: &CudaSlice<T>,
        d_final_state: Option<&CudaSlice<f32>>,
        grads: &mut [CudaViewMut<'_, f32>; 6],
        d_initial_state: &mut CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        self.launch_scaled_into(
            gpu,
            inputs,
            d,
            initial_state,
            (dy, 1.0),
            d_final_state,
            grads,
            d_initial_state,
        )
    }

    /// [`SsdBackward::launch_into`] for the cotangent `dy_scale · dy` (dy read times the
    /// factor, in float32): the backward of `dy_scale · y`, as Based's linear branch needs
    /// (its output is its scale times SSD's y; `super::based_backward`).
    ///
    /// # Errors
    /// As [`SsdBackward::launch_into`].
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    pub fn launch_scaled_into<T: DeviceRepr>(
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
        (dy, dy_scale): (&CudaSlice<T>, f32),
        d_final_state: Option<&CudaSlice<f32>>,
        grads: &mut [CudaViewMut<'_, f32>; 6],
        d_initial_state: &mut CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        let s = self.shape;
        let want = match self.dtype {
            Dtype::F32 => 4,
            Dtype::Bf16 => 2,
        };
        if std::mem::size_of::<T>() != want {
            return Err(GpuError::Config(format!(
                "ssd backward: built for {:?}, not {}-byte elements",
                self.dtype,
                std::mem::size_of::<T>()
            )));
        }
        let bt = s.batch * s.seq_len;
        let state_len = s.batch * s.heads * s.head_dim * s.state;
        let [dx, ddt, da, db, dc, dd] = grads;
        let opt = |v: Option<&CudaSlice<f32>>, want: usize| v.map_or(want, |v| v.len());
        let checks = [
            ("x", x.len(), bt * s.heads * s.head_dim),
            ("dt", dt.len(), bt * s.heads),
            ("a", a.len(), s.heads),
            ("b", b.len(), bt * s.groups * s.state),
            ("c", c.len(), bt * s.groups * s.state),
            ("d", opt(d, s.heads), s.heads),
            ("initial_state", opt(initial_state, state_len), state_len),
            ("dy", dy.len(), bt * s.heads * s.head_dim),
            ("d_final_state", opt(d_final_state, state_len), state_len),
            ("dx", dx.len(), bt * s.heads * s.head_dim),
            ("ddt", ddt.len(), bt * s.heads),
            ("da", da.len(), s.heads),
            ("db", db.len(), bt * s.groups * s.state),
            ("dc", dc.len(), bt * s.groups * s.state),
            ("dd", dd.len(), s.heads),
            ("d_initial_state", d_initial_state.len(), state_len),
        ];
        check_buffers("ssd backward", &s, &checks)?;
        if s.seq_len == 0 {
            gpu.stream.memset_zeros(&mut *da)?;
            gpu.stream.memset_zeros(&mut *dd)?;
            // No step: the initial state's gradient is d_final_state; the rest are empty.
            return super::cuda::no_step(gpu, d_final_state, d_initial_state);
        }
        let n_chunks = s.seq_len.div_ceil(CHUNK);
        let (t_len, heads, groups) = (s.seq_len as i32, s.heads as i32, s.groups as i32);
        let (p, n, chunks) = (s.head_dim as i32, s.state as i32, n_chunks as i32);
        let has_d = i32::from(d.is_some());
        let has_initial = i32::from(initial_state.is_some());
        let has_d_final = i32::from(d_final_state.is_some());
        let cfg = |smem: u32, grid: (u32, u32, u32)| LaunchConfig {
            grid_dim: grid,
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: smem,
        };
        let per_chunk = (n_chunks as u32, s.heads as u32, s.batch as u32);
        let slices = (s.head_dim * s.state).div_ceil(THREADS as usize) as u32;
        let per_slice = (s.heads as u32, s.batch as u32, slices);
        let unused = &self.unused;
        let [xu, dyx, cdc] = &mut self.per_step;
        let [dbh, dch] = &mut self.per_head;
        let [pa, pd] = &mut self.parts;

        // 1, 2. The forward's chunk states (float32, ssd.cu's kernel 1 on the backward's tiled
        // products) and the states entering each chunk.
        let mut l = gpu.stream.launch_builder(&self.chunk_state);
        l.arg(x)
            .arg(dt)
            .arg(a)
            .arg(b)
            .arg(&mut self.states)
            .arg(&mut self.decay);
        l.arg(&t_len).arg(&heads).arg(&groups).arg(&p).arg(&n);
        // SAFETY: ssd_bwd_chunk_state_<t>(const T* x, const float* dt, const float* A, const T* Bm,
        // float* states, float* chunk_log_decay, int T_len, int heads, int groups, int P,
        // int N): the buffers were checked above, the scratch sized for this shape in `new`;
        // blocks (chunk, head, batch entry) write their own slice.
        unsafe { l.launch(cfg(self.smem[0], per_chunk))? };
        let mut l = gpu.stream.launch_builder(&self.passing);
        l.arg(&mut self.states)
            .arg(&self.decay)
            .arg(initial_state.unwrap_or(unused))
            .arg(&has_initial)
            .arg(&mut self.final_state);
        l.arg(&heads).arg(&chunks).arg(&p).arg(&n);
        // SAFETY: ssd_state_passing(float* states, const float* chunk_log_decay,
        // const float* initial_state, int has_initial, float* final_state, int heads,
        // int n_chunks, int P, int N): blocks (head, batch entry, slice) cover the P·N elements
        // once; the initial state is read only when has_initial is 1 (then B·H·P·N floats).
        unsafe { l.launch(cfg(0, per_slice))? };
        // 3, 4. The chunks' own adjoints, then the adjoint entering each chunk.
        let mut l = gpu.stream.launch_builder(&self.adjoint);
        l.arg(dy)
            .arg(&dy_scale)
            .arg(dt)
            .arg(a)
            .arg(c)
            .arg(&mut self.adjoints);
        l.arg(&t_len).arg(&heads).arg(&groups).arg(&p).arg(&n);
        // SAFETY: ssd_bwd_chunk_adjoint_<t>(const T* dy, float dy_scale, const float* dt, const float* A,
        // const T* Cm, float* adj, int T_len, int heads, int groups, int P, int N): as kernel 1,
        // with dy of X's length (checked).
        unsafe { l.launch(cfg(self.smem[0], per_chunk))? };
        let mut l = gpu.stream.launch_builder(&self.adjoint_passing);
        l.arg(&mut self.adjoints)
            .arg(&self.decay)
            .arg(d_final_state.unwrap_or(unused))
            .arg(&has_d_final)
            .arg(&mut *d_initial_state);
        l.arg(&heads).arg(&chunks).arg(&p).arg(&n);
        // SAFETY: ssd_bwd_state_passing, ssd_state_passing's arguments with d_final for the
        // initial state and d_initial for the final one: the same coverage; d_final is read only
        // when has_d_final is 1 (then B·H·P·N floats, checked).
        unsafe { l.launch(cfg(0, per_slice))? };
        // 5. dx, per step x·u and dy·x, and per chunk ⟨R_c, S_e⟩.
        let mut l = gpu.stream.launch_builder(&self.dx);
        l.arg(x)
            .arg(dt)
            .arg(a)
            .arg(b)
            .arg(c)
            .arg(d.unwrap_or(unused))
            .arg(&has_d);
        l.arg(dy)
            .arg(&dy_scale)
            .arg(&self.adjoints)
            .arg(&self.states)
            .arg(&self.final_state);
        l.arg(&mut *dx)
            .arg(&mut *xu)
            .arg(&mut *dyx)
            .arg(&mut self.bound);
        l.arg(&t_len).arg(&heads).arg(&groups).arg(&p).arg(&n);
        // SAFETY: ssd_bwd_dx_<t>(const T* x, const float* dt, const float* A, const T* Bm,
        // const T* Cm, const float* D, int has_d, const T* dy, float dy_scale, const float* adj,
        // const float* states, const float* final_state, float* dx, float* xu, float* dyx,
        // float* bound, int T_len, int heads, int groups, int P, int N): checked buffers,
        // scratch of B·T·H floats and of B·H·n_chunks (bound); D read only when has_d is 1.
        unsafe { l.launch(cfg(self.smem[1], per_chunk))? };
        // 6. dB and dC per head, and per step C·(Sᵀ dy).
        let mut l = gpu.stream.launch_builder(&self.db);
        l.arg(x)
            .arg(dt)
            .arg(a)
            .arg(c)
            .arg(dy)
            .arg(&dy_scale)
            .arg(&self.adjoints)
            .arg(&mut *dbh);
        l.arg(&t_len).arg(&heads).arg(&groups).arg(&p).arg(&n);
        // SAFETY: ssd_bwd_db_<t>(const T* x, const float* dt, const float* A, const T* Cm,
        // const T* dy, float dy_scale, const float* adj, float* dbh, int T_len, int heads, int groups, int P,
        // int N): dbh holds B·T·H·N floats (`new`).
        unsafe { l.launch(cfg(self.smem[2], per_chunk))? };
        let mut l = gpu.stream.launch_builder(&self.dc);
        l.arg(x)
            .arg(dt)
            .arg(a)
            .arg(b)
            .arg(c)
            .arg(dy)
            .arg(&dy_scale)
            .arg(&self.states);
        l.arg(&mut *dch).arg(&mut *cdc);
        l.arg(&t_len).arg(&heads).arg(&groups).arg(&p).arg(&n);
        // SAFETY: ssd_bwd_dc_<t>(const T* x, const float* dt, const float* A, const T* Bm,
        // const T* Cm, const T* dy, float dy_scale, const float* states, float* dch, float* cdc, int T_len,
        // int heads, int groups, int P, int N): as ssd_bwd_db, cdc of B·T·H floats.
        unsafe { l.launch(cfg(self.smem[2], per_chunk))? };
        // 7. dl per chunk: dΔ, and the parts of dA and dD.
        let mut l = gpu.stream.launch_builder(&self.ddt);
        l.arg(dt)
            .arg(a)
            .arg(&*xu)
            .arg(&*dyx)
            .arg(&*cdc)
            .arg(&self.bound);
        l.arg(&mut *ddt).arg(&mut *pa).arg(&mut *pd);
        l.arg(&t_len).arg(&heads).arg(&chunks);
        // SAFETY: ssd_bwd_ddt(const float* dt, const float* A, const float* xu,
        // const float* dyx, const float* cdc, const float* bound, float* ddt, float* pa,
        // float* pd, int T_len, int heads, int n_chunks): blocks (head, batch entry); the
        // per-step and per-chunk scratch written above.
        unsafe { l.launch(cfg(self.smem[3], (s.heads as u32, s.batch as u32, 1)))? };
        // 8. dB and dC over the group's heads; dA and dD over the batch.
        let rows = bt as i64;
        let batch = s.batch as i32;
        let blocks = (bt * s.groups * s.state)
            .div_ceil(THREADS as usize)
            .clamp(1, 65_535) as u32;
        let mut l = gpu.stream.launch_builder(&self.sum);
        l.arg(&*dbh).arg(&*dch).arg(&*pa).arg(&*pd).arg(&has_d);
        l.arg(&mut *db).arg(&mut *dc).arg(&mut *da).arg(&mut *dd);
        l.arg(&rows).arg(&batch).arg(&heads).arg(&groups).arg(&n);
        // SAFETY: ssd_bwd_sum(const float* dbh, const float* dch, const float* pa,
        // const float* pd, int has_d, float* db, float* dc, float* da, float* dd,
        // long long rows, int batch, int heads, int groups, int N): a grid-stride loop over
        // the B·T·G·N checked elements; block 0 writes the H entries of dA and dD.
        unsafe { l.launch(cfg(0, (blocks, 1, 1)))? };
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_memory_fits_the_grid_shapes() {
        let s = SsdShape {
            batch: 1,
            seq_len: 1,
            heads: 1,
            head_dim: 128,
            state: 128,
            groups: 1,
        };
        let [state, dx, dbc, ddt] = backward_shared_bytes(s);
        assert_eq!(state, ((64 * 128 + 64 * 128 + 64) * 4) as u32);
        assert_eq!(
            dx,
            ((64 * 128 + 64 * 129 + 64 * 128 + 128 * 129 + 64 * 64 + 64 + 8) * 4) as u32
        );
        assert_eq!(
            dbc,
            ((2 * 64 * 129 + 64 * 64 + 64 * 128 + 128 * 128 + 128) * 4) as u32
        );
        assert_eq!(ddt, (16 * 4) as u32);
        // head_dim = state = 128, the grid's largest, fits; 256 does not.
        assert!(backward_shared_bytes(s).iter().all(|&b| b <= MAX_SHARED));
        let big = SsdShape { head_dim: 256, ..s };
        assert!(backward_shared_bytes(big).iter().any(|&b| b > MAX_SHARED));
    }

    #[test]
    fn entry_points_are_in_the_source() {
        let e = entry_points();
        assert_eq!(e.len(), 13);
        for name in &e {
            let stem = name.trim_end_matches("_f32").trim_end_matches("_bf16");
            assert!(SSD_BWD_SRC.contains(stem), "{name}");
        }
    }
}
