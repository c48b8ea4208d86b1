//! One hop, measured alone: `count` long-delay messages wait in the work queue while no
//! bridge runs; then a bridge child process starts and moves each into a level queue
//! (publish, confirm, ack). The rate is taken from the moment the bridge consumes until the
//! level queues hold every message, and set beside the baseline.

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::{Result, bail};
use delay_bridge_bench::report;

use delay_bridge::clock::now_ms;
use delay_bridge::config::Config;
use delay_bridge::ladder::{format_duration, parse_duration};
use delay_bridge::plan::{Step, next_step};

use super::baseline::{Baseline, BaselineArgs};
use super::cost::{Cost, broker_cpu_between, broker_cpu_now};
use super::load::{due_at, publish};
use super::{Target, bridge_description, mib, print_report, print_targets};
use delay_bridge::sandbox::{Sandbox, TargetBinding, queue_counts};

use crate::measured_bridge::MeasuredBridge;
use crate::process_usage::UsageSpan;

/// `bench hop` options.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Messages to move.
    #[arg(long, default_value_t = 50_000)]
    count: u64,
    /// Their delay (long enough that each takes exactly one hop during the run).
    #[arg(long, default_value = "1h")]
    delay: String,
    /// Body size, bytes (at least 16).
    #[arg(long, default_value_t = 100)]
    body_size: usize,
    #[command(flatten)]
    baseline: BaselineArgs,
}

pub async fn run(base: &Config, args: &Args) -> Result<()> {
    let delay = parse_duration(&args.delay).map_err(|e| anyhow::anyhow!("--delay: {e}"))?;
    if delay < base.ladder.smallest() * 2 + base.margin + Duration::from_secs(600) {
        bail!("--delay must exceed 10 minutes plus twice the smallest level plus the margin");
    }
    let count = args.count.max(1);
    let baseline = args.baseline.measure(base, args.body_size, 2000.0).await?;
    let sandbox = Sandbox::declare(base, "delay-bridge-bench-hop", TargetBinding::Fanout).await?;
    let measured = measure(&sandbox, &baseline, args, count, delay).await;
    sandbox.finish().await?;
    let m = measured?;

    let rate = count as f64 / m.seconds.max(1e-6);
    let ratio = rate / baseline.rate;
    let cpu_us = m.bridge.cpu.as_secs_f64() * 1e6 / count as f64;
    println!(
        "hop: {count} messages of {} B, delay {}, waiting in the work queue, then moved by one bridge",
        args.body_size,
        format_duration(delay)
    );
    println!("bridge: {}", bridge_description());
    println!(
        "broker: {} ({})",
        base.url(),
        super::steady::broker_name(&baseline)
    );
    println!("{}", baseline.line());
    println!(
        "moved {count} into level(s) {} in {:.2} s: {rate:.0} hops/s = {ratio:.2} x baseline",
        m.levels.join(", "),
        m.seconds
    );
    println!(
        "bridge process: CPU {:.2} s = {cpu_us:.0} us per hop ({:.0}% of one core); RSS {} at ready, {} at end, peak {}",
        m.bridge.cpu.as_secs_f64(),
        100.0 * m.bridge.cpu.as_secs_f64() / m.seconds.max(1e-6),
        mib(m.bridge.rss_start),
        mib(m.bridge.rss_end),
        mib(m.bridge.peak_rss)
    );
    println!(
        "{} per hop (the baseline's flat-out pass; the broker's figure includes this bench's polling of the levels' counts every 5 ms)",
        m.cost.line()
    );
    let targets = [Target::new(
        "every message in a level, none lost or doubled",
        format!("{} of {count} in the levels", m.in_levels),
        m.in_levels == count,
    )];
    print_targets(&targets);
    let report = report::Report::new(
        "hop",
        report::Hop {
            count,
            seconds: m.seconds,
            hops_per_s: rate.round(),
            ratio: (ratio * 1000.0).round() / 1000.0,
            bridge_cpu_us_per_hop: cpu_us.round(),
            in_levels: m.in_levels,
            cost: m.cost.report(),
        },
    )
    .bridge(bridge_description())
    .baseline(baseline.report());
    print_report(report, &targets, &m.bridge, None);
    Ok(())
}

struct Measured {
    seconds: f64,
    levels: Vec<String>,
    in_levels: u64,
    /// From ready to the end.
    bridge: UsageSpan,
    cost: Cost,
}

async fn measure(
    sandbox: &Sandbox,
    baseline: &Baseline,
    args: &Args,
    count: u64,
    delay: Duration,
) -> Result<Measured> {
    let channel = crate::load::confirm_channel(&sandbox.conn).await?;
    let due_ms = now_ms() + delay.as_millis() as u64;
    let ingress = sandbox.ingress.clone();
    publish(&channel, count, None, |seq| {
        due_at(&ingress, seq, due_ms, args.body_size)
    })
    .await?;
    let work_queue = sandbox.config.names.work_queue();
    let waiting = queue_counts(&sandbox.conn, &work_queue).await?.messages;
    if waiting != count {
        bail!("the work queue holds {waiting} messages, expected {count}");
    }
    // The levels the hop can land in during the next 10 minutes: polling only them keeps
    // each poll short; the final count covers every level.
    let config = &sandbox.config;
    let levels: BTreeSet<String> = [0, 600_000]
        .iter()
        .filter_map(|ahead| {
            match next_step(due_ms, now_ms() + ahead, &config.ladder, config.margin) {
                Step::Hop(level) => Some(config.names.level_queue(level)),
                _ => None,
            }
        })
        .collect();
    let levels: Vec<String> = levels.into_iter().collect();

    let process = MeasuredBridge::start(sandbox).await?;
    let started = tokio::time::Instant::now();
    let ready = process.usage()?;
    let broker_start = broker_cpu_now(baseline)?;
    let deadline = started + Duration::from_secs(60) + Duration::from_millis(count);
    loop {
        if sandbox.ready_in(&levels).await? >= count {
            break;
        }
        if tokio::time::Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let seconds = started.elapsed().as_secs_f64();
    let end = process.usage()?;
    let broker_end = broker_cpu_now(baseline)?;
    let bridge = ready.until(&end);
    let in_levels = sandbox.pending_in_levels().await?;
    process.stop().await?;
    Ok(Measured {
        seconds,
        levels,
        in_levels,
        bridge,
        cost: Cost {
            messages: count,
            broker_cpu: broker_cpu_between(broker_start, broker_end),
            baseline_broker_us: baseline.flat_broker_us_per_message(),
            bridge_cpu: bridge.cpu,
        },
    })
}
