//! A process's CPU time and memory, read from `/proc/<pid>`: the bridge's and the broker's
//! own, apart from the load generator's.

use std::time::Duration;

use anyhow::{Context, Result};

/// What `/proc/<pid>` says of a process now.
#[derive(Debug, Clone, Copy)]
pub struct ProcessUsage {
    /// Resident set size, bytes.
    pub rss: u64,
    /// The largest resident set size so far, bytes.
    pub peak_rss: u64,
    /// User plus system CPU time since the process started.
    pub cpu: Duration,
}

/// What a process used between two readings.
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
    /// For the report.
    pub fn report(&self) -> delay_bridge_bench::report::BridgeUsage {
        delay_bridge_bench::report::BridgeUsage {
            bridge_cpu_s: self.cpu.as_secs_f64(),
            bridge_rss_first_bytes: self.rss_start,
            bridge_rss_end_bytes: self.rss_end,
            bridge_peak_rss_bytes: self.peak_rss,
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

/// Reads `/proc/<pid>/status` and `/proc/<pid>/stat`.
pub fn read(pid: i32) -> Result<ProcessUsage> {
    let process = procfs::process::Process::new(pid).with_context(|| format!("process {pid}"))?;
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
