//! `delay-bridge-bench client-relay`: what the AMQP client costs per message, at a moderate
//! rate or flat out. The bridge relays each delayed message at least twice (work queue to a
//! level, work queue to its target); this scenario relays a stream once (consume, publish
//! with a confirm, ack) with each client in turn, each relay in a child process on one
//! runtime worker as the bridge runs, and reports the relay's CPU time per message beside
//! the broker's. lapin is the bridge's client; amqprs runs its I/O as tasks on the caller's
//! runtime instead of a thread of its own; `bare` is the library's bare connection, one task
//! reading and writing frames, what a client of our own would cost; `wire` is the library's
//! own connection (`amqp::wire`), used as the lapin relay uses lapin.

mod amqprs_relay;
mod bare_relay;
mod child;
pub mod job;
mod lapin_relay;
mod wire_relay;

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

use delay_bridge::amqp;
use delay_bridge::config::Config;
use delay_bridge::contract::PERSISTENT;
use delay_bridge::sandbox::queue_counts;

use super::above_zero::above_zero;
use super::broker_process::BrokerProcess;
use super::load::{Arrivals, Collector, Outgoing, body, now_us, publish};
use super::{Spread, Target, print_targets, targets_json};
use job::{ChildReport, Client};

pub use child::main as child_main;

/// How long a relay child may take to consume.
const READY_WITHIN: Duration = Duration::from_secs(30);

/// `bench client-relay` options.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Messages per second published to each relay.
    #[arg(long, default_value_t = 2000.0, value_parser = above_zero)]
    rate: f64,
    /// Seconds of load per client (`rate` x `seconds` messages).
    #[arg(long, default_value_t = 30)]
    seconds: u64,
    /// Publish the same count as fast as confirms allow instead of at `rate`.
    #[arg(long)]
    flat_out: bool,
    /// Body size, bytes (at least 16).
    #[arg(long, default_value_t = 100)]
    body_size: usize,
}

/// One client's run.
struct Outcome {
    client: Client,
    report: ChildReport,
    arrivals: Arrivals,
    /// Messages still in the relay's source queue after it exited (not acked).
    left_unacked: u64,
    broker_cpu: Option<Duration>,
    /// From the first publish to the last arrival.
    seconds: f64,
}

impl Outcome {
    fn msg_per_s(&self) -> f64 {
        self.arrivals.received as f64 / self.seconds.max(1e-6)
    }

    fn relay_us(&self) -> f64 {
        self.report.cpu_us as f64 / self.report.relayed.max(1) as f64
    }

    fn broker_us(&self) -> Option<f64> {
        self.broker_cpu
            .map(|cpu| cpu.as_secs_f64() * 1e6 / self.arrivals.expected.max(1) as f64)
    }

    fn switches(&self) -> f64 {
        self.report.context_switches as f64 / self.report.relayed.max(1) as f64
    }

    fn exact(&self) -> bool {
        self.arrivals.missing() == 0 && self.arrivals.duplicates == 0 && self.left_unacked == 0
    }

    fn json(&self) -> Value {
        let latency = Spread::of(&self.arrivals.lateness_us);
        json!({
            "msg_per_s": self.msg_per_s().round(),
            "relay_cpu_us_per_msg": self.relay_us().round(),
            "relay_context_switches_per_msg": (self.switches() * 100.0).round() / 100.0,
            "broker_cpu_us_per_msg": self.broker_us().map(f64::round),
            "missing": self.arrivals.missing(),
            "duplicates": self.arrivals.duplicates,
            "left_unacked": self.left_unacked,
            "latency_p50_ms": latency.map(|s| s.p50 as f64 / 1000.0),
            "latency_p99_ms": latency.map(|s| s.p99 as f64 / 1000.0),
        })
    }
}

/// The two queues of one relay, uniquely named: it consumes `from` and publishes to `to`.
struct RelayQueues {
    from: String,
    to: String,
}

impl RelayQueues {
    async fn declare(conn: &Connection) -> Result<Self> {
        let prefix = format!(
            "delay-bridge-bench-relay-{:06x}",
            rand::random::<u32>() & 0xff_ffff
        );
        let queues = Self {
            from: format!("{prefix}.from"),
            to: format!("{prefix}.to"),
        };
        let channel = conn.create_channel().await?;
        for queue in [&queues.from, &queues.to] {
            let durable = QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            };
            channel
                .queue_declare(queue.as_str().into(), durable, FieldTable::default())
                .await?;
        }
        let _ = channel.close(200, "declared".into()).await;
        Ok(queues)
    }

    async fn delete(&self, conn: &Connection) -> Result<()> {
        let channel = conn.create_channel().await?;
        for queue in [&self.from, &self.to] {
            channel
                .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
                .await?;
        }
        let _ = channel.close(200, "deleted".into()).await;
        Ok(())
    }
}

/// Runs the scenario: each client in turn on its own pair of queues.
pub async fn run(base: &Config, config_path: &Path, args: &Args) -> Result<()> {
    let count = (args.rate * args.seconds as f64).round().max(1.0) as u64;
    let broker = match BrokerProcess::find(base.url().expose()) {
        Ok(broker) => Some(broker),
        Err(e) => {
            tracing::warn!("the broker's CPU is not measured: {e:#}");
            None
        }
    };
    let conn = amqp::connect(base.url(), "delay-bridge bench client-relay").await?;
    let mut outcomes = Vec::new();
    for client in Client::ALL {
        let queues = RelayQueues::declare(&conn).await?;
        let outcome = measure(
            base,
            config_path,
            &conn,
            &queues,
            broker.as_ref(),
            client,
            count,
            args,
        )
        .await;
        queues.delete(&conn).await?;
        outcomes.push(outcome?);
    }
    let _ = conn.close(200, "done".into()).await;
    report(base, broker.as_ref(), args, count, &outcomes);
    Ok(())
}

/// One client's relay under the paced load.
#[allow(clippy::too_many_arguments)]
async fn measure(
    base: &Config,
    config_path: &Path,
    conn: &Connection,
    queues: &RelayQueues,
    broker: Option<&BrokerProcess>,
    client: Client,
    count: u64,
    args: &Args,
) -> Result<Outcome> {
    let executable = std::env::current_exe().context("finding this executable")?;
    let mut child = Command::new(executable)
        .arg("--config")
        .arg(config_path)
        .arg("relay-child")
        .args([
            "--client",
            client.name(),
            "--from",
            &queues.from,
            "--to",
            &queues.to,
        ])
        .args(["--count", &count.to_string()])
        .args(["--prefetch", &base.prefetch.to_string()])
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .context("starting the relay child process")?;
    let stdout = child.stdout.take().context("the relay's output")?;
    let mut lines = BufReader::new(stdout).lines();
    let consuming = async {
        while let Some(line) = lines.next_line().await? {
            if line == child::READY {
                return Ok(());
            }
        }
        bail!("the {} relay exited before consuming", client.name())
    };
    tokio::time::timeout(READY_WITHIN, consuming)
        .await
        .with_context(|| {
            format!(
                "the {} relay did not consume within {READY_WITHIN:?}",
                client.name()
            )
        })??;

    let collector = Collector::start(conn, &queues.to, count).await?;
    let channel = amqp::confirm_channel(conn).await?;
    let broker_start = broker.map(BrokerProcess::cpu).transpose()?;
    let rate = (!args.flat_out).then_some(args.rate);
    let published = publish(&channel, count, rate, |seq| Outgoing {
        exchange: "".into(),
        routing_key: queues.from.as_str().into(),
        body: body(seq, now_us(), args.body_size),
        properties: BasicProperties::default().with_delivery_mode(PERSISTENT),
    })
    .await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let arrivals = collector.finish(deadline, Duration::ZERO).await?;
    let broker_end = broker.map(BrokerProcess::cpu).transpose()?;
    let _ = channel.close(200, "published".into()).await;
    let published = published?;
    let seconds = arrivals.last_us.saturating_sub(published.started_us) as f64 / 1e6;

    let line = tokio::time::timeout(Duration::from_secs(60), lines.next_line())
        .await
        .context("the relay did not report within 60 s")??
        .context("the relay exited without its report")?;
    let report: ChildReport =
        serde_json::from_str(&line).with_context(|| format!("the relay's report: {line}"))?;
    let status = child.wait().await?;
    if !status.success() {
        bail!("the {} relay failed: {status}", client.name());
    }
    let left_unacked = queue_counts(conn, &queues.from).await?.messages;
    Ok(Outcome {
        client,
        report,
        arrivals,
        left_unacked,
        broker_cpu: broker_start
            .zip(broker_end)
            .map(|(a, b)| b.saturating_sub(a)),
        seconds,
    })
}

/// Prints the table, the targets and the JSON line.
fn report(
    base: &Config,
    broker: Option<&BrokerProcess>,
    args: &Args,
    count: u64,
    outcomes: &[Outcome],
) {
    let pace = if args.flat_out {
        "flat out".to_string()
    } else {
        format!("at {} msg/s", args.rate)
    };
    println!(
        "client-relay: {count} messages of {} B {pace}, relayed once (consume, publish confirmed, ack) by each client in turn, in a child process on one runtime worker",
        args.body_size
    );
    println!(
        "broker: {} ({})",
        base.url(),
        broker.map_or_else(|| "process not found".into(), BrokerProcess::describe)
    );
    println!(
        "{:<8} {:>8} {:>14} {:>18} {:>14} {:>8} {:>8} {:>8} {:>8}",
        "client",
        "msg/s",
        "relay us/msg",
        "ctx switches/msg",
        "broker us/msg",
        "missing",
        "dup",
        "p50 ms",
        "p99 ms"
    );
    for outcome in outcomes {
        let latency = Spread::of(&outcome.arrivals.lateness_us);
        println!(
            "{:<8} {:>8.0} {:>14.0} {:>18.2} {:>14} {:>8} {:>8} {:>8.1} {:>8.1}",
            outcome.client.name(),
            outcome.msg_per_s(),
            outcome.relay_us().round(),
            outcome.switches(),
            outcome
                .broker_us()
                .map_or_else(|| "-".into(), |us| format!("{us:.0}")),
            outcome.arrivals.missing(),
            outcome.arrivals.duplicates,
            latency.map_or(f64::NAN, |s| s.p50 as f64 / 1000.0),
            latency.map_or(f64::NAN, |s| s.p99 as f64 / 1000.0),
        );
    }
    // Each client's relay CPU per message over lapin's, lapin first.
    let ratios: Vec<(&str, f64)> = match outcomes.split_first() {
        Some((lapin, others)) => others
            .iter()
            .map(|o| (o.client.name(), o.relay_us() / lapin.relay_us().max(1e-9)))
            .collect(),
        None => Vec::new(),
    };
    for (client, ratio) in &ratios {
        println!("relay CPU per message, {client} / lapin: {ratio:.2}");
    }
    let targets: Vec<Target> = outcomes
        .iter()
        .map(|o| {
            Target::new(
                format!("{}: every message relayed once and acked", o.client.name()),
                format!(
                    "{} missing, {} duplicated, {} unacked",
                    o.arrivals.missing(),
                    o.arrivals.duplicates,
                    o.left_unacked
                ),
                o.exact(),
            )
        })
        .collect();
    print_targets(&targets);
    let mut report = json!({
        "scenario": "client-relay",
        "rate": if args.flat_out { Value::from("flat out") } else { Value::from(args.rate) },
        "count": count,
        "body_size": args.body_size,
        "targets": targets_json(&targets),
    });
    if let Some(object) = report.as_object_mut() {
        for outcome in outcomes {
            object.insert(outcome.client.name().into(), outcome.json());
        }
        for (client, ratio) in ratios {
            object.insert(
                format!("relay_cpu_ratio_{client}_to_lapin"),
                Value::from((ratio * 100.0).round() / 100.0),
            );
        }
    }
    println!("{report}");
}
