//! Data-checked prose: values and ratios render the fixture's numbers (computed here from the
//! fixture rows, not typed), claims are checked against every case pair, and every failure
//! names the prose file, the call, the claim's sentence and the offending rows.

use std::fs;
use std::path::{Path, PathBuf};

use kernelpages::load::{self, case_label, Loaded};
use kernelpages::schema::{Row, Status};
use kernelpages::site::prose::{self, ProseError};
use kernelpages::site::{self, format, BuildOptions};
use scraper::{Html, Selector};

fn fixture_docs() -> Vec<Loaded> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/valid");
    load::load_dir(&dir).unwrap()
}

fn rows(docs: &[Loaded]) -> Vec<&Row> {
    docs.iter().flat_map(|l| l.doc.rows.iter()).collect()
}

/// The fixture row of `implementation` at (head_dim, causal, seq_len).
fn row<'a>(
    docs: &'a [Loaded],
    implementation: &str,
    head_dim: i64,
    causal: bool,
    seq_len: i64,
) -> &'a Row {
    rows(docs)
        .into_iter()
        .find(|r| {
            r.implementation == implementation
                && r.int("head_dim") == Some(head_dim)
                && r.flag("causal") == Some(causal)
                && r.int("seq_len") == Some(seq_len)
        })
        .unwrap_or_else(|| panic!("no fixture row {implementation} {head_dim} {causal} {seq_len}"))
}

/// Renders one prose file and returns the text of each `<li>`.
fn items(docs: &[Loaded], source: &str) -> Vec<String> {
    let html = prose::render_prose(docs, &[("p.md", source)])
        .unwrap_or_else(|e| panic!("{e}"))
        .remove("p.md")
        .unwrap();
    let doc = Html::parse_fragment(&html);
    doc.select(&Selector::parse("li").unwrap())
        .map(|li| {
            li.text()
                .collect::<String>()
                .split_whitespace()
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect()
}

fn failure(docs: &[Loaded], source: &str) -> ProseError {
    match prose::render_prose(docs, &[("p.md", source)]) {
        Ok(html) => panic!("expected a failure, rendered {html:?}"),
        Err(e) => e,
    }
}

/// A ratio of two times whose quartiles overlap names no faster side: it says `within noise`,
/// by the rule the claims and tables use (the faster side's q3 below the other's q1).
#[test]
fn a_ratio_within_noise_says_so() {
    let mut docs = fixture_docs();
    let src = r#"- {{ ratio(suite="attention", num="flash", den="torch_cudnn", case="head_dim=128, seq_len=2048, causal=false") }}"#;
    let before = items(&docs, src);
    assert!(!before[0].contains("within noise"), "{before:?}");
    let flash = row(&docs, "flash", 128, false, 2048).clone();
    let r = row(&docs, "torch_cudnn", 128, false, 2048)
        .median_ms
        .unwrap()
        / flash.median_ms.unwrap();
    // The alternative's first quartile moved below the default's third.
    for l in &mut docs {
        for row in &mut l.doc.rows {
            if row.implementation == "torch_cudnn" && row.case == flash.case {
                let (lo, hi) = (flash.median_ms.unwrap(), row.median_ms.unwrap());
                row.q1_ms = Some(lo.min(hi) * 0.99);
                row.q3_ms = Some(lo.max(hi) * 1.01);
            }
        }
    }
    let after = items(&docs, src);
    assert_eq!(after, [format!("{} (within noise)", format::ratio(r))]);
}

#[test]
fn values_and_ratios_are_the_fixture_numbers() {
    let docs = fixture_docs();
    let src = r#"
- {{ value(suite="attention", implementation="flash", case="head_dim=128, seq_len=2048, causal=false", field="tflops") }}
- {{ value(suite="attention", implementation="math", case="head_dim = 64 and causal = true and seq_len = 1024", field="median_ms") }}
- {{ value(suite="attention", implementation="math", case="head_dim=64, causal=false, seq_len=2048", field="temporaries_mb") }}
- {{ value(suite="attention", implementation="flash", case="head_dim=64, causal=false, seq_len=max", field="rel_err") }}
- {{ ratio(suite="attention", num="flash", den="torch_cudnn", case="head_dim=128, seq_len=2048, causal=false", field="median_ms") }}
- {{ case(suite="attention", case="head_dim=64, causal=false, seq_len=max") }}
- {{ largest(suite="attention", param="seq_len") }}
- {{ values(suite="attention", param="head_dim") }}
"#;
    let got = items(&docs, src);
    let flash = row(&docs, "flash", 128, false, 2048);
    let math = row(&docs, "math", 64, true, 1024);
    let math_t = row(&docs, "math", 64, false, 2048);
    let max_seq = rows(&docs)
        .iter()
        .filter_map(|r| r.int("seq_len"))
        .max()
        .unwrap();
    let flash_max = row(&docs, "flash", 64, false, max_seq);
    let cudnn = row(&docs, "torch_cudnn", 128, false, 2048);
    let expected = [
        format::sig(
            flash.flops.unwrap() / (flash.median_ms.unwrap() * 1e-3) / 1e12,
            3,
        ),
        format::ms(math.median_ms.unwrap()),
        format::mb(math_t.memory.as_ref().unwrap().temporaries_mb.unwrap()),
        format::rel_err(flash_max.accuracy.as_ref().unwrap().rel_err),
        {
            // The alternative's time over the default's, however num and den are given.
            let r = cudnn.median_ms.unwrap() / flash.median_ms.unwrap();
            format!(
                "{} ({})",
                format::ratio(r),
                format::time_ratio_words(r, r, "flash")
            )
        },
        format!("head_dim=64, causal=false, seq_len={max_seq}"),
        max_seq.to_string(),
        "64, 128".to_string(),
    ];
    assert_eq!(got, expected);
}

#[test]
fn a_claim_that_holds_says_how_many_cases_it_covers() {
    let docs = fixture_docs();
    let got = items(
        &docs,
        r#"- {{ claim(suite="attention", faster="flash", than="math", where="seq_len >= 1024") }}"#,
    );
    // Pairs in which both ran, and pairs left out because one did not.
    let (mut both, mut left_out) = (0, 0);
    let mut ratios = Vec::new();
    let mut lengths = std::collections::BTreeSet::new();
    let mut compared = Vec::new();
    for f in rows(&docs)
        .into_iter()
        .filter(|r| r.implementation == "flash" && r.int("seq_len").unwrap() >= 1024)
    {
        let m = rows(&docs)
            .into_iter()
            .find(|r| r.implementation == "math" && r.case == f.case);
        match m {
            Some(m) if m.status == Status::Ok && f.status == Status::Ok => {
                both += 1;
                ratios.push(m.median_ms.unwrap() / f.median_ms.unwrap());
                lengths.insert(f.int("seq_len").unwrap());
                compared.push(f.case.clone());
            }
            _ => left_out += 1,
        }
    }
    assert!(both > 1 && left_out > 0, "{both} {left_out}");
    let lo = ratios.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = ratios.iter().copied().fold(0.0, f64::max);
    // math's time over flash's (the default is the reference), with the words.
    let range = if format::ratio(lo) == format::ratio(hi) {
        format::ratio(lo)
    } else {
        format!("{} to {}", format::ratio(lo), format::ratio(hi))
    };
    let words = format::time_ratio_words(lo, hi, "flash");
    // The cases compared are named by the lengths they hold, not by the clause.
    let lengths: Vec<i64> = lengths.into_iter().collect();
    let named = match lengths.as_slice() {
        [one] => format!("seq_len = {one}"),
        [a, b] => format!("seq_len {a} or {b}"),
        [a, b, c] => format!("seq_len {a}, {b} or {c}"),
        [a, .., z] => format!("seq_len {a} to {z}"),
        [] => unreachable!(),
    };
    // The count, with what the cases vary in beyond the filter (head_dim, causal, ...) when
    // they do, then the ratios.
    assert_eq!(got.len(), 1);
    let head =
        format!("flash is faster than math in every measured case with {named} ({both} cases");
    assert!(got[0].starts_with(&head), "{got:?}");
    let rest = &got[0][head.len()..];
    // What else the compared cases vary in (every parameter but seq_len, the filter's).
    let varying: Vec<&String> = compared[0]
        .keys()
        .filter(|k| *k != "seq_len" && compared.iter().any(|c| c.get(*k) != compared[0].get(*k)))
        .collect();
    if varying.is_empty() {
        assert!(rest.starts_with("; "), "{rest}");
    } else {
        assert!(rest.starts_with(" across "), "{rest}");
        for k in &varying {
            assert!(rest.contains(k.as_str()), "{k} in {rest}");
        }
    }
    assert!(
        rest.ends_with(&format!(
            "{range} ({words}); {left_out} cases where either did not run are left out)"
        )),
        "{rest}"
    );
}

#[test]
fn a_contradicted_claim_names_file_sentence_and_rows() {
    let docs = fixture_docs();
    let src = "Intro line.\n\nAt every size {{ claim(suite=\"attention\", faster=\"torch_cudnn\", than=\"flash\", where=\"causal = false\") }}.\n";
    let err = failure(&docs, src);
    assert_eq!(err.problems.len(), 1, "{err}");
    let p = &err.problems[0];
    assert_eq!(p.file, "p.md");
    assert_eq!(p.line, Some(3));
    assert!(
        p.call
            .starts_with("claim(suite=\"attention\", faster=\"torch_cudnn\""),
        "{}",
        p.call
    );
    let text = err.to_string();
    assert!(
        text.contains(
            "\"torch_cudnn is faster than flash in every measured case with causal = false\""
        ),
        "{text}"
    );
    // Every contradicting pair is listed with both medians; the others are not.
    let mut contradicting = 0;
    for c in rows(&docs)
        .into_iter()
        .filter(|r| r.implementation == "torch_cudnn" && r.flag("causal") == Some(false))
    {
        let Some(f) = rows(&docs)
            .into_iter()
            .find(|r| r.implementation == "flash" && r.case == c.case)
        else {
            continue;
        };
        let (Some(cm), Some(fm)) = (c.median_ms, f.median_ms) else {
            continue;
        };
        let line = format!(
            "{}: torch_cudnn median_ms {}, flash median_ms {}",
            case_label(&c.case),
            format::ms(cm),
            format::ms(fm)
        );
        if cm < fm {
            assert!(
                !text.contains(&line),
                "listed a case that agrees: {line}\n{text}"
            );
        } else {
            contradicting += 1;
            assert!(text.contains(&line), "missing {line}\n{text}");
        }
    }
    assert!(contradicting > 0);
    assert!(
        text.contains(&format!("does not hold in {contradicting} of ")),
        "{text}"
    );
}

#[test]
fn a_claim_covering_no_case_fails() {
    let docs = fixture_docs();
    let err = failure(
        &docs,
        r#"{{ claim(suite="attention", faster="flash", than="math", where="seq_len > 1000000") }}"#,
    );
    let text = err.to_string();
    assert!(text.contains("p.md:1:"), "{text}");
    assert!(text.contains("supported by no measured case"), "{text}");
    assert!(text.contains("0 matching cases"), "{text}");
    assert!(text.contains("seq_len > 1000000"), "{text}");
}

#[test]
fn queries_matching_no_row_or_several_fail_and_every_problem_is_listed() {
    let docs = fixture_docs();
    let src = r#"{{ value(suite="attention", implementation="flash", case="head_dim=128", field="tflops") }}
{{ value(suite="attention", implementation="flash", case="head_dim=96, seq_len=512, causal=false", field="tflops") }}
{{ value(suite="attention", implementation="flsh", case="head_dim=128", field="tflops") }}
{{ claim(suite="attention", faster="flash", than="math", where="seq_len >> 3") }}
{{ value(suite="attention", implementation="math", case="head_dim=128, seq_len=4096, causal=false", field="median_ms") }}
"#;
    let err = failure(&docs, src);
    let text = err.to_string();
    let lines: Vec<Option<usize>> = err.problems.iter().map(|p| p.line).collect();
    assert_eq!(
        lines,
        [Some(1), Some(2), Some(3), Some(4), Some(5)],
        "{text}"
    );
    let flash_128 = rows(&docs)
        .iter()
        .filter(|r| r.implementation == "flash" && r.int("head_dim") == Some(128))
        .count();
    assert!(
        text.contains(&format!("matches {flash_128} rows of flash, not one")),
        "{text}"
    );
    assert!(text.contains("matches no row"), "{text}");
    assert!(text.contains("no row of implementation `flsh`"), "{text}");
    assert!(text.contains("`seq_len >> 3`"), "{text}");
    // math at head_dim 128, seq_len 4096, non-causal is an oom row in the fixture.
    assert!(text.contains("has status oom"), "{text}");
}

#[test]
fn an_unknown_argument_is_refused() {
    let docs = fixture_docs();
    let err = failure(
        &docs,
        r#"{{ claim(suite="attention", faster="flash", than="math", were="seq_len > 1") }}"#,
    );
    assert!(err.to_string().contains("unknown argument `were`"), "{err}");
}

/// `kind` picks the run kind prose reads: the grid by default, `decode` for decoding
/// documents; the grid's rows are then not read, and an unknown kind is an error.
#[test]
fn kind_picks_the_decoding_documents() {
    let grid = fixture_docs();
    let mut decode = fixture_docs();
    for l in decode.iter_mut() {
        l.doc.config.kind = kernelpages::schema::RunKind::Decode;
    }
    let r = row(&grid, "flash", 128, false, 2048);
    let src = r#"- {{ value(suite="attention", kind="decode", implementation="flash", case="head_dim = 128, causal = false, seq_len = 2048", field="median_ms") }}"#;
    assert_eq!(
        items(&decode, src),
        [format::ms(r.median_ms.unwrap())],
        "decode documents read with kind=decode"
    );
    let err = failure(&grid, src);
    assert!(
        err.to_string().contains("no document of suite attention"),
        "grid documents are not read with kind=decode: {err}"
    );
    let plain = src.replace(r#"kind="decode", "#, "");
    assert!(
        failure(&decode, &plain)
            .to_string()
            .contains("no document of suite attention"),
        "decode documents are not read without kind"
    );
    let bad = src.replace(r#"kind="decode""#, r#"kind="sweep""#);
    assert!(failure(&grid, &bad)
        .to_string()
        .contains("unknown kind `sweep`"));
}

fn copy_fixture_as(device: &str, dir: &Path) {
    let src =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/valid/gpu_attention.json");
    let text = fs::read_to_string(src).unwrap();
    let text = text.replace("Synthetic Test GPU (fixture)", device);
    fs::create_dir_all(dir).unwrap();
    fs::write(dir.join("gpu_attention.json"), text).unwrap();
}

#[test]
fn the_site_prose_is_checked_when_the_site_is_built() {
    // The site's prose speaks of the H200; the synthetic fixture, relabelled as one,
    // contradicts its claims, so the build fails naming the file, the claim and the rows.
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    copy_fixture_as("NVIDIA H200", &data);
    let opts = BuildOptions {
        data_dir: data,
        out_dir: tmp.path().join("site"),
        base_url: None,
        templates_dir: None,
    };
    let err = site::build(&opts).unwrap_err();
    let text = format!("{err:#}");
    assert!(
        text.contains(kernelpages::site::templates::ATTENTION_PROSE),
        "{text}"
    );
    assert!(
        text.contains("torch_cudnn is faster than flash in every measured case"),
        "{text}"
    );
    assert!(text.contains("head_dim=64"), "{text}");
    assert!(!opts.out_dir.exists());
}

#[test]
fn the_committed_data_builds_with_its_prose() {
    // Reads data/ (never writes it) and builds into a temporary folder.
    let data = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data");
    let docs = load::load_dir(&data).unwrap();
    let site_prose =
        prose::render_site_prose(&docs, &kernelpages::site::templates::Sources::built_in())
            .unwrap_or_else(|e| panic!("{e}"));
    let attention = site_prose.attention.expect("attention prose");
    let text: String = Html::parse_fragment(&attention)
        .root_element()
        .text()
        .collect();
    assert!(
        text.contains("flash is faster than math in every measured case"),
        "{text}"
    );
    assert!(site_prose.limitations.is_some());
}

/// The fixture's card is not among the cards the curated prose lists: its sentences are left
/// out, and the attention prose is the one that says why (the card, the cards it is written
/// for); the other pages have none (the fixture has no GPU documents of their suites).
#[test]
fn prose_about_another_device_is_left_out() {
    let docs = fixture_docs();
    let site_prose =
        prose::render_site_prose(&docs, &kernelpages::site::templates::Sources::built_in())
            .unwrap();
    let attention = site_prose.attention.expect("the note on the card");
    assert!(
        attention.contains("measured on the Synthetic Test GPU (fixture)")
            && attention.contains("written for the NVIDIA H200 and NVIDIA H100 80GB HBM3"),
        "{attention}"
    );
    assert!(
        !attention.contains("Where flash stands") && !attention.contains("faster than"),
        "curated sentences on an unlisted card: {attention}"
    );
    assert_eq!(site_prose.mixers, None);
    assert_eq!(site_prose.limitations, None);
}

/// `prose/prelude.md` is put before every other prose file: what it sets (the built-in one sets
/// `cards`) each of them sees, it renders nothing itself, a call's line stays the line in its
/// own file, the prelude's own problems are reported once under its name, and a file that does
/// not parse says the prelude's lines come first.
#[test]
fn the_prelude_is_shared_by_every_prose_file() {
    use kernelpages::site::templates::{
        Sources, ATTENTION_PROSE, LIMITATIONS_PROSE, MIXERS_PROSE, PROSE_PRELUDE,
    };
    let docs = fixture_docs();
    let built_in = Sources::built_in();
    assert!(built_in
        .prose_source(PROSE_PRELUDE)
        .unwrap()
        .contains("{% set cards = "));
    for name in [ATTENTION_PROSE, MIXERS_PROSE, LIMITATIONS_PROSE] {
        assert!(
            !built_in.prose_source(name).unwrap().contains("set cards"),
            "{name} sets its own cards"
        );
    }
    let with = |prelude: &str, body: &str| {
        let mut s = Sources::built_in();
        for (name, src) in s.prose.iter_mut() {
            *src = if *name == PROSE_PRELUDE {
                prelude.to_string()
            } else {
                format!("{body} in {name}\n")
            };
        }
        s
    };
    let shared = prose::render_site_prose(
        &docs,
        &with("{% set shared = \"from the prelude\" -%}\n", "{{ shared }}"),
    )
    .unwrap();
    for (name, html) in [
        (ATTENTION_PROSE, shared.attention),
        (MIXERS_PROSE, shared.mixers),
        (LIMITATIONS_PROSE, shared.limitations),
    ] {
        let html = html.unwrap_or_else(|| panic!("{name} rendered nothing"));
        assert!(
            html.contains(&format!("from the prelude in {name}")),
            "{name}: {html}"
        );
    }
    // A failed call on line 2 of a file is reported at line 2, after a 3-line prelude.
    let err = prose::render_site_prose(
        &docs,
        &with(
            "{#- one -#}\n{#- two -#}\n{% set x = 1 -%}\n",
            "text\n{{ value(suite=\"attention\", implementation=\"nope\", case=\"head_dim = 64\", field=\"tflops\") }}",
        ),
    )
    .unwrap_err();
    assert!(err.problems.iter().all(|p| p.line == Some(2)), "{err}");
    // The prelude's own problems: once, under its name, with the call's line in it.
    let err = prose::render_site_prose(
        &docs,
        &with(
            "{#- one -#}\n{% set v = value(suite=\"attention\", implementation=\"nope\", case=\"head_dim = 64\", field=\"tflops\") -%}",
            "text",
        ),
    )
    .unwrap_err();
    assert_eq!(err.problems.len(), 1, "{err}");
    assert!(
        err.problems[0].file.ends_with(PROSE_PRELUDE) && err.problems[0].line == Some(2),
        "{err}"
    );
    let err = prose::render_site_prose(&docs, &with("{% if %}", "text")).unwrap_err();
    assert_eq!(err.problems.len(), 1, "{err}");
    assert!(err.problems[0].file.ends_with(PROSE_PRELUDE), "{err}");
    let err = prose::render_site_prose(&docs, &with("{% set x = 1 -%}\n", "{% if %}")).unwrap_err();
    assert!(
        err.problems
            .iter()
            .all(|p| p.message.contains("the 1 line of prose/prelude.md")),
        "{err}"
    );
}

/// `build`, `check` and `serve` read the templates folder: prose edited on disk must be what
/// the next build renders, not the copy compiled into the binary.
#[test]
fn prose_is_read_from_the_templates_folder() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("prose")).unwrap();
    std::fs::write(
        dir.path().join("prose/attention.md"),
        "Edited on disk: {{ 1 + 1 }}\n",
    )
    .unwrap();
    let sources = kernelpages::site::templates::Sources::from_dir(dir.path()).unwrap();
    let src = sources
        .prose_source(kernelpages::site::templates::ATTENTION_PROSE)
        .unwrap();
    assert!(src.starts_with("Edited on disk"), "{src}");
    // Files absent from the folder keep the embedded source.
    let lim = sources
        .prose_source(kernelpages::site::templates::LIMITATIONS_PROSE)
        .unwrap();
    assert!(lim.contains("measured("), "{lim}");
}

/// "Faster" needs the faster side's q3 below the other's q1: a case inside the noise counts
/// for neither side and the claim says so; a claim only the noise covers fails.
#[test]
fn a_claim_within_the_noise_says_so() {
    let mut docs = fixture_docs();
    let claim = r#"- {{ claim(suite="attention", faster="flash", than="math", where="head_dim = 64, causal = false") }}"#;
    let before = items(&docs, claim);
    assert!(before[0].contains("in every measured case"), "{before:?}");
    // Widen flash's spread at one size until it overlaps math's.
    let (at, math_q1) = {
        let r = rows(&docs)
            .into_iter()
            .find(|r| {
                r.implementation == "math"
                    && r.status == Status::Ok
                    && r.int("head_dim") == Some(64)
                    && r.flag("causal") == Some(false)
            })
            .unwrap();
        (r.case.clone(), r.q1_ms.unwrap())
    };
    for r in &mut docs[0].doc.rows {
        if r.implementation == "flash" && r.case == at {
            r.q3_ms = Some(math_q1 * 1.01);
        }
    }
    let after = items(&docs, claim);
    let n: usize = before[0]
        .split(" (")
        .nth(1)
        .and_then(|t| t.split(' ').next())
        .and_then(|t| t.parse().ok())
        .unwrap();
    assert!(
        after[0].contains(&format!("in {} of {n} measured cases", n - 1)),
        "{after:?}"
    );
    assert!(after[0].contains("within noise in 1"), "{after:?}");
}

/// The fixture's attention document relabelled as measured on the CPU `name`.
fn as_cpu(doc: &Loaded, name: &str) -> Loaded {
    let mut l = doc.clone();
    l.doc.device.kind = kernelpages::schema::DeviceKind::Cpu;
    l.doc.device.name = name.into();
    l
}

#[test]
fn cpu_device_names_the_cpu_the_documents_were_measured_on() {
    let docs = fixture_docs();
    let src = r#"
- [{{ cpu_device(suite="attention") }}]
- {{ measured(suite="attention", device=cpu_device(suite="attention")) }}
"#;
    // Only GPU documents: an empty name, on which nothing is measured.
    assert_eq!(items(&docs, src), ["[]", "false"]);
    let mut with_cpu = docs.clone();
    with_cpu.push(as_cpu(&docs[0], "Test CPU"));
    assert_eq!(items(&with_cpu, src), ["[Test CPU]", "true"]);
    // CPU documents of one suite from two CPUs: the prose cannot tell which to quote.
    with_cpu.push(as_cpu(&docs[0], "Other CPU"));
    let text = failure(&with_cpu, src).to_string();
    assert!(text.contains("several CPUs: Other CPU, Test CPU"), "{text}");
    assert!(failure(&docs, r#"{{ cpu_device(suite="x") }}"#)
        .to_string()
        .contains("unknown suite `x`"));
}

/// The fixture's GPU attention document.
fn gpu_attention(docs: &[Loaded]) -> &Loaded {
    docs.iter()
        .find(|l| {
            l.doc.suite.as_str() == "attention"
                && l.doc.device.kind == kernelpages::schema::DeviceKind::Gpu
        })
        .expect("the fixture has a GPU attention document")
}

/// `gpu_device` names the card the suite's GPU documents were measured on (prose about them
/// follows a rerun on another card), is empty without GPU documents, and is an error when two
/// cards' documents of one suite are in the data.
#[test]
fn gpu_device_names_the_card_the_documents_were_measured_on() {
    let docs = fixture_docs();
    let card = gpu_attention(&docs).doc.device.name.clone();
    let src = r#"
- [{{ gpu_device(suite="attention") }}]
- {{ measured(suite="attention", device=gpu_device(suite="attention")) }}
"#;
    assert_eq!(items(&docs, src), [format!("[{card}]"), "true".into()]);
    // Among the cards the prose names: the card when listed, else empty.
    let among = format!(
        r#"- [{{{{ gpu_device(suite="attention", among="Other GPU; {card}") }}}}]
- [{{{{ gpu_device(suite="attention", among="Other GPU; Third GPU") }}}}]"#
    );
    assert_eq!(items(&docs, &among), [format!("[{card}]"), "[]".into()]);
    // Only CPU documents: an empty name, on which nothing is measured.
    let cpu_only: Vec<Loaded> = docs.iter().map(|l| as_cpu(l, "Test CPU")).collect();
    assert_eq!(items(&cpu_only, src), ["[]", "false"]);
    // A second card's document of the same suite: the prose cannot tell which to quote.
    let mut two = docs.clone();
    let mut other = docs[0].clone();
    other.doc.device.name = "Other GPU".into();
    two.push(other);
    let text = failure(&two, src).to_string();
    assert!(text.contains("several GPUs: "), "{text}");
    assert!(text.contains("Other GPU"), "{text}");
    // With `among`, the first listed card that has documents.
    let prefer = |among: &str| {
        items(
            &two,
            &format!(r#"- [{{{{ gpu_device(suite="attention", among="{among}") }}}}]"#),
        )
    };
    assert_eq!(prefer(&format!("Other GPU; {card}")), ["[Other GPU]"]);
    assert_eq!(prefer(&format!("{card}; Other GPU")), [format!("[{card}]")]);
    assert_eq!(prefer("Third GPU"), ["[]"]);
}

/// `gpu_cards` lists every card a suite has GPU documents on, sorted (empty without any), and
/// `commits` the commits of the documents a device picks: what the attention prose says when
/// its tables show several cards.
#[test]
fn gpu_cards_and_commits_name_every_card_and_its_commit() {
    let docs = fixture_docs();
    let card = gpu_attention(&docs).clone();
    let src = format!(
        r#"- [{{{{ gpu_cards(suite="attention") }}}}]
- [{{{{ commits(suite="attention", device="{}") }}}}]
- [{{{{ commits(suite="attention", device="A second card") }}}}]"#,
        card.doc.device.name
    );
    let mut two = docs.clone();
    let mut other = card.clone();
    other.doc.device.name = "A second card".into();
    other.doc.config.git_commit = "0123456789abcdef".into();
    two.push(other);
    let short: String = card.doc.config.git_commit.chars().take(7).collect();
    assert_eq!(
        items(&two, &src),
        [
            format!("[A second card, {}]", card.doc.device.name),
            format!("[{short}]"),
            "[0123456]".to_string(),
        ]
    );
    let cpu_only: Vec<Loaded> = docs.iter().map(|l| as_cpu(l, "Test CPU")).collect();
    assert_eq!(
        items(&cpu_only, r#"- [{{ gpu_cards(suite="attention") }}]"#),
        ["[]"]
    );
}

/// `failed` is true exactly when a row that did not run (of the implementation, kept by the
/// where-clause) has the status and a message with the text: false on the fixture, true once
/// one flash row becomes an `error` with that message, and still false for another
/// implementation, another text or status, a where-clause that leaves the row out, or an `ok`
/// row whose message has the text; with `every=true` only once every flash row is one.
#[test]
fn failed_finds_the_rows_that_did_not_run_with_a_message() {
    let mut docs = fixture_docs();
    let probe = r#"- {{ failed(suite="attention", implementation="flash", text="code generation") }}
- {{ failed(suite="attention", implementation="math", text="code generation") }}
- {{ failed(suite="attention", implementation="flash", text="out of memory") }}
- {{ failed(suite="attention", implementation="flash", text="code generation", where="head_dim = 64") }}
- {{ failed(suite="attention", text="code generation") }}"#;
    assert_eq!(
        items(&docs, probe),
        ["false", "false", "false", "false", "false"]
    );
    let (doc, index) = docs
        .iter()
        .enumerate()
        .find_map(|(d, l)| {
            l.doc
                .rows
                .iter()
                .position(|r| {
                    r.implementation == "flash"
                        && r.status == Status::Ok
                        && r.int("head_dim") != Some(64)
                })
                .map(|i| (d, i))
        })
        .expect("an ok flash row not at head_dim 64");
    // An ok row's message is not a failure.
    docs[doc].doc.rows[index].message = Some("crashed at code generation".into());
    assert_eq!(
        items(&docs, probe),
        ["false", "false", "false", "false", "false"]
    );
    docs[doc].doc.rows[index].status = Status::Error;
    assert_eq!(
        items(&docs, probe),
        ["true", "false", "false", "false", "true"]
    );
    assert!(
        failure(
            &docs,
            r#"{{ failed(suite="attention", implementation="flash") }}"#
        )
        .to_string()
        .contains("`text` or `status`"),
        "`text` or `status` is required"
    );
    // By status, and whether every row kept is a failure.
    let by_status = r#"- {{ failed(suite="attention", implementation="flash", status="error") }}
- {{ failed(suite="attention", implementation="flash", status="oom") }}
- {{ failed(suite="attention", implementation="flash", status="error", every=true) }}
- {{ failed(suite="attention", implementation="math", status="error", every=true) }}"#;
    assert_eq!(items(&docs, by_status), ["true", "false", "false", "false"]);
    let mut all = docs.clone();
    for l in &mut all {
        for r in l
            .doc
            .rows
            .iter_mut()
            .filter(|r| r.implementation == "flash")
        {
            r.status = Status::Error;
            r.message = Some("crashed at code generation".into());
        }
    }
    assert_eq!(items(&all, by_status), ["true", "false", "true", "false"]);
    assert!(
        failure(&docs, r#"{{ failed(suite="attention", status="broken") }}"#)
            .to_string()
            .contains("unknown status `broken`")
    );
}

/// `over_tolerance` is true exactly when a row that ran (of the implementation, kept by the
/// where-clause) has an error above its tolerance: false on the fixture, true once one row's
/// error is raised past it, and still false for another implementation or a where-clause that
/// leaves that row out.
#[test]
fn over_tolerance_finds_the_flagged_rows() {
    let mut docs = fixture_docs();
    let probe = r#"- {{ over_tolerance(suite="attention", implementation="flash") }}
- {{ over_tolerance(suite="attention", implementation="flash", where="head_dim = 64") }}
- {{ over_tolerance(suite="attention", implementation="math") }}"#;
    assert_eq!(items(&docs, probe), ["false", "false", "false"]);
    let raised = docs[0]
        .doc
        .rows
        .iter_mut()
        .find(|r| {
            r.implementation == "flash"
                && r.status == Status::Ok
                && r.accuracy.is_some()
                && r.int("head_dim") != Some(64)
        })
        .expect("an ok flash row with an accuracy, not at head_dim 64");
    let acc = raised.accuracy.as_mut().unwrap();
    acc.rel_err = acc.tolerance * 2.0;
    assert_eq!(items(&docs, probe), ["true", "false", "false"]);
}

/// `dispatch_dtypes` quotes the dtypes of the fixture's rule, joined with "and", and is an
/// error for a device class no rule has.
#[test]
fn dispatch_dtypes_quotes_the_rule() {
    let docs = fixture_docs();
    let d = docs
        .iter()
        .filter(|l| l.doc.suite.as_str() == "attention")
        .flat_map(|l| l.doc.config.dispatch.iter())
        .next()
        .expect("the fixture's attention document has a dispatch rule")
        .clone();
    let probe = format!(
        r#"- {{{{ dispatch_dtypes(suite="attention", implementation="{imp}", on="{on}") }}}}"#,
        imp = d.implementation,
        on = d.device
    );
    let parts: Vec<&str> = d.dtype.split(',').map(str::trim).collect();
    let want = match parts.as_slice() {
        [one] => one.to_string(),
        [init @ .., last] => format!("{} and {last}", init.join(", ")),
        [] => unreachable!("split gives one part at least"),
    };
    assert_eq!(items(&docs, &probe), [want]);
    // Two documents whose rules for the class disagree are an error.
    let mut two = fixture_docs();
    let mut other = two
        .iter()
        .find(|l| l.doc.suite.as_str() == "attention")
        .expect("an attention document")
        .clone();
    for r in other.doc.config.dispatch.iter_mut() {
        r.dtype = "fp8".into();
    }
    two.push(other);
    assert!(failure(&two, &probe).to_string().contains("disagree"));
    // A class "other than" the one asked for does not match it.
    let mut excluded = fixture_docs();
    for l in excluded.iter_mut() {
        for r in l.doc.config.dispatch.iter_mut() {
            r.device = format!("any device other than {}", d.device);
        }
    }
    assert!(failure(&excluded, &probe)
        .to_string()
        .contains("no dispatch rule"));
    assert!(failure(
        &docs,
        &format!(
            r#"{{{{ dispatch_dtypes(suite="attention", implementation="{}", on="no such class") }}}}"#,
            d.implementation
        )
    )
    .to_string()
    .contains("no dispatch rule"));
}

/// `dispatch_says` reads the documents' dispatch records: true for words of a rule of that
/// implementation, false for words no rule has, for another implementation's rule, and for a
/// device with no document; a missing argument is an error.
#[test]
fn dispatch_says_reads_the_dispatch_record() {
    let docs = fixture_docs();
    let d = docs
        .iter()
        .filter(|l| l.doc.suite.as_str() == "attention")
        .flat_map(|l| l.doc.config.dispatch.iter())
        .next()
        .expect("the fixture's attention document has a dispatch rule")
        .clone();
    let word = d.rule.split_whitespace().next().expect("a rule has words");
    let probe = format!(
        r#"- {{{{ dispatch_says(suite="attention", implementation="{imp}", text="{word}") }}}}
- {{{{ dispatch_says(suite="attention", implementation="{imp}", text="no rule says this") }}}}
- {{{{ dispatch_says(suite="attention", implementation="not_{imp}", text="{word}") }}}}
- {{{{ dispatch_says(suite="attention", device="no such device", implementation="{imp}", text="{word}") }}}}"#,
        imp = d.implementation
    );
    assert_eq!(items(&docs, &probe), ["true", "false", "false", "false"]);
    assert!(failure(
        &docs,
        r#"{{ dispatch_says(suite="attention", implementation="flash") }}"#
    )
    .to_string()
    .contains("missing argument `text`"));
}
