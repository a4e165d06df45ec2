//! `docgen serve` on loopback: the built site is served, links resolve with and without a base
//! URL, a data or template change rebuilds, a failed rebuild keeps the last good site, no path
//! escapes the site folder, served pages carry the live-reload script (the files on disk do
//! not), the live-reload stream announces each successful rebuild, and a port in use is named
//! with `--port`. Every wait is bounded (20 s).

use std::fs;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
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

/// Every file under `dir`.
fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(files_under(&p));
        } else {
            out.push(p);
        }
    }
    out
}

/// A client of the live-reload stream (server-sent events over HTTP/1.0, so the body is the
/// bare event stream).
struct Events {
    stream: TcpStream,
    buf: String,
}

impl Events {
    /// Connects and waits for the `hello` event, after which every rebuild is announced.
    fn connect(addr: SocketAddr) -> Events {
        let mut stream = TcpStream::connect(addr).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        write!(
            stream,
            "GET /__livereload HTTP/1.0\r\nHost: localhost\r\nAccept: text/event-stream\r\n\r\n"
        )
        .unwrap();
        let mut ev = Events {
            stream,
            buf: String::new(),
        };
        let (code, head) = ev.head();
        assert_eq!(code, 200, "{head}");
        assert!(head.contains("text/event-stream"), "{head}");
        assert_eq!(ev.next_event().0, "hello");
        ev
    }

    fn fill(&mut self) {
        let mut chunk = [0u8; 4096];
        let n = self.stream.read(&mut chunk).expect("no event within 20 s");
        assert!(n > 0, "the event stream closed");
        self.buf.push_str(&String::from_utf8_lossy(&chunk[..n]));
    }

    fn head(&mut self) -> (u16, String) {
        loop {
            if let Some(i) = self.buf.find("\r\n\r\n") {
                let head = self.buf[..i].to_string();
                self.buf.drain(..i + 4);
                let code = head.split_whitespace().nth(1).unwrap().parse().unwrap();
                return (code, head);
            }
            self.fill();
        }
    }

    /// The next event's name and data; keep-alive comments are skipped.
    fn next_event(&mut self) -> (String, String) {
        loop {
            if let Some(i) = self.buf.find("\n\n") {
                let block: String = self.buf.drain(..i + 2).collect();
                let (mut name, mut data) = (String::new(), String::new());
                for line in block.lines() {
                    if let Some(v) = line.strip_prefix("event:") {
                        name = v.trim().to_string();
                    } else if let Some(v) = line.strip_prefix("data:") {
                        data = v.trim().to_string();
                    }
                }
                if !name.is_empty() {
                    return (name, data);
                }
                continue;
            }
            self.fill();
        }
    }
}

struct Setup {
    tmp: tempfile::TempDir,
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
        tmp,
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
            templates_dir: Some(s.templates.clone()),
        },
        port: 0,
        watch: vec![s.data.clone(), s.templates.clone()],
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

    // Served pages get the live-reload script; the files on disk never do.
    assert!(index.contains("data-docgen-livereload"));
    assert!(index.contains("/__livereload"));
    assert!(!String::from_utf8_lossy(&svg).contains("__livereload"));
    let on_disk = files_under(&s.out);
    assert!(on_disk.len() > 10);
    for f in &on_disk {
        let bytes = fs::read(f).unwrap();
        assert!(
            !String::from_utf8_lossy(&bytes).contains("__livereload"),
            "{} has the live-reload script",
            f.display()
        );
    }
    let from_disk = fs::read_to_string(s.out.join("index.html")).unwrap();
    assert_eq!(
        index.replace(
            &index[index.find("<script data-docgen-livereload>").unwrap()
                ..index.find("</script>\n</body>").unwrap() + "</script>\n".len()],
            ""
        ),
        from_disk,
        "the served page is the file plus the script"
    );

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
    assert!(index.contains("data-docgen-livereload"));
    server.stop();
}

#[test]
fn no_path_escapes_the_site_folder() {
    let s = setup();
    // A file beside the site folder: what a traversal would reach.
    fs::write(s.tmp.path().join("secret.txt"), "secret-6120").unwrap();
    for base_url in [None, Some("/perf/")] {
        let server = start(&s, base_url);
        let addr = server.addr();
        let m = if base_url.is_some() { "/perf" } else { "" };
        assert_eq!(get(addr, &format!("{m}/index.html")).0, 200);
        for evil in [
            "/../secret.txt",
            "/%2e%2e/secret.txt",
            "/%2E%2E/secret.txt",
            "/..%2fsecret.txt",
            "/%2e%2e%2fsecret.txt",
            "/figures/../../secret.txt",
            "/figures/%2e%2e/%2e%2e/secret.txt",
            "/figures/..%2f..%2fsecret.txt",
            "/%2fsecret.txt",
            "//secret.txt",
            "/..\\secret.txt",
            "/%5c..%5csecret.txt",
        ] {
            for path in [format!("{m}{evil}"), evil.to_string()] {
                let (code, body) = get(addr, &path);
                assert_ne!(code, 200, "{base_url:?}: GET {path}");
                assert!(
                    !String::from_utf8_lossy(&body).contains("secret-6120"),
                    "{base_url:?}: GET {path}"
                );
            }
        }
        server.stop();
    }
}

#[test]
fn the_live_reload_stream_announces_each_successful_rebuild() {
    let s = setup();
    let server = start(&s, None);
    let addr = server.addr();
    let mut events = Events::connect(addr);

    // A data change: one or more rebuilds (the watcher may split a burst), each announced with
    // its build number, and the new page is served once the reload is announced.
    let mut doc: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(s.data.join("gpu_attention.json")).unwrap())
            .unwrap();
    doc["device"]["name"] = serde_json::Value::from("Reload Test GPU");
    put(
        &s.data.join("gpu_attention.gpu2.json"),
        serde_json::to_string(&doc).unwrap(),
    );
    let mut seen = Vec::new();
    let (name, data) = events.next_event();
    assert_eq!(name, "reload");
    seen.push(data.parse::<u64>().unwrap());
    assert!(get_text(addr, "/attention.html").contains("Reload Test GPU"));

    // A failed rebuild announces nothing; the next good one does.
    put(&s.data.join("broken.json"), "{ not json");
    wait_for("failed rebuild", || {
        server.counts().failed.load(Ordering::SeqCst) >= 1
    });
    let ok_before_fix = server.counts().ok.load(Ordering::SeqCst);
    fs::remove_file(s.data.join("broken.json")).unwrap();
    wait_for("rebuild after the fix", || {
        server.counts().ok.load(Ordering::SeqCst) > ok_before_fix
    });
    let ok = server.counts().ok.load(Ordering::SeqCst);
    while *seen.last().unwrap() < ok {
        let (name, data) = events.next_event();
        assert_eq!(name, "reload");
        seen.push(data.parse().unwrap());
    }
    // One reload per successful build after the first, in order: none for the failed one.
    assert_eq!(seen, (2..=ok).collect::<Vec<_>>());

    // A build opens every file it reads; reads are not changes, so nothing more is built.
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(server.counts().ok.load(Ordering::SeqCst), ok);
    server.stop();
}

#[test]
fn a_port_in_use_is_named_with_the_port_option() {
    let s = setup();
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let err = Server::start(ServeOptions {
        build: BuildOptions {
            data_dir: s.data.clone(),
            out_dir: s.out.clone(),
            base_url: None,
            templates_dir: None,
        },
        port,
        watch: vec![s.data.clone()],
        debounce: Duration::from_millis(100),
    })
    .err()
    .expect("a second server on a port in use");
    let msg = format!("{err:#}");
    assert!(
        msg.contains(&format!("127.0.0.1:{port} is in use")) && msg.contains("--port"),
        "{msg}"
    );

    // The same through the command line, which exits 1 with that message.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_docgen"))
        .args(["serve", "--port", &port.to_string(), "--data"])
        .arg(&s.data)
        .arg("--out")
        .arg(&s.out)
        .arg("--templates")
        .arg(&s.templates)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "127.0.0.1:{port} is in use; pick another with --port"
        )),
        "{stderr}"
    );
    drop(taken);
}

#[test]
fn without_base_url_every_link_is_relative() {
    // Relative links are what make the site work from file://.
    let s = setup();
    kernelpages::site::build(&BuildOptions {
        data_dir: s.data.clone(),
        out_dir: s.out.clone(),
        base_url: None,
        templates_dir: None,
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
