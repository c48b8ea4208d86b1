//! `connection-cuts`: the broker closes the bridge's connections every few seconds
//! (`rabbitmqctl close_connection`) while the load flows. The bridge reconnects at once after
//! a session that worked, so a cut costs a reconnect, not a backoff.

use std::time::Duration;

use anyhow::{Context, Result};
use delay_bridge_bench::report;

use delay_bridge::config::Config;
use delay_bridge::ladder::{format_duration, parse_duration};
use delay_bridge::sandbox::{Sandbox, TargetBinding};

use super::traffic::FaultCollector;
use super::{Load, Tally, p99_within, spawn_load, tally_after};
use crate::broker_memory::Ctl;
use crate::measured_bridge::MeasuredBridge;

/// `connection-cuts` options.
#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(flatten)]
    load: Load,
    /// Close the bridge's connections this often.
    #[arg(long, default_value = "3s", value_parser = parse_duration)]
    every: Duration,
    /// Keep cutting for this long from the first publish.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    cut_for: Duration,
    /// How to run rabbitmqctl against the broker (for example `bash scripts/debian-broker.sh trixie ctl`).
    #[arg(long, env = "DELAY_BRIDGE_CTL", default_value = "rabbitmqctl")]
    ctl: String,
}

/// The p99 lateness the scenario must keep.
const P99_LIMIT: Duration = Duration::from_secs(1);

pub async fn run(base: &Config, args: &Args) -> Result<()> {
    args.load.check()?;
    let ctl = Ctl::parse(&args.ctl)?;
    let sandbox = Sandbox::declare(base, "delay-bridge-faults-cuts", TargetBinding::Fanout).await?;
    let result = measure(&sandbox, args, &ctl).await;
    sandbox.finish().await?;
    let (tally, cuts) = result?;
    let targets = [tally.none_missing(), p99_within(&tally, P99_LIMIT)];
    tally.print(
        &[
            args.load.describe(),
            format!(
                "the broker closed the bridge's connections {cuts} times, every {} for {}",
                format_duration(args.every),
                format_duration(args.cut_for)
            ),
        ],
        &targets,
        report::FaultDone {
            cuts: Some(cuts),
            ..Default::default()
        },
    );
    Ok(())
}

async fn measure(sandbox: &Sandbox, args: &Args, ctl: &Ctl) -> Result<(Tally, u64)> {
    let load = &args.load;
    let bridge = MeasuredBridge::start(sandbox).await?;
    let urls = sandbox.config.urls.clone();
    let collector = FaultCollector::start(urls.clone(), sandbox.target_queue.clone(), load.count);
    let ingress = sandbox.ingress.clone();
    let publisher = spawn_load(urls.clone(), load, ingress);
    let name = format!("delay-bridge {}", sandbox.prefix());
    let started = tokio::time::Instant::now();
    let mut cuts = 0;
    let mut next_cut = started + args.every;
    while next_cut <= started + args.cut_for {
        tokio::time::sleep_until(next_cut).await;
        // One cut closes all of the bridge's connections (their names begin alike).
        if close_connections_named(ctl, &name).await? > 0 {
            cuts += 1;
        }
        next_cut += args.every;
    }
    let sent = publisher.await.context("the publisher task")??;
    let grace = Duration::from_secs(30);
    let names = &sandbox.config.names;
    let tally = tally_after("connection-cuts", load, sent, collector, names, grace).await?;
    bridge.stop().await?;
    Ok((tally, cuts))
}

/// Has the broker close every connection whose client-provided name contains `name`;
/// returns how many it closed.
pub async fn close_connections_named(ctl: &Ctl, name: &str) -> Result<u64> {
    let listed = ctl
        .call(&[
            "list_connections",
            "-q",
            "--no-table-headers",
            "pid",
            "client_properties",
        ])
        .await?;
    let mut closed = 0;
    for line in listed.lines().filter(|l| l.contains(name)) {
        let Some(pid) = line.split_whitespace().next() else {
            continue;
        };
        // A connection that went on its own between the listing and the close is no error.
        if ctl
            .call(&[
                "close_connection",
                pid,
                "delay-bridge faults: connection cut",
            ])
            .await
            .is_ok()
        {
            closed += 1;
        }
    }
    Ok(closed)
}
