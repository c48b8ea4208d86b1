//! The bridge as users run it: `delay-bridge run` in a child process, configured by a file
//! the sandbox writes.

use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use tokio::process::{Child, Command};

use super::SandboxError;
use crate::config::{Config, ENV_URL};

/// A configuration written to a temporary file for a `delay-bridge` child process, with
/// the password redacted; the real broker URLs go to the child through `DELAY_BRIDGE_URL`.
/// The file is deleted when this is dropped.
pub struct ConfigFile {
    path: PathBuf,
    url: String,
}

impl ConfigFile {
    /// Writes `config` to `<temp dir>/<prefix>-<random>.toml`.
    pub fn write(config: &Config) -> Result<Self, SandboxError> {
        let path = std::env::temp_dir().join(format!(
            "{}-{:08x}.toml",
            config.names.prefix(),
            rand::random::<u32>()
        ));
        std::fs::write(&path, config.to_string()).map_err(|source| SandboxError::Process {
            what: format!("writing {}", path.display()),
            source,
        })?;
        Ok(Self {
            path,
            url: config
                .urls
                .iter()
                .map(|u| u.expose())
                .collect::<Vec<_>>()
                .join(" "),
        })
    }

    /// Where the file is.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `exe --config <file>` with the broker URL in its environment and `RUST_LOG` unset;
    /// the caller adds the subcommand.
    pub fn command(&self, exe: &Path) -> Command {
        let mut command = Command::new(exe);
        command
            .arg("--config")
            .arg(&self.path)
            .env(ENV_URL, &self.url)
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .kill_on_drop(true);
        command
    }
}

impl Drop for ConfigFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Where a bridge process logs and how much.
#[derive(Debug, Clone, Default)]
pub struct ProcessLog {
    /// `RUST_LOG` for the child; `None` leaves it unset (the binary's default level).
    pub rust_log: Option<String>,
    /// A file for the child's stderr; `None` inherits this process's stderr.
    pub stderr: Option<PathBuf>,
}

impl ProcessLog {
    /// Warnings and errors only, to this process's stderr.
    pub fn warnings() -> Self {
        Self {
            rust_log: Some("warn".into()),
            stderr: None,
        }
    }
}

/// A `delay-bridge run` child process, killed when dropped.
pub struct BridgeProcess {
    child: Child,
    pid: u32,
}

impl BridgeProcess {
    /// Starts `exe --config <file> run`. It does not wait: see
    /// [`super::Sandbox::wait_for_consumers`].
    pub fn spawn(exe: &Path, config: &ConfigFile, log: &ProcessLog) -> Result<Self, SandboxError> {
        let mut command = config.command(exe);
        command.arg("run");
        if let Some(level) = &log.rust_log {
            command.env("RUST_LOG", level);
        }
        if let Some(path) = &log.stderr {
            let file = std::fs::File::create(path).map_err(|source| SandboxError::Process {
                what: format!("creating {}", path.display()),
                source,
            })?;
            command.stderr(file);
        }
        let child = command.spawn().map_err(|source| SandboxError::Process {
            what: format!("starting {} run", exe.display()),
            source,
        })?;
        let pid = child.id().ok_or_else(|| {
            SandboxError::ProcessState("the bridge process exited at once".into())
        })?;
        Ok(Self { child, pid })
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Its exit status, if it has exited.
    pub fn exited(&mut self) -> Result<Option<ExitStatus>, SandboxError> {
        self.child
            .try_wait()
            .map_err(|source| SandboxError::Process {
                what: "checking the bridge process".into(),
                source,
            })
    }

    /// SIGKILL: no chance to ack, drain or close anything.
    pub async fn kill9(mut self) {
        let _ = self.child.start_kill();
        let _ = self.child.wait().await;
    }

    /// SIGTERM (its graceful shutdown), then its exit status within `within`.
    pub async fn terminate(mut self, within: Duration) -> Result<ExitStatus, SandboxError> {
        // The `kill` command, not a signal call: the library holds no `unsafe` and no
        // platform crate for one signal.
        let signalled = std::process::Command::new("kill")
            .args(["-TERM", &self.pid.to_string()])
            .status()
            .map_err(|source| SandboxError::Process {
                what: "running kill -TERM".into(),
                source,
            })?;
        if !signalled.success() {
            return Err(SandboxError::ProcessState(format!(
                "kill -TERM {} failed: {signalled}",
                self.pid
            )));
        }
        match tokio::time::timeout(within, self.child.wait()).await {
            Ok(status) => status.map_err(|source| SandboxError::Process {
                what: "waiting for the bridge process".into(),
                source,
            }),
            Err(_) => Err(SandboxError::ProcessState(format!(
                "the bridge process did not exit within {within:?} of SIGTERM"
            ))),
        }
    }
}
