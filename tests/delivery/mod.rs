//! Delivery as the plugin's users expect it: order, timing, byte-identical properties and
//! headers through many hops, and bad input parked with its reason.

use std::time::Duration;

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldArray, FieldTable};

use crate::support::*;

const SEC: Duration = Duration::from_secs(1);

/// The plugin's own test: delays [500, 100, 300, 200, 100, 400] ms arrive sorted by delay.
async fn arrive_sorted(test: &str, as_string: bool) {
    let mut w = World::start(Setup::new(test)).await;
    let delays = [500i64, 100, 300, 200, 100, 400];
    for (i, d) in delays.iter().enumerate() {
        let value = if as_string {
            text(&d.to_string())
        } else {
            AMQPValue::LongInt(*d as i32)
        };
        let props = BasicProperties::default()
            .with_message_id(format!("m{i}").into())
            .with_headers(headers(vec![("x-delay", value)]));
        w.publish("rk.sorted", d.to_string().as_bytes(), props)
            .await;
    }
    let got = w.recv_n(delays.len(), 10 * SEC).await;
    let arrived: Vec<i64> = got
        .iter()
        .map(|m| String::from_utf8_lossy(&m.body).parse().unwrap())
        .collect();
    let mut sorted = delays.to_vec();
    sorted.sort();
    assert_eq!(arrived, sorted, "arrival order");
    w.cleanup().await;
}

#[tokio::test]
async fn plugin_case_delays_arrive_sorted() {
    arrive_sorted("sorted", false).await;
}

#[tokio::test]
async fn plugin_case_string_delays_arrive_sorted() {
    arrive_sorted("sorted-str", true).await;
}

#[tokio::test]
async fn no_header_and_zero_delay_arrive_at_once() {
    let mut w = World::start(Setup::new("at-once")).await;
    let t0 = w
        .publish("rk.now", b"none", BasicProperties::default())
        .await;
    let a = w.recv_within(5 * SEC).await;
    let t1 = w.publish("rk.now", b"zero", with_delay(0)).await;
    let b = w.recv_within(5 * SEC).await;
    assert_eq!(
        (a.body.as_slice(), b.body.as_slice()),
        (&b"none"[..], &b"zero"[..])
    );
    for (sent, got) in [(t0, &a), (t1, &b)] {
        assert!(
            got.at_ms - sent < 500,
            "arrived after {} ms",
            got.at_ms - sent
        );
    }
    assert_eq!(w.stats().snapshot().hops, 0);
    w.cleanup().await;
}

#[tokio::test]
async fn a_long_delay_does_not_hold_back_a_short_one() {
    let mut w = World::start(Setup {
        ladder: "1s 2s 4s 8s",
        margin: Duration::from_millis(50),
        ..Setup::new("no-block")
    })
    .await;
    w.publish("rk.x", b"10s", with_delay(10_000)).await;
    let sent = w.publish("rk.x", b"1s", with_delay(1_000)).await;
    let first = w.recv_within(5 * SEC).await;
    assert_eq!(first.body, b"1s");
    let late = first.at_ms as i64 - (sent as i64 + 1_000);
    assert!((0..300).contains(&late), "1s message lateness {late} ms");
    let second = w.recv_within(12 * SEC).await;
    assert_eq!(second.body, b"10s");
    w.cleanup().await;
}

/// Every header type a publisher may use, for byte-for-byte comparison.
fn rich_headers(delay_ms: i64) -> FieldTable {
    let mut nested = FieldTable::default();
    nested.insert("inner".into(), AMQPValue::LongLongInt(7));
    headers(vec![
        ("x-delay", AMQPValue::LongLongInt(delay_ms)),
        ("app-string", text("héllo")),
        ("app-i8", AMQPValue::ShortShortInt(-3)),
        ("app-i16", AMQPValue::ShortInt(-300)),
        ("app-i32", AMQPValue::LongInt(-70_000)),
        ("app-i64", AMQPValue::LongLongInt(1 << 40)),
        ("app-bool", AMQPValue::Boolean(true)),
        ("app-double", AMQPValue::Double(2.5)),
        ("app-float", AMQPValue::Float(1.25)),
        ("app-ts", AMQPValue::Timestamp(1_700_000_000)),
        ("app-table", AMQPValue::FieldTable(nested)),
        (
            "app-array",
            AMQPValue::FieldArray(FieldArray::from(vec![text("a"), AMQPValue::LongInt(1)])),
        ),
        ("app-bytes", AMQPValue::ByteArray(vec![0u8, 1, 255].into())),
        ("app-void", AMQPValue::Void),
    ])
}

#[tokio::test]
async fn multi_hop_delivery_is_on_time_and_byte_identical() {
    // Levels 100/300 ms, margin 20 ms: 1000 ms = 300+300+300 (the same level three times)
    // + hold; 1450 ms = 300×4 + 100 + hold.
    let mut w = World::start(Setup {
        ladder: "100ms 300ms",
        margin: Duration::from_millis(20),
        // Its verdict is a lateness within 100 ms: 197 ms with three tests beside it.
        alone: true,
        ..Setup::new("multi-hop")
    })
    .await;
    let mut sent = Vec::new();
    for (i, delay) in [1_000i64, 1_450, 2_000].iter().enumerate() {
        let props = BasicProperties::default()
            .with_content_type("application/json".into())
            .with_content_encoding("identity".into())
            .with_headers(rich_headers(*delay))
            .with_delivery_mode(2)
            .with_priority(3)
            .with_correlation_id(format!("corr-{i}").into())
            .with_reply_to("replies".into())
            .with_message_id(format!("multi-{i}").into())
            .with_timestamp(1_700_000_000)
            .with_type("test.kind".into())
            .with_app_id("tests".into());
        let body = format!("{{\"n\":{i},\"bytes\":\"\\u0000\"}}").into_bytes();
        let rk = format!("rk.multi.{i}");
        let at = w.publish(&rk, &body, props.clone()).await;
        sent.push((at, *delay, rk, body, props));
    }
    let got = w.recv_n(3, 10 * SEC).await;
    let mut lateness = Vec::new();
    for (m, (at, delay, rk, body, props)) in got.iter().zip(&sent) {
        assert_eq!(&m.routing_key, rk);
        assert_eq!(&m.exchange, &w.target);
        assert_eq!(&m.body, body);
        let late = m.at_ms as i64 - (*at as i64 + delay);
        lateness.push(late);
        // Properties exactly as published, but x-delay negated as the plugin does.
        let mut want = delay_bridge::contract::Properties::from(props);
        let mut h = want.headers.take().unwrap().inner().clone();
        h.insert("x-delay".into(), AMQPValue::LongInt(-(*delay as i32)));
        want.headers = Some(FieldTable::from(h));
        let have = delay_bridge::contract::Properties::from(&m.properties);
        assert_eq!(have, want, "properties of {rk}");
        for (k, _) in m.properties.headers().as_ref().unwrap() {
            assert!(!k.as_str().starts_with("x-death"), "{k} leaked");
            assert!(!k.as_str().starts_with("x-first-death"), "{k} leaked");
            assert!(!k.as_str().starts_with("delay-bridge-"), "{k} leaked");
        }
    }
    println!("multi-hop lateness (ms): {lateness:?}");
    for late in &lateness {
        assert!(
            (0..=100).contains(late),
            "lateness {late} ms out of [0, 100]"
        );
    }
    // 3 + 5 + 6 hops at least were made (1000: 3, 1450: 5, 2000: 6)
    assert!(
        w.stats().snapshot().hops >= 14,
        "hops {}",
        w.stats().snapshot().hops
    );
    w.cleanup().await;
}

#[tokio::test]
async fn expiration_does_not_cut_the_delay_and_user_id_does_not_break_the_hop() {
    let mut w = World::start(Setup {
        ladder: "500ms 1s",
        margin: Duration::from_millis(50),
        ..Setup::new("expiration")
    })
    .await;
    let props = with_delay(2_000)
        .with_expiration("60000".into())
        .with_user_id("guest".into());
    let sent = w.publish("rk.exp", b"e", props).await;
    let m = w.recv_within(6 * SEC).await;
    let late = m.at_ms as i64 - (sent as i64 + 2_000);
    assert!((0..300).contains(&late), "lateness {late} ms");
    assert_eq!(m.properties.expiration(), &Some("60000".into()));
    assert_eq!(m.properties.user_id(), &Some("guest".into()));
    assert!(w.stats().snapshot().hops >= 1);
    w.cleanup().await;
}

#[tokio::test]
async fn bad_inputs_are_parked_with_their_reason() {
    let mut w = World::start(Setup::new("bad-input")).await;
    let cases = [
        (headers(vec![("x-delay", text("soon"))]), "bad-delay"),
        (
            headers(vec![("x-delay", AMQPValue::Boolean(true))]),
            "bad-delay",
        ),
        (
            headers(vec![("x-delay", AMQPValue::LongLongInt(400 * 86_400_000))]),
            "delay-too-long",
        ),
        (
            headers(vec![("x-deliver-at", text("tomorrow"))]),
            "bad-deliver-at",
        ),
    ];
    for (i, (h, _)) in cases.iter().enumerate() {
        let props = BasicProperties::default()
            .with_headers(h.clone())
            .with_message_id(format!("bad-{i}").into())
            .with_expiration("1000".into());
        w.publish(
            &format!("rk.bad.{i}"),
            format!("body-{i}").as_bytes(),
            props,
        )
        .await;
    }
    let mut parked = Vec::new();
    for _ in 0..cases.len() {
        parked.push(w.parked_within(5 * SEC).await);
    }
    parked.sort_by_key(|m| m.properties.message_id().clone().unwrap().to_string());
    for (i, (m, (_, reason))) in parked.iter().zip(&cases).enumerate() {
        assert_eq!(
            m.header("delay-bridge-reason"),
            Some(&text(reason)),
            "case {i}"
        );
        assert!(m.header("delay-bridge-detail").is_some());
        assert_eq!(m.body, format!("body-{i}").into_bytes(), "body kept");
        assert_eq!(m.routing_key, format!("rk.bad.{i}"), "routing key kept");
        assert_eq!(
            m.properties.expiration(),
            &None,
            "a parked message never expires"
        );
        assert_eq!(m.header("delay-bridge-expiration"), Some(&text("1000")));
    }
    w.assert_quiet(Duration::from_millis(300)).await;
    w.cleanup().await;
}

#[tokio::test]
async fn unroutable_and_missing_targets_are_parked_and_the_next_message_is_delivered() {
    let prefix_missing = format!("missing-{:08x}", rand::random::<u32>());
    let mut w = World::start(Setup {
        extra_routes: vec![(
            format!("{prefix_missing}.in"),
            format!("{prefix_missing}.nowhere"),
        )],
        ..Setup::new("unroutable")
    })
    .await;
    // The extra ingress is part of the bridge topology; its target exchange does not exist.
    let missing_ingress = format!("{prefix_missing}.in");

    // 1. unroutable: the target exists but nothing is bound for this routing key
    w.publish("unbound.key", b"u", with_delay(200)).await;
    let p = w.parked_within(5 * SEC).await;
    assert_eq!(p.header("delay-bridge-reason"), Some(&text("unroutable")));
    assert_eq!(p.routing_key, "unbound.key");

    // 2. missing target: twice, to show the replaced channel works again
    for body in [b"m1", b"m2"] {
        publish_to(
            &w.publisher,
            &missing_ingress,
            "rk.m",
            body,
            with_delay(150),
        )
        .await;
        let p = w.parked_within(5 * SEC).await;
        assert_eq!(
            p.header("delay-bridge-reason"),
            Some(&text("target-missing"))
        );
        assert_eq!(p.body, body);
    }

    // 3. the bridge still delivers normally
    w.publish("rk.after", b"ok", with_delay(150)).await;
    let m = w.recv_within(5 * SEC).await;
    assert_eq!(m.body, b"ok");
    assert_eq!(w.stats().snapshot().reconnects, 0, "no session was lost");
    w.cleanup().await;
}

#[tokio::test]
async fn a_conflicting_existing_queue_fails_startup_naming_queue_argument_and_values() {
    let mut w = World::without_bridge("mismatch").await;
    // Redeclare one level with another TTL under a different config.
    let mut config = w.config.clone();
    config.ladder =
        delay_bridge::ladder::Ladder::parse("100ms 250ms 400ms 800ms").expect("a ladder");
    // Pre-create the 250ms queue with the wrong TTL.
    let wrong = config.names.level_queue(Duration::from_millis(250));
    w.adopt_queue(&wrong);
    let ch = w.conn.create_channel().await.unwrap();
    let mut args = FieldTable::default();
    args.insert("x-message-ttl".into(), AMQPValue::LongLongInt(999));
    ch.queue_declare(
        wrong.as_str().into(),
        lapin::options::QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        args,
    )
    .await
    .unwrap();
    let err = tokio::time::timeout(
        20 * SEC,
        delay_bridge::bridge::Bridge::new(config.clone())
            .run(tokio_util::sync::CancellationToken::new()),
    )
    .await
    .expect("start-up fails fast")
    .unwrap_err();
    let message = err.to_string();
    assert!(err.is_permanent());
    for part in [
        config.names.level_queue(Duration::from_millis(250)),
        "x-message-ttl".to_string(),
        "999".to_string(),
        "250".to_string(),
    ] {
        assert!(message.contains(&part), "`{part}` missing from: {message}");
    }
    w.cleanup().await;
}

/// A publisher's own `x-delivery-count` header (an application that copied the headers of
/// a message it consumed from a quorum queue) is not a redelivery count: the message is
/// delivered, not parked `redelivery-limit`.
#[tokio::test]
async fn a_publishers_x_delivery_count_is_not_taken_for_redeliveries() {
    let mut w = World::start(Setup::new("delivery-count")).await;
    let props = BasicProperties::default().with_headers(headers(vec![
        ("x-delay", AMQPValue::LongLongInt(300)),
        ("x-delivery-count", AMQPValue::LongLongInt(1_000)),
    ]));
    w.publish("rk.count", b"copied-headers", props).await;
    let m = w.recv_within(Duration::from_secs(10)).await;
    assert_eq!(m.body, b"copied-headers");
    assert_eq!(w.stats().snapshot().parked, 0, "nothing parked");
    w.cleanup().await;
}

/// The product's defaults: the default ladder with the fine levels of a 100-ms hop window,
/// bundled hops. 400 messages with delays from 0.3 s to 3.3 s each arrive once, never early,
/// half of them within 50 ms of their due time and every one within 1 s, and their hops
/// travel in bundles (two or more hops per bundle on average: how many share a window
/// depends on how fast the suite lets the test publish: 4.9 was seen in CI on 4.0.5, where
/// this asked for 5). The median is what tells a bundle held past its due time; the bound on
/// every message only catches one left behind: while other tests (all but the heavy ones)
/// ran beside it on two cores, single messages were seen 133-155 ms late and, once in CI on
/// 4.0.5, 347 ms (alone the worst is 7-23 ms). It now runs alone.
#[tokio::test]
async fn the_default_configuration_bundles_and_delivers_on_time() {
    const N: usize = 400;
    let mut w = World::start(Setup {
        ladder: "default",
        margin: delay_bridge::config::defaults::MARGIN,
        hop_window: None,
        alone: true,
        ..Setup::new("defaults")
    })
    .await;
    assert!(w.config.bundle_hops, "bundles are on by default");
    assert_eq!(
        w.config.ladder.smallest(),
        Duration::from_millis(100),
        "with the hop window's fine levels"
    );
    let stats = w.stats();
    let start = delay_bridge::clock::now_ms();
    let due = |i: usize| start + 300 + (i as u64 * 7_919) % 3_000;
    for i in 0..N {
        let props = lapin::BasicProperties::default()
            .with_message_id(i.to_string().into())
            .with_headers(headers(vec![(
                "x-deliver-at",
                lapin::types::AMQPValue::LongLongInt(due(i) as i64),
            )]));
        w.publish("rk.defaults", i.to_string().as_bytes(), props)
            .await;
    }
    let got = w.recv_n(N, 30 * SEC).await;
    let mut seen = std::collections::HashSet::new();
    let mut lateness = Vec::with_capacity(N);
    for m in &got {
        let i: usize = String::from_utf8_lossy(&m.body).parse().unwrap();
        assert!(seen.insert(i), "message {i} twice");
        let late = m.at_ms as i64 - due(i) as i64;
        assert!((0..1_000).contains(&late), "message {i}: {late} ms late");
        lateness.push(late);
    }
    lateness.sort_unstable();
    let median = lateness[N / 2];
    assert!(median < 50, "median lateness {median} ms");
    let counts = stats.snapshot();
    assert!(
        counts.bundles >= 1 && counts.bundles * 2 <= counts.hops,
        "hops travelled in bundles: {counts:?}"
    );
    assert_eq!(counts.bundling, 1);
    w.assert_quiet(Duration::from_millis(500)).await;
    w.cleanup().await;
}

/// A route whose ingress is a `headers` exchange (`ingress_type = "headers"`, as the
/// README's move off the delayed-message plugin declares it): every message published to
/// it reaches the bridge and is delivered once when due, and a binding on the ingress that
/// asks for a header (the move's binding to the target, for what the plugin still holds)
/// takes none of them.
#[tokio::test]
async fn a_headers_ingress_takes_every_message_and_a_header_binding_none() {
    let mut w = World::without_bridge("headers-ingress").await;
    let ingress = format!("{}.h-in", w.prefix());
    let target = format!("{}.h-out", w.prefix());
    let queue = format!("{target}.q");
    w.declare_extra_exchange(&target, lapin::ExchangeKind::Direct)
        .await;
    w.declare_bound_queue(&queue, &target, "orders.close").await;
    w.add_route(delay_bridge::config::Route {
        ingress_kind: delay_bridge::config::IngressKind::Headers,
        ..delay_bridge::config::Route::new(ingress.clone(), target.clone())
    })
    .await
    .unwrap();
    let channel = w.sandbox.channel().await.unwrap();
    let mut drain_only = FieldTable::default();
    drain_only.insert("x-match".into(), text("all"));
    drain_only.insert("delay-bridge-plugin-drain".into(), text("yes"));
    channel
        .exchange_bind(
            target.as_str().into(),
            ingress.as_str().into(),
            "orders.close".into(),
            lapin::options::ExchangeBindOptions::default(),
            drain_only,
        )
        .await
        .unwrap();
    w.start_bridge().await;
    let sent = publish_to(
        &w.publisher,
        &ingress,
        "orders.close",
        b"close",
        with_delay(800),
    )
    .await;
    let deadline = std::time::Instant::now() + 10 * SEC;
    while w.queue_depth(&queue).await < 1 {
        assert!(
            std::time::Instant::now() < deadline,
            "nothing delivered within 10 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let arrived = delay_bridge::clock::now_ms();
    assert!(
        arrived >= sent + 800,
        "delivered when due, not at once through the header binding: after {} ms",
        arrived - sent
    );
    let got = channel
        .basic_get(
            queue.as_str().into(),
            lapin::options::BasicGetOptions::default(),
        )
        .await
        .unwrap()
        .expect("the delivered message");
    assert_eq!(got.delivery.data, b"close");
    // Once: nothing else comes.
    w.assert_quiet(Duration::from_millis(500)).await;
    assert_eq!(w.queue_depth(&queue).await, 0, "delivered once");
    w.cleanup().await;
}
