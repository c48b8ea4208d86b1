//! `delay-bridge-bench relay-child`: one relay in a process of its own, on one runtime
//! worker as the bridge runs, so that its CPU time is its own. It prints `ready` once
//! consuming and, when done, its [`ChildReport`] as one JSON line.

use std::io::Write;

use anyhow::{Context, Result};

use delay_bridge::config::Config;

use super::job::{ChildArgs, Client};
use super::{amqprs_relay, lapin_relay};

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
    let report = runtime.block_on(async {
        match args.client {
            Client::Lapin => lapin_relay::relay(config.url(), args, ready).await,
            Client::Amqprs => amqprs_relay::relay(config.url(), args, ready).await,
        }
    })?;
    println!("{}", serde_json::to_string(&report)?);
    Ok(())
}
