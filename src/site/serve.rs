//! `docgen serve`: builds the site to disk, serves the output folder over HTTP on 127.0.0.1
//! only, rebuilds when a file under the watched folders (`data/`, `templates/`) changes, and
//! makes open pages reload themselves after each successful rebuild.
//!
//! As in mdBook, serving is done by maintained libraries: [`axum`] on a [`tokio`] runtime owned
//! by the [`Server`] (so callers stay synchronous), [`tower_http::services::ServeDir`] for the
//! files (`index.html` for folders, content types, and refusal of any path with a `..`, a root or
//! a prefix component, percent-encoded or not), and [`notify_debouncer_full`] for the watcher.
//!
//! The server only ever reads the built folder: a rebuild goes through [`super::build`] (with
//! its output-folder guard, the templates folder of the build options, and its atomic swap),
//! and a failed rebuild leaves the last good site in place (the error is printed and serving
//! goes on).
//!
//! Live reload: each HTML page is served with a small script, inserted on the fly before its
//! last `</body>`, that listens on the server-sent-events stream [`LIVE_RELOAD_PATH`] and
//! reloads the page on a `reload` event, which every successful rebuild sends. The files on
//! disk are never changed: the built site stays script-free and works from `file://`.
//!
//! The site is mounted under the path of `--base-url` when one is given (`/` then redirects
//! there); every response carries `Cache-Control: no-store`.

use std::convert::Infallible;
use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::Context as _;
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode, Uri};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use futures_util::{Stream, StreamExt as _};
use notify_debouncer_full::notify::{RecommendedWatcher, RecursiveMode};
use notify_debouncer_full::{DebounceEventResult, Debouncer, RecommendedCache};
use tokio::sync::broadcast;
use tower_http::services::ServeDir;

use super::BuildOptions;

/// Default quiet time of the watcher: a burst of changes closer together than this gives one
/// rebuild.
pub const DEBOUNCE: Duration = Duration::from_millis(200);

/// URL path of the live-reload stream (server-sent events), outside any base-URL mount.
pub const LIVE_RELOAD_PATH: &str = "/__livereload";

/// The script inserted into served HTML pages (never into the files on disk).
const LIVE_RELOAD_SCRIPT: &str = "<script data-docgen-livereload>\
new EventSource(\"/__livereload\").addEventListener(\"reload\", () => location.reload());\
</script>\n";

/// Largest HTML page that gets the live-reload script, bytes; larger ones are served as they
/// are.
const MAX_INJECT: usize = 64 * 1024 * 1024;

/// What `docgen serve` needs.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// Where the site is built from and to; `base_url`'s path is where it is mounted.
    pub build: BuildOptions,
    /// TCP port on 127.0.0.1; 0 picks a free one (see [`Server::addr`]).
    pub port: u16,
    /// Folders whose changes trigger a rebuild (recursively). Missing folders are skipped.
    pub watch: Vec<PathBuf>,
    /// Quiet time of the watcher ([`DEBOUNCE`] by default): changes are gathered until none
    /// came for this long, then one rebuild runs.
    pub debounce: Duration,
}

/// Counts of builds since start, for logs and tests.
#[derive(Debug, Default)]
pub struct BuildCounts {
    /// Builds that wrote a site (the first one included).
    pub ok: AtomicU64,
    /// Builds that failed (the previous site kept).
    pub failed: AtomicU64,
}

/// The debounced file watcher.
type Watcher = Debouncer<RecommendedWatcher, RecommendedCache>;

/// What the rebuild thread is told.
enum Msg {
    /// Files changed under a watched folder.
    Changed(Vec<PathBuf>),
    /// The watcher reported an error.
    WatchError(String),
    /// Finish and return.
    Stop,
}

/// A running server: the HTTP server on its own runtime, the watcher, and the thread that
/// rebuilds.
pub struct Server {
    addr: SocketAddr,
    counts: Arc<BuildCounts>,
    runtime: Option<tokio::runtime::Runtime>,
    serving: Option<tokio::task::JoinHandle<io::Result<()>>>,
    watcher: Option<Watcher>,
    to_rebuilder: mpsc::Sender<Msg>,
    rebuilder: Option<JoinHandle<()>>,
}

impl Server {
    /// Binds 127.0.0.1:`port`, starts watching, builds once, and starts serving and rebuilding
    /// in the background.
    ///
    /// Errors: the port is in use or cannot be bound (checked first, so it fails at once), the
    /// first build fails (nothing to serve), or the watcher or runtime cannot be started.
    pub fn start(opts: ServeOptions) -> anyhow::Result<Server> {
        let listener = bind(opts.port)?;
        let addr = listener.local_addr().context("listener has no address")?;

        // Watching starts before the first build, so a change made during it is not missed.
        let (to_rebuilder, inbox) = mpsc::channel();
        let watcher = watch(&opts, to_rebuilder.clone())?;
        let counts = Arc::new(BuildCounts::default());
        let n = build_once(&opts)?;
        counts.ok.fetch_add(1, Ordering::SeqCst);
        eprintln!("wrote {n} files to {}", opts.build.out_dir.display());

        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("docgen-serve")
            .enable_all()
            .build()
            .context("cannot start the server's runtime")?;
        let (reload_tx, _) = broadcast::channel::<u64>(16);
        let app = router(Site {
            root: opts.build.out_dir.clone(),
            mount: mount_path(opts.build.base_url.as_deref()),
            reload: reload_tx.clone(),
        });
        listener
            .set_nonblocking(true)
            .context("cannot make the listener non-blocking")?;
        let listener = {
            let _entered = runtime.enter();
            tokio::net::TcpListener::from_std(listener).context("cannot register the listener")?
        };
        let serving = runtime.spawn(async move { axum::serve(listener, app).await });

        let rebuild_counts = Arc::clone(&counts);
        let rebuilder = std::thread::Builder::new()
            .name("docgen-rebuild".into())
            .spawn(move || rebuild_loop(&opts, &inbox, &rebuild_counts, &reload_tx))
            .context("cannot start the rebuild thread")?;

        Ok(Server {
            addr,
            counts,
            runtime: Some(runtime),
            serving: Some(serving),
            watcher: Some(watcher),
            to_rebuilder,
            rebuilder: Some(rebuilder),
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

    /// Blocks for as long as the server runs: until the process is interrupted (`docgen serve`
    /// runs until Ctrl-C), or the HTTP server fails, whose error is then returned.
    pub fn wait(mut self) -> anyhow::Result<()> {
        let result = match (&self.runtime, self.serving.take()) {
            (Some(rt), Some(task)) => match rt.block_on(task) {
                Ok(served) => served.context("the HTTP server failed"),
                Err(e) => Err(anyhow::anyhow!("the HTTP server stopped: {e}")),
            },
            _ => Ok(()),
        };
        self.shutdown();
        result
    }

    /// Stops the watcher, the rebuild thread (after the build in progress, if any) and the
    /// HTTP server, open live-reload streams included, and waits for them.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        // No more change events, then the rebuild thread, then the server.
        if let Some(w) = self.watcher.take() {
            w.stop();
        }
        let _ = self.to_rebuilder.send(Msg::Stop);
        if let Some(t) = self.rebuilder.take() {
            let _ = t.join();
        }
        if let Some(task) = self.serving.take() {
            task.abort();
        }
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_timeout(Duration::from_secs(2));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Binds 127.0.0.1:`port`, with a message naming `--port` when the port is taken.
fn bind(port: u16) -> anyhow::Result<std::net::TcpListener> {
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    std::net::TcpListener::bind(addr).map_err(|e| {
        if e.kind() == io::ErrorKind::AddrInUse {
            anyhow::anyhow!("{addr} is in use; pick another with --port (0 picks a free one)")
        } else {
            anyhow::Error::new(e).context(format!("cannot listen on {addr}"))
        }
    })
}

fn build_once(opts: &ServeOptions) -> anyhow::Result<usize> {
    super::build(&opts.build).map(|s| s.files)
}

/// Starts the debounced watcher on every watched folder that exists; its events go to
/// `to_rebuilder`. Reads (the build opens every file it loads) are not changes, and neither
/// are changes to the site folder itself or its temporary siblings, so a site built inside a
/// watched folder does not rebuild forever.
fn watch(opts: &ServeOptions, to_rebuilder: mpsc::Sender<Msg>) -> anyhow::Result<Watcher> {
    // Compared with the watched folders' canonical paths; the site folder may not exist yet.
    let out = std::path::absolute(&opts.build.out_dir).unwrap_or(opts.build.out_dir.clone());
    let out = match (out.parent().map(Path::canonicalize), out.file_name()) {
        (Some(Ok(parent)), Some(name)) => parent.join(name),
        _ => out,
    };
    let mut debouncer = notify_debouncer_full::new_debouncer(
        opts.debounce,
        None,
        move |events: DebounceEventResult| {
            let msg = match events {
                Ok(events) => {
                    let mut paths: Vec<PathBuf> = events
                        .into_iter()
                        .filter(|e| !e.kind.is_access())
                        .flat_map(|e| e.event.paths)
                        .filter(|p| !is_site_output(&out, p))
                        .collect();
                    paths.dedup();
                    if paths.is_empty() {
                        return;
                    }
                    Msg::Changed(paths)
                }
                Err(errors) => Msg::WatchError(
                    errors
                        .iter()
                        .map(ToString::to_string)
                        .collect::<Vec<_>>()
                        .join("; "),
                ),
            };
            let _ = to_rebuilder.send(msg);
        },
    )
    .context("cannot start the file watcher")?;
    for dir in &opts.watch {
        if !dir.is_dir() {
            continue;
        }
        let dir = dir.canonicalize().unwrap_or(dir.clone());
        debouncer
            .watch(&dir, RecursiveMode::Recursive)
            .with_context(|| format!("cannot watch {}", dir.display()))?;
    }
    Ok(debouncer)
}

/// Whether `path` is in the site folder `out` or one of the siblings a build writes and
/// removes ([`super::write::is_build_output`]).
fn is_site_output(out: &Path, path: &Path) -> bool {
    super::write::is_build_output(out, path)
}

/// Rebuilds once per batch of changes until told to stop; after each successful rebuild,
/// tells the open pages to reload.
fn rebuild_loop(
    opts: &ServeOptions,
    inbox: &mpsc::Receiver<Msg>,
    counts: &BuildCounts,
    reload: &broadcast::Sender<u64>,
) {
    while let Ok(msg) = inbox.recv() {
        let mut changed = match msg {
            Msg::Stop => return,
            Msg::WatchError(e) => {
                eprintln!("watch: {e}");
                continue;
            }
            Msg::Changed(paths) => paths,
        };
        // Changes that came during the last build are covered by this one.
        while let Ok(more) = inbox.try_recv() {
            match more {
                Msg::Stop => return,
                Msg::WatchError(e) => eprintln!("watch: {e}"),
                Msg::Changed(paths) => changed.extend(paths),
            }
        }
        let first = changed[0].display();
        match changed.len() {
            1 => eprintln!("changed: {first}; rebuilding"),
            n => eprintln!("changed: {first} and {} more; rebuilding", n - 1),
        }
        match build_once(opts) {
            Ok(n) => {
                let ok = counts.ok.fetch_add(1, Ordering::SeqCst) + 1;
                eprintln!(
                    "rebuilt: wrote {n} files to {}",
                    opts.build.out_dir.display()
                );
                // No page open is not an error.
                let _ = reload.send(ok);
            }
            Err(e) => {
                counts.failed.fetch_add(1, Ordering::SeqCst);
                eprintln!("Error: {e:#}");
                eprintln!("still serving the last good site");
            }
        }
    }
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

/// What the request handlers share.
#[derive(Clone)]
struct Site {
    /// The built site folder (read afresh at each request, so a swapped-in build is served).
    root: PathBuf,
    /// From [`mount_path`].
    mount: String,
    /// Sends the number of successful builds after each rebuild.
    reload: broadcast::Sender<u64>,
}

fn router(site: Site) -> Router {
    Router::new()
        .route(LIVE_RELOAD_PATH, get(live_reload))
        .fallback(serve_site)
        .with_state(Arc::new(site))
        .layer(axum::middleware::map_response(no_store))
}

async fn no_store(mut resp: Response) -> Response {
    resp.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    resp
}

/// The live-reload stream: a `hello` event at once (so a client knows it is subscribed), then
/// a `reload` event after every successful rebuild.
async fn live_reload(
    State(site): State<Arc<Site>>,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let rx = site.reload.subscribe();
    let hello = futures_util::stream::once(async { Ok(Event::default().event("hello").data("")) });
    let reloads = futures_util::stream::unfold(rx, |mut rx| async move {
        let build = match rx.recv().await {
            Ok(n) => n.to_string(),
            // Missed some: one reload covers them.
            Err(broadcast::error::RecvError::Lagged(_)) => String::new(),
            Err(broadcast::error::RecvError::Closed) => return None,
        };
        Some((Ok(Event::default().event("reload").data(build)), rx))
    });
    Sse::new(hello.chain(reloads)).keep_alive(KeepAlive::default())
}

/// Serves a file of the site: the mount prefix is taken off and [`ServeDir`] does the rest;
/// HTML pages get the live-reload script.
async fn serve_site(State(site): State<Arc<Site>>, req: Request) -> Response {
    let path = req.uri().path();
    if site.mount != "/" && (path == "/" || path == site.mount.trim_end_matches('/')) {
        return (StatusCode::FOUND, [(header::LOCATION, site.mount.clone())]).into_response();
    }
    let Some(rest) = path.strip_prefix(&site.mount) else {
        return StatusCode::NOT_FOUND.into_response();
    };
    let Ok(uri) = format!("/{rest}").parse::<Uri>() else {
        return StatusCode::NOT_FOUND.into_response();
    };
    let (parts, _) = req.into_parts();
    let prefix = site.mount.trim_end_matches('/');
    let dir = ServeDir::new(&site.root).redirect_path_prefix(prefix);
    let request = || {
        let mut r = Request::new(Body::empty());
        *r.method_mut() = parts.method.clone();
        *r.uri_mut() = uri.clone();
        *r.headers_mut() = parts.headers.clone();
        r
    };
    // `Ok(None)`: no such file (a missing file, or a file where a folder was expected).
    let fetch = || async {
        match dir.clone().try_call(request()).await {
            Ok(r) if r.status() == StatusCode::NOT_FOUND => Ok(None),
            Ok(r) => Ok(Some(r)),
            Err(e)
                if e.kind() == io::ErrorKind::NotFound
                    || e.kind() == io::ErrorKind::NotADirectory =>
            {
                Ok(None)
            }
            Err(e) => Err(e),
        }
    };
    let mut found = fetch().await;
    if matches!(found, Ok(None)) {
        // A rebuild swaps the site folder with two renames; a read that falls between them
        // finds nothing, so a miss is retried once a moment later.
        tokio::time::sleep(Duration::from_millis(100)).await;
        found = fetch().await;
    }
    match found {
        Ok(Some(resp)) => with_live_reload(&parts.method, resp.map(Body::new)).await,
        Ok(None) => (StatusCode::NOT_FOUND, "not found\n").into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n")).into_response(),
    }
}

/// Inserts [`LIVE_RELOAD_SCRIPT`] into a whole (200) HTML page; other responses pass as they
/// are.
async fn with_live_reload(method: &Method, resp: Response) -> Response {
    let is_html = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/html"));
    if resp.status() != StatusCode::OK || !is_html {
        return resp;
    }
    let (mut parts, body) = resp.into_parts();
    // The length changes; the body sets it again.
    parts.headers.remove(header::CONTENT_LENGTH);
    if method == Method::HEAD {
        return Response::from_parts(parts, Body::empty());
    }
    match axum::body::to_bytes(body, MAX_INJECT).await {
        Ok(page) => Response::from_parts(parts, Body::from(inject(&page))),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n")).into_response(),
    }
}

/// `page` with [`LIVE_RELOAD_SCRIPT`] before its last `</body>` (any case), or at the end when
/// it has none.
fn inject(page: &[u8]) -> Bytes {
    let at = page
        .windows(7)
        .rposition(|w| w.eq_ignore_ascii_case(b"</body>"))
        .unwrap_or(page.len());
    let mut out = Vec::with_capacity(page.len() + LIVE_RELOAD_SCRIPT.len());
    out.extend_from_slice(&page[..at]);
    out.extend_from_slice(LIVE_RELOAD_SCRIPT.as_bytes());
    out.extend_from_slice(&page[at..]);
    Bytes::from(out)
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
    fn script_goes_before_the_last_body_end() {
        let page = inject(b"<html><body><p>x</p></BODY></html>");
        let page = String::from_utf8(page.to_vec()).unwrap();
        assert!(
            page.ends_with(&format!("<p>x</p>{LIVE_RELOAD_SCRIPT}</BODY></html>")),
            "{page}"
        );
        let bare = inject(b"<p>no body end</p>");
        assert!(bare.ends_with(LIVE_RELOAD_SCRIPT.as_bytes()));
        assert!(LIVE_RELOAD_SCRIPT.contains(LIVE_RELOAD_PATH));
    }

    #[test]
    fn site_output_is_not_a_change() {
        let out = Path::new("/w/data/site");
        assert!(is_site_output(out, Path::new("/w/data/site/index.html")));
        assert!(is_site_output(
            out,
            Path::new("/w/data/.site.tmp-42-0/figures/a.svg")
        ));
        assert!(is_site_output(out, Path::new("/w/data/.site.old-42-0")));
        assert!(!is_site_output(out, Path::new("/w/data/gpu.json")));
        assert!(!is_site_output(out, Path::new("/w/data/site2/x.json")));
    }
}
