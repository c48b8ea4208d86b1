//! Bundles: the hops of one window into one level, carried as one message.
//!
//! With `bridge.bundle_hops` the bridge publishes the messages that hop into the same level
//! in the same `bridge.hop_window` as one persistent message, so the broker stores, expires,
//! dead-letters, delivers and acks one message where it did each of them once per message.
//! A bundle's header [`super::header::BUNDLE`] says how many messages it
//! carries; its body is [`FORMAT`], then for each message the length and bytes of its
//! properties (as in an AMQP content header: flags, then the properties) and the length and
//! bytes of its body, lengths as 32-bit big-endian integers. Each message's properties are
//! its hop's (the publisher's plus the bridge state headers), so a message read from a
//! bundle is decoded exactly as a message that hopped alone.
//!
//! A bundle none of whose messages is a recurring occurrence says in its header when the
//! first and the last of them are due ([`super::header::BUNDLE_FIRST_DUE`],
//! [`super::header::BUNDLE_LAST_DUE`]): when both go on into the same next level, every
//! message between does, and the bundle is passed on whole without its messages being
//! read. Its body travels again as it came, and its header [`super::header::BUNDLE_HOPS`]
//! counts the hops its messages made since their state was last written (their
//! `delay-bridge-hops` plus that is how many hops each made). A version that does not read
//! these headers reads every bundle message by message and counts fewer hops; the count is
//! only reported, nothing is planned on it.
//!
//! Pure: no I/O.

use amq_protocol::frame::WriteContext;
use amq_protocol::protocol::basic::{gen_properties, parse_properties};
use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, ShortString};

use super::hop_bytes::write_state_properties;
use super::{Envelope, PERSISTENT, ParkReason, Parked, header};

/// The first byte of a bundle's body: the format of what follows.
pub const FORMAT: u8 = 1;

/// One message of a bundle, as it would have hopped alone.
#[derive(Debug, Clone, PartialEq)]
pub struct Member<'a> {
    /// Its hop's properties: the publisher's plus the bridge state headers.
    pub properties: BasicProperties,
    /// Its body, in the bundle's.
    pub body: &'a [u8],
}

/// The bytes one message takes in a bundle's body: its properties' length and bytes, then
/// its body's. `None` when a length does not fit 32 bits or the properties cannot be
/// encoded (such a message hops alone).
pub fn encode_member(properties: &BasicProperties, body: &[u8]) -> Option<Vec<u8>> {
    let encoded = gen_properties(properties)(WriteContext::from(Vec::new()))
        .ok()?
        .write;
    let properties_len = u32::try_from(encoded.len()).ok()?;
    let body_len = u32::try_from(body.len()).ok()?;
    let mut member = Vec::with_capacity(8 + encoded.len() + body.len());
    member.extend_from_slice(&properties_len.to_be_bytes());
    member.extend_from_slice(&encoded);
    member.extend_from_slice(&body_len.to_be_bytes());
    member.extend_from_slice(body);
    Some(member)
}

/// A hop's member of a bundle: what [`encode_member`] makes of
/// [`hop_properties`](super::hop_properties)`(envelope)` and `body`, written without
/// building those properties (the same bytes).
pub fn encode_hop_member(envelope: &Envelope, body: &[u8]) -> Option<Vec<u8>> {
    encode_state_member(envelope, envelope.hops.saturating_add(1), body)
}

/// A member of a bundle with the properties a message of a bundle was read with: what
/// [`encode_member`] makes of [`consumed_properties`](super::consumed_properties)`(envelope)`
/// and `body`, written without building those properties (the same bytes).
pub fn encode_consumed_member(envelope: &Envelope, body: &[u8]) -> Option<Vec<u8>> {
    encode_state_member(envelope, envelope.hops, body)
}

fn encode_state_member(envelope: &Envelope, hops: u32, body: &[u8]) -> Option<Vec<u8>> {
    let mut member = Vec::with_capacity(256 + body.len());
    member.extend_from_slice(&[0; 4]);
    write_state_properties(envelope, hops, &mut member)?;
    let properties_len = u32::try_from(member.len() - 4).ok()?;
    member[..4].copy_from_slice(&properties_len.to_be_bytes());
    member.extend_from_slice(&u32::try_from(body.len()).ok()?.to_be_bytes());
    member.extend_from_slice(body);
    Some(member)
}

/// A bundle's body from its members' bytes (each from [`encode_member`]).
pub fn bundle_body<'a>(members: impl IntoIterator<Item = &'a [u8]>) -> Vec<u8> {
    let mut body = vec![FORMAT];
    for member in members {
        body.extend_from_slice(member);
    }
    body
}

/// What a bundle's header says of its messages besides their count.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Summary {
    /// The hops they made that their own state does not count
    /// ([`super::header::BUNDLE_HOPS`]).
    pub uncounted_hops: u32,
    /// When the first and the last of them are due, epoch ms, when none is a recurring
    /// occurrence ([`super::header::BUNDLE_FIRST_DUE`], [`super::header::BUNDLE_LAST_DUE`]).
    pub due: Option<(u64, u64)>,
}

impl Summary {
    /// The summary of messages due at `due` (epoch ms; `None` for a recurring occurrence)
    /// whose state counts every hop they made: `due` is left out when one is `None` or
    /// there are none.
    pub fn of(due: impl IntoIterator<Item = Option<u64>>) -> Self {
        let mut range: Option<(u64, u64)> = None;
        for at in due {
            let Some(at) = at else {
                return Self::default();
            };
            range = Some(range.map_or((at, at), |(first, last)| (first.min(at), last.max(at))));
        }
        Self {
            uncounted_hops: 0,
            due: range,
        }
    }
}

/// A bundle's properties: persistent, with the count of messages it carries.
pub fn bundle_properties(count: usize) -> BasicProperties {
    summarised_properties(count, &Summary::default())
}

/// A bundle's properties: persistent, with the count of messages it carries and what
/// `summary` says of them.
pub fn summarised_properties(count: usize, summary: &Summary) -> BasicProperties {
    let mut headers = FieldTable::default();
    let mut set = |name: &str, value: i64| {
        headers.insert(ShortString::from(name), AMQPValue::LongLongInt(value));
    };
    set(header::BUNDLE, i64::try_from(count).unwrap_or(i64::MAX));
    if summary.uncounted_hops > 0 {
        set(header::BUNDLE_HOPS, i64::from(summary.uncounted_hops));
    }
    if let Some((first, last)) = summary.due {
        set(
            header::BUNDLE_FIRST_DUE,
            i64::try_from(first).unwrap_or(i64::MAX),
        );
        set(
            header::BUNDLE_LAST_DUE,
            i64::try_from(last).unwrap_or(i64::MAX),
        );
    }
    BasicProperties::default()
        .with_delivery_mode(PERSISTENT)
        .with_headers(headers)
}

/// What the header of a bundle with these properties says of its messages: a header that
/// is absent or not a non-negative integer says nothing (no uncounted hops; no due times,
/// also when the first is after the last); the hops are at most `u32::MAX`.
pub fn summary(properties: &BasicProperties) -> Summary {
    let headers = properties.headers();
    let read = |name: &str| {
        headers
            .as_ref()
            .and_then(|h| h.inner().get(name))
            .and_then(super::value::as_integer)
            .and_then(|value| u64::try_from(value).ok())
    };
    let due = match (
        read(header::BUNDLE_FIRST_DUE),
        read(header::BUNDLE_LAST_DUE),
    ) {
        (Some(first), Some(last)) if first <= last => Some((first, last)),
        _ => None,
    };
    Summary {
        uncounted_hops: read(header::BUNDLE_HOPS)
            .map_or(0, |hops| u32::try_from(hops).unwrap_or(u32::MAX)),
        due,
    }
}

/// True when a delivery with these properties is a bundle (it carries
/// [`super::header::BUNDLE`]). Only a delivery that came back through the
/// work exchange is read as one: on a publisher's message the header is just a header.
pub fn is_bundle(properties: &BasicProperties) -> bool {
    properties
        .headers()
        .as_ref()
        .is_some_and(|h| h.inner().contains_key(header::BUNDLE))
}

/// How many messages a bundle with these properties says it carries (`None`: it is no
/// bundle, or the count is not a positive integer).
pub fn count(properties: &BasicProperties) -> Option<u64> {
    properties
        .headers()
        .as_ref()
        .and_then(|h| h.inner().get(header::BUNDLE))
        .and_then(super::value::as_integer)
        .and_then(|count| u64::try_from(count).ok())
        .filter(|count| *count > 0)
}

/// The fewest bytes a message takes in a bundle's body: the two lengths before its
/// properties and its body.
const SMALLEST_MEMBER_BYTES: u64 = 8;

/// How many messages a bundle with `properties` and a body of `body_bytes` can carry at
/// most: its count, but never more than the body could hold (the count is read before
/// anything checks it, and a forged one must not make the bridge account for more).
pub fn count_within(properties: &BasicProperties, body_bytes: usize) -> Option<u64> {
    count(properties).map(|count| count.min(body_bytes as u64 / SMALLEST_MEMBER_BYTES))
}

/// The messages of a bundle whose properties are `properties` and whose body is `body`, or
/// why it must be parked whole (`bad-state`: the count, the format or a length is wrong).
pub fn decode_bundle<'a>(
    properties: &BasicProperties,
    body: &'a [u8],
) -> Result<Vec<Member<'a>>, Parked> {
    let count = count(properties)
        .ok_or_else(|| malformed(format!("header `{}` is not a count", header::BUNDLE)))?;
    let Some((&FORMAT, mut rest)) = body.split_first() else {
        return Err(malformed(format!(
            "its body does not start with format {FORMAT}"
        )));
    };
    let mut members = Vec::new();
    while !rest.is_empty() {
        let n = members.len();
        let (properties_bytes, after) = take_sized(rest)
            .ok_or_else(|| malformed(format!("message {n}'s properties are cut short")))?;
        let (body, after) = take_sized(after)
            .ok_or_else(|| malformed(format!("message {n}'s body is cut short")))?;
        let properties = match parse_properties(properties_bytes) {
            Ok(([], properties)) => properties,
            _ => return Err(malformed(format!("message {n}'s properties do not parse"))),
        };
        members.push(Member { properties, body });
        rest = after;
    }
    if members.len() as u64 != count {
        return Err(malformed(format!(
            "it says {count} messages and carries {}",
            members.len()
        )));
    }
    Ok(members)
}

/// The `message_id` of each message in a bundle's `body`, in order (`None` for one without),
/// read from their property bytes without parsing the rest; `None` when it is not a
/// bundle's body or a message's properties are cut short.
pub fn member_message_ids(body: &[u8]) -> Option<Vec<Option<&[u8]>>> {
    let (&FORMAT, mut rest) = body.split_first()? else {
        return None;
    };
    let mut ids = Vec::new();
    while !rest.is_empty() {
        let (properties, after) = take_sized(rest)?;
        let (_, after) = take_sized(after)?;
        ids.push(message_id(properties)?);
        rest = after;
    }
    Some(ids)
}

/// How the properties before `message_id` in a content header are skipped, in their order
/// there, each with its flag bit.
enum Skip {
    /// A short string: a length byte, then that many bytes.
    ShortString,
    /// A table: a 32-bit big-endian length, then that many bytes.
    Table,
    /// One octet.
    Octet,
}

/// The properties before `message_id`, in order, with their flag bits.
const BEFORE_MESSAGE_ID: [(u16, Skip); 8] = [
    (1 << 15, Skip::ShortString), // content-type
    (1 << 14, Skip::ShortString), // content-encoding
    (1 << 13, Skip::Table),       // headers
    (1 << 12, Skip::Octet),       // delivery-mode
    (1 << 11, Skip::Octet),       // priority
    (1 << 10, Skip::ShortString), // correlation-id
    (1 << 9, Skip::ShortString),  // reply-to
    (1 << 8, Skip::ShortString),  // expiration
];

/// The flag bit of `message_id`.
const MESSAGE_ID: u16 = 1 << 7;

/// The `message_id` in a content header's property bytes (16 bits of flags, then the
/// properties the flags name, in order), skipping the ones before it by their lengths.
fn message_id(properties: &[u8]) -> Option<Option<&[u8]>> {
    let (flags, mut rest) = properties.split_first_chunk::<2>()?;
    let flags = u16::from_be_bytes(*flags);
    for (flag, skip) in &BEFORE_MESSAGE_ID {
        if flags & flag == 0 {
            continue;
        }
        let len = match skip {
            Skip::ShortString => 1 + usize::from(*rest.first()?),
            Skip::Table => {
                let (len, _) = rest.split_first_chunk::<4>()?;
                4 + usize::try_from(u32::from_be_bytes(*len)).ok()?
            }
            Skip::Octet => 1,
        };
        rest = rest.get(len..)?;
    }
    if flags & MESSAGE_ID == 0 {
        return Some(None);
    }
    let len = usize::from(*rest.first()?);
    rest.get(1..1 + len).map(Some)
}

/// A 32-bit big-endian length and that many bytes from the front of `bytes`, and the rest.
fn take_sized(bytes: &[u8]) -> Option<(&[u8], &[u8])> {
    let (len, rest) = bytes.split_first_chunk::<4>()?;
    let len = usize::try_from(u32::from_be_bytes(*len)).ok()?;
    (rest.len() >= len).then(|| rest.split_at(len))
}

fn malformed(what: String) -> Parked {
    Parked::new(
        ParkReason::BadState,
        format!("a bundle that cannot be read: {what}"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::types::{AMQPValue, FieldArray, LongString};
    use proptest::prelude::*;

    fn properties(id: &str) -> BasicProperties {
        let mut headers = FieldTable::default();
        headers.insert("s".into(), AMQPValue::LongString(LongString::from(id)));
        headers.insert(
            "binary".into(),
            AMQPValue::LongString(LongString::from(vec![0xff, 0x00, 0xfe])),
        );
        headers.insert(
            "a".into(),
            AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::ShortInt(-3)])),
        );
        BasicProperties::default()
            .with_message_id(id.into())
            .with_priority(7)
            .with_timestamp(1_700_000_000)
            .with_headers(headers)
    }

    fn bundle(members: &[(BasicProperties, Vec<u8>)]) -> (BasicProperties, Vec<u8>) {
        let encoded: Vec<Vec<u8>> = members
            .iter()
            .map(|(p, b)| encode_member(p, b).expect("encodes"))
            .collect();
        (
            bundle_properties(members.len()),
            bundle_body(encoded.iter().map(Vec::as_slice)),
        )
    }

    #[test]
    fn members_come_back_with_every_property_and_their_bodies() {
        let members = vec![
            (properties("one"), b"first".to_vec()),
            (properties("two"), Vec::new()),
            (BasicProperties::default(), vec![0u8; 3000]),
        ];
        let (bundle_props, body) = bundle(&members);
        assert!(is_bundle(&bundle_props));
        assert_eq!(count(&bundle_props), Some(3));
        assert_eq!(*bundle_props.delivery_mode(), Some(PERSISTENT));
        let read = decode_bundle(&bundle_props, &body).expect("reads");
        let expected: Vec<Member> = members
            .iter()
            .map(|(properties, body)| Member {
                properties: properties.clone(),
                body,
            })
            .collect();
        assert_eq!(read, expected);
    }

    #[test]
    fn a_forged_count_is_never_taken_beyond_what_the_body_holds() {
        let mut headers = FieldTable::default();
        headers.insert(header::BUNDLE.into(), AMQPValue::LongLongInt(i64::MAX));
        let forged = BasicProperties::default().with_headers(headers);
        assert_eq!(count(&forged), Some(i64::MAX as u64));
        assert_eq!(count_within(&forged, 80), Some(10));
        assert_eq!(count_within(&forged, 0), Some(0));
        let (genuine, body) = bundle(&[(properties("one"), b"first".to_vec())]);
        assert_eq!(count_within(&genuine, body.len()), Some(1));
    }

    #[test]
    fn a_message_without_the_header_is_no_bundle() {
        assert!(!is_bundle(&BasicProperties::default()));
        assert!(!is_bundle(&properties("x")));
    }

    #[test]
    fn a_cut_body_a_wrong_count_or_format_is_bad_state() {
        let (props, body) = bundle(&[
            (properties("one"), b"first".to_vec()),
            (properties("two"), b"second".to_vec()),
        ]);
        for cut in 1..body.len() {
            let parked = decode_bundle(&props, &body[..cut]).expect_err("cut");
            assert_eq!(parked.reason, ParkReason::BadState, "cut at {cut}");
        }
        let mut other_format = body.clone();
        other_format[0] = 2;
        assert!(decode_bundle(&props, &other_format).is_err());
        assert!(decode_bundle(&props, &[]).is_err());
        let wrong_count = bundle_properties(3);
        let parked = decode_bundle(&wrong_count, &body).expect_err("count");
        assert!(
            parked.detail.contains("says 3 messages and carries 2"),
            "{parked:?}"
        );
        let mut no_count = FieldTable::default();
        no_count.insert(header::BUNDLE.into(), AMQPValue::LongString("two".into()));
        let parked = decode_bundle(&BasicProperties::default().with_headers(no_count), &body)
            .expect_err("count");
        assert!(parked.detail.contains("is not a count"), "{parked:?}");
    }

    #[test]
    fn a_summary_goes_out_and_comes_back_with_the_bundle() {
        assert_eq!(summary(&bundle_properties(2)), Summary::default());
        let plain = bundle_properties(2);
        let names = plain.headers().as_ref().unwrap().inner();
        assert_eq!(
            names.len(),
            1,
            "a bundle with nothing to say has its count only"
        );
        let said = Summary {
            uncounted_hops: 3,
            due: Some((1_000, 2_500)),
        };
        let passed = summarised_properties(2, &said);
        assert_eq!(count(&passed), Some(2));
        assert_eq!(*passed.delivery_mode(), Some(PERSISTENT));
        assert_eq!(summary(&passed), said);
    }

    #[test]
    fn a_summary_covers_every_due_time_unless_one_is_an_occurrence() {
        assert_eq!(Summary::of([]).due, None);
        assert_eq!(Summary::of([Some(5)]).due, Some((5, 5)));
        assert_eq!(
            Summary::of([Some(7), Some(3), Some(9), Some(4)]).due,
            Some((3, 9))
        );
        assert_eq!(Summary::of([Some(7), None, Some(3)]), Summary::default());
    }

    #[test]
    fn a_header_that_is_no_count_says_nothing() {
        let with = |entries: Vec<(&str, AMQPValue)>| {
            let mut headers = FieldTable::default();
            for (name, value) in entries {
                headers.insert(name.into(), value);
            }
            summary(&BasicProperties::default().with_headers(headers))
        };
        let hops = |value| with(vec![(header::BUNDLE_HOPS, value)]).uncounted_hops;
        assert_eq!(hops(AMQPValue::ShortInt(4)), 4, "any integer type");
        assert_eq!(hops(AMQPValue::LongLongInt(-1)), 0, "negative");
        assert_eq!(hops(AMQPValue::LongString("2".into())), 0, "not an integer");
        assert_eq!(
            hops(AMQPValue::LongLongInt(i64::MAX)),
            u32::MAX,
            "too large"
        );
        let due = |first, last| {
            with(vec![
                (header::BUNDLE_FIRST_DUE, first),
                (header::BUNDLE_LAST_DUE, last),
            ])
            .due
        };
        let int = AMQPValue::LongLongInt;
        assert_eq!(due(int(1), int(2)), Some((1, 2)));
        assert_eq!(due(int(2), int(1)), None, "first after last");
        assert_eq!(due(int(-1), int(2)), None, "negative");
        assert_eq!(due(int(1), AMQPValue::LongString("2".into())), None);
        assert_eq!(with(vec![(header::BUNDLE_FIRST_DUE, int(1))]).due, None);
    }

    #[test]
    fn message_ids_are_read_from_the_property_bytes_of_each_message() {
        let (_, body) = bundle(&[
            (properties("one"), b"first".to_vec()),
            (BasicProperties::default(), Vec::new()),
            (
                BasicProperties::default()
                    .with_content_type("text/plain".into())
                    .with_content_encoding("gzip".into())
                    .with_delivery_mode(2)
                    .with_correlation_id("c".into())
                    .with_reply_to("r".into())
                    .with_expiration("60000".into())
                    .with_message_id("three".into())
                    .with_app_id("app".into()),
                b"third".to_vec(),
            ),
        ]);
        let ids = member_message_ids(&body).expect("reads");
        assert_eq!(
            ids,
            vec![Some(&b"one"[..]), None, Some(&b"three"[..])],
            "in order, none for a message without"
        );
        for cut in 1..body.len() {
            let ids = member_message_ids(&body[..cut]);
            assert!(
                ids.is_none() || ids.is_some_and(|ids| ids.len() < 3),
                "cut at {cut}"
            );
        }
        assert_eq!(member_message_ids(&[]), None);
    }

    #[test]
    fn a_length_past_the_end_is_refused_without_reading_it() {
        let mut body = vec![FORMAT];
        body.extend_from_slice(&u32::MAX.to_be_bytes());
        assert!(decode_bundle(&bundle_properties(1), &body).is_err());
    }

    proptest! {
        #[test]
        fn any_bodies_and_ids_round_trip(
            messages in proptest::collection::vec(
                ("[a-z0-9-]{0,40}", proptest::collection::vec(any::<u8>(), 0..200)),
                1..20,
            )
        ) {
            let members: Vec<(BasicProperties, Vec<u8>)> = messages
                .into_iter()
                .map(|(id, body)| (properties(&id), body))
                .collect();
            let (props, body) = bundle(&members);
            let read = decode_bundle(&props, &body).expect("reads");
            prop_assert_eq!(read.len(), members.len());
            let ids = member_message_ids(&body).expect("ids");
            for (id, (properties, _)) in ids.iter().zip(&members) {
                let expected = properties.message_id().as_ref().map(|id| id.as_str().as_bytes());
                prop_assert_eq!(*id, expected);
            }
            for (member, (properties, body)) in read.iter().zip(&members) {
                prop_assert_eq!(&member.properties, properties);
                prop_assert_eq!(member.body, body.as_slice());
            }
        }
    }
}
