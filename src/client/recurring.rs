//! Recurring schedules from the typed client: the `x-repeat-*` headers set on a message,
//! checked here as the bridges will read them, and published with the first occurrence's
//! due time.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};

use super::{Client, ClientError, Message, Scheduled, When};
use crate::clock::now_ms;
use crate::recurring::{Recurrence, RecurrenceError, header};

/// Where a recurring schedule ends: at a time, after a count of occurrences, whichever
/// comes first; `Repeat::default()` runs until cancelled.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Repeat {
    /// No occurrence after this time.
    pub until: Option<SystemTime>,
    /// At most this many occurrences (at least 1).
    pub count: Option<u64>,
}

impl Client {
    /// Schedules `message` (its `message_id` is the schedule's id) every `every`, by
    /// elapsed time, the first occurrence `every` from now, until `repeat` ends it or a
    /// [`Client::cancel`] of the id stops it. Scheduling under an id that runs replaces
    /// that schedule. An interval below [`crate::recurring::MIN_INTERVAL`] is refused here;
    /// bridges also refuse (park `bad-schedule`) one below their smallest level or above
    /// their `max_delay`.
    pub async fn schedule_every(
        &self,
        message: Message,
        every: Duration,
        repeat: Repeat,
    ) -> Result<Scheduled, ClientError> {
        let every_ms = i64::try_from(every.as_millis()).unwrap_or(i64::MAX);
        let rule = vec![(header::EVERY, AMQPValue::LongLongInt(every_ms))];
        self.schedule_recurring(message, rule, repeat).await
    }

    /// Schedules `message` (its `message_id` is the schedule's id) whenever the cron
    /// `expression` matches the wall clock of the IANA `zone` (`"UTC"`, `"Europe/Berlin"`),
    /// from its first match after now, until `repeat` ends it or a [`Client::cancel`] of
    /// the id stops it. Scheduling under an id that runs replaces that schedule.
    pub async fn schedule_cron(
        &self,
        message: Message,
        expression: &str,
        zone: &str,
        repeat: Repeat,
    ) -> Result<Scheduled, ClientError> {
        let text = |s: &str| AMQPValue::LongString(LongString::from(s));
        let rule = vec![
            (header::CRON, text(expression)),
            (header::TIME_ZONE, text(zone)),
        ];
        self.schedule_recurring(message, rule, repeat).await
    }

    /// Sets the rule and the end on `message`, checks them as a bridge reads them, and
    /// schedules it at its first occurrence.
    async fn schedule_recurring(
        &self,
        mut message: Message,
        rule: Vec<(&str, AMQPValue)>,
        repeat: Repeat,
    ) -> Result<Scheduled, ClientError> {
        if message.message_id().is_none() {
            return Err(ClientError::NoMessageId);
        }
        let mut headers = message.headers();
        for (name, value) in rule {
            headers.insert(ShortString::from(name), value);
        }
        if let Some(until) = repeat.until {
            let ms = until
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
            headers.insert(ShortString::from(header::UNTIL), AMQPValue::LongLongInt(ms));
        }
        if let Some(count) = repeat.count {
            let count = i64::try_from(count).unwrap_or(i64::MAX);
            headers.insert(
                ShortString::from(header::COUNT),
                AMQPValue::LongLongInt(count),
            );
        }
        let headers = FieldTable::from(headers);
        let recurrence = Recurrence::from_headers(&headers, true)?
            .ok_or(ClientError::BadSchedule(RecurrenceError::NeverOccurs))?;
        // The bridges' smallest level and maximum delay are theirs; the smallest recurring
        // interval holds everywhere.
        recurrence.check(now_ms(), Duration::ZERO, Duration::MAX)?;
        let first = recurrence
            .first(None, now_ms())
            .ok_or(ClientError::BadSchedule(RecurrenceError::NeverOccurs))?;
        message.properties = message.properties.with_headers(headers);
        let at = UNIX_EPOCH + Duration::from_millis(first.due_ms);
        self.schedule(message, When::At(at)).await
    }
}
