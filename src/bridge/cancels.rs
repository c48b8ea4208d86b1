//! The cancel-stream follower: reads the stream of tombstones from its start (or, after a
//! reconnect, from where it stopped) into the shared [`TombstoneSet`], signals when it has
//! caught up, then follows new tombstones and expires old ones.
//!
//! Catching up over AMQP 0-9-1 has no "end of stream" signal, so the follower appends a
//! catch-up marker with a random token (publisher-confirmed) and reads until it sees it:
//! every tombstone confirmed before the marker has then been read.
//!
//! It reads on the session's consuming connection (the project's own), which hands over an
//! entry its codec cannot read (a short string that is not UTF-8, appended by hand) as
//! bytes: nothing can be removed from a stream, so such an entry is skipped, with an error
//! that names its offset, and the follower goes on.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use super::{BridgeError, Shared};
use crate::amqp::disposition::Disposition;
use crate::amqp::publisher::Publisher;
use crate::amqp::stream_offset::{raw_stream_offset, stream_offset};
use crate::amqp::wire::{self, Channel, Consumer, Delivery};
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
    connection: &wire::Connection,
    publish: &Publisher,
    stop: CancellationToken,
) -> Result<tokio::task::JoinHandle<Result<(), BridgeError>>, BridgeError> {
    let stream = shared.config.names.cancel_stream();
    let channel = connection
        .open_channel()
        .await
        .map_err(BridgeError::wire("opening the cancel-stream channel"))?;
    channel
        .qos(STREAM_PREFETCH)
        .await
        .map_err(BridgeError::wire("setting the cancel-stream prefetch"))?;
    let resume = *shared.stream_next_offset.lock().expect("offset lock");
    let offset = match resume {
        Some(next) => AMQPValue::LongLongInt(next as i64),
        None => AMQPValue::LongString(LongString::from("first")),
    };
    let mut args = FieldTable::default();
    args.insert("x-stream-offset".into(), offset);
    let consumer = channel
        .consume(
            &stream,
            &format!("delay-bridge-cancels-{}", std::process::id()),
            args,
        )
        .await
        .map_err(BridgeError::wire("consuming the cancel stream"))?;

    let token = format!("{:032x}", rand::random::<u128>());
    let marker = publish
        .publish(
            ShortString::from(""),
            ShortString::from(stream.as_str()),
            b"",
            sync_properties(ShortString::from(token.as_str())),
        )
        .await;
    let refused = match marker {
        Disposition::Routed => None,
        Disposition::Returned { code, text } => {
            Some(format!("did not take the catch-up marker ({code} {text})"))
        }
        Disposition::Nacked => Some("refused the catch-up marker (nack)".to_string()),
        Disposition::Refused(refusal) => {
            Some(format!("refused the catch-up marker ({})", refusal.detail))
        }
        Disposition::Lost(e) => {
            return Err(BridgeError::publish("appending the catch-up marker")(e));
        }
    };
    if let Some(why) = refused {
        return Err(BridgeError::OwnQueueMissing(format!(
            "the cancel stream `{stream}` {why}"
        )));
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
    mut consumer: Consumer,
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
                    Ok(Some(d)) => d,
                    Err(e) => return Err(BridgeError::wire("reading the cancel stream")(e)),
                    Ok(None) => return Err(BridgeError::ConsumerEnded("the broker cancelled the cancel-stream consumer".into())),
                };
                read += 1;
                if read_one(&shared, &delivery, &token) && let Some(tx) = caught_up.take() {
                    let _ = tx.send(read);
                }
                unacked = Some(delivery.delivery_tag);
                if read.is_multiple_of(ACK_EVERY) || caught_up.is_none() {
                    ack(&channel, unacked.take())?;
                }
            }
            _ = tokio::time::sleep(sweep_in) => expire(&shared),
            _ = stop.cancelled() => {
                let _ = ack(&channel, unacked.take());
                let _ = channel.close().await;
                return Ok(());
            }
        }
    }
}

/// Applies one delivery from the stream and moves the resume offset past it; true when it
/// is this follower's own catch-up marker. An entry the codec cannot read is skipped.
fn read_one(shared: &Shared, delivery: &Delivery, token: &str) -> bool {
    let (offset, marker) = match &delivery.unreadable {
        None => (
            stream_offset(&delivery.properties),
            apply(shared, read_entry(&delivery.properties), token),
        ),
        Some(raw) => {
            let offset = raw_stream_offset(&raw.properties);
            skip_unreadable(offset);
            (offset, false)
        }
    };
    if let Some(offset) = offset {
        *shared.stream_next_offset.lock().expect("offset lock") = Some(offset + 1);
    }
    marker
}

/// Says that the entry at `offset` is skipped: the codec cannot read it.
fn skip_unreadable(offset: Option<u64>) {
    tracing::error!(
        ?offset,
        "skipping a cancel-stream entry the AMQP client cannot read (a short string that is not UTF-8): if it was a cancel, it is not applied"
    );
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
        StreamEntry::Successors(successors) => {
            let mut set = shared.tombstones.lock().expect("tombstone lock");
            if set.insert_successors(successors, now_ms()) {
                tracing::trace!(live = set.successors_len(), "successor tombstone");
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

fn ack(channel: &Channel, tag: Option<u64>) -> Result<(), BridgeError> {
    if let Some(tag) = tag {
        channel
            .ack([(tag, true)])
            .map_err(BridgeError::wire("acknowledging cancel-stream entries"))?;
    }
    Ok(())
}
