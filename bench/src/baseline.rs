//! The broker's own ceiling, which every other broker scenario measures first: persistent
//! messages published with confirms (the same publisher, confirm window and body size as
//! the scenarios) through one plain durable queue to the same auto-ack collector.
//!
//! Two passes: flat out (throughput; latency there is mostly queueing behind the confirm
//! window), then paced at a moderate rate for 5 s (latency of one broker round trip, the
//! floor under the bridge's lateness, which ends with exactly such a trip). The broker
//! process's CPU time over the paced pass, per message, is the cost of one plain transit at
//! that rate: the yardstick for the broker's CPU per delayed message.

use std::time::Duration;

use anyhow::{Result, bail};
use lapin::{BasicProperties, Channel, Connection};

use delay_bridge::config::Config;
use delay_bridge::contract::PERSISTENT;

use super::above_zero::above_zero;
use super::broker_process::BrokerProcess;
use super::load::{Arrivals, Collector, HEADER_BYTES, Outgoing, PlainQueue, body, now_us, publish};
use super::{Spread, ms};

/// `bench baseline` options.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Messages to send flat out through the plain queue.
    #[arg(long, default_value_t = 50_000)]
    count: u64,
    /// The paced pass's rate, msg/s.
    #[arg(long, default_value_t = 2000.0, value_parser = above_zero)]
    rate: f64,
    /// How long the paced pass lasts, seconds.
    #[arg(long, default_value_t = 5.0, value_parser = above_zero)]
    paced_seconds: f64,
    /// Body size, bytes (at least 16).
    #[arg(long, default_value_t = 100)]
    body_size: usize,
}

/// The options every broker scenario uses for its baseline.
#[derive(Debug, clap::Args)]
pub struct BaselineArgs {
    /// Messages to send flat out through the plain queue for the baseline.
    #[arg(long, default_value_t = 50_000)]
    pub baseline_count: u64,
    /// How long the baseline's paced pass lasts, seconds.
    #[arg(long, default_value_t = 5.0, value_parser = above_zero)]
    pub baseline_paced_seconds: f64,
}

impl BaselineArgs {
    /// Measures the baseline with these options.
    pub async fn measure(
        &self,
        config: &Config,
        body_size: usize,
        paced_rate: f64,
    ) -> Result<Baseline> {
        measure(
            config,
            self.baseline_count,
            body_size,
            paced_rate,
            self.baseline_paced_seconds,
        )
        .await
    }
}

/// The broker's ceiling on this machine, now.
#[derive(Debug, Clone)]
pub struct Baseline {
    /// Messages sent flat out.
    pub count: u64,
    /// Body size, bytes.
    pub body_size: usize,
    /// Flat out: messages per second, from the first publish to the last arrival.
    pub rate: f64,
    /// Flat out: arrival minus send time.
    pub latency: Spread,
    /// The paced pass's rate, msg/s.
    pub paced_rate: f64,
    /// Paced: arrival minus send time.
    pub paced_latency: Spread,
    /// Messages of the paced pass.
    pub paced_count: u64,
    /// The broker process's CPU time over the paced pass (`None`: not found on this machine).
    pub paced_broker_cpu: Option<Duration>,
    /// The broker process's CPU time over the flat-out pass.
    pub flat_broker_cpu: Option<Duration>,
    /// The broker's process, when it runs on this machine: the scenarios read its CPU too.
    pub broker: Option<BrokerProcess>,
}

impl Baseline {
    /// The broker's CPU time per message of the paced pass, µs: one plain transit.
    pub fn broker_us_per_message(&self) -> Option<f64> {
        self.paced_broker_cpu
            .map(|cpu| cpu.as_secs_f64() * 1e6 / self.paced_count.max(1) as f64)
    }

    /// The broker's CPU time per message of the flat-out pass, µs.
    pub fn flat_broker_us_per_message(&self) -> Option<f64> {
        self.flat_broker_cpu
            .map(|cpu| cpu.as_secs_f64() * 1e6 / self.count.max(1) as f64)
    }

    /// One line for a scenario's report.
    pub fn line(&self) -> String {
        let broker_cpu = self
            .broker_us_per_message()
            .map_or_else(|| "not measured".to_string(), |us| format!("{us:.0} us"));
        format!(
            "baseline (plain durable queue, same publisher and consumer, {} B): flat out {:.0} msg/s (latency p50 {} ms, p99 {} ms); paced at {} msg/s latency p50 {} ms, p99 {} ms, max {} ms, broker CPU per message {broker_cpu}",
            self.body_size,
            self.rate,
            ms(self.latency.p50),
            ms(self.latency.p99),
            self.paced_rate,
            ms(self.paced_latency.p50),
            ms(self.paced_latency.p99),
            ms(self.paced_latency.max),
        )
    }

    /// For the report.
    pub fn report(&self) -> delay_bridge_bench::report::Baseline {
        delay_bridge_bench::report::Baseline {
            count: self.count,
            body_bytes: self.body_size as u64,
            msg_per_s: self.rate.round(),
            latency: self.latency.report(),
            paced_msg_per_s: self.paced_rate,
            paced_latency: self.paced_latency.report(),
            paced_broker_cpu_us_per_msg: self.broker_us_per_message(),
            flat_broker_cpu_us_per_msg: self.flat_broker_us_per_message(),
            broker_version: self.broker.as_ref().and_then(|b| b.version.clone()),
        }
    }
}

/// Measures the baseline on a fresh, uniquely named durable queue, deleted afterwards:
/// `count` messages flat out, then `paced_rate` msg/s for `paced_seconds`.
pub async fn measure(
    config: &Config,
    count: u64,
    body_size: usize,
    paced_rate: f64,
    paced_seconds: f64,
) -> Result<Baseline> {
    let count = count.max(1);
    let plain = PlainQueue::declare(config, "baseline").await?;
    let (channel, consumer, queue) = (&plain.channel, &plain.consumer, plain.name.as_str());
    let paced_count = (paced_rate * paced_seconds).round().max(1.0) as u64;
    let broker = match BrokerProcess::find(config.url().expose()) {
        Ok(broker) => Some(broker),
        Err(e) => {
            tracing::warn!("the broker's CPU is not measured: {e:#}");
            None
        }
    };
    let broker_cpu = || broker.as_ref().map(BrokerProcess::cpu).transpose();
    let passes = async {
        let flat_before = broker_cpu()?;
        let flat = pass(channel, consumer, queue, count, None, body_size).await?;
        let cpu_before = broker_cpu()?;
        let flat_cpu = flat_before
            .zip(cpu_before)
            .map(|(a, b)| b.saturating_sub(a));
        let paced = pass(
            channel,
            consumer,
            queue,
            paced_count,
            Some(paced_rate),
            body_size,
        )
        .await?;
        let cpu = cpu_before
            .zip(broker_cpu()?)
            .map(|(a, b)| b.saturating_sub(a));
        Ok::<_, anyhow::Error>((flat, paced, flat_cpu, cpu))
    }
    .await;
    plain.delete().await?;
    let ((started_us, flat), (_, paced), flat_broker_cpu, paced_broker_cpu) = passes?;
    let seconds = flat.last_us.saturating_sub(started_us) as f64 / 1e6;
    Ok(Baseline {
        count,
        body_size: body_size.max(HEADER_BYTES),
        rate: count as f64 / seconds.max(1e-6),
        latency: Spread::of(&flat.lateness_us).expect("count >= 1"),
        paced_rate,
        paced_latency: Spread::of(&paced.lateness_us).expect("paced count >= 1"),
        paced_count,
        paced_broker_cpu,
        flat_broker_cpu,
        broker,
    })
}

/// One pass through the queue: the first publish time and what arrived (all of it, once,
/// or an error).
async fn pass(
    channel: &Channel,
    consumer: &Connection,
    queue: &str,
    count: u64,
    rate: Option<f64>,
    body_size: usize,
) -> Result<(u64, Arrivals)> {
    let collector = Collector::start(consumer, queue, count).await?;
    let published = publish(channel, count, rate, |seq| Outgoing {
        exchange: "".into(),
        routing_key: queue.into(),
        body: body(seq, now_us(), body_size),
        properties: BasicProperties::default().with_delivery_mode(PERSISTENT),
    })
    .await;
    // If publishing failed, stop collecting at once.
    let wait = if published.is_ok() { 60 } else { 0 };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(wait);
    let arrivals = collector.finish(deadline, Duration::ZERO).await?;
    let published = published?;
    if arrivals.missing() > 0 || arrivals.duplicates > 0 {
        bail!(
            "the baseline lost {} and duplicated {} of {count} messages: the broker is not healthy",
            arrivals.missing(),
            arrivals.duplicates
        );
    }
    Ok((published.started_us, arrivals))
}

/// `bench baseline`: the ceiling alone.
pub async fn run(config: &Config, args: &Args) -> Result<()> {
    let baseline = measure(
        config,
        args.count,
        args.body_size,
        args.rate,
        args.paced_seconds,
    )
    .await?;
    println!(
        "baseline: broker {} ({}), no bridge",
        config.url(),
        baseline
            .broker
            .as_ref()
            .map_or_else(|| "process not found".into(), BrokerProcess::describe)
    );
    println!("{}", baseline.line());
    println!("latency, ms:          {}", Spread::header());
    println!("  flat out            {}", baseline.latency.row());
    println!("  paced               {}", baseline.paced_latency.row());
    println!(
        "{}",
        delay_bridge_bench::report::Report::new("baseline", delay_bridge_bench::report::Nothing {})
            .bridge("none")
            .baseline(baseline.report())
            .to_line()
    );
    Ok(())
}
