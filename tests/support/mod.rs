//! Test support: a uniquely prefixed topology per test, a bridge in process or as a child
//! process, waits on events with deadlines, and cleanup even when a test panics.

#![allow(dead_code)]

pub mod raw;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use delay_bridge::bridge::{Bridge, Stats};
use delay_bridge::clock::now_ms;
use delay_bridge::config::{
    Config, RawBridge, RawBroker, RawCancel, RawConfig, RawDelays, RawRoute, RawTopology,
};
use delay_bridge::topology::Topology;
use futures::StreamExt;
use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions,
    ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// The broker the tests use: `DELAY_BRIDGE_TEST_URL`, or the local default.
pub fn broker_url() -> String {
    std::env::var("DELAY_BRIDGE_TEST_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_string())
}

/// A unique prefix: the test's name plus randomness, so tests run in parallel.
pub fn unique_prefix(test: &str) -> String {
    format!("test-{test}-{:08x}", rand::random::<u32>())
}

pub async fn connect() -> Connection {
    Connection::connect(&broker_url(), ConnectionProperties::default())
        .await
        .expect("the test broker answers (run scripts/broker.sh)")
}

/// One message as received from the target queue, with its arrival time.
#[derive(Debug)]
pub struct Received {
    pub at_ms: u64,
    pub routing_key: String,
    pub exchange: String,
    pub properties: BasicProperties,
    pub body: Vec<u8>,
}

impl Received {
    pub fn header(&self, name: &str) -> Option<&AMQPValue> {
        self.properties
            .headers()
            .as_ref()
            .and_then(|h| h.inner().get(name))
    }
}

/// A message that reached the target queue or the parked queue.
#[derive(Debug)]
pub enum Arrival {
    /// Delivered to the target.
    Target(Received),
    /// Parked, with a reason.
    Parked(Received),
}

/// A test's world: its own prefix, a target topic exchange with a catch-all queue, the
/// parked queue watched, and a bridge (in process unless the test starts processes).
pub struct World {
    pub prefix: String,
    pub config: Config,
    pub conn: Arc<Connection>,
    pub publisher: Channel,
    pub ingress: String,
    pub target: String,
    pub target_queue: String,
    received: mpsc::UnboundedReceiver<Received>,
    parked: mpsc::UnboundedReceiver<Received>,
    bridge: Option<(CancellationToken, tokio::task::JoinHandle<()>, Arc<Stats>)>,
    extra_exchanges: Vec<String>,
    cleaned: bool,
}

/// Options for a world.
pub struct Setup<'a> {
    pub test: &'a str,
    pub ladder: &'a str,
    pub margin: &'a str,
    /// Extra `[[route]]` TOML (for example a route to a missing target).
    pub extra_routes: Vec<(String, String)>,
    pub start_bridge: bool,
    pub prefetch: u32,
    /// `classic` or `quorum`.
    pub queue_type: &'a str,
    /// `delays.max_delay`.
    pub max_delay: &'a str,
    /// `cancel.grace`.
    pub cancel_grace: &'a str,
    /// `bridge.target_full_timeout`, when not the default.
    pub target_full_timeout: Option<&'a str>,
    /// `bridge.redelivery_limit`, when not the default.
    pub redelivery_limit: Option<u32>,
    /// `bridge.max_unacked_bytes`, when not the default.
    pub max_unacked_bytes: Option<u64>,
}

impl<'a> Setup<'a> {
    pub fn new(test: &'a str) -> Self {
        Self {
            test,
            ladder: "100ms 200ms 400ms 800ms",
            margin: "30ms",
            extra_routes: Vec::new(),
            start_bridge: true,
            prefetch: 4000,
            queue_type: "classic",
            max_delay: "366d",
            cancel_grace: "1d",
            target_full_timeout: None,
            redelivery_limit: None,
            max_unacked_bytes: None,
        }
    }
}

/// The configuration of a test's bridge, as the file would hold it (typed by section; the
/// validated `Config` comes from `RawConfig::validate`).
pub fn raw_config(
    prefix: &str,
    ladder: &str,
    margin: &str,
    routes: &[(String, String)],
    prefetch: u32,
) -> RawConfig {
    RawConfig {
        broker: RawBroker {
            url: Some(broker_url()),
            urls: None,
        },
        topology: RawTopology {
            prefix: Some(prefix.into()),
            ..RawTopology::default()
        },
        delays: RawDelays {
            ladder: Some(ladder.into()),
            margin: Some(margin.into()),
            max_delay: Some("366d".into()),
        },
        bridge: RawBridge {
            prefetch: Some(prefetch),
            shutdown_timeout: Some("5s".into()),
            ..RawBridge::default()
        },
        cancel: RawCancel::default(),
        routes: routes
            .iter()
            .map(|(ingress, target)| RawRoute {
                ingress: Some(ingress.clone()),
                target: Some(target.clone()),
            })
            .collect(),
    }
}

/// The same as a TOML file, for a bridge process (the password is written as it is).
pub fn config_toml(
    prefix: &str,
    ladder: &str,
    margin: &str,
    routes: &[(String, String)],
    prefetch: u32,
) -> String {
    toml::to_string(&raw_config(prefix, ladder, margin, routes, prefetch)).expect("TOML")
}

impl World {
    pub async fn start(setup: Setup<'_>) -> World {
        let prefix = unique_prefix(setup.test);
        let ingress = format!("{prefix}.in");
        let target = format!("{prefix}.out");
        let target_queue = format!("{prefix}.out.q");
        let mut routes = vec![(ingress.clone(), target.clone())];
        routes.extend(setup.extra_routes.iter().cloned());
        let mut raw = raw_config(&prefix, setup.ladder, setup.margin, &routes, setup.prefetch);
        raw.topology.queue_type = Some(setup.queue_type.into());
        raw.delays.max_delay = Some(setup.max_delay.into());
        raw.cancel.grace = Some(setup.cancel_grace.into());
        raw.bridge.target_full_timeout = setup.target_full_timeout.map(Into::into);
        raw.bridge.redelivery_limit = setup.redelivery_limit;
        raw.bridge.max_unacked_bytes = setup.max_unacked_bytes;
        let config = raw.validate().expect("test config is valid");
        let conn = Arc::new(connect().await);
        let setup_channel = conn.create_channel().await.unwrap();
        setup_channel
            .exchange_declare(
                target.as_str().into(),
                ExchangeKind::Topic,
                ExchangeDeclareOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        declare_queue(&setup_channel, &target_queue).await;
        setup_channel
            .queue_bind(
                target_queue.as_str().into(),
                target.as_str().into(),
                "rk.#".into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        // Declare the bridge topology now, so publishes before the bridge is up are kept.
        Topology::from_config(&config).declare(&conn).await.unwrap();
        let received = watch_queue(&conn, &target_queue).await;
        let parked = watch_queue(&conn, &config.names.parked_queue()).await;
        let publisher = conn.create_channel().await.unwrap();
        publisher
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        let mut world = World {
            prefix,
            config,
            conn,
            publisher,
            ingress,
            target,
            target_queue,
            received,
            parked,
            bridge: None,
            extra_exchanges: Vec::new(),
            cleaned: false,
        };
        if setup.start_bridge {
            world.start_bridge().await;
        }
        world
    }

    /// Starts the bridge in process and waits until it consumes.
    pub async fn start_bridge(&mut self) {
        let (token, handle, stats) = self.spawn_bridge().await;
        self.bridge = Some((token, handle, stats));
    }

    /// Starts one more bridge instance in process on this world's config (the caller stops
    /// it with the token) and waits until it is ready.
    pub async fn spawn_bridge(
        &self,
    ) -> (CancellationToken, tokio::task::JoinHandle<()>, Arc<Stats>) {
        let bridge = Bridge::new(self.config.clone());
        let stats = bridge.stats();
        let mut ready = bridge.ready();
        let token = CancellationToken::new();
        let run_token = token.clone();
        let handle = tokio::spawn(async move {
            bridge.run(run_token).await.expect("the bridge runs");
        });
        tokio::time::timeout(Duration::from_secs(20), ready.wait_for(|r| *r))
            .await
            .expect("bridge ready within 20s")
            .unwrap();
        (token, handle, stats)
    }

    /// A typed client for this world's bridge.
    pub async fn client(&self) -> delay_bridge::client::Client {
        delay_bridge::client::Client::connect(&broker_url(), &self.prefix)
            .await
            .expect("client connects")
    }

    /// Messages ready in a queue now.
    pub async fn queue_depth(&self, queue: &str) -> u32 {
        inspect_queue(&self.conn, queue).await.message_count()
    }

    /// Messages in the work queue and every level queue (ready; the bridge's unacked ones
    /// are not counted).
    pub async fn pending_in_queues(&self) -> u32 {
        let mut total = self.queue_depth(&self.config.names.work_queue()).await;
        for level in self.config.ladder.levels() {
            total += self
                .queue_depth(&self.config.names.level_queue(*level))
                .await;
        }
        total
    }

    pub fn stats(&self) -> Arc<Stats> {
        self.bridge.as_ref().expect("bridge running").2.clone()
    }

    /// Stops the in-process bridge and waits for it to drain.
    pub async fn stop_bridge(&mut self) {
        if let Some((token, handle, _)) = self.bridge.take() {
            token.cancel();
            tokio::time::timeout(Duration::from_secs(20), handle)
                .await
                .expect("bridge stops within 20s")
                .expect("bridge task did not panic");
        }
    }

    /// Publishes to the ingress exchange with confirm; returns the publish time (epoch ms).
    pub async fn publish(
        &self,
        routing_key: &str,
        body: &[u8],
        properties: BasicProperties,
    ) -> u64 {
        publish_to(
            &self.publisher,
            &self.ingress,
            routing_key,
            body,
            properties,
        )
        .await
    }

    /// The next message on the target queue, or a panic after `within`.
    pub async fn recv_within(&mut self, within: Duration) -> Received {
        tokio::time::timeout(within, self.received.recv())
            .await
            .unwrap_or_else(|_| panic!("no message on the target within {within:?}"))
            .expect("target consumer alive")
    }

    /// The next parked message, or a panic after `within`.
    pub async fn parked_within(&mut self, within: Duration) -> Received {
        tokio::time::timeout(within, self.parked.recv())
            .await
            .unwrap_or_else(|_| panic!("nothing parked within {within:?}"))
            .expect("parked consumer alive")
    }

    /// The next message on the target or the parked queue, or `None` after `within`.
    pub async fn next_arrival(&mut self, within: Duration) -> Option<Arrival> {
        tokio::select! {
            Some(m) = self.received.recv() => Some(Arrival::Target(m)),
            Some(m) = self.parked.recv() => Some(Arrival::Parked(m)),
            _ = tokio::time::sleep(within) => None,
        }
    }

    /// Collects `n` messages from the target, panicking at the deadline.
    pub async fn recv_n(&mut self, n: usize, within: Duration) -> Vec<Received> {
        let deadline = Instant::now() + within;
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, self.received.recv()).await {
                Ok(Some(m)) => out.push(m),
                _ => panic!("received {} of {n} messages within {within:?}", out.len()),
            }
        }
        out
    }

    /// Collects whatever arrives on the target until it has been quiet for `quiet`.
    pub async fn drain_quiet(&mut self, quiet: Duration) -> Vec<Received> {
        let mut out = Vec::new();
        while let Ok(Some(m)) = tokio::time::timeout(quiet, self.received.recv()).await {
            out.push(m);
        }
        out
    }

    /// Asserts nothing else arrives on the target or parked queue for `quiet`.
    pub async fn assert_quiet(&mut self, quiet: Duration) {
        tokio::select! {
            m = self.received.recv() => panic!("unexpected message on the target: {m:?}"),
            m = self.parked.recv() => panic!("unexpected parked message: {m:?}"),
            _ = tokio::time::sleep(quiet) => {}
        }
    }

    /// Declares an extra exchange the cleanup deletes.
    pub async fn declare_extra_exchange(&mut self, name: &str, kind: ExchangeKind) {
        let ch = self.conn.create_channel().await.unwrap();
        ch.exchange_declare(
            name.into(),
            kind,
            ExchangeDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
        self.extra_exchanges.push(name.to_string());
    }

    /// An exchange the test declared itself, for the cleanup to delete.
    pub fn adopt_exchange(&mut self, name: &str) {
        self.extra_exchanges.push(name.to_string());
    }

    /// Stops the bridge and deletes everything this test declared.
    pub async fn cleanup(mut self) {
        self.stop_bridge().await;
        cleanup_topology(
            &self.config,
            &self.target,
            &self.target_queue,
            &self.extra_exchanges,
        )
        .await;
        self.cleaned = true;
    }
}

impl Drop for World {
    fn drop(&mut self) {
        if self.cleaned {
            return;
        }
        // A failed test still leaves nothing behind: clean up on a thread of its own.
        if let Some((token, _, _)) = self.bridge.take() {
            token.cancel();
        }
        let config = self.config.clone();
        let (target, queue, extra) = (
            self.target.clone(),
            self.target_queue.clone(),
            self.extra_exchanges.clone(),
        );
        let _ = std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(cleanup_topology(&config, &target, &queue, &extra));
        })
        .join();
    }
}

pub async fn cleanup_topology(config: &Config, target: &str, target_queue: &str, extra: &[String]) {
    let conn = connect().await;
    let _ = Topology::from_config(config).delete(&conn).await;
    let ch = conn.create_channel().await.unwrap();
    let _ = ch
        .queue_delete(target_queue.into(), QueueDeleteOptions::default())
        .await;
    let _ = ch
        .exchange_delete(target.into(), ExchangeDeleteOptions::default())
        .await;
    for e in extra {
        let _ = ch
            .exchange_delete(e.as_str().into(), ExchangeDeleteOptions::default())
            .await;
    }
    let _ = conn.close(200, "cleanup".into()).await;
}

pub async fn declare_queue(channel: &Channel, name: &str) {
    channel
        .queue_declare(
            name.into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
}

/// Consumes a queue (auto-ack) into a channel of received messages, stamping arrival time.
pub async fn watch_queue(conn: &Connection, queue: &str) -> mpsc::UnboundedReceiver<Received> {
    let channel = conn.create_channel().await.unwrap();
    let mut consumer = channel
        .basic_consume(
            queue.into(),
            format!("watch-{queue}").as_str().into(),
            BasicConsumeOptions {
                no_ack: true,
                ..BasicConsumeOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        let _keep = channel;
        while let Some(Ok(d)) = consumer.next().await {
            let m = Received {
                at_ms: now_ms(),
                routing_key: d.routing_key.to_string(),
                exchange: d.exchange.to_string(),
                properties: d.properties,
                body: d.data,
            };
            if tx.send(m).is_err() {
                break;
            }
        }
    });
    rx
}

pub async fn publish_to(
    channel: &Channel,
    exchange: &str,
    routing_key: &str,
    body: &[u8],
    properties: BasicProperties,
) -> u64 {
    let at = now_ms();
    let confirm = channel
        .basic_publish(
            exchange.into(),
            ShortString::from(routing_key),
            BasicPublishOptions::default(),
            body,
            properties,
        )
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(confirm.is_ack(), "publish confirmed");
    at
}

/// Waits until `condition` holds, checking every 5 ms, panicking with `what` at the deadline.
pub async fn wait_until(what: &str, within: Duration, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !condition() {
        assert!(Instant::now() < deadline, "not within {within:?}: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Reads a counter.
pub fn count(counter: &std::sync::atomic::AtomicU64) -> u64 {
    counter.load(std::sync::atomic::Ordering::Relaxed)
}

pub fn headers(entries: Vec<(&str, AMQPValue)>) -> FieldTable {
    let mut map = BTreeMap::new();
    for (k, v) in entries {
        map.insert(ShortString::from(k), v);
    }
    FieldTable::from(map)
}

pub fn with_delay(ms: i64) -> BasicProperties {
    BasicProperties::default().with_headers(headers(vec![("x-delay", AMQPValue::LongLongInt(ms))]))
}

pub fn text(s: &str) -> AMQPValue {
    AMQPValue::LongString(s.into())
}

/// A `delay-bridge run` child process, killed when dropped.
pub struct BridgeProcess {
    pub child: tokio::process::Child,
}

impl BridgeProcess {
    /// Starts the release-or-debug binary Cargo built for these tests (warnings only, to
    /// the test's stderr).
    pub fn spawn(config_path: &std::path::Path) -> BridgeProcess {
        Self::start(config_path, Some("warn"), None)
    }

    /// As `spawn`, with `RUST_LOG` = `rust_log` (`None`: unset, the binary's default level)
    /// and stderr written to the file `log`.
    pub fn spawn_logging(
        config_path: &std::path::Path,
        rust_log: Option<&str>,
        log: &std::path::Path,
    ) -> BridgeProcess {
        Self::start(config_path, rust_log, Some(log))
    }

    fn start(
        config_path: &std::path::Path,
        rust_log: Option<&str>,
        log: Option<&std::path::Path>,
    ) -> BridgeProcess {
        let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_delay-bridge"));
        command
            .arg("--config")
            .arg(config_path)
            .arg("run")
            .env_remove("RUST_LOG")
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true);
        if let Some(level) = rust_log {
            command.env("RUST_LOG", level);
        }
        if let Some(log) = log {
            command.stderr(std::fs::File::create(log).expect("log file"));
        }
        BridgeProcess {
            child: command.spawn().expect("spawn delay-bridge"),
        }
    }

    pub fn pid(&self) -> i32 {
        self.child.id().expect("running") as i32
    }

    /// SIGKILL: no chance to ack, drain or close anything.
    pub async fn kill9(mut self) {
        self.child.start_kill().unwrap();
        let _ = self.child.wait().await;
    }

    /// SIGTERM, then the exit status within `within`.
    pub async fn terminate(mut self, within: Duration) -> std::process::ExitStatus {
        let status = std::process::Command::new("kill")
            .args(["-TERM", &self.pid().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
        tokio::time::timeout(within, self.child.wait())
            .await
            .expect("exits after SIGTERM")
            .unwrap()
    }
}

/// Writes the world's config to a temp file for child processes.
pub fn write_config(world: &World, prefetch: u32) -> std::path::PathBuf {
    let path = std::env::temp_dir().join(format!("{}.toml", world.prefix));
    let text = config_toml(
        &world.prefix,
        &world.config.ladder.to_string(),
        &delay_bridge::ladder::format_duration(world.config.margin),
        &[(world.ingress.clone(), world.target.clone())],
        prefetch,
    );
    std::fs::write(&path, text).unwrap();
    path
}

/// A queue's message and consumer counts now (a passive declare on a channel of its own).
pub async fn inspect_queue(conn: &Connection, queue: &str) -> lapin::Queue {
    let channel = conn.create_channel().await.unwrap();
    let q = channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    let _ = channel.close(200, "inspected".into()).await;
    q
}

/// Waits until the work queue has `n` consumers.
pub async fn wait_for_consumers(world: &World, n: u32, within: Duration) {
    let deadline = Instant::now() + within;
    let work_queue = world.config.names.work_queue();
    loop {
        let q = inspect_queue(&world.conn, &work_queue).await;
        if q.consumer_count() >= n {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{n} consumers not there within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `rabbitmqctl` for the test broker: `DELAY_BRIDGE_TEST_CTL` (a command and its leading
/// arguments, for example `bash scripts/broker4.sh ctl`), or plain `rabbitmqctl`.
pub fn rabbitmqctl() -> std::process::Command {
    let line = std::env::var("DELAY_BRIDGE_TEST_CTL").unwrap_or_else(|_| "rabbitmqctl".into());
    let mut parts = line.split_whitespace();
    let mut command = std::process::Command::new(parts.next().expect("a command"));
    command.args(parts);
    command
}

/// Makes the broker close every connection whose client-provided name contains `name`
/// (needs `rabbitmqctl` and the broker's Erlang cookie, i.e. root on a local broker).
/// Returns how many it closed.
pub fn close_connections_named(name: &str) -> usize {
    let out = rabbitmqctl()
        .args([
            "list_connections",
            "-q",
            "--no-table-headers",
            "pid",
            "client_properties",
        ])
        .output()
        .expect("rabbitmqctl is needed for the connection-loss test");
    assert!(
        out.status.success(),
        "rabbitmqctl list_connections: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut closed = 0;
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        if !line.contains(name) {
            continue;
        }
        let pid = line.split_whitespace().next().unwrap();
        let status = rabbitmqctl()
            .args([
                "close_connection",
                pid,
                "delay-bridge test: simulated connection loss",
            ])
            .output()
            .unwrap();
        assert!(status.status.success());
        closed += 1;
    }
    closed
}

/// The broker's `max_message_size`, read with rabbitmqctl.
pub fn broker_max_message_size() -> usize {
    let out = rabbitmqctl()
        .args(["eval", "application:get_env(rabbit, max_message_size)."])
        .output()
        .expect("rabbitmqctl runs");
    let text = String::from_utf8_lossy(&out.stdout);
    let digits: String = text.chars().filter(|c| c.is_ascii_digit()).collect();
    digits
        .parse()
        .unwrap_or_else(|_| panic!("max_message_size from rabbitmqctl: {text:?}"))
}
