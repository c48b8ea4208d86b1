//! One queue the session consumes, on a channel of its own: its consumer, the prefetch
//! window the byte budget allows it, and its acks.
//!
//! The session consumes two queues: the work queue (new messages) and the returns queue
//! (messages and bundles back from the levels). Apart, because RabbitMQ walks a channel's
//! unacked deliveries from the oldest for every ack that is not the oldest (both the
//! channel and the queue do). Messages back from a level are often held for their last
//! second, unacked; on the channel of new messages, which are acked within a hop window,
//! every ack walked past all of them.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use lapin::types::FieldTable;

use super::acks::{AckOp, AckTracker};
use super::budget::{ByteBudget, Retune};
use super::{BridgeError, Shared, Stats};
use crate::amqp::wire::{self, Channel, Consumer, Delivery, Settle, WireError};

/// Which of the session's queues a delivery came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Inlet {
    /// The work queue: new messages from the ingress exchanges.
    Work,
    /// The returns queue: what the levels dead-letter into the work exchange (and what
    /// `parked replay` publishes there).
    Returns,
}

impl Inlet {
    /// Its name in consumer tags and logs.
    fn as_str(self) -> &'static str {
        match self {
            Inlet::Work => "work",
            Inlet::Returns => "returns",
        }
    }
}

/// A delivery's tag on the channel of the queue it came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Tag {
    /// The queue it came from.
    pub(super) inlet: Inlet,
    /// Its delivery tag on that queue's channel.
    pub(super) delivery: u64,
}

/// How often a queue's consumer was handed over to a successor (to change its window),
/// counted at both ends: odd while the old one is cancelled and the new one not yet
/// started. The peers watch reads it, so as not to take this bridge's own returns
/// consumer, between two consumers, for an instance that cannot read bundles.
#[derive(Debug, Default)]
pub(super) struct Handovers(AtomicU64);

impl Handovers {
    /// A handover began or ended.
    pub(super) fn step(&self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }

    /// A reading to pass to [`Handovers::between_since`].
    pub(super) fn reading(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }

    /// True when the queue had no consumer of this session at some moment since
    /// `reading` was taken (one was under way then, or one began or ended since).
    pub(super) fn between_since(&self, reading: u64) -> bool {
        reading % 2 == 1 || self.reading() != reading
    }
}

/// One consumed queue, its channel, its share of the byte budget and its acks.
pub(super) struct Consuming {
    inlet: Inlet,
    queue: String,
    /// The channel the queue is consumed and acked on.
    pub(super) channel: Channel,
    /// The consumer; `None` once a paused one has handed over its last delivery.
    consumer: Option<Consumer>,
    consumer_tag: String,
    /// Consumers started on `channel` (each needs its own tag).
    consumers_started: u64,
    /// True from the moment the consumer is cancelled to change its prefetch window until
    /// its successor starts.
    replacing: bool,
    /// The body bytes of this queue's deliveries not yet settled, and the prefetch window
    /// that keeps them within its share of `bridge.max_unacked_bytes`.
    pub(super) budget: ByteBudget,
    /// The deliveries not yet acked, and which acks to send.
    pub(super) tracker: AckTracker,
    /// Where the running consumer's window is reported.
    stats: Arc<Stats>,
    /// Its consumer's handovers, as the peers watch reads them.
    handovers: Arc<Handovers>,
}

impl Consuming {
    /// Opens a channel on `connection` and consumes `inlet`'s queue with a window of
    /// `budget`.
    pub(super) async fn open(
        connection: &wire::Connection,
        shared: &Shared,
        inlet: Inlet,
        budget: ByteBudget,
    ) -> Result<Self, BridgeError> {
        let names = &shared.config.names;
        let queue = match inlet {
            Inlet::Work => names.work_queue(),
            Inlet::Returns => names.returns_queue(),
        };
        let channel = connection
            .open_channel()
            .await
            .map_err(BridgeError::wire("opening a consumer channel"))?;
        channel
            .qos(budget.window())
            .await
            .map_err(BridgeError::wire("setting prefetch"))?;
        let mut consuming = Self {
            inlet,
            queue,
            channel,
            consumer: None,
            consumer_tag: String::new(),
            consumers_started: 0,
            replacing: false,
            budget,
            tracker: AckTracker::new(),
            stats: shared.stats.clone(),
            handovers: Arc::default(),
        };
        consuming.consume().await?;
        Ok(consuming)
    }

    /// Its consumer's handovers.
    pub(super) fn handovers(&self) -> Arc<Handovers> {
        self.handovers.clone()
    }

    /// The queue's name.
    pub(super) fn queue(&self) -> &str {
        &self.queue
    }

    /// True while a consumer runs or hands over its last deliveries.
    pub(super) fn has_consumer(&self) -> bool {
        self.consumer.is_some()
    }

    /// True while a cancelled consumer waits for its successor.
    pub(super) fn is_replacing(&self) -> bool {
        self.replacing
    }

    /// The consumer's next delivery (pending while there is none).
    pub(super) async fn next(&mut self) -> Result<Option<Delivery>, WireError> {
        match &mut self.consumer {
            Some(consumer) => consumer.next().await,
            None => std::future::pending().await,
        }
    }

    /// The consumer ended: a cancelled one handed over its last delivery (true), or the
    /// broker cancelled it (false).
    pub(super) fn ended(&mut self) -> bool {
        self.consumer = None;
        self.replacing
    }

    /// Cancels the consumer so that another one can start with the budget's new window.
    /// Deliveries the broker sent before the cancel still arrive and are carried; then the
    /// stream ends. The cancel runs apart from the session's loop: a broker that blocks the
    /// connection reads nothing, and the loop must still settle and shut down.
    pub(super) fn replace_consumer(&mut self, retune: Retune) {
        tracing::debug!(
            queue = %self.queue,
            ?retune,
            unacked_bytes = self.budget.unacked(),
            "changing the consumer's prefetch window for bridge.max_unacked_bytes"
        );
        self.replacing = true;
        self.handovers.step();
        let channel = self.channel.clone();
        let tag = self.consumer_tag.as_str().into();
        tokio::spawn(async move {
            if let Err(e) = channel.cancel(&tag).await {
                // The channel is gone: the session learns it from the consumer.
                tracing::debug!(error = %e, "cancelling the consumer");
            }
        });
    }

    /// Starts the replacement consumer with the budget's window, once the old one handed
    /// over its last delivery and enough of the budget is free (the caller knows that the
    /// broker reads again).
    pub(super) async fn resume(&mut self) -> Result<(), BridgeError> {
        if !self.replacing || self.consumer.is_some() || !self.budget.may_resume() {
            return Ok(());
        }
        let window = self.budget.window();
        self.channel
            .qos(window)
            .await
            .map_err(BridgeError::wire("setting prefetch"))?;
        self.consume().await?;
        self.replacing = false;
        self.handovers.step();
        self.budget.resumed();
        tracing::debug!(queue = %self.queue, window, unacked_bytes = self.budget.unacked(), "consuming");
        Ok(())
    }

    /// Cancels the consumer for shutdown, unless one is being replaced (cancelled already).
    pub(super) async fn cancel(&self) {
        if !self.replacing {
            let _ = self
                .channel
                .cancel(&self.consumer_tag.as_str().into())
                .await;
        }
    }

    /// Sends acks and requeues, in `ops`' order, in one write. Any error means the channel
    /// is gone, and the broker redelivers everything unacked. The order matters: an ack that
    /// overtook a requeue or a single ack it covers would close the channel, which the
    /// no-loss tests would see as redeliveries.
    pub(super) fn apply(&self, ops: Vec<AckOp>) -> Result<(), BridgeError> {
        if ops.is_empty() {
            return Ok(());
        }
        self.channel
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

    /// Starts a consumer with a tag of its own.
    async fn consume(&mut self) -> Result<(), BridgeError> {
        self.consumer_tag = format!(
            "delay-bridge-{}-{}-{}",
            std::process::id(),
            self.inlet.as_str(),
            self.consumers_started
        );
        self.consumers_started += 1;
        let what = match self.inlet {
            Inlet::Work => "consuming the work queue",
            Inlet::Returns => "consuming the returns queue",
        };
        let consumer = self
            .channel
            .consume(&self.queue, &self.consumer_tag, FieldTable::default())
            .await
            .map_err(BridgeError::wire(what))?;
        self.consumer = Some(consumer);
        let window = u64::from(self.budget.window());
        let gauge = match self.inlet {
            Inlet::Work => &self.stats.work_window,
            Inlet::Returns => &self.stats.returns_window,
        };
        gauge.store(window, Ordering::Relaxed);
        Ok(())
    }
}
