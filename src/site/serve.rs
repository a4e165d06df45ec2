//! `docgen serve`: builds the site to disk, serves the output folder over HTTP on 127.0.0.1
//! only, and rebuilds when a file under the watched folders (`data/`, `templates/`) changes.
//!
//! As in mdBook, the server only ever reads the built folder: a rebuild writes a new site with
//! [`super::build`]'s atomic swap, and a failed rebuild leaves the last good site in place (the
//! error is printed and serving goes on). Changes are found by polling the size and
//! modification time of every file under the watched folders every [`POLL`].
//!
//! The HTTP side is deliberately small: `GET` and `HEAD` of files, `index.html` for folders,
//! the site mounted under the path of `--base-url` when one is given, `Connection: close`.

use std::collections::BTreeMap;
use std::fs;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime};

use anyhow::Context as _;

use super::BuildOptions;

/// How often the watched folders are scanned for changes.
pub const POLL: Duration = Duration::from_millis(500);

/// Longest request head read, bytes; longer requests get 431.
const MAX_HEAD: usize = 16 * 1024;

/// What `docgen serve` needs.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// Where the site is built from and to; `base_url`'s path is where it is mounted.
    pub build: BuildOptions,
    /// TCP port on 127.0.0.1; 0 picks a free one (see [`Server::addr`]).
    pub port: u16,
    /// Folders whose changes trigger a rebuild (recursively). Missing folders are skipped.
    pub watch: Vec<PathBuf>,
    /// Folder of template overrides read at each build (`templates/`), or `None` to use only
    /// the templates built into the binary.
    pub templates_dir: Option<PathBuf>,
    /// Poll interval of the watcher.
    pub poll: Duration,
}

/// Counts of builds since start, for logs and tests.
#[derive(Debug, Default)]
pub struct BuildCounts {
    /// Builds that wrote a site.
    pub ok: AtomicU64,
    /// Builds that failed (the previous site kept).
    pub failed: AtomicU64,
}

/// A running server: the listener thread and the watcher thread.
pub struct Server {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    counts: Arc<BuildCounts>,
    threads: Vec<JoinHandle<()>>,
}

impl Server {
    /// Builds once, binds 127.0.0.1:`port` and starts serving and watching in background
    /// threads.
    ///
    /// Errors: the first build fails (nothing to serve), or the port cannot be bound.
    pub fn start(opts: ServeOptions) -> anyhow::Result<Server> {
        let counts = Arc::new(BuildCounts::default());
        let n = build_once(&opts)?;
        counts.ok.fetch_add(1, Ordering::SeqCst);
        eprintln!("wrote {n} files to {}", opts.build.out_dir.display());
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, opts.port))
            .with_context(|| format!("cannot listen on 127.0.0.1:{}", opts.port))?;
        let addr = listener.local_addr().context("listener has no address")?;
        let stop = Arc::new(AtomicBool::new(false));
        let mount = mount_path(opts.build.base_url.as_deref());
        let root = opts.build.out_dir.clone();
        let serve_stop = Arc::clone(&stop);
        let server = std::thread::spawn(move || {
            for stream in listener.incoming() {
                if serve_stop.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(stream) = stream else { continue };
                let (root, mount) = (root.clone(), mount.clone());
                std::thread::spawn(move || {
                    if let Err(e) = handle(stream, &root, &mount) {
                        eprintln!("serve: {e:#}");
                    }
                });
            }
        });
        let watch_stop = Arc::clone(&stop);
        let watch_counts = Arc::clone(&counts);
        let watcher = std::thread::spawn(move || watch(&opts, &watch_stop, &watch_counts));
        Ok(Server {
            addr,
            stop,
            counts,
            threads: vec![server, watcher],
        })
    }

    /// The address served (127.0.0.1 and the bound port).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Builds so far.
    pub fn counts(&self) -> &BuildCounts {
        &self.counts
    }

    /// Blocks until the server stops (it does not, unless [`Server::stop`] is called from
    /// another thread); `docgen serve` runs until interrupted.
    pub fn wait(mut self) {
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }

    /// Stops the watcher and the listener and waits for both.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the blocking accept with one connection of our own.
        let _ = TcpStream::connect(self.addr);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if !self.threads.is_empty() {
            self.shutdown();
        }
    }
}

fn build_once(opts: &ServeOptions) -> anyhow::Result<usize> {
    super::build(&opts.build).map(|s| s.files)
}

/// Polls the watched folders and rebuilds on change, until `stop`.
fn watch(opts: &ServeOptions, stop: &AtomicBool, counts: &BuildCounts) {
    let mut last = fingerprint(&opts.watch);
    while !stop.load(Ordering::SeqCst) {
        std::thread::sleep(opts.poll);
        let now = fingerprint(&opts.watch);
        if now == last {
            continue;
        }
        last = now;
        match build_once(opts) {
            Ok(n) => {
                counts.ok.fetch_add(1, Ordering::SeqCst);
                eprintln!(
                    "rebuilt: wrote {n} files to {}",
                    opts.build.out_dir.display()
                );
            }
            Err(e) => {
                counts.failed.fetch_add(1, Ordering::SeqCst);
                eprintln!("Error: {e:#}");
                eprintln!("still serving the last good site");
            }
        }
    }
}

/// Size and modification time of every file under `dirs`, by path.
fn fingerprint(dirs: &[PathBuf]) -> BTreeMap<PathBuf, (u64, Option<SystemTime>)> {
    let mut out = BTreeMap::new();
    let mut stack: Vec<PathBuf> = dirs.to_vec();
    while let Some(d) = stack.pop() {
        let Ok(entries) = fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            let Ok(meta) = e.metadata() else { continue };
            if meta.is_dir() {
                stack.push(p);
            } else {
                out.insert(p, (meta.len(), meta.modified().ok()));
            }
        }
    }
    out
}

/// The URL path the site is mounted at: `/` plus the path of `base_url`, ending in `/`.
/// `https://host/perf` and `/perf/` both give `/perf/`.
pub fn mount_path(base_url: Option<&str>) -> String {
    let Some(b) = base_url else {
        return "/".to_string();
    };
    let path = match b.split_once("://") {
        Some((_, rest)) => rest.find('/').map_or("/", |i| &rest[i..]),
        None => b,
    };
    let trimmed = path.trim_matches('/');
    if trimmed.is_empty() {
        "/".to_string()
    } else {
        format!("/{trimmed}/")
    }
}

/// Content type by file extension.
fn content_type(path: &Path) -> &'static str {
    match path.extension().and_then(|e| e.to_str()) {
        Some("html") => "text/html; charset=utf-8",
        Some("css") => "text/css; charset=utf-8",
        Some("svg") => "image/svg+xml",
        Some("json") => "application/json",
        Some("png") => "image/png",
        Some("js") => "text/javascript; charset=utf-8",
        Some("txt" | "md") => "text/plain; charset=utf-8",
        _ => "application/octet-stream",
    }
}

/// Decodes `%XX` escapes; `None` when one is malformed or the result is not UTF-8.
fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = s.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// The file under `root` that `target` (the request target) names, if it is inside the mount
/// and a plain relative path. Folders map to their `index.html`.
pub fn resolve(root: &Path, mount: &str, target: &str) -> Option<PathBuf> {
    let path = target.split(['?', '#']).next().unwrap_or("");
    let path = percent_decode(path)?;
    let rel = path.strip_prefix(mount).or_else(|| {
        // `/perf` for mount `/perf/`.
        (path.len() + 1 == mount.len() && mount.starts_with(&path)).then_some("")
    })?;
    let rel_path = Path::new(rel);
    if !rel_path
        .components()
        .all(|c| matches!(c, Component::Normal(_)))
    {
        return None;
    }
    let mut full = root.join(rel_path);
    if full.is_dir() {
        full.push("index.html");
    }
    Some(full)
}

fn handle(mut stream: TcpStream, root: &Path, mount: &str) -> anyhow::Result<()> {
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut head = String::new();
    let mut line = String::new();
    loop {
        line.clear();
        let n = (&mut reader)
            .take((MAX_HEAD - head.len()) as u64 + 1)
            .read_line(&mut line)?;
        if n == 0 {
            break;
        }
        head.push_str(&line);
        if line == "\r\n" || line == "\n" {
            break;
        }
        if head.len() > MAX_HEAD {
            return respond(
                &mut stream,
                "431 Request Header Fields Too Large",
                None,
                b"",
            );
        }
    }
    let mut parts = head.lines().next().unwrap_or("").split_whitespace();
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    if method != "GET" && method != "HEAD" {
        return respond(&mut stream, "405 Method Not Allowed", None, b"");
    }
    let body_wanted = method == "GET";
    // The bare root redirects to the mount, so `/` works with a base URL too.
    if target == "/" && mount != "/" {
        let head = format!(
            "HTTP/1.1 302 Found\r\nLocation: {mount}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        );
        stream.write_all(head.as_bytes())?;
        return Ok(());
    }
    let read = || resolve(root, mount, target).and_then(|p| Some((fs::read(&p).ok()?, p)));
    // A rebuild swaps the site folder with two renames; a read that falls between them
    // finds nothing, so a miss is retried once a moment later.
    let found = read().or_else(|| {
        std::thread::sleep(Duration::from_millis(100));
        read()
    });
    match found {
        Some((bytes, path)) => {
            let body: &[u8] = if body_wanted { &bytes } else { b"" };
            respond_len(
                &mut stream,
                "200 OK",
                Some(content_type(&path)),
                body,
                bytes.len(),
            )
        }
        None => {
            let msg = b"not found\n";
            let body: &[u8] = if body_wanted { msg } else { b"" };
            respond_len(
                &mut stream,
                "404 Not Found",
                Some("text/plain; charset=utf-8"),
                body,
                msg.len(),
            )
        }
    }
}

fn respond(
    stream: &mut TcpStream,
    status: &str,
    content_type: Option<&str>,
    body: &[u8],
) -> anyhow::Result<()> {
    respond_len(stream, status, content_type, body, body.len())
}

fn respond_len(
    stream: &mut TcpStream,
    status: &str,
    content_type: Option<&str>,
    body: &[u8],
    length: usize,
) -> anyhow::Result<()> {
    let mut head = format!(
        "HTTP/1.1 {status}\r\nContent-Length: {length}\r\nCache-Control: no-store\r\nConnection: close\r\n"
    );
    if let Some(ct) = content_type {
        head.push_str(&format!("Content-Type: {ct}\r\n"));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes())?;
    stream.write_all(body)?;
    stream.flush()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mount_paths() {
        assert_eq!(mount_path(None), "/");
        assert_eq!(mount_path(Some("/perf")), "/perf/");
        assert_eq!(mount_path(Some("/perf/")), "/perf/");
        assert_eq!(mount_path(Some("https://x.github.io/a/b/")), "/a/b/");
        assert_eq!(mount_path(Some("https://x.github.io")), "/");
    }

    #[test]
    fn resolve_stays_inside_the_root() {
        let root = Path::new("/srv/site");
        assert_eq!(
            resolve(root, "/", "/figures/a.svg?x=1"),
            Some(root.join("figures/a.svg"))
        );
        assert_eq!(resolve(root, "/", "/../etc/passwd"), None);
        assert_eq!(resolve(root, "/", "/%2e%2e/etc/passwd"), None);
        assert_eq!(resolve(root, "/perf/", "/index.html"), None);
        assert_eq!(
            resolve(root, "/perf/", "/perf/a%20b.html"),
            Some(root.join("a b.html"))
        );
        assert_eq!(resolve(root, "/", "/%zz"), None);
    }
}
