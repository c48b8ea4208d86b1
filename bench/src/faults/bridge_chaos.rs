//! `bridge-chaos`: two `delay-bridge run` processes share the work while one of them, in
//! turn, is SIGKILLed every few seconds and started again. Whatever a killed process held
//! (unacknowledged deliveries, holds, unconfirmed publishes) is redelivered by the broker
//! to the other one: nothing is lost; what it had published but not yet acknowledged
//! arrives twice, bounded by its prefetch per kill.

use std::time::Duration;

use anyhow::{Context, Result};
use delay_bridge_bench::report;

use delay_bridge::config::Config;
use delay_bridge::ladder::{format_duration, parse_duration};
use delay_bridge::sandbox::process::{BridgeProcess, ConfigFile, ProcessLog};
use delay_bridge::sandbox::{Sandbox, TargetBinding};

use super::traffic::FaultCollector;
use super::{Load, Tally, spawn_load, tally_after};
use crate::Target;
use crate::measured_bridge::bridge_executable;

/// `bridge-chaos` options.
#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(flatten)]
    load: Load,
    /// The shortest pause between two kills.
    #[arg(long, default_value = "2s", value_parser = parse_duration)]
    min_pause: Duration,
    /// The longest pause between two kills.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    max_pause: Duration,
}

/// How long a bridge process may take to consume after it is started.
const READY_WITHIN: Duration = Duration::from_secs(30);

pub async fn run(base: &Config, args: &Args) -> Result<()> {
    args.load.check()?;
    anyhow::ensure!(
        args.min_pause <= args.max_pause,
        "--min-pause must not exceed --max-pause"
    );
    let sandbox =
        Sandbox::declare(base, "delay-bridge-faults-chaos", TargetBinding::Fanout).await?;
    let result = measure(&sandbox, args).await;
    sandbox.finish().await?;
    let (tally, kills) = result?;
    // Each kill can redeliver at most what that process held unacknowledged.
    let bound = kills * u64::from(base.prefetch);
    let targets = [
        tally.none_missing(),
        Target::new(
            format!("duplicates <= kills x prefetch ({bound})"),
            tally.seen.duplicates().to_string(),
            tally.seen.duplicates() <= bound,
        ),
    ];
    tally.print(
        &[
            args.load.describe(),
            format!(
                "two bridge processes; one SIGKILLed and restarted every {} to {}: {kills} kills",
                format_duration(args.min_pause),
                format_duration(args.max_pause)
            ),
        ],
        &targets,
        report::FaultDone {
            kills: Some(kills),
            ..Default::default()
        },
    );
    Ok(())
}

async fn measure(sandbox: &Sandbox, args: &Args) -> Result<(Tally, u64)> {
    let load = &args.load;
    let exe = bridge_executable()?;
    let config = ConfigFile::write(&sandbox.config)?;
    let log = ProcessLog {
        rust_log: Some("error".into()),
        stderr: None,
    };
    let mut bridges = [
        Some(BridgeProcess::spawn(&exe, &config, &log)?),
        Some(BridgeProcess::spawn(&exe, &config, &log)?),
    ];
    sandbox.wait_for_consumers(2, READY_WITHIN).await?;
    let urls = sandbox.config.urls.clone();
    let collector = FaultCollector::start(urls.clone(), sandbox.target_queue.clone(), load.count);
    let ingress = sandbox.ingress.clone();
    let mut publisher = spawn_load(urls.clone(), load, ingress);
    let mut kills = 0u64;
    let (min, max) = (
        args.min_pause.as_millis() as u64,
        args.max_pause.as_millis() as u64,
    );
    let sent = loop {
        let pause = Duration::from_millis(rand::random_range(min..=max));
        tokio::select! {
            sent = &mut publisher => break sent.context("the publisher task")??,
            _ = tokio::time::sleep(pause) => {
                let victim = (kills % 2) as usize;
                if let Some(process) = bridges[victim].take() {
                    process.kill9().await;
                }
                kills += 1;
                bridges[victim] = Some(BridgeProcess::spawn(&exe, &config, &log)?);
            }
        }
    };
    let grace = Duration::from_secs(60);
    let names = &sandbox.config.names;
    let tally = tally_after("bridge-chaos", load, sent, collector, names, grace).await?;
    for bridge in bridges.into_iter().flatten() {
        bridge.terminate(Duration::from_secs(30)).await?;
    }
    Ok((tally, kills))
}
