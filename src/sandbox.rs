//! A throw-away bridge for the demo and the benchmarks: a random prefix, one route to a
//! fanout target exchange with one queue, and the bridge running in process through the
//! library's `Bridge::run` (as `delay-bridge run` runs it). `finish` deletes everything.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
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

/// A running throw-away bridge and its target.
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
    stats: Arc<Stats>,
    shutdown: CancellationToken,
    running: tokio::task::JoinHandle<Result<(), BridgeError>>,
}

impl Sandbox {
    /// Names everything `<stem>-<random>`, declares the target, starts the bridge and waits
    /// until it is ready.
    pub async fn start(base: &Config, stem: &str) -> Result<Self> {
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
            delay_bridge::amqp::connect(&config.url, stem)
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
        let bridge = Bridge::new(config.clone());
        let stats = bridge.stats();
        let mut ready = bridge.ready();
        let shutdown = CancellationToken::new();
        let running = tokio::spawn(bridge.run(shutdown.clone()));
        tokio::time::timeout(Duration::from_secs(30), ready.wait_for(|r| *r))
            .await
            .context("the bridge did not become ready within 30s")??;
        Ok(Self {
            config,
            conn,
            ingress,
            target_queue,
            target,
            stats,
            shutdown,
            running,
        })
    }

    /// The running bridge's counters.
    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// Stops the bridge and deletes everything the sandbox declared.
    pub async fn finish(self) -> Result<()> {
        self.shutdown.cancel();
        let stopped = self.running.await;
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
        stopped.context("the bridge task panicked")??;
        Ok(())
    }
}
