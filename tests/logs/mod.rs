//! Logs leak nothing: no message body or header value at the default level, no password at
//! any level, trace included.

use std::time::Duration;

use delay_bridge::config::BrokerUrl;
use lapin::BasicProperties;
use lapin::types::AMQPValue;

use crate::support::*;

const SEC: Duration = Duration::from_secs(1);

#[tokio::test]
async fn logs_leak_neither_bodies_nor_header_values_nor_the_password() {
    let mut w = World::without_bridge("logs").await;
    let tag = format!("{:08x}", rand::random::<u32>());
    let (user, password) = (format!("logs-{tag}"), format!("pw-SECRET-{tag}"));
    let test_user = TestUser::create(&user, &password, [".*", ".*", ".*"]);
    let with_user = test_user.url(&password);
    let config = w.config_file_with(|config| {
        config.urls = vec![BrokerUrl::parse(&with_user).expect("a URL")];
    });
    let log = std::env::temp_dir().join(format!("{}.log", w.prefix()));

    // Default level: a message parked for a bad x-delay and one parked unroutable.
    let bridge = spawn_logging(&config, None, &log);
    wait_for_consumers(&w, 1, 20 * SEC).await;
    let bad = BasicProperties::default().with_headers(headers(vec![(
        "x-delay",
        text_value(&format!("DELAY-SECRET-{tag}")),
    )]));
    w.publish("rk.logs", format!("BODY-SECRET-{tag}").as_bytes(), bad)
        .await;
    let unroutable = with_delay(100).with_headers(headers(vec![
        ("x-delay", AMQPValue::LongLongInt(100)),
        ("app", text_value(&format!("HEADER-SECRET-{tag}"))),
    ]));
    w.publish(
        "nobody.logs",
        format!("BODY-SECRET-{tag}").as_bytes(),
        unroutable,
    )
    .await;
    for _ in 0..2 {
        w.parked_within(10 * SEC).await;
    }
    assert!(bridge.terminate(20 * SEC).await.unwrap().success());
    let default_log = std::fs::read_to_string(&log).unwrap();
    assert_eq!(
        default_log.matches("parking message").count(),
        2,
        "both parkings are logged:\n{default_log}"
    );
    assert!(
        !default_log.contains("SECRET"),
        "a secret in the log:\n{default_log}"
    );
    assert!(
        !default_log.contains('\u{1b}'),
        "colour codes in a log file"
    );

    // Trace level: the connection handshake and everything after it.
    let bridge = spawn_logging(&config, Some("trace"), &log);
    wait_for_consumers(&w, 1, 20 * SEC).await;
    assert!(bridge.terminate(20 * SEC).await.unwrap().success());
    let trace_log = std::fs::read_to_string(&log).unwrap();
    assert!(
        trace_log.lines().count() > 50,
        "trace logging is on ({} lines)",
        trace_log.lines().count()
    );
    assert!(
        !trace_log.contains(&password),
        "the password is in the trace log"
    );
    let _ = std::fs::remove_file(&log);
    w.cleanup().await;
}

/// `log.format = "json"`: every line the daemon writes is one JSON object with its time,
/// level and message, the fields of the event beside them.
#[tokio::test]
async fn the_json_log_format_writes_one_object_per_line() {
    let mut w = World::without_bridge("jsonlog").await;
    let config = w.config_file_with(|config| {
        config.log_format = delay_bridge::config::LogFormat::Json;
    });
    let log = std::env::temp_dir().join(format!("{}.log", w.prefix()));
    let bridge = spawn_logging(&config, None, &log);
    wait_for_consumers(&w, 1, 20 * SEC).await;
    let bad =
        BasicProperties::default().with_headers(headers(vec![("x-delay", text_value("soon"))]));
    w.publish("rk.jsonlog", b"bad", bad).await;
    w.parked_within(10 * SEC).await;
    assert!(bridge.terminate(20 * SEC).await.unwrap().success());
    let text = std::fs::read_to_string(&log).unwrap();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}")))
        .collect();
    assert!(lines.len() >= 3, "starting, consuming, parking:\n{text}");
    for line in &lines {
        for key in ["timestamp", "level", "message"] {
            assert!(line.get(key).is_some(), "no {key} in {line}");
        }
    }
    let parking = lines
        .iter()
        .find(|line| line["message"] == "parking message")
        .unwrap_or_else(|| panic!("the parking is logged:\n{text}"));
    assert_eq!(parking["level"], "WARN");
    assert_eq!(parking["reason"], "bad-delay");
    let _ = std::fs::remove_file(&log);
    w.cleanup().await;
}

fn text_value(s: &str) -> AMQPValue {
    AMQPValue::LongString(s.into())
}
