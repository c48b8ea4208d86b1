//! What a bridge's topology holds now, for `delay-bridge status`: each queue's messages (a
//! passive declare; bytes too when the management API is configured), the work and returns
//! queues' consumers, the parked messages by reason, and the cancel stream's entries by kind.

use std::collections::BTreeMap;
use std::time::Duration;

use lapin::Connection;
use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use serde::Serialize;
use thiserror::Error;

use crate::amqp::cancel_stream::{self, Start};
use crate::amqp::stream_reader::StreamReader;
use crate::amqp::wire::WireError;
use crate::amqp::{self, QueueCounts, queue_counts, reply_code};
use crate::cancel::{Authority, Record, StreamEntry, checkpoint};
use crate::config::{Config, QueueType};
use crate::ladder::format_duration;
use crate::management::{Management, ManagementError, QueueFigures};
use crate::parked::{self, ParkedError};
use crate::topology::Topology;

/// The longest `status` reads the cancel stream after finding its end: it stops there
/// (complete) sooner, unless the broker is too busy to deliver the entries, or entries left
/// the stream meanwhile.
pub const STREAM_READ_WITHIN: Duration = Duration::from_secs(30);

/// How long `status` takes to find where the cancel stream ends: the first entry of its
/// last chunk comes within this when there is one (an empty stream sends nothing), and the
/// rest of that chunk right after it.
const STREAM_END_WITHIN: Duration = Duration::from_millis(500);

/// How long one management API request may take.
const MANAGEMENT_TIMEOUT: Duration = Duration::from_secs(10);

/// Why the status could not be read.
#[derive(Debug, Error)]
pub enum StatusError {
    /// A queue of the bridge does not exist: no bridge with this prefix has declared its
    /// topology on this broker and vhost.
    #[error(
        "the queue `{queue}` does not exist: no bridge with topology.prefix `{prefix}` has started on this broker and vhost (check the prefix and the broker URL)"
    )]
    Missing {
        /// The queue.
        queue: String,
        /// The prefix asked for.
        prefix: String,
    },
    /// A queue of the bridge could not be counted.
    #[error("counting `{queue}`: {source}")]
    Count {
        /// The queue.
        queue: String,
        /// The client error.
        source: lapin::Error,
    },
    /// The parked queue could not be read.
    #[error(transparent)]
    Parked(#[from] ParkedError),
    /// The cancel stream could not be read.
    #[error("reading `{stream}`: {source}")]
    Stream {
        /// The stream.
        stream: String,
        /// What failed.
        source: WireError,
    },
    /// The management API did not answer.
    #[error(transparent)]
    Management(#[from] ManagementError),
    /// Connecting to read the cancel stream failed.
    #[error(transparent)]
    Connect(#[from] amqp::ConnectError),
}

/// One queue.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct QueueStatus {
    /// Its name.
    pub name: String,
    /// Messages ready in it (a passive declare; the management API's count when it is
    /// configured, which also counts unacknowledged ones and, in a quorum queue, expired
    /// ones its dead-letter worker has not forwarded).
    pub messages: u64,
    /// Bytes of the bodies it holds (management API only).
    pub bytes: Option<u64>,
    /// Its consumers.
    pub consumers: u64,
}

/// One delay level.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LevelStatus {
    /// The level, as the ladder prints it.
    pub level: String,
    /// Its queue.
    #[serde(flatten)]
    pub queue: QueueStatus,
}

/// The parked queue.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ParkedStatus {
    /// The queue.
    #[serde(flatten)]
    pub queue: QueueStatus,
    /// Reasons of the messages read, and how many have each.
    pub by_reason: BTreeMap<String, u64>,
    /// How many messages were read for `by_reason` (at most the limit asked for).
    pub read: u64,
    /// Why none were read, when that was not safe.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub not_read: Option<String>,
}

/// Everything `status` shows.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Status {
    /// The bridge's prefix.
    pub prefix: String,
    /// `classic` or `quorum`.
    pub queue_type: String,
    /// Where the figures come from: `amqp` (passive declares) or `management`.
    pub source: &'static str,
    /// The work queue: new messages, and the bridges consuming it.
    pub work: QueueStatus,
    /// The returns queue: messages back from a level, and the bridges consuming it.
    pub returns: QueueStatus,
    /// Every level, ascending.
    pub levels: Vec<LevelStatus>,
    /// Messages in all levels together.
    pub pending_in_levels: u64,
    /// The parked queue.
    pub parked: ParkedStatus,
    /// The cancel stream: its entries (tombstones, and the catch-up markers bridges append
    /// when they start).
    pub cancel_stream: QueueStatus,
    /// What the cancel stream's entries are.
    pub cancel_entries: StreamEntries,
}

/// What the newest complete checkpoint of the cancel stream holds.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct CheckpointFigures {
    /// The stream offset of its begin entry.
    pub offset: u64,
    /// Live cancels in it.
    pub cancels: u64,
    /// Live replacements of recurring schedules in it.
    pub replacements: u64,
    /// Live successor tombstones in it.
    pub successors: u64,
    /// Cancels dated ahead in it, held until their clamp.
    pub held: u64,
    /// Parts that could not be read.
    pub unreadable_parts: u64,
}

impl CheckpointFigures {
    fn at(offset: u64) -> Self {
        Self {
            offset,
            ..Self::default()
        }
    }

    /// Counts the records of one part's body.
    fn count(&mut self, body: &[u8]) {
        let Ok(records) = checkpoint::decode_part(body) else {
            self.unreadable_parts += 1;
            return;
        };
        for record in records {
            match record {
                Record::Cancel { .. } => self.cancels += 1,
                Record::Replaced { .. } => self.replacements += 1,
                Record::Successors { .. } => self.successors += 1,
                Record::Held { .. } => self.held += 1,
                Record::StreamClock { .. } => {}
            }
        }
    }
}

/// The cancel stream's entries by kind, read from its newest complete checkpoint (else
/// from its start) up to its end.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct StreamEntries {
    /// The checkpoint the read began at (none: the stream has none, and was read from its
    /// first entry); the counts below are of the entries read after its begin.
    pub checkpoint: Option<CheckpointFigures>,
    /// Cancels (tombstones) the stream still holds; the bridges forget each one after
    /// `max_delay + cancel.grace`, or `cancel.grace` after the due time it names.
    pub tombstones: u64,
    /// Successor tombstones, one per redelivered occurrence of a recurring schedule (see
    /// [`crate::cancel::Successors`]; a version before 0.2 wrote one per delivered one).
    pub successors: u64,
    /// Catch-up markers and clock entries: one per bridge start, and one every
    /// [`crate::cancel::CLOCK_EVERY`] per running bridge.
    pub markers: u64,
    /// Clamps of tombstones dated ahead of the clock (see [`crate::cancel::FutureCancels`]).
    pub clamps: u64,
    /// Checkpoint entries (begins and parts; see [`crate::cancel::checkpoint`]).
    pub checkpoint_entries: u64,
    /// Entries that are neither, or bridge state a bridge did not write (the trust table,
    /// [`crate::cancel::trust`]): skipped by the bridges.
    pub invalid: u64,
    /// Entries the AMQP client cannot read (a short string that is not UTF-8; skipped by the
    /// bridges, logged at error with their offset).
    pub unreadable: u64,
    /// True when the read reached the stream's end as it was when `status` began (what was
    /// appended after is not read); false when it stopped at [`STREAM_READ_MOST`] entries or
    /// [`STREAM_READ_WITHIN`] passed before the end.
    pub complete: bool,
}

/// The most cancel-stream entries `status` reads.
pub const STREAM_READ_MOST: u64 = 100_000;

/// Reads the status of `config`'s topology on `connection`, reading at most
/// `parked_limit` parked messages for their reasons.
pub async fn read(
    config: &Config,
    connection: &Connection,
    parked_limit: u16,
) -> Result<Status, StatusError> {
    let names = &config.names;
    let figures = match &config.management {
        Some(management) => Some(
            Management::new(&management.urls, config.url(), MANAGEMENT_TIMEOUT)
                .queues(names.prefix())
                .await?,
        ),
        None => None,
    };
    let channel = connection
        .create_channel()
        .await
        .map_err(|source| StatusError::Count {
            queue: names.work_queue(),
            source,
        })?;
    let count = |name: String| {
        let channel = &channel;
        let figures = figures.as_deref();
        async move {
            let counted = queue_counts(channel, &name).await.map_err(|source| {
                if reply_code(&source) == Some(404) {
                    StatusError::Missing {
                        queue: name.clone(),
                        prefix: names.prefix().to_string(),
                    }
                } else {
                    StatusError::Count {
                        queue: name.clone(),
                        source,
                    }
                }
            })?;
            Ok::<_, StatusError>(queue_status(name, counted, figures))
        }
    };
    let work = count(names.work_queue()).await?;
    let returns = count(names.returns_queue()).await?;
    let mut levels = Vec::with_capacity(config.ladder.levels().len());
    for level in config.ladder.levels() {
        levels.push(LevelStatus {
            level: format_duration(*level),
            queue: count(names.level_queue(*level)).await?,
        });
    }
    let parked_queue = count(names.parked_queue()).await?;
    let cancel_stream = count(names.cancel_stream()).await?;
    let _ = channel.close(200, "counted".into()).await;
    // The stream and the parked queue are read on one connection of the project's own.
    let reading = amqp::connect_wire(config.url(), "delay-bridge status")
        .await
        .map_err(StatusError::Connect)?;
    let read_both = async {
        let cancel_entries = count_stream(config, &names.cancel_stream(), &Authority::of(config))
            .await
            .map_err(|source| StatusError::Stream {
                stream: names.cancel_stream(),
                source,
            })?;
        let not_read = unsafe_to_read(config, connection).await;
        let read = match not_read {
            None => parked::peek_on(&reading, config, parked_limit).await?.0,
            Some(_) => Vec::new(),
        };
        Ok::<_, StatusError>((cancel_entries, not_read, read))
    };
    let read_both = read_both.await;
    reading.close().await;
    let (cancel_entries, not_read, read) = read_both?;
    Ok(Status {
        prefix: names.prefix().to_string(),
        queue_type: config.queue_type.to_string(),
        source: if figures.is_some() {
            "management"
        } else {
            "amqp"
        },
        pending_in_levels: levels.iter().map(|l| l.queue.messages).sum(),
        work,
        returns,
        levels,
        parked: ParkedStatus {
            queue: parked_queue,
            by_reason: parked::count_by_reason(&read),
            read: read.len() as u64,
            not_read,
        },
        cancel_stream,
        cancel_entries,
    })
}

/// Reads the cancel stream on `connection` up to its end as it was when the read began
/// ([`stream_end`]): from the newest complete checkpoint a bridge wrote (as `authority`
/// tells),
/// found by reading back from that end, else from the first entry; at most
/// [`STREAM_READ_MOST`] entries after it, sorted by kind. However fast entries are appended
/// meanwhile, the read ends. Reading a stream takes nothing from it. The project's own
/// connection hands over an entry its codec cannot read as bytes: counted as unreadable.
async fn count_stream(
    config: &Config,
    stream: &str,
    authority: &Authority,
) -> Result<StreamEntries, WireError> {
    let mut reader = StreamReader::new(
        config.url(),
        "delay-bridge status: cancel stream",
        stream,
        Start::Last,
    );
    let counted = count_with(&mut reader, authority).await;
    reader.close().await;
    counted
}

/// [`count_stream`] with `reader`.
async fn count_with(
    reader: &mut StreamReader,
    authority: &Authority,
) -> Result<StreamEntries, WireError> {
    let Some(end) = stream_end(reader).await? else {
        return Ok(StreamEntries {
            complete: true,
            ..StreamEntries::default()
        });
    };
    let (found, _) = cancel_stream::locate(reader, end, authority).await?;
    reader.seek(found.map_or(Start::First, Start::At)).await;
    let mut entries = StreamEntries::default();
    let mut checkpoint = found.map(|offset| (CheckpointFigures::at(offset), None::<String>));
    let mut read = 0u64;
    let deadline = tokio::time::Instant::now() + STREAM_READ_WITHIN;
    while let Ok(next) = tokio::time::timeout_at(deadline, reader.next()).await {
        let Some(delivery) = next? else { break };
        let offset = cancel_stream::offset_of(&delivery);
        read += 1;
        match &delivery.unreadable {
            None => {
                let entry = authority.read(&delivery.properties, &delivery.data);
                // The checkpoint's own begin and parts give its figures.
                let own = match (&mut checkpoint, &entry) {
                    (
                        Some((figures, token @ None)),
                        StreamEntry::CheckpointBegin { token: t, .. },
                    ) if offset == Some(figures.offset) => {
                        *token = Some(t.clone());
                        true
                    }
                    (
                        Some((figures, Some(token))),
                        StreamEntry::CheckpointPart { token: t, .. },
                    ) if t == token => {
                        figures.count(&delivery.data);
                        true
                    }
                    _ => false,
                };
                if !own {
                    count_entry(&mut entries, entry);
                }
            }
            Some(_) => entries.unreadable += 1,
        }
        if offset.is_some_and(|offset| offset >= end) {
            entries.complete = true;
            break;
        }
        if read == STREAM_READ_MOST {
            break;
        }
    }
    entries.unreadable += reader.take_skipped();
    entries.checkpoint = checkpoint.map(|(figures, _)| figures);
    Ok(entries)
}

/// Counts one entry by its kind.
fn count_entry(entries: &mut StreamEntries, entry: StreamEntry) {
    match entry {
        StreamEntry::Cancel(_) => entries.tombstones += 1,
        StreamEntry::Successors(_) => entries.successors += 1,
        StreamEntry::Sync { .. } => entries.markers += 1,
        StreamEntry::CheckpointBegin { .. } | StreamEntry::CheckpointPart { .. } => {
            entries.checkpoint_entries += 1
        }
        StreamEntry::Clamp { .. } => entries.clamps += 1,
        StreamEntry::NotTaken(_) | StreamEntry::Invalid(_) => entries.invalid += 1,
    }
}

/// The offset of the stream's last entry now (`None`: it is empty). A consumer attached
/// at `last` is sent the stream's last chunk (the entries written together), then whatever
/// comes after: the largest offset of what arrives within [`STREAM_END_WITHIN`] of
/// attaching is taken (a little past the end when entries keep coming).
async fn stream_end(reader: &mut StreamReader) -> Result<Option<u64>, WireError> {
    reader.seek(Start::Last).await;
    let mut end = None;
    let deadline = tokio::time::Instant::now() + STREAM_END_WITHIN;
    while let Ok(next) = tokio::time::timeout_at(deadline, reader.next()).await {
        let Some(delivery) = next? else { break };
        end = end.max(cancel_stream::offset_of(&delivery));
    }
    Ok(end)
}

/// Why reading the parked queue (which hands every message back) could lose messages: a
/// quorum parked queue declared before the bridge set its delivery limit has RabbitMQ 4.x's
/// default, 20 hand-backs. Declaring it as the bridge does tells: the broker refuses
/// another limit than the queue's.
async fn unsafe_to_read(config: &Config, connection: &Connection) -> Option<String> {
    if config.queue_type != QueueType::Quorum {
        return None;
    }
    let topology = Topology::from_config(config);
    let parked = topology
        .queues
        .iter()
        .find(|q| q.name == config.names.parked_queue())?;
    let channel = connection.create_channel().await.ok()?;
    let mut arguments = FieldTable::default();
    for (name, value) in &parked.arguments {
        arguments.insert((*name).into(), value.clone());
    }
    let declared = channel
        .queue_declare(
            parked.name.as_str().into(),
            QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            },
            arguments,
        )
        .await;
    match declared {
        Ok(_) => {
            let _ = channel.close(200, "checked".into()).await;
            None
        }
        Err(e) => Some(format!(
            "not read: the parked queue does not have the delivery limit the bridge sets ({e}); \
             on RabbitMQ 4.x each read would count against its default limit of 20, past which \
             it drops messages (see docs/operations.md, 'Changing the topology')"
        )),
    }
}

/// A queue's status from its passive declare, and its management figures when there are
/// some (they count every message, not only the ready ones, and the bytes).
fn queue_status(
    name: String,
    counted: QueueCounts,
    figures: Option<&[QueueFigures]>,
) -> QueueStatus {
    match figures.and_then(|all| all.iter().find(|f| f.name == name)) {
        Some(f) => QueueStatus {
            name,
            messages: f.messages.max(counted.messages),
            bytes: Some(f.message_bytes),
            consumers: counted.consumers,
        },
        None => QueueStatus {
            name,
            messages: counted.messages,
            bytes: None,
            consumers: counted.consumers,
        },
    }
}
