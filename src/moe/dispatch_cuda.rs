//! Top-k routing, the dispatch plan, dispatch and combine on CUDA (`kernels/moe/dispatch.cu`):
//! the GPU forms of [`super::reference::route`], [`super::reference::plan`],
//! [`super::reference::dispatch`] and [`super::reference::combine`], with the same order (a
//! token's experts by decreasing logit, ties to the lower index; dispatched rows sorted by
//! expert, stably) and the same capacity rule, deterministic run to run. Assignment
//! `a = token · top_k + slot`. bf16 activations are held as their bits (`u16`).

use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig, PushKernelArg};

use super::reference::Gate;
use crate::gpu::{Gpu, GpuError};
use crate::sequence_mixers::cuda::with_prelude;

/// The kernel source (`kernels/moe/dispatch.cu`).
pub const DISPATCH_SRC: &str = include_str!("../../kernels/moe/dispatch.cu");

/// What NVRTC compiles: the sequence-mixer prelude, then [`DISPATCH_SRC`].
pub fn source() -> String {
    with_prelude(DISPATCH_SRC)
}

/// The kernels' names.
pub const ENTRY_POINTS: [&str; 12] = [
    "moe_route",
    "moe_chunk_counts",
    "moe_plan_offsets",
    "moe_scatter",
    "moe_gather",
    "moe_combine",
    "moe_swiglu",
    "moe_bf16_to_f32",
    "moe_combine_backward",
    "moe_swiglu_backward",
    "moe_gather_backward",
    "moe_route_backward",
];

/// Assignments per block of the plan kernels (`MD_CHUNK`).
pub const CHUNK: usize = 1024;
/// Most experts the kernels take: the routing holds 8 logits per lane (`MD_LANE_EXPERTS`).
pub const MAX_EXPERTS: usize = 256;
/// Most experts per token (`MD_MAX_TOP_K`).
pub const MAX_TOP_K: usize = 16;
/// Threads of the plan's offsets kernel (`MD_MAX_EXPERTS`).
const OFFSET_THREADS: u32 = 1024;

/// A routing on the device: `experts` and `weights` `[T, top_k]`.
pub struct DeviceRouting {
    /// Tokens.
    pub tokens: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Chosen experts (int32), a token's in decreasing logit.
    pub experts: CudaSlice<i32>,
    /// Gate weights (float32), summing to 1 per token.
    pub weights: CudaSlice<f32>,
}

/// A dispatch plan on the device ([`super::reference::DispatchPlan`]'s fields as int32).
pub struct DevicePlan {
    /// Experts.
    pub experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// `[E + 1]`: expert e owns dispatched rows `offsets[e] .. offsets[e + 1]`.
    pub offsets: CudaSlice<i32>,
    /// `[T · top_k]` (the first `offsets[E]` used): each dispatched row's assignment.
    pub rows: CudaSlice<i32>,
    /// `[T · top_k]`: each assignment's row, or −1 where its expert's capacity was full.
    pub row_of: CudaSlice<i32>,
}

impl DevicePlan {
    /// Dispatched rows an output of [`MoeDispatch::dispatch`] must hold: T · top_k (with a
    /// capacity, the kept rows are fewer: `offsets[E]`, on the device).
    pub fn max_rows(&self) -> usize {
        self.row_of.len()
    }
}

/// The compiled routing, plan, dispatch and combine kernels.
pub struct MoeDispatch {
    f: [CudaFunction; 12],
    /// NVRTC compile and module load time, s (0 when this process had compiled the source).
    pub compile_s: f64,
}

fn cfg(blocks: usize, threads: u32, smem: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (blocks.max(1) as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: smem as u32,
    }
}

fn config_error(what: String) -> GpuError {
    GpuError::Config(format!("MoE dispatch: {what}"))
}

/// The SwiGLU kernels' sizes: F positive and even, each buffer `(name, length, columns)`
/// holding `rows` rows of its columns; returns F and `rows` as int32.
fn swiglu_shape(
    f: usize,
    rows: usize,
    buffers: &[(&str, usize, usize)],
) -> Result<(i32, i32), GpuError> {
    if f == 0 || !f.is_multiple_of(2) {
        return Err(config_error(format!("F = {f} must be positive and even")));
    }
    for &(name, len, cols) in buffers {
        if len < rows * cols {
            return Err(config_error(format!(
                "{name} holds {len} elements; {rows} rows of {cols} need {}",
                rows * cols
            )));
        }
    }
    match (i32::try_from(f), i32::try_from(rows)) {
        (Ok(f_i), Ok(rows_i)) => Ok((f_i, rows_i)),
        _ => Err(config_error(format!(
            "F = {f} or {rows} rows above i32::MAX"
        ))),
    }
}

impl MoeDispatch {
    /// Compiles the kernels (once per process).
    ///
    /// # Errors
    /// [`GpuError::Compile`] with NVRTC's log; driver errors from loading.
    pub fn new(gpu: &Gpu) -> Result<MoeDispatch, GpuError> {
        let compiled = gpu.compile("dispatch.cu", &source())?;
        // moe_scatter's 32 · E ints at E = MAX_EXPERTS: 32 KB, under the default limit.
        let f: Vec<CudaFunction> = ENTRY_POINTS
            .iter()
            .map(|name| gpu.function(&compiled.module, name, 0))
            .collect::<Result<_, _>>()?;
        Ok(MoeDispatch {
            f: f.try_into()
                .unwrap_or_else(|_| unreachable!("one function per entry point")),
            compile_s: compiled.compile_s,
        })
    }

    /// Top-k routing of `tokens` tokens from router logits `[T, E]` (float32, finite).
    ///
    /// # Errors
    /// [`GpuError::Config`] for E above [`MAX_EXPERTS`], `top_k` of 0 or above E or
    /// [`MAX_TOP_K`], or a logits length other than T·E; driver errors.
    pub fn route(
        &self,
        gpu: &Gpu,
        logits: &CudaSlice<f32>,
        tokens: usize,
        experts: usize,
        top_k: usize,
        gate: Gate,
    ) -> Result<DeviceRouting, GpuError> {
        if experts == 0 || experts > MAX_EXPERTS || top_k == 0 || top_k > experts.min(MAX_TOP_K) {
            return Err(config_error(format!(
                "{experts} experts, top_k {top_k}: the kernels take 1 to {MAX_EXPERTS} experts and top_k from 1 to min(E, {MAX_TOP_K})"
            )));
        }
        if logits.len() != tokens * experts && !(tokens == 0 && logits.len() == 1) {
            return Err(config_error(format!(
                "logits hold {} values, T·E = {}",
                logits.len(),
                tokens * experts
            )));
        }
        let n = (tokens * top_k).max(1);
        // SAFETY: every element is written by moe_route before any read (T·top_k outputs).
        let mut ex = unsafe { gpu.stream.alloc::<i32>(n)? };
        let mut w = unsafe { gpu.stream.alloc::<f32>(n)? };
        if tokens > 0 {
            let (t, e, k) = (tokens as i32, experts as i32, top_k as i32);
            let sigmoid = i32::from(gate == Gate::Sigmoid);
            let mut l = gpu.stream.launch_builder(&self.f[0]);
            l.arg(logits)
                .arg(&mut ex)
                .arg(&mut w)
                .arg(&t)
                .arg(&e)
                .arg(&k)
                .arg(&sigmoid);
            // SAFETY: moe_route(const float* logits, int* experts, float* weights, int T,
            // int E, int top_k, int sigmoid), one warp per token (4 per block): lengths
            // checked above, E ≤ 256 and top_k ≤ 16 as the kernel's arrays hold.
            unsafe { l.launch(cfg(tokens.div_ceil(4), 128, 0))? };
        }
        Ok(DeviceRouting {
            tokens,
            top_k,
            experts: ex,
            weights: w,
        })
    }

    /// The dispatch plan of `routing` over `experts` experts, keeping at most `capacity`
    /// assignments per expert (`None`: dropless).
    ///
    /// # Errors
    /// [`GpuError::Config`] for E above [`MAX_EXPERTS`] or a capacity above `i32::MAX`; driver
    /// errors. The routing's experts must lie below `experts` (the kernels do not check).
    pub fn plan(
        &self,
        gpu: &Gpu,
        routing: &DeviceRouting,
        experts: usize,
        capacity: Option<usize>,
    ) -> Result<DevicePlan, GpuError> {
        if experts == 0 || experts > MAX_EXPERTS {
            return Err(config_error(format!(
                "{experts} experts (1 to {MAX_EXPERTS})"
            )));
        }
        let cap: i32 = match capacity {
            None => -1,
            Some(c) => i32::try_from(c)
                .map_err(|_| config_error(format!("capacity {c} above i32::MAX")))?,
        };
        let n = routing.tokens * routing.top_k;
        let chunks = n.div_ceil(CHUNK).max(1);
        let mut ranks = gpu.stream.alloc_zeros::<i32>(chunks * experts)?;
        let mut offsets = gpu.stream.alloc_zeros::<i32>(experts + 1)?;
        let mut rows = gpu.stream.alloc_zeros::<i32>(n.max(1))?;
        let mut row_of = gpu.stream.alloc_zeros::<i32>(n.max(1))?;
        let (n_i, e_i, c_i) = (n as i32, experts as i32, chunks as i32);
        let mut l = gpu.stream.launch_builder(&self.f[1]);
        l.arg(&routing.experts).arg(&n_i).arg(&e_i).arg(&mut ranks);
        // SAFETY: moe_chunk_counts(const int* experts, int n_assign, int E, int* counts),
        // one block of CHUNK threads per chunk, E ints of shared memory; counts holds
        // chunks · E.
        unsafe { l.launch(cfg(chunks, CHUNK as u32, 4 * experts))? };
        let mut l = gpu.stream.launch_builder(&self.f[2]);
        l.arg(&mut ranks)
            .arg(&c_i)
            .arg(&e_i)
            .arg(&cap)
            .arg(&mut offsets);
        // SAFETY: moe_plan_offsets(int* counts, int n_chunks, int E, int capacity,
        // int* offsets), one block of 1024 threads with 1024 ints of shared memory; E ≤ 1024,
        // offsets holds E + 1.
        unsafe { l.launch(cfg(1, OFFSET_THREADS, 4 * OFFSET_THREADS as usize))? };
        let mut l = gpu.stream.launch_builder(&self.f[3]);
        l.arg(&routing.experts)
            .arg(&n_i)
            .arg(&e_i)
            .arg(&cap)
            .arg(&ranks)
            .arg(&offsets)
            .arg(&mut row_of)
            .arg(&mut rows);
        // SAFETY: moe_scatter(const int* experts, int n_assign, int E, int capacity,
        // const int* ranks, const int* offsets, int* row_of, int* rows), one block of CHUNK
        // threads per chunk, 32 · E ints of shared memory (32 KB at E = 256); rows and row_of
        // hold n; each kept assignment writes one distinct row below offsets[E] ≤ n.
        unsafe { l.launch(cfg(chunks, CHUNK as u32, 4 * 32 * experts))? };
        // `ranks` is dropped on return: cudarc frees it in stream order (cuMemFreeAsync on the
        // stream), after the kernels above that read it.
        Ok(DevicePlan {
            experts,
            top_k: routing.top_k,
            offsets,
            rows,
            row_of,
        })
    }

    /// `moe_dispatch`: the tokens' rows of `x` `[T, H]` (bf16) gathered into expert order in
    /// `xd` (`[plan.max_rows(), H]`, the first `offsets[E]` rows written). [`moe_dispatch`]
    /// allocates `xd`.
    ///
    /// # Errors
    /// [`GpuError::Config`] for an H that is not a multiple of 8 or lengths that do not fit;
    /// driver errors.
    #[doc(alias = "moe_dispatch")]
    pub fn dispatch(
        &self,
        gpu: &Gpu,
        x: &CudaSlice<u16>,
        plan: &DevicePlan,
        h: usize,
        xd: &mut CudaSlice<u16>,
    ) -> Result<(), GpuError> {
        let tokens = plan.row_of.len() / plan.top_k.max(1);
        if h == 0 || !h.is_multiple_of(8) {
            return Err(config_error(format!(
                "H = {h} must be a positive multiple of 8"
            )));
        }
        if x.len() < tokens * h || xd.len() < plan.max_rows() * h {
            return Err(config_error(format!(
                "x holds {} and xd {} elements; T·H = {}, rows·H = {}",
                x.len(),
                xd.len(),
                tokens * h,
                plan.max_rows() * h
            )));
        }
        let (h_i, k_i) = (h as i32, plan.top_k as i32);
        let n_rows = plan.offsets.slice(plan.experts..plan.experts + 1);
        let mut l = gpu.stream.launch_builder(&self.f[4]);
        l.arg(x)
            .arg(&plan.rows)
            .arg(&n_rows)
            .arg(&h_i)
            .arg(&k_i)
            .arg(xd);
        let pieces = plan.max_rows() * h / 8;
        // SAFETY: moe_gather(const u16* x, const int* rows, const int* n_rows, int H,
        // int top_k, u16* xd), grid-stride over offsets[E] · H / 8 16-byte pieces: x holds
        // T·H, xd max_rows·H ≥ offsets[E]·H, every rows[r] < T·top_k; H a multiple of 8.
        unsafe { l.launch(cfg(pieces.div_ceil(256).min(8192), 256, 0))? };
        Ok(())
    }

    /// `moe_combine`: out `[T, H]` (bf16) = Σ over each token's kept slots of its gate weight
    /// times its row of `yd` (`[plan.max_rows(), H]`, the experts' outputs in the plan's
    /// order), summed in float32 in slot order and rounded once. [`moe_combine`] allocates
    /// `out`.
    ///
    /// # Errors
    /// [`GpuError::Config`] for an odd H or lengths that do not fit; driver errors.
    #[doc(alias = "moe_combine")]
    pub fn combine(
        &self,
        gpu: &Gpu,
        yd: &CudaSlice<u16>,
        plan: &DevicePlan,
        routing: &DeviceRouting,
        h: usize,
        out: &mut CudaSlice<u16>,
    ) -> Result<(), GpuError> {
        let tokens = routing.tokens;
        if h == 0 || !h.is_multiple_of(2) {
            return Err(config_error(format!("H = {h} must be positive and even")));
        }
        if out.len() < tokens * h || yd.len() < plan.max_rows() * h {
            return Err(config_error(format!(
                "out holds {} and yd {} elements; T·H = {}, rows·H = {}",
                out.len(),
                yd.len(),
                tokens * h,
                plan.max_rows() * h
            )));
        }
        if tokens == 0 {
            return Ok(());
        }
        let (t_i, k_i, h_i) = (tokens as i32, routing.top_k as i32, h as i32);
        let mut l = gpu.stream.launch_builder(&self.f[5]);
        l.arg(yd)
            .arg(&plan.row_of)
            .arg(&routing.weights)
            .arg(&t_i)
            .arg(&k_i)
            .arg(&h_i)
            .arg(out);
        let pairs = tokens * h / 2;
        // SAFETY: moe_combine(const u16* yd, const int* row_of, const float* weights, int T,
        // int top_k, int H, u16* out), grid-stride over T·H/2 column pairs: out holds T·H,
        // row_of and weights T·top_k, every kept row_of < offsets[E] ≤ yd's rows.
        unsafe { l.launch(cfg(pairs.div_ceil(256).min(8192), 256, 0))? };
        Ok(())
    }

    /// The SwiGLU activation between the experts' two grouped GEMMs: `gu` `[rows, 2F]` (bf16,
    /// each row the gate projection then the up projection) to `act` `[rows, F]` = silu(gate) ·
    /// up, in float32, rounded once; the plan's `offsets[E]` rows (read on the device).
    ///
    /// # Errors
    /// [`GpuError::Config`] for an odd F or lengths under the plan's rows; driver errors.
    pub fn swiglu(
        &self,
        gpu: &Gpu,
        gu: &CudaSlice<u16>,
        plan: &DevicePlan,
        f: usize,
        act: &mut CudaSlice<u16>,
    ) -> Result<(), GpuError> {
        let rows = plan.max_rows();
        let (f_i, rows_i) =
            swiglu_shape(f, rows, &[("gu", gu.len(), 2 * f), ("act", act.len(), f)])?;
        let n_rows = plan.offsets.slice(plan.experts..plan.experts + 1);
        let mut l = gpu.stream.launch_builder(&self.f[6]);
        l.arg(gu).arg(&n_rows).arg(&rows_i).arg(&f_i).arg(act);
        let pairs = rows * f / 2;
        // SAFETY: moe_swiglu(const u16* gu, const int* n_rows, int max_rows, int F, u16* act),
        // grid-stride over min(offsets[E], max_rows) · F / 2 column pairs (the kernel clamps):
        // gu holds max_rows·2F and act max_rows·F (checked); F even.
        unsafe { l.launch(cfg(pairs.div_ceil(256).min(8192), 256, 0))? };
        Ok(())
    }

    /// bf16 `x` to float32 `y` (the router's logits for [`MoeDispatch::route`]), `n` elements.
    ///
    /// # Errors
    /// [`GpuError::Config`] for buffers under `n`; driver errors.
    pub fn to_f32(
        &self,
        gpu: &Gpu,
        x: &CudaSlice<u16>,
        n: usize,
        y: &mut CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        if x.len() < n || y.len() < n {
            return Err(config_error(format!(
                "x holds {} and y {} elements, {n} to convert",
                x.len(),
                y.len()
            )));
        }
        if n == 0 {
            return Ok(());
        }
        let n_i = n as i64;
        let mut l = gpu.stream.launch_builder(&self.f[7]);
        l.arg(x).arg(&n_i).arg(y);
        // SAFETY: moe_bf16_to_f32(const u16* x, long long n, float* y), grid-stride over n:
        // both hold at least n (checked).
        unsafe { l.launch(cfg(n.div_ceil(256).min(8192), 256, 0))? };
        Ok(())
    }
}

/// What the backward of the combine returns ([`MoeDispatch::combine_backward`]).
pub struct CombineGrads {
    /// The experts' outputs' gradient `[plan.max_rows(), H]` (bf16): each kept row is its gate
    /// weight times its token's row of dy; rows past `offsets[E]` are not written.
    pub dyd: CudaSlice<u16>,
    /// The gate weights' gradient `[T, top_k]` (float32): dy\[t\] · yd\[row\], 0 for a dropped
    /// assignment.
    pub dweights: CudaSlice<f32>,
}

impl MoeDispatch {
    /// Backward of [`MoeDispatch::combine`] for out's gradient `dy` `[T, H]` (bf16), through the
    /// plan's `row_of` (each assignment's row: the permutation's inverse): dyd\[row_of\[a\]\] =
    /// weights\[a\] · dy\[a / top_k\] (rounded once) and dweights\[a\] = Σ_h dy · yd\[row\] in
    /// float32 (`kernels/moe/dispatch.cu`, `moe_combine_backward`; float64:
    /// [`super::reference::moe_layer_backward`]).
    ///
    /// # Errors
    /// [`GpuError::Config`] for an odd H or lengths that do not fit; out-of-memory and driver
    /// errors.
    pub fn combine_backward(
        &self,
        gpu: &Gpu,
        dy: &CudaSlice<u16>,
        yd: &CudaSlice<u16>,
        plan: &DevicePlan,
        routing: &DeviceRouting,
        h: usize,
    ) -> Result<CombineGrads, GpuError> {
        let (tokens, top_k) = (routing.tokens, routing.top_k);
        if h == 0 || !h.is_multiple_of(2) {
            return Err(config_error(format!("H = {h} must be positive and even")));
        }
        let rows = plan.max_rows();
        if dy.len() < tokens * h || yd.len() < rows * h {
            return Err(config_error(format!(
                "dy holds {} and yd {} elements; T·H = {}, rows·H = {}",
                dy.len(),
                yd.len(),
                tokens * h,
                rows * h
            )));
        }
        let n = tokens * top_k;
        // SAFETY: moe_combine_backward writes every dweights (n of them) and every kept row of
        // dyd; rows past offsets[E] are read by no later step except as grouped-GEMM rows that
        // belong to no group (never stored, and zeroed in shared memory for dW).
        let mut dyd = unsafe { gpu.stream.alloc::<u16>((rows * h).max(1))? };
        let mut dweights = unsafe { gpu.stream.alloc::<f32>(n.max(1))? };
        if n > 0 {
            let (n_i, k_i, h_i) = (n as i32, top_k as i32, h as i32);
            let mut l = gpu.stream.launch_builder(&self.f[8]);
            l.arg(dy)
                .arg(yd)
                .arg(&plan.row_of)
                .arg(&routing.weights)
                .arg(&n_i)
                .arg(&k_i)
                .arg(&h_i)
                .arg(&mut dyd)
                .arg(&mut dweights);
            // SAFETY: moe_combine_backward(const u16* dy, const u16* yd, const int* row_of,
            // const float* weights, int n_assign, int top_k, int H, u16* dyd, float* dweights),
            // one warp per assignment (8 per block): lengths checked above, every kept row_of
            // below rows.
            unsafe { l.launch(cfg(n.div_ceil(8), 256, 0))? };
        }
        Ok(CombineGrads { dyd, dweights })
    }

    /// Backward of [`MoeDispatch::swiglu`]: `dact` `[rows, F]` and `gu` `[rows, 2F]` (bf16) to
    /// `dgu` `[rows, 2F]`: with s = sigmoid(gate), d gate = dact · up · s · (1 + gate (1 − s)),
    /// d up = dact · gate · s (float32, rounded once); the plan's `offsets[E]` rows.
    ///
    /// # Errors
    /// [`GpuError::Config`] for an odd F or lengths under the plan's rows; driver errors.
    pub fn swiglu_backward(
        &self,
        gpu: &Gpu,
        dact: &CudaSlice<u16>,
        gu: &CudaSlice<u16>,
        plan: &DevicePlan,
        f: usize,
        dgu: &mut CudaSlice<u16>,
    ) -> Result<(), GpuError> {
        let rows = plan.max_rows();
        let (f_i, rows_i) = swiglu_shape(
            f,
            rows,
            &[
                ("gu", gu.len(), 2 * f),
                ("dgu", dgu.len(), 2 * f),
                ("dact", dact.len(), f),
            ],
        )?;
        let n_rows = plan.offsets.slice(plan.experts..plan.experts + 1);
        let mut l = gpu.stream.launch_builder(&self.f[9]);
        l.arg(dact)
            .arg(gu)
            .arg(&n_rows)
            .arg(&rows_i)
            .arg(&f_i)
            .arg(dgu);
        let pairs = rows * f / 2;
        // SAFETY: moe_swiglu_backward(const u16* dact, const u16* gu, const int* n_rows,
        // int max_rows, int F, u16* dgu), grid-stride over min(offsets[E], max_rows) · F / 2
        // column pairs: the buffers hold max_rows rows (checked); F even.
        unsafe { l.launch(cfg(pairs.div_ceil(256).min(8192), 256, 0))? };
        Ok(())
    }

    /// Backward of [`MoeDispatch::dispatch`] (the gather): dx `[T, H]` (bf16) = `base`\[t\]
    /// (when given: the router's share of x's gradient) + Σ over the token's kept slots of
    /// `dxd`\[row_of\[a\]\], in float32, rounded once: the permutation's inverse as a sum.
    ///
    /// # Errors
    /// [`GpuError::Config`] for an odd H or lengths that do not fit; driver errors.
    #[allow(clippy::too_many_arguments)]
    pub fn dispatch_backward(
        &self,
        gpu: &Gpu,
        dxd: &CudaSlice<u16>,
        plan: &DevicePlan,
        routing: &DeviceRouting,
        base: Option<&CudaSlice<u16>>,
        h: usize,
        dx: &mut CudaSlice<u16>,
    ) -> Result<(), GpuError> {
        let tokens = routing.tokens;
        if h == 0 || !h.is_multiple_of(2) {
            return Err(config_error(format!("H = {h} must be positive and even")));
        }
        let base_len = base.map_or(tokens * h, |b| b.len());
        if dx.len() < tokens * h || dxd.len() < plan.max_rows() * h || base_len < tokens * h {
            return Err(config_error(format!(
                "dx holds {}, dxd {} and base {base_len} elements; T·H = {}, rows·H = {}",
                dx.len(),
                dxd.len(),
                tokens * h,
                plan.max_rows() * h
            )));
        }
        if tokens == 0 {
            return Ok(());
        }
        let (t_i, k_i, h_i) = (tokens as i32, routing.top_k as i32, h as i32);
        let pairs = tokens * h / 2;
        let launch = cfg(pairs.div_ceil(256).min(8192), 256, 0);
        let mut l = gpu.stream.launch_builder(&self.f[10]);
        l.arg(dxd).arg(&plan.row_of);
        let null: u64 = 0;
        match base {
            Some(b) => l.arg(b),
            None => l.arg(&null),
        };
        l.arg(&t_i).arg(&k_i).arg(&h_i).arg(dx);
        // SAFETY: moe_gather_backward(const u16* dxd, const int* row_of, const u16* base,
        // int T, int top_k, int H, u16* dx), grid-stride over T·H/2 column pairs: dx and base
        // (or a null pointer, which the kernel does not read) hold T·H, every kept row_of is
        // below dxd's rows (checked lengths).
        unsafe { l.launch(launch)? };
        Ok(())
    }

    /// Backward of [`MoeDispatch::route`]: the router logits' gradient `[T, E]` (bf16, for the
    /// router's GEMM) from the gate weights' gradient `dweights` `[T, top_k]` and the forward's
    /// float32 `logits`. With c = Σ_k w_k · dw_k, a chosen logit gets w_j (dw_j − c) (softmax)
    /// or s_j (1 − s_j)(dw_j − c) / Σ s (sigmoid, s = sigmoid(logit)); the others 0.
    ///
    /// # Errors
    /// [`GpuError::Config`] for lengths that do not fit; out-of-memory and driver errors.
    pub fn route_backward(
        &self,
        gpu: &Gpu,
        dweights: &CudaSlice<f32>,
        routing: &DeviceRouting,
        logits: &CudaSlice<f32>,
        experts: usize,
        gate: Gate,
    ) -> Result<CudaSlice<u16>, GpuError> {
        let (tokens, top_k) = (routing.tokens, routing.top_k);
        if dweights.len() < tokens * top_k || logits.len() < tokens * experts {
            return Err(config_error(format!(
                "dweights hold {} and logits {} values; T·top_k = {}, T·E = {}",
                dweights.len(),
                logits.len(),
                tokens * top_k,
                tokens * experts
            )));
        }
        // SAFETY: moe_route_backward writes all T × E values.
        let mut dlogits = unsafe { gpu.stream.alloc::<u16>((tokens * experts).max(1))? };
        if tokens == 0 {
            return Ok(dlogits);
        }
        let (t_i, e_i, k_i) = (tokens as i32, experts as i32, top_k as i32);
        let sigmoid = i32::from(gate == Gate::Sigmoid);
        let mut l = gpu.stream.launch_builder(&self.f[11]);
        l.arg(dweights)
            .arg(&routing.experts)
            .arg(&routing.weights)
            .arg(logits)
            .arg(&t_i)
            .arg(&e_i)
            .arg(&k_i)
            .arg(&sigmoid)
            .arg(&mut dlogits);
        // SAFETY: moe_route_backward(const float* dweights, const int* experts,
        // const float* weights, const float* logits, int T, int E, int top_k, int sigmoid,
        // u16* dlogits), one warp per token (4 per block): lengths checked above.
        unsafe { l.launch(cfg(tokens.div_ceil(4), 128, 0))? };
        Ok(dlogits)
    }
}

/// Dispatch, the issue's `moe_dispatch`: the rows of `x` `[T, H]` (bf16 bits) that `plan` keeps,
/// gathered into expert order into a new `[plan.max_rows(), H]` buffer (the first `offsets[E]`
/// rows written, the rest zero), by a sort's permutation, not a one-hot product
/// ([`MoeDispatch::dispatch`]). The float64 definition is [`super::reference::dispatch`].
///
/// # Errors
/// As [`MoeDispatch::dispatch`]; an out-of-memory error from the allocation.
pub fn moe_dispatch(
    gpu: &Gpu,
    kernels: &MoeDispatch,
    x: &CudaSlice<u16>,
    plan: &DevicePlan,
    h: usize,
) -> Result<CudaSlice<u16>, GpuError> {
    let mut xd = gpu
        .stream
        .alloc_zeros::<u16>((plan.max_rows() * h).max(1))?;
    kernels.dispatch(gpu, x, plan, h, &mut xd)?;
    Ok(xd)
}

/// Combine, the issue's `moe_combine`: a new `[T, H]` buffer (bf16 bits) holding, for each
/// token, the sum over its kept slots of the gate weight times the expert output `yd`\[row\]
/// (`[plan.max_rows(), H]`, in the plan's order), in float32, rounded once
/// ([`MoeDispatch::combine`]). The float64 definition is [`super::reference::combine`].
///
/// # Errors
/// As [`MoeDispatch::combine`]; an out-of-memory error from the allocation.
pub fn moe_combine(
    gpu: &Gpu,
    kernels: &MoeDispatch,
    yd: &CudaSlice<u16>,
    plan: &DevicePlan,
    routing: &DeviceRouting,
    h: usize,
) -> Result<CudaSlice<u16>, GpuError> {
    let mut out = gpu.stream.alloc_zeros::<u16>((routing.tokens * h).max(1))?;
    kernels.combine(gpu, yd, plan, routing, h, &mut out)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_match_the_kernel_source() {
        let def = |name: &str| -> usize {
            crate::moe::source_define(DISPATCH_SRC, name)
                .unwrap_or_else(|| panic!("{name} not defined"))
        };
        assert_eq!(def("MD_CHUNK"), CHUNK);
        assert_eq!(def("MD_MAX_TOP_K"), MAX_TOP_K);
        assert_eq!(def("MD_LANE_EXPERTS") * 32, MAX_EXPERTS);
        assert_eq!(def("MD_MAX_EXPERTS"), OFFSET_THREADS as usize);
        for f in ENTRY_POINTS {
            assert!(DISPATCH_SRC.contains(&format!("void {f}(")), "{f}");
        }
    }
}
