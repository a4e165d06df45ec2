//! Based's backward (`sequence_mixers::based_backward`) on the device against the float64
//! adjoint (`sequence_mixers::based_gradients::based_backward`).

use cudarc::driver::CudaSlice;
use kernelpages::sequence_mixers::based_backward::{
    window_backward_tc_shared_bytes, BasedBackward,
};
use kernelpages::sequence_mixers::based_gradients::based_backward;
use kernelpages::sequence_mixers::cuda::Dtype;
use kernelpages::sequence_mixers::reference::{BasedInputs, BasedShape, BasedState};

use super::{
    assert_backward_within, assert_same_bits, compiles_without_spills, down, gpu, poisoned,
    rounded, rounded_f32, uniform, up,
};

/// The backward's window module (based.cu and based_bwd.cu) compiles
/// ([`compiles_without_spills`]); its linear branch is SSD's backward module, compiled by
/// `ssd_bwd::ssd_backward_kernels_compile_without_spills`. Runs in CI.
#[test]
#[cfg_attr(
    not(kp_nvrtc),
    ignore = "needs NVRTC 13 (libnvrtc.so.13) on the loader path; .ci/run installs it"
)]
fn based_backward_kernels_compile_without_spills() {
    use kernelpages::sequence_mixers::{based_backward, based_cuda};
    let mut entries = based_cuda::entry_points();
    entries.extend(based_backward::entry_points());
    compiles_without_spills("based_bwd.cu", &based_backward::source(), &entries);
}

fn shape(
    batch: usize,
    seq_len: usize,
    heads: usize,
    key_dim: usize,
    value_dim: usize,
    window: usize,
) -> BasedShape {
    BasedShape {
        batch,
        seq_len,
        heads,
        key_dim,
        value_dim,
        window,
    }
}

/// One backward on the device from random inputs in [−1, 1) (scale 1/√K), with or without
/// an initial state and d_final_state (`optional`): the gradients' values in the order dq, dk,
/// dv, d(initial state), and the float64 adjoint's on the same rounded inputs.
fn based_backward_case(
    s: BasedShape,
    dtype: Dtype,
    optional: bool,
    seed: u64,
) -> (Vec<Vec<f64>>, Vec<Vec<f64>>) {
    let g = gpu();
    let bth = s.batch * s.seq_len * s.heads;
    let state_len = s.batch * s.heads * s.value_dim * s.key_dim;
    let q = uniform(bth * s.key_dim, -1.0, 1.0, seed);
    let k = uniform(bth * s.key_dim, -1.0, 1.0, seed + 1);
    let v = uniform(bth * s.value_dim, -1.0, 1.0, seed + 2);
    let s0 = uniform(state_len, -1.0, 1.0, seed + 3);
    let dy = uniform(bth * s.value_dim, -1.0, 1.0, seed + 4);
    let dfin = uniform(state_len, -1.0, 1.0, seed + 5);
    let scale = 1.0 / (s.key_dim as f32).sqrt();
    let (qr, kr, vr, dyr) = (
        rounded(dtype, &q),
        rounded(dtype, &k),
        rounded(dtype, &v),
        rounded(dtype, &dy),
    );
    let (s0r, dfinr) = (rounded_f32(&s0), rounded_f32(&dfin));
    let start = BasedState {
        s: s0r,
        ..BasedState::zeros(s)
    };
    let want = based_backward(
        s,
        BasedInputs {
            q: &qr,
            k: &kr,
            v: &vr,
            scale: scale as f64,
            initial_state: optional.then_some(&start),
        },
        &dyr,
        optional.then_some(&dfinr[..]),
    )
    .unwrap();
    let (s0_d, dfin_d) = (up::<f32>(&s0), up::<f32>(&dfin));
    let mut grads: [CudaSlice<f32>; 3] = [
        poisoned::<f32>(bth * s.key_dim),
        poisoned::<f32>(bth * s.key_dim),
        poisoned::<f32>(bth * s.value_dim),
    ];
    let mut d_initial = poisoned::<f32>(state_len);
    let mut bwd = BasedBackward::new(g, s, dtype).unwrap();
    macro_rules! run {
        ($t:ty) => {{
            let (q_d, k_d, v_d, dy_d) = (up::<$t>(&q), up::<$t>(&k), up::<$t>(&v), up::<$t>(&dy));
            let [a, b, c] = &mut grads;
            bwd.launch_into(
                g,
                (&q_d, &k_d, &v_d),
                scale,
                optional.then_some(&s0_d),
                &dy_d,
                optional.then_some(&dfin_d),
                &mut [a.as_view_mut(), b.as_view_mut(), c.as_view_mut()],
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
    (got, vec![want.dq, want.dk, want.dv, want.d_initial_state])
}

const NAMES: [&str; 4] = ["dq", "dk", "dv", "d_initial_state"];

/// The backward against the float64 adjoint: both dtypes (float32 arithmetic either way, on
/// the same rounded inputs), with and without an initial state and d_final_state; one step,
/// partial chunks and tiles (63, 65, 200 steps), K ≠ V and odd widths, windows of 1, 64, 65
/// and 256 steps, K = V = 128 (the grid's largest), and 4,097 steps. Relative L2 error of
/// every gradient ≤ 1e-4 where the window's kernels are version 1 (float32), ≤ 4e-3 where
/// bf16 runs them on tensor cores (version 2: P and dS rounded to bf16 for their products); a
/// NaN fails.
#[test]
#[cfg_attr(not(kp_cuda), ignore = "needs an NVIDIA GPU (libcuda.so.1)")]
fn based_backward_matches_float64() {
    let cases = [
        shape(1, 1, 2, 16, 16, 64),
        shape(2, 63, 2, 32, 16, 1),
        shape(1, 65, 2, 33, 31, 64),
        shape(2, 200, 2, 64, 64, 65),
        shape(1, 300, 1, 128, 128, 256),
        shape(1, 130, 2, 128, 128, 64),
        shape(1, 4097, 1, 16, 32, 64),
    ];
    assert_backward_within(
        "based backward",
        "S0, d_final",
        &NAMES,
        &cases,
        700,
        |s, dtype| {
            if window_backward_tc_shared_bytes(s, dtype).is_some() {
                4e-3
            } else {
                1e-4
            }
        },
        based_backward_case,
    );
}

/// Two calls on the same inputs give the same bits (no atomics).
#[test]
#[cfg_attr(not(kp_cuda), ignore = "needs an NVIDIA GPU (libcuda.so.1)")]
fn based_backward_is_deterministic() {
    let s = shape(2, 300, 2, 64, 64, 64);
    let (first, _) = based_backward_case(s, Dtype::Bf16, true, 97);
    let (second, _) = based_backward_case(s, Dtype::Bf16, true, 97);
    assert_same_bits(&NAMES, &first, &second);
}
