//! Behaviours that differ between RabbitMQ 3.x and 4.x, tested on whichever broker
//! `DELAY_BRIDGE_TEST_URL` names (scripts/test.sh runs the suite on 3.10 and on 4.0).

use std::time::Duration;

use delay_bridge::client::{ClientError, Message, When};
use futures::StreamExt;
use lapin::BasicProperties;
use lapin::options::{BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;

use crate::support::*;

const SEC: Duration = Duration::from_secs(1);

/// Dead-lettering writes `x-death` (3.x reads a re-published one, and drops a message that
/// meets a queue in its death history), `x-first-death-*`, and from 3.13 `x-last-death-*`.
fn assert_no_death_headers(m: &Received) {
    if let Some(h) = m.properties.headers().as_ref() {
        for (k, _) in h {
            for p in [
                "x-death",
                "x-first-death-",
                "x-last-death-",
                "delay-bridge-",
            ] {
                assert!(
                    !k.as_str().starts_with(p),
                    "header {k} leaked to the target"
                );
            }
        }
    }
}

#[tokio::test]
async fn a_message_revisiting_one_level_many_times_arrives_once_without_death_headers() {
    // One 100 ms level: a 2.5 s delay visits it about 24 times.
    let mut w = World::start(Setup {
        ladder: "100ms",
        margin: Duration::from_millis(20),
        ..Setup::new("revisit")
    })
    .await;
    let props = with_delay(2_500).with_message_id("revisit".into());
    let sent = w.publish("rk.revisit", b"revisit", props).await;
    w.publish(
        "rk.revisit",
        b"sentinel",
        with_delay(3_000).with_message_id("sentinel".into()),
    )
    .await;
    let got = w.recv_n(2, 10 * SEC).await;
    assert_eq!(got[0].body, b"revisit");
    assert_eq!(
        got[1].body, b"sentinel",
        "the revisiting message arrived once"
    );
    let late = got[0].at_ms as i64 - (sent as i64 + 2_500);
    assert!((0..200).contains(&late), "lateness {late} ms");
    for m in &got {
        assert_no_death_headers(m);
    }
    let hops = w.stats().snapshot().hops;
    assert!(hops >= 40, "the same level was visited {hops} times in all");
    assert_eq!(w.pending_in_queues().await, 0);
    w.cleanup().await;
}

#[tokio::test]
async fn quorum_levels_take_more_hops_than_the_default_delivery_limit() {
    // RabbitMQ 4.x gives quorum queues a delivery limit of 20. A hop is a new publish and a
    // return from a level is a dead-lettering, not a redelivery, so 29 visits to one quorum
    // level (and 29 returns through the quorum work queue) must still deliver.
    let mut w = World::start(Setup {
        ladder: "100ms",
        margin: Duration::from_millis(20),
        queue_type: "quorum",
        ..Setup::new("quorum-hops")
    })
    .await;
    let sent = w
        .publish(
            "rk.q",
            b"many-hops",
            with_delay(3_000).with_message_id("q".into()),
        )
        .await;
    let m = w.recv_within(15 * SEC).await;
    assert_eq!(m.body, b"many-hops");
    assert!(m.at_ms >= sent + 3_000);
    assert_no_death_headers(&m);
    let hops = w.stats().snapshot().hops;
    assert!(
        hops > 20,
        "made {hops} hops, more than the default delivery limit of 20"
    );
    assert_eq!(w.stats().snapshot().parked, 0);
    w.cleanup().await;
}

#[tokio::test]
async fn a_message_redelivered_too_often_is_parked_with_a_reason() {
    // Redeliveries do count: a delivery returned to the quorum work queue again and again
    // as when it crashes the bridge every time (its channel goes with it, the delivery
    // unacked) is parked `redelivery-limit`. A channel lost counts on every version; a
    // `basic.nack` with requeue no longer does on 4.3 (see
    // `a_nack_counts_toward_the_delivery_limit_before_4_3_only`).
    let mut w = World::start(Setup {
        queue_type: "quorum",
        start_bridge: false,
        ..Setup::new("redelivered")
    })
    .await;
    w.publish("rk.poison", b"poison", BasicProperties::default())
        .await;
    let work = w.config.names.work_queue();
    for _ in 0..w.config.redelivery_limit {
        let channel = w.conn.create_channel().await.unwrap();
        channel
            .basic_qos(1, BasicQosOptions::default())
            .await
            .unwrap();
        let mut consumer = channel
            .basic_consume(
                work.as_str().into(),
                "crashing".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        tokio::time::timeout(5 * SEC, consumer.next())
            .await
            .expect("redelivered")
            .unwrap()
            .unwrap();
        // Crashes with it unacked.
        let _ = channel.close(200, "crash".into()).await;
    }
    w.start_bridge().await;
    let parked = w.parked_within(10 * SEC).await;
    assert_eq!(parked.body, b"poison");
    assert_eq!(
        parked.header("delay-bridge-reason"),
        Some(&text("redelivery-limit"))
    );
    assert_eq!(w.stats().snapshot().delivered, 0);
    w.cleanup().await;
}

#[tokio::test]
async fn a_message_over_the_size_limit_is_refused_with_a_clear_error_and_one_at_it_travels() {
    let limit = broker_max_message_size();
    let mut w = World::start(Setup {
        ladder: "200ms",
        margin: Duration::from_millis(30),
        ..Setup::new("size-limit")
    })
    .await;
    let client = w.client().await;
    let msg = |bytes: usize, id: &str| {
        Message::new(w.ingress.as_str(), "rk.size", vec![b'x'; bytes]).with_message_id(id)
    };
    let err = client
        .schedule(msg(limit + 1, "over"), When::After(SEC))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, ClientError::TooLarge { bytes, broker } if *bytes == limit + 1 && broker.contains(&limit.to_string())),
        "{err}"
    );
    // A body at the limit (capped at 16 MiB to keep the test quick on 3.x's 128 MiB limit)
    // travels: the bridge's headers do not count against the body limit.
    let size = limit.min(16 * 1024 * 1024);
    client
        .schedule(
            msg(size, "at-limit"),
            When::After(Duration::from_millis(500)),
        )
        .await
        .expect("the client still works after the broker closed a channel");
    let m = w.recv_within(20 * SEC).await;
    assert_eq!(m.body.len(), size);
    assert!(w.stats().snapshot().hops >= 1, "it went through a level");
    client.close().await.unwrap();
    w.cleanup().await;
}
