//! `delay-bridge-bench relay-child`: one relay in a process of its own, so that its CPU
//! time is its own, and as the bridge runs: a task on a runtime of one worker. It prints `ready` once
//! consuming and, when done, its [`ChildReport`] as one JSON line.

use std::io::Write;

use anyhow::{Context, Result};

use delay_bridge::config::Config;

use super::job::{ChildArgs, Client};
use super::{amqprs_relay, bare_relay, lapin_relay, wire_relay};

/// The line the child prints once it consumes.
pub const READY: &str = "ready";

/// Runs the relay `args` asks for and prints its report.
pub fn main(config: &Config, args: &ChildArgs) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let ready = || {
        println!("{READY}");
        let _ = std::io::stdout().flush();
    };
    let url = config.url().clone();
    let job = args.clone();
    let relay = async move {
        match job.client {
            Client::Lapin => lapin_relay::relay(&url, &job, ready).await,
            Client::Amqprs => amqprs_relay::relay(&url, &job, ready).await,
            Client::Bare => bare_relay::relay(&url, &job, ready).await,
            Client::Wire => wire_relay::relay(&url, &job, ready).await,
        }
    };
    // Spawned, so that it runs on the worker and not on this thread.
    let report = runtime
        .block_on(runtime.spawn(relay))
        .context("the relay task")??;
    println!("{}", serde_json::to_string(&report)?);
    Ok(())
}
