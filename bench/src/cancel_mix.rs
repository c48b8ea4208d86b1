//! A shop's cancels appended at full rate while one bridge runs: nine in ten name a due
//! time a few minutes ahead (order timeouts), one in ten none (the caller does not know it).
//! Every one stays live for the run (a dated cancel is kept `cancel.grace` after its due
//! time), which is the shape that was never checkpointed before 0.3: the threshold was the
//! whole live state. Measured: when the running bridge wrote its first checkpoint and how
//! many it wrote, its RSS per live tombstone while following; then a restart's time to
//! ready, RSS (and peak) and entries read, beside a start on the empty stream in the same
//! run; and one `status --json`, timed.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use delay_bridge_bench::report;
use lapin::types::ShortString;

use delay_bridge::cancel::tombstone_properties;
use delay_bridge::clock::now_ms;
use delay_bridge::config::Config;
use delay_bridge::sandbox::process::ConfigFile;
use delay_bridge::sandbox::{Sandbox, TargetBinding};

use super::bridge_metrics::value;
use super::load::{self, Outgoing};
use crate::measured_bridge::{MeasuredBridge, bridge_executable};

/// `bench cancel-mix` options.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Cancels appended while the bridge runs, each for its own message id.
    #[arg(long, default_value_t = 5_000_000)]
    count: u64,
    /// How long to wait for the running bridge's first checkpoint after the last append.
    #[arg(long, default_value_t = 300)]
    checkpoint_within_s: u64,
}

/// How far ahead a dated cancel names its message's due time.
const DUE_AHEAD_MS: u64 = 5 * 60_000;

/// A start of a bridge process: until it consumed, and what it said then.
async fn start(sandbox: &Sandbox) -> Result<(MeasuredBridge, report::HistoryStart, u64)> {
    let started = Instant::now();
    let bridge = MeasuredBridge::start(sandbox).await?;
    let ready_s = started.elapsed().as_secs_f64();
    let usage = bridge.usage()?;
    let metrics = bridge.metrics().await.unwrap_or_default();
    let gauge = |name: &str| value(&metrics, name).map(|v| v as u64);
    Ok((
        bridge,
        report::HistoryStart {
            ready_s,
            rss_bytes: usage.rss,
            entries_read: gauge("delay_bridge_cancel_catch_up_entries"),
            live: gauge("delay_bridge_tombstones"),
        },
        usage.peak_rss,
    ))
}

pub async fn run(base: &Config, args: &Args) -> Result<()> {
    let sandbox =
        Sandbox::declare(base, "delay-bridge-bench-cancel-mix", TargetBinding::Fanout).await?;
    let (bridge, empty, _) = start(&sandbox).await?;
    bridge.stop().await?;

    let (bridge, _, _) = start(&sandbox).await?;
    let rss_before = bridge.usage()?.rss;
    let channel = load::confirm_channel(&sandbox.conn).await?;
    let stream = sandbox.config.names.cancel_stream();
    let begun = Instant::now();
    let published = load::publish(&channel, args.count, None, |seq| {
        let now = now_ms();
        Outgoing {
            exchange: ShortString::from(""),
            routing_key: ShortString::from(stream.as_str()),
            body: Vec::new(),
            properties: tombstone_properties(
                ShortString::from(format!("order-{seq:010}")),
                now,
                (seq % 10 != 0).then_some(now + DUE_AHEAD_MS),
            ),
        }
    })
    .await
    .context("appending the cancels")?;
    let publish_s = (published.confirmed_us - published.started_us) as f64 / 1e6;
    let deadline = Instant::now() + Duration::from_secs(args.checkpoint_within_s);
    let (first_checkpoint_s, checkpoints) = loop {
        let text = bridge.metrics().await?;
        let written = value(&text, "delay_bridge_checkpoints_total").unwrap_or(0.0) as u64;
        let live = value(&text, "delay_bridge_tombstones").unwrap_or(0.0) as u64;
        if written >= 1 && live >= args.count {
            break (Some(begun.elapsed().as_secs_f64()), written);
        }
        if Instant::now() > deadline {
            break (None, written);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let following = bridge.usage()?;
    bridge.stop().await?;
    let per_tombstone = (following.rss as f64 - rss_before as f64) / args.count.max(1) as f64;

    let (bridge, restart, restart_peak) = start(&sandbox).await?;
    bridge.stop().await?;

    let config = ConfigFile::write(&sandbox.config)?;
    let (status_s, json) = super::history::timed_status(&config, &bridge_executable()?).await?;
    let status_checkpoint = json["cancel_entries"]["checkpoint"]["cancels"].as_u64();
    sandbox.finish().await?;

    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    let shown = |v: Option<u64>| v.map_or("-".to_string(), |v| v.to_string());
    println!(
        "cancel-mix: {} cancels appended while a bridge ran (9 in 10 due {} min ahead, 1 in 10 undated; RabbitMQ {})",
        args.count,
        DUE_AHEAD_MS / 60_000,
        base.url()
    );
    println!(
        "  appended with confirms in {publish_s:.1} s ({:.0}/s)",
        args.count as f64 / publish_s.max(1e-3)
    );
    match first_checkpoint_s {
        Some(s) => println!(
            "  running bridge: {checkpoints} checkpoint(s), the state complete {s:.1} s after the first append; {per_tombstone:.0} bytes of RSS per live tombstone while following"
        ),
        None => println!(
            "  running bridge: {checkpoints} checkpoint(s) within {} s of the last append; {per_tombstone:.0} bytes of RSS per live tombstone while following",
            args.checkpoint_within_s
        ),
    }
    println!(
        "  {:<24} {:>10} {:>10} {:>12} {:>12}",
        "bridge start", "ready in s", "RSS MiB", "entries read", "live"
    );
    for (name, start) in [("empty stream (baseline)", &empty), ("restart", &restart)] {
        println!(
            "  {:<24} {:>10.2} {:>10.1} {:>12} {:>12}",
            name,
            start.ready_s,
            mib(start.rss_bytes),
            shown(start.entries_read),
            shown(start.live)
        );
    }
    println!("  restart peak RSS {:.1} MiB", mib(restart_peak));
    println!(
        "  status --json: {status_s:.2} s, from a checkpoint of {} cancels",
        shown(status_checkpoint)
    );
    println!(
        "{}",
        report::Report::new(
            "cancel-mix",
            report::CancelMix {
                count: args.count,
                publish_s,
                checkpoints,
                first_checkpoint_s,
                rss_bytes_per_tombstone: per_tombstone,
                empty,
                restart,
                restart_peak_rss_bytes: restart_peak,
                status_s,
                status_checkpoint_cancels: status_checkpoint,
            },
        )
        .to_line()
    );
    Ok(())
}
