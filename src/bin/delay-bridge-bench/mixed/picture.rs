//! The soak's per-minute figures as an SVG picture: the small messages' lateness (p50,
//! p99, max; log scale), the CPU per message of the broker and the bridge, and the bridge's
//! RSS.

use std::path::Path;

use anyhow::{Result, anyhow};
use plotters::prelude::*;

use super::minutes::{CostMinute, DueMinute};

/// Draws the picture into `path`, titled `title`.
pub fn draw(path: &Path, title: &str, due: &[DueMinute], cost: &[CostMinute]) -> Result<()> {
    let fail = |e: &dyn std::fmt::Display| anyhow!("drawing {}: {e}", path.display());
    let root = SVGBackend::new(path, (960, 900)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| fail(&e))?;
    let root = root
        .titled(title, ("sans-serif", 18))
        .map_err(|e| fail(&e))?;
    let panels = root.split_evenly((3, 1));
    let minutes = due.len().max(cost.len()).max(1) as f64 + 0.5;

    let lateness: Vec<(f64, [f64; 3])> = due
        .iter()
        .filter_map(|m| {
            let s = m.small?;
            let ms = |us: i64| (us as f64 / 1000.0).max(0.01);
            Some((m.minute as f64, [ms(s.p50), ms(s.p99), ms(s.max)]))
        })
        .collect();
    let top = lateness.iter().map(|(_, v)| v[2]).fold(10.0_f64, f64::max) * 2.0;
    let mut chart = ChartBuilder::on(&panels[0])
        .caption(
            "lateness of small messages by minute due (ms, log)",
            ("sans-serif", 15),
        )
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d(0.5..minutes, (0.01..top).log_scale())
        .map_err(|e| fail(&e))?;
    chart
        .configure_mesh()
        .x_desc("minute")
        .y_desc("ms")
        .draw()
        .map_err(|e| fail(&e))?;
    for (i, (name, color)) in [("p50", BLUE), ("p99", RED), ("max", BLACK)]
        .into_iter()
        .enumerate()
    {
        chart
            .draw_series(LineSeries::new(
                lateness.iter().map(|(m, v)| (*m, v[i])),
                color,
            ))
            .map_err(|e| fail(&e))?
            .label(name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
    }
    chart
        .configure_series_labels()
        .border_style(BLACK)
        .background_style(WHITE)
        .draw()
        .map_err(|e| fail(&e))?;

    let cpu_top = cost
        .iter()
        .map(|c| c.broker_us.unwrap_or(0.0).max(c.bridge_us))
        .fold(100.0_f64, f64::max)
        * 1.2;
    let mut chart = ChartBuilder::on(&panels[1])
        .caption(
            "CPU per message published in the minute (us)",
            ("sans-serif", 15),
        )
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d(0.5..minutes, 0.0..cpu_top)
        .map_err(|e| fail(&e))?;
    chart
        .configure_mesh()
        .x_desc("minute")
        .y_desc("us")
        .draw()
        .map_err(|e| fail(&e))?;
    chart
        .draw_series(LineSeries::new(
            cost.iter()
                .filter_map(|c| Some((c.minute as f64, c.broker_us?))),
            RED,
        ))
        .map_err(|e| fail(&e))?
        .label("broker")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], RED));
    chart
        .draw_series(LineSeries::new(
            cost.iter().map(|c| (c.minute as f64, c.bridge_us)),
            BLUE,
        ))
        .map_err(|e| fail(&e))?
        .label("bridge")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE));
    chart
        .configure_series_labels()
        .border_style(BLACK)
        .background_style(WHITE)
        .draw()
        .map_err(|e| fail(&e))?;

    let mib = |bytes: u64| bytes as f64 / (1024.0 * 1024.0);
    let rss_top = cost
        .iter()
        .map(|c| mib(c.bridge_rss))
        .fold(16.0_f64, f64::max)
        * 1.2;
    let mut chart = ChartBuilder::on(&panels[2])
        .caption(
            "bridge RSS at the end of each minute (MiB)",
            ("sans-serif", 15),
        )
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d(0.5..minutes, 0.0..rss_top)
        .map_err(|e| fail(&e))?;
    chart
        .configure_mesh()
        .x_desc("minute")
        .y_desc("MiB")
        .draw()
        .map_err(|e| fail(&e))?;
    chart
        .draw_series(LineSeries::new(
            cost.iter().map(|c| (c.minute as f64, mib(c.bridge_rss))),
            GREEN,
        ))
        .map_err(|e| fail(&e))?;
    root.present().map_err(|e| fail(&e))?;
    Ok(())
}
