//! The load side of every benchmark: a publisher with many confirms in flight (paced or
//! flat out) and a collector that timestamps each arrival. Both are the same in the
//! baseline and in the bridge scenarios, so their ratios compare like with like.
//!
//! Every message body starts with 16 bytes: its sequence number and a stamp (epoch µs: the
//! send time in the baseline, the due time through the bridge), both little-endian u64,
//! then padding up to the body size.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, BasicQosOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::{FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Confirmation, Connection};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use delay_bridge::amqp;
use delay_bridge::config::Config;

/// Publishes awaiting at most this many confirms at once.
pub const CONFIRM_WINDOW: usize = 2000;

/// The smallest body: sequence number and stamp.
pub const HEADER_BYTES: usize = 16;

/// Opens a channel in publisher-confirm mode: the load publishes as a client of the bridge
/// does, on lapin.
pub async fn confirm_channel(connection: &Connection) -> Result<Channel, lapin::Error> {
    let channel = connection.create_channel().await?;
    channel
        .confirm_select(lapin::options::ConfirmSelectOptions::default())
        .await?;
    Ok(channel)
}

/// Wall-clock now, epoch microseconds.
pub fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

/// A body of `size` bytes (at least [`HEADER_BYTES`]) carrying `seq` and `stamp_us`.
pub fn body(seq: u64, stamp_us: u64, size: usize) -> Vec<u8> {
    let mut body = Vec::with_capacity(size.max(HEADER_BYTES));
    body.extend_from_slice(&seq.to_le_bytes());
    body.extend_from_slice(&stamp_us.to_le_bytes());
    body.resize(size.max(HEADER_BYTES), b'.');
    body
}

/// The sequence number and stamp of a body made by [`body`].
pub fn read_body(data: &[u8]) -> Option<(u64, u64)> {
    let seq = u64::from_le_bytes(data.get(..8)?.try_into().ok()?);
    let stamp = u64::from_le_bytes(data.get(8..16)?.try_into().ok()?);
    Some((seq, stamp))
}

/// One message to publish.
pub struct Outgoing {
    /// The exchange.
    pub exchange: ShortString,
    /// The routing key.
    pub routing_key: ShortString,
    /// The body.
    pub body: Vec<u8>,
    /// The properties (persistent, headers).
    pub properties: BasicProperties,
}

/// When publishing started and when its last confirm arrived (epoch µs).
#[derive(Debug, Clone, Copy)]
pub struct Published {
    /// The first publish.
    pub started_us: u64,
    /// The last confirm.
    pub confirmed_us: u64,
}

/// Publishes `count` messages made by `make(seq)` on a confirm-mode channel, at `rate`
/// messages per second (or as fast as the confirm window allows), and waits for every
/// confirm. A nack is an error.
pub async fn publish(
    channel: &Channel,
    count: u64,
    rate: Option<f64>,
    mut make: impl FnMut(u64) -> Outgoing,
) -> Result<Published> {
    let started = tokio::time::Instant::now();
    let started_us = now_us();
    let mut in_flight = FuturesUnordered::new();
    let settle = |confirm: lapin::Result<Confirmation>| -> Result<()> {
        match confirm.context("waiting for a publish confirm")? {
            Confirmation::Nack(_) => bail!("the broker nacked a publish"),
            _ => Ok(()),
        }
    };
    for seq in 0..count {
        if let Some(rate) = rate {
            let at = started + Duration::from_secs_f64(seq as f64 / rate);
            loop {
                tokio::select! {
                    _ = tokio::time::sleep_until(at) => break,
                    Some(confirm) = in_flight.next() => settle(confirm)?,
                }
            }
        }
        while in_flight.len() >= CONFIRM_WINDOW {
            settle(in_flight.next().await.expect("in flight"))?;
        }
        let out = make(seq);
        let confirm = channel
            .basic_publish(
                out.exchange,
                out.routing_key,
                BasicPublishOptions::default(),
                &out.body,
                out.properties,
            )
            .await
            .context("publishing")?;
        in_flight.push(confirm);
    }
    while let Some(confirm) = in_flight.next().await {
        settle(confirm)?;
    }
    Ok(Published {
        started_us,
        confirmed_us: now_us(),
    })
}

/// A plain durable queue of the bench's own, named `delay-bridge-bench-<role>-<random>`,
/// with a connection that publishes to it on a confirm-mode channel and another for its
/// consumer: what the baseline and `intake` send their paced load through.
pub struct PlainQueue {
    /// The queue's name.
    pub name: String,
    /// The confirm-mode channel to publish on.
    pub channel: Channel,
    /// The connection to consume on.
    pub consumer: Connection,
    publisher: Connection,
}

impl PlainQueue {
    /// Opens both connections (named after `role`) and declares the queue.
    pub async fn declare(config: &Config, role: &str) -> Result<Self> {
        let name = format!(
            "delay-bridge-bench-{role}-{:06x}",
            rand::random::<u32>() & 0xff_ffff
        );
        let publisher = amqp::connect(
            config.url(),
            &format!("delay-bridge bench {role} publisher"),
        )
        .await?;
        let consumer =
            amqp::connect(config.url(), &format!("delay-bridge bench {role} consumer")).await?;
        let channel = confirm_channel(&publisher).await?;
        channel
            .queue_declare(
                name.as_str().into(),
                QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await?;
        Ok(Self {
            name,
            channel,
            consumer,
            publisher,
        })
    }

    /// Deletes the queue and closes both connections.
    pub async fn delete(self) -> Result<()> {
        self.channel
            .queue_delete(self.name.as_str().into(), QueueDeleteOptions::default())
            .await?;
        let _ = self.publisher.close(200, "done".into()).await;
        let _ = self.consumer.close(200, "done".into()).await;
        Ok(())
    }
}

/// A new channel on `conn` consuming `queue` without acknowledgements (the broker pushes
/// as fast as it can, 2 000 deliveries at a time), under the consumer tag `tag`.
pub async fn consume_no_ack(
    conn: &Connection,
    queue: &str,
    tag: &str,
) -> lapin::Result<(Channel, lapin::Consumer)> {
    let channel = conn.create_channel().await?;
    channel.basic_qos(2000, BasicQosOptions::default()).await?;
    let consumer = channel
        .basic_consume(
            queue.into(),
            tag.into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
    Ok((channel, consumer))
}

/// What arrived on a collected queue.
#[derive(Debug, Clone)]
pub struct Arrivals {
    /// Messages expected (sequence numbers `0..expected`).
    pub expected: u64,
    /// Distinct messages received.
    pub received: u64,
    /// Copies of an already received message, or of an unknown sequence number.
    pub duplicates: u64,
    /// For each distinct arrival, arrival minus its stamp, µs, sorted ascending.
    pub lateness_us: Vec<i64>,
    /// The first and last distinct arrival, epoch µs.
    pub first_us: u64,
    /// See `first_us`.
    pub last_us: u64,
}

impl Arrivals {
    /// Expected messages that never arrived.
    pub fn missing(&self) -> u64 {
        self.expected - self.received
    }
}

/// Consumes a queue (auto-ack, so the broker pushes as fast as it can) in its own task
/// and timestamps every arrival as it comes off the connection.
pub struct Collector {
    task: JoinHandle<Result<Arrivals>>,
    done: tokio::sync::watch::Receiver<bool>,
    stop: CancellationToken,
}

impl Collector {
    /// Starts consuming `queue` on `conn`, expecting sequence numbers `0..expected`.
    pub async fn start(conn: &Connection, queue: &str, expected: u64) -> Result<Self> {
        let (channel, mut consumer) = consume_no_ack(conn, queue, "delay-bridge-bench").await?;
        let (done_tx, done) = tokio::sync::watch::channel(false);
        let stop = CancellationToken::new();
        let stopped = stop.clone();
        let task = tokio::spawn(async move {
            let mut seen = vec![false; expected as usize];
            let mut arrivals = Arrivals {
                expected,
                received: 0,
                duplicates: 0,
                lateness_us: Vec::with_capacity(expected as usize),
                first_us: 0,
                last_us: 0,
            };
            loop {
                let delivery = tokio::select! {
                    next = consumer.next() => match next {
                        Some(delivery) => delivery,
                        None => bail!("the broker ended the collector's consumer"),
                    },
                    _ = stopped.cancelled() => break,
                };
                let at = now_us();
                let delivery = delivery.context("consuming")?;
                let Some((seq, stamp)) = read_body(&delivery.data) else {
                    arrivals.duplicates += 1;
                    continue;
                };
                match seen.get_mut(seq as usize) {
                    Some(seen) if !*seen => {
                        *seen = true;
                        arrivals.received += 1;
                        arrivals.lateness_us.push(at as i64 - stamp as i64);
                        if arrivals.first_us == 0 {
                            arrivals.first_us = at;
                        }
                        arrivals.last_us = at;
                        if arrivals.received == expected {
                            done_tx.send_replace(true);
                        }
                    }
                    _ => arrivals.duplicates += 1,
                }
            }
            let _ = channel.close(200, "collected".into()).await;
            Ok(arrivals)
        });
        Ok(Self { task, done, stop })
    }

    /// Waits until every expected message arrived or `deadline` passed, then watches for
    /// `linger` more (late duplicates), stops and returns what arrived.
    pub async fn finish(
        mut self,
        deadline: tokio::time::Instant,
        linger: Duration,
    ) -> Result<Arrivals> {
        let _ = tokio::time::timeout_at(deadline, self.done.wait_for(|d| *d)).await;
        tokio::time::sleep(linger).await;
        self.stop.cancel();
        let mut arrivals = self.task.await.context("the collector task failed")??;
        arrivals.lateness_us.sort_unstable();
        Ok(arrivals)
    }
}

/// What [`due_at_once`] sent and what arrived.
pub struct AtOnce {
    /// The instant they were all due, epoch ms.
    pub due_ms: u64,
    /// When publishing began and the last confirm came.
    pub published: Published,
    /// What arrived at the target.
    pub arrivals: Arrivals,
}

/// Publishes `count` messages of `body_size` bytes, all due `lead` from now, to the
/// sandbox's ingress, and collects them at its target (on a connection of their own) until
/// all arrived or a minute past the due instant (plus 10 ms per hundred messages). An
/// error when publishing took longer than `lead`.
pub async fn due_at_once(
    sandbox: &delay_bridge::sandbox::Sandbox,
    count: u64,
    lead: Duration,
    body_size: usize,
) -> Result<AtOnce> {
    let consumer = amqp::connect(sandbox.config.url(), "delay-bridge bench collector").await?;
    let collector = Collector::start(&consumer, &sandbox.target_queue, count).await?;
    let channel = confirm_channel(&sandbox.conn).await?;
    let due_ms = delay_bridge::clock::now_ms() + lead.as_millis() as u64;
    let ingress = sandbox.ingress.clone();
    let published = publish(&channel, count, None, |seq| {
        due_at(&ingress, seq, due_ms, body_size)
    })
    .await?;
    if published.confirmed_us > due_ms * 1000 {
        bail!(
            "publishing {count} messages took longer than their {:.1} s lead; the due instant passed first",
            lead.as_secs_f64()
        );
    }
    let deadline = tokio::time::Instant::now()
        + lead
        + Duration::from_secs(60)
        + Duration::from_millis(count / 100);
    let arrivals = collector.finish(deadline, Duration::from_secs(1)).await?;
    let _ = consumer.close(200, "done".into()).await;
    Ok(AtOnce {
        due_ms,
        published,
        arrivals,
    })
}

/// A persistent message to a route's ingress exchange, due at `due_ms` (epoch ms, header
/// `x-deliver-at`), stamped with its due time.
pub fn due_at(ingress: &str, seq: u64, due_ms: u64, body_size: usize) -> Outgoing {
    let mut headers = FieldTable::default();
    headers.insert(
        delay_bridge::contract::header::DELIVER_AT.into(),
        lapin::types::AMQPValue::LongLongInt(due_ms as i64),
    );
    Outgoing {
        exchange: ingress.into(),
        routing_key: "".into(),
        body: body(seq, due_ms * 1000, body_size),
        properties: BasicProperties::default()
            .with_delivery_mode(delay_bridge::contract::PERSISTENT)
            .with_headers(headers),
    }
}
