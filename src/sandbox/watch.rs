//! A queue's messages as they arrive, stamped with their arrival time.

use futures::StreamExt;
use lapin::options::BasicConsumeOptions;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Connection};
use tokio::sync::mpsc;

use super::SandboxError;
use crate::clock::now_ms;

/// One message as consumed from a watched queue.
#[derive(Debug)]
pub struct Received {
    /// When it arrived here (epoch ms).
    pub at_ms: u64,
    /// Its routing key.
    pub routing_key: String,
    /// The exchange it was published to.
    pub exchange: String,
    /// Its properties, headers included.
    pub properties: BasicProperties,
    /// Its body.
    pub body: Vec<u8>,
}

impl Received {
    /// One of its headers.
    pub fn header(&self, name: &str) -> Option<&AMQPValue> {
        self.properties
            .headers()
            .as_ref()
            .and_then(|headers| headers.inner().get(name))
    }
}

/// Consumes `queue` (auto-ack) on a channel of its own into a channel of received
/// messages, until the receiver is dropped or the connection closes.
pub async fn watch_queue(
    conn: &Connection,
    queue: &str,
) -> Result<mpsc::UnboundedReceiver<Received>, SandboxError> {
    let channel = conn
        .create_channel()
        .await
        .map_err(SandboxError::broker("opening a channel"))?;
    let mut consumer = channel
        .basic_consume(
            queue.into(),
            format!("watch-{queue}").as_str().into(),
            BasicConsumeOptions {
                no_ack: true,
                ..BasicConsumeOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .map_err(SandboxError::broker(format!("consuming {queue}")))?;
    let (sender, receiver) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        let _keep_open = channel;
        while let Some(Ok(delivery)) = consumer.next().await {
            let received = Received {
                at_ms: now_ms(),
                routing_key: delivery.routing_key.to_string(),
                exchange: delivery.exchange.to_string(),
                properties: delivery.properties,
                body: delivery.data,
            };
            if sender.send(received).is_err() {
                break;
            }
        }
    });
    Ok(receiver)
}
