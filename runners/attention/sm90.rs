//! The `flash_sm90` implementation of the attention runner: the wgmma forward for compute
//! capability 9.0 (`kernels/attn_wgmma_sm90.cu`, [`kernelpages::attention::sm90`], issue 11;
//! the version [`kernelpages::attention::sm90::Sm90Version::for_shape`] picks), measured beside
//! `flash` on the same cases. Never a default yet: the dispatch keeps `flash` until the
//! document names the sm_80 kernel apart (`flash_sm80`) and this one has a backward. Forward,
//! bf16, head_dim 64 and 128, any lengths, causal or not, key lengths, GQA; `unsupported` with
//! the reason otherwise (and on any other device).

use kernelpages::attention::sm90::HopperForward;
use kernelpages::attention::{AttentionCase, Dtype, Pass};
use kernelpages::gpu::{Gpu, GpuError};
use kernelpages::runner::own;
use kernelpages::runner::protocol::{Job, Reply};

/// The implementation's name in documents and `--implementations`.
pub const IMPLEMENTATION: &str = "flash_sm90";

/// Why `flash_sm90` cannot run case `c`, or `None` (the device is checked when the case runs).
pub fn unsupported(c: &AttentionCase) -> Option<String> {
    if c.pass != Pass::Fwd {
        return Some("flash_sm90 runs the forward only (its backward is not written yet)".into());
    }
    if c.dtype != Dtype::Bf16 {
        return Some(format!("flash_sm90 runs bf16, not {}", c.dtype.as_str()));
    }
    if c.head_dim != 64 && c.head_dim != 128 {
        return Some(format!(
            "flash_sm90 runs head_dim 64 or 128, not {}",
            c.head_dim
        ));
    }
    None
}

/// Q, K, V of one input set on the device.
pub struct Sm90Set {
    q: cudarc::driver::CudaSlice<u16>,
    k: cudarc::driver::CudaSlice<u16>,
    v: cudarc::driver::CudaSlice<u16>,
}

/// The case process's launcher: the compiled kernel, the key lengths and the LSE.
struct Sm90Launch {
    fwd: HopperForward,
    case: AttentionCase,
    kv_lens: cudarc::driver::CudaSlice<i32>,
    lse: cudarc::driver::CudaSlice<f32>,
}

impl own::Launcher for Sm90Launch {
    type Set = Sm90Set;
    fn upload(&self, gpu: &Gpu, host: &[Vec<u16>]) -> Result<Sm90Set, GpuError> {
        let [q, k, v, ..] = host else {
            return Err(GpuError::Config("flash_sm90 takes q, k, v".into()));
        };
        Ok(Sm90Set {
            q: gpu.stream.clone_htod(q)?,
            k: gpu.stream.clone_htod(k)?,
            v: gpu.stream.clone_htod(v)?,
        })
    }
    fn replicate(&self, gpu: &Gpu, s: &Sm90Set) -> Result<Sm90Set, GpuError> {
        Ok(Sm90Set {
            q: gpu.stream.clone_dtod(&s.q)?,
            k: gpu.stream.clone_dtod(&s.k)?,
            v: gpu.stream.clone_dtod(&s.v)?,
        })
    }
    fn launch(
        &mut self,
        gpu: &Gpu,
        s: &Sm90Set,
        outs: &mut [cudarc::driver::CudaSlice<u16>],
    ) -> Result<(), GpuError> {
        let [o] = outs else {
            return Err(GpuError::Config("flash_sm90 writes one output".into()));
        };
        let c = &self.case;
        self.fwd.launch(
            gpu,
            (c.batch, c.heads, c.kv_heads, c.seq_len_q, c.seq_len_kv),
            (&s.q, &s.k, &s.v),
            &self.kv_lens,
            c.causal,
            c.scale(),
            o,
            &mut self.lse,
        )
    }
    fn temporary_bytes(&self) -> u64 {
        (self.lse.len() * 4 + self.kv_lens.len() * 4) as u64
    }
    fn residual_bytes(&self) -> Option<u64> {
        None
    }
    fn workspace_bytes(&self) -> u64 {
        0
    }
}

/// The case process of `flash_sm90`: compile, first call, check and time one case.
pub fn measure(job: &Job) -> Reply {
    let c = match super::job_case(job, unsupported) {
        Ok(c) => c,
        Err(reply) => return *reply,
    };
    own::measure(job, |gpu| {
        let fwd = HopperForward::new(gpu, c.head_dim, c.seq_len_q)?;
        let compile_s = fwd.compile_s;
        let lens: Vec<i32> = (0..c.batch).map(|b| c.kv_len(b) as i32).collect();
        let kv_lens = gpu.stream.clone_htod(&lens)?;
        let lse = gpu
            .stream
            .alloc_zeros::<f32>(c.batch * c.heads * c.seq_len_q)?;
        Ok((
            Sm90Launch {
                fwd,
                case: c.clone(),
                kv_lens,
                lse,
            },
            compile_s,
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flash_sm90_takes_the_bf16_forward_at_head_dim_64_and_128() {
        let c = AttentionCase {
            causal: true,
            kv_lens: Some(vec![4096, 100, 1, 4096]),
            kv_heads: 2,
            ..AttentionCase::new(4, 8, 4096, 128)
        };
        assert_eq!(unsupported(&c), None);
        let bwd = AttentionCase {
            pass: Pass::FwdBwd,
            ..c.clone()
        };
        assert!(unsupported(&bwd).unwrap().contains("forward only"));
        let fp16 = AttentionCase {
            dtype: Dtype::F16,
            ..c.clone()
        };
        assert!(unsupported(&fp16).unwrap().contains("bf16"));
        let wide = AttentionCase::new(1, 1, 64, 256);
        assert!(unsupported(&wide).unwrap().contains("head_dim"));
    }
}
