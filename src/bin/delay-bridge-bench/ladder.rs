//! Hops per delay for every preset (and the configured ladder), over delays uniform on
//! [1 s, 30 d] and [1 s, 1 y]. Pure computation with the bridge's own planner: no broker,
//! so no baseline; the presets are each other's comparison (rocketmq's 18 fixed levels and
//! the NServiceBus-style binary tiers against the default clock ladder).

use std::time::Duration;

use anyhow::Result;
use serde_json::json;

use delay_bridge::config::Config;
use delay_bridge::ladder::{Ladder, PRESETS, format_duration};
use delay_bridge::plan::hop_stats;

use super::{Target, print_targets, targets_json};

/// `bench ladder` options.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Delays per range, evenly spaced (the uniform distribution's mean without sampling
    /// noise).
    #[arg(long, default_value_t = 200_000)]
    samples: u32,
}

/// Target of the performance table (docs/performance.md): mean hops over [1 s, 30 d] with the default ladder.
const MEAN_HOPS_TARGET: f64 = 4.0;

const DAY: u64 = 86_400;

pub fn run(base: &Config, args: &Args) -> Result<()> {
    let ranges = [("30d", 30 * DAY), ("1y", 365 * DAY)];
    let mut ladders: Vec<(String, Ladder)> = PRESETS
        .iter()
        .map(|p| (p.to_string(), Ladder::preset(p).expect("presets are valid")))
        .collect();
    if !ladders.iter().any(|(_, l)| *l == base.ladder) {
        ladders.push(("configured".into(), base.ladder.clone()));
    }
    println!(
        "ladder: hops per delay, {} delays evenly spaced on each range, margin {} (pure computation, no broker)",
        args.samples,
        format_duration(base.margin)
    );
    println!(
        "{:<12} {:>7} {:>14} {:>14} {:>14} {:>14}",
        "ladder", "levels", "mean [1s,30d]", "worst [1s,30d]", "mean [1s,1y]", "worst [1s,1y]"
    );
    let mut rows = Vec::new();
    let mut default_mean = f64::INFINITY;
    for (name, ladder) in &ladders {
        let stats: Vec<_> = ranges
            .iter()
            .map(|(_, to)| {
                hop_stats(
                    ladder,
                    base.margin,
                    Duration::from_secs(1),
                    Duration::from_secs(*to),
                    args.samples,
                )
            })
            .collect();
        println!(
            "{:<12} {:>7} {:>14.2} {:>14} {:>14.2} {:>14}",
            name,
            ladder.levels().len(),
            stats[0].mean,
            stats[0].worst,
            stats[1].mean,
            stats[1].worst
        );
        if name == "default" {
            default_mean = stats[0].mean;
        }
        rows.push(json!({
            "ladder": name, "levels": ladder.levels().len(),
            "ranges": ranges.iter().zip(&stats).map(|((range, _), s)| json!({
                "range": format!("[1s,{range}]"), "mean_hops": s.mean, "worst_hops": s.worst,
            })).collect::<Vec<_>>(),
        }));
    }
    let targets = [Target::new(
        format!("default ladder mean hops <= {MEAN_HOPS_TARGET} over [1s,30d]"),
        format!("{default_mean:.2}"),
        default_mean <= MEAN_HOPS_TARGET,
    )];
    print_targets(&targets);
    println!(
        "{}",
        json!({
            "scenario": "ladder",
            "bridge": "none (pure computation)",
            "baseline": null,
            "margin_ms": base.margin.as_millis() as u64,
            "samples": args.samples,
            "ladders": rows,
            "targets": targets_json(&targets),
        })
    );
    Ok(())
}
