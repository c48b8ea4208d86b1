//! Levels whose expired messages are not forwarded. A quorum level dead-letters at least
//! once: an expired message waits in the queue (counted in `messages`, not in
//! `messages_ready`) until its dead-letter worker has published it to the work exchange and
//! seen the confirm. When the worker cannot (the work exchange missing at boot, a leader
//! that moved), those messages stay, late, until the broker retries. Pure bookkeeping over
//! the management API's readings; the caller passes the time.

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// What changed with one reading.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Change {
    /// `queue` has held expired, unforwarded messages at every reading for `stuck_for`;
    /// `messages` now.
    Stuck {
        queue: String,
        messages: u64,
        stuck_for: Duration,
    },
    /// `queue`, reported stuck, holds none any more.
    Recovered { queue: String },
}

/// Since when each queue has held expired, unforwarded messages, and which were reported.
#[derive(Debug)]
pub(crate) struct StuckWatch {
    stuck_after: Duration,
    /// Queue -> (first reading with such messages, reported stuck).
    holding: HashMap<String, (Instant, bool)>,
}

impl StuckWatch {
    /// Reports a queue once it has held such messages at every reading for `stuck_after`.
    pub(crate) fn new(stuck_after: Duration) -> Self {
        Self {
            stuck_after,
            holding: HashMap::new(),
        }
    }

    /// Takes one reading: (queue, expired messages not yet forwarded) for every queue read.
    /// A queue missing from the reading counts as holding none.
    pub(crate) fn observe(&mut self, reading: &[(String, u64)], now: Instant) -> Vec<Change> {
        let mut changes = Vec::new();
        let holding_now: HashMap<&str, u64> = reading
            .iter()
            .filter(|(_, messages)| *messages > 0)
            .map(|(queue, messages)| (queue.as_str(), *messages))
            .collect();
        self.holding.retain(|queue, (_, reported)| {
            let still = holding_now.contains_key(queue.as_str());
            if !still && *reported {
                changes.push(Change::Recovered {
                    queue: queue.clone(),
                });
            }
            still
        });
        for (queue, messages) in holding_now {
            let (since, reported) = self
                .holding
                .entry(queue.to_string())
                .or_insert((now, false));
            let stuck_for = now.saturating_duration_since(*since);
            if !*reported && stuck_for >= self.stuck_after {
                *reported = true;
                changes.push(Change::Stuck {
                    queue: queue.to_string(),
                    messages,
                    stuck_for,
                });
            }
        }
        changes.sort();
        changes
    }

    /// Queues reported stuck and not recovered.
    pub(crate) fn stuck(&self) -> usize {
        self.holding
            .values()
            .filter(|(_, reported)| *reported)
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    fn reading(entries: &[(&str, u64)]) -> Vec<(String, u64)> {
        entries.iter().map(|(q, n)| (q.to_string(), *n)).collect()
    }

    #[test]
    fn a_level_holding_messages_at_every_reading_is_reported_once_then_recovers() {
        let t0 = Instant::now();
        let mut watch = StuckWatch::new(10 * S);
        assert_eq!(watch.observe(&reading(&[("l.1s", 40)]), t0), vec![]);
        assert_eq!(watch.observe(&reading(&[("l.1s", 40)]), t0 + 5 * S), vec![]);
        assert_eq!(
            watch.observe(&reading(&[("l.1s", 41)]), t0 + 10 * S),
            vec![Change::Stuck {
                queue: "l.1s".into(),
                messages: 41,
                stuck_for: 10 * S
            }]
        );
        assert_eq!(watch.stuck(), 1);
        assert_eq!(
            watch.observe(&reading(&[("l.1s", 41)]), t0 + 15 * S),
            vec![]
        );
        assert_eq!(
            watch.observe(&reading(&[("l.1s", 0)]), t0 + 20 * S),
            vec![Change::Recovered {
                queue: "l.1s".into()
            }]
        );
        assert_eq!(watch.stuck(), 0);
    }

    #[test]
    fn a_reading_with_none_starts_the_wait_over() {
        let t0 = Instant::now();
        let mut watch = StuckWatch::new(10 * S);
        watch.observe(&reading(&[("l.1s", 3)]), t0);
        watch.observe(&reading(&[("l.1s", 0)]), t0 + 5 * S);
        watch.observe(&reading(&[("l.1s", 2)]), t0 + 6 * S);
        assert_eq!(watch.observe(&reading(&[("l.1s", 2)]), t0 + 11 * S), vec![]);
        assert_eq!(watch.stuck(), 0);
    }

    #[test]
    fn a_queue_gone_from_the_reading_recovers_and_others_are_apart() {
        let t0 = Instant::now();
        let mut watch = StuckWatch::new(S);
        watch.observe(&reading(&[("a", 1), ("b", 1)]), t0);
        assert_eq!(
            watch.observe(&reading(&[("a", 1), ("b", 1)]), t0 + S).len(),
            2
        );
        assert_eq!(
            watch.observe(&reading(&[("b", 1)]), t0 + 2 * S),
            vec![Change::Recovered { queue: "a".into() }]
        );
        assert_eq!(watch.stuck(), 1);
    }
}
