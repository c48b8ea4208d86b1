//! One confirm-mode channel per target exchange.
//!
//! Publishing to a missing exchange makes the broker close the channel (404) and fail every
//! confirm pending on it. With a channel per target, only publishes to that same missing
//! target fail; a closed channel is replaced on next use.

use std::collections::HashMap;
use std::sync::Arc;

use lapin::{Channel, Connection};
use tokio::sync::Mutex;

use super::confirm_channel;

/// Lazily opened confirm channels, one per target exchange.
pub struct TargetChannels {
    connection: Arc<Connection>,
    channels: Mutex<HashMap<String, Channel>>,
}

impl TargetChannels {
    /// No channels yet; they open on first use.
    pub fn new(connection: Arc<Connection>) -> Self {
        Self {
            connection,
            channels: Mutex::new(HashMap::new()),
        }
    }

    /// The open channel for `target`, opening a new one if there is none or it was closed.
    pub async fn get(&self, target: &str) -> Result<Channel, lapin::Error> {
        let mut channels = self.channels.lock().await;
        if let Some(channel) = channels.get(target)
            && channel.status().connected()
        {
            return Ok(channel.clone());
        }
        let channel = confirm_channel(&self.connection).await?;
        channels.insert(target.to_string(), channel.clone());
        Ok(channel)
    }

    /// Closes every open target channel (on shutdown).
    pub async fn close_all(&self) {
        let channels: Vec<Channel> = self.channels.lock().await.drain().map(|(_, c)| c).collect();
        for channel in channels {
            if channel.status().connected() {
                let _ = channel.close(200, "delay-bridge stopping".into()).await;
            }
        }
    }
}
