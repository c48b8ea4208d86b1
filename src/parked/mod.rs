//! The parked queue: its messages described, selected, listed, replayed or purged.
//!
//! Reading never takes a message out by itself: messages are consumed unacknowledged on a
//! channel of their own, and whatever was not acknowledged goes back to the queue when that
//! channel closes (the broker requeues it). Only a purged message, or a replayed one whose
//! copy the broker has confirmed, is acknowledged, so an interrupted replay loses nothing.
//! The queue is read on the project's own connection, which reads a message whose routing
//! key, header name or property is not UTF-8 as bytes: it is listed as `unreadable`
//! ([`ParkedMessage::describe_unreadable`]) and can be purged, never replayed.

mod filter;
mod ops;

use std::collections::BTreeMap;

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable};
use serde::Serialize;
use thiserror::Error;

pub use filter::{Filter, replay_properties};
pub use ops::{Action, Outcome, Replay, Report, act, act_at, peek, peek_on};

use crate::contract::{ParkReason, bundle, header};

/// The most messages one read takes (a channel's prefetch is a 16-bit count).
pub const MOST_AT_ONCE: u16 = u16::MAX;

/// Why an operation on the parked queue stopped. Whatever it had not removed is back in
/// the queue.
#[derive(Debug, Error)]
pub enum ParkedError {
    /// The parked queue does not exist: no bridge with this prefix has declared its
    /// topology on this broker and vhost.
    #[error(
        "the parked queue `{queue}` does not exist: no bridge with this topology.prefix has started on this broker and vhost (check the prefix and the broker URL)"
    )]
    Missing {
        /// The queue.
        queue: String,
    },
    /// Reading the queue, or removing a message from it, failed.
    #[error("reading the parked queue `{queue}`: {source}")]
    Read {
        /// The queue.
        queue: String,
        /// The connection's error.
        source: crate::amqp::wire::WireError,
    },
    /// A replayed copy got no answer from the broker (the message stays parked).
    #[error("replaying into the work exchange: {0}")]
    Replay(#[from] crate::amqp::PublishError),
    /// The broker refused a replayed copy for its exchange or its content (403 no
    /// permission to write to the work exchange, 406 over `max_message_size`, ...); the
    /// message stays parked, and so does every one after it.
    #[error(
        "the broker refused a replayed copy ({detail}); it and every message after it stay parked"
    )]
    ReplayRefused {
        /// The broker's words.
        detail: String,
    },
    /// Connecting failed.
    #[error(transparent)]
    Connect(#[from] crate::amqp::ConnectError),
}

/// What a parked message says about itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ParkedMessage {
    /// The stable reason code (`delay-bridge-reason`), if the message has one (the quorum
    /// work queue's own delivery limit dead-letters without one).
    pub reason: Option<String>,
    /// The human detail (`delay-bridge-detail`).
    pub detail: Option<String>,
    /// The publisher's routing key.
    pub routing_key: String,
    /// The target exchange it was bound for, when it had got that far.
    pub target: Option<String>,
    /// Its `message_id`.
    pub message_id: Option<String>,
    /// When it was parked, epoch ms (not recorded before this version).
    pub parked_at: Option<u64>,
    /// True when it carries the bridge's state (due time and target), or is a bundle of
    /// hops (an older bridge that cannot read bundles parks one `bad-state`), so that it
    /// can go back through the work exchange; a message parked before a bridge read it (a
    /// bad header, an unknown route) cannot: fix it and publish it again.
    pub replayable: bool,
    /// Its body's size in bytes.
    pub body_bytes: usize,
}

impl ParkedMessage {
    /// Describes a parked delivery.
    pub fn describe(routing_key: &str, properties: &BasicProperties, body_bytes: usize) -> Self {
        let headers = properties.headers().clone().unwrap_or_default();
        let text = |name: &str| text_of(&headers, name);
        let target = text(header::STATE_TARGET);
        let has_due_time = headers.inner().contains_key(header::STATE_DELIVER_AT);
        Self {
            reason: text(header::REASON),
            detail: text(header::DETAIL),
            routing_key: text(header::STATE_ROUTING_KEY).unwrap_or_else(|| routing_key.to_string()),
            replayable: (target.is_some() && has_due_time) || bundle::is_bundle(properties),
            target,
            message_id: properties
                .message_id()
                .as_ref()
                .map(|id| id.as_str().to_string()),
            parked_at: match headers.inner().get(header::PARKED_AT) {
                Some(AMQPValue::LongLongInt(at)) => u64::try_from(*at).ok(),
                _ => None,
            },
            body_bytes,
        }
    }
}

impl ParkedMessage {
    /// Describes a parked delivery the AMQP codec cannot read in full (`what`: which part,
    /// see [`crate::amqp::wire::Raw`]), published straight into the parked queue: it is
    /// `unreadable`, and cannot be replayed (fix it and publish it again).
    pub fn describe_unreadable(routing_key: &str, what: &str, body_bytes: usize) -> Self {
        Self {
            reason: Some(ParkReason::Unreadable.as_str().to_string()),
            detail: Some(format!(
                "the AMQP client cannot read {what}: a short string that is not UTF-8"
            )),
            routing_key: routing_key.to_string(),
            target: None,
            message_id: None,
            parked_at: None,
            replayable: false,
            body_bytes,
        }
    }
}

fn text_of(headers: &FieldTable, name: &str) -> Option<String> {
    match headers.inner().get(name)? {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_string()),
        _ => None,
    }
}

/// How many of `messages` have each reason (`none` for a message without one).
pub fn count_by_reason(messages: &[ParkedMessage]) -> BTreeMap<String, u64> {
    let mut counts = BTreeMap::new();
    for message in messages {
        let reason = message.reason.clone().unwrap_or_else(|| "none".into());
        *counts.entry(reason).or_insert(0) += 1;
    }
    counts
}
