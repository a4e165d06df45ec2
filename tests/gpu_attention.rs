//! GPU correctness of the attention kernels against the float64 CPU reference.
//!
//! Runs on a machine with an NVIDIA GPU. Where build.rs found no CUDA driver (`kp_cuda`), the
//! GPU tests are compiled as ignored, with the reason; on the GPU machine run them with
//! `cargo test --release --test gpu_attention -- --include-ignored`.
//! The output is poisoned with NaN before each launch, so an element the kernel never writes
//! fails the check, and every query row of two (batch, head) slices is compared.

use kernelpages::attention::cpu::{check_output, CheckPlan, Inputs};
use kernelpages::attention::cuda::{dispatch, forward, upload, Implementation, Runner};
use kernelpages::attention::{AttentionCase, Dtype};
use kernelpages::gpu::{self, Gpu};

/// The GPU, or a failure saying why there is none (these tests are ignored without one).
fn gpu_or_skip(test: &str) -> Option<Gpu> {
    match gpu::detect() {
        Err(e) => panic!("{test}: no CUDA device: {e}"),
        Ok(()) => Some(Gpu::open(0).expect("device opens")),
    }
}

fn run_case(gpu: &Gpu, imp: Implementation, c: &AttentionCase, seed: u64) -> f64 {
    let host = Inputs::random(c, seed);
    let (mut runner, _) = Runner::new(gpu, imp, c).expect("compiles");
    let inp = upload(gpu, &host.q, &host.k, &host.v).expect("upload");
    let mut out = gpu
        .stream
        .clone_htod(&vec![0xFFFFu16; c.q_elems()])
        .expect("alloc");
    runner.launch(gpu, c, &inp, &mut out).expect("launch");
    gpu.stream.synchronize().expect("sync");
    let got = gpu.stream.clone_dtoh(&out).expect("download");
    let plan = CheckPlan::new(c, c.seq_len_q, seed);
    check_output(c, &host, &got, &plan)
}

fn cases(kv_heads: usize) -> Vec<AttentionCase> {
    let mut v = Vec::new();
    for dtype in [Dtype::Bf16, Dtype::F16] {
        for head_dim in [64, 128] {
            for causal in [false, true] {
                for seq_len in [128, 384] {
                    v.push(AttentionCase {
                        kv_heads,
                        causal,
                        dtype,
                        ..AttentionCase::new(2, 4, seq_len, head_dim)
                    });
                }
            }
        }
    }
    v
}

/// Every flash configuration the runner can be told to use (`--flash-config`), including the
/// defaults. The configuration reaches `Runner::new` through `KP_FLASH_CONFIG`, so this is the
/// only test in this binary that sets it.
#[test]
#[cfg_attr(
    not(kp_cuda),
    ignore = "needs an NVIDIA GPU and its driver; run on the GPU machine with --include-ignored"
)]
fn flash_matches_float64_reference() {
    let Some(gpu) = gpu_or_skip("flash_matches_float64_reference") else {
        return;
    };
    for cfg in [
        "",
        "v2w4",
        "v2w8",
        "v3w4m2b64",
        "v3w4m2b32",
        "v3w8m2b32",
        "v3w4m1b64",
    ] {
        if cfg.is_empty() {
            std::env::remove_var("KP_FLASH_CONFIG");
        } else {
            std::env::set_var("KP_FLASH_CONFIG", format!("64={cfg},128={cfg}"));
        }
        for (i, c) in cases(4).into_iter().chain(cases(2)).enumerate() {
            let c = AttentionCase {
                seq_len_q: c.seq_len_q * 2,
                seq_len_kv: c.seq_len_kv * 2,
                ..c
            }; // multiples of 256 rows
            let err = run_case(&gpu, Implementation::Flash, &c, 100 + i as u64);
            eprintln!("flash [{cfg}] {c:?}: rel_err {err:.2e}");
            assert!(
                err <= c.dtype.tolerance(),
                "flash [{cfg}] {c:?}: rel_err {err}"
            );
        }
    }
    std::env::remove_var("KP_FLASH_CONFIG");
}

#[test]
#[cfg_attr(
    not(kp_cuda),
    ignore = "needs an NVIDIA GPU and its driver; run on the GPU machine with --include-ignored"
)]
fn math_matches_float64_reference() {
    let Some(gpu) = gpu_or_skip("math_matches_float64_reference") else {
        return;
    };
    for (i, c) in cases(4).into_iter().enumerate() {
        let err = run_case(&gpu, Implementation::Math, &c, 200 + i as u64);
        eprintln!("math {c:?}: rel_err {err:.2e}");
        assert!(err <= c.dtype.tolerance(), "math {c:?}: rel_err {err}");
    }
}

#[test]
fn unsupported_shapes_are_refused_before_launch() {
    let c = AttentionCase::new(1, 2, 100, 96);
    let why = Implementation::Flash.supports(&c).unwrap_err();
    assert!(why.contains("head_dim 96"), "{why}");
    let c = AttentionCase { head_dim: 64, ..c };
    assert!(Implementation::Flash
        .supports(&c)
        .unwrap_err()
        .contains("seq_len 100"));
    let gqa = AttentionCase {
        kv_heads: 1,
        ..AttentionCase::new(1, 2, 128, 64)
    };
    assert!(Implementation::Math.supports(&gqa).is_err());
    assert!(Implementation::Flash.supports(&gqa).is_ok());
    // The dispatch the site's "What runs by default" table describes, and the rows' `default`.
    assert_eq!(dispatch(&gqa), Some(Implementation::Flash));
    assert!(Implementation::Flash.is_default_for(&gqa));
    let odd = AttentionCase::new(1, 2, 128, 96);
    assert_eq!(dispatch(&odd), Some(Implementation::Math));
    assert!(!Implementation::Flash.is_default_for(&odd));
    let none = AttentionCase { kv_heads: 1, ..odd };
    assert_eq!(dispatch(&none), None);
}

#[test]
#[cfg_attr(
    not(kp_cuda),
    ignore = "needs an NVIDIA GPU and its driver; run on the GPU machine with --include-ignored"
)]
fn forward_runs_the_dispatched_implementation() {
    let Some(gpu) = gpu_or_skip("forward_runs_the_dispatched_implementation") else {
        return;
    };
    for head_dim in [64, 96] {
        let c = AttentionCase {
            causal: true,
            ..AttentionCase::new(1, 2, 256, head_dim)
        };
        let host = Inputs::random(&c, 1);
        let inp = upload(&gpu, &host.q, &host.k, &host.v).expect("upload");
        let mut out = gpu
            .stream
            .clone_htod(&vec![0xFFFFu16; c.q_elems()])
            .expect("alloc");
        let ran = forward(&gpu, &c, &inp, &mut out).expect("forward");
        assert_eq!(Some(ran), dispatch(&c));
        gpu.stream.synchronize().expect("sync");
        let got = gpu.stream.clone_dtoh(&out).expect("download");
        let err = check_output(&c, &host, &got, &CheckPlan::new(&c, c.seq_len_q, 4));
        assert!(
            err <= c.dtype.tolerance(),
            "forward {c:?} ({}): {err}",
            ran.name()
        );
    }
}
