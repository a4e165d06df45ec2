//! Writing the suite document: atomically (a temporary file beside the target, then a
//! rename), after every row, with the run's times and the commit the runner was built from.

use std::path::Path;

use anyhow::{Context, Result};

use crate::schema::Document;

/// Writes `doc` to `path` atomically (temporary file beside it, then rename).
///
/// # Errors
/// I/O errors, naming the file.
pub fn write_atomic(path: &Path, doc: &Document) -> Result<()> {
    let text = serde_json::to_string_pretty(doc)? + "\n";
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let tmp = dir.join(format!(
        ".{}.tmp-{}",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("doc"),
        std::process::id()
    ));
    std::fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path)
        .with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))?;
    Ok(())
}

/// Now as RFC 3339 UTC, to the second.
pub fn now_rfc3339() -> String {
    // Seconds since the epoch to a UTC civil date (Howard Hinnant's days_from_civil inverse).
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    rfc3339(secs)
}

fn rfc3339(secs: i64) -> String {
    let (days, rem) = (secs.div_euclid(86400), secs.rem_euclid(86400));
    let z = days + 719468;
    let era = z.div_euclid(146097);
    let doe = z - era * 146097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        (rem % 3600) / 60,
        rem % 60
    )
}

/// The commit the binary was built from, as `build.rs` recorded it (`-dirty` with uncommitted
/// changes), or `unknown` when it was built outside a git checkout.
pub fn git_commit() -> String {
    option_env!("KP_GIT_COMMIT")
        .filter(|c| !c.is_empty())
        .unwrap_or("unknown")
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_are_civil() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_795_000_000), "2026-11-18T11:06:40Z");
    }
}
