//! The retry / blame / park policy of one publish, apart from I/O: given the broker's answer
//! to each attempt ([`Disposition`]), whether the publish is settled (routed, parked, given
//! back, or a new session is needed) or tried again, and whether on a private channel.
//! `Publishing::until_settled` (`carrier::publish`) publishes, sleeps between attempts and
//! counts; every decision is [`Settling::next`]'s.
//!
//! - routed: done;
//! - returned: a target parks it `unroutable`; the bridge's own queue missing means a new
//!   session (it redeclares);
//! - nacked: try again; a target that refuses longer than `bridge.target_full_timeout`
//!   parks it `target-full`;
//! - refused (403, 404, 406): every publish pending on the closed channel got the same
//!   error, so the [`Culprit`] decides whose it is ([`whose`]). Refused [`REFUSED_ATTEMPTS`]
//!   times for itself, a target parks it with the refusal's reason, and so does the
//!   bridge's own topology for `too-large` (anything else there is a configuration fault:
//!   a new session, logged). A refusal naming another message's size blames that one, but
//!   only [`REFUSED_ATTEMPTS`] times: then this message goes alone to be sure; so does one
//!   whose culprit is not known;
//! - lost (channel or connection gone or not opened, no confirm in time): try again, and
//!   after [`LOST_ATTEMPTS`] a new session.

use std::time::Duration;

use tokio::time::Instant;

use super::BridgeError;
use crate::amqp::disposition::{Culprit, Disposition, Refusal, Whose, whose};
use crate::contract::{ParkReason, Parked};

/// Refusals that were this message's (see [`Culprit`]) before it is parked; also how often
/// another message's size may be blamed before this one goes alone.
pub(super) const REFUSED_ATTEMPTS: u32 = 3;
/// Lost attempts tolerated for one publish before the session is renewed.
pub(super) const LOST_ATTEMPTS: u32 = 3;

/// Where a publish goes: one of the bridge's own queues (through the default exchange or the
/// bridge's exchanges, on the session's own channel) or a route's target exchange.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Destination<'a> {
    /// A level, the returns or parked queue, the cancel stream: named for logs.
    Own(&'a str),
    /// A target exchange.
    Target(&'a str),
}

/// How the broker settled a publish.
#[derive(Debug)]
pub(super) enum Settled {
    /// Routed: the message is where it belongs.
    Routed,
    /// It cannot go there: park it with this reason.
    Park(Parked),
}

/// What to do after an attempt.
#[derive(Debug)]
pub(super) enum Next {
    /// The publish is settled.
    Settle(Settled),
    /// Publish again after a pause (on a private channel when [`Settling::alone`] says so).
    Retry,
    /// Give up: a new session is needed (the delivery goes back to the broker).
    Fail(BridgeError),
}

/// The state of one publish between attempts.
#[derive(Debug)]
pub(super) struct Settling<'a> {
    destination: Destination<'a>,
    routing_key: &'a str,
    body_len: u64,
    target_full_timeout: Duration,
    lost: u32,
    refused: u32,
    blamed_others: u32,
    alone: bool,
    nacked_since: Option<Instant>,
}

impl<'a> Settling<'a> {
    /// A publish of a `body_len`-byte body with `routing_key` to `destination`; a target
    /// nacking it for `target_full_timeout` parks it.
    pub(super) fn new(
        destination: Destination<'a>,
        routing_key: &'a str,
        body_len: u64,
        target_full_timeout: Duration,
    ) -> Self {
        Self {
            destination,
            routing_key,
            body_len,
            target_full_timeout,
            lost: 0,
            refused: 0,
            blamed_others: 0,
            alone: false,
            nacked_since: None,
        }
    }

    /// True when the next attempt goes on a private channel (to learn whether a refusal is
    /// this message's).
    pub(super) fn alone(&self) -> bool {
        self.alone
    }

    /// What follows an attempt the broker answered with `disposition` at `now`.
    pub(super) fn next(&mut self, disposition: Disposition, now: Instant) -> Next {
        match disposition {
            Disposition::Routed => Next::Settle(Settled::Routed),
            Disposition::Returned { code, text } => self.returned(code, &text),
            Disposition::Nacked => {
                let since = *self.nacked_since.get_or_insert(now);
                match self.destination {
                    Destination::Target(target)
                        if now.saturating_duration_since(since) >= self.target_full_timeout =>
                    {
                        Next::Settle(Settled::Park(Parked::new(
                            ParkReason::TargetFull,
                            format!(
                                "target exchange `{target}` refused the message (nack) for {}",
                                crate::ladder::format_duration(self.target_full_timeout)
                            ),
                        )))
                    }
                    _ => Next::Retry,
                }
            }
            Disposition::Refused(refusal) => self.refused(refusal),
            Disposition::Lost(e) => {
                self.lost += 1;
                if self.lost > LOST_ATTEMPTS {
                    Next::Fail(BridgeError::publish("publishing")(e))
                } else {
                    Next::Retry
                }
            }
        }
    }

    /// A publish confirmed but routed to no queue.
    fn returned(&self, code: u16, text: &str) -> Next {
        match self.destination {
            Destination::Target(target) => Next::Settle(Settled::Park(Parked::new(
                ParkReason::Unroutable,
                format!(
                    "target exchange `{target}` routed routing key `{}` to no queue ({code} {text})",
                    self.routing_key
                ),
            ))),
            Destination::Own(what) => Next::Fail(BridgeError::OwnQueueMissing(format!(
                "{what} did not take a message ({code} {text}); redeclaring the topology"
            ))),
        }
    }

    /// A channel closed under the publish with a code that blames a message or its
    /// destination.
    fn refused(&mut self, refusal: Refusal) -> Next {
        let Refusal {
            reason,
            detail,
            culprit,
            ..
        } = refusal;
        let exchange_channel = matches!(self.destination, Destination::Target(_));
        match whose(culprit, exchange_channel, self.alone, self.body_len) {
            // A target refusing every publish alike needs no private channel; a message
            // refused for itself goes alone to be sure.
            Whose::Ours => {
                self.refused += 1;
                self.alone = culprit != Culprit::Destination || !exchange_channel;
            }
            // Another size blames another message, but only so often: should the broker
            // count a size otherwise, this one must still go alone.
            Whose::Others => {
                self.blamed_others += 1;
                self.alone = self.blamed_others >= REFUSED_ATTEMPTS;
            }
            Whose::Unknown => self.alone = true,
        }
        if self.refused < REFUSED_ATTEMPTS {
            return Next::Retry;
        }
        let detail = format!("refused {} times: {detail}", self.refused);
        match self.destination {
            Destination::Own(what) if reason != ParkReason::TooLarge => {
                tracing::error!("{what} refused a publish: {detail}");
                Next::Fail(BridgeError::OwnQueueMissing(format!(
                    "{what} refused a publish ({detail})"
                )))
            }
            _ => Next::Settle(Settled::Park(Parked::new(reason, detail))),
        }
    }
}

#[cfg(test)]
mod tests;
