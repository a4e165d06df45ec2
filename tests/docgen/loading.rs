//! Loader robustness: whatever the bytes, `parse_document` returns a value or an error and
//! never panics; and every invalid fixture is refused with its file named.

use std::path::{Path, PathBuf};

use kernelpages::load;
use proptest::prelude::*;

fn arb_json() -> impl Strategy<Value = serde_json::Value> {
    let leaf = prop_oneof![
        Just(serde_json::Value::Null),
        any::<bool>().prop_map(serde_json::Value::from),
        any::<i64>().prop_map(serde_json::Value::from),
        any::<f64>().prop_map(serde_json::Value::from),
        "[a-z_]{0,12}".prop_map(serde_json::Value::from),
    ];
    leaf.prop_recursive(4, 64, 8, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..8).prop_map(serde_json::Value::from),
            prop::collection::btree_map(
                prop_oneof![
                    Just("schema_version".to_string()),
                    Just("suite".to_string()),
                    Just("rows".to_string()),
                    Just("median_ms".to_string()),
                    Just("status".to_string()),
                    "[a-z_]{1,10}"
                ],
                inner,
                0..8
            )
            .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
        ]
    })
}

fn valid_fixture() -> Vec<u8> {
    std::fs::read(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/valid/gpu_attention.json"),
    )
    .unwrap()
}

proptest! {
    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = load::parse_document(Path::new("x.json"), &bytes);
    }

    #[test]
    fn arbitrary_json_never_panics(v in arb_json()) {
        let bytes = serde_json::to_vec(&v).unwrap();
        let _ = load::parse_document(Path::new("x.json"), &bytes);
    }

    #[test]
    fn corrupted_valid_document_never_panics(cut in 0usize..100_000, byte in any::<u8>()) {
        let mut bytes = valid_fixture();
        let i = cut % bytes.len();
        bytes[i] = byte;
        let _ = load::parse_document(Path::new("x.json"), &bytes);
        bytes.truncate(i);
        prop_assert!(load::parse_document(Path::new("x.json"), &bytes).is_err());
    }
}

#[test]
fn valid_fixture_loads() {
    let docs =
        load::load_dir(&PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/valid"))
            .unwrap();
    assert_eq!(docs.len(), 1);
    assert!(docs[0].doc.rows.len() > 90);
}

#[test]
fn every_invalid_fixture_is_refused_naming_its_file() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/invalid");
    let mut n = 0;
    for case in std::fs::read_dir(dir).unwrap() {
        let case = case.unwrap().path();
        let err = load::load_dir(&case).expect_err(&case.display().to_string());
        let s = format!("{err:#}");
        assert!(s.contains("gpu_attention"), "{}: {s}", case.display());
        n += 1;
    }
    assert!(n >= 6);
}

#[test]
fn oversized_file_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("big.json");
    let f = std::fs::File::create(&path).unwrap();
    f.set_len(load::MAX_DOCUMENT_BYTES + 1).unwrap();
    let err = load::load_file(&path).unwrap_err();
    assert!(
        matches!(err.0.as_slice(), [load::LoadError::TooLarge { .. }]),
        "{err}"
    );
    assert!(err.to_string().contains("big.json"));
}

/// The JSON Schema (`data/schema.json`) and the loader state the same ranges: for every
/// numeric field, a value is accepted by one exactly when it is accepted by the other.
#[test]
fn the_schema_and_the_loader_agree_on_every_range() {
    let schema: serde_json::Value =
        serde_json::from_str(&kernelpages::schema::document_schema_json()).unwrap();
    let validator = jsonschema::validator_for(&schema).unwrap();
    let base: serde_json::Value = serde_json::from_slice(&valid_fixture()).unwrap();
    // (pointers set together, values): times are set together so their order always holds.
    let fields: &[&[&str]] = &[
        &["/rows/0/median_ms", "/rows/0/q1_ms", "/rows/0/q3_ms"],
        &["/rows/0/flops"],
        &["/rows/0/bytes"],
        &["/rows/0/items"],
        &["/rows/0/compile_s"],
        &["/rows/0/inner_calls"],
        &["/rows/0/samples"],
        &["/rows/0/input_sets"],
        &["/rows/0/accuracy/rel_err"],
        &["/rows/0/accuracy/tolerance"],
        &["/rows/0/memory/arguments_mb"],
        &["/rows/0/memory/outputs_mb"],
        &["/rows/0/memory/temporaries_mb"],
        &["/rows/0/memory/residuals_mb"],
        &["/rows/0/memory/peak_mb"],
        &["/device/memory_mb"],
        &["/device/l2_mb"],
        &["/config/throughput/0/per_second"],
    ];
    let values: [f64; 8] = [-1.0, -1e-300, 0.0, 1e-300, 0.5, 1.0, 3.0, 1e300];
    let mut checked = 0;
    for pointers in fields {
        for v in values {
            let mut doc = base.clone();
            for p in *pointers {
                let (parent, key) = p.rsplit_once('/').unwrap();
                let obj = doc.pointer_mut(parent).unwrap().as_object_mut().unwrap();
                // Integers where the field is one, so that only the range is in question.
                let value = if ["inner_calls", "samples", "input_sets"].contains(&key) {
                    if v.fract() != 0.0 {
                        continue;
                    }
                    serde_json::json!(v as i64)
                } else {
                    serde_json::json!(v)
                };
                obj.insert(key.to_string(), value);
            }
            let by_schema = validator.is_valid(&doc);
            let bytes = serde_json::to_vec(&doc).unwrap();
            let by_loader = load::parse_document(Path::new("x.json"), &bytes);
            assert_eq!(
                by_schema,
                by_loader.is_ok(),
                "{pointers:?} = {v}: schema says {by_schema}, loader says {:?}",
                by_loader.err().map(|e| e.to_string())
            );
            checked += 1;
        }
    }
    assert!(checked > 100, "{checked}");
}

/// Numbers that cannot be true are refused, each naming the file, line and JSON path.
#[test]
fn impossible_numbers_are_refused() {
    let base: serde_json::Value = serde_json::from_slice(&valid_fixture()).unwrap();
    let cases: &[(&str, serde_json::Value, &str)] = &[
        (
            "/rows/0/median_ms",
            serde_json::json!(0.0),
            "rows[0].median_ms",
        ),
        ("/rows/0/q1_ms", serde_json::json!(0.0), "rows[0].q1_ms"),
        ("/rows/0/q3_ms", serde_json::json!(0.0), "rows[0].q3_ms"),
        (
            "/rows/0/accuracy/rel_err",
            serde_json::json!(-0.5),
            "rows[0].accuracy.rel_err",
        ),
        (
            "/rows/0/memory/peak_mb",
            serde_json::json!(-3.0),
            "rows[0].memory.peak_mb",
        ),
        // A stored throughput: docgen derives it, so a document cannot claim one.
        ("/rows/0/tflops", serde_json::json!(99999.0), "tflops"),
    ];
    for (pointer, value, needle) in cases {
        let mut doc = base.clone();
        let (parent, key) = pointer.rsplit_once('/').unwrap();
        doc.pointer_mut(parent)
            .unwrap()
            .as_object_mut()
            .unwrap()
            .insert(key.to_string(), value.clone());
        let bytes = serde_json::to_vec_pretty(&doc).unwrap();
        let err = load::parse_document(Path::new("x.json"), &bytes)
            .expect_err(pointer)
            .to_string();
        // The problem about this field, among any others it causes (quartile order).
        let problem = err
            .lines()
            .find(|l| l.contains(needle))
            .unwrap_or_else(|| panic!("{pointer}: {err}"))
            .trim_start_matches("  - ");
        assert!(problem.starts_with("x.json:"), "{problem}");
        let line: usize = problem
            .trim_start_matches("x.json:")
            .split(':')
            .next()
            .unwrap()
            .parse()
            .unwrap_or_else(|_| panic!("no line: {err}"));
        assert!(line > 1, "{err}");
    }
    // A median of 0 would have published "inf×": the loader says why instead.
    let mut doc = base.clone();
    doc["rows"][0]["median_ms"] = serde_json::json!(0.0);
    let err = load::parse_document(Path::new("x.json"), &serde_json::to_vec(&doc).unwrap())
        .unwrap_err()
        .to_string();
    assert!(err.contains("must be finite and > 0"), "{err}");
}
