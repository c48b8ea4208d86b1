//! What only the benchmarks need of a sandbox: queue counts, and the bridge as a
//! `delay-bridge run` child process.

use anyhow::{Context, Result};
use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use lapin::{Channel, Connection};

use super::process::BridgeProcess;
use super::{Running, Sandbox};

/// A queue's ready messages and consumers, from a passive declare.
#[derive(Debug, Clone, Copy)]
pub struct QueueCounts {
    /// Messages ready for delivery (not counting unacknowledged ones).
    pub messages: u64,
    /// Consumers attached.
    pub consumers: u64,
}

/// Counts of an existing queue (an error if it does not exist).
pub async fn queue_counts(conn: &Connection, queue: &str) -> Result<QueueCounts> {
    let channel = conn.create_channel().await?;
    let counts = counts_on(&channel, queue).await;
    let _ = channel.close(200, "counted".into()).await;
    counts
}

/// Counts of an existing queue by a passive declare on `channel` (which a missing queue
/// closes).
async fn counts_on(channel: &Channel, queue: &str) -> Result<QueueCounts> {
    let declared = channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .with_context(|| format!("queue {queue}"))?;
    Ok(QueueCounts {
        messages: u64::from(declared.message_count()),
        consumers: u64::from(declared.consumer_count()),
    })
}

impl Sandbox {
    /// Starts the bridge as a `delay-bridge run` child process and waits until it is ready.
    pub async fn run_process(&mut self) -> Result<()> {
        self.ensure_not_started()?;
        self.running = Running::Process(BridgeProcess::start(&self.config, &self.conn).await?);
        Ok(())
    }

    /// The bridge's child process, when it runs in one.
    pub fn process(&self) -> Option<&BridgeProcess> {
        match &self.running {
            Running::Process(process) => Some(process),
            _ => None,
        }
    }

    /// The queue names of the bridge's delay levels.
    pub fn level_queues(&self) -> Vec<String> {
        self.config
            .ladder
            .levels()
            .iter()
            .map(|l| self.config.names.level_queue(*l))
            .collect()
    }

    /// Ready messages in all level queues together.
    pub async fn pending_in_levels(&self) -> Result<u64> {
        self.ready_in(&self.level_queues()).await
    }

    /// Ready messages in these queues together (one channel, one passive declare each).
    pub async fn ready_in(&self, queues: &[String]) -> Result<u64> {
        let channel = self.conn.create_channel().await?;
        let mut total = 0;
        for queue in queues {
            total += counts_on(&channel, queue).await?.messages;
        }
        let _ = channel.close(200, "counted".into()).await;
        Ok(total)
    }
}
