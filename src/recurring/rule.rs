//! When a rule's next occurrence is due: a fixed interval, or a cron expression read in an
//! IANA time zone. Pure: every time is a parameter, in epoch milliseconds.

use std::time::Duration;

use chrono::{DateTime, TimeZone, Utc};
use chrono_tz::Tz;
use croner::Cron;

/// How a schedule repeats.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rule {
    /// Every `period`, by elapsed time (no calendar, no time zone).
    Every(Duration),
    /// Whenever the cron expression matches the wall clock of `zone`. Across daylight
    /// saving changes it follows the Open Cron Pattern Specification as `croner` implements
    /// it: a fixed time (`30 2 * * *`) that a change skips runs right after the change and
    /// a fixed time that a change repeats runs once; an interval or wildcard pattern
    /// (`*/15 * * * *`) skips what the change skips and runs in both passes of what it
    /// repeats.
    Cron {
        /// The expression as the publisher wrote it.
        expression: String,
        /// The expression, parsed.
        cron: Box<Cron>,
        /// The zone its wall clock is read in.
        zone: Tz,
    },
}

impl Rule {
    /// The first occurrence strictly after `after_ms`; `None` when there is none the cron
    /// search reaches (a pattern no date matches, such as 30 February, or one beyond the
    /// year 5000).
    pub fn next_after(&self, after_ms: u64) -> Option<u64> {
        match self {
            Rule::Every(period) => after_ms.checked_add(period_ms(*period)),
            Rule::Cron { cron, zone, .. } => {
                let after = instant(after_ms)?.with_timezone(zone);
                let next = cron.find_next_occurrence(&after, false).ok()?;
                u64::try_from(next.timestamp_millis()).ok()
            }
        }
    }

    /// The occurrences strictly after `after_ms` and at or before `until_ms`, counted up to
    /// `most` (a rule that runs far more often than that counts `most`).
    pub fn count_between(&self, after_ms: u64, until_ms: u64, most: u64) -> u64 {
        match self {
            Rule::Every(period) => {
                let period = period_ms(*period).max(1);
                (until_ms.saturating_sub(after_ms) / period).min(most)
            }
            Rule::Cron { .. } => {
                let mut counted = 0;
                let mut at = after_ms;
                while counted < most {
                    match self.next_after(at) {
                        Some(next) if next <= until_ms => {
                            counted += 1;
                            at = next;
                        }
                        _ => break,
                    }
                }
                counted
            }
        }
    }

    /// The times between the next `samples` occurrences after `after_ms`, in order (the
    /// period once for an interval); empty when fewer than two occur.
    pub fn gaps(&self, after_ms: u64, samples: usize) -> Vec<Duration> {
        if let Rule::Every(period) = self {
            return vec![*period];
        }
        let mut occurrences = Vec::with_capacity(samples);
        let mut at = after_ms;
        while occurrences.len() < samples {
            let Some(next) = self.next_after(at) else {
                break;
            };
            occurrences.push(next);
            at = next;
        }
        occurrences
            .windows(2)
            .map(|pair| Duration::from_millis(pair[1] - pair[0]))
            .collect()
    }
}

/// A period in whole milliseconds, saturating.
fn period_ms(period: Duration) -> u64 {
    u64::try_from(period.as_millis()).unwrap_or(u64::MAX)
}

/// Epoch milliseconds as a UTC instant, if chrono can hold it.
pub(super) fn instant(epoch_ms: u64) -> Option<DateTime<Utc>> {
    Utc.timestamp_millis_opt(i64::try_from(epoch_ms).ok()?)
        .single()
}
