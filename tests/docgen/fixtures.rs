//! Generates the synthetic test fixture `tests/fixtures/valid/gpu_attention.json`.
//!
//! The numbers are made up by a formula: this is a TEST FIXTURE, not a measurement. Regenerate
//! with `cargo test --test docgen fixtures:: -- --ignored`; the non-ignored test checks that the
//! committed file is what the generator produces.

use std::collections::BTreeMap;
use std::path::PathBuf;

use kernelpages::schema::{
    Accuracy, Count, Device, DeviceKind, DispatchRule, Document, Memory, Param, Reference, Row,
    RunConfig, Status, Suite, Throughput, TimingConfig, SCHEMA_VERSION,
};

const IMPLS: [(&str, &str, bool); 6] = [
    ("flash", "kernelpages", true),
    ("math", "cuBLAS", false),
    ("torch_flash", "PyTorch", false),
    ("torch_cudnn", "PyTorch", false),
    ("torch_efficient", "PyTorch", false),
    ("torch_math", "PyTorch", false),
];

fn fixture_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/valid/gpu_attention.json")
}

fn synthetic_document() -> Document {
    let mut rows = Vec::new();
    for head_dim in [64i64, 128] {
        for causal in [false, true] {
            for seq_len in [512i64, 1024, 2048, 4096] {
                for (name, library, default) in IMPLS {
                    let mut case = BTreeMap::new();
                    case.insert("batch".to_string(), Param::Int(4));
                    case.insert("heads".to_string(), Param::Int(16));
                    case.insert("kv_heads".to_string(), Param::Int(16));
                    case.insert("seq_len".to_string(), Param::Int(seq_len));
                    case.insert("head_dim".to_string(), Param::Int(head_dim));
                    case.insert("causal".to_string(), Param::Bool(causal));
                    case.insert("dtype".to_string(), Param::Text("bf16".to_string()));
                    case.insert("pass".to_string(), Param::Text("fwd".to_string()));
                    // A missing (case, implementation) pair: no row at all.
                    if name == "torch_efficient" && seq_len == 4096 && head_dim == 64 && !causal {
                        continue;
                    }
                    if name == "math" && seq_len == 4096 && head_dim == 128 && !causal {
                        rows.push(Row::failed(
                            case,
                            name,
                            library,
                            default,
                            Status::Oom,
                            "CUDA_ERROR_OUT_OF_MEMORY: allocating the 4.29 GB score matrix",
                        ));
                        continue;
                    }
                    if name == "torch_cudnn" && seq_len == 512 && head_dim == 64 && causal {
                        rows.push(Row::failed(
                            case,
                            name,
                            library,
                            default,
                            Status::Unsupported,
                            "<script>alert(1)</script> cuDNN SDPA rejects this shape",
                        ));
                        continue;
                    }
                    if name == "flash" && seq_len == 4096 && head_dim == 128 && causal {
                        rows.push(Row::failed(
                            case,
                            name,
                            library,
                            default,
                            Status::Timeout,
                            "case exceeded 60 s",
                        ));
                        continue;
                    }
                    let factor = match name {
                        "flash" => 1.0,
                        "math" => 2.5,
                        "torch_flash" => 1.1,
                        "torch_cudnn" => {
                            if head_dim == 128 {
                                0.8
                            } else {
                                1.3
                            }
                        }
                        "torch_efficient" => 1.2,
                        _ => 3.0,
                    };
                    let t = seq_len as f64 / 512.0;
                    let causal_factor = if causal { 0.55 } else { 1.0 };
                    let median = 0.05 * t * t * (head_dim as f64 / 64.0) * factor * causal_factor;
                    let median = (median * 1e4).round() / 1e4;
                    let flops = 4.0
                        * 4.0
                        * 16.0
                        * (seq_len * seq_len) as f64
                        * head_dim as f64
                        * if causal { 0.5 } else { 1.0 };
                    let rel_err =
                        if name == "torch_math" && seq_len == 2048 && head_dim == 128 && causal {
                            0.05
                        } else {
                            2.0e-3 + 1.0e-4 * factor
                        };
                    let arguments_mb = 3.0 * 4.0 * 16.0 * (seq_len * head_dim) as f64 * 2.0 / 1e6;
                    rows.push(Row {
                        case,
                        implementation: name.to_string(),
                        library: library.to_string(),
                        default,
                        status: Status::Ok,
                        message: None,
                        median_ms: Some(median),
                        q1_ms: Some((median * 0.98 * 1e5).round() / 1e5),
                        q3_ms: Some((median * 1.03 * 1e5).round() / 1e5),
                        inner_calls: Some(8),
                        samples: Some(20),
                        input_sets: Some(4),
                        compile_s: Some(0.4),
                        memory: Some(Memory {
                            arguments_mb: Some(arguments_mb),
                            outputs_mb: Some(arguments_mb / 3.0),
                            temporaries_mb: Some(if name == "math" {
                                4.0 * 16.0 * (seq_len * seq_len) as f64 * 4.0 / 1e6
                            } else {
                                0.0
                            }),
                            residuals_mb: None,
                            peak_mb: Some(arguments_mb * 1.5),
                            peak_method: Some("cuMemGetInfo delta".to_string()),
                            ..Memory::default()
                        }),
                        accuracy: Some(Accuracy {
                            rel_err,
                            metric: "rel_l2".to_string(),
                            reference: Reference::Float64Cpu,
                            tolerance: 1.0e-2,
                            checked: Some(
                                "2 of 64 (batch, head) slices x 256 query rows".to_string(),
                            ),
                        }),
                        flops: Some(flops),
                        ..Row::failed(BTreeMap::new(), name, library, default, Status::Ok, "")
                    });
                }
            }
        }
    }
    let mut libraries = BTreeMap::new();
    libraries.insert("cudarc".to_string(), "0.19.0".to_string());
    libraries.insert("cuda".to_string(), "13.0".to_string());
    libraries.insert("torch".to_string(), "2.9.0".to_string());
    Document {
        schema_version: SCHEMA_VERSION,
        suite: Suite::Attention,
        device: Device {
            kind: DeviceKind::Gpu,
            name: "Synthetic Test GPU (fixture)".to_string(),
            compute_capability: Some("9.0".to_string()),
            sm_count: Some(132),
            memory_mb: Some(150_000.0),
            l2_mb: Some(60.0),
            driver_version: Some("000.00".to_string()),
            cuda_version: Some("13.0".to_string()),
            cpu_threads: None,
            host_cpu: None,
            os: None,
            nvrtc_arch: None,
            power_limit_w: None,
            max_sm_clock_mhz: None,
            max_mem_clock_mhz: None,
        },
        config: RunConfig {
            runner: "attention".to_string(),
            runner_version: "0.1.0".to_string(),
            git_commit: "0000000000000000000000000000000000000000".to_string(),
            libraries,
            timing: TimingConfig {
                warmup_ms: 100.0,
                repeats: 20,
                min_sample_ms: 2.0,
                max_inner: 1000,
                l2_rotation_factor: 3.0,
                case_timeout_s: 60.0,
                launch_bound_ratio: kernelpages::schema::LAUNCH_BOUND_RATIO,
                runs: 1,
            },
            command: vec![
                "attention".to_string(),
                "--compare".to_string(),
                "torch".to_string(),
                "--output".to_string(),
                "data/gpu_attention.json".to_string(),
                "--note".to_string(),
                "fixture run's note".to_string(),
            ],
            flop_rule: None,
            started_at: "2000-01-01T00:00:00Z".to_string(),
            finished_at: Some("2000-01-01T00:10:00Z".to_string()),
            axes: vec!["seq_len".to_string()],
            throughput: vec![Throughput {
                key: "tflops".to_string(),
                unit: "TFLOP/s".to_string(),
                count: Count::Flops,
                per_second: 1e12,
                ceiling: None,
            }],
            amendments: Vec::new(),
            kind: Default::default(),
            protocol: None,
            dispatch: vec![DispatchRule {
                entry_point: "attention::forward".to_string(),
                device: "cuda sm_80+".to_string(),
                dtype: "bf16, f16".to_string(),
                rule: "head_dim in {64, 128}".to_string(),
                implementation: "flash".to_string(),
            }],
        },
        rows,
    }
}

fn rendered() -> String {
    let mut s = serde_json::to_string_pretty(&synthetic_document()).unwrap();
    s.push('\n');
    s
}

#[test]
#[ignore = "writes the fixture; run explicitly to regenerate it"]
fn regenerate_fixture() {
    // Written beside it, then renamed over it: the tests of this binary that read the fixture
    // (with `--include-ignored`) see the old file or the new one, never half of one.
    let path = fixture_path();
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, rendered()).unwrap();
    std::fs::rename(&tmp, &path).unwrap();
}

#[test]
fn fixture_matches_generator() {
    let on_disk = std::fs::read_to_string(fixture_path()).unwrap();
    assert_eq!(
        on_disk,
        rendered(),
        "run `cargo test --test docgen fixtures:: -- --ignored` to regenerate"
    );
}
