//! The wire contract (v1): headers and properties in, and out.
//!
//! [`decode`] turns a consumed delivery into an [`Envelope`] (when it is due, where it goes,
//! what the publisher sent) or a [`Parked`] reason. [`hop_properties`],
//! [`delivery_properties`] and [`parked_properties`] build what is published next. Pure:
//! no I/O, the clock is a parameter.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};

use crate::config::Route;

/// Header names of the contract.
pub mod header {
    /// The delay in milliseconds, as the delayed-message plugin reads it.
    pub const DELAY: &str = "x-delay";
    /// An absolute due time: epoch milliseconds or an RFC 3339 string. Wins over `x-delay`.
    pub const DELIVER_AT: &str = "x-deliver-at";
    /// When the publisher published the message, epoch ms (the typed client sets it). A
    /// cancel drops the copies that entered before it: this header, when present, is when
    /// the copy entered; otherwise the moment the bridge first read it.
    pub const PUBLISHED_AT: &str = "x-published-at";
    /// Prefix of every header the bridge itself writes.
    pub const BRIDGE_PREFIX: &str = "delay-bridge-";
    /// Bridge state: the due time, epoch ms.
    pub const STATE_DELIVER_AT: &str = "delay-bridge-deliver-at";
    /// Bridge state: the target exchange.
    pub const STATE_TARGET: &str = "delay-bridge-target";
    /// Bridge state: the publisher's routing key.
    pub const STATE_ROUTING_KEY: &str = "delay-bridge-routing-key";
    /// Bridge state: the publisher's `expiration` property (it would cut a level's TTL short).
    pub const STATE_EXPIRATION: &str = "delay-bridge-expiration";
    /// Bridge state: the publisher's `user_id` property (the broker refuses another user's).
    pub const STATE_USER_ID: &str = "delay-bridge-user-id";
    /// Bridge state: the publisher's `delivery_mode` when it was not 2 (0 = absent).
    pub const STATE_DELIVERY_MODE: &str = "delay-bridge-delivery-mode";
    /// Bridge state: how many hops the message has made.
    pub const STATE_HOPS: &str = "delay-bridge-hops";
    /// Bridge state: when the bridge first saw the message, epoch ms.
    pub const STATE_FIRST_SEEN: &str = "delay-bridge-first-seen";
    /// Bridge state: when the copy entered, for cancellation (`x-published-at`, else first
    /// seen), epoch ms.
    pub const STATE_ENTERED_AT: &str = "delay-bridge-entered-at";
    /// On parked messages: the stable reason code.
    pub const REASON: &str = "delay-bridge-reason";
    /// On parked messages: a human explanation.
    pub const DETAIL: &str = "delay-bridge-detail";
    /// On delivered messages whose publisher set a `user_id` other than the bridge's user.
    pub const ORIGINAL_USER_ID: &str = "original-user-id";
    /// Failed deliveries so far, set by quorum queues on redelivery.
    pub const DELIVERY_COUNT: &str = "x-delivery-count";
    /// Prefixes of the headers dead-lettering adds; stripped on every re-publish.
    pub const DEATH_PREFIXES: [&str; 3] = ["x-death", "x-first-death-", "x-last-death-"];
}

/// `delivery_mode` value of a persistent message.
pub const PERSISTENT: u8 = 2;

/// Epoch milliseconds before this (September 2001) in `x-deliver-at` are taken for seconds.
const EARLIEST_DELIVER_AT_MS: i64 = 1_000_000_000_000;

/// Why a message is parked. The code (`as_str`) is stable: consumers may match on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ParkReason {
    /// `x-delay` is not a number the plugin would read.
    BadDelay,
    /// `x-deliver-at` is neither epoch milliseconds nor RFC 3339.
    BadDeliverAt,
    /// `x-published-at` is not epoch milliseconds.
    BadPublishedAt,
    /// The delay is above the configured maximum.
    DelayTooLong,
    /// The message came through an exchange that is no route's ingress.
    UnknownRoute,
    /// The bridge's own headers are missing or malformed.
    BadState,
    /// The target is not an exchange any route allows.
    TargetNotAllowed,
    /// The target exchange took the message but no queue was bound for its routing key.
    Unroutable,
    /// The target exchange does not exist.
    TargetMissing,
    /// The message was redelivered more often than the work queue's delivery limit.
    RedeliveryLimit,
}

impl ParkReason {
    /// The stable code written to `delay-bridge-reason`.
    pub fn as_str(self) -> &'static str {
        match self {
            ParkReason::BadDelay => "bad-delay",
            ParkReason::BadDeliverAt => "bad-deliver-at",
            ParkReason::BadPublishedAt => "bad-published-at",
            ParkReason::DelayTooLong => "delay-too-long",
            ParkReason::UnknownRoute => "unknown-route",
            ParkReason::BadState => "bad-state",
            ParkReason::TargetNotAllowed => "target-not-allowed",
            ParkReason::Unroutable => "unroutable",
            ParkReason::TargetMissing => "target-missing",
            ParkReason::RedeliveryLimit => "redelivery-limit",
        }
    }
}

impl fmt::Display for ParkReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A decision to park, with the human detail that goes with the code.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Parked {
    /// The stable reason.
    pub reason: ParkReason,
    /// What exactly was wrong, for a human.
    pub detail: String,
}

impl Parked {
    fn new(reason: ParkReason, detail: impl Into<String>) -> Self {
        Self {
            reason,
            detail: detail.into(),
        }
    }
}

/// The AMQP basic properties as plain data, so they can be edited and rebuilt
/// (lapin's `BasicProperties` cannot remove a field).
#[allow(missing_docs)]
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Properties {
    pub content_type: Option<ShortString>,
    pub content_encoding: Option<ShortString>,
    pub headers: Option<FieldTable>,
    pub delivery_mode: Option<u8>,
    pub priority: Option<u8>,
    pub correlation_id: Option<ShortString>,
    pub reply_to: Option<ShortString>,
    pub expiration: Option<ShortString>,
    pub message_id: Option<ShortString>,
    pub timestamp: Option<u64>,
    pub kind: Option<ShortString>,
    pub user_id: Option<ShortString>,
    pub app_id: Option<ShortString>,
    pub cluster_id: Option<ShortString>,
}

impl From<&BasicProperties> for Properties {
    fn from(p: &BasicProperties) -> Self {
        Self {
            content_type: p.content_type().clone(),
            content_encoding: p.content_encoding().clone(),
            headers: p.headers().clone(),
            delivery_mode: *p.delivery_mode(),
            priority: *p.priority(),
            correlation_id: p.correlation_id().clone(),
            reply_to: p.reply_to().clone(),
            expiration: p.expiration().clone(),
            message_id: p.message_id().clone(),
            timestamp: *p.timestamp(),
            kind: p.kind().clone(),
            user_id: p.user_id().clone(),
            app_id: p.app_id().clone(),
            cluster_id: p.cluster_id().clone(),
        }
    }
}

impl From<Properties> for BasicProperties {
    fn from(p: Properties) -> Self {
        let mut out = BasicProperties::default();
        macro_rules! set {
            ($($field:ident => $with:ident),* $(,)?) => {
                $(if let Some(v) = p.$field { out = out.$with(v); })*
            };
        }
        set!(
            content_type => with_content_type,
            content_encoding => with_content_encoding,
            headers => with_headers,
            delivery_mode => with_delivery_mode,
            priority => with_priority,
            correlation_id => with_correlation_id,
            reply_to => with_reply_to,
            expiration => with_expiration,
            message_id => with_message_id,
            timestamp => with_timestamp,
            kind => with_type,
            user_id => with_user_id,
            app_id => with_app_id,
            cluster_id => with_cluster_id,
        );
        out
    }
}

/// A consumed delivery, as the contract sees it.
#[derive(Debug, Clone, Copy)]
pub struct Incoming<'a> {
    /// The exchange it was published to (an ingress exchange, or the work exchange for a
    /// message coming back from a level).
    pub exchange: &'a str,
    /// Its routing key.
    pub routing_key: &'a ShortString,
    /// Its properties, headers included.
    pub properties: &'a BasicProperties,
}

/// What `decode` needs to know of the configuration.
#[derive(Debug, Clone, Copy)]
pub struct Intake<'a> {
    /// The bridge's work exchange: messages from it carry bridge state.
    pub work_exchange: &'a str,
    /// The routes: ingress exchange → target exchange (the allow-list of targets).
    pub routes: &'a [Route],
    /// The longest delay accepted.
    pub max_delay: Duration,
}

/// What the publisher's properties had that the bridge must not carry through levels.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stash {
    /// The publisher's `expiration`, restored on delivery.
    pub expiration: Option<ShortString>,
    /// The publisher's `user_id`.
    pub user_id: Option<ShortString>,
    /// The publisher's `delivery_mode`; hops are always persistent.
    pub delivery_mode: Option<u8>,
}

/// A message the bridge is moving: when it is due, where it goes, what the publisher sent.
#[derive(Debug, Clone, PartialEq)]
pub struct Envelope {
    /// Due time, epoch ms.
    pub deliver_at: u64,
    /// The target exchange.
    pub target: String,
    /// The publisher's routing key.
    pub routing_key: ShortString,
    /// Hops made so far.
    pub hops: u32,
    /// When the bridge first saw the message, epoch ms.
    pub first_seen: u64,
    /// When this copy entered, for cancellation: a cancel at or after this time drops it.
    pub entered_at: u64,
    /// The publisher's properties without `expiration`, `user_id` and `delivery_mode`
    /// (see `stash`), and with no `x-death*` or `delay-bridge-*` headers.
    pub properties: Properties,
    /// The properties set aside while the message travels.
    pub stash: Stash,
}

/// Reads a consumed delivery: a new message from an ingress exchange, or one coming back
/// from a level through the work exchange.
pub fn decode(
    incoming: Incoming<'_>,
    now_ms: u64,
    intake: &Intake<'_>,
) -> Result<Envelope, Parked> {
    let raw = Properties::from(incoming.properties);
    let headers = raw.headers.clone().unwrap_or_default();
    if incoming.exchange == intake.work_exchange {
        return decode_in_flight(raw, &headers, intake);
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
    let deliver_at = due_time(&headers, now_ms, intake.max_delay)?;
    let entered_at = match headers.inner().get(header::PUBLISHED_AT) {
        None => now_ms,
        Some(value) => parse_published_at(value)
            .map_err(|detail| Parked::new(ParkReason::BadPublishedAt, detail))?,
    };
    let (properties, stash) = split_publisher_properties(raw);
    Ok(Envelope {
        deliver_at,
        target: route.target.clone(),
        routing_key: incoming.routing_key.clone(),
        hops: 0,
        first_seen: now_ms,
        entered_at,
        properties,
        stash,
    })
}

fn decode_in_flight(
    raw: Properties,
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
    let stash = Stash {
        expiration: short(header::STATE_EXPIRATION)?,
        user_id: short(header::STATE_USER_ID)?,
        delivery_mode,
    };
    let hops = int(header::STATE_HOPS)?.min(u64::from(u32::MAX)) as u32;
    let first_seen = int(header::STATE_FIRST_SEEN)?;
    let entered_at = match get(header::STATE_ENTERED_AT) {
        None => first_seen,
        Some(_) => int(header::STATE_ENTERED_AT)?,
    };
    let (properties, _) = split_publisher_properties(raw);
    Ok(Envelope {
        deliver_at,
        target,
        routing_key,
        hops,
        first_seen,
        entered_at,
        properties,
        stash,
    })
}

fn bad_state(name: &str) -> Parked {
    Parked::new(
        ParkReason::BadState,
        format!("bridge header `{name}` is missing or malformed"),
    )
}

/// The due time of a new message: `x-deliver-at` wins over `x-delay`; neither means now.
fn due_time(headers: &FieldTable, now_ms: u64, max_delay: Duration) -> Result<u64, Parked> {
    let max_ms = max_delay.as_millis() as u64;
    let too_long = |what: String| {
        Parked::new(
            ParkReason::DelayTooLong,
            format!(
                "{what} is beyond the maximum delay of {} ({max_ms} ms)",
                crate::ladder::format_duration(max_delay)
            ),
        )
    };
    if let Some(value) = headers.inner().get(header::DELIVER_AT) {
        let at = parse_deliver_at(value)
            .map_err(|detail| Parked::new(ParkReason::BadDeliverAt, detail))?;
        let at = u64::try_from(at).unwrap_or(0);
        if at.saturating_sub(now_ms) > max_ms {
            return Err(too_long(format!("x-deliver-at {at}")));
        }
        return Ok(at.max(now_ms));
    }
    let Some(value) = headers.inner().get(header::DELAY) else {
        return Ok(now_ms);
    };
    let delay = parse_delay(value).map_err(|detail| Parked::new(ParkReason::BadDelay, detail))?;
    if delay <= 0 {
        return Ok(now_ms);
    }
    if delay as u128 > u128::from(max_ms) {
        return Err(too_long(format!("x-delay {delay} ms")));
    }
    Ok(now_ms + delay as u64)
}

/// Reads `x-delay` as the delayed-message plugin does: any integer type, a string of
/// (optionally signed) digits, a float or decimal truncated toward zero. Huge values
/// saturate (and are then refused as too long). Anything else is an error with a reason.
pub fn parse_delay(value: &AMQPValue) -> Result<i128, String> {
    if let Some(v) = as_integer(value) {
        return Ok(i128::from(v));
    }
    match value {
        AMQPValue::Float(f) => float_delay(f64::from(*f)),
        AMQPValue::Double(f) => float_delay(*f),
        AMQPValue::DecimalValue(d) => {
            Ok(i128::from(d.value) / 10i128.pow(u32::from(d.scale.min(30))))
        }
        AMQPValue::LongString(_) | AMQPValue::ShortString(_) => {
            let text = as_text(value).unwrap_or_default();
            parse_signed_digits(&text)
                .ok_or_else(|| format!("x-delay {text:?} is not a whole number of milliseconds"))
        }
        other => Err(format!(
            "x-delay must be an integer or a string of digits, got {}",
            type_name(other)
        )),
    }
}

fn float_delay(f: f64) -> Result<i128, String> {
    if f.is_finite() {
        Ok(f.trunc().clamp(i128::MIN as f64, i128::MAX as f64) as i128)
    } else {
        Err(format!("x-delay {f} is not a finite number"))
    }
}

/// `[+-]?[0-9]+`, saturating far beyond any useful delay.
fn parse_signed_digits(text: &str) -> Option<i128> {
    let (negative, digits) = match text.as_bytes().first()? {
        b'-' => (true, &text[1..]),
        b'+' => (false, &text[1..]),
        _ => (false, text),
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let magnitude = if digits.len() > 30 {
        i128::MAX
    } else {
        digits.parse::<i128>().ok()?
    };
    Some(if negative { -magnitude } else { magnitude })
}

/// Reads `x-deliver-at`: epoch milliseconds (an integer, or a string of digits) or an
/// RFC 3339 timestamp. Epoch values before 2001 are refused as probably seconds.
pub fn parse_deliver_at(value: &AMQPValue) -> Result<i64, String> {
    let epoch_ms = |v: i64| {
        if v < EARLIEST_DELIVER_AT_MS {
            Err(format!(
                "x-deliver-at {v} is before 2001 as epoch milliseconds (seconds instead of milliseconds?)"
            ))
        } else {
            Ok(v)
        }
    };
    if let Some(v) = as_integer(value) {
        return epoch_ms(v);
    }
    match value {
        AMQPValue::LongString(_) | AMQPValue::ShortString(_) => {
            let text = as_text(value).unwrap_or_default();
            if !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) {
                return text
                    .parse::<i64>()
                    .map_err(|_| format!("x-deliver-at {text:?} is out of range"))
                    .and_then(epoch_ms);
            }
            chrono::DateTime::parse_from_rfc3339(text.trim())
                .map(|t| t.timestamp_millis())
                .map_err(|e| {
                    format!(
                        "x-deliver-at {text:?} is neither epoch milliseconds nor an RFC 3339 time ({e})"
                    )
                })
        }
        other => Err(format!(
            "x-deliver-at must be epoch milliseconds or an RFC 3339 string, got {}",
            type_name(other)
        )),
    }
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

/// Reads `x-published-at`: epoch milliseconds as any integer type or a string of digits,
/// from 2001 on (an earlier value is probably seconds).
pub fn parse_published_at(value: &AMQPValue) -> Result<u64, String> {
    let v = match as_integer(value) {
        Some(v) => v,
        None => as_text(value)
            .filter(|t| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|t| t.parse::<i64>().ok())
            .ok_or_else(|| {
                format!(
                    "x-published-at must be epoch milliseconds (an integer), got {}",
                    match value {
                        AMQPValue::LongString(_) | AMQPValue::ShortString(_) =>
                            format!("{:?}", as_text(value).unwrap_or_default()),
                        other => type_name(other).to_string(),
                    }
                )
            })?,
    };
    if v < EARLIEST_DELIVER_AT_MS {
        return Err(format!(
            "x-published-at {v} is before 2001 as epoch milliseconds (seconds instead of milliseconds?)"
        ));
    }
    Ok(v as u64)
}

/// Any AMQP integer type, widened. `LongLongUInt` above `i64::MAX` saturates.
fn as_integer(value: &AMQPValue) -> Option<i64> {
    Some(match value {
        AMQPValue::ShortShortInt(v) => i64::from(*v),
        AMQPValue::ShortShortUInt(v) => i64::from(*v),
        AMQPValue::ShortInt(v) => i64::from(*v),
        AMQPValue::ShortUInt(v) => i64::from(*v),
        AMQPValue::LongInt(v) => i64::from(*v),
        AMQPValue::LongUInt(v) => i64::from(*v),
        AMQPValue::LongLongInt(v) => *v,
        _ => return None,
    })
}

fn as_text(value: &AMQPValue) -> Option<String> {
    match value {
        AMQPValue::LongString(s) => String::from_utf8(s.as_bytes().to_vec()).ok(),
        AMQPValue::ShortString(s) => Some(s.as_str().to_string()),
        _ => None,
    }
}

fn type_name(value: &AMQPValue) -> &'static str {
    match value {
        AMQPValue::Boolean(_) => "a boolean",
        AMQPValue::FieldTable(_) => "a table",
        AMQPValue::FieldArray(_) => "an array",
        AMQPValue::ByteArray(_) => "a byte array",
        AMQPValue::Timestamp(_) => "a timestamp",
        AMQPValue::Void => "void",
        _ => "a value of another type",
    }
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

/// Splits raw properties into what travels (cleaned) and what is set aside.
fn split_publisher_properties(mut raw: Properties) -> (Properties, Stash) {
    let stash = Stash {
        expiration: raw.expiration.take(),
        user_id: raw.user_id.take(),
        delivery_mode: raw.delivery_mode.take(),
    };
    raw.headers = raw.headers.map(|h| FieldTable::from(publisher_headers(&h)));
    (raw, stash)
}

fn long_string(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s))
}

fn key(name: &str) -> ShortString {
    ShortString::from(name)
}

/// The properties of a hop into a level: the publisher's properties, persistent, without
/// `expiration` and `user_id`, plus the bridge state headers (hop count incremented).
pub fn hop_properties(envelope: &Envelope) -> BasicProperties {
    with_state(envelope, envelope.hops + 1)
}

/// The properties the message was read with, rebuilt from the envelope (the publisher's
/// plus the state headers, hop count unchanged; dead-letter headers are gone). The bridge
/// parks from these once a message is decoded, so it need not keep the consumed copy.
pub fn consumed_properties(envelope: &Envelope) -> BasicProperties {
    with_state(envelope, envelope.hops)
}

/// The publisher's properties, persistent, without `expiration` and `user_id`, plus the
/// bridge state headers with this hop count.
fn with_state(envelope: &Envelope, hops: u32) -> BasicProperties {
    let mut props = envelope.properties.clone();
    let mut headers = props
        .headers
        .as_ref()
        .map(|h| h.inner().clone())
        .unwrap_or_default();
    let state: [(&str, Option<AMQPValue>); 9] = [
        (
            header::STATE_DELIVER_AT,
            Some(AMQPValue::LongLongInt(envelope.deliver_at as i64)),
        ),
        (header::STATE_TARGET, Some(long_string(&envelope.target))),
        (
            header::STATE_ROUTING_KEY,
            Some(long_string(envelope.routing_key.as_str())),
        ),
        (
            header::STATE_HOPS,
            Some(AMQPValue::LongLongInt(i64::from(hops))),
        ),
        (
            header::STATE_FIRST_SEEN,
            Some(AMQPValue::LongLongInt(envelope.first_seen as i64)),
        ),
        (
            header::STATE_ENTERED_AT,
            Some(AMQPValue::LongLongInt(envelope.entered_at as i64)),
        ),
        (
            header::STATE_EXPIRATION,
            envelope
                .stash
                .expiration
                .as_ref()
                .map(|e| long_string(e.as_str())),
        ),
        (
            header::STATE_USER_ID,
            envelope
                .stash
                .user_id
                .as_ref()
                .map(|u| long_string(u.as_str())),
        ),
        (
            header::STATE_DELIVERY_MODE,
            match envelope.stash.delivery_mode {
                Some(PERSISTENT) => None,
                Some(m) => Some(AMQPValue::LongLongInt(i64::from(m))),
                None => Some(AMQPValue::LongLongInt(0)),
            },
        ),
    ];
    for (name, value) in state {
        if let Some(value) = value {
            headers.insert(key(name), value);
        }
    }
    props.headers = Some(FieldTable::from(headers));
    props.delivery_mode = Some(PERSISTENT);
    props.into()
}

/// The properties of the final delivery: exactly the publisher's, with `expiration` and
/// `delivery_mode` restored, `x-delay` negated (as the plugin does, so a delayed-type target
/// does not delay again), and no bridge or dead-letter headers. The publisher's `user_id`
/// is restored when it is `bridge_user` (the broker refuses any other) and otherwise
/// carried in the `original-user-id` header.
pub fn delivery_properties(envelope: &Envelope, bridge_user: &str) -> BasicProperties {
    let mut props = envelope.properties.clone();
    props.expiration = envelope.stash.expiration.clone();
    props.delivery_mode = envelope.stash.delivery_mode;
    let mut extra = Vec::new();
    match &envelope.stash.user_id {
        Some(user) if user.as_str() == bridge_user => props.user_id = Some(user.clone()),
        Some(user) => extra.push((key(header::ORIGINAL_USER_ID), long_string(user.as_str()))),
        None => {}
    }
    if let Some(h) = props.headers.as_mut() {
        let mut table = h.inner().clone();
        if let Some(delay) = table.get(header::DELAY).and_then(|v| parse_delay(v).ok())
            && delay > 0
        {
            table.insert(key(header::DELAY), negated_delay(delay));
        }
        table.extend(extra.drain(..));
        *h = FieldTable::from(table);
    }
    if !extra.is_empty() {
        props.headers = Some(FieldTable::from(
            extra.into_iter().collect::<BTreeMap<_, _>>(),
        ));
    }
    // A table emptied of bridge headers was no table at all (a header-less publisher).
    if props.headers.as_ref().is_some_and(|h| h.inner().is_empty()) {
        props.headers = None;
    }
    props.into()
}

/// `-delay` as a signed 32-bit integer (the plugin's type), or 64-bit when it does not fit.
fn negated_delay(delay: i128) -> AMQPValue {
    let negated = -delay.min(i128::from(i64::MAX));
    match i32::try_from(negated) {
        Ok(v) => AMQPValue::LongInt(v),
        Err(_) => AMQPValue::LongLongInt(negated as i64),
    }
}

/// The properties of a parked message: the consumed message's own, kept for diagnosis and
/// replay, made persistent and safe to sit in a queue: `expiration` and `user_id` move to
/// bridge headers (an expiration would delete it), dead-letter headers are stripped, and
/// `delay-bridge-reason` and `delay-bridge-detail` say why.
pub fn parked_properties(consumed: &BasicProperties, parked: &Parked) -> BasicProperties {
    let mut props = Properties::from(consumed);
    let mut headers: BTreeMap<ShortString, AMQPValue> = props
        .headers
        .as_ref()
        .map(|h| h.inner().clone())
        .unwrap_or_default();
    headers.retain(|k, _| {
        !header::DEATH_PREFIXES
            .iter()
            .any(|p| k.as_str().starts_with(p))
    });
    if let Some(expiration) = props.expiration.take() {
        headers.insert(
            key(header::STATE_EXPIRATION),
            long_string(expiration.as_str()),
        );
    }
    if let Some(user) = props.user_id.take() {
        headers.insert(key(header::STATE_USER_ID), long_string(user.as_str()));
    }
    headers.insert(key(header::REASON), long_string(parked.reason.as_str()));
    headers.insert(key(header::DETAIL), long_string(&parked.detail));
    props.headers = Some(FieldTable::from(headers));
    props.delivery_mode = Some(PERSISTENT);
    props.into()
}

#[cfg(test)]
mod tests;
