//! The `plan` and `ladders` commands: what the planner does with one delay, and how ladders
//! compare. Neither needs a broker; both read the configuration leniently.

use std::fmt::Write as _;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, bail};

use delay_bridge::config::{RawConfig, defaults};
use delay_bridge::ladder::{Ladder, PRESETS, format_duration};
use delay_bridge::plan::{Step, hop_count, hop_stats, plan};

/// What a plan is made with: flags win, then the config file if it exists, then the
/// defaults.
pub struct PlanSettings {
    /// The levels.
    pub ladder: Ladder,
    /// How early the last hop lands.
    pub margin: Duration,
    /// The longest delay the bridge accepts (`delays.max_delay`); longer ones are parked.
    pub max_delay: Duration,
}

impl PlanSettings {
    /// Reads `config` if it exists (only the keys planning needs are checked), with `ladder`
    /// and `margin` from the command line on top.
    pub fn read(config: &Path, ladder: Option<&str>, margin: Option<Duration>) -> Result<Self> {
        let raw = if config.exists() {
            let text = std::fs::read_to_string(config)
                .with_context(|| format!("cannot read {}", config.display()))?;
            toml::from_str::<RawConfig>(&text)
                .with_context(|| format!("invalid configuration {}", config.display()))?
        } else {
            RawConfig::default()
        };
        let ladder_text = ladder
            .map(str::to_string)
            .or(raw.delays.ladder)
            .unwrap_or_else(|| defaults::LADDER.to_string());
        Ok(Self {
            ladder: Ladder::parse(&ladder_text).context("invalid ladder")?,
            margin: margin.or(raw.delays.margin).unwrap_or(defaults::MARGIN),
            max_delay: raw.delays.max_delay.unwrap_or(defaults::MAX_DELAY),
        })
    }
}

/// The plan of `delay` as `plan` prints it: each hop, the hold and the delivery, or, for a
/// delay longer than `max_delay`, that the bridge parks it. `ladder_name` names the ladder
/// in the first line.
pub fn render_plan(delay: Duration, ladder_name: &str, settings: &PlanSettings) -> String {
    let ladder = &settings.ladder;
    let mut out = format!(
        "plan for {} with the {ladder_name} ladder ({} levels, {} .. {}), margin {}:\n",
        format_duration(delay),
        ladder.levels().len(),
        format_duration(ladder.smallest()),
        format_duration(ladder.largest()),
        format_duration(settings.margin)
    );
    if delay > settings.max_delay {
        let _ = writeln!(
            out,
            "  {} is longer than delays.max_delay ({}): the bridge parks such a message as \
             `delay-too-long` and never delivers it",
            format_duration(delay),
            format_duration(settings.max_delay)
        );
        return out;
    }
    let steps = plan(delay, ladder, settings.margin);
    let mut elapsed = Duration::ZERO;
    let mut parts = Vec::new();
    for (i, step) in steps.iter().enumerate() {
        let _ = match step {
            Step::Hop(level) => {
                elapsed += *level;
                parts.push(format_duration(*level));
                writeln!(
                    out,
                    "  {:>2}. hop into level {:<10} due in {}",
                    i + 1,
                    format_duration(*level),
                    format_duration(delay - elapsed)
                )
            }
            Step::Hold(rest) => {
                elapsed += *rest;
                parts.push(format!("hold {}", format_duration(*rest)));
                writeln!(
                    out,
                    "  {:>2}. hold in the bridge {}",
                    i + 1,
                    format_duration(*rest)
                )
            }
            Step::Deliver => writeln!(out, "  {:>2}. deliver to the target", i + 1),
        };
    }
    let joined = if parts.is_empty() {
        "0ms".to_string()
    } else {
        parts.join(" + ")
    };
    let hops = hop_count(&steps);
    let _ = writeln!(
        out,
        "{} = {joined}  ({hops} hop{})",
        format_duration(delay),
        if hops == 1 { "" } else { "s" }
    );
    out
}

/// `ladders`: the presets and `extra` ladders, their mean and worst hops over delays spread
/// evenly on [1 s, `max`].
pub fn print_ladders(max: Duration, margin: Duration, extra: &[String]) -> Result<()> {
    if max < Duration::from_secs(1) {
        bail!("--max must be at least 1s");
    }
    let mut ladders: Vec<(String, Ladder)> = PRESETS
        .iter()
        .map(|p| (p.to_string(), Ladder::preset(p).expect("presets are valid")))
        .collect();
    for text in extra {
        ladders.push((text.clone(), Ladder::parse(text)?));
    }
    println!(
        "hops over 200000 delays spread evenly on [1s, {}], margin {}:",
        format_duration(max),
        format_duration(margin)
    );
    println!(
        "{:<24} {:>7} {:>10} {:>12}",
        "ladder", "levels", "mean hops", "worst hops"
    );
    for (name, ladder) in ladders {
        let stats = hop_stats(&ladder, margin, Duration::from_secs(1), max, 200_000);
        println!(
            "{:<24} {:>7} {:>10.2} {:>12}",
            name,
            ladder.levels().len(),
            stats.mean,
            stats.worst
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(max_delay: Duration) -> PlanSettings {
        PlanSettings {
            ladder: Ladder::default_ladder(),
            margin: defaults::MARGIN,
            max_delay,
        }
    }

    const DAY: Duration = Duration::from_secs(86_400);

    #[test]
    fn a_delay_past_max_delay_is_shown_parked_not_planned() {
        let shown = render_plan(400 * DAY, "configured", &settings(366 * DAY));
        assert!(
            shown.contains("longer than delays.max_delay (366d)"),
            "{shown}"
        );
        assert!(shown.contains("`delay-too-long`"), "{shown}");
        assert!(!shown.contains("hop into"), "{shown}");
        assert!(!shown.contains("deliver to the target"), "{shown}");
    }

    #[test]
    fn a_delay_at_max_delay_is_planned_to_delivery() {
        let shown = render_plan(366 * DAY, "configured", &settings(366 * DAY));
        assert!(!shown.contains("delay-too-long"), "{shown}");
        assert!(shown.contains("hop into level 48d"), "{shown}");
        assert!(shown.contains("deliver to the target"), "{shown}");
    }

    #[test]
    fn a_plan_names_each_hop_the_hold_and_the_sum() {
        let shown = render_plan(Duration::from_millis(1_500), "default", &settings(DAY));
        assert!(shown.starts_with("plan for 1s500ms with the default ladder (189 levels"));
        assert!(
            shown.contains("   1. hop into level 1s         due in 500ms\n"),
            "{shown}"
        );
        assert!(
            shown.contains("   2. hold in the bridge 500ms\n"),
            "{shown}"
        );
        assert!(shown.contains("   3. deliver to the target\n"), "{shown}");
        assert!(
            shown.ends_with("1s500ms = 1s + hold 500ms  (1 hop)\n"),
            "{shown}"
        );
    }
}
