//! `sequence_mixers`: measures the sequence mixers' forward passes (SSD, Mamba-2's layer, and
//! Mamba's selective scan; [`kernelpages::sequence_mixers`]) for the project's implementations
//! and, with `--compare torch`, PyTorch's eager formulations (`runners/compare/torch_mixers.py`:
//! Mamba-2's chunked minimal SSD, and the selective scan's reference loop over time), and writes
//! one suite document. The machinery (processes, order, timing records, progress, document) is
//! `kernelpages::runner`; this file is the grid, the implementations, the dispatch table and
//! the counts.
//!
//! The project's implementations: `cuda` on a CUDA device (version 1 of each kernel, float32
//! arithmetic on CUDA cores: [`kernelpages::sequence_mixers::cuda`],
//! [`kernelpages::sequence_mixers::scan_cuda`]) and `cpu` on the CPU (`--device cpu`, the
//! float32 recurrence over rayon's threads: [`kernelpages::sequence_mixers::cpu`]).
//!
//! ```text
//! sequence_mixers --compare torch --output data/gpu_sequence_mixers.json
//! sequence_mixers --device cpu --compare torch --output data/cpu_sequence_mixers.json
//! sequence_mixers --device cpu --quick
//! ```

use std::path::Path;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::Parser;
use cudarc::driver::CudaSlice;

use kernelpages::attention::cpu_flash::read_elements;
use kernelpages::attention::Dtype as Codec;
use kernelpages::gpu::{Gpu, GpuError};
use kernelpages::runner::grid::Params;
use kernelpages::runner::protocol::{CaseFiles, Job, Reply, TensorFile};
use kernelpages::runner::{self, host, own, Alternative, Declared, DeviceChoice, RunnerArgs};
use kernelpages::schema::{Count, DispatchRule, RunKind, Status, Suite, Throughput};
use kernelpages::sequence_mixers::case::{Mixer, MixerCase, MixerDtype, MixerInputs};
use kernelpages::sequence_mixers::cuda::{self as ssd_cuda, Dtype as DeviceDtype, Ssd};
use kernelpages::sequence_mixers::scan_cuda::{self, Scan};
use kernelpages::sequence_mixers::{cpu, files};

/// Measure the sequence mixers on the GPU (or with --device cpu the CPU) and write a suite
/// document.
#[derive(Parser, Debug)]
#[command(
    name = "sequence_mixers",
    version,
    about = "Measure the sequence mixers (SSD, the selective scan) on the GPU (data/gpu_sequence_mixers.json) or with --device cpu the CPU (data/cpu_sequence_mixers.json) and write a suite document"
)]
struct Cli {
    #[command(flatten)]
    run: RunnerArgs,
    /// Mixers: `ssd`, `selective_scan` [default: both].
    #[arg(long, value_delimiter = ',')]
    mixers: Option<Vec<String>>,
    /// Sequence lengths [default: 1024,4096,16384,65536 on the GPU, 1024,4096 on the CPU; the
    /// shortest with --quick].
    #[arg(long, value_delimiter = ',')]
    seq_lens: Option<Vec<usize>>,
    /// SSD head_dim (= its state size N) [default: 64,128 on the GPU, 64 on the CPU]; the
    /// selective scan runs heads × head_dim channels.
    #[arg(long, value_delimiter = ',')]
    head_dims: Option<Vec<usize>>,
    /// dtypes of X, B, C and Y [default: bf16,fp32 on the GPU, fp32 on the CPU].
    #[arg(long, value_delimiter = ',')]
    dtypes: Option<Vec<String>>,
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
/// Sequence lengths of the GPU grid.
const GPU_SEQ_LENS: [usize; 4] = [1024, 4096, 16384, 65536];
/// Sequence lengths of the CPU grid.
const CPU_SEQ_LENS: [usize; 2] = [1024, 4096];
/// SSD head dims of the GPU grid.
const GPU_HEAD_DIMS: [usize; 2] = [64, 128];
/// SSD head dims of the CPU grid.
const CPU_HEAD_DIMS: [usize; 1] = [64];

/// The alternatives `--compare` can add (each module measures on the run's device).
const ALTERNATIVES: [Alternative; 1] = [Alternative {
    name: "torch",
    module: "torch_mixers",
    library: "PyTorch",
    implementations: &["torch_eager"],
}];

/// How FLOPs are counted (the document's `flop_rule`).
const FLOP_RULE: &str = "the recurrence's arithmetic, per token and state element: SSD 5 (the decay and input update, 3; the read-out by C, 2), the selective scan 6 (its per-element Δ·A as well; exponentials not counted); a chunked kernel does more, the count is the same for every implementation of a case. Throughput also as tokens per second (B·T per call)";

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
                Mixer::parse(n)
                    .with_context(|| format!("--mixers: unknown mixer `{n}` (ssd, selective_scan)"))
            })
            .collect::<Result<_>>()?,
        None => Mixer::ALL.to_vec(),
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
                other => anyhow::bail!("--dtypes: `{other}` (fp32, bf16)"),
            })
            .collect::<Result<_>>()?,
        None if gpu => vec![MixerDtype::Bf16, MixerDtype::Fp32],
        None => vec![MixerDtype::Fp32],
    };
    let mut out = Vec::new();
    for &mixer in &mixers {
        for &dtype in &dtypes {
            for &p in &head_dims {
                for &t in &seq_lens {
                    let mut c = match mixer {
                        Mixer::Ssd => MixerCase::ssd(BATCH, t, HEADS, p, p),
                        Mixer::SelectiveScan => MixerCase::scan(BATCH, t, HEADS * p, SCAN_STATE),
                    };
                    c.dtype = dtype;
                    c.validate().map_err(anyhow::Error::msg)?;
                    out.push(c.params());
                }
            }
        }
    }
    Ok(out)
}

/// What the entry points run: version 1 of each CUDA kernel, or the CPU recurrence.
fn dispatch_rules(device: DeviceChoice) -> Vec<DispatchRule> {
    if device == DeviceChoice::Gpu {
        return vec![
            DispatchRule {
                entry_point: "sequence_mixers::cuda::Ssd".into(),
                device: "CUDA, compute capability 8.0 or newer".into(),
                dtype: "fp32, bf16 (X, B, C, Y; Δ, A, D and states fp32)".into(),
                rule: format!(
                    "always (head_dim and state up to {}): SSD in chunks of {} steps, three kernels (each chunk's final state from zero, the states passed between chunks, each chunk's output from its intra-chunk masked products plus the incoming state's read-out), float32 arithmetic on CUDA cores (version 1, no tensor cores)",
                    ssd_cuda::MAX_DIM,
                    ssd_cuda::CHUNK
                ),
                implementation: GPU_IMPLEMENTATION.into(),
            },
            DispatchRule {
                entry_point: "sequence_mixers::scan_cuda::Scan".into(),
                device: "CUDA, compute capability 8.0 or newer".into(),
                dtype: "fp32, bf16 (u, B, C, y; Δ, A, D and states fp32)".into(),
                rule: format!(
                    "always (state up to {}): one warp per channel walking the sequence, each lane holding a slice of the channel's state in registers, the read-out summed across the warp; {} warps per block",
                    scan_cuda::MAX_STATE,
                    scan_cuda::WARPS
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
        if c.mixer == Mixer::SelectiveScan {
            notes.push(format!(
                "channels = {HEADS} × head_dim, state {SCAN_STATE} per channel (Mamba-1's d_state)"
            ));
        }
        if implementation == GPU_IMPLEMENTATION {
            notes.push("float32 arithmetic; zero initial state, the final state written".into());
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
        anyhow::ensure!(inputs.len() == 6, "{} inputs, expected 6", inputs.len());
        for t in inputs {
            anyhow::ensure!(
                t.dtype == "fp32",
                "input {} is {}, expected fp32",
                t.name,
                t.dtype
            );
        }
        let read = |k: usize| read_elements::<f32>(&inputs[k].path);
        Ok(MixerInputs {
            x: read(0)?,
            dt: read(1)?,
            a: read(2)?,
            b: read(3)?,
            c: read(4)?,
            d: read(5)?,
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

/// X (u), B, C in the case's element type on the device.
enum Seq {
    F32(CudaSlice<f32>),
    Bf16(CudaSlice<u16>),
}

/// One input set on the device.
struct DeviceSet {
    x: Seq,
    b: Seq,
    c: Seq,
    dt: CudaSlice<f32>,
    a: CudaSlice<f32>,
    d: CudaSlice<f32>,
}

/// The mixer's compiled kernels.
enum Kernels {
    Ssd(Ssd),
    Scan(Scan),
}

/// `cuda` on one case: the kernels write Y (in the case's dtype) and the final state (kept in
/// the launcher's buffer); a float32 Y is written into the launcher's buffer and copied into
/// the runner's output.
struct GpuLaunch {
    kernels: Kernels,
    case: MixerCase,
    y32: Option<CudaSlice<f32>>,
    final_state: CudaSlice<f32>,
}

fn upload_seq(gpu: &Gpu, dtype: MixerDtype, words: &[u16]) -> Result<Seq, GpuError> {
    Ok(match dtype {
        MixerDtype::Fp32 => {
            let v: Vec<f32> = Codec::F32
                .decode_all(words)
                .into_iter()
                .map(|x| x as f32)
                .collect();
            Seq::F32(gpu.stream.clone_htod(&v)?)
        }
        MixerDtype::Bf16 => Seq::Bf16(gpu.stream.clone_htod(words)?),
    })
}

fn upload_f32(gpu: &Gpu, words: &[u16]) -> Result<CudaSlice<f32>, GpuError> {
    let v: Vec<f32> = Codec::F32
        .decode_all(words)
        .into_iter()
        .map(|x| x as f32)
        .collect();
    Ok(gpu.stream.clone_htod(&v)?)
}

fn copy_seq(gpu: &Gpu, s: &Seq) -> Result<Seq, GpuError> {
    Ok(match s {
        Seq::F32(v) => Seq::F32(gpu.stream.clone_dtod(v)?),
        Seq::Bf16(v) => Seq::Bf16(gpu.stream.clone_dtod(v)?),
    })
}

impl own::Launcher for GpuLaunch {
    type Set = DeviceSet;
    fn upload(&self, gpu: &Gpu, host: &[Vec<u16>]) -> Result<DeviceSet, GpuError> {
        if host.len() != 6 {
            return Err(GpuError::Config(format!(
                "{} inputs, expected 6",
                host.len()
            )));
        }
        let dt = self.case.dtype;
        Ok(DeviceSet {
            x: upload_seq(gpu, dt, &host[0])?,
            dt: upload_f32(gpu, &host[1])?,
            a: upload_f32(gpu, &host[2])?,
            b: upload_seq(gpu, dt, &host[3])?,
            c: upload_seq(gpu, dt, &host[4])?,
            d: upload_f32(gpu, &host[5])?,
        })
    }
    fn replicate(&self, gpu: &Gpu, set: &DeviceSet) -> Result<DeviceSet, GpuError> {
        Ok(DeviceSet {
            x: copy_seq(gpu, &set.x)?,
            b: copy_seq(gpu, &set.b)?,
            c: copy_seq(gpu, &set.c)?,
            dt: gpu.stream.clone_dtod(&set.dt)?,
            a: gpu.stream.clone_dtod(&set.a)?,
            d: gpu.stream.clone_dtod(&set.d)?,
        })
    }
    fn launch(
        &mut self,
        gpu: &Gpu,
        set: &DeviceSet,
        outs: &mut [CudaSlice<u16>],
    ) -> Result<(), GpuError> {
        let out = outs
            .first_mut()
            .ok_or_else(|| GpuError::Config("no output buffer".into()))?;
        let fs = &mut self.final_state;
        match (&set.x, &set.b, &set.c) {
            (Seq::F32(x), Seq::F32(b), Seq::F32(c)) => {
                let y = self
                    .y32
                    .as_mut()
                    .ok_or_else(|| GpuError::Config("no float32 output buffer".into()))?;
                match &mut self.kernels {
                    Kernels::Ssd(k) => {
                        k.launch(gpu, x, &set.dt, &set.a, b, c, Some(&set.d), None, y, fs)?
                    }
                    Kernels::Scan(k) => {
                        k.launch(gpu, x, &set.dt, &set.a, b, c, Some(&set.d), None, y, fs)?
                    }
                }
                let len = y.len();
                // SAFETY: `out` holds 2·len 16-bit words, the bytes of `len` floats.
                let mut dst = unsafe { out.transmute_mut::<f32>(len) }
                    .ok_or_else(|| GpuError::Config("output buffer too short".into()))?;
                gpu.stream.memcpy_dtod(y, &mut dst)?;
            }
            (Seq::Bf16(x), Seq::Bf16(b), Seq::Bf16(c)) => match &mut self.kernels {
                Kernels::Ssd(k) => {
                    k.launch(gpu, x, &set.dt, &set.a, b, c, Some(&set.d), None, out, fs)?
                }
                Kernels::Scan(k) => {
                    k.launch(gpu, x, &set.dt, &set.a, b, c, Some(&set.d), None, out, fs)?
                }
            },
            _ => return Err(GpuError::Config("inputs of mixed element types".into())),
        }
        Ok(())
    }
    fn temporary_bytes(&self) -> u64 {
        let kernels = match &self.kernels {
            Kernels::Ssd(k) => k.temporary_bytes(),
            Kernels::Scan(k) => k.temporary_bytes(),
        };
        kernels
            + 4 * self.final_state.len() as u64
            + self.y32.as_ref().map_or(0, |y| 4 * y.len() as u64)
    }
    fn residual_bytes(&self) -> Option<u64> {
        None
    }
    fn workspace_bytes(&self) -> u64 {
        0
    }
}

/// The case process for `cuda`.
fn measure_gpu(job: &Job) -> Reply {
    let case = match case_of(&job.case) {
        Ok(c) => c,
        Err(e) => return Reply::failed(job, Status::Error, format!("{e:#}")),
    };
    own::measure(job, |gpu| {
        let dtype = match case.dtype {
            MixerDtype::Fp32 => DeviceDtype::F32,
            MixerDtype::Bf16 => DeviceDtype::Bf16,
        };
        let (kernels, compile_s, state_len) = match case.mixer {
            Mixer::Ssd => {
                let k = Ssd::new(gpu, case.ssd_shape(), dtype)?;
                let s = k.compile_s;
                (Kernels::Ssd(k), s, case.batch * case.state_elements())
            }
            Mixer::SelectiveScan => {
                let k = Scan::new(gpu, case.scan_shape(), dtype)?;
                let s = k.compile_s;
                (Kernels::Scan(k), s, case.batch * case.state_elements())
            }
        };
        let y_len = case.batch * case.seq_len * case.width();
        let y32 = match case.dtype {
            MixerDtype::Fp32 => Some(gpu.stream.alloc_zeros::<f32>(y_len)?),
            MixerDtype::Bf16 => None,
        };
        let final_state = gpu.stream.alloc_zeros::<f32>(state_len.max(1))?;
        Ok((
            GpuLaunch {
                kernels,
                case,
                y32,
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
        // 2 mixers × 2 dtypes × 2 head dims × 4 lengths.
        assert_eq!(cases(&gpu, false).unwrap().len(), 32);
        assert_eq!(cases(&gpu, true).unwrap().len(), 2 * 2);
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
        assert_eq!(dispatch_rules(DeviceChoice::Gpu).len(), 2);
    }
}
