//! `delay-bridge health`: one GET of a running bridge's `/healthz` or `/readyz`, for
//! container health checks.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use anyhow::{Context, Result, bail};

use crate::output::out;
use delay_bridge::config::Config;

/// How long the check waits for an answer.
const TIMEOUT: Duration = Duration::from_secs(3);

/// Asks the listener of `config` and fails unless it answers 200.
pub async fn check(config: &Config, ready: bool) -> Result<()> {
    let metrics = config.metrics.context(
        "metrics.listen is not set (or DELAY_BRIDGE_METRICS_LISTEN): no listener to ask",
    )?;
    let path = if ready { "readyz" } else { "healthz" };
    let url = format!("http://{}/{path}", reachable(metrics.listen));
    let response = reqwest::Client::builder()
        .timeout(TIMEOUT)
        .build()?
        .get(&url)
        .send()
        .await
        .with_context(|| format!("GET {url}"))?;
    let status = response.status();
    let body = response.text().await.unwrap_or_default();
    if !status.is_success() {
        bail!("GET {url}: {status}: {}", body.trim());
    }
    out!("{body}")?;
    Ok(())
}

/// The address to connect to for a listen address: a wildcard one is reached on loopback.
fn reachable(listen: SocketAddr) -> SocketAddr {
    match listen.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => {
            SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), listen.port())
        }
        IpAddr::V6(ip) if ip.is_unspecified() => {
            SocketAddr::new(IpAddr::V6(Ipv6Addr::LOCALHOST), listen.port())
        }
        _ => listen,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wildcard_listen_address_is_reached_on_loopback() {
        let reach = |text: &str| reachable(text.parse().unwrap()).to_string();
        assert_eq!(reach("0.0.0.0:9090"), "127.0.0.1:9090");
        assert_eq!(reach("[::]:9090"), "[::1]:9090");
        assert_eq!(reach("10.1.2.3:9090"), "10.1.2.3:9090");
    }
}
