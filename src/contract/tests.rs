use super::*;
use lapin::types::{DecimalValue, FieldArray};

const NOW: u64 = 1_800_000_000_000;
const WORK: &str = "t.work";

fn routes() -> Vec<Route> {
    vec![Route::new("in", "out")]
}

fn table(entries: Vec<(&str, AMQPValue)>) -> FieldTable {
    let mut t = FieldTable::default();
    for (k, v) in entries {
        t.insert(k.into(), v);
    }
    t
}

fn ls(s: &str) -> AMQPValue {
    AMQPValue::LongString(s.into())
}

fn decode_with(exchange: &str, props: &BasicProperties) -> Result<Envelope, Parked> {
    let routes = routes();
    let intake = Intake {
        work_exchange: WORK,
        routes: &routes,
        max_delay: Duration::from_secs(366 * 86_400),
        smallest_level: Duration::from_secs(1),
    };
    decode(
        Incoming {
            exchange,
            routing_key: &"rk.1".into(),
            properties: props,
        },
        NOW,
        &intake,
    )
}

fn with_headers(entries: Vec<(&str, AMQPValue)>) -> BasicProperties {
    BasicProperties::default().with_headers(table(entries))
}

/// Header entries of one test case.
type Headers = Vec<(&'static str, AMQPValue)>;

/// What happens to a new message with these headers.
#[derive(Debug, PartialEq)]
enum Outcome {
    /// Due this many ms after now.
    DueIn(u64),
    Park(ParkReason),
}

fn outcome(headers: Vec<(&str, AMQPValue)>) -> Outcome {
    match decode_with("in", &with_headers(headers)) {
        Ok(e) => Outcome::DueIn(e.deliver_at - NOW),
        Err(p) => Outcome::Park(p.reason),
    }
}

#[test]
fn odd_and_bad_inputs_have_exact_outcomes() {
    use Outcome::*;
    use ParkReason::*;
    let year_ms: u64 = 366 * 86_400_000;
    let cases: Vec<(&str, Headers, Outcome)> = vec![
        ("no header", vec![], DueIn(0)),
        ("zero", vec![("x-delay", AMQPValue::LongInt(0))], DueIn(0)),
        (
            "negative",
            vec![("x-delay", AMQPValue::LongInt(-500))],
            DueIn(0),
        ),
        (
            "i8",
            vec![("x-delay", AMQPValue::ShortShortInt(100))],
            DueIn(100),
        ),
        (
            "u8",
            vec![("x-delay", AMQPValue::ShortShortUInt(200))],
            DueIn(200),
        ),
        (
            "i16",
            vec![("x-delay", AMQPValue::ShortInt(300))],
            DueIn(300),
        ),
        (
            "u16",
            vec![("x-delay", AMQPValue::ShortUInt(400))],
            DueIn(400),
        ),
        (
            "u32",
            vec![("x-delay", AMQPValue::LongUInt(500))],
            DueIn(500),
        ),
        (
            "i64",
            vec![("x-delay", AMQPValue::LongLongInt(600))],
            DueIn(600),
        ),
        ("digits", vec![("x-delay", ls("1500"))], DueIn(1500)),
        ("plus digits", vec![("x-delay", ls("+1500"))], DueIn(1500)),
        ("negative string", vec![("x-delay", ls("-1500"))], DueIn(0)),
        (
            "float truncates",
            vec![("x-delay", AMQPValue::Double(1500.9))],
            DueIn(1500),
        ),
        (
            "f32 truncates",
            vec![("x-delay", AMQPValue::Float(2.7))],
            DueIn(2),
        ),
        (
            "decimal truncates",
            vec![(
                "x-delay",
                AMQPValue::DecimalValue(DecimalValue {
                    scale: 1,
                    value: 12345,
                }),
            )],
            DueIn(1234),
        ),
        (
            "NaN",
            vec![("x-delay", AMQPValue::Double(f64::NAN))],
            Park(BadDelay),
        ),
        (
            "infinite",
            vec![("x-delay", AMQPValue::Double(f64::INFINITY))],
            Park(BadDelay),
        ),
        (
            "non-numeric string",
            vec![("x-delay", ls("soon"))],
            Park(BadDelay),
        ),
        ("empty string", vec![("x-delay", ls(""))], Park(BadDelay)),
        (
            "spaces in string",
            vec![("x-delay", ls(" 100"))],
            Park(BadDelay),
        ),
        (
            "unit in string",
            vec![("x-delay", ls("5s"))],
            Park(BadDelay),
        ),
        (
            "boolean",
            vec![("x-delay", AMQPValue::Boolean(true))],
            Park(BadDelay),
        ),
        (
            "table",
            vec![("x-delay", AMQPValue::FieldTable(FieldTable::default()))],
            Park(BadDelay),
        ),
        (
            "array",
            vec![(
                "x-delay",
                AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::LongInt(5)])),
            )],
            Park(BadDelay),
        ),
        ("void", vec![("x-delay", AMQPValue::Void)], Park(BadDelay)),
        (
            "exactly the maximum",
            vec![("x-delay", AMQPValue::LongLongInt(year_ms as i64))],
            DueIn(year_ms),
        ),
        (
            "huge",
            vec![("x-delay", AMQPValue::LongLongInt(year_ms as i64 + 1))],
            Park(DelayTooLong),
        ),
        (
            "huge string",
            vec![("x-delay", ls(&"9".repeat(40)))],
            Park(DelayTooLong),
        ),
        (
            "both headers: deliver-at wins",
            vec![
                ("x-delay", AMQPValue::LongInt(100)),
                ("x-deliver-at", AMQPValue::LongLongInt((NOW + 5_000) as i64)),
            ],
            DueIn(5_000),
        ),
        (
            "deliver-at wins over a bad x-delay",
            vec![
                ("x-delay", ls("soon")),
                ("x-deliver-at", AMQPValue::LongLongInt((NOW + 7) as i64)),
            ],
            DueIn(7),
        ),
        (
            "deliver-at in the past",
            vec![(
                "x-deliver-at",
                AMQPValue::LongLongInt((NOW - 60_000) as i64),
            )],
            DueIn(0),
        ),
        (
            "deliver-at beyond the maximum",
            vec![(
                "x-deliver-at",
                AMQPValue::LongLongInt((NOW + year_ms + 1) as i64),
            )],
            Park(DelayTooLong),
        ),
        (
            "deliver-at as digits",
            vec![("x-deliver-at", ls(&(NOW + 250).to_string()))],
            DueIn(250),
        ),
        (
            "deliver-at RFC 3339 with offset",
            vec![("x-deliver-at", ls("2027-01-15T10:00:01.500+02:00"))],
            DueIn(1_500),
        ),
        (
            "deliver-at in seconds",
            vec![("x-deliver-at", AMQPValue::LongLongInt((NOW / 1000) as i64))],
            Park(BadDeliverAt),
        ),
        (
            "deliver-at negative",
            vec![("x-deliver-at", AMQPValue::LongInt(-1))],
            Park(BadDeliverAt),
        ),
        (
            "deliver-at garbage",
            vec![("x-deliver-at", ls("tomorrow"))],
            Park(BadDeliverAt),
        ),
        (
            "deliver-at table",
            vec![("x-deliver-at", AMQPValue::FieldTable(FieldTable::default()))],
            Park(BadDeliverAt),
        ),
    ];
    assert!(cases.len() >= 15);
    for (name, headers, expected) in cases {
        assert_eq!(outcome(headers), expected, "case: {name}");
    }
}

#[test]
fn rfc3339_is_read_with_its_offset() {
    // 2027-01-15T08:00:00Z
    let utc = chrono::DateTime::parse_from_rfc3339("2027-01-15T08:00:00Z")
        .unwrap()
        .timestamp_millis();
    assert_eq!(
        parse_deliver_at(&ls("2027-01-15T10:00:00+02:00")).unwrap(),
        utc
    );
    assert_eq!(
        parse_deliver_at(&ls("2027-01-15T08:00:00.250Z")).unwrap(),
        utc + 250
    );
}

#[test]
fn parked_details_say_what_was_wrong() {
    let err = decode_with("in", &with_headers(vec![("x-delay", ls("soon"))])).unwrap_err();
    assert_eq!(err.reason.as_str(), "bad-delay");
    assert!(err.detail.contains("\"soon\""), "{}", err.detail);
    let err = decode_with("elsewhere", &BasicProperties::default()).unwrap_err();
    assert_eq!(err.reason, ParkReason::UnknownRoute);
    assert!(err.detail.contains("`elsewhere`"), "{}", err.detail);
    let err = decode_with(
        "in",
        &with_headers(vec![("x-delay", AMQPValue::LongLongInt(i64::MAX))]),
    )
    .unwrap_err();
    assert_eq!(err.reason, ParkReason::DelayTooLong);
    assert!(err.detail.contains("366d"), "{}", err.detail);
}

/// A publisher message with every property set and headers of many AMQP types.
fn rich_properties() -> BasicProperties {
    BasicProperties::default()
        .with_content_type("application/json".into())
        .with_content_encoding("gzip".into())
        .with_headers(table(vec![
            ("x-delay", AMQPValue::LongInt(5_000)),
            ("app-string", ls("hello")),
            ("app-i8", AMQPValue::ShortShortInt(-3)),
            ("app-u16", AMQPValue::ShortUInt(65_000)),
            ("app-i32", AMQPValue::LongInt(-70_000)),
            ("app-bool", AMQPValue::Boolean(true)),
            ("app-double", AMQPValue::Double(2.5)),
            ("app-ts", AMQPValue::Timestamp(1_700_000_000)),
            (
                "app-table",
                AMQPValue::FieldTable(table(vec![("inner", AMQPValue::LongLongInt(7))])),
            ),
            (
                "app-array",
                AMQPValue::FieldArray(FieldArray::from(vec![ls("a"), AMQPValue::LongInt(1)])),
            ),
            ("app-bytes", AMQPValue::ByteArray(vec![0u8, 255].into())),
            ("app-void", AMQPValue::Void),
            ("x-death", AMQPValue::FieldArray(FieldArray::default())),
            ("x-first-death-queue", ls("somewhere")),
            ("x-last-death-reason", ls("expired")),
            ("delay-bridge-target", ls("forged")),
        ]))
        .with_delivery_mode(1)
        .with_priority(7)
        .with_correlation_id("corr-1".into())
        .with_reply_to("replies".into())
        .with_expiration("60000".into())
        .with_message_id("m-1".into())
        .with_timestamp(1_700_000_000)
        .with_type("order.created".into())
        .with_user_id("alice".into())
        .with_app_id("shop".into())
        .with_cluster_id("c1".into())
}

/// Takes a hop's properties through a level the way the broker does: dead-lettering drops
/// `expiration` (there is none on a hop) and adds `x-death` and `x-first-death-*`.
fn through_level(hop: &BasicProperties) -> BasicProperties {
    let mut p = Properties::from(hop);
    let mut headers = p.headers.take().unwrap().inner().clone();
    headers.insert(
        "x-death".into(),
        AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::FieldTable(table(vec![
            ("count", AMQPValue::LongLongInt(1)),
            ("reason", ls("expired")),
        ]))])),
    );
    headers.insert("x-first-death-reason".into(), ls("expired"));
    headers.insert("x-last-death-queue".into(), ls("t.level.1s"));
    p.headers = Some(FieldTable::from(headers));
    p.into()
}

fn header<'a>(props: &'a BasicProperties, name: &str) -> Option<&'a AMQPValue> {
    props.headers().as_ref().and_then(|h| h.inner().get(name))
}

#[test]
fn a_message_survives_two_hops_and_is_delivered_as_published() {
    let published = rich_properties();
    let first = decode_with("in", &published).unwrap();
    assert_eq!(first.deliver_at, NOW + 5_000);
    assert_eq!(first.target, "out");
    assert_eq!(first.routing_key.as_str(), "rk.1");

    let hop1 = hop_properties(&first);
    // expiration stashed, user_id moved, persistent while travelling
    assert_eq!(hop1.expiration(), &None);
    assert_eq!(hop1.user_id(), &None);
    assert_eq!(hop1.delivery_mode(), &Some(PERSISTENT));
    assert_eq!(header(&hop1, header::STATE_EXPIRATION), Some(&ls("60000")));
    assert_eq!(header(&hop1, header::STATE_USER_ID), Some(&ls("alice")));
    assert_eq!(
        header(&hop1, header::STATE_HOPS),
        Some(&AMQPValue::LongLongInt(1))
    );
    assert_eq!(header(&hop1, header::STATE_TARGET), Some(&ls("out")));
    assert_eq!(
        header(&hop1, "x-death"),
        None,
        "x-death stripped before a hop"
    );
    assert_eq!(header(&hop1, "x-first-death-queue"), None);
    assert_eq!(header(&hop1, "x-last-death-reason"), None);

    let back1 = through_level(&hop1);
    let second = decode_with(WORK, &back1).unwrap();
    assert_eq!(second.hops, 1);
    assert_eq!(second.deliver_at, first.deliver_at);
    assert_eq!(second.first_seen, NOW);
    let hop2 = hop_properties(&second);
    assert_eq!(
        header(&hop2, header::STATE_HOPS),
        Some(&AMQPValue::LongLongInt(2))
    );
    assert_eq!(
        header(&hop2, "x-death"),
        None,
        "x-death stripped on every re-publish"
    );
    assert_eq!(header(&hop2, "x-last-death-queue"), None);

    let third = decode_with(WORK, &through_level(&hop2)).unwrap();
    let delivered = delivery_properties(&third, "bridge");

    // Every property as published, except user_id (not the bridge's user) …
    let mut expected = Properties::from(&published);
    expected.user_id = None;
    let got = Properties::from(&delivered);
    assert_eq!(got.expiration, Some("60000".into()), "expiration restored");
    assert_eq!(
        got.delivery_mode,
        Some(1),
        "publisher's delivery mode restored"
    );
    let strip_headers = |mut p: Properties| {
        p.headers = None;
        p
    };
    assert_eq!(strip_headers(got.clone()), strip_headers(expected.clone()));

    // … and every publisher header with its AMQP type, x-delay negated, no bridge headers.
    let mut want = expected.headers.unwrap().inner().clone();
    want.retain(|k, _| {
        !k.as_str().starts_with("x-death")
            && !k.as_str().starts_with("x-first-death-")
            && !k.as_str().starts_with("x-last-death-")
            && !k.as_str().starts_with("delay-bridge-")
    });
    want.insert("x-delay".into(), AMQPValue::LongInt(-5_000));
    want.insert(header::ORIGINAL_USER_ID.into(), ls("alice"));
    assert_eq!(got.headers.unwrap().inner(), &want);
}

#[test]
fn user_id_is_restored_when_it_is_the_bridges_own() {
    let props = BasicProperties::default().with_user_id("guest".into());
    let env = decode_with("in", &props).unwrap();
    let delivered = delivery_properties(&env, "guest");
    assert_eq!(delivered.user_id(), &Some("guest".into()));
    assert_eq!(delivered.headers(), &None, "no headers appear from nowhere");
}

#[test]
fn a_message_without_properties_is_delivered_without_any() {
    let env = decode_with("in", &BasicProperties::default()).unwrap();
    let hop = hop_properties(&env);
    assert_eq!(
        header(&hop, header::STATE_DELIVERY_MODE),
        Some(&AMQPValue::LongLongInt(0))
    );
    let back = decode_with(WORK, &through_level(&hop)).unwrap();
    assert_eq!(
        delivery_properties(&back, "guest"),
        BasicProperties::default()
    );
}

#[test]
fn x_delay_is_negated_only_when_it_delayed() {
    for (sent, delivered) in [
        (AMQPValue::LongInt(1500), AMQPValue::LongInt(-1500)),
        (ls("1500"), AMQPValue::LongInt(-1500)),
        (AMQPValue::Double(99.9), AMQPValue::LongInt(-99)),
        (
            AMQPValue::LongLongInt(30 * 86_400_000),
            AMQPValue::LongLongInt(-30 * 86_400_000),
        ),
        (AMQPValue::LongInt(0), AMQPValue::LongInt(0)),
        (AMQPValue::LongInt(-5), AMQPValue::LongInt(-5)),
    ] {
        let env = decode_with("in", &with_headers(vec![("x-delay", sent.clone())])).unwrap();
        let out = delivery_properties(&env, "guest");
        assert_eq!(header(&out, "x-delay"), Some(&delivered), "sent {sent:?}");
    }
}

#[test]
fn bridge_strings_are_long_strings_and_integers_long_long() {
    let env = decode_with(
        "in",
        &BasicProperties::default()
            .with_expiration("100".into())
            .with_user_id("bob".into()),
    )
    .unwrap();
    let hop = hop_properties(&env);
    for (k, v) in hop.headers().as_ref().unwrap() {
        assert!(
            matches!(v, AMQPValue::LongString(_) | AMQPValue::LongLongInt(_)),
            "{k} is {v:?}"
        );
    }
    let parked = parked_properties(
        &hop,
        &Parked::new(ParkReason::Unroutable, "no queue bound"),
        NOW,
    );
    for (k, v) in parked.headers().as_ref().unwrap() {
        assert!(
            !matches!(v, AMQPValue::ShortString(_)),
            "{k} is a short string"
        );
    }
}

#[test]
fn in_flight_state_is_checked() {
    let env = decode_with("in", &BasicProperties::default()).unwrap();
    let hop = hop_properties(&env);
    // a target no route allows
    let mut p = Properties::from(&hop);
    let mut h = p.headers.take().unwrap().inner().clone();
    h.insert(header::STATE_TARGET.into(), ls("admin-exchange"));
    p.headers = Some(FieldTable::from(h.clone()));
    let err = decode_with(WORK, &p.clone().into()).unwrap_err();
    assert_eq!(err.reason, ParkReason::TargetNotAllowed);
    // a missing deliver-at
    h.remove(header::STATE_DELIVER_AT);
    h.insert(header::STATE_TARGET.into(), ls("out"));
    p.headers = Some(FieldTable::from(h.clone()));
    let err = decode_with(WORK, &p.clone().into()).unwrap_err();
    assert_eq!(err.reason, ParkReason::BadState);
    assert!(err.detail.contains(header::STATE_DELIVER_AT));
    // a routing key too long for AMQP
    h.insert(
        header::STATE_DELIVER_AT.into(),
        AMQPValue::LongLongInt(NOW as i64),
    );
    h.insert(header::STATE_ROUTING_KEY.into(), ls(&"k".repeat(256)));
    p.headers = Some(FieldTable::from(h));
    let err = decode_with(WORK, &p.into()).unwrap_err();
    assert_eq!(err.reason, ParkReason::BadState);
    // no headers at all through the work exchange
    let err = decode_with(WORK, &BasicProperties::default()).unwrap_err();
    assert_eq!(err.reason, ParkReason::BadState);
}

#[test]
fn forged_bridge_headers_on_new_messages_are_ignored() {
    let env = decode_with(
        "in",
        &with_headers(vec![
            ("delay-bridge-target", ls("admin-exchange")),
            ("delay-bridge-deliver-at", AMQPValue::LongLongInt(1)),
        ]),
    )
    .unwrap();
    assert_eq!(env.target, "out");
    assert_eq!(env.deliver_at, NOW);
    assert_eq!(env.properties.headers.unwrap().inner().len(), 0);
}

#[test]
fn parked_messages_cannot_expire_and_say_why() {
    let published = rich_properties();
    let parked = parked_properties(
        &published,
        &Parked::new(ParkReason::BadDelay, "x-delay \"soon\" is not a number"),
        NOW,
    );
    assert_eq!(parked.expiration(), &None);
    assert_eq!(
        header(&parked, header::PARKED_AT),
        Some(&AMQPValue::LongLongInt(NOW as i64))
    );
    assert_eq!(parked.user_id(), &None);
    assert_eq!(parked.delivery_mode(), &Some(PERSISTENT));
    assert_eq!(header(&parked, header::REASON), Some(&ls("bad-delay")));
    assert_eq!(
        header(&parked, header::DETAIL),
        Some(&ls("x-delay \"soon\" is not a number"))
    );
    assert_eq!(
        header(&parked, header::STATE_EXPIRATION),
        Some(&ls("60000"))
    );
    assert_eq!(header(&parked, "x-death"), None);
    assert_eq!(header(&parked, "app-string"), Some(&ls("hello")));
    assert_eq!(parked.message_id(), &Some("m-1".into()));
    assert_eq!(parked.priority(), &Some(7));
}

#[test]
fn properties_round_trip_through_plain_data() {
    let p = rich_properties();
    assert_eq!(BasicProperties::from(Properties::from(&p)), p);
}

#[test]
fn a_copy_entered_when_published_or_else_when_first_read() {
    let read_now = decode_with("in", &BasicProperties::default()).unwrap();
    assert_eq!(read_now.entered_at, NOW, "no x-published-at: first read");
    let published = NOW - 7_000;
    for value in [
        AMQPValue::LongLongInt(published as i64),
        ls(&published.to_string()),
    ] {
        let env = decode_with(
            "in",
            &with_headers(vec![(header::PUBLISHED_AT, value.clone())]),
        )
        .unwrap();
        assert_eq!(env.entered_at, published, "{value:?}");
        // carried through a level, and the header itself stays the publisher's
        let back = decode_with(WORK, &through_level(&hop_properties(&env))).unwrap();
        assert_eq!(back.entered_at, published);
        assert_eq!(back.first_seen, NOW);
        let delivered = delivery_properties(&back, "guest");
        assert_eq!(header(&delivered, header::PUBLISHED_AT), Some(&value));
        assert_eq!(header(&delivered, header::STATE_ENTERED_AT), None);
    }
}

#[test]
fn a_published_at_ahead_of_the_bridges_clock_counts_as_now_plus_the_allowance() {
    // A year ahead: no cancel could reach the copy if it were taken as given.
    let ahead = NOW + 366 * 86_400_000;
    let env = decode_with(
        "in",
        &with_headers(vec![(
            header::PUBLISHED_AT,
            AMQPValue::LongLongInt(ahead as i64),
        )]),
    )
    .unwrap();
    assert_eq!(
        env.entered_at,
        NOW + crate::cancel::CLOCK_ALLOWANCE_MS,
        "at most the bridge's now plus the clock allowance"
    );
}

#[test]
fn a_schedules_first_occurrence_beyond_the_maximum_delay_is_refused() {
    // Every minute of June, taken in mid-January: the gaps are a minute, the first is
    // months away.
    let routes = routes();
    let intake = Intake {
        work_exchange: WORK,
        routes: &routes,
        max_delay: Duration::from_secs(30 * 86_400),
        smallest_level: Duration::from_secs(1),
    };
    let props =
        with_headers(vec![("x-repeat-cron", ls("* * * 6 *"))]).with_message_id("june".into());
    let parked = decode(
        Incoming {
            exchange: "in",
            routing_key: &"rk.1".into(),
            properties: &props,
        },
        NOW,
        &intake,
    )
    .unwrap_err();
    assert_eq!(parked.reason, ParkReason::BadSchedule, "{}", parked.detail);
    assert!(parked.detail.contains("maximum delay"), "{}", parked.detail);
}

#[test]
fn a_hop_count_at_its_largest_stays_there() {
    let mut env = decode_with("in", &BasicProperties::default()).unwrap();
    env.hops = u32::MAX;
    let back = decode_with(WORK, &through_level(&hop_properties(&env))).unwrap();
    assert_eq!(back.hops, u32::MAX);
}

#[test]
fn a_bad_published_at_is_parked_with_a_reason() {
    for (value, words) in [
        (ls("yesterday"), "epoch milliseconds"),
        (AMQPValue::LongLongInt(1_700_000_000), "seconds instead"),
        (AMQPValue::Boolean(true), "a boolean"),
    ] {
        let err =
            decode_with("in", &with_headers(vec![(header::PUBLISHED_AT, value)])).unwrap_err();
        assert_eq!(err.reason, ParkReason::BadPublishedAt);
        assert!(err.detail.contains(words), "{}", err.detail);
    }
}

#[test]
fn in_flight_copies_from_before_entered_at_existed_use_first_seen() {
    let env = decode_with("in", &BasicProperties::default()).unwrap();
    let mut p = Properties::from(&hop_properties(&env));
    let mut h = p.headers.take().unwrap().inner().clone();
    h.remove(header::STATE_ENTERED_AT);
    h.insert(
        header::STATE_FIRST_SEEN.into(),
        AMQPValue::LongLongInt(NOW as i64 - 5),
    );
    p.headers = Some(FieldTable::from(h));
    let back = decode_with(WORK, &p.into()).unwrap();
    assert_eq!(back.entered_at, NOW - 5);
}

#[test]
fn redelivered_too_often_is_parked_with_the_count() {
    assert_eq!(redelivered_too_often(&BasicProperties::default(), 40), None);
    let props = |n: i64| with_headers(vec![(header::DELIVERY_COUNT, AMQPValue::LongLongInt(n))]);
    assert_eq!(redelivered_too_often(&props(39), 40), None);
    let parked = redelivered_too_often(&props(40), 40).unwrap();
    assert_eq!(parked.reason, ParkReason::RedeliveryLimit);
    assert!(parked.detail.contains("40 times"), "{}", parked.detail);
}

#[test]
fn consumed_properties_rebuild_what_a_level_message_was_read_with() {
    let first = decode_with("in", &rich_properties()).unwrap();
    let hop = hop_properties(&first);
    let consumed = through_level(&hop);
    let read = decode_with(WORK, &consumed).unwrap();
    assert_eq!(
        consumed_properties(&read),
        hop,
        "the consumed copy minus x-death"
    );
    let parked = Parked::new(ParkReason::Unroutable, "no queue bound");
    assert_eq!(
        parked_properties(&consumed_properties(&read), &parked, NOW),
        parked_properties(&consumed, &parked, NOW),
        "parking from the envelope parks the same message"
    );
}

#[test]
fn cc_and_bcc_are_set_aside_on_hops_and_restored_on_delivery() {
    let cc = AMQPValue::FieldArray(FieldArray::from(vec![ls("victim")]));
    let bcc = AMQPValue::FieldArray(FieldArray::from(vec![ls("hidden")]));
    let published = with_headers(vec![
        ("x-delay", AMQPValue::LongInt(5_000)),
        ("CC", cc.clone()),
        ("BCC", bcc.clone()),
        ("app", ls("kept")),
    ]);
    let first = decode_with("in", &published).unwrap();
    let hop = hop_properties(&first);
    assert_eq!(header(&hop, "CC"), None, "a hop routes only to its level");
    assert_eq!(header(&hop, "BCC"), None);
    assert_eq!(header(&hop, "delay-bridge-cc"), Some(&cc));
    let again = decode_with(WORK, &through_level(&hop)).unwrap();
    let second_hop = hop_properties(&again);
    assert_eq!(header(&second_hop, "CC"), None);
    let delivered = delivery_properties(&again, "bridge");
    assert_eq!(header(&delivered, "CC"), Some(&cc));
    assert_eq!(header(&delivered, "BCC"), Some(&bcc));
    assert_eq!(header(&delivered, "app"), Some(&ls("kept")));
    assert_eq!(header(&delivered, "delay-bridge-cc"), None);
    // Parked copies cannot route by CC either.
    let parked = parked_properties(&published, &Parked::new(ParkReason::BadState, "test"), NOW);
    assert_eq!(header(&parked, "CC"), None);
    assert_eq!(header(&parked, "delay-bridge-cc"), Some(&cc));
}

#[test]
fn a_copy_that_hopped_with_cc_before_the_stash_existed_keeps_it_for_delivery() {
    let cc = AMQPValue::FieldArray(FieldArray::from(vec![ls("extra.key")]));
    let first = decode_with(
        "in",
        &with_headers(vec![("x-delay", AMQPValue::LongInt(5_000))]),
    )
    .unwrap();
    // An older bridge carried CC on the hop itself.
    let mut old = Properties::from(&hop_properties(&first));
    let mut headers = old.headers.take().unwrap().inner().clone();
    headers.insert("CC".into(), cc.clone());
    old.headers = Some(FieldTable::from(headers));
    let again = decode_with(WORK, &through_level(&old.into())).unwrap();
    assert_eq!(header(&hop_properties(&again), "CC"), None);
    assert_eq!(
        header(&delivery_properties(&again, "bridge"), "CC"),
        Some(&cc)
    );
}

#[test]
fn a_parked_copy_without_publisher_headers_keeps_the_bridges_and_says_so() {
    let consumed = with_headers(vec![("app", ls("big")), ("delay-bridge-target", ls("out"))])
        .with_message_id("m".into());
    let parked = Parked::new(ParkReason::TooLarge, "over the frame");
    let props = parked_properties_without_headers(&consumed, &parked, NOW);
    assert_eq!(header(&props, "app"), None);
    assert_eq!(header(&props, "delay-bridge-target"), Some(&ls("out")));
    assert_eq!(
        header(&props, "delay-bridge-reason"),
        Some(&ls("too-large"))
    );
    let AMQPValue::LongString(detail) = header(&props, "delay-bridge-detail").unwrap() else {
        panic!("a long string");
    };
    let detail = String::from_utf8_lossy(detail.as_bytes()).into_owned();
    assert!(
        detail.starts_with("over the frame; the publisher's headers were dropped"),
        "{detail}"
    );
    assert_eq!(props.message_id().as_ref().map(|m| m.as_str()), Some("m"));
}

mod arbitrary_tables {
    //! Decoding over arbitrary header tables: every AMQP field type, nested, with the
    //! contract's own names as keys. Whatever a publisher sends, the outcome is a due time
    //! within the limits or a reason to park, never a panic; the bridge's state survives a
    //! hop exactly; nothing of the publisher's is taken for the bridge's own.

    use super::*;
    use proptest::collection::vec;
    use proptest::prelude::*;

    /// Keys the contract reads, keys that look like its own, and any other.
    fn key() -> impl Strategy<Value = String> {
        prop_oneof![
            prop::sample::select(header::ALL.to_vec()).prop_map(str::to_string),
            "[a-zA-Z0-9_.-]{0,12}",
        ]
    }

    /// Numbers as text, the odd spellings a publisher in another language sends.
    fn number_text() -> impl Strategy<Value = String> {
        prop_oneof![
            any::<i64>().prop_map(|n| n.to_string()),
            any::<f64>().prop_map(|n| n.to_string()),
            (0u64..100_000).prop_map(|n| format!(" {n} ")),
            Just("2026-12-24T08:00:00Z".to_string()),
            Just(String::new()),
            ".{0,20}",
        ]
    }

    fn leaf() -> impl Strategy<Value = AMQPValue> {
        prop_oneof![
            any::<bool>().prop_map(AMQPValue::Boolean),
            any::<i8>().prop_map(AMQPValue::ShortShortInt),
            any::<u8>().prop_map(AMQPValue::ShortShortUInt),
            any::<i16>().prop_map(AMQPValue::ShortInt),
            any::<u16>().prop_map(AMQPValue::ShortUInt),
            any::<i32>().prop_map(AMQPValue::LongInt),
            any::<u32>().prop_map(AMQPValue::LongUInt),
            any::<i64>().prop_map(AMQPValue::LongLongInt),
            (-5_000i64..5_000).prop_map(AMQPValue::LongLongInt),
            any::<f32>().prop_map(AMQPValue::Float),
            any::<f64>().prop_map(AMQPValue::Double),
            (any::<u8>(), any::<u32>())
                .prop_map(|(scale, value)| AMQPValue::DecimalValue(DecimalValue { scale, value })),
            number_text()
                .prop_filter("a short string holds 255 bytes", |s| s.len() <= 255)
                .prop_map(|s| AMQPValue::ShortString(s.as_str().into())),
            number_text().prop_map(|s| AMQPValue::LongString(s.as_str().into())),
            ".{0,300}".prop_map(|s| AMQPValue::LongString(s.as_str().into())),
            any::<u64>().prop_map(AMQPValue::Timestamp),
            vec(any::<u8>(), 0..64).prop_map(|b| AMQPValue::ByteArray(b.into())),
            Just(AMQPValue::Void),
        ]
    }

    fn value() -> impl Strategy<Value = AMQPValue> {
        leaf().prop_recursive(4, 48, 6, |inner| {
            prop_oneof![
                vec(inner.clone(), 0..6).prop_map(|v| AMQPValue::FieldArray(v.into())),
                vec((key(), inner), 0..6).prop_map(|entries| AMQPValue::FieldTable(of(entries))),
            ]
        })
    }

    fn of(entries: Vec<(String, AMQPValue)>) -> FieldTable {
        let mut t = FieldTable::default();
        for (k, v) in entries {
            t.insert(k.as_str().into(), v);
        }
        t
    }

    fn headers() -> impl Strategy<Value = FieldTable> {
        vec((key(), value()), 0..10).prop_map(of)
    }

    /// A header name the bridge keeps for itself on the way through levels.
    fn is_bridge_state(name: &str) -> bool {
        name.starts_with(header::BRIDGE_PREFIX)
            || header::DEATH_PREFIXES.iter().any(|p| name.starts_with(p))
            || name == header::CC
            || name == header::BCC
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2_000))]

        #[test]
        fn any_table_is_due_within_the_limits_or_parked_with_a_reason(
            table in headers(),
            expiration in proptest::option::of("[0-9]{1,6}"),
        ) {
            let mut props = BasicProperties::default().with_headers(table.clone());
            if let Some(e) = expiration {
                props = props.with_expiration(e.as_str().into());
            }
            match decode_with("in", &props) {
                Ok(env) => {
                    let year_ms: u64 = 366 * 86_400_000;
                    prop_assert!(env.deliver_at >= NOW && env.deliver_at <= NOW + year_ms);
                    let kept = env.properties.headers.clone().unwrap_or_default();
                    for name in kept.inner().keys() {
                        prop_assert!(!is_bridge_state(name.as_str()), "{} kept", name.as_str());
                    }
                    // One hop and back: the same envelope, one hop further.
                    let back = decode_with(WORK, &through_level(&hop_properties(&env)));
                    let hopped = Envelope { hops: env.hops + 1, ..env.clone() };
                    prop_assert_eq!(back.as_ref(), Ok(&hopped));
                    // Delivered: CC and BCC restored as the publisher sent them.
                    let delivered = delivery_properties(&env, "guest");
                    for name in [header::CC, header::BCC] {
                        prop_assert_eq!(header(&delivered, name), table.inner().get(name));
                    }
                }
                Err(parked) => prop_assert!(!parked.detail.is_empty()),
            }
        }

        /// A bundle member's properties written straight from the envelope are the bytes
        /// encoding the built properties gives, whatever the publisher's headers (the
        /// bridge's own names among them), properties and state.
        #[test]
        fn a_member_written_from_the_envelope_is_the_encoded_properties(
            table in proptest::option::of(headers()),
            cc in proptest::option::of(value()),
            occurrence in proptest::option::of(any::<u64>()),
            hops in any::<u32>(),
            short in proptest::option::of("[ -~]{0,255}"),
            other in proptest::option::of("\\PC{0,60}"),
            present in any::<u16>(),
            priority in proptest::option::of(any::<u8>()),
            timestamp in proptest::option::of(any::<u64>()),
            user in proptest::option::of("[a-z]{1,12}"),
            target in "\\PC{0,40}",
        ) {
            let mut env = decode_with("in", &with_headers(vec![("x-delay", AMQPValue::LongInt(5_000))]))
                .expect("decodes");
            env.properties.headers = table;
            env.properties.content_type = short.as_deref().map(Into::into);
            env.properties.message_id = short.as_deref().filter(|_| priority.is_some()).map(Into::into);
            env.properties.cluster_id = user.as_deref().map(Into::into);
            // Each other field present or not by one bit of `present`.
            // Each a text of its own, so that two fields swapped would show.
            let field = |bit: u16| {
                other
                    .as_deref()
                    .filter(|_| present & (1 << bit) != 0)
                    .map(|s| format!("{bit}:{s}").as_str().into())
            };
            env.properties.content_encoding = field(0);
            env.properties.correlation_id = field(1);
            env.properties.reply_to = field(2);
            env.properties.expiration = field(3);
            env.properties.kind = field(4);
            env.properties.user_id = field(5);
            env.properties.app_id = field(6);
            env.properties.delivery_mode = priority.filter(|_| present & (1 << 7) != 0);
            env.stash.expiration = field(8);
            env.routing_key = field(9).unwrap_or_else(|| "rk".into());
            env.target = target;
            env.properties.priority = priority;
            env.properties.timestamp = timestamp;
            env.stash.cc = cc.clone();
            env.stash.bcc = cc;
            env.stash.user_id = user.as_deref().map(Into::into);
            env.stash.delivery_mode = priority.map(|p| p % 3);
            env.occurrence = occurrence;
            env.born = timestamp.unwrap_or(7);
            env.hops = hops;
            let body = b"body";
            prop_assert_eq!(
                bundle::encode_hop_member(&env, body),
                bundle::encode_member(&hop_properties(&env), body)
            );
            prop_assert_eq!(
                bundle::encode_consumed_member(&env, body),
                bundle::encode_member(&consumed_properties(&env), body)
            );
        }

        #[test]
        fn any_table_from_the_work_exchange_decodes_or_parks(table in headers()) {
            let props = BasicProperties::default().with_headers(table);
            if let Err(parked) = decode_with(WORK, &props) {
                prop_assert!(!parked.detail.is_empty());
            }
        }
    }
}

#[test]
fn the_amqp_1_0_delivery_annotations_sent_as_headers_set_the_due_time() {
    use Outcome::*;
    use ParkReason::*;
    let at = |ms: u64| AMQPValue::LongLongInt((NOW + ms) as i64);
    let cases: Vec<(&str, Headers, Outcome)> = vec![
        (
            "x-opt-delivery-time alone",
            vec![("x-opt-delivery-time", at(4_000))],
            DueIn(4_000),
        ),
        (
            "x-opt-delivery-time as a 0-9-1 timestamp (seconds)",
            vec![(
                "x-opt-delivery-time",
                AMQPValue::Timestamp((NOW + 9_000) / 1000),
            )],
            DueIn(9_000),
        ),
        (
            "x-opt-delivery-time in seconds as an integer",
            vec![(
                "x-opt-delivery-time",
                AMQPValue::LongLongInt((NOW / 1000) as i64),
            )],
            Park(BadDeliverAt),
        ),
        (
            "x-opt-delivery-delay alone",
            vec![("x-opt-delivery-delay", AMQPValue::LongInt(1_500))],
            DueIn(1_500),
        ),
        (
            "x-opt-delivery-delay bad",
            vec![("x-opt-delivery-delay", ls("later"))],
            Park(BadDelay),
        ),
        (
            "x-deliver-at wins over x-opt-delivery-time",
            vec![
                ("x-opt-delivery-time", at(9_000)),
                ("x-deliver-at", at(2_000)),
            ],
            DueIn(2_000),
        ),
        (
            "x-opt-delivery-time wins over x-delay",
            vec![
                ("x-delay", AMQPValue::LongInt(100)),
                ("x-opt-delivery-time", at(3_000)),
            ],
            DueIn(3_000),
        ),
        (
            "x-delay wins over x-opt-delivery-delay",
            vec![
                ("x-opt-delivery-delay", AMQPValue::LongInt(8_000)),
                ("x-delay", AMQPValue::LongInt(200)),
            ],
            DueIn(200),
        ),
        (
            "a bad deciding header parks even with a good later one",
            vec![
                ("x-opt-delivery-time", ls("noon")),
                ("x-delay", AMQPValue::LongInt(200)),
            ],
            Park(BadDeliverAt),
        ),
        (
            "x-opt-delivery-delay beyond the maximum",
            vec![(
                "x-opt-delivery-delay",
                AMQPValue::LongLongInt(400 * 86_400_000),
            )],
            Park(DelayTooLong),
        ),
    ];
    for (name, headers, expected) in cases {
        assert_eq!(outcome(headers), expected, "case: {name}");
    }
    let err = decode_with(
        "in",
        &with_headers(vec![("x-opt-delivery-delay", ls("later"))]),
    )
    .unwrap_err();
    assert!(
        err.detail.starts_with("x-opt-delivery-delay "),
        "{}",
        err.detail
    );
}
