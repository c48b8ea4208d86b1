//! Faults of the bridge and its connection: SIGKILL, two processes, SIGTERM, a closed
//! connection, quorum mode, a burst of first publishes.

use std::time::Duration;

use crate::support::*;

const SEC: Duration = Duration::from_secs(1);

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
    let mut w = World::without_bridge("crash").await;
    let path = w.config_file(PREFETCH);
    let first = spawn_process(&path);
    wait_for_consumers(&w, 1, 20 * SEC).await;
    publish_spread(&w, N, 300, 4_000).await;
    // Kill once deliveries have started: the rest sit in levels, holds and in flight.
    let mut got = w.recv_n(200, 10 * SEC).await;
    first.kill9().await;
    let second = spawn_process(&path);
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
    // Two consumers hold a window of `PREFETCH` each: the work queue's (new messages, whose
    // first hops were confirmed and not yet acked travel twice) and the returns queue's
    // (deliveries and hops confirmed, not yet acked). A killed bridge doubles what both held.
    let bound = 2 * PREFETCH as usize;
    println!("crash: {distinct}/{N} delivered, {dups} duplicates (bound: two windows, {bound})");
    assert_eq!(distinct, N, "every message arrives after a SIGKILL");
    assert!(
        dups <= bound,
        "duplicates {dups} above the two in-flight windows"
    );
    let status = second.terminate(20 * SEC).await.unwrap();
    assert!(status.success(), "exit status {status:?}");
    w.cleanup().await;
}

#[tokio::test]
async fn two_bridge_processes_share_the_work_without_duplicates() {
    const N: usize = 600;
    let mut w = World::without_bridge("two").await;
    let path = w.config_file(500);
    let a = spawn_process(&path);
    let b = spawn_process(&path);
    wait_for_consumers(&w, 2, 20 * SEC).await;
    publish_spread(&w, N, 100, 2_500).await;
    let mut got = w.recv_n(N, 20 * SEC).await;
    got.extend(w.drain_quiet(SEC).await);
    let (distinct, dups) = count_ids(&got, N);
    assert_eq!((distinct, dups), (N, 0), "all delivered, none twice");
    for p in [a, b] {
        assert!(p.terminate(20 * SEC).await.unwrap().success());
    }
    w.cleanup().await;
}

#[tokio::test]
async fn sigterm_releases_held_messages_and_exits_zero() {
    const N: usize = 200;
    let mut w = World::start(Setup {
        ladder: "1s",
        margin: Duration::from_millis(100),
        start_bridge: false,
        ..Setup::new("sigterm")
    })
    .await;
    let path = w.config_file(1_000);
    let first = spawn_process(&path);
    wait_for_consumers(&w, 1, 20 * SEC).await;
    // Delays below the smallest level + margin: every message is held in process.
    publish_spread(&w, N, 600, 1_050).await;
    let status = first.terminate(20 * SEC).await.unwrap();
    assert!(status.success(), "exit status {status:?}");
    let mut got = w.drain_quiet(Duration::from_millis(200)).await;
    let second = spawn_process(&path);
    wait_for_consumers(&w, 1, 20 * SEC).await;
    got.extend(w.recv_n(N - count_ids(&got, N).0, 20 * SEC).await);
    got.extend(w.drain_quiet(Duration::from_millis(500)).await);
    assert_eq!(
        count_ids(&got, N),
        (N, 0),
        "released, redelivered once each"
    );
    assert!(second.terminate(20 * SEC).await.unwrap().success());
    w.cleanup().await;
}

/// Which of the bridge's connections a test closes.
#[derive(Clone, Copy)]
enum Lost {
    /// Every one of them (`delay-bridge <prefix>` and what its name begins).
    All,
    /// `delay-bridge <prefix> consumer`, the work queue's.
    Consumer,
    /// `delay-bridge <prefix> publisher`, the one that publishes.
    Publisher,
    /// `delay-bridge <prefix>`, the one that declares and reads queue depths.
    Control,
}

/// Closes `lost` mid-stream: the session ends on the other connection too, the next one
/// carries on, and nothing is lost.
async fn lose_connections(test: &str, lost: Lost) {
    const N: usize = 300;
    let mut w = World::start(Setup::new(test)).await;
    publish_spread(&w, N, 200, 2_500).await;
    let mut got = w.recv_n(20, 10 * SEC).await;
    let name = format!("delay-bridge {}", w.prefix());
    let (closed, expected) = match lost {
        Lost::All => (close_connections_named(&name), 4),
        Lost::Consumer => (close_connections_named(&format!("{name} consumer")), 1),
        Lost::Publisher => (close_connections_named(&format!("{name} publisher")), 1),
        Lost::Control => (close_connections_named_exactly(&name), 1),
    };
    assert_eq!(
        closed, expected,
        "the bridge's connections were found and closed"
    );
    got.extend(w.recv_n(N - count_ids(&got, N).0, 30 * SEC).await);
    got.extend(w.drain_quiet(Duration::from_millis(500)).await);
    let (distinct, dups) = count_ids(&got, N);
    println!("{test}: {distinct}/{N} delivered, {dups} duplicates");
    assert_eq!(distinct, N);
    assert!(dups <= 4_000, "duplicates bounded by prefetch");
    assert!(w.stats().snapshot().reconnects >= 1);
    w.cleanup().await;
}

#[tokio::test]
async fn a_lost_connection_is_reconnected_and_nothing_is_lost() {
    lose_connections("reconnect", Lost::All).await;
}

#[tokio::test]
async fn a_lost_consumer_connection_is_reconnected_and_nothing_is_lost() {
    lose_connections("reconnect-consumer", Lost::Consumer).await;
}

#[tokio::test]
async fn a_lost_publishing_connection_is_reconnected_and_nothing_is_lost() {
    lose_connections("reconnect-publisher", Lost::Publisher).await;
}

#[tokio::test]
async fn a_lost_control_connection_is_reconnected_and_nothing_is_lost() {
    lose_connections("reconnect-control", Lost::Control).await;
}

#[tokio::test]
async fn quorum_mode_delivers_through_quorum_levels() {
    let mut w = World::start(Setup {
        ladder: "100ms 300ms",
        margin: Duration::from_millis(30),
        queue_type: "quorum",
        // Its verdict is a lateness bound (381 ms against 300 once on 4.0.5 beside three
        // other tests).
        alone: true,
        ..Setup::new("quorum")
    })
    .await;
    let sent = w.publish("rk.q", b"q", with_delay(1_200)).await;
    let m = w.recv_within(10 * SEC).await;
    let late = m.at_ms as i64 - (sent as i64 + 1_200);
    assert!((0..300).contains(&late), "lateness {late} ms");
    assert_eq!(m.body, b"q");
    assert!(w.stats().snapshot().hops >= 3);
    w.cleanup().await;
}

/// With several brokers configured, the bridge moves past one that refuses connections (the
/// first, here: nothing listens on its port) and serves through the next.
#[tokio::test]
async fn a_bridge_with_several_brokers_moves_past_one_that_is_down() {
    let mut w = World::without_bridge("urls").await;
    let mut config = w.config.clone();
    let down = delay_bridge::config::BrokerUrl::parse("amqp://guest:guest@127.0.0.1:1/%2f")
        .expect("a URL");
    config.urls = vec![down, config.url().clone()];
    let bridge = InProcessBridge::start(config)
        .await
        .expect("ready through the second broker");
    assert!(
        bridge.stats().snapshot().reconnects >= 1,
        "the first broker was tried"
    );
    w.publish("rk.urls", b"through-2", with_delay(200)).await;
    assert_eq!(w.recv_within(5 * SEC).await.body, b"through-2");
    bridge.stop().await.expect("the bridge stops cleanly");
    w.cleanup().await;
}
