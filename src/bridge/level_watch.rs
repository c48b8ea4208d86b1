//! Reads the bridge's queues from the management API every `management.interval` and warns
//! about a level whose expired messages are not forwarded (see `bridge::stuck`), with the
//! remedy, in the log and in [`Stats`](super::Stats).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use tokio_util::sync::CancellationToken;

use super::Stats;
use super::stuck::{Change, StuckWatch};
use crate::config::{BrokerUrl, ManagementConfig};
use crate::ladder::format_duration;
use crate::management::Management;

/// Watches until `stop` fires.
pub(super) async fn run(
    config: ManagementConfig,
    broker: BrokerUrl,
    prefix: String,
    stats: Arc<Stats>,
    stop: CancellationToken,
) {
    let api = Management::new(&config.urls, &broker, config.interval.max(REQUEST_TIMEOUT));
    let mut watch = StuckWatch::new(config.stuck_after);
    let mut failing = false;
    let mut ticks = tokio::time::interval(config.interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = ticks.tick() => {}
            _ = stop.cancelled() => return,
        }
        let queues = match api.queues(&prefix).await {
            Ok(queues) => {
                if failing {
                    tracing::info!("the management API answers again");
                    failing = false;
                }
                queues
            }
            Err(e) => {
                if !failing {
                    tracing::warn!("cannot read the queues' figures: {e}; trying again");
                    failing = true;
                }
                continue;
            }
        };
        let reading: Vec<(String, u64)> = queues
            .into_iter()
            .map(|q| (q.name, q.messages_dlx))
            .collect();
        let unforwarded: u64 = reading.iter().map(|(_, n)| n).sum();
        stats
            .expired_unforwarded
            .store(unforwarded, Ordering::Relaxed);
        for change in watch.observe(&reading, Instant::now()) {
            match change {
                Change::Stuck {
                    queue,
                    messages,
                    stuck_for,
                } => tracing::warn!(
                    queue,
                    messages,
                    "{queue} has held {messages} expired messages that its dead-letter worker has not forwarded for {}: they are late. {REMEDY}",
                    format_duration(stuck_for)
                ),
                Change::Recovered { queue } => {
                    tracing::info!(queue, "{queue} forwards its expired messages again")
                }
            }
        }
        stats
            .stuck_queues
            .store(watch.stuck() as u64, Ordering::Relaxed);
    }
}

/// The longest a reading may take, at the least.
const REQUEST_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// What an operator can do about a stuck level.
const REMEDY: &str = "The broker retries a dead-letter publish it has no confirm for only after \
    `dead_letter_worker_publisher_confirm_timeout` (180 s by default; set it to 2000 in \
    advanced.config, README, \"Clusters and quorum mode\"). Check that the work exchange exists. After a \
    node loss, RabbitMQ 3.10 can hold them until the lost node is back: bring it back (4.x \
    forwards them at that retry).";
