//! Kernel sums: sums over every pair of two point clouds of a Gaussian kernel, computed
//! without ever holding the N × M matrix (the "online" or "map-reduce" scheme of KeOps,
//! Charlier et al., JMLR 2021), and the entropic optimal transport built on them.
//!
//! Points are row-major float32: X `[N, D]`, Y `[M, D]`. The operations ([`Op`]):
//! - **`rbf_mv`**, the Gaussian kernel matrix–vector (or matrix–matrix) product:
//!   out\[i, c\] = Σ_j exp(−‖x_i − y_j‖² / 2σ²) · b\[j, c\], with b `[M, C]`, out `[N, C]`.
//! - **`kde`**, the Gaussian kernel density estimate of the cloud Y at the points X:
//!   out\[i\] = (1/M) Σ_j (2πσ²)^(−D/2) exp(−‖x_i − y_j‖² / 2σ²), `rbf_mv` with b = 1/M and
//!   the normalisation; σ by Scott's rule, σ = M^(−1/(D+4)) · s̄ with s̄ the mean per-axis
//!   standard deviation of Y ([`scott_bandwidth`]).
//! - **`kernel_lse`**, the kernel log-sum-exp: out\[i\] = log Σ_j exp(−‖x_i − y_j‖² / ε + g_j),
//!   with g `[M]`, computed with a running maximum (stable for any spread of g); its gradient
//!   with respect to x is ∂out_i/∂x_i = −(2/ε) (x_i − Σ_j p_ij y_j), p_ij the softmax weights
//!   of row i.
//!
//! Counts: one **kernel evaluation** is one (i, j) pair; throughput is reported in kernel
//! evaluations per second ([`KernelSumCase::evaluations`]), the unit KeOps and the issue's
//! targets use, with FLOPs as counted in [`KernelSumCase::flops`].
//!
//! [`reference`] is the float64 definition; [`cpu`] the multi-threaded float32 implementation;
//! [`cuda`] the float32 CUDA kernels (`kernels/kernel_sums/kernel_sums.cu`);
//! [`sinkhorn`] the log-domain Sinkhorn solver on top of `kernel_lse`.

use std::collections::BTreeMap;

use crate::schema::Param;

pub mod cpu;
pub mod cuda;
pub mod files;
pub mod sinkhorn;

/// What a case computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    /// Gaussian kernel times a matrix `b` `[M, C]`.
    RbfMv,
    /// Gaussian kernel density estimate (normalised).
    Kde,
    /// Kernel log-sum-exp with a weight vector `g` `[M]`.
    KernelLse,
}

impl Op {
    /// Every operation.
    pub const ALL: [Op; 3] = [Op::RbfMv, Op::Kde, Op::KernelLse];

    /// Name in documents: `rbf_mv`, `kde`, `kernel_lse`.
    pub fn as_str(self) -> &'static str {
        match self {
            Op::RbfMv => "rbf_mv",
            Op::Kde => "kde",
            Op::KernelLse => "kernel_lse",
        }
    }

    /// The operation named `s`.
    pub fn parse(s: &str) -> Option<Op> {
        Op::ALL.into_iter().find(|o| o.as_str() == s)
    }
}

/// One kernel-sum case: float32 points X `[n, dim]` and Y `[m, dim]`.
#[derive(Clone, Debug, PartialEq)]
pub struct KernelSumCase {
    /// The operation.
    pub op: Op,
    /// Points in X (output rows) N.
    pub n: usize,
    /// Points in Y (summed over) M.
    pub m: usize,
    /// Dimension D of each point.
    pub dim: usize,
    /// Columns C of `b` (`rbf_mv`; 1 for the others).
    pub cols: usize,
    /// Forward, or forward + the gradient with respect to X (`kernel_lse` only).
    pub grad: bool,
}

impl KernelSumCase {
    /// A forward case with one column.
    pub fn new(op: Op, n: usize, m: usize, dim: usize) -> KernelSumCase {
        KernelSumCase {
            op,
            n,
            m,
            dim,
            cols: 1,
            grad: false,
        }
    }

    /// The case as named parameters for a document row: `op`, `n`, `dim`, `dtype` (`fp32`),
    /// `pass` (`fwd`, or `fwd+bwd` with the gradient), `cols` for `rbf_mv`, and `m` only when
    /// it differs from `n` (so that a sweep over N = M is one series along `n`).
    pub fn params(&self) -> BTreeMap<String, Param> {
        let mut p = BTreeMap::new();
        p.insert("op".into(), Param::Text(self.op.as_str().into()));
        p.insert("n".into(), Param::Int(self.n as i64));
        if self.m != self.n {
            p.insert("m".into(), Param::Int(self.m as i64));
        }
        p.insert("dim".into(), Param::Int(self.dim as i64));
        p.insert("dtype".into(), Param::Text("fp32".into()));
        p.insert(
            "pass".into(),
            Param::Text(if self.grad { "fwd+bwd" } else { "fwd" }.into()),
        );
        if self.op == Op::RbfMv {
            p.insert("cols".into(), Param::Int(self.cols as i64));
        }
        p
    }

    /// The case named by `p` ([`KernelSumCase::params`]; `m` defaults to `n`).
    ///
    /// # Errors
    /// A missing or mistyped parameter, an unknown op, a dtype other than fp32.
    pub fn from_params(p: &BTreeMap<String, Param>) -> Result<KernelSumCase, String> {
        let int = |k: &str| crate::schema::param_size(p, k);
        let text = |k: &str| crate::schema::param_name(p, k);
        let op = text("op")?;
        let op = Op::parse(op).ok_or_else(|| format!("unknown op `{op}`"))?;
        if text("dtype")? != "fp32" {
            return Err(format!(
                "dtype `{}`: kernel sums take fp32 points",
                text("dtype")?
            ));
        }
        let grad = match text("pass")? {
            "fwd" => false,
            "fwd+bwd" => true,
            other => return Err(format!("unknown pass `{other}`")),
        };
        let c = KernelSumCase {
            op,
            n: int("n")?,
            m: if p.contains_key("m") {
                int("m")?
            } else {
                int("n")?
            },
            dim: int("dim")?,
            cols: if op == Op::RbfMv { int("cols")? } else { 1 },
            grad,
        };
        c.validate()?;
        Ok(c)
    }

    /// Checks the sizes.
    ///
    /// # Errors
    /// A zero size, or the gradient asked of an operation other than `kernel_lse`.
    pub fn validate(&self) -> Result<(), String> {
        if self.n == 0 || self.m == 0 || self.dim == 0 || self.cols == 0 {
            return Err(format!("a size is 0: {self:?}"));
        }
        if self.grad && self.op != Op::KernelLse {
            return Err(format!(
                "the gradient is implemented for kernel_lse only, not {}",
                self.op.as_str()
            ));
        }
        Ok(())
    }

    /// Kernel evaluations of one call: N · M (the forward; the gradient pass evaluates each
    /// pair once more, so a `fwd+bwd` call counts 2 · N · M).
    pub fn evaluations(&self) -> f64 {
        let pairs = self.n as f64 * self.m as f64;
        if self.grad {
            2.0 * pairs
        } else {
            pairs
        }
    }

    /// FLOPs of one call, per pair: 3·D for the squared distance (subtract, multiply, add),
    /// 1 for the exponential and its scaling, 2·C for the product with b (`rbf_mv`, `kde`) or
    /// 2 for the running sum (`kernel_lse`), plus 2·D for Σ p·y with the gradient.
    pub fn flops(&self) -> f64 {
        let d = self.dim as f64;
        let per_pair = 3.0 * d
            + 1.0
            + match self.op {
                Op::RbfMv | Op::Kde => 2.0 * self.cols as f64,
                Op::KernelLse => 2.0,
            }
            + if self.grad { 2.0 * d } else { 0.0 };
        per_pair * self.n as f64 * self.m as f64
    }

    /// Bytes one call must read and write at least: X, Y, b or g, and the output (and the
    /// gradient), float32.
    pub fn bytes(&self) -> f64 {
        let (n, m, d, c) = (
            self.n as f64,
            self.m as f64,
            self.dim as f64,
            self.cols as f64,
        );
        let out = match self.op {
            Op::RbfMv => n * c,
            Op::Kde => n,
            Op::KernelLse => n + if self.grad { n * d } else { 0.0 },
        };
        let weights = match self.op {
            Op::RbfMv => m * c,
            Op::Kde => 0.0,
            Op::KernelLse => m,
        };
        4.0 * ((n + m) * d + weights + out)
    }

    /// Elements of the output: N·C (`rbf_mv`), N (`kde`, `kernel_lse`), and N·D more for the
    /// gradient.
    pub fn output_len(&self) -> usize {
        match self.op {
            Op::RbfMv => self.n * self.cols,
            Op::Kde => self.n,
            Op::KernelLse => self.n + if self.grad { self.n * self.dim } else { 0 },
        }
    }

    /// The bandwidth σ of `rbf_mv` for this case's random inputs (uniform in the unit cube):
    /// σ = 0.25·√D, so that a typical pair (‖x − y‖² ≈ D/6) has weight about exp(−1.3) and
    /// sums are dominated by neither the nearest nor all points.
    pub fn sigma(&self) -> f64 {
        0.25 * (self.dim as f64).sqrt()
    }

    /// The ε of `kernel_lse` for this case: 2σ², the same scale as `rbf_mv`'s exponent.
    pub fn epsilon(&self) -> f64 {
        2.0 * self.sigma() * self.sigma()
    }
}

/// Scott's rule bandwidth of the cloud `y` (`[m, dim]`): σ = m^(−1/(dim+4)) · s̄, s̄ the mean
/// over axes of the per-axis standard deviation (Scott, 1992, "Multivariate Density
/// Estimation", §6.3). A cloud with no spread (one point, or all equal) takes s̄ = 1.
pub fn scott_bandwidth(y: &[f32], m: usize, dim: usize) -> f64 {
    let mut sd = 0.0;
    for a in 0..dim {
        let mean = (0..m).map(|j| y[j * dim + a] as f64).sum::<f64>() / m as f64;
        let var = (0..m)
            .map(|j| (y[j * dim + a] as f64 - mean).powi(2))
            .sum::<f64>()
            / m.max(2).saturating_sub(1) as f64;
        sd += var.sqrt();
    }
    let sd = if sd > 0.0 { sd / dim as f64 } else { 1.0 };
    (m as f64).powf(-1.0 / (dim as f64 + 4.0)) * sd
}

/// The inputs of a case: X, Y and the weights (b `[M, C]` for `rbf_mv`, g `[M]` for
/// `kernel_lse`, empty for `kde`).
#[derive(Clone, Debug, PartialEq)]
pub struct Inputs {
    /// X, `[N, D]`.
    pub x: Vec<f32>,
    /// Y, `[M, D]`.
    pub y: Vec<f32>,
    /// b or g.
    pub w: Vec<f32>,
}

impl Inputs {
    /// The runner's inputs: X and Y uniform in [0, 1)^D, b standard normal, g uniform in
    /// [−1, 1); each tensor from its own stream of `seed` (SplitMix64).
    pub fn random(c: &KernelSumCase, seed: u64) -> Inputs {
        let uniform = |n: usize, s: u64| -> Vec<f32> {
            let mut st = s;
            (0..n).map(|_| unit(&mut st) as f32).collect()
        };
        let w = match c.op {
            Op::RbfMv => crate::attention::cpu_flash::normal_f32(c.m * c.cols, seed + 2),
            Op::Kde => Vec::new(),
            Op::KernelLse => uniform(c.m, seed + 2)
                .into_iter()
                .map(|u| 2.0 * u - 1.0)
                .collect(),
        };
        Inputs {
            x: uniform(c.n * c.dim, seed),
            y: uniform(c.m * c.dim, seed + 1),
            w,
        }
    }
}

impl Inputs {
    /// Checks each tensor's length against case `c`: X `[N, D]`, Y `[M, D]`, b `[M, C]`
    /// (`rbf_mv`), g `[M]` (`kernel_lse`), nothing for `kde`.
    ///
    /// # Errors
    /// The first tensor of the wrong length, by name, with both counts.
    pub fn check(&self, c: &KernelSumCase) -> Result<(), String> {
        let (w_name, w_len) = match c.op {
            Op::RbfMv => ("b", c.m * c.cols),
            Op::Kde => ("weights (kde takes none)", 0),
            Op::KernelLse => ("g", c.m),
        };
        for (name, got, want) in [
            ("x", self.x.len(), c.n * c.dim),
            ("y", self.y.len(), c.m * c.dim),
            (w_name, self.w.len(), w_len),
        ] {
            if got != want {
                return Err(format!("{name} has {got} elements; the call needs {want}"));
            }
        }
        Ok(())
    }
}

/// A uniform draw in [0, 1) from a SplitMix64 state.
fn unit(state: &mut u64) -> f64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 53) as f64
}

/// The parameters a call takes besides the points: σ (`rbf_mv`, `kde`) or ε (`kernel_lse`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Scale {
    /// Gaussian bandwidth σ.
    pub sigma: f64,
    /// Log-sum-exp temperature ε.
    pub epsilon: f64,
}

impl Scale {
    /// The case's own: σ = [`KernelSumCase::sigma`] (`kde`: Scott's rule on Y) and
    /// ε = [`KernelSumCase::epsilon`].
    pub fn of(c: &KernelSumCase, inp: &Inputs) -> Scale {
        let sigma = if c.op == Op::Kde {
            scott_bandwidth(&inp.y, c.m, c.dim)
        } else {
            c.sigma()
        };
        Scale {
            sigma,
            epsilon: c.epsilon(),
        }
    }
}

/// The float64 value of output `rows` (each row's `C` values, or the log-sum-exp followed by
/// the D gradient components when the case has the gradient, laid out as
/// [`KernelSumCase::output_len`] does: all N values first, then the N × D gradient).
/// O(rows · M · D): the runner samples rows for large N.
pub fn reference_rows(c: &KernelSumCase, inp: &Inputs, s: Scale, rows: &[usize]) -> Vec<f64> {
    let d = c.dim;
    let sq = |i: usize, j: usize| -> f64 {
        (0..d)
            .map(|a| {
                let t = inp.x[i * d + a] as f64 - inp.y[j * d + a] as f64;
                t * t
            })
            .sum()
    };
    let mut vals = Vec::new();
    let mut grads = Vec::new();
    for &i in rows {
        match c.op {
            Op::RbfMv => {
                let mut acc = vec![0.0f64; c.cols];
                for j in 0..c.m {
                    let k = (-sq(i, j) / (2.0 * s.sigma * s.sigma)).exp();
                    for (a, col) in acc.iter_mut().enumerate() {
                        *col += k * inp.w[j * c.cols + a] as f64;
                    }
                }
                vals.extend(acc);
            }
            Op::Kde => {
                // Shifted by the row's largest term, so that rows far from every point of Y
                // (or many dimensions) do not underflow float64 either.
                let e: Vec<f64> = (0..c.m)
                    .map(|j| -sq(i, j) / (2.0 * s.sigma * s.sigma))
                    .collect();
                let mx = e.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = e.iter().map(|v| (v - mx).exp()).sum();
                vals.push((mx + sum.ln() + kde_log_norm(s.sigma, d, c.m)).exp());
            }
            Op::KernelLse => {
                let e: Vec<f64> = (0..c.m)
                    .map(|j| -sq(i, j) / s.epsilon + inp.w[j] as f64)
                    .collect();
                let mx = e.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = e.iter().map(|v| (v - mx).exp()).sum();
                vals.push(mx + sum.ln());
                if c.grad {
                    for a in 0..d {
                        let py: f64 = (0..c.m)
                            .map(|j| (e[j] - mx).exp() / sum * inp.y[j * d + a] as f64)
                            .sum();
                        grads.push(-2.0 / s.epsilon * (inp.x[i * d + a] as f64 - py));
                    }
                }
            }
        }
    }
    vals.extend(grads);
    vals
}

/// The float64 definition of the whole output (small cases), laid out as
/// [`KernelSumCase::output_len`].
pub fn reference(c: &KernelSumCase, inp: &Inputs, s: Scale) -> Vec<f64> {
    let rows: Vec<usize> = (0..c.n).collect();
    reference_rows(c, inp, s, &rows)
}

/// Why a public kernel-sum call was refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum KernelSumError {
    /// A size, length or scale that cannot describe the call.
    #[error("{0}")]
    Invalid(String),
    /// A compile, launch or out-of-memory error on the device.
    #[error(transparent)]
    Gpu(#[from] crate::gpu::GpuError),
}

/// Runs case `c` on `device` with checked inputs.
fn run_case(
    device: crate::gpu::Device,
    c: &KernelSumCase,
    inp: &Inputs,
    s: Scale,
) -> Result<Vec<f32>, KernelSumError> {
    c.validate().map_err(KernelSumError::Invalid)?;
    inp.check(c).map_err(KernelSumError::Invalid)?;
    let scale = if c.op == Op::KernelLse {
        s.epsilon
    } else {
        s.sigma
    };
    if !(scale > 0.0 && scale.is_finite()) {
        return Err(KernelSumError::Invalid(format!(
            "{} = {scale} is not a positive finite number",
            if c.op == Op::KernelLse {
                "epsilon"
            } else {
                "sigma"
            }
        )));
    }
    match device {
        crate::gpu::Device::Cpu => {
            let mut out = vec![0.0f32; c.output_len()];
            cpu::compute(c, inp, s, &mut out);
            Ok(out)
        }
        crate::gpu::Device::Cuda(gpu) => Ok(cuda::compute(gpu, c, inp, s)?),
    }
}

fn points(len: usize, dim: usize, what: &str) -> Result<usize, KernelSumError> {
    if dim == 0 || !len.is_multiple_of(dim) || len == 0 {
        return Err(KernelSumError::Invalid(format!(
            "{what} has {len} elements: not a non-empty whole number of {dim}-dimensional points"
        )));
    }
    Ok(len / dim)
}

/// The Gaussian kernel matrix–matrix product without the N × M matrix:
/// out\[i, c\] = Σ_j exp(−‖x_i − y_j‖² / 2σ²) · b\[j, c\], for float32 X `[N, dim]`, Y
/// `[M, dim]`, b `[M, cols]` (row-major), returning `[N, cols]`. On the CPU the tiled
/// implementation ([`cpu`]), on CUDA the `online` kernels ([`cuda`]; KeOps-style map-reduce,
/// Charlier et al., JMLR 2021).
///
/// # Errors
/// [`KernelSumError::Invalid`] for lengths that do not form whole points, b of the wrong
/// length, σ ≤ 0; device errors.
pub fn rbf_kernel_mv(
    device: crate::gpu::Device,
    x: &[f32],
    y: &[f32],
    b: &[f32],
    dim: usize,
    sigma: f64,
) -> Result<Vec<f32>, KernelSumError> {
    let (n, m) = (points(x.len(), dim, "x")?, points(y.len(), dim, "y")?);
    let cols = b.len() / m;
    let c = KernelSumCase {
        cols: cols.max(1),
        ..KernelSumCase::new(Op::RbfMv, n, m, dim)
    };
    let inp = Inputs {
        x: x.to_vec(),
        y: y.to_vec(),
        w: b.to_vec(),
    };
    run_case(
        device,
        &c,
        &inp,
        Scale {
            sigma,
            epsilon: 1.0,
        },
    )
}

/// The natural logarithm of the KDE's normalisation, ln((2πσ²)^(−dim/2) / M).
fn kde_log_norm(sigma: f64, dim: usize, m: usize) -> f64 {
    -(dim as f64) / 2.0 * (2.0 * std::f64::consts::PI * sigma * sigma).ln() - (m as f64).ln()
}

/// The Gaussian kernel density of the cloud Y at the points X, `[N]`:
/// (1/M) Σ_j (2πσ²)^(−dim/2) exp(−‖x_i − y_j‖² / 2σ²), σ given or by Scott's rule
/// ([`scott_bandwidth`]) when `None`.
///
/// The `kde` kernels add the unnormalised float32 terms and scale at the end, which is fast
/// but loses a row whose terms all fall below float32's smallest normal number (many
/// dimensions, or a point far from every point of Y): the GPU flushes them to 0. A row whose
/// sum is below M · 2⁻¹⁰⁶ (where the flushed terms could be more than 2⁻²⁰ of it), or every
/// row when the normalisation itself is not a normal float32, is recomputed as
/// exp(log-sum-exp + log normalisation), the kernel log-sum-exp ([`kernel_logsumexp`], g = 0,
/// ε = 2σ²) with the normalisation added in float64: the density then comes out right wherever
/// it is a float32 number (and 0 only where it is below float32's range). [`log_kde`] gives
/// the logarithm.
///
/// # Errors
/// As [`rbf_kernel_mv`].
pub fn kde(
    device: crate::gpu::Device,
    x: &[f32],
    y: &[f32],
    dim: usize,
    sigma: Option<f64>,
) -> Result<Vec<f32>, KernelSumError> {
    let (n, m) = (points(x.len(), dim, "x")?, points(y.len(), dim, "y")?);
    let c = KernelSumCase::new(Op::Kde, n, m, dim);
    let sigma = sigma.unwrap_or_else(|| scott_bandwidth(y, m, dim));
    check_sigma(sigma)?;
    let norm = kde_log_norm(sigma, dim, m).exp() as f32;
    let mut out = if norm.is_normal() {
        let inp = Inputs {
            x: x.to_vec(),
            y: y.to_vec(),
            w: Vec::new(),
        };
        run_case(
            device,
            &c,
            &inp,
            Scale {
                sigma,
                epsilon: 1.0,
            },
        )?
    } else {
        vec![0.0; n]
    };
    let floor = m as f64 * (-106f64).exp2();
    let lost: Vec<usize> = (0..n)
        .filter(|&i| !norm.is_normal() || (out[i] as f64 / norm as f64) < floor)
        .collect();
    if !lost.is_empty() {
        let xs: Vec<f32> = lost
            .iter()
            .flat_map(|&i| x[i * dim..(i + 1) * dim].iter().copied())
            .collect();
        for (&i, l) in lost.iter().zip(log_density(device, &xs, y, dim, m, sigma)?) {
            out[i] = l.exp() as f32;
        }
    }
    Ok(out)
}

/// The natural logarithm of [`kde`], `[N]`: ln(1/M) − (dim/2)·ln(2πσ²) + log Σ_j
/// exp(−‖x_i − y_j‖² / 2σ²), computed as the kernel log-sum-exp ([`kernel_logsumexp`]) with
/// ε = 2σ² and g = 0, so that it never underflows: what to use in many dimensions, where the
/// density itself is often below float32's range.
///
/// # Errors
/// As [`rbf_kernel_mv`].
pub fn log_kde(
    device: crate::gpu::Device,
    x: &[f32],
    y: &[f32],
    dim: usize,
    sigma: Option<f64>,
) -> Result<Vec<f32>, KernelSumError> {
    let m = points(y.len(), dim, "y")?;
    let sigma = sigma.unwrap_or_else(|| scott_bandwidth(y, m, dim));
    check_sigma(sigma)?;
    Ok(log_density(device, x, y, dim, m, sigma)?
        .into_iter()
        .map(|l| l as f32)
        .collect())
}

/// σ must be a positive finite number.
fn check_sigma(sigma: f64) -> Result<(), KernelSumError> {
    if sigma > 0.0 && sigma.is_finite() {
        Ok(())
    } else {
        Err(KernelSumError::Invalid(format!(
            "sigma = {sigma} is not a positive finite number"
        )))
    }
}

/// The KDE's log density at each point of `x`, in float64: the float32 kernel log-sum-exp
/// (g = 0, ε = 2σ²) plus the normalisation's logarithm, for Y of `m` points and a checked σ.
fn log_density(
    device: crate::gpu::Device,
    x: &[f32],
    y: &[f32],
    dim: usize,
    m: usize,
    sigma: f64,
) -> Result<Vec<f64>, KernelSumError> {
    let g = vec![0.0f32; m];
    let lse = kernel_logsumexp(device, x, y, &g, dim, 2.0 * sigma * sigma, false)?;
    let log_norm = kde_log_norm(sigma, dim, m);
    Ok(lse.into_iter().map(|l| l as f64 + log_norm).collect())
}

/// The kernel log-sum-exp, `[N]`: out\[i\] = log Σ_j exp(−‖x_i − y_j‖² / ε + g_j), stable for
/// any spread of g (running maximum), with g `[M]`; with `grad`, also ∂out_i/∂x_i
/// = −(2/ε)(x_i − Σ_j p_ij y_j) appended as `[N, dim]` (the output is then N·(1 + dim)
/// floats).
///
/// # Errors
/// As [`rbf_kernel_mv`], with ε for σ.
pub fn kernel_logsumexp(
    device: crate::gpu::Device,
    x: &[f32],
    y: &[f32],
    g: &[f32],
    dim: usize,
    epsilon: f64,
    grad: bool,
) -> Result<Vec<f32>, KernelSumError> {
    let (n, m) = (points(x.len(), dim, "x")?, points(y.len(), dim, "y")?);
    let c = KernelSumCase {
        grad,
        ..KernelSumCase::new(Op::KernelLse, n, m, dim)
    };
    let inp = Inputs {
        x: x.to_vec(),
        y: y.to_vec(),
        w: g.to_vec(),
    };
    run_case(
        device,
        &c,
        &inp,
        Scale {
            sigma: 1.0,
            epsilon,
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_round_trip_and_bad_ones_are_refused() {
        for op in Op::ALL {
            let c = KernelSumCase {
                cols: if op == Op::RbfMv { 4 } else { 1 },
                grad: op == Op::KernelLse,
                ..KernelSumCase::new(op, 7, 9, 3)
            };
            assert_eq!(KernelSumCase::from_params(&c.params()).unwrap(), c);
            let square = KernelSumCase { m: 7, ..c };
            assert!(!square.params().contains_key("m"));
            assert_eq!(
                KernelSumCase::from_params(&square.params()).unwrap(),
                square
            );
        }
        let mut p = KernelSumCase::new(Op::Kde, 7, 9, 3).params();
        p.insert("pass".into(), Param::Text("fwd+bwd".into()));
        assert!(KernelSumCase::from_params(&p)
            .unwrap_err()
            .contains("kernel_lse only"));
        p.insert("op".into(), Param::Text("sinc".into()));
        assert!(KernelSumCase::from_params(&p).unwrap_err().contains("sinc"));
    }

    /// One point each: the kernel is exp(−d²/2σ²) exactly, the log-sum-exp −d²/ε + g.
    #[test]
    fn one_pair_matches_the_closed_form() {
        let c = KernelSumCase::new(Op::RbfMv, 1, 1, 2);
        let inp = Inputs {
            x: vec![0.0, 0.0],
            y: vec![3.0, 4.0],
            w: vec![2.0],
        };
        let s = Scale {
            sigma: 5.0,
            epsilon: 25.0,
        };
        let r = reference(&c, &inp, s);
        assert!((r[0] - 2.0 * (-0.5f64).exp()).abs() < 1e-15);
        let c = KernelSumCase {
            grad: true,
            ..KernelSumCase::new(Op::KernelLse, 1, 1, 2)
        };
        let r = reference(&c, &inp, s);
        assert!((r[0] - (-1.0 + 2.0)).abs() < 1e-15);
        // One key: p = 1, the gradient is −(2/ε)(x − y).
        assert!((r[1] - 2.0 / 25.0 * 3.0).abs() < 1e-15);
        assert!((r[2] - 2.0 / 25.0 * 4.0).abs() < 1e-15);
    }

    /// The density of many points integrates to about 1 over a grid (1-D).
    #[test]
    fn kde_is_a_density() {
        let m = 400;
        let y: Vec<f32> = (0..m).map(|j| 0.3 + 0.4 * j as f32 / m as f32).collect();
        let n = 2001;
        let x: Vec<f32> = (0..n)
            .map(|i| -1.0 + 3.0 * i as f32 / (n - 1) as f32)
            .collect();
        let c = KernelSumCase::new(Op::Kde, n, m, 1);
        let inp = Inputs {
            x,
            y,
            w: Vec::new(),
        };
        let s = Scale::of(&c, &inp);
        let dens = reference(&c, &inp, s);
        let integral: f64 = dens.iter().sum::<f64>() * 3.0 / (n - 1) as f64;
        assert!((integral - 1.0).abs() < 1e-3, "{integral}");
    }

    /// 161 uniform points in 128 dimensions with Scott's bandwidth: every term of a row is
    /// below float32's smallest normal number, although the densities are float32 numbers.
    /// The kernel alone loses those rows; [`kde`] recovers them through [`log_kde`].
    #[test]
    fn kde_recovers_the_rows_whose_terms_underflow() {
        use crate::gpu::Device;
        let c = KernelSumCase::new(Op::Kde, 9, 161, 128);
        let inp = Inputs::random(&c, 11);
        let s = Scale::of(&c, &inp);
        let want = reference(&c, &inp, s);
        assert!(
            want.iter().all(|&v| (v as f32).is_normal()),
            "the densities are float32 numbers: {want:?}"
        );
        let kernel = run_case(Device::Cpu, &c, &inp, s).unwrap();
        let lost = kernel
            .iter()
            .zip(&want)
            .filter(|(&k, &w)| ((k as f64 - w) / w).abs() > 1e-3)
            .count();
        assert!(lost > 0, "the kernel alone kept every row: {kernel:?}");
        // The exponents are about 85 here: float32 distances put a few 1e-4 on the density
        // (the kernel's own rows have the same at this size).
        let got = kde(Device::Cpu, &inp.x, &inp.y, c.dim, None).unwrap();
        for (g, w) in got.iter().zip(&want) {
            assert!(((*g as f64 - w) / w).abs() < 1e-3, "{g} against {w}");
        }
        let logs = log_kde(Device::Cpu, &inp.x, &inp.y, c.dim, None).unwrap();
        for (l, w) in logs.iter().zip(&want) {
            assert!(
                (*l as f64 - w.ln()).abs() < 1e-4 * w.ln().abs(),
                "{l} against {}",
                w.ln()
            );
        }
    }

    /// Where the normalisation itself is not a normal float32 number (here about 10⁻⁴⁰), every
    /// row goes through the log-sum-exp: the densities, subnormal in float32 here, come out as
    /// float64 rounds them, never NaN.
    #[test]
    fn kde_with_a_normalisation_out_of_float32_range() {
        use crate::gpu::Device;
        let c = KernelSumCase::new(Op::Kde, 5, 40, 96);
        let inp = Inputs::random(&c, 3);
        let s = Scale {
            sigma: 1.0,
            epsilon: 1.0,
        };
        assert!(!((kde_log_norm(1.0, 96, 40)).exp() as f32).is_normal());
        let want = reference(&c, &inp, s);
        let got = kde(Device::Cpu, &inp.x, &inp.y, c.dim, Some(1.0)).unwrap();
        let logs = log_kde(Device::Cpu, &inp.x, &inp.y, c.dim, Some(1.0)).unwrap();
        for ((g, l), w) in got.iter().zip(&logs).zip(&want) {
            assert!(g.is_finite() && *g >= 0.0);
            assert!((*g as f64 - w).abs() <= 1e-4 * w + 3e-45, "{g} against {w}");
            assert!(
                (*l as f64 - w.ln()).abs() < 1e-5 * w.ln().abs(),
                "{l} against {}",
                w.ln()
            );
        }
    }

    #[test]
    fn counts_follow_the_sizes() {
        let c = KernelSumCase::new(Op::KernelLse, 1000, 2000, 3);
        assert_eq!(c.evaluations(), 2e6);
        assert_eq!(c.flops(), 2e6 * (9.0 + 1.0 + 2.0));
        let g = KernelSumCase { grad: true, ..c };
        assert_eq!(g.evaluations(), 4e6);
        assert_eq!(g.output_len(), 4000);
    }

    #[test]
    fn public_functions_check_their_inputs_and_agree_with_the_reference() {
        use crate::gpu::Device;
        let x = [0.0f32, 0.0, 1.0, 1.0];
        let y = [3.0f32, 4.0];
        let out = rbf_kernel_mv(Device::Cpu, &x, &y, &[2.0], 2, 5.0).unwrap();
        assert!((out[0] as f64 - 2.0 * (-0.5f64).exp()).abs() < 1e-6);
        let lse = kernel_logsumexp(Device::Cpu, &x, &y, &[1.0], 2, 25.0, true).unwrap();
        assert_eq!(lse.len(), 2 * 3);
        assert!((lse[0] as f64 - 0.0).abs() < 1e-6, "{lse:?}");
        let e = rbf_kernel_mv(Device::Cpu, &x[..3], &y, &[2.0], 2, 5.0).unwrap_err();
        assert!(e.to_string().starts_with("x has 3 elements"), "{e}");
        let e = kernel_logsumexp(Device::Cpu, &x, &y, &[1.0, 2.0], 2, 1.0, false).unwrap_err();
        assert!(e.to_string().starts_with("g has 2 elements"), "{e}");
        let e = kde(Device::Cpu, &x, &y, 2, Some(0.0)).unwrap_err();
        assert!(e.to_string().contains("sigma"), "{e}");
        assert_eq!(kde(Device::Cpu, &x, &y, 2, None).unwrap().len(), 2);
    }
}
