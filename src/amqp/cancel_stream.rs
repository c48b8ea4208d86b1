//! Reading the cancel stream from a place: where a reader attaches, finding where the stream
//! ends, and locating the newest complete checkpoint by reading back from the end (the
//! decisions are [`crate::cancel::checkpoint`]'s), each on a [`StreamReader`]. Shared by the
//! bridge's follower and `status`.

use lapin::types::{AMQPValue, LongString};

use super::stream_offset::stream_offset;
use super::stream_reader::StreamReader;
use super::wire::{Delivery, WireError};
use crate::cancel::checkpoint::LOOK_BACK;
use crate::cancel::{Authority, Locate, StreamEntry};

/// Stream consumers need a prefetch; acks only return credit.
pub(crate) const STREAM_PREFETCH: u16 = 1000;
/// Ack (multiple) after this many entries.
pub(crate) const ACK_EVERY: u64 = 100;

/// Where a reader attaches to the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Start {
    /// The stream's first entry.
    First,
    /// The stream's last chunk.
    Last,
    /// The entry at this offset.
    At(u64),
}

impl Start {
    /// Its `x-stream-offset` argument.
    pub(crate) fn argument(self) -> AMQPValue {
        match self {
            Start::First => AMQPValue::LongString(LongString::from("first")),
            Start::Last => AMQPValue::LongString(LongString::from("last")),
            Start::At(offset) => AMQPValue::LongLongInt(i64::try_from(offset).unwrap_or(i64::MAX)),
        }
    }
}

/// The offset of a delivery, readable or not.
pub(crate) fn offset_of(delivery: &Delivery) -> Option<u64> {
    match &delivery.unreadable {
        None => stream_offset(&delivery.properties),
        Some(raw) => super::stream_offset::raw_stream_offset(&raw.properties),
    }
}

/// The offset of the stream's last entry, read with `reader` (which is left at the stream's
/// last chunk): `None` when the broker cancelled the consumer.
pub(crate) async fn last_offset(reader: &mut StreamReader) -> Result<Option<u64>, WireError> {
    reader.seek(Start::Last).await;
    Ok(reader.next().await?.as_ref().and_then(offset_of))
}

/// Finds the begin offset of the newest complete checkpoint at or before `end`, reading
/// back from it with `reader` ([`LOOK_BACK`] entries in turn) for the pointers in trusted
/// markers and clock entries, and checkpoints begun and completed within: `None` when none
/// is named (a young stream, or one no bridge from 0.2 wrote to). A stretch that would reach
/// back over half the stream's offsets is not read: reading the stream from its start costs
/// at most twice that. `authority` takes each entry (the trust table). Also how many
/// entries it read.
pub(crate) async fn locate(
    reader: &mut StreamReader,
    end: u64,
    authority: &Authority,
) -> Result<(Option<u64>, u64), WireError> {
    let mut read = 0u64;
    for back in LOOK_BACK {
        let from = end.saturating_sub(back);
        if from <= back {
            break;
        }
        reader.seek(Start::At(from)).await;
        let mut locate = Locate::new();
        while let Some(delivery) = reader.next().await? {
            read += 1;
            let offset = offset_of(&delivery);
            if delivery.unreadable.is_none() {
                match authority.read(&delivery.properties, &delivery.data) {
                    StreamEntry::Sync {
                        checkpoint: Some(begin),
                        ..
                    } => locate.pointer(begin),
                    StreamEntry::CheckpointBegin { token, .. } => {
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
        if locate.found().is_some() {
            return Ok((locate.found(), read));
        }
    }
    Ok((None, read))
}
