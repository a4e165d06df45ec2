//! Every CUDA kernel instantiation the runners can ask for compiles with NVRTC for sm_80 and
//! sm_90a. Needs only the NVRTC library (no GPU): where build.rs found no `libnvrtc.so.13` the
//! tests are compiled as ignored, with the reason; `.ci/run` installs NVRTC from PyPI so CI
//! runs them.

use kernelpages::attention::cuda::{flash_instance, FlashConfig, SOFTMAX_SRC};
use kernelpages::attention::{AttentionCase, Dtype};

fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen the library.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Compiles exactly as the runner does (`kernelpages::gpu::nvrtc_compile`).
fn compile(name: &str, src: &str, arch: &str) {
    if let Err(e) = kernelpages::gpu::nvrtc_compile(name, src, arch) {
        panic!("{arch}: {e}");
    }
}

#[test]
#[cfg_attr(
    not(kp_nvrtc),
    ignore = "needs NVRTC 13 (libnvrtc.so.13) on the loader path; .ci/run installs it"
)]
fn every_flash_instantiation_compiles() {
    assert!(
        nvrtc_present(),
        "libnvrtc.so.13 not found on the loader path"
    );
    let configs = [
        "v2w4",
        "v2w8",
        "v3w4m2b64",
        "v3w4m2b32",
        "v3w8m2b32",
        "v3w4m1b64",
    ];
    for cfg in configs {
        let fc = FlashConfig::parse(cfg).unwrap();
        for dtype in [Dtype::Bf16, Dtype::F16] {
            for head_dim in [64, 128] {
                for causal in [false, true] {
                    let c = AttentionCase {
                        causal,
                        dtype,
                        ..AttentionCase::new(1, 1, 1024, head_dim)
                    };
                    let (name, src) = flash_instance(&c, fc);
                    compile(&name, &src, "sm_90a");
                }
            }
        }
    }
    // The default instantiations also build for Ampere.
    for head_dim in [64, 128] {
        let c = AttentionCase {
            causal: true,
            ..AttentionCase::new(1, 1, 1024, head_dim)
        };
        let (name, src) = flash_instance(&c, FlashConfig::for_head_dim(head_dim).unwrap());
        compile(&name, &src, "sm_80");
    }
}

#[test]
#[cfg_attr(
    not(kp_nvrtc),
    ignore = "needs NVRTC 13 (libnvrtc.so.13) on the loader path; .ci/run installs it"
)]
fn softmax_kernels_compile() {
    assert!(
        nvrtc_present(),
        "libnvrtc.so.13 not found on the loader path"
    );
    compile("softmax_rows.cu", SOFTMAX_SRC, "sm_90a");
    compile("softmax_rows.cu", SOFTMAX_SRC, "sm_80");
}

#[test]
fn flash_configs_parse_and_reject() {
    let c = FlashConfig::parse("v3w4m2b32").unwrap();
    assert_eq!((c.version, c.warps, c.m_tiles, c.key_tile), (3, 4, 2, 32));
    assert_eq!(c.query_tile(), 128);
    assert_eq!(c.name(), "v3w4m2b32");
    assert_eq!(FlashConfig::parse("v2w8").unwrap().query_tile(), 128);
    for bad in ["v2w6", "v3w4m3b32", "v3w4m1b128", "w4", "v3w4m2", ""] {
        assert!(FlashConfig::parse(bad).is_err(), "{bad}");
    }
}
