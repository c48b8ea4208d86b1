//! Whether every bridge on the prefix reads bundles, so that this one may bundle its hops
//! (`bridge.bundle_hops`).
//!
//! A bundle comes back through the returns queue, which only versions that read bundles
//! consume; a version that does not read them consumes the work queue alone (and parks a
//! bundle it meets `bad-state`). Every instance of this version consumes both queues, so
//! while the work queue has more consumers than the returns queue an older instance runs
//! on the prefix: hops then go alone. The counts come from a passive declare of each queue
//! every [`EVERY`].
//!
//! This bridge's own returns consumer is sometimes between two consumers: cancelled to
//! change its prefetch window for the byte budget, for a moment or, paused, for as long as
//! what it holds waits for its instant. A reading taken meanwhile counts it as there (its
//! [`Handovers`] say so). Another bridge's consumer between two is not seen: its moment
//! closes the gate until the next reading. A reading that overlaps a handover of ours may
//! count our consumer twice, and so miss an older instance until the next reading.

use std::sync::Arc;
use std::time::Duration;

use lapin::{Channel, Connection};
use tokio_util::sync::CancellationToken;

use super::Shared;
use super::carrier::BundleGate;
use super::inlet::Handovers;
use crate::amqp::{QueueCounts, queue_counts};

/// How often the consumer counts are read.
pub(super) const EVERY: Duration = Duration::from_secs(2);

/// True when the consumers of the returns queue (`returns`, plus this bridge's own when it
/// was `own_returns_between` two consumers) are at least those of the work queue (`work`):
/// no instance consumes the work queue alone.
pub(crate) fn every_peer_reads_bundles(
    work: QueueCounts,
    returns: QueueCounts,
    own_returns_between: bool,
) -> bool {
    work.consumers > 0 && returns.consumers + u64::from(own_returns_between) >= work.consumers
}

/// Reads the counts once now (so that the session's first hops know), then every
/// [`EVERY`] in a task of its own until `stop` fires, keeping the carrier's `gate` up to
/// date; `own_returns` are the handovers of this session's returns consumer. A failed
/// reading closes the gate until the next one.
pub(super) async fn watch(
    shared: Arc<Shared>,
    connection: Arc<Connection>,
    gate: BundleGate,
    own_returns: Arc<Handovers>,
    stop: CancellationToken,
) {
    if !shared.config.bundle_hops {
        return;
    }
    let mut channel = None;
    check(
        &shared,
        &connection,
        &gate,
        &own_returns,
        &mut channel,
        true,
    )
    .await;
    tokio::spawn(async move {
        let mut every = tokio::time::interval_at(tokio::time::Instant::now() + EVERY, EVERY);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = every.tick() => {
                    check(&shared, &connection, &gate, &own_returns, &mut channel, false).await;
                }
                _ = stop.cancelled() => break,
            }
        }
        gate.close_quietly();
        if let Some(open) = channel {
            let _ = open.close(200, "session ended".into()).await;
        }
    });
}

/// One reading, on `channel` (opened anew when it is gone), into the `gate`, with this
/// session's returns consumer counted while `own_returns` says it is between two; a change
/// is logged (and, on the `first` reading, a closed gate).
async fn check(
    shared: &Shared,
    connection: &Connection,
    gate: &BundleGate,
    own_returns: &Handovers,
    channel: &mut Option<Channel>,
    first: bool,
) {
    if !channel.as_ref().is_some_and(|c| c.status().connected()) {
        *channel = connection.create_channel().await.ok();
    }
    let before = own_returns.reading();
    let reading = match channel {
        Some(open) => read(shared, open).await,
        None => None,
    };
    let own_between = own_returns.between_since(before);
    let allowed =
        reading.is_some_and(|(work, returns)| every_peer_reads_bundles(work, returns, own_between));
    let was = gate.set(allowed);
    match (was, allowed, reading) {
        (true, false, Some((work, returns))) | (false, false, Some((work, returns)))
            if (was || first) && work.consumers > returns.consumers + u64::from(own_between) =>
        {
            tracing::warn!(
                work_consumers = work.consumers,
                returns_consumers = returns.consumers,
                "an instance that does not read bundles consumes the work queue (an older version?): hops go alone until it is gone"
            );
        }
        (false, true, _) => {
            tracing::info!("every instance on the prefix reads bundles: hops travel in bundles");
        }
        _ => {}
    }
}

/// The work and returns queues' counts, or `None` when either could not be read.
async fn read(shared: &Shared, channel: &Channel) -> Option<(QueueCounts, QueueCounts)> {
    let names = &shared.config.names;
    let work = queue_counts(channel, &names.work_queue()).await;
    let returns = queue_counts(channel, &names.returns_queue()).await;
    match (work, returns) {
        (Ok(work), Ok(returns)) => Some((work, returns)),
        (Err(e), _) | (_, Err(e)) => {
            tracing::debug!(error = %e, "reading the consumers of the work and returns queues");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn consumers(consumers: u64) -> QueueCounts {
        QueueCounts {
            messages: 0,
            consumers,
        }
    }

    #[test]
    fn an_instance_consuming_the_work_queue_alone_stops_bundling() {
        assert!(every_peer_reads_bundles(consumers(1), consumers(1), false));
        assert!(every_peer_reads_bundles(consumers(3), consumers(3), false));
        assert!(!every_peer_reads_bundles(consumers(2), consumers(1), false));
        assert!(!every_peer_reads_bundles(consumers(0), consumers(0), false));
        // One of ours between two work consumers for a moment.
        assert!(every_peer_reads_bundles(consumers(1), consumers(2), false));
    }

    /// This bridge's own returns consumer, between two consumers, counts as there; an
    /// older instance beside it is still seen.
    #[test]
    fn our_own_returns_consumer_between_two_is_not_an_older_instance() {
        assert!(every_peer_reads_bundles(consumers(1), consumers(0), true));
        assert!(every_peer_reads_bundles(consumers(2), consumers(1), true));
        assert!(!every_peer_reads_bundles(consumers(2), consumers(0), true));
        assert!(!every_peer_reads_bundles(consumers(0), consumers(0), true));
    }

    #[test]
    fn a_handover_under_way_or_since_a_reading_is_seen() {
        let handovers = Handovers::default();
        let idle = handovers.reading();
        assert!(!handovers.between_since(idle));
        handovers.step();
        assert!(handovers.between_since(idle), "one began since");
        let during = handovers.reading();
        assert!(handovers.between_since(during), "one under way");
        handovers.step();
        let after = handovers.reading();
        assert!(!handovers.between_since(after));
        handovers.step();
        handovers.step();
        assert!(handovers.between_since(after), "one began and ended since");
    }
}
