//! SSD's backward (`sequence_mixers::ssd_backward`) on the device against the float64 adjoint
//! (`sequence_mixers::gradients::ssd_backward`).

use cudarc::driver::{CudaSlice, CudaViewMut};
use kernelpages::sequence_mixers::cuda::Dtype;
use kernelpages::sequence_mixers::gradients::ssd_backward;
use kernelpages::sequence_mixers::reference::{SsdInputs, SsdShape};
use kernelpages::sequence_mixers::ssd_backward::SsdBackward;

use super::{
    assert_backward_within, assert_same_bits, compiles_without_spills, down, gpu, poisoned,
    rounded, rounded_f32, uniform, up,
};

/// The backward's module (the forward's kernels and the backward's) compiles
/// ([`compiles_without_spills`]); runs in CI.
#[test]
#[cfg_attr(
    not(kp_nvrtc),
    ignore = "needs NVRTC 13 (libnvrtc.so.13) on the loader path; .ci/run installs it"
)]
fn ssd_backward_kernels_compile_without_spills() {
    use kernelpages::sequence_mixers::{cuda, ssd_backward};
    let mut entries = cuda::entry_points();
    entries.extend(ssd_backward::entry_points());
    compiles_without_spills("ssd_bwd.cu", &ssd_backward::source(), &entries);
}

fn shape(
    batch: usize,
    seq_len: usize,
    heads: usize,
    groups: usize,
    p: usize,
    n: usize,
) -> SsdShape {
    SsdShape {
        batch,
        seq_len,
        heads,
        head_dim: p,
        state: n,
        groups,
    }
}

/// The gradient buffers of one call, float32, poisoned (NaN): dX, dΔ, dA, dB, dC, dD and the
/// initial state's.
fn gradient_buffers(s: SsdShape) -> ([CudaSlice<f32>; 6], CudaSlice<f32>) {
    let bt = s.batch * s.seq_len;
    let bgn = bt * s.groups * s.state;
    (
        [
            poisoned::<f32>(bt * s.heads * s.head_dim),
            poisoned::<f32>(bt * s.heads),
            poisoned::<f32>(s.heads),
            poisoned::<f32>(bgn),
            poisoned::<f32>(bgn),
            poisoned::<f32>(s.heads),
        ],
        poisoned::<f32>(s.batch * s.heads * s.head_dim * s.state),
    )
}

/// Views of the six gradient buffers, as the runner passes them.
fn views(g: &mut [CudaSlice<f32>; 6]) -> [CudaViewMut<'_, f32>; 6] {
    let [a, b, c, d, e, f] = g;
    [
        a.as_view_mut(),
        b.as_view_mut(),
        c.as_view_mut(),
        d.as_view_mut(),
        e.as_view_mut(),
        f.as_view_mut(),
    ]
}

/// One backward on the device from random inputs (Δ in [0.01, 0.2), A in [−4, −0.5), the
/// rest in [−1, 1)), with or without D, an initial state and d_final_state (`optional`):
/// every gradient's values, in the order dX, dΔ, dA, dB, dC, dD, d(initial state), and the
/// float64 adjoint's on the same rounded inputs.
fn ssd_backward_case(
    s: SsdShape,
    dtype: Dtype,
    optional: bool,
    seed: u64,
) -> (Vec<Vec<f64>>, Vec<Vec<f64>>) {
    let g = gpu();
    let bt = s.batch * s.seq_len;
    let state_len = s.batch * s.heads * s.head_dim * s.state;
    let x = uniform(bt * s.heads * s.head_dim, -1.0, 1.0, seed);
    let dt = uniform(bt * s.heads, 0.01, 0.2, seed + 1);
    let a = uniform(s.heads, -4.0, -0.5, seed + 2);
    let b = uniform(bt * s.groups * s.state, -1.0, 1.0, seed + 3);
    let c = uniform(bt * s.groups * s.state, -1.0, 1.0, seed + 4);
    let d = uniform(s.heads, -1.0, 1.0, seed + 5);
    let s0 = uniform(state_len, -1.0, 1.0, seed + 6);
    let dy = uniform(bt * s.heads * s.head_dim, -1.0, 1.0, seed + 7);
    let dfin = uniform(state_len, -1.0, 1.0, seed + 8);
    let (xr, br, cr, dyr) = (
        rounded(dtype, &x),
        rounded(dtype, &b),
        rounded(dtype, &c),
        rounded(dtype, &dy),
    );
    let (dtr, ar, dr, s0r, dfinr) = (
        rounded_f32(&dt),
        rounded_f32(&a),
        rounded_f32(&d),
        rounded_f32(&s0),
        rounded_f32(&dfin),
    );
    let want = ssd_backward(
        s,
        SsdInputs {
            x: &xr,
            dt: &dtr,
            a: &ar,
            b: &br,
            c: &cr,
            d: optional.then_some(&dr[..]),
            initial_state: optional.then_some(&s0r[..]),
        },
        &dyr,
        optional.then_some(&dfinr[..]),
    )
    .unwrap();
    let (dt_d, a_d, d_d, s0_d, dfin_d) = (
        up::<f32>(&dt),
        up::<f32>(&a),
        up::<f32>(&d),
        up::<f32>(&s0),
        up::<f32>(&dfin),
    );
    let (mut grads, mut d_initial) = gradient_buffers(s);
    let mut bwd = SsdBackward::new(g, s, dtype).unwrap();
    macro_rules! run {
        ($t:ty) => {{
            let (x_d, b_d, c_d, dy_d) = (up::<$t>(&x), up::<$t>(&b), up::<$t>(&c), up::<$t>(&dy));
            bwd.launch_into(
                g,
                (&x_d, &dt_d, &a_d, &b_d, &c_d),
                optional.then_some(&d_d),
                optional.then_some(&s0_d),
                &dy_d,
                optional.then_some(&dfin_d),
                &mut views(&mut grads),
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
    let wants = vec![
        want.dx,
        want.ddt,
        want.da,
        want.db,
        want.dc,
        // Without D the kernels write dD as zeros.
        want.dd.unwrap_or_else(|| vec![0.0; s.heads]),
        want.d_initial_state,
    ];
    (got, wants)
}

const NAMES: [&str; 7] = ["dx", "ddt", "da", "db", "dc", "dd", "d_initial_state"];

/// The backward against the float64 adjoint: both dtypes (float32 arithmetic either way, on
/// the same rounded inputs), with and without D, an initial state and d_final_state; one
/// step, 63, 64, 65 and 200 steps (partial chunks), groups, odd head_dim and state, head_dim
/// = state = 128 (the grid's largest), and 4,097 steps (65 chunks). Relative L2 error of every
/// gradient ≤ 1e-4 (the largest absolute value where the float64 gradient is exactly 0); a
/// NaN fails.
#[test]
#[cfg_attr(not(kp_cuda), ignore = "needs an NVIDIA GPU (libcuda.so.1)")]
fn ssd_backward_matches_float64() {
    let cases = [
        shape(1, 1, 2, 1, 16, 16),
        shape(2, 63, 4, 2, 32, 16),
        shape(1, 64, 2, 2, 64, 64),
        shape(1, 65, 2, 1, 33, 31),
        shape(2, 200, 4, 1, 64, 128),
        shape(1, 130, 2, 1, 128, 128),
        shape(1, 4097, 2, 1, 16, 32),
    ];
    assert_backward_within(
        "ssd backward",
        "D, S0, d_final",
        &NAMES,
        &cases,
        500,
        |_, _| 1e-4,
        ssd_backward_case,
    );
}

/// Two calls on the same inputs give the same bits (no atomics in the sums).
#[test]
#[cfg_attr(not(kp_cuda), ignore = "needs an NVIDIA GPU (libcuda.so.1)")]
fn ssd_backward_is_deterministic() {
    let s = shape(2, 300, 4, 1, 64, 64);
    let (first, _) = ssd_backward_case(s, Dtype::Bf16, true, 77);
    let (second, _) = ssd_backward_case(s, Dtype::Bf16, true, 77);
    assert_same_bits(&NAMES, &first, &second);
}

/// The grid's shape (B4 T16384 H8 P128 N128, one group), both dtypes: every gradient finite
/// and dX not all zero after 16,384 steps (no float64 reference at this size; the shapes above
/// check the values).
#[test]
#[cfg_attr(not(kp_cuda), ignore = "needs an NVIDIA GPU (libcuda.so.1)")]
fn ssd_backward_at_the_grid_shape_is_finite() {
    let g = gpu();
    let s = shape(4, 16_384, 8, 1, 128, 128);
    let bt = s.batch * s.seq_len;
    for dtype in [Dtype::F32, Dtype::Bf16] {
        let dt = up::<f32>(&uniform(bt * s.heads, 0.01, 0.2, 1));
        let a = up::<f32>(&uniform(s.heads, -4.0, -0.5, 2));
        let d = up::<f32>(&uniform(s.heads, -1.0, 1.0, 3));
        let (mut grads, mut d_initial) = gradient_buffers(s);
        let mut bwd = SsdBackward::new(g, s, dtype).unwrap();
        macro_rules! run {
            ($t:ty) => {{
                let x = up::<$t>(&uniform(bt * s.heads * s.head_dim, -1.0, 1.0, 4));
                let b = up::<$t>(&uniform(bt * s.state, -1.0, 1.0, 5));
                let c = up::<$t>(&uniform(bt * s.state, -1.0, 1.0, 6));
                let dy = up::<$t>(&uniform(bt * s.heads * s.head_dim, -1.0, 1.0, 7));
                bwd.launch_into(
                    g,
                    (&x, &dt, &a, &b, &c),
                    Some(&d),
                    None,
                    &dy,
                    None,
                    &mut views(&mut grads),
                    &mut d_initial,
                )
                .unwrap();
            }};
        }
        match dtype {
            Dtype::F32 => run!(f32),
            Dtype::Bf16 => run!(u16),
        }
        let dx = down(&grads[0]);
        for (name, buf) in NAMES.iter().zip(grads.iter().chain([&d_initial])) {
            assert!(down(buf).iter().all(|x| x.is_finite()), "{dtype:?} {name}");
        }
        assert!(dx.iter().any(|&x| x != 0.0), "{dtype:?}");
        println!(
            "ssd backward {s:?} {dtype:?}: finite; scratch {:.0} MB",
            bwd.temporary_bytes() as f64 / 1e6
        );
    }
}

/// No step: the initial state's gradient is d_final_state, dA and dD are zero.
#[test]
#[cfg_attr(not(kp_cuda), ignore = "needs an NVIDIA GPU (libcuda.so.1)")]
fn ssd_backward_with_no_step_passes_d_final_state_back() {
    let g = gpu();
    let s = shape(2, 0, 2, 1, 8, 16);
    let state_len = s.batch * s.heads * s.head_dim * s.state;
    let dfin = uniform(state_len, -1.0, 1.0, 9);
    let empty = up::<f32>(&[]);
    let a = up::<f32>(&uniform(s.heads, -4.0, -0.5, 10));
    let d = up::<f32>(&uniform(s.heads, -1.0, 1.0, 11));
    let (mut grads, mut d_initial) = gradient_buffers(s);
    let mut bwd = SsdBackward::new(g, s, Dtype::F32).unwrap();
    bwd.launch_into(
        g,
        (&empty, &empty, &a, &empty, &empty),
        Some(&d),
        None,
        &empty,
        Some(&up::<f32>(&dfin)),
        &mut views(&mut grads),
        &mut d_initial,
    )
    .unwrap();
    assert_eq!(down(&d_initial), rounded_f32(&dfin));
    assert!(down(&grads[2]).iter().all(|&v| v == 0.0));
    assert!(down(&grads[5]).iter().all(|&v| v == 0.0));
}
