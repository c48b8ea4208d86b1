//! Decoding a consumed delivery into an [`Envelope`], or the reason to park it.

use std::collections::BTreeMap;
use std::time::Duration;

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, ShortString};

use super::value::{as_integer, as_text, parse_delay_in, parse_deliver_at_in, parse_published_at};
use super::{
    Envelope, Incoming, Intake, PERSISTENT, ParkReason, Parked, Properties, Stash, header,
};
use crate::recurring::{Occurrence, Recurrence, RecurrenceError};

/// Reads a consumed delivery: a new message from an ingress exchange, or one coming back
/// from a level through the work exchange.
pub fn decode(
    incoming: Incoming<'_>,
    now_ms: u64,
    intake: &Intake<'_>,
) -> Result<Envelope, Parked> {
    let consumed = incoming.properties;
    let no_headers = FieldTable::default();
    let headers = consumed.headers().as_ref().unwrap_or(&no_headers);
    if incoming.exchange == intake.work_exchange {
        return decode_in_flight(consumed, headers, intake);
    }
    let route = intake
        .routes
        .iter()
        .find(|r| r.ingress == incoming.exchange)
        .ok_or_else(|| {
            Parked::new(
                ParkReason::UnknownRoute,
                format!(
                    "arrived through exchange `{}`, which is no route's ingress exchange",
                    incoming.exchange
                ),
            )
        })?;
    let deliver_at = due_time(headers, now_ms, intake.max_delay)?;
    // A publish time ahead of the bridge's clock counts as its now plus the clock
    // allowance, as a cancel's time does: a publisher whose copy entered later than any
    // cancel could name would make it uncancellable, and a client a little ahead (a
    // reschedule is published a millisecond after its own cancel) must stay after it.
    let entered_at = match headers.inner().get(header::PUBLISHED_AT) {
        None => now_ms,
        Some(value) => parse_published_at(value)
            .map_err(|detail| Parked::new(ParkReason::BadPublishedAt, detail))?
            .min(now_ms.saturating_add(crate::cancel::CLOCK_ALLOWANCE_MS)),
    };
    let first = first_occurrence(headers, consumed, deliver_at, now_ms, intake)?;
    let (properties, stash) = split_publisher_properties(consumed);
    Ok(Envelope {
        deliver_at: first.map_or(deliver_at, |o| o.due_ms),
        target: route.target.clone(),
        routing_key: incoming.routing_key.clone(),
        hops: 0,
        first_seen: now_ms,
        entered_at,
        properties,
        stash,
        occurrence: first.map(|o| o.number),
        born: 0,
    })
}

/// The first occurrence of a recurring schedule (`None` for a message that does not
/// repeat): at the publisher's due time when it gave one, else the rule's first after now.
/// A schedule the bridge refuses is parked `bad-schedule`.
fn first_occurrence(
    headers: &FieldTable,
    raw: &BasicProperties,
    deliver_at: u64,
    now_ms: u64,
    intake: &Intake<'_>,
) -> Result<Option<Occurrence>, Parked> {
    let refused = |e: RecurrenceError| Parked::new(ParkReason::BadSchedule, e.to_string());
    let has_id = raw
        .message_id()
        .as_ref()
        .is_some_and(|id| !id.as_str().is_empty());
    let Some(recurrence) = Recurrence::from_headers(headers, has_id).map_err(refused)? else {
        return Ok(None);
    };
    recurrence
        .check(now_ms, intake.smallest_level, intake.max_delay)
        .map_err(refused)?;
    let gave_due_time = header::DUE_TIME
        .iter()
        .any(|name| headers.inner().contains_key(*name));
    let first = recurrence
        .first(gave_due_time.then_some(deliver_at), now_ms)
        .ok_or_else(|| refused(RecurrenceError::NeverOccurs))?;
    // The rule's first occurrence, like any due time, within the maximum delay (the gaps
    // `check` looks at come after it: `* * * 1 *` in November is due in January).
    let wait = Duration::from_millis(first.due_ms.saturating_sub(now_ms));
    if beyond_max_delay(wait, intake.max_delay) {
        return Err(refused(RecurrenceError::TooRare {
            gap: wait,
            max_delay: intake.max_delay,
        }));
    }
    Ok(Some(first))
}

fn decode_in_flight(
    raw: &BasicProperties,
    headers: &FieldTable,
    intake: &Intake<'_>,
) -> Result<Envelope, Parked> {
    let get = |name: &str| headers.inner().get(name);
    let int = |name: &str| -> Result<u64, Parked> {
        match get(name).and_then(as_integer) {
            Some(v) if v >= 0 => Ok(v as u64),
            _ => Err(bad_state(name)),
        }
    };
    let text = |name: &str| -> Result<Option<String>, Parked> {
        match get(name) {
            None => Ok(None),
            Some(v) => as_text(v).map(Some).ok_or_else(|| bad_state(name)),
        }
    };
    let short = |name: &str| -> Result<Option<ShortString>, Parked> {
        text(name)?
            .map(|s| ShortString::try_new(s).map_err(|_| bad_state(name)))
            .transpose()
    };
    let deliver_at = int(header::STATE_DELIVER_AT)?;
    let target = text(header::STATE_TARGET)?.ok_or_else(|| bad_state(header::STATE_TARGET))?;
    let routing_key =
        short(header::STATE_ROUTING_KEY)?.ok_or_else(|| bad_state(header::STATE_ROUTING_KEY))?;
    if !intake.routes.iter().any(|r| r.target == target) {
        return Err(Parked::new(
            ParkReason::TargetNotAllowed,
            format!("target exchange `{target}` is not the target of any configured route"),
        ));
    }
    let delivery_mode = match get(header::STATE_DELIVERY_MODE) {
        None => Some(PERSISTENT),
        Some(v) => match as_integer(v) {
            Some(0) => None,
            Some(m) if (1..=255).contains(&m) => Some(m as u8),
            _ => return Err(bad_state(header::STATE_DELIVERY_MODE)),
        },
    };
    // A copy that hopped before `CC` was set aside still carries it: keep it for delivery.
    let (properties, travelling) = split_publisher_properties(raw);
    let stash = Stash {
        expiration: short(header::STATE_EXPIRATION)?,
        user_id: short(header::STATE_USER_ID)?,
        delivery_mode,
        cc: get(header::STATE_CC).cloned().or(travelling.cc),
        bcc: get(header::STATE_BCC).cloned().or(travelling.bcc),
    };
    let hops = int(header::STATE_HOPS)?.min(u64::from(u32::MAX)) as u32;
    let first_seen = int(header::STATE_FIRST_SEEN)?;
    let entered_at = match get(header::STATE_ENTERED_AT) {
        None => first_seen,
        Some(_) => int(header::STATE_ENTERED_AT)?,
    };
    let occurrence = match get(header::STATE_OCCURRENCE) {
        None => None,
        Some(_) => Some(int(header::STATE_OCCURRENCE)?),
    };
    let born = match (occurrence, get(header::STATE_BORN)) {
        (Some(_), Some(_)) => int(header::STATE_BORN)?,
        _ => 0,
    };
    Ok(Envelope {
        deliver_at,
        target,
        routing_key,
        hops,
        first_seen,
        entered_at,
        properties,
        stash,
        occurrence,
        born,
    })
}

fn bad_state(name: &str) -> Parked {
    Parked::new(
        ParkReason::BadState,
        format!("bridge header `{name}` is missing or malformed"),
    )
}

/// The due time of a new message: the first header of [`header::DUE_TIME`] present
/// decides (an absolute time, `x-deliver-at` or `x-opt-delivery-time`, before a delay,
/// `x-delay` or `x-opt-delivery-delay`); none means now. A bad value in the deciding header
/// parks the message, even when a later one would do.
fn due_time(headers: &FieldTable, now_ms: u64, max_delay: Duration) -> Result<u64, Parked> {
    let max_ms = max_delay.as_millis() as u64;
    let beyond = |wait_ms: u64| beyond_max_delay(Duration::from_millis(wait_ms), max_delay);
    let too_long = |what: String| {
        Parked::new(
            ParkReason::DelayTooLong,
            format!(
                "{what} is beyond the maximum delay of {} ({max_ms} ms)",
                crate::ladder::format_duration(max_delay)
            ),
        )
    };
    let Some((name, value)) = header::DUE_TIME
        .iter()
        .find_map(|name| headers.inner().get(*name).map(|value| (*name, value)))
    else {
        return Ok(now_ms);
    };
    if name == header::DELIVER_AT || name == header::OPT_DELIVERY_TIME {
        let at = parse_deliver_at_in(name, value)
            .map_err(|detail| Parked::new(ParkReason::BadDeliverAt, detail))?;
        let at = u64::try_from(at).unwrap_or(0);
        if beyond(at.saturating_sub(now_ms)) {
            return Err(too_long(format!("{name} {at}")));
        }
        return Ok(at.max(now_ms));
    }
    let delay =
        parse_delay_in(name, value).map_err(|detail| Parked::new(ParkReason::BadDelay, detail))?;
    if delay <= 0 {
        return Ok(now_ms);
    }
    if u64::try_from(delay).map_or(true, beyond) {
        return Err(too_long(format!("{name} {delay} ms")));
    }
    Ok(now_ms + delay as u64)
}

/// Whether a message due `wait` from now is parked `delay-too-long` by a bridge whose
/// `delays.max_delay` is `max_delay` (a wait of exactly `max_delay` is taken). The typed
/// client refuses the same waits before publishing.
pub fn beyond_max_delay(wait: Duration, max_delay: Duration) -> bool {
    wait > max_delay
}

/// A work-queue delivery the broker has redelivered `limit` times or more (quorum queues
/// count failed deliveries in `x-delivery-count`): parked `redelivery-limit` before the
/// broker's own delivery limit would dead-letter it without a reason.
pub fn redelivered_too_often(properties: &BasicProperties, limit: i64) -> Option<Parked> {
    let count = properties
        .headers()
        .as_ref()?
        .inner()
        .get(header::DELIVERY_COUNT)
        .and_then(as_integer)?;
    (count >= limit).then(|| {
        Parked::new(
            ParkReason::RedeliveryLimit,
            format!(
                "redelivered {count} times (x-delivery-count) without being settled; parked so it cannot stall the bridge"
            ),
        )
    })
}

/// Publisher headers minus what dead-lettering adds and what the bridge itself writes.
fn publisher_headers(headers: &FieldTable) -> BTreeMap<ShortString, AMQPValue> {
    headers
        .inner()
        .iter()
        .filter(|(k, _)| {
            let k = k.as_str();
            !k.starts_with(header::BRIDGE_PREFIX)
                && !header::DEATH_PREFIXES.iter().any(|p| k.starts_with(p))
        })
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// Splits consumed properties into what travels (cleaned) and what is set aside.
fn split_publisher_properties(consumed: &BasicProperties) -> (Properties, Stash) {
    let mut raw = Properties::without_headers(consumed);
    let mut headers = consumed.headers().as_ref().map(publisher_headers);
    let mut take = |name: &str| headers.as_mut().and_then(|h| h.remove(name));
    let stash = Stash {
        expiration: raw.expiration.take(),
        user_id: raw.user_id.take(),
        delivery_mode: raw.delivery_mode.take(),
        cc: take(header::CC),
        bcc: take(header::BCC),
    };
    raw.headers = headers.map(FieldTable::from);
    (raw, stash)
}
