//! `delay-bridge parked list|replay|purge`: the parked messages a filter selects, listed,
//! sent back through the bridge, or removed.

use std::time::Duration;

use anyhow::{Context, Result, bail};

use crate::output::{out, outln};
use delay_bridge::clock::now_ms;
use delay_bridge::config::Config;
use delay_bridge::ladder::{format_duration, parse_duration};
use delay_bridge::parked::{self, Action, Filter, Report};

/// What to do with the parked messages.
#[derive(Debug, clap::Subcommand)]
pub enum ParkedCommand {
    /// Show the selected messages: reason, target, routing key, message id, age, detail.
    /// They stay parked.
    List(Selection),
    /// Send each selected message back through the work exchange (its due time is past, so
    /// a running bridge delivers it to its target, or parks it again with today's reason),
    /// and remove it from the parked queue once the broker confirmed the copy.
    Replay(Selection),
    /// Remove the selected messages. Needs a filter, or `--all`.
    Purge {
        #[command(flatten)]
        selection: Selection,
        /// Purge every message (no filter).
        #[arg(long)]
        all: bool,
    },
}

/// Which messages, and how.
#[derive(Debug, clap::Args)]
pub struct Selection {
    /// Only messages parked for this reason (`none`: without a reason).
    #[arg(long)]
    reason: Option<String>,
    /// Only messages bound for this target exchange (the route's target).
    #[arg(long)]
    target: Option<String>,
    /// Only the message with this id.
    #[arg(long)]
    message_id: Option<String>,
    /// Only messages parked at least this long ago (90s, 2h, 1d).
    #[arg(long, value_parser = parse_duration)]
    older_than: Option<Duration>,
    /// At most this many messages.
    #[arg(long, default_value_t = 100)]
    limit: usize,
    /// Say what would be done; change nothing.
    #[arg(long)]
    dry_run: bool,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

impl Selection {
    fn filter(&self) -> Filter {
        Filter {
            reason: self.reason.clone(),
            target: self.target.clone(),
            message_id: self.message_id.clone(),
            older_than: self.older_than,
        }
    }
}

/// Runs one `parked` command against `config`'s parked queue.
pub async fn run(config: &Config, command: &ParkedCommand) -> Result<()> {
    let (action, selection) = match command {
        ParkedCommand::List(selection) => (Action::List, selection),
        ParkedCommand::Replay(selection) => (Action::Replay, selection),
        ParkedCommand::Purge { selection, all } => {
            if selection.filter().is_empty() && !all {
                bail!(
                    "purge needs a filter (--reason, --target, --message-id, --older-than) or --all"
                );
            }
            (Action::Purge, selection)
        }
    };
    let report = parked::act_at(
        config,
        action,
        &selection.filter(),
        selection.limit,
        selection.dry_run,
    )
    .await
    .context("working on the parked queue")?;
    if selection.json {
        outln!("{}", serde_json::to_string_pretty(&report)?)?;
    } else {
        out!("{}", table(&report, now_ms()))?;
    }
    let failed = report.selected.iter().filter(|o| o.note.is_some()).count();
    if failed > 0 && !report.dry_run {
        bail!("{failed} selected message(s) stayed parked (see the notes above)");
    }
    Ok(())
}

/// One line per selected message, then what was done.
fn table(report: &Report, now_ms: u64) -> String {
    let mut out = format!(
        "{:<18} {:<20} {:<24} {:<38} {:>9}  detail\n",
        "reason", "target", "routing key", "message id", "age"
    );
    for outcome in &report.selected {
        let m = &outcome.message;
        let age = m.parked_at.map_or("-".to_string(), |at| {
            format_duration(Duration::from_millis(
                now_ms.saturating_sub(at) / 1000 * 1000,
            ))
        });
        out.push_str(&format!(
            "{:<18} {:<20} {:<24} {:<38} {:>9}  {}\n",
            m.reason.as_deref().unwrap_or("none"),
            m.target.as_deref().unwrap_or("-"),
            m.routing_key,
            m.message_id.as_deref().unwrap_or("-"),
            age,
            m.detail.as_deref().unwrap_or("")
        ));
        if let Some(note) = &outcome.note {
            out.push_str(&format!("  ^ {note}\n"));
        }
    }
    let verb = match report.action {
        Action::List => "listed",
        Action::Replay => "replayed",
        Action::Purge => "purged",
    };
    let done = match (report.action, report.dry_run) {
        (Action::List, _) => report.selected.len(),
        (_, true) => 0,
        _ => report.done(),
    };
    out.push_str(&format!(
        "{} selected of {} read ({} parked); {done} {verb}{}\n",
        report.selected.len(),
        report.scanned,
        report.held,
        if report.dry_run {
            " (dry run: nothing changed)"
        } else {
            ""
        }
    ));
    out
}
