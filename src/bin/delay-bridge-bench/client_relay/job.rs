//! What a relay child process is asked to do, and how it measures its own CPU time.

use std::time::Duration;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

/// The AMQP client a relay runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Client {
    /// lapin, the bridge's client: its I/O loop runs on a thread of its own.
    Lapin,
    /// amqprs: its reader and writer are tasks on the caller's tokio runtime.
    Amqprs,
    /// The library's bare connection (amq-protocol frames on the caller's runtime), one
    /// task for the whole relay: what a client of our own would cost.
    Bare,
    /// The library's own connection (`amqp::wire`), shaped as the lapin relay: a consumer,
    /// a confirm-mode channel, a task per message waiting for its confirm.
    Wire,
}

impl Client {
    /// Every client, in the order the scenario runs them.
    pub const ALL: [Client; 4] = [Client::Lapin, Client::Amqprs, Client::Bare, Client::Wire];

    /// Its name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Client::Lapin => "lapin",
            Client::Amqprs => "amqprs",
            Client::Bare => "bare",
            Client::Wire => "wire",
        }
    }
}

/// `delay-bridge-bench relay-child` options: one relay, as the parent scenario starts it.
#[derive(Debug, Clone, clap::Args)]
pub struct ChildArgs {
    /// The client to relay with.
    #[arg(long, value_enum)]
    pub client: Client,
    /// The queue consumed.
    #[arg(long)]
    pub from: String,
    /// The queue every delivery is published to (through the default exchange).
    #[arg(long)]
    pub to: String,
    /// Deliveries to relay before the child reports and exits.
    #[arg(long)]
    pub count: u64,
    /// Unacknowledged deliveries at most (the bridge's `prefetch`).
    #[arg(long)]
    pub prefetch: u16,
}

/// What the child reports on its last line of output.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct ChildReport {
    /// Deliveries relayed: published, confirmed and then acknowledged.
    pub relayed: u64,
    /// The child's CPU time from its first delivery to its last ack, µs.
    pub cpu_us: u64,
    /// Context switches of all its threads over the same span.
    pub context_switches: u64,
}

/// The child's own CPU time (`process_usage`) and its threads' context switches, read from
/// `/proc/self/task`.
#[derive(Debug, Clone, Copy)]
pub struct SelfUsage {
    cpu: Duration,
    context_switches: u64,
}

impl SelfUsage {
    /// Reads them now.
    pub fn now() -> Result<Self> {
        let cpu = crate::process_usage::read(std::process::id() as i32)?.cpu;
        let me = procfs::process::Process::myself().context("reading /proc/self")?;
        let mut context_switches = 0;
        for task in me.tasks().context("listing /proc/self/task")?.flatten() {
            if let Ok(status) = task.status() {
                context_switches += status.voluntary_ctxt_switches.unwrap_or(0)
                    + status.nonvoluntary_ctxt_switches.unwrap_or(0);
            }
        }
        Ok(Self {
            cpu,
            context_switches,
        })
    }

    /// The report of `relayed` deliveries from this reading to `end`.
    pub fn until(&self, end: &SelfUsage, relayed: u64) -> ChildReport {
        ChildReport {
            relayed,
            cpu_us: end.cpu.saturating_sub(self.cpu).as_micros() as u64,
            context_switches: end.context_switches.saturating_sub(self.context_switches),
        }
    }
}
