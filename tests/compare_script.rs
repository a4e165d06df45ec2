//! Checks `runners/compare_attention.py`, the PyTorch comparison script the `attention` runner
//! starts with `--compare torch`: its rows must deserialise as [`kernelpages::schema::Row`], one
//! per (case, implementation) in request order, each with the case copied exactly.
//!
//! Without torch (the CI machine) every row is `unsupported` and names torch. With torch and a
//! GPU the same test measures tiny cases for real. Without `python3` the tests print a skip line.
//!
//! `COMPARE_ROWS_JSON=/path/rows.json cargo test --test compare_script` also validates a rows
//! file brought back from a GPU run.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use kernelpages::schema::{Param, Row, Status};
use serde_json::{json, Value};

const IMPLEMENTATIONS: [&str; 4] = [
    "torch_flash",
    "torch_cudnn",
    "torch_efficient",
    "torch_math",
];

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("runners/compare_attention.py")
}

/// True when `python3` runs; otherwise prints why the test is skipped.
fn have_python(test: &str) -> bool {
    match Command::new("python3").arg("--version").output() {
        Ok(o) if o.status.success() => true,
        _ => {
            eprintln!("skipping {test}: python3 is not available");
            false
        }
    }
}

fn torch_importable() -> bool {
    Command::new("python3")
        .args(["-c", "import torch"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

fn run_script(args: &[&str]) -> Output {
    Command::new("python3")
        .arg(script())
        .args(args)
        .output()
        .expect("python3 starts")
}

fn describe(o: &Output) -> String {
    format!(
        "exit {:?}\n--- stdout\n{}\n--- stderr\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn request(cases: &[Value]) -> Value {
    json!({
        "timing": {"warmup_calls": 1, "repeats": 3, "min_sample_ms": 0.5, "max_inner": 10,
                   "l2_rotation_factor": 3.0, "case_timeout_s": 60.0},
        "l2_bytes": 62914560u64,
        "seed": 1234,
        "implementations": IMPLEMENTATIONS,
        "memory_subprocess": true,
        "check_rows": 16,
        "check_slices": 2,
        "cases": cases,
    })
}

fn cases() -> Vec<Value> {
    vec![
        json!({"batch": 1, "heads": 2, "kv_heads": 2, "seq_len": 128, "head_dim": 64,
               "causal": true, "dtype": "bf16", "pass": "fwd"}),
        json!({"batch": 2, "heads": 4, "kv_heads": 2, "seq_len": 256, "head_dim": 128,
               "causal": false, "dtype": "fp16", "pass": "fwd"}),
    ]
}

/// Checks a rows document and returns its rows.
fn check_document(doc: &Value) -> Vec<Row> {
    let obj = doc.as_object().expect("rows document is an object");
    let keys: Vec<&str> = obj.keys().map(String::as_str).collect();
    assert_eq!(keys.len(), 3, "unexpected top-level keys {keys:?}");
    let libraries = obj["libraries"]
        .as_object()
        .expect("libraries is an object");
    assert!(libraries.contains_key("python"), "{libraries:?}");
    for (name, version) in libraries {
        assert!(
            version.is_string(),
            "library {name} version is not a string: {version}"
        );
    }
    assert!(obj["finished"].is_boolean(), "finished must be a boolean");
    let rows: Vec<Row> =
        serde_json::from_value(obj["rows"].clone()).expect("rows deserialise as schema::Row");
    for row in &rows {
        assert_eq!(row.library, "PyTorch");
        assert!(!row.default);
        assert!(
            IMPLEMENTATIONS.contains(&row.implementation.as_str()),
            "{}",
            row.implementation
        );
        if row.status == Status::Ok {
            for field in [
                row.median_ms,
                row.q1_ms,
                row.q3_ms,
                row.compile_s,
                row.flops,
            ] {
                assert!(
                    field.is_some_and(f64::is_finite),
                    "ok row lacks a figure: {row:?}"
                );
            }
            let (q1, med, q3) = (
                row.q1_ms.unwrap(),
                row.median_ms.unwrap(),
                row.q3_ms.unwrap(),
            );
            assert!(q1 <= med && med <= q3 && q1 > 0.0, "{row:?}");
            assert!(row.inner_calls.unwrap() >= 1 && row.samples.unwrap() >= 1);
            assert!(row.input_sets.unwrap() >= 1);
            let acc = row.accuracy.as_ref().expect("ok row has accuracy");
            assert_eq!(acc.metric, "rel_l2");
            assert!(acc.rel_err.is_finite() && acc.rel_err >= 0.0);
            let mem = row.memory.as_ref().expect("ok row has memory");
            assert!(mem.arguments_mb.is_some() && mem.outputs_mb.is_some());
            if let Some(t) = mem.temporaries_mb {
                assert!(t >= 0.0);
            }
        } else {
            let msg = row.message.as_deref().unwrap_or("");
            assert!(!msg.is_empty(), "a {:?} row needs a message", row.status);
            assert!(row.median_ms.is_none() && row.accuracy.is_none(), "{row:?}");
        }
    }
    rows
}

#[test]
fn rows_follow_the_request_and_the_schema() {
    if !have_python("rows_follow_the_request_and_the_schema") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let req_path = dir.path().join("request.json");
    let out_path = dir.path().join("rows.json");
    let cases = cases();
    std::fs::write(
        &req_path,
        serde_json::to_string_pretty(&request(&cases)).unwrap(),
    )
    .unwrap();

    let o = run_script(&[
        "--request",
        req_path.to_str().unwrap(),
        "--output",
        out_path.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", describe(&o));
    assert!(
        !dir.path().join("rows.json.tmp").exists(),
        "the .tmp file was left behind"
    );

    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&out_path).unwrap()).unwrap();
    assert_eq!(doc["finished"], Value::Bool(true));
    let rows = check_document(&doc);
    assert_eq!(
        rows.len(),
        cases.len() * IMPLEMENTATIONS.len(),
        "{}",
        describe(&o)
    );

    let torch = torch_importable();
    let mut i = 0;
    for case in &cases {
        let expected: BTreeMap<String, Param> = serde_json::from_value(case.clone()).unwrap();
        for implementation in IMPLEMENTATIONS {
            let row = &rows[i];
            i += 1;
            assert_eq!(row.case, expected, "row {i}: case not copied exactly");
            assert_eq!(row.implementation, implementation, "row {i}: order");
            if !torch {
                assert_eq!(row.status, Status::Unsupported, "{row:?}");
                let msg = row.message.as_deref().unwrap_or("");
                assert!(msg.contains("torch"), "message must name torch: {msg}");
            }
        }
    }
    // One progress line per row on stderr.
    let stderr = String::from_utf8_lossy(&o.stderr);
    let progress = stderr
        .lines()
        .filter(|l| l.starts_with("[compare_attention] case "))
        .count();
    assert_eq!(progress, rows.len(), "{stderr}");
}

#[test]
fn backward_and_unknown_dtype_rows_are_unsupported() {
    if !have_python("backward_and_unknown_dtype_rows_are_unsupported") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let req_path = dir.path().join("request.json");
    let out_path = dir.path().join("rows.json");
    let cases = vec![
        json!({"batch": 1, "heads": 2, "kv_heads": 2, "seq_len": 128, "head_dim": 64,
               "causal": true, "dtype": "bf16", "pass": "fwd+bwd"}),
        json!({"batch": 1, "heads": 2, "kv_heads": 2, "seq_len": 128, "head_dim": 64,
               "causal": true, "dtype": "fp8", "pass": "fwd"}),
    ];
    std::fs::write(&req_path, request(&cases).to_string()).unwrap();
    let o = run_script(&[
        "--request",
        req_path.to_str().unwrap(),
        "--output",
        out_path.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", describe(&o));
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&out_path).unwrap()).unwrap();
    let rows = check_document(&doc);
    assert_eq!(rows.len(), 8);
    let torch = torch_importable();
    for (i, row) in rows.iter().enumerate() {
        assert_eq!(row.status, Status::Unsupported, "{row:?}");
        let msg = row.message.as_deref().unwrap();
        if torch {
            let want = if i < 4 {
                "backward not implemented"
            } else {
                "dtype"
            };
            assert!(msg.contains(want), "{msg}");
        } else {
            assert!(msg.contains("torch"), "{msg}");
        }
    }
}

#[test]
fn malformed_request_fails_naming_the_file() {
    if !have_python("malformed_request_fails_naming_the_file") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let out_path = dir.path().join("rows.json");
    let mut no_cases = request(&cases());
    no_cases.as_object_mut().unwrap().remove("cases");
    let mut bad_impl = request(&cases());
    bad_impl["implementations"] = json!(["torch_flash", "torch_nope"]);
    let mut bad_case = request(&cases());
    bad_case["cases"][1]["seq_len"] = json!("long");
    let bodies = [
        ("not_json.json", "{\"timing\": ".to_string()),
        ("no_cases.json", no_cases.to_string()),
        ("bad_impl.json", bad_impl.to_string()),
        ("bad_case.json", bad_case.to_string()),
    ];
    for (name, body) in bodies {
        let req_path = dir.path().join(name);
        std::fs::write(&req_path, body).unwrap();
        let o = run_script(&[
            "--request",
            req_path.to_str().unwrap(),
            "--output",
            out_path.to_str().unwrap(),
        ]);
        assert!(!o.status.success(), "{name} was accepted: {}", describe(&o));
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert!(
            stderr.contains(req_path.to_str().unwrap()),
            "{name}: {stderr}"
        );
        assert!(
            !out_path.exists(),
            "{name}: rows written for a malformed request"
        );
    }
    // A request file that does not exist.
    let missing = dir.path().join("missing.json");
    let o = run_script(&[
        "--request",
        missing.to_str().unwrap(),
        "--output",
        out_path.to_str().unwrap(),
    ]);
    assert!(!o.status.success(), "{}", describe(&o));
    assert!(String::from_utf8_lossy(&o.stderr).contains(missing.to_str().unwrap()));
}

#[test]
fn self_test_passes() {
    if !have_python("self_test_passes") {
        return;
    }
    let o = run_script(&["--self-test"]);
    assert!(o.status.success(), "{}", describe(&o));
}

/// Validates a rows file from a GPU run when `COMPARE_ROWS_JSON` names one.
#[test]
fn rows_file_from_a_gpu_run() {
    let Ok(path) = std::env::var("COMPARE_ROWS_JSON") else {
        eprintln!("skipping rows_file_from_a_gpu_run: COMPARE_ROWS_JSON is not set");
        return;
    };
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let rows = check_document(&doc);
    eprintln!("{path}: {} rows deserialise as schema::Row", rows.len());
}
