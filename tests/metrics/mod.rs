//! The metrics and health listener: `delay-bridge run` with `[metrics] listen` serves
//! Prometheus text whose values match known traffic, and `/readyz` tells not-ready from
//! ready.

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use delay_bridge::bridge::Bridge;
use delay_bridge::clock::now_ms;
use delay_bridge::config::MetricsConfig;
use delay_bridge::http::{self, Endpoints, MetricsRegistry};
use lapin::BasicProperties;
use tokio_util::sync::CancellationToken;

use crate::support::*;

const SEC: Duration = Duration::from_secs(1);

/// One sample of `text` (Prometheus exposition format): the value of the line whose series
/// (name and labels, as printed) is `series`.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .find_map(|line| {
            let (name, value) = line.rsplit_once(' ')?;
            (name == series).then(|| value.parse().ok())?
        })
}

/// The metric names of a scrape: each series' name (a histogram's `_bucket`, `_sum` and
/// `_count`), and a histogram's own name.
fn scraped_names(text: &str) -> BTreeSet<String> {
    let series: BTreeSet<String> = text
        .lines()
        .filter(|line| !line.starts_with('#') && !line.is_empty())
        .filter_map(|line| line.split(['{', ' ']).next())
        .map(str::to_string)
        .collect();
    let histograms: Vec<String> = series
        .iter()
        .filter_map(|name| name.strip_suffix("_bucket"))
        .map(str::to_string)
        .collect();
    series.into_iter().chain(histograms).collect()
}

/// Every `delay_bridge_*` name in `file` of the repository (a dashboard, alerting rules or
/// their tests), as written: a histogram's with its `_bucket`, `_sum` or `_count`.
fn queried_metric_names(file: &str) -> BTreeSet<String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(file);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{file}: {e}"));
    let mut names = BTreeSet::new();
    let mut rest = text.as_str();
    while let Some(at) = rest.find("delay_bridge_") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_lowercase() || c == '_'))
            .unwrap_or(tail.len());
        names.insert(tail[..end].to_string());
        rest = &tail[end..];
    }
    names
}

async fn get(url: &str) -> (u16, String) {
    let response = reqwest::get(url).await.expect("the listener answers");
    let status = response.status().as_u16();
    (status, response.text().await.expect("a text body"))
}

/// Waits for the line `delay-bridge run` logs when its listener is bound, and returns the
/// base URL it names (the config asks for port 0: the system picks a free one).
async fn listener_url(log: &Path, within: Duration) -> String {
    let deadline = Instant::now() + within;
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if let Some(start) = text.find("metrics on http://") {
            let rest = &text[start + "metrics on ".len()..];
            let end = rest.find("/metrics").expect("the line names /metrics");
            return rest[..end].to_string();
        }
        assert!(
            Instant::now() < deadline,
            "no listener logged within {within:?}:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Scrapes until `series` reads `expected`, or panics at the deadline with the last text.
async fn wait_for_sample(base: &str, series: &str, expected: f64, within: Duration) -> String {
    let deadline = Instant::now() + within;
    loop {
        let (_, text) = get(&format!("{base}/metrics")).await;
        if sample(&text, series) == Some(expected) {
            return text;
        }
        assert!(
            Instant::now() < deadline,
            "{series} was not {expected} within {within:?}:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Known traffic through the daemon: 4 messages delivered after hops, 2 parked
/// `unroutable`, 1 parked `bad-delay`, and 5 long ones left pending in the 10m and 1h
/// levels. The scrape shows each of them where it belongs.
#[tokio::test]
async fn the_daemon_serves_metrics_that_count_known_traffic() {
    let mut w = World::start(Setup {
        ladder: "100ms 200ms 400ms 800ms 10m 1h",
        start_bridge: false,
        ..Setup::new("metrics")
    })
    .await;
    let config = w.config_file_with(|config| {
        config.metrics = Some(MetricsConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            interval: Duration::from_millis(200),
        });
    });
    let log = std::env::temp_dir().join(format!("{}.log", w.prefix()));
    let bridge = spawn_logging(&config, Some("info"), &log);
    let base = listener_url(&log, 30 * SEC).await;
    wait_for_consumers(&w, 1, 20 * SEC).await;

    for i in 0..4 {
        w.publish(&format!("rk.metrics.{i}"), b"due", with_delay(1_000))
            .await;
    }
    for i in 0..2 {
        w.publish(
            &format!("nobody.metrics.{i}"),
            b"unroutable",
            with_delay(300),
        )
        .await;
    }
    let bad = BasicProperties::default().with_headers(headers(vec![("x-delay", text("soon"))]));
    w.publish("rk.metrics.bad", b"bad", bad).await;
    for _ in 0..3 {
        w.publish("rk.metrics.later", b"later", with_delay(30 * 60 * 1000))
            .await;
    }
    for _ in 0..2 {
        w.publish(
            "rk.metrics.much-later",
            b"later",
            with_delay(2 * 3600 * 1000),
        )
        .await;
    }
    w.recv_n(4, 30 * SEC).await;
    for _ in 0..3 {
        w.parked_within(30 * SEC).await;
    }

    // The depth gauges follow the queues every 200 ms: wait for a reading taken after the
    // long ones settled in their levels and the short ones were delivered (nothing held).
    wait_for_sample(
        &base,
        r#"delay_bridge_level_messages{level="1h"}"#,
        2.0,
        30 * SEC,
    )
    .await;
    wait_for_sample(
        &base,
        r#"delay_bridge_level_messages{level="10m"}"#,
        3.0,
        30 * SEC,
    )
    .await;
    // A delivery is counted once its confirm is read, which can come after the target
    // queue's consumer has it (4.3.6 once scraped 3 here).
    wait_for_sample(&base, "delay_bridge_delivered_total", 4.0, 30 * SEC).await;
    let text = wait_for_sample(
        &base,
        r#"delay_bridge_pending_due_messages{le="+Inf"}"#,
        5.0,
        30 * SEC,
    )
    .await;
    let value =
        |series: &str| sample(&text, series).unwrap_or_else(|| panic!("{series} in:\n{text}"));
    assert_eq!(value("delay_bridge_delivered_total"), 4.0);
    assert_eq!(
        value(r#"delay_bridge_parked_total{reason="unroutable"}"#),
        2.0
    );
    assert_eq!(
        value(r#"delay_bridge_parked_total{reason="bad-delay"}"#),
        1.0
    );
    assert_eq!(
        value(r#"delay_bridge_parked_total{reason="target-missing"}"#),
        0.0
    );
    assert!(
        value("delay_bridge_consumed_total") >= 12.0,
        "12 published:\n{text}"
    );
    assert_eq!(value("delay_bridge_delivery_lateness_seconds_count"), 4.0);
    // When the bridge sent each delivery: before the broker confirmed it.
    assert_eq!(value("delay_bridge_publish_lateness_seconds_count"), 4.0);
    assert!(
        value("delay_bridge_publish_lateness_seconds_sum")
            <= value("delay_bridge_delivery_lateness_seconds_sum"),
        "{text}"
    );
    assert_eq!(value("delay_bridge_hops_per_message_count"), 4.0);
    assert!(
        value("delay_bridge_hops_per_message_sum") >= 4.0,
        "a 1 s delay takes at least one hop on this ladder:\n{text}"
    );
    // The test's own consumer empties the parked queue as messages arrive.
    assert_eq!(value("delay_bridge_parked_messages"), 0.0);
    assert_eq!(value("delay_bridge_held_messages"), 0.0);
    assert_eq!(value("delay_bridge_ready"), 1.0);
    // 10m holds messages due within 1h + margin: counted from the 6 h bucket on; 1h's
    // have no bound.
    assert_eq!(
        value(r#"delay_bridge_pending_due_messages{le="3600"}"#),
        0.0,
        "{text}"
    );
    assert_eq!(
        value(r#"delay_bridge_pending_due_messages{le="21600"}"#),
        3.0
    );
    assert_eq!(
        value(r#"delay_bridge_pending_due_messages{le="+Inf"}"#),
        5.0
    );

    // The dashboard and the alerting rules query only what the bridge exports.
    let exported = scraped_names(&text);
    for file in [
        "ops/grafana/delay-bridge.json",
        "ops/prometheus/delay-bridge-alerts.yml",
        "ops/prometheus/delay-bridge-alerts.test.yml",
    ] {
        let queried = queried_metric_names(file);
        assert!(queried.len() >= 3, "{file} queries {queried:?}");
        let unknown: Vec<&String> = queried.difference(&exported).collect();
        assert!(
            unknown.is_empty(),
            "{file} names metrics the bridge does not export: {unknown:?}\n{text}"
        );
    }

    // `delay-bridge health --ready`, as a container health check runs it, asks the same
    // listener; once the bridge stopped it fails.
    let listen = base.trim_start_matches("http://").parse().unwrap();
    let health_config = w.config_file_with(|config| {
        config.metrics = Some(MetricsConfig {
            listen,
            interval: Duration::from_secs(5),
        });
    });
    let health = || {
        let mut command = std::process::Command::new(bridge_exe());
        command
            .arg("--config")
            .arg(health_config.path())
            .args(["health", "--ready"]);
        command.output().expect("delay-bridge health runs")
    };
    let answer = health();
    assert!(answer.status.success(), "{answer:?}");
    assert_eq!(String::from_utf8_lossy(&answer.stdout), "ready\n");
    assert!(bridge.terminate(20 * SEC).await.unwrap().success());
    let answer = health();
    assert_eq!(answer.status.code(), Some(1), "{answer:?}");
    let _ = std::fs::remove_file(&log);
    w.cleanup().await;
}

/// A message that came back from its level while no bridge ran is read after its due time:
/// `delay_bridge_read_lateness_seconds` (the broker's part of the lateness) shows how late,
/// beside the delivery lateness; messages read in time count in its first bucket. The bridge
/// sends such a message on at once: `delay_bridge_publish_lateness_seconds` shows it as late
/// as it was read, and the one read in time as sent within a few ms of its due instant.
#[tokio::test]
async fn a_message_read_after_its_due_time_shows_in_read_lateness() {
    let mut w = World::start(Setup {
        ladder: "1s",
        margin: Duration::from_millis(250),
        ..Setup::new("read-late")
    })
    .await;
    let sent = w.publish("rk.read-late", b"late", with_delay(1_500)).await;
    let level = w.config.names.level_queue(SEC);
    let deadline = Instant::now() + 10 * SEC;
    while w.queue_depth(&level).await == 0 {
        assert!(Instant::now() < deadline, "no hop into `{level}`");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    w.stop_bridge().await;
    // Back in the returns queue with no bridge to read it, until well past its due time.
    let returns = w.config.names.returns_queue();
    let late_by: u32 = 600;
    let deadline = Instant::now() + 10 * SEC;
    while w.queue_depth(&returns).await == 0 || now_ms() < sent + 1_500 + u64::from(late_by) {
        assert!(Instant::now() < deadline, "the message never came back");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let config = w.config_file_with(|config| {
        config.metrics = Some(MetricsConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            interval: Duration::from_secs(5),
        });
    });
    let log = std::env::temp_dir().join(format!("{}.log", w.prefix()));
    let bridge = spawn_logging(&config, Some("info"), &log);
    let base = listener_url(&log, 30 * SEC).await;
    let late = w.recv_within(10 * SEC).await;
    assert_eq!(late.body, b"late");
    w.publish("rk.read-late", b"on time", with_delay(1_500))
        .await;
    assert_eq!(w.recv_within(10 * SEC).await.body, b"on time");
    let text = wait_for_sample(
        &base,
        "delay_bridge_read_lateness_seconds_count",
        2.0,
        10 * SEC,
    )
    .await;
    let value =
        |series: &str| sample(&text, series).unwrap_or_else(|| panic!("{series} in:\n{text}"));
    // The on-time one in the first bucket, the late one past 0.5 s.
    assert_eq!(
        value(r#"delay_bridge_read_lateness_seconds_bucket{le="0.001"}"#),
        1.0
    );
    assert_eq!(
        value(r#"delay_bridge_read_lateness_seconds_bucket{le="0.5"}"#),
        1.0,
        "{text}"
    );
    assert!(
        value("delay_bridge_read_lateness_seconds_sum") >= f64::from(late_by) / 1000.0,
        "{text}"
    );
    assert!(
        value("delay_bridge_delivery_lateness_seconds_sum")
            >= value("delay_bridge_read_lateness_seconds_sum"),
        "{text}"
    );
    // Sent: the late one as late as it was read, the other within the 0.25 s bucket.
    assert_eq!(
        value("delay_bridge_publish_lateness_seconds_count"),
        2.0,
        "{text}"
    );
    assert_eq!(
        value(r#"delay_bridge_publish_lateness_seconds_bucket{le="0.25"}"#),
        1.0,
        "{text}"
    );
    assert!(
        value("delay_bridge_publish_lateness_seconds_sum")
            >= value("delay_bridge_read_lateness_seconds_sum"),
        "{text}"
    );
    assert!(
        value("delay_bridge_delivery_lateness_seconds_sum")
            >= value("delay_bridge_publish_lateness_seconds_sum"),
        "{text}"
    );
    assert!(bridge.terminate(20 * SEC).await.unwrap().success());
    let _ = std::fs::remove_file(&log);
    w.cleanup().await;
}

/// `/healthz` answers as soon as the listener runs; `/readyz` answers 503 until the bridge
/// consumes, then 200.
#[tokio::test]
async fn readyz_is_503_until_the_bridge_consumes_then_200() {
    let w = World::without_bridge("readyz").await;
    let registry = Arc::new(MetricsRegistry::new());
    let bridge = Bridge::with_metrics(w.config.clone(), registry.recorder());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let stop = CancellationToken::new();
    let endpoints = Endpoints {
        registry,
        stats: bridge.stats(),
        ready: bridge.ready(),
    };
    let server = tokio::spawn(http::serve(listener, endpoints, stop.clone()));

    let (status, body) = get(&format!("{base}/healthz")).await;
    assert_eq!((status, body.as_str()), (200, "alive\n"));
    let (status, body) = get(&format!("{base}/readyz")).await;
    assert_eq!(status, 503, "not ready before the bridge runs: {body}");
    let (_, text) = get(&format!("{base}/metrics")).await;
    assert_eq!(sample(&text, "delay_bridge_ready"), Some(0.0), "{text}");

    let mut ready = bridge.ready();
    let running = tokio::spawn(bridge.run(stop.clone()));
    tokio::time::timeout(20 * SEC, ready.wait_for(|r| *r))
        .await
        .expect("the bridge is ready within 20 s")
        .expect("the bridge runs");
    let (status, body) = get(&format!("{base}/readyz")).await;
    assert_eq!((status, body.as_str()), (200, "ready\n"));

    stop.cancel();
    running.await.unwrap().expect("the bridge stops cleanly");
    server.await.unwrap().expect("the listener stops cleanly");
    w.cleanup().await;
}

#[test]
fn a_sample_is_read_by_its_exact_series() {
    let text = "# HELP x_total x\nx_total 3\nx_total{reason=\"a\"} 1\ny 2.5\n";
    assert_eq!(sample(text, "x_total"), Some(3.0));
    assert_eq!(sample(text, r#"x_total{reason="a"}"#), Some(1.0));
    assert_eq!(sample(text, "y"), Some(2.5));
    assert_eq!(sample(text, "z"), None);
}
