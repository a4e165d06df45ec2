//! The `masks` grid of the attention runner (issue 10 §1): the named masks and score
//! modifications of `flex_attention` (causal, sliding window, document, prefix-LM, ALiBi,
//! soft-capping) over a seq_len sweep, forward and forward + backward, each case naming its
//! modification in the case parameter `mask`. The project's `flex` runs every mask; PyTorch's
//! `flex_attention` under `torch.compile` (`runners/compare/torch_flex.py`, `--compare
//! torch_flex`) the same; `flash` and SDPA's backends run the causal cases as the hand-written
//! baseline. The float64 reference applies the same modification
//! ([`kernelpages::attention::files::write_masked_case`]); FLOPs count the visible pairs. It
//! runs alone and writes a document of its own kind (`config.kind = masks`,
//! `data/gpu_attention_masks.json`).

use anyhow::{Context, Result};

use kernelpages::attention::flex::FlexMod;
use kernelpages::attention::{AttentionCase, Pass};
use kernelpages::runner::grid::Params;
use kernelpages::schema::Param;

/// The case parameter naming a case's modification ([`FlexMod::name`], or `none`).
pub const MASK_PARAM: &str = "mask";

/// The masks the grid runs by default (`--flex-masks`).
pub const MASKS: [&str; 6] = [
    "causal",
    "sliding_window(1024)",
    "document",
    "prefix_lm(1024)",
    "alibi",
    "softcap(30)",
];

/// Seq lengths of the masks grid [default], and of its `--quick` version.
pub const SEQ_LENS: [usize; 3] = [1024, 4096, 16384];
const QUICK_SEQ_LENS: [usize; 1] = [1024];

/// The masks grid: B4 H8 head_dim 128 bf16, `masks` × `seq_lens` × `passes`; a case is causal
/// exactly when its mask is `causal` (so the implementations without generated masks run it).
///
/// # Errors
/// An unknown mask name.
pub fn cases(
    masks: &[String],
    seq_lens: Option<&[usize]>,
    passes: &[Pass],
    quick: bool,
) -> Result<Vec<Params>> {
    let lens: &[usize] = if quick {
        &QUICK_SEQ_LENS
    } else {
        seq_lens.unwrap_or(&SEQ_LENS)
    };
    let mut out = Vec::new();
    for name in masks {
        let m = FlexMod::parse(name)
            .map_err(anyhow::Error::msg)
            .context("--flex-masks")?;
        for &t in lens {
            for &pass in passes {
                let c = AttentionCase {
                    causal: m == Some(FlexMod::Causal),
                    pass,
                    ..AttentionCase::new(4, 8, t, 128)
                };
                let mut p = c.params();
                p.insert(MASK_PARAM.into(), Param::Text(name.clone()));
                out.push(p);
            }
        }
    }
    Ok(out)
}

/// The modification a case names: `None` when the case has no `mask` parameter (not a masks
/// case), `Some(Ok(None))` for `none`.
pub fn mask_of(p: &Params) -> Option<Result<Option<FlexMod>, String>> {
    match p.get(MASK_PARAM)? {
        Param::Text(s) => Some(FlexMod::parse(s)),
        other => Some(Err(format!(
            "case parameter `mask` must be text, got {other:?}"
        ))),
    }
}

/// Why an implementation without generated masks (`flash`, `math`, SDPA's backends, JAX) cannot
/// run masks case `p`, or `None`: they run `none` and `causal` only.
pub fn fixed_mask_unsupported(p: &Params, implementation: &str) -> Option<String> {
    match mask_of(p)? {
        Err(e) => Some(e),
        Ok(None | Some(FlexMod::Causal)) => None,
        Ok(Some(m)) => Some(format!(
            "{implementation} takes no generated mask; `{}` runs through flex_attention",
            m.name()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_masks_grid_names_each_mask_and_only_causal_is_causal() {
        let masks: Vec<String> = MASKS.iter().map(|s| s.to_string()).collect();
        let c = cases(&masks, None, &[Pass::Fwd, Pass::FwdBwd], false).unwrap();
        assert_eq!(c.len(), MASKS.len() * SEQ_LENS.len() * 2);
        for p in &c {
            let m = mask_of(p).unwrap().unwrap();
            let case = AttentionCase::from_params(p).unwrap();
            assert_eq!(case.causal, m == Some(FlexMod::Causal));
            let sdpa = fixed_mask_unsupported(p, "torch_cudnn");
            assert_eq!(sdpa.is_none(), case.causal, "{p:?}");
        }
        assert!(cases(&["diagonal".into()], None, &[Pass::Fwd], true).is_err());
        assert_eq!(
            cases(&masks, None, &[Pass::Fwd], true).unwrap().len(),
            MASKS.len()
        );
        let mut plain = c[0].clone();
        plain.remove(MASK_PARAM);
        assert!(mask_of(&plain).is_none() && fixed_mask_unsupported(&plain, "flash").is_none());
    }
}
