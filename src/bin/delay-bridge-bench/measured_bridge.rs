//! The bridge under test as users run it: the `delay-bridge` executable beside this one,
//! `run` in a child process, so that its memory and CPU time (read from `/proc`) are its
//! own and not the load generator's.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde_json::json;

use delay_bridge::sandbox::Sandbox;
use delay_bridge::sandbox::process::{BridgeProcess, ConfigFile, ProcessLog};

/// How long a starting bridge may take to consume: long enough to read a cancel stream of
/// millions of tombstones.
const READY_WITHIN: Duration = Duration::from_secs(300);

/// A `delay-bridge run` child process serving a sandbox.
pub struct MeasuredBridge {
    process: BridgeProcess,
    _config: ConfigFile,
}

/// What `/proc/<pid>` says of the bridge process now.
#[derive(Debug, Clone, Copy)]
pub struct ProcessUsage {
    /// Resident set size, bytes.
    pub rss: u64,
    /// The largest resident set size so far, bytes.
    pub peak_rss: u64,
    /// User plus system CPU time since the process started.
    pub cpu: Duration,
}

/// What the bridge process used between two readings.
#[derive(Debug, Clone, Copy)]
pub struct UsageSpan {
    /// CPU time spent between the readings.
    pub cpu: Duration,
    /// RSS at the first reading, bytes.
    pub rss_start: u64,
    /// RSS at the second reading, bytes.
    pub rss_end: u64,
    /// The largest RSS up to the second reading, bytes.
    pub peak_rss: u64,
}

impl UsageSpan {
    /// Adds the span to a JSON report: `bridge_cpu_s`, `bridge_rss_<start>_bytes` (the
    /// first reading's name, for example `start` or `ready`), `bridge_rss_end_bytes` and
    /// `bridge_peak_rss_bytes`.
    pub fn add_to(&self, report: &mut serde_json::Value, start: &str) {
        let fields = [
            ("bridge_cpu_s".to_string(), json!(self.cpu.as_secs_f64())),
            (format!("bridge_rss_{start}_bytes"), json!(self.rss_start)),
            ("bridge_rss_end_bytes".to_string(), json!(self.rss_end)),
            ("bridge_peak_rss_bytes".to_string(), json!(self.peak_rss)),
        ];
        if let Some(object) = report.as_object_mut() {
            object.extend(fields);
        }
    }
}

impl ProcessUsage {
    /// From this reading to a later one.
    pub fn until(&self, end: &ProcessUsage) -> UsageSpan {
        UsageSpan {
            cpu: end.cpu.saturating_sub(self.cpu),
            rss_start: self.rss,
            rss_end: end.rss,
            peak_rss: end.peak_rss,
        }
    }
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
        let process = procfs::process::Process::new(pid).context("the bridge process")?;
        let status = process.status().context("/proc/<pid>/status")?;
        let stat = process.stat().context("/proc/<pid>/stat")?;
        let kib = |value: Option<u64>, key: &str| {
            value
                .map(|kib| kib * 1024)
                .with_context(|| format!("no {key} in /proc/{pid}/status"))
        };
        let ticks_per_second = procfs::ticks_per_second().max(1);
        Ok(ProcessUsage {
            rss: kib(status.vmrss, "VmRSS")?,
            peak_rss: kib(status.vmhwm, "VmHWM")?,
            cpu: Duration::from_millis((stat.utime + stat.stime) * 1000 / ticks_per_second),
        })
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
