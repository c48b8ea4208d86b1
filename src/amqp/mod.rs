//! AMQP plumbing: connecting (password never shown), a queue's depth, the one confirmed
//! publish path (`publisher::Publisher`), and the project's own connection ([`wire`]).
//!
//! One rule: `wire` carries every message (consuming and acking, publishing with confirms
//! and returns, the cancel stream, the parked queue's list, replay and purge); lapin
//! declares and counts (the topology, passive declares for depths and `status`, the
//! sandbox).

pub mod broker_version;
pub(crate) mod cancel_stream;
mod depth;
pub(crate) mod disposition;
pub(crate) mod publisher;
pub(crate) mod returns;
pub(crate) mod stream_offset;
pub(crate) mod stream_reader;
mod stream_stalls;
pub(crate) mod targets;
mod tls;
pub mod wire;

pub use depth::{QueueCounts, queue_counts};
pub use publisher::PublishError;

use lapin::{Connection, ConnectionProperties};
use thiserror::Error;

use crate::config::BrokerUrl;

/// Why connecting failed. The URL is shown with its password redacted.
#[derive(Debug, Error)]
#[error("cannot connect to {url}: {source}")]
pub struct ConnectError {
    /// The broker URL, redacted.
    pub url: String,
    /// The client error.
    #[source]
    pub source: ConnectFailure,
}

/// What failed a connection: lapin's (declaring, reading queues, the cancel stream) or the
/// project's own ([`wire`]: consuming and publishing).
#[derive(Debug, Error)]
pub enum ConnectFailure {
    /// lapin's error.
    #[error(transparent)]
    Lapin(#[from] lapin::Error),
    /// The project's connection's error.
    #[error(transparent)]
    Wire(#[from] wire::WireError),
}

impl ConnectError {
    /// The broker's reply code, when the broker refused the connection (403 for a wrong
    /// password, 530 for a missing vhost).
    pub fn reply_code(&self) -> Option<u16> {
        match &self.source {
            ConnectFailure::Lapin(error) => reply_code(error),
            ConnectFailure::Wire(error) => error.reply_code(),
        }
    }
}

/// The heartbeat the project's own connections ask for (lapin takes the broker's, 60 s by
/// default).
pub const WIRE_HEARTBEAT: std::time::Duration = std::time::Duration::from_secs(60);

/// Opens the project's own connection ([`wire`]) named `name` (shown in the management
/// UI), with the URL's TLS files when it has some, asking for a heartbeat every
/// [`WIRE_HEARTBEAT`].
pub async fn connect_wire(url: &BrokerUrl, name: &str) -> Result<wire::Connection, ConnectError> {
    wire::Connection::open(url, name, WIRE_HEARTBEAT)
        .await
        .map_err(|source| ConnectError {
            url: url.to_string(),
            source: ConnectFailure::Wire(source),
        })
}

/// Opens a connection named `name` (shown in the management UI), with the URL's TLS files
/// when it has some (read now, so renewed files apply at the next connect).
pub async fn connect(url: &BrokerUrl, name: &str) -> Result<Connection, ConnectError> {
    let fail = |source: lapin::Error| ConnectError {
        source: ConnectFailure::Lapin(with_tls_hint(url, source)),
        url: url.to_string(),
    };
    let properties = ConnectionProperties::default().with_connection_name(name.into());
    match url.tls() {
        None => Connection::connect(url.expose(), properties).await,
        Some(files) => {
            let tls = tls::read(files).map_err(|e| fail(lapin::Error::from(e)))?;
            tls::connect(url.expose(), files.server_name.as_deref(), tls, properties).await
        }
    }
    .map_err(fail)
}

/// `source`, with what to check when it alone may not say: a broker that requires a client
/// certificate may reset the connection before its alert arrives, and the URL has none.
fn with_tls_hint(url: &BrokerUrl, source: lapin::Error) -> lapin::Error {
    let text = source.to_string();
    let without_client_certificate = url.tls().is_some_and(|files| files.client.is_none());
    if without_client_certificate
        && (text.contains("CertificateRequired") || text.contains("reset by peer"))
    {
        lapin::Error::from(std::io::Error::other(format!(
            "{text} (no tls.cert_file and tls.key_file: does the broker require a client certificate?)"
        )))
    } else {
        source
    }
}

/// The AMQP reply code of a channel or connection error, if the broker sent one.
pub(crate) fn reply_code(error: &lapin::Error) -> Option<u16> {
    match error.kind() {
        lapin::ErrorKind::ProtocolError(amqp) => Some(amqp.get_id()),
        _ => None,
    }
}
