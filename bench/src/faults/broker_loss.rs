//! `node-loss` and `broker-crash`: a broker process is killed mid-run (`--kill`, a shell
//! command such as `bash scripts/cluster.sh kill 1`) and started again later
//! (`--restart`). The sandbox declares everything through the first configured broker, so
//! with quorum queues on a cluster that node leads every queue; the bridges, the publisher
//! and the collector start on the others (each one's broker list begins one node further),
//! and move on when theirs goes.
//!
//! The failover is measured from the kill until some bridge consumes the work queue again,
//! read through a broker that stays up.

use std::time::Duration;

use anyhow::{Context, Result, bail};
use delay_bridge_bench::report;

use delay_bridge::config::{BrokerUrl, Config};
use delay_bridge::ladder::{format_duration, parse_duration};
use delay_bridge::sandbox::process::{BridgeProcess, ConfigFile, ProcessLog};
use delay_bridge::sandbox::{Sandbox, TargetBinding, queue_counts};

use super::traffic::{FaultCollector, connect_any};
use super::{Load, Tally, spawn_load, tally_after};
use crate::Target;
use crate::measured_bridge::bridge_executable;

/// `node-loss` / `broker-crash` options.
#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(flatten)]
    load: Load,
    /// The shell command that kills the broker (or node) that leads the queues.
    #[arg(long)]
    kill: String,
    /// The shell command that starts it again (returns once it is up).
    #[arg(long)]
    restart: String,
    /// When to kill, from the first publish.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    kill_after: Duration,
    /// When to start it again, from the first publish.
    #[arg(long, default_value = "25s", value_parser = parse_duration)]
    restart_after: Duration,
    /// Bridge processes (each starts on the next broker of the list).
    #[arg(long, default_value_t = 2)]
    bridges: usize,
}

/// How long the bridges may take to consume after they start.
const READY_WITHIN: Duration = Duration::from_secs(60);
/// How late a message may be beyond the failover.
const BEYOND_FAILOVER: Duration = Duration::from_secs(10);

/// Runs the scenario under `name` (`node-loss` or `broker-crash`).
pub async fn run(base: &Config, args: &Args, name: &'static str) -> Result<()> {
    args.load.check()?;
    anyhow::ensure!(
        args.kill_after < args.restart_after,
        "--kill-after must come before --restart-after"
    );
    anyhow::ensure!(args.bridges >= 1, "--bridges must be at least 1");
    let sandbox = Sandbox::declare(
        base,
        &format!("delay-bridge-faults-{name}"),
        TargetBinding::Fanout,
    )
    .await?;
    let result = measure(&sandbox, args, name).await;
    let cleaned = sandbox.finish().await;
    let (tally, failover) = result?;
    cleaned?;
    let mut targets = vec![tally.none_missing()];
    let max_us = tally.lateness().map_or(i64::MAX, |s| s.max);
    if let Some(failover) = failover {
        let limit = failover + BEYOND_FAILOVER;
        targets.push(Target::new(
            format!(
                "max lateness <= failover + {}",
                format_duration(BEYOND_FAILOVER)
            ),
            format!(
                "{} ms (failover {})",
                crate::ms(max_us),
                format_duration(failover)
            ),
            max_us <= limit.as_micros() as i64,
        ));
    }
    tally.print(
        &[
            args.load.describe(),
            format!(
                "{} queues; {} bridge process(es); `{}` at {}, `{}` at {}; failover (kill to consuming again): {}",
                base.queue_type,
                args.bridges,
                args.kill,
                format_duration(args.kill_after),
                args.restart,
                format_duration(args.restart_after),
                failover.map_or("not seen".into(), format_duration)
            ),
        ],
        &targets,
        report::FaultDone {
            queue_type: Some(base.queue_type.to_string()),
            failover_ms: failover.map(|f| f.as_millis() as u64),
            ..Default::default()
        },
    );
    Ok(())
}

/// `urls` rotated to begin `by` places further.
fn rotated(urls: &[BrokerUrl], by: usize) -> Vec<BrokerUrl> {
    let mut urls = urls.to_vec();
    let n = urls.len();
    urls.rotate_left(by % n);
    urls
}

async fn measure(
    sandbox: &Sandbox,
    args: &Args,
    name: &'static str,
) -> Result<(Tally, Option<Duration>)> {
    let load = &args.load;
    let exe = bridge_executable()?;
    let urls = sandbox.config.urls.clone();
    let log = ProcessLog {
        rust_log: Some("warn".into()),
        stderr: None,
    };
    let mut files = Vec::new();
    let mut bridges = Vec::new();
    for i in 0..args.bridges {
        let mut config = sandbox.config.clone();
        config.urls = rotated(&urls, i + 1);
        let file = ConfigFile::write(&config)?;
        bridges.push(BridgeProcess::spawn(&exe, &file, &log)?);
        files.push(file);
    }
    sandbox
        .wait_for_consumers(args.bridges as u64, READY_WITHIN)
        .await?;
    let others = rotated(&urls, 1);
    let collector = FaultCollector::start(others.clone(), sandbox.target_queue.clone(), load.count);
    let ingress = sandbox.ingress.clone();
    let publisher = spawn_load(others.clone(), load, ingress);
    let started = tokio::time::Instant::now();
    tokio::time::sleep_until(started + args.kill_after).await;
    shell(&args.kill).await?;
    let killed = tokio::time::Instant::now();
    let work_queue = sandbox.config.names.work_queue();
    let failover = tokio::select! {
        consuming = consuming_again(&others, &work_queue) => Some(consuming? - killed),
        _ = tokio::time::sleep_until(started + args.restart_after) => None,
    };
    tokio::time::sleep_until(started + args.restart_after).await;
    shell(&args.restart).await?;
    // Without a failover before the restart (one broker), the outage ends when a bridge
    // consumes on the restarted broker.
    let failover = match failover {
        Some(f) => Some(f),
        None => Some(consuming_again(&others, &work_queue).await? - killed),
    };
    let sent = publisher.await.context("the publisher task")??;
    let grace = Duration::from_secs(60);
    let names = &sandbox.config.names;
    let tally = tally_after(name, load, sent, collector, names, grace).await?;
    for bridge in bridges {
        bridge.terminate(Duration::from_secs(30)).await?;
    }
    Ok((tally, failover))
}

/// Waits until the work queue has a consumer again, as a broker of `urls` that answers
/// sees it; returns when.
async fn consuming_again(urls: &[BrokerUrl], work_queue: &str) -> Result<tokio::time::Instant> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(300);
    let mut next = 0;
    while tokio::time::Instant::now() < deadline {
        let probe = async {
            let conn = connect_any(urls, &mut next, "delay-bridge faults probe").await?;
            let counts = queue_counts(&conn, work_queue).await;
            let _ = conn.close(200, "probed".into()).await;
            anyhow::Ok(counts?.consumers)
        };
        // A broker still electing a leader may not answer at once.
        if let Ok(Ok(consumers)) = tokio::time::timeout(Duration::from_secs(2), probe).await
            && consumers > 0
        {
            return Ok(tokio::time::Instant::now());
        }
        next += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    bail!("no bridge consumed {work_queue} within 300 s of the kill")
}

/// Runs `sh -c command` and fails unless it succeeds.
async fn shell(command: &str) -> Result<()> {
    let status = tokio::process::Command::new("sh")
        .args(["-c", command])
        .status()
        .await
        .with_context(|| format!("running {command}"))?;
    if !status.success() {
        bail!("`{command}` failed: {status}");
    }
    Ok(())
}
