//! `delay-bridge status` shows what the topology holds: messages per level, the work
//! queue's consumers, parked messages by reason (left parked), the cancel stream.

use std::time::{Duration, Instant};

use delay_bridge::naming::Names;
use delay_bridge::sandbox::process::ConfigFile;
use lapin::BasicProperties;

use crate::support::*;

const SEC: Duration = Duration::from_secs(1);

/// The output of `delay-bridge status` with `args` on `config`.
async fn status(config: &ConfigFile, args: &[&str]) -> String {
    let mut command = vec!["status"];
    command.extend_from_slice(args);
    let (ok, stdout) = run_command(config, &command).await;
    assert!(ok, "status failed");
    stdout
}

/// `status --json`, read until `ready` holds for it or the deadline passes.
async fn status_when(
    config: &ConfigFile,
    within: Duration,
    ready: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let deadline = Instant::now() + within;
    loop {
        let json: serde_json::Value =
            serde_json::from_str(&status(config, &["--json"]).await).expect("JSON");
        if ready(&json) {
            return json;
        }
        assert!(Instant::now() < deadline, "not within {within:?}: {json:#}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn status_shows_levels_consumers_and_parked_reasons_and_leaves_them_parked() {
    let w = World::start(Setup {
        ladder: "100ms 200ms 400ms 800ms 10m",
        watch_parked: false,
        ..Setup::new("status")
    })
    .await;
    for _ in 0..3 {
        w.publish("rk.status.later", b"later", with_delay(30 * 60 * 1000))
            .await;
    }
    for i in 0..2 {
        w.publish(&format!("nobody.status.{i}"), b"x", with_delay(100))
            .await;
    }
    let bad = BasicProperties::default().with_headers(headers(vec![("x-delay", text("soon"))]));
    w.publish("rk.status.bad", b"bad", bad).await;
    let client = w.client().await;
    for id in ["cancelled-1", "cancelled-2"] {
        client.cancel(id).await.expect("cancelled");
    }
    let config = w.config_file(4000);

    let level = |json: &serde_json::Value, level: &str| {
        json["levels"]
            .as_array()
            .and_then(|levels| levels.iter().find(|l| l["level"] == level))
            .map(|l| l["messages"].as_u64().unwrap_or(0))
    };
    let json = status_when(&config, 30 * SEC, |json| {
        level(json, "10m") == Some(3) && json["parked"]["messages"] == 3
    })
    .await;
    assert_eq!(json["work"]["consumers"], 1, "{json:#}");
    assert_eq!(json["pending_in_levels"], 3, "{json:#}");
    assert_eq!(json["parked"]["read"], 3, "{json:#}");
    assert_eq!(json["parked"]["by_reason"]["unroutable"], 2, "{json:#}");
    assert_eq!(json["parked"]["by_reason"]["bad-delay"], 1, "{json:#}");
    assert_eq!(
        json["cancel_stream"]["name"],
        w.config.names.cancel_stream(),
        "{json:#}"
    );
    // Two cancels, and the marker the bridge appended when it started.
    assert_eq!(json["cancel_entries"]["tombstones"], 2, "{json:#}");
    assert_eq!(json["cancel_entries"]["markers"], 1, "{json:#}");
    assert_eq!(json["cancel_entries"]["complete"], true, "{json:#}");

    // Reading them left them parked; the table says the same.
    let table = status(&config, &[]).await;
    assert!(table.contains("level 10m"), "{table}");
    assert!(
        !table.contains("level 100ms"),
        "empty levels are not shown:\n{table}"
    );
    assert!(table.contains("unroutable"), "{table}");
    assert!(table.contains("(3 of 3 read; they stay parked)"), "{table}");
    assert!(
        table.contains("cancel stream: 2 tombstones, 1 catch-up markers"),
        "{table}"
    );
    assert_eq!(w.queue_depth(&w.config.names.parked_queue()).await, 3);
    w.cleanup().await;
}

/// Reading the parked queue hands its messages back: read 25 times, more than RabbitMQ
/// 4.x's default delivery limit of quorum queues (20), they are all still parked.
#[tokio::test]
async fn reading_a_quorum_parked_queue_many_times_loses_nothing() {
    let w = World::start(Setup {
        queue_type: "quorum",
        watch_parked: false,
        ..Setup::new("status-peek")
    })
    .await;
    for i in 0..3 {
        w.publish(&format!("nobody.peek.{i}"), b"x", with_delay(0))
            .await;
    }
    let parked_queue = w.config.names.parked_queue();
    let deadline = Instant::now() + 30 * SEC;
    while w.queue_depth(&parked_queue).await < 3 {
        assert!(Instant::now() < deadline, "3 parked within 30 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for round in 0..25 {
        let (read, held) = delay_bridge::parked::peek(&w.config, 100)
            .await
            .expect("the parked queue is read");
        assert_eq!((read.len(), held), (3, 3), "round {round}");
        // The closed channel's messages are back before the next read counts them.
        let deadline = Instant::now() + 10 * SEC;
        while w.queue_depth(&parked_queue).await < 3 {
            assert!(
                Instant::now() < deadline,
                "round {round}: not back within 10 s"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    w.cleanup().await;
}

/// An entry of the cancel stream the AMQP client cannot read (a header name that is not
/// UTF-8, appended by hand) stays in the stream until its retention drops it. `status`
/// counts it as unreadable beside the entries it can read, instead of failing while it
/// lasts.
#[tokio::test]
async fn status_counts_a_cancel_stream_entry_it_cannot_read_and_the_rest() {
    let w = World::start(Setup {
        watch_parked: false,
        ..Setup::new("status-unreadable")
    })
    .await;
    let client = w.client().await;
    client.cancel("before").await.expect("cancelled");
    crate::support::raw::publish_unreadable_into(
        &broker_url(),
        &w.config.names.cancel_stream(),
        b"not a tombstone anyone reads",
    )
    .await;
    client.cancel("after").await.expect("cancelled");
    let config = w.config_file(4000);

    let json = status_when(&config, 30 * SEC, |json| {
        json["cancel_entries"]["unreadable"] == 1
    })
    .await;
    assert_eq!(json["cancel_entries"]["tombstones"], 2, "{json:#}");
    // One marker per session start: the entry costs the bridge a session, which may have
    // started again by now.
    assert!(
        json["cancel_entries"]["markers"].as_u64() >= Some(1),
        "{json:#}"
    );
    assert_eq!(json["cancel_entries"]["invalid"], 0, "{json:#}");
    assert_eq!(json["cancel_entries"]["complete"], true, "{json:#}");
    let table = status(&config, &[]).await;
    assert!(
        table.contains("cancel stream: 2 tombstones, ")
            && table.contains(" markers, 1 unreadable\n"),
        "{table}"
    );
    client.close().await.unwrap();
    w.cleanup().await;
}

/// `status` and `parked list` for a prefix no bridge has declared say which queue is
/// missing and what to check, once, without the AMQP client's own log lines, and declare
/// nothing.
#[tokio::test]
async fn status_and_parked_for_a_prefix_no_bridge_declared_say_what_to_check() {
    let w = World::start(Setup {
        start_bridge: false,
        ..Setup::new("status-none")
    })
    .await;
    let never = format!("{}-never", w.prefix());
    let config = w.config_file_with(|config| config.names = Names::new(&never));
    for (args, queue) in [
        (&["status"][..], format!("`{never}.work`")),
        (&["parked", "list"][..], format!("`{never}.parked`")),
    ] {
        let out = config
            .command(&bridge_exe())
            .args(args)
            .output()
            .await
            .expect("delay-bridge runs");
        let said = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded: {said}");
        assert!(said.contains(&queue), "{args:?}: {said}");
        assert!(said.contains("does not exist"), "{args:?}: {said}");
        assert!(said.contains("check the prefix"), "{args:?}: {said}");
        assert!(!said.contains("lapin"), "{args:?}: {said}");
        assert_eq!(said.matches("NOT_FOUND").count(), 0, "{args:?}: {said}");
    }
    for queue in [format!("{never}.work"), format!("{never}.parked")] {
        assert!(w.counts(&queue).await.is_err(), "`{queue}` was declared");
    }
    w.cleanup().await;
}

/// `status` returns within its bound while the cancel stream is written 100 times a second
/// (steady cancels, as a shop with order timeouts writes all day): it reads up to the end
/// the stream had when it began, and counts at least what was there.
#[tokio::test]
async fn status_returns_while_the_cancel_stream_is_written() {
    use delay_bridge::cancel::{message_id, tombstone_properties};
    let w = World::start(Setup::new("status-busy-stream")).await;
    let stream = w.config.names.cancel_stream();
    let writer = w.confirm_channel().await;
    let stop = tokio_util::sync::CancellationToken::new();
    let written = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let appending = {
        let (stop, written) = (stop.clone(), written.clone());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(10));
            for n in 0..6_000u64 {
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = tick.tick() => {}
                }
                let id = message_id(&format!("busy-{n}")).unwrap();
                publish_to(
                    &writer,
                    "",
                    &stream,
                    b"",
                    tombstone_properties(id, delay_bridge::clock::now_ms(), None),
                )
                .await;
                written.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        })
    };
    wait_until("200 cancels appended", 10 * SEC, || {
        written.load(std::sync::atomic::Ordering::Relaxed) >= 200
    })
    .await;
    let config = w.config_file(4000);
    for _ in 0..2 {
        let before = written.load(std::sync::atomic::Ordering::Relaxed);
        let started = Instant::now();
        let out = tokio::time::timeout(5 * SEC, status(&config, &["--json"]))
            .await
            .expect("status returns within 5 s while the stream is written");
        let took = started.elapsed();
        let json: serde_json::Value = serde_json::from_str(&out).expect("JSON");
        let entries = &json["cancel_entries"];
        println!("status took {took:?}: {entries}");
        assert_eq!(entries["complete"], true, "{entries}");
        assert!(
            entries["tombstones"].as_u64().unwrap() >= before,
            "{entries} with {before} written before status began"
        );
    }
    stop.cancel();
    appending.await.unwrap();
    w.cleanup().await;
}
