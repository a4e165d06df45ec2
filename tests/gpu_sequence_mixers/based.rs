//! Based's forward (`sequence_mixers::based_cuda`, `kernels/sequence_mixers/based.cu`) on the
//! GPU against `reference::based`, and the kernels' NVRTC compile (no GPU needed: it runs in
//! CI).

use kernelpages::sequence_mixers::based_cuda::{entry_points, linear_shape, source, Based};
use kernelpages::sequence_mixers::cuda::{tensor_core_path, Dtype};
use kernelpages::sequence_mixers::reference::{self, BasedInputs, BasedShape, BasedState};

use super::{compiles_without_spills, down, gpu, poisoned, rel_l2, rounded, uniform, up};

/// One Based case on the device against the float64 recurrence on the same (rounded) inputs,
/// with an empty initial window cache: returns (error of O, error of the final linear state).
fn based_case(shape: BasedShape, dtype: Dtype, start: bool, seed: u64) -> (f64, f64) {
    let g = gpu();
    let bth = shape.batch * shape.seq_len * shape.heads;
    let q = uniform(bth * shape.key_dim, -1.0, 1.0, seed);
    let k = uniform(bth * shape.key_dim, -1.0, 1.0, seed + 1);
    let v = uniform(bth * shape.value_dim, -1.0, 1.0, seed + 2);
    let state_len = shape.batch * shape.heads * shape.value_dim * shape.key_dim;
    let s0 = uniform(state_len, -1.0, 1.0, seed + 3);
    let scale = 1.0 / (shape.key_dim as f32).sqrt();
    // The reference reads the values the device gets: float32 or bf16, and a float32 S₀.
    let (qr, kr, vr) = (rounded(dtype, &q), rounded(dtype, &k), rounded(dtype, &v));
    let start_state = BasedState {
        s: s0.iter().map(|&e| e as f32 as f64).collect(),
        ..BasedState::zeros(shape)
    };
    let (o_ref, last_ref) = reference::based(
        shape,
        BasedInputs {
            q: &qr,
            k: &kr,
            v: &vr,
            scale: scale as f64,
            initial_state: start.then_some(&start_state),
        },
    )
    .unwrap();
    let s0_d = up::<f32>(&s0);
    let mut fin = poisoned::<f32>(state_len);
    let mut based = Based::new(g, shape, dtype).unwrap();
    // The dtype-typed tensors, launched and read back as `$t` (f32, or u16 holding bf16).
    macro_rules! run {
        ($t:ty) => {{
            let (q_d, k_d, v_d) = (up::<$t>(&q), up::<$t>(&k), up::<$t>(&v));
            let mut o_d = poisoned::<$t>(o_ref.len());
            based
                .launch(
                    g,
                    &q_d,
                    &k_d,
                    &v_d,
                    scale,
                    start.then_some(&s0_d),
                    &mut o_d.as_view_mut(),
                    &mut fin,
                )
                .unwrap();
            down(&o_d)
        }};
    }
    let o: Vec<f64> = match dtype {
        Dtype::F32 => run!(f32),
        Dtype::Bf16 => run!(u16),
    };
    let fin = down(&fin);
    (
        super::rel_l2_with_tail(&o, &o_ref, shape.batch, shape.seq_len),
        rel_l2(&fin, &last_ref.s),
    )
}

#[test]
#[cfg_attr(not(kp_cuda), ignore = "needs an NVIDIA GPU (libcuda.so.1)")]
fn based_matches_float64_on_every_shape() {
    let shape = |batch, seq_len, heads, key_dim, value_dim, window| BasedShape {
        batch,
        seq_len,
        heads,
        key_dim,
        value_dim,
        window,
    };
    let cases = [
        // One step (W > T), with the smallest and the largest window.
        shape(1, 1, 2, 64, 64, 1),
        shape(2, 1, 2, 64, 64, 256),
        // One exact chunk: W = 1 (the current key alone), 4, and W = T.
        shape(2, 64, 3, 64, 64, 1),
        shape(2, 64, 3, 64, 64, 4),
        shape(1, 64, 2, 64, 64, 64),
        // Four chunks, the last partial: windows inside the sequence, and W > T.
        shape(2, 200, 2, 64, 64, 4),
        shape(1, 200, 3, 64, 64, 64),
        shape(1, 200, 2, 64, 64, 256),
        // K ≠ V, both ways, and the largest widths (176 KiB of shared memory).
        shape(1, 200, 2, 32, 96, 64),
        shape(2, 200, 1, 128, 16, 256),
        shape(1, 200, 2, 128, 128, 64),
        // Small odd widths: partial warps over V, K below a warp.
        shape(1, 130, 3, 5, 7, 4),
        // Issue 12's lengths around the chunk of 64 and past 65,536.
        shape(1, 63, 1, 16, 16, 8),
        shape(1, 65, 1, 16, 16, 8),
        shape(1, 65_537, 1, 16, 16, 64),
    ];
    let mut failures = Vec::new();
    for (n, &s) in cases.iter().enumerate() {
        for dtype in [Dtype::F32, Dtype::Bf16] {
            for start in [false, true] {
                let (eo, es) = based_case(s, dtype, start, 300 + 10 * n as u64);
                // float32 arithmetic on exact inputs: 1e-4 for the output and the state. bf16:
                // the output's rounding, 1e-2; the state 1e-4 from the float32 kernels, 1e-2
                // from the tensor-core ones (SSD's version 5, the cases `tensor_core_path`
                // takes), which round Δ·x, the chunk states and the products' operands to bf16
                // inside.
                let tol = if dtype == Dtype::F32 { 1e-4 } else { 1e-2 };
                let state_tol = if tensor_core_path(linear_shape(s), dtype).is_some() {
                    1e-2
                } else {
                    1e-4
                };
                println!("based {s:?} {dtype:?} initial {start}: O {eo:.2e} state {es:.2e}");
                if !(eo <= tol && es <= state_tol) {
                    failures.push(format!(
                        "{s:?} {dtype:?} initial {start}: O {eo:.2e}, state {es:.2e}"
                    ));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
#[cfg_attr(not(kp_cuda), ignore = "needs an NVIDIA GPU (libcuda.so.1)")]
fn based_with_no_step_returns_the_initial_state() {
    let s = BasedShape {
        batch: 1,
        seq_len: 0,
        heads: 2,
        key_dim: 4,
        value_dim: 8,
        window: 4,
    };
    let (_, es) = based_case(s, Dtype::F32, true, 7);
    assert_eq!(es, 0.0);
}

/// Every entry point compiles for sm_90a (to PTX, and to machine code as the runner loads it)
/// and sm_80 (to PTX, `ptx_for_ampere`), and ptxas reports no spills on sm_90a.
#[test]
#[cfg_attr(
    not(kp_nvrtc),
    ignore = "needs NVRTC 13 (libnvrtc.so.13) on the loader path; .ci/run installs it"
)]
fn based_kernels_compile_without_spills() {
    compiles_without_spills("based.cu", &source(), &entry_points());
}
