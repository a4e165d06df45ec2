//! One case of the sequence-mixer grid: which mixer, its sizes, dtype and pass, as the runner's
//! named parameters ([`MixerCase::params`], [`MixerCase::from_params`]), with the FLOP, byte
//! and token counts its throughputs divide by, the random inputs every implementation of the
//! case reads ([`MixerInputs::random`]) and their float64 reference
//! ([`MixerInputs::reference`], the sequential recurrences of [`super::reference`]).

use std::collections::BTreeMap;

use crate::schema::Param;

use super::reference::{
    self, BasedInputs, BasedShape, DeltaInputs, DeltaShape, ScanInputs, ScanShape, SsdInputs,
    SsdShape,
};

/// The mixers the runner measures so far.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Mixer {
    /// Mamba-2's state-space dual layer ([`reference::ssd`]).
    Ssd,
    /// Mamba's selective scan ([`reference::selective_scan`]).
    SelectiveScan,
    /// Gated DeltaNet's gated delta rule ([`reference::gated_delta_rule`]).
    GatedDelta,
    /// Based's linear attention with a sliding-window softmax branch ([`reference::based`]).
    Based,
}

impl Mixer {
    /// Every mixer, in grid order.
    pub const ALL: [Mixer; 4] = [
        Mixer::Ssd,
        Mixer::SelectiveScan,
        Mixer::GatedDelta,
        Mixer::Based,
    ];

    /// The parameter value (`ssd`, `selective_scan`, `gated_delta`, `based`).
    pub fn as_str(self) -> &'static str {
        match self {
            Mixer::Ssd => "ssd",
            Mixer::SelectiveScan => "selective_scan",
            Mixer::GatedDelta => "gated_delta",
            Mixer::Based => "based",
        }
    }

    /// Names of its inputs, in the order the runner writes them (the protocol's order).
    pub fn input_names(self) -> &'static [&'static str] {
        match self {
            Mixer::Ssd => &["x", "dt", "a", "b", "c", "d"],
            Mixer::SelectiveScan => &["u", "delta", "a", "b", "c", "d"],
            Mixer::GatedDelta => &["q", "k", "v", "alpha", "beta"],
            Mixer::Based => &["q", "k", "v"],
        }
    }

    /// Whether the project has a backward of this mixer (all four: SSD, the selective scan,
    /// Based and the gated delta rule): the mixers that take a `fwd+bwd` pass.
    pub fn has_backward(self) -> bool {
        matches!(
            self,
            Mixer::Ssd | Mixer::SelectiveScan | Mixer::Based | Mixer::GatedDelta
        )
    }

    /// The mixer named `s`, if any.
    pub fn parse(s: &str) -> Option<Mixer> {
        Mixer::ALL.into_iter().find(|m| m.as_str() == s)
    }
}

/// What one call computes: the forward, or the forward and the backward (the gradients of
/// ⟨dy, y⟩ with respect to every input, dy given; every mixer: [`Mixer::has_backward`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MixerPass {
    /// The forward.
    Fwd,
    /// The forward, then the backward from dy.
    FwdBwd,
}

impl MixerPass {
    /// The parameter value (`fwd`, `fwd+bwd`).
    pub fn as_str(self) -> &'static str {
        match self {
            MixerPass::Fwd => "fwd",
            MixerPass::FwdBwd => "fwd+bwd",
        }
    }
}

/// Element type of the sequence inputs (X, B, C) and the output; Δ, A, D and the states are
/// float32 in every case (as Mamba's kernels take them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MixerDtype {
    /// float32.
    Fp32,
    /// bfloat16 (8-bit exponent, 7-bit mantissa).
    Bf16,
}

impl MixerDtype {
    /// The parameter value (`fp32`, `bf16`).
    pub fn as_str(self) -> &'static str {
        match self {
            MixerDtype::Fp32 => "fp32",
            MixerDtype::Bf16 => "bf16",
        }
    }

    /// The runner's element codec for this dtype.
    pub fn codec(self) -> crate::attention::Dtype {
        match self {
            MixerDtype::Fp32 => crate::attention::Dtype::F32,
            MixerDtype::Bf16 => crate::attention::Dtype::Bf16,
        }
    }

    /// Bytes per element.
    pub fn bytes(self) -> usize {
        match self {
            MixerDtype::Fp32 => 4,
            MixerDtype::Bf16 => 2,
        }
    }
}

/// One forward call of a mixer: for SSD `heads` × `head_dim` values per token with a state of
/// `head_dim` × `state` per head and B, C shared by `groups` groups; for the selective scan
/// `channels` values per token with `state` states each and B, C shared by all channels; for
/// the gated delta rule and Based `heads` heads with keys and values of `head_dim` (K = V) and
/// a head_dim × head_dim state per head, Based's window branch over the last `window` keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MixerCase {
    /// Which recurrence.
    pub mixer: Mixer,
    /// Batch entries, B.
    pub batch: usize,
    /// Time steps, T.
    pub seq_len: usize,
    /// SSD, gated delta, Based: heads, H (0 for the scan).
    pub heads: usize,
    /// SSD: value width per head, P; gated delta and Based: K = V (0 for the scan).
    pub head_dim: usize,
    /// SSD: groups of heads sharing B and C, G (0 for the scan).
    pub groups: usize,
    /// Selective scan: channels, D (0 for SSD).
    pub channels: usize,
    /// State size per head (SSD) or per channel (scan), N (0 for the others, whose state is
    /// head_dim × head_dim).
    pub state: usize,
    /// Based: the softmax branch's window W (0 for the others).
    pub window: usize,
    /// Element type of the sequence inputs (X, u, B, C, q, k, v) and the output.
    pub dtype: MixerDtype,
    /// The forward, or the forward and the backward.
    pub pass: MixerPass,
}

impl MixerCase {
    /// An SSD case with one group.
    pub fn ssd(batch: usize, seq_len: usize, heads: usize, head_dim: usize, state: usize) -> Self {
        MixerCase {
            mixer: Mixer::Ssd,
            batch,
            seq_len,
            heads,
            head_dim,
            groups: 1,
            channels: 0,
            state,
            window: 0,
            dtype: MixerDtype::Fp32,
            pass: MixerPass::Fwd,
        }
    }

    /// A gated-delta-rule case (K = V = `head_dim`).
    pub fn gated_delta(batch: usize, seq_len: usize, heads: usize, head_dim: usize) -> Self {
        MixerCase {
            mixer: Mixer::GatedDelta,
            state: 0,
            groups: 0,
            ..MixerCase::ssd(batch, seq_len, heads, head_dim, 0)
        }
    }

    /// A Based case (K = V = `head_dim`, window W).
    pub fn based(
        batch: usize,
        seq_len: usize,
        heads: usize,
        head_dim: usize,
        window: usize,
    ) -> Self {
        MixerCase {
            mixer: Mixer::Based,
            window,
            ..MixerCase::gated_delta(batch, seq_len, heads, head_dim)
        }
    }

    /// A selective-scan case.
    pub fn scan(batch: usize, seq_len: usize, channels: usize, state: usize) -> Self {
        MixerCase {
            mixer: Mixer::SelectiveScan,
            batch,
            seq_len,
            heads: 0,
            head_dim: 0,
            groups: 0,
            channels,
            state,
            window: 0,
            dtype: MixerDtype::Fp32,
            pass: MixerPass::Fwd,
        }
    }

    /// The gated delta rule's shape (meaningful for [`Mixer::GatedDelta`]).
    pub fn delta_shape(&self) -> DeltaShape {
        DeltaShape {
            batch: self.batch,
            seq_len: self.seq_len,
            heads: self.heads,
            key_dim: self.head_dim,
            value_dim: self.head_dim,
        }
    }

    /// Based's shape (meaningful for [`Mixer::Based`]).
    pub fn based_shape(&self) -> BasedShape {
        BasedShape {
            batch: self.batch,
            seq_len: self.seq_len,
            heads: self.heads,
            key_dim: self.head_dim,
            value_dim: self.head_dim,
            window: self.window,
        }
    }

    /// The SSD shape (meaningful for [`Mixer::Ssd`]).
    pub fn ssd_shape(&self) -> SsdShape {
        SsdShape {
            batch: self.batch,
            seq_len: self.seq_len,
            heads: self.heads,
            head_dim: self.head_dim,
            state: self.state,
            groups: self.groups,
        }
    }

    /// The scan shape (meaningful for [`Mixer::SelectiveScan`]).
    pub fn scan_shape(&self) -> ScanShape {
        ScanShape {
            batch: self.batch,
            seq_len: self.seq_len,
            channels: self.channels,
            state: self.state,
        }
    }

    /// The runner's parameters: `mixer`, `batch`, `seq_len`, `dtype`, `pass` (`fwd`), and
    /// `heads`, `head_dim`, `state`, `groups` (SSD), `channels`, `state` (scan), `heads`,
    /// `head_dim` (gated delta), `heads`, `head_dim`, `window` (Based).
    pub fn params(&self) -> BTreeMap<String, Param> {
        let mut p = BTreeMap::new();
        let int = |v: usize| Param::Int(v as i64);
        p.insert("mixer".into(), Param::Text(self.mixer.as_str().into()));
        p.insert("batch".into(), int(self.batch));
        p.insert("seq_len".into(), int(self.seq_len));
        p.insert("dtype".into(), Param::Text(self.dtype.as_str().into()));
        p.insert("pass".into(), Param::Text(self.pass.as_str().into()));
        match self.mixer {
            Mixer::Ssd => {
                p.insert("heads".into(), int(self.heads));
                p.insert("head_dim".into(), int(self.head_dim));
                p.insert("state".into(), int(self.state));
                p.insert("groups".into(), int(self.groups));
            }
            Mixer::SelectiveScan => {
                p.insert("channels".into(), int(self.channels));
                p.insert("state".into(), int(self.state));
            }
            Mixer::GatedDelta => {
                p.insert("heads".into(), int(self.heads));
                p.insert("head_dim".into(), int(self.head_dim));
            }
            Mixer::Based => {
                p.insert("heads".into(), int(self.heads));
                p.insert("head_dim".into(), int(self.head_dim));
                p.insert("window".into(), int(self.window));
            }
        }
        p
    }

    /// The case named by `p` ([`MixerCase::params`]).
    ///
    /// # Errors
    /// A missing or mistyped parameter, an unknown mixer or dtype, a pass other than `fwd` or
    /// `fwd+bwd`, `fwd+bwd` for a mixer without a backward ([`Mixer::has_backward`]), or a
    /// shape [`MixerCase::validate`] refuses.
    pub fn from_params(p: &BTreeMap<String, Param>) -> Result<MixerCase, String> {
        let int = |k: &str| crate::schema::param_size(p, k);
        let text = |k: &str| crate::schema::param_name(p, k);
        let name = text("mixer")?;
        let mixer = Mixer::parse(name)
            .ok_or_else(|| format!("unknown mixer `{name}` (ssd, selective_scan)"))?;
        let dtype = match text("dtype")? {
            "fp32" => MixerDtype::Fp32,
            "bf16" => MixerDtype::Bf16,
            other => return Err(format!("dtype `{other}`: the mixers take fp32 or bf16")),
        };
        let pass = match text("pass")? {
            "fwd" => MixerPass::Fwd,
            "fwd+bwd" if mixer.has_backward() => MixerPass::FwdBwd,
            "fwd+bwd" => {
                return Err(format!(
                    "pass `fwd+bwd` of {}: the project has no backward of it",
                    mixer.as_str()
                ))
            }
            other => return Err(format!("pass `{other}`: fwd or fwd+bwd")),
        };
        let mut c = match mixer {
            Mixer::Ssd => MixerCase {
                groups: int("groups")?,
                ..MixerCase::ssd(
                    int("batch")?,
                    int("seq_len")?,
                    int("heads")?,
                    int("head_dim")?,
                    int("state")?,
                )
            },
            Mixer::SelectiveScan => MixerCase::scan(
                int("batch")?,
                int("seq_len")?,
                int("channels")?,
                int("state")?,
            ),
            Mixer::GatedDelta => MixerCase::gated_delta(
                int("batch")?,
                int("seq_len")?,
                int("heads")?,
                int("head_dim")?,
            ),
            Mixer::Based => MixerCase::based(
                int("batch")?,
                int("seq_len")?,
                int("heads")?,
                int("head_dim")?,
                int("window")?,
            ),
        };
        c.dtype = dtype;
        c.pass = pass;
        c.validate()?;
        Ok(c)
    }

    /// Checks the sizes: none 0 (seq_len included: a grid case has at least one step; Based's
    /// window too), and for SSD heads a multiple of groups.
    ///
    /// # Errors
    /// The fault, with the case.
    pub fn validate(&self) -> Result<(), String> {
        let sizes = match self.mixer {
            Mixer::Ssd => vec![self.heads, self.head_dim, self.groups, self.state],
            Mixer::SelectiveScan => vec![self.channels, self.state],
            Mixer::GatedDelta => vec![self.heads, self.head_dim],
            Mixer::Based => vec![self.heads, self.head_dim, self.window],
        };
        if self.batch == 0 || self.seq_len == 0 || sizes.contains(&0) {
            return Err(format!("a size is 0: {self:?}"));
        }
        if self.mixer == Mixer::Ssd && !self.heads.is_multiple_of(self.groups) {
            return Err(format!(
                "heads {} is not a multiple of groups {}",
                self.heads, self.groups
            ));
        }
        Ok(())
    }

    /// Output values per token: H·P (SSD), D (scan), H·V (gated delta, Based).
    pub fn width(&self) -> usize {
        match self.mixer {
            Mixer::SelectiveScan => self.channels,
            _ => self.heads * self.head_dim,
        }
    }

    /// State elements of one sequence: H·P·N (SSD), D·N (scan), H·V·K (gated delta, Based's
    /// linear branch).
    pub fn state_elements(&self) -> usize {
        match self.mixer {
            Mixer::Ssd | Mixer::SelectiveScan => self.width() * self.state,
            Mixer::GatedDelta | Mixer::Based => self.width() * self.head_dim,
        }
    }

    /// Its inputs in protocol order: name, whether the file holds the case's dtype (sequence
    /// inputs) rather than float32, and shape (see [`MixerInputs`]).
    pub fn input_specs(&self) -> Vec<(&'static str, bool, Vec<usize>)> {
        let (bs, t, h, k) = (self.batch, self.seq_len, self.heads, self.head_dim);
        let (g, n, d) = (self.groups, self.state, self.channels);
        let shapes: Vec<(bool, Vec<usize>)> = match self.mixer {
            Mixer::Ssd => vec![
                (true, vec![bs, t, h, k]),
                (false, vec![bs, t, h]),
                (false, vec![h]),
                (true, vec![bs, t, g, n]),
                (true, vec![bs, t, g, n]),
                (false, vec![h]),
            ],
            Mixer::SelectiveScan => vec![
                (true, vec![bs, t, d]),
                (false, vec![bs, t, d]),
                (false, vec![d, n]),
                (true, vec![bs, t, n]),
                (true, vec![bs, t, n]),
                (false, vec![d]),
            ],
            Mixer::GatedDelta => vec![
                (true, vec![bs, t, h, k]),
                (true, vec![bs, t, h, k]),
                (true, vec![bs, t, h, k]),
                (false, vec![bs, t, h]),
                (false, vec![bs, t, h]),
            ],
            Mixer::Based => vec![
                (true, vec![bs, t, h, k]),
                (true, vec![bs, t, h, k]),
                (true, vec![bs, t, h, k]),
            ],
        };
        let mut specs: Vec<(&'static str, bool, Vec<usize>)> = self
            .mixer
            .input_names()
            .iter()
            .zip(shapes)
            .map(|(name, (seq, shape))| (*name, seq, shape))
            .collect();
        if self.pass == MixerPass::FwdBwd {
            // The cotangent of the output, last (the protocol's order for a backward job), of
            // the output's shape: [B, T, D] for the scan, [B, T, H, head_dim] for the others.
            let out = match self.mixer {
                Mixer::SelectiveScan => vec![bs, t, d],
                Mixer::Ssd | Mixer::GatedDelta | Mixer::Based => vec![bs, t, h, k],
            };
            specs.push(("dy", true, out));
        }
        specs
    }

    /// Based: Σ over the steps of the keys the window branch sees, min(t + 1, W) summed over
    /// t < T (0 for the other mixers).
    pub fn window_pairs(&self) -> f64 {
        if self.mixer != Mixer::Based {
            return 0.0;
        }
        let (t, w) = (self.seq_len as f64, self.window.min(self.seq_len) as f64);
        w * (w + 1.0) / 2.0 + (t - w) * w
    }

    /// Tokens of one call, B·T.
    pub fn tokens(&self) -> f64 {
        self.batch as f64 * self.seq_len as f64
    }

    /// FLOPs of one call as the recurrence counts them, per token and state element: SSD 5
    /// (3 for the update, decay times state plus Δ·x·B with Δ·x formed once per value; 2 for
    /// the read-out by C), the selective scan 6 (its per-element Δ·A as well; exponentials not
    /// counted), the gated delta rule 7 (S·k 2, the update α·S + w·kᵀ 3, the read-out S·q 2),
    /// Based's linear branch 4 (v·kᵀ added, S·q); Based's window branch adds 4·K per (query,
    /// key) pair it sees ([`MixerCase::window_pairs`] per batch entry and head: q·k and the
    /// weighted sum of v). A chunked kernel does more arithmetic than this (the intra-chunk
    /// products); the count is the same for every implementation of a case. A forward and
    /// backward call counts three times the forward.
    pub fn flops(&self) -> f64 {
        let per = match self.mixer {
            Mixer::Ssd => 5.0,
            Mixer::SelectiveScan => 6.0,
            Mixer::GatedDelta => 7.0,
            Mixer::Based => 4.0,
        };
        let window =
            4.0 * self.head_dim as f64 * self.window_pairs() * (self.batch * self.heads) as f64;
        let forward = per * self.tokens() * self.state_elements() as f64 + window;
        match self.pass {
            MixerPass::Fwd => forward,
            // The backward counted as twice the forward (a vector-Jacobian product does about
            // two products per product of the forward), as for attention.
            MixerPass::FwdBwd => 3.0 * forward,
        }
    }

    /// Bytes one call must move at least: X (u), B, C and Y in the case's dtype, Δ in float32
    /// (per head for SSD, per channel for the scan), A and D in float32 (A per channel and
    /// state for the scan); for the gated delta rule q, k, v and o in the case's dtype and α, β
    /// in float32 per head and token; for Based q, k, v and o; no initial or final state. A
    /// forward and backward adds a second read of the inputs, dy, and the float32 gradients.
    pub fn bytes(&self) -> f64 {
        let e = self.dtype.bytes() as f64;
        let t = self.tokens();
        let w = self.width() as f64;
        let n = self.state as f64;
        match self.mixer {
            Mixer::Ssd => {
                let g = self.groups as f64;
                let h = self.heads as f64;
                let forward = t * (2.0 * w * e + 2.0 * g * n * e + 4.0 * h) + 8.0 * h;
                match self.pass {
                    MixerPass::Fwd => forward,
                    // The backward reads X, B, C, Δ and dy, and writes dX ([B, T, H, P]), dΔ
                    // ([B, T, H]), dB and dC ([B, T, G, N]), dA and dD in float32.
                    MixerPass::FwdBwd => {
                        forward
                            + t * (2.0 * w * e + 2.0 * g * n * e + 4.0 * h)
                            + t * (4.0 * w + 4.0 * h + 8.0 * g * n)
                            + 8.0 * h
                    }
                }
            }
            Mixer::SelectiveScan => {
                let forward = t * (2.0 * w * e + 2.0 * n * e + 4.0 * w) + 4.0 * w * (n + 1.0);
                match self.pass {
                    MixerPass::Fwd => forward,
                    // The backward reads the inputs and dy again and writes du and dΔ
                    // ([B, T, D]), dB and dC ([B, T, N]), dA and dD in float32.
                    MixerPass::FwdBwd => {
                        forward
                            + t * (2.0 * w * e + 2.0 * n * e + 4.0 * w)
                            + t * (w * e + 8.0 * w + 8.0 * n)
                            + 4.0 * w * (n + 1.0)
                    }
                }
            }
            Mixer::GatedDelta => {
                let forward = t * (4.0 * w * e + 8.0 * self.heads as f64);
                match self.pass {
                    MixerPass::Fwd => forward,
                    // The backward reads q, k, v, α, β and dy again and writes dq, dk, dv,
                    // dα and dβ in float32.
                    MixerPass::FwdBwd => {
                        forward
                            + t * (4.0 * w * e + 8.0 * self.heads as f64)
                            + t * (12.0 * w + 8.0 * self.heads as f64)
                    }
                }
            }
            Mixer::Based => match self.pass {
                MixerPass::Fwd => t * 4.0 * w * e,
                // The backward reads q, k, v and dy again and writes dq, dk and dv in float32.
                MixerPass::FwdBwd => t * (8.0 * w * e + 12.0 * w),
            },
        }
    }

    /// A short label for progress lines (`ssd B4 T4096 H8 P64 N64 bf16`).
    pub fn label(&self) -> String {
        let label = self.forward_label();
        match self.pass {
            MixerPass::Fwd => label,
            MixerPass::FwdBwd => format!("{label} fwd+bwd"),
        }
    }

    /// [`MixerCase::label`] without the pass.
    fn forward_label(&self) -> String {
        match self.mixer {
            Mixer::Ssd => format!(
                "ssd B{} T{} H{} P{} N{} G{} {}",
                self.batch,
                self.seq_len,
                self.heads,
                self.head_dim,
                self.state,
                self.groups,
                self.dtype.as_str()
            ),
            Mixer::SelectiveScan => format!(
                "selective_scan B{} T{} D{} N{} {}",
                self.batch,
                self.seq_len,
                self.channels,
                self.state,
                self.dtype.as_str()
            ),
            Mixer::GatedDelta => format!(
                "gated_delta B{} T{} H{} K=V{} {}",
                self.batch,
                self.seq_len,
                self.heads,
                self.head_dim,
                self.dtype.as_str()
            ),
            Mixer::Based => format!(
                "based B{} T{} H{} K=V{} W{} {}",
                self.batch,
                self.seq_len,
                self.heads,
                self.head_dim,
                self.window,
                self.dtype.as_str()
            ),
        }
    }
}

/// One input tensor of a case: its name (the protocol's), values (already rounded to `dtype`),
/// element type and shape.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    /// Name, from [`Mixer::input_names`].
    pub name: &'static str,
    /// Values, row-major.
    pub values: Vec<f32>,
    /// Element type of its file: the case's for sequence inputs, float32 for the rest.
    pub dtype: MixerDtype,
    /// Shape.
    pub shape: Vec<usize>,
}

/// The inputs of one case, as the values every implementation reads, in the order of
/// [`Mixer::input_names`] and the layouts of [`super::reference`]:
/// - SSD: `x` `[B, T, H, P]`, `dt` `[B, T, H]`, `a` `[H]`, `b` and `c` `[B, T, G, N]`, `d` `[H]`;
/// - selective scan: `u` `[B, T, D]`, `delta` `[B, T, D]`, `a` `[D, N]`, `b` and `c` `[B, T, N]`,
///   `d` `[D]`;
/// - gated delta: `q`, `k` `[B, T, H, K]`, `v` `[B, T, H, V]`, `alpha`, `beta` `[B, T, H]`;
/// - Based: `q`, `k` `[B, T, H, K]`, `v` `[B, T, H, V]`, and the score factor `scale`.
#[derive(Clone, Debug, PartialEq)]
pub struct MixerInputs {
    /// The tensors, in protocol order.
    pub tensors: Vec<Tensor>,
    /// Based's factor on q·k (1/√K); 1 for the others.
    pub scale: f64,
}

/// `n` draws from U[lo, hi), SplitMix64 from `seed`.
fn uniform(n: usize, lo: f64, hi: f64, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x2545_F491_4F6C_DD1D) ^ 0x5DEE_CE66;
    (0..n)
        .map(|_| {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            let u = (z >> 11) as f64 / (1u64 << 53) as f64;
            (lo + (hi - lo) * u) as f32
        })
        .collect()
}

impl MixerInputs {
    /// Random inputs of case `c` from `seed`, each tensor from its own stream, sequence inputs
    /// rounded to the case's dtype (the ranges of the mixers' GPU tests):
    /// - SSD and the scan: X (u), B, C uniform in [−1, 1), Δ in [0.01, 0.2), A in
    ///   [−4, −0.5) (every step decays the state by exp(Δ·A) in (0.45, 0.995)), D in [−1, 1);
    /// - gated delta: q uniform in [−1, 1) times 1/√K, k uniform then L2-normalised per token
    ///   and head (as the layer does), v in [−1, 1), α in [0.8, 1), β in [0, 1);
    /// - Based: q, k, v uniform in [−1, 1), scale 1/√K;
    /// - a forward and backward case also dy, the output's cotangent, uniform in [−1, 1)
    ///   (rounded to the case's dtype).
    pub fn random(c: &MixerCase, seed: u64) -> MixerInputs {
        let bt = c.batch * c.seq_len;
        let round = |v: Vec<f32>| -> Vec<f32> {
            match c.dtype {
                MixerDtype::Fp32 => v,
                MixerDtype::Bf16 => {
                    let codec = c.dtype.codec();
                    codec
                        .decode_all(&codec.encode_all(&v))
                        .into_iter()
                        .map(|x| x as f32)
                        .collect()
                }
            }
        };
        let (h, k) = (c.heads, c.head_dim);
        let mut scale = 1.0;
        // Values in protocol order (shapes and dtypes from `input_specs`).
        let values: Vec<Vec<f32>> = match c.mixer {
            Mixer::Ssd => {
                let gn = c.groups * c.state;
                vec![
                    uniform(bt * h * k, -1.0, 1.0, seed),
                    uniform(bt * h, 0.01, 0.2, seed + 1),
                    uniform(h, -4.0, -0.5, seed + 2),
                    uniform(bt * gn, -1.0, 1.0, seed + 3),
                    uniform(bt * gn, -1.0, 1.0, seed + 4),
                    uniform(h, -1.0, 1.0, seed + 5),
                ]
            }
            Mixer::SelectiveScan => {
                let (d, n) = (c.channels, c.state);
                vec![
                    uniform(bt * d, -1.0, 1.0, seed),
                    uniform(bt * d, 0.01, 0.2, seed + 1),
                    uniform(d * n, -4.0, -0.5, seed + 2),
                    uniform(bt * n, -1.0, 1.0, seed + 3),
                    uniform(bt * n, -1.0, 1.0, seed + 4),
                    uniform(d, -1.0, 1.0, seed + 5),
                ]
            }
            Mixer::GatedDelta => {
                let inv = 1.0 / (k as f64).sqrt();
                let mut kk = uniform(bt * h * k, -1.0, 1.0, seed + 1);
                for row in kk.chunks_exact_mut(k) {
                    let norm = row.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-6);
                    row.iter_mut().for_each(|x| *x /= norm);
                }
                vec![
                    uniform(bt * h * k, -inv, inv, seed),
                    kk,
                    uniform(bt * h * k, -1.0, 1.0, seed + 2),
                    uniform(bt * h, 0.8, 1.0, seed + 3),
                    uniform(bt * h, 0.0, 1.0, seed + 4),
                ]
            }
            Mixer::Based => {
                scale = 1.0 / (k as f64).sqrt();
                vec![
                    uniform(bt * h * k, -1.0, 1.0, seed),
                    uniform(bt * h * k, -1.0, 1.0, seed + 1),
                    uniform(bt * h * k, -1.0, 1.0, seed + 2),
                ]
            }
        };
        let mut values = values;
        if c.pass == MixerPass::FwdBwd {
            values.push(uniform(bt * c.width(), -1.0, 1.0, seed + 6));
        }
        let tensors = c
            .input_specs()
            .into_iter()
            .zip(values)
            .map(|((name, seq, shape), v)| Tensor {
                name,
                values: if seq { round(v) } else { v },
                dtype: if seq { c.dtype } else { MixerDtype::Fp32 },
                shape,
            })
            .collect();
        MixerInputs { tensors, scale }
    }

    /// The values of tensor `name`, or an empty slice when the case has none of that name.
    pub fn get(&self, name: &str) -> &[f32] {
        self.tensors
            .iter()
            .find(|t| t.name == name)
            .map_or(&[], |t| t.values.as_slice())
    }

    /// The values of tensor `name` as float64 (empty when the case has none of that name).
    fn float64(&self, name: &str) -> Vec<f64> {
        self.get(name).iter().map(|&x| x as f64).collect()
    }

    /// Calls `run` with the selective scan's inputs (u, Δ, A, B, C, D; zero initial state) as
    /// float64, as the references read them.
    fn with_scan_inputs<R>(&self, run: impl FnOnce(ScanInputs) -> R) -> R {
        let (u, dt, a) = (self.float64("u"), self.float64("delta"), self.float64("a"));
        let (b, cc, d) = (self.float64("b"), self.float64("c"), self.float64("d"));
        run(ScanInputs {
            u: &u,
            delta: &dt,
            a: &a,
            b: &b,
            c: &cc,
            d: Some(&d),
            initial_state: None,
        })
    }

    /// Calls `run` with SSD's inputs (X, Δ, A, B, C, D; zero initial state) as float64, as the
    /// references read them.
    fn with_ssd_inputs<R>(&self, run: impl FnOnce(SsdInputs) -> R) -> R {
        let (x, dt, a) = (self.float64("x"), self.float64("dt"), self.float64("a"));
        let (b, cc, d) = (self.float64("b"), self.float64("c"), self.float64("d"));
        run(SsdInputs {
            x: &x,
            dt: &dt,
            a: &a,
            b: &b,
            c: &cc,
            d: Some(&d),
            initial_state: None,
        })
    }

    /// The float64 gradients of ⟨dy, y⟩ for a forward and backward case `c`, zero initial
    /// state: per gradient its name, the input it is the gradient of, values and shape, in the
    /// order of the inputs:
    /// - SSD ([`super::gradients::ssd_backward`]): dX `[B, T, H, P]`, dΔ `[B, T, H]`, dA `[H]`,
    ///   dB and dC `[B, T, G, N]`, dD `[H]`;
    /// - the selective scan ([`super::gradients::selective_scan_backward`]): du `[B, T, D]`,
    ///   dΔ `[B, T, D]`, dA `[D, N]`, dB and dC `[B, T, N]`, dD `[D]`;
    /// - Based ([`super::based_gradients::based_backward`]): dq, dk and dv `[B, T, H, K]`;
    /// - the gated delta rule ([`super::delta_gradients::gated_delta_rule_backward`]): dq, dk
    ///   and dv `[B, T, H, K]`, dα and dβ `[B, T, H]`.
    ///
    /// # Errors
    /// A case that is not a forward and backward case of a mixer with a backward; inputs whose
    /// lengths do not fit `c`.
    #[allow(clippy::type_complexity)]
    pub fn gradient_references(
        &self,
        c: &MixerCase,
    ) -> Result<Vec<(&'static str, &'static str, Vec<f64>, Vec<usize>)>, String> {
        if !c.mixer.has_backward() || c.pass != MixerPass::FwdBwd {
            return Err(format!(
                "gradient references: {} has no backward case",
                c.label()
            ));
        }
        let dy = self.float64("dy");
        let (bs, t) = (c.batch, c.seq_len);
        if c.mixer == Mixer::GatedDelta {
            let (q, k, v) = (self.float64("q"), self.float64("k"), self.float64("v"));
            let (alpha, beta) = (self.float64("alpha"), self.float64("beta"));
            let inp = DeltaInputs {
                q: &q,
                k: &k,
                v: &v,
                alpha: &alpha,
                beta: &beta,
                initial_state: None,
            };
            let g =
                super::delta_gradients::gated_delta_rule_backward(c.delta_shape(), inp, &dy, None)?;
            let (shape, per_head) = (vec![bs, t, c.heads, c.head_dim], vec![bs, t, c.heads]);
            return Ok(vec![
                ("dq", "q", g.d_q, shape.clone()),
                ("dk", "k", g.d_k, shape.clone()),
                ("dv", "v", g.d_v, shape),
                ("dalpha", "alpha", g.d_alpha, per_head.clone()),
                ("dbeta", "beta", g.d_beta, per_head),
            ]);
        }
        if c.mixer == Mixer::Based {
            let (q, k, v) = (self.float64("q"), self.float64("k"), self.float64("v"));
            let inp = BasedInputs {
                q: &q,
                k: &k,
                v: &v,
                scale: self.scale,
                initial_state: None,
            };
            let g = super::based_gradients::based_backward(c.based_shape(), inp, &dy, None)?;
            let shape = vec![bs, t, c.heads, c.head_dim];
            return Ok(vec![
                ("dq", "q", g.dq, shape.clone()),
                ("dk", "k", g.dk, shape.clone()),
                ("dv", "v", g.dv, shape),
            ]);
        }
        if c.mixer == Mixer::Ssd {
            let g = self.with_ssd_inputs(|inp| {
                super::gradients::ssd_backward(c.ssd_shape(), inp, &dy, None)
            })?;
            let (h, gn) = (c.heads, [c.groups, c.state]);
            return Ok(vec![
                ("dx", "x", g.dx, vec![bs, t, h, c.head_dim]),
                ("ddt", "dt", g.ddt, vec![bs, t, h]),
                ("dA", "a", g.da, vec![h]),
                ("dB", "b", g.db, vec![bs, t, gn[0], gn[1]]),
                ("dC", "c", g.dc, vec![bs, t, gn[0], gn[1]]),
                ("dD", "d", g.dd.unwrap_or_default(), vec![h]),
            ]);
        }
        let g = self.with_scan_inputs(|inp| {
            super::gradients::selective_scan_backward(c.scan_shape(), inp, &dy, None)
        })?;
        let (ch, n) = (c.channels, c.state);
        Ok(vec![
            ("du", "u", g.du, vec![bs, t, ch]),
            ("ddelta", "delta", g.ddelta, vec![bs, t, ch]),
            ("dA", "a", g.da, vec![ch, n]),
            ("dB", "b", g.db, vec![bs, t, n]),
            ("dC", "c", g.dc, vec![bs, t, n]),
            ("dD", "d", g.dd.unwrap_or_default(), vec![ch]),
        ])
    }

    /// The float64 output of case `c` on these inputs, from a zero state: the sequential
    /// recurrence ([`reference::ssd`], [`reference::selective_scan`],
    /// [`reference::gated_delta_rule`], [`reference::based`]).
    ///
    /// # Errors
    /// Inputs whose lengths do not fit `c` (the message names the input).
    pub fn reference(&self, c: &MixerCase) -> Result<Vec<f64>, String> {
        let f = |name: &str| -> Vec<f64> { self.get(name).iter().map(|&x| x as f64).collect() };
        match c.mixer {
            Mixer::Ssd => {
                self.with_ssd_inputs(|inp| reference::ssd(c.ssd_shape(), inp).map(|(y, _)| y))
            }
            Mixer::SelectiveScan => self.with_scan_inputs(|inp| {
                reference::selective_scan(c.scan_shape(), inp).map(|(y, _)| y)
            }),
            Mixer::GatedDelta => {
                let (q, k, v, alpha, beta) = (f("q"), f("k"), f("v"), f("alpha"), f("beta"));
                let inp = DeltaInputs {
                    q: &q,
                    k: &k,
                    v: &v,
                    alpha: &alpha,
                    beta: &beta,
                    initial_state: None,
                };
                reference::gated_delta_rule(c.delta_shape(), inp).map(|(o, _)| o)
            }
            Mixer::Based => {
                let (q, k, v) = (f("q"), f("k"), f("v"));
                let inp = BasedInputs {
                    q: &q,
                    k: &k,
                    v: &v,
                    scale: self.scale,
                    initial_state: None,
                };
                reference::based(c.based_shape(), inp).map(|(o, _)| o)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_round_trip_and_bad_cases_are_refused() {
        let mut ssd = MixerCase::ssd(2, 65, 4, 8, 16);
        ssd.groups = 2;
        ssd.dtype = MixerDtype::Bf16;
        assert_eq!(MixerCase::from_params(&ssd.params()), Ok(ssd));
        let scan = MixerCase::scan(1, 7, 32, 16);
        assert_eq!(MixerCase::from_params(&scan.params()), Ok(scan));
        for c in [
            MixerCase::gated_delta(1, 9, 2, 8),
            MixerCase::based(1, 9, 2, 8, 4),
        ] {
            assert_eq!(MixerCase::from_params(&c.params()), Ok(c));
        }
        let mut p = MixerCase::based(1, 9, 2, 8, 4).params();
        p.insert("window".into(), Param::Int(0));
        assert!(MixerCase::from_params(&p)
            .unwrap_err()
            .contains("size is 0"));
        let mut p = ssd.params();
        p.insert("groups".into(), Param::Int(3));
        assert!(MixerCase::from_params(&p)
            .unwrap_err()
            .contains("multiple of groups"));
        // Every mixer has a backward (fwd+bwd), and refuses any other pass.
        let mut p = scan.params();
        p.insert("pass".into(), Param::Text("fwd+bwd".into()));
        let back = MixerCase::from_params(&p).unwrap();
        assert_eq!(back.pass, MixerPass::FwdBwd);
        assert_eq!(back.params(), p);
        assert!(back.label().ends_with("fwd+bwd"));
        let mut q = MixerCase::gated_delta(1, 9, 2, 8).params();
        q.insert("pass".into(), Param::Text("fwd+bwd".into()));
        assert_eq!(MixerCase::from_params(&q).unwrap().pass, MixerPass::FwdBwd);
        q.insert("pass".into(), Param::Text("bwd".into()));
        assert!(MixerCase::from_params(&q)
            .unwrap_err()
            .contains("fwd or fwd+bwd"));
        p.insert("mixer".into(), Param::Text("mamba3".into()));
        assert!(MixerCase::from_params(&p)
            .unwrap_err()
            .contains("unknown mixer"));
    }

    #[test]
    fn counts_follow_the_shapes() {
        // SSD, B1 T2 H2 P3 N4 G1 fp32: 5 FLOPs per token and state element.
        let c = MixerCase::ssd(1, 2, 2, 3, 4);
        assert_eq!(c.flops(), 5.0 * 2.0 * 24.0);
        // Per token: X and Y 2·6·4, B and C 2·4·4, Δ 2·4; A and D 2·4 each once.
        assert_eq!(c.bytes(), 2.0 * (48.0 + 32.0 + 8.0) + 16.0);
        let s = MixerCase::scan(1, 3, 2, 4);
        assert_eq!(s.flops(), 6.0 * 3.0 * 8.0);
        // Per token: u and y 2·2·4, B and C 2·4·4, Δ 2·4; A 2·4·4 and D 2·4 once.
        assert_eq!(s.bytes(), 3.0 * (16.0 + 32.0 + 8.0) + 4.0 * 2.0 * 5.0);
        // Gated delta, B1 T2 H2 K=V3: 7 per token and state element (2·3·3 = 18).
        let d = MixerCase::gated_delta(1, 2, 2, 3);
        assert_eq!(d.flops(), 7.0 * 2.0 * 18.0);
        assert_eq!(d.bytes(), 2.0 * (4.0 * 6.0 * 4.0 + 8.0 * 2.0));
        // Its fwd+bwd: three times the FLOPs; the inputs read twice, dy, and dq, dk, dv (12
        // bytes per value of a token) and dα, dβ (8 per head) in float32.
        let mut db = d;
        db.pass = MixerPass::FwdBwd;
        assert_eq!(db.flops(), 3.0 * d.flops());
        assert_eq!(db.bytes(), 2.0 * d.bytes() + 2.0 * (12.0 * 6.0 + 8.0 * 2.0));
        // Based, T5 W3: the window sees 1 + 2 + 3 + 3 + 3 = 12 keys per head.
        let b = MixerCase::based(1, 5, 2, 3, 3);
        assert_eq!(b.window_pairs(), 12.0);
        assert_eq!(b.flops(), 4.0 * 5.0 * 18.0 + 4.0 * 3.0 * 12.0 * 2.0);
        assert_eq!(MixerCase::based(1, 2, 1, 1, 8).window_pairs(), 3.0);
    }

    #[test]
    fn bf16_inputs_are_rounded_and_the_reference_runs() {
        let mut c = MixerCase::ssd(1, 5, 2, 4, 8);
        c.dtype = MixerDtype::Bf16;
        let inp = MixerInputs::random(&c, 3);
        // bf16 keeps 8 significant bits: every X is a multiple of 2^-8 of its binade.
        assert!(inp.get("x").iter().all(|&v| v.to_bits() & 0xFFFF == 0));
        assert!(inp.get("dt").iter().any(|&v| v.to_bits() & 0xFFFF != 0));
        assert!(inp.get("dt").iter().all(|&v| (0.01..0.2).contains(&v)));
        let y = inp.reference(&c).unwrap();
        assert_eq!(y.len(), 5 * 8);
        assert!(y.iter().all(|v| v.is_finite()) && y.iter().any(|&v| v != 0.0));
        let s = MixerCase::scan(2, 3, 4, 8);
        assert_eq!(MixerInputs::random(&s, 1).reference(&s).unwrap().len(), 24);
        for c in [
            MixerCase::gated_delta(2, 5, 3, 4),
            MixerCase::based(2, 5, 3, 4, 2),
        ] {
            let inp = MixerInputs::random(&c, 1);
            let names: Vec<&str> = inp.tensors.iter().map(|t| t.name).collect();
            assert_eq!(names, c.mixer.input_names());
            let o = inp.reference(&c).unwrap();
            assert_eq!(o.len(), 2 * 5 * 3 * 4);
            assert!(o.iter().all(|v| v.is_finite()) && o.iter().any(|&v| v != 0.0));
        }
        // The delta rule's keys are unit vectors per token and head.
        let c = MixerCase::gated_delta(1, 3, 2, 8);
        let inp = MixerInputs::random(&c, 4);
        for k in inp.get("k").chunks_exact(8) {
            let n: f32 = k.iter().map(|x| x * x).sum();
            assert!((n - 1.0).abs() < 1e-5, "{n}");
        }
    }
}
