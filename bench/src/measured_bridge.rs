//! The bridge under test as users run it: the `delay-bridge` executable beside this one,
//! `run` in a child process, so that its memory and CPU time (read from `/proc`) are its
//! own and not the load generator's.

use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};

use delay_bridge::config::MetricsConfig;
use delay_bridge::sandbox::Sandbox;
use delay_bridge::sandbox::process::{BridgeProcess, ConfigFile, ProcessLog};

use crate::process_usage::{self, ProcessUsage};

/// How long a starting bridge may take to consume: long enough to read a cancel stream of
/// millions of tombstones.
const READY_WITHIN: Duration = Duration::from_secs(300);

/// How often the measured bridge reads its queue depths for its gauges: once an hour, so
/// that its listener (read for its lateness histograms) adds no broker work to a run.
const DEPTHS_EVERY: Duration = Duration::from_secs(3600);

/// A `delay-bridge run` child process serving a sandbox.
pub struct MeasuredBridge {
    process: BridgeProcess,
    _config: ConfigFile,
    /// Its Prometheus listener's `/metrics`.
    metrics_url: String,
}

/// The `delay-bridge` executable built beside this one.
pub fn bridge_executable() -> Result<PathBuf> {
    let bench = std::env::current_exe().context("finding this executable")?;
    let bridge = bench.with_file_name("delay-bridge");
    if !bridge.exists() {
        bail!(
            "{} is missing: build both with cargo build --release (the workspace builds both)",
            bridge.display()
        );
    }
    Ok(bridge)
}

impl MeasuredBridge {
    /// Starts `delay-bridge run` on the sandbox's config and waits until it consumes the
    /// work queue, which it does only once its topology is declared and the cancel stream
    /// is read up to date.
    pub async fn start(sandbox: &Sandbox) -> Result<Self> {
        Self::start_executable(sandbox, None).await
    }

    /// As [`MeasuredBridge::start`], with `executable` instead of the one built beside this
    /// one (an earlier release, for a before/after comparison).
    pub async fn start_executable(sandbox: &Sandbox, executable: Option<&PathBuf>) -> Result<Self> {
        let listen = free_loopback_port()?;
        let mut config = sandbox.config.clone();
        config.metrics = Some(MetricsConfig {
            listen,
            interval: DEPTHS_EVERY,
        });
        let config = ConfigFile::write(&config)?;
        let log = ProcessLog {
            rust_log: Some(
                std::env::var("DELAY_BRIDGE_BENCH_LOG").unwrap_or_else(|_| "warn".into()),
            ),
            stderr: None,
        };
        let executable = match executable {
            Some(path) => path.clone(),
            None => bridge_executable()?,
        };
        let mut process = BridgeProcess::spawn(&executable, &config, &log)?;
        let deadline = tokio::time::Instant::now() + READY_WITHIN;
        let work_queue = sandbox.config.names.work_queue();
        while sandbox.counts(&work_queue).await?.consumers == 0 {
            if let Some(status) = process.exited()? {
                bail!("the bridge process exited before it was ready: {status}");
            }
            if tokio::time::Instant::now() > deadline {
                bail!("the bridge process did not consume {work_queue} within {READY_WITHIN:?}");
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Ok(Self {
            process,
            _config: config,
            metrics_url: format!("http://{listen}/metrics"),
        })
    }

    /// Its metrics now, as Prometheus text.
    pub async fn metrics(&self) -> Result<String> {
        read_metrics(&self.metrics_url).await
    }

    /// Where its metrics are read (for a task that reads them while it runs).
    pub fn metrics_url(&self) -> &str {
        &self.metrics_url
    }

    /// Its process id.
    pub fn pid(&self) -> Result<i32> {
        i32::try_from(self.process.pid()).context("pid out of range")
    }

    /// Its memory and CPU time now.
    pub fn usage(&self) -> Result<ProcessUsage> {
        process_usage::read(self.pid()?).context("the bridge process")
    }

    /// Stops it with SIGTERM (its graceful shutdown) and waits up to 30 s for it to exit.
    pub async fn stop(self) -> Result<()> {
        let status = self.process.terminate(Duration::from_secs(30)).await?;
        if !status.success() {
            bail!("the bridge process exited with {status}");
        }
        Ok(())
    }
}

/// A bridge's metrics at `url` (its `/metrics`) now, as Prometheus text.
pub async fn read_metrics(url: &str) -> Result<String> {
    let response = reqwest::get(url)
        .await
        .with_context(|| format!("GET {url}"))?;
    response
        .error_for_status()
        .with_context(|| format!("GET {url}"))?
        .text()
        .await
        .context("reading the bridge's metrics")
}

/// A loopback address with a port free now (the system's pick), for the bridge's listener.
fn free_loopback_port() -> Result<SocketAddr> {
    let probe = TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    probe.local_addr().context("finding a free port")
}
