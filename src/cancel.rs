//! Cancellation, pure: the tombstone format of the cancel stream and the in-memory set of
//! live tombstones.
//!
//! A cancel appends a flat tombstone `(message_id, cancelled_at)` to the cancel stream. Every
//! bridge instance reads the stream from its start and keeps the live tombstones in a
//! [`TombstoneSet`]; a copy of a message whose id has a tombstone is dropped when it *entered*
//! (see [`crate::contract::header::PUBLISHED_AT`]) at or before `cancelled_at`. A later copy
//! with the same id (a reschedule) lives. A tombstone leaves memory once no copy it covers can
//! still be pending: `cancelled_at + max_delay + grace`.
//!
//! Stream entries carry no tables or arrays (a stream does not keep them): the id is the
//! `message_id` property, the rest are flat headers.

use std::collections::{BTreeSet, HashMap};

pub mod checkpoint;
mod future;
mod successors;
pub mod trust;

pub use checkpoint::{Checkpoints, Load, Loaded, Locate, Record};
pub use future::{CLOCK_CORRECTION_MOST, CLOCK_EVERY, Clamp, FutureCancels, Read};
pub use successors::{
    LINE_RENEWED_EVERY, SuccessorSet, Successors, birth, born_at_ms, renewal_due,
};
pub use trust::{Authority, Kind, Writer};

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};

/// Header names of cancel-stream entries.
pub mod header {
    /// What the entry is: [`super::KIND_CANCEL`] or [`super::KIND_SYNC`].
    pub const KIND: &str = "delay-bridge-kind";
    /// On a tombstone: when the cancel was made, epoch ms (an integer).
    pub const CANCELLED_AT: &str = "delay-bridge-cancelled-at";
    /// On a tombstone, optional: when the cancelled message was due, epoch ms. The
    /// tombstone then leaves memory at that time plus the grace, not `max_delay` later.
    pub const DUE_AT: &str = "delay-bridge-due-at";
    /// On a successor tombstone: when the schedule entered, epoch ms.
    pub const ENTERED_AT: &str = "delay-bridge-entered-at";
    /// On a successor tombstone: the occurrence delivered.
    pub const AFTER_OCCURRENCE: &str = "delay-bridge-after-occurrence";
    /// On a successor tombstone: copies born before this are dropped.
    pub const BORN_BEFORE: &str = "delay-bridge-born-before";
    /// On a schedule's replacement: the target exchange whose schedules of the id it
    /// replaces; on a successor tombstone (from 0.2), the target its copies are bound for.
    pub const TARGET: &str = "delay-bridge-target";
    /// On a catch-up marker, a clock entry or a clamp: when the bridge wrote it, epoch ms.
    pub const AT: &str = "delay-bridge-at";
    /// On a clamp: the stream offset of the tombstone it clamps.
    pub const OFFSET: &str = "delay-bridge-offset";
    /// On a catch-up marker or clock entry (from 0.2): the offset of the begin entry of
    /// the newest complete checkpoint its bridge knew; on a checkpoint part: its begin's.
    pub const CHECKPOINT: &str = "delay-bridge-checkpoint";
    /// On a checkpoint part: its number, from 0.
    pub const PART: &str = "delay-bridge-part";
    /// On a checkpoint part: how many parts the checkpoint has.
    pub const PARTS: &str = "delay-bridge-parts";
}

/// How far ahead of the reading bridge's clock a tombstone's `cancelled_at` may be. A
/// canceller whose clock runs further ahead is taken to have cancelled at the reader's now
/// plus this, so it cannot cancel a reschedule published after it.
pub const CLOCK_ALLOWANCE_MS: u64 = 1_000;

/// `delay-bridge-kind` of a tombstone.
pub const KIND_CANCEL: &str = "cancel";
/// `delay-bridge-kind` of a successor tombstone (see [`Successors`]).
pub const KIND_SUCCESSORS: &str = "successors";
/// `delay-bridge-kind` of a schedule's replacement: a tombstone that drops only the copies
/// of a recurring schedule of its id bound for one target exchange (see [`Scope`]).
pub const KIND_REPLACED: &str = "schedule-replaced";
/// `delay-bridge-kind` of a catch-up marker (a bridge appends one at boot and reads up to it)
/// or a clock entry (one every [`CLOCK_EVERY`] while it follows the stream).
pub const KIND_SYNC: &str = "sync";
/// `delay-bridge-kind` of a clamp: when a tombstone dated ahead of the clock counts as made
/// (see [`FutureCancels`]).
pub const KIND_CLAMP: &str = "clamp";
/// `delay-bridge-kind` of a checkpoint's begin entry (see [`checkpoint`]).
pub const KIND_CHECKPOINT: &str = "checkpoint";
/// `delay-bridge-kind` of a checkpoint's part (see [`checkpoint`]).
pub const KIND_CHECKPOINT_PART: &str = "checkpoint-part";

/// A cancellation: drop every copy of `message_id` within its [`Scope`] that entered at or
/// before `cancelled_at`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tombstone {
    /// The `message_id` of the message to cancel.
    pub message_id: String,
    /// When the cancel was made, epoch ms.
    pub cancelled_at: u64,
    /// When the cancelled message was due, epoch ms, if the canceller said so.
    pub due_at: Option<u64>,
    /// Which copies of the id it drops.
    pub scope: Scope,
}

#[cfg(test)]
impl Tombstone {
    /// A cancel of every copy of `id` that entered at or before `at`.
    pub(crate) fn every(id: &str, at: u64) -> Self {
        Self {
            message_id: id.into(),
            cancelled_at: at,
            due_at: None,
            scope: Scope::Every,
        }
    }
}

/// Which copies of an id a tombstone drops.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Scope {
    /// Every copy: a cancel (`delay-bridge-kind: cancel`).
    Every,
    /// Only the copies of a recurring schedule bound for this target exchange: what a new
    /// schedule under the id replaces when the bridge takes it in
    /// (`delay-bridge-kind: schedule-replaced`). A one-off message, or a schedule of
    /// another route's target, is not touched.
    Schedules {
        /// The target exchange.
        target: String,
    },
}

/// One entry read from the cancel stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamEntry {
    /// A cancellation.
    Cancel(Tombstone),
    /// A successor tombstone of a recurring schedule.
    Successors(Successors),
    /// A catch-up marker or a clock entry, with its token and when a bridge wrote it (none
    /// from a version before 0.2).
    Sync {
        /// The marker's token (its `message_id`).
        token: String,
        /// When it was written, epoch ms.
        at: Option<u64>,
        /// The begin offset of the newest complete checkpoint its bridge knew (none before
        /// 0.2, or none written yet).
        checkpoint: Option<u64>,
    },
    /// A checkpoint's begin entry.
    CheckpointBegin {
        /// The checkpoint's token (its `message_id`).
        token: String,
        /// When it was begun, epoch ms.
        at: Option<u64>,
    },
    /// A checkpoint's part (its records are in the body: [`checkpoint::decode_part`]).
    CheckpointPart {
        /// The checkpoint's token.
        token: String,
        /// Its number, from 0.
        part: u32,
        /// How many parts the checkpoint has.
        parts: u32,
    },
    /// A clamp of the tombstone at `offset`: it counts as made at `cancelled_at`.
    Clamp {
        /// The tombstone's stream offset.
        offset: u64,
        /// When the tombstone counts as made, epoch ms.
        cancelled_at: u64,
        /// When the clamp was written, epoch ms.
        at: u64,
    },
    /// An entry of this kind that the trust table ([`trust::taken`]) does not take from
    /// its writer. Skipped (and logged).
    NotTaken(Kind),
    /// Something else; the text says what is wrong with it. Skipped (and logged).
    Invalid(String),
}

impl StreamEntry {
    /// Its kind, for the trust table (none for what is not a valid entry).
    pub fn kind(&self) -> Option<Kind> {
        Some(match self {
            StreamEntry::Cancel(Tombstone {
                scope: Scope::Every,
                ..
            }) => Kind::Cancel,
            StreamEntry::Cancel(_) => Kind::Replaced,
            StreamEntry::Successors(_) => Kind::Successors,
            StreamEntry::Sync { .. } => Kind::Sync,
            StreamEntry::CheckpointBegin { .. } => Kind::CheckpointBegin,
            StreamEntry::CheckpointPart { .. } => Kind::CheckpointPart,
            StreamEntry::Clamp { .. } => Kind::Clamp,
            StreamEntry::NotTaken(_) | StreamEntry::Invalid(_) => return None,
        })
    }
}

/// The longest id, token or target an entry may name, in bytes: AMQP's short-string limit,
/// which bounds `message_id` and exchange names. A longer one (a stream-protocol publish, or
/// a target in a long-string header) makes the entry invalid.
pub const NAME_MOST_BYTES: usize = 255;

/// The longest `delay-bridge-kind` read as text (every kind is far shorter).
const KIND_MOST_BYTES: usize = 32;

/// Why a message id cannot be cancelled.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MessageIdError {
    /// The id is empty.
    #[error("a message id cannot be empty")]
    Empty,
    /// The id does not fit AMQP's `message_id` (a short string).
    #[error("message id of {0} bytes is longer than AMQP's 255-byte limit")]
    TooLong(usize),
}

/// Checks a message id and makes it an AMQP short string.
pub fn message_id(id: &str) -> Result<ShortString, MessageIdError> {
    if id.is_empty() {
        return Err(MessageIdError::Empty);
    }
    ShortString::try_new(id.to_string()).map_err(|_| MessageIdError::TooLong(id.len()))
}

fn entry_properties(message_id: ShortString, headers: Vec<(&str, AMQPValue)>) -> BasicProperties {
    let mut table = FieldTable::default();
    for (k, v) in headers {
        table.insert(ShortString::from(k), v);
    }
    BasicProperties::default()
        .with_message_id(message_id)
        .with_delivery_mode(crate::contract::PERSISTENT)
        .with_headers(table)
}

/// The properties of a schedule's replacement (the body is empty): the copies of recurring
/// schedules of `message_id` bound for `target` that entered at or before `entered_before`
/// are dropped.
pub fn replaced_properties(
    message_id: ShortString,
    target: &str,
    entered_before: u64,
) -> BasicProperties {
    entry_properties(
        message_id,
        vec![
            (
                header::KIND,
                AMQPValue::LongString(LongString::from(KIND_REPLACED)),
            ),
            (
                header::CANCELLED_AT,
                AMQPValue::LongLongInt(i64::try_from(entered_before).unwrap_or(i64::MAX)),
            ),
            (
                header::TARGET,
                AMQPValue::LongString(LongString::from(target)),
            ),
        ],
    )
}

/// The properties of a tombstone entry (the body is empty); `due_at` when the canceller
/// knows when the message was due.
pub fn tombstone_properties(
    message_id: ShortString,
    cancelled_at: u64,
    due_at: Option<u64>,
) -> BasicProperties {
    let mut headers = vec![
        (
            header::KIND,
            AMQPValue::LongString(LongString::from(KIND_CANCEL)),
        ),
        (
            header::CANCELLED_AT,
            AMQPValue::LongLongInt(cancelled_at as i64),
        ),
    ];
    if let Some(due_at) = due_at {
        headers.push((header::DUE_AT, AMQPValue::LongLongInt(due_at as i64)));
    }
    entry_properties(message_id, headers)
}

/// The properties of a successor tombstone (the body is empty).
pub fn successors_properties(message_id: ShortString, successors: &Successors) -> BasicProperties {
    let int = |v: u64| AMQPValue::LongLongInt(i64::try_from(v).unwrap_or(i64::MAX));
    let mut headers = vec![
        (
            header::KIND,
            AMQPValue::LongString(LongString::from(KIND_SUCCESSORS)),
        ),
        (header::ENTERED_AT, int(successors.entered_at)),
        (header::AFTER_OCCURRENCE, int(successors.after_occurrence)),
        (header::BORN_BEFORE, int(successors.born_before)),
        (header::DUE_AT, int(successors.due_at)),
    ];
    if let Some(target) = &successors.target {
        headers.push((
            header::TARGET,
            AMQPValue::LongString(LongString::from(target.as_str())),
        ));
    }
    entry_properties(message_id, headers)
}

/// The properties of a catch-up marker or clock entry with this token, written at `at_ms`,
/// naming the newest complete checkpoint its bridge knows (the body is empty).
pub fn sync_properties(token: ShortString, at_ms: u64, checkpoint: Option<u64>) -> BasicProperties {
    let mut headers = vec![
        (
            header::KIND,
            AMQPValue::LongString(LongString::from(KIND_SYNC)),
        ),
        (header::AT, AMQPValue::LongLongInt(epoch_i64(at_ms))),
    ];
    if let Some(begin) = checkpoint {
        headers.push((header::CHECKPOINT, AMQPValue::LongLongInt(epoch_i64(begin))));
    }
    entry_properties(token, headers)
}

/// The properties of a checkpoint's begin entry, begun at `at_ms` (the body is empty).
pub fn checkpoint_begin_properties(token: ShortString, at_ms: u64) -> BasicProperties {
    entry_properties(
        token,
        vec![
            (
                header::KIND,
                AMQPValue::LongString(LongString::from(KIND_CHECKPOINT)),
            ),
            (header::AT, AMQPValue::LongLongInt(epoch_i64(at_ms))),
        ],
    )
}

/// The properties of part `part` of `parts` of the checkpoint `token` that begins at
/// `begin` (the body holds its records).
pub fn checkpoint_part_properties(
    token: ShortString,
    begin: u64,
    part: u32,
    parts: u32,
) -> BasicProperties {
    entry_properties(
        token,
        vec![
            (
                header::KIND,
                AMQPValue::LongString(LongString::from(KIND_CHECKPOINT_PART)),
            ),
            (header::CHECKPOINT, AMQPValue::LongLongInt(epoch_i64(begin))),
            (header::PART, AMQPValue::LongLongInt(i64::from(part))),
            (header::PARTS, AMQPValue::LongLongInt(i64::from(parts))),
        ],
    )
}

/// The properties of a clamp entry written at `at_ms` (the body is empty).
pub fn clamp_properties(clamp: &Clamp, at_ms: u64) -> Result<BasicProperties, MessageIdError> {
    Ok(entry_properties(
        message_id(&clamp.message_id)?,
        vec![
            (
                header::KIND,
                AMQPValue::LongString(LongString::from(KIND_CLAMP)),
            ),
            (
                header::OFFSET,
                AMQPValue::LongLongInt(epoch_i64(clamp.offset)),
            ),
            (
                header::CANCELLED_AT,
                AMQPValue::LongLongInt(epoch_i64(clamp.cancelled_at)),
            ),
            (header::AT, AMQPValue::LongLongInt(epoch_i64(at_ms))),
        ],
    ))
}

/// `v` as a signed 64-bit header value (saturated).
fn epoch_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// Reads a stream entry from its properties.
pub fn read_entry(properties: &BasicProperties) -> StreamEntry {
    let headers = properties.headers().as_ref();
    let get = |name: &str| headers.and_then(|h| h.inner().get(name));
    let text = |v: &AMQPValue| match v {
        AMQPValue::LongString(s) => String::from_utf8(s.as_bytes().to_vec()).ok(),
        AMQPValue::ShortString(s) => Some(s.as_str().to_string()),
        _ => None,
    };
    let Some(kind) = get(header::KIND).and_then(text) else {
        return StreamEntry::Invalid(format!("no `{}` header", header::KIND));
    };
    if kind.len() > KIND_MOST_BYTES {
        return StreamEntry::Invalid(format!("an entry kind of {} bytes", kind.len()));
    }
    let id = properties
        .message_id()
        .as_ref()
        .map(|m| m.as_str().to_string())
        .filter(|m| !m.is_empty());
    if let Some(long) = [id.as_ref(), get(header::TARGET).and_then(text).as_ref()]
        .into_iter()
        .flatten()
        .find(|name| name.len() > NAME_MOST_BYTES)
    {
        return StreamEntry::Invalid(format!(
            "`{kind}` entry names an id or target of {} bytes (at most {NAME_MOST_BYTES})",
            long.len()
        ));
    }
    let epoch_ms = |v: Option<&AMQPValue>| match v {
        Some(AMQPValue::LongLongInt(v)) if *v >= 0 => Some(*v as u64),
        Some(AMQPValue::LongInt(v)) if *v >= 0 => Some(*v as u64),
        Some(AMQPValue::LongUInt(v)) => Some(u64::from(*v)),
        _ => None,
    };
    match (kind.as_str(), id) {
        (KIND_SYNC, Some(token)) => StreamEntry::Sync {
            token,
            at: epoch_ms(get(header::AT)),
            checkpoint: epoch_ms(get(header::CHECKPOINT)),
        },
        (KIND_CHECKPOINT, Some(token)) => StreamEntry::CheckpointBegin {
            token,
            at: epoch_ms(get(header::AT)),
        },
        (KIND_CHECKPOINT_PART, Some(token)) => {
            let number = |name: &str| epoch_ms(get(name)).and_then(|v| u32::try_from(v).ok());
            match (number(header::PART), number(header::PARTS)) {
                (Some(part), Some(parts)) if part < parts => {
                    StreamEntry::CheckpointPart { token, part, parts }
                }
                _ => StreamEntry::Invalid(format!(
                    "checkpoint part of `{token}` lacks an integer part number below its count"
                )),
            }
        }
        (KIND_CLAMP, Some(message_id)) => match (
            epoch_ms(get(header::OFFSET)),
            epoch_ms(get(header::CANCELLED_AT)),
            epoch_ms(get(header::AT)),
        ) {
            (Some(offset), Some(cancelled_at), Some(at)) => StreamEntry::Clamp {
                offset,
                cancelled_at,
                at,
            },
            _ => StreamEntry::Invalid(format!(
                "clamp for `{message_id}` lacks an integer offset, cancel time or time"
            )),
        },
        (KIND_SUCCESSORS, Some(message_id)) => {
            let field = |name: &str| {
                epoch_ms(get(name)).ok_or_else(|| {
                    format!("successor tombstone for `{message_id}` has no integer `{name}`")
                })
            };
            let read = (|| {
                Ok::<_, String>(Successors {
                    target: get(header::TARGET).and_then(text),
                    entered_at: field(header::ENTERED_AT)?,
                    after_occurrence: field(header::AFTER_OCCURRENCE)?,
                    born_before: field(header::BORN_BEFORE)?,
                    due_at: field(header::DUE_AT)?,
                    message_id: message_id.clone(),
                })
            })();
            match read {
                Ok(successors) => StreamEntry::Successors(successors),
                Err(why) => StreamEntry::Invalid(why),
            }
        }
        (KIND_CANCEL | KIND_REPLACED, Some(message_id)) => {
            let scope = match kind.as_str() {
                KIND_CANCEL => Scope::Every,
                _ => match get(header::TARGET).and_then(text) {
                    Some(target) => Scope::Schedules { target },
                    None => {
                        return StreamEntry::Invalid(format!(
                            "schedule replacement for `{message_id}` has no `{}`",
                            header::TARGET
                        ));
                    }
                },
            };
            // A malformed due time is ignored: the tombstone is then kept the longest.
            let due_at = epoch_ms(get(header::DUE_AT));
            let cancelled_at = match epoch_ms(get(header::CANCELLED_AT)) {
                Some(at) => at,
                None => {
                    return StreamEntry::Invalid(format!(
                        "tombstone for `{message_id}` has no integer `{}`",
                        header::CANCELLED_AT
                    ));
                }
            };
            StreamEntry::Cancel(Tombstone {
                message_id,
                cancelled_at,
                due_at,
                scope,
            })
        }
        (
            KIND_SYNC | KIND_CANCEL | KIND_REPLACED | KIND_SUCCESSORS | KIND_CLAMP
            | KIND_CHECKPOINT | KIND_CHECKPOINT_PART,
            None,
        ) => StreamEntry::Invalid(format!("`{kind}` entry without a message_id")),
        (other, _) => StreamEntry::Invalid(format!("unknown entry kind `{other}`")),
    }
}

/// What [`TombstoneSet::insert`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Inserted {
    /// A new live tombstone.
    New,
    /// The id had a tombstone; this later cancel now covers later copies too.
    Extended,
    /// The id already had this or a later cancel: nothing changed.
    Covered,
    /// Too old: every copy it covers is past its latest due time.
    Expired,
}

#[derive(Debug, Clone, Copy)]
struct Live {
    cancelled_at: u64,
    /// When it leaves memory, epoch ms.
    expires_at: u64,
    /// Copies this instance dropped because of it.
    dropped: u64,
}

/// A tombstone that left memory, and whether it ever dropped a copy here.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expired {
    /// The cancelled id.
    pub message_id: String,
    /// Copies this instance dropped for it (0: already delivered, unknown, or dropped by
    /// another instance).
    pub dropped: u64,
}

/// The live tombstones, bounded by time: each leaves once no copy it covers can still be
/// pending: `cancelled_at + keep_ms` (max delay plus grace), or, when the canceller said when
/// the message was due, that time plus `grace_ms` if it is sooner.
#[derive(Debug, Clone)]
pub struct TombstoneSet {
    keep_ms: u64,
    grace_ms: u64,
    /// The cancels ([`Scope::Every`]), by id.
    live: HashMap<String, Live>,
    /// The schedules' replacements, by (target, id).
    replaced: HashMap<(String, String), Live>,
    /// (expires at, id, target of a replacement), to expire in order.
    by_expiry: BTreeSet<(u64, String, Option<String>)>,
    /// The successor tombstones of recurring schedules.
    successors: SuccessorSet,
}

impl TombstoneSet {
    /// An empty set whose tombstones live `keep_ms` after their cancel, or `grace_ms` after
    /// the due time a tombstone names.
    pub fn new(keep_ms: u64, grace_ms: u64) -> Self {
        Self {
            keep_ms,
            grace_ms,
            live: HashMap::new(),
            replaced: HashMap::new(),
            by_expiry: BTreeSet::new(),
            successors: SuccessorSet::default(),
        }
    }

    /// How long a tombstone is kept after its cancel, ms.
    pub fn keep_ms(&self) -> u64 {
        self.keep_ms
    }

    /// Adds a tombstone read at `now_ms`. Its `cancelled_at` counts as at most `now_ms` plus
    /// [`CLOCK_ALLOWANCE_MS`].
    pub fn insert(&mut self, tombstone: Tombstone, now_ms: u64) -> Inserted {
        let cancelled_at = tombstone
            .cancelled_at
            .min(now_ms.saturating_add(CLOCK_ALLOWANCE_MS));
        let expires_at = self.expires_at(&tombstone, now_ms);
        if expires_at <= now_ms {
            return Inserted::Expired;
        }
        let target = match tombstone.scope {
            Scope::Every => None,
            Scope::Schedules { target } => Some(target),
        };
        self.put(tombstone.message_id, target, cancelled_at, expires_at)
    }

    /// Keeps the cancel of `id` (of the schedules bound for `target`, when given) that
    /// covers copies entered at or before `cancelled_at` until `expires_at`. Of two cancels
    /// of one id both stand: the later one covers more copies, the longer one lives longer.
    fn put(
        &mut self,
        id: String,
        target: Option<String>,
        cancelled_at: u64,
        expires_at: u64,
    ) -> Inserted {
        let live = match &target {
            None => self.live.get_mut(&id),
            Some(target) => self.replaced.get_mut(&(target.clone(), id.clone())),
        };
        let Some(live) = live else {
            self.by_expiry
                .insert((expires_at, id.clone(), target.clone()));
            let live = Live {
                cancelled_at,
                expires_at,
                dropped: 0,
            };
            match target {
                None => self.live.insert(id, live),
                Some(target) => self.replaced.insert((target, id), live),
            };
            return Inserted::New;
        };
        let inserted = if cancelled_at > live.cancelled_at {
            live.cancelled_at = cancelled_at;
            Inserted::Extended
        } else {
            Inserted::Covered
        };
        if expires_at > live.expires_at {
            self.by_expiry
                .remove(&(live.expires_at, id.clone(), target.clone()));
            live.expires_at = expires_at;
            self.by_expiry.insert((expires_at, id, target));
        }
        inserted
    }

    /// True when every copy `tombstone` covers is past its latest due time at `now_ms` (as
    /// dated: a later reading can only make it leave sooner): it would not be kept.
    pub fn expired(&self, tombstone: &Tombstone, now_ms: u64) -> bool {
        self.expires_at(tombstone, now_ms) <= now_ms
    }

    /// When `tombstone`, read at `now_ms`, leaves memory.
    fn expires_at(&self, tombstone: &Tombstone, now_ms: u64) -> u64 {
        let cancelled_at = tombstone
            .cancelled_at
            .min(now_ms.saturating_add(CLOCK_ALLOWANCE_MS));
        let longest = cancelled_at.saturating_add(self.keep_ms);
        match tombstone.due_at {
            Some(due_at) => longest.min(due_at.max(cancelled_at).saturating_add(self.grace_ms)),
            None => longest,
        }
    }

    /// True when a tombstone for `message_id` is live, whichever copies it covers. Counts
    /// nothing.
    pub fn names(&self, message_id: &str) -> bool {
        self.live.contains_key(message_id)
    }

    /// True when the copy of `message_id` that entered at `entered_at` is cancelled. Counts
    /// the drop against the tombstone.
    pub fn cancels(&mut self, message_id: &str, entered_at: u64) -> bool {
        match self.live.get_mut(message_id) {
            Some(live) if entered_at <= live.cancelled_at => {
                live.dropped += 1;
                true
            }
            _ => false,
        }
    }

    /// True when a later schedule of `message_id` for `target` replaced the one that
    /// entered at `entered_at`. Counts the drop against the replacement.
    fn replaces(&mut self, message_id: &str, target: &str, entered_at: u64) -> bool {
        if self.replaced.is_empty() {
            return false;
        }
        match self
            .replaced
            .get_mut(&(target.to_string(), message_id.to_string()))
        {
            Some(live) if entered_at <= live.cancelled_at => {
                live.dropped += 1;
                true
            }
            _ => false,
        }
    }

    /// Removes the tombstones whose covered copies can no longer be pending at `now_ms`.
    pub fn expire(&mut self, now_ms: u64) -> Vec<Expired> {
        self.successors.expire(now_ms);
        let mut gone = Vec::new();
        while let Some(first) = self.by_expiry.first() {
            if first.0 > now_ms {
                break;
            }
            let (_, id, target) = self.by_expiry.pop_first().expect("first exists");
            let live = match target {
                None => self.live.remove(&id),
                Some(target) => self.replaced.remove(&(target, id.clone())),
            };
            gone.push(Expired {
                message_id: id,
                dropped: live.map_or(0, |l| l.dropped),
            });
        }
        gone
    }

    /// When the next tombstone expires, epoch ms.
    pub fn next_expiry(&self) -> Option<u64> {
        let plain = self.by_expiry.first().map(|(at, _, _)| *at);
        match (plain, self.successors.next_expiry()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Adds a successor tombstone read at `now_ms`, kept a grace after the occurrence it
    /// names was due; false when that has passed.
    pub fn insert_successors(&mut self, successors: Successors, now_ms: u64) -> bool {
        let longest = self.keep_ms.saturating_add(self.grace_ms);
        self.successors
            .insert(successors, self.grace_ms, longest, now_ms)
    }

    /// True when the copy of a recurring schedule's `occurrence` bound for `target`, born
    /// at `born`, is dropped: its schedule `(message_id, entered_at)` is cancelled or
    /// replaced by a later schedule of the id for that target, or a successor tombstone says
    /// another copy of that occurrence lives.
    pub fn cancels_occurrence(
        &mut self,
        message_id: &str,
        target: &str,
        entered_at: u64,
        occurrence: u64,
        born: u64,
    ) -> bool {
        self.cancels(message_id, entered_at)
            || self.replaces(message_id, target, entered_at)
            || self
                .successors
                .drops(message_id, target, entered_at, occurrence, born)
    }

    /// True when the copy of a recurring schedule bound for `target` that entered at
    /// `entered_at` is cancelled or replaced, whatever successor tombstones say (a
    /// redelivered copy is born again after them). Counts the drop.
    pub fn cancels_schedule(&mut self, message_id: &str, target: &str, entered_at: u64) -> bool {
        self.cancels(message_id, entered_at) || self.replaces(message_id, target, entered_at)
    }

    /// The latest birth a successor tombstone of the schedule `(message_id, entered_at)`
    /// bound for `target` names (see [`SuccessorSet::latest_birth`]).
    pub fn latest_birth(&self, message_id: &str, target: &str, entered_at: u64) -> Option<u64> {
        self.successors.latest_birth(message_id, target, entered_at)
    }

    /// The live state as checkpoint records: the cancels, the schedules' replacements and
    /// the successor tombstones, each with when it leaves memory.
    pub fn records(&self) -> Vec<Record> {
        let mut records = Vec::with_capacity(self.len() + self.successors.len());
        records.extend(self.live.iter().map(|(id, live)| Record::Cancel {
            id: id.clone(),
            c: live.cancelled_at,
            e: live.expires_at,
        }));
        records.extend(
            self.replaced
                .iter()
                .map(|((target, id), live)| Record::Replaced {
                    id: id.clone(),
                    t: target.clone(),
                    c: live.cancelled_at,
                    e: live.expires_at,
                }),
        );
        self.successors.records(&mut records);
        records
    }

    /// Restores one record of a checkpoint at `now_ms`, as it was written (what has expired
    /// by then is left out). Records that are not the set's are ignored, and so is one that
    /// names an id or target longer than [`NAME_MOST_BYTES`] (a version before 0.3 took them).
    pub fn restore(&mut self, record: Record, now_ms: u64) {
        if record.longest_name() > NAME_MOST_BYTES {
            return;
        }
        let (id, target, cancelled_at, expires_at) = match record {
            Record::Cancel { id, c, e } => (id, None, c, e),
            Record::Replaced { id, t, c, e } => (id, Some(t), c, e),
            Record::Successors { id, t, n, a, b, e } => {
                self.successors.restore(
                    Successors {
                        message_id: id,
                        target: t,
                        entered_at: n,
                        after_occurrence: a,
                        born_before: b,
                        due_at: e,
                    },
                    e,
                    now_ms,
                );
                return;
            }
            Record::Held { .. } | Record::StreamClock { .. } => return,
        };
        if expires_at > now_ms {
            self.put(id, target, cancelled_at, expires_at);
        }
    }

    /// How many successor tombstones are live.
    pub fn successors_len(&self) -> usize {
        self.successors.len()
    }

    /// How many tombstones are live (cancels and schedules' replacements).
    pub fn len(&self) -> usize {
        self.live.len() + self.replaced.len()
    }

    /// True when no tombstone is live.
    pub fn is_empty(&self) -> bool {
        self.live.is_empty() && self.replaced.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn t(id: &str, at: u64) -> Tombstone {
        Tombstone::every(id, at)
    }

    #[test]
    fn a_schedules_replacement_drops_only_that_targets_schedules_of_the_id() {
        let mut set = TombstoneSet::new(10_000, 0);
        let replaced = Tombstone {
            scope: Scope::Schedules {
                target: "orders".into(),
            },
            ..t("digest", 1_000)
        };
        assert_eq!(set.insert(replaced, 1_000), Inserted::New);
        assert!(
            !set.cancels("digest", 900),
            "a one-off message of the id lives"
        );
        assert!(!set.names("digest"));
        assert!(set.cancels_occurrence("digest", "orders", 900, 3, 0));
        assert!(
            !set.cancels_occurrence("digest", "payments", 900, 3, 0),
            "another target's schedule of the id lives"
        );
        assert!(
            !set.cancels_occurrence("digest", "orders", 1_001, 1, 0),
            "the schedule that replaced it lives"
        );
        assert_eq!(set.len(), 1);
        assert_eq!(set.expire(11_000).len(), 1);
        assert!(set.is_empty());
        let entry = replaced_properties(message_id("digest").unwrap(), "orders", 1_000);
        assert_eq!(
            read_entry(&entry),
            StreamEntry::Cancel(Tombstone {
                scope: Scope::Schedules {
                    target: "orders".into()
                },
                ..t("digest", 1_000)
            })
        );
    }

    fn due(id: &str, at: u64, due_at: u64) -> Tombstone {
        Tombstone {
            due_at: Some(due_at),
            ..t(id, at)
        }
    }

    #[test]
    fn a_canceller_clock_ahead_cannot_cancel_a_later_reschedule() {
        let now = 1_000_000;
        let mut set = TombstoneSet::new(10_000_000, 0);
        // The canceller's clock is an hour ahead.
        set.insert(t("a", now + 3_600_000), now);
        assert!(set.cancels("a", now + 500), "what entered before: dropped");
        assert!(
            !set.cancels("a", now + CLOCK_ALLOWANCE_MS + 1),
            "a reschedule published after the allowance lives"
        );
    }

    #[test]
    fn a_tombstone_that_names_the_due_time_leaves_after_it_plus_the_grace() {
        let mut set = TombstoneSet::new(100_000, 1_000);
        set.insert(due("a", 1_000, 5_000), 1_000);
        // due before the cancel was made: kept the grace after the cancel
        set.insert(due("b", 3_000, 2_000), 3_000);
        // due later than max delay allows: the usual bound wins
        set.insert(due("c", 1_000, 500_000), 1_000);
        assert_eq!(set.next_expiry(), Some(4_000));
        let gone = |v: Vec<Expired>| v.into_iter().map(|e| e.message_id).collect::<Vec<_>>();
        assert_eq!(gone(set.expire(4_000)), vec!["b"]);
        assert_eq!(gone(set.expire(6_000)), vec!["a"]);
        assert_eq!(gone(set.expire(101_000)), vec!["c"]);
    }

    #[test]
    fn an_id_is_named_while_its_tombstone_lives_whichever_copies_it_covers() {
        let mut set = TombstoneSet::new(10_000, 0);
        set.insert(t("a", 1_000), 1_000);
        assert!(set.names("a"));
        assert!(!set.cancels("a", 1_001), "a reschedule's copy lives");
        assert!(set.names("a"), "still named: it covers older copies");
        assert!(!set.names("b"));
        set.expire(11_000);
        assert!(!set.names("a"), "gone with its tombstone");
    }

    #[test]
    fn of_two_cancels_of_one_id_the_longer_lived_bound_stands() {
        let mut set = TombstoneSet::new(100_000, 1_000);
        set.insert(t("a", 1_000), 1_000);
        assert_eq!(
            set.insert(due("a", 2_000, 3_000), 2_000),
            Inserted::Extended
        );
        assert_eq!(set.next_expiry(), Some(101_000));
        assert!(set.cancels("a", 1_500));
    }

    #[test]
    fn copies_that_entered_before_the_cancel_are_dropped_later_ones_live() {
        let mut set = TombstoneSet::new(10_000, 0);
        assert_eq!(set.insert(t("order-1", 1_000), 1_000), Inserted::New);
        assert!(set.cancels("order-1", 999));
        assert!(set.cancels("order-1", 1_000), "same millisecond: cancelled");
        assert!(!set.cancels("order-1", 1_001), "a reschedule's copy lives");
        assert!(!set.cancels("order-2", 0), "other ids are untouched");
    }

    #[test]
    fn a_later_cancel_extends_an_earlier_one_and_an_earlier_is_covered() {
        let mut set = TombstoneSet::new(10_000, 0);
        set.insert(t("a", 1_000), 1_000);
        assert_eq!(set.insert(t("a", 500), 1_000), Inserted::Covered);
        assert!(!set.cancels("a", 1_500));
        assert_eq!(set.insert(t("a", 2_000), 2_000), Inserted::Extended);
        assert!(set.cancels("a", 1_500));
        assert_eq!(set.len(), 1);
        // expiry follows the latest cancel
        assert!(set.expire(11_000).is_empty());
        assert_eq!(set.next_expiry(), Some(12_000));
        assert_eq!(set.expire(12_000).len(), 1);
        assert!(set.is_empty());
    }

    #[test]
    fn tombstones_leave_once_nothing_they_cover_can_be_pending() {
        let mut set = TombstoneSet::new(5_000, 0);
        set.insert(t("a", 1_000), 1_000);
        set.insert(t("b", 2_000), 2_000);
        assert!(set.cancels("a", 900));
        assert_eq!(set.expire(5_999), vec![]);
        assert_eq!(
            set.expire(6_000),
            vec![Expired {
                message_id: "a".into(),
                dropped: 1
            }]
        );
        assert_eq!(
            set.expire(60_000),
            vec![Expired {
                message_id: "b".into(),
                dropped: 0
            }]
        );
        assert_eq!(
            set.insert(t("c", 1_000), 6_000),
            Inserted::Expired,
            "an old tombstone read at boot is not kept"
        );
        assert!(set.is_empty());
    }

    #[test]
    fn entries_round_trip_and_bad_ones_say_why() {
        let props = tombstone_properties(message_id("order-9").unwrap(), 1_700_000_000_123, None);
        assert_eq!(
            read_entry(&props),
            StreamEntry::Cancel(t("order-9", 1_700_000_000_123))
        );
        let with_due = tombstone_properties(message_id("o").unwrap(), 1_000, Some(9_000));
        assert_eq!(
            read_entry(&with_due),
            StreamEntry::Cancel(due("o", 1_000, 9_000))
        );
        let sync = sync_properties("tok".into(), 5_000, Some(77));
        assert_eq!(
            read_entry(&sync),
            StreamEntry::Sync {
                token: "tok".into(),
                at: Some(5_000),
                checkpoint: Some(77),
            }
        );
        assert_eq!(
            read_entry(&checkpoint_begin_properties("cp".into(), 9)),
            StreamEntry::CheckpointBegin {
                token: "cp".into(),
                at: Some(9)
            }
        );
        assert_eq!(
            read_entry(&checkpoint_part_properties("cp".into(), 77, 1, 3)),
            StreamEntry::CheckpointPart {
                token: "cp".into(),
                part: 1,
                parts: 3
            }
        );
        assert!(matches!(
            read_entry(&checkpoint_part_properties("cp".into(), 77, 3, 3)),
            StreamEntry::Invalid(_)
        ));
        let clamp = Clamp {
            offset: 42,
            message_id: "o".into(),
            cancelled_at: 7_000,
        };
        assert_eq!(
            read_entry(&clamp_properties(&clamp, 6_000).unwrap()),
            StreamEntry::Clamp {
                offset: 42,
                cancelled_at: 7_000,
                at: 6_000
            }
        );
        let bare = BasicProperties::default().with_message_id("x".into());
        assert!(
            matches!(read_entry(&bare), StreamEntry::Invalid(m) if m.contains("delay-bridge-kind"))
        );
        let mut table = FieldTable::default();
        table.insert(header::KIND.into(), AMQPValue::LongString("cancel".into()));
        let no_time = BasicProperties::default()
            .with_message_id("x".into())
            .with_headers(table);
        assert!(
            matches!(read_entry(&no_time), StreamEntry::Invalid(m) if m.contains("cancelled-at"))
        );
        assert_eq!(message_id(""), Err(MessageIdError::Empty));
        assert_eq!(
            message_id(&"x".repeat(256)),
            Err(MessageIdError::TooLong(256))
        );
    }

    #[test]
    fn an_id_or_target_longer_than_a_short_string_makes_the_entry_invalid() {
        let long = "t".repeat(NAME_MOST_BYTES + 1);
        let successors = Successors {
            message_id: "d".into(),
            target: Some(long.clone()),
            entered_at: 1,
            after_occurrence: 1,
            born_before: 1,
            due_at: 1,
        };
        let entry = read_entry(&successors_properties("d".into(), &successors));
        assert!(
            matches!(&entry, StreamEntry::Invalid(why) if why.contains("256 bytes")),
            "{entry:?}"
        );
        let replaced = replaced_properties("d".into(), &long, 5);
        assert!(matches!(read_entry(&replaced), StreamEntry::Invalid(_)));
        let fits = replaced_properties("d".into(), &long[1..], 5);
        assert!(matches!(read_entry(&fits), StreamEntry::Cancel(_)));
        let mut table = FieldTable::default();
        table.insert(
            header::KIND.into(),
            AMQPValue::LongString("k".repeat(100_000).into()),
        );
        let kind = BasicProperties::default()
            .with_message_id("x".into())
            .with_headers(table);
        assert!(
            matches!(read_entry(&kind), StreamEntry::Invalid(why) if why.len() < 100),
            "a long kind is not echoed"
        );
    }

    #[test]
    fn a_set_restored_from_its_records_decides_as_the_set_did() {
        let mut set = TombstoneSet::new(100_000, 1_000);
        set.insert(t("a", 1_000), 1_000);
        set.insert(due("b", 2_000, 3_000), 2_000);
        set.insert(
            Tombstone {
                scope: Scope::Schedules {
                    target: "orders".into(),
                },
                ..t("d", 1_500)
            },
            2_000,
        );
        set.insert_successors(
            Successors {
                message_id: "d".into(),
                target: Some("orders".into()),
                entered_at: 10,
                after_occurrence: 3,
                born_before: 99,
                due_at: 50_000,
            },
            2_000,
        );
        let mut restored = TombstoneSet::new(100_000, 1_000);
        for record in set.records() {
            restored.restore(record, 2_500);
        }
        assert_eq!(restored.len(), 3);
        assert_eq!(restored.successors_len(), 1);
        assert_eq!(restored.next_expiry(), set.next_expiry());
        assert!(restored.cancels("a", 1_000) && !restored.cancels("a", 1_001));
        assert!(restored.cancels("b", 2_000));
        assert!(restored.cancels_occurrence("d", "orders", 1_400, 1, 500));
        assert!(
            restored.cancels_occurrence("d", "orders", 10, 4, 98),
            "the successor drops"
        );
        assert!(!restored.cancels_occurrence("d", "orders", 1_600, 4, 98));
        let mut later = TombstoneSet::new(100_000, 1_000);
        for record in set.records() {
            later.restore(record, 4_000);
        }
        assert!(!later.names("b"), "expired by the time it was read");
    }

    proptest! {
        /// The set agrees with a naive model: an id is cancelled for `entered` when the
        /// latest unexpired cancel for it is at or after `entered`; the size never exceeds
        /// the ids cancelled within the keep window.
        #[test]
        fn matches_a_naive_model(
            ops in proptest::collection::vec((0u8..5, 0u64..100_000, 0u64..100_000), 1..200),
            keep in 1u64..50_000,
        ) {
            let mut set = TombstoneSet::new(keep, 0);
            let mut model: HashMap<String, u64> = HashMap::new();
            let mut now = 0u64;
            for (id, at, probe) in ops {
                now += at % 1_000;
                let id = format!("m{id}");
                let cancelled_at = now.saturating_sub(at % 3_000);
                set.insert(t(&id, cancelled_at), now);
                if cancelled_at + keep > now {
                    let e = model.entry(id.clone()).or_insert(cancelled_at);
                    *e = (*e).max(cancelled_at);
                }
                set.expire(now);
                model.retain(|_, c| *c + keep > now);
                let entered = probe % (now + 1);
                let want = model.get(&id).is_some_and(|c| entered <= *c);
                prop_assert_eq!(set.cancels(&id, entered), want);
                prop_assert_eq!(set.len(), model.len());
                prop_assert_eq!(set.by_expiry.len(), set.live.len());
            }
        }
    }
}
