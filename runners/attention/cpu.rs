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
    dot_product_attention_backward_into, dot_product_attention_into,
    dot_product_attention_lse_into, read_elements, Element, ElementType, Gradients, Options, Shape,
    BLOCK_KV, BLOCK_Q,
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
        Ok((c, _)) if c.kv_lens.is_some() => {
            Some("per-sequence key lengths are not implemented in cpu_flash".into())
        }
        Ok(_) => None,
        Err(e) => Some(format!("{e:#}")),
    }
}

/// `cpu_flash` on one case, as the shared CPU case process drives it: the forward
/// ([`dot_product_attention_into`]), or for `fwd+bwd` the forward keeping its log-sum-exp
/// then the backward for the job's dO ([`dot_product_attention_lse_into`],
/// [`dot_product_attention_backward_into`]), every result in buffers allocated once.
struct Launch<T: Element> {
    shape: Shape,
    options: Options,
    out: Vec<T>,
    /// The forward's natural-log log-sum-exp per query row, and dQ, dK, dV (`fwd+bwd` only).
    backward: Option<(Vec<f32>, Gradients<T>)>,
}

impl<T: Element> Launch<T> {
    fn new(shape: Shape, options: Options, backward: bool) -> Launch<T> {
        let zero = T::from_f32(0.0);
        Launch {
            shape,
            options,
            out: vec![zero; shape.q_elems()],
            backward: backward.then(|| {
                (
                    vec![0.0f32; shape.batch * shape.heads * shape.seq_len_q],
                    Gradients {
                        dq: vec![zero; shape.q_elems()],
                        dk: vec![zero; shape.kv_elems()],
                        dv: vec![zero; shape.kv_elems()],
                    },
                )
            }),
        }
    }
}

impl<T: Element> host::Launcher for Launch<T> {
    /// Q, K, V, and dO for `fwd+bwd`.
    type Set = Vec<Vec<T>>;
    fn load(&self, inputs: &[TensorFile]) -> Result<Vec<Vec<T>>> {
        let want = if self.backward.is_some() { 4 } else { 3 };
        anyhow::ensure!(
            inputs.len() == want,
            "expected {} inputs (q, k, v{}); got {}",
            want,
            if want == 4 { ", do" } else { "" },
            inputs.len()
        );
        for t in inputs {
            anyhow::ensure!(
                t.dtype == T::TYPE.as_str(),
                "input {} is {}, expected {}",
                t.name,
                t.dtype,
                T::TYPE.as_str()
            );
        }
        inputs.iter().map(|t| read_elements(&t.path)).collect()
    }
    fn replicate(&self, set: &Vec<Vec<T>>) -> Vec<Vec<T>> {
        set.clone()
    }
    fn poison(&mut self) {
        let nan = T::from_f32(f32::NAN);
        self.out.fill(nan);
        if let Some((_, g)) = &mut self.backward {
            g.dq.fill(nan);
            g.dk.fill(nan);
            g.dv.fill(nan);
        }
    }
    fn call(&mut self, set: &Vec<Vec<T>>) -> Result<()> {
        let (q, k, v) = (&set[0], &set[1], &set[2]);
        match &mut self.backward {
            None => dot_product_attention_into(q, k, v, &self.shape, &self.options, &mut self.out)?,
            Some((lse, g)) => {
                dot_product_attention_lse_into(
                    q,
                    k,
                    v,
                    &self.shape,
                    &self.options,
                    &mut self.out,
                    lse,
                )?;
                dot_product_attention_backward_into(
                    q,
                    k,
                    v,
                    &self.out,
                    &set[3],
                    lse,
                    &self.shape,
                    &self.options,
                    g,
                )?;
            }
        }
        Ok(())
    }
    fn value(&self, i: usize) -> f64 {
        self.out[i].to_f32() as f64
    }
    fn output_len(&self) -> usize {
        self.out.len()
    }
    /// dQ, dK, dV in the order of the job's `gradients`.
    fn gradient_value(&self, k: usize, i: usize) -> f64 {
        match (&self.backward, k) {
            (Some((_, g)), 0) => g.dq[i].to_f32() as f64,
            (Some((_, g)), 1) => g.dk[i].to_f32() as f64,
            (Some((_, g)), 2) => g.dv[i].to_f32() as f64,
            _ => f64::NAN,
        }
    }
    fn gradient_len(&self, k: usize) -> usize {
        match (&self.backward, k) {
            (Some((_, g)), 0) => g.dq.len(),
            (Some((_, g)), 1) => g.dk.len(),
            (Some((_, g)), 2) => g.dv.len(),
            _ => 0,
        }
    }
    /// The forward: K and V widened to float32 (16-bit inputs), and per task a float32 copy
    /// of its query block, its accumulator and one score tile, for as many tasks as threads.
    /// With the backward, the larger of that and the backward's: Q, K, V and dO widened to
    /// float32 (always: the backward copies fp32 too), two floats per query row (the base-2
    /// log-sum-exp and dO·O), and per task the larger of a dK/dV task's (two key-block
    /// accumulators, a probability and a dP tile) and a dQ task's (an accumulator and two tiles).
    fn temporary_bytes(&self) -> u64 {
        let s = &self.shape;
        let threads = rayon::current_num_threads();
        let widened = if T::TYPE == ElementType::F32 {
            0
        } else {
            2 * s.kv_elems() * 4
        };
        let per_task = (2 * BLOCK_Q * s.head_dim + BLOCK_Q * BLOCK_KV + 2 * BLOCK_Q) * 4;
        let forward = widened + threads * per_task;
        if self.backward.is_none() {
            return forward as u64;
        }
        let rows = s.batch * s.heads * s.seq_len_q;
        let kv_task = (2 * BLOCK_KV * s.head_dim + 2 * BLOCK_Q * BLOCK_KV) * 4;
        let q_task = (BLOCK_Q * s.head_dim + 2 * BLOCK_Q * BLOCK_KV) * 4;
        let backward =
            (2 * s.q_elems() + 2 * s.kv_elems()) * 4 + 2 * rows * 4 + threads * kv_task.max(q_task);
        forward.max(backward) as u64
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
        let backward = c.pass == Pass::FwdBwd;
        host::measure(job, || Ok(Launch::<T>::new(shape, options, backward)))
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
    fn key_lengths_are_unsupported_with_a_reason() {
        let (c, _) = case_of(&case(ElementType::Bf16)).unwrap();
        let bwd = AttentionCase {
            pass: Pass::FwdBwd,
            ..c.clone()
        };
        assert!(unsupported(&bwd.params()).is_none());
        let lens = AttentionCase {
            kv_lens: Some(vec![50]),
            ..c.clone()
        };
        assert!(unsupported(&lens.params()).unwrap().contains("key lengths"));
        assert!(unsupported(&c.params()).is_none());
    }

    #[test]
    fn every_type_measures_ok_against_its_reference() {
        for (e, pass) in [ElementType::Bf16, ElementType::F16, ElementType::F32]
            .into_iter()
            .flat_map(|e| [(e, Pass::Fwd), (e, Pass::FwdBwd)])
        {
            let dir = tempfile::tempdir().unwrap();
            let (c, _) = case_of(&case(e)).unwrap();
            let c = AttentionCase { pass, ..c };
            let p = c.params();
            let grads = if pass == Pass::FwdBwd { 3 } else { 0 };
            let files = kernelpages::attention::files::write_case(&c, 3, 16, dir.path()).unwrap();
            assert_eq!(files.inputs[0].dtype, e.as_str());
            assert_eq!(files.gradients.len(), grads);
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
            assert_eq!(row.status, Status::Ok, "{e:?} {pass:?} {row:?}");
            let acc = row.accuracy.unwrap();
            assert!(acc.rel_err < acc.tolerance / 4.0, "{e:?} {pass:?} {acc:?}");
            assert!(row.host_ms.is_none());
        }
    }
}
