//! The data contract between runners and `docgen`: one suite document per JSON file in `data/`.
//!
//! Runners serialise a [`Document`]; `docgen` deserialises it and never reads anything else.
//! The JSON Schema written next to the data (`data/schema.json`) is generated from these types
//! with `schemars`, so the types are the single source of truth.
//!
//! Every case is a named parameter map ([`Row::case`]) so that later suites (sequence mixers,
//! kernel sums, MoE, whole models) reuse the same row type with their own parameters.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Version of this schema. Bumped when a field changes meaning or a required field is added.
///
/// Version 2 added the declared figure axes ([`RunConfig::axes`]) and throughput measures
/// ([`RunConfig::throughput`]), the `bytes` and `items` counts of a row, the record of changes
/// made after a run ([`RunConfig::amendments`]), and dropped the stored `tflops` (docgen derives
/// every throughput from its count and the median).
pub const SCHEMA_VERSION: u32 = 2;

/// A row is launch-bound when the host time to enqueue one call ([`Row::host_ms`]) is at least
/// this fraction of the device time of one back-to-back call (the eager median): the timing
/// then measures the host issuing calls, not the kernel. Recorded per document as
/// [`TimingConfig::launch_bound_ratio`].
pub const LAUNCH_BOUND_RATIO: f64 = 0.8;

/// One suite's measurements on one device: what `attention > data/gpu_attention.json` writes.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Document {
    /// Must equal [`SCHEMA_VERSION`].
    #[schemars(range(max = u32::MAX))]
    pub schema_version: u32,
    /// Which suite the rows belong to.
    pub suite: Suite,
    /// The device the rows were measured on.
    pub device: Device,
    /// How the runner was configured and which software it ran.
    pub config: RunConfig,
    /// One row per (case, implementation), including cases that could not run.
    pub rows: Vec<Row>,
}

/// The suites the project measures; each maps to a page of the site.
#[derive(
    Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash,
)]
#[serde(rename_all = "snake_case")]
pub enum Suite {
    /// Softmax attention (flash, math, framework SDPA backends).
    Attention,
    /// Linear-attention style sequence mixers (GLA, DeltaNet, SSD).
    SequenceMixers,
    /// Kernel sums (Gaussian matvec, logsumexp, Sinkhorn).
    KernelSums,
    /// Mixture-of-experts grouped GEMM.
    Moe,
    /// Whole model forward and backward passes.
    Models,
}

impl Suite {
    /// Every suite, in page order.
    pub const ALL: [Suite; 5] = [
        Suite::Attention,
        Suite::SequenceMixers,
        Suite::KernelSums,
        Suite::Moe,
        Suite::Models,
    ];

    /// The snake_case name used in JSON and file names (`attention`, `kernel_sums`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            Suite::Attention => "attention",
            Suite::SequenceMixers => "sequence_mixers",
            Suite::KernelSums => "kernel_sums",
            Suite::Moe => "moe",
            Suite::Models => "models",
        }
    }

    /// Human title of the suite.
    pub fn title(self) -> &'static str {
        match self {
            Suite::Attention => "Attention",
            Suite::SequenceMixers => "Sequence mixers",
            Suite::KernelSums => "Kernel sums",
            Suite::Moe => "Mixture of experts",
            Suite::Models => "Models",
        }
    }
}

/// Whether the rows ran on a GPU or on the host CPU.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum DeviceKind {
    /// A CUDA GPU.
    Gpu,
    /// The host CPU.
    Cpu,
}

/// The device a document was measured on.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Device {
    /// GPU or CPU.
    pub kind: DeviceKind,
    /// Marketing name as the driver reports it, e.g. `NVIDIA H200`, or the CPU model.
    pub name: String,
    /// CUDA compute capability as `major.minor` (GPU only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute_capability: Option<String>,
    /// Number of streaming multiprocessors (GPU only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(max = u32::MAX))]
    pub sm_count: Option<u32>,
    /// Total device memory in MB (10^6 bytes) (GPU only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("exclusiveMinimum" = 0))]
    pub memory_mb: Option<f64>,
    /// L2 cache size in MB (10^6 bytes) (GPU only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("exclusiveMinimum" = 0))]
    pub l2_mb: Option<f64>,
    /// Driver version, e.g. `580.159.04` or the CUDA driver API version `13.0`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub driver_version: Option<String>,
    /// CUDA version the runner was built against and loaded, e.g. `13.0`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cuda_version: Option<String>,
    /// Hardware threads (CPU only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(max = u32::MAX))]
    pub cpu_threads: Option<u32>,
    /// The host's CPU model (`/proc/cpuinfo` `model name`), e.g. `AMD EPYC 9654 96-Core
    /// Processor`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_cpu: Option<String>,
    /// The host's operating system and kernel, e.g. `Ubuntu 24.04.1 LTS, Linux 6.1.0`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub os: Option<String>,
    /// The architecture NVRTC compiled the project's kernels for, e.g. `sm_90a` or `sm_80`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nvrtc_arch: Option<String>,
    /// Enforced power limit at the start of the run, W (NVML).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("exclusiveMinimum" = 0))]
    pub power_limit_w: Option<f64>,
    /// Highest SM clock the device supports, MHz (NVML `max_clock_info(SM)`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("exclusiveMinimum" = 0))]
    pub max_sm_clock_mhz: Option<f64>,
    /// Highest memory clock the device supports, MHz (NVML `max_clock_info(Memory)`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("exclusiveMinimum" = 0))]
    pub max_mem_clock_mhz: Option<f64>,
}

/// How a document was produced: enough to reproduce it.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RunConfig {
    /// Runner binary name, e.g. `attention`.
    pub runner: String,
    /// Runner (crate) version.
    pub runner_version: String,
    /// `git rev-parse HEAD` of the checkout the runner was built from (`unknown` outside git),
    /// with `-dirty` appended when the tree had uncommitted changes.
    pub git_commit: String,
    /// Versions of every library involved, by name (`cudarc`, `cuda`, `cublas`, `nvrtc`,
    /// `torch`, `cudnn`, `jax`, ...). A library that was looked for and not found is absent.
    pub libraries: BTreeMap<String, String>,
    /// Timing parameters shared by every row.
    pub timing: TimingConfig,
    /// The command line that produced the document, argv\[0\] reduced to the binary name.
    pub command: Vec<String>,
    /// Start of the run, RFC 3339 UTC.
    pub started_at: String,
    /// End of the run, RFC 3339 UTC; absent while the run is still writing rows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<String>,
    /// How the runner counts the FLOPs of one call (the suite's rule, in words), e.g.
    /// `4·B·H·T²·D, halved when causal, ×3.5 for forward + backward`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flop_rule: Option<String>,
    /// Which implementation each public entry point picks when none is named.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dispatch: Vec<DispatchRule>,
    /// The case parameters the figures are drawn against, most important first (attention:
    /// `seq_len`; decoding: the cache length; kernel sums: `n`). The first is the x axis of
    /// every figure and the row key of every table; rows that share every other parameter form
    /// one group. Each later axis gets figures of its own, grouped the same way.
    #[schemars(length(min = 1))]
    pub axes: Vec<String>,
    /// The throughput measures the rows carry, each derived by docgen from a per-call count of
    /// the row and its median time (TFLOP/s from `flops`, GB/s from `bytes`, items/s from
    /// `items`). Empty when the suite reports times only.
    #[serde(default)]
    pub throughput: Vec<Throughput>,
    /// The protocol's fixed rules as the runner applied them (its constants), so that the
    /// site describes this document by its own numbers; absent in documents written before
    /// they were recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub protocol: Option<ProtocolConstants>,
    /// Changes made to the document after the runner wrote it, oldest first. A document
    /// edited by hand must say so here.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub amendments: Vec<Amendment>,
    /// What the run measured: the suite's comparison grid (the default, and absent from the
    /// JSON) or a tile sweep. The site keeps one run of each kind per suite and device.
    #[serde(default, skip_serializing_if = "RunKind::is_grid")]
    pub kind: RunKind,
}

/// The case parameter naming a tile sweep row's configuration ([`RunKind::TileSweep`]).
pub const TILE_CONFIG_PARAM: &str = "config";

/// The kind of a run.
#[derive(
    Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord,
)]
#[serde(rename_all = "snake_case")]
pub enum RunKind {
    /// The suite's grid: the project's implementations beside the alternatives, case by case.
    #[default]
    Grid,
    /// One kernel in each configuration tried while tuning it (tile sizes, warps, options),
    /// every case naming its configuration in the case parameter `config` and the
    /// configuration the dispatch picks marked `default`: why the default is what it is.
    TileSweep,
    /// A grid of decoding shapes (a few query rows against a long KV cache), where the
    /// figure of merit is bandwidth: its rows carry `bytes` and the document declares GB/s.
    /// A document of its own beside the suite's grid, drawn like a grid.
    Decode,
    /// The masks grid: generated masks and score modifications (`flex_attention`), each case
    /// naming its modification in the case parameter `mask`, FLOPs counting the pairs the mask
    /// leaves visible. A document of its own beside the suite's grid, drawn like a grid.
    Masks,
}

impl RunKind {
    /// True for [`RunKind::Grid`].
    pub fn is_grid(&self) -> bool {
        *self == RunKind::Grid
    }

    /// The snake_case name used in JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            RunKind::Grid => "grid",
            RunKind::TileSweep => "tile_sweep",
            RunKind::Decode => "decode",
            RunKind::Masks => "masks",
        }
    }
}

/// The fixed rules of the measurement protocol (`src/harness.rs`), recorded per document.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ProtocolConstants {
    /// Fewest samples a row keeps when the time limit stops sampling.
    #[schemars(range(min = 1, max = u32::MAX))]
    pub min_samples: u32,
    /// Most input copies rotated through.
    #[schemars(range(min = 1, max = u32::MAX))]
    pub max_input_sets: u32,
    /// Share of the free device memory the comparison scripts' input copies may take.
    #[schemars(extend("exclusiveMinimum" = 0))]
    pub rotation_memory_fraction: f64,
    /// A case process is killed at `process_limit_factor` × `case_timeout_s` +
    /// `process_limit_margin_s`.
    #[schemars(extend("exclusiveMinimum" = 0))]
    pub process_limit_factor: f64,
    /// See `process_limit_factor`, s.
    #[schemars(range(min = 0))]
    pub process_limit_margin_s: f64,
    /// How often the machine state was sampled while a row was timed, ms.
    #[schemars(extend("exclusiveMinimum" = 0))]
    pub machine_sample_ms: f64,
    /// True when each of the project's kernel sources was compiled to machine code once per
    /// runner process (each shard or `--filter` part its own) and later case processes loaded
    /// that code, their rows reporting the first compile's `compile_s`
    /// ([`crate::gpu::KERNEL_CACHE_ENV`]); false or absent when every case process compiled its
    /// kernels.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub kernels_compiled_once: bool,
}

/// Which per-call count of a row a throughput is computed from.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[serde(rename_all = "snake_case")]
pub enum Count {
    /// [`Row::flops`]: floating-point operations of one call.
    Flops,
    /// [`Row::bytes`]: bytes one call must move through device memory.
    Bytes,
    /// [`Row::items`]: items (tokens, kernel evaluations, ...) one call processes.
    Items,
}

impl Count {
    /// The snake_case name used in JSON (`flops`, `bytes`, `items`).
    pub fn as_str(self) -> &'static str {
        match self {
            Count::Flops => "flops",
            Count::Bytes => "bytes",
            Count::Items => "items",
        }
    }

    /// The count of `row`, when it has one.
    pub fn of(self, row: &Row) -> Option<f64> {
        match self {
            Count::Flops => row.flops,
            Count::Bytes => row.bytes,
            Count::Items => row.items,
        }
    }
}

/// One throughput measure a document declares: `count / (median_ms / 1000) / per_second`,
/// shown in `unit`. Attention declares `{key: "tflops", unit: "TFLOP/s", count: "flops",
/// per_second: 1e12}`.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Throughput {
    /// Identifier used by prose queries and anchors, e.g. `tflops`, `gb_per_s`.
    #[schemars(length(min = 1))]
    pub key: String,
    /// Unit shown beside the value, e.g. `TFLOP/s`, `GB/s`, `Mtokens/s`.
    #[schemars(length(min = 1))]
    pub unit: String,
    /// The row count it is computed from.
    pub count: Count,
    /// Divisor from count per second to the unit: `1e12` for TFLOP/s, `1e9` for GB/s.
    #[schemars(extend("exclusiveMinimum" = 0))]
    pub per_second: f64,
    /// The device's ceiling for this measure in `unit`, when the runner knows one (dense bf16
    /// tensor peak, HBM bandwidth); the page then shows each value as a share of it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ceiling: Option<Ceiling>,
}

impl Throughput {
    /// This measure for `row`: its count over its median time, in [`Throughput::unit`];
    /// `None` when the row has no positive median or no such count.
    pub fn of(&self, row: &Row) -> Option<f64> {
        let ms = row.median_ms.filter(|m| *m > 0.0)?;
        Some(self.count.of(row)? / (ms * 1e-3) / self.per_second)
    }
}

/// A device ceiling and where the figure comes from.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Ceiling {
    /// The ceiling, in the throughput's unit.
    #[schemars(extend("exclusiveMinimum" = 0))]
    pub value: f64,
    /// Where it comes from, e.g. `cuBLAS bf16 GEMM 8192³ measured in this run` or a datasheet.
    #[schemars(length(min = 1))]
    pub source: String,
}

/// A change made to a document after its run.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Amendment {
    /// When, RFC 3339 UTC or a date (`2026-11-30`).
    #[schemars(length(min = 1))]
    pub when: String,
    /// What changed, naming the fields.
    #[schemars(length(min = 1))]
    pub what: String,
    /// Why.
    #[schemars(length(min = 1))]
    pub why: String,
}

/// Timing parameters (see the Methodology section of the site). The same parameters and the
/// same rules apply to the project's kernels and to the alternatives measured from Python.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TimingConfig {
    /// Warm-up, ms: after the case is compiled and loaded and its first call made, calls are
    /// repeated until their event time adds up to at least this long, before any sample.
    #[schemars(range(min = 0))]
    pub warmup_ms: f64,
    /// Timed samples per case; each sample is `inner` back-to-back calls between two events.
    /// A case stops taking samples early only under `case_timeout_s` (see there).
    #[schemars(range(min = 1, max = u32::MAX))]
    pub repeats: u32,
    /// Smallest wall time of one sample, in ms: `inner` is raised until a sample lasts this long.
    #[schemars(extend("exclusiveMinimum" = 0))]
    pub min_sample_ms: f64,
    /// Upper bound on `inner`.
    #[schemars(range(min = 1, max = u32::MAX))]
    pub max_inner: u32,
    /// Inputs are rotated among enough copies that their total exceeds this many times the L2
    /// (at most 64 copies, and on the Python side at most half the free device memory; a row
    /// whose rotation was capped says so in [`Row::l2_rotation_reached`] and [`Row::notes`]).
    #[schemars(range(min = 0))]
    pub l2_rotation_factor: f64,
    /// Per-case wall-clock limit in seconds, counted from the first warm-up call: no sample is
    /// started that would end past it once 3 samples exist (the row keeps the samples taken);
    /// with fewer, passing it makes the row `timeout`. The case process is killed, and the row
    /// recorded as `timeout`, at 1.5 × this limit + 60 s (input upload and checks included).
    #[schemars(extend("exclusiveMinimum" = 0))]
    pub case_timeout_s: f64,
    /// A row is launch-bound when [`Row::host_ms`] ≥ this × its eager device time per call
    /// ([`LAUNCH_BOUND_RATIO`]).
    #[serde(default = "default_launch_bound_ratio")]
    #[schemars(extend("exclusiveMinimum" = 0))]
    pub launch_bound_ratio: f64,
    /// How many times the whole grid was measured (`--runs k`); each row keeps the run whose
    /// median is the median of the runs and lists every run's median in [`Row::runs_ms`].
    #[serde(default = "default_runs")]
    #[schemars(range(min = 1, max = u32::MAX))]
    pub runs: u32,
}

fn default_launch_bound_ratio() -> f64 {
    LAUNCH_BOUND_RATIO
}

fn default_runs() -> u32 {
    1
}

/// One row of the dispatch table: for inputs matching `rule` on `device`, `entry_point` runs
/// `implementation`.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DispatchRule {
    /// Public function, e.g. `attention::dot_product_attention`.
    pub entry_point: String,
    /// Device class, e.g. `cuda sm_80+`.
    pub device: String,
    /// Dtypes the rule covers, e.g. `bf16, f16`.
    pub dtype: String,
    /// Shape condition in words, e.g. `head_dim in {64, 128}, seq_len % 64 == 0`.
    pub rule: String,
    /// Implementation picked.
    pub implementation: String,
}

/// One named case parameter value.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq)]
#[serde(untagged)]
pub enum Param {
    /// A flag such as `causal`.
    Bool(bool),
    /// An integer size such as `seq_len`.
    Int(i64),
    /// A real parameter such as a blur scale.
    Float(f64),
    /// A name such as `dtype` or `pass`.
    Text(String),
}

/// The size named `key` in a case's parameters (a non-negative `Param::Int`).
///
/// # Errors
/// The parameter is missing, or is not a non-negative integer (the message names it).
pub fn param_size(p: &BTreeMap<String, Param>, key: &str) -> Result<usize, String> {
    match p.get(key) {
        Some(Param::Int(i)) if *i >= 0 => Ok(*i as usize),
        Some(other) => Err(format!("parameter `{key}` = {other} is not a size")),
        None => Err(format!("parameter `{key}` is missing")),
    }
}

/// The name named `key` in a case's parameters (a `Param::Text`, such as `dtype`).
///
/// # Errors
/// The parameter is missing, or is not text (the message names it).
pub fn param_name<'a>(p: &'a BTreeMap<String, Param>, key: &str) -> Result<&'a str, String> {
    match p.get(key) {
        Some(Param::Text(s)) => Ok(s.as_str()),
        Some(other) => Err(format!("parameter `{key}` = {other} is not a name")),
        None => Err(format!("parameter `{key}` is missing")),
    }
}

impl std::fmt::Display for Param {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Param::Bool(b) => write!(f, "{b}"),
            Param::Int(i) => write!(f, "{i}"),
            Param::Float(x) => write!(f, "{x}"),
            Param::Text(s) => f.write_str(s),
        }
    }
}

/// Outcome of one (case, implementation).
#[derive(
    Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash,
)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// Ran; timing and accuracy fields are set.
    Ok,
    /// Ran out of device memory.
    Oom,
    /// The implementation rejects the shape, dtype or backend; `message` says why.
    Unsupported,
    /// Failed; `message` keeps the error.
    Error,
    /// Exceeded the case time limit.
    Timeout,
}

impl Status {
    /// The snake_case name used in JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::Oom => "oom",
            Status::Unsupported => "unsupported",
            Status::Error => "error",
            Status::Timeout => "timeout",
        }
    }
}

/// Memory figures of one row, MB = 10^6 bytes.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(deny_unknown_fields)]
pub struct Memory {
    /// Input arguments the implementation reads (Q, K, V, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub arguments_mb: Option<f64>,
    /// Outputs it writes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub outputs_mb: Option<f64>,
    /// Temporaries it allocates beyond arguments and outputs (score matrices, workspaces).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub temporaries_mb: Option<f64>,
    /// Bytes kept for the backward pass (residuals); forward-only rows leave it out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub residuals_mb: Option<f64>,
    /// The most device memory allocated at once from the case's start (its first input set
    /// uploaded) to the end of its first call: one input set, the output and every temporary,
    /// read in a fresh process per case; library workspaces that persist across calls are
    /// apart (`workspace_mb`), the CUDA context is not counted. `peak_method` says how it was
    /// read (the project: the stream-ordered memory pool's `USED_MEM_HIGH`; PyTorch:
    /// `torch.cuda.max_memory_allocated`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub peak_mb: Option<f64>,
    /// How `peak_mb` was read, e.g. `cuMemGetInfo delta` or `torch.cuda.max_memory_allocated`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_method: Option<String>,
    /// Peak of the memory the allocator held from the device over the same span as `peak_mb`,
    /// its rounding and caching included (the project: the pool's `RESERVED_MEM_HIGH`;
    /// PyTorch: `torch.cuda.max_memory_reserved`), workspaces apart.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub reserved_peak_mb: Option<f64>,
    /// Library workspaces held across calls, not in `peak_mb` (the project's `math`: the
    /// cuBLAS workspace it gives the handle; PyTorch: the cuBLAS/cuBLASLt workspaces released by
    /// `torch._C._cuda_clearCublasWorkspaces`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub workspace_mb: Option<f64>,
}

/// Which reference an error was measured against.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Reference {
    /// A float64 implementation on the host CPU.
    Float64Cpu,
    /// A float64 implementation on the device (used by the Python comparison script).
    Float64Device,
    /// The same computation in float32 at highest precision on the device.
    Float32Device,
}

/// Accuracy of one row.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Accuracy {
    /// The error, as defined by `metric`.
    #[schemars(range(min = 0))]
    pub rel_err: f64,
    /// `rel_l2`: ‖out − ref‖₂ / ‖ref‖₂ over the checked output elements (`checked`).
    pub metric: String,
    /// The reference `rel_err` is measured against.
    pub reference: Reference,
    /// Largest `rel_err` accepted for this dtype; a row above it is flagged on the site.
    #[schemars(extend("exclusiveMinimum" = 0))]
    pub tolerance: f64,
    /// What the reference covered when it checked a sample, e.g.
    /// `2 of 32 (batch, head) slices x 256 of 16384 query rows`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checked: Option<String>,
}

/// One (case, implementation) result.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Row {
    /// The case as named parameters. Attention: `batch`, `heads`, `kv_heads`, `seq_len`,
    /// `head_dim`, `causal`, `dtype`, `pass` (`fwd` or `fwd+bwd`).
    pub case: BTreeMap<String, Param>,
    /// Implementation name, unique within the suite, e.g. `flash`, `math`, `torch_cudnn`.
    pub implementation: String,
    /// Who provides it, e.g. `kernelpages`, `cuBLAS`, `PyTorch`.
    pub library: String,
    /// True for the implementation the project runs when none is named.
    pub default: bool,
    /// Outcome.
    pub status: Status,
    /// Why a row is not `ok` (error text kept verbatim), or a remark on an `ok` row.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// Median time per call, ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("exclusiveMinimum" = 0))]
    pub median_ms: Option<f64>,
    /// First quartile of time per call, ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("exclusiveMinimum" = 0))]
    pub q1_ms: Option<f64>,
    /// Third quartile of time per call, ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("exclusiveMinimum" = 0))]
    pub q3_ms: Option<f64>,
    /// Calls per timed sample.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = u32::MAX))]
    pub inner_calls: Option<u32>,
    /// Number of timed samples.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = u32::MAX))]
    pub samples: Option<u32>,
    /// Input sets rotated through during timing (1 = no rotation).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = u32::MAX))]
    pub input_sets: Option<u32>,
    /// Time to compile (NVRTC, torch.compile, XLA) and load the case, s. With
    /// `protocol.kernels_compiled_once`, the first compile and load of the same kernel sources
    /// in this runner process, which may have been an earlier case's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub compile_s: Option<f64>,
    /// Memory figures.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<Memory>,
    /// Accuracy against the reference.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accuracy: Option<Accuracy>,
    /// Floating-point operations of one call, by the suite's counting rule
    /// ([`RunConfig::flop_rule`]; attention: 4·B·H·T²·D, halved when causal, ×3.5 for forward
    /// + backward). Throughputs are derived from it, never stored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("exclusiveMinimum" = 0))]
    pub flops: Option<f64>,
    /// Bytes one call must move through device memory (each input read once, each output
    /// written once), for GB/s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("exclusiveMinimum" = 0))]
    pub bytes: Option<f64>,
    /// Items one call processes (tokens, kernel evaluations, ...), for items/s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("exclusiveMinimum" = 0))]
    pub items: Option<f64>,
    /// How `median_ms` was timed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timing: Option<TimingMethod>,
    /// Median host time to enqueue one call, ms: the host's wall time from before the first
    /// launch of a sample to after its last launch returned, ÷ `inner`, over the same samples as
    /// the eager median. The row is launch-bound when `host_ms` ≥
    /// [`TimingConfig::launch_bound_ratio`] × the eager device time per call (`median_ms`, or
    /// `eager_median_ms` for graph-replayed rows).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("exclusiveMinimum" = 0))]
    pub host_ms: Option<f64>,
    /// For rows timed by [`TimingMethod::GraphReplay`]: the median of the same calls made
    /// eagerly back to back between two events, ms (the second figure).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("exclusiveMinimum" = 0))]
    pub eager_median_ms: Option<f64>,
    /// Wall time of the first call in a fresh process, s (frameworks: backend selection, plan
    /// building, lazy library loading), apart from `compile_s`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub first_call_s: Option<f64>,
    /// The median of each run of `--runs k`, ms, in run order; empty for a single run.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub runs_ms: Vec<f64>,
    /// Bytes rotated through while timing ÷ the L2 size: `input_sets` × one input set's bytes
    /// ÷ L2. Below [`TimingConfig::l2_rotation_factor`] when a cap stopped the rotation short.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub l2_rotation_reached: Option<f64>,
    /// The device's state while the row was timed (NVML, sampled by the runner every 25 ms).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub machine: Option<MachineState>,
    /// Remarks the page shows beside the row (float32 accumulation, useful-work FLOPs, rotation
    /// capped at N sets, launch-bound, ...).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
}

/// How a row's `median_ms` was timed.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum TimingMethod {
    /// `inner` calls issued back to back between two CUDA events.
    Events,
    /// A CUDA graph holding `inner` calls, replayed between two CUDA events.
    GraphReplay,
    /// `inner` calls issued back to back between two readings of the host's clock, the last
    /// reading after waiting for the results: CPU rows, and frameworks without device events
    /// (JAX: asynchronous dispatch, then `block_until_ready`).
    WallClock,
}

/// The device's state while a row was timed, from NVML samples the runner takes every 25 ms
/// over the row's timed span.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(deny_unknown_fields)]
pub struct MachineState {
    /// Median SM clock, MHz.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("exclusiveMinimum" = 0))]
    pub sm_clock_mhz: Option<f64>,
    /// Highest SM clock the device supports, MHz (to show throttling as a share).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("exclusiveMinimum" = 0))]
    pub max_sm_clock_mhz: Option<f64>,
    /// Median memory clock, MHz.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("exclusiveMinimum" = 0))]
    pub mem_clock_mhz: Option<f64>,
    /// Highest GPU temperature, °C.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature_c: Option<f64>,
    /// Median board power, W.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub power_w: Option<f64>,
    /// Enforced power limit, W.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("exclusiveMinimum" = 0))]
    pub power_limit_w: Option<f64>,
    /// Clock throttle reasons seen in any sample, other than idle and application-clock
    /// settings (e.g. `sw_power_cap`, `hw_slowdown`, `sw_thermal_slowdown`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub throttle_reasons: Vec<String>,
    /// Other processes seen on the GPU before or during the row, as `pid name` (the runner and
    /// its case processes excluded). Non-empty means the GPU was shared while this row was timed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub other_processes: Vec<String>,
}

impl Row {
    /// A row for a case that did not run.
    pub fn failed(
        case: BTreeMap<String, Param>,
        implementation: &str,
        library: &str,
        default: bool,
        status: Status,
        message: impl Into<String>,
    ) -> Row {
        Row {
            case,
            implementation: implementation.to_string(),
            library: library.to_string(),
            default,
            status,
            message: Some(message.into()),
            median_ms: None,
            q1_ms: None,
            q3_ms: None,
            inner_calls: None,
            samples: None,
            input_sets: None,
            compile_s: None,
            memory: None,
            accuracy: None,
            flops: None,
            bytes: None,
            items: None,
            timing: None,
            host_ms: None,
            eager_median_ms: None,
            first_call_s: None,
            runs_ms: Vec::new(),
            l2_rotation_reached: None,
            machine: None,
            notes: Vec::new(),
        }
    }

    /// True when the host time to enqueue one call is at least `ratio` × the eager device time
    /// per call (`eager_median_ms` for graph-replayed rows, else `median_ms`): the timing
    /// measured the host issuing calls. False when either figure is missing.
    pub fn launch_bound(&self, ratio: f64) -> bool {
        let device = self.eager_median_ms.or(self.median_ms);
        match (self.host_ms, device) {
            (Some(h), Some(d)) => h >= ratio * d,
            _ => false,
        }
    }

    /// Value of a case parameter.
    pub fn param(&self, name: &str) -> Option<&Param> {
        self.case.get(name)
    }

    /// Integer case parameter.
    pub fn int(&self, name: &str) -> Option<i64> {
        match self.case.get(name) {
            Some(Param::Int(i)) => Some(*i),
            _ => None,
        }
    }

    /// Boolean case parameter.
    pub fn flag(&self, name: &str) -> Option<bool> {
        match self.case.get(name) {
            Some(Param::Bool(b)) => Some(*b),
            _ => None,
        }
    }

    /// Text case parameter.
    pub fn text(&self, name: &str) -> Option<&str> {
        match self.case.get(name) {
            Some(Param::Text(s)) => Some(s),
            _ => None,
        }
    }
}

/// The JSON Schema of [`Document`], pretty-printed.
pub fn document_schema_json() -> String {
    let schema = schemars::schema_for!(Document);
    let mut s = serde_json::to_string_pretty(&schema).expect("schema serialises");
    s.push('\n');
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn param_untagged_roundtrip() {
        let mut case = BTreeMap::new();
        case.insert("seq_len".into(), Param::Int(4096));
        case.insert("causal".into(), Param::Bool(true));
        case.insert("dtype".into(), Param::Text("bf16".into()));
        let row = Row::failed(
            case,
            "flash",
            "kernelpages",
            true,
            Status::Oom,
            "out of memory",
        );
        let s = serde_json::to_string(&row).unwrap();
        assert!(s.contains(r#""seq_len":4096"#), "{s}");
        let back: Row = serde_json::from_str(&s).unwrap();
        assert_eq!(back, row);
        assert_eq!(back.int("seq_len"), Some(4096));
        assert_eq!(back.flag("causal"), Some(true));
        assert_eq!(back.text("dtype"), Some("bf16"));
    }

    #[test]
    fn unknown_status_is_rejected() {
        let s =
            r#"{"case":{},"implementation":"x","library":"y","default":false,"status":"crashed"}"#;
        assert!(serde_json::from_str::<Row>(s).is_err());
    }

    #[test]
    fn schema_names_every_suite() {
        let s = document_schema_json();
        for suite in Suite::ALL {
            assert!(s.contains(suite.as_str()), "{}", suite.as_str());
        }
    }
}
