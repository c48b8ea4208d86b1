//! The cancel-stream follower: reads the stream of tombstones from its start (or, after a
//! reconnect, from where it stopped) into the shared [`TombstoneSet`], signals when it has
//! caught up, then follows new tombstones and expires old ones.
//!
//! Catching up over AMQP 0-9-1 has no "end of stream" signal, so the follower appends a
//! catch-up marker with a random token (publisher-confirmed) and reads until it sees it:
//! every tombstone confirmed before the marker has then been read.
//!
//! A tombstone dated ahead of the clock is held until its clamp entry is read (the first
//! one in the stream decides, for every reader and after any restart; see
//! [`FutureCancels`](crate::cancel::FutureCancels)); once caught up, the follower appends one for each such tombstone it
//! reads, and a clock entry every [`CLOCK_EVERY`].
//!
//! It reads on a connection of its own ([`StreamReader`]), which attaches again where it
//! stopped when the connection fails, and skips (counted in
//! `delay_bridge_cancel_stream_skipped_total`, warned with its offset) an entry the broker
//! cannot send to an AMQP 0-9-1 reader, which closes the connection each time it is sent.
//! An entry the project's codec cannot read (a short string that is not UTF-8, appended by
//! hand) comes as bytes: nothing can be removed from a stream, so it is skipped, with an
//! error that names its offset, and the follower goes on.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use lapin::types::ShortString;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use super::appender::Appender;
use super::checkpoints::{self, Start};
use super::{BridgeError, Shared};
use crate::amqp::disposition::Disposition;
use crate::amqp::stream_offset::{raw_stream_offset, stream_offset};
use crate::amqp::stream_reader::StreamReader;
use crate::amqp::wire::{self, Delivery};
use crate::cancel::{
    CLOCK_EVERY, Clamp, Inserted, Read, StreamEntry, Tombstone, clamp_properties, sync_properties,
};
use crate::clock::now_ms;
use crate::config::BrokerUrl;

/// Expire at least this often, so the gauge stays current.
const SWEEP_AT_MOST: Duration = Duration::from_secs(30);

/// Starts following the cancel stream. Returns once every tombstone confirmed before this
/// call has been read, with the task that goes on following (it ends with an error when the
/// channel or connection is lost, or `Ok` when `stop` fires).
pub(super) async fn follow(
    shared: Arc<Shared>,
    url: &BrokerUrl,
    publishing: &wire::Connection,
    stop: CancellationToken,
) -> Result<tokio::task::JoinHandle<Result<(), BridgeError>>, BridgeError> {
    let stream = shared.config.names.cancel_stream();
    let appender = Appender::new(publishing, shared.config.confirm_timeout);
    let publish = &appender;
    let resume = *shared.stream_next_offset.lock().expect("offset lock");
    shared
        .future_cancels
        .lock()
        .expect("future cancels lock")
        .catching_up();
    let started = tokio::time::Instant::now();
    let token = format!("{:032x}", rand::random::<u128>());
    let newest = shared
        .checkpoints
        .lock()
        .expect("checkpoints lock")
        .newest();
    let marker = append(
        &shared,
        publish,
        &stream,
        sync_properties(ShortString::from(token.as_str()), now_ms(), newest),
        Vec::new(),
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

    // Where to read from: after a lost session, where it stopped; at boot, the newest
    // complete checkpoint, else the stream's start. The reader has a connection of its own
    // (see `amqp::stream_reader`).
    let name = format!(
        "delay-bridge {} cancel stream",
        shared.config.names.prefix()
    );
    let counted = shared.clone();
    let mut reader = StreamReader::new(url, &name, &stream, Start::First).on_skip(move |_| {
        counted.stats.stream_skipped.fetch_add(1, Ordering::Relaxed);
    });
    let (mut start, mut located) = match resume {
        Some(next) => (Start::At(next), 0),
        None => match checkpoints::locate(&shared, &mut reader, &token).await {
            Ok((Some(begin), read)) => (Start::At(begin), read),
            Ok((None, read)) => (Start::First, read),
            Err(e) => {
                reader.close().await;
                return Err(e);
            }
        },
    };
    let loading = resume.is_none() && matches!(start, Start::At(_));
    let backlog = loop {
        reader.seek(start).await;
        let Start::At(begin) = start else {
            if resume.is_none() {
                // No checkpoint: the age of the newest counts from now.
                *shared.checkpoints.lock().expect("checkpoints lock") =
                    crate::cancel::Checkpoints::starting_from(None, now_ms());
            }
            break Vec::new();
        };
        if !loading {
            break Vec::new();
        }
        match checkpoints::load(&shared, &mut reader, begin, &token).await {
            Ok(Ok((kept, read))) => {
                located += read;
                break kept;
            }
            Ok(Err(why)) => {
                tracing::warn!("{why}: reading the cancel stream from its start");
                start = Start::First;
                continue;
            }
            Err(e) => {
                reader.close().await;
                return Err(e);
            }
        }
    };

    let (caught_up_tx, caught_up) = oneshot::channel();
    let handle = tokio::spawn(run(
        shared.clone(),
        reader,
        backlog,
        publish.clone(),
        token,
        caught_up_tx,
        stop,
    ));
    match caught_up.await {
        Ok(read) => {
            let read = read + located;
            shared.stats.catch_up_entries.store(read, Ordering::Relaxed);
            tracing::info!(
                stream = %stream,
                entries = read,
                from = ?start,
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
                "the broker cancelled the cancel-stream follower before it caught up".into(),
            )),
        },
    }
}

#[allow(clippy::too_many_arguments)]
async fn run(
    shared: Arc<Shared>,
    mut reader: StreamReader,
    backlog: Vec<Delivery>,
    publish: Appender,
    token: String,
    caught_up: oneshot::Sender<u64>,
    stop: CancellationToken,
) -> Result<(), BridgeError> {
    let mut caught_up = Some(caught_up);
    let mut read = 0u64;
    let mut backlog = backlog.into_iter();
    let mut next_clock = tokio::time::Instant::now() + CLOCK_EVERY;
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
            biased;
            next = async { backlog.next() }, if backlog.len() > 0 => {
                let Some(delivery) = next else { continue };
                read += 1;
                if let Some(tx) = take_entry(&shared, &publish, &delivery, &token, &mut caught_up) {
                    let _ = tx.send(read);
                }
            }
            next = reader.next() => {
                let delivery = match next {
                    Ok(Some(d)) => d,
                    Err(e) => {
                        reader.close().await;
                        return Err(BridgeError::wire("reading the cancel stream")(e));
                    }
                    Ok(None) => {
                        reader.close().await;
                        return Err(BridgeError::ConsumerEnded("the broker cancelled the cancel-stream consumer".into()));
                    }
                };
                read += 1;
                if let Some(tx) = take_entry(&shared, &publish, &delivery, &token, &mut caught_up) {
                    let _ = tx.send(read);
                }
            }
            _ = tokio::time::sleep(sweep_in) => expire(&shared),
            _ = tokio::time::sleep_until(next_clock), if caught_up.is_none() => {
                next_clock = tokio::time::Instant::now() + CLOCK_EVERY;
                append_clock(&shared, &publish).await;
            }
            _ = stop.cancelled() => {
                reader.close().await;
                return Ok(());
            }
        }
    }
}

/// Takes one delivery: applies it, appends the clamps it calls for, and once caught up,
/// begins a checkpoint when one is due. Returns the catch-up signal to send when it was
/// this follower's own marker.
fn take_entry(
    shared: &Arc<Shared>,
    publish: &Appender,
    delivery: &Delivery,
    token: &str,
    caught_up: &mut Option<oneshot::Sender<u64>>,
) -> Option<oneshot::Sender<u64>> {
    let (marker, mut clamps) = read_one(shared, publish, delivery, token);
    let mut signal = None;
    if marker && let Some(tx) = caught_up.take() {
        let (apply_now, held) = shared
            .future_cancels
            .lock()
            .expect("future cancels lock")
            .caught_up(now_ms());
        for tombstone in apply_now {
            insert(shared, tombstone);
        }
        clamps.extend(held);
        signal = Some(tx);
    }
    // Appended beside the read, which goes on meanwhile.
    for clamp in clamps {
        tokio::spawn(append_clamp(shared.clone(), publish.clone(), clamp));
    }
    if caught_up.is_none() {
        if let Some(next) = *shared.stream_next_offset.lock().expect("offset lock") {
            checkpoints::maybe_begin(shared, publish, next.saturating_sub(1));
        }
        let name = shared
            .checkpoints
            .lock()
            .expect("checkpoints lock")
            .to_name();
        if name.is_some() {
            let (shared, publish) = (shared.clone(), publish.clone());
            tokio::spawn(async move { append_clock(&shared, &publish).await });
        }
    }
    signal
}

/// Applies one delivery from the stream and moves the resume offset past it: whether it is
/// this follower's own catch-up marker, and the clamp entries to append for what it held.
/// An entry the codec cannot read is skipped.
fn read_one(
    shared: &Arc<Shared>,
    publish: &Appender,
    delivery: &Delivery,
    token: &str,
) -> (bool, Vec<Clamp>) {
    let (offset, read) = match &delivery.unreadable {
        None => {
            let offset = stream_offset(&delivery.properties);
            let entry = shared.authority.read(&delivery.properties, &delivery.data);
            (offset, apply(shared, publish, entry, offset, token))
        }
        Some(raw) => {
            let offset = raw_stream_offset(&raw.properties);
            skip_unreadable(offset);
            (offset, (false, Vec::new()))
        }
    };
    if let Some(offset) = offset {
        *shared.stream_next_offset.lock().expect("offset lock") = Some(offset + 1);
    }
    read
}

/// Appends a clamp entry for a tombstone dated ahead that the follower holds; should the
/// stream refuse it, the tombstone is applied here as the clamp says (this bridge then
/// judged it alone).
async fn append_clamp(shared: Arc<Shared>, publish: Appender, clamp: Clamp) {
    let stream = shared.config.names.cancel_stream();
    let appended = match clamp_properties(&clamp, now_ms()) {
        Ok(properties) => matches!(
            append(&shared, &publish, &stream, properties, Vec::new()).await,
            Disposition::Routed
        ),
        Err(_) => false,
    };
    if !appended {
        tracing::warn!(
            message_id = %clamp.message_id,
            offset = clamp.offset,
            "the cancel stream did not take the clamp of a cancel dated ahead: applied here as clamped"
        );
        // Moved from the held cancels to the live ones under both locks, in the order a
        // checkpoint takes them ([`checkpoints::begun`]): this runs beside the follower, and
        // a checkpoint taken between the two would hold the cancel in neither.
        let mut set = shared.tombstones.lock().expect("tombstone lock");
        let held = shared
            .future_cancels
            .lock()
            .expect("future cancels lock")
            .clamp(clamp.offset, clamp.cancelled_at);
        if let Some(tombstone) = held {
            set.insert(tombstone, now_ms());
            shared
                .stats
                .tombstones
                .store(set.len() as u64, Ordering::Relaxed);
        }
    }
}

/// Appends a clock entry: the time a bridge wrote into the stream, so that a later
/// catch-up holds at most [`CLOCK_EVERY`] of cancels dated after the last one (see
/// [`FutureCancels`](crate::cancel::FutureCancels)). A failure is only logged: the next one comes.
async fn append_clock(shared: &Shared, publish: &Appender) {
    let stream = shared.config.names.cancel_stream();
    let token = format!("clock-{:032x}", rand::random::<u128>());
    let newest = shared
        .checkpoints
        .lock()
        .expect("checkpoints lock")
        .newest();
    let properties = sync_properties(ShortString::from(token.as_str()), now_ms(), newest);
    if !matches!(
        append(shared, publish, &stream, properties, Vec::new()).await,
        Disposition::Routed
    ) {
        tracing::warn!("the cancel stream did not take a clock entry");
    }
}

/// Appends an entry with `properties` and `body` to `stream`, confirmed, as the bridge's
/// own ([`Authority::own`](crate::cancel::Authority::own): its `user_id`, and its signature
/// when a state key is set).
pub(super) async fn append(
    shared: &Shared,
    publish: &Appender,
    stream: &str,
    properties: lapin::BasicProperties,
    body: Vec<u8>,
) -> Disposition {
    let properties = shared.authority.own(properties, &body);
    publish.publish("", stream, &body, &properties).await
}

/// Says that the entry at `offset` is skipped: the codec cannot read it.
fn skip_unreadable(offset: Option<u64>) {
    tracing::error!(
        ?offset,
        "skipping a cancel-stream entry the AMQP client cannot read (a short string that is not UTF-8): if it was a cancel, it is not applied"
    );
}

/// Applies one entry read at `offset`, as the trust table took it: whether it is this
/// follower's own catch-up marker, and the clamp entries to append (for a tombstone dated
/// ahead, read live).
fn apply(
    shared: &Arc<Shared>,
    publish: &Appender,
    entry: StreamEntry,
    offset: Option<u64>,
    token: &str,
) -> (bool, Vec<Clamp>) {
    let future = || shared.future_cancels.lock().expect("future cancels lock");
    match entry {
        StreamEntry::NotTaken(kind) => {
            tracing::warn!(?offset, %kind, "skipping a cancel-stream entry a bridge did not write");
            (false, Vec::new())
        }
        StreamEntry::Cancel(tombstone) => {
            let now = now_ms();
            // Nothing it covers can still be pending: not held, whatever its date.
            if shared
                .tombstones
                .lock()
                .expect("tombstone lock")
                .expired(&tombstone, now)
            {
                return (false, Vec::new());
            }
            let read = future().tombstone(offset, tombstone, now);
            match read {
                Read::Apply(tombstone) => insert(shared, tombstone),
                Read::Held => {}
                Read::Clamp(clamp) => return (false, vec![clamp]),
                Read::Unclamped(behind_ms) => tracing::warn!(
                    ?offset,
                    behind_ms,
                    "this bridge's clock is behind the stream's (the times other bridges write) by more than {:?}: it writes no clamp for a cancel dated ahead, and applies the first clamp another bridge writes; fix its clock",
                    crate::cancel::CLOCK_CORRECTION_MOST
                ),
            }
            (false, Vec::new())
        }
        StreamEntry::Successors(successors) => {
            let mut set = shared.tombstones.lock().expect("tombstone lock");
            if set.insert_successors(successors, now_ms()) {
                tracing::trace!(live = set.successors_len(), "successor tombstone");
            }
            (false, Vec::new())
        }
        StreamEntry::CheckpointBegin { token: begun, at } => {
            if let Some(offset) = offset {
                checkpoints::begun(shared, publish, &begun, offset, at);
            }
            (false, Vec::new())
        }
        StreamEntry::CheckpointPart {
            token: of,
            part,
            parts,
        } => {
            let completed = shared
                .checkpoints
                .lock()
                .expect("checkpoints lock")
                .part(&of, part, parts);
            if let Some(begin) = completed {
                tracing::debug!(begin, "cancel-stream checkpoint complete");
            }
            (false, Vec::new())
        }
        StreamEntry::Sync {
            token: seen, at, ..
        } => {
            if let Some(at) = at {
                bridge_entry(shared, at);
            }
            (seen == token, Vec::new())
        }
        StreamEntry::Clamp {
            offset,
            cancelled_at,
            at,
        } => {
            bridge_entry(shared, at);
            let clamped = future().clamp(offset, cancelled_at);
            if let Some(tombstone) = clamped {
                insert(shared, tombstone);
            }
            (false, Vec::new())
        }
        StreamEntry::Invalid(why) => {
            tracing::warn!(?offset, "skipping a cancel-stream entry: {why}");
            (false, Vec::new())
        }
    }
}

/// Notes an entry a bridge wrote at `at_ms`: the stream's clock, and how far this bridge's
/// clock is behind it (`delay_bridge_clock_behind_stream_seconds`).
fn bridge_entry(shared: &Shared, at_ms: u64) {
    let now = now_ms();
    let mut future = shared.future_cancels.lock().expect("future cancels lock");
    future.bridge_entry(at_ms, now);
    shared
        .stats
        .clock_behind_ms
        .store(future.behind_ms(now), Ordering::Relaxed);
}

/// Adds a tombstone to the live set.
fn insert(shared: &Shared, tombstone: Tombstone) {
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
