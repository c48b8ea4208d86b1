//! The bridge under test as users run it: the `delay-bridge` executable beside this one,
//! `run` in a child process, so that its memory and CPU time (read from `/proc`) are its
//! own and not the load generator's.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};

use delay_bridge::sandbox::Sandbox;
use delay_bridge::sandbox::process::{BridgeProcess, ConfigFile, ProcessLog};

use crate::process_usage::{self, ProcessUsage};

/// How long a starting bridge may take to consume: long enough to read a cancel stream of
/// millions of tombstones.
const READY_WITHIN: Duration = Duration::from_secs(300);

/// A `delay-bridge run` child process serving a sandbox.
pub struct MeasuredBridge {
    process: BridgeProcess,
    _config: ConfigFile,
}

/// The `delay-bridge` executable built beside this one.
pub fn bridge_executable() -> Result<PathBuf> {
    let bench = std::env::current_exe().context("finding this executable")?;
    let bridge = bench.with_file_name("delay-bridge");
    if !bridge.exists() {
        bail!(
            "{} is missing: build both with cargo build --release --features bench",
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
        let config = ConfigFile::write(&sandbox.config)?;
        let log = ProcessLog {
            rust_log: Some(
                std::env::var("DELAY_BRIDGE_BENCH_LOG").unwrap_or_else(|_| "warn".into()),
            ),
            stderr: None,
        };
        let mut process = BridgeProcess::spawn(&bridge_executable()?, &config, &log)?;
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
        })
    }

    /// Its memory and CPU time now.
    pub fn usage(&self) -> Result<ProcessUsage> {
        let pid = i32::try_from(self.process.pid()).context("pid out of range")?;
        process_usage::read(pid).context("the bridge process")
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
