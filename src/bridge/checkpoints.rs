//! The cancel stream's checkpoints, as a bridge meets them (the format and the decisions
//! are [`crate::cancel::checkpoint`]'s): a starting follower locates the newest complete
//! checkpoint in the stream's last stretch and loads it instead of reading the whole
//! history; a following one writes a checkpoint when the stream has grown enough past the
//! newest.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};

use super::{BridgeError, Shared};
use crate::amqp::disposition::Disposition;
use crate::amqp::publisher::Publisher;
use crate::amqp::stream_offset::stream_offset;
use crate::amqp::wire::{self, Channel, Consumer, Delivery};
use crate::cancel::checkpoint::{self, LOOK_BACK};
use crate::cancel::{
    Load, Loaded, Locate, StreamEntry, checkpoint_begin_properties, checkpoint_part_properties,
    read_entry,
};
use crate::clock::now_ms;

/// Stream consumers need a prefetch; acks only return credit.
pub(super) const STREAM_PREFETCH: u16 = 1000;
/// Ack (multiple) after this many entries.
pub(super) const ACK_EVERY: u64 = 100;

/// Where a follower attaches to the stream.
#[derive(Debug, Clone, Copy)]
pub(super) enum Start {
    /// The stream's first entry.
    First,
    /// The entry at this offset.
    At(u64),
}

impl Start {
    fn argument(self) -> AMQPValue {
        match self {
            Start::First => AMQPValue::LongString(LongString::from("first")),
            Start::At(offset) => AMQPValue::LongLongInt(i64::try_from(offset).unwrap_or(i64::MAX)),
        }
    }
}

/// Opens a channel and attaches a consumer to `stream` at `offset` (an `x-stream-offset`).
pub(super) async fn attach(
    connection: &wire::Connection,
    stream: &str,
    offset: AMQPValue,
    tag: &str,
) -> Result<(Channel, Consumer), wire::WireError> {
    let channel = connection.open_channel().await?;
    channel.qos(STREAM_PREFETCH).await?;
    let mut args = FieldTable::default();
    args.insert("x-stream-offset".into(), offset);
    match channel.consume(stream, tag, args).await {
        Ok(consumer) => Ok((channel, consumer)),
        Err(e) => {
            let _ = channel.close().await;
            Err(e)
        }
    }
}

/// Attaches at `start`.
pub(super) async fn attach_at(
    connection: &wire::Connection,
    stream: &str,
    start: Start,
) -> Result<(Channel, Consumer), BridgeError> {
    attach(
        connection,
        stream,
        start.argument(),
        &format!("delay-bridge-cancels-{}", std::process::id()),
    )
    .await
    .map_err(BridgeError::wire("consuming the cancel stream"))
}

/// True when a bridge wrote the entry (see `cancels::Written`).
pub(super) fn by_bridge(shared: &Shared, delivery: &Delivery) -> bool {
    delivery.properties.user_id().as_ref().map(|u| u.as_str()) == Some(shared.bridge_user.as_str())
}

/// Finds the begin offset of the newest complete checkpoint, reading back from the
/// stream's end ([`LOOK_BACK`] entries in turn) for bridges' pointers and checkpoints
/// completed within: `None` when none names one (a young stream, or one no bridge from 0.2
/// wrote to). Also how many entries it read.
pub(super) async fn locate(
    shared: &Shared,
    connection: &wire::Connection,
    stream: &str,
) -> Result<(Option<u64>, u64), BridgeError> {
    let mut read = 0u64;
    let Some(end) = end_offset(connection, stream).await? else {
        return Ok((None, read));
    };
    for back in LOOK_BACK {
        let from = end.saturating_sub(back);
        let (channel, mut consumer) = attach_at(connection, stream, Start::At(from)).await?;
        let mut locate = Locate::new();
        loop {
            let delivery = next(&mut consumer).await?;
            read += 1;
            let offset = stream_offset(&delivery.properties);
            locate.read(offset);
            if read.is_multiple_of(ACK_EVERY) {
                channel
                    .ack([(delivery.delivery_tag, true)])
                    .map_err(BridgeError::wire("acknowledging cancel-stream entries"))?;
            }
            if delivery.unreadable.is_none() && by_bridge(shared, &delivery) {
                match read_entry(&delivery.properties) {
                    StreamEntry::Sync {
                        checkpoint: Some(begin),
                        ..
                    } => locate.pointer(begin),
                    StreamEntry::CheckpointBegin { token } => {
                        if let Some(offset) = offset {
                            locate.begun(&token, offset);
                        }
                    }
                    StreamEntry::CheckpointPart { token, part, parts } => {
                        locate.part(&token, part, parts)
                    }
                    _ => {}
                }
            }
            if offset.is_none_or(|offset| offset >= end) {
                break;
            }
        }
        let _ = channel.close().await;
        if locate.found().is_some() || from == 0 {
            return Ok((locate.found(), read));
        }
    }
    Ok((None, read))
}

/// The offset of an entry in the stream's last chunk (`None`: the broker sent none, or
/// without an offset): a consumer attached at `last` is sent that chunk first.
async fn end_offset(
    connection: &wire::Connection,
    stream: &str,
) -> Result<Option<u64>, BridgeError> {
    let (channel, mut consumer) = attach(
        connection,
        stream,
        AMQPValue::LongString(LongString::from("last")),
        "",
    )
    .await
    .map_err(BridgeError::wire("consuming the cancel stream"))?;
    let delivery = next(&mut consumer).await?;
    let _ = channel.close().await;
    Ok(stream_offset(&delivery.properties))
}

/// The consumer's next delivery.
async fn next(consumer: &mut Consumer) -> Result<Delivery, BridgeError> {
    match consumer.next().await {
        Ok(Some(delivery)) => Ok(delivery),
        Ok(None) => Err(BridgeError::ConsumerEnded(
            "the broker cancelled the cancel-stream consumer".into(),
        )),
        Err(e) => Err(BridgeError::wire("reading the cancel stream")(e)),
    }
}

/// Loads the checkpoint that begins at the consumer's first entry (`begin`) into the
/// shared state: the deliveries read meanwhile that are not its parts, to apply next in
/// order, or why it cannot be loaded (the caller then reads the stream from its start).
pub(super) async fn load(
    shared: &Shared,
    channel: &Channel,
    consumer: &mut Consumer,
    begin: u64,
    token: &str,
) -> Result<Result<Vec<Delivery>, String>, BridgeError> {
    let mut load = Load::<Delivery>::new(begin);
    let mut read = 0u64;
    loop {
        let delivery = next(consumer).await?;
        read += 1;
        if read.is_multiple_of(ACK_EVERY) {
            channel
                .ack([(delivery.delivery_tag, true)])
                .map_err(BridgeError::wire("acknowledging cancel-stream entries"))?;
        }
        let entry = match &delivery.unreadable {
            None if by_bridge(shared, &delivery) => read_entry(&delivery.properties),
            _ => StreamEntry::Invalid(String::new()),
        };
        if !load.started() {
            let begun = match &entry {
                StreamEntry::CheckpointBegin { token } => Some(token.as_str()),
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
                    checkpoint::Checkpoints::starting_from(Some(begin));
                tracing::info!(begin, records = restored, "cancel-stream checkpoint loaded");
                return Ok(Ok(kept));
            }
        }
    }
}

/// Begins a checkpoint if one is due after reading the entry at `offset` (see
/// [`checkpoint::Checkpoints::due`]): appends its begin entry; the follower takes the
/// state when it reads it back ([`begun`]).
pub(super) fn maybe_begin(shared: &Arc<Shared>, publish: &Publisher, offset: u64) {
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
            checkpoint_begin_properties(ShortString::from(token.as_str())),
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
pub(super) fn begun(shared: &Arc<Shared>, publish: &Publisher, token: &str, begin: u64) {
    let mine = {
        let mut checkpoints = shared.checkpoints.lock().expect("checkpoints lock");
        checkpoints.begun(token, begin, now_ms());
        checkpoints.is_mine(token)
    };
    if !mine {
        return;
    }
    let mut records = shared.tombstones.lock().expect("tombstone lock").records();
    shared
        .future_cancels
        .lock()
        .expect("future cancels lock")
        .records(&mut records);
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
