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

use std::collections::BTreeMap;
use std::time::Duration;

use super::{CLOCK_ALLOWANCE_MS, Record, Scope, Tombstone};

/// How often a bridge that follows the stream appends a clock entry (a catch-up marker
/// with its time), bounding what a later catch-up holds.
pub const CLOCK_EVERY: Duration = Duration::from_secs(600);

/// What to do with a tombstone just read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Read {
    /// Apply it now, as it is.
    Apply(Tombstone),
    /// Held until its clamp entry is read.
    Held,
    /// Held; append this clamp entry for it.
    Clamp(Clamp),
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

    /// A tombstone read at `offset` (none: the broker did not say) at `now_ms`.
    pub fn tombstone(&mut self, offset: Option<u64>, tombstone: Tombstone, now_ms: u64) -> Read {
        let Some(offset) = offset else {
            return Read::Apply(tombstone);
        };
        let reference = if self.live { now_ms } else { self.stream_clock };
        if tombstone.cancelled_at <= reference.saturating_add(CLOCK_ALLOWANCE_MS) {
            return Read::Apply(tombstone);
        }
        if !self.live {
            self.held.insert(offset, tombstone);
            return Read::Held;
        }
        let clamp = clamp_of(offset, &tombstone, now_ms);
        self.held.insert(offset, tombstone);
        Read::Clamp(clamp)
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
        let ahead = now_ms.saturating_add(CLOCK_ALLOWANCE_MS);
        self.held.retain(|offset, tombstone| {
            if tombstone.cancelled_at <= ahead {
                apply.push(tombstone.clone());
                false
            } else {
                clamps.push(clamp_of(*offset, tombstone, now_ms));
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

    #[test]
    fn without_an_offset_a_tombstone_is_applied_as_before() {
        let mut reader = FutureCancels::new();
        assert_eq!(
            reader.tombstone(None, t("x", u64::MAX), 0),
            Read::Apply(t("x", u64::MAX))
        );
    }
}
