//! `delay-bridge demo`: a bridge in process, a few messages published with plain AMQP and
//! `x-delay`, each arrival printed as it happens, then everything it declared deleted.

use std::time::Duration;

use anyhow::{Context, Result, bail};
use lapin::BasicProperties;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable};

use delay_bridge::clock::now_ms;
use delay_bridge::config::Config;
use delay_bridge::ladder::format_duration;
use delay_bridge::plan::{hop_count, plan};

use delay_bridge::sandbox::{Sandbox, TargetBinding, watch_queue};

/// The delays the demo publishes, in publish order (ms): the 10 s one first.
const DELAYS_MS: [u64; 5] = [10_000, 3_000, 1_000, 2_500, 5_000];

/// Runs the demo against the configured broker with a throw-away prefix and route.
pub async fn run_demo(base: &Config) -> Result<()> {
    println!(
        "delay-bridge demo: broker {}, ladder of {} levels ({} .. {}), margin {}",
        base.url(),
        base.ladder.levels().len(),
        format_duration(base.ladder.smallest()),
        format_duration(base.ladder.largest()),
        format_duration(base.margin),
    );
    let sandbox = Sandbox::start(base, "delay-bridge-demo", TargetBinding::Fanout).await?;
    let prefix = sandbox.config.names.prefix().to_string();
    println!(
        "bridge running; publishing to exchange `{}` with plain AMQP and x-delay:",
        sandbox.ingress
    );
    let result = publish_and_watch(&sandbox).await;
    sandbox.finish().await?;
    println!("cleaned up: every exchange and queue of `{prefix}` deleted");
    result
}

async fn publish_and_watch(sandbox: &Sandbox) -> Result<()> {
    let (conn, ingress, config, stats) = (
        &sandbox.conn,
        sandbox.ingress.as_str(),
        &sandbox.config,
        sandbox
            .stats()
            .context("the demo's bridge runs in process")?,
    );
    let mut arrivals = watch_queue(conn, &sandbox.target_queue).await?;
    let publisher = conn.create_channel().await?;
    publisher
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let mut due = Vec::new();
    for delay in DELAYS_MS {
        let mut headers = FieldTable::default();
        headers.insert("x-delay".into(), AMQPValue::LongLongInt(delay as i64));
        let sent = now_ms();
        publisher
            .basic_publish(
                ingress.into(),
                format!("demo.{delay}ms").as_str().into(),
                BasicPublishOptions::default(),
                delay.to_string().as_bytes(),
                BasicProperties::default()
                    .with_message_id(format!("demo-{delay}").into())
                    .with_headers(headers),
            )
            .await?
            .await?;
        due.push((delay, sent + delay));
        println!(
            "  published x-delay {:>6} ms at {}  (due {})",
            delay,
            clock(sent),
            clock(sent + delay)
        );
    }
    println!("arrivals, as they happen:");
    println!(
        "  {:>8}  {:>12}  {:>12}  {:>8}  {:>12}",
        "x-delay", "due", "arrived", "late", "planned hops"
    );
    let mut order = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(40);
    while order.len() < DELAYS_MS.len() {
        let delivery = tokio::time::timeout_at(deadline, arrivals.recv())
            .await
            .context("not every demo message arrived within 40s")?
            .context("the demo consumer stopped")?;
        let arrived = delivery.at_ms;
        let delay: u64 = String::from_utf8_lossy(&delivery.body).parse()?;
        let due_at = due
            .iter()
            .find(|(d, _)| *d == delay)
            .map(|(_, at)| *at)
            .context("an unexpected message arrived")?;
        let hops = hop_count(&plan(
            Duration::from_millis(delay),
            &config.ladder,
            config.margin,
        ));
        println!(
            "  {:>5} ms  {}  {}  {:>+5} ms  {:>12}",
            delay,
            clock(due_at),
            clock(arrived),
            arrived as i64 - due_at as i64,
            hops
        );
        order.push(delay);
    }
    println!(
        "arrival order: {} ms. The 1000 ms message was published after the 10000 ms one and was not held back by it.",
        order
            .iter()
            .map(|d| d.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!(
        "bridge counters: {} hops, {} delivered, {} parked",
        stats.snapshot().hops,
        stats.snapshot().delivered,
        stats.snapshot().parked
    );
    if !order.windows(2).all(|w| w[0] <= w[1]) {
        bail!("messages arrived out of delay order: {order:?}");
    }
    Ok(())
}

/// `HH:MM:SS.mmm` (UTC) of an epoch-ms instant.
fn clock(ms: u64) -> String {
    chrono::DateTime::from_timestamp_millis(ms as i64)
        .map(|t| t.format("%H:%M:%S%.3f").to_string())
        .unwrap_or_default()
}
