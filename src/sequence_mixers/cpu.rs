//! The mixers on the CPU in float32: the sequential recurrence of [`super::reference`], one
//! task per (batch entry, head) for SSD and per (batch entry, block of [`SCAN_BLOCK`]
//! channels) for the selective scan, spread over rayon's threads; the state stays in the
//! task's cache while it walks the sequence, and the sums over the state run in 8 lanes so that
//! they vectorise. Each task writes its own `[T, width]` slice of scratch, scattered into Y
//! after all tasks finish ([`temporary_bytes`]).
//!
//! A chunked form would do more arithmetic (the intra-chunk products) to expose matrix
//! products; on a few CPU cores the recurrence, linear in T and in the state, is the faster
//! choice at the widths measured.

use rayon::prelude::*;

use super::case::{Mixer, MixerCase, MixerInputs};
use super::reference::{ScanShape, SsdShape};

/// Channels per selective-scan task.
pub const SCAN_BLOCK: usize = 16;

/// Lanes of the state sums.
const LANES: usize = 8;

/// Σ s_n·c_n over `s` and `c` (equal lengths) in [`LANES`] partial sums.
#[inline]
fn dot(s: &[f32], c: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    let (sh, st) = s.split_at(s.len() - s.len() % LANES);
    let (ch, ct) = c.split_at(sh.len());
    for (sv, cv) in sh.chunks_exact(LANES).zip(ch.chunks_exact(LANES)) {
        for l in 0..LANES {
            acc[l] += sv[l] * cv[l];
        }
    }
    let mut total: f32 = acc.iter().sum();
    for (a, b) in st.iter().zip(ct) {
        total += a * b;
    }
    total
}

/// Bytes of scratch one call of case `c` allocates: the tasks' outputs before the scatter,
/// B·T·width floats, and one state per task (SSD and the scan; the others do not run here).
pub fn temporary_bytes(c: &MixerCase) -> u64 {
    let out = c.batch * c.seq_len * c.width();
    let states = match c.mixer {
        Mixer::Ssd => c.batch * c.heads * c.head_dim * c.state,
        Mixer::SelectiveScan => c.batch * c.channels.next_multiple_of(SCAN_BLOCK) * c.state,
        Mixer::GatedDelta | Mixer::Based => 0,
    };
    4 * (out + states) as u64
}

/// One forward call of case `c` (SSD or the selective scan) on `inp`, from a zero state,
/// writing Y (`[B, T, H, P]` or `[B, T, D]`, float32) into `y`.
///
/// # Errors
/// Another mixer; inputs (by name and length, [`MixerCase::input_specs`]) or an output that do
/// not fit `c`; a shape `c.validate` refuses.
pub fn forward(c: &MixerCase, inp: &MixerInputs, y: &mut [f32]) -> Result<(), String> {
    c.validate()?;
    if !matches!(c.mixer, Mixer::Ssd | Mixer::SelectiveScan) {
        return Err(format!(
            "{}: the CPU implementation runs SSD and the selective scan",
            c.mixer.as_str()
        ));
    }
    let bt = c.batch * c.seq_len;
    let specs = c.input_specs();
    if inp.tensors.len() != specs.len() {
        return Err(format!(
            "{} inputs, expected {}",
            inp.tensors.len(),
            specs.len()
        ));
    }
    for (t, (name, _, shape)) in inp.tensors.iter().zip(&specs) {
        let want: usize = shape.iter().product();
        if t.name != *name || t.values.len() != want {
            return Err(format!(
                "input {} of {} elements, expected {name} of {want} for {c:?}",
                t.name,
                t.values.len()
            ));
        }
    }
    if y.len() != bt * c.width() {
        return Err(format!(
            "y: {} elements, expected {}",
            y.len(),
            bt * c.width()
        ));
    }
    match c.mixer {
        Mixer::Ssd => ssd(c, inp, y),
        Mixer::SelectiveScan => scan(c, inp, y),
        Mixer::GatedDelta | Mixer::Based => unreachable!("refused above"),
    }
    Ok(())
}

fn ssd(c: &MixerCase, inp: &MixerInputs, y: &mut [f32]) {
    let args = SsdArgs {
        x: inp.get("x"),
        dt: inp.get("dt"),
        a: inp.get("a"),
        b: inp.get("b"),
        c: inp.get("c"),
        d: Some(inp.get("d")),
        initial_state: None,
    };
    ssd_f32(c.ssd_shape(), &args, y);
}

/// The float32 inputs of SSD, laid out as [`super::reference::SsdInputs`]: X `[B, T, H, P]`,
/// Δ `[B, T, H]`, A `[H]`, B and C `[B, T, G, N]`, D `[H]` or none, the initial state
/// `[B, H, P, N]` or zeros.
#[derive(Clone, Copy, Debug)]
pub struct SsdArgs<'a> {
    /// X.
    pub x: &'a [f32],
    /// Δ (after the softplus).
    pub dt: &'a [f32],
    /// A.
    pub a: &'a [f32],
    /// B.
    pub b: &'a [f32],
    /// C.
    pub c: &'a [f32],
    /// D, or no skip connection.
    pub d: Option<&'a [f32]>,
    /// The state before the first step, or zeros.
    pub initial_state: Option<&'a [f32]>,
}

/// SSD's recurrence in float32 on checked lengths: Y into `y` (`[B, T, H, P]`), the final
/// state returned (`[B, H, P, N]`).
pub(crate) fn ssd_f32(shape: SsdShape, args: &SsdArgs, y: &mut [f32]) -> Vec<f32> {
    let SsdShape {
        batch,
        seq_len: t_len,
        heads,
        head_dim: p_dim,
        state: n_dim,
        groups,
    } = shape;
    let per_group = heads / groups;
    let (xs, dts, a_h, bs, cs) = (args.x, args.dt, args.a, args.b, args.c);
    let parts: Vec<(Vec<f32>, Vec<f32>)> = (0..batch * heads)
        .into_par_iter()
        .map(|task| {
            let (b, h) = (task / heads, task % heads);
            let g = h / per_group;
            let per_state = p_dim * n_dim;
            let mut s = match args.initial_state {
                Some(s0) => s0[task * per_state..][..per_state].to_vec(),
                None => vec![0.0f32; per_state],
            };
            let mut out = vec![0.0f32; t_len * p_dim];
            let (a, skip) = (a_h[h], args.d.map_or(0.0, |d| d[h]));
            for t in 0..t_len {
                let bt = b * t_len + t;
                let dt = dts[bt * heads + h];
                let decay = (dt * a).exp();
                let x = &xs[(bt * heads + h) * p_dim..][..p_dim];
                let bv = &bs[(bt * groups + g) * n_dim..][..n_dim];
                let cv = &cs[(bt * groups + g) * n_dim..][..n_dim];
                let o = &mut out[t * p_dim..][..p_dim];
                for p in 0..p_dim {
                    let row = &mut s[p * n_dim..][..n_dim];
                    let dx = dt * x[p];
                    for (r, &bn) in row.iter_mut().zip(bv) {
                        *r = decay * *r + dx * bn;
                    }
                    o[p] = dot(row, cv) + skip * x[p];
                }
            }
            (out, s)
        })
        .collect();
    let mut final_state = Vec::with_capacity(batch * heads * p_dim * n_dim);
    for (task, (part, state)) in parts.iter().enumerate() {
        let (b, h) = (task / heads, task % heads);
        for t in 0..t_len {
            let dst = ((b * t_len + t) * heads + h) * p_dim;
            y[dst..dst + p_dim].copy_from_slice(&part[t * p_dim..][..p_dim]);
        }
        final_state.extend_from_slice(state);
    }
    final_state
}

fn scan(c: &MixerCase, inp: &MixerInputs, y: &mut [f32]) {
    let args = ScanArgs {
        u: inp.get("u"),
        delta: inp.get("delta"),
        a: inp.get("a"),
        b: inp.get("b"),
        c: inp.get("c"),
        d: Some(inp.get("d")),
        initial_state: None,
    };
    scan_f32(c.scan_shape(), &args, y);
}

/// The float32 inputs of the selective scan, laid out as [`super::reference::ScanInputs`]:
/// u and Δ `[B, T, D]`, A `[D, N]`, B and C `[B, T, N]`, D `[D]` or none, the initial state
/// `[B, D, N]` or zeros.
#[derive(Clone, Copy, Debug)]
pub struct ScanArgs<'a> {
    /// u.
    pub u: &'a [f32],
    /// Δ (after the softplus).
    pub delta: &'a [f32],
    /// A.
    pub a: &'a [f32],
    /// B.
    pub b: &'a [f32],
    /// C.
    pub c: &'a [f32],
    /// D, or no skip connection.
    pub d: Option<&'a [f32]>,
    /// The state before the first step, or zeros.
    pub initial_state: Option<&'a [f32]>,
}

/// The selective scan's recurrence in float32 on checked lengths: y into `y` (`[B, T, D]`),
/// the final state returned (`[B, D, N]`).
pub(crate) fn scan_f32(shape: ScanShape, args: &ScanArgs, y: &mut [f32]) -> Vec<f32> {
    let ScanShape {
        batch,
        seq_len: t_len,
        channels,
        state: n_dim,
    } = shape;
    let blocks = channels.div_ceil(SCAN_BLOCK);
    let (us, deltas, a_all, bs, cs) = (args.u, args.delta, args.a, args.b, args.c);
    let parts: Vec<(Vec<f32>, Vec<f32>)> = (0..batch * blocks)
        .into_par_iter()
        .map(|task| {
            let (b, blk) = (task / blocks, task % blocks);
            let ch0 = blk * SCAN_BLOCK;
            let width = SCAN_BLOCK.min(channels - ch0);
            let mut h = match args.initial_state {
                Some(s0) => s0[(b * channels + ch0) * n_dim..][..width * n_dim].to_vec(),
                None => vec![0.0f32; width * n_dim],
            };
            let mut out = vec![0.0f32; t_len * width];
            for t in 0..t_len {
                let bt = b * t_len + t;
                let bv = &bs[bt * n_dim..][..n_dim];
                let cv = &cs[bt * n_dim..][..n_dim];
                for k in 0..width {
                    let ch = ch0 + k;
                    let i = bt * channels + ch;
                    let (u, dt) = (us[i], deltas[i]);
                    let a = &a_all[ch * n_dim..][..n_dim];
                    let hs = &mut h[k * n_dim..][..n_dim];
                    let du = dt * u;
                    for ((hv, &an), &bn) in hs.iter_mut().zip(a).zip(bv) {
                        *hv = (dt * an).exp() * *hv + du * bn;
                    }
                    out[t * width + k] = dot(hs, cv) + args.d.map_or(0.0, |d| d[ch]) * u;
                }
            }
            (out, h)
        })
        .collect();
    let mut final_state = vec![0.0f32; batch * channels * n_dim];
    for (task, (part, state)) in parts.iter().enumerate() {
        let (b, blk) = (task / blocks, task % blocks);
        let ch0 = blk * SCAN_BLOCK;
        let width = SCAN_BLOCK.min(channels - ch0);
        for t in 0..t_len {
            let dst = (b * t_len + t) * channels + ch0;
            y[dst..dst + width].copy_from_slice(&part[t * width..][..width]);
        }
        final_state[(b * channels + ch0) * n_dim..][..width * n_dim].copy_from_slice(state);
    }
    final_state
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sequence_mixers::case::MixerDtype;

    fn rel(a: &[f32], b: &[f64]) -> f64 {
        let num: f64 = a.iter().zip(b).map(|(&x, y)| (x as f64 - y).powi(2)).sum();
        let den: f64 = b.iter().map(|y| y * y).sum();
        (num / den).sqrt()
    }

    #[test]
    fn float32_matches_the_float64_recurrence() {
        // Sizes that leave partial lanes (N 12) and a partial channel block (D 37).
        let mut ssd = MixerCase::ssd(2, 70, 4, 6, 12);
        ssd.groups = 2;
        let scan = MixerCase::scan(2, 70, 37, 12);
        let mut bf = MixerCase::scan(1, 33, 16, 16);
        bf.dtype = MixerDtype::Bf16;
        for c in [ssd, scan, bf] {
            let inp = MixerInputs::random(&c, 11);
            let want = inp.reference(&c).unwrap();
            let mut y = vec![f32::NAN; want.len()];
            forward(&c, &inp, &mut y).unwrap();
            let e = rel(&y, &want);
            assert!(e < 1e-6, "{c:?}: rel err {e}");
        }
        let mut short = vec![0.0; 3];
        assert!(forward(&ssd, &MixerInputs::random(&ssd, 1), &mut short)
            .unwrap_err()
            .contains("y:"));
    }
}
