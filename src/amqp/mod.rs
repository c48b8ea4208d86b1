//! AMQP plumbing: connecting (password never shown), a queue's depth, the one confirmed
//! publish path ([`publisher::Publisher`]), and the project's own connection
//! ([`wire`]), on which the bridge consumes the work queue.

pub mod bare;
mod depth;
pub(crate) mod publisher;
pub(crate) mod returns;
pub(crate) mod targets;
mod tls;
pub mod unreadable;
pub(crate) mod verdict;
pub mod wire;

pub use depth::{QueueCounts, queue_counts};
pub use publisher::PublishError;
pub use unreadable::SweepError;

use lapin::options::ConfirmSelectOptions;
use lapin::{Channel, Connection, ConnectionProperties};
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
    pub source: lapin::Error,
}

/// Opens a connection named `name` (shown in the management UI), with the URL's TLS files
/// when it has some (read now, so renewed files apply at the next connect).
pub async fn connect(url: &BrokerUrl, name: &str) -> Result<Connection, ConnectError> {
    let fail = |source: lapin::Error| ConnectError {
        source: with_tls_hint(url, source),
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

/// True when lapin failed on a frame it could not parse: a delivery with a short string
/// that is not UTF-8 (see [`unreadable`]). lapin fails the whole connection on it.
pub fn is_unreadable_frame(error: &lapin::Error) -> bool {
    matches!(error.kind(), lapin::ErrorKind::ParsingError(_))
}

/// Opens a channel in publisher-confirm mode.
pub async fn confirm_channel(connection: &Connection) -> Result<Channel, lapin::Error> {
    let channel = connection.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    Ok(channel)
}

/// What the broker said of a confirmed, mandatory publish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Published {
    /// Confirmed and routed to at least one queue.
    Routed,
    /// Confirmed but returned: no queue was bound for it (312 NO_ROUTE).
    Returned {
        /// The broker's reply code.
        code: u16,
        /// The broker's reply text.
        text: String,
    },
    /// The broker refused it (a nack: for example a full queue with `reject-publish`).
    Nacked,
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

/// The broker's text when it refused a publish for its body size (406, "larger than
/// configured max size"); the channel is closed.
pub(crate) fn size_refusal(error: &lapin::Error) -> Option<String> {
    match error.kind() {
        lapin::ErrorKind::ProtocolError(amqp)
            if amqp.get_id() == 406 && amqp.get_message().as_str().contains("max size") =>
        {
            Some(amqp.get_message().to_string())
        }
        _ => None,
    }
}
