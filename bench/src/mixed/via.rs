//! Where the `mixed` soak's messages wait for their due time: the bridge (through its
//! ingress, each message with its due time) or, for a comparison in one sitting, the
//! archived delayed-message plugin (through an `x-delayed-message` exchange, each message
//! with its delay).

use anyhow::{Context, Result};
use delay_bridge::clock::now_ms;
use delay_bridge::sandbox::Sandbox;

use crate::bridge_description;
use crate::load::{Outgoing, due_at};

/// Where the soak's messages go to wait.
#[derive(Debug, Clone)]
pub(super) enum Via {
    /// The bridge's ingress exchange, each message with its due time.
    Bridge { ingress: String },
    /// An exchange of the archived plugin, each message with its delay (`x-delay`).
    Plugin { exchange: String },
}

impl Via {
    /// Message `seq`, `size` bytes, due at `due_ms` (epoch ms), for `routing_key`.
    pub(super) fn message(
        &self,
        seq: u64,
        due_ms: u64,
        size: usize,
        routing_key: &str,
    ) -> Outgoing {
        match self {
            Via::Bridge { ingress } => Outgoing {
                routing_key: routing_key.into(),
                ..due_at(ingress, seq, due_ms, size)
            },
            Via::Plugin { exchange } => {
                let delay_ms = due_ms.saturating_sub(now_ms());
                crate::plugin::delayed(exchange, routing_key, seq, delay_ms, size)
            }
        }
    }

    /// True when a bridge carries the delays.
    pub(super) fn is_bridge(&self) -> bool {
        matches!(self, Via::Bridge { .. })
    }

    /// What carries the delays, in a word: `bridge` or `plugin`.
    pub(super) fn label(&self) -> &'static str {
        if self.is_bridge() { "bridge" } else { "plugin" }
    }

    /// What carries the delays, for the report.
    pub(super) fn description(&self) -> String {
        match self {
            Via::Bridge { .. } => bridge_description(),
            Via::Plugin { .. } => crate::plugin::DESCRIPTION.into(),
        }
    }
}

/// Declares `exchange` as the plugin's, routing into the sandbox's target as the bridge
/// does: bound to it (an exchange-to-exchange binding) for each of `keys`.
pub(super) async fn declare_plugin_exchange(
    sandbox: &Sandbox,
    exchange: &str,
    keys: &[&str],
) -> Result<()> {
    let channel = sandbox.channel().await?;
    crate::plugin::declare_delayed(&channel, exchange).await?;
    for key in keys {
        channel
            .exchange_bind(
                sandbox.target.as_str().into(),
                exchange.into(),
                (*key).into(),
                lapin::options::ExchangeBindOptions::default(),
                lapin::types::FieldTable::default(),
            )
            .await
            .with_context(|| format!("binding {} to {exchange}", sandbox.target))?;
    }
    let _ = channel.close(200, "declared".into()).await;
    Ok(())
}
