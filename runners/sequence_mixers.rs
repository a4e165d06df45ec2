//! `sequence_mixers`: measures the sequence mixers' forward passes ([`kernelpages::sequence_mixers`]:
//! SSD, Mamba-2's layer; Mamba's selective scan; Gated DeltaNet's gated delta rule; Based's
//! linear attention with a sliding-window softmax branch) for the project's implementations
//! and, with `--compare torch`, PyTorch's eager formulations (`runners/compare/torch_mixers.py`:
//! Mamba-2's chunked minimal SSD, the selective scan's and the gated delta rule's reference
//! loops over time, Based chunked), with `--compare fla` flash-linear-attention's chunked
//! Triton kernels on a GPU (`runners/compare/fla_mixers.py`: simple GLA for SSD, the gated delta
//! rule, linear attention plus windowed attention for Based; no selective scan), with
//! `--compare jax` JAX's `lax.associative_scan` formulation of SSD and the selective scan
//! (`runners/compare/jax_mixers.py`, on the run's device), with `--compare mamba` mamba_ssm's
//! Triton SSD and CUDA selective scan on a GPU (`runners/compare/mamba_mixers.py`), and writes
//! one suite document. The machinery (processes,
//! order, timing records, progress, document) is `kernelpages::runner`; this file is the grid,
//! the implementations, the dispatch table and the counts.
//!
//! The project's implementations: `cuda` on a CUDA device (bf16 products on tensor cores where
//! a kernel has a tensor-core version for the shape, float32 arithmetic on CUDA cores otherwise;
//! the dispatch table says which: [`kernelpages::sequence_mixers::cuda`],
//! [`kernelpages::sequence_mixers::scan_cuda`], [`kernelpages::sequence_mixers::delta_cuda`],
//! [`kernelpages::sequence_mixers::based_cuda`]) and `cpu` on the CPU (`--device cpu`, SSD and
//! the selective scan: the float32 recurrence over rayon's threads,
//! [`kernelpages::sequence_mixers::cpu`]).
//!
//! ```text
//! sequence_mixers --compare torch,fla --output data/gpu_sequence_mixers.json
//! sequence_mixers --device cpu --compare torch --output data/cpu_sequence_mixers.json
//! sequence_mixers --device cpu --quick
//! ```

use std::path::Path;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::Parser;
use cudarc::driver::{CudaSlice, CudaViewMut, DeviceRepr};

use kernelpages::attention::cpu_flash::read_elements;
use kernelpages::attention::Dtype as Codec;
use kernelpages::gpu::{Gpu, GpuError};
use kernelpages::runner::grid::Params;
use kernelpages::runner::protocol::{CaseFiles, Job, Reply, TensorFile};
use kernelpages::runner::{self, host, own, Alternative, Declared, DeviceChoice, RunnerArgs};
use kernelpages::schema::{Count, DispatchRule, RunKind, Status, Suite, Throughput};
use kernelpages::sequence_mixers::based_backward::{self, BasedBackward};
use kernelpages::sequence_mixers::based_cuda::{self, Based};
use kernelpages::sequence_mixers::case::{
    Mixer, MixerCase, MixerDtype, MixerInputs, MixerPass, Tensor,
};
use kernelpages::sequence_mixers::cuda::{self as ssd_cuda, Dtype as DeviceDtype, Ssd};
use kernelpages::sequence_mixers::delta_backward::DeltaBackward;
use kernelpages::sequence_mixers::delta_cuda::{self, GatedDelta};
use kernelpages::sequence_mixers::scan_cuda::{self, Scan, ScanBackward};
use kernelpages::sequence_mixers::ssd_backward::SsdBackward;
use kernelpages::sequence_mixers::{cpu, files};

/// Measure the sequence mixers on the GPU (or with --device cpu the CPU) and write a suite
/// document.
#[derive(Parser, Debug)]
#[command(
    name = "sequence_mixers",
    version,
    about = "Measure the sequence mixers (SSD, the selective scan, the gated delta rule, Based) on the GPU (data/gpu_sequence_mixers.json) or with --device cpu the CPU (SSD and the selective scan: data/cpu_sequence_mixers.json) and write a suite document"
)]
struct Cli {
    #[command(flatten)]
    run: RunnerArgs,
    /// Mixers: `ssd`, `selective_scan`, `gated_delta`, `based` [default: all four on the GPU,
    /// the first two on the CPU].
    #[arg(long, value_delimiter = ',')]
    mixers: Option<Vec<String>>,
    /// Sequence lengths [default: 1024,4096,16384,65536 on the GPU, 1024,4096 on the CPU; the
    /// shortest with --quick].
    #[arg(long, value_delimiter = ',')]
    seq_lens: Option<Vec<usize>>,
    /// head_dim [default: 64,128 on the GPU, 64 on the CPU]: SSD's P (= its state size N), the
    /// gated delta rule's and Based's K = V; the selective scan runs heads × head_dim channels.
    #[arg(long, value_delimiter = ',')]
    head_dims: Option<Vec<usize>>,
    /// dtypes of X, B, C and Y [default: bf16,fp32 on the GPU, fp32 on the CPU].
    #[arg(long, value_delimiter = ',')]
    dtypes: Option<Vec<String>>,
    /// Passes: `fwd`, `fwd+bwd` [default: both on the GPU, fwd on the CPU]; fwd+bwd cases are
    /// made for every mixer (each has a backward).
    #[arg(long, value_delimiter = ',')]
    passes: Option<Vec<String>>,
    /// Tokens whose outputs are checked against float64 per case (evenly spaced, the last
    /// included).
    #[arg(long, default_value_t = 256)]
    check_tokens: usize,
}

/// The project's CPU implementation.
const CPU_IMPLEMENTATION: &str = "cpu";
/// The project's CUDA implementation.
const GPU_IMPLEMENTATION: &str = "cuda";
/// Batch entries of every case (the issue's grid).
const BATCH: usize = 4;
/// SSD heads of every case.
const HEADS: usize = 8;
/// The selective scan's state per channel: Mamba-1's d_state.
const SCAN_STATE: usize = 16;
/// Based's sliding window: the paper's 64 most recent keys.
const BASED_WINDOW: usize = 64;
/// Sequence lengths of the GPU grid.
const GPU_SEQ_LENS: [usize; 4] = [1024, 4096, 16384, 65536];
/// Sequence lengths of the CPU grid.
const CPU_SEQ_LENS: [usize; 2] = [1024, 4096];
/// SSD head dims of the GPU grid.
const GPU_HEAD_DIMS: [usize; 2] = [64, 128];
/// SSD head dims of the CPU grid.
const CPU_HEAD_DIMS: [usize; 1] = [64];

/// PyTorch's eager implementation (`runners/compare/torch_mixers.py`).
const TORCH_EAGER: &str = "torch_eager";
/// Longest sequence at which PyTorch's loop formulations (the selective scan, the gated delta
/// rule) are timed: about 40 µs of host time per step, 20 timed calls and a CUDA graph per case.
/// At 16,384 steps one such row took 40–60 s of the H200's time on 2026-12-02 (a quarter of a
/// shard's), for a time that grows linearly in seq_len from the 4,096-step row.
const TORCH_LOOP_MAX_SEQ_LEN: usize = 4096;

/// flash-linear-attention's chunked Triton kernels (`runners/compare/fla_mixers.py`).
const FLA_CHUNK: &str = "fla_chunk";

/// JAX's associative-scan formulation of SSD and the selective scan
/// (`runners/compare/jax_mixers.py`).
const JAX_SCAN: &str = "jax_scan";

/// mamba_ssm's kernels: Mamba-2's Triton SSD and Mamba-1's CUDA selective scan
/// (`runners/compare/mamba_mixers.py`).
const MAMBA_SSM: &str = "mamba_ssm";

/// The alternatives `--compare` can add (each module measures on the run's device).
const ALTERNATIVES: [Alternative; 4] = [
    Alternative {
        name: "torch",
        module: "torch_mixers",
        library: "PyTorch",
        implementations: &[TORCH_EAGER],
    },
    Alternative {
        name: "fla",
        module: "fla_mixers",
        library: "flash-linear-attention",
        implementations: &[FLA_CHUNK],
    },
    Alternative {
        name: "jax",
        module: "jax_mixers",
        library: "JAX",
        implementations: &[JAX_SCAN],
    },
    Alternative {
        name: "mamba",
        module: "mamba_mixers",
        library: "mamba_ssm",
        implementations: &[MAMBA_SSM],
    },
];

/// How FLOPs are counted (the document's `flop_rule`).
const FLOP_RULE: &str = "the recurrence's arithmetic, per token and state element: SSD 5 (the decay and input update, 3; the read-out by C, 2), the selective scan 6 (its per-element Δ·A as well; exponentials not counted), the gated delta rule 7 (S·k 2, the update α·S + w·kᵀ 3, the read-out S·q 2), Based's linear branch 4 (v·kᵀ added, S·q) plus, for its window, 4·head_dim per (query, key) pair the window holds (q·k and the weighted sum of v); a chunked kernel does more, the count is the same for every implementation of a case; a forward and backward call (pass fwd+bwd) counts three times its forward (the backward as twice the forward). Throughput also as tokens per second (B·T per call)";

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match &cli.run.run_case {
        Some(job) => runner::child_main(job, |job| {
            if job.implementation == GPU_IMPLEMENTATION {
                measure_gpu(job)
            } else {
                measure_cpu(job)
            }
        }),
        None => run(&cli),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("Error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// The cases of the grid (or the quick grid: the shortest length, the first head_dim).
fn cases(cli: &Cli, quick: bool) -> Result<Vec<Params>> {
    let gpu = cli.run.device == DeviceChoice::Gpu;
    let mixers: Vec<Mixer> = match &cli.mixers {
        Some(names) => names
            .iter()
            .map(|n| {
                Mixer::parse(n).with_context(|| {
                    format!(
                        "--mixers: unknown mixer `{n}` (ssd, selective_scan, gated_delta, based)"
                    )
                })
            })
            .collect::<Result<_>>()?,
        None if gpu => Mixer::ALL.to_vec(),
        None => vec![Mixer::Ssd, Mixer::SelectiveScan],
    };
    let mut seq_lens = cli.seq_lens.clone().unwrap_or_else(|| {
        if gpu {
            GPU_SEQ_LENS.to_vec()
        } else {
            CPU_SEQ_LENS.to_vec()
        }
    });
    let mut head_dims = cli.head_dims.clone().unwrap_or_else(|| {
        if gpu {
            GPU_HEAD_DIMS.to_vec()
        } else {
            CPU_HEAD_DIMS.to_vec()
        }
    });
    if quick {
        seq_lens.truncate(1);
        head_dims.truncate(1);
    }
    let dtypes: Vec<MixerDtype> = match &cli.dtypes {
        Some(names) => names
            .iter()
            .map(|n| match n.as_str() {
                "fp32" => Ok(MixerDtype::Fp32),
                "bf16" => Ok(MixerDtype::Bf16),
                other => {
                    anyhow::bail!("--dtypes: unknown dtype `{other}`; the mixers take fp32, bf16")
                }
            })
            .collect::<Result<_>>()?,
        None if gpu => vec![MixerDtype::Bf16, MixerDtype::Fp32],
        None => vec![MixerDtype::Fp32],
    };
    let passes: Vec<MixerPass> = match &cli.passes {
        Some(names) => names
            .iter()
            .map(|n| match n.as_str() {
                "fwd" => Ok(MixerPass::Fwd),
                "fwd+bwd" => Ok(MixerPass::FwdBwd),
                other => anyhow::bail!("--passes: unknown pass `{other}` (fwd, fwd+bwd)"),
            })
            .collect::<Result<_>>()?,
        None if gpu => vec![MixerPass::Fwd, MixerPass::FwdBwd],
        None => vec![MixerPass::Fwd],
    };
    let mut out = Vec::new();
    // seq_len outermost: `--shard i/n` takes every n-th case, so each shard gets a share of
    // the longest (slowest) cases.
    for &t in &seq_lens {
        for &mixer in &mixers {
            for &dtype in &dtypes {
                for &p in &head_dims {
                    let mut c = match mixer {
                        Mixer::Ssd => MixerCase::ssd(BATCH, t, HEADS, p, p),
                        Mixer::SelectiveScan => MixerCase::scan(BATCH, t, HEADS * p, SCAN_STATE),
                        Mixer::GatedDelta => MixerCase::gated_delta(BATCH, t, HEADS, p),
                        Mixer::Based => MixerCase::based(BATCH, t, HEADS, p, BASED_WINDOW),
                    };
                    c.dtype = dtype;
                    c.validate().map_err(anyhow::Error::msg)?;
                    for &pass in &passes {
                        // A mixer without a backward takes the forward only.
                        if pass == MixerPass::FwdBwd && !mixer.has_backward() {
                            continue;
                        }
                        c.pass = pass;
                        out.push(c.params());
                    }
                }
            }
        }
    }
    Ok(out)
}

/// What the CUDA kernels of case `c` compute in, as a row's note: which products run on tensor
/// cores (bf16 operands, float32 accumulation) and what they round to bf16, or float32
/// arithmetic on CUDA cores. Follows the kernels' own choice: SSD's version 5 (and Based's
/// linear branch on it) where [`ssd_cuda::tensor_core_path`] takes the shape, Based's window
/// version 2 where [`based_cuda::window_tc_shared_bytes`] does, the gated delta rule's version 3
/// where [`delta_cuda::tc_shared_bytes`] does.
fn gpu_arithmetic_note(c: &MixerCase) -> String {
    const SSD_TC: &str = "Δ·x scaled by its decay, the masked decayed C·Bᵀ, the partial sums of the chunk states within each walk of up to 8 chunks, the states entering each walk and each chunk's entering state (the partial sum plus the walk's, decayed) rounded to bf16; float32 accumulation and state passing";
    let dtype = device_dtype(c.dtype);
    match c.mixer {
        Mixer::Ssd if ssd_cuda::tensor_core_path(c.ssd_shape(), dtype).is_some() => {
            format!("bf16 products on tensor cores ({SSD_TC})")
        }
        Mixer::Based => {
            let shape = c.based_shape();
            let linear =
                ssd_cuda::tensor_core_path(based_cuda::linear_shape(shape), dtype).is_some();
            let window = based_cuda::window_tc_shared_bytes(shape, dtype).is_some();
            match (linear, window) {
                (false, false) => "float32 arithmetic".to_string(),
                (l, w) => format!(
                    "bf16 products on tensor cores: {}{}{}",
                    if l { "the linear branch as SSD's (the masked q·kᵀ, the partial sums of the chunk states within each walk and the states entering each walk rounded to bf16)" } else { "" },
                    if l && w { "; " } else { "" },
                    if w { "the window's QKᵀ and PV (the probabilities rounded to bf16; the softmax in float32)" } else { "" },
                ),
            }
        }
        Mixer::GatedDelta if delta_cuda::tensor_core_path(c.delta_shape(), dtype) => {
            "bf16 products on tensor cores (K Kᵀ, W and U~ from the inverted triangular matrix, the state's update, the output's q·kᵀ and read-out; that matrix, βγk and βv, W, U~, U and its decayed copy, the masked decayed q·kᵀ and the states entering each chunk rounded to bf16; float32 accumulation, triangular solve and state carried between chunks)".to_string()
        }
        _ => "float32 arithmetic".to_string(),
    }
}

/// The kernels' element type for a case's dtype.
fn device_dtype(d: MixerDtype) -> DeviceDtype {
    match d {
        MixerDtype::Fp32 => DeviceDtype::F32,
        MixerDtype::Bf16 => DeviceDtype::Bf16,
    }
}

/// The gated delta rule's dispatch on Hopper where this process takes version 10's walks
/// ([`delta_cuda::wgmma_dispatched`]): a sentence for its rule, else nothing.
fn wgmma_walk_rule() -> String {
    if !delta_cuda::wgmma_dispatched() {
        return String::new();
    }
    let walks = delta_cuda::WGMMA_WALKS
        .iter()
        .map(|(columns, stages, d)| {
            format!(
                "at K = V = {d} one warpgroup per {columns} rows of the state, tiles loaded {} chunks ahead",
                stages - 1
            )
        })
        .collect::<Vec<_>>()
        .join(", ");
    let (major, minor) = delta_cuda::WGMMA_CC;
    let opt_in = if delta_cuda::WGMMA_DISPATCHED {
        String::new()
    } else {
        format!(
            " (this run opted in with {}=1; not yet the library's default)",
            delta_cuda::WGMMA_ENV
        )
    };
    format!(
        " On compute capability {major}.{minor}, instead, version 10 where its sizes fit{opt_in}: the solve that also writes the decayed Q Kᵀ, then the state walked on wgmma (bf16 operands from shared memory, float32 accumulation; the state held transposed in the accumulators, the output computed in the walk): {walks}."
    )
}

/// What the entry points run: the CUDA kernels' versions, or the CPU recurrence.
fn dispatch_rules(device: DeviceChoice) -> Vec<DispatchRule> {
    if device == DeviceChoice::Gpu {
        return vec![
            DispatchRule {
                entry_point: "sequence_mixers::cuda::Ssd".into(),
                device: "CUDA, compute capability 8.0 or newer".into(),
                dtype: "fp32, bf16 (X, B, C, Y; Δ, A, D and states fp32)".into(),
                rule: format!(
                    "always (head_dim and state up to {}): SSD in chunks of {} steps. bf16 with head_dim a multiple of 16 and state of 32, both up to 128: version 5, three kernels: blocks walking {} chunks or fewer (as many as keep about {} blocks), each summing its chunks' states on tensor cores (mma.sync m16n8k16, bf16 operands, float32 accumulation) and storing the partial sums and the walk's own state as bf16, the walks' states passed from walk to walk (a float32 running sum per element, 8 elements per thread, the states entering each walk stored as bf16), then each chunk's output on tensor cores (C·Bᵀ masked and decayed, times Δ·x, plus the read-out of its entering state: the partial sum plus the walk's entering state decayed). Otherwise version 1.1, float32 arithmetic on CUDA cores, three kernels (each chunk's final state from zero, the states passed between chunks, each chunk's output from its intra-chunk masked products plus the incoming state's read-out)",
                    ssd_cuda::MAX_DIM,
                    ssd_cuda::CHUNK,
                    ssd_cuda::MAX_WALK,
                    ssd_cuda::WALK_BLOCKS
                ),
                implementation: GPU_IMPLEMENTATION.into(),
            },
            DispatchRule {
                entry_point: "sequence_mixers::ssd_backward::SsdBackward".into(),
                device: "CUDA, compute capability 8.0 or newer".into(),
                dtype: "fp32, bf16 (X, B, C, dy; Δ, A, D, states and gradients fp32)".into(),
                rule: format!(
                    "a forward and backward call: after the forward above, version 1.1 of the backward, float32 arithmetic on CUDA cores (products register-tiled, 4 rows by up to 4 columns per thread) in chunks of {} steps (head_dim and state up to {}, shared memory permitting: both 128 fit), nine launches: the forward's chunk states recomputed and passed on, each chunk's own part of the state's adjoint and those passed from the last chunk back, then per chunk dX (with x·u and dy·x per step), dB and dC per head from the Gram matrix dy·xᵀ, the adjoint and the entering state; dΔ, dA and dD from a suffix sum over the sequence per (head, batch entry); dB and dC summed over the group's heads",
                    ssd_cuda::CHUNK,
                    ssd_cuda::MAX_DIM
                ),
                implementation: GPU_IMPLEMENTATION.into(),
            },
            DispatchRule {
                entry_point: "sequence_mixers::delta_cuda::GatedDelta".into(),
                device: "CUDA, compute capability 8.0 or newer".into(),
                dtype: "fp32, bf16 (q, k, v, o; α, β and states fp32)".into(),
                rule: format!(
                    "always (K and V up to {}): the chunked WY form in chunks of {} steps, three kernels: every chunk's triangular solve at once (W and U~), the V × K state walked from chunk to chunk {} of its rows per block, every chunk's output at once. bf16 with K a multiple of 32 and V of 16: version 3, the products on tensor cores (mma.sync m16n8k16, bf16 operands, float32 accumulation; K Kᵀ, W and U~ from the inverted triangular matrix, U = U~ − W Sᵀ and the state update, the output's products), the inverse by blocks of 16 rows (the diagonal blocks by substitution in float32 registers, the blocks below them by tf32 mma.sync m16n8k8 with float32 accumulation), W, U~, U and the entering states stored as bf16; at K = V = {} two kernels, compiled for that size: the solve also writes each chunk's decayed Q Kᵀ (bf16), and the state walk computes the output itself, by warps that each hold {} whole rows (all K columns in the mma accumulators, no exchange between warps within a chunk), {} rows per block, tiles loaded {} chunks ahead, with no entering states or U stored; at K = V = {} the three kernels compiled for that size, the state walked by one warp per block holding {} whole rows, tiles loaded {} chunks ahead; else {} rows per block, its tiles loaded {} chunks ahead, where V is a multiple of 32 above 64, otherwise {} rows and {} chunk ahead.{} Otherwise version 2, float32 arithmetic on CUDA cores",
                    delta_cuda::MAX_DIM,
                    delta_cuda::CHUNK,
                    delta_cuda::ROWS,
                    delta_cuda::FUSED_WALKS[0].2,
                    delta_cuda::TC_ROWS,
                    delta_cuda::TC_ROWS * delta_cuda::FUSED_WALKS[0].0,
                    delta_cuda::FUSED_WALKS[0].1 - 1,
                    delta_cuda::WHOLE_ROW_WALKS[0].2,
                    delta_cuda::TC_ROWS * delta_cuda::WHOLE_ROW_WALKS[0].0,
                    delta_cuda::WHOLE_ROW_WALKS[0].1 - 1,
                    delta_cuda::TC_ROWS * delta_cuda::TC_STATE_WALKS[1].0,
                    delta_cuda::TC_STATE_WALKS[1].1 - 1,
                    delta_cuda::TC_ROWS * delta_cuda::TC_STATE_WALKS[0].0,
                    delta_cuda::TC_STATE_WALKS[0].1 - 1,
                    wgmma_walk_rule()
                ),
                implementation: GPU_IMPLEMENTATION.into(),
            },
            DispatchRule {
                entry_point: "sequence_mixers::delta_backward::DeltaBackward".into(),
                device: "CUDA, compute capability 8.0 or newer".into(),
                dtype: "fp32, bf16 (q, k, v, dy; α, β, states and gradients fp32)".into(),
                rule: format!(
                    "a forward and backward call: after the forward above, version 1.1 of the backward, float32 arithmetic on CUDA cores whatever the forward's path, chunks of {} steps, six launches: the forward's version-2 preparation and state pass again (U, the log decays and the state entering each chunk), each chunk's unit upper-triangular solve for its part of the adjoint's G_t = (dS_t + do_t q_tᵀ) k_t, the state's gradient passed from the last chunk back to the first {} of its rows per block, then per chunk dv and dβ (value rows 16 at a time) and dq, dk and dα (its L × L and L × K products summed over the value rows); dα without dividing by α; no atomics",
                    delta_cuda::CHUNK,
                    delta_cuda::ROWS
                ),
                implementation: GPU_IMPLEMENTATION.into(),
            },
            DispatchRule {
                entry_point: "sequence_mixers::based_cuda::Based".into(),
                device: "CUDA, compute capability 8.0 or newer".into(),
                dtype: "fp32, bf16 (q, k, v, o; states fp32)".into(),
                rule: format!(
                    "always (K and V up to {}, window up to {}): the linear branch as SSD's kernels without decay, chunks of {} steps in parallel (each chunk's kᵀv summed, the states passed on, each chunk's output from its masked products plus the incoming state), then the window branch in tiles of {} query rows, exact softmax over each query's last W keys. bf16: the linear branch on SSD's tensor-core kernels where they take the shape (K a multiple of 32, V of 16, both up to 128), the window branch (K and V multiples of 16) as version 2, QKᵀ and PV on tensor cores with an online softmax in float32, 4 warps per tile. Otherwise version 1.2, float32 arithmetic on CUDA cores with the keys in shared memory",
                    based_cuda::MAX_DIM,
                    based_cuda::MAX_WINDOW,
                    based_cuda::CHUNK,
                    based_cuda::TILE
                ),
                implementation: GPU_IMPLEMENTATION.into(),
            },
            DispatchRule {
                entry_point: "sequence_mixers::based_backward::BasedBackward".into(),
                device: "CUDA, compute capability 8.0 or newer".into(),
                dtype: "fp32, bf16 (q, k, v, dy; states and gradients fp32)".into(),
                rule: format!(
                    "a forward and backward call: after the forward above, the linear branch's gradients from SSD's backward (version 1.1, float32 on CUDA cores, dt 1, A 0, dy read times the scale; it writes dq, dk, dv and the initial state's gradient), then the window branch's added by two kernels in tiles of {} rows: per query tile the row's log-sum-exp and Σ P·dP recomputed over its window, then dq; per key tile dk and dv over the queries that see it; no atomics. bf16 with K and V multiples of 16: the window's version 2 on tensor cores (mma.sync m16n8k16: QKᵀ, dO Vᵀ, dS K, Pᵀ dO and dSᵀ Q, P and dS rounded to bf16, float32 accumulation and softmax statistics), 4 warps per tile. Otherwise version 1, float32 arithmetic on CUDA cores",
                    based_cuda::TILE
                ),
                implementation: GPU_IMPLEMENTATION.into(),
            },
            DispatchRule {
                entry_point: "sequence_mixers::scan_cuda::Scan".into(),
                device: "CUDA, compute capability 8.0 or newer".into(),
                dtype: "fp32, bf16 (u, B, C, y; Δ, A, D and states fp32)".into(),
                rule: format!(
                    "always (state up to {}): version 2, the sequence in chunks of 64 to 1024 steps (the longest that still gives 2,048 blocks), three launches: every (batch entry, chunk, channel) walks its chunk from a zero state at once; the chunks' maps of the state composed in order; every chunk walked again from the state entering it, writing y. One to 16 threads per channel ({} state entries each in registers), {} threads per block, the steps' inputs staged in shared memory",
                    scan_cuda::MAX_STATE,
                    scan_cuda::STATES_PER_THREAD,
                    scan_cuda::THREADS
                ),
                implementation: GPU_IMPLEMENTATION.into(),
            },
        ];
    }
    vec![DispatchRule {
        entry_point: "sequence_mixers::cpu::forward".into(),
        device: "CPU".into(),
        dtype: "fp32".into(),
        rule: format!(
            "always: the sequential recurrence in float32, one task per (batch entry, head) for SSD and per (batch entry, {} channels) for the selective scan over rayon's threads, the state sums in 8 lanes",
            cpu::SCAN_BLOCK
        ),
        implementation: CPU_IMPLEMENTATION.into(),
    }]
}

/// The document's throughputs: GFLOP/s (the recurrence's count), GB/s, and M tokens/s.
fn throughput_decls() -> Vec<Throughput> {
    vec![
        Throughput {
            key: "gflops".into(),
            unit: "GFLOP/s".into(),
            count: Count::Flops,
            per_second: 1e9,
            ceiling: None,
        },
        Throughput {
            key: "gbps".into(),
            unit: "GB/s".into(),
            count: Count::Bytes,
            per_second: 1e9,
            ceiling: None,
        },
        Throughput {
            key: "mtokens".into(),
            unit: "M tokens/s".into(),
            count: Count::Items,
            per_second: 1e6,
            ceiling: None,
        },
    ]
}

struct Mixers {
    check_tokens: usize,
}

fn case_of(p: &Params) -> Result<MixerCase> {
    MixerCase::from_params(p).map_err(anyhow::Error::msg)
}

impl runner::Suite for Mixers {
    fn suite(&self) -> Suite {
        Suite::SequenceMixers
    }

    /// X, B, C uniform in [−1, 1), Δ in [0.01, 0.2), A in [−4, −0.5), D in [−1, 1)
    /// ([`MixerInputs::random`]), and the float64 reference of the checked tokens.
    fn prepare(&self, p: &Params, seed: u64, dir: &Path) -> Result<CaseFiles> {
        files::write_case(&case_of(p)?, seed, self.check_tokens, dir)
    }

    fn unsupported(&self, p: &Params, implementation: &str) -> Option<String> {
        let c = match case_of(p) {
            Ok(c) => c,
            Err(e) => return Some(format!("{e:#}")),
        };
        if implementation == JAX_SCAN && matches!(c.mixer, Mixer::GatedDelta | Mixer::Based) {
            return Some(
                "the gated delta rule's per-step decay is a matrix (I − β k kᵀ) and Based adds a \
                 softmax window: JAX's associative-scan formulation is measured for SSD and the \
                 selective scan"
                    .into(),
            );
        }
        if implementation == MAMBA_SSM && matches!(c.mixer, Mixer::GatedDelta | Mixer::Based) {
            return Some(format!(
                "mamba_ssm has no {} (its kernels are Mamba-1's selective scan and Mamba-2's SSD)",
                if c.mixer == Mixer::Based {
                    "Based (linear attention with a window)"
                } else {
                    "gated delta rule"
                }
            ));
        }
        // The alternatives' backward (autograd through them) is measured for SSD, Based and
        // the gated delta rule: PyTorch's chunked forms and its loop over the gated delta
        // rule's steps, flash-linear-attention's simple GLA, gated delta rule, linear attention
        // and windowed attention; their selective scans are loops over seq_len (PyTorch) or
        // absent (the library). JAX's associative scan has its vjp for SSD and the selective
        // scan.
        let alternative_backward =
            (matches!(c.mixer, Mixer::Ssd | Mixer::Based | Mixer::GatedDelta)
                && [TORCH_EAGER, FLA_CHUNK].contains(&implementation))
                || (matches!(c.mixer, Mixer::Ssd | Mixer::SelectiveScan)
                    && [JAX_SCAN, MAMBA_SSM].contains(&implementation));
        if c.pass == MixerPass::FwdBwd
            && implementation != GPU_IMPLEMENTATION
            && !alternative_backward
        {
            return Some(format!(
                "fwd+bwd: {implementation} has no backward of the {} measured (PyTorch's and \
                 flash-linear-attention's are measured for SSD, Based and the gated delta \
                 rule, JAX's and mamba_ssm's for SSD and the selective scan)",
                c.mixer.as_str()
            ));
        }
        if implementation == CPU_IMPLEMENTATION
            && matches!(c.mixer, Mixer::GatedDelta | Mixer::Based)
        {
            return Some(format!(
                "{}: the CPU implementation runs SSD and the selective scan",
                c.mixer.as_str()
            ));
        }
        if implementation == TORCH_EAGER
            && matches!(c.mixer, Mixer::SelectiveScan | Mixer::GatedDelta)
            && c.seq_len > TORCH_LOOP_MAX_SEQ_LEN
        {
            return Some(format!(
                "PyTorch's eager {} is a Python loop over time, several kernel launches per \
                 step: at seq_len {} a timed call is seconds and a CUDA graph of it hundreds of \
                 thousands of nodes, so the runner does not time it past seq_len {}",
                c.mixer.as_str(),
                c.seq_len,
                TORCH_LOOP_MAX_SEQ_LEN
            ));
        }
        if implementation == FLA_CHUNK && c.mixer == Mixer::SelectiveScan {
            return Some(
                "flash-linear-attention has no Mamba-1 selective scan (a decay per channel and \
                 state element); on a GPU its SSD-like kernel (simple GLA) is the ssd row"
                    .into(),
            );
        }
        if implementation == CPU_IMPLEMENTATION && c.dtype != MixerDtype::Fp32 {
            return Some(format!(
                "dtype {}: the CPU implementation computes and stores float32 only",
                c.dtype.as_str()
            ));
        }
        None
    }

    fn is_default(&self, _p: &Params, implementation: &str) -> bool {
        implementation == CPU_IMPLEMENTATION || implementation == GPU_IMPLEMENTATION
    }

    fn notes(&self, p: &Params, implementation: &str) -> Vec<String> {
        let Ok(c) = case_of(p) else {
            return Vec::new();
        };
        let mut notes = Vec::new();
        match c.mixer {
            Mixer::SelectiveScan => notes.push(format!(
                "channels = {HEADS} × head_dim, state {SCAN_STATE} per channel (Mamba-1's d_state)"
            )),
            Mixer::GatedDelta => notes.push(
                "q scaled by 1/√K, k L2-normalised per token and head, α in [0.8, 1), β in [0, 1)"
                    .into(),
            ),
            Mixer::Based => notes.push(
                "identity feature map (q and k taken as already mapped), scale 1/√K on both branches' scores, the linear branch unnormalised".into(),
            ),
            Mixer::Ssd => {}
        }
        if implementation == GPU_IMPLEMENTATION {
            notes.push(format!(
                "{}; zero initial state, the final state written",
                gpu_arithmetic_note(&c)
            ));
            if c.mixer == Mixer::SelectiveScan {
                notes.push(format!(
                    "forward (version 2): chunks of {} steps walked at once, the state passed \
                     between them",
                    scan_cuda::forward_chunk(c.scan_shape())
                ));
            }
            if c.pass == MixerPass::FwdBwd && c.mixer == Mixer::Ssd {
                notes.push(format!(
                    "backward (version 1.1): float32 arithmetic on CUDA cores whatever the \
                     forward's path, chunks of {} steps; the forward's chunk states recomputed \
                     (nothing kept by the forward call), the state's adjoint passed from the \
                     last chunk back to the first, then dX, dB and dC per chunk from the two and \
                     dΔ from a suffix sum over the sequence; dB and dC summed over the group's \
                     heads and dA, dD over the batch in a fixed order (no atomics); gradients in \
                     float32",
                    ssd_cuda::CHUNK
                ));
            }
            if c.pass == MixerPass::FwdBwd && c.mixer == Mixer::GatedDelta {
                notes.push(format!(
                    "backward (version 1.1): float32 arithmetic on CUDA cores whatever the \
                     forward's path, chunks of {} steps; the forward's U, log decays and \
                     entering states recomputed (nothing kept by the forward call), the state's \
                     gradient passed from the last chunk back to the first, then dv, dβ, dq, dk \
                     and dα per chunk; no atomics; gradients in float32",
                    delta_cuda::CHUNK
                ));
            }
            if c.pass == MixerPass::FwdBwd && c.mixer == Mixer::Based {
                notes.push(format!(
                    "backward: the linear branch through SSD's backward (version 1.1, float32 on \
                     CUDA cores, chunks of {} steps, dt 1 and A 0, dy times the scale), then \
                     the window's softmax backward added, one block per {} query rows (their \
                     log-sum-exp and Σ P·dP recomputed, then dq) and one per {} keys (dk, dv), \
                     {}; nothing kept by the forward call, no atomics; gradients in float32",
                    ssd_cuda::CHUNK,
                    based_cuda::TILE,
                    based_cuda::TILE,
                    if based_backward::window_backward_tc_shared_bytes(
                        c.based_shape(),
                        device_dtype(c.dtype)
                    )
                    .is_some()
                    {
                        "version 2: its products on tensor cores, P and dS rounded to bf16"
                    } else {
                        "version 1: float32 arithmetic on CUDA cores"
                    }
                ));
            }
            if c.pass == MixerPass::FwdBwd && c.mixer == Mixer::SelectiveScan {
                notes.push(format!(
                    "backward (version 2): chunks of {} steps walked at once, the forward's \
                     states entering each chunk recomputed (nothing kept by the forward call), \
                     each chunk's adjoint passed back to the chunk before; dB and dC summed \
                     over every channel in shared memory by one block per chunk (no atomics); \
                     gradients in float32",
                    scan_cuda::backward_chunk(c.state).unwrap_or(0)
                ));
            }
        }
        if implementation == CPU_IMPLEMENTATION {
            notes.push("float32 arithmetic; zero initial state".into());
        }
        notes
    }

    fn label(&self, p: &Params) -> String {
        case_of(p).map_or_else(|_| format!("{p:?}"), |c| c.label())
    }
}

fn run(cli: &Cli) -> Result<ExitCode> {
    let own = match cli.run.device {
        DeviceChoice::Gpu => GPU_IMPLEMENTATION,
        DeviceChoice::Cpu => CPU_IMPLEMENTATION,
    };
    let imps = runner::implementations(&[(own, "kernelpages")], &ALTERNATIVES, &cli.run.compare)?;
    let cases = cli.run.select(cases(cli, false)?, cases(cli, true)?)?;
    let declared = Declared {
        runner: "sequence_mixers",
        flop_rule: Some(FLOP_RULE.into()),
        dispatch: dispatch_rules(cli.run.device),
        axes: vec!["seq_len".into()],
        throughput: throughput_decls(),
        kind: RunKind::Grid,
    };
    let suite = Mixers {
        check_tokens: cli.check_tokens,
    };
    runner::run(&suite, &cli.run, declared, cases, imps, Vec::new())
}

/// `cpu` on one case, as the shared CPU case process drives it.
struct Launch {
    case: MixerCase,
    out: Vec<f32>,
}

impl host::Launcher for Launch {
    type Set = MixerInputs;
    fn load(&self, inputs: &[TensorFile]) -> Result<MixerInputs> {
        let specs = self.case.input_specs();
        anyhow::ensure!(
            inputs.len() == specs.len(),
            "{} inputs, expected {}",
            inputs.len(),
            specs.len()
        );
        let mut tensors = Vec::with_capacity(specs.len());
        for (t, (name, _, shape)) in inputs.iter().zip(specs) {
            anyhow::ensure!(
                t.dtype == "fp32" && t.name == name,
                "input {} ({}), expected {name} (fp32)",
                t.name,
                t.dtype
            );
            tensors.push(Tensor {
                name,
                values: read_elements::<f32>(&t.path)?,
                dtype: MixerDtype::Fp32,
                shape,
            });
        }
        Ok(MixerInputs {
            tensors,
            scale: 1.0,
        })
    }
    fn replicate(&self, set: &MixerInputs) -> MixerInputs {
        set.clone()
    }
    fn poison(&mut self) {
        self.out.fill(f32::NAN);
    }
    fn call(&mut self, set: &MixerInputs) -> Result<()> {
        cpu::forward(&self.case, set, &mut self.out).map_err(anyhow::Error::msg)
    }
    fn value(&self, i: usize) -> f64 {
        self.out[i] as f64
    }
    fn output_len(&self) -> usize {
        self.out.len()
    }
    fn temporary_bytes(&self) -> u64 {
        cpu::temporary_bytes(&self.case)
    }
}

/// The case process for `cpu`.
fn measure_cpu(job: &Job) -> Reply {
    if job.implementation != CPU_IMPLEMENTATION {
        return Reply::failed(
            job,
            Status::Error,
            format!("unknown implementation `{}`", job.implementation),
        );
    }
    let case = match case_of(&job.case) {
        Ok(c) => c,
        Err(e) => return Reply::failed(job, Status::Error, format!("{e:#}")),
    };
    let len = case.batch * case.seq_len * case.width();
    host::measure(job, || {
        Ok(Launch {
            case,
            out: vec![0.0; len],
        })
    })
}

/// One input on the device: a sequence input in the case's element type, or a float32 one.
enum Dev {
    F32(CudaSlice<f32>),
    Bf16(CudaSlice<u16>),
}

impl Dev {
    fn f32(&self) -> Result<&CudaSlice<f32>, GpuError> {
        match self {
            Dev::F32(v) => Ok(v),
            Dev::Bf16(_) => Err(GpuError::Config(
                "a bf16 input where float32 was expected".into(),
            )),
        }
    }
    fn bf16(&self) -> Result<&CudaSlice<u16>, GpuError> {
        match self {
            Dev::Bf16(v) => Ok(v),
            Dev::F32(_) => Err(GpuError::Config(
                "a float32 input where bf16 was expected".into(),
            )),
        }
    }
}

/// One input set on the device, in the protocol's order.
struct DeviceSet {
    tensors: Vec<Dev>,
}

/// The mixer's compiled kernels.
enum Kernels {
    Ssd(Ssd),
    Scan(Scan),
    /// The selective scan's forward, then its backward (a fwd+bwd case), and the buffer the
    /// backward writes the initial state's gradient to (not an output of the case).
    ScanBwd(Box<(Scan, ScanBackward, CudaSlice<f32>)>),
    /// SSD's forward, then its backward (a fwd+bwd case), and the buffer the backward writes
    /// the initial state's gradient to (not an output of the case).
    SsdBwd(Box<(Ssd, SsdBackward, CudaSlice<f32>)>),
    Delta(Box<GatedDelta>),
    /// The gated delta rule's forward, then its backward (a fwd+bwd case), and the buffer the
    /// backward writes the initial state's gradient to (not an output of the case).
    DeltaBwd(Box<(GatedDelta, DeltaBackward, CudaSlice<f32>)>),
    Based(Box<Based>),
    /// Based's forward, then its backward (a fwd+bwd case), and the buffer the backward writes
    /// the initial linear state's gradient to (not an output of the case).
    BasedBwd(Box<(Based, BasedBackward, CudaSlice<f32>)>),
}

/// `cuda` on one case: the kernels write the output straight into the runner's buffer (its
/// words viewed as the case's element type) and the final state into the launcher's.
struct GpuLaunch {
    kernels: Kernels,
    case: MixerCase,
    /// Based's factor on q·k, from the case's arguments (1 for the others).
    scale: f32,
    final_state: CudaSlice<f32>,
}

/// The runner's gradient buffers (float32 words: the N gradients of a backward's inputs, six
/// for SSD and the scan, five for the gated delta rule, three for Based) as float32 views.
///
/// # Errors
/// [`GpuError::Config`] for other than N buffers, or one of an odd number of words.
fn gradient_views<const N: usize>(
    grads: &mut [CudaSlice<u16>],
) -> Result<[CudaViewMut<'_, f32>; N], GpuError> {
    let mut views = Vec::with_capacity(grads.len());
    for g in grads.iter_mut() {
        let len = g.len() / 2;
        // SAFETY: `g` holds 2·len 16-bit words, the bytes of `len` floats.
        views.push(
            unsafe { g.transmute_mut::<f32>(len) }
                .ok_or_else(|| GpuError::Config("gradient buffer too short".into()))?,
        );
    }
    views.try_into().map_err(|v: Vec<_>| {
        GpuError::Config(format!("{} gradient buffers, expected {N}", v.len()))
    })
}

/// Launches `k` on the sequence inputs `seq` (X or u, B, C; or q, k, v; then dy for a
/// backward) and the float32 ones `f` (Δ, A, D; or α, β), in the order of
/// [`Mixer::input_names`]; a backward writes its gradients into `grads` (the case's outputs
/// after y, float32 words).
#[allow(clippy::too_many_arguments)]
fn launch_kernels<T: DeviceRepr>(
    k: &mut Kernels,
    gpu: &Gpu,
    seq: &[&CudaSlice<T>],
    f: &[&CudaSlice<f32>],
    scale: f32,
    y: &mut CudaViewMut<'_, T>,
    fs: &mut CudaSlice<f32>,
    grads: &mut [CudaSlice<u16>],
) -> Result<(), GpuError> {
    let want = |s: usize, n: usize| {
        if seq.len() == s && f.len() == n {
            Ok(())
        } else {
            Err(GpuError::Config(format!(
                "{} sequence and {} float32 inputs, expected {s} and {n}",
                seq.len(),
                f.len()
            )))
        }
    };
    // The selective scan's forward: u, Δ, A, B, C, D; no initial state.
    let mut scan_forward = |k: &mut Scan| {
        k.launch(
            gpu,
            seq[0],
            f[0],
            f[1],
            seq[1],
            seq[2],
            Some(f[2]),
            None,
            y,
            fs,
        )
    };
    // SSD's forward: X, Δ, A, B, C, D; no initial state.
    let ssd_forward = |k: &mut Ssd, y: &mut CudaViewMut<'_, T>, fs: &mut CudaSlice<f32>| {
        k.launch(
            gpu,
            seq[0],
            f[0],
            f[1],
            seq[1],
            seq[2],
            Some(f[2]),
            None,
            y,
            fs,
        )
    };
    match k {
        Kernels::Ssd(k) => {
            want(3, 3)?;
            ssd_forward(k, y, fs)
        }
        Kernels::SsdBwd(k) => {
            want(4, 3)?;
            let (fwd, bwd, d_initial) = &mut **k;
            ssd_forward(fwd, y, fs)?;
            bwd.launch_into(
                gpu,
                (seq[0], f[0], f[1], seq[1], seq[2]),
                Some(f[2]),
                None,
                seq[3],
                None,
                &mut gradient_views(grads)?,
                d_initial,
            )
        }
        Kernels::Scan(k) => {
            want(3, 3)?;
            scan_forward(k)
        }
        Kernels::ScanBwd(k) => {
            want(4, 3)?;
            let (fwd, bwd, d_initial) = &mut **k;
            scan_forward(fwd)?;
            let mut views = gradient_views(grads)?;
            bwd.launch_into(
                gpu,
                seq[0],
                f[0],
                f[1],
                seq[1],
                seq[2],
                Some(f[2]),
                None,
                seq[3],
                None,
                &mut views,
                d_initial,
            )
        }
        Kernels::Delta(k) => {
            want(3, 2)?;
            k.launch(gpu, seq[0], seq[1], seq[2], f[0], f[1], None, y, fs)
        }
        Kernels::DeltaBwd(k) => {
            want(4, 2)?;
            let (fwd, bwd, d_initial) = &mut **k;
            fwd.launch(gpu, seq[0], seq[1], seq[2], f[0], f[1], None, y, fs)?;
            bwd.launch_into(
                gpu,
                (seq[0], seq[1], seq[2]),
                (f[0], f[1]),
                None,
                seq[3],
                None,
                &mut gradient_views(grads)?,
                d_initial,
            )
        }
        Kernels::Based(k) => {
            want(3, 0)?;
            k.launch(gpu, seq[0], seq[1], seq[2], scale, None, y, fs)
        }
        Kernels::BasedBwd(k) => {
            want(4, 0)?;
            let (fwd, bwd, d_initial) = &mut **k;
            fwd.launch(gpu, seq[0], seq[1], seq[2], scale, None, y, fs)?;
            bwd.launch_into(
                gpu,
                (seq[0], seq[1], seq[2]),
                scale,
                None,
                seq[3],
                None,
                &mut gradient_views(grads)?,
                d_initial,
            )
        }
    }
}

impl own::Launcher for GpuLaunch {
    type Set = DeviceSet;
    fn upload(&self, gpu: &Gpu, host: &[Vec<u16>]) -> Result<DeviceSet, GpuError> {
        let specs = self.case.input_specs();
        if host.len() != specs.len() {
            return Err(GpuError::Config(format!(
                "{} inputs, expected {}",
                host.len(),
                specs.len()
            )));
        }
        let mut tensors = Vec::with_capacity(specs.len());
        for (words, (_, seq, _)) in host.iter().zip(&specs) {
            tensors.push(if *seq && self.case.dtype == MixerDtype::Bf16 {
                Dev::Bf16(gpu.stream.clone_htod(words)?)
            } else {
                let v: Vec<f32> = Codec::F32
                    .decode_all(words)
                    .into_iter()
                    .map(|x| x as f32)
                    .collect();
                Dev::F32(gpu.stream.clone_htod(&v)?)
            });
        }
        Ok(DeviceSet { tensors })
    }
    fn replicate(&self, gpu: &Gpu, set: &DeviceSet) -> Result<DeviceSet, GpuError> {
        let mut tensors = Vec::with_capacity(set.tensors.len());
        for t in &set.tensors {
            tensors.push(match t {
                Dev::F32(v) => Dev::F32(gpu.stream.clone_dtod(v)?),
                Dev::Bf16(v) => Dev::Bf16(gpu.stream.clone_dtod(v)?),
            });
        }
        Ok(DeviceSet { tensors })
    }
    fn launch(
        &mut self,
        gpu: &Gpu,
        set: &DeviceSet,
        outs: &mut [CudaSlice<u16>],
    ) -> Result<(), GpuError> {
        let (out, grads) = outs
            .split_first_mut()
            .ok_or_else(|| GpuError::Config("no output buffer".into()))?;
        let specs = self.case.input_specs();
        let floats: Vec<&CudaSlice<f32>> = set
            .tensors
            .iter()
            .zip(&specs)
            .filter(|(_, (_, seq, _))| !seq)
            .map(|(t, _)| t.f32())
            .collect::<Result<_, _>>()?;
        let seq_of = specs.iter().map(|(_, seq, _)| *seq);
        let fs = &mut self.final_state;
        match self.case.dtype {
            MixerDtype::Fp32 => {
                let seq: Vec<&CudaSlice<f32>> = set
                    .tensors
                    .iter()
                    .zip(seq_of)
                    .filter(|(_, s)| *s)
                    .map(|(t, _)| t.f32())
                    .collect::<Result<_, _>>()?;
                let len = out.len() / 2;
                // SAFETY: `out` holds 2·len 16-bit words, the bytes of `len` floats.
                let mut y = unsafe { out.transmute_mut::<f32>(len) }
                    .ok_or_else(|| GpuError::Config("output buffer too short".into()))?;
                launch_kernels(
                    &mut self.kernels,
                    gpu,
                    &seq,
                    &floats,
                    self.scale,
                    &mut y,
                    fs,
                    grads,
                )
            }
            MixerDtype::Bf16 => {
                let seq: Vec<&CudaSlice<u16>> = set
                    .tensors
                    .iter()
                    .zip(seq_of)
                    .filter(|(_, s)| *s)
                    .map(|(t, _)| t.bf16())
                    .collect::<Result<_, _>>()?;
                let mut y = out.as_view_mut();
                launch_kernels(
                    &mut self.kernels,
                    gpu,
                    &seq,
                    &floats,
                    self.scale,
                    &mut y,
                    fs,
                    grads,
                )
            }
        }
    }
    fn temporary_bytes(&self) -> u64 {
        let kernels = match &self.kernels {
            Kernels::Ssd(k) => k.temporary_bytes(),
            Kernels::Scan(k) => k.temporary_bytes(),
            Kernels::ScanBwd(k) => {
                k.0.temporary_bytes() + k.1.temporary_bytes() + 4 * k.2.len() as u64
            }
            Kernels::SsdBwd(k) => {
                k.0.temporary_bytes() + k.1.temporary_bytes() + 4 * k.2.len() as u64
            }
            Kernels::Delta(k) => k.temporary_bytes(),
            Kernels::DeltaBwd(k) => {
                k.0.temporary_bytes() + k.1.temporary_bytes() + 4 * k.2.len() as u64
            }
            Kernels::Based(k) => k.temporary_bytes(),
            Kernels::BasedBwd(k) => {
                k.0.temporary_bytes() + k.1.temporary_bytes() + 4 * k.2.len() as u64
            }
        };
        kernels + 4 * self.final_state.len() as u64
    }
    fn residual_bytes(&self) -> Option<u64> {
        // The backward recomputes the forward from the inputs: the forward keeps nothing.
        matches!(
            self.kernels,
            Kernels::ScanBwd(_) | Kernels::SsdBwd(_) | Kernels::BasedBwd(_) | Kernels::DeltaBwd(_)
        )
        .then_some(0)
    }
    fn workspace_bytes(&self) -> u64 {
        0
    }
}

/// The case process for `cuda`; Based's scale comes from the case's arguments (as for the
/// comparison modules).
fn measure_gpu(job: &Job) -> Reply {
    let case = match case_of(&job.case) {
        Ok(c) => c,
        Err(e) => return Reply::failed(job, Status::Error, format!("{e:#}")),
    };
    let scale = match (
        case.mixer,
        job.files.arguments.get("scale").and_then(|v| v.as_f64()),
    ) {
        (Mixer::Based, Some(s)) => s as f32,
        (Mixer::Based, None) => {
            return Reply::failed(job, Status::Error, "the case's arguments lack scale".into())
        }
        _ => 1.0,
    };
    own::measure(job, |gpu| {
        let dtype = device_dtype(case.dtype);
        let kernels = match case.mixer {
            Mixer::Ssd if case.pass == MixerPass::FwdBwd => {
                let d_initial = gpu
                    .stream
                    .alloc_zeros::<f32>((case.batch * case.state_elements()).max(1))?;
                Kernels::SsdBwd(Box::new((
                    Ssd::new(gpu, case.ssd_shape(), dtype)?,
                    SsdBackward::new(gpu, case.ssd_shape(), dtype)?,
                    d_initial,
                )))
            }
            Mixer::Ssd => Kernels::Ssd(Ssd::new(gpu, case.ssd_shape(), dtype)?),
            Mixer::SelectiveScan if case.pass == MixerPass::FwdBwd => {
                let d_initial = gpu
                    .stream
                    .alloc_zeros::<f32>((case.batch * case.state_elements()).max(1))?;
                Kernels::ScanBwd(Box::new((
                    Scan::new(gpu, case.scan_shape(), dtype)?,
                    ScanBackward::new(gpu, case.scan_shape(), dtype)?,
                    d_initial,
                )))
            }
            Mixer::SelectiveScan => Kernels::Scan(Scan::new(gpu, case.scan_shape(), dtype)?),
            Mixer::GatedDelta if case.pass == MixerPass::FwdBwd => {
                let d_initial = gpu
                    .stream
                    .alloc_zeros::<f32>((case.batch * case.state_elements()).max(1))?;
                Kernels::DeltaBwd(Box::new((
                    GatedDelta::new(gpu, case.delta_shape(), dtype)?,
                    DeltaBackward::new(gpu, case.delta_shape(), dtype)?,
                    d_initial,
                )))
            }
            Mixer::GatedDelta => {
                Kernels::Delta(Box::new(GatedDelta::new(gpu, case.delta_shape(), dtype)?))
            }
            Mixer::Based if case.pass == MixerPass::FwdBwd => {
                let d_initial = gpu
                    .stream
                    .alloc_zeros::<f32>((case.batch * case.state_elements()).max(1))?;
                Kernels::BasedBwd(Box::new((
                    Based::new(gpu, case.based_shape(), dtype)?,
                    BasedBackward::new(gpu, case.based_shape(), dtype)?,
                    d_initial,
                )))
            }
            Mixer::Based => Kernels::Based(Box::new(Based::new(gpu, case.based_shape(), dtype)?)),
        };
        let compile_s = match &kernels {
            Kernels::Ssd(k) => k.compile_s,
            Kernels::Scan(k) => k.compile_s,
            // One source (scan.cu) holds both: compiled once.
            Kernels::ScanBwd(k) => k.0.compile_s + k.1.compile_s,
            // Two sources (ssd.cu; ssd.cu with ssd_bwd.cu), each compiled once.
            Kernels::SsdBwd(k) => k.0.compile_s + k.1.compile_s,
            Kernels::Delta(k) => k.compile_s,
            // Two sources (delta.cu; delta.cu with delta_bwd.cu), each compiled once.
            Kernels::DeltaBwd(k) => k.0.compile_s + k.1.compile_s,
            Kernels::Based(k) => k.compile_s,
            // SSD's backward module and the window's backward module besides the forward's.
            Kernels::BasedBwd(k) => k.0.compile_s + k.1.compile_s,
        };
        let final_state = gpu
            .stream
            .alloc_zeros::<f32>((case.batch * case.state_elements()).max(1))?;
        Ok((
            GpuLaunch {
                kernels,
                case,
                scale,
                final_state,
            },
            compile_s,
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_grids_and_their_selection() {
        let gpu = Cli::try_parse_from(["sequence_mixers"]).unwrap();
        // 4 mixers × 2 dtypes × 2 head dims × 4 lengths forward, and every mixer's 2 × 2 × 4
        // forward and backward cases; the longest spread over the shards.
        let all_gpu = cases(&gpu, false).unwrap();
        assert_eq!(all_gpu.len(), 64 + 64);
        assert_eq!(cases(&gpu, true).unwrap().len(), 4 * 2 + 4 * 2);
        let backward: Vec<MixerCase> = all_gpu
            .iter()
            .map(|p| MixerCase::from_params(p).unwrap())
            .filter(|c| c.pass == MixerPass::FwdBwd)
            .collect();
        assert_eq!(backward.len(), 64);
        for mixer in Mixer::ALL {
            assert_eq!(backward.iter().filter(|c| c.mixer == mixer).count(), 16);
        }
        let fwd_only = Cli::try_parse_from(["sequence_mixers", "--passes", "fwd"]).unwrap();
        assert_eq!(cases(&fwd_only, false).unwrap().len(), 64);
        assert!(Cli::try_parse_from(["sequence_mixers", "--passes", "bwd"])
            .map(|c| cases(&c, false).is_err())
            .unwrap());
        let longest = |shard: usize| {
            all_gpu
                .iter()
                .enumerate()
                .filter(|(i, p)| {
                    i % 3 == shard && MixerCase::from_params(p).unwrap().seq_len == 65536
                })
                .count()
        };
        assert!(
            (0..3).all(|s| longest(s) >= 5),
            "{:?}",
            (0..3).map(longest).collect::<Vec<_>>()
        );
        let cpu = Cli::try_parse_from(["sequence_mixers", "--device", "cpu"]).unwrap();
        let all = cases(&cpu, false).unwrap();
        assert_eq!(all.len(), 2 * CPU_SEQ_LENS.len());
        let scan = all
            .iter()
            .map(|p| MixerCase::from_params(p).unwrap())
            .find(|c| c.mixer == Mixer::SelectiveScan)
            .unwrap();
        assert_eq!((scan.channels, scan.state), (HEADS * 64, SCAN_STATE));
        let suite = Mixers { check_tokens: 4 };
        let mut bf = scan;
        bf.dtype = MixerDtype::Bf16;
        use runner::Suite as _;
        assert!(suite
            .unsupported(&bf.params(), CPU_IMPLEMENTATION)
            .unwrap()
            .contains("float32"));
        assert!(suite
            .unsupported(&bf.params(), GPU_IMPLEMENTATION)
            .is_none());
        // The selective scan's backward case runs on the project's CUDA kernels only.
        let mut back = bf;
        back.pass = MixerPass::FwdBwd;
        assert!(suite
            .unsupported(&back.params(), GPU_IMPLEMENTATION)
            .is_none());
        for other in [CPU_IMPLEMENTATION, TORCH_EAGER, FLA_CHUNK] {
            assert!(suite
                .unsupported(&back.params(), other)
                .unwrap()
                .contains("fwd+bwd"));
        }
        // SSD's, Based's and the gated delta rule's backward run for PyTorch and
        // flash-linear-attention too, not on the CPU.
        let mut ssd_back = MixerCase::ssd(4, 1024, 8, 64, 64);
        ssd_back.pass = MixerPass::FwdBwd;
        let mut based_back = MixerCase::based(4, 1024, 8, 64, 64);
        based_back.pass = MixerPass::FwdBwd;
        let mut delta_back = MixerCase::gated_delta(4, 1024, 8, 64);
        delta_back.pass = MixerPass::FwdBwd;
        for back in [ssd_back, based_back, delta_back] {
            for (imp, runs) in [
                (GPU_IMPLEMENTATION, true),
                (TORCH_EAGER, true),
                (FLA_CHUNK, true),
                (CPU_IMPLEMENTATION, false),
            ] {
                assert_eq!(
                    suite.unsupported(&back.params(), imp).is_none(),
                    runs,
                    "{imp} {}",
                    back.label()
                );
            }
        }
        let picked = Cli::try_parse_from([
            "sequence_mixers",
            "--device",
            "cpu",
            "--filter",
            "mixer=ssd,seq_len>=4096",
        ])
        .unwrap();
        let kept = picked
            .run
            .select(
                cases(&picked, false).unwrap(),
                cases(&picked, true).unwrap(),
            )
            .unwrap();
        assert_eq!(kept.len(), 1);
        assert!(Cli::try_parse_from(["sequence_mixers", "--mixers", "gla"])
            .map(|c| cases(&c, false).is_err())
            .unwrap());
        assert_eq!(dispatch_rules(DeviceChoice::Gpu).len(), 7);
        let long = MixerCase::gated_delta(4, 65536, 8, 64);
        assert!(suite
            .unsupported(&long.params(), TORCH_EAGER)
            .unwrap()
            .contains("Python loop"));
        assert!(suite
            .unsupported(&long.params(), GPU_IMPLEMENTATION)
            .is_none());
        let ssd_long = MixerCase::ssd(4, 65536, 8, 64, 64);
        assert!(suite.unsupported(&ssd_long.params(), TORCH_EAGER).is_none());
        assert!(suite.unsupported(&ssd_long.params(), FLA_CHUNK).is_none());
        let scan = MixerCase::scan(4, 1024, 512, 16);
        assert!(suite
            .unsupported(&scan.params(), FLA_CHUNK)
            .unwrap()
            .contains("no Mamba-1 selective scan"));
        // JAX's associative scan: SSD and the scan, fwd and fwd+bwd; not the other two.
        let mut scan_back = MixerCase::scan(4, 1024, 512, 16);
        scan_back.pass = MixerPass::FwdBwd;
        assert!(suite.unsupported(&scan_back.params(), JAX_SCAN).is_none());
        assert!(suite.unsupported(&ssd_back.params(), JAX_SCAN).is_none());
        assert!(suite
            .unsupported(&based_back.params(), JAX_SCAN)
            .unwrap()
            .contains("associative-scan"));
        assert!(suite.unsupported(&ssd_back.params(), MAMBA_SSM).is_none());
        assert!(suite
            .unsupported(&based_back.params(), MAMBA_SSM)
            .unwrap()
            .contains("mamba_ssm has no Based"));
        let based = MixerCase::based(1, 8, 2, 4, 2);
        assert!(suite
            .unsupported(&based.params(), CPU_IMPLEMENTATION)
            .unwrap()
            .contains("CPU implementation runs SSD"));
    }
}
