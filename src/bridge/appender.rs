//! Where the cancel-stream follower appends the bridge's own entries (catch-up markers,
//! clock entries, clamps, checkpoints): a confirm-mode channel of its own on the publishing
//! connection, opened again when the broker closes it. The broker closes a channel for a
//! publish it refuses (a message over its size limit, say): on a channel shared with the
//! rest, or one never opened again, one refused checkpoint part failed every later append
//! of that bridge (clamps, clock entries, checkpoints) until it restarted.

use std::sync::Arc;
use std::time::Duration;

use lapin::BasicProperties;
use tokio::sync::Mutex;

use crate::amqp::disposition::Disposition;
use crate::amqp::publisher::Publisher;
use crate::amqp::wire;

/// The follower's appends: cheap to clone, one channel for all clones.
#[derive(Clone)]
pub(super) struct Appender {
    connection: wire::Connection,
    confirm_timeout: Duration,
    channel: Arc<Mutex<Option<Publisher>>>,
}

impl Appender {
    /// Appends on `connection`, each publish confirmed within `confirm_timeout`.
    pub(super) fn new(connection: &wire::Connection, confirm_timeout: Duration) -> Self {
        Self {
            connection: connection.clone(),
            confirm_timeout,
            channel: Arc::new(Mutex::new(None)),
        }
    }

    /// Publishes one entry, confirmed, and says what became of it; a channel the broker
    /// closed is opened again first.
    pub(super) async fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        properties: &BasicProperties,
    ) -> Disposition {
        let publisher = {
            let mut channel = self.channel.lock().await;
            match channel.as_ref() {
                Some(publisher) if publisher.is_open() => publisher.clone(),
                _ => match Publisher::open(&self.connection, self.confirm_timeout).await {
                    Ok(publisher) => channel.insert(publisher).clone(),
                    Err(e) => return Disposition::of_error(e.into()),
                },
            }
        };
        publisher
            .publish(exchange, routing_key, body, properties)
            .await
    }
}
