//! The bridge as users run it: this very executable's `run` command in a child process,
//! configured by a TOML file the sandbox writes. Its memory and CPU time are read from
//! `/proc`, so a benchmark can report them without the load generator's own.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use lapin::Connection;
use tokio::process::{Child, Command};

use delay_bridge::config::Config;

use super::queue_counts;

/// A `delay-bridge run` child process.
pub struct BridgeProcess {
    child: Child,
    pid: u32,
    config_file: PathBuf,
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

impl BridgeProcess {
    /// Starts `delay-bridge run` for `config` and waits (up to 5 min) until it consumes the
    /// work queue, which it does only once its topology is declared and the cancel stream
    /// is read up to date. The work queue must already exist.
    pub async fn start(config: &Config, conn: &Connection) -> Result<Self> {
        let config_file =
            std::env::temp_dir().join(format!("{}.bridge.toml", config.names.prefix()));
        // The file holds the redacted URL; the real one goes through the environment.
        std::fs::write(&config_file, config.to_string())
            .with_context(|| format!("writing {}", config_file.display()))?;
        let exe = std::env::current_exe().context("finding the delay-bridge executable")?;
        let child = Command::new(exe)
            .arg("--config")
            .arg(&config_file)
            .arg("run")
            .env("DELAY_BRIDGE_URL", config.url().expose())
            .env(
                "RUST_LOG",
                std::env::var("DELAY_BRIDGE_BENCH_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .context("starting `delay-bridge run`")?;
        let pid = child.id().context("the bridge process has no pid")?;
        let mut process = Self {
            child,
            pid,
            config_file,
        };
        let work_queue = config.names.work_queue();
        // Long enough to read a cancel stream of millions of tombstones.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(300);
        loop {
            if let Some(status) = process.child.try_wait()? {
                bail!("the bridge process exited before it was ready: {status}");
            }
            if queue_counts(conn, &work_queue).await?.consumers > 0 {
                return Ok(process);
            }
            if tokio::time::Instant::now() > deadline {
                bail!("the bridge process did not consume {work_queue} within 5 min");
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Its memory and CPU time now.
    pub fn usage(&self) -> Result<ProcessUsage> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid))?;
        let kib = |key: &str| -> Result<u64> {
            status
                .lines()
                .find_map(|l| l.strip_prefix(key))
                .and_then(|rest| rest.split_whitespace().next())
                .and_then(|v| v.parse::<u64>().ok())
                .map(|v| v * 1024)
                .with_context(|| format!("no {key} in /proc/{}/status", self.pid))
        };
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid))?;
        // Fields after the command name (which may hold spaces) start at field 3.
        let fields: Vec<&str> = stat
            .rsplit_once(')')
            .map(|(_, rest)| rest.split_whitespace().collect())
            .unwrap_or_default();
        let ticks = |i: usize| fields.get(i - 3).and_then(|v| v.parse::<u64>().ok());
        let (utime, stime) = ticks(14)
            .zip(ticks(15))
            .with_context(|| format!("unreadable /proc/{}/stat", self.pid))?;
        let per_second = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
            .ok()
            .flatten()
            .unwrap_or(100)
            .max(1) as u64;
        Ok(ProcessUsage {
            rss: kib("VmRSS:")?,
            peak_rss: kib("VmHWM:")?,
            cpu: Duration::from_millis((utime + stime) * 1000 / per_second),
        })
    }

    /// Stops it with SIGTERM (its graceful shutdown) and waits up to 30 s for it to exit.
    pub async fn stop(mut self) -> Result<()> {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.pid as i32),
            nix::sys::signal::Signal::SIGTERM,
        )
        .context("signalling the bridge process")?;
        let status = tokio::time::timeout(Duration::from_secs(30), self.child.wait())
            .await
            .context("the bridge process did not exit within 30 s of SIGTERM")??;
        let _ = std::fs::remove_file(&self.config_file);
        if !status.success() {
            bail!("the bridge process exited with {status}");
        }
        Ok(())
    }
}
