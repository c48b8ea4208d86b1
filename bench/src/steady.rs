//! Steady load: `rate` messages per second for `seconds`, each due a uniformly random
//! delay in [min, max] after it is published (header `x-deliver-at`), through a bridge
//! child process. Lateness is arrival at the consumer minus the due time; CPU per message is
//! the broker's and the bridge's, the broker's beside one plain transit at the same rate.

use std::time::Duration;

use anyhow::Result;
use delay_bridge_bench::report;

use delay_bridge::amqp;
use delay_bridge::clock::now_ms;
use delay_bridge::config::Config;
use delay_bridge::ladder::{format_duration, parse_duration};

use super::above_zero::above_zero;
use super::baseline::{Baseline, BaselineArgs};
use super::broker_process::{BrokerProcess, BrokerSeries};
use super::cost::{Cost, broker_cpu_between, broker_cpu_now};
use super::load::{Collector, due_at, publish};
use super::{Spread, Target, bridge_description, mib, ms, print_report, print_targets};
use delay_bridge::sandbox::{Sandbox, TargetBinding};

use crate::bridge_metrics::LatenessSplit;
use crate::measured_bridge::MeasuredBridge;
use crate::process_usage::UsageSpan;

/// `bench steady` options.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Messages per second.
    #[arg(long, default_value_t = 2000.0, value_parser = above_zero)]
    rate: f64,
    /// How long to publish, seconds.
    #[arg(long, default_value_t = 60.0, value_parser = above_zero)]
    seconds: f64,
    #[command(flatten)]
    shape: Shape,
    #[command(flatten)]
    baseline: BaselineArgs,
}

/// The delays and bodies of a steady load (`steady` and `capacity`).
#[derive(Debug, clap::Args)]
pub struct Shape {
    /// The shortest delay.
    #[arg(long, default_value = "1s")]
    min_delay: String,
    /// The longest delay.
    #[arg(long, default_value = "20s")]
    max_delay: String,
    /// Body size, bytes (at least 16).
    #[arg(long, default_value_t = 100)]
    pub body_size: usize,
}

impl Shape {
    /// The shortest and longest delay.
    pub fn delays(&self) -> Result<(Duration, Duration)> {
        let min =
            parse_duration(&self.min_delay).map_err(|e| anyhow::anyhow!("--min-delay: {e}"))?;
        let max =
            parse_duration(&self.max_delay).map_err(|e| anyhow::anyhow!("--max-delay: {e}"))?;
        anyhow::ensure!(min <= max, "--min-delay must not exceed --max-delay");
        Ok((min, max))
    }
}

/// Targets of the performance table (docs/performance.md) on the 2-core reference machine: p99 and max
/// lateness on RabbitMQ 3.x, p99 on 4.x (where no max is set), and the achieved share of
/// the asked rate.
const P99_LIMIT_MS_3X: f64 = 5.0;
const P99_LIMIT_MS_4X: f64 = 10.0;
const MAX_LIMIT_MS: f64 = 50.0;
const ACHIEVED_SHARE: f64 = 0.99;

pub async fn run(base: &Config, args: &Args) -> Result<()> {
    let (min, max) = args.shape.delays()?;
    let count = (args.rate * args.seconds).round().max(1.0) as u64;

    let baseline = args
        .baseline
        .measure(base, args.shape.body_size, args.rate)
        .await?;
    let load = Load {
        rate: args.rate,
        count,
        min,
        max,
        body_size: args.shape.body_size,
    };
    let m = trial(base, &baseline, &load).await?;

    println!(
        "steady: {} msg/s for {} s ({count} messages), delays uniform over [{}, {}], body {} B",
        args.rate,
        args.seconds,
        format_duration(min),
        format_duration(max),
        args.shape.body_size
    );
    println!("bridge: {}", bridge_description());
    println!("broker: {} ({})", base.url(), broker_name(&baseline));
    println!("{}", baseline.line());
    println!(
        "published {count} at {:.0} msg/s achieved; received {}, missing {}, duplicates {}, early {}",
        m.achieved_rate,
        m.arrivals.received,
        m.arrivals.missing(),
        m.arrivals.duplicates,
        m.early
    );
    let spread = Spread::of(&m.arrivals.lateness_us);
    if let Some(s) = &spread {
        println!("lateness (arrival - due), ms: {}", Spread::header());
        println!("                              {}", s.row());
    }
    println!(
        "bridge process: CPU {:.1} s over {:.0} s ({:.0}% of one core), {:.0} us per message; RSS {} at start, {} at end, peak {}",
        m.bridge.cpu.as_secs_f64(),
        m.wall.as_secs_f64(),
        100.0 * m.bridge.cpu.as_secs_f64() / m.wall.as_secs_f64().max(1e-9),
        m.bridge.cpu.as_secs_f64() * 1e6 / count as f64,
        mib(m.bridge.rss_start),
        mib(m.bridge.rss_end),
        mib(m.bridge.peak_rss)
    );
    if let Some(full) = &m.full_rate {
        println!("{}", full.line(args.rate));
    }
    if let Some(split) = &m.lateness_split {
        println!("{}", split.line());
    }
    println!("{}", m.cost.line());
    let (p99, max_late) = spread.map_or((i64::MAX, i64::MAX), |s| (s.p99, s.max));
    println!("machine CPU busy during the run: {}", m.machine_busy);
    let series = baseline
        .broker
        .as_ref()
        .map_or(BrokerSeries::Unknown, |b| b.series());
    let p99_limit_ms = match series {
        BrokerSeries::FourOrLater => P99_LIMIT_MS_4X,
        BrokerSeries::Three | BrokerSeries::Unknown => P99_LIMIT_MS_3X,
    };
    let mut targets = vec![
        Target::new(
            format!("achieved rate >= {:.0}% of asked", ACHIEVED_SHARE * 100.0),
            format!("{:.1}%", 100.0 * m.achieved_rate / args.rate),
            m.achieved_rate >= ACHIEVED_SHARE * args.rate,
        ),
        Target::new(
            format!("steady p99 lateness <= {p99_limit_ms} ms"),
            format!("{} ms", ms(p99)),
            (p99 as f64) <= p99_limit_ms * 1000.0,
        ),
    ];
    if series != BrokerSeries::FourOrLater {
        targets.push(Target::new(
            format!("steady max lateness <= {MAX_LIMIT_MS} ms"),
            format!("{} ms", ms(max_late)),
            (max_late as f64) <= MAX_LIMIT_MS * 1000.0,
        ));
    }
    targets.extend([
        m.cost.broker_target(),
        m.cost.bridge_target(),
        Target::new(
            "every message once, none early",
            format!(
                "{} missing, {} duplicates, {} early",
                m.arrivals.missing(),
                m.arrivals.duplicates,
                m.early
            ),
            m.arrivals.missing() == 0 && m.arrivals.duplicates == 0 && m.early == 0,
        ),
    ]);
    print_targets(&targets);
    let report = report::Report::new(
        "steady",
        report::Steady {
            rate: args.rate,
            seconds: args.seconds,
            count,
            min_delay_ms: min.as_millis() as u64,
            max_delay_ms: max.as_millis() as u64,
            achieved_rate: m.achieved_rate.round(),
            received: m.arrivals.received,
            missing: m.arrivals.missing(),
            duplicates: m.arrivals.duplicates,
            early: m.early as u64,
            lateness: spread.map(|s| s.report()),
            bridge_lateness: m.lateness_split.map(|s| s.report()),
            cost: m.cost.report(),
            bridge_cpu_us_per_msg_full_rate: m.full_rate.map(|f| f.bridge_us(args.rate)),
        },
    )
    .bridge(bridge_description())
    .baseline(baseline.report());
    print_report(report, &targets, &m.bridge, Some(&m.machine_busy));
    Ok(())
}

/// The load of one steady run.
#[derive(Debug, Clone, Copy)]
pub struct Load {
    /// Messages per second asked.
    pub rate: f64,
    /// Messages in all.
    pub count: u64,
    /// The shortest delay.
    pub min: Duration,
    /// The longest delay.
    pub max: Duration,
    /// Body size, bytes.
    pub body_size: usize,
}

/// How long after the first publish the bridge may still be short of its full rate of
/// deliveries, beyond the longest delay (the margin, a bundle's window).
const FULL_RATE_SETTLES: Duration = Duration::from_secs(1);

/// The bridge's CPU in the part of a run where it takes in and delivers the full rate every
/// second: from the longest delay (and [`FULL_RATE_SETTLES`]) after the first publish to
/// the last publish. The whole run's figure also holds the ramps before and after it,
/// where fewer messages share each wake-up.
#[derive(Debug, Clone, Copy)]
pub struct FullRate {
    /// The window's length.
    pub window: Duration,
    /// The bridge's CPU in it.
    pub bridge_cpu: Duration,
}

impl FullRate {
    /// The window after the first publish, (start, end), for `load`; `None` when the run
    /// publishes too briefly to have one of at least 2 s.
    pub fn window(load: &Load) -> Option<(Duration, Duration)> {
        let publishing = Duration::from_secs_f64(load.count as f64 / load.rate);
        let from = load.max + FULL_RATE_SETTLES;
        (publishing >= from + Duration::from_secs(2)).then_some((from, publishing))
    }

    /// The bridge's CPU per message at `rate` messages a second, µs.
    pub fn bridge_us(&self, rate: f64) -> f64 {
        self.bridge_cpu.as_secs_f64() * 1e6 / (rate * self.window.as_secs_f64()).max(1.0)
    }

    /// One line for the human report.
    pub fn line(&self, rate: f64) -> String {
        format!(
            "bridge process at full rate (the {:.0} s from the longest delay after the first publish to the last, taking in and delivering {rate:.0} msg/s): CPU {:.2} s, {:.0} us per message",
            self.window.as_secs_f64(),
            self.bridge_cpu.as_secs_f64(),
            self.bridge_us(rate)
        )
    }
}

/// Reads the CPU of the bridge with process id `pid` over `window` (from
/// [`FullRate::window`]) after `first_publish`; `None` without a window or a reading.
async fn read_full_rate(
    pid: i32,
    first_publish: tokio::time::Instant,
    window: Option<(Duration, Duration)>,
) -> Option<FullRate> {
    let (from, to) = window?;
    tokio::time::sleep_until(first_publish + from).await;
    let start = crate::process_usage::read(pid).ok()?;
    tokio::time::sleep_until(first_publish + to).await;
    let end = crate::process_usage::read(pid).ok()?;
    Some(FullRate {
        window: to - from,
        bridge_cpu: start.until(&end).cpu,
    })
}

/// What one steady run measured.
pub struct Measured {
    /// The bridge's CPU where it ran at the full rate (`None`: too short a run).
    pub full_rate: Option<FullRate>,
    /// The bridge's own count of late confirms and late reads.
    pub lateness_split: Option<LatenessSplit>,
    /// How busy the whole machine was during the run.
    pub machine_busy: String,
    /// What arrived.
    pub arrivals: super::load::Arrivals,
    /// Arrivals before their due time.
    pub early: usize,
    /// Messages per second the publisher achieved.
    pub achieved_rate: f64,
    /// From the bridge's start to the last arrival.
    pub wall: Duration,
    /// The bridge process's usage.
    pub bridge: UsageSpan,
    /// CPU per message.
    pub cost: Cost,
}

/// One steady run on its own sandbox (declared, then deleted), through a bridge child process.
pub async fn trial(base: &Config, baseline: &Baseline, load: &Load) -> Result<Measured> {
    let sandbox =
        Sandbox::declare(base, "delay-bridge-bench-steady", TargetBinding::Fanout).await?;
    let measured = measure(&sandbox, baseline, load).await;
    sandbox.finish().await?;
    measured
}

/// The broker process as the report names it.
pub fn broker_name(baseline: &Baseline) -> String {
    baseline
        .broker
        .as_ref()
        .map_or_else(|| "process not found".into(), BrokerProcess::describe)
}

async fn measure(sandbox: &Sandbox, baseline: &Baseline, load: &Load) -> Result<Measured> {
    let count = load.count;
    let process = MeasuredBridge::start(sandbox).await?;
    let start = process.usage()?;
    let broker_start = broker_cpu_now(baseline)?;
    let machine = super::MachineCpu::now();
    let started = tokio::time::Instant::now();
    let consumer = amqp::connect(sandbox.config.url(), "delay-bridge bench collector").await?;
    let collector = Collector::start(&consumer, &sandbox.target_queue, count).await?;
    let channel = crate::load::confirm_channel(&sandbox.conn).await?;
    let (min_ms, max_ms) = (load.min.as_millis() as u64, load.max.as_millis() as u64);
    let ingress = sandbox.ingress.clone();
    let body_size = load.body_size;
    let full_rate = tokio::spawn(read_full_rate(
        process.pid()?,
        tokio::time::Instant::now(),
        FullRate::window(load),
    ));
    let published = publish(&channel, count, Some(load.rate), |seq| {
        let delay = rand::random_range(min_ms..=max_ms);
        due_at(&ingress, seq, now_ms() + delay, body_size)
    })
    .await?;
    let deadline = tokio::time::Instant::now() + load.max + Duration::from_secs(30);
    let arrivals = collector.finish(deadline, Duration::from_secs(1)).await?;
    let full_rate = full_rate.await.unwrap_or(None);
    let end = process.usage()?;
    let broker_end = broker_cpu_now(baseline)?;
    let lateness_split = LatenessSplit::read(&process.metrics().await?);
    process.stop().await?;
    let machine_busy = machine.busy_since(&super::MachineCpu::now());
    let _ = consumer.close(200, "done".into()).await;
    let publish_s = (published.confirmed_us - published.started_us) as f64 / 1e6;
    let bridge = start.until(&end);
    Ok(Measured {
        full_rate,
        lateness_split,
        machine_busy,
        early: arrivals.lateness_us.iter().take_while(|l| **l < 0).count(),
        arrivals,
        achieved_rate: count as f64 / publish_s.max(1e-9),
        wall: started.elapsed(),
        bridge,
        cost: Cost {
            messages: count,
            broker_cpu: broker_cpu_between(broker_start, broker_end),
            baseline_broker_us: baseline.broker_us_per_message(),
            bridge_cpu: bridge.cpu,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(rate: f64, seconds: u64, max_delay_s: u64) -> Load {
        Load {
            rate,
            count: (rate * seconds as f64) as u64,
            min: Duration::from_secs(1),
            max: Duration::from_secs(max_delay_s),
            body_size: 100,
        }
    }

    #[test]
    fn the_full_rate_runs_from_the_longest_delay_to_the_last_publish() {
        assert_eq!(
            FullRate::window(&load(2000.0, 30, 20)),
            Some((Duration::from_secs(21), Duration::from_secs(30)))
        );
        assert_eq!(
            FullRate::window(&load(2000.0, 22, 20)),
            None,
            "a run that ends before the full rate lasts 2 s has none"
        );
        let full = FullRate {
            window: Duration::from_secs(10),
            bridge_cpu: Duration::from_secs(2),
        };
        assert_eq!(full.bridge_us(2000.0), 100.0);
    }
}
