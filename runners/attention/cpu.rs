//! `attention --device cpu`: the CPU grid, the project's CPU implementation (`cpu_flash`,
//! [`kernelpages::attention::cpu_flash`]), PyTorch's CPU `scaled_dot_product_attention` as
//! the alternative (`runners/compare/torch_cpu.py`), the case files and the case process.
//!
//! The case files are the GPU grid's (`files::write_case`, through the suite's `prepare`): the
//! same input bits and float64 reference for the same case and seed.
//!
//! ```text
//! attention --device cpu --compare torch --output data/cpu_attention.json
//! ```

use anyhow::Result;

use kernelpages::attention::cpu_flash::{
    dot_product_attention_into, read_elements, Element, ElementType, Options, Shape, BLOCK_KV,
    BLOCK_Q,
};
use kernelpages::attention::{AttentionCase, Pass};
use kernelpages::runner::grid::Params;
use kernelpages::runner::protocol::{Job, Reply, TensorFile};
use kernelpages::runner::{host, Alternative};
use kernelpages::schema::DispatchRule;

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

/// A CPU case and its element type from its parameters.
///
/// # Errors
/// A missing or mistyped parameter, an unknown dtype.
pub fn case_of(p: &Params) -> Result<(AttentionCase, ElementType)> {
    let c = AttentionCase::from_params(p).map_err(anyhow::Error::msg)?;
    let element = ElementType::from(c.dtype);
    Ok((c, element))
}

/// The CPU document's throughput: GFLOP/s by the suite's FLOP rule (TFLOP/s would read 0.0
/// on a CPU); no ceiling is measured.
pub fn throughput_decls() -> Vec<kernelpages::schema::Throughput> {
    vec![kernelpages::schema::Throughput {
        key: "gflops".into(),
        unit: "GFLOP/s".into(),
        count: kernelpages::schema::Count::Flops,
        per_second: 1e9,
        ceiling: None,
    }]
}

/// What the public entry points run on the CPU (one implementation for every case;
/// [`kernelpages::attention::api::implementation`] with `Device::Cpu`).
pub fn dispatch_rules() -> Vec<DispatchRule> {
    let device = "CPU (x86-64 or any other target; AVX2 + FMA used where present)";
    vec![
        DispatchRule {
            entry_point: "attention::dot_product_attention, attention::dot_product_attention_vjp (Device::Cpu)".into(),
            device: device.into(),
            dtype: "bf16, fp16, fp32 (computed in float32)".into(),
            rule: "always: any shape, heads a multiple of kv_heads; forward and forward + backward".into(),
            implementation: IMPLEMENTATION.into(),
        },
        DispatchRule {
            entry_point: "attention::mha (Device::Cpu)".into(),
            device: device.into(),
            dtype: "bf16, fp16, fp32 (computed in float32)".into(),
            rule: "always: the four projections through the gemm crate on rayon's threads (float32, rounded to the input type), the attention as dot_product_attention".into(),
            implementation: format!("gemm + {IMPLEMENTATION}"),
        },
    ]
}

/// Why the project's CPU implementation cannot run a case, when it cannot.
pub fn unsupported(p: &Params) -> Option<String> {
    match case_of(p) {
        Ok((c, _)) if c.pass != Pass::Fwd => {
            Some("fwd+bwd is not measured on the CPU yet: the CPU case process times the forward only (attention::cpu_flash::dot_product_attention_vjp is tested, not timed)".into())
        }
        Ok((c, _)) if c.kv_lens.is_some() => {
            Some("per-sequence key lengths are not implemented in cpu_flash".into())
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
            scale: c.scale,
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
        Err(e) => Reply::failed(job, kernelpages::schema::Status::Error, format!("{e:#}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kernelpages::attention::Dtype;
    use kernelpages::harness::default_timing;
    use kernelpages::runner::DeviceChoice;
    use kernelpages::schema::Param;
    use kernelpages::schema::Status;

    fn case(element: ElementType) -> Params {
        let dtype = match element {
            ElementType::Bf16 => Dtype::Bf16,
            ElementType::F16 => Dtype::F16,
            ElementType::F32 => Dtype::F32,
        };
        AttentionCase {
            kv_heads: 1,
            causal: true,
            dtype,
            ..AttentionCase::new(1, 2, 100, 32)
        }
        .params()
    }

    #[test]
    fn fp32_cases_round_trip() {
        let p = case(ElementType::F32);
        assert_eq!(p.get("dtype"), Some(&Param::Text("fp32".into())));
        let (c, e) = case_of(&p).unwrap();
        assert_eq!((c.seq_len_q, e), (100, ElementType::F32));
    }

    #[test]
    fn the_backward_and_key_lengths_are_unsupported_with_a_reason() {
        let (c, _) = case_of(&case(ElementType::Bf16)).unwrap();
        let bwd = AttentionCase {
            pass: Pass::FwdBwd,
            ..c.clone()
        };
        assert!(unsupported(&bwd.params()).unwrap().contains("forward only"));
        let lens = AttentionCase {
            kv_lens: Some(vec![50]),
            ..c.clone()
        };
        assert!(unsupported(&lens.params()).unwrap().contains("key lengths"));
        assert!(unsupported(&c.params()).is_none());
    }

    #[test]
    fn every_type_measures_ok_against_its_reference() {
        for e in [ElementType::Bf16, ElementType::F16, ElementType::F32] {
            let dir = tempfile::tempdir().unwrap();
            let p = case(e);
            let (c, _) = case_of(&p).unwrap();
            let files = kernelpages::attention::files::write_case(&c, 3, 16, dir.path()).unwrap();
            assert_eq!(files.inputs[0].dtype, e.as_str());
            assert_eq!(
                std::fs::metadata(&files.inputs[0].path).unwrap().len(),
                (200 * 32 * e.bytes()) as u64
            );
            let job = Job {
                case: p,
                implementation: IMPLEMENTATION.into(),
                device: DeviceChoice::Cpu,
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
