//! The checks behind the fuzz targets, shared with the replay test: the fuzz targets
//! (`fuzz/fuzz_targets/*.rs`) and the main package's `tests/fuzz_corpus.rs` both include
//! this file with `#[path]`, so a corpus file is checked by the same code on stable as
//! under libFuzzer.
//!
//! Each check takes any bytes, builds from them what a hostile publisher (or a writer to
//! the work exchange or the cancel stream) controls, hands it to the library, and asserts
//! that the answer is a value or a reason, never a panic, and that what the bridge would
//! publish next encodes, reads back as it wrote it, and keeps its own state apart from the
//! publisher's. Inputs start with a control byte; then, by one of its bits, either the
//! properties as an AMQP content header carries them (flags, then the properties, read by
//! the same parser the bridge's connection uses) or a compact description of properties
//! whose header names come from the contract's own (see [`structured_properties`]).

use std::fmt::Debug;
use std::time::Duration;

use amq_protocol::frame::WriteContext;
use amq_protocol::protocol::basic::{gen_properties, parse_properties};
use delay_bridge::cancel::{
    self, CLOCK_ALLOWANCE_MS, Clamp, FutureCancels, Inserted, Read, Scope, StreamEntry, Tombstone,
    TombstoneSet,
};
use delay_bridge::config::Route;
use delay_bridge::contract::signature::StateKeys;
use delay_bridge::contract::{
    self, Envelope, Incoming, Intake, ParkReason, Parked, bundle, header,
};
use delay_bridge::parked::{ParkedMessage, replay_properties};
use delay_bridge::recurring::{self, Recurrence};
use lapin::BasicProperties;
use lapin::types::{AMQPValue, DecimalValue, FieldArray, FieldTable, LongString, ShortString};

/// A target's check: any bytes in, a panic on a wrong answer.
pub type Check = fn(&[u8]);

/// The fuzz targets by name, each with its check.
pub const TARGETS: [(&str, Check); 4] = [
    ("decode", decode),
    ("bundle", bundle),
    ("recurring", recurring),
    ("cancel", cancel),
];

/// The earliest `now` of a check, epoch ms (November 2023); a check adds up to 136 years.
const BASE_MS: u64 = 1_700_000_000_000;
/// The bridge's work exchange in every check.
const WORK: &str = "t.work";
/// The bridge's AMQP user.
const BRIDGE_USER: &str = "guest";
/// The largest `frame_max` a broker negotiates by default.
const FRAME_MAX: u32 = 131_072;
/// How deep the compact description nests tables and arrays.
const MOST_DEPTH: u8 = 6;
/// `delays.max_delay` choices.
const MAX_DELAYS: [Duration; 4] = [
    Duration::from_secs(3_600),
    Duration::from_secs(30 * 86_400),
    Duration::from_secs(366 * 86_400),
    Duration::from_millis(u32::MAX as u64),
];
/// Smallest level choices.
const SMALLEST_LEVELS: [Duration; 4] = [
    Duration::from_millis(100),
    Duration::from_secs(1),
    Duration::from_secs(60),
    Duration::from_secs(3_600),
];

/// Text values a publisher plausibly sends: durations, cron expressions, zones, times,
/// numbers, cancel-stream kinds, ids and exchange names.
const TEXTS: [&str; 40] = [
    "",
    "0",
    "1000",
    "-250",
    " 42 ",
    "+7",
    "99999999999999999999999999999999",
    "1800000000000",
    "5m",
    "1h30m",
    "@every 10s",
    "@every 1d",
    "0 * * * *",
    "*/15 * * * * *",
    "30 2 * * *",
    "0 0 30 2 *",
    "0 0 29 2 *",
    "@daily",
    "@hourly",
    "* * * 1 *",
    "0 0 1 1 *",
    "Europe/Berlin",
    "America/New_York",
    "UTC",
    "Mars/Olympus",
    "2030-01-01T00:00:00Z",
    "2026-03-29T02:30:00+01:00",
    "1970-01-01T00:00:00Z",
    "cancel",
    "successors",
    "sync",
    "a",
    "b",
    "id-1",
    "in",
    "out",
    "t.work",
    "guest",
    "NaN",
    "1e3",
];

/// The header names a compact description picks from: every name of the contract, of
/// recurring schedules and of the cancel stream, and a few near misses.
fn names() -> Vec<&'static str> {
    let mut names: Vec<&'static str> = header::ALL.to_vec();
    names.extend([
        recurring::header::EVERY,
        recurring::header::CRON,
        recurring::header::TIME_ZONE,
        recurring::header::UNTIL,
        recurring::header::COUNT,
        recurring::header::OCCURRENCE,
        recurring::header::OCCURRENCE_DUE,
        recurring::header::OCCURRENCE_LATE,
        recurring::header::SKIPPED,
        cancel::header::KIND,
        cancel::header::CANCELLED_AT,
        cancel::header::DUE_AT,
        cancel::header::ENTERED_AT,
        cancel::header::AFTER_OCCURRENCE,
        cancel::header::BORN_BEFORE,
        "x-stream-offset",
        "x-last-death-queue",
        "delay-bridge-",
        "delay-bridge-other",
        "",
    ]);
    names
}

/// Bytes read from the front; past the end every read is zero, so any input is valid.
struct Input<'a> {
    bytes: &'a [u8],
}

impl<'a> Input<'a> {
    fn new(bytes: &'a [u8]) -> Self {
        Self { bytes }
    }

    fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    fn u8(&mut self) -> u8 {
        match self.bytes.split_first() {
            Some((first, rest)) => {
                self.bytes = rest;
                *first
            }
            None => 0,
        }
    }

    fn u16(&mut self) -> u16 {
        u16::from_be_bytes([self.u8(), self.u8()])
    }

    fn u32(&mut self) -> u32 {
        u32::from_be_bytes([self.u8(), self.u8(), self.u8(), self.u8()])
    }

    fn u64(&mut self) -> u64 {
        (u64::from(self.u32()) << 32) | u64::from(self.u32())
    }

    fn take(&mut self, n: usize) -> &'a [u8] {
        let (taken, rest) = self.bytes.split_at(n.min(self.bytes.len()));
        self.bytes = rest;
        taken
    }

    fn rest(&mut self) -> &'a [u8] {
        self.take(self.bytes.len())
    }

    /// A clock reading: [`BASE_MS`] plus up to 136 years.
    fn now(&mut self) -> u64 {
        BASE_MS + u64::from(self.u32()) * 1_000 + u64::from(self.u16() % 1_000)
    }

    /// Text of at most 255 bytes: one of [`TEXTS`], or bytes made UTF-8.
    fn text(&mut self) -> String {
        let len = self.u8();
        if len >= 0xd0 {
            return TEXTS[usize::from(len - 0xd0) % TEXTS.len()].to_string();
        }
        let raw = self.take(usize::from(len));
        truncated(String::from_utf8_lossy(raw).into_owned())
    }

    fn short(&mut self) -> ShortString {
        ShortString::from(self.text())
    }

    fn name(&mut self, names: &[&str]) -> ShortString {
        let pick = self.u8();
        if pick < 0xc0 {
            return ShortString::from(names[usize::from(pick) % names.len()]);
        }
        let raw = self.take(usize::from(pick & 0x3f));
        ShortString::from(truncated(String::from_utf8_lossy(raw).into_owned()))
    }

    /// A header value of any type the wire carries (no `ShortString`: a table cannot carry
    /// one), tables and arrays nested up to [`MOST_DEPTH`].
    fn value(&mut self, names: &[&str], depth: u8) -> AMQPValue {
        let nest = depth < MOST_DEPTH;
        match self.u8() % 22 {
            0 => AMQPValue::Boolean(self.u8() & 1 == 1),
            1 => AMQPValue::ShortShortInt(self.u8() as i8),
            2 => AMQPValue::ShortShortUInt(self.u8()),
            3 => AMQPValue::ShortInt(self.u16() as i16),
            4 => AMQPValue::ShortUInt(self.u16()),
            5 => AMQPValue::LongInt(self.u32() as i32),
            6 => AMQPValue::LongUInt(self.u32()),
            7 => AMQPValue::LongLongInt(self.u64() as i64),
            8 => AMQPValue::Float(f32::from_bits(self.u32())),
            9 => AMQPValue::Double(f64::from_bits(self.u64())),
            10 => AMQPValue::DecimalValue(DecimalValue {
                scale: self.u8(),
                value: self.u32(),
            }),
            11 => {
                let len = usize::from(self.u16() % 1_024);
                AMQPValue::LongString(LongString::from(self.take(len).to_vec()))
            }
            12 if nest => {
                let n = self.u8() % 8;
                let items: Vec<AMQPValue> = (0..n).map(|_| self.value(names, depth + 1)).collect();
                AMQPValue::FieldArray(FieldArray::from(items))
            }
            13 => AMQPValue::Timestamp(self.u64()),
            14 if nest => AMQPValue::FieldTable(self.table(names, depth + 1)),
            15 => {
                let len = usize::from(self.u8());
                AMQPValue::ByteArray(self.take(len).to_vec().into())
            }
            16 => AMQPValue::Void,
            17 | 18 => AMQPValue::LongString(LongString::from(self.text())),
            // An epoch time near now, as the contract's times are.
            19 => AMQPValue::LongLongInt((BASE_MS as i64) + i64::from(self.u32() as i32) * 1_000),
            // A number as text.
            20 => AMQPValue::LongString(LongString::from((self.u64() as i64).to_string())),
            _ => AMQPValue::LongLongInt(i64::from(self.u16())),
        }
    }

    fn table(&mut self, names: &[&str], depth: u8) -> FieldTable {
        let mut table = FieldTable::default();
        for _ in 0..self.u8() % 12 {
            let name = self.name(names);
            let value = self.value(names, depth);
            table.insert(name, value);
        }
        table
    }

    /// Properties from their compact description: 16 bits of flags (the content header's:
    /// bit 15 `content_type` ... bit 2 `cluster_id`), then each property present.
    fn structured_properties(&mut self, names: &[&str]) -> BasicProperties {
        let flags = self.u16();
        let on = |bit: u16| flags & (1 << bit) != 0;
        let mut p = BasicProperties::default();
        if on(15) {
            p = p.with_content_type(self.short());
        }
        if on(14) {
            p = p.with_content_encoding(self.short());
        }
        if on(13) {
            p = p.with_headers(self.table(names, 0));
        }
        if on(12) {
            p = p.with_delivery_mode(self.u8());
        }
        if on(11) {
            p = p.with_priority(self.u8());
        }
        if on(10) {
            p = p.with_correlation_id(self.short());
        }
        if on(9) {
            p = p.with_reply_to(self.short());
        }
        if on(8) {
            p = p.with_expiration(self.short());
        }
        if on(7) {
            p = p.with_message_id(self.short());
        }
        if on(6) {
            p = p.with_timestamp(self.u64());
        }
        if on(5) {
            p = p.with_type(self.short());
        }
        if on(4) {
            p = p.with_user_id(self.short());
        }
        if on(3) {
            p = p.with_app_id(self.short());
        }
        if on(2) {
            p = p.with_cluster_id(self.short());
        }
        p
    }

    /// Properties as the wire carries them (`wire`: the rest of the input, read by the
    /// codec, whatever it leaves is the rest again; `Err` with the bytes when the codec
    /// refuses them), or from their compact description.
    fn properties(&mut self, wire: bool, names: &[&str]) -> Result<BasicProperties, &'a [u8]> {
        if !wire {
            return Ok(self.structured_properties(names));
        }
        let bytes = self.bytes;
        match parse_properties(bytes) {
            Ok((rest, properties)) => {
                self.bytes = rest;
                Ok(properties)
            }
            Err(_) => {
                self.bytes = &[];
                Err(bytes)
            }
        }
    }
}

/// `text` cut to the 255 bytes of a short string, at a character boundary.
fn truncated(mut text: String) -> String {
    let mut end = text.len().min(255);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text.truncate(end);
    text
}

/// Equal as printed: structural equality in which a NaN equals itself.
fn same<T: Debug>(a: &T, b: &T) -> bool {
    format!("{a:?}") == format!("{b:?}")
}

fn header_of<'p>(properties: &'p BasicProperties, name: &str) -> Option<&'p AMQPValue> {
    properties.headers().as_ref()?.inner().get(name)
}

/// A header name the bridge keeps for itself, or that dead-lettering adds.
fn is_bridge_state(name: &str) -> bool {
    name.starts_with(header::BRIDGE_PREFIX)
        || header::DEATH_PREFIXES.iter().any(|p| name.starts_with(p))
}

/// Properties as the bridge would publish them: they encode, read back the same, and the
/// size the bridge computes for their frame is the size of the frame.
fn publishable(properties: &BasicProperties) {
    let encoded = gen_properties(properties)(WriteContext::from(Vec::new()))
        .expect("properties encode")
        .write;
    let back = match parse_properties(&encoded[..]) {
        Ok(([], back)) => back,
        other => panic!("properties read back: {other:?}"),
    };
    assert!(same(&back, properties), "{back:?} != {properties:?}");
    // Frame overhead 8, class, weight and body size 12; the flags are in `encoded`.
    assert_eq!(
        contract::content_header_frame_len(properties),
        8 + 12 + encoded.len(),
        "content_header_frame_len"
    );
}

/// Whether checks skip what a known finding (fuzz/README.md) would fail on, so that fuzzing
/// goes on past it: unless `DELAY_BRIDGE_FUZZ_KNOWN` is set, to reproduce one.
fn skip_known() -> bool {
    static SKIP: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *SKIP.get_or_init(|| std::env::var_os("DELAY_BRIDGE_FUZZ_KNOWN").is_none())
}

fn routes() -> Vec<Route> {
    vec![Route::new("in", "out"), Route::new("in2", "out2")]
}

fn keys() -> StateKeys {
    StateKeys::new(&[0x5a; 32], Some(&[0xa5; 32])).expect("keys of 32 bytes")
}

/// `decode`: a delivery from an ingress exchange, the work exchange, or another exchange;
/// its properties as the wire carries them (or the codec refuses them), or described.
///
/// Input: a control byte (bits 0-1 the exchange: `in`, the work exchange, `in2`,
/// `elsewhere`; bit 2 properties described, not as on the wire; bits 3-4 the max delay;
/// bits 5-6 the smallest level; bit 7 unsigned state accepted), the time (6 bytes), the
/// routing key (a length byte and its bytes), the properties, and the body (the rest).
pub fn decode(data: &[u8]) {
    let names = names();
    let mut input = Input::new(data);
    let control = input.u8();
    let exchange = ["in", WORK, "in2", "elsewhere"][usize::from(control & 3)];
    let wire = control & 4 == 0;
    let max_delay = MAX_DELAYS[usize::from((control >> 3) & 3)];
    let smallest_level = SMALLEST_LEVELS[usize::from((control >> 5) & 3)];
    let accept_unsigned = control & 0x80 != 0;
    let now = input.now();
    let key_len = usize::from(input.u8());
    let raw_key = input.take(key_len);
    let routing_key = ShortString::from(truncated(String::from_utf8_lossy(raw_key).into_owned()));
    let properties = input.properties(wire, &names);
    let body = input.rest();
    let routes = routes();
    let intake = Intake {
        work_exchange: WORK,
        routes: &routes,
        max_delay,
        smallest_level,
    };
    match properties {
        Ok(properties) => {
            publishable(&properties);
            delivered(
                exchange,
                &routing_key,
                &properties,
                body,
                now,
                &intake,
                accept_unsigned,
            );
        }
        Err(raw) => unreadable(raw, raw_key, now),
    }
}

/// A delivery the codec cannot read: parked as bytes, with properties any client reads.
fn unreadable(raw: &[u8], routing_key: &[u8], now: u64) {
    let what = "its properties (a header name or a property)";
    let (key, properties) = contract::unreadable_parked(raw, routing_key, what, now);
    assert!(key.as_str().len() <= 255);
    assert_eq!(
        header_of(&properties, header::RAW_PROPERTIES),
        Some(&AMQPValue::ByteArray(raw.to_vec().into()))
    );
    assert_eq!(
        header_of(&properties, header::REASON),
        Some(&AMQPValue::LongString(
            ParkReason::Unreadable.as_str().into()
        ))
    );
    publishable(&properties);
    // Too large for a frame: parked without the property bytes.
    let (_, bare) = contract::unreadable_parked(&[], routing_key, what, now);
    publishable(&bare);
    let described = ParkedMessage::describe(key.as_str(), &properties, 0);
    assert!(!described.replayable);
}

/// What the carrier does with a delivery the codec read: the redelivery limit, the state's
/// signature, then decode; a decoded message is carried, any other parked.
fn delivered(
    exchange: &str,
    routing_key: &ShortString,
    properties: &BasicProperties,
    body: &[u8],
    now: u64,
    intake: &Intake<'_>,
    accept_unsigned: bool,
) {
    if let Some(parked) = contract::redelivered_too_often(properties, 3) {
        assert_eq!(parked.reason, ParkReason::RedeliveryLimit);
    }
    let keys = keys();
    if let Err(parked) = keys.verify(properties, body, accept_unsigned) {
        assert_eq!(parked.reason, ParkReason::BadState);
        assert!(!parked.detail.is_empty());
    }
    let incoming = Incoming {
        exchange,
        routing_key,
        properties,
    };
    match contract::decode(incoming, now, intake) {
        Ok(envelope) => carried(&envelope, exchange != WORK, body, now, intake, &keys),
        Err(parked) if exchange != WORK => {
            // As the carrier parks a message taken in: without the `delay-bridge-*` headers
            // its publisher set, which are not the bridge's state.
            assert!(!parked.detail.is_empty(), "{parked:?}");
            let forged = properties.headers().as_ref().map_or(0, |h| {
                h.inner()
                    .keys()
                    .filter(|k| k.as_str().starts_with(header::BRIDGE_PREFIX))
                    .count()
            });
            let (consumed, removed) = contract::without_bridge_headers(properties);
            assert_eq!(removed, forged);
            park(true, routing_key, &consumed, &parked, body, now, intake);
        }
        Err(parked) => {
            assert!(!parked.detail.is_empty(), "{parked:?}");
            park(false, routing_key, properties, &parked, body, now, intake);
        }
    }
}

/// A parked copy: persistent, nothing that would expire it or route it again, the reason
/// said; listed with that reason; replayed through the work exchange without panic.
/// `publishers_own`: `consumed` are the publisher's properties as sent (parked at intake),
/// not the bridge's state.
fn park(
    publishers_own: bool,
    routing_key: &ShortString,
    consumed: &BasicProperties,
    parked: &Parked,
    body: &[u8],
    now: u64,
    intake: &Intake<'_>,
) {
    let properties = contract::parked_properties(consumed, parked, now);
    publishable(&properties);
    assert_eq!(*properties.delivery_mode(), Some(contract::PERSISTENT));
    assert!(properties.expiration().is_none() && properties.user_id().is_none());
    let table = properties.headers().as_ref().expect("parking headers");
    for name in table.inner().keys() {
        let name = name.as_str();
        assert!(
            !header::DEATH_PREFIXES.iter().any(|p| name.starts_with(p)),
            "{name} kept"
        );
        assert!(name != header::CC && name != header::BCC, "{name} kept");
    }
    let described = ParkedMessage::describe(routing_key.as_str(), &properties, body.len());
    assert_eq!(described.reason.as_deref(), Some(parked.reason.as_str()));
    let bare = contract::parked_properties_without_headers(consumed, parked, now);
    publishable(&bare);
    // The fallback for a parked copy too large for a frame keeps the `delay-bridge-*`
    // headers of the consumed message: of a message taken in, only those the parking
    // wrote (found by this target on 7c9a042, where a publisher's own were kept).
    if publishers_own {
        let written = [
            header::REASON,
            header::DETAIL,
            header::PARKED_AT,
            header::STATE_EXPIRATION,
            header::STATE_USER_ID,
        ];
        for name in bare
            .headers()
            .as_ref()
            .expect("parking headers")
            .inner()
            .keys()
        {
            assert!(
                written.contains(&name.as_str()),
                "the publisher's `{name}` kept in a parked copy without the publisher's headers"
            );
        }
    }
    // Replayed: back through the work exchange with the parking headers removed.
    let replay = replay_properties(&properties);
    for name in [header::REASON, header::DETAIL, header::PARKED_AT] {
        assert!(header_of(&replay, name).is_none(), "{name} kept on replay");
    }
    let incoming = Incoming {
        exchange: WORK,
        routing_key,
        properties: &replay,
    };
    if let Err(again) = contract::decode(incoming, now, intake) {
        assert!(!again.detail.is_empty());
    }
}

/// An envelope as a hop writes it and the next read returns it: an absent header table and
/// an empty one are the same, and a `delivery_mode` of 0 is no `delivery_mode` (the state
/// header says "absent" with 0).
fn normalized(envelope: &Envelope) -> Envelope {
    let mut envelope = envelope.clone();
    if envelope
        .properties
        .headers
        .as_ref()
        .is_some_and(|h| h.inner().is_empty())
    {
        envelope.properties.headers = None;
    }
    if envelope.stash.delivery_mode == Some(0) {
        envelope.stash.delivery_mode = None;
    }
    envelope
}

/// A decoded message: within the limits, its state apart from the publisher's headers;
/// its hop reads back as the same envelope one hop further (signed, through a level,
/// alone or in a bundle); its delivery carries no bridge state; it parks cleanly.
fn carried(
    envelope: &Envelope,
    from_ingress: bool,
    body: &[u8],
    now: u64,
    intake: &Intake<'_>,
    keys: &StateKeys,
) {
    if from_ingress {
        let max_ms = intake.max_delay.as_millis() as u64;
        assert!(envelope.deliver_at >= now, "due before now");
        if envelope.occurrence.is_none() {
            assert!(
                envelope.deliver_at <= now + max_ms,
                "due beyond the max delay"
            );
        }
        assert_eq!(envelope.hops, 0);
        assert_eq!(envelope.first_seen, now);
    }
    assert!(intake.routes.iter().any(|r| r.target == envelope.target));
    let kept = &envelope.properties;
    if let Some(headers) = &kept.headers {
        for name in headers.inner().keys() {
            let name = name.as_str();
            assert!(!is_bridge_state(name), "{name} kept as the publisher's");
            assert!(name != header::CC && name != header::BCC, "{name} travels");
        }
    }
    assert!(kept.expiration.is_none() && kept.user_id.is_none() && kept.delivery_mode.is_none());
    let read = |properties: &BasicProperties| {
        let incoming = Incoming {
            exchange: WORK,
            routing_key: &envelope.routing_key,
            properties,
        };
        contract::decode(incoming, now, intake).map(|e| normalized(&e))
    };

    // As it was read, rebuilt for parking.
    let consumed = contract::consumed_properties(envelope);
    publishable(&consumed);
    let again = read(&consumed);
    assert!(same(&again, &Ok(normalized(envelope))), "{again:?}");

    // Delivered: the publisher's, restored, without the bridge's state.
    let delivered = contract::delivery_properties(envelope, BRIDGE_USER);
    publishable(&delivered);
    if let Some(headers) = delivered.headers() {
        for name in headers.inner().keys() {
            assert!(!is_bridge_state(name.as_str()), "{name} delivered");
        }
    }
    assert!(same(
        &header_of(&delivered, header::CC),
        &envelope.stash.cc.as_ref()
    ));
    assert!(same(
        &header_of(&delivered, header::BCC),
        &envelope.stash.bcc.as_ref()
    ));
    assert_eq!(delivered.expiration(), &envelope.stash.expiration);

    let parked = Parked::new(
        ParkReason::TargetMissing,
        "the target exchange does not exist",
    );
    park(
        false,
        &envelope.routing_key,
        &consumed,
        &parked,
        body,
        now,
        intake,
    );

    // One hop, signed, through a level, and back.
    let hop = contract::hop_properties(envelope);
    publishable(&hop);
    let signed = keys.sign(hop.clone(), body);
    keys.verify(&signed, body, false)
        .expect("the bridge's own signature verifies");
    let mut through_level = contract::Properties::from(&signed);
    if let Some(headers) = through_level.headers.as_mut() {
        headers.insert(
            "x-death".into(),
            AMQPValue::FieldArray(FieldArray::default()),
        );
        headers.insert(
            "x-first-death-reason".into(),
            AMQPValue::LongString("expired".into()),
        );
    }
    let through_level: BasicProperties = through_level.into();
    let hopped = Envelope {
        // The count saturates (found by this target on 7c9a042, where it overflowed).
        hops: envelope.hops.saturating_add(1),
        ..normalized(envelope)
    };
    let back = read(&through_level);
    assert!(
        same(&back, &Ok(hopped.clone())),
        "a hop reads back: {back:?} != {hopped:?}"
    );

    // A bundle of one, its id read the quick way.
    let member = bundle::encode_member(&hop, body).expect("a member encodes");
    let bundled = bundle::bundle_body([member.as_slice()]);
    let members = bundle::decode_bundle(&bundle::bundle_properties(1), &bundled)
        .expect("a bundle of one reads");
    assert_eq!(members.len(), 1);
    assert!(same(&members[0].properties, &hop));
    assert_eq!(members[0].body, body);
    let id = hop.message_id().as_ref().map(|id| id.as_str().as_bytes());
    assert_eq!(bundle::member_message_ids(&bundled), Some(vec![id]));
}

/// `bundle`: a delivery from the work exchange that says it is a bundle.
///
/// Input: a control byte (bit 0: the bundle's properties described, else a count of the
/// messages the body holds with a summary; bit 1 with uncounted hops; bit 2 with due
/// times), the time, then, per bit 0, the properties or the summary's numbers, and the
/// body (the rest).
pub fn bundle(data: &[u8]) {
    let names = names();
    let mut input = Input::new(data);
    let control = input.u8();
    let now = input.now();
    let described = (control & 1 != 0).then(|| input.structured_properties(&names));
    let uncounted_hops = if control & 2 != 0 { input.u32() } else { 0 };
    let due = (control & 4 != 0).then(|| {
        let first = BASE_MS + u64::from(input.u32());
        (first, first + u64::from(input.u32()))
    });
    let body = input.rest();
    let ids = bundle::member_message_ids(body);
    let properties = described.unwrap_or_else(|| {
        let count = ids.as_ref().map_or(1, Vec::len);
        let summary = bundle::Summary {
            uncounted_hops,
            due,
        };
        bundle::summarised_properties(count, &summary)
    });
    let count = bundle::count(&properties);
    if count.is_some() {
        assert!(bundle::is_bundle(&properties));
    }
    let within = bundle::count_within(&properties, body.len());
    assert!(within <= count && within.is_some() == count.is_some());
    let summary = bundle::summary(&properties);
    if let Some((first, last)) = summary.due {
        assert!(first <= last);
    }
    let members = match bundle::decode_bundle(&properties, body) {
        Ok(members) => members,
        Err(parked) => {
            assert_eq!(parked.reason, ParkReason::BadState);
            assert!(!parked.detail.is_empty());
            return;
        }
    };
    assert_eq!(Some(members.len() as u64), count);
    assert_eq!(within, count, "a bundle that reads holds its count");
    let ids = ids.expect("the id reader reads every bundle the full reader reads");
    assert_eq!(ids.len(), members.len());
    for (id, member) in ids.iter().zip(&members) {
        let read = member.properties.message_id().as_ref();
        assert_eq!(
            *id,
            read.map(|id| id.as_str().as_bytes()),
            "ids read two ways"
        );
    }
    // Written again, read again: the same messages.
    let encoded: Vec<Vec<u8>> = members
        .iter()
        .map(|m| bundle::encode_member(&m.properties, m.body).expect("a member encodes"))
        .collect();
    let again = bundle::bundle_body(encoded.iter().map(Vec::as_slice));
    let back = bundle::decode_bundle(&bundle::bundle_properties(members.len()), &again)
        .expect("a bundle written again reads");
    assert!(same(&back, &members));
    // Each message is carried as one that hopped alone.
    let routes = routes();
    let intake = Intake {
        work_exchange: WORK,
        routes: &routes,
        max_delay: MAX_DELAYS[2],
        smallest_level: SMALLEST_LEVELS[1],
    };
    let routing_key = ShortString::from("rk");
    for member in members.iter().take(8) {
        publishable(&member.properties);
        delivered(
            WORK,
            &routing_key,
            &member.properties,
            member.body,
            now,
            &intake,
            false,
        );
    }
}

/// `recurring`: the `x-repeat-*` headers read, checked, and a few occurrences delivered,
/// each late by up to 49 days (an outage: the cost of `delivering` is bounded).
///
/// Input: a control byte (bit 0: the message has an id; bit 1 headers described, not as on
/// the wire; bit 2 the publisher gave a due time; bits 3-4 the smallest level; bits 5-6 the
/// max delay), the time, the due time's offset (4 bytes), how many occurrences (1 byte),
/// each one's lateness (4 bytes each, read as the occurrences go), then the properties
/// whose header table is read.
pub fn recurring(data: &[u8]) {
    let names = names();
    let mut input = Input::new(data);
    let control = input.u8();
    let has_id = control & 1 != 0;
    let wire = control & 2 == 0;
    let smallest_level = SMALLEST_LEVELS[usize::from((control >> 3) & 3)];
    let max_delay = MAX_DELAYS[usize::from((control >> 5) & 3)];
    let now = input.now();
    let due_offset = u64::from(input.u32());
    let given_due = (control & 4 != 0).then_some(now + due_offset);
    let steps = input.u8() % 4;
    let lateness: Vec<u64> = (0..=steps).map(|_| u64::from(input.u32())).collect();
    let Ok(properties) = input.properties(wire, &names) else {
        return;
    };
    let headers = properties.headers().clone().unwrap_or_default();
    let recurrence = match Recurrence::from_headers(&headers, has_id) {
        Ok(Some(recurrence)) => recurrence,
        Ok(None) => return,
        Err(refused) => {
            assert!(!refused.to_string().is_empty());
            return;
        }
    };
    if let Err(refused) = recurrence.check(now, smallest_level, max_delay) {
        assert!(!refused.to_string().is_empty());
        return;
    }
    let Some(first) = recurrence.first(given_due, now) else {
        return;
    };
    assert_eq!(first.number, 1);
    match given_due {
        Some(due) => assert_eq!(first.due_ms, due),
        None => assert!(first.due_ms > now, "the first occurrence is after now"),
    }
    // Known (fuzz/README.md, `recurring`): `check` samples the gaps of the next 64
    // occurrences only, so for a rule whose long gap lies beyond them (`* * * 1 *`, every
    // minute of January) `first` may be due further ahead than the max delay. The bridge
    // does not take such a schedule in (`contract::decode` refuses a first occurrence
    // beyond it), and ends one whose next occurrence is (the carrier's check at each
    // occurrence); `Recurrence` alone does not. Checked only with DELAY_BRIDGE_FUZZ_KNOWN.
    let max_ms = max_delay.as_millis() as u64;
    let known = !skip_known();
    if known && given_due.is_none() {
        assert!(
            first.due_ms - now <= max_ms,
            "first occurrence beyond the max delay"
        );
    }
    let within_end = |o: recurring::Occurrence| {
        recurrence.count.is_none_or(|count| o.number <= count)
            && recurrence.until_ms.is_none_or(|until| o.due_ms <= until)
    };
    assert!(within_end(first));
    let mut current = first;
    for late in lateness {
        let at = current.due_ms.saturating_add(late);
        let delivering = recurrence.delivering(current, at);
        // An interval counts what it skipped exactly; a cron rule up to a bound.
        if matches!(recurrence.rule, recurring::Rule::Cron { .. }) {
            assert!(delivering.skipped <= recurring::MOST_SKIPPED_COUNTED);
        }
        let with = recurring::with_occurrence(properties.clone(), current, &delivering);
        publishable(&with);
        assert_eq!(
            header_of(&with, recurring::header::OCCURRENCE),
            Some(&AMQPValue::LongLongInt(current.number as i64))
        );
        // A publisher's own `x-occurrence-late` passes through on time: only a late one is
        // said.
        if delivering.late() {
            assert_eq!(
                header_of(&with, recurring::header::OCCURRENCE_LATE),
                Some(&AMQPValue::Boolean(true))
            );
            assert_eq!(
                header_of(&with, recurring::header::SKIPPED),
                Some(&AMQPValue::LongLongInt(delivering.skipped as i64))
            );
        }
        let Some(next) = delivering.next else {
            break;
        };
        assert_eq!(
            next.number,
            current
                .number
                .saturating_add(delivering.skipped)
                .saturating_add(1)
        );
        assert!(next.due_ms > current.due_ms, "the next occurrence is later");
        if known {
            let last = if delivering.skipped > 0 {
                at
            } else {
                current.due_ms
            };
            assert!(
                next.due_ms - last <= max_ms,
                "next occurrence beyond the max delay"
            );
        }
        if delivering.skipped > 0 {
            assert!(next.due_ms > at, "after skipping, the next is after now");
        }
        assert!(within_end(next));
        current = next;
    }
}

/// `cancel`: entries of the cancel stream read as the cancel follower reads them
/// (`src/bridge/cancels.rs`): a tombstone dated ahead held in [`FutureCancels`] until its
/// clamp, clamps and bridges' times taken only from bridges, what applies fed into a
/// [`TombstoneSet`]; copies checked against it, catch-ups ended and begun, expiries, as
/// the clock goes on.
///
/// Input: a control byte (bit 0 entries described, not as on the wire; bits 1-2 how long
/// tombstones are kept, bits 3-4 the grace), the time, then operations, each a byte: an
/// entry (bit 6: read without a stream offset; bit 7: not written by a bridge; the clock on
/// by 2 bytes of seconds, then its properties), a copy checked, an occurrence checked, an
/// expiry (the clock on by 2 bytes of seconds), or the catch-up ended (bit 7: begun again).
pub fn cancel(data: &[u8]) {
    let names = names();
    let mut input = Input::new(data);
    let control = input.u8();
    let wire = control & 1 == 0;
    let keep_ms = [60_000, 3_600_000, 31_622_400_000, u64::MAX][usize::from((control >> 1) & 3)];
    let grace_ms = [0, 1_000, 300_000, u64::MAX][usize::from((control >> 3) & 3)];
    let mut now = input.now();
    let mut set = TombstoneSet::new(keep_ms, grace_ms);
    assert_eq!(set.keep_ms(), keep_ms);
    let mut future = FutureCancels::new();
    let mut offset = 0u64;
    let mut ids: Vec<String> = vec!["a".into()];
    let targets = ["out", "out2"];
    let mut operations = 0;
    while !input.is_empty() && operations < 256 {
        operations += 1;
        let op = input.u8();
        let bridges = op & 0x80 == 0;
        match op % 6 {
            0 | 1 => {
                now += u64::from(input.u16()) * 1_000;
                let Ok(properties) = input.properties(wire, &names) else {
                    break;
                };
                offset += 1;
                let at_offset = (op & 0x40 == 0).then_some(offset);
                let entry = cancel::read_entry(&properties);
                stream_entry(&entry, &properties);
                // The trust table, as every reader of the stream applies it.
                let writer = if bridges {
                    cancel::Writer::Bridge
                } else {
                    cancel::Writer::Other
                };
                if entry
                    .kind()
                    .is_some_and(|kind| !cancel::trust::taken(kind, writer))
                {
                    continue;
                }
                match entry {
                    StreamEntry::Cancel(tombstone) => {
                        ids.push(tombstone.message_id.clone());
                        if set.expired(&tombstone, now) {
                            continue;
                        }
                        match future.tombstone(at_offset, tombstone, now) {
                            Read::Apply(tombstone) => insert(&mut set, tombstone, now),
                            Read::Held => {}
                            Read::Unclamped(_) => unreachable!("no clock behind here"),
                            Read::Clamp(clamp) => {
                                // Appended by this bridge, read back: the held one applies.
                                assert_eq!(clamp.cancelled_at, now + CLOCK_ALLOWANCE_MS);
                                let written = cancel::clamp_properties(&clamp, now)
                                    .expect("a tombstone's id is an id");
                                publishable(&written);
                                let StreamEntry::Clamp {
                                    offset,
                                    cancelled_at,
                                    at,
                                } = cancel::read_entry(&written)
                                else {
                                    panic!("a clamp reads back as one");
                                };
                                assert_eq!(
                                    (offset, cancelled_at, at),
                                    (clamp.offset, clamp.cancelled_at, now)
                                );
                                future.bridge_time(at);
                                let held = future
                                    .clamp(offset, cancelled_at)
                                    .expect("the clamped tombstone is held");
                                assert!(held.cancelled_at <= cancelled_at);
                                insert(&mut set, held, now);
                            }
                        }
                    }
                    StreamEntry::Successors(successors) => {
                        ids.push(successors.message_id.clone());
                        set.insert_successors(successors, now);
                    }
                    StreamEntry::Sync { at: Some(at), .. } => future.bridge_time(at),
                    StreamEntry::Clamp {
                        offset,
                        cancelled_at,
                        at,
                    } => {
                        future.bridge_time(at);
                        if let Some(held) = future.clamp(offset, cancelled_at) {
                            assert!(held.cancelled_at <= cancelled_at);
                            insert(&mut set, held, now);
                        }
                    }
                    _ => {}
                }
            }
            2 => {
                let id = &ids[usize::from(input.u8()) % ids.len()];
                let entered_at = now.saturating_sub(u64::from(input.u32()) * 1_000);
                if set.cancels(id, entered_at) {
                    assert!(set.names(id));
                }
            }
            3 => {
                let id = &ids[usize::from(input.u8()) % ids.len()];
                let target = targets[usize::from(op >> 7)];
                let entered_at = now.saturating_sub(u64::from(input.u32()) * 1_000);
                let occurrence = u64::from(input.u8());
                let born = input.u64();
                let schedule = set.cancels_schedule(id, target, entered_at);
                let dropped = set.cancels_occurrence(id, target, entered_at, occurrence, born);
                assert!(
                    !schedule || dropped,
                    "a cancelled schedule drops its occurrences"
                );
                set.latest_birth(id, target, entered_at);
            }
            4 => {
                now += u64::from(input.u16()) * 1_000;
                set.expire(now);
                if let Some(next) = set.next_expiry() {
                    assert!(next > now, "{next} expires by {now}, after expiring");
                }
            }
            _ if bridges => {
                let (apply, clamps) = future.caught_up(now);
                for tombstone in apply {
                    assert!(tombstone.cancelled_at <= now + CLOCK_ALLOWANCE_MS);
                    insert(&mut set, tombstone, now);
                }
                for clamp in clamps {
                    assert_eq!(clamp.cancelled_at, now + CLOCK_ALLOWANCE_MS);
                    let written = cancel::clamp_properties(&clamp, now).expect("an id");
                    publishable(&written);
                }
            }
            _ => future.catching_up(),
        }
        // `is_empty` agrees with `len`.
        #[allow(clippy::len_zero)]
        let none = set.len() == 0;
        assert_eq!(set.is_empty(), none);
    }
    // A checkpoint of the state, written and read back, decides as the state does (what
    // has expired is not read back).
    set.expire(now);
    let mut records = set.records();
    future.records(&mut records);
    let bodies = cancel::checkpoint::parts(&records);
    let read: Vec<_> = bodies
        .iter()
        .flat_map(|body| cancel::checkpoint::decode_part(body).expect("a part reads back"))
        .collect();
    assert_eq!(read, records);
    let mut restored = TombstoneSet::new(keep_ms, grace_ms);
    let mut restored_future = FutureCancels::new();
    for record in read {
        restored_future.restore(&record);
        restored.restore(record, now);
    }
    assert_eq!(restored.len(), set.len());
    assert_eq!(restored.successors_len(), set.successors_len());
    assert_eq!(restored.next_expiry(), set.next_expiry());
    assert_eq!(restored_future.held(), future.held());
    for id in &ids {
        assert_eq!(restored.names(id), set.names(id), "{id}");
        for entered_at in [0, now / 2, now] {
            assert_eq!(
                restored.cancels_schedule(id, "out", entered_at),
                set.cancels_schedule(id, "out", entered_at),
                "{id} entered at {entered_at}"
            );
        }
    }
}

/// A tombstone applied: a cancel of every copy is named by its id from then on (until it
/// expires); a schedule's replacement names nothing.
fn insert(set: &mut TombstoneSet, tombstone: Tombstone, now: u64) {
    let id = tombstone.message_id.clone();
    let every = tombstone.scope == Scope::Every;
    let before = set.names(&id);
    let inserted = set.insert(tombstone, now);
    if !every {
        assert_eq!(set.names(&id), before);
        return;
    }
    match inserted {
        Inserted::New => assert!(!before && set.names(&id)),
        Inserted::Extended | Inserted::Covered => assert!(before && set.names(&id)),
        Inserted::Expired => assert_eq!(set.names(&id), before),
    }
}

/// An entry read from the stream says what it is, and written again as the bridge writes
/// it, reads back the same.
fn stream_entry(entry: &StreamEntry, properties: &BasicProperties) {
    let id = properties.message_id().as_ref().map(ShortString::as_str);
    let (written, expected) = match entry {
        StreamEntry::Cancel(tombstone) => {
            assert_eq!(Some(tombstone.message_id.as_str()), id);
            let id = cancel::message_id(&tombstone.message_id).expect("a read id is an id");
            match &tombstone.scope {
                Scope::Every => (
                    cancel::tombstone_properties(id, tombstone.cancelled_at, tombstone.due_at),
                    entry.clone(),
                ),
                // A replacement is written without a due time.
                Scope::Schedules { target } => (
                    cancel::replaced_properties(id, target, tombstone.cancelled_at),
                    StreamEntry::Cancel(Tombstone {
                        due_at: None,
                        ..tombstone.clone()
                    }),
                ),
            }
        }
        StreamEntry::Successors(successors) => {
            assert_eq!(Some(successors.message_id.as_str()), id);
            let id = cancel::message_id(&successors.message_id).expect("a read id is an id");
            (cancel::successors_properties(id, successors), entry.clone())
        }
        StreamEntry::Sync {
            token,
            at,
            checkpoint,
        } => {
            assert_eq!(Some(token.as_str()), id);
            // A bridge writes the time always.
            let at = at.unwrap_or(0);
            (
                cancel::sync_properties(ShortString::from(token.as_str()), at, *checkpoint),
                StreamEntry::Sync {
                    token: token.clone(),
                    at: Some(at),
                    checkpoint: *checkpoint,
                },
            )
        }
        StreamEntry::CheckpointBegin { token, at } => {
            assert_eq!(Some(token.as_str()), id);
            // A bridge writes the time always.
            let at = at.unwrap_or(0);
            (
                cancel::checkpoint_begin_properties(ShortString::from(token.as_str()), at),
                StreamEntry::CheckpointBegin {
                    token: token.clone(),
                    at: Some(at),
                },
            )
        }
        StreamEntry::CheckpointPart { token, part, parts } => {
            assert_eq!(Some(token.as_str()), id);
            assert!(part < parts);
            (
                cancel::checkpoint_part_properties(
                    ShortString::from(token.as_str()),
                    0,
                    *part,
                    *parts,
                ),
                entry.clone(),
            )
        }
        StreamEntry::Clamp {
            offset,
            cancelled_at,
            at,
        } => {
            let clamp = Clamp {
                offset: *offset,
                message_id: id.expect("a clamp has an id").to_string(),
                cancelled_at: *cancelled_at,
            };
            let written = cancel::clamp_properties(&clamp, *at).expect("a read id is an id");
            (written, entry.clone())
        }
        StreamEntry::Invalid(why) => {
            assert!(!why.is_empty());
            return;
        }
        StreamEntry::NotTaken(_) => unreachable!("read_entry judges no writer"),
    };
    publishable(&written);
    assert_eq!(
        cancel::read_entry(&written),
        expected,
        "written again, read again"
    );
}

/// Inputs to start each target's corpus from: what the bridge and its publishers really
/// send, in each target's input format. The replay test checks them too.
pub fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    let mut seeds = Vec::new();
    let wire = |p: &BasicProperties| {
        gen_properties(p)(WriteContext::from(Vec::new()))
            .expect("properties encode")
            .write
    };
    let table = |entries: Vec<(&str, AMQPValue)>| {
        let mut t = FieldTable::default();
        for (k, v) in entries {
            t.insert(k.into(), v);
        }
        t
    };
    let text = |s: &str| AMQPValue::LongString(s.into());
    let int = AMQPValue::LongLongInt;
    let now = BASE_MS as i64;
    let publisher = [
        table(vec![]),
        table(vec![(header::DELAY, AMQPValue::LongInt(5_000))]),
        table(vec![(header::DELAY, text("2500"))]),
        table(vec![(header::DELAY, AMQPValue::Double(1.5e3))]),
        table(vec![(header::DELIVER_AT, int(now + 60_000))]),
        table(vec![(header::DELIVER_AT, text("2030-01-01T00:00:00Z"))]),
        table(vec![(
            header::OPT_DELIVERY_TIME,
            AMQPValue::Timestamp(1_700_000_100),
        )]),
        table(vec![(header::OPT_DELIVERY_DELAY, int(90_000))]),
        table(vec![
            (header::DELAY, int(1_000)),
            (header::PUBLISHED_AT, int(now)),
            (
                header::CC,
                AMQPValue::FieldArray(vec![text("other")].into()),
            ),
            (
                header::BCC,
                AMQPValue::FieldArray(vec![text("hidden")].into()),
            ),
        ]),
        table(vec![
            (recurring::header::EVERY, text("5m")),
            (recurring::header::COUNT, int(3)),
        ]),
        table(vec![
            (recurring::header::CRON, text("30 2 * * *")),
            (recurring::header::TIME_ZONE, text("Europe/Berlin")),
            (recurring::header::UNTIL, text("2030-01-01T00:00:00Z")),
        ]),
        table(vec![
            (header::DELAY, int(1_000)),
            (
                "x-death",
                AMQPValue::FieldArray(
                    vec![AMQPValue::FieldTable(table(vec![("count", int(1))]))].into(),
                ),
            ),
            (
                "nested",
                AMQPValue::FieldTable(table(vec![(
                    "t",
                    AMQPValue::FieldTable(table(vec![(
                        "d",
                        AMQPValue::DecimalValue(DecimalValue { scale: 2, value: 5 }),
                    )])),
                )])),
            ),
            ("bytes", AMQPValue::ByteArray(vec![0, 255].into())),
            ("void", AMQPValue::Void),
        ]),
    ];
    let full = |headers: FieldTable| {
        BasicProperties::default()
            .with_content_type("application/json".into())
            .with_headers(headers)
            .with_delivery_mode(1)
            .with_priority(3)
            .with_correlation_id("c".into())
            .with_reply_to("r".into())
            .with_expiration("60000".into())
            .with_message_id("id-1".into())
            .with_timestamp(1_700_000_000)
            .with_type("t".into())
            .with_user_id("guest".into())
            .with_app_id("app".into())
    };
    let routes = routes();
    let intake = Intake {
        work_exchange: WORK,
        routes: &routes,
        max_delay: MAX_DELAYS[2],
        smallest_level: SMALLEST_LEVELS[1],
    };
    // control, time (6 bytes), routing key, properties, body.
    let decode_input = |control: u8, properties: &[u8], body: &[u8]| {
        let mut input = vec![control, 0, 0, 0, 0, 0, 0, 2, b'r', b'k'];
        input.extend_from_slice(properties);
        input.extend_from_slice(body);
        input
    };
    let mut hops = Vec::new();
    for headers in &publisher {
        for properties in [
            BasicProperties::default().with_headers(headers.clone()),
            full(headers.clone()),
        ] {
            let bytes = wire(&properties);
            seeds.push(("decode", decode_input(0x10, &bytes, b"body")));
            seeds.push(("recurring", {
                let mut input = vec![
                    0x11, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0,
                ];
                input.extend_from_slice(&bytes);
                input
            }));
            let incoming = Incoming {
                exchange: "in",
                routing_key: &"rk".into(),
                properties: &properties,
            };
            if let Ok(envelope) = contract::decode(incoming, BASE_MS, &intake) {
                let hop = contract::hop_properties(&envelope);
                seeds.push(("decode", decode_input(0x11, &wire(&hop), b"body")));
                seeds.push((
                    "decode",
                    decode_input(0x11, &wire(&keys().sign(hop.clone(), b"body")), b"body"),
                ));
                hops.push(hop);
            }
        }
    }
    // A header name that is not UTF-8: the codec refuses it.
    let unreadable = [0x20, 0x00, 0, 0, 0, 4, 2, 0xff, 0xfe, b'V'];
    seeds.push(("decode", decode_input(0x00, &unreadable, b"")));
    // Bundles of the hops: counted (control 6: with uncounted hops and due times), and
    // with their properties described (control 1).
    for n in [1, 2, hops.len()] {
        let members: Vec<Vec<u8>> = hops
            .iter()
            .take(n)
            .map(|hop| bundle::encode_member(hop, b"m").expect("a member encodes"))
            .collect();
        let body = bundle::bundle_body(members.iter().map(Vec::as_slice));
        let mut input = vec![0x06, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 10];
        input.extend_from_slice(&body);
        seeds.push(("bundle", input));
        // Described: flags 0x2000 (headers), one entry, name 26 (`delay-bridge-bundle` in
        // `header::ALL`), value tag 21 (a 16-bit integer).
        let index = header::ALL
            .iter()
            .position(|n| *n == header::BUNDLE)
            .expect("listed") as u8;
        let mut input = vec![0x01, 0, 0, 0, 0, 0, 0, 0x20, 0x00, 1, index, 21, 0, n as u8];
        input.extend_from_slice(&body);
        seeds.push(("bundle", input));
    }
    // Cancel stream entries: a tombstone with a due time, a successor tombstone, a marker.
    let mut stream = vec![0x02, 0, 0, 0, 0, 0, 0];
    let entries = [
        cancel::tombstone_properties("a".into(), BASE_MS, Some(BASE_MS + 60_000)),
        cancel::tombstone_properties("b".into(), BASE_MS + 5_000, None),
        // Dated an hour ahead: held, clamped.
        cancel::tombstone_properties("c".into(), BASE_MS + 3_600_000, None),
        cancel::replaced_properties("a".into(), "out", BASE_MS),
        cancel::successors_properties(
            "a".into(),
            &cancel::Successors {
                message_id: "a".into(),
                target: Some("out".into()),
                entered_at: BASE_MS,
                after_occurrence: 2,
                born_before: cancel::birth(BASE_MS, 7),
                due_at: BASE_MS + 120_000,
            },
        ),
        cancel::sync_properties("token".into(), BASE_MS, Some(12)),
        cancel::checkpoint_begin_properties("checkpoint".into(), BASE_MS),
        cancel::checkpoint_part_properties("checkpoint".into(), 12, 0, 2),
        cancel::clamp_properties(
            &Clamp {
                offset: 3,
                message_id: "c".into(),
                cancelled_at: BASE_MS + 1_000,
            },
            BASE_MS,
        )
        .expect("an id"),
    ];
    // The catch-up ends first: the tombstone dated ahead is then clamped as read live.
    stream.push(5);
    for entry in &entries {
        stream.extend_from_slice(&[0, 0, 1]);
        stream.extend_from_slice(&wire(entry));
    }
    // Check a copy of `a`, an occurrence of it, then expire an hour later.
    stream.extend_from_slice(&[
        2, 0, 0, 0, 0, 1, 3, 0, 0, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0, 1, 4, 0x0e, 0x10,
    ]);
    seeds.push(("cancel", stream));
    seeds
}
