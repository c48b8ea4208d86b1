//! Recurring schedules, pure: a message that repeats every interval or on a cron
//! expression in a time zone, until a time or for a count, named by its `message_id`.
//!
//! A publisher sets the rule in headers ([`header`]) on an ordinary delayed message. Each
//! occurrence is delivered to the target as an ordinary message, with its number and due
//! time in headers; the copy that travels on to the next occurrence keeps the schedule's
//! headers and its `x-published-at`, so that a cancel of its id stops every later
//! occurrence. This module reads the rule ([`Recurrence::from_headers`]), says when the
//! first occurrence is due ([`Recurrence::first`]) and what delivering one means
//! ([`Recurrence::delivering`]): after an outage longer than a period one overdue
//! occurrence is delivered, marked late with how many were skipped, and the schedule goes
//! on from now (no catch-up storm).

mod headers;
mod rule;

pub use headers::{header, with_occurrence};
pub use rule::Rule;

use std::time::Duration;

use thiserror::Error;

/// How many occurrences of the next ones [`Recurrence::check`] looks at for the shortest
/// time between two.
const GAP_SAMPLES: usize = 64;

/// Skipped occurrences are counted up to this many (a schedule every minute that was
/// stopped for a year skipped more than anyone needs counted).
pub const MOST_SKIPPED_COUNTED: u64 = 1_000_000;

/// A recurring schedule: its rule and where it ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recurrence {
    /// How it repeats.
    pub rule: Rule,
    /// No occurrence is due after this, epoch ms.
    pub until_ms: Option<u64>,
    /// At most this many occurrences (skipped ones count).
    pub count: Option<u64>,
}

/// One occurrence of a schedule: its number (from 1) and when it is due, epoch ms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Occurrence {
    /// Its number: 1 for the first.
    pub number: u64,
    /// When it is due, epoch ms.
    pub due_ms: u64,
}

/// What delivering an occurrence at a given time means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Delivering {
    /// Occurrences that were due by then as well and are not delivered.
    pub skipped: u64,
    /// The occurrence after them, to schedule before this one is acknowledged; `None` when
    /// the schedule has ended.
    pub next: Option<Occurrence>,
}

impl Delivering {
    /// True when later occurrences were due by the time this one was delivered: it stands
    /// for them.
    pub fn late(&self) -> bool {
        self.skipped > 0
    }
}

/// Why a recurring schedule is refused. Its message is parked with this as the detail.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum RecurrenceError {
    /// Both an interval and a cron expression.
    #[error(
        "both {} and {}: a schedule repeats by one rule",
        header::EVERY,
        header::CRON
    )]
    TwoRules,
    /// The interval is not a duration.
    #[error("{every} {0:?} is not a duration (for example `5m`, `@every 1h30m`, or milliseconds)", every = header::EVERY)]
    BadInterval(String),
    /// The cron expression does not parse.
    #[error("{} {expression:?} is not a cron expression: {reason}", header::CRON)]
    BadCron {
        /// The expression.
        expression: String,
        /// What the parser said.
        reason: String,
    },
    /// The time zone is not an IANA zone name.
    #[error("{zone} {0:?} is not an IANA time zone (for example `Europe/Berlin` or `UTC`)", zone = header::TIME_ZONE)]
    UnknownZone(String),
    /// A time zone, an end or a count without a rule.
    #[error("{0} without {every} or {cron}", every = header::EVERY, cron = header::CRON)]
    NoRule(&'static str),
    /// A time zone for an interval, which runs by elapsed time.
    #[error(
        "{} with {}: an interval runs by elapsed time; a zone goes with {}",
        header::TIME_ZONE,
        header::EVERY,
        header::CRON
    )]
    ZoneForInterval,
    /// The end is not a time, or the count not a positive whole number.
    #[error("{name}: {reason}")]
    BadEnd {
        /// The header.
        name: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// No `message_id`: nothing could replace or cancel the schedule.
    #[error(
        "a recurring schedule needs a message_id: it is the schedule's id, by which it is replaced and cancelled"
    )]
    NoId,
    /// Occurrences closer together than the smallest level.
    #[error("occurrences {} apart, closer than the smallest level ({}): such a schedule would never rest in a level", crate::ladder::format_duration(*gap), crate::ladder::format_duration(*smallest))]
    TooFrequent {
        /// The shortest time between two of its occurrences.
        gap: Duration,
        /// The smallest level.
        smallest: Duration,
    },
    /// Occurrences further apart than the bridges' maximum delay.
    #[error("occurrences {} apart, beyond the maximum delay of {} (delays.max_delay)", crate::ladder::format_duration(*gap), crate::ladder::format_duration(*max_delay))]
    TooRare {
        /// The time between two of its occurrences.
        gap: Duration,
        /// The maximum delay.
        max_delay: Duration,
    },
    /// No occurrence: the rule matches no date the search reaches, or it ends first.
    #[error(
        "the schedule has no occurrence (a date that never comes, or an end before its first occurrence)"
    )]
    NeverOccurs,
}

impl Recurrence {
    /// Refuses a schedule whose occurrences, from `now_ms` on, come closer together than
    /// `smallest_level` or further apart than `max_delay`.
    pub fn check(
        &self,
        now_ms: u64,
        smallest_level: Duration,
        max_delay: Duration,
    ) -> Result<(), RecurrenceError> {
        let gaps = self.rule.gaps(now_ms, GAP_SAMPLES);
        let (Some(&gap), Some(&longest)) = (gaps.iter().min(), gaps.iter().max()) else {
            // One occurrence at most: fine if it ends there, else it never comes back.
            return match self.count {
                Some(1) => Ok(()),
                _ => Err(RecurrenceError::NeverOccurs),
            };
        };
        if gap < smallest_level {
            return Err(RecurrenceError::TooFrequent {
                gap,
                smallest: smallest_level,
            });
        }
        if longest > max_delay {
            return Err(RecurrenceError::TooRare {
                gap: longest,
                max_delay,
            });
        }
        Ok(())
    }

    /// The first occurrence of a schedule taken in at `now_ms`: at `first_due_ms` when the
    /// publisher gave a due time (`x-delay`, `x-deliver-at`), else the rule's first after
    /// `now_ms`. `None` when the schedule ends before it.
    pub fn first(&self, first_due_ms: Option<u64>, now_ms: u64) -> Option<Occurrence> {
        let due_ms = match first_due_ms {
            Some(due) => due,
            None => self.rule.next_after(now_ms)?,
        };
        self.within_end(Occurrence { number: 1, due_ms })
    }

    /// What delivering `current` at `now_ms` means: the occurrences after it that were due
    /// by `now_ms` are skipped (counted), and the one after them is next, unless the
    /// schedule ends first.
    pub fn delivering(&self, current: Occurrence, now_ms: u64) -> Delivering {
        let mut skipped = self
            .rule
            .count_between(current.due_ms, now_ms, MOST_SKIPPED_COUNTED);
        // Skipped occurrences count against the schedule's end.
        if let Some(count) = self.count {
            skipped = skipped.min(count.saturating_sub(current.number));
        }
        if let Some(until) = self.until_ms {
            let before_end = self
                .rule
                .count_between(current.due_ms, until, MOST_SKIPPED_COUNTED);
            skipped = skipped.min(before_end);
        }
        let last_due = match skipped {
            0 => current.due_ms,
            // The next is the first due after now.
            _ => now_ms.max(current.due_ms),
        };
        let next = self.rule.next_after(last_due).and_then(|due_ms| {
            self.within_end(Occurrence {
                number: current.number + skipped + 1,
                due_ms,
            })
        });
        Delivering { skipped, next }
    }

    /// `occurrence`, if the schedule has not ended before it.
    fn within_end(&self, occurrence: Occurrence) -> Option<Occurrence> {
        let counted = self.count.is_none_or(|count| occurrence.number <= count);
        let in_time = self.until_ms.is_none_or(|until| occurrence.due_ms <= until);
        (counted && in_time).then_some(occurrence)
    }
}

#[cfg(test)]
mod tests;
