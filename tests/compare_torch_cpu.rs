//! The PyTorch CPU comparison module (`runners/compare/torch_cpu.py`) through the runner's own
//! client: its self-test (no torch needed), and every job answered with a row that
//! deserialises as [`kernelpages::schema::Row`]. Without torch every row is `unsupported` and
//! names torch; with torch (any machine: it runs on the CPU) the rows are measured, on the
//! runner's input bits and reference, and a NaN planted outside the checked elements fails the
//! row. Without `python3` (build.rs's `kp_python`) the tests are compiled as ignored, and the
//! NaN test without torch (`kp_torch`).

use std::process::Command;
use std::time::Duration;

use kernelpages::attention::{files, AttentionCase, Pass};
use kernelpages::harness::default_timing;
use kernelpages::runner::process::Server;
use kernelpages::runner::protocol::Job;
use kernelpages::runner::DeviceChoice;
use kernelpages::schema::{Status, TimingConfig, TimingMethod};

fn runners_dir() -> std::path::PathBuf {
    kernelpages::runner::locate_runners_dir().expect("runners/compare/ exists")
}

fn have_torch() -> bool {
    Command::new("python3")
        .args(["-c", "import torch"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

fn job(c: &AttentionCase, implementation: &str, dir: &std::path::Path) -> Job {
    let files = files::write_case(c, 1, 16, dir).unwrap();
    Job {
        case: c.params(),
        implementation: implementation.into(),
        device: DeviceChoice::Cpu,
        timing: TimingConfig {
            warmup_ms: 5.0,
            repeats: 5,
            min_sample_ms: 0.5,
            case_timeout_s: 60.0,
            ..default_timing()
        },
        l2_bytes: 1 << 20,
        files,
    }
}

fn case() -> AttentionCase {
    AttentionCase {
        kv_heads: 2,
        causal: true,
        ..AttentionCase::new(1, 4, 128, 64)
    }
}

#[test]
#[cfg_attr(not(kp_python), ignore = "needs python3")]
fn self_test_passes_without_torch() {
    let o = Command::new("python3")
        .args(["-m", "compare.torch_cpu", "self-test"])
        .env("PYTHONPATH", runners_dir())
        .output()
        .expect("python3 runs");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

#[test]
#[cfg_attr(not(kp_python), ignore = "needs python3")]
fn every_job_gets_a_reply_row() {
    let torch = have_torch();
    let dir = tempfile::tempdir().unwrap();
    let mut s = Server::start("python3", &runners_dir(), "torch_cpu", &[]).expect("starts");
    let c = case();
    for imp in ["torch_cpu_flash", "torch_cpu_math"] {
        let row = s
            .request(&job(&c, imp, dir.path()), Duration::from_secs(120))
            .unwrap()
            .row;
        eprintln!(
            "{imp}: {:?} {:?} {:?}",
            row.status, row.median_ms, row.message
        );
        assert_eq!(
            (row.implementation.as_str(), row.library.as_str()),
            (imp, "PyTorch")
        );
        if !torch {
            assert_eq!(row.status, Status::Unsupported);
            assert!(row.message.unwrap().contains("torch"));
            continue;
        }
        assert_eq!(row.status, Status::Ok, "{row:?}");
        let acc = row.accuracy.unwrap();
        assert!(acc.rel_err < acc.tolerance, "{acc:?}");
        assert!(row.host_ms.is_none());
        assert_eq!(
            row.timing,
            Some(kernelpages::schema::TimingMethod::WallClock)
        );
        assert!(row.notes.iter().any(|n| n.contains("intra-op threads")));
    }
    let fwd_bwd = AttentionCase {
        pass: Pass::FwdBwd,
        ..c.clone()
    };
    let row = s
        .request(
            &job(&fwd_bwd, "torch_cpu_flash", dir.path()),
            Duration::from_secs(60),
        )
        .unwrap()
        .row;
    // Forward + backward: O, dQ, dK and dV checked against float64 (torch), or unsupported
    // naming torch when it is missing.
    if torch {
        assert_eq!(row.status, Status::Ok, "{row:?}");
        let acc = row.accuracy.unwrap();
        assert!(acc.rel_err < acc.tolerance, "{acc:?}");
        let checked = acc.checked.unwrap_or_default();
        assert!(checked.contains("dV"), "{checked}");
    } else {
        assert_eq!(row.status, Status::Unsupported);
        assert!(row.message.unwrap().contains("torch"));
    }
}

#[test]
#[cfg_attr(
    not(kp_torch),
    ignore = "needs torch importable by python3 (the self-test covers the check without it)"
)]
fn a_nan_outside_the_checked_rows_fails_the_row() {
    assert!(have_torch(), "torch is not importable");
    let dir = tempfile::tempdir().unwrap();
    let c = case();
    let j = job(&c, "torch_cpu_flash", dir.path());
    let covered = |i: u64| {
        j.files
            .check
            .ranges
            .iter()
            .any(|&[s, n]| i >= s && i < s + n)
    };
    let outside = (0..c.q_elems() as u64)
        .rev()
        .find(|&i| !covered(i))
        .unwrap();
    let mut s = Server::start(
        "python3",
        &runners_dir(),
        "torch_cpu",
        &[("KP_COMPARE_PLANT_NAN".into(), outside.to_string())],
    )
    .unwrap();
    let row = s.request(&j, Duration::from_secs(120)).unwrap().row;
    assert_eq!(row.status, Status::Error);
    assert!(row
        .message
        .unwrap()
        .contains(&format!("non-finite output at element {outside} ")));
}

/// The dense kernel-sum module (`runners/compare/torch_kernel_sums.py`) on the same client:
/// its self-test, and one job per operation (the log-sum-exp with its gradient dX included)
/// answered with a row; with torch every row is measured and within the float32 tolerance of
/// the runner's float64 reference, without torch every row is `unsupported` naming torch.
#[test]
#[cfg_attr(not(kp_python), ignore = "needs python3")]
fn kernel_sum_module_answers_every_op() {
    use kernelpages::kernel_sums::{files as ks_files, KernelSumCase, Op};
    let o = Command::new("python3")
        .args(["-m", "compare.torch_kernel_sums", "self-test"])
        .env("PYTHONPATH", runners_dir())
        .output()
        .expect("python3 runs");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let torch = have_torch();
    let dir = tempfile::tempdir().unwrap();
    let mut s = Server::start("python3", &runners_dir(), "torch_kernel_sums", &[]).expect("starts");
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
        let mut j = job(&case(), "torch_dense", &sub);
        j.case = c.params();
        j.files = ks_files::write_case(c, 3, 32, &sub).unwrap();
        let row = s.request(&j, Duration::from_secs(120)).unwrap().row;
        eprintln!(
            "{c:?}: {:?} {:?} {:?}",
            row.status, row.median_ms, row.message
        );
        if !torch {
            assert_eq!(row.status, Status::Unsupported);
            assert!(row.message.unwrap().contains("torch"));
            continue;
        }
        assert_eq!(row.status, Status::Ok, "{c:?}: {row:?}");
        let acc = row.accuracy.unwrap();
        assert!(acc.rel_err < acc.tolerance, "{c:?}: {acc:?}");
        assert_eq!(row.items, Some(c.evaluations()));
        if c.grad {
            assert!(
                acc.checked.unwrap().contains("dX"),
                "the gradient is checked"
            );
        }
    }
}

/// The sequence-mixer module (`compare.torch_mixers`, PyTorch's eager formulations): its
/// self-test, then one job per (mixer, dtype) with a length that is not a multiple of the
/// chunk (SSD, the selective scan, the gated delta rule, Based), and a backward job; with torch the forwards are measured and within the dtype's
/// tolerance of the runner's float64 reference and the backward is `unsupported`, without
/// torch every row is `unsupported` naming torch.
#[test]
#[cfg_attr(not(kp_python), ignore = "needs python3")]
fn mixer_module_answers_each_mixer_and_dtype() {
    use kernelpages::sequence_mixers::case::{MixerCase, MixerDtype};
    use kernelpages::sequence_mixers::files as mx_files;
    let o = Command::new("python3")
        .args(["-m", "compare.torch_mixers", "self-test"])
        .env("PYTHONPATH", runners_dir())
        .output()
        .expect("python3 runs");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let torch = have_torch();
    let dir = tempfile::tempdir().unwrap();
    let mut s = Server::start("python3", &runners_dir(), "torch_mixers", &[]).expect("starts");
    let mut ssd = MixerCase::ssd(2, 100, 4, 8, 16);
    ssd.groups = 2;
    let scan = MixerCase::scan(2, 100, 24, 16);
    let delta = MixerCase::gated_delta(2, 100, 3, 8);
    let based = MixerCase::based(2, 100, 3, 8, 5);
    let mut k = 0;
    for base in [ssd, scan, delta, based] {
        for dtype in [MixerDtype::Fp32, MixerDtype::Bf16] {
            let c = MixerCase { dtype, ..base };
            k += 1;
            let sub = dir.path().join(k.to_string());
            std::fs::create_dir_all(&sub).unwrap();
            let mut j = job(&case(), "torch_eager", &sub);
            j.case = c.params();
            j.files = mx_files::write_case(&c, 3, 16, &sub).unwrap();
            let row = s.request(&j, Duration::from_secs(120)).unwrap().row;
            eprintln!(
                "{}: {:?} {:?} {:?}",
                c.label(),
                row.status,
                row.median_ms,
                row.message
            );
            if !torch {
                assert_eq!(row.status, Status::Unsupported);
                assert!(row.message.unwrap().contains("torch"));
                continue;
            }
            assert_eq!(row.status, Status::Ok, "{c:?}: {row:?}");
            let acc = row.accuracy.unwrap();
            assert!(acc.rel_err < acc.tolerance, "{c:?}: {acc:?}");
            assert_eq!(row.items, Some(c.tokens()));
        }
    }
    if torch {
        let sub = dir.path().join("bwd");
        std::fs::create_dir_all(&sub).unwrap();
        let mut j = job(&case(), "torch_eager", &sub);
        j.files = mx_files::write_case(&scan, 3, 16, &sub).unwrap();
        j.case = scan.params();
        j.case.insert(
            "pass".into(),
            kernelpages::schema::Param::Text("fwd+bwd".into()),
        );
        j.files
            .arguments
            .insert("pass".into(), serde_json::json!("fwd+bwd"));
        let row = s.request(&j, Duration::from_secs(120)).unwrap().row;
        assert_eq!(row.status, Status::Unsupported, "{row:?}");
    }
}

/// flash-linear-attention's module (`compare.fla_mixers`): its self-test passes anywhere (the
/// kernels are checked only where torch has a GPU and the library imports), and a CPU job is an
/// `unsupported` row for every mixer, saying that the library's kernels are Triton kernels for
/// GPUs.
#[test]
#[cfg_attr(not(kp_python), ignore = "needs python3")]
fn fla_module_answers_cpu_jobs_with_reasons() {
    use kernelpages::sequence_mixers::case::MixerCase;
    use kernelpages::sequence_mixers::files as mx_files;
    let o = Command::new("python3")
        .args(["-m", "compare.fla_mixers", "self-test"])
        .env("PYTHONPATH", runners_dir())
        .output()
        .expect("python3 runs");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let dir = tempfile::tempdir().unwrap();
    let mut s = Server::start("python3", &runners_dir(), "fla_mixers", &[]).expect("starts");
    let cases = [
        MixerCase::ssd(1, 70, 2, 8, 8),
        MixerCase::scan(1, 70, 8, 4),
        MixerCase::gated_delta(1, 70, 2, 8),
        MixerCase::based(1, 70, 2, 8, 5),
    ];
    for (k, c) in cases.iter().enumerate() {
        let sub = dir.path().join(k.to_string());
        std::fs::create_dir_all(&sub).unwrap();
        let mut j = job(&case(), "fla_chunk", &sub);
        j.case = c.params();
        j.files = mx_files::write_case(c, 3, 16, &sub).unwrap();
        let row = s.request(&j, Duration::from_secs(60)).unwrap().row;
        assert_eq!(row.status, Status::Unsupported, "{c:?}: {row:?}");
        assert_eq!(row.library, "flash-linear-attention");
        let msg = row.message.unwrap();
        assert!(msg.contains("GPU"), "{msg}");
    }
}

/// mamba_ssm's module (`compare.mamba_mixers`): its self-test passes anywhere, and a CPU job is
/// an `unsupported` row saying why (no CPU rows; the gated delta rule and Based are not in the
/// library).
#[test]
#[cfg_attr(not(kp_python), ignore = "needs python3")]
fn mamba_module_answers_cpu_jobs_with_reasons() {
    use kernelpages::sequence_mixers::case::MixerCase;
    use kernelpages::sequence_mixers::files as mx_files;
    let o = Command::new("python3")
        .args(["-m", "compare.mamba_mixers", "self-test"])
        .env("PYTHONPATH", runners_dir())
        .output()
        .expect("python3 runs");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let dir = tempfile::tempdir().unwrap();
    let mut s = Server::start("python3", &runners_dir(), "mamba_mixers", &[]).expect("starts");
    for (k, c) in [MixerCase::ssd(1, 70, 2, 8, 8), MixerCase::scan(1, 70, 8, 4)]
        .iter()
        .enumerate()
    {
        let sub = dir.path().join(k.to_string());
        std::fs::create_dir_all(&sub).unwrap();
        let mut j = job(&case(), "mamba_ssm", &sub);
        j.case = c.params();
        j.files = mx_files::write_case(c, 3, 16, &sub).unwrap();
        let row = s.request(&j, Duration::from_secs(60)).unwrap().row;
        assert_eq!(row.status, Status::Unsupported, "{c:?}: {row:?}");
        assert_eq!(row.library, "mamba_ssm");
        assert!(row.message.unwrap().contains("GPU"));
    }
}

/// `runners/mamba_wheel.py` packs a source distribution's `mamba_ssm/*.py` into a wheel whose
/// RECORD hashes every file and whose METADATA names the version; a tarball that is not
/// mamba_ssm's is refused.
#[test]
#[cfg_attr(not(kp_python), ignore = "needs python3")]
fn mamba_wheel_packs_the_python_sources() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("mamba_ssm-9.9");
    std::fs::create_dir_all(src.join("mamba_ssm/ops")).unwrap();
    std::fs::write(src.join("PKG-INFO"), "Name: mamba_ssm\nVersion: 9.9\n").unwrap();
    std::fs::write(
        src.join("mamba_ssm/__init__.py"),
        "import selective_scan_cuda\n",
    )
    .unwrap();
    std::fs::write(src.join("mamba_ssm/ops/kernel.py"), "X = 1\n").unwrap();
    std::fs::write(src.join("mamba_ssm/ops/ext.cu"), "// not packed\n").unwrap();
    let tar = dir.path().join("sdist.tar.gz");
    let ok = Command::new("tar")
        .args(["czf"])
        .arg(&tar)
        .args(["-C"])
        .arg(dir.path())
        .arg("mamba_ssm-9.9")
        .status()
        .unwrap();
    assert!(ok.success());
    let script = runners_dir().join("mamba_wheel.py");
    let out = Command::new("python3")
        .arg(&script)
        .arg(&tar)
        .arg(dir.path().join("whl"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let check = Command::new("python3")
        .args([
            "-c",
            "import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); n = sorted(z.namelist()); \
             print('\\n'.join(n)); r = z.read('mamba_ssm-9.9.dist-info/RECORD').decode(); \
             assert 'mamba_ssm/ops/kernel.py,sha256=' in r, r; \
             assert 'Version: 9.9' in z.read('mamba_ssm-9.9.dist-info/METADATA').decode()",
        ])
        .arg(dir.path().join("whl/mamba_ssm-9.9-py3-none-any.whl"))
        .output()
        .unwrap();
    let listing = String::from_utf8_lossy(&check.stdout);
    assert!(
        check.status.success(),
        "{listing}{}",
        String::from_utf8_lossy(&check.stderr)
    );
    assert!(
        listing.contains("mamba_ssm/__init__.py") && !listing.contains("ext.cu"),
        "{listing}"
    );
    let bad = Command::new("python3")
        .arg(&script)
        .arg(dir.path().join("whl/mamba_ssm-9.9-py3-none-any.whl"))
        .arg(dir.path().join("whl2"))
        .output()
        .unwrap();
    assert!(!bad.status.success());
}

/// The MoE module (`compare.torch_moe`, PyTorch's grouped-GEMM alternatives): its self-test,
/// then a CPU job and a GPU job of a skewed case with empty experts (forward and backward),
/// each answered with a row: `unsupported` naming torch or CUDA where there is no torch (or,
/// for the GPU job, no device), else measured within the tolerance with dX and dW checked (on
/// the CPU by wall clock, its note naming the CPU's `_grouped_mm`).
#[test]
#[cfg_attr(not(kp_python), ignore = "needs python3")]
fn moe_module_answers_cpu_and_gpu_jobs() {
    use kernelpages::moe::case::{GroupedCase, Spread};
    use kernelpages::moe::files as moe_files;
    let o = Command::new("python3")
        .args(["-m", "compare.torch_moe", "self-test"])
        .env("PYTHONPATH", runners_dir())
        .output()
        .expect("python3 runs");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let dir = tempfile::tempdir().unwrap();
    let mut s = Server::start("python3", &runners_dir(), "torch_moe", &[]).expect("starts");
    let c = GroupedCase {
        tokens: 100,
        experts: 8,
        top_k: 2,
        hidden: 64,
        width: 48,
        spread: Spread::Zipf,
        backward: true,
    };
    for device in [DeviceChoice::Cpu, DeviceChoice::Gpu] {
        let sub = dir.path().join(format!("{device:?}"));
        std::fs::create_dir_all(&sub).unwrap();
        let mut j = job(&case(), "torch_grouped_mm", &sub);
        j.device = device;
        j.case = c.params();
        j.files = moe_files::write_case(&c, 3, 16, &sub).unwrap();
        let row = s.request(&j, Duration::from_secs(120)).unwrap().row;
        eprintln!("{device:?}: {:?} {:?}", row.status, row.message);
        if device == DeviceChoice::Cpu && cfg!(kp_torch) {
            assert_eq!(row.status, Status::Ok, "{row:?}");
            assert_eq!(row.timing, Some(TimingMethod::WallClock), "{row:?}");
            assert!(row
                .notes
                .iter()
                .any(|n| n.contains("_grouped_mm on the CPU")));
        }
        if row.status == Status::Unsupported {
            let m = row.message.unwrap();
            assert!(m.contains("torch") || m.contains("CUDA"), "{m}");
            continue;
        }
        assert_eq!(row.status, Status::Ok, "{row:?}");
        let acc = row.accuracy.unwrap();
        assert!(acc.rel_err < acc.tolerance, "{acc:?}");
        let checked = acc.checked.unwrap();
        assert!(
            checked.contains("dX") && checked.contains("dW"),
            "{checked}"
        );
    }
}

/// `compare/flex_sweep.py` (how many compiles PyTorch's flex_attention under torch.compile
/// spends on a seq_len sweep in one process) on the CPU with two short lengths: one JSON line
/// per length and a total per mask whose graph count is the lengths' sum, the first length
/// compiling at least once, every output finite (the script raises otherwise).
#[test]
#[cfg_attr(not(kp_torch), ignore = "needs python3 with torch")]
fn flex_sweep_counts_the_compiles_of_each_length() {
    let o = Command::new("python3")
        .args([
            "-m",
            "compare.flex_sweep",
            "--device",
            "cpu",
            "--seq-lens",
            "64,128",
            "--masks",
            "causal",
            "--calls",
            "1",
        ])
        .env("PYTHONPATH", runners_dir())
        .output()
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let lines: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    assert!(lines[0].get("setup").is_some(), "{stdout}");
    let rows: Vec<&serde_json::Value> = lines
        .iter()
        .filter(|l| l.get("seq_len").is_some())
        .collect();
    assert_eq!(rows.len(), 2, "{stdout}");
    assert!(rows[0]["graphs"].as_u64().unwrap() >= 1, "{stdout}");
    let total = lines.last().unwrap();
    let sum: u64 = rows.iter().map(|r| r["graphs"].as_u64().unwrap()).sum();
    assert_eq!(total["graphs"].as_u64(), Some(sum), "{stdout}");
    assert_eq!(total["lengths"].as_u64(), Some(2), "{stdout}");
    assert_eq!(
        total["recompiled_lengths"][0].as_u64(),
        Some(64),
        "{stdout}"
    );
}
