//! The parked queue, read without taking anything out of it: the messages are consumed
//! unacknowledged on a channel of their own, described, and handed back to the queue when
//! that channel closes (the broker requeues what a closed channel had not acknowledged).

use std::collections::BTreeMap;
use std::time::Duration;

use futures::StreamExt;
use lapin::options::{BasicConsumeOptions, BasicQosOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Connection};
use serde::Serialize;
use thiserror::Error;

use crate::amqp::queue_counts;
use crate::contract::header;

/// The most messages one read takes (a channel's prefetch is a 16-bit count).
pub const MOST_AT_ONCE: u16 = u16::MAX;

/// How long a read waits for the next message the queue counted before it gives up on it
/// (another consumer may have taken it).
const NEXT_WITHIN: Duration = Duration::from_secs(5);

/// Why the parked queue could not be read.
#[derive(Debug, Error)]
#[error("reading the parked queue `{queue}`: {source}")]
pub struct ParkedReadError {
    /// The queue.
    pub queue: String,
    /// The client error.
    pub source: lapin::Error,
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
    /// Its body's size in bytes.
    pub body_bytes: usize,
}

impl ParkedMessage {
    /// Describes a parked delivery.
    pub fn describe(routing_key: &str, properties: &BasicProperties, body_bytes: usize) -> Self {
        let headers = properties.headers().clone().unwrap_or_default();
        let text = |name: &str| text_of(&headers, name);
        Self {
            reason: text(header::REASON),
            detail: text(header::DETAIL),
            routing_key: text(header::STATE_ROUTING_KEY).unwrap_or_else(|| routing_key.to_string()),
            target: text(header::STATE_TARGET),
            message_id: properties
                .message_id()
                .as_ref()
                .map(|id| id.as_str().to_string()),
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

/// The first `limit` messages of the parked queue `queue` (at most [`MOST_AT_ONCE`]), and
/// how many it held in all when the read began. Nothing is removed.
pub async fn peek(
    connection: &Connection,
    queue: &str,
    limit: u16,
) -> Result<(Vec<ParkedMessage>, u64), ParkedReadError> {
    let fail = |source| ParkedReadError {
        queue: queue.to_string(),
        source,
    };
    let channel = connection.create_channel().await.map_err(fail)?;
    let result = async {
        let held = queue_counts(&channel, queue).await?.messages;
        let wanted = held.min(u64::from(limit)) as usize;
        let mut read = Vec::with_capacity(wanted);
        if wanted == 0 {
            return Ok((read, held));
        }
        channel
            .basic_qos(wanted as u16, BasicQosOptions::default())
            .await?;
        let mut consumer = channel
            .basic_consume(
                queue.into(),
                "delay-bridge-parked-reader".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        while read.len() < wanted {
            match tokio::time::timeout(NEXT_WITHIN, consumer.next()).await {
                Ok(Some(delivery)) => {
                    let delivery = delivery?;
                    read.push(ParkedMessage::describe(
                        delivery.routing_key.as_str(),
                        &delivery.properties,
                        delivery.data.len(),
                    ));
                }
                // Another consumer took the rest, or the queue was deleted.
                Ok(None) | Err(_) => break,
            }
        }
        Ok((read, held))
    }
    .await;
    // Closing the channel hands every message it read back to the queue.
    let _ = channel.close(200, "read".into()).await;
    result.map_err(fail)
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
