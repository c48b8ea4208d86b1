//! Which parked messages an operation takes, and what a replayed one is published with.
//! Pure: the time is a parameter.

use std::collections::BTreeMap;
use std::time::Duration;

use lapin::BasicProperties;
use lapin::types::{FieldTable, ShortString};

use super::ParkedMessage;
use crate::contract::header;

/// A selection of parked messages: every condition set must hold.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Filter {
    /// Its reason code (`none` selects messages without one).
    pub reason: Option<String>,
    /// The target exchange it was bound for.
    pub target: Option<String>,
    /// Its `message_id`.
    pub message_id: Option<String>,
    /// Parked at least this long ago (a message parked by a version that did not record
    /// the time never matches).
    pub older_than: Option<Duration>,
}

impl Filter {
    /// True when no condition is set: every message matches.
    pub fn is_empty(&self) -> bool {
        self == &Filter::default()
    }

    /// Whether `message` is selected at `now_ms`.
    pub fn matches(&self, message: &ParkedMessage, now_ms: u64) -> bool {
        let reason = message.reason.as_deref().unwrap_or("none");
        self.reason.as_deref().is_none_or(|r| r == reason)
            && self
                .target
                .as_deref()
                .is_none_or(|t| message.target.as_deref() == Some(t))
            && self
                .message_id
                .as_deref()
                .is_none_or(|id| message.message_id.as_deref() == Some(id))
            && self.older_than.is_none_or(|age| {
                message
                    .parked_at
                    .is_some_and(|at| now_ms.saturating_sub(at) >= age.as_millis() as u64)
            })
    }
}

/// The properties a parked message is replayed with: as parked, without the parking
/// headers. It goes back through the work exchange carrying the bridge's state (its due
/// time is past), so a bridge delivers it to its target as it delivers any message, or
/// parks it again with the reason of the day.
pub fn replay_properties(parked: &BasicProperties) -> BasicProperties {
    let mut properties = parked.clone();
    if let Some(headers) = parked.headers() {
        let kept: BTreeMap<ShortString, _> = headers
            .inner()
            .iter()
            .filter(|(name, _)| {
                ![header::REASON, header::DETAIL, header::PARKED_AT].contains(&name.as_str())
            })
            .map(|(name, value)| (name.clone(), value.clone()))
            .collect();
        properties = properties.with_headers(FieldTable::from(kept));
    }
    properties
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::types::AMQPValue;

    const NOW: u64 = 1_800_000_000_000;

    fn message(
        reason: Option<&str>,
        target: Option<&str>,
        parked_at: Option<u64>,
    ) -> ParkedMessage {
        ParkedMessage {
            reason: reason.map(Into::into),
            detail: None,
            routing_key: "rk".into(),
            target: target.map(Into::into),
            message_id: Some("m-1".into()),
            parked_at,
            replayable: target.is_some(),
            body_bytes: 1,
        }
    }

    #[test]
    fn every_condition_set_must_hold() {
        let m = message(Some("unroutable"), Some("orders"), Some(NOW - 60_000));
        assert!(Filter::default().matches(&m, NOW));
        let reason = |r: &str| Filter {
            reason: Some(r.into()),
            ..Filter::default()
        };
        assert!(reason("unroutable").matches(&m, NOW));
        assert!(!reason("target-missing").matches(&m, NOW));
        assert!(reason("none").matches(&message(None, None, None), NOW));
        let target = Filter {
            target: Some("orders".into()),
            message_id: Some("m-1".into()),
            ..Filter::default()
        };
        assert!(target.matches(&m, NOW));
        assert!(!target.matches(&message(Some("unroutable"), None, None), NOW));
        let aged = |secs| Filter {
            older_than: Some(Duration::from_secs(secs)),
            ..Filter::default()
        };
        assert!(aged(60).matches(&m, NOW));
        assert!(!aged(61).matches(&m, NOW));
        assert!(
            !aged(1).matches(&message(Some("unroutable"), None, None), NOW),
            "no parking time: no age"
        );
        assert!(!aged(1).is_empty() && Filter::default().is_empty());
    }

    #[test]
    fn a_replayed_message_loses_the_parking_headers_only() {
        let mut headers = FieldTable::default();
        for name in [header::REASON, header::DETAIL, header::STATE_TARGET, "app"] {
            headers.insert(name.into(), AMQPValue::LongString("x".into()));
        }
        headers.insert(header::PARKED_AT.into(), AMQPValue::LongLongInt(NOW as i64));
        let parked = BasicProperties::default()
            .with_headers(headers)
            .with_message_id("m-1".into());
        let replayed = replay_properties(&parked);
        let names: Vec<&str> = replayed
            .headers()
            .as_ref()
            .unwrap()
            .inner()
            .keys()
            .map(|k| k.as_str())
            .collect();
        assert_eq!(names, ["app", header::STATE_TARGET]);
        assert_eq!(replayed.message_id(), parked.message_id());
    }
}
