//! From the raw file to a [`Config`]: every key checked, defaults filled in, each error
//! naming the key and the bad value.

use std::path::PathBuf;
use std::time::Duration;

use super::*;

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

/// `broker.url` or `broker.urls` (one of them; the default URL when neither is given).
fn broker_urls(
    url: Option<String>,
    urls: Option<Vec<String>>,
) -> Result<Vec<BrokerUrl>, ConfigError> {
    match (url, urls) {
        (Some(_), Some(_)) => Err(invalid(
            "broker",
            "url and urls",
            "give either `url` (one broker) or `urls` (several), not both",
        )),
        (None, Some(list)) if list.is_empty() => {
            Err(invalid("broker.urls", "[]", "name at least one broker"))
        }
        (None, Some(list)) => list.iter().map(|u| BrokerUrl::parse(u)).collect(),
        (url, None) => Ok(vec![BrokerUrl::parse(
            url.as_deref().unwrap_or(DEFAULT_URL),
        )?]),
    }
}

/// `topology.prefix`: letters, digits and `- _ . :`, at least one.
fn prefix(prefix: Option<String>) -> Result<String, ConfigError> {
    let prefix = prefix.unwrap_or_else(|| defaults::PREFIX.to_string());
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
    Ok(prefix)
}

/// `topology.queue_type`: `classic` or `quorum`.
fn queue_type(text: Option<&str>) -> Result<QueueType, ConfigError> {
    match text.unwrap_or(defaults::QUEUE_TYPE) {
        "classic" => Ok(QueueType::Classic),
        "quorum" => Ok(QueueType::Quorum),
        other => Err(invalid(
            "topology.queue_type",
            other,
            "must be `classic` or `quorum`",
        )),
    }
}

/// The `[[route]]` tables: at least one; each ingress its own, never the target, never
/// one of the bridge's own exchanges.
fn routes(raws: &[RawRoute], names: &Names) -> Result<Vec<Route>, ConfigError> {
    if raws.is_empty() {
        return Err(invalid(
            "route",
            "[]",
            "at least one [[route]] with `ingress` and `target` is needed",
        ));
    }
    let mut routes = Vec::with_capacity(raws.len());
    for (i, raw) in raws.iter().enumerate() {
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
    Ok(routes)
}

impl RawBridge {
    /// `bridge.hop_window` and `bridge.bundle_hops` as the bridge reads them: the window at
    /// most 1 s, and bundles (on by default while there is a window) only with a window.
    pub fn hops(&self) -> Result<(Duration, bool), ConfigError> {
        let hop_window = self.hop_window.unwrap_or(defaults::HOP_WINDOW);
        if hop_window > defaults::MAX_HOP_WINDOW {
            return Err(invalid(
                "bridge.hop_window",
                crate::ladder::format_duration(hop_window),
                "must be at most 1s (a hop waiting for its window holds its delivery unacked)",
            ));
        }
        let bundle_hops = self
            .bundle_hops
            .unwrap_or(defaults::BUNDLE_HOPS && !hop_window.is_zero());
        if bundle_hops && hop_window.is_zero() {
            return Err(invalid(
                "bridge.bundle_hops",
                "true".to_string(),
                "needs a bridge.hop_window above 0s (the hops of one window are bundled)",
            ));
        }
        Ok((hop_window, bundle_hops))
    }
}

/// The levels a bridge declares for a configured `ladder`: with bundles, the hop window's
/// fine levels below the smallest level keep the messages of the last bundle due close
/// together (see `Ladder::with_fine_levels`).
pub fn levels(ladder: Ladder, hop_window: Duration, bundle_hops: bool) -> Ladder {
    if bundle_hops {
        ladder.with_fine_levels(hop_window)
    } else {
        ladder
    }
}

impl RawConfig {
    /// Checks every key and builds the validated config.
    pub fn validate(self) -> Result<Config, ConfigError> {
        let urls = broker_urls(self.broker.url, self.broker.urls)?;
        let prefix = prefix(self.topology.prefix)?;
        let queue_type = queue_type(self.topology.queue_type.as_deref())?;
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
        let (hop_window, bundle_hops) = self.bridge.hops()?;
        let state_keys = state_keys(&self.bridge)?;
        let ladder = levels(ladder, hop_window, bundle_hops);
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
        let routes = routes(&self.routes, &names)?;
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
    pub(super) fn is_unset(&self) -> bool {
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
    pub(super) fn is_unset(&self) -> bool {
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
