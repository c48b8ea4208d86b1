//! `plugin-move`: moving a delayed exchange off the archived delayed-message plugin onto the
//! bridge, run end to end as docs/operations.md's procedure says, with counts.
//!
//! 1. The setup under the plugin: the publishers' exchange (`x-delayed-message`, routing as
//!    `direct`) bound to the consumers' queue with the publishers' routing key.
//! 2. Messages published into the plugin with `x-delay`, most still waiting in it at the
//!    move.
//! 3. The move, publishers paused and the plugin suspended (`rabbitmqctl eval
//!    'sys:suspend(rabbit_delayed_message).'`, resumed after): the target exchange takes the plugin exchange's bindings;
//!    the plugin exchange is deleted and declared again, same name, as the bridge's
//!    `headers` ingress (`ingress_type = "headers"`), bound to the work queue, and to the
//!    target with each routing key it was bound with and a header no message carries. The
//!    plugin keeps the messages of a deleted exchange and, when each is due, routes it by
//!    that name and its routing key, ignoring binding arguments: to the target, directly
//!    (through the bridge it would wait its delay again: this plugin build leaves `x-delay`
//!    as it was). A message published to the ingress matches only the work queue's binding.
//!    The bridge starts.
//! 4. Messages published into the same exchange name with `x-delay` again, now through the
//!    bridge.
//!
//! It reports published before and after, delivered, doubled and lost, and how many were
//! still waiting in the plugin at the move. The plugin must be enabled on the broker.

use std::time::Duration;

use anyhow::{Context, Result, bail};
use delay_bridge_bench::report;
use lapin::options::{ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, ExchangeKind};

use delay_bridge::amqp;
use delay_bridge::clock::now_ms;
use delay_bridge::config::{Config, IngressKind};
use delay_bridge::ladder::format_duration;
use delay_bridge::sandbox::{Sandbox, TargetBinding};

use super::Spread;
use super::above_zero::above_zero;
use super::broker_memory::Ctl;
use super::load::{Collector, publish};
use super::measured_bridge::MeasuredBridge;
use super::plugin::{declare_delayed, delayed};
use super::steady::Shape;

/// `bench plugin-move` options.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Messages published into the plugin before the move.
    #[arg(long, default_value_t = 20_000)]
    before: u64,
    /// Messages published into the same exchange after the move.
    #[arg(long, default_value_t = 20_000)]
    after: u64,
    /// Messages per second while publishing.
    #[arg(long, default_value_t = 2000.0, value_parser = above_zero)]
    rate: f64,
    #[command(flatten)]
    shape: Shape,
    /// How to run rabbitmqctl against the broker under test (for example
    /// "bash scripts/debian-broker.sh trixie ctl").
    #[arg(long, env = "DELAY_BRIDGE_CTL", default_value = "rabbitmqctl")]
    ctl: String,
}

/// The publishers' routing key, bound as under the plugin.
const KEY: &str = "orders.close";

pub async fn run(base: &Config, args: &Args) -> Result<()> {
    let (min, max) = args.shape.delays()?;
    let mut sandbox = Sandbox::declare(
        base,
        "delay-bridge-bench-move",
        TargetBinding::Topic(KEY.into()),
    )
    .await?;
    let measured = measure(&mut sandbox, args, (min, max)).await;
    let finished = sandbox.finish().await;
    let m = measured?;
    finished?;

    let total = args.before + args.after;
    let lost = total - m.arrivals.received;
    println!(
        "plugin-move: {} messages into the plugin's exchange, the move, {} more into the same exchange name; {} msg/s, x-delay uniform over [{}, {}], body {} B",
        args.before,
        args.after,
        args.rate,
        format_duration(min),
        format_duration(max),
        args.shape.body_size
    );
    println!(
        "waiting in the plugin at the move: {} (due after it); the move took {} ms (publishers paused), the plugin was suspended {} ms around it",
        m.waiting_at_move, m.move_ms, m.suspended_ms
    );
    println!(
        "published before {}, after {}; delivered {}, doubled {}, lost {}",
        args.before, args.after, m.arrivals.received, m.arrivals.duplicates, lost
    );
    let spread = Spread::of(&m.arrivals.lateness_us);
    if let Some(s) = &spread {
        println!("lateness (arrival - due), ms: {}", Spread::header());
        println!("                              {}", s.row());
    }
    println!(
        "{}",
        report::Report::new(
            "plugin-move",
            report::PluginMove {
                published_before: args.before,
                published_after: args.after,
                waiting_at_move: m.waiting_at_move,
                move_ms: m.move_ms,
                suspended_ms: m.suspended_ms,
                delivered: m.arrivals.received,
                doubled: m.arrivals.duplicates,
                lost,
                lateness: spread.map(|s| s.report()),
            },
        )
        .to_line()
    );
    if lost > 0 || m.arrivals.duplicates > 0 {
        bail!("the move lost {lost} and doubled {}", m.arrivals.duplicates);
    }
    Ok(())
}

/// What the move did.
struct Measured {
    arrivals: super::load::Arrivals,
    waiting_at_move: u64,
    /// The exchange's delete, declare and bindings.
    move_ms: u64,
    /// The plugin suspended, around the move (two `rabbitmqctl eval` calls).
    suspended_ms: u64,
}

async fn measure(
    sandbox: &mut Sandbox,
    args: &Args,
    (min, max): (Duration, Duration),
) -> Result<Measured> {
    let exchange = sandbox.ingress.clone();
    let exchange = exchange.as_str();
    let channel = crate::load::confirm_channel(&sandbox.conn).await?;
    // 1. As it was under the plugin: the sandbox declared the name as the bridge's ingress;
    // it becomes the plugin's exchange, bound to the consumers' queue.
    delete_exchange(&channel, exchange).await?;
    declare_delayed(&channel, exchange).await?;
    bind(&channel, &sandbox.target_queue, exchange, KEY).await?;
    let consumer = amqp::connect(sandbox.config.url(), "delay-bridge bench move collector").await?;
    let total = args.before + args.after;
    let collector = Collector::start(&consumer, &sandbox.target_queue, total).await?;

    // 2. Into the plugin.
    let (min_ms, max_ms) = (min.as_millis() as u64, max.as_millis() as u64);
    let mut dues = Vec::with_capacity(total as usize);
    publish(&channel, args.before, Some(args.rate), |seq| {
        let delay = rand::random_range(min_ms..=max_ms);
        dues.push(now_ms() + delay);
        delayed(exchange, KEY, seq, delay, args.shape.body_size)
    })
    .await?;

    // 3. The move. (The sandbox declared the target exchange with the queue's binding.)
    // The plugin waits while the exchange has no bindings: a message it released then
    // would be routed nowhere, and lost.
    let ctl = Ctl::parse(&args.ctl)?;
    let suspended = now_ms();
    ctl.call(&["eval", "sys:suspend(rabbit_delayed_message)."])
        .await
        .context("suspending the plugin (rabbitmqctl eval; set --ctl or DELAY_BRIDGE_CTL)")?;
    let started = now_ms();
    let work_queue = sandbox.config.names.work_queue();
    delete_exchange(&channel, exchange).await?;
    channel
        .exchange_declare(
            exchange.into(),
            ExchangeKind::Headers,
            ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .context("declaring the bridge's ingress")?;
    bind(&channel, &work_queue, exchange, "").await?;
    let mut drain_only = FieldTable::default();
    drain_only.insert("x-match".into(), AMQPValue::LongString("all".into()));
    drain_only.insert(
        "delay-bridge-plugin-drain".into(),
        AMQPValue::LongString("yes".into()),
    );
    channel
        .exchange_bind(
            sandbox.target.as_str().into(),
            exchange.into(),
            KEY.into(),
            lapin::options::ExchangeBindOptions::default(),
            drain_only,
        )
        .await
        .context("binding the target to the ingress for the plugin's messages")?;
    let move_ms = now_ms() - started;
    ctl.call(&["eval", "sys:resume(rabbit_delayed_message)."])
        .await
        .context("resuming the plugin")?;
    let suspended_ms = now_ms() - suspended;
    sandbox.config.routes[0].ingress_kind = IngressKind::Headers;
    let waiting_at_move = dues.iter().filter(|due| **due > started).count() as u64;
    let bridge = MeasuredBridge::start(sandbox).await?;

    // 4. Into the same name, through the bridge.
    publish(&channel, args.after, Some(args.rate), |seq| {
        let seq = args.before + seq;
        let delay = rand::random_range(min_ms..=max_ms);
        delayed(exchange, KEY, seq, delay, args.shape.body_size)
    })
    .await?;
    let deadline = tokio::time::Instant::now() + max + Duration::from_secs(30);
    let arrivals = collector.finish(deadline, Duration::from_secs(2)).await?;
    bridge.stop().await?;
    let _ = consumer.close(200, "done".into()).await;
    Ok(Measured {
        arrivals,
        waiting_at_move,
        move_ms,
        suspended_ms,
    })
}

/// Deletes `name` (absent is fine).
async fn delete_exchange(channel: &Channel, name: &str) -> Result<()> {
    channel
        .exchange_delete(name.into(), ExchangeDeleteOptions::default())
        .await
        .with_context(|| format!("deleting exchange {name}"))
}

/// Binds `queue` to `exchange` with `key`.
async fn bind(channel: &Channel, queue: &str, exchange: &str, key: &str) -> Result<()> {
    channel
        .queue_bind(
            queue.into(),
            exchange.into(),
            key.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .with_context(|| format!("binding {queue} to {exchange} with `{key}`"))
}
