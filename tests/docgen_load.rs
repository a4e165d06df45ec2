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
