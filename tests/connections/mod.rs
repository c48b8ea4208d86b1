//! A bridge holds four connections (control, consuming, publishing, the cancel stream's)
//! through every kind of traffic and a lost session, and never opens a fifth: what the
//! broker lists under the bridge's names, sampled all along. (A fifth, short-lived one
//! reads a cancel-stream entry alone when the broker failed to send it: not here.)

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use delay_bridge::client::{Message, When};

use crate::support::*;

const SEC: Duration = Duration::from_secs(1);

/// How many connections the broker lists whose name begins `delay-bridge <prefix>` (the
/// bridge's four are `delay-bridge <prefix>`, `... consumer`, `... publisher` and
/// `... cancel stream`).
fn bridge_connections(prefix: &str) -> usize {
    let named = format!("\"delay-bridge {prefix}");
    listed_connections()
        .lines()
        .filter(|line| line.contains(&named))
        .count()
}

/// Waits until the broker lists exactly four connections of the bridge (each list takes
/// rabbitmqctl a moment: off the runtime, so that the bridge in this process runs on).
async fn four_listed(prefix: &str, within: Duration) {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let prefix = prefix.to_string();
        let listed = tokio::task::spawn_blocking(move || bridge_connections(&prefix))
            .await
            .expect("the list");
        if listed == 4 {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{listed} connections of the bridge listed, not 4, within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Lists the bridge's connections again and again until told to stop; gives the most seen
/// at once and how many lists it took.
fn sample(prefix: String, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<(usize, usize)> {
    std::thread::spawn(move || {
        let (mut most, mut samples) = (0, 0);
        while !stop.load(Ordering::Relaxed) {
            most = most.max(bridge_connections(&prefix));
            samples += 1;
        }
        (most, samples)
    })
}

/// Deliveries, an unroutable message, an unreadable one, a cancel, and a lost session with
/// its reconnect: the broker never lists more than four connections of the bridge, and
/// four again once it has reconnected. (Before the AMQP layer had one rule, an unreadable
/// delivery made a bridge open another, bare connection to sweep its queue.)
#[tokio::test]
async fn a_bridge_holds_four_connections_and_never_opens_a_fifth() {
    let mut w = World::start(Setup::new("connections")).await;
    let prefix = w.prefix().to_string();
    four_listed(&prefix, 20 * SEC).await;
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = sample(prefix.clone(), stop.clone());

    w.publish("rk.first", b"first", with_delay(600)).await;
    assert_eq!(w.recv_within(10 * SEC).await.body, b"first");
    w.publish("unbound.key", b"unroutable", with_delay(300))
        .await;
    assert_eq!(w.parked_within(10 * SEC).await.body, b"unroutable");
    crate::support::raw::publish_with_header_named(
        &broker_url(),
        &w.ingress,
        300,
        &[0xff, 0xfe],
        b"unreadable",
    )
    .await;
    assert_eq!(w.parked_within(10 * SEC).await.body, b"unreadable");
    let client = w.client().await;
    let message = |id: &str| {
        Message::new(w.ingress.as_str(), "rk.cancel", id.as_bytes().to_vec()).with_message_id(id)
    };
    client
        .schedule(message("doomed"), When::After(2 * SEC))
        .await
        .expect("scheduled");
    client.cancel("doomed").await.expect("cancelled");
    client
        .schedule(message("sentinel"), When::After(3 * SEC))
        .await
        .expect("scheduled");
    assert_eq!(w.recv_within(10 * SEC).await.body, b"sentinel");
    client.close().await.expect("closed");

    let closed = close_connections_named(&format!("delay-bridge {prefix}"));
    assert_eq!(
        closed, 4,
        "the bridge's four connections were listed and closed"
    );
    let stats = w.stats();
    wait_until("the bridge reconnected", 30 * SEC, || {
        stats.snapshot().reconnects >= 1
    })
    .await;
    w.publish("rk.after", b"after", with_delay(300)).await;
    assert_eq!(w.recv_within(20 * SEC).await.body, b"after");
    four_listed(&prefix, 20 * SEC).await;

    stop.store(true, Ordering::Relaxed);
    let (most, samples) = sampler.join().expect("the sampler");
    println!("{samples} lists of the broker's connections, at most {most} of the bridge's");
    assert!(
        samples >= 3,
        "the connections were listed during the traffic"
    );
    assert!(most <= 4, "{most} connections of the bridge at once");
    w.cleanup().await;
}
