//! Encoding what is published next: a hop's properties with the bridge's state, the final
//! delivery's (the publisher's own, restored), and a parked copy's.

use std::collections::BTreeMap;

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};

use super::value::parse_delay;
use super::{Envelope, PERSISTENT, Parked, Properties, header};

fn long_string(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s))
}

fn key(name: &str) -> ShortString {
    ShortString::from(name)
}

/// The properties of a hop into a level: the publisher's properties, persistent, without
/// `expiration` and `user_id`, plus the bridge state headers (hop count incremented).
pub fn hop_properties(envelope: &Envelope) -> BasicProperties {
    with_state(envelope, envelope.hops.saturating_add(1))
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
    let mut props = envelope.properties.clone_without_headers();
    let mut headers = envelope
        .properties
        .headers
        .as_ref()
        .map(|h| h.inner().clone())
        .unwrap_or_default();
    for (name, value) in state_headers(envelope, hops) {
        if let Some(value) = value {
            headers.insert(key(name), value.to_amqp());
        }
    }
    props.headers = Some(FieldTable::from(headers));
    props.delivery_mode = Some(PERSISTENT);
    props.into()
}

/// The value of one bridge state header, borrowed from the envelope.
#[derive(Debug, Clone, Copy)]
pub(super) enum StateValue<'a> {
    /// A 64-bit integer (`l`).
    Int(i64),
    /// A long string (`S`).
    Text(&'a str),
    /// A value kept as the publisher sent it (`CC`, `BCC`).
    Kept(&'a AMQPValue),
}

impl StateValue<'_> {
    /// The value as a header table holds it.
    pub(super) fn to_amqp(self) -> AMQPValue {
        match self {
            StateValue::Int(i) => AMQPValue::LongLongInt(i),
            StateValue::Text(s) => long_string(s),
            StateValue::Kept(v) => v.clone(),
        }
    }
}

/// The number of bridge state headers a hop can carry.
pub(super) const STATE_HEADERS: usize = 13;

/// The bridge state headers of a hop with this hop count, by name; `None` for one the
/// message does not carry.
pub(super) fn state_headers(
    envelope: &Envelope,
    hops: u32,
) -> [(&'static str, Option<StateValue<'_>>); STATE_HEADERS] {
    let saturating = |n: u64| StateValue::Int(i64::try_from(n).unwrap_or(i64::MAX));
    [
        (
            header::STATE_DELIVER_AT,
            Some(StateValue::Int(envelope.deliver_at as i64)),
        ),
        (
            header::STATE_TARGET,
            Some(StateValue::Text(&envelope.target)),
        ),
        (
            header::STATE_ROUTING_KEY,
            Some(StateValue::Text(envelope.routing_key.as_str())),
        ),
        (header::STATE_HOPS, Some(StateValue::Int(i64::from(hops)))),
        (
            header::STATE_FIRST_SEEN,
            Some(StateValue::Int(envelope.first_seen as i64)),
        ),
        (
            header::STATE_ENTERED_AT,
            Some(StateValue::Int(envelope.entered_at as i64)),
        ),
        (
            header::STATE_OCCURRENCE,
            envelope.occurrence.map(saturating),
        ),
        (
            header::STATE_BORN,
            envelope.occurrence.map(|_| saturating(envelope.born)),
        ),
        (
            header::STATE_EXPIRATION,
            envelope
                .stash
                .expiration
                .as_ref()
                .map(|e| StateValue::Text(e.as_str())),
        ),
        (
            header::STATE_USER_ID,
            envelope
                .stash
                .user_id
                .as_ref()
                .map(|u| StateValue::Text(u.as_str())),
        ),
        (
            header::STATE_DELIVERY_MODE,
            match envelope.stash.delivery_mode {
                Some(PERSISTENT) => None,
                Some(m) => Some(StateValue::Int(i64::from(m))),
                None => Some(StateValue::Int(0)),
            },
        ),
        (
            header::STATE_CC,
            envelope.stash.cc.as_ref().map(StateValue::Kept),
        ),
        (
            header::STATE_BCC,
            envelope.stash.bcc.as_ref().map(StateValue::Kept),
        ),
    ]
}

/// The properties of the final delivery: exactly the publisher's, with `expiration`,
/// `delivery_mode`, `CC` and `BCC` restored (so `CC` adds routing keys within the target
/// exchange only), `x-delay` negated (as the plugin does, so a delayed-type target
/// does not delay again), and no bridge or dead-letter headers. The publisher's `user_id`
/// is restored when it is `bridge_user` (the broker refuses any other) and otherwise
/// carried in the `original-user-id` header.
pub fn delivery_properties(envelope: &Envelope, bridge_user: &str) -> BasicProperties {
    let mut props = envelope.properties.clone_without_headers();
    props.expiration = envelope.stash.expiration.clone();
    props.delivery_mode = envelope.stash.delivery_mode;
    let mut extra = Vec::new();
    match &envelope.stash.user_id {
        Some(user) if user.as_str() == bridge_user => props.user_id = Some(user.clone()),
        Some(user) => extra.push((key(header::ORIGINAL_USER_ID), long_string(user.as_str()))),
        None => {}
    }
    for (name, value) in [
        (header::CC, &envelope.stash.cc),
        (header::BCC, &envelope.stash.bcc),
    ] {
        if let Some(value) = value {
            extra.push((key(name), value.clone()));
        }
    }
    if let Some(h) = envelope.properties.headers.as_ref() {
        let mut table = h.inner().clone();
        if let Some(delay) = table.get(header::DELAY).and_then(|v| parse_delay(v).ok())
            && delay > 0
        {
            table.insert(key(header::DELAY), negated_delay(delay));
        }
        table.extend(extra.drain(..));
        props.headers = Some(FieldTable::from(table));
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
/// replay, made persistent and safe to sit in a queue: `expiration`, `user_id`, `CC` and
/// `BCC` move to bridge headers (an expiration would delete it), dead-letter headers are stripped, and
/// `delay-bridge-reason` and `delay-bridge-detail` say why.
pub fn parked_properties(
    consumed: &BasicProperties,
    parked: &Parked,
    parked_at_ms: u64,
) -> BasicProperties {
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
    for (name, state) in [
        (header::CC, header::STATE_CC),
        (header::BCC, header::STATE_BCC),
    ] {
        if let Some(value) = headers.remove(name) {
            headers.insert(key(state), value);
        }
    }
    headers.insert(key(header::REASON), long_string(parked.reason.as_str()));
    headers.insert(key(header::DETAIL), long_string(&parked.detail));
    headers.insert(
        key(header::PARKED_AT),
        AMQPValue::LongLongInt(i64::try_from(parked_at_ms).unwrap_or(i64::MAX)),
    );
    props.headers = Some(FieldTable::from(headers));
    props.delivery_mode = Some(PERSISTENT);
    props.into()
}

/// A new message's properties without the `delay-bridge-*` headers its publisher set, and
/// how many there were: they are not the bridge's state, and a parked copy must not carry
/// them as if they were (`parked replay` acts on the bridge state of a parked copy).
pub fn without_bridge_headers(consumed: &BasicProperties) -> (BasicProperties, usize) {
    let Some(headers) = consumed.headers().as_ref() else {
        return (consumed.clone(), 0);
    };
    let kept: BTreeMap<ShortString, AMQPValue> = headers
        .inner()
        .iter()
        .filter(|(k, _)| !k.as_str().starts_with(header::BRIDGE_PREFIX))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let removed = headers.inner().len() - kept.len();
    match removed {
        0 => (consumed.clone(), 0),
        _ => (
            consumed.clone().with_headers(FieldTable::from(kept)),
            removed,
        ),
    }
}

/// A parked copy without the publisher's headers, for a message whose headers with the
/// parking headers would not fit in a frame: the body, the other properties and the
/// bridge's headers are kept, and the detail says the headers were dropped.
pub fn parked_properties_without_headers(
    consumed: &BasicProperties,
    parked: &Parked,
    parked_at_ms: u64,
) -> BasicProperties {
    let mut bare = Properties::from(consumed);
    bare.headers = bare.headers.map(|h| {
        FieldTable::from(
            h.inner()
                .iter()
                .filter(|(k, _)| k.as_str().starts_with(header::BRIDGE_PREFIX))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect::<BTreeMap<_, _>>(),
        )
    });
    let detail = format!(
        "{}; the publisher's headers were dropped: with the parking headers they do not fit in a frame",
        parked.detail
    );
    parked_properties(
        &bare.into(),
        &Parked::new(parked.reason, detail),
        parked_at_ms,
    )
}

/// The parked copy of a message the AMQP client cannot read (see
/// [`ParkReason::Unreadable`](super::ParkReason::Unreadable)): its routing key (made UTF-8,
/// the lost bytes replaced) and properties that any client reads. They are persistent and
/// carry the reason, a detail saying that `what` could not be read, when it was parked, the
/// original property bytes (`delay-bridge-raw-properties`), and the routing key's bytes
/// when they are not UTF-8 (`delay-bridge-raw-routing-key`).
pub fn unreadable_parked(
    raw_properties: &[u8],
    routing_key: &[u8],
    what: &str,
    parked_at_ms: u64,
) -> (ShortString, BasicProperties) {
    let parked = Parked::new(
        super::ParkReason::Unreadable,
        format!(
            "the AMQP client cannot read {what}: a short string that is not UTF-8; the original properties are kept as bytes in {}",
            header::RAW_PROPERTIES
        ),
    );
    let mut headers = BTreeMap::new();
    headers.insert(
        key(header::RAW_PROPERTIES),
        AMQPValue::ByteArray(raw_properties.to_vec().into()),
    );
    let readable_key = match std::str::from_utf8(routing_key) {
        Ok(text) => text.to_string(),
        Err(_) => {
            headers.insert(
                key(header::RAW_ROUTING_KEY),
                AMQPValue::ByteArray(routing_key.to_vec().into()),
            );
            String::from_utf8_lossy(routing_key).into_owned()
        }
    };
    let properties = BasicProperties::default().with_headers(FieldTable::from(headers));
    (
        truncated_short_string(&readable_key),
        parked_properties(&properties, &parked, parked_at_ms),
    )
}

/// `text` cut to the 255 bytes a short string holds, at a character boundary (a lossy
/// UTF-8 conversion may have made it longer).
fn truncated_short_string(text: &str) -> ShortString {
    let mut end = text.len().min(255);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    ShortString::from(&text[..end])
}
