//! A reader of the cancel stream on a connection of its own, which goes on past what one
//! entry can do to that connection.
//!
//! A stream reader gets entries in offset order, from the offset it was asked for (an entry
//! before it, should the broker send one with the chunk it shares, is passed over); when its
//! connection or channel fails, it
//! opens them again and attaches at the offset after the last entry it handed out, so its
//! caller sees every entry once, in order, as if nothing had happened. An entry the broker
//! cannot send to an AMQP 0-9-1 reader closes the connection at every attach before it:
//! after a few failures at one offset ([`Stalls`]) the reader probes that entry alone, and
//! when the probe's connection fails too, it skips the entry, counts it
//! ([`StreamReader::take_skipped`]) and warns with its offset. Its own connection keeps such an
//! entry away from the bridge's consuming connection, whose work and returns consumers it
//! would otherwise close with it.

use std::time::Duration;

use lapin::types::FieldTable;

use super::cancel_stream::{ACK_EVERY, STREAM_PREFETCH, Start, offset_of};
use super::stream_stalls::{Next, Stalls};
use super::wire::{self, Channel, Consumer, Delivery, WireError};
use crate::config::BrokerUrl;

/// How long a probe waits for the entry it reads.
const PROBE_WITHIN: Duration = Duration::from_secs(5);

/// The pause before attaching again after a failure (doubling per failure at one place).
const RETRY_FIRST: Duration = Duration::from_millis(200);

/// A consumer attached to the stream, and what it has not acked.
struct Attached {
    channel: Channel,
    consumer: Consumer,
    /// The tag of the last delivery not yet acked.
    unacked: Option<u64>,
    /// Deliveries since the last ack.
    since_ack: u64,
    /// Its window was one delivery: each one is acked.
    one_by_one: bool,
}

/// A reader of one stream, attached at a position it keeps across failures.
pub(crate) struct StreamReader {
    url: BrokerUrl,
    name: String,
    stream: String,
    connection: Option<wire::Connection>,
    attached: Option<Attached>,
    /// Where the next attach starts: the offset after the last entry handed out, or the
    /// start asked for before the first one.
    position: Start,
    stalls: Stalls,
    /// Failures in a row at the position, for the pause.
    failures: u32,
    /// Entries still to read one at a time (a window of one, each acked) after a failure:
    /// the broker converts what it sends ahead in a batch, so with a wider window an entry
    /// it cannot send fails the connection before the entries ahead of it arrive, and the
    /// position never reaches it.
    careful: u64,
    /// When to attach again after a failure.
    retry_at: Option<tokio::time::Instant>,
    /// Entries skipped since [`Self::take_skipped`] was last called.
    skipped: u64,
    /// Told the offset of each entry skipped, as it is skipped.
    on_skip: Option<Box<dyn Fn(u64) + Send + Sync>>,
}

impl StreamReader {
    /// A reader of `stream` on a connection to `url` named `name`, attached at `start`
    /// (connected at the first read).
    pub(crate) fn new(url: &BrokerUrl, name: &str, stream: &str, start: Start) -> Self {
        Self {
            url: url.clone(),
            name: name.to_string(),
            stream: stream.to_string(),
            connection: None,
            attached: None,
            position: start,
            stalls: Stalls::default(),
            failures: 0,
            careful: 0,
            retry_at: None,
            skipped: 0,
            on_skip: None,
        }
    }

    /// The reader tells `hook` the offset of each entry it skips, as it skips it.
    pub(crate) fn on_skip(mut self, hook: impl Fn(u64) + Send + Sync + 'static) -> Self {
        self.on_skip = Some(Box::new(hook));
        self
    }

    /// Reads from `start` on, on the same connection.
    pub(crate) async fn seek(&mut self, start: Start) {
        if let Some(attached) = self.attached.take() {
            let _ = attached.channel.close().await;
        }
        self.position = start;
        self.stalls = Stalls::default();
        self.failures = 0;
        self.retry_at = None;
    }

    /// How many entries were skipped since the last call (each one the broker could not
    /// send; warned of with its offset).
    pub(crate) fn take_skipped(&mut self) -> u64 {
        std::mem::take(&mut self.skipped)
    }

    /// The next entry; `None` when the broker cancelled the consumer (the stream was
    /// deleted). Fails when the reader gave up at one position ([`Stalls`]). Cancel-safe:
    /// dropped mid-way, the next call goes on from where this one was.
    pub(crate) async fn next(&mut self) -> Result<Option<Delivery>, WireError> {
        loop {
            if let Some(at) = self.retry_at {
                tokio::time::sleep_until(at).await;
                self.retry_at = None;
            }
            let failure = match self.ensure().await {
                Err(e) => e,
                Ok(attached) => match attached.consumer.next().await {
                    Ok(Some(delivery)) => {
                        let before = match (self.position, offset_of(&delivery)) {
                            (Start::At(position), Some(offset)) => offset < position,
                            _ => false,
                        };
                        self.handed_out(&delivery);
                        if before {
                            // Before the position (a broker that sends the chunk it is in
                            // whole would): read already, or not asked for.
                            continue;
                        }
                        return Ok(Some(delivery));
                    }
                    Ok(None) => return Ok(None),
                    Err(e) => e,
                },
            };
            self.failed(failure).await?;
        }
    }

    /// Attached at the position (connecting and attaching when not).
    async fn ensure(&mut self) -> Result<&mut Attached, WireError> {
        if self
            .connection
            .as_ref()
            .is_some_and(|connection| !connection.is_open())
        {
            self.attached = None;
            if let Some(connection) = self.connection.take() {
                connection.close().await;
            }
        }
        if self.connection.is_none() {
            let connection = super::connect_wire(&self.url, &self.name)
                .await
                .map_err(|e| WireError::Unexpected(e.to_string()))?;
            self.connection = Some(connection);
        }
        // Read past the place that failed one by one: attach again with the usual window.
        if self.careful == 0
            && let Some(attached) = self.attached.take_if(|a| a.one_by_one)
        {
            let _ = attached.channel.close().await;
        }
        let connection = self.connection.as_ref().expect("connected above");
        if self.attached.as_ref().is_none_or(|a| !a.channel.is_open()) {
            let window = (self.careful > 0).then_some(1);
            let (channel, consumer) =
                attach(connection, &self.stream, self.position, window).await?;
            self.attached = Some(Attached {
                channel,
                consumer,
                unacked: None,
                since_ack: 0,
                one_by_one: window.is_some(),
            });
        }
        Ok(self.attached.as_mut().expect("attached above"))
    }

    /// A delivery goes to the caller: the position moves past it, and its credit returns
    /// every [`ACK_EVERY`] entries.
    fn handed_out(&mut self, delivery: &Delivery) {
        if let Some(offset) = offset_of(delivery) {
            self.position = match self.position {
                Start::At(position) => Start::At(position.max(offset + 1)),
                Start::First | Start::Last => Start::At(offset + 1),
            };
        }
        self.stalls.read();
        self.failures = 0;
        self.careful = self.careful.saturating_sub(1);
        if let Some(attached) = self.attached.as_mut() {
            attached.unacked = Some(delivery.delivery_tag);
            attached.since_ack += 1;
            if attached.since_ack >= ACK_EVERY || attached.one_by_one {
                attached.since_ack = 0;
                if let Some(tag) = attached.unacked.take() {
                    // A failed ack fails the next read, which attaches again.
                    let _ = attached.channel.ack([(tag, true)]);
                }
            }
        }
    }

    /// The connection or channel failed with `error`: retry after a pause, skip a poison
    /// entry, or give up.
    async fn failed(&mut self, error: WireError) -> Result<(), WireError> {
        self.attached = None;
        self.careful = ACK_EVERY;
        if let Some(connection) = self.connection.take() {
            connection.close().await;
        }
        let offset = match self.position {
            Start::At(offset) => Some(offset),
            Start::First | Start::Last => None,
        };
        match self.stalls.failed(offset) {
            Next::GiveUp => return Err(error),
            Next::Probe(offset) => match self.probe(offset).await {
                Probed::Poison => {
                    tracing::warn!(
                        stream = %self.stream,
                        offset,
                        %error,
                        "skipping a cancel-stream entry the broker cannot send to an AMQP 0-9-1 reader (it closes the reader's connection each time): if it was a cancel, it is not applied"
                    );
                    self.skipped += 1;
                    if let Some(hook) = &self.on_skip {
                        hook(offset);
                    }
                    self.position = Start::At(offset + 1);
                    self.stalls = Stalls::default();
                    self.failures = 0;
                    return Ok(());
                }
                Probed::Readable => self.stalls.readable(),
                Probed::Unknown => {}
            },
            Next::Retry => {}
        }
        tracing::debug!(stream = %self.stream, ?offset, %error, "the cancel-stream reader attaches again");
        let pause = RETRY_FIRST.saturating_mul(1 << self.failures.min(4));
        self.failures += 1;
        self.retry_at = Some(tokio::time::Instant::now() + pause);
        Ok(())
    }

    /// Reads the entry at `offset` alone on a connection of its own: poison when the
    /// connection or channel fails after the consumer attached and before it arrives.
    async fn probe(&self, offset: u64) -> Probed {
        let Ok(connection) = super::connect_wire(&self.url, &format!("{} probe", self.name)).await
        else {
            return Probed::Unknown;
        };
        let probed = match attach(&connection, &self.stream, Start::At(offset), Some(1)).await {
            Err(_) => Probed::Unknown,
            Ok((channel, mut consumer)) => {
                let deadline = tokio::time::Instant::now() + PROBE_WITHIN;
                loop {
                    match tokio::time::timeout_at(deadline, consumer.next()).await {
                        // One of its chunk before it: on to the next.
                        Ok(Ok(Some(delivery)))
                            if offset_of(&delivery).is_some_and(|at| at < offset) =>
                        {
                            let _ = channel.ack([(delivery.delivery_tag, false)]);
                        }
                        Ok(Ok(Some(_))) => break Probed::Readable,
                        Ok(Err(_)) => break Probed::Poison,
                        Ok(Ok(None)) | Err(_) => break Probed::Unknown,
                    }
                }
            }
        };
        connection.close().await;
        probed
    }

    /// Closes the reader's connection.
    pub(crate) async fn close(mut self) {
        if let Some(attached) = self.attached.take() {
            if let Some(tag) = attached.unacked {
                let _ = attached.channel.ack([(tag, true)]);
            }
            let _ = attached.channel.close().await;
        }
        if let Some(connection) = self.connection.take() {
            connection.close().await;
        }
    }
}

/// What a probe found.
enum Probed {
    /// The broker cannot send it: skip it.
    Poison,
    /// It arrived.
    Readable,
    /// Neither (the probe could not connect or attach, or nothing came).
    Unknown,
}

/// Opens a channel on `connection` with a window of `prefetch` (none: the stream readers'
/// usual one) and attaches a consumer to `stream` at `start`.
async fn attach(
    connection: &wire::Connection,
    stream: &str,
    start: Start,
    prefetch: Option<u16>,
) -> Result<(Channel, Consumer), WireError> {
    let channel = connection.open_channel().await?;
    channel.qos(prefetch.unwrap_or(STREAM_PREFETCH)).await?;
    let mut args = FieldTable::default();
    args.insert("x-stream-offset".into(), start.argument());
    match channel.consume(stream, "", args).await {
        Ok(consumer) => Ok((channel, consumer)),
        Err(e) => {
            let _ = channel.close().await;
            Err(e)
        }
    }
}
