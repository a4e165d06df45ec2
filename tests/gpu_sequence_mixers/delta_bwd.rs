//! The gated delta rule's backward (`sequence_mixers::delta_backward`) on the device against
//! the float64 adjoint (`sequence_mixers::delta_gradients::gated_delta_rule_backward`).

use cudarc::driver::CudaSlice;
use kernelpages::sequence_mixers::cuda::Dtype;
use kernelpages::sequence_mixers::delta_backward::{entry_points, source, DeltaBackward};
use kernelpages::sequence_mixers::delta_cuda;
use kernelpages::sequence_mixers::delta_gradients::gated_delta_rule_backward;
use kernelpages::sequence_mixers::reference::{DeltaInputs, DeltaShape};

use super::{
    assert_backward_within, assert_same_bits, compiles_without_spills_on, down, gpu, poisoned,
    rounded, rounded_f32, uniform, unit_keys, up,
};

/// The backward's module (delta.cu and delta_bwd.cu) compiles ([`compiles_without_spills_on`];
/// the forward's Hopper-only walks in the sm_90a PTX alone).
/// Runs in CI.
#[test]
#[cfg_attr(
    not(kp_nvrtc),
    ignore = "needs NVRTC 13 (libnvrtc.so.13) on the loader path; .ci/run installs it"
)]
fn delta_backward_kernels_compile_without_spills() {
    let mut entries = delta_cuda::entry_points();
    entries.extend(entry_points());
    compiles_without_spills_on(
        "delta_bwd.cu",
        &source(),
        &entries,
        &delta_cuda::hopper_entry_points(),
        &["sm_90a", "sm_80"],
    );
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

const NAMES: [&str; 6] = ["dq", "dk", "dv", "d_alpha", "d_beta", "d_initial_state"];

/// One backward on the device from random inputs (unit keys, α in [0.5, 1), β in [0, 1), q,
/// v, the states and cotangents in [−1, 1)), with or without an initial state and
/// d_final_state (`optional`): the gradients in the order of [`NAMES`], and the float64
/// adjoint's on the same rounded inputs.
fn delta_backward_case(
    s: DeltaShape,
    dtype: Dtype,
    optional: bool,
    seed: u64,
) -> (Vec<Vec<f64>>, Vec<Vec<f64>>) {
    let g = gpu();
    let n = s.batch * s.seq_len * s.heads;
    let (kd, vd) = (s.key_dim, s.value_dim);
    let state_len = s.batch * s.heads * vd * kd;
    let q = uniform(n * kd, -1.0, 1.0, seed);
    let k = unit_keys(n, kd, seed + 1);
    let v = uniform(n * vd, -1.0, 1.0, seed + 2);
    let alpha = uniform(n, 0.5, 1.0, seed + 3);
    let beta = uniform(n, 0.0, 1.0, seed + 4);
    let s0 = uniform(state_len, -1.0, 1.0, seed + 5);
    let dout = uniform(n * vd, -1.0, 1.0, seed + 6);
    let dfin = uniform(state_len, -1.0, 1.0, seed + 7);
    let (qr, kr, vr, dor) = (
        rounded(dtype, &q),
        rounded(dtype, &k),
        rounded(dtype, &v),
        rounded(dtype, &dout),
    );
    let (ar, br, s0r, dfinr) = (
        rounded_f32(&alpha),
        rounded_f32(&beta),
        rounded_f32(&s0),
        rounded_f32(&dfin),
    );
    let want = gated_delta_rule_backward(
        s,
        DeltaInputs {
            q: &qr,
            k: &kr,
            v: &vr,
            alpha: &ar,
            beta: &br,
            initial_state: optional.then_some(&s0r[..]),
        },
        &dor,
        optional.then_some(&dfinr[..]),
    )
    .unwrap();
    let (a_d, b_d, s0_d, dfin_d) = (
        up::<f32>(&alpha),
        up::<f32>(&beta),
        up::<f32>(&s0),
        up::<f32>(&dfin),
    );
    let mut grads: [CudaSlice<f32>; 5] = [
        poisoned::<f32>(n * kd),
        poisoned::<f32>(n * kd),
        poisoned::<f32>(n * vd),
        poisoned::<f32>(n),
        poisoned::<f32>(n),
    ];
    let mut d_initial = poisoned::<f32>(state_len);
    let mut bwd = DeltaBackward::new(g, s, dtype).unwrap();
    macro_rules! run {
        ($t:ty) => {{
            let (q_d, k_d, v_d, do_d) = (up::<$t>(&q), up::<$t>(&k), up::<$t>(&v), up::<$t>(&dout));
            let [a, b, c, d, e] = &mut grads;
            bwd.launch_into(
                g,
                (&q_d, &k_d, &v_d),
                (&a_d, &b_d),
                optional.then_some(&s0_d),
                &do_d,
                optional.then_some(&dfin_d),
                &mut [
                    a.as_view_mut(),
                    b.as_view_mut(),
                    c.as_view_mut(),
                    d.as_view_mut(),
                    e.as_view_mut(),
                ],
                &mut d_initial,
            )
            .unwrap();
        }};
    }
    match dtype {
        Dtype::F32 => run!(f32),
        Dtype::Bf16 => run!(u16),
    }
    let mut got: Vec<Vec<f64>> = grads.iter().map(down).collect();
    got.push(down(&d_initial));
    (
        got,
        vec![
            want.d_q,
            want.d_k,
            want.d_v,
            want.d_alpha,
            want.d_beta,
            want.d_initial_state,
        ],
    )
}

/// The backward against the float64 adjoint: both dtypes (float32 arithmetic either way, on
/// the same rounded inputs), with and without an initial state and d_final_state; one step,
/// partial chunks (63, 65, 200 steps), K ≠ V, odd widths and V not a multiple of the 16-row
/// blocks, K = V = 128 (the grid's largest) and 4,097 steps. Relative L2 error of every
/// gradient ≤ 1e-4; a NaN fails.
#[test]
#[cfg_attr(not(kp_cuda), ignore = "needs an NVIDIA GPU (libcuda.so.1)")]
fn delta_backward_matches_float64() {
    let cases = [
        shape(1, 1, 2, 16, 16),
        shape(2, 63, 2, 32, 16),
        shape(1, 65, 2, 33, 31),
        shape(2, 200, 2, 64, 48),
        shape(1, 130, 2, 128, 128),
        shape(1, 4097, 1, 64, 64),
    ];
    assert_backward_within(
        "gated delta backward",
        "S0, d_final",
        &NAMES,
        &cases,
        900,
        |_, _| 1e-4,
        delta_backward_case,
    );
}

/// Two calls on the same inputs give the same bits (no atomics).
#[test]
#[cfg_attr(not(kp_cuda), ignore = "needs an NVIDIA GPU (libcuda.so.1)")]
fn delta_backward_is_deterministic() {
    let s = shape(2, 300, 2, 64, 64);
    let (first, _) = delta_backward_case(s, Dtype::Bf16, true, 97);
    let (second, _) = delta_backward_case(s, Dtype::Bf16, true, 97);
    assert_same_bits(&NAMES, &first, &second);
}

/// The six launches' device times at the grid's largest T = 16384 shape (B4 H8, K = V = 128,
/// bf16), printed for kernels/TUNING-sequence-mixers.md; each must be a positive time.
#[test]
#[cfg_attr(not(kp_cuda), ignore = "needs an NVIDIA GPU (libcuda.so.1)")]
fn delta_backward_stage_times() {
    let g = gpu();
    let s = shape(4, 16384, 8, 128, 128);
    let n = s.batch * s.seq_len * s.heads;
    let state_len = s.batch * s.heads * s.value_dim * s.key_dim;
    let k = unit_keys(n, s.key_dim, 5);
    let seq = |v: &[f64]| up::<u16>(v);
    let (q, k, v, dout) = (
        seq(&uniform(n * s.key_dim, -0.1, 0.1, 1)),
        seq(&k),
        seq(&uniform(n * s.value_dim, -1.0, 1.0, 2)),
        seq(&uniform(n * s.value_dim, -1.0, 1.0, 3)),
    );
    let (alpha, beta) = (
        up::<f32>(&uniform(n, 0.8, 1.0, 4)),
        up::<f32>(&uniform(n, 0.0, 1.0, 6)),
    );
    let mut grads: Vec<CudaSlice<f32>> = [s.key_dim, s.key_dim, s.value_dim, 1, 1]
        .iter()
        .map(|&w| poisoned::<f32>(n * w))
        .collect();
    let mut d_initial = poisoned::<f32>(state_len);
    let mut bwd = DeltaBackward::new(g, s, Dtype::Bf16).unwrap();
    bwd.time_stages(g).unwrap();
    for _ in 0..3 {
        let [a, b, c, d, e] = &mut grads[..] else {
            unreachable!()
        };
        bwd.launch_into(
            g,
            (&q, &k, &v),
            (&alpha, &beta),
            None,
            &dout,
            None,
            &mut [
                a.as_view_mut(),
                b.as_view_mut(),
                c.as_view_mut(),
                d.as_view_mut(),
                e.as_view_mut(),
            ],
            &mut d_initial,
        )
        .unwrap();
    }
    let times = bwd.stage_times_ms().unwrap();
    let total: f32 = times.iter().map(|t| t.1).sum();
    for (name, ms) in &times {
        println!("gated delta backward {s:?} bf16: {name}: {ms:.3} ms");
        assert!(ms.is_finite() && *ms > 0.0, "{name}: {ms}");
    }
    println!("gated delta backward {s:?} bf16: all six {total:.3} ms");
}
