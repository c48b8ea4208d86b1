//! `delay-bridge bench <scenario>`: measurements against the real broker, with the bridge
//! run in process through the library's `Bridge::run` (as `delay-bridge run` runs it), in a
//! [`crate::sandbox::Sandbox`]. Each
//! scenario prints a human table and one JSON object (the last line of its output).

mod cancel_horizon;

use anyhow::Result;
use clap::Subcommand;

use delay_bridge::config::Config;

/// The scenarios.
#[derive(Debug, Subcommand)]
pub enum Scenario {
    /// How long before deliver-at a confirmed cancel still wins: cancels are confirmed at
    /// decreasing lead times before their messages' due time; the table shows which won.
    CancelHorizon(cancel_horizon::Args),
}

/// Runs one scenario against the configured broker.
pub async fn run(base: &Config, scenario: &Scenario) -> Result<()> {
    match scenario {
        Scenario::CancelHorizon(args) => cancel_horizon::run(base, args).await,
    }
}

/// The value at quantile `q` (0..=1) of sorted samples.
pub fn quantile(sorted: &[i64], q: f64) -> Option<i64> {
    if sorted.is_empty() {
        return None;
    }
    let i = ((sorted.len() - 1) as f64 * q).round() as usize;
    Some(sorted[i])
}
