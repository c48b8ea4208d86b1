//! When a stream reader's connection keeps failing at one offset, pure: retry, probe the
//! entry there, or give up.
//!
//! An entry the broker cannot convert for an AMQP 0-9-1 reader (a stream-protocol publish
//! with no body, on RabbitMQ 3.10) closes the reader's whole connection (541
//! INTERNAL_ERROR) each time the broker sends it, at whatever offset the reader attaches
//! before it. Nothing can be removed from a stream, so a reader that only retried would
//! retry forever. [`Stalls`] counts the failures at one position: after
//! [`PROBE_AFTER`] failures with nothing read, the caller probes the entry at that offset
//! alone (a consumer with a window of one, on a connection of its own); when the probe's
//! connection fails too, the entry is poison and is skipped. After [`GIVE_UP_AFTER`]
//! failures at one position the caller gives up (the broker is gone, or the stream).

/// Failures at one offset, with nothing read between, before the entry there is probed.
pub(crate) const PROBE_AFTER: u32 = 2;

/// Failures at one position, with nothing read between, before the reader gives up.
pub(crate) const GIVE_UP_AFTER: u32 = 5;

/// What to do after a failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Next {
    /// Attach again at the same position (after a pause).
    Retry,
    /// Probe the entry at this offset alone.
    Probe(u64),
    /// Stop trying: the failure is the caller's.
    GiveUp,
}

/// The failures at the reader's current position.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Stalls {
    /// The position failed at (`None`: a position without an offset, the stream's first
    /// or last entry) and how often in a row.
    at: Option<Option<u64>>,
    failures: u32,
    /// Whether the entry at the position was probed and found readable.
    probed: bool,
}

impl Stalls {
    /// The reader read an entry: its position moved on.
    pub(crate) fn read(&mut self) {
        *self = Self::default();
    }

    /// The reader's connection or channel failed at `offset` (the next entry's, when
    /// known) with nothing read since the last failure there.
    pub(crate) fn failed(&mut self, offset: Option<u64>) -> Next {
        if self.at == Some(offset) {
            self.failures += 1;
        } else {
            *self = Self {
                at: Some(offset),
                failures: 1,
                probed: false,
            };
        }
        match offset {
            _ if self.failures >= GIVE_UP_AFTER => Next::GiveUp,
            Some(offset) if self.failures >= PROBE_AFTER && !self.probed => Next::Probe(offset),
            _ => Next::Retry,
        }
    }

    /// The probe read the entry at the position: it is not poison (the failures were
    /// something else; the reader retries until it gives up).
    pub(crate) fn readable(&mut self) {
        self.probed = true;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_at_one_offset_probe_it_once_then_give_up() {
        let mut stalls = Stalls::default();
        assert_eq!(stalls.failed(Some(7)), Next::Retry);
        assert_eq!(stalls.failed(Some(7)), Next::Probe(7));
        stalls.readable();
        for _ in PROBE_AFTER + 1..GIVE_UP_AFTER {
            assert_eq!(stalls.failed(Some(7)), Next::Retry, "probed: not poison");
        }
        assert_eq!(stalls.failed(Some(7)), Next::GiveUp);
    }

    #[test]
    fn a_read_or_another_offset_starts_the_count_again() {
        let mut stalls = Stalls::default();
        assert_eq!(stalls.failed(Some(7)), Next::Retry);
        stalls.read();
        assert_eq!(stalls.failed(Some(7)), Next::Retry);
        assert_eq!(stalls.failed(Some(8)), Next::Retry, "another offset");
        assert_eq!(stalls.failed(Some(8)), Next::Probe(8));
    }

    #[test]
    fn a_position_without_an_offset_is_never_probed() {
        let mut stalls = Stalls::default();
        for _ in 1..GIVE_UP_AFTER {
            assert_eq!(stalls.failed(None), Next::Retry);
        }
        assert_eq!(stalls.failed(None), Next::GiveUp);
    }
}
