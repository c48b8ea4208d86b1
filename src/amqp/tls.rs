//! The TLS files of `[tls]`, read into what the AMQP client connects with.

use std::io;
use std::path::Path;

use lapin::tcp::{OwnedIdentity, OwnedTLSConfig};

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
