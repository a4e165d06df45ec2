//! The `flex` implementation of the attention runner: the flex_attention forward (issue 10 §1;
//! `kernels/flex_attn_fwd_sm90.cu` on compute capability 9.0, `kernels/flex_attn_fwd.cu`
//! elsewhere: [`kernelpages::attention::flex::FlexKernel`]) and, for forward + backward, its
//! backward (`kernels/flex_attn_bwd.cu`). On a masks-grid case it runs the modification
//! the case names (its `mask` parameter, with the document ids of
//! [`kernelpages::attention::flex::document_lengths`] for `document`); on the other grids' cases
//! the case's own mask: bottom-right causal (`FlexMod::Causal`, the same mask as every other
//! implementation's causal) or none, which measures what generating the mask costs against
//! `flash` on the same cases.

use kernelpages::attention::cpu_flash::Shape;
use kernelpages::attention::flex::{aux_for, FlexAttention, FlexMod, FlexShape, FlexSpec};
use kernelpages::attention::{AttentionCase, Pass};
use kernelpages::gpu::{Gpu, GpuError};
use kernelpages::runner::own;
use kernelpages::runner::protocol::{Job, Reply};

/// The implementation's name in documents and `--implementations`.
pub const IMPLEMENTATION: &str = "flex";

/// The flex kernels' shape for case `c` (its scale resolved).
fn shape_of(c: &AttentionCase) -> FlexShape {
    FlexShape::new(&Shape::of_case(c), c.dtype, c.scale())
}

/// The modification case `c` asks for when it names none: causal (bottom-right) or no mask.
pub fn mod_of(c: &AttentionCase) -> Option<FlexMod> {
    c.causal.then_some(FlexMod::Causal)
}

/// The kernel expressions of `m` (`none`: no mask, no modification).
pub fn spec_of(m: Option<FlexMod>) -> FlexSpec {
    m.map_or_else(
        || FlexSpec {
            name: "none".into(),
            mask: None,
            score: None,
            score_grad: None,
        },
        |m| m.spec(),
    )
}

/// Why `flex` cannot run case `c`, or `None`: the flex kernels' shapes
/// ([`FlexShape::unsupported`]).
pub fn unsupported(c: &AttentionCase) -> Option<String> {
    shape_of(c).unsupported()
}

/// Q, K, V (and dO for forward + backward) of one input set on the device.
pub struct FlexSet {
    q: cudarc::driver::CudaSlice<u16>,
    k: cudarc::driver::CudaSlice<u16>,
    v: cudarc::driver::CudaSlice<u16>,
    dout: Option<cudarc::driver::CudaSlice<u16>>,
}

/// The case process's launcher: the compiled kernels with their block masks, and the LSE.
struct FlexLaunch {
    flex: FlexAttention,
    lse: cudarc::driver::CudaSlice<f32>,
    case: AttentionCase,
}

impl own::Launcher for FlexLaunch {
    type Set = FlexSet;
    fn upload(&self, gpu: &Gpu, host: &[Vec<u16>]) -> Result<FlexSet, GpuError> {
        let [q, k, v, rest @ ..] = host else {
            return Err(GpuError::Config("flex takes q, k, v (and do)".into()));
        };
        Ok(FlexSet {
            q: gpu.stream.clone_htod(q)?,
            k: gpu.stream.clone_htod(k)?,
            v: gpu.stream.clone_htod(v)?,
            dout: match rest.first() {
                Some(d) => Some(gpu.stream.clone_htod(d)?),
                None => None,
            },
        })
    }
    fn replicate(&self, gpu: &Gpu, s: &FlexSet) -> Result<FlexSet, GpuError> {
        Ok(FlexSet {
            q: gpu.stream.clone_dtod(&s.q)?,
            k: gpu.stream.clone_dtod(&s.k)?,
            v: gpu.stream.clone_dtod(&s.v)?,
            dout: match &s.dout {
                Some(d) => Some(gpu.stream.clone_dtod(d)?),
                None => None,
            },
        })
    }
    fn launch(
        &mut self,
        gpu: &Gpu,
        s: &FlexSet,
        outs: &mut [cudarc::driver::CudaSlice<u16>],
    ) -> Result<(), GpuError> {
        match (outs, &s.dout) {
            ([o], _) => self.flex.launch(gpu, &s.q, &s.k, &s.v, o, &mut self.lse),
            ([o, dq, dk, dv], Some(dout)) => {
                self.flex.launch(gpu, &s.q, &s.k, &s.v, o, &mut self.lse)?;
                self.flex
                    .launch_backward(gpu, (&s.q, &s.k, &s.v), o, &self.lse, dout, dq, dk, dv)
            }
            _ => Err(GpuError::Config(
                "flex writes O (and dQ, dK, dV from dO for forward + backward)".into(),
            )),
        }
    }
    fn temporary_bytes(&self) -> u64 {
        let lse = self.lse.len() as u64 * 4;
        let bwd = self.flex.backward_bytes();
        // With a backward the LSE is a residual, not a temporary.
        self.flex.block_mask_bytes() + bwd + if bwd > 0 { 0 } else { lse }
    }
    fn residual_bytes(&self) -> Option<u64> {
        // What the forward keeps for the backward: O and the LSE.
        (self.case.pass == Pass::FwdBwd).then(|| {
            (self.case.q_elems() * self.case.dtype.bytes()) as u64 + self.lse.len() as u64 * 4
        })
    }
    fn workspace_bytes(&self) -> u64 {
        0
    }
}

/// The case process of `flex`: compile, block mask, first call, check and time one case
/// (`own::measure`); the row's note names the modification, the forward kernel and the block
/// mask's tiles.
pub fn measure(job: &Job) -> Reply {
    let c = match super::job_case(job, unsupported) {
        Ok(c) => c,
        Err(reply) => return *reply,
    };
    let m = match super::masks::mask_of(&job.case) {
        None => mod_of(&c),
        Some(Ok(m)) => m,
        Some(Err(e)) => return Reply::failed(job, kernelpages::schema::Status::Error, e),
    };
    let spec = spec_of(m);
    let aux = aux_for(m, c.batch, c.seq_len_kv);
    let mut noted: Option<String> = None;
    let mut reply = own::measure(job, |gpu| {
        let lens: Vec<usize> = (0..c.batch).map(|b| c.kv_len(b)).collect();
        let mut flex = FlexAttention::new(gpu, shape_of(&c), &spec, &lens, &aux)?;
        if c.pass == Pass::FwdBwd {
            flex.enable_backward(gpu)?;
        }
        let (listed, whole, all) = flex.block_mask(gpu)?.tiles(flex.key_tiles());
        noted = Some(format!(
            "flex_attention with mask `{}` ({}{}), forward on {}{}: the block mask lists \
             {listed} of {all} tiles, {whole} of them whole (no mask evaluated)",
            spec.name,
            spec.mask.as_deref().unwrap_or("none"),
            spec.score
                .as_deref()
                .map(|s| format!("; score {s}"))
                .unwrap_or_default(),
            flex.kernel().describe(),
            flex.backward_kernel()
                .map(|k| format!(", backward on {}", k.describe(c.head_dim)))
                .unwrap_or_default()
        ));
        let compile_s = flex.compile_s;
        let lse = gpu
            .stream
            .alloc_zeros::<f32>(c.batch * c.heads * c.seq_len_q)?;
        Ok((
            FlexLaunch {
                flex,
                lse,
                case: c.clone(),
            },
            compile_s,
        ))
    });
    if reply.row.status == kernelpages::schema::Status::Ok {
        reply.row.notes.extend(noted);
    }
    reply
}

#[cfg(test)]
mod tests {
    use super::*;
    use kernelpages::attention::Dtype;

    #[test]
    fn flex_takes_bf16_fp16_at_head_dim_64_and_128_both_passes() {
        let c = AttentionCase {
            causal: true,
            ..AttentionCase::new(4, 8, 4096, 128)
        };
        assert_eq!(unsupported(&c), None);
        assert_eq!(spec_of(mod_of(&c)), FlexMod::Causal.spec());
        assert_eq!(
            spec_of(mod_of(&AttentionCase::new(1, 1, 64, 64))).mask,
            None
        );
        let bwd = AttentionCase {
            pass: Pass::FwdBwd,
            ..c.clone()
        };
        assert_eq!(unsupported(&bwd), None);
        let wide = AttentionCase::new(1, 1, 64, 256);
        assert!(unsupported(&wide).unwrap().contains("head_dim"));
        let f32c = AttentionCase {
            dtype: Dtype::F32,
            ..c
        };
        assert!(unsupported(&f32c).unwrap().contains("bf16 or fp16"));
    }
}
