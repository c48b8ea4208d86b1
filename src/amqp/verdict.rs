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
    },
    /// The channel or connection is gone, or no confirm came in time: try again on a new
    /// channel; when that keeps failing, reconnect.
    Lost(PublishError),
}

/// Classifies a publish attempt.
pub fn verdict(result: Result<Published, PublishError>) -> Verdict {
    match result {
        Ok(Published::Routed) => Verdict::Routed,
        Ok(Published::Returned { code, text }) => Verdict::Returned { code, text },
        Ok(Published::Nacked) => Verdict::Nacked,
        Err(PublishError::Broker(e)) => {
            let refused = match e.kind() {
                lapin::ErrorKind::ProtocolError(amqp) => {
                    refusal(amqp.get_id(), amqp.get_message().as_str())
                }
                _ => None,
            };
            match refused {
                Some(reason) => Verdict::Refused {
                    reason,
                    detail: e.to_string(),
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
