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
    /// The target exchange its copies are bound for (`None` in an entry a version before
    /// 0.2 wrote: it names the schedule of that id and entry time whatever its target).
    pub target: Option<String>,
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

/// How long a line of copies lives before it is born again even without a redelivery: a
/// copy the broker stored twice without redelivering anything (a publish retried after
/// its confirm was lost, a quorum level dead-lettering twice when its leader changed)
/// forks a schedule into two lines of one birth, which no successor tombstone tells apart;
/// both are born again within this, and the one born last drops the other. It costs one
/// stream entry per schedule this often (or per occurrence, for a rarer schedule).
pub const LINE_RENEWED_EVERY: std::time::Duration = std::time::Duration::from_secs(600);

/// When the copy born at `born` was born, epoch ms.
pub fn born_at_ms(born: u64) -> u64 {
    born >> BIRTH_RANDOM_BITS
}

/// Whether a line born at `born` is due to be born again at `now_ms` (see
/// [`LINE_RENEWED_EVERY`]).
pub fn renewal_due(born: u64, now_ms: u64) -> bool {
    born_at_ms(born).saturating_add(LINE_RENEWED_EVERY.as_millis() as u64) <= now_ms
}

/// The birth of a copy published at `now_ms`, with `random` bits to order copies born in
/// the same millisecond.
pub fn birth(now_ms: u64, random: u32) -> u64 {
    (now_ms << BIRTH_RANDOM_BITS) | u64::from(random & ((1 << BIRTH_RANDOM_BITS) - 1))
}

/// One live successor tombstone of a schedule.
#[derive(Debug, Clone)]
struct Live {
    target: Option<String>,
    after_occurrence: u64,
    born_before: u64,
    expires_at: u64,
}

impl Live {
    /// Whether it is about the copies bound for `target`.
    fn names(&self, target: &str) -> bool {
        self.target.as_deref().is_none_or(|t| t == target)
    }
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
    /// Adds `tombstone`, kept until `grace_ms` after its due time, but no longer than
    /// `longest_ms` from `now_ms` (a due time no schedule can have does not keep it for
    /// ever); false when that has passed at `now_ms`.
    pub fn insert(
        &mut self,
        tombstone: Successors,
        grace_ms: u64,
        longest_ms: u64,
        now_ms: u64,
    ) -> bool {
        let expires_at = tombstone
            .due_at
            .saturating_add(grace_ms)
            .min(now_ms.saturating_add(longest_ms));
        if expires_at <= now_ms {
            return false;
        }
        let key = (tombstone.message_id, tombstone.entered_at);
        self.by_expiry.insert((expires_at, key.0.clone(), key.1));
        self.live.entry(key).or_default().push(Live {
            target: tombstone.target,
            after_occurrence: tombstone.after_occurrence,
            born_before: tombstone.born_before,
            expires_at,
        });
        true
    }

    /// Appends the live ones to `records`, each with when it leaves memory.
    pub fn records(&self, records: &mut Vec<super::Record>) {
        for ((id, entered_at), lives) in &self.live {
            records.extend(lives.iter().map(|live| super::Record::Successors {
                id: id.clone(),
                t: live.target.clone(),
                n: *entered_at,
                a: live.after_occurrence,
                b: live.born_before,
                e: live.expires_at,
            }));
        }
    }

    /// Restores one read from a checkpoint, leaving memory at `expires_at`; false when that
    /// has passed at `now_ms`.
    pub fn restore(&mut self, tombstone: Successors, expires_at: u64, now_ms: u64) -> bool {
        self.insert(tombstone, 0, expires_at.saturating_sub(now_ms), now_ms)
    }

    /// The latest birth a successor tombstone of the schedule `(message_id, entered_at)`
    /// bound for `target` names: a copy born again must be born after it, or its own
    /// line's tombstone would drop it.
    pub fn latest_birth(&self, message_id: &str, target: &str, entered_at: u64) -> Option<u64> {
        self.live
            .get(&(message_id.to_string(), entered_at))?
            .iter()
            .filter(|live| live.names(target))
            .map(|live| live.born_before)
            .max()
    }

    /// True when a successor tombstone drops the copy of `occurrence` of the schedule
    /// `(message_id, entered_at)` bound for `target`, born at `born`.
    pub fn drops(
        &self,
        message_id: &str,
        target: &str,
        entered_at: u64,
        occurrence: u64,
        born: u64,
    ) -> bool {
        self.live
            .get(&(message_id.to_string(), entered_at))
            .is_some_and(|tombstones| {
                tombstones.iter().any(|live| {
                    live.names(target)
                        && occurrence > live.after_occurrence
                        && born < live.born_before
                })
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
            target: Some("orders".into()),
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
        assert!(set.insert(successors(3, older), 60_000, u64::MAX, 10_000));
        assert!(set.insert(successors(3, newer), 60_000, u64::MAX, 10_000));
        assert!(set.drops("digest", "orders", 1_000, 4, older));
        assert!(!set.drops("digest", "orders", 1_000, 4, newer));
    }

    #[test]
    fn a_successor_tombstone_spares_its_own_occurrence_other_schedules_and_later_births() {
        let mut set = SuccessorSet::default();
        set.insert(successors(3, birth(10_000, 0)), 60_000, u64::MAX, 10_000);
        // The occurrence that was delivered (redelivered, it must go on).
        assert!(!set.drops("digest", "orders", 1_000, 3, birth(9_000, 0)));
        // A replacement schedule with the same id entered later.
        assert!(!set.drops("digest", "orders", 2_000, 4, birth(9_000, 0)));
        assert!(!set.drops("other", "orders", 1_000, 4, birth(9_000, 0)));
        // A later copy of a later occurrence.
        assert!(!set.drops("digest", "orders", 1_000, 5, birth(11_000, 0)));
        assert!(set.drops("digest", "orders", 1_000, 5, birth(9_000, 0)));
    }

    #[test]
    fn a_line_is_renewed_once_it_is_older_than_the_renewal_period() {
        let period = LINE_RENEWED_EVERY.as_millis() as u64;
        let born = birth(1_000_000, 5);
        assert_eq!(born_at_ms(born), 1_000_000);
        assert!(!renewal_due(born, 1_000_000 + period - 1));
        assert!(renewal_due(born, 1_000_000 + period));
        let mut set = SuccessorSet::default();
        assert_eq!(set.latest_birth("digest", "orders", 1_000), None);
        set.insert(successors(3, birth(10_000, 1)), 60_000, u64::MAX, 10_000);
        set.insert(successors(4, birth(12_000, 1)), 60_000, u64::MAX, 10_000);
        assert_eq!(
            set.latest_birth("digest", "orders", 1_000),
            Some(birth(12_000, 1))
        );
    }

    #[test]
    fn a_successor_tombstone_names_its_target_and_an_old_one_every_target() {
        let mut set = SuccessorSet::default();
        set.insert(successors(3, birth(10_000, 0)), 60_000, u64::MAX, 10_000);
        assert!(!set.drops("digest", "payments", 1_000, 4, birth(9_000, 0)));
        assert_eq!(set.latest_birth("digest", "payments", 1_000), None);
        let before_0_2 = Successors {
            target: None,
            ..successors(5, birth(10_000, 0))
        };
        set.insert(before_0_2, 60_000, u64::MAX, 10_000);
        assert!(set.drops("digest", "payments", 1_000, 6, birth(9_000, 0)));
    }

    #[test]
    fn a_successor_tombstone_is_kept_no_longer_than_the_longest_bound() {
        let mut set = SuccessorSet::default();
        let forever = Successors {
            due_at: u64::MAX,
            ..successors(3, birth(10_000, 0))
        };
        assert!(set.insert(forever, 60_000, 100_000, 10_000));
        assert_eq!(set.next_expiry(), Some(110_000));
    }

    #[test]
    fn births_order_by_millisecond_before_their_random_bits() {
        assert!(birth(10_000, u32::MAX) < birth(10_001, 0));
        assert!(birth(10_000, 1) < birth(10_000, 2));
    }

    #[test]
    fn successor_tombstones_expire_a_grace_after_their_due_time() {
        let mut set = SuccessorSet::default();
        set.insert(successors(3, birth(10_000, 0)), 5_000, u64::MAX, 10_000);
        assert_eq!(set.next_expiry(), Some(55_000));
        assert_eq!(set.expire(54_999), 0);
        assert_eq!(set.len(), 1);
        assert_eq!(set.expire(55_000), 1);
        assert!(set.is_empty());
        assert!(
            !set.insert(successors(3, 1), 5_000, u64::MAX, 55_000),
            "already expired"
        );
    }
}
