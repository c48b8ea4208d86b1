//! The bridge runtime: connect, declare, consume the work queue, hop/hold/deliver/park, and
//! reconnect with backoff when the broker goes away. Runs until its shutdown token fires.

pub(crate) mod acks;
mod budget;
mod cancels;
mod carrier;
mod depths;
mod inlet;
pub mod instruments;
mod level_watch;
mod peers;
mod reconnect;
mod redeliveries;
mod refusals;
mod session;
mod stuck;
mod turns;

use std::ops::ControlFlow;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use thiserror::Error;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::amqp::{self, ConnectError};
use crate::cancel::TombstoneSet;
use crate::config::Config;
use crate::contract::ParkReason;
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
    /// Consuming, acking or opening a publishing channel failed mid-session (connection
    /// or channel lost).
    #[error("{what}: {source}")]
    Wire {
        /// What the bridge was doing.
        what: &'static str,
        /// The connection's error.
        source: crate::amqp::wire::WireError,
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
    /// Publishing the bundle a message hopped in failed in a way that needs a new session
    /// (the error its publish met).
    #[error("publishing a bundle of hops: {0}")]
    Bundle(String),
}

impl BridgeError {
    /// True when reconnecting cannot help and the bridge should stop.
    pub fn is_permanent(&self) -> bool {
        match self {
            BridgeError::Topology(e) => e.is_permanent(),
            BridgeError::Connect(e) => matches!(e.reply_code(), Some(403 | 530)),
            _ => false,
        }
    }

    /// True when the AMQP client failed the connection on a frame it could not parse: a
    /// delivery with a short string that is not UTF-8 (see [`crate::amqp::unreadable`]).
    fn is_unreadable_frame(&self) -> bool {
        let source = match self {
            BridgeError::Wire { source, .. }
            | BridgeError::Publish {
                source: amqp::PublishError::Broker(source),
                ..
            } => return matches!(source, crate::amqp::wire::WireError::Unreadable(_)),
            BridgeError::Broker { source, .. } => source,
            _ => return false,
        };
        amqp::is_unreadable_frame(source)
    }

    fn broker(what: &'static str) -> impl FnOnce(lapin::Error) -> BridgeError {
        move |source| BridgeError::Broker { what, source }
    }

    fn wire(what: &'static str) -> impl FnOnce(crate::amqp::wire::WireError) -> BridgeError {
        move |source| BridgeError::Wire { what, source }
    }

    fn publish(
        what: &'static str,
    ) -> impl FnOnce(crate::amqp::publisher::PublishError) -> BridgeError {
        move |source| BridgeError::Publish { what, source }
    }
}

/// Declares [`Stats`] (the live counters, shared with the bridge's tasks) and [`Counts`] (a
/// reading of them) from one list, so the two cannot drift apart. Each entry names the
/// Prometheus metric it is exported as (a counter or a gauge; `none`: exported otherwise),
/// and its doc comment is that metric's help text.
macro_rules! counters {
    ($($(#[doc = $doc:literal])* $name:ident: $kind:ident $metric:literal,)*) => {
        /// Counters of what the bridge did, updated as it works; read them with
        /// [`Stats::snapshot`].
        #[derive(Debug, Default)]
        pub struct Stats {
            $($(#[doc = $doc])* pub(crate) $name: AtomicU64,)*
        }

        /// What the bridge had done when [`Stats::snapshot`] was called.
        #[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
        pub struct Counts {
            $($(#[doc = $doc])* pub $name: u64,)*
        }

        impl Stats {
            /// Every counter now (each read on its own, not as one atomic reading).
            pub fn snapshot(&self) -> Counts {
                Counts {
                    $($name: self.$name.load(Ordering::Relaxed),)*
                }
            }
        }

        impl Counts {
            /// Sets each exported metric of `recorder` to this reading.
            pub fn export(&self, recorder: &dyn metrics::Recorder) {
                $(export!($kind, recorder, $metric, concat!($($doc),*), self.$name);)*
            }
        }
    };
}

/// One entry of [`counters!`] into a metrics recorder.
macro_rules! export {
    (counter, $recorder:expr, $metric:literal, $help:expr, $value:expr) => {
        $recorder.describe_counter(
            metrics::KeyName::from_const_str($metric),
            None,
            metrics::SharedString::from($help.trim().to_string()),
        );
        metrics::Recorder::register_counter(
            $recorder,
            &metrics::Key::from_static_name($metric),
            &metrics::Metadata::new(module_path!(), metrics::Level::INFO, None),
        )
        .absolute($value);
    };
    (gauge, $recorder:expr, $metric:literal, $help:expr, $value:expr) => {
        $recorder.describe_gauge(
            metrics::KeyName::from_const_str($metric),
            None,
            metrics::SharedString::from($help.trim().to_string()),
        );
        metrics::Recorder::register_gauge(
            $recorder,
            &metrics::Key::from_static_name($metric),
            &metrics::Metadata::new(module_path!(), metrics::Level::INFO, None),
        )
        .set($value as f64);
    };
    (none, $recorder:expr, $metric:literal, $help:expr, $value:expr) => {};
}

counters! {
    /// Deliveries consumed from the work queue.
    consumed: counter "delay_bridge_consumed_total",
    /// Hops published into level queues (confirmed), alone or in a bundle.
    hops: counter "delay_bridge_hops_total",
    /// Bundles published into level queues (confirmed): each carries the hops of one
    /// `bridge.hop_window` into one level (`bridge.bundle_hops`).
    bundles: counter "delay_bridge_bundles_total",
    /// Messages published to their target (confirmed).
    delivered: counter "delay_bridge_delivered_total",
    /// Messages parked (confirmed); exported by reason as `delay_bridge_parked_total`.
    parked: none "",
    /// Messages waiting on a hold timer now.
    held: gauge "delay_bridge_held_messages",
    /// Deliveries consumed and not yet acked or given back now.
    in_flight: gauge "delay_bridge_in_flight_messages",
    /// Deliveries given back to the broker unprocessed (shutdown or a failed session).
    released: counter "delay_bridge_released_total",
    /// Publishes the broker refused (nack) and that were retried.
    nacks: counter "delay_bridge_nacks_total",
    /// Publishes tried again for any reason: refused (nack), unanswered (a lost channel or
    /// no confirm in time), or refused by the broker (403, 404, 406) fewer times than it
    /// takes to park.
    retries: counter "delay_bridge_publish_retries_total",
    /// Sessions that ended with an error and were reconnected.
    reconnects: counter "delay_bridge_reconnects_total",
    /// Copies dropped because their message was cancelled.
    cancelled: counter "delay_bridge_cancelled_total",
    /// Live tombstones in memory now.
    tombstones: gauge "delay_bridge_tombstones",
    /// Times the consumer was paused because unacked bodies went over
    /// `bridge.max_unacked_bytes` (its prefetch window narrowed).
    pauses: counter "delay_bridge_consumer_pauses_total",
    /// The most bytes of unacked deliveries held at once so far: their bodies, and 1 KiB
    /// for each message of a bundle.
    max_unacked_bytes_seen: gauge "delay_bridge_max_unacked_bytes",
    /// The prefetch window of the work queue's consumer now: `bridge.prefetch`, or fewer
    /// while large bodies narrow it to fit its share of `bridge.max_unacked_bytes`.
    work_window: gauge "delay_bridge_work_window",
    /// The prefetch window of the returns queue's consumer now (as `work_window`).
    returns_window: gauge "delay_bridge_returns_window",
    /// 1 while hops travel in bundles (`bridge.bundle_hops`, and every instance on the
    /// prefix reads bundles), else 0: the carriers read it to decide.
    bundling: gauge "delay_bridge_bundling",
    /// The bridge's queues holding expired messages their dead-letter worker has not
    /// forwarded for `management.stuck_after` now (read from the management API).
    stuck_queues: gauge "delay_bridge_stuck_queues",
    /// Expired messages not yet forwarded by the dead-letter workers of the bridge's
    /// queues, at the last reading of the management API.
    expired_unforwarded: gauge "delay_bridge_expired_unforwarded_messages",
}

/// What every session and message task shares.
struct Shared {
    config: Config,
    topology: Topology,
    bridge_user: String,
    /// `config.names.work_exchange()`, built once: every delivery is checked against it.
    work_exchange: String,
    stats: Arc<Stats>,
    /// What the bridge records besides `stats` (nothing without a metrics recorder).
    instruments: instruments::Instruments,
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
                instruments,
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
                    // A delivery lapin cannot read fails every session that receives it:
                    // take it out of the work queue and start again at once. When there
                    // is none there (the frame came on another channel), this is a loss
                    // like any other.
                    if e.is_unreadable_frame()
                        && self.sweep_unreadable(&config.urls[broker], &e).await > 0
                    {
                        self.ready_tx.send_replace(false);
                        self.shared.stats.reconnects.fetch_add(1, Ordering::Relaxed);
                        continue;
                    }
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

    /// After `lost`, takes what the AMQP client cannot read out of its way, within
    /// [`SWEEP_TIMEOUT`]: parks such deliveries at the head of the work and returns queues
    /// ([`amqp::unreadable::sweep`]), and when there is none, reads the cancel stream apart
    /// past such entries ([`amqp::unreadable::read_stream`]). Gives how many it parked or
    /// skipped. A failure is logged: the next session that meets such a frame fails again,
    /// and this runs again.
    async fn sweep_unreadable(&self, url: &crate::config::BrokerUrl, lost: &BridgeError) -> u64 {
        tracing::warn!(
            "{lost}: the AMQP client cannot read a frame; looking for deliveries it cannot read in the work and returns queues"
        );
        let shared = &self.shared;
        let config = &shared.config;
        let swept = tokio::time::timeout(SWEEP_TIMEOUT, async {
            let mut swept = amqp::unreadable::Swept::default();
            for queue in [config.names.work_queue(), config.names.returns_queue()] {
                let one = amqp::unreadable::sweep(
                    url,
                    &config.names,
                    &queue,
                    config.prefetch,
                    SWEEP_IDLE,
                )
                .await?;
                swept.readable += one.readable;
                swept.parked += one.parked;
            }
            if swept.parked > 0 {
                return Ok((swept, 0));
            }
            let from = *shared.stream_next_offset.lock().expect("offset lock");
            let mut skipped = 0;
            let read =
                amqp::unreadable::read_stream(url, &config.names, from, SWEEP_IDLE, |entry| {
                    if cancels::apply_read_apart(shared, entry) {
                        skipped += 1;
                    }
                    ControlFlow::Continue(())
                })
                .await?;
            tracing::info!(read, skipped, "read the cancel stream apart");
            Ok::<_, amqp::unreadable::SweepError>((swept, skipped))
        })
        .await;
        match swept {
            Ok(Ok((swept, skipped))) => {
                shared
                    .stats
                    .parked
                    .fetch_add(swept.parked, Ordering::Relaxed);
                for _ in 0..swept.parked {
                    shared.instruments.parked(ParkReason::Unreadable);
                }
                tracing::warn!(
                    parked = swept.parked,
                    given_back = swept.readable,
                    skipped_in_cancel_stream = skipped,
                    "took what the AMQP client cannot read out of its way (work and returns queues: parked `unreadable`)"
                );
                swept.parked + skipped
            }
            Ok(Err(e)) => {
                tracing::error!("taking what the AMQP client cannot read out of its way: {e}");
                0
            }
            Err(_) => {
                tracing::error!(
                    "taking what the AMQP client cannot read out of its way took over {SWEEP_TIMEOUT:?}"
                );
                0
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

/// How long a sweep for unreadable deliveries may take.
const SWEEP_TIMEOUT: Duration = Duration::from_secs(30);
/// A sweep stops when no delivery came for this long.
const SWEEP_IDLE: Duration = Duration::from_secs(1);

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
