//! Publishers in other languages work unchanged.

use std::time::Duration;

use lapin::BasicProperties;
use lapin::types::AMQPValue;

use crate::support::*;

const SEC: Duration = Duration::from_secs(1);

/// A python with pika: `DELAY_BRIDGE_PYTHON`, else the one `scripts/python-env.sh` finds or
/// makes (a venv under the project). `None` when neither works (no python3 or no PyPI).
pub fn pika_python() -> Option<String> {
    if let Ok(python) = std::env::var("DELAY_BRIDGE_PYTHON") {
        return Some(python);
    }
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/python-env.sh");
    let out = std::process::Command::new("bash")
        .arg(script)
        .output()
        .ok()?;
    let path = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (out.status.success() && !path.is_empty()).then_some(path)
}

#[tokio::test]
async fn a_python_pika_publisher_works_unchanged() {
    let Some(python) = pika_python() else {
        eprintln!(
            "SKIPPED a_python_pika_publisher_works_unchanged: no python with pika \
             (set DELAY_BRIDGE_PYTHON, or let scripts/python-env.sh make .venv)"
        );
        return;
    };
    let mut w = World::start(Setup {
        ladder: "200ms 500ms",
        margin: Duration::from_millis(30),
        ..Setup::new("pika")
    })
    .await;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/pika_publisher.py");
    let out = tokio::process::Command::new(&python)
        .args([script, &broker_url(), &w.ingress])
        .output()
        .await
        .expect("run the pika publisher");
    assert!(
        out.status.success(),
        "pika publisher failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let started: u64 = String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .expect("the publisher prints when it began publishing");
    let got = w.recv_n(3, 10 * SEC).await;
    let bodies: Vec<&[u8]> = got.iter().map(|m| m.body.as_slice()).collect();
    assert_eq!(
        bodies,
        vec![&b"int 400"[..], b"str 900", b"int 1500"],
        "sorted by delay"
    );
    for (m, delay) in got.iter().zip([400i32, 900, 1500]) {
        let late = m.at_ms as i64 - (started as i64 + i64::from(delay));
        assert!(late < 1_000, "lateness {late} ms");
        assert_eq!(m.routing_key, "rk.pika");
        assert_eq!(m.properties.content_type(), &Some("text/plain".into()));
        assert_eq!(m.properties.delivery_mode(), &Some(2));
        assert_eq!(m.header("x-delay"), Some(&AMQPValue::LongInt(-delay)));
        assert_eq!(m.header("tenant"), Some(&text("acme")));
        assert_eq!(m.header("attempt"), Some(&AMQPValue::LongInt(3)));
        assert!(m.header("delay-bridge-hops").is_none());
    }
    assert_eq!(got[0].properties.message_id(), &Some("py-1".into()));
    w.cleanup().await;
}

/// A publisher written for Tanzu RabbitMQ's delayed queues sets the AMQP 1.0 annotations
/// `x-opt-delivery-time` (epoch ms) or `x-opt-delivery-delay` (ms); sent as headers, the
/// bridge reads them as it reads `x-deliver-at` and `x-delay`.
#[tokio::test]
async fn the_delivery_annotations_of_tanzu_delayed_queues_work_as_headers() {
    let mut w = World::start(Setup::new("annotations")).await;
    let sent = delay_bridge::clock::now_ms();
    let by_time = BasicProperties::default().with_headers(headers(vec![(
        "x-opt-delivery-time",
        AMQPValue::LongLongInt(sent as i64 + 1_200),
    )]));
    w.publish("rk.by-time", b"by-time", by_time).await;
    let by_delay = BasicProperties::default().with_headers(headers(vec![(
        "x-opt-delivery-delay",
        AMQPValue::LongInt(600),
    )]));
    w.publish("rk.by-delay", b"by-delay", by_delay).await;
    let first = w.recv_within(10 * SEC).await;
    let second = w.recv_within(10 * SEC).await;
    assert_eq!(
        (first.routing_key.as_str(), second.routing_key.as_str()),
        ("rk.by-delay", "rk.by-time"),
        "the 600 ms one first"
    );
    assert!(
        first.at_ms >= sent + 600,
        "not early: {}",
        first.at_ms - sent
    );
    assert!(
        second.at_ms >= sent + 1_200,
        "not early: {}",
        second.at_ms - sent
    );
    assert!(
        second.at_ms < sent + 1_200 + 1_000,
        "late: {}",
        second.at_ms - sent
    );
    w.assert_quiet(Duration::from_millis(300)).await;
    w.cleanup().await;
}
