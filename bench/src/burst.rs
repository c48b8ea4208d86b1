//! A burst: `count` messages all due at the same instant, published ahead of it as fast as
//! the broker confirms. Drain rate is messages over the time from the due instant to the
//! last arrival, compared with the baseline's rate.

use std::time::Duration;

use anyhow::Result;
use delay_bridge_bench::report;

use delay_bridge::config::Config;

use super::baseline::{Baseline, BaselineArgs};
use super::cost::{Cost, broker_cpu_between, broker_cpu_now};
use super::load::due_at_once;
use super::{Spread, Target, bridge_description, mib, print_report, print_targets};
use delay_bridge::sandbox::{Sandbox, TargetBinding};

use crate::measured_bridge::MeasuredBridge;
use crate::process_usage::UsageSpan;

/// `bench burst` options.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Messages, all due at the same instant.
    #[arg(long, default_value_t = 50_000)]
    count: u64,
    /// Body size, bytes (at least 16).
    #[arg(long, default_value_t = 100)]
    body_size: usize,
    #[command(flatten)]
    baseline: BaselineArgs,
}

/// Target of the performance table (docs/performance.md): drain rate as a share of the baseline.
const DRAIN_RATIO_TARGET: f64 = 0.75;

pub async fn run(base: &Config, args: &Args) -> Result<()> {
    let count = args.count.max(1);
    let baseline = args.baseline.measure(base, args.body_size, 2000.0).await?;
    let sandbox = Sandbox::declare(base, "delay-bridge-bench-burst", TargetBinding::Fanout).await?;
    // Due far enough ahead that publishing (at the baseline's pace, with slack) ends first.
    let lead = Duration::from_secs(3) + Duration::from_secs_f64(3.0 * count as f64 / baseline.rate);
    let measured = measure(&sandbox, &baseline, args, count, lead).await;
    sandbox.finish().await?;
    let m = measured?;

    let drain_s = m.arrivals.last_us.saturating_sub(m.due_ms * 1000) as f64 / 1e6;
    let drain_rate = m.arrivals.received as f64 / drain_s.max(1e-6);
    let ratio = drain_rate / baseline.rate;
    println!(
        "burst: {count} messages all due at one instant ({:.1} s after the first publish), body {} B",
        lead.as_secs_f64(),
        args.body_size
    );
    println!("bridge: {}", bridge_description());
    println!(
        "broker: {} ({})",
        base.url(),
        super::steady::broker_name(&baseline)
    );
    println!("{}", baseline.line());
    println!(
        "published in {:.2} s; received {}, missing {}, duplicates {}",
        (m.published_us.1 - m.published_us.0) as f64 / 1e6,
        m.arrivals.received,
        m.arrivals.missing(),
        m.arrivals.duplicates
    );
    println!(
        "drained in {drain_s:.2} s after the due instant: {drain_rate:.0} msg/s = {ratio:.2} x baseline"
    );
    let spread = Spread::of(&m.arrivals.lateness_us);
    if let Some(s) = &spread {
        println!("lateness (arrival - due), ms: {}", Spread::header());
        println!("                              {}", s.row());
    }
    println!(
        "bridge process: CPU {:.1} s, {:.0} us per message; RSS {} at start, {} at end, peak {}",
        m.bridge.cpu.as_secs_f64(),
        m.bridge.cpu.as_secs_f64() * 1e6 / count as f64,
        mib(m.bridge.rss_start),
        mib(m.bridge.rss_end),
        mib(m.bridge.peak_rss)
    );
    println!(
        "{} (the baseline's flat-out pass: a burst is flat out)",
        m.cost.line()
    );
    println!("machine CPU busy during the run: {}", m.machine_busy);
    let targets = [
        Target::new(
            format!("burst drain >= {DRAIN_RATIO_TARGET} x baseline"),
            format!(
                "{ratio:.2} x ({drain_rate:.0} / {:.0} msg/s)",
                baseline.rate
            ),
            ratio >= DRAIN_RATIO_TARGET,
        ),
        Target::new(
            "every message once",
            format!(
                "{} missing, {} duplicates",
                m.arrivals.missing(),
                m.arrivals.duplicates
            ),
            m.arrivals.missing() == 0 && m.arrivals.duplicates == 0,
        ),
        m.cost.broker_target(),
    ];
    print_targets(&targets);
    let report = report::Report::new(
        "burst",
        report::Burst {
            count,
            received: m.arrivals.received,
            missing: m.arrivals.missing(),
            duplicates: m.arrivals.duplicates,
            drain_s,
            drain_msg_per_s: drain_rate.round(),
            drain_ratio: (ratio * 1000.0).round() / 1000.0,
            lateness: spread.map(|s| s.report()),
            cost: m.cost.report(),
        },
    )
    .bridge(bridge_description())
    .baseline(baseline.report());
    print_report(report, &targets, &m.bridge, Some(&m.machine_busy));
    Ok(())
}

struct Measured {
    /// How busy the whole machine was during the run.
    machine_busy: String,
    arrivals: super::load::Arrivals,
    due_ms: u64,
    published_us: (u64, u64),
    bridge: UsageSpan,
    cost: Cost,
}

async fn measure(
    sandbox: &Sandbox,
    baseline: &Baseline,
    args: &Args,
    count: u64,
    lead: Duration,
) -> Result<Measured> {
    let process = MeasuredBridge::start(sandbox).await?;
    let start = process.usage()?;
    let broker_start = broker_cpu_now(baseline)?;
    let machine = super::MachineCpu::now();
    let sent = due_at_once(sandbox, count, lead, args.body_size).await?;
    let (arrivals, due_ms, published) = (sent.arrivals, sent.due_ms, sent.published);
    let end = process.usage()?;
    let broker_end = broker_cpu_now(baseline)?;
    let bridge = start.until(&end);
    process.stop().await?;
    let machine_busy = machine.busy_since(&super::MachineCpu::now());
    Ok(Measured {
        machine_busy,
        arrivals,
        due_ms,
        published_us: (published.started_us, published.confirmed_us),
        bridge,
        cost: Cost {
            messages: count,
            broker_cpu: broker_cpu_between(broker_start, broker_end),
            baseline_broker_us: baseline.flat_broker_us_per_message(),
            bridge_cpu: bridge.cpu,
        },
    })
}
