//! The PyTorch CPU comparison module (`runners/compare/torch_cpu.py`) through the runner's own
//! client: its self-test (no torch needed), and every job answered with a row that
//! deserialises as [`kernelpages::schema::Row`]. Without torch every row is `unsupported` and
//! names torch; with torch (any machine: it runs on the CPU) the rows are measured, on the
//! runner's input bits and reference, and a NaN planted outside the checked elements fails the
//! row. Without `python3` (build.rs's `kp_python`) the tests are compiled as ignored, and the
//! NaN test without torch (`kp_torch`).

use std::process::Command;
use std::time::Duration;

use kernelpages::attention::cpu::{normal_bits, reference_values, CheckPlan};
use kernelpages::attention::{AttentionCase, Dtype, Pass};
use kernelpages::harness::default_timing;
use kernelpages::runner::process::Server;
use kernelpages::runner::protocol::{
    write_f64, write_u16, CaseFiles, CheckSpec, Job, OutputSpec, TensorFile,
};
use kernelpages::schema::{Reference, Status, TimingConfig};

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
    let q = normal_bits(c.q_elems(), c.dtype, 1);
    let k = normal_bits(c.kv_elems(), c.dtype, 2);
    let v = normal_bits(c.kv_elems(), c.dtype, 3);
    let plan = CheckPlan::new(c, 16, 5);
    write_f64(
        &dir.join("ref.f64"),
        &reference_values(c, &q, &k, &v, &plan),
    )
    .unwrap();
    let q_shape = vec![c.batch, c.heads, c.seq_len, c.head_dim];
    let kv_shape = vec![c.batch, c.kv_heads, c.seq_len, c.head_dim];
    let inputs = [
        ("q", &q, &q_shape),
        ("k", &k, &kv_shape),
        ("v", &v, &kv_shape),
    ]
    .into_iter()
    .map(|(name, bits, shape)| {
        let path = dir.join(format!("{name}.bin"));
        write_u16(&path, bits).unwrap();
        TensorFile {
            name: name.into(),
            dtype: c.dtype.as_str().into(),
            shape: shape.clone(),
            path,
        }
    })
    .collect();
    Job {
        case: c.params(),
        implementation: implementation.into(),
        timing: TimingConfig {
            warmup_ms: 5.0,
            repeats: 5,
            min_sample_ms: 0.5,
            case_timeout_s: 60.0,
            ..default_timing()
        },
        l2_bytes: 1 << 20,
        files: CaseFiles {
            inputs,
            output: OutputSpec {
                dtype: c.dtype.as_str().into(),
                shape: q_shape,
            },
            check: CheckSpec {
                ranges: plan.ranges(c),
                reference: dir.join("ref.f64"),
                reference_kind: Reference::Float64Cpu,
                tolerance: c.dtype.tolerance(),
                checked: plan.describe(c),
            },
            flops: Some(c.flops()),
            bytes: None,
        },
    }
}

fn case() -> AttentionCase {
    AttentionCase {
        batch: 1,
        heads: 4,
        kv_heads: 2,
        seq_len: 128,
        head_dim: 64,
        causal: true,
        dtype: Dtype::Bf16,
        pass: Pass::Fwd,
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
        assert!(row.host_ms.is_none() && row.timing.is_none());
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
    assert_eq!(row.status, Status::Unsupported);
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
