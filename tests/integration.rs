//! End-to-end tests against the real broker. Each test has its own prefixed topology and
//! deletes it; waits are on events with deadlines.

mod bench;
mod cancel;
mod support;
mod versions;

use std::time::Duration;

use delay_bridge::bridge::Stats;
use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldArray, FieldTable};
use support::*;

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
    assert_eq!(w.stats().hops.load(std::sync::atomic::Ordering::Relaxed), 0);
    w.cleanup().await;
}

#[tokio::test]
async fn a_long_delay_does_not_hold_back_a_short_one() {
    let mut w = World::start(Setup {
        ladder: "1s 2s 4s 8s",
        margin: "50ms",
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
        margin: "20ms",
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
        Stats::get(&w.stats().hops) >= 14,
        "hops {}",
        Stats::get(&w.stats().hops)
    );
    w.cleanup().await;
}

#[tokio::test]
async fn expiration_does_not_cut_the_delay_and_user_id_does_not_break_the_hop() {
    let mut w = World::start(Setup {
        ladder: "500ms 1s",
        margin: "50ms",
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
    assert!(Stats::get(&w.stats().hops) >= 1);
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
    assert_eq!(Stats::get(&w.stats().reconnects), 0, "no session was lost");
    w.cleanup().await;
}

#[tokio::test]
async fn a_conflicting_existing_queue_fails_startup_naming_queue_argument_and_values() {
    let w = World::start(Setup {
        start_bridge: false,
        ..Setup::new("mismatch")
    })
    .await;
    // Redeclare one level with another TTL under a different config.
    let text_cfg = config_toml(
        &w.prefix,
        "100ms 250ms 400ms 800ms",
        "30ms",
        &[(w.ingress.clone(), w.target.clone())],
        100,
    );
    let config = delay_bridge::config::Config::from_toml(&text_cfg, "<test>", &[]).unwrap();
    // Pre-create the 250ms queue with the wrong TTL.
    let ch = w.conn.create_channel().await.unwrap();
    let mut args = FieldTable::default();
    args.insert("x-message-ttl".into(), AMQPValue::LongLongInt(999));
    ch.queue_declare(
        config
            .names
            .level_queue(Duration::from_millis(250))
            .as_str()
            .into(),
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
        delay_bridge::bridge::run(config.clone(), tokio_util::sync::CancellationToken::new()),
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
    let conn = connect().await;
    let ch = conn.create_channel().await.unwrap();
    let _ = ch
        .queue_delete(
            config
                .names
                .level_queue(Duration::from_millis(250))
                .as_str()
                .into(),
            Default::default(),
        )
        .await;
    w.cleanup().await;
}

/// Publishes `n` messages with delays spread over [min_ms, max_ms], message ids `0..n`.
async fn publish_spread(w: &World, n: usize, min_ms: u64, max_ms: u64) {
    let mut confirms = Vec::with_capacity(n);
    for i in 0..n {
        let delay = min_ms + (i as u64 * 7919) % (max_ms - min_ms);
        let props = with_delay(delay as i64).with_message_id(i.to_string().into());
        let confirm = w
            .publisher
            .basic_publish(
                w.ingress.as_str().into(),
                "rk.load".into(),
                Default::default(),
                i.to_string().as_bytes(),
                props,
            )
            .await
            .unwrap();
        confirms.push(confirm);
    }
    for c in confirms {
        assert!(c.await.unwrap().is_ack());
    }
}

/// Counts ids received: (distinct, duplicates).
fn count_ids(got: &[Received], n: usize) -> (usize, usize) {
    let mut seen = vec![0u32; n];
    for m in got {
        let id: usize = String::from_utf8_lossy(&m.body).parse().unwrap();
        seen[id] += 1;
    }
    let distinct = seen.iter().filter(|c| **c > 0).count();
    let dups = seen.iter().map(|c| c.saturating_sub(1) as usize).sum();
    (distinct, dups)
}

#[tokio::test]
async fn sigkill_mid_flight_loses_nothing() {
    const N: usize = 2_000;
    const PREFETCH: u32 = 1_000;
    let mut w = World::start(Setup {
        start_bridge: false,
        ..Setup::new("crash")
    })
    .await;
    let path = write_config(&w, PREFETCH);
    let first = BridgeProcess::spawn(&path);
    wait_for_consumers(&w, 1, 20 * SEC).await;
    publish_spread(&w, N, 300, 4_000).await;
    // Kill once deliveries have started: the rest sit in levels, holds and in flight.
    let mut got = w.recv_n(200, 10 * SEC).await;
    first.kill9().await;
    let second = BridgeProcess::spawn(&path);
    wait_for_consumers(&w, 1, 20 * SEC).await;
    let deadline = std::time::Instant::now() + 30 * SEC;
    while count_ids(&got, N).0 < N {
        assert!(
            std::time::Instant::now() < deadline,
            "missing {} of {N}",
            N - count_ids(&got, N).0
        );
        got.extend(w.drain_quiet(Duration::from_millis(500)).await);
    }
    got.extend(w.drain_quiet(SEC).await);
    let (distinct, dups) = count_ids(&got, N);
    println!("crash: {distinct}/{N} delivered, {dups} duplicates (bound: prefetch {PREFETCH})");
    assert_eq!(distinct, N, "every message arrives after a SIGKILL");
    assert!(
        dups <= PREFETCH as usize,
        "duplicates {dups} above the in-flight window"
    );
    let status = second.terminate(20 * SEC).await;
    assert!(status.success(), "exit status {status:?}");
    let _ = std::fs::remove_file(path);
    w.cleanup().await;
}

#[tokio::test]
async fn two_bridge_processes_share_the_work_without_duplicates() {
    const N: usize = 600;
    let mut w = World::start(Setup {
        start_bridge: false,
        ..Setup::new("two")
    })
    .await;
    let path = write_config(&w, 500);
    let a = BridgeProcess::spawn(&path);
    let b = BridgeProcess::spawn(&path);
    wait_for_consumers(&w, 2, 20 * SEC).await;
    publish_spread(&w, N, 100, 2_500).await;
    let mut got = w.recv_n(N, 20 * SEC).await;
    got.extend(w.drain_quiet(SEC).await);
    let (distinct, dups) = count_ids(&got, N);
    assert_eq!((distinct, dups), (N, 0), "all delivered, none twice");
    for p in [a, b] {
        assert!(p.terminate(20 * SEC).await.success());
    }
    let _ = std::fs::remove_file(path);
    w.cleanup().await;
}

#[tokio::test]
async fn sigterm_releases_held_messages_and_exits_zero() {
    const N: usize = 200;
    let mut w = World::start(Setup {
        ladder: "1s",
        margin: "100ms",
        start_bridge: false,
        ..Setup::new("sigterm")
    })
    .await;
    let path = write_config(&w, 1_000);
    let first = BridgeProcess::spawn(&path);
    wait_for_consumers(&w, 1, 20 * SEC).await;
    // Delays below the smallest level + margin: every message is held in process.
    publish_spread(&w, N, 600, 1_050).await;
    let status = first.terminate(20 * SEC).await;
    assert!(status.success(), "exit status {status:?}");
    let mut got = w.drain_quiet(Duration::from_millis(200)).await;
    let second = BridgeProcess::spawn(&path);
    wait_for_consumers(&w, 1, 20 * SEC).await;
    got.extend(w.recv_n(N - count_ids(&got, N).0, 20 * SEC).await);
    got.extend(w.drain_quiet(Duration::from_millis(500)).await);
    assert_eq!(
        count_ids(&got, N),
        (N, 0),
        "released, redelivered once each"
    );
    assert!(second.terminate(20 * SEC).await.success());
    let _ = std::fs::remove_file(path);
    w.cleanup().await;
}

#[tokio::test]
async fn a_python_pika_publisher_works_unchanged() {
    let python = std::env::var("DELAY_BRIDGE_PYTHON").unwrap_or_else(|_| {
        panic!("DELAY_BRIDGE_PYTHON is not set: run scripts/test.sh, or set it to a python with pika (scripts/python-env.sh prints one)")
    });
    let mut w = World::start(Setup {
        ladder: "200ms 500ms",
        margin: "30ms",
        ..Setup::new("pika")
    })
    .await;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/pika_publisher.py");
    let started = delay_bridge::bridge::now_ms();
    let out = tokio::process::Command::new(&python)
        .args([script, &broker_url(), &w.ingress])
        .output()
        .await
        .expect("run the pika publisher");
    assert!(
        out.status.success(),
        "pika publisher failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let got = w.recv_n(3, 10 * SEC).await;
    let bodies: Vec<&[u8]> = got.iter().map(|m| m.body.as_slice()).collect();
    assert_eq!(
        bodies,
        vec![&b"int 400"[..], b"str 900", b"int 1500"],
        "sorted by delay"
    );
    for (m, delay) in got.iter().zip([400i32, 900, 1500]) {
        let late = m.at_ms as i64 - (started as i64 + i64::from(delay));
        assert!(late < 1_000, "lateness {late} ms");
        assert_eq!(m.routing_key, "rk.pika");
        assert_eq!(m.properties.content_type(), &Some("text/plain".into()));
        assert_eq!(m.properties.delivery_mode(), &Some(2));
        assert_eq!(m.header("x-delay"), Some(&AMQPValue::LongInt(-delay)));
        assert_eq!(m.header("tenant"), Some(&text("acme")));
        assert_eq!(m.header("attempt"), Some(&AMQPValue::LongInt(3)));
        assert!(m.header("delay-bridge-hops").is_none());
    }
    assert_eq!(got[0].properties.message_id(), &Some("py-1".into()));
    w.cleanup().await;
}

#[tokio::test]
async fn a_lost_connection_is_reconnected_and_nothing_is_lost() {
    const N: usize = 300;
    let mut w = World::start(Setup::new("reconnect")).await;
    publish_spread(&w, N, 200, 2_500).await;
    let mut got = w.recv_n(20, 10 * SEC).await;
    let closed = close_connections_named(&format!("delay-bridge {}", w.prefix));
    assert_eq!(closed, 1, "the bridge's connection was found and closed");
    got.extend(w.recv_n(N - count_ids(&got, N).0, 30 * SEC).await);
    got.extend(w.drain_quiet(Duration::from_millis(500)).await);
    let (distinct, dups) = count_ids(&got, N);
    println!("reconnect: {distinct}/{N} delivered, {dups} duplicates");
    assert_eq!(distinct, N);
    assert!(dups <= 4_000, "duplicates bounded by prefetch");
    assert!(Stats::get(&w.stats().reconnects) >= 1);
    w.cleanup().await;
}

#[tokio::test]
async fn quorum_mode_delivers_through_quorum_levels() {
    let mut w = World::start(Setup {
        ladder: "100ms 300ms",
        margin: "30ms",
        queue_type: "quorum",
        ..Setup::new("quorum")
    })
    .await;
    let sent = w.publish("rk.q", b"q", with_delay(1_200)).await;
    let m = w.recv_within(10 * SEC).await;
    let late = m.at_ms as i64 - (sent as i64 + 1_200);
    assert!((0..300).contains(&late), "lateness {late} ms");
    assert_eq!(m.body, b"q");
    assert!(Stats::get(&w.stats().hops) >= 3);
    w.cleanup().await;
}

/// A burst of deliveries to a target that has no channel yet opens one channel between them,
/// not one each: 3000 at once would exceed the broker's 2047 channels per connection.
#[tokio::test]
async fn concurrent_first_publishes_to_a_target_share_one_channel() {
    use delay_bridge::amqp::targets::TargetChannels;
    let connection = std::sync::Arc::new(connect().await);
    let targets = std::sync::Arc::new(TargetChannels::new(connection.clone()));
    let opens = (0..3000).map(|_| {
        let targets = targets.clone();
        tokio::spawn(async move { targets.get("amq.direct").await.map(|c| c.id()) })
    });
    let ids = tokio::time::timeout(30 * SEC, futures::future::join_all(opens))
        .await
        .expect("3000 lookups within 30 s");
    let mut distinct: Vec<u16> = ids
        .into_iter()
        .map(|joined| joined.expect("task").expect("a channel"))
        .collect();
    distinct.sort();
    distinct.dedup();
    assert_eq!(distinct.len(), 1, "channels opened: {distinct:?}");
    targets.close_all().await;
    let _ = connection.close(200, "done".into()).await;
}
