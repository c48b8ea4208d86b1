//! The cancel stream's checkpoints, as a bridge meets them (the format and the decisions
//! are [`crate::cancel::checkpoint`]'s): a starting follower locates the newest complete
//! checkpoint in the stream's last stretch and loads it instead of reading the whole
//! history; a following one writes a checkpoint when the stream has grown enough past the
//! newest.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use lapin::types::ShortString;

use super::appender::Appender;
use super::{BridgeError, Shared};
use crate::amqp::cancel_stream;
pub(super) use crate::amqp::cancel_stream::Start;
use crate::amqp::disposition::Disposition;
use crate::amqp::stream_offset::stream_offset;
use crate::amqp::stream_reader::StreamReader;
use crate::amqp::wire::Delivery;
use crate::cancel::checkpoint;
use crate::cancel::{
    Load, Loaded, StreamEntry, checkpoint_begin_properties, checkpoint_part_properties,
};
use crate::clock::now_ms;

/// Finds the begin offset of the newest complete checkpoint (see
/// [`cancel_stream::locate`]), reading back from where this follower's catch-up marker
/// `token` stands in the stream. Also how many entries it read.
pub(super) async fn locate(
    shared: &Shared,
    reader: &mut StreamReader,
    token: &str,
) -> Result<(Option<u64>, u64), BridgeError> {
    let (end, to_end) = cancel_stream::own_marker(reader, token)
        .await
        .map_err(BridgeError::wire("reading the cancel stream"))?;
    let Some(end) = end else {
        return Ok((None, to_end));
    };
    let (found, read) = cancel_stream::locate(reader, end, &shared.authority)
        .await
        .map_err(BridgeError::wire("reading the cancel stream"))?;
    Ok((found, read + to_end))
}

/// The reader's next delivery.
async fn next(reader: &mut StreamReader) -> Result<Delivery, BridgeError> {
    match reader.next().await {
        Ok(Some(delivery)) => Ok(delivery),
        Ok(None) => Err(BridgeError::ConsumerEnded(
            "the broker cancelled the cancel-stream consumer".into(),
        )),
        Err(e) => Err(BridgeError::wire("reading the cancel stream")(e)),
    }
}

/// Loads the checkpoint that begins at the reader's next entry (`begin`) into the shared
/// state: the deliveries read meanwhile that are not its parts, to apply next in order, and
/// how many it read; or why it cannot be loaded (the caller then reads the stream from its
/// start).
pub(super) async fn load(
    shared: &Shared,
    reader: &mut StreamReader,
    begin: u64,
    token: &str,
) -> Result<Result<(Vec<Delivery>, u64), String>, BridgeError> {
    let mut load = Load::<Delivery>::new(begin);
    let mut read = 0u64;
    let mut begun_at = None;
    loop {
        let delivery = next(reader).await?;
        read += 1;
        let entry = match &delivery.unreadable {
            None => shared.authority.read(&delivery.properties, &delivery.data),
            Some(_) => StreamEntry::Invalid(String::new()),
        };
        if !load.started() {
            let begun = match &entry {
                StreamEntry::CheckpointBegin { token, at } => {
                    begun_at = *at;
                    Some(token.as_str())
                }
                _ => None,
            };
            match load.first(stream_offset(&delivery.properties), begun) {
                Loaded::Broken(why) => return Ok(Err(why)),
                _ => continue,
            }
        }
        let loaded = match entry {
            StreamEntry::CheckpointPart {
                token: of,
                part,
                parts,
            } => load.part(&of, part, parts, &delivery.data),
            StreamEntry::Sync { token: seen, .. } if seen == token => {
                return Ok(Err(format!(
                    "the checkpoint at offset {begin} is incomplete (its parts were not all read before the catch-up marker)"
                )));
            }
            _ => {
                load.keep(delivery);
                Loaded::Loading
            }
        };
        match loaded {
            Loaded::Loading => {}
            Loaded::Broken(why) => return Ok(Err(why)),
            Loaded::Done(records, kept) => {
                let now = now_ms();
                let restored = records.len();
                {
                    let mut set = shared.tombstones.lock().expect("tombstone lock");
                    let mut future = shared.future_cancels.lock().expect("future cancels lock");
                    for record in records {
                        future.restore(&record);
                        set.restore(record, now);
                    }
                    shared
                        .stats
                        .tombstones
                        .store(set.len() as u64, Ordering::Relaxed);
                }
                *shared.checkpoints.lock().expect("checkpoints lock") =
                    checkpoint::Checkpoints::starting_from(Some(begin), begun_at.unwrap_or(now));
                tracing::info!(begin, records = restored, "cancel-stream checkpoint loaded");
                let kept_count = kept.len() as u64;
                return Ok(Ok((kept, read - kept_count)));
            }
        }
    }
}

/// Begins a checkpoint if one is due after reading the entry at `offset` (see
/// [`checkpoint::Checkpoints::due`]): appends its begin entry; the follower takes the
/// state when it reads it back ([`begun`]).
pub(super) fn maybe_begin(shared: &Arc<Shared>, publish: &Appender, offset: u64) {
    let live = {
        let set = shared.tombstones.lock().expect("tombstone lock");
        (set.len() + set.successors_len()) as u64
    };
    let held = shared
        .future_cancels
        .lock()
        .expect("future cancels lock")
        .held() as u64;
    let now = now_ms();
    let token = {
        let mut checkpoints = shared.checkpoints.lock().expect("checkpoints lock");
        if !checkpoints.due(offset, live + held, shared.checkpoint_slack, now) {
            return;
        }
        let token = format!("checkpoint-{:032x}", rand::random::<u128>());
        checkpoints.writing(&token, now);
        token
    };
    let shared = shared.clone();
    let publish = publish.clone();
    tokio::spawn(async move {
        let stream = shared.config.names.cancel_stream();
        let begun = super::cancels::append(
            &shared,
            &publish,
            &stream,
            checkpoint_begin_properties(ShortString::from(token.as_str()), now),
            Vec::new(),
        )
        .await;
        if !matches!(begun, Disposition::Routed) {
            tracing::warn!("the cancel stream did not take a checkpoint's begin entry");
            shared
                .checkpoints
                .lock()
                .expect("checkpoints lock")
                .abandoned();
        }
    });
}

/// The follower read the begin entry `token` at `begin`: when it is this bridge's, takes
/// the state as every entry before it left it, and writes the parts.
pub(super) fn begun(
    shared: &Arc<Shared>,
    publish: &Appender,
    token: &str,
    begin: u64,
    at_ms: Option<u64>,
) {
    let mine = {
        let mut checkpoints = shared.checkpoints.lock().expect("checkpoints lock");
        checkpoints.begun(token, begin, at_ms, now_ms());
        checkpoints.is_mine(token)
    };
    if !mine {
        return;
    }
    // Both taken at once (the live cancels' lock first, as everything that moves a held
    // cancel into them takes it), so that a cancel moving between them is in one of them.
    let records = {
        let set = shared.tombstones.lock().expect("tombstone lock");
        let mut records = set.records();
        shared
            .future_cancels
            .lock()
            .expect("future cancels lock")
            .records(&mut records);
        records
    };
    let shared = shared.clone();
    let publish = publish.clone();
    let token = token.to_string();
    tokio::spawn(async move {
        let stream = shared.config.names.cancel_stream();
        let bodies = checkpoint::parts(&records);
        let parts = u32::try_from(bodies.len()).unwrap_or(u32::MAX);
        for (part, body) in (0..parts).zip(bodies) {
            let properties =
                checkpoint_part_properties(ShortString::from(token.as_str()), begin, part, parts);
            let appended =
                super::cancels::append(&shared, &publish, &stream, properties, body).await;
            if !matches!(appended, Disposition::Routed) {
                tracing::warn!(
                    begin,
                    part,
                    "the cancel stream did not take a checkpoint part: the checkpoint is left incomplete"
                );
                shared
                    .checkpoints
                    .lock()
                    .expect("checkpoints lock")
                    .abandoned();
                return;
            }
        }
        shared.stats.checkpoints.fetch_add(1, Ordering::Relaxed);
        tracing::info!(
            begin,
            records = records.len(),
            parts,
            "cancel-stream checkpoint written"
        );
    });
}
