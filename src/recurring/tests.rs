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
            |e| matches!(e, RecurrenceError::UnknownZone(zone) if zone == "Mars/Olympus"),
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
        cron("0 0 30 2 *", "UTC").check(now, level, max),
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
