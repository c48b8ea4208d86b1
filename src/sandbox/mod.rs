//! A throw-away bridge for the demo and the benchmarks: a random prefix, one route to a
//! fanout target exchange with one queue, and the bridge's topology declared. The bridge
//! then runs in process through the library's `Bridge::run`, or as a `delay-bridge run`
//! child process ([`process::BridgeProcess`]), the two ways users run it. `finish` stops it
//! and deletes everything.

#[cfg(feature = "bench")]
mod measure;
#[cfg(feature = "bench")]
pub mod process;
#[cfg(feature = "bench")]
pub use measure::queue_counts;

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use lapin::options::{
    ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{Connection, ExchangeKind};
use tokio_util::sync::CancellationToken;

use delay_bridge::bridge::{Bridge, BridgeError, Stats};
use delay_bridge::config::{Config, Route};
use delay_bridge::naming::Names;
use delay_bridge::topology::Topology;

#[cfg(feature = "bench")]
use process::BridgeProcess;

/// A throw-away topology, its target, and the bridge serving it (once started).
pub struct Sandbox {
    /// The bridge's config: the base one with the sandbox's prefix and route.
    pub config: Config,
    /// A connection for the caller's publishers and consumers.
    pub conn: Arc<Connection>,
    /// The route's ingress exchange.
    pub ingress: String,
    /// The queue bound to the route's target exchange.
    pub target_queue: String,
    target: String,
    running: Running,
}

/// How the sandbox's bridge runs.
enum Running {
    NotStarted,
    InProcess {
        stats: Arc<Stats>,
        shutdown: CancellationToken,
        task: tokio::task::JoinHandle<Result<(), BridgeError>>,
    },
    #[cfg(feature = "bench")]
    Process(BridgeProcess),
}

impl Sandbox {
    /// Names everything `<stem>-<random>`, declares the target and the bridge's topology,
    /// starts the bridge in process and waits until it is ready.
    pub async fn start(base: &Config, stem: &str) -> Result<Self> {
        let mut sandbox = Self::declare(base, stem).await?;
        sandbox.run_in_process().await?;
        Ok(sandbox)
    }

    /// Names everything `<stem>-<random>` and declares the target and the bridge's
    /// topology; no bridge runs yet (messages published now wait in the work queue).
    pub async fn declare(base: &Config, stem: &str) -> Result<Self> {
        let prefix = format!("{stem}-{:06x}", rand::random::<u32>() & 0xff_ffff);
        let mut config = base.clone();
        config.names = Names::new(prefix.clone());
        let ingress = format!("{prefix}.in");
        let target = format!("{prefix}.out");
        let target_queue = format!("{prefix}.out.q");
        config.routes = vec![Route {
            ingress: ingress.clone(),
            target: target.clone(),
        }];
        let conn = Arc::new(
            delay_bridge::amqp::connect(config.url(), stem)
                .await
                .context("is RabbitMQ running? try: bash scripts/broker.sh")?,
        );
        let channel = conn.create_channel().await?;
        channel
            .exchange_declare(
                target.as_str().into(),
                ExchangeKind::Fanout,
                ExchangeDeclareOptions::default(),
                FieldTable::default(),
            )
            .await?;
        channel
            .queue_declare(
                target_queue.as_str().into(),
                QueueDeclareOptions::default(),
                FieldTable::default(),
            )
            .await?;
        channel
            .queue_bind(
                target_queue.as_str().into(),
                target.as_str().into(),
                "".into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await?;
        let _ = channel.close(200, "declared".into()).await;
        Topology::from_config(&config).declare(&conn).await?;
        Ok(Self {
            config,
            conn,
            ingress,
            target_queue,
            target,
            running: Running::NotStarted,
        })
    }

    /// Starts the bridge in process (the library's `Bridge::run`) and waits until it is
    /// ready.
    pub async fn run_in_process(&mut self) -> Result<()> {
        self.ensure_not_started()?;
        let bridge = Bridge::new(self.config.clone());
        let stats = bridge.stats();
        let mut ready = bridge.ready();
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(bridge.run(shutdown.clone()));
        self.running = Running::InProcess {
            stats,
            shutdown,
            task,
        };
        tokio::time::timeout(Duration::from_secs(30), ready.wait_for(|r| *r))
            .await
            .context("the bridge did not become ready within 30s")??;
        Ok(())
    }

    fn ensure_not_started(&self) -> Result<()> {
        if !matches!(self.running, Running::NotStarted) {
            bail!("the sandbox's bridge is already started");
        }
        Ok(())
    }

    /// The in-process bridge's counters (`None` when it runs in a child process or not
    /// at all).
    pub fn stats(&self) -> Option<&Stats> {
        match &self.running {
            Running::InProcess { stats, .. } => Some(stats),
            _ => None,
        }
    }

    /// Stops the bridge, however it runs (graceful shutdown in both cases).
    pub async fn stop_bridge(&mut self) -> Result<()> {
        match std::mem::replace(&mut self.running, Running::NotStarted) {
            Running::NotStarted => Ok(()),
            Running::InProcess { shutdown, task, .. } => {
                shutdown.cancel();
                task.await.context("the bridge task panicked")??;
                Ok(())
            }
            #[cfg(feature = "bench")]
            Running::Process(process) => process.stop().await,
        }
    }

    /// Stops the bridge and deletes everything the sandbox declared.
    pub async fn finish(mut self) -> Result<()> {
        let stopped = self.stop_bridge().await;
        let channel = self.conn.create_channel().await?;
        channel
            .queue_delete(
                self.target_queue.as_str().into(),
                QueueDeleteOptions::default(),
            )
            .await?;
        channel
            .exchange_delete(
                self.target.as_str().into(),
                ExchangeDeleteOptions::default(),
            )
            .await?;
        Topology::from_config(&self.config)
            .delete(&self.conn)
            .await?;
        let _ = self.conn.close(200, "done".into()).await;
        stopped
    }
}
