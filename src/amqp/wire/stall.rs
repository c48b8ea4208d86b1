//! A broker that stops answering while something waits on it (a stopped or paused VM, a
//! long garbage collection, an overloaded node): told apart from a broker that is merely
//! idle, so that the operator hears of it once, and so that a publish waiting for its
//! confirm is not sent again while the broker holds it (it would arrive twice when the
//! broker wakes up). Pure: the caller says how long the broker has been silent and whether
//! anything waits on it.

use std::time::Duration;

/// A broker silent for this long while publishes or calls wait on it is reported stalled.
pub const WARN_AFTER: Duration = Duration::from_secs(10);

/// What to tell the operator about the broker's silence now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum News {
    /// It has stopped answering what waits on it: warn, once.
    Stalled(Duration),
    /// It answers again after it was reported stalled.
    Answering,
}

/// Whether the broker's silence is news: `silent` is how long it has sent nothing,
/// `awaited` whether a publish or a call waits on it, `reported` whether it is reported
/// stalled already.
pub fn news(silent: Duration, awaited: bool, reported: bool) -> Option<News> {
    let stalled = awaited && silent >= WARN_AFTER;
    match (stalled, reported) {
        (true, false) => Some(News::Stalled(silent)),
        (false, true) if silent < WARN_AFTER => Some(News::Answering),
        _ => None,
    }
}

/// Whether a publish whose confirm deadline of `deadline` just passed should wait on:
/// the broker has said nothing at all for at least half of it, so it is stalled rather
/// than losing this confirm. A dead peer is the heartbeat's to find (two intervals).
pub fn wait_on(silent: Duration, deadline: Duration) -> bool {
    silent >= deadline / 2
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn an_idle_broker_is_no_news_however_long_it_is_silent() {
        assert_eq!(news(60 * S, false, false), None);
    }

    #[test]
    fn a_stall_is_told_once_and_its_end_once() {
        assert_eq!(news(9 * S, true, false), None);
        assert_eq!(news(10 * S, true, false), Some(News::Stalled(10 * S)));
        assert_eq!(news(30 * S, true, true), None, "once");
        assert_eq!(news(Duration::ZERO, true, true), Some(News::Answering));
        assert_eq!(news(Duration::ZERO, false, false), None);
    }

    #[test]
    fn a_publish_waits_on_only_when_the_broker_is_silent() {
        assert!(wait_on(15 * S, 30 * S));
        assert!(!wait_on(14 * S, 30 * S), "the broker answers other things");
        assert!(!wait_on(Duration::ZERO, 30 * S));
    }
}
