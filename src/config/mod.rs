//! Configuration: raw serde structs from TOML (`raw.rs`), checked into a validated
//! [`Config`] (`validate.rs`); broker and management URLs, redacted when shown (`urls.rs`).
//!
//! Unknown keys are refused; every error names the key and the bad value. Environment
//! overrides (`DELAY_BRIDGE_URL`, `DELAY_BRIDGE_PREFIX`) are applied before validation.
//! Passwords never leave this module unredacted through `Display`/`Debug` of [`BrokerUrl`].

use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use thiserror::Error;

use crate::contract::signature::{MIN_KEY_BYTES, StateKeys};
use crate::ladder::{Ladder, LadderError, format_duration};
use crate::naming::Names;

mod raw;
#[cfg(test)]
mod tests;
mod urls;
mod validate;

pub use raw::*;
pub use urls::{BrokerUrl, ManagementUrl, TlsFiles, redact_url};
pub use validate::levels;

/// Environment variable that overrides `broker.url` / `broker.urls`: one URL, or several
/// separated by white space.
pub const ENV_URL: &str = "DELAY_BRIDGE_URL";
/// Environment variable that overrides `topology.prefix`.
pub const ENV_PREFIX: &str = "DELAY_BRIDGE_PREFIX";
/// Environment variable that overrides `metrics.listen` (turning the listener on).
pub const ENV_METRICS_LISTEN: &str = "DELAY_BRIDGE_METRICS_LISTEN";
/// Environment variable that overrides `log.format`.
pub const ENV_LOG_FORMAT: &str = "DELAY_BRIDGE_LOG_FORMAT";
/// The key the bridge state is signed with (wins over `bridge.state_key_file`).
pub const ENV_STATE_KEY: &str = "DELAY_BRIDGE_STATE_KEY";
/// The previous key, still accepted (wins over `bridge.state_key_previous_file`).
pub const ENV_STATE_KEY_PREVIOUS: &str = "DELAY_BRIDGE_STATE_KEY_PREVIOUS";

/// The default broker URL.
pub const DEFAULT_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// Why a configuration was refused.
#[derive(Debug, Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Read {
        /// The path tried.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The TOML is malformed or has unknown keys or wrong types.
    #[error("{path}: {message}")]
    Parse {
        /// The path (or `<text>`).
        path: String,
        /// The TOML parser's message, which names the key and position.
        message: String,
    },
    /// A key holds a value that is not acceptable.
    #[error("`{key}` = {value:?}: {reason}")]
    Invalid {
        /// The dotted key, for example `delays.margin`.
        key: String,
        /// The value as given (passwords redacted).
        value: String,
        /// What is wrong and what would be right.
        reason: String,
    },
    /// The ladder is invalid.
    #[error("`delays.ladder`: {0}")]
    Ladder(#[from] LadderError),
}

fn invalid(key: &str, value: impl fmt::Display, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.to_string(),
        value: value.to_string(),
        reason: reason.into(),
    }
}

/// How `delay-bridge` writes its log lines (`log.format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    /// Plain text, coloured only on a terminal.
    #[default]
    Text,
    /// One JSON object per line, for log shippers.
    Json,
}

impl fmt::Display for LogFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LogFormat::Text => "text",
            LogFormat::Json => "json",
        })
    }
}

impl std::str::FromStr for LogFormat {
    type Err = ConfigError;

    fn from_str(text: &str) -> Result<Self, ConfigError> {
        match text {
            "text" => Ok(LogFormat::Text),
            "json" => Ok(LogFormat::Json),
            other => Err(invalid("log.format", other, "must be \"text\" or \"json\"")),
        }
    }
}

/// Where a route takes messages: publishers publish to `ingress`, the bridge delivers to
/// `target` (the allow-list of exchanges the bridge publishes to on a publisher's behalf).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    /// The exchange publishers send delayed messages to (declared by the bridge, of
    /// `ingress_kind`).
    pub ingress: String,
    /// The exchange due messages are published to, with their original routing key.
    pub target: String,
    /// The ingress exchange's type.
    pub ingress_kind: IngressKind,
}

impl Route {
    /// A route from a fanout `ingress` to `target`.
    pub fn new(ingress: impl Into<String>, target: impl Into<String>) -> Self {
        Self {
            ingress: ingress.into(),
            target: target.into(),
            ingress_kind: IngressKind::Fanout,
        }
    }
}

/// The type of a route's ingress exchange (`route.ingress_type`). The work queue is bound
/// to it with the empty routing key and no arguments, which either type routes every
/// message by.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum IngressKind {
    /// A fanout exchange (the default).
    #[default]
    Fanout,
    /// A headers exchange: other bindings on it can take only the messages that carry
    /// given headers, or (by routing key) what the delayed-message plugin still holds for an
    /// exchange of that name (docs/moving-off-the-plugin.md).
    Headers,
}

impl IngressKind {
    /// The name the config and RabbitMQ use.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Fanout => "fanout",
            Self::Headers => "headers",
        }
    }
}

/// Classic or quorum level and work queues.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueType {
    /// Classic queues (lazy on brokers before 3.12): one node.
    Classic,
    /// Quorum queues: replicated, for clusters.
    Quorum,
}

impl fmt::Display for QueueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            QueueType::Classic => "classic",
            QueueType::Quorum => "quorum",
        })
    }
}

/// The HTTP listener for Prometheus metrics and health (`[metrics]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetricsConfig {
    /// Where `/metrics`, `/healthz` and `/readyz` are served.
    pub listen: SocketAddr,
    /// How often the bridge reads its queues' depths (one passive declare per queue) for
    /// the pending gauges.
    pub interval: Duration,
}

/// The management API, read to see what AMQP does not show (levels whose expired messages
/// are not forwarded).
#[derive(Debug, Clone, PartialEq)]
pub struct ManagementConfig {
    /// Nodes to ask, in order: any node answers for the whole cluster.
    pub urls: Vec<ManagementUrl>,
    /// How often the bridge reads the figures.
    pub interval: Duration,
    /// How long a level may hold expired messages its dead-letter worker has not forwarded
    /// before the bridge warns.
    pub stuck_after: Duration,
}

/// A validated configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Every broker, in the order they are tried: on connection loss the bridge moves to the
    /// next one (the nodes of a cluster). Never empty.
    pub urls: Vec<BrokerUrl>,
    /// The names of the bridge's exchanges and queues.
    pub names: Names,
    /// Classic or quorum queues.
    pub queue_type: QueueType,
    /// The delay levels.
    pub ladder: Ladder,
    /// How much before the due time the last hop lands; the rest is held in process.
    pub margin: Duration,
    /// The longest delay accepted.
    pub max_delay: Duration,
    /// How many unacknowledged deliveries the bridge holds at once, for each of the two
    /// queues it consumes (work and returns).
    pub prefetch: u16,
    /// Worker threads of the async runtime that `delay-bridge run` builds (the AMQP client
    /// adds one I/O thread per connection). A library caller runs the bridge on its own
    /// runtime and ignores this.
    pub worker_threads: usize,
    /// How long shutdown waits for in-flight publishes to be confirmed.
    pub shutdown_timeout: Duration,
    /// How long the bridge waits for the broker to confirm one publish before it gives up
    /// on that channel and lets the message be redelivered.
    pub confirm_timeout: Duration,
    /// How long a target may refuse (nack) a message before it is parked `target-full`.
    pub target_full_timeout: Duration,
    /// Hops wait for the next multiple of this on the wall clock, so that the hops of a
    /// window reach each level together and expire together: the broker then handles them
    /// in batches (zero: hop at once). Deliveries never wait for it.
    pub hop_window: Duration,
    /// The hops of one `hop_window` into the same level travel as one message (a bundle):
    /// the broker stores, expires, dead-letters, delivers and acks one message for them.
    pub bundle_hops: bool,
    /// A work-queue delivery redelivered this many times without being settled is parked
    /// `redelivery-limit` (counted by quorum queues, and by the bridge process itself).
    pub redelivery_limit: u32,
    /// The most body bytes of unacknowledged deliveries the bridge holds (a bundle also
    /// counts 1 KiB for each message it carries), half for each queue it consumes: past a
    /// queue's half, it stops consuming that queue until half of the half is settled
    /// (besides `prefetch`, which counts messages).
    pub max_unacked_bytes: u64,
    /// The keys the bridge state is signed and checked with (`bridge.state_key_file` or
    /// `DELAY_BRIDGE_STATE_KEY`, and the previous ones); `None`: not signed nor checked.
    pub state_keys: Option<StateKeys>,
    /// Where the keys were read from (printed instead of the keys).
    pub state_key_files: (Option<PathBuf>, Option<PathBuf>),
    /// Copies with no signature are accepted (`bridge.accept_unsigned_state`), else parked
    /// `bad-state` when `state_keys` is set.
    pub accept_unsigned_state: bool,
    /// How long past the latest due time of the copies it covers a tombstone is kept (a
    /// bridge backlog or outage can deliver a copy late).
    pub cancel_grace: Duration,
    /// The management API to read, when set (`[management]`).
    pub management: Option<ManagementConfig>,
    /// The metrics and health listener, when set (`[metrics]`).
    pub metrics: Option<MetricsConfig>,
    /// How the command writes its log (`log.format`).
    pub log_format: LogFormat,
    /// Ingress → target routes.
    pub routes: Vec<Route>,
}

/// Defaults, as documented in `config/delay-bridge.toml`.
pub mod defaults {
    use std::time::Duration;

    /// `topology.prefix`
    pub const PREFIX: &str = "delay-bridge";
    /// `topology.queue_type`
    pub const QUEUE_TYPE: &str = "classic";
    /// `delays.ladder`
    pub const LADDER: &str = "default";
    /// `delays.margin`
    pub const MARGIN: Duration = Duration::from_millis(250);
    /// `delays.max_delay`
    pub const MAX_DELAY: Duration = Duration::from_secs(366 * DAY);
    /// `bridge.prefetch`
    pub const PREFETCH: u32 = 4000;
    /// `bridge.worker_threads`
    pub const WORKER_THREADS: u32 = 2;
    /// The most `bridge.worker_threads` accepted.
    pub const MAX_WORKER_THREADS: u32 = 64;
    /// `bridge.shutdown_timeout`
    pub const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(10);
    /// `bridge.confirm_timeout`
    pub const CONFIRM_TIMEOUT: Duration = Duration::from_secs(30);
    /// `bridge.target_full_timeout`
    pub const TARGET_FULL_TIMEOUT: Duration = Duration::from_secs(5 * 60);
    /// `bridge.redelivery_limit`
    pub const REDELIVERY_LIMIT: u32 = 40;
    /// `bridge.hop_window`
    pub const HOP_WINDOW: Duration = Duration::from_millis(100);
    /// `bridge.hop_window` may be at most this: a hop waiting for its window holds its
    /// delivery unacked.
    pub const MAX_HOP_WINDOW: Duration = Duration::from_secs(1);
    /// `bridge.bundle_hops`, when `bridge.hop_window` is above 0s (with a window of 0s,
    /// nothing is bundled unless asked, which is refused).
    pub const BUNDLE_HOPS: bool = true;
    /// `bridge.redelivery_limit` must stay below the quorum work queue's own
    /// `x-delivery-limit` (50), which dead-letters without a reason.
    pub const MAX_REDELIVERY_LIMIT: u32 = 49;
    /// `bridge.max_unacked_bytes` (256 MiB)
    pub const MAX_UNACKED_BYTES: u64 = 256 << 20;
    /// `cancel.grace`
    pub const CANCEL_GRACE: Duration = Duration::from_secs(DAY);
    /// `management.interval`
    pub const MANAGEMENT_INTERVAL: Duration = Duration::from_secs(5);
    /// `management.stuck_after`
    pub const STUCK_AFTER: Duration = Duration::from_secs(15);
    /// `metrics.interval`
    pub const METRICS_INTERVAL: Duration = Duration::from_secs(5);

    /// Seconds in a day.
    const DAY: u64 = 86_400;
}

impl Config {
    /// How long a tombstone must be kept (in memory and in the cancel stream): a copy it
    /// covers entered at or before the cancel, so it is due at most `max_delay` after it,
    /// and `cancel_grace` covers a late delivery.
    pub fn tombstone_keep(&self) -> Duration {
        self.max_delay + self.cancel_grace
    }

    /// Reads, applies environment overrides, and validates a TOML file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_toml(&text, &path.display().to_string(), &env_overrides())
    }

    /// Parses and validates TOML text, with overrides given as (variable, value) pairs.
    pub fn from_toml(
        text: &str,
        origin: &str,
        overrides: &[(&str, String)],
    ) -> Result<Self, ConfigError> {
        let mut raw: RawConfig = toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: origin.to_string(),
            message: e.to_string().trim_end().to_string(),
        })?;
        for (var, value) in overrides {
            match *var {
                ENV_URL => {
                    // One URL, or several separated by white space (the nodes of a cluster).
                    raw.broker.url = None;
                    raw.broker.urls = Some(value.split_whitespace().map(str::to_string).collect());
                }
                ENV_PREFIX => raw.topology.prefix = Some(value.clone()),
                ENV_LOG_FORMAT => raw.log.format = Some(value.trim().to_string()),
                ENV_STATE_KEY => raw.bridge.state_key = Some(value.clone()),
                ENV_STATE_KEY_PREVIOUS => raw.bridge.state_key_previous = Some(value.clone()),
                ENV_METRICS_LISTEN => {
                    raw.metrics.listen = Some(value.trim().parse().map_err(|_| {
                        invalid(
                            ENV_METRICS_LISTEN,
                            value,
                            "not an address and port, for example 0.0.0.0:9090",
                        )
                    })?);
                }
                _ => {}
            }
        }
        raw.validate()
    }
}

/// The overrides present in the process environment.
pub fn env_overrides() -> Vec<(&'static str, String)> {
    [
        ENV_URL,
        ENV_PREFIX,
        ENV_METRICS_LISTEN,
        ENV_LOG_FORMAT,
        ENV_STATE_KEY,
        ENV_STATE_KEY_PREVIOUS,
    ]
    .into_iter()
    .filter_map(|var| std::env::var(var).ok().map(|v| (var, v)))
    .collect()
}

impl Config {
    /// The broker tried first.
    pub fn url(&self) -> &BrokerUrl {
        &self.urls[0]
    }

    /// The configuration as it would be written, every key explicit, the password redacted.
    pub fn to_raw(&self) -> RawConfig {
        RawConfig {
            broker: if self.urls.len() > 1 {
                RawBroker {
                    url: None,
                    urls: Some(self.urls.iter().map(|u| u.to_string()).collect()),
                }
            } else {
                RawBroker {
                    url: Some(self.url().to_string()),
                    urls: None,
                }
            },
            topology: RawTopology {
                prefix: Some(self.names.prefix().to_string()),
                queue_type: Some(self.queue_type.to_string()),
            },
            delays: RawDelays {
                ladder: Some(self.ladder.to_string()),
                margin: Some(self.margin),
                max_delay: Some(self.max_delay),
            },
            bridge: RawBridge {
                prefetch: Some(u32::from(self.prefetch)),
                worker_threads: Some(self.worker_threads as u32),
                shutdown_timeout: Some(self.shutdown_timeout),
                confirm_timeout: Some(self.confirm_timeout),
                target_full_timeout: Some(self.target_full_timeout),
                redelivery_limit: Some(self.redelivery_limit),
                hop_window: Some(self.hop_window),
                bundle_hops: Some(self.bundle_hops),
                max_unacked_bytes: Some(self.max_unacked_bytes),
                state_key_file: self.state_key_files.0.clone(),
                state_key_previous_file: self.state_key_files.1.clone(),
                accept_unsigned_state: self
                    .state_keys
                    .is_some()
                    .then_some(self.accept_unsigned_state),
                state_key: None,
                state_key_previous: None,
            },
            cancel: RawCancel {
                grace: Some(self.cancel_grace),
            },
            management: self
                .management
                .as_ref()
                .map(|m| RawManagement {
                    url: None,
                    urls: Some(m.urls.iter().map(|u| u.to_string()).collect()),
                    interval: Some(m.interval),
                    stuck_after: Some(m.stuck_after),
                })
                .unwrap_or_default(),
            metrics: self
                .metrics
                .map(|m| RawMetrics {
                    listen: Some(m.listen),
                    interval: Some(m.interval),
                })
                .unwrap_or_default(),
            log: RawLog {
                format: Some(self.log_format.to_string()),
            },
            tls: self
                .url()
                .tls()
                .map(|tls| RawTls {
                    ca_file: tls.ca_file.clone(),
                    cert_file: tls.client.as_ref().map(|(cert, _)| cert.clone()),
                    key_file: tls.client.as_ref().map(|(_, key)| key.clone()),
                    server_name: tls.server_name.clone(),
                })
                .unwrap_or_default(),
            routes: self
                .routes
                .iter()
                .map(|r| RawRoute {
                    ingress: Some(r.ingress.clone()),
                    target: Some(r.target.clone()),
                    ingress_type: (r.ingress_kind != IngressKind::Fanout)
                        .then(|| r.ingress_kind.as_str().to_string()),
                })
                .collect(),
        }
    }
}

impl fmt::Display for Config {
    /// The effective configuration as TOML, password redacted.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = toml::to_string(&self.to_raw()).map_err(|_| fmt::Error)?;
        f.write_str(&text)
    }
}
