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

/// How long a reader looks for its own catch-up marker from the stream's last chunk on
/// before it takes the largest offset it read as the end.
const MARKER_WITHIN: std::time::Duration = std::time::Duration::from_secs(5);

/// The offset of the catch-up marker `token` a reader appended (confirmed) just before, read
/// with `reader` from the stream's last chunk on: where the stream ended when the reader
/// began. (The first entry of the last chunk is not that end: a broker under load writes
/// thousands of entries in one chunk, and a look-back from the chunk's start missed a
/// checkpoint written inside it.) Should others append after the marker so that the last
/// chunk comes after it, the largest offset read within [`MARKER_WITHIN`] is taken. Also how
/// many entries it read; `None` when nothing was read.
pub(crate) async fn own_marker(
    reader: &mut StreamReader,
    token: &str,
) -> Result<(Option<u64>, u64), WireError> {
    reader.seek(Start::Last).await;
    let deadline = tokio::time::Instant::now() + MARKER_WITHIN;
    let (mut read, mut largest) = (0u64, None);
    while let Ok(next) = tokio::time::timeout_at(deadline, reader.next()).await {
        let Some(delivery) = next? else { break };
        read += 1;
        let offset = offset_of(&delivery);
        largest = largest.max(offset);
        if delivery.unreadable.is_none()
            && matches!(
                crate::cancel::read_entry(&delivery.properties),
                StreamEntry::Sync { token: seen, .. } if seen == token
            )
        {
            return Ok((offset, read));
        }
    }
    Ok((largest, read))
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
