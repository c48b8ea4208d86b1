//! What is pending, and by when it is due, from queue depths alone.
//!
//! Pure: the bridge reads the depths (one passive declare per queue) and this module turns
//! them into due-time buckets. No message is read: the bound comes from the planner. A
//! message hops into level `L` only when its remaining time minus the margin is below the
//! next level up (the planner takes the largest level that fits), so while it sits in `L` it
//! is due within that next level plus the margin. A held message is due within the smallest
//! level plus the margin. Messages in the largest level, and in the work queue (not read
//! yet), have no bound.

use std::time::Duration;

use crate::ladder::Ladder;

/// The upper bounds of the due-time buckets, ascending: a message counts in the first
/// bucket its bound fits in, and every bucket counts the ones before it (as Prometheus'
/// `le` buckets do). The last bucket, unbounded, is implicit.
pub const DUE_BUCKETS: [Duration; 11] = [
    Duration::from_secs(1),
    Duration::from_secs(5),
    Duration::from_secs(30),
    Duration::from_secs(60),
    Duration::from_secs(5 * 60),
    Duration::from_secs(30 * 60),
    Duration::from_secs(3600),
    Duration::from_secs(6 * 3600),
    Duration::from_secs(86_400),
    Duration::from_secs(7 * 86_400),
    Duration::from_secs(30 * 86_400),
];

/// Messages pending in one bridge's view, at one reading.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Pending {
    /// Each level and the messages its queue holds (ready ones: what a passive declare
    /// counts), ascending by level.
    pub levels: Vec<(Duration, u64)>,
    /// Messages this bridge holds in process for their last moments.
    pub held: u64,
    /// Messages ready in the work and returns queues (new ones and ones back from a level),
    /// not read yet.
    pub work_queue: u64,
}

impl Pending {
    /// How long at most until a message in `level` is due, or `None` for the largest level.
    pub fn due_within(level: Duration, ladder: &Ladder, margin: Duration) -> Option<Duration> {
        let levels = ladder.levels();
        let next = levels.partition_point(|l| *l <= level);
        levels.get(next).map(|above| *above + margin)
    }

    /// Cumulative counts per bucket of [`DUE_BUCKETS`], then the total (the unbounded
    /// bucket): element `i` counts the messages surely due within `DUE_BUCKETS[i]`.
    pub fn due_buckets(&self, ladder: &Ladder, margin: Duration) -> [u64; DUE_BUCKETS.len() + 1] {
        let mut in_bucket = [0u64; DUE_BUCKETS.len() + 1];
        let mut add = |bound: Option<Duration>, count: u64| {
            let index = bound.map_or(DUE_BUCKETS.len(), |bound| {
                DUE_BUCKETS.partition_point(|upper| *upper < bound)
            });
            in_bucket[index] += count;
        };
        add(Some(ladder.smallest() + margin), self.held);
        for (level, count) in &self.levels {
            add(Self::due_within(*level, ladder, margin), *count);
        }
        add(None, self.work_queue);
        let mut running = 0;
        in_bucket.map(|count| {
            running += count;
            running
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn a_level_is_due_within_the_next_level_up_plus_the_margin() {
        let ladder = Ladder::parse("1s 10s 1m").unwrap();
        let margin = Duration::from_millis(250);
        assert_eq!(
            Pending::due_within(secs(1), &ladder, margin),
            Some(Duration::from_millis(10_250))
        );
        assert_eq!(
            Pending::due_within(secs(10), &ladder, margin),
            Some(Duration::from_millis(60_250))
        );
        assert_eq!(Pending::due_within(secs(60), &ladder, margin), None);
    }

    #[test]
    fn the_bound_agrees_with_the_planner_for_every_remaining_time() {
        use crate::plan::{Step, next_step};
        let ladder = Ladder::parse("1s 10s 1m 1h").unwrap();
        let margin = Duration::from_millis(250);
        for remaining_ms in (0..4_000_000u64).step_by(997) {
            if let Step::Hop(level) = next_step(remaining_ms, 0, &ladder, margin)
                && let Some(bound) = Pending::due_within(level, &ladder, margin)
            {
                assert!(
                    Duration::from_millis(remaining_ms) < bound,
                    "{remaining_ms} ms hopped into {level:?}, bound {bound:?}"
                );
            }
        }
    }

    #[test]
    fn buckets_are_cumulative_and_end_with_every_pending_message() {
        let ladder = Ladder::parse("1s 10s 1m").unwrap();
        let pending = Pending {
            levels: vec![(secs(1), 3), (secs(10), 5), (secs(60), 7)],
            held: 2,
            work_queue: 11,
        };
        let buckets = pending.due_buckets(&ladder, Duration::from_millis(250));
        // held: within 1.25 s (bucket 5 s); level 1s: within 10.25 s (30 s);
        // level 10s: within 60.25 s (5 m); level 1m and the work queue: unbounded.
        assert_eq!(buckets[0], 0, "nothing is surely due within 1 s");
        assert_eq!(buckets[1], 2);
        assert_eq!(buckets[2], 5);
        assert_eq!(buckets[3], 5, "60.25 s is past the 1 m bucket");
        assert_eq!(buckets[4], 10);
        assert_eq!(buckets[DUE_BUCKETS.len() - 1], 10);
        assert_eq!(buckets[DUE_BUCKETS.len()], 28);
    }
}
