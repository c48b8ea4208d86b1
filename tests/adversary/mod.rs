//! The adversary suite: a publisher is not an administrator. Each test runs a bridge with a
//! state key and two routes (the world's own, and `<prefix>.pay.in` → `<prefix>.payments`,
//! whose queue takes every routing key), and attacks it as a user holding exactly the
//! rights `delay-bridge permissions` prints for its role (a publisher, a canceller, an
//! operator), or, where the attack needs more than a publisher has, as a user who may write
//! to the work exchange. Each asserts that nothing reaches a queue it should not, nothing is
//! cancelled that should not be, what the stream holds stays bounded, and a genuine message
//! published alongside still arrives on time.

use std::time::Duration;

use delay_bridge::client::Client;
use delay_bridge::clock::now_ms;
use delay_bridge::config::{BrokerUrl, Route};
use delay_bridge::contract::signature::StateKeys;
use delay_bridge::contract::{bundle, header};
use delay_bridge::permissions::grants;
use delay_bridge::sandbox::process::ConfigFile;
use futures::StreamExt;
use lapin::options::{
    BasicConsumeOptions, BasicGetOptions, BasicQosOptions, ConfirmSelectOptions, QueueBindOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};
use tokio::sync::mpsc;

use crate::bundles::in_flight;
use crate::support::*;

const SEC: Duration = Duration::from_secs(1);

/// The suite's state key.
const KEY: &[u8] = b"adversary-suite-key-0123456789ab";

/// A year, in ms.
const YEAR_MS: u64 = 366 * 86_400_000;

/// A bridge with a key and two routes, the recipe's users, and the other route's queue
/// watched.
struct Arena {
    w: World,
    /// The world's own route's ingress.
    ingress: String,
    /// The other route: its ingress and its target exchange.
    other_ingress: String,
    other_target: String,
    /// What reached the other route's queue.
    other: mpsc::UnboundedReceiver<Received>,
    /// A confirming channel of the recipe's publisher (and its connection, kept open).
    publisher: Channel,
    _publisher_connection: Connection,
    /// The recipe's canceller and operator, as configurations of the `delay-bridge` command.
    canceller_url: String,
    /// The canceller's user name and password, for the stream protocol.
    canceller_login: (String, String),
    operator: ConfigFile,
    _users: Vec<TestUser>,
}

impl Arena {
    async fn start(test: &str) -> Arena {
        let mut w = World::start(Setup {
            start_bridge: false,
            watch_parked: false,
            ..Setup::new(test)
        })
        .await;
        let ingress = w.config.routes[0].ingress.clone();
        let other_ingress = format!("{}.pay.in", w.prefix());
        let other_target = format!("{}.payments", w.prefix());
        let other_queue = format!("{}.payments.all", w.prefix());
        w.add_route(Route::new(other_ingress.clone(), other_target.clone()))
            .await
            .expect("second route");
        w.declare_extra_exchange(&other_target, ExchangeKind::Topic)
            .await;
        w.declare_bound_queue(&other_queue, &other_target, "#")
            .await;
        let other = watch_queue(&w.conn, &other_queue).await;
        let file = std::env::temp_dir().join(format!("{}.key", w.prefix()));
        std::fs::write(&file, KEY).expect("key file written");
        w.config.state_key_files = (Some(file), None);
        w.config.state_keys = Some(StateKeys::new(KEY, None).expect("a long enough key"));
        w.start_bridge().await;

        let tag = format!("{:08x}", rand::random::<u32>());
        let recipe = grants(&w.config);
        let mut users = Vec::new();
        let mut url_of = |role: &str| {
            let grant = recipe.iter().find(|g| g.role == role).expect("a role");
            let password = format!("pw-{tag}");
            let user = TestUser::create(
                &format!("adv-{role}-{tag}"),
                &password,
                [&grant.configure, &grant.write, &grant.read],
            );
            let url = user.url(&password);
            users.push(user);
            url
        };
        let publisher_url = url_of("publisher");
        let canceller_url = url_of("canceller");
        let canceller_login = (format!("adv-canceller-{tag}"), format!("pw-{tag}"));
        let operator_url = url_of("operator");
        let mut operator_config = w.config.clone();
        operator_config.urls = vec![BrokerUrl::parse(&operator_url).expect("a URL")];
        let operator = ConfigFile::write(&operator_config).expect("config written");
        let connection = Connection::connect(&publisher_url, ConnectionProperties::default())
            .await
            .expect("the publisher connects");
        let publisher = connection.create_channel().await.unwrap();
        publisher
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        Arena {
            w,
            ingress,
            other_ingress,
            other_target,
            other,
            publisher,
            _publisher_connection: connection,
            canceller_url,
            canceller_login,
            operator,
            _users: users,
        }
    }

    /// A confirming channel of the recipe's canceller (and its connection, to keep open).
    async fn canceller(&self) -> (Connection, Channel) {
        let connection = Connection::connect(&self.canceller_url, ConnectionProperties::default())
            .await
            .expect("the canceller connects");
        let channel = connection.create_channel().await.unwrap();
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        (connection, channel)
    }

    /// Publishes `entries` (see tests/stream_publisher.py) to the cancel stream over the
    /// stream protocol as the recipe's canceller: the script's exit code, or `None` (said on
    /// stderr) where the broker has no stream listener the tests know of
    /// (`DELAY_BRIDGE_STREAM_PORT`) or no python with rstream.
    async fn stream_publish(&self, entries: serde_json::Value) -> Option<i32> {
        let Ok(port) = std::env::var("DELAY_BRIDGE_STREAM_PORT") else {
            eprintln!("skipped: no DELAY_BRIDGE_STREAM_PORT (the broker's stream protocol port)");
            return None;
        };
        let Some(python) = crate::interop::pika_python() else {
            eprintln!("skipped: no python with rstream (scripts/python-env.sh)");
            return None;
        };
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/stream_publisher.py");
        let (user, password) = &self.canceller_login;
        let stream = self.w.config.names.cancel_stream();
        let mut child = tokio::process::Command::new(&python)
            .args([script, "127.0.0.1", &port, user, password, "/", &stream])
            .stdin(std::process::Stdio::piped())
            .spawn()
            .expect("run the stream publisher");
        let mut stdin = child.stdin.take().expect("stdin");
        tokio::io::AsyncWriteExt::write_all(&mut stdin, entries.to_string().as_bytes())
            .await
            .expect("entries written");
        drop(stdin);
        let status = tokio::time::timeout(30 * SEC, child.wait())
            .await
            .expect("the stream publisher ends within 30 s")
            .expect("the stream publisher ran");
        Some(status.code().unwrap_or(-1))
    }

    /// After a forged checkpoint that leaves out the real cancel of `victim` (made at
    /// `cancelled_at`) and cancels `innocent`: the running bridge and a restarted one hold
    /// only the real cancel (a restart loads what the bridges' clock entries named), and
    /// only the innocent copy arrives.
    async fn forgery_changed_nothing(&mut self, cancelled_at: u64) {
        let stats = self.w.stats();
        wait_until("the real cancel is applied", 5 * SEC, || {
            stats.snapshot().tombstones == 1
        })
        .await;
        self.w.stop_bridge().await;
        self.w.start_bridge().await;
        let restarted = self.w.stats().snapshot();
        assert_eq!(restarted.tombstones, 1, "only the real cancel");
        assert_eq!(restarted.checkpoints, 0, "no checkpoint taken");
        self.only_the_innocent_arrives(cancelled_at).await;
        assert_eq!(
            self.w.stats().snapshot().cancelled,
            1,
            "the victim's copy dropped"
        );
    }

    /// Publishes a copy of `victim` and of `innocent`, both entered a second before
    /// `cancelled_at`, due in 300 ms: only the innocent one arrives (`victim` was cancelled
    /// at `cancelled_at`; whatever a forgery said of `innocent`).
    async fn only_the_innocent_arrives(&mut self, cancelled_at: u64) {
        for id in ["victim", "innocent"] {
            let published_at = AMQPValue::LongLongInt((cancelled_at - 1_000) as i64);
            self.publish(
                &self.ingress,
                "rk.copy",
                id.as_bytes(),
                with(vec![
                    ("x-delay", AMQPValue::LongLongInt(300)),
                    (header::PUBLISHED_AT, published_at),
                ])
                .with_message_id(id.into()),
            )
            .await;
        }
        let got = self.w.recv_within(10 * SEC).await;
        assert_eq!(got.body, b"innocent", "the innocent copy arrives");
        self.w.assert_quiet(2 * SEC).await;
    }

    /// Publishes as the recipe's publisher, confirmed.
    async fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        props: BasicProperties,
    ) {
        publish_to(&self.publisher, exchange, routing_key, body, props).await;
    }

    /// `delay-bridge parked <args> --json` as the recipe's operator: its exit success and
    /// report.
    async fn parked(&self, args: &[&str]) -> (bool, serde_json::Value) {
        let mut command = vec!["parked"];
        command.extend_from_slice(args);
        command.push("--json");
        let (ok, stdout) = run_command(&self.operator, &command).await;
        (ok, serde_json::from_str(&stdout).unwrap_or_default())
    }

    /// Waits until the parked queue holds `n` messages.
    async fn parked_depth(&self, n: u64, within: Duration) {
        let queue = self.w.config.names.parked_queue();
        let deadline = std::time::Instant::now() + within;
        loop {
            let depth = self.w.queue_depth(&queue).await;
            if depth == n {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the parked queue held {depth}, not {n}, after {within:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Asserts that nothing reaches the other route's queue for `quiet`.
    async fn assert_other_quiet(&mut self, quiet: Duration) {
        if let Ok(Some(got)) = tokio::time::timeout(quiet, self.other.recv()).await {
            panic!(
                "reached the other route's queue: {:?} {:?}",
                got.routing_key,
                String::from_utf8_lossy(&got.body)
            );
        }
    }

    async fn cleanup(self) {
        self.w.cleanup().await;
    }
}

/// Headers of a new message with `entries`.
fn with(entries: Vec<(&str, AMQPValue)>) -> BasicProperties {
    BasicProperties::default().with_headers(headers(entries))
}

fn int(v: u64) -> AMQPValue {
    AMQPValue::LongLongInt(v as i64)
}

/// The selected messages of a `parked --json` report (each message's description, with
/// `done` and `note`).
fn selected(report: &serde_json::Value) -> Vec<serde_json::Value> {
    report["selected"].as_array().cloned().unwrap_or_default()
}

/// A publisher sends to its ingress a message with a bad `x-delay` and its own bridge state
/// bound for the other route's target (with a routing key, a user and an entry time no
/// cancel reaches), and one that says it is a bundle of such state: both are parked
/// `bad-delay` without those headers, listed as not replayable, and a replay as the
/// recipe's operator sends nothing anywhere.
#[tokio::test]
async fn a_publishers_forged_state_never_reaches_another_route_through_a_replay() {
    let mut a = Arena::start("adv-replay").await;
    let now = now_ms();
    let forged_state = |id: &str, extra: Vec<(&str, AMQPValue)>| {
        let mut entries = vec![
            ("x-delay", text("garbage")),
            (header::STATE_TARGET, text(&a.other_target)),
            (header::STATE_ROUTING_KEY, text("refund.approved")),
            (header::STATE_DELIVER_AT, int(now)),
            (header::STATE_FIRST_SEEN, int(now)),
            (header::STATE_ENTERED_AT, int(now + 10 * YEAR_MS)),
            (header::STATE_USER_ID, text("admin")),
            (header::STATE_HOPS, int(0)),
        ];
        entries.extend(extra);
        with(entries).with_message_id(id.into())
    };
    a.publish(
        &a.ingress,
        "rk.forged",
        b"forged",
        forged_state("forged-1", vec![]),
    )
    .await;
    let member = bundle::encode_member(&in_flight(2, now, &a.other_target), b"in a bundle")
        .expect("a member");
    a.publish(
        &a.ingress,
        "rk.forged",
        &bundle::bundle_body([member.as_slice()]),
        forged_state("forged-2", vec![(header::BUNDLE, int(1))]),
    )
    .await;
    a.publish(&a.ingress, "rk.genuine", b"genuine", with_delay(1_000))
        .await;
    a.parked_depth(2, 10 * SEC).await;

    let (ok, listed) = a.parked(&["list"]).await;
    assert!(ok, "parked list as the operator: {listed}");
    for message in selected(&listed) {
        let m = &message;
        assert_eq!(m["reason"], "bad-delay", "{m}");
        assert_eq!(m["replayable"], false, "{m}");
        assert!(
            m["target"].is_null(),
            "the publisher's target is not kept: {m}"
        );
    }
    let (ok, replayed) = a.parked(&["replay"]).await;
    assert!(!ok, "both stay parked, and the command says so: {replayed}");
    let got = a.w.recv_within(10 * SEC).await;
    assert_eq!(got.body, b"genuine");
    a.assert_other_quiet(3 * SEC).await;
    a.w.assert_quiet(SEC).await;
    a.parked_depth(2, SEC).await;
    a.cleanup().await;
}

/// Copies that failed their signature (written into the work exchange by a user who may,
/// bound for the other route's target) are parked `bad-state` and never signed again by a
/// replay; a copy the bridge itself parked (`unroutable`) is replayed and delivered.
#[tokio::test]
async fn a_copy_that_failed_its_signature_is_never_signed_again_by_a_replay() {
    let mut a = Arena::start("adv-bad-state").await;
    let work = a.w.config.names.work_exchange();
    let now = now_ms();
    publish_to(
        &a.w.publisher,
        &work,
        "forged",
        b"unsigned",
        in_flight(1, now, &a.other_target),
    )
    .await;
    let other_key = StateKeys::new(b"another key, at least 16 bytes", None).unwrap();
    let elsewhere = other_key.sign(in_flight(2, now, &a.other_target), b"signed elsewhere");
    publish_to(
        &a.w.publisher,
        &work,
        "forged",
        b"signed elsewhere",
        elsewhere,
    )
    .await;
    // The bridge's own: unroutable at the world's target (which binds `rk.#` only).
    a.publish(
        &a.ingress,
        "nobody.genuine",
        b"genuine",
        with_delay(300).with_message_id("genuine".into()),
    )
    .await;
    a.parked_depth(3, 10 * SEC).await;

    let (ok, listed) = a.parked(&["list"]).await;
    assert!(ok, "{listed}");
    let by_reason = |reason: &str| {
        selected(&listed)
            .into_iter()
            .filter(|m| m["reason"] == reason)
            .map(|m| m["replayable"].as_bool())
            .collect::<Vec<_>>()
    };
    assert_eq!(by_reason("bad-state"), vec![Some(false), Some(false)]);
    assert_eq!(by_reason("unroutable"), vec![Some(true)]);

    let channel = a.w.conn.create_channel().await.unwrap();
    channel
        .queue_bind(
            a.w.target_queue.as_str().into(),
            a.w.target.as_str().into(),
            "nobody.#".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let (ok, replayed) = a.parked(&["replay"]).await;
    assert!(!ok, "the two forged copies stay parked: {replayed}");
    let got = a.w.recv_within(10 * SEC).await;
    assert_eq!(
        got.body, b"genuine",
        "the bridge's own parked copy is replayed"
    );
    a.assert_other_quiet(3 * SEC).await;
    a.parked_depth(2, SEC).await;
    a.cleanup().await;
}

/// A recurring schedule published under the id of another message (one on its own route,
/// one on the other route) replaces only schedules of that id bound for its own target:
/// both messages arrive.
#[tokio::test]
async fn a_schedule_cannot_cancel_another_message_of_its_id() {
    let mut a = Arena::start("adv-schedule-id").await;
    a.publish(
        &a.ingress,
        "rk.victim.a",
        b"victim a",
        with_delay(2_500).with_message_id("victim-a".into()),
    )
    .await;
    a.publish(
        &a.other_ingress,
        "rk.victim.b",
        b"victim b",
        with_delay(2_500).with_message_id("victim-b".into()),
    )
    .await;
    for id in ["victim-a", "victim-b"] {
        let schedule = with(vec![
            ("x-repeat-every", text("1h")),
            ("x-delay", int(60_000)),
        ])
        .with_message_id(id.into());
        a.publish(&a.ingress, "rk.schedule", b"schedule", schedule)
            .await;
    }
    let got = a.w.recv_within(10 * SEC).await;
    assert_eq!(got.body, b"victim a");
    let other = tokio::time::timeout(10 * SEC, a.other.recv())
        .await
        .expect("the other route's message arrives")
        .expect("watched");
    assert_eq!(other.body, b"victim b");
    a.cleanup().await;
}

/// An `x-published-at` a year ahead does not make a message uncancellable: it counts as
/// the bridge's now plus the 1-s clock allowance, so the recipe's canceller, cancelling once
/// that has passed, drops it; a genuine message alongside arrives.
#[tokio::test]
async fn a_future_published_at_does_not_make_a_message_uncancellable() {
    let mut a = Arena::start("adv-future").await;
    let ahead = with(vec![
        ("x-delay", int(3_000)),
        ("x-published-at", int(now_ms() + YEAR_MS)),
    ])
    .with_message_id("ahead".into());
    a.publish(&a.ingress, "rk.ahead", b"ahead", ahead).await;
    a.publish(&a.ingress, "rk.genuine", b"genuine", with_delay(3_000))
        .await;
    tokio::time::sleep(Duration::from_millis(
        delay_bridge::cancel::CLOCK_ALLOWANCE_MS + 300,
    ))
    .await;
    let canceller = Client::connect(&a.canceller_url, a.w.prefix())
        .await
        .expect("the canceller connects");
    canceller.cancel("ahead").await.expect("cancelled");
    let got = a.w.recv_within(10 * SEC).await;
    assert_eq!(got.body, b"genuine");
    a.w.assert_quiet(2 * SEC).await;
    a.cleanup().await;
}

/// The cancel stream's entries for one schedule id, read from its first entry until none
/// comes for a second.
async fn stream_entries_for(w: &World, id: &str) -> usize {
    let channel = w.conn.create_channel().await.unwrap();
    channel
        .basic_qos(1_000, BasicQosOptions::default())
        .await
        .unwrap();
    let mut arguments = FieldTable::default();
    arguments.insert("x-stream-offset".into(), text("first"));
    let mut consumer = channel
        .basic_consume(
            w.config.names.cancel_stream().as_str().into(),
            "adversary".into(),
            BasicConsumeOptions::default(),
            arguments,
        )
        .await
        .unwrap();
    let mut count = 0;
    while let Ok(Some(Ok(delivery))) = tokio::time::timeout(SEC, consumer.next()).await {
        if delivery
            .properties
            .message_id()
            .as_ref()
            .map(|m| m.as_str())
            == Some(id)
        {
            count += 1;
        }
        delivery.ack(Default::default()).await.unwrap();
    }
    let _ = channel.close(200, "read".into()).await;
    count
}

/// A schedule every second, delivered six times, adds nothing to the cancel stream but its
/// replacement entry (an occurrence delivered in the ordinary way writes nothing); one
/// every 100 ms is refused at intake (`bad-schedule`), below the smallest recurring
/// interval.
#[tokio::test]
async fn a_one_second_schedule_adds_nothing_to_the_cancel_stream_and_a_faster_one_is_refused() {
    let mut a = Arena::start("adv-tick").await;
    let tick = with(vec![("x-repeat-every", text("1s"))]).with_message_id("tick".into());
    a.publish(&a.ingress, "rk.tick", b"tick", tick).await;
    let fast = with(vec![("x-repeat-every", text("100ms"))]).with_message_id("fast".into());
    a.publish(&a.ingress, "rk.fast", b"fast", fast).await;
    let ticks = a.w.recv_n(6, 15 * SEC).await;
    assert!(ticks.iter().all(|t| t.body == b"tick"), "{ticks:?}");
    assert_eq!(
        stream_entries_for(&a.w, "tick").await,
        1,
        "the schedule's replacement entry, and nothing per occurrence"
    );
    assert_eq!(stream_entries_for(&a.w, "fast").await, 0);
    // In memory too: the replacement, and no entry per occurrence.
    assert!(a.w.stats().snapshot().tombstones <= 1);
    let (ok, listed) = a.parked(&["list"]).await;
    assert!(ok, "{listed}");
    let parked = selected(&listed);
    assert_eq!(parked.len(), 1, "{listed}");
    assert_eq!(parked[0]["reason"], "bad-schedule");
    a.cleanup().await;
}

/// Two messages into the work exchange claiming to be bundles of `i64::MAX` messages (a user
/// who may write there): each is parked `bad-state` and the bridge's byte budget neither
/// overflows nor stalls; a genuine message arrives on time.
#[tokio::test]
async fn a_forged_bundle_count_neither_crashes_nor_stalls_the_bridge() {
    let mut a = Arena::start("adv-count").await;
    let work = a.w.config.names.work_exchange();
    for _ in 0..2 {
        let forged = with(vec![(header::BUNDLE, AMQPValue::LongLongInt(i64::MAX))]);
        publish_to(&a.w.publisher, &work, "forged", b"\x01tiny", forged).await;
    }
    let published = now_ms();
    a.publish(&a.ingress, "rk.genuine", b"genuine", with_delay(500))
        .await;
    let got = a.w.recv_within(10 * SEC).await;
    assert_eq!(got.body, b"genuine");
    assert!(
        got.at_ms < published + 2_000,
        "on time: {} ms late",
        got.at_ms - published - 500
    );
    a.parked_depth(2, 5 * SEC).await;
    a.cleanup().await;
}

/// A copy the bridge signed, taken from a level by a user who may read it and sent back
/// into the work exchange with another `message_id` (the id cancels name) and a `CC`
/// header (one more routing key at the target), is parked `bad-state`: the signature
/// covers what the bridge acts on, not only its own headers.
#[tokio::test]
async fn a_signed_copy_with_its_id_or_cc_changed_is_parked() {
    let mut a = Arena::start("adv-unsigned-parts").await;
    a.publish(
        &a.ingress,
        "rk.taken",
        b"taken",
        with_delay(6_000).with_message_id("taken".into()),
    )
    .await;
    let level = a.w.config.names.level_queue(Duration::from_millis(800));
    let channel = a.w.conn.create_channel().await.unwrap();
    let deadline = std::time::Instant::now() + 5 * SEC;
    let copy = loop {
        let got = channel
            .basic_get(level.as_str().into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap();
        if let Some(message) = got {
            break message.delivery;
        }
        assert!(std::time::Instant::now() < deadline, "no copy in {level}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let mut changed_headers = copy.properties.headers().clone().unwrap_or_default();
    changed_headers.insert(
        "CC".into(),
        AMQPValue::FieldArray(vec![text("rk.stolen")].into()),
    );
    for properties in [
        copy.properties
            .clone()
            .with_message_id("someone-elses".into()),
        copy.properties.clone().with_headers(changed_headers),
    ] {
        publish_to(
            &a.w.publisher,
            &a.w.config.names.work_exchange(),
            "forged",
            &copy.data,
            properties,
        )
        .await;
    }
    a.parked_depth(2, 10 * SEC).await;
    let (ok, listed) = a.parked(&["list"]).await;
    assert!(ok, "{listed}");
    for message in selected(&listed) {
        assert_eq!(message["reason"], "bad-state", "{message}");
    }
    a.w.assert_quiet(2 * SEC).await;
    a.cleanup().await;
}

/// A tombstone dated an hour ahead (a canceller's clock running fast, with the recipe's
/// canceller rights) counts as made at the reading bridge's now plus the allowance, and
/// still does after a restart reads it again an allowance and more later: a reschedule
/// published after it lives through the restart.
#[tokio::test]
async fn a_cancel_dated_ahead_means_the_same_after_a_restart() {
    use delay_bridge::cancel::{CLOCK_ALLOWANCE_MS, message_id, tombstone_properties};
    let mut a = Arena::start("adv-ahead-restart").await;
    let stats = a.w.stats();
    let (connection, canceller) = a.canceller().await;
    publish_to(
        &canceller,
        &a.w.config.names.cancel_exchange(),
        "",
        b"",
        tombstone_properties(message_id("ahead").unwrap(), now_ms() + 3_600_000, None),
    )
    .await;
    wait_until("the tombstone is applied", 5 * SEC, || {
        stats.snapshot().tombstones == 1
    })
    .await;
    // Published once the allowance has passed: after the cancel, by any clock.
    tokio::time::sleep(Duration::from_millis(CLOCK_ALLOWANCE_MS + 500)).await;
    a.publish(
        &a.ingress,
        "rk.after",
        b"after",
        with_delay(5_000).with_message_id("ahead".into()),
    )
    .await;
    a.w.stop_bridge().await;
    a.w.start_bridge().await;
    let got = a.w.recv_within(15 * SEC).await;
    assert_eq!(
        got.body, b"after",
        "the reschedule lives through the restart"
    );
    let _ = connection.close(200, "done".into()).await;
    a.cleanup().await;
}

/// Enough history that a starting bridge looks back for a checkpoint rather than reading
/// the stream whole: 3 000 cancels long past their due time, as the canceller.
async fn history(canceller: &Channel, exchange: &str, now: u64) {
    use delay_bridge::cancel::{message_id, tombstone_properties};
    for n in 0..3_000 {
        let long_ago = now - YEAR_MS;
        publish_to(
            canceller,
            exchange,
            "",
            b"",
            tombstone_properties(
                message_id(&format!("filler-{n}")).unwrap(),
                long_ago,
                Some(long_ago),
            ),
        )
        .await;
    }
}

/// A canceller writes a checkpoint of its own into the stream (a begin entry, and a part
/// that says only `innocent` is cancelled, leaving out the real cancel of `victim`) and a
/// marker naming it: neither the running bridge nor a restarted one takes it (only a
/// bridge's entries count, by the `user_id` the broker checks).
#[tokio::test]
async fn a_cancellers_forged_checkpoint_changes_nothing() {
    use delay_bridge::cancel::{
        checkpoint, checkpoint_begin_properties, checkpoint_part_properties, message_id,
        sync_properties, tombstone_properties,
    };
    let mut a = Arena::start("adv-forged-checkpoint").await;
    let (connection, canceller) = a.canceller().await;
    let exchange = a.w.config.names.cancel_exchange();
    let cancelled_at = now_ms();
    publish_to(
        &canceller,
        &exchange,
        "",
        b"",
        tombstone_properties(message_id("victim").unwrap(), cancelled_at, None),
    )
    .await;
    history(&canceller, &exchange, cancelled_at).await;
    let forged = checkpoint::encode_part(&[checkpoint::Record::Cancel {
        id: "innocent".into(),
        c: u64::MAX / 4,
        e: now_ms() + YEAR_MS,
    }]);
    publish_to(
        &canceller,
        &exchange,
        "",
        b"",
        checkpoint_begin_properties("forged".into(), now_ms()),
    )
    .await;
    publish_to(
        &canceller,
        &exchange,
        "",
        &forged,
        checkpoint_part_properties("forged".into(), 0, 0, 1),
    )
    .await;
    publish_to(
        &canceller,
        &exchange,
        "",
        b"",
        sync_properties("forged-pointer".into(), now_ms(), Some(0)),
    )
    .await;
    a.forgery_changed_nothing(cancelled_at).await;
    let _ = connection.close(200, "done".into()).await;
    a.cleanup().await;
}

/// The same forgery over the stream protocol, which stores a publish's `user_id` unchecked:
/// the canceller writes the bridge's own user into the begin entry, the part and a marker
/// naming it. The state key's signature is what tells a bridge's entries then: neither the
/// running bridge nor a restarted one takes the forgery, and the real cancel holds.
#[tokio::test]
async fn a_cancellers_checkpoint_forged_over_the_stream_protocol_changes_nothing() {
    use delay_bridge::cancel::{checkpoint, header as entry, message_id, tombstone_properties};
    let mut a = Arena::start("adv-stream-forgery").await;
    let (connection, canceller) = a.canceller().await;
    let exchange = a.w.config.names.cancel_exchange();
    let cancelled_at = now_ms();
    publish_to(
        &canceller,
        &exchange,
        "",
        b"",
        tombstone_properties(message_id("victim").unwrap(), cancelled_at, None),
    )
    .await;
    history(&canceller, &exchange, cancelled_at).await;
    let bridge_user = a.w.config.url().user();
    let forged = checkpoint::encode_part(&[checkpoint::Record::Cancel {
        id: "innocent".into(),
        c: u64::MAX / 4,
        e: now_ms() + YEAR_MS,
    }]);
    let entries = serde_json::json!([
        {"message_id": "forged", "user_id": bridge_user, "body": "x",
         "headers": {entry::KIND: "checkpoint", entry::AT: now_ms()}},
        {"message_id": "forged", "user_id": bridge_user,
         "body": String::from_utf8(forged).unwrap(),
         "headers": {entry::KIND: "checkpoint-part", entry::CHECKPOINT: 0, entry::PART: 0,
                     entry::PARTS: 1}},
        {"message_id": "forged-pointer", "user_id": bridge_user, "body": "x",
         "headers": {entry::KIND: "sync", entry::AT: now_ms(), entry::CHECKPOINT: 0}},
    ]);
    let Some(code) = a.stream_publish(entries).await else {
        let _ = connection.close(200, "done".into()).await;
        a.cleanup().await;
        return;
    };
    assert_eq!(
        code, 0,
        "the canceller may write to the stream over the stream protocol"
    );
    a.forgery_changed_nothing(cancelled_at).await;
    let _ = connection.close(200, "done".into()).await;
    a.cleanup().await;
}

/// A canceller's successor tombstones are bridge state and are not taken from it: 200 of
/// them with 120 KiB targets leave nothing behind, and one that names a running schedule
/// (every copy of its next occurrences born before the end of time) does not stop it.
#[tokio::test]
async fn a_cancellers_successor_tombstones_are_not_taken() {
    use delay_bridge::cancel::{Successors, message_id, successors_properties};
    let mut a = Arena::start("adv-successors").await;
    let (connection, canceller) = a.canceller().await;
    let exchange = a.w.config.names.cancel_exchange();
    let entered_at = now_ms() - 1_000;
    a.publish(
        &a.ingress,
        "rk.tick",
        b"tick",
        with(vec![
            ("x-repeat-every", AMQPValue::LongString("1s".into())),
            ("x-repeat-count", AMQPValue::LongLongInt(6)),
            ("x-delay", AMQPValue::LongLongInt(1_000)),
            (
                header::PUBLISHED_AT,
                AMQPValue::LongLongInt(entered_at as i64),
            ),
        ])
        .with_message_id("tick".into()),
    )
    .await;
    let stop_it = Successors {
        message_id: "tick".into(),
        target: Some(a.w.config.routes[0].target.clone()),
        entered_at,
        after_occurrence: 0,
        born_before: u64::MAX / 2,
        due_at: now_ms() + YEAR_MS,
    };
    publish_to(
        &canceller,
        &exchange,
        "",
        b"",
        successors_properties(message_id("tick").unwrap(), &stop_it),
    )
    .await;
    let long = "t".repeat(120 * 1024);
    for n in 0..200 {
        let mut properties = successors_properties(
            message_id(&format!("big-{n}")).unwrap(),
            &Successors {
                target: None,
                ..stop_it.clone()
            },
        );
        let mut headers = properties.headers().clone().unwrap_or_default();
        headers.insert(
            delay_bridge::cancel::header::TARGET.into(),
            AMQPValue::LongString(long.as_str().into()),
        );
        properties = properties.with_headers(headers);
        publish_to(&canceller, &exchange, "", b"", properties).await;
    }
    for n in 1..=3 {
        let got = a.w.recv_within(10 * SEC).await;
        assert_eq!(got.body, b"tick", "occurrence {n} of the schedule arrives");
    }
    let _ = connection.close(200, "done".into()).await;
    a.cleanup().await;
}

/// One entry no AMQP 0-9-1 reader can be sent: a stream-protocol publish with no body,
/// which the broker fails to convert, closing the reader's connection each time it sends
/// it. The running bridge skips it and goes on; a restarted one reads past it and becomes
/// ready; each counts it; a cancel after it holds.
#[tokio::test]
async fn an_entry_the_broker_cannot_send_is_skipped_and_the_bridge_stays_ready() {
    use delay_bridge::cancel::{message_id, tombstone_properties};
    let mut a = Arena::start("adv-poison-entry").await;
    let entries = serde_json::json!([
        {"message_id": "poison", "user_id": null, "body": "",
         "headers": {delay_bridge::cancel::header::KIND: "cancel"}},
    ]);
    let Some(code) = a.stream_publish(entries).await else {
        a.cleanup().await;
        return;
    };
    assert_eq!(
        code, 0,
        "the canceller may write to the stream over the stream protocol"
    );
    let stats = a.w.stats();
    wait_until("the running bridge skips the entry", 30 * SEC, || {
        stats.snapshot().stream_skipped == 1
    })
    .await;
    let (connection, canceller) = a.canceller().await;
    let cancelled_at = now_ms();
    publish_to(
        &canceller,
        &a.w.config.names.cancel_exchange(),
        "",
        b"",
        tombstone_properties(message_id("victim").unwrap(), cancelled_at, None),
    )
    .await;
    wait_until("the cancel after it is applied", 10 * SEC, || {
        stats.snapshot().tombstones == 1
    })
    .await;
    a.w.stop_bridge().await;
    a.w.start_bridge().await;
    let again = a.w.stats().snapshot();
    assert_eq!(
        again.stream_skipped, 1,
        "the restarted bridge skipped it too"
    );
    assert_eq!(again.tombstones, 1, "and has the cancel after it");
    assert_eq!(again.reconnects, 0, "no session was lost to it");
    let (ok, out) = run_command(&a.operator, &["status", "--json"]).await;
    assert!(ok, "status reads past it: {out}");
    let json: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    assert_eq!(json["cancel_entries"]["unreadable"], 1, "{out}");
    a.only_the_innocent_arrives(cancelled_at).await;
    let _ = connection.close(200, "done".into()).await;
    a.cleanup().await;
}

/// A bridge whose clock is 3 s behind the others' (run under `faketime`): a cancel made on
/// time is one dated ahead to it. Before 0.3 it clamped each such cancel it read live to its
/// own now plus the allowance, 2 s before the cancel, and every instance started afterwards
/// followed that clamp: messages published in those 2 s were delivered though their cancels
/// were confirmed well before they were due. Now it measures its clock against the times
/// the other bridges write, judges by the corrected clock, and writes no such clamp.
#[tokio::test]
async fn a_bridge_whose_clock_is_behind_does_not_decide_cancels_for_the_others() {
    use delay_bridge::cancel::{message_id, tombstone_properties};
    // libfaketime preloaded into the bridge itself (the `faketime` command runs it as a
    // child, which a signal to the wrapper would not stop).
    let libfaketime = ["x86_64-linux-gnu", "aarch64-linux-gnu"]
        .iter()
        .map(|arch| std::path::PathBuf::from(format!("/usr/lib/{arch}/faketime/libfaketime.so.1")))
        .find(|path| path.is_file());
    let Some(libfaketime) = libfaketime else {
        eprintln!("skipped: no libfaketime (Debian's faketime package)");
        return;
    };
    let mut a = Arena::start("adv-clock-behind").await;
    let wrapper = std::env::temp_dir().join(format!("{}-behind.sh", a.w.prefix()));
    std::fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\nLD_PRELOAD={} FAKETIME=-3s FAKETIME_NO_CACHE=1 \
             FAKETIME_DONT_FAKE_MONOTONIC=1 exec {} \"$@\"\n",
            libfaketime.display(),
            bridge_exe().display()
        ),
    )
    .expect("wrapper written");
    std::fs::set_permissions(
        &wrapper,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .expect("wrapper executable");
    let config = ConfigFile::write(&a.w.config).expect("config written");
    let behind = delay_bridge::sandbox::process::BridgeProcess::spawn(
        &wrapper,
        &config,
        &delay_bridge::sandbox::process::ProcessLog::warnings(),
    )
    .expect("the bridge 3 s behind starts");
    wait_for_consumers(&a.w, 2, 30 * SEC).await;
    // The in-process bridge starts again: the one behind reads its marker live.
    a.w.stop_bridge().await;
    a.w.start_bridge().await;
    wait_for_consumers(&a.w, 2, 30 * SEC).await;
    let (connection, canceller) = a.canceller().await;
    // The cancels come more than the clock allowance after the last time a bridge wrote
    // into the stream, as cancels minutes after a start do: a reader that starts later
    // then holds each until its clamp, if one was written.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let ids: Vec<String> = (0..6).map(|n| format!("order-{n}")).collect();
    for id in &ids {
        let published_at = AMQPValue::LongLongInt(now_ms() as i64);
        a.publish(
            &a.ingress,
            "rk.copy",
            id.as_bytes(),
            with(vec![
                ("x-delay", AMQPValue::LongLongInt(20_000)),
                (header::PUBLISHED_AT, published_at),
            ])
            .with_message_id(id.as_str().into()),
        )
        .await;
        publish_to(
            &canceller,
            &a.w.config.names.cancel_exchange(),
            "",
            b"",
            tombstone_properties(message_id(id).unwrap(), now_ms() + 200, None),
        )
        .await;
    }
    // An instance started after the cancels were read follows whatever clamps they got.
    a.w.stop_bridge().await;
    a.w.start_bridge().await;
    a.publish(
        &a.ingress,
        "rk.copy",
        b"sentinel",
        with(vec![("x-delay", AMQPValue::LongLongInt(22_000))]).with_message_id("sentinel".into()),
    )
    .await;
    let got = a.w.recv_within(40 * SEC).await;
    assert_eq!(
        got.body, b"sentinel",
        "no cancelled order arrives before it"
    );
    a.w.assert_quiet(2 * SEC).await;
    let (ok, out) = run_command(&a.operator, &["status", "--json"]).await;
    assert!(ok, "status: {out}");
    let json: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    assert_eq!(
        json["cancel_entries"]["clamps"], 0,
        "no clamp written: {out}"
    );
    let _ = behind.terminate(20 * SEC).await;
    let _ = connection.close(200, "done".into()).await;
    let _ = std::fs::remove_file(&wrapper);
    a.cleanup().await;
}
