//! `delay-bridge bench <scenario>`: measurements against the real broker, with the bridge
//! run in process through the library's `Bridge::run` (as `delay-bridge run` runs it). Each
//! scenario prints a human table and one JSON object (the last line of its output).

mod cancel_horizon;

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Subcommand;
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

/// The scenarios.
#[derive(Debug, Subcommand)]
pub enum Scenario {
    /// How long before deliver-at a confirmed cancel still wins: cancels are confirmed at
    /// decreasing lead times before their messages' due time; the table shows which won.
    CancelHorizon(cancel_horizon::Args),
}

/// Runs one scenario against the configured broker.
pub async fn run(base: &Config, scenario: &Scenario) -> Result<()> {
    match scenario {
        Scenario::CancelHorizon(args) => cancel_horizon::run(base, args).await,
    }
}

/// A throw-away topology (random prefix), a target exchange and queue, and the bridge
/// running in process. `finish` deletes everything.
pub struct Bench {
    pub config: Config,
    pub conn: Arc<Connection>,
    pub ingress: String,
    pub target_queue: String,
    target: String,
    stats: Arc<Stats>,
    shutdown: CancellationToken,
    running: tokio::task::JoinHandle<Result<(), BridgeError>>,
}

impl Bench {
    /// Declares the target, starts the bridge and waits until it is ready.
    pub async fn start(
        base: &Config,
        name: &str,
        adjust: impl FnOnce(&mut Config),
    ) -> Result<Self> {
        let prefix = format!(
            "delay-bridge-bench-{name}-{:06x}",
            rand::random::<u32>() & 0xff_ffff
        );
        let mut config = base.clone();
        config.names = Names::new(prefix.clone());
        let ingress = format!("{prefix}.in");
        let target = format!("{prefix}.out");
        let target_queue = format!("{prefix}.out.q");
        config.routes = vec![Route {
            ingress: ingress.clone(),
            target: target.clone(),
        }];
        adjust(&mut config);
        let conn = Arc::new(
            delay_bridge::amqp::connect(&config.url, "delay-bridge bench")
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

    /// Stops the bridge and deletes everything the bench declared.
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
        let _ = self.conn.close(200, "bench done".into()).await;
        stopped.context("the bridge task panicked")??;
        Ok(())
    }
}

/// The value at quantile `q` (0..=1) of sorted samples.
pub fn quantile(sorted: &[i64], q: f64) -> Option<i64> {
    if sorted.is_empty() {
        return None;
    }
    let i = ((sorted.len() - 1) as f64 * q).round() as usize;
    Some(sorted[i])
}
