//! `attention`: measures the attention grid for the project's kernels (`flash`, the default,
//! and `math`) and, with `--compare torch`, PyTorch's SDPA backends (`runners/compare/
//! torch_sdpa.py`), and writes one suite document. The machinery (processes, order, timing
//! records, progress, document) is `kernelpages::runner`; this file is the grid, the
//! implementations, the dispatch table and the counts.
//!
//! ```text
//! attention --compare torch --output data/gpu_attention.json
//! attention --quick --filter head_dim=128 --runs 2
//! ```

use std::path::Path;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::Parser;

use kernelpages::attention::cpu::{reference_values, CheckPlan, Inputs};
use kernelpages::attention::cuda::{
    replicate, upload, DeviceInputs, FlashConfig, Implementation, Runner,
};
use kernelpages::attention::{AttentionCase, Dtype, Pass};
use kernelpages::gpu::{Gpu, GpuError};
use kernelpages::runner::grid::Params;
use kernelpages::runner::protocol::{
    write_f64, write_u16, CaseFiles, CheckSpec, OutputSpec, TensorFile,
};
use kernelpages::runner::{self, own, Alternative, Declared, RunnerArgs};
use kernelpages::schema::{DispatchRule, Reference, Suite};

/// Measure attention implementations on the GPU and write a suite document.
#[derive(Parser, Debug)]
#[command(
    name = "attention",
    version,
    about = "Measure attention implementations on the GPU and write a suite document (data/gpu_attention.json)"
)]
struct Cli {
    #[command(flatten)]
    run: RunnerArgs,
    /// Implementations of this project to run.
    #[arg(long, value_delimiter = ',', default_value = "flash,math")]
    implementations: Vec<String>,
    /// Batch size.
    #[arg(long, default_value_t = 4)]
    batch: usize,
    /// Query heads.
    #[arg(long, default_value_t = 8)]
    heads: usize,
    /// Key/value heads (defaults to --heads; fewer is GQA).
    #[arg(long)]
    kv_heads: Option<usize>,
    /// Head dimensions.
    #[arg(long, value_delimiter = ',', default_value = "64,128")]
    head_dims: Vec<usize>,
    /// Sequence lengths.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "512,1024,2048,4096,8192,16384"
    )]
    seq_lens: Vec<usize>,
    /// Masks to run: `full`, `causal`.
    #[arg(long, value_delimiter = ',', default_value = "full,causal")]
    masks: Vec<String>,
    /// Element types: `bf16`, `fp16`.
    #[arg(long, value_delimiter = ',', default_value = "bf16")]
    dtypes: Vec<String>,
    /// Query rows per checked slice for the float64 reference.
    #[arg(long, default_value_t = 256)]
    check_rows: usize,
    /// Flash kernel configuration per head_dim, e.g. `64=v2w4,128=v3w4m2b32` (see
    /// `kernels/TUNING.md`); the measured defaults otherwise.
    #[arg(long)]
    flash_config: Option<String>,
}

/// The alternatives `--compare` can add.
const ALTERNATIVES: [Alternative; 1] = [Alternative {
    name: "torch",
    module: "torch_sdpa",
    library: "PyTorch",
    implementations: &[
        "torch_flash",
        "torch_cudnn",
        "torch_efficient",
        "torch_math",
    ],
}];

/// Seq lengths of the `--quick` grid.
const QUICK_SEQ_LENS: [usize; 2] = [512, 1024];

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match &cli.run.run_case {
        Some(job) => runner::child_main(job, measure_own),
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

fn cases(cli: &Cli, seq_lens: &[usize]) -> Result<Vec<Params>> {
    let mut cases = Vec::new();
    for dt in &cli.dtypes {
        let dtype = Dtype::parse(dt).with_context(|| format!("--dtypes: unknown dtype `{dt}`"))?;
        for &head_dim in &cli.head_dims {
            for mask in &cli.masks {
                let causal = match mask.as_str() {
                    "full" => false,
                    "causal" => true,
                    m => bail!("--masks: unknown mask `{m}` (full or causal)"),
                };
                for &seq_len in seq_lens {
                    let c = AttentionCase {
                        kv_heads: cli.kv_heads.unwrap_or(cli.heads),
                        causal,
                        dtype,
                        pass: Pass::Fwd,
                        ..AttentionCase::new(cli.batch, cli.heads, seq_len, head_dim)
                    };
                    cases.push(c.params());
                }
            }
        }
    }
    Ok(cases)
}

/// What `attention::forward` ([`kernelpages::attention::dispatch`]) picks, in words built from
/// the same configuration it reads.
fn dispatch_rules() -> Vec<DispatchRule> {
    let flash = |d: usize| FlashConfig::for_head_dim(d).expect("checked at start");
    let (f64_, f128) = (flash(64), flash(128));
    vec![
        DispatchRule {
            entry_point: "attention::forward".into(),
            device: "CUDA, compute capability 8.0 or newer".into(),
            dtype: "bf16, fp16".into(),
            rule: format!(
                "forward pass, heads a multiple of kv_heads, and head_dim 64 with seq_len % {} == 0 (config {}) or head_dim 128 with seq_len % {} == 0 (config {})",
                f64_.query_tile(),
                f64_.name(),
                f128.query_tile(),
                f128.name()
            ),
            implementation: Implementation::Flash.name().into(),
        },
        DispatchRule {
            entry_point: "attention::forward".into(),
            device: "CUDA, compute capability 8.0 or newer".into(),
            dtype: "bf16, fp16".into(),
            rule: "otherwise, forward pass with kv_heads == heads and seq_len % 4 == 0".into(),
            implementation: Implementation::Math.name().into(),
        },
        DispatchRule {
            entry_point: "attention::cpu::forward_f64".into(),
            device: "CPU".into(),
            dtype: "any (computed in float64)".into(),
            rule: "always".into(),
            implementation: "cpu_reference".into(),
        },
    ]
}

struct Attention {
    check_rows: usize,
}

fn case_of(p: &Params) -> Result<AttentionCase> {
    AttentionCase::from_params(p).map_err(anyhow::Error::msg)
}

impl runner::Suite for Attention {
    fn suite(&self) -> Suite {
        Suite::Attention
    }

    /// Q, K, V as standard normals rounded to the dtype (seeds `seed`, `seed + 1`, `seed + 2`),
    /// and the float64 reference of 4 (batch, head) slices × `check_rows` query rows.
    fn prepare(&self, p: &Params, seed: u64, dir: &Path) -> Result<CaseFiles> {
        let c = case_of(p)?;
        let inp = Inputs::random(&c, seed);
        let plan = CheckPlan::new(&c, self.check_rows, seed ^ 0x5eed);
        let reference = reference_values(&c, &inp, &plan).o;
        let q_shape = vec![c.batch, c.heads, c.seq_len_q, c.head_dim];
        let kv_shape = vec![c.batch, c.kv_heads, c.seq_len_kv, c.head_dim];
        let mut inputs = Vec::new();
        for (name, bits, shape) in [
            ("q", &inp.q, &q_shape),
            ("k", &inp.k, &kv_shape),
            ("v", &inp.v, &kv_shape),
        ] {
            let path = dir.join(format!("{name}.bin"));
            write_u16(&path, bits)?;
            inputs.push(TensorFile {
                name: name.into(),
                dtype: c.dtype.as_str().into(),
                shape: shape.clone(),
                path,
            });
        }
        let ref_path = dir.join("reference.f64");
        write_f64(&ref_path, &reference)?;
        Ok(CaseFiles {
            inputs,
            output: OutputSpec {
                dtype: c.dtype.as_str().into(),
                shape: q_shape,
            },
            check: CheckSpec {
                ranges: plan.ranges(&c),
                reference: ref_path,
                reference_kind: Reference::Float64Cpu,
                tolerance: c.dtype.tolerance(),
                checked: plan.describe(&c),
            },
            flops: Some(c.flops()),
            bytes: None,
        })
    }

    fn unsupported(&self, p: &Params, implementation: &str) -> Option<String> {
        let imp = Implementation::parse(implementation)?;
        match case_of(p) {
            Ok(c) => imp.supports(&c).err(),
            Err(e) => Some(e.to_string()),
        }
    }

    fn is_default(&self, p: &Params, implementation: &str) -> bool {
        match (case_of(p), Implementation::parse(implementation)) {
            (Ok(c), Some(imp)) => imp.is_default_for(&c),
            _ => false,
        }
    }

    fn notes(&self, p: &Params, implementation: &str) -> Vec<String> {
        let causal = case_of(p).is_ok_and(|c| c.causal);
        if causal && matches!(implementation, "math" | "torch_math") {
            vec!["computes all T×T scores and masks half of them: TFLOP/s counts the useful work (the causal half)".into()]
        } else {
            Vec::new()
        }
    }

    fn label(&self, p: &Params) -> String {
        match case_of(p) {
            Ok(c) => format!(
                "B{} H{}/{} T{} D{} {} {} {}",
                c.batch,
                c.heads,
                c.kv_heads,
                c.seq_len_q,
                c.head_dim,
                if c.causal { "causal" } else { "full" },
                c.dtype.as_str(),
                c.pass.as_str()
            ),
            Err(_) => format!("{p:?}"),
        }
    }
}

fn run(cli: &Cli) -> Result<ExitCode> {
    if let Some(spec) = &cli.flash_config {
        // The case processes inherit the environment; FlashConfig::for_head_dim reads it.
        std::env::set_var("KP_FLASH_CONFIG", spec);
    }
    for d in [64, 128] {
        FlashConfig::for_head_dim(d)
            .map_err(anyhow::Error::msg)
            .context("--flash-config")?;
    }
    let own: Vec<(&str, &str)> = cli
        .implementations
        .iter()
        .map(|n| {
            Implementation::parse(n)
                .map(|i| (i.name(), i.library()))
                .with_context(|| format!("--implementations: unknown `{n}` (flash, math)"))
        })
        .collect::<Result<_>>()?;
    let imps = runner::implementations(&own, &ALTERNATIVES, &cli.run.compare)?;
    let cases = cli
        .run
        .select(cases(cli, &cli.seq_lens)?, cases(cli, &QUICK_SEQ_LENS)?)?;
    let declared = Declared {
        runner: "attention",
        flop_rule: Some(AttentionCase::FLOP_RULE.into()),
        dispatch: dispatch_rules(),
        axes: AttentionCase::AXES.iter().map(|a| a.to_string()).collect(),
        throughput: AttentionCase::throughput_decls(),
    };
    let suite = Attention {
        check_rows: cli.check_rows,
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
        upload(gpu, &host[0], &host[1], &host[2])
    }
    fn replicate(&self, gpu: &Gpu, set: &DeviceInputs) -> Result<DeviceInputs, GpuError> {
        replicate(gpu, set)
    }
    fn launch(
        &mut self,
        gpu: &Gpu,
        set: &DeviceInputs,
        out: &mut cudarc::driver::CudaSlice<u16>,
    ) -> Result<(), GpuError> {
        self.runner.launch(gpu, &self.case, set, out)
    }
    fn temporary_bytes(&self) -> u64 {
        self.imp.temporary_bytes(&self.case)
    }
    fn workspace_bytes(&self) -> u64 {
        self.runner.workspace_bytes()
    }
}

/// The case process: compile, first call, check and time one (case, implementation).
fn measure_own(job: &runner::protocol::Job) -> runner::protocol::Reply {
    let parsed = case_of(&job.case).and_then(|c| {
        Implementation::parse(&job.implementation)
            .map(|i| (c, i))
            .context("unknown implementation")
    });
    let (c, imp) = match parsed {
        Ok(x) => x,
        Err(e) => {
            return runner::protocol::Reply {
                row: kernelpages::schema::Row::failed(
                    job.case.clone(),
                    &job.implementation,
                    "",
                    false,
                    kernelpages::schema::Status::Error,
                    format!("{e:#}"),
                ),
                window: None,
                libraries: Default::default(),
                pid: None,
            }
        }
    };
    let dtype = c.dtype;
    own::measure(
        job,
        |gpu| {
            let (runner, compile_s) = Runner::new(gpu, imp, &c)?;
            Ok((
                Launch {
                    runner,
                    case: c.clone(),
                    imp,
                },
                compile_s,
            ))
        },
        move |bits| dtype.from_bits(bits) as f64,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use kernelpages::runner::Suite as _;

    #[test]
    fn default_grid_quick_grid_and_filter() {
        let cli = Cli::try_parse_from(["attention"]).unwrap();
        assert_eq!(cases(&cli, &cli.seq_lens).unwrap().len(), 2 * 2 * 6);
        let cli =
            Cli::try_parse_from(["attention", "--quick", "--filter", "head_dim=128"]).unwrap();
        let kept = cli
            .run
            .select(
                cases(&cli, &cli.seq_lens).unwrap(),
                cases(&cli, &QUICK_SEQ_LENS).unwrap(),
            )
            .unwrap();
        assert_eq!(kept.len(), 2 * 2);
        let cli = Cli::try_parse_from(["attention", "--shard", "1/2"]).unwrap();
        assert_eq!(cli.run.shard.unwrap().count, 2);
    }

    #[test]
    fn prepared_files_hold_the_inputs_and_the_reference() {
        let cli = Cli::try_parse_from([
            "attention",
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
        let p = &cases(&cli, &cli.seq_lens).unwrap()[0];
        let dir = tempfile::tempdir().unwrap();
        let suite = Attention { check_rows: 16 };
        let files = suite.prepare(p, 7, dir.path()).unwrap();
        let c = case_of(p).unwrap();
        let q = kernelpages::runner::protocol::read_u16(&files.inputs[0].path).unwrap();
        assert_eq!(q, Inputs::random(&c, 7).q);
        let reference = kernelpages::runner::protocol::read_f64(&files.check.reference).unwrap();
        let n: u64 = files.check.ranges.iter().map(|r| r[1]).sum();
        assert_eq!(reference.len() as u64, n);
        // The reference of row 0 of a causal slice is V's row 0.
        let v = kernelpages::runner::protocol::read_u16(&files.inputs[2].path).unwrap();
        assert_eq!(files.check.ranges[0], [0, 64]);
        for e in 0..64 {
            assert_eq!(reference[e], c.dtype.from_bits(v[e]) as f64);
        }
        assert_eq!(files.flops, Some(c.flops()));
        assert!(suite.notes(p, "math")[0].contains("useful work"));
        assert!(suite.notes(p, "flash").is_empty());
        assert!(suite.is_default(p, "flash"));
        assert!(suite.unsupported(p, "flash").is_none());
        assert!(suite.unsupported(p, "torch_cudnn").is_none());
    }

    #[test]
    fn the_dispatch_table_names_what_dispatch_picks() {
        let rules = dispatch_rules();
        let c = AttentionCase::new(1, 2, 1024, 128);
        assert_eq!(
            kernelpages::attention::dispatch(&c).map(|i| i.name()),
            Some(rules[0].implementation.as_str())
        );
        let odd = AttentionCase::new(1, 2, 100, 128);
        assert_eq!(
            kernelpages::attention::dispatch(&odd).map(|i| i.name()),
            Some(rules[1].implementation.as_str())
        );
    }
}
