//! The carrier of one message: decode it, then hop, hold, deliver, park or drop it until
//! whatever replaces it is confirmed, and report that to the session (which alone acks).
//!
//! By job: [`intake`] reads a delivery (signature, redeliveries, headers) into what is
//! carried; [`planner`] decides each step (pure), and the carrier's step loop takes it:
//! [`steps`] hops a message alone or delivers it (and drops a cancelled copy);
//! [`occurrences`] handles a recurring schedule's next copy and its line; [`parking`]
//! parks what cannot be carried, or read; [`publish`] publishes until the broker settles,
//! as [`settling`] decides (pure); [`bundle_hops`] carries the hops of one window into one
//! level as one message, and [`bundle_returns`] a bundle that comes back as its messages;
//! [`gate`] says whether hops travel in bundles now.
//!
//! The jobs talk through narrow types, never through the [`Carrier`]: [`Steps`],
//! [`Occurrences`] and [`Parking`] are views borrowing only the bridge's shared state and
//! the session's publishing; the [`Bundler`] owns the bundles filling up and the gate, and
//! [`BundleReturns`] the lanes, each taking what it publishes with as a [`Sending`]. The
//! carrier composes them and keeps the top-level entry ([`Carrier::start`], which the
//! session calls) and the step loop.
//!
//! Every path ends in one [`Outcome`]: done (its replacement is confirmed: ack), or a
//! [`Stop`] (give the delivery back, and renew the session for a failure).

use std::sync::Arc;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::inlet::{Inlet, Tag};
use super::{BridgeError, Shared};
use crate::amqp::publisher::Publisher;
use crate::amqp::returns::Fingerprint;
use crate::amqp::wire::{self, Delivery};
use crate::clock::{now_ms, until_epoch_ms};
use crate::config::Config;
use crate::contract::bundle;

mod bundle_hops;
mod bundle_returns;
mod gate;
mod intake;
mod occurrences;
mod parking;
mod publish;
mod settling;
mod steps;

use crate::plan::decide as planner;
use bundle_hops::Bundler;
use bundle_returns::{BundleReturns, CarryMessage};
pub(super) use gate::BundleGate;
use intake::{Decoded, Prepared, Reader, Undecodable};
use occurrences::{Line, Occurrences};
use parking::Parking;
use planner::{Decision, Rules, Situation};
use publish::Publishing;
use steps::Steps;

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
    /// The bridge's shared state (configuration, counters, cancels, redeliveries).
    shared: Arc<Shared>,
    /// Publishes until the broker settles, on the session's channels.
    publishing: Publishing,
    /// Where each message's end (and a hold) is reported.
    events: mpsc::UnboundedSender<Event>,
    /// Fires when the session stops: holds and backoffs give their delivery back.
    stop: CancellationToken,
    /// Hops in bundles: the bundles filling up now and the gate (`bridge.bundle_hops`).
    bundler: Bundler,
    /// Carries the bundles that come back; holds the lanes their messages take turns in.
    returns: BundleReturns,
}

/// What the bundle jobs publish with, borrowed from the carrier: the bridge's shared state
/// (the names, the state keys, the counters, the cancels), the session's publishing, and
/// its stop (a bundle waits for its window).
#[derive(Clone, Copy)]
struct Sending<'a> {
    /// The bridge's shared state.
    shared: &'a Shared,
    /// Publishes the bundles until the broker settles them.
    publishing: &'a Publishing,
    /// Fires when the session stops: a bundle waiting for its window is released.
    stop: &'a CancellationToken,
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
        let bundler = Bundler::new(shared.stats.clone());
        Self {
            shared,
            publishing,
            events,
            stop,
            bundler,
            returns: BundleReturns::new(),
        }
    }

    /// Whether hops travel in bundles now: the carrier's state, which `bridge::peers`
    /// opens while every instance on the prefix reads bundles.
    pub(super) fn bundle_gate(&self) -> &BundleGate {
        self.bundler.gate()
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
        // Decoded before spawning, so the task keeps only what it needs (its future is the
        // per-delivery memory cost while thousands are held).
        let prepared = Reader::of(&carrier.shared).prepare(
            &carrier.returns,
            carrier.bundler.gate(),
            tag,
            delivery,
            redeliveries,
        );
        tokio::spawn(async move {
            let outcome = match &prepared {
                Prepared::One(one) => carrier.carry_message(one).await,
                Prepared::Bundle(bundle) => {
                    Box::pin(carrier.returns.carry(
                        carrier.sending(),
                        &carrier.bundler,
                        &carrier,
                        bundle,
                    ))
                    .await
                }
                Prepared::Unreadable(raw, body) => {
                    Box::pin(carrier.parking().park_unreadable(tag, raw, body)).await
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

    /// The step loop: hops, holds and delivers a decoded message until a replacement is
    /// confirmed, as [`planner::decide`] says at each step.
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
                match Box::pin(self.occurrences().renew_line(
                    *tag,
                    envelope,
                    *taken_in,
                    *redelivered,
                ))
                .await?
                {
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
        let rules = rules(config);
        let mut situation = Situation {
            now_ms: now_ms(),
            deliver_at: envelope.deliver_at,
            // Only while every instance on the prefix reads bundles (`peers` opens the
            // gate).
            bundled: self.bundler.gate().is_open(),
            in_window: config.hop_window.is_zero(),
            waits_here: *waits_here,
            from_work: tag.inlet == Inlet::Work,
        };
        loop {
            if steps::cancelled(&self.shared, envelope) {
                return Ok(());
            }
            situation.now_ms = now_ms();
            match planner::decide(&situation, &rules) {
                Decision::Bundle { level, leaves_at } => {
                    match Box::pin(self.bundler.hop(
                        self.sending(),
                        *tag,
                        body,
                        envelope,
                        level,
                        leaves_at,
                    ))
                    .await
                    {
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
                    return Box::pin(self.steps().hop(*tag, body, envelope, level)).await;
                }
                Decision::Hold { counted } => {
                    if !self.hold(*tag, envelope.deliver_at, counted).await {
                        return Err(Stop::Release);
                    }
                }
                Decision::Deliver => {
                    return Box::pin(self.steps().deliver(
                        *tag,
                        body,
                        envelope,
                        *read_at,
                        lane.as_ref(),
                    ))
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

    /// Closes the carrier's channels (at the end of a session that ended well).
    pub(super) async fn close(&self) {
        self.publishing.close().await;
    }

    /// The steps that publish a message on (see [`steps`]).
    fn steps(&self) -> Steps<'_> {
        Steps::new(&self.shared, &self.publishing)
    }

    /// A recurring schedule's line and next copy (see [`occurrences`]).
    fn occurrences(&self) -> Occurrences<'_> {
        Occurrences::new(&self.shared, &self.publishing)
    }

    /// Parking what cannot be carried (see [`parking`]).
    fn parking(&self) -> Parking<'_> {
        Parking::new(&self.shared, &self.publishing)
    }

    /// What the bundle jobs publish with.
    fn sending(&self) -> Sending<'_> {
        Sending {
            shared: &self.shared,
            publishing: &self.publishing,
            stop: &self.stop,
        }
    }
}

impl CarryMessage for Carrier {
    /// Carries one decoded delivery, or parks one that could not be decoded.
    async fn carry_message(&self, prepared: &Result<Decoded, Box<Undecodable>>) -> Outcome {
        match prepared {
            Ok(decoded) => self.carry(decoded).await,
            Err(undecodable) => Box::pin(self.parking().park_undecodable(undecodable)).await,
        }
    }
}

/// The settings [`planner::decide`] reads, from `config`.
fn rules(config: &Config) -> Rules<'_> {
    Rules {
        ladder: &config.ladder,
        margin: config.margin,
        hop_window: config.hop_window,
    }
}
