//! The flash kernels' control flow (tile loops, limits, masks, warp skips, partial-tile
//! guards, GQA walk, key lengths, bottom-right causal), emulated element by element in
//! `kernels/emulate_flash.py` against a float64 reference: index logic checked on any machine
//! with `python3`, no GPU (the GPU tests check the matrix fragments and rounding).

use std::process::Command;

/// Runs the emulation `script` with python3 and asserts it exits 0 with "ALL OK" last.
fn runs_clean(script: &str) {
    runs_clean_with(script, &[]);
}

/// [`runs_clean`] with arguments after the script.
fn runs_clean_with(script: &str, args: &[&std::path::Path]) {
    assert_all_ok(Command::new("python3").arg(script).args(args), script);
}

/// Runs `cmd` and asserts it exits 0 with "ALL OK" last on its standard output; the failure
/// message names the run (`what`) and shows both outputs.
fn assert_all_ok(cmd: &mut Command, what: &str) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.trim_end().ends_with("ALL OK"),
        "{what}: {text}\n{}",
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

/// The flex kernels' control flow (the block-mask kernel's per-thread element loop, any/all
/// reductions and whole-tile test; the forward's walk over the tile lists, masking of partial
/// tiles only, the score modification on in-bounds pairs), emulated in float64 in
/// `kernels/emulate_flex.py` with the CUDA C expressions the host generates for every named
/// modification (translated to Python), against a dense reference; the same run checks those
/// expressions against the Rust reference (`FlexMod::visible`, `FlexMod::modify`) on every pair,
/// and the emulated block mask against `block_mask_host`.
#[test]
#[cfg_attr(not(kp_python), ignore = "needs python3")]
fn flex_control_flow_matches_the_reference() {
    use kernelpages::attention::flex::{block_mask_host, FlexMod, FlexShape};
    use kernelpages::attention::Dtype;
    let mods = [
        FlexMod::Causal,
        FlexMod::SlidingWindow(40),
        FlexMod::Document,
        FlexMod::PrefixLm(30),
        FlexMod::Alibi,
        FlexMod::SoftCap(2.0),
    ];
    // (seq_len_q, seq_len_kv, key lengths): a tile and a half with a shorter second entry,
    // fewer queries than keys, more queries than keys (rows with no key).
    let shapes = [
        (130, 130, vec![130, 70]),
        (20, 150, vec![150, 150]),
        (150, 70, vec![70, 70]),
    ];
    let mut out = Vec::new();
    for m in mods {
        let spec = m.spec();
        let mut per_shape = Vec::new();
        for (tq, tkv, lens) in &shapes {
            let shape = FlexShape {
                batch: 2,
                heads: 2,
                kv_heads: 1,
                seq_len_q: *tq,
                seq_len_kv: *tkv,
                head_dim: 16,
                dtype: Dtype::Bf16,
                scale: 0.25,
            };
            // Documents of 30 positions in entry 0 and 100 in entry 1 (whole tiles).
            let aux: Vec<i32> = (0..2 * tkv)
                .map(|i| ((i % tkv) / if i < *tkv { 30 } else { 100 }) as i32)
                .collect();
            let visible: Vec<Vec<Vec<bool>>> = (0..2)
                .map(|b| {
                    (0..*tq)
                        .map(|q| {
                            (0..*tkv)
                                .map(|kv| m.visible(b, q, kv, *tq, *tkv, &aux))
                                .collect()
                        })
                        .collect()
                })
                .collect();
            let mut modified = Vec::new();
            for s in [-3.1, 0.7, 25.0] {
                for h in 0..2 {
                    for (q, kv) in [(0, 0), (5, 3), (*tq - 1, *tkv - 1), (*tq / 2, 1)] {
                        modified.push(serde_json::json!([
                            s,
                            h,
                            q,
                            kv,
                            m.modify(s, h, q, kv, 2, *tq, *tkv)
                        ]));
                    }
                }
            }
            let bm = block_mask_host(&shape, &m, lens, &aux);
            per_shape.push(serde_json::json!({
                "batch": 2, "heads": 2, "kv_heads": 1, "seq_len_q": tq, "seq_len_kv": tkv,
                "head_dim": 16, "scale": 0.25, "kv_lens": lens, "aux": aux,
                "visible": visible, "modified": modified,
                "block_mask": {"count": bm.count, "index": bm.index, "full": bm.full},
            }));
        }
        out.push(serde_json::json!({
            "name": m.name(), "mask": spec.mask, "score": spec.score, "shapes": per_shape,
        }));
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("flex_specs.json");
    std::fs::write(
        &path,
        serde_json::json!({
            "mods": out,
            "rows": kernelpages::attention::flex::FLEX_ROWS,
            "keys": kernelpages::attention::flex::FLEX_KEYS,
            "threads": 32 * kernelpages::attention::flex::FLEX_WARPS,
        })
        .to_string(),
    )
    .unwrap();
    runs_clean_with(
        concat!(env!("CARGO_MANIFEST_DIR"), "/kernels/emulate_flex.py"),
        &[&path],
    );
}

/// Compiles `kernels/sequence_mixers/emulate/<name>.cpp` (the kernel source with the CPU shim
/// `cuda_shim.h`) with g++, runs it on `cases` (one argument each) and asserts that it prints
/// "ALL OK" last.
fn emulated_kernel_runs_clean(name: &str, cases: &[String]) {
    emulated_suite_kernel_runs_clean("sequence_mixers", name, cases);
}

/// [`emulated_kernel_runs_clean`] for `kernels/<suite>/emulate/<name>.cpp`, which finds the
/// shim and the sequence-mixer prelude (`-I kernels/sequence_mixers/emulate`,
/// `-I kernels/sequence_mixers`) beside its suite's kernels (`-I kernels/<suite>`).
fn emulated_suite_kernel_runs_clean(suite: &str, name: &str, cases: &[String]) {
    emulated_suite_kernel_runs_clean_with(suite, name, &[], cases);
}

/// As [`emulated_suite_kernel_runs_clean`], compiled with the preprocessor definitions
/// `defines` (`-D` arguments such as `GG_BF16=0`).
fn emulated_suite_kernel_runs_clean_with(
    suite: &str,
    name: &str,
    defines: &[&str],
    cases: &[String],
) {
    let (_tmp, exe) = build_emulation_with(suite, name, defines);
    assert_all_ok(Command::new(&exe).args(cases), name);
}

/// Compiles `kernels/<suite>/emulate/<name>.cpp` with g++ into a temporary folder (returned
/// with the executable's path, so that it lives as long as the caller needs it).
fn build_emulation(suite: &str, name: &str) -> (tempfile::TempDir, std::path::PathBuf) {
    build_emulation_with(suite, name, &[])
}

/// [`build_emulation`] with the preprocessor definitions `defines` (each passed as `-D`).
fn build_emulation_with(
    suite: &str,
    name: &str,
    defines: &[&str],
) -> (tempfile::TempDir, std::path::PathBuf) {
    let kernels = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
    let dir = kernels.join(suite);
    let shared = kernels.join("sequence_mixers");
    let tmp = tempfile::tempdir().unwrap();
    let exe = tmp.path().join(name);
    let built = Command::new("g++")
        .args(["-std=c++20", "-O1", "-w"])
        .args(defines.iter().map(|d| format!("-D{d}")))
        .arg("-I")
        .arg(&dir)
        .arg("-I")
        .arg(&shared)
        .arg("-I")
        .arg(shared.join("emulate"))
        .arg(dir.join("emulate").join(format!("{name}.cpp")))
        .arg("-o")
        .arg(&exe)
        .output()
        .expect("g++ runs");
    assert!(
        built.status.success(),
        "{}",
        String::from_utf8_lossy(&built.stderr)
    );
    (tmp, exe)
}

/// The shim the emulations run on (`cuda_shim.h`: CUDA threads as fibers, barriers as yields,
/// a random order per pass): a block sum through shuffles and `__syncthreads` is exact; a
/// read of a higher and of a lower thread's slot with no barrier after its write reads the
/// poison; a barrier one thread skips stops the program, naming the block, instead of hanging.
#[test]
#[cfg_attr(not(kp_cxx), ignore = "needs g++ with C++20 and <ucontext.h>")]
fn the_shim_runs_blocks_catches_races_and_stops_at_skipped_barriers() {
    let (_tmp, exe) = build_emulation("sequence_mixers", "shim_check");
    for mode in ["sum", "race_up", "race_down"] {
        assert_all_ok(Command::new(&exe).arg(mode), mode);
    }
    let out = Command::new(&exe)
        .arg("deadlock")
        .output()
        .expect("shim_check runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a skipped barrier went unnoticed");
    assert!(
        err.contains("block (0, 0, 0): 127 of 128 threads wait at a barrier"),
        "{err}"
    );
}

/// SSD's kernels (`ssd.cu`: chunk states, state passing, chunk outputs) on the CPU against the
/// float64 recurrence, with the host's shared-memory sizes
/// (`sequence_mixers::cuda::shared_bytes`, `tensor_core_shared_bytes`), shared memory poisoned
/// and guarded past them: the float32 kernels on every shape (partial chunks, groups, one
/// step, head_dim = state 128, odd sizes), and the bf16 tensor-core kernels (version 5, walks of 1, 3 and 8 chunks, their
/// `mma.sync` fragments emulated lane by lane in `cuda_shim.h`) on the shapes the host gives
/// them.
#[test]
#[cfg_attr(not(kp_cxx), ignore = "needs g++ with C++20 and <ucontext.h>")]
fn ssd_kernels_emulated_match_the_recurrence() {
    use kernelpages::sequence_mixers::cuda::{shared_bytes, tensor_core_shared_bytes};
    use kernelpages::sequence_mixers::reference::SsdShape;
    let cases: Vec<String> = [
        (1, 150, 2, 1, 16, 8),
        (2, 64, 4, 2, 32, 40),
        (1, 1, 2, 2, 8, 8),
        (1, 129, 2, 1, 64, 64),
        (1, 70, 1, 1, 128, 128),
        // Odd sizes: the padded rows' stride is N | 1.
        (1, 100, 2, 1, 33, 31),
        // The tensor-core kernels' smallest tiles, groups, one step, P not a power of two.
        (1, 150, 2, 1, 16, 32),
        (2, 64, 4, 2, 32, 32),
        (1, 1, 2, 2, 16, 32),
        (1, 200, 2, 2, 48, 96),
        // The chunk states' warps: two per 16-row tile of P (P = 64), one with all 16 column
        // tiles (P = 128), one with 4 (N = 32), and at P = 16 six warps of two tiles and two
        // idle (N = 96).
        (1, 300, 2, 1, 64, 64),
        (1, 90, 1, 1, 128, 32),
        (1, 40, 2, 1, 16, 96),
        // Ten chunks, two batch entries.
        (2, 600, 2, 1, 64, 64),
    ]
    .iter()
    .map(|&(batch, seq_len, heads, groups, head_dim, state)| {
        let shape = SsdShape {
            batch,
            seq_len,
            heads,
            head_dim,
            state,
            groups,
        };
        let (state_bytes, scan_bytes) = shared_bytes(shape);
        let (tc_state, tc_scan) = tensor_core_shared_bytes(shape).unwrap_or((0, 0));
        format!(
            "{batch},{seq_len},{heads},{groups},{head_dim},{state},{state_bytes},{scan_bytes},\
             {tc_state},{tc_scan}"
        )
    })
    .collect();
    // Both paths ran where they should: 4 shapes without tensor-core sizes, 10 with.
    let with_tc = cases.iter().filter(|c| !c.ends_with(",0,0")).count();
    assert_eq!(with_tc, 10, "{cases:?}");
    emulated_kernel_runs_clean("ssd_check", &cases);
}

/// Based's four kernels (the linear branch as `ssd.cu`'s chunked kernels without decay, then
/// `based.cu`'s window branch) on the CPU
/// against the float64 recurrence, with the host's shared-memory sizes
/// (`sequence_mixers::based_cuda::{shared_bytes, window_shared_bytes}`), shared memory
/// poisoned and guarded past them: partial chunks and tiles, one step, K ≠ V, windows of 1 to
/// 200 steps; and the tensor-core window kernel (bf16) where the host would take it.
#[test]
#[cfg_attr(not(kp_cxx), ignore = "needs g++ with C++20 and <ucontext.h>")]
fn based_kernels_emulated_match_the_recurrence() {
    use kernelpages::sequence_mixers::based_cuda::{
        shared_bytes, window_shared_bytes, window_tc_shared_bytes,
    };
    use kernelpages::sequence_mixers::cuda::Dtype;
    use kernelpages::sequence_mixers::reference::BasedShape;
    let cases: Vec<String> = [
        (1, 150, 2, 16, 8, 5),
        (2, 64, 2, 64, 32, 64),
        (1, 1, 1, 8, 8, 1),
        (1, 130, 1, 64, 64, 65),
        (1, 70, 1, 40, 72, 1),
        (1, 300, 1, 32, 128, 200),
        (1, 129, 2, 128, 128, 64),
        // Odd key and value widths (rows of K | 1 floats), W past a tile.
        (1, 130, 1, 31, 63, 65),
        (2, 65, 1, 33, 97, 129),
    ]
    .iter()
    .map(|&(batch, seq_len, heads, key_dim, value_dim, window)| {
        let shape = BasedShape {
            batch,
            seq_len,
            heads,
            key_dim,
            value_dim,
            window,
        };
        let (state_bytes, scan_bytes) = shared_bytes(shape);
        format!(
            "{batch},{seq_len},{heads},{key_dim},{value_dim},{window},{state_bytes},{scan_bytes},{},{}",
            window_shared_bytes(shape),
            window_tc_shared_bytes(shape, Dtype::Bf16).unwrap_or(0)
        )
    })
    .collect();
    // The tensor-core window ran on the shapes with K and V multiples of 16.
    assert_eq!(
        cases.iter().filter(|c| !c.ends_with(",0")).count(),
        4,
        "{cases:?}"
    );
    emulated_kernel_runs_clean("based_check", &cases);
}

/// The gated delta rule's three kernels (`delta.cu`: every chunk's triangular solve, the state
/// pass over the chunks by blocks of state rows, every chunk's output) on the CPU against the
/// float64 recurrence, with the host's shared-memory sizes
/// (`sequence_mixers::delta_cuda::shared_bytes` and `tc_shared_bytes`), shared memory
/// poisoned and guarded past them: partial chunks, one step, K ≠ V both ways, V not a multiple of the state pass's rows per
/// block, odd K, K = V = 128, and on tensor cores (bf16) every walk the host takes (version
/// 10's on wgmma, which the shim emulates, as on a compute capability 9.0 device).
#[test]
#[cfg_attr(not(kp_cxx), ignore = "needs g++ with C++20 and <ucontext.h>")]
fn gated_delta_kernels_emulated_match_the_recurrence() {
    use kernelpages::sequence_mixers::cuda::Dtype;
    use kernelpages::sequence_mixers::delta_cuda::{shared_bytes, tc_shared_bytes, StateWalk};
    use kernelpages::sequence_mixers::reference::DeltaShape;
    let cases: Vec<String> = [
        (1, 150, 2, 16, 8),
        (2, 64, 2, 32, 40),
        (1, 1, 1, 8, 8),
        (1, 129, 1, 64, 64),
        (1, 70, 1, 128, 128),
        (1, 100, 1, 33, 50),
        (1, 65, 1, 72, 24),
        // The tensor-core path: K = 32 (one column tile per warp), V ≠ K, a state row block
        // per 16 values; a walk of 32 rows a block (V = 96: three blocks) over more chunks
        // than its ring has stages.
        (1, 200, 2, 32, 48),
        (2, 100, 1, 64, 32),
        (1, 300, 2, 32, 96),
        // The whole-row walks over more chunks than their ring has stages, with a short last
        // chunk: one warp a block at K = V = 64 (version 9: U and the entering states written
        // for the output kernel), two at 128 (version 8: the output in the walk; one barrier a
        // chunk between them).
        (1, 300, 2, 64, 64),
        (1, 300, 1, 128, 128),
    ]
    .iter()
    .map(|&(b, t, h, k, v)| (b, t, h, k, v, false))
    // Version 10's walks on wgmma (Hopper's; wgmma emulated by cuda_shim.h) at both sizes, over
    // more chunks than their rings have stages, with a short last chunk.
    .chain([(1, 300, 2, 64, 64, true), (1, 300, 1, 128, 128, true)])
    .map(|(batch, seq_len, heads, key_dim, value_dim, hopper)| {
        let shape = DeltaShape {
            batch,
            seq_len,
            heads,
            key_dim,
            value_dim,
        };
        let [prep, pass, out] = shared_bytes(shape);
        // The walks of any sm_80+ device, or with `hopper` those of a compute capability 9.0
        // one.
        let [tp, ts, to] = tc_shared_bytes(shape, Dtype::Bf16, hopper).unwrap_or([0; 3]);
        let walk = StateWalk::for_shape(shape, hopper);
        // The walk's kind: 0 shared rows (versions 3 and 4), 1 fused, 2 whole rows then the
        // output kernel, 3 fused on wgmma.
        let groups = walk.row_groups;
        let kind = if walk.wgmma {
            3
        } else if walk.fused {
            1
        } else {
            2 * u8::from(walk.whole_rows)
        };
        format!(
            "{batch},{seq_len},{heads},{key_dim},{value_dim},{prep},{pass},{out},{tp},{ts},{to},{groups},{kind}"
        )
    })
    .collect();
    // The tensor-core kernels ran where the host would take them: K = V = 64 and 128, three
    // times each (the first shapes; the whole-row walks: one warp without the output, two with
    // it; version 10's on wgmma), and the three shapes above (one walks 32 rows a block in two
    // groups of 4 warps).
    assert_eq!(
        cases.iter().filter(|c| !c.contains(",0,0,0,")).count(),
        9,
        "{cases:?}"
    );
    assert_eq!(cases.iter().filter(|c| c.ends_with(",3")).count(), 2);
    assert_eq!(cases.iter().filter(|c| c.ends_with(",1,2")).count(), 2);
    assert_eq!(cases.iter().filter(|c| c.ends_with(",2,1")).count(), 2);
    assert_eq!(cases.iter().filter(|c| c.ends_with(",2,0")).count(), 1);
    emulated_kernel_runs_clean("gdn_check", &cases);
}

/// The gated delta rule's backward (the forward's `gdn_prepare` and `gdn_state_pass`, then
/// `delta_bwd.cu`'s four kernels) on the CPU against a float64 adjoint checked by central
/// finite differences: dq, dk, dv, dα, dβ and the initial state's gradient, with and without
/// an initial state and a final state's cotangent, a gate of exactly 0, with the host's
/// shared-memory sizes (`delta_backward::shared_bytes`), shared memory poisoned and guarded
/// past them: one step, partial chunks, K ≠ V, value rows not a multiple of the 16-row
/// blocks, odd widths, K = V = 64 and 128. Bound 1e-4.
#[test]
#[cfg_attr(not(kp_cxx), ignore = "needs g++ with C++20 and <ucontext.h>")]
fn delta_backward_emulated_matches_the_adjoint() {
    use kernelpages::sequence_mixers::delta_backward;
    use kernelpages::sequence_mixers::delta_cuda::shared_bytes;
    use kernelpages::sequence_mixers::reference::DeltaShape;
    let cases: Vec<String> = [
        (1, 9, 1, 4, 3),
        (1, 1, 2, 8, 8),
        (2, 130, 1, 16, 24),
        (1, 200, 1, 32, 48),
        (1, 100, 1, 33, 50),
        (1, 70, 1, 64, 64),
        (1, 65, 1, 128, 128),
    ]
    .iter()
    .map(|&(batch, seq_len, heads, key_dim, value_dim)| {
        let shape = DeltaShape {
            batch,
            seq_len,
            heads,
            key_dim,
            value_dim,
        };
        let [prep, pass, _] = shared_bytes(shape);
        let [bp, bs, bv, bk] = delta_backward::shared_bytes(shape);
        format!("{batch},{seq_len},{heads},{key_dim},{value_dim},{prep},{pass},{bp},{bs},{bv},{bk}")
    })
    .collect();
    emulated_kernel_runs_clean("gdn_bwd_check", &cases);
}

/// The selective scan's forward (`scan.cu`, version 2: the chunks' end states from zero, the
/// pass between chunks, the chunks walked again for y) on the CPU against the float64
/// recurrence: 1, 2, 4, 8 and 16 threads per channel (N up to 16, 32, 64, 128, 256), one step,
/// one chunk, several with the last partial, chunks of the staged steps only, channels not a
/// multiple of a block's, idle state entries.
#[test]
#[cfg_attr(not(kp_cxx), ignore = "needs g++ with C++20 and <ucontext.h>")]
fn selective_scan_kernel_emulated_matches_the_recurrence() {
    let cases: Vec<String> = [
        (1, 1, 1, 1, 64),
        (2, 37, 13, 16, 32),
        (2, 16, 9, 33, 32),
        (1, 61, 19, 128, 16),
        (1, 100, 10, 256, 8),
        (1, 33, 8, 48, 32),
        (1, 4, 3, 16, 64),
        (1, 300, 130, 16, 64),
        (1, 65, 5, 17, 32),
        // 35 chunks: the pass's loads run 32 chunks ahead, then a partial batch.
        (1, 1100, 3, 16, 32),
    ]
    .iter()
    .map(|(b, t, d, n, l)| format!("{b},{t},{d},{n},{l}"))
    .collect();
    emulated_kernel_runs_clean("scan_check", &cases);
}

/// The selective scan's backward (`scan.cu`, version 2: the forward's chunk states and pass for
/// the checkpoints, every chunk's own adjoint, the adjoints passed back from the last chunk,
/// then every chunk recomputed into shared memory and walked backwards, dB and dC summed over
/// all channels by the chunk's block, dA and dD from per-chunk parts) on the CPU against a float64 adjoint, itself checked
/// against finite differences: every gradient, with D, an initial state and a cotangent of the
/// final state; one step, lengths shorter than, equal to and past a chunk, channels not a
/// multiple of the block's warps, one and two states per lane, with the host's chunk
/// (`scan_cuda::backward_chunk`) and a short one.
#[test]
#[cfg_attr(not(kp_cxx), ignore = "needs g++ with C++20 and <ucontext.h>")]
fn selective_scan_backward_emulated_matches_the_adjoint() {
    use kernelpages::sequence_mixers::scan_cuda::backward_chunk;
    let mut cases: Vec<String> = [
        (1, 1, 1, 1),
        (2, 37, 13, 16),
        (1, 32, 8, 16),
        (1, 70, 9, 33),
        (1, 64, 8, 64),
        (1, 5, 3, 16),
    ]
    .iter()
    .map(|&(b, t, d, n)| format!("{b},{t},{d},{n},{}", backward_chunk(n).unwrap()))
    .collect();
    cases.push("1,29,10,16,4".into());
    // An odd channel count at N <= 16: the last warp's second half has no channel.
    cases.push("1,40,17,7,32".into());
    // 35 chunks: both passes' loads run 32 chunks ahead, then a partial batch.
    cases.push("1,1100,3,16,32".into());
    emulated_kernel_runs_clean("scan_bwd_check", &cases);
}

/// SSD's backward (`ssd_bwd.cu` after `ssd.cu`: the forward's chunk states and their passing,
/// the chunks' own adjoints and their passing back, dx, dB and dC per head, the suffix sums
/// for dΔ, the sums over the group and the batch) on the CPU against a float64 adjoint, itself
/// checked against finite differences: every gradient, with and without D, an initial state
/// and a cotangent of the final state, with the host's shared-memory sizes
/// (`sequence_mixers::ssd_backward::backward_shared_bytes`), shared memory poisoned and guarded
/// past them: one step, partial chunks, groups, odd head_dim and state, one, two and four
/// columns per lane in the tiled products and more than one pass of them.
#[test]
#[cfg_attr(not(kp_cxx), ignore = "needs g++ with C++20 and <ucontext.h>")]
fn ssd_backward_emulated_matches_the_adjoint() {
    use kernelpages::sequence_mixers::reference::SsdShape;
    use kernelpages::sequence_mixers::ssd_backward::backward_shared_bytes;
    let cases: Vec<String> = [
        (1, 1, 2, 1, 8, 8),
        (1, 70, 2, 1, 16, 8),
        (2, 150, 4, 2, 8, 16),
        (1, 65, 1, 1, 33, 31),
        (1, 64, 2, 2, 32, 40),
        // Four columns per lane (head_dim 128, state 72), and two passes of them (state 160).
        (1, 70, 1, 1, 128, 72),
        (1, 40, 1, 1, 16, 160),
    ]
    .iter()
    .map(|&(batch, seq_len, heads, groups, head_dim, state)| {
        let [chunk, dx, dbc, ddt] = backward_shared_bytes(SsdShape {
            batch,
            seq_len,
            heads,
            head_dim,
            state,
            groups,
        });
        format!("{batch},{seq_len},{heads},{groups},{head_dim},{state},{chunk},{chunk},{dx},{dbc},{ddt}")
    })
    .collect();
    emulated_kernel_runs_clean("ssd_bwd_check", &cases);
}

/// Based's backward as `sequence_mixers::based_backward` launches it (SSD's backward kernels
/// for the linear branch, dt 1, A 0, dy read times the scale; then the window's dq and dk/dv
/// kernels adding their part) on the CPU against a float64 adjoint, itself checked against
/// finite differences: dq, dk, dv and the initial state's gradient, with and without an
/// initial state and a final state's cotangent, with the host's shared-memory sizes, shared
/// memory poisoned and guarded past them: one step and a window of one, partial tiles,
/// K ≠ V and odd widths, windows of 5, 64, 65 and 200 steps; where K and V are multiples of 16,
/// again on bf16-rounded inputs with the window's tensor-core kernels (version 2, `mma.sync`
/// emulated lane by lane), bound 1e-3.
#[test]
#[cfg_attr(not(kp_cxx), ignore = "needs g++ with C++20 and <ucontext.h>")]
fn based_backward_emulated_matches_the_adjoint() {
    use kernelpages::sequence_mixers::based_backward::{
        window_backward_shared_bytes, window_backward_tc_shared_bytes,
    };
    use kernelpages::sequence_mixers::based_cuda::linear_shape;
    use kernelpages::sequence_mixers::cuda::Dtype;
    use kernelpages::sequence_mixers::reference::BasedShape;
    use kernelpages::sequence_mixers::ssd_backward::backward_shared_bytes;
    let cases: Vec<String> = [
        (1, 1, 1, 4, 4, 1),
        (1, 70, 2, 8, 4, 5),
        (2, 150, 1, 16, 8, 64),
        (1, 130, 1, 5, 7, 65),
        (1, 200, 1, 32, 32, 200),
        // The tensor-core kernels: one step, K ≠ V, windows 5, 64 and 200.
        (1, 1, 1, 16, 16, 1),
        (1, 70, 2, 16, 32, 5),
        (2, 150, 1, 32, 16, 64),
        (1, 200, 1, 64, 64, 200),
    ]
    .iter()
    .map(|&(batch, seq_len, heads, key_dim, value_dim, window)| {
        let s = BasedShape {
            batch,
            seq_len,
            heads,
            key_dim,
            value_dim,
            window,
        };
        let [chunk, dx, dbc, ddt] = backward_shared_bytes(linear_shape(s));
        let [dq, dkv] = window_backward_shared_bytes(s);
        let [tcq, tckv] = window_backward_tc_shared_bytes(s, Dtype::Bf16).unwrap_or([0, 0]);
        format!(
            "{batch},{seq_len},{heads},{key_dim},{value_dim},{window},{chunk},{chunk},{dx},{dbc},{ddt},{dq},{dkv},{tcq},{tckv}"
        )
    })
    .collect();
    emulated_kernel_runs_clean("based_bwd_check", &cases);
}

/// The grouped GEMM's three kernels (`kernels/moe/grouped_gemm.cu`: forward, dX, dW), bf16 and
/// fp16, on the CPU against float64 products of the same 16-bit values, every element, outputs
/// poisoned:
/// issue 14's inputs (8 experts with [5, 0, 0, 3, 0, 1, 0, 7] rows, K = N = 256; every count
/// 0; one token), partial row, column and reduction tiles, a group of more than one band of
/// row tiles, and the skewed counts `GroupedCase` gives (its last quarter of experts empty);
/// persistent grids of fewer blocks than tiles.
#[test]
#[cfg_attr(not(kp_cxx), ignore = "needs g++ with C++20 and <ucontext.h>")]
fn grouped_gemm_emulated_matches_float64() {
    use kernelpages::moe::case::{GroupedCase, Spread};
    let join = |c: &[usize]| {
        c.iter()
            .map(|v| v.to_string())
            .collect::<Vec<_>>()
            .join(":")
    };
    let zipf = GroupedCase {
        tokens: 150,
        experts: 8,
        top_k: 2,
        hidden: 64,
        width: 72,
        spread: Spread::Zipf,
        backward: true,
    };
    let counts = zipf.group_counts();
    assert_eq!(&counts[6..], &[0, 0], "{counts:?}");
    let cases = vec![
        format!("256,256,3,{}", join(&[5, 0, 0, 3, 0, 1, 0, 7])),
        format!("256,256,2,{}", join(&[0; 8])),
        format!("256,256,1,{}", join(&[0, 0, 1, 0])),
        format!("136,264,5,{}", join(&[130, 0, 257])),
        format!("16,136,9,{}", join(&[1100, 5])),
        format!("{},{},4,{}", zipf.hidden, zipf.width, join(&counts)),
    ];
    emulated_suite_kernel_runs_clean("moe", "grouped_gemm_check", &cases);
    emulated_suite_kernel_runs_clean_with("moe", "grouped_gemm_check", &["GG_BF16=0"], &cases);
}

/// The MoE routing, plan, gather, combine and SwiGLU kernels (`kernels/moe/dispatch.cu`) and
/// their backward on the CPU against a direct reference: chosen experts with ties, the stable
/// plan with and without a capacity, softmax and sigmoid gates, the identity at top_k = 1, the
/// activation; the combine's, SwiGLU's and the gather's backward against float64, the gates'
/// against central differences (dropped assignments and experts not chosen get none).
#[test]
#[cfg_attr(not(kp_cxx), ignore = "needs g++ with C++20 and <ucontext.h>")]
fn moe_dispatch_emulated_matches_the_reference() {
    let cases: Vec<String> = [
        "37,8,2,-1,16,0",
        "300,8,1,-1,16,0",
        "50,200,8,-1,8,1",
        "700,16,4,90,8,1",
        "130,64,6,-1,96,0",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    emulated_suite_kernel_runs_clean("moe", "dispatch_check", &cases);
}

/// The math path's row kernels (`kernels/softmax_rows.cu`, emulated by
/// `kernels/emulate/softmax_rows_check.cpp` on the sequence-mixer shim) for bf16, fp16 and
/// fp32 P: the softmax within the dtype's rounding of float64 with every other column up to the
/// row stride exactly 0, and the backward's dS = P (dP − D) bit for bit, with the padding
/// columns of S and dP holding NaN beforehand. Key counts that are and are not multiples of 8
/// (so of the 4-wide vectors), more than one pass of 256 threads over a row, key lengths below
/// the key count (0 included), bottom-right causal with more queries than keys (rows that see
/// no key) and fewer. At each key count also the padded K and V copies (`pad_rows_*`,
/// `unpad_rows_*`) in 16-byte and 4-byte units on a grid smaller than the work: rows copied,
/// padding rows written 0 over NaN, dK and dV copied out, nothing written past any buffer.
#[test]
#[cfg_attr(not(kp_cxx), ignore = "needs g++ with C++20 and <ucontext.h>")]
fn math_row_kernels_emulated_match_float64() {
    let cases: Vec<String> = [
        (3, 1, 1, 0),
        (5, 7, 7, 1),
        (4, 1030, 1030, 0),
        (6, 1029, 1000, 1),
        (5, 64, 64, 1),
        (4, 9, 0, 0),
        (2, 5, 5, 1),
        (5, 2, 2, 1),
        (3, 8, 3, 0),
        // 12 keys: the last 4-wide vector is all padding (4092's case).
        (3, 12, 12, 0),
    ]
    .iter()
    .map(|&(tq, tkv, l, causal)| format!("{tq},{tkv},{l},{causal}"))
    .collect();
    emulated_suite_kernel_runs_clean("", "softmax_rows_check", &cases);
}
