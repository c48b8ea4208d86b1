//! One session: consume the work queue on one of the project's own connections
//! ([`crate::amqp::wire`]), hand each delivery to a [`Carrier`] (which publishes on the
//! other), fold what carriers report into batched acks, and drain on shutdown. lapin's
//! connection carries the cancel stream and the depth readings. This is the only place
//! that acks.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use lapin::Connection;
use lapin::types::FieldTable;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use super::acks::{AckOp, AckTracker};
use super::budget::{ByteBudget, Retune};
use super::carrier::{Carrier, Event, Outcome};
use super::{BridgeError, CLOSE_TIMEOUT, Shared, cancels, depths};
use crate::amqp::publisher::Publisher;
use crate::amqp::wire::{self, Channel, Consumer, Delivery, Settle, WireError};

/// Most carrier events folded into one batch of acks (bounds the time the loop spends away
/// from the consumer).
const MAX_EVENT_BATCH: usize = 4096;

/// The session's two connections of the project's own: consuming and publishing apart, so
/// that the broker's flow control on publishes never holds back the acks.
pub(super) struct Wires<'a> {
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
        consuming,
        publishing,
    } = wires;
    let consume = consuming
        .open_channel()
        .await
        .map_err(BridgeError::wire("opening the consumer channel"))?;
    let budget = ByteBudget::new(config.max_unacked_bytes, config.prefetch);
    consume
        .qos(budget.window())
        .await
        .map_err(BridgeError::wire("setting prefetch"))?;
    let publish = Publisher::open(publishing, config.confirm_timeout)
        .await
        .map_err(BridgeError::wire("opening the publisher channel"))?;
    let stop = CancellationToken::new();
    let _stop_carriers_on_exit = stop.clone().drop_guard();
    let follower = cancels::follow(shared.clone(), &connection, &publish, stop.clone()).await?;
    let consumer_tag = consumer_tag(0);
    let consumer = consume_work_queue(&consume, &shared, &consumer_tag).await?;
    tokio::spawn(depths::run(
        shared.clone(),
        connection.clone(),
        stop.clone(),
    ));
    ready.send_replace(true);
    tracing::info!(queue = %config.names.work_queue(), prefetch = config.prefetch, "consuming");

    let (events_tx, events) = mpsc::unbounded_channel();
    let carrier = Carrier::new(shared.clone(), publishing, publish, events_tx, stop.clone());
    let mut session = Session {
        shared: shared.clone(),
        consumer_blocked: consuming.blocked(),
        consume,
        consumer: Some(consumer),
        consumer_tag,
        consumers_started: 1,
        replacing: false,
        budget,
        carrier,
        events,
        tracker: AckTracker::new(),
        stop,
        follower: Some(follower),
        consuming: true,
    };
    // A publishing connection that fails ends the session at once, not at the next
    // publish.
    let result = tokio::select! {
        result = session.drive(shutdown) => result,
        error = publishing.failed() => Err(BridgeError::wire("publishing")(error)),
    };
    session.stop.cancel();
    // What this session held goes back to the broker with it.
    shared.stats.held.store(0, Ordering::Relaxed);
    shared.stats.in_flight.store(0, Ordering::Relaxed);
    if result.is_ok() && publishing.blocked().borrow().is_none() {
        // Close our channels before the connection closes, so nothing is cut mid-frame
        // (bounded: a broker that blocks now reads nothing).
        let _ = tokio::time::timeout(CLOSE_TIMEOUT, async {
            let _ = session.consume.close().await;
            session.carrier.close().await;
        })
        .await;
    }
    result
}

/// This process's `n`th consumer tag on a channel (a paused consumer is cancelled, and its
/// successor needs a tag of its own).
fn consumer_tag(n: u64) -> String {
    format!("delay-bridge-{}-{n}", std::process::id())
}

async fn consume_work_queue(
    consume: &Channel,
    shared: &Shared,
    consumer_tag: &str,
) -> Result<Consumer, BridgeError> {
    consume
        .consume(
            &shared.config.names.work_queue(),
            consumer_tag,
            FieldTable::default(),
        )
        .await
        .map_err(BridgeError::wire("consuming the work queue"))
}

/// The state of one session.
struct Session {
    shared: Arc<Shared>,
    /// Set while the broker blocks the consuming connection (it then reads nothing).
    consumer_blocked: watch::Receiver<Option<String>>,
    /// The channel the work queue is consumed and acked on.
    consume: Channel,
    /// The work-queue consumer; `None` once a paused one has handed over its last delivery.
    consumer: Option<Consumer>,
    consumer_tag: String,
    /// Consumers started on `consume` (each needs its own tag).
    consumers_started: u64,
    /// True from the moment the consumer is cancelled to change its prefetch window until
    /// its successor starts.
    replacing: bool,
    /// The body bytes of deliveries not yet settled, and the prefetch window that keeps
    /// them within `bridge.max_unacked_bytes`.
    budget: ByteBudget,
    carrier: Carrier,
    /// What carriers report.
    events: mpsc::UnboundedReceiver<Event>,
    /// The deliveries not yet acked, and which acks to send.
    tracker: AckTracker,
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
            if !self.consuming && self.tracker.outstanding() == 0 {
                return Ok(());
            }
            tokio::select! {
                biased;
                Some(event) = self.events.recv() => self.settle(event).await?,
                next = next_delivery(&mut self.consumer), if self.consuming && self.consumer.is_some() => match next {
                    Ok(Some(delivery)) => {
                        self.shared.stats.consumed.fetch_add(1, Ordering::Relaxed);
                        self.tracker.delivered(delivery.delivery_tag);
                        self.shared
                            .stats
                            .in_flight
                            .store(self.tracker.outstanding() as u64, Ordering::Relaxed);
                        let budget_bytes = self.carrier.budget_bytes(&delivery);
                        let retune = self.budget.taken(budget_bytes);
                        self.shared
                            .stats
                            .max_unacked_bytes_seen
                            .fetch_max(self.budget.unacked(), Ordering::Relaxed);
                        self.carrier.start(delivery, budget_bytes);
                        if let Some(retune) = retune {
                            self.replace_consumer(retune);
                        }
                    }
                    Err(e) => return Err(BridgeError::wire("consuming")(e)),
                    // A consumer this session cancelled has handed over its last delivery.
                    Ok(None) if self.replacing => {
                        self.consumer = None;
                        self.resume().await?;
                    }
                    Ok(None) => {
                        return Err(BridgeError::ConsumerEnded(
                            "the broker cancelled the consumer".into(),
                        ));
                    }
                },
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
                        outstanding = self.tracker.outstanding(),
                        "shutdown timeout: leaving unconfirmed deliveries unacked (the broker redelivers them)"
                    );
                    return Ok(());
                }
                _ = retry_resume.tick(), if self.replacing && self.consumer.is_none() => {
                    self.resume().await?;
                }
                _ = report.tick() => {
                    let held = self.tracker.held_count();
                    if held > 0 {
                        tracing::info!(held, outstanding = self.tracker.outstanding(), prefetch = config.prefetch, "holding messages for their last moments");
                    }
                }
            }
        }
    }

    /// Folds `first` and every event that finished meanwhile into one batch of acks: one
    /// `multiple` ack instead of one ack (and one wait for the client's writer) per message.
    async fn settle(&mut self, first: Event) -> Result<(), BridgeError> {
        let shared = self.shared.clone();
        let stats = &shared.stats;
        let mut ops = Vec::new();
        let mut failure = None;
        let mut next = Some(first);
        let mut batched = 0;
        while let Some(event) = next {
            match event {
                Event::Held(tag) => self.tracker.held(tag),
                Event::Ended {
                    tag,
                    budget_bytes,
                    outcome,
                } => {
                    self.budget.settled(budget_bytes);
                    match outcome {
                        Outcome::Done => ops.extend(self.tracker.done(tag)),
                        Outcome::Release => {
                            stats.released.fetch_add(1, Ordering::Relaxed);
                            ops.extend(self.tracker.release(tag));
                        }
                        Outcome::Failed(error) => {
                            stats.released.fetch_add(1, Ordering::Relaxed);
                            ops.extend(self.tracker.release(tag));
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
        stats
            .held
            .store(self.tracker.held_count() as u64, Ordering::Relaxed);
        stats
            .in_flight
            .store(self.tracker.outstanding() as u64, Ordering::Relaxed);
        apply(&self.consume, AckTracker::compact(ops))?;
        match failure {
            Some(error) => Err(error),
            None => self.resume().await,
        }
    }

    /// Cancels the consumer so that another one can start with the budget's new window.
    /// Deliveries the broker sent before the cancel still arrive and are carried; then the
    /// stream ends. The cancel runs apart from this loop: a broker that blocks the
    /// connection reads nothing, and the loop must still settle and shut down.
    fn replace_consumer(&mut self, retune: Retune) {
        tracing::debug!(
            ?retune,
            unacked_bytes = self.budget.unacked(),
            "changing the consumer's prefetch window for bridge.max_unacked_bytes"
        );
        if matches!(retune, Retune::Pause(_)) {
            self.shared.stats.pauses.fetch_add(1, Ordering::Relaxed);
        }
        self.replacing = true;
        let channel = self.consume.clone();
        let tag = self.consumer_tag.as_str().into();
        tokio::spawn(async move {
            if let Err(e) = channel.cancel(&tag).await {
                // The channel is gone: the session learns it from the consumer.
                tracing::debug!(error = %e, "cancelling the consumer");
            }
        });
    }

    /// Starts the replacement consumer with the budget's window, once the old one handed
    /// over its last delivery, enough of the budget is free and the broker reads again.
    async fn resume(&mut self) -> Result<(), BridgeError> {
        if !self.replacing
            || self.consumer.is_some()
            || !self.consuming
            || !self.budget.may_resume()
            || self.consumer_blocked.borrow().is_some()
        {
            return Ok(());
        }
        let window = self.budget.window();
        self.consume
            .qos(window)
            .await
            .map_err(BridgeError::wire("setting prefetch"))?;
        self.consumer_tag = consumer_tag(self.consumers_started);
        self.consumers_started += 1;
        self.consumer =
            Some(consume_work_queue(&self.consume, &self.shared, &self.consumer_tag).await?);
        self.replacing = false;
        self.budget.resumed();
        tracing::debug!(window, unacked_bytes = self.budget.unacked(), "consuming");
        Ok(())
    }

    /// Shutdown: no new deliveries; held messages and backoffs give theirs back.
    async fn begin_drain(&mut self) {
        self.consuming = false;
        tracing::info!(
            outstanding = self.tracker.outstanding(),
            "stopping: no new deliveries; releasing held messages, waiting for in-flight confirms"
        );
        // A broker under a resource alarm reads nothing, not even a cancel. A consumer
        // being replaced was cancelled already.
        if !self.replacing && self.consumer_blocked.borrow().is_none() {
            let _ = tokio::time::timeout(
                CLOSE_TIMEOUT,
                self.consume.cancel(&self.consumer_tag.as_str().into()),
            )
            .await;
        }
        self.stop.cancel();
    }
}

/// The consumer's next delivery (pending while there is none).
async fn next_delivery(consumer: &mut Option<Consumer>) -> Result<Option<Delivery>, WireError> {
    match consumer {
        Some(consumer) => consumer.next().await,
        None => std::future::pending().await,
    }
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

/// Sends acks and requeues, in `ops`' order, in one write. Any error means the channel is
/// gone, and the broker redelivers everything unacked. The order matters: an ack that
/// overtook a requeue or a single ack it covers would close the channel, which the no-loss
/// tests would see as redeliveries.
fn apply(channel: &Channel, ops: Vec<AckOp>) -> Result<(), BridgeError> {
    if ops.is_empty() {
        return Ok(());
    }
    channel
        .settle(ops.into_iter().map(|op| match op {
            AckOp::Multiple(tag) => Settle::Ack {
                tag,
                multiple: true,
            },
            AckOp::Single(tag) => Settle::Ack {
                tag,
                multiple: false,
            },
            AckOp::Requeue(tag) => Settle::Nack {
                tag,
                multiple: false,
                requeue: true,
            },
        }))
        .map_err(BridgeError::wire("acknowledging"))
}
