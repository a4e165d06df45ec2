//! Mamba's selective scan on the device (`sequence_mixers::scan_cuda`) against the float64
//! recurrence (`reference::selective_scan`), and the NVRTC compile of its source.

use kernelpages::sequence_mixers::cuda::Dtype;
use kernelpages::sequence_mixers::gradients::selective_scan_backward;
use kernelpages::sequence_mixers::reference::{self, ScanInputs, ScanShape};
use kernelpages::sequence_mixers::scan_cuda::{
    backward_chunk, entry_points, forward_chunk, source, threads_per_channel, Scan, ScanBackward,
    ScanGradientBuffers,
};

use super::{
    compiles_without_spills, down, gpu, poisoned, rel_l2, rounded, rounded_f32, uniform, up,
};

/// A selective-scan shape: B, T, D (channels), N (state).
fn shape(batch: usize, seq_len: usize, channels: usize, state: usize) -> ScanShape {
    ScanShape {
        batch,
        seq_len,
        channels,
        state,
    }
}

/// The forward's inputs for `shape`, drawn from `seed` on: u, Δ (0.01 to 0.2), A (−4 to
/// −0.5), B, C, D and the initial state (−1 to 1), in [`ScanInputs`]' layouts.
fn random_inputs(shape: ScanShape, seed: u64) -> [Vec<f64>; 7] {
    let bt = shape.batch * shape.seq_len;
    let (ch, n) = (shape.channels, shape.state);
    [
        uniform(bt * ch, -1.0, 1.0, seed),
        uniform(bt * ch, 0.01, 0.2, seed + 1),
        uniform(ch * n, -4.0, -0.5, seed + 2),
        uniform(bt * n, -1.0, 1.0, seed + 3),
        uniform(bt * n, -1.0, 1.0, seed + 4),
        uniform(ch, -1.0, 1.0, seed + 5),
        uniform(shape.batch * ch * n, -1.0, 1.0, seed + 6),
    ]
}

/// One selective-scan case on the device, in chunks of `chunk` steps (`None`: what
/// [`forward_chunk`] picks), against the float64 recurrence on the same (rounded) inputs:
/// returns (error of y, error of the final state).
fn scan_case(
    shape: ScanShape,
    dtype: Dtype,
    skip: bool,
    start: bool,
    seed: u64,
    chunk: Option<usize>,
) -> (f64, f64) {
    let g = gpu();
    let state_len = shape.batch * shape.channels * shape.state;
    let [u, delta, a, b, c, d, s0] = random_inputs(shape, seed);
    // The reference reads the values the device gets: float32 or bf16, and float32 Δ, A, D.
    let (ur, br, cr) = (rounded(dtype, &u), rounded(dtype, &b), rounded(dtype, &c));
    let (deltar, ar, dr, s0r) = (
        rounded_f32(&delta),
        rounded_f32(&a),
        rounded_f32(&d),
        rounded_f32(&s0),
    );
    let (y_ref, s_ref) = reference::selective_scan(
        shape,
        ScanInputs {
            u: &ur,
            delta: &deltar,
            a: &ar,
            b: &br,
            c: &cr,
            d: skip.then_some(&dr[..]),
            initial_state: start.then_some(&s0r[..]),
        },
    )
    .unwrap();
    let (delta_d, a_d, d_d, s0_d) = (
        up::<f32>(&delta),
        up::<f32>(&a),
        up::<f32>(&d),
        up::<f32>(&s0),
    );
    let mut fin = poisoned::<f32>(state_len);
    let chunk = chunk.unwrap_or_else(|| forward_chunk(shape));
    let mut scan = Scan::with_chunk(g, shape, dtype, chunk).unwrap();
    assert_eq!(scan.chunk(), chunk);
    // The chunks' states [B, chunks, D, N] and sums of Δ [B, chunks, D], float32.
    let chunks = shape.seq_len.div_ceil(chunk);
    let rows = shape.batch * chunks * shape.channels;
    assert_eq!(
        scan.temporary_bytes(),
        4 * ((rows * shape.state).max(1) + rows.max(1)) as u64
    );
    // The dtype-typed tensors, launched and read back as `$t` (f32, or u16 holding bf16).
    macro_rules! run {
        ($t:ty) => {{
            let (u_d, b_d, c_d) = (up::<$t>(&u), up::<$t>(&b), up::<$t>(&c));
            let mut y_d = poisoned::<$t>(y_ref.len());
            scan.launch(
                g,
                &u_d,
                &delta_d,
                &a_d,
                &b_d,
                &c_d,
                skip.then_some(&d_d),
                start.then_some(&s0_d),
                &mut y_d.as_view_mut(),
                &mut fin,
            )
            .unwrap();
            down(&y_d)
        }};
    }
    let y: Vec<f64> = match dtype {
        Dtype::F32 => run!(f32),
        Dtype::Bf16 => run!(u16),
    };
    let fin = down(&fin);
    (
        super::rel_l2_with_tail(&y, &y_ref, shape.batch, shape.seq_len),
        rel_l2(&fin, &s_ref),
    )
}

#[test]
#[cfg_attr(not(kp_cuda), ignore = "needs an NVIDIA GPU (libcuda.so.1)")]
fn selective_scan_matches_float64_on_every_shape() {
    let cases = [
        // One step, one channel, one state entry (15 idle entries, 127 idle threads).
        shape(1, 1, 1, 1),
        // 1, 4, 8 and 16 threads per channel; channels not a multiple of a block's; T not a
        // multiple of anything.
        shape(2, 37, 13, 16),
        shape(2, 129, 20, 64),
        shape(3, 61, 19, 128),
        shape(1, 257, 10, 256),
        // N not a multiple of 16: 48 on 4 threads (4 idle entries each), 17 on 2 (15 idle
        // entries in all).
        shape(2, 50, 16, 48),
        shape(1, 70, 130, 17),
        // A long sequence: 1000 steps of accumulated float32 rounding.
        shape(1, 1000, 9, 16),
        // Issue 12's lengths around 64 and past 65,536.
        shape(1, 63, 4, 16),
        shape(1, 65, 4, 16),
        shape(1, 65_537, 2, 16),
    ];
    let mut failures = Vec::new();
    for (k, &s) in cases.iter().enumerate() {
        for dtype in [Dtype::F32, Dtype::Bf16] {
            // The chunk the host picks, and the shortest (32 steps: most chunks, the pass
            // between them longest, the last one partial).
            for chunk in [None, Some(32)] {
                for (skip, start) in [(false, false), (true, false), (false, true), (true, true)] {
                    let (ey, es) = scan_case(s, dtype, skip, start, 200 + k as u64, chunk);
                    // float32 arithmetic on exact inputs: 1e-4; bf16 output rounding: 1e-2.
                    let tol = if dtype == Dtype::F32 { 1e-4 } else { 1e-2 };
                    println!(
                        "selective_scan {s:?} {dtype:?} threads/channel {} chunk {chunk:?} D \
                         {skip} initial {start}: y {ey:.2e} state {es:.2e}",
                        threads_per_channel(s.state).unwrap()
                    );
                    if !(ey <= tol && es <= 1e-4) {
                        failures.push(format!(
                            "{s:?} {dtype:?} chunk {chunk:?} D {skip} initial {start}: y \
                             {ey:.2e}, state {es:.2e}"
                        ));
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
#[cfg_attr(not(kp_cuda), ignore = "needs an NVIDIA GPU (libcuda.so.1)")]
fn selective_scan_with_no_step_returns_the_initial_state() {
    let s = ScanShape {
        batch: 2,
        seq_len: 0,
        channels: 3,
        state: 16,
    };
    let (_, es) = scan_case(s, Dtype::F32, true, true, 7, None);
    assert_eq!(es, 0.0);
}

/// At the grid's shape (B4 T16384 D512 N16), every chunk length from 32 to 2048 steps gives
/// the same y and final state as the float64 recurrence, bf16 and fp32: the chunk only splits
/// the same float32 arithmetic differently. (Under ncu, its launches also time each length.)
#[test]
#[cfg_attr(not(kp_cuda), ignore = "needs an NVIDIA GPU (libcuda.so.1)")]
fn selective_scan_chunk_lengths_agree_at_the_grid_shape() {
    let shape = ScanShape {
        batch: 4,
        seq_len: 16_384,
        channels: 512,
        state: 16,
    };
    let mut failures = Vec::new();
    for dtype in [Dtype::F32, Dtype::Bf16] {
        for chunk in [32, 64, 128, 256, 512, 1024, 2048] {
            let (ey, es) = scan_case(shape, dtype, true, true, 300, Some(chunk));
            let tol = if dtype == Dtype::F32 { 1e-4 } else { 1e-2 };
            println!("selective_scan {dtype:?} chunk {chunk}: y {ey:.2e} state {es:.2e}");
            if !(ey <= tol && es <= 1e-4) {
                failures.push(format!(
                    "{dtype:?} chunk {chunk}: y {ey:.2e}, state {es:.2e}"
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
#[cfg_attr(
    not(kp_nvrtc),
    ignore = "needs NVRTC 13 (libnvrtc.so.13) on the loader path; .ci/run installs it"
)]
fn scan_kernels_compile_without_spills() {
    compiles_without_spills("scan.cu", &source(), &entry_points());
}

/// Fills every gradient buffer before a launch: du, dΔ and the initial state's gradient with
/// NaN (an element never written fails), dA, dB, dC and dD with 1000 (the launch must
/// overwrite them whole: version 1.1 added into them, version 2 writes them).
fn poison_gradients(grads: &mut ScanGradientBuffers) {
    for buf in [&mut grads.du, &mut grads.ddelta, &mut grads.d_initial_state] {
        let len = buf.len();
        *buf = poisoned::<f32>(len);
    }
    for buf in [&mut grads.da, &mut grads.db, &mut grads.dc, &mut grads.dd] {
        let len = buf.len();
        *buf = up::<f32>(&vec![1000.0; len]);
    }
}

/// One selective-scan backward on the device against the float64 adjoint
/// (`gradients::selective_scan_backward`) on the same rounded inputs and cotangents, with D,
/// an initial state and d_final_state when `optional`, without them otherwise: the largest
/// relative L2 error over the gradients, and which it was.
fn scan_backward_case(
    shape: ScanShape,
    dtype: Dtype,
    optional: bool,
    seed: u64,
) -> (f64, &'static str) {
    let g = gpu();
    let bt = shape.batch * shape.seq_len;
    let (ch, n) = (shape.channels, shape.state);
    let state_len = shape.batch * ch * n;
    let [u, delta, a, b, c, d, s0] = random_inputs(shape, seed);
    let dy = uniform(bt * ch, -1.0, 1.0, seed + 7);
    let dfin = uniform(state_len, -1.0, 1.0, seed + 8);
    let (ur, br, cr, dyr) = (
        rounded(dtype, &u),
        rounded(dtype, &b),
        rounded(dtype, &c),
        rounded(dtype, &dy),
    );
    let (deltar, ar, dr, s0r, dfinr) = (
        rounded_f32(&delta),
        rounded_f32(&a),
        rounded_f32(&d),
        rounded_f32(&s0),
        rounded_f32(&dfin),
    );
    let want = selective_scan_backward(
        shape,
        ScanInputs {
            u: &ur,
            delta: &deltar,
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
    let (delta_d, a_d, d_d, s0_d, dfin_d) = (
        up::<f32>(&delta),
        up::<f32>(&a),
        up::<f32>(&d),
        up::<f32>(&s0),
        up::<f32>(&dfin),
    );
    let mut grads = ScanGradientBuffers::new(g, shape).unwrap();
    poison_gradients(&mut grads);
    let mut bwd = ScanBackward::new(g, shape, dtype).unwrap();
    assert_eq!(bwd.chunk(), backward_chunk(n).unwrap());
    macro_rules! run {
        ($t:ty) => {{
            let (u_d, b_d, c_d, dy_d) = (up::<$t>(&u), up::<$t>(&b), up::<$t>(&c), up::<$t>(&dy));
            bwd.launch(
                g,
                &u_d,
                &delta_d,
                &a_d,
                &b_d,
                &c_d,
                optional.then_some(&d_d),
                optional.then_some(&s0_d),
                &dy_d,
                optional.then_some(&dfin_d),
                &mut grads,
            )
            .unwrap();
        }};
    }
    match dtype {
        Dtype::F32 => run!(f32),
        Dtype::Bf16 => run!(u16),
    }
    let zeros_d = vec![0.0; ch];
    let pairs: [(&'static str, Vec<f64>, &[f64]); 7] = [
        ("du", down(&grads.du), &want.du),
        ("ddelta", down(&grads.ddelta), &want.ddelta),
        ("da", down(&grads.da), &want.da),
        ("db", down(&grads.db), &want.db),
        ("dc", down(&grads.dc), &want.dc),
        // Without D the kernel leaves dD at the zeros the launch wrote.
        (
            "dd",
            down(&grads.dd),
            want.dd.as_deref().unwrap_or(&zeros_d),
        ),
        (
            "d_initial_state",
            down(&grads.d_initial_state),
            &want.d_initial_state,
        ),
    ];
    let mut worst = (0.0f64, "none");
    for (name, got, w) in pairs {
        let got = if w.is_empty() { Vec::new() } else { got };
        let e = if w.is_empty() { 0.0 } else { rel_l2(&got, w) };
        // A NaN (a non-finite gradient) counts as the worst error.
        let e = if e.is_nan() { f64::INFINITY } else { e };
        if e > worst.0 {
            worst = (e, name);
        }
    }
    worst
}

/// The backward on the device against the float64 adjoint: both dtypes (the kernel's
/// arithmetic is float32 either way, on the same rounded inputs), one and two states per lane,
/// one step, lengths around a chunk, channels not a multiple of the block's 8 warps, a long
/// sequence (125 chunks) and more channels than a chunk walk's block.
#[test]
#[cfg_attr(not(kp_cuda), ignore = "needs an NVIDIA GPU (libcuda.so.1)")]
fn selective_scan_backward_matches_float64() {
    let cases = [
        shape(1, 1, 1, 1),
        shape(2, 37, 13, 16),
        shape(2, 32, 16, 16),
        shape(1, 63, 9, 33),
        shape(2, 129, 20, 64),
        shape(1, 65, 4, 16),
        shape(1, 4000, 9, 16),
        // More channels than one chunk-walk block holds (128 at one thread per channel).
        shape(1, 100, 130, 16),
    ];
    let mut failures = Vec::new();
    for (k, &s) in cases.iter().enumerate() {
        for dtype in [Dtype::F32, Dtype::Bf16] {
            for optional in [true, false] {
                let (e, which) = scan_backward_case(s, dtype, optional, 300 + 10 * k as u64);
                println!(
                    "selective_scan backward {s:?} {dtype:?} D, h0, d_final {optional}: \
                     worst {which} {e:.2e}"
                );
                if e.is_nan() || e > 1e-4 {
                    failures.push(format!("{s:?} {dtype:?} {optional}: {which} {e:.2e}"));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// A state past `scan_cuda::MAX_BACKWARD_STATE` (64) is refused with the reason, not run.
#[test]
#[cfg_attr(not(kp_cuda), ignore = "needs an NVIDIA GPU (libcuda.so.1)")]
fn selective_scan_backward_refuses_a_state_past_64() {
    let s = ScanShape {
        batch: 1,
        seq_len: 8,
        channels: 2,
        state: 65,
    };
    let e = ScanBackward::new(gpu(), s, Dtype::F32)
        .err()
        .expect("refused");
    assert!(e.to_string().contains("more than the 64"), "{e}");
}

/// The backward at the grid's shape (B4, T16384, D512, N16), both dtypes: every gradient
/// finite and du not all zero (no float64 reference at this size: the shapes above check the
/// values). Run under ncu, it gives the backward kernel's time at the grid's shape.
#[test]
#[cfg_attr(not(kp_cuda), ignore = "needs an NVIDIA GPU (libcuda.so.1)")]
fn selective_scan_backward_at_the_grid_shape_is_finite() {
    let g = gpu();
    let s = ScanShape {
        batch: 4,
        seq_len: 16_384,
        channels: 512,
        state: 16,
    };
    let bt = s.batch * s.seq_len;
    let (ch, n) = (s.channels, s.state);
    for dtype in [Dtype::F32, Dtype::Bf16] {
        let delta = up::<f32>(&uniform(bt * ch, 0.01, 0.2, 1));
        let a = up::<f32>(&uniform(ch * n, -4.0, -0.5, 2));
        let d = up::<f32>(&uniform(ch, -1.0, 1.0, 3));
        let mut grads = ScanGradientBuffers::new(g, s).unwrap();
        let mut bwd = ScanBackward::new(g, s, dtype).unwrap();
        macro_rules! run {
            ($t:ty) => {{
                let u = up::<$t>(&uniform(bt * ch, -1.0, 1.0, 4));
                let b = up::<$t>(&uniform(bt * n, -1.0, 1.0, 5));
                let c = up::<$t>(&uniform(bt * n, -1.0, 1.0, 6));
                let dy = up::<$t>(&uniform(bt * ch, -1.0, 1.0, 7));
                for _ in 0..3 {
                    bwd.launch(
                        g,
                        &u,
                        &delta,
                        &a,
                        &b,
                        &c,
                        Some(&d),
                        None,
                        &dy,
                        None,
                        &mut grads,
                    )
                    .unwrap();
                }
            }};
        }
        match dtype {
            Dtype::F32 => run!(f32),
            Dtype::Bf16 => run!(u16),
        }
        let du = down(&grads.du);
        for (name, v) in [
            ("du", &du),
            ("ddelta", &down(&grads.ddelta)),
            ("da", &down(&grads.da)),
            ("db", &down(&grads.db)),
            ("dc", &down(&grads.dc)),
            ("dd", &down(&grads.dd)),
            ("d_initial_state", &down(&grads.d_initial_state)),
        ] {
            assert!(v.iter().all(|x| x.is_finite()), "{dtype:?} {name}");
        }
        assert!(du.iter().any(|&x| x != 0.0), "{dtype:?}");
        println!(
            "selective_scan backward {s:?} {dtype:?}: finite; scratch {} MB",
            bwd.temporary_bytes() as f64 / 1e6
        );
    }
}

/// No step: the initial state's gradient is d_final_state, dA and dD are zero.
#[test]
#[cfg_attr(not(kp_cuda), ignore = "needs an NVIDIA GPU (libcuda.so.1)")]
fn selective_scan_backward_with_no_step_passes_d_final_state_back() {
    let g = gpu();
    let s = ScanShape {
        batch: 2,
        seq_len: 0,
        channels: 3,
        state: 16,
    };
    let state_len = s.batch * s.channels * s.state;
    let dfin = uniform(state_len, -1.0, 1.0, 9);
    let empty = up::<f32>(&[]);
    let a = up::<f32>(&uniform(s.channels * s.state, -4.0, -0.5, 10));
    let mut grads = ScanGradientBuffers::new(g, s).unwrap();
    poison_gradients(&mut grads);
    let mut bwd = ScanBackward::new(g, s, Dtype::F32).unwrap();
    bwd.launch(
        g,
        &empty,
        &empty,
        &a,
        &empty,
        &empty,
        None,
        None,
        &empty,
        Some(&up::<f32>(&dfin)),
        &mut grads,
    )
    .unwrap();
    assert_eq!(down(&grads.d_initial_state), rounded_f32(&dfin));
    assert!(down(&grads.da).iter().all(|&x| x == 0.0));
    assert!(down(&grads.dd).iter().all(|&x| x == 0.0));
}
