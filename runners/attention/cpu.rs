//! `attention --device cpu`: the CPU grid, the project's CPU implementation (`cpu_flash`,
//! [`kernelpages::attention::cpu_flash`]), PyTorch's CPU `scaled_dot_product_attention` as
//! the alternative (`runners/compare/torch_cpu.py`), the case files and the case process.
//!
//! The CPU takes fp32 besides the 16-bit types. [`AttentionCase`]'s `dtype` is 16-bit only
//! (the CUDA code matches on it), so a CPU case is an [`AttentionCase`] for the sizes and an
//! [`ElementType`] for the inputs: [`case_of`] and [`params`] convert, and nothing of the CPU
//! path reads the case's `dtype` field.
//!
//! ```text
//! attention --device cpu --compare torch --output data/cpu_attention.json
//! ```

use std::path::Path;

use anyhow::{Context, Result};

use kernelpages::attention::cpu::{normal_bits, CheckPlan};
use kernelpages::attention::cpu_flash::{
    self, dot_product_attention_into, read_elements, Element, ElementType, Options, Shape,
    BLOCK_KV, BLOCK_Q,
};
use kernelpages::attention::{AttentionCase, Dtype};
use kernelpages::runner::grid::Params;
use kernelpages::runner::protocol::{
    write_f64, CaseFiles, CheckSpec, Job, OutputSpec, Reply, TensorFile,
};
use kernelpages::runner::{host, Alternative};
use kernelpages::schema::{DispatchRule, Param, Reference};

/// The project's CPU implementation.
pub const IMPLEMENTATION: &str = "cpu_flash";

/// The alternatives `--compare` can add on the CPU.
pub const ALTERNATIVES: [Alternative; 1] = [Alternative {
    name: "torch",
    module: "torch_cpu",
    library: "PyTorch",
    implementations: &["torch_cpu_flash", "torch_cpu_math"],
}];

/// Batch size of the CPU grid.
pub const BATCH: usize = 2;
/// Sequence lengths of the CPU grid.
pub const SEQ_LENS: [usize; 5] = [128, 256, 512, 1024, 2048];
/// Sequence lengths of the CPU `--quick` grid.
pub const QUICK_SEQ_LENS: [usize; 2] = [128, 256];
/// Element types of the CPU grid.
pub const DTYPES: [&str; 2] = ["bf16", "fp32"];

/// A CPU case's sizes and input type from its parameters.
///
/// # Errors
/// A missing or mistyped parameter, an unknown dtype.
pub fn case_of(p: &Params) -> Result<(AttentionCase, ElementType)> {
    let element = match p.get("dtype") {
        Some(Param::Text(s)) => {
            ElementType::parse(s).with_context(|| format!("unknown dtype `{s}`"))?
        }
        other => anyhow::bail!("case parameter `dtype` must be text, got {other:?}"),
    };
    // The sizes through the shared parser, with a 16-bit stand-in for fp32.
    let mut sizes = p.clone();
    sizes.insert("dtype".into(), Param::Text(Dtype::Bf16.as_str().into()));
    let c = AttentionCase::from_params(&sizes).map_err(anyhow::Error::msg)?;
    Ok((c, element))
}

/// The parameters of a CPU case (`dtype` is the element type's name).
pub fn params(c: &AttentionCase, element: ElementType) -> Params {
    let mut p = c.params();
    p.insert("dtype".into(), Param::Text(element.as_str().into()));
    p
}

/// What the CPU entry point runs (one implementation for every case).
pub fn dispatch_rules() -> Vec<DispatchRule> {
    vec![DispatchRule {
        entry_point: "attention::cpu_flash::dot_product_attention".into(),
        device: "CPU (x86-64 or any other target; AVX2 + FMA used where present)".into(),
        dtype: "bf16, fp16, fp32 (computed in float32)".into(),
        rule: "always: any shape, heads a multiple of kv_heads".into(),
        implementation: IMPLEMENTATION.into(),
    }]
}

fn write_elements(path: &Path, bytes: Vec<u8>) -> Result<()> {
    std::fs::write(path, bytes).with_context(|| format!("writing {}", path.display()))
}

/// Q, K, V as standard normals (seeds `seed`, `seed + 1`, `seed + 2`; the 16-bit types from
/// the same generator as the GPU grid, fp32 from [`cpu_flash::normal_f32`]), and the float64
/// reference of 4 (batch, head) slices × `check_rows` query rows.
pub fn prepare(p: &Params, seed: u64, dir: &Path, check_rows: usize) -> Result<CaseFiles> {
    let (c, element) = case_of(p)?;
    let shape = Shape::of_case(&c);
    let options = Options {
        causal: c.causal,
        scale: None,
    };
    let plan = CheckPlan::new(&c, check_rows, seed ^ 0x5eed);
    let draw = |n: usize, s: u64| -> Vec<u8> {
        match element {
            ElementType::F32 => cpu_flash::normal_f32(n, s)
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect(),
            ElementType::Bf16 | ElementType::F16 => {
                let dt = if element == ElementType::Bf16 {
                    Dtype::Bf16
                } else {
                    Dtype::F16
                };
                normal_bits(n, dt, s)
                    .iter()
                    .flat_map(|x| x.to_le_bytes())
                    .collect()
            }
        }
    };
    let q_shape = vec![c.batch, c.heads, c.seq_len, c.head_dim];
    let kv_shape = vec![c.batch, c.kv_heads, c.seq_len, c.head_dim];
    let mut inputs = Vec::new();
    for (i, (name, n, shape)) in [
        ("q", c.q_elems(), &q_shape),
        ("k", c.kv_elems(), &kv_shape),
        ("v", c.kv_elems(), &kv_shape),
    ]
    .into_iter()
    .enumerate()
    {
        let path = dir.join(format!("{name}.bin"));
        write_elements(&path, draw(n, seed.wrapping_add(i as u64)))?;
        inputs.push(TensorFile {
            name: name.into(),
            dtype: element.as_str().into(),
            shape: shape.clone(),
            path,
        });
    }
    fn reference<T: Element>(
        inputs: &[TensorFile],
        shape: &Shape,
        options: &Options,
        plan: &CheckPlan,
    ) -> Result<Vec<f64>> {
        let q = read_elements::<T>(&inputs[0].path)?;
        let k = read_elements::<T>(&inputs[1].path)?;
        let v = read_elements::<T>(&inputs[2].path)?;
        Ok(cpu_flash::reference_values(
            &q, &k, &v, shape, options, plan,
        ))
    }
    let values = match element {
        ElementType::Bf16 => reference::<half::bf16>(&inputs, &shape, &options, &plan)?,
        ElementType::F16 => reference::<half::f16>(&inputs, &shape, &options, &plan)?,
        ElementType::F32 => reference::<f32>(&inputs, &shape, &options, &plan)?,
    };
    let ref_path = dir.join("reference.f64");
    write_f64(&ref_path, &values)?;
    Ok(CaseFiles {
        inputs,
        output: OutputSpec {
            dtype: element.as_str().into(),
            shape: q_shape,
        },
        check: CheckSpec {
            ranges: plan.ranges(&c),
            reference: ref_path,
            reference_kind: Reference::Float64Cpu,
            tolerance: element.tolerance(),
            checked: plan.describe(&c),
        },
        flops: Some(c.flops()),
        bytes: None,
    })
}

/// Short label of a CPU case for progress lines.
pub fn label(p: &Params) -> String {
    match case_of(p) {
        Ok((c, e)) => format!(
            "B{} H{}/{} T{} D{} {} {} {}",
            c.batch,
            c.heads,
            c.kv_heads,
            c.seq_len,
            c.head_dim,
            if c.causal { "causal" } else { "full" },
            e.as_str(),
            c.pass.as_str()
        ),
        Err(_) => format!("{p:?}"),
    }
}

/// Why the project's CPU implementation cannot run a case, when it cannot.
pub fn unsupported(p: &Params) -> Option<String> {
    match case_of(p) {
        Ok((c, _)) if c.pass != kernelpages::attention::Pass::Fwd => {
            Some("fwd+bwd is not measured on the CPU yet: the runner's fwd+bwd protocol (dO input, gradient checks) is not in place; attention::cpu_flash::dot_product_attention_vjp is".into())
        }
        Ok(_) => None,
        Err(e) => Some(format!("{e:#}")),
    }
}

/// `cpu_flash` on one case, as the shared CPU case process drives it.
struct Launch<T: Element> {
    shape: Shape,
    options: Options,
    out: Vec<T>,
}

impl<T: Element> host::Launcher for Launch<T> {
    type Set = [Vec<T>; 3];
    fn load(&self, inputs: &[TensorFile]) -> Result<[Vec<T>; 3]> {
        anyhow::ensure!(inputs.len() == 3, "expected q, k, v; got {}", inputs.len());
        for t in inputs {
            anyhow::ensure!(
                t.dtype == T::TYPE.as_str(),
                "input {} is {}, expected {}",
                t.name,
                t.dtype,
                T::TYPE.as_str()
            );
        }
        Ok([
            read_elements(&inputs[0].path)?,
            read_elements(&inputs[1].path)?,
            read_elements(&inputs[2].path)?,
        ])
    }
    fn replicate(&self, set: &[Vec<T>; 3]) -> [Vec<T>; 3] {
        set.clone()
    }
    fn poison(&mut self) {
        self.out.fill(T::from_f32(f32::NAN));
    }
    fn call(&mut self, set: &[Vec<T>; 3]) -> Result<()> {
        dot_product_attention_into(
            &set[0],
            &set[1],
            &set[2],
            &self.shape,
            &self.options,
            &mut self.out,
        )?;
        Ok(())
    }
    fn value(&self, i: usize) -> f64 {
        self.out[i].to_f32() as f64
    }
    fn output_len(&self) -> usize {
        self.out.len()
    }
    /// K and V widened to float32 (16-bit inputs), and per task a float32 copy of its query
    /// block, its accumulator and one score tile, for as many tasks as threads.
    fn temporary_bytes(&self) -> u64 {
        let s = &self.shape;
        let widened = if T::TYPE == ElementType::F32 {
            0
        } else {
            2 * s.kv_elems() * 4
        };
        let per_task = (2 * BLOCK_Q * s.head_dim + BLOCK_Q * BLOCK_KV + 2 * BLOCK_Q) * 4;
        (widened + rayon::current_num_threads() * per_task) as u64
    }
}

/// The case process for `cpu_flash`.
pub fn measure(job: &Job) -> Reply {
    fn run<T: Element>(job: &Job, c: &AttentionCase) -> Reply {
        let shape = Shape::of_case(c);
        let options = Options {
            causal: c.causal,
            scale: None,
        };
        host::measure(job, || {
            Ok(Launch::<T> {
                shape,
                options,
                out: vec![T::from_f32(0.0); shape.q_elems()],
            })
        })
    }
    match case_of(&job.case) {
        Ok((c, ElementType::Bf16)) => run::<half::bf16>(job, &c),
        Ok((c, ElementType::F16)) => run::<half::f16>(job, &c),
        Ok((c, ElementType::F32)) => run::<f32>(job, &c),
        Err(e) => Reply {
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
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kernelpages::attention::Pass;
    use kernelpages::harness::default_timing;
    use kernelpages::schema::Status;

    fn case(element: ElementType) -> Params {
        let c = AttentionCase {
            batch: 1,
            heads: 2,
            kv_heads: 1,
            seq_len: 100,
            head_dim: 32,
            causal: true,
            dtype: Dtype::Bf16,
            pass: Pass::Fwd,
        };
        params(&c, element)
    }

    #[test]
    fn fp32_cases_round_trip() {
        let p = case(ElementType::F32);
        assert_eq!(p.get("dtype"), Some(&Param::Text("fp32".into())));
        let (c, e) = case_of(&p).unwrap();
        assert_eq!((c.seq_len, e), (100, ElementType::F32));
        assert_eq!(label(&p), "B1 H2/1 T100 D32 causal fp32 fwd");
    }

    #[test]
    fn every_type_measures_ok_against_its_reference() {
        for e in [ElementType::Bf16, ElementType::F16, ElementType::F32] {
            let dir = tempfile::tempdir().unwrap();
            let p = case(e);
            let files = prepare(&p, 3, dir.path(), 16).unwrap();
            assert_eq!(files.inputs[0].dtype, e.as_str());
            assert_eq!(
                std::fs::metadata(&files.inputs[0].path).unwrap().len(),
                (200 * 32 * e.bytes()) as u64
            );
            let job = Job {
                case: p,
                implementation: IMPLEMENTATION.into(),
                timing: kernelpages::schema::TimingConfig {
                    warmup_ms: 2.0,
                    repeats: 3,
                    min_sample_ms: 0.5,
                    ..default_timing()
                },
                l2_bytes: 1 << 20,
                files,
            };
            let row = measure(&job).row;
            assert_eq!(row.status, Status::Ok, "{row:?}");
            let acc = row.accuracy.unwrap();
            assert!(acc.rel_err < acc.tolerance / 4.0, "{e:?} {acc:?}");
            assert!(row.host_ms.is_none());
        }
    }
}
