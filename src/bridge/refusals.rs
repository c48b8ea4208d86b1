//! Target exchanges that refused a publish a moment ago (404 missing, 403 internal or
//! forbidden). Such a refusal closes the target's channel and fails every publish pending
//! on it, and it blames the target, not one message: each of those messages has its answer.
//! Remembering it for a moment lets thousands of messages due at once to a missing target
//! share one refusal instead of each asking the broker again on a channel of its own (which
//! ran the connection out of channels). Pure bookkeeping: the caller passes the time.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::amqp::disposition::Refusal;

/// How long a target's refusal stands for the messages that follow it.
pub(crate) const MEMORY: Duration = Duration::from_secs(1);

/// A target's latest refusal, and when it came.
#[derive(Debug, Clone)]
struct Latest {
    refusal: Refusal,
    at: Instant,
}

/// The latest refusal of each target that refused within [`MEMORY`].
#[derive(Debug, Default)]
pub(crate) struct TargetRefusals {
    by_target: HashMap<String, Latest>,
}

impl TargetRefusals {
    /// `target` refused a publish at `now` with `refusal`.
    pub(crate) fn refused(&mut self, target: &str, refusal: &Refusal, now: Instant) {
        self.by_target
            .retain(|_, latest| now.saturating_duration_since(latest.at) < MEMORY);
        self.by_target.insert(
            target.to_string(),
            Latest {
                refusal: refusal.clone(),
                at: now,
            },
        );
    }

    /// `target`'s refusal if it refused less than [`MEMORY`] before `now`.
    pub(crate) fn recent(&self, target: &str, now: Instant) -> Option<Refusal> {
        self.by_target
            .get(target)
            .filter(|latest| now.saturating_duration_since(latest.at) < MEMORY)
            .map(|latest| latest.refusal.clone())
    }

    /// `target` took a publish: whatever it refused before no longer stands.
    pub(crate) fn took(&mut self, target: &str) {
        self.by_target.remove(target);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::amqp::disposition::Culprit;
    use crate::contract::ParkReason;

    /// A refusal that blames the target, with the broker's `code` and words.
    fn refusal(reason: ParkReason, code: u16, detail: &str) -> Refusal {
        Refusal {
            reason,
            code,
            detail: detail.into(),
            culprit: Culprit::Destination,
        }
    }

    #[test]
    fn a_refusal_stands_for_its_target_only_and_only_for_a_moment() {
        let start = Instant::now();
        let mut refusals = TargetRefusals::default();
        let missing = refusal(ParkReason::TargetMissing, 404, "NOT_FOUND");
        refusals.refused("orders", &missing, start);
        assert_eq!(refusals.recent("orders", start + MEMORY / 2), Some(missing));
        assert_eq!(refusals.recent("payments", start), None);
        assert_eq!(refusals.recent("orders", start + MEMORY), None);
    }

    #[test]
    fn a_publish_the_target_took_ends_its_refusal() {
        let start = Instant::now();
        let mut refusals = TargetRefusals::default();
        refusals.refused(
            "orders",
            &refusal(ParkReason::TargetRefused, 403, "ACCESS_REFUSED"),
            start,
        );
        refusals.took("orders");
        assert_eq!(refusals.recent("orders", start), None);
    }

    #[test]
    fn old_refusals_are_forgotten_when_a_new_one_comes() {
        let start = Instant::now();
        let mut refusals = TargetRefusals::default();
        let missing = refusal(ParkReason::TargetMissing, 404, "");
        for i in 0..100 {
            refusals.refused(&format!("t{i}"), &missing, start);
        }
        refusals.refused("last", &missing, start + MEMORY);
        assert_eq!(refusals.by_target.len(), 1);
    }
}
