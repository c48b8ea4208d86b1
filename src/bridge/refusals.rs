//! Target exchanges that refused a publish a moment ago (404 missing, 403 internal or
//! forbidden). Such a refusal closes the target's channel and fails every publish pending
//! on it, and it blames the target, not one message: each of those messages has its answer.
//! Remembering it for a moment lets thousands of messages due at once to a missing target
//! share one refusal instead of each asking the broker again on a channel of its own (which
//! ran the connection out of channels). Pure bookkeeping: the caller passes the time.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::contract::ParkReason;

/// How long a target's refusal stands for the messages that follow it.
pub(crate) const MEMORY: Duration = Duration::from_secs(1);

/// A target's latest refusal.
#[derive(Debug, Clone)]
struct Refusal {
    reason: ParkReason,
    detail: String,
    at: Instant,
}

/// The latest refusal of each target that refused within [`MEMORY`].
#[derive(Debug, Default)]
pub(crate) struct TargetRefusals {
    by_target: HashMap<String, Refusal>,
}

impl TargetRefusals {
    /// `target` refused a publish at `now` for `reason`, in the broker's words `detail`.
    pub(crate) fn refused(&mut self, target: &str, reason: ParkReason, detail: &str, now: Instant) {
        self.by_target
            .retain(|_, refusal| now.saturating_duration_since(refusal.at) < MEMORY);
        self.by_target.insert(
            target.to_string(),
            Refusal {
                reason,
                detail: detail.to_string(),
                at: now,
            },
        );
    }

    /// `target`'s refusal if it refused less than [`MEMORY`] before `now`: the reason and
    /// the broker's words.
    pub(crate) fn recent(&self, target: &str, now: Instant) -> Option<(ParkReason, String)> {
        self.by_target
            .get(target)
            .filter(|refusal| now.saturating_duration_since(refusal.at) < MEMORY)
            .map(|refusal| (refusal.reason, refusal.detail.clone()))
    }

    /// `target` took a publish: whatever it refused before no longer stands.
    pub(crate) fn took(&mut self, target: &str) {
        self.by_target.remove(target);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_stands_for_its_target_only_and_only_for_a_moment() {
        let start = Instant::now();
        let mut refusals = TargetRefusals::default();
        refusals.refused("orders", ParkReason::TargetMissing, "NOT_FOUND", start);
        assert_eq!(
            refusals.recent("orders", start + MEMORY / 2),
            Some((ParkReason::TargetMissing, "NOT_FOUND".to_string()))
        );
        assert_eq!(refusals.recent("payments", start), None);
        assert_eq!(refusals.recent("orders", start + MEMORY), None);
    }

    #[test]
    fn a_publish_the_target_took_ends_its_refusal() {
        let start = Instant::now();
        let mut refusals = TargetRefusals::default();
        refusals.refused("orders", ParkReason::TargetRefused, "ACCESS_REFUSED", start);
        refusals.took("orders");
        assert_eq!(refusals.recent("orders", start), None);
    }

    #[test]
    fn old_refusals_are_forgotten_when_a_new_one_comes() {
        let start = Instant::now();
        let mut refusals = TargetRefusals::default();
        for i in 0..100 {
            refusals.refused(&format!("t{i}"), ParkReason::TargetMissing, "", start);
        }
        refusals.refused("last", ParkReason::TargetMissing, "", start + MEMORY);
        assert_eq!(refusals.by_target.len(), 1);
    }
}
