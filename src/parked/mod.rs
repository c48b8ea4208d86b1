//! The parked queue: its messages described, selected, listed, replayed or purged.
//!
//! Reading never takes a message out by itself: messages are consumed unacknowledged on a
//! channel of their own, and whatever was not acknowledged goes back to the queue when that
//! channel closes (the broker requeues it). Only a purged message, or a replayed one whose
//! copy the broker has confirmed, is acknowledged, so an interrupted replay loses nothing.
//! A message the AMQP client cannot read is parked again as one it can, at the queue's end
//! ([`set_aside_unreadable`]).

mod filter;
mod ops;
mod unreadable;

use std::collections::BTreeMap;

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable};
use serde::Serialize;
use thiserror::Error;

pub use filter::{Filter, replay_properties};
pub use ops::{Action, Outcome, ReplayOn, Report, act};
pub use unreadable::{act_at, peek, set_aside_unreadable};

use crate::contract::{bundle, header};

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
        /// The client error.
        source: lapin::Error,
    },
    /// A replay was asked for without a connection to publish the copies on.
    #[error("a replay needs a connection to publish on")]
    NoReplayConnection,
    /// A replayed copy got no answer from the broker (the message stays parked).
    #[error("replaying into the work exchange: {0}")]
    Replay(#[from] crate::amqp::PublishError),
    /// The AMQP client failed its connection on a message of the queue it cannot read (a
    /// short string that is not UTF-8), while the operation read the queue and before it
    /// did anything. [`act_at`] sets such messages aside and starts again.
    #[error(
        "the parked queue `{queue}` holds a message the AMQP client cannot read (a header name, a property or the routing key that is not UTF-8)"
    )]
    Unreadable {
        /// The queue.
        queue: String,
    },
    /// Connecting failed.
    #[error(transparent)]
    Connect(#[from] crate::amqp::ConnectError),
    /// Setting aside the messages the AMQP client cannot read failed.
    #[error("setting aside parked messages the AMQP client cannot read: {0}")]
    SetAside(#[from] crate::amqp::SweepError),
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
