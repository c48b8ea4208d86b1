//! The steps that publish a decoded message on, as the carrier's step loop takes them: a
//! hop alone into a level, and the delivery to its target (then, for a recurring schedule,
//! its next occurrence); and the check that drops a cancelled copy before its next step.

use std::sync::atomic::Ordering;
use std::time::Duration;

use super::Outcome;
use super::occurrences::{self, Occurrences};
use super::parking::Parking;
use super::publish::{Attempt, Publishing, signed};
use super::settling::{Destination, Settled};
use crate::bridge::Shared;
use crate::bridge::inlet::Tag;
use crate::bridge::turns::Lane;
use crate::clock::now_ms;
use crate::contract::{Envelope, delivery_properties, hop_properties};
use crate::recurring;

/// The steps that publish a message on, borrowed from the carrier: the bridge's shared
/// state they read (the names, the state keys, the bridge's user, the counters and
/// instruments) and the session's publishing.
#[derive(Clone, Copy)]
pub(super) struct Steps<'a> {
    /// The bridge's shared state.
    shared: &'a Shared,
    /// Publishes hops and deliveries until the broker settles them.
    publishing: &'a Publishing,
}

impl<'a> Steps<'a> {
    /// The steps with `shared` state, published on `publishing`.
    pub(super) fn new(shared: &'a Shared, publishing: &'a Publishing) -> Self {
        Self { shared, publishing }
    }

    /// Hops a message alone into the level queue of `level`, through the default exchange.
    pub(super) async fn hop(
        self,
        tag: Tag,
        body: &[u8],
        envelope: &Envelope,
        level: Duration,
    ) -> Outcome {
        let queue = self.shared.config.names.level_queue(level);
        let attempt = Attempt::own(
            tag,
            &queue,
            "",
            &queue,
            body,
            signed(&self.shared.config, hop_properties(envelope), body),
        );
        match self.publishing.until_settled(attempt).await? {
            Settled::Routed => {
                self.shared.stats.hops.fetch_add(1, Ordering::Relaxed);
                tracing::trace!(queue, hops = envelope.hops.saturating_add(1), "hop");
                Ok(())
            }
            Settled::Park(parked) => self.parking().park_read(tag, body, envelope, parked).await,
        }
    }

    /// Publishes a message due now to its target, then (for a recurring schedule) its next
    /// occurrence; a target that will not take it parks it.
    pub(super) async fn deliver(
        self,
        tag: Tag,
        body: &[u8],
        envelope: &Envelope,
        read_at: u64,
        lane: Option<&Lane>,
    ) -> Outcome {
        let mut properties = delivery_properties(envelope, &self.shared.bridge_user);
        let recurring = occurrences::occurrence(&self.shared.config, envelope, now_ms());
        if let Some((occurrence, delivering)) = &recurring {
            properties = recurring::with_occurrence(properties, *occurrence, delivering);
        }
        let attempt = Attempt {
            tag,
            destination: Destination::Target(&envelope.target),
            exchange: &envelope.target,
            routing_key: envelope.routing_key.as_str(),
            body,
            properties,
            lane,
        };
        match self.publishing.until_settled_sent(attempt).await? {
            (Settled::Routed, sent_at) => {
                let confirmed_at = now_ms();
                self.shared.stats.delivered.fetch_add(1, Ordering::Relaxed);
                let instruments = &self.shared.instruments;
                instruments
                    .lateness
                    .record((confirmed_at as f64 - envelope.deliver_at as f64) / 1000.0);
                instruments
                    .read_lateness
                    .record(read_at.saturating_sub(envelope.deliver_at) as f64 / 1000.0);
                instruments.publish_lateness.record(
                    sent_at
                        .saturating_sub(Duration::from_millis(envelope.deliver_at))
                        .as_secs_f64(),
                );
                instruments
                    .hops_per_message
                    .record(f64::from(envelope.hops));
                tracing::debug!(
                    target = %envelope.target,
                    hops = envelope.hops,
                    late_ms = confirmed_at.saturating_sub(envelope.deliver_at),
                    read_lead_ms = envelope.deliver_at as i64 - read_at as i64,
                    "delivered"
                );
                match recurring {
                    Some((occurrence, delivering)) => {
                        let occurrences = Occurrences::new(self.shared, self.publishing);
                        Box::pin(
                            occurrences.schedule_next(tag, body, envelope, occurrence, delivering),
                        )
                        .await
                    }
                    None => Ok(()),
                }
            }
            (Settled::Park(parked), _) => {
                self.parking().park_read(tag, body, envelope, parked).await
            }
        }
    }

    /// Parking, with the same shared state and publishing.
    fn parking(self) -> Parking<'a> {
        Parking::new(self.shared, self.publishing)
    }
}

/// True when a tombstone in `shared` covers this copy: it is dropped (acked with nothing
/// replacing it), at its next hop or before its delivery, and counted.
pub(super) fn cancelled(shared: &Shared, envelope: &Envelope) -> bool {
    let Some(id) = envelope.properties.message_id.as_ref() else {
        return false;
    };
    let mut tombstones = shared.tombstones.lock().expect("tombstone lock");
    let dropped = match envelope.occurrence {
        Some(occurrence) => tombstones.cancels_occurrence(
            id.as_str(),
            &envelope.target,
            envelope.entered_at,
            occurrence,
            envelope.born,
        ),
        None => tombstones.cancels(id.as_str(), envelope.entered_at),
    };
    drop(tombstones);
    if dropped {
        shared.stats.cancelled.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(
            message_id = %id,
            hops = envelope.hops,
            due_in_ms = envelope.deliver_at as i64 - now_ms() as i64,
            "cancelled: dropped"
        );
    }
    dropped
}
