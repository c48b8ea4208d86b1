//! Every exchange and queue name the bridge owns, derived from one prefix.

use std::time::Duration;

use crate::ladder::format_duration;

/// The names of the bridge's own exchanges and queues for a given prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Names {
    prefix: String,
}

impl Names {
    /// Names under `prefix` (for example `delay-bridge`).
    pub fn new(prefix: impl Into<String>) -> Self {
        Self {
            prefix: prefix.into(),
        }
    }

    /// The prefix itself.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The fanout exchange every level dead-letters into (`<prefix>.work`).
    pub fn work_exchange(&self) -> String {
        format!("{}.work", self.prefix)
    }

    /// The queue new messages enter, from every route's ingress exchange (`<prefix>.work`).
    /// The bridge consumes it.
    pub fn work_queue(&self) -> String {
        format!("{}.work", self.prefix)
    }

    /// The queue messages come back to from the levels, bound to the work exchange
    /// (`<prefix>.returns`). The bridge consumes it on a channel of its own, so that what it
    /// holds there never stands in front of the acks for new messages.
    pub fn returns_queue(&self) -> String {
        format!("{}.returns", self.prefix)
    }

    /// The level queue for one delay level (`<prefix>.level.1m30s`).
    pub fn level_queue(&self, level: Duration) -> String {
        format!("{}.level.{}", self.prefix, format_duration(level))
    }

    /// The fanout exchange parked messages are published to (`<prefix>.parked`).
    pub fn parked_exchange(&self) -> String {
        format!("{}.parked", self.prefix)
    }

    /// The queue holding parked messages (`<prefix>.parked`).
    pub fn parked_queue(&self) -> String {
        format!("{}.parked", self.prefix)
    }

    /// The stream of cancellations (tombstones) every instance reads (`<prefix>.cancel`).
    pub fn cancel_stream(&self) -> String {
        format!("{}.cancel", self.prefix)
    }

    /// The fanout exchange cancellers publish tombstones to (`<prefix>.cancel`, bound to
    /// the cancel stream of the same name): a canceller needs write permission on it
    /// alone, not on the default exchange, through which anyone could write into a level.
    pub fn cancel_exchange(&self) -> String {
        format!("{}.cancel", self.prefix)
    }

    /// The longest name this prefix produces for the given levels, in bytes.
    pub fn longest_name_len<'a>(&self, levels: impl IntoIterator<Item = &'a Duration>) -> usize {
        levels
            .into_iter()
            .map(|l| self.level_queue(*l).len())
            .chain([
                self.work_queue().len(),
                self.returns_queue().len(),
                self.parked_queue().len(),
                self.cancel_stream().len(),
            ])
            .max()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_derive_from_the_prefix() {
        let names = Names::new("t1");
        assert_eq!(names.work_exchange(), "t1.work");
        assert_eq!(names.work_queue(), "t1.work");
        assert_eq!(names.returns_queue(), "t1.returns");
        assert_eq!(names.parked_exchange(), "t1.parked");
        assert_eq!(names.parked_queue(), "t1.parked");
        assert_eq!(names.level_queue(Duration::from_secs(90)), "t1.level.1m30s");
        assert_eq!(
            names.level_queue(Duration::from_millis(500)),
            "t1.level.500ms"
        );
    }

    #[test]
    fn distinct_levels_get_distinct_queues() {
        let ladder = crate::ladder::Ladder::default_ladder();
        let names = Names::new("p");
        let mut all: Vec<String> = ladder
            .levels()
            .iter()
            .map(|l| names.level_queue(*l))
            .collect();
        all.sort();
        all.dedup();
        assert_eq!(all.len(), ladder.levels().len());
    }
}
