//! Balanced entropic optimal transport between two weighted point clouds, in the log domain,
//! on top of the float32 kernel log-sum-exp ([`cpu::kernel_lse`] on the CPU, the CUDA kernels
//! through [`cuda::LseSession`] on a GPU: never an N × M matrix), and the debiased Sinkhorn
//! divergence. [`sinkhorn_on`] and [`sinkhorn_divergence_on`] take the device; on CUDA the
//! kernel sums move there (the clouds uploaded once, the weights and the results copied each
//! call) and so do the float64 passes over the pairs (the convergence confirmation and the
//! final evaluation, [`cuda::sinkhorn_row_pass`]); the float64 potentials stay on the host.
//!
//! # The problem
//! Clouds α = Σ_i a_i δ(x_i) and β = Σ_j b_j δ(y_j): points x `[n, dim]` and y `[m, dim]`
//! row-major float32, weights a `[n]` and b `[m]` float64, non-negative, each summing to 1.
//! The cost is **C(x, y) = ‖x − y‖² / 2**, in squared units of the coordinates; ε, the
//! potentials f, g and every value returned are in the same unit. The entropic transport
//! problem (Cuturi 2013, "Sinkhorn Distances: Lightspeed Computation of Optimal Transport",
//! NeurIPS; written as in Feydy et al. 2019, "Interpolating between Optimal Transport and MMD
//! using Sinkhorn Divergences", AISTATS) is
//!
//! OT_ε(α, β) = min over couplings π of (a, b) of ⟨π, C⟩ + ε KL(π | a ⊗ b),
//!
//! with the dual
//!
//! OT_ε(α, β) = max over f `[n]`, g `[m]` of ⟨a, f⟩ + ⟨b, g⟩ − ε ⟨a ⊗ b, exp((f ⊕ g − C)/ε) − 1⟩,
//!
//! whose optimum gives the plan π_ij = a_i b_j exp((f_i + g_j − C(x_i, y_j))/ε). At the optimum
//! the plan has mass 1, so OT_ε = ⟨a, f⟩ + ⟨b, g⟩.
//!
//! # The iteration
//! Sinkhorn's alternating updates, in the log domain (the "soft-min" form: no kernel matrix,
//! no scaling vectors that overflow; Schmitzer 2019, "Stabilized Sparse Scaling Algorithms for
//! Entropy Regularized Transport Problems", SIAM J. Sci. Comput. 41(3)):
//!
//! f_i ← −ε log Σ_j b_j exp((g_j − C(x_i, y_j))/ε),  g_j ← −ε log Σ_i a_i exp((f_i − C(x_i, y_j))/ε).
//!
//! Each update is one [`cpu::kernel_lse`] call: since C/ε = ‖x − y‖²/(2ε),
//! f = −ε · kernel_lse(x, y, h, ε' = 2ε) with h_j = g_j/ε + log b_j (and the same with the
//! clouds swapped for g). The kernel sums are float32; the potentials are kept in **float64**
//! (h is rounded to float32 for each call). Both clouds are first translated by their common
//! mean (the cost does not change), which keeps float32 squared distances accurate for clouds
//! far from the origin.
//!
//! **ε-scaling** (Schmitzer 2019; the annealing Feydy et al. 2019 use as well): the iteration
//! starts at ε₀ = the squared diagonal of the clouds' bounding box (at least the squared
//! diameter, so at least twice the largest cost), takes one iteration at each ε₀·s^k above the
//! target (s = [`Params::scaling`]), then iterates at the target ε until the row marginal error
//! is at most [`Params::tol`], or [`Params::max_iter`] iterations (counted from the first
//! stage) have run, or an iteration leaves f unchanged (a fixed point of the float32
//! iteration, which cannot improve).
//!
//! **Marginal error.** After an iteration the column marginal of the plan is b (up to the
//! float32 rounding of the last update); the error reported is the L1 norm of the **row**
//! marginal violation, Σ_i |Σ_j π_ij − a_i|, which is free to estimate in float32 (it is the
//! next f update) and is confirmed in float64 before [`Status::Converged`] is reported.
//!
//! **Limits.** The exponents the kernel sums see are of size C/ε, rounded in float32 (relative
//! 6e-8, and the squared distances a few ulps): the marginal error cannot go much below about
//! (typical cost / ε) · 1e-7. Measured on 100 × 150 points in [0, 1]^5 (typical cost 0.07):
//! ε = 1e-3 reaches 1e-4 in 1788 iterations; at ε = 1e-4 the float32 iteration stops moving
//! at 1.8e-4, above a 1e-4 tolerance, and reports [`Status::NotConverged`]. Sinkhorn's rate also
//! degrades as ε falls (roughly like 1/ε iterations), and most when the two clouds nearly
//! coincide (a cloud against itself: 14 iterations at ε = 0.1, 2760 at ε = 0.01, where the
//! symmetric update of the self terms takes 15).
//!
//! **Transport cost.** The Sinkhorn plan π satisfies the marginals only up to that error, so its
//! cost can fall below the exact optimal transport cost. [`Transport::transport_cost`] is the
//! cost of π rounded onto the couplings of (a, b) by the procedure of Altschuler, Weed and
//! Rigollet 2017 ("Near-linear time approximation algorithms for optimal transport via Sinkhorn
//! iteration", NeurIPS, Algorithm 2): scale rows down to at most a, columns down to at most b,
//! add the rank-one coupling of the deficits. The rounded plan has marginals a and b exactly, so
//! its cost is an upper bound on the exact optimal transport cost; it moves at most
//! 2 · (row + column L1 marginal errors) of mass (their Lemma 7), so it differs from the
//! unrounded ⟨π, C⟩ ([`Transport::plan_cost`]) by at most that times the largest cost. Both are
//! evaluated in float64 on the original coordinates, row by row (O(n·m·dim) work, O(n + m)
//! memory plus O(m) per thread): three passes over the pairs, once at the end (and one more
//! each time the float32 estimate meets the tolerance, to confirm it).
//!
//! **Debiased divergence** ([`sinkhorn_divergence`], Feydy et al. 2019):
//! S_ε(α, β) = OT_ε(α, β) − ½ OT_ε(α, α) − ½ OT_ε(β, β), each term the dual value
//! ⟨a, f⟩ + ⟨b, g⟩ − ε(mass(π) − 1) (the last term vanishes at convergence); the self terms use
//! the symmetric averaged update p ← ½ (p + T(p)) (T the soft-min of the cloud against itself),
//! OT_ε(α, α) = 2⟨a, p⟩ − ε(mass − 1); the cross term is [`sinkhorn`]. For this cost exp(−C/ε)
//! is a Gaussian kernel, positive definite and universal, and Feydy et al. show S_ε ≥ 0 with
//! equality only for α = β. The self terms do not cancel the cross term exactly: S_ε(α, α) is 0
//! up to the tolerance's effect on the values (measured: 1e-12 at ε = 0.1, −3e-7 at ε = 0.01 on
//! 100 points in [0, 1]^5 with tolerance 1e-4).

use rayon::prelude::*;

use super::{cpu, cuda};
use crate::gpu::{Device, GpuError};

/// Why a call was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SinkhornError {
    /// The dimension is 0.
    #[error("the dimension is 0")]
    ZeroDim,
    /// A cloud has no weight.
    #[error("cloud {cloud} has no points")]
    Empty {
        /// `x` or `y`.
        cloud: &'static str,
    },
    /// The coordinates are not `weights × dim` numbers.
    #[error("cloud {cloud}: {coords} coordinates for {weights} weights of dimension {dim} (needs {})", weights * dim)]
    Shape {
        /// `x` or `y`.
        cloud: &'static str,
        /// Coordinates given.
        coords: usize,
        /// Weights given.
        weights: usize,
        /// The dimension.
        dim: usize,
    },
    /// A coordinate is NaN or infinite.
    #[error("cloud {cloud}: coordinate {index} is {value}, not finite")]
    NonFinitePoint {
        /// `x` or `y`.
        cloud: &'static str,
        /// Index into the row-major coordinates.
        index: usize,
        /// The coordinate.
        value: f32,
    },
    /// A weight is negative, NaN or infinite.
    #[error("cloud {cloud}: weight {index} is {value}; weights must be finite and non-negative")]
    BadWeight {
        /// `x` or `y`.
        cloud: &'static str,
        /// The weight's index.
        index: usize,
        /// The weight.
        value: f64,
    },
    /// The weights do not sum to 1 within 1e-5.
    #[error("cloud {cloud}: weights sum to {sum}, not to 1 within 1e-5 (balanced transport)")]
    NotNormalised {
        /// `x` or `y`.
        cloud: &'static str,
        /// Their sum.
        sum: f64,
    },
    /// ε is not positive and finite.
    #[error("epsilon = {0}: it must be positive and finite")]
    BadEpsilon(f64),
    /// The ε-scaling factor is outside (0, 1).
    #[error("scaling factor {0}: it must lie in (0, 1)")]
    BadScaling(f64),
    /// The tolerance is not positive and finite.
    #[error("tolerance {0}: it must be positive and finite")]
    BadTolerance(f64),
    /// The iteration cap is 0.
    #[error("max_iter is 0: at least one iteration is needed")]
    NoIterations,
    /// The CUDA device failed (compile, allocation, launch or copy).
    #[error("the CUDA device failed: {0}")]
    Device(String),
    /// The potentials became infinite or NaN (ε far too small for float32 kernel sums on these
    /// coordinates: g/ε overflows).
    #[error("the potentials became non-finite at iteration {iteration} (epsilon = {epsilon}): epsilon is too small for float32 kernel sums at this scale")]
    NonFinite {
        /// The iteration (from 1).
        iteration: usize,
        /// The ε of that iteration.
        epsilon: f64,
    },
}

/// A weighted point cloud: the measure Σ_i w_i δ(p_i).
#[derive(Clone, Copy, Debug)]
pub struct Cloud<'a> {
    /// Points, row-major float32 `[len, dim]`.
    pub points: &'a [f32],
    /// Weights `[len]`, float64, non-negative, summing to 1 within 1e-5 (they are divided by
    /// their sum before use).
    pub weights: &'a [f64],
}

impl<'a> Cloud<'a> {
    /// The cloud of `points` `[len, dim]` with `weights` `[len]` (checked by the solvers).
    pub fn new(points: &'a [f32], weights: &'a [f64]) -> Cloud<'a> {
        Cloud { points, weights }
    }
}

/// How to solve.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Params {
    /// The target regularisation ε (> 0), in the cost's unit (squared coordinates).
    pub epsilon: f64,
    /// ε-scaling factor s in (0, 1): the stages are ε₀, ε₀·s, ε₀·s², … down to `epsilon`.
    pub scaling: f64,
    /// Tolerance (> 0) on the L1 row marginal error at the target ε.
    pub tol: f64,
    /// Cap on the iterations, annealing stages included (≥ 1). One iteration of [`sinkhorn`] is
    /// an f and a g update (two kernel sums); one of a self term in [`sinkhorn_divergence`] is
    /// one symmetric update (one kernel sum).
    pub max_iter: usize,
}

impl Params {
    /// ε with the defaults: scaling 0.5, tolerance 1e-4, at most 10 000 iterations.
    pub fn new(epsilon: f64) -> Params {
        Params {
            epsilon,
            scaling: 0.5,
            tol: 1e-4,
            max_iter: 10_000,
        }
    }
}

/// Whether the iteration met the tolerance.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    /// The row marginal error reached the tolerance at the target ε (checked in float64).
    Converged,
    /// The iteration cap came first, or the float32 iteration stopped moving above the
    /// tolerance (module documentation, "Limits"): the potentials and values are those of the
    /// last iteration, possibly at an ε above the target ([`Transport::epsilon`]); do not use
    /// them as the answer. ([`Transport::transport_cost`] remains the cost of a true coupling,
    /// an upper bound on the optimal transport cost.)
    NotConverged,
}

/// The result of [`sinkhorn`]. Values in the cost's unit (squared coordinates), float64.
#[derive(Clone, Debug, PartialEq)]
pub struct Transport {
    /// Dual potential on x, `[n]`.
    pub f: Vec<f64>,
    /// Dual potential on y, `[m]`: the last update, g = the soft-min of f.
    pub g: Vec<f64>,
    /// The ε of the last iteration: the target when converged, possibly larger otherwise.
    pub epsilon: f64,
    /// The regularised value OT_ε as the dual objective ⟨a, f⟩ + ⟨b, g⟩ − ε(mass(π) − 1),
    /// a lower bound on the true OT_ε that is exact at convergence.
    pub ot_eps: f64,
    /// ⟨π̂, C⟩ for the plan π̂ rounded onto the couplings of (a, b) (module documentation): an
    /// upper bound on the exact (unregularised) optimal transport cost.
    pub transport_cost: f64,
    /// ⟨π, C⟩ for the Sinkhorn plan π itself, whose row marginal is off by `marginal_error`.
    pub plan_cost: f64,
    /// Mass the rounding moved onto the rank-one coupling (≤ about half `marginal_error`).
    pub rounding_mass: f64,
    /// L1 norm of the row marginal violation, Σ_i |Σ_j π_ij − a_i|, in float64.
    pub marginal_error: f64,
    /// The plan's row marginal Σ_j π_ij, `[n]`, float64 (a, the weights normalised, at
    /// convergence).
    pub row_marginal: Vec<f64>,
    /// Iterations run, annealing stages included.
    pub iterations: usize,
    /// [`Status::Converged`] or [`Status::NotConverged`].
    pub status: Status,
}

/// The result of [`sinkhorn_divergence`], in the cost's unit.
#[derive(Clone, Debug, PartialEq)]
pub struct Divergence {
    /// S_ε(α, β) = `ot_xy` − ½ `ot_xx` − ½ `ot_yy`.
    pub value: f64,
    /// OT_ε(α, β) (dual value).
    pub ot_xy: f64,
    /// OT_ε(α, α) (dual value of the symmetric problem).
    pub ot_xx: f64,
    /// OT_ε(β, β).
    pub ot_yy: f64,
    /// The largest of the three row marginal errors.
    pub marginal_error: f64,
    /// Iterations of the three problems together.
    pub iterations: usize,
    /// Converged only when all three did.
    pub status: Status,
}

/// Checks one cloud and returns its number of points.
fn check_cloud(c: &Cloud, name: &'static str, dim: usize) -> Result<usize, SinkhornError> {
    let len = c.weights.len();
    if len == 0 {
        return Err(SinkhornError::Empty { cloud: name });
    }
    if c.points.len() != len * dim {
        return Err(SinkhornError::Shape {
            cloud: name,
            coords: c.points.len(),
            weights: len,
            dim,
        });
    }
    if let Some((index, &value)) = c.points.iter().enumerate().find(|(_, v)| !v.is_finite()) {
        return Err(SinkhornError::NonFinitePoint {
            cloud: name,
            index,
            value,
        });
    }
    if let Some((index, &value)) = c
        .weights
        .iter()
        .enumerate()
        .find(|(_, w)| !(w.is_finite() && **w >= 0.0))
    {
        return Err(SinkhornError::BadWeight {
            cloud: name,
            index,
            value,
        });
    }
    let sum: f64 = c.weights.iter().sum();
    if (sum - 1.0).abs() > 1e-5 {
        return Err(SinkhornError::NotNormalised { cloud: name, sum });
    }
    Ok(len)
}

fn check_params(p: &Params) -> Result<(), SinkhornError> {
    if !(p.epsilon.is_finite() && p.epsilon > 0.0) {
        return Err(SinkhornError::BadEpsilon(p.epsilon));
    }
    if !(p.scaling > 0.0 && p.scaling < 1.0) {
        return Err(SinkhornError::BadScaling(p.scaling));
    }
    if !(p.tol.is_finite() && p.tol > 0.0) {
        return Err(SinkhornError::BadTolerance(p.tol));
    }
    if p.max_iter == 0 {
        return Err(SinkhornError::NoIterations);
    }
    Ok(())
}

/// A cloud ready for the iteration: centred float32 points, normalised weights, their logs.
struct Prepared<'a> {
    /// Original points (the float64 evaluations use them).
    points: &'a [f32],
    /// Points minus the common centre, float32 (the kernel sums use them).
    centred: Vec<f32>,
    weights: Vec<f64>,
    log_weights: Vec<f64>,
}

fn prepare<'a>(c: &Cloud<'a>, dim: usize, centre: &[f64]) -> Prepared<'a> {
    let sum: f64 = c.weights.iter().sum();
    let weights: Vec<f64> = c.weights.iter().map(|w| w / sum).collect();
    Prepared {
        points: c.points,
        centred: c
            .points
            .chunks_exact(dim)
            .flat_map(|p| p.iter().zip(centre).map(|(v, m)| (*v as f64 - m) as f32))
            .collect(),
        log_weights: weights.iter().map(|w| w.ln()).collect(),
        weights,
    }
}

/// The common mean of the clouds' points and the squared diagonal of their bounding box.
fn centre_and_extent(clouds: &[&Cloud], dim: usize) -> (Vec<f64>, f64) {
    let mut sum = vec![0.0f64; dim];
    let mut lo = vec![f64::INFINITY; dim];
    let mut hi = vec![f64::NEG_INFINITY; dim];
    let mut count = 0usize;
    for c in clouds {
        for p in c.points.chunks_exact(dim) {
            for (a, &v) in p.iter().enumerate() {
                let v = v as f64;
                sum[a] += v;
                lo[a] = lo[a].min(v);
                hi[a] = hi[a].max(v);
            }
            count += 1;
        }
    }
    let centre = sum.iter().map(|s| s / count as f64).collect();
    let diag2 = lo.iter().zip(&hi).map(|(l, h)| (h - l) * (h - l)).sum();
    (centre, diag2)
}

/// The ε of each annealing stage followed by the target: ε₀·s^k while above the target, then
/// the target (just the target when ε₀ ≤ target).
fn schedule(eps0: f64, target: f64, scaling: f64) -> Vec<f64> {
    let mut out = Vec::new();
    let mut e = eps0;
    while e > target {
        out.push(e);
        e *= scaling;
    }
    out.push(target);
    out
}

/// One side's soft-min: out_i = −ε log Σ_j w_j exp((pot_j − C(x_i, z_j))/ε), through
/// float32 `kernel_lse` with ε' = 2ε and h_j = pot_j/ε + log w_j, on the CPU or on a CUDA
/// device (`session`).
struct SoftMin<'g> {
    x: Vec<f32>,
    z: Vec<f32>,
    log_w: Vec<f64>,
    dim: usize,
    session: Option<cuda::LseSession<'g>>,
    h: Vec<f32>,
    lse: Vec<f32>,
}

impl From<GpuError> for SinkhornError {
    fn from(e: GpuError) -> Self {
        SinkhornError::Device(e.to_string())
    }
}

impl<'g> SoftMin<'g> {
    fn new(
        device: Device<'g>,
        x: &Prepared,
        z: &Prepared,
        dim: usize,
    ) -> Result<SoftMin<'g>, SinkhornError> {
        let session = match device {
            Device::Cpu => None,
            Device::Cuda(gpu) => Some(cuda::LseSession::new(gpu, &x.centred, &z.centred, dim)?),
        };
        Ok(SoftMin {
            x: x.centred.clone(),
            z: z.centred.clone(),
            log_w: z.log_weights.clone(),
            dim,
            session,
            h: vec![0.0; z.weights.len()],
            lse: vec![0.0; x.weights.len()],
        })
    }

    fn apply(&mut self, pot: &[f64], eps: f64, out: &mut [f64]) -> Result<(), SinkhornError> {
        for ((h, p), lw) in self.h.iter_mut().zip(pot).zip(&self.log_w) {
            *h = (p / eps + lw) as f32;
        }
        match &mut self.session {
            None => cpu::kernel_lse(
                &self.x,
                &self.z,
                &self.h,
                self.dim,
                2.0 * eps,
                &mut self.lse,
            ),
            Some(s) => s.call(&self.h, 2.0 * eps, &mut self.lse)?,
        }
        for (o, l) in out.iter_mut().zip(&self.lse) {
            *o = -eps * *l as f64;
        }
        Ok(())
    }
}

/// Σ_i a_i |exp((f_i − f̃_i)/ε) − 1|: the L1 row marginal error of the plan of (f, g) when
/// f̃ is the soft-min of g.
fn row_error_estimate(a: &[f64], f: &[f64], f_next: &[f64], eps: f64) -> f64 {
    a.iter()
        .zip(f.iter().zip(f_next))
        .map(|(w, (u, v))| {
            if *w > 0.0 {
                w * ((u - v) / eps).exp_m1().abs()
            } else {
                0.0
            }
        })
        .sum()
}

/// [`row_pass`] on `device`: the CPU's cores, or the CUDA device's float64
/// [`cuda::sinkhorn_row_pass`] (the same values up to the order of the float64 sums).
fn row_pass_on(
    device: Device,
    x: &[f32],
    z: &[f32],
    dim: usize,
    beta: &[f64],
    eps: f64,
    w: Option<&[f64]>,
) -> Result<Vec<(f64, f64, f64)>, SinkhornError> {
    match device {
        Device::Cpu => Ok(row_pass(x, z, dim, beta, eps, w)),
        Device::Cuda(gpu) => Ok(cuda::sinkhorn_row_pass(gpu, x, z, dim, beta, eps, w)?),
    }
}

/// Per row i, float64: l_i = log Σ_j exp(β_j − C(x_i, z_j)/ε), the softmax-weighted cost
/// Σ_j p_ij C(x_i, z_j) with p_ij = exp(β_j − C/ε − l_i), and Σ_j w_j C(x_i, z_j) for an
/// optional `w` `[m]` (0 without). O(m) memory per thread.
fn row_pass(
    x: &[f32],
    z: &[f32],
    dim: usize,
    beta: &[f64],
    eps: f64,
    w: Option<&[f64]>,
) -> Vec<(f64, f64, f64)> {
    let m = beta.len();
    x.par_chunks_exact(dim)
        .map_init(
            || vec![0.0f64; m],
            |cost, xi| {
                let mut mx = f64::NEG_INFINITY;
                for ((c, zj), bj) in cost.iter_mut().zip(z.chunks_exact(dim)).zip(beta) {
                    *c = 0.5
                        * xi.iter()
                            .zip(zj)
                            .map(|(p, q)| {
                                let d = *p as f64 - *q as f64;
                                d * d
                            })
                            .sum::<f64>();
                    mx = mx.max(bj - *c / eps);
                }
                if mx == f64::NEG_INFINITY {
                    return (f64::NEG_INFINITY, 0.0, 0.0);
                }
                let (mut s, mut sc) = (0.0f64, 0.0f64);
                for (c, bj) in cost.iter().zip(beta) {
                    let e = (bj - c / eps - mx).exp();
                    s += e;
                    sc += e * c;
                }
                let wc = w.map_or(0.0, |w| w.iter().zip(cost.iter()).map(|(a, c)| a * c).sum());
                (mx + s.ln(), sc / s, wc)
            },
        )
        .collect()
}

/// The log-scalings α_i = f_i/ε + log a_i of a potential.
fn log_scaling(pot: &[f64], log_w: &[f64], eps: f64) -> Vec<f64> {
    pot.iter().zip(log_w).map(|(p, l)| p / eps + l).collect()
}

/// Row sums r_i = exp(α_i + l_i) of the plan exp(α_i + β_j − C_ij/ε) from a row pass.
fn row_sums(alpha: &[f64], rows: &[(f64, f64, f64)]) -> Vec<f64> {
    alpha
        .iter()
        .zip(rows)
        .map(|(a, r)| (a + r.0).exp())
        .collect()
}

fn l1_error(r: &[f64], a: &[f64]) -> f64 {
    r.iter().zip(a).map(|(u, v)| (u - v).abs()).sum()
}

/// What the float64 evaluation of a plan gives.
struct Evaluation {
    row_marginal: Vec<f64>,
    marginal_error: f64,
    mass: f64,
    plan_cost: f64,
    transport_cost: f64,
    rounding_mass: f64,
}

/// Evaluates the plan of (f, g) in float64 and rounds it onto the couplings of (a, b)
/// (Altschuler et al. 2017, Algorithm 2), never holding it, its row passes on `device`.
/// `first` is a row pass of β already computed.
#[allow(clippy::too_many_arguments)]
fn evaluate(
    device: Device,
    x: &Prepared,
    y: &Prepared,
    dim: usize,
    f: &[f64],
    g: &[f64],
    eps: f64,
    first: Option<Vec<(f64, f64, f64)>>,
) -> Result<Evaluation, SinkhornError> {
    let alpha = log_scaling(f, &x.log_weights, eps);
    let beta = log_scaling(g, &y.log_weights, eps);
    let rows = match first {
        Some(rows) => rows,
        None => row_pass_on(device, x.points, y.points, dim, &beta, eps, None)?,
    };
    let r = row_sums(&alpha, &rows);
    let marginal_error = l1_error(&r, &x.weights);
    let mass = r.iter().sum();
    let plan_cost = r.iter().zip(&rows).map(|(ri, row)| ri * row.1).sum();
    // Rows down to at most a: α'_i = α_i + min(log a_i − log r_i, 0) = min(α_i, log a_i − l_i).
    let alpha1: Vec<f64> = alpha
        .iter()
        .zip(&x.log_weights)
        .zip(&rows)
        .map(|((al, la), row)| al.min(la - row.0))
        .collect();
    // Columns down to at most b.
    let cols = row_pass_on(device, y.points, x.points, dim, &alpha1, eps, None)?;
    let beta1: Vec<f64> = beta
        .iter()
        .zip(&y.log_weights)
        .zip(&cols)
        .map(|((be, lb), col)| be.min(lb - col.0))
        .collect();
    let col_deficit: Vec<f64> = row_sums(&beta1, &cols)
        .iter()
        .zip(&y.weights)
        .map(|(c, b)| (b - c).max(0.0))
        .collect();
    // The scaled plan's rows, cost, and Σ_j deficit_j C_ij for the rank-one part.
    let rows1 = row_pass_on(
        device,
        x.points,
        y.points,
        dim,
        &beta1,
        eps,
        Some(&col_deficit),
    )?;
    let r1 = row_sums(&alpha1, &rows1);
    let mut cost: f64 = r1.iter().zip(&rows1).map(|(ri, row)| ri * row.1).sum();
    let row_deficit: Vec<f64> = r1
        .iter()
        .zip(&x.weights)
        .map(|(r, a)| (a - r).max(0.0))
        .collect();
    let rounding_mass: f64 = row_deficit.iter().sum();
    if rounding_mass > 0.0 {
        let cross: f64 = row_deficit
            .iter()
            .zip(&rows1)
            .map(|(e, row)| e * row.2)
            .sum();
        cost += cross / rounding_mass;
    }
    Ok(Evaluation {
        row_marginal: r,
        marginal_error,
        mass,
        plan_cost,
        transport_cost: cost,
        rounding_mass,
    })
}

/// Log-domain balanced entropic optimal transport between `x` and `y` (dimension `dim`) with
/// cost ‖x − y‖²/2, by Sinkhorn's iteration (Cuturi 2013) in the log domain with ε-scaling
/// (Schmitzer 2019), on float32 [`cpu::kernel_lse`] kernel sums and float64 potentials; see the
/// module documentation for the formulas and for how the values are evaluated.
///
/// Shapes: `x.points` `[n, dim]`, `x.weights` `[n]`, `y.points` `[m, dim]`, `y.weights` `[m]`;
/// the result's f is `[n]`, g `[m]`. Memory O((n + m)·dim) plus the kernel sums' per-thread
/// tiles and O(m) float64 per thread for the evaluation; time O(iterations · n · m · dim) (two
/// kernel sums per iteration) plus three float64 passes over the pairs at the end.
///
/// A result with [`Status::NotConverged`] carries the last iterate; its values are not the
/// answer.
///
/// # Errors
/// [`SinkhornError`]: dim = 0; an empty cloud; coordinates that are not weights × dim numbers or
/// not finite; a negative or non-finite weight; weights not summing to 1 within 1e-5;
/// ε ≤ 0; a scaling outside (0, 1); a tolerance ≤ 0; max_iter = 0; potentials that overflow
/// (ε far too small for the coordinates' scale in float32).
pub fn sinkhorn(
    x: Cloud,
    y: Cloud,
    dim: usize,
    params: &Params,
) -> Result<Transport, SinkhornError> {
    sinkhorn_on(Device::Cpu, x, y, dim, params)
}

/// [`sinkhorn`] with its kernel sums on `device`: the CPU's [`cpu::kernel_lse`], or a CUDA
/// device's kernels through [`cuda::LseSession`] (two sessions, x against y and y against x;
/// each update copies m or n weights in and n or m sums out). The float64 potentials stay on
/// the host; the float64 passes over the pairs (the confirmation of convergence and the final
/// evaluation) run on the device too ([`cuda::sinkhorn_row_pass`], in float64), so the two
/// devices agree up to the float32 kernel sums' rounding and the order of float64 sums.
///
/// # Errors
/// As [`sinkhorn`], and [`SinkhornError::Device`] when the CUDA device fails.
pub fn sinkhorn_on(
    device: Device,
    x: Cloud,
    y: Cloud,
    dim: usize,
    params: &Params,
) -> Result<Transport, SinkhornError> {
    if dim == 0 {
        return Err(SinkhornError::ZeroDim);
    }
    let n = check_cloud(&x, "x", dim)?;
    let m = check_cloud(&y, "y", dim)?;
    check_params(params)?;
    let (centre, eps0) = centre_and_extent(&[&x, &y], dim);
    let (xp, yp) = (prepare(&x, dim, &centre), prepare(&y, dim, &centre));
    let stages = schedule(eps0, params.epsilon, params.scaling);
    let mut on_x = SoftMin::new(device, &xp, &yp, dim)?;
    let mut on_y = SoftMin::new(device, &yp, &xp, dim)?;

    let mut f = vec![0.0f64; n];
    let mut g = vec![0.0f64; m];
    let mut f_next = vec![0.0f64; n];
    on_x.apply(&g, stages[0], &mut f)?;
    let mut iterations = 0;
    let mut first_pass = None;
    let (status, eps) = loop {
        let eps = stages[iterations.min(stages.len() - 1)];
        on_y.apply(&f, eps, &mut g)?;
        on_x.apply(&g, eps, &mut f_next)?;
        iterations += 1;
        if !(g.iter().all(|v| v.is_finite()) && f_next.iter().all(|v| v.is_finite())) {
            return Err(SinkhornError::NonFinite {
                iteration: iterations,
                epsilon: eps,
            });
        }
        if iterations >= stages.len()
            && row_error_estimate(&xp.weights, &f, &f_next, eps) <= params.tol
        {
            // Confirm in float64: the float32 estimate is off by the kernel sums' rounding.
            let beta = log_scaling(&g, &yp.log_weights, eps);
            let rows = row_pass_on(device, xp.points, yp.points, dim, &beta, eps, None)?;
            let alpha = log_scaling(&f, &xp.log_weights, eps);
            if l1_error(&row_sums(&alpha, &rows), &xp.weights) <= params.tol {
                first_pass = Some(rows);
                break (Status::Converged, eps);
            }
        }
        // A fixed point of the float32 iteration that misses the tolerance cannot improve.
        if iterations >= params.max_iter || (iterations >= stages.len() && f_next == f) {
            break (Status::NotConverged, eps);
        }
        std::mem::swap(&mut f, &mut f_next);
    };
    let ev = evaluate(device, &xp, &yp, dim, &f, &g, eps, first_pass)?;
    let dual = dot(&xp.weights, &f) + dot(&yp.weights, &g) - eps * (ev.mass - 1.0);
    Ok(Transport {
        f,
        g,
        epsilon: eps,
        ot_eps: dual,
        transport_cost: ev.transport_cost,
        plan_cost: ev.plan_cost,
        rounding_mass: ev.rounding_mass,
        marginal_error: ev.marginal_error,
        row_marginal: ev.row_marginal,
        iterations,
        status,
    })
}

/// Sinkhorn's iteration at one fixed ε, a step at a time (what a per-iteration timing
/// measures): f⁰ = the soft-min of g = 0, then each [`SinkhornIterations::step`] updates
/// g ← soft-min of f, f ← soft-min of g (two kernel log-sum-exps on `device`, as in
/// [`sinkhorn_on`], without ε-scaling or any convergence test).
pub struct SinkhornIterations<'g> {
    on_x: SoftMin<'g>,
    on_y: SoftMin<'g>,
    f: Vec<f64>,
    g: Vec<f64>,
    epsilon: f64,
}

impl<'g> SinkhornIterations<'g> {
    /// Prepares the clouds (checked as [`sinkhorn`] checks them, centred on their common mean)
    /// and sets f to its first update.
    ///
    /// # Errors
    /// As [`sinkhorn_on`] for the clouds and ε.
    pub fn new(
        device: Device<'g>,
        x: Cloud,
        y: Cloud,
        dim: usize,
        epsilon: f64,
    ) -> Result<SinkhornIterations<'g>, SinkhornError> {
        if dim == 0 {
            return Err(SinkhornError::ZeroDim);
        }
        check_cloud(&x, "x", dim)?;
        let m = check_cloud(&y, "y", dim)?;
        check_params(&Params::new(epsilon))?;
        let (centre, _) = centre_and_extent(&[&x, &y], dim);
        let (xp, yp) = (prepare(&x, dim, &centre), prepare(&y, dim, &centre));
        let mut it = SinkhornIterations {
            on_x: SoftMin::new(device, &xp, &yp, dim)?,
            on_y: SoftMin::new(device, &yp, &xp, dim)?,
            f: vec![0.0; xp.weights.len()],
            g: vec![0.0; m],
            epsilon,
        };
        it.on_x.apply(&it.g, epsilon, &mut it.f)?;
        Ok(it)
    }

    /// One iteration: g from f, then f from g.
    ///
    /// # Errors
    /// [`SinkhornError::Device`] when the CUDA device fails.
    pub fn step(&mut self) -> Result<(), SinkhornError> {
        self.on_y.apply(&self.f, self.epsilon, &mut self.g)?;
        self.on_x.apply(&self.g, self.epsilon, &mut self.f)
    }

    /// The potentials (f `[n]`, g `[m]`) after the last step.
    pub fn potentials(&self) -> (&[f64], &[f64]) {
        (&self.f, &self.g)
    }
}

/// [`SinkhornIterations`] held on a CUDA device ([`cuda::DeviceSinkhorn`]): the clouds checked
/// and centred as [`SinkhornIterations::new`] does, uploaded with their log-weights, and f⁰
/// computed on the stream; each [`cuda::DeviceSinkhorn::step`] is then four launches (six
/// when the log-sum-exps split Y) with no host copy (a CUDA graph can capture it), and
/// [`cuda::DeviceSinkhorn::potentials`] reads f and g back.
///
/// # Errors
/// As [`SinkhornIterations::new`] for the clouds and ε; [`SinkhornError::Device`] for compile
/// and driver errors.
pub fn device_iterations(
    gpu: &crate::gpu::Gpu,
    x: Cloud,
    y: Cloud,
    dim: usize,
    epsilon: f64,
) -> Result<cuda::DeviceSinkhorn, SinkhornError> {
    if dim == 0 {
        return Err(SinkhornError::ZeroDim);
    }
    check_cloud(&x, "x", dim)?;
    check_cloud(&y, "y", dim)?;
    check_params(&Params::new(epsilon))?;
    let (centre, _) = centre_and_extent(&[&x, &y], dim);
    let (xp, yp) = (prepare(&x, dim, &centre), prepare(&y, dim, &centre));
    Ok(cuda::DeviceSinkhorn::new(
        gpu,
        &xp.centred,
        &yp.centred,
        dim,
        &xp.log_weights,
        &yp.log_weights,
        epsilon,
    )?)
}

/// The float64 definition of [`SinkhornIterations`] after its first step, at `rows` of x: f¹
/// from g¹ from f⁰ (f⁰ the soft-min of g = 0), every soft-min a float64 log-sum-exp over all
/// points (2·n·m pair evaluations, then |rows|·m). Clouds and ε as [`SinkhornIterations::new`],
/// unchecked (the caller's to check); the weights normalised by their sum.
pub fn first_step_reference(
    x: Cloud,
    y: Cloud,
    dim: usize,
    epsilon: f64,
    rows: &[usize],
) -> Vec<f64> {
    let norm = |w: &[f64]| -> Vec<f64> {
        let s: f64 = w.iter().sum();
        w.iter().map(|v| (v / s).ln()).collect()
    };
    let (log_a, log_b) = (norm(x.weights), norm(y.weights));
    let soft = |p: &[f32], z: &[f32], pot: &[f64], log_w: &[f64]| -> Vec<f64> {
        row_pass(p, z, dim, &log_scaling(pot, log_w, epsilon), epsilon, None)
            .iter()
            .map(|r| -epsilon * r.0)
            .collect()
    };
    let f0 = soft(x.points, y.points, &vec![0.0; log_b.len()], &log_b);
    let g1 = soft(y.points, x.points, &f0, &log_a);
    let picked: Vec<f32> = rows
        .iter()
        .flat_map(|&i| x.points[i * dim..(i + 1) * dim].iter().copied())
        .collect();
    soft(&picked, y.points, &g1, &log_b)
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .filter(|(w, _)| **w > 0.0)
        .map(|(w, v)| w * v)
        .sum()
}

/// One self term OT_ε(α, α) by the symmetric update p ← ½(p + T(p)), T the soft-min of p on
/// the cloud itself: (dual value 2⟨a, p⟩ − ε(mass − 1), row marginal error, iterations, status).
fn self_transport(
    device: Device,
    c: &Prepared,
    dim: usize,
    stages: &[f64],
    params: &Params,
) -> Result<(f64, f64, usize, Status), SinkhornError> {
    let n = c.weights.len();
    let mut soft = SoftMin::new(device, c, c, dim)?;
    let mut p = vec![0.0f64; n];
    let mut t = vec![0.0f64; n];
    soft.apply(&vec![0.0; n], stages[0], &mut p)?;
    let mut iterations = 0;
    let (status, eps, rows) = loop {
        let eps = stages[iterations.min(stages.len() - 1)];
        soft.apply(&p, eps, &mut t)?;
        iterations += 1;
        if !t.iter().all(|v| v.is_finite()) {
            return Err(SinkhornError::NonFinite {
                iteration: iterations,
                epsilon: eps,
            });
        }
        // A fixed point of the float32 iteration that misses the tolerance cannot improve.
        let stalled =
            iterations >= stages.len() && p.iter().zip(&t).all(|(u, v)| 0.5 * (u + v) == *u);
        let done = iterations >= params.max_iter || stalled;
        if (iterations >= stages.len() && row_error_estimate(&c.weights, &p, &t, eps) <= params.tol)
            || done
        {
            let beta = log_scaling(&p, &c.log_weights, eps);
            let rows = row_pass_on(device, c.points, c.points, dim, &beta, eps, None)?;
            let err = l1_error(&row_sums(&beta, &rows), &c.weights);
            if iterations >= stages.len() && err <= params.tol {
                break (Status::Converged, eps, rows);
            }
            if done {
                break (Status::NotConverged, eps, rows);
            }
        }
        for (u, v) in p.iter_mut().zip(&t) {
            *u = 0.5 * (*u + v);
        }
    };
    let beta = log_scaling(&p, &c.log_weights, eps);
    let r = row_sums(&beta, &rows);
    let mass: f64 = r.iter().sum();
    let value = 2.0 * dot(&c.weights, &p) - eps * (mass - 1.0);
    Ok((value, l1_error(&r, &c.weights), iterations, status))
}

/// The debiased Sinkhorn divergence S_ε(α, β) = OT_ε(α, β) − ½ OT_ε(α, α) − ½ OT_ε(β, β)
/// (Feydy et al. 2019, "Interpolating between Optimal Transport and MMD using Sinkhorn
/// Divergences"), cost ‖x − y‖²/2, each OT_ε its dual value at convergence (⟨a, f⟩ + ⟨b, g⟩;
/// the self terms 2⟨a, p⟩ by the symmetric update). All three problems use the same ε-scaling
/// schedule, from the squared diagonal of both clouds' bounding box. S_ε ≥ 0 (up to the
/// float32 rounding of the kernel sums and the tolerance), = 0 for α = β.
///
/// Shapes, units and parameters as [`sinkhorn`]; the cost is about that of [`sinkhorn`] plus two
/// symmetric problems.
///
/// # Errors
/// As [`sinkhorn`].
pub fn sinkhorn_divergence(
    x: Cloud,
    y: Cloud,
    dim: usize,
    params: &Params,
) -> Result<Divergence, SinkhornError> {
    sinkhorn_divergence_on(Device::Cpu, x, y, dim, params)
}

/// [`sinkhorn_divergence`] with its kernel sums on `device` (as [`sinkhorn_on`]).
///
/// # Errors
/// As [`sinkhorn_on`].
pub fn sinkhorn_divergence_on(
    device: Device,
    x: Cloud,
    y: Cloud,
    dim: usize,
    params: &Params,
) -> Result<Divergence, SinkhornError> {
    let xy = sinkhorn_on(device, x, y, dim, params)?;
    let (centre, eps0) = centre_and_extent(&[&x, &y], dim);
    let stages = schedule(eps0, params.epsilon, params.scaling);
    let (xx, err_x, it_x, st_x) =
        self_transport(device, &prepare(&x, dim, &centre), dim, &stages, params)?;
    let (yy, err_y, it_y, st_y) =
        self_transport(device, &prepare(&y, dim, &centre), dim, &stages, params)?;
    let all = [xy.status, st_x, st_y];
    Ok(Divergence {
        value: xy.ot_eps - 0.5 * xx - 0.5 * yy,
        ot_xy: xy.ot_eps,
        ot_xx: xx,
        ot_yy: yy,
        marginal_error: xy.marginal_error.max(err_x).max(err_y),
        iterations: xy.iterations + it_x + it_y,
        status: if all.iter().all(|s| *s == Status::Converged) {
            Status::Converged
        } else {
            Status::NotConverged
        },
    })
}

#[cfg(test)]
mod tests {
    use super::super::unit;
    use super::*;

    /// `len` points uniform in [0, 1)^dim and weights 0.2 + U[0, 1), normalised (SplitMix64).
    fn cloud(len: usize, dim: usize, seed: u64) -> (Vec<f32>, Vec<f64>) {
        let mut s = seed;
        let points = (0..len * dim).map(|_| unit(&mut s) as f32).collect();
        let w: Vec<f64> = (0..len).map(|_| 0.2 + unit(&mut s)).collect();
        let sum: f64 = w.iter().sum();
        (points, w.iter().map(|v| v / sum).collect())
    }

    /// The n × m costs ‖x_i − y_j‖²/2 in float64 (tests only).
    fn costs(x: &[f32], y: &[f32], dim: usize) -> Vec<f64> {
        let mut c = Vec::new();
        for xi in x.chunks_exact(dim) {
            for yj in y.chunks_exact(dim) {
                let d2: f64 = xi
                    .iter()
                    .zip(yj)
                    .map(|(p, q)| (*p as f64 - *q as f64).powi(2))
                    .sum();
                c.push(0.5 * d2);
            }
        }
        c
    }

    /// The exact optimal transport cost min ⟨π, c⟩ over the couplings of (a, b) (Σa = Σb), by
    /// the transportation simplex in float64: a north-west-corner basis (n + m − 1 cells, a
    /// spanning tree of rows and columns), then pivots on the most negative reduced cost
    /// c_ij − u_i − v_j (u_i + v_j = c_ij on the basis, u_0 = 0), moving θ around the cycle the
    /// entering cell closes in the tree, until no reduced cost is below −1e-12.
    fn exact_ot(c: &[f64], a: &[f64], b: &[f64]) -> f64 {
        let (n, m) = (a.len(), b.len());
        let mut basis: Vec<(usize, usize, f64)> = Vec::with_capacity(n + m - 1);
        let mut basic = vec![false; n * m];
        let (mut sa, mut sb) = (a.to_vec(), b.to_vec());
        let (mut i, mut j) = (0, 0);
        loop {
            let q = sa[i].min(sb[j]);
            basis.push((i, j, q));
            basic[i * m + j] = true;
            sa[i] -= q;
            sb[j] -= q;
            if i == n - 1 && j == m - 1 {
                break;
            }
            if j == m - 1 || (i < n - 1 && sa[i] <= sb[j]) {
                i += 1;
            } else {
                j += 1;
            }
        }
        // Tree nodes: rows 0..n, columns n..n + m; edges are basis cells.
        for _ in 0..100_000 {
            let mut adj = vec![Vec::new(); n + m];
            for (k, &(i, j, _)) in basis.iter().enumerate() {
                adj[i].push((n + j, k));
                adj[n + j].push((i, k));
            }
            let mut pot = vec![f64::NAN; n + m];
            pot[0] = 0.0;
            let mut stack = vec![0];
            while let Some(v) = stack.pop() {
                for &(w, k) in &adj[v] {
                    if pot[w].is_nan() {
                        let (i, j, _) = basis[k];
                        pot[w] = c[i * m + j] - pot[v];
                        stack.push(w);
                    }
                }
            }
            let mut best = (-1e-12, None);
            for i in 0..n {
                for j in 0..m {
                    let rc = c[i * m + j] - pot[i] - pot[n + j];
                    if !basic[i * m + j] && rc < best.0 {
                        best = (rc, Some((i, j)));
                    }
                }
            }
            let Some((ei, ej)) = best.1 else {
                return basis.iter().map(|&(i, j, q)| q * c[i * m + j]).sum();
            };
            // The tree path from column ej to row ei (parent edges of a search from row ei).
            let mut parent = vec![usize::MAX; n + m];
            let mut seen = vec![false; n + m];
            seen[ei] = true;
            let mut stack = vec![ei];
            while let Some(v) = stack.pop() {
                for &(w, k) in &adj[v] {
                    if !seen[w] {
                        seen[w] = true;
                        parent[w] = k;
                        stack.push(w);
                    }
                }
            }
            let mut path = Vec::new();
            let mut v = n + ej;
            while v != ei {
                let k = parent[v];
                path.push(k);
                let (i, j, _) = basis[k];
                v = if v == i { n + j } else { i };
            }
            // The entering cell gains θ; along the path from its column the cells lose, gain,
            // lose, …, the last (on row ei) loses. θ is the smallest flow of a losing cell.
            let (mut theta, mut leave) = (f64::INFINITY, 0);
            for &k in path.iter().step_by(2) {
                if basis[k].2 < theta {
                    theta = basis[k].2;
                    leave = k;
                }
            }
            for (s, &k) in path.iter().enumerate() {
                if s % 2 == 0 {
                    basis[k].2 -= theta;
                } else {
                    basis[k].2 += theta;
                }
            }
            let (li, lj, _) = basis[leave];
            basic[li * m + lj] = false;
            basis[leave] = (ei, ej, theta);
            basic[ei * m + ej] = true;
        }
        panic!("the transportation simplex did not finish in 100 000 pivots");
    }

    fn entropy(w: &[f64]) -> f64 {
        -w.iter()
            .filter(|v| **v > 0.0)
            .map(|v| v * v.ln())
            .sum::<f64>()
    }

    fn solve(x: &[f32], a: &[f64], y: &[f32], b: &[f64], dim: usize, p: &Params) -> Transport {
        sinkhorn(Cloud::new(x, a), Cloud::new(y, b), dim, p).unwrap()
    }

    fn divergence(
        x: &[f32],
        a: &[f64],
        y: &[f32],
        b: &[f64],
        dim: usize,
        p: &Params,
    ) -> Divergence {
        sinkhorn_divergence(Cloud::new(x, a), Cloud::new(y, b), dim, p).unwrap()
    }

    /// The exact solver on answers known otherwise: a 2 × 2 problem by hand, and uniform 5 × 5
    /// problems (a degenerate basis) whose optimum is a permutation (Birkhoff), by brute force
    /// over all 120.
    /// One step of the fixed-ε iteration against its float64 definition, on every row and on
    /// a few, and the solver's row marginal sums to the plan's mass.
    #[test]
    fn one_step_matches_float64_and_the_marginal_is_kept() {
        let dim = 3;
        let (xp, xw) = cloud(300, dim, 11);
        let (yp, yw) = cloud(200, dim, 12);
        let (x, y) = (Cloud::new(&xp, &xw), Cloud::new(&yp, &yw));
        let eps = 2.5e-3;
        let mut it = SinkhornIterations::new(Device::Cpu, x, y, dim, eps).unwrap();
        it.step().unwrap();
        let rows: Vec<usize> = (0..300).collect();
        let want = first_step_reference(x, y, dim, eps, &rows);
        let scale = want.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        let err = it
            .potentials()
            .0
            .iter()
            .zip(&want)
            .fold(0.0f64, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            err <= 1e-5 * scale,
            "f after one step off by {err:e} (scale {scale:e})"
        );
        let some = first_step_reference(x, y, dim, eps, &[299, 0, 17]);
        assert_eq!(some, vec![want[299], want[0], want[17]]);
        let t = sinkhorn(x, y, dim, &Params::new(0.05)).unwrap();
        assert_eq!(t.status, Status::Converged);
        assert_eq!(t.row_marginal.len(), 300);
        let l1: f64 = t
            .row_marginal
            .iter()
            .zip(&xw)
            .map(|(r, a)| (r - a).abs())
            .sum();
        assert!(
            (l1 - t.marginal_error).abs() <= 1e-12,
            "{l1} vs {}",
            t.marginal_error
        );
    }

    #[test]
    fn exact_solver_matches_known_answers() {
        // a = (0.3, 0.7), b = (0.6, 0.4), moving costs 1: 0.3 stays in place on row 0,
        // 0.4 on row 1, 0.3 moves: cost 0.3.
        let c = [0.0, 1.0, 1.0, 0.0];
        assert!((exact_ot(&c, &[0.3, 0.7], &[0.6, 0.4]) - 0.3).abs() < 1e-15);
        fn permutations(k: usize, rest: &mut Vec<usize>, out: &mut Vec<Vec<usize>>) {
            if rest.len() == k {
                out.push(rest.clone());
                return;
            }
            for v in 0..k {
                if !rest.contains(&v) {
                    rest.push(v);
                    permutations(k, rest, out);
                    rest.pop();
                }
            }
        }
        let mut perms = Vec::new();
        permutations(5, &mut Vec::new(), &mut perms);
        assert_eq!(perms.len(), 120);
        for seed in 0..20 {
            let (x, _) = cloud(5, 2, 100 + seed);
            let (y, _) = cloud(5, 2, 200 + seed);
            let c = costs(&x, &y, 2);
            let best = perms
                .iter()
                .map(|p| {
                    p.iter()
                        .enumerate()
                        .map(|(i, &j)| c[i * 5 + j])
                        .sum::<f64>()
                        / 5.0
                })
                .fold(f64::INFINITY, f64::min);
            let got = exact_ot(&c, &[0.2; 5], &[0.2; 5]);
            assert!((got - best).abs() <= 1e-14, "seed {seed}: {got} vs {best}");
        }
    }

    /// The case: 100 and 150 points uniform in [0, 1]^5, random weights, ε from 1e-1 to
    /// 1e-4. Every result is finite; a converged one meets the tolerance. The (rounded) transport
    /// cost is never below the exact optimal transport cost, and for a converged ε it is within
    /// the entropic bound ε·min(H(a), H(b)) above it (⟨π_ε, C⟩ ≤ OT_ε ≤ OT_0 + ε·KL(π_0 | a ⊗ b)),
    /// as is OT_ε; and it does not increase as ε shrinks, over the converged ε.
    #[test]
    fn transport_cost_is_bounded_by_the_exact_cost_and_falls_with_epsilon() {
        let dim = 5;
        let (x, a) = cloud(100, dim, 11);
        let (y, b) = cloud(150, dim, 12);
        let c = costs(&x, &y, dim);
        let exact = exact_ot(&c, &a, &b);
        let max_cost = c.iter().cloned().fold(0.0, f64::max);
        let bias = entropy(&a).min(entropy(&b));
        let mut last: Option<Transport> = None;
        for eps in [1e-1, 1e-2, 1e-3, 1e-4] {
            let p = Params {
                max_iter: 2000,
                ..Params::new(eps)
            };
            let r = solve(&x, &a, &y, &b, dim, &p);
            let values = [
                r.ot_eps,
                r.transport_cost,
                r.plan_cost,
                r.marginal_error,
                r.rounding_mass,
            ];
            assert!(values.iter().chain(&r.f).chain(&r.g).all(|v| v.is_finite()));
            assert_eq!((r.f.len(), r.g.len()), (100, 150));
            assert!(
                r.marginal_error <= p.tol || r.status == Status::NotConverged,
                "ε {eps}: {r:?}"
            );
            assert!(
                r.transport_cost >= exact * (1.0 - 1e-6),
                "ε {eps}: {} below the exact {exact}",
                r.transport_cost
            );
            if r.status == Status::NotConverged {
                continue;
            }
            assert_eq!(r.epsilon, eps);
            // The rounding moves at most twice the marginal errors' worth of mass.
            let slack = 2.0 * max_cost * r.marginal_error;
            assert!(r.transport_cost <= exact + eps * bias + slack, "ε {eps}");
            assert!(r.ot_eps >= exact - slack && r.ot_eps <= exact + eps * bias + slack);
            if let Some(prev) = &last {
                let slack = 2.0 * max_cost * (r.marginal_error + prev.marginal_error);
                assert!(
                    r.transport_cost <= prev.transport_cost + slack,
                    "ε {eps}: {} after {} at ε {}",
                    r.transport_cost,
                    prev.transport_cost,
                    prev.epsilon
                );
            }
            last = Some(r);
        }
        assert_eq!(last.unwrap().epsilon, 1e-3, "ε = 1e-3 converges");
    }

    /// A single point each: the only coupling is a ⊗ b, so OT_ε = ⟨π, C⟩ = C exactly.
    #[test]
    fn one_point_each_costs_its_distance() {
        let r = solve(
            &[1.0, 2.0],
            &[1.0],
            &[4.0, 6.0],
            &[1.0],
            2,
            &Params::new(0.1),
        );
        assert_eq!(r.status, Status::Converged);
        for v in [r.ot_eps, r.transport_cost, r.plan_cost, r.f[0] + r.g[0]] {
            assert!((v - 12.5).abs() < 1e-5 * 12.5, "{v} {r:?}");
        }
    }

    /// A point of weight 0 changes nothing (its log-weight is −∞ throughout).
    #[test]
    fn a_zero_weight_point_changes_nothing() {
        let dim = 3;
        let (x, a) = cloud(40, dim, 5);
        let (y, b) = cloud(30, dim, 6);
        let p = Params::new(1e-2);
        let r = solve(&x, &a, &y, &b, dim, &p);
        let mut y0 = y.clone();
        y0.extend([0.5, 0.5, 0.5]);
        let mut b0 = b.clone();
        b0.push(0.0);
        let r0 = solve(&x, &a, &y0, &b0, dim, &p);
        assert_eq!(
            (r.status, r0.status),
            (Status::Converged, Status::Converged)
        );
        assert!(r0.g.iter().chain(&r0.f).all(|v| v.is_finite()));
        for (u, v) in [(r.ot_eps, r0.ot_eps), (r.transport_cost, r0.transport_cost)] {
            assert!((u - v).abs() < 1e-4 * u, "{u} vs {v}");
        }
    }

    /// S_ε(α, α) = 0 and, for a translation by τ, S_ε(α, α + τ) = ‖τ‖²/2 exactly (the cost's
    /// cross term integrates to 0 against any coupling, the self terms are equal); S_ε ≥ 0 for
    /// two different clouds.
    #[test]
    fn divergence_vanishes_on_itself_and_is_not_negative() {
        let dim = 5;
        let (x, a) = cloud(100, dim, 21);
        let (y, b) = cloud(150, dim, 22);
        let tau = [0.25f32, -0.5, 0.0, 0.125, 0.0];
        let shifted: Vec<f32> = x
            .chunks_exact(dim)
            .flat_map(|p| p.iter().zip(&tau).map(|(v, t)| v + t))
            .collect();
        let half_tau2 = 0.5 * tau.iter().map(|t| (*t as f64).powi(2)).sum::<f64>();
        for eps in [1e-1, 2e-2] {
            let p = Params::new(eps);
            let same = divergence(&x, &a, &x, &a, dim, &p);
            assert_eq!(same.status, Status::Converged);
            assert!(same.value.abs() <= 1e-6, "ε {eps}: {same:?}");
            let moved = divergence(&x, &a, &shifted, &a, dim, &p);
            assert_eq!(moved.status, Status::Converged);
            assert!(
                (moved.value - half_tau2).abs() <= 1e-4 * half_tau2,
                "ε {eps}: {} vs {half_tau2}",
                moved.value
            );
            let other = divergence(&x, &a, &y, &b, dim, &p);
            assert_eq!(other.status, Status::Converged);
            assert!(other.value >= -1e-6, "ε {eps}: {other:?}");
            assert!(other.value < other.ot_xy);
        }
    }

    /// Two iterations at ε = 1e-4 cannot converge, nor one more than the annealing stages.
    #[test]
    fn a_capped_run_reports_not_converged() {
        let dim = 5;
        let (x, a) = cloud(100, dim, 11);
        let (y, b) = cloud(150, dim, 12);
        let eps = 1e-4;
        let stages = schedule(
            centre_and_extent(&[&Cloud::new(&x, &a), &Cloud::new(&y, &b)], dim).1,
            eps,
            0.5,
        );
        for cap in [2, stages.len() + 1] {
            let p = Params {
                max_iter: cap,
                ..Params::new(eps)
            };
            let r = solve(&x, &a, &y, &b, dim, &p);
            assert_eq!(r.status, Status::NotConverged);
            assert_eq!(r.iterations, cap);
            assert!(r.marginal_error > p.tol && r.marginal_error.is_finite());
            let d = divergence(&x, &a, &y, &b, dim, &p);
            assert_eq!(d.status, Status::NotConverged);
        }
    }

    #[test]
    fn bad_input_is_refused() {
        let x = [0.0f32, 1.0, 2.0, 3.0];
        let a = [0.5, 0.5];
        let p = Params::new(0.1);
        let run = |x: &[f32], a: &[f64], dim: usize, p: &Params| {
            let c = Cloud::new(x, a);
            let y = Cloud {
                points: &[0.0, 0.0],
                weights: &[1.0],
            };
            (
                sinkhorn(c, y, dim, p).unwrap_err(),
                sinkhorn_divergence(y, c, dim, p).unwrap_err(),
            )
        };
        assert_eq!(run(&x, &a, 0, &p).0, SinkhornError::ZeroDim);
        assert_eq!(run(&[], &[], 2, &p).0, SinkhornError::Empty { cloud: "x" });
        assert!(matches!(run(&x, &a, 3, &p).0, SinkhornError::Shape { .. }));
        assert!(matches!(
            run(&x, &[1.0], 2, &p).0,
            SinkhornError::Shape { .. }
        ));
        assert!(matches!(
            run(&[0.0, f32::NAN, 2.0, 3.0], &a, 2, &p).0,
            SinkhornError::NonFinitePoint { index: 1, .. }
        ));
        assert!(matches!(
            run(&x, &[1.5, -0.5], 2, &p).0,
            SinkhornError::BadWeight { index: 1, .. }
        ));
        assert!(matches!(
            run(&x, &[f64::NAN, 1.0], 2, &p).0,
            SinkhornError::BadWeight { index: 0, .. }
        ));
        let (e, d) = run(&x, &[0.5, 0.5 + 2e-5], 2, &p);
        assert!(matches!(e, SinkhornError::NotNormalised { cloud: "x", .. }));
        assert!(matches!(d, SinkhornError::NotNormalised { cloud: "y", .. }));
        assert!(e.to_string().contains("within 1e-5"), "{e}");
        // Within 1e-5 is accepted (and renormalised).
        let near = [0.5, 0.5 + 5e-6];
        assert!(sinkhorn(Cloud::new(&x, &near), Cloud::new(&x, &a), 2, &p).is_ok());
        for eps in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let q = Params::new(eps);
            assert!(matches!(run(&x, &a, 2, &q).0, SinkhornError::BadEpsilon(_)));
        }
        for scaling in [0.0, 1.0, f64::NAN] {
            let q = Params { scaling, ..p };
            assert!(matches!(run(&x, &a, 2, &q).0, SinkhornError::BadScaling(_)));
        }
        let q = Params { tol: 0.0, ..p };
        assert_eq!(run(&x, &a, 2, &q).0, SinkhornError::BadTolerance(0.0));
        let q = Params { max_iter: 0, ..p };
        assert_eq!(run(&x, &a, 2, &q).1, SinkhornError::NoIterations);
    }
}
