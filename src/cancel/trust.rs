//! Who may write which cancel-stream entry: the one table every reader of the stream (the
//! follower, the checkpoint loader, the checkpoint locator and `status`) decides by.
//!
//! Anyone with write permission on the cancel exchange may cancel: a plain cancel is taken
//! from any writer. Every other kind is bridge state (schedules' replacements, successor
//! tombstones, catch-up markers and clock entries, clamps, checkpoints) and is taken only
//! from a bridge. A bridge is told by two marks:
//!
//! - its `user_id`, which the broker checks against the publishing connection's user on
//!   AMQP 0-9-1, but **not** on the stream protocol (RabbitMQ 3.10 stores a stream-protocol
//!   publish's `user_id` as given); and
//! - when `bridge.state_key` is set, the state's signature
//!   ([`crate::contract::signature`]) over the entry's headers, `message_id` and body,
//!   which no canceller can forge over any protocol. An unsigned entry with the bridge's
//!   `user_id` (a version before 0.3 wrote it) is taken only while
//!   `bridge.accept_unsigned_state` is set, as for copies in the levels.

use lapin::BasicProperties;
use lapin::types::ShortString;

use super::{StreamEntry, read_entry};
use crate::contract::signature::StateKeys;

/// The kinds of cancel-stream entry, as the trust table sees them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// A cancel of every copy of an id (`cancel`).
    Cancel,
    /// A schedule's replacement (`schedule-replaced`).
    Replaced,
    /// A successor tombstone (`successors`).
    Successors,
    /// A catch-up marker or a clock entry (`sync`).
    Sync,
    /// A clamp of a cancel dated ahead (`clamp`).
    Clamp,
    /// A checkpoint's begin entry (`checkpoint`).
    CheckpointBegin,
    /// A checkpoint's part (`checkpoint-part`).
    CheckpointPart,
}

impl Kind {
    /// Every kind, in the order the wire contract lists them.
    pub const ALL: [Kind; 7] = [
        Kind::Cancel,
        Kind::Replaced,
        Kind::Successors,
        Kind::Sync,
        Kind::Clamp,
        Kind::CheckpointBegin,
        Kind::CheckpointPart,
    ];

    /// Its `delay-bridge-kind` value.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Cancel => super::KIND_CANCEL,
            Kind::Replaced => super::KIND_REPLACED,
            Kind::Successors => super::KIND_SUCCESSORS,
            Kind::Sync => super::KIND_SYNC,
            Kind::Clamp => super::KIND_CLAMP,
            Kind::CheckpointBegin => super::KIND_CHECKPOINT,
            Kind::CheckpointPart => super::KIND_CHECKPOINT_PART,
        }
    }
}

impl std::fmt::Display for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Who wrote an entry, as far as a reader can tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Writer {
    /// A bridge of this prefix (see the module's text for how it is told).
    Bridge,
    /// Anyone else who may write to the cancel exchange or stream.
    Other,
}

/// The trust table: whether an entry of `kind` written by `writer` is taken.
pub const fn taken(kind: Kind, writer: Writer) -> bool {
    matches!((kind, writer), (Kind::Cancel, _) | (_, Writer::Bridge))
}

/// How a reader tells a bridge's entries from anyone else's, and how a bridge marks its own.
#[derive(Debug, Clone)]
pub struct Authority {
    bridge_user: String,
    keys: Option<StateKeys>,
    accept_unsigned: bool,
}

impl Authority {
    /// Bridges connect as `bridge_user`; with `keys`, their entries are signed, and an
    /// unsigned one is taken only when `accept_unsigned`.
    pub fn new(
        bridge_user: impl Into<String>,
        keys: Option<StateKeys>,
        accept_unsigned: bool,
    ) -> Self {
        Self {
            bridge_user: bridge_user.into(),
            keys,
            accept_unsigned,
        }
    }

    /// The authority of a configuration: its broker user, state keys and
    /// `bridge.accept_unsigned_state`.
    pub fn of(config: &crate::config::Config) -> Self {
        Self::new(
            config.url().user(),
            config.state_keys.clone(),
            config.accept_unsigned_state,
        )
    }

    /// Who wrote the entry with `properties` and `body`.
    pub fn writer(&self, properties: &BasicProperties, body: &[u8]) -> Writer {
        let user = properties.user_id().as_ref().map(|u| u.as_str());
        if user != Some(self.bridge_user.as_str()) {
            return Writer::Other;
        }
        match &self.keys {
            None => Writer::Bridge,
            Some(keys) => match keys.verify(properties, body, self.accept_unsigned) {
                Ok(_) => Writer::Bridge,
                Err(_) => Writer::Other,
            },
        }
    }

    /// The entry with `properties` and `body` as a reader takes it: read, then
    /// [`StreamEntry::NotTaken`] when the table does not take its kind from its writer.
    /// A plain cancel is never checked (it is taken from anyone).
    pub fn read(&self, properties: &BasicProperties, body: &[u8]) -> StreamEntry {
        let entry = read_entry(properties);
        match entry.kind() {
            Some(kind) if !taken(kind, Writer::Other) => match self.writer(properties, body) {
                Writer::Bridge => entry,
                Writer::Other => StreamEntry::NotTaken(kind),
            },
            _ => entry,
        }
    }

    /// `properties` of an entry a bridge appends with `body`: its `user_id` the bridge's,
    /// signed when a state key is set.
    pub fn own(&self, properties: BasicProperties, body: &[u8]) -> BasicProperties {
        let properties = properties.with_user_id(ShortString::from(self.bridge_user.as_str()));
        match &self.keys {
            Some(keys) => keys.sign(properties, body),
            None => properties,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cancel::{
        Successors, checkpoint_begin_properties, message_id, successors_properties,
        tombstone_properties,
    };

    const KEY: &[u8] = b"0123456789abcdef0123";

    fn keyed(accept_unsigned: bool) -> Authority {
        Authority::new("bridge", StateKeys::new(KEY, None), accept_unsigned)
    }

    fn successors() -> BasicProperties {
        successors_properties(
            message_id("digest").unwrap(),
            &Successors {
                message_id: "digest".into(),
                target: Some("orders".into()),
                entered_at: 1,
                after_occurrence: 2,
                born_before: 3,
                due_at: 4,
            },
        )
    }

    #[test]
    fn only_a_cancel_is_taken_from_anyone() {
        for kind in Kind::ALL {
            assert!(taken(kind, Writer::Bridge), "{kind} from a bridge");
            assert_eq!(
                taken(kind, Writer::Other),
                kind == Kind::Cancel,
                "{kind} from another"
            );
        }
    }

    #[test]
    fn without_a_key_the_user_id_tells_a_bridge() {
        let authority = Authority::new("bridge", None, false);
        let theirs = successors().with_user_id("canceller".into());
        assert_eq!(
            authority.read(&theirs, b""),
            StreamEntry::NotTaken(Kind::Successors)
        );
        let ours = authority.own(successors(), b"");
        assert!(matches!(
            authority.read(&ours, b""),
            StreamEntry::Successors(_)
        ));
        let cancel = tombstone_properties(message_id("o").unwrap(), 5, None);
        assert!(matches!(
            authority.read(&cancel, b""),
            StreamEntry::Cancel(_)
        ));
    }

    #[test]
    fn with_a_key_the_bridges_user_id_alone_is_not_enough() {
        let authority = keyed(false);
        // What a canceller can publish over the stream protocol: the bridge's user_id.
        let forged = checkpoint_begin_properties("cp".into(), 9).with_user_id("bridge".into());
        assert_eq!(
            authority.read(&forged, b""),
            StreamEntry::NotTaken(Kind::CheckpointBegin)
        );
        let signed = authority.own(checkpoint_begin_properties("cp".into(), 9), b"");
        assert!(matches!(
            authority.read(&signed, b""),
            StreamEntry::CheckpointBegin { .. }
        ));
        // Signed for another body (a part's records changed): not taken.
        let part = authority.own(
            crate::cancel::checkpoint_part_properties("cp".into(), 1, 0, 1),
            b"[]",
        );
        assert!(matches!(
            authority.read(&part, b"[]"),
            StreamEntry::CheckpointPart { .. }
        ));
        assert_eq!(
            authority.read(&part, b"[{}]"),
            StreamEntry::NotTaken(Kind::CheckpointPart)
        );
        // Signed with another key.
        let other = Authority::new(
            "bridge",
            StateKeys::new(b"another key of 16+ bytes", None),
            false,
        );
        assert_eq!(
            authority.read(&other.own(successors(), b""), b""),
            StreamEntry::NotTaken(Kind::Successors)
        );
    }

    #[test]
    fn an_unsigned_entry_of_the_bridges_user_is_taken_only_while_unsigned_state_is_accepted() {
        let unsigned = successors().with_user_id("bridge".into());
        assert_eq!(
            keyed(false).read(&unsigned, b""),
            StreamEntry::NotTaken(Kind::Successors)
        );
        assert!(matches!(
            keyed(true).read(&unsigned, b""),
            StreamEntry::Successors(_)
        ));
        let tampered = {
            let mut p = keyed(true).own(successors(), b"");
            let mut headers = p.headers().clone().unwrap_or_default();
            headers.insert(
                crate::cancel::header::BORN_BEFORE.into(),
                lapin::types::AMQPValue::LongLongInt(99),
            );
            p = p.with_headers(headers);
            p
        };
        assert_eq!(
            keyed(true).read(&tampered, b""),
            StreamEntry::NotTaken(Kind::Successors),
            "a signature that does not match is never accepted"
        );
    }
}
