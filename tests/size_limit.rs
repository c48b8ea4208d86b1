//! A body the broker no longer accepts: its `max_message_size` lowered under a message
//! already travelling through the levels. Every publish of that body is refused (406), the
//! parked queue's too; retrying cannot help, and leaving the message to the broker would
//! bring it back for ever. It is parked `too-large` without its body, and other traffic
//! flows on.
//!
//! A test binary of its own: the limit is broker-wide, and Cargo runs test binaries one
//! after another, so no other test publishes meanwhile; its tests take turns ([`TURN`]).
//!
//! Also: a checkpoint part the broker refuses closes the channel it went on; the bridge's
//! later appends to the cancel stream (clamps, clock entries, checkpoints) still go in.

mod support;

use std::time::Duration;

use support::*;

const SEC: Duration = Duration::from_secs(1);

/// The tests of this binary change the broker's limit: one at a time.
static TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Lowers the test broker's `max_message_size` for channels opened from now on; restores
/// it when dropped (also on a panic).
struct SizeLimit {
    restore: usize,
}

impl SizeLimit {
    fn lower_to(bytes: usize) -> SizeLimit {
        let restore = broker_max_message_size();
        set_max_message_size(bytes);
        SizeLimit { restore }
    }
}

impl Drop for SizeLimit {
    fn drop(&mut self) {
        set_max_message_size(self.restore);
    }
}

/// Sets the limit where each broker reads it: the application environment (3.x, read by
/// every new channel) and, where it exists, the copy 4.x caches at boot.
fn set_max_message_size(bytes: usize) {
    let out = rabbitmqctl()
        .args([
            "eval",
            &format!(
                "application:set_env(rabbit, max_message_size, {bytes}), \
                 case persistent_term:get(max_message_size, undefined) of \
                     undefined -> ok; \
                     _ -> persistent_term:put(max_message_size, {bytes}) \
                 end."
            ),
        ])
        .output()
        .expect("rabbitmqctl runs");
    assert!(
        out.status.success(),
        "set max_message_size {bytes}: {out:?}"
    );
}

#[tokio::test]
async fn a_body_the_broker_no_longer_accepts_is_parked_without_it_and_traffic_flows_on() {
    let _turn = TURN.lock().await;
    const BODY: usize = 64 << 10;
    let mut w = World::start(Setup::new("shrunk")).await;
    let stats = w.stats();
    let props = with_delay(4_000).with_message_id("big".into());
    w.publish("rk.big", &vec![b'x'; BODY], props).await;
    wait_until("the message hopped into a level", 10 * SEC, || {
        stats.snapshot().hops >= 1
    })
    .await;
    let limit = SizeLimit::lower_to(16 << 10);
    // The bridge's channels were opened under the old limit; its next session's are not.
    let closed = close_connections_named(&format!("delay-bridge {}", w.prefix()));
    assert_eq!(
        closed, 4,
        "the bridge's four connections (control, consuming, publishing, cancel stream) were found and closed"
    );

    let parked = w.parked_within(30 * SEC).await;
    assert_eq!(
        parked.header("delay-bridge-reason"),
        Some(&text("too-large"))
    );
    assert!(parked.body.is_empty(), "parked without its body");
    let detail = match parked.header("delay-bridge-detail") {
        Some(lapin::types::AMQPValue::LongString(s)) => {
            String::from_utf8_lossy(s.as_bytes()).into_owned()
        }
        other => panic!("delay-bridge-detail: {other:?}"),
    };
    assert!(
        detail.contains(&format!("its body ({BODY} bytes) was removed")),
        "{detail}"
    );
    assert_eq!(
        parked.properties.message_id().as_ref().map(|m| m.as_str()),
        Some("big")
    );

    w.publish("rk.small", b"small", with_delay(500)).await;
    let got = w.recv_within(10 * SEC).await;
    assert_eq!(got.body, b"small");
    w.assert_quiet(Duration::from_millis(300)).await;
    drop(limit);
    w.cleanup().await;
}

/// A checkpoint whose part is over the broker's limit: the broker refuses it and closes the
/// channel it went on. Before 0.3 that channel was never opened again, so every later
/// append of the bridge failed; now a clamp for a cancel dated ahead still goes in.
#[tokio::test]
async fn a_refused_checkpoint_part_leaves_the_bridge_appending() {
    use delay_bridge::cancel::{message_id, tombstone_properties};
    let _turn = TURN.lock().await;
    let w = World::start(Setup::new("refused-part")).await;
    let limit = SizeLimit::lower_to(16 << 10);
    // Its channels opened under the old limit; the next session's do not.
    close_connections_named(&format!("delay-bridge {}", w.prefix()));
    let stats = w.stats();
    wait_until("the bridge reconnected", 30 * SEC, || {
        stats.snapshot().reconnects >= 1
    })
    .await;
    // Enough live cancels that a checkpoint is due, and its one part (~1 MB) over 16 KiB.
    let now = delay_bridge::clock::now_ms();
    for batch in 0..7 {
        let mut confirms = Vec::new();
        for i in 0..2_000 {
            let id = message_id(&format!("order-{batch}-{i}")).unwrap();
            confirms.push(append(&w, tombstone_properties(id, now, Some(now + 600_000))).await);
        }
        for confirm in futures::future::join_all(confirms).await {
            assert!(confirm.expect("confirmed").is_ack());
        }
    }
    let entries = |json: &serde_json::Value, kind: &str| json["cancel_entries"][kind].as_u64();
    let status = || async {
        let (ok, out) = run_command(&w.config_file(4000), &["status", "--json"]).await;
        assert!(ok, "status: {out}");
        serde_json::from_str::<serde_json::Value>(&out).expect("JSON")
    };
    let deadline = tokio::time::Instant::now() + 60 * SEC;
    while entries(&status().await, "checkpoint_entries").unwrap_or(0) == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no checkpoint begun"
        );
    }
    assert_eq!(stats.snapshot().checkpoints, 0, "its part was refused");
    // Cancels dated an hour ahead: the bridge appends a clamp for each.
    let ahead = delay_bridge::clock::now_ms() + 3_600_000;
    for id in ["ahead-1", "ahead-2"] {
        append(
            &w,
            tombstone_properties(message_id(id).unwrap(), ahead, None),
        )
        .await
        .await
        .expect("confirmed");
    }
    let deadline = tokio::time::Instant::now() + 30 * SEC;
    while entries(&status().await, "clamps").unwrap_or(0) < 2 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the bridge appends no clamp after a refused part"
        );
    }
    drop(limit);
    w.cleanup().await;
}

/// Appends an entry with `properties` to the world's cancel stream: its confirm, to await.
async fn append(w: &World, properties: lapin::BasicProperties) -> lapin::PublisherConfirm {
    w.publisher
        .basic_publish(
            "".into(),
            w.config.names.cancel_stream().as_str().into(),
            lapin::options::BasicPublishOptions::default(),
            b"",
            properties,
        )
        .await
        .expect("published")
}
