//! Demo.
use crate::config::Config;
/// Demo.
pub async fn run_demo(_config: &Config) -> anyhow::Result<()> {
    Ok(())
}
