//! Mamba's selective scan on the device (`sequence_mixers::scan_cuda`) against the float64
//! recurrence (`reference::selective_scan`), and the NVRTC compile of its source.

use kernelpages::sequence_mixers::cuda::Dtype;
use kernelpages::sequence_mixers::reference::{self, ScanInputs, ScanShape};
use kernelpages::sequence_mixers::scan_cuda::{entry_points, source, states_per_lane, Scan};

use super::{
    compiles_without_spills, down, gpu, poisoned, rel_l2, rounded, rounded_f32, uniform, up,
};

/// One selective-scan case on the device against the float64 recurrence on the same (rounded)
/// inputs: returns (error of y, error of the final state).
fn scan_case(shape: ScanShape, dtype: Dtype, skip: bool, start: bool, seed: u64) -> (f64, f64) {
    let g = gpu();
    let bt = shape.batch * shape.seq_len;
    let (ch, n) = (shape.channels, shape.state);
    let u = uniform(bt * ch, -1.0, 1.0, seed);
    let delta = uniform(bt * ch, 0.01, 0.2, seed + 1);
    let a = uniform(ch * n, -4.0, -0.5, seed + 2);
    let b = uniform(bt * n, -1.0, 1.0, seed + 3);
    let c = uniform(bt * n, -1.0, 1.0, seed + 4);
    let d = uniform(ch, -1.0, 1.0, seed + 5);
    let state_len = shape.batch * ch * n;
    let s0 = uniform(state_len, -1.0, 1.0, seed + 6);
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
    let mut scan = Scan::new(g, shape, dtype).unwrap();
    assert_eq!(scan.temporary_bytes(), 0);
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
    (rel_l2(&y, &y_ref), rel_l2(&fin, &s_ref))
}

#[test]
#[cfg_attr(not(kp_cuda), ignore = "needs an NVIDIA GPU (libcuda.so.1)")]
fn selective_scan_matches_float64_on_every_shape() {
    let shape = |batch, seq_len, channels, state| ScanShape {
        batch,
        seq_len,
        channels,
        state,
    };
    let cases = [
        // One step, one channel, one state entry (31 idle lanes, 7 idle warps).
        shape(1, 1, 1, 1),
        // States per lane 1 (half the lanes idle), 2, 4 and 8; channels not a multiple of the
        // block's 8 warps; T not a multiple of anything.
        shape(2, 37, 13, 16),
        shape(2, 129, 20, 64),
        shape(3, 61, 19, 128),
        shape(1, 257, 10, 256),
        // N not a multiple of 32 (two entries on lanes 0..15, one on the rest), whole blocks.
        shape(2, 50, 16, 48),
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
            for (skip, start) in [(false, false), (true, false), (false, true), (true, true)] {
                let (ey, es) = scan_case(s, dtype, skip, start, 200 + k as u64);
                // float32 arithmetic on exact inputs: 1e-4; bf16 output rounding: 1e-2.
                let tol = if dtype == Dtype::F32 { 1e-4 } else { 1e-2 };
                println!(
                    "selective_scan {s:?} {dtype:?} states/lane {} D {skip} initial {start}: \
                     y {ey:.2e} state {es:.2e}",
                    states_per_lane(s.state).unwrap()
                );
                if !(ey <= tol && es <= 1e-4) {
                    failures.push(format!(
                        "{s:?} {dtype:?} D {skip} initial {start}: y {ey:.2e}, state {es:.2e}"
                    ));
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
    let (_, es) = scan_case(s, Dtype::F32, true, true, 7);
    assert_eq!(es, 0.0);
}

#[test]
#[cfg_attr(
    not(kp_nvrtc),
    ignore = "needs NVRTC 13 (libnvrtc.so.13) on the loader path; .ci/run installs it"
)]
fn scan_kernels_compile_without_spills() {
    compiles_without_spills("scan.cu", &source(), &entry_points());
}
