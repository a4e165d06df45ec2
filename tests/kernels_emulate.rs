//! The flash kernels' control flow (tile loops, limits, masks, warp skips, partial-tile
//! guards, GQA walk, key lengths, bottom-right causal), emulated element by element in
//! `kernels/emulate_flash.py` against a float64 reference: index logic checked on any machine
//! with `python3`, no GPU (the GPU tests check the matrix fragments and rounding).

use std::process::Command;

/// Runs the emulation `script` with python3 and asserts it exits 0 with "ALL OK" last.
fn runs_clean(script: &str) {
    let out = Command::new("python3")
        .arg(script)
        .output()
        .expect("python3 runs");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.trim_end().ends_with("ALL OK"),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
#[cfg_attr(not(kp_python), ignore = "needs python3")]
fn kernel_control_flow_matches_the_reference() {
    runs_clean(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/kernels/emulate_flash.py"
    ));
}

/// The kernel-sum kernels' control flow (grid and rows per thread as the host plans them, Y
/// tiles staged between barriers, the prefetched next tile, kernel_lse's online-max chunks and
/// −∞ guard, the generic kernels' feature chunks, padding of partial tiles, store guards),
/// emulated element by element in float64 in `kernels/kernel_sums/emulate_kernel_sums.py`,
/// with bounds-checked global arrays and NaN-initialised shared buffers and outputs.
#[test]
#[cfg_attr(not(kp_python), ignore = "needs python3")]
fn kernel_sums_control_flow_matches_the_reference() {
    runs_clean(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/kernels/kernel_sums/emulate_kernel_sums.py"
    ));
}

/// The split-KV decoding kernels' control flow (the host's split plan, paged addresses through
/// the block table and the layout's strides, the ring of tile stages and its zero fill, the
/// ldmatrix addresses and mma fragments, each warp's keys, masks and online softmax over the
/// quad, the warps' merge, the partials and their combine, bottom-right causal, empty sequences
/// and rows, row blocks), emulated in float64 in `kernels/emulate_decode.py` with
/// bounds-checked global arrays and NaN-initialised shared buffers and outputs.
#[test]
#[cfg_attr(not(kp_python), ignore = "needs python3")]
fn decode_control_flow_matches_the_reference() {
    runs_clean(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/kernels/emulate_decode.py"
    ));
}
