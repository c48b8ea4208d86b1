//! One session: consume the work and returns queues, each on a channel of its own
//! ([`super::inlet`]), on one of the project's own connections ([`crate::amqp::wire`]),
//! hand each delivery to a [`Carrier`] (which publishes on the other), fold what carriers
//! report into batched acks, and drain on shutdown. The cancel stream is followed on a
//! connection of its own ([`crate::amqp::stream_reader`]); lapin's connection reads the
//! depths, and its loss ends the session like the others'. This is the only place that acks.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use futures::{Stream, StreamExt};
use lapin::Connection;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use super::acks::AckTracker;
use super::budget::{ByteBudget, Retune};
use super::carrier::{Carrier, Event, Stop};
use super::inlet::{Consuming, Inlet, Tag};
use super::{BridgeError, CLOSE_TIMEOUT, Shared, cancels, depths, peers};
use crate::amqp::publisher::Publisher;
use crate::amqp::wire::{self, Delivery, WireError};

/// Most carrier events folded into one batch of acks (bounds the time the loop spends away
/// from the consumer).
const MAX_EVENT_BATCH: usize = 4096;

/// The session's two connections of the project's own: consuming and publishing apart, so
/// that the broker's flow control on publishes never holds back the acks.
pub(super) struct Wires<'a> {
    /// The broker the session's connections go to (the cancel-stream follower opens one
    /// of its own there).
    pub(super) url: &'a crate::config::BrokerUrl,
    /// Where the work queue is consumed and acked.
    pub(super) consuming: &'a wire::Connection,
    /// Where every hop, delivery and parked message is published.
    pub(super) publishing: &'a wire::Connection,
}

/// Runs one session, consuming and publishing on `wires` and reading the cancel stream on
/// `connection`, until shutdown drains it (`Ok`) or something breaks (`Err`: the caller
/// reconnects).
pub(super) async fn run(
    shared: Arc<Shared>,
    connection: Arc<Connection>,
    wires: Wires<'_>,
    shutdown: &CancellationToken,
    ready: &watch::Sender<bool>,
) -> Result<(), BridgeError> {
    let config = &shared.config;
    let Wires {
        url,
        consuming,
        publishing,
    } = wires;
    // Listened to from the start, so that a loss during the setup is seen too.
    let control_events = Box::pin(connection.events_listener());
    // Each queue gets half of the byte budget: together they stay within it.
    let share = || ByteBudget::new(config.max_unacked_bytes / 2, config.prefetch);
    let publish = Publisher::open(publishing, config.confirm_timeout)
        .await
        .map_err(BridgeError::wire("opening the publisher channel"))?;
    let stop = CancellationToken::new();
    let _stop_carriers_on_exit = stop.clone().drop_guard();
    let follower = cancels::follow(shared.clone(), url, publishing, stop.clone()).await?;
    let returns = Consuming::open(consuming, &shared, Inlet::Returns, share()).await?;
    let work = Consuming::open(consuming, &shared, Inlet::Work, share()).await?;
    tokio::spawn(depths::run(
        shared.clone(),
        connection.clone(),
        stop.clone(),
    ));
    let (events_tx, events) = mpsc::unbounded_channel();
    let carrier = Carrier::new(shared.clone(), publishing, publish, events_tx, stop.clone());
    peers::watch(
        shared.clone(),
        connection.clone(),
        carrier.bundle_gate().clone(),
        returns.handovers(),
        stop.clone(),
    )
    .await;
    ready.send_replace(true);
    tracing::info!(
        work = work.queue(),
        returns = returns.queue(),
        prefetch = config.prefetch,
        "consuming"
    );

    let mut session = Session {
        shared: shared.clone(),
        consumer_blocked: consuming.blocked(),
        work,
        returns,
        carrier,
        events,
        stop,
        follower: Some(follower),
        consuming: true,
    };
    // A publishing connection that fails ends the session at once, not at the next
    // publish.
    let result = tokio::select! {
        result = session.drive(shutdown) => result,
        error = publishing.failed() => Err(BridgeError::wire("publishing")(error)),
        lost = control_failed(&connection, control_events) => Err(BridgeError::ControlLost(lost)),
    };
    session.stop.cancel();
    // Its hops no longer travel in bundles; the gauge says so now, before a next session
    // opens a gate of its own (this session's peers task closes its gate quietly).
    session.carrier.bundle_gate().set(false);
    // What this session held goes back to the broker with it.
    shared.stats.held.store(0, Ordering::Relaxed);
    shared.stats.work_window.store(0, Ordering::Relaxed);
    shared.stats.returns_window.store(0, Ordering::Relaxed);
    shared.stats.in_flight.store(0, Ordering::Relaxed);
    if result.is_ok() && publishing.blocked().borrow().is_none() {
        // Close our channels before the connection closes, so nothing is cut mid-frame
        // (bounded: a broker that blocks now reads nothing).
        let _ = tokio::time::timeout(CLOSE_TIMEOUT, async {
            let _ = session.returns.channel.close().await;
            let _ = session.work.channel.close().await;
            session.carrier.close().await;
        })
        .await;
    }
    result
}

/// The state of one session.
struct Session {
    shared: Arc<Shared>,
    /// Set while the broker blocks the consuming connection (it then reads nothing).
    consumer_blocked: watch::Receiver<Option<String>>,
    /// The work queue: new messages.
    work: Consuming,
    /// The returns queue: what comes back from the levels.
    returns: Consuming,
    carrier: Carrier,
    /// What carriers report.
    events: mpsc::UnboundedReceiver<Event>,
    /// Fires when the session stops.
    stop: CancellationToken,
    /// The cancel-stream follower, until it ends.
    follower: Option<tokio::task::JoinHandle<Result<(), BridgeError>>>,
    /// False once shutdown began: no new deliveries.
    consuming: bool,
}

impl Session {
    /// Drives the session until shutdown drains it (`Ok`) or something breaks (`Err`).
    async fn drive(&mut self, shutdown: &CancellationToken) -> Result<(), BridgeError> {
        let config = self.shared.config.clone();
        let mut drain_deadline = None;
        let mut report = tokio::time::interval(Duration::from_secs(10));
        // A consumer that could not be replaced at once (the broker blocked the connection,
        // or too many bytes were held) is tried again on this tick too.
        let mut retry_resume = tokio::time::interval(Duration::from_millis(500));
        loop {
            if !self.consuming && self.outstanding() == 0 {
                return Ok(());
            }
            // What came back from the levels goes first: it is due soonest.
            tokio::select! {
                biased;
                Some(event) = self.events.recv() => self.settle(event).await?,
                next = self.returns.next(), if self.consuming && self.returns.has_consumer() => {
                    self.take(Inlet::Returns, next).await?;
                }
                next = self.work.next(), if self.consuming && self.work.has_consumer() => {
                    self.take(Inlet::Work, next).await?;
                }
                ended = follow(&mut self.follower), if self.follower.is_some() => {
                    self.follower = None;
                    match ended {
                        Ok(Ok(())) => {}
                        Ok(Err(e)) => return Err(e),
                        Err(e) => {
                            return Err(BridgeError::ConsumerEnded(format!(
                                "the cancel-stream follower failed: {e}"
                            )));
                        }
                    }
                }
                _ = shutdown.cancelled(), if self.consuming => {
                    self.begin_drain().await;
                    drain_deadline = Some(tokio::time::Instant::now() + config.shutdown_timeout);
                }
                _ = sleep_until(drain_deadline), if drain_deadline.is_some() => {
                    tracing::warn!(
                        outstanding = self.outstanding(),
                        "shutdown timeout: leaving unconfirmed deliveries unacked (the broker redelivers them)"
                    );
                    return Ok(());
                }
                _ = retry_resume.tick(), if self.waits_to_resume() => {
                    self.resume().await?;
                }
                _ = report.tick() => {
                    let held = self.held();
                    if held > 0 {
                        tracing::info!(held, outstanding = self.outstanding(), prefetch = config.prefetch, "holding messages for their last moments");
                    }
                }
            }
        }
    }

    fn inlet(&mut self, inlet: Inlet) -> &mut Consuming {
        match inlet {
            Inlet::Work => &mut self.work,
            Inlet::Returns => &mut self.returns,
        }
    }

    /// Deliveries taken and not yet acked, from both queues.
    fn outstanding(&self) -> usize {
        self.work.tracker.outstanding() + self.returns.tracker.outstanding()
    }

    /// Deliveries waiting on a hold timer, from both queues.
    fn held(&self) -> usize {
        self.work.tracker.held_count() + self.returns.tracker.held_count()
    }

    /// True while a cancelled consumer waits for its successor.
    fn waits_to_resume(&self) -> bool {
        [&self.work, &self.returns]
            .iter()
            .any(|c| c.is_replacing() && !c.has_consumer())
    }

    /// Takes what `inlet`'s consumer gave: a delivery to carry, or its end.
    async fn take(
        &mut self,
        inlet: Inlet,
        next: Result<Option<Delivery>, WireError>,
    ) -> Result<(), BridgeError> {
        match next {
            Ok(Some(delivery)) => {
                let budget_bytes = self.carrier.budget_bytes(&delivery);
                let tag = Tag {
                    inlet,
                    delivery: delivery.delivery_tag,
                };
                let consuming = self.inlet(inlet);
                consuming.tracker.delivered(tag.delivery);
                let retune = consuming.budget.taken(budget_bytes);
                let stats = &self.shared.stats;
                stats.consumed.fetch_add(1, Ordering::Relaxed);
                stats
                    .in_flight
                    .store(self.outstanding() as u64, Ordering::Relaxed);
                stats.max_unacked_bytes_seen.fetch_max(
                    self.work.budget.unacked() + self.returns.budget.unacked(),
                    Ordering::Relaxed,
                );
                if matches!(retune, Some(Retune::Pause(_))) {
                    stats.pauses.fetch_add(1, Ordering::Relaxed);
                }
                self.carrier.start(tag, delivery, budget_bytes);
                if let Some(retune) = retune {
                    self.inlet(inlet).replace_consumer(retune);
                }
                Ok(())
            }
            Err(e) => Err(BridgeError::wire("consuming")(e)),
            // A consumer this session cancelled has handed over its last delivery.
            Ok(None) if self.inlet(inlet).ended() => self.resume().await,
            Ok(None) => Err(BridgeError::ConsumerEnded(format!(
                "the broker cancelled the consumer of {}",
                self.inlet(inlet).queue()
            ))),
        }
    }

    /// Folds `first` and every event that finished meanwhile into one batch of acks per
    /// queue: one `multiple` ack instead of one ack (and one wait for the client's writer)
    /// per message.
    async fn settle(&mut self, first: Event) -> Result<(), BridgeError> {
        let shared = self.shared.clone();
        let stats = &shared.stats;
        let mut work_ops = Vec::new();
        let mut returns_ops = Vec::new();
        let mut failure = None;
        let mut next = Some(first);
        let mut batched = 0;
        while let Some(event) = next {
            match event {
                Event::Held(tag) => self.inlet(tag.inlet).tracker.held(tag.delivery),
                Event::Ended {
                    tag,
                    budget_bytes,
                    outcome,
                } => {
                    let consuming = self.inlet(tag.inlet);
                    consuming.budget.settled(budget_bytes);
                    let ops = match tag.inlet {
                        Inlet::Work => &mut work_ops,
                        Inlet::Returns => &mut returns_ops,
                    };
                    match outcome {
                        Ok(()) => ops.extend(consuming.tracker.done(tag.delivery)),
                        Err(Stop::Release) => {
                            stats.released.fetch_add(1, Ordering::Relaxed);
                            ops.extend(consuming.tracker.release(tag.delivery));
                        }
                        Err(Stop::Failed(error)) => {
                            stats.released.fetch_add(1, Ordering::Relaxed);
                            ops.extend(consuming.tracker.release(tag.delivery));
                            failure.get_or_insert(error);
                        }
                    }
                }
            }
            batched += 1;
            next = if batched < MAX_EVENT_BATCH {
                self.events.try_recv().ok()
            } else {
                None
            };
        }
        stats.held.store(self.held() as u64, Ordering::Relaxed);
        stats
            .in_flight
            .store(self.outstanding() as u64, Ordering::Relaxed);
        self.returns.apply(AckTracker::compact(returns_ops))?;
        self.work.apply(AckTracker::compact(work_ops))?;
        match failure {
            Some(error) => Err(error),
            None => self.resume().await,
        }
    }

    /// Starts the replacement consumers that may start: the session still consumes and the
    /// broker reads again.
    async fn resume(&mut self) -> Result<(), BridgeError> {
        if !self.consuming || self.consumer_blocked.borrow().is_some() {
            return Ok(());
        }
        self.returns.resume().await?;
        self.work.resume().await
    }

    /// Shutdown: no new deliveries; held messages and backoffs give theirs back.
    async fn begin_drain(&mut self) {
        self.consuming = false;
        tracing::info!(
            outstanding = self.outstanding(),
            "stopping: no new deliveries; releasing held messages, waiting for in-flight confirms"
        );
        // A broker under a resource alarm reads nothing, not even a cancel.
        if self.consumer_blocked.borrow().is_none() {
            let _ = tokio::time::timeout(CLOSE_TIMEOUT, async {
                self.returns.cancel().await;
                self.work.cancel().await;
            })
            .await;
        }
        self.stop.cancel();
    }
}

/// Waits until lapin's control connection fails (or its events end); gives why. lapin
/// reports a channel the broker closed (a passive declare of a queue that is gone, say) as
/// an error event too: that one leaves the connection connected, and the session goes on.
async fn control_failed(
    connection: &Connection,
    mut events: impl Stream<Item = lapin::Event> + Unpin,
) -> String {
    while let Some(event) = events.next().await {
        if let lapin::Event::Error(error) = event
            && !connection.status().connected()
        {
            return error.to_string();
        }
    }
    "the connection's events ended".into()
}

/// The follower's end (pending while there is none).
async fn follow(
    follower: &mut Option<tokio::task::JoinHandle<Result<(), BridgeError>>>,
) -> Result<Result<(), BridgeError>, tokio::task::JoinError> {
    match follower {
        Some(handle) => handle.await,
        None => std::future::pending().await,
    }
}

async fn sleep_until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::options::QueueDeclareOptions;
    use lapin::types::FieldTable;

    /// A channel the broker closes on the control connection (a passive declare of a queue
    /// that is gone: the depth readings meet one when an operator deletes a level) is an
    /// error event to lapin, and the connection stays up: it must not end the session.
    /// (A lost control connection ending it is tests/faults' `a_lost_control_connection_...`.)
    #[tokio::test]
    async fn a_channel_error_on_the_control_connection_does_not_end_the_session() {
        let url = std::env::var("DELAY_BRIDGE_TEST_URL")
            .unwrap_or_else(|_| crate::config::DEFAULT_URL.to_string());
        let url = crate::config::BrokerUrl::parse(&url).expect("a broker URL");
        let connection = Arc::new(
            crate::amqp::connect(&url, "session test control")
                .await
                .expect("the test broker answers"),
        );
        let events = Box::pin(connection.events_listener());
        let channel = connection.create_channel().await.expect("a channel");
        let missing = format!("delay-bridge-session-test-{:08x}", rand::random::<u32>());
        let declared = channel
            .queue_declare(
                missing.as_str().into(),
                QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await;
        assert!(declared.is_err(), "the queue does not exist");
        let watching = {
            let connection = connection.clone();
            tokio::spawn(async move { control_failed(&connection, events).await })
        };
        let ended = tokio::time::timeout(Duration::from_millis(500), watching).await;
        assert!(ended.is_err(), "the session went on: {ended:?}");
        assert!(connection.status().connected());
        let _ = connection.close(200, "done".into()).await;
    }
}
