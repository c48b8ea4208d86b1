//! `delay-bridge demo`: a bridge in process with its metrics listener, a few messages
//! published with plain AMQP and `x-delay`, each arrival printed as it happens, the bridge's
//! `/metrics` after that traffic, then everything it declared deleted.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use lapin::BasicProperties;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable};
use tokio_util::sync::CancellationToken;

use delay_bridge::bridge::Bridge;
use delay_bridge::clock::now_ms;
use delay_bridge::config::{Config, MetricsConfig};
use delay_bridge::http::{self, Endpoints, MetricsRegistry};
use delay_bridge::ladder::format_duration;

use crate::output::outln;
use crate::plan_cmd::{PlanSettings, path, path_hops};
use delay_bridge::sandbox::{Sandbox, TargetBinding, watch_queue};

/// The delays the demo publishes, in publish order (ms): the 10 s one first.
const DELAYS_MS: [u64; 5] = [10_000, 3_000, 1_000, 2_500, 5_000];

/// How often the demo's bridge reads its queue depths for the pending gauges.
const DEPTHS_EVERY: Duration = Duration::from_millis(500);

/// Runs the demo against the configured broker with a throw-away prefix and route.
pub async fn run_demo(base: &Config) -> Result<()> {
    outln!(
        "delay-bridge demo: broker {}, ladder of {} levels ({} .. {}), margin {}",
        base.url(),
        base.ladder.levels().len(),
        format_duration(base.ladder.smallest()),
        format_duration(base.ladder.largest()),
        format_duration(base.margin),
    )?;
    let mut sandbox = Sandbox::declare(base, "delay-bridge-demo", TargetBinding::Fanout).await?;
    // The configured listener, or any free port on loopback; queue depths read often enough
    // for a run of seconds.
    let listen = base
        .metrics
        .map_or_else(|| "127.0.0.1:0".parse().expect("an address"), |m| m.listen);
    sandbox.config.metrics = Some(MetricsConfig {
        listen,
        interval: DEPTHS_EVERY,
    });
    let registry = Arc::new(MetricsRegistry::new());
    let bridge = Bridge::with_metrics(sandbox.config.clone(), registry.recorder());
    let endpoints = Endpoints {
        registry,
        stats: bridge.stats(),
        ready: bridge.ready(),
    };
    sandbox.run_bridge(bridge).await?;
    let prefix = sandbox.config.names.prefix().to_string();
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("cannot listen on {listen} for the demo's metrics"))?;
    let metrics_url = format!("http://{}/metrics", listener.local_addr()?);
    let stop_serving = CancellationToken::new();
    let _stop_serving_on_exit = stop_serving.clone().drop_guard();
    tokio::spawn(http::serve(listener, endpoints, stop_serving));
    // From here on the sandbox is deleted whatever happens, a failed write included.
    let mut result = outln!("bridge running, metrics on {metrics_url}").and_then(|()| {
        outln!(
            "publishing to exchange `{}` with plain AMQP and x-delay:",
            sandbox.ingress
        )
    });
    if result.is_ok() {
        result = publish_and_watch(&sandbox).await;
    }
    if result.is_ok() {
        result = print_metrics(&metrics_url).await;
    }
    sandbox.finish().await?;
    // The demo's own failure, if any, wins over a failed last line.
    let said = outln!("cleaned up: every exchange and queue of `{prefix}` deleted");
    result?;
    said
}

/// GETs the demo bridge's `/metrics` once its queue depths show nothing pending (they are
/// read every [`DEPTHS_EVERY`]), and prints its samples that are not zero, histogram
/// buckets left out.
async fn print_metrics(url: &str) -> Result<()> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let text = loop {
        let text = reqwest::get(url)
            .await
            .with_context(|| format!("GET {url}"))?
            .text()
            .await?;
        let nothing_pending = text
            .lines()
            .any(|line| line == r#"delay_bridge_pending_due_messages{le="+Inf"} 0"#);
        if nothing_pending || tokio::time::Instant::now() > deadline {
            break text;
        }
        tokio::time::sleep(DEPTHS_EVERY / 4).await;
    };
    let mut samples: Vec<&str> = text
        .lines()
        .filter(|line| !line.starts_with('#') && !line.contains("_bucket{"))
        .filter(|line| line.rsplit_once(' ').is_some_and(|(_, value)| value != "0"))
        .collect();
    samples.sort_unstable();
    outln!("GET {url} after the demo traffic (samples that are not zero, without buckets):")?;
    for sample in samples {
        outln!("  {sample}")?;
    }
    Ok(())
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
        outln!(
            "  published x-delay {:>6} ms at {}  (due {})",
            delay,
            clock(sent),
            clock(sent + delay)
        )?;
    }
    // The path `delay-bridge plan` shows for each delay under this configuration.
    let planned = PlanSettings::new(
        config.ladder.clone(),
        config.margin,
        config.max_delay,
        config.hop_window,
        config.bundle_hops,
    );
    outln!("arrivals, as they happen:")?;
    outln!(
        "  {:>8}  {:>12}  {:>12}  {:>8}  {:>12}",
        "x-delay",
        "due",
        "arrived",
        "late",
        "planned hops"
    )?;
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
        let hops = path_hops(&path(Duration::from_millis(delay), &planned));
        outln!(
            "  {:>5} ms  {}  {}  {:>+5} ms  {:>12}",
            delay,
            clock(due_at),
            clock(arrived),
            arrived as i64 - due_at as i64,
            hops
        )?;
        order.push(delay);
    }
    outln!(
        "arrival order: {} ms. The 1000 ms message was published after the 10000 ms one and was not held back by it.",
        order
            .iter()
            .map(|d| d.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    )?;
    outln!(
        "bridge counters: {} hops, {} delivered, {} parked",
        stats.snapshot().hops,
        stats.snapshot().delivered,
        stats.snapshot().parked
    )?;
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
