//! GPU correctness of the kernel-sum kernels (`kernels/kernel_sums/kernel_sums.cu`) against the
//! float64 definition (`kernel_sums::reference_rows`).
//!
//! Runs on a machine with an NVIDIA GPU. Where build.rs found no CUDA driver (`kp_cuda`), the
//! tests are compiled as ignored, with the reason; on the GPU machine run them with
//! `cargo test --release --test gpu_kernel_sums -- --include-ignored --test-threads 1`.
//! `kernel_sums::cuda::compute` fills every output with NaN before its launch, so an element the
//! kernel never writes fails the finiteness check; rows are compared all for small N, sampled
//! (first, last, around every block edge, and a stride) for large N. Each test prints one line
//! per case (`--nocapture`) and a failing test names every failing case.

use std::sync::OnceLock;

use kernelpages::attention::rel_l2;
use kernelpages::gpu::{self, Gpu};
use kernelpages::kernel_sums::{self, cuda, reference_rows, Inputs, KernelSumCase, Op, Scale};

/// One device for the whole test binary, so each entry point compiles once.
fn gpu() -> &'static Gpu {
    static GPU: OnceLock<Gpu> = OnceLock::new();
    GPU.get_or_init(|| {
        if let Err(e) = gpu::detect() {
            panic!("{e}");
        }
        Gpu::open(0).expect("device opens")
    })
}

/// The rows compared: all up to 64, otherwise the first and last, both sides of every block
/// edge the kernels have (128 and 256 rows per block), and every 37th row.
fn sample_rows(n: usize) -> Vec<usize> {
    if n <= 64 {
        return (0..n).collect();
    }
    let mut rows: Vec<usize> = [0, 1, 127, 128, 129, 255, 256, 257, 511, 512, 513]
        .into_iter()
        .chain((0..n).step_by(37))
        .chain([n - 2, n - 1])
        .filter(|&i| i < n)
        .collect();
    rows.sort_unstable();
    rows.dedup();
    rows
}

/// The device output's values at `rows`, laid out as `reference_rows` lays them out.
fn gather(c: &KernelSumCase, out: &[f32], rows: &[usize]) -> Vec<f64> {
    let per_row = if c.op == Op::RbfMv { c.cols } else { 1 };
    let mut v: Vec<f64> = rows
        .iter()
        .flat_map(|&i| out[i * per_row..(i + 1) * per_row].iter())
        .map(|&x| x as f64)
        .collect();
    if c.grad {
        let (n, d) = (c.n, c.dim);
        v.extend(
            rows.iter()
                .flat_map(|&i| out[n + i * d..n + (i + 1) * d].iter())
                .map(|&x| x as f64),
        );
    }
    v
}

/// Relative L2 error of the device result of `c` on `inp` against float64, over the sampled
/// rows (the gradient separately, the larger of the two is returned). Every output element
/// must be finite (the output was poisoned with NaN).
fn error(c: &KernelSumCase, inp: &Inputs, s: Scale) -> Result<f64, String> {
    let out = cuda::compute(gpu(), c, inp, s).map_err(|e| e.to_string())?;
    if out.len() != c.output_len() {
        return Err(format!("{} outputs, want {}", out.len(), c.output_len()));
    }
    if let Some(k) = out.iter().position(|v| !v.is_finite()) {
        return Err(format!("output element {k} is {}", out[k]));
    }
    let rows = sample_rows(c.n);
    let want = reference_rows(c, inp, s, &rows);
    let got = gather(c, &out, &rows);
    Ok(if c.grad {
        let r = rows.len();
        rel_l2(&got[..r], &want[..r]).max(rel_l2(&got[r..], &want[r..]))
    } else {
        rel_l2(&got, &want)
    })
}

fn label(c: &KernelSumCase) -> String {
    format!(
        "{} N{} M{} D{} C{}{}",
        c.op.as_str(),
        c.n,
        c.m,
        c.dim,
        c.cols,
        if c.grad { " +grad" } else { "" }
    )
}

/// The bar for float32 is 1e-5 relative to float64. `kde` in many dimensions is the
/// exception `cpu.rs`'s test explains: Scott's bandwidth σ makes the typical exponent
/// E = E‖x − y‖² / 2σ² = (dim / 6) / 2σ² (points uniform in the unit cube) large, 45–120 at
/// dim 64 and ~140 at dim 130, and a float32 squared distance (relative error a few 1e-7,
/// whatever the order of the sums) moves each kernel value by about 1e-6·E. The bound allows
/// 4e-6·E on top of 1e-5 (measured on the H200: 1.9e-4 at dim 130, E ≈ 140).
fn tolerance(c: &KernelSumCase, s: Scale) -> f64 {
    if c.op == Op::Kde && c.dim > 16 {
        let typical_exponent = c.dim as f64 / 6.0 / (2.0 * s.sigma * s.sigma);
        1e-5 + 4e-6 * typical_exponent
    } else {
        1e-5
    }
}

/// Runs every case on fresh random inputs with the case's own scale; panics naming every
/// failing case.
fn check_cases(cases: &[KernelSumCase], seed: u64) {
    let mut failures = Vec::new();
    for (k, c) in cases.iter().enumerate() {
        let inp = Inputs::random(c, seed + 10 * k as u64);
        let s = Scale::of(c, &inp);
        let entry = cuda::entry_point(c).map(|p| p.entry).unwrap_or_default();
        match error(c, &inp, s) {
            Ok(e) => {
                eprintln!("{} ({entry}): {e:.2e}", label(c));
                if e.is_nan() || e > tolerance(c, s) {
                    failures.push(format!("{} ({entry}): error {e:.2e}", label(c)));
                }
            }
            Err(e) => failures.push(format!("{} ({entry}): {e}", label(c))),
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

/// Every op at N, M ∈ {1, 7, 1025} (equal and different), D ∈ {1, 3, 16, 64}, C ∈ {1, 3, 64}
/// for rbf_mv, and kernel_lse with and without the gradient.
#[test]
#[cfg_attr(not(kp_cuda), ignore = "needs an NVIDIA GPU (libcuda.so.1)")]
fn every_op_matches_float64() {
    let mut cases = Vec::new();
    for n in [1, 7, 1025] {
        for m in [1, 7, 1025] {
            for dim in [1, 3, 16, 64] {
                for cols in [1, 3, 64] {
                    cases.push(KernelSumCase {
                        cols,
                        ..KernelSumCase::new(Op::RbfMv, n, m, dim)
                    });
                }
                cases.push(KernelSumCase::new(Op::Kde, n, m, dim));
                for grad in [false, true] {
                    cases.push(KernelSumCase {
                        grad,
                        ..KernelSumCase::new(Op::KernelLse, n, m, dim)
                    });
                }
            }
        }
    }
    check_cases(&cases, 1);
}

/// The entry points and tiles the main grid does not reach: D = 2 (its own kernels, split and
/// not), D = 5 and 128 (the tensor-core kernels with the features padded to 8, split and not,
/// and at their largest dimension), D = 130 (the generic kernels with a feature chunk cut short, and several
/// chunks), column counts needing 4-, 16- and several 64-column tiles, and N, M off every tile
/// size.
#[test]
#[cfg_attr(not(kp_cuda), ignore = "needs an NVIDIA GPU (libcuda.so.1)")]
fn other_dimensions_and_column_tiles() {
    let mut cases = Vec::new();
    for dim in [2, 5, 128, 130] {
        let (n, m) = (300, 161);
        for cols in [1, 2, 4, 16, 17, 130] {
            cases.push(KernelSumCase {
                cols,
                ..KernelSumCase::new(Op::RbfMv, n, m, dim)
            });
        }
        // Past 64 dimensions Scott's bandwidth on 161 points puts even the nearest pair's
        // exponent near 85 (e^-85 ≈ 1e-37): the unnormalised sums the KDE kernels accumulate
        // fall below float32's smallest normal number and flush to 0 although the densities
        // (~1e-34 after the normalisation) are representable. A known limit of the kernels
        // (kernels/TUNING-kernel-sums.md), not a float32 result to hold them to.
        if dim <= 64 {
            cases.push(KernelSumCase::new(Op::Kde, n, m, dim));
        }
        for grad in [false, true] {
            cases.push(KernelSumCase {
                grad,
                ..KernelSumCase::new(Op::KernelLse, n, m, dim)
            });
        }
    }
    // The split matvec and KDE at D = 2 (few row blocks, Y in parts: the main grid's
    // M = 1025 splits D = 1 and 3), the last part short.
    for m in [1000, 1300] {
        let plan = cuda::entry_point(&KernelSumCase::new(Op::Kde, 300, m, 2)).unwrap();
        assert!(plan.splits > 1, "{plan:?}");
        cases.push(KernelSumCase::new(Op::RbfMv, 300, m, 2));
        cases.push(KernelSumCase::new(Op::Kde, 300, m, 2));
    }
    // The split tensor-core kernels with the features padded to 8 (D = 5): few row blocks,
    // Y in parts, the last short.
    for m in [1000, 1300] {
        let plan = cuda::entry_point(&KernelSumCase::new(Op::KernelLse, 300, m, 5)).unwrap();
        assert!(plan.splits > 1 && plan.entry.ends_with("_tc"), "{plan:?}");
        cases.push(KernelSumCase::new(Op::RbfMv, 300, m, 5));
        cases.push(KernelSumCase::new(Op::Kde, 300, m, 5));
        cases.push(KernelSumCase::new(Op::KernelLse, 300, m, 5));
    }
    // Rows per block 256 and 128: one past, one short.
    for (n, m) in [(257, 129), (129, 257), (255, 33)] {
        for dim in [3, 16] {
            cases.push(KernelSumCase {
                grad: true,
                ..KernelSumCase::new(Op::KernelLse, n, m, dim)
            });
            cases.push(KernelSumCase {
                cols: 64,
                ..KernelSumCase::new(Op::RbfMv, n, m, dim)
            });
        }
    }
    check_cases(&cases, 2);
}

/// The public `kde` in the dimensions where the KDE kernels' terms flush to 0 (D = 128, 130 on
/// 161 points, Scott's bandwidth; D = 3 with a point far from the cloud): the rows it
/// recomputes through the log-sum-exp match float64 row by row, and `log_kde` matches the
/// float64 logarithm.
#[test]
#[cfg_attr(not(kp_cuda), ignore = "needs an NVIDIA GPU (libcuda.so.1)")]
fn kde_recovers_rows_whose_terms_underflow() {
    let mut failures = Vec::new();
    for (dim, far) in [(128, false), (130, false), (3, true)] {
        let c = KernelSumCase::new(Op::Kde, 300, 161, dim);
        let mut inp = Inputs::random(&c, 40 + dim as u64);
        if far {
            // Row 5 moved 3 along every axis, out of the unit cube: each of its terms, and its
            // density, is far below float32's range; only its logarithm is checked.
            inp.x[5 * dim..6 * dim].iter_mut().for_each(|v| *v += 3.0);
        }
        let s = Scale::of(&c, &inp);
        let mut rows = sample_rows(c.n);
        if far {
            rows.push(5);
        }
        let want = reference_rows(&c, &inp, s, &rows);
        if !far {
            // The kernel alone loses rows here (what the recovery is for).
            let kernel = cuda::compute(gpu(), &c, &inp, s).unwrap();
            let lost = rows
                .iter()
                .zip(&want)
                .filter(|(&i, &w)| ((kernel[i] as f64 - w) / w).abs() > 1e-3)
                .count();
            if lost == 0 {
                failures.push(format!("D{dim}: the kernel alone kept every row"));
            }
        }
        let device = gpu::Device::Cuda(gpu());
        let got = kernel_sums::kde(device, &inp.x, &inp.y, dim, None).unwrap();
        let logs = kernel_sums::log_kde(device, &inp.x, &inp.y, dim, None).unwrap();
        let tol = 4.0 * tolerance(&c, s);
        let (mut worst, mut worst_log) = (0.0f64, 0.0f64);
        for (&i, w) in rows.iter().zip(&want) {
            if (*w as f32).is_normal() {
                worst = worst.max(((got[i] as f64 - w) / w).abs());
            }
            worst_log = worst_log.max((logs[i] as f64 - w.ln()).abs() / w.ln().abs().max(1.0));
        }
        eprintln!(
            "kde() D{dim}{}: density {worst:.2e}, log {worst_log:.2e}",
            if far { " far row" } else { "" }
        );
        if !(worst <= tol && worst_log <= tol) {
            failures.push(format!(
                "D{dim}: density {worst:.2e}, log {worst_log:.2e} > {tol:.2e}"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Weights spread over ±1e4: the running maximum keeps every row finite and exact to 1e-6
/// relative (a direct exp would overflow), on the point-cloud and the generic kernels, and the
/// gradient stays finite. Also weights rising by 0.1 nat a point (2.3 octaves a chunk of 16),
/// which the small-D kernel's lazy step (terms summed against a stale maximum, up to
/// KS_LSE_LAZY_MAX = 2^8) serves for a few chunks at a time before a chunk's sum passes its
/// bound and the exact step catches up: split over Y at 300 rows, and unsplit (the path of the
/// grid's largest N) at SPLIT_TARGET_BLOCKS row blocks and more.
#[test]
#[cfg_attr(not(kp_cuda), ignore = "needs an NVIDIA GPU (libcuda.so.1)")]
fn log_sum_exp_survives_a_wide_spread() {
    let fills: [fn(usize) -> f32; 2] = [
        |j| if j % 2 == 0 { 1e4 } else { -1e4 } * (j as f32 / 700.0),
        |j| 0.1 * j as f32,
    ];
    for (dim, grad, fill) in [3, 16]
        .into_iter()
        .flat_map(|d| [(d, false), (d, true)])
        .flat_map(|(d, g)| fills.map(|f| (d, g, f)))
    {
        let c = KernelSumCase {
            grad,
            ..KernelSumCase::new(Op::KernelLse, 300, 700, dim)
        };
        let mut inp = Inputs::random(&c, 3);
        for (j, g) in inp.w.iter_mut().enumerate() {
            *g = fill(j);
        }
        let s = Scale::of(&c, &inp);
        let out = cuda::compute(gpu(), &c, &inp, s).unwrap();
        let want = reference_rows(&c, &inp, s, &(0..c.n).collect::<Vec<_>>());
        for (i, (g, w)) in out[..c.n].iter().zip(&want).enumerate() {
            assert!(g.is_finite(), "D{dim} row {i}: {g}");
            assert!(
                ((*g as f64 - w) / w).abs() < 1e-6,
                "D{dim} row {i}: {g} vs {w}"
            );
        }
        assert!(out.iter().all(|v| v.is_finite()), "D{dim} grad {grad}");
    }
    let n = cuda::SPLIT_TARGET_BLOCKS * 256 + 5;
    let c = KernelSumCase::new(Op::KernelLse, n, 700, 3);
    assert_eq!(
        cuda::y_splits(n.div_ceil(256), c.m).0,
        1,
        "the unsplit kernel"
    );
    let mut inp = Inputs::random(&c, 4);
    for (j, g) in inp.w.iter_mut().enumerate() {
        *g = fills[1](j);
    }
    let s = Scale::of(&c, &inp);
    let out = cuda::compute(gpu(), &c, &inp, s).unwrap();
    let rows = sample_rows(n);
    let want = reference_rows(&c, &inp, s, &rows);
    for (&i, w) in rows.iter().zip(&want) {
        let g = out[i] as f64;
        assert!(((g - w) / w).abs() < 1e-6, "unsplit row {i}: {g} vs {w}");
    }
}

/// Weights of −∞ (a point that must not count): the first 200 points of Y are excluded, so
/// each row's first chunks and tiles hold no finite term (the −∞ maximum guard) before the
/// rest arrives; a row whose every weight is −∞ gets −∞, as on the CPU.
#[test]
#[cfg_attr(not(kp_cuda), ignore = "needs an NVIDIA GPU (libcuda.so.1)")]
fn log_sum_exp_skips_minus_infinity() {
    for dim in [3, 16] {
        let c = KernelSumCase {
            grad: true,
            ..KernelSumCase::new(Op::KernelLse, 150, 450, dim)
        };
        let mut inp = Inputs::random(&c, 5);
        inp.w[..200].fill(f32::NEG_INFINITY);
        let s = Scale::of(&c, &inp);
        let e = error(&c, &inp, s).unwrap_or_else(|e| panic!("D{dim}: {e}"));
        assert!(e <= 1e-5, "D{dim}: error {e:.2e}");

        all_minus_infinity(
            &KernelSumCase::new(Op::KernelLse, 20, 40, dim),
            6,
            &format!("D{dim}"),
        );
    }
    // The split log-sum-exp (few rows, many points): a first part of only −∞ weights, and
    // every weight −∞ (each part's maximum −∞, merged to −∞, not NaN).
    let c = KernelSumCase::new(Op::KernelLse, 150, 900, 3);
    let plan = cuda::entry_point(&c).unwrap();
    assert!(plan.splits > 1 && plan.split_len <= 400, "{plan:?}");
    let mut inp = Inputs::random(&c, 7);
    inp.w[..400].fill(f32::NEG_INFINITY);
    let s = Scale::of(&c, &inp);
    let e = error(&c, &inp, s).unwrap_or_else(|e| panic!("split: {e}"));
    assert!(e <= 1e-5, "split: error {e:.2e}");
    let c = KernelSumCase::new(Op::KernelLse, 20, 600, 3);
    assert!(cuda::entry_point(&c).unwrap().splits > 1);
    all_minus_infinity(&c, 8, "split");
}

/// Log-sum-exp case `c` with every weight −∞ (inputs from `seed`): every output is −∞, not NaN.
fn all_minus_infinity(c: &KernelSumCase, seed: u64, what: &str) {
    let mut inp = Inputs::random(c, seed);
    inp.w.fill(f32::NEG_INFINITY);
    let s = Scale::of(c, &inp);
    let out = cuda::compute(gpu(), c, &inp, s).unwrap();
    assert!(
        out.iter().all(|&v| v == f32::NEG_INFINITY),
        "{what}: {out:?}"
    );
}

/// A runner launched twice into the same output gives the same values: nothing accumulates
/// into the output across calls (the generic gradient uses its output rows as accumulators and
/// must clear them first).
#[test]
#[cfg_attr(not(kp_cuda), ignore = "needs an NVIDIA GPU (libcuda.so.1)")]
fn repeated_launches_overwrite_the_output() {
    let gpu = gpu();
    for c in [
        KernelSumCase {
            grad: true,
            ..KernelSumCase::new(Op::KernelLse, 300, 100, 16)
        },
        KernelSumCase {
            grad: true,
            ..KernelSumCase::new(Op::KernelLse, 300, 100, 3)
        },
        KernelSumCase {
            cols: 3,
            ..KernelSumCase::new(Op::RbfMv, 300, 100, 3)
        },
    ] {
        let inp = Inputs::random(&c, 9);
        let s = Scale::of(&c, &inp);
        let mut runner = cuda::Runner::new(gpu, &c).unwrap();
        let dev = cuda::upload(gpu, &c, &inp).unwrap();
        let mut out = gpu
            .stream
            .clone_htod(&vec![f32::NAN; c.output_len()])
            .unwrap();
        runner.launch(gpu, &c, s, &dev, &mut out).unwrap();
        let first = gpu.stream.clone_dtoh(&out).unwrap();
        runner.launch(gpu, &c, s, &dev, &mut out).unwrap();
        let second = gpu.stream.clone_dtoh(&out).unwrap();
        assert_eq!(first, second, "{}", label(&c));
        assert!(first.iter().all(|v| v.is_finite()), "{}", label(&c));
    }
}

/// `len` points uniform in [0, 1)^dim and weights 0.2 + U[0, 1), normalised (an LCG; the
/// values need only be fixed, not of any quality).
fn cloud(len: usize, dim: usize, seed: u64) -> (Vec<f32>, Vec<f64>) {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut unit = move || {
        s = s
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (s >> 11) as f64 / (1u64 << 53) as f64
    };
    let points = (0..len * dim).map(|_| unit() as f32).collect();
    let w: Vec<f64> = (0..len).map(|_| 0.2 + unit()).collect();
    let sum: f64 = w.iter().sum();
    (points, w.iter().map(|v| v / sum).collect())
}

/// Sinkhorn with its kernel sums on the device (`sinkhorn_on(Device::Cuda)`) against the same
/// solver on the CPU: the 100 × 150 points in [0, 1]^5 at ε = 1e-1 down to 1e-3. Both
/// converge (the float64 confirmation runs on the host either way), the device's marginal error
/// meets the tolerance, and the two transport costs agree within 1e-3 relative (the kernel sums
/// round differently: CUDA's ex2.approx and tile order against the CPU's exp); the cost does
/// not increase as ε shrinks. The debiased divergence of a cloud with itself is 0 within 1e-6.
#[test]
#[cfg_attr(not(kp_cuda), ignore = "needs an NVIDIA GPU (libcuda.so.1)")]
fn sinkhorn_on_the_device_matches_the_cpu() {
    use kernelpages::gpu::Device;
    use kernelpages::kernel_sums::sinkhorn::{
        sinkhorn, sinkhorn_divergence_on, sinkhorn_on, Cloud, Params, Status,
    };
    let dim = 5;
    let (xp, xw) = cloud(100, dim, 1);
    let (yp, yw) = cloud(150, dim, 2);
    let (x, y) = (Cloud::new(&xp, &xw), Cloud::new(&yp, &yw));
    let mut last_cost = f64::INFINITY;
    for eps in [1e-1, 1e-2, 1e-3] {
        let p = Params::new(eps);
        let cpu = sinkhorn(x, y, dim, &p).unwrap();
        let dev = sinkhorn_on(Device::Cuda(gpu()), x, y, dim, &p).unwrap();
        eprintln!(
            "eps {eps:e}: cpu {:?} {} it, cost {:.8}, err {:.2e}; device {:?} {} it, cost {:.8}, err {:.2e}",
            cpu.status,
            cpu.iterations,
            cpu.transport_cost,
            cpu.marginal_error,
            dev.status,
            dev.iterations,
            dev.transport_cost,
            dev.marginal_error
        );
        assert_eq!(cpu.status, Status::Converged);
        assert_eq!(dev.status, Status::Converged);
        assert!(dev.marginal_error <= p.tol, "{dev:?}");
        assert!(dev.f.iter().chain(&dev.g).all(|v| v.is_finite()));
        let rel = (dev.transport_cost - cpu.transport_cost).abs() / cpu.transport_cost;
        assert!(rel <= 1e-3, "eps {eps}: costs differ by {rel:.2e}");
        assert!(
            dev.transport_cost <= last_cost * (1.0 + 1e-9),
            "cost rose as eps fell"
        );
        last_cost = dev.transport_cost;
    }
    let own = sinkhorn_divergence_on(Device::Cuda(gpu()), x, x, dim, &Params::new(0.1)).unwrap();
    eprintln!("S(x, x) on the device at eps 0.1: {:e}", own.value);
    assert!(own.value.abs() <= 1e-6, "{own:?}");
}

/// Sinkhorn's iteration held on the device (`sinkhorn::device_iterations`): after one step, f
/// against its float64 definition (`first_step_reference`, the runner's check) within 1e-5 at
/// ε = 2.5e-3 (the runner's) and 1e-2; then two more steps replayed from a CUDA graph of one
/// step (the runner's timing: nothing in a step may wait on the host), f and g against the
/// CPU's `SinkhornIterations` after the same three steps. Clouds of 1000 and 700 points: not
/// multiples of any tile.
#[test]
#[cfg_attr(not(kp_cuda), ignore = "needs an NVIDIA GPU (libcuda.so.1)")]
fn sinkhorn_iterations_held_on_the_device_match() {
    use kernelpages::gpu::Device;
    use kernelpages::kernel_sums::sinkhorn::{
        device_iterations, first_step_reference, Cloud, SinkhornIterations,
    };
    let dim = 3;
    let (xp, xw) = cloud(1000, dim, 3);
    let (yp, yw) = cloud(700, dim, 4);
    let (x, y) = (Cloud::new(&xp, &xw), Cloud::new(&yp, &yw));
    let rel = |a: &[f64], b: &[f64]| {
        let num: f64 = a.iter().zip(b).map(|(p, q)| (p - q) * (p - q)).sum();
        let den: f64 = b.iter().map(|q| q * q).sum();
        (num / den).sqrt()
    };
    let g = gpu();
    for eps in [2.5e-3, 1e-2] {
        let mut dev = device_iterations(g, x, y, dim, eps).unwrap();
        let mut copy = g.poisoned_u16(4 * 1000).unwrap();
        dev.step(g, Some(&mut copy)).unwrap();
        let (f1, _) = dev.potentials(g).unwrap();
        let rows: Vec<usize> = (0..1000).collect();
        let want = first_step_reference(x, y, dim, eps, &rows);
        let e1 = rel(&f1, &want);
        // The copy the runner checks is f itself.
        let words = g.stream.clone_dtoh(&copy).unwrap();
        let copied: Vec<f64> = (0..1000)
            .map(|i| kernelpages::runner::protocol::decode("fp64", &words, i))
            .collect();
        assert_eq!(copied, f1, "eps {eps}: the copy is not f");
        let graph = g
            .capture(|| dev.step(g, None))
            .unwrap()
            .expect("a step records launches");
        for _ in 0..2 {
            graph.launch().unwrap();
        }
        let (f3, g3) = dev.potentials(g).unwrap();
        let mut cpu = SinkhornIterations::new(Device::Cpu, x, y, dim, eps).unwrap();
        for _ in 0..3 {
            cpu.step().unwrap();
        }
        let (cf, cg) = cpu.potentials();
        let (ef, eg) = (rel(&f3, cf), rel(&g3, cg));
        eprintln!(
            "eps {eps:e}: f1 vs float64 {e1:.2e}; after 3 steps f {ef:.2e}, g {eg:.2e} vs the CPU"
        );
        assert!(e1 <= 1e-5, "eps {eps}: f1 off by {e1:.2e}");
        assert!(
            ef <= 1e-4 && eg <= 1e-4,
            "eps {eps}: f {ef:.2e}, g {eg:.2e}"
        );
    }
}

/// The float64 row pass of a Sinkhorn plan on the device (`cuda::sinkhorn_row_pass`, what a
/// solve's convergence confirmation and final evaluation run on a GPU) against the same sums
/// written out here in float64: 300 rows against 1000 points (not a multiple of the 32 lanes)
/// in 3 and 5 dimensions, β spread over ±20 with some −∞, with and without the column weights;
/// a row whose every β is −∞ gives (−∞, 0, 0). Agreement to 1e-12 relative (only the order of
/// the float64 sums differs).
#[test]
#[cfg_attr(not(kp_cuda), ignore = "needs an NVIDIA GPU (libcuda.so.1)")]
fn sinkhorn_row_pass_matches_float64_on_the_host() {
    let g = gpu();
    for dim in [3, 5] {
        let (x, _) = cloud(300, dim, 11);
        let (z, w) = cloud(1000, dim, 12);
        let eps = 0.05;
        let beta: Vec<f64> = (0..1000)
            .map(|j| {
                if j % 97 == 5 {
                    f64::NEG_INFINITY
                } else {
                    20.0 * ((j as f64 * 0.37).sin())
                }
            })
            .collect();
        for weights in [None, Some(&w[..])] {
            let got = cuda::sinkhorn_row_pass(g, &x, &z, dim, &beta, eps, weights).unwrap();
            assert_eq!(got.len(), 300);
            for (i, row) in got.iter().enumerate() {
                let xi = &x[i * dim..(i + 1) * dim];
                let cost: Vec<f64> = z
                    .chunks_exact(dim)
                    .map(|zj| {
                        0.5 * xi
                            .iter()
                            .zip(zj)
                            .map(|(a, b)| (*a as f64 - *b as f64).powi(2))
                            .sum::<f64>()
                    })
                    .collect();
                let mx = cost
                    .iter()
                    .zip(&beta)
                    .map(|(c, b)| b - c / eps)
                    .fold(f64::NEG_INFINITY, f64::max);
                let (mut s, mut sc) = (0.0, 0.0);
                for (c, b) in cost.iter().zip(&beta) {
                    let e = (b - c / eps - mx).exp();
                    s += e;
                    sc += e * c;
                }
                let wc: f64 =
                    weights.map_or(0.0, |w| w.iter().zip(&cost).map(|(a, c)| a * c).sum());
                let want = (mx + s.ln(), sc / s, wc);
                let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 * b.abs().max(1.0);
                assert!(
                    close(row.0, want.0) && close(row.1, want.1) && close(row.2, want.2),
                    "dim {dim} row {i}: {row:?} vs {want:?}"
                );
            }
        }
        let none = vec![f64::NEG_INFINITY; 1000];
        let got = cuda::sinkhorn_row_pass(g, &x[..dim], &z, dim, &none, eps, Some(&w)).unwrap();
        assert_eq!(got, [(f64::NEG_INFINITY, 0.0, 0.0)]);
    }
}
