//! `delay-bridge parked list|replay|purge`: filters select, a dry run changes nothing,
//! replay sends messages back through the bridge to their target, purge needs a filter,
//! and a replay killed midway loses nothing.

use std::collections::HashSet;
use std::process::Stdio;
use std::time::{Duration, Instant};

use delay_bridge::sandbox::process::ConfigFile;
use lapin::BasicProperties;
use lapin::options::QueueBindOptions;
use lapin::types::FieldTable;

use crate::support::*;

const SEC: Duration = Duration::from_secs(1);

/// `delay-bridge parked <args>` on `config`: its exit success and stdout.
async fn parked(config: &ConfigFile, args: &[&str]) -> (bool, String) {
    let mut command = vec!["parked"];
    command.extend_from_slice(args);
    run_command(config, &command).await
}

/// `parked <args> --json`, parsed.
async fn parked_json(config: &ConfigFile, args: &[&str]) -> (bool, serde_json::Value) {
    let mut with_json = args.to_vec();
    with_json.push("--json");
    let (ok, stdout) = parked(config, &with_json).await;
    (ok, serde_json::from_str(&stdout).unwrap_or_default())
}

/// A received message's id.
fn id(message: &Received) -> String {
    message
        .properties
        .message_id()
        .as_ref()
        .map(|id| id.to_string())
        .unwrap_or_default()
}

fn selected(report: &serde_json::Value) -> usize {
    report["selected"].as_array().map_or(0, Vec::len)
}

fn done(report: &serde_json::Value) -> usize {
    report["selected"]
        .as_array()
        .map_or(0, |s| s.iter().filter(|o| o["done"] == true).count())
}

async fn wait_for_depth(w: &World, queue: &str, depth: u64, within: Duration) {
    let deadline = Instant::now() + within;
    loop {
        let now = w.queue_depth(queue).await;
        if now == depth {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{queue} held {now}, not {depth}, after {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Makes routing keys `nobody.#` reach the world's target queue.
async fn route_nobody_to_the_target(w: &World) {
    let ch = w.conn.create_channel().await.unwrap();
    ch.queue_bind(
        w.target_queue.as_str().into(),
        w.target.as_str().into(),
        "nobody.#".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
}

#[tokio::test]
async fn list_replay_and_purge_take_what_the_filter_selects() {
    let missing = format!("test-parked-missing-{:08x}", rand::random::<u32>());
    let mut w = World::start(Setup {
        watch_parked: false,
        extra_routes: vec![(format!("{missing}.in"), missing.clone())],
        ..Setup::new("parked")
    })
    .await;
    let parked_queue = w.config.names.parked_queue();
    for i in 0..3 {
        publish_to(
            &w.publisher,
            &format!("{missing}.in"),
            &format!("rk.missing.{i}"),
            b"missing",
            with_delay(0),
        )
        .await;
    }
    for i in 0..2 {
        let props = with_delay(0).with_message_id(format!("unroutable-{i}").into());
        w.publish(&format!("nobody.{i}"), b"unroutable", props)
            .await;
    }
    let bad = BasicProperties::default().with_headers(headers(vec![("x-delay", text("soon"))]));
    w.publish("rk.bad", b"bad", bad).await;
    wait_for_depth(&w, &parked_queue, 6, 30 * SEC).await;
    let config = w.config_file(4000);

    let (ok, list) = parked_json(&config, &["list", "--reason", "target-missing"]).await;
    assert!(ok);
    assert_eq!((selected(&list), done(&list)), (3, 0), "{list:#}");
    assert_eq!(list["selected"][0]["target"], missing.as_str());
    assert!(
        list["selected"][0]["parked_at"].as_u64().is_some(),
        "{list:#}"
    );
    let (ok, table) = parked(&config, &["list", "--message-id", "unroutable-1"]).await;
    assert!(
        ok && table.contains("unroutable-1") && table.contains("1 selected of 6 read"),
        "{table}"
    );

    // A dry run changes nothing; then the real replay, once the target routes them.
    let (ok, dry) = parked_json(&config, &["replay", "--reason", "unroutable", "--dry-run"]).await;
    assert!(ok);
    assert_eq!((selected(&dry), done(&dry)), (2, 0), "{dry:#}");
    wait_for_depth(&w, &parked_queue, 6, 5 * SEC).await;
    route_nobody_to_the_target(&w).await;
    let (ok, replay) = parked_json(&config, &["replay", "--reason", "unroutable"]).await;
    assert!(ok);
    assert_eq!(done(&replay), 2, "{replay:#}");
    let back = w.recv_n(2, 10 * SEC).await;
    let mut keys: Vec<&str> = back.iter().map(|m| m.routing_key.as_str()).collect();
    keys.sort_unstable();
    assert_eq!(
        keys,
        ["nobody.0", "nobody.1"],
        "delivered with their own routing keys"
    );
    assert!(
        back.iter()
            .all(|m| m.header("delay-bridge-reason").is_none()),
        "no parking headers on delivery"
    );
    wait_for_depth(&w, &parked_queue, 4, 5 * SEC).await;

    // A message parked before a bridge read it cannot be replayed: it stays, and says why.
    let (ok, refused) = parked_json(&config, &["replay", "--reason", "bad-delay"]).await;
    assert!(
        !ok,
        "a selected message that stayed parked fails the command"
    );
    assert!(
        refused["selected"][0]["note"]
            .as_str()
            .is_some_and(|n| n.contains("not replayable"))
    );
    wait_for_depth(&w, &parked_queue, 4, 5 * SEC).await;

    // Purge needs a filter; with one it removes what it selects, up to the limit.
    let (ok, _) = parked(&config, &["purge"]).await;
    assert!(!ok, "purge without a filter is refused");
    let (ok, purge) = parked_json(
        &config,
        &["purge", "--reason", "target-missing", "--limit", "2"],
    )
    .await;
    assert!(ok);
    assert_eq!(done(&purge), 2, "{purge:#}");
    wait_for_depth(&w, &parked_queue, 2, 5 * SEC).await;
    w.assert_quiet(Duration::from_millis(300)).await;
    w.cleanup().await;
}

/// 2 000 parked messages; a replay SIGKILLed once 500 of them arrived. Every message
/// is then delivered or still parked (some may be both: confirmed, not yet removed), and a
/// second replay delivers the rest.
#[tokio::test]
async fn a_replay_killed_midway_loses_nothing() {
    const N: usize = 2000;
    let mut w = World::start(Setup {
        watch_parked: false,
        ..Setup::new("parked-kill")
    })
    .await;
    let parked_queue = w.config.names.parked_queue();
    for i in 0..N {
        let props = with_delay(0).with_message_id(format!("m-{i}").into());
        w.publish(&format!("nobody.{i}"), b"x", props).await;
    }
    wait_for_depth(&w, &parked_queue, N as u64, 60 * SEC).await;
    route_nobody_to_the_target(&w).await;
    let config = w.config_file(4000);
    let limit = N.to_string();
    let mut replay = config.command(&bridge_exe());
    replay
        .args(["parked", "replay", "--limit", &limit])
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let mut child = replay.spawn().expect("the replay starts");
    let first = w.recv_n(N / 4, 30 * SEC).await;
    child.start_kill().expect("SIGKILL");
    child.wait().await.unwrap();
    let mut delivered: HashSet<String> = first.iter().map(id).collect();
    let mut copies = first.len();
    for m in w.drain_quiet(Duration::from_millis(500)).await {
        delivered.insert(id(&m));
        copies += 1;
    }
    let still_parked = w.queue_depth(&parked_queue).await as usize;
    let (left, _) = delay_bridge::parked::peek(&w.config, u16::MAX)
        .await
        .unwrap();
    let parked_ids: HashSet<String> = left.into_iter().filter_map(|m| m.message_id).collect();
    let missing = (0..N)
        .map(|i| format!("m-{i}"))
        .filter(|id| !delivered.contains(id) && !parked_ids.contains(id))
        .count();
    println!(
        "replay killed after {} arrivals: {} delivered ({copies} copies), {still_parked} still parked, {missing} missing",
        N / 4,
        delivered.len()
    );
    assert!(
        still_parked > 0,
        "the kill came after the replay had finished: nothing tested"
    );
    assert_eq!(missing, 0);

    let (ok, _) = parked(&config, &["replay", "--limit", &limit]).await;
    assert!(ok);
    for m in w.drain_quiet(Duration::from_secs(2)).await {
        delivered.insert(id(&m));
    }
    assert_eq!(
        delivered.len(),
        N,
        "every message delivered after the second replay"
    );
    assert_eq!(w.queue_depth(&parked_queue).await, 0);
    w.cleanup().await;
}

/// A message in the parked queue that lapin cannot read (a header name that is not UTF-8,
/// published straight into the queue) failed every `parked` command and `status`, until
/// the first command parked it again (a copy, at the queue's end). The queue is read on
/// the project's own connection now: the message is listed as `unreadable` as it came, a
/// list changes nothing, a replay leaves it, and `parked purge --reason unreadable`
/// removes it.
#[tokio::test]
async fn a_parked_message_the_client_cannot_read_is_listed_as_it_came_and_can_be_purged() {
    let w = World::start(Setup {
        watch_parked: false,
        ..Setup::new("parked-unreadable")
    })
    .await;
    let parked_queue = w.config.names.parked_queue();
    crate::support::raw::publish_unreadable_into(&broker_url(), &parked_queue, b"hostile").await;
    for i in 0..3 {
        w.publish(&format!("nobody.{i}"), b"unroutable", with_delay(0))
            .await;
    }
    wait_for_depth(&w, &parked_queue, 4, 30 * SEC).await;
    let config = w.config_file(4000);

    let (ok, purged) = parked_json(
        &config,
        &["purge", "--reason", "unroutable", "--limit", "2"],
    )
    .await;
    assert!(ok, "purge failed: {purged:#}");
    assert_eq!(done(&purged), 2, "{purged:#}");
    wait_for_depth(&w, &parked_queue, 2, 10 * SEC).await;

    let (ok, listed) = parked_json(&config, &["list"]).await;
    assert!(ok, "list failed");
    let selected = listed["selected"].as_array().expect("selected");
    let mut reasons: Vec<String> = selected
        .iter()
        .map(|o| o["reason"].as_str().unwrap_or("none").to_string())
        .collect();
    reasons.sort();
    assert_eq!(reasons, ["unreadable", "unroutable"], "{listed:#}");
    let unreadable = selected
        .iter()
        .find(|o| o["reason"] == "unreadable")
        .expect("the unreadable message");
    let detail = unreadable["detail"].as_str().unwrap_or_default();
    assert!(
        detail.contains("its properties") && !detail.contains("kept as bytes"),
        "listed as it came, not parked again: {listed:#}"
    );
    assert_eq!(unreadable["replayable"], false, "{listed:#}");
    assert_eq!(
        unreadable["routing_key"],
        parked_queue.as_str(),
        "{listed:#}"
    );

    let (_, replayed) = parked_json(&config, &["replay", "--reason", "unreadable"]).await;
    assert_eq!(done(&replayed), 0, "{replayed:#}");
    wait_for_depth(&w, &parked_queue, 2, 10 * SEC).await;

    let (ok, stdout) = run_command(&config, &["status", "--json"]).await;
    assert!(ok, "status failed");
    let status: serde_json::Value = serde_json::from_str(&stdout).expect("JSON");
    assert_eq!(status["parked"]["by_reason"]["unreadable"], 1, "{status:#}");

    let (ok, purged) = parked_json(&config, &["purge", "--reason", "unreadable"]).await;
    assert!(ok, "purge failed: {purged:#}");
    assert_eq!(done(&purged), 1, "{purged:#}");
    wait_for_depth(&w, &parked_queue, 1, 10 * SEC).await;
    w.cleanup().await;
}

/// `parked list` on a parked queue something keeps parking into reads what the queue held
/// when it began, then returns: it never chases the tail.
#[tokio::test]
async fn listing_a_parked_queue_that_keeps_growing_returns() {
    let w = World::start(Setup {
        watch_parked: false,
        start_bridge: false,
        ..Setup::new("parked-growing")
    })
    .await;
    let parked_queue = w.config.names.parked_queue();
    for i in 0..500 {
        let props = BasicProperties::default().with_message_id(format!("before-{i}").into());
        publish_to(&w.publisher, "", &parked_queue, b"parked", props).await;
    }
    wait_for_depth(&w, &parked_queue, 500, 30 * SEC).await;
    // A writer that parks a message every 2 ms for as long as the listing runs.
    let writer = w.confirm_channel().await;
    let stop = tokio_util::sync::CancellationToken::new();
    let writing = tokio::spawn({
        let stop = stop.clone();
        let parked_queue = parked_queue.clone();
        async move {
            let mut written = 0u64;
            while !stop.is_cancelled() && written < 20_000 {
                let props =
                    BasicProperties::default().with_message_id(format!("during-{written}").into());
                publish_to(&writer, "", &parked_queue, b"parked", props).await;
                written += 1;
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            written
        }
    });
    let config = w.config_file(4000);
    let began = Instant::now();
    // A filter nothing matches: every message the listing may read is read.
    let (ok, list) = parked_json(&config, &["list", "--message-id", "none-such"]).await;
    let took = began.elapsed();
    stop.cancel();
    let written = writing.await.unwrap();
    assert!(ok, "{list:#}");
    assert!(took < 10 * SEC, "parked list took {took:?}");
    let held = list["held"].as_u64().unwrap();
    let scanned = list["scanned"].as_u64().unwrap();
    assert!(
        (500..=500 + written).contains(&held),
        "held {held}, written during {written}: {list:#}"
    );
    assert_eq!(scanned, held, "{list:#}");
    assert_eq!(selected(&list), 0, "{list:#}");
    // Nothing was taken: what was parked is all still there.
    wait_for_depth(&w, &parked_queue, 500 + written, 30 * SEC).await;
    w.cleanup().await;
}
