//! The broker's memory, read with `rabbitmqctl` (the management plugin is not needed).
//! Every reading first garbage-collects every Erlang process, so two readings differ by
//! what is live, not by garbage that happened not to be collected yet.

use anyhow::{Context, Result, bail};
use tokio::process::Command;

/// How to run `rabbitmqctl`: a command and its leading arguments, for example
/// `rabbitmqctl` or `bash scripts/debian-broker.sh trixie ctl`.
#[derive(Debug, Clone)]
pub struct Ctl(Vec<String>);

impl Ctl {
    /// Splits a command line on whitespace.
    pub fn parse(text: &str) -> Result<Self> {
        let words: Vec<String> = text.split_whitespace().map(str::to_string).collect();
        if words.is_empty() {
            bail!("--ctl is empty");
        }
        Ok(Self(words))
    }

    /// Runs `rabbitmqctl <args>` and returns its standard output.
    pub async fn call(&self, args: &[&str]) -> Result<String> {
        let out = Command::new(&self.0[0])
            .args(&self.0[1..])
            .args(args)
            .output()
            .await
            .with_context(|| format!("running {}", self.0.join(" ")))?;
        if !out.status.success() {
            bail!(
                "{} {} failed ({}): {}{}",
                self.0.join(" "),
                args.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stdout).trim(),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// The broker's total memory (bytes, `erlang:memory(total)`), right after a full
    /// garbage collection.
    pub async fn total_after_gc(&self) -> Result<u64> {
        let out = self
            .call(&[
                "eval",
                "[erlang:garbage_collect(P) || P <- erlang:processes()], erlang:memory(total).",
            ])
            .await?;
        out.trim()
            .parse()
            .with_context(|| format!("unexpected erlang:memory output {out:?}"))
    }

    /// The summed `memory` of every queue whose name starts with `prefix`, and the
    /// messages in them (`rabbitmqctl list_queues`).
    pub async fn queues(&self, prefix: &str) -> Result<QueueMemory> {
        let out = self
            .call(&[
                "list_queues",
                "-q",
                "--no-table-headers",
                "name",
                "messages",
                "memory",
            ])
            .await?;
        let mut total = QueueMemory::default();
        for line in out.lines() {
            let cols: Vec<&str> = line.split('\t').collect();
            if let [name, messages, memory] = cols[..]
                && name.starts_with(prefix)
            {
                total.messages += messages.trim().parse::<u64>().unwrap_or(0);
                total.bytes += memory.trim().parse::<u64>().unwrap_or(0);
            }
        }
        Ok(total)
    }
}

impl Ctl {
    /// Bytes on disk under the broker's data directory (message stores, queue indexes,
    /// Raft logs, streams), summed by the broker itself (so that a broker in a chroot or on
    /// another host is read the same way).
    pub async fn data_dir_bytes(&self) -> Result<u64> {
        let out = self
            .call(&[
                "eval",
                "Dir = case erlang:function_exported(rabbit, data_dir, 0) of \
                   true -> rabbit:data_dir(); false -> rabbit_mnesia:dir() end, \
                 filelib:fold_files(Dir, \"\", true, \
                   fun(F, Sum) -> Sum + filelib:file_size(F) end, 0).",
            ])
            .await?;
        out.trim()
            .parse()
            .with_context(|| format!("unexpected data directory size {out:?}"))
    }
}

/// What `list_queues` says of a set of queues.
#[derive(Debug, Clone, Copy, Default)]
pub struct QueueMemory {
    /// Messages in them.
    pub messages: u64,
    /// Their processes' memory, bytes.
    pub bytes: u64,
}
