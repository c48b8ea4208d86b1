//! Publishing one message until the broker settles it: the driver of [`Settling`] (which
//! decides), with the channels it publishes on, the pauses between attempts, the targets'
//! remembered refusals and the turns of a bundle's messages.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::settling::{Destination, Next, Settled, Settling};
use super::{Event, Stop};
use crate::amqp::disposition::{Culprit, Disposition, Refusal};
use crate::amqp::publisher::{PublishError, Publisher};
use crate::amqp::targets::{Share, TargetChannels};
use crate::amqp::wire;
use crate::bridge::BridgeError;
use crate::bridge::inlet::Tag;
use crate::bridge::refusals::TargetRefusals;
use crate::bridge::stats::Stats;
use crate::bridge::turns::Lane;
use crate::clock::now_since_epoch;
use crate::config::Config;
use crate::contract::{self, ParkReason, Parked};

/// The key of the bridge's own confirm channel (hops and parking) among the target
/// channels: no route's target can be the default exchange.
const OWN_CHANNEL: &str = "";

/// The longest pause between two attempts.
const MAX_RETRY_DELAY: Duration = Duration::from_secs(5);

/// Pauses between publish attempts: 100 ms doubling to 5 s, with jitter.
fn retry_delays() -> impl Iterator<Item = Duration> {
    crate::bridge::backoff(Duration::from_millis(100), MAX_RETRY_DELAY)
}

/// `properties` of a copy into a level or the returns queue, signed for `body` when
/// `bridge.state_key` is set (`contract::signature`).
pub(super) fn signed(
    config: &Config,
    properties: lapin::BasicProperties,
    body: &[u8],
) -> lapin::BasicProperties {
    match &config.state_keys {
        Some(keys) => keys.sign(properties, body),
        None => properties,
    }
}

/// One message to publish until the broker settles it.
pub(super) struct Attempt<'a> {
    /// The delivery it replaces (held while it backs off).
    pub(super) tag: Tag,
    pub(super) destination: Destination<'a>,
    pub(super) exchange: &'a str,
    pub(super) routing_key: &'a str,
    pub(super) body: &'a [u8],
    pub(super) properties: lapin::BasicProperties,
    /// For a message of a bundle on its way to its target: the lane whose turn each attempt
    /// waits for (see `bridge::turns`; not held while it backs off).
    pub(super) lane: Option<&'a Lane>,
}

impl<'a> Attempt<'a> {
    /// A copy into one of the bridge's own queues (`queue`, named for logs), through
    /// `exchange` with `routing_key`.
    pub(super) fn own(
        tag: Tag,
        queue: &'a str,
        exchange: &'a str,
        routing_key: &'a str,
        body: &'a [u8],
        properties: lapin::BasicProperties,
    ) -> Self {
        Self {
            tag,
            destination: Destination::Own(queue),
            exchange,
            routing_key,
            body,
            properties,
            lane: None,
        }
    }

    /// A copy of the delivery `tag` for the parked queue, through `exchange`.
    pub(super) fn parked(
        tag: Tag,
        exchange: &'a str,
        routing_key: &'a str,
        body: &'a [u8],
        properties: lapin::BasicProperties,
    ) -> Self {
        Self::own(
            tag,
            "the parked queue",
            exchange,
            routing_key,
            body,
            properties,
        )
    }

    /// An entry for the cancel stream (a tombstone), in place of the delivery `tag`,
    /// through the cancel exchange `exchange`.
    pub(super) fn stream_entry(
        tag: Tag,
        exchange: &'a str,
        properties: lapin::BasicProperties,
    ) -> Self {
        Self::own(tag, "the cancel stream", exchange, "", b"", properties)
    }
}

/// What publishing needs, one per session, shared by every message's task.
#[derive(Clone)]
pub(super) struct Publishing {
    /// One confirm channel per target exchange, and the bridge's own ([`OWN_CHANNEL`]):
    /// a channel the broker closed (a refused message) is replaced on next use.
    targets: Arc<TargetChannels>,
    /// Targets that refused a publish a moment ago: the messages pending with it share its
    /// answer.
    refusals: Arc<Mutex<TargetRefusals>>,
    /// The negotiated frame size: a content header must fit in one frame, or the broker
    /// closes the connection.
    frame_max: u32,
    /// `bridge.target_full_timeout`: a target nacking that long parks the message.
    target_full_timeout: Duration,
    /// Counts nacks and retries.
    stats: Arc<Stats>,
    /// Where a delivery is reported held while its publish pauses.
    events: mpsc::UnboundedSender<Event>,
    /// Fires when the session stops: a pause or a turn gives the delivery back.
    stop: CancellationToken,
}

impl Publishing {
    /// Publishing on `connection`, with `own` (the session's confirm channel) for the
    /// bridge's own queues.
    pub(super) fn new(
        connection: &wire::Connection,
        own: Publisher,
        confirm_timeout: Duration,
        target_full_timeout: Duration,
        stats: Arc<Stats>,
        events: mpsc::UnboundedSender<Event>,
        stop: CancellationToken,
    ) -> Self {
        let targets = Arc::new(TargetChannels::new(connection.clone(), confirm_timeout));
        targets.adopt(OWN_CHANNEL, own);
        Self {
            targets,
            refusals: Arc::default(),
            frame_max: connection.tuned().frame_max,
            target_full_timeout,
            stats,
            events,
            stop,
        }
    }

    /// The negotiated frame size, which a content header must fit in.
    pub(super) fn frame_max(&self) -> u32 {
        self.frame_max
    }

    /// Closes the channels (at the end of a session that ended well).
    pub(super) async fn close(&self) {
        self.targets.close_all().await;
    }

    /// Publishes into the bridge's own topology until settled: anything refused there is a
    /// fault of the topology (a new session).
    pub(super) async fn own(&self, attempt: Attempt<'_>) -> Result<(), Stop> {
        match self.until_settled(attempt).await? {
            Settled::Routed => Ok(()),
            Settled::Park(parked) => Err(Stop::Failed(BridgeError::OwnQueueMissing(format!(
                "the bridge's own topology refused a publish ({}: {})",
                parked.reason, parked.detail
            )))),
        }
    }

    /// Publishes until the broker settles the message one way or another: each attempt's
    /// answer goes to a [`Settling`], which decides (see `settling` for the policy); this
    /// publishes, pauses between attempts (100 ms doubling to 5 s, with jitter) and counts.
    /// A target's refusal stands for the attempts after it for
    /// [`refusals::MEMORY`](crate::bridge::refusals::MEMORY) without asking the broker
    /// again, and an attempt the policy sends alone goes on a private channel (at most
    /// [`ISOLATED_AT_ONCE`](crate::amqp::targets::ISOLATED_AT_ONCE) at a time). While it
    /// pauses the delivery counts as held, so the acks of others go on.
    pub(super) async fn until_settled(&self, attempt: Attempt<'_>) -> Result<Settled, Stop> {
        self.until_settled_sent(attempt)
            .await
            .map(|(settled, _)| settled)
    }

    /// [`Self::until_settled`], with when the attempt that settled it was sent (the time
    /// since the epoch, after any turn it waited for; the start for one never sent).
    pub(super) async fn until_settled_sent(
        &self,
        attempt: Attempt<'_>,
    ) -> Result<(Settled, Duration), Stop> {
        if !contract::fits_frame(&attempt.properties, self.frame_max) {
            return Ok((
                Settled::Park(Parked::new(
                    ParkReason::TooLarge,
                    format!(
                        "its properties and headers with the bridge's would take a {}-byte frame, over the connection's {} bytes",
                        contract::content_header_frame_len(&attempt.properties),
                        self.frame_max
                    ),
                )),
                now_since_epoch(),
            ));
        }
        let mut settling = Settling::new(
            attempt.destination,
            attempt.routing_key,
            attempt.body.len() as u64,
            self.target_full_timeout,
        );
        let mut delays = retry_delays();
        loop {
            let Some((disposition, sent_at)) = self.answer(&attempt, settling.alone()).await else {
                return Err(Stop::Release);
            };
            if matches!(disposition, Disposition::Nacked) {
                self.stats.nacks.fetch_add(1, Ordering::Relaxed);
            }
            match settling.next(disposition, tokio::time::Instant::now()) {
                Next::Settle(settled) => return Ok((settled, sent_at)),
                Next::Fail(error) => return Err(Stop::Failed(error)),
                Next::Retry => {}
            }
            self.stats.retries.fetch_add(1, Ordering::Relaxed);
            let _ = self.events.send(Event::Held(attempt.tag));
            let delay = delays.next().unwrap_or(MAX_RETRY_DELAY);
            tracing::debug!(?delay, "publish not settled; retrying");
            tokio::select! {
                _ = tokio::time::sleep(delay) => {}
                _ = self.stop.cancelled() => return Err(Stop::Release),
            }
        }
    }

    /// The broker's answer to one attempt (on a private channel when `alone`), or a
    /// refusal the target gave a moment ago standing for it, with when it was sent (or
    /// answered from memory); `None` when the bridge stops while the attempt waits for its
    /// turn.
    async fn answer(&self, attempt: &Attempt<'_>, alone: bool) -> Option<(Disposition, Duration)> {
        // A remembered refusal is not noted again: it lapses on time, and the next publish
        // asks the target anew.
        if let Some(remembered) = self.remembered_refusal(attempt, alone) {
            return Some((Disposition::Refused(remembered), now_since_epoch()));
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
        let sent_at = now_since_epoch();
        let answer = self.publish_once(attempt, alone).await;
        if let Destination::Target(target) = attempt.destination {
            self.note_answer(target, &answer);
        }
        let answer = match answer {
            // A channel that the target's refusal closed under this publish (it was already
            // closing): that refusal is this publish's answer too.
            Disposition::Lost(_) => self
                .remembered_refusal(attempt, alone)
                .map_or(answer, Disposition::Refused),
            answer => answer,
        };
        Some((answer, sent_at))
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
}

/// Publishes `attempt` once on `publisher`.
async fn publish_on(publisher: &Publisher, attempt: &Attempt<'_>) -> Disposition {
    publisher
        .publish(
            attempt.exchange,
            attempt.routing_key,
            attempt.body,
            &attempt.properties,
        )
        .await
}
