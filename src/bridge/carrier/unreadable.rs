//! Deliveries the AMQP codec cannot read in full (a routing key, a header name or a
//! property that is not UTF-8; AMQP says they are, and the broker passes on any bytes):
//! parked `unreadable` within the session, like any message the bridge cannot carry, with
//! the original property bytes and the routing key's bytes kept in headers and the body as
//! it came. The connection reads them as bytes ([`crate::amqp::wire::Raw`]), so none of
//! them costs a session.

use std::sync::atomic::Ordering;

use super::publish::Attempt;
use super::settling::Settled;
use super::{Carrier, Outcome, Stop};
use crate::amqp::wire::Raw;
use crate::bridge::BridgeError;
use crate::bridge::inlet::Tag;
use crate::clock::now_ms;
use crate::contract::{self, ParkReason};

impl Carrier {
    /// Parks a delivery that could not be read: `raw` is what could not, `body` its body.
    pub(super) async fn park_unreadable(&self, tag: Tag, raw: &Raw, body: &[u8]) -> Outcome {
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
