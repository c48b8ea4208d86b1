//! The broker under test as an operating-system process, so that its own CPU time can be
//! put beside the bridge's: the process that holds the listening socket of the broker URL's
//! port on this machine (RabbitMQ's `beam.smp`), found through `/proc`, the same way on the
//! distribution's 3.x package and on the 4.x broker in its chroot.

use std::collections::HashSet;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use lapin::uri::AMQPUri;
use procfs::net::TcpState;
use procfs::process::{FDTarget, Process};

use crate::process_usage::{self, ProcessUsage};

/// The broker's process, found by the port it listens on.
#[derive(Debug, Clone)]
pub struct BrokerProcess {
    pid: i32,
    /// The RabbitMQ version of its installation (`rabbitmq_server-<version>` under the
    /// process's root), when it is a package install that shows it.
    pub version: Option<String>,
}

/// The major version of RabbitMQ a figure was measured on, for targets that differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BrokerSeries {
    /// 3.x.
    Three,
    /// 4.x or later.
    FourOrLater,
    /// Not known (not a package install): the stricter targets apply.
    Unknown,
}

impl BrokerProcess {
    /// The process listening on the port of `url` (an `amqp://` URL on this machine).
    pub fn find(url: &str) -> Result<Self> {
        let uri: AMQPUri = url
            .parse()
            .map_err(|e: String| anyhow::anyhow!("the broker URL: {e}"))?;
        let port = uri.authority.port;
        let mut listening = HashSet::new();
        for table in [procfs::net::tcp(), procfs::net::tcp6()] {
            let entries = table.context("reading /proc/net/tcp")?;
            listening.extend(
                entries
                    .into_iter()
                    .filter(|e| e.state == TcpState::Listen && e.local_address.port() == port)
                    .map(|e| e.inode),
            );
        }
        if listening.is_empty() {
            bail!("no process on this machine listens on port {port} (the broker must be local)");
        }
        for process in procfs::process::all_processes().context("listing /proc")? {
            let Ok(process) = process else { continue };
            let Ok(fds) = process.fd() else { continue };
            let holds = fds.flatten().any(
                |fd| matches!(fd.target, FDTarget::Socket(inode) if listening.contains(&inode)),
            );
            if holds {
                return Ok(Self {
                    pid: process.pid,
                    version: installed_version(&process),
                });
            }
        }
        bail!("no readable process holds the socket listening on port {port} (run as root?)")
    }

    /// Its CPU time and memory now.
    pub fn usage(&self) -> Result<ProcessUsage> {
        process_usage::read(self.pid).context("the broker process")
    }

    /// Its CPU time now (user plus system since it started).
    pub fn cpu(&self) -> Result<Duration> {
        Ok(self.usage()?.cpu)
    }

    /// Which major version it runs.
    pub fn series(&self) -> BrokerSeries {
        match self.version.as_deref().and_then(|v| v.split('.').next()) {
            Some("3") => BrokerSeries::Three,
            Some(major) if major.parse::<u32>().is_ok() => BrokerSeries::FourOrLater,
            _ => BrokerSeries::Unknown,
        }
    }

    /// For reports: `RabbitMQ <version> (pid N)`.
    pub fn describe(&self) -> String {
        format!(
            "RabbitMQ {} (pid {})",
            self.version.as_deref().unwrap_or("of unknown version"),
            self.pid
        )
    }
}

/// The version in the name of `usr/lib/rabbitmq/lib/rabbitmq_server-<version>` under the
/// process's root directory (a chroot shows its own).
fn installed_version(process: &Process) -> Option<String> {
    let lib = process.root().ok()?.join("usr/lib/rabbitmq/lib");
    std::fs::read_dir(lib)
        .ok()?
        .flatten()
        .filter_map(|entry| {
            entry
                .file_name()
                .to_str()?
                .strip_prefix("rabbitmq_server-")
                .map(str::to_string)
        })
        .max()
}
