//! A quorum level whose expired messages its dead-letter worker does not forward is noticed
//! from the management API's figures, counted in the bridge's stats, and warned about.

use std::time::Duration;

use delay_bridge::config::RawManagement;

use crate::support::*;

const SEC: Duration = Duration::from_secs(1);

/// The work exchange is deleted under a running bridge, so a quorum level's at-least-once
/// dead-letter worker cannot forward what expires there (the broker retries only after
/// `dead_letter_worker_publisher_confirm_timeout`, 180 s by default). The bridge sees the
/// level's expired, unforwarded messages in the management API and counts it stuck once it
/// has held them for `management.stuck_after`. Without the watch, nothing noticed.
#[tokio::test]
async fn a_quorum_level_that_does_not_forward_its_expired_messages_is_reported_stuck() {
    let overview = format!("{}/api/overview", management_url());
    let answer = reqwest::Client::new()
        .get(&overview)
        .basic_auth("guest", Some("guest"))
        .timeout(10 * SEC)
        .send()
        .await;
    assert!(
        answer.as_ref().is_ok_and(|r| r.status().is_success()),
        "the broker's management API does not answer at {overview} ({answer:?}): run \
         scripts/broker.sh, which enables the plugin"
    );
    let w = World::start(Setup {
        queue_type: "quorum",
        ladder: "500ms",
        management: RawManagement {
            url: Some(management_url()),
            interval: Some(Duration::from_millis(500)),
            stuck_after: Some(2 * SEC),
            ..RawManagement::default()
        },
        ..Setup::new("stuck")
    })
    .await;
    let stats = w.stats();
    let ch = w.conn.create_channel().await.unwrap();
    ch.exchange_delete(
        w.config.names.work_exchange().as_str().into(),
        Default::default(),
    )
    .await
    .expect("the work exchange is deleted");
    // Long enough to hop into the 500 ms level at least once.
    for i in 0..5 {
        w.publish(&format!("rk.stuck.{i}"), b"stuck", with_delay(60_000))
            .await;
    }
    wait_until("the bridge reports a stuck level", 60 * SEC, || {
        stats.snapshot().stuck_queues >= 1
    })
    .await;
    let counts = stats.snapshot();
    assert!(
        counts.expired_unforwarded >= 1,
        "expired, unforwarded messages counted: {counts:?}"
    );
    assert_eq!(counts.delivered, 0);
    w.cleanup().await;
}
