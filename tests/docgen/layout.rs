//! Every page as a browser lays it out: at 390 px (a phone) and 1280 px wide, no page is wider
//! than the window; wide tables, code and figures scroll inside their own box; and no figure
//! is drawn smaller than its own size, so its text keeps the size it was drawn at (tick labels
//! 13 px, legends 12 px: `figures.rs`). A figure's own size is its `<img>`'s width and height
//! attributes, which docgen writes from the size it draws the SVG at (`figures.rs`
//! checks that they match the SVG files), so the browser lays the pages out with images off: loading
//! the site's ~800 figures took over 40 s of the test's 52 on two cores, laying the pages out
//! without them about 3.
//!
//! The site is built from the committed data into a temporary folder; a harness page beside it
//! loads every page in an iframe of each width and writes what it measured into its title,
//! which headless Chromium prints with `--dump-dom`. The site itself stays script-free. Needs
//! Chromium: without it the test is compiled as ignored (build.rs sets `kp_chromium`).

use std::fs;
use std::path::Path;
use std::process::Command;

use kernelpages::site::{self, BuildOptions};

use super::{chromium, CHROMIUM_FLAGS};

const WIDTHS: [u32; 2] = [390, 1280];

/// The harness: one iframe per (page, width); once all have loaded, the title holds one line
/// per frame, `page width scrollWidth clientWidth shrunk-figures offenders`.
fn harness(pages: &[String]) -> String {
    let mut frames = String::new();
    for p in pages {
        for w in WIDTHS {
            frames.push_str(&format!(
                "<iframe data-page=\"{p}\" data-width=\"{w}\" src=\"{p}\" \
                 style=\"width:{w}px;height:900px;border:0;display:block\"></iframe>\n"
            ));
        }
    }
    format!(
        r#"<!DOCTYPE html><html><head><title>pending</title></head><body>
{frames}<script>
const out = [];
function measure(f) {{
  const d = f.contentDocument, root = d.documentElement, cw = root.clientWidth;
  // Elements sticking out past the window, outside any box that scrolls.
  const scrolls = e => {{ for (let a = e.parentElement; a; a = a.parentElement) {{
      const s = getComputedStyle(a).overflowX; if (s === 'auto' || s === 'scroll') return true; }}
    return false; }};
  const off = [...d.body.querySelectorAll('*')]
    .filter(e => e.getBoundingClientRect().right > cw + 0.5 && !scrolls(e))
    .slice(0, 4).map(e => e.tagName.toLowerCase() + (e.className ? '.' + e.className : ''));
  // Figures drawn smaller than their own size (the width attribute; a figure without one
  // counts) would shrink their text below its set size.
  const shrunk = [...d.images]
    .filter(i => !i.hasAttribute('width') || i.width + 1 < Number(i.getAttribute('width'))).length;
  out.push([f.dataset.page, f.dataset.width, root.scrollWidth, cw, shrunk, off.join('|') || '-'].join(' '));
}}
// The window's load event comes after every frame's.
window.addEventListener('load', () => {{
  document.querySelectorAll('iframe').forEach(measure);
  document.title = out.join('\n');
}});
</script></body></html>"#
    )
}

#[test]
#[cfg_attr(
    not(kp_chromium),
    ignore = "needs Chromium on PATH (Debian package `chromium`; .ci/run installs it)"
)]
fn no_page_is_wider_than_the_window() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("site");
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    site::build(&BuildOptions {
        data_dir: root.join("data"),
        out_dir: out.clone(),
        base_url: None,
        templates_dir: Some(root.join("templates")),
    })
    .unwrap();
    let mut pages: Vec<String> = fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".html"))
        .collect();
    pages.sort();
    assert!(pages.len() >= 4, "{pages:?}");
    // In this temporary copy of the site, so that the frames load the pages by relative path.
    let harness_path = out.join("zz-layout-harness.html");
    fs::write(&harness_path, harness(&pages)).unwrap();
    let profile = tempfile::tempdir().unwrap();
    let output = Command::new(chromium().expect("chromium on PATH"))
        .args(CHROMIUM_FLAGS)
        .args([
            "--allow-file-access-from-files",
            "--blink-settings=imagesEnabled=false",
            "--window-size=1400,900",
            "--virtual-time-budget=20000",
            "--dump-dom",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .arg(format!("file://{}", harness_path.display()))
        .output()
        .unwrap();
    let dom = String::from_utf8_lossy(&output.stdout);
    let title = dom
        .split("<title>")
        .nth(1)
        .and_then(|t| t.split("</title>").next())
        .unwrap_or_else(|| panic!("no title in {dom}"));
    let lines: Vec<&str> = title.lines().collect();
    assert_eq!(
        lines.len(),
        pages.len() * WIDTHS.len(),
        "not every frame reported: {title}"
    );
    let mut wide = Vec::new();
    for line in &lines {
        let f: Vec<&str> = line.splitn(6, ' ').collect();
        let (scroll, client): (u32, u32) = (f[2].parse().unwrap(), f[3].parse().unwrap());
        let shrunk: u32 = f[4].parse().unwrap();
        if scroll > client || shrunk > 0 {
            wide.push(line.to_string());
        }
    }
    assert!(
        wide.is_empty(),
        "pages wider than the window, or with figures drawn smaller than their size \
         (page width scrollWidth clientWidth shrunk-figures offenders):\n{}",
        wide.join("\n")
    );
}
