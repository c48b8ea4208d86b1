//! Fault scenarios: load through the bridge while something breaks (the bridge's
//! connections, the bridge process, a broker, a cluster node), or hostile headers. Each
//! reports the same tally: messages sent, delivered, missing, duplicates, parked, and
//! lateness; and prints its targets as PASS or MISS.

pub mod bridge_chaos;
pub mod broker_loss;
pub mod connection_cuts;
pub mod fuzz;
pub mod traffic;

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, Result};
use delay_bridge_bench::report;
use futures::StreamExt;
use lapin::types::AMQPValue;

use delay_bridge::clock::now_ms;
use delay_bridge::config::BrokerUrl;
use delay_bridge::contract::header;
use delay_bridge::ladder::{format_duration, parse_duration};
use delay_bridge::naming::Names;

use super::above_zero::above_zero;
use super::load::{Outgoing, consume_no_ack, due_at, read_body};
use super::{Spread, Target, ms, print_targets, target_rows};
use traffic::{Seen, Sent};

/// The load of a fault scenario.
#[derive(Debug, Clone, clap::Args)]
pub struct Load {
    /// Messages to send.
    #[arg(long, default_value_t = 50_000)]
    pub count: u64,
    /// Messages per second.
    #[arg(long, default_value_t = 1000.0, value_parser = above_zero)]
    pub rate: f64,
    /// The shortest delay.
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    pub min_delay: Duration,
    /// The longest delay.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub max_delay: Duration,
}

impl Load {
    /// Checks the options.
    pub fn check(&self) -> Result<()> {
        anyhow::ensure!(self.count > 0, "--count must be > 0");
        anyhow::ensure!(
            self.min_delay <= self.max_delay,
            "--min-delay must not exceed --max-delay"
        );
        Ok(())
    }

    /// Message `seq` to `ingress`, due a random delay within the range from now.
    pub fn message(&self, ingress: &str, seq: u64) -> Outgoing {
        let (min, max) = (
            self.min_delay.as_millis() as u64,
            self.max_delay.as_millis() as u64,
        );
        due_at(ingress, seq, now_ms() + rand::random_range(min..=max), 100)
    }

    /// One line for the report.
    pub fn describe(&self) -> String {
        format!(
            "{} messages at {}/s, delays uniform over [{}, {}]",
            self.count,
            self.rate,
            format_duration(self.min_delay),
            format_duration(self.max_delay)
        )
    }
}

/// Publishes `load` to `ingress` through `urls` in a task of its own.
pub fn spawn_load(
    urls: Vec<BrokerUrl>,
    load: &Load,
    ingress: String,
) -> tokio::task::JoinHandle<Result<Sent>> {
    let load = load.clone();
    tokio::spawn(async move {
        traffic::publish_through_faults(&urls, load.count, load.rate, |seq| {
            load.message(&ingress, seq)
        })
        .await
    })
}

/// Ends a scenario once its load is published: waits for every message, up to the longest
/// delay plus `grace`, then reads the bridge's parked queue (named by `names`) and tallies.
pub async fn tally_after(
    scenario: &'static str,
    load: &Load,
    sent: Sent,
    collector: traffic::FaultCollector,
    names: &Names,
    grace: Duration,
) -> Result<Tally> {
    let deadline = tokio::time::Instant::now() + load.max_delay + grace;
    let urls = collector.urls.clone();
    let seen = collector
        .finish(load.count, deadline, Duration::from_secs(2))
        .await?;
    let parked = read_parked(&urls, &names.parked_queue(), load.count).await?;
    Ok(Tally {
        scenario,
        count: load.count,
        sent,
        seen,
        parked,
    })
}

/// What the parked queue held at the end of a scenario.
#[derive(Debug, Clone, Default)]
pub struct Parked {
    /// Copies per sequence number.
    pub copies: Vec<u32>,
    /// Messages per reason.
    pub by_reason: BTreeMap<String, u64>,
}

impl Parked {
    /// Parked messages in all.
    pub fn total(&self) -> u64 {
        self.by_reason.values().sum()
    }
}

/// Reads the parked queue to the end (acknowledging: the scenario's topology is deleted
/// next) and counts its messages by sequence number and reason.
pub async fn read_parked(urls: &[BrokerUrl], queue: &str, expected: u64) -> Result<Parked> {
    count_parked(urls, queue, expected, true).await
}

/// As [`read_parked`], leaving every message in the queue: they are read unacknowledged
/// and go back, in their order, when the reader's channel closes.
pub async fn peek_parked(urls: &[BrokerUrl], queue: &str, expected: u64) -> Result<Parked> {
    count_parked(urls, queue, expected, false).await
}

/// Reads the parked queue to the end, taking its messages out or not (`take`).
async fn count_parked(
    urls: &[BrokerUrl],
    queue: &str,
    expected: u64,
    take: bool,
) -> Result<Parked> {
    let mut next = 0;
    let conn = traffic::connect_any(urls, &mut next, "delay-bridge faults parked reader").await?;
    let consumed = if take {
        consume_no_ack(&conn, queue, "delay-bridge-faults-parked").await
    } else {
        consume_unacked(&conn, queue, "delay-bridge-faults-parked-peek").await
    };
    let (channel, mut consumer) = consumed.with_context(|| format!("consuming {queue}"))?;
    let mut parked = Parked {
        copies: vec![0; expected as usize],
        ..Parked::default()
    };
    // The queue is settled (nothing enters it any more): it is read when a second passes
    // without a message.
    while let Ok(Some(delivery)) =
        tokio::time::timeout(Duration::from_secs(1), consumer.next()).await
    {
        let delivery = delivery?;
        let reason = delivery
            .properties
            .headers()
            .as_ref()
            .and_then(|h| h.inner().get(header::REASON).cloned())
            .map_or_else(
                || "(none)".to_string(),
                |v| match v {
                    AMQPValue::LongString(s) => s.to_string(),
                    other => format!("{other:?}"),
                },
            );
        *parked.by_reason.entry(reason).or_default() += 1;
        if let Some((seq, _)) = read_body(&delivery.data)
            && let Some(copies) = parked.copies.get_mut(seq as usize)
        {
            *copies += 1;
        }
    }
    // Closing the channel first hands back whatever was read unacknowledged.
    let _ = channel.close(200, "read".into()).await;
    let _ = conn.close(200, "read".into()).await;
    Ok(parked)
}

/// Consumes `queue` with acknowledgements and no prefetch limit: nothing read is removed
/// until acknowledged (the caller never does).
async fn consume_unacked(
    conn: &lapin::Connection,
    queue: &str,
    tag: &str,
) -> lapin::Result<(lapin::Channel, lapin::Consumer)> {
    let channel = conn.create_channel().await?;
    let consumer = channel
        .basic_consume(
            queue.into(),
            tag.into(),
            lapin::options::BasicConsumeOptions::default(),
            lapin::types::FieldTable::default(),
        )
        .await?;
    Ok((channel, consumer))
}

/// The outcome of a fault scenario, the same for each.
pub struct Tally {
    /// The scenario's name.
    pub scenario: &'static str,
    /// Messages the publisher was asked to send.
    pub count: u64,
    /// What the publisher did.
    pub sent: Sent,
    /// What reached the target.
    pub seen: Seen,
    /// What was parked.
    pub parked: Parked,
}

impl Tally {
    /// Sequence numbers neither delivered nor parked.
    pub fn missing(&self) -> u64 {
        self.seen
            .copies
            .iter()
            .zip(&self.parked.copies)
            .filter(|(delivered, parked)| **delivered == 0 && **parked == 0)
            .count() as u64
    }

    /// Lateness of first arrivals.
    pub fn lateness(&self) -> Option<Spread> {
        Spread::of(&self.seen.lateness_us)
    }

    /// The p99 lateness in µs (`i64::MAX` when nothing arrived).
    pub fn p99_us(&self) -> i64 {
        self.lateness().map_or(i64::MAX, |s| s.p99)
    }

    /// When the messages more than a second late were due and when they arrived, in
    /// seconds from the start of the run (`None` when there were none).
    pub fn late_window(&self) -> Option<String> {
        let late = &self.seen.late;
        let since = |us: u64| us.saturating_sub(self.seen.started_us) as f64 / 1e6;
        let due_first = late.iter().map(|l| l.0).min()?;
        let due_last = late.iter().map(|l| l.0).max()?;
        let arrived_first = late.iter().map(|l| l.1).min()?;
        let arrived_last = late.iter().map(|l| l.1).max()?;
        Some(format!(
            "{} messages more than 1 s late: due from {:.1} s to {:.1} s, arrived from {:.1} s to {:.1} s (from the start)",
            late.len(),
            since(due_first),
            since(due_last),
            since(arrived_first),
            since(arrived_last)
        ))
    }

    /// The target every scenario has: every message delivered or parked.
    pub fn none_missing(&self) -> Target {
        Target::new(
            "0 missing",
            format!("{} missing", self.missing()),
            self.missing() == 0,
        )
    }

    /// Prints the table, the targets and the JSON report (its last line), with the
    /// scenario's own fields.
    pub fn print(&self, lines: &[String], targets: &[Target], fault: report::FaultDone) {
        self.print_with(lines, &[], targets, fault);
    }

    /// As [`Tally::print`], with `after` printed below the tally's own lines (figures the
    /// scenario measured after the tally).
    pub fn print_with(
        &self,
        lines: &[String],
        after: &[String],
        targets: &[Target],
        fault: report::FaultDone,
    ) {
        println!("{}:", self.scenario);
        for line in lines {
            println!("  {line}");
        }
        println!(
            "  sent {} at {:.0}/s (confirmed {}, sent again {} after {} lost publisher connections), delivered {}, missing {}, duplicates {}, parked {}",
            self.count,
            self.sent.rate,
            self.sent.confirmed,
            self.sent.resent,
            self.sent.reconnects,
            self.seen.delivered(),
            self.missing(),
            self.seen.duplicates(),
            self.parked.total()
        );
        if self.seen.foreign > 0 {
            println!(
                "  {} arrivals on the target were no message of this run",
                self.seen.foreign
            );
        }
        if !self.parked.by_reason.is_empty() {
            println!("  parked by reason: {:?}", self.parked.by_reason);
        }
        if let Some(s) = self.lateness() {
            println!("  lateness (arrival - due), ms: {}", Spread::header());
            println!("                               {}", s.row());
        }
        if let Some(late) = self.late_window() {
            println!("  {late}");
        }
        for line in after {
            println!("  {line}");
        }
        print_targets(targets);
        let report = report::Report::new(
            self.scenario,
            report::Fault {
                count: self.count,
                confirmed: self.sent.confirmed,
                publish_rate: self.sent.rate.round(),
                publisher_resent: self.sent.resent,
                publisher_reconnects: self.sent.reconnects,
                delivered: self.seen.delivered(),
                missing: self.missing(),
                duplicates: self.seen.duplicates(),
                parked: self.parked.total(),
                parked_by_reason: self.parked.by_reason.clone(),
                collector_reconnects: self.seen.reconnects,
                foreign: self.seen.foreign,
                lateness: self.lateness().map(|s| s.report()),
                later_than_1s: self.seen.late.len() as u64,
                fault,
            },
        )
        .targets(target_rows(targets));
        println!("{}", report.to_line());
    }
}

/// `p99 lateness <= limit` as a target.
pub fn p99_within(tally: &Tally, limit: Duration) -> Target {
    let p99 = tally.p99_us();
    Target::new(
        format!("p99 lateness <= {}", format_duration(limit)),
        format!("{} ms", ms(p99)),
        p99 <= limit.as_micros() as i64,
    )
}
