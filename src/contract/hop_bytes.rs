//! A hop's properties written straight to their wire encoding, without building them: the
//! bytes [`gen_properties`](amq_protocol::protocol::basic::gen_properties) writes for
//! [`hop_properties`](super::hop_properties) (or
//! [`consumed_properties`](super::consumed_properties)), borrowed from the envelope. A
//! bundle's member is encoded this way for every hop, so the header table the publisher
//! sent is not copied, nor a name allocated, per message and per hop.

use amq_protocol::frame::{GenResult, WriteContext};
use amq_protocol::types::generation::{gen_long_string, gen_type, gen_value};
use amq_protocol::types::{AMQPType, AMQPValue};

use super::encode::{STATE_HEADERS, StateValue, state_headers};
use super::{Envelope, PERSISTENT, Properties};

/// Appends to `out` the encoded properties of `envelope` with its state headers at `hops`:
/// byte for byte what encoding `with_state(envelope, hops)` writes. `None` when they do
/// not encode (a name longer than a short string); `out` then holds part of them, to be
/// thrown away.
pub(super) fn write_state_properties(
    envelope: &Envelope,
    hops: u32,
    out: &mut Vec<u8>,
) -> Option<()> {
    let p: &Properties = &envelope.properties;
    let flag = |present: bool, bit: u16| if present { 1 << bit } else { 0 };
    let flags: u16 = flag(p.content_type.is_some(), 15)
        | flag(p.content_encoding.is_some(), 14)
        | 1 << 13 // headers
        | 1 << 12 // delivery mode
        | flag(p.priority.is_some(), 11)
        | flag(p.correlation_id.is_some(), 10)
        | flag(p.reply_to.is_some(), 9)
        | flag(p.expiration.is_some(), 8)
        | flag(p.message_id.is_some(), 7)
        | flag(p.timestamp.is_some(), 6)
        | flag(p.kind.is_some(), 5)
        | flag(p.user_id.is_some(), 4)
        | flag(p.app_id.is_some(), 3)
        | flag(p.cluster_id.is_some(), 2);
    out.extend_from_slice(&flags.to_be_bytes());
    for short in [&p.content_type, &p.content_encoding] {
        short_string(short.as_ref().map(|s| s.as_str()), out)?;
    }
    headers(envelope, hops, out)?;
    out.push(PERSISTENT);
    if let Some(priority) = p.priority {
        out.push(priority);
    }
    for short in [&p.correlation_id, &p.reply_to, &p.expiration, &p.message_id] {
        short_string(short.as_ref().map(|s| s.as_str()), out)?;
    }
    if let Some(timestamp) = p.timestamp {
        out.extend_from_slice(&timestamp.to_be_bytes());
    }
    for short in [&p.kind, &p.user_id, &p.app_id, &p.cluster_id] {
        short_string(short.as_ref().map(|s| s.as_str()), out)?;
    }
    Some(())
}

/// A short string field, when present.
fn short_string(value: Option<&str>, out: &mut Vec<u8>) -> Option<()> {
    if let Some(s) = value {
        out.push(u8::try_from(s.len()).ok()?);
        out.extend_from_slice(s.as_bytes());
    }
    Some(())
}

/// The header table: the publisher's headers and the state headers in name order (as a
/// `BTreeMap` keeps them), a state header in place of a publisher's of the same name.
fn headers(envelope: &Envelope, hops: u32, out: &mut Vec<u8>) -> Option<()> {
    let mut state: [(&str, Option<StateValue<'_>>); STATE_HEADERS] = state_headers(envelope, hops);
    state.sort_unstable_by(|a, b| a.0.cmp(b.0));
    let mut state = state
        .iter()
        .filter_map(|(name, value)| value.map(|value| (*name, value)))
        .peekable();
    let mut publisher = envelope
        .properties
        .headers
        .iter()
        .flat_map(|table| table.inner().iter())
        .peekable();
    let length_at = out.len();
    out.extend_from_slice(&[0; 4]);
    loop {
        let state_first = match (state.peek(), publisher.peek()) {
            (None, None) => break,
            (Some(_), None) => true,
            (None, Some(_)) => false,
            (Some((name, _)), Some((key, _))) => *name <= key.as_str(),
        };
        if state_first {
            let (name, value) = state.next()?;
            if publisher
                .peek()
                .is_some_and(|(key, _)| key.as_str() == name)
            {
                publisher.next();
            }
            short_string(Some(name), out)?;
            state_value(value, out)?;
        } else {
            let (key, value) = publisher.next()?;
            short_string(Some(key.as_str()), out)?;
            amqp_value(value, out)?;
        }
    }
    let length = u32::try_from(out.len() - length_at - 4).ok()?;
    out[length_at..length_at + 4].copy_from_slice(&length.to_be_bytes());
    Some(())
}

fn state_value(value: StateValue<'_>, out: &mut Vec<u8>) -> Option<()> {
    match value {
        StateValue::Int(i) => amqp_value(&AMQPValue::LongLongInt(i), out),
        StateValue::Text(s) => put_back(
            gen_type(AMQPType::LongString)(WriteContext::from(std::mem::take(out)))
                .and_then(gen_long_string(s.as_bytes())),
            out,
        ),
        StateValue::Kept(v) => amqp_value(v, out),
    }
}

/// A value with its type tag, as amq-protocol encodes it.
fn amqp_value(value: &AMQPValue, out: &mut Vec<u8>) -> Option<()> {
    put_back(
        gen_value(value)(WriteContext::from(std::mem::take(out))),
        out,
    )
}

/// Puts the buffer a generator wrote into back in `out`.
fn put_back(written: GenResult<Vec<u8>>, out: &mut Vec<u8>) -> Option<()> {
    *out = written.ok()?.write;
    Some(())
}
