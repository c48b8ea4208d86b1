//! A year of cancel-stream history: how long a bridge takes to be ready, and its RSS, over
//! a stream of `--entries` entries of a year-like mix, beside a start on an empty stream in
//! the same run.
//!
//! The mix, oldest first, dated over the past year: a catch-up marker every 190 entries
//! (one per 10 minutes at ten entries a second, as running bridges write them), a successor
//! tombstone every tenth entry (their occurrences long past), `--live` live cancels (half
//! without a due time spread over the year, half due in the coming day at the end), and
//! cancels whose message was due within 30 minutes of the cancel for the rest (long past
//! too). The first start reads the whole stream and then writes a checkpoint; each later
//! start (`--restarts`) reads from the newest checkpoint. With `--before EXE`, that
//! executable (an earlier release) starts on the same stream too, once. Last, with a
//! bridge running, `delay-bridge status` runs `--status-runs` times while a writer appends
//! `--status-rate` cancels a second: how long each took and what it read.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use lapin::types::ShortString;

use delay_bridge::cancel::{
    Successors, successors_properties, sync_properties, tombstone_properties,
};
use delay_bridge::clock::now_ms;
use delay_bridge::config::Config;
use delay_bridge::sandbox::process::ConfigFile;
use delay_bridge::sandbox::{Sandbox, TargetBinding};

use super::load::{self, Outgoing};
use crate::measured_bridge::MeasuredBridge;
use delay_bridge_bench::report;

const DAY_MS: u64 = 86_400_000;
const YEAR_MS: u64 = 365 * DAY_MS;

/// `bench history` options.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Entries in the cancel stream.
    #[arg(long, default_value_t = 10_000_000)]
    entries: u64,
    /// Live cancels among them.
    #[arg(long, default_value_t = 100_000)]
    live: u64,
    /// Starts after the first (each from the newest checkpoint).
    #[arg(long, default_value_t = 3)]
    restarts: u32,
    /// An earlier `delay-bridge` executable to start once on the same stream ("before").
    #[arg(long)]
    before: Option<PathBuf>,
    /// `status` runs timed while the stream is written (0: none).
    #[arg(long, default_value_t = 3)]
    status_runs: u32,
    /// Cancels appended a second while `status` runs.
    #[arg(long, default_value_t = 100)]
    status_rate: u32,
}

/// The longest a `status` run may take before the bench gives up on it.
const STATUS_WITHIN: Duration = Duration::from_secs(120);

/// One start: ready after, RSS then, entries read and live cancels.
struct Start {
    ready_s: f64,
    rss: u64,
    read: Option<u64>,
    tombstones: Option<u64>,
}

impl Start {
    fn report(&self) -> report::HistoryStart {
        report::HistoryStart {
            ready_s: self.ready_s,
            rss_bytes: self.rss,
            entries_read: self.read,
            live: self.tombstones,
        }
    }
}

/// The entry at `seq` of the mix.
fn entry(seq: u64, args: &Args, now: u64) -> Outgoing {
    let dated = now - YEAR_MS + YEAR_MS * seq / args.entries.max(1);
    let id = ShortString::from(format!("history-{seq:010}"));
    let live_due_from = args.entries.saturating_sub(args.live / 2);
    let properties = if seq.is_multiple_of(190) {
        sync_properties(id, dated, None).with_user_id(ShortString::from("guest"))
    } else if seq >= live_due_from {
        tombstone_properties(id, dated, Some(now + DAY_MS))
    } else if seq % (2 * args.entries / args.live.max(1)).max(1) == 1 {
        tombstone_properties(id, dated, None)
    } else if seq % 10 == 3 {
        successors_properties(
            id,
            &Successors {
                message_id: format!("schedule-{}", seq % 1_000),
                target: Some("orders".into()),
                entered_at: dated.saturating_sub(DAY_MS),
                after_occurrence: seq,
                born_before: dated << 20,
                due_at: dated + 60_000,
            },
        )
    } else {
        tombstone_properties(id, dated, Some(dated + 30 * 60_000))
    };
    Outgoing {
        exchange: ShortString::from(""),
        routing_key: ShortString::from(""),
        body: Vec::new(),
        properties,
    }
}

/// The value of an unlabelled metric in Prometheus text.
fn metric(text: &str, name: &str) -> Option<u64> {
    crate::bridge_metrics::value(text, name).map(|v| v as u64)
}

/// `delay-bridge status --json` runs, each timed, while a bridge runs and a writer appends
/// `args.status_rate` cancels a second to the stream.
async fn status_while_written(
    sandbox: &Sandbox,
    args: &Args,
) -> Result<Vec<report::HistoryStatus>> {
    let bridge = MeasuredBridge::start(sandbox).await?;
    let config = ConfigFile::write(&sandbox.config)?;
    let exe = crate::measured_bridge::bridge_executable()?;
    let stop = tokio_util::sync::CancellationToken::new();
    let writer = {
        let channel = load::confirm_channel(&sandbox.conn).await?;
        let stream = sandbox.config.names.cancel_stream();
        let every = Duration::from_secs(1) / args.status_rate.max(1);
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            let mut written = 0u64;
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return Ok::<u64, anyhow::Error>(written),
                    _ = tick.tick() => {}
                }
                let id = ShortString::from(format!("while-status-{written:010}"));
                channel
                    .basic_publish(
                        "".into(),
                        stream.as_str().into(),
                        lapin::options::BasicPublishOptions::default(),
                        b"",
                        tombstone_properties(id, now_ms(), None),
                    )
                    .await?
                    .await?;
                written += 1;
            }
        })
    };
    let mut runs = Vec::new();
    for _ in 0..args.status_runs {
        let (seconds, json) = timed_status(&config, &exe).await?;
        let entries = &json["cancel_entries"];
        let count = |field: &str| entries[field].as_u64().unwrap_or(0);
        runs.push(report::HistoryStatus {
            seconds,
            complete: entries["complete"].as_bool().unwrap_or(false),
            from_checkpoint: !entries["checkpoint"].is_null(),
            entries_after: count("tombstones")
                + count("successors")
                + count("markers")
                + count("clamps")
                + count("checkpoint_entries")
                + count("invalid")
                + count("unreadable"),
        });
    }
    stop.cancel();
    let written = writer.await.context("the writer task")??;
    bridge.stop().await?;
    eprintln!("  {written} cancels appended while status ran");
    Ok(runs)
}

/// Runs `delay-bridge status --json` on `config` with `exe`: how long it took (at most
/// [`STATUS_WITHIN`]) and what it printed.
pub(crate) async fn timed_status(
    config: &ConfigFile,
    exe: &std::path::Path,
) -> Result<(f64, serde_json::Value)> {
    let started = Instant::now();
    let output = tokio::time::timeout(
        STATUS_WITHIN,
        config.command(exe).args(["status", "--json"]).output(),
    )
    .await
    .with_context(|| format!("status did not return within {STATUS_WITHIN:?}"))?
    .context("running status")?;
    let seconds = started.elapsed().as_secs_f64();
    if !output.status.success() {
        bail!(
            "status failed: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    let json = serde_json::from_slice(&output.stdout).context("status --json")?;
    Ok((seconds, json))
}

async fn start(sandbox: &Sandbox, exe: Option<&PathBuf>, wait_checkpoint: bool) -> Result<Start> {
    let started = Instant::now();
    let bridge = MeasuredBridge::start_executable(sandbox, exe).await?;
    let ready_s = started.elapsed().as_secs_f64();
    let usage = bridge.usage()?;
    let metrics = bridge.metrics().await.unwrap_or_default();
    if wait_checkpoint {
        let deadline = Instant::now() + Duration::from_secs(300);
        loop {
            let text = bridge.metrics().await?;
            if metric(&text, "delay_bridge_checkpoints_total").unwrap_or(0) >= 1 {
                break;
            }
            if Instant::now() > deadline {
                bail!("no checkpoint written within 300 s");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    bridge.stop().await?;
    Ok(Start {
        ready_s,
        rss: usage.rss,
        read: metric(&metrics, "delay_bridge_cancel_catch_up_entries"),
        tombstones: metric(&metrics, "delay_bridge_tombstones"),
    })
}

pub async fn run(base: &Config, args: &Args) -> Result<()> {
    if args.live > args.entries {
        bail!("--live cannot exceed --entries");
    }
    let sandbox =
        Sandbox::declare(base, "delay-bridge-bench-history", TargetBinding::Fanout).await?;
    let empty = start(&sandbox, None, false).await?;
    let channel = load::confirm_channel(&sandbox.conn).await?;
    let stream = sandbox.config.names.cancel_stream();
    let now = now_ms();
    let published = load::publish(&channel, args.entries, None, |seq| Outgoing {
        routing_key: ShortString::from(stream.as_str()),
        ..entry(seq, args, now)
    })
    .await
    .context("appending the history")?;
    let publish_s = (published.confirmed_us - published.started_us) as f64 / 1e6;
    let first = start(&sandbox, None, true).await?;
    let mut restarts = Vec::new();
    for _ in 0..args.restarts {
        restarts.push(start(&sandbox, None, false).await?);
    }
    let before = match &args.before {
        Some(exe) => Some(start(&sandbox, Some(exe), false).await?),
        None => None,
    };
    let status = status_while_written(&sandbox, args).await;
    sandbox.finish().await?;
    let status = status?;

    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    let shown = |v: Option<u64>| v.map_or("-".to_string(), |v| v.to_string());
    println!(
        "history: {} entries of a year-like mix, {} live cancels (RabbitMQ {})",
        args.entries,
        args.live,
        base.url()
    );
    println!(
        "  appended with confirms in {publish_s:.1} s ({:.0}/s)",
        args.entries as f64 / publish_s
    );
    println!(
        "  {:<34} {:>10} {:>9} {:>12} {:>10}",
        "bridge start", "ready s", "RSS MiB", "entries read", "live"
    );
    let row = |name: &str, s: &Start| {
        println!(
            "  {name:<34} {:>10.2} {:>9.1} {:>12} {:>10}",
            s.ready_s,
            mib(s.rss),
            shown(s.read),
            shown(s.tombstones)
        )
    };
    row("empty stream (baseline)", &empty);
    if let Some(before) = &before {
        row("before (--before), whole stream", before);
    }
    row("first start: whole stream", &first);
    for (i, s) in restarts.iter().enumerate() {
        row(&format!("restart {}: from the checkpoint", i + 1), s);
    }
    if !restarts.is_empty() {
        let mut ready: Vec<f64> = restarts.iter().map(|s| s.ready_s).collect();
        let mut rss: Vec<f64> = restarts.iter().map(|s| mib(s.rss)).collect();
        ready.sort_by(f64::total_cmp);
        rss.sort_by(f64::total_cmp);
        let spread = |v: &[f64]| {
            format!(
                "{:.2} / {:.2} / {:.2}",
                v[0],
                v[v.len() / 2],
                v[v.len() - 1]
            )
        };
        println!(
            "  restarts, min / median / max: ready {} s, RSS {} MiB",
            spread(&ready),
            spread(&rss)
        );
    }
    if !status.is_empty() {
        let mut seconds: Vec<f64> = status.iter().map(|s| s.seconds).collect();
        seconds.sort_by(f64::total_cmp);
        let reads: Vec<String> = status
            .iter()
            .map(|s| {
                format!(
                    "{}{} entries{}",
                    if s.from_checkpoint {
                        "checkpoint + "
                    } else {
                        ""
                    },
                    s.entries_after,
                    if s.complete { "" } else { " (incomplete)" }
                )
            })
            .collect();
        println!(
            "  status while {} cancels a second are appended ({} runs): {:.2} / {:.2} / {:.2} s (min / median / max); read {}",
            args.status_rate,
            status.len(),
            seconds[0],
            seconds[seconds.len() / 2],
            seconds[seconds.len() - 1],
            reads.join(", ")
        );
    }
    println!(
        "{}",
        report::Report::new(
            "history",
            report::History {
                entries: args.entries,
                live: args.live,
                publish_s,
                empty: empty.report(),
                first: first.report(),
                restarts: restarts.iter().map(Start::report).collect(),
                before: before.as_ref().map(Start::report),
                status,
            },
        )
        .to_line()
    );
    Ok(())
}
