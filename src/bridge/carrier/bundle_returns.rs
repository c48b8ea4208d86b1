//! The return side of bundles: a bundle that comes back through the work exchange is
//! passed on whole into its next level when all its messages go there together (by the
//! hop side, `bundle_hops`), or carried as its messages, each as a delivery of its own would be. Its delivery is acked once
//! every message in it is settled (hopped again, delivered, parked or dropped). When the
//! session stops first, the messages not yet settled travel on as a bundle of their own
//! through the work exchange before the delivery is acked, so a graceful stop delivers
//! nothing twice. After a failure that renews the session the whole bundle goes back to the
//! broker, and its settled messages come again (at least once, as any delivery unacked at a
//! fault). The hop side is `bundle_hops`.

use std::collections::HashMap;
use std::sync::Arc;

use lapin::BasicProperties;
use lapin::types::ShortString;

use super::bundle_hops::Bundler;
use super::gate::BundleGate;
use super::intake::{Decoded, Reader, Undecodable};
use super::parking::Parking;
use super::publish::{Attempt, signed};
use super::settling::Settled;
use super::{Outcome, Sending, Stop};
use crate::amqp::wire::Delivery;
use crate::bridge::inlet::Tag;
use crate::bridge::turns::{Lane, Lanes};
use crate::clock::now_ms;
use crate::config::Config;
use crate::contract::Parked;
use crate::contract::bundle::{self, Member, Summary};

/// What the bridge is taken to hold per message of a bundle it carries, besides the bundle's
/// body, for the byte budget: a decoded message's task state measured 928 bytes (see
/// docs/performance.md, "Bridge memory is per unacked delivery"), plus its envelope.
pub(super) const HELD_MESSAGE_BYTES: u64 = 1024;

/// A bundle that came back, ready to be carried.
pub(super) enum PreparedBundle {
    /// Its messages, read one by one.
    Read(Bundle),
    /// Back from a level with a header that says when its first and last messages are due:
    /// kept as it came, to be passed on whole if they go on into one level when it is
    /// carried (else read then).
    Sealed(Box<Sealed>),
    /// It could not be read: parked whole.
    Unreadable(Box<Undecodable>),
}

/// A message of a bundle as it was read: decoded, or why it is parked.
pub(super) type Read = Result<Decoded, Box<Undecodable>>;

/// Carries one message a bundle brought back, as a delivery of its own would be: the
/// carrier's step loop, as [`BundleReturns`] sees it.
pub(super) trait CarryMessage {
    /// Carries a decoded message, or parks one that could not be decoded.
    fn carry_message<'a>(&'a self, message: &'a Read) -> impl Future<Output = Outcome> + Send + 'a;
}

/// The messages of a bundle that came back.
pub(super) struct Bundle {
    /// Its delivery.
    tag: Tag,
    /// The routing key it came back with (its level's name).
    routing_key: ShortString,
    /// Each message decoded, or why it is parked.
    messages: Vec<Read>,
}

/// What a bundle's delivery says of every message in it.
#[derive(Clone, Copy)]
pub(super) struct Provenance {
    /// The broker flagged the delivery redelivered (see `Decoded::redelivered`).
    redelivered: bool,
    /// The bridge vouches for the bundle's state (see `Undecodable::vouched`).
    vouched: bool,
}

/// A bundle kept as it came (see [`PreparedBundle::Sealed`]): read only should its messages
/// go apart.
pub(super) struct Sealed {
    /// Its delivery.
    tag: Tag,
    /// The exchange it came back through (the work exchange).
    exchange: ShortString,
    /// The routing key it came back with (its level's name).
    routing_key: ShortString,
    /// Its properties as consumed.
    properties: BasicProperties,
    /// Its body as consumed.
    body: Vec<u8>,
    /// Where it comes from.
    provenance: Provenance,
    /// How many messages it carries.
    count: usize,
    /// What its header says of them.
    summary: Summary,
}

/// Carries the bundles that come back; holds the lanes their messages take turns in at
/// publishing to their targets. One per session: its clones share the lanes.
#[derive(Clone)]
pub(super) struct BundleReturns {
    /// The turns the messages of bundles take at publishing to their targets.
    lanes: Arc<Lanes>,
}

impl BundleReturns {
    /// No lane open yet.
    pub(super) fn new() -> Self {
        Self {
            lanes: Lanes::new(),
        }
    }

    /// Prepares a bundle that came back through the work exchange, read with `reader`:
    /// kept sealed when it came back from a level, hops travel in bundles (`gate`) and its
    /// header says when its first and last messages are due (whether they go on together
    /// is decided once, when it is carried), else read into its messages, each decoded as
    /// a delivery of its own would be (a bundle redelivered too often parks every message
    /// in it `redelivery-limit`).
    pub(super) fn prepare(
        &self,
        reader: Reader<'_>,
        gate: &BundleGate,
        tag: Tag,
        delivery: Delivery,
        redeliveries: Option<u32>,
    ) -> PreparedBundle {
        let Delivery {
            exchange,
            routing_key,
            properties,
            data,
            ..
        } = delivery;
        let unreadable = |body, routing_key, consumed, parked, vouched| {
            PreparedBundle::Unreadable(Box::new(Undecodable {
                tag,
                body,
                routing_key,
                consumed,
                parked,
                vouched,
            }))
        };
        let provenance = match reader.check_signature(&exchange, &properties, &data) {
            Ok(vouched) => Provenance {
                redelivered: redeliveries.is_some(),
                vouched,
            },
            Err(parked) => return unreadable(data, routing_key, properties, parked, false),
        };
        let too_often = reader.redelivered_too_often(&properties, redeliveries);
        let summary = bundle::summary(&properties);
        let count = bundle::count(&properties).and_then(|count| usize::try_from(count).ok());
        if let Some(count) = count
            && too_often.is_none()
            && summary.due.is_some()
            && !back_from_returns(reader.config, &routing_key)
            && gate.is_open()
        {
            return PreparedBundle::Sealed(Box::new(Sealed {
                tag,
                exchange,
                routing_key,
                properties,
                body: data,
                provenance,
                count,
                summary,
            }));
        }
        let read = self.read_bundle(
            reader,
            tag,
            &exchange,
            &routing_key,
            &properties,
            &data,
            too_often,
            provenance,
        );
        match read {
            Ok(bundle) => PreparedBundle::Read(bundle),
            Err(parked) => unreadable(data, routing_key, properties, parked, provenance.vouched),
        }
    }

    /// Reads a bundle's messages from its `properties` and `body` with `reader`, each
    /// decoded (or parked as `too_often` says), with the hops its header says their state
    /// does not count, and `redelivered` when the broker flagged the bundle's delivery so;
    /// why the whole bundle is parked when it cannot be read.
    #[allow(clippy::too_many_arguments)]
    fn read_bundle(
        &self,
        reader: Reader<'_>,
        tag: Tag,
        exchange: &ShortString,
        routing_key: &ShortString,
        properties: &BasicProperties,
        body: &[u8],
        too_often: Option<Parked>,
        provenance: Provenance,
    ) -> Result<Bundle, Parked> {
        let read_at = now_ms();
        let members = bundle::decode_bundle(properties, body)?;
        let uncounted_hops = bundle::summary(properties).uncounted_hops;
        let waits_here = back_from_returns(reader.config, routing_key);
        // A lane per due instant: a burst's messages (due at one instant) take turns as one
        // lane, and each message due after them in the same bundle as a lane of its own,
        // so it waits for a turn of the burst, not behind all of it.
        let mut lanes: HashMap<u64, Lane> = HashMap::new();
        let messages = members
            .into_iter()
            .map(|Member { properties, body }| {
                let decoded = match &too_often {
                    Some(parked) => Err(parked.clone()),
                    None => reader.decode(exchange, routing_key, &properties),
                };
                match decoded {
                    Ok(mut envelope) => {
                        envelope.hops = envelope.hops.saturating_add(uncounted_hops);
                        let lane = lanes
                            .entry(envelope.deliver_at)
                            .or_insert_with(|| self.lanes.open())
                            .join();
                        Ok(Decoded {
                            tag,
                            body: body.to_vec(),
                            envelope,
                            read_at,
                            waits_here,
                            lane: Some(lane),
                            taken_in: false,
                            redelivered: provenance.redelivered,
                        })
                    }
                    Err(parked) => Err(Box::new(Undecodable {
                        tag,
                        body: body.to_vec(),
                        routing_key: routing_key.clone(),
                        consumed: properties,
                        parked,
                        vouched: provenance.vouched,
                    })),
                }
            })
            .collect();
        Ok(Bundle {
            tag,
            routing_key: routing_key.clone(),
            messages,
        })
    }

    /// Carries a bundle that came back, with `sending` and its messages by `carrier`:
    /// passes it on whole (by the `bundler`), or carries every message of it at once (done
    /// when all are), or parks it whole.
    pub(super) async fn carry(
        &self,
        sending: Sending<'_>,
        bundler: &Bundler,
        carrier: &impl CarryMessage,
        prepared: &PreparedBundle,
    ) -> Outcome {
        match prepared {
            PreparedBundle::Read(bundle) => carry_messages(sending, carrier, bundle).await,
            PreparedBundle::Sealed(sealed) => {
                if let Some(outcome) = bundler
                    .pass_whole(
                        sending,
                        sealed.tag,
                        &sealed.summary,
                        sealed.count,
                        &sealed.body,
                    )
                    .await
                {
                    return outcome;
                }
                let read = self.read_bundle(
                    Reader::of(sending.shared),
                    sealed.tag,
                    &sealed.exchange,
                    &sealed.routing_key,
                    &sealed.properties,
                    &sealed.body,
                    None,
                    sealed.provenance,
                );
                match read {
                    Ok(bundle) => carry_messages(sending, carrier, &bundle).await,
                    Err(parked) => {
                        Box::pin(Parking::new(sending.shared, sending.publishing).park(
                            sealed.tag,
                            &sealed.body,
                            &sealed.routing_key,
                            &sealed.properties,
                            &parked,
                            sealed.provenance.vouched,
                        ))
                        .await
                    }
                }
            }
            PreparedBundle::Unreadable(unreadable) => {
                Box::pin(
                    Parking::new(sending.shared, sending.publishing).park_undecodable(unreadable),
                )
                .await
            }
        }
    }
}

/// True for a delivery back from the returns queue (level zero), by the names in
/// `config`: its messages wait out their last moments here; back from a level, they move
/// there first.
fn back_from_returns(config: &Config, routing_key: &ShortString) -> bool {
    routing_key.as_str() == config.names.returns_queue()
}

/// Carries every message of a bundle at once by `carrier`; done when all are (what a stop
/// released is passed on with `sending`).
async fn carry_messages(
    sending: Sending<'_>,
    carrier: &impl CarryMessage,
    bundle: &Bundle,
) -> Outcome {
    let outcomes = futures::future::join_all(
        bundle
            .messages
            .iter()
            .map(|message| carrier.carry_message(message)),
    )
    .await;
    let mut released = Vec::new();
    for (message, outcome) in bundle.messages.iter().zip(outcomes) {
        match outcome {
            Ok(()) => {}
            Err(Stop::Release) => released.push(message),
            Err(Stop::Failed(error)) => return Err(Stop::Failed(error)),
        }
    }
    if released.is_empty() {
        return Ok(());
    }
    pass_on(sending, bundle, &released).await
}

/// Sends the messages of `bundle` a stop released on through the work exchange with
/// `sending`, as a bundle of their own: once that is confirmed, the bundle's delivery is
/// done and none of its settled messages comes again.
async fn pass_on(sending: Sending<'_>, bundle: &Bundle, released: &[&Read]) -> Outcome {
    let members: Option<Vec<Vec<u8>>> = released
        .iter()
        .map(|message| match message {
            Ok(decoded) => bundle::encode_consumed_member(&decoded.envelope, &decoded.body),
            Err(undecodable) => bundle::encode_member(&undecodable.consumed, &undecodable.body),
        })
        .collect();
    // They were read from a bundle, so they fit one; should one not, all go back.
    let Some(members) = members else {
        return Err(Stop::Release);
    };
    let body = bundle::bundle_body(members.iter().map(Vec::as_slice));
    let attempt = Attempt::own(
        bundle.tag,
        "the work queue",
        &sending.shared.work_exchange,
        bundle.routing_key.as_str(),
        &body,
        signed(
            &sending.shared.config,
            bundle::bundle_properties(members.len()),
            &body,
        ),
    );
    match sending.publishing.until_settled(attempt).await {
        Ok(Settled::Routed) => {
            tracing::debug!(
                messages = members.len(),
                "stopping: passed the unsettled messages of a bundle on"
            );
            Ok(())
        }
        Ok(Settled::Park(_)) | Err(Stop::Release) => Err(Stop::Release),
        Err(Stop::Failed(error)) => Err(Stop::Failed(error)),
    }
}
