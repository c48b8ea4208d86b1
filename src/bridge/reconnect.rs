//! How long to wait before reconnecting, as pure bookkeeping: a session that worked (it got
//! as far as consuming) makes its loss news, most likely a cut connection, so the bridge
//! reconnects at once and the backoff starts over; losses in a row back off from
//! [`MIN_PAUSE`], doubling with jitter, up to [`MAX_PAUSE`].

use std::time::Duration;

/// The first pause after a failed reconnect.
pub(crate) const MIN_PAUSE: Duration = Duration::from_millis(200);
/// The longest pause between reconnects (jitter adds up to as much again): a broker that
/// comes back after an outage is served again within seconds, while a connection attempt
/// every few seconds costs a down broker nothing.
pub(crate) const MAX_PAUSE: Duration = Duration::from_secs(5);

/// The pauses between reconnects.
pub(crate) struct Reconnects {
    delays: Box<dyn Iterator<Item = Duration> + Send>,
}

impl Default for Reconnects {
    fn default() -> Self {
        Self {
            delays: Box::new(super::backoff(MIN_PAUSE, MAX_PAUSE)),
        }
    }
}

impl Reconnects {
    /// A session ended with an error: the pause before the next attempt. `worked` is true
    /// when that session had been consuming.
    pub(crate) fn pause_after_loss(&mut self, worked: bool) -> Duration {
        if worked {
            *self = Self::default();
            return Duration::ZERO;
        }
        self.delays.next().unwrap_or(MAX_PAUSE)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lost_session_that_worked_reconnects_at_once_and_the_backoff_starts_over() {
        let mut reconnects = Reconnects::default();
        assert_eq!(reconnects.pause_after_loss(true), Duration::ZERO);
        let failing: Vec<Duration> = (0..12)
            .map(|_| reconnects.pause_after_loss(false))
            .collect();
        assert!(
            failing[0] >= MIN_PAUSE && failing[0] < 2 * MIN_PAUSE,
            "{failing:?}"
        );
        assert!(failing.iter().all(|d| *d <= 2 * MAX_PAUSE), "{failing:?}");
        assert!(
            failing[11] >= MAX_PAUSE,
            "backs off to the longest pause: {failing:?}"
        );
        // A broker back after a long outage is tried again within 10 s.
        assert!(
            failing.iter().all(|d| *d <= Duration::from_secs(10)),
            "{failing:?}"
        );
        // It worked again: at once, then from the shortest pause.
        assert_eq!(reconnects.pause_after_loss(true), Duration::ZERO);
        let next = reconnects.pause_after_loss(false);
        assert!(next >= MIN_PAUSE && next < 2 * MIN_PAUSE, "{next:?}");
    }
}
