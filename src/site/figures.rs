//! Draws the model's figures as SVG strings with Plotters; nothing here touches the disk.
//!
//! Each SVG gets a `<title>` and `<desc>` (inserted after the root element, which Plotters
//! does not write) so screen readers and text browsers can read it.

use anyhow::{anyhow, Context as _};
use plotters::prelude::*;

use super::model::{FigureSpec, GlanceChart};

const WIDTH: u32 = 720;
const HEIGHT: u32 = 420;

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

/// Inserts `<title>` and `<desc>` right after the opening `<svg ...>` tag.
pub fn add_title_desc(svg: &str, title: &str, desc: &str) -> anyhow::Result<String> {
    let start = svg.find("<svg").context("SVG has no <svg> element")?;
    let end = svg[start..]
        .find('>')
        .context("SVG root element is not closed")?
        + start
        + 1;
    Ok(format!(
        "{}\n<title>{}</title>\n<desc>{}</desc>{}",
        &svg[..end],
        xml_escape(title),
        xml_escape(desc),
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

/// Draws a time-against-x figure: log-log, one line with markers per implementation, a cross
/// at the top of the plot for each case that did not run.
pub fn line_figure(spec: &FigureSpec) -> anyhow::Result<String> {
    let mut svg = String::new();
    {
        let err = plot_err(&spec.file);
        let root = SVGBackend::with_string(&mut svg, (WIDTH, HEIGHT)).into_drawing_area();
        root.fill(&WHITE).map_err(&err)?;
        let xs = spec.series.iter().flat_map(|s| {
            s.points
                .iter()
                .map(|p| p.0)
                .chain(s.failed.iter().map(|f| f.0))
        });
        let (x0, x1) = log_bounds(xs, 1.15);
        let (y0, y1) = log_bounds(
            spec.series
                .iter()
                .flat_map(|s| s.points.iter().map(|p| p.1)),
            1.6,
        );
        let mut chart = ChartBuilder::on(&root)
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d((x0..x1).log_scale(), (y0..y1).log_scale())
            .map_err(&err)?;
        chart
            .configure_mesh()
            .x_desc(spec.x_label.as_str())
            .y_desc("median time (ms)")
            .x_label_formatter(&|x| format!("{x:.0}"))
            .y_label_formatter(&|y| super::format::sig(*y, 2))
            .draw()
            .map_err(&err)?;
        for s in &spec.series {
            let colour = rgb(&s.colour);
            if !s.points.is_empty() {
                chart
                    .draw_series(LineSeries::new(
                        s.points.iter().copied(),
                        colour.stroke_width(2),
                    ))
                    .map_err(&err)?
                    .label(s.name.as_str())
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 16, y)], colour.stroke_width(2))
                    });
                chart
                    .draw_series(s.points.iter().map(|p| Circle::new(*p, 3, colour.filled())))
                    .map_err(&err)?;
            }
            if !s.failed.is_empty() {
                let statuses: Vec<String> = s
                    .failed
                    .iter()
                    .map(|(x, st)| format!("{st} at {x}"))
                    .collect();
                let label = format!("{}: {}", s.name, statuses.join(", "));
                chart
                    .draw_series(
                        s.failed
                            .iter()
                            .map(|(x, _)| Cross::new((*x, y1 / 1.12), 6, colour.stroke_width(2))),
                    )
                    .map_err(&err)?
                    .label(label)
                    .legend(move |(x, y)| Cross::new((x + 8, y), 5, colour.stroke_width(2)));
            }
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.4))
            .position(SeriesLabelPosition::LowerRight)
            .draw()
            .map_err(&err)?;
        root.present().map_err(&err)?;
    }
    add_title_desc(&svg, &spec.title, &spec.desc)
}

/// Draws the At a glance chart: horizontal bars from 1 to each ratio on a log x axis, a
/// vertical line at 1, each bar labelled.
pub fn glance_chart(chart_spec: &GlanceChart) -> anyhow::Result<String> {
    let n = chart_spec.bars.len();
    let height = (80 + 34 * n as u32).max(160);
    let mut svg = String::new();
    {
        let err = plot_err(&chart_spec.file);
        let root = SVGBackend::with_string(&mut svg, (WIDTH + 240, height)).into_drawing_area();
        root.fill(&WHITE).map_err(&err)?;
        let (mut lo, mut hi) =
            log_bounds(chart_spec.bars.iter().map(|b| b.ratio).chain([1.0]), 1.0);
        // Symmetric, with room for the labels on the right.
        let span = (hi.ln().abs()).max(lo.ln().abs()).max(2f64.ln());
        lo = (-span * 1.2).exp();
        hi = (span * 1.2).exp();
        let mut chart = ChartBuilder::on(&root)
            .margin(12)
            .margin_top(28)
            .x_label_area_size(40)
            .y_label_area_size(10)
            .build_cartesian_2d((lo..hi * 3.0).log_scale(), 0f64..n as f64)
            .map_err(&err)?;
        root.draw(&Text::new(
            chart_spec.title.clone(),
            (12, 4),
            ("sans-serif", 14).into_font().color(&BLACK),
        ))
        .map_err(&err)?;
        chart
            .configure_mesh()
            .disable_y_mesh()
            .disable_y_axis()
            .x_desc("fastest accurate alternative time ÷ default time (right of 1: default faster)")
            .x_label_formatter(&|x| super::format::sig(*x, 2))
            .draw()
            .map_err(&err)?;
        let faster = RGBColor(0x59, 0xa1, 0x4f);
        let slower = RGBColor(0xe1, 0x57, 0x59);
        for (i, b) in chart_spec.bars.iter().enumerate() {
            let y_top = n as f64 - i as f64 - 0.2;
            let y_bottom = n as f64 - i as f64 - 0.8;
            let colour = if b.ratio >= 1.0 { faster } else { slower };
            chart
                .draw_series(std::iter::once(Rectangle::new(
                    [(1.0, y_bottom), (b.ratio, y_top)],
                    colour.filled(),
                )))
                .map_err(&err)?;
            let x_text = b.ratio.max(1.0) * 1.05;
            chart
                .draw_series(std::iter::once(Text::new(
                    b.label.clone(),
                    (x_text, y_top - 0.15),
                    ("sans-serif", 13).into_font().color(&BLACK),
                )))
                .map_err(&err)?;
        }
        chart
            .draw_series(LineSeries::new(
                [(1.0, 0.0), (1.0, n as f64)],
                BLACK.stroke_width(1),
            ))
            .map_err(&err)?;
        root.present().map_err(&err)?;
    }
    add_title_desc(&svg, &chart_spec.title, &chart_spec.desc)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn title_goes_after_root() {
        let s = add_title_desc("<?xml?><svg a=\"1\"><rect/></svg>", "T<", "D").unwrap();
        assert_eq!(
            s,
            "<?xml?><svg a=\"1\">\n<title>T&lt;</title>\n<desc>D</desc><rect/></svg>"
        );
    }
}
