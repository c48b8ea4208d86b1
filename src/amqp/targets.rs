//! One confirm-mode publisher per target exchange (and one for the bridge's own queues).
//!
//! Publishing to a missing exchange makes the broker close the channel (404) and fail every
//! confirm pending on it; so does a refused message (403, 406). With a channel per target,
//! only publishes to that same target fail; a closed channel is replaced on next use.
//! Private channels for single publishes are few at a time, so that a burst of refusals
//! cannot run the connection out of channels.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lapin::Connection;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::publisher::Publisher;

/// Lazily opened confirm channels, one per target exchange.
pub struct TargetChannels {
    connection: Arc<Connection>,
    confirm_timeout: Duration,
    /// A plain mutex, held only for a map lookup or insert (never across an await): a burst
    /// of thousands of deliveries due at once must not queue on an async lock.
    channels: Mutex<HashMap<String, Publisher>>,
    /// One async lock per target, taken only to open its channel, so that thousands of
    /// deliveries to a target that has no channel yet open one between them, not one each
    /// (which ran the connection out of channels in a burst).
    opening: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Permits for private channels: at most [`ISOLATED_AT_ONCE`] open at a time.
    isolated: Arc<Semaphore>,
}

/// Private single-publish channels open at once, at most (a connection has 2047).
pub const ISOLATED_AT_ONCE: usize = 16;

/// A private confirm channel for one publish, counted against [`ISOLATED_AT_ONCE`] until
/// it is closed.
pub struct Isolated {
    publisher: Publisher,
    _permit: OwnedSemaphorePermit,
}

impl Isolated {
    /// The channel to publish on.
    pub fn publisher(&self) -> &Publisher {
        &self.publisher
    }

    /// Closes the channel and gives its place back.
    pub async fn close(self, reason: &str) {
        self.publisher.close(reason).await;
    }
}

impl TargetChannels {
    /// No channels yet; they open on first use. Each publish waits at most
    /// `confirm_timeout` for its confirm.
    pub fn new(connection: Arc<Connection>, confirm_timeout: Duration) -> Self {
        Self {
            connection,
            confirm_timeout,
            channels: Mutex::new(HashMap::new()),
            opening: Mutex::new(HashMap::new()),
            isolated: Arc::new(Semaphore::new(ISOLATED_AT_ONCE)),
        }
    }

    /// The open channel for `target`, opening a new one if there is none or it was closed.
    /// Concurrent callers for the same target share one opening.
    pub async fn get(&self, target: &str) -> Result<Publisher, lapin::Error> {
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
        let opened = Publisher::open(&self.connection, self.confirm_timeout).await?;
        self.channels
            .lock()
            .expect("target channels lock")
            .insert(target.to_string(), opened.clone());
        Ok(opened)
    }

    /// Uses `publisher` as the channel for `key` until it closes.
    pub fn adopt(&self, key: &str, publisher: Publisher) {
        self.channels
            .lock()
            .expect("target channels lock")
            .insert(key.to_string(), publisher);
    }

    /// A private confirm channel for one publish that must not share the fate of others
    /// (after a refusal: every publish pending on a closed channel gets the same error).
    /// Waits while [`ISOLATED_AT_ONCE`] are open. The caller closes it.
    pub async fn isolated(&self) -> Result<Isolated, lapin::Error> {
        let permit = self
            .isolated
            .clone()
            .acquire_owned()
            .await
            .expect("the isolation semaphore is never closed");
        Ok(Isolated {
            publisher: Publisher::open(&self.connection, self.confirm_timeout).await?,
            _permit: permit,
        })
    }

    fn open_channel(&self, target: &str) -> Option<Publisher> {
        let channels = self.channels.lock().expect("target channels lock");
        channels.get(target).filter(|p| p.is_open()).cloned()
    }

    /// Closes every open target channel (on shutdown).
    pub async fn close_all(&self) {
        let publishers: Vec<Publisher> = self
            .channels
            .lock()
            .expect("target channels lock")
            .drain()
            .map(|(_, c)| c)
            .collect();
        for publisher in publishers {
            publisher.close("delay-bridge stopping").await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The broker the tests use: `DELAY_BRIDGE_TEST_URL`, or the local default.
    fn broker_url() -> String {
        std::env::var("DELAY_BRIDGE_TEST_URL")
            .unwrap_or_else(|_| crate::config::DEFAULT_URL.to_string())
    }

    /// A burst of deliveries to a target that has no channel yet opens one channel between
    /// them, not one each: 3000 at once would exceed the broker's 2047 channels per
    /// connection. (Needs the test broker, like the integration tests.)
    #[tokio::test]
    async fn concurrent_first_publishes_to_a_target_share_one_channel() {
        let url = crate::config::BrokerUrl::parse(&broker_url()).expect("a broker URL");
        let connection = Arc::new(
            crate::amqp::connect(&url, "targets unit test")
                .await
                .expect("the test broker answers (run scripts/broker.sh)"),
        );
        let targets = Arc::new(TargetChannels::new(
            connection.clone(),
            Duration::from_secs(30),
        ));
        let opens = (0..3000).map(|_| {
            let targets = targets.clone();
            tokio::spawn(async move { targets.get("amq.direct").await.map(|p| p.channel_id()) })
        });
        let ids = tokio::time::timeout(Duration::from_secs(30), futures::future::join_all(opens))
            .await
            .expect("3000 lookups within 30 s");
        let mut distinct: Vec<u16> = ids
            .into_iter()
            .map(|joined| joined.expect("task").expect("a channel"))
            .collect();
        distinct.sort();
        distinct.dedup();
        assert_eq!(distinct.len(), 1, "channels opened: {distinct:?}");
        targets.close_all().await;
        let _ = connection.close(200, "done".into()).await;
    }
}
