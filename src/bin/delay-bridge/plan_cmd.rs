//! The `plan` and `ladders` commands: the path the bridge takes with one delay under the
//! configuration, and how ladders compare. Neither needs a broker; both read the
//! configuration leniently.

use std::fmt::Write as _;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, bail};

use delay_bridge::config::{RawConfig, defaults, levels};
use delay_bridge::ladder::{Ladder, PRESETS, format_duration};
use delay_bridge::plan::decide::{Decision, Rules, Situation, decide};
use delay_bridge::plan::hop_stats;

use crate::output::outln;

/// What a plan is made with: flags win, then the config file if it exists, then the
/// defaults.
pub struct PlanSettings {
    /// The levels the bridge uses: the configured ladder, with the hop window's fine levels
    /// below its smallest level when hops are bundled (as the bridge declares them).
    pub ladder: Ladder,
    /// How early the last hop lands.
    pub margin: Duration,
    /// The longest delay the bridge accepts (`delays.max_delay`); longer ones are parked.
    pub max_delay: Duration,
    /// `bridge.hop_window`: hops wait for the next multiple of it (zero: none).
    pub hop_window: Duration,
    /// `bridge.bundle_hops` as the bridge reads it: the hops of one window into one level
    /// travel as one message.
    pub bundled: bool,
}

impl PlanSettings {
    /// Reads `config` if it exists (only the keys planning needs are checked, with the
    /// rules `check-config` applies to them), with `ladder` and `margin` from the command
    /// line on top.
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
        let (hop_window, bundled) = raw
            .bridge
            .hops()
            .with_context(|| format!("invalid configuration {}", config.display()))?;
        Ok(Self::new(
            Ladder::parse(&ladder_text).context("invalid ladder")?,
            margin.or(raw.delays.margin).unwrap_or(defaults::MARGIN),
            raw.delays.max_delay.unwrap_or(defaults::MAX_DELAY),
            hop_window,
            bundled,
        ))
    }

    /// Settings from a configured `ladder`: with bundles, the window's fine levels are
    /// added below its smallest level, as the bridge adds them.
    pub fn new(
        ladder: Ladder,
        margin: Duration,
        max_delay: Duration,
        hop_window: Duration,
        bundled: bool,
    ) -> Self {
        Self {
            ladder: levels(ladder, hop_window, bundled),
            margin,
            max_delay,
            hop_window,
            bundled,
        }
    }
}

/// One step of the path a message takes, as the bridge decides it (its carrier's planner),
/// on an ideal clock: each step takes no time but the waits it names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathStep {
    /// Wait in the bridge for the end of the hop window (this long), then hop.
    AwaitWindow(Duration),
    /// Into this level queue, alone or in the bundle of its window; back when its TTL ends.
    Hop {
        /// The level.
        level: Duration,
        /// In a bundle (`bridge.bundle_hops`).
        bundled: bool,
    },
    /// In its window's bundle to the returns queue, to wait out its last moments there.
    ToReturns,
    /// Held in the bridge for the rest of the delay.
    Hold(Duration),
    /// Published to the target.
    Deliver,
}

/// The path of a message with `delay`, read by a bridge at the start of a hop window: the
/// decision the bridge's carrier takes at each step (`plan::decide`, the same code), taken
/// again after each until the delivery, on an ideal clock where only waits take time.
pub fn path(delay: Duration, settings: &PlanSettings) -> Vec<PathStep> {
    let rules = Rules {
        ladder: &settings.ladder,
        margin: settings.margin,
        hop_window: settings.hop_window,
    };
    let no_window = settings.hop_window.is_zero();
    let mut situation = Situation {
        now_ms: 0,
        deliver_at: delay.as_millis() as u64,
        bundled: settings.bundled,
        in_window: no_window,
        waits_here: false,
        from_work: true,
    };
    // Consumed again at `now_ms` from the returns queue (`waits_here` unless it came in a
    // bundle back from a level), before its hop window.
    let consumed_again = |situation: Situation, now_ms: u64, waits_here: bool| Situation {
        now_ms,
        in_window: no_window,
        waits_here,
        from_work: false,
        ..situation
    };
    let mut steps = Vec::new();
    let wait_until = |steps: &mut Vec<PathStep>, now: u64, until: u64| {
        if until > now {
            steps.push(PathStep::AwaitWindow(Duration::from_millis(until - now)));
        }
    };
    loop {
        let now = situation.now_ms;
        match decide(&situation, &rules) {
            Decision::AwaitWindow(until) => {
                wait_until(&mut steps, now, until);
                situation.now_ms = until;
                situation.in_window = true;
            }
            Decision::Hop(level) => {
                steps.push(PathStep::Hop {
                    level,
                    bundled: false,
                });
                // Back through the returns queue, where its last moments are waited out.
                situation = consumed_again(situation, now + level.as_millis() as u64, true);
            }
            Decision::Bundle { level, leaves_at } => {
                wait_until(&mut steps, now, leaves_at);
                // Level zero is the returns queue; a bundle back from a level is read as a
                // bundle, so its messages may still go on to the returns queue.
                let to_returns = level.is_zero();
                steps.push(match to_returns {
                    true => PathStep::ToReturns,
                    false => PathStep::Hop {
                        level,
                        bundled: true,
                    },
                });
                situation =
                    consumed_again(situation, leaves_at + level.as_millis() as u64, to_returns);
            }
            Decision::Hold { .. } => {
                let due = situation.deliver_at;
                steps.push(PathStep::Hold(Duration::from_millis(
                    due.saturating_sub(now),
                )));
                situation.now_ms = due.max(now);
            }
            Decision::Deliver => {
                steps.push(PathStep::Deliver);
                return steps;
            }
        }
    }
}

/// How many level hops a path takes (the trip to the returns queue is not one).
pub fn path_hops(steps: &[PathStep]) -> usize {
    steps
        .iter()
        .filter(|s| matches!(s, PathStep::Hop { .. }))
        .count()
}

/// The plan of `delay` as `plan` prints it: each hop (and whether it travels in a bundle),
/// the trip to the returns queue, the hold and the delivery, or, for a delay longer than
/// `max_delay`, that the bridge parks it. `ladder_name` names the ladder in the first line.
pub fn render_plan(delay: Duration, ladder_name: &str, settings: &PlanSettings) -> String {
    let ladder = &settings.ladder;
    let mut out = format!(
        "plan for {} with the {ladder_name} ladder ({} levels, {} .. {}), margin {}, {}:\n",
        format_duration(delay),
        ladder.levels().len(),
        format_duration(ladder.smallest()),
        format_duration(ladder.largest()),
        format_duration(settings.margin),
        match (settings.bundled, settings.hop_window.is_zero()) {
            (true, _) => format!(
                "hops bundled in {} windows",
                format_duration(settings.hop_window)
            ),
            (false, false) => format!(
                "hops alone in {} windows",
                format_duration(settings.hop_window)
            ),
            (false, true) => "hops alone, at once".to_string(),
        }
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
    let steps = path(delay, settings);
    let mut elapsed = Duration::ZERO;
    let mut parts = Vec::new();
    for (i, step) in steps.iter().enumerate() {
        let n = i + 1;
        let _ = match step {
            PathStep::AwaitWindow(wait) => {
                elapsed += *wait;
                parts.push(format!("window {}", format_duration(*wait)));
                writeln!(
                    out,
                    "  {n:>2}. wait for the hop window's end, {}",
                    format_duration(*wait)
                )
            }
            PathStep::Hop { level, bundled } => {
                elapsed += *level;
                parts.push(format_duration(*level));
                writeln!(
                    out,
                    "  {n:>2}. hop into level {:<10} {}due in {}",
                    format_duration(*level),
                    if *bundled { "in a bundle, " } else { "" },
                    format_duration(delay - elapsed)
                )
            }
            PathStep::ToReturns => writeln!(
                out,
                "  {n:>2}. to the returns queue in a bundle, due in {}",
                format_duration(delay - elapsed)
            ),
            PathStep::Hold(rest) => {
                elapsed += *rest;
                parts.push(format!("hold {}", format_duration(*rest)));
                writeln!(
                    out,
                    "  {n:>2}. hold in the bridge {}",
                    format_duration(*rest)
                )
            }
            PathStep::Deliver => writeln!(out, "  {n:>2}. deliver to the target"),
        };
    }
    let joined = if parts.is_empty() {
        "0ms".to_string()
    } else {
        parts.join(" + ")
    };
    let hops = path_hops(&steps);
    let _ = writeln!(
        out,
        "{} = {joined}  ({hops} hop{})",
        format_duration(delay),
        if hops == 1 { "" } else { "s" }
    );
    if !settings.hop_window.is_zero() {
        let _ = writeln!(
            out,
            "(read at the start of a hop window; read later in it, a message waits for the \
             window's end and its last hops can be fewer)"
        );
    }
    out
}

/// `ladders`: the presets (the default one also with the fine levels bundled hops add in
/// the default 100ms window) and `extra` ladders, their mean and worst hops over delays
/// spread evenly on [1 s, `max`].
pub fn print_ladders(max: Duration, margin: Duration, extra: &[String]) -> Result<()> {
    if max < Duration::from_secs(1) {
        bail!("--max must be at least 1s");
    }
    let mut ladders: Vec<(String, Ladder)> = PRESETS
        .iter()
        .map(|p| (p.to_string(), Ladder::preset(p).expect("presets are valid")))
        .collect();
    ladders.insert(
        1,
        (
            format!("default, bundled {}", format_duration(defaults::HOP_WINDOW)),
            Ladder::default_ladder().with_fine_levels(defaults::HOP_WINDOW),
        ),
    );
    for text in extra {
        ladders.push((text.clone(), Ladder::parse(text)?));
    }
    outln!(
        "hops over 200000 delays spread evenly on [1s, {}], margin {}:",
        format_duration(max),
        format_duration(margin)
    )?;
    outln!(
        "{:<24} {:>7} {:>10} {:>12}",
        "ladder",
        "levels",
        "mean hops",
        "worst hops"
    )?;
    for (name, ladder) in ladders {
        let stats = hop_stats(&ladder, margin, Duration::from_secs(1), max, 200_000);
        outln!(
            "{:<24} {:>7} {:>10.2} {:>12}",
            name,
            ladder.levels().len(),
            stats.mean,
            stats.worst
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use delay_bridge::plan::{hop_count, plan};
    use proptest::prelude::*;

    const DAY: Duration = Duration::from_secs(86_400);

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// The defaults: the default ladder with bundled hops in 100 ms windows.
    fn defaults_with(max_delay: Duration) -> PlanSettings {
        PlanSettings::new(
            Ladder::default_ladder(),
            defaults::MARGIN,
            max_delay,
            defaults::HOP_WINDOW,
            true,
        )
    }

    fn alone(ladder: &str, window: Duration) -> PlanSettings {
        PlanSettings::new(
            Ladder::parse(ladder).unwrap(),
            ms(250),
            366 * DAY,
            window,
            false,
        )
    }

    fn read(toml: &str) -> PlanSettings {
        static FILES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = FILES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let file = std::env::temp_dir().join(format!("plan-cmd-{}-{n}.toml", std::process::id()));
        std::fs::write(&file, toml).unwrap();
        let settings = PlanSettings::read(&file, None, None).unwrap();
        let _ = std::fs::remove_file(&file);
        settings
    }

    #[test]
    fn a_delay_past_max_delay_is_shown_parked_not_planned() {
        let shown = render_plan(400 * DAY, "configured", &defaults_with(366 * DAY));
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
        let shown = render_plan(366 * DAY, "configured", &defaults_with(366 * DAY));
        assert!(!shown.contains("delay-too-long"), "{shown}");
        assert!(shown.contains("hop into level 48d"), "{shown}");
        assert!(shown.contains("deliver to the target"), "{shown}");
    }

    #[test]
    fn the_configuration_s_window_bundles_and_fine_levels_are_read() {
        let shipped = read("[[route]]\ningress = \"a\"\ntarget = \"b\"\n");
        assert!(shipped.bundled);
        assert_eq!(shipped.hop_window, ms(100));
        assert_eq!(shipped.ladder.smallest(), ms(100), "fine levels");
        assert_eq!(shipped.ladder.levels().len(), 189 + 4);
        let off = read("[bridge]\nbundle_hops = false\n[delays]\nladder = \"1s 1m\"\n");
        assert!(!off.bundled);
        assert_eq!(off.ladder.levels(), &[ms(1_000), ms(60_000)]);
        let none = read("[bridge]\nhop_window = \"0s\"\n");
        assert!(!none.bundled && none.hop_window.is_zero());
        assert_eq!(none.ladder.smallest(), ms(1_000), "no fine levels");
    }

    #[test]
    fn with_bundles_the_last_moments_go_through_the_fine_levels_and_the_returns_queue() {
        // 1.5 s: 1s, then 200ms (fine), then 300 ms left: to the returns queue, held there.
        let steps = path(ms(1_500), &defaults_with(DAY));
        let bundle = |level| PathStep::Hop {
            level: ms(level),
            bundled: true,
        };
        assert_eq!(
            steps,
            vec![
                bundle(1_000),
                bundle(200),
                PathStep::ToReturns,
                PathStep::Hold(ms(300)),
                PathStep::Deliver
            ]
        );
        let shown = render_plan(ms(1_500), "configured", &defaults_with(DAY));
        assert!(
            shown.starts_with(
                "plan for 1s500ms with the configured ladder (193 levels, 100ms .. 48d), \
                 margin 250ms, hops bundled in 100ms windows:\n"
            ),
            "{shown}"
        );
        assert!(
            shown.contains("   1. hop into level 1s         in a bundle, due in 500ms\n"),
            "{shown}"
        );
        assert!(
            shown.contains("   3. to the returns queue in a bundle, due in 300ms\n"),
            "{shown}"
        );
        assert!(
            shown.contains("\n1s500ms = 1s + 200ms + hold 300ms  (2 hops)\n(read at the start"),
            "{shown}"
        );
    }

    #[test]
    fn a_message_due_within_a_margin_is_held_not_sent_to_the_returns_queue() {
        assert_eq!(
            path(ms(200), &defaults_with(DAY)),
            vec![PathStep::Hold(ms(200)), PathStep::Deliver]
        );
        assert_eq!(
            path(Duration::ZERO, &defaults_with(DAY)),
            vec![PathStep::Deliver]
        );
    }

    #[test]
    fn alone_a_hop_waits_for_its_window_when_a_level_ends_between_two() {
        // Levels of 150 ms in 100 ms windows: after each hop, 50 ms to the next window.
        let steps = path(ms(700), &alone("150ms", ms(100)));
        assert_eq!(
            steps,
            vec![
                PathStep::Hop {
                    level: ms(150),
                    bundled: false
                },
                PathStep::AwaitWindow(ms(50)),
                PathStep::Hop {
                    level: ms(150),
                    bundled: false
                },
                PathStep::Hold(ms(350)),
                PathStep::Deliver
            ]
        );
        let shown = render_plan(ms(700), "configured", &alone("150ms", ms(100)));
        assert!(shown.contains("hops alone in 100ms windows:"), "{shown}");
        assert!(
            shown.contains("   2. wait for the hop window's end, 50ms\n"),
            "{shown}"
        );
        assert!(
            shown.contains("\n700ms = 150ms + window 50ms + 150ms + hold 350ms  (2 hops)\n"),
            "{shown}"
        );
    }

    #[test]
    fn without_a_window_the_path_is_the_plain_plan() {
        let settings = alone("default", Duration::ZERO);
        let shown = render_plan(ms(1_500), "default", &settings);
        assert!(shown.contains("hops alone, at once:"), "{shown}");
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

    proptest! {
        /// Whatever the delay: the path's waits add up to it exactly, it ends with the
        /// delivery, at most one hold comes right before it, a hop lands at least a margin
        /// before the due time, and without a window it is the library's plan.
        #[test]
        fn a_path_adds_up_and_keeps_the_margin(
            delay_ms in 0u64..(40 * 86_400_000),
            window_ms in prop::sample::select(vec![0u64, 20, 100, 250, 1_000]),
            bundled in any::<bool>(),
        ) {
            let bundled = bundled && window_ms > 0;
            let settings = PlanSettings::new(
                Ladder::default_ladder(), ms(250), 366 * DAY, ms(window_ms), bundled);
            let steps = path(ms(delay_ms), &settings);
            prop_assert_eq!(steps.last(), Some(&PathStep::Deliver));
            let mut elapsed = 0u64;
            for (i, step) in steps.iter().enumerate() {
                match step {
                    PathStep::AwaitWindow(wait) => elapsed += wait.as_millis() as u64,
                    PathStep::Hop { level, bundled: b } => {
                        prop_assert_eq!(*b, bundled);
                        elapsed += level.as_millis() as u64;
                        prop_assert!(elapsed + 250 <= delay_ms, "hop {} lands late", i);
                    }
                    PathStep::ToReturns => prop_assert!(bundled),
                    PathStep::Hold(rest) => {
                        prop_assert_eq!(i, steps.len() - 2);
                        elapsed += rest.as_millis() as u64;
                    }
                    PathStep::Deliver => prop_assert_eq!(i, steps.len() - 1),
                }
            }
            prop_assert_eq!(elapsed, delay_ms);
            if window_ms == 0 {
                let plain = plan(ms(delay_ms), &settings.ladder, ms(250));
                prop_assert_eq!(path_hops(&steps), hop_count(&plain));
            }
        }
    }
}
