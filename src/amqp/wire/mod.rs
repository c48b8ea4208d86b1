//! A connection of the project's own: AMQP 0-9-1 with many channels, whose I/O runs as
//! tasks on the caller's tokio runtime (one reads frames, one writes them). lapin runs its
//! I/O on a thread of its own, so every frame in or out is a hand-off between that thread
//! and the runtime's worker; here a frame read is handled on the reader task and a frame
//! sent is queued for the writer task, which writes everything queued in one go.
//!
//! It reads and writes frames with amq-protocol, lapin's own codec, so properties and
//! field tables are lapin's types. What it does: the handshake (PLAIN or EXTERNAL, over
//! TLS when the URL says so), heartbeats, `connection.blocked`, channels, calls that wait
//! for their reply, consumers, acks and nacks, publishes with their confirm and return, and
//! errors: a channel the broker closes fails what waits on it, a connection that fails
//! fails everything. What it does not do: recover. A failed connection stays failed; the
//! caller opens a new one.
//!
//! Bounds: the outbox holds what callers sent and the socket has not yet taken, and a
//! consumer's queue what the broker delivered and the caller has not yet taken; neither has
//! a bound of its own. The broker bounds deliveries by the channel's prefetch (`qos`), and
//! callers bound what they send (the bridge by its prefetch windows and its publishing in
//! turns); while the broker blocks publishing, publishes queue in the outbox. Connecting
//! gives up after the URL's `connection_timeout` ([`CONNECT_WITHIN`] by default); a frame
//! over `frame_max` is refused both ways; a body reserves at most 1 MiB before its bytes
//! arrive.

mod channel;
mod confirms;
mod content;
mod handshake;
mod outbox;
mod reader;
pub mod stall;

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use amq_protocol::protocol::{AMQPClass, channel as channel_methods, connection};
use futures::io::BufReader;
use futures::{AsyncReadExt, FutureExt};
use thiserror::Error;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

pub use channel::{
    Channel, Confirm, Consumer, Delivery, PendingConfirm, ReturnHandler, Returned, Settle,
};
pub use content::Raw;

use crate::config::BrokerUrl;
use channel::ChannelShared;
pub use handshake::Tuned;
use outbox::Outbox;

/// The frame type of a content header.
const FRAME_HEADER: u8 = 2;
/// The frame type of a content body.
const FRAME_BODY: u8 = 3;
/// The frame type of a heartbeat.
const FRAME_HEARTBEAT: u8 = 8;
/// The byte that ends every frame.
const FRAME_END: u8 = 0xCE;
/// How long connecting (TCP, TLS, the AMQP handshake) may take when the URL does not say.
pub const CONNECT_WITHIN: Duration = Duration::from_secs(30);
/// How long [`Connection::close`] waits for the broker's answer.
const CLOSE_WITHIN: Duration = Duration::from_secs(5);
/// Bytes read from the socket at a time.
const READ_BUFFER: usize = 128 * 1024;

/// Why a connection or a channel failed. Clones go to everything that waited on it.
#[derive(Debug, Clone, Error)]
pub enum WireError {
    /// The socket failed or ended.
    #[error("the connection to the broker failed: {0}")]
    Io(Arc<io::Error>),
    /// The broker closed the connection or the channel.
    #[error("the broker closed the {what}: {code} {text}")]
    Closed {
        /// `connection` or `channel`.
        what: &'static str,
        /// The reply code.
        code: u16,
        /// The reply text.
        text: String,
    },
    /// The broker sent a frame this client cannot read (a short string that is not UTF-8
    /// in a method other than a delivery, say). A delivery is handed to its consumer with
    /// what could not be read as bytes ([`Raw`]); anything else fails the connection.
    #[error("the broker sent a frame this client cannot read: {0}")]
    Unreadable(String),
    /// The broker sent something out of place.
    #[error("unexpected from the broker: {0}")]
    Unexpected(String),
    /// Nothing came from the broker for two heartbeat intervals.
    #[error("nothing from the broker for {0:?} (two heartbeat intervals)")]
    MissedHeartbeats(Duration),
    /// The connection was closed here.
    #[error("the connection was closed")]
    ConnectionClosed,
    /// The channel was closed here.
    #[error("the channel was closed")]
    ChannelClosed,
    /// A content header over the connection's `frame_max` (properties and headers too
    /// large): the broker would close the whole connection for it, so nothing of that
    /// publish was sent.
    #[error(
        "a content header of {header} bytes (the message's properties and headers) is over the connection's frame_max of {frame_max} bytes; nothing was sent"
    )]
    HeaderTooLarge {
        /// The content header frame's size.
        header: usize,
        /// The largest frame the broker takes.
        frame_max: usize,
    },
    /// No channel number is free.
    #[error("every channel number the broker allows is in use")]
    NoChannelFree,
    /// The broker URL or its TLS files.
    #[error("{0}")]
    Setup(String),
}

impl WireError {
    fn io(error: io::Error) -> Self {
        Self::Io(Arc::new(error))
    }

    /// The broker's reply code, when the broker closed the channel or the connection.
    pub fn reply_code(&self) -> Option<u16> {
        match self {
            Self::Closed { code, .. } => Some(*code),
            _ => None,
        }
    }

    /// The broker's reply text, when the broker closed the channel or the connection.
    pub fn reply_text(&self) -> Option<&str> {
        match self {
            Self::Closed { text, .. } => Some(text),
            _ => None,
        }
    }

    /// True for a channel error: the channel is gone, the connection is not.
    pub fn is_channel_error(&self) -> bool {
        matches!(
            self,
            Self::Closed {
                what: "channel",
                ..
            } | Self::ChannelClosed
        )
    }
}

/// What the connection's tasks and handles share.
pub(super) struct Inner {
    outbox: Outbox,
    channels: Mutex<Channels>,
    /// The first reason the connection failed; set once.
    failure: OnceLock<WireError>,
    /// Cancelled when the connection failed: the writer and the heartbeat stop.
    stop: CancellationToken,
    /// The broker's reason while it blocks publishing (a resource alarm), else `None`.
    blocked: watch::Sender<Option<String>>,
    tuned: Tuned,
    /// The version the broker announced (`connection.start`'s server properties).
    broker_version: Option<String>,
    /// When the connection opened, and milliseconds after it that the last frame came.
    opened: Instant,
    heard_at_ms: AtomicU64,
}

struct Channels {
    open: HashMap<u16, Arc<ChannelShared>>,
    /// The number tried first for the next channel (numbers are not reused at once).
    next: u16,
}

impl Inner {
    /// A connection's shared state, opened with `tuned` limits: no channel yet, nothing
    /// failed.
    fn new(tuned: Tuned, broker_version: Option<String>) -> Self {
        Self {
            outbox: Outbox::new(tuned.frame_max),
            channels: Mutex::new(Channels {
                open: HashMap::new(),
                next: 1,
            }),
            failure: OnceLock::new(),
            stop: CancellationToken::new(),
            blocked: watch::Sender::new(None),
            tuned,
            broker_version,
            opened: Instant::now(),
            heard_at_ms: AtomicU64::new(0),
        }
    }

    /// Fails the connection with `error` (the first reason stays).
    fn fail(&self, error: WireError) {
        let error = self.failure.get_or_init(|| error).clone();
        self.outbox.close(&error);
        self.stop.cancel();
        let channels: Vec<_> = {
            let mut channels = self.channels.lock().unwrap_or_else(PoisonError::into_inner);
            channels.open.drain().map(|(_, shared)| shared).collect()
        };
        for shared in channels {
            shared.fail(&error);
        }
    }

    /// Why the connection failed, once it has.
    fn error(&self) -> Option<WireError> {
        self.failure.get().cloned()
    }

    fn channel(&self, id: u16) -> Option<Arc<ChannelShared>> {
        let channels = self.channels.lock().unwrap_or_else(PoisonError::into_inner);
        channels.open.get(&id).cloned()
    }

    fn forget_channel(&self, id: u16) {
        let mut channels = self.channels.lock().unwrap_or_else(PoisonError::into_inner);
        channels.open.remove(&id);
    }

    /// Notes that a frame came now.
    fn heard(&self) {
        let elapsed = self.opened.elapsed().as_millis() as u64;
        self.heard_at_ms.store(elapsed, Ordering::Relaxed);
    }

    /// True when a publish waits for its confirm or a call for its reply, on any channel.
    fn awaited(&self) -> bool {
        let channels = self.channels.lock().unwrap_or_else(PoisonError::into_inner);
        channels.open.values().any(|shared| shared.awaits_broker())
    }

    fn silent_for(&self) -> Duration {
        let elapsed = self.opened.elapsed().as_millis() as u64;
        Duration::from_millis(elapsed.saturating_sub(self.heard_at_ms.load(Ordering::Relaxed)))
    }

    /// A method the broker sent on channel 0.
    fn on_connection_method(&self, method: AMQPClass) -> Result<(), WireError> {
        match method {
            AMQPClass::Connection(connection::AMQPMethod::Close(close)) => {
                let error = WireError::Closed {
                    what: "connection",
                    code: close.reply_code,
                    text: close.reply_text.to_string(),
                };
                // Written even as the connection fails: the broker waits for it.
                self.outbox.farewell(&error, |frames| {
                    frames.method(
                        0,
                        AMQPClass::Connection(connection::AMQPMethod::CloseOk(
                            connection::CloseOk {},
                        )),
                    )
                });
                Err(error)
            }
            AMQPClass::Connection(connection::AMQPMethod::CloseOk(_)) => {
                Err(WireError::ConnectionClosed)
            }
            AMQPClass::Connection(connection::AMQPMethod::Blocked(blocked)) => {
                self.blocked.send_replace(Some(blocked.reason.to_string()));
                Ok(())
            }
            AMQPClass::Connection(connection::AMQPMethod::Unblocked(_)) => {
                self.blocked.send_replace(None);
                Ok(())
            }
            other => Err(WireError::Unexpected(format!("{other:?} on channel 0"))),
        }
    }
}

/// An open connection. Clones share it; when the last clone is dropped the connection
/// ends (its channels with it).
#[derive(Clone)]
pub struct Connection {
    inner: Arc<Inner>,
    _end_when_dropped: Arc<tokio_util::sync::DropGuard>,
}

impl Connection {
    /// Connects to `url` as `name` (shown in the management UI), asking for a heartbeat
    /// every `heartbeat` (at most; `0` for none), and starts the reader and writer tasks on
    /// the current tokio runtime.
    ///
    /// Connecting (TCP, TLS and the AMQP handshake) takes at most the URL's
    /// `connection_timeout` (milliseconds), or [`CONNECT_WITHIN`]: a peer that accepts the
    /// socket and never answers fails the connect.
    pub async fn open(url: &BrokerUrl, name: &str, heartbeat: Duration) -> Result<Self, WireError> {
        let within = connect_within(url);
        tokio::time::timeout(within, Self::connect(url, name, heartbeat))
            .await
            .map_err(|_| {
                WireError::io(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "no answer from the broker within {within:?} of connecting (the URL's connection_timeout)"
                    ),
                ))
            })?
    }

    /// [`Connection::open`] without its deadline.
    async fn connect(url: &BrokerUrl, name: &str, heartbeat: Duration) -> Result<Self, WireError> {
        let (stream, uri) = handshake::open_stream(url).await?;
        let heartbeat = u16::try_from(heartbeat.as_secs()).unwrap_or(u16::MAX);
        let (stream, tuned, broker_version) =
            handshake::handshake(stream, &uri, name, heartbeat).await?;
        let (reads, writes) = stream.split();
        let inner = Arc::new(Inner::new(tuned, broker_version));
        let reading = inner.clone();
        tokio::spawn(async move {
            let read = reader::read_frames(&reading, BufReader::with_capacity(READ_BUFFER, reads));
            // A panic while a frame is handled (in a caller's return handler, say) fails
            // the connection with a reason, so that everything waiting on it is answered.
            // A connection that ended here (dropped, failed) stops reading at once, even
            // from a peer that keeps the socket open and says nothing.
            let error = tokio::select! {
                read = std::panic::AssertUnwindSafe(read).catch_unwind() => match read {
                    Ok(error) => error,
                    Err(panic) => WireError::Unexpected(format!(
                        "the connection's reader panicked: {}",
                        panic_text(panic.as_ref())
                    )),
                },
                _ = reading.stop.cancelled() => WireError::ConnectionClosed,
            };
            reading.fail(error);
        });
        let writing = inner.clone();
        tokio::spawn(async move {
            if let Err(error) = writing.outbox.write_to(writes, &writing.stop).await {
                writing.fail(error);
            }
        });
        if tuned.heartbeat > 0 {
            tokio::spawn(beat(
                inner.clone(),
                Duration::from_secs(tuned.heartbeat.into()),
            ));
        }
        let end = inner.stop.clone().drop_guard();
        Ok(Self {
            inner,
            _end_when_dropped: Arc::new(end),
        })
    }

    /// Opens a channel.
    pub async fn open_channel(&self) -> Result<Channel, WireError> {
        let shared = {
            let mut channels = self
                .inner
                .channels
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if let Some(error) = self.inner.error() {
                return Err(error);
            }
            let max = self.inner.tuned.channel_max;
            let id = (0..max)
                .map(|step| {
                    ((u32::from(channels.next) - 1 + u32::from(step)) % u32::from(max)) as u16 + 1
                })
                .find(|id| !channels.open.contains_key(id))
                .ok_or(WireError::NoChannelFree)?;
            channels.next = id % max + 1;
            let shared = Arc::new(ChannelShared::new(id));
            channels.open.insert(id, shared.clone());
            shared
        };
        let channel = Channel {
            shared,
            inner: self.inner.clone(),
        };
        // A caller that goes before the broker's open-ok (its future dropped) leaves a
        // channel the broker opens and nobody uses: close it, which frees its number.
        let undo = scopeguard::guard(channel.clone(), |channel| {
            channel.send_detached(channel::close_method(), true)
        });
        let reply = channel
            .call(AMQPClass::Channel(channel_methods::AMQPMethod::Open(
                channel_methods::Open {},
            )))
            .await;
        scopeguard::ScopeGuard::into_inner(undo);
        match reply? {
            AMQPClass::Channel(channel_methods::AMQPMethod::OpenOk(_)) => Ok(channel),
            other => Err(WireError::Unexpected(format!(
                "{other:?} (channel.open-ok)"
            ))),
        }
    }

    /// True until the connection fails or is closed.
    pub fn is_open(&self) -> bool {
        self.inner.failure.get().is_none()
    }

    /// Why the connection failed, once it has.
    pub fn error(&self) -> Option<WireError> {
        self.inner.error()
    }

    /// Resolves once the connection has failed or been closed, with why.
    pub async fn failed(&self) -> WireError {
        self.inner.stop.cancelled().await;
        self.inner.error().unwrap_or(WireError::ConnectionClosed)
    }

    /// The broker's reason while it blocks publishing on this connection (a resource
    /// alarm: `low on memory`, say), `None` while it does not; changes as it does.
    pub fn blocked(&self) -> watch::Receiver<Option<String>> {
        self.inner.blocked.subscribe()
    }

    /// The limits agreed with the broker.
    pub fn tuned(&self) -> Tuned {
        self.inner.tuned
    }

    /// The version the broker announced when the connection opened (RabbitMQ's `version`
    /// server property), if any.
    pub fn broker_version(&self) -> Option<&str> {
        self.inner.broker_version.as_deref()
    }

    /// Closes the connection: the broker gives back what it delivered and was not acked,
    /// and everything still waiting fails with [`WireError::ConnectionClosed`].
    pub async fn close(&self) {
        let sent = self.inner.outbox.send(|frames| {
            frames.method(
                0,
                AMQPClass::Connection(connection::AMQPMethod::Close(connection::Close {
                    reply_code: 200,
                    reply_text: "done".into(),
                    class_id: 0,
                    method_id: 0,
                })),
            )
        });
        if sent.is_ok() {
            let _ = tokio::time::timeout(CLOSE_WITHIN, self.inner.stop.cancelled()).await;
        }
        self.inner.fail(WireError::ConnectionClosed);
    }
}

/// How long connecting may take: the URL's `connection_timeout` (milliseconds, as lapin
/// reads it), or [`CONNECT_WITHIN`]. A URL that does not parse fails later, saying why.
fn connect_within(url: &BrokerUrl) -> Duration {
    url.expose()
        .parse::<lapin::uri::AMQPUri>()
        .ok()
        .and_then(|uri| uri.query.connection_timeout)
        .map_or(CONNECT_WITHIN, Duration::from_millis)
}

/// What a panic said, when it said it with a string.
fn panic_text(panic: &(dyn std::any::Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(no message)")
}

/// Sends a heartbeat every half `interval`, fails the connection after two intervals with
/// nothing from the broker, and warns once when the broker stops answering what waits on
/// it ([`stall`]), checking every second.
async fn beat(inner: Arc<Inner>, interval: Duration) {
    const CHECK_EVERY: Duration = Duration::from_secs(1);
    let mut ticks = tokio::time::interval(CHECK_EVERY.min(interval / 2));
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut beat_sent = Instant::now();
    let mut reported = false;
    loop {
        tokio::select! {
            _ = inner.stop.cancelled() => return,
            _ = ticks.tick() => {}
        }
        let silent = inner.silent_for();
        if silent > interval * 2 {
            inner.fail(WireError::MissedHeartbeats(interval * 2));
            return;
        }
        match stall::news(silent, inner.awaited(), reported) {
            Some(stall::News::Stalled(silent)) => {
                reported = true;
                tracing::warn!(
                    silent_s = silent.as_secs(),
                    "the broker has stopped answering: nothing from it for {silent:?} while publishes or calls wait on it (a stopped, paused or overloaded node?); they wait for it, up to two heartbeat intervals ({:?})",
                    interval * 2
                );
            }
            Some(stall::News::Answering) => {
                reported = false;
                tracing::info!("the broker answers again");
            }
            None => {}
        }
        if beat_sent.elapsed() >= interval / 2 {
            beat_sent = Instant::now();
            let _ = inner.outbox.send(|frames| {
                frames.heartbeat();
                Ok(())
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// A connection's shared state with no socket behind it, frames of at most 4 KiB, and
    /// channel 1 open.
    fn detached() -> Inner {
        let tuned = Tuned {
            frame_max: 4096,
            channel_max: 16,
            heartbeat: 0,
        };
        let inner = Inner::new(tuned, None);
        inner
            .channels
            .lock()
            .unwrap()
            .open
            .insert(1, Arc::new(ChannelShared::new(1)));
        inner
    }

    /// Reads `bytes` as what the broker sent: the reader ends with an error (at the latest
    /// at the end of the bytes), and nothing panics.
    fn read_all(bytes: &[u8]) -> WireError {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime");
        let inner = detached();
        runtime.block_on(reader::read_frames(&inner, futures::io::Cursor::new(bytes)))
    }

    /// Well-framed frames of any type on channels 0 to 2, with any payload: past the
    /// framing, into the parsers and the channels.
    fn frames() -> impl Strategy<Value = Vec<u8>> {
        prop::collection::vec(
            (0u8..=9, 0u16..=2, prop::collection::vec(any::<u8>(), 0..96)),
            0..24,
        )
        .prop_map(|frames| {
            let mut bytes = Vec::new();
            for (kind, channel, payload) in frames {
                bytes.push(kind);
                bytes.extend_from_slice(&channel.to_be_bytes());
                bytes.extend_from_slice(&(payload.len() as u32).to_be_bytes());
                bytes.extend_from_slice(&payload);
                bytes.push(FRAME_END);
            }
            bytes
        })
    }

    /// A frame announcing more than `frame_max` is refused before anything is allocated
    /// for it.
    #[test]
    fn a_frame_over_frame_max_is_refused_before_it_is_read() {
        let mut bytes = vec![FRAME_BODY, 0, 1];
        bytes.extend_from_slice(&u32::MAX.to_be_bytes());
        let error = read_all(&bytes);
        assert!(error.to_string().contains("frame_max"), "{error}");
    }

    proptest! {
        /// Any bytes at all: an error, never a panic (and every allocation bounded by
        /// `frame_max` and a body's first mebibyte).
        #[test]
        fn the_reader_survives_any_bytes(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
            let _ = read_all(&bytes);
        }

        /// Any well-framed frames: an error, never a panic.
        #[test]
        fn the_reader_survives_any_frames(bytes in frames()) {
            let _ = read_all(&bytes);
        }
    }
}
