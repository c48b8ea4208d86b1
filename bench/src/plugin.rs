//! `plugin`: the archived delayed-message plugin (`rabbitmq_delayed_message_exchange`),
//! measured as `steady` and `burst` measure the bridge, for a comparison in one sitting: a
//! steady rate through an `x-delayed-message` exchange (lateness, the broker's CPU per
//! message beside one plain transit), then a burst due at one instant (drain rate). The
//! plugin must be enabled on the broker; without it the scenario says so and fails.

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

use super::Spread;
use super::above_zero::above_zero;
use super::baseline::BaselineArgs;
use super::cost::{broker_cpu_between, broker_cpu_now};
use super::load::{Collector, Outgoing, body, publish};
use super::steady::{Shape, broker_name};

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

pub async fn run(base: &Config, args: &Args) -> Result<()> {
    let (min, max) = args.shape.delays()?;
    let baseline = args
        .baseline
        .measure(base, args.shape.body_size, args.rate)
        .await?;
    let conn = amqp::connect(base.url(), "delay-bridge bench plugin").await?;
    let name = format!(
        "delay-bridge-bench-plugin-{:06x}",
        rand::random::<u32>() & 0xff_ffff
    );
    let channel = crate::load::confirm_channel(&conn).await?;
    declare(&channel, &name).await?;
    let measured = measure(base, &baseline, args, &conn, &name, (min, max)).await;
    let cleanup = conn.create_channel().await?;
    let _ = cleanup
        .queue_delete(name.as_str().into(), QueueDeleteOptions::default())
        .await;
    let _ = cleanup
        .exchange_delete(name.as_str().into(), ExchangeDeleteOptions::default())
        .await;
    let _ = conn.close(200, "done".into()).await;
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
    let spread = Spread::of(&m.steady.lateness_us);
    println!(
        "steady: received {}, missing {}, duplicates {}",
        m.steady.received,
        m.steady.missing(),
        m.steady.duplicates
    );
    if let Some(s) = &spread {
        println!("lateness (arrival - due), ms: {}", Spread::header());
        println!("                              {}", s.row());
    }
    let plain = baseline.broker_us_per_message();
    let broker_line = match (m.broker_us, plain) {
        (Some(us), Some(p)) => format!(
            "{us:.0} us per message, {:.2}x one plain transit at the same rate ({p:.0} us)",
            us / p.max(1e-9)
        ),
        (Some(us), None) => format!("{us:.0} us per message"),
        _ => "not measured".into(),
    };
    println!("CPU: broker {broker_line}");
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
            received: m.steady.received,
            missing: m.steady.missing(),
            duplicates: m.steady.duplicates,
            lateness: spread.map(|s| s.report()),
            cost: report::Cost {
                broker_cpu_us_per_msg: m.broker_us.map(|us| us.round()),
                baseline_broker_cpu_us_per_msg: plain.map(|us| us.round()),
                broker_cpu_ratio: m
                    .broker_us
                    .zip(plain)
                    .map(|(us, p)| (us / p.max(1e-9) * 100.0).round() / 100.0),
                bridge_cpu_us_per_msg: None,
            },
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
    steady: super::load::Arrivals,
    broker_us: Option<f64>,
    /// Seconds from the due instant to the last arrival, and how many arrived.
    burst: Option<(f64, u64)>,
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

async fn measure(
    base: &Config,
    baseline: &super::baseline::Baseline,
    args: &Args,
    conn: &lapin::Connection,
    name: &str,
    (min, max): (Duration, Duration),
) -> Result<Measured> {
    let count = (args.rate * args.seconds).round().max(1.0) as u64;
    let consumer = amqp::connect(base.url(), "delay-bridge bench plugin collector").await?;
    let collector = Collector::start(&consumer, name, count).await?;
    let channel = crate::load::confirm_channel(conn).await?;
    let broker_start = broker_cpu_now(baseline)?;
    let (min_ms, max_ms) = (min.as_millis() as u64, max.as_millis() as u64);
    publish(&channel, count, Some(args.rate), |seq| {
        delayed(
            name,
            KEY,
            seq,
            rand::random_range(min_ms..=max_ms),
            args.shape.body_size,
        )
    })
    .await?;
    let deadline = tokio::time::Instant::now() + max + Duration::from_secs(30);
    let steady = collector.finish(deadline, Duration::from_secs(1)).await?;
    let broker_end = broker_cpu_now(baseline)?;
    let broker_us = broker_cpu_between(broker_start, broker_end)
        .map(|cpu| cpu.as_secs_f64() * 1e6 / count as f64);

    let burst = if args.burst > 0 {
        let collector = Collector::start(&consumer, name, args.burst).await?;
        // Due far enough ahead that publishing ends first.
        let lead = Duration::from_secs(3)
            + Duration::from_secs_f64(3.0 * args.burst as f64 / baseline.rate);
        let due = now_ms() + lead.as_millis() as u64;
        publish(&channel, args.burst, None, |seq| {
            let mut out = delayed(
                name,
                KEY,
                seq,
                due.saturating_sub(now_ms()),
                args.shape.body_size,
            );
            out.body = body(seq, due * 1000, args.shape.body_size);
            out
        })
        .await?;
        let deadline = tokio::time::Instant::now() + lead + Duration::from_secs(60);
        let arrivals = collector.finish(deadline, Duration::from_secs(1)).await?;
        if arrivals.received == 0 {
            bail!("no message of the burst arrived");
        }
        let drain_s = arrivals.last_us.saturating_sub(due * 1000) as f64 / 1e6;
        Some((drain_s, arrivals.received))
    } else {
        None
    };
    let _ = consumer.close(200, "done".into()).await;
    Ok(Measured {
        steady,
        broker_us,
        burst,
    })
}
