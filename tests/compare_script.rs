//! The comparison modules (`runners/compare/`) through the runner's own client
//! ([`kernelpages::runner::process::Server`]): every reply deserialises as
//! [`kernelpages::runner::protocol::Reply`] with a [`kernelpages::schema::Row`], one per job.
//!
//! Without torch (the CI machine) every row is `unsupported` and names torch. With torch and a
//! GPU (the device machine) the same tests measure tiny cases for real, on the runner's input
//! bits and reference, and a NaN planted outside the checked elements of a PyTorch output
//! makes that row fail. Without `python3` (build.rs's `kp_python`) the tests are compiled as
//! ignored, and the NaN test needs torch with a GPU (`kp_cuda`, the device machine).
//!
//! `KP_RUNNERS_DIR` points the tests at another copy of `runners/` (the device machine).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use kernelpages::attention::{AttentionCase, Dtype, Pass};
use kernelpages::harness::default_timing;
use kernelpages::runner::process::Server;
use kernelpages::runner::protocol::{CaseFiles, Job, Reply};
use kernelpages::runner::DeviceChoice;
use kernelpages::schema::{Reference, Status, TimingConfig, TimingMethod};

const IMPLEMENTATIONS: [&str; 4] = [
    "torch_flash",
    "torch_cudnn",
    "torch_efficient",
    "torch_math",
];

fn runners_dir() -> PathBuf {
    kernelpages::runner::locate_runners_dir().expect("runners/compare/ exists")
}

/// True when python3 runs; these tests are ignored where build.rs found none, so a missing
/// python3 here is a failure.
fn have_python(test: &str) -> bool {
    match Command::new("python3").arg("--version").output() {
        Ok(o) if o.status.success() => true,
        _ => panic!("{test}: python3 is not available"),
    }
}

fn torch_with_gpu() -> bool {
    Command::new("python3")
        .args([
            "-c",
            "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)",
        ])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

fn timing() -> TimingConfig {
    TimingConfig {
        warmup_ms: 5.0,
        repeats: 5,
        min_sample_ms: 0.5,
        max_inner: 10,
        case_timeout_s: 20.0,
        ..default_timing()
    }
}

/// Writes a case's inputs and reference as the runner does and returns the job files.
fn case_files(c: &AttentionCase, dir: &Path) -> CaseFiles {
    kernelpages::attention::files::write_case(c, 11, 16, dir).unwrap()
}

fn case(causal: bool, dtype: Dtype, kv_heads: usize) -> AttentionCase {
    AttentionCase {
        kv_heads,
        causal,
        dtype,
        ..AttentionCase::new(2, 4, 256, 64)
    }
}

fn job(c: &AttentionCase, implementation: &str, files: &CaseFiles) -> Job {
    Job {
        case: c.params(),
        implementation: implementation.into(),
        device: DeviceChoice::Gpu,
        timing: timing(),
        l2_bytes: 62_914_560,
        files: files.clone(),
    }
}

fn server(envs: &[(String, String)]) -> Server {
    Server::start("python3", &runners_dir(), "torch_sdpa", envs).expect("python3 starts")
}

/// Checks a reply's row beyond what deserialising already proved.
fn check_reply(reply: &Reply, c: &AttentionCase, implementation: &str, gpu: bool) {
    let row = &reply.row;
    assert_eq!(row.case, c.params(), "case copied exactly");
    assert_eq!(row.implementation, implementation);
    assert_eq!(row.library, "PyTorch");
    assert!(reply.libraries.contains_key("python"), "{reply:?}");
    if !gpu {
        assert_eq!(row.status, Status::Unsupported, "{row:?}");
        // Without a GPU: torch missing, no CUDA device, or (torch importable on a CPU-only
        // machine) a backend that refuses the case before looking for a device.
        let msg = row.message.as_deref().unwrap_or("").to_lowercase();
        assert!(msg.contains("torch") || msg.contains("cuda"), "{msg}");
        return;
    }
    if row.status != Status::Ok {
        // A backend may refuse a shape (e.g. cuDNN with GQA); it must say why.
        assert!(
            matches!(row.status, Status::Unsupported | Status::Error),
            "{row:?}"
        );
        assert!(!row.message.as_deref().unwrap_or("").is_empty());
        return;
    }
    let (q1, m, q3) = (
        row.q1_ms.unwrap(),
        row.median_ms.unwrap(),
        row.q3_ms.unwrap(),
    );
    assert!(0.0 < q1 && q1 <= m && m <= q3, "{row:?}");
    assert!(row.host_ms.unwrap() > 0.0);
    assert!(row.first_call_s.unwrap() > 0.0);
    assert!(
        row.compile_s.is_none(),
        "PyTorch's first call is not a compile"
    );
    match row.timing.unwrap() {
        TimingMethod::GraphReplay => assert!(row.eager_median_ms.unwrap() > 0.0),
        TimingMethod::Events => assert!(row.notes.iter().any(|n| n.contains("graph"))),
        TimingMethod::WallClock => panic!("PyTorch on a GPU has device events: {row:?}"),
    }
    let acc = row.accuracy.as_ref().unwrap();
    assert_eq!(
        acc.reference,
        Reference::Float64Cpu,
        "the runner's reference"
    );
    assert!(acc.rel_err < acc.tolerance, "{acc:?}");
    let mem = row.memory.as_ref().unwrap();
    assert!(mem.peak_mb.unwrap() > 0.0 && mem.reserved_peak_mb.unwrap() >= 0.0);
    assert!(reply.window.is_some());
    assert_eq!(row.flops, Some(c.flops()));
    if implementation == "torch_math" {
        assert!(
            row.notes.iter().any(|n| n.contains("float32")),
            "{:?}",
            row.notes
        );
    }
}

#[test]
#[cfg_attr(not(kp_python), ignore = "needs python3")]
fn self_test_passes() {
    if !have_python("self_test_passes") {
        return;
    }
    let o = Command::new("python3")
        .args(["-m", "compare.torch_sdpa", "self-test"])
        .env("PYTHONPATH", runners_dir())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// Importing the geomloss module (what the comparison server does before it forks a process
/// per job) must not import geomloss: geomloss imports pykeops, whose import initialises CUDA,
/// and the forked jobs then cannot (every geomloss GPU row of the H200 run at 9a3c050 said "no
/// CUDA device visible to torch"). A stub `geomloss` package on the path records whether it was
/// imported; `load_geomloss`, which the job calls, does import it.
#[test]
#[cfg_attr(not(kp_python), ignore = "needs python3")]
fn the_geomloss_module_leaves_geomloss_to_the_job() {
    if !have_python("the_geomloss_module_leaves_geomloss_to_the_job") {
        return;
    }
    let stub = tempfile::tempdir().unwrap();
    std::fs::create_dir(stub.path().join("geomloss")).unwrap();
    std::fs::write(
        stub.path().join("geomloss").join("__init__.py"),
        "import sys\nsys.modules.setdefault('pykeops', type(sys)('pykeops'))\n",
    )
    .unwrap();
    let path = std::env::join_paths([runners_dir(), stub.path().to_path_buf()]).unwrap();
    let script = "import sys\n\
                  import compare.geomloss_sinkhorn as g\n\
                  print('at import:', 'geomloss' in sys.modules, 'pykeops' in sys.modules)\n\
                  g.load_geomloss()\n\
                  print('in the job:', 'geomloss' in sys.modules, g.torch is not None)\n";
    let o = Command::new("python3")
        .args(["-c", script])
        .env("PYTHONPATH", path)
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(out.contains("at import: False False"), "{out}");
    // With torch there, the job's call imports geomloss (the stub); without it, the module
    // reports torch's import error and never reaches geomloss.
    assert!(
        out.contains("in the job: True True") || out.contains("in the job: False False"),
        "{out}"
    );
}

#[test]
#[cfg_attr(not(kp_python), ignore = "needs python3")]
fn every_job_gets_a_reply_row() {
    if !have_python("every_job_gets_a_reply_row") {
        return;
    }
    let gpu = torch_with_gpu();
    let dir = tempfile::tempdir().unwrap();
    let mut s = server(&[]);
    for (i, c) in [case(true, Dtype::Bf16, 4), case(false, Dtype::F16, 2)]
        .iter()
        .enumerate()
    {
        let d = dir.path().join(format!("case{i}"));
        std::fs::create_dir_all(&d).unwrap();
        let files = case_files(c, &d);
        for imp in IMPLEMENTATIONS {
            let reply = s
                .request(&job(c, imp, &files), Duration::from_secs(150))
                .unwrap();
            eprintln!("{imp}: {:?} {:?}", reply.row.status, reply.row.median_ms);
            check_reply(&reply, c, imp, gpu);
        }
    }
    // Forward + backward: dO is the 4th input and the row checks O, dQ, dK and dV; a case
    // whose causal mask PyTorch aligns differently (seq_len_q != seq_len_kv) is run with an
    // explicit bottom-right mask, or refused by the flash backend with the reason.
    let c = AttentionCase {
        pass: Pass::FwdBwd,
        ..case(true, Dtype::Bf16, 4)
    };
    let cross = AttentionCase {
        seq_len_q: 40,
        seq_len_kv: 100,
        // 57 keys for 40 queries: with the causal mask every row sees a key. (With fewer keys
        // than queries the first rows see none; cuDNN's explicit-mask path then disagrees with
        // the reference's O = 0 on those rows, which the row's notes say:
        // protocol.empty_rows_note.)
        kv_lens: Some(vec![100, 57]),
        ..c.clone()
    };
    for (i, c) in [c.clone(), cross].iter().enumerate() {
        let d = dir.path().join(format!("bwd{i}"));
        std::fs::create_dir_all(&d).unwrap();
        let files = case_files(c, &d);
        assert_eq!(files.inputs[3].name, "do");
        for imp in IMPLEMENTATIONS {
            let reply = s
                .request(&job(c, imp, &files), Duration::from_secs(150))
                .unwrap();
            eprintln!(
                "{imp} fwd+bwd: {:?} {:?}",
                reply.row.status, reply.row.message
            );
            check_reply(&reply, c, imp, gpu);
            if i == 1 && imp == "torch_flash" && gpu {
                assert_eq!(reply.row.status, Status::Unsupported);
                assert!(reply.row.message.as_deref().unwrap().contains("top-left"));
            }
            if reply.row.status == Status::Ok {
                let acc = reply.row.accuracy.as_ref().unwrap();
                let checked = acc.checked.as_deref().unwrap();
                assert!(
                    checked.contains("dQ") && checked.contains("largest"),
                    "{checked}"
                );
                let mem = reply.row.memory.as_ref().unwrap();
                assert!(mem.residuals_mb.unwrap() > 0.0, "{mem:?}");
            }
        }
    }
    let files = case_files(&c, &dir.path().join("bwd0"));
    // A malformed job line is answered with an error row, and the server goes on.
    let mut bad = job(&c, "torch_flash", &files);
    bad.timing.case_timeout_s = f64::NAN;
    let reply = s.request(&bad, Duration::from_secs(60)).unwrap();
    assert_eq!(reply.row.status, Status::Error, "{:?}", reply.row);
    assert!(s.alive());
}

#[test]
#[cfg_attr(
    not(kp_cuda),
    ignore = "needs torch with a GPU: run on the GPU machine with --include-ignored"
)]
fn a_nan_outside_the_checked_slices_fails_the_row() {
    if !have_python("a_nan_outside_the_checked_slices_fails_the_row") {
        return;
    }
    assert!(
        torch_with_gpu(),
        "no torch with a GPU (the pure check runs in the self-test everywhere)"
    );
    let dir = tempfile::tempdir().unwrap();
    let c = case(false, Dtype::Bf16, 4);
    let files = case_files(&c, dir.path());
    // The last element of slice (0, 1), row 17: outside the 16 checked rows of the plan?
    // Pick any element not covered by the ranges.
    let covered = |i: u64| files.check.ranges.iter().any(|&[s, n]| i >= s && i < s + n);
    let outside = (0..c.q_elems() as u64)
        .rev()
        .find(|&i| !covered(i))
        .unwrap();
    let mut s = server(&[("KP_COMPARE_PLANT_NAN".into(), outside.to_string())]);
    for imp in ["torch_flash", "torch_math"] {
        let reply = s
            .request(&job(&c, imp, &files), Duration::from_secs(150))
            .unwrap();
        assert_eq!(reply.row.status, Status::Error, "{:?}", reply.row);
        let msg = reply.row.message.unwrap();
        assert!(
            msg.contains(&format!("non-finite output at element {outside} ")),
            "{msg}"
        );
    }
}

/// The dense kernel-sum module (`runners/compare/torch_kernel_sums.py`) on the GPU: a job whose
/// `device` is `gpu` is measured on CUDA (allocator peak, graph-replay timing) and checked
/// against the runner's float64 reference, for every op and the gradient.
#[test]
#[cfg_attr(
    not(kp_cuda),
    ignore = "needs torch with a GPU: run on the GPU machine with --include-ignored"
)]
fn kernel_sum_module_runs_on_the_gpu() {
    use kernelpages::kernel_sums::{files as ks_files, KernelSumCase, Op};
    if !have_python("kernel_sum_module_runs_on_the_gpu") {
        return;
    }
    assert!(torch_with_gpu(), "no torch with a GPU");
    let dir = tempfile::tempdir().unwrap();
    let mut s = Server::start("python3", &runners_dir(), "torch_kernel_sums", &[]).unwrap();
    let cases = [
        KernelSumCase {
            cols: 4,
            ..KernelSumCase::new(Op::RbfMv, 3000, 2000, 3)
        },
        KernelSumCase::new(Op::Kde, 3000, 2000, 2),
        KernelSumCase::new(Op::KernelLse, 3000, 2000, 64),
        KernelSumCase {
            grad: true,
            ..KernelSumCase::new(Op::KernelLse, 3000, 2000, 3)
        },
    ];
    for (k, c) in cases.iter().enumerate() {
        let sub = dir.path().join(k.to_string());
        std::fs::create_dir_all(&sub).unwrap();
        let files = ks_files::write_case(c, 3, 32, &sub).unwrap();
        let j = Job {
            case: c.params(),
            implementation: "torch_dense".into(),
            device: DeviceChoice::Gpu,
            timing: timing(),
            l2_bytes: 62_914_560,
            files,
        };
        let row = s.request(&j, Duration::from_secs(150)).unwrap().row;
        eprintln!(
            "{c:?}: {:?} {:?} {:?}",
            row.status, row.median_ms, row.timing
        );
        assert_eq!(row.status, Status::Ok, "{c:?}: {row:?}");
        assert_eq!(row.timing, Some(TimingMethod::GraphReplay), "{row:?}");
        let acc = row.accuracy.unwrap();
        assert!(acc.rel_err < acc.tolerance, "{c:?}: {acc:?}");
        let mem = row.memory.unwrap();
        // The dense N x M float32 matrix is on the device during the call.
        let dense_mb = 4.0 * (c.n * c.m) as f64 / 1e6;
        assert!(mem.peak_mb.unwrap() >= dense_mb, "{c:?}: {mem:?}");
    }
}

/// flash-linear-attention's module (`runners/compare/fla_mixers.py`) on the GPU, with the library
/// on `PYTHONPATH` (the device run installs fla-core and einops from wheels): its self-test (each
/// kernel call against the float64 recurrences), then SSD, the gated delta rule and Based at a
/// length that is not a multiple of the chunk, bf16 and fp32, measured and within the row's
/// tolerance in bf16 (fp32 goes through TF32 products: its error is reported, under 2e-2), and
/// the selective scan `unsupported`.
#[test]
#[cfg_attr(
    not(kp_cuda),
    ignore = "needs torch with a GPU and flash-linear-attention: run on the GPU machine with --include-ignored"
)]
fn fla_module_runs_on_the_gpu() {
    use kernelpages::sequence_mixers::case::{MixerCase, MixerDtype};
    use kernelpages::sequence_mixers::files as mx_files;
    if !have_python("fla_module_runs_on_the_gpu") {
        return;
    }
    assert!(torch_with_gpu(), "no torch with a GPU");
    // The runners' package first, then whatever PYTHONPATH holds (the installed wheels).
    let mut path = vec![runners_dir()];
    path.extend(
        std::env::var_os("PYTHONPATH")
            .map_or_else(Vec::new, |p| std::env::split_paths(&p).collect::<Vec<_>>()),
    );
    let o = Command::new("python3")
        .args(["-m", "compare.fla_mixers", "self-test"])
        .env("PYTHONPATH", std::env::join_paths(path).unwrap())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    assert!(!stderr.contains("not checked here"), "{stderr}");
    let dir = tempfile::tempdir().unwrap();
    let mut s = Server::start("python3", &runners_dir(), "fla_mixers", &[]).unwrap();
    let bases = [
        MixerCase::ssd(2, 200, 4, 64, 64),
        MixerCase::gated_delta(2, 200, 4, 64),
        MixerCase::based(2, 200, 4, 64, 64),
        MixerCase::scan(2, 200, 64, 16),
    ];
    let mut k = 0;
    for base in bases {
        for dtype in [MixerDtype::Bf16, MixerDtype::Fp32] {
            let c = MixerCase { dtype, ..base };
            k += 1;
            let sub = dir.path().join(k.to_string());
            std::fs::create_dir_all(&sub).unwrap();
            let j = Job {
                case: c.params(),
                implementation: "fla_chunk".into(),
                device: DeviceChoice::Gpu,
                timing: timing(),
                l2_bytes: 62_914_560,
                files: mx_files::write_case(&c, 3, 32, &sub).unwrap(),
            };
            let row = s.request(&j, Duration::from_secs(150)).unwrap().row;
            eprintln!(
                "{}: {:?} {:?} {:?} {:?}",
                c.label(),
                row.status,
                row.median_ms,
                row.accuracy.as_ref().map(|a| a.rel_err),
                row.message
            );
            if base.mixer == kernelpages::sequence_mixers::case::Mixer::SelectiveScan {
                assert_eq!(row.status, Status::Unsupported, "{row:?}");
                continue;
            }
            assert_eq!(row.status, Status::Ok, "{c:?}: {row:?}");
            let acc = row.accuracy.unwrap();
            if dtype == MixerDtype::Bf16 {
                assert!(acc.rel_err < acc.tolerance, "{c:?}: {acc:?}");
            } else {
                assert!(acc.rel_err < 2e-2, "{c:?}: {acc:?}");
            }
        }
    }
}

/// PyTorch's flex_attention module (`runners/compare/torch_flex.py`): its self-test everywhere;
/// with torch and a GPU, every named modification on a small GQA case whose length is not a
/// multiple of any block size, forward with equal, fewer and more queries than keys (the
/// bottom-right alignment must match the reference's), and forward + backward for the score
/// modifications and the document mask, checked against the runner's float64 reference with
/// the same modification, with its compile time recorded; without them, rows that say why.
#[test]
#[cfg_attr(not(kp_python), ignore = "needs python3")]
fn flex_module_runs_every_mask() {
    use kernelpages::attention::files::{masked_flops, write_masked_case};
    use kernelpages::attention::flex::FlexMod;
    if !have_python("flex_module_runs_every_mask") {
        return;
    }
    let o = Command::new("python3")
        .args(["-m", "compare.torch_flex", "self-test"])
        .env("PYTHONPATH", runners_dir())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let gpu = torch_with_gpu();
    let dir = tempfile::tempdir().unwrap();
    let mut s = Server::start("python3", &runners_dir(), "torch_flex", &[]).unwrap();
    let names = [
        "none",
        "causal",
        "sliding_window(64)",
        "document",
        "prefix_lm(100)",
        "alibi",
        "softcap(2.5)",
    ];
    for (i, name) in names.iter().enumerate() {
        let m = FlexMod::parse(name).unwrap();
        // (pass, seq_len_q, seq_len_kv): square, then fewer and more queries than keys, where
        // the bottom-right alignment decides which keys a row sees (rows before the first key
        // see none).
        let mut runs = vec![
            (Pass::Fwd, 300, 300),
            (Pass::Fwd, 200, 300),
            (Pass::Fwd, 300, 130),
        ];
        if matches!(
            m,
            Some(FlexMod::Alibi | FlexMod::SoftCap(_) | FlexMod::Document)
        ) {
            runs.push((Pass::FwdBwd, 300, 300));
        }
        for (pass, tq, tkv) in runs {
            let c = AttentionCase {
                kv_heads: 2,
                causal: m == Some(FlexMod::Causal),
                pass,
                seq_len_q: tq,
                seq_len_kv: tkv,
                ..AttentionCase::new(2, 4, 1, 64)
            };
            let d = dir
                .path()
                .join(format!("mask{i}{}_{tq}x{tkv}", pass.as_str()));
            std::fs::create_dir_all(&d).unwrap();
            let files = write_masked_case(&c, m, 11, 16, &d).unwrap();
            assert_eq!(files.arguments["mask"], *name);
            let mut j = job(&c, "torch_flex", &files);
            j.case.insert(
                "mask".into(),
                kernelpages::schema::Param::Text(name.to_string()),
            );
            let reply = s.request(&j, Duration::from_secs(200)).unwrap();
            let row = &reply.row;
            eprintln!(
                "torch_flex {name} {} {tq}x{tkv}: {:?} {:?} compile {:?} s",
                pass.as_str(),
                row.status,
                row.accuracy.as_ref().map(|a| a.rel_err),
                row.compile_s
            );
            assert_eq!(row.case, j.case);
            if !gpu {
                assert_eq!(row.status, Status::Unsupported, "{row:?}");
                let msg = row.message.as_deref().unwrap_or("");
                assert!(msg.contains("torch") || msg.contains("CUDA"), "{msg}");
                continue;
            }
            assert_eq!(row.status, Status::Ok, "{name}: {row:?}");
            let acc = row.accuracy.as_ref().unwrap();
            assert!(acc.rel_err < acc.tolerance, "{name}: {acc:?}");
            assert!(row.compile_s.unwrap() > 0.0, "{row:?}");
            assert_eq!(row.flops, Some(masked_flops(&c, m)));
            if pass == Pass::FwdBwd {
                assert!(acc.checked.as_deref().unwrap().contains("dQ"));
            }
        }
    }
}
