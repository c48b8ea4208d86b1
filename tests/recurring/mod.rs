//! Recurring schedules through a running bridge: occurrences in order with their numbers and
//! due times, the end by count, a cancel that stops a schedule for good, a schedule that
//! replaces the one running under its id, refusals parked `bad-schedule`, and a lost
//! session that doubles at most one occurrence and never the schedule.

use std::collections::BTreeMap;
use std::time::Duration;

use delay_bridge::contract::ParkReason;
use delay_bridge::recurring::header;
use delay_bridge::sandbox::Received;
use lapin::BasicProperties;
use lapin::types::AMQPValue;

use crate::support::*;

const SEC: Duration = Duration::from_secs(1);

/// A schedule named `id` with these `x-repeat-*` (or other) headers.
fn schedule(id: &str, entries: Vec<(&str, AMQPValue)>) -> BasicProperties {
    BasicProperties::default()
        .with_message_id(id.into())
        .with_headers(headers(entries))
}

fn integer(received: &Received, name: &str) -> u64 {
    match received.header(name) {
        Some(AMQPValue::LongLongInt(v)) => *v as u64,
        other => panic!("{name}: {other:?} on {:?}", received.properties),
    }
}

#[tokio::test]
async fn a_schedule_delivers_its_occurrences_in_order_and_ends_at_its_count() {
    occurrences_in_order_to_the_count(Setup::new("recurring-count")).await;
}

/// The same through the defaults' bundled hops (100-ms windows, fine levels).
#[tokio::test]
async fn a_schedule_runs_through_bundled_hops() {
    occurrences_in_order_to_the_count(Setup {
        ladder: "1s 2s",
        hop_window: Some(Duration::from_millis(100)),
        bundle_hops: Some(true),
        ..Setup::new("recurring-bundled")
    })
    .await;
}

/// A schedule every second (the smallest recurring interval) for three occurrences, the
/// first 300 ms after it is published:
/// three deliveries numbered 1 to 3, each not before its due time, then nothing.
async fn occurrences_in_order_to_the_count(setup: Setup<'_>) {
    let mut w = World::start(setup).await;
    w.publish(
        "rk.tick",
        b"tick",
        schedule(
            "tick",
            vec![
                (header::EVERY, text("1s")),
                (header::COUNT, AMQPValue::LongLongInt(3)),
                ("x-delay", AMQPValue::LongLongInt(300)),
            ],
        ),
    )
    .await;
    let mut dues = Vec::new();
    for number in 1..=3 {
        let got = w.recv_within(10 * SEC).await;
        assert_eq!(got.body, b"tick");
        assert_eq!(got.routing_key, "rk.tick");
        assert_eq!(integer(&got, header::OCCURRENCE), number);
        assert_eq!(got.header(header::OCCURRENCE_LATE), None);
        let due = integer(&got, header::OCCURRENCE_DUE);
        assert!(got.at_ms + 50 >= due, "not before its due time");
        dues.push(due);
    }
    assert_eq!(dues[1] - dues[0], 1_000);
    assert_eq!(dues[2] - dues[1], 1_000);
    w.assert_quiet(2 * SEC).await;
    assert_eq!(w.pending_in_queues().await, 0, "nothing left behind");
    w.cleanup().await;
}

/// The bridge is stopped for five periods and more: when it starts again, one overdue
/// occurrence is delivered, marked late with how many were skipped, and the schedule goes
/// on from then, on time: no storm of the missed ones.
#[tokio::test]
async fn after_an_outage_one_late_occurrence_stands_for_the_missed_ones() {
    const PERIOD_MS: u64 = 1_000;
    let mut w = World::start(Setup::new("recurring-outage")).await;
    w.publish(
        "rk.outage",
        b"beat",
        schedule("beat", vec![(header::EVERY, text("1s"))]),
    )
    .await;
    let before = w.recv_within(10 * SEC).await;
    let last_number = integer(&before, header::OCCURRENCE);
    w.stop_bridge().await;
    let stopped_at = delay_bridge::clock::now_ms();
    // Five periods and more without a bridge (a wall-clock outage, not a wait on an event).
    tokio::time::sleep(Duration::from_millis(6 * PERIOD_MS)).await;
    let outage_ms = delay_bridge::clock::now_ms() - stopped_at;
    w.start_bridge().await;
    let mut late = None;
    let mut after = Vec::new();
    while after.len() < 4 {
        let got = w.recv_within(20 * SEC).await;
        let number = integer(&got, header::OCCURRENCE);
        if number <= last_number + 1 && got.header(header::OCCURRENCE_LATE).is_none() {
            // Due before the stop, delivered at it: not the late one.
            continue;
        }
        match got.header(header::OCCURRENCE_LATE) {
            Some(AMQPValue::Boolean(true)) => {
                assert!(late.is_none(), "a second late occurrence: {number}");
                late = Some((number, integer(&got, header::SKIPPED)));
            }
            other => {
                assert!(
                    late.is_some(),
                    "occurrence {number} before the late one ({other:?})"
                );
                after.push(number);
            }
        }
    }
    let (late_number, skipped) = late.expect("one late occurrence");
    println!(
        "outage {outage_ms} ms: occurrence {late_number} late, {skipped} skipped; then {after:?}"
    );
    assert!(
        skipped >= outage_ms / PERIOD_MS - 2,
        "{skipped} skipped in {outage_ms} ms"
    );
    assert_eq!(
        after[0],
        late_number + skipped + 1,
        "the schedule goes on after the skipped ones"
    );
    for pair in after.windows(2) {
        assert_eq!(pair[1], pair[0] + 1);
    }
    let client = w.client().await;
    client.cancel("beat").await.expect("cancelled");
    client.close().await.expect("closed");
    w.cleanup().await;
}

#[tokio::test]
async fn a_cancelled_schedule_never_comes_back() {
    let mut w = World::start(Setup::new("recurring-cancel")).await;
    w.publish(
        "rk.cancel",
        b"again",
        schedule("again", vec![(header::EVERY, text("1s"))]),
    )
    .await;
    for number in 1..=2 {
        assert_eq!(
            integer(&w.recv_within(10 * SEC).await, header::OCCURRENCE),
            number
        );
    }
    let client = w.client().await;
    client.cancel("again").await.expect("cancelled");
    // What was already on its way may still arrive; nothing after it.
    let quiet_from = delay_bridge::clock::now_ms() + 500;
    let until = tokio::time::Instant::now() + 4 * SEC;
    while let Ok(Some(got)) =
        tokio::time::timeout_at(until, async { Some(w.recv_within(10 * SEC).await) }).await
    {
        assert!(
            got.at_ms < quiet_from,
            "occurrence {} came {} ms after the cancel",
            integer(&got, header::OCCURRENCE),
            got.at_ms + 500 - quiet_from
        );
    }
    client.close().await.expect("closed");
    w.cleanup().await;
}

#[tokio::test]
async fn a_schedule_published_again_under_its_id_replaces_the_running_one() {
    let mut w = World::start(Setup::new("recurring-replace")).await;
    let every = || vec![(header::EVERY, text("1s"))];
    w.publish("rk.r", b"first", schedule("report", every()))
        .await;
    assert_eq!(w.recv_within(10 * SEC).await.body, b"first");
    w.publish("rk.r", b"second", schedule("report", every()))
        .await;
    let mut seconds = 0;
    let until = tokio::time::Instant::now() + 6 * SEC;
    while tokio::time::Instant::now() < until {
        let got = w.recv_within(10 * SEC).await;
        match got.body.as_slice() {
            b"second" => seconds += 1,
            b"first" => assert_eq!(seconds, 0, "the replaced schedule after its replacement"),
            other => panic!("{other:?}"),
        }
    }
    assert!(seconds >= 4, "{seconds} occurrences of the replacement");
    let client = w.client().await;
    client.cancel("report").await.expect("cancelled");
    client.close().await.expect("closed");
    w.cleanup().await;
}

#[tokio::test]
async fn schedules_the_bridge_refuses_are_parked_bad_schedule() {
    let mut w = World::start(Setup::new("recurring-bad")).await;
    let cases: Vec<(&str, BasicProperties)> = vec![
        (
            "unknown zone",
            schedule(
                "zone",
                vec![
                    (header::CRON, text("0 8 * * *")),
                    (header::TIME_ZONE, text("Mars/Olympus_Mons")),
                ],
            ),
        ),
        (
            "closer than the smallest recurring interval",
            schedule("fast", vec![(header::EVERY, text("500ms"))]),
        ),
        (
            "no message_id",
            BasicProperties::default().with_headers(headers(vec![(header::EVERY, text("1s"))])),
        ),
        (
            "not a cron expression",
            schedule("cron", vec![(header::CRON, text("every morning"))]),
        ),
    ];
    for (what, properties) in cases {
        w.publish("rk.bad", what.as_bytes(), properties).await;
        let parked = w.parked_within(10 * SEC).await;
        assert_eq!(parked.body, what.as_bytes());
        assert_eq!(
            parked.header("delay-bridge-reason"),
            Some(&text(ParkReason::BadSchedule.as_str())),
            "{what}"
        );
    }
    w.assert_quiet(SEC).await;
    w.cleanup().await;
}

/// The bridge's sessions are cut twice while a schedule runs, the second time once the
/// schedule runs steadily again: a cut delivers again the occurrences whose delivery it
/// interrupted (delivered, not yet acknowledged: one, or two when the broker closes the
/// bridge's connections one after the other and the publishing one carries on a moment),
/// but the schedule itself never runs twice: after the cuts every occurrence comes once,
/// in order. Without successor tombstones the same test sees every later occurrence two or
/// three times.
#[tokio::test]
async fn a_lost_session_doubles_at_most_one_occurrence_and_never_the_schedule() {
    let mut w = World::start(Setup::new("recurring-cut")).await;
    w.publish(
        "rk.cut",
        b"cut",
        schedule("cut", vec![(header::EVERY, text("1s"))]),
    )
    .await;
    let mut seen: BTreeMap<u64, u32> = BTreeMap::new();
    let mut record = |got: &Received| {
        *seen.entry(integer(got, header::OCCURRENCE)).or_default() += 1;
    };
    for cut in 0..2 {
        for _ in 0..6 {
            record(&w.recv_within(20 * SEC).await);
        }
        let closed = close_connections_named(&format!("delay-bridge {}", w.prefix()));
        assert_eq!(closed, 4, "cut {cut}: the bridge's connections");
    }
    // After the cuts: every occurrence once, in order.
    let mut after = Vec::new();
    while after.len() < 12 {
        let got = w.recv_within(20 * SEC).await;
        record(&got);
        after.push(integer(&got, header::OCCURRENCE));
    }
    let settled = &after[after.len() - 8..];
    for pair in settled.windows(2) {
        assert_eq!(pair[1], pair[0] + 1, "one chain of occurrences: {after:?}");
    }
    let doubled: Vec<_> = seen.iter().filter(|(_, n)| **n > 1).collect();
    assert!(doubled.len() <= 4, "doubled: {doubled:?} of {seen:?}");
    assert!(seen.values().all(|n| *n <= 2), "{seen:?}");
    let client = w.client().await;
    client.cancel("cut").await.expect("cancelled");
    client.close().await.expect("closed");
    w.cleanup().await;
}

/// A copy held at its delivery (its target nacks it: a queue full with `reject-publish`)
/// is given back by a cut session twice: the first redelivery is born again (its successor
/// tombstone written) and keeps retrying, the second still carries its old birth, which
/// that tombstone names. It must be born again once more, not dropped: once the target
/// takes messages again, the schedule goes on.
#[tokio::test]
async fn a_copy_given_back_twice_in_a_row_keeps_its_schedule() {
    use lapin::options::{QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions};
    let mut w = World::start(Setup::new("recurring-twice")).await;
    let stats = w.stats();
    let full = format!("{}.full", w.prefix());
    let ch = w.conn.create_channel().await.unwrap();
    let mut args = lapin::types::FieldTable::default();
    args.insert("x-max-length".into(), AMQPValue::LongLongInt(0));
    args.insert("x-overflow".into(), text("reject-publish"));
    ch.queue_declare(full.as_str().into(), QueueDeclareOptions::default(), args)
        .await
        .unwrap();
    w.adopt_queue(&full);
    ch.queue_bind(
        full.as_str().into(),
        w.target.as_str().into(),
        "rk.twice".into(),
        QueueBindOptions::default(),
        lapin::types::FieldTable::default(),
    )
    .await
    .unwrap();
    w.publish(
        "rk.twice",
        b"twice",
        schedule("twice", vec![(header::EVERY, text("1s"))]),
    )
    .await;
    let nacked = |stats: &std::sync::Arc<delay_bridge::bridge::Stats>| stats.snapshot().nacks;
    let name = format!("delay-bridge {}", w.prefix());
    for cut in 0..2 {
        let before = nacked(&stats);
        wait_until("the held occurrence is retried", 20 * SEC, || {
            nacked(&stats) > before
        })
        .await;
        assert!(close_connections_named(&name) > 0, "cut {cut}");
        wait_for_consumers(&w, 1, 20 * SEC).await;
    }
    let before = nacked(&stats);
    wait_until("the schedule's copy is still retried", 20 * SEC, || {
        nacked(&stats) > before
    })
    .await;
    ch.queue_delete(full.as_str().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    // Each nacked attempt also reached the target's own queue (a queue that refuses does
    // not unroute it from the others): occurrence 1 arrives once per attempt. Then the
    // schedule goes on.
    let deadline = std::time::Instant::now() + 20 * SEC;
    loop {
        let number = integer(&w.recv_within(20 * SEC).await, header::OCCURRENCE);
        if number >= 3 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the schedule stopped at {number}"
        );
    }
    let client = w.client().await;
    client.cancel("twice").await.expect("cancelled");
    client.close().await.expect("closed");
    w.cleanup().await;
}

/// The typed client: `schedule_every` to a count, and what it refuses before publishing.
#[tokio::test]
async fn the_typed_client_schedules_every_and_cron_and_refuses_what_bridges_would() {
    use delay_bridge::client::{ClientError, Message, Repeat};
    let mut w = World::start(Setup::new("recurring-client")).await;
    let client = w.client().await;
    let ingress = w.ingress.clone();
    let message =
        |id: &str| Message::new(ingress.as_str(), "rk.client", b"c".to_vec()).with_message_id(id);
    let twice = Repeat {
        count: Some(2),
        ..Repeat::default()
    };
    client
        .schedule_every(message("every"), Duration::from_secs(1), twice)
        .await
        .expect("scheduled");
    for number in 1..=2 {
        assert_eq!(
            integer(&w.recv_within(10 * SEC).await, header::OCCURRENCE),
            number
        );
    }
    w.assert_quiet(SEC).await;
    let refused = client
        .schedule_cron(
            message("cron"),
            "0 8 * * *",
            "Mars/Olympus_Mons",
            Repeat::default(),
        )
        .await;
    assert!(
        matches!(refused, Err(ClientError::BadSchedule(_))),
        "{refused:?}"
    );
    let refused = client
        .schedule_cron(message("cron"), "not cron", "UTC", Repeat::default())
        .await;
    assert!(
        matches!(refused, Err(ClientError::BadSchedule(_))),
        "{refused:?}"
    );
    let refused = client
        .schedule_every(
            message("fast"),
            Duration::from_millis(500),
            Repeat::default(),
        )
        .await;
    assert!(
        matches!(refused, Err(ClientError::BadSchedule(_))),
        "below the smallest recurring interval: {refused:?}"
    );
    let no_id = Message::new(ingress.as_str(), "rk.client", b"c".to_vec());
    let refused = client
        .schedule_every(no_id, Duration::from_secs(1), Repeat::default())
        .await;
    assert!(
        matches!(refused, Err(ClientError::NoMessageId)),
        "{refused:?}"
    );
    client.close().await.expect("closed");
    w.cleanup().await;
}

/// `delay-bridge schedule --every` and `--cron --tz`, each to a count.
#[tokio::test]
async fn the_cli_schedules_every_and_cron() {
    let mut w = World::start(Setup::new("recurring-cli")).await;
    let config = w.config_file(100);
    for args in [
        vec!["--every", "1s"],
        vec!["--cron", "* * * * * *", "--tz", "Europe/Berlin"],
    ] {
        let mut command = config.command(&bridge_exe());
        command
            .args([
                "schedule",
                "--message-id",
                "cli-tick",
                "-k",
                "rk.cli",
                "-b",
                "tick",
            ])
            .args(&args)
            .args(["--count", "2"]);
        let out = command.output().await.expect("the command ran");
        let said = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && said.contains("first occurrence"),
            "{args:?}: {said}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        for number in 1..=2 {
            let got = w.recv_within(10 * SEC).await;
            assert_eq!(got.body, b"tick");
            assert_eq!(integer(&got, header::OCCURRENCE), number, "{args:?}");
        }
        w.assert_quiet(1500 * Duration::from_millis(1)).await;
    }
    w.cleanup().await;
}

/// A bridge process killed (SIGKILL) right after an occurrence arrived, twice, and started
/// again: each crash delivers again at most the one occurrence it interrupted, and after
/// them every occurrence comes once, in order.
#[tokio::test]
async fn a_crash_doubles_at_most_one_occurrence_and_never_the_schedule() {
    let mut w = World::without_bridge("recurring-crash").await;
    let config = w.config_file(1_000);
    let mut bridge = spawn_process(&config);
    wait_for_consumers(&w, 1, 20 * SEC).await;
    w.publish(
        "rk.crash",
        b"crash",
        schedule("crash", vec![(header::EVERY, text("1s"))]),
    )
    .await;
    let mut seen: BTreeMap<u64, u32> = BTreeMap::new();
    let mut record = |got: &Received| {
        *seen.entry(integer(got, header::OCCURRENCE)).or_default() += 1;
    };
    for _ in 0..2 {
        for _ in 0..4 {
            record(&w.recv_within(20 * SEC).await);
        }
        bridge.kill9().await;
        bridge = spawn_process(&config);
        wait_for_consumers(&w, 1, 20 * SEC).await;
    }
    let mut after = Vec::new();
    while after.len() < 10 {
        let got = w.recv_within(20 * SEC).await;
        record(&got);
        after.push(integer(&got, header::OCCURRENCE));
    }
    for pair in after[after.len() - 6..].windows(2) {
        assert_eq!(pair[1], pair[0] + 1, "one chain of occurrences: {after:?}");
    }
    let doubled: Vec<_> = seen.iter().filter(|(_, n)| **n > 1).collect();
    println!("crashes: doubled {doubled:?} of {seen:?}");
    assert!(doubled.len() <= 2, "doubled: {doubled:?} of {seen:?}");
    assert!(seen.values().all(|n| *n <= 2), "{seen:?}");
    let client = w.client().await;
    client.cancel("crash").await.expect("cancelled");
    client.close().await.expect("closed");
    let status = bridge.terminate(20 * SEC).await.expect("it stops");
    assert!(status.success(), "exit status {status:?}");
    w.cleanup().await;
}
