//! Queue counts by passive declare: how many messages wait where, who consumes.

use std::time::Duration;

use lapin::Connection;

use super::{Sandbox, SandboxError};
pub use crate::amqp::QueueCounts;
use crate::amqp::queue_counts as counts_on_channel;

/// Counts of an existing queue (an error if it does not exist).
pub async fn queue_counts(conn: &Connection, queue: &str) -> Result<QueueCounts, SandboxError> {
    let channel = conn
        .create_channel()
        .await
        .map_err(SandboxError::broker("opening a channel"))?;
    let counts = counts_on(&channel, queue).await;
    let _ = channel.close(200, "counted".into()).await;
    counts
}

/// Counts of an existing queue on `channel` (which a missing queue closes).
async fn counts_on(channel: &lapin::Channel, queue: &str) -> Result<QueueCounts, SandboxError> {
    counts_on_channel(channel, queue)
        .await
        .map_err(SandboxError::broker(format!("counting {queue}")))
}

impl Sandbox {
    /// Counts of one queue now.
    pub async fn counts(&self, queue: &str) -> Result<QueueCounts, SandboxError> {
        queue_counts(&self.conn, queue).await
    }

    /// The queue names of the bridge's delay levels.
    pub fn level_queues(&self) -> Vec<String> {
        self.config
            .ladder
            .levels()
            .iter()
            .map(|level| self.config.names.level_queue(*level))
            .collect()
    }

    /// Ready messages in all level queues together.
    pub async fn pending_in_levels(&self) -> Result<u64, SandboxError> {
        self.ready_in(&self.level_queues()).await
    }

    /// Ready messages in these queues together (one channel, one passive declare each).
    pub async fn ready_in(&self, queues: &[String]) -> Result<u64, SandboxError> {
        let ready = self.ready_by_queue(queues.iter()).await?;
        Ok(ready.iter().map(|(_, messages)| messages).sum())
    }

    /// Ready messages in each of `queues`, in their order (one channel, one passive
    /// declare each).
    async fn ready_by_queue<'q>(
        &self,
        queues: impl Iterator<Item = &'q String>,
    ) -> Result<Vec<(String, u64)>, SandboxError> {
        let channel = self.channel().await?;
        let mut ready = Vec::new();
        for queue in queues {
            ready.push((queue.clone(), counts_on(&channel, queue).await?.messages));
        }
        let _ = channel.close(200, "counted".into()).await;
        Ok(ready)
    }

    /// Ready messages in every queue the sandbox declared or adopted (the bridge's work,
    /// parked, returns and level queues, the target queue and the extra ones), the cancel
    /// stream aside; only those that hold any, in declaration order. Read after the bridge
    /// stopped, it says where messages that never arrived still wait.
    pub async fn messages_left(&self) -> Result<Vec<(String, u64)>, SandboxError> {
        let topology = crate::topology::Topology::from_config(&self.config);
        let extra = self.queues();
        let bridge_queues = topology.queues.iter().map(|q| &q.name);
        let mut left = self.ready_by_queue(bridge_queues.chain(&extra)).await?;
        left.retain(|(_, messages)| *messages > 0);
        Ok(left)
    }

    /// Waits until the work queue has at least `n` consumers (bridges in process or in
    /// child processes), checking every 20 ms.
    pub async fn wait_for_consumers(&self, n: u64, within: Duration) -> Result<(), SandboxError> {
        let work_queue = self.config.names.work_queue();
        let deadline = tokio::time::Instant::now() + within;
        while self.counts(&work_queue).await?.consumers < n {
            if tokio::time::Instant::now() > deadline {
                return Err(SandboxError::ProcessState(format!(
                    "{work_queue} did not have {n} consumers within {within:?}"
                )));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    }
}
