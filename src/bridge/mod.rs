//! The bridge runtime: connect, declare, consume the work queue, hop/hold/deliver/park, and
//! reconnect with backoff when the broker goes away. Runs until its shutdown token fires.

pub(crate) mod acks;
mod budget;
mod cancels;
mod carrier;
mod level_watch;
mod reconnect;
mod redeliveries;
mod refusals;
mod session;
mod stuck;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use thiserror::Error;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::amqp::{self, ConnectError};
use crate::cancel::TombstoneSet;
use crate::config::Config;
use crate::topology::{Topology, TopologyError};

/// Why the bridge stopped (or one session of it ended).
#[derive(Debug, Error)]
pub enum BridgeError {
    /// Connecting failed.
    #[error(transparent)]
    Connect(#[from] ConnectError),
    /// Declaring the topology failed.
    #[error(transparent)]
    Topology(#[from] TopologyError),
    /// A broker operation failed mid-session (connection or channel lost).
    #[error("{what}: {source}")]
    Broker {
        /// What the bridge was doing.
        what: &'static str,
        /// The client error.
        source: lapin::Error,
    },
    /// A publish on the bridge's own channel got no answer (channel lost, or no confirm
    /// within `bridge.confirm_timeout`).
    #[error("{what}: {source}")]
    Publish {
        /// What the bridge was doing.
        what: &'static str,
        /// Why the publish has no answer.
        source: crate::amqp::publisher::PublishError,
    },
    /// A publish into the bridge's own topology came back unrouted (a level or the parked
    /// queue was deleted under the bridge); the session restarts and redeclares.
    #[error("{0}")]
    OwnQueueMissing(String),
    /// The consumer was cancelled or its stream ended.
    #[error("the work-queue consumer ended: {0}")]
    ConsumerEnded(String),
}

impl BridgeError {
    /// True when reconnecting cannot help and the bridge should stop.
    pub fn is_permanent(&self) -> bool {
        match self {
            BridgeError::Topology(e) => e.is_permanent(),
            BridgeError::Connect(e) => matches!(amqp::reply_code(&e.source), Some(403 | 530)),
            _ => false,
        }
    }

    fn broker(what: &'static str) -> impl FnOnce(lapin::Error) -> BridgeError {
        move |source| BridgeError::Broker { what, source }
    }

    fn publish(
        what: &'static str,
    ) -> impl FnOnce(crate::amqp::publisher::PublishError) -> BridgeError {
        move |source| BridgeError::Publish { what, source }
    }
}

/// Declares [`Stats`] (the live counters, shared with the bridge's tasks) and [`Counts`] (a
/// reading of them) from one list, so the two cannot drift apart.
macro_rules! counters {
    ($($(#[$doc:meta])* $name:ident,)*) => {
        /// Counters of what the bridge did, updated as it works; read them with
        /// [`Stats::snapshot`].
        #[derive(Debug, Default)]
        pub struct Stats {
            $($(#[$doc])* pub(crate) $name: AtomicU64,)*
        }

        /// What the bridge had done when [`Stats::snapshot`] was called.
        #[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
        pub struct Counts {
            $($(#[$doc])* pub $name: u64,)*
        }

        impl Stats {
            /// Every counter now (each read on its own, not as one atomic reading).
            pub fn snapshot(&self) -> Counts {
                Counts {
                    $($name: self.$name.load(Ordering::Relaxed),)*
                }
            }
        }
    };
}

counters! {
    /// Deliveries consumed from the work queue.
    consumed,
    /// Hops published into level queues (confirmed).
    hops,
    /// Messages published to their target (confirmed).
    delivered,
    /// Messages parked (confirmed).
    parked,
    /// Messages waiting on a hold timer now.
    held,
    /// Deliveries given back to the broker unprocessed (shutdown or a failed session).
    released,
    /// Publishes the broker refused (nack) and that were retried.
    nacks,
    /// Sessions that ended with an error and were reconnected.
    reconnects,
    /// Copies dropped because their message was cancelled.
    cancelled,
    /// Live tombstones in memory now.
    tombstones,
    /// Times the consumer was paused because unacked bodies went over
    /// `bridge.max_unacked_bytes` (its prefetch window narrowed).
    pauses,
    /// The most body bytes of unacked deliveries held at once so far.
    max_unacked_bytes_seen,
    /// The bridge's queues holding expired messages their dead-letter worker has not
    /// forwarded for `management.stuck_after` now (read from the management API).
    stuck_queues,
    /// Expired messages not yet forwarded by the dead-letter workers of the bridge's
    /// queues, at the last reading of the management API.
    expired_unforwarded,
}

/// What every session and message task shares.
struct Shared {
    config: Config,
    topology: Topology,
    bridge_user: String,
    /// `config.names.work_exchange()`, built once: every delivery is checked against it.
    work_exchange: String,
    stats: Arc<Stats>,
    /// The live cancellations, shared by the stream follower and the message tasks.
    tombstones: Mutex<TombstoneSet>,
    /// Where the cancel-stream follower resumes after a reconnect (`None`: from the start).
    stream_next_offset: Mutex<Option<u64>>,
    /// How often this process saw each unsettled message redelivered (classic queues keep
    /// no count).
    redeliveries: Mutex<redeliveries::RedeliveryCounts>,
}

/// A bridge, ready to run.
pub struct Bridge {
    shared: Arc<Shared>,
    ready_tx: watch::Sender<bool>,
}

impl Bridge {
    /// A bridge for this configuration.
    pub fn new(config: Config) -> Self {
        let topology = Topology::from_config(&config);
        let bridge_user = config.url().user();
        let work_exchange = config.names.work_exchange();
        let tombstones = TombstoneSet::new(
            config.tombstone_keep().as_millis() as u64,
            config.cancel_grace.as_millis() as u64,
        );
        Self {
            shared: Arc::new(Shared {
                config,
                topology,
                bridge_user,
                work_exchange,
                stats: Arc::new(Stats::default()),
                tombstones: Mutex::new(tombstones),
                stream_next_offset: Mutex::new(None),
                redeliveries: Mutex::new(redeliveries::RedeliveryCounts::default()),
            }),
            ready_tx: watch::channel(false).0,
        }
    }

    /// Its counters.
    pub fn stats(&self) -> Arc<Stats> {
        self.shared.stats.clone()
    }

    /// Becomes `true` once the topology is declared, the cancel stream is read up to date
    /// and the work queue is consumed, and `false` while reconnecting.
    pub fn ready(&self) -> watch::Receiver<bool> {
        self.ready_tx.subscribe()
    }

    /// Runs until `shutdown` fires (then drains and returns `Ok`), or until an error that
    /// reconnecting cannot fix. Connection loss is logged once and retried with backoff.
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), BridgeError> {
        let config = &self.shared.config;
        let brokers: Vec<String> = config.urls.iter().map(|u| u.to_string()).collect();
        tracing::info!(
            brokers = %brokers.join(" "),
            prefix = config.names.prefix(),
            levels = config.ladder.levels().len(),
            queue_type = %config.queue_type,
            "delay-bridge starting"
        );
        let watching = CancellationToken::new();
        let _stop_watching = watching.clone().drop_guard();
        if let Some(management) = &config.management {
            tokio::spawn(level_watch::run(
                management.clone(),
                config.url().clone(),
                config.names.prefix().to_string(),
                self.shared.stats.clone(),
                watching,
            ));
        }
        let mut reconnects = reconnect::Reconnects::default();
        let mut failing = false;
        // Which broker to try: on every loss or refusal, the next one (a cluster's nodes).
        let mut broker = 0;
        loop {
            if shutdown.is_cancelled() {
                return Ok(());
            }
            match self.session(&shutdown, &config.urls[broker]).await {
                Ok(()) => return Ok(()),
                Err(e) if e.is_permanent() => {
                    tracing::error!("{e}");
                    return Err(e);
                }
                Err(e) => {
                    // A session that got as far as consuming worked: its loss is news.
                    let worked = self.ready_tx.send_replace(false);
                    if worked {
                        failing = false;
                    }
                    if failing {
                        tracing::debug!("still failing: {e}");
                    } else {
                        tracing::warn!(
                            "broker connection lost or refused: {e}; reconnecting with backoff"
                        );
                        failing = true;
                    }
                    self.shared.stats.reconnects.fetch_add(1, Ordering::Relaxed);
                    broker = (broker + 1) % config.urls.len();
                    tokio::select! {
                        _ = tokio::time::sleep(reconnects.pause_after_loss(worked)) => {}
                        _ = shutdown.cancelled() => return Ok(()),
                    }
                }
            }
        }
    }

    async fn session(
        &self,
        shutdown: &CancellationToken,
        url: &crate::config::BrokerUrl,
    ) -> Result<(), BridgeError> {
        let config = &self.shared.config;
        let connection =
            Arc::new(amqp::connect(url, &format!("delay-bridge {}", config.names.prefix())).await?);
        let alarms = CancellationToken::new();
        let _stop_alarm_log = alarms.clone().drop_guard();
        let events = connection.events_listener();
        tokio::spawn(async move {
            tokio::select! {
                _ = log_alarms(events) => {}
                _ = alarms.cancelled() => {}
            }
        });
        self.shared.topology.declare(&connection).await?;
        let result = session::run(
            self.shared.clone(),
            connection.clone(),
            shutdown,
            &self.ready_tx,
        )
        .await;
        // A broker under a resource alarm reads nothing, not even a close.
        if !connection.status().blocked() {
            let _ = tokio::time::timeout(
                CLOSE_TIMEOUT,
                connection.close(200, "delay-bridge stopping".into()),
            )
            .await;
        }
        result
    }
}

/// How long closing a channel or the connection may take before the bridge goes on without
/// the broker's answer.
pub(crate) const CLOSE_TIMEOUT: Duration = Duration::from_secs(2);

/// Logs the broker's flow control: `connection.blocked` (a memory or disk alarm) once at
/// warn with its reason, and the unblock at info. Publishes wait meanwhile (their confirm
/// deadline does not run); nothing is given up.
async fn log_alarms(events: impl futures::Stream<Item = lapin::Event>) {
    use futures::StreamExt;
    futures::pin_mut!(events);
    while let Some(event) = events.next().await {
        match event {
            lapin::Event::ConnectionBlocked(reason) => tracing::warn!(
                %reason,
                "the broker blocked publishing (resource alarm); deliveries wait until it unblocks"
            ),
            lapin::Event::ConnectionUnblocked => {
                tracing::info!("the broker unblocked publishing; deliveries resume")
            }
            _ => {}
        }
    }
}

/// Pauses between attempts: from `min`, doubling up to `max`, with jitter, without end.
pub(crate) fn backoff(min: Duration, max: Duration) -> impl Iterator<Item = Duration> {
    use backon::BackoffBuilder;
    backon::ExponentialBuilder::new()
        .with_min_delay(min)
        .with_max_delay(max)
        .with_jitter()
        .without_max_times()
        .build()
}
