//! `docgen serve` on loopback: the built site is served, links resolve with and without a base
//! URL, a data or template change rebuilds, and a failed rebuild keeps the last good site.
//! Every wait is bounded (20 s).

use std::fs;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kernelpages::site::serve::{ServeOptions, Server};
use kernelpages::site::BuildOptions;
use scraper::{Html, Selector};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// One GET; returns the status code and the body.
fn get(addr: SocketAddr, path: &str) -> (u16, Vec<u8>) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).unwrap();
    let split = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("no end of head");
    let head = String::from_utf8_lossy(&buf[..split]).into_owned();
    let code = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    (code, buf[split + 4..].to_vec())
}

fn get_text(addr: SocketAddr, path: &str) -> String {
    let (code, body) = get(addr, path);
    assert_eq!(code, 200, "GET {path}");
    String::from_utf8(body).unwrap()
}

/// Waits until `done` holds, at most 20 s.
fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !done() {
        assert!(t0.elapsed() < Duration::from_secs(20), "timed out: {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Writes `bytes` to `path` in one step (a write beside the watched folder, then a rename), so
/// a rebuild never reads a half-written file.
fn put(path: &Path, bytes: impl AsRef<[u8]>) {
    let staging = path.parent().unwrap().parent().unwrap().join("staging.tmp");
    fs::write(&staging, bytes).unwrap();
    fs::rename(&staging, path).unwrap();
}

struct Setup {
    _tmp: tempfile::TempDir,
    data: PathBuf,
    templates: PathBuf,
    out: PathBuf,
}

fn setup() -> Setup {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let templates = tmp.path().join("templates");
    fs::create_dir_all(&data).unwrap();
    fs::create_dir_all(&templates).unwrap();
    fs::copy(
        root().join("tests/fixtures/valid/gpu_attention.json"),
        data.join("gpu_attention.json"),
    )
    .unwrap();
    fs::copy(
        root().join("templates/base.html"),
        templates.join("base.html"),
    )
    .unwrap();
    let out = tmp.path().join("site");
    Setup {
        _tmp: tmp,
        data,
        templates,
        out,
    }
}

fn start(s: &Setup, base_url: Option<&str>) -> Server {
    Server::start(ServeOptions {
        build: BuildOptions {
            data_dir: s.data.clone(),
            out_dir: s.out.clone(),
            base_url: base_url.map(String::from),
        },
        port: 0,
        watch: vec![s.data.clone(), s.templates.clone()],
        templates_dir: Some(s.templates.clone()),
        debounce: Duration::from_millis(100),
    })
    .unwrap()
}

/// Every `href`/`src` of the page at `path`, fetched through the server.
fn check_links(addr: SocketAddr, page_url: &str, html: &str) -> usize {
    let doc = Html::parse_document(html);
    let sel = Selector::parse("a[href], img[src], link[href]").unwrap();
    let dir = &page_url[..page_url.rfind('/').unwrap() + 1];
    let mut n = 0;
    for e in doc.select(&sel) {
        let target = e.value().attr("href").or(e.value().attr("src")).unwrap();
        let target = target.split('#').next().unwrap();
        if target.is_empty() || target.contains("://") {
            continue;
        }
        let url = if target.starts_with('/') {
            target.to_string()
        } else {
            format!("{dir}{target}")
        };
        let (code, _) = get(addr, &url);
        assert_eq!(code, 200, "{page_url} links to {url}");
        n += 1;
    }
    n
}

#[test]
fn serves_the_site_on_loopback_and_rebuilds_on_change() {
    let s = setup();
    let server = start(&s, None);
    let addr = server.addr();
    assert!(addr.ip().is_loopback(), "{addr}");
    let index = get_text(addr, "/");
    assert!(index.contains("At a glance"));
    assert_eq!(index, get_text(addr, "/index.html"));
    assert!(check_links(addr, "/index.html", &index) > 10);
    let (code, svg) = get(addr, "/figures/at-a-glance.svg");
    assert_eq!(code, 200);
    assert!(String::from_utf8_lossy(&svg).contains("<svg"));
    assert_eq!(get(addr, "/missing.html").0, 404);
    assert_eq!(get(addr, "/../Cargo.toml").0, 404);

    // A new shard document: rebuilt, and the page lists it.
    let mut doc: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(s.data.join("gpu_attention.json")).unwrap())
            .unwrap();
    doc["device"]["name"] = serde_json::Value::from("Second Test GPU");
    put(
        &s.data.join("gpu_attention.gpu2.json"),
        serde_json::to_string(&doc).unwrap(),
    );
    wait_for("rebuild after a data change", || {
        let (code, body) = get(addr, "/attention.html");
        code == 200 && String::from_utf8_lossy(&body).contains("Second Test GPU")
    });

    // A template change shows without recompiling.
    let base = fs::read_to_string(s.templates.join("base.html")).unwrap();
    put(
        &s.templates.join("base.html"),
        base.replace("<footer>", "<footer><p>template-marker-7431</p>"),
    );
    wait_for("rebuild after a template change", || {
        let (code, body) = get(addr, "/index.html");
        code == 200 && String::from_utf8_lossy(&body).contains("template-marker-7431")
    });

    // A broken document: the rebuild fails, the last good site stays served.
    let good = get_text(addr, "/index.html");
    let failed_before = server.counts().failed.load(Ordering::SeqCst);
    put(&s.data.join("broken.json"), "{ not json");
    wait_for("failed rebuild", || {
        server.counts().failed.load(Ordering::SeqCst) > failed_before
    });
    assert_eq!(get_text(addr, "/index.html"), good);
    server.stop();
}

#[test]
fn base_url_mounts_the_site_under_its_path() {
    let s = setup();
    let server = start(&s, Some("/perf/"));
    let addr = server.addr();
    let index = get_text(addr, "/perf/index.html");
    assert!(check_links(addr, "/perf/index.html", &index) > 10);
    let attention = get_text(addr, "/perf/attention.html");
    assert!(check_links(addr, "/perf/attention.html", &attention) > 5);
    assert_eq!(get(addr, "/index.html").0, 404);
    assert_eq!(get(addr, "/").0, 302);
    assert_eq!(get(addr, "/perf").0, 302);
    assert_eq!(get_text(addr, "/perf/"), index);
    assert_eq!(
        get(addr, "/perf/figures").0,
        307,
        "folder without its slash"
    );
    server.stop();
}

#[test]
fn without_base_url_every_link_is_relative() {
    // Relative links are what make the site work from file://.
    let s = setup();
    kernelpages::site::build(&BuildOptions {
        data_dir: s.data.clone(),
        out_dir: s.out.clone(),
        base_url: None,
    })
    .unwrap();
    let sel = Selector::parse("a[href], img[src], link[href]").unwrap();
    for name in ["index.html", "attention.html", "hopper.html"] {
        let doc = Html::parse_document(&fs::read_to_string(s.out.join(name)).unwrap());
        for e in doc.select(&sel) {
            let target = e.value().attr("href").or(e.value().attr("src")).unwrap();
            assert!(
                !target.starts_with('/') && !target.contains("://"),
                "{name}: {target}"
            );
            let file = target.split('#').next().unwrap();
            if !file.is_empty() {
                assert!(Path::new(&s.out).join(file).is_file(), "{name}: {target}");
            }
        }
    }
}
