//! Upgrades without loss: queues declared by an older bridge or another configuration are
//! used as they are where that changes nothing for their messages, and a level removed from
//! the ladder still hands its messages on.

use std::time::Duration;

use delay_bridge::bridge::Bridge;
use delay_bridge::config::Config;
use lapin::options::QueueDeclareOptions;
use lapin::types::{AMQPValue, FieldTable};
use tokio_util::sync::CancellationToken;

use crate::support::*;

const SEC: Duration = Duration::from_secs(1);
const DAY: Duration = Duration::from_secs(86_400);

/// A config for the world's prefix and route with another ladder and cancel grace.
fn config_with(w: &World, ladder: &str, grace: Duration) -> Config {
    let mut raw = raw_config(
        w.prefix(),
        ladder,
        Duration::from_millis(30),
        &[(w.ingress.clone(), w.target.clone())],
        1000,
    );
    raw.cancel.grace = Some(grace);
    raw.validate().expect("valid config")
}

/// Declares a durable queue with `args`, as an older bridge would have.
async fn declare_durable(ch: &lapin::Channel, name: &str, args: FieldTable) {
    ch.queue_declare(
        name.into(),
        QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        },
        args,
    )
    .await
    .unwrap();
}

/// Runs a bridge in process until the returned token is cancelled; waits until it is ready.
async fn run_bridge(config: Config) -> (CancellationToken, tokio::task::JoinHandle<()>) {
    let bridge = Bridge::new(config);
    let mut ready = bridge.ready();
    let token = CancellationToken::new();
    let run = token.clone();
    let handle = tokio::spawn(async move { bridge.run(run).await.expect("the bridge runs") });
    tokio::time::timeout(20 * SEC, ready.wait_for(|r| *r))
        .await
        .expect("ready within 20 s: the existing queues were accepted")
        .unwrap();
    (token, handle)
}

/// A level queue as an older bridge declared it (classic, no `x-queue-version`, not lazy)
/// and a cancel stream kept for another `max_delay + grace`: the bridge starts, warns, and
/// delivers through that level on time.
#[tokio::test]
async fn queues_that_differ_only_in_storage_or_retention_are_used_as_they_are() {
    let mut w = World::without_bridge("upgrade-args").await;
    // The world declared the stream with a 366 d + 1 d retention; this config asks 366 d + 2 d.
    let config = config_with(&w, "100ms 200ms 400ms 800ms 2s", 2 * DAY);
    let old_level = config.names.level_queue(Duration::from_secs(2));
    let mut args = FieldTable::default();
    args.insert("x-message-ttl".into(), AMQPValue::LongLongInt(2_000));
    args.insert(
        "x-dead-letter-exchange".into(),
        text(&config.names.work_exchange()),
    );
    let ch = w.conn.create_channel().await.unwrap();
    declare_durable(&ch, &old_level, args).await;
    w.adopt_queue(&old_level);
    let (token, handle) = run_bridge(config).await;
    let mut w = w;
    let sent = w.publish("rk.upgrade", b"through", with_delay(2_600)).await;
    let got = w.recv_within(10 * SEC).await;
    assert_eq!(got.body, b"through");
    let late = got.at_ms as i64 - (sent as i64 + 2_600);
    assert!((0..500).contains(&late), "lateness {late} ms");
    token.cancel();
    handle.await.unwrap();
    w.cleanup().await;
}

/// A message waiting in a level that the next configuration no longer has is not lost: the
/// level queue still dead-letters into the work queue when its TTL runs out, and the bridge
/// on the new ladder delivers it on time.
#[tokio::test]
async fn removing_a_level_from_the_ladder_loses_nothing() {
    let mut w = World::start(Setup {
        ladder: "100ms 200ms 400ms 800ms 3s",
        ..Setup::new("upgrade-level")
    })
    .await;
    let sent = w.publish("rk.level", b"in-3s", with_delay(3_500)).await;
    let three_s = w.config.names.level_queue(Duration::from_secs(3));
    wait_until_async("the message waits in the 3 s level", 5 * SEC, || async {
        w.queue_depth(&three_s).await == 1
    })
    .await;
    w.stop_bridge().await;
    let config = config_with(&w, "100ms 200ms 400ms 800ms", DAY);
    assert!(
        !config.ladder.levels().contains(&Duration::from_secs(3)),
        "the new ladder has no 3 s level"
    );
    let (token, handle) = run_bridge(config).await;
    let got = w.recv_within(10 * SEC).await;
    assert_eq!(got.body, b"in-3s");
    let late = got.at_ms as i64 - (sent as i64 + 3_500);
    assert!((0..500).contains(&late), "lateness {late} ms");
    assert_eq!(w.queue_depth(&three_s).await, 0, "the old level is empty");
    token.cancel();
    handle.await.unwrap();
    w.cleanup().await;
}

/// A work queue an older bridge bound to the work exchange is unbound from it when this
/// bridge declares its topology, with the returns queue bound in its place: what the levels
/// dead-letter into the work exchange then lands once, in the returns queue.
#[tokio::test]
async fn the_work_exchange_moves_from_the_work_queue_to_the_returns_queue() {
    let w = World::without_bridge("upgrade-returns").await;
    let names = w.config.names.clone();
    let ch = w.conn.create_channel().await.unwrap();
    // As an older bridge left it.
    ch.queue_bind(
        names.work_queue().as_str().into(),
        names.work_exchange().as_str().into(),
        "".into(),
        lapin::options::QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    // The world's own ladder: every queue the bridge declares is one the world deletes.
    let (token, handle) = run_bridge(config_with(&w, "100ms 200ms 400ms 800ms", DAY)).await;
    token.cancel();
    handle.await.unwrap();
    ch.basic_publish(
        names.work_exchange().as_str().into(),
        "".into(),
        lapin::options::BasicPublishOptions::default(),
        b"probe",
        lapin::BasicProperties::default(),
    )
    .await
    .unwrap();
    let returns = names.returns_queue();
    wait_until_async("the probe is in the returns queue", 5 * SEC, || async {
        w.queue_depth(&returns).await == 1
    })
    .await;
    assert_eq!(
        w.queue_depth(&names.work_queue()).await,
        0,
        "not copied into the work queue"
    );
    w.cleanup().await;
}

/// Polls an async condition every 20 ms until it holds, panicking with `what` at `within`.
async fn wait_until_async<F, Fut>(what: &str, within: Duration, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = std::time::Instant::now() + within;
    while !condition().await {
        assert!(
            std::time::Instant::now() < deadline,
            "not within {within:?}: {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A quorum parked queue declared before the bridge set its delivery limit: the bridge
/// starts on it (warning that RabbitMQ 4.x's default applies) and parks into it.
#[tokio::test]
async fn a_quorum_parked_queue_without_a_delivery_limit_is_used_as_it_is() {
    // Its own watcher would consume the queue this test replaces.
    let w = World::start(Setup {
        queue_type: "quorum",
        start_bridge: false,
        watch_parked: false,
        ..Setup::new("upgrade-parked")
    })
    .await;
    let parked = w.config.names.parked_queue();
    let ch = w.conn.create_channel().await.unwrap();
    ch.queue_delete(parked.as_str().into(), Default::default())
        .await
        .unwrap();
    let mut args = FieldTable::default();
    args.insert("x-queue-type".into(), text("quorum"));
    declare_durable(&ch, &parked, args).await;
    ch.queue_bind(
        parked.as_str().into(),
        w.config.names.parked_exchange().as_str().into(),
        "".into(),
        Default::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let (token, handle) = run_bridge(w.config.clone()).await;
    w.publish("nobody.upgrade", b"parked", with_delay(0)).await;
    wait_until_async("the message is parked", 10 * SEC, || async {
        w.queue_depth(&parked).await == 1
    })
    .await;
    // `status` does not read such a queue (each read would count against 4.x's default
    // limit) and says why.
    let status = delay_bridge::status::read(&w.config, &w.conn, 100)
        .await
        .expect("the status is read");
    assert_eq!(status.parked.read, 0);
    assert!(
        status
            .parked
            .not_read
            .as_deref()
            .is_some_and(|why| why.contains("delivery limit")),
        "{:?}",
        status.parked
    );
    assert_eq!(w.queue_depth(&parked).await, 1);
    token.cancel();
    handle.await.unwrap();
    w.cleanup().await;
}
