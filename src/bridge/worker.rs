//! One session on one connection: consume the work queue, decide each delivery with the pure
//! core, publish what replaces it with confirms (many in flight at once), and ack only what
//! is confirmed. This is the only place that acks; hold timers live only here.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use futures::StreamExt;
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions};
use lapin::types::{FieldTable, ShortString};
use lapin::{Channel, Connection};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use super::acks::{AckOp, AckTracker};
use super::cancels;
use super::{BridgeError, Shared, now_ms, until_epoch_ms};
use crate::amqp::targets::TargetChannels;
use crate::amqp::{self, Published};
use crate::contract::{
    self, Envelope, Incoming, Intake, ParkReason, Parked, consumed_properties, delivery_properties,
    hop_properties, parked_properties,
};
use crate::plan::{Step, next_step};
use crate::topology::PARK_AFTER_REDELIVERIES;

/// What a message task reports to the session loop.
enum Event {
    /// The delivery waits on a hold timer.
    Held(u64),
    /// Its replacement is confirmed: it may be acked.
    Done(u64),
    /// It goes back to the broker unprocessed.
    Release(u64),
    /// Publishing failed in a way that needs a new session; it goes back to the broker.
    Failed(u64, BridgeError),
}

/// Most task events folded into one batch of acks (bounds the time the loop spends away
/// from the consumer).
const MAX_EVENT_BATCH: usize = 4096;

/// What each message task needs.
#[derive(Clone)]
struct Task {
    shared: Arc<Shared>,
    publish: Channel,
    targets: Arc<TargetChannels>,
    events: mpsc::UnboundedSender<Event>,
    stop: CancellationToken,
}

/// A decoded delivery on its way to its target.
struct Moving {
    tag: u64,
    body: Vec<u8>,
    envelope: Envelope,
    /// When the bridge read it, epoch ms (for the delivered log line).
    read_at: u64,
}

/// A delivery to park as it was consumed.
struct Parking {
    body: Vec<u8>,
    routing_key: ShortString,
    consumed: lapin::BasicProperties,
    parked: Parked,
}

/// How a message ended, from the task's point of view.
enum Outcome {
    Done,
    Release,
    Failed(BridgeError),
}

pub(super) async fn run_session(
    shared: Arc<Shared>,
    connection: Arc<Connection>,
    shutdown: &CancellationToken,
    ready: &watch::Sender<bool>,
) -> Result<(), BridgeError> {
    let config = &shared.config;
    let consume = connection
        .create_channel()
        .await
        .map_err(BridgeError::broker("opening the consumer channel"))?;
    consume
        .basic_qos(config.prefetch, BasicQosOptions::default())
        .await
        .map_err(BridgeError::broker("setting prefetch"))?;
    let publish = amqp::confirm_channel(&connection)
        .await
        .map_err(BridgeError::broker("opening the publisher channel"))?;
    let stop = CancellationToken::new();
    let _stop_tasks_on_exit = stop.clone().drop_guard();
    let follower = cancels::follow(shared.clone(), &connection, &publish, stop.clone()).await?;
    let work_queue = config.names.work_queue();
    let consumer_tag = format!("delay-bridge-{}", std::process::id());
    let mut consumer = consume
        .basic_consume(
            work_queue.as_str().into(),
            consumer_tag.as_str().into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(BridgeError::broker("consuming the work queue"))?;
    ready.send_replace(true);
    tracing::info!(queue = %work_queue, prefetch = config.prefetch, "consuming");

    let (events_tx, mut events) = mpsc::unbounded_channel();
    let task = Task {
        shared: shared.clone(),
        publish,
        targets: Arc::new(TargetChannels::new(connection.clone())),
        events: events_tx,
        stop: stop.clone(),
    };
    let result = session_loop(
        &shared,
        &consume,
        &mut consumer,
        &consumer_tag,
        &task,
        &stop,
        &mut events,
        shutdown,
        follower,
    )
    .await;
    stop.cancel();
    if result.is_ok() {
        // Close our channels before the connection closes, so nothing is cut mid-frame.
        let _ = consume.close(200, "delay-bridge stopping".into()).await;
        let _ = task
            .publish
            .close(200, "delay-bridge stopping".into())
            .await;
        task.targets.close_all().await;
    }
    result
}

/// Drives one session until shutdown drains it (`Ok`) or something breaks (`Err`).
#[allow(clippy::too_many_arguments)]
async fn session_loop(
    shared: &Arc<Shared>,
    consume: &Channel,
    consumer: &mut lapin::Consumer,
    consumer_tag: &str,
    task: &Task,
    stop: &CancellationToken,
    events: &mut mpsc::UnboundedReceiver<Event>,
    shutdown: &CancellationToken,
    mut follower: tokio::task::JoinHandle<Result<(), BridgeError>>,
) -> Result<(), BridgeError> {
    let config = &shared.config;
    let mut following = true;
    let mut tracker = AckTracker::new();
    let mut consuming = true;
    let mut drain_deadline = None;
    let mut report = tokio::time::interval(Duration::from_secs(10));
    loop {
        if !consuming && tracker.outstanding() == 0 {
            return Ok(());
        }
        tokio::select! {
            biased;
            Some(event) = events.recv() => {
                // Everything that finished meanwhile goes in one batch: one `multiple` ack
                // instead of one ack (and one wait for lapin's writer) per message.
                let mut ops = Vec::new();
                let mut failure = None;
                let mut next = Some(event);
                let mut batched = 0;
                while let Some(event) = next {
                    match event {
                        Event::Held(tag) => tracker.held(tag),
                        Event::Done(tag) => ops.extend(tracker.done(tag)),
                        Event::Release(tag) => {
                            shared.stats.released.fetch_add(1, Ordering::Relaxed);
                            ops.extend(tracker.release(tag));
                        }
                        Event::Failed(tag, error) => {
                            shared.stats.released.fetch_add(1, Ordering::Relaxed);
                            ops.extend(tracker.release(tag));
                            failure.get_or_insert(error);
                        }
                    }
                    batched += 1;
                    next = if batched < MAX_EVENT_BATCH { events.try_recv().ok() } else { None };
                }
                shared.stats.held.store(tracker.held_count() as u64, Ordering::Relaxed);
                apply(consume, AckTracker::compact(ops)).await?;
                if let Some(error) = failure {
                    return Err(error);
                }
            }
            next = consumer.next(), if consuming => {
                let delivery = match next {
                    Some(Ok(delivery)) => delivery,
                    Some(Err(e)) => return Err(BridgeError::broker("consuming")(e)),
                    None => return Err(BridgeError::ConsumerEnded("the broker cancelled the consumer".into())),
                };
                shared.stats.consumed.fetch_add(1, Ordering::Relaxed);
                tracker.delivered(delivery.delivery_tag);
                let task = task.clone();
                let tag = delivery.delivery_tag;
                // Decoded here, so the task below keeps only what it needs (its future is
                // the per-delivery memory cost while thousands are held).
                let prepared = task.prepare(delivery);
                tokio::spawn(async move {
                    let outcome = match &prepared {
                        Ok(moving) => task.carry(moving).await,
                        Err(parking) => Box::pin(task.park(
                            &parking.body,
                            &parking.routing_key,
                            &parking.consumed,
                            &parking.parked,
                        ))
                        .await,
                    };
                    let event = match outcome {
                        Outcome::Done => Event::Done(tag),
                        Outcome::Release => Event::Release(tag),
                        Outcome::Failed(e) => Event::Failed(tag, e),
                    };
                    let _ = task.events.send(event);
                });
            }
            ended = &mut follower, if following => {
                following = false;
                match ended {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => return Err(e),
                    Err(e) => return Err(BridgeError::ConsumerEnded(format!("the cancel-stream follower failed: {e}"))),
                }
            }
            _ = shutdown.cancelled(), if consuming => {
                consuming = false;
                tracing::info!(outstanding = tracker.outstanding(), "stopping: no new deliveries; releasing held messages, waiting for in-flight confirms");
                let _ = consume
                    .basic_cancel(consumer_tag.into(), Default::default())
                    .await;
                stop.cancel();
                drain_deadline = Some(tokio::time::Instant::now() + config.shutdown_timeout);
            }
            _ = sleep_until(drain_deadline), if drain_deadline.is_some() => {
                tracing::warn!(
                    outstanding = tracker.outstanding(),
                    "shutdown timeout: leaving unconfirmed deliveries unacked (the broker redelivers them)"
                );
                return Ok(());
            }
            _ = report.tick() => {
                let held = tracker.held_count();
                if held > 0 {
                    tracing::info!(held, outstanding = tracker.outstanding(), prefetch = config.prefetch, "holding messages for their last moments");
                }
            }
        }
    }
}

async fn sleep_until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

/// Sends acks and requeues. `Ok(false)`-style silent failures do not exist here: any error
/// means the channel is gone, and the broker redelivers everything unacked.
async fn apply(channel: &Channel, ops: Vec<AckOp>) -> Result<(), BridgeError> {
    for op in ops {
        let result = match op {
            AckOp::Multiple(tag) => {
                channel
                    .basic_ack(tag, BasicAckOptions { multiple: true })
                    .await
            }
            AckOp::Single(tag) => {
                channel
                    .basic_ack(tag, BasicAckOptions { multiple: false })
                    .await
            }
            AckOp::Requeue(tag) => {
                channel
                    .basic_nack(
                        tag,
                        BasicNackOptions {
                            multiple: false,
                            requeue: true,
                        },
                    )
                    .await
            }
        };
        result.map_err(BridgeError::broker("acknowledging"))?;
    }
    Ok(())
}

impl Task {
    /// Decodes a delivery. Past this point only its tag, body and envelope are kept: the
    /// consumed properties (with their x-death history), names and acker are dropped, so
    /// that the thousands of deliveries held for their last moments stay small.
    fn prepare(&self, delivery: Delivery) -> Result<Moving, Box<Parking>> {
        let read_at = now_ms();
        let Delivery {
            delivery_tag,
            exchange,
            routing_key,
            properties,
            data,
            ..
        } = delivery;
        match self.read(&exchange, &routing_key, &properties) {
            Ok(envelope) => Ok(Moving {
                tag: delivery_tag,
                body: data,
                envelope,
                read_at,
            }),
            Err(parked) => Err(Box::new(Parking {
                body: data,
                routing_key,
                consumed: properties,
                parked,
            })),
        }
    }

    /// Hops, holds and delivers a decoded message until a replacement is confirmed.
    async fn carry(&self, moving: &Moving) -> Outcome {
        let config = &self.shared.config;
        let Moving {
            tag,
            body,
            envelope,
            read_at,
        } = moving;
        loop {
            if self.cancelled(envelope) {
                return Outcome::Done;
            }
            match next_step(envelope.deliver_at, now_ms(), &config.ladder, config.margin) {
                // Boxed: the task's own future is then only as large as its hold, which is
                // where most deliveries wait.
                Step::Hop(level) => return Box::pin(self.hop(body, envelope, level)).await,
                Step::Hold(_) => {
                    let _ = self.events.send(Event::Held(*tag));
                    // Sleep to the due instant itself (µs precision), not to a whole-ms
                    // remainder, so the timer adds at most its own 1 ms tick.
                    tokio::select! {
                        _ = tokio::time::sleep(until_epoch_ms(envelope.deliver_at)) => continue,
                        _ = self.stop.cancelled() => return Outcome::Release,
                    }
                }
                Step::Deliver => {
                    return Box::pin(self.deliver(body, envelope, *read_at)).await;
                }
            }
        }
    }

    /// Decodes a consumed delivery, or says why it must be parked.
    fn read(
        &self,
        exchange: &ShortString,
        routing_key: &ShortString,
        properties: &lapin::BasicProperties,
    ) -> Result<Envelope, Parked> {
        if let Some(parked) = contract::redelivered_too_often(properties, PARK_AFTER_REDELIVERIES) {
            return Err(parked);
        }
        let config = &self.shared.config;
        let intake = Intake {
            work_exchange: &self.shared.work_exchange,
            routes: &config.routes,
            max_delay: config.max_delay,
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
        let dropped = self
            .shared
            .tombstones
            .lock()
            .expect("tombstone lock")
            .cancels(id.as_str(), envelope.entered_at);
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

    async fn hop(&self, body: &[u8], envelope: &Envelope, level: Duration) -> Outcome {
        let queue = self.shared.config.names.level_queue(level);
        let outcome = self
            .publish_own(
                &queue,
                ShortString::from(""),
                ShortString::from(queue.as_str()),
                body,
                hop_properties(envelope),
            )
            .await;
        if matches!(outcome, Outcome::Done) {
            self.shared.stats.hops.fetch_add(1, Ordering::Relaxed);
            tracing::trace!(queue, hops = envelope.hops + 1, "hop");
        }
        outcome
    }

    /// Parks a message: `consumed` are the properties it was read with.
    async fn park(
        &self,
        body: &[u8],
        routing_key: &ShortString,
        consumed: &lapin::BasicProperties,
        parked: &Parked,
    ) -> Outcome {
        tracing::warn!(
            reason = parked.reason.as_str(),
            detail = %parked.detail,
            message_id = ?consumed.message_id().as_ref().map(|m| m.as_str()),
            "parking message"
        );
        let exchange = self.shared.config.names.parked_exchange();
        let outcome = self
            .publish_own(
                "the parked queue",
                ShortString::from(exchange.as_str()),
                routing_key.clone(),
                body,
                parked_properties(consumed, parked),
            )
            .await;
        if matches!(outcome, Outcome::Done) {
            self.shared.stats.parked.fetch_add(1, Ordering::Relaxed);
        }
        outcome
    }

    /// Publishes into the bridge's own topology on the shared publisher channel, retrying
    /// nacks with backoff. A return means the bridge's own queue is gone: new session.
    async fn publish_own(
        &self,
        what: &str,
        exchange: ShortString,
        routing_key: ShortString,
        body: &[u8],
        properties: lapin::BasicProperties,
    ) -> Outcome {
        let mut attempt = 0u32;
        loop {
            match amqp::publish_confirmed(
                &self.publish,
                exchange.clone(),
                routing_key.clone(),
                body,
                properties.clone(),
            )
            .await
            {
                Ok(Published::Routed) => return Outcome::Done,
                Ok(Published::Returned { code, text }) => {
                    return Outcome::Failed(BridgeError::OwnQueueMissing(format!(
                        "{what} did not take a message ({code} {text}); redeclaring the topology"
                    )));
                }
                Ok(Published::Nacked) => {
                    self.shared.stats.nacks.fetch_add(1, Ordering::Relaxed);
                    if !self.back_off(&mut attempt, what).await {
                        return Outcome::Release;
                    }
                }
                Err(e) => return Outcome::Failed(BridgeError::broker("publishing")(e)),
            }
        }
    }

    async fn deliver(&self, body: &[u8], envelope: &Envelope, read_at: u64) -> Outcome {
        let properties = delivery_properties(envelope, &self.shared.bridge_user);
        let mut attempt = 0u32;
        let mut channel_errors = 0u32;
        loop {
            let channel = match self.targets.get(&envelope.target).await {
                Ok(channel) => channel,
                Err(e) => {
                    return Outcome::Failed(BridgeError::broker("opening a target channel")(e));
                }
            };
            let result = amqp::publish_confirmed(
                &channel,
                ShortString::from(envelope.target.as_str()),
                envelope.routing_key.clone(),
                body,
                properties.clone(),
            )
            .await;
            match result {
                Ok(Published::Routed) => {
                    self.shared.stats.delivered.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(
                        target = %envelope.target,
                        routing_key = %envelope.routing_key,
                        hops = envelope.hops,
                        late_ms = now_ms().saturating_sub(envelope.deliver_at),
                        read_lead_ms = envelope.deliver_at as i64 - read_at as i64,
                        "delivered"
                    );
                    return Outcome::Done;
                }
                Ok(Published::Returned { code, text }) => {
                    let parked = Parked {
                        reason: ParkReason::Unroutable,
                        detail: format!(
                            "target exchange `{}` routed routing key `{}` to no queue ({code} {text})",
                            envelope.target, envelope.routing_key
                        ),
                    };
                    return self.park_read(body, envelope, parked).await;
                }
                Ok(Published::Nacked) => {
                    self.shared.stats.nacks.fetch_add(1, Ordering::Relaxed);
                    if !self.back_off(&mut attempt, &envelope.target).await {
                        return Outcome::Release;
                    }
                }
                Err(e) if amqp::reply_code(&e) == Some(404) => {
                    let parked = Parked {
                        reason: ParkReason::TargetMissing,
                        detail: format!(
                            "target exchange `{}` does not exist ({e})",
                            envelope.target
                        ),
                    };
                    return self.park_read(body, envelope, parked).await;
                }
                Err(e) => {
                    // The target channel was closed under this publish (by another message's
                    // 404, or by the connection): try again on a fresh one, a few times.
                    channel_errors += 1;
                    if channel_errors > 3 {
                        return Outcome::Failed(BridgeError::broker("publishing to a target")(e));
                    }
                }
            }
        }
    }

    /// Parks a message that was decoded, from its envelope (boxed: parking is rare, and the
    /// delivery future stays small without it).
    async fn park_read(&self, body: &[u8], envelope: &Envelope, parked: Parked) -> Outcome {
        let consumed = consumed_properties(envelope);
        Box::pin(self.park(body, &envelope.routing_key, &consumed, &parked)).await
    }

    /// Sleeps before retrying a nacked publish. False when the bridge is stopping.
    async fn back_off(&self, attempt: &mut u32, what: &str) -> bool {
        let delay =
            Duration::from_millis(100 * (1u64 << (*attempt).min(6))).min(Duration::from_secs(5));
        *attempt += 1;
        tracing::warn!(
            attempt = *attempt,
            ?delay,
            "the broker refused a publish to {what} (nack); retrying"
        );
        tokio::select! {
            _ = tokio::time::sleep(delay) => true,
            _ = self.stop.cancelled() => false,
        }
    }
}
