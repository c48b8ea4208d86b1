//! A throw-away bridge for demos, benchmarks and broker-backed tests (feature `sandbox`).
//!
//! A [`Sandbox`] names everything `<stem>-<random>`: the bridge's topology, one route from
//! an ingress exchange to a target exchange with one queue bound to it, and any exchange the
//! caller adds. The bridge then runs in process ([`Sandbox::run_in_process`], the library's
//! `Bridge::run`) or as a `delay-bridge run` child process ([`process::BridgeProcess`]), the
//! two ways users run it. [`Sandbox::finish`] stops it and deletes everything; a sandbox
//! dropped without `finish` (a failed test) still deletes what it declared.
//!
//! ```no_run
//! # async fn demo() -> Result<(), delay_bridge::sandbox::SandboxError> {
//! use delay_bridge::sandbox::{Sandbox, TargetBinding, base_config};
//!
//! let base = base_config(None).expect("the defaults are valid");
//! let sandbox = Sandbox::start(&base, "my-test", TargetBinding::Fanout).await?;
//! // publish with `x-delay` to sandbox.ingress, consume sandbox.target_queue ...
//! sandbox.finish().await
//! # }
//! ```

pub mod process;
mod queues;
mod watch;

pub use queues::{QueueCounts, queue_counts};
pub use watch::{Received, watch_queue};

use std::sync::Arc;
use std::time::Duration;

use lapin::options::{
    ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Connection, ExchangeKind};
use thiserror::Error;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::amqp::{self, ConnectError};
use crate::bridge::{Bridge, BridgeError, Stats};
use crate::config::{
    Config, ConfigError, ENV_URL, QueueType, RawBroker, RawConfig, RawRoute, Route,
};
use crate::naming::Names;
use crate::topology::{Topology, TopologyError};

/// How long a bridge started by the sandbox may take to become ready.
const READY_WITHIN: Duration = Duration::from_secs(30);

/// What went wrong in a sandbox.
#[derive(Debug, Error)]
pub enum SandboxError {
    /// The broker does not answer.
    #[error("{0} (is RabbitMQ running? try: bash scripts/broker.sh)")]
    Connect(#[from] ConnectError),
    /// Declaring the bridge's topology failed.
    #[error(transparent)]
    Topology(#[from] TopologyError),
    /// A broker operation failed.
    #[error("{what}: {source}")]
    Broker {
        /// What the sandbox was doing.
        what: String,
        /// The client error.
        source: lapin::Error,
    },
    /// The bridge stopped with an error.
    #[error("the bridge stopped: {0}")]
    Bridge(#[from] BridgeError),
    /// The bridge's task panicked.
    #[error("the bridge task panicked")]
    Panicked,
    /// The bridge was not ready in time.
    #[error("the bridge was not ready within {0:?}")]
    NotReady(Duration),
    /// A bridge already runs in this sandbox.
    #[error("the sandbox's bridge is already started")]
    AlreadyStarted,
    /// A child process could not be started, signalled or awaited.
    #[error("{what}: {source}")]
    Process {
        /// What the sandbox was doing.
        what: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A child process exited or did not exit when it should have.
    #[error("{0}")]
    ProcessState(String),
}

impl SandboxError {
    fn broker(what: impl Into<String>) -> impl FnOnce(lapin::Error) -> SandboxError {
        let what = what.into();
        move |source| SandboxError::Broker { what, source }
    }
}

/// The default configuration with `url` as the broker (or else `DELAY_BRIDGE_URL`, or else
/// the local default): a base for [`Sandbox::declare`], which sets the prefix and routes.
pub fn base_config(url: Option<&str>) -> Result<Config, ConfigError> {
    let url = url
        .map(str::to_string)
        .or_else(|| std::env::var(ENV_URL).ok());
    RawConfig {
        broker: RawBroker { url, urls: None },
        // Replaced by the sandbox's own route; validation wants one.
        routes: vec![RawRoute {
            ingress: Some("sandbox.in".into()),
            target: Some("sandbox.out".into()),
            ingress_type: None,
        }],
        ..RawConfig::default()
    }
    .validate()
}

/// How the sandbox's target queue is bound to its target exchange.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TargetBinding {
    /// A fanout exchange: every message reaches the queue.
    Fanout,
    /// A topic exchange bound with this pattern: a message whose routing key does not match
    /// is unroutable at the target (parked `unroutable` by the bridge).
    Topic(String),
}

/// A bridge running in process, stopped through its token.
pub struct InProcessBridge {
    stats: Arc<Stats>,
    ready: tokio::sync::watch::Receiver<bool>,
    shutdown: CancellationToken,
    task: JoinHandle<Result<(), BridgeError>>,
}

impl InProcessBridge {
    /// Starts a bridge for `config` on this runtime and waits until it is ready (its
    /// topology declared, the cancel stream read up to date, consuming).
    pub async fn start(config: Config) -> Result<Self, SandboxError> {
        Self::run(Bridge::new(config)).await
    }

    /// Runs `bridge` on this runtime and waits until it is ready.
    pub async fn run(bridge: Bridge) -> Result<Self, SandboxError> {
        let stats = bridge.stats();
        let mut ready = bridge.ready();
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(bridge.run(shutdown.clone()));
        let started = Self {
            stats,
            ready: ready.clone(),
            shutdown,
            task,
        };
        match tokio::time::timeout(READY_WITHIN, ready.wait_for(|r| *r)).await {
            Ok(Ok(_)) => Ok(started),
            // The bridge dropped its readiness sender: it stopped; say why.
            Ok(Err(_)) => Err(started.stop().await.err().unwrap_or(SandboxError::Panicked)),
            Err(_) => Err(SandboxError::NotReady(READY_WITHIN)),
        }
    }

    /// Its readiness, as [`Bridge::ready`].
    pub fn ready(&self) -> tokio::sync::watch::Receiver<bool> {
        self.ready.clone()
    }

    /// Its counters.
    pub fn stats(&self) -> Arc<Stats> {
        self.stats.clone()
    }

    /// Graceful shutdown: waits for the bridge to drain and stop.
    pub async fn stop(self) -> Result<(), SandboxError> {
        self.shutdown.cancel();
        self.task.await.map_err(|_| SandboxError::Panicked)??;
        Ok(())
    }
}

/// A throw-away topology, its target, and the bridge serving it (once started).
pub struct Sandbox {
    /// The bridge's config: the base one with the sandbox's prefix and routes.
    pub config: Config,
    /// A connection for the caller's publishers and consumers.
    pub conn: Arc<Connection>,
    /// The route's ingress exchange.
    pub ingress: String,
    /// The route's target exchange.
    pub target: String,
    /// The queue bound to the target exchange.
    pub target_queue: String,
    bridge: Option<InProcessBridge>,
    extra_exchanges: Vec<String>,
    extra_queues: Vec<String>,
    finished: bool,
}

impl Sandbox {
    /// Declares everything (see [`Sandbox::declare`]), starts the bridge in process and
    /// waits until it is ready.
    pub async fn start(
        base: &Config,
        stem: &str,
        binding: TargetBinding,
    ) -> Result<Self, SandboxError> {
        let mut sandbox = Self::declare(base, stem, binding).await?;
        sandbox.run_in_process().await?;
        Ok(sandbox)
    }

    /// Names everything `<stem>-<random>`, declares the target exchange, its queue and the
    /// bridge's topology; no bridge runs yet (messages published now wait in the work
    /// queue). The base config's routes are replaced by the sandbox's own: a sandbox never
    /// touches a real route's exchanges.
    pub async fn declare(
        base: &Config,
        stem: &str,
        binding: TargetBinding,
    ) -> Result<Self, SandboxError> {
        let prefix = format!("{stem}-{:08x}", rand::random::<u32>());
        let mut config = base.clone();
        config.names = Names::new(prefix.clone());
        let ingress = format!("{prefix}.in");
        let target = format!("{prefix}.out");
        let target_queue = format!("{prefix}.out.q");
        config.routes = vec![Route::new(ingress.clone(), target.clone())];
        let conn = Arc::new(amqp::connect(config.url(), stem).await?);
        let sandbox = Self {
            config,
            conn,
            ingress,
            target,
            target_queue,
            bridge: None,
            extra_exchanges: Vec::new(),
            extra_queues: Vec::new(),
            finished: false,
        };
        sandbox.declare_target(&binding).await?;
        // Before any bridge runs, so that messages published now are kept.
        Topology::from_config(&sandbox.config)
            .declare(&sandbox.conn)
            .await?;
        Ok(sandbox)
    }

    async fn declare_target(&self, binding: &TargetBinding) -> Result<(), SandboxError> {
        let (kind, pattern) = match binding {
            TargetBinding::Fanout => (ExchangeKind::Fanout, ""),
            TargetBinding::Topic(pattern) => (ExchangeKind::Topic, pattern.as_str()),
        };
        let channel = self.channel().await?;
        // Durable like the queue below: a broker restart must find the route's target.
        let declare_target = channel.exchange_declare(
            self.target.as_str().into(),
            kind,
            ExchangeDeclareOptions {
                durable: true,
                ..ExchangeDeclareOptions::default()
            },
            FieldTable::default(),
        );
        declare_target
            .await
            .map_err(SandboxError::broker(format!("declaring {}", self.target)))?;
        // Durable, and replicated in quorum mode: a fault test's broker restart or node loss
        // must not take delivered messages with it.
        let mut args = FieldTable::default();
        if self.config.queue_type == QueueType::Quorum {
            args.insert(
                "x-queue-type".into(),
                AMQPValue::LongString("quorum".into()),
            );
        }
        channel
            .queue_declare(
                self.target_queue.as_str().into(),
                QueueDeclareOptions {
                    durable: true,
                    ..QueueDeclareOptions::default()
                },
                args,
            )
            .await
            .map_err(SandboxError::broker(format!(
                "declaring {}",
                self.target_queue
            )))?;
        channel
            .queue_bind(
                self.target_queue.as_str().into(),
                self.target.as_str().into(),
                pattern.into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(SandboxError::broker(format!(
                "binding {}",
                self.target_queue
            )))?;
        let _ = channel.close(200, "declared".into()).await;
        Ok(())
    }

    /// A new channel on the sandbox's connection.
    pub async fn channel(&self) -> Result<lapin::Channel, SandboxError> {
        self.conn
            .create_channel()
            .await
            .map_err(SandboxError::broker("opening a channel"))
    }

    /// The sandbox's prefix: every name it declared starts with it.
    pub fn prefix(&self) -> &str {
        self.config.names.prefix()
    }

    /// Starts the bridge in process (the library's `Bridge::run`) and waits until it is
    /// ready.
    pub async fn run_in_process(&mut self) -> Result<(), SandboxError> {
        self.run_bridge(Bridge::new(self.config.clone())).await
    }

    /// Runs `bridge` (built on this sandbox's `config`, for example with metrics) in
    /// process and waits until it is ready.
    pub async fn run_bridge(&mut self, bridge: Bridge) -> Result<(), SandboxError> {
        if self.bridge.is_some() {
            return Err(SandboxError::AlreadyStarted);
        }
        self.bridge = Some(InProcessBridge::run(bridge).await?);
        Ok(())
    }

    /// The in-process bridge (`None` when none runs in process).
    pub fn bridge(&self) -> Option<&InProcessBridge> {
        self.bridge.as_ref()
    }

    /// The in-process bridge's counters (`None` when no bridge runs in process).
    pub fn stats(&self) -> Option<Arc<Stats>> {
        self.bridge.as_ref().map(InProcessBridge::stats)
    }

    /// Stops the in-process bridge, if one runs (graceful shutdown).
    pub async fn stop_bridge(&mut self) -> Result<(), SandboxError> {
        match self.bridge.take() {
            Some(bridge) => bridge.stop().await,
            None => Ok(()),
        }
    }

    /// Adds a route before the bridge starts and declares its ingress exchange (deleted
    /// with the bridge's topology). Its target is the caller's to declare, or not.
    pub async fn add_route(&mut self, route: Route) -> Result<(), SandboxError> {
        if self.bridge.is_some() {
            return Err(SandboxError::AlreadyStarted);
        }
        self.config.routes.push(route);
        Topology::from_config(&self.config)
            .declare(&self.conn)
            .await?;
        Ok(())
    }

    /// Declares one more exchange, deleted with the sandbox.
    pub async fn declare_extra_exchange(
        &mut self,
        name: &str,
        kind: ExchangeKind,
    ) -> Result<(), SandboxError> {
        let channel = self.channel().await?;
        channel
            .exchange_declare(
                name.into(),
                kind,
                ExchangeDeclareOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(SandboxError::broker(format!("declaring {name}")))?;
        let _ = channel.close(200, "declared".into()).await;
        self.adopt_exchange(name);
        Ok(())
    }

    /// An exchange the caller declared itself (or the bridge declares as a route's
    /// ingress), for the sandbox to delete.
    pub fn adopt_exchange(&mut self, name: &str) {
        self.extra_exchanges.push(name.to_string());
    }

    /// A queue the caller declared itself, for the sandbox to delete.
    pub fn adopt_queue(&mut self, name: &str) {
        self.extra_queues.push(name.to_string());
    }

    /// Stops the bridge and deletes everything the sandbox declared (through a new
    /// connection to the first broker that answers when the sandbox's own was lost, for
    /// example to a broker a fault test killed).
    pub async fn finish(mut self) -> Result<(), SandboxError> {
        let stopped = self.stop_bridge().await;
        self.finished = true;
        let conn = if self.conn.status().connected() {
            self.conn.clone()
        } else {
            Arc::new(connect_first(&self.config, "sandbox-cleanup").await?)
        };
        let deleted = delete_all(&conn, &self.config, &self.queues(), &self.exchanges()).await;
        let _ = conn.close(200, "done".into()).await;
        stopped.and(deleted)
    }

    /// The target queue and every extra one.
    fn queues(&self) -> Vec<String> {
        let mut queues = vec![self.target_queue.clone()];
        queues.extend(self.extra_queues.iter().cloned());
        queues
    }

    /// The target exchange and every extra one.
    fn exchanges(&self) -> Vec<String> {
        let mut exchanges = vec![self.target.clone()];
        exchanges.extend(self.extra_exchanges.iter().cloned());
        exchanges
    }
}

impl Drop for Sandbox {
    /// A sandbox dropped without [`Sandbox::finish`] (a test that failed) still deletes
    /// what it declared, from a thread of its own with its own connection.
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        if let Some(bridge) = self.bridge.take() {
            bridge.shutdown.cancel();
        }
        let config = self.config.clone();
        let queues = self.queues();
        let exchanges = self.exchanges();
        let _ = std::thread::spawn(move || {
            let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            runtime.block_on(async {
                if let Ok(conn) = connect_first(&config, "sandbox-cleanup").await {
                    let _ = delete_all(&conn, &config, &queues, &exchanges).await;
                    let _ = conn.close(200, "cleanup".into()).await;
                }
            });
        })
        .join();
    }
}

/// Connects to the first of the configured brokers that answers.
async fn connect_first(config: &Config, name: &str) -> Result<Connection, SandboxError> {
    let mut last = None;
    for url in &config.urls {
        match amqp::connect(url, name).await {
            Ok(conn) => return Ok(conn),
            Err(e) => last = Some(e),
        }
    }
    Err(last.expect("a config names at least one broker").into())
}

/// Deletes the bridge's topology, then these queues and exchanges.
async fn delete_all(
    conn: &Connection,
    config: &Config,
    queues: &[String],
    exchanges: &[String],
) -> Result<(), SandboxError> {
    Topology::from_config(config)
        .delete(conn)
        .await
        .map_err(SandboxError::broker("deleting the bridge's topology"))?;
    let channel = conn
        .create_channel()
        .await
        .map_err(SandboxError::broker("opening a channel"))?;
    for queue in queues {
        channel
            .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
            .await
            .map_err(SandboxError::broker(format!("deleting {queue}")))?;
    }
    for exchange in exchanges {
        channel
            .exchange_delete(exchange.as_str().into(), ExchangeDeleteOptions::default())
            .await
            .map_err(SandboxError::broker(format!("deleting {exchange}")))?;
    }
    let _ = channel.close(200, "deleted".into()).await;
    Ok(())
}
