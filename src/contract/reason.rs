//! Why a message is parked: stable codes consumers may match on, and the human detail.

use std::fmt;

/// Why a message is parked. The code (`as_str`) is stable: consumers may match on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ParkReason {
    /// `x-delay` is not a number the plugin would read.
    BadDelay,
    /// `x-deliver-at` is neither epoch milliseconds nor RFC 3339.
    BadDeliverAt,
    /// `x-published-at` is not epoch milliseconds.
    BadPublishedAt,
    /// The delay is above the configured maximum.
    DelayTooLong,
    /// The message came through an exchange that is no route's ingress.
    UnknownRoute,
    /// The bridge's own headers are missing or malformed.
    BadState,
    /// The target is not an exchange any route allows.
    TargetNotAllowed,
    /// The target exchange took the message but no queue was bound for its routing key.
    Unroutable,
    /// The target exchange does not exist.
    TargetMissing,
    /// The message was redelivered more often than the work queue's delivery limit.
    RedeliveryLimit,
    /// The broker refused the publish to the target for a reason retrying does not fix
    /// (403: an `internal` exchange, or one the bridge's user may not write).
    TargetRefused,
    /// The broker refused the message for its size.
    TooLarge,
    /// The target's queue refused the message (nack, `reject-publish` overflow) for longer
    /// than `bridge.target_full_timeout`.
    TargetFull,
    /// The AMQP client cannot read the message: a short string (a header name, a property,
    /// the routing key) is not UTF-8. Parked with its properties as bytes; not replayable.
    Unreadable,
    /// A recurring schedule the bridge refuses (`x-repeat-*` headers): two rules, a bad
    /// interval or cron expression, an unknown time zone, no `message_id`, occurrences
    /// closer than the smallest level or further apart than `max_delay`, none at all.
    BadSchedule,
}

impl ParkReason {
    /// Every reason.
    pub const ALL: [ParkReason; 15] = [
        ParkReason::BadDelay,
        ParkReason::BadDeliverAt,
        ParkReason::BadPublishedAt,
        ParkReason::DelayTooLong,
        ParkReason::UnknownRoute,
        ParkReason::BadState,
        ParkReason::TargetNotAllowed,
        ParkReason::Unroutable,
        ParkReason::TargetMissing,
        ParkReason::RedeliveryLimit,
        ParkReason::TargetRefused,
        ParkReason::TooLarge,
        ParkReason::TargetFull,
        ParkReason::Unreadable,
        ParkReason::BadSchedule,
    ];

    /// The stable code written to `delay-bridge-reason`.
    pub fn as_str(self) -> &'static str {
        match self {
            ParkReason::BadDelay => "bad-delay",
            ParkReason::BadDeliverAt => "bad-deliver-at",
            ParkReason::BadPublishedAt => "bad-published-at",
            ParkReason::DelayTooLong => "delay-too-long",
            ParkReason::UnknownRoute => "unknown-route",
            ParkReason::BadState => "bad-state",
            ParkReason::TargetNotAllowed => "target-not-allowed",
            ParkReason::Unroutable => "unroutable",
            ParkReason::TargetMissing => "target-missing",
            ParkReason::RedeliveryLimit => "redelivery-limit",
            ParkReason::TargetRefused => "target-refused",
            ParkReason::TooLarge => "too-large",
            ParkReason::TargetFull => "target-full",
            ParkReason::Unreadable => "unreadable",
            ParkReason::BadSchedule => "bad-schedule",
        }
    }
}

impl fmt::Display for ParkReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A decision to park, with the human detail that goes with the code.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Parked {
    /// The stable reason.
    pub reason: ParkReason,
    /// What exactly was wrong, for a human.
    pub detail: String,
}

impl Parked {
    /// A decision to park for `reason`, with what exactly was wrong.
    pub fn new(reason: ParkReason, detail: impl Into<String>) -> Self {
        Self {
            reason,
            detail: detail.into(),
        }
    }
}
