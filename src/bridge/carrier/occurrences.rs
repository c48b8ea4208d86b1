//! A recurring schedule's occurrences as the carrier meets them: what delivering one means
//! (checked against this bridge's limits: pure), the copy of the next one after a delivery,
//! and the line a copy belongs to (a schedule taken in replaces its older ones; a
//! redelivered copy is born again), each entry confirmed before the delivery is acked.

use std::sync::atomic::Ordering;

use super::publish::{Attempt, Publishing, signed};
use super::{Outcome, Stop, steps};
use crate::bridge::Shared;
use crate::bridge::inlet::Tag;
use crate::cancel::Successors;
use crate::clock::now_ms;
use crate::config::Config;
use crate::contract::{Envelope, consumed_properties};
use crate::recurring::{self, Delivering, Occurrence, Recurrence};

/// For a copy of a recurring schedule delivered at `now` (epoch ms): its occurrence, and what delivering it now
/// means (skipped occurrences, the next one). `None` for any other message, and for a
/// copy whose schedule no longer reads (it is delivered once, and the schedule ends).
pub(super) fn occurrence(
    config: &Config,
    envelope: &Envelope,
    now: u64,
) -> Option<(Occurrence, Delivering)> {
    let number = envelope.occurrence?;
    let headers = envelope.properties.headers.clone().unwrap_or_default();
    let recurrence = match Recurrence::from_headers(&headers, true) {
        Ok(Some(recurrence)) => recurrence,
        other => {
            tracing::error!(
                message_id = ?envelope.properties.message_id,
                ?other,
                "a recurring schedule's copy no longer reads as one: delivered once, and the schedule ends"
            );
            return None;
        }
    };
    let occurrence = Occurrence {
        number,
        due_ms: envelope.deliver_at,
    };
    let mut delivering = recurrence.delivering(occurrence, now);
    // Held to this bridge's limits at every occurrence, not only at intake: a copy an
    // older version or another configuration took in, or one whose rule changed on the
    // way (possible without a state key), costs no more than a new one may. Checked
    // on the gaps around the next occurrence, one search more than delivering takes
    // (the full check at intake looks further); only while another one follows.
    if let Some(next) = delivering.next
        && let Some(why) = beyond_limits(config, &recurrence, occurrence, next, now)
    {
        tracing::warn!(
            message_id = ?envelope.properties.message_id,
            why,
            "a recurring schedule is beyond this bridge's limits: this occurrence is delivered, and the schedule ends"
        );
        delivering.next = None;
    }
    Some((occurrence, delivering))
}

/// Why a schedule whose `current` occurrence is delivered at `now_ms`, `next` following
/// it, is beyond this bridge's limits, if it is: the gap after `next` under the smallest
/// recurring interval (or the smallest level, if longer), or `next` further than
/// `delays.max_delay` away.
fn beyond_limits(
    config: &Config,
    recurrence: &Recurrence,
    current: Occurrence,
    next: Occurrence,
    now_ms: u64,
) -> Option<&'static str> {
    let shortest = recurring::MIN_INTERVAL.max(config.ladder.smallest());
    let following = recurrence.rule.next_after(next.due_ms);
    if following.is_some_and(|f| f.saturating_sub(next.due_ms) < shortest.as_millis() as u64) {
        return Some("occurrences closer together than the smallest recurring interval");
    }
    let wait = next.due_ms.saturating_sub(now_ms.max(current.due_ms));
    (wait > config.max_delay.as_millis() as u64)
        .then_some("occurrences further apart than delays.max_delay")
}

/// What becomes of a copy of a recurring occurrence's line before its next step (see
/// [`Occurrences::renew_line`]).
pub(super) enum Line {
    /// It goes on as it is.
    AsIs,
    /// It goes on as this copy, with a new birth.
    Renewed(Box<Envelope>),
    /// A cancel or a replacement drops it: its delivery is done with.
    Dropped,
}

/// A recurring schedule's line and next copy, borrowed from the carrier: the bridge's
/// shared state it reads (the names, the state keys, the cancels, the bridge's user, the
/// counters and instruments) and the session's publishing, which takes its entries in the
/// cancel stream and its next copies.
#[derive(Clone, Copy)]
pub(super) struct Occurrences<'a> {
    /// The bridge's shared state.
    shared: &'a Shared,
    /// Publishes the cancel-stream entries and the next copies.
    publishing: &'a Publishing,
}

impl<'a> Occurrences<'a> {
    /// Occurrences with `shared` state, published on `publishing`.
    pub(super) fn new(shared: &'a Shared, publishing: &'a Publishing) -> Self {
        Self { shared, publishing }
    }

    /// After an occurrence of a recurring schedule was delivered: the copy of the next
    /// occurrence through the work exchange, confirmed before the delivery is acknowledged.
    /// A delivery given back after that (a crash, a lost session) comes again redelivered:
    /// it delivers its occurrence a second time at most, and is born again first
    /// ([`Occurrences::reborn`]), which drops the next copy published here.
    pub(super) async fn schedule_next(
        self,
        tag: Tag,
        body: &[u8],
        envelope: &Envelope,
        occurrence: Occurrence,
        delivering: Delivering,
    ) -> Outcome {
        let instruments = &self.shared.instruments;
        instruments.occurrence(delivering.skipped);
        let Some(next) = delivering.next else {
            tracing::debug!(
                occurrence = occurrence.number,
                "the recurring schedule ended"
            );
            return Ok(());
        };
        let names = &self.shared.config.names;
        // The next copy keeps this one's birth (its line): only a rebirth gives a new one.
        let next_copy = Envelope {
            deliver_at: next.due_ms,
            hops: 0,
            occurrence: Some(next.number),
            ..envelope.clone()
        };
        let returns = names.returns_queue();
        let copy = Attempt::own(
            tag,
            &returns,
            &self.shared.work_exchange,
            envelope.routing_key.as_str(),
            body,
            signed(&self.shared.config, consumed_properties(&next_copy), body),
        );
        self.publishing.own(copy).await?;
        tracing::debug!(
            occurrence = next.number,
            due_in_ms = next.due_ms as i64 - now_ms() as i64,
            "next occurrence scheduled"
        );
        Ok(())
    }

    /// Where a copy of a recurring occurrence starts a line of its own:
    /// - taken in: the schedule replaces what its id named before on its target
    ///   ([`Occurrences::replace_older`]), and its copies are born now;
    /// - redelivered: born again ([`Occurrences::reborn`]) unless a cancel or a replacement
    ///   drops it; successor tombstones do not, for it may be the last copy of its
    ///   schedule (its own rebirth's tombstone names a birth it never published);
    /// - its line older than [`LINE_RENEWED_EVERY`](crate::cancel::LINE_RENEWED_EVERY):
    ///   born again unless anything drops it, so a fork no redelivery flagged heals.
    pub(super) async fn renew_line(
        self,
        tag: Tag,
        envelope: &Envelope,
        taken_in: bool,
        redelivered: bool,
    ) -> Result<Line, Stop> {
        if taken_in {
            self.replace_older(tag, envelope).await?;
            return Ok(Line::Renewed(Box::new(Envelope {
                born: crate::cancel::birth(now_ms(), rand::random()),
                ..envelope.clone()
            })));
        }
        let dropped = if redelivered {
            self.cancels_schedule(envelope)
        } else if crate::cancel::renewal_due(envelope.born, now_ms()) {
            steps::cancelled(self.shared, envelope)
        } else {
            return Ok(Line::AsIs);
        };
        if dropped {
            return Ok(Line::Dropped);
        }
        self.reborn(tag, envelope)
            .await
            .map(|copy| Line::Renewed(Box::new(copy)))
    }

    /// `properties` of an entry this bridge appends to the cancel stream, marked as a
    /// bridge's (its `user_id`, signed when a state key is set), so that readers tell it from
    /// a canceller's (see [`crate::cancel::trust`]).
    fn own_entry(self, properties: lapin::BasicProperties) -> lapin::BasicProperties {
        self.shared.authority.own(properties, b"")
    }

    /// True when a cancel or a later schedule's replacement drops this copy of a recurring
    /// schedule (successor tombstones aside).
    fn cancels_schedule(self, envelope: &Envelope) -> bool {
        let Some(id) = envelope.properties.message_id.as_ref() else {
            return false;
        };
        let dropped = self
            .shared
            .tombstones
            .lock()
            .expect("tombstone lock")
            .cancels_schedule(id.as_str(), &envelope.target, envelope.entered_at);
        if dropped {
            self.shared.stats.cancelled.fetch_add(1, Ordering::Relaxed);
        }
        dropped
    }

    /// A copy of a recurring occurrence is born again: a successor tombstone ("of this
    /// schedule, drop every copy of this occurrence or a later one born before now") into
    /// the cancel stream, confirmed, then the copy carried on with that birth, which every
    /// later copy of its line keeps. What its line published before its delivery was given
    /// back (a hop, or the next occurrence after a delivery) is then dropped at its next
    /// step, and of two lines (two copies in flight redelivered, or a fork no redelivery
    /// flagged, renewed) the one born again last lives; so a schedule does not run twice.
    /// The stream takes an entry for a redelivery and once per
    /// [`LINE_RENEWED_EVERY`](crate::cancel::LINE_RENEWED_EVERY), never per occurrence of a
    /// frequent schedule.
    async fn reborn(self, tag: Tag, envelope: &Envelope) -> Result<Envelope, Stop> {
        let (Some(number), Some(id)) = (envelope.occurrence, &envelope.properties.message_id)
        else {
            return Ok(envelope.clone());
        };
        // After its own line's birth and every birth a successor tombstone of its schedule
        // names, whatever this instance's clock says: a copy born before a tombstone it
        // knows of would be dropped by it.
        let latest = self
            .shared
            .tombstones
            .lock()
            .expect("tombstone lock")
            .latest_birth(id.as_str(), &envelope.target, envelope.entered_at)
            .unwrap_or(0);
        let born = crate::cancel::birth(now_ms(), rand::random())
            .max(envelope.born.saturating_add(1))
            .max(latest.saturating_add(1));
        // Kept until the latest copy it may have to drop is due: this occurrence's twin,
        // or the next occurrence that twin published.
        let headers = envelope.properties.headers.clone().unwrap_or_default();
        let current = Occurrence {
            number,
            due_ms: envelope.deliver_at,
        };
        let due_at = Recurrence::from_headers(&headers, true)
            .ok()
            .flatten()
            .and_then(|recurrence| recurrence.delivering(current, now_ms()).next)
            .map_or(envelope.deliver_at, |next| {
                next.due_ms.max(envelope.deliver_at)
            });
        let successors = Successors {
            message_id: id.to_string(),
            target: Some(envelope.target.clone()),
            entered_at: envelope.entered_at,
            after_occurrence: number.saturating_sub(1),
            born_before: born,
            due_at,
        };
        let cancel_exchange = self.shared.config.names.cancel_exchange();
        let tombstone = Attempt::stream_entry(
            tag,
            &cancel_exchange,
            self.own_entry(crate::cancel::successors_properties(
                id.clone(),
                &successors,
            )),
        );
        self.publishing.own(tombstone).await?;
        tracing::debug!(occurrence = number, "redelivered occurrence born again");
        Ok(Envelope {
            born,
            ..envelope.clone()
        })
    }

    /// A recurring schedule taken in replaces the schedules of its id bound for its target
    /// that entered before it (a schedule's replacement in the cancel stream, confirmed
    /// before its first hop). A one-off message of the id, or another target's schedule,
    /// is not touched: publishing is not cancelling.
    async fn replace_older(self, tag: Tag, envelope: &Envelope) -> Outcome {
        let Some(id) = envelope.properties.message_id.clone() else {
            return Ok(());
        };
        let cancel_exchange = self.shared.config.names.cancel_exchange();
        let attempt = Attempt::stream_entry(
            tag,
            &cancel_exchange,
            self.own_entry(crate::cancel::replaced_properties(
                id,
                &envelope.target,
                envelope.entered_at.saturating_sub(1),
            )),
        );
        self.publishing.own(attempt).await
    }
}
