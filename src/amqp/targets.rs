//! One confirm-mode channel per target exchange.
//!
//! Publishing to a missing exchange makes the broker close the channel (404) and fail every
//! confirm pending on it. With a channel per target, only publishes to that same missing
//! target fail; a closed channel is replaced on next use.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use lapin::{Channel, Connection};

use super::confirm_channel;

/// Lazily opened confirm channels, one per target exchange.
pub struct TargetChannels {
    connection: Arc<Connection>,
    /// A plain mutex, held only for a map lookup or insert (never across an await): a burst
    /// of thousands of deliveries due at once must not queue on an async lock.
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
        if let Some(channel) = self.open_channel(target) {
            return Ok(channel);
        }
        let opened = confirm_channel(&self.connection).await?;
        // Another task may have opened one meanwhile: keep the first, close ours.
        let kept = {
            let mut channels = self.channels.lock().expect("target channels lock");
            match channels.get(target) {
                Some(existing) if existing.status().connected() => Some(existing.clone()),
                _ => {
                    channels.insert(target.to_string(), opened.clone());
                    None
                }
            }
        };
        match kept {
            Some(existing) => {
                let _ = opened.close(200, "opened twice".into()).await;
                Ok(existing)
            }
            None => Ok(opened),
        }
    }

    fn open_channel(&self, target: &str) -> Option<Channel> {
        let channels = self.channels.lock().expect("target channels lock");
        channels
            .get(target)
            .filter(|c| c.status().connected())
            .cloned()
    }

    /// Closes every open target channel (on shutdown).
    pub async fn close_all(&self) {
        let channels: Vec<Channel> = self
            .channels
            .lock()
            .expect("target channels lock")
            .drain()
            .map(|(_, c)| c)
            .collect();
        for channel in channels {
            if channel.status().connected() {
                let _ = channel.close(200, "delay-bridge stopping".into()).await;
            }
        }
    }
}
