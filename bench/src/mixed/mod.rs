//! `mixed`: a soak that lives like production. One bridge child process for the whole run
//! at a steady rate of small messages, with large bodies now and then, a burst due at one
//! instant every few minutes, cancels, reschedules and unroutable messages (see
//! [`traffic`]). It reports the small messages' lateness **per minute** of due time (so a
//! degradation shows), what went missing or came twice, the broker's and the bridge's CPU
//! per message and the bridge's RSS per minute, and draws them as an SVG picture.
//!
//! With `--plugin` the same flow goes through the archived delayed-message plugin instead
//! (enabled on the broker), for a comparison in one sitting: without the cancels,
//! reschedules and unroutable messages, which the plugin cannot carry (a plain
//! [`traffic::Layout`]), and without a bridge to measure.

mod collect;
mod minutes;
mod picture;
mod traffic;
mod via;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use anyhow::{Context, Result};
use delay_bridge_bench::report;
use lapin::BasicProperties;
use tokio::sync::mpsc;

use delay_bridge::amqp;
use delay_bridge::client::{Client, Message, When};
use delay_bridge::clock::now_ms;
use delay_bridge::config::Config;
use delay_bridge::ladder::{format_duration, parse_duration};
use delay_bridge::sandbox::{Sandbox, TargetBinding};

use self::collect::{Collector, Outcomes};
use self::minutes::{CostMinute, DueMinute, Reading};
use self::traffic::{Kind, Layout, message_id};
use self::via::Via;
use super::above_zero::above_zero;
use super::baseline::{Baseline, BaselineArgs};
use super::bridge_metrics::LatenessSplit;
use super::load::{Outgoing, body, now_us, publish};
use super::measured_bridge::MeasuredBridge;
use super::{Spread, Target, mib, ms, print_targets, target_rows};

/// `bench mixed` options.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Small messages per second, the whole run.
    #[arg(long, default_value_t = 2000.0, value_parser = above_zero)]
    rate: f64,
    /// How long the steady flow lasts, minutes.
    #[arg(long, default_value_t = 30.0, value_parser = above_zero)]
    minutes: f64,
    /// The shortest delay of a small message.
    #[arg(long, default_value = "1s")]
    min_delay: String,
    /// The longest delay of a small message.
    #[arg(long, default_value = "20s")]
    max_delay: String,
    /// Body size of the small messages, bytes (at least 16).
    #[arg(long, default_value_t = 64)]
    body_size: usize,
    /// One large body this often (its delay as a small message's).
    #[arg(long, default_value = "1m")]
    large_every: String,
    /// The large bodies' size, bytes.
    #[arg(long, default_value_t = 4 << 20)]
    large_size: usize,
    /// One burst this often, the first halfway through the first period.
    #[arg(long, default_value = "5m")]
    burst_every: String,
    /// Messages per burst, all due at one instant 10 s after the burst starts.
    #[arg(long, default_value_t = 20_000)]
    burst_size: u64,
    /// Where to draw the per-minute picture (SVG).
    #[arg(long)]
    svg: Option<PathBuf>,
    /// Send the flow through the archived delayed-message plugin (enabled on the broker)
    /// instead of a bridge, for a comparison: only small messages in the steady flow, as it
    /// can neither cancel nor park.
    #[arg(long)]
    plugin: bool,
    #[command(flatten)]
    baseline: BaselineArgs,
}

/// Targets at 2 000 msg/s (issue "Real traffic"): p99 lateness of small messages in every
/// minute, and no minute's p99 above this multiple of the first minute's.
const MINUTE_P99_LIMIT_MS: f64 = 20.0;
const MINUTE_P99_DRIFT: f64 = 2.0;
/// The bridge's RSS may exceed `bridge.max_unacked_bytes` by at most this much.
const RSS_ALLOWANCE: u64 = 64 << 20;
/// How many of the latest small messages the report lists.
const LATEST_SHOWN: usize = 5;

/// How long after it is published a cancel or a reschedule is sent.
const CANCEL_AFTER: Duration = Duration::from_millis(500);
/// The shortest delay of a message that is cancelled or rescheduled (well beyond the cancel
/// horizon).
const CANCELLED_MIN_DELAY: Duration = Duration::from_secs(3);
/// A cancel confirmed less than this before its message is due may lose (the bridge may
/// have read and delivered it already); one confirmed earlier must win.
const CANCEL_LEAD: Duration = Duration::from_millis(500);
/// How much later a rescheduled message is due than it first was.
const RESCHEDULED_LATER: Duration = Duration::from_secs(2);
/// How far ahead of its start a burst is due.
const BURST_LEAD: Duration = Duration::from_secs(10);
/// The routing keys: the target (a topic exchange) routes the first to its queue (bound
/// `rk.#`), the bursts' to a queue of their own (bound `burst.#`, read by a consumer of its
/// own on a connection of its own, as a campaign's consumer would be: with one queue for
/// both, a consumer reads a burst's 20 000 messages before the small ones behind them,
/// whatever delivered them), and the last nowhere.
const ROUTED_KEY: &str = "rk.mixed";
const BURST_KEY: &str = "burst.mixed";
const BURST_BINDING: &str = "burst.#";
const UNROUTABLE_KEY: &str = "unroutable.mixed";

/// The run's shape, from its options.
struct Shape {
    duration: Duration,
    min: Duration,
    max: Duration,
    large_every: Duration,
    burst_every: Duration,
    layout: Layout,
}

impl Shape {
    fn of(args: &Args) -> Result<Self> {
        let duration = |flag: &str, text: &str| {
            parse_duration(text).map_err(|e| anyhow::anyhow!("--{flag}: {e}"))
        };
        let (min, max) = (
            duration("min-delay", &args.min_delay)?,
            duration("max-delay", &args.max_delay)?,
        );
        anyhow::ensure!(min <= max, "--min-delay must not exceed --max-delay");
        let large_every = duration("large-every", &args.large_every)?;
        let burst_every = duration("burst-every", &args.burst_every)?;
        anyhow::ensure!(
            !large_every.is_zero() && !burst_every.is_zero(),
            "--large-every and --burst-every must be above 0"
        );
        let duration = Duration::from_secs_f64(args.minutes * 60.0);
        let layout = Layout {
            steady: (args.rate * duration.as_secs_f64()).round() as u64,
            large: (duration.as_secs_f64() / large_every.as_secs_f64()).floor() as u64,
            bursts: (duration.as_secs_f64() / burst_every.as_secs_f64()).floor() as u64,
            burst_size: args.burst_size,
            plain: args.plugin,
        };
        Ok(Self {
            duration,
            min,
            max,
            large_every,
            burst_every,
            layout,
        })
    }
}

pub async fn run(base: &Config, args: &Args) -> Result<()> {
    let shape = Shape::of(args)?;
    let baseline = args
        .baseline
        .measure(base, args.body_size, args.rate)
        .await?;
    let mut sandbox = Sandbox::declare(
        base,
        "delay-bridge-bench-mixed",
        TargetBinding::Topic("rk.#".into()),
    )
    .await?;
    let burst_queue = format!("{}.burst.q", sandbox.prefix());
    sandbox.adopt_queue(&burst_queue);
    declare_burst_queue(&sandbox, &burst_queue).await?;
    let via = if args.plugin {
        let exchange = format!("{}.plugin", sandbox.prefix());
        sandbox.adopt_exchange(&exchange);
        via::declare_plugin_exchange(&sandbox, &exchange, &[ROUTED_KEY, BURST_KEY]).await?;
        Via::Plugin { exchange }
    } else {
        Via::Bridge {
            ingress: sandbox.ingress.clone(),
        }
    };
    let measured = measure(&sandbox, &via, &burst_queue, &baseline, args, &shape).await;
    // Where what never arrived still waits (the bridge has stopped), before the sandbox
    // deletes it: a message still in a queue was late, one in none was lost.
    let left = match &measured {
        Ok(m) if m.outcomes.missing + m.outcomes.unparked > 0 => {
            match sandbox.messages_left().await {
                Ok(left) => Some(left),
                Err(e) => {
                    eprintln!("counting what is left in the topology: {e}");
                    None
                }
            }
        }
        _ => None,
    };
    sandbox.finish().await?;
    report(base, &via, &baseline, args, &shape, measured?, left)
}

/// What one soak measured.
struct Measured {
    due: Vec<DueMinute>,
    cost: Vec<CostMinute>,
    outcomes: Outcomes,
    /// Cancels and reschedules confirmed too close to their message's due time to count.
    late_cancels: u64,
    /// Missing and doubled, by kind.
    by_kind: Vec<(Kind, (u64, u64))>,
    /// The sequence numbers that should have reached the target and did not.
    missing: Vec<u64>,
    strays: u64,
    /// Per burst: seconds from its due instant to its last arrival.
    burst_drains: Vec<f64>,
    /// When the run started (epoch µs).
    start_us: u64,
    /// Per burst: its due instant and its last arrival (epoch µs).
    drains: Vec<(u64, u64)>,
    /// The small messages that arrived latest after their due time, with their kind.
    latest: Vec<(minutes::Arrived, Kind)>,
    peak_rss: u64,
    broker_us: Option<f64>,
    bridge_us: f64,
}

/// The bursts' own queue, bound to the target with [`BURST_BINDING`].
async fn declare_burst_queue(sandbox: &Sandbox, queue: &str) -> Result<()> {
    let channel = sandbox.channel().await?;
    channel
        .queue_declare(
            queue.into(),
            lapin::options::QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            lapin::types::FieldTable::default(),
        )
        .await
        .with_context(|| format!("declaring {queue}"))?;
    channel
        .queue_bind(
            queue.into(),
            sandbox.target.as_str().into(),
            BURST_BINDING.into(),
            lapin::options::QueueBindOptions::default(),
            lapin::types::FieldTable::default(),
        )
        .await
        .with_context(|| format!("binding {queue}"))?;
    let _ = channel.close(200, "declared".into()).await;
    Ok(())
}

async fn measure(
    sandbox: &Sandbox,
    via: &Via,
    burst_queue: &str,
    baseline: &Baseline,
    args: &Args,
    shape: &Shape,
) -> Result<Measured> {
    let layout = shape.layout;
    let bridge = match via {
        Via::Bridge { .. } => Some(MeasuredBridge::start(sandbox).await?),
        Via::Plugin { .. } => None,
    };
    let consumer = amqp::connect(sandbox.config.url(), "delay-bridge bench collector").await?;
    // The bursts' consumer on a connection of its own: on one connection a burst's 20 000
    // deliveries could queue ahead of the small messages' in the collector's socket and
    // count as their lateness.
    let burst_consumer =
        amqp::connect(sandbox.config.url(), "delay-bridge bench burst collector").await?;
    let collector = Collector::start(
        [&consumer, &burst_consumer],
        [sandbox.target_queue.as_str(), burst_queue],
        &sandbox.config.names.parked_queue(),
        layout,
    )
    .await?;
    let published = Arc::new(AtomicU64::new(0));
    let start_us = now_us();
    let bridge_pid = bridge.as_ref().map(MeasuredBridge::pid).transpose()?;
    let metrics_url = bridge.as_ref().map(|b| b.metrics_url().to_owned());
    let sampler = Sampler::start(baseline, bridge_pid, metrics_url, published.clone());

    // Cancels and reschedules, each a moment after its message.
    let client = Client::connect_to(std::slice::from_ref(sandbox.config.url()), sandbox.prefix())
        .await
        .context("the bench's client")?;
    let (cancels_tx, cancels) = mpsc::unbounded_channel();
    let canceller = tokio::spawn(cancel_all(client, cancels, sandbox.ingress.clone()));

    // Large bodies and bursts on a connection of their own, beside the steady flow.
    let side = amqp::connect(sandbox.config.url(), "delay-bridge bench side").await?;
    let large = tokio::spawn(publish_large(
        crate::load::confirm_channel(&side).await?,
        via.clone(),
        shape.layout,
        args.large_size,
        (shape.large_every, shape.min, shape.max),
        published.clone(),
    ));
    let bursts = tokio::spawn(publish_bursts(
        crate::load::confirm_channel(&side).await?,
        via.clone(),
        shape.layout,
        shape.burst_every,
        args.body_size,
        published.clone(),
    ));

    let steady = crate::load::confirm_channel(&sandbox.conn).await?;
    let (min_ms, max_ms) = (shape.min.as_millis() as u64, shape.max.as_millis() as u64);
    let counted = published.clone();
    publish(&steady, layout.steady, Some(args.rate), |seq| {
        counted.fetch_add(1, Ordering::Relaxed);
        let kind = layout.kind(seq);
        let mut delay = rand::random_range(min_ms..=max_ms);
        if matches!(kind, Kind::Cancelled | Kind::Rescheduled) {
            delay = delay.max(CANCELLED_MIN_DELAY.as_millis() as u64);
        }
        let due = now_ms() + delay;
        let key = match kind {
            Kind::Unroutable => UNROUTABLE_KEY,
            _ => ROUTED_KEY,
        };
        let mut out = via.message(seq, due, args.body_size, key);
        if matches!(kind, Kind::Cancelled | Kind::Rescheduled) {
            // As a publisher that may cancel does: the id, and when it entered, so that a
            // cancel sent after the publish drops it even if the bridge reads it later.
            let mut headers = out.properties.headers().clone().unwrap_or_default();
            headers.insert(
                delay_bridge::contract::header::PUBLISHED_AT.into(),
                lapin::types::AMQPValue::LongLongInt(now_ms() as i64),
            );
            out.properties = out
                .properties
                .with_message_id(message_id(seq).into())
                .with_headers(headers);
            let _ = cancels_tx.send((seq, kind, due, tokio::time::Instant::now()));
        }
        out
    })
    .await?;
    drop(cancels_tx);
    large.await.context("the large-body publisher")??;
    bursts.await.context("the burst publisher")??;
    let late_cancels = canceller.await.context("the canceller")??;
    // The minutes end with the publishing; the deliveries after it count in the totals.
    sampler.end_minutes();
    // Every message is due by now plus the longest delay (and a rescheduled one 2 s later).
    let deadline = tokio::time::Instant::now()
        + shape.max.max(BURST_LEAD)
        + RESCHEDULED_LATER
        + Duration::from_secs(30);
    let collected = collector.finish(deadline, Duration::from_secs(2)).await?;
    let (readings, end_reading) = sampler.finish().await?;
    let peak_rss = match bridge {
        Some(bridge) => {
            let end = bridge.usage()?;
            bridge.stop().await?;
            end.peak_rss
        }
        None => 0,
    };
    let _ = consumer.close(200, "done".into()).await;
    let _ = burst_consumer.close(200, "done".into()).await;
    let _ = side.close(200, "done".into()).await;

    let arrived = collected.arrived();
    let drains: Vec<(u64, u64)> = (0..layout.bursts)
        .map(|i| {
            let seqs = layout.burst_seqs(i);
            arrived
                .iter()
                .filter(|a| seqs.contains(&a.seq))
                .fold((u64::MAX, 0), |(due, last), a| {
                    (due.min(a.due_us), last.max(a.at_us))
                })
        })
        .collect();
    let burst_drains = drains
        .iter()
        .map(|&(due, last)| last.saturating_sub(due) as f64 / 1e6)
        .collect();
    let totals = readings.first().copied().map(|first| (first, end_reading));
    let messages = layout.total().max(1) as f64;
    Ok(Measured {
        due: minutes::by_due_minute(&arrived, &layout, start_us, &drains),
        start_us,
        latest: minutes::latest_small(&arrived, &layout, LATEST_SHOWN)
            .into_iter()
            .map(|a| (a, layout.kind(a.seq)))
            .collect(),
        drains,
        cost: minutes::cost_per_minute(&readings),
        outcomes: collected.outcomes(&layout, &late_cancels),
        late_cancels: late_cancels.len() as u64,
        by_kind: collected.by_kind(&layout, &late_cancels),
        missing: collected.missing(&layout, &late_cancels),
        strays: collected.strays,
        burst_drains,
        peak_rss,
        broker_us: totals.and_then(|(a, b)| {
            Some(b.broker_cpu_us?.saturating_sub(a.broker_cpu_us?) as f64 / messages)
        }),
        bridge_us: totals.map_or(0.0, |(a, b)| {
            b.bridge_cpu_us.saturating_sub(a.bridge_cpu_us) as f64 / messages
        }),
    })
}

/// Sends each cancel or reschedule [`CANCEL_AFTER`] its message was published.
/// Returns the sequence numbers whose cancel (or reschedule) was confirmed less than
/// [`CANCEL_LEAD`] before the message was due: such a cancel may lose, by design.
async fn cancel_all(
    client: Client,
    mut cancels: mpsc::UnboundedReceiver<(u64, Kind, u64, tokio::time::Instant)>,
    ingress: String,
) -> Result<Vec<u64>> {
    let mut late = Vec::new();
    while let Some((seq, kind, due_ms, published)) = cancels.recv().await {
        tokio::time::sleep_until(published + CANCEL_AFTER).await;
        let id = message_id(seq);
        if kind == Kind::Rescheduled {
            let later = due_ms + RESCHEDULED_LATER.as_millis() as u64;
            let message = Message::new(ingress.as_str(), ROUTED_KEY, body(seq, later * 1000, 64))
                .with_properties(BasicProperties::default().with_delivery_mode(2))
                .with_message_id(id);
            let at = SystemTime::UNIX_EPOCH + Duration::from_millis(later);
            client
                .reschedule(message, When::At(at))
                .await
                .with_context(|| format!("rescheduling {seq}"))?;
        } else {
            client
                .cancel(&id)
                .await
                .with_context(|| format!("cancelling {seq}"))?;
        }
        if now_ms() + CANCEL_LEAD.as_millis() as u64 > due_ms {
            late.push(seq);
        }
    }
    client.close().await?;
    Ok(late)
}

/// Publishes one large body every `every`, halfway through each period.
async fn publish_large(
    channel: lapin::Channel,
    via: Via,
    layout: Layout,
    size: usize,
    (every, min, max): (Duration, Duration, Duration),
    published: Arc<AtomicU64>,
) -> Result<()> {
    let start = tokio::time::Instant::now();
    for i in 0..layout.large {
        tokio::time::sleep_until(start + every * i as u32 + every / 2).await;
        let delay = rand::random_range(min.as_millis() as u64..=max.as_millis() as u64);
        let seq = layout.large_seq(i);
        let mut out = via.message(seq, now_ms() + delay, size, ROUTED_KEY);
        published.fetch_add(1, Ordering::Relaxed);
        publish(&channel, 1, None, |_| Outgoing {
            exchange: out.exchange.clone(),
            routing_key: out.routing_key.clone(),
            body: std::mem::take(&mut out.body),
            properties: out.properties.clone(),
        })
        .await?;
    }
    Ok(())
}

/// Publishes each burst flat out, halfway through its period, due [`BURST_LEAD`] later.
async fn publish_bursts(
    channel: lapin::Channel,
    via: Via,
    layout: Layout,
    every: Duration,
    body_size: usize,
    published: Arc<AtomicU64>,
) -> Result<()> {
    let start = tokio::time::Instant::now();
    for i in 0..layout.bursts {
        tokio::time::sleep_until(start + every * i as u32 + every / 2).await;
        let due = now_ms() + BURST_LEAD.as_millis() as u64;
        let first = layout.burst_seqs(i).start;
        publish(&channel, layout.burst_size, None, |j| {
            published.fetch_add(1, Ordering::Relaxed);
            via.message(first + j, due, body_size, BURST_KEY)
        })
        .await?;
    }
    Ok(())
}

/// Reads the broker's and the bridge's usage once a minute while the run publishes.
struct Sampler {
    task: tokio::task::JoinHandle<Vec<Reading>>,
    stop: tokio_util::sync::CancellationToken,
    read: Arc<dyn Fn() -> Reading + Send + Sync>,
}

impl Sampler {
    /// Reads the broker and, when there is one, the bridge with process id `bridge` and its
    /// own lateness count at `metrics_url`.
    fn start(
        baseline: &Baseline,
        bridge: Option<i32>,
        metrics_url: Option<String>,
        published: Arc<AtomicU64>,
    ) -> Self {
        let broker = baseline.broker.clone();
        let read: Arc<dyn Fn() -> Reading + Send + Sync> = Arc::new(move || {
            let usage = bridge.and_then(|pid| crate::process_usage::read(pid).ok());
            Reading {
                published: published.load(Ordering::Relaxed),
                broker_cpu_us: broker
                    .as_ref()
                    .and_then(|b| b.cpu().ok())
                    .map(|cpu| cpu.as_micros() as u64),
                bridge_cpu_us: usage.map_or(0, |u| u.cpu.as_micros() as u64),
                bridge_rss: usage.map_or(0, |u| u.rss),
                bridge_lateness: None,
            }
        });
        let stop = tokio_util::sync::CancellationToken::new();
        let stopped = stop.clone();
        let reader = read.clone();
        let task = tokio::spawn(async move {
            let metrics_url = metrics_url.as_deref();
            let mut readings = vec![with_lateness(reader(), metrics_url).await];
            let mut minute = tokio::time::interval(Duration::from_secs(60));
            minute.tick().await;
            loop {
                tokio::select! {
                    _ = minute.tick() => readings.push(with_lateness(reader(), metrics_url).await),
                    _ = stopped.cancelled() => break,
                }
            }
            readings.push(with_lateness(reader(), metrics_url).await);
            readings
        });
        Self { task, stop, read }
    }

    /// The last minute ends now (a shorter one, when the run is not whole minutes).
    fn end_minutes(&self) {
        self.stop.cancel();
    }

    /// The readings of the minutes, and one more now.
    async fn finish(self) -> Result<(Vec<Reading>, Reading)> {
        self.stop.cancel();
        let readings = self.task.await.context("the sampler task")?;
        Ok((readings, (self.read)()))
    }
}

/// How long a minute's reading waits for the bridge's metrics, so that a bridge that does
/// not answer costs that minute's split, not the later minutes' readings.
const METRICS_WITHIN: Duration = Duration::from_secs(5);

/// `reading` with the bridge's own lateness count read from its listener at `metrics_url`
/// (left out when there is no bridge or it does not answer within [`METRICS_WITHIN`]).
async fn with_lateness(mut reading: Reading, metrics_url: Option<&str>) -> Reading {
    if let Some(url) = metrics_url {
        let metrics =
            tokio::time::timeout(METRICS_WITHIN, super::measured_bridge::read_metrics(url)).await;
        reading.bridge_lateness = metrics
            .ok()
            .and_then(Result::ok)
            .and_then(|text| LatenessSplit::read(&text));
    }
    reading
}

/// What went missing, in runs of sequence numbers (a run joins those published within a
/// second of each other), and where messages still waited once the bridge stopped.
fn report_missing(missing: &[u64], rate: u64, left: Option<&[(String, u64)]>) {
    const RUNS_SHOWN: usize = 20;
    if !missing.is_empty() {
        let runs = collect::runs(missing, rate);
        println!(
            "missing by sequence number, in {} runs (the steady flow publishes {rate} a second):",
            runs.len()
        );
        for (first, last, count) in runs.iter().take(RUNS_SHOWN) {
            println!("  {first}-{last}: {count}");
        }
        if runs.len() > RUNS_SHOWN {
            println!("  ... and {} runs more", runs.len() - RUNS_SHOWN);
        }
    }
    match left {
        None => {}
        Some([]) => println!("left in the topology once the bridge stopped: nothing"),
        Some(left) => {
            let queues: Vec<String> = left.iter().map(|(q, n)| format!("{q} {n}")).collect();
            println!(
                "left in the topology once the bridge stopped: {}",
                queues.join(", ")
            );
        }
    }
}

fn report(
    base: &Config,
    via: &Via,
    baseline: &Baseline,
    args: &Args,
    shape: &Shape,
    m: Measured,
    left: Option<Vec<(String, u64)>>,
) -> Result<()> {
    let layout = shape.layout;
    let mix = if layout.plain {
        "no cancels, reschedules or unroutable messages"
    } else {
        "1 % cancelled, 0.5 % rescheduled, 0.5 % unroutable"
    };
    println!(
        "mixed: {} msg/s for {} ({} small, delays [{}, {}], {} B; {mix}), {} bodies of {} one every {}, {} bursts of {} one every {}",
        args.rate,
        format_duration(shape.duration),
        layout.steady,
        format_duration(shape.min),
        format_duration(shape.max),
        args.body_size,
        layout.large,
        mib(args.large_size as u64),
        format_duration(shape.large_every),
        layout.bursts,
        layout.burst_size,
        format_duration(shape.burst_every),
    );
    println!("{}: {}", via.label(), via.description());
    println!(
        "broker: {} ({})",
        base.url(),
        super::steady::broker_name(baseline)
    );
    println!("{}", baseline.line());
    let o = m.outcomes;
    println!(
        "missing {}, doubled {}, cancelled but delivered {}, unroutable not parked once {} (parked more than once {}), parked wrongly {}, strays {}",
        o.missing, o.doubled, o.cancel_lost, o.unparked, o.parked_again, o.misparked, m.strays
    );
    println!(
        "cancels and reschedules confirmed less than {} before their message was due (not counted): {}",
        format_duration(CANCEL_LEAD),
        m.late_cancels
    );
    for (kind, (missing, doubled)) in &m.by_kind {
        if missing + doubled > 0 {
            println!("  {kind:?}: missing {missing}, doubled {doubled}");
        }
    }
    report_missing(&m.missing, args.rate.max(1.0) as u64, left.as_deref());
    println!(
        "per minute of due time: small messages' lateness, ms; per minute of the run: CPU per message published, us; bridge RSS; of what the bridge delivered, % late over 10 ms by its own count at its confirm / when it read them"
    );
    println!(
        "{:>6} {:>8} {} {:>6} {:>6} | {:>8} {:>8} {:>10} {:>13}",
        "minute",
        "small",
        Spread::header(),
        "large",
        "burst",
        "broker",
        "bridge",
        "RSS",
        "late conf/read"
    );
    let rows = m.due.len().max(m.cost.len());
    // Nothing to read of a bridge when the plugin carries the delays.
    let bridged = via.is_bridge();
    for i in 0..rows {
        let due = m.due.get(i);
        let cost = m.cost.get(i);
        let small = due.and_then(|d| d.small);
        let late = cost
            .filter(|_| bridged)
            .and_then(|c| c.bridge_lateness)
            .map_or_else(
                || "-".into(),
                |late| {
                    let (confirmed, read) = late.shares();
                    format!("{confirmed:.2}/{read:.2}")
                },
            );
        println!(
            "{:>6} {:>8} {} {:>6} {:>6} | {:>8} {:>8} {:>10} {late:>13}",
            i + 1,
            small.map_or(0, |s| s.count),
            small.map_or_else(|| format!("{:>53}", "-"), |s| s.row()),
            due.map_or(0, |d| d.large_due),
            due.map_or(0, |d| d.burst_due),
            cost.and_then(|c| c.broker_us)
                .map_or_else(|| "-".into(), |us| format!("{us:.0}")),
            cost.filter(|_| bridged)
                .map_or_else(|| "-".into(), |c| format!("{:.0}", c.bridge_us)),
            cost.filter(|_| bridged)
                .map_or_else(|| "-".into(), |c| mib(c.bridge_rss)),
        );
    }
    let drains: Vec<String> = m.burst_drains.iter().map(|s| format!("{s:.2} s")).collect();
    println!(
        "bursts drained (due instant to last arrival): {}",
        drains.join(", ")
    );
    let drain_starts: Vec<String> = m
        .drains
        .iter()
        .map(|&(due, _)| format!("{:.3} s", due.saturating_sub(m.start_us) as f64 / 1e6))
        .collect();
    println!("bursts due at (into the run): {}", drain_starts.join(", "));
    for (a, kind) in &m.latest {
        println!(
            "late: small message {} ({kind:?}) due {:.3} s into the run, {:.1} ms late",
            a.seq,
            a.due_us.saturating_sub(m.start_us) as f64 / 1e6,
            a.at_us.saturating_sub(a.due_us) as f64 / 1e3
        );
    }
    for due in &m.due {
        if let Some(during) = due.small_while_draining {
            println!(
                "minute {}: the {} small messages due while its burst drained: {}",
                due.minute,
                during.count,
                during.row()
            );
        }
    }
    let plain = baseline.broker_us_per_message();
    let bridge_whole = if bridged {
        format!(
            ", bridge {:.0} us per message, bridge peak RSS {}",
            m.bridge_us,
            mib(m.peak_rss)
        )
    } else {
        String::new()
    };
    println!(
        "whole run: broker {} us per message ({}){bridge_whole}",
        m.broker_us
            .map_or_else(|| "-".into(), |us| format!("{us:.0}")),
        m.broker_us.zip(plain).map_or_else(
            || "plain transit unknown".into(),
            |(us, p)| format!("{:.2} x a plain transit", us / p.max(1e-9))
        ),
    );
    if let Some(path) = &args.svg {
        let title = format!(
            "{} mixed soak: {} msg/s, {}, {}",
            if bridged {
                "delay-bridge"
            } else {
                "delayed-message plugin"
            },
            args.rate,
            format_duration(shape.duration),
            super::steady::broker_name(baseline)
        );
        picture::draw(path, &title, &m.due, &m.cost, bridged)?;
        println!("picture: {}", path.display());
    }

    // Minutes entirely inside the steady flow count (the last may be partly after it).
    let steady_minutes: Vec<&DueMinute> = m
        .due
        .iter()
        .filter(|d| (d.minute as f64) <= args.minutes)
        .collect();
    let p99s: Vec<i64> = steady_minutes
        .iter()
        .filter_map(|d| Some(d.small?.p99))
        .collect();
    let worst = p99s.iter().copied().max().unwrap_or(i64::MAX);
    let first = p99s.first().copied().unwrap_or(0);
    let budget = base.max_unacked_bytes;
    let mut targets = vec![
        Target::new(
            format!("p99 of small messages <= {MINUTE_P99_LIMIT_MS} ms in every minute"),
            format!("worst minute {} ms", ms(worst)),
            (worst as f64) <= MINUTE_P99_LIMIT_MS * 1000.0,
        ),
        Target::new(
            format!("no minute's p99 over {MINUTE_P99_DRIFT}x the first minute's"),
            format!("first {} ms, worst {} ms", ms(first), ms(worst)),
            (worst as f64) <= MINUTE_P99_DRIFT * first.max(1) as f64,
        ),
        Target::new(
            "every message as it should end: once, cancelled, or parked",
            format!(
                "{} missing, {} doubled, {} cancels lost, {} unparked, {} misparked",
                o.missing, o.doubled, o.cancel_lost, o.unparked, o.misparked
            ),
            o == Outcomes::default() && m.strays == 0,
        ),
    ];
    if bridged {
        targets.insert(
            2,
            Target::new(
                format!("bridge RSS <= max_unacked_bytes + {}", mib(RSS_ALLOWANCE)),
                format!("peak {}", mib(m.peak_rss)),
                m.peak_rss <= budget + RSS_ALLOWANCE,
            ),
        );
    }
    print_targets(&targets);
    let report = report::Report::new(
        "mixed",
        report::Mixed {
            rate: args.rate,
            minutes: args.minutes,
            large_size: args.large_size as u64,
            burst_size: args.burst_size,
            missing: o.missing,
            doubled: o.doubled,
            cancel_lost: o.cancel_lost,
            unparked: o.unparked,
            misparked: o.misparked,
            strays: m.strays,
            late_cancels: m.late_cancels,
            minutes_due: m
                .due
                .iter()
                .map(|d| {
                    let due = report::MinuteDue {
                        small: d.small.map(|s| s.report()),
                        small_while_draining: d.small_while_draining.map(|s| s.report()),
                        large_due: d.large_due,
                        burst_due: d.burst_due,
                    };
                    (format!("{:02}", d.minute), due)
                })
                .collect(),
            minutes_cost: m
                .cost
                .iter()
                .map(|c| {
                    let cost = report::MinuteCost {
                        published: c.published,
                        broker_us: c.broker_us,
                        bridge_us: c.bridge_us,
                        bridge_rss_bytes: c.bridge_rss,
                        bridge_lateness: c.bridge_lateness.map(|l| l.report()),
                    };
                    (format!("{:02}", c.minute), cost)
                })
                .collect(),
            first_minute_p99_ms: first as f64 / 1000.0,
            worst_minute_p99_ms: worst as f64 / 1000.0,
            burst_drain_s: m.burst_drains.clone(),
            broker_us: m.broker_us,
            bridge_us: m.bridge_us,
            bridge_peak_rss_bytes: m.peak_rss,
        },
    )
    .bridge(via.description())
    .baseline(baseline.report())
    .targets(target_rows(&targets));
    println!("{}", report.to_line());
    Ok(())
}
