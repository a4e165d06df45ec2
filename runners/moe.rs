//! `moe`: measures the MoE grouped GEMM (issue 14; [`kernelpages::moe`]) for the project's
//! kernel and, with `--compare torch`, PyTorch's alternatives (`runners/compare/torch_moe.py`:
//! `torch._grouped_mm`, a Python loop of matmuls, a batched GEMM padded to the largest group,
//! and a dense GEMM of the same FLOPs as the ceiling), and writes one suite document. The
//! machinery (processes, order, timing records, progress, document) is `kernelpages::runner`;
//! this file is the grid, the implementations, the dispatch table and the counts.
//!
//! The project's implementation: `grouped_mma_sync` (`kernels/moe/grouped_gemm.cu`,
//! [`kernelpages::moe::cuda`]): one launch for every expert, a persistent grid of 128 × 128
//! tiles on the tensor cores through mma.sync; a `fwd+bwd` call is the forward, dX and dW
//! (three launches).
//!
//! ```text
//! moe --compare torch --output data/gpu_moe.json
//! moe --quick --filter experts=64
//! ```

use std::path::Path;
use std::process::ExitCode;

use anyhow::Result;
use clap::Parser;
use cudarc::driver::CudaSlice;

use kernelpages::gpu::{Gpu, GpuError};
use kernelpages::moe::case::{GroupedCase, Spread};
use kernelpages::moe::cuda::{GroupedGemm, Product};
use kernelpages::moe::files;
use kernelpages::runner::grid::Params;
use kernelpages::runner::protocol::{CaseFiles, Job, Reply};
use kernelpages::runner::{self, own, Alternative, Declared, DeviceChoice, RunnerArgs};
use kernelpages::schema::{Count, DispatchRule, RunKind, Status, Suite, Throughput};

/// Measure the MoE grouped GEMM on the GPU and write a suite document.
#[derive(Parser, Debug)]
#[command(
    name = "moe",
    version,
    about = "Measure the MoE grouped GEMM (ragged experts, forward and backward) on the GPU and write a suite document (data/gpu_moe.json)"
)]
struct Cli {
    #[command(flatten)]
    run: RunnerArgs,
    /// Token counts [default: 4096,16384,65536 for the forward, 4096,16384 with the backward;
    /// 4096 with --quick].
    #[arg(long, value_delimiter = ',')]
    tokens: Option<Vec<usize>>,
    /// Rows of Y and dX checked against float64 per case (evenly spaced; each expert's first
    /// and last row are checked besides).
    #[arg(long, default_value_t = 32)]
    check_rows: usize,
}

/// The project's implementation.
const IMPLEMENTATION: &str = "grouped_mma_sync";

/// The expert layers of the grid: (experts, top_k, hidden K, expert width N, the model whose
/// layer it is).
const LAYERS: [(usize, usize, usize, usize, &str); 4] = [
    (8, 2, 4096, 14336, "Mixtral 8x7B"),
    (8, 1, 4096, 4096, "8 experts, top-1, square"),
    (64, 8, 2048, 1408, "64 small experts, top-8"),
    (128, 8, 2048, 1408, "128 small experts, top-8"),
];
/// Token counts of the forward rows.
const FWD_TOKENS: [usize; 3] = [4096, 16384, 65536];
/// Token counts of the forward + backward rows (their dY alone is M · N bf16).
const BWD_TOKENS: [usize; 2] = [4096, 16384];
/// Token counts of `--quick`.
const QUICK_TOKENS: [usize; 1] = [4096];

/// The alternatives `--compare` can add.
const ALTERNATIVES: [Alternative; 1] = [Alternative {
    name: "torch",
    module: "torch_moe",
    library: "PyTorch",
    implementations: &[
        "torch_grouped_mm",
        "torch_loop",
        "torch_bmm_padded",
        "torch_dense",
    ],
}];

/// How FLOPs are counted (the document's `flop_rule`).
const FLOP_RULE: &str = "2·M·K·N for the forward (M = tokens·top_k rows, K the hidden size, N the expert width), whatever the split over experts; 6·M·K·N with the backward (dX and dW as many each); padding and empty experts count nothing";

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match &cli.run.run_case {
        Some(job) => runner::child_main(job, measure_gpu),
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

/// The cases of the grid (or the quick grid): every layer at every token count, balanced and
/// skewed, the forward, then the forward and backward.
fn cases(cli: &Cli, quick: bool) -> Result<Vec<Params>> {
    let mut out = Vec::new();
    for backward in [false, true] {
        let tokens: Vec<usize> = match (&cli.tokens, quick, backward) {
            (Some(t), _, _) => t.clone(),
            (None, true, _) => QUICK_TOKENS.to_vec(),
            (None, false, false) => FWD_TOKENS.to_vec(),
            (None, false, true) => BWD_TOKENS.to_vec(),
        };
        for &(experts, top_k, hidden, width, _) in &LAYERS {
            for &t in &tokens {
                for spread in [Spread::Balanced, Spread::Zipf] {
                    let c = GroupedCase {
                        tokens: t,
                        experts,
                        top_k,
                        hidden,
                        width,
                        spread,
                        backward,
                    };
                    c.validate().map_err(anyhow::Error::msg)?;
                    out.push(c.params());
                }
            }
        }
    }
    Ok(out)
}

fn dispatch_rules() -> Vec<DispatchRule> {
    vec![DispatchRule {
        entry_point: "moe::cuda::GroupedGemm::launch".into(),
        device: "CUDA, compute capability 8.0 or newer".into(),
        dtype: "bf16 (float32 accumulation)".into(),
        rule: "always: one launch over every expert's rows whatever their sizes (empty experts included), a persistent grid of 2 blocks per SM taking 128 × 128 output tiles in turn, bands of 8 row tiles per column step; mma.sync m16n8k16 from 4 cp.async stages of 32 along the reduction; dX and dW the same kernel with the weights read transposed and the reduction over each expert's rows".into(),
        implementation: IMPLEMENTATION.into(),
    }]
}

fn throughput_decls() -> Vec<Throughput> {
    vec![
        Throughput {
            key: "tflops".into(),
            unit: "TFLOP/s".into(),
            count: Count::Flops,
            per_second: 1e12,
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

struct Moe {
    check_rows: usize,
}

fn case_of(p: &Params) -> Result<GroupedCase> {
    GroupedCase::from_params(p).map_err(anyhow::Error::msg)
}

/// The layer's description for a case (its row of [`LAYERS`]).
fn layer_name(c: &GroupedCase) -> Option<&'static str> {
    LAYERS
        .iter()
        .find(|l| (l.0, l.1, l.2, l.3) == (c.experts, c.top_k, c.hidden, c.width))
        .map(|l| l.4)
}

impl runner::Suite for Moe {
    fn suite(&self) -> Suite {
        Suite::Moe
    }

    /// x, w (and dY) uniform in [−1, 1) in bf16 ([`files::uniform_bf16`]) and the float64
    /// references of the checked elements.
    fn prepare(&self, p: &Params, seed: u64, dir: &Path) -> Result<CaseFiles> {
        files::write_case(&case_of(p)?, seed, self.check_rows, dir)
    }

    fn unsupported(&self, p: &Params, _implementation: &str) -> Option<String> {
        case_of(p).err().map(|e| format!("{e:#}"))
    }

    fn is_default(&self, _p: &Params, implementation: &str) -> bool {
        implementation == IMPLEMENTATION
    }

    fn notes(&self, p: &Params, implementation: &str) -> Vec<String> {
        let Ok(c) = case_of(p) else {
            return Vec::new();
        };
        let counts = c.group_counts();
        let largest = counts.iter().copied().max().unwrap_or(0);
        let empty = counts.iter().filter(|&&n| n == 0).count();
        let mut notes = vec![format!(
            "{} rows over {} experts: largest group {largest}, {empty} empty",
            c.rows(),
            c.experts
        )];
        if let Some(name) = layer_name(&c) {
            notes.push(format!("layer: {name}"));
        }
        if implementation == IMPLEMENTATION && c.backward {
            notes.push("fwd+bwd: the forward, dX and dW, three launches".into());
        }
        notes
    }

    fn label(&self, p: &Params) -> String {
        match case_of(p) {
            Ok(c) => format!(
                "{} T{} E{} k{} {}x{} {}",
                if c.backward { "fwd+bwd" } else { "fwd" },
                c.tokens,
                c.experts,
                c.top_k,
                c.hidden,
                c.width,
                c.spread.as_str()
            ),
            Err(_) => format!("{p:?}"),
        }
    }
}

fn run(cli: &Cli) -> Result<ExitCode> {
    anyhow::ensure!(
        cli.run.device == DeviceChoice::Gpu,
        "moe measures the GPU only so far (--device cpu has no implementation yet)"
    );
    let imps = runner::implementations(
        &[(IMPLEMENTATION, "kernelpages")],
        &ALTERNATIVES,
        &cli.run.compare,
    )?;
    let cases = cli.run.select(cases(cli, false)?, cases(cli, true)?)?;
    let declared = Declared {
        runner: "moe",
        flop_rule: Some(FLOP_RULE.into()),
        dispatch: dispatch_rules(),
        axes: vec!["tokens".into()],
        throughput: throughput_decls(),
        kind: RunKind::Grid,
    };
    let suite = Moe {
        check_rows: cli.check_rows,
    };
    runner::run(&suite, &cli.run, declared, cases, imps, Vec::new())
}

/// One input set on the device: x, w and (with the backward) dY.
struct Set {
    x: CudaSlice<u16>,
    w: CudaSlice<u16>,
    dy: Option<CudaSlice<u16>>,
}

/// `grouped_mma_sync` on one case, as the shared GPU case process drives it: the kernels write
/// the runner's outputs directly (Y, then dX and dW).
struct Launch {
    gg: GroupedGemm,
    case: GroupedCase,
    offsets: CudaSlice<i32>,
}

impl own::Launcher for Launch {
    type Set = Set;
    fn upload(&self, gpu: &Gpu, host: &[Vec<u16>]) -> Result<Set, GpuError> {
        let up = |k: usize| -> Result<CudaSlice<u16>, GpuError> {
            match host.get(k) {
                Some(v) if !v.is_empty() => Ok(gpu.stream.clone_htod(v)?),
                // The driver refuses a zero-byte allocation; no row reads it.
                _ => Ok(gpu.stream.clone_htod(&[0u16])?),
            }
        };
        Ok(Set {
            x: up(0)?,
            w: up(1)?,
            dy: if self.case.backward {
                Some(up(2)?)
            } else {
                None
            },
        })
    }
    fn replicate(&self, gpu: &Gpu, set: &Set) -> Result<Set, GpuError> {
        Ok(Set {
            x: gpu.stream.clone_dtod(&set.x)?,
            w: gpu.stream.clone_dtod(&set.w)?,
            dy: match &set.dy {
                Some(d) => Some(gpu.stream.clone_dtod(d)?),
                None => None,
            },
        })
    }
    fn launch(
        &mut self,
        gpu: &Gpu,
        set: &Set,
        outs: &mut [CudaSlice<u16>],
    ) -> Result<(), GpuError> {
        let c = &self.case;
        let (m, k, n) = (c.rows(), c.hidden, c.width);
        let want = if c.backward { 3 } else { 1 };
        if outs.len() != want {
            return Err(GpuError::Config(format!(
                "{} output buffers; the case writes {want}",
                outs.len()
            )));
        }
        let (y, grads) = outs.split_at_mut(1);
        self.gg.launch(
            gpu,
            Product::Forward,
            &set.x,
            &set.w,
            &mut y[0],
            &self.offsets,
            m,
            k,
            n,
        )?;
        if let Some(dy) = &set.dy {
            let (dx, dw) = grads.split_at_mut(1);
            self.gg.launch(
                gpu,
                Product::Dx,
                dy,
                &set.w,
                &mut dx[0],
                &self.offsets,
                m,
                k,
                n,
            )?;
            self.gg.launch(
                gpu,
                Product::Dw,
                &set.x,
                dy,
                &mut dw[0],
                &self.offsets,
                m,
                k,
                n,
            )?;
        }
        Ok(())
    }
    fn temporary_bytes(&self) -> u64 {
        // The offsets (E + 1 int32).
        4 * (self.case.experts as u64 + 1)
    }
    fn residual_bytes(&self) -> Option<u64> {
        // The backward reads x and w, the forward's inputs; nothing else is kept.
        self.case.backward.then_some(0)
    }
    fn workspace_bytes(&self) -> u64 {
        0
    }
}

/// The case process for `grouped_mma_sync`: the group counts from the case's arguments.
fn measure_gpu(job: &Job) -> Reply {
    if job.implementation != IMPLEMENTATION {
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
    let counts = match files::counts_of(&job.files.arguments) {
        Ok(c) => c,
        Err(e) => return Reply::failed(job, Status::Error, format!("{e:#}")),
    };
    own::measure(job, |gpu| {
        let gg = GroupedGemm::new(gpu, case.experts)?;
        let compile_s = gg.compile_s;
        let offsets: Vec<i32> = kernelpages::moe::reference::offsets_of(&counts)
            .into_iter()
            .map(|o| o as i32)
            .collect();
        let offsets = gpu.stream.clone_htod(&offsets)?;
        Ok((
            Launch {
                gg,
                case: case.clone(),
                offsets,
            },
            compile_s,
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_grid_and_its_selection() {
        let cli = Cli::try_parse_from(["moe"]).unwrap();
        let all = cases(&cli, false).unwrap();
        assert_eq!(
            all.len(),
            LAYERS.len() * 2 * (FWD_TOKENS.len() + BWD_TOKENS.len())
        );
        for p in &all {
            let c = case_of(p).unwrap();
            assert!(layer_name(&c).is_some());
            // K and N are multiples of 8 (the kernels' 16-byte copies).
            assert_eq!((c.hidden % 8, c.width % 8), (0, 0));
        }
        let quick = Cli::try_parse_from(["moe", "--quick", "--filter", "experts=64"]).unwrap();
        let kept = quick
            .run
            .select(cases(&quick, false).unwrap(), cases(&quick, true).unwrap())
            .unwrap();
        // One token count, balanced and skewed, fwd and fwd+bwd.
        assert_eq!(kept.len(), 4);
        assert!(Cli::try_parse_from(["moe", "--device", "cpu"])
            .map(|c| run(&c).is_err())
            .unwrap());
    }
}
