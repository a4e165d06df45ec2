//! The only reader of `data/`: finds the suite documents, parses them against the
//! [`schema`](crate::schema) types and checks what serde cannot (schema version, sane times,
//! no duplicate rows). Also writes `data/schema.json` and owns the atomic file write the rest of
//! the crate uses.
//!
//! Every error names the file it came from; parse errors add the line, column and JSON path.

use std::collections::BTreeMap;
use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use anyhow::Context as _;

use crate::schema::{self, Document, Param, Suite, SCHEMA_VERSION};

/// Largest document accepted, in bytes (64 MiB). Larger files are refused before parsing.
pub const MAX_DOCUMENT_BYTES: u64 = 64 * 1024 * 1024;

/// File name of the generated JSON Schema inside the data folder; never loaded as a document.
pub const SCHEMA_FILE_NAME: &str = "schema.json";

/// One parsed and checked suite document and the file it came from.
#[derive(Clone, Debug, PartialEq)]
pub struct Loaded {
    /// Path of the JSON file, as found under the data folder.
    pub path: PathBuf,
    /// The document.
    pub doc: Document,
}

impl Loaded {
    /// File name of the document (`gpu_attention.json`), for display.
    pub fn file_name(&self) -> String {
        self.path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| self.path.display().to_string())
    }
}

/// Why a document was refused. Every variant names the file.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The file could not be read.
    #[error("cannot read {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The file is larger than [`MAX_DOCUMENT_BYTES`].
    #[error("{path} is {bytes} bytes, over the {max} byte limit for a document")]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// Its size (at least; reading stops past the limit).
        bytes: u64,
        /// The limit.
        max: u64,
    },
    /// The JSON is malformed or does not match the schema.
    #[error("{path}:{line}:{column}: {message} (at JSON path `{json_path}`)")]
    Parse {
        /// The file.
        path: PathBuf,
        /// 1-based line of the error (0 when unknown).
        line: usize,
        /// 1-based column of the error (0 when unknown).
        column: usize,
        /// Path of the offending value, e.g. `rows[3].status` (`.` for the root).
        json_path: String,
        /// serde_json's message.
        message: String,
    },
    /// `schema_version` is not [`SCHEMA_VERSION`].
    #[error("{path}: schema_version is {found}, this docgen reads version {expected}")]
    SchemaVersion {
        /// The file.
        path: PathBuf,
        /// Version in the file.
        found: u32,
        /// Version this build understands.
        expected: u32,
    },
    /// A row's values are impossible (negative or inverted times, ok row without a time).
    #[error("{path}: rows[{index}] ({implementation}, {case}): {problem}")]
    BadRow {
        /// The file.
        path: PathBuf,
        /// Index of the row in `rows`.
        index: usize,
        /// Implementation of the row.
        implementation: String,
        /// The case, as `name=value` pairs.
        case: String,
        /// What is wrong.
        problem: String,
    },
    /// The same (suite, device, case, implementation) appears twice.
    #[error(transparent)]
    Duplicate(Box<DuplicateRow>),
}

/// Two rows with the same (suite, device, case, implementation), in one or two files.
#[derive(Debug, thiserror::Error)]
#[error(
    "duplicate row for suite {suite}, device {device}, implementation {implementation}, \
     case {case}: in {} (rows[{first_index}]) and {} (rows[{second_index}])",
    first.display(),
    second.display()
)]
pub struct DuplicateRow {
    /// Suite name.
    pub suite: String,
    /// Device name.
    pub device: String,
    /// Implementation.
    pub implementation: String,
    /// The case, as `name=value` pairs.
    pub case: String,
    /// File of the first occurrence.
    pub first: PathBuf,
    /// Row index of the first occurrence.
    pub first_index: usize,
    /// File of the second occurrence.
    pub second: PathBuf,
    /// Row index of the second occurrence.
    pub second_index: usize,
}

/// Loads every `*.json` document of `dir` (not recursing, skipping [`SCHEMA_FILE_NAME`]),
/// sorted by file name, and checks them together.
///
/// Errors: the folder cannot be listed, or any document is refused ([`LoadError`]).
pub fn load_dir(dir: &Path) -> anyhow::Result<Vec<Loaded>> {
    let entries =
        fs::read_dir(dir).with_context(|| format!("cannot list data folder {}", dir.display()))?;
    let mut paths = Vec::new();
    for entry in entries {
        let entry = entry.with_context(|| format!("cannot list data folder {}", dir.display()))?;
        let path = entry.path();
        let is_json = path.extension().is_some_and(|e| e == "json");
        let is_schema = path.file_name().is_some_and(|n| n == SCHEMA_FILE_NAME);
        if is_json && !is_schema && path.is_file() {
            paths.push(path);
        }
    }
    paths.sort();
    let mut loaded = Vec::with_capacity(paths.len());
    for path in paths {
        let doc = load_file(&path)?;
        loaded.push(Loaded { path, doc });
    }
    check_duplicates(&loaded)?;
    Ok(loaded)
}

/// Reads and checks one document.
///
/// Errors: [`LoadError::Read`], [`LoadError::TooLarge`], and those of [`parse_document`].
pub fn load_file(path: &Path) -> Result<Document, LoadError> {
    let read_err = |source| LoadError::Read {
        path: path.to_path_buf(),
        source,
    };
    let file = fs::File::open(path).map_err(read_err)?;
    let len = file.metadata().map_err(read_err)?.len();
    if len > MAX_DOCUMENT_BYTES {
        return Err(LoadError::TooLarge {
            path: path.to_path_buf(),
            bytes: len,
            max: MAX_DOCUMENT_BYTES,
        });
    }
    let mut bytes = Vec::with_capacity(len as usize);
    // Read one byte past the limit so a file that grows while being read is still refused.
    file.take(MAX_DOCUMENT_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(read_err)?;
    if bytes.len() as u64 > MAX_DOCUMENT_BYTES {
        return Err(LoadError::TooLarge {
            path: path.to_path_buf(),
            bytes: bytes.len() as u64,
            max: MAX_DOCUMENT_BYTES,
        });
    }
    parse_document(path, &bytes)
}

/// Parses `bytes` as a [`Document`] and checks it; `path` only names the source in errors.
/// Never panics, whatever the bytes.
///
/// Errors: [`LoadError::Parse`] (with line, column and JSON path), [`LoadError::SchemaVersion`],
/// [`LoadError::BadRow`], and [`LoadError::Duplicate`] for a row repeated within the document.
pub fn parse_document(path: &Path, bytes: &[u8]) -> Result<Document, LoadError> {
    let parse_err = |e: serde_json::Error, json_path: String| LoadError::Parse {
        path: path.to_path_buf(),
        line: e.line(),
        column: e.column(),
        json_path,
        message: strip_position(&e.to_string()),
    };
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let doc: Document = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let json_path = e.path().to_string();
        parse_err(e.into_inner(), json_path)
    })?;
    de.end().map_err(|e| parse_err(e, ".".to_string()))?;
    check_document(path, &doc)?;
    let single = [Loaded {
        path: path.to_path_buf(),
        doc,
    }];
    check_duplicates(&single)?;
    let [Loaded { doc, .. }] = single;
    Ok(doc)
}

/// serde_json appends " at line L column C" to its messages; the error prints them itself.
fn strip_position(message: &str) -> String {
    match message.rfind(" at line ") {
        Some(i) => message[..i].to_string(),
        None => message.to_string(),
    }
}

/// The case as `name=value` pairs joined with `, ` (parameter names sorted).
pub fn case_label(case: &BTreeMap<String, Param>) -> String {
    case.iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn check_document(path: &Path, doc: &Document) -> Result<(), LoadError> {
    if doc.schema_version != SCHEMA_VERSION {
        return Err(LoadError::SchemaVersion {
            path: path.to_path_buf(),
            found: doc.schema_version,
            expected: SCHEMA_VERSION,
        });
    }
    for (index, row) in doc.rows.iter().enumerate() {
        let bad = |problem: String| LoadError::BadRow {
            path: path.to_path_buf(),
            index,
            implementation: row.implementation.clone(),
            case: case_label(&row.case),
            problem,
        };
        for (name, value) in [
            ("median_ms", row.median_ms),
            ("q1_ms", row.q1_ms),
            ("q3_ms", row.q3_ms),
        ] {
            if let Some(v) = value {
                if !v.is_finite() || v < 0.0 {
                    return Err(bad(format!("{name} is {v}; times must be finite and >= 0")));
                }
            }
        }
        if let (Some(q1), Some(m), Some(q3)) = (row.q1_ms, row.median_ms, row.q3_ms) {
            if !(q1 <= m && m <= q3) {
                return Err(bad(format!("quartiles out of order: q1_ms {q1} <= median_ms {m} <= q3_ms {q3} does not hold")));
            }
        }
        if row.status == schema::Status::Ok && row.median_ms.is_none() {
            return Err(bad("status is ok but median_ms is missing".to_string()));
        }
        if let Some(acc) = &row.accuracy {
            if !acc.rel_err.is_finite() || acc.rel_err < 0.0 {
                return Err(bad(format!(
                    "accuracy.rel_err is {}; must be finite and >= 0",
                    acc.rel_err
                )));
            }
        }
    }
    Ok(())
}

/// Key of a row for duplicate detection: suite, device name, canonical case JSON, implementation.
type RowKey = (Suite, String, String, String);

fn check_duplicates(loaded: &[Loaded]) -> Result<(), LoadError> {
    let mut seen: BTreeMap<RowKey, (&Path, usize)> = BTreeMap::new();
    for l in loaded {
        for (index, row) in l.doc.rows.iter().enumerate() {
            // BTreeMap serialises in key order, so equal cases give equal strings.
            let case_json = serde_json::to_string(&row.case).unwrap_or_default();
            let key = (
                l.doc.suite,
                l.doc.device.name.clone(),
                case_json,
                row.implementation.clone(),
            );
            if let Some((first, first_index)) = seen.get(&key) {
                return Err(LoadError::Duplicate(Box::new(DuplicateRow {
                    suite: l.doc.suite.as_str().to_string(),
                    device: l.doc.device.name.clone(),
                    implementation: row.implementation.clone(),
                    case: case_label(&row.case),
                    first: first.to_path_buf(),
                    first_index: *first_index,
                    second: l.path.clone(),
                    second_index: index,
                })));
            }
            seen.insert(key, (&l.path, index));
        }
    }
    Ok(())
}

/// Writes `bytes` to `path` atomically: a temporary file beside it, flushed, then renamed over.
///
/// Errors: the temporary file cannot be written or renamed; the error names the path.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = path
        .file_name()
        .with_context(|| format!("{} has no file name", path.display()))?;
    let tmp = parent.join(format!(
        ".{}.tmp-{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    let result = (|| -> anyhow::Result<()> {
        let mut f =
            fs::File::create(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
        f.write_all(bytes)
            .with_context(|| format!("cannot write {}", tmp.display()))?;
        f.sync_all()
            .with_context(|| format!("cannot flush {}", tmp.display()))?;
        fs::rename(&tmp, path)
            .with_context(|| format!("cannot rename {} to {}", tmp.display(), path.display()))?;
        Ok(())
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// Writes [`schema::document_schema_json`] to `data_dir/schema.json` atomically and returns the
/// path written.
pub fn write_schema(data_dir: &Path) -> anyhow::Result<PathBuf> {
    let path = data_dir.join(SCHEMA_FILE_NAME);
    write_schema_to(&path)?;
    Ok(path)
}

/// Writes [`schema::document_schema_json`] to `path` atomically.
pub fn write_schema_to(path: &Path) -> anyhow::Result<()> {
    write_atomic(path, schema::document_schema_json().as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_error_names_file_line_and_path() {
        let err = parse_document(Path::new("x.json"), b"{\n  \"schema_version\": \"one\"\n}")
            .unwrap_err();
        let s = err.to_string();
        assert!(s.starts_with("x.json:2:"), "{s}");
        assert!(s.contains("schema_version"), "{s}");
    }

    #[test]
    fn strip_position_keeps_message() {
        assert_eq!(
            strip_position("EOF while parsing at line 3 column 1"),
            "EOF while parsing"
        );
        assert_eq!(strip_position("plain"), "plain");
    }
}
