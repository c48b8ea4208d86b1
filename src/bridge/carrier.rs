//! The carrier of one message: decode it, then hop, hold, deliver, park or drop it until
//! whatever replaces it is confirmed, and report that to the session (which alone acks).
//! The hold timer lives here; [`bundles`] carries the hops of one window into one level as
//! one message.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use lapin::types::ShortString;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use self::settling::{Destination, Next, Settled, Settling};
use super::inlet::{Inlet, Tag};
use super::refusals::TargetRefusals;
use super::turns::{Lane, Lanes};
use super::{BridgeError, Shared};
use crate::amqp::disposition::{Culprit, Disposition, Refusal};
use crate::amqp::publisher::{PublishError, Publisher};
use crate::amqp::returns::Fingerprint;
use crate::amqp::targets::{Share, TargetChannels};
use crate::amqp::wire::{self, Delivery};
use crate::cancel::Successors;
use crate::clock::{now_ms, until_epoch_ms};
use crate::contract::bundle;
use crate::contract::signature::Trust;
use crate::contract::{
    self, Envelope, Incoming, Intake, ParkReason, Parked, consumed_properties, delivery_properties,
    hop_properties, parked_properties,
};
use crate::recurring::{self, Delivering, Occurrence, Recurrence};

mod bundles;
mod planner;
mod settling;
mod unreadable;

use planner::{Decision, Rules, Situation};

/// What a carrier reports to the session about the delivery it carries.
pub(super) enum Event {
    /// The delivery waits on a hold timer.
    Held(Tag),
    /// The carrier is done with the delivery `tag`, which took `budget_bytes` from the byte
    /// budget (see [`Carrier::budget_bytes`]).
    Ended {
        tag: Tag,
        budget_bytes: u64,
        outcome: Outcome,
    },
}

/// The key of the bridge's own confirm channel (hops and parking) among the target
/// channels: no route's target can be the default exchange.
const OWN_CHANNEL: &str = "";

/// What carrying a message needs; one per session, cloned into each message's task.
#[derive(Clone)]
pub(super) struct Carrier {
    shared: Arc<Shared>,
    /// One confirm channel per target exchange, and the bridge's own ([`OWN_CHANNEL`]):
    /// a channel the broker closed (a refused message) is replaced on next use.
    targets: Arc<TargetChannels>,
    /// Targets that refused a publish a moment ago: the messages pending with it share its
    /// answer.
    refusals: Arc<std::sync::Mutex<TargetRefusals>>,
    /// The negotiated frame size: a content header must fit in one frame, or the broker
    /// closes the connection.
    frame_max: u32,
    /// Where each message's end is reported.
    events: mpsc::UnboundedSender<Event>,
    /// Fires when the session stops: holds and backoffs give their delivery back.
    stop: CancellationToken,
    /// The bundles of hops filling up now (`bridge.bundle_hops`).
    bundles: Arc<bundles::Filling>,
    /// The turns the messages of bundles take at publishing to their targets.
    lanes: Arc<Lanes>,
}

/// A decoded delivery on its way to its target.
struct Decoded {
    tag: Tag,
    body: Vec<u8>,
    envelope: Envelope,
    /// When the bridge read it, epoch ms (for the delivered log line).
    read_at: u64,
    /// With bundled hops: whether it may wait out its last moments on the delivery it came
    /// in (see [`Carrier::wait_out`]). A new message, or one of a bundle back from a level,
    /// moves to the returns queue to wait instead, so that the delivery it came in is
    /// settled within its window.
    waits_here: bool,
    /// For a message of a bundle, its lane (the bundle's messages due at its instant): it
    /// publishes to its target in turns with the other lanes (see `bridge::turns`).
    lane: Option<Lane>,
    /// True for a message taken in from a route's ingress (not back from a level).
    taken_in: bool,
    /// True when the broker flagged the delivery it came in redelivered: a copy of it may
    /// already have been published (a hop, a next occurrence) before the delivery was
    /// given back, so a recurring occurrence is born again (see [`Carrier::reborn`]).
    redelivered: bool,
}

/// A delivery that could not be decoded: parked as it was consumed (a new message without
/// the `delay-bridge-*` headers its publisher set).
struct Undecodable {
    /// The delivery it came in (a bundle's, for a message of a bundle).
    tag: Tag,
    body: Vec<u8>,
    routing_key: ShortString,
    consumed: lapin::BasicProperties,
    parked: Parked,
    /// True when the bridge state in `consumed` is the bridge's own (its signature held, or
    /// no key is set): the parked copy is then signed, so that `parked replay` may send it
    /// back. A copy whose signature failed is never signed again.
    vouched: bool,
}

/// A delivery ready to be carried. Most are `One`: boxing it would cost every delivery an
/// allocation to spare the few bundles some bytes.
#[allow(clippy::large_enum_variant)]
enum Prepared {
    /// A message that came alone.
    One(Result<Decoded, Box<Undecodable>>),
    /// A bundle of messages that hopped together.
    Bundle(bundles::PreparedBundle),
    /// A delivery the AMQP codec cannot read in full, and its body: parked.
    Unreadable(Box<wire::Raw>, Vec<u8>),
}

/// One message to publish until the broker settles it.
struct Attempt<'a> {
    /// The delivery it replaces (held while it backs off).
    tag: Tag,
    destination: Destination<'a>,
    exchange: ShortString,
    routing_key: ShortString,
    body: &'a [u8],
    properties: lapin::BasicProperties,
    /// For a message of a bundle on its way to its target: the lane whose turn each attempt
    /// waits for (see `bridge::turns`; not held while it backs off).
    lane: Option<&'a Lane>,
}

impl<'a> Attempt<'a> {
    /// A copy of the delivery `tag` for the parked queue, through `exchange`.
    fn parked(
        tag: Tag,
        exchange: &str,
        routing_key: ShortString,
        body: &'a [u8],
        properties: lapin::BasicProperties,
    ) -> Self {
        Self {
            tag,
            destination: Destination::Own("the parked queue"),
            exchange: ShortString::from(exchange),
            routing_key,
            body,
            properties,
            lane: None,
        }
    }

    /// An entry for the cancel stream (a tombstone), in place of the delivery `tag`,
    /// through the cancel exchange `exchange`.
    fn stream_entry(tag: Tag, exchange: &str, properties: lapin::BasicProperties) -> Self {
        Self {
            tag,
            destination: Destination::Own("the cancel stream"),
            exchange: ShortString::from(exchange),
            routing_key: ShortString::from(""),
            body: b"",
            properties,
            lane: None,
        }
    }
}

/// The longest pause between two attempts.
const MAX_RETRY_DELAY: Duration = Duration::from_secs(5);

/// Pauses between publish attempts: 100 ms doubling to 5 s, with jitter.
fn retry_delays() -> impl Iterator<Item = Duration> {
    super::backoff(Duration::from_millis(100), MAX_RETRY_DELAY)
}

/// How a carrier was done with a delivery.
pub(super) enum Outcome {
    /// Its replacement is confirmed: it may be acked.
    Done,
    /// It goes back to the broker unprocessed.
    Release,
    /// Publishing failed in a way that needs a new session; it goes back to the broker.
    Failed(BridgeError),
}

impl Carrier {
    /// A carrier for one session publishing on `connection`; `publish` is the session's own
    /// confirm channel.
    pub(super) fn new(
        shared: Arc<Shared>,
        connection: &wire::Connection,
        publish: Publisher,
        events: mpsc::UnboundedSender<Event>,
        stop: CancellationToken,
    ) -> Self {
        let confirm_timeout = shared.config.confirm_timeout;
        let targets = Arc::new(TargetChannels::new(connection.clone(), confirm_timeout));
        targets.adopt(OWN_CHANNEL, publish);
        Self {
            shared,
            targets,
            refusals: Arc::default(),
            frame_max: connection.tuned().frame_max,
            events,
            stop,
            bundles: Arc::default(),
            lanes: Lanes::new(),
        }
    }

    /// Takes a delivery on: decodes it here, then carries it in a task of its own, which
    /// reports [`Event`]s for `tag`. A bundle that came back from a level is
    /// carried as its messages, each as a delivery of its own would be, and ends when the
    /// last of them does. `budget_bytes` is what it took from the byte budget
    /// ([`Carrier::budget_bytes`]), reported back when it ends.
    pub(super) fn start(&self, tag: Tag, delivery: Delivery, budget_bytes: u64) {
        let carrier = self.clone();
        let redelivered = delivery.redelivered.then(|| {
            Fingerprint::of(
                delivery.exchange.as_str(),
                delivery.routing_key.as_str(),
                &delivery.properties,
                &delivery.data,
            )
        });
        let redeliveries = redelivered.map(|fingerprint| {
            self.shared
                .redeliveries
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .redelivered(fingerprint)
        });
        let is_bundle = delivery.exchange.as_str() == self.shared.work_exchange
            && bundle::is_bundle(&delivery.properties);
        // Decoded before spawning, so the task keeps only what it needs (its future is the
        // per-delivery memory cost while thousands are held).
        let prepared = match delivery.unreadable {
            Some(raw) => Prepared::Unreadable(raw, delivery.data),
            None if is_bundle => {
                Prepared::Bundle(carrier.prepare_bundle(tag, delivery, redeliveries))
            }
            None => Prepared::One(carrier.prepare(tag, delivery, redeliveries)),
        };
        tokio::spawn(async move {
            let outcome = match &prepared {
                Prepared::One(one) => carrier.carry_prepared(one).await,
                Prepared::Bundle(bundle) => Box::pin(carrier.carry_bundle(bundle)).await,
                Prepared::Unreadable(raw, body) => {
                    Box::pin(carrier.park_unreadable(tag, raw, body)).await
                }
            };
            if let (Outcome::Done, Some(fingerprint)) = (&outcome, redelivered) {
                carrier
                    .shared
                    .redeliveries
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .settled(fingerprint);
            }
            let _ = carrier.events.send(Event::Ended {
                tag,
                budget_bytes,
                outcome,
            });
        });
    }

    /// What `delivery` takes from the byte budget (`bridge.max_unacked_bytes`) until it is
    /// settled: its body, and for a bundle also an allowance for each message it carries,
    /// which the bridge holds decoded (a bundle of small messages costs far more memory
    /// than its body).
    pub(super) fn budget_bytes(&self, delivery: &Delivery) -> u64 {
        let body = delivery.data.len() as u64;
        if delivery.exchange.as_str() != self.shared.work_exchange {
            return body;
        }
        let messages = bundle::count_within(&delivery.properties, delivery.data.len()).unwrap_or(0);
        body.saturating_add(messages.saturating_mul(bundles::HELD_MESSAGE_BYTES))
    }

    /// Carries one decoded delivery, or parks one that could not be decoded.
    async fn carry_prepared(&self, prepared: &Result<Decoded, Box<Undecodable>>) -> Outcome {
        match prepared {
            Ok(decoded) => self.carry(decoded).await,
            Err(undecodable) => {
                Box::pin(self.park(
                    undecodable.tag,
                    &undecodable.body,
                    &undecodable.routing_key,
                    &undecodable.consumed,
                    &undecodable.parked,
                    undecodable.vouched,
                ))
                .await
            }
        }
    }

    /// Closes the carrier's channels (at the end of a session that ended well).
    pub(super) async fn close(&self) {
        self.targets.close_all().await;
    }

    /// Decodes a delivery. Past this point only its tag, body and envelope are kept: the
    /// consumed properties (with their x-death history), names and acker are dropped, so
    /// that the thousands of deliveries held for their last moments stay small.
    /// `redeliveries` is how often this process has seen it redelivered (`None` when the
    /// broker did not flag it redelivered).
    fn prepare(
        &self,
        tag: Tag,
        delivery: Delivery,
        redeliveries: Option<u32>,
    ) -> Result<Decoded, Box<Undecodable>> {
        let read_at = now_ms();
        let Delivery {
            exchange,
            routing_key,
            properties,
            data,
            ..
        } = delivery;
        let signature = self.check_signature(&exchange, &properties, &data);
        let vouched = signature == Ok(true);
        let read =
            signature.and_then(|_| self.read(&exchange, &routing_key, &properties, redeliveries));
        let taken_in = exchange.as_str() != self.shared.work_exchange;
        match read {
            Ok(envelope) => Ok(Decoded {
                tag,
                body: data,
                envelope,
                read_at,
                waits_here: tag.inlet == Inlet::Returns,
                lane: None,
                taken_in,
                redelivered: redeliveries.is_some(),
            }),
            // A new message's `delay-bridge-*` headers are its publisher's: never parked as
            // if they were the bridge's state (a replay would act on them).
            Err(parked) if taken_in => {
                let (consumed, forged) = contract::without_bridge_headers(&properties);
                let parked = match forged {
                    0 => parked,
                    n => Parked::new(
                        parked.reason,
                        format!(
                            "{}; {n} delay-bridge-* header(s) its publisher set were removed",
                            parked.detail
                        ),
                    ),
                };
                Err(Box::new(Undecodable {
                    tag,
                    body: data,
                    routing_key,
                    consumed,
                    parked,
                    vouched: false,
                }))
            }
            Err(parked) => Err(Box::new(Undecodable {
                tag,
                body: data,
                routing_key,
                consumed: properties,
                parked,
                vouched,
            })),
        }
    }

    /// The settings [`planner::decide`] reads.
    fn rules(&self) -> Rules<'_> {
        let config = &self.shared.config;
        Rules {
            ladder: &config.ladder,
            margin: config.margin,
            hop_window: config.hop_window,
        }
    }

    /// Hops, holds and delivers a decoded message until a replacement is confirmed, as
    /// [`planner::decide`] says at each step.
    async fn carry(&self, moving: &Decoded) -> Outcome {
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
                match Box::pin(self.renew_line(*tag, envelope, *taken_in, *redelivered)).await {
                    Ok(Some(copy)) => {
                        renewed = copy;
                        &renewed
                    }
                    Ok(None) => envelope,
                    Err(outcome) => return outcome,
                }
            }
            None => envelope,
        };
        let rules = self.rules();
        let mut situation = Situation {
            now_ms: now_ms(),
            deliver_at: envelope.deliver_at,
            // Only while every instance on the prefix reads bundles (`peers` keeps the
            // gauge).
            bundled: self.shared.stats.bundling.load(Ordering::Relaxed) == 1,
            in_window: config.hop_window.is_zero(),
            waits_here: *waits_here,
            from_work: tag.inlet == Inlet::Work,
        };
        loop {
            if self.cancelled(envelope) {
                return Outcome::Done;
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
                        _ = self.stop.cancelled() => return Outcome::Release,
                    }
                }
                // Boxed: the task's own future is then only as large as its hold, which is
                // where most deliveries wait.
                Decision::Hop(level) => {
                    return Box::pin(self.hop(*tag, body, envelope, level)).await;
                }
                Decision::Hold { counted } => {
                    if !self.hold(*tag, envelope.deliver_at, counted).await {
                        return Outcome::Release;
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

    /// Decodes a consumed delivery, or says why it must be parked.
    fn read(
        &self,
        exchange: &ShortString,
        routing_key: &ShortString,
        properties: &lapin::BasicProperties,
        redeliveries: Option<u32>,
    ) -> Result<Envelope, Parked> {
        if let Some(parked) = self.redelivered_too_often(properties, redeliveries) {
            return Err(parked);
        }
        self.decode(exchange, routing_key, properties)
    }

    /// `properties` of a copy into a level or the returns queue, signed for `body` when
    /// `bridge.state_key` is set (`contract::signature`).
    pub(super) fn signed(
        &self,
        properties: lapin::BasicProperties,
        body: &[u8],
    ) -> lapin::BasicProperties {
        match &self.shared.config.state_keys {
            Some(keys) => keys.sign(properties, body),
            None => properties,
        }
    }

    /// Whether a delivery's state may be trusted: one that came back through the work
    /// exchange must carry a valid signature when `bridge.state_key` is set (else it is
    /// parked `bad-state`); any other, and any without a key, passes. `Ok(true)` when the
    /// bridge vouches for the state (see [`Undecodable::vouched`]): no key is set, or it
    /// was signed; a copy let through by `bridge.accept_unsigned_state` is carried but not
    /// vouched for.
    pub(super) fn check_signature(
        &self,
        exchange: &ShortString,
        properties: &lapin::BasicProperties,
        body: &[u8],
    ) -> Result<bool, Parked> {
        let config = &self.shared.config;
        match &config.state_keys {
            Some(keys) if exchange.as_str() == self.shared.work_exchange => keys
                .verify(properties, body, config.accept_unsigned_state)
                .map(|trust| trust == Trust::Signed),
            _ => Ok(true),
        }
    }

    /// Why a delivery with these properties, redelivered `redeliveries` times to this
    /// process (`None`: not flagged redelivered), must be parked `redelivery-limit`, if it
    /// must.
    fn redelivered_too_often(
        &self,
        properties: &lapin::BasicProperties,
        redeliveries: Option<u32>,
    ) -> Option<Parked> {
        let limit = self.shared.config.redelivery_limit;
        // Only a redelivery's `x-delivery-count` is the broker's: on a first delivery the
        // header can only be the publisher's.
        let redeliveries = redeliveries?;
        if let Some(parked) = contract::redelivered_too_often(properties, i64::from(limit)) {
            return Some(parked);
        }
        (redeliveries >= limit).then(|| {
            Parked::new(
                ParkReason::RedeliveryLimit,
                format!(
                    "redelivered {redeliveries} times to this bridge without being settled; parked so it cannot stall the bridge"
                ),
            )
        })
    }

    /// Decodes a message that came through `exchange`, or says why it must be parked.
    fn decode(
        &self,
        exchange: &ShortString,
        routing_key: &ShortString,
        properties: &lapin::BasicProperties,
    ) -> Result<Envelope, Parked> {
        let config = &self.shared.config;
        let intake = Intake {
            work_exchange: &self.shared.work_exchange,
            routes: &config.routes,
            max_delay: config.max_delay,
            smallest_level: config.ladder.smallest(),
        };
        let incoming = Incoming {
            exchange: exchange.as_str(),
            routing_key,
            properties,
        };
        contract::decode(incoming, now_ms(), &intake)
    }

    /// True when a tombstone covers this copy: it is dropped (acked with nothing replacing
    /// it), at its next hop or before its delivery.
    fn cancelled(&self, envelope: &Envelope) -> bool {
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

    async fn hop(&self, tag: Tag, body: &[u8], envelope: &Envelope, level: Duration) -> Outcome {
        let queue = self.shared.config.names.level_queue(level);
        let attempt = Attempt {
            tag,
            destination: Destination::Own(&queue),
            exchange: ShortString::from(""),
            routing_key: ShortString::from(queue.as_str()),
            body,
            properties: self.signed(hop_properties(envelope), body),
            lane: None,
        };
        match self.publish_until_settled(attempt).await {
            Settled::Routed => {
                self.shared.stats.hops.fetch_add(1, Ordering::Relaxed);
                tracing::trace!(queue, hops = envelope.hops.saturating_add(1), "hop");
                Outcome::Done
            }
            Settled::Park(parked) => self.park_read(tag, body, envelope, parked).await,
            Settled::Release => Outcome::Release,
            Settled::Failed(e) => Outcome::Failed(e),
        }
    }

    /// Parks a message: `consumed` are the properties it was read with; `vouched` when the
    /// bridge state in them is the bridge's own, so that the parked copy is signed (see
    /// [`Undecodable::vouched`]).
    async fn park(
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
        if !contract::fits_frame(&properties, self.frame_max) {
            properties = vouch(contract::parked_properties_without_headers(
                consumed, parked, parked_at,
            ));
        }
        let attempt = Attempt::parked(tag, &exchange, routing_key.clone(), body, properties);
        match self.publish_until_settled(attempt).await {
            Settled::Routed => {
                self.shared.stats.parked.fetch_add(1, Ordering::Relaxed);
                self.shared.instruments.parked(parked.reason);
                Outcome::Done
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
            Settled::Park(again) => Outcome::Failed(BridgeError::OwnQueueMissing(format!(
                "the parked queue refused a message ({}: {})",
                again.reason, again.detail
            ))),
            Settled::Release => Outcome::Release,
            Settled::Failed(e) => Outcome::Failed(e),
        }
    }

    async fn deliver(
        &self,
        tag: Tag,
        body: &[u8],
        envelope: &Envelope,
        read_at: u64,
        lane: Option<&Lane>,
    ) -> Outcome {
        let mut properties = delivery_properties(envelope, &self.shared.bridge_user);
        let recurring = self.occurrence(envelope);
        if let Some((occurrence, delivering)) = &recurring {
            properties = recurring::with_occurrence(properties, *occurrence, delivering);
        }
        let attempt = Attempt {
            tag,
            destination: Destination::Target(&envelope.target),
            exchange: ShortString::from(envelope.target.as_str()),
            routing_key: envelope.routing_key.clone(),
            body,
            properties,
            lane,
        };
        match self.publish_until_settled(attempt).await {
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
                    None => Outcome::Done,
                }
            }
            Settled::Park(parked) => self.park_read(tag, body, envelope, parked).await,
            Settled::Release => Outcome::Release,
            Settled::Failed(e) => Outcome::Failed(e),
        }
    }

    /// For a copy of a recurring schedule: its occurrence, and what delivering it now
    /// means (skipped occurrences, the next one). `None` for any other message, and for a
    /// copy whose schedule no longer reads (it is delivered once, and the schedule ends).
    fn occurrence(&self, envelope: &Envelope) -> Option<(Occurrence, Delivering)> {
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
        let now = now_ms();
        let mut delivering = recurrence.delivering(occurrence, now);
        // Held to this bridge's limits at every occurrence, not only at intake: a copy an
        // older version or another configuration took in, or one whose rule changed on the
        // way (possible without a state key), costs no more than a new one may. Checked
        // on the gaps around the next occurrence, one search more than delivering takes
        // (the full check at intake looks further); only while another one follows.
        if let Some(next) = delivering.next
            && let Some(why) = self.beyond_limits(&recurrence, occurrence, next, now)
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
        &self,
        recurrence: &Recurrence,
        current: Occurrence,
        next: Occurrence,
        now_ms: u64,
    ) -> Option<&'static str> {
        let config = &self.shared.config;
        let shortest = recurring::MIN_INTERVAL.max(config.ladder.smallest());
        let following = recurrence.rule.next_after(next.due_ms);
        if following.is_some_and(|f| f.saturating_sub(next.due_ms) < shortest.as_millis() as u64) {
            return Some("occurrences closer together than the smallest recurring interval");
        }
        let wait = next.due_ms.saturating_sub(now_ms.max(current.due_ms));
        (wait > config.max_delay.as_millis() as u64)
            .then_some("occurrences further apart than delays.max_delay")
    }

    /// After an occurrence of a recurring schedule was delivered: the copy of the next
    /// occurrence through the work exchange, confirmed before the delivery is acknowledged.
    /// A delivery given back after that (a crash, a lost session) comes again redelivered:
    /// it delivers its occurrence a second time at most, and is born again first
    /// ([`Carrier::reborn`]), which drops the next copy published here.
    async fn schedule_next(
        &self,
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
            return Outcome::Done;
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
        let copy = Attempt {
            tag,
            destination: Destination::Own(&returns),
            exchange: ShortString::from(self.shared.work_exchange.as_str()),
            routing_key: envelope.routing_key.clone(),
            body,
            properties: self.signed(consumed_properties(&next_copy), body),
            lane: None,
        };
        let outcome = self.own_publish(copy).await;
        if matches!(outcome, Outcome::Done) {
            tracing::debug!(
                occurrence = next.number,
                due_in_ms = next.due_ms as i64 - now_ms() as i64,
                "next occurrence scheduled"
            );
        }
        outcome
    }

    /// Where a copy of a recurring occurrence starts a line of its own (the copy with its new
    /// birth; `None`: it goes on as it is; `Err`: its delivery is done with, dropped or
    /// given back):
    /// - taken in: the schedule replaces what its id named before on its target
    ///   ([`Carrier::replace_older`]), and its copies are born now;
    /// - redelivered: born again ([`Carrier::reborn`]) unless a cancel or a replacement
    ///   drops it; successor tombstones do not, for it may be the last copy of its
    ///   schedule (its own rebirth's tombstone names a birth it never published);
    /// - its line older than [`LINE_RENEWED_EVERY`](crate::cancel::LINE_RENEWED_EVERY):
    ///   born again unless anything drops it, so a fork no redelivery flagged heals.
    async fn renew_line(
        &self,
        tag: Tag,
        envelope: &Envelope,
        taken_in: bool,
        redelivered: bool,
    ) -> Result<Option<Envelope>, Outcome> {
        if taken_in {
            return match self.replace_older(tag, envelope).await {
                Outcome::Done => Ok(Some(Envelope {
                    born: crate::cancel::birth(now_ms(), rand::random()),
                    ..envelope.clone()
                })),
                other => Err(other),
            };
        }
        let dropped = if redelivered {
            self.cancels_schedule(envelope)
        } else if crate::cancel::renewal_due(envelope.born, now_ms()) {
            self.cancelled(envelope)
        } else {
            return Ok(None);
        };
        if dropped {
            return Err(Outcome::Done);
        }
        self.reborn(tag, envelope).await.map(Some)
    }

    /// The bridge's own user, as the `user_id` of what it appends to the cancel stream: the
    /// broker checks it, so bridges tell their own entries from a canceller's.
    fn bridge_user(&self) -> ShortString {
        ShortString::from(self.shared.bridge_user.as_str())
    }

    /// True when a cancel or a later schedule's replacement drops this copy of a recurring
    /// schedule (successor tombstones aside).
    fn cancels_schedule(&self, envelope: &Envelope) -> bool {
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
    async fn reborn(&self, tag: Tag, envelope: &Envelope) -> Result<Envelope, Outcome> {
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
        let tombstone = Attempt::stream_entry(
            tag,
            &self.shared.config.names.cancel_exchange(),
            crate::cancel::successors_properties(id.clone(), &successors)
                .with_user_id(self.bridge_user()),
        );
        match self.own_publish(tombstone).await {
            Outcome::Done => {
                tracing::debug!(occurrence = number, "redelivered occurrence born again");
                Ok(Envelope {
                    born,
                    ..envelope.clone()
                })
            }
            other => Err(other),
        }
    }

    /// A recurring schedule taken in replaces the schedules of its id bound for its target
    /// that entered before it (a schedule's replacement in the cancel stream, confirmed
    /// before its first hop). A one-off message of the id, or another target's schedule,
    /// is not touched: publishing is not cancelling.
    async fn replace_older(&self, tag: Tag, envelope: &Envelope) -> Outcome {
        let Some(id) = envelope.properties.message_id.clone() else {
            return Outcome::Done;
        };
        let attempt = Attempt::stream_entry(
            tag,
            &self.shared.config.names.cancel_exchange(),
            crate::cancel::replaced_properties(
                id,
                &envelope.target,
                envelope.entered_at.saturating_sub(1),
            )
            .with_user_id(self.bridge_user()),
        );
        self.own_publish(attempt).await
    }

    /// Publishes into the bridge's own topology until settled: done when routed; anything
    /// refused there is a fault of the topology (a new session).
    async fn own_publish(&self, attempt: Attempt<'_>) -> Outcome {
        match self.publish_until_settled(attempt).await {
            Settled::Routed => Outcome::Done,
            Settled::Park(parked) => Outcome::Failed(BridgeError::OwnQueueMissing(format!(
                "the bridge's own topology refused a publish ({}: {})",
                parked.reason, parked.detail
            ))),
            Settled::Release => Outcome::Release,
            Settled::Failed(e) => Outcome::Failed(e),
        }
    }

    /// Publishes until the broker settles the message one way or another: each attempt's
    /// answer goes to a [`Settling`], which decides (see `settling` for the policy); this
    /// publishes, pauses between attempts (100 ms doubling to 5 s, with jitter) and counts.
    /// A target's refusal stands for the attempts after it for
    /// [`refusals::MEMORY`](super::refusals::MEMORY) without asking the broker again, and an
    /// attempt the policy sends alone goes on a private channel (at most
    /// [`ISOLATED_AT_ONCE`](crate::amqp::targets::ISOLATED_AT_ONCE) at a time). While it
    /// pauses the delivery counts as held, so the acks of others go on.
    async fn publish_until_settled(&self, attempt: Attempt<'_>) -> Settled {
        if !contract::fits_frame(&attempt.properties, self.frame_max) {
            return Settled::Park(Parked::new(
                ParkReason::TooLarge,
                format!(
                    "its properties and headers with the bridge's would take a {}-byte frame, over the connection's {} bytes",
                    contract::content_header_frame_len(&attempt.properties),
                    self.frame_max
                ),
            ));
        }
        let mut settling = Settling::new(
            attempt.destination,
            attempt.routing_key.as_str(),
            attempt.body.len() as u64,
            self.shared.config.target_full_timeout,
        );
        let mut delays = retry_delays();
        loop {
            let Some(disposition) = self.answer(&attempt, settling.alone()).await else {
                return Settled::Release;
            };
            if matches!(disposition, Disposition::Nacked) {
                self.shared.stats.nacks.fetch_add(1, Ordering::Relaxed);
            }
            match settling.next(disposition, tokio::time::Instant::now()) {
                Next::Settle(settled) => return settled,
                Next::Retry => {}
            }
            self.shared.stats.retries.fetch_add(1, Ordering::Relaxed);
            let _ = self.events.send(Event::Held(attempt.tag));
            let delay = delays.next().unwrap_or(MAX_RETRY_DELAY);
            tracing::debug!(?delay, "publish not settled; retrying");
            tokio::select! {
                _ = tokio::time::sleep(delay) => {}
                _ = self.stop.cancelled() => return Settled::Release,
            }
        }
    }

    /// The broker's answer to one attempt (on a private channel when `alone`), or a
    /// refusal the target gave a moment ago standing for it; `None` when the bridge stops
    /// while the attempt waits for its turn.
    async fn answer(&self, attempt: &Attempt<'_>, alone: bool) -> Option<Disposition> {
        // A remembered refusal is not noted again: it lapses on time, and the next publish
        // asks the target anew.
        if let Some(remembered) = self.remembered_refusal(attempt, alone) {
            return Some(Disposition::Refused(remembered));
        }
        // The messages of a bundle take turns with other bundles', so that one due now need
        // not wait behind every message of a burst; the turn ends with the attempt, so a
        // backoff holds none.
        let _turn = match attempt.lane {
            Some(lane) => tokio::select! {
                turn = lane.turn() => Some(turn),
                _ = self.stop.cancelled() => return None,
            },
            None => None,
        };
        let answer = self.publish_once(attempt, alone).await;
        if let Destination::Target(target) = attempt.destination {
            self.note_answer(target, &answer);
        }
        Some(match answer {
            // A channel that the target's refusal closed under this publish (it was already
            // closing): that refusal is this publish's answer too.
            Disposition::Lost(_) => self
                .remembered_refusal(attempt, alone)
                .map_or(answer, Disposition::Refused),
            answer => answer,
        })
    }

    /// The refusal a target gave a moment ago, standing for this attempt without asking the
    /// broker again (see `bridge::refusals`); `None` on a private channel, for the bridge's
    /// own queues, or when the target has not refused lately.
    fn remembered_refusal(&self, attempt: &Attempt<'_>, alone: bool) -> Option<Refusal> {
        let Destination::Target(target) = attempt.destination else {
            return None;
        };
        if alone {
            return None;
        }
        self.refusals
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .recent(target, std::time::Instant::now())
    }

    /// Remembers what `target` answered: a refusal that blames it stands for a moment; a
    /// publish it took or returned ends that.
    fn note_answer(&self, target: &str, disposition: &Disposition) {
        let mut refusals = self.refusals.lock().unwrap_or_else(|e| e.into_inner());
        match disposition {
            Disposition::Refused(refusal) if refusal.culprit == Culprit::Destination => {
                refusals.refused(target, refusal, std::time::Instant::now())
            }
            Disposition::Routed | Disposition::Returned { .. } | Disposition::Nacked => {
                refusals.took(target)
            }
            Disposition::Refused(_) | Disposition::Lost(_) => {}
        }
    }

    /// One publish of `attempt` on its destination's channel or, `alone`, on a private one
    /// (closed after it). A channel that cannot be opened is a lost attempt.
    async fn publish_once(&self, attempt: &Attempt<'_>, alone: bool) -> Disposition {
        if alone {
            return match self.targets.isolated().await {
                Ok(isolated) => {
                    let disposition = publish_on(isolated.publisher(), attempt).await;
                    isolated.close().await;
                    disposition
                }
                Err(e) => Disposition::Lost(PublishError::Broker(e)),
            };
        }
        let key = match attempt.destination {
            Destination::Own(_) => OWN_CHANNEL,
            Destination::Target(target) => target,
        };
        let share = match attempt.lane {
            Some(lane) if lane.is_bulk() => Share::Bulk,
            _ => Share::Common,
        };
        match self.targets.get_shared(key, share).await {
            Ok(publisher) => publish_on(&publisher, attempt).await,
            // A target found missing (or forbidden) when its channel opened refuses this
            // publish as a publish would have; any other failure is a lost attempt.
            Err(e) => Disposition::of_error(PublishError::Broker(e)),
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

/// Publishes `attempt` once on `publisher`.
async fn publish_on(publisher: &Publisher, attempt: &Attempt<'_>) -> Disposition {
    publisher
        .publish(
            attempt.exchange.clone(),
            attempt.routing_key.clone(),
            attempt.body,
            attempt.properties.clone(),
        )
        .await
}
