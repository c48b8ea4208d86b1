//! Reads the depths of the bridge's queues every `metrics.interval` for the pending gauges:
//! one passive declare per level queue, the work queue and the parked queue, on a channel
//! of the session's connection. Runs only when metrics are on; ends with the session.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use lapin::{Channel, Connection};
use tokio_util::sync::CancellationToken;

use super::Shared;
use crate::amqp::queue_counts;
use crate::config::defaults;
use crate::pending::Pending;

/// Reads the depths until `stop` fires. A failed reading is logged at debug and tried
/// again on a new channel at the next interval (a deleted queue closes the channel; the
/// session learns of a lost connection by itself).
pub(super) async fn run(shared: Arc<Shared>, connection: Arc<Connection>, stop: CancellationToken) {
    if !shared.instruments.enabled {
        return;
    }
    let interval = shared
        .config
        .metrics
        .map_or(defaults::METRICS_INTERVAL, |metrics| metrics.interval);
    let mut every = tokio::time::interval(interval);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut channel: Option<Channel> = None;
    loop {
        tokio::select! {
            _ = every.tick() => {}
            _ = stop.cancelled() => break,
        }
        if !channel.as_ref().is_some_and(|c| c.status().connected()) {
            channel = match connection.create_channel().await {
                Ok(opened) => Some(opened),
                Err(e) => {
                    tracing::debug!(error = %e, "opening a channel to read queue depths");
                    continue;
                }
            };
        }
        let Some(open) = &channel else { continue };
        match read(&shared, open).await {
            Ok((pending, parked)) => shared.instruments.depths(&pending, parked, &shared.config),
            Err(e) => tracing::debug!(error = %e, "reading queue depths"),
        }
    }
    if let Some(open) = channel {
        let _ = open.close(200, "session ended".into()).await;
    }
}

/// One reading: every level, the work and returns queues, the parked queue, and what is
/// held now.
async fn read(shared: &Shared, channel: &Channel) -> Result<(Pending, u64), lapin::Error> {
    let names = &shared.config.names;
    let mut levels = Vec::with_capacity(shared.config.ladder.levels().len());
    for level in shared.config.ladder.levels() {
        let counts = queue_counts(channel, &names.level_queue(*level)).await?;
        levels.push((*level, counts.messages));
    }
    // Both queues the bridge consumes: what waits to be read.
    let work_queue = queue_counts(channel, &names.work_queue()).await?.messages
        + queue_counts(channel, &names.returns_queue())
            .await?
            .messages;
    let parked = queue_counts(channel, &names.parked_queue()).await?.messages;
    let pending = Pending {
        levels,
        held: shared.stats.held.load(Ordering::Relaxed),
        work_queue,
    };
    Ok((pending, parked))
}
