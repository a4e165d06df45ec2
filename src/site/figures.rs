//! Draws the model's figures as SVG strings with Plotters; nothing here touches the disk.
//!
//! Each SVG gets a `<title>` and `<desc>` (inserted after the root element, which Plotters
//! does not write) so screen readers and text browsers can read it, and a `<style>` whose
//! `prefers-color-scheme: dark` rule recolours the background, text and axes: the figures are
//! used through `<img>`, where the page's stylesheet cannot reach them. The rule matches the
//! colours Plotters writes as attributes ([`INK`], [`PAPER`]), which no data series uses.
//!
//! Axes show only chosen ticks: the measured x values, and 1-2-5 steps on log y axes; no minor
//! grid. The legend sits below the plot, so it never hides data.

use std::fmt::Write as _;

use anyhow::{anyhow, Context as _};
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::model::{
    BarOutcome, Dash, FigureSpec, GlanceChart, Marker, RatioWords, Series, TileChart,
};

/// Width of a line figure, px.
pub const WIDTH: u32 = 600;
/// Height of a line figure's plot (axes included, legend excluded), px.
const PLOT_HEIGHT: u32 = 380;
/// Height of one legend line, px.
const LEGEND_LINE: u32 = 20;
/// Font of every text.
const FONT: &str = "sans-serif";

/// Plotters' SVG backend writes a requested font size divided by 1.24 (its point-to-pixel
/// factor); the font size to request for text `size` px high in the SVG.
fn px(size: f64) -> f64 {
    size * 1.24
}

/// Text, axes and the tolerance line; light grey in the dark theme.
pub const INK: RGBColor = RGBColor(0x1d, 0x1f, 0x21);
/// Background; near black in the dark theme.
pub const PAPER: RGBColor = RGBColor(0xff, 0xff, 0xff);
/// Grid lines (drawn translucent, readable on both backgrounds).
const GRID: RGBColor = RGBColor(0x8c, 0x95, 0x9f);
/// Bars where the default is faster (ratio above 1): blue, and orange for the other side, the
/// pair of the Okabe-Ito palette that readers with any common colour-vision deficiency tell
/// apart.
pub const DEFAULT_FASTER: RGBColor = RGBColor(0x00, 0x72, 0xb2);
/// Bars where the alternative is faster (ratio below 1).
pub const ALTERNATIVE_FASTER: RGBColor = RGBColor(0xe6, 0x9f, 0x00);

/// Colours of [`INK`] and [`PAPER`] in the dark theme (those of `templates/style.css`).
const DARK_INK: &str = "#e6e6e6";
const DARK_PAPER: &str = "#15171a";

/// `#RRGGBB` as Plotters writes it in SVG attributes.
fn svg_hex(c: RGBColor) -> String {
    format!("#{:02X}{:02X}{:02X}", c.0, c.1, c.2)
}

/// Parses `#rrggbb` into a colour; anything else is grey.
fn rgb(hex: &str) -> RGBColor {
    let h = hex.trim_start_matches('#');
    let p = |i: usize| {
        h.get(i..i + 2)
            .and_then(|s| u8::from_str_radix(s, 16).ok())
            .unwrap_or(0x80)
    };
    if h.len() == 6 {
        RGBColor(p(0), p(2), p(4))
    } else {
        RGBColor(0x80, 0x80, 0x80)
    }
}

fn xml_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '&' => out.push_str("&amp;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            c => out.push(c),
        }
    }
    out
}

/// The `<style>` element of every figure: the dark theme's colours for [`INK`] and [`PAPER`].
pub fn theme_style() -> String {
    let (ink, paper) = (svg_hex(INK), svg_hex(PAPER));
    format!(
        "<style>@media (prefers-color-scheme: dark) {{ \
         [fill=\"{paper}\"] {{ fill: {DARK_PAPER}; }} \
         [fill=\"{ink}\"] {{ fill: {DARK_INK}; }} \
         [stroke=\"{ink}\"] {{ stroke: {DARK_INK}; }} }}</style>"
    )
}

/// Inserts `<title>`, `<desc>` and the [`theme_style`] right after the opening `<svg ...>` tag.
pub fn add_title_desc(svg: &str, title: &str, desc: &str) -> anyhow::Result<String> {
    let start = svg.find("<svg").context("SVG has no <svg> element")?;
    let end = svg[start..]
        .find('>')
        .context("SVG root element is not closed")?
        + start
        + 1;
    Ok(format!(
        "{}\n<title>{}</title>\n<desc>{}</desc>\n{}{}",
        &svg[..end],
        xml_escape(title),
        xml_escape(desc),
        theme_style(),
        &svg[end..]
    ))
}

fn plot_err<E: std::fmt::Debug>(what: &str) -> impl Fn(E) -> anyhow::Error + '_ {
    move |e| anyhow!("plotting {what}: {e:?}")
}

/// Bounds of a log axis around `values`: a factor of `pad` beyond the extremes.
fn log_bounds(values: impl Iterator<Item = f64>, pad: f64) -> (f64, f64) {
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for v in values.filter(|v| v.is_finite() && *v > 0.0) {
        lo = lo.min(v);
        hi = hi.max(v);
    }
    if !lo.is_finite() {
        return (0.1, 10.0);
    }
    if lo == hi {
        return (lo / 2.0, hi * 2.0);
    }
    (lo / pad, hi * pad)
}

/// Ticks of a log axis over `lo..hi`: 1-2-5 steps of each decade, only powers of ten when
/// those are too many, finer steps when too few.
pub fn log_ticks(lo: f64, hi: f64) -> Vec<f64> {
    let sets: [&[f64]; 3] = [
        &[1.0, 2.0, 5.0],
        &[1.0],
        &[1.0, 1.2, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0],
    ];
    let within = |mantissas: &[f64]| -> Vec<f64> {
        if !(lo > 0.0 && hi > lo && lo.is_finite() && hi.is_finite()) {
            return Vec::new();
        }
        let (d0, d1) = (lo.log10().floor() as i32, hi.log10().ceil() as i32);
        let mut v = Vec::new();
        for d in d0..=d1 {
            for m in mantissas {
                // Parse the decimal form so ticks are the round numbers they print as.
                let t: f64 = format!("{m}e{d}").parse().unwrap_or(f64::NAN);
                if t >= lo && t <= hi {
                    v.push(t);
                }
            }
        }
        v
    };
    let coarse = within(sets[0]);
    if coarse.len() > 8 {
        return within(sets[1]);
    }
    if coarse.len() < 3 {
        let fine = within(sets[2]);
        if fine.len() > coarse.len() {
            return fine;
        }
    }
    coarse
}

/// A tick label: plain decimal with at most three significant digits and no trailing zeros,
/// scientific (`2e-4`) below 0.001 or from 10⁶.
pub fn tick_label(v: f64) -> String {
    if v != 0.0 && (v.abs() < 1e-3 || v.abs() >= 1e6) {
        let s = format!("{v:.1e}");
        return s.replace(".0e", "e");
    }
    let s = super::format::sig(v, 3);
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

/// Splits `text` at `", "` so that lines hold at most about `max_chars` characters.
fn wrap(text: &str, max_chars: usize) -> Vec<String> {
    let mut lines: Vec<String> = Vec::new();
    let mut line = String::new();
    for part in text.split_inclusive(", ") {
        if !line.is_empty() && line.chars().count() + part.chars().count() > max_chars {
            lines.push(line.trim_end().to_string());
            line.clear();
        }
        line.push_str(part);
    }
    if !line.trim().is_empty() {
        lines.push(line.trim_end().to_string());
    }
    lines
}

/// Approximate width of `text` at font size `size`, px (sans-serif averages ~0.55 em).
fn text_width(text: &str, size: f64) -> u32 {
    (text.chars().count() as f64 * size * 0.55).ceil() as u32
}

/// One legend entry below a line figure.
enum LegendMark {
    /// The series' line and marker, in its colour.
    Line(RGBColor, Marker, Dash),
    /// A cross, in the series colour: cases that did not run.
    Cross(RGBColor),
    /// A dashed line: a reference value.
    Dashed,
}

/// The legend of a figure: one entry per series that has points, one per series with cases
/// that did not run (naming the status and where), one per reference line.
fn legend_entries(spec: &FigureSpec) -> Vec<(LegendMark, String)> {
    let mut v = Vec::new();
    for s in &spec.series {
        let colour = rgb(&s.colour);
        if !s.points.is_empty() {
            v.push((LegendMark::Line(colour, s.marker, s.dash), s.name.clone()));
        }
        if !s.failed.is_empty() {
            v.push((LegendMark::Cross(colour), failed_label(s, &spec.x_label)));
        }
    }
    for (_, label) in &spec.reference_lines {
        v.push((LegendMark::Dashed, label.clone()));
    }
    v
}

/// `flash: did not run: oom at seq_len 8192, 16384; timeout at 4096`.
fn failed_label(s: &Series, x_label: &str) -> String {
    let mut by_status: Vec<(&str, Vec<String>)> = Vec::new();
    for (x, st) in &s.failed {
        let x = tick_label(*x);
        match by_status.iter_mut().find(|(k, _)| k == st) {
            Some((_, xs)) => xs.push(x),
            None => by_status.push((st.as_str(), vec![x])),
        }
    }
    let parts: Vec<String> = by_status
        .into_iter()
        .map(|(st, xs)| format!("{st} at {x_label} {}", xs.join(", ")))
        .collect();
    format!("{}: did not run: {}", s.name, parts.join("; "))
}

/// Legend layout: two columns when every entry fits half the width, otherwise one.
fn legend_columns(entries: &[(LegendMark, String)]) -> u32 {
    let half = (WIDTH - 40) / 2 - 30;
    if entries.iter().all(|(_, t)| text_width(t, 12.0) <= half) {
        2
    } else {
        1
    }
}

/// The figure's visible title, wrapped to the figure's width.
fn title_lines(spec: &FigureSpec) -> Vec<String> {
    wrap(&spec.title, (WIDTH as usize - 24) / 8)
}

/// Height of the title block above the plot, px.
fn title_height(spec: &FigureSpec) -> u32 {
    10 + 19 * title_lines(spec).len() as u32
}

/// Pixel height of a line figure: its title, the plot and its legend lines.
pub fn line_figure_height(spec: &FigureSpec) -> u32 {
    let entries = legend_entries(spec);
    let cols = legend_columns(&entries);
    let lines = (entries.len() as u32).div_ceil(cols);
    title_height(spec) + PLOT_HEIGHT + 12 + lines * LEGEND_LINE
}

/// Linear ticks over `0..hi`: 1-2-5 steps giving 4 to 8 ticks.
pub fn linear_ticks(hi: f64) -> Vec<f64> {
    if !(hi.is_finite() && hi > 0.0) {
        return vec![0.0];
    }
    let raw = hi / 6.0;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| hi / s <= 8.0)
        .unwrap_or(10.0 * mag);
    let decimals = (-step.log10().floor()).max(0.0) as usize;
    (0..)
        .map(|i| {
            // Round through the decimal form so ticks are the round numbers they print as.
            let t = i as f64 * step;
            format!("{t:.decimals$}").parse::<f64>().unwrap_or(t)
        })
        .take_while(|t| *t <= hi * 1.0001)
        .collect()
}

/// Draws a line figure (time, throughput, peak memory or relative error against an axis): log
/// x; log y, or linear y from 0 for throughput; one line per implementation with its own
/// marker and dash pattern (so lines that overlap stay apart without colour); a cross at the top
/// of the plot for each case that did not run; a dashed line per reference value; x ticks at
/// the measured x values only.
pub fn line_figure(spec: &FigureSpec) -> anyhow::Result<String> {
    let entries = legend_entries(spec);
    let height = line_figure_height(spec);
    let mut svg = String::new();
    {
        let err = plot_err(&spec.file);
        let root = SVGBackend::with_string(&mut svg, (WIDTH, height)).into_drawing_area();
        root.fill(&PAPER).map_err(&err)?;
        let (head, body) = root.split_vertically(title_height(spec));
        for (i, line) in title_lines(spec).iter().enumerate() {
            head.draw(&Text::new(
                line.clone(),
                (12, 8 + 19 * i as i32),
                (FONT, px(14.0)).into_font().color(&INK),
            ))
            .map_err(&err)?;
        }
        let (plot, legend) = body.split_vertically(PLOT_HEIGHT);

        let mut xs: Vec<f64> = spec
            .series
            .iter()
            .flat_map(|s| {
                s.points
                    .iter()
                    .map(|p| p.0)
                    .chain(s.failed.iter().map(|f| f.0))
            })
            .filter(|x| x.is_finite() && *x > 0.0)
            .collect();
        xs.sort_by(f64::total_cmp);
        xs.dedup();
        let (x0, x1) = log_bounds(xs.iter().copied(), 1.15);
        let ys: Vec<f64> = spec
            .series
            .iter()
            .flat_map(|s| s.points.iter().map(|p| p.1))
            .chain(spec.reference_lines.iter().map(|r| r.0))
            .collect();
        let any_failed = spec.series.iter().any(|s| !s.failed.is_empty());
        // The body is the same for both y axes; only the coordinate type differs.
        macro_rules! draw_body {
            ($y_coord:expr, $y_labels:expr, $y1:expr, $cross_y:expr) => {{
                let (y1, cross_y) = ($y1, $cross_y);
                let _ = y1;
                let mut chart = ChartBuilder::on(&plot)
                    .margin(12)
                    .margin_right(24)
                    .x_label_area_size(44)
                    .y_label_area_size(64)
                    .build_cartesian_2d((x0..x1).log_scale().with_key_points(xs.clone()), $y_coord)
                    .map_err(&err)?;
                chart
                    .configure_mesh()
                    .x_desc(spec.x_label.as_str())
                    .y_desc(spec.y_label.as_str())
                    .x_label_formatter(&|x| tick_label(*x))
                    .y_label_formatter(&|y| tick_label(*y))
                    .y_labels($y_labels)
                    .bold_line_style(GRID.mix(0.3))
                    .light_line_style(TRANSPARENT)
                    .axis_style(INK)
                    .label_style((FONT, px(13.0)).into_font().color(&INK))
                    .axis_desc_style((FONT, px(14.0)).into_font().color(&INK))
                    .draw()
                    .map_err(&err)?;
                for (value, _) in &spec.reference_lines {
                    chart
                        .draw_series(DashedLineSeries::new(
                            [(x0, *value), (x1, *value)],
                            6,
                            4,
                            INK.stroke_width(1),
                        ))
                        .map_err(&err)?;
                }
                for s in &spec.series {
                    let colour = rgb(&s.colour);
                    let line = colour.stroke_width(if s.emphasis { 3 } else { 2 });
                    if !s.points.is_empty() {
                        match s.dash {
                            Dash::Solid => {
                                chart
                                    .draw_series(LineSeries::new(s.points.iter().copied(), line))
                                    .map_err(&err)?;
                            }
                            Dash::Dashed | Dash::Dotted => {
                                let (size, spacing) = s.dash.pattern();
                                chart
                                    .draw_series(DashedLineSeries::new(
                                        s.points.iter().copied(),
                                        size,
                                        spacing,
                                        line,
                                    ))
                                    .map_err(&err)?;
                            }
                        }
                        let filled = colour.filled();
                        let pts = s.points.iter().copied();
                        match s.marker {
                            Marker::Circle => chart.draw_series(
                                pts.map(|p| EmptyElement::at(p) + Circle::new((0, 0), 4, filled)),
                            ),
                            Marker::Square => chart.draw_series(pts.map(|p| {
                                EmptyElement::at(p) + Rectangle::new([(-4, -4), (4, 4)], filled)
                            })),
                            Marker::Triangle => chart.draw_series(pts.map(|p| {
                                EmptyElement::at(p) + TriangleMarker::new((0, 0), 5, filled)
                            })),
                            Marker::Diamond => chart.draw_series(pts.map(|p| {
                                EmptyElement::at(p)
                                    + Polygon::new(vec![(0, -5), (5, 0), (0, 5), (-5, 0)], filled)
                            })),
                        }
                        .map_err(&err)?;
                    }
                    chart
                        .draw_series(
                            s.failed
                                .iter()
                                .map(|(x, _)| Cross::new((*x, cross_y), 6, colour.stroke_width(2))),
                        )
                        .map_err(&err)?;
                }
            }};
        }
        if spec.log_y {
            let (y0, mut y1) = log_bounds(ys.iter().copied(), 1.6);
            if any_failed {
                // Headroom for the crosses above the highest point.
                y1 *= 1.5;
            }
            let y_ticks = log_ticks(y0, y1);
            draw_body!(
                (y0..y1).log_scale().with_key_points(y_ticks),
                10,
                y1,
                y1 / 1.2
            );
        } else {
            let top = ys
                .iter()
                .copied()
                .filter(|v| v.is_finite())
                .fold(0.0f64, f64::max);
            let top = if top > 0.0 { top } else { 1.0 };
            let y1 = top * if any_failed { 1.25 } else { 1.1 };
            let y_ticks = linear_ticks(y1).len();
            draw_body!(0.0..y1, y_ticks, y1, top * 1.15);
        }
        draw_legend(&legend, &entries).map_err(&err)?;
        root.present().map_err(&err)?;
    }
    add_title_desc(&svg, &spec.title, &spec.desc)
}

/// [`line_figure`] of every spec, in order, spread over the available cores (figures are the
/// bulk of a large site's build). Errors name the figure's file.
pub fn line_figures(specs: &[FigureSpec]) -> anyhow::Result<Vec<String>> {
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, 8);
    let chunk = specs.len().div_ceil(threads).max(16);
    let draw = |part: &[FigureSpec]| -> anyhow::Result<Vec<String>> {
        part.iter()
            .map(|spec| line_figure(spec).with_context(|| format!("drawing {}", spec.file)))
            .collect()
    };
    if specs.len() <= chunk {
        return draw(specs);
    }
    let parts: Vec<anyhow::Result<Vec<String>>> = std::thread::scope(|scope| {
        let handles: Vec<_> = specs
            .chunks(chunk)
            .map(|part| scope.spawn(move || draw(part)))
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow!("a figure-drawing thread panicked")))
            })
            .collect()
    });
    let mut out = Vec::with_capacity(specs.len());
    for part in parts {
        out.extend(part?);
    }
    Ok(out)
}

fn draw_legend<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    entries: &[(LegendMark, String)],
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let cols = legend_columns(entries);
    let col_width = (WIDTH as i32 - 76) / cols as i32;
    let font = (FONT, px(12.0)).into_font().color(&INK);
    for (i, (mark, label)) in entries.iter().enumerate() {
        let (row, col) = (i as i32 / cols as i32, i as i32 % cols as i32);
        let x = 76 + col * col_width;
        let y = 6 + row * LEGEND_LINE as i32 + LEGEND_LINE as i32 / 2;
        match mark {
            LegendMark::Line(c, marker, dash) => {
                let (size, spacing) = dash.pattern();
                let mut x0 = x;
                while x0 < x + 22 {
                    let x_end = (x0 + size as i32).min(x + 22);
                    area.draw(&PathElement::new(
                        vec![(x0, y), (x_end, y)],
                        c.stroke_width(2),
                    ))?;
                    x0 = x_end + spacing as i32;
                }
                let filled = c.filled();
                let at = (x + 11, y);
                match marker {
                    Marker::Circle => area.draw(&Circle::new(at, 4, filled))?,
                    Marker::Square => area.draw(&Rectangle::new(
                        [(at.0 - 4, at.1 - 4), (at.0 + 4, at.1 + 4)],
                        filled,
                    ))?,
                    Marker::Triangle => area.draw(&TriangleMarker::new(at, 5, filled))?,
                    Marker::Diamond => area.draw(&Polygon::new(
                        vec![
                            (at.0, at.1 - 5),
                            (at.0 + 5, at.1),
                            (at.0, at.1 + 5),
                            (at.0 - 5, at.1),
                        ],
                        filled,
                    ))?,
                }
            }
            LegendMark::Cross(c) => {
                area.draw(&Cross::new((x + 10, y), 5, c.stroke_width(2)))?;
            }
            LegendMark::Dashed => {
                for k in 0..2 {
                    area.draw(&PathElement::new(
                        vec![(x + k * 12, y), (x + k * 12 + 7, y)],
                        INK.stroke_width(1),
                    ))?;
                }
            }
        }
        area.draw(&Text::new(
            label.clone(),
            (x + 28, y),
            font.pos(Pos::new(HPos::Left, VPos::Center)),
        ))?;
    }
    Ok(())
}

/// x range of the At a glance chart: every ratio, whisker end, 1, and at least 0.5 to 2, so both
/// sides of 1 ("alternative faster", "default faster") carry a tick whatever the data; with room
/// beyond the extremes.
pub fn glance_bounds(chart: &GlanceChart) -> (f64, f64) {
    let values = chart
        .bars
        .iter()
        .flat_map(|b| match b.outcome {
            BarOutcome::Ratio { ratio, range } => {
                [Some(ratio), range.map(|r| r.0), range.map(|r| r.1)]
            }
            BarOutcome::DefaultInaccurate => [None, None, None],
        })
        .flatten()
        .filter(|v| v.is_finite() && *v > 0.0)
        .chain([0.5, 1.0, 2.0]);
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for v in values {
        lo = lo.min(v);
        hi = hi.max(v);
    }
    // At least a factor 1.25 of room beyond the extremes, and 15 % of the span.
    let span = (hi / lo).ln();
    let pad = (0.15 * span).max(1.25f64.ln());
    ((lo.ln() - pad).exp(), (hi.ln() + pad).exp())
}

/// Width of the At a glance chart, px: it fits a phone's screen scrolled once at most.
pub const GLANCE_WIDTH: u32 = 720;
/// Height of one bar's slot with a one-line label (the label above, the bar below), px.
const GLANCE_SLOT: u32 = 46;
/// Height of each further label line, px: a label too long for the chart's width wraps at its
/// commas, and every slot grows by this much per extra line of the longest label.
const GLANCE_LINE: u32 = 16;
/// Most label lines: the label of a case has a dozen parameters at most.
const GLANCE_MAX_LINES: usize = 3;

/// Shortest bar of the glance chart, px (a ratio within a few per cent of 1 would otherwise be
/// a sliver whose colour cannot be seen).
pub const GLANCE_MIN_BAR: i32 = 20;

/// Where [`glance_chart`] puts things, px.
struct GlanceLayout {
    width: u32,
    height: u32,
    title_lines: Vec<String>,
    /// Above the plot: the title and a gap.
    top: u32,
    /// Each bar's label, wrapped to the plot's width (at most [`GLANCE_MAX_LINES`] lines).
    labels: Vec<Vec<String>>,
    /// The most lines a label takes (at least 1).
    label_lines: usize,
    /// One bar's height with its label.
    slot: u32,
    plot_height: u32,
}

fn glance_layout(chart_spec: &GlanceChart) -> GlanceLayout {
    let n = chart_spec.bars.len();
    let width = GLANCE_WIDTH;
    let title_lines = wrap(&chart_spec.title, (width as usize - 24) / 8);
    let top = 16 + 20 * title_lines.len() as u32 + 22;
    let legend_height = 2 * LEGEND_LINE + 8;
    // Bar labels at 13 px, wrapped to the plot's width.
    let label_chars = ((width - 48) as f64 / (13.0 * 0.55)) as usize;
    let labels: Vec<Vec<String>> = chart_spec
        .bars
        .iter()
        .map(|b| {
            let mut lines = wrap(&b.label, label_chars);
            lines.truncate(GLANCE_MAX_LINES);
            lines
        })
        .collect();
    let label_lines = labels.iter().map(Vec::len).max().unwrap_or(1).max(1);
    let slot = GLANCE_SLOT + GLANCE_LINE * (label_lines as u32 - 1);
    let plot_height = slot * n as u32 + 44;
    GlanceLayout {
        width,
        height: top + plot_height + legend_height + 8,
        title_lines,
        top,
        labels,
        label_lines,
        slot,
        plot_height,
    }
}

/// The size [`glance_chart`] draws `chart` at, px (width, height): the `<img>`'s attributes.
pub fn glance_size(chart: &GlanceChart) -> (u32, u32) {
    let l = glance_layout(chart);
    (l.width, l.height)
}

/// The size [`line_figure`] draws `spec` at, px (width, height).
pub fn line_figure_size(spec: &FigureSpec) -> (u32, u32) {
    (WIDTH, line_figure_height(spec))
}

/// The size [`tile_chart`] draws `spec` at, px (width, height).
pub fn tile_size(spec: &TileChart) -> (u32, u32) {
    (WIDTH, tile_layout(spec).2)
}

/// [`tile_chart`]'s title lines, the height above its plot and the whole height, px.
fn tile_layout(spec: &TileChart) -> (Vec<String>, u32, u32) {
    let n = spec.bars.len().max(1);
    let title_lines = wrap(&spec.title, (WIDTH as usize - 24) / 8);
    let top = 12 + 20 * title_lines.len() as u32;
    let plot_height = TILE_SLOT * n as u32 + 56;
    (title_lines, top, top + plot_height + 8)
}

/// Draws the At a glance chart: per representative comparison, its label on a line of its own
/// and below it a horizontal bar from 1 to the ratio (at least [`GLANCE_MIN_BAR`] px long) on a
/// log x axis whose range comes from the data and holds 1 (green where the default is faster, red where the alternative is), a
/// whisker over the ratio's range from both interquartile ranges, or a cross where the default
/// is inaccurate; a vertical line at 1; a legend saying what colours, whiskers and crosses
/// mean.
pub fn glance_chart(chart_spec: &GlanceChart) -> anyhow::Result<String> {
    let n = chart_spec.bars.len();
    let GlanceLayout {
        width,
        height,
        title_lines,
        top,
        labels,
        label_lines,
        slot,
        plot_height,
    } = glance_layout(chart_spec);
    // Slot-relative positions (1 = one slot), from its top: label baselines, the bar's middle.
    let unit = |px: u32| f64::from(px) / f64::from(slot);
    let mut svg = String::new();
    {
        let err = plot_err(&chart_spec.file);
        let root = SVGBackend::with_string(&mut svg, (width, height)).into_drawing_area();
        root.fill(&PAPER).map_err(&err)?;
        draw_title_lines(&root, &title_lines).map_err(&err)?;
        let (plot_area, legend_area) = root.split_vertically(top + plot_height);
        let (lo, hi) = glance_bounds(chart_spec);
        let ticks = glance_ticks(lo, hi);
        let mut chart = ChartBuilder::on(&plot_area)
            .margin(12)
            .margin_top(top)
            .margin_right(24)
            .x_label_area_size(44)
            .y_label_area_size(8)
            .build_cartesian_2d((lo..hi).log_scale().with_key_points(ticks), 0f64..n as f64)
            .map_err(&err)?;
        chart
            .configure_mesh()
            .disable_y_mesh()
            .y_labels(0)
            .x_desc(chart_spec.words.axis.as_str())
            .x_label_formatter(&|x| tick_label(*x))
            .bold_line_style(GRID.mix(0.3))
            .light_line_style(TRANSPARENT)
            .axis_style(INK)
            .label_style((FONT, px(13.0)).into_font().color(&INK))
            .axis_desc_style((FONT, px(14.0)).into_font().color(&INK))
            .draw()
            .map_err(&err)?;
        // Which side means what, just above the plot on either side of 1.
        let (one_x, plot_top) = chart.backend_coord(&(1.0, n as f64));
        let side = (FONT, px(12.0)).into_font().color(&INK);
        root.draw(&Text::new(
            chart_spec.words.left.as_str(),
            (one_x - 8, plot_top - 6),
            side.pos(Pos::new(HPos::Right, VPos::Bottom)),
        ))
        .map_err(&err)?;
        root.draw(&Text::new(
            chart_spec.words.right.as_str(),
            (one_x + 8, plot_top - 6),
            side.pos(Pos::new(HPos::Left, VPos::Bottom)),
        ))
        .map_err(&err)?;
        let label_font = (FONT, px(13.0))
            .into_font()
            .color(&INK)
            .pos(Pos::new(HPos::Left, VPos::Bottom));
        for (i, b) in chart_spec.bars.iter().enumerate() {
            // The slot's lower part holds the bar, its upper part the label.
            let slot_top = n as f64 - i as f64;
            let y_mid = slot_top - unit(31 + GLANCE_LINE * (label_lines as u32 - 1));
            match b.outcome {
                BarOutcome::Ratio { ratio, range } => {
                    let colour = if ratio >= 1.0 {
                        DEFAULT_FASTER
                    } else {
                        ALTERNATIVE_FASTER
                    };
                    // From 1 to the ratio, never shorter than GLANCE_MIN_BAR px, so that a
                    // ratio near 1 still shows its colour (which side is faster); its value is
                    // in the bar's label.
                    let (x1, y_top) = chart.backend_coord(&(1.0, y_mid + unit(9)));
                    let (xr, y_bottom) = chart.backend_coord(&(ratio, y_mid - unit(9)));
                    let xr = if ratio >= 1.0 {
                        xr.max(x1 + GLANCE_MIN_BAR)
                    } else {
                        xr.min(x1 - GLANCE_MIN_BAR)
                    };
                    root.draw(&Rectangle::new(
                        [(x1.min(xr), y_top), (x1.max(xr), y_bottom)],
                        colour.filled(),
                    ))
                    .map_err(&err)?;
                    if let Some((low, high)) = range {
                        let cap = unit(6);
                        chart
                            .draw_series(
                                [
                                    vec![(low, y_mid), (high, y_mid)],
                                    vec![(low, y_mid - cap), (low, y_mid + cap)],
                                    vec![(high, y_mid - cap), (high, y_mid + cap)],
                                ]
                                .into_iter()
                                .map(|p| PathElement::new(p, INK.stroke_width(1))),
                            )
                            .map_err(&err)?;
                    }
                }
                BarOutcome::DefaultInaccurate => {
                    chart
                        .draw_series(std::iter::once(Cross::new(
                            (1.0, y_mid),
                            7,
                            ALTERNATIVE_FASTER.stroke_width(3),
                        )))
                        .map_err(&err)?;
                }
            }
            for (k, line) in labels[i].iter().enumerate() {
                let (px, py) =
                    chart.backend_coord(&(lo, slot_top - unit(14 + GLANCE_LINE * k as u32)));
                root.draw(&Text::new(line.clone(), (px + 4, py), label_font.clone()))
                    .map_err(&err)?;
            }
        }
        chart
            .draw_series(LineSeries::new(
                [(1.0, 0.0), (1.0, n as f64)],
                INK.stroke_width(2),
            ))
            .map_err(&err)?;
        draw_glance_legend(&legend_area, &chart_spec.words).map_err(&err)?;
        root.present().map_err(&err)?;
    }
    add_title_desc(&svg, &chart_spec.title, &chart_spec.desc)
}

/// The glance chart's legend: bar colours by who is faster, the whisker, the cross.
fn draw_glance_legend<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    words: &RatioWords,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let font = (FONT, px(12.0)).into_font().color(&INK);
    let row = |i: i32| 6 + i * LEGEND_LINE as i32 + LEGEND_LINE as i32 / 2;
    let entries: [(i32, i32, &str); 4] = [
        (0, 20, words.above.as_str()),
        (0, 370, words.below.as_str()),
        (1, 20, "whisker: range from both implementations' quartiles"),
        (1, 480, "default inaccurate"),
    ];
    let shown = if words.crosses { 4 } else { 3 };
    for (k, (line, x, label)) in entries.into_iter().take(shown).enumerate() {
        let y = row(line);
        match k {
            0 | 1 => {
                let c = if k == 0 {
                    DEFAULT_FASTER
                } else {
                    ALTERNATIVE_FASTER
                };
                area.draw(&Rectangle::new([(x, y - 5), (x + 22, y + 5)], c.filled()))?;
            }
            2 => {
                for seg in [
                    vec![(x, y), (x + 22, y)],
                    vec![(x, y - 4), (x, y + 4)],
                    vec![(x + 22, y - 4), (x + 22, y + 4)],
                ] {
                    area.draw(&PathElement::new(seg, INK.stroke_width(1)))?;
                }
            }
            _ => {
                area.draw(&Cross::new(
                    (x + 11, y),
                    6,
                    ALTERNATIVE_FASTER.stroke_width(3),
                ))?;
            }
        }
        area.draw(&Text::new(
            label,
            (x + 30, y),
            font.clone().pos(Pos::new(HPos::Left, VPos::Center)),
        ))?;
    }
    Ok(())
}

fn glance_ticks(lo: f64, hi: f64) -> Vec<f64> {
    let mut t = log_ticks(lo, hi);
    if !t.contains(&1.0) {
        t.push(1.0);
        t.sort_by(f64::total_cmp);
    }
    t
}

/// Draws a bar chart's wrapped title, 20 px per line from the top left.
fn draw_title_lines<DB: DrawingBackend>(
    root: &DrawingArea<DB, plotters::coord::Shift>,
    lines: &[String],
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    for (i, line) in lines.iter().enumerate() {
        root.draw(&Text::new(
            line.clone(),
            (12, 8 + 20 * i as i32),
            (FONT, px(15.0)).into_font().color(&INK),
        ))?;
    }
    Ok(())
}

/// Height of one bar's slot in a tile sweep chart, px.
const TILE_SLOT: u32 = 26;

/// The x range of a tile sweep chart: 0 to a round tick above every value and whisker end.
pub fn tile_bounds(chart: &TileChart) -> f64 {
    let hi = chart
        .bars
        .iter()
        .flat_map(|b| [b.value, b.range.map(|r| r.1)])
        .flatten()
        .filter(|v| v.is_finite() && *v > 0.0)
        .fold(0.0f64, f64::max);
    if hi <= 0.0 {
        return 1.0;
    }
    let ticks = linear_ticks(hi * 1.12);
    ticks
        .last()
        .copied()
        .filter(|t| *t >= hi)
        .unwrap_or(hi * 1.12)
}

/// Draws a tile sweep chart: one horizontal bar per configuration on a linear axis from 0,
/// labelled with the configuration's name on the left and its value at the bar's end; the
/// default's bar in [`DEFAULT_FASTER`] and labelled `(default)`, the others grey; a whisker
/// over the interquartile range; a configuration that did not run shows its status instead of
/// a bar.
pub fn tile_chart(spec: &TileChart) -> anyhow::Result<String> {
    let n = spec.bars.len().max(1);
    let width = WIDTH;
    let (title_lines, top, height) = tile_layout(spec);
    let label_width = spec
        .bars
        .iter()
        .map(|b| text_width(&format!("{} (default)", b.label), 13.0))
        .max()
        .unwrap_or(60)
        + 16;
    let mut svg = String::new();
    {
        let err = plot_err(&spec.file);
        let root = SVGBackend::with_string(&mut svg, (width, height)).into_drawing_area();
        root.fill(&PAPER).map_err(&err)?;
        draw_title_lines(&root, &title_lines).map_err(&err)?;
        let hi = tile_bounds(spec);
        let ticks = linear_ticks(hi);
        let (_, plot_area) = root.split_vertically(top);
        let mut chart = ChartBuilder::on(&plot_area)
            .margin(12)
            .margin_right(56)
            .x_label_area_size(44)
            .y_label_area_size(label_width)
            .build_cartesian_2d(0f64..hi, 0f64..n as f64)
            .map_err(&err)?;
        chart
            .configure_mesh()
            .disable_y_mesh()
            .y_labels(0)
            .x_labels(ticks.len())
            .x_desc(spec.x_label.clone())
            .x_label_formatter(&|x| tick_label(*x))
            .bold_line_style(GRID.mix(0.3))
            .light_line_style(TRANSPARENT)
            .axis_style(INK)
            .label_style((FONT, px(13.0)).into_font().color(&INK))
            .axis_desc_style((FONT, px(13.0)).into_font().color(&INK))
            .draw()
            .map_err(&err)?;
        let label_font = (FONT, px(13.0)).into_font().color(&INK);
        for (i, b) in spec.bars.iter().enumerate() {
            let y_mid = n as f64 - i as f64 - 0.5;
            let (x0, y0) = chart.backend_coord(&(0.0, y_mid));
            let name = if b.is_default {
                format!("{} (default)", b.label)
            } else {
                b.label.clone()
            };
            root.draw(&Text::new(
                name,
                (x0 - 8, y0),
                label_font.clone().pos(Pos::new(HPos::Right, VPos::Center)),
            ))
            .map_err(&err)?;
            match b.value {
                Some(v) => {
                    let colour = if b.is_default { DEFAULT_FASTER } else { GRID };
                    chart
                        .draw_series(std::iter::once(Rectangle::new(
                            [(0.0, y_mid - 0.32), (v, y_mid + 0.32)],
                            colour.filled(),
                        )))
                        .map_err(&err)?;
                    let mut end = v;
                    if let Some((lo, hi)) = b.range {
                        end = end.max(hi);
                        chart
                            .draw_series(
                                [
                                    vec![(lo, y_mid), (hi, y_mid)],
                                    vec![(lo, y_mid - 0.2), (lo, y_mid + 0.2)],
                                    vec![(hi, y_mid - 0.2), (hi, y_mid + 0.2)],
                                ]
                                .into_iter()
                                .map(|p| PathElement::new(p, INK.stroke_width(1))),
                            )
                            .map_err(&err)?;
                    }
                    let (ex, ey) = chart.backend_coord(&(end, y_mid));
                    root.draw(&Text::new(
                        super::format::sig(v, 4),
                        (ex + 6, ey),
                        label_font.clone().pos(Pos::new(HPos::Left, VPos::Center)),
                    ))
                    .map_err(&err)?;
                }
                None => {
                    root.draw(&Text::new(
                        b.status.clone().unwrap_or_else(|| "not measured".into()),
                        (x0 + 6, y0),
                        label_font.clone().pos(Pos::new(HPos::Left, VPos::Center)),
                    ))
                    .map_err(&err)?;
                }
            }
        }
        root.present().map_err(&err)?;
    }
    add_title_desc(&svg, &spec.title, &spec.desc)
}

/// A one-line summary of a figure's legend for tests and debugging (not drawn).
pub fn legend_text(spec: &FigureSpec) -> String {
    let mut s = String::new();
    for (_, label) in legend_entries(spec) {
        let _ = writeln!(s, "{label}");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::site::model::{GlanceBar, Series};

    #[test]
    fn title_and_style_go_after_root() {
        let s = add_title_desc("<?xml?><svg a=\"1\"><rect/></svg>", "T<", "D").unwrap();
        assert!(
            s.starts_with("<?xml?><svg a=\"1\">\n<title>T&lt;</title>\n<desc>D</desc>\n<style>"),
            "{s}"
        );
        assert!(s.ends_with("</style><rect/></svg>"), "{s}");
    }

    #[test]
    fn log_ticks_are_round_and_few() {
        assert_eq!(log_ticks(0.015, 250.0), vec![0.1, 1.0, 10.0, 100.0]);
        assert_eq!(log_ticks(0.3, 3.0), vec![0.5, 1.0, 2.0]);
        assert_eq!(log_ticks(0.6, 1.4), vec![0.6, 0.7, 0.8, 1.0, 1.2]);
        assert_eq!(tick_label(0.5), "0.5");
        assert_eq!(tick_label(16384.0), "16384");
        assert_eq!(tick_label(0.0002), "2e-4");
        assert_eq!(tick_label(0.015), "0.015");
    }

    #[test]
    fn glance_range_holds_one_with_room_on_both_sides() {
        let chart = GlanceChart {
            file: "g.svg".into(),
            title: "t".into(),
            desc: "d".into(),
            words: RatioWords::glance(),
            bars: vec![
                GlanceBar {
                    label: "a".into(),
                    outcome: BarOutcome::Ratio {
                        ratio: 0.4,
                        range: Some((0.35, 0.45)),
                    },
                },
                GlanceBar {
                    label: "b".into(),
                    outcome: BarOutcome::DefaultInaccurate,
                },
            ],
        };
        let (lo, hi) = glance_bounds(&chart);
        assert!(lo < 0.35 && hi > 1.0 * 1.2, "{lo} {hi}");
        let t = glance_ticks(lo, hi);
        // Every ratio below 1, yet the "default faster" side still has a tick.
        assert!(
            t.contains(&1.0) && t.iter().any(|v| *v < 1.0) && t.iter().any(|v| *v > 1.0),
            "{t:?}"
        );
        let svg = glance_chart(&chart).unwrap();
        for words in [
            "default faster",
            "alternative faster",
            "quartiles",
            "default inaccurate",
        ] {
            assert!(svg.contains(words), "legend lacks {words}");
        }
    }

    #[test]
    fn legend_names_each_status() {
        let spec = FigureSpec {
            file: "f.svg".into(),
            title: "t".into(),
            desc: "d".into(),
            x_label: "seq_len".into(),
            y_label: "y".into(),
            series: vec![Series {
                name: "math".into(),
                colour: "#f28e2b".into(),
                marker: Marker::Square,
                dash: Dash::Dashed,
                emphasis: false,
                points: vec![(512.0, 1.0)],
                failed: vec![(4096.0, "oom".into()), (8192.0, "oom".into())],
            }],
            reference_lines: vec![(0.01, "tolerance 1.00e-2".into())],
            log_y: true,
        };
        assert_eq!(
            legend_text(&spec),
            "math\nmath: did not run: oom at seq_len 4096, 8192\ntolerance 1.00e-2\n"
        );
        let svg = line_figure(&spec).unwrap();
        assert!(svg.contains("<title>t</title>"));
        let linear = line_figure(&FigureSpec {
            log_y: false,
            ..spec
        })
        .unwrap();
        assert!(linear.contains("<title>t</title>"));
    }

    #[test]
    fn linear_ticks_are_round_and_cover_the_top() {
        assert_eq!(
            linear_ticks(330.0),
            vec![0.0, 50.0, 100.0, 150.0, 200.0, 250.0, 300.0]
        );
        assert_eq!(linear_ticks(1.0), vec![0.0, 0.2, 0.4, 0.6, 0.8, 1.0]);
        assert_eq!(linear_ticks(0.0), vec![0.0]);
    }
}
