//! The soak's per-minute figures as an SVG picture: the small messages' lateness (p50,
//! p99, max; log scale), the CPU per message of the broker and the bridge, and the bridge's
//! RSS (without the bridge's lines when the plugin carried the delays).

use std::path::Path;

use anyhow::{Result, anyhow};
use plotters::coord::ranged1d::ValueFormatter;
use plotters::coord::types::RangedCoordf64;
use plotters::coord::{CoordTranslate, Shift};
use plotters::prelude::*;

use super::minutes::{CostMinute, DueMinute};

/// One line of a panel: its name, colour and points (minute, value).
type Line = (&'static str, RGBColor, Vec<(f64, f64)>);

/// A quantile of the lateness panel: its name, colour, and where it is in a spread (µs).
type Quantile = (&'static str, RGBColor, fn(&crate::Spread) -> i64);

/// Draws the picture into `path`, titled `title`; the bridge's CPU and RSS only when
/// `bridged` (a bridge carried the delays).
pub fn draw(
    path: &Path,
    title: &str,
    due: &[DueMinute],
    cost: &[CostMinute],
    bridged: bool,
) -> Result<()> {
    let fail = |e: &dyn std::fmt::Display| anyhow!("drawing {}: {e}", path.display());
    let root = SVGBackend::new(path, (960, 900)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| fail(&e))?;
    let root = root
        .titled(title, ("sans-serif", 18))
        .map_err(|e| fail(&e))?;
    let panels = root.split_evenly((3, 1));
    let minutes = 0.5..(due.len().max(cost.len()).max(1) as f64 + 0.5);

    let quantiles: [Quantile; 3] = [
        ("p50", BLUE, |s| s.p50),
        ("p99", RED, |s| s.p99),
        ("max", BLACK, |s| s.max),
    ];
    let lateness: Vec<Line> = quantiles
        .iter()
        .map(|(name, color, of)| {
            let points = due
                .iter()
                .filter_map(|m| Some((m.minute as f64, (of(&m.small?) as f64 / 1000.0).max(0.01))))
                .collect();
            (*name, *color, points)
        })
        .collect();
    let top = highest(&lateness, 10.0) * 2.0;
    let chart = ChartBuilder::on(&panels[0])
        .caption(
            "lateness of small messages by minute due (ms, log)",
            ("sans-serif", 15),
        )
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d(minutes.clone(), (0.01..top).log_scale())
        .map_err(|e| fail(&e))?;
    lines(chart, "ms", &lateness).map_err(|e| fail(&e))?;

    let mut cpu = vec![
        (
            "broker",
            RED,
            cost.iter()
                .filter_map(|c| Some((c.minute as f64, c.broker_us?)))
                .collect(),
        ),
        (
            "bridge",
            BLUE,
            cost.iter()
                .map(|c| (c.minute as f64, c.bridge_us))
                .collect(),
        ),
    ];
    let mut rss = vec![(
        "bridge RSS",
        GREEN,
        cost.iter()
            .map(|c| (c.minute as f64, c.bridge_rss as f64 / (1024.0 * 1024.0)))
            .collect(),
    )];
    let mut rss_caption = "bridge RSS at the end of each minute (MiB)";
    if !bridged {
        cpu.truncate(1);
        rss.clear();
        rss_caption = "no bridge: the plugin carried the delays";
    }
    linear(
        &panels[1],
        "CPU per message published in the minute (us)",
        "us",
        minutes.clone(),
        &cpu,
    )
    .map_err(|e| fail(&e))?;

    linear(&panels[2], rss_caption, "MiB", minutes, &rss).map_err(|e| fail(&e))?;
    root.present().map_err(|e| fail(&e))?;
    Ok(())
}

/// The highest value of `lines`, at least `floor`.
fn highest(lines: &[Line], floor: f64) -> f64 {
    lines
        .iter()
        .flat_map(|(_, _, points)| points.iter().map(|(_, v)| *v))
        .fold(floor, f64::max)
}

/// A panel on a linear scale from 0 to a little above the highest value.
fn linear(
    area: &DrawingArea<SVGBackend<'_>, Shift>,
    caption: &str,
    unit: &str,
    minutes: std::ops::Range<f64>,
    series: &[Line],
) -> Result<(), Box<dyn std::error::Error>> {
    let chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 15))
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d(minutes, 0.0..highest(series, 16.0) * 1.2)?;
    lines(chart, unit, series)
}

/// Draws the mesh, `series` and their legend on `chart`.
fn lines<'a, Y>(
    mut chart: ChartContext<'a, SVGBackend<'a>, Cartesian2d<RangedCoordf64, Y>>,
    unit: &str,
    series: &[Line],
) -> Result<(), Box<dyn std::error::Error>>
where
    Y: Ranged<ValueType = f64> + ValueFormatter<f64>,
    Cartesian2d<RangedCoordf64, Y>: CoordTranslate<From = (f64, f64)>,
{
    chart
        .configure_mesh()
        .x_desc("minute")
        .y_desc(unit)
        .draw()?;
    for (name, color, points) in series {
        let color = *color;
        chart
            .draw_series(LineSeries::new(points.iter().copied(), color))?
            .label(*name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
    }
    chart
        .configure_series_labels()
        .border_style(BLACK)
        .background_style(WHITE)
        .draw()?;
    Ok(())
}
