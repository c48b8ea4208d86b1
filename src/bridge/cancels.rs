//! The cancel-stream follower: reads the stream of tombstones from its start (or, after a
//! reconnect, from where it stopped) into the shared [`TombstoneSet`], signals when it has
//! caught up, then follows new tombstones and expires old ones.
//!
//! Catching up over AMQP 0-9-1 has no "end of stream" signal, so the follower appends a
//! catch-up marker with a random token (publisher-confirmed) and reads until it sees it:
//! every tombstone confirmed before the marker has then been read.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use futures::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{Channel, Connection};
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use super::{BridgeError, Shared};
use crate::amqp::publisher::Publisher;
use crate::amqp::{Published, unreadable};
use crate::cancel::{Inserted, StreamEntry, read_entry, sync_properties};
use crate::clock::now_ms;

/// Stream consumers need a prefetch; acks only return credit.
const STREAM_PREFETCH: u16 = 1000;
/// Ack (multiple) after this many entries.
const ACK_EVERY: u64 = 100;
/// Expire at least this often, so the gauge stays current.
const SWEEP_AT_MOST: Duration = Duration::from_secs(30);

/// Starts following the cancel stream. Returns once every tombstone confirmed before this
/// call has been read, with the task that goes on following (it ends with an error when the
/// channel or connection is lost, or `Ok` when `stop` fires).
pub(super) async fn follow(
    shared: Arc<Shared>,
    connection: &Connection,
    publish: &Publisher,
    stop: CancellationToken,
) -> Result<tokio::task::JoinHandle<Result<(), BridgeError>>, BridgeError> {
    let stream = shared.config.names.cancel_stream();
    let channel = connection
        .create_channel()
        .await
        .map_err(BridgeError::broker("opening the cancel-stream channel"))?;
    channel
        .basic_qos(STREAM_PREFETCH, BasicQosOptions::default())
        .await
        .map_err(BridgeError::broker("setting the cancel-stream prefetch"))?;
    let resume = *shared.stream_next_offset.lock().expect("offset lock");
    let offset = match resume {
        Some(next) => AMQPValue::LongLongInt(next as i64),
        None => AMQPValue::LongString(LongString::from("first")),
    };
    let mut args = FieldTable::default();
    args.insert("x-stream-offset".into(), offset);
    let consumer = channel
        .basic_consume(
            stream.as_str().into(),
            format!("delay-bridge-cancels-{}", std::process::id())
                .as_str()
                .into(),
            BasicConsumeOptions::default(),
            args,
        )
        .await
        .map_err(BridgeError::broker("consuming the cancel stream"))?;

    let token = format!("{:032x}", rand::random::<u128>());
    let marker = publish
        .publish(
            ShortString::from(""),
            ShortString::from(stream.as_str()),
            b"",
            sync_properties(ShortString::from(token.as_str())),
        )
        .await
        .map_err(BridgeError::publish("appending the catch-up marker"))?;
    match marker {
        Published::Routed => {}
        Published::Returned { code, text } => {
            return Err(BridgeError::OwnQueueMissing(format!(
                "the cancel stream `{stream}` did not take the catch-up marker ({code} {text})"
            )));
        }
        Published::Nacked => {
            return Err(BridgeError::OwnQueueMissing(format!(
                "the cancel stream `{stream}` refused the catch-up marker (nack)"
            )));
        }
    }

    let (caught_up_tx, caught_up) = oneshot::channel();
    let started = tokio::time::Instant::now();
    let handle = tokio::spawn(run(
        shared.clone(),
        channel,
        consumer,
        token,
        caught_up_tx,
        stop,
    ));
    match caught_up.await {
        Ok(read) => {
            tracing::info!(
                stream = %stream,
                entries = read,
                live_tombstones = shared.stats.tombstones.load(Ordering::Relaxed),
                took_ms = started.elapsed().as_millis() as u64,
                "cancel stream read up to date"
            );
            Ok(handle)
        }
        // The task ended before catching up: its result says why.
        Err(_) => match handle.await {
            Ok(Err(e)) => Err(e),
            _ => Err(BridgeError::ConsumerEnded(
                "the cancel-stream follower stopped before catching up".into(),
            )),
        },
    }
}

async fn run(
    shared: Arc<Shared>,
    channel: Channel,
    mut consumer: lapin::Consumer,
    token: String,
    caught_up: oneshot::Sender<u64>,
    stop: CancellationToken,
) -> Result<(), BridgeError> {
    let mut caught_up = Some(caught_up);
    let mut read = 0u64;
    let mut unacked = None;
    loop {
        let next_expiry = shared
            .tombstones
            .lock()
            .expect("tombstone lock")
            .next_expiry();
        let sweep_in = next_expiry
            .map(|at| Duration::from_millis(at.saturating_sub(now_ms())))
            .unwrap_or(SWEEP_AT_MOST)
            .min(SWEEP_AT_MOST);
        tokio::select! {
            next = consumer.next() => {
                let delivery = match next {
                    Some(Ok(d)) => d,
                    Some(Err(e)) => return Err(BridgeError::broker("reading the cancel stream")(e)),
                    None => return Err(BridgeError::ConsumerEnded("the broker cancelled the cancel-stream consumer".into())),
                };
                read += 1;
                if let Some(offset) = stream_offset(&delivery.properties) {
                    *shared.stream_next_offset.lock().expect("offset lock") = Some(offset + 1);
                }
                if apply(&shared, read_entry(&delivery.properties), &token)
                    && let Some(tx) = caught_up.take()
                {
                    let _ = tx.send(read);
                }
                unacked = Some(delivery.delivery_tag);
                if read.is_multiple_of(ACK_EVERY) || caught_up.is_none() {
                    ack(&channel, unacked.take()).await?;
                }
            }
            _ = tokio::time::sleep(sweep_in) => expire(&shared),
            _ = stop.cancelled() => {
                let _ = ack(&channel, unacked.take()).await;
                let _ = channel.close(200, "delay-bridge stopping".into()).await;
                return Ok(());
            }
        }
    }
}

/// Applies an entry that a bare connection read from the stream (after a session failed on
/// an entry lapin cannot read; see [`crate::amqp::unreadable::read_stream`]) as the
/// follower would, so that the next follower resumes after it. True when it was such an
/// entry, skipped.
pub(super) fn apply_read_apart(shared: &Shared, entry: unreadable::StreamEntry) -> bool {
    let (offset, skipped) = match entry {
        unreadable::StreamEntry::Readable(properties) => {
            // No follower's marker is read here: nothing waits for one.
            apply(shared, read_entry(&properties), "");
            (stream_offset(&properties), false)
        }
        unreadable::StreamEntry::Unreadable(offset) => {
            tracing::error!(
                ?offset,
                "skipping a cancel-stream entry the AMQP client cannot read (a short string that is not UTF-8): if it was a cancel, it is not applied"
            );
            (offset, true)
        }
    };
    if let Some(offset) = offset {
        *shared.stream_next_offset.lock().expect("offset lock") = Some(offset + 1);
    }
    skipped
}

/// Applies one entry; true when it is this follower's own catch-up marker.
fn apply(shared: &Shared, entry: StreamEntry, token: &str) -> bool {
    match entry {
        StreamEntry::Cancel(tombstone) => {
            let id = tombstone.message_id.clone();
            let cancelled_at = tombstone.cancelled_at;
            let mut set = shared.tombstones.lock().expect("tombstone lock");
            let inserted = set.insert(tombstone, now_ms());
            shared
                .stats
                .tombstones
                .store(set.len() as u64, Ordering::Relaxed);
            if inserted != Inserted::Expired {
                tracing::debug!(message_id = %id, cancelled_at, ?inserted, "tombstone");
            }
            false
        }
        StreamEntry::Sync(seen) => seen == token,
        StreamEntry::Invalid(why) => {
            tracing::warn!("skipping a cancel-stream entry: {why}");
            false
        }
    }
}

fn expire(shared: &Shared) {
    let mut set = shared.tombstones.lock().expect("tombstone lock");
    for gone in set.expire(now_ms()) {
        if gone.dropped == 0 {
            tracing::debug!(
                message_id = %gone.message_id,
                "tombstone expired without dropping a copy here (already delivered, unknown id, or dropped by another instance)"
            );
        }
    }
    shared
        .stats
        .tombstones
        .store(set.len() as u64, Ordering::Relaxed);
}

async fn ack(channel: &Channel, tag: Option<u64>) -> Result<(), BridgeError> {
    if let Some(tag) = tag {
        channel
            .basic_ack(tag, BasicAckOptions { multiple: true })
            .await
            .map_err(BridgeError::broker("acknowledging cancel-stream entries"))?;
    }
    Ok(())
}

/// The `x-stream-offset` the broker stamps on every stream delivery.
fn stream_offset(properties: &lapin::BasicProperties) -> Option<u64> {
    match properties
        .headers()
        .as_ref()?
        .inner()
        .get("x-stream-offset")?
    {
        AMQPValue::LongLongInt(v) if *v >= 0 => Some(*v as u64),
        AMQPValue::LongInt(v) if *v >= 0 => Some(*v as u64),
        _ => None,
    }
}
