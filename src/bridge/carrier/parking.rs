//! Parking what the bridge cannot carry: a copy into the parked queue, with why in its
//! headers, confirmed before the delivery is acked. A message is parked with the
//! properties it was read with, signed when the bridge vouches for its state; one the
//! broker refuses even there is parked without its body.
//!
//! Deliveries the AMQP codec cannot read in full (a routing key, a header name or a
//! property that is not UTF-8; AMQP says they are, and the broker passes on any bytes) are
//! parked `unreadable` within the session too, with the original property bytes and the
//! routing key's bytes kept in headers and the body as it came. The connection reads them
//! as bytes ([`crate::amqp::wire::Raw`]), so none of them costs a session.

use std::sync::atomic::Ordering;

use lapin::types::ShortString;

use super::intake::Undecodable;
use super::publish::{Attempt, Publishing, signed};
use super::settling::Settled;
use super::{Outcome, Stop};
use crate::amqp::wire::Raw;
use crate::bridge::inlet::Tag;
use crate::bridge::{BridgeError, Shared};
use crate::clock::now_ms;
use crate::contract::{self, Envelope, ParkReason, Parked, consumed_properties, parked_properties};

/// Parking, borrowed from the carrier: the bridge's shared state it reads (the names, the
/// state keys that sign a copy the bridge vouches for, the counters and instruments) and
/// the session's publishing.
#[derive(Clone, Copy)]
pub(super) struct Parking<'a> {
    /// The bridge's shared state.
    shared: &'a Shared,
    /// Publishes the parked copies.
    publishing: &'a Publishing,
}

impl<'a> Parking<'a> {
    /// Parking with `shared` state, published on `publishing`.
    pub(super) fn new(shared: &'a Shared, publishing: &'a Publishing) -> Self {
        Self { shared, publishing }
    }

    /// Parks a message: `consumed` are the properties it was read with; `vouched` when the
    /// bridge state in them is the bridge's own, so that the parked copy is signed (see
    /// [`Undecodable::vouched`]).
    pub(super) async fn park(
        self,
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
            true => signed(&self.shared.config, properties, body),
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

    /// Parks a delivery that could not be decoded, as it was consumed.
    pub(super) async fn park_undecodable(self, undecodable: &Undecodable) -> Outcome {
        self.park(
            undecodable.tag,
            &undecodable.body,
            &undecodable.routing_key,
            &undecodable.consumed,
            &undecodable.parked,
            undecodable.vouched,
        )
        .await
    }

    /// Parks a message that was decoded, from its envelope (boxed: parking is rare, and the
    /// delivery future stays small without it).
    pub(super) async fn park_read(
        self,
        tag: Tag,
        body: &[u8],
        envelope: &Envelope,
        parked: Parked,
    ) -> Outcome {
        let consumed = consumed_properties(envelope);
        Box::pin(self.park(tag, body, &envelope.routing_key, &consumed, &parked, true)).await
    }

    /// Parks a delivery that could not be read: `raw` is what could not, `body` its body.
    pub(super) async fn park_unreadable(self, tag: Tag, raw: &Raw, body: &[u8]) -> Outcome {
        tracing::warn!(
            reason = ParkReason::Unreadable.as_str(),
            what = raw.what,
            "parking a message the AMQP codec cannot read"
        );
        let parked_at = now_ms();
        let (mut routing_key, mut properties) =
            contract::unreadable_parked(&raw.properties, &raw.routing_key, raw.what, parked_at);
        if !contract::fits_frame(&properties, self.publishing.frame_max()) {
            // The original property bytes filled the frame: the parked copy goes without them.
            (routing_key, properties) =
                contract::unreadable_parked(&[], &raw.routing_key, raw.what, parked_at);
        }
        let exchange = self.shared.config.names.parked_exchange();
        let attempt = Attempt::parked(tag, &exchange, routing_key.as_str(), body, properties);
        match self.publishing.until_settled(attempt).await? {
            Settled::Routed => {
                self.shared.stats.parked.fetch_add(1, Ordering::Relaxed);
                self.shared.instruments.parked(ParkReason::Unreadable);
                Ok(())
            }
            Settled::Park(again) => Err(Stop::Failed(BridgeError::OwnQueueMissing(format!(
                "the parked queue refused a message the AMQP codec cannot read ({}: {})",
                again.reason, again.detail
            )))),
        }
    }
}
