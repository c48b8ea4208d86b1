//! What taking a delayed message in costs the broker, with no bridge: the bench's paced
//! publisher (persistent, confirms) into a plain durable queue whose consumer acks late, as
//! the bridge acks a new message only once what replaced it is confirmed (with bundled hops,
//! after its window). The consumer acks with `multiple` every `--ack-every`.
//!
//! A message acked at once by an auto-ack consumer (the baseline) is never written; one
//! held past the queue's next flush is written, and the queue flushes whenever it falls
//! idle with confirms owed. So this is the part of a delayed message's cost that no
//! bridge can remove, beside the baseline's plain transit measured in the same run. Every
//! delayed message makes this trip and one plain transit (to its target), so their sum is
//! the floor under the broker's CPU per delayed message.

use std::time::Duration;

use anyhow::{Context, Result, bail};
use delay_bridge_bench::report;
use futures::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection};
use tokio_util::sync::CancellationToken;

use delay_bridge::config::Config;
use delay_bridge::contract::PERSISTENT;
use delay_bridge::ladder::{format_duration, parse_duration};

use super::above_zero::above_zero;
use super::baseline::BaselineArgs;
use super::load::{Outgoing, PlainQueue, body, now_us, publish, read_body};

/// `bench intake` options.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Messages per second.
    #[arg(long, default_value_t = 2000.0, value_parser = above_zero)]
    rate: f64,
    /// How long to publish, seconds.
    #[arg(long, default_value_t = 20.0, value_parser = above_zero)]
    seconds: f64,
    /// How often the consumer acks everything it received (one `multiple` ack).
    #[arg(long, default_value = "100ms")]
    ack_every: String,
    /// Body size, bytes (at least 16).
    #[arg(long, default_value_t = 100)]
    body_size: usize,
    #[command(flatten)]
    baseline: BaselineArgs,
}

/// The most deliveries the late-acking consumer holds unacked.
const PREFETCH: u16 = 10_000;

/// Runs the scenario and prints its report.
pub async fn run(config: &Config, args: &Args) -> Result<()> {
    let ack_every =
        parse_duration(&args.ack_every).map_err(|e| anyhow::anyhow!("--ack-every: {e}"))?;
    anyhow::ensure!(!ack_every.is_zero(), "--ack-every must be above 0s");
    let baseline = args
        .baseline
        .measure(config, args.body_size, args.rate)
        .await?;
    let Some(broker) = baseline.broker.clone() else {
        bail!("the broker's process is not on this machine: its CPU cannot be measured");
    };
    let count = (args.rate * args.seconds).round().max(1.0) as u64;
    let plain = PlainQueue::declare(config, "intake").await?;
    let measured = async {
        let acker = LateAcker::start(&plain.consumer, &plain.name, count, ack_every).await?;
        let cpu_before = broker.cpu()?;
        publish(&plain.channel, count, Some(args.rate), |seq| Outgoing {
            exchange: "".into(),
            routing_key: plain.name.as_str().into(),
            body: body(seq, now_us(), args.body_size),
            properties: BasicProperties::default().with_delivery_mode(PERSISTENT),
        })
        .await?;
        let received = acker.finish(Duration::from_secs(60)).await?;
        let cpu = broker.cpu()?.saturating_sub(cpu_before);
        Ok::<_, anyhow::Error>((received, cpu))
    }
    .await;
    plain.delete().await?;
    let (received, cpu) = measured?;
    if received.missing > 0 || received.duplicates > 0 {
        bail!(
            "the intake queue lost {} and duplicated {} of {count} messages: the broker is not healthy",
            received.missing,
            received.duplicates
        );
    }

    let intake_us = cpu.as_secs_f64() * 1e6 / count as f64;
    let plain_us = baseline
        .broker_us_per_message()
        .context("the baseline's broker CPU")?;
    let ratio = intake_us / plain_us.max(1e-9);
    println!(
        "intake: {} msg/s for {} s ({count} messages) into a durable queue, acked every {}, body {} B",
        args.rate,
        args.seconds,
        format_duration(ack_every),
        args.body_size
    );
    println!("broker: {} ({})", config.url(), broker.describe());
    println!("{}", baseline.line());
    println!(
        "broker CPU per message: intake {intake_us:.0} us, {ratio:.2}x one plain transit at the same rate ({plain_us:.0} us); intake plus one plain transit (the two trips of every delayed message): {:.2}x",
        ratio + 1.0
    );
    println!(
        "{}",
        report::Report::new(
            "intake",
            report::Intake {
                rate: args.rate,
                seconds: args.seconds,
                ack_every_ms: ack_every.as_millis() as u64,
                count,
                received: count - received.missing,
                duplicates: received.duplicates,
                intake_broker_cpu_us_per_msg: intake_us,
                intake_ratio: ratio,
                intake_plus_transit_ratio: ratio + 1.0,
            },
        )
        .bridge("none")
        .baseline(baseline.report())
        .to_line()
    );
    Ok(())
}

/// What the late-acking consumer received.
struct Received {
    missing: u64,
    duplicates: u64,
}

/// A consumer with manual acks that acks everything it received every `ack_every`, with
/// one `multiple` ack.
struct LateAcker {
    task: tokio::task::JoinHandle<Result<Received>>,
    all_acked: tokio::sync::watch::Receiver<bool>,
    stop: CancellationToken,
}

impl LateAcker {
    async fn start(
        conn: &Connection,
        queue: &str,
        expected: u64,
        ack_every: Duration,
    ) -> Result<Self> {
        let channel = conn.create_channel().await?;
        channel
            .basic_qos(PREFETCH, BasicQosOptions::default())
            .await?;
        let mut deliveries = channel
            .basic_consume(
                queue.into(),
                "delay-bridge-bench-intake".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        let (all_acked_tx, all_acked) = tokio::sync::watch::channel(false);
        let stop = CancellationToken::new();
        let stopped = stop.clone();
        let task = tokio::spawn(async move {
            let mut seen = vec![false; expected as usize];
            let (mut received, mut duplicates) = (0u64, 0u64);
            let mut unacked_up_to: Option<u64> = None;
            let mut ticks = tokio::time::interval(ack_every);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    next = deliveries.next() => {
                        let delivery = match next {
                            Some(delivery) => delivery.context("consuming")?,
                            None => bail!("the broker ended the intake consumer"),
                        };
                        unacked_up_to = Some(delivery.delivery_tag);
                        match read_body(&delivery.data).and_then(|(seq, _)| seen.get_mut(seq as usize)) {
                            Some(seen) if !*seen => {
                                *seen = true;
                                received += 1;
                            }
                            _ => duplicates += 1,
                        }
                    }
                    _ = ticks.tick() => {
                        if let Some(tag) = unacked_up_to.take() {
                            channel
                                .basic_ack(tag, BasicAckOptions { multiple: true })
                                .await
                                .context("acking")?;
                            if received == expected {
                                all_acked_tx.send_replace(true);
                            }
                        }
                    }
                    _ = stopped.cancelled() => break,
                }
            }
            let _ = channel.close(200, "acked".into()).await;
            Ok(Received {
                missing: expected - received,
                duplicates,
            })
        });
        Ok(Self {
            task,
            all_acked,
            stop,
        })
    }

    /// Waits until every expected message was received and acked, or `within` passed.
    async fn finish(mut self, within: Duration) -> Result<Received> {
        let _ = tokio::time::timeout(within, self.all_acked.wait_for(|done| *done)).await;
        self.stop.cancel();
        self.task.await.context("the intake consumer failed")?
    }
}
