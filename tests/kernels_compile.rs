//! Every CUDA kernel instantiation the runners can ask for compiles with NVRTC, for sm_90a to
//! machine code and for sm_80, where the kernel runs on both, to PTX (`spills::ptx_for_ampere`:
//! without ptxas, the PTX scanned for Hopper-only instructions; a few fp16 instances, bf16's
//! code with the other 16-bit type, for one of the two: flex and the forward's fast path; both
//! to keep CI under ten minutes). Checks of which entry points a module holds, and of the
//! wgmma forward's build without its TMA store, read `compute_90a` PTX without ptxas (the
//! files' default builds go through ptxas for sm_90a in the other tests). ptxas's resource
//! report (registers, spills) of the defaults is printed
//! (`cargo test --test kernels_compile -- --nocapture`; kernels/TUNING.md records it). Needs
//! only the NVRTC library (no GPU): where build.rs found no `libnvrtc.so.13` the tests are
//! compiled as ignored, with the reason; `.ci/run` installs NVRTC from PyPI so CI runs them.
//!
//! Instantiations are compiled many to a source (one NVRTC call per kernel file and
//! architecture), as fast as NVRTC allows; a failing one is named in the compiler's log.

use std::collections::BTreeMap;

#[path = "common/spills.rs"]
mod spills;
use spills::ptx_for_ampere;

use kernelpages::attention::cuda::{
    flash_bwd_wrappers, flash_wrapper, BwdConfig, FlashConfig, BWD_SWEEP, FLASH_BWD_SRC,
    FLASH_HEAD_DIMS, FLASH_SRC, FWD_SWEEP, PRELUDE_SRC, SOFTMAX_SRC,
};
use kernelpages::attention::{AttentionCase, Dtype, Pass};

fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen the library.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Compiles exactly as the runner does (`kernelpages::gpu::nvrtc_compile_cubin`: NVRTC and
/// ptxas, to the machine code it loads).
fn compile(name: &str, src: &str, arch: &str) {
    if let Err(e) = kernelpages::gpu::nvrtc_compile_cubin(name, src, arch) {
        panic!("{arch}: {e}");
    }
}

fn case(dtype: Dtype, head_dim: usize, causal: bool) -> AttentionCase {
    AttentionCase {
        causal,
        dtype,
        ..AttentionCase::new(1, 1, 1024, head_dim)
    }
}

/// Every (dtype, head dim, mask) the runners can ask flash for.
fn flash_cases() -> Vec<AttentionCase> {
    let mut v = Vec::new();
    for dtype in [Dtype::Bf16, Dtype::F16] {
        for d in FLASH_HEAD_DIMS {
            for causal in [false, true] {
                v.push(case(dtype, d, causal));
            }
        }
    }
    v
}

/// One source with the forward kernel and the wrappers of `(case, config)` pairs.
fn fwd_source(pairs: &[(AttentionCase, FlashConfig)]) -> String {
    let mut src = format!("{PRELUDE_SRC}\n{FLASH_SRC}\n");
    let mut seen = BTreeMap::new();
    for (c, fc) in pairs {
        let (name, w) = flash_wrapper(c, *fc);
        seen.entry(name).or_insert(w);
    }
    for w in seen.values() {
        src.push_str(w);
    }
    src
}

/// One source with the backward kernels and the wrappers of `(case, config)` pairs (shared
/// wrappers once).
fn bwd_source(pairs: &[(AttentionCase, BwdConfig)]) -> String {
    let mut src = format!("{PRELUDE_SRC}\n{FLASH_BWD_SRC}\n");
    let mut seen = BTreeMap::new();
    for (c, bc) in pairs {
        for (name, w) in flash_bwd_wrappers(c, *bc).1 {
            seen.entry(name).or_insert(w);
        }
    }
    for w in seen.values() {
        src.push_str(w);
    }
    src
}

fn defaults_fwd() -> Vec<(AttentionCase, FlashConfig)> {
    flash_cases()
        .into_iter()
        .map(|c| {
            let fc = FlashConfig::for_head_dim(c.head_dim).unwrap();
            (c, fc)
        })
        .collect()
}

fn defaults_bwd() -> Vec<(AttentionCase, BwdConfig)> {
    flash_cases()
        .into_iter()
        .map(|c| {
            let bc = BwdConfig::for_head_dim(c.head_dim).unwrap();
            (c, bc)
        })
        .collect()
}

/// Every flash instantiation the runners can ask for compiles: the defaults (each dtype, head
/// dim and mask) for Ampere and for Hopper, where ptxas's report of them is printed and
/// checked, and every swept forward and backward configuration for Hopper.
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
    // The defaults for every dtype, head dim and mask, for Ampere (PTX), and for Hopper with
    // ptxas's report (the same compile, reporting): printed for kernels/TUNING.md, and no
    // kernel may need more than the 255 registers a thread has or spill more than a few words.
    ptx_for_ampere("flash_fwd_defaults.cu", &fwd_source(&defaults_fwd()));
    ptx_for_ampere("flash_bwd_defaults.cu", &bwd_source(&defaults_bwd()));
    let (fwd, bwd) = (defaults_fwd(), defaults_bwd());
    let mut reports =
        kernelpages::gpu::ptxas_report("fwd.cu", &fwd_source(&fwd), "sm_90a").unwrap();
    reports.extend(kernelpages::gpu::ptxas_report("bwd.cu", &bwd_source(&bwd), "sm_90a").unwrap());
    eprintln!("| kernel | registers | spill bytes | stack bytes |");
    eprintln!("| --- | --- | --- | --- |");
    for r in &reports {
        eprintln!(
            "| {} | {} | {} | {} |",
            r.kernel, r.registers, r.spill_bytes, r.stack_bytes
        );
    }
    assert!(reports.len() >= fwd.len() + bwd.len());
    for r in &reports {
        assert!(r.registers <= 255, "{r:?}");
        assert!(
            r.spill_bytes <= 64,
            "{} spills {} bytes",
            r.kernel,
            r.spill_bytes
        );
    }
    // The configurations `--flash-config` and `--flash-bwd-config` can name, where they fit
    // the head dim's registers (bf16 and fp16 share the code; bf16 stands for both).
    let mut fwd = Vec::new();
    for cfg in FWD_SWEEP {
        for d in [64, 128] {
            for causal in [false, true] {
                fwd.push((
                    case(Dtype::Bf16, d, causal),
                    FlashConfig::parse(cfg).unwrap(),
                ));
            }
        }
    }
    compile("flash_fwd_configs.cu", &fwd_source(&fwd), "sm_90a");
    let mut bwd = Vec::new();
    for cfg in BWD_SWEEP.into_iter().chain(["w4r32", "w8r16", "w4r64"]) {
        let bc = BwdConfig::parse(cfg).unwrap();
        for d in [64, 128].into_iter().filter(|&d| bc.check(d).is_ok()) {
            bwd.push((case(Dtype::Bf16, d, true), bc));
        }
    }
    compile("flash_bwd_configs.cu", &bwd_source(&bwd), "sm_90a");
}

/// The runner loads NVRTC's machine code (an ELF image for the real architecture), so the
/// driver does not compile the PTX again; a virtual architecture has none and is refused.
#[test]
#[cfg_attr(
    not(kp_nvrtc),
    ignore = "needs NVRTC 13 (libnvrtc.so.13) on the loader path; .ci/run installs it"
)]
fn nvrtc_gives_machine_code_for_a_real_architecture_only() {
    assert!(
        nvrtc_present(),
        "libnvrtc.so.13 not found on the loader path"
    );
    let cubin =
        kernelpages::gpu::nvrtc_compile_cubin("softmax_rows.cu", SOFTMAX_SRC, "sm_90a").unwrap();
    assert_eq!(&cubin[..4], b"\x7fELF", "not an ELF image");
    let e = kernelpages::gpu::nvrtc_compile_cubin("softmax_rows.cu", SOFTMAX_SRC, "compute_90a")
        .unwrap_err()
        .to_string();
    assert!(e.contains("no machine code for `compute_90a`"), "{e}");
    let e = kernelpages::gpu::nvrtc_compile_cubin("bad.cu", "this is not C", "sm_90a")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("bad.cu") && e.contains("--gpu-architecture=sm_90a"),
        "{e}"
    );
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
    ptx_for_ampere("softmax_rows.cu", SOFTMAX_SRC);
    // Every entry point the math runner looks up by name (`Runner::new`, only on a GPU) is in
    // the sm_90a machine code (ptxas reports it): a missing one would fail there, not here,
    // without this.
    let reports = kernelpages::gpu::ptxas_report("softmax_rows.cu", SOFTMAX_SRC, "sm_90a").unwrap();
    let mut names: Vec<String> = [
        "pad_rows_v16",
        "unpad_rows_v16",
        "pad_rows_v4",
        "unpad_rows_v4",
    ]
    .map(String::from)
    .into();
    for dt in ["bf16", "f16", "f32"] {
        names.push(format!("rowdot_{dt}"));
        names.push(format!("softmax_bwd_rows_{dt}"));
        for mask in ["full", "causal"] {
            names.push(format!("softmax_rows_{dt}_{mask}"));
        }
    }
    for name in names {
        assert!(
            reports.iter().any(|r| r.kernel == name),
            "softmax_rows.cu has no entry point {name}"
        );
    }
}

/// The head-layout kernels `attention::mha` launches on the device.
#[test]
#[cfg_attr(
    not(kp_nvrtc),
    ignore = "needs NVRTC 13 (libnvrtc.so.13) on the loader path; .ci/run installs it"
)]
fn heads_layout_kernels_compile() {
    assert!(
        nvrtc_present(),
        "libnvrtc.so.13 not found on the loader path"
    );
    let src = kernelpages::attention::api::HEADS_LAYOUT_SRC;
    let hopper = kernelpages::gpu::nvrtc_compile("heads_layout.cu", src, "sm_90a")
        .unwrap_or_else(|e| panic!("{e}"))
        .to_src();
    for (arch, text) in [
        ("sm_90a", hopper),
        ("sm_80", ptx_for_ampere("heads_layout.cu", src)),
    ] {
        for f in [
            "split_heads_w1",
            "split_heads_w2",
            "merge_heads_w1",
            "merge_heads_w2",
        ] {
            assert!(text.contains(f), "{f} missing from the {arch} PTX");
        }
    }
}

#[test]
fn configs_parse_and_reject() {
    let c = FlashConfig::parse("v3w4m2b32").unwrap();
    assert_eq!((c.warps, c.m_tiles, c.key_tile), (4, 2, 32));
    assert_eq!(c.query_tile(), 128);
    assert_eq!(c.name(), "v3w4m2b32");
    for bad in [
        "v2w4",
        "v3w6m2b32",
        "v3w4m3b32",
        "v3w4m1b128",
        "w4",
        "v3w4m2",
        "",
    ] {
        assert!(FlashConfig::parse(bad).is_err(), "{bad}");
    }
    let b = BwdConfig::parse("w8r32").unwrap();
    assert_eq!((b.warps, b.query_rows, b.key_tile()), (8, 32, 128));
    assert_eq!(b.name(), "w8r32");
    assert_eq!((b.unroll, b.vec_red), (1, false));
    let v = BwdConfig::parse("w8r32u2v").unwrap();
    assert_eq!(
        (v.warps, v.query_rows, v.unroll, v.vec_red),
        (8, 32, 2, true)
    );
    let d = BwdConfig::parse("w8r64dv").unwrap();
    assert!(d.drop_end_sync && d.vec_red && !b.drop_end_sync);
    assert_eq!(d.name(), "w8r64dv");
    for name in BWD_SWEEP {
        assert_eq!(BwdConfig::parse(name).unwrap().name(), name);
    }
    for bad in [
        "w8r128", "w6r32", "w8", "r32", "", "w8r32u3", "w8r32vu2", "w8r32u", "w8r32vd",
    ] {
        assert!(BwdConfig::parse(bad).is_err(), "{bad}");
    }
    let narrow = BwdConfig::parse("w8r16").unwrap();
    assert!(narrow.check(64).unwrap_err().contains("head_dim 64"));
    assert!(narrow.check(128).is_ok());
    // Every default runs its head dim and fits the 163 KB of shared memory an sm_80 CTA may
    // opt into.
    for d in FLASH_HEAD_DIMS {
        BwdConfig::for_head_dim(d).unwrap().check(d).unwrap();
        let f = FlashConfig::for_head_dim(d).unwrap().smem_bytes(d);
        let b = BwdConfig::for_head_dim(d).unwrap().smem_bytes(d);
        assert!(
            f <= 163 * 1024 && b <= 163 * 1024,
            "head_dim {d}: {f} / {b} bytes"
        );
    }
}

/// The fast path of the forward (equal query and key lengths) (`kernels/flash_attn_fwd_aligned.cu`), in every
/// (dtype, head dim, mask) it is dispatched for.
#[test]
#[cfg_attr(
    not(kp_nvrtc),
    ignore = "needs NVRTC 13 (libnvrtc.so.13) on the loader path; .ci/run installs it"
)]
fn the_fast_path_forward_compiles() {
    assert!(
        nvrtc_present(),
        "libnvrtc.so.13 not found on the loader path"
    );
    use kernelpages::attention::cuda::{flash_even, flash_fast_instance, flash_fast_path};
    let mut names = std::collections::BTreeSet::new();
    for dtype in [Dtype::Bf16, Dtype::F16] {
        for head_dim in [64, 128] {
            for causal in [false, true] {
                // The EVEN instance (a multiple of the query tile) and the masked-tail one;
                // forward + backward writes the log-sum-exp.
                for (seq_len, pass) in [
                    (256, Pass::Fwd),
                    (4097, Pass::Fwd),
                    (256, Pass::FwdBwd),
                    (4097, Pass::FwdBwd),
                ] {
                    let mut c = case(dtype, head_dim, causal);
                    c.seq_len_q = seq_len;
                    c.seq_len_kv = seq_len;
                    c.pass = pass;
                    let fc = FlashConfig::for_head_dim(head_dim).unwrap();
                    assert!(flash_fast_path(&c, fc), "{c:?}");
                    assert_eq!(flash_even(&c, fc), seq_len == 256, "{c:?}");
                    let (name, src) = flash_fast_instance(&c, fc);
                    // fp16 is bf16's code with the other 16-bit type: Hopper's report (the
                    // spill check) for both, Ampere's PTX for bf16 (CI's time).
                    if dtype == Dtype::Bf16 {
                        ptx_for_ampere(&format!("{name}.cu"), &src);
                    }
                    let reports =
                        kernelpages::gpu::ptxas_report(&format!("{name}.cu"), &src, "sm_90a")
                            .unwrap();
                    for r in &reports {
                        // `--nocapture` prints the table kernels/TUNING.md quotes.
                        eprintln!("| {} | {} | {} |", r.kernel, r.registers, r.spill_bytes);
                        // The tuned head_dim 128 kernel spills 60 bytes and still measures
                        // 313 TFLOP/s (kernels/TUNING.md); its non-causal tail instance, with
                        // the partial key tile's two iterations peeled, 112.
                        assert!(r.spill_bytes <= 160, "{r:?}");
                    }
                    names.insert(name);
                }
            }
        }
    }
    assert_eq!(
        names.len(),
        32,
        "one instance per dtype, head_dim, mask, tail and log-sum-exp: {names:?}"
    );
    // Not the fast path: different lengths, a head_dim it is not built for, key lengths.
    let fc = FlashConfig::for_head_dim(128).unwrap();
    let odd = AttentionCase::new(1, 1, 1000, 128);
    assert!(flash_fast_path(&odd, fc) && !flash_even(&odd, fc));
    let mut cross = odd.clone();
    cross.seq_len_kv = 1024;
    assert!(!flash_fast_path(&cross, fc));
    let mut lens = odd.clone();
    lens.kv_lens = Some(vec![999]);
    assert!(!flash_fast_path(&lens, fc));
    // Every swept forward configuration runs on the fast path.
    for name in FWD_SWEEP {
        assert!(flash_fast_path(&odd, FlashConfig::parse(name).unwrap()));
    }
    let d96 = AttentionCase::new(1, 1, 1024, 96);
    assert!(!flash_fast_path(
        &d96,
        FlashConfig::for_head_dim(96).unwrap()
    ));
}

/// The kernel-sum kernels (`kernels/kernel_sums/kernel_sums.cu`): the whole source compiles for
/// Ampere with every entry point `kernel_sums::cuda` can launch in its PTX, and for Hopper with
/// each in ptxas's report (none spilling); each entry point also compiles alone, as the runner
/// compiles it (`entry_source`), to a module holding that entry point and no other.
#[test]
#[cfg_attr(
    not(kp_nvrtc),
    ignore = "needs NVRTC 13 (libnvrtc.so.13) on the loader path; .ci/run installs it"
)]
fn kernel_sums_kernels_compile() {
    assert!(
        nvrtc_present(),
        "libnvrtc.so.13 not found on the loader path"
    );
    use kernelpages::kernel_sums::cuda::{entry_points, entry_source, KERNEL_SUMS_SRC};
    let names = entry_points();
    let text = ptx_for_ampere("kernel_sums.cu", KERNEL_SUMS_SRC);
    for f in &names {
        // `.entry name(`: a bare substring test would take rbf_mv_d1_c16 for rbf_mv_d1_c1.
        assert!(
            text.contains(&format!(".entry {f}(")),
            "{f} missing from the sm_80 PTX"
        );
    }
    assert_eq!(text.matches(".entry ").count(), names.len(), "sm_80");
    // On sm_90a the same compile with ptxas's report (printed with `--nocapture` for
    // kernels/TUNING-kernel-sums.md): every entry point and no other, none spilling or needing
    // more than the 255 registers a thread has.
    let reports =
        kernelpages::gpu::ptxas_report("kernel_sums.cu", KERNEL_SUMS_SRC, "sm_90a").unwrap();
    assert_eq!(reports.len(), names.len(), "sm_90a: {reports:?}");
    eprintln!("| kernel | registers | spill bytes | stack bytes |");
    eprintln!("| --- | --- | --- | --- |");
    for name in &names {
        let r = reports
            .iter()
            .find(|r| &r.kernel == name)
            .unwrap_or_else(|| panic!("no ptxas report for {name}"));
        eprintln!(
            "| {} | {} | {} | {} |",
            r.kernel, r.registers, r.spill_bytes, r.stack_bytes
        );
        assert_eq!(r.spill_bytes, 0, "{r:?}");
        assert!(r.registers <= 255, "{r:?}");
    }
    // Each entry point alone, as the runner compiles it: itself, and for a split kernel sum
    // the combine that merges its partials (compiled with it, never alone). Which entry points
    // a module holds is in its PTX: compute_90a, no ptxas (the whole file's machine code is
    // checked above).
    use kernelpages::kernel_sums::cuda::{COMBINE, SUM_COMBINE, TC_CENTER, TC_PREP};
    let launched_with_others = [COMBINE, SUM_COMBINE, TC_CENTER, TC_PREP];
    for f in names
        .iter()
        .filter(|f| !launched_with_others.contains(&f.as_str()))
    {
        let ptx =
            kernelpages::gpu::nvrtc_compile(&format!("{f}.cu"), &entry_source(f), "compute_90a")
                .unwrap_or_else(|e| panic!("{e}"));
        let text = ptx.to_src();
        assert!(text.contains(&format!(".entry {f}(")), "{f} alone");
        let lse_split = f.starts_with("kernel_lse_split_");
        let sum_split = f.starts_with("rbf_mv_split_") || f.starts_with("kde_split_");
        // The tensor-core kernels come with their two pre-pass kernels.
        let tc = f.ends_with("_tc");
        assert_eq!(
            text.matches(".entry ").count(),
            1 + (lse_split || sum_split) as usize + 2 * tc as usize,
            "{f} alone"
        );
        for pre in [TC_CENTER, TC_PREP] {
            assert_eq!(text.contains(&format!(".entry {pre}(")), tc, "{f} alone");
        }
        assert_eq!(
            text.contains(&format!(".entry {COMBINE}(")),
            lse_split,
            "{f} alone"
        );
        assert_eq!(
            text.contains(&format!(".entry {SUM_COMBINE}(")),
            sum_split,
            "{f} alone"
        );
    }
    // The Sinkhorn half-step's epilogue (`DeviceSinkhorn`), as the GPU runner compiles it.
    use kernelpages::kernel_sums::cuda::{SINKHORN_EVAL_SRC, SINKHORN_UPDATE_SRC};
    for arch in ["compute_80", "sm_90a"] {
        let ptx = kernelpages::gpu::nvrtc_compile("sinkhorn_update.cu", SINKHORN_UPDATE_SRC, arch)
            .unwrap_or_else(|e| panic!("{arch}: {e}"));
        assert!(ptx.to_src().contains(".entry sinkhorn_update("), "{arch}");
        // And a solve's float64 evaluation passes (`sinkhorn_row_pass`).
        let ptx = kernelpages::gpu::nvrtc_compile("sinkhorn_eval.cu", SINKHORN_EVAL_SRC, arch)
            .unwrap_or_else(|e| panic!("{arch}: {e}"));
        assert!(ptx.to_src().contains(".entry sinkhorn_row_pass("), "{arch}");
    }
}

/// Every split-KV decoding instance (`kernels/flash_decode.cu`: each head_dim and 16-bit dtype)
/// compiles for Hopper (with its TMA build) and Ampere, on Hopper keeps its accumulators in
/// registers (no spill, both builds), and asks for no more shared memory than a CTA may have.
#[test]
#[cfg_attr(
    not(kp_nvrtc),
    ignore = "needs NVRTC 13 (libnvrtc.so.13) on the loader path; .ci/run installs it"
)]
fn decode_kernels_compile_without_spills() {
    use kernelpages::attention::decode_gpu::{
        decode_source, row_tiles, split_smem_bytes, split_smem_bytes_tma, tma_kernel_name,
        DECODE_HEAD_DIMS, ROW_TILE,
    };
    assert!(
        nvrtc_present(),
        "libnvrtc.so.13 not found on the loader path"
    );
    let mut n = 0;
    for d in DECODE_HEAD_DIMS {
        // Every row-tile count the host picks at this head_dim: one tile, and two where more
        // than 16 rows take them.
        let mut tiles = vec![1];
        if row_tiles(2 * ROW_TILE, d) == 2 {
            tiles.push(2);
        }
        for mt in tiles {
            // The shared memory the host gives must fit the H200's 227 KiB per CTA.
            assert!(
                split_smem_bytes(d, mt).max(split_smem_bytes_tma(d, mt)) <= 227 * 1024,
                "head_dim {d}, {mt} tiles"
            );
            for dtype in [Dtype::Bf16, Dtype::F16] {
                let (split, src) = decode_source(d, mt, dtype, false);
                ptx_for_ampere(&format!("{split}.cu"), &src);
                let (_, src) = decode_source(d, mt, dtype, true);
                let reports =
                    kernelpages::gpu::ptxas_report(&format!("{split}.cu"), &src, "sm_90a").unwrap();
                let names: Vec<&str> = reports.iter().map(|r| r.kernel.as_str()).collect();
                assert!(
                    names.contains(&split.as_str())
                        && names.contains(&tma_kernel_name(&split).as_str()),
                    "{names:?}"
                );
                for rep in &reports {
                    println!(
                        "{}: {} registers, {} bytes spilled",
                        rep.kernel, rep.registers, rep.spill_bytes
                    );
                    assert_eq!(rep.spill_bytes, 0, "{} spills", rep.kernel);
                }
                n += 1;
            }
        }
    }
    // head_dim 64 and 128 with one and two row tiles, 256 with one; two dtypes each.
    assert_eq!(n, 2 * 5, "instances compiled");
}

/// The flex_attention kernels (forward and backward) compile with NVRTC for every modification
/// the project names, at every head_dim and 16-bit dtype (bf16 for sm_90a at every head_dim and
/// for sm_80 at the smallest; fp16 for sm_90a at the largest, where registers are tightest, and
/// for sm_80 at the others), without spills on sm_90a (the forward's and the backward's main
/// kernels at head_dim 128 within 128 bytes), and in shared memory an sm_80 CTA may have; a bad expression is an NVRTC error that names the file, and a
/// score modification without its derivative has no backward.
#[test]
#[cfg_attr(
    not(kp_nvrtc),
    ignore = "needs NVRTC 13 (libnvrtc.so.13) on the loader path; .ci/run installs it"
)]
fn flex_kernels_compile_without_spills() {
    use kernelpages::attention::flex::{
        flex_bwd_smem_bytes, flex_bwd_source, flex_smem_bytes, flex_source, FlexSpec,
        FLEX_HEAD_DIMS,
    };
    assert!(
        nvrtc_present(),
        "libnvrtc.so.13 not found on the loader path"
    );
    let mods = compiled_mods();
    // Every modification at every head_dim and dtype compiles at least once: bf16 for Hopper
    // with ptxas's report (the spill check) at every head_dim and for Ampere at the smallest;
    // fp16 (the same code with the other 16-bit type) for Hopper at the largest head_dim, where
    // the registers are tightest, and for Ampere at the others. Fewer compiles than every
    // instance for both architectures, to keep CI under ten minutes.
    let (smallest, largest) = (FLEX_HEAD_DIMS[0], FLEX_HEAD_DIMS[FLEX_HEAD_DIMS.len() - 1]);
    let mut compiled = std::collections::BTreeSet::new();
    let n_mods = mods.len();
    for m in mods {
        for d in FLEX_HEAD_DIMS {
            assert!(flex_smem_bytes(d) <= 163 * 1024, "head_dim {d}");
            assert!(flex_bwd_smem_bytes(d) <= 163 * 1024, "head_dim {d}");
            for dtype in [Dtype::Bf16, Dtype::F16] {
                let for_ampere = match dtype {
                    Dtype::Bf16 => d == smallest,
                    _ => d != largest,
                };
                let for_hopper = dtype == Dtype::Bf16 || d == largest;
                let (_, fwd, src) = flex_source(&m.spec(), d, dtype);
                let (names, bwd_src) = flex_bwd_source(&m.spec(), d, dtype).unwrap();
                for (file, src) in [
                    (format!("{fwd}_{}.cu", m.name()), src),
                    (format!("{}_{}.cu", names[2], m.name()), bwd_src),
                ] {
                    let instance = format!("{file} d{d} {dtype:?}");
                    if for_ampere {
                        ptx_for_ampere(&file, &src);
                        compiled.insert(instance.clone());
                    }
                    if !for_hopper {
                        continue;
                    }
                    compiled.insert(instance);
                    for rep in kernelpages::gpu::ptxas_report(&file, &src, "sm_90a").unwrap() {
                        println!(
                            "{} {}: {} registers, {} bytes spilled",
                            m.name(),
                            rep.kernel,
                            rep.registers,
                            rep.spill_bytes
                        );
                        // At head_dim 128 the backward's main kernel holds 128 fp32 dK and dV
                        // accumulators per thread, as flash_bwd does (which spills 16-24
                        // bytes): 20-84 bytes with a mask, 72 with soft-capping's kp_tanh; the
                        // forward's two 16-row groups per warp spill 88-124 bytes and still
                        // measured faster than one (kernels/TUNING.md, flex v1.2). A bound of
                        // 128 bytes for those two kernels there, none elsewhere.
                        let main_kernel = (rep.kernel.starts_with("flex_bwd_")
                            || rep.kernel.starts_with("flex_fwd_"))
                            && !rep.kernel.contains("_pre_")
                            && !rep.kernel.contains("_dq_");
                        let allowed = if main_kernel && d == 128 { 128 } else { 0 };
                        assert!(
                            rep.spill_bytes <= allowed,
                            "{} {} spills {} bytes",
                            m.name(),
                            rep.kernel,
                            rep.spill_bytes
                        );
                    }
                }
            }
        }
    }
    // Every (modification, head_dim, dtype) instance, forward and backward, for one
    // architecture at least.
    assert_eq!(
        compiled.len(),
        n_mods * FLEX_HEAD_DIMS.len() * 2 * 2,
        "instances compiled: {compiled:?}"
    );
    let bad = FlexSpec {
        name: "bad".into(),
        mask: Some("q_idx >= no_such_name".into()),
        score: None,
        score_grad: None,
    };
    // A score modification without its derivative has no backward.
    let no_grad = FlexSpec {
        score: Some("score * 2.0f".into()),
        mask: None,
        ..bad.clone()
    };
    let e = flex_bwd_source(&no_grad, 64, Dtype::Bf16).unwrap_err();
    assert!(e.contains("score_grad"), "{e}");
    let (_, _, src) = flex_source(&bad, 64, Dtype::Bf16);
    let e = kernelpages::gpu::nvrtc_compile_cubin("flex_bad.cu", &src, "sm_90a")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("flex_bad.cu") && e.contains("no_such_name"),
        "{e}"
    );
}

/// The ptxas report of kernel `name` among `reports`, printed, after checking that it spills
/// nothing; panics naming the kernel otherwise.
fn spill_free<'a>(
    reports: &'a [kernelpages::gpu::PtxasReport],
    name: &str,
) -> &'a kernelpages::gpu::PtxasReport {
    let r = reports
        .iter()
        .find(|r| r.kernel == name)
        .unwrap_or_else(|| panic!("{name} in {reports:?}"));
    println!("{name}: {} registers", r.registers);
    assert_eq!(r.spill_bytes, 0, "{r:?}");
    r
}

/// The sm_90a building blocks, their probe and the wgmma attention forwards v1–v5
/// (`kernels/attn_wgmma_sm90.cu`: `wgmma` with shared-memory descriptors and a register operand,
/// TMA, mbarriers, setmaxnreg) compile for sm_90a without spills, the warp-specialised ones at
/// their launch bounds' whole register cap (what setmaxnreg's hand-over needs).
#[test]
#[cfg_attr(
    not(kp_nvrtc),
    ignore = "needs NVRTC 13 (libnvrtc.so.13) on the loader path; .ci/run installs it"
)]
fn wgmma_probe_compiles_for_sm_90a() {
    use kernelpages::attention::cuda::PRELUDE_SRC;
    use kernelpages::attention::sm90::WGMMA_SRC;
    assert!(
        nvrtc_present(),
        "libnvrtc.so.13 not found on the loader path"
    );
    use kernelpages::attention::Dtype;
    let src = kernelpages::attention::sm90::wgmma_source(None);
    assert!(src.contains(PRELUDE_SRC) && src.contains(WGMMA_SRC));
    assert_eq!(
        src,
        kernelpages::attention::sm90::wgmma_source_for(None, Dtype::Bf16)
    );
    // bf16, then fp16 (the same kernels on f16 operands, dispatched with FP16_DISPATCHED).
    for dtype in [Dtype::Bf16, Dtype::F16] {
        let src = kernelpages::attention::sm90::wgmma_source_for(None, dtype);
        let reports = kernelpages::gpu::ptxas_report("attn_wgmma_sm90.cu", &src, "sm_90a").unwrap();
        wgmma_forwards_fit(&reports);
    }
    // The persistent instantiations (KP_SM90_FWD_PERSIST=1), the build without the ping-pong
    // between consumers (KP_SM90_FWD_PINGPONG=0) and the trace's probe build change only the
    // warp-specialised kernels: wgmma_forwards_keep_their_wgmma_asynchronous compiles each of
    // those in each build and checks that it fits as here (`forward_fits`).
}

/// Every wgmma forward and the probe in `reports` compile without spills, the warp-specialised
/// ones at their launch bounds' whole register cap.
fn wgmma_forwards_fit(reports: &[kernelpages::gpu::PtxasReport]) {
    for name in [
        "wgmma_probe",
        "attn_fwd_sm90_d64",
        "attn_fwd_sm90_d128",
        "attn_fwd_sm90_ws_d64",
        "attn_fwd_sm90_ws_d128",
        "attn_fwd_sm90_wsp_d64",
        "attn_fwd_sm90_wsp_d128",
        "attn_fwd_sm90_wsp3_d64",
        "attn_fwd_sm90_wsps3_d128",
    ] {
        forward_fits(reports, name);
    }
}

/// The wgmma forward `name` in `reports` compiles without spills; a warp-specialised one (with
/// its tail split's combine, also spill-free) at its launch bounds' whole register cap.
fn forward_fits(reports: &[kernelpages::gpu::PtxasReport], name: &str) {
    if name.contains("_ws") {
        // The tail split's combine beside each warp-specialised forward.
        spill_free(reports, &format!("{name}_combine"));
    }
    let r = spill_free(reports, name);
    // The warp-specialised kernels raise their consumers' registers with setmaxnreg.inc, which
    // waits for registers the producer gave back: it can succeed only when ptxas allocated the
    // whole per-thread cap of the launch bounds (384 threads: 168, 512: 128).
    if name.contains("_ws") {
        let cap = if name.contains("wsp3") { 128 } else { 168 };
        assert_eq!(r.registers, cap, "{r:?}");
    }
}

/// The wgmma backward (`kernels/attn_wgmma_bwd_sm90.cu`) compiles for sm_90a without spills,
/// its main kernels (64 or 128 queries per step, and 80 at head_dim 128) at the whole register
/// cap of 384 threads (168, what the consumers' setmaxnreg.inc to 240 needs).
#[test]
#[cfg_attr(
    not(kp_nvrtc),
    ignore = "needs NVRTC 13 (libnvrtc.so.13) on the loader path; .ci/run installs it"
)]
fn wgmma_backward_compiles_for_sm_90a() {
    use kernelpages::attention::cuda::PRELUDE_SRC;
    use kernelpages::attention::sm90::{WGMMA_BWD_SRC, WGMMA_SRC};
    assert!(
        nvrtc_present(),
        "libnvrtc.so.13 not found on the loader path"
    );
    use kernelpages::attention::Dtype;
    let src = kernelpages::attention::sm90::bwd_source(None);
    // fp16's kernels (dispatched with FP16_DISPATCHED): the same names, no spills, the main
    // kernel at the register cap.
    for d in [64, 128] {
        let f16 = kernelpages::attention::sm90::bwd_source_wide(Some(d), Dtype::F16, (80, 64));
        let reports =
            kernelpages::gpu::ptxas_report("attn_wgmma_bwd_sm90.cu", &f16, "sm_90a").unwrap();
        assert_eq!(
            spill_free(&reports, &format!("attn_bwd_sm90_d{d}")).registers,
            168
        );
        // 80 queries per step at head_dim 128 only.
        let m80 = format!("attn_bwd_sm90_d{d}_m80");
        if d == 128 {
            assert_eq!(spill_free(&reports, &m80).registers, 168);
        } else {
            assert!(reports.iter().all(|r| r.kernel != m80), "{reports:?}");
        }
        spill_free(&reports, &format!("attn_bwd_sm90_pre_d{d}"));
        spill_free(&reports, "attn_bwd_sm90_dq_convert");
        spill_free(&reports, "attn_bwd_sm90_dkv_combine");
    }
    for d in [64, 128] {
        // The source for one head_dim holds its two kernels, its tail split's combine, the dQ
        // conversion and the split dK/dV combine, nothing else.
        let one = kernelpages::attention::sm90::bwd_source(Some(d));
        let reports =
            kernelpages::gpu::ptxas_report("attn_wgmma_bwd_sm90.cu", &one, "sm_90a").unwrap();
        let mut kernels: Vec<&str> = reports.iter().map(|r| r.kernel.as_str()).collect();
        kernels.sort_unstable();
        let want = [
            format!("attn_bwd_sm90_d{d}"),
            "attn_bwd_sm90_dkv_combine".to_string(),
            "attn_bwd_sm90_dq_convert".to_string(),
            format!("attn_bwd_sm90_pre_d{d}"),
            format!("attn_bwd_sm90_tail_combine_d{d}"),
        ];
        assert_eq!(kernels, want.iter().map(String::as_str).collect::<Vec<_>>());
    }
    // At head_dim 128 with the default steps (80 under both masks) the module holds the kernel
    // of 80 queries and not the one of 64, which no launch would take.
    let default = kernelpages::attention::sm90::bwd_source_wide(
        Some(128),
        Dtype::Bf16,
        kernelpages::attention::sm90::BWD_WIDE_DEFAULT,
    );
    let reports =
        kernelpages::gpu::ptxas_report("attn_wgmma_bwd_sm90.cu", &default, "sm_90a").unwrap();
    let mut kernels: Vec<&str> = reports.iter().map(|r| r.kernel.as_str()).collect();
    kernels.sort_unstable();
    assert_eq!(
        kernels,
        [
            "attn_bwd_sm90_d128_m80",
            "attn_bwd_sm90_dkv_combine",
            "attn_bwd_sm90_dq_convert",
            "attn_bwd_sm90_pre_d128",
            "attn_bwd_sm90_tail_combine_d128",
        ]
    );
    assert!(src.contains(WGMMA_SRC) && src.contains(WGMMA_BWD_SRC) && src.contains(PRELUDE_SRC));
    let reports = kernelpages::gpu::ptxas_report("attn_wgmma_bwd_sm90.cu", &src, "sm_90a").unwrap();
    // The forward kernels are not compiled again in the backward's module.
    assert!(
        reports
            .iter()
            .all(|r| !r.kernel.starts_with("attn_fwd") && r.kernel != "wgmma_probe"),
        "{reports:?}"
    );
    for name in [
        "attn_bwd_sm90_pre_d64",
        "attn_bwd_sm90_pre_d128",
        "attn_bwd_sm90_d64",
        "attn_bwd_sm90_d128",
        "attn_bwd_sm90_d128_m80",
        "attn_bwd_sm90_dq_convert",
        "attn_bwd_sm90_dkv_combine",
        "attn_bwd_sm90_tail_combine_d64",
        "attn_bwd_sm90_tail_combine_d128",
    ] {
        let r = spill_free(&reports, name);
        if !name.contains("pre") && !name.contains("convert") && !name.contains("combine") {
            assert_eq!(r.registers, 168, "{r:?}");
            // No wait injected by ptxas: one would end the overlap of a step's dQ product with
            // the next step's S^T (the pipelining in the kernel's step).
            assert!(r.wgmma_advisories.is_empty(), "{r:?}");
        }
    }
}

/// Each process compiles the one wgmma forward it runs: the source `HopperForward` compiles for
/// every version and head_dim it accepts (and the probe's) holds that kernel, with its tail
/// split's combine for the warp-specialised versions (V2 to V5), and no other. Checked here in
/// the PTX (`compute_90a`) for the probe and V1; for V2 to V5 in the machine code that
/// `wgmma_forwards_keep_their_wgmma_asynchronous` compiles from the same source.
#[test]
#[cfg_attr(
    not(kp_nvrtc),
    ignore = "needs NVRTC 13 (libnvrtc.so.13) on the loader path; .ci/run installs it"
)]
fn each_wgmma_forward_compiles_alone() {
    use kernelpages::attention::sm90::{wgmma_source, Sm90Version};
    assert!(
        nvrtc_present(),
        "libnvrtc.so.13 not found on the loader path"
    );
    let names = [
        "wgmma_probe".to_string(),
        Sm90Version::V1.kernel_name(64).unwrap(),
        Sm90Version::V1.kernel_name(128).unwrap(),
    ];
    for (v, d) in [
        (Sm90Version::V4, 128),
        (Sm90Version::V5, 64),
        (Sm90Version::V3, 96),
    ] {
        assert_eq!(v.kernel_name(d), None, "{v:?} d{d}");
    }
    for name in &names {
        let ptx = ptx_of(&wgmma_source(Some(name)));
        assert!(ptx.contains(&format!(".entry {name}(")), "{name}");
        assert_eq!(ptx.matches(".entry ").count(), 1, "{name}");
        // The scan `ptx_for_ampere` runs on sm_80's PTX finds these kernels' Hopper
        // instructions (wgmma, mbarrier waits, TMA copies).
        assert!(!spills::hopper_only(&ptx).is_empty(), "{name}");
    }
}

/// Hopper SASS opcodes (the low 12 bits of an instruction's first 64-bit word), as cuobjdump
/// 13 decodes NVRTC 13.0's sm_90a cubins: `HGMMA` with A from shared memory and from registers,
/// and `WARPGROUP.ARRIVE` / `WARPGROUP.DEPBAR` (one opcode).
const SASS_HGMMA_SS: u64 = 0x9f0;
const SASS_HGMMA_RS: u64 = 0xdf0;
const SASS_WARPGROUP_SYNC: u64 = 0x9c5;
/// Stores to and loads from local memory (`STL`, `LDL`: where ptxas spills).
const SASS_STL: u64 = 0x387;
const SASS_LDL: u64 = 0x983;

/// How many instructions of the `.text` sections of the sm_90a ELF `cubin` have each opcode of
/// `opcodes` (Hopper instructions are 16 bytes; the opcode is the low 12 bits of the first
/// little-endian word). Panics on a file that is not a 64-bit little-endian ELF.
fn sass_opcode_counts(cubin: &[u8], opcodes: &[u64]) -> Vec<usize> {
    let u16_at = |o: usize| u16::from_le_bytes(cubin[o..o + 2].try_into().unwrap()) as usize;
    let u32_at = |o: usize| u32::from_le_bytes(cubin[o..o + 4].try_into().unwrap()) as usize;
    let u64_at = |o: usize| u64::from_le_bytes(cubin[o..o + 8].try_into().unwrap());
    assert!(
        cubin.starts_with(b"\x7fELF\x02\x01"),
        "not a 64-bit little-endian ELF"
    );
    let (shoff, shentsize) = (u64_at(0x28) as usize, u16_at(0x3a));
    let (shnum, shstrndx) = (u16_at(0x3c), u16_at(0x3e));
    let section = |i: usize| {
        let h = shoff + i * shentsize;
        // (name offset, file offset, size)
        (
            u32_at(h),
            u64_at(h + 0x18) as usize,
            u64_at(h + 0x20) as usize,
        )
    };
    let strtab = section(shstrndx).1;
    let name = |off: usize| {
        let s = &cubin[strtab + off..];
        String::from_utf8_lossy(&s[..s.iter().position(|&b| b == 0).unwrap()]).into_owned()
    };
    let mut counts = vec![0; opcodes.len()];
    for i in 0..shnum {
        let (n, off, size) = section(i);
        if !name(n).starts_with(".text") {
            continue;
        }
        for at in (off..off + size).step_by(16) {
            let op = u64_at(at) & 0xfff;
            if let Some(k) = opcodes.iter().position(|&o| o == op) {
                counts[k] += 1;
            }
        }
    }
    counts
}

/// The warp-specialised wgmma forwards (V2 to V5) and the wgmma backward keep their wgmma
/// asynchronous: at most one
/// `WARPGROUP.ARRIVE` or `WARPGROUP.DEPBAR` per two `HGMMA`. When ptxas cannot prove that the
/// values the wgmma descriptors and barrier waits depend on are the same in every thread, it
/// waits after every wgmma (one of each per `HGMMA`) without an advisory; the persistent loop
/// did that on 2026-12-06 until its tile counts were broadcast, 25 % slower on the device.
/// Each forward build (default, persistent, without the ping-pong, traced) also fits: no
/// spills, the whole register cap (`forward_fits`).
#[test]
#[cfg_attr(
    not(kp_nvrtc),
    ignore = "needs NVRTC 13 (libnvrtc.so.13) on the loader path; .ci/run installs it"
)]
fn wgmma_forwards_keep_their_wgmma_asynchronous() {
    use kernelpages::attention::sm90::{wgmma_source, wgmma_source_with, Sm90Version};
    use kernelpages::attention::Dtype;
    assert!(
        nvrtc_present(),
        "libnvrtc.so.13 not found on the loader path"
    );
    for (v, d) in [
        (Sm90Version::V2, 64),
        (Sm90Version::V2, 128),
        (Sm90Version::V3, 64),
        (Sm90Version::V3, 128),
        (Sm90Version::V4, 64),
        (Sm90Version::V5, 128),
    ] {
        let name = v.kernel_name(d).unwrap();
        // The default module (a causal and a non-causal copy of the loop), then the one with
        // the persistent instantiation (a third copy): S and P V, several k-steps each, and an
        // arrive and a wait at least, per copy. Each compile gives the cubin checked here and
        // the PTX checked below.
        let [default_ptx, persistent_ptx] = [(false, 2), (true, 3)].map(|(persistent, copies)| {
            let src = wgmma_source_with(Some(&name), Dtype::Bf16, persistent, true);
            let label = format!("{name} (persistent {persistent})");
            let (ptx, reports) = asynchronous_with_report(
                &label,
                "attn_wgmma_sm90.cu",
                &src,
                (12 * copies, 2 * copies),
            );
            forward_fits(&reports, &name);
            if !persistent {
                // The module a process running this forward compiles (`wgmma_source`): the
                // kernel and its tail split's combine, no other.
                assert_eq!(src, wgmma_source(Some(&name)));
                let mut kernels: Vec<String> = reports.iter().map(|r| r.kernel.clone()).collect();
                kernels.sort_unstable();
                assert_eq!(kernels, [name.clone(), format!("{name}_combine")], "{name}");
            }
            ptx
        });
        // The ping-pong between consumers: its named-barrier turns in the default build of
        // the versions that overlap within a warpgroup (V3 to V5; four hand-ons in each of the
        // causal and the non-causal loop, V2 has none), none without it
        // (KP_SM90_FWD_PINGPONG=0), and the wgmma asynchronous in both.
        let (plain_ptx, reports) = asynchronous_with_report(
            &format!("{name} (without the ping-pong)"),
            "attn_wgmma_sm90.cu",
            &wgmma_source_with(Some(&name), Dtype::Bf16, false, false),
            (24, 4),
        );
        forward_fits(&reports, &name);
        let arrives = |ptx: &str| ptx.matches("bar.arrive").count();
        let (turns, plain) = (arrives(&default_ptx), arrives(&plain_ptx));
        println!(
            "{name}: bar.arrive in the PTX {turns} (default), {plain} (without the ping-pong)"
        );
        let expected = if v == Sm90Version::V2 { 0 } else { 8 };
        assert_eq!(turns, expected, "{name}: the ping-pong's hand-ons");
        // The persistent instantiation (a third copy of the loop) has none of its own.
        assert_eq!(
            arrives(&persistent_ptx),
            expected,
            "{name}: hand-ons with the persistent grid"
        );
        assert_eq!(
            plain, 0,
            "{name}: named-barrier arrivals without the ping-pong"
        );
        // The epilogue's TMA store of O, gone with its probe switch; the trace's probe build
        // (sm90::HopperForward::with_probe) keeps the wgmma asynchronous.
        let tma_stores = |ptx: &str| ptx.matches("cp.async.bulk.tensor.3d.global.shared").count();
        assert!(
            tma_stores(&default_ptx) > 0,
            "{name}: the epilogue's TMA store"
        );
        let switched = |define: &str| {
            format!("#define {define}\n")
                + &wgmma_source_with(Some(&name), Dtype::Bf16, false, true)
        };
        assert_eq!(
            tma_stores(&ptx_of(&switched("KP_SM90_NO_TMA_STORE"))),
            0,
            "{name}: KP_SM90_NO_TMA_STORE"
        );
        let (_, reports) = asynchronous_with_report(
            &format!("{name} (traced)"),
            "attn_wgmma_sm90.cu",
            &switched(kernelpages::attention::sm90::TRACE_DEFINE),
            (24, 4),
        );
        forward_fits(&reports, &name);
    }
    // The wgmma backward's module at each head_dim, likewise; at 128 with both kernels, 80
    // queries a step (`attn_bwd_sm90_d128_m80`, the default) and 64 (KP_SM90_BWD_BM=64). As
    // first built (2026-12-06) that kernel was serialised: 132 HGMMA and 152 warpgroup
    // arrive/wait in the module, with ptxas's advisory C7512 (too few registers), which this
    // check did not read then; dV is now waited for before dQ^T starts (kernels/TUNING.md, "The
    // wgmma backward: 80 queries a step, and the last wave split").
    for (d, min) in [(64, (24, 2)), (128, (48, 4))] {
        let src = kernelpages::attention::sm90::bwd_source_wide(Some(d), Dtype::Bf16, (80, 64));
        assert_wgmma_asynchronous(
            &format!("wgmma backward d{d}"),
            "attn_wgmma_bwd_sm90.cu",
            &src,
            min,
        );
    }
}

/// The PTX of the wgmma forward's source `src` for sm_90a (`compute_90a`: no ptxas).
fn ptx_of(src: &str) -> String {
    kernelpages::gpu::nvrtc_compile("attn_wgmma_sm90.cu", src, "compute_90a")
        .unwrap()
        .to_src()
}

/// The flex modifications the compile tests instantiate: every one the project names, with
/// arguments that give partial and whole tiles.
fn compiled_mods() -> [kernelpages::attention::flex::FlexMod; 6] {
    use kernelpages::attention::flex::FlexMod;
    [
        FlexMod::Causal,
        FlexMod::SlidingWindow(256),
        FlexMod::Document,
        FlexMod::PrefixLm(128),
        FlexMod::Alibi,
        FlexMod::SoftCap(50.0),
    ]
}

/// flex_attention's forward on the wgmma kernel (`kernels/flex_attn_fwd_sm90.cu`) compiles for
/// sm_90a for every named modification at head_dim 64 and 128 (bf16; fp16 at 128 with a mask
/// and with a score modification), with its wgmma asynchronous, no spills and the whole
/// register cap of 384 threads (168: the consumers' setmaxnreg.inc needs it), its block-mask
/// kernel spill-free; and the dense modules it is built on select no kernel of their own.
#[test]
#[cfg_attr(
    not(kp_nvrtc),
    ignore = "needs NVRTC 13 (libnvrtc.so.13) on the loader path; .ci/run installs it"
)]
fn flex_wgmma_forward_keeps_its_wgmma_asynchronous() {
    use kernelpages::attention::flex::{flex_sm90_source, FlexMod, FLEX_HEAD_DIMS};
    assert!(
        nvrtc_present(),
        "libnvrtc.so.13 not found on the loader path"
    );
    let mods = compiled_mods();
    let mut instances = Vec::new();
    for m in mods {
        for d in FLEX_HEAD_DIMS {
            instances.push((m, d, Dtype::Bf16));
        }
    }
    instances.push((FlexMod::Causal, 128, Dtype::F16));
    instances.push((FlexMod::SoftCap(50.0), 128, Dtype::F16));
    for (m, d, dtype) in instances {
        let (block, fwd, src) = flex_sm90_source(&m.spec(), d, dtype);
        let label = format!("{fwd} {}", m.name());
        // One copy of the loop (no causal or persistent instantiation): S and P V of several
        // k-steps each, an arrive and a wait at least.
        let (ptx, reports) =
            asynchronous_with_report(&label, &format!("{fwd}_{}.cu", m.name()), &src, (12, 2));
        let r = spill_free(&reports, &fwd);
        assert_eq!(r.registers, 168, "{label}: {r:?}");
        spill_free(&reports, &block);
        // The two kernels and nothing of the dense forwards'.
        let entries = ptx.matches(".entry ").count();
        assert_eq!(entries, 2, "{label}: {entries} kernels in the module");
    }
}

/// flex_attention's backward on the wgmma backward (`kernels/flex_attn_bwd_sm90.cu`) compiles
/// for sm_90a for every named modification at head_dim 64 and 128 (bf16; fp16 at 128 with a
/// mask and with a score modification) with its wgmma asynchronous (ptxas's serialisation
/// advisories read too), its main kernel and the transposed block mask's spill-free, and none
/// of the dense backward's main kernels in the module (its preprocessing and dQ conversion are
/// this backward's).
#[test]
#[cfg_attr(
    not(kp_nvrtc),
    ignore = "needs NVRTC 13 (libnvrtc.so.13) on the loader path; .ci/run installs it"
)]
fn flex_wgmma_backward_keeps_its_wgmma_asynchronous() {
    use kernelpages::attention::flex::{flex_bwd_sm90_source, FlexMod, FLEX_HEAD_DIMS};
    assert!(
        nvrtc_present(),
        "libnvrtc.so.13 not found on the loader path"
    );
    let mut instances = Vec::new();
    for m in compiled_mods() {
        for d in FLEX_HEAD_DIMS {
            instances.push((m, d, Dtype::Bf16));
        }
    }
    instances.push((FlexMod::Causal, 128, Dtype::F16));
    instances.push((FlexMod::SoftCap(50.0), 128, Dtype::F16));
    for (m, d, dtype) in instances {
        let (names, src) = flex_bwd_sm90_source(&m.spec(), d, dtype).unwrap();
        let label = format!("{} {}", names[2], m.name());
        // At least the dense d64 module's counts (one main kernel there too).
        let min = (24, 2);
        let out = asynchronous_compile(&label, &format!("{}_{}.cu", names[2], m.name()), &src, min);
        let (ptx, reports) = (out.ptx, out.reports);
        spill_free(&reports, &names[0]);
        // The main kernel spill-free, except the document mask's at head_dim 64 (its 34 loads
        // from aux per partial tile beside S^T, dP^T, dK and dV), which keeps one value in 4
        // bytes of local memory: nvdisasm (2026-12-07) showed one store at the kernel's start
        // and one load in its epilogue, nothing in the loop. Allowed as exactly that: at most 8
        // bytes, and one STL and one LDL in the whole module.
        let r = reports.iter().find(|r| r.kernel == names[2]).unwrap();
        if r.spill_bytes > 0 {
            let [stl, ldl] = sass_opcode_counts(&out.cubin, &[SASS_STL, SASS_LDL])[..] else {
                unreachable!()
            };
            assert!(
                m == FlexMod::Document && d == 64 && r.spill_bytes <= 8 && stl <= 1 && ldl <= 1,
                "{label}: {r:?}, {stl} STL, {ldl} LDL"
            );
        }
        for dense in [
            format!("attn_bwd_sm90_d{d}("),
            format!("attn_bwd_sm90_d{d}_m80("),
        ] {
            assert!(
                !ptx.contains(&format!(".entry {dense}")),
                "{label}: the dense main kernel {dense} in the module"
            );
        }
        for name in &names {
            assert!(
                ptx.contains(&format!(".entry {name}(")),
                "{label}: no kernel {name}"
            );
        }
    }
}

/// Compiles `src` (file `file`) for sm_90a and checks its cubin: at least `min.0` `HGMMA` and
/// `min.1` warpgroup arrive/wait instructions (so that the opcodes are the right ones), and at
/// most one arrive/wait per two `HGMMA` (none serialised); prints the counts under `label`.
/// Returns the PTX of the same compile (one NVRTC run for both checks).
fn assert_wgmma_asynchronous(label: &str, file: &str, src: &str, min: (usize, usize)) -> String {
    asynchronous_with_report(label, file, src, min).0
}

/// [`assert_wgmma_asynchronous`], giving ptxas's report of the same compile as well.
fn asynchronous_with_report(
    label: &str,
    file: &str,
    src: &str,
    min: (usize, usize),
) -> (String, Vec<kernelpages::gpu::PtxasReport>) {
    let out = asynchronous_compile(label, file, src, min);
    (out.ptx, out.reports)
}

/// [`assert_wgmma_asynchronous`], giving the whole compile (PTX, cubin, ptxas's report).
fn asynchronous_compile(
    label: &str,
    file: &str,
    src: &str,
    min: (usize, usize),
) -> kernelpages::gpu::CompiledWithReport {
    let out = kernelpages::gpu::compile_with_report(file, src, "sm_90a").unwrap();
    let c = sass_opcode_counts(
        &out.cubin,
        &[SASS_HGMMA_SS, SASS_HGMMA_RS, SASS_WARPGROUP_SYNC],
    );
    let (hgmma, sync) = (c[0] + c[1], c[2]);
    println!("{label}: {hgmma} HGMMA, {sync} warpgroup arrive/wait");
    // ptxas says why when it can (e.g. C7512: too few registers); the counts below catch the
    // cases it does not.
    for r in &out.reports {
        for a in &r.wgmma_advisories {
            println!("{label}: {}: {a}", r.kernel);
        }
        assert!(
            r.wgmma_advisories.iter().all(|a| !a.contains("serialized")),
            "{label}: {}: {:?}",
            r.kernel,
            r.wgmma_advisories
        );
    }
    assert!(hgmma >= min.0, "{label}: {hgmma} HGMMA");
    assert!(sync >= min.1, "{label}: {sync} warpgroup arrive/wait");
    assert!(
        2 * sync <= hgmma,
        "{label}: {sync} warpgroup arrive/wait for {hgmma} HGMMA"
    );
    out
}
