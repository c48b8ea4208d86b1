//! What one publish attempt's result means for the message it carried, decided in one place.

use super::Published;
use super::publisher::PublishError;
use crate::contract::ParkReason;

/// The meaning of one confirmed, mandatory publish attempt.
#[derive(Debug)]
pub enum Verdict {
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
    /// Every publish pending on that channel gets the same error, so it is this message's
    /// fault only when it is refused while publishing alone.
    Refused {
        /// Why the message is parked if the refusal persists.
        reason: ParkReason,
        /// The broker's words.
        detail: String,
        /// What the refusal blames, as far as the broker's words tell.
        culprit: Culprit,
    },
    /// The channel or connection is gone, or no confirm came in time: try again on a new
    /// channel; when that keeps failing, reconnect.
    Lost(PublishError),
}

/// What a refusal that closed a channel blames. Every publish pending on that channel gets
/// the same error, so this says which of them the broker meant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Culprit {
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
pub enum Whose {
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
pub fn whose(culprit: Culprit, exchange_channel: bool, alone: bool, body_len: u64) -> Whose {
    match culprit {
        _ if alone => Whose::Ours,
        Culprit::Destination if exchange_channel => Whose::Ours,
        Culprit::SizeOf(size) if size == body_len => Whose::Ours,
        Culprit::SizeOf(_) => Whose::Others,
        Culprit::Destination | Culprit::SomeMessage => Whose::Unknown,
    }
}

/// Classifies a publish attempt.
pub fn verdict(result: Result<Published, PublishError>) -> Verdict {
    match result {
        Ok(Published::Routed) => Verdict::Routed,
        Ok(Published::Returned { code, text }) => Verdict::Returned { code, text },
        Ok(Published::Nacked) => Verdict::Nacked,
        Err(PublishError::Broker(e)) => {
            let refused = match (e.reply_code(), e.reply_text()) {
                (Some(code), Some(text)) => {
                    refusal(code, text).map(|reason| (reason, culprit(code, text)))
                }
                _ => None,
            };
            match refused {
                Some((reason, culprit)) => Verdict::Refused {
                    reason,
                    detail: e.to_string(),
                    culprit,
                },
                None => Verdict::Lost(PublishError::Broker(e)),
            }
        }
        Err(timeout @ PublishError::ConfirmTimeout(_)) => Verdict::Lost(timeout),
    }
}

/// The park reason for a channel closed with `code` and `text`, when that code blames the
/// message or its destination; `None` for codes that mean the channel or connection failed.
pub fn refusal(code: u16, text: &str) -> Option<ParkReason> {
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
pub fn culprit(code: u16, text: &str) -> Culprit {
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
    fn confirms_map_to_their_verdicts() {
        assert!(matches!(verdict(Ok(Published::Routed)), Verdict::Routed));
        assert!(matches!(verdict(Ok(Published::Nacked)), Verdict::Nacked));
        assert!(matches!(
            verdict(Ok(Published::Returned {
                code: 312,
                text: "NO_ROUTE".into()
            })),
            Verdict::Returned { code: 312, .. }
        ));
        assert!(matches!(
            verdict(Err(PublishError::ConfirmTimeout(
                std::time::Duration::from_secs(1)
            ))),
            Verdict::Lost(PublishError::ConfirmTimeout(_))
        ));
    }
}
