//! Successor tombstones: how the copies of a recurring schedule's occurrence that a
//! redelivery made twice are cut back to one.
//!
//! A copy of occurrence `n` is carried on a delivery that is acknowledged only once what
//! replaces it is confirmed: a hop into a level, or after its delivery, the copy of the next
//! occurrence. When that delivery is given back instead (a crash, a lost session), the
//! broker redelivers it, and what was already published lives on beside what the
//! redelivery publishes: every later occurrence would come twice. So a redelivered copy of
//! an occurrence is first born again: the bridge appends a successor tombstone to the
//! cancel stream, "of the schedule `(message_id, entered_at)`, drop every copy of an
//! occurrence after `n - 1` born before `born`", with `born` its new birth, and carries the
//! copy on with it. Births are ordered (epoch milliseconds, then random bits), and the copy
//! of each next occurrence keeps its parent's birth: a birth names a line of copies. What
//! the lost carrier published belongs to the older line and is dropped at its next step;
//! when a crash leaves two lines (copies of two occurrences, both redelivered and born
//! again), the one born again last drops the other. Only redeliveries write to the
//! stream: a schedule delivered in the ordinary way adds nothing, however long it runs
//! (before 0.2 each delivered occurrence appended one, naming the fresh birth of the next
//! copy: such entries mean the same). A successor tombstone leaves memory a grace after
//! the latest occurrence it names was due.

use std::collections::{BTreeSet, HashMap};

/// A successor tombstone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Successors {
    /// The schedule's id.
    pub message_id: String,
    /// When the schedule entered (every copy of it carries this).
    pub entered_at: u64,
    /// Copies of the occurrences after this one are dropped...
    pub after_occurrence: u64,
    /// ...when born before this.
    pub born_before: u64,
    /// When the next occurrence is due, epoch ms: the tombstone leaves memory a grace
    /// after it.
    pub due_at: u64,
}

/// Random bits in a birth below its milliseconds.
const BIRTH_RANDOM_BITS: u32 = 20;

/// The birth of a copy published at `now_ms`, with `random` bits to order copies born in
/// the same millisecond.
pub fn birth(now_ms: u64, random: u32) -> u64 {
    (now_ms << BIRTH_RANDOM_BITS) | u64::from(random & ((1 << BIRTH_RANDOM_BITS) - 1))
}

/// One live successor tombstone of a schedule.
#[derive(Debug, Clone, Copy)]
struct Live {
    after_occurrence: u64,
    born_before: u64,
    expires_at: u64,
}

/// The live successor tombstones, bounded by time.
#[derive(Debug, Clone, Default)]
pub struct SuccessorSet {
    /// (id, entered at) → each live one of that schedule.
    live: HashMap<(String, u64), Vec<Live>>,
    /// (expires at, id, entered at), to expire in order.
    by_expiry: BTreeSet<(u64, String, u64)>,
}

impl SuccessorSet {
    /// Adds `tombstone`, kept until `grace_ms` after its due time; false when that has
    /// passed at `now_ms`.
    pub fn insert(&mut self, tombstone: Successors, grace_ms: u64, now_ms: u64) -> bool {
        let expires_at = tombstone.due_at.saturating_add(grace_ms);
        if expires_at <= now_ms {
            return false;
        }
        let key = (tombstone.message_id, tombstone.entered_at);
        self.by_expiry.insert((expires_at, key.0.clone(), key.1));
        self.live.entry(key).or_default().push(Live {
            after_occurrence: tombstone.after_occurrence,
            born_before: tombstone.born_before,
            expires_at,
        });
        true
    }

    /// True when a successor tombstone drops the copy of `occurrence` of the schedule
    /// `(message_id, entered_at)` born at `born`.
    pub fn drops(&self, message_id: &str, entered_at: u64, occurrence: u64, born: u64) -> bool {
        self.live
            .get(&(message_id.to_string(), entered_at))
            .is_some_and(|tombstones| {
                tombstones
                    .iter()
                    .any(|live| occurrence > live.after_occurrence && born < live.born_before)
            })
    }

    /// Removes what expired by `now_ms`; how many it removed.
    pub fn expire(&mut self, now_ms: u64) -> usize {
        let mut removed = 0;
        while let Some((expires_at, _, _)) = self.by_expiry.first() {
            if *expires_at > now_ms {
                break;
            }
            let (expires_at, id, entered_at) = self.by_expiry.pop_first().expect("first exists");
            let key = (id, entered_at);
            if let Some(tombstones) = self.live.get_mut(&key) {
                let before = tombstones.len();
                tombstones.retain(|live| live.expires_at != expires_at);
                removed += before - tombstones.len();
                if tombstones.is_empty() {
                    self.live.remove(&key);
                }
            }
        }
        removed
    }

    /// The next time something expires, epoch ms.
    pub fn next_expiry(&self) -> Option<u64> {
        self.by_expiry.first().map(|(at, _, _)| *at)
    }

    /// How many are live.
    pub fn len(&self) -> usize {
        self.live.values().map(Vec::len).sum()
    }

    /// True when none is live.
    pub fn is_empty(&self) -> bool {
        self.live.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn successors(after_occurrence: u64, born_before: u64) -> Successors {
        Successors {
            message_id: "digest".into(),
            entered_at: 1_000,
            after_occurrence,
            born_before,
            due_at: 50_000,
        }
    }

    #[test]
    fn of_two_copies_of_the_next_occurrence_the_one_born_last_survives() {
        let (older, newer) = (birth(10_000, 7), birth(10_000, 9));
        let mut set = SuccessorSet::default();
        // Each parent's tombstone names the birth of the copy it published.
        assert!(set.insert(successors(3, older), 60_000, 10_000));
        assert!(set.insert(successors(3, newer), 60_000, 10_000));
        assert!(set.drops("digest", 1_000, 4, older));
        assert!(!set.drops("digest", 1_000, 4, newer));
    }

    #[test]
    fn a_successor_tombstone_spares_its_own_occurrence_other_schedules_and_later_births() {
        let mut set = SuccessorSet::default();
        set.insert(successors(3, birth(10_000, 0)), 60_000, 10_000);
        // The occurrence that was delivered (redelivered, it must go on).
        assert!(!set.drops("digest", 1_000, 3, birth(9_000, 0)));
        // A replacement schedule with the same id entered later.
        assert!(!set.drops("digest", 2_000, 4, birth(9_000, 0)));
        assert!(!set.drops("other", 1_000, 4, birth(9_000, 0)));
        // A later copy of a later occurrence.
        assert!(!set.drops("digest", 1_000, 5, birth(11_000, 0)));
        assert!(set.drops("digest", 1_000, 5, birth(9_000, 0)));
    }

    #[test]
    fn births_order_by_millisecond_before_their_random_bits() {
        assert!(birth(10_000, u32::MAX) < birth(10_001, 0));
        assert!(birth(10_000, 1) < birth(10_000, 2));
    }

    #[test]
    fn successor_tombstones_expire_a_grace_after_their_due_time() {
        let mut set = SuccessorSet::default();
        set.insert(successors(3, birth(10_000, 0)), 5_000, 10_000);
        assert_eq!(set.next_expiry(), Some(55_000));
        assert_eq!(set.expire(54_999), 0);
        assert_eq!(set.len(), 1);
        assert_eq!(set.expire(55_000), 1);
        assert!(set.is_empty());
        assert!(
            !set.insert(successors(3, 1), 5_000, 55_000),
            "already expired"
        );
    }
}
