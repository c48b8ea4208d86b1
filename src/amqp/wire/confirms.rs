//! Publisher confirms owed on one channel: each publish takes the next sequence number, and
//! the broker's `basic.ack` / `basic.nack` settles one number or, with `multiple`, every
//! number up to it. Pure bookkeeping: what waits for a confirm is generic.

use std::collections::BTreeMap;

/// The publishes of one confirm-mode channel not yet settled, by sequence number.
#[derive(Debug)]
pub(super) struct Confirms<T> {
    /// The number the next publish gets (the broker counts from 1).
    next: u64,
    /// What waits for each unsettled publish.
    pending: BTreeMap<u64, T>,
}

impl<T> Confirms<T> {
    /// No publish yet.
    pub(super) fn new() -> Self {
        Self {
            next: 1,
            pending: BTreeMap::new(),
        }
    }

    /// Gives the next publish its sequence number, with `waiter` to settle.
    pub(super) fn register(&mut self, waiter: T) -> u64 {
        let sequence = self.next;
        self.next += 1;
        self.pending.insert(sequence, waiter);
        sequence
    }

    /// The waiters the broker settles with `tag` (every one up to it when `multiple`), in
    /// sequence order. A tag that settles nothing (already settled, or never published)
    /// gives none.
    pub(super) fn settle(&mut self, tag: u64, multiple: bool) -> Vec<T> {
        if multiple {
            let later = self.pending.split_off(&(tag.saturating_add(1)));
            std::mem::replace(&mut self.pending, later)
                .into_values()
                .collect()
        } else {
            self.pending.remove(&tag).into_iter().collect()
        }
    }

    /// Every waiter still unsettled (the channel is gone: none of them will be settled).
    pub(super) fn take_all(&mut self) -> Vec<T> {
        std::mem::take(&mut self.pending).into_values().collect()
    }

    /// How many publishes wait for their confirm.
    pub(super) fn len(&self) -> usize {
        self.pending.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequence_numbers_count_from_one() {
        let mut confirms = Confirms::new();
        assert_eq!(confirms.register('a'), 1);
        assert_eq!(confirms.register('b'), 2);
        assert_eq!(confirms.len(), 2);
    }

    #[test]
    fn a_single_tag_settles_only_its_own_publish() {
        let mut confirms = Confirms::new();
        for waiter in ['a', 'b', 'c'] {
            confirms.register(waiter);
        }
        assert_eq!(confirms.settle(2, false), vec!['b']);
        assert_eq!(confirms.settle(2, false), Vec::<char>::new());
        assert_eq!(confirms.len(), 2);
    }

    #[test]
    fn a_multiple_tag_settles_every_publish_up_to_it_in_order() {
        let mut confirms = Confirms::new();
        for waiter in ['a', 'b', 'c', 'd'] {
            confirms.register(waiter);
        }
        assert_eq!(confirms.settle(2, false), vec!['b']);
        assert_eq!(confirms.settle(3, true), vec!['a', 'c']);
        assert_eq!(confirms.take_all(), vec!['d']);
        assert_eq!(confirms.len(), 0);
    }

    #[test]
    fn a_tag_beyond_every_publish_settles_what_there_is() {
        let mut confirms = Confirms::new();
        confirms.register('a');
        assert_eq!(confirms.settle(u64::MAX, true), vec!['a']);
        assert_eq!(confirms.settle(7, false), Vec::<char>::new());
    }
}
