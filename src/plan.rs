//! The planner: given when a message is due and what time it is, the next step.
//!
//! Pure: the clock is a parameter. Remaining time is always recomputed from the absolute
//! deliver-at, so lateness of one step never accumulates into the next.

pub mod decide;

use std::time::Duration;

use crate::ladder::Ladder;

/// What the bridge does next with a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Re-publish into the level queue of this duration.
    Hop(Duration),
    /// Wait this long in process (the remainder is below the smallest level plus the margin).
    Hold(Duration),
    /// Publish to the target now.
    Deliver,
}

/// The next step for a message due at `deliver_at_ms` (epoch ms) when the clock reads
/// `now_ms`: hop into the largest level `L <= remaining − margin`; else hold for the
/// remainder; at or after the due time, deliver.
pub fn next_step(deliver_at_ms: u64, now_ms: u64, ladder: &Ladder, margin: Duration) -> Step {
    let remaining = Duration::from_millis(deliver_at_ms.saturating_sub(now_ms));
    if remaining.is_zero() {
        return Step::Deliver;
    }
    match remaining
        .checked_sub(margin)
        .and_then(|budget| ladder.largest_at_most(budget))
    {
        Some(level) => Step::Hop(level),
        None => Step::Hold(remaining),
    }
}

/// The whole plan of a delay on an ideal clock: the hops, at most one final hold, and the
/// delivery (always last).
pub fn plan(delay: Duration, ladder: &Ladder, margin: Duration) -> Vec<Step> {
    let deliver_at = delay.as_millis() as u64;
    let mut now = 0u64;
    let mut steps = Vec::new();
    loop {
        let step = next_step(deliver_at, now, ladder, margin);
        steps.push(step);
        match step {
            Step::Hop(level) => now += level.as_millis() as u64,
            Step::Hold(rest) => now += rest.as_millis() as u64,
            Step::Deliver => return steps,
        }
    }
}

/// How many hops a plan takes.
pub fn hop_count(steps: &[Step]) -> usize {
    steps.iter().filter(|s| matches!(s, Step::Hop(_))).count()
}

/// Mean and worst-case hop counts of a ladder over delays spread evenly on `[from, to]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HopStats {
    /// Mean hops over the sampled delays.
    pub mean: f64,
    /// Most hops seen over the sampled delays.
    pub sampled_worst: usize,
    /// The exact worst case over `[0, to]`, from [`Ladder::worst_case_hops`].
    pub worst: u64,
}

/// Measures hop counts over `samples` delays evenly spaced on `[from, to]`.
pub fn hop_stats(
    ladder: &Ladder,
    margin: Duration,
    from: Duration,
    to: Duration,
    samples: u32,
) -> HopStats {
    let samples = samples.max(2);
    let span = to.saturating_sub(from);
    let mut total = 0usize;
    let mut sampled_worst = 0usize;
    for i in 0..samples {
        let delay = from + span.mul_f64(f64::from(i) / f64::from(samples - 1));
        let hops = hop_count(&plan(delay, ladder, margin));
        total += hops;
        sampled_worst = sampled_worst.max(hops);
    }
    HopStats {
        mean: total as f64 / f64::from(samples),
        sampled_worst,
        worst: ladder.worst_case_hops(to, margin),
    }
}

/// The start of the next hop window at or after `now_ms` (epoch ms): the next multiple of
/// `window` on the wall clock, so that every bridge instance and every message share the
/// same boundaries. A zero window is no window: `now_ms` itself.
pub fn hop_window_end(now_ms: u64, window: Duration) -> u64 {
    let window_ms = window.as_millis() as u64;
    if window_ms == 0 {
        return now_ms;
    }
    now_ms.div_ceil(window_ms) * window_ms
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    #[test]
    fn five_hours_under_rocketmq_is_two_two_one() {
        let steps = plan(Duration::from_secs(5 * 3600), &Ladder::rocketmq(), ms(200));
        let hours = |h: u64| Step::Hop(Duration::from_secs(h * 3600));
        // 5h − 200 ms margin: 2h, 2h, then 1h does not fit (59m59.8s left) → 30m, 20m, 9m…
        assert_eq!(&steps[..2], &[hours(2), hours(2)]);
        let exact = plan(Duration::from_secs(5 * 3600), &Ladder::rocketmq(), ms(0));
        assert_eq!(exact, vec![hours(2), hours(2), hours(1), Step::Deliver]);
    }

    #[test]
    fn short_delays_hold_and_late_ones_deliver() {
        let ladder = Ladder::parse("1s 5s").unwrap();
        assert_eq!(next_step(1_000, 1_000, &ladder, ms(100)), Step::Deliver);
        assert_eq!(next_step(1_000, 5_000, &ladder, ms(100)), Step::Deliver);
        assert_eq!(
            next_step(1_500, 1_000, &ladder, ms(100)),
            Step::Hold(ms(500))
        );
        // 1.05 s remaining minus 100 ms margin does not fit the 1 s level: hold it all.
        assert_eq!(
            next_step(2_050, 1_000, &ladder, ms(100)),
            Step::Hold(ms(1_050))
        );
        assert_eq!(next_step(8_000, 0, &ladder, ms(100)), Step::Hop(ms(5_000)));
    }

    #[test]
    fn plan_of_zero_is_deliver() {
        assert_eq!(
            plan(Duration::ZERO, &Ladder::rocketmq(), ms(200)),
            vec![Step::Deliver]
        );
    }

    #[test]
    fn hop_stats_of_a_tiny_ladder() {
        let ladder = Ladder::parse("1s").unwrap();
        let stats = hop_stats(&ladder, ms(0), ms(0), Duration::from_secs(4), 5);
        // delays 0,1,2,3,4 s take 0,1,2,3,4 hops
        assert_eq!(stats.mean, 2.0);
        assert_eq!(stats.sampled_worst, 4);
        assert_eq!(stats.worst, 4);
    }

    /// The default ladder's promise (docs/architecture.md, "How it works, in short"): at most
    /// 4 hops up to 30 days, at most 4 on average, with the default margin (the ladder
    /// alone, without the fine levels bundled hops add).
    #[test]
    fn the_default_ladder_takes_at_most_four_hops_up_to_thirty_days() {
        let stats = hop_stats(
            &Ladder::default_ladder(),
            crate::config::defaults::MARGIN,
            Duration::from_secs(1),
            Duration::from_secs(30 * 86_400),
            20_000,
        );
        assert!(stats.mean <= 4.0, "mean {}", stats.mean);
        assert_eq!(stats.worst, 4);
    }

    fn ladder_strategy() -> impl Strategy<Value = Ladder> {
        prop::collection::btree_set(1u64..5_000_000, 1..12).prop_map(|set| {
            Ladder::new(set.into_iter().map(Duration::from_millis).collect()).unwrap()
        })
    }

    proptest! {
        #[test]
        fn a_plan_adds_up_exactly_and_never_overshoots(
            ladder in ladder_strategy(),
            delay_ms in 0u64..50_000_000,
            margin_ms in 0u64..2_000,
        ) {
            let margin = ms(margin_ms);
            let steps = plan(ms(delay_ms), &ladder, margin);
            prop_assert_eq!(steps.last(), Some(&Step::Deliver));
            let mut elapsed = 0u64;
            for (i, step) in steps.iter().enumerate() {
                match step {
                    Step::Hop(level) => elapsed += level.as_millis() as u64,
                    Step::Hold(rest) => {
                        // the hold is the last waiting step and is short
                        prop_assert_eq!(i, steps.len() - 2);
                        prop_assert!(*rest < ladder.smallest() + margin);
                        elapsed += rest.as_millis() as u64;
                    }
                    Step::Deliver => prop_assert_eq!(i, steps.len() - 1),
                }
                prop_assert!(elapsed <= delay_ms, "step {} overshoots", i);
            }
            prop_assert_eq!(elapsed, delay_ms);
            let hops = hop_count(&steps) as u64;
            prop_assert!(hops <= ladder.worst_case_hops(ms(delay_ms), margin));
        }

        #[test]
        fn next_step_is_consistent_with_any_clock(
            ladder in ladder_strategy(),
            deliver_at in 0u64..10_000_000_000,
            now in 0u64..10_000_000_000,
            margin_ms in 0u64..2_000,
        ) {
            let margin = ms(margin_ms);
            match next_step(deliver_at, now, &ladder, margin) {
                Step::Deliver => prop_assert!(now >= deliver_at),
                Step::Hold(rest) => {
                    prop_assert_eq!(rest.as_millis() as u64, deliver_at - now);
                    prop_assert!(rest < ladder.smallest() + margin);
                }
                Step::Hop(level) => {
                    prop_assert!(ladder.levels().contains(&level));
                    prop_assert!(now + level.as_millis() as u64 + margin_ms <= deliver_at);
                }
            }
        }

        #[test]
        fn preset_plans_stay_within_their_worst_case(delay_s in 0u64..(400 * 86_400)) {
            for ladder in [Ladder::default_ladder(), Ladder::binary()] {
                let margin = ms(250);
                let steps = plan(Duration::from_secs(delay_s), &ladder, margin);
                let worst = ladder.worst_case_hops(Duration::from_secs(400 * 86_400), margin);
                prop_assert!(hop_count(&steps) as u64 <= worst);
            }
        }
    }

    #[test]
    fn hops_wait_for_the_next_multiple_of_the_window() {
        let window = Duration::from_millis(20);
        assert_eq!(
            hop_window_end(1_000, window),
            1_000,
            "on a boundary: at once"
        );
        assert_eq!(hop_window_end(1_001, window), 1_020);
        assert_eq!(hop_window_end(1_019, window), 1_020);
        assert_eq!(hop_window_end(1_234, Duration::ZERO), 1_234, "no window");
    }
}
