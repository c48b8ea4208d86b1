//! Why the bridge stopped, or one session of it ended: [`BridgeError`].

use thiserror::Error;

use crate::amqp::ConnectError;
use crate::topology::TopologyError;

/// Why the bridge stopped (or one session of it ended).
#[derive(Debug, Error)]
pub enum BridgeError {
    /// Connecting failed.
    #[error(transparent)]
    Connect(#[from] ConnectError),
    /// Declaring the topology failed.
    #[error(transparent)]
    Topology(#[from] TopologyError),
    /// The control connection (lapin's: declares, depths) failed mid-session.
    #[error("the control connection failed: {0}")]
    ControlLost(String),
    /// Consuming, acking or opening a channel failed mid-session (connection or channel
    /// lost).
    #[error("{what}: {source}")]
    Wire {
        /// What the bridge was doing.
        what: &'static str,
        /// The connection's error.
        source: crate::amqp::wire::WireError,
    },
    /// A publish on the bridge's own channel got no answer (channel lost, or no confirm
    /// within `bridge.confirm_timeout`).
    #[error("{what}: {source}")]
    Publish {
        /// What the bridge was doing.
        what: &'static str,
        /// Why the publish has no answer.
        source: crate::amqp::publisher::PublishError,
    },
    /// A publish into the bridge's own topology came back unrouted (a level or the parked
    /// queue was deleted under the bridge); the session restarts and redeclares.
    #[error("{0}")]
    OwnQueueMissing(String),
    /// The consumer was cancelled or its stream ended.
    #[error("the work-queue consumer ended: {0}")]
    ConsumerEnded(String),
    /// Publishing the bundle a message hopped in failed in a way that needs a new session
    /// (the error its publish met).
    #[error("publishing a bundle of hops: {0}")]
    Bundle(String),
}

impl BridgeError {
    /// True when reconnecting cannot help and the bridge should stop.
    pub fn is_permanent(&self) -> bool {
        match self {
            BridgeError::Topology(e) => e.is_permanent(),
            BridgeError::Connect(e) => matches!(e.reply_code(), Some(403 | 530)),
            _ => false,
        }
    }

    pub(super) fn wire(
        what: &'static str,
    ) -> impl FnOnce(crate::amqp::wire::WireError) -> BridgeError {
        move |source| BridgeError::Wire { what, source }
    }

    pub(super) fn publish(
        what: &'static str,
    ) -> impl FnOnce(crate::amqp::publisher::PublishError) -> BridgeError {
        move |source| BridgeError::Publish { what, source }
    }
}
