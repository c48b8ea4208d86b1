//! Cancels dated ahead of the clock, made to mean the same on every reader and after every
//! restart. Pure: the time is a parameter.
//!
//! A tombstone says when its cancel was made (`cancelled_at`, the canceller's clock), and
//! drops the copies that entered at or before it. One dated further ahead than
//! [`CLOCK_ALLOWANCE_MS`] of the bridge's clock (a canceller's clock running fast, or a
//! hostile date) would also drop reschedules published after it, so it counts as made at
//! the reading bridge's now plus the allowance. But a reader's now differs from one read to
//! the next (a restart reads the stream again, later): clamped afresh each time, the same
//! cancel would cover more copies after a restart than it did live.
//!
//! So the clamp is written down once. A bridge following the stream live that reads a
//! tombstone dated ahead holds it and appends a clamp entry (`delay-bridge-kind: clamp`:
//! the tombstone's stream offset, and the time it counts as made); the first clamp entry for
//! an offset is the one every reader applies, then and after any restart. While catching
//! up, a reader cannot tell whether a tombstone was ahead when it was written; it compares
//! it with the latest time a bridge wrote into the stream before it (catch-up markers,
//! clocks, clamps, replacements), holds one dated further ahead than that plus the
//! allowance, applies it as its clamp entry says when one follows, and once caught up,
//! applies as dated what is no longer ahead (no live reader clamped it) and clamps the rest
//! itself, as live. Bridges append a clock entry every [`CLOCK_EVERY`], so what a catch-up
//! holds is at most that long a stretch of cancels.
//!
//! A reader's own clock may be behind the other bridges'. Clamped by a clock 3 s behind, a
//! cancel made on time counts as made 2 s before it was, and every later reader follows
//! that clamp: a message published in those 2 s is delivered though its cancel was
//! confirmed. So a reader also measures how far its clock is behind the stream's: each
//! entry a bridge wrote says when (`delay-bridge-at`), and one read sooner than it was
//! written by the reader's clock says the reader is behind by at least the difference (the
//! largest such difference over the last two [`CLOCK_EVERY`] windows is taken). A reader
//! judges cancels dated ahead by its clock corrected by that much; one further behind than
//! [`CLOCK_CORRECTION_MOST`] writes no clamp at all (the others clamp) and says so.

use std::collections::BTreeMap;
use std::time::Duration;

use super::{CLOCK_ALLOWANCE_MS, Record, Scope, Tombstone};

/// How often a bridge that follows the stream appends a clock entry (a catch-up marker
/// with its time), bounding what a later catch-up holds.
pub const CLOCK_EVERY: Duration = Duration::from_secs(600);

/// The most a reader corrects its clock by, to the stream's (see the module's text); a
/// reader further behind writes no clamp.
pub const CLOCK_CORRECTION_MOST: Duration = Duration::from_secs(60);

/// What to do with a tombstone just read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Read {
    /// Apply it now, as it is.
    Apply(Tombstone),
    /// Held until its clamp entry is read.
    Held,
    /// Held; append this clamp entry for it.
    Clamp(Clamp),
    /// Held, and no clamp written: this reader's clock is further behind the stream's than
    /// [`CLOCK_CORRECTION_MOST`] (by this many ms), so another reader's clamp decides.
    Unclamped(u64),
}

/// How far a reader's clock is behind the times bridges write into the stream: the largest
/// `at - now` of the entries read in the current window of two [`CLOCK_EVERY`] and the one
/// before.
#[derive(Debug, Clone, Copy)]
struct Skew {
    window_start: u64,
    current: i64,
    previous: i64,
}

impl Default for Skew {
    fn default() -> Self {
        Self {
            window_start: 0,
            current: i64::MIN,
            previous: i64::MIN,
        }
    }
}

/// One window of skew samples, ms.
const SKEW_WINDOW_MS: u64 = 2 * CLOCK_EVERY.as_secs() * 1_000;

impl Skew {
    fn sample(&mut self, at_ms: u64, now_ms: u64) {
        let elapsed = now_ms.saturating_sub(self.window_start);
        if elapsed >= SKEW_WINDOW_MS {
            self.previous = if elapsed < 2 * SKEW_WINDOW_MS {
                self.current
            } else {
                i64::MIN
            };
            self.current = i64::MIN;
            self.window_start = now_ms;
        }
        let ahead =
            i64::try_from(at_ms).unwrap_or(i64::MAX) - i64::try_from(now_ms).unwrap_or(i64::MAX);
        self.current = self.current.max(ahead);
    }

    fn behind_ms(&self, now_ms: u64) -> u64 {
        let elapsed = now_ms.saturating_sub(self.window_start);
        let most = if elapsed >= 2 * SKEW_WINDOW_MS {
            i64::MIN
        } else if elapsed >= SKEW_WINDOW_MS {
            self.current
        } else {
            self.current.max(self.previous)
        };
        u64::try_from(most).unwrap_or(0)
    }
}

/// A clamp entry: the tombstone at `offset` counts as made at `cancelled_at`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Clamp {
    /// The tombstone's stream offset.
    pub offset: u64,
    /// Its id (the entry's `message_id`, for reading the stream by eye).
    pub message_id: String,
    /// When it counts as made, epoch ms.
    pub cancelled_at: u64,
}

/// The tombstones dated ahead that a reader holds, and the latest time bridges wrote into
/// the stream before where it reads.
#[derive(Debug, Clone, Default)]
pub struct FutureCancels {
    /// The latest time a bridge wrote into the stream so far, epoch ms (0: none yet).
    stream_clock: u64,
    /// The tombstones held, by stream offset.
    held: BTreeMap<u64, Tombstone>,
    /// True once the reader has caught up with the stream.
    live: bool,
    /// How far this reader's clock is behind the stream's.
    skew: Skew,
}

impl FutureCancels {
    /// A reader at the start of a catch-up.
    pub fn new() -> Self {
        Self::default()
    }

    /// The reader starts catching up again (after a lost session, from where it stopped):
    /// what it holds stays held, and what it reads is judged as in any catch-up.
    pub fn catching_up(&mut self) {
        self.live = false;
    }

    /// Notes a time a bridge wrote into the stream (a marker's, a clamp's, a replacement's).
    pub fn bridge_time(&mut self, at_ms: u64) {
        self.stream_clock = self.stream_clock.max(at_ms);
    }

    /// Notes an entry a bridge wrote at `at_ms`, read at `now_ms`: the stream's clock, and
    /// how far this reader's clock is behind it.
    pub fn bridge_entry(&mut self, at_ms: u64, now_ms: u64) {
        self.bridge_time(at_ms);
        self.skew.sample(at_ms, now_ms);
    }

    /// How far this reader's clock is behind the stream's at `now_ms`, ms (0: not behind).
    pub fn behind_ms(&self, now_ms: u64) -> u64 {
        self.skew.behind_ms(now_ms)
    }

    /// This reader's clock at `now_ms`, corrected by how far it is behind the stream's (at
    /// most [`CLOCK_CORRECTION_MOST`]).
    fn corrected(&self, now_ms: u64) -> u64 {
        let most = CLOCK_CORRECTION_MOST.as_millis() as u64;
        now_ms.saturating_add(self.behind_ms(now_ms).min(most))
    }

    /// The reader's clock is too far behind the stream's to clamp: by this much.
    fn too_far_behind(&self, now_ms: u64) -> Option<u64> {
        let behind = self.behind_ms(now_ms);
        (behind > CLOCK_CORRECTION_MOST.as_millis() as u64).then_some(behind)
    }

    /// A tombstone read at `offset` (none: the broker did not say) at `now_ms`.
    pub fn tombstone(&mut self, offset: Option<u64>, tombstone: Tombstone, now_ms: u64) -> Read {
        let Some(offset) = offset else {
            return Read::Apply(tombstone);
        };
        let reference = if self.live {
            self.corrected(now_ms)
        } else {
            self.stream_clock
        };
        if tombstone.cancelled_at <= reference.saturating_add(CLOCK_ALLOWANCE_MS) {
            return Read::Apply(tombstone);
        }
        if !self.live {
            self.held.insert(offset, tombstone);
            return Read::Held;
        }
        self.held.insert(offset, tombstone.clone());
        match self.too_far_behind(now_ms) {
            Some(behind) => Read::Unclamped(behind),
            None => Read::Clamp(clamp_of(offset, &tombstone, reference)),
        }
    }

    /// A clamp entry read: the tombstone it names, to apply as made at the clamp's time, if
    /// it is held (a later clamp entry for the same offset changes nothing).
    pub fn clamp(&mut self, offset: u64, cancelled_at: u64) -> Option<Tombstone> {
        let mut tombstone = self.held.remove(&offset)?;
        tombstone.cancelled_at = tombstone.cancelled_at.min(cancelled_at);
        Some(tombstone)
    }

    /// The reader has caught up at `now_ms`: what it held and is no longer ahead is applied
    /// as dated; the rest stays held, each with a clamp entry to append.
    pub fn caught_up(&mut self, now_ms: u64) -> (Vec<Tombstone>, Vec<Clamp>) {
        self.live = true;
        let mut apply = Vec::new();
        let mut clamps = Vec::new();
        let reference = self.corrected(now_ms);
        let clamping = self.too_far_behind(now_ms).is_none();
        let ahead = reference.saturating_add(CLOCK_ALLOWANCE_MS);
        self.held.retain(|offset, tombstone| {
            if tombstone.cancelled_at <= ahead {
                apply.push(tombstone.clone());
                false
            } else {
                if clamping {
                    clamps.push(clamp_of(*offset, tombstone, reference));
                }
                true
            }
        });
        (apply, clamps)
    }

    /// What a checkpoint keeps of this: the stream's clock and the tombstones held.
    pub fn records(&self, records: &mut Vec<Record>) {
        records.push(Record::StreamClock {
            at: self.stream_clock,
        });
        records.extend(self.held.iter().map(|(offset, tombstone)| Record::Held {
            o: *offset,
            id: tombstone.message_id.clone(),
            c: tombstone.cancelled_at,
            d: tombstone.due_at,
            t: match &tombstone.scope {
                Scope::Every => None,
                Scope::Schedules { target } => Some(target.clone()),
            },
        }));
    }

    /// Restores one record of a checkpoint; others are not this reader's.
    pub fn restore(&mut self, record: &Record) {
        if record.longest_name() > super::NAME_MOST_BYTES {
            return;
        }
        match record {
            Record::StreamClock { at } => self.bridge_time(*at),
            Record::Held { o, id, c, d, t } => {
                self.held.insert(
                    *o,
                    Tombstone {
                        message_id: id.clone(),
                        cancelled_at: *c,
                        due_at: *d,
                        scope: match t {
                            None => Scope::Every,
                            Some(target) => Scope::Schedules {
                                target: target.clone(),
                            },
                        },
                    },
                );
            }
            _ => {}
        }
    }

    /// How many tombstones are held.
    pub fn held(&self) -> usize {
        self.held.len()
    }
}

fn clamp_of(offset: u64, tombstone: &Tombstone, now_ms: u64) -> Clamp {
    Clamp {
        offset,
        message_id: tombstone.message_id.clone(),
        cancelled_at: now_ms.saturating_add(CLOCK_ALLOWANCE_MS),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(id: &str, at: u64) -> Tombstone {
        Tombstone::every(id, at)
    }

    const HOUR: u64 = 3_600_000;

    #[test]
    fn live_a_cancel_dated_ahead_is_held_until_its_clamp_and_one_on_time_applies() {
        let now = 10 * HOUR;
        let mut reader = FutureCancels::new();
        reader.caught_up(now);
        assert_eq!(
            reader.tombstone(Some(7), t("on-time", now + 500), now),
            Read::Apply(t("on-time", now + 500))
        );
        let Read::Clamp(clamp) = reader.tombstone(Some(8), t("ahead", now + HOUR), now) else {
            panic!("a cancel an hour ahead is clamped");
        };
        assert_eq!(clamp.offset, 8);
        assert_eq!(clamp.cancelled_at, now + CLOCK_ALLOWANCE_MS);
        assert_eq!(reader.held(), 1);
        // The first clamp entry for the offset decides; a second changes nothing.
        assert_eq!(
            reader.clamp(8, now + 400),
            Some(t("ahead", now + 400)),
            "another bridge's clamp came first"
        );
        assert_eq!(reader.clamp(8, clamp.cancelled_at), None);
        assert_eq!(reader.held(), 0);
    }

    #[test]
    fn a_restart_applies_the_clamp_written_live_not_its_own_later_now() {
        let written = 10 * HOUR;
        // Live: a marker at `written`, then the tombstone, then the live reader's clamp.
        let mut live = FutureCancels::new();
        live.bridge_time(written);
        live.caught_up(written);
        let Read::Clamp(clamp) = live.tombstone(Some(5), t("ahead", written + HOUR), written)
        else {
            panic!("clamped live");
        };
        let applied_live = live.clamp(5, clamp.cancelled_at).unwrap();
        // Two hours later, a restart reads the same entries: the tombstone is no longer
        // ahead of the reader's clock, but it was of the stream's when written.
        let later = written + 2 * HOUR;
        let mut restart = FutureCancels::new();
        restart.bridge_time(written);
        assert_eq!(
            restart.tombstone(Some(5), t("ahead", written + HOUR), later),
            Read::Held
        );
        assert_eq!(restart.clamp(5, clamp.cancelled_at), Some(applied_live));
        assert_eq!(restart.caught_up(later), (vec![], vec![]));
    }

    #[test]
    fn a_catch_up_applies_what_no_live_reader_clamped_and_clamps_what_is_still_ahead() {
        let marker = 10 * HOUR;
        let now = marker + HOUR;
        let mut reader = FutureCancels::new();
        reader.bridge_time(marker);
        // Cancelled on time half an hour after the last bridge entry: held, then applied.
        assert_eq!(
            reader.tombstone(Some(1), t("quiet", marker + HOUR / 2), now),
            Read::Held
        );
        // Dated a day ahead and written while no bridge ran: clamped now.
        assert_eq!(
            reader.tombstone(Some(2), t("ahead", now + 24 * HOUR), now),
            Read::Held
        );
        // Not ahead of the stream's clock: applied at once.
        assert_eq!(
            reader.tombstone(Some(3), t("old", marker - 5), now),
            Read::Apply(t("old", marker - 5))
        );
        let (apply, clamps) = reader.caught_up(now);
        assert_eq!(apply, vec![t("quiet", marker + HOUR / 2)]);
        assert_eq!(
            clamps,
            vec![Clamp {
                offset: 2,
                message_id: "ahead".into(),
                cancelled_at: now + CLOCK_ALLOWANCE_MS
            }]
        );
        assert_eq!(reader.held(), 1, "until its clamp is read back");
    }

    /// A reader 3 s behind the other bridges: a cancel made on time by the canceller's (and
    /// the others') clock is no cancel dated ahead to it once it has read another bridge's
    /// entry, so it writes no clamp 2 s early for every later reader to follow.
    #[test]
    fn a_reader_behind_the_stream_judges_by_the_stream_clock() {
        let true_now = 10 * HOUR;
        let behind = 3_000;
        let mut reader = FutureCancels::new();
        reader.caught_up(true_now - behind);
        // Another bridge's clock entry, written a moment ago.
        reader.bridge_entry(true_now - 20, true_now - behind);
        assert_eq!(reader.behind_ms(true_now - behind), behind - 20);
        assert_eq!(
            reader.tombstone(Some(5), t("a", true_now), true_now - behind + 10),
            Read::Apply(t("a", true_now))
        );
        // A canceller an hour fast: clamped by the corrected clock.
        match reader.tombstone(Some(6), t("b", true_now + HOUR), true_now - behind + 20) {
            Read::Clamp(clamp) => {
                assert_eq!(clamp.cancelled_at, true_now + CLOCK_ALLOWANCE_MS);
            }
            other => panic!("{other:?}"),
        }
        // The measure fades: two windows on, with no fresh sample, no correction.
        let later = true_now - behind + 2 * SKEW_WINDOW_MS + 1;
        assert_eq!(reader.behind_ms(later), 0);
    }

    #[test]
    fn a_reader_far_behind_the_stream_writes_no_clamp() {
        let true_now = 10 * HOUR;
        let behind = 120_000;
        let mut reader = FutureCancels::new();
        reader.caught_up(true_now - behind);
        reader.bridge_entry(true_now, true_now - behind);
        assert_eq!(
            reader.tombstone(Some(5), t("a", true_now + HOUR), true_now - behind),
            Read::Unclamped(behind)
        );
        assert_eq!(reader.held(), 1, "held until another reader's clamp");
        assert_eq!(
            reader.clamp(5, true_now + 1_000),
            Some(t("a", true_now + 1_000))
        );
    }

    #[test]
    fn without_an_offset_a_tombstone_is_applied_as_before() {
        let mut reader = FutureCancels::new();
        assert_eq!(
            reader.tombstone(None, t("x", u64::MAX), 0),
            Read::Apply(t("x", u64::MAX))
        );
    }
}
