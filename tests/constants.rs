//! The protocol's constants are written twice, in Rust (`src/harness.rs`, the schema) and in
//! the Python comparison package (`runners/compare/`): both sides must apply the same rules,
//! and the site's Methodology reads the Rust ones. This holds the two equal.

use std::path::PathBuf;

use kernelpages::harness;

/// The value of `NAME = value` at the start of a line of `file` (under `runners/compare/`).
fn python_constant(file: &str, name: &str) -> f64 {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("runners/compare")
        .join(file);
    let text = std::fs::read_to_string(&path).unwrap();
    let prefix = format!("{name} = ");
    let line = text
        .lines()
        .find(|l| l.starts_with(&prefix))
        .unwrap_or_else(|| panic!("{}: no {name}", path.display()));
    line[prefix.len()..]
        .split('#')
        .next()
        .unwrap()
        .trim()
        .parse()
        .unwrap_or_else(|e| panic!("{}: {line}: {e}", path.display()))
}

#[test]
fn python_and_rust_apply_the_same_constants() {
    let pairs = [
        ("timing.py", "MIN_SAMPLES", harness::MIN_SAMPLES as f64),
        (
            "timing.py",
            "MAX_INPUT_SETS",
            f64::from(harness::MAX_INPUT_SETS),
        ),
        (
            "timing.py",
            "ROTATION_MEMORY_FRACTION",
            harness::ROTATION_MEMORY_FRACTION,
        ),
        (
            "protocol.py",
            "PROCESS_LIMIT_FACTOR",
            harness::PROCESS_LIMIT_FACTOR,
        ),
        (
            "protocol.py",
            "PROCESS_LIMIT_MARGIN_S",
            harness::PROCESS_LIMIT_MARGIN_S,
        ),
    ];
    for (file, name, rust) in pairs {
        assert_eq!(python_constant(file, name), rust, "{file} {name}");
    }
}
