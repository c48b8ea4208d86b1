//! A typed client: schedule a message after a delay or at an absolute time, cancel it,
//! reschedule it. Every call waits for the broker's publisher confirm and returns a typed
//! error; nothing is fire-and-forget.
//!
//! Scheduling publishes to a route's **ingress exchange** (any exchange works for the
//! broker; the bridge only takes messages from its configured ingresses) with `x-delay` or
//! `x-deliver-at`, a `message_id` (generated when absent) and `x-published-at`. Cancelling
//! appends a tombstone to the bridge's cancel stream, `<prefix>.cancel`.
//!
//! ```no_run
//! use std::time::Duration;
//! use delay_bridge::client::{Client, Message, When};
//!
//! # async fn example() -> Result<(), delay_bridge::client::ClientError> {
//! let client = Client::connect("amqp://guest:guest@127.0.0.1:5672/%2f", "delay-bridge").await?;
//! // Remind in 30 minutes, unless the order is paid first.
//! let reminder = Message::new("delayed", "orders.reminder", b"order 42 unpaid".to_vec())
//!     .with_message_id("reminder-order-42");
//! let scheduled = client.schedule(reminder.clone(), When::After(Duration::from_secs(1800))).await?;
//! println!("due at {} (epoch ms)", scheduled.deliver_at);
//!
//! // The customer asked for more time: deliver in 2 hours instead.
//! client.reschedule(reminder, When::After(Duration::from_secs(7200))).await?;
//!
//! // The order was paid: the reminder must not go out.
//! let cancelled = client.cancel("reminder-order-42").await?;
//! println!("cancelled at {}", cancelled.cancelled_at);
//! # Ok(()) }
//! ```

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, ShortString};
use thiserror::Error;

use crate::amqp::disposition::{Disposition, Refusal};
use crate::amqp::publisher::{PublishError, Publisher};
use crate::amqp::targets::TargetChannels;
use crate::amqp::wire::{Connection, WireError};
use crate::amqp::{self, ConnectError};
use crate::cancel::{MessageIdError, message_id, tombstone_properties};
use crate::clock::now_ms;
use crate::config::{BrokerUrl, ConfigError, defaults};
use crate::contract::ParkReason;
use crate::contract::beyond_max_delay;
use crate::contract::header;
use crate::ladder::format_duration;
use crate::naming::Names;
use crate::recurring::RecurrenceError;

mod recurring;

pub use recurring::Repeat;

/// Why a client call failed.
#[derive(Debug, Error)]
pub enum ClientError {
    /// The URL is not an `amqp://` or `amqps://` URL.
    #[error(transparent)]
    Url(#[from] ConfigError),
    /// Connecting failed.
    #[error(transparent)]
    Connect(#[from] ConnectError),
    /// The message id is empty or too long.
    #[error(transparent)]
    MessageId(#[from] MessageIdError),
    /// A reschedule needs the id of the message it replaces.
    #[error("rescheduling needs the message's id: set it with Message::with_message_id")]
    NoMessageId,
    /// An exchange or routing key is longer than AMQP's 255 bytes.
    #[error("{what} `{name}…` is longer than AMQP's 255-byte limit")]
    NameTooLong {
        /// "exchange" or "routing key".
        what: &'static str,
        /// Its first 40 characters.
        name: String,
    },
    /// The exchange does not exist (the broker closed the channel with 404).
    #[error(
        "exchange `{exchange}` does not exist: is it a route's ingress, and has the bridge started once?"
    )]
    ExchangeMissing {
        /// The exchange published to.
        exchange: String,
    },
    /// The exchange took the message but routed it to no queue: nothing would deliver it.
    #[error(
        "exchange `{exchange}` routed routing key `{routing_key}` to no queue ({code} {text}): is it a route's ingress?"
    )]
    Unroutable {
        /// The exchange published to.
        exchange: String,
        /// The routing key.
        routing_key: String,
        /// The broker's reply code.
        code: u16,
        /// The broker's reply text.
        text: String,
    },
    /// The cancel stream does not exist: the bridge with this prefix never started.
    #[error(
        "the cancel stream `{stream}` does not exist: start the bridge with prefix `{prefix}` once, or check the prefix"
    )]
    NoCancelStream {
        /// The stream's name.
        stream: String,
        /// The prefix the client was given.
        prefix: String,
    },
    /// The broker refused the publish (a nack, for example a full queue).
    #[error(
        "the broker refused the publish to `{exchange}` (nack); nothing was scheduled or cancelled"
    )]
    Refused {
        /// The exchange published to (`<prefix>.cancel` for a cancel, "" before bridges
        /// declared that exchange).
        exchange: String,
    },
    /// The body is larger than the broker's `max_message_size` (16 MiB by default on
    /// RabbitMQ 4.x, 128 MiB on 3.x); nothing was scheduled.
    #[error("the message body of {bytes} bytes is over the broker's size limit: {broker}")]
    TooLarge {
        /// The body's size.
        bytes: usize,
        /// The broker's words, which name its limit.
        broker: String,
    },
    /// The broker did not confirm the publish in time (for example under a resource
    /// alarm); whether it was taken is unknown, so publishing again may duplicate it.
    #[error(
        "the broker did not confirm the publish to `{exchange}` within {timeout:?}; it may or may not have been taken"
    )]
    Unconfirmed {
        /// The exchange published to (`<prefix>.cancel` for a cancel, "" before bridges
        /// declared that exchange).
        exchange: String,
        /// How long the client waited.
        timeout: Duration,
    },
    /// The message would be due further ahead than the bridges' `delays.max_delay`: they
    /// would park it as `delay-too-long`. Nothing was scheduled or cancelled. The client
    /// assumes the default, 366 days, unless told otherwise ([`Client::with_max_delay`]).
    #[error(
        "due in {}, beyond the maximum delay of {} (delays.max_delay): bridges park such a message as `delay-too-long`; nothing was scheduled or cancelled",
        format_duration(*wait),
        format_duration(*max)
    )]
    DelayTooLong {
        /// How far ahead the message would be due.
        wait: Duration,
        /// The longest delay this client schedules ([`Client::with_max_delay`]).
        max: Duration,
    },
    /// A reschedule cancelled the earlier copy, and then the publish of the new one failed:
    /// the message is no longer scheduled (unless `source` is [`ClientError::Unconfirmed`],
    /// when the new copy may have been taken). Schedule it again once the cause is fixed.
    #[error(
        "the earlier copy of `{message_id}` is cancelled; scheduling the new one failed: {source}"
    )]
    CancelledNotScheduled {
        /// The rescheduled message's id.
        message_id: String,
        /// Why the new copy was not scheduled.
        source: Box<ClientError>,
    },
    /// The broker refused the publish for its exchange or content and closed the channel:
    /// no permission to write to the exchange or an internal exchange (403), or a
    /// precondition the message fails (406). Nothing was scheduled or cancelled.
    #[error("the broker refused the publish to `{exchange}` ({code}): {detail}")]
    Denied {
        /// The exchange published to.
        exchange: String,
        /// The broker's reply code.
        code: u16,
        /// The broker's words.
        detail: String,
    },
    /// A recurring schedule the bridges would refuse (park `bad-schedule`): a bad cron
    /// expression, an unknown time zone, a zero interval, a count of 0, no occurrence.
    #[error(transparent)]
    BadSchedule(#[from] RecurrenceError),
    /// Any other broker or connection error.
    #[error("{what}: {source}")]
    Broker {
        /// What the client was doing.
        what: &'static str,
        /// The connection's error.
        source: WireError,
    },
}

/// When a scheduled message is due.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum When {
    /// After this delay (`x-delay`, counted by the bridge from when it first reads the
    /// message).
    After(Duration),
    /// At this instant (`x-deliver-at`, epoch ms). A past instant delivers at once.
    At(SystemTime),
}

/// A message to schedule: where it goes when due, and what it carries.
#[derive(Debug, Clone)]
pub struct Message {
    exchange: String,
    routing_key: String,
    body: Vec<u8>,
    properties: BasicProperties,
    /// Set by `with_message_id`; wins over the properties' `message_id`.
    id: Option<String>,
}

impl Message {
    /// A message published to `exchange` (a route's ingress) with `routing_key`; when due,
    /// the bridge publishes it to the route's target with this routing key.
    pub fn new(
        exchange: impl Into<String>,
        routing_key: impl Into<String>,
        body: impl Into<Vec<u8>>,
    ) -> Self {
        Self {
            exchange: exchange.into(),
            routing_key: routing_key.into(),
            body: body.into(),
            properties: BasicProperties::default(),
            id: None,
        }
    }

    /// Sets every AMQP property (headers included); they are delivered as set.
    pub fn with_properties(mut self, properties: BasicProperties) -> Self {
        self.properties = properties;
        self
    }

    /// Sets the `message_id`, the handle for cancel and reschedule (an invalid id is
    /// reported by the call that publishes).
    pub fn with_message_id(mut self, id: impl Into<String>) -> Self {
        self.id = Some(id.into());
        self
    }

    /// A copy of its headers, to change.
    fn headers(&self) -> std::collections::BTreeMap<ShortString, AMQPValue> {
        self.properties
            .headers()
            .as_ref()
            .map(|h| h.inner().clone())
            .unwrap_or_default()
    }

    /// The `message_id`, if set.
    pub fn message_id(&self) -> Option<&str> {
        self.id
            .as_deref()
            .or_else(|| self.properties.message_id().as_ref().map(|m| m.as_str()))
    }
}

/// What a confirmed schedule returns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scheduled {
    /// The message's id (generated when the message had none).
    pub message_id: String,
    /// `x-published-at`: when it was published, epoch ms (a cancel after this drops it).
    pub published_at: u64,
    /// When it is due, epoch ms, by this client's clock.
    pub deliver_at: u64,
}

/// What a confirmed cancel returns. The tombstone is durable in the stream: every bridge
/// instance drops any still-pending copy of the id published before `cancelled_at`. If
/// the message was already delivered, or the id is unknown, the cancel is a harmless no-op.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cancelled {
    /// The cancelled id.
    pub message_id: String,
    /// When the cancel was made, epoch ms.
    pub cancelled_at: u64,
}

/// How long a client call waits for the broker's confirm.
const CONFIRM_TIMEOUT: Duration = Duration::from_secs(30);

/// A connection to the broker for scheduling and cancelling through a bridge's topology.
pub struct Client {
    connection: Connection,
    channels: TargetChannels,
    names: Names,
    /// The longest delay scheduled; longer ones are refused before publishing.
    max_delay: Duration,
}

impl Client {
    /// Connects to `url` for the bridge whose topology prefix is `prefix`.
    pub async fn connect(url: &str, prefix: &str) -> Result<Self, ClientError> {
        Self::connect_to(&[BrokerUrl::parse(url)?], prefix).await
    }

    /// Connects to the first of `urls` that answers (the nodes of a cluster, in order).
    pub async fn connect_any(urls: &[&str], prefix: &str) -> Result<Self, ClientError> {
        let urls = urls
            .iter()
            .map(|url| BrokerUrl::parse(url))
            .collect::<Result<Vec<_>, _>>()?;
        Self::connect_to(&urls, prefix).await
    }

    /// Connects to the first of `urls` that answers, with their TLS files (a
    /// configuration's `urls`).
    pub async fn connect_to(urls: &[BrokerUrl], prefix: &str) -> Result<Self, ClientError> {
        let mut last = None;
        for url in urls {
            match amqp::connect_wire(url, "delay-bridge client").await {
                Ok(connection) => {
                    return Ok(Self {
                        channels: TargetChannels::new(connection.clone(), CONFIRM_TIMEOUT),
                        connection,
                        names: Names::new(prefix),
                        max_delay: defaults::MAX_DELAY,
                    });
                }
                Err(e) => last = Some(ClientError::from(e)),
            }
        }
        Err(last.unwrap_or_else(|| {
            ClientError::Url(ConfigError::Invalid {
                key: "urls".into(),
                value: "[]".into(),
                reason: "name at least one broker".into(),
            })
        }))
    }

    /// Refuses to schedule a message due further ahead than `max_delay`, as bridges
    /// configured with `delays.max_delay = max_delay` would park it (`delay-too-long`). The
    /// default is the bridge's default, 366 days.
    pub fn with_max_delay(mut self, max_delay: Duration) -> Self {
        self.max_delay = max_delay;
        self
    }

    /// Publishes `message` to be delivered `when`; returns once the broker confirmed it. A
    /// message due further ahead than [`Client::with_max_delay`] is refused unpublished.
    pub async fn schedule(&self, message: Message, when: When) -> Result<Scheduled, ClientError> {
        self.check_delay(when)?;
        self.schedule_after_cancel(message, when, None).await
    }

    /// Cancels every pending copy of `message_id` published before now; returns once the
    /// tombstone is confirmed. Cancelling a delivered or unknown id is a harmless no-op.
    /// Bridges keep the tombstone `max_delay` plus the grace; [`Client::cancel_due`] lets
    /// them forget it sooner.
    pub async fn cancel(&self, message_id: &str) -> Result<Cancelled, ClientError> {
        self.cancel_with_due(message_id, None).await
    }

    /// As [`Client::cancel`], for a message due at `due` (as [`Scheduled::deliver_at`] said):
    /// bridges forget the tombstone once that time plus the grace has passed. A copy of
    /// this id due later than `due` may then be delivered: pass the latest due time.
    pub async fn cancel_due(
        &self,
        message_id: &str,
        due: SystemTime,
    ) -> Result<Cancelled, ClientError> {
        let due_ms = due
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        self.cancel_with_due(message_id, Some(due_ms)).await
    }

    async fn cancel_with_due(
        &self,
        message_id: &str,
        due_at: Option<u64>,
    ) -> Result<Cancelled, ClientError> {
        let id = crate::cancel::message_id(message_id)?;
        let cancelled_at = now_ms();
        let stream = self.names.cancel_stream();
        let properties = tombstone_properties(id, cancelled_at, due_at);
        // Through the cancel exchange; a bridge older than it declared none, and its
        // stream takes the tombstone through the default exchange.
        let exchange = self.names.cancel_exchange();
        let settled = match self
            .publish(&exchange, "", b"", properties.clone())
            .await
            .and_then(|disposition| settled(disposition, &exchange, "", 0))
        {
            Err(ClientError::ExchangeMissing { .. }) => self
                .publish("", &stream, b"", properties)
                .await
                .and_then(|disposition| settled(disposition, "", &stream, 0)),
            settled => settled,
        };
        match settled {
            Ok(()) => Ok(Cancelled {
                message_id: message_id.to_string(),
                cancelled_at,
            }),
            Err(ClientError::Unroutable { .. }) => Err(ClientError::NoCancelStream {
                stream,
                prefix: self.names.prefix().to_string(),
            }),
            Err(e) => Err(e),
        }
    }

    /// Moves a message to a new time: cancels the pending copy of its id, then publishes
    /// this one (same id), which lives. Later or earlier both work.
    ///
    /// What can be checked before the cancel is: the id, the names, the delay
    /// ([`ClientError::DelayTooLong`]) and that the exchange exists
    /// ([`ClientError::ExchangeMissing`]); a refusal then leaves the earlier copy scheduled.
    /// A failure of the publish after the cancel is [`ClientError::CancelledNotScheduled`].
    pub async fn reschedule(&self, message: Message, when: When) -> Result<Scheduled, ClientError> {
        let id = message.message_id().ok_or(ClientError::NoMessageId)?;
        message_id(id)?;
        self.check_delay(when)?;
        short_name("exchange", &message.exchange)?;
        short_name("routing key", &message.routing_key)?;
        self.channel_for(&message.exchange, message.body.len())
            .await?;
        let cancelled = self.cancel(id).await?;
        let id = id.to_string();
        self.schedule_after_cancel(message, when, Some(cancelled.cancelled_at))
            .await
            .map_err(|source| ClientError::CancelledNotScheduled {
                message_id: id,
                source: Box::new(source),
            })
    }

    /// Closes the connection (waiting for the broker's answer a few seconds at most).
    pub async fn close(self) -> Result<(), ClientError> {
        self.channels.close_all().await;
        self.connection.close().await;
        Ok(())
    }

    /// Refuses a message due further ahead than `max_delay`, by this client's clock.
    fn check_delay(&self, when: When) -> Result<(), ClientError> {
        let wait = match when {
            When::After(delay) => delay,
            When::At(at) => at
                .duration_since(SystemTime::now())
                .unwrap_or(Duration::ZERO),
        };
        if beyond_max_delay(wait, self.max_delay) {
            return Err(ClientError::DelayTooLong {
                wait,
                max: self.max_delay,
            });
        }
        Ok(())
    }

    async fn schedule_after_cancel(
        &self,
        message: Message,
        when: When,
        cancelled_at: Option<u64>,
    ) -> Result<Scheduled, ClientError> {
        let id = match message.message_id() {
            Some(id) => id.to_string(),
            None => uuid::Uuid::new_v4().to_string(),
        };
        let id_short = message_id(&id)?;
        // Strictly after the cancel it follows, even on a clock that did not move.
        let published_at = now_ms().max(cancelled_at.map_or(0, |c| c + 1));
        let (name, value, deliver_at) = match when {
            When::After(delay) => {
                let ms = delay.as_millis().min(i64::MAX as u128) as i64;
                (
                    header::DELAY,
                    AMQPValue::LongLongInt(ms),
                    published_at.saturating_add(ms as u64),
                )
            }
            When::At(at) => {
                let ms = at
                    .duration_since(UNIX_EPOCH)
                    .map(|d| d.as_millis() as u64)
                    .unwrap_or(0);
                (
                    header::DELIVER_AT,
                    AMQPValue::LongLongInt(ms as i64),
                    ms.max(published_at),
                )
            }
        };
        let mut headers = message.headers();
        headers.remove(header::DELAY);
        headers.remove(header::DELIVER_AT);
        headers.insert(ShortString::from(name), value);
        headers.insert(
            ShortString::from(header::PUBLISHED_AT),
            AMQPValue::LongLongInt(published_at as i64),
        );
        let properties = message
            .properties
            .clone()
            .with_message_id(id_short)
            .with_headers(FieldTable::from(headers));
        let disposition = self
            .publish(
                &message.exchange,
                &message.routing_key,
                &message.body,
                properties,
            )
            .await?;
        settled(
            disposition,
            &message.exchange,
            &message.routing_key,
            message.body.len(),
        )?;
        Ok(Scheduled {
            message_id: id,
            published_at,
            deliver_at,
        })
    }

    /// The exchange's publisher. Opening its channel checks that the exchange exists
    /// ([`ClientError::ExchangeMissing`]); the channel is kept for the publishes after.
    async fn channel_for(&self, exchange: &str, body_len: usize) -> Result<Publisher, ClientError> {
        self.channels
            .get(exchange)
            .await
            .map_err(|source| match Refusal::of(&source) {
                Some(refusal) => refused(refusal, exchange, body_len),
                None => ClientError::Broker {
                    what: "opening a channel",
                    source,
                },
            })
    }

    /// One confirmed, mandatory publish on the exchange's own channel (a 404 closes only
    /// that channel), and what became of it.
    async fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        properties: BasicProperties,
    ) -> Result<Disposition, ClientError> {
        let (exchange_name, key) = (
            short_name("exchange", exchange)?,
            short_name("routing key", routing_key)?,
        );
        let publisher = self.channel_for(exchange, body.len()).await?;
        Ok(publisher
            .publish(exchange_name.as_str(), key.as_str(), body, &properties)
            .await)
    }
}

/// What became of a publish of a `body_len`-byte body to `exchange` with `routing_key`, as
/// the client's answer: `Ok` when the broker routed it.
fn settled(
    disposition: Disposition,
    exchange: &str,
    routing_key: &str,
    body_len: usize,
) -> Result<(), ClientError> {
    let exchange = exchange.to_string();
    Err(match disposition {
        Disposition::Routed => return Ok(()),
        Disposition::Returned { code, text } => ClientError::Unroutable {
            exchange,
            routing_key: routing_key.to_string(),
            code,
            text,
        },
        Disposition::Nacked => ClientError::Refused { exchange },
        Disposition::Refused(refusal) => refused(refusal, &exchange, body_len),
        Disposition::Lost(PublishError::ConfirmTimeout(timeout)) => {
            ClientError::Unconfirmed { exchange, timeout }
        }
        Disposition::Lost(PublishError::Broker(source)) => ClientError::Broker {
            what: "publishing",
            source,
        },
    })
}

/// What the broker's `refusal` of a `body_len`-byte body for `exchange` means.
fn refused(refusal: Refusal, exchange: &str, body_len: usize) -> ClientError {
    let exchange = exchange.to_string();
    match refusal.reason {
        ParkReason::TargetMissing => ClientError::ExchangeMissing { exchange },
        ParkReason::TooLarge => ClientError::TooLarge {
            bytes: body_len,
            broker: refusal.detail,
        },
        _ => ClientError::Denied {
            exchange,
            code: refusal.code,
            detail: refusal.detail,
        },
    }
}

/// An exchange name or routing key as AMQP carries it: at most 255 bytes.
fn short_name(what: &'static str, name: &str) -> Result<ShortString, ClientError> {
    ShortString::try_new(name.to_string()).map_err(|_| ClientError::NameTooLong {
        what,
        name: truncate(name, 40).to_string(),
    })
}

/// At most `max` bytes of `s`, cut at a character boundary.
fn truncate(s: &str, max: usize) -> &str {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}
