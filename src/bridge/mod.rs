//! The bridge runtime: connect, declare, consume the work queue, hop/hold/deliver/park, and
//! reconnect with backoff when the broker goes away. Runs until its shutdown token fires.

pub mod acks;
mod cancels;
mod worker;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

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
}

/// Counters of what the bridge did, for logs, the demo and tests.
#[derive(Debug, Default)]
pub struct Stats {
    /// Deliveries consumed from the work queue.
    pub consumed: AtomicU64,
    /// Hops published into level queues (confirmed).
    pub hops: AtomicU64,
    /// Messages published to their target (confirmed).
    pub delivered: AtomicU64,
    /// Messages parked (confirmed).
    pub parked: AtomicU64,
    /// Messages waiting on a hold timer now.
    pub held: AtomicU64,
    /// Deliveries given back to the broker unprocessed (shutdown or a failed session).
    pub released: AtomicU64,
    /// Publishes the broker refused (nack) and that were retried.
    pub nacks: AtomicU64,
    /// Sessions that ended with an error and were reconnected.
    pub reconnects: AtomicU64,
    /// Copies dropped because their message was cancelled.
    pub cancelled: AtomicU64,
    /// Live tombstones in memory now.
    pub tombstones: AtomicU64,
}

impl Stats {
    /// Reads a counter.
    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
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
        let bridge_user = config.url.user();
        let work_exchange = config.names.work_exchange();
        let tombstones = TombstoneSet::new(config.tombstone_keep().as_millis() as u64);
        Self {
            shared: Arc::new(Shared {
                config,
                topology,
                bridge_user,
                work_exchange,
                stats: Arc::new(Stats::default()),
                tombstones: Mutex::new(tombstones),
                stream_next_offset: Mutex::new(None),
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
        tracing::info!(
            url = %config.url,
            prefix = config.names.prefix(),
            levels = config.ladder.levels().len(),
            queue_type = %config.queue_type,
            "delay-bridge starting"
        );
        let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(30));
        let mut failing = false;
        loop {
            if shutdown.is_cancelled() {
                return Ok(());
            }
            let started = tokio::time::Instant::now();
            match self.session(&shutdown).await {
                Ok(()) => return Ok(()),
                Err(e) if e.is_permanent() => {
                    tracing::error!("{e}");
                    return Err(e);
                }
                Err(e) => {
                    self.ready_tx.send_replace(false);
                    if started.elapsed() > Duration::from_secs(30) {
                        backoff.reset();
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
                    tokio::select! {
                        _ = tokio::time::sleep(backoff.next_delay()) => {}
                        _ = shutdown.cancelled() => return Ok(()),
                    }
                }
            }
        }
    }

    async fn session(&self, shutdown: &CancellationToken) -> Result<(), BridgeError> {
        let config = &self.shared.config;
        let connection = Arc::new(
            amqp::connect(
                &config.url,
                &format!("delay-bridge {}", config.names.prefix()),
            )
            .await?,
        );
        self.shared.topology.declare(&connection).await?;
        let result = worker::run_session(
            self.shared.clone(),
            connection.clone(),
            shutdown,
            &self.ready_tx,
        )
        .await;
        let _ = connection.close(200, "delay-bridge stopping".into()).await;
        result
    }
}

/// Runs a bridge for `config` until `shutdown` fires.
pub async fn run(config: Config, shutdown: CancellationToken) -> Result<(), BridgeError> {
    Bridge::new(config).run(shutdown).await
}

/// Wall-clock now, epoch milliseconds.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// How long from now until the epoch-ms instant `at` (zero if it has passed), measured
/// with the clock's full precision.
pub fn until_epoch_ms(at: u64) -> Duration {
    (UNIX_EPOCH + Duration::from_millis(at))
        .duration_since(SystemTime::now())
        .unwrap_or_default()
}

/// Exponential backoff with jitter.
struct Backoff {
    base: Duration,
    max: Duration,
    attempt: u32,
}

impl Backoff {
    fn new(base: Duration, max: Duration) -> Self {
        Self {
            base,
            max,
            attempt: 0,
        }
    }

    fn next_delay(&mut self) -> Duration {
        let exp = self.base.saturating_mul(1 << self.attempt.min(16));
        self.attempt += 1;
        let capped = exp.min(self.max);
        capped.mul_f64(0.5 + rand::random::<f64>() / 2.0)
    }

    fn reset(&mut self) {
        self.attempt = 0;
    }
}
