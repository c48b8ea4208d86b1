//! The wire contract of recurring schedules: the headers a publisher sets, read into a
//! [`Recurrence`], and the headers each delivered occurrence carries.

use std::str::FromStr;
use std::time::Duration;

use chrono_tz::Tz;
use croner::Cron;
use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, ShortString};

use super::{Delivering, Occurrence, Recurrence, RecurrenceError, Rule, some_date_matches};
use crate::contract::value::{as_integer, as_text, parse_deliver_at_in};

/// Header names of recurring schedules.
pub mod header {
    /// Repeat every interval: a duration (`5m`, `1h30m`, `@every 10m`) or milliseconds.
    pub const EVERY: &str = "x-repeat-every";
    /// Repeat on a cron expression (five fields, or six with seconds first; `@daily` and
    /// the other nicknames too).
    pub const CRON: &str = "x-repeat-cron";
    /// The IANA time zone a cron expression is read in (`Europe/Berlin`); UTC when absent.
    pub const TIME_ZONE: &str = "x-repeat-tz";
    /// No occurrence after this time: epoch milliseconds or RFC 3339.
    pub const UNTIL: &str = "x-repeat-until";
    /// At most this many occurrences.
    pub const COUNT: &str = "x-repeat-count";
    /// On a delivered occurrence: its number, from 1.
    pub const OCCURRENCE: &str = "x-occurrence";
    /// On a delivered occurrence: when it was due, epoch ms.
    pub const OCCURRENCE_DUE: &str = "x-occurrence-due";
    /// On a delivered occurrence that stands for later ones also due by then: `true`.
    pub const OCCURRENCE_LATE: &str = "x-occurrence-late";
    /// On a late occurrence: how many occurrences after it were skipped.
    pub const SKIPPED: &str = "x-occurrences-skipped";
}

impl Recurrence {
    /// The schedule `headers` describe, `None` for a message that does not repeat.
    /// `has_id` says whether the message has a `message_id`, which a schedule needs.
    pub fn from_headers(
        headers: &FieldTable,
        has_id: bool,
    ) -> Result<Option<Recurrence>, RecurrenceError> {
        let get = |name: &str| headers.inner().get(name);
        let rule = match (get(header::EVERY), get(header::CRON)) {
            (Some(_), Some(_)) => return Err(RecurrenceError::TwoRules),
            (Some(every), None) => {
                if get(header::TIME_ZONE).is_some() {
                    return Err(RecurrenceError::ZoneForInterval);
                }
                Rule::Every(interval(every)?)
            }
            (None, Some(cron)) => cron_rule(cron, get(header::TIME_ZONE))?,
            (None, None) => {
                return match [header::TIME_ZONE, header::UNTIL, header::COUNT]
                    .into_iter()
                    .find(|name| get(name).is_some())
                {
                    Some(name) => Err(RecurrenceError::NoRule(name)),
                    None => Ok(None),
                };
            }
        };
        if !has_id {
            return Err(RecurrenceError::NoId);
        }
        let until_ms = get(header::UNTIL).map(until).transpose()?;
        let count = get(header::COUNT).map(count).transpose()?;
        Ok(Some(Recurrence {
            rule,
            until_ms,
            count,
        }))
    }
}

/// `properties` of a delivered `occurrence` with its number and due time, and, when it
/// stands for later ones ([`Delivering::late`]), that it is late and how many it skipped.
pub fn with_occurrence(
    properties: BasicProperties,
    occurrence: Occurrence,
    delivering: &Delivering,
) -> BasicProperties {
    let mut table = properties
        .headers()
        .as_ref()
        .map(|h| h.inner().clone())
        .unwrap_or_default();
    let int = |v: u64| AMQPValue::LongLongInt(i64::try_from(v).unwrap_or(i64::MAX));
    table.insert(
        ShortString::from(header::OCCURRENCE),
        int(occurrence.number),
    );
    table.insert(
        ShortString::from(header::OCCURRENCE_DUE),
        int(occurrence.due_ms),
    );
    if delivering.late() {
        table.insert(
            ShortString::from(header::OCCURRENCE_LATE),
            AMQPValue::Boolean(true),
        );
        table.insert(ShortString::from(header::SKIPPED), int(delivering.skipped));
    }
    properties.with_headers(FieldTable::from(table))
}

/// `x-repeat-every`: a duration, optionally after `@every `, or whole milliseconds.
fn interval(value: &AMQPValue) -> Result<Duration, RecurrenceError> {
    let period = match as_integer(value) {
        Some(ms) => u64::try_from(ms).ok().map(Duration::from_millis),
        None => as_text(value).and_then(|text| {
            let text = text.trim();
            let text = text.strip_prefix("@every").unwrap_or(text).trim();
            match text.parse::<u64>() {
                Ok(ms) => Some(Duration::from_millis(ms)),
                Err(_) => humantime::parse_duration(text).ok(),
            }
        }),
    };
    period
        .filter(|period| !period.is_zero())
        .ok_or_else(|| RecurrenceError::BadInterval(shown(value)))
}

/// `x-repeat-cron` read in `x-repeat-tz` (UTC when absent). An expression no date matches
/// (30 February) is refused here, before any search for its occurrences.
fn cron_rule(cron: &AMQPValue, zone: Option<&AMQPValue>) -> Result<Rule, RecurrenceError> {
    let bad_cron = |reason: &str| RecurrenceError::BadCron {
        expression: shown(cron),
        reason: cut_short(reason),
    };
    let expression = as_text(cron).ok_or_else(|| bad_cron("a cron expression is text"))?;
    let parsed = Cron::from_str(&expression).map_err(|e| bad_cron(&e.to_string()))?;
    if !some_date_matches(&parsed) {
        return Err(RecurrenceError::NeverOccurs);
    }
    let zone = match zone {
        None => Tz::UTC,
        Some(value) => {
            let name = as_text(value).unwrap_or_default();
            Tz::from_str(name.trim()).map_err(|_| RecurrenceError::UnknownZone(shown(value)))?
        }
    };
    Ok(Rule::Cron {
        expression,
        cron: Box::new(parsed),
        zone,
    })
}

/// `x-repeat-count`: a whole number of at least 1.
fn count(value: &AMQPValue) -> Result<u64, RecurrenceError> {
    let count = as_integer(value).or_else(|| as_text(value)?.trim().parse::<i64>().ok());
    count
        .and_then(|count| u64::try_from(count).ok())
        .filter(|count| *count >= 1)
        .ok_or_else(|| RecurrenceError::BadEnd {
            name: header::COUNT,
            reason: format!("{} is not a whole number of at least 1", shown(value)),
        })
}

/// `x-repeat-until`: epoch milliseconds (from 2001) or an RFC 3339 time, from 1970.
fn until(value: &AMQPValue) -> Result<u64, RecurrenceError> {
    parse_deliver_at_in(header::UNTIL, value)
        .ok()
        .and_then(|ms| u64::try_from(ms).ok())
        .ok_or_else(|| RecurrenceError::BadEnd {
            name: header::UNTIL,
            reason: format!(
                "{} is neither epoch milliseconds from 2001 on nor an RFC 3339 time (for example `2027-01-15T08:00:00Z`)",
                shown(value)
            ),
        })
}

/// At most this many characters of a header value, or of what a parser said about it, go
/// into the detail of a refusal (then `…`): a refusal is logged and parked with its detail,
/// which must not grow with what a publisher sent.
const MOST_SHOWN_CHARS: usize = 64;

/// A header value as the detail of a refusal shows it, as a publisher would write it: text
/// in quotes (escaped, cut short after [`MOST_SHOWN_CHARS`]), a number in digits, `true` or
/// `false`, and any other type by its name.
pub(super) fn shown(value: &AMQPValue) -> String {
    match value {
        AMQPValue::ShortShortInt(number) => number.to_string(),
        AMQPValue::ShortShortUInt(number) => number.to_string(),
        AMQPValue::ShortInt(number) => number.to_string(),
        AMQPValue::ShortUInt(number) => number.to_string(),
        AMQPValue::LongInt(number) => number.to_string(),
        AMQPValue::LongUInt(number) => number.to_string(),
        AMQPValue::LongLongInt(number) => number.to_string(),
        AMQPValue::Float(number) => cut_short(&number.to_string()),
        AMQPValue::Double(number) => cut_short(&number.to_string()),
        AMQPValue::DecimalValue(decimal) => {
            let scale = usize::from(decimal.scale);
            let digits = format!("{:0>width$}", decimal.value, width = scale + 1);
            let (whole, fraction) = digits.split_at(digits.len() - scale);
            cut_short(&match fraction {
                "" => whole.to_string(),
                _ => format!("{whole}.{fraction}"),
            })
        }
        AMQPValue::Boolean(flag) => flag.to_string(),
        AMQPValue::ShortString(text) => quoted(text.as_str().as_bytes()),
        AMQPValue::LongString(text) => quoted(text.as_bytes()),
        AMQPValue::Timestamp(seconds) => format!("the timestamp {seconds}"),
        AMQPValue::FieldTable(_) => "a field table".to_string(),
        AMQPValue::FieldArray(_) => "a field array".to_string(),
        AMQPValue::ByteArray(_) => "a byte array".to_string(),
        AMQPValue::Void => "no value (void)".to_string(),
    }
}

/// `text` (UTF-8; a byte that is not, as `�`) in double quotes, a double quote, a backslash
/// or a control character in it escaped as in Rust (`\"`, `\\`, `\n`, `\u{1b}`), cut short
/// after [`MOST_SHOWN_CHARS`] characters of the escaped text. Only its first bytes are read.
fn quoted(text: &[u8]) -> String {
    // Enough bytes for one character more than is shown (a character is at most 4 bytes).
    let read = &text[..text.len().min(4 * (MOST_SHOWN_CHARS + 1))];
    let mut escaped = String::new();
    for character in String::from_utf8_lossy(read).chars() {
        if character == '"' || character == '\\' || character.is_control() {
            escaped.extend(character.escape_debug());
        } else {
            escaped.push(character);
        }
    }
    format!("\"{}\"", cut_short(&escaped))
}

/// `text` cut after [`MOST_SHOWN_CHARS`] characters, with `…` for what was cut.
fn cut_short(text: &str) -> String {
    match text.char_indices().nth(MOST_SHOWN_CHARS) {
        Some((end, _)) => format!("{}…", &text[..end]),
        None => text.to_string(),
    }
}
