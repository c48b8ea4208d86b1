//! The TLS files of `[tls]`, read into what the AMQP client connects with.

use std::io;
use std::path::Path;

use lapin::tcp::{AsyncTcpStream, OwnedIdentity, OwnedTLSConfig};
use lapin::uri::AMQPUri;
use lapin::{Connection, ConnectionProperties};

use crate::config::TlsFiles;

/// Reads the CA and the client certificate and key. A file that cannot be read is an error
/// naming the key and the path.
pub(super) fn read(files: &TlsFiles) -> io::Result<OwnedTLSConfig> {
    let cert_chain = files
        .ca_file
        .as_deref()
        .map(|path| read_text("tls.ca_file", path))
        .transpose()?;
    let identity = match &files.client {
        Some((cert, key)) => Some(OwnedIdentity::PKCS8 {
            pem: read_bytes("tls.cert_file", cert)?,
            key: read_bytes("tls.key_file", key)?,
        }),
        None => None,
    };
    Ok(OwnedTLSConfig {
        identity,
        cert_chain,
    })
}

/// Connects to `url` over TLS, checking the broker's certificate against `server_name`, or
/// the URL's host when there is none (the AMQP client's own connect has no separate name).
pub(super) async fn connect(
    url: &str,
    server_name: Option<&str>,
    tls: OwnedTLSConfig,
    properties: ConnectionProperties,
) -> lapin::Result<Connection> {
    let uri: AMQPUri = url
        .parse()
        .map_err(|e: String| lapin::Error::from(io::Error::new(io::ErrorKind::InvalidInput, e)))?;
    let runtime = lapin::runtime::default_runtime()?;
    let server_name = server_name.unwrap_or(&uri.authority.host).to_string();
    Connection::connector(
        uri,
        runtime,
        async move |uri, runtime| {
            let addresses =
                runtime.to_socket_addrs((uri.authority.host.clone(), uri.authority.port));
            let stream = AsyncTcpStream::connect(&runtime, addresses).await?;
            Ok(stream.into_tls(&server_name, tls.as_ref()).await?)
        },
        properties,
    )
    .await
}

/// A byte stream to the broker of `uri`, over TLS with `tls` when given (checking the
/// broker's certificate against `server_name`, or the URI's host), as lapin's own
/// connections open it. For the project's own connection ([`super::wire`]).
pub(super) async fn stream(
    uri: &AMQPUri,
    server_name: Option<&str>,
    tls: Option<OwnedTLSConfig>,
) -> io::Result<impl futures::AsyncRead + futures::AsyncWrite + Unpin + Send + use<>> {
    let runtime = lapin::runtime::default_runtime().map_err(io::Error::other)?;
    let addresses = runtime.to_socket_addrs((uri.authority.host.clone(), uri.authority.port));
    let stream = AsyncTcpStream::connect(&runtime, addresses).await?;
    match tls {
        None => Ok(stream),
        Some(tls) => {
            let server_name = server_name.unwrap_or(&uri.authority.host);
            stream.into_tls(server_name, tls.as_ref()).await
        }
    }
}

fn read_bytes(key: &str, path: &Path) -> io::Result<Vec<u8>> {
    std::fs::read(path)
        .map_err(|e| io::Error::new(e.kind(), format!("reading {key} {}: {e}", path.display())))
}

fn read_text(key: &str, path: &Path) -> io::Result<String> {
    String::from_utf8(read_bytes(key, path)?).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{key} {} is not PEM text", path.display()),
        )
    })
}
