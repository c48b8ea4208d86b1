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
    /// One async lock per target, taken only to open its channel, so that thousands of
    /// deliveries to a target that has no channel yet open one between them, not one each
    /// (which ran the connection out of channels in a burst).
    opening: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

impl TargetChannels {
    /// No channels yet; they open on first use.
    pub fn new(connection: Arc<Connection>) -> Self {
        Self {
            connection,
            channels: Mutex::new(HashMap::new()),
            opening: Mutex::new(HashMap::new()),
        }
    }

    /// The open channel for `target`, opening a new one if there is none or it was closed.
    /// Concurrent callers for the same target share one opening.
    pub async fn get(&self, target: &str) -> Result<Channel, lapin::Error> {
        if let Some(channel) = self.open_channel(target) {
            return Ok(channel);
        }
        let opening = self
            .opening
            .lock()
            .expect("target opening lock")
            .entry(target.to_string())
            .or_default()
            .clone();
        let _opener = opening.lock().await;
        // Whoever held the lock before us may have opened it.
        if let Some(channel) = self.open_channel(target) {
            return Ok(channel);
        }
        let opened = confirm_channel(&self.connection).await?;
        self.channels
            .lock()
            .expect("target channels lock")
            .insert(target.to_string(), opened.clone());
        Ok(opened)
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
