//! One case of the sequence-mixer grid: which mixer, its sizes, dtype and pass, as the runner's
//! named parameters ([`MixerCase::params`], [`MixerCase::from_params`]), with the FLOP, byte
//! and token counts its throughputs divide by, the random inputs every implementation of the
//! case reads ([`MixerInputs::random`]) and their float64 reference
//! ([`MixerInputs::reference`], the sequential recurrences of [`super::reference`]).

use std::collections::BTreeMap;

use crate::schema::Param;

use super::reference::{self, ScanInputs, ScanShape, SsdInputs, SsdShape};

/// The mixers the runner measures so far.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Mixer {
    /// Mamba-2's state-space dual layer ([`reference::ssd`]).
    Ssd,
    /// Mamba's selective scan ([`reference::selective_scan`]).
    SelectiveScan,
}

impl Mixer {
    /// Every mixer, in grid order.
    pub const ALL: [Mixer; 2] = [Mixer::Ssd, Mixer::SelectiveScan];

    /// The parameter value (`ssd`, `selective_scan`).
    pub fn as_str(self) -> &'static str {
        match self {
            Mixer::Ssd => "ssd",
            Mixer::SelectiveScan => "selective_scan",
        }
    }

    /// The mixer named `s`, if any.
    pub fn parse(s: &str) -> Option<Mixer> {
        Mixer::ALL.into_iter().find(|m| m.as_str() == s)
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
/// `channels` values per token with `state` states each and B, C shared by all channels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MixerCase {
    /// Which recurrence.
    pub mixer: Mixer,
    /// Batch entries, B.
    pub batch: usize,
    /// Time steps, T.
    pub seq_len: usize,
    /// SSD: heads, H (0 for the scan).
    pub heads: usize,
    /// SSD: value width per head, P (0 for the scan).
    pub head_dim: usize,
    /// SSD: groups of heads sharing B and C, G (0 for the scan).
    pub groups: usize,
    /// Selective scan: channels, D (0 for SSD).
    pub channels: usize,
    /// State size per head (SSD) or per channel (scan), N.
    pub state: usize,
    /// Element type of X (u), B, C and Y.
    pub dtype: MixerDtype,
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
            dtype: MixerDtype::Fp32,
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
            dtype: MixerDtype::Fp32,
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

    /// The runner's parameters: `mixer`, `batch`, `seq_len`, `state`, `dtype`, `pass` (`fwd`),
    /// and `heads`, `head_dim`, `groups` (SSD) or `channels` (scan).
    pub fn params(&self) -> BTreeMap<String, Param> {
        let mut p = BTreeMap::new();
        let int = |v: usize| Param::Int(v as i64);
        p.insert("mixer".into(), Param::Text(self.mixer.as_str().into()));
        p.insert("batch".into(), int(self.batch));
        p.insert("seq_len".into(), int(self.seq_len));
        p.insert("state".into(), int(self.state));
        p.insert("dtype".into(), Param::Text(self.dtype.as_str().into()));
        p.insert("pass".into(), Param::Text("fwd".into()));
        match self.mixer {
            Mixer::Ssd => {
                p.insert("heads".into(), int(self.heads));
                p.insert("head_dim".into(), int(self.head_dim));
                p.insert("groups".into(), int(self.groups));
            }
            Mixer::SelectiveScan => {
                p.insert("channels".into(), int(self.channels));
            }
        }
        p
    }

    /// The case named by `p` ([`MixerCase::params`]).
    ///
    /// # Errors
    /// A missing or mistyped parameter, an unknown mixer or dtype, a pass other than `fwd`
    /// (the backward kernels are not written yet), or a shape [`MixerCase::validate`] refuses.
    pub fn from_params(p: &BTreeMap<String, Param>) -> Result<MixerCase, String> {
        let int = |k: &str| -> Result<usize, String> {
            match p.get(k) {
                Some(Param::Int(i)) if *i >= 0 => Ok(*i as usize),
                Some(other) => Err(format!("parameter `{k}` = {other} is not a size")),
                None => Err(format!("parameter `{k}` is missing")),
            }
        };
        let text = |k: &str| -> Result<&str, String> {
            match p.get(k) {
                Some(Param::Text(s)) => Ok(s.as_str()),
                Some(other) => Err(format!("parameter `{k}` = {other} is not a name")),
                None => Err(format!("parameter `{k}` is missing")),
            }
        };
        let name = text("mixer")?;
        let mixer = Mixer::parse(name)
            .ok_or_else(|| format!("unknown mixer `{name}` (ssd, selective_scan)"))?;
        let dtype = match text("dtype")? {
            "fp32" => MixerDtype::Fp32,
            "bf16" => MixerDtype::Bf16,
            other => return Err(format!("dtype `{other}`: the mixers take fp32 or bf16")),
        };
        match text("pass")? {
            "fwd" => {}
            other => {
                return Err(format!(
                    "pass `{other}`: only the forward is measured so far (the backward kernels \
                     are not written yet)"
                ))
            }
        }
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
        };
        c.dtype = dtype;
        c.validate()?;
        Ok(c)
    }

    /// Checks the sizes: none 0 (seq_len included: a grid case has at least one step), and for
    /// SSD heads a multiple of groups.
    ///
    /// # Errors
    /// The fault, with the case.
    pub fn validate(&self) -> Result<(), String> {
        let sizes = match self.mixer {
            Mixer::Ssd => vec![self.heads, self.head_dim, self.groups],
            Mixer::SelectiveScan => vec![self.channels],
        };
        if self.batch == 0 || self.seq_len == 0 || self.state == 0 || sizes.contains(&0) {
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

    /// Values per token: H·P (SSD) or D (scan).
    pub fn width(&self) -> usize {
        match self.mixer {
            Mixer::Ssd => self.heads * self.head_dim,
            Mixer::SelectiveScan => self.channels,
        }
    }

    /// State elements per token step: H·P·N (SSD) or D·N (scan).
    pub fn state_elements(&self) -> usize {
        self.width() * self.state
    }

    /// Tokens of one call, B·T.
    pub fn tokens(&self) -> f64 {
        self.batch as f64 * self.seq_len as f64
    }

    /// FLOPs of one call as the recurrence counts them, per token and state element: 3 for the
    /// update (decay times state, plus Δ·x·B with Δ·x formed once per value) and 2 for the
    /// read-out (times C, summed); the selective scan adds 1 for its per-element Δ·A (its
    /// exponential is not counted). A chunked kernel does more arithmetic than this (the
    /// intra-chunk products); the count is the same for every implementation of a case.
    pub fn flops(&self) -> f64 {
        let per = match self.mixer {
            Mixer::Ssd => 5.0,
            Mixer::SelectiveScan => 6.0,
        };
        per * self.tokens() * self.state_elements() as f64
    }

    /// Bytes one call must move at least: X (u), B, C and Y in the case's dtype, Δ in float32
    /// (per head for SSD, per channel for the scan), A and D in float32 (A per channel and
    /// state for the scan); no initial or final state.
    pub fn bytes(&self) -> f64 {
        let e = self.dtype.bytes() as f64;
        let t = self.tokens();
        let w = self.width() as f64;
        let n = self.state as f64;
        match self.mixer {
            Mixer::Ssd => {
                let g = self.groups as f64;
                let h = self.heads as f64;
                t * (2.0 * w * e + 2.0 * g * n * e + 4.0 * h) + 8.0 * h
            }
            Mixer::SelectiveScan => t * (2.0 * w * e + 2.0 * n * e + 4.0 * w) + 4.0 * w * (n + 1.0),
        }
    }

    /// A short label for progress lines (`ssd B4 T4096 H8 P64 N64 bf16`).
    pub fn label(&self) -> String {
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
        }
    }
}

/// The inputs of one case, as the values every implementation reads (X, B and C already
/// rounded to the case's dtype), in the layouts of [`super::reference`]: for SSD `x`
/// `[B, T, H, P]`, `dt` `[B, T, H]`, `a` `[H]`, `b` and `c` `[B, T, G, N]`, `d` `[H]`; for the
/// scan `x` is u `[B, T, D]`, `dt` is Δ `[B, T, D]`, `a` `[D, N]`, `b` and `c` `[B, T, N]`,
/// `d` `[D]`.
#[derive(Clone, Debug, PartialEq)]
pub struct MixerInputs {
    /// X (SSD) or u (scan).
    pub x: Vec<f32>,
    /// Δ after the softplus, in [0.01, 0.2).
    pub dt: Vec<f32>,
    /// A, in [−4, −0.5): every step decays the state by exp(Δ·A) in (0.45, 0.995).
    pub a: Vec<f32>,
    /// B.
    pub b: Vec<f32>,
    /// C.
    pub c: Vec<f32>,
    /// D, the skip connection.
    pub d: Vec<f32>,
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
    /// Random inputs of case `c` from `seed`: X, B, C uniform in [−1, 1) (rounded to the
    /// case's dtype), Δ in [0.01, 0.2), A in [−4, −0.5), D in [−1, 1), each tensor from its own
    /// stream (the ranges of the mixers' GPU tests).
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
        let (steps, a_len, bc_width, d_len) = match c.mixer {
            Mixer::Ssd => (bt * c.heads, c.heads, c.groups * c.state, c.heads),
            Mixer::SelectiveScan => (bt * c.channels, c.channels * c.state, c.state, c.channels),
        };
        MixerInputs {
            x: round(uniform(bt * c.width(), -1.0, 1.0, seed)),
            dt: uniform(steps, 0.01, 0.2, seed + 1),
            a: uniform(a_len, -4.0, -0.5, seed + 2),
            b: round(uniform(bt * bc_width, -1.0, 1.0, seed + 3)),
            c: round(uniform(bt * bc_width, -1.0, 1.0, seed + 4)),
            d: uniform(d_len, -1.0, 1.0, seed + 5),
        }
    }

    /// The float64 output Y of case `c` on these inputs, from a zero state: the sequential
    /// recurrence ([`reference::ssd`], [`reference::selective_scan`]).
    ///
    /// # Errors
    /// Inputs whose lengths do not fit `c` (the message names the input).
    pub fn reference(&self, c: &MixerCase) -> Result<Vec<f64>, String> {
        let f = |v: &[f32]| -> Vec<f64> { v.iter().map(|&x| x as f64).collect() };
        let (x, dt, a, b, cc, d) = (
            f(&self.x),
            f(&self.dt),
            f(&self.a),
            f(&self.b),
            f(&self.c),
            f(&self.d),
        );
        match c.mixer {
            Mixer::Ssd => reference::ssd(
                c.ssd_shape(),
                SsdInputs {
                    x: &x,
                    dt: &dt,
                    a: &a,
                    b: &b,
                    c: &cc,
                    d: Some(&d),
                    initial_state: None,
                },
            )
            .map(|(y, _)| y),
            Mixer::SelectiveScan => reference::selective_scan(
                c.scan_shape(),
                ScanInputs {
                    u: &x,
                    delta: &dt,
                    a: &a,
                    b: &b,
                    c: &cc,
                    d: Some(&d),
                    initial_state: None,
                },
            )
            .map(|(y, _)| y),
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
        let mut p = ssd.params();
        p.insert("groups".into(), Param::Int(3));
        assert!(MixerCase::from_params(&p)
            .unwrap_err()
            .contains("multiple of groups"));
        let mut p = scan.params();
        p.insert("pass".into(), Param::Text("fwd+bwd".into()));
        assert!(MixerCase::from_params(&p).unwrap_err().contains("backward"));
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
    }

    #[test]
    fn bf16_inputs_are_rounded_and_the_reference_runs() {
        let mut c = MixerCase::ssd(1, 5, 2, 4, 8);
        c.dtype = MixerDtype::Bf16;
        let inp = MixerInputs::random(&c, 3);
        // bf16 keeps 8 significant bits: every X is a multiple of 2^-8 of its binade.
        assert!(inp.x.iter().all(|&v| v.to_bits() & 0xFFFF == 0));
        assert!(inp.dt.iter().any(|&v| v.to_bits() & 0xFFFF != 0));
        assert!(inp.dt.iter().all(|&v| (0.01..0.2).contains(&v)));
        let y = inp.reference(&c).unwrap();
        assert_eq!(y.len(), 5 * 8);
        assert!(y.iter().all(|v| v.is_finite()) && y.iter().any(|&v| v != 0.0));
        let s = MixerCase::scan(2, 3, 4, 8);
        assert_eq!(MixerInputs::random(&s, 1).reference(&s).unwrap().len(), 24);
    }
}
