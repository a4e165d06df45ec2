//! The JAX comparison module (`runners/compare/jax_attention.py`) through the runner's own
//! client ([`kernelpages::runner::process::Server`]): its self-test (pure Python, no JAX), and
//! every job answered with a [`kernelpages::runner::protocol::Reply`] whose row deserialises.
//!
//! Without JAX or a GPU (the CI machine) every row is `unsupported` and says why. With JAX and
//! a GPU (the device machine) the same jobs are measured for real on the runner's input bits
//! and reference. Without `python3` (build.rs's `kp_python`) the tests are compiled as ignored.
//!
//! Where JAX is importable (`kp_jax`), the module's whole path (inputs, jit, vjp, checks,
//! timing) also runs on JAX's CPU platform through its test hook
//! (`KP_COMPARE_JAX_PLATFORM=cpu`): those rows check the code, not a GPU.
//!
//! `KP_RUNNERS_DIR` points the tests at another copy of `runners/` (the device machine).

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use kernelpages::attention::{files, AttentionCase, Dtype, Pass};
use kernelpages::harness::default_timing;
use kernelpages::runner::process::Server;
use kernelpages::runner::protocol::{CaseFiles, Job};
use kernelpages::runner::DeviceChoice;
use kernelpages::schema::{Status, TimingConfig};

fn runners_dir() -> std::path::PathBuf {
    kernelpages::runner::locate_runners_dir().expect("runners/compare/ exists")
}

/// True when JAX sees a GPU here.
fn jax_with_gpu() -> bool {
    Command::new("python3")
        .args([
            "-c",
            "import jax, sys; sys.exit(0 if jax.devices('gpu') else 1)",
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
        case_timeout_s: 60.0,
        ..default_timing()
    }
}

/// The runner's files for a case, as the runner writes them ([`files::write_case`]): q, k, v
/// (and dO for fwd+bwd, with the gradients' checks) and the float64 references.
fn case_files(c: &AttentionCase, dir: &Path) -> CaseFiles {
    files::write_case(c, 11, 16, dir).unwrap()
}

fn case(causal: bool, dtype: Dtype, kv_heads: usize, pass: Pass) -> AttentionCase {
    AttentionCase {
        kv_heads,
        causal,
        dtype,
        pass,
        ..AttentionCase::new(2, 4, 256, 64)
    }
}

#[test]
#[cfg_attr(not(kp_python), ignore = "needs python3")]
fn self_test_passes_without_jax() {
    let o = Command::new("python3")
        .args(["-m", "compare.jax_attention", "self-test"])
        .env("PYTHONPATH", runners_dir())
        .output()
        .expect("python3 runs");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

#[test]
#[cfg_attr(not(kp_python), ignore = "needs python3")]
fn every_job_gets_a_reply_row() {
    let gpu = jax_with_gpu();
    let dir = tempfile::tempdir().unwrap();
    let mut s =
        Server::start("python3", &runners_dir(), "jax_attention", &[]).expect("python3 starts");
    for (i, c) in [
        case(true, Dtype::Bf16, 2, Pass::Fwd),
        case(false, Dtype::F16, 4, Pass::FwdBwd),
    ]
    .iter()
    .enumerate()
    {
        let d = dir.path().join(format!("case{i}"));
        std::fs::create_dir_all(&d).unwrap();
        let files = case_files(c, &d);
        for imp in ["jax_xla", "jax_cudnn"] {
            let job = Job {
                case: c.params(),
                implementation: imp.into(),
                device: DeviceChoice::Gpu,
                timing: timing(),
                l2_bytes: 62_914_560,
                files: files.clone(),
            };
            let reply = s.request(&job, Duration::from_secs(300)).unwrap();
            let row = &reply.row;
            eprintln!(
                "{imp} {}: {:?} {:?}",
                c.pass.as_str(),
                row.status,
                row.message
            );
            assert_eq!(row.case, c.params());
            assert_eq!(
                (row.implementation.as_str(), row.library.as_str()),
                (imp, "JAX")
            );
            assert!(reply.libraries.contains_key("python"));
            if !gpu {
                assert_eq!(row.status, Status::Unsupported, "{row:?}");
                let msg = row.message.as_deref().unwrap();
                assert!(msg.contains("jax") || msg.contains("GPU"), "{msg}");
                continue;
            }
            if row.status != Status::Ok {
                assert!(!row.message.as_deref().unwrap_or("").is_empty(), "{row:?}");
                continue;
            }
            let acc = row.accuracy.as_ref().unwrap();
            assert!(acc.rel_err < acc.tolerance, "{acc:?}");
            assert!(row.first_call_s.unwrap() > 0.0 && row.host_ms.unwrap() > 0.0);
            assert!(row.q1_ms.unwrap() <= row.median_ms.unwrap());
            assert_eq!(
                row.timing,
                Some(kernelpages::schema::TimingMethod::WallClock)
            );
            assert!(row.notes.iter().any(|n| n.contains("XLA compilation")));
            assert_eq!(row.flops, Some(c.flops()));
        }
    }
    // A fwd+bwd job without dO is unsupported, with the reason (GPU or not).
    let c = case(false, Dtype::Bf16, 4, Pass::FwdBwd);
    let d = dir.path().join("nodo");
    std::fs::create_dir_all(&d).unwrap();
    let mut files = case_files(&c, &d);
    files.inputs.truncate(3);
    let job = Job {
        case: c.params(),
        implementation: "jax_xla".into(),
        device: DeviceChoice::Gpu,
        timing: timing(),
        l2_bytes: 1,
        files,
    };
    let row = s.request(&job, Duration::from_secs(120)).unwrap().row;
    assert_eq!(row.status, Status::Unsupported);
    if gpu {
        assert!(row.message.unwrap().contains("dO"));
    }
    assert!(s.alive());
}

#[test]
#[cfg_attr(
    not(kp_jax),
    ignore = "needs jax importable by python3 (the CPU build of jaxlib is enough)"
)]
fn the_whole_module_runs_on_jax_cpu() {
    let dir = tempfile::tempdir().unwrap();
    let c = AttentionCase {
        kv_heads: 2,
        causal: true,
        pass: Pass::FwdBwd,
        ..AttentionCase::new(1, 4, 100, 32)
    };
    let files = case_files(&c, dir.path());
    let job = Job {
        case: c.params(),
        implementation: "jax_xla".into(),
        device: DeviceChoice::Gpu,
        timing: timing(),
        l2_bytes: 1 << 20,
        files: files.clone(),
    };
    let cpu = ("KP_COMPARE_JAX_PLATFORM".to_string(), "cpu".to_string());
    let mut s = Server::start(
        "python3",
        &runners_dir(),
        "jax_attention",
        std::slice::from_ref(&cpu),
    )
    .expect("python3 starts");
    let row = s.request(&job, Duration::from_secs(300)).unwrap().row;
    assert_eq!(row.status, Status::Ok, "{row:?}");
    let acc = row.accuracy.unwrap();
    assert!(acc.rel_err < acc.tolerance, "{acc:?}");
    assert!(row.host_ms.unwrap() <= row.median_ms.unwrap() * 1.5);
    // A NaN planted outside the checked elements fails the row.
    let covered = |i: u64| files.check.ranges.iter().any(|&[s, n]| i >= s && i < s + n);
    let outside = (0..c.q_elems() as u64)
        .rev()
        .find(|&i| !covered(i))
        .unwrap();
    let mut s = Server::start(
        "python3",
        &runners_dir(),
        "jax_attention",
        &[cpu, ("KP_COMPARE_PLANT_NAN".into(), outside.to_string())],
    )
    .unwrap();
    let row = s.request(&job, Duration::from_secs(300)).unwrap().row;
    assert_eq!(row.status, Status::Error, "{row:?}");
    assert!(row
        .message
        .unwrap()
        .contains(&format!("non-finite output at element {outside} ")));
}

/// The dense kernel-sum module (`runners/compare/jax_kernel_sums.py`) on JAX's CPU platform,
/// picked by the job's `device`: every op and the gradient checked against the runner's
/// float64 reference, peak memory from the resident set, no host time (it does not apply on
/// the CPU).
#[test]
#[cfg_attr(
    not(kp_jax),
    ignore = "needs jax importable by python3 (the CPU build of jaxlib is enough)"
)]
fn kernel_sum_module_runs_on_jax_cpu() {
    use kernelpages::kernel_sums::{files as ks_files, KernelSumCase, Op};
    let dir = tempfile::tempdir().unwrap();
    let mut s = Server::start("python3", &runners_dir(), "jax_kernel_sums", &[]).unwrap();
    let cases = [
        KernelSumCase {
            cols: 3,
            ..KernelSumCase::new(Op::RbfMv, 300, 200, 3)
        },
        KernelSumCase::new(Op::Kde, 300, 200, 2),
        KernelSumCase::new(Op::KernelLse, 300, 200, 16),
        KernelSumCase {
            grad: true,
            ..KernelSumCase::new(Op::KernelLse, 300, 200, 3)
        },
    ];
    for (k, c) in cases.iter().enumerate() {
        let sub = dir.path().join(k.to_string());
        std::fs::create_dir_all(&sub).unwrap();
        let job = Job {
            case: c.params(),
            implementation: "jax_dense".into(),
            device: DeviceChoice::Cpu,
            timing: timing(),
            l2_bytes: 1 << 20,
            files: ks_files::write_case(c, 3, 32, &sub).unwrap(),
        };
        let row = s.request(&job, Duration::from_secs(300)).unwrap().row;
        eprintln!(
            "{c:?}: {:?} {:?} {:?}",
            row.status, row.median_ms, row.message
        );
        assert_eq!(row.status, Status::Ok, "{c:?}: {row:?}");
        assert_eq!(row.host_ms, None, "{row:?}");
        let acc = row.accuracy.unwrap();
        assert!(acc.rel_err < acc.tolerance, "{c:?}: {acc:?}");
        let mem = row.memory.unwrap();
        assert!(mem.peak_mb.is_some(), "{mem:?}");
    }
}

/// The sequence-mixer module (`runners/compare/jax_mixers.py`): its self-test (the pure
/// checks; with JAX, both formulations and dA's gradient against float64 recurrences).
#[test]
#[cfg_attr(not(kp_python), ignore = "needs python3")]
fn mixer_self_test_passes() {
    let o = Command::new("python3")
        .args(["-m", "compare.jax_mixers", "self-test"])
        .env("PYTHONPATH", runners_dir())
        .output()
        .expect("python3 runs");
    assert!(
        o.status.success(),
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

/// The sequence-mixer module on JAX's CPU platform, picked by the job's `device`: SSD (groups,
/// bf16 and fp32) and the selective scan, fwd and fwd+bwd, each output and gradient checked
/// against the runner's float64 references; the gated delta rule answered `unsupported` with
/// the reason.
#[test]
#[cfg_attr(
    not(kp_jax),
    ignore = "needs jax importable by python3 (the CPU build of jaxlib is enough)"
)]
fn mixer_module_runs_on_jax_cpu() {
    use kernelpages::sequence_mixers::case::{MixerCase, MixerDtype, MixerPass};
    use kernelpages::sequence_mixers::files as mixer_files;
    let dir = tempfile::tempdir().unwrap();
    let mut s = Server::start("python3", &runners_dir(), "jax_mixers", &[]).unwrap();
    let mut ssd = MixerCase::ssd(2, 70, 4, 8, 16);
    ssd.groups = 2;
    let mut ssd_bf16 = ssd;
    ssd_bf16.dtype = MixerDtype::Bf16;
    let mut ssd_back = ssd;
    ssd_back.pass = MixerPass::FwdBwd;
    let mut scan_back = MixerCase::scan(2, 50, 12, 4);
    scan_back.pass = MixerPass::FwdBwd;
    let delta = MixerCase::gated_delta(1, 9, 2, 8);
    for (k, c) in [ssd, ssd_bf16, ssd_back, scan_back, delta]
        .iter()
        .enumerate()
    {
        let sub = dir.path().join(k.to_string());
        std::fs::create_dir_all(&sub).unwrap();
        let job = Job {
            case: c.params(),
            implementation: "jax_scan".into(),
            device: DeviceChoice::Cpu,
            timing: timing(),
            l2_bytes: 1 << 20,
            files: mixer_files::write_case(c, 3, 32, &sub).unwrap(),
        };
        let row = s.request(&job, Duration::from_secs(300)).unwrap().row;
        eprintln!(
            "{}: {:?} {:?} {:?}",
            c.label(),
            row.status,
            row.median_ms,
            row.message
        );
        if k == 4 {
            assert_eq!(row.status, Status::Unsupported, "{row:?}");
            assert!(row.message.unwrap().contains("associative-scan"));
            continue;
        }
        assert_eq!(row.status, Status::Ok, "{}: {row:?}", c.label());
        let acc = row.accuracy.unwrap();
        assert!(acc.rel_err < acc.tolerance, "{}: {acc:?}", c.label());
        assert!(row.memory.unwrap().peak_mb.is_some());
    }
}
