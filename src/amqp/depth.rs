//! A queue's depth by passive declare: cheap, allowed to any user who may read the queue,
//! and answered by the node that leads it.

use lapin::Channel;
use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;

/// A queue's ready messages and consumers, from a passive declare.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueCounts {
    /// Messages ready for delivery (not counting unacknowledged ones, nor, in a quorum
    /// queue, expired ones its dead-letter worker has not forwarded yet).
    pub messages: u64,
    /// Consumers attached.
    pub consumers: u64,
}

/// Counts of an existing queue by a passive declare on `channel`. A missing queue is an
/// error that closes the channel (404).
pub async fn queue_counts(channel: &Channel, queue: &str) -> Result<QueueCounts, lapin::Error> {
    let declared = channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
    Ok(QueueCounts {
        messages: u64::from(declared.message_count()),
        consumers: u64::from(declared.consumer_count()),
    })
}
