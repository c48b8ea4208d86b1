//! When a rule's next occurrence is due: a fixed interval, or a cron expression read in an
//! IANA time zone. Pure: every time is a parameter, in epoch milliseconds.
//!
//! Every cost here is bounded whatever a publisher writes. An interval is arithmetic. A
//! cron rule moves by *steps*, one search for the next occurrence each ([`Rule::next_after`]),
//! and a search walks the calendar at most [`SEARCH_YEARS`] years ahead and tries at most
//! [`MOST_WALL_TIMES_TRIED`] wall-clock times; an expression that no date can match (30
//! February) is refused when it is read ([`some_date_matches`]), before any search, since a
//! search for it would walk the calendar day by day to the year 5000.

use std::cell::Cell;
use std::cmp::Ordering;
use std::time::Duration;

use chrono::{DateTime, Datelike, TimeZone, Utc};
use chrono_tz::Tz;
use croner::errors::CronError;
use croner::time::days_in_month;
use croner::{CivilDateTime, Cron, CronDateTime, Resolution, Weekday};

/// How many calendar years past the year it starts in one search for a cron rule's next
/// occurrence looks: an occurrence further away is not found, and the rule is taken to end
/// there. Ten years hold the longest gap of a leap-day rule (eight years, across 2100) with
/// room to spare, and bound the walk of a rule that matches rarely or no more (a year field
/// in the past, the 29th of February on a Monday) to about 50 µs, where a walk to the year
/// 5000 (the cron search's own end) takes milliseconds.
pub const SEARCH_YEARS: u16 = 10;

/// How many wall-clock times one search for a cron rule's next occurrence may try in its
/// zone (one each time the search stops on a time its pattern matches, or steps through a
/// time that daylight saving skips) before it gives up, and the rule is taken to end there.
/// A search that meets a change of clock steps second by second through the hour or two the
/// change skips: two hours of seconds (7,200) and room to spare for the rest of a search,
/// which tries a few times a year of calendar. A rule that only matches times a change skips
/// (`* * 2 * 3 0L` in Berlin: each second of 2 o'clock on the last Sunday of March) would
/// otherwise try 3,600 a year for [`SEARCH_YEARS`] years (3 ms); it gives up after 0.6 ms.
/// A change that skips more than two hours (a zone that skips a day, as Samoa did at the
/// end of 2011) ends a schedule that matches most of its seconds.
pub const MOST_WALL_TIMES_TRIED: u32 = 8_192;

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
    /// repeats. [`Recurrence::from_headers`](super::Recurrence::from_headers) builds it only
    /// for an expression some date matches ([`some_date_matches`]).
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
    /// The first occurrence strictly after `after_ms`; `None` when there is none within
    /// [`SEARCH_YEARS`] calendar years of it (a year field in the past, an occurrence that
    /// comes round more rarely than that) or within [`MOST_WALL_TIMES_TRIED`] wall-clock
    /// times. One step: for a cron rule one search, bounded by both.
    pub fn next_after(&self, after_ms: u64) -> Option<u64> {
        match self {
            Rule::Every(period) => after_ms.checked_add(period_ms(*period)),
            Rule::Cron { cron, zone, .. } => {
                let after = instant(after_ms)?.with_timezone(zone);
                // The search stops with an error at the first year past the last it may
                // look in (the pattern's years end there).
                let last_year = after
                    .year()
                    .saturating_add(i32::from(SEARCH_YEARS))
                    .min(croner::YEAR_UPPER_LIMIT);
                let mut bounded = Cron::clone(cron);
                bounded.pattern.years.max = u16::try_from(last_year).ok()?;
                let tries_left = Cell::new(MOST_WALL_TIMES_TRIED);
                let start = Tried {
                    at: after,
                    tries_left: &tries_left,
                };
                let next = bounded.find_next_occurrence(&start, false);
                #[cfg(test)]
                steps::taken(MOST_WALL_TIMES_TRIED - tries_left.get());
                u64::try_from(next.ok()?.at.timestamp_millis()).ok()
            }
        }
    }

    /// The occurrences strictly after `after_ms` and at or before `until_ms`, counted up to
    /// `most`: exactly, by arithmetic, for an interval; for a cron rule by one step per
    /// occurrence, so at most `most` steps (and then at least `most` occurred).
    pub fn count_between(&self, after_ms: u64, until_ms: u64, most: u64) -> u64 {
        match self {
            Rule::Every(period) => {
                let period = period_ms(*period).max(1);
                (until_ms.saturating_sub(after_ms) / period).min(most)
            }
            Rule::Cron { .. } => {
                let most = usize::try_from(most).unwrap_or(usize::MAX);
                let counted = self
                    .occurrences_after(after_ms)
                    .take(most)
                    .take_while(|due_ms| *due_ms <= until_ms)
                    .count();
                u64::try_from(counted).unwrap_or(u64::MAX)
            }
        }
    }

    /// The occurrences strictly after `after_ms`, in order, one step each; the iterator ends
    /// where [`Rule::next_after`] finds none.
    pub fn occurrences_after(&self, after_ms: u64) -> Occurrences<'_> {
        Occurrences {
            rule: self,
            after_ms: Some(after_ms),
        }
    }
}

/// The occurrences of a rule after a time, in order: see [`Rule::occurrences_after`].
#[derive(Debug, Clone)]
pub struct Occurrences<'a> {
    /// The rule they are occurrences of.
    rule: &'a Rule,
    /// The last one given (at first the time they come after); `None` once they ended.
    after_ms: Option<u64>,
}

impl Iterator for Occurrences<'_> {
    type Item = u64;

    fn next(&mut self) -> Option<u64> {
        let next = self.rule.next_after(self.after_ms?);
        self.after_ms = next;
        next
    }
}

/// An instant in a rule's zone as a cron search moves it, which counts down the wall-clock
/// times the search tries and stops the search when none are left
/// ([`MOST_WALL_TIMES_TRIED`]). Otherwise it is the `DateTime` it holds.
#[derive(Debug, Clone)]
struct Tried<'a> {
    /// The instant.
    at: DateTime<Tz>,
    /// The wall-clock times the search may still try.
    tries_left: &'a Cell<u32>,
}

impl Tried<'_> {
    /// Another instant of the same search.
    fn moved(&self, at: DateTime<Tz>) -> Self {
        Tried {
            at,
            tries_left: self.tries_left,
        }
    }
}

impl CronDateTime for Tried<'_> {
    fn to_civil(&self) -> CivilDateTime {
        self.at.to_civil()
    }

    fn civil_weekday(&self) -> Weekday {
        self.at.civil_weekday()
    }

    fn resolve_civil(&self, civil: CivilDateTime) -> Result<Resolution<Self>, CronError> {
        let left = self.tries_left.get();
        if left == 0 {
            return Err(CronError::TimeSearchLimitExceeded);
        }
        self.tries_left.set(left - 1);
        Ok(match self.at.resolve_civil(civil)? {
            Resolution::Single(at) => Resolution::Single(self.moved(at)),
            Resolution::Ambiguous(earlier, later) => {
                Resolution::Ambiguous(self.moved(earlier), self.moved(later))
            }
            Resolution::Gap => Resolution::Gap,
        })
    }

    fn checked_add_seconds(&self, seconds: i64) -> Option<Self> {
        Some(self.moved(self.at.checked_add_seconds(seconds)?))
    }

    fn cmp_instant(&self, other: &Self) -> Ordering {
        self.at.cmp_instant(&other.at)
    }
}

/// Whether some calendar date matches the date fields of `cron` (its months, days of the
/// month and days of the week), its years aside: false for `0 0 30 2 *`, or for the first
/// of a month that is also a last Friday (`0 0 1 * +5L`), which a search would walk the
/// calendar to the year 5000 for. A day matches or not by its number, its weekday and the
/// length of its month alone, and in the Gregorian calendar every month the pattern names
/// comes round starting on each of the seven weekdays, in each length it has (February: 28
/// and 29 days): so the months of the four lengths starting on each weekday decide it, at
/// most 4 × 7 × 31 day matches (tens of microseconds), and fewer for the first that
/// matches (well under a microsecond for `*`).
pub fn some_date_matches(cron: &Cron) -> bool {
    /// A month of each length: (its length, a year, the month).
    const MONTH_OF_LENGTH: [(u32, i32, u32); 4] =
        [(28, 2001, 2), (29, 2004, 2), (30, 2001, 4), (31, 2001, 1)];
    let pattern = &cron.pattern;
    let named = |length: u32| {
        (1..=12u32)
            .filter(|month| pattern.month_match(*month).unwrap_or(false))
            .any(|month| {
                [2001, 2004]
                    .into_iter()
                    .any(|year| days_in_month(year, month) == length)
            })
    };
    MONTH_OF_LENGTH
        .into_iter()
        .filter(|(length, ..)| named(*length))
        .any(|(length, year, month)| {
            (0..7u32).any(|first_weekday| {
                (1..=length).any(|day| {
                    let weekday = Weekday::from_days_from_sunday(first_weekday + day - 1);
                    pattern
                        .day_match(year, month, day, weekday)
                        .unwrap_or(false)
                })
            })
        })
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

/// The steps (cron searches) this thread took and the wall-clock times they tried, for
/// tests that bound them.
#[cfg(test)]
pub(super) mod steps {
    use std::cell::Cell;

    /// What searches took: steps, and wall-clock times tried.
    #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
    pub(crate) struct Taken {
        /// Cron searches.
        pub(crate) steps: u64,
        /// Wall-clock times they tried, together.
        pub(crate) tries: u64,
        /// The most wall-clock times one of them tried.
        pub(crate) most_tries: u64,
    }

    thread_local! {
        /// What searches took so far on this thread.
        static TAKEN: Cell<Taken> = const {
            Cell::new(Taken { steps: 0, tries: 0, most_tries: 0 })
        };
    }

    /// One more search, which tried `tries` wall-clock times.
    pub(crate) fn taken(tries: u32) {
        TAKEN.with(|taken| {
            let so_far = taken.get();
            taken.set(Taken {
                steps: so_far.steps + 1,
                tries: so_far.tries + u64::from(tries),
                most_tries: so_far.most_tries.max(u64::from(tries)),
            });
        });
    }

    /// What the searches `work` makes take, and what it returns.
    pub(crate) fn counted<T>(work: impl FnOnce() -> T) -> (Taken, T) {
        let before = TAKEN.with(|taken| taken.replace(Taken::default()));
        let result = work();
        (TAKEN.with(|taken| taken.replace(before)), result)
    }
}
