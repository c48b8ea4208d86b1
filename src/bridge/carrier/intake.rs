//! Reading a delivery into what the carrier carries: its signature checked, its redeliveries
//! counted, its headers decoded into an [`Envelope`], or the reason it is parked (a bundle's
//! messages are read by `bundle_returns`). No I/O: the configuration and the time are all
//! it reads.

use lapin::types::ShortString;

use super::bundle_returns::{BundleReturns, PreparedBundle};
use super::gate::BundleGate;
use crate::amqp::wire::{Delivery, Raw};
use crate::bridge::Shared;
use crate::bridge::inlet::{Inlet, Tag};
use crate::bridge::turns::Lane;
use crate::clock::now_ms;
use crate::config::Config;
use crate::contract::signature::Trust;
use crate::contract::{self, Envelope, Incoming, Intake, ParkReason, Parked, bundle};

/// A decoded delivery on its way to its target.
pub(super) struct Decoded {
    pub(super) tag: Tag,
    pub(super) body: Vec<u8>,
    pub(super) envelope: Envelope,
    /// When the bridge read it, epoch ms (for the delivered log line).
    pub(super) read_at: u64,
    /// With bundled hops: whether it may wait out its last moments on the delivery it came
    /// in (see `planner::Situation::waits_here`). A new message, or one of a bundle back from a level,
    /// moves to the returns queue to wait instead, so that the delivery it came in is
    /// settled within its window.
    pub(super) waits_here: bool,
    /// For a message of a bundle, its lane (the bundle's messages due at its instant): it
    /// publishes to its target in turns with the other lanes (see `bridge::turns`).
    pub(super) lane: Option<Lane>,
    /// True for a message taken in from a route's ingress (not back from a level).
    pub(super) taken_in: bool,
    /// True when the broker flagged the delivery it came in redelivered: a copy of it may
    /// already have been published (a hop, a next occurrence) before the delivery was
    /// given back, so a recurring occurrence is born again (see
    /// [`Occurrences::reborn`](super::occurrences::Occurrences::reborn)).
    pub(super) redelivered: bool,
}

/// A delivery that could not be decoded: parked as it was consumed (a new message without
/// the `delay-bridge-*` headers its publisher set).
pub(super) struct Undecodable {
    /// The delivery it came in (a bundle's, for a message of a bundle).
    pub(super) tag: Tag,
    pub(super) body: Vec<u8>,
    pub(super) routing_key: ShortString,
    pub(super) consumed: lapin::BasicProperties,
    pub(super) parked: Parked,
    /// True when the bridge state in `consumed` is the bridge's own (its signature held, or
    /// no key is set): the parked copy is then signed, so that `parked replay` may send it
    /// back. A copy whose signature failed is never signed again.
    pub(super) vouched: bool,
}

/// A delivery ready to be carried. Most are `One`: boxing it would cost every delivery an
/// allocation to spare the few bundles some bytes.
#[allow(clippy::large_enum_variant)]
pub(super) enum Prepared {
    /// A message that came alone.
    One(Result<Decoded, Box<Undecodable>>),
    /// A bundle of messages that hopped together.
    Bundle(PreparedBundle),
    /// A delivery the AMQP codec cannot read in full, and its body: parked.
    Unreadable(Box<Raw>, Vec<u8>),
}

/// What reading a delivery needs: the configuration and the work exchange's name.
#[derive(Clone, Copy)]
pub(super) struct Reader<'a> {
    pub(super) config: &'a Config,
    /// `config.names.work_exchange()`, built once.
    pub(super) work_exchange: &'a str,
}

impl<'a> Reader<'a> {
    /// What reading a delivery needs, from the bridge's shared state.
    pub(super) fn of(shared: &'a Shared) -> Self {
        Self {
            config: &shared.config,
            work_exchange: &shared.work_exchange,
        }
    }

    /// Reads a delivery into what is carried: one the AMQP codec could not read, as it came;
    /// a bundle back through the work exchange, by `returns` (kept sealed only while `gate`
    /// is open); any other, decoded. `redeliveries` as for [`Reader::prepare_one`].
    pub(super) fn prepare(
        self,
        returns: &BundleReturns,
        gate: &BundleGate,
        tag: Tag,
        delivery: Delivery,
        redeliveries: Option<u32>,
    ) -> Prepared {
        let is_bundle = delivery.exchange.as_str() == self.work_exchange
            && bundle::is_bundle(&delivery.properties);
        match delivery.unreadable {
            Some(raw) => Prepared::Unreadable(raw, delivery.data),
            None if is_bundle => {
                Prepared::Bundle(returns.prepare(self, gate, tag, delivery, redeliveries))
            }
            None => Prepared::One(self.prepare_one(tag, delivery, redeliveries)),
        }
    }

    /// Decodes a delivery. Past this point only its tag, body and envelope are kept: the
    /// consumed properties (with their x-death history), names and acker are dropped, so
    /// that the thousands of deliveries held for their last moments stay small.
    /// `redeliveries` is how often this process has seen it redelivered (`None` when the
    /// broker did not flag it redelivered).
    pub(super) fn prepare_one(
        self,
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
        let taken_in = exchange.as_str() != self.work_exchange;
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

    /// Decodes a consumed delivery, or says why it must be parked.
    fn read(
        self,
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

    /// Whether a delivery's state may be trusted: one that came back through the work
    /// exchange must carry a valid signature when `bridge.state_key` is set (else it is
    /// parked `bad-state`); any other, and any without a key, passes. `Ok(true)` when the
    /// bridge vouches for the state (see [`Undecodable::vouched`]): no key is set, or it
    /// was signed; a copy let through by `bridge.accept_unsigned_state` is carried but not
    /// vouched for.
    pub(super) fn check_signature(
        self,
        exchange: &ShortString,
        properties: &lapin::BasicProperties,
        body: &[u8],
    ) -> Result<bool, Parked> {
        match &self.config.state_keys {
            Some(keys) if exchange.as_str() == self.work_exchange => keys
                .verify(properties, body, self.config.accept_unsigned_state)
                .map(|trust| trust == Trust::Signed),
            _ => Ok(true),
        }
    }

    /// Why a delivery with these properties, redelivered `redeliveries` times to this
    /// process (`None`: not flagged redelivered), must be parked `redelivery-limit`, if it
    /// must.
    pub(super) fn redelivered_too_often(
        self,
        properties: &lapin::BasicProperties,
        redeliveries: Option<u32>,
    ) -> Option<Parked> {
        let limit = self.config.redelivery_limit;
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
    pub(super) fn decode(
        self,
        exchange: &ShortString,
        routing_key: &ShortString,
        properties: &lapin::BasicProperties,
    ) -> Result<Envelope, Parked> {
        let config = self.config;
        let intake = Intake {
            work_exchange: self.work_exchange,
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
}
