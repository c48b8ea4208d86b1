//! What became of one confirmed, mandatory publish, decided in one place: every publisher
//! (the carrier, the typed client, the cancel follower, parked replay) gets a
//! [`Disposition`] from [`Publisher::publish`](super::publisher::Publisher::publish) and
//! acts on it, none reads the broker's confirms, returns or channel errors itself.

use super::publisher::PublishError;
use super::returns::Return;
use super::wire::{Confirm, WireError};
use crate::contract::ParkReason;

/// What became of one confirmed, mandatory publish.
#[derive(Debug)]
pub(crate) enum Disposition {
    /// Confirmed and routed: the message is where it belongs.
    Routed,
    /// Confirmed, but no queue took it (312 NO_ROUTE).
    Returned {
        /// The broker's reply code.
        code: u16,
        /// The broker's reply text.
        text: String,
    },
    /// The broker refused it (nack, for example `reject-publish` overflow): back off and
    /// try again.
    Nacked,
    /// The broker closed the channel with a code that blames a message or its destination.
    Refused(Refusal),
    /// The channel or connection is gone, or no confirm came in time: try again on a new
    /// channel; when that keeps failing, reconnect.
    Lost(PublishError),
}

/// A channel the broker closed with a code that blames a message or its destination
/// (403, 404, 406). Every publish pending on that channel gets the same refusal, so it is
/// this message's fault only as far as [`whose`] tells.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Refusal {
    /// Why the message is parked if the refusal persists.
    pub reason: ParkReason,
    /// The broker's reply code.
    pub code: u16,
    /// The broker's words.
    pub detail: String,
    /// What the refusal blames, as far as the broker's words tell.
    pub culprit: Culprit,
}

impl Disposition {
    /// A publish the broker confirmed (`confirm`) and perhaps returned (`ret`).
    pub(crate) fn confirmed(confirm: Confirm, ret: Option<Return>) -> Self {
        match (confirm, ret) {
            (Confirm::Ack, None) => Self::Routed,
            (Confirm::Ack, Some(Return { code, text })) => Self::Returned { code, text },
            (Confirm::Nack, _) => Self::Nacked,
        }
    }

    /// A publish that got no confirm: a refusal when the broker's code blames the message
    /// or its destination, otherwise lost.
    pub(crate) fn of_error(error: PublishError) -> Self {
        match &error {
            PublishError::Broker(e) => Refusal::of(e).map_or(Self::Lost(error), Self::Refused),
            PublishError::ConfirmTimeout(_) => Self::Lost(error),
        }
    }
}

impl Refusal {
    /// The refusal `error` is when the broker closed a channel with a code that blames a
    /// message or its destination; `None` for any other failure.
    pub(crate) fn of(error: &WireError) -> Option<Self> {
        let (code, text) = (error.reply_code()?, error.reply_text()?);
        Some(Self {
            reason: refusal(code, text)?,
            code,
            culprit: culprit(code, text),
            detail: error.to_string(),
        })
    }
}

/// What a refusal that closed a channel blames. Every publish pending on that channel gets
/// the same error, so this says which of them the broker meant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Culprit {
    /// The exchange published to (404 missing, 403 internal or forbidden): every publish to
    /// it is refused alike.
    Destination,
    /// The message whose body is this many bytes (406, over `max_message_size`).
    SizeOf(u64),
    /// One message on the channel, which one the broker does not say (any other 406).
    SomeMessage,
}

/// Whose a refusal is, as far as one message can tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Whose {
    /// This message's: it counts towards parking it.
    Ours,
    /// Another message's (another size was named): publish again.
    Others,
    /// Not known: only a publish on a private channel tells.
    Unknown,
}

/// Whose a refusal blaming `culprit` is for a message with a `body_len`-byte body,
/// published `alone` on a private channel or on a channel shared by every publish to the
/// same `exchange_channel` (a target's own channel: its publishes all go to one exchange).
pub(crate) fn whose(culprit: Culprit, exchange_channel: bool, alone: bool, body_len: u64) -> Whose {
    match culprit {
        _ if alone => Whose::Ours,
        Culprit::Destination if exchange_channel => Whose::Ours,
        Culprit::SizeOf(size) if size == body_len => Whose::Ours,
        Culprit::SizeOf(_) => Whose::Others,
        Culprit::Destination | Culprit::SomeMessage => Whose::Unknown,
    }
}

/// The park reason for a channel closed with `code` and `text`, when that code blames the
/// message or its destination; `None` for codes that mean the channel or connection failed.
pub(crate) fn refusal(code: u16, text: &str) -> Option<ParkReason> {
    match code {
        // ACCESS_REFUSED: an internal exchange, or no write permission.
        403 => Some(ParkReason::TargetRefused),
        // NOT_FOUND: the exchange does not exist.
        404 => Some(ParkReason::TargetMissing),
        // PRECONDITION_FAILED: "message size ... is larger than configured max size".
        406 if text.contains("max size") || text.contains("larger than") => {
            Some(ParkReason::TooLarge)
        }
        // Any other precondition the message fails (an invalid expiration, ...).
        406 => Some(ParkReason::TargetRefused),
        _ => None,
    }
}

/// What a refusal with `code` and `text` blames (see [`Culprit`]).
pub(crate) fn culprit(code: u16, text: &str) -> Culprit {
    match code {
        403 | 404 => Culprit::Destination,
        // "PRECONDITION_FAILED - message size 4096 is larger than configured max size 1024"
        406 => text
            .split("message size ")
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|size| size.parse().ok())
            .map_or(Culprit::SomeMessage, Culprit::SizeOf),
        _ => Culprit::SomeMessage,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_that_blame_the_message_or_target_have_a_park_reason() {
        let cases = [
            (
                403,
                "ACCESS_REFUSED - cannot publish to internal exchange 'x'",
                Some(ParkReason::TargetRefused),
            ),
            (
                403,
                "ACCESS_REFUSED - access to exchange 'x' refused for user 'u'",
                Some(ParkReason::TargetRefused),
            ),
            (
                404,
                "NOT_FOUND - no exchange 'x'",
                Some(ParkReason::TargetMissing),
            ),
            (
                406,
                "PRECONDITION_FAILED - message size 4096 is larger than configured max size 1024",
                Some(ParkReason::TooLarge),
            ),
            (
                406,
                "PRECONDITION_FAILED - invalid expiration",
                Some(ParkReason::TargetRefused),
            ),
            (
                320,
                "CONNECTION_FORCED - closed via management plugin",
                None,
            ),
            (501, "FRAME_ERROR", None),
            (541, "INTERNAL_ERROR", None),
        ];
        for (code, text, expected) in cases {
            assert_eq!(refusal(code, text), expected, "{code} {text}");
        }
    }

    #[test]
    fn a_refusal_blames_the_destination_the_message_of_a_size_or_some_message() {
        let cases = [
            (
                404,
                "NOT_FOUND - no exchange 'x' in vhost '/'",
                Culprit::Destination,
            ),
            (
                403,
                "ACCESS_REFUSED - cannot publish to internal exchange 'x'",
                Culprit::Destination,
            ),
            (
                406,
                "PRECONDITION_FAILED - message size 4096 is larger than configured max size 1024",
                Culprit::SizeOf(4096),
            ),
            (
                406,
                "PRECONDITION_FAILED - message size lots is larger than configured max size 1",
                Culprit::SomeMessage,
            ),
            (
                406,
                "PRECONDITION_FAILED - invalid expiration",
                Culprit::SomeMessage,
            ),
        ];
        for (code, text, expected) in cases {
            assert_eq!(culprit(code, text), expected, "{code} {text}");
        }
    }

    #[test]
    fn a_refusal_is_ours_alone_for_our_target_or_at_our_size() {
        use Culprit::*;
        let cases = [
            // (culprit, exchange channel, alone, body length, whose)
            (SomeMessage, true, true, 10, Whose::Ours),
            (SizeOf(99), false, true, 10, Whose::Ours),
            (Destination, true, false, 10, Whose::Ours),
            (Destination, false, false, 10, Whose::Unknown),
            (SizeOf(10), false, false, 10, Whose::Ours),
            (SizeOf(99), true, false, 10, Whose::Others),
            (SomeMessage, true, false, 10, Whose::Unknown),
        ];
        for (culprit, exchange_channel, alone, len, expected) in cases {
            assert_eq!(
                whose(culprit, exchange_channel, alone, len),
                expected,
                "{culprit:?} exchange channel {exchange_channel} alone {alone} len {len}"
            );
        }
    }

    #[test]
    fn confirms_and_returns_map_to_their_dispositions() {
        let returned = || Return {
            code: 312,
            text: "NO_ROUTE".into(),
        };
        assert!(matches!(
            Disposition::confirmed(Confirm::Ack, None),
            Disposition::Routed
        ));
        assert!(matches!(
            Disposition::confirmed(Confirm::Ack, Some(returned())),
            Disposition::Returned { code: 312, .. }
        ));
        assert!(matches!(
            Disposition::confirmed(Confirm::Nack, None),
            Disposition::Nacked
        ));
        assert!(matches!(
            Disposition::confirmed(Confirm::Nack, Some(returned())),
            Disposition::Nacked
        ));
    }

    #[test]
    fn a_closed_channel_is_a_refusal_only_when_its_code_blames_the_message_or_target() {
        let closed = |code: u16, text: &str| {
            Disposition::of_error(PublishError::Broker(WireError::Closed {
                what: "channel",
                code,
                text: text.into(),
            }))
        };
        match closed(404, "NOT_FOUND - no exchange 'x' in vhost '/'") {
            Disposition::Refused(refusal) => {
                assert_eq!(refusal.reason, ParkReason::TargetMissing);
                assert_eq!(refusal.code, 404);
                assert_eq!(refusal.culprit, Culprit::Destination);
                assert!(refusal.detail.contains("no exchange 'x'"), "{refusal:?}");
            }
            other => panic!("404: {other:?}"),
        }
        match closed(
            406,
            "PRECONDITION_FAILED - message size 9 is larger than configured max size 1",
        ) {
            Disposition::Refused(refusal) => {
                assert_eq!(refusal.reason, ParkReason::TooLarge);
                assert_eq!(refusal.culprit, Culprit::SizeOf(9));
            }
            other => panic!("406: {other:?}"),
        }
        assert!(matches!(
            closed(320, "CONNECTION_FORCED - closed via management plugin"),
            Disposition::Lost(PublishError::Broker(_))
        ));
        assert!(matches!(
            Disposition::of_error(PublishError::Broker(WireError::ChannelClosed)),
            Disposition::Lost(PublishError::Broker(WireError::ChannelClosed))
        ));
        assert!(matches!(
            Disposition::of_error(PublishError::ConfirmTimeout(
                std::time::Duration::from_secs(1)
            )),
            Disposition::Lost(PublishError::ConfirmTimeout(_))
        ));
    }
}
