//! The gated delta rule forward (`kernels/sequence_mixers/delta.cu`, version 2) against the
//! float64 recurrence `reference::gated_delta_rule`, and its source compiled by NVRTC.

use kernelpages::sequence_mixers::cuda::Dtype;
use kernelpages::sequence_mixers::delta_cuda::{
    entry_points, hopper_entry_points, source, tensor_core_path, GatedDelta, StateWalk, WGMMA_CC,
};
use kernelpages::sequence_mixers::reference::{self, DeltaInputs, DeltaShape};

use super::{
    compiles_without_spills_on, down, gpu, poisoned, rel_l2, rounded, rounded_f32, uniform,
    unit_keys, up,
};

/// One gated-delta-rule case on the device against the float64 recurrence on the same
/// (rounded) inputs, with version 10's walks where `hopper` ([`GatedDelta::with_walks`]):
/// returns (error of O, error of the final state).
fn delta_case(shape: DeltaShape, dtype: Dtype, start: bool, hopper: bool, seed: u64) -> (f64, f64) {
    let g = gpu();
    let n = shape.batch * shape.seq_len * shape.heads;
    let (kd, vd) = (shape.key_dim, shape.value_dim);
    let q = uniform(n * kd, -1.0, 1.0, seed);
    // Unit keys, as the layer normalises them: normalised here, before the rounding.
    let k = unit_keys(n, kd, seed + 1);
    let v = uniform(n * vd, -1.0, 1.0, seed + 2);
    let alpha = uniform(n, 0.5, 1.0, seed + 3);
    let beta = uniform(n, 0.0, 1.0, seed + 4);
    let state_len = shape.batch * shape.heads * vd * kd;
    let s0 = uniform(state_len, -1.0, 1.0, seed + 5);
    // The reference reads the values the device gets: float32 or bf16 q, k, v, and float32
    // α, β and initial state.
    let (qr, kr, vr) = (rounded(dtype, &q), rounded(dtype, &k), rounded(dtype, &v));
    let (ar, br, s0r) = (rounded_f32(&alpha), rounded_f32(&beta), rounded_f32(&s0));
    let (o_ref, s_ref) = reference::gated_delta_rule(
        shape,
        DeltaInputs {
            q: &qr,
            k: &kr,
            v: &vr,
            alpha: &ar,
            beta: &br,
            initial_state: start.then_some(&s0r[..]),
        },
    )
    .unwrap();
    let (a_d, b_d, s0_d) = (up::<f32>(&alpha), up::<f32>(&beta), up::<f32>(&s0));
    let mut fin = poisoned::<f32>(state_len);
    let mut gdn = GatedDelta::with_walks(g, shape, dtype, hopper).unwrap();
    // Scratch: W, U, the log decays and the entering states of every chunk, float32, with
    // one-element bf16 placeholders (W, U, the states, M); on the tensor-core path g float32
    // with one-element float32 placeholders for W, U and the states, and W and U~ (then U) in
    // bf16 with the entering states, or with a fused walk (K = V = 128, and 64 too with
    // version 10's walks on Hopper) M [rows, 64, 64] instead, the other a one-element placeholder (each buffer at least one
    // element).
    let rows = shape.batch * shape.heads * shape.seq_len.div_ceil(64);
    let n = |n: usize| n.max(1) as u64;
    let (w, u, gl, st) = (rows * 64 * kd, rows * 64 * vd, rows * 64, rows * vd * kd);
    let walk = gdn.state_walk();
    let tc = walk.is_some();
    let fused = walk.is_some_and(|w| w.fused);
    let want = if tc {
        let last = if fused {
            1 + n(rows * 64 * 64)
        } else {
            n(st) + 1
        };
        3 * 4 + n(gl) * 4 + (n(w) + n(u) + last) * 2
    } else {
        (n(w) + n(u) + n(gl) + n(st)) * 4 + 4 * 2
    };
    assert_eq!(gdn.temporary_bytes(), want);
    // The dtype-typed tensors, launched and read back as `$t` (f32, or u16 holding bf16).
    macro_rules! run {
        ($t:ty) => {{
            let (q_d, k_d, v_d) = (up::<$t>(&q), up::<$t>(&k), up::<$t>(&v));
            let mut o_d = poisoned::<$t>(o_ref.len());
            gdn.launch(
                g,
                &q_d,
                &k_d,
                &v_d,
                &a_d,
                &b_d,
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
        rel_l2(&fin, &s_ref),
    )
}

fn shape(
    batch: usize,
    seq_len: usize,
    heads: usize,
    key_dim: usize,
    value_dim: usize,
) -> DeltaShape {
    DeltaShape {
        batch,
        seq_len,
        heads,
        key_dim,
        value_dim,
    }
}

#[test]
#[cfg_attr(not(kp_cuda), ignore = "needs an NVIDIA GPU (libcuda.so.1)")]
fn gated_delta_rule_matches_float64_on_every_shape() {
    let cases = [
        // One step; one exact chunk; a partial last chunk (200 = 3·64 + 8), at K = V = 64 and
        // 128 (the largest); K ≠ V both ways; widths that are not multiples of a warp.
        shape(1, 1, 2, 64, 64),
        shape(2, 64, 3, 64, 64),
        shape(2, 200, 2, 64, 64),
        shape(1, 200, 2, 128, 128),
        shape(2, 200, 2, 64, 128),
        shape(1, 130, 3, 128, 32),
        shape(2, 77, 2, 16, 24),
        // The tensor-core state walk of 32 rows a block over 16 chunks, 4 times its stages
        // (V = 96: three blocks a head).
        shape(1, 1000, 2, 32, 96),
        // K = V = 128 and 64 over 16 and 11 chunks (versions 8's and 9's walks, on Hopper
        // version 10's too), several turns of their rings, the last chunk partial.
        shape(1, 1000, 2, 128, 128),
        shape(1, 700, 2, 64, 64),
        // Issue 12's lengths around the chunk of 64 and past 65,536.
        shape(1, 63, 2, 16, 16),
        shape(1, 65, 2, 16, 16),
        shape(1, 65_537, 1, 16, 16),
    ];
    let mut failures = Vec::new();
    // On a Hopper GPU the cases version 10's walks take also run with them, whether or not
    // the dispatch takes them yet.
    let on_hopper = gpu().cc == WGMMA_CC;
    for (n, &s) in cases.iter().enumerate() {
        for dtype in [Dtype::F32, Dtype::Bf16] {
            let wgmma =
                on_hopper && tensor_core_path(s, dtype) && StateWalk::for_shape(s, true).wgmma;
            let walks: &[bool] = if wgmma { &[false, true] } else { &[false] };
            for (start, &hopper) in [false, true]
                .into_iter()
                .flat_map(|x| walks.iter().map(move |w| (x, w)))
            {
                let (eo, es) = delta_case(s, dtype, start, hopper, 300 + n as u64);
                // float32 arithmetic on exact inputs: 1e-4 for O and the state. The float32
                // triangular solve needs no looser bound: unit keys and β < 1 keep |A_ij| < 1,
                // and the substitution replays the recurrence, whose steps (I − β k kᵀ) do not
                // grow (the kernel's source run on the CPU in float32 gave ≤ 5e-7 on these
                // cases). bf16 output rounding (2⁻⁹ relative): 1e-2 for O; the state 1e-4
                // from the float32 kernels, 1e-2 from the tensor-core ones (version 3, where
                // `tensor_core_path` takes them: W, the entering states and U are rounded to bf16
                // inside).
                let tol = if dtype == Dtype::F32 { 1e-4 } else { 1e-2 };
                let state_tol = if tensor_core_path(s, dtype) {
                    1e-2
                } else {
                    1e-4
                };
                println!(
                    "gated_delta_rule {s:?} {dtype:?} initial {start} hopper walks {hopper}: O {eo:.2e} state {es:.2e}"
                );
                if !(eo <= tol && es <= state_tol) {
                    failures.push(format!(
                        "{s:?} {dtype:?} initial {start} hopper walks {hopper}: O {eo:.2e}, state {es:.2e}"
                    ));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
#[cfg_attr(not(kp_cuda), ignore = "needs an NVIDIA GPU (libcuda.so.1)")]
fn gated_delta_rule_with_no_step_returns_the_initial_state() {
    let s = shape(1, 0, 2, 8, 4);
    for start in [false, true] {
        let (_, es) = delta_case(s, Dtype::F32, start, false, 9);
        // Zeros against zeros give 0/0: rel_l2 divides by max(‖want‖², 1e-300).
        assert_eq!(es, 0.0, "initial {start}");
    }
}

#[test]
#[cfg_attr(not(kp_cuda), ignore = "needs an NVIDIA GPU (libcuda.so.1)")]
fn gated_delta_rule_refuses_bad_shapes_and_buffers() {
    let g = gpu();
    let s = shape(1, 3, 1, 8, 4);
    for bad in [
        shape(1, 3, 1, 129, 4),
        shape(1, 3, 1, 8, 0),
        shape(0, 3, 1, 8, 4),
    ] {
        assert!(GatedDelta::new(g, bad, Dtype::F32).is_err(), "{bad:?}");
    }
    let mut gdn = GatedDelta::new(g, s, Dtype::F32).unwrap();
    let z = |n: usize| g.stream.alloc_zeros::<f32>(n).unwrap();
    let (q, k, v, a, b) = (z(24), z(24), z(12), z(3), z(3));
    let (mut o, mut fin) = (z(12), z(32));
    gdn.launch(g, &q, &k, &v, &a, &b, None, &mut o.as_view_mut(), &mut fin)
        .unwrap();
    let short = z(2);
    let e = gdn
        .launch(
            g,
            &q,
            &k,
            &v,
            &a,
            &short,
            None,
            &mut o.as_view_mut(),
            &mut fin,
        )
        .unwrap_err();
    assert!(e.to_string().contains("beta holds 2"), "{e}");
    // bf16 buffers for an f32 runner.
    let h = |n: usize| g.stream.alloc_zeros::<u16>(n).unwrap();
    let (qh, kh, vh, mut oh) = (h(24), h(24), h(12), h(12));
    let e = gdn
        .launch(
            g,
            &qh,
            &kh,
            &vh,
            &a,
            &b,
            None,
            &mut oh.as_view_mut(),
            &mut fin,
        )
        .unwrap_err();
    assert!(e.to_string().contains("2-byte"), "{e}");
}

#[test]
#[cfg_attr(
    not(kp_nvrtc),
    ignore = "needs NVRTC 13 (libnvrtc.so.13) on the loader path; .ci/run installs it"
)]
fn delta_kernels_compile_without_spills() {
    compiles_without_spills_on(
        "delta.cu",
        &source(),
        &entry_points(),
        &hopper_entry_points(),
        &["sm_90a", "sm_80"],
    );
}
