//! Publishes the broker refuses for a reason that will not go away are parked with a stable
//! reason after a bounded number of attempts, while other traffic keeps flowing.

use std::time::Duration;

use lapin::ExchangeKind;
use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};

use crate::support::*;

const SEC: Duration = Duration::from_secs(1);

/// A world with one extra route whose target the test sets up; gives the extra ingress.
async fn world_with_extra_route(
    test: &str,
    target_suffix: &str,
    target_full_timeout: Option<Duration>,
) -> (World, String, String) {
    let other = format!("{test}-{:08x}", rand::random::<u32>());
    let ingress = format!("{other}.in");
    let target = format!("{other}.{target_suffix}");
    let w = World::start(Setup {
        extra_routes: vec![(ingress.clone(), target.clone())],
        target_full_timeout,
        ..Setup::new(test)
    })
    .await;
    (w, ingress, target)
}

/// Declares `full` (direct) with one queue, bound `rk.full`, that holds at most
/// `max_length` messages and refuses (nacks) publishes beyond them.
async fn declare_full_target(w: &mut World, full: &str, max_length: i64) {
    let queue = format!("{full}.q");
    w.declare_extra_exchange(full, ExchangeKind::Direct).await;
    let ch = w.conn.create_channel().await.unwrap();
    let mut args = FieldTable::default();
    args.insert("x-max-length".into(), AMQPValue::LongLongInt(max_length));
    args.insert(
        "x-overflow".into(),
        AMQPValue::LongString("reject-publish".into()),
    );
    ch.queue_declare(queue.as_str().into(), QueueDeclareOptions::default(), args)
        .await
        .unwrap();
    w.adopt_queue(&queue);
    ch.queue_bind(
        queue.as_str().into(),
        full.into(),
        "rk.full".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
}

fn reason(m: &Received) -> Option<&AMQPValue> {
    m.header("delay-bridge-reason")
}

/// An `internal` target exchange refuses every publish (403, channel closed): the message
/// is parked `target-refused`, and a message to a good target published after it arrives
/// while the refused one is retried, on the same session.
#[tokio::test]
async fn a_target_that_refuses_every_publish_parks_the_message_and_traffic_flows_on() {
    let (mut w, ingress, internal) = world_with_extra_route("refused", "internal", None).await;
    let ch = w.conn.create_channel().await.unwrap();
    ch.exchange_declare(
        internal.as_str().into(),
        ExchangeKind::Topic,
        ExchangeDeclareOptions {
            internal: true,
            ..ExchangeDeclareOptions::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
    w.adopt_exchange(&internal);
    publish_to(
        &w.publisher,
        &ingress,
        "rk.refused",
        b"refused",
        with_delay(150),
    )
    .await;
    w.publish("rk.ok", b"ok", with_delay(300)).await;
    let delivered = w.recv_within(5 * SEC).await;
    assert_eq!(delivered.body, b"ok");
    let parked = w.parked_within(15 * SEC).await;
    assert_eq!(parked.body, b"refused");
    assert_eq!(reason(&parked), Some(&text("target-refused")));
    let detail = match parked.header("delay-bridge-detail") {
        Some(AMQPValue::LongString(s)) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        other => panic!("no detail: {other:?}"),
    };
    assert!(
        detail.contains("ACCESS_REFUSED") && detail.contains("internal"),
        "detail names the refusal: {detail}"
    );
    assert_eq!(w.stats().snapshot().reconnects, 0, "no session was lost");
    w.assert_quiet(Duration::from_millis(300)).await;
    w.cleanup().await;
}

/// A target whose only queue is full with `reject-publish` nacks every publish: the message
/// is retried with backoff, parked `target-full` once `bridge.target_full_timeout` (1 s
/// here) has passed, and a message to another target published after it is delivered
/// meanwhile.
#[tokio::test]
async fn a_full_target_parks_the_message_after_the_configured_time_and_traffic_flows_on() {
    let (mut w, ingress, full) = world_with_extra_route("full", "full", Some(SEC)).await;
    declare_full_target(&mut w, &full, 1).await;
    publish_to(
        &w.publisher,
        &full,
        "rk.full",
        b"filler",
        Default::default(),
    )
    .await;

    let sent = publish_to(&w.publisher, &ingress, "rk.full", b"full", with_delay(150)).await;
    w.publish("rk.ok", b"ok", with_delay(400)).await;
    let delivered = w.recv_within(5 * SEC).await;
    assert_eq!(
        delivered.body, b"ok",
        "traffic flows while the full target is retried"
    );
    let parked = w.parked_within(15 * SEC).await;
    assert_eq!(parked.body, b"full");
    assert_eq!(reason(&parked), Some(&text("target-full")));
    let waited = parked.at_ms - sent;
    assert!(
        waited >= 1_150,
        "parked after {waited} ms, before the 1 s limit had passed"
    );
    assert!(w.stats().snapshot().nacks >= 2, "it was retried");
    assert_eq!(w.stats().snapshot().reconnects, 0, "no session was lost");
    w.cleanup().await;
}

/// A classic work queue marks a redelivery but counts none, so a message whose handling
/// costs the bridge its session would come back for ever. The bridge counts redeliveries
/// itself: a message held while its connection is closed twice reaches
/// `bridge.redelivery_limit` (2 here) and is parked `redelivery-limit` instead of being
/// delivered. (Before, it was delivered after any number of redeliveries.)
#[tokio::test]
async fn a_classic_message_redelivered_past_the_limit_is_parked() {
    let mut w = World::start(Setup {
        // Holds last up to the smallest level plus the margin: the message waits in the
        // bridge for its whole delay.
        margin: Duration::from_secs(8),
        redelivery_limit: Some(2),
        ..Setup::new("redeliver")
    })
    .await;
    let stats = w.stats();
    w.publish("rk.held", b"held", with_delay(7_000)).await;
    for seen in 1..=2u64 {
        wait_until("the message is held", 10 * SEC, || {
            stats.snapshot().consumed >= seen && stats.snapshot().held >= 1
        })
        .await;
        let closed = close_connections_named(&format!("delay-bridge {}", w.prefix()));
        assert_eq!(
            closed, 4,
            "the bridge's four connections (control, consuming, publishing, cancel stream) were found and closed"
        );
    }
    let parked = w.parked_within(20 * SEC).await;
    assert_eq!(parked.body, b"held");
    assert_eq!(reason(&parked), Some(&text("redelivery-limit")));
    w.assert_quiet(Duration::from_millis(300)).await;
    assert_eq!(stats.snapshot().delivered, 0);
    w.cleanup().await;
}

/// 3 000 messages due at one instant to a target exchange that does not exist: every one is
/// parked `target-missing` once, on the session it started on. Each 404 closes the target's
/// channel and fails every publish pending on it; before the refusal was judged once per
/// target, each of them retried on a private channel of its own, the connection ran out of
/// channels ("maximum number of channels reached"), the session ended, and the redeliveries
/// that followed parked messages `redelivery-limit` instead.
#[tokio::test]
async fn a_burst_to_a_missing_target_parks_every_message_target_missing_on_one_session() {
    const N: usize = 3_000;
    let other = format!("burst-missing-{:08x}", rand::random::<u32>());
    let ingress = format!("{other}.in");
    let mut w = World::start(Setup {
        extra_routes: vec![(ingress.clone(), format!("{other}.nowhere"))],
        start_bridge: false,
        ..Setup::new("burst-missing")
    })
    .await;
    let deliver_at = delay_bridge::clock::now_ms() + 3_000;
    let mut confirms = Vec::with_capacity(N);
    for i in 0..N {
        let properties = lapin::BasicProperties::default()
            .with_message_id(i.to_string().into())
            .with_headers(headers(vec![(
                "x-deliver-at",
                AMQPValue::LongLongInt(deliver_at as i64),
            )]));
        let confirm = w
            .publisher
            .basic_publish(
                ingress.as_str().into(),
                "rk.missing".into(),
                Default::default(),
                b"missing",
                properties,
            )
            .await
            .unwrap();
        confirms.push(confirm);
    }
    for c in confirms {
        assert!(c.await.unwrap().is_ack());
    }
    w.start_bridge().await;

    let mut parked = std::collections::HashMap::<String, u32>::new();
    let mut reasons = std::collections::BTreeMap::<String, u32>::new();
    let deadline = std::time::Instant::now() + 90 * SEC;
    while parked.len() < N {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match w.next_arrival(left).await {
            Some(Arrival::Parked(m)) => {
                let why = match reason(&m) {
                    Some(AMQPValue::LongString(s)) => s.to_string(),
                    other => format!("{other:?}"),
                };
                *reasons.entry(why).or_default() += 1;
                let id = m.properties.message_id().clone().unwrap().to_string();
                *parked.entry(id).or_default() += 1;
            }
            Some(Arrival::Target(m)) => panic!("delivered to a missing target: {m:?}"),
            None => break,
        }
    }
    assert_eq!(
        parked.len(),
        N,
        "parked {} of {N}: {reasons:?}",
        parked.len()
    );
    assert_eq!(
        reasons.get("target-missing").copied(),
        Some(N as u32),
        "every one parked target-missing: {reasons:?}"
    );
    // Before the fixes: 40 and more sessions lost; then, on 4.0.5 under the whole suite, one
    // in some runs (lapin's close-ok overtaking queued publishes, see `amqp::targets`).
    assert_eq!(w.stats().snapshot().reconnects, 0, "no session was lost");
    w.assert_quiet(Duration::from_millis(500)).await;
    w.cleanup().await;
}

/// A bundling bridge with 300 messages due at one instant for a full target (nacked, retried
/// until `bridge.target_full_timeout`, 5 s here): a message due just after them for another
/// target is delivered while they are still retried. The messages of bundles publish in
/// turns (`bridge::turns`), and a message backing off holds none. (Before, each held its
/// turn through its backoffs: the 128 turns stayed with the full target until its messages
/// were parked, and the other target's message waited for that.)
#[tokio::test]
async fn a_full_target_backing_off_holds_no_turn_from_other_targets() {
    const FULL: usize = 300;
    let other = format!("turns-{:08x}", rand::random::<u32>());
    let (ingress, full) = (format!("{other}.in"), format!("{other}.full"));
    let mut w = World::start(Setup {
        ladder: "1s 2s",
        margin: Duration::from_millis(100),
        hop_window: Some(Duration::from_millis(100)),
        bundle_hops: Some(true),
        extra_routes: vec![(ingress.clone(), full.clone())],
        target_full_timeout: Some(5 * SEC),
        ..Setup::new("turns-full")
    })
    .await;
    declare_full_target(&mut w, &full, 0).await;
    let due = delay_bridge::clock::now_ms() + 2_500;
    let at = |ms: u64| {
        lapin::BasicProperties::default().with_headers(headers(vec![(
            "x-deliver-at",
            AMQPValue::LongLongInt(ms as i64),
        )]))
    };
    for _ in 0..FULL {
        publish_to(&w.publisher, &ingress, "rk.full", b"full", at(due)).await;
    }
    w.publish("rk.ok", b"ok", at(due + 300)).await;
    let delivered = w.recv_within(15 * SEC).await;
    assert_eq!(delivered.body, b"ok");
    let snapshot = w.stats().snapshot();
    assert_eq!(
        snapshot.parked, 0,
        "delivered while the full target's messages were still retried: {snapshot:?}"
    );
    assert!(snapshot.nacks > 0, "the full target nacked: {snapshot:?}");
    let mut parked = 0;
    while parked < FULL {
        let m = w.parked_within(30 * SEC).await;
        assert_eq!(reason(&m), Some(&text("target-full")));
        parked += 1;
    }
    w.cleanup().await;
}
