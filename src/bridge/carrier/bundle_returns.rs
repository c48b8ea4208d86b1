//! The return side of bundles: a bundle that comes back through the work exchange is
//! passed on whole into its next level when all its messages go there together, or carried
//! as its messages, each as a delivery of its own would be. Its delivery is acked once
//! every message in it is settled (hopped again, delivered, parked or dropped). When the
//! session stops first, the messages not yet settled travel on as a bundle of their own
//! through the work exchange before the delivery is acked, so a graceful stop delivers
//! nothing twice. After a failure that renews the session the whole bundle goes back to the
//! broker, and its settled messages come again (at least once, as any delivery unacked at a
//! fault). The hop side is `bundle_hops`.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::time::Duration;

use lapin::BasicProperties;
use lapin::types::ShortString;

use super::planner::{self, Decision, Situation};
use super::publish::Attempt;
use super::settling::Settled;
use super::{Carrier, Decoded, Outcome, Stop, Undecodable};
use crate::amqp::wire::Delivery;
use crate::bridge::inlet::{Inlet, Tag};
use crate::bridge::turns::Lane;
use crate::clock::{now_ms, until_epoch_ms};
use crate::contract::Parked;
use crate::contract::bundle::{self, Member, Summary};

/// What the bridge is taken to hold per message of a bundle it carries, besides the bundle's
/// body, for the byte budget: a decoded message's task state measured 928 bytes (see
/// docs/performance.md, "Bridge memory is per unacked delivery"), plus its envelope.
pub(super) const HELD_MESSAGE_BYTES: u64 = 1024;

/// A bundle that came back, ready to be carried.
pub(in crate::bridge) enum PreparedBundle {
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
type Read = Result<Decoded, Box<Undecodable>>;

/// The messages of a bundle that came back.
pub(in crate::bridge) struct Bundle {
    /// Its delivery.
    tag: Tag,
    /// The routing key it came back with (its level's name).
    routing_key: ShortString,
    /// Each message decoded, or why it is parked.
    messages: Vec<Read>,
}

/// A bundle kept as it came (see [`PreparedBundle::Sealed`]): read only should its messages
/// go apart.
/// What a bundle's delivery says of every message in it.
#[derive(Clone, Copy)]
pub(in crate::bridge) struct Provenance {
    /// The broker flagged the delivery redelivered (see `Decoded::redelivered`).
    redelivered: bool,
    /// The bridge vouches for the bundle's state (see `Undecodable::vouched`).
    vouched: bool,
}

pub(in crate::bridge) struct Sealed {
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

impl Carrier {
    /// Prepares a bundle that came back through the work exchange: kept sealed when it came
    /// back from a level, hops travel in bundles and its header says when its first and
    /// last messages are due (whether they go on together is decided once, when it is
    /// carried), else read into its messages, each decoded as a delivery of its own would
    /// be (a bundle redelivered too often parks every message in it `redelivery-limit`).
    pub(super) fn prepare_bundle(
        &self,
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
        let provenance = match self.reader().check_signature(&exchange, &properties, &data) {
            Ok(vouched) => Provenance {
                redelivered: redeliveries.is_some(),
                vouched,
            },
            Err(parked) => return unreadable(data, routing_key, properties, parked, false),
        };
        let too_often = self
            .reader()
            .redelivered_too_often(&properties, redeliveries);
        let summary = bundle::summary(&properties);
        let count = bundle::count(&properties).and_then(|count| usize::try_from(count).ok());
        if let Some(count) = count
            && too_often.is_none()
            && summary.due.is_some()
            && !self.back_from_returns(&routing_key)
            && self.gate.is_open()
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

    /// True for a delivery back from the returns queue (level zero): its messages wait out
    /// their last moments here; back from a level, they move there first.
    fn back_from_returns(&self, routing_key: &ShortString) -> bool {
        routing_key.as_str() == self.shared.config.names.returns_queue()
    }

    /// Reads a bundle's messages from its `properties` and `body`, each decoded (or parked
    /// as `too_often` says), with the hops its header says their state does not count, and
    /// `redelivered` when the broker flagged the bundle's delivery so; why the whole bundle
    /// is parked when it cannot be read.
    #[allow(clippy::too_many_arguments)]
    fn read_bundle(
        &self,
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
        let waits_here = self.back_from_returns(routing_key);
        // A lane per due instant: a burst's messages (due at one instant) take turns as one
        // lane, and each message due after them in the same bundle as a lane of its own,
        // so it waits for a turn of the burst, not behind all of it.
        let mut lanes: HashMap<u64, Lane> = HashMap::new();
        let messages = members
            .into_iter()
            .map(|Member { properties, body }| {
                let decoded = match &too_often {
                    Some(parked) => Err(parked.clone()),
                    None => self.reader().decode(exchange, routing_key, &properties),
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

    /// The one level and window every message of a bundle back from a level (delivery
    /// `tag`, header `summary`, `body`) goes on to now, if they do: the first and the last
    /// due go on into the same one (so every message between does), no cancel names one of
    /// them, and hops travel in bundles.
    fn sealed_next_level(
        &self,
        tag: Tag,
        summary: &Summary,
        body: &[u8],
    ) -> Option<(Duration, u64)> {
        if !self.gate.is_open() {
            return None;
        }
        let (first, last) = summary.due?;
        let rules = self.rules();
        let now_ms = now_ms();
        let decide = |deliver_at| {
            let situation = Situation {
                now_ms,
                deliver_at,
                bundled: true,
                in_window: rules.hop_window.is_zero(),
                waits_here: false,
                from_work: tag.inlet == Inlet::Work,
            };
            planner::decide(&situation, &rules)
        };
        let next = decide(first);
        let Decision::Bundle { level, leaves_at } = next else {
            return None;
        };
        if decide(last) != next {
            return None;
        }
        let tombstones = self.shared.tombstones.lock().expect("tombstone lock");
        if !tombstones.is_empty() {
            for id in bundle::member_message_ids(body)?.into_iter().flatten() {
                match std::str::from_utf8(id) {
                    Ok(id) if !tombstones.names(id) => {}
                    _ => return None,
                }
            }
        }
        Some((level, leaves_at))
    }

    /// Passes a sealed bundle on whole into the one level all its messages go to, when they
    /// still do: its body as it came, its hop counted on the bundle. `None` when it must be
    /// read and carried message by message instead (they go apart now, or the level
    /// refused it).
    async fn pass_sealed(&self, sealed: &Sealed) -> Option<Outcome> {
        let (level, leaves_at) =
            self.sealed_next_level(sealed.tag, &sealed.summary, &sealed.body)?;
        tokio::select! {
            _ = tokio::time::sleep(until_epoch_ms(leaves_at)) => {}
            _ = self.stop.cancelled() => return Some(Err(Stop::Release)),
        }
        let (exchange, queue) = self.level_route(level);
        let summary = Summary {
            uncounted_hops: sealed.summary.uncounted_hops.saturating_add(1),
            ..sealed.summary
        };
        let properties = bundle::summarised_properties(sealed.count, &summary);
        let attempt = Attempt::own(
            sealed.tag,
            &queue,
            exchange,
            &queue,
            &sealed.body,
            self.signed(properties, &sealed.body),
        );
        match self.publishing.until_settled(attempt).await {
            Ok(Settled::Routed) => {
                let stats = &self.shared.stats;
                stats.bundles.fetch_add(1, Ordering::Relaxed);
                stats.passed_whole.fetch_add(1, Ordering::Relaxed);
                stats.hops.fetch_add(sealed.count as u64, Ordering::Relaxed);
                tracing::trace!(queue, messages = sealed.count, "bundle passed on whole");
                Some(Ok(()))
            }
            Ok(Settled::Park(refused)) => {
                tracing::warn!(
                    queue,
                    messages = sealed.count,
                    reason = refused.reason.as_str(),
                    "a level refused a bundle passed on whole: its messages go on one by one"
                );
                None
            }
            Err(stop) => Some(Err(stop)),
        }
    }

    /// Carries a bundle that came back: passes it on whole, or carries every message of it
    /// at once (done when all are), or parks it whole.
    pub(super) async fn carry_bundle(&self, prepared: &PreparedBundle) -> Outcome {
        match prepared {
            PreparedBundle::Read(bundle) => self.carry_messages(bundle).await,
            PreparedBundle::Sealed(sealed) => {
                if let Some(outcome) = self.pass_sealed(sealed).await {
                    return outcome;
                }
                let read = self.read_bundle(
                    sealed.tag,
                    &sealed.exchange,
                    &sealed.routing_key,
                    &sealed.properties,
                    &sealed.body,
                    None,
                    sealed.provenance,
                );
                match read {
                    Ok(bundle) => self.carry_messages(&bundle).await,
                    Err(parked) => {
                        Box::pin(self.park(
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
                Box::pin(self.park(
                    unreadable.tag,
                    &unreadable.body,
                    &unreadable.routing_key,
                    &unreadable.consumed,
                    &unreadable.parked,
                    unreadable.vouched,
                ))
                .await
            }
        }
    }

    /// Carries every message of a bundle at once; done when all are.
    async fn carry_messages(&self, bundle: &Bundle) -> Outcome {
        let outcomes = futures::future::join_all(
            bundle
                .messages
                .iter()
                .map(|message| self.carry_prepared(message)),
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
        self.pass_on(bundle, &released).await
    }

    /// Sends the messages of `bundle` a stop released on through the work exchange, as a
    /// bundle of their own: once that is confirmed, the bundle's delivery is done and none
    /// of its settled messages comes again.
    async fn pass_on(&self, bundle: &Bundle, released: &[&Read]) -> Outcome {
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
            &self.shared.work_exchange,
            bundle.routing_key.as_str(),
            &body,
            self.signed(bundle::bundle_properties(members.len()), &body),
        );
        match self.publishing.until_settled(attempt).await {
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
}
