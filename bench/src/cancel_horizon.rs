//! The cancel horizon: how long before a message's deliver-at a *confirmed* cancel still
//! stops it.
//!
//! For each lead time L in the list, `count` messages are scheduled with due times spread
//! over the run, and for each a task cancels it so that the cancel is sent L before the due
//! time. The time the broker confirmed the cancel is recorded, so the actual lead (due
//! minus confirm) is measured, not assumed. Then every message that was not cancelled and a
//! final sentinel are awaited: a cancelled message that arrives arrives before the sentinel.
//!
//! The broker's CPU over the run (scheduling, cancels, hops, deliveries) is reported per
//! scheduled message beside one plain transit at the same rate (the baseline's paced pass).
//! The bridge runs in this process, so its own CPU cannot be told apart and is not reported.

use std::cmp::Reverse;
use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use anyhow::{Context, Result, bail};
use delay_bridge_bench::report;

use delay_bridge::bridge::Stats;
use delay_bridge::client::{Client, Message, When};
use delay_bridge::clock::now_ms;
use delay_bridge::config::Config;
use delay_bridge::ladder::{format_duration, parse_duration};

use delay_bridge::sandbox::{Sandbox, TargetBinding, watch_queue};

use super::baseline::{Baseline, BaselineArgs};
use super::cost::{Cost, broker_cpu_between, broker_cpu_now};

/// Messages are scheduled this far apart, ms: the rate the baseline's paced pass runs at.
const SPACING_MS: u64 = 10;
/// How long the bridge's counters may take, after the sentinel arrived, to account for
/// every message: it counts a delivery once the broker confirmed it, which can come after
/// the target's consumer already has it.
const COUNTERS_SETTLE: Duration = Duration::from_secs(10);

/// `bench cancel-horizon` options.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Messages per lead time.
    #[arg(long, default_value_t = 50)]
    count: usize,
    /// Lead times: how long before the due time each cancel is sent.
    #[arg(long, default_value = "1s 200ms 100ms 50ms 20ms 10ms 5ms 2ms 0ms")]
    leads: String,
    /// The delay of the first message; the rest are spread 10 ms apart after it.
    #[arg(long, default_value = "3s")]
    delay: String,
    #[command(flatten)]
    baseline: BaselineArgs,
}

struct Sample {
    /// The lead the cancel was sent with, ms.
    lead_ms: u64,
    /// Due minus the cancel's confirm, ms (negative: confirmed after the due time).
    confirmed_lead_ms: i64,
    /// The message arrived anyway.
    lost: bool,
}

pub async fn run(base: &Config, args: &Args) -> Result<()> {
    let leads: Vec<Duration> = args
        .leads
        .split_whitespace()
        .map(|l| parse_duration(l).map_err(|e| anyhow::anyhow!("--leads {l:?}: {e}")))
        .collect::<Result<_>>()?;
    let first = parse_duration(&args.delay).map_err(|e| anyhow::anyhow!("--delay: {e}"))?;
    let baseline = args
        .baseline
        .measure(base, 16, 1000.0 / SPACING_MS as f64)
        .await?;
    let bench = Sandbox::start(base, "delay-bridge-bench-cancel", TargetBinding::Fanout).await?;
    let broker_start = broker_cpu_now(&baseline)?;
    let samples = measure(&bench, &leads, args.count, first).await;
    let broker_cpu = broker_cpu_between(broker_start, broker_cpu_now(&baseline)?);
    let stats = bench
        .stats()
        .context("this bench runs the bridge in process")?;
    // Each message dropped or delivered, and the sentinel delivered.
    let expected = samples.as_ref().map_or(0, |s| s.len() as u64) + 1;
    let counters = settled_counters(&stats, expected).await;
    bench.finish().await?;
    let samples = samples?;
    // The bridge runs in this process: only the broker's side of the cost is measured.
    let cost = Cost {
        messages: samples.len() as u64,
        broker_cpu,
        baseline_broker_us: baseline.broker_us_per_message(),
        bridge_cpu: std::time::Duration::ZERO,
    };
    report(&samples, counters, base, &baseline, &cost);
    Ok(())
}

/// The bridge's (dropped, delivered) counters once they add up to `expected`, or as they
/// stand after [`COUNTERS_SETTLE`].
async fn settled_counters(stats: &Stats, expected: u64) -> (u64, u64) {
    let deadline = tokio::time::Instant::now() + COUNTERS_SETTLE;
    loop {
        let now = stats.snapshot();
        if now.cancelled + now.delivered >= expected || tokio::time::Instant::now() >= deadline {
            return (now.cancelled, now.delivered);
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn measure(
    bench: &Sandbox,
    leads: &[Duration],
    count: usize,
    first: Duration,
) -> Result<Vec<Sample>> {
    let client =
        Arc::new(Client::connect(bench.config.url().expose(), bench.config.names.prefix()).await?);
    let mut arrivals = watch_queue(&bench.conn, &bench.target_queue).await?;
    // Interleave the lead times so each sees the same conditions over the run.
    let start = now_ms() + first.as_millis() as u64;
    let plan: Vec<(String, u64, Duration)> = (0..count * leads.len())
        .map(|k| {
            (
                format!("m{k}"),
                start + SPACING_MS * k as u64,
                leads[k % leads.len()],
            )
        })
        .collect();
    let last_due = plan.last().map_or(start, |p| p.1);
    for (id, due, _) in &plan {
        client
            .schedule(
                Message::new(bench.ingress.as_str(), "", id.as_bytes().to_vec())
                    .with_message_id(id.as_str()),
                When::At(UNIX_EPOCH + Duration::from_millis(*due)),
            )
            .await?;
    }
    if now_ms() + 500 > start {
        bail!(
            "scheduling took too long for --delay {}: raise it",
            format_duration(first)
        );
    }
    let mut cancels = Vec::new();
    for (id, due, lead) in plan.iter().cloned() {
        let client = client.clone();
        cancels.push(tokio::spawn(async move {
            let send_at = due.saturating_sub(lead.as_millis() as u64);
            tokio::time::sleep(Duration::from_millis(send_at.saturating_sub(now_ms()))).await;
            client.cancel(&id).await.map(|_| now_ms())
        }));
    }
    let mut confirmed = Vec::with_capacity(cancels.len());
    for c in cancels {
        confirmed.push(c.await??);
    }
    client
        .schedule(
            Message::new(bench.ingress.as_str(), "", b"sentinel".to_vec())
                .with_message_id("sentinel"),
            When::At(UNIX_EPOCH + Duration::from_millis(last_due + 500)),
        )
        .await?;
    let mut arrived = HashSet::new();
    loop {
        let d = tokio::time::timeout(Duration::from_secs(30), arrivals.recv())
            .await
            .context("the sentinel did not arrive within 30 s")?
            .context("consumer ended")?;
        let id = String::from_utf8_lossy(&d.body).into_owned();
        if id == "sentinel" {
            break;
        }
        arrived.insert(id);
    }
    drop(arrivals);
    if let Ok(c) = Arc::try_unwrap(client) {
        c.close().await?;
    }
    Ok(plan
        .iter()
        .zip(confirmed)
        .map(|((id, due, lead), at)| Sample {
            lead_ms: lead.as_millis() as u64,
            confirmed_lead_ms: *due as i64 - at as i64,
            lost: arrived.contains(id),
        })
        .collect())
}

fn report(
    samples: &[Sample],
    (dropped, delivered): (u64, u64),
    base: &Config,
    baseline: &Baseline,
    cost: &Cost,
) {
    let mut rows: BTreeMap<Reverse<u64>, Vec<&Sample>> = BTreeMap::new();
    for s in samples {
        rows.entry(Reverse(s.lead_ms)).or_default().push(s);
    }
    println!(
        "cancel horizon: bridge in process (library Bridge::run), margin {}, broker {}",
        format_duration(base.margin),
        base.url()
    );
    println!(
        "{:>10}  {:>8}  {:>5}  {:>24}",
        "sent lead", "honoured", "lost", "confirmed lead p50 / min"
    );
    let mut report_rows = Vec::new();
    for (Reverse(lead), row) in rows {
        let mut leads: Vec<i64> = row.iter().map(|s| s.confirmed_lead_ms).collect();
        leads.sort();
        let lost = row.iter().filter(|s| s.lost).count();
        let p50 = super::Spread::of(&leads).map_or(0, |spread| spread.p50);
        let min = leads.first().copied().unwrap_or(0);
        println!(
            "{lead:>8}ms  {:>8}  {lost:>5}  {p50:>15} / {min:>4} ms",
            row.len() - lost
        );
        report_rows.push(report::HorizonRow {
            lead_ms: lead,
            sent: row.len() as u64,
            honoured: (row.len() - lost) as u64,
            lost: lost as u64,
            confirmed_lead_p50_ms: p50,
            confirmed_lead_min_ms: min,
        });
    }
    let largest_lost = samples
        .iter()
        .filter(|s| s.lost)
        .map(|s| s.confirmed_lead_ms)
        .max();
    let smallest_won = samples
        .iter()
        .filter(|s| !s.lost)
        .map(|s| s.confirmed_lead_ms)
        .min();
    match largest_lost {
        Some(l) => println!(
            "horizon: the largest confirmed lead that still lost was {l} ms; every cancel confirmed more than {l} ms before deliver-at won"
        ),
        None => println!(
            "horizon: no cancel lost; the smallest confirmed lead that won was {} ms",
            smallest_won.unwrap_or(0)
        ),
    }
    println!("bridge counters: {dropped} copies dropped, {delivered} delivered");
    println!("{}", baseline.line());
    let (broker_us, ratio) = (cost.broker_us(), cost.broker_ratio());
    match (broker_us, ratio) {
        (Some(us), Some(ratio)) => println!(
            "CPU: broker {us:.0} us per scheduled message (its cancel, hops and delivery included), {ratio:.2}x one plain transit at the same rate; bridge in process, not measured apart"
        ),
        _ => println!("CPU: broker not measured; bridge in process, not measured apart"),
    }
    println!(
        "{}",
        report::Report::new(
            "cancel-horizon",
            report::CancelHorizon {
                margin_ms: base.margin.as_millis() as u64,
                rows: report_rows,
                largest_lost_confirmed_lead_ms: largest_lost,
                smallest_won_confirmed_lead_ms: smallest_won,
                dropped,
                delivered,
                cost: report::Cost {
                    bridge_cpu_us_per_msg: None,
                    ..cost.report()
                },
            },
        )
        .bridge("in process (library Bridge::run)")
        .baseline(baseline.report())
        .to_line()
    );
}
