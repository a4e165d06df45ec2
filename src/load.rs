//! The only reader of `data/`: finds the suite documents (recursively, so that the documents of
//! several devices can live side by side in `data/<device>/`), parses them against the
//! [`schema`](crate::schema) types and checks what serde cannot: schema version, times that can
//! be true, throughput counts present where the document declares a throughput, no duplicate
//! rows, no two runs of one suite on one device. Also writes `data/schema.json` and owns the
//! atomic file write the rest of the crate uses.
//!
//! Every problem names the file, the line and the JSON path it is at, and every problem of
//! every file is reported, not only the first ([`LoadErrors`]).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use anyhow::Context as _;

use crate::schema::{self, Document, Param, RunKind, Suite, SCHEMA_VERSION, TILE_CONFIG_PARAM};

/// Largest document accepted, in bytes (64 MiB). Larger files are refused before parsing.
pub const MAX_DOCUMENT_BYTES: u64 = 64 * 1024 * 1024;

/// File name of the generated JSON Schema inside the data folder; never loaded as a document.
pub const SCHEMA_FILE_NAME: &str = "schema.json";

/// Folders of the data folder that hold no documents (the runners' logs); never descended.
pub const SKIPPED_DIRS: [&str; 1] = ["logs"];

/// One parsed and checked suite document and the file it came from.
#[derive(Clone, Debug, PartialEq)]
pub struct Loaded {
    /// Path of the JSON file, as found under the data folder.
    pub path: PathBuf,
    /// The path relative to the data folder, `/`-separated (`gpu_attention.json`,
    /// `h200/gpu_attention.json`): how pages name the document.
    pub rel_path: String,
    /// The document.
    pub doc: Document,
    /// Cases (their parameters as JSON) of a run cut off before it finished (no `finished_at`):
    /// a missing cell of one of these is a row the run never reached. Empty for a finished run;
    /// shards merged by `site::model::merge_shards` keep the union.
    pub cut_off_cases: BTreeSet<String>,
    /// Shards of this document's run that `--shard i/n` names but the data folder lacks, per
    /// part of the run ([`missing_shards`]); the same for every document of one run, filled by
    /// [`load_dir`]. Empty when every shard is there or the run was not sharded.
    pub missing_shards: Vec<MissingShards>,
    /// Per case (its key, [`case_key`]), the part of the run that measured it: its command and
    /// the implementations with a row in that part. Parts of one run may compare different
    /// alternatives (`--compare`, `--exclude`), so a missing cell can be an implementation that
    /// part never ran; merged shards keep the union.
    pub case_parts: BTreeMap<String, std::sync::Arc<CasePart>>,
}

/// The part of a run (one document) that measured a case.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CasePart {
    /// The part's command line without its `--output` (where the file went on the machine
    /// that ran it), as the page shows it.
    pub command: String,
    /// Implementations with at least one row in the part.
    pub implementations: BTreeSet<String>,
}

/// [`Loaded::case_parts`] of one document: every case of it mapped to the document's part.
fn case_parts(doc: &Document) -> BTreeMap<String, std::sync::Arc<CasePart>> {
    let mut command = Vec::new();
    let mut skip = false;
    for a in &doc.config.command {
        if std::mem::take(&mut skip) {
            continue;
        }
        if a == "--output" {
            skip = true;
        } else if !a.starts_with("--output=") {
            command.push(a.as_str());
        }
    }
    let part = std::sync::Arc::new(CasePart {
        command: command.join(" "),
        implementations: doc.rows.iter().map(|r| r.implementation.clone()).collect(),
    });
    doc.rows
        .iter()
        .map(|r| (case_key(&r.case), part.clone()))
        .collect()
}

/// Shards of one part of a run (`--shard i/n`, under one `--filter` or none) that no document
/// in the data folder holds: their cases, every n-th case of the part's grid from the i-th, were
/// never loaded, so their rows are absent rather than failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MissingShards {
    /// The part's `--filter` expression, if the run was split by filter as well.
    pub filter: Option<String>,
    /// n of `--shard i/n`.
    pub count: u32,
    /// The missing i, ascending (1-based, as the runner counts them).
    pub missing: Vec<u32>,
}

impl MissingShards {
    /// `shards 9–16 of 16 (part --filter pass=fwd+bwd)`: runs of consecutive shards joined.
    pub fn describe(&self) -> String {
        let mut spans: Vec<(u32, u32)> = Vec::new();
        for &i in &self.missing {
            match spans.last_mut() {
                Some((_, hi)) if *hi + 1 == i => *hi = i,
                _ => spans.push((i, i)),
            }
        }
        let list = spans
            .iter()
            .map(|&(lo, hi)| {
                if lo == hi {
                    lo.to_string()
                } else {
                    format!("{lo}\u{2013}{hi}")
                }
            })
            .collect::<Vec<_>>()
            .join(", ");
        let noun = if self.missing.len() == 1 {
            "shard"
        } else {
            "shards"
        };
        let part = match &self.filter {
            Some(f) => format!(" of the part measured with --filter {f}"),
            None => String::new(),
        };
        format!("{noun} {list} of {}{part}", self.count)
    }
}

/// The key of a case in [`Loaded::cut_off_cases`].
pub fn case_key(case: &BTreeMap<String, crate::schema::Param>) -> String {
    serde_json::to_string(case).unwrap_or_default()
}

/// The cases of `doc` when it never finished (no `finished_at`), else none.
fn cut_off_cases(doc: &Document) -> BTreeSet<String> {
    if doc.config.finished_at.is_some() {
        return BTreeSet::new();
    }
    doc.rows.iter().map(|r| case_key(&r.case)).collect()
}

impl Loaded {
    /// Wraps a document read from `path`; `rel_path` is the file name.
    pub fn new(path: PathBuf, doc: Document) -> Loaded {
        let rel_path = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| path.display().to_string());
        Loaded {
            path,
            rel_path,
            cut_off_cases: cut_off_cases(&doc),
            missing_shards: Vec::new(),
            case_parts: case_parts(&doc),
            doc,
        }
    }

    /// [`Loaded::missing_shards`] in words, parts joined by `; ` (`shards 9–16 of 16 of the
    /// part measured with --filter pass=fwd+bwd`), or `None` when no shard is missing.
    pub fn missing_shards_text(&self) -> Option<String> {
        if self.missing_shards.is_empty() {
            return None;
        }
        let parts: Vec<String> = self
            .missing_shards
            .iter()
            .map(MissingShards::describe)
            .collect();
        Some(parts.join("; "))
    }

    /// The document's path relative to the data folder (`h200/gpu_attention.json`), for
    /// display and for the `--output` of its reproduce command.
    pub fn file_name(&self) -> String {
        self.rel_path.clone()
    }
}

/// Where in a file a problem is: 1-based line and column (0 when unknown) and the JSON path
/// (`rows[3].median_ms`, `.` for the root).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Location {
    /// 1-based line, 0 when unknown.
    pub line: usize,
    /// 1-based column, 0 when unknown.
    pub column: usize,
    /// JSON path of the value.
    pub json_path: String,
}

/// Why a document was refused. Every variant names the file.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
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
    /// The JSON is malformed or does not match the schema's types.
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
    #[error(
        "{path}:{line}: schema_version is {found}, this docgen reads version {expected} \
         (at JSON path `schema_version`)"
    )]
    SchemaVersion {
        /// The file.
        path: PathBuf,
        /// Line of the field (0 when unknown).
        line: usize,
        /// Version in the file.
        found: u64,
        /// Version this build understands.
        expected: u32,
    },
    /// A value is impossible or inconsistent (a time of zero, quartiles out of order, a
    /// declared throughput whose count is missing, a negative memory figure, ...).
    #[error("{path}:{}: {what}: {problem} (at JSON path `{}`)", at.line, at.json_path)]
    Invalid {
        /// The file.
        path: PathBuf,
        /// Where in the file.
        at: Location,
        /// What the value belongs to, e.g. `rows[3] (flash, seq_len=512)` or `config`.
        what: String,
        /// What is wrong.
        problem: String,
    },
    /// The same (suite, device, case, implementation) appears twice.
    #[error(transparent)]
    Duplicate(Box<DuplicateRow>),
    /// Two documents of one suite, one device and one kind of run that are not shards of one
    /// run.
    #[error(
        "{} and {} both hold a {kind} of suite {suite} on device {device} and are not shards \
         of one run (shards come from one commit and one command, apart from the alternatives \
         each part compares, each part naming its cases with `--shard i/n` or its own \
         `--filter`); keep one of them (a document's device is \
         its `device.name`, not its folder; its kind is `config.kind`, `grid` when absent)",
        first.display(),
        second.display()
    )]
    TwoRuns {
        /// `grid` or `tile_sweep` (`config.kind`).
        kind: &'static str,
        /// Suite name.
        suite: String,
        /// Device name.
        device: String,
        /// One document.
        first: PathBuf,
        /// The other.
        second: PathBuf,
    },
    /// Two parts of one run both hold a case, each with rows of other implementations (parts
    /// that compare different alternatives, `--compare` or `--exclude`, under overlapping
    /// `--filter`s): the case's rows would come from two sessions.
    #[error(
        "{} and {} are parts of one run of suite {suite} on device {device} but both measured \
         the case {case} (the parts' --filter or --shard must split the cases; a part may \
         compare other alternatives, not measure a case again); keep one of them",
        first.display(),
        second.display()
    )]
    SharedCase {
        /// Suite name.
        suite: String,
        /// Device name.
        device: String,
        /// The first case both hold, as its parameters.
        case: String,
        /// One document.
        first: PathBuf,
        /// The other.
        second: PathBuf,
    },
    /// A document's command names a shard outside `1..=n` (`--shard i/n`, 1-based as the
    /// runner counts).
    #[error(
        "{}: config.command has `--shard {index}/{count}`, but shards are numbered 1 to {count}",
        path.display()
    )]
    BadShard {
        /// The document.
        path: PathBuf,
        /// i of `--shard i/n`.
        index: u32,
        /// n of `--shard i/n`.
        count: u32,
    },
    /// The data folder holds no suite document with rows.
    #[error("no suite documents in {dir}{detail}")]
    NoDocuments {
        /// The folder.
        dir: PathBuf,
        /// What was found instead, e.g. ` (2 documents, all with no rows)`.
        detail: String,
    },
    /// The data folder cannot be listed.
    #[error("cannot list data folder {dir}: {message}")]
    List {
        /// The folder.
        dir: PathBuf,
        /// The I/O error.
        message: String,
    },
}

/// Two rows with the same (suite, device, case, implementation), in one or two files.
#[derive(Debug, thiserror::Error)]
#[error(
    "duplicate row for suite {suite}, device {device}, implementation {implementation}, \
     case {case}: in {}:{first_line} (rows[{first_index}]) and {}:{second_line} (rows[{second_index}])",
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
    /// Line of the first occurrence (0 when unknown).
    pub first_line: usize,
    /// File of the second occurrence.
    pub second: PathBuf,
    /// Row index of the second occurrence.
    pub second_index: usize,
    /// Line of the second occurrence (0 when unknown).
    pub second_line: usize,
}

/// Every problem found, in file order; at least one.
#[derive(Debug)]
pub struct LoadErrors(pub Vec<LoadError>);

impl fmt::Display for LoadErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0.as_slice() {
            [one] => write!(f, "{one}"),
            many => {
                write!(f, "{} problems in the data:", many.len())?;
                for e in many {
                    write!(f, "\n  - {e}")?;
                }
                Ok(())
            }
        }
    }
}

impl std::error::Error for LoadErrors {}

impl From<LoadError> for LoadErrors {
    fn from(e: LoadError) -> LoadErrors {
        LoadErrors(vec![e])
    }
}

/// The document files of `dir`: every `*.json` (extension matched case-insensitively) under
/// it, recursively, skipping [`SCHEMA_FILE_NAME`], hidden files and folders, and the folders
/// named in [`SKIPPED_DIRS`]; sorted by path.
///
/// Errors: [`LoadError::List`] when the folder or one of its folders cannot be listed.
pub fn document_paths(dir: &Path) -> Result<Vec<PathBuf>, LoadError> {
    let list_err = |message: String| LoadError::List {
        dir: dir.to_path_buf(),
        message,
    };
    if !dir.is_dir() {
        return Err(list_err(if dir.exists() {
            "not a folder".to_string()
        } else {
            "no such folder".to_string()
        }));
    }
    let mut paths = Vec::new();
    let walker = walkdir::WalkDir::new(dir)
        .follow_links(true)
        .sort_by_file_name()
        .into_iter()
        .filter_entry(|e| {
            let name = e.file_name().to_string_lossy();
            e.depth() == 0
                || !(name.starts_with('.')
                    || (e.file_type().is_dir() && SKIPPED_DIRS.contains(&name.as_ref())))
        });
    for entry in walker {
        let entry = entry.map_err(|e| list_err(e.to_string()))?;
        if !entry.file_type().is_file() {
            continue;
        }
        let name = entry.file_name().to_string_lossy().to_lowercase();
        if name.ends_with(".json") && name != SCHEMA_FILE_NAME {
            paths.push(entry.into_path());
        }
    }
    paths.sort();
    Ok(paths)
}

/// Loads every document of `dir` ([`document_paths`]) and checks them together.
///
/// Errors ([`LoadErrors`], every problem of every file): a document is refused; the folder
/// holds no document with rows ([`LoadError::NoDocuments`]); two documents hold one suite on
/// one device, of one kind of run (`config.kind`), without being shards of one run
/// ([`LoadError::TwoRuns`]); a row is repeated across files.
pub fn load_dir(dir: &Path) -> Result<Vec<Loaded>, LoadErrors> {
    let paths = document_paths(dir)?;
    let mut loaded = Vec::with_capacity(paths.len());
    let mut errors = Vec::new();
    for path in paths {
        match load_file(&path) {
            Ok(doc) => {
                let rel_path = path
                    .strip_prefix(dir)
                    .unwrap_or(&path)
                    .components()
                    .map(|c| c.as_os_str().to_string_lossy().into_owned())
                    .collect::<Vec<_>>()
                    .join("/");
                loaded.push(Loaded {
                    path,
                    rel_path,
                    cut_off_cases: cut_off_cases(&doc),
                    missing_shards: Vec::new(),
                    case_parts: case_parts(&doc),
                    doc,
                });
            }
            Err(e) => errors.extend(e.0),
        }
    }
    if errors.is_empty() {
        let rows: usize = loaded.iter().map(|l| l.doc.rows.len()).sum();
        if rows == 0 {
            let detail = match loaded.len() {
                0 => " (no *.json file other than schema.json)".to_string(),
                n => format!(
                    " ({n} document{} with no rows)",
                    if n == 1 { "" } else { "s" }
                ),
            };
            errors.push(LoadError::NoDocuments {
                dir: dir.to_path_buf(),
                detail,
            });
        }
        let runs = check_runs(&loaded);
        if runs.is_empty() {
            errors.extend(check_duplicates(&loaded));
        }
        // Two runs of one suite repeat each other's rows: the runs' error says it all.
        errors.extend(runs);
    }
    if errors.is_empty() {
        fill_missing_shards(&mut loaded);
        Ok(loaded)
    } else {
        Err(LoadErrors(errors))
    }
}

/// Reads and checks one document.
///
/// Errors: [`LoadError::Read`], [`LoadError::TooLarge`], and those of [`parse_document`].
pub fn load_file(path: &Path) -> Result<Document, LoadErrors> {
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
        }
        .into());
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
        }
        .into());
    }
    parse_document(path, &bytes)
}

/// Parses `bytes` as a [`Document`] and checks it; `path` only names the source in errors.
/// Never panics, whatever the bytes.
///
/// Errors: [`LoadError::Parse`] (with line, column and JSON path), or
/// [`LoadError::SchemaVersion`] (checked first, so an older document says so rather than
/// failing on a field that changed), or every [`LoadError::Invalid`] and
/// [`LoadError::Duplicate`] of the document.
pub fn parse_document(path: &Path, bytes: &[u8]) -> Result<Document, LoadErrors> {
    let parse_err = |e: serde_json::Error, json_path: String| LoadError::Parse {
        path: path.to_path_buf(),
        line: e.line(),
        column: e.column(),
        json_path,
        message: strip_position(&e.to_string()),
    };
    // The version first: a document of another version fails on the fields that changed.
    // (Only the version is kept; every other value is skipped without being built.)
    #[derive(serde::Deserialize)]
    struct Version {
        schema_version: Option<u64>,
    }
    if let Ok(value) = serde_json::from_slice::<Version>(bytes) {
        if let Some(found) = value.schema_version {
            if found != u64::from(SCHEMA_VERSION) {
                let line = locate(bytes, &[PathSeg::Key("schema_version".into())]).line;
                return Err(LoadError::SchemaVersion {
                    path: path.to_path_buf(),
                    line,
                    found,
                    expected: SCHEMA_VERSION,
                }
                .into());
            }
        }
    }
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let doc: Document = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let json_path = e.path().to_string();
        parse_err(e.into_inner(), json_path)
    })?;
    de.end().map_err(|e| parse_err(e, ".".to_string()))?;
    let mut errors = check_document(path, bytes, &doc);
    let single = [Loaded::new(path.to_path_buf(), doc)];
    errors.extend(check_duplicates(&single));
    if !errors.is_empty() {
        return Err(LoadErrors(errors));
    }
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

/// One step of a JSON path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PathSeg {
    /// An object member.
    Key(String),
    /// An array element.
    Index(usize),
}

/// `rows[3].median_ms` from its steps (`.` for none).
pub fn path_string(path: &[PathSeg]) -> String {
    let mut s = String::new();
    for seg in path {
        match seg {
            PathSeg::Key(k) => {
                if !s.is_empty() {
                    s.push('.');
                }
                s.push_str(k);
            }
            PathSeg::Index(i) => s.push_str(&format!("[{i}]")),
        }
    }
    if s.is_empty() {
        ".".to_string()
    } else {
        s
    }
}

/// The steps of a JSON pointer (`/rows/3/median_ms`).
pub fn pointer_segments(pointer: &str) -> Vec<PathSeg> {
    pointer
        .split('/')
        .skip(1)
        .map(|p| {
            let p = p.replace("~1", "/").replace("~0", "~");
            match p.parse::<usize>() {
                Ok(i) => PathSeg::Index(i),
                Err(_) => PathSeg::Key(p),
            }
        })
        .collect()
}

/// Where the value at `path` starts in `bytes` (a JSON text): its line and column, and the
/// path as text. Where the path does not reach a value (a missing field), the deepest value it
/// reaches is located instead. Line 0 when the text does not parse.
pub fn locate(bytes: &[u8], path: &[PathSeg]) -> Location {
    use jsonc_parser::ast::Value;
    use jsonc_parser::common::Ranged as _;
    let mut at = Location {
        line: 0,
        column: 0,
        json_path: path_string(path),
    };
    let Ok(text) = std::str::from_utf8(bytes) else {
        return at;
    };
    let Ok(parsed) = jsonc_parser::parse_to_ast(
        text,
        &jsonc_parser::CollectOptions::default(),
        &jsonc_parser::ParseOptions::default(),
    ) else {
        return at;
    };
    let Some(mut value) = parsed.value.as_ref() else {
        return at;
    };
    for seg in path {
        let next = match (seg, value) {
            (PathSeg::Key(k), Value::Object(o)) => o
                .properties
                .iter()
                .find(|p| p.name.as_str() == k)
                .map(|p| &p.value),
            (PathSeg::Index(i), Value::Array(a)) => a.elements.get(*i),
            _ => None,
        };
        match next {
            Some(v) => value = v,
            None => break,
        }
    }
    let start = value.range().start.min(text.len());
    let before = &text[..start];
    at.line = before.matches('\n').count() + 1;
    at.column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    at
}

/// Every semantic problem of `doc` (read from `bytes` at `path`): the ranges the JSON Schema
/// also states (so the two agree), and what it cannot state (quartile order, an ok row's time
/// and declared counts, unique axes and throughput keys).
fn check_document(path: &Path, bytes: &[u8], doc: &Document) -> Vec<LoadError> {
    use PathSeg::{Index, Key};
    let mut errors = Vec::new();
    let mut bad = |segs: Vec<PathSeg>, what: String, problem: String| {
        errors.push(LoadError::Invalid {
            path: path.to_path_buf(),
            at: locate(bytes, &segs),
            what,
            problem,
        });
    };
    let key = |k: &str| Key(k.to_string());

    // Device.
    for (name, v) in [
        ("memory_mb", doc.device.memory_mb),
        ("l2_mb", doc.device.l2_mb),
        ("power_limit_w", doc.device.power_limit_w),
        ("max_sm_clock_mhz", doc.device.max_sm_clock_mhz),
        ("max_mem_clock_mhz", doc.device.max_mem_clock_mhz),
    ] {
        if let Some(v) = v {
            if !(v.is_finite() && v > 0.0) {
                bad(
                    vec![key("device"), key(name)],
                    "device".into(),
                    format!("{name} is {v}; must be finite and > 0"),
                );
            }
        }
    }

    // Config: timing parameters.
    let config = &doc.config;
    let t = &config.timing;
    for (name, v, strict) in [
        ("warmup_ms", t.warmup_ms, false),
        ("min_sample_ms", t.min_sample_ms, true),
        ("l2_rotation_factor", t.l2_rotation_factor, false),
        ("case_timeout_s", t.case_timeout_s, true),
        ("launch_bound_ratio", t.launch_bound_ratio, true),
    ] {
        if !(v.is_finite() && (v > 0.0 || (!strict && v == 0.0))) {
            let rule = if strict { "> 0" } else { ">= 0" };
            bad(
                vec![key("config"), key("timing"), key(name)],
                "config.timing".into(),
                format!("{name} is {v}; must be finite and {rule}"),
            );
        }
    }
    for (name, v) in [
        ("repeats", t.repeats),
        ("max_inner", t.max_inner),
        ("runs", t.runs),
    ] {
        if v == 0 {
            bad(
                vec![key("config"), key("timing"), key(name)],
                "config.timing".into(),
                format!("{name} is 0; must be >= 1"),
            );
        }
    }

    // Config: axes and throughput declarations.
    if config.axes.is_empty() {
        bad(
            vec![key("config"), key("axes")],
            "config".into(),
            "axes is empty; name at least one case parameter to draw the figures against".into(),
        );
    }
    let mut seen_axes = BTreeSet::new();
    for (i, a) in config.axes.iter().enumerate() {
        if !seen_axes.insert(a.as_str()) {
            bad(
                vec![key("config"), key("axes"), Index(i)],
                "config".into(),
                format!("axis {a:?} is named twice"),
            );
        }
    }
    let mut seen_keys = BTreeSet::new();
    for (i, t) in config.throughput.iter().enumerate() {
        let at = |f: &str| vec![key("config"), key("throughput"), Index(i), key(f)];
        let what = format!("config.throughput[{i}] ({})", t.unit);
        if t.key.is_empty() || !seen_keys.insert(t.key.as_str()) {
            bad(
                at("key"),
                what.clone(),
                format!("key {:?} is empty or used twice", t.key),
            );
        }
        if t.unit.is_empty() {
            bad(at("unit"), what.clone(), "unit is empty".into());
        }
        if !(t.per_second.is_finite() && t.per_second > 0.0) {
            bad(
                at("per_second"),
                what.clone(),
                format!("per_second is {}; must be finite and > 0", t.per_second),
            );
        }
        if let Some(c) = &t.ceiling {
            if !(c.value.is_finite() && c.value > 0.0) {
                bad(
                    vec![
                        key("config"),
                        key("throughput"),
                        Index(i),
                        key("ceiling"),
                        key("value"),
                    ],
                    what.clone(),
                    format!("ceiling.value is {}; must be finite and > 0", c.value),
                );
            }
            if c.source.is_empty() {
                bad(
                    vec![
                        key("config"),
                        key("throughput"),
                        Index(i),
                        key("ceiling"),
                        key("source"),
                    ],
                    what.clone(),
                    "ceiling.source is empty".into(),
                );
            }
        }
    }
    if let Some(p) = &config.protocol {
        let at = |f: &str| vec![key("config"), key("protocol"), key(f)];
        for (f, v, strict) in [
            ("rotation_memory_fraction", p.rotation_memory_fraction, true),
            ("process_limit_factor", p.process_limit_factor, true),
            ("process_limit_margin_s", p.process_limit_margin_s, false),
            ("machine_sample_ms", p.machine_sample_ms, true),
        ] {
            let ok = v.is_finite() && if strict { v > 0.0 } else { v >= 0.0 };
            if !ok {
                bad(
                    at(f),
                    "config.protocol".into(),
                    format!(
                        "{f} is {v}; must be finite and {}",
                        if strict { "> 0" } else { ">= 0" }
                    ),
                );
            }
        }
        for (f, v) in [
            ("min_samples", p.min_samples),
            ("max_input_sets", p.max_input_sets),
        ] {
            if v == 0 {
                bad(
                    at(f),
                    "config.protocol".into(),
                    format!("{f} is 0; must be >= 1"),
                );
            }
        }
    }
    for (i, a) in config.amendments.iter().enumerate() {
        for (f, v) in [("when", &a.when), ("what", &a.what), ("why", &a.why)] {
            if v.trim().is_empty() {
                bad(
                    vec![key("config"), key("amendments"), Index(i), key(f)],
                    format!("config.amendments[{i}]"),
                    format!("{f} is empty"),
                );
            }
        }
    }

    // Rows.
    for (index, row) in doc.rows.iter().enumerate() {
        let what = format!(
            "rows[{index}] ({}, {})",
            row.implementation,
            case_label(&row.case)
        );
        let at = |f: &[&str]| {
            let mut v = vec![key("rows"), Index(index)];
            v.extend(f.iter().map(|s| key(s)));
            v
        };
        if doc.config.kind == RunKind::TileSweep
            && !matches!(row.case.get(TILE_CONFIG_PARAM), Some(Param::Text(t)) if !t.is_empty())
        {
            bad(
                at(&["case"]),
                what.clone(),
                format!(
                    "a tile sweep's row must name its configuration in the case parameter \
                     `{TILE_CONFIG_PARAM}` (text)"
                ),
            );
        }
        let mut positive = |f: &[&str], v: Option<f64>| {
            if let Some(v) = v {
                if !(v.is_finite() && v > 0.0) {
                    bad(
                        at(f),
                        what.clone(),
                        format!("{} is {v}; must be finite and > 0", f.join(".")),
                    );
                }
            }
        };
        positive(&["median_ms"], row.median_ms);
        positive(&["q1_ms"], row.q1_ms);
        positive(&["q3_ms"], row.q3_ms);
        positive(&["flops"], row.flops);
        positive(&["bytes"], row.bytes);
        positive(&["items"], row.items);
        positive(&["host_ms"], row.host_ms);
        positive(&["eager_median_ms"], row.eager_median_ms);
        if let Some(m) = &row.machine {
            positive(&["machine", "sm_clock_mhz"], m.sm_clock_mhz);
            positive(&["machine", "max_sm_clock_mhz"], m.max_sm_clock_mhz);
            positive(&["machine", "mem_clock_mhz"], m.mem_clock_mhz);
            positive(&["machine", "power_limit_w"], m.power_limit_w);
        }
        for &r in &row.runs_ms {
            positive(&["runs_ms"], Some(r));
        }
        if let Some(a) = &row.accuracy {
            positive(&["accuracy", "tolerance"], Some(a.tolerance));
        }
        let mut non_negative = |f: &[&str], v: Option<f64>| {
            if let Some(v) = v {
                if !(v.is_finite() && v >= 0.0) {
                    bad(
                        at(f),
                        what.clone(),
                        format!("{} is {v}; must be finite and >= 0", f.join(".")),
                    );
                }
            }
        };
        non_negative(&["compile_s"], row.compile_s);
        non_negative(&["first_call_s"], row.first_call_s);
        non_negative(&["l2_rotation_reached"], row.l2_rotation_reached);
        if let Some(m) = &row.machine {
            non_negative(&["machine", "power_w"], m.power_w);
        }
        if let Some(a) = &row.accuracy {
            non_negative(&["accuracy", "rel_err"], Some(a.rel_err));
        }
        if let Some(m) = &row.memory {
            for (f, v) in [
                ("arguments_mb", m.arguments_mb),
                ("outputs_mb", m.outputs_mb),
                ("temporaries_mb", m.temporaries_mb),
                ("residuals_mb", m.residuals_mb),
                ("peak_mb", m.peak_mb),
                ("reserved_peak_mb", m.reserved_peak_mb),
                ("workspace_mb", m.workspace_mb),
            ] {
                non_negative(&["memory", f], v);
            }
        }
        if let Some(c) = row.machine.as_ref().and_then(|m| m.temperature_c) {
            if !c.is_finite() {
                bad(
                    at(&["machine", "temperature_c"]),
                    what.clone(),
                    format!("machine.temperature_c is {c}; must be finite"),
                );
            }
        }
        for (f, v) in [
            ("inner_calls", row.inner_calls),
            ("samples", row.samples),
            ("input_sets", row.input_sets),
        ] {
            if v == Some(0) {
                bad(at(&[f]), what.clone(), format!("{f} is 0; must be >= 1"));
            }
        }
        if let (Some(q1), Some(m), Some(q3)) = (row.q1_ms, row.median_ms, row.q3_ms) {
            if !(q1 <= m && m <= q3) {
                bad(
                    at(&["q1_ms"]),
                    what.clone(),
                    format!(
                        "quartiles out of order: q1_ms {q1} <= median_ms {m} <= q3_ms {q3} \
                         does not hold"
                    ),
                );
            }
        }
        if row.status == schema::Status::Ok {
            if row.median_ms.is_none() {
                bad(
                    at(&[]),
                    what.clone(),
                    "status is ok but median_ms is missing".into(),
                );
            }
            for t in &config.throughput {
                if t.count.of(row).is_none() {
                    bad(
                        at(&[]),
                        what.clone(),
                        format!(
                            "status is ok but `{}` is missing, which the declared throughput \
                             {} (config.throughput, key {:?}) is computed from",
                            t.count.as_str(),
                            t.unit,
                            t.key
                        ),
                    );
                }
            }
        }
    }
    errors
}

/// Key of a row for duplicate detection: suite, device name, canonical case JSON, implementation.
type RowKey = (Suite, String, String, String);

fn check_duplicates(loaded: &[Loaded]) -> Vec<LoadError> {
    let mut errors = Vec::new();
    let mut seen: BTreeMap<RowKey, (&Loaded, usize)> = BTreeMap::new();
    let line_of = |l: &Loaded, index: usize| -> usize {
        fs::read(&l.path)
            .map(|b| locate(&b, &[PathSeg::Key("rows".into()), PathSeg::Index(index)]).line)
            .unwrap_or(0)
    };
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
                errors.push(LoadError::Duplicate(Box::new(DuplicateRow {
                    suite: l.doc.suite.as_str().to_string(),
                    device: l.doc.device.name.clone(),
                    implementation: row.implementation.clone(),
                    case: case_label(&row.case),
                    first: first.path.clone(),
                    first_index: *first_index,
                    first_line: line_of(first, *first_index),
                    second: l.path.clone(),
                    second_index: index,
                    second_line: line_of(l, index),
                })));
            } else {
                seen.insert(key, (l, index));
            }
        }
    }
    errors
}

/// `(i, n)` of a `--shard i/n` (or `--shard=i/n`) in a recorded command line.
pub fn shard_of(command: &[String]) -> Option<(u32, u32)> {
    let value = command.iter().enumerate().find_map(|(i, a)| {
        if a == "--shard" {
            command.get(i + 1).map(String::as_str)
        } else {
            a.strip_prefix("--shard=")
        }
    })?;
    let (i, n) = value.split_once('/')?;
    Some((i.trim().parse().ok()?, n.trim().parse().ok()?))
}

/// The shards that the documents of one run (`parts`: one suite, device and kind of run,
/// already checked by [`check_runs`]) name but do not hold, per `--filter` part: for each part
/// with `--shard i/n`, the i in `1..=n` that no document has.
pub fn missing_shards(parts: &[&Loaded]) -> Vec<MissingShards> {
    let mut by_part: BTreeMap<Option<String>, (u32, BTreeSet<u32>)> = BTreeMap::new();
    for l in parts {
        if let Some((i, n)) = shard_of(&l.doc.config.command) {
            let filter = filter_of(&l.doc.config.command).map(str::to_string);
            let entry = by_part.entry(filter).or_insert((n, BTreeSet::new()));
            entry.1.insert(i);
        }
    }
    by_part
        .into_iter()
        .filter_map(|(filter, (count, present))| {
            let missing: Vec<u32> = (1..=count).filter(|i| !present.contains(i)).collect();
            (!missing.is_empty()).then_some(MissingShards {
                filter,
                count,
                missing,
            })
        })
        .collect()
}

/// Sets [`Loaded::missing_shards`] on every document from the documents of its run.
fn fill_missing_shards(loaded: &mut [Loaded]) {
    let key = |l: &Loaded| (l.doc.suite, l.doc.device.name.clone(), l.doc.config.kind);
    let mut found: Vec<Vec<MissingShards>> = Vec::with_capacity(loaded.len());
    for l in loaded.iter() {
        let run: Vec<&Loaded> = loaded.iter().filter(|o| key(o) == key(l)).collect();
        found.push(missing_shards(&run));
    }
    for (l, m) in loaded.iter_mut().zip(found) {
        l.missing_shards = m;
    }
}

/// The options that split one run into parts: which cases a part measures, which
/// alternatives it measures them with (an expensive alternative may be left to some parts; the
/// page says so in its missing cells, [`Loaded::case_parts`]), and where it writes.
const PART_OPTIONS: [&str; 5] = ["--shard", "--filter", "--compare", "--exclude", "--output"];

/// The command line without its [`PART_OPTIONS`]: equal for the parts of one run.
fn command_without_shard(command: &[String]) -> Vec<&str> {
    command_without(command, &PART_OPTIONS)
}

/// The command line without the `options` given (`--shard`, ...) and their values, whether
/// written `--shard 1/4` or `--shard=1/4`.
pub fn command_without<'a>(command: &'a [String], options: &[&str]) -> Vec<&'a str> {
    let mut out = Vec::new();
    let mut skip = false;
    for a in command {
        if std::mem::take(&mut skip) {
            continue;
        }
        if options.contains(&a.as_str()) {
            skip = true;
            continue;
        }
        if options.iter().any(|o| a.starts_with(&format!("{o}="))) {
            continue;
        }
        out.push(a.as_str());
    }
    out
}

/// The `--filter` of a recorded command, if any.
fn filter_of(command: &[String]) -> Option<&str> {
    command.iter().enumerate().find_map(|(i, a)| {
        if a == "--filter" {
            command.get(i + 1).map(String::as_str)
        } else {
            a.strip_prefix("--filter=")
        }
    })
}

/// Documents of one suite, device and kind of run (`config.kind`: the grid, or a tile sweep,
/// which may come from another commit than the grid) must be parts of one run: from the same
/// commit, with the same timing parameters and the same command apart from
/// [`PART_OPTIONS`] (the alternatives compared may differ from part to part), each part
/// selecting its cases its own way (`--shard i/n`, `--filter`, or both: a run split over
/// several calls of a time-limited machine, say begun in shards and finished by filters); two
/// documents with the same selection are two runs. Every pair of documents is compared, so a
/// copied part is caught whichever part comes first. Parts must measure disjoint cases: a case
/// whose rows the two parts split by implementation is refused here
/// ([`LoadError::SharedCase`]), a row both hold by the duplicate-row check. A shard number
/// outside `1..=n` is refused ([`LoadError::BadShard`]).
fn check_runs(loaded: &[Loaded]) -> Vec<LoadError> {
    let mut errors = Vec::new();
    let mut by_key: BTreeMap<(Suite, &str, RunKind), Vec<&Loaded>> = BTreeMap::new();
    for l in loaded {
        by_key
            .entry((l.doc.suite, l.doc.device.name.as_str(), l.doc.config.kind))
            .or_default()
            .push(l);
    }
    for l in loaded {
        if let Some((index, count)) = shard_of(&l.doc.config.command) {
            if index == 0 || index > count {
                errors.push(LoadError::BadShard {
                    path: l.path.clone(),
                    index,
                    count,
                });
            }
        }
    }
    for ((suite, device, kind), docs) in by_key {
        for (i, first) in docs.iter().enumerate() {
            for other in &docs[i + 1..] {
                let a = &first.doc.config;
                let b = &other.doc.config;
                let same_run = a.git_commit == b.git_commit
                    && a.timing == b.timing
                    && command_without_shard(&a.command) == command_without_shard(&b.command);
                // Parts of one run select their cases differently (`--shard i/n`, `--filter`,
                // or both); the same selection twice is two runs of the same cases. Whatever
                // the selections, the parts are held to disjoint cases below and by the
                // duplicate-row check.
                let same_selection = filter_of(&a.command) == filter_of(&b.command)
                    && shard_of(&a.command) == shard_of(&b.command);
                let shards = same_run && !same_selection;
                if shards {
                    // Distinct filters may still overlap; a case whose rows are split between
                    // the parts by implementation is refused here, one repeated whole row by
                    // the duplicate-row check.
                    fn of(l: &Loaded) -> BTreeMap<String, BTreeSet<&str>> {
                        let mut m: BTreeMap<String, BTreeSet<&str>> = BTreeMap::new();
                        for r in &l.doc.rows {
                            m.entry(case_key(&r.case))
                                .or_default()
                                .insert(r.implementation.as_str());
                        }
                        m
                    }
                    let (ca, cb) = (of(first), of(other));
                    let shared = ca
                        .iter()
                        .find(|(k, ia)| cb.get(*k).is_some_and(|ib| ia.is_disjoint(ib)));
                    if let Some((k, _)) = shared {
                        let case = first
                            .doc
                            .rows
                            .iter()
                            .find(|r| &case_key(&r.case) == k)
                            .map(|r| case_label(&r.case))
                            .unwrap_or_default();
                        errors.push(LoadError::SharedCase {
                            suite: suite.as_str().to_string(),
                            device: device.to_string(),
                            case,
                            first: first.path.clone(),
                            second: other.path.clone(),
                        });
                    }
                } else {
                    errors.push(LoadError::TwoRuns {
                        kind: kind.as_str(),
                        suite: suite.as_str().to_string(),
                        device: device.to_string(),
                        first: first.path.clone(),
                        second: other.path.clone(),
                    });
                }
            }
        }
    }
    errors
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

    #[test]
    fn locate_finds_nested_values() {
        let text = b"{\n  \"rows\": [\n    {\"a\": 1},\n    {\"a\": 2,\n     \"b\": 3}\n  ]\n}";
        let at = locate(
            text,
            &[
                PathSeg::Key("rows".into()),
                PathSeg::Index(1),
                PathSeg::Key("b".into()),
            ],
        );
        assert_eq!((at.line, at.column), (5, 11), "{at:?}");
        assert_eq!(at.json_path, "rows[1].b");
        // A missing member locates its parent.
        let at = locate(
            text,
            &[
                PathSeg::Key("rows".into()),
                PathSeg::Index(0),
                PathSeg::Key("zz".into()),
            ],
        );
        assert_eq!(at.line, 3);
        assert_eq!(
            pointer_segments("/rows/1/b"),
            vec![
                PathSeg::Key("rows".into()),
                PathSeg::Index(1),
                PathSeg::Key("b".into())
            ]
        );
    }

    #[test]
    fn shard_numbers_and_mixed_parts_are_checked() {
        let doc: Document =
            serde_json::from_str(include_str!("../tests/fixtures/valid/gpu_attention.json"))
                .expect("fixture");
        let part = |name: &str, extra: &[&str]| {
            let mut d = doc.clone();
            d.config.command.extend(extra.iter().map(|s| s.to_string()));
            Loaded::new(PathBuf::from(name), d)
        };
        // Shard 3 of 2 is no shard.
        let e = check_runs(&[part("a.json", &["--shard", "3/2"])]);
        assert!(
            matches!(
                e[..],
                [LoadError::BadShard {
                    index: 3,
                    count: 2,
                    ..
                }]
            ),
            "{e:?}"
        );
        assert!(e[0].to_string().contains("a.json"));
        // An unfiltered shard beside a filtered part (a run begun in shards and finished by
        // filters): parts of one run when their cases are disjoint; a case both hold, its
        // rows split by implementation, is refused.
        let by_case = |name: &str, extra: &[&str], first_half: bool| {
            let mut l = part(name, extra);
            let mut keys: Vec<String> = l.doc.rows.iter().map(|r| case_key(&r.case)).collect();
            keys.sort();
            keys.dedup();
            let half: BTreeSet<String> = keys[..keys.len() / 2].iter().cloned().collect();
            l.doc
                .rows
                .retain(|r| half.contains(&case_key(&r.case)) == first_half);
            l
        };
        let e = check_runs(&[
            by_case("a.json", &["--shard", "1/2"], true),
            by_case("b.json", &["--filter", "pass=fwd"], false),
        ]);
        assert!(e.is_empty(), "{e:?}");
        let mut b = part("b.json", &["--filter", "pass=fwd"]);
        b.doc.rows.retain(|r| !r.default);
        let mut a = part("a.json", &["--shard", "1/2"]);
        a.doc.rows.retain(|r| r.default);
        let e = check_runs(&[a, b]);
        assert!(matches!(e[..], [LoadError::SharedCase { .. }]), "{e:?}");
        // The same selection twice is two runs.
        let e = check_runs(&[
            part("a.json", &["--shard", "1/2"]),
            part("b.json", &["--shard", "1/2"]),
        ]);
        assert!(matches!(e[..], [LoadError::TwoRuns { .. }]), "{e:?}");
        // Distinct filters, each sharded, are parts of one run.
        let e = check_runs(&[
            part("a.json", &["--filter", "pass=fwd", "--shard", "1/2"]),
            part("b.json", &["--filter", "pass=fwd", "--shard", "2/2"]),
            part("c.json", &["--filter", "pass=fwd+bwd", "--shard", "1/2"]),
        ]);
        assert!(e.is_empty(), "{e:?}");
        // Parts may compare different alternatives; the same filter twice is still two runs.
        let e = check_runs(&[
            part(
                "a.json",
                &["--compare", "torch,fla", "--filter", "seq_len=16384"],
            ),
            part("b.json", &["--filter", "seq_len=4096"]),
        ]);
        assert!(e.is_empty(), "{e:?}");
        let e = check_runs(&[
            part(
                "a.json",
                &["--compare", "torch", "--filter", "seq_len=4096"],
            ),
            part("b.json", &["--filter", "seq_len=4096"]),
        ]);
        assert!(matches!(e[..], [LoadError::TwoRuns { .. }]), "{e:?}");
        // Distinct filters that overlap, the shared cases' rows split by implementation: the
        // case would come from two sessions.
        let split = |name: &str, filter: &str, keep_default: bool| {
            let mut l = part(name, &["--filter", filter]);
            l.doc.rows.retain(|r| r.default == keep_default);
            l
        };
        let e = check_runs(&[
            split("a.json", "seq_len>=512", true),
            split("b.json", "seq_len>=1024", false),
        ]);
        assert!(matches!(e[..], [LoadError::SharedCase { .. }]), "{e:?}");
        assert!(
            e[0].to_string().contains("both measured the case"),
            "{}",
            e[0]
        );
    }

    #[test]
    fn missing_shards_are_described_as_spans() {
        let m = |filter: Option<&str>, count, missing: &[u32]| MissingShards {
            filter: filter.map(str::to_string),
            count,
            missing: missing.to_vec(),
        };
        assert_eq!(
            m(Some("pass=fwd+bwd"), 16, &[9, 10, 11, 12, 13, 14, 15, 16]).describe(),
            "shards 9\u{2013}16 of 16 of the part measured with --filter pass=fwd+bwd"
        );
        assert_eq!(m(None, 3, &[3]).describe(), "shard 3 of 3");
        assert_eq!(
            m(None, 8, &[1, 2, 4, 6, 7]).describe(),
            "shards 1\u{2013}2, 4, 6\u{2013}7 of 8"
        );
    }

    #[test]
    fn shard_options_are_read_from_the_command() {
        let cmd = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            shard_of(&cmd(&["attention", "--shard", "1/3"])),
            Some((1, 3))
        );
        assert_eq!(shard_of(&cmd(&["attention", "--shard=0/2"])), Some((0, 2)));
        assert_eq!(shard_of(&cmd(&["attention"])), None);
        assert_eq!(
            command_without_shard(&cmd(&["a", "--shard", "1/3", "--output", "x", "--quick"])),
            vec!["a", "--quick"]
        );
    }
}
