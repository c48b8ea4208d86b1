//! Checkpoints of the cancel state, pure: what a starting reader needs is bounded by what is
//! live, not by the stream's history.
//!
//! A checkpoint is a run of stream entries a bridge writes: a *begin* entry
//! (`delay-bridge-kind: checkpoint`, its `message_id` a random token), then *parts*
//! (`checkpoint-part`, the same token, `delay-bridge-part` of `delay-bridge-parts`, and
//! `delay-bridge-checkpoint`, the begin's offset), whose bodies hold the live state as
//! [`Record`]s. The writer takes the state when it reads its own begin entry back: the
//! parts then hold exactly what every entry *before* the begin left live. A reader that
//! starts at the begin's offset loads the parts, applies the entries between and after them
//! in stream order, and has the same state as one that read the whole stream.
//!
//! A checkpoint is complete once every part is in the stream. Bridges name the newest
//! complete checkpoint they know (its begin's offset) in their catch-up markers and clock
//! entries (`delay-bridge-checkpoint`), which come at least every
//! [`CLOCK_EVERY`](super::CLOCK_EVERY) while a bridge runs: a starting reader finds one by
//! reading only the stream's last minutes ([`Locate`]). A writer that crashes mid-checkpoint
//! leaves an incomplete one no marker names; readers go on from the previous one.
//!
//! A bridge writes a checkpoint once the entries after the newest one reach half the state
//! it would write (and at least [`MIN_ENTRIES_BETWEEN`]), and at least every
//! [`AT_LEAST_EVERY_MS`], whatever share of the stream is live: a start reads at most the
//! live state, half as many entries after it, and the located window; while the state
//! stays the same size, the checkpoints add about two records per entry. (Before 0.3 the
//! threshold was the whole state, which a stream whose entries all stay live never reaches:
//! such a stream was never checkpointed.) Each part's body is at most
//! [`PART_MOST_BYTES`], far below any broker's message size limit.
//!
//! Only a bridge's entries count, as the trust table ([`super::trust`]) tells them: a
//! checkpoint or a pointer anyone else writes is skipped.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

/// The fewest entries after the newest checkpoint before a bridge writes another: below
/// this a start reads everything at once anyway.
pub const MIN_ENTRIES_BETWEEN: u64 = 10_000;

/// The most bytes in one part's body: far below any broker's message size limit (RabbitMQ's
/// default is 128 MiB, and 16 MiB is a common setting). A record is at most about 600 bytes
/// (an id and a target are at most [`super::NAME_MOST_BYTES`] each).
pub const PART_MOST_BYTES: usize = 1 << 20;

/// The longest a bridge lets the newest checkpoint age before it writes another, however
/// few entries follow it: a retention by age (see docs/operations.md) then never removes the
/// newest checkpoint while a bridge runs.
pub const AT_LEAST_EVERY_MS: u64 = 86_400_000;

/// How long a begun checkpoint may stay incomplete before a bridge takes its writer for
/// lost and writes its own.
pub const WRITE_WITHIN_MS: u64 = 60_000;

/// One piece of live state in a checkpoint part.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "k")]
pub enum Record {
    /// A live cancel of every copy of `id` that entered at or before `c`, kept until `e`.
    #[serde(rename = "c")]
    Cancel {
        /// The message id.
        id: String,
        /// Copies that entered at or before this are dropped, epoch ms.
        c: u64,
        /// When it leaves memory, epoch ms.
        e: u64,
    },
    /// A live replacement of the schedules of `id` bound for target `t`.
    #[serde(rename = "r")]
    Replaced {
        /// The schedule id.
        id: String,
        /// The target exchange.
        t: String,
        /// Schedules that entered at or before this are dropped, epoch ms.
        c: u64,
        /// When it leaves memory, epoch ms.
        e: u64,
    },
    /// A live successor tombstone (see [`super::Successors`]).
    #[serde(rename = "s")]
    Successors {
        /// The schedule id.
        id: String,
        /// Its target (none: written before 0.2, every target).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        t: Option<String>,
        /// When the schedule entered.
        n: u64,
        /// Copies of occurrences after this one...
        a: u64,
        /// ...born before this are dropped.
        b: u64,
        /// When it leaves memory, epoch ms.
        e: u64,
    },
    /// A tombstone dated ahead, held until its clamp entry (see [`super::FutureCancels`]).
    #[serde(rename = "h")]
    Held {
        /// Its stream offset.
        o: u64,
        /// The message id.
        id: String,
        /// When it says it was made.
        c: u64,
        /// When it says its message was due.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        d: Option<u64>,
        /// The target of a schedule's replacement (none: a cancel).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        t: Option<String>,
    },
    /// The latest time a bridge wrote into the stream before the begin entry.
    #[serde(rename = "k")]
    StreamClock {
        /// Epoch ms.
        at: u64,
    },
}

impl Record {
    /// The length of the longest id or target it names, in bytes.
    pub fn longest_name(&self) -> usize {
        match self {
            Record::Cancel { id, .. } => id.len(),
            Record::Replaced { id, t, .. } => id.len().max(t.len()),
            Record::Successors { id, t, .. } => id.len().max(t.as_ref().map_or(0, String::len)),
            Record::Held { id, t, .. } => id.len().max(t.as_ref().map_or(0, String::len)),
            Record::StreamClock { .. } => 0,
        }
    }
}

/// Why a part's body could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("checkpoint part unreadable: {0}")]
pub struct PartError(String);

/// The body of one part.
pub fn encode_part(records: &[Record]) -> Vec<u8> {
    serde_json::to_vec(records).expect("records always serialise")
}

/// The records of a part's body.
pub fn decode_part(body: &[u8]) -> Result<Vec<Record>, PartError> {
    serde_json::from_slice(body).map_err(|e| PartError(e.to_string()))
}

/// A checkpoint begun and not yet complete, as a reader follows it.
#[derive(Debug, Clone)]
struct Begun {
    begin: u64,
    parts_seen: BTreeSet<u32>,
    seen_at_ms: u64,
    /// When its writer began it (its begin entry's time).
    begun_at_ms: u64,
}

/// What a follower knows of the checkpoints in the stream: the newest complete one, the
/// ones begun, and whether it is time to write one.
#[derive(Debug, Clone, Default)]
pub struct Checkpoints {
    /// Begun ones by token (at most a few: a stale one leaves when a newer begins).
    begun: BTreeMap<String, Begun>,
    /// The begin offset of the newest complete checkpoint.
    newest: Option<u64>,
    /// When the newest complete checkpoint was begun (or, with none, when this follower
    /// started), epoch ms.
    newest_at_ms: u64,
    /// The token of the checkpoint this follower is writing, while it writes it.
    writing: Option<(String, u64)>,
    /// Entries read since this follower last named the newest checkpoint.
    since_named: u64,
}

/// The most begun checkpoints a follower tracks at once.
const BEGUN_AT_MOST: usize = 4;

impl Checkpoints {
    /// What a follower that loaded the complete checkpoint at `begin`, begun at `at_ms` (or
    /// none: `at_ms` is when it started), knows.
    pub fn starting_from(begin: Option<u64>, at_ms: u64) -> Self {
        Self {
            newest: begin,
            newest_at_ms: at_ms,
            ..Self::default()
        }
    }

    /// The begin offset of the newest complete checkpoint.
    pub fn newest(&self) -> Option<u64> {
        self.newest
    }

    /// A begin entry (a bridge's) read at `offset`, at `now_ms`, begun at `at_ms` (its
    /// time; none: `now_ms`).
    pub fn begun(&mut self, token: &str, offset: u64, at_ms: Option<u64>, now_ms: u64) {
        if self.begun.len() >= BEGUN_AT_MOST
            && let Some(oldest) = self
                .begun
                .iter()
                .min_by_key(|(_, b)| b.begin)
                .map(|(t, _)| t.clone())
        {
            self.begun.remove(&oldest);
        }
        self.begun.insert(
            token.to_string(),
            Begun {
                begin: offset,
                parts_seen: BTreeSet::new(),
                seen_at_ms: now_ms,
                begun_at_ms: at_ms.unwrap_or(now_ms),
            },
        );
    }

    /// A part (a bridge's) read: the begin offset of the checkpoint it completes, if it does.
    pub fn part(&mut self, token: &str, part: u32, parts: u32) -> Option<u64> {
        let begun = self.begun.get_mut(token)?;
        if part >= parts {
            return None;
        }
        begun.parts_seen.insert(part);
        if begun.parts_seen.len() < parts as usize {
            return None;
        }
        let (begin, begun_at_ms) = (begun.begin, begun.begun_at_ms);
        self.begun.remove(token);
        if self.writing.as_ref().is_some_and(|(t, _)| t == token) {
            self.writing = None;
        }
        if self.newest.is_none_or(|newest| begin > newest) {
            self.newest = Some(begin);
            self.newest_at_ms = begun_at_ms;
            // Named at the next entry read.
            self.since_named = POINTER_EVERY;
        }
        Some(begin)
    }

    /// Whether to write a checkpoint now: the stream's last offset read is `last_offset`,
    /// the state holds `live_records`, and no checkpoint is being written (this follower's
    /// or another's begun within [`WRITE_WITHIN_MS`]); due when the entries after the
    /// newest reach half the state (and [`MIN_ENTRIES_BETWEEN`]), or it is older than
    /// [`AT_LEAST_EVERY_MS`]. `slack` (0 to 1) spreads the moment between bridges.
    pub fn due(&self, last_offset: u64, live_records: u64, slack: f64, now_ms: u64) -> bool {
        let writing = |seen_at: u64| seen_at.saturating_add(WRITE_WITHIN_MS) > now_ms;
        if self.writing.as_ref().is_some_and(|(_, at)| writing(*at))
            || self.begun.values().any(|b| writing(b.seen_at_ms))
        {
            return false;
        }
        let age_limit = AT_LEAST_EVERY_MS as f64 * (1.0 + slack.clamp(0.0, 1.0));
        if now_ms.saturating_sub(self.newest_at_ms) as f64 >= age_limit {
            return true;
        }
        let since = match self.newest {
            Some(begin) => last_offset.saturating_sub(begin),
            None => last_offset.saturating_add(1),
        };
        let threshold =
            (live_records / 2).max(MIN_ENTRIES_BETWEEN) as f64 * (1.0 + slack.clamp(0.0, 1.0));
        since as f64 >= threshold
    }

    /// This follower begins writing the checkpoint `token` at `now_ms`.
    pub fn writing(&mut self, token: &str, now_ms: u64) {
        self.writing = Some((token.to_string(), now_ms));
    }

    /// True when `token` is the checkpoint this follower is writing.
    pub fn is_mine(&self, token: &str) -> bool {
        self.writing.as_ref().is_some_and(|(t, _)| t == token)
    }

    /// An entry was read: the newest checkpoint to name in a clock entry now, when it is
    /// time to ([`POINTER_EVERY`] entries since it was last named, or it just completed).
    pub fn to_name(&mut self) -> Option<u64> {
        self.since_named = self.since_named.saturating_add(1);
        if self.newest.is_some() && self.since_named >= POINTER_EVERY {
            self.since_named = 0;
            return self.newest;
        }
        None
    }

    /// This follower gave up writing its checkpoint.
    pub fn abandoned(&mut self) {
        self.writing = None;
    }
}

/// Cuts `records` into the bodies of a checkpoint's parts, each a JSON array of at most
/// [`PART_MOST_BYTES`] (one part at least, so an empty state is a complete checkpoint too; a
/// single record larger than that, which the entry bounds rule out, is a part of its own).
pub fn parts(records: &[Record]) -> Vec<Vec<u8>> {
    let mut bodies = Vec::new();
    let mut body = vec![b'['];
    for record in records {
        let encoded = serde_json::to_vec(record).expect("records always serialise");
        if body.len() > 1 && body.len() + 1 + encoded.len() + 1 > PART_MOST_BYTES {
            body.push(b']');
            bodies.push(std::mem::replace(&mut body, vec![b'[']));
        }
        if body.len() > 1 {
            body.push(b',');
        }
        body.extend_from_slice(&encoded);
    }
    body.push(b']');
    bodies.push(body);
    bodies
}

/// A reader loading the checkpoint that begins at `begin`: it gathers the parts and keeps
/// the other entries (`E`) it reads meanwhile, to apply after the parts in stream order.
#[derive(Debug)]
pub struct Load<E> {
    begin: u64,
    token: Option<String>,
    parts: BTreeMap<u32, Vec<Record>>,
    kept: Vec<E>,
}

/// What a [`Load`] made of an entry.
#[derive(Debug, PartialEq, Eq)]
pub enum Loaded<E> {
    /// Not complete yet.
    Loading,
    /// Complete: the state's records, then the entries to apply after them, in order.
    Done(Vec<Record>, Vec<E>),
    /// The checkpoint cannot be loaded (gone from the stream, or not what was named): read
    /// the stream from its start instead.
    Broken(String),
}

impl<E> Load<E> {
    /// Loads the checkpoint whose begin entry is at `begin`.
    pub fn new(begin: u64) -> Self {
        Self {
            begin,
            token: None,
            parts: BTreeMap::new(),
            kept: Vec::new(),
        }
    }

    /// The begin offset.
    pub fn begin(&self) -> u64 {
        self.begin
    }

    /// The begin entry `token` (a bridge's) read at `offset`, or `None` for any other
    /// entry read first.
    pub fn first(&mut self, offset: Option<u64>, token: Option<&str>) -> Loaded<E> {
        match (offset, token) {
            (Some(offset), Some(token)) if offset == self.begin => {
                self.token = Some(token.to_string());
                Loaded::Loading
            }
            (offset, _) => Loaded::Broken(format!(
                "the checkpoint named at offset {} is not in the stream (first entry read: {offset:?})",
                self.begin
            )),
        }
    }

    /// True once the begin entry was read.
    pub fn started(&self) -> bool {
        self.token.is_some()
    }

    /// A part (a bridge's) read with its body.
    pub fn part(&mut self, token: &str, part: u32, parts: u32, body: &[u8]) -> Loaded<E> {
        if self.token.as_deref() != Some(token) || part >= parts {
            return Loaded::Loading;
        }
        match decode_part(body) {
            Ok(records) => {
                self.parts.insert(part, records);
            }
            Err(e) => return Loaded::Broken(e.to_string()),
        }
        if self.parts.len() < parts as usize {
            return Loaded::Loading;
        }
        let records = std::mem::take(&mut self.parts)
            .into_values()
            .flatten()
            .collect();
        Loaded::Done(records, std::mem::take(&mut self.kept))
    }

    /// Another entry, kept to apply after the parts.
    pub fn keep(&mut self, entry: E) {
        self.kept.push(entry);
    }
}

/// A reader finding the newest complete checkpoint in the stream's last stretch (from a
/// time back, up to where it began reading): the pointers in bridges' markers and clock
/// entries, and any checkpoint begun and completed within the stretch.
#[derive(Debug, Clone, Default)]
pub struct Locate {
    seen: Checkpoints,
    newest: Option<u64>,
}

impl Locate {
    /// A reader at the start of the stretch.
    pub fn new() -> Self {
        Self::default()
    }

    /// A bridge's marker or clock entry naming the checkpoint at `begin`.
    pub fn pointer(&mut self, begin: u64) {
        self.newest = self.newest.max(Some(begin));
    }

    /// A bridge's begin entry.
    pub fn begun(&mut self, token: &str, offset: u64) {
        self.seen.begun(token, offset, None, 0);
    }

    /// A bridge's part.
    pub fn part(&mut self, token: &str, part: u32, parts: u32) {
        if let Some(begin) = self.seen.part(token, part, parts) {
            self.pointer(begin);
        }
    }

    /// The newest complete checkpoint found.
    pub fn found(&self) -> Option<u64> {
        self.newest
    }
}

/// How many entries back from the stream's end a starting reader looks for a checkpoint, in
/// turn: a bridge that follows the stream names the newest one when it completes and after
/// every [`POINTER_EVERY`] entries, so the first stretch usually finds it; the later ones
/// find the last one named before every bridge stopped. Past the last, the stream is read
/// from its first entry.
pub const LOOK_BACK: [u64; 4] = [1_000, 10_000, 100_000, 1_000_000];

/// After how many entries read a following bridge names the newest checkpoint again (in a
/// clock entry), so a starting reader finds it within the first stretch it looks at.
pub const POINTER_EVERY: u64 = 800;

#[cfg(test)]
mod tests {
    use super::*;

    fn cancel(id: &str) -> Record {
        Record::Cancel {
            id: id.into(),
            c: 1,
            e: 2,
        }
    }

    #[test]
    fn records_round_trip_through_parts() {
        let long = "i".repeat(crate::cancel::NAME_MOST_BYTES);
        let records: Vec<Record> = (0..(PART_MOST_BYTES / 250))
            .map(|i| cancel(&format!("{long}-{i}")))
            .chain([
                Record::Replaced {
                    id: "d".into(),
                    t: "orders".into(),
                    c: 5,
                    e: 9,
                },
                Record::Successors {
                    id: "d".into(),
                    t: None,
                    n: 1,
                    a: 2,
                    b: 3,
                    e: 4,
                },
                Record::Held {
                    o: 7,
                    id: "x".into(),
                    c: 99,
                    d: Some(100),
                    t: None,
                },
                Record::StreamClock { at: 5 },
            ])
            .collect();
        let bodies = parts(&records);
        assert_eq!(bodies.len(), 2);
        assert!(bodies.iter().all(|b| b.len() <= PART_MOST_BYTES));
        let back: Vec<Record> = bodies
            .iter()
            .flat_map(|b| decode_part(b).unwrap())
            .collect();
        assert_eq!(back, records);
        assert_eq!(parts(&[]).len(), 1, "an empty state is one part");
        assert!(decode_part(b"{not json").is_err());
    }

    #[test]
    fn a_load_waits_for_every_part_and_keeps_what_came_between_in_order() {
        let mut load = Load::<&str>::new(10);
        assert_eq!(load.first(Some(10), Some("tok")), Loaded::Loading);
        load.keep("cancel-a");
        let one = encode_part(&[cancel("x")]);
        let two = encode_part(&[cancel("y")]);
        assert_eq!(
            load.part("other", 0, 1, &one),
            Loaded::Loading,
            "another checkpoint"
        );
        assert_eq!(load.part("tok", 1, 2, &two), Loaded::Loading);
        load.keep("cancel-b");
        assert_eq!(
            load.part("tok", 0, 2, &one),
            Loaded::Done(vec![cancel("x"), cancel("y")], vec!["cancel-a", "cancel-b"])
        );
    }

    #[test]
    fn a_load_whose_checkpoint_is_gone_or_unreadable_is_broken() {
        let mut gone = Load::<()>::new(10);
        assert!(matches!(
            gone.first(Some(50), Some("tok")),
            Loaded::Broken(_)
        ));
        let mut other = Load::<()>::new(10);
        assert!(matches!(other.first(Some(10), None), Loaded::Broken(_)));
        let mut bad = Load::<()>::new(10);
        bad.first(Some(10), Some("tok"));
        assert!(matches!(bad.part("tok", 0, 1, b"[{"), Loaded::Broken(_)));
    }

    #[test]
    fn a_checkpoint_is_complete_with_its_last_part_and_an_incomplete_one_is_not_named() {
        let mut seen = Checkpoints::default();
        seen.begun("crashed", 100, None, 0);
        assert_eq!(seen.part("crashed", 0, 3), None);
        seen.begun("ok", 200, None, 0);
        assert_eq!(seen.part("ok", 1, 2), None);
        assert_eq!(seen.part("ok", 1, 2), None, "a part read twice counts once");
        assert_eq!(seen.part("ok", 0, 2), Some(200));
        assert_eq!(seen.newest(), Some(200));
        assert_eq!(seen.part("unknown", 0, 1), None, "its begin was not read");
    }

    #[test]
    fn a_checkpoint_is_due_once_the_entries_after_it_reach_half_the_state() {
        let now = 1_000_000;
        let mut seen = Checkpoints::starting_from(Some(1_000), now);
        assert!(!seen.due(1_000 + MIN_ENTRIES_BETWEEN - 1, 10, 0.0, now));
        assert!(seen.due(1_000 + MIN_ENTRIES_BETWEEN, 10, 0.0, now));
        assert!(
            !seen.due(1_000 + 29_999, 60_000, 0.0, now),
            "half the state is larger"
        );
        assert!(seen.due(1_000 + 30_000, 60_000, 0.0, now));
        assert!(
            !seen.due(1_000 + 30_000, 60_000, 0.5, now),
            "this bridge waits longer"
        );
        // Someone is writing one: wait for it, unless it stalled.
        seen.begun("other", 70_000, Some(now), now);
        assert!(!seen.due(1_000 + 80_000, 10, 0.0, now));
        assert!(seen.due(1_000 + 80_000, 10, 0.0, now + WRITE_WITHIN_MS));
        let young = Checkpoints::starting_from(None, now);
        assert!(
            !young.due(100, 10, 0.0, now),
            "a young stream is read whole"
        );
        assert!(young.due(MIN_ENTRIES_BETWEEN, 10, 0.0, now));
        // However quiet the stream, the newest is never much older than a day.
        let day = AT_LEAST_EVERY_MS;
        let mut quiet = Checkpoints::starting_from(Some(1_000), now);
        assert!(!quiet.due(1_001, 10, 0.0, now + day - 1));
        assert!(quiet.due(1_001, 10, 0.0, now + day));
        assert!(!quiet.due(1_001, 10, 0.5, now + day), "the slack");
        assert!(young.due(100, 10, 0.0, now + day));
        quiet.begun("later", 2_000, Some(now + day), now + day);
        quiet.part("later", 0, 1);
        assert!(!quiet.due(2_001, 10, 0.0, now + day + 1_000));
    }

    /// A stream every entry of which stays live (cancels kept a day and more, as a shop's
    /// are): before 0.3 no checkpoint was ever due, however long the stream grew.
    #[test]
    fn a_stream_whose_entries_all_stay_live_is_checkpointed_as_it_grows() {
        let now = 1_000_000;
        let mut seen = Checkpoints::starting_from(None, now);
        let mut written = Vec::new();
        for offset in 0..2_000_000u64 {
            let live = offset + 1;
            if seen.due(offset, live, 0.25, now) {
                let token = format!("c{offset}");
                seen.begun(&token, offset, Some(now), now);
                seen.part(&token, 0, 1);
                written.push(offset);
            }
        }
        assert!(written.len() >= 5, "checkpoints at {written:?}");
        let last = *written.last().unwrap();
        assert!(
            2_000_000 - last <= 2_000_000 / 2 + 1,
            "a start reads the state and at most about half as many entries after it"
        );
    }

    #[test]
    fn the_newest_checkpoint_is_named_when_it_completes_and_every_so_many_entries() {
        let mut seen = Checkpoints::default();
        for _ in 0..POINTER_EVERY {
            assert_eq!(seen.to_name(), None, "none to name");
        }
        seen.begun("tok", 5, None, 0);
        assert_eq!(seen.part("tok", 0, 1), Some(5));
        assert_eq!(seen.to_name(), Some(5), "named once complete");
        for _ in 1..POINTER_EVERY {
            assert_eq!(seen.to_name(), None);
        }
        assert_eq!(seen.to_name(), Some(5));
    }

    #[test]
    fn locating_takes_the_newest_pointer_or_checkpoint_completed_in_the_stretch() {
        let mut locate = Locate::new();
        locate.pointer(100);
        locate.begun("tok", 600);
        locate.part("tok", 0, 1);
        locate.pointer(300);
        assert_eq!(locate.found(), Some(600));
    }
}
