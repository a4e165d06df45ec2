//! The `flash_sm80` implementation of the attention runner: the portable flash kernels
//! (mma.sync, compute capability 8.0 and newer) measured on their own where `flash` runs
//! another kernel, so that the page compares the two on the same card. Today that is compute
//! capability 9.0, where `flash` runs the wgmma forward for bf16 and fp16 at head_dim 64 and 128 (alone,
//! or with the wgmma backward: [`kernelpages::attention::sm90::takes`], issue 11).
//! Elsewhere `flash` is this kernel, and the row is `unsupported` with that reason (on another
//! device, when the case runs).

use kernelpages::attention::cuda::{FlashConfig, Implementation, Runner};
use kernelpages::attention::{sm90, AttentionCase};
use kernelpages::gpu::GpuError;
use kernelpages::runner::own;
use kernelpages::runner::protocol::{Job, Reply};

/// The implementation's name in documents and `--implementations`.
pub const IMPLEMENTATION: &str = "flash_sm80";

/// Why `flash_sm80` is not measured for case `c` on any device, or `None` (the device is
/// checked when the case runs).
pub fn unsupported(c: &AttentionCase) -> Option<String> {
    // The cases flash would give the wgmma forward on compute capability 9.0 (one rule:
    // sm90::takes); the device itself is checked when the case runs.
    if !sm90::takes("sm_90a", c) {
        return Some(format!(
            "flash runs this same portable kernel here; {IMPLEMENTATION} is measured where \
             flash runs the wgmma forward (bf16{}, head_dim 64 or 128, a positive scale, \
             compute capability 9.0)",
            if sm90::fp16_dispatched() {
                " or fp16"
            } else {
                ""
            }
        ));
    }
    Implementation::Flash.supports(c).err()
}

/// The case process of `flash_sm80`: the flash runner with the default forward configuration
/// given, which keeps it on the portable kernel ([`Runner::with_configs`]).
pub fn measure(job: &Job) -> Reply {
    let c = match super::job_case(job, unsupported) {
        Ok(c) => c,
        Err(reply) => return *reply,
    };
    own::measure(job, |gpu| {
        if !sm90::takes(&gpu.arch(), &c) {
            return Err(GpuError::Unsupported(format!(
                "flash runs this same portable kernel on {}; {IMPLEMENTATION} is measured where \
                 flash runs the wgmma kernel (compute capability 9.0)",
                gpu.arch()
            )));
        }
        let fwd = FlashConfig::for_head_dim(c.head_dim).map_err(GpuError::Config)?;
        let (runner, compile_s) =
            Runner::with_configs(gpu, Implementation::Flash, &c, Some(fwd), None)?;
        Ok((
            super::Launch {
                runner,
                case: c.clone(),
                imp: Implementation::Flash,
            },
            compile_s,
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kernelpages::attention::{Dtype, Pass};

    #[test]
    fn flash_sm80_is_measured_where_flash_may_run_the_wgmma_kernel() {
        let c = AttentionCase {
            causal: true,
            kv_lens: Some(vec![4096, 100, 1, 4096]),
            kv_heads: 2,
            ..AttentionCase::new(4, 8, 4096, 128)
        };
        assert_eq!(unsupported(&c), None);
        assert!(sm90::takes("sm_90a", &c));
        let both = AttentionCase {
            pass: Pass::FwdBwd,
            ..c.clone()
        };
        assert_eq!(unsupported(&both), None);
        assert!(sm90::takes("sm_90a", &both));
        let fp16 = AttentionCase {
            dtype: Dtype::F16,
            ..c.clone()
        };
        assert_eq!(unsupported(&fp16).is_none(), sm90::fp16_dispatched());
        for other in [
            AttentionCase {
                dtype: Dtype::F32,
                ..c.clone()
            },
            AttentionCase::new(1, 1, 64, 256),
            AttentionCase {
                scale: Some(-0.1),
                ..c.clone()
            },
        ] {
            let why = unsupported(&other).expect("not measured");
            assert!(why.contains("same portable kernel"), "{why}");
            assert!(!sm90::takes("sm_90a", &other));
        }
    }
}
