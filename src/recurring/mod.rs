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
//!
//! A publisher chooses every `x-repeat-*` header, so every cost they could choose is
//! bounded: reading a rule is linear in its headers (and refuses a cron expression no date
//! matches), and a cron rule then moves by *steps*, one search for its next occurrence each,
//! which walks at most [`SEARCH_YEARS`] years of the calendar and tries at most
//! [`MOST_WALL_TIMES_TRIED`] wall-clock times. [`Recurrence::first`] takes one step,
//! [`Recurrence::delivering`] at most [`MOST_SKIPPED_COUNTED`] + 1, [`Recurrence::check`] at
//! most 64; an interval takes none, its occurrences are arithmetic. And no schedule repeats
//! more often than [`MIN_INTERVAL`].

mod headers;
mod rule;

pub use headers::{header, with_occurrence};
pub use rule::{MOST_WALL_TIMES_TRIED, Occurrences, Rule, SEARCH_YEARS, some_date_matches};

use std::time::Duration;

use thiserror::Error;

/// How many occurrences of the next ones [`Recurrence::check`] looks at for the shortest
/// time between two (and the longest): enough for a month's lengths, or a step that does not
/// divide its field (`*/7` minutes: 56 then 0), to show.
const GAP_SAMPLES: usize = 64;

/// The skipped occurrences of a cron schedule are counted up to this many, one step each:
/// after an outage in which more were due, [`Delivering::skipped`] says this many (read: at
/// least this many), the schedule goes on from now, and its numbering counts this many for
/// the skipped ones. A schedule with an `x-repeat-count` still ends exactly where fewer than
/// this many occurrences remained to it; where more remained, it may deliver up to the
/// uncounted ones more than its count. An interval's skipped occurrences are counted
/// exactly, by arithmetic.
pub const MOST_SKIPPED_COUNTED: u64 = 256;

/// No schedule repeats more often than this, whatever the smallest level: each occurrence
/// costs an entry in the cancel stream and a confirmed publish or two (NATS takes the same
/// bound for `@every`). A six-field cron every second (`* * * * * *`) is just within it.
pub const MIN_INTERVAL: Duration = Duration::from_secs(1);

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
    /// Occurrences that were due by then as well and are not delivered: exact for an
    /// interval; for a cron rule at most [`MOST_SKIPPED_COUNTED`], which then means at least
    /// that many.
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
    /// The interval is not a duration. It holds the value as a refusal shows it (text
    /// quoted, a number in digits, cut short when long).
    #[error("{every} {0} is not a duration (for example `5m`, `@every 1h30m`, or milliseconds)", every = header::EVERY)]
    BadInterval(String),
    /// The cron expression does not parse.
    #[error("{} {expression} is not a cron expression: {reason}", header::CRON)]
    BadCron {
        /// The expression as a refusal shows it (quoted, cut short when long).
        expression: String,
        /// What the parser said (cut short when long).
        reason: String,
    },
    /// The time zone is not an IANA zone name. It holds the value as a refusal shows it.
    #[error("{zone} {0} is not an IANA time zone (for example `Europe/Berlin` or `UTC`)", zone = header::TIME_ZONE)]
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
    /// Occurrences closer together than [`MIN_INTERVAL`] or the smallest level, whichever
    /// is longer.
    #[error("occurrences {} apart, closer than {shortest}", crate::ladder::format_duration(*gap))]
    TooFrequent {
        /// The shortest time between two of its occurrences.
        gap: Duration,
        /// The shortest time allowed between two, and what sets it.
        shortest: ShortestGap,
    },
    /// Occurrences further apart than the bridges' maximum delay.
    #[error("occurrences {} apart, beyond the maximum delay of {} (delays.max_delay)", crate::ladder::format_duration(*gap), crate::ladder::format_duration(*max_delay))]
    TooRare {
        /// The time between two of its occurrences.
        gap: Duration,
        /// The maximum delay.
        max_delay: Duration,
    },
    /// No occurrence: the rule matches no date, none a search finds (within
    /// [`SEARCH_YEARS`] years and [`MOST_WALL_TIMES_TRIED`] wall-clock times), or it ends
    /// first.
    #[error(
        "the schedule has no occurrence (a date that never comes, or an end before its first occurrence)"
    )]
    NeverOccurs,
}

/// The shortest time a schedule may leave between two occurrences, and what sets it: the
/// longer of [`MIN_INTERVAL`] and the bridge's smallest level.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShortestGap {
    /// [`MIN_INTERVAL`], at least as long as the smallest level.
    SmallestInterval(Duration),
    /// The smallest level, longer than [`MIN_INTERVAL`]: a schedule closer than it would
    /// never rest in a level.
    SmallestLevel(Duration),
}

impl ShortestGap {
    /// The shortest gap a bridge whose smallest level is `smallest_level` allows.
    pub fn with_smallest_level(smallest_level: Duration) -> ShortestGap {
        if smallest_level > MIN_INTERVAL {
            ShortestGap::SmallestLevel(smallest_level)
        } else {
            ShortestGap::SmallestInterval(MIN_INTERVAL)
        }
    }

    /// The time itself.
    pub fn duration(&self) -> Duration {
        match self {
            ShortestGap::SmallestInterval(shortest) | ShortestGap::SmallestLevel(shortest) => {
                *shortest
            }
        }
    }
}

impl std::fmt::Display for ShortestGap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let shown = crate::ladder::format_duration(self.duration());
        match self {
            ShortestGap::SmallestInterval(_) => {
                write!(f, "the smallest recurring interval ({shown})")
            }
            ShortestGap::SmallestLevel(_) => write!(
                f,
                "the smallest level ({shown}): such a schedule would never rest in a level"
            ),
        }
    }
}

impl Recurrence {
    /// Refuses a schedule whose occurrences, from `now_ms` on, come closer together than
    /// [`MIN_INTERVAL`] or `smallest_level` (whichever is longer) or further apart than
    /// `max_delay`, or that has no occurrence after `now_ms` (unless its count is 1: the
    /// publisher's due time is all of it). One occurrence after `now_ms` and none after it
    /// passes: the schedule ends there.
    ///
    /// Cheap enough to call at every occurrence, and the carrier may, to hold a running
    /// schedule to the limits of the bridge that carries it now (a schedule that an older
    /// bridge or another configuration took in): an interval costs a comparison; a cron rule
    /// at most 64 steps (the next 64 occurrences, fewer when a gap is too long), each a
    /// search bounded by [`SEARCH_YEARS`] and [`MOST_WALL_TIMES_TRIED`]: tens of
    /// microseconds for a rule every minute.
    pub fn check(
        &self,
        now_ms: u64,
        smallest_level: Duration,
        max_delay: Duration,
    ) -> Result<(), RecurrenceError> {
        let shortest = ShortestGap::with_smallest_level(smallest_level);
        let (gap, longest) = match &self.rule {
            Rule::Every(period) => (*period, *period),
            Rule::Cron { .. } => {
                let mut occurrences = self.rule.occurrences_after(now_ms).take(GAP_SAMPLES);
                let Some(mut previous) = occurrences.next() else {
                    return match self.count {
                        Some(1) => Ok(()),
                        _ => Err(RecurrenceError::NeverOccurs),
                    };
                };
                let mut shortest_and_longest: Option<(Duration, Duration)> = None;
                for due_ms in occurrences {
                    let between = Duration::from_millis(due_ms.saturating_sub(previous));
                    let (gap, longest) = shortest_and_longest.unwrap_or((between, between));
                    shortest_and_longest = Some((gap.min(between), longest.max(between)));
                    previous = due_ms;
                    if between > max_delay {
                        // Looking further is searching further: this is refused already.
                        break;
                    }
                }
                // One occurrence, and the schedule ends there: nothing to refuse.
                let Some(shortest_and_longest) = shortest_and_longest else {
                    return Ok(());
                };
                shortest_and_longest
            }
        };
        if gap < shortest.duration() {
            return Err(RecurrenceError::TooFrequent { gap, shortest });
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
    /// `now_ms` (one step). `None` when the schedule ends before it.
    pub fn first(&self, first_due_ms: Option<u64>, now_ms: u64) -> Option<Occurrence> {
        let due_ms = match first_due_ms {
            Some(due) => due,
            None => self.rule.next_after(now_ms)?,
        };
        self.within_end(Occurrence { number: 1, due_ms })
    }

    /// What delivering `current` at `now_ms` means: the occurrences after it that were due
    /// by `now_ms` are skipped (counted, and counted against the schedule's end), and the one
    /// after them is next, unless the schedule ends first.
    ///
    /// Its cost does not grow with the end the publisher chose: the end by `x-repeat-until`
    /// only asks whether the next occurrence falls after it. An interval takes no step. A
    /// cron rule takes one step per skipped occurrence and one that finds the first not due
    /// yet, together at most [`MOST_SKIPPED_COUNTED`] (when that many were skipped, the
    /// schedule goes on from now, its numbering counting that many), then one for the next:
    /// at most [`MOST_SKIPPED_COUNTED`] + 1.
    pub fn delivering(&self, current: Occurrence, now_ms: u64) -> Delivering {
        // Skipped: due by now, and not after the end.
        let skipped_until = self.until_ms.map_or(now_ms, |until| until.min(now_ms));
        let most_counted = match self.rule {
            Rule::Every(_) => u64::MAX,
            Rule::Cron { .. } => MOST_SKIPPED_COUNTED,
        };
        let most_counted = match self.count {
            Some(count) => most_counted.min(count.saturating_sub(current.number)),
            None => most_counted,
        };
        let skipped = self
            .rule
            .count_between(current.due_ms, skipped_until, most_counted);
        let last_due = match skipped {
            0 => current.due_ms,
            // The next is the first due after now.
            _ => now_ms.max(current.due_ms),
        };
        let next = self.rule.next_after(last_due).and_then(|due_ms| {
            self.within_end(Occurrence {
                number: current.number.saturating_add(skipped).saturating_add(1),
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
