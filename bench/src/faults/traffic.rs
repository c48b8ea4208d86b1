//! The load side of the fault scenarios: a publisher and a collector that survive what the
//! scenario does to the broker. The publisher keeps every message until the broker
//! confirmed it and sends it again after a nack or a lost connection, with its first due
//! time (an at-least-once publisher, as a careful application writes one); the collector
//! reconnects and consumes again. Both move through the brokers they are given, in turn.
//!
//! Bodies are those of the benchmarks ([`crate::load::body`]): a sequence number and the
//! due time, so every arrival is counted once per sequence number and timed against its due.

use std::collections::{HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result};
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use lapin::options::BasicPublishOptions;
use lapin::{Channel, Confirmation, Connection};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use delay_bridge::amqp;
use delay_bridge::config::BrokerUrl;

use crate::load::{CONFIRM_WINDOW, Outgoing, consume_no_ack, now_us, read_body};

/// How long the fault traffic keeps trying to reach a broker before it gives up.
const RECONNECT_WITHIN: Duration = Duration::from_secs(120);
/// The pause between two connection attempts.
const RECONNECT_PAUSE: Duration = Duration::from_millis(200);

/// Connects to the first of `urls` that answers, starting at `*next` and moving on after
/// every failure, within [`RECONNECT_WITHIN`].
pub async fn connect_any(urls: &[BrokerUrl], next: &mut usize, name: &str) -> Result<Connection> {
    let deadline = tokio::time::Instant::now() + RECONNECT_WITHIN;
    loop {
        let url = &urls[*next % urls.len()];
        match amqp::connect(url, name).await {
            Ok(conn) => return Ok(conn),
            Err(e) if tokio::time::Instant::now() > deadline => {
                return Err(e).context(format!("{name}: no broker answered"));
            }
            Err(_) => {
                *next += 1;
                tokio::time::sleep(RECONNECT_PAUSE).await;
            }
        }
    }
}

/// What the publisher did.
#[derive(Debug, Clone, Copy, Default)]
pub struct Sent {
    /// Distinct messages confirmed by the broker.
    pub confirmed: u64,
    /// Publishes sent again after a nack or a lost connection (each may arrive twice: the
    /// broker may have taken the first before the connection went).
    pub resent: u64,
    /// Connections the publisher lost.
    pub reconnects: u64,
    /// The achieved rate of first publishes, per second.
    pub rate: f64,
}

/// Publishes `count` messages made by `make(seq)` (called once per sequence number: a
/// message sent again is the same message) at `rate` per second, until every one is
/// confirmed; survives nacks and lost connections (see the module).
pub async fn publish_through_faults(
    urls: &[BrokerUrl],
    count: u64,
    rate: f64,
    make: impl FnMut(u64) -> Outgoing,
) -> Result<Sent> {
    let mut publisher = Publisher {
        count,
        rate,
        make,
        made: Vec::with_capacity(count as usize),
        again: VecDeque::new(),
        unconfirmed: HashSet::new(),
        sent: Sent::default(),
        started: tokio::time::Instant::now(),
        last_first_publish: tokio::time::Instant::now(),
    };
    let mut next_url = 0;
    loop {
        let conn = connect_any(urls, &mut next_url, "delay-bridge faults publisher").await?;
        let lost = match crate::load::confirm_channel(&conn).await {
            Ok(channel) => publisher.run(&channel).await.is_err(),
            Err(_) => true,
        };
        if !lost {
            let _ = conn.close(200, "published".into()).await;
            break;
        }
        // Whatever was not confirmed on the lost channel goes again (some may have been
        // taken: those arrive twice and are counted as duplicates).
        publisher.sent.reconnects += 1;
        let unconfirmed = std::mem::take(&mut publisher.unconfirmed);
        publisher.sent.resent += unconfirmed.len() as u64;
        publisher.again.extend(unconfirmed);
        next_url += 1;
    }
    let span = publisher.last_first_publish - publisher.started;
    publisher.sent.rate = count as f64 / span.as_secs_f64().max(1e-9);
    Ok(publisher.sent)
}

/// The channel or its connection was lost.
struct Lost;

struct Publisher<F> {
    count: u64,
    rate: f64,
    make: F,
    /// Every message made so far, by sequence number.
    made: Vec<Outgoing>,
    /// Sequence numbers to send again, before any new one.
    again: VecDeque<u64>,
    /// Sent on the current channel and not confirmed yet.
    unconfirmed: HashSet<u64>,
    sent: Sent,
    started: tokio::time::Instant,
    last_first_publish: tokio::time::Instant,
}

impl<F: FnMut(u64) -> Outgoing> Publisher<F> {
    /// Publishes on `channel` until every message is confirmed (`Ok`) or the channel is lost.
    async fn run(&mut self, channel: &Channel) -> Result<(), Lost> {
        let mut in_flight = FuturesUnordered::new();
        loop {
            let seq = match self.again.pop_front() {
                Some(seq) => seq,
                None if (self.made.len() as u64) < self.count => {
                    let seq = self.made.len() as u64;
                    let slot = self.started + Duration::from_secs_f64(seq as f64 / self.rate);
                    loop {
                        tokio::select! {
                            _ = tokio::time::sleep_until(slot) => break,
                            Some((done, confirm)) = in_flight.next() => self.settle(done, confirm)?,
                        }
                    }
                    self.made.push((self.make)(seq));
                    self.last_first_publish = tokio::time::Instant::now();
                    seq
                }
                None => match in_flight.next().await {
                    Some((done, confirm)) => {
                        self.settle(done, confirm)?;
                        continue;
                    }
                    None if self.again.is_empty() => return Ok(()),
                    None => continue,
                },
            };
            while in_flight.len() >= CONFIRM_WINDOW {
                let (done, confirm) = in_flight.next().await.expect("in flight");
                if let Err(lost) = self.settle(done, confirm) {
                    self.again.push_front(seq);
                    return Err(lost);
                }
            }
            let out = &self.made[seq as usize];
            let published = channel
                .basic_publish(
                    out.exchange.clone(),
                    out.routing_key.clone(),
                    BasicPublishOptions::default(),
                    &out.body,
                    out.properties.clone(),
                )
                .await;
            match published {
                Ok(confirm) => {
                    self.unconfirmed.insert(seq);
                    in_flight.push(async move { (seq, confirm.await) });
                }
                Err(_) => {
                    self.again.push_front(seq);
                    return Err(Lost);
                }
            }
        }
    }

    /// Settles one confirm: an ack counts, a nack sends the message again.
    fn settle(&mut self, seq: u64, confirm: lapin::Result<Confirmation>) -> Result<(), Lost> {
        match confirm {
            Ok(Confirmation::Nack(_)) => {
                self.unconfirmed.remove(&seq);
                self.sent.resent += 1;
                self.again.push_back(seq);
                Ok(())
            }
            Ok(_) => {
                self.unconfirmed.remove(&seq);
                self.sent.confirmed += 1;
                Ok(())
            }
            Err(_) => Err(Lost),
        }
    }
}

/// What the collector saw.
#[derive(Debug, Clone, Default)]
pub struct Seen {
    /// Copies per sequence number.
    pub copies: Vec<u32>,
    /// For each first arrival, arrival minus due, µs.
    pub lateness_us: Vec<i64>,
    /// Due and arrival times (epoch µs) of the first arrivals that came more than a
    /// second late: when the fault held them and when they moved again.
    pub late: Vec<(u64, u64)>,
    /// When the collector started (epoch µs).
    pub started_us: u64,
    /// Bodies that were not a benchmark body.
    pub foreign: u64,
    /// Connections the collector lost.
    pub reconnects: u64,
}

impl Seen {
    /// Distinct sequence numbers that arrived.
    pub fn delivered(&self) -> u64 {
        self.copies.iter().filter(|c| **c > 0).count() as u64
    }

    /// Every arrival: each copy of a message of this run, and every foreign body.
    pub fn arrivals(&self) -> u64 {
        self.copies.iter().map(|c| u64::from(*c)).sum::<u64>() + self.foreign
    }

    /// Copies beyond the first.
    pub fn duplicates(&self) -> u64 {
        self.copies
            .iter()
            .map(|c| u64::from(c.saturating_sub(1)))
            .sum()
    }
}

/// Consumes a queue (auto-ack) on whichever broker answers, reconnecting after a loss, and
/// counts arrivals per sequence number.
pub struct FaultCollector {
    /// The brokers it consumes through.
    pub urls: Vec<BrokerUrl>,
    seen: Arc<Mutex<Seen>>,
    stop: CancellationToken,
    task: JoinHandle<Result<()>>,
}

impl FaultCollector {
    /// Starts consuming `queue`, expecting sequence numbers `0..expected`.
    pub fn start(urls: Vec<BrokerUrl>, queue: String, expected: u64) -> Self {
        let seen = Arc::new(Mutex::new(Seen {
            copies: vec![0; expected as usize],
            started_us: now_us(),
            ..Seen::default()
        }));
        let stop = CancellationToken::new();
        let task = tokio::spawn(collect(urls.clone(), queue, seen.clone(), stop.clone()));
        Self {
            urls,
            seen,
            stop,
            task,
        }
    }

    /// Distinct sequence numbers seen so far.
    pub fn delivered(&self) -> u64 {
        self.seen.lock().expect("not poisoned").delivered()
    }

    /// What it has seen so far (it goes on collecting).
    pub fn seen_now(&self) -> Seen {
        let mut seen = self.seen.lock().expect("not poisoned").clone();
        seen.lateness_us.sort_unstable();
        seen
    }

    /// Waits until `target` distinct messages arrived or `deadline` passed, then watches
    /// `linger` more for late copies, and stops.
    pub async fn finish(
        self,
        target: u64,
        deadline: tokio::time::Instant,
        linger: Duration,
    ) -> Result<Seen> {
        while self.delivered() < target && tokio::time::Instant::now() < deadline {
            if self.task.is_finished() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        tokio::time::sleep(linger).await;
        self.stop.cancel();
        self.task.await.context("the collector task")??;
        let mut seen = self.seen.lock().expect("not poisoned").clone();
        seen.lateness_us.sort_unstable();
        Ok(seen)
    }
}

async fn collect(
    urls: Vec<BrokerUrl>,
    queue: String,
    seen: Arc<Mutex<Seen>>,
    stop: CancellationToken,
) -> Result<()> {
    let mut next_url = 1;
    loop {
        let conn = tokio::select! {
            conn = connect_any(&urls, &mut next_url, "delay-bridge faults collector") => conn?,
            _ = stop.cancelled() => return Ok(()),
        };
        let mut consumer = match consume_no_ack(&conn, &queue, "delay-bridge-faults").await {
            Ok((_channel, consumer)) => consumer,
            Err(_) => {
                next_url += 1;
                tokio::time::sleep(RECONNECT_PAUSE).await;
                continue;
            }
        };
        loop {
            let delivery = tokio::select! {
                next = consumer.next() => next,
                _ = stop.cancelled() => {
                    let _ = conn.close(200, "collected".into()).await;
                    return Ok(());
                }
            };
            let at = now_us();
            let Some(Ok(delivery)) = delivery else {
                break;
            };
            let mut seen = seen.lock().expect("not poisoned");
            match read_body(&delivery.data) {
                Some((seq, due_us)) if (seq as usize) < seen.copies.len() => {
                    seen.copies[seq as usize] += 1;
                    // A stamp of 0: a message without a due time (the fuzz), not timed.
                    if seen.copies[seq as usize] == 1 && due_us > 0 {
                        let late = at as i64 - due_us as i64;
                        seen.lateness_us.push(late);
                        if late > 1_000_000 {
                            seen.late.push((due_us, at));
                        }
                    }
                }
                _ => seen.foreign += 1,
            }
        }
        seen.lock().expect("not poisoned").reconnects += 1;
        next_url += 1;
        if stop.is_cancelled() {
            return Ok(());
        }
    }
}
