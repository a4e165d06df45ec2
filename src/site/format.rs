//! Formatting of numbers and commands for display, and the stable hash used for file names
//! and anchors. Pure functions: the page model calls them, tests call them to predict output.

/// `x` rounded to `sig` significant digits, in plain decimal notation (`1.23`, `0.0123`, `123`).
/// Non-finite values print as `—`.
pub fn sig(x: f64, sig: u32) -> String {
    if !x.is_finite() {
        return "—".to_string();
    }
    if x == 0.0 {
        return "0".to_string();
    }
    let magnitude = x.abs().log10().floor() as i32;
    let decimals = (sig as i32 - 1 - magnitude).max(0) as usize;
    format!("{x:.decimals$}")
}

/// A time in ms, three significant digits.
pub fn ms(x: f64) -> String {
    sig(x, 3)
}

/// An interquartile range `q1–q3` in ms.
pub fn iqr(q1: f64, q3: f64) -> String {
    format!("{}–{}", ms(q1), ms(q3))
}

/// A relative error in scientific notation with two decimals (`1.23e-3`).
pub fn rel_err(x: f64) -> String {
    format!("{x:.2e}")
}

/// A ratio followed by `×`: two decimals below 10 (`0.62×`, `7.51×`), one from 10 (`38.6×`).
pub fn ratio(x: f64) -> String {
    if x.abs() >= 10.0 {
        format!("{x:.1}×")
    } else {
        format!("{x:.2}×")
    }
}

/// The site's one direction for a ratio of times: the other implementation's time ÷ the
/// reference's (the reference is the default whenever the default is one of the two), in
/// words: above 1 the reference is faster. `lo..=hi` is a range of such ratios (equal for one).
/// Returns e.g. `flash 1.61× slower` (ratio 0.62), `flash faster` (ratios of 2.01 to 7.51:
/// the value itself says by how much), `flash as fast` (ratios of 1 to under 1.005, or
/// slower by under 0.05 %) or `flash 1.004× slower` (slower by under 0.5 %: three decimals; a
/// slower reference is not called as fast by rounding).
pub fn time_ratio_words(lo: f64, hi: f64, reference: &str) -> String {
    let (lo, hi) = (lo.min(hi), lo.max(hi));
    let span = |a: f64, b: f64| {
        let (a, b) = (ratio(a), ratio(b));
        if a == b {
            a
        } else {
            format!("{a} to {b}")
        }
    };
    if lo >= 1.0 {
        if ratio(hi) == ratio(1.0) {
            return format!("{reference} as fast");
        }
        format!("{reference} faster")
    } else if hi <= 1.0 {
        // Slower by less than 0.5 %: three decimals, not `1.00× slower` (a slower reference is
        // called as fast only within 0.05 %).
        if ratio(1.0 / lo) == ratio(1.0) {
            if 1.0 / lo < 1.0005 {
                return format!("{reference} as fast");
            }
            return format!("{reference} {:.3}× slower", 1.0 / lo);
        }
        format!("{reference} {} slower", span(1.0 / hi, 1.0 / lo))
    } else {
        format!(
            "{reference} between {} slower and {} faster",
            ratio(1.0 / lo),
            ratio(hi)
        )
    }
}

/// A time ratio (or range) as HTML: the value(s), marked with the direction every ratio on the
/// site shares (`data-ratio="time of other ÷ time of reference"`), then the words of
/// [`time_ratio_words`]. `other` and `reference` are implementation names (HTML-escaped here).
pub fn time_ratio_html(lo: f64, hi: f64, other: &str, reference: &str) -> String {
    let value = if ratio(lo) == ratio(hi) {
        ratio(lo)
    } else {
        format!("{} to {}", ratio(lo.min(hi)), ratio(lo.max(hi)))
    };
    format!(
        "<span class=\"ratio\" data-ratio=\"time of other ÷ time of reference\" \
         data-other=\"{}\" data-reference=\"{}\" data-lo=\"{lo}\" data-hi=\"{hi}\">{value}</span> \
         ({})",
        html_escape(other),
        html_escape(reference),
        html_escape(&time_ratio_words(lo, hi, reference))
    )
}

/// A ratio from [`time_ratio_html`] whose two times are within noise of each other (their
/// quartiles overlap): the words naming a faster side become `within noise`.
pub fn within_noise_html(ratio_html: &str) -> String {
    match ratio_html.rfind(" (") {
        Some(at) if ratio_html.ends_with(')') => {
            format!("{} (within noise)", &ratio_html[..at])
        }
        _ => ratio_html.to_string(),
    }
}

/// The first 7 characters of a commit hash (all of a shorter one), as the pages name commits.
pub fn short_commit(commit: &str) -> String {
    commit.chars().take(7).collect()
}

/// `s` with `&`, `<`, `>` and `"` escaped for HTML text and attribute values.
pub fn html_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// A memory figure in MB, three significant digits.
pub fn mb(x: f64) -> String {
    sig(x, 3)
}

/// A library version as its users know it. cuDNN reports an integer (`torch.backends.cudnn.
/// version()`: 91900 for 9.19.0, 8907 for 8.9.7), shown dotted; anything else as recorded.
pub fn library_version(name: &str, version: &str) -> String {
    let is_cudnn = name.to_ascii_lowercase().contains("cudnn");
    match version.parse::<u64>() {
        Ok(v) if is_cudnn && v >= 90_000 => {
            format!("{}.{}.{}", v / 10_000, (v / 100) % 100, v % 100)
        }
        Ok(v) if is_cudnn && v >= 1_000 => format!("{}.{}.{}", v / 1_000, (v / 100) % 10, v % 100),
        _ => version.to_string(),
    }
}

/// One argument quoted for a POSIX shell: left alone when it holds only safe characters,
/// otherwise single-quoted with embedded quotes escaped.
pub fn shell_quote(arg: &str) -> String {
    let safe = !arg.is_empty()
        && arg
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_-./=:,+@%".contains(c));
    if safe {
        arg.to_string()
    } else {
        format!("'{}'", arg.replace('\'', r"'\''"))
    }
}

/// A command line joined with spaces, each argument shell-quoted.
pub fn shell_join(args: &[String]) -> String {
    args.iter()
        .map(|a| shell_quote(a))
        .collect::<Vec<_>>()
        .join(" ")
}

/// 64-bit FNV-1a of `bytes`: stable across runs, platforms and Rust versions, so file names
/// derived from it are deterministic.
pub fn stable_hash(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn significant_digits() {
        assert_eq!(sig(1.2345, 3), "1.23");
        assert_eq!(sig(0.012345, 3), "0.0123");
        assert_eq!(sig(123.45, 3), "123");
        assert_eq!(sig(12345.0, 3), "12345");
        assert_eq!(sig(0.0, 3), "0");
        assert_eq!(sig(f64::NAN, 3), "—");
    }

    #[test]
    fn quoting() {
        assert_eq!(shell_quote("--out"), "--out");
        assert_eq!(shell_quote("a b"), "'a b'");
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
        assert_eq!(shell_quote(""), "''");
    }

    #[test]
    fn ratios_say_which_way_they_go() {
        assert_eq!(time_ratio_words(0.62, 0.62, "flash"), "flash 1.61× slower");
        assert_eq!(time_ratio_words(2.01, 7.51, "flash"), "flash faster");
        assert_eq!(ratio(38.57), "38.6×");
        assert_eq!(
            time_ratio_words(0.46, 0.76, "flash"),
            "flash 1.32× to 2.17× slower"
        );
        assert_eq!(time_ratio_words(1.0, 1.0, "flash"), "flash as fast");
        // 0.00624 ms against 0.00627: slower by 0.5 %, not `1.00× slower`.
        assert_eq!(
            time_ratio_words(0.00624 / 0.00627, 0.00624 / 0.00627, "flash"),
            "flash 1.005× slower"
        );
        let html = time_ratio_html(0.5, 0.5, "torch_cudnn", "flash");
        assert!(html.starts_with("<span class=\"ratio\""), "{html}");
        assert!(
            html.contains(">0.50×</span> (flash 2.00× slower)"),
            "{html}"
        );
    }

    #[test]
    fn cudnn_versions_read_as_released() {
        assert_eq!(library_version("cudnn", "91900"), "9.19.0");
        assert_eq!(library_version("cuDNN", "8907"), "8.9.7");
        assert_eq!(library_version("cudnn", "9.19.0"), "9.19.0");
        assert_eq!(library_version("torch", "2110"), "2110");
    }

    #[test]
    fn hash_is_fnv1a() {
        assert_eq!(stable_hash(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(stable_hash(b"a"), 0xaf63_dc4c_8601_ec8c);
    }
}
