//! The bridge runtime: connect, declare, consume the work queue, hop/hold/deliver/park, and
//! reconnect with backoff when the broker goes away. Runs until its shutdown token fires.

pub(crate) mod acks;
mod appender;
mod budget;
mod cancels;
mod carrier;
mod checkpoints;
mod depths;
mod error;
mod inlet;
pub mod instruments;
mod level_watch;
mod peers;
mod reconnect;
mod redeliveries;
mod refusals;
mod session;
mod stats;
mod stuck;
mod turns;

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::amqp;
use crate::cancel::TombstoneSet;
use crate::config::Config;
use crate::topology::Topology;

pub use error::BridgeError;
pub use stats::{Counts, Stats};

/// What every session and message task shares.
struct Shared {
    config: Config,
    topology: Topology,
    bridge_user: String,
    /// How the cancel stream's readers tell a bridge's entries, and how this one marks its
    /// own (the trust table: [`crate::cancel::trust`]).
    authority: crate::cancel::Authority,
    /// `config.names.work_exchange()`, built once: every delivery is checked against it.
    work_exchange: String,
    stats: Arc<Stats>,
    /// What the bridge records besides `stats` (nothing without a metrics recorder).
    instruments: instruments::Instruments,
    /// The live cancellations, shared by the stream follower and the message tasks.
    tombstones: Mutex<TombstoneSet>,
    /// Where the cancel-stream follower resumes after a reconnect (`None`: from the start).
    stream_next_offset: Mutex<Option<u64>>,
    /// The cancels dated ahead of the clock the follower holds until their clamp is read
    /// (kept across sessions, like the offset it resumes from).
    future_cancels: Mutex<crate::cancel::FutureCancels>,
    /// What the follower knows of the cancel stream's checkpoints (kept across sessions).
    checkpoints: Mutex<crate::cancel::Checkpoints>,
    /// How much longer than the least this bridge lets the stream grow past the newest
    /// checkpoint before it writes one (0 to 0.25, drawn once: bridges on one prefix seldom
    /// write at the same moment).
    checkpoint_slack: f64,
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
    /// A bridge for this configuration, recording no metrics beyond [`Stats`].
    pub fn new(config: Config) -> Self {
        let instruments = instruments::Instruments::disabled(&config);
        Self::with_instruments(config, instruments)
    }

    /// A bridge for this configuration that registers its metrics in `recorder` (parked by
    /// reason, lateness and hops at delivery, queue depths read every `metrics.interval`).
    /// [`Stats`] go to the same recorder with [`Counts::export`].
    pub fn with_metrics(config: Config, recorder: &dyn metrics::Recorder) -> Self {
        let instruments = instruments::Instruments::register(recorder, &config);
        Self::with_instruments(config, instruments)
    }

    fn with_instruments(config: Config, instruments: instruments::Instruments) -> Self {
        let topology = Topology::from_config(&config);
        let bridge_user = config.url().user();
        let authority = crate::cancel::Authority::of(&config);
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
                authority,
                work_exchange,
                stats: Arc::new(Stats::default()),
                instruments,
                tombstones: Mutex::new(tombstones),
                stream_next_offset: Mutex::new(None),
                future_cancels: Mutex::default(),
                checkpoints: Mutex::default(),
                checkpoint_slack: rand::random::<f64>() * 0.25,
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
        let prefix = config.names.prefix();
        let connection = Arc::new(amqp::connect(url, &format!("delay-bridge {prefix}")).await?);
        self.shared.topology.declare(&connection).await?;
        let consuming = amqp::connect_wire(url, &format!("delay-bridge {prefix} consumer")).await?;
        if let Some(warning) = consuming
            .broker_version()
            .and_then(|version| amqp::broker_version::warning(version, config.queue_type))
        {
            tracing::warn!("{warning}");
        }
        let publishing =
            amqp::connect_wire(url, &format!("delay-bridge {prefix} publisher")).await?;
        let alarms = tokio::spawn(log_alarms(publishing.blocked()));
        let result = session::run(
            self.shared.clone(),
            connection.clone(),
            session::Wires {
                url,
                consuming: &consuming,
                publishing: &publishing,
            },
            shutdown,
            &self.ready_tx,
        )
        .await;
        alarms.abort();
        let _ = tokio::time::timeout(CLOSE_TIMEOUT, consuming.close()).await;
        // A broker under a resource alarm reads nothing from a connection that publishes,
        // not even a close: that one is dropped.
        if publishing.blocked().borrow().is_none() {
            let _ = tokio::time::timeout(CLOSE_TIMEOUT, publishing.close()).await;
        }
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

/// Logs the broker's flow control on the publishing connection: `connection.blocked` (a
/// memory or disk alarm) once at warn with its reason, and the unblock at info. Publishes
/// wait meanwhile (their confirm deadline does not run); nothing is given up.
async fn log_alarms(mut blocked: tokio::sync::watch::Receiver<Option<String>>) {
    let mut was_blocked = false;
    while blocked.changed().await.is_ok() {
        let reason = blocked.borrow_and_update().clone();
        match reason {
            Some(reason) if !was_blocked => {
                was_blocked = true;
                tracing::warn!(
                    %reason,
                    "the broker blocked publishing (resource alarm); deliveries wait until it unblocks"
                );
            }
            None if was_blocked => {
                was_blocked = false;
                tracing::info!("the broker unblocked publishing; deliveries resume");
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
