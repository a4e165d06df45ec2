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

/// A ratio with two decimals followed by `×`.
pub fn ratio(x: f64) -> String {
    format!("{x:.2}×")
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
