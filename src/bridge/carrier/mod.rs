//! The carrier of one message: decode it, then hop, hold, deliver, park or drop it until
//! whatever replaces it is confirmed, and report that to the session (which alone acks).
//!
//! By job: [`intake`] reads a delivery (signature, redeliveries, headers) into what is
//! carried; [`planner`] decides each step (pure) and [`steps`] takes it (hop, hold,
//! deliver, park, drop); [`occurrences`] handles a recurring schedule's next copy and its
//! line; [`publish`] publishes until the broker settles, as [`settling`] decides (pure);
//! [`bundle_hops`] carries the hops of one window into one level as one message, and
//! [`bundle_returns`] a bundle that comes back as its messages; [`gate`] says whether hops
//! travel in bundles now; [`unreadable`] parks what the codec cannot read.
//!
//! Every path ends in one [`Outcome`]: done (its replacement is confirmed: ack), or a
//! [`Stop`] (give the delivery back, and renew the session for a failure).

use std::sync::Arc;

use lapin::types::ShortString;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::inlet::Tag;
use super::turns::{Lane, Lanes};
use super::{BridgeError, Shared};
use crate::amqp::publisher::Publisher;
use crate::amqp::returns::Fingerprint;
use crate::amqp::wire::{self, Delivery};
use crate::contract::bundle;
use crate::contract::{Envelope, Parked};

mod bundle_hops;
mod bundle_returns;
mod gate;
mod intake;
mod occurrences;
mod publish;
mod settling;
mod steps;
mod unreadable;

use crate::plan::decide as planner;
pub(super) use gate::BundleGate;
use intake::Reader;
use planner::Rules;
use publish::Publishing;

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

/// Why a carrier gives a delivery back to the broker instead of settling it.
pub(super) enum Stop {
    /// The session is stopping: the delivery goes back unprocessed.
    Release,
    /// Publishing failed in a way that needs a new session; the delivery goes back.
    Failed(BridgeError),
}

impl Stop {
    /// The same stop for another delivery that shared the publish it came from (a
    /// bundle's messages): a failure as its text.
    fn shared(&self) -> Stop {
        match self {
            Stop::Release => Stop::Release,
            Stop::Failed(error) => Stop::Failed(BridgeError::Bundle(error.to_string())),
        }
    }
}

/// How a carrier was done with a delivery: `Ok` once what replaces it is confirmed (it may
/// be acked: hopped, delivered, parked or dropped by a cancel), or why it goes back.
pub(super) type Outcome = Result<(), Stop>;

/// What carrying a message needs; one per session, cloned into each message's task.
#[derive(Clone)]
pub(super) struct Carrier {
    shared: Arc<Shared>,
    /// Publishes until the broker settles, on the session's channels.
    publishing: Publishing,
    /// Where each message's end is reported.
    events: mpsc::UnboundedSender<Event>,
    /// Fires when the session stops: holds and backoffs give their delivery back.
    stop: CancellationToken,
    /// The bundles of hops filling up now (`bridge.bundle_hops`).
    bundles: Arc<bundle_hops::Filling>,
    /// The turns the messages of bundles take at publishing to their targets.
    lanes: Arc<Lanes>,
    /// Whether hops travel in bundles now (`bridge::peers` opens and closes it).
    gate: BundleGate,
}

/// A decoded delivery on its way to its target.
struct Decoded {
    tag: Tag,
    body: Vec<u8>,
    envelope: Envelope,
    /// When the bridge read it, epoch ms (for the delivered log line).
    read_at: u64,
    /// With bundled hops: whether it may wait out its last moments on the delivery it came
    /// in (see `planner::Situation::waits_here`). A new message, or one of a bundle back from a level,
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
    Bundle(bundle_returns::PreparedBundle),
    /// A delivery the AMQP codec cannot read in full, and its body: parked.
    Unreadable(Box<wire::Raw>, Vec<u8>),
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
        let config = &shared.config;
        let publishing = Publishing::new(
            connection,
            publish,
            config.confirm_timeout,
            config.target_full_timeout,
            shared.stats.clone(),
            events.clone(),
            stop.clone(),
        );
        let gate = BundleGate::new(shared.stats.clone());
        Self {
            shared,
            publishing,
            events,
            stop,
            bundles: Arc::default(),
            lanes: Lanes::new(),
            gate,
        }
    }

    /// Whether hops travel in bundles now: the carrier's state, which `bridge::peers`
    /// opens while every instance on the prefix reads bundles.
    pub(super) fn bundle_gate(&self) -> &BundleGate {
        &self.gate
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
            None => Prepared::One(carrier.reader().prepare(tag, delivery, redeliveries)),
        };
        tokio::spawn(async move {
            let outcome = match &prepared {
                Prepared::One(one) => carrier.carry_prepared(one).await,
                Prepared::Bundle(bundle) => Box::pin(carrier.carry_bundle(bundle)).await,
                Prepared::Unreadable(raw, body) => {
                    Box::pin(carrier.park_unreadable(tag, raw, body)).await
                }
            };
            if let (Ok(()), Some(fingerprint)) = (&outcome, redelivered) {
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
        body.saturating_add(messages.saturating_mul(bundle_returns::HELD_MESSAGE_BYTES))
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
        self.publishing.close().await;
    }

    /// What reading a delivery needs (see [`intake`]).
    fn reader(&self) -> Reader<'_> {
        Reader {
            config: &self.shared.config,
            work_exchange: &self.shared.work_exchange,
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

    /// `properties` of a copy into a level or the returns queue, signed for `body` when
    /// `bridge.state_key` is set (`contract::signature`).
    fn signed(&self, properties: lapin::BasicProperties, body: &[u8]) -> lapin::BasicProperties {
        match &self.shared.config.state_keys {
            Some(keys) => keys.sign(properties, body),
            None => properties,
        }
    }
}
