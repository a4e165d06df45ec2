//! `moe`: measures the MoE grouped GEMM (issue 14; [`kernelpages::moe`]) for the project's
//! kernel and, with `--compare torch`, PyTorch's alternatives (`runners/compare/torch_moe.py`:
//! `torch._grouped_mm`, a Python loop of matmuls, a batched GEMM padded to the largest group,
//! and a dense GEMM of the same FLOPs as the ceiling), and writes one suite document. The
//! machinery (processes, order, timing records, progress, document) is `kernelpages::runner`;
//! this file is the grid, the implementations, the dispatch table and the counts.
//!
//! The project's implementations: `grouped_matmul`, the dispatch
//! ([`kernelpages::moe::cuda::GroupedKernel::for_shape`]): on compute capability 9.0 the wgmma
//! kernel (`kernels/moe/grouped_gemm_sm90.cu`, [`kernelpages::moe::sm90`]: TMA, a producer and
//! two consumer warpgroups, 128 × 256 tiles, or 256 × 128 for the forward where N is an odd
//! multiple of 128 and [`kernelpages::moe::sm90::tall_pays`]), elsewhere the portable one; and
//! `grouped_mma_sync`, the portable kernel on every device (`kernels/moe/grouped_gemm.cu`,
//! [`kernelpages::moe::cuda`]: 128 × 128 tiles through mma.sync). Both run one launch for every
//! expert on a persistent grid; a `fwd+bwd` call is the forward, dX and dW (three launches).
//! Beside them on the GPU, always, the in-process alternative `cublas_loop`
//! ([`kernelpages::moe::cublas`]: one cublasGemmEx per non-empty expert).
//! With `--device cpu`, `cpu_grouped`: on a CPU with AVX-512 BF16 the bf16 operands multiplied
//! as they are ([`kernelpages::moe::cpu_bf16`]), elsewhere float32 products of them decoded
//! ([`kernelpages::moe::cpu`]), float32 results, on the host's cores (`data/cpu_moe.json`).
//!
//! ```text
//! moe --compare torch --output data/gpu_moe.json
//! moe --device cpu --compare torch --output data/cpu_moe.json
//! moe --quick --filter experts=64
//! ```

use std::path::Path;
use std::process::ExitCode;

use anyhow::Result;
use clap::Parser;
use cudarc::driver::CudaSlice;

use kernelpages::attention::cpu_flash::read_elements;
use kernelpages::gpu::{Gpu, GpuError};
use kernelpages::moe::case::{GroupedCase, Spread};
use kernelpages::moe::cpu as moe_cpu;
use kernelpages::moe::cpu_bf16 as moe_cpu_bf16;
use kernelpages::moe::cublas::{self, CublasLoop};
use kernelpages::moe::cuda::{Dtype, GroupedKernel, Product};
use kernelpages::moe::files;
use kernelpages::moe::layer_case::{self, LayerCase};
use kernelpages::moe::layer_cuda::{DeviceExperts, MoeLayer};
use kernelpages::moe::reference::Gate;
use kernelpages::runner::grid::Params;
use kernelpages::runner::protocol::{CaseFiles, Job, Reply, TensorFile};
use kernelpages::runner::{self, host, own, Alternative, Declared, DeviceChoice, RunnerArgs};
use kernelpages::schema::{Count, DispatchRule, Param, RunKind, Status, Suite, Throughput};

/// Measure the MoE grouped GEMM on the GPU and write a suite document.
#[derive(Parser, Debug)]
#[command(
    name = "moe",
    version,
    about = "Measure the MoE grouped GEMM (ragged experts, forward and backward) on the GPU (data/gpu_moe.json) or with --device cpu the CPU (data/cpu_moe.json) and write a suite document"
)]
struct Cli {
    #[command(flatten)]
    run: RunnerArgs,
    /// Token counts [default on the GPU: 4096,16384,131072 for the forward, 4096,16384 with the
    /// backward, 4096 with --quick; on the CPU: 256,1024, 256 with --quick].
    #[arg(long, value_delimiter = ',')]
    tokens: Option<Vec<usize>>,
    /// Rows of Y and dX checked against float64 per case (evenly spaced; each expert's first
    /// and last row are checked besides).
    #[arg(long, default_value_t = 32)]
    check_rows: usize,
}

/// The project's implementation: the dispatch of [`GroupedKernel::for_shape`].
const IMPLEMENTATION: &str = "grouped_matmul";
/// The portable kernel, run on every device beside the dispatch.
const PORTABLE: &str = "grouped_mma_sync";
/// The in-process alternative: one cuBLAS GEMM per non-empty expert ([`CublasLoop`]).
const CUBLAS_LOOP: &str = "cublas_loop";
/// The project's CPU implementation.
const CPU_IMPLEMENTATION: &str = "cpu_grouped";
/// Token counts of the CPU grid (its `--quick` grid: the first).
const CPU_TOKENS: [usize; 2] = [256, 1024];
/// Layers of [`LAYERS`] the CPU grid leaves out: the Mixtral layer's 4096 × 14336 experts
/// make a call of seconds on a few cores.
const CPU_SKIP_WIDTH: usize = 14336;

/// The expert layers of the grid: (experts, top_k, hidden K, expert width N, the model whose
/// layer it is).
const LAYERS: [(usize, usize, usize, usize, &str); 4] = [
    (8, 2, 4096, 14336, "Mixtral 8x7B"),
    (8, 1, 4096, 4096, "8 experts, top-1, square"),
    (64, 8, 2048, 1408, "64 small experts, top-8"),
    (128, 8, 2048, 1408, "128 small experts, top-8"),
];
/// The issue's two target points, beside the layers' token sweeps: M = tokens · top_k = 16384
/// rows of K = 2048, N = 1408, over 8 experts (top-2 of 8192 tokens) and over 64 (top-8 of
/// 2048 tokens), where `torch._grouped_mm` was measured at 671 and 528 TFLOP/s on the H200.
/// (experts, top_k, hidden K, expert width N, tokens.) Forward and backward, balanced and
/// skewed, on the GPU only.
const TARGETS: [(usize, usize, usize, usize, usize); 2] =
    [(8, 2, 2048, 1408, 8192), (64, 8, 2048, 1408, 2048)];
/// Token counts of the forward rows (issue 14's 4k to 128k; until 513d89c the largest was
/// 65536).
const FWD_TOKENS: [usize; 3] = [4096, 16384, 131072];
/// Token counts of the forward + backward rows (their dY alone is M · N bf16).
const BWD_TOKENS: [usize; 2] = [4096, 16384];
/// Token counts of `--quick`.
const QUICK_TOKENS: [usize; 1] = [4096];
/// Token counts of the whole layer's rows (the forward, and the forward and backward).
const LAYER_TOKENS: [usize; 2] = [4096, 16384];
/// The project's whole MoE layer ([`MoeLayer`]), on the `op = layer` cases.
const LAYER_IMPLEMENTATION: &str = "moe_layer";
/// The implementations of the `op = layer` cases; every other one computes the grouped GEMM.
const LAYER_IMPLEMENTATIONS: [&str; 4] = [
    LAYER_IMPLEMENTATION,
    "torch_layer_eager",
    "torch_layer_grouped",
    "torch_layer_compile",
];

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
        "torch_layer_eager",
        "torch_layer_grouped",
        "torch_layer_compile",
    ],
}];

/// How FLOPs are counted (the document's `flop_rule`).
const FLOP_RULE: &str = "grouped GEMM: 2·M·K·N for the forward (M = tokens·top_k rows, K the hidden size, N the expert width), whatever the split over experts; 6·M·K·N with the backward (dX and dW as many each); padding and empty experts count nothing. Whole layer (op = layer): 2·T·H·E for the router and 6·T·top_k·H·F for the experts' three projections (T tokens, H the hidden size, F the expert width), three times as many with the backward (each product's dX and dW); softmax, SwiGLU and the weighted sum count nothing";

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match &cli.run.run_case {
        Some(job) => runner::child_main(job, |job| {
            if job.implementation == CPU_IMPLEMENTATION {
                measure_cpu(job)
            } else if job.implementation == LAYER_IMPLEMENTATION {
                measure_layer(job)
            } else if job.implementation == CUBLAS_LOOP {
                measure_cublas(job)
            } else {
                measure_gpu(job)
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

/// The cases of the grid (or the quick grid): every layer at every token count, balanced and
/// skewed, the forward, then the forward and backward.
fn cases(cli: &Cli, quick: bool) -> Result<Vec<Params>> {
    let mut out = Vec::new();
    for backward in [false, true] {
        let cpu = cli.run.device == DeviceChoice::Cpu;
        let tokens: Vec<usize> = match (&cli.tokens, quick, backward, cpu) {
            (Some(t), _, _, _) => t.clone(),
            (None, true, _, true) => CPU_TOKENS[..1].to_vec(),
            (None, false, _, true) => CPU_TOKENS.to_vec(),
            (None, true, _, false) => QUICK_TOKENS.to_vec(),
            (None, false, false, false) => FWD_TOKENS.to_vec(),
            (None, false, true, false) => BWD_TOKENS.to_vec(),
        };
        for &(experts, top_k, hidden, width, _) in &LAYERS {
            if cpu && width == CPU_SKIP_WIDTH {
                continue;
            }
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
    // The target points, in the default GPU grid only (not with --tokens or --quick).
    if cli.run.device == DeviceChoice::Gpu && cli.tokens.is_none() && !quick {
        for backward in [false, true] {
            for &(experts, top_k, hidden, width, tokens) in &TARGETS {
                for spread in [Spread::Balanced, Spread::Zipf] {
                    let c = GroupedCase {
                        tokens,
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
    // The whole layer's forward, then its forward and backward (the GPU only: the CPU
    // implements the grouped GEMM alone).
    if cli.run.device == DeviceChoice::Gpu {
        let tokens: Vec<usize> = match (&cli.tokens, quick) {
            (Some(t), _) => t.clone(),
            (None, true) => QUICK_TOKENS.to_vec(),
            (None, false) => LAYER_TOKENS.to_vec(),
        };
        for backward in [false, true] {
            for &(experts, top_k, hidden, width, _) in &LAYERS {
                for &t in &tokens {
                    let c = LayerCase {
                        tokens: t,
                        experts,
                        top_k,
                        hidden,
                        width,
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

fn dispatch_rules(device: DeviceChoice) -> Vec<DispatchRule> {
    if device == DeviceChoice::Cpu {
        return vec![
            DispatchRule {
                entry_point: "moe::cpu_bf16::grouped_matmul_bf16, moe::cpu_bf16::grouped_matmul_backward_bf16".into(),
                device: "x86-64 CPU with AVX-512 BF16 (detected at run time)".into(),
                dtype: "bf16 operands as they are, float32 accumulation and results; K and N even".into(),
                rule: format!("each expert's rows in blocks of {} over rayon's threads, {} × {} register tiles of vdpbf16ps over the weights packed once into pair-interleaved panels; dW per expert from x_eᵀ and dY_e packed in the call", moe_cpu_bf16::BLOCK_ROWS, moe_cpu_bf16::MR, moe_cpu_bf16::NR),
                implementation: CPU_IMPLEMENTATION.into(),
            },
            DispatchRule {
                entry_point: "moe::cpu::grouped_matmul_f32, moe::cpu::grouped_matmul_backward_f32".into(),
                device: "any other CPU (or K or N odd)".into(),
                dtype: "bf16 operands decoded to float32 once at load; float32 products and results".into(),
                rule: format!("each expert's rows in blocks of {} over rayon's threads, one gemm-crate product per block; dW per expert in blocks of {} k-rows", moe_cpu::BLOCK_ROWS, moe_cpu::BLOCK_ROWS),
                implementation: CPU_IMPLEMENTATION.into(),
            },
        ];
    }
    vec![DispatchRule {
        entry_point: "moe::cuda::GroupedKernel::for_shape".into(),
        device: "CUDA, compute capability 9.0 (sm_90a)".into(),
        dtype: "bf16 (float32 accumulation)".into(),
        rule: format!("K and N multiples of 64 and at most {} experts: the wgmma kernel (grouped_gemm_sm90.cu): one launch over every expert's rows whatever their sizes, a persistent grid of one block per SM taking 128 × 256 output tiles in turn (bands of 8 row tiles per column step), or for the forward where N is an odd multiple of 128 (such as 1408) 256 × 128 tiles, so that no column tile is half empty, when a cost model on the mean group size favours them (moe::sm90::tall_pays){}; a producer warpgroup brings 64-wide steps of A and B by TMA through 4 stages (128-byte swizzle, mbarriers) and two consumer warpgroups multiply them on wgmma m64n256k16 (m64n128k16 on the 256 × 128 tiles and on a last column tile of at most 128; a 256 × 128 tile with at most 128 of its group's rows left splits its columns between the two, on m64n64k16; on the 128 × 256 tiles a consumer whose rows all lie past its group's end skips its products); they store the tile in 64 × 64 subtiles through shared memory by TMA (from registers where a tile's rows end inside a group's neighbour); dW zeroes a group's rows past its end in shared memory. Otherwise the portable kernel below", kernelpages::moe::sm90::MAX_GROUPS, if kernelpages::moe::sm90::TALL_DW_DISPATCHED { ", and dW the same way by its K rows a group" } else { "" }),
        implementation: IMPLEMENTATION.into(),
    },
    DispatchRule {
        entry_point: "moe::cuda::GroupedKernel::for_shape".into(),
        device: "CUDA, compute capability 8.0 or newer (other than 9.0)".into(),
        dtype: "bf16 (float32 accumulation)".into(),
        rule: "always: the portable kernel (grouped_gemm.cu), as grouped_mma_sync".into(),
        implementation: IMPLEMENTATION.into(),
    },
    DispatchRule {
        entry_point: "moe::dispatch_cuda::MoeDispatch::route, plan, dispatch, combine (and their backwards)".into(),
        device: "CUDA, compute capability 8.0 or newer".into(),
        dtype: "float32 router logits and gate weights; bf16 rows (the combine sums in float32 and rounds once)".into(),
        rule: format!(
            "always: top-k routing, one warp per token (at most {} experts, top_k at most {}; a token's experts by decreasing logit, ties to the lower index), its gates the softmax over the chosen logits (Mixtral) or their sigmoids divided by their sum (DeepSeek-V3); the plan, a stable counting sort of the assignments by expert in chunks of {} (dropless, or at most a capacity per expert, the later assignments in token order dropped); the gather of each kept assignment's row into expert order, no one-hot product; the combine, each token's kept rows times their gate weights; the backward runs through the plan's inverse",
            kernelpages::moe::dispatch_cuda::MAX_EXPERTS,
            kernelpages::moe::dispatch_cuda::MAX_TOP_K,
            kernelpages::moe::dispatch_cuda::CHUNK
        ),
        implementation: "moe_dispatch".into(),
    },
    DispatchRule {
        entry_point: "moe::layer_cuda::MoeLayer::forward".into(),
        device: "CUDA, compute capability 8.0 or newer".into(),
        dtype: "bf16 activations and weights (float32 accumulation; bf16 between the steps)".into(),
        rule: "always: the router's GEMM on the portable kernel (N = E), softmax or sigmoid top-k, a stable counting sort by expert into the dispatch plan, the gather, the experts' gate and up projections as one grouped GEMM of [E, H, 2F] weights and the down projection as another (each on the dispatch above for its K × N), SwiGLU between them, and the gate-weighted combine".into(),
        implementation: LAYER_IMPLEMENTATION.into(),
    },
    DispatchRule {
        entry_point: "moe::layer_cuda::MoeLayer::backward_into".into(),
        device: "CUDA, compute capability 8.0 or newer".into(),
        dtype: "bf16 activations, weights and gradients (float32 accumulation; bf16 between the steps)".into(),
        rule: "always, from the forward's saved routing, plan and activations: the combine's backward through the plan's inverse (each kept row's gradient and each gate weight's), the down projection's dX and dW and then gate and up's (the grouped GEMMs above), SwiGLU's backward between them, the gates' backward to the router's logits, the router GEMM's dX and dW on the portable kernel, and the gather's backward summing each token's rows onto the router's share of dx".into(),
        implementation: LAYER_IMPLEMENTATION.into(),
    },
    DispatchRule {
        entry_point: "moe::cuda::GroupedGemm::launch".into(),
        device: "CUDA, compute capability 8.0 or newer".into(),
        dtype: "bf16 (float32 accumulation)".into(),
        rule: "always: one launch over every expert's rows whatever their sizes (empty experts included), a persistent grid of 2 blocks per SM taking 128 × 128 output tiles in turn, bands of 8 row tiles per column step; mma.sync m16n8k16 from 4 cp.async stages of 32 along the reduction; dX and dW the same kernel with the weights read transposed and the reduction over each expert's rows".into(),
        implementation: PORTABLE.into(),
    }]
}

/// The document's throughputs: TFLOP/s on the GPU, GFLOP/s on the CPU, and tokens per second.
fn throughput_decls(device: DeviceChoice) -> Vec<Throughput> {
    let flops = if device == DeviceChoice::Gpu {
        Throughput {
            key: "tflops".into(),
            unit: "TFLOP/s".into(),
            count: Count::Flops,
            per_second: 1e12,
            ceiling: None,
        }
    } else {
        Throughput {
            key: "gflops".into(),
            unit: "GFLOP/s".into(),
            count: Count::Flops,
            per_second: 1e9,
            ceiling: None,
        }
    };
    vec![
        flops,
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

/// True for a whole-layer case (`op = layer`).
fn is_layer(p: &Params) -> bool {
    matches!(p.get("op"), Some(Param::Text(op)) if op == layer_case::OP)
}

fn layer_case_of(p: &Params) -> Result<LayerCase> {
    LayerCase::from_params(p).map_err(anyhow::Error::msg)
}

/// Whether `c` is one of [`TARGETS`].
fn is_target(c: &GroupedCase) -> bool {
    TARGETS.contains(&(c.experts, c.top_k, c.hidden, c.width, c.tokens))
}

/// The layer's description for a case's (experts, top_k, hidden, width) (its row of
/// [`LAYERS`]).
fn layer_name(shape: (usize, usize, usize, usize)) -> Option<&'static str> {
    LAYERS
        .iter()
        .find(|l| (l.0, l.1, l.2, l.3) == shape)
        .map(|l| l.4)
}

impl runner::Suite for Moe {
    fn suite(&self) -> Suite {
        Suite::Moe
    }

    /// x, w (and dY) uniform in [−1, 1) in bf16 ([`files::uniform_bf16`]) and the float64
    /// references of the checked elements.
    /// A whole-layer case: [`layer_case::write_case`] (its inputs route every token alike in
    /// every implementation).
    fn prepare(&self, p: &Params, seed: u64, dir: &Path) -> Result<CaseFiles> {
        if is_layer(p) {
            return layer_case::write_case(&layer_case_of(p)?, seed, self.check_rows, dir);
        }
        files::write_case(&case_of(p)?, seed, self.check_rows, dir)
    }

    fn unsupported(&self, p: &Params, _implementation: &str) -> Option<String> {
        if is_layer(p) {
            return layer_case_of(p).err().map(|e| format!("{e:#}"));
        }
        case_of(p).err().map(|e| format!("{e:#}"))
    }

    /// The layer's implementations run the `op = layer` cases, the others the grouped GEMM's.
    fn applies(&self, p: &Params, implementation: &str) -> bool {
        is_layer(p) == LAYER_IMPLEMENTATIONS.contains(&implementation)
    }

    fn is_default(&self, _p: &Params, implementation: &str) -> bool {
        implementation == IMPLEMENTATION
            || implementation == CPU_IMPLEMENTATION
            || implementation == LAYER_IMPLEMENTATION
    }

    fn notes(&self, p: &Params, implementation: &str) -> Vec<String> {
        if is_layer(p) {
            let Ok(c) = layer_case_of(p) else {
                return Vec::new();
            };
            let mut notes = vec![format!(
                "router: {} · I on each token's first {} features (a random permutation of the levels 0, 1/E, …), 0 elsewhere: logits exact and distinct, so every implementation routes alike; softmax top-{}, dropless",
                layer_case::ROUTER_SCALE,
                c.experts,
                c.top_k
            )];
            if let Some(name) = layer_name((c.experts, c.top_k, c.hidden, c.width)) {
                notes.push(format!("layer: {name}"));
            }
            if c.backward {
                notes.push("fwd+bwd: the forward, then the gradients of x and of every weight from the output's dy; dx, dW_gate_up and dW_down are checked, the router's weight gradient is computed but not checked (its float64 reference needs every token's expert outputs)".into());
            }
            return notes;
        }
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
        if let Some(name) = layer_name((c.experts, c.top_k, c.hidden, c.width)) {
            notes.push(format!("layer: {name}"));
        }
        if is_target(&c) {
            notes.push(format!(
                "the issue's target point: M = {} rows, K = {}, N = {}",
                c.rows(),
                c.hidden,
                c.width
            ));
        }
        if (implementation == IMPLEMENTATION || implementation == PORTABLE) && c.backward {
            notes.push("fwd+bwd: the forward, dX and dW, three launches".into());
        }
        if implementation == CUBLAS_LOOP {
            let busy = counts.iter().filter(|&&n| n > 0).count();
            notes.push(if c.backward {
                format!("a loop in this process of cublasGemmEx calls, bf16 with float32 accumulation: {} GEMMs ({busy} non-empty experts × 3: Y, dX, dW) and {empty} memsets (an empty expert's dW); group sizes read on the host", 3 * busy)
            } else {
                format!("a loop in this process of cublasGemmEx calls, bf16 with float32 accumulation: {busy} GEMMs, one per non-empty expert; group sizes read on the host")
            });
        }
        if implementation == CPU_IMPLEMENTATION {
            let bf16 = moe_cpu_bf16::runs(c.hidden, c.width);
            notes.push(if bf16 {
                "bf16 operands multiplied as they are (AVX-512 BF16, vdpbf16ps), float32 accumulation and results (PyTorch's and the GPU rows' are bf16, so their error against float64 includes the output's rounding); the weights packed once when loaded (and their transpose for dX), outside the timed call, as a library packs parameters; dW's operands (x_eᵀ, dY_e) packed inside it".into()
            } else {
                "float32 results (PyTorch's and the GPU rows' are bf16, so their error against float64 includes the output's rounding); the operands' bf16 values decoded to float32 when loaded, outside the timed call (this CPU has no AVX-512 BF16)".into()
            });
        }
        notes
    }

    fn label(&self, p: &Params) -> String {
        if let Ok(c) = layer_case_of(p) {
            return format!(
                "layer {} T{} E{} k{} {}x{}",
                if c.backward { "fwd+bwd" } else { "fwd" },
                c.tokens,
                c.experts,
                c.top_k,
                c.hidden,
                c.width
            );
        }
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
    let own: &[(&str, &str)] = match cli.run.device {
        DeviceChoice::Gpu => &[
            (IMPLEMENTATION, "kernelpages"),
            (PORTABLE, "kernelpages"),
            (LAYER_IMPLEMENTATION, "kernelpages"),
            (CUBLAS_LOOP, "cuBLAS"),
        ],
        DeviceChoice::Cpu => &[(CPU_IMPLEMENTATION, "kernelpages")],
    };
    let imps = runner::implementations(own, &ALTERNATIVES, &cli.run.compare)?;
    let cases = cli.run.select(cases(cli, false)?, cases(cli, true)?)?;
    let declared = Declared {
        runner: "moe",
        flop_rule: Some(FLOP_RULE.into()),
        dispatch: dispatch_rules(cli.run.device),
        axes: vec!["tokens".into()],
        throughput: throughput_decls(cli.run.device),
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

/// x, w and (with the backward) dY on the device from the runner's host tensors.
fn upload_set(gpu: &Gpu, host: &[Vec<u16>], backward: bool) -> Result<Set, GpuError> {
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
        dy: if backward { Some(up(2)?) } else { None },
    })
}

/// A device copy of an input set (the rotation of inputs larger than L2).
fn replicate_set(gpu: &Gpu, set: &Set) -> Result<Set, GpuError> {
    Ok(Set {
        x: gpu.stream.clone_dtod(&set.x)?,
        w: gpu.stream.clone_dtod(&set.w)?,
        dy: match &set.dy {
            Some(d) => Some(gpu.stream.clone_dtod(d)?),
            None => None,
        },
    })
}

/// dX and dW among a case's outputs (with the backward).
type Grads<'a> = Option<(&'a mut CudaSlice<u16>, &'a mut CudaSlice<u16>)>;

/// The runner's output buffers of a grouped-GEMM case: Y, and with the backward dX and dW.
///
/// # Errors
/// [`GpuError::Config`] when their number is not the case's (1, or 3 with the backward).
fn case_outputs(
    outs: &mut [CudaSlice<u16>],
    backward: bool,
) -> Result<(&mut CudaSlice<u16>, Grads<'_>), GpuError> {
    let n = outs.len();
    match (outs, backward) {
        ([y], false) => Ok((y, None)),
        ([y, dx, dw], true) => Ok((y, Some((dx, dw)))),
        _ => Err(GpuError::Config(format!(
            "{n} output buffers; the case writes {}",
            if backward { 3 } else { 1 }
        ))),
    }
}

/// `grouped_matmul` or `grouped_mma_sync` on one case, as the shared GPU case process drives
/// it: the kernel writes the runner's outputs directly (Y, then dX and dW).
struct Launch {
    gg: GroupedKernel,
    case: GroupedCase,
    offsets: CudaSlice<i32>,
}

impl own::Launcher for Launch {
    type Set = Set;
    fn upload(&self, gpu: &Gpu, host: &[Vec<u16>]) -> Result<Set, GpuError> {
        upload_set(gpu, host, self.case.backward)
    }
    fn replicate(&self, gpu: &Gpu, set: &Set) -> Result<Set, GpuError> {
        replicate_set(gpu, set)
    }
    fn launch(
        &mut self,
        gpu: &Gpu,
        set: &Set,
        outs: &mut [CudaSlice<u16>],
    ) -> Result<(), GpuError> {
        let c = &self.case;
        let (m, k, n) = (c.rows(), c.hidden, c.width);
        let (y, grads) = case_outputs(outs, c.backward)?;
        self.gg.launch(
            gpu,
            Product::Forward,
            &set.x,
            &set.w,
            y,
            &self.offsets,
            m,
            k,
            n,
        )?;
        if let (Some(dy), Some((dx, dw))) = (&set.dy, grads) {
            self.gg
                .launch(gpu, Product::Dx, dy, &set.w, dx, &self.offsets, m, k, n)?;
            self.gg
                .launch(gpu, Product::Dw, &set.x, dy, dw, &self.offsets, m, k, n)?;
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

/// `cublas_loop` on one case: [`CublasLoop`] writing the runner's outputs (Y, then dX and dW).
struct CublasLaunch {
    blas: CublasLoop,
    case: GroupedCase,
    offsets: Vec<usize>,
}

impl own::Launcher for CublasLaunch {
    type Set = Set;
    fn upload(&self, gpu: &Gpu, host: &[Vec<u16>]) -> Result<Set, GpuError> {
        upload_set(gpu, host, self.case.backward)
    }
    fn replicate(&self, gpu: &Gpu, set: &Set) -> Result<Set, GpuError> {
        replicate_set(gpu, set)
    }
    fn launch(
        &mut self,
        gpu: &Gpu,
        set: &Set,
        outs: &mut [CudaSlice<u16>],
    ) -> Result<(), GpuError> {
        let c = &self.case;
        let (k, n) = (c.hidden, c.width);
        let (y, grads) = case_outputs(outs, c.backward)?;
        self.blas
            .forward(gpu, &set.x, &set.w, y, &self.offsets, k, n)?;
        if let (Some(dy), Some((dx, dw))) = (&set.dy, grads) {
            self.blas
                .backward(gpu, &set.x, &set.w, dy, dx, dw, &self.offsets, k, n)?;
        }
        Ok(())
    }
    fn temporary_bytes(&self) -> u64 {
        0
    }
    fn residual_bytes(&self) -> Option<u64> {
        // The backward reads x and w, the forward's inputs; nothing else is kept.
        self.case.backward.then_some(0)
    }
    fn workspace_bytes(&self) -> u64 {
        cublas::WORKSPACE_BYTES as u64
    }
}

/// The case process for `cublas_loop`: the group sizes from the case's arguments, on the host.
fn measure_cublas(job: &Job) -> Reply {
    let (case, counts) = match job_case(job) {
        Ok(x) => x,
        Err(e) => return Reply::failed(job, Status::Error, format!("{e:#}")),
    };
    let offsets = kernelpages::moe::reference::offsets_of(&counts);
    let mut reply = own::measure(job, |gpu| {
        Ok((
            CublasLaunch {
                blas: CublasLoop::new(gpu)?,
                case: case.clone(),
                offsets,
            },
            0.0,
        ))
    });
    // Nothing is compiled: cuBLAS's kernels ship built (the handle's creation is not a
    // compile, and the column would not mean what it means for the NVRTC rows).
    reply.row.compile_s = None;
    reply
}

/// One CPU input set: x, w (and dY) decoded to float32, or on a CPU with AVX-512 BF16 (K and N
/// even) x's and dY's bf16 bits with w packed for the bf16 kernels (and, with the backward, wᵀ).
enum CpuSet {
    F32 {
        x: Vec<f32>,
        w: Vec<f32>,
        dy: Vec<f32>,
    },
    Bf16 {
        x: Vec<u16>,
        dy: Vec<u16>,
        w: std::sync::Arc<moe_cpu_bf16::PackedWeights>,
        wt: Option<std::sync::Arc<moe_cpu_bf16::PackedWeights>>,
    },
}

/// `cpu_grouped` on one case, as the shared CPU case process drives it.
struct CpuLaunch {
    case: GroupedCase,
    offsets: Vec<usize>,
    y: Vec<f32>,
    dx: Vec<f32>,
    dw: Vec<f32>,
}

impl CpuLaunch {
    /// Whether the products run on bf16 operands ([`moe_cpu_bf16`]): a CPU with AVX-512 BF16,
    /// K and N even.
    fn bf16(&self) -> bool {
        moe_cpu_bf16::runs(self.case.hidden, self.case.width)
    }
}

impl host::Launcher for CpuLaunch {
    type Set = CpuSet;
    fn load(&self, inputs: &[TensorFile]) -> Result<CpuSet> {
        let read_bits = |k: usize| -> Result<Vec<half::bf16>> {
            match inputs.get(k) {
                Some(t) => {
                    anyhow::ensure!(
                        t.dtype == "bf16",
                        "input {} is {}, expected bf16",
                        t.name,
                        t.dtype
                    );
                    read_elements(&t.path)
                }
                None => Ok(Vec::new()),
            }
        };
        let (x, w, dy) = (read_bits(0)?, read_bits(1)?, read_bits(2)?);
        if !self.bf16() {
            let f32s = |v: &[half::bf16]| v.iter().map(|b| b.to_f32()).collect::<Vec<f32>>();
            return Ok(CpuSet::F32 {
                x: f32s(&x),
                w: f32s(&w),
                dy: f32s(&dy),
            });
        }
        let bits = |v: &[half::bf16]| v.iter().map(|b| b.to_bits()).collect::<Vec<u16>>();
        let c = &self.case;
        let wb = bits(&w);
        let packed = moe_cpu_bf16::PackedWeights::new(&wb, c.experts, c.hidden, c.width);
        let wt = c.backward.then(|| {
            std::sync::Arc::new(moe_cpu_bf16::PackedWeights::transposed(
                &wb, c.experts, c.hidden, c.width,
            ))
        });
        Ok(CpuSet::Bf16 {
            x: bits(&x),
            dy: bits(&dy),
            w: std::sync::Arc::new(packed),
            wt,
        })
    }
    fn replicate(&self, set: &CpuSet) -> CpuSet {
        match set {
            CpuSet::F32 { x, w, dy } => CpuSet::F32 {
                x: x.clone(),
                w: w.clone(),
                dy: dy.clone(),
            },
            // The packed weights are shared (read-only, as a library's parameters), x and dY
            // copied.
            CpuSet::Bf16 { x, dy, w, wt } => CpuSet::Bf16 {
                x: x.clone(),
                dy: dy.clone(),
                w: std::sync::Arc::clone(w),
                wt: wt.clone(),
            },
        }
    }
    fn poison(&mut self) {
        self.y.fill(f32::NAN);
        self.dx.fill(f32::NAN);
        self.dw.fill(f32::NAN);
    }
    fn call(&mut self, set: &CpuSet) -> Result<()> {
        let (k, n) = (self.case.hidden, self.case.width);
        match set {
            CpuSet::F32 { x, w, dy } => {
                moe_cpu::grouped_matmul_f32(x, w, &self.offsets, k, n, &mut self.y);
                if self.case.backward {
                    moe_cpu::grouped_matmul_backward_f32(
                        x,
                        w,
                        dy,
                        &self.offsets,
                        k,
                        n,
                        &mut self.dx,
                        &mut self.dw,
                    );
                }
            }
            CpuSet::Bf16 { x, dy, w, wt } => {
                moe_cpu_bf16::grouped_matmul_bf16(x, w, &self.offsets, &mut self.y);
                if let Some(wt) = wt {
                    moe_cpu_bf16::grouped_matmul_backward_bf16(
                        x,
                        wt,
                        dy,
                        &self.offsets,
                        &mut self.dx,
                        &mut self.dw,
                    );
                }
            }
        }
        Ok(())
    }
    fn value(&self, i: usize) -> f64 {
        f64::from(self.y[i])
    }
    fn output_len(&self) -> usize {
        self.y.len()
    }
    fn gradient_value(&self, k: usize, i: usize) -> f64 {
        match k {
            0 => f64::from(self.dx[i]),
            1 => f64::from(self.dw[i]),
            _ => f64::NAN,
        }
    }
    fn gradient_len(&self, k: usize) -> usize {
        match k {
            0 => self.dx.len(),
            1 => self.dw.len(),
            _ => 0,
        }
    }
    fn temporary_bytes(&self) -> u64 {
        0
    }
}

/// The job's case and its group counts (the case's arguments, so that every implementation
/// splits the rows alike).
///
/// # Errors
/// A case that does not parse, or arguments without `counts`.
fn job_case(job: &Job) -> Result<(GroupedCase, Vec<usize>)> {
    Ok((case_of(&job.case)?, files::counts_of(&job.files.arguments)?))
}

/// The case process for `cpu_grouped`: the group counts from the case's arguments.
fn measure_cpu(job: &Job) -> Reply {
    let (case, counts) = match job_case(job) {
        Ok(x) => x,
        Err(e) => return Reply::failed(job, Status::Error, format!("{e:#}")),
    };
    let offsets = kernelpages::moe::reference::offsets_of(&counts);
    let (m, k, n, e) = (case.rows(), case.hidden, case.width, case.experts);
    let grads = case.backward;
    host::measure(job, || {
        Ok(CpuLaunch {
            offsets,
            y: vec![0.0; m * n],
            dx: vec![0.0; if grads { m * k } else { 0 }],
            dw: vec![0.0; if grads { e * k * n } else { 0 }],
            case: case.clone(),
        })
    })
}

/// The case process for `grouped_matmul` (the dispatch) and `grouped_mma_sync`: the group
/// counts from the case's arguments; the row notes the kernel that ran.
fn measure_gpu(job: &Job) -> Reply {
    if job.implementation != IMPLEMENTATION && job.implementation != PORTABLE {
        return Reply::failed(
            job,
            Status::Error,
            format!("unknown implementation `{}`", job.implementation),
        );
    }
    let (case, counts) = match job_case(job) {
        Ok(x) => x,
        Err(e) => return Reply::failed(job, Status::Error, format!("{e:#}")),
    };
    let mut kernel = None;
    let mut reply = own::measure(job, |gpu| {
        let gg = if job.implementation == PORTABLE {
            GroupedKernel::named(gpu, PORTABLE, case.experts, Dtype::Bf16)?
        } else {
            GroupedKernel::for_shape(gpu, case.experts, case.hidden, case.width, Dtype::Bf16)?
        };
        kernel = Some(gg.implementation());
        let compile_s = gg.compile_s();
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
    });
    if let (Some(k), true) = (kernel, job.implementation == IMPLEMENTATION) {
        reply.row.notes.push(format!("kernel: {k}"));
    }
    reply
}

/// One input set of the layer on the device: x, the weights and (with the backward) dy.
struct LayerSet {
    x: CudaSlice<u16>,
    w: DeviceExperts,
    dy: Option<CudaSlice<u16>>,
}

/// `moe_layer` on one case: [`MoeLayer::forward_into`] writing the runner's output and, with
/// the backward, [`MoeLayer::backward_into`] its dx, dW_gate_up and dW_down (the router's
/// gradient into a buffer of its own, computed but not among the checked outputs).
struct LayerLaunch {
    layer: MoeLayer,
    case: LayerCase,
    router_offsets: CudaSlice<i32>,
    router_grad: Option<CudaSlice<u16>>,
}

impl LayerLaunch {
    /// Tokens T, experts E, hidden H, width F and routed rows M = T·top_k, as byte-count
    /// factors.
    fn sizes(&self) -> (u64, u64, u64, u64, u64) {
        let c = &self.case;
        let t = c.tokens as u64;
        (
            t,
            c.experts as u64,
            c.hidden as u64,
            c.width as u64,
            t * c.top_k as u64,
        )
    }
}

impl own::Launcher for LayerLaunch {
    type Set = LayerSet;
    fn upload(&self, gpu: &Gpu, host: &[Vec<u16>]) -> Result<LayerSet, GpuError> {
        let c = &self.case;
        let (x, router, gate_up, down, dy) = match (host, c.backward) {
            ([x, router, gate_up, down], false) => (x, router, gate_up, down, None),
            ([x, router, gate_up, down, dy], true) => (x, router, gate_up, down, Some(dy)),
            _ => {
                return Err(GpuError::Config(format!(
                    "{} input tensors; the layer takes x, router, gate_up, down{}",
                    host.len(),
                    if c.backward { ", dy" } else { "" }
                )))
            }
        };
        let up = |v: &Vec<u16>| gpu.stream.clone_htod(v);
        Ok(LayerSet {
            dy: dy.map(up).transpose()?,
            x: up(x)?,
            w: DeviceExperts {
                experts: c.experts,
                hidden: c.hidden,
                width: c.width,
                router: up(router)?,
                gate_up: up(gate_up)?,
                down: up(down)?,
            },
        })
    }
    fn replicate(&self, gpu: &Gpu, set: &LayerSet) -> Result<LayerSet, GpuError> {
        let cp = |v: &CudaSlice<u16>| gpu.stream.clone_dtod(v);
        Ok(LayerSet {
            dy: set.dy.as_ref().map(cp).transpose()?,
            x: cp(&set.x)?,
            w: DeviceExperts {
                experts: set.w.experts,
                hidden: set.w.hidden,
                width: set.w.width,
                router: cp(&set.w.router)?,
                gate_up: cp(&set.w.gate_up)?,
                down: cp(&set.w.down)?,
            },
        })
    }
    fn launch(
        &mut self,
        gpu: &Gpu,
        set: &LayerSet,
        outs: &mut [CudaSlice<u16>],
    ) -> Result<(), GpuError> {
        let c = &self.case;
        let n = outs.len();
        let (out, grads) = match (outs, &set.dy, &mut self.router_grad) {
            ([out], None, _) => (out, None),
            ([out, dx, gate_up, down], Some(dy), Some(router)) => {
                (out, Some((dy, [dx, router, gate_up, down])))
            }
            _ => {
                return Err(GpuError::Config(format!(
                    "{n} output buffers; the layer writes {}",
                    if c.backward { 4 } else { 1 }
                )))
            }
        };
        let state = self.layer.forward_into(
            gpu,
            &set.x,
            c.tokens,
            &set.w,
            (c.top_k, Gate::Softmax, None),
            &self.router_offsets,
            out,
        )?;
        if let Some((dy, bufs)) = grads {
            self.layer.backward_into(
                gpu,
                &set.x,
                &set.w,
                &state,
                &self.router_offsets,
                dy,
                bufs,
            )?;
        }
        Ok(())
    }
    fn temporary_bytes(&self) -> u64 {
        // Used where the device has no memory pool: the intermediates between the launches
        // (logits in bf16 and float32, the routing, the dispatched rows, gate and up, the
        // activation, the experts' outputs), the plan's small arrays apart.
        let c = &self.case;
        let (t, e, h, f, m) = self.sizes();
        if !c.backward {
            return t * e * 6 + m * 8 + 2 * (m * h + m * 2 * f + m * f + m * h);
        }
        // With the backward the forward's intermediates are residuals (below) but for its
        // bf16 logits; then the backward's: dY's rows and the gates' gradient, dact, dgu, the
        // rows' dx, the logits' gradient and the router's dx.
        t * e * 2 + 2 * (m * h + m * f + m * 2 * f + m * h) + m * 4 + t * e * 2 + t * h * 2
    }
    fn residual_bytes(&self) -> Option<u64> {
        // What the forward keeps for the backward (`LayerState`): the float32 logits, the
        // routing and plan, the dispatched rows, gate and up, the activation, the experts'
        // outputs.
        let c = &self.case;
        let (t, e, h, f, m) = self.sizes();
        c.backward
            .then_some(t * e * 4 + m * 16 + 2 * (m * h + m * 2 * f + m * f + m * h))
    }
    fn workspace_bytes(&self) -> u64 {
        // The router's weight gradient (fwd+bwd): allocated once, held across calls.
        self.router_grad.as_ref().map_or(0, |g| 2 * g.len() as u64)
    }
}

/// The case process for `moe_layer`: the layer compiled for the case's shape (the experts'
/// GEMMs on the dispatch's kernel, noted in the row).
fn measure_layer(job: &Job) -> Reply {
    let case = match layer_case_of(&job.case) {
        Ok(c) => c,
        Err(e) => return Reply::failed(job, Status::Error, format!("{e:#}")),
    };
    let mut kernel = None;
    let mut reply = own::measure(job, |gpu| {
        let layer = MoeLayer::new(gpu, case.experts, case.hidden, case.width)?;
        kernel = Some(layer.experts_kernel());
        let compile_s = layer.compile_s;
        let router_offsets = MoeLayer::router_offsets(gpu, case.tokens)?;
        let router_grad = if case.backward {
            Some(gpu.stream.alloc_zeros::<u16>(case.hidden * case.experts)?)
        } else {
            None
        };
        Ok((
            LayerLaunch {
                layer,
                case: case.clone(),
                router_offsets,
                router_grad,
            },
            compile_s,
        ))
    });
    if let Some(k) = kernel {
        reply.row.notes.push(format!(
            "in order: the router's GEMM (grouped_mma_sync, one group), its logits to float32, softmax top-k, the plan (a counting sort by expert), the dispatch (gather), gate and up as one grouped GEMM ({k}), SwiGLU, down ({k}), the combine"
        ));
        if case.backward {
            reply.row.notes.push(format!(
                "backward, in order: the combine's (each kept row's dY and each gate weight's gradient, through the plan's inverse), down's dX and dW ({k}), SwiGLU's, gate and up's dX and dW ({k}), the gates' (softmax), the router's dX and dW (grouped_mma_sync), the gather's (each token's rows summed onto the router's dx)"
            ));
        }
    }
    reply
}

#[cfg(test)]
mod tests {
    use super::*;
    use kernelpages::runner::Suite as _;

    #[test]
    fn the_grid_and_its_selection() {
        let cli = Cli::try_parse_from(["moe"]).unwrap();
        let all = cases(&cli, false).unwrap();
        assert_eq!(
            all.len(),
            LAYERS.len() * (2 * (FWD_TOKENS.len() + BWD_TOKENS.len()) + 2 * LAYER_TOKENS.len())
                + 2 * 2 * TARGETS.len()
        );
        let suite = Moe { check_rows: 8 };
        let (layers, grouped): (Vec<&Params>, Vec<&Params>) = all.iter().partition(|p| is_layer(p));
        assert_eq!(layers.len(), 2 * LAYERS.len() * LAYER_TOKENS.len());
        let backward = layers
            .iter()
            .filter(|p| layer_case_of(p).unwrap().backward)
            .count();
        assert_eq!(backward, LAYERS.len() * LAYER_TOKENS.len());
        for p in &layers {
            let c = layer_case_of(p).unwrap();
            assert!(layer_name((c.experts, c.top_k, c.hidden, c.width)).is_some());
            // Only the layer's implementations measure a layer case, and they nothing else.
            assert!(suite.applies(p, LAYER_IMPLEMENTATION));
            assert!(suite.applies(p, "torch_layer_compile"));
            assert!(!suite.applies(p, IMPLEMENTATION) && !suite.applies(p, "torch_grouped_mm"));
            assert!(suite.is_default(p, LAYER_IMPLEMENTATION));
        }
        let mut targets = 0;
        for p in grouped {
            let c = case_of(p).unwrap();
            if is_target(&c) {
                // M = 16384 rows of K = 2048, N = 1408.
                assert_eq!((c.rows(), c.hidden, c.width), (16384, 2048, 1408));
                targets += 1;
            } else {
                assert!(layer_name((c.experts, c.top_k, c.hidden, c.width)).is_some());
            }
            assert!(suite.applies(p, IMPLEMENTATION) && suite.applies(p, "torch_dense"));
            assert!(!suite.applies(p, LAYER_IMPLEMENTATION));
            // K and N are multiples of 64: the dispatch runs the wgmma kernel on sm_90a.
            assert!(kernelpages::moe::sm90::takes(
                "sm_90a", c.experts, c.hidden, c.width
            ));
        }
        assert_eq!(targets, 2 * 2 * TARGETS.len());
        let quick = Cli::try_parse_from(["moe", "--quick", "--filter", "experts=64"]).unwrap();
        let kept = quick
            .run
            .select(cases(&quick, false).unwrap(), cases(&quick, true).unwrap())
            .unwrap();
        // One token count, balanced and skewed, fwd and fwd+bwd; the layer's forward and its
        // forward and backward.
        assert_eq!(kept.len(), 6);
        // The CPU grid: the three layers of small or square experts at its two token counts.
        let cpu = Cli::try_parse_from(["moe", "--device", "cpu"]).unwrap();
        let cpu_cases = cases(&cpu, false).unwrap();
        assert_eq!(
            cpu_cases.len(),
            (LAYERS.len() - 1) * 2 * 2 * CPU_TOKENS.len()
        );
        assert!(cpu_cases
            .iter()
            .all(|p| case_of(p).unwrap().width != CPU_SKIP_WIDTH));
        assert_eq!(
            dispatch_rules(DeviceChoice::Cpu)[0].implementation,
            CPU_IMPLEMENTATION
        );
    }
}
