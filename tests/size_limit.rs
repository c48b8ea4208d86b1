//! A body the broker no longer accepts: its `max_message_size` lowered under a message
//! already travelling through the levels. Every publish of that body is refused (406), the
//! parked queue's too; retrying cannot help, and leaving the message to the broker would
//! bring it back for ever. It is parked `too-large` without its body, and other traffic
//! flows on.
//!
//! A test binary of its own: the limit is broker-wide, and Cargo runs test binaries one
//! after another, so no other test publishes meanwhile.

mod support;

use std::time::Duration;

use support::*;

const SEC: Duration = Duration::from_secs(1);

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
        closed, 3,
        "the bridge's three connections (control, consuming, publishing) were found and closed"
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
