//! Scale: `count` long-delay messages published through a bridge child process until they
//! all sit in the level queues. At the start, at a checkpoint and at the end the broker's
//! memory (after a full GC) and the bridge's RSS are read: memory per pending message is
//! the growth over the count, and the bridge's RSS should not grow with it. Each step also
//! reports what taking its messages in cost (ingress to the work queue, the bridge, a hop
//! into a level): the broker's CPU per message beside one flat-out plain transit, and the
//! bridge's. The broker's data directory is read beside its memory. Last, a sample due
//! at one instant is published on top of what is pending and collected at the target: how
//! long it takes to drain, and how late, with the levels full.

use std::time::Duration;

use anyhow::{Context, Result, bail};
use delay_bridge_bench::report;

use delay_bridge::clock::now_ms;
use delay_bridge::config::{Config, QueueType};
use delay_bridge::ladder::{format_duration, parse_duration};

use super::baseline::{Baseline, BaselineArgs};
use super::broker_memory::Ctl;
use super::cost::{Cost, broker_cpu_between, broker_cpu_now};
use super::load::{due_at, due_at_once, publish};
use super::{Target, bridge_description, mib, print_targets, target_rows};
use delay_bridge::sandbox::{Sandbox, TargetBinding, queue_counts};

use crate::measured_bridge::MeasuredBridge;
use crate::process_usage::ProcessUsage;

/// `bench pending` options.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Messages left pending in the levels.
    #[arg(long, default_value_t = 1_000_000)]
    count: u64,
    /// An intermediate count at which memory is read too (the base of "flat").
    #[arg(long, default_value_t = 100_000)]
    checkpoint: u64,
    /// Their delay (they stay pending for the whole run).
    #[arg(long, default_value = "7d")]
    delay: String,
    /// Messages in the sample due at one instant after the last step (0: no sample).
    #[arg(long, default_value_t = 10_000)]
    sample: u64,
    /// How long after it is published the sample falls due.
    #[arg(long, default_value = "10s")]
    sample_lead: String,
    /// Body size, bytes (at least 16).
    #[arg(long, default_value_t = 100)]
    body_size: usize,
    /// How to run rabbitmqctl against the broker under test (for example
    /// "bash scripts/debian-broker.sh trixie ctl").
    #[arg(long, env = "DELAY_BRIDGE_CTL", default_value = "rabbitmqctl")]
    ctl: String,
    #[command(flatten)]
    baseline: BaselineArgs,
}

/// Targets of the performance table (docs/performance.md).
const RSS_LIMIT: u64 = 64 * 1024 * 1024;
const RSS_FLAT_GROWTH: f64 = 0.10;
const BROKER_BYTES_PER_MESSAGE: f64 = 200.0;

/// Readings at one pending count.
#[derive(Debug, Clone, Copy)]
struct Reading {
    pending: u64,
    broker_total: u64,
    /// Messages in the level queues as the broker counts them (a bundle is one).
    level_messages: u64,
    queue_memory: u64,
    /// `None` where the broker would not say.
    broker_disk: Option<u64>,
    bridge: ProcessUsage,
    /// Seconds from the first publish of this step until the levels held it all.
    seconds: f64,
    /// What taking this step's messages in cost (`None` at the start).
    intake: Option<Cost>,
}

impl Reading {
    fn report(&self) -> report::PendingReading {
        report::PendingReading {
            pending: self.pending,
            broker_total_bytes: self.broker_total,
            level_messages: Some(self.level_messages),
            queue_memory_bytes: self.queue_memory,
            bridge_rss_bytes: self.bridge.rss,
            bridge_peak_rss_bytes: self.bridge.peak_rss,
            bridge_cpu_s: self.bridge.cpu.as_secs_f64(),
            seconds: self.seconds,
            broker_disk_bytes: self.broker_disk,
            intake_cost: self.intake.map(|cost| cost.report()),
        }
    }
}

pub async fn run(base: &Config, args: &Args) -> Result<()> {
    let delay = parse_duration(&args.delay).map_err(|e| anyhow::anyhow!("--delay: {e}"))?;
    if delay < Duration::from_secs(3600) {
        bail!("--delay must be at least 1h so nothing falls due during the run");
    }
    let sample_lead =
        parse_duration(&args.sample_lead).map_err(|e| anyhow::anyhow!("--sample-lead: {e}"))?;
    let ctl = Ctl::parse(&args.ctl)?;
    ctl.total_after_gc().await.context(
        "this scenario reads the broker's memory with rabbitmqctl; set --ctl or DELAY_BRIDGE_CTL",
    )?;
    let count = args.count.max(1);
    let mut steps = vec![count];
    if args.checkpoint > 0 && args.checkpoint < count {
        steps.insert(0, args.checkpoint);
    }
    let baseline = args.baseline.measure(base, args.body_size, 2000.0).await?;
    let sandbox =
        Sandbox::declare(base, "delay-bridge-bench-pending", TargetBinding::Fanout).await?;
    let measured = measure(&sandbox, args, &ctl, &steps, delay, &baseline, sample_lead).await;
    println!("deleting the benchmark's queues ({count} messages)...");
    let deleting = tokio::time::Instant::now();
    sandbox.finish().await?;
    println!("deleted in {:.1} s", deleting.elapsed().as_secs_f64());
    let (readings, sample) = measured?;
    report(base, args, &baseline, &readings, sample.as_ref());
    Ok(())
}

async fn measure(
    sandbox: &Sandbox,
    args: &Args,
    ctl: &Ctl,
    steps: &[u64],
    delay: Duration,
    baseline: &Baseline,
    sample_lead: Duration,
) -> Result<(Vec<Reading>, Option<report::PendingSample>)> {
    let process = MeasuredBridge::start(sandbox).await?;
    let mut readings = vec![read(sandbox, &process, ctl, 0, 0.0, None).await?];
    let channel = crate::load::confirm_channel(&sandbox.conn).await?;
    let work_queue = sandbox.config.names.work_queue();
    let mut published = 0u64;
    for &step in steps {
        let started = tokio::time::Instant::now();
        // Read after the previous reading: its rabbitmqctl calls (a full GC) are not counted.
        let broker_start = broker_cpu_now(baseline)?;
        let bridge_start = process.usage()?.cpu;
        let ingress = sandbox.ingress.clone();
        let offset = published;
        publish(&channel, step - published, None, |seq| {
            due_at(
                &ingress,
                offset + seq,
                now_ms() + delay.as_millis() as u64,
                args.body_size,
            )
        })
        .await?;
        published = step;
        // Wait until the bridge has moved every message into a level (its confirmed hops:
        // in bundles, a level queue's message holds many).
        let deadline = started + Duration::from_secs(120) + Duration::from_millis(step);
        loop {
            let waiting = queue_counts(&sandbox.conn, &work_queue).await?.messages;
            if waiting == 0 && hops(&process).await? >= step {
                break;
            }
            if tokio::time::Instant::now() > deadline {
                bail!("the levels did not reach {step} pending messages in time");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let seconds = started.elapsed().as_secs_f64();
        let intake = Cost {
            messages: step - offset,
            broker_cpu: broker_cpu_between(broker_start, broker_cpu_now(baseline)?),
            baseline_broker_us: baseline.flat_broker_us_per_message(),
            bridge_cpu: process.usage()?.cpu.saturating_sub(bridge_start),
        };
        readings.push(read(sandbox, &process, ctl, step, seconds, Some(intake)).await?);
        eprintln!("  {step} pending after {seconds:.1} s");
    }
    let sample = if args.sample > 0 {
        Some(drain_sample(sandbox, args, published, sample_lead).await?)
    } else {
        None
    };
    process.stop().await?;
    Ok((readings, sample))
}

/// Publishes `args.sample` messages due `lead` after now through the route whose levels
/// hold `pending` messages, and collects them at the target.
async fn drain_sample(
    sandbox: &Sandbox,
    args: &Args,
    pending: u64,
    lead: Duration,
) -> Result<report::PendingSample> {
    let count = args.sample;
    let sent = due_at_once(sandbox, count, lead, args.body_size).await?;
    let (arrivals, due_ms) = (sent.arrivals, sent.due_ms);
    let drain_s = (arrivals.last_us as f64 / 1e6 - due_ms as f64 / 1e3).max(0.0);
    eprintln!(
        "  sample of {count} due at one instant beside {pending} pending: {} arrived, drained {drain_s:.2} s after the due instant",
        arrivals.received
    );
    Ok(report::PendingSample {
        count,
        pending,
        drain_s,
        missing: arrivals.missing(),
        duplicates: arrivals.duplicates,
        lateness: super::Spread::of(&arrivals.lateness_us).map(|s| s.report()),
    })
}

/// Hops the bridge has confirmed into level queues.
async fn hops(process: &MeasuredBridge) -> Result<u64> {
    let metrics = process.metrics().await?;
    let hops = crate::bridge_metrics::value(&metrics, "delay_bridge_hops_total")
        .context("the bridge's metrics have no delay_bridge_hops_total")?;
    Ok(hops as u64)
}

async fn read(
    sandbox: &Sandbox,
    process: &MeasuredBridge,
    ctl: &Ctl,
    pending: u64,
    seconds: f64,
    intake: Option<Cost>,
) -> Result<Reading> {
    let prefix = format!("{}.", sandbox.config.names.prefix());
    Ok(Reading {
        pending,
        broker_total: ctl.total_after_gc().await?,
        level_messages: sandbox.pending_in_levels().await?,
        queue_memory: ctl.queues(&prefix).await?.bytes,
        broker_disk: match ctl.data_dir_bytes().await {
            Ok(bytes) => Some(bytes),
            Err(e) => {
                eprintln!("  the broker's data directory was not read: {e:#}");
                None
            }
        },
        bridge: process.usage()?,
        seconds,
        intake,
    })
}

fn report(
    base: &Config,
    args: &Args,
    baseline: &Baseline,
    readings: &[Reading],
    sample: Option<&report::PendingSample>,
) {
    let first = readings[0];
    let last = *readings.last().expect("a reading per step");
    // Signed: with messages on disk the growth can be below the noise (GC, other queues).
    let per_message = |r: &Reading, bytes: fn(&Reading) -> u64| {
        (bytes(r) as f64 - bytes(&first) as f64) / r.pending.max(1) as f64
    };
    let disk_per_message = |r: &Reading| match (r.broker_disk, first.broker_disk) {
        (Some(now), Some(then)) if r.pending > 0 => {
            Some((now as f64 - then as f64) / r.pending as f64)
        }
        _ => None,
    };
    println!(
        "pending: {} messages of {} B, delay {}, {} {} level queues ({} .. {})",
        last.pending,
        args.body_size,
        args.delay,
        base.ladder.levels().len(),
        base.queue_type,
        format_duration(base.ladder.smallest()),
        format_duration(base.ladder.largest())
    );
    println!("bridge: {}", bridge_description());
    println!("broker: {}", base.url());
    println!("{}", baseline.line());
    println!(
        "{:>10} {:>10} {:>14} {:>12} {:>14} {:>12} {:>14} {:>8} {:>12} {:>10} {:>9}",
        "pending",
        "in levels",
        "broker total",
        "B/msg",
        "level queues",
        "B/msg",
        "broker disk",
        "B/msg",
        "bridge RSS",
        "peak RSS",
        "hops/s"
    );
    let mut previous = first;
    for r in readings {
        let moved = r.pending - previous.pending;
        println!(
            "{:>10} {:>10} {:>14} {:>12} {:>14} {:>12} {:>14} {:>8} {:>12} {:>10} {:>9}",
            r.pending,
            r.level_messages,
            mib(r.broker_total),
            if r.pending == 0 {
                "-".into()
            } else {
                format!("{:.0}", per_message(r, |r| r.broker_total))
            },
            mib(r.queue_memory),
            if r.pending == 0 {
                "-".into()
            } else {
                format!("{:.0}", per_message(r, |r| r.queue_memory))
            },
            r.broker_disk.map_or("-".into(), mib),
            disk_per_message(r).map_or("-".into(), |b| format!("{b:.0}")),
            mib(r.bridge.rss),
            mib(r.bridge.peak_rss),
            if moved == 0 {
                "-".into()
            } else {
                format!("{:.0}", moved as f64 / r.seconds.max(1e-6))
            }
        );
        previous = *r;
    }
    println!(
        "in levels: messages in the level queues as the broker counts them (hops travel in bundles when bridge.bundle_hops is on: one message holds many)"
    );
    println!(
        "baseline publish rate for scale: {:.0} msg/s; the levels filled at the hops/s above",
        baseline.rate
    );
    for r in readings {
        if let Some(intake) = r.intake {
            println!(
                "taking in the messages up to {} pending (published flat out): {}",
                r.pending,
                intake.line()
            );
        }
    }
    if let Some(sample) = sample {
        let lateness = sample.lateness.as_ref().map_or("-".to_string(), |l| {
            format!(
                "p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
                l.p50_ms, l.p99_ms, l.max_ms
            )
        });
        println!(
            "a sample of {} due at one instant beside {} pending: drained {:.2} s after its due instant; late by {lateness}; missing {}, duplicates {}",
            sample.count, sample.pending, sample.drain_s, sample.missing, sample.duplicates
        );
    }
    let broker_per_msg = per_message(&last, |r| r.broker_total);
    let mut targets = Vec::new();
    if base.queue_type == QueueType::Classic {
        targets.push(Target::new(
            format!("broker memory <= {BROKER_BYTES_PER_MESSAGE} B per pending message"),
            format!("{broker_per_msg:.0} B"),
            broker_per_msg <= BROKER_BYTES_PER_MESSAGE,
        ));
    }
    targets.push(Target::new(
        format!("bridge RSS <= 64 MiB at {} pending", last.pending),
        mib(last.bridge.rss),
        last.bridge.rss <= RSS_LIMIT,
    ));
    if readings.len() > 2 {
        let base_rss = readings[1];
        let growth = last.bridge.rss as f64 / base_rss.bridge.rss.max(1) as f64 - 1.0;
        targets.push(Target::new(
            format!(
                "bridge RSS flat {} -> {} pending (<= {:.0}% growth)",
                base_rss.pending,
                last.pending,
                RSS_FLAT_GROWTH * 100.0
            ),
            format!(
                "{} -> {} ({:+.1}%)",
                mib(base_rss.bridge.rss),
                mib(last.bridge.rss),
                growth * 100.0
            ),
            growth <= RSS_FLAT_GROWTH,
        ));
    }
    print_targets(&targets);
    println!(
        "{}",
        report::Report::new(
            "pending",
            report::Pending {
                queue_type: base.queue_type.to_string(),
                body_bytes: args.body_size as u64,
                readings: readings.iter().map(Reading::report).collect(),
                broker_bytes_per_pending_message: broker_per_msg.round(),
                queue_bytes_per_pending_message: per_message(&last, |r| r.queue_memory).round(),
                disk_bytes_per_pending_message: disk_per_message(&last).map(f64::round),
                sample: sample.cloned(),
            },
        )
        .bridge(bridge_description())
        .baseline(baseline.report())
        .targets(target_rows(&targets))
        .to_line()
    );
}
