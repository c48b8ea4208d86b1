//! The configuration file as written: serde structs, every key optional, unknown keys
//! refused.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::*;

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
    pub(super) fn validate(self, urls: &[BrokerUrl]) -> Result<Option<TlsFiles>, ConfigError> {
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
