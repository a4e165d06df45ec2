//! The built overview page as a browser draws it: the site is built from the committed data,
//! `index.html` is opened from `file://` in headless Chromium (`--screenshot`), and the PNG is
//! decoded to check that the At a glance chart rendered: one horizontal band of bar-coloured
//! pixels per bar, on a light background in the light theme and a dark one in the dark theme.
//!
//! Without Chromium (build.rs sets `kp_chromium` when it finds one) the test is compiled as
//! ignored, with the reason; `.ci/run` installs Chromium so CI does run it.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kernelpages::site::{self, BuildOptions};

use super::{chromium, CHROMIUM_FLAGS};

/// Bar colours of the At a glance chart (`figures::DEFAULT_FASTER`, `ALTERNATIVE_FASTER`).
const BAR_COLOURS: [[u8; 3]; 2] = [[0x00, 0x72, 0xb2], [0xe6, 0x9f, 0x00]];

/// Screenshot of `page` (a file), 1280 px wide and `height` px tall; `dark` forces the dark
/// colour scheme.
fn screenshot(browser: &Path, page: &Path, png: &Path, dark: bool, height: usize) {
    let profile = tempfile::tempdir().unwrap();
    let mut cmd = Command::new(browser);
    cmd.args(CHROMIUM_FLAGS)
        .arg("--hide-scrollbars")
        .arg(format!("--window-size=1280,{height}"))
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .arg(format!("--screenshot={}", png.display()));
    if dark {
        cmd.arg("--force-dark-mode");
    }
    let url = format!("file://{}", page.display());
    let mut child = cmd
        .arg(url)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            assert!(status.success(), "chromium failed: {status}");
            break;
        }
        if t0.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("chromium did not finish in 120 s");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(png.is_file(), "no screenshot written");
}

/// RGB pixels, row-major, and the width.
fn decode(png_path: &Path) -> (Vec<[u8; 3]>, usize) {
    let file = std::io::BufReader::new(fs::File::open(png_path).unwrap());
    let mut decoder = png::Decoder::new(file);
    decoder.set_transformations(png::Transformations::normalize_to_color8());
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size().unwrap()];
    let info = reader.next_frame(&mut buf).unwrap();
    let channels = info.color_type.samples();
    assert!(
        channels >= 3,
        "unexpected colour type {:?}",
        info.color_type
    );
    let pixels = buf[..info.buffer_size()]
        .chunks_exact(channels)
        .map(|p| [p[0], p[1], p[2]])
        .collect();
    (pixels, info.width as usize)
}

fn near(a: [u8; 3], b: [u8; 3]) -> bool {
    a.iter().zip(b).all(|(x, y)| x.abs_diff(y) <= 6)
}

/// Bands of rows holding bar-coloured pixels (a band: rows with at least 10 such pixels, a gap
/// of at most [`MAX_GAP`] rows bridged: the IQR whisker's horizontal line crosses a short bar
/// and leaves fewer than 10 bar-coloured pixels in its row), as (first row, last row, leftmost
/// column, rightmost column).
fn bar_bands(pixels: &[[u8; 3]], width: usize) -> Vec<(usize, usize, usize, usize)> {
    let mut bands: Vec<(usize, usize, usize, usize)> = Vec::new();
    let mut open = false;
    for (y, row) in pixels.chunks_exact(width).enumerate() {
        let cols: Vec<usize> = row
            .iter()
            .enumerate()
            .filter(|(_, p)| BAR_COLOURS.iter().any(|c| near(**p, *c)))
            .map(|(x, _)| x)
            .collect();
        if cols.len() >= 10 {
            let (l, r) = (cols[0], cols[cols.len() - 1]);
            match (open, bands.last_mut()) {
                (true, Some(b)) => {
                    b.1 = y;
                    b.2 = b.2.min(l);
                    b.3 = b.3.max(r);
                }
                _ => bands.push((y, y, l, r)),
            }
            open = true;
        } else if bands.last().is_none_or(|b| y - b.1 > MAX_GAP) {
            open = false;
        }
    }
    bands
}

/// Rows a band may skip (a whisker line, antialiased: 2 rows at the screenshot's scale).
const MAX_GAP: usize = 3;

fn luminance(p: [u8; 3]) -> f64 {
    0.2126 * f64::from(p[0]) + 0.7152 * f64::from(p[1]) + 0.0722 * f64::from(p[2])
}

#[test]
#[cfg_attr(
    not(kp_chromium),
    ignore = "needs Chromium on PATH (Debian package `chromium`; .ci/run installs it)"
)]
fn at_a_glance_chart_renders_in_chromium() {
    let browser = chromium().expect("chromium on PATH");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("site");
    let data = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data");
    site::build(&BuildOptions {
        data_dir: data.clone(),
        out_dir: out.clone(),
        base_url: None,
        templates_dir: None,
    })
    .unwrap();
    let bars = kernelpages::site::model::build_model(
        &kernelpages::load::load_dir(&data).unwrap(),
        None,
        &[],
    )
    .glance_chart
    .map_or(0, |c| c.bars.len());
    assert!(bars > 0, "the committed data gives no At a glance bar");

    for dark in [false, true] {
        let png_path = tmp.path().join(if dark { "dark.png" } else { "light.png" });
        // Tall enough for the whole chart: a slot of 46 px per bar, more where a long case
        // label wraps (78 px seen with kernel-sum labels), below the page's header.
        screenshot(
            &browser,
            &out.join("index.html"),
            &png_path,
            dark,
            1600 + 100 * bars,
        );
        let (pixels, width) = decode(&png_path);
        let mut bands = bar_bands(&pixels, width);
        // One band per bar, then the legend's row of the two bar colours.
        assert_eq!(
            bands.len(),
            bars + 1,
            "dark={dark}: expected one band per bar and the legend's, found {bands:?}"
        );
        let legend = bands.pop().unwrap();
        assert!(legend.1 - legend.0 <= 12, "legend swatches: {legend:?}");
        for &(top, bottom, left, right) in &bands {
            assert!(bottom - top >= 8, "dark={dark}: bar too thin {bands:?}");
            assert!(right - left >= 10, "dark={dark}: bar too short {bands:?}");
        }
        // The chart's background just above its first bar follows the theme.
        let (top, _, left, right) = bands[0];
        let y = top.saturating_sub(4);
        let row = &pixels[y * width + left..=y * width + right];
        let mean = row.iter().map(|p| luminance(*p)).sum::<f64>() / row.len() as f64;
        if dark {
            assert!(mean < 80.0, "dark theme: background luminance {mean}");
        } else {
            assert!(mean > 200.0, "light theme: background luminance {mean}");
        }
    }
}
