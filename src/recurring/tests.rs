use std::time::Duration;

use chrono::{Datelike, NaiveDate, NaiveTime, TimeZone, Timelike, Utc};
use chrono_tz::Tz;
use lapin::types::{AMQPValue, FieldTable, LongString};
use proptest::prelude::*;

use super::*;

const MINUTE: u64 = 60_000;
const HOUR: u64 = 60 * MINUTE;
const DAY: u64 = 24 * HOUR;

fn text(value: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(value))
}

/// A header and its value.
type Entry<'a> = (&'a str, AMQPValue);

/// Whether an error is the one a case expects.
type IsExpected = fn(&RecurrenceError) -> bool;

fn headers(entries: &[Entry]) -> FieldTable {
    let mut table = FieldTable::default();
    for (name, value) in entries {
        table.insert((*name).into(), value.clone());
    }
    table
}

fn read(entries: &[Entry]) -> Result<Option<Recurrence>, RecurrenceError> {
    Recurrence::from_headers(&headers(entries), true)
}

fn cron(expression: &str, zone: &str) -> Recurrence {
    read(&[
        (header::CRON, text(expression)),
        (header::TIME_ZONE, text(zone)),
    ])
    .expect("a schedule")
    .expect("it repeats")
}

fn every(period: Duration) -> Recurrence {
    Recurrence {
        rule: Rule::Every(period),
        until_ms: None,
        count: None,
    }
}

/// Epoch ms of a UTC date and time.
fn utc(y: i32, mo: u32, d: u32, h: u32, mi: u32) -> u64 {
    Utc.with_ymd_and_hms(y, mo, d, h, mi, 0)
        .unwrap()
        .timestamp_millis() as u64
}

fn local(ms: u64, zone: Tz) -> chrono::DateTime<Tz> {
    Utc.timestamp_millis_opt(ms as i64)
        .unwrap()
        .with_timezone(&zone)
}

/// `count` occurrences of `rule` after `after_ms`, in order.
fn occurrences(rule: &Rule, after_ms: u64, count: usize) -> Vec<u64> {
    let mut found = Vec::with_capacity(count);
    let mut at = after_ms;
    while found.len() < count {
        let next = rule.next_after(at).expect("an occurrence");
        found.push(next);
        at = next;
    }
    found
}

#[test]
fn an_interval_reads_as_a_duration_an_every_or_milliseconds() {
    for value in [
        text("5m"),
        text("@every 5m"),
        text(" @every 300s "),
        text("300000"),
        AMQPValue::LongLongInt(300_000),
        AMQPValue::LongUInt(300_000),
    ] {
        let read = read(&[(header::EVERY, value.clone())]);
        assert_eq!(
            read.map(|r| r.map(|r| r.rule)),
            Ok(Some(Rule::Every(Duration::from_secs(300)))),
            "{value:?}"
        );
    }
    for value in [
        text("0s"),
        text("soon"),
        AMQPValue::LongLongInt(-5),
        AMQPValue::Boolean(true),
    ] {
        assert!(
            matches!(
                read(&[(header::EVERY, value.clone())]),
                Err(RecurrenceError::BadInterval(_))
            ),
            "{value:?}"
        );
    }
}

#[test]
fn a_message_without_repeat_headers_does_not_repeat() {
    assert_eq!(read(&[("x-delay", AMQPValue::LongLongInt(5))]), Ok(None));
}

#[test]
fn bad_schedules_are_refused_with_what_is_wrong() {
    let cases: [(&[Entry], IsExpected); 7] = [
        (
            &[
                (header::EVERY, text("5m")),
                (header::CRON, text("* * * * *")),
            ],
            |e| matches!(e, RecurrenceError::TwoRules),
        ),
        (&[(header::CRON, text("61 * * * *"))], |e| {
            matches!(e, RecurrenceError::BadCron { .. })
        }),
        (
            &[
                (header::CRON, text("0 8 * * *")),
                (header::TIME_ZONE, text("Mars/Olympus")),
            ],
            |e| matches!(e, RecurrenceError::UnknownZone(zone) if zone == "\"Mars/Olympus\""),
        ),
        (
            &[
                (header::EVERY, text("5m")),
                (header::TIME_ZONE, text("UTC")),
            ],
            |e| matches!(e, RecurrenceError::ZoneForInterval),
        ),
        (
            &[(header::COUNT, AMQPValue::LongLongInt(3))],
            |e| matches!(e, RecurrenceError::NoRule(name) if *name == header::COUNT),
        ),
        (
            &[
                (header::EVERY, text("5m")),
                (header::COUNT, AMQPValue::LongLongInt(0)),
            ],
            |e| matches!(e, RecurrenceError::BadEnd { name, .. } if *name == header::COUNT),
        ),
        (
            &[
                (header::EVERY, text("5m")),
                (header::UNTIL, text("next tuesday")),
            ],
            |e| matches!(e, RecurrenceError::BadEnd { name, .. } if *name == header::UNTIL),
        ),
    ];
    for (entries, expected) in cases {
        match read(entries) {
            Err(e) => assert!(expected(&e), "{entries:?}: {e}"),
            other => panic!("{entries:?}: {other:?}"),
        }
    }
    assert_eq!(
        Recurrence::from_headers(&headers(&[(header::EVERY, text("5m"))]), false),
        Err(RecurrenceError::NoId)
    );
}

#[test]
fn an_end_reads_as_a_time_or_a_count() {
    let schedule = read(&[
        (header::EVERY, text("1h")),
        (header::UNTIL, text("2027-01-15T08:00:00Z")),
        (header::COUNT, text("12")),
    ])
    .unwrap()
    .unwrap();
    assert_eq!(schedule.until_ms, Some(utc(2027, 1, 15, 8, 0)));
    assert_eq!(schedule.count, Some(12));
}

#[test]
fn schedules_closer_than_the_smallest_level_or_rarer_than_the_maximum_delay_are_refused() {
    let now = utc(2027, 3, 1, 0, 0);
    let level = Duration::from_secs(5);
    let max = Duration::from_secs(366 * 24 * 3600);
    assert!(matches!(
        every(Duration::from_secs(2)).check(now, level, max),
        Err(RecurrenceError::TooFrequent { .. })
    ));
    assert!(matches!(
        cron("* * * * * *", "UTC").check(now, level, max),
        Err(RecurrenceError::TooFrequent { gap, .. }) if gap == Duration::from_secs(1)
    ));
    assert!(matches!(
        cron("0 12 29 2 *", "UTC").check(now, level, max),
        Err(RecurrenceError::TooRare { .. })
    ));
    assert!(matches!(
        every(Duration::from_secs(400 * 24 * 3600)).check(now, level, max),
        Err(RecurrenceError::TooRare { .. })
    ));
    assert_eq!(
        read(&[(header::CRON, text("0 0 30 2 *"))]),
        Err(RecurrenceError::NeverOccurs)
    );
    assert_eq!(
        cron("*/5 * * * *", "Europe/Berlin").check(now, level, max),
        Ok(())
    );
    assert_eq!(every(Duration::from_secs(5)).check(now, level, max), Ok(()));
}

#[test]
fn the_first_occurrence_is_the_publishers_due_time_or_the_rules_first() {
    let now = utc(2027, 3, 1, 7, 30);
    let daily = cron("0 8 * * *", "UTC");
    assert_eq!(
        daily.first(None, now),
        Some(Occurrence {
            number: 1,
            due_ms: utc(2027, 3, 1, 8, 0)
        })
    );
    assert_eq!(
        daily.first(Some(now + 10 * MINUTE), now).map(|o| o.due_ms),
        Some(now + 10 * MINUTE)
    );
    let ended = Recurrence {
        until_ms: Some(now),
        ..daily
    };
    assert_eq!(ended.first(None, now), None);
}

#[test]
fn an_occurrence_on_time_is_followed_by_the_next_one() {
    let schedule = cron("0 8 * * *", "Europe/Berlin");
    let due = schedule.rule.next_after(utc(2027, 3, 1, 0, 0)).unwrap();
    assert_eq!(due, utc(2027, 3, 1, 7, 0), "08:00 in Berlin in winter");
    let current = Occurrence {
        number: 4,
        due_ms: due,
    };
    let delivering = schedule.delivering(current, due + 20);
    assert_eq!(delivering.skipped, 0);
    assert!(!delivering.late());
    assert_eq!(
        delivering.next,
        Some(Occurrence {
            number: 5,
            due_ms: due + DAY
        })
    );
}

#[test]
fn after_an_outage_one_late_occurrence_stands_for_the_skipped_ones_and_the_schedule_goes_on_from_now()
 {
    let due = utc(2027, 3, 1, 8, 0);
    let current = Occurrence {
        number: 1,
        due_ms: due,
    };
    // Down for three and a half days: the occurrences of the 2nd, 3rd and 4th are skipped.
    let now = due + 3 * DAY + 12 * HOUR;
    let delivering = cron("0 8 * * *", "UTC").delivering(current, now);
    assert_eq!(delivering.skipped, 3);
    assert!(delivering.late());
    assert_eq!(
        delivering.next,
        Some(Occurrence {
            number: 5,
            due_ms: utc(2027, 3, 5, 8, 0)
        })
    );
    // An interval goes on from now.
    let delivering = every(Duration::from_secs(600)).delivering(current, due + 35 * MINUTE);
    assert_eq!(delivering.skipped, 3);
    assert_eq!(
        delivering.next,
        Some(Occurrence {
            number: 5,
            due_ms: due + 45 * MINUTE
        })
    );
}

#[test]
fn skipped_occurrences_count_against_the_end() {
    let due = utc(2027, 3, 1, 8, 0);
    let hourly = |count, until_ms| Recurrence {
        rule: Rule::Every(Duration::from_secs(3600)),
        until_ms,
        count,
    };
    let current = Occurrence {
        number: 2,
        due_ms: due,
    };
    let by_count = hourly(Some(3), None).delivering(current, due + 5 * HOUR);
    assert_eq!((by_count.skipped, by_count.next), (1, None));
    let by_time = hourly(None, Some(due + 2 * HOUR)).delivering(current, due + 5 * HOUR);
    assert_eq!((by_time.skipped, by_time.next), (2, None));
    let last = hourly(Some(2), None).delivering(current, due);
    assert_eq!((last.skipped, last.next), (0, None));
}

#[test]
fn a_leap_day_schedule_runs_on_the_29th_of_february_of_leap_years_only() {
    let leap_day = cron("0 12 29 2 *", "UTC");
    let found = occurrences(&leap_day.rule, utc(2027, 1, 1, 0, 0), 3);
    assert_eq!(
        found,
        vec![
            utc(2028, 2, 29, 12, 0),
            utc(2032, 2, 29, 12, 0),
            utc(2036, 2, 29, 12, 0)
        ]
    );
}

#[test]
fn the_31st_runs_in_months_that_have_one_and_the_last_day_in_every_month() {
    let thirty_first = cron("0 0 31 * *", "UTC");
    let months: Vec<u32> = occurrences(&thirty_first.rule, utc(2027, 1, 1, 0, 0), 7)
        .into_iter()
        .map(|ms| local(ms, Tz::UTC).month())
        .collect();
    assert_eq!(months, vec![1, 3, 5, 7, 8, 10, 12]);
    let last_day = cron("0 0 L * *", "UTC");
    let days: Vec<(u32, u32)> = occurrences(&last_day.rule, utc(2028, 1, 1, 0, 0), 3)
        .into_iter()
        .map(|ms| (local(ms, Tz::UTC).month(), local(ms, Tz::UTC).day()))
        .collect();
    assert_eq!(days, vec![(1, 31), (2, 29), (3, 31)]);
}

/// A midnight that a change skips (Santiago moved from 24:00 to 01:00 on 8 September
/// 2024): a schedule at midnight runs at 01:00 that day, once. (The property test below
/// found this case for its own assertion, which compared the wall time alone.)
#[test]
fn a_midnight_that_daylight_saving_skips_runs_at_the_end_of_the_gap() {
    let zone = Tz::America__Santiago;
    let schedule = cron("0 0 * * *", zone.name());
    let found = occurrences(&schedule.rule, utc(2024, 9, 6, 12, 0), 3);
    let days: Vec<String> = found
        .iter()
        .map(|ms| local(*ms, zone).format("%Y-%m-%d %H:%M %z").to_string())
        .collect();
    assert_eq!(
        days,
        vec![
            "2024-09-07 00:00 -0400",
            "2024-09-08 01:00 -0300",
            "2024-09-09 00:00 -0300"
        ]
    );
}

/// A cron rule as the headers give it, or why it is refused.
fn read_cron(expression: &str) -> Result<Option<Recurrence>, RecurrenceError> {
    read(&[(header::CRON, text(expression))])
}

/// What the cron searches `work` makes take (steps, wall-clock times tried), and what it
/// returns.
fn steps<T>(work: impl FnOnce() -> T) -> (super::rule::steps::Taken, T) {
    super::rule::steps::counted(work)
}

/// Finding: the end by `x-repeat-until` was found by counting every occurrence up to it, at
/// each delivery (a second-by-second rule until 2035: a million steps, a quarter of a second
/// and more). Delivering on time now takes two steps, wherever the end is.
#[test]
fn delivering_an_occurrence_on_time_takes_two_steps_however_far_its_end() {
    let due = utc(2027, 3, 1, 8, 0);
    for (expression, period) in [("* * * * * *", 1_000), ("* * * * *", MINUTE)] {
        for until_ms in [None, Some(utc(2035, 1, 1, 0, 0)), Some(u64::MAX / 2)] {
            let schedule = Recurrence {
                until_ms,
                ..cron(expression, "Europe/Berlin")
            };
            let current = Occurrence {
                number: 7,
                due_ms: due,
            };
            let (taken, delivering) = steps(|| schedule.delivering(current, due + 30));
            assert!(
                taken.steps <= 2 && taken.tries <= 8,
                "{expression} until {until_ms:?}: {taken:?}"
            );
            assert_eq!(
                delivering,
                Delivering {
                    skipped: 0,
                    next: Some(Occurrence {
                        number: 8,
                        due_ms: due + period
                    })
                },
                "{expression}"
            );
        }
    }
}

/// Finding: after an outage a cron rule's skipped occurrences were counted up to a million
/// steps. Now at most [`MOST_SKIPPED_COUNTED`]: the late occurrence says that many (at
/// least that many were skipped), and the schedule goes on from now, numbered after them.
#[test]
fn after_a_long_outage_a_cron_schedule_counts_its_skipped_occurrences_up_to_a_bound() {
    let due = utc(2027, 3, 1, 8, 0);
    let now = due + DAY + 500;
    let current = Occurrence {
        number: 3,
        due_ms: due,
    };
    for until_ms in [None, Some(utc(2035, 1, 1, 0, 0))] {
        let schedule = Recurrence {
            until_ms,
            ..cron("* * * * * *", "UTC")
        };
        let (taken, delivering) = steps(|| schedule.delivering(current, now));
        assert!(taken.steps <= MOST_SKIPPED_COUNTED + 1, "{taken:?}");
        assert_eq!(delivering.skipped, MOST_SKIPPED_COUNTED);
        assert!(delivering.late());
        assert_eq!(
            delivering.next,
            Some(Occurrence {
                number: 3 + MOST_SKIPPED_COUNTED + 1,
                due_ms: due + DAY + 1_000
            }),
            "the first second after now"
        );
    }
    // Within the bound the count is exact.
    let (_, within) = steps(|| {
        cron("* * * * * *", "UTC").delivering(current, due + MOST_SKIPPED_COUNTED * 1_000 - 1)
    });
    assert_eq!(within.skipped, MOST_SKIPPED_COUNTED - 1);
}

/// An interval's skipped occurrences are counted exactly, by arithmetic, whatever the
/// outage: a year of a schedule every second.
#[test]
fn an_intervals_skipped_occurrences_are_counted_exactly_however_long_the_outage() {
    let due = utc(2027, 3, 1, 8, 0);
    let current = Occurrence {
        number: 1,
        due_ms: due,
    };
    let year = 365 * DAY;
    let delivering = every(Duration::from_secs(1)).delivering(current, due + year + 200);
    assert_eq!(delivering.skipped, year / 1_000);
    assert_eq!(
        delivering.next,
        Some(Occurrence {
            number: 1 + year / 1_000 + 1,
            due_ms: due + year + 1_200
        })
    );
}

/// `x-repeat-count` still ends a cron schedule after an outage exactly where fewer than
/// [`MOST_SKIPPED_COUNTED`] occurrences remained; beyond, the numbering counts the bound for
/// the skipped ones (the schedule may then deliver more than its count, as documented).
#[test]
fn a_count_still_ends_a_cron_schedule_after_an_outage() {
    let due = utc(2027, 3, 1, 8, 0);
    let current = Occurrence {
        number: 5,
        due_ms: due,
    };
    let counted = |count| Recurrence {
        count: Some(count),
        ..cron("* * * * * *", "UTC")
    };
    let (taken, ended) = steps(|| counted(15).delivering(current, due + HOUR));
    assert_eq!((ended.skipped, ended.next), (10, None));
    assert!(taken.steps <= 11, "{taken:?}");
    let last = counted(5).delivering(current, due + HOUR);
    assert_eq!((last.skipped, last.next), (0, None));
    let beyond = counted(100_000).delivering(current, due + HOUR);
    assert_eq!(beyond.skipped, MOST_SKIPPED_COUNTED);
    assert_eq!(
        beyond.next.map(|next| next.number),
        Some(5 + MOST_SKIPPED_COUNTED + 1)
    );
}

/// Finding: a cron expression no date matches cost a search to the year 5000 at intake (30
/// February: 6.5 ms; the first of a month that is a last Friday, `+5L`: 35 ms). Now it is
/// refused when read, without a single search, in microseconds.
#[test]
fn a_cron_expression_no_date_matches_is_refused_when_read_without_a_search() {
    let never = [
        "0 0 30 2 *",
        "0 0 31 4,6,9,11 *",
        "0 0 31 2,4,6,9,11 *",
        "0 0 1 * +5L",
        "0 0 L * +1#1",
        "0 0 0 30 2 * 2030",
    ];
    let started = std::time::Instant::now();
    for _ in 0..20 {
        for expression in never {
            let (taken, refused) = steps(|| read_cron(expression));
            assert_eq!(refused, Err(RecurrenceError::NeverOccurs), "{expression}");
            assert_eq!(taken.steps, 0, "{expression}");
        }
    }
    // A coarse guard on the scan of dates, which no step counts: 120 refusals take about
    // 20 ms in a test build (a search to the year 5000 for one of them took up to 35 ms in
    // a release build).
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    // Rare dates are not never: the 29th of February, and the last day of a month that is
    // its fourth Monday (a February of 28 days that starts on a Tuesday).
    let after = utc(2027, 3, 1, 0, 0);
    let leap_day = cron("0 12 29 2 *", "UTC");
    assert_eq!(
        leap_day.rule.next_after(after),
        Some(utc(2028, 2, 29, 12, 0))
    );
    let fourth_monday_last = cron("0 0 L * +1#4", "UTC");
    let next = local(
        fourth_monday_last.rule.next_after(after).expect("one"),
        Tz::UTC,
    );
    assert_eq!(
        (next.month(), next.day(), next.weekday()),
        (2, 28, chrono::Weekday::Mon)
    );
}

/// A search looks [`SEARCH_YEARS`] calendar years ahead and no further: one step each, and a
/// rule with nothing in them has no next occurrence.
#[test]
fn a_search_looks_no_further_than_its_years() {
    let after = utc(2027, 3, 1, 0, 0);
    let within = cron("0 0 0 1 1 * 2036", "UTC");
    let (taken, found) = steps(|| within.rule.next_after(after));
    assert_eq!((taken.steps, found), (1, Some(utc(2036, 1, 1, 0, 0))));
    let beyond = cron("0 0 0 1 1 * 2045", "UTC");
    let (taken, found) = steps(|| beyond.rule.next_after(after));
    assert_eq!((taken.steps, found), (1, None));
    assert!(taken.tries <= 2, "{taken:?}");
    assert_eq!(
        beyond.check(
            after,
            Duration::from_secs(1),
            Duration::from_secs(u64::MAX / 4)
        ),
        Err(RecurrenceError::NeverOccurs)
    );
    assert_eq!(beyond.first(None, after), None);
}

/// A rule that only matches times daylight saving skips (each second of 2 o'clock on the
/// last Sunday of March, in Berlin) made a search step through an hour of seconds a year
/// to the year 5000 (a second and more); now it gives up after [`MOST_WALL_TIMES_TRIED`]
/// wall-clock times. A rule that meets a change of clock on its way, even a change of two
/// hours (Troll, in Antarctica), still finds its next occurrence within that many.
#[test]
fn a_search_tries_a_bounded_number_of_wall_clock_times_and_crosses_any_change_of_clock() {
    let after = utc(2027, 3, 1, 0, 0);
    let skipped_only = cron("* * 2 * 3 0L", "Europe/Berlin");
    let (taken, found) = steps(|| skipped_only.rule.next_after(after));
    assert_eq!(found, None);
    assert!(
        taken.most_tries <= u64::from(MOST_WALL_TIMES_TRIED),
        "{taken:?}"
    );
    let berlin = Tz::Europe__Berlin;
    let troll = Tz::Antarctica__Troll;
    // Just before each change: 01:59:59 in Berlin, 00:59:59 UTC in Troll.
    let before_berlin = utc(2027, 3, 28, 0, 59) + 59_000;
    let before_troll = utc(2027, 3, 28, 0, 59) + 59_000;
    let cases = [
        (
            "* * * * * *",
            berlin,
            before_berlin,
            "2027-03-28 03:00:00 +0200",
        ),
        (
            "* * 2 * * *",
            berlin,
            before_berlin,
            "2027-03-29 02:00:00 +0200",
        ),
        (
            "0 30 2 * * *",
            berlin,
            before_berlin,
            "2027-03-28 03:00:00 +0200",
        ),
        (
            "* * * * * *",
            troll,
            before_troll,
            "2027-03-28 03:00:00 +0200",
        ),
        (
            "* * 1-2 * * *",
            troll,
            before_troll,
            "2027-03-29 01:00:00 +0200",
        ),
    ];
    for (expression, zone, start, wanted) in cases {
        let schedule = cron(expression, zone.name());
        let (taken, found) = steps(|| schedule.rule.next_after(start));
        let found = local(found.expect("an occurrence"), zone)
            .format("%Y-%m-%d %H:%M:%S %z")
            .to_string();
        assert_eq!(found, wanted, "{expression} in {zone}");
        assert!(
            taken.most_tries < u64::from(MOST_WALL_TIMES_TRIED),
            "{expression} in {zone}: {taken:?}"
        );
    }
}

/// Finding: the smallest recurring interval was the smallest level (100 ms by default), so a
/// schedule every 100 ms wrote ten stream entries a second. Now [`MIN_INTERVAL`] is the
/// floor whatever the ladder, and the refusal names the bound that applies.
#[test]
fn no_schedule_repeats_more_often_than_the_smallest_recurring_interval() {
    let now = utc(2027, 3, 1, 0, 0);
    let max = Duration::from_secs(366 * 24 * 3600);
    let default_level = Duration::from_millis(100);
    for period in [
        Duration::from_micros(500),
        Duration::from_millis(100),
        Duration::from_millis(999),
    ] {
        let refused = every(period).check(now, default_level, max);
        assert_eq!(
            refused,
            Err(RecurrenceError::TooFrequent {
                gap: period,
                shortest: ShortestGap::SmallestInterval(MIN_INTERVAL)
            }),
            "{period:?}"
        );
    }
    let refused = every(Duration::from_millis(100))
        .check(now, default_level, max)
        .unwrap_err();
    assert_eq!(
        refused.to_string(),
        "occurrences 100ms apart, closer than the smallest recurring interval (1s)"
    );
    assert_eq!(every(MIN_INTERVAL).check(now, default_level, max), Ok(()));
    assert_eq!(
        cron("* * * * * *", "UTC").check(now, default_level, max),
        Ok(()),
        "every second is just within"
    );
    let level = Duration::from_secs(5);
    let refused = every(Duration::from_secs(2))
        .check(now, level, max)
        .unwrap_err();
    assert_eq!(
        refused.to_string(),
        "occurrences 2s apart, closer than the smallest level (5s): such a schedule would never rest in a level"
    );
    let (taken, _) = steps(|| cron("* * * * * *", "UTC").check(now, level, max));
    assert!(taken.steps <= GAP_SAMPLES as u64, "{taken:?}");
}

/// Finding: a refusal showed a header value in Rust's debug form (`"LongInt(-5)"`), and
/// whole: a 100 KiB header made a 100 KiB detail. Now a value shows as a publisher writes
/// it, and at most 64 characters of it.
#[test]
fn a_refusal_shows_a_value_as_a_publisher_writes_it_and_cuts_it_short() {
    let refusal = |entries: &[Entry]| read(entries).expect_err("refused").to_string();
    let huge = "9".repeat(100 * 1024);
    let cases: Vec<(Vec<Entry>, &str)> = vec![
        (
            vec![(header::EVERY, AMQPValue::LongInt(-5))],
            "x-repeat-every -5 is not a duration",
        ),
        (
            vec![(header::EVERY, AMQPValue::Boolean(true))],
            "x-repeat-every true is not a duration",
        ),
        (
            vec![(header::EVERY, AMQPValue::FieldTable(FieldTable::default()))],
            "x-repeat-every a field table is not a duration",
        ),
        (
            vec![(header::EVERY, text("soon \"ish\"\n"))],
            r#"x-repeat-every "soon \"ish\"\n" is not a duration"#,
        ),
        (
            vec![
                (header::CRON, text("0 8 * * *")),
                (header::TIME_ZONE, AMQPValue::LongLongInt(2)),
            ],
            "x-repeat-tz 2 is not an IANA time zone",
        ),
        (
            vec![(header::CRON, AMQPValue::LongLongInt(5))],
            "x-repeat-cron 5 is not a cron expression: a cron expression is text",
        ),
        (
            vec![
                (header::EVERY, text("5m")),
                (header::COUNT, AMQPValue::Double(1.5)),
            ],
            "x-repeat-count: 1.5 is not a whole number of at least 1",
        ),
        (
            vec![
                (header::EVERY, text("5m")),
                (
                    header::COUNT,
                    AMQPValue::DecimalValue(lapin::types::DecimalValue {
                        scale: 2,
                        value: 150,
                    }),
                ),
            ],
            "x-repeat-count: 1.50 is not a whole number of at least 1",
        ),
        (
            vec![
                (header::EVERY, text("5m")),
                (header::UNTIL, AMQPValue::LongLongInt(5)),
            ],
            "x-repeat-until: 5 is neither epoch milliseconds",
        ),
        (
            vec![(header::EVERY, text(&huge))],
            "x-repeat-every \"9999999999999999999999999999999999999999999999999999999999999999…\" is not a duration",
        ),
    ];
    for (entries, wanted) in cases {
        let said = refusal(&entries);
        assert!(
            said.starts_with(wanted),
            "{said:?} does not start {wanted:?}"
        );
    }
    // Every value a publisher can send makes a short detail, and none shows Rust's names.
    let long_text = format!("{huge}\u{1b}\"é");
    for value in [
        text(&long_text),
        AMQPValue::ShortString(long_text[..200].into()),
        AMQPValue::LongString(LongString::from(vec![0xff_u8; 100 * 1024])),
        AMQPValue::Double(1e300),
        AMQPValue::Float(f32::MAX),
        AMQPValue::ByteArray(vec![1_u8; 100 * 1024].into()),
        AMQPValue::FieldArray(vec![AMQPValue::Void; 1024].into()),
        AMQPValue::Timestamp(5),
        AMQPValue::Void,
    ] {
        for name in [header::EVERY, header::CRON, header::UNTIL, header::COUNT] {
            let mut entries = vec![(name, value.clone())];
            if name != header::EVERY && name != header::CRON {
                entries.push((header::EVERY, text("5m")));
            }
            let said = refusal(&entries);
            assert!(said.chars().count() < 300, "{name}: {} chars", said.len());
            for debug in [
                "LongString",
                "ShortString",
                "Double(",
                "Float(",
                "ByteArray",
                "FieldArray",
                "Timestamp(",
                "Void",
            ] {
                assert!(!said.contains(debug), "{name}: {said}");
            }
        }
        let zone = read(&[
            (header::CRON, text("0 8 * * *")),
            (header::TIME_ZONE, value.clone()),
        ]);
        assert!(
            matches!(&zone, Err(RecurrenceError::UnknownZone(shown)) if shown.chars().count() <= 70),
            "{zone:?}"
        );
    }
}

/// The carrier may check a schedule's limits at every occurrence: the check refuses a
/// running schedule beyond this bridge's limits (one an older bridge took in), takes a
/// bounded number of steps, and passes a schedule whose last occurrence is the next.
#[test]
fn the_check_is_cheap_enough_for_every_occurrence_and_passes_a_schedule_that_ends() {
    let now = utc(2027, 3, 1, 0, 0);
    let level = Duration::from_millis(100);
    let max = Duration::from_secs(366 * 24 * 3600);
    assert!(matches!(
        every(Duration::from_millis(100)).check(now, level, max),
        Err(RecurrenceError::TooFrequent { .. })
    ));
    for expression in [
        "* * * * * *",
        "*/5 * * * *",
        "0 8 * * 1-5",
        "@yearly",
        "0 12 29 2 *",
    ] {
        let schedule = cron(expression, "Europe/Berlin");
        let (taken, _) = steps(|| schedule.check(now, level, max));
        assert!(taken.steps <= GAP_SAMPLES as u64, "{expression}: {taken:?}");
    }
    // A leap-day rule is refused after its first gap: two steps, not 64 leap days.
    let (taken, refused) = steps(|| cron("0 12 29 2 *", "UTC").check(now, level, max));
    assert!(matches!(refused, Err(RecurrenceError::TooRare { .. })));
    assert_eq!(taken.steps, 2);
    // The last but one occurrence of a rule that ends: one more to come, nothing to refuse.
    let ending = cron("0 0 0 1 1 * 2028,2029", "UTC");
    assert_eq!(ending.check(utc(2028, 1, 1, 0, 0), level, max), Ok(()));
}

/// Zones with daylight saving changes of an hour (both hemispheres) and of half an hour.
const ZONES: [Tz; 5] = [
    Tz::Europe__Berlin,
    Tz::America__New_York,
    Tz::Australia__Sydney,
    Tz::Australia__Lord_Howe,
    Tz::America__Santiago,
];

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// A fixed daily time runs once on every local calendar day, daylight saving or not: at
    /// that wall-clock time when the day has it (the first of the two when a change repeats
    /// it), and right after the change when the change skips it.
    #[test]
    fn a_fixed_daily_time_runs_once_every_local_day_across_daylight_saving(
        zone in prop::sample::select(ZONES.to_vec()),
        hour in 0u32..24,
        minute in prop::sample::select(vec![0u32, 15, 30, 45]),
        start_day in 0u64..3_000,
    ) {
        let schedule = cron(&format!("{minute} {hour} * * *"), zone.name());
        let start = utc(2024, 1, 1, 0, 0) + start_day * DAY;
        let found = occurrences(&schedule.rule, start, 400);
        let wanted = NaiveTime::from_hms_opt(hour, minute, 0).unwrap();
        for pair in found.windows(2) {
            let (a, b) = (local(pair[0], zone), local(pair[1], zone));
            prop_assert_eq!(b.date_naive(), a.date_naive().succ_opt().unwrap(), "{} then {}", a, b);
        }
        for &ms in &found {
            let at = local(ms, zone);
            match zone.from_local_datetime(&at.date_naive().and_time(wanted)) {
                chrono::LocalResult::Single(exact) => prop_assert_eq!(at, exact),
                chrono::LocalResult::Ambiguous(first, _) => prop_assert_eq!(at, first),
                chrono::LocalResult::None => {
                    // In the gap: the first instant after it (a second before, the wall
                    // clock is before the wanted time, on that day or, for a gap at
                    // midnight, the day before).
                    let wanted_at = at.date_naive().and_time(wanted);
                    let before = local(ms - 1_000, zone);
                    prop_assert!(
                        at.naive_local() > wanted_at && before.naive_local() < wanted_at,
                        "{} (before: {})",
                        at,
                        before
                    );
                }
            }
        }
    }

    /// Every half hour on the wall clock is every half hour of elapsed time, across every
    /// change of these zones (each moves the clock by 30 or 60 minutes): nothing is doubled
    /// when the clock goes back, nothing is bunched when it goes forward.
    #[test]
    fn every_half_hour_on_the_wall_clock_is_every_half_hour_of_elapsed_time(
        zone in prop::sample::select(ZONES.to_vec()),
        start_day in 0u64..3_000,
    ) {
        let schedule = cron("*/30 * * * *", zone.name());
        let start = utc(2024, 1, 1, 0, 0) + start_day * DAY;
        // Two weeks: at least one change for any start near one.
        let found = occurrences(&schedule.rule, start, 14 * 48);
        for pair in found.windows(2) {
            prop_assert_eq!(pair[1] - pair[0], 30 * MINUTE, "{} then {}", local(pair[0], zone), local(pair[1], zone));
        }
    }

    /// A leap-day schedule from any year runs next on the 29th of February of a leap year.
    #[test]
    fn a_leap_day_schedule_from_any_year_runs_on_a_leap_day(year in 2001i32..2090, day in 0u32..365) {
        let start = NaiveDate::from_yo_opt(year, day + 1).unwrap_or(NaiveDate::from_ymd_opt(year, 12, 31).unwrap());
        let start_ms = Utc.from_utc_datetime(&start.and_hms_opt(0, 0, 0).unwrap()).timestamp_millis() as u64;
        let next = local(cron("0 12 29 2 *", "UTC").rule.next_after(start_ms).unwrap(), Tz::UTC);
        prop_assert_eq!((next.month(), next.day(), next.hour()), (2, 29, 12));
        prop_assert!(NaiveDate::from_ymd_opt(next.year(), 2, 29).is_some());
        prop_assert!(next.year() - year <= 8);
    }

    /// Delivering an interval's occurrence at any time after it is due skips exactly the
    /// occurrences due by then, and the next one is due within a period of now, after it.
    #[test]
    fn an_intervals_next_occurrence_comes_within_a_period_of_any_delivery(
        period_s in 1u64..100_000,
        number in 1u64..1_000,
        late_ms in 0u64..10_000_000_000,
    ) {
        let period = period_s * 1_000;
        let due = utc(2027, 1, 1, 0, 0);
        let current = Occurrence { number, due_ms: due };
        let now = due + late_ms;
        let delivering = every(Duration::from_millis(period)).delivering(current, now);
        let next = delivering.next.unwrap();
        prop_assert_eq!(delivering.skipped, late_ms / period);
        prop_assert_eq!(next.number, number + delivering.skipped + 1);
        prop_assert!(next.due_ms > now && next.due_ms <= now + period);
    }

    /// Delivering a cron occurrence late never skips one due after now: the next is the
    /// rule's first occurrence after now, and the skipped ones are those in between.
    #[test]
    fn a_late_cron_occurrence_is_followed_by_the_first_one_after_now(
        zone in prop::sample::select(ZONES.to_vec()),
        late_minutes in 0u64..20_000,
    ) {
        let schedule = cron("0 */6 * * *", zone.name());
        let first = schedule.rule.next_after(utc(2027, 3, 1, 0, 0)).unwrap();
        let current = Occurrence { number: 1, due_ms: first };
        let now = first + late_minutes * MINUTE;
        let delivering = schedule.delivering(current, now);
        let next = delivering.next.unwrap();
        if delivering.skipped == 0 {
            prop_assert_eq!(Some(next.due_ms), schedule.rule.next_after(first));
        } else {
            prop_assert_eq!(Some(next.due_ms), schedule.rule.next_after(now));
        }
        prop_assert!(next.due_ms > now);
        prop_assert_eq!(delivering.skipped, schedule.rule.count_between(first, now, u64::MAX));
    }
}
