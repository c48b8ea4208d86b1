//! The steps of one decoded message, as the planner decides them: hop into a level, wait
//! for a hop window, hold until due, deliver to its target, or park; a cancelled copy is
//! dropped before its next step.

use std::sync::atomic::Ordering;
use std::time::Duration;

use lapin::types::ShortString;

use super::occurrences::{self, Line};
use super::planner::{self, Decision, Situation};
use super::publish::Attempt;
use super::settling::{Destination, Settled};
use super::{Carrier, Decoded, Event, Outcome, Stop};
use crate::bridge::BridgeError;
use crate::bridge::inlet::{Inlet, Tag};
use crate::bridge::turns::Lane;
use crate::clock::{now_ms, until_epoch_ms};
use crate::contract::{
    self, Envelope, ParkReason, Parked, consumed_properties, delivery_properties, hop_properties,
    parked_properties,
};
use crate::recurring;

impl Carrier {
    /// Hops, holds and delivers a decoded message until a replacement is confirmed, as
    /// [`planner::decide`] says at each step.
    pub(super) async fn carry(&self, moving: &Decoded) -> Outcome {
        let config = &self.shared.config;
        let Decoded {
            tag,
            body,
            envelope,
            read_at,
            waits_here,
            lane,
            taken_in,
            redelivered,
        } = moving;
        let renewed;
        let envelope = match envelope.occurrence {
            Some(_) => {
                match Box::pin(self.renew_line(*tag, envelope, *taken_in, *redelivered)).await? {
                    Line::Renewed(copy) => {
                        renewed = *copy;
                        &renewed
                    }
                    Line::AsIs => envelope,
                    Line::Dropped => return Ok(()),
                }
            }
            None => envelope,
        };
        let rules = self.rules();
        let mut situation = Situation {
            now_ms: now_ms(),
            deliver_at: envelope.deliver_at,
            // Only while every instance on the prefix reads bundles (`peers` opens the
            // gate).
            bundled: self.gate.is_open(),
            in_window: config.hop_window.is_zero(),
            waits_here: *waits_here,
            from_work: tag.inlet == Inlet::Work,
        };
        loop {
            if self.cancelled(envelope) {
                return Ok(());
            }
            situation.now_ms = now_ms();
            match planner::decide(&situation, &rules) {
                Decision::Bundle { level, leaves_at } => {
                    match Box::pin(self.hop_bundled(*tag, body, envelope, level, leaves_at)).await {
                        Some(outcome) => return outcome,
                        // Its bundle was refused: it hops alone.
                        None => situation.bundled = false,
                    }
                }
                Decision::AwaitWindow(end) => {
                    situation.in_window = true;
                    tokio::select! {
                        _ = tokio::time::sleep(until_epoch_ms(end)) => {}
                        _ = self.stop.cancelled() => return Err(Stop::Release),
                    }
                }
                // Boxed: the task's own future is then only as large as its hold, which is
                // where most deliveries wait.
                Decision::Hop(level) => {
                    return Box::pin(self.hop(*tag, body, envelope, level)).await;
                }
                Decision::Hold { counted } => {
                    if !self.hold(*tag, envelope.deliver_at, counted).await {
                        return Err(Stop::Release);
                    }
                }
                Decision::Deliver => {
                    return Box::pin(self.deliver(*tag, body, envelope, *read_at, lane.as_ref()))
                        .await;
                }
            }
        }
    }

    /// Waits until `deliver_at` (epoch ms), with the delivery `tag` counted as held when
    /// `counted`; false when the session stopped first.
    async fn hold(&self, tag: Tag, deliver_at: u64, counted: bool) -> bool {
        if counted {
            let _ = self.events.send(Event::Held(tag));
        }
        // Sleep to the due instant itself (µs precision), not to a whole-ms remainder, so
        // the timer adds at most its own 1 ms tick.
        tokio::select! {
            _ = tokio::time::sleep(until_epoch_ms(deliver_at)) => true,
            _ = self.stop.cancelled() => false,
        }
    }

    /// True when a tombstone covers this copy: it is dropped (acked with nothing replacing
    /// it), at its next hop or before its delivery.
    pub(super) fn cancelled(&self, envelope: &Envelope) -> bool {
        let Some(id) = envelope.properties.message_id.as_ref() else {
            return false;
        };
        let mut tombstones = self.shared.tombstones.lock().expect("tombstone lock");
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
            self.shared.stats.cancelled.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(
                message_id = %id,
                hops = envelope.hops,
                due_in_ms = envelope.deliver_at as i64 - now_ms() as i64,
                "cancelled: dropped"
            );
        }
        dropped
    }

    /// Hops a message alone into the level queue of `level`, through the default exchange.
    async fn hop(&self, tag: Tag, body: &[u8], envelope: &Envelope, level: Duration) -> Outcome {
        let queue = self.shared.config.names.level_queue(level);
        let attempt = Attempt::own(
            tag,
            &queue,
            "",
            &queue,
            body,
            self.signed(hop_properties(envelope), body),
        );
        match self.publishing.until_settled(attempt).await? {
            Settled::Routed => {
                self.shared.stats.hops.fetch_add(1, Ordering::Relaxed);
                tracing::trace!(queue, hops = envelope.hops.saturating_add(1), "hop");
                Ok(())
            }
            Settled::Park(parked) => self.park_read(tag, body, envelope, parked).await,
        }
    }

    /// Parks a message: `consumed` are the properties it was read with; `vouched` when the
    /// bridge state in them is the bridge's own, so that the parked copy is signed (see
    /// [`Undecodable::vouched`](super::Undecodable::vouched)).
    pub(super) async fn park(
        &self,
        tag: Tag,
        body: &[u8],
        routing_key: &ShortString,
        consumed: &lapin::BasicProperties,
        parked: &Parked,
        vouched: bool,
    ) -> Outcome {
        // The detail can quote a header value: only at debug.
        tracing::warn!(
            reason = parked.reason.as_str(),
            message_id = ?consumed.message_id().as_ref().map(|m| m.as_str()),
            "parking message"
        );
        tracing::debug!(reason = parked.reason.as_str(), detail = %parked.detail, "parked detail");
        let exchange = self.shared.config.names.parked_exchange();
        let parked_at = now_ms();
        let vouch = |properties| match vouched {
            true => self.signed(properties, body),
            false => properties,
        };
        let mut properties = vouch(parked_properties(consumed, parked, parked_at));
        if !contract::fits_frame(&properties, self.publishing.frame_max()) {
            properties = vouch(contract::parked_properties_without_headers(
                consumed, parked, parked_at,
            ));
        }
        let attempt = Attempt::parked(tag, &exchange, routing_key.as_str(), body, properties);
        match self.publishing.until_settled(attempt).await? {
            Settled::Routed => {
                self.shared.stats.parked.fetch_add(1, Ordering::Relaxed);
                self.shared.instruments.parked(parked.reason);
                Ok(())
            }
            // The broker refuses a body this large anywhere now (its max message size was
            // lowered under messages already in the levels): retrying cannot help, and
            // leaving it to the broker would bring it back for ever. Park what it accepts.
            Settled::Park(again) if again.reason == ParkReason::TooLarge && !body.is_empty() => {
                tracing::error!(
                    body_bytes = body.len(),
                    message_id = ?consumed.message_id().as_ref().map(|m| m.as_str()),
                    "the broker refuses this message's body even in the parked queue: parking it without its body"
                );
                let without_body = Parked::new(
                    parked.reason,
                    format!(
                        "{}; its body ({} bytes) was removed: the broker refused it even in the parked queue ({})",
                        parked.detail,
                        body.len(),
                        again.detail
                    ),
                );
                // Its body is gone: never replayed as if it were the message.
                Box::pin(self.park(tag, &[], routing_key, consumed, &without_body, false)).await
            }
            // The parked queue refuses it too: leave it to the broker and say why.
            Settled::Park(again) => Err(Stop::Failed(BridgeError::OwnQueueMissing(format!(
                "the parked queue refused a message ({}: {})",
                again.reason, again.detail
            )))),
        }
    }

    /// Publishes a message due now to its target, then (for a recurring schedule) its next
    /// occurrence; a target that will not take it parks it.
    async fn deliver(
        &self,
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
        match self.publishing.until_settled(attempt).await? {
            Settled::Routed => {
                let confirmed_at = now_ms();
                self.shared.stats.delivered.fetch_add(1, Ordering::Relaxed);
                let instruments = &self.shared.instruments;
                instruments
                    .lateness
                    .record((confirmed_at as f64 - envelope.deliver_at as f64) / 1000.0);
                instruments
                    .read_lateness
                    .record(read_at.saturating_sub(envelope.deliver_at) as f64 / 1000.0);
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
                        Box::pin(self.schedule_next(tag, body, envelope, occurrence, delivering))
                            .await
                    }
                    None => Ok(()),
                }
            }
            Settled::Park(parked) => self.park_read(tag, body, envelope, parked).await,
        }
    }

    /// Parks a message that was decoded, from its envelope (boxed: parking is rare, and the
    /// delivery future stays small without it).
    async fn park_read(
        &self,
        tag: Tag,
        body: &[u8],
        envelope: &Envelope,
        parked: Parked,
    ) -> Outcome {
        let consumed = consumed_properties(envelope);
        Box::pin(self.park(tag, body, &envelope.routing_key, &consumed, &parked, true)).await
    }
}
