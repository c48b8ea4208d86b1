//! Redeliveries counted by the bridge itself: a classic work queue marks a redelivery but
//! keeps no count, so a message whose handling costs the session (a refused parked copy, a
//! connection the broker closes over it) would come back for ever. Pure bookkeeping: the
//! caller hashes what it consumed and asks how often this process has seen it redelivered.
//!
//! The count lives in this process: it survives reconnects, not a restart. Entries leave
//! when their message is settled, and the oldest leave first past a fixed capacity, so the
//! memory is bounded whatever the broker sends.

use std::collections::{HashMap, VecDeque};

use crate::amqp::returns::Fingerprint;

/// How many distinct redelivered messages are remembered at once.
pub(crate) const CAPACITY: usize = 100_000;

/// Redelivery counts by message content.
#[derive(Debug)]
pub(crate) struct RedeliveryCounts {
    capacity: usize,
    /// Count and the generation it was inserted with.
    counts: HashMap<Fingerprint, (u32, u64)>,
    /// Insertion order; an entry whose generation no longer matches was settled or replaced.
    order: VecDeque<(Fingerprint, u64)>,
    generation: u64,
}

impl Default for RedeliveryCounts {
    fn default() -> Self {
        Self::with_capacity(CAPACITY)
    }
}

impl RedeliveryCounts {
    /// Counts for at most `capacity` distinct messages.
    pub(crate) fn with_capacity(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            counts: HashMap::new(),
            order: VecDeque::new(),
            generation: 0,
        }
    }

    /// One more redelivery of the message `fingerprint`: how many this process has seen.
    pub(crate) fn redelivered(&mut self, fingerprint: Fingerprint) -> u32 {
        if let Some((count, _)) = self.counts.get_mut(&fingerprint) {
            *count += 1;
            return *count;
        }
        self.generation += 1;
        self.counts.insert(fingerprint, (1, self.generation));
        self.order.push_back((fingerprint, self.generation));
        while self.counts.len() > self.capacity {
            let Some((oldest, generation)) = self.order.pop_front() else {
                break;
            };
            if self.counts.get(&oldest).map(|e| e.1) == Some(generation) {
                self.counts.remove(&oldest);
            }
        }
        if self.order.len() > 2 * self.capacity {
            let counts = &self.counts;
            self.order
                .retain(|(f, g)| counts.get(f).map(|e| e.1) == Some(*g));
        }
        1
    }

    /// The message was settled (its replacement confirmed): forget it.
    pub(crate) fn settled(&mut self, fingerprint: Fingerprint) {
        self.counts.remove(&fingerprint);
    }

    /// Messages counted now.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.counts.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fp(n: u8) -> Fingerprint {
        Fingerprint::of("", "rk", &lapin::BasicProperties::default(), &[n])
    }

    #[test]
    fn each_redelivery_of_one_message_counts_and_settling_forgets_it() {
        let mut counts = RedeliveryCounts::default();
        assert_eq!(counts.redelivered(fp(1)), 1);
        assert_eq!(counts.redelivered(fp(2)), 1);
        assert_eq!(counts.redelivered(fp(1)), 2);
        assert_eq!(counts.redelivered(fp(1)), 3);
        counts.settled(fp(1));
        assert_eq!(counts.redelivered(fp(1)), 1);
        assert_eq!(counts.redelivered(fp(2)), 2);
    }

    #[test]
    fn past_its_capacity_the_oldest_message_is_forgotten_first() {
        let mut counts = RedeliveryCounts::with_capacity(3);
        for n in 1..=3 {
            counts.redelivered(fp(n));
        }
        counts.redelivered(fp(1)); // counted again, still the oldest entry
        counts.redelivered(fp(4)); // evicts 1
        assert_eq!(counts.len(), 3);
        assert_eq!(counts.redelivered(fp(2)), 2);
        assert_eq!(counts.redelivered(fp(1)), 1, "1 was forgotten");
    }

    #[test]
    fn settled_and_reinserted_messages_keep_the_order_bounded() {
        let mut counts = RedeliveryCounts::with_capacity(2);
        for _ in 0..1000 {
            counts.redelivered(fp(9));
            counts.settled(fp(9));
        }
        assert!(
            counts.order.len() <= 4,
            "order holds {}",
            counts.order.len()
        );
        assert_eq!(counts.len(), 0);
        // an old, stale order entry does not evict a live one
        counts.redelivered(fp(1));
        counts.redelivered(fp(2));
        assert_eq!(counts.redelivered(fp(1)), 2);
        assert_eq!(counts.redelivered(fp(2)), 2);
    }
}
