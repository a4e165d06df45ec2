//! Mamba's selective scan on CUDA: `kernels/sequence_mixers/scan.cu`, compiled by NVRTC at
//! run time. The forward, [`Scan`] (version 2), computes the recurrence of
//! [`super::reference::selective_scan`] (Gu and Dao, 2023, "Mamba: Linear-Time Sequence
//! Modeling with Selective State Spaces", Algorithm 2) on CUDA cores in float32 with the
//! sequence cut into chunks of [`forward_chunk`] steps: (1) every (batch entry, chunk, channel)
//! walks its chunk from a zero state at once, (2) the chunks' affine maps of the state are
//! composed in order (the state entering each chunk), (3) every chunk is walked again from the
//! state entering it and writes y. In (1) and (3), [`threads_per_channel`] threads share a
//! channel's N state entries, [`STATES_PER_THREAD`] each in registers. [`ScanBackward`] is its
//! vector-Jacobian product (version 2: the adjoint in the same chunk form, each chunk's steps
//! walked backwards from the forward's state entering it), states up to
//! [`MAX_BACKWARD_STATE`].

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

/// Threads per block of the forward's chunk walks (`SCAN_THREADS` in the source).
pub const THREADS: u32 = 128;

/// State entries each thread of a chunk walk holds in registers (`SCAN_NS` in the source).
pub const STATES_PER_THREAD: usize = 16;

/// The largest state the forward holds: 16 threads per channel × [`STATES_PER_THREAD`].
pub const MAX_STATE: usize = 256;

/// Threads per block of the pass between chunks (one per batch entry, channel and state entry).
const PASS_THREADS: u32 = 256;

/// The largest grid y and z dimensions (chunks and batch entries per launch).
const MAX_GRID_Y: usize = 65_535;

/// Threads sharing one channel's state in the forward's chunk walks for state size `n`
/// (1 ≤ n ≤ [`MAX_STATE`]): the smallest power of two G with G · [`STATES_PER_THREAD`] ≥ n
/// (1 up to 16 entries, 16 at 256); `None` for 0 or past [`MAX_STATE`].
pub fn threads_per_channel(n: usize) -> Option<usize> {
    if n == 0 || n > MAX_STATE {
        return None;
    }
    Some(n.div_ceil(STATES_PER_THREAD).next_power_of_two())
}

/// Steps whose inputs a chunk walk stages in shared memory at once, for `g` threads per
/// channel: 32, 16 at 8 and 8 at 16, so the staged rows stay within 48 KiB.
pub fn staged_steps(g: usize) -> usize {
    match g {
        0..=4 => 32,
        8 => 16,
        _ => 8,
    }
}

/// Dynamic shared memory of a chunk walk for `g` threads per channel, bytes: u and Δ for the
/// block's channels and the B and C rows (padded to g · [`STATES_PER_THREAD`]), float32, for
/// [`staged_steps`] steps.
pub fn forward_shared_bytes(g: usize) -> u32 {
    let per_block = THREADS as usize / g;
    (staged_steps(g) * (2 * per_block + 2 * g * STATES_PER_THREAD) * 4) as u32
}

/// The forward's chunk length for `shape`: the largest of 64, 128, …, 1024 steps that still
/// gives at least 2,048 chunk-walk blocks (about 2.5 waves of the H200's 132 SMs at six blocks
/// each), 64 when none does; raised (doubling) until the chunks fit the grid's y
/// ([`MAX_GRID_Y`]). Always a multiple of [`staged_steps`].
pub fn forward_chunk(shape: ScanShape) -> usize {
    let g = threads_per_channel(shape.state).unwrap_or(1);
    let channel_blocks = shape.channels.div_ceil(THREADS as usize / g);
    let blocks = |l: usize| channel_blocks * shape.seq_len.div_ceil(l) * shape.batch;
    let mut l = 64;
    while l < 1024 && blocks(2 * l) >= 2048 {
        l *= 2;
    }
    while shape.seq_len.div_ceil(l) > MAX_GRID_Y {
        l *= 2;
    }
    l
}

/// The threads-per-channel variants compiled (`g<G>` in the forward's entry points).
pub const THREADS_PER_CHANNEL: [usize; 5] = [1, 2, 4, 8, 16];

/// The forward's entry points for `dtype` and `g` threads per channel: the chunk end states,
/// then the chunk walk that writes y (the pass between chunks, `scan_chunk_pass`, is the same
/// for every variant).
pub fn forward_entry_points(dtype: Dtype, g: usize) -> [String; 2] {
    [
        format!("scan_chunk_state_{}_g{g}", dtype.tag()),
        format!("scan_chunk_out_{}_g{g}", dtype.tag()),
    ]
}

/// Every entry point of [`SCAN_SRC`]: the forwards, the pass between chunks, the backward's
/// chunk-adjoint walks and pass, then the backwards.
pub fn entry_points() -> Vec<String> {
    let mut v = Vec::new();
    for d in [Dtype::F32, Dtype::Bf16] {
        for g in THREADS_PER_CHANNEL {
            v.extend(forward_entry_points(d, g));
        }
    }
    v.push("scan_chunk_pass".into());
    for d in [Dtype::F32, Dtype::Bf16] {
        for g in BACKWARD_THREADS_PER_CHANNEL {
            v.push(backward_adjoint_entry_point(d, g));
        }
    }
    v.push("scan_bwd_pass".into());
    v.push("scan_bwd_sum".into());
    for d in [Dtype::F32, Dtype::Bf16] {
        for (s, lanes) in BACKWARD_VARIANTS {
            v.push(backward_entry_point(d, s, lanes));
        }
    }
    v
}

/// The largest state the backward holds (32 lanes × 2 entries): its chunk's states and the
/// dB and dC terms are kept in shared memory, which a larger state would outgrow.
pub const MAX_BACKWARD_STATE: usize = 64;

/// The (states per lane, lanes per channel) variants of the backward's last walk
/// (`scan_bwd_<t>_s<S>_l<LN>`): half-warps per channel for states up to 16, whole warps with
/// one or two entries per lane above.
pub const BACKWARD_VARIANTS: [(usize, usize); 3] = [(1, 16), (1, 32), (2, 32)];

/// Lanes per channel in the backward's last walk for state size `n`: 16 up to 16 entries (a
/// warp then takes two channels at once), 32 above.
pub fn backward_lanes_per_channel(n: usize) -> usize {
    if n <= 16 {
        16
    } else {
        32
    }
}

/// Entries of the state each lane of the backward's last walk holds for state size `n`
/// (1 ≤ n ≤ [`MAX_BACKWARD_STATE`]): ⌈n/32⌉ (1 or 2; with 16 lanes per channel at n ≤ 16,
/// still 1); `None` for 0 or past [`MAX_BACKWARD_STATE`].
pub fn states_per_lane(n: usize) -> Option<usize> {
    if n == 0 || n > MAX_BACKWARD_STATE {
        return None;
    }
    Some(n.div_ceil(32))
}

/// Warps per block of the backward's last walk (`SCAN_BWD_WARPS` in the source; each takes one
/// channel at a time, or two at states up to 16).
pub const BACKWARD_WARPS: u32 = 8;

/// The backward's chunk-adjoint walk for `dtype` and `g` threads per channel
/// (`scan_bwd_adjoint_<t>_g<G>`; `g` up to 4, as the backward's states are up to 64).
pub fn backward_adjoint_entry_point(dtype: Dtype, g: usize) -> String {
    format!("scan_bwd_adjoint_{}_g{g}", dtype.tag())
}

/// The threads-per-channel variants of the backward's chunk-adjoint walk.
pub const BACKWARD_THREADS_PER_CHANNEL: [usize; 3] = [1, 2, 4];

/// The backward's last walk for `dtype` with `states_per_lane` entries on each of `lanes`
/// lanes per channel.
pub fn backward_entry_point(dtype: Dtype, states_per_lane: usize, lanes: usize) -> String {
    format!("scan_bwd_{}_s{states_per_lane}_l{lanes}", dtype.tag())
}

/// Steps per chunk of the backward for state size `n` (1 ≤ n ≤ [`MAX_BACKWARD_STATE`]): the
/// largest power of two with chunk · n ≤ 512, at most 64, so that its dynamic shared memory
/// ([`backward_shared_bytes`]) stays within 64 KiB. `None` for 0 or past the maximum.
pub fn backward_chunk(n: usize) -> Option<usize> {
    if n == 0 || n > MAX_BACKWARD_STATE {
        return None;
    }
    let fit = 512 / n;
    Some((1usize << (usize::BITS - 1 - fit.leading_zeros())).min(64))
}

/// Dynamic shared memory of the backward's last walk for state size `n`, bytes: per channel
/// in flight (one or two per warp) the chunk's states h_{t−1}, and per warp its dB and dC
/// terms, `chunk × n` float32 each.
pub fn backward_shared_bytes(n: usize) -> Option<u32> {
    let in_flight = 32 / backward_lanes_per_channel(n) + 2;
    backward_chunk(n).map(|l| (in_flight * BACKWARD_WARPS as usize * l * n * 4) as u32)
}

/// The selective scan's forward (version 2) compiled for one shape and dtype, with its
/// scratch: the chunks' states `[B, chunks, D, N]` and sums of Δ `[B, chunks, D]`, float32.
pub struct Scan {
    shape: ScanShape,
    dtype: Dtype,
    chunk_state_fn: CudaFunction,
    chunk_out_fn: CudaFunction,
    pass_fn: CudaFunction,
    /// Steps per chunk.
    chunk: usize,
    /// Threads per channel in the chunk walks.
    threads_per_channel: usize,
    chunk_state: CudaSlice<f32>,
    chunk_dt: CudaSlice<f32>,
    /// Stands in for D or the initial state when none is given (never read).
    unused: CudaSlice<f32>,
    /// NVRTC compile and module load time, s (0 when this process had compiled the source).
    pub compile_s: f64,
}

impl Scan {
    /// Compiles the kernels for `shape` and `dtype`, with the chunk length
    /// [`forward_chunk`] picks, and allocates the scratch.
    ///
    /// # Errors
    /// As [`Scan::with_chunk`].
    pub fn new(gpu: &Gpu, shape: ScanShape, dtype: Dtype) -> Result<Scan, GpuError> {
        Scan::with_chunk(gpu, shape, dtype, forward_chunk(shape))
    }

    /// [`Scan::new`] with chunks of `chunk` steps (a positive multiple of 32, so of every
    /// [`staged_steps`]): for tests and tuning.
    ///
    /// # Errors
    /// [`GpuError::Config`] for a shape the reference refuses (an empty dimension other than
    /// seq_len), a state past [`MAX_STATE`], more than 65 535 batch entries or chunks (the
    /// grid's z and y), a chunk length that is not a positive multiple of 32, or seq_len or
    /// B · D · N past 32-bit ints; [`GpuError::Compile`] with the NVRTC log; driver errors
    /// (out of memory for the scratch).
    pub fn with_chunk(
        gpu: &Gpu,
        shape: ScanShape,
        dtype: Dtype,
        chunk: usize,
    ) -> Result<Scan, GpuError> {
        let s = shape;
        check_dimensions("selective_scan", s)?;
        let Some(g) = threads_per_channel(s.state) else {
            return Err(GpuError::Config(format!(
                "selective_scan: state {} is more than the {MAX_STATE} the kernel holds in \
                 registers",
                s.state
            )));
        };
        if chunk == 0 || !chunk.is_multiple_of(32) {
            return Err(GpuError::Config(format!(
                "selective_scan: chunk length {chunk} is not a positive multiple of 32"
            )));
        }
        let chunks = s.seq_len.div_ceil(chunk);
        if chunks > MAX_GRID_Y {
            return Err(GpuError::Config(format!(
                "selective_scan: {chunks} chunks of {chunk} steps are more than the grid's \
                 {MAX_GRID_Y}"
            )));
        }
        let fits = |v: usize| v <= i32::MAX as usize;
        let states = s.batch * s.channels * s.state;
        if !(fits(s.seq_len + chunk) && fits(s.channels + THREADS as usize) && fits(states)) {
            return Err(GpuError::Config(format!(
                "selective_scan: {s:?} does not fit 32-bit ints"
            )));
        }
        let compiled = gpu.compile("scan.cu", &source())?;
        let [state_name, out_name] = forward_entry_points(dtype, g);
        let shared = forward_shared_bytes(g);
        let chunk_state_fn = gpu.function(&compiled.module, &state_name, shared)?;
        let chunk_out_fn = gpu.function(&compiled.module, &out_name, shared)?;
        let pass_fn = gpu.function(&compiled.module, "scan_chunk_pass", 0)?;
        let chunk_state = gpu.stream.alloc_zeros::<f32>((states * chunks).max(1))?;
        let chunk_dt = gpu
            .stream
            .alloc_zeros::<f32>((s.batch * s.channels * chunks).max(1))?;
        let unused = gpu.stream.alloc_zeros::<f32>(1)?;
        Ok(Scan {
            shape,
            dtype,
            chunk_state_fn,
            chunk_out_fn,
            pass_fn,
            chunk,
            threads_per_channel: g,
            chunk_state,
            chunk_dt,
            unused,
            compile_s: compiled.compile_s,
        })
    }

    /// Steps per chunk.
    pub fn chunk(&self) -> usize {
        self.chunk
    }

    /// Threads sharing a channel's state in the chunk walks ([`threads_per_channel`]).
    pub fn threads_per_channel(&self) -> usize {
        self.threads_per_channel
    }

    /// Bytes of scratch one call uses beyond its inputs and outputs: the chunks' states and
    /// sums of Δ.
    pub fn temporary_bytes(&self) -> u64 {
        4 * (self.chunk_state.len() + self.chunk_dt.len()) as u64
    }

    /// Launches one selective scan: y `[B, T, D]` and the final state `[B, D, N]` from u
    /// `[B, T, D]`, Δ `[B, T, D]` (after the softplus), A `[D, N]`, B and C `[B, T, N]`, D `[D]`
    /// (optional) and the initial state `[B, D, N]` (optional: zeros), the layouts of
    /// [`super::reference::selective_scan`]. u, B, C and y are of the runner's [`Dtype`]
    /// (`f32`, or `u16` holding bf16 bits); Δ, A, D and the states are float32. Three kernels,
    /// asynchronous on [`Gpu::stream`].
    ///
    /// # Errors
    /// [`GpuError::Config`] for a buffer whose length does not fit the shape or an element
    /// type other than the runner's dtype; driver errors from the launches.
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
        super::cuda::check_element::<T>(self.dtype, "selective_scan")?;
        let bt = s.batch * s.seq_len;
        let state_len = s.batch * s.channels * s.state;
        let mut checks = input_checks(s, u, delta, a, b, c, d, initial_state);
        checks.extend([
            ("y", y.len(), bt * s.channels),
            ("final_state", final_state.len(), state_len),
        ]);
        super::cuda::check_buffers("selective_scan", &s, &checks)?;
        if s.seq_len == 0 {
            return super::cuda::no_step(gpu, initial_state, final_state);
        }
        let g = self.threads_per_channel;
        let walks = ChunkWalks::new(s, self.chunk, g, staged_steps(g));
        let has_d = i32::from(d.is_some());
        let (t_len, channels, n) = (s.seq_len as i32, s.channels as i32, s.state as i32);
        let (l_i, ts_i) = (self.chunk as i32, walks.ts as i32);
        walks.states(
            gpu,
            (&self.chunk_state_fn, &self.pass_fn),
            (u, delta, a, b),
            initial_state,
            &self.unused,
            (&mut self.chunk_state, &mut self.chunk_dt),
            final_state,
        )?;
        let mut k = gpu.stream.launch_builder(&self.chunk_out_fn);
        k.arg(u)
            .arg(delta)
            .arg(a)
            .arg(b)
            .arg(c)
            .arg(d.unwrap_or(&self.unused))
            .arg(&has_d)
            .arg(&mut self.chunk_state)
            .arg(&mut *y)
            .arg(&t_len)
            .arg(&channels)
            .arg(&n)
            .arg(&l_i)
            .arg(&ts_i);
        // SAFETY: scan_chunk_out_<t>_g<G>(const T* u, const float* delta, const float* A,
        // const T* Bm, const T* Cm, const float* D, int has_d, float* chunk_state, T* y,
        // int T_len, int channels, int N, int L, int ts): as the first launch; D is
        // read only when has_d is 1 (then D floats, checked); each block writes y for its
        // chunk's steps and its channels only.
        unsafe { k.launch(walks.walk())? };
        Ok(())
    }
}

/// The chunk walks' launch geometry for one shape: `chunk` steps per chunk, `g` threads per
/// channel, `ts` steps staged at a time (at most [`staged_steps`]`(g)`).
struct ChunkWalks {
    shape: ScanShape,
    chunk: usize,
    g: usize,
    ts: usize,
}

impl ChunkWalks {
    fn new(shape: ScanShape, chunk: usize, g: usize, ts: usize) -> ChunkWalks {
        ChunkWalks {
            shape,
            chunk,
            g,
            ts,
        }
    }

    /// A chunk walk's grid: (channel blocks, chunks, batch entries), with its shared memory.
    fn walk(&self) -> LaunchConfig {
        let s = self.shape;
        LaunchConfig {
            grid_dim: (
                s.channels.div_ceil(THREADS as usize / self.g) as u32,
                s.seq_len.div_ceil(self.chunk) as u32,
                s.batch as u32,
            ),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: forward_shared_bytes(self.g),
        }
    }

    /// A pass's grid: one thread per batch entry, channel and state entry.
    fn pass(&self) -> LaunchConfig {
        let s = self.shape;
        LaunchConfig {
            grid_dim: (
                (s.batch * s.channels * s.state).div_ceil(PASS_THREADS as usize) as u32,
                1,
                1,
            ),
            block_dim: (PASS_THREADS, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// The forward's steps 1 and 2 (`scan_chunk_state_<t>_g<G>`, then `scan_chunk_pass`): into
    /// `scratch` = (chunk states, chunk sums of Δ) the state entering every chunk and each
    /// chunk's sum of Δ, into `last` the final state. `fns` are those two kernels for the
    /// shape's dtype and G; `unused` stands in for an absent initial state. The caller has
    /// checked the inputs' lengths against the shape and that seq_len ≥ 1, and sized the
    /// scratch for ⌈T / chunk⌉ chunks.
    #[allow(clippy::too_many_arguments)]
    fn states<T: DeviceRepr>(
        &self,
        gpu: &Gpu,
        fns: (&CudaFunction, &CudaFunction),
        (u, delta, a, b): (
            &CudaSlice<T>,
            &CudaSlice<f32>,
            &CudaSlice<f32>,
            &CudaSlice<T>,
        ),
        initial_state: Option<&CudaSlice<f32>>,
        unused: &CudaSlice<f32>,
        scratch: (&mut CudaSlice<f32>, &mut CudaSlice<f32>),
        last: &mut CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        let s = self.shape;
        let (chunk_state, chunk_dt) = scratch;
        let (t_len, channels, n) = (s.seq_len as i32, s.channels as i32, s.state as i32);
        let (l, ts) = (self.chunk as i32, self.ts as i32);
        let mut k = gpu.stream.launch_builder(fns.0);
        k.arg(u)
            .arg(delta)
            .arg(a)
            .arg(b)
            .arg(&mut *chunk_state)
            .arg(&mut *chunk_dt)
            .arg(&t_len)
            .arg(&channels)
            .arg(&n)
            .arg(&l)
            .arg(&ts);
        // SAFETY: scan_chunk_state_<t>_g<G>(const T* u, const float* delta, const float* A,
        // const T* Bm, float* chunk_state, float* chunk_dt, int T_len, int channels, int N,
        // int L, int ts): the caller checked the inputs' lengths and element size, T_len ≥ 1,
        // sized the scratch for ⌈T/L⌉ chunks and picked the variant G with G·SCAN_NS ≥ N; ts
        // ≤ staged_steps(G) fits the shared memory of forward_shared_bytes(G); each block
        // writes the rows of its chunk and channels only.
        unsafe { k.launch(self.walk())? };
        self.compose(
            gpu,
            fns.1,
            a,
            initial_state,
            unused,
            chunk_state,
            chunk_dt,
            last,
        )
    }

    /// A pass between chunks (`scan_chunk_pass`, or `scan_bwd_pass` for the backward's
    /// adjoints, the same signature): from `start` (zeros when absent; `unused` stands in),
    /// each entry of `chunks` ([B, chunks, D, N]) replaced by the value entering its chunk,
    /// the value past the last chunk into `last` ([B, D, N]).
    #[allow(clippy::too_many_arguments)]
    fn compose(
        &self,
        gpu: &Gpu,
        f: &CudaFunction,
        a: &CudaSlice<f32>,
        start: Option<&CudaSlice<f32>>,
        unused: &CudaSlice<f32>,
        chunks: &mut CudaSlice<f32>,
        chunk_dt: &CudaSlice<f32>,
        last: &mut CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        let s = self.shape;
        let (channels, n) = (s.channels as i32, s.state as i32);
        let (batch, count) = (s.batch as i32, s.seq_len.div_ceil(self.chunk) as i32);
        let has_start = i32::from(start.is_some());
        let mut k = gpu.stream.launch_builder(f);
        k.arg(a)
            .arg(start.unwrap_or(unused))
            .arg(&has_start)
            .arg(chunks)
            .arg(chunk_dt)
            .arg(last)
            .arg(&batch)
            .arg(&channels)
            .arg(&n)
            .arg(&count);
        // SAFETY: scan_chunk_pass / scan_bwd_pass(const float* A, const float* start,
        // int has_start, float* chunks, const float* chunk_dt, float* last, int batch,
        // int channels, int N, int chunks): one thread per B·D·N entry (the rest of the last
        // block return); the callers sized `chunks` and `chunk_dt` for ⌈T/L⌉ chunks and
        // `last` for B·D·N floats, and checked `start` (B·D·N floats, read only when given).
        unsafe { k.launch(self.pass())? };
        Ok(())
    }
}

/// An error naming `what` for a shape with an empty dimension other than seq_len, or more
/// batch entries than a grid's y or z dimension holds (the batch is the walks' z and the
/// backward's last walk's y).
fn check_dimensions(what: &str, s: ScanShape) -> Result<(), GpuError> {
    if s.batch == 0 || s.channels == 0 || s.state == 0 {
        return Err(GpuError::Config(format!(
            "{what}: empty dimension in {s:?}"
        )));
    }
    if s.batch > MAX_GRID_Y {
        return Err(GpuError::Config(format!(
            "{what}: batch {} is more than the grid's {MAX_GRID_Y}",
            s.batch
        )));
    }
    Ok(())
}

/// (name, length, expected length) of the forward's inputs for shape `s`, as
/// `super::cuda::check_buffers` takes them (an absent D or initial state passes).
#[allow(clippy::too_many_arguments)]
fn input_checks<T>(
    s: ScanShape,
    u: &CudaSlice<T>,
    delta: &CudaSlice<f32>,
    a: &CudaSlice<f32>,
    b: &CudaSlice<T>,
    c: &CudaSlice<T>,
    d: Option<&CudaSlice<f32>>,
    initial_state: Option<&CudaSlice<f32>>,
) -> Vec<(&'static str, usize, usize)> {
    let bt = s.batch * s.seq_len;
    let state_len = s.batch * s.channels * s.state;
    vec![
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
    ]
}

/// Gradients of the selective scan on the device, float32, in the layouts of
/// [`super::gradients::ScanGradients`] (which the backward is checked against).
pub struct ScanGradientBuffers {
    /// ∂L/∂u, `[B, T, D]`.
    pub du: CudaSlice<f32>,
    /// ∂L/∂Δ, `[B, T, D]` (Δ after the softplus).
    pub ddelta: CudaSlice<f32>,
    /// ∂L/∂A, `[D, N]`, summed over batch and time.
    pub da: CudaSlice<f32>,
    /// ∂L/∂B, `[B, T, N]`, summed over the channels.
    pub db: CudaSlice<f32>,
    /// ∂L/∂C, `[B, T, N]`, summed over the channels.
    pub dc: CudaSlice<f32>,
    /// ∂L/∂D, `[D]` (zeros when the forward had no D).
    pub dd: CudaSlice<f32>,
    /// ∂L/∂(initial state), `[B, D, N]`.
    pub d_initial_state: CudaSlice<f32>,
}

impl ScanGradientBuffers {
    /// Zeroed buffers for `shape`.
    ///
    /// # Errors
    /// Driver errors (out of memory).
    pub fn new(gpu: &Gpu, shape: ScanShape) -> Result<ScanGradientBuffers, GpuError> {
        let s = shape;
        let bt = s.batch * s.seq_len;
        // The driver refuses zero-byte allocations: an empty buffer is one unread element.
        let z = |n: usize| gpu.stream.alloc_zeros::<f32>(n.max(1));
        Ok(ScanGradientBuffers {
            du: z(bt * s.channels)?,
            ddelta: z(bt * s.channels)?,
            da: z(s.channels * s.state)?,
            db: z(bt * s.state)?,
            dc: z(bt * s.state)?,
            dd: z(s.channels)?,
            d_initial_state: z(s.batch * s.channels * s.state)?,
        })
    }

    /// Bytes of the seven buffers.
    pub fn bytes(&self) -> u64 {
        [
            &self.du,
            &self.ddelta,
            &self.da,
            &self.db,
            &self.dc,
            &self.dd,
            &self.d_initial_state,
        ]
        .iter()
        .map(|b| 4 * b.len() as u64)
        .sum()
    }
}

/// The selective scan's backward (`kernels/sequence_mixers/scan.cu`), version 2: the adjoint
/// of the recurrence of [`super::reference::selective_scan`] (Gu and Dao, 2023, Mamba's
/// selective scan; the same vector-Jacobian product as
/// [`super::gradients::selective_scan_backward`]), with the sequence cut into chunks of
/// [`backward_chunk`] steps walked at once. Seven launches: the forward's chunk end states and
/// pass give the state entering every chunk (the checkpoints; the forward is recomputed, not
/// kept); every chunk walks its adjoint backwards from zero; a pass from the last chunk gives
/// the adjoint reaching each chunk's last state (and the initial state's gradient); then one
/// block of 8 warps per (chunk, batch entry), its warps taking the channels in turn (two at
/// once, one per half-warp, when the state has at most 16 entries), recomputes
/// each channel's chunk states into shared memory and walks its steps backwards, writing du
/// and dΔ; dB and dC, shared by the channels, are summed over all channels in shared memory
/// and written by the chunk's block alone (no atomics), and the parts of dA and dD of each
/// (batch entry, chunk, channel) are added by two last reductions. States up to
/// [`MAX_BACKWARD_STATE`] entries; at most 65 535 chunks (the walks' grid y).
pub struct ScanBackward {
    shape: ScanShape,
    dtype: Dtype,
    chunk_state_fn: CudaFunction,
    pass_fn: CudaFunction,
    adjoint_fn: CudaFunction,
    adjoint_pass_fn: CudaFunction,
    function: CudaFunction,
    sum_fn: CudaFunction,
    chunk: usize,
    threads_per_channel: usize,
    shared_bytes: u32,
    /// The state entering every chunk, `[B, ⌈T / chunk⌉, D, N]` float32.
    checkpoints: CudaSlice<f32>,
    /// Each chunk's sum of Δ, `[B, ⌈T / chunk⌉, D]`.
    chunk_dt: CudaSlice<f32>,
    /// The adjoint reaching each chunk's last state, `[B, ⌈T / chunk⌉, D, N]`.
    adjoints: CudaSlice<f32>,
    /// Where the forward's pass leaves the final state, `[B, D, N]` (not returned).
    final_state: CudaSlice<f32>,
    /// Stands in for D, the initial state or d_final_state when none is given (never read).
    unused: CudaSlice<f32>,
    /// NVRTC compile and module load time, s (0 when this process had compiled the source).
    pub compile_s: f64,
}

impl ScanBackward {
    /// Compiles the kernels, picks the backward for `shape` and `dtype`, and allocates its
    /// scratch.
    ///
    /// # Errors
    /// [`GpuError::Config`] for an empty dimension other than seq_len, a state past
    /// [`MAX_BACKWARD_STATE`], more than 65 535 batch entries or chunks, or sizes past 32-bit
    /// ints; [`GpuError::Compile`] with the NVRTC log; driver errors (out of memory).
    pub fn new(gpu: &Gpu, shape: ScanShape, dtype: Dtype) -> Result<ScanBackward, GpuError> {
        let s = shape;
        check_dimensions("selective_scan backward", s)?;
        let (Some(chunk), Some(shared_bytes), Some(per_lane), Some(g)) = (
            backward_chunk(s.state),
            backward_shared_bytes(s.state),
            states_per_lane(s.state),
            threads_per_channel(s.state),
        ) else {
            return Err(GpuError::Config(format!(
                "selective_scan backward: state {} is more than the {MAX_BACKWARD_STATE} the \
                 backward keeps in shared memory",
                s.state
            )));
        };
        let chunks = s.seq_len.div_ceil(chunk);
        if chunks > MAX_GRID_Y {
            return Err(GpuError::Config(format!(
                "selective_scan backward: {chunks} chunks of {chunk} steps are more than the \
                 grid's {MAX_GRID_Y}"
            )));
        }
        let fits = |v: usize| v <= i32::MAX as usize;
        let states = s.batch * s.channels * s.state;
        if !(fits(s.seq_len + chunk)
            && fits(s.channels + THREADS as usize)
            && fits(s.seq_len * s.state)
            && fits(states)
            && fits(s.batch * chunks))
        {
            return Err(GpuError::Config(format!(
                "selective_scan backward: {s:?} does not fit 32-bit ints"
            )));
        }
        let compiled = gpu.compile("scan.cu", &source())?;
        let walk_shared = forward_shared_bytes(g);
        let [state_name, _] = forward_entry_points(dtype, g);
        let chunk_state_fn = gpu.function(&compiled.module, &state_name, walk_shared)?;
        let pass_fn = gpu.function(&compiled.module, "scan_chunk_pass", 0)?;
        let adjoint_fn = gpu.function(
            &compiled.module,
            &backward_adjoint_entry_point(dtype, g),
            walk_shared,
        )?;
        let adjoint_pass_fn = gpu.function(&compiled.module, "scan_bwd_pass", 0)?;
        let sum_fn = gpu.function(&compiled.module, "scan_bwd_sum", 0)?;
        let function = gpu.function(
            &compiled.module,
            &backward_entry_point(dtype, per_lane, backward_lanes_per_channel(s.state)),
            shared_bytes,
        )?;
        let alloc = |len: usize| gpu.stream.alloc_zeros::<f32>(len.max(1));
        Ok(ScanBackward {
            shape,
            dtype,
            chunk_state_fn,
            pass_fn,
            adjoint_fn,
            adjoint_pass_fn,
            function,
            sum_fn,
            chunk,
            threads_per_channel: g,
            shared_bytes,
            checkpoints: alloc(states * chunks)?,
            chunk_dt: alloc(s.batch * s.channels * chunks)?,
            adjoints: alloc(states * chunks)?,
            final_state: alloc(states)?,
            unused: alloc(1)?,
            compile_s: compiled.compile_s,
        })
    }

    /// Steps per chunk ([`backward_chunk`]).
    pub fn chunk(&self) -> usize {
        self.chunk
    }

    /// Bytes of scratch one call uses beyond its inputs and outputs: the checkpoints, the
    /// chunks' sums of Δ and adjoints, and the final state the forward's pass leaves.
    pub fn temporary_bytes(&self) -> u64 {
        4 * (self.checkpoints.len()
            + self.chunk_dt.len()
            + self.adjoints.len()
            + self.final_state.len()) as u64
    }

    /// Launches one backward: from the forward's inputs (as [`Scan::launch`] takes them), dy
    /// `[B, T, D]` (the runner's dtype) and d_final_state `[B, D, N]` (float32, optional:
    /// zeros), every gradient into `grads` (float32, each written whole whatever the buffers
    /// held). Seven launches, asynchronous on [`Gpu::stream`].
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
        dy: &CudaSlice<T>,
        d_final_state: Option<&CudaSlice<f32>>,
        grads: &mut ScanGradientBuffers,
    ) -> Result<(), GpuError> {
        let ScanGradientBuffers {
            du,
            ddelta,
            da,
            db,
            dc,
            dd,
            d_initial_state,
        } = grads;
        let mut views = [
            du.as_view_mut(),
            ddelta.as_view_mut(),
            da.as_view_mut(),
            db.as_view_mut(),
            dc.as_view_mut(),
            dd.as_view_mut(),
        ];
        self.launch_into(
            gpu,
            u,
            delta,
            a,
            b,
            c,
            d,
            initial_state,
            dy,
            d_final_state,
            &mut views,
            d_initial_state,
        )
    }

    /// [`ScanBackward::launch`] into views: `grads` are du, dΔ, dA, dB, dC and dD in that order
    /// (float32, the layouts of [`ScanGradientBuffers`]), as a runner's output buffers hold
    /// them.
    ///
    /// # Errors
    /// As [`ScanBackward::launch`].
    #[allow(clippy::too_many_arguments)]
    pub fn launch_into<T: DeviceRepr>(
        &mut self,
        gpu: &Gpu,
        u: &CudaSlice<T>,
        delta: &CudaSlice<f32>,
        a: &CudaSlice<f32>,
        b: &CudaSlice<T>,
        c: &CudaSlice<T>,
        d: Option<&CudaSlice<f32>>,
        initial_state: Option<&CudaSlice<f32>>,
        dy: &CudaSlice<T>,
        d_final_state: Option<&CudaSlice<f32>>,
        grads: &mut [CudaViewMut<'_, f32>; 6],
        d_initial_state: &mut CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        let s = self.shape;
        super::cuda::check_element::<T>(self.dtype, "selective_scan backward")?;
        let bt = s.batch * s.seq_len;
        let state_len = s.batch * s.channels * s.state;
        let [du, ddelta, da, db, dc, dd] = grads;
        let mut checks = input_checks(s, u, delta, a, b, c, d, initial_state);
        checks.extend([
            ("dy", dy.len(), bt * s.channels),
            (
                "d_final_state",
                d_final_state.map_or(state_len, |v| v.len()),
                state_len,
            ),
            ("du", du.len(), bt * s.channels),
            ("ddelta", ddelta.len(), bt * s.channels),
            ("da", da.len(), s.channels * s.state),
            ("db", db.len(), bt * s.state),
            ("dc", dc.len(), bt * s.state),
            ("dd", dd.len(), s.channels),
            ("d_initial_state", d_initial_state.len(), state_len),
        ]);
        super::cuda::check_buffers("selective_scan backward", &s, &checks)?;
        if s.seq_len == 0 {
            gpu.stream.memset_zeros(&mut *da)?;
            gpu.stream.memset_zeros(&mut *db)?;
            gpu.stream.memset_zeros(&mut *dc)?;
            gpu.stream.memset_zeros(&mut *dd)?;
            // No step: the initial state's gradient is d_final_state; the rest are empty or 0.
            return super::cuda::no_step(gpu, d_final_state, d_initial_state);
        }
        let has_d = i32::from(d.is_some());
        let (t_len, channels, n, l) = (
            s.seq_len as i32,
            s.channels as i32,
            s.state as i32,
            self.chunk as i32,
        );
        let g = self.threads_per_channel;
        let chunks = s.seq_len.div_ceil(self.chunk);
        let walks = ChunkWalks::new(s, self.chunk, g, staged_steps(g).min(self.chunk));
        let ts = walks.ts as i32;
        // 1, 2. The states entering every chunk (the checkpoints).
        walks.states(
            gpu,
            (&self.chunk_state_fn, &self.pass_fn),
            (u, delta, a, b),
            initial_state,
            &self.unused,
            (&mut self.checkpoints, &mut self.chunk_dt),
            &mut self.final_state,
        )?;
        // 3. Each chunk's own adjoint, walked backwards from zero.
        let mut k = gpu.stream.launch_builder(&self.adjoint_fn);
        k.arg(dy)
            .arg(delta)
            .arg(a)
            .arg(c)
            .arg(&mut self.adjoints)
            .arg(&t_len)
            .arg(&channels)
            .arg(&n)
            .arg(&l)
            .arg(&ts);
        // SAFETY: scan_bwd_adjoint_<t>_g<G>(const T* dy, const float* delta, const float* A,
        // const T* Cm, float* chunk_adjoint, int T_len, int channels, int N, int L, int ts):
        // the layout, grid and shared memory of ChunkWalks::states' first launch; dy was
        // checked to hold B·T·D elements of the dtype.
        unsafe { k.launch(walks.walk())? };
        // 4. The adjoint reaching each chunk's last state, from d_final_state back.
        walks.compose(
            gpu,
            &self.adjoint_pass_fn,
            a,
            d_final_state,
            &self.unused,
            &mut self.adjoints,
            &self.chunk_dt,
            d_initial_state,
        )?;
        // 5. Every chunk walked backwards from its adjoint: du, dΔ, dB, dC and the parts of
        // dA and dD.
        let cfg = LaunchConfig {
            grid_dim: (chunks as u32, s.batch as u32, 1),
            block_dim: (32 * BACKWARD_WARPS, 1, 1),
            shared_mem_bytes: self.shared_bytes,
        };
        let mut k = gpu.stream.launch_builder(&self.function);
        k.arg(u)
            .arg(delta)
            .arg(a)
            .arg(b)
            .arg(c)
            .arg(d.unwrap_or(&self.unused))
            .arg(&has_d)
            .arg(dy)
            .arg(&self.checkpoints)
            .arg(&mut self.adjoints)
            .arg(&mut self.chunk_dt)
            .arg(&mut *du)
            .arg(&mut *ddelta)
            .arg(&mut *db)
            .arg(&mut *dc)
            .arg(&t_len)
            .arg(&channels)
            .arg(&n)
            .arg(&l);
        // SAFETY: scan_bwd_<t>_s<S>_l<LN>(const T* u, const float* delta, const float* A,
        // const T* Bm, const T* Cm, const float* D, int has_d, const T* dy,
        // const float* checkpoints, float* chunk_adjoint, float* dd_part, float* du,
        // float* ddelta, float* dBm, float* dCm, int T_len, int channels, int N, int L): the
        // lengths and the element size were checked above, T_len ≥ 1, `new` picked LN from
        // backward_lanes_per_channel(N) and S with LN·S ≥ N, L from backward_chunk(N), the scratch for ⌈T/L⌉ chunks (the grid's x,
        // the batch its y) and the shared memory of backward_shared_bytes(N); D is read only
        // when has_d is 1. Each block writes dB and dC for its own chunk's steps only.
        unsafe { k.launch(cfg)? };
        // 6. dA and dD, the sums of their parts over the batch entries and chunks.
        let rows = (s.batch * chunks) as i32;
        let one = 1i32;
        for (part, cols, out, enabled) in [
            (&self.adjoints, s.channels * s.state, &mut *da, &one),
            (&self.chunk_dt, s.channels, &mut *dd, &has_d),
        ] {
            let cols_i = cols as i32;
            let sum = LaunchConfig {
                grid_dim: (cols.div_ceil(32) as u32, 1, 1),
                block_dim: (32 * BACKWARD_WARPS, 1, 1),
                shared_mem_bytes: 32 * BACKWARD_WARPS * 4,
            };
            let mut k = gpu.stream.launch_builder(&self.sum_fn);
            k.arg(part).arg(&rows).arg(&cols_i).arg(out).arg(enabled);
            // SAFETY: scan_bwd_sum(const float* part, int rows, int cols, float* out,
            // int enabled): `part` holds rows·cols floats (the adjoints B·chunks·D·N, the
            // chunks' sums of Δ B·chunks·D), `out` cols (dA D·N, dD D; checked above), the
            // grid ⌈cols/32⌉ blocks with 8·32 floats of shared memory.
            unsafe { k.launch(sum)? };
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threads_per_channel_cover_the_state() {
        assert_eq!(threads_per_channel(0), None);
        assert_eq!(threads_per_channel(1), Some(1));
        assert_eq!(threads_per_channel(16), Some(1));
        assert_eq!(threads_per_channel(17), Some(2));
        assert_eq!(threads_per_channel(33), Some(4));
        assert_eq!(threads_per_channel(64), Some(4));
        assert_eq!(threads_per_channel(65), Some(8));
        assert_eq!(threads_per_channel(128), Some(8));
        assert_eq!(threads_per_channel(129), Some(16));
        assert_eq!(threads_per_channel(256), Some(16));
        assert_eq!(threads_per_channel(257), None);
        for n in 1..=MAX_STATE {
            let g = threads_per_channel(n).unwrap();
            // A power of two dividing the warp (a channel's group is adjacent lanes), covering
            // the state, and not twice as many threads as needed.
            assert!(THREADS_PER_CHANNEL.contains(&g) && 32 % g == 0, "{n}");
            assert!(g * STATES_PER_THREAD >= n && (g == 1 || (g / 2) * STATES_PER_THREAD < n));
            assert!(forward_shared_bytes(g) <= 48 * 1024, "{n}");
            assert_eq!(32 % staged_steps(g), 0, "{n}");
        }
    }

    #[test]
    fn forward_chunks_keep_the_grid_busy_and_fit_it() {
        let shape = |batch, seq_len, channels, state| ScanShape {
            batch,
            seq_len,
            channels,
            state,
        };
        // The grid's B4 D512 N16: 16 blocks per chunk, so 2,048 blocks at 128 steps.
        assert_eq!(forward_chunk(shape(4, 16_384, 512, 16)), 128);
        assert_eq!(forward_chunk(shape(4, 16_384, 1024, 16)), 256);
        assert_eq!(forward_chunk(shape(4, 65_536, 1024, 16)), 1024);
        // Short sequences keep the shortest chunk.
        assert_eq!(forward_chunk(shape(4, 1024, 512, 16)), 64);
        assert_eq!(forward_chunk(shape(1, 1, 1, 1)), 64);
        // Past 65,535 chunks of 1024 steps the chunk doubles until they fit.
        let long = shape(1, 100_000_000, 1, 16);
        let l = forward_chunk(long);
        assert!(
            long.seq_len.div_ceil(l) <= MAX_GRID_Y && long.seq_len.div_ceil(l / 2) > MAX_GRID_Y
        );
        for n in [1, 16, 48, 64, 128, 256] {
            for t in [1, 100, 5000, 70_000] {
                let l = forward_chunk(shape(2, t, 100, n));
                let g = threads_per_channel(n).unwrap();
                assert!(l.is_power_of_two() && l >= 64 && l.is_multiple_of(staged_steps(g)));
            }
        }
    }

    #[test]
    fn entry_points_are_named_once() {
        let e = entry_points();
        assert_eq!(e.len(), 35);
        assert_eq!(e[0], "scan_chunk_state_f32_g1");
        assert_eq!(e[1], "scan_chunk_out_f32_g1");
        assert_eq!(e[19], "scan_chunk_out_bf16_g16");
        assert_eq!(e[20], "scan_chunk_pass");
        assert_eq!(e[21], "scan_bwd_adjoint_f32_g1");
        assert_eq!(e[26], "scan_bwd_adjoint_bf16_g4");
        assert_eq!(e[27], "scan_bwd_pass");
        assert_eq!(e[28], "scan_bwd_sum");
        assert_eq!(e[29], "scan_bwd_f32_s1_l16");
        assert_eq!(e[34], "scan_bwd_bf16_s2_l32");
        for (i, name) in e.iter().enumerate() {
            assert!(!e[..i].contains(name), "{name} twice");
        }
        // Each forward pair is one SCAN_ENTRY(<t>, <type>, <G>) line of the source.
        for d in [Dtype::F32, Dtype::Bf16] {
            let ty = if d == Dtype::F32 { "float" } else { "u16" };
            for g in THREADS_PER_CHANNEL {
                let line = format!("SCAN_ENTRY({}, {ty}, {g})", d.tag());
                assert!(SCAN_SRC.contains(&line), "{line}");
            }
        }
        for d in [Dtype::F32, Dtype::Bf16] {
            let ty = if d == Dtype::F32 { "float" } else { "u16" };
            for g in BACKWARD_THREADS_PER_CHANNEL {
                let line = format!("SCAN_ADJ_ENTRY({}, {ty}, {g})", d.tag());
                assert!(SCAN_SRC.contains(&line), "{line}");
            }
        }
        for stem in [
            "scan_chunk_state_##NAME##_g##G(",
            "scan_chunk_out_##NAME##_g##G(",
            "scan_bwd_adjoint_##NAME##_g##G(",
            "void scan_chunk_pass(",
            "void scan_bwd_pass(",
            "void __launch_bounds__(SCAN_BWD_THREADS)\nscan_bwd_sum(",
        ] {
            assert!(SCAN_SRC.contains(stem), "{stem}");
        }
        assert!(SCAN_SRC.contains(&format!("#define SCAN_THREADS {THREADS}")));
        assert!(SCAN_SRC.contains(&format!("#define SCAN_NS {STATES_PER_THREAD}")));
        for d in [Dtype::F32, Dtype::Bf16] {
            for (s, lanes) in BACKWARD_VARIANTS {
                let ty = if d == Dtype::F32 { "float" } else { "u16" };
                let line = format!("SCAN_BWD_ENTRY({}, {ty}, {s}, {lanes})", d.tag());
                assert!(SCAN_SRC.contains(&line), "{line}");
            }
        }
        assert!(SCAN_SRC.contains(&format!("#define SCAN_BWD_WARPS {BACKWARD_WARPS}")));
    }

    #[test]
    fn backward_chunks_fit_shared_memory() {
        assert_eq!(backward_chunk(0), None);
        assert_eq!(backward_chunk(65), None);
        assert_eq!(backward_chunk(1), Some(64));
        assert_eq!(backward_chunk(16), Some(32));
        assert_eq!(backward_chunk(33), Some(8));
        assert_eq!(backward_chunk(64), Some(8));
        for n in 1..=MAX_BACKWARD_STATE {
            let l = backward_chunk(n).unwrap();
            assert!(
                l.is_power_of_two() && l * n <= 512 && (l == 64 || 2 * l * n > 512),
                "{n}"
            );
            assert!(backward_shared_bytes(n).unwrap() <= 64 * 1024, "{n}");
            let per_lane = states_per_lane(n).unwrap();
            let lanes = backward_lanes_per_channel(n);
            assert!(BACKWARD_VARIANTS.contains(&(per_lane, lanes)), "{n}");
            assert!(per_lane * lanes >= n, "{n}");
            let g = threads_per_channel(n).unwrap();
            assert!(BACKWARD_THREADS_PER_CHANNEL.contains(&g), "{n}");
        }
    }
}
