//! Cancel and reschedule, end to end: tombstones in the cancel stream, honoured by every
//! bridge instance at a message's next hop or before its delivery.
//!
//! Absence is proven with a sentinel: a message due after the cancelled one. FIFO expiry and
//! the bridge's ordering mean the cancelled one would have arrived first; the level and work
//! queues being empty shows no copy is left anywhere.

use std::time::{Duration, SystemTime};

use delay_bridge::bridge::Stats;
use delay_bridge::client::{ClientError, Message, When};
use delay_bridge::clock::now_ms;
use delay_bridge::sandbox::process::ConfigFile;
use lapin::types::AMQPValue;

use crate::support::*;

const SEC: Duration = Duration::from_secs(1);

fn msg(w: &World, id: &str, body: &str) -> Message {
    Message::new(w.ingress.as_str(), "rk.cancel", body.as_bytes().to_vec()).with_message_id(id)
}

/// Waits for the sentinel and asserts it is the only message that arrived.
async fn only_sentinel_arrives(w: &mut World, within: Duration) {
    let got = w.recv_within(within).await;
    assert_eq!(got.body, b"sentinel", "a cancelled message arrived");
    assert_eq!(w.pending_in_queues().await, 0, "no copy left in any queue");
}

#[tokio::test]
async fn cancel_in_a_level_queue_drops_it_at_its_next_hop() {
    let mut w = World::start(Setup {
        ladder: "500ms",
        margin: Duration::from_millis(50),
        ..Setup::new("cancel-level")
    })
    .await;
    let stats = w.stats();
    let client = w.client().await;
    let doomed = client
        .schedule(msg(&w, "doomed", "doomed"), When::After(4 * SEC))
        .await
        .unwrap();
    client
        .schedule(msg(&w, "sentinel", "sentinel"), When::After(5 * SEC))
        .await
        .unwrap();
    // Let it ride a few hops, then cancel while it sits in the level queue.
    wait_until("two hops each", 5 * SEC, || stats.snapshot().hops >= 4).await;
    let cancelled = client.cancel("doomed").await.unwrap();
    wait_until("the copy is dropped", 5 * SEC, || {
        stats.snapshot().cancelled == 1
    })
    .await;
    let dropped_at = now_ms();
    assert!(
        dropped_at < cancelled.cancelled_at + 1_000,
        "dropped at its next hop (a level is 500 ms), {} ms after the cancel",
        dropped_at - cancelled.cancelled_at
    );
    assert!(
        dropped_at + 2_000 < doomed.deliver_at,
        "left the levels early instead of riding to the end"
    );
    only_sentinel_arrives(&mut w, 10 * SEC).await;
    assert_eq!(stats.snapshot().cancelled, 1);
    client.close().await.unwrap();
    w.cleanup().await;
}

#[tokio::test]
async fn cancel_during_the_final_hold_stops_the_delivery() {
    // One 2 s level and a 1.5 s margin: a 1.2 s delay is held in process from the start.
    let mut w = World::start(Setup {
        ladder: "2s",
        margin: Duration::from_millis(1500),
        ..Setup::new("cancel-hold")
    })
    .await;
    let stats = w.stats();
    let client = w.client().await;
    client
        .schedule(
            msg(&w, "held", "held"),
            When::After(Duration::from_millis(1_200)),
        )
        .await
        .unwrap();
    wait_until("the message is held", 5 * SEC, || {
        stats.snapshot().held == 1
    })
    .await;
    client.cancel("held").await.unwrap();
    client
        .schedule(
            msg(&w, "sentinel", "sentinel"),
            When::After(Duration::from_millis(1_500)),
        )
        .await
        .unwrap();
    only_sentinel_arrives(&mut w, 10 * SEC).await;
    assert_eq!(stats.snapshot().cancelled, 1, "dropped before delivery");
    assert_eq!(stats.snapshot().hops, 0, "it never left the hold");
    client.close().await.unwrap();
    w.cleanup().await;
}

#[tokio::test]
async fn cancelling_a_delivered_or_unknown_id_is_a_harmless_no_op() {
    let mut w = World::start(Setup::new("cancel-noop")).await;
    let stats = w.stats();
    let client = w.client().await;
    client
        .schedule(
            msg(&w, "done", "done"),
            When::After(Duration::from_millis(300)),
        )
        .await
        .unwrap();
    assert_eq!(w.recv_within(5 * SEC).await.body, b"done");
    let after_delivery = client.cancel("done").await.expect("a no-op, not an error");
    let unknown = client
        .cancel("never-scheduled")
        .await
        .expect("a no-op, not an error");
    assert_eq!(unknown.message_id, "never-scheduled");
    assert!(after_delivery.cancelled_at <= unknown.cancelled_at);
    wait_until("both tombstones read", 5 * SEC, || {
        stats.snapshot().tombstones == 2
    })
    .await;
    client
        .schedule(
            msg(&w, "sentinel", "sentinel"),
            When::After(Duration::from_millis(300)),
        )
        .await
        .unwrap();
    only_sentinel_arrives(&mut w, 5 * SEC).await;
    assert_eq!(stats.snapshot().cancelled, 0, "nothing was dropped");
    assert_eq!(stats.snapshot().delivered, 2);
    // Invalid ids are refused before anything is published.
    let err = client.cancel("").await.unwrap_err();
    assert!(err.to_string().contains("empty"), "{err}");
    client.close().await.unwrap();
    w.cleanup().await;
}

#[tokio::test]
async fn reschedule_later_and_earlier_delivers_once_at_the_new_time() {
    let mut w = World::start(Setup {
        ladder: "250ms 500ms 1s",
        margin: Duration::from_millis(50),
        ..Setup::new("reschedule")
    })
    .await;
    let client = w.client().await;
    let later = msg(&w, "later", "later");
    let earlier = msg(&w, "earlier", "earlier");
    client
        .schedule(later.clone(), When::After(Duration::from_millis(800)))
        .await
        .unwrap();
    client
        .schedule(earlier.clone(), When::After(4 * SEC))
        .await
        .unwrap();
    let moved_later = client
        .reschedule(later, When::After(3 * SEC))
        .await
        .unwrap();
    let at = SystemTime::now() + Duration::from_millis(1_500);
    let moved_earlier = client.reschedule(earlier, When::At(at)).await.unwrap();
    client
        .schedule(msg(&w, "sentinel", "sentinel"), When::After(5 * SEC))
        .await
        .unwrap();

    let got = w.recv_n(3, 10 * SEC).await;
    let bodies: Vec<&[u8]> = got.iter().map(|m| m.body.as_slice()).collect();
    assert_eq!(
        bodies,
        vec![&b"earlier"[..], b"later", b"sentinel"],
        "each once, in the new order"
    );
    for (m, due) in [
        (&got[0], moved_earlier.deliver_at),
        (&got[1], moved_later.deliver_at),
    ] {
        assert!(
            m.at_ms >= due && m.at_ms < due + 500,
            "{:?} arrived {} ms from its new due time",
            String::from_utf8_lossy(&m.body),
            m.at_ms as i64 - due as i64
        );
        assert_eq!(
            m.header("x-published-at"),
            Some(&AMQPValue::LongLongInt(if m.body == b"later" {
                moved_later.published_at
            } else {
                moved_earlier.published_at
            } as i64))
        );
    }
    assert_eq!(w.pending_in_queues().await, 0);
    assert_eq!(w.stats().snapshot().cancelled, 2, "both old copies dropped");
    client.close().await.unwrap();
    w.cleanup().await;
}

#[tokio::test]
async fn a_cancel_made_while_no_bridge_runs_is_honoured_by_a_fresh_instance() {
    let mut w = World::start(Setup {
        ladder: "500ms",
        margin: Duration::from_millis(50),
        ..Setup::new("cancel-restart")
    })
    .await;
    let client = w.client().await;
    client
        .schedule(msg(&w, "a", "a"), When::After(3 * SEC))
        .await
        .unwrap();
    wait_until("first hop", 5 * SEC, || w.stats().snapshot().hops >= 1).await;
    w.stop_bridge().await;
    // With no bridge running: cancel one in a level, and one never read by any bridge.
    client
        .schedule(msg(&w, "b", "b"), When::After(2 * SEC))
        .await
        .unwrap();
    client.cancel("a").await.unwrap();
    client.cancel("b").await.unwrap();
    client
        .schedule(msg(&w, "sentinel", "sentinel"), When::After(4 * SEC))
        .await
        .unwrap();
    w.start_bridge().await;
    let stats = w.stats();
    assert_eq!(
        stats.snapshot().tombstones,
        2,
        "read from the stream before ready"
    );
    only_sentinel_arrives(&mut w, 10 * SEC).await;
    assert_eq!(stats.snapshot().cancelled, 2);
    client.close().await.unwrap();
    w.cleanup().await;
}

#[tokio::test]
async fn two_instances_both_honour_cancels() {
    let mut w = World::start(Setup {
        ladder: "250ms 500ms",
        margin: Duration::from_millis(50),
        ..Setup::new("cancel-two")
    })
    .await;
    let second_bridge = w.spawn_bridge().await;
    let second = second_bridge.stats();
    let first = w.stats();
    let client = w.client().await;
    for i in 0..40 {
        client
            .schedule(
                msg(&w, &format!("m{i}"), &format!("m{i}")),
                When::After(3 * SEC),
            )
            .await
            .unwrap();
    }
    for i in (0..40).step_by(2) {
        client.cancel(&format!("m{i}")).await.unwrap();
    }
    let got = w.recv_n(20, 10 * SEC).await;
    let mut ids: Vec<String> = got
        .iter()
        .map(|m| String::from_utf8_lossy(&m.body).into_owned())
        .collect();
    ids.sort();
    let mut want: Vec<String> = (1..40).step_by(2).map(|i| format!("m{i}")).collect();
    want.sort();
    assert_eq!(ids, want, "exactly the uncancelled ones");
    wait_until("20 copies dropped", 5 * SEC, || {
        first.snapshot().cancelled + second.snapshot().cancelled == 20
    })
    .await;
    assert!(
        first.snapshot().consumed > 0 && second.snapshot().consumed > 0,
        "both instances took work"
    );
    client
        .schedule(
            msg(&w, "sentinel", "sentinel"),
            When::After(Duration::from_millis(500)),
        )
        .await
        .unwrap();
    only_sentinel_arrives(&mut w, 5 * SEC).await;
    second_bridge
        .stop()
        .await
        .expect("the second bridge stops cleanly");
    client.close().await.unwrap();
    w.cleanup().await;
}

/// Waits until the one tombstone is live, then gone; gives how long after `cancelled_at`
/// (epoch ms) it left memory.
async fn tombstone_lifetime(stats: &Stats, cancelled_at: u64) -> u64 {
    wait_until("the tombstone is live", 5 * SEC, || {
        stats.snapshot().tombstones == 1
    })
    .await;
    wait_until("the tombstone leaves", 10 * SEC, || {
        stats.snapshot().tombstones == 0
    })
    .await;
    now_ms() - cancelled_at
}

#[tokio::test]
async fn old_tombstones_leave_memory() {
    // Max delay 2 s plus 1 s grace: a tombstone is kept 3 s after its cancel.
    let mut w = World::start(Setup {
        max_delay: Duration::from_secs(2),
        cancel_grace: Duration::from_secs(1),
        ..Setup::new("cancel-expiry")
    })
    .await;
    let stats = w.stats();
    let client = w.client().await;
    let cancelled = client.cancel("gone-soon").await.unwrap();
    let left_after = tombstone_lifetime(&stats, cancelled.cancelled_at).await;
    assert!(
        (3_000..4_000).contains(&left_after),
        "left {left_after} ms after the cancel, expected about 3000"
    );
    // A fresh instance reading the stream from the start does not load it again.
    w.stop_bridge().await;
    w.start_bridge().await;
    assert_eq!(w.stats().snapshot().tombstones, 0);
    client.close().await.unwrap();
    w.cleanup().await;
}

#[tokio::test]
async fn client_errors_are_typed_and_say_what_to_do() {
    use delay_bridge::client::Client;
    let mut w = World::without_bridge("client-errors").await;
    let client = w.client().await;
    let missing = format!("{}.no-such-exchange", w.prefix());
    let err = client
        .schedule(
            Message::new(missing.as_str(), "k", b"x".to_vec()),
            When::After(SEC),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(&err, ClientError::ExchangeMissing { exchange } if *exchange == missing),
        "{err}"
    );
    // The client keeps working after the broker closed that exchange's channel.
    let unbound = format!("{}.unbound", w.prefix());
    w.declare_extra_exchange(&unbound, lapin::ExchangeKind::Fanout)
        .await;
    let err = client
        .schedule(
            Message::new(unbound.as_str(), "k", b"x".to_vec()),
            When::After(SEC),
        )
        .await
        .unwrap_err();
    assert!(matches!(err, ClientError::Unroutable { .. }), "{err}");
    let err = client
        .reschedule(
            Message::new(w.ingress.as_str(), "k", b"x".to_vec()),
            When::After(SEC),
        )
        .await
        .unwrap_err();
    assert!(matches!(err, ClientError::NoMessageId), "{err}");
    let err = client.cancel(&"x".repeat(256)).await.unwrap_err();
    assert!(err.to_string().contains("255"), "{err}");
    let ok = client
        .schedule(msg(&w, "fine", "fine"), When::After(SEC))
        .await
        .expect("a good schedule still works");
    assert_eq!(ok.message_id, "fine");
    client.close().await.unwrap();

    let other = Client::connect(&broker_url(), &format!("{}-never-started", w.prefix()))
        .await
        .unwrap();
    let err = other.cancel("x").await.unwrap_err();
    assert!(matches!(err, ClientError::NoCancelStream { .. }), "{err}");
    assert!(err.to_string().contains("start the bridge"), "{err}");
    other.close().await.unwrap();
    let err = Client::connect("http://nope", "p")
        .await
        .err()
        .expect("bad url refused");
    assert!(matches!(err, ClientError::Url(_)), "{err}");
    w.cleanup().await;
}

/// Runs a `delay-bridge` command against the world's config; panics with its output on failure.
async fn cli(config: &ConfigFile, args: &[&str]) -> String {
    let out = config
        .command(&bridge_exe())
        .args(args)
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "delay-bridge {args:?}: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

#[tokio::test]
async fn the_cli_schedules_reschedules_and_cancels() {
    let mut w = World::start(Setup::new("cli")).await;
    let config = w.config_file(100);
    let config = &config;
    let said = cli(
        config,
        &[
            "schedule",
            "--message-id",
            "cli-moved",
            "-k",
            "rk.cli",
            "--delay",
            "3s",
            "-b",
            "first",
        ],
    )
    .await;
    assert!(said.contains("message id cli-moved"), "{said}");
    cli(
        config,
        &[
            "schedule",
            "--message-id",
            "cli-cancelled",
            "-k",
            "rk.cli",
            "--delay",
            "2s",
            "-b",
            "cancelled",
        ],
    )
    .await;
    let refused = config
        .command(&bridge_exe())
        .args(["reschedule", "cli-moved", "-k", "rk.cli", "--delay", "400d"])
        .output()
        .await
        .unwrap();
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success(),
        "a reschedule past max_delay: {said}"
    );
    assert!(said.contains("`delay-too-long`"), "{said}");
    let said = cli(
        config,
        &[
            "reschedule",
            "cli-moved",
            "-k",
            "rk.cli",
            "--delay",
            "500ms",
            "-b",
            "moved",
        ],
    )
    .await;
    assert!(said.contains("rescheduled"), "{said}");
    let said = cli(config, &["cancel", "cli-cancelled"]).await;
    assert!(
        said.contains("cancelled message id cli-cancelled"),
        "{said}"
    );
    cli(
        config,
        &[
            "schedule",
            "--message-id",
            "sentinel",
            "-k",
            "rk.cli",
            "--delay",
            "3500ms",
            "-b",
            "sentinel",
        ],
    )
    .await;
    let got = w.recv_n(2, 10 * SEC).await;
    assert_eq!(got[0].body, b"moved");
    assert_eq!(got[0].routing_key, "rk.cli");
    assert_eq!(
        got[1].body, b"sentinel",
        "the old and the cancelled copies never arrived"
    );
    assert_eq!(w.pending_in_queues().await, 0);
    assert_eq!(w.stats().snapshot().cancelled, 2);
    w.cleanup().await;
}

/// A reschedule that cannot take effect leaves the earlier copy where it was: a delay the
/// bridges would park (`delays.max_delay`) and an exchange that does not exist are refused
/// before the cancel. A refusal that only the publish after the cancel can see (an exchange
/// that routes nowhere) says that the earlier copy is cancelled.
#[tokio::test]
async fn a_reschedule_that_cannot_take_effect_is_refused_before_its_cancel() {
    const DAY: Duration = Duration::from_secs(86_400);
    let mut w = World::start(Setup::new("resched-refused")).await;
    let stats = w.stats();
    let client = w.client().await;
    client
        .schedule(msg(&w, "kept", "kept"), When::After(2 * SEC))
        .await
        .unwrap();
    let too_far = [
        When::After(400 * DAY),
        When::At(SystemTime::now() + 400 * DAY),
    ];
    for when in too_far {
        let err = client
            .reschedule(msg(&w, "kept", "moved too far"), when)
            .await
            .unwrap_err();
        assert!(matches!(err, ClientError::DelayTooLong { .. }), "{err}");
        assert!(err.to_string().contains("366d"), "{err}");
        let err = client
            .schedule(msg(&w, "far", "far"), when)
            .await
            .unwrap_err();
        assert!(matches!(err, ClientError::DelayTooLong { .. }), "{err}");
    }
    let missing = format!("{}.missing", w.prefix());
    let err = client
        .reschedule(
            Message::new(missing.as_str(), "rk.cancel", b"x".to_vec()).with_message_id("kept"),
            When::After(SEC),
        )
        .await
        .unwrap_err();
    assert!(matches!(err, ClientError::ExchangeMissing { .. }), "{err}");
    let got = w.recv_within(10 * SEC).await;
    assert_eq!(
        got.body, b"kept",
        "the refused reschedules cancelled nothing"
    );
    assert_eq!(stats.snapshot().cancelled, 0);

    // A client told of a shorter `max_delay` refuses past it.
    let strict = w.client().await.with_max_delay(SEC);
    let err = strict
        .schedule(msg(&w, "strict", "strict"), When::After(2 * SEC))
        .await
        .unwrap_err();
    assert!(matches!(err, ClientError::DelayTooLong { .. }), "{err}");
    strict.close().await.unwrap();

    let unbound = format!("{}.unbound", w.prefix());
    w.declare_extra_exchange(&unbound, lapin::ExchangeKind::Fanout)
        .await;
    client
        .schedule(msg(&w, "moved", "moved"), When::After(2 * SEC))
        .await
        .unwrap();
    let err = client
        .reschedule(
            Message::new(unbound.as_str(), "rk.cancel", b"x".to_vec()).with_message_id("moved"),
            When::After(SEC),
        )
        .await
        .unwrap_err();
    match &err {
        ClientError::CancelledNotScheduled { message_id, source } => {
            assert_eq!(message_id, "moved");
            assert!(matches!(**source, ClientError::Unroutable { .. }), "{err}");
        }
        other => panic!("expected CancelledNotScheduled, got {other}"),
    }
    assert!(err.to_string().contains("is cancelled"), "{err}");
    client
        .schedule(msg(&w, "sentinel", "sentinel"), When::After(3 * SEC))
        .await
        .unwrap();
    only_sentinel_arrives(&mut w, 10 * SEC).await;
    client.close().await.unwrap();
    w.cleanup().await;
}

/// A cancel that says when its message was due leaves memory at that time plus the grace
/// (1 s here), not `max_delay` (366 d) plus the grace after the cancel.
#[tokio::test]
async fn a_cancel_that_names_the_due_time_leaves_memory_after_it() {
    let w = World::start(Setup {
        cancel_grace: Duration::from_secs(1),
        ..Setup::new("cancel-due")
    })
    .await;
    let stats = w.stats();
    let client = w.client().await;
    let due = SystemTime::now() + Duration::from_millis(500);
    let cancelled = client.cancel_due("due-soon", due).await.unwrap();
    let left_after = tombstone_lifetime(&stats, cancelled.cancelled_at).await;
    assert!(
        (1_500..2_500).contains(&left_after),
        "left {left_after} ms after the cancel, expected about 1500"
    );
    client.close().await.unwrap();
    w.cleanup().await;
}

/// A canceller whose clock runs an hour ahead cannot cancel a copy that entered after the
/// reading bridge's now plus its 1 s allowance (a reschedule published by a correct clock).
#[tokio::test]
async fn a_canceller_clock_ahead_does_not_cancel_a_later_reschedule() {
    use delay_bridge::cancel::{message_id, tombstone_properties};
    let mut w = World::start(Setup::new("cancel-clock")).await;
    let stats = w.stats();
    let now = now_ms();
    publish_to(
        &w.publisher,
        "",
        &w.config.names.cancel_stream(),
        b"",
        tombstone_properties(message_id("clock").unwrap(), now + 3_600_000, None),
    )
    .await;
    wait_until("the tombstone is read", 5 * SEC, || {
        stats.snapshot().tombstones == 1
    })
    .await;
    // `x-published-at` counts at most as the bridge's now plus the allowance, as the
    // cancel's time does. So the reschedule comes once the clock allowance has passed.
    let read_at = now_ms();
    tokio::time::sleep(Duration::from_millis(
        delay_bridge::cancel::CLOCK_ALLOWANCE_MS + 100,
    ))
    .await;
    let rescheduled = headers(vec![
        ("x-delay", AMQPValue::LongLongInt(300)),
        (
            "x-published-at",
            AMQPValue::LongLongInt(read_at as i64 + 3_600_000),
        ),
    ]);
    w.publish(
        "rk.clock",
        b"rescheduled",
        lapin::BasicProperties::default()
            .with_message_id("clock".into())
            .with_headers(rescheduled),
    )
    .await;
    let got = w.recv_within(5 * SEC).await;
    assert_eq!(got.body, b"rescheduled");
    w.cleanup().await;
}
