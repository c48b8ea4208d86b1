//! Live tombstones: the bridge's memory per live tombstone, and how long a starting bridge
//! takes to read a cancel stream holding `count` of them (its catch-up: it consumes nothing
//! before), each beside the same bridge starting on an empty stream in the same run. What
//! that read costs the broker and the bridge per tombstone is set beside one flat-out plain
//! transit (the baseline), and so is what appending the tombstones cost the broker.

use std::time::Instant;

use anyhow::Result;
use delay_bridge_bench::report;
use lapin::types::ShortString;

use delay_bridge::cancel::tombstone_properties;
use delay_bridge::clock::now_ms;
use delay_bridge::config::Config;

use super::baseline::BaselineArgs;
use super::cost::{Cost, broker_cpu_between, broker_cpu_now};
use super::load::{self, Outgoing};
use delay_bridge::sandbox::{Sandbox, TargetBinding};

use crate::measured_bridge::MeasuredBridge;
use crate::process_usage::ProcessUsage;

/// `bench tombstones` options.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Tombstones in the cancel stream, each for its own message id.
    #[arg(long, default_value_t = 1_000_000)]
    count: u64,
    #[command(flatten)]
    baseline: BaselineArgs,
}

/// A bridge process started on the sandbox: how long until it consumed, and its usage then.
async fn start_and_read(sandbox: &Sandbox) -> Result<(f64, ProcessUsage)> {
    let started = Instant::now();
    let process = MeasuredBridge::start(sandbox).await?;
    let ready_s = started.elapsed().as_secs_f64();
    let usage = process.usage()?;
    process.stop().await?;
    Ok((ready_s, usage))
}

pub async fn run(base: &Config, args: &Args) -> Result<()> {
    // Tombstones have no body: they are set beside the smallest plain transit the baseline
    // sends (its body carries a sequence number and a timestamp).
    let baseline = args.baseline.measure(base, 16, 2000.0).await?;
    let sandbox =
        Sandbox::declare(base, "delay-bridge-bench-tombstones", TargetBinding::Fanout).await?;
    let (empty_s, empty) = start_and_read(&sandbox).await?;

    let channel = crate::load::confirm_channel(&sandbox.conn).await?;
    let stream = sandbox.config.names.cancel_stream();
    let cancelled_at = now_ms();
    let append_start = broker_cpu_now(&baseline)?;
    let published = load::publish(&channel, args.count, None, |seq| Outgoing {
        exchange: ShortString::from(""),
        routing_key: ShortString::from(stream.as_str()),
        body: Vec::new(),
        properties: tombstone_properties(
            ShortString::from(format!("bench-tombstone-{seq:010}")),
            cancelled_at,
            None,
        ),
    })
    .await?;
    let publish_s = (published.confirmed_us - published.started_us) as f64 / 1e6;
    let append_broker_cpu = broker_cpu_between(append_start, broker_cpu_now(&baseline)?);

    let read_start = broker_cpu_now(&baseline)?;
    let (full_s, full) = start_and_read(&sandbox).await?;
    let read_broker_cpu = broker_cpu_between(read_start, broker_cpu_now(&baseline)?);
    sandbox.finish().await?;
    // The read's cost: what the start on the full stream took beyond the start on an empty
    // one (the bridge), and what the broker spent while it ran.
    let read = Cost {
        messages: args.count,
        broker_cpu: read_broker_cpu,
        baseline_broker_us: baseline.flat_broker_us_per_message(),
        bridge_cpu: full.cpu.saturating_sub(empty.cpu),
    };
    let append = Cost {
        messages: args.count,
        broker_cpu: append_broker_cpu,
        baseline_broker_us: baseline.flat_broker_us_per_message(),
        bridge_cpu: std::time::Duration::ZERO,
    };

    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    let per_tombstone = (full.rss as f64 - empty.rss as f64) / args.count as f64;
    println!(
        "tombstones: {} live, one id each (RabbitMQ {})",
        args.count,
        base.url()
    );
    println!("{}", baseline.line());
    println!(
        "  appended with confirms in {publish_s:.1} s ({:.0}/s)",
        args.count as f64 / publish_s
    );
    println!(
        "  {:<24} {:>12} {:>12}",
        "bridge start", "ready in s", "RSS MiB"
    );
    println!(
        "  {:<24} {:>12.2} {:>12.1}",
        "empty stream (baseline)",
        empty_s,
        mib(empty.rss)
    );
    println!(
        "  {:<24} {:>12.2} {:>12.1}",
        format!("{} tombstones", args.count),
        full_s,
        mib(full.rss)
    );
    println!(
        "  catch-up: {:.2} s more than on an empty stream ({:.0} tombstones/s); \
         memory: {per_tombstone:.0} bytes of RSS per live tombstone",
        full_s - empty_s,
        args.count as f64 / (full_s - empty_s).max(1e-3)
    );
    let broker_line = |cost: &Cost| match (cost.broker_us(), cost.broker_ratio()) {
        (Some(us), Some(ratio)) => {
            format!("{us:.1} us per tombstone, {ratio:.2}x one flat-out plain transit")
        }
        _ => "not measured".to_string(),
    };
    println!("  broker CPU appending: {}", broker_line(&append));
    println!(
        "  reading at start: broker CPU {}; bridge CPU {:.1} us per tombstone",
        broker_line(&read),
        read.bridge_us()
    );
    println!(
        "{}",
        report::Report::new(
            "tombstones",
            report::Tombstones {
                count: args.count,
                publish_s,
                ready_empty_s: empty_s,
                ready_full_s: full_s,
                catch_up_s: full_s - empty_s,
                rss_empty_bytes: empty.rss,
                rss_full_bytes: full.rss,
                rss_bytes_per_tombstone: per_tombstone,
                append_broker_cpu_us_per_tombstone: append.broker_us(),
                append_broker_cpu_ratio: append.broker_ratio(),
                read_cost: read.report(),
            },
        )
        .baseline(baseline.report())
        .to_line()
    );
    Ok(())
}
