//! Test support: a uniquely prefixed topology per test (the library's sandbox), a bridge in
//! process or as a child process, waits on events with deadlines, and cleanup even when a
//! test panics.

#![allow(dead_code)]

pub mod raw;

use std::collections::BTreeMap;
use std::ops::{Deref, DerefMut};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use delay_bridge::bridge::Stats;
use delay_bridge::clock::now_ms;
use delay_bridge::config::{
    Config, RawBridge, RawBroker, RawCancel, RawConfig, RawDelays, RawLog, RawManagement,
    RawMetrics, RawRoute, RawTopology, Route,
};
use delay_bridge::sandbox::process::{BridgeProcess, ConfigFile, ProcessLog};
use delay_bridge::sandbox::{Sandbox, TargetBinding};
use lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use tokio::sync::mpsc;

pub use delay_bridge::sandbox::{InProcessBridge, Received};

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

/// A message that reached the target queue or the parked queue.
#[derive(Debug)]
pub enum Arrival {
    /// Delivered to the target.
    Target(Received),
    /// Parked, with a reason.
    Parked(Received),
}

/// A test's world: a sandbox whose target is a topic exchange bound with `rk.#` (so any
/// other routing key is unroutable), the target and parked queues watched, a confirming
/// publisher, and a bridge (in process unless the test starts processes).
pub struct World {
    pub sandbox: Sandbox,
    pub publisher: Channel,
    received: mpsc::UnboundedReceiver<Received>,
    parked: mpsc::UnboundedReceiver<Received>,
    /// Its share of the machine while it lives (see [`CPU_SHARE`]).
    _share: Share,
}

impl Deref for World {
    type Target = Sandbox;
    fn deref(&self) -> &Sandbox {
        &self.sandbox
    }
}

impl DerefMut for World {
    fn deref_mut(&mut self) -> &mut Sandbox {
        &mut self.sandbox
    }
}

/// Options for a world.
pub struct Setup<'a> {
    pub test: &'a str,
    pub ladder: &'a str,
    pub margin: Duration,
    /// Extra routes (ingress, target), for example a route to a missing target.
    pub extra_routes: Vec<(String, String)>,
    pub start_bridge: bool,
    pub prefetch: u32,
    /// `classic` or `quorum`.
    pub queue_type: &'a str,
    /// `delays.max_delay`.
    pub max_delay: Duration,
    /// `cancel.grace`.
    pub cancel_grace: Duration,
    /// `bridge.target_full_timeout`, when not the default.
    pub target_full_timeout: Option<Duration>,
    /// `bridge.redelivery_limit`, when not the default.
    pub redelivery_limit: Option<u32>,
    /// `bridge.max_unacked_bytes`, when not the default.
    pub max_unacked_bytes: Option<u64>,
    /// `[management]`, when set.
    pub management: RawManagement,
    /// False: nothing consumes the parked queue (the test reads it itself).
    pub watch_parked: bool,
    /// `bridge.hop_window`: `0s` unless set (so the ladder runs as given, without bundles);
    /// `None` is the product's default (100 ms, bundled).
    pub hop_window: Option<Duration>,
    /// `bridge.bundle_hops`, when not the default.
    pub bundle_hops: Option<bool>,
    /// The test's verdict is a time or an order under load: no other world of its binary
    /// runs meanwhile (see [`CPU_SHARE`]).
    pub alone: bool,
}

impl<'a> Setup<'a> {
    pub fn new(test: &'a str) -> Self {
        Self {
            test,
            ladder: "100ms 200ms 400ms 800ms",
            margin: Duration::from_millis(30),
            extra_routes: Vec::new(),
            start_bridge: true,
            prefetch: 4000,
            queue_type: "classic",
            max_delay: Duration::from_secs(31622400),
            cancel_grace: Duration::from_secs(86400),
            target_full_timeout: None,
            redelivery_limit: None,
            max_unacked_bytes: None,
            management: RawManagement::default(),
            watch_parked: true,
            hop_window: Some(Duration::ZERO),
            bundle_hops: None,
            alone: false,
        }
    }

    /// The bridge's configuration for these options (the sandbox sets prefix and routes).
    fn config(&self) -> Config {
        // The sandbox replaces the prefix and the route.
        let route = [("unused.in".to_string(), "unused.out".to_string())];
        let mut raw = raw_config("unused", self.ladder, self.margin, &route, self.prefetch);
        raw.topology.queue_type = Some(self.queue_type.into());
        raw.delays.max_delay = Some(self.max_delay);
        raw.cancel.grace = Some(self.cancel_grace);
        raw.bridge.target_full_timeout = self.target_full_timeout;
        raw.bridge.redelivery_limit = self.redelivery_limit;
        raw.bridge.max_unacked_bytes = self.max_unacked_bytes;
        raw.bridge.hop_window = self.hop_window;
        raw.bridge.bundle_hops = self.bundle_hops;
        raw.management = self.management.clone();
        raw.validate().expect("test config is valid")
    }
}

/// The configuration of a test's bridge, as the file would hold it (typed by section; the
/// validated `Config` comes from `RawConfig::validate`).
pub fn raw_config(
    prefix: &str,
    ladder: &str,
    margin: Duration,
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
            margin: Some(margin),
            max_delay: None,
        },
        bridge: RawBridge {
            prefetch: Some(prefetch),
            shutdown_timeout: Some(Duration::from_secs(5)),
            // The ladder as given: hops at once, no bundles (tests of bundles set a window).
            hop_window: Some(Duration::ZERO),
            ..RawBridge::default()
        },
        cancel: RawCancel::default(),
        management: RawManagement::default(),
        metrics: RawMetrics::default(),
        log: RawLog::default(),
        tls: Default::default(),
        routes: routes
            .iter()
            .map(|(ingress, target)| RawRoute {
                ingress: Some(ingress.clone()),
                target: Some(target.clone()),
                ingress_type: None,
            })
            .collect(),
    }
}

impl World {
    /// A world with the default setup whose bridge the test starts itself (in process or
    /// as a child process).
    pub async fn without_bridge(test: &str) -> World {
        World::start(Setup {
            start_bridge: false,
            ..Setup::new(test)
        })
        .await
    }

    pub async fn start(setup: Setup<'_>) -> World {
        let share = Share::take(setup.alone).await;
        let mut sandbox = Sandbox::declare(
            &setup.config(),
            &format!("test-{}", setup.test),
            TargetBinding::Topic("rk.#".into()),
        )
        .await
        .expect("the test's topology is declared");
        for (ingress, target) in &setup.extra_routes {
            let route = Route::new(ingress.clone(), target.clone());
            sandbox.add_route(route).await.expect("route added");
        }
        let received = delay_bridge::sandbox::watch_queue(&sandbox.conn, &sandbox.target_queue)
            .await
            .expect("target watched");
        let parked = if setup.watch_parked {
            delay_bridge::sandbox::watch_queue(&sandbox.conn, &sandbox.config.names.parked_queue())
                .await
                .expect("parked queue watched")
        } else {
            mpsc::unbounded_channel().1
        };
        let publisher = sandbox.channel().await.unwrap();
        publisher
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        let mut world = World {
            sandbox,
            publisher,
            received,
            parked,
            _share: share,
        };
        if setup.start_bridge {
            world.start_bridge().await;
        }
        world
    }

    /// Starts the bridge in process and waits until it consumes.
    pub async fn start_bridge(&mut self) {
        self.sandbox
            .run_in_process()
            .await
            .expect("the bridge starts");
    }

    /// Starts one more bridge instance in process on this world's config (the caller stops
    /// it) and waits until it is ready.
    pub async fn spawn_bridge(&self) -> InProcessBridge {
        InProcessBridge::start(self.config.clone())
            .await
            .expect("a second bridge starts")
    }

    /// A typed client for this world's bridge.
    pub async fn client(&self) -> delay_bridge::client::Client {
        delay_bridge::client::Client::connect(&broker_url(), self.prefix())
            .await
            .expect("client connects")
    }

    /// Messages ready in a queue now.
    pub async fn queue_depth(&self, queue: &str) -> u64 {
        self.counts(queue).await.expect("the queue exists").messages
    }

    /// Messages in the work and returns queues and every level queue (ready; the bridge's
    /// unacked ones are not counted).
    pub async fn pending_in_queues(&self) -> u64 {
        let mut queues = self.level_queues();
        queues.push(self.config.names.work_queue());
        queues.push(self.config.names.returns_queue());
        self.ready_in(&queues).await.expect("the queues exist")
    }

    /// The in-process bridge's counters.
    pub fn stats(&self) -> Arc<Stats> {
        self.sandbox.stats().expect("bridge running")
    }

    /// Stops the in-process bridge and waits for it to drain.
    pub async fn stop_bridge(&mut self) {
        tokio::time::timeout(Duration::from_secs(20), self.sandbox.stop_bridge())
            .await
            .expect("bridge stops within 20s")
            .expect("the bridge stopped cleanly");
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
            &self.sandbox.ingress,
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
            Some(m) = self.parked.recv() => panic!("unexpected parked message: {m:?}"),
            _ = tokio::time::sleep(quiet) => {}
        }
    }

    /// Declares an extra exchange the cleanup deletes.
    pub async fn declare_extra_exchange(&mut self, name: &str, kind: lapin::ExchangeKind) {
        self.sandbox
            .declare_extra_exchange(name, kind)
            .await
            .expect("exchange declared");
    }

    /// Declares a queue bound to `exchange` with `key`, deleted with the world.
    pub async fn declare_bound_queue(&mut self, queue: &str, exchange: &str, key: &str) {
        let channel = self.sandbox.channel().await.unwrap();
        declare_queue(&channel, queue).await;
        channel
            .queue_bind(
                queue.into(),
                exchange.into(),
                key.into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        let _ = channel.close(200, "declared".into()).await;
        self.adopt_queue(queue);
    }

    /// Stops the bridge and deletes everything this test declared.
    pub async fn cleanup(self) {
        self.sandbox.finish().await.expect("the test cleans up");
    }

    /// A new channel on the world's connection in publisher-confirm mode (for
    /// [`publish_to`] from a task of the test's own).
    pub async fn confirm_channel(&self) -> Channel {
        let channel = self.sandbox.channel().await.expect("a channel");
        channel
            .confirm_select(lapin::options::ConfirmSelectOptions::default())
            .await
            .expect("confirm mode");
        channel
    }

    /// This world's config with another prefetch, written for a child process.
    pub fn config_file(&self, prefetch: u32) -> ConfigFile {
        self.config_file_with(|config| {
            config.prefetch = u16::try_from(prefetch).expect("prefetch fits");
        })
    }

    /// This world's config, changed by `change`, written for a child process.
    pub fn config_file_with(&self, change: impl FnOnce(&mut Config)) -> ConfigFile {
        let mut config = self.config.clone();
        change(&mut config);
        ConfigFile::write(&config).expect("config file written")
    }
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
    delay_bridge::sandbox::watch_queue(conn, queue)
        .await
        .expect("queue watched")
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

/// The number a test gave a message as its `message_id`.
pub fn numeric_id(m: &Received) -> usize {
    m.properties
        .message_id()
        .as_ref()
        .expect("message id")
        .as_str()
        .parse()
        .expect("numeric id")
}

/// Waits until `condition` holds, checking every 5 ms, panicking with `what` at the deadline.
pub async fn wait_until(what: &str, within: Duration, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !condition() {
        assert!(Instant::now() < deadline, "not within {within:?}: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
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

/// The `delay-bridge` executable Cargo built for these tests: its own when the tests are
/// the daemon's, else (the bench's smoke tests, another package of the workspace) the one
/// the workspace built into the same target directory, beside `deps/`.
pub fn bridge_exe() -> PathBuf {
    match option_env!("CARGO_BIN_EXE_delay-bridge") {
        Some(exe) => PathBuf::from(exe),
        None => {
            let test = std::env::current_exe().expect("the test executable's path");
            let profile_dir = test
                .parent()
                .and_then(Path::parent)
                .expect("a test executable in <target>/<profile>/deps");
            profile_dir.join(format!("delay-bridge{}", std::env::consts::EXE_SUFFIX))
        }
    }
}

/// Runs `delay-bridge <args>` to its end on `config` (the broker URL in its environment):
/// whether it succeeded, and its stdout. Its stderr goes to the test's output.
pub async fn run_command(config: &ConfigFile, args: &[&str]) -> (bool, String) {
    let output = config
        .command(&bridge_exe())
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .output()
        .await
        .expect("delay-bridge runs");
    eprint!(
        "delay-bridge {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let stdout = String::from_utf8(output.stdout).expect("UTF-8 output");
    (output.status.success(), stdout)
}

/// Starts `delay-bridge run` on `config`, warnings only, to the test's stderr.
pub fn spawn_process(config: &ConfigFile) -> BridgeProcess {
    BridgeProcess::spawn(&bridge_exe(), config, &ProcessLog::warnings())
        .expect("spawn delay-bridge")
}

/// As `spawn_process`, with `RUST_LOG` = `rust_log` (`None`: unset, the binary's default
/// level) and stderr written to the file `log`.
pub fn spawn_logging(config: &ConfigFile, rust_log: Option<&str>, log: &Path) -> BridgeProcess {
    let log = ProcessLog {
        rust_log: rust_log.map(Into::into),
        stderr: Some(PathBuf::from(log)),
    };
    BridgeProcess::spawn(&bridge_exe(), config, &log).expect("spawn delay-bridge")
}

/// Waits until the work queue has `n` consumers.
pub async fn wait_for_consumers(world: &World, n: u64, within: Duration) {
    world
        .sandbox
        .wait_for_consumers(n, within)
        .await
        .expect("consumers there");
}

/// A test whose verdict is a time or an order under load runs with no other world in its
/// binary (the write side, [`Setup::alone`]); every other world holds a read side, and may
/// run beside the others. On two cores a 14 000-entry history read beside a burst-order
/// test decided that test (2026-11-29: runs of 926 and 1 049 burst messages where 666 pass,
/// twice), and with four tests at a time a multi-hop delivery due in 1 s came 197 ms late
/// on 4.3.6 (2026-11-29); each passes alone. No test holds two worlds at once: a second
/// read side asked for while a timing test waits would wait behind it for good.
static CPU_SHARE: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

/// A world's share of the machine (see [`CPU_SHARE`]), held until the world is dropped.
enum Share {
    /// Beside other tests.
    Beside(#[allow(dead_code)] tokio::sync::RwLockReadGuard<'static, ()>),
    /// With no other world running.
    Alone(#[allow(dead_code)] tokio::sync::RwLockWriteGuard<'static, ()>),
}

impl Share {
    /// Waits for the share `alone` asks for.
    async fn take(alone: bool) -> Share {
        if alone {
            Share::Alone(CPU_SHARE.write().await)
        } else {
            Share::Beside(CPU_SHARE.read().await)
        }
    }
}

/// `rabbitmqctl` for the test broker: `DELAY_BRIDGE_TEST_CTL` (a command and its leading
/// arguments, for example `bash /abs/path/scripts/debian-broker.sh trixie ctl`: absolute, since
/// each package's tests run in its own directory), or plain `rabbitmqctl`.
pub fn rabbitmqctl() -> std::process::Command {
    let line = std::env::var("DELAY_BRIDGE_TEST_CTL").unwrap_or_else(|_| "rabbitmqctl".into());
    let mut parts = line.split_whitespace();
    let mut command = std::process::Command::new(parts.next().expect("a command"));
    command.args(parts);
    command
}

/// A broker user of the test's own with `permissions` (configure, write, read) on `/`,
/// removed when dropped.
pub struct TestUser {
    name: String,
}

impl TestUser {
    pub fn create(name: &str, password: &str, permissions: [&str; 3]) -> TestUser {
        let [configure, write, read] = permissions;
        for args in [
            vec!["add_user", name, password],
            vec!["set_permissions", "-p", "/", name, configure, write, read],
        ] {
            let out = rabbitmqctl()
                .args(&args)
                .output()
                .expect("rabbitmqctl runs");
            assert!(out.status.success(), "rabbitmqctl {args:?}: {out:?}");
        }
        TestUser { name: name.into() }
    }

    /// The test broker's URL with this user's name and `password` in place of guest's.
    pub fn url(&self, password: &str) -> String {
        let url = broker_url();
        let with_user = url.replacen("guest:guest@", &format!("{}:{password}@", self.name), 1);
        assert_ne!(url, with_user, "the test broker URL has guest:guest");
        with_user
    }
}

impl Drop for TestUser {
    fn drop(&mut self) {
        let _ = rabbitmqctl().args(["delete_user", &self.name]).output();
    }
}

/// Makes the broker close every connection whose client-provided name contains `name`
/// (needs `rabbitmqctl` and the broker's Erlang cookie, i.e. root on a local broker).
/// Returns how many it closed.
pub fn close_connections_named(name: &str) -> usize {
    close_connections_where(|properties| properties.contains(name))
}

/// As [`close_connections_named`], for the connections named exactly `name`.
pub fn close_connections_named_exactly(name: &str) -> usize {
    // rabbitmqctl prints the property as `{"connection_name","<name>"}`.
    let quoted = format!("\"{name}\"}}");
    close_connections_where(|properties| properties.contains(&quoted))
}

/// The broker's connections, one line each: its pid, then its client properties (where
/// rabbitmqctl prints the name as `{"connection_name","<name>"}`).
pub fn listed_connections() -> String {
    let out = rabbitmqctl()
        .args([
            "list_connections",
            "-q",
            "--no-table-headers",
            "pid",
            "client_properties",
        ])
        .output()
        .expect("rabbitmqctl lists the connections");
    assert!(
        out.status.success(),
        "rabbitmqctl list_connections: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn close_connections_where(matches: impl Fn(&str) -> bool) -> usize {
    let mut closed = 0;
    for line in listed_connections().lines() {
        if !matches(line) {
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

/// Properties of every kind and a header of every field type lapin writes (but the
/// deprecated short string), nested in a table and an array as well.
pub fn every_property() -> lapin::BasicProperties {
    use lapin::types::{AMQPValue, ByteArray, DecimalValue, FieldArray};
    let values = vec![
        ("bool", AMQPValue::Boolean(true)),
        ("i8", AMQPValue::ShortShortInt(-8)),
        ("u8", AMQPValue::ShortShortUInt(200)),
        ("i16", AMQPValue::ShortInt(-16_000)),
        ("u16", AMQPValue::ShortUInt(65_000)),
        ("i32", AMQPValue::LongInt(-2_000_000_000)),
        ("u32", AMQPValue::LongUInt(4_000_000_000)),
        ("i64", AMQPValue::LongLongInt(-9_000_000_000_000)),
        ("f32", AMQPValue::Float(0.25)),
        ("f64", AMQPValue::Double(1.0 / 3.0)),
        (
            "decimal",
            AMQPValue::DecimalValue(DecimalValue {
                scale: 2,
                value: 12_345,
            }),
        ),
        ("text", AMQPValue::LongString("héllo, wörld".into())),
        ("timestamp", AMQPValue::Timestamp(1_700_000_000)),
        (
            "bytes",
            AMQPValue::ByteArray(ByteArray::from(vec![0u8, 1, 254, 255])),
        ),
        ("void", AMQPValue::Void),
    ];
    let nested = headers(values.clone());
    let array = FieldArray::from(values.iter().map(|(_, v)| v.clone()).collect::<Vec<_>>());
    let mut every_type = headers(values);
    every_type.insert("table".into(), AMQPValue::FieldTable(nested));
    every_type.insert("array".into(), AMQPValue::FieldArray(array));
    lapin::BasicProperties::default()
        .with_content_type("application/json".into())
        .with_content_encoding("gzip".into())
        .with_headers(every_type)
        .with_delivery_mode(2)
        .with_priority(7)
        .with_correlation_id("corr".into())
        .with_reply_to("reply".into())
        .with_expiration("600000".into())
        .with_message_id("id-1".into())
        .with_timestamp(1_700_000_001)
        .with_type("kind".into())
        .with_user_id("guest".into())
        .with_app_id("app".into())
        .with_cluster_id("cluster".into())
}

/// The management API of the test broker: `DELAY_BRIDGE_TEST_MANAGEMENT_URL`, or the local
/// default (scripts/broker.sh enables the plugin).
pub fn management_url() -> String {
    std::env::var("DELAY_BRIDGE_TEST_MANAGEMENT_URL")
        .unwrap_or_else(|_| "http://127.0.0.1:15672".to_string())
}

/// GETs the management API's `segments` (each percent-encoded as one path segment) as
/// JSON, as guest.
pub async fn management_get(segments: &[&str]) -> serde_json::Value {
    let mut url = reqwest::Url::parse(&management_url()).expect("a management URL");
    url.path_segments_mut()
        .expect("a base URL")
        .push("api")
        .extend(segments);
    reqwest::Client::new()
        .get(url.clone())
        .basic_auth("guest", Some("guest"))
        .timeout(Duration::from_secs(10))
        .send()
        .await
        .and_then(reqwest::Response::error_for_status)
        .unwrap_or_else(|e| {
            panic!("the management API answers {url} (scripts/broker.sh enables it): {e}")
        })
        .json()
        .await
        .expect("the management API answers JSON")
}

/// For each channel of the connections whose client-provided name is `connection_name`:
/// how many messages it published, as the management API last sampled its statistics
/// (every 5 s by default), largest first; channels that published none left out.
pub async fn published_per_channel(connection_name: &str) -> Vec<u64> {
    let connections = management_get(&["connections"]).await;
    let mut counts = Vec::new();
    for connection in connections.as_array().into_iter().flatten() {
        if connection["client_properties"]["connection_name"] != connection_name {
            continue;
        }
        let name = connection["name"].as_str().expect("a connection's name");
        let channels = management_get(&["connections", name, "channels"]).await;
        counts.extend(
            channels
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|channel| channel["message_stats"]["publish"].as_u64())
                .filter(|published| *published > 0),
        );
    }
    counts.sort_unstable_by(|a, b| b.cmp(a));
    counts
}
