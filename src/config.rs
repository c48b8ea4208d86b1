//! Configuration: raw serde structs from TOML, then a validated [`Config`].
//!
//! Unknown keys are refused; every error names the key and the bad value. Environment
//! overrides (`DELAY_BRIDGE_URL`, `DELAY_BRIDGE_PREFIX`) are applied before validation.
//! Passwords never leave this module unredacted through `Display`/`Debug` of [`BrokerUrl`].

use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::contract::signature::{MIN_KEY_BYTES, StateKeys};
use crate::ladder::{Ladder, LadderError, format_duration};
use crate::naming::Names;

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

/// Durations in the file: read by humantime (`250ms`, `1m30s`, `2h`, `366d`), written in
/// the same units the ladder is printed in (`366d`, not `1year 18h`).
mod duration_text {
    use std::time::Duration;

    use serde::{Deserializer, Serializer};

    use crate::ladder::format_duration;

    pub fn serialize<S: Serializer>(value: &Option<Duration>, out: S) -> Result<S::Ok, S::Error> {
        match value {
            // Whole milliseconds print in days to milliseconds; finer ones as humantime does.
            Some(d) if d.subsec_nanos().is_multiple_of(1_000_000) => {
                out.serialize_str(&format_duration(*d))
            }
            _ => humantime_serde::serialize(value, out),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(input: D) -> Result<Option<Duration>, D::Error> {
        humantime_serde::deserialize(input)
    }
}

/// The file as written. Every section and key is optional; unknown keys are errors.
#[allow(missing_docs)]
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    #[serde(default)]
    pub broker: RawBroker,
    #[serde(default)]
    pub topology: RawTopology,
    #[serde(default)]
    pub delays: RawDelays,
    #[serde(default)]
    pub bridge: RawBridge,
    #[serde(default)]
    pub cancel: RawCancel,
    #[serde(default, skip_serializing_if = "RawManagement::is_unset")]
    pub management: RawManagement,
    #[serde(default, skip_serializing_if = "RawMetrics::is_unset")]
    pub metrics: RawMetrics,
    #[serde(default)]
    pub log: RawLog,
    #[serde(default, skip_serializing_if = "RawTls::is_unset")]
    pub tls: RawTls,
    #[serde(default, rename = "route")]
    pub routes: Vec<RawRoute>,
}

/// `[broker]`
#[allow(missing_docs)]
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawBroker {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub urls: Option<Vec<String>>,
}

/// `[management]`
#[allow(missing_docs)]
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawManagement {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub urls: Option<Vec<String>>,
    #[serde(
        default,
        with = "duration_text",
        skip_serializing_if = "Option::is_none"
    )]
    pub interval: Option<Duration>,
    #[serde(
        default,
        with = "duration_text",
        skip_serializing_if = "Option::is_none"
    )]
    pub stuck_after: Option<Duration>,
}

/// `[metrics]`
#[allow(missing_docs)]
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawMetrics {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub listen: Option<SocketAddr>,
    #[serde(
        default,
        with = "duration_text",
        skip_serializing_if = "Option::is_none"
    )]
    pub interval: Option<Duration>,
}

/// `[topology]`
#[allow(missing_docs)]
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawTopology {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefix: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub queue_type: Option<String>,
}

/// `[delays]`
#[allow(missing_docs)]
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawDelays {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ladder: Option<String>,
    #[serde(
        default,
        with = "duration_text",
        skip_serializing_if = "Option::is_none"
    )]
    pub margin: Option<Duration>,
    #[serde(
        default,
        with = "duration_text",
        skip_serializing_if = "Option::is_none"
    )]
    pub max_delay: Option<Duration>,
}

/// `[bridge]`
#[allow(missing_docs)]
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawBridge {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefetch: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub worker_threads: Option<u32>,
    #[serde(
        default,
        with = "duration_text",
        skip_serializing_if = "Option::is_none"
    )]
    pub shutdown_timeout: Option<Duration>,
    #[serde(
        default,
        with = "duration_text",
        skip_serializing_if = "Option::is_none"
    )]
    pub confirm_timeout: Option<Duration>,
    #[serde(
        default,
        with = "duration_text",
        skip_serializing_if = "Option::is_none"
    )]
    pub target_full_timeout: Option<Duration>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub redelivery_limit: Option<u32>,
    #[serde(
        default,
        with = "duration_text",
        skip_serializing_if = "Option::is_none"
    )]
    pub hop_window: Option<Duration>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bundle_hops: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_unacked_bytes: Option<u64>,
    /// A file holding the key the bridge state is signed with (`contract::signature`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub state_key_file: Option<PathBuf>,
    /// A file holding the previous key, still accepted while a new one is rolled out.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub state_key_previous_file: Option<PathBuf>,
    /// Accept copies with no signature (while a key is introduced on a running system).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub accept_unsigned_state: Option<bool>,
    /// The key itself, from `DELAY_BRIDGE_STATE_KEY` only: never read from or written to
    /// a file.
    #[serde(skip)]
    pub state_key: Option<String>,
    /// The previous key, from `DELAY_BRIDGE_STATE_KEY_PREVIOUS` only.
    #[serde(skip)]
    pub state_key_previous: Option<String>,
}

/// `[cancel]`
#[allow(missing_docs)]
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawCancel {
    #[serde(
        default,
        with = "duration_text",
        skip_serializing_if = "Option::is_none"
    )]
    pub grace: Option<Duration>,
}

/// `[tls]`
#[allow(missing_docs)]
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawTls {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cert_file: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key_file: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub server_name: Option<String>,
}

impl RawTls {
    /// True when the section sets nothing.
    fn is_unset(&self) -> bool {
        self.ca_file.is_none()
            && self.cert_file.is_none()
            && self.key_file.is_none()
            && self.server_name.is_none()
    }

    /// `None` when unset. A certificate needs its key and the other way round, and TLS
    /// files need `amqps://` URLs (a plain connection would ignore them).
    fn validate(self, urls: &[BrokerUrl]) -> Result<Option<TlsFiles>, ConfigError> {
        if self.is_unset() {
            return Ok(None);
        }
        let client = match (self.cert_file, self.key_file) {
            (Some(cert), Some(key)) => Some((cert, key)),
            (None, None) => None,
            _ => {
                return Err(invalid(
                    "tls",
                    "cert_file or key_file",
                    "a client certificate needs both `cert_file` and `key_file`",
                ));
            }
        };
        if let Some(plain) = urls.iter().find(|u| !u.expose().starts_with("amqps://")) {
            return Err(invalid(
                "tls",
                plain,
                "[tls] applies to amqps:// URLs; this broker URL is not one",
            ));
        }
        if let Some(name) = &self.server_name
            && (name.is_empty() || name.contains(['/', ':', '@', ' ']))
        {
            return Err(invalid(
                "tls.server_name",
                name,
                "a host name the broker's certificate carries, such as rabbit.internal",
            ));
        }
        Ok(Some(TlsFiles {
            ca_file: self.ca_file,
            client,
            server_name: self.server_name,
        }))
    }
}

/// `[log]`
#[allow(missing_docs)]
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawLog {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub format: Option<String>,
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

/// `[[route]]`
#[allow(missing_docs)]
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawRoute {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ingress: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
    /// `fanout` (the default) or `headers`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ingress_type: Option<String>,
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
    /// exchange of that name (docs/operations.md, "Moving off the delayed-message plugin").
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

/// An AMQP URL whose `Display` and `Debug` redact the password, with the TLS files an
/// `amqps://` connection to it uses (`[tls]`).
#[derive(Clone, PartialEq, Eq)]
pub struct BrokerUrl {
    text: String,
    tls: Option<TlsFiles>,
}

/// The files of `[tls]`: the CA that signed the broker's certificate and this client's own
/// certificate and key. Read at every connect, so renewed files apply at the next one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// PEM CA certificates to trust (besides the system's), when set.
    pub ca_file: Option<PathBuf>,
    /// PEM client certificate and its PEM (PKCS#8) key, for brokers that require one.
    pub client: Option<(PathBuf, PathBuf)>,
    /// The name the broker's certificate must carry, when it is not the URL's host (a
    /// load balancer's address, an IP).
    pub server_name: Option<String>,
}

impl BrokerUrl {
    /// This URL with `tls` for connecting.
    pub fn with_tls(mut self, tls: Option<TlsFiles>) -> Self {
        self.tls = tls;
        self
    }

    /// The TLS files to connect with, when `[tls]` is set.
    pub fn tls(&self) -> Option<&TlsFiles> {
        self.tls.as_ref()
    }

    /// Checks the scheme and wraps the URL.
    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        let parsed = url::Url::parse(text)
            .map_err(|e| invalid("broker.url", redact_url(text), format!("not a URL ({e})")))?;
        if !matches!(parsed.scheme(), "amqp" | "amqps") {
            return Err(invalid(
                "broker.url",
                redact_url(text),
                "the scheme must be amqp:// or amqps://",
            ));
        }
        Ok(Self {
            text: text.to_string(),
            tls: None,
        })
    }

    /// The full URL, password included: only for connecting.
    pub fn expose(&self) -> &str {
        &self.text
    }

    /// The user name in the URL (RabbitMQ's default, `guest`, when absent).
    pub fn user(&self) -> String {
        url::Url::parse(&self.text)
            .ok()
            .map(|u| u.username().to_string())
            .filter(|u| !u.is_empty())
            .map(|u| {
                url::form_urlencoded::parse(format!("u={u}").as_bytes())
                    .next()
                    .map(|(_, v)| v.into_owned())
                    .unwrap_or(u)
            })
            .unwrap_or_else(|| "guest".to_string())
    }
}

impl BrokerUrl {
    /// User, password (RabbitMQ's defaults, `guest`, when absent) and virtual host (`/`
    /// when the URL names none), decoded.
    pub fn credentials_and_vhost(&self) -> (String, String, String) {
        let parsed = url::Url::parse(&self.text).ok();
        let decode = |text: &str| {
            url::form_urlencoded::parse(format!("v={}", text.replace('+', "%2B")).as_bytes())
                .next()
                .map(|(_, v)| v.into_owned())
                .unwrap_or_else(|| text.to_string())
        };
        let password = parsed
            .as_ref()
            .and_then(|u| u.password().map(decode))
            .unwrap_or_else(|| "guest".to_string());
        let vhost = parsed
            .as_ref()
            .map(|u| u.path().trim_start_matches('/').to_string())
            .filter(|p| !p.is_empty())
            .map(|p| decode(&p))
            .unwrap_or_else(|| "/".to_string());
        (self.user(), password, vhost)
    }
}

/// The base URL of a node's management HTTP API (`http://host:15672`), whose `Display`
/// and `Debug` redact a password.
#[derive(Clone, PartialEq, Eq)]
pub struct ManagementUrl(url::Url);

impl ManagementUrl {
    /// Checks the scheme (`http` or `https`) and wraps the URL.
    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        let parsed = url::Url::parse(text).map_err(|e| {
            invalid(
                "management.url",
                redact_url(text),
                format!("not a URL ({e})"),
            )
        })?;
        if parsed.scheme() != "http" {
            return Err(invalid(
                "management.url",
                redact_url(text),
                "the scheme must be http:// (the management API's own listener, for example http://127.0.0.1:15672)",
            ));
        }
        Ok(Self(parsed))
    }

    /// The URL without its credentials.
    pub fn base(&self) -> url::Url {
        let mut base = self.0.clone();
        let _ = base.set_username("");
        let _ = base.set_password(None);
        base
    }

    /// The user and password the URL carries, if it names a user.
    pub fn credentials(&self) -> Option<(String, String)> {
        let user = self.0.username();
        (!user.is_empty()).then(|| {
            (
                user.to_string(),
                self.0.password().unwrap_or_default().to_string(),
            )
        })
    }
}

impl fmt::Display for ManagementUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&redact_url(self.0.as_str()))
    }
}

impl fmt::Debug for ManagementUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ManagementUrl({self})")
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

impl fmt::Display for BrokerUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&redact_url(&self.text))
    }
}

impl fmt::Debug for BrokerUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BrokerUrl({})", redact_url(&self.text))
    }
}

/// Replaces the password of a URL with `***` (also in text that does not parse).
pub fn redact_url(text: &str) -> String {
    if let Ok(mut parsed) = url::Url::parse(text) {
        if parsed.password().is_some() && parsed.set_password(Some("***")).is_ok() {
            return parsed.to_string();
        }
        return text.to_string();
    }
    // Unparseable: blank anything between "://user:" and "@".
    match (text.find("://"), text.rfind('@')) {
        (Some(s), Some(at)) if at > s => {
            let creds = &text[s + 3..at];
            match creds.find(':') {
                Some(colon) => format!("{}***{}", &text[..s + 3 + colon + 1], &text[at..]),
                None => text.to_string(),
            }
        }
        _ => text.to_string(),
    }
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

/// The state keys `bridge` names: each from its variable, else from its file (white space
/// around it trimmed); none without a current key.
fn state_keys(bridge: &RawBridge) -> Result<Option<StateKeys>, ConfigError> {
    let read = |from_env: &Option<String>,
                key: &'static str,
                file: &Option<PathBuf>|
     -> Result<Option<Vec<u8>>, ConfigError> {
        if let Some(value) = from_env {
            return Ok(Some(value.trim().as_bytes().to_vec()));
        }
        let Some(path) = file else {
            return Ok(None);
        };
        let bytes = std::fs::read(path)
            .map_err(|error| invalid(key, path.display(), format!("cannot be read: {error}")))?;
        Ok(Some(bytes.trim_ascii().to_vec()))
    };
    let current = read(
        &bridge.state_key,
        "bridge.state_key_file",
        &bridge.state_key_file,
    )?;
    let previous = read(
        &bridge.state_key_previous,
        "bridge.state_key_previous_file",
        &bridge.state_key_previous_file,
    )?;
    let Some(current) = current else {
        if previous.is_some() {
            return Err(invalid(
                "bridge.state_key_previous_file",
                "",
                "a previous key needs a current one (bridge.state_key_file)",
            ));
        }
        return Ok(None);
    };
    StateKeys::new(&current, previous.as_deref())
        .map(Some)
        .ok_or_else(|| {
            invalid(
                "bridge.state_key_file",
                "<redacted>",
                format!(
                    "each key must be at least {MIN_KEY_BYTES} bytes (for example the 64 hex \
                     digits of `openssl rand -hex 32`)"
                ),
            )
        })
}

/// A count between 1 and `max`, or `default` when unset; `why` explains the upper bound.
fn count_key(
    key: &str,
    value: Option<u32>,
    default: u32,
    max: u32,
    why: &str,
) -> Result<u32, ConfigError> {
    let value = value.unwrap_or(default);
    if (1..=max).contains(&value) {
        Ok(value)
    } else {
        Err(invalid(
            key,
            value,
            format!("must be between 1 and {max}{why}"),
        ))
    }
}

fn exchange_name(key: &str, value: &Option<String>) -> Result<String, ConfigError> {
    let name = value.as_deref().ok_or_else(|| {
        invalid(
            key,
            "",
            "missing; every [[route]] needs `ingress` and `target`",
        )
    })?;
    if name.is_empty() || name.len() > 255 || name.starts_with("amq.") && key.ends_with("ingress") {
        return Err(invalid(
            key,
            name,
            "an exchange name of 1 to 255 bytes (an ingress cannot be an amq.* exchange)",
        ));
    }
    Ok(name.to_string())
}

impl RawConfig {
    /// Checks every key and builds the validated config.
    pub fn validate(self) -> Result<Config, ConfigError> {
        let urls = match (self.broker.url, self.broker.urls) {
            (Some(_), Some(_)) => {
                return Err(invalid(
                    "broker",
                    "url and urls",
                    "give either `url` (one broker) or `urls` (several), not both",
                ));
            }
            (None, Some(list)) if list.is_empty() => {
                return Err(invalid("broker.urls", "[]", "name at least one broker"));
            }
            (None, Some(list)) => list
                .iter()
                .map(|u| BrokerUrl::parse(u))
                .collect::<Result<Vec<_>, _>>()?,
            (url, None) => vec![BrokerUrl::parse(url.as_deref().unwrap_or(DEFAULT_URL))?],
        };
        let prefix = self
            .topology
            .prefix
            .unwrap_or_else(|| defaults::PREFIX.to_string());
        if prefix.is_empty()
            || !prefix
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.:".contains(c))
        {
            return Err(invalid(
                "topology.prefix",
                &prefix,
                "use letters, digits and - _ . : only, at least one character",
            ));
        }
        let queue_type = match self
            .topology
            .queue_type
            .as_deref()
            .unwrap_or(defaults::QUEUE_TYPE)
        {
            "classic" => QueueType::Classic,
            "quorum" => QueueType::Quorum,
            other => {
                return Err(invalid(
                    "topology.queue_type",
                    other,
                    "must be `classic` or `quorum`",
                ));
            }
        };
        let ladder = Ladder::parse(self.delays.ladder.as_deref().unwrap_or(defaults::LADDER))?;
        let margin = self.delays.margin.unwrap_or(defaults::MARGIN);
        if margin >= Duration::from_secs(60) || !margin.subsec_nanos().is_multiple_of(1_000_000) {
            return Err(invalid(
                "delays.margin",
                format_duration(margin),
                "must be whole milliseconds below 1 minute (holds last up to the smallest level plus the margin)",
            ));
        }
        let max_delay = self.delays.max_delay.unwrap_or(defaults::MAX_DELAY);
        if max_delay < ladder.smallest() {
            return Err(invalid(
                "delays.max_delay",
                format_duration(max_delay),
                format!(
                    "must be at least the smallest level ({})",
                    format_duration(ladder.smallest())
                ),
            ));
        }
        let prefetch = self.bridge.prefetch.unwrap_or(defaults::PREFETCH);
        let prefetch = u16::try_from(prefetch)
            .ok()
            .filter(|p| *p >= 1)
            .ok_or_else(|| invalid("bridge.prefetch", prefetch, "must be between 1 and 65535"))?;
        let worker_threads = count_key(
            "bridge.worker_threads",
            self.bridge.worker_threads,
            defaults::WORKER_THREADS,
            defaults::MAX_WORKER_THREADS,
            "",
        )?;
        let shutdown_timeout = self
            .bridge
            .shutdown_timeout
            .unwrap_or(defaults::SHUTDOWN_TIMEOUT);
        let confirm_timeout = self
            .bridge
            .confirm_timeout
            .unwrap_or(defaults::CONFIRM_TIMEOUT);
        if confirm_timeout.is_zero() {
            return Err(invalid(
                "bridge.confirm_timeout",
                "0s",
                "must be longer than zero",
            ));
        }
        let target_full_timeout = self
            .bridge
            .target_full_timeout
            .unwrap_or(defaults::TARGET_FULL_TIMEOUT);
        let hop_window = self.bridge.hop_window.unwrap_or(defaults::HOP_WINDOW);
        if hop_window > defaults::MAX_HOP_WINDOW {
            return Err(invalid(
                "bridge.hop_window",
                crate::ladder::format_duration(hop_window),
                "must be at most 1s (a hop waiting for its window holds its delivery unacked)",
            ));
        }
        let state_keys = state_keys(&self.bridge)?;
        let bundle_hops = self
            .bridge
            .bundle_hops
            .unwrap_or(defaults::BUNDLE_HOPS && !hop_window.is_zero());
        if bundle_hops && hop_window.is_zero() {
            return Err(invalid(
                "bridge.bundle_hops",
                "true".to_string(),
                "needs a bridge.hop_window above 0s (the hops of one window are bundled)",
            ));
        }
        // With bundles, the hop window's fine levels below the smallest level keep the
        // messages of the last bundle due close together (see `Ladder::with_fine_levels`).
        let ladder = if bundle_hops {
            ladder.with_fine_levels(hop_window)
        } else {
            ladder
        };
        let redelivery_limit = count_key(
            "bridge.redelivery_limit",
            self.bridge.redelivery_limit,
            defaults::REDELIVERY_LIMIT,
            defaults::MAX_REDELIVERY_LIMIT,
            " (below the quorum work queue's own delivery limit)",
        )?;
        let max_unacked_bytes = self
            .bridge
            .max_unacked_bytes
            .unwrap_or(defaults::MAX_UNACKED_BYTES);
        if max_unacked_bytes == 0 {
            return Err(invalid(
                "bridge.max_unacked_bytes",
                0,
                "must be at least 1 (one delivery is always taken, whatever its size)",
            ));
        }
        let cancel_grace = self.cancel.grace.unwrap_or(defaults::CANCEL_GRACE);
        let names = Names::new(prefix);
        if names.longest_name_len(ladder.levels()) > 255 {
            return Err(invalid(
                "topology.prefix",
                names.prefix(),
                "too long: queue names built from it exceed 255 bytes",
            ));
        }
        if self.routes.is_empty() {
            return Err(invalid(
                "route",
                "[]",
                "at least one [[route]] with `ingress` and `target` is needed",
            ));
        }
        let mut routes = Vec::with_capacity(self.routes.len());
        for (i, raw) in self.routes.iter().enumerate() {
            let ingress = exchange_name(&format!("route[{i}].ingress"), &raw.ingress)?;
            let target = exchange_name(&format!("route[{i}].target"), &raw.target)?;
            if ingress == target {
                return Err(invalid(
                    &format!("route[{i}].target"),
                    &target,
                    "the target cannot be the route's own ingress exchange",
                ));
            }
            let own = [
                names.work_exchange(),
                names.parked_exchange(),
                names.cancel_exchange(),
            ];
            if own.contains(&ingress) || own.contains(&target) {
                return Err(invalid(
                    &format!("route[{i}]"),
                    format!("{ingress} -> {target}"),
                    "a route cannot use the bridge's own work, parked or cancel exchange",
                ));
            }
            if routes.iter().any(|r: &Route| r.ingress == ingress) {
                return Err(invalid(
                    &format!("route[{i}].ingress"),
                    &ingress,
                    "two routes share this ingress exchange",
                ));
            }
            let ingress_kind = match raw.ingress_type.as_deref() {
                None | Some("fanout") => IngressKind::Fanout,
                Some("headers") => IngressKind::Headers,
                Some(other) => {
                    return Err(invalid(
                        &format!("route[{i}].ingress_type"),
                        other,
                        "`fanout` or `headers`",
                    ));
                }
            };
            routes.push(Route {
                ingress,
                target,
                ingress_kind,
            });
        }
        let management = self.management.validate()?;
        let metrics = self.metrics.validate()?;
        let tls = self.tls.validate(&urls)?;
        let urls = urls.into_iter().map(|u| u.with_tls(tls.clone())).collect();
        let log_format = match &self.log.format {
            Some(text) => text.parse()?,
            None => LogFormat::default(),
        };
        Ok(Config {
            urls,
            names,
            queue_type,
            ladder,
            margin,
            max_delay,
            prefetch,
            worker_threads: worker_threads as usize,
            shutdown_timeout,
            confirm_timeout,
            target_full_timeout,
            hop_window,
            bundle_hops,
            redelivery_limit,
            max_unacked_bytes,
            state_keys,
            state_key_files: (
                self.bridge.state_key_file.clone(),
                self.bridge.state_key_previous_file.clone(),
            ),
            accept_unsigned_state: self.bridge.accept_unsigned_state.unwrap_or(false),
            cancel_grace,
            management,
            metrics,
            log_format,
            routes,
        })
    }
}

impl RawMetrics {
    /// True when the section sets nothing.
    fn is_unset(&self) -> bool {
        self.listen.is_none() && self.interval.is_none()
    }

    /// `None` when no `listen` address is set (an `interval` alone is refused).
    fn validate(self) -> Result<Option<MetricsConfig>, ConfigError> {
        let Some(listen) = self.listen else {
            if self.interval.is_some() {
                return Err(invalid(
                    "metrics",
                    "no listen",
                    "`interval` needs the listener's address, `listen` (for example \"0.0.0.0:9090\")",
                ));
            }
            return Ok(None);
        };
        let interval = self.interval.unwrap_or(defaults::METRICS_INTERVAL);
        if interval < Duration::from_millis(100) {
            return Err(invalid(
                "metrics.interval",
                format_duration(interval),
                "must be at least 100ms",
            ));
        }
        Ok(Some(MetricsConfig { listen, interval }))
    }
}

impl RawManagement {
    /// True when the section sets nothing.
    fn is_unset(&self) -> bool {
        self.url.is_none()
            && self.urls.is_none()
            && self.interval.is_none()
            && self.stuck_after.is_none()
    }

    /// `None` when no management URL is set (the section's other keys alone are refused).
    fn validate(self) -> Result<Option<ManagementConfig>, ConfigError> {
        let urls = match (self.url, self.urls) {
            (Some(_), Some(_)) => {
                return Err(invalid(
                    "management",
                    "url and urls",
                    "give either `url` (one node) or `urls` (several), not both",
                ));
            }
            (Some(url), None) => vec![ManagementUrl::parse(&url)?],
            (None, Some(list)) if !list.is_empty() => list
                .iter()
                .map(|u| ManagementUrl::parse(u))
                .collect::<Result<Vec<_>, _>>()?,
            _ if self.interval.is_some() || self.stuck_after.is_some() => {
                return Err(invalid(
                    "management",
                    "no url",
                    "`interval` and `stuck_after` need the management API's `url`",
                ));
            }
            _ => return Ok(None),
        };
        let interval = self.interval.unwrap_or(defaults::MANAGEMENT_INTERVAL);
        if interval < Duration::from_millis(100) {
            return Err(invalid(
                "management.interval",
                format_duration(interval),
                "must be at least 100ms",
            ));
        }
        let stuck_after = self.stuck_after.unwrap_or(defaults::STUCK_AFTER);
        Ok(Some(ManagementConfig {
            urls,
            interval,
            stuck_after,
        }))
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = "[[route]]\ningress = \"orders.delayed\"\ntarget = \"orders\"\n";

    fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::from_toml(text, "<test>", &[])
    }

    #[test]
    fn the_printed_configuration_reads_back_as_the_same() {
        let text = format!(
            "[broker]\nurl = \"amqp://user@broker:5672/%2f\"\n\
             [topology]\nprefix = \"p\"\nqueue_type = \"quorum\"\n\
             [delays]\nladder = \"1s 5s 1m30s\"\nmargin = \"120ms\"\nmax_delay = \"30d\"\n\
             [bridge]\nprefetch = 100\nworker_threads = 2\nshutdown_timeout = \"3s\"\n\
             confirm_timeout = \"7s 500us\"\ntarget_full_timeout = \"90s\"\n\
             redelivery_limit = 7\nmax_unacked_bytes = 1048576\nhop_window = \"20ms\"\n\
             bundle_hops = true\n\
             [cancel]\ngrace = \"2h\"\n{MINIMAL}\
             [[route]]\ningress = \"b.in\"\ntarget = \"b\"\n"
        );
        let config = parse(&text).unwrap();
        let printed = config.to_string();
        assert_eq!(parse(&printed).unwrap(), config, "{printed}");
        // Durations print in the units the file is written in.
        for line in [
            "max_delay = \"30d\"",
            "grace = \"2h\"",
            "margin = \"120ms\"",
        ] {
            assert!(printed.contains(line), "{line} not in {printed}");
        }
        // The default URL's password is printed as *** and read back as that: all else
        // round-trips.
        let defaults = parse(MINIMAL).unwrap();
        let mut back = parse(&defaults.to_string()).unwrap();
        assert_ne!(back.url(), defaults.url());
        back.urls = defaults.urls.clone();
        assert_eq!(back, defaults);
    }

    #[test]
    fn several_brokers_are_tried_in_order_and_printed_redacted() {
        let config = parse(&format!(
            "[broker]\nurls = [\"amqp://u:pw1@node1:5672/%2f\", \"amqp://u:pw2@node2:5672/%2f\"]\n{MINIMAL}"
        ))
        .unwrap();
        assert_eq!(config.urls.len(), 2);
        let printed = config.to_string();
        assert!(
            printed.contains("u:***@node1") && printed.contains("u:***@node2"),
            "{printed}"
        );
        assert!(
            !printed.contains("pw1") && !printed.contains("pw2"),
            "{printed}"
        );
        let both = parse(&format!(
            "[broker]\nurl = \"amqp://a/%2f\"\nurls = [\"amqp://b/%2f\"]\n{MINIMAL}"
        ));
        assert!(matches!(both, Err(ConfigError::Invalid { key, .. }) if key == "broker"));
        let none = parse(&format!("[broker]\nurls = []\n{MINIMAL}"));
        assert!(matches!(none, Err(ConfigError::Invalid { key, .. }) if key == "broker.urls"));
        let one = parse(MINIMAL).unwrap();
        assert_eq!(one.urls.len(), 1);
    }

    #[test]
    fn the_printed_configuration_never_shows_the_password() {
        let config = parse(&format!(
            "[broker]\nurl = \"amqp://user:s3cret@broker/%2f\"\n{MINIMAL}"
        ))
        .unwrap();
        let printed = config.to_string();
        assert!(!printed.contains("s3cret"), "{printed}");
        assert!(printed.contains("user:***@broker"), "{printed}");
    }

    #[test]
    fn defaults_fill_a_minimal_file() {
        let c = parse(MINIMAL).unwrap();
        assert_eq!(c.url().expose(), DEFAULT_URL);
        assert_eq!(c.names.prefix(), "delay-bridge");
        assert_eq!(c.queue_type, QueueType::Classic);
        // Bundled hops in 100-ms windows, with the window's fine levels below 1 s.
        assert_eq!(c.hop_window, Duration::from_millis(100));
        assert!(c.bundle_hops);
        assert_eq!(
            c.ladder,
            Ladder::default_ladder().with_fine_levels(Duration::from_millis(100))
        );
        assert_eq!(c.ladder.smallest(), Duration::from_millis(100));
        assert_eq!(c.margin, Duration::from_millis(250));
        assert_eq!(c.max_delay, Duration::from_secs(366 * 86_400));
        assert_eq!(c.prefetch, 4000);
        assert_eq!(c.worker_threads, 2);
        assert_eq!(c.cancel_grace, Duration::from_secs(86_400));
        assert_eq!(c.routes, vec![Route::new("orders.delayed", "orders")]);
    }

    #[test]
    fn a_hop_window_of_zero_turns_bundles_off_unless_they_are_asked_for() {
        let c = parse(&format!("{MINIMAL}\n[bridge]\nhop_window = \"0s\"\n")).unwrap();
        assert!(!c.bundle_hops);
        assert_eq!(
            c.ladder,
            Ladder::default_ladder(),
            "no fine levels without bundles"
        );
        let c = parse(&format!("{MINIMAL}\n[bridge]\nbundle_hops = false\n")).unwrap();
        assert!(!c.bundle_hops);
        assert_eq!(c.ladder, Ladder::default_ladder());
        assert_eq!(
            c.to_raw().validate().unwrap().ladder,
            c.ladder,
            "round trip"
        );
        let bundled = parse(MINIMAL).unwrap();
        assert_eq!(
            bundled.to_raw().validate().unwrap().ladder,
            bundled.ladder,
            "round trip with fine levels"
        );
    }

    #[test]
    fn the_shipped_file_parses_and_documents_every_key() {
        let text = include_str!("../config/delay-bridge.toml");
        let c = parse(text).unwrap();
        assert!(!c.routes.is_empty());
        // Every key the raw structs know appears in the documented file (uncommented).
        for key in [
            "[broker]",
            "url =",
            "[topology]",
            "prefix =",
            "queue_type =",
            "[delays]",
            "ladder =",
            "margin =",
            "max_delay =",
            "[bridge]",
            "prefetch =",
            "worker_threads =",
            "shutdown_timeout =",
            "[cancel]",
            "grace =",
            "[[route]]",
            "ingress =",
            "target =",
        ] {
            assert!(
                text.lines().any(|l| l.trim_start().starts_with(key)),
                "config/delay-bridge.toml does not document `{key}`"
            );
        }
    }

    #[test]
    fn the_state_key_comes_from_its_file_or_the_environment_and_is_never_printed() {
        let dir = std::env::temp_dir();
        let file = dir.join(format!("state-key-{:08x}", rand::random::<u32>()));
        std::fs::write(&file, "0123456789abcdef0123456789abcdef\n").unwrap();
        let text = format!(
            "[bridge]\nstate_key_file = \"{}\"\naccept_unsigned_state = true\n{MINIMAL}",
            file.display()
        );
        let c = parse(&text).unwrap();
        let from_file = c.state_keys.clone().expect("a key");
        assert!(c.accept_unsigned_state);
        let printed = c.to_string();
        assert!(!printed.contains("0123456789abcdef"), "{printed}");
        let reread = parse(&printed).unwrap();
        assert_eq!(
            (reread.state_keys, reread.accept_unsigned_state),
            (c.state_keys.clone(), true),
            "{printed}"
        );
        // The variable wins over the file; the trailing newline of the file is not key.
        let from_env = Config::from_toml(
            &text,
            "<test>",
            &[(ENV_STATE_KEY, "0123456789abcdef0123456789abcdef".into())],
        )
        .unwrap();
        assert_eq!(from_env.state_keys, Some(from_file));
        let short = Config::from_toml(MINIMAL, "<test>", &[(ENV_STATE_KEY, "short".into())]);
        assert!(
            matches!(&short, Err(ConfigError::Invalid { key, value, .. })
                if key == "bridge.state_key_file" && value == "<redacted>"),
            "{short:?}"
        );
        let missing = parse("[bridge]\nstate_key_file = \"/nonexistent/key\"\n");
        assert!(
            matches!(missing, Err(ConfigError::Invalid { .. })),
            "{missing:?}"
        );
        let only_previous = Config::from_toml(
            MINIMAL,
            "<test>",
            &[(
                ENV_STATE_KEY_PREVIOUS,
                "0123456789abcdef0123456789abcdef".into(),
            )],
        );
        assert!(only_previous.is_err());
        assert_eq!(parse(MINIMAL).unwrap().state_keys, None, "off by default");
        std::fs::remove_file(&file).unwrap();
    }

    #[test]
    fn environment_overrides_win() {
        let c = Config::from_toml(
            MINIMAL,
            "<test>",
            &[
                (ENV_URL, "amqp://u:secret@h:5673/v".to_string()),
                (ENV_PREFIX, "other".to_string()),
            ],
        )
        .unwrap();
        assert_eq!(c.url().expose(), "amqp://u:secret@h:5673/v");
        assert_eq!(c.names.prefix(), "other");
        assert_eq!(c.url().user(), "u");
        let listening = Config::from_toml(
            MINIMAL,
            "<test>",
            &[(ENV_METRICS_LISTEN, "0.0.0.0:9090".to_string())],
        )
        .unwrap();
        assert_eq!(
            listening.metrics.map(|m| m.listen),
            Some("0.0.0.0:9090".parse().unwrap())
        );
        let bad = Config::from_toml(MINIMAL, "<test>", &[(ENV_METRICS_LISTEN, "9090".into())]);
        assert!(matches!(bad, Err(ConfigError::Invalid { key, .. }) if key == ENV_METRICS_LISTEN));
    }

    #[test]
    fn the_url_variable_may_name_several_brokers() {
        let c = Config::from_toml(
            MINIMAL,
            "<test>",
            &[(
                ENV_URL,
                " amqp://u:p@n1:5672/%2f  amqp://u:p@n2:5672/%2f\n".to_string(),
            )],
        )
        .unwrap();
        let urls: Vec<&str> = c.urls.iter().map(BrokerUrl::expose).collect();
        assert_eq!(urls, ["amqp://u:p@n1:5672/%2f", "amqp://u:p@n2:5672/%2f"]);
        let empty = Config::from_toml(MINIMAL, "<test>", &[(ENV_URL, " ".to_string())]);
        assert!(matches!(empty, Err(ConfigError::Invalid { key, .. }) if key == "broker.urls"));
    }

    #[test]
    fn unknown_keys_are_refused_by_name() {
        let err = parse(&format!("{MINIMAL}[bridge]\nprefetsh = 10\n")).unwrap_err();
        assert!(err.to_string().contains("prefetsh"), "{err}");
        let err = parse(&format!("colour = 1\n{MINIMAL}")).unwrap_err();
        assert!(err.to_string().contains("colour"), "{err}");
    }

    #[test]
    fn bad_values_name_key_and_value() {
        let cases = [
            ("[delays]\nmax_delay = \"1ms\"\n", "delays.max_delay", "1ms"),
            (
                "[topology]\nqueue_type = \"lazy\"\n",
                "topology.queue_type",
                "lazy",
            ),
            (
                "[topology]\nprefix = \"has space\"\n",
                "topology.prefix",
                "has space",
            ),
            ("[bridge]\nprefetch = 0\n", "bridge.prefetch", "0"),
            ("[bridge]\nprefetch = 70000\n", "bridge.prefetch", "70000"),
            (
                "[bridge]\nworker_threads = 0\n",
                "bridge.worker_threads",
                "0",
            ),
            (
                "[bridge]\nworker_threads = 65\n",
                "bridge.worker_threads",
                "65",
            ),
            ("[broker]\nurl = \"http://x\"\n", "broker.url", "http://x"),
            ("[delays]\nladder = \"1s 1s\"\n", "delays.ladder", "1s"),
            (
                "[bridge]\nredelivery_limit = 50\n",
                "bridge.redelivery_limit",
                "50",
            ),
            (
                "[bridge]\nmax_unacked_bytes = 0\n",
                "bridge.max_unacked_bytes",
                "0",
            ),
            ("[bridge]\nhop_window = \"2s\"\n", "bridge.hop_window", "2s"),
            (
                "[bridge]\nbundle_hops = true\nhop_window = \"0s\"\n",
                "bridge.bundle_hops",
                "true",
            ),
        ];
        for (extra, key, value) in cases {
            let err = parse(&format!("{extra}{MINIMAL}")).unwrap_err().to_string();
            assert!(
                err.contains(key) && err.contains(value),
                "{extra:?} gave {err}"
            );
        }
        // A duration that does not parse is refused by the reader, which shows the line.
        for (extra, line) in [
            ("[delays]\nmargin = \"soon\"\n", "margin = \"soon\""),
            ("[cancel]\ngrace = \"a while\"\n", "grace = \"a while\""),
            ("[bridge]\nconfirm_timeout = 30\n", "confirm_timeout = 30"),
        ] {
            let err = parse(&format!("{extra}{MINIMAL}")).unwrap_err().to_string();
            assert!(
                err.contains("line 2") && err.contains(line) && err.contains("duration"),
                "{extra:?} gave {err}"
            );
        }
        let err = parse("[[route]]\ningress = \"a\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("route[0].target"), "{err}");
        let err = parse("").unwrap_err().to_string();
        assert!(err.contains("[[route]]"), "{err}");
    }

    #[test]
    fn a_route_takes_a_fanout_or_a_headers_ingress_and_nothing_else() {
        assert_eq!(
            parse(MINIMAL).unwrap().routes[0].ingress_kind,
            IngressKind::Fanout
        );
        let headers = parse(&format!("{MINIMAL}ingress_type = \"headers\"\n")).unwrap();
        assert_eq!(headers.routes[0].ingress_kind, IngressKind::Headers);
        assert_eq!(
            headers.to_raw().validate().unwrap().routes,
            headers.routes,
            "written back as read"
        );
        let err = parse(&format!("{MINIMAL}ingress_type = \"topic\"\n"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("route[0].ingress_type") && err.contains("`fanout` or `headers`"),
            "{err}"
        );
    }

    #[test]
    fn passwords_are_redacted_when_printed() {
        let c = Config::from_toml(
            MINIMAL,
            "<test>",
            &[(
                ENV_URL,
                "amqps://admin:hunter2@rabbit:5671/prod".to_string(),
            )],
        )
        .unwrap();
        for shown in [c.to_string(), format!("{c:?}"), c.url().to_string()] {
            assert!(!shown.contains("hunter2"), "{shown}");
            assert!(shown.contains("admin:***@rabbit"), "{shown}");
        }
        let err = parse(&format!("[broker]\nurl = \"ftp://a:hunter2@b\"\n{MINIMAL}"))
            .unwrap_err()
            .to_string();
        assert!(!err.contains("hunter2"), "{err}");
        assert_eq!(redact_url("amqp://a:b c@host"), "amqp://a:***@host");
    }

    #[test]
    fn the_metrics_listener_is_off_unless_an_address_is_set() {
        assert_eq!(parse(MINIMAL).unwrap().metrics, None);
        let config = parse(&format!("[metrics]\nlisten = \"0.0.0.0:9090\"\n{MINIMAL}")).unwrap();
        let metrics = config.metrics.expect("metrics set");
        assert_eq!(metrics.listen, "0.0.0.0:9090".parse().unwrap());
        assert_eq!(metrics.interval, defaults::METRICS_INTERVAL);
        let printed = config.to_string();
        assert!(printed.contains("listen = \"0.0.0.0:9090\""), "{printed}");
        assert!(printed.contains("interval = \"5s\""), "{printed}");
        let refused = |extra: &str| {
            parse(&format!("{extra}\n{MINIMAL}"))
                .unwrap_err()
                .to_string()
        };
        assert!(refused("[metrics]\ninterval = \"5s\"").contains("needs the listener's address"));
        assert!(refused("[metrics]\nlisten = \"localhost\"").contains("listen"));
        assert!(
            refused("[metrics]\nlisten = \"127.0.0.1:9090\"\ninterval = \"1ms\"")
                .contains("at least 100ms")
        );
    }

    #[test]
    fn the_management_section_is_off_unless_a_url_is_set_and_keeps_its_password() {
        assert_eq!(parse(MINIMAL).unwrap().management, None);
        let config = parse(&format!(
            "[management]\nurl = \"http://watcher:s3cret@127.0.0.1:15672\"\nstuck_after = \"30s\"\n{MINIMAL}"
        ))
        .unwrap();
        let management = config.management.clone().expect("management set");
        assert_eq!(management.interval, defaults::MANAGEMENT_INTERVAL);
        assert_eq!(management.stuck_after, Duration::from_secs(30));
        assert_eq!(
            management.urls[0].credentials(),
            Some(("watcher".to_string(), "s3cret".to_string()))
        );
        let printed = config.to_string();
        assert!(!printed.contains("s3cret"), "{printed}");
        assert!(printed.contains("stuck_after = \"30s\""), "{printed}");

        let refused = |text: &str| {
            parse(&format!("{text}\n{MINIMAL}"))
                .unwrap_err()
                .to_string()
        };
        assert!(refused("[management]\nstuck_after = \"5s\"").contains("need the management API"));
        assert!(refused("[management]\nurl = \"amqp://h:15672\"").contains("http://"));
        assert!(
            refused("[management]\nurl = \"http://h\"\ninterval = \"10ms\"")
                .contains("at least 100ms")
        );
    }

    #[test]
    fn an_amqp_url_gives_the_management_api_its_credentials_and_virtual_host() {
        let url = BrokerUrl::parse("amqp://bob:p%40ss@h:5672/orders%2Fprod").unwrap();
        assert_eq!(
            url.credentials_and_vhost(),
            ("bob".into(), "p@ss".into(), "orders/prod".into())
        );
        let url = BrokerUrl::parse("amqp://h").unwrap();
        assert_eq!(
            url.credentials_and_vhost(),
            ("guest".into(), "guest".into(), "/".into())
        );
        let url = BrokerUrl::parse("amqp://guest:guest@127.0.0.1:5672/%2f").unwrap();
        assert_eq!(url.credentials_and_vhost().2, "/");
    }
}
