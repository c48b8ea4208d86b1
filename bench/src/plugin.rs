//! `plugin`: the archived delayed-message plugin (`rabbitmq_delayed_message_exchange`),
//! measured as `steady` and `burst` measure the bridge, for a comparison in one sitting: a
//! steady rate through an `x-delayed-message` exchange (lateness, the broker's CPU per
//! message beside one plain transit), then a burst due at one instant (drain rate). The
//! plugin must be enabled on the broker; without it the scenario says so and fails. Its
//! steady pass ([`trial`]) is also what `capacity --plugin` runs at each rate.

use std::time::Duration;

use anyhow::{Context, Result, bail};
use delay_bridge_bench::report;
use lapin::options::{
    ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, ExchangeKind};

use delay_bridge::amqp;
use delay_bridge::clock::now_ms;
use delay_bridge::config::Config;
use delay_bridge::ladder::format_duration;

use super::above_zero::above_zero;
use super::baseline::{Baseline, BaselineArgs};
use super::cost::{Cost, broker_cpu_between, broker_cpu_now};
use super::load::{Arrivals, Collector, Outgoing, body, publish};
use super::steady::{Load, Shape, broker_name};
use super::{MachineCpu, Spread};

/// `bench plugin` options.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Messages per second of the steady pass.
    #[arg(long, default_value_t = 2000.0, value_parser = above_zero)]
    rate: f64,
    /// How long the steady pass publishes, seconds (as `steady`'s).
    #[arg(long, default_value_t = 60.0, value_parser = above_zero)]
    seconds: f64,
    #[command(flatten)]
    shape: Shape,
    /// Messages of the burst, all due at one instant (0: no burst).
    #[arg(long, default_value_t = 50_000)]
    burst: u64,
    #[command(flatten)]
    baseline: BaselineArgs,
}

/// The routing key of every message (the delayed exchange routes as `direct`).
const KEY: &str = "plugin";

/// What carries the delays when the plugin does, for the reports.
pub const DESCRIPTION: &str =
    "rabbitmq_delayed_message_exchange (the archived plugin, in the broker)";

/// Runs the scenario: the steady pass, then the burst, through one delayed exchange.
pub async fn run(base: &Config, args: &Args) -> Result<()> {
    let (min, max) = args.shape.delays()?;
    let baseline = args
        .baseline
        .measure(base, args.shape.body_size, args.rate)
        .await?;
    let load = Load {
        rate: args.rate,
        count: (args.rate * args.seconds).round().max(1.0) as u64,
        min,
        max,
        body_size: args.shape.body_size,
    };
    let topology = DelayedTopology::declare(base).await?;
    let measured = measure(base, &baseline, args, &topology, &load).await;
    topology.delete().await;
    let m = measured?;

    println!(
        "plugin: rabbitmq_delayed_message_exchange, {} msg/s for {} s, delays uniform over [{}, {}], body {} B; then {} due at one instant",
        args.rate,
        args.seconds,
        format_duration(min),
        format_duration(max),
        args.shape.body_size,
        args.burst
    );
    println!("broker: {} ({})", base.url(), broker_name(&baseline));
    println!("{}", baseline.line());
    let steady = &m.steady.arrivals;
    let spread = Spread::of(&steady.lateness_us);
    println!(
        "steady: received {}, missing {}, duplicates {}",
        steady.received,
        steady.missing(),
        steady.duplicates
    );
    if let Some(s) = &spread {
        println!("lateness (arrival - due), ms: {}", Spread::header());
        println!("                              {}", s.row());
    }
    println!("CPU: broker {}", m.steady.cost.broker_line());
    if let Some((drain_s, received)) = m.burst {
        println!(
            "burst: received {received} of {}; drained in {drain_s:.2} s after the due instant: {:.0} msg/s = {:.2} x baseline",
            args.burst,
            received as f64 / drain_s.max(1e-6),
            received as f64 / drain_s.max(1e-6) / baseline.rate
        );
    }
    let report = report::Report::new(
        "plugin",
        report::Plugin {
            rate: args.rate,
            seconds: args.seconds,
            min_delay_ms: min.as_millis() as u64,
            max_delay_ms: max.as_millis() as u64,
            received: steady.received,
            missing: steady.missing(),
            duplicates: steady.duplicates,
            lateness: spread.map(|s| s.report()),
            cost: m.steady.cost.broker_report(),
            burst: m.burst.map(|(drain_s, received)| report::PluginBurst {
                count: args.burst,
                received,
                drain_s,
                drain_msg_per_s: (received as f64 / drain_s.max(1e-6)).round(),
                drain_ratio: ((received as f64 / drain_s.max(1e-6) / baseline.rate) * 100.0)
                    .round()
                    / 100.0,
            }),
        },
    )
    .baseline(baseline.report());
    println!("{}", report.to_line());
    Ok(())
}

/// Fails, saying how to enable it, unless the broker has the plugin: declares a delayed
/// exchange and its queue, and deletes them.
pub async fn ensure_enabled(base: &Config) -> Result<()> {
    DelayedTopology::declare(base).await?.delete().await;
    Ok(())
}

/// One steady pass through a fresh delayed exchange and queue (declared, then deleted),
/// as `plugin` runs it: `capacity --plugin` runs one at each rate.
pub async fn trial(base: &Config, baseline: &Baseline, load: &Load) -> Result<SteadyPass> {
    let topology = DelayedTopology::declare(base).await?;
    let pass = steady_pass(base, baseline, &topology, load).await;
    topology.delete().await;
    pass
}

/// A delayed exchange and the durable queue bound to it, both named
/// `delay-bridge-bench-plugin-<random>`, and the connection that declared them.
struct DelayedTopology {
    conn: lapin::Connection,
    name: String,
}

impl DelayedTopology {
    /// Connects and declares a fresh exchange and its queue.
    async fn declare(base: &Config) -> Result<Self> {
        let conn = amqp::connect(base.url(), "delay-bridge bench plugin").await?;
        let name = format!(
            "delay-bridge-bench-plugin-{:06x}",
            rand::random::<u32>() & 0xff_ffff
        );
        let channel = crate::load::confirm_channel(&conn).await?;
        if let Err(e) = declare(&channel, &name).await {
            // The queue may have been declared before the binding failed.
            let topology = Self { conn, name };
            topology.delete().await;
            return Err(e);
        }
        let _ = channel.close(200, "declared".into()).await;
        Ok(Self { conn, name })
    }

    /// Deletes the queue and the exchange (what is left of them) and closes the connection.
    async fn delete(self) {
        if let Ok(cleanup) = self.conn.create_channel().await {
            let _ = cleanup
                .queue_delete(self.name.as_str().into(), QueueDeleteOptions::default())
                .await;
            let _ = cleanup
                .exchange_delete(self.name.as_str().into(), ExchangeDeleteOptions::default())
                .await;
            let _ = cleanup.close(200, "done".into()).await;
        }
        let _ = self.conn.close(200, "done".into()).await;
    }
}

/// Declares the delayed exchange (type `x-delayed-message`, routing as `direct`) and a
/// durable queue bound to it, both named `name`.
async fn declare(channel: &Channel, name: &str) -> Result<()> {
    declare_delayed(channel, name).await?;
    channel
        .queue_declare(
            name.into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
    channel
        .queue_bind(
            name.into(),
            name.into(),
            KEY.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
    Ok(())
}

/// Declares `name` as the plugin's exchange (type `x-delayed-message`, routing as
/// `direct`), durable.
pub(super) async fn declare_delayed(channel: &Channel, name: &str) -> Result<()> {
    let mut arguments = FieldTable::default();
    arguments.insert(
        "x-delayed-type".into(),
        AMQPValue::LongString("direct".into()),
    );
    channel
        .exchange_declare(
            name.into(),
            ExchangeKind::Custom("x-delayed-message".into()),
            ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            arguments,
        )
        .await
        .context(
            "declaring an x-delayed-message exchange: is the plugin installed for this \
             broker and enabled? (rabbitmq-plugins enable rabbitmq_delayed_message_exchange)",
        )?;
    Ok(())
}

/// What the plugin did.
struct Measured {
    steady: SteadyPass,
    /// Seconds from the due instant to the last arrival, and how many arrived.
    burst: Option<(f64, u64)>,
}

/// What one steady pass through the plugin measured.
pub struct SteadyPass {
    /// What arrived.
    pub arrivals: Arrivals,
    /// Messages per second the publisher achieved.
    pub achieved_rate: f64,
    /// How busy the whole machine was during the pass.
    pub machine_busy: String,
    /// The broker's CPU per message, beside one plain transit at the same rate (no bridge:
    /// its CPU is zero).
    pub cost: Cost,
}

/// A persistent message with routing key `key` into `exchange`, delayed by `delay_ms`
/// (`x-delay`), stamped with its due time.
pub(super) fn delayed(
    exchange: &str,
    key: &str,
    seq: u64,
    delay_ms: u64,
    body_size: usize,
) -> Outgoing {
    let mut headers = FieldTable::default();
    headers.insert("x-delay".into(), AMQPValue::LongLongInt(delay_ms as i64));
    Outgoing {
        exchange: exchange.into(),
        routing_key: key.into(),
        body: body(seq, (now_ms() + delay_ms) * 1000, body_size),
        properties: BasicProperties::default()
            .with_delivery_mode(2)
            .with_headers(headers),
    }
}

/// The steady pass, then the burst (when asked), through `topology`.
async fn measure(
    base: &Config,
    baseline: &Baseline,
    args: &Args,
    topology: &DelayedTopology,
    load: &Load,
) -> Result<Measured> {
    let steady = steady_pass(base, baseline, topology, load).await?;
    let burst = if args.burst > 0 {
        Some(burst(base, baseline, topology, args.burst, load.body_size).await?)
    } else {
        None
    };
    Ok(Measured { steady, burst })
}

/// `load.count` messages at `load.rate` into the topology's exchange, each delayed
/// uniformly over [`load.min`, `load.max`], collected from its queue.
async fn steady_pass(
    base: &Config,
    baseline: &Baseline,
    topology: &DelayedTopology,
    load: &Load,
) -> Result<SteadyPass> {
    let (name, count) = (topology.name.as_str(), load.count);
    let consumer = amqp::connect(base.url(), "delay-bridge bench plugin collector").await?;
    let collector = Collector::start(&consumer, name, count).await?;
    let channel = crate::load::confirm_channel(&topology.conn).await?;
    let broker_start = broker_cpu_now(baseline)?;
    let machine = MachineCpu::now();
    let (min_ms, max_ms) = (load.min.as_millis() as u64, load.max.as_millis() as u64);
    let published = publish(&channel, count, Some(load.rate), |seq| {
        delayed(
            name,
            KEY,
            seq,
            rand::random_range(min_ms..=max_ms),
            load.body_size,
        )
    })
    .await?;
    let deadline = tokio::time::Instant::now() + load.max + Duration::from_secs(30);
    let arrivals = collector.finish(deadline, Duration::from_secs(1)).await?;
    let broker_end = broker_cpu_now(baseline)?;
    let machine_busy = machine.busy_since(&MachineCpu::now());
    let _ = consumer.close(200, "done".into()).await;
    // Closed here, not dropped: a channel dropped closes in the background, and the
    // connection's close then finds it closing (lapin logs that as an error).
    let _ = channel.close(200, "done".into()).await;
    let publish_s = published.confirmed_us.saturating_sub(published.started_us) as f64 / 1e6;
    Ok(SteadyPass {
        arrivals,
        achieved_rate: count as f64 / publish_s.max(1e-9),
        machine_busy,
        cost: Cost {
            messages: count,
            broker_cpu: broker_cpu_between(broker_start, broker_end),
            baseline_broker_us: baseline.broker_us_per_message(),
            bridge_cpu: Duration::ZERO,
        },
    })
}

/// `count` messages all due at one instant into the topology's exchange: seconds from the
/// due instant to the last arrival, and how many arrived.
async fn burst(
    base: &Config,
    baseline: &Baseline,
    topology: &DelayedTopology,
    count: u64,
    body_size: usize,
) -> Result<(f64, u64)> {
    let name = topology.name.as_str();
    let consumer = amqp::connect(base.url(), "delay-bridge bench plugin collector").await?;
    let collector = Collector::start(&consumer, name, count).await?;
    let channel = crate::load::confirm_channel(&topology.conn).await?;
    // Due far enough ahead that publishing ends first.
    let lead = Duration::from_secs(3) + Duration::from_secs_f64(3.0 * count as f64 / baseline.rate);
    let due = now_ms() + lead.as_millis() as u64;
    publish(&channel, count, None, |seq| {
        let mut out = delayed(name, KEY, seq, due.saturating_sub(now_ms()), body_size);
        out.body = body(seq, due * 1000, body_size);
        out
    })
    .await?;
    let deadline = tokio::time::Instant::now() + lead + Duration::from_secs(60);
    let arrivals = collector.finish(deadline, Duration::from_secs(1)).await?;
    let _ = consumer.close(200, "done".into()).await;
    // Closed here, not dropped: a channel dropped closes in the background, and the
    // connection's close then finds it closing (lapin logs that as an error).
    let _ = channel.close(200, "done".into()).await;
    if arrivals.received == 0 {
        bail!("no message of the burst arrived");
    }
    let drain_s = arrivals.last_us.saturating_sub(due * 1000) as f64 / 1e6;
    Ok((drain_s, arrivals.received))
}
