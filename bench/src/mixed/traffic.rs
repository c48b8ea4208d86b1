//! What the `mixed` soak sends, as pure code: which sequence number is which kind of
//! message, and what should become of each.
//!
//! Sequence numbers `0..steady` are the steady flow; among them, by `seq % 1000`, 1 % are
//! cancelled, 0.5 % rescheduled and 0.5 % unroutable (so every minute has some of each).
//! Then come the large bodies, then the bursts, one block of `burst_size` each. A plain
//! layout (for the archived plugin, which can neither cancel nor park) has only small
//! messages in its steady flow.

/// What a message is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A small message of the steady flow: delivered once, on time.
    Small,
    /// Cancelled a moment after it is published: never delivered.
    Cancelled,
    /// Rescheduled (cancel, then the same id again, later) a moment after it is published:
    /// delivered once, at its new time.
    Rescheduled,
    /// Its routing key reaches no queue at the target: parked `unroutable`.
    Unroutable,
    /// A body of several MiB: delivered once.
    Large,
    /// One of a burst due at one instant: delivered once.
    Burst,
}

impl Kind {
    /// True when the message should reach the target queue.
    pub fn is_delivered(self) -> bool {
        !matches!(self, Kind::Cancelled | Kind::Unroutable)
    }
}

/// How the soak's sequence numbers are laid out.
#[derive(Debug, Clone, Copy)]
pub struct Layout {
    /// Messages of the steady flow.
    pub steady: u64,
    /// Large bodies.
    pub large: u64,
    /// Bursts.
    pub bursts: u64,
    /// Messages per burst.
    pub burst_size: u64,
    /// No cancels, reschedules or unroutable messages: every message of the steady flow is
    /// small (what the archived plugin can carry).
    pub plain: bool,
}

impl Layout {
    /// Every sequence number in use: `0..total`.
    pub fn total(&self) -> u64 {
        self.steady + self.large + self.bursts * self.burst_size
    }

    /// The kind of message `seq`.
    pub fn kind(&self, seq: u64) -> Kind {
        if seq < self.steady && self.plain {
            Kind::Small
        } else if seq < self.steady {
            match seq % 1000 {
                0..10 => Kind::Cancelled,
                10..15 => Kind::Rescheduled,
                15..20 => Kind::Unroutable,
                _ => Kind::Small,
            }
        } else if seq < self.steady + self.large {
            Kind::Large
        } else {
            Kind::Burst
        }
    }

    /// The sequence number of large body `i`.
    pub fn large_seq(&self, i: u64) -> u64 {
        self.steady + i
    }

    /// The sequence numbers of burst `i`.
    pub fn burst_seqs(&self, i: u64) -> std::ops::Range<u64> {
        let first = self.steady + self.large + i * self.burst_size;
        first..first + self.burst_size
    }
}

/// The message id of `seq` (cancels and reschedules name it).
pub fn message_id(seq: u64) -> String {
    format!("mixed-{seq}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_take_their_shares_and_blocks_follow_each_other() {
        let layout = Layout {
            steady: 10_000,
            large: 3,
            bursts: 2,
            burst_size: 100,
            plain: false,
        };
        let count = |kind| {
            (0..layout.steady)
                .filter(|s| layout.kind(*s) == kind)
                .count()
        };
        assert_eq!(count(Kind::Cancelled), 100);
        assert_eq!(count(Kind::Rescheduled), 50);
        assert_eq!(count(Kind::Unroutable), 50);
        assert_eq!(layout.kind(layout.large_seq(2)), Kind::Large);
        assert_eq!(layout.burst_seqs(0), 10_003..10_103);
        assert_eq!(layout.burst_seqs(1).end, layout.total());
        assert_eq!(layout.kind(layout.total() - 1), Kind::Burst);
    }

    #[test]
    fn a_plain_layout_has_only_small_messages_in_its_steady_flow() {
        let layout = Layout {
            steady: 10_000,
            large: 3,
            bursts: 2,
            burst_size: 100,
            plain: true,
        };
        assert!((0..layout.steady).all(|s| layout.kind(s) == Kind::Small));
        assert_eq!(layout.kind(layout.large_seq(0)), Kind::Large);
        assert_eq!(layout.kind(layout.total() - 1), Kind::Burst);
    }
}
