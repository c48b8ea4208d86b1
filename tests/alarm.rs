//! A broker resource alarm (`connection.blocked`): logged once with its reason, deliveries
//! wait safely and resume when it clears, and SIGTERM during an alarm still exits within
//! `shutdown_timeout`.
//!
//! A test binary of its own: the alarm blocks every publisher on the broker, and Cargo runs
//! test binaries one after another, so no other test publishes meanwhile.

mod support;

use std::time::{Duration, Instant};

use support::*;

const SEC: Duration = Duration::from_secs(1);
/// The messages' delay: longer than raising an alarm with rabbitmqctl takes.
const DELAY: Duration = Duration::from_secs(6);

/// Raises a memory alarm on the test broker; clears it when dropped (also on a panic).
struct MemoryAlarm {
    restore: String,
}

impl MemoryAlarm {
    fn raise() -> MemoryAlarm {
        let out = rabbitmqctl()
            .args(["eval", "vm_memory_monitor:get_vm_memory_high_watermark()."])
            .output()
            .expect("rabbitmqctl runs");
        let current = String::from_utf8_lossy(&out.stdout).trim().to_string();
        let restore = if current.parse::<f64>().is_ok() {
            current
        } else {
            "0.4".to_string()
        };
        set_watermark("0");
        MemoryAlarm { restore }
    }
}

impl Drop for MemoryAlarm {
    fn drop(&mut self) {
        set_watermark(&self.restore);
    }
}

fn set_watermark(value: &str) {
    let out = rabbitmqctl()
        .args(["set_vm_memory_high_watermark", value])
        .output()
        .expect("rabbitmqctl runs");
    assert!(
        out.status.success(),
        "set_vm_memory_high_watermark {value}: {out:?}"
    );
}

fn blocked_lines(log: &std::path::Path) -> usize {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .matches("the broker blocked publishing")
        .count()
}

async fn wait_for_blocked_lines(log: &std::path::Path, n: usize, within: Duration) {
    let deadline = Instant::now() + within;
    while blocked_lines(log) < n {
        assert!(
            Instant::now() < deadline,
            "the bridge did not log the alarm within {within:?}:\n{}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn publish_batch(w: &World, first: usize, n: usize, delay_ms: i64) {
    for i in first..first + n {
        w.publish(
            "rk.alarm",
            i.to_string().as_bytes(),
            with_delay(delay_ms).with_message_id(i.to_string().into()),
        )
        .await;
    }
}

fn ids(got: &[Received]) -> Vec<usize> {
    let mut ids: Vec<usize> = got
        .iter()
        .map(|m| String::from_utf8_lossy(&m.body).parse().unwrap())
        .collect();
    ids.sort();
    ids
}

#[tokio::test]
async fn a_resource_alarm_stalls_deliveries_safely_and_sigterm_still_exits_in_time() {
    let mut w = World::without_bridge("alarm").await;
    let config = w.config_file(1000);
    let log = std::env::temp_dir().join(format!("{}.log", w.prefix()));

    // 1. Blocked while messages come due: logged once with its reason, nothing arrives, not
    // even past the due time. (Raising the alarm takes rabbitmqctl a second or two: the
    // delays leave room for it, so the bridge still has hops to publish once it is up.)
    let bridge = spawn_logging(&config, Some("info"), &log);
    wait_for_consumers(&w, 1, 20 * SEC).await;
    let due = Instant::now() + DELAY;
    publish_batch(&w, 0, 20, DELAY.as_millis() as i64).await;
    let alarm = MemoryAlarm::raise();
    wait_for_blocked_lines(&log, 1, 10 * SEC).await;
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("memory"), "the reason is logged:\n{text}");
    w.assert_quiet((due + SEC).saturating_duration_since(Instant::now()))
        .await;
    assert_eq!(blocked_lines(&log), 1, "the alarm is logged once");

    // 2. Cleared: every message arrives, once.
    drop(alarm);
    let got = w.recv_n(20, 15 * SEC).await;
    assert_eq!(ids(&got), (0..20).collect::<Vec<_>>());
    w.assert_quiet(Duration::from_millis(500)).await;

    // 3. SIGTERM while blocked with deliveries waiting: exits within shutdown_timeout (5 s).
    publish_batch(&w, 100, 10, DELAY.as_millis() as i64).await;
    let alarm = MemoryAlarm::raise();
    wait_for_blocked_lines(&log, 2, 10 * SEC).await;
    let asked = Instant::now();
    let status = bridge.terminate(15 * SEC).await.unwrap();
    let took = asked.elapsed();
    println!("exited {took:?} after SIGTERM during the alarm (shutdown_timeout 5 s)");
    assert!(status.success(), "exit status {status:?}");
    assert!(took < 6 * SEC, "exited {took:?} after SIGTERM");
    drop(alarm);

    // 4. Nothing was lost: the next bridge delivers what waited. A delivery the broker took
    // but had not confirmed when the first bridge stopped comes again (at least once).
    let bridge = spawn_logging(&config, Some("info"), &log);
    let mut got = Vec::new();
    let deadline = Instant::now() + 20 * SEC;
    loop {
        let mut distinct = ids(&got);
        distinct.dedup();
        if distinct == (100..110).collect::<Vec<_>>() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "after the restart only {distinct:?} of 100..110 arrived"
        );
        got.extend(w.drain_quiet(Duration::from_millis(300)).await);
    }
    got.extend(w.drain_quiet(Duration::from_millis(500)).await);
    let duplicates = got.len() - 10;
    println!("after the restart: 10 of 10 delivered, {duplicates} twice");
    assert!(duplicates <= 10, "{duplicates} duplicates of 10 in flight");
    assert!(bridge.terminate(20 * SEC).await.unwrap().success());
    let _ = std::fs::remove_file(&log);
    w.cleanup().await;
}
