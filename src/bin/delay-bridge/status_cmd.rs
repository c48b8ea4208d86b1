//! `delay-bridge status`: what the bridge's topology holds now, as a table or as JSON.

use anyhow::{Context, Result};

use crate::output::{out, outln};
use delay_bridge::config::Config;
use delay_bridge::status::{self, QueueStatus, Status};

/// The options of `status`.
#[derive(Debug, clap::Args)]
pub struct StatusArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Show every level, empty ones too.
    #[arg(long)]
    all_levels: bool,
    /// Read at most this many parked messages for their reasons (they stay parked).
    #[arg(long, default_value_t = 1000)]
    parked_limit: u16,
}

/// Reads and prints the status of `config`'s topology.
pub async fn status(config: &Config, args: &StatusArgs) -> Result<()> {
    let connection = delay_bridge::amqp::connect(config.url(), "delay-bridge status").await?;
    let read = status::read(config, &connection, args.parked_limit).await;
    let _ = connection.close(200, "status read".into()).await;
    let status = read.context("reading the status")?;
    if args.json {
        outln!("{}", serde_json::to_string_pretty(&status)?)?;
    } else {
        out!("{}", table(&status, args.all_levels))?;
    }
    Ok(())
}

/// The status as a table: one row per queue, then the parked reasons.
fn table(status: &Status, all_levels: bool) -> String {
    let mut rows: Vec<(String, &QueueStatus)> = vec![
        ("work".into(), &status.work),
        ("returns".into(), &status.returns),
    ];
    rows.extend(
        status
            .levels
            .iter()
            .filter(|l| all_levels || l.queue.messages > 0)
            .map(|l| (format!("level {}", l.level), &l.queue)),
    );
    rows.push(("parked".into(), &status.parked.queue));
    rows.push(("cancel stream".into(), &status.cancel_stream));
    let mut out = format!(
        "prefix {} ({} queues), figures from {}\n",
        status.prefix, status.queue_type, status.source
    );
    out.push_str(&format!(
        "{:<14} {:<40} {:>10} {:>12} {:>9}\n",
        "", "queue", "messages", "bytes", "consumers"
    ));
    for (what, queue) in rows {
        let bytes = queue.bytes.map_or("-".to_string(), |b| b.to_string());
        out.push_str(&format!(
            "{:<14} {:<40} {:>10} {:>12} {:>9}\n",
            what, queue.name, queue.messages, bytes, queue.consumers
        ));
    }
    let empty = status
        .levels
        .iter()
        .filter(|l| l.queue.messages == 0)
        .count();
    out.push_str(&format!(
        "pending in levels: {} ({} of {} levels empty{})\n",
        status.pending_in_levels,
        empty,
        status.levels.len(),
        if all_levels { "" } else { ", not shown" }
    ));
    let entries = &status.cancel_entries;
    let from = match &entries.checkpoint {
        Some(c) => format!(
            "checkpoint at offset {} ({} live cancels{}{}{}), then ",
            c.offset,
            c.cancels,
            if c.replacements > 0 {
                format!(", {} schedule replacements", c.replacements)
            } else {
                String::new()
            },
            if c.successors > 0 {
                format!(", {} successor tombstones", c.successors)
            } else {
                String::new()
            },
            if c.held > 0 {
                format!(", {} cancels dated ahead", c.held)
            } else {
                String::new()
            },
        ),
        None => String::new(),
    };
    out.push_str(&format!(
        "cancel stream: {from}{} tombstones, {} catch-up markers{}{}{}{}{}{}\n",
        entries.tombstones,
        entries.markers,
        if entries.successors > 0 {
            format!(
                ", {} successor tombstones (one per redelivered occurrence of a recurring schedule)",
                entries.successors
            )
        } else {
            String::new()
        },
        if entries.clamps > 0 {
            format!(", {} clamps of cancels dated ahead", entries.clamps)
        } else {
            String::new()
        },
        if entries.checkpoint_entries > 0 {
            format!(", {} checkpoint entries", entries.checkpoint_entries)
        } else {
            String::new()
        },
        if entries.unreadable > 0 {
            format!(", {} unreadable", entries.unreadable)
        } else {
            String::new()
        },
        if entries.invalid > 0 {
            format!(", {} invalid entries", entries.invalid)
        } else {
            String::new()
        },
        if entries.complete {
            ""
        } else {
            " (not every entry read)"
        }
    ));
    let parked = &status.parked;
    if let Some(why) = &parked.not_read {
        out.push_str(&format!("parked by reason: {why}\n"));
    } else if parked.read > 0 {
        out.push_str(&format!(
            "parked by reason ({} of {} read; they stay parked):\n",
            parked.read, parked.queue.messages
        ));
        for (reason, count) in &parked.by_reason {
            out.push_str(&format!("  {reason:<20} {count:>8}\n"));
        }
    }
    out
}
