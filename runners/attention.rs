//! `attention`: measures the attention grid for the project's kernels (`flash`, the default,
//! and `math`) and, with `--compare torch,jax`, PyTorch's SDPA backends (`runners/compare/
//! torch_sdpa.py`) and `jax.nn.dot_product_attention` (`runners/compare/jax_attention.py`),
//! and writes one suite document. `--device cpu` measures the CPU instead
//! (`runners/attention/cpu.rs`: `cpu_flash` against PyTorch's CPU SDPA). The machinery
//! (processes, order, timing records, progress, document) is `kernelpages::runner`; this file
//! is the grid, the implementations, the dispatch table and the counts.
//!
//! Two grids (`--grids main,shapes`, the default): `main`, the square self-attention sweep over
//! seq_len, head dims and masks, forward and forward + backward; `shapes`, the shapes of issue 9
//! §2 (short and non-aligned lengths, decoding, cross-attention, GQA/MQA, head dims 32/96/256,
//! fp16 and fp32, scale 0.3, per-sequence key lengths), each forward and forward + backward.
//! `decode` (`runners/attention/decode.rs`) runs alone and writes a document of its own kind
//! (`config.kind = decode`, `data/gpu_attention_decode.json`): 1, 2 and 8 query rows against
//! KV caches of 4k to 128k keys, where the split-KV decoding kernels (`flash_decode`,
//! `flash_decode_paged`, `flash_decode_paged256`) run beside the others and rows carry GB/s.
//! A third, `tiles`, is the tile sweep behind the defaults: the flash kernel in each
//! configuration of `FWD_SWEEP` and `BWD_SWEEP`, the configuration a case parameter (`config`);
//! it runs alone (with `--implementations flash`) and writes a document of its own kind
//! (`config.kind = tile_sweep`, `data/gpu_attention_tiles.json`), which the site draws in the
//! Attention page's tile sweep section. The configurations of one shape share their inputs and
//! float64 reference, prepared once.
//!
//! ```text
//! attention --compare torch,jax --output data/gpu_attention.json
//! attention --quick --filter head_dim=128 --runs 2
//! attention --grids shapes --passes fwd
//! attention --grids tiles --implementations flash --output data/gpu_attention_tiles.json
//! attention --device cpu --compare torch --output data/cpu_attention.json
//! ```

#[path = "attention/cpu.rs"]
mod cpu;
#[path = "attention/decode.rs"]
mod decode;
#[path = "attention/flex.rs"]
mod flex;
#[path = "attention/masks.rs"]
mod masks;
use kernelpages::attention::sm90;

#[path = "attention/sm80.rs"]
mod sm80;

use std::path::Path;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::Parser;

use kernelpages::attention::cuda::{
    replicate, upload, BwdConfig, DeviceInputs, FlashConfig, Implementation, Runner, BWD_SWEEP,
    FLASH_HEAD_DIMS, FWD_SWEEP, MATH_FP32_NOTE,
};
use kernelpages::attention::decode_gpu::{self, DECODE_HEAD_DIMS};
use kernelpages::attention::flex::{
    sm90_backward_off, sm90_forward_off, FlexKernel, FLEX_BWD_KEYS, FLEX_BWD_ROWS, FLEX_HEAD_DIMS,
};
use kernelpages::attention::{cpu::Inputs, files, AttentionCase, Dtype, Pass};
use kernelpages::gpu::{Gpu, GpuError};
use kernelpages::runner::grid::Params;
use kernelpages::runner::protocol::CaseFiles;
use kernelpages::runner::{self, own, Alternative, Declared, DeviceChoice, RunnerArgs};
use kernelpages::schema::{DispatchRule, Param, RunKind, Suite};

/// Measure attention implementations on the GPU (or with --device cpu the CPU) and write a
/// suite document.
#[derive(Parser, Debug)]
#[command(
    name = "attention",
    version,
    about = "Measure attention implementations on the GPU (data/gpu_attention.json) or with --device cpu the CPU (data/cpu_attention.json) and write a suite document"
)]
struct Cli {
    #[command(flatten)]
    run: RunnerArgs,
    /// Implementations of this project to run [default: flash,math, and flash_sm80 on compute
    /// capability 9.0; with `--grids decode` math,flash_decode,flash_decode_paged,
    /// flash_decode_paged256; with
    /// `--grids masks` flex,flash; cpu_flash with --device cpu]. `flex` runs flex_attention (forward, and backward for fwd+bwd) with
    /// the case's mask: the masks grid's named modification, else causal or none. `flash` runs
    /// what the dispatch picks on the device (on compute capability 9.0 the wgmma forward for
    /// bf16 and fp16 at head_dim 64 and 128, and the wgmma backward for fwd+bwd); `flash_sm80` the
    /// portable kernels on those cases, measured on compute capability 9.0 only (`unsupported`
    /// elsewhere).
    #[arg(long, value_delimiter = ',')]
    implementations: Option<Vec<String>>,
    /// Grids to measure: `main` (the seq_len sweep), `shapes` (issue 9 §2's shapes), `decode`
    /// (1, 2, 8 query rows against caches of 4k to 128k keys, with the split-KV decoding
    /// implementations) and `tiles` (the flash configurations behind the defaults, seq_len
    /// 16384 or `--seq-lens`); `tiles` and `decode` run alone, each a document of its own kind
    /// [default: main,shapes; main with --device cpu].
    #[arg(long, value_delimiter = ',')]
    grids: Option<Vec<String>>,
    /// Passes: `fwd`, `fwd+bwd` [default: fwd,fwd+bwd].
    #[arg(long, value_delimiter = ',')]
    passes: Option<Vec<String>>,
    /// Main grid: batch size [default: 4; 2 with --device cpu].
    #[arg(long)]
    batch: Option<usize>,
    /// Main grid: query heads.
    #[arg(long, default_value_t = 8)]
    heads: usize,
    /// Main grid: key/value heads (defaults to --heads; fewer is GQA).
    #[arg(long)]
    kv_heads: Option<usize>,
    /// Main grid: head dimensions.
    #[arg(long, value_delimiter = ',', default_value = "64,128")]
    head_dims: Vec<usize>,
    /// Main grid: sequence lengths [default: 512,1024,2048,4096,8192,16384;
    /// 128,256,512,1024,2048 with --device cpu].
    #[arg(long, value_delimiter = ',')]
    seq_lens: Option<Vec<usize>>,
    /// Main grid: masks to run, `full`, `causal`.
    #[arg(long, value_delimiter = ',', default_value = "full,causal")]
    masks: Vec<String>,
    /// Main grid: element types, `bf16`, `fp16`, `fp32` [default: bf16; bf16,fp32 with
    /// --device cpu].
    #[arg(long, value_delimiter = ',')]
    dtypes: Option<Vec<String>>,
    /// Query rows (and key rows, for dK and dV) per checked slice for the float64 reference.
    #[arg(long, default_value_t = 256)]
    check_rows: usize,
    /// Flash forward configuration per head_dim, e.g. `64=v3w4m2b64,128=v3w4m2b32` (see
    /// `kernels/TUNING.md`); the defaults otherwise. A configuration names the portable
    /// kernel: on compute capability 9.0 flash then runs it instead of the wgmma forward (and
    /// backward) for that head_dim.
    #[arg(long)]
    flash_config: Option<String>,
    /// Flash backward configuration per head_dim, e.g. `128=w8r64`. A configuration names the
    /// portable kernels: on compute capability 9.0 flash's forward + backward then runs them
    /// instead of the wgmma forward and backward for that head_dim.
    #[arg(long)]
    flash_bwd_config: Option<String>,
    /// Masks grid: the modifications to run, by name (`none`, `causal`, `sliding_window(W)`,
    /// `document`, `prefix_lm(P)`, `alibi`, `softcap(C)`).
    #[arg(long, value_delimiter = ';', default_values = masks::MASKS)]
    flex_masks: Vec<String>,
}

/// The alternatives `--compare` can add.
const ALTERNATIVES: [Alternative; 3] = [
    Alternative {
        name: "torch",
        module: "torch_sdpa",
        library: "PyTorch",
        implementations: &[
            "torch_flash",
            "torch_cudnn",
            "torch_efficient",
            "torch_math",
        ],
    },
    Alternative {
        name: "jax",
        module: "jax_attention",
        library: "JAX",
        implementations: &["jax_xla", "jax_cudnn"],
    },
    Alternative {
        name: "torch_flex",
        module: "torch_flex",
        library: "PyTorch",
        implementations: &["torch_flex"],
    },
];

/// The GPU grids `--grids` runs by default (the tile sweep and the decoding grid are
/// documents of their own).
const GPU_GRIDS: [&str; 2] = ["main", "shapes"];

/// Seq lengths of the GPU main grid.
const SEQ_LENS: [usize; 6] = [512, 1024, 2048, 4096, 8192, 16384];
/// Seq lengths of the GPU `--quick` main grid.
const QUICK_SEQ_LENS: [usize; 2] = [512, 1024];

/// A list option's value, else the device's default.
fn or_default<T: Clone>(
    given: &Option<Vec<T>>,
    gpu: &[T],
    cpu: &[T],
    device: DeviceChoice,
) -> Vec<T> {
    given.clone().unwrap_or_else(|| match device {
        DeviceChoice::Gpu => gpu.to_vec(),
        DeviceChoice::Cpu => cpu.to_vec(),
    })
}

/// A list-of-names option's value, else the device's default.
fn names_or_default(
    given: &Option<Vec<String>>,
    gpu: &[&str],
    cpu: &[&str],
    device: DeviceChoice,
) -> Vec<String> {
    let d: Vec<String> = match device {
        DeviceChoice::Gpu => gpu,
        DeviceChoice::Cpu => cpu,
    }
    .iter()
    .map(|s| s.to_string())
    .collect();
    given.clone().unwrap_or(d)
}

fn on_cpu(cli: &Cli) -> bool {
    cli.run.device == DeviceChoice::Cpu
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match &cli.run.run_case {
        Some(job) => runner::child_main(job, |job| {
            if job.implementation == cpu::IMPLEMENTATION {
                cpu::measure(job)
            } else if decode::is_decode(&job.implementation) {
                decode::measure(job)
            } else if job.implementation == flex::IMPLEMENTATION {
                flex::measure(job)
            } else if job.implementation == sm80::IMPLEMENTATION {
                sm80::measure(job)
            } else {
                measure_own(job)
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

fn passes(cli: &Cli) -> Result<Vec<Pass>> {
    names_or_default(
        &cli.passes,
        &["fwd", "fwd+bwd"],
        &["fwd", "fwd+bwd"],
        cli.run.device,
    )
    .iter()
    .map(|p| Pass::parse(p).with_context(|| format!("--passes: unknown pass `{p}` (fwd, fwd+bwd)")))
    .collect()
}

fn mask(m: &str) -> Result<bool> {
    match m {
        "full" => Ok(false),
        "causal" => Ok(true),
        m => bail!("--masks: unknown mask `{m}` (full or causal)"),
    }
}

/// The main grid: dtypes × head dims × masks × seq_lens × passes, square self-attention.
fn main_cases(cli: &Cli, seq_lens: &[usize]) -> Result<Vec<AttentionCase>> {
    let mut cases = Vec::new();
    let dtypes = names_or_default(&cli.dtypes, &["bf16"], &cpu::DTYPES, cli.run.device);
    let batch = cli
        .batch
        .unwrap_or(if on_cpu(cli) { cpu::BATCH } else { 4 });
    for dt in &dtypes {
        let dtype = Dtype::parse(dt).with_context(|| format!("--dtypes: unknown dtype `{dt}`"))?;
        for &head_dim in &cli.head_dims {
            for m in &cli.masks {
                let causal = mask(m)?;
                for &seq_len in seq_lens {
                    for &pass in &passes(cli)? {
                        cases.push(AttentionCase {
                            kv_heads: cli.kv_heads.unwrap_or(cli.heads),
                            causal,
                            dtype,
                            pass,
                            ..AttentionCase::new(batch, cli.heads, seq_len, head_dim)
                        });
                    }
                }
            }
        }
    }
    Ok(cases)
}

/// The shapes of issue 9 §2, each in every pass of `--passes`; `quick` is a small subset
/// with the same kinds of shape at small sizes.
fn shape_cases(cli: &Cli, quick: bool) -> Result<Vec<AttentionCase>> {
    let mut v: Vec<AttentionCase> = Vec::new();
    let both = |c: AttentionCase| [c.clone(), AttentionCase { causal: true, ..c }];
    // Short and non-aligned lengths (batch 1, 24 heads, head_dim 64), with the aligned 4096
    // beside 4092 and 4097.
    let lens: &[usize] = if quick {
        &[1, 63, 65]
    } else {
        &[1, 7, 63, 65, 129, 192, 4092, 4096, 4097]
    };
    for &t in lens {
        v.extend(both(AttentionCase::new(1, 24, t, 64)));
    }
    // Decoding: 1 query against 20 keys, [4, 32, 1, 128] / [4, 32, 20, 128].
    v.extend(both(AttentionCase {
        seq_len_q: 1,
        seq_len_kv: 20,
        ..AttentionCase::new(4, 32, 1, 128)
    }));
    let t = if quick { 512 } else { 4096 };
    // GQA 32:8 and MQA 8:1.
    for (h, kvh) in [(32, 8), (8, 1)] {
        v.extend(both(AttentionCase {
            kv_heads: kvh,
            ..AttentionCase::new(4, h, t, 128)
        }));
    }
    // Head dims beside the main grid's.
    for d in [32, 96, 256] {
        v.extend(both(AttentionCase::new(4, 8, t, d)));
    }
    // fp16 and fp32.
    for dtype in [Dtype::F16, Dtype::F32] {
        v.extend(both(AttentionCase {
            dtype,
            ..AttentionCase::new(4, 8, t, 128)
        }));
    }
    // Softmax scale 0.3.
    v.push(AttentionCase {
        scale: Some(0.3),
        ..AttentionCase::new(4, 8, t, 128)
    });
    // Cross-attention: fewer queries than keys (both masks), and more (causal: the first
    // Tq − Tkv rows see no key).
    let (short, long) = (t / 4, t);
    v.extend(both(AttentionCase {
        seq_len_q: short,
        seq_len_kv: long,
        ..AttentionCase::new(4, 8, 1, 128)
    }));
    v.push(AttentionCase {
        seq_len_q: long,
        seq_len_kv: short,
        causal: true,
        ..AttentionCase::new(4, 8, 1, 128)
    });
    // Per-sequence key lengths, including 1 and 0.
    v.extend(both(AttentionCase {
        seq_len_q: short,
        seq_len_kv: long,
        kv_lens: Some(vec![long, long / 2, 1, 0]),
        ..AttentionCase::new(4, 8, 1, 128)
    }));
    let mut out = Vec::new();
    for c in v {
        for &pass in &passes(cli)? {
            out.push(AttentionCase { pass, ..c.clone() });
        }
    }
    Ok(out)
}

/// The case parameter selecting special inputs ([`files::OVERFLOW_INPUTS`]: Q = K = 24).
const INPUTS_PARAM: &str = "inputs";

/// Issue 9 §2's fp16 inputs whose raw dot products overflow fp16: B1 H8 T1024 head_dim 128
/// fp16, Q = K = 24 ([`files::write_overflow_case`]), not causal, forward only (when `--passes`
/// has it). Part of the shapes grid (not of its `--quick` version). Not forward + backward: with
/// every key equal, the exact dQ is 0 (each row of dS sums to 0), so a relative error of dQ
/// against float64 divides rounding noise by rounding noise.
fn overflow_cases(cli: &Cli) -> Result<Vec<Params>> {
    if !passes(cli)?.contains(&Pass::Fwd) {
        return Ok(Vec::new());
    }
    let mut p = AttentionCase {
        dtype: Dtype::F16,
        ..AttentionCase::new(1, 8, 1024, 128)
    }
    .params();
    p.insert(
        INPUTS_PARAM.into(),
        Param::Text(files::OVERFLOW_INPUTS.into()),
    );
    Ok(vec![p])
}

/// The cases of `--grids` (their `--quick` versions when `quick`), as document parameters.
fn cases(cli: &Cli, quick: bool) -> Result<Vec<Params>> {
    let mut cases = Vec::new();
    let grids = names_or_default(&cli.grids, &GPU_GRIDS, &["main"], cli.run.device);
    for g in &grids {
        match g.as_str() {
            "main" => {
                let seq_lens = if quick {
                    or_default(&None, &QUICK_SEQ_LENS, &cpu::QUICK_SEQ_LENS, cli.run.device)
                } else {
                    or_default(&cli.seq_lens, &SEQ_LENS, &cpu::SEQ_LENS, cli.run.device)
                };
                cases.extend(main_cases(cli, &seq_lens)?)
            }
            "shapes" => cases.extend(shape_cases(cli, quick)?),
            "decode" => {
                if !on_cpu(cli) {
                    cases.extend(decode::cases(quick))
                }
            }
            "tiles" | "masks" => {}
            g => bail!("--grids: unknown grid `{g}` (main, shapes, decode, masks, tiles)"),
        }
    }
    let mut params: Vec<Params> = cases.iter().map(AttentionCase::params).collect();
    // Grids that are documents of their own kind run alone.
    for (alone, what) in [
        ("tiles", "a tile sweep is a document of its own, data/gpu_attention_tiles.json"),
        (
            "decode",
            "decoding shapes are a document of their own, data/gpu_attention_decode.json, drawn in GB/s",
        ),
        (
            "masks",
            "the masks grid is a document of its own, data/gpu_attention_masks.json",
        ),
    ] {
        if grids.iter().any(|g| g == alone) && grids.iter().any(|g| g != alone) {
            let others: Vec<&str> = grids
                .iter()
                .filter(|g| *g != alone)
                .map(String::as_str)
                .collect();
            bail!(
                "--grids: `{alone}` runs alone ({what}), not with {}",
                others.join(", ")
            );
        }
    }
    if grids.iter().any(|g| g == "shapes") && !quick {
        params.extend(overflow_cases(cli)?);
    }
    if grids.iter().any(|g| g == "tiles") {
        params.extend(tile_cases(cli, quick)?);
    }
    if grids.iter().any(|g| g == "masks") && !on_cpu(cli) {
        params.extend(masks::cases(
            &cli.flex_masks,
            cli.seq_lens.as_deref(),
            &passes(cli)?,
            quick,
        )?);
    }
    Ok(params)
}

/// The kind of document `--grids` makes: a tile sweep for `tiles`, the decoding grid for
/// `decode`, else the grid.
fn run_kind(cli: &Cli) -> RunKind {
    match &cli.grids {
        Some(g) if g.iter().any(|g| g == "tiles") => RunKind::TileSweep,
        Some(g) if g.iter().any(|g| g == "decode") => RunKind::Decode,
        Some(g) if g.iter().any(|g| g == "masks") => RunKind::Masks,
        _ => RunKind::Grid,
    }
}

/// The case parameter naming a flash configuration in the tile sweep (`v3w4m2b64` for a
/// forward, `w8r32v` for a backward).
const CONFIG_PARAM: &str = kernelpages::schema::TILE_CONFIG_PARAM;

/// The tile sweep (issue 9 §4): every forward configuration of [`FWD_SWEEP`] (forward pass) and
/// every backward configuration of [`BWD_SWEEP`] (forward + backward, the forward in its
/// default configuration) that the head dim can run, at B4 H8, head_dim 64 and 128, both
/// masks, bf16, seq_len 16384 (or `--seq-lens`; 1024 with `--quick`). Each case carries its
/// configuration as the `config` parameter.
fn tile_cases(cli: &Cli, quick: bool) -> Result<Vec<Params>> {
    let seq_lens = if quick {
        vec![1024]
    } else {
        cli.seq_lens.clone().unwrap_or_else(|| vec![16384])
    };
    let mut out = Vec::new();
    for &head_dim in &[64, 128] {
        for causal in [false, true] {
            for &seq_len in &seq_lens {
                let base = AttentionCase {
                    causal,
                    ..AttentionCase::new(4, 8, seq_len, head_dim)
                };
                let mut push = |pass: Pass, name: &str| {
                    let mut p = AttentionCase {
                        pass,
                        ..base.clone()
                    }
                    .params();
                    p.insert(CONFIG_PARAM.into(), Param::Text(name.into()));
                    out.push(p);
                };
                for name in FWD_SWEEP {
                    push(Pass::Fwd, name);
                }
                for name in BWD_SWEEP {
                    let bc = BwdConfig::parse(name).map_err(anyhow::Error::msg)?;
                    if bc.check(head_dim).is_ok() {
                        push(Pass::FwdBwd, name);
                    }
                }
            }
        }
    }
    Ok(out)
}

/// The flash configurations a tile-sweep case names (forward, backward), `None` each for the
/// default.
fn case_configs(p: &Params) -> Result<(Option<FlashConfig>, Option<BwdConfig>)> {
    match p.get(CONFIG_PARAM) {
        None => Ok((None, None)),
        Some(Param::Text(s)) if s.starts_with("v3") => Ok((
            Some(FlashConfig::parse(s).map_err(anyhow::Error::msg)?),
            None,
        )),
        Some(Param::Text(s)) => Ok((None, Some(BwdConfig::parse(s).map_err(anyhow::Error::msg)?))),
        Some(other) => bail!("case parameter `config` must be text, got {other:?}"),
    }
}

/// The configuration name the default dispatch runs for `c` in the tile sweep's terms: the
/// forward's for a forward, the backward's for forward + backward.
fn default_config_name(c: &AttentionCase) -> Option<String> {
    match c.pass {
        Pass::Fwd => FlashConfig::for_head_dim(c.head_dim).ok().map(|f| f.name()),
        Pass::FwdBwd => BwdConfig::for_head_dim(c.head_dim).ok().map(|b| b.name()),
    }
}

/// The wgmma forward's choices that this process's environment can change
/// ([`sm90::PINGPONG_ENV`], [`sm90::PERSIST_ENV`], [`sm90::TAIL_ENV`]), in the dispatch rule's
/// words, so that a document measured with one of them set says what ran (the site reads the
/// rule's text: "taking turns to issue" for the ping-pong, "last wave" for the tail split).
struct HopperWords {
    /// The consumers' turns (the ping-pong), or what ran instead.
    turns: String,
    /// The non-causal grid: the tail split, or what ran instead.
    grid: String,
    /// The backward's non-causal grid: its tail split (with a leading `; `) where
    /// [`sm90::BwdEnv::tail_split`], else what ran instead.
    bwd_grid: String,
    /// The backward's queries per step at head_dim 128 ([`sm90::BwdEnv::wide`]).
    bwd_wide: (usize, usize),
    /// After the backward's query steps at head_dim 128: nothing for the default
    /// ([`sm90::BWD_WIDE_DEFAULT`]), else the [`sm90::BWD_BM_ENV`] setting that changed them.
    bwd_steps: String,
}

impl HopperWords {
    fn from_env() -> HopperWords {
        let env = sm90::FwdEnv::read();
        HopperWords::new(
            !env.pingpong,
            env.persistent,
            !env.tail_split,
            sm90::BwdEnv::read(),
        )
    }

    /// The words for the ping-pong turned off, the persistent grid on and the tail split off,
    /// and the backward's settings `bwd`.
    fn new(no_turns: bool, persistent: bool, no_split: bool, bwd: sm90::BwdEnv) -> HopperWords {
        let turns = if no_turns {
            format!(
                " (in this run without the consumers' turns: {}=0)",
                sm90::PINGPONG_ENV
            )
        } else if persistent {
            " (the consumers taking turns to issue their products, FlashAttention-3's ping-pong, under the causal mask only in this run: the persistent grid has no turns)".to_string()
        } else {
            ", the consumers taking turns to issue their products (FlashAttention-3's ping-pong, on named barriers)".to_string()
        };
        let split = format!(
            "where the query tiles (one CTA each) leave a last wave of at most half the SMs each tile of that wave runs as 2 to {} CTAs over a share of its key tiles (at least {} of seq_len_kv's), whose fp32 partial outputs a second kernel merges by their log-sum-exps",
            sm90::TAIL_MAX_PARTS,
            sm90::TAIL_MIN_PART_KEY_TILES
        );
        let grid = match (persistent, no_split) {
            (false, false) => split,
            (true, false) => format!(
                "in this run ({}=1) on a persistent grid of at most one CTA per SM taking the query tiles in turn; {split}",
                sm90::PERSIST_ENV
            ),
            (false, true) => format!(
                "one CTA per query tile (in this run {}=0: the final wave's tiles not split)",
                sm90::TAIL_ENV
            ),
            (true, true) => format!(
                "in this run ({}=1, {}=0) on a persistent grid of at most one CTA per SM taking the query tiles in turn, none split",
                sm90::PERSIST_ENV,
                sm90::TAIL_ENV
            ),
        };
        let bwd_grid = if bwd.tail_split {
            format!(
                "; without the causal mask, where the grid's final round of CTAs fills at most half the SMs, each CTA of that round runs as 2 to {} CTAs over a share of its query steps (at least {} each), their fp32 partial dK and dV added in part order by a combine",
                sm90::BWD_TAIL_MAX_PARTS,
                sm90::BWD_TAIL_MIN_STEPS
            )
        } else {
            format!(
                " (in this run {}=0: the final round of CTAs not split)",
                sm90::BWD_TAIL_ENV
            )
        };
        let bwd_steps = if bwd.wide == sm90::BWD_WIDE_DEFAULT {
            String::new()
        } else {
            let setting = match bwd.wide {
                (64, 64) => "64",
                (80, 64) => "80",
                _ => "80c",
            };
            format!(" (in this run {}={setting})", sm90::BWD_BM_ENV)
        };
        HopperWords {
            turns,
            grid,
            bwd_grid,
            bwd_wide: bwd.wide,
            bwd_steps,
        }
    }
}

/// What the public entry points (`attention::dot_product_attention` and its vjp, and `mha`)
/// run on a CUDA device ([`kernelpages::attention::dispatch`]), in words built from the same
/// constants it reads.
fn dispatch_rules() -> Vec<DispatchRule> {
    const ENTRY: &str =
        "attention::dot_product_attention, attention::dot_product_attention_vjp (Device::Cuda)";
    let hopper = HopperWords::from_env();
    let dims: Vec<String> = FLASH_HEAD_DIMS.iter().map(|d| d.to_string()).collect();
    let configs: Vec<String> = FLASH_HEAD_DIMS
        .iter()
        .map(|&d| {
            format!(
                "{d}: {}",
                FlashConfig::for_head_dim(d)
                    .expect("checked at start")
                    .name()
            )
        })
        .collect();
    let bwd_configs: Vec<String> = FLASH_HEAD_DIMS
        .iter()
        .map(|&d| {
            format!(
                "{d}: {}",
                BwdConfig::for_head_dim(d).expect("checked at start").name()
            )
        })
        .collect();
    let decode_dims: Vec<String> = DECODE_HEAD_DIMS.iter().map(|d| d.to_string()).collect();
    // The TMA build's head dims: multiples of 64 (decode_gpu::Decoder::new).
    let tma_dims: Vec<String> = DECODE_HEAD_DIMS
        .iter()
        .filter(|d| d.is_multiple_of(64))
        .map(|d| d.to_string())
        .collect();
    let mut rules = vec![
        DispatchRule {
            entry_point: "attention::dot_product_attention, attention::mha (Device::Cuda)".into(),
            device: "CUDA, compute capability 8.0 or newer".into(),
            dtype: "bf16, fp16".into(),
            rule: format!(
                "decoding shapes, forward: at most {} query rows against at least {} keys, head_dim {}, causal (bottom-right) or not, per-sequence key lengths, GQA/MQA, any scale. Kernels: split-KV (kernels/flash_decode.cu): the keys split into ranges so that one wave of {} CTAs per SM ({} at head_dim 256) is filled, query rows in {}-row mma.sync tiles, {} tiles per CTA at head_dim <= 128 when a GQA group has more rows than one tile, the ranges combined by the last CTA of each (sequence, kv head) to finish; K and V tiles by TMA tensor copies on compute capability 9.0 at head_dim {} (the contiguous cache, and vLLM's pages of {} keys or a multiple of {}), by cp.async elsewhere",
                AttentionCase::DECODE_MAX_QUERIES,
                AttentionCase::DECODE_MIN_KEYS,
                decode_dims.join(", "),
                decode_gpu::CTAS_PER_SM,
                decode_gpu::ctas_per_sm(256, 1),
                decode_gpu::ROW_TILE,
                decode_gpu::row_tiles(decode_gpu::ROW_TILE + 1, 128),
                tma_dims.join(", "),
                decode_gpu::TMA_SMALL_PAGE,
                decode_gpu::KEY_TILE
            ),
            implementation: decode::CONTIGUOUS.into(),
        },
        DispatchRule {
            entry_point: ENTRY.into(),
            device: "CUDA, compute capability 9.0 (sm_90a)".into(),
            dtype: if sm90::fp16_dispatched() {
                "bf16, fp16"
            } else {
                "bf16"
            }
            .into(),
            rule: format!(
                "otherwise, at head_dim 64 or 128 with a positive scale, the forward, and for forward + backward the wgmma backward after it: any seq_len_q and seq_len_kv, causal (bottom-right) or not, per-sequence key lengths, GQA/MQA. Kernel: the wgmma forward (kernels/attn_wgmma_sm90.cu): K and V in {}-key tiles by TMA on mbarriers from a producer warpgroup, consumer warpgroups of 64 query rows on wgmma with the softmax of one key tile overlapped with the P·V product of the previous one{}; {}-row query tiles at head_dim 64 from {} queries, {}-row tiles otherwise; without the causal mask, {}; under the causal mask the CTAs take the query tiles heaviest first within chunks of (head, batch entry) pairs whose K and V fit half the L2, the chunk size from a simulated makespan. Kernel: the wgmma backward (kernels/attn_wgmma_bwd_sm90.cu): {}-key tiles per CTA holding dK and dV in registers, Q and dO in steps of {} rows at head_dim 64, and at 128 of {} under the causal mask and {} without{}, by TMA, dQ summed in fp32 by TMA reduce-adds; where (key tiles × kv heads × batch) is small against {} SMs and a kv head has several query heads, those heads are split over up to {} CTAs per key tile (causal: to two waves; not causal: what fits one), their fp32 partial dK and dV added in a fixed order by a fourth kernel{}; under the causal mask, where a simulation of the grid on {} SMs puts key tiles fastest at least 2 % behind, the CTAs start longest first (key tiles slowest) within chunks of at least {} (kv head · split, batch entry) pairs, the chunk size from that simulation (grids of up to {} CTAs are simulated). The rows of {} measure the portable kernels below on the same cases",
                sm90::WS_KEYS,
                hopper.turns,
                sm90::Sm90Version::V4.rows(),
                sm90::V4_MIN_QUERIES,
                sm90::Sm90Version::V3.rows(),
                hopper.grid,
                sm90::BWD_KEYS,
                sm90::bwd_queries(64),
                sm90::bwd_step_queries(128, true, hopper.bwd_wide),
                sm90::bwd_step_queries(128, false, hopper.bwd_wide),
                hopper.bwd_steps,
                sm90::BWD_SPLIT_SMS,
                sm90::BWD_MAX_SPLITS,
                hopper.bwd_grid,
                sm90::BWD_SPLIT_SMS,
                sm90::BWD_MIN_CHUNK,
                sm90::BWD_SCHEDULE_MAX_CTAS,
                sm80::IMPLEMENTATION
            ),
            implementation: Implementation::Flash.name().into(),
        },
        DispatchRule {
            entry_point: ENTRY.into(),
            device: "CUDA, compute capability 8.0 or newer".into(),
            dtype: "bf16, fp16".into(),
            rule: format!(
                "otherwise: head_dim {} (forward configs {}), any seq_len_q and seq_len_kv, causal (bottom-right) or not, per-sequence key lengths, GQA/MQA, any scale; forward and forward + backward. Kernels: with seq_len_q = seq_len_kv, head_dim 64 or 128 and every key valid the forward is the tuned v3 kernel (kernels/flash_attn_fwd_aligned.cu; its last tile masked when the length is not a multiple of its 128-row query tile; it also writes the log-sum-exp when a backward follows), every other forward the general kernel (kernels/flash_attn_fwd.cu); the backward kernels (kernels/flash_attn_bwd.cu, backward configs {})",
                dims.join(", "),
                configs.join(", "),
                bwd_configs.join(", ")
            ),
            implementation: Implementation::Flash.name().into(),
        },
        DispatchRule {
            entry_point: ENTRY.into(),
            device: "CUDA, compute capability 8.0 or newer".into(),
            dtype: "bf16, fp16, fp32".into(),
            rule: "otherwise: fp32 (cuBLAS SGEMM, no TF32) or another head_dim; every shape, forward and forward + backward".into(),
            implementation: Implementation::Math.name().into(),
        },
    ];
    rules.extend(flex_dispatch_rules());
    rules.extend([
        DispatchRule {
            entry_point: "attention::mha (Device::Cuda)".into(),
            device: "CUDA, compute capability 8.0 or newer".into(),
            dtype: "bf16, fp16, fp32".into(),
            rule: "always: the four projections as cuBLAS GEMMs over all batch · seq_len tokens (cublasGemmEx, float32 compute; fp32 with pedantic math, no TF32), heads moved by kernels/heads_layout.cu, the attention by the rules above".into(),
            implementation: format!("cuBLAS + {} or {}", Implementation::Flash.name(), Implementation::Math.name()),
        },
        DispatchRule {
            entry_point: "attention::cpu::forward_f64".into(),
            device: "CPU".into(),
            dtype: "any (computed in float64)".into(),
            rule: "always".into(),
            implementation: "cpu_reference".into(),
        },
    ]);
    rules
}

/// flex_attention's rules on a CUDA device: the wgmma forward on compute capability 9.0, unless
/// this process keeps flex's forward on the portable kernel (`KP_FLEX_SM90=0`), and the wgmma
/// backward unless it keeps the backward there (`KP_FLEX_BWD_SM90=0`): the rules state what the
/// rows ran; then the portable kernels.
fn flex_dispatch_rules() -> Vec<DispatchRule> {
    const ENTRY: &str =
        "attention::api::flex_attention, attention::api::flex_attention_vjp (Device::Cuda)";
    let flex_dims: Vec<String> = FLEX_HEAD_DIMS.iter().map(|d| d.to_string()).collect();
    let (sm90_off, bwd_sm90_on) = (sm90_forward_off(), !sm90_backward_off());
    let sm90 = (!sm90_off || bwd_sm90_on).then(|| DispatchRule {
        entry_point: ENTRY.into(),
        device: "CUDA, compute capability 9.0 (sm_90a)".into(),
        dtype: "bf16, fp16".into(),
        rule: format!(
            "head_dim {} with a positive scale: the forward on {}; the backward {}",
            flex_dims.join(" or "),
            if sm90_off {
                "the portable kernel as below".to_string()
            } else {
                format!(
                    "{}, the mask evaluated in partial tiles only and tiles it empties never loaded",
                    FlexKernel::Wgmma.describe()
                )
            },
            if bwd_sm90_on {
                "on the wgmma backward (kernels/flex_attn_bwd_sm90.cu, TMA, warp specialisation, dQ by fp32 TMA reduce-adds)"
            } else {
                "as below"
            }
        ),
        implementation: flex::IMPLEMENTATION.into(),
    });
    let portable = DispatchRule {
        entry_point: ENTRY.into(),
        device: "CUDA, compute capability 8.0 or newer".into(),
        dtype: "bf16, fp16".into(),
        rule: format!(
            "otherwise, head_dim {}: the forward on {}; the backward (kernels/flex_attn_bwd.cu, FlashAttention-2's over a transposed block mask of {}-row query steps and {}-key tiles, dQ summed with fp32 atomics) {}",
            flex_dims.join(" or "),
            FlexKernel::Portable.describe(),
            FLEX_BWD_ROWS,
            FLEX_BWD_KEYS,
            if bwd_sm90_on { "on other devices" } else { "on every device" }
        ),
        implementation: flex::IMPLEMENTATION.into(),
    };
    sm90.into_iter().chain([portable]).collect()
}

struct Attention {
    check_rows: usize,
    device: DeviceChoice,
    /// The GPU's architecture ([`kernelpages::gpu::Gpu::arch`], e.g. `sm_90a`) for a tile
    /// sweep on the GPU (its rows' notes depend on it); `None` otherwise or where the device
    /// did not open.
    sweep_arch: Option<String>,
}

/// The note of a tile-sweep row of `flash` for case `c` on a device of architecture `arch`
/// where `flash` itself runs another kernel ([`sm90::takes`]): the swept configurations are the
/// portable kernel's, and `default` marks that kernel's default (what `flash_sm80` runs).
fn sweep_note(arch: &str, c: &AttentionCase) -> Option<String> {
    sm90::takes(arch, c).then(|| {
        format!(
            "on this device ({arch}) flash runs its wgmma kernels for this case: the swept configurations are the portable kernel's, and default marks the portable kernel's default ({} runs it)",
            sm80::IMPLEMENTATION
        )
    })
}

/// The attention case of a case process's `job`, or the reply that ends the process: `error`
/// when its parameters are not a case, `unsupported` with `why`'s reason.
fn job_case(
    job: &runner::protocol::Job,
    why: impl Fn(&AttentionCase) -> Option<String>,
) -> std::result::Result<AttentionCase, Box<runner::protocol::Reply>> {
    use kernelpages::schema::Status;
    let c = AttentionCase::from_params(&job.case)
        .map_err(|e| Box::new(runner::protocol::Reply::failed(job, Status::Error, e)))?;
    match why(&c) {
        Some(reason) => Err(Box::new(runner::protocol::Reply::failed(
            job,
            Status::Unsupported,
            reason,
        ))),
        None => Ok(c),
    }
}

fn case_of(p: &Params) -> Result<AttentionCase> {
    AttentionCase::from_params(p).map_err(anyhow::Error::msg)
}

impl runner::Suite for Attention {
    fn suite(&self) -> Suite {
        Suite::Attention
    }

    /// Q, K, V (and dO for forward + backward) as standard normals rounded to the dtype
    /// (seeds `seed` … `seed + 3`), and the float64 reference of up to 4 (batch, head) slices ×
    /// `check_rows` rows ([`files::write_case`]); Q = K = 24 for the overflow cases
    /// ([`files::write_overflow_case`]), the masks grid's modification applied to the reference
    /// for its cases ([`files::write_masked_case`]).
    fn prepare(&self, p: &Params, seed: u64, dir: &Path) -> Result<CaseFiles> {
        match p.get(INPUTS_PARAM) {
            None => {}
            Some(Param::Text(s)) if s == files::OVERFLOW_INPUTS => {
                return files::write_overflow_case(&case_of(p)?, seed, self.check_rows, dir);
            }
            Some(other) => bail!(
                "case parameter `{INPUTS_PARAM}`: {other:?} is not `{}`",
                files::OVERFLOW_INPUTS
            ),
        }
        match masks::mask_of(p) {
            Some(m) => files::write_masked_case(
                &case_of(p)?,
                m.map_err(anyhow::Error::msg)?,
                seed,
                self.check_rows,
                dir,
            ),
            None => files::write_case(&case_of(p)?, seed, self.check_rows, dir),
        }
    }

    /// The case without its tile-sweep `config`: every configuration of one shape runs on the
    /// same inputs against the same reference, prepared once.
    fn inputs_key(&self, p: &Params) -> Params {
        let mut key = p.clone();
        key.remove(CONFIG_PARAM);
        key
    }

    fn unsupported(&self, p: &Params, implementation: &str) -> Option<String> {
        if implementation == cpu::IMPLEMENTATION {
            return cpu::unsupported(p);
        }
        if decode::is_decode(implementation) {
            return match case_of(p) {
                Ok(c) => decode_gpu::unsupported_case(&c),
                Err(e) => Some(e.to_string()),
            };
        }
        if implementation == flex::IMPLEMENTATION {
            if p.contains_key(CONFIG_PARAM) {
                return Some("the tile sweep measures the flash kernel's configurations".into());
            }
            return match case_of(p) {
                Ok(c) => flex::unsupported(&c),
                Err(e) => Some(e.to_string()),
            };
        }
        if implementation == sm80::IMPLEMENTATION {
            if p.contains_key(CONFIG_PARAM) {
                return Some("the tile sweep measures the flash kernel's configurations".into());
            }
            if let Some(why) = masks::fixed_mask_unsupported(p, implementation) {
                return Some(why);
            }
            return match case_of(p) {
                Ok(c) => sm80::unsupported(&c),
                Err(e) => Some(e.to_string()),
            };
        }
        if implementation == "torch_flex" {
            // The comparison module says what it cannot run.
            return None;
        }
        if let Some(why) = masks::fixed_mask_unsupported(p, implementation) {
            return Some(why);
        }
        if p.contains_key(CONFIG_PARAM) && implementation != Implementation::Flash.name() {
            return Some(format!(
                "the tile sweep measures the flash kernel's configurations; {implementation} has none"
            ));
        }
        let imp = Implementation::parse(implementation)?;
        match case_of(p) {
            Ok(c) => imp.supports(&c).err(),
            Err(e) => Some(e.to_string()),
        }
    }

    fn is_default(&self, p: &Params, implementation: &str) -> bool {
        if self.device == DeviceChoice::Cpu {
            return implementation == cpu::IMPLEMENTATION;
        }
        if masks::mask_of(p).is_some() {
            // A named mask runs through flex_attention, whose kernel is flex.
            return implementation == flex::IMPLEMENTATION;
        }
        if decode::is_decode(implementation) {
            // The paged kernel is not what the API calls: its cache is laid out by the caller.
            return implementation == decode::CONTIGUOUS
                && case_of(p).is_ok_and(|c| decode_gpu::takes(&c));
        }
        match (case_of(p), Implementation::parse(implementation)) {
            (Ok(c), Some(imp)) => {
                let named = match p.get(CONFIG_PARAM) {
                    Some(Param::Text(s)) => Some(s.clone()),
                    _ => None,
                };
                imp.is_default_for(&c) && (named.is_none() || named == default_config_name(&c))
            }
            _ => false,
        }
    }

    fn notes(&self, p: &Params, implementation: &str) -> Vec<String> {
        let Ok(c) = case_of(p) else {
            return Vec::new();
        };
        let mut notes = Vec::new();
        let masked = c.causal || c.kv_lens.is_some();
        if masked && matches!(implementation, "math" | "torch_math") {
            notes.push("computes all Tq×Tkv scores and masks the invisible ones: TFLOP/s counts the useful work".into());
        }
        if implementation == "math" && c.dtype == Dtype::F32 {
            notes.push(MATH_FP32_NOTE.into());
        }
        if implementation == "math" && kernelpages::attention::cuda::math_pads_keys(&c) {
            notes.push(format!(
                "seq_len_kv {} is not a multiple of 8: each call copies K and V into zero-padded \
                 buffers of {} keys (in the temporaries), over which the GEMMs along the keys run",
                c.seq_len_kv,
                kernelpages::attention::cuda::math_row_stride(c.seq_len_kv)
            ));
        }
        if implementation == "flash" && p.contains_key(CONFIG_PARAM) {
            if let Some(note) = self.sweep_arch.as_deref().and_then(|a| sweep_note(a, &c)) {
                notes.push(note);
            }
        }
        if implementation == "flash" && c.pass == Pass::FwdBwd {
            notes.push("dQ is summed over key tiles in fp32 by unordered adds (atomics in the portable backward, TMA reduce-adds in the wgmma backward): its last bit may vary from run to run (O, dK and dV do not)".into());
            if c.head_dim > 128 {
                notes.push("head_dim 256: the backward's main kernel runs twice (dK and dV columns 0–127, then 128–255), recomputing S and dP".into());
            }
        }
        notes
    }

    fn label(&self, p: &Params) -> String {
        match case_of(p) {
            Ok(c) => {
                let t = if c.seq_len_q == c.seq_len_kv {
                    format!("T{}", c.seq_len_q)
                } else {
                    format!("Tq{} Tkv{}", c.seq_len_q, c.seq_len_kv)
                };
                let mask = match p.get(masks::MASK_PARAM) {
                    Some(Param::Text(m)) => format!("mask {m}"),
                    _ => (if c.causal { "causal" } else { "full" }).to_string(),
                };
                let mut s = format!(
                    "B{} H{}/{} {t} D{} {mask} {} {}",
                    c.batch,
                    c.heads,
                    c.kv_heads,
                    c.head_dim,
                    c.dtype.as_str(),
                    c.pass.as_str()
                );
                if let Some(x) = c.scale {
                    s += &format!(" scale {x}");
                }
                if let Some(l) = &c.kv_lens {
                    s += &format!(" kv_lens {l:?}");
                }
                if let Some(Param::Text(cfg)) = p.get(CONFIG_PARAM) {
                    s += &format!(" config {cfg}");
                }
                if let Some(Param::Text(inputs)) = p.get(INPUTS_PARAM) {
                    s += &format!(" inputs {inputs}");
                }
                s
            }
            Err(_) => format!("{p:?}"),
        }
    }
}

fn run(cli: &Cli) -> Result<ExitCode> {
    if let Some(spec) = &cli.flash_config {
        // The case processes inherit the environment; FlashConfig::for_head_dim reads it.
        std::env::set_var("KP_FLASH_CONFIG", spec);
    }
    if let Some(spec) = &cli.flash_bwd_config {
        std::env::set_var("KP_FLASH_BWD_CONFIG", spec);
    }
    for d in FLASH_HEAD_DIMS {
        FlashConfig::for_head_dim(d)
            .map_err(anyhow::Error::msg)
            .context("--flash-config")?;
        BwdConfig::for_head_dim(d)
            .map_err(anyhow::Error::msg)
            .context("--flash-bwd-config")?;
    }
    let gpu_default: &[&str] = match run_kind(cli) {
        // `flash` is not what the API runs on decoding shapes (the split-KV kernel is).
        RunKind::Decode => &[
            "math",
            decode::CONTIGUOUS,
            decode::PAGED,
            decode::PAGED_LARGE,
        ],
        // Generated masks; flash runs the causal cases.
        RunKind::Masks => &[flex::IMPLEMENTATION, "flash"],
        // flash_sm80 runs by default only where flash runs another kernel (compute
        // capability 9.0: a short-lived context asks the device, as the run's setup does).
        _ if !on_cpu(cli)
            && cli.implementations.is_none()
            && kernelpages::gpu::Gpu::open(0).is_ok_and(|g| g.arch() == "sm_90a") =>
        {
            &["flash", sm80::IMPLEMENTATION, "math"]
        }
        _ => &["flash", "math"],
    };
    let names = names_or_default(
        &cli.implementations,
        gpu_default,
        &[cpu::IMPLEMENTATION],
        cli.run.device,
    );
    let own: Vec<(&str, &str)> = names
        .iter()
        .map(|n| {
            if on_cpu(cli) {
                return (n == cpu::IMPLEMENTATION)
                    .then_some((cpu::IMPLEMENTATION, "kernelpages"))
                    .with_context(|| {
                        format!("--implementations: unknown `{n}` on the CPU (cpu_flash)")
                    });
            }
            if let Some(&d) = decode::IMPLEMENTATIONS.iter().find(|(name, _)| name == n) {
                return Ok(d);
            }
            if n == flex::IMPLEMENTATION {
                return Ok((flex::IMPLEMENTATION, "kernelpages"));
            }
            if n == sm80::IMPLEMENTATION {
                return Ok((sm80::IMPLEMENTATION, "kernelpages"));
            }
            Implementation::parse(n)
                .map(|i| (i.name(), i.library()))
                .with_context(|| {
                    format!(
                        "--implementations: unknown `{n}` (flash, math, {}, {}, {}, {}, {})",
                        decode::CONTIGUOUS,
                        decode::PAGED,
                        decode::PAGED_LARGE,
                        flex::IMPLEMENTATION,
                        sm80::IMPLEMENTATION
                    )
                })
        })
        .collect::<Result<_>>()?;
    let alternatives: &[Alternative] = if on_cpu(cli) {
        &cpu::ALTERNATIVES
    } else {
        &ALTERNATIVES
    };
    let imps = runner::implementations(&own, alternatives, &cli.run.compare)?;
    let cases = cli.run.select(cases(cli, false)?, cases(cli, true)?)?;
    // Decoding shapes carry bytes: the document then states the byte rule and declares GB/s.
    let decoding = cases
        .iter()
        .any(|p| case_of(p).is_ok_and(|c| c.is_decoding()));
    let declared = Declared {
        runner: "attention",
        flop_rule: Some(if run_kind(cli) == RunKind::Masks {
            files::MASKED_FLOP_RULE.to_string()
        } else if decoding {
            format!(
                "{}; bytes for GB/s: {}",
                AttentionCase::FLOP_RULE,
                AttentionCase::byte_rule()
            )
        } else {
            AttentionCase::FLOP_RULE.to_string()
        }),
        dispatch: if on_cpu(cli) {
            cpu::dispatch_rules()
        } else {
            dispatch_rules()
        },
        axes: if run_kind(cli) == RunKind::Decode {
            decode::AXES.iter().map(|a| a.to_string()).collect()
        } else {
            AttentionCase::AXES.iter().map(|a| a.to_string()).collect()
        },
        throughput: if on_cpu(cli) {
            cpu::throughput_decls()
        } else if decoding {
            AttentionCase::decoding_throughput_decls()
        } else {
            AttentionCase::throughput_decls()
        },
        kind: run_kind(cli),
    };
    let suite = Attention {
        check_rows: cli.check_rows,
        device: cli.run.device,
        // A short-lived context asks the device, as the run's setup does. A configuration given
        // for the run makes flash run the portable kernels itself: no note then.
        sweep_arch: (run_kind(cli) == RunKind::TileSweep
            && !on_cpu(cli)
            && cli.flash_config.is_none()
            && cli.flash_bwd_config.is_none())
        .then(|| kernelpages::gpu::Gpu::open(0).ok().map(|g| g.arch()))
        .flatten(),
    };
    runner::run(&suite, &cli.run, declared, cases, imps, Vec::new())
}

/// The project's implementation for one case, as the shared case process drives it.
struct Launch {
    runner: Runner,
    case: AttentionCase,
    imp: Implementation,
}

impl own::Launcher for Launch {
    type Set = DeviceInputs;
    fn upload(&self, gpu: &Gpu, host: &[Vec<u16>]) -> Result<DeviceInputs, GpuError> {
        let [q, k, v, rest @ ..] = host else {
            return Err(GpuError::Config("attention takes q, k, v (and do)".into()));
        };
        let inputs = Inputs {
            q: q.clone(),
            k: k.clone(),
            v: v.clone(),
            dout: rest.first().cloned().unwrap_or_default(),
        };
        upload(gpu, &self.case, &inputs)
    }
    fn replicate(&self, gpu: &Gpu, set: &DeviceInputs) -> Result<DeviceInputs, GpuError> {
        replicate(gpu, set)
    }
    fn launch(
        &mut self,
        gpu: &Gpu,
        set: &DeviceInputs,
        outs: &mut [cudarc::driver::CudaSlice<u16>],
    ) -> Result<(), GpuError> {
        self.runner.launch(gpu, &self.case, set, outs)
    }
    fn temporary_bytes(&self) -> u64 {
        self.imp.temporary_bytes(&self.case) + self.runner.dispatch_temporary_bytes(&self.case)
    }
    fn residual_bytes(&self) -> Option<u64> {
        (self.case.pass == Pass::FwdBwd).then(|| self.imp.residual_bytes(&self.case))
    }
    fn workspace_bytes(&self) -> u64 {
        self.runner.workspace_bytes()
    }
}

/// The case process: compile, first call, check and time one (case, implementation).
fn measure_own(job: &runner::protocol::Job) -> runner::protocol::Reply {
    let parsed = case_of(&job.case).and_then(|c| {
        let imp = Implementation::parse(&job.implementation).context("unknown implementation")?;
        Ok((c, imp, case_configs(&job.case)?))
    });
    let (c, imp, (fwd, bwd)) = match parsed {
        Ok(x) => x,
        Err(e) => {
            return runner::protocol::Reply::failed(
                job,
                kernelpages::schema::Status::Error,
                format!("{e:#}"),
            )
        }
    };
    own::measure(job, |gpu| {
        let (runner, compile_s) = Runner::with_configs(gpu, imp, &c, fwd, bwd)?;
        Ok((
            Launch {
                runner,
                case: c.clone(),
                imp,
            },
            compile_s,
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kernelpages::runner::Suite as _;

    /// The Hopper rule names the ping-pong and the tail split only when they ran: the site's
    /// limitations read these phrases from a document's dispatch table.
    #[test]
    fn hopper_words_say_what_the_environment_changed() {
        const TURNS: &str = "the consumers taking turns to issue their products (";
        for no_turns in [false, true] {
            for persistent in [false, true] {
                for no_split in [false, true] {
                    let w = HopperWords::new(no_turns, persistent, no_split, DEFAULT_BWD);
                    let label = format!(
                        "{no_turns} {persistent} {no_split}: {} / {}",
                        w.turns, w.grid
                    );
                    assert_eq!(w.turns.contains(TURNS), !no_turns && !persistent, "{label}");
                    assert_eq!(w.grid.contains("last wave"), !no_split, "{label}");
                    // The limitations page reads "last wave" anywhere in the rule as the
                    // forward's split: the backward's own split says it otherwise.
                    assert!(!w.bwd_grid.contains("last wave"), "{}", w.bwd_grid);
                    assert_eq!(w.grid.contains(sm90::PERSIST_ENV), persistent, "{label}");
                    assert_eq!(w.turns.contains(sm90::PINGPONG_ENV), no_turns, "{label}");
                }
            }
        }
        // The backward's settings: named only where they differ from the defaults.
        for wide in [(64, 64), (80, 64), (80, 80)] {
            for tail_split in [false, true] {
                let bwd = sm90::BwdEnv { wide, tail_split };
                let w = HopperWords::new(false, false, false, bwd);
                let label = format!("{bwd:?}: {} / {}", w.bwd_steps, w.bwd_grid);
                assert_eq!(
                    w.bwd_steps.contains(sm90::BWD_BM_ENV),
                    wide != sm90::BWD_WIDE_DEFAULT,
                    "{label}"
                );
                assert_eq!(
                    w.bwd_grid.contains(sm90::BWD_TAIL_ENV),
                    tail_split != sm90::BWD_TAIL_DEFAULT,
                    "{label}"
                );
                assert!(!w.bwd_grid.contains("last wave"), "{label}");
            }
        }
    }

    /// The backward's settings when the environment sets none.
    const DEFAULT_BWD: sm90::BwdEnv = sm90::BwdEnv {
        wide: sm90::BWD_WIDE_DEFAULT,
        tail_split: sm90::BWD_TAIL_DEFAULT,
    };

    #[test]
    fn default_grid_quick_grid_and_filter() {
        let cli = Cli::try_parse_from(["attention", "--grids", "main"]).unwrap();
        assert_eq!(cases(&cli, false).unwrap().len(), 2 * 2 * 6 * 2);
        let cli = Cli::try_parse_from([
            "attention",
            "--quick",
            "--grids",
            "main",
            "--filter",
            "head_dim=128",
        ])
        .unwrap();
        let kept = cli
            .run
            .select(cases(&cli, false).unwrap(), cases(&cli, true).unwrap())
            .unwrap();
        assert_eq!(kept.len(), 2 * 2 * 2);
        // The CPU grid: the main grid only, forward and forward + backward, bf16 and fp32,
        // batch 2, its own lengths.
        let cli = Cli::try_parse_from(["attention", "--device", "cpu"]).unwrap();
        let grid: Vec<AttentionCase> = cases(&cli, false)
            .unwrap()
            .iter()
            .map(|p| case_of(p).unwrap())
            .collect();
        assert_eq!(grid.len(), 2 * 2 * 2 * 2 * cpu::SEQ_LENS.len());
        assert!(grid.iter().any(|c| c.dtype == Dtype::F32));
        assert!(grid.iter().all(|c| c.batch == cpu::BATCH));
        assert_eq!(
            grid.iter().filter(|c| c.pass == Pass::FwdBwd).count(),
            grid.len() / 2
        );
        assert_eq!(cases(&cli, true).unwrap().len(), 2 * 2 * 2 * 2 * 2);
        let cli = Cli::try_parse_from(["attention", "--shard", "1/2"]).unwrap();
        assert_eq!(cli.run.shard.unwrap().count, 2);
    }

    #[test]
    fn the_tile_sweep_runs_alone_as_a_document_of_its_own_kind() {
        let cli = Cli::try_parse_from(["attention", "--grids", "tiles"]).unwrap();
        assert_eq!(run_kind(&cli), RunKind::TileSweep);
        let cli = Cli::try_parse_from(["attention", "--grids", "main,shapes"]).unwrap();
        assert_eq!(run_kind(&cli), RunKind::Grid);
        assert_eq!(
            run_kind(&Cli::try_parse_from(["attention"]).unwrap()),
            RunKind::Grid
        );
        let cli = Cli::try_parse_from(["attention", "--grids", "main,tiles"]).unwrap();
        let err = cases(&cli, false).unwrap_err().to_string();
        assert!(err.contains("runs alone") && err.contains("main"), "{err}");
        // Its configurations of one shape share one preparation of the inputs.
        let suite = Attention {
            check_rows: 64,
            device: DeviceChoice::Gpu,
            sweep_arch: None,
        };
        let cli = Cli::try_parse_from(["attention", "--grids", "tiles"]).unwrap();
        let tiles = cases(&cli, false).unwrap();
        let keys: std::collections::BTreeSet<String> = tiles
            .iter()
            .map(|p| format!("{:?}", suite.inputs_key(p)))
            .collect();
        // head_dim 64/128 × full/causal × fwd/fwd+bwd.
        assert_eq!(keys.len(), 2 * 2 * 2, "{keys:?}");
        assert!(tiles.iter().all(|p| p.contains_key(CONFIG_PARAM)));
    }

    #[test]
    fn the_decode_grid_runs_alone_as_a_document_of_its_own_kind() {
        let cli = Cli::try_parse_from(["attention", "--grids", "decode"]).unwrap();
        assert_eq!(run_kind(&cli), RunKind::Decode);
        let all = cases(&cli, false).unwrap();
        assert_eq!(all.len(), decode::cases(false).len());
        assert!(all.iter().all(|p| case_of(p).unwrap().is_decoding()));
        let cli = Cli::try_parse_from(["attention", "--grids", "main,decode"]).unwrap();
        let e = cases(&cli, false).unwrap_err().to_string();
        assert!(
            e.contains("`decode` runs alone") && e.contains("main"),
            "{e}"
        );
        // The default grids hold no decoding shape, so the grid document declares no GB/s.
        let cli = Cli::try_parse_from(["attention"]).unwrap();
        assert!(cases(&cli, false)
            .unwrap()
            .iter()
            .all(|p| !case_of(p).unwrap().is_decoding()));
    }

    #[test]
    fn the_tile_sweep_says_where_flash_runs_another_kernel() {
        let cli = Cli::try_parse_from(["attention", "--grids", "tiles"]).unwrap();
        let tiles = cases(&cli, false).unwrap();
        let on = |arch: Option<&str>| Attention {
            check_rows: 16,
            device: DeviceChoice::Gpu,
            sweep_arch: arch.map(String::from),
        };
        let has_note = |suite: &Attention, p: &Params| {
            suite
                .notes(p, "flash")
                .iter()
                .any(|n| n.contains("the swept configurations are the portable kernel's"))
        };
        let hopper = on(Some("sm_90a"));
        let mut noted = 0;
        for p in &tiles {
            let c = case_of(p).unwrap();
            let want = sm90::takes("sm_90a", &c);
            assert_eq!(has_note(&hopper, p), want, "{c:?}");
            noted += usize::from(want);
            assert!(!has_note(&on(Some("sm_89")), p), "{c:?}");
            assert!(!has_note(&on(None), p), "{c:?}");
        }
        assert!(noted > 0, "the sweep has cases the wgmma kernels take");
        // Only the sweep's rows: a grid case of the same shape, without a configuration.
        let mut grid_case = tiles[0].clone();
        grid_case.remove(CONFIG_PARAM);
        assert!(!has_note(&hopper, &grid_case));
    }

    #[test]
    fn the_tile_sweep_names_every_configuration_once_and_marks_the_defaults() {
        let cli = Cli::try_parse_from(["attention", "--grids", "tiles"]).unwrap();
        let tiles = cases(&cli, false).unwrap();
        let suite = Attention {
            check_rows: 16,
            device: DeviceChoice::Gpu,
            sweep_arch: None,
        };
        for d in [64, 128] {
            for causal in [false, true] {
                let of = |pass: Pass| -> Vec<&Params> {
                    tiles
                        .iter()
                        .filter(|p| {
                            let c = case_of(p).unwrap();
                            c.head_dim == d && c.causal == causal && c.pass == pass
                        })
                        .collect()
                };
                assert_eq!(of(Pass::Fwd).len(), FWD_SWEEP.len());
                let runnable = BWD_SWEEP
                    .iter()
                    .filter(|n| BwdConfig::parse(n).unwrap().check(d).is_ok())
                    .count();
                assert_eq!(of(Pass::FwdBwd).len(), runnable);
                // Exactly one default per (pass, head dim, mask): the dispatch's configuration.
                for pass in [Pass::Fwd, Pass::FwdBwd] {
                    let defaults: Vec<_> = of(pass)
                        .into_iter()
                        .filter(|p| suite.is_default(p, "flash"))
                        .collect();
                    assert_eq!(defaults.len(), 1, "d{d} causal {causal} {pass:?}");
                    let c = case_of(defaults[0]).unwrap();
                    assert_eq!(
                        defaults[0].get(CONFIG_PARAM),
                        Some(&Param::Text(default_config_name(&c).unwrap()))
                    );
                }
            }
        }
        // Each case names its configuration, parsed back as the child reads it; math has none.
        for p in &tiles {
            let (f, b) = case_configs(p).unwrap();
            assert!(f.is_some() != b.is_some());
            assert!(suite.unsupported(p, "math").is_some());
        }
        assert!(case_configs(&tiles[0]).unwrap().0.is_some());
        let bad = {
            let mut p = tiles[0].clone();
            p.insert(CONFIG_PARAM.into(), Param::Text("w9r7".into()));
            p
        };
        assert!(case_configs(&bad).is_err());
    }

    #[test]
    fn the_shapes_grid_holds_issue_9s_shapes() {
        let cli =
            Cli::try_parse_from(["attention", "--grids", "shapes", "--passes", "fwd"]).unwrap();
        let all: Vec<AttentionCase> = shape_cases(&cli, false).unwrap();
        let has = |f: &dyn Fn(&AttentionCase) -> bool| all.iter().any(f);
        for t in [1, 7, 63, 65, 129, 192, 4092, 4096, 4097] {
            assert!(has(&|c| c.seq_len_q == t
                && c.seq_len_kv == t
                && (c.batch, c.heads, c.head_dim) == (1, 24, 64)));
        }
        assert!(has(&|c| (
            c.batch,
            c.heads,
            c.seq_len_q,
            c.seq_len_kv,
            c.head_dim
        ) == (4, 32, 1, 20, 128)));
        assert!(has(&|c| (c.heads, c.kv_heads) == (32, 8)));
        assert!(has(&|c| (c.heads, c.kv_heads) == (8, 1)));
        for d in [32, 96, 256] {
            assert!(has(&|c| c.head_dim == d));
        }
        assert!(has(&|c| c.dtype == Dtype::F16) && has(&|c| c.dtype == Dtype::F32));
        assert!(has(&|c| c.scale == Some(0.3)));
        assert!(has(&|c| c
            .kv_lens
            .as_ref()
            .is_some_and(|l| l.contains(&0) && l.contains(&1))));
        assert!(has(&|c| c.seq_len_q > c.seq_len_kv && c.causal));
        // Every case is valid, and flash takes all but fp32.
        for c in &all {
            c.validate().unwrap();
            assert_eq!(
                Implementation::Flash.supports(c).is_ok(),
                c.dtype != Dtype::F32,
                "{c:?}"
            );
            assert!(Implementation::Math.supports(c).is_ok());
        }
        // Both passes by default; a filter on seq_len_q reaches the cases that have it.
        let cli =
            Cli::try_parse_from(["attention", "--grids", "shapes", "--filter", "seq_len_q=1"])
                .unwrap();
        let kept = cli
            .run
            .select(cases(&cli, false).unwrap(), cases(&cli, true).unwrap())
            .unwrap();
        assert_eq!(kept.len(), 2 * 2, "decode, full and causal, two passes");
    }

    #[test]
    fn the_shapes_grid_holds_the_fp16_overflow_inputs() {
        let cli = Cli::try_parse_from(["attention", "--grids", "shapes"]).unwrap();
        let over: Vec<Params> = cases(&cli, false)
            .unwrap()
            .into_iter()
            .filter(|p| p.contains_key(INPUTS_PARAM))
            .collect();
        assert_eq!(over.len(), 1, "the forward only");
        assert!(cases(&cli, true)
            .unwrap()
            .iter()
            .all(|p| !p.contains_key(INPUTS_PARAM)));
        let suite = Attention {
            check_rows: 4,
            device: DeviceChoice::Gpu,
            sweep_arch: None,
        };
        let mut small = over[0].clone();
        small.insert("seq_len".into(), Param::Int(64));
        let c = case_of(&small).unwrap();
        assert_eq!((c.dtype, c.head_dim, c.pass), (Dtype::F16, 128, Pass::Fwd));
        let dir = tempfile::tempdir().unwrap();
        let files = suite.prepare(&small, 7, dir.path()).unwrap();
        let q = kernelpages::runner::protocol::read_u16(&files.inputs[0].path).unwrap();
        let k = kernelpages::runner::protocol::read_u16(&files.inputs[1].path).unwrap();
        let bits = Dtype::F16.encode_all(&[24.0])[0];
        assert!(q.iter().chain(&k).all(|&x| x == bits));
        assert_eq!(
            files.arguments.get("inputs"),
            Some(&serde_json::json!(files::OVERFLOW_INPUTS))
        );
        // Every score is equal: each checked row of O is the mean of V over the 64 keys.
        let v = Dtype::F16
            .decode_all(&kernelpages::runner::protocol::read_u16(&files.inputs[2].path).unwrap());
        let reference = kernelpages::runner::protocol::read_f64(&files.check.reference).unwrap();
        let mut at = 0;
        for r in &files.check.ranges {
            for i in r[0]..r[0] + r[1] {
                let (row, col) = (i as usize / 128, i as usize % 128);
                let head = row / 64;
                let mean: f64 = (0..64).map(|j| v[(head * 64 + j) * 128 + col]).sum::<f64>() / 64.0;
                assert!((reference[at] - mean).abs() < 1e-12, "element {i}");
                at += 1;
            }
        }
        small.insert(INPUTS_PARAM.into(), Param::Text("zeros".into()));
        let e = suite
            .prepare(&small, 7, dir.path())
            .unwrap_err()
            .to_string();
        assert!(e.contains("`inputs`") && e.contains("qk_24"), "{e}");
    }

    #[test]
    fn prepared_files_hold_the_inputs_and_the_reference() {
        let cli = Cli::try_parse_from([
            "attention",
            "--grids",
            "main",
            "--batch",
            "1",
            "--heads",
            "2",
            "--seq-lens",
            "128",
            "--head-dims",
            "64",
            "--masks",
            "causal",
        ])
        .unwrap();
        let all = cases(&cli, false).unwrap();
        let p = &all[0];
        let dir = tempfile::tempdir().unwrap();
        let suite = Attention {
            check_rows: 16,
            device: DeviceChoice::Gpu,
            sweep_arch: None,
        };
        let files = suite.prepare(p, 7, dir.path()).unwrap();
        let c = case_of(p).unwrap();
        assert_eq!(c.pass, Pass::Fwd);
        let q = kernelpages::runner::protocol::read_u16(&files.inputs[0].path).unwrap();
        assert_eq!(q, Inputs::random(&c, 7).q);
        let reference = kernelpages::runner::protocol::read_f64(&files.check.reference).unwrap();
        let n: u64 = files.check.ranges.iter().map(|r| r[1]).sum();
        assert_eq!(reference.len() as u64, n);
        // The reference of row 0 of a causal slice is V's row 0.
        let v = kernelpages::runner::protocol::read_u16(&files.inputs[2].path).unwrap();
        assert_eq!(files.check.ranges[0], [0, 64]);
        for (e, &r) in reference.iter().take(64).enumerate() {
            assert_eq!(r, c.dtype.from_bits(v[e]) as f64);
        }
        assert_eq!(files.flops, Some(c.flops()));
        assert!(files.gradients.is_empty());
        assert_eq!(files.arguments["causal_alignment"], "bottom_right");
        assert!(suite.notes(p, "math")[0].contains("useful work"));
        assert!(suite.notes(p, "flash").is_empty());
        // math says where it pads the keys (seq_len_kv not a multiple of 8), and only there.
        for (t, padded) in [(4092, true), (4096, false), (4097, true)] {
            let q = AttentionCase::new(1, 24, t, 64).params();
            let notes = suite.notes(&q, "math");
            assert_eq!(
                notes.iter().any(|n| n.contains("zero-padded")),
                padded,
                "{t}: {notes:?}"
            );
        }
        assert!(suite.is_default(p, "flash"));
        assert!(suite.unsupported(p, "flash").is_none());
        assert!(suite.unsupported(p, "torch_cudnn").is_none());
        // The forward + backward case adds dO and the three gradients.
        let p = &all[1];
        let c = case_of(p).unwrap();
        assert_eq!(c.pass, Pass::FwdBwd);
        let files = suite.prepare(p, 7, dir.path()).unwrap();
        let names: Vec<&str> = files.inputs.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["q", "k", "v", "do"]);
        let grads: Vec<(&str, &str)> = files
            .gradients
            .iter()
            .map(|g| (g.name.as_str(), g.input.as_str()))
            .collect();
        assert_eq!(grads, [("dQ", "q"), ("dK", "k"), ("dV", "v")]);
        for g in &files.gradients {
            let r = kernelpages::runner::protocol::read_f64(&g.check.reference).unwrap();
            let n: u64 = g.check.ranges.iter().map(|r| r[1]).sum();
            assert_eq!(r.len() as u64, n);
            assert!(r.iter().all(|x| x.is_finite()) && r.iter().any(|&x| x != 0.0));
        }
        assert!(files.check.checked.contains("dK and dV"));
        assert!(suite.notes(p, "flash")[0].contains("atomics"));
    }

    #[test]
    fn the_dispatch_table_names_what_dispatch_picks() {
        let rules = dispatch_rules();
        // A decoding shape (one query row, 4k keys, bf16, head_dim 128) is the split-KV
        // kernel's: the first rule, the suite's default, and what the API reports.
        let dec = AttentionCase {
            seq_len_q: 1,
            seq_len_kv: 4096,
            kv_heads: 8,
            causal: true,
            ..AttentionCase::new(2, 32, 1, 128)
        };
        assert!(decode_gpu::takes(&dec));
        assert_eq!(rules[0].implementation, decode::CONTIGUOUS);
        let suite = Attention {
            check_rows: 4,
            device: DeviceChoice::Gpu,
            sweep_arch: None,
        };
        let p = dec.params();
        assert!(suite.is_default(&p, decode::CONTIGUOUS));
        assert!(!suite.is_default(&p, decode::PAGED));
        assert!(!suite.is_default(&p, "flash") && !suite.is_default(&p, "math"));
        // Not decoding: 17 query rows, or forward + backward.
        for other in [
            AttentionCase {
                seq_len_q: 17,
                ..dec.clone()
            },
            AttentionCase {
                pass: Pass::FwdBwd,
                ..dec.clone()
            },
        ] {
            assert!(!decode_gpu::takes(&other));
            let p = other.params();
            assert!(suite.is_default(&p, "flash"));
            assert!(!suite.is_default(&p, decode::CONTIGUOUS));
        }
        let c = AttentionCase::new(1, 2, 1024, 128);
        assert_eq!(
            kernelpages::attention::dispatch(&c).map(|i| i.name()),
            Some(rules[2].implementation.as_str())
        );
        // Any length is flash's now; fp32 and other head dims are math's.
        for t in [1, 7, 100, 4097] {
            let odd = AttentionCase::new(1, 2, t, 64);
            assert_eq!(
                kernelpages::attention::dispatch(&odd),
                Some(Implementation::Flash)
            );
        }
        for odd in [
            AttentionCase {
                dtype: Dtype::F32,
                ..AttentionCase::new(1, 2, 100, 128)
            },
            AttentionCase::new(1, 2, 100, 80),
        ] {
            assert_eq!(
                kernelpages::attention::dispatch(&odd).map(|i| i.name()),
                Some(rules[3].implementation.as_str())
            );
        }
        // On compute capability 9.0 the bf16 forward at head_dim 64 and 128 is still `flash`
        // (its wgmma kernel: the second rule, for that device only); fp16 as the process
        // dispatches it, and the rule's dtypes say so.
        assert!(rules[1].device.contains("9.0") && rules[2].device.contains("8.0"));
        assert_eq!(rules[1].implementation, Implementation::Flash.name());
        assert!(sm90::takes("sm_90a", &c) && !sm90::takes("sm_89", &c));
        assert!(rules[1].rule.contains(&sm90::V4_MIN_QUERIES.to_string()));
        let fp16 = AttentionCase {
            dtype: Dtype::F16,
            ..c.clone()
        };
        assert_eq!(sm90::takes("sm_90a", &fp16), sm90::fp16_dispatched());
        assert_eq!(
            rules[1].dtype.contains("fp16"),
            sm90::fp16_dispatched(),
            "{:?}",
            rules[1].dtype
        );
        // flash_sm80 runs where flash may run the wgmma kernel, never as the default.
        assert!(!suite.is_default(&c.params(), sm80::IMPLEMENTATION));
        assert!(sm80::unsupported(&c).is_none());
        assert_eq!(sm80::unsupported(&fp16).is_none(), sm90::fp16_dispatched());
    }
}
