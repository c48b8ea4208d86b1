//! `delay-bridge-bench <scenario>`: measurements against the real broker, a workspace
//! member of its own (`bench/`), built beside the `delay-bridge` executable it measures. Every broker
//! scenario first measures the broker's own ceiling (`baseline`) in the same run, with the
//! same publisher and consumer, and prints its figures as ratios of it. Each scenario
//! prints a human table and then one JSON object (the last line of its output); each
//! target of the performance table (docs/performance.md) is printed as PASS or MISS next to its figure.
//!
//! The bridge under test runs as users run it: `steady`, `burst`, `hop` and `pending` start
//! `delay-bridge run` as a child process ([`measured_bridge`], so its RSS and CPU time are
//! its own); `cancel-horizon` runs the library's `Bridge::run` in process.

mod above_zero;
mod baseline;
mod bridge_metrics;
mod broker_memory;
mod broker_process;
mod burst;
mod cancel_horizon;
mod cancel_mix;
mod capacity;
mod cost;
mod faults;
mod history;
mod hop;
mod intake;
mod load;
mod measured_bridge;
mod mixed;
mod pending;
mod plugin;
mod plugin_move;
mod process_usage;
mod spread;
mod steady;
mod tombstones;

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use delay_bridge::config::Config;
use delay_bridge_bench::report;

/// Benchmarks of delay-bridge against a real broker, each on a throw-away topology; every
/// report says how the bridge under test ran and prints its own baseline.
#[derive(Debug, Parser)]
#[command(name = "delay-bridge-bench", version)]
struct Cli {
    /// The configuration file (TOML): the broker, the ladder, the margin and the prefetch
    /// of the bridge under test (its prefix and routes are the benchmark's own).
    #[arg(
        short,
        long,
        env = "DELAY_BRIDGE_CONFIG",
        default_value = "config/delay-bridge.toml"
    )]
    config: PathBuf,

    #[command(subcommand)]
    scenario: Scenario,
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let config = Config::load(&cli.config)
        .with_context(|| format!("invalid configuration {}", cli.config.display()))?;
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?
        .block_on(run(&config, &cli.scenario))
}

/// The scenarios.
#[derive(Debug, Subcommand)]
pub enum Scenario {
    /// The broker's ceiling: persistent publishes with confirms through one plain durable
    /// queue to an auto-ack consumer (msg/s, latency p50/p99). No bridge.
    Baseline(baseline::Args),
    /// A steady rate of messages with delays spread over a range: lateness (arrival minus
    /// due) percentiles, early, missing and duplicate counts.
    Steady(steady::Args),
    /// The highest steady rate at which p99 lateness stays within 10 ms with nothing
    /// missing, and what a delayed message costs the broker and the bridge there.
    Capacity(capacity::Args),
    /// Many messages all due at the same instant: how fast the bridge drains them, as a
    /// ratio of the baseline.
    Burst(burst::Args),
    /// Messages moved through one hop (work queue to level queue, confirmed and acked) per
    /// second, as a ratio of the baseline, and the bridge's CPU time per hop.
    Hop(hop::Args),
    /// What taking a message in costs the broker, with no bridge: the same paced publisher
    /// into a plain durable queue whose consumer acks late (every `--ack-every`, as the
    /// bridge acks a new message once what replaced it is confirmed), beside the baseline.
    Intake(intake::Args),
    /// A soak that lives like production: one bridge for many minutes at a steady rate,
    /// with large bodies, bursts, cancels, reschedules and unroutable messages; lateness per
    /// minute, what went missing or came twice, CPU and RSS per minute, and a picture.
    Mixed(mixed::Args),
    /// The archived delayed-message plugin (when enabled on the broker), measured as
    /// `steady` and `burst` measure the bridge: lateness and the broker's CPU per message
    /// at a steady rate, then a burst's drain rate.
    Plugin(plugin::Args),
    /// Moving a delayed exchange off the plugin (when enabled on the broker) onto the
    /// bridge, as docs/operations.md's procedure says: published before and after the move,
    /// delivered, doubled and lost.
    PluginMove(plugin_move::Args),
    /// Many long-delay messages pending in the levels: broker memory per pending message
    /// and the bridge's RSS as the count grows.
    Pending(pending::Args),
    /// How long before deliver-at a confirmed cancel still wins: cancels are confirmed at
    /// decreasing lead times before their messages' due time; the table shows which won.
    CancelHorizon(cancel_horizon::Args),
    /// Memory per live tombstone and the catch-up time of a starting bridge over a cancel
    /// stream of `--count` tombstones, beside a start on an empty stream.
    Tombstones(tombstones::Args),
    /// A shop's cancels appended at full rate while one bridge runs (9 in 10 due a few
    /// minutes ahead, 1 in 10 undated, all live): whether it checkpoints, and a restart's
    /// time to ready, RSS and entries read, beside a start on an empty stream.
    CancelMix(cancel_mix::Args),
    /// A year of cancel-stream history (10M entries of a year-like mix by default): a
    /// bridge's time to ready and RSS on its first start (the whole stream) and on restarts
    /// (from the newest checkpoint), beside a start on an empty stream.
    History(history::Args),
    /// Fault: the broker closes the bridge's connection every few seconds under load.
    ConnectionCuts(faults::connection_cuts::Args),
    /// Fault: two bridge processes, one SIGKILLed and restarted every few seconds.
    BridgeChaos(faults::bridge_chaos::Args),
    /// Fault: `kill -9` of the cluster node that leads the queues, started again later
    /// (the configured brokers are the cluster's nodes, the first one leading).
    NodeLoss(faults::broker_loss::Args),
    /// Fault: `kill -9` of the one broker, started again later.
    BrokerCrash(faults::broker_loss::Args),
    /// Fault: random header tables and properties through a real bridge.
    Fuzz(faults::fuzz::Args),
    /// The spread (min / median / max) of several saved runs of one scenario, and which
    /// targets each met. Reads files only: no broker.
    Spread(spread::Args),
}

/// Runs one scenario against the configured broker.
async fn run(base: &Config, scenario: &Scenario) -> Result<()> {
    match scenario {
        Scenario::Baseline(args) => baseline::run(base, args).await,
        Scenario::Steady(args) => steady::run(base, args).await,
        Scenario::Burst(args) => burst::run(base, args).await,
        Scenario::Capacity(args) => capacity::run(base, args).await,
        Scenario::Hop(args) => hop::run(base, args).await,
        Scenario::Intake(args) => intake::run(base, args).await,
        Scenario::Pending(args) => pending::run(base, args).await,
        Scenario::Mixed(args) => mixed::run(base, args).await,
        Scenario::Plugin(args) => plugin::run(base, args).await,
        Scenario::PluginMove(args) => plugin_move::run(base, args).await,
        Scenario::CancelHorizon(args) => cancel_horizon::run(base, args).await,
        Scenario::Tombstones(args) => tombstones::run(base, args).await,
        Scenario::CancelMix(args) => cancel_mix::run(base, args).await,
        Scenario::History(args) => history::run(base, args).await,
        Scenario::ConnectionCuts(args) => faults::connection_cuts::run(base, args).await,
        Scenario::BridgeChaos(args) => faults::bridge_chaos::run(base, args).await,
        Scenario::NodeLoss(args) => faults::broker_loss::run(base, args, "node-loss").await,
        Scenario::BrokerCrash(args) => faults::broker_loss::run(base, args, "broker-crash").await,
        Scenario::Fuzz(args) => faults::fuzz::run(base, args).await,
        Scenario::Spread(args) => spread::run(args),
    }
}

/// A latency distribution, µs.
#[derive(Debug, Clone, Copy)]
pub struct Spread {
    /// Samples.
    pub count: usize,
    /// Smallest.
    pub min: i64,
    /// Median.
    pub p50: i64,
    /// 90th percentile.
    pub p90: i64,
    /// 99th percentile.
    pub p99: i64,
    /// 99.9th percentile.
    pub p999: i64,
    /// Largest.
    pub max: i64,
}

impl Spread {
    /// The distribution of samples (`None` when there are none), through a histogram
    /// with three significant digits. Samples may be negative (early arrivals): the
    /// histogram holds each one's distance from the smallest.
    pub fn of(samples: &[i64]) -> Option<Self> {
        let min = *samples.iter().min()?;
        let max = *samples.iter().max()?;
        let mut histogram = hdrhistogram::Histogram::<u64>::new(3).ok()?;
        for sample in samples {
            histogram.record(sample.abs_diff(min)).ok()?;
        }
        let at = |q: f64| {
            min.saturating_add(histogram.value_at_quantile(q) as i64)
                .min(max)
        };
        Some(Self {
            count: samples.len(),
            min,
            p50: at(0.5),
            p90: at(0.9),
            p99: at(0.99),
            p999: at(0.999),
            max,
        })
    }

    /// One table row in milliseconds: min p50 p90 p99 p99.9 max.
    pub fn row(&self) -> String {
        format!(
            "{:>8} {:>8} {:>8} {:>8} {:>8} {:>8}",
            ms(self.min),
            ms(self.p50),
            ms(self.p90),
            ms(self.p99),
            ms(self.p999),
            ms(self.max)
        )
    }

    /// The header matching [`Spread::row`].
    pub fn header() -> String {
        format!(
            "{:>8} {:>8} {:>8} {:>8} {:>8} {:>8}",
            "min", "p50", "p90", "p99", "p99.9", "max"
        )
    }

    /// For the report, in milliseconds.
    pub fn report(&self) -> report::Lateness {
        let ms = |us: i64| us as f64 / 1000.0;
        report::Lateness {
            count: self.count as u64,
            min_ms: ms(self.min),
            p50_ms: ms(self.p50),
            p90_ms: ms(self.p90),
            p99_ms: ms(self.p99),
            p999_ms: ms(self.p999),
            max_ms: ms(self.max),
        }
    }
}

/// Microseconds shown as milliseconds with one decimal.
pub fn ms(us: i64) -> String {
    format!("{:.1}", us as f64 / 1000.0)
}

/// Bytes shown as MiB with one decimal.
pub fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

/// One target of the performance table (docs/performance.md): what is compared, the figure, and whether it is met.
pub struct Target {
    /// What is measured and its limit, e.g. "steady p99 lateness <= 5 ms".
    pub name: String,
    /// The measured figure, as shown.
    pub figure: String,
    /// Met or not.
    pub pass: bool,
}

impl Target {
    /// A target.
    pub fn new(name: impl Into<String>, figure: impl Into<String>, pass: bool) -> Self {
        Self {
            name: name.into(),
            figure: figure.into(),
            pass,
        }
    }

    fn verdict(&self) -> &'static str {
        if self.pass { "PASS" } else { "MISS" }
    }

    /// For the report.
    pub fn report(&self) -> report::TargetRow {
        report::TargetRow {
            target: self.name.clone(),
            measured: self.figure.clone(),
            verdict: if self.pass {
                report::Verdict::Pass
            } else {
                report::Verdict::Miss
            },
        }
    }
}

/// Prints the targets, one per line.
pub fn print_targets(targets: &[Target]) {
    println!("targets:");
    for t in targets {
        println!("  {}  {:<48} measured {}", t.verdict(), t.name, t.figure);
    }
}

/// The targets for the report.
pub fn target_rows(targets: &[Target]) -> Vec<report::TargetRow> {
    targets.iter().map(Target::report).collect()
}

/// Completes a broker scenario's report with what each of them reports (the targets,
/// the bridge process's usage, how busy the machine was) and prints it as the last line.
pub fn print_report<T: serde::Serialize>(
    mut report: report::Report<T>,
    targets: &[Target],
    bridge: &process_usage::UsageSpan,
    machine_busy: Option<&str>,
) {
    report.usage = Some(bridge.report());
    report.targets = target_rows(targets);
    report.machine_cpu_busy = machine_busy.map(str::to_string);
    println!("{}", report.to_line());
}

/// How the bridge under test runs, for the report.
pub fn bridge_description() -> String {
    let exe = measured_bridge::bridge_executable()
        .map(|p| p.display().to_string())
        .unwrap_or_else(|_| "delay-bridge".into());
    let build = if cfg!(debug_assertions) {
        "DEBUG build: figures are not representative, use --release"
    } else {
        "release build"
    };
    format!("`{exe} run` in a child process ({build})")
}

/// The machine's CPU counters (`/proc/stat`, all cores), to report how busy the whole
/// machine was during a run: on a small machine the broker, the bridge and the load
/// generator share the cores, and a saturated machine shows up as lateness.
#[derive(Debug, Clone, Copy)]
pub struct MachineCpu {
    busy: u64,
    total: u64,
}

impl MachineCpu {
    /// Reads the counters now (zeros where `/proc/stat` is unreadable).
    pub fn now() -> Self {
        use procfs::CurrentSI;
        let Ok(stat) = procfs::KernelStats::current() else {
            return Self { busy: 0, total: 0 };
        };
        let cpu = stat.total;
        let idle = cpu.idle + cpu.iowait.unwrap_or(0);
        let busy = cpu.user
            + cpu.nice
            + cpu.system
            + cpu.irq.unwrap_or(0)
            + cpu.softirq.unwrap_or(0)
            + cpu.steal.unwrap_or(0);
        Self {
            busy,
            total: busy + idle,
        }
    }

    /// The busy share of all cores between `self` and `later`, and the core count.
    pub fn busy_since(&self, later: &MachineCpu) -> String {
        let total = later.total.saturating_sub(self.total).max(1) as f64;
        let busy = later.busy.saturating_sub(self.busy) as f64;
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        format!("{:.0}% of {cores} cores", 100.0 * busy / total)
    }
}
