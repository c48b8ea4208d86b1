//! Which acks to send, and when: pure bookkeeping of the consumer channel's delivery tags.
//!
//! Acks go out in delivery-tag order, batched with `multiple=true` up to the highest
//! contiguous finished tag: single acks sent out of order make the broker walk its unacked
//! list for each. A held message (waiting out its last second) would stall that batching, so
//! finished tags behind a held one are acked singly. Only finished tags are ever acked.

use std::collections::{BTreeMap, BTreeSet};

/// What to send to the broker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AckOp {
    /// `basic.ack(tag, multiple=true)`.
    Multiple(u64),
    /// `basic.ack(tag, multiple=false)`.
    Single(u64),
    /// `basic.nack(tag, requeue=true)`: give it back to the broker unprocessed.
    Requeue(u64),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    /// Being decided or published.
    InFlight,
    /// Waiting on a hold timer: may stay unfinished for up to a second or so.
    Held,
    /// Replaced and confirmed: may be acked.
    Done,
}

/// The unacknowledged deliveries of one consumer channel. Every operation is O(log n) in
/// the outstanding deliveries (amortized: each tag enters and leaves each set once).
#[derive(Debug, Default)]
pub struct AckTracker {
    slots: BTreeMap<u64, Slot>,
    /// Tags in `Slot::Done`, not yet acked.
    done: BTreeSet<u64>,
    /// How many slots are `Slot::Held`.
    held: usize,
}

impl AckTracker {
    /// An empty tracker (a new channel).
    pub fn new() -> Self {
        Self::default()
    }

    /// A delivery arrived.
    pub fn delivered(&mut self, tag: u64) {
        self.slots.entry(tag).or_insert(Slot::InFlight);
    }

    /// The delivery waits on a hold timer.
    pub fn held(&mut self, tag: u64) {
        if let Some(slot @ Slot::InFlight) = self.slots.get_mut(&tag) {
            *slot = Slot::Held;
            self.held += 1;
        }
    }

    /// Whatever replaced the delivery is confirmed (or nothing needed to replace it).
    pub fn done(&mut self, tag: u64) -> Vec<AckOp> {
        if let Some(slot) = self.slots.get_mut(&tag) {
            if *slot == Slot::Held {
                self.held -= 1;
            }
            *slot = Slot::Done;
            self.done.insert(tag);
        }
        self.ackable()
    }

    /// The delivery goes back to the broker unprocessed (shutdown, or a failed publish).
    pub fn release(&mut self, tag: u64) -> Vec<AckOp> {
        match self.slots.remove(&tag) {
            None => return Vec::new(),
            Some(Slot::Held) => self.held -= 1,
            Some(Slot::Done) => {
                self.done.remove(&tag);
            }
            Some(Slot::InFlight) => {}
        }
        let mut ops = vec![AckOp::Requeue(tag)];
        ops.extend(self.ackable());
        ops
    }

    /// Deliveries not yet acked or released.
    pub fn outstanding(&self) -> usize {
        self.slots.len()
    }

    /// Deliveries waiting on a hold timer.
    pub fn held_count(&self) -> usize {
        self.held
    }

    /// Merges the ops of several events into as few as the broker needs, in a safe order:
    /// every requeue and single ack as it came, then only the highest `multiple` ack.
    ///
    /// Dropping a lower `Multiple(a)` is safe because the later `Multiple(b)` (b > a) covers
    /// every tag it did; moving `Multiple(b)` last is safe because a tag requeued or acked
    /// singly after it was issued is above `b` (the tracker had removed every tag up to `b`),
    /// and `b` itself can be settled by nothing else, so it is still unacked when it goes.
    pub fn compact(ops: Vec<AckOp>) -> Vec<AckOp> {
        let mut highest = None;
        let mut compacted: Vec<AckOp> = ops
            .into_iter()
            .filter(|op| match op {
                AckOp::Multiple(tag) => {
                    highest = highest.max(Some(*tag));
                    false
                }
                _ => true,
            })
            .collect();
        compacted.extend(highest.map(AckOp::Multiple));
        compacted
    }

    fn ackable(&mut self) -> Vec<AckOp> {
        let mut ops = Vec::new();
        let mut last_done = None;
        while let Some((&tag, &Slot::Done)) = self.slots.first_key_value() {
            self.slots.remove(&tag);
            self.done.remove(&tag);
            last_done = Some(tag);
        }
        if let Some(tag) = last_done {
            ops.push(AckOp::Multiple(tag));
        }
        if let Some((_, Slot::Held)) = self.slots.first_key_value() {
            for tag in std::mem::take(&mut self.done) {
                self.slots.remove(&tag);
                ops.push(AckOp::Single(tag));
            }
        }
        ops
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn in_order_completions_batch() {
        let mut t = AckTracker::new();
        for tag in 1..=3 {
            t.delivered(tag);
        }
        assert_eq!(t.done(2), vec![]);
        assert_eq!(t.done(1), vec![AckOp::Multiple(2)]);
        assert_eq!(t.done(3), vec![AckOp::Multiple(3)]);
        assert_eq!(t.outstanding(), 0);
    }

    #[test]
    fn finished_tags_behind_a_held_one_are_acked_singly() {
        let mut t = AckTracker::new();
        for tag in 1..=4 {
            t.delivered(tag);
        }
        t.held(1);
        assert_eq!(t.held_count(), 1);
        assert_eq!(t.done(3), vec![AckOp::Single(3)]);
        assert_eq!(t.done(2), vec![AckOp::Single(2)]);
        assert_eq!(t.done(1), vec![AckOp::Multiple(1)]);
        assert_eq!(t.done(4), vec![AckOp::Multiple(4)]);
    }

    #[test]
    fn released_tags_are_requeued_never_acked() {
        let mut t = AckTracker::new();
        for tag in 1..=3 {
            t.delivered(tag);
        }
        t.held(1);
        assert_eq!(t.done(2), vec![AckOp::Single(2)]);
        assert_eq!(t.release(1), vec![AckOp::Requeue(1)]);
        assert_eq!(t.done(3), vec![AckOp::Multiple(3)]);
        assert_eq!(t.release(1), vec![], "released once only");
    }

    proptest! {
        /// Whatever the order in which deliveries finish, are held or are released, and however
        /// the ops of consecutive events are batched through `compact`, every tag is acked or
        /// requeued exactly once, only while the broker still has it unacked, and acked only
        /// after it finished.
        #[test]
        fn every_tag_is_settled_once_and_only_when_finished(
            events in prop::collection::vec((0u64..40, 0u8..4, any::<bool>()), 1..200)
        ) {
            let mut t = AckTracker::new();
            let total = 40u64;
            for tag in 1..=total {
                t.delivered(tag);
            }
            let mut finished = std::collections::HashSet::new();
            // What the broker holds unacked; an op on a tag not in it is a channel error.
            let mut unacked: std::collections::BTreeSet<u64> = (1..=total).collect();
            let apply = |ops: Vec<AckOp>,
                         finished: &std::collections::HashSet<u64>,
                         unacked: &mut std::collections::BTreeSet<u64>| {
                for op in AckTracker::compact(ops) {
                    let (tag, settles) = match op {
                        AckOp::Multiple(tag) => (tag, unacked.range(..=tag).copied().collect()),
                        AckOp::Single(tag) => (tag, vec![tag]),
                        AckOp::Requeue(tag) => (tag, vec![tag]),
                    };
                    assert!(unacked.contains(&tag), "{op:?}: tag {tag} is not unacked");
                    for settled in settles {
                        if !matches!(op, AckOp::Requeue(_)) {
                            assert!(finished.contains(&settled), "{op:?} acks unfinished {settled}");
                        }
                        unacked.remove(&settled);
                    }
                }
            };
            // The model of held_count: held while neither finished nor released.
            let mut held = std::collections::HashSet::new();
            let mut released = std::collections::HashSet::new();
            let mut batch = Vec::new();
            for (i, kind, flush) in events {
                let tag = i + 1;
                match kind {
                    0 => {
                        if !finished.contains(&tag) && !released.contains(&tag) {
                            held.insert(tag);
                        }
                        t.held(tag)
                    }
                    1 | 2 => {
                        finished.insert(tag);
                        held.remove(&tag);
                        batch.extend(t.done(tag));
                    }
                    _ => if !finished.contains(&tag) {
                        released.insert(tag);
                        held.remove(&tag);
                        batch.extend(t.release(tag));
                    },
                }
                if flush {
                    apply(std::mem::take(&mut batch), &finished, &mut unacked);
                }
                prop_assert_eq!(t.held_count(), held.len());
            }
            for tag in 1..=total {
                if unacked.contains(&tag) && !released.contains(&tag) {
                    finished.insert(tag);
                    batch.extend(t.done(tag));
                }
            }
            apply(batch, &finished, &mut unacked);
            prop_assert!(unacked.is_empty(), "never settled: {unacked:?}");
            prop_assert_eq!(t.outstanding(), 0);
        }
    }
}
