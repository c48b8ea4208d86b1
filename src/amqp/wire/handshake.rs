//! Opening AMQP 0-9-1 on a socket: the protocol header, `connection.start` (the broker's
//! version), the login (PLAIN or EXTERNAL), `connection.tune` (the limits both sides
//! keep) and `connection.open` of the virtual host. Sequential frame by frame, before the
//! connection's reader and writer tasks take the socket over; every write is flushed, so
//! nothing waits in a TLS buffer.

use amq_protocol::frame::{AMQPFrame, WriteContext, gen_frame};
use amq_protocol::protocol::{AMQPClass, connection};
use futures::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::uri::{AMQPScheme, AMQPUri, SASLMechanism};

use super::{FRAME_END, FRAME_HEARTBEAT, WireError};
use crate::amqp::tls;
use crate::config::BrokerUrl;

/// The frame type of a method.
const FRAME_METHOD: u8 = 1;
/// The frame size asked for when the broker sets no limit (RabbitMQ's default).
const DEFAULT_FRAME_MAX: u32 = 131_072;
/// AMQP's smallest `frame_max`.
const SMALLEST_FRAME_MAX: u32 = 4096;

/// The limits agreed in the handshake.
#[derive(Debug, Clone, Copy)]
pub struct Tuned {
    /// The largest frame, bytes, header and end byte included.
    pub frame_max: u32,
    /// The highest channel number.
    pub channel_max: u16,
    /// Seconds between heartbeats (`0`: none).
    pub heartbeat: u16,
}

/// A socket to the broker of `url`, over TLS when the URL says so (with its TLS files, read
/// now), and the URL parsed.
pub(super) async fn open_stream(
    url: &BrokerUrl,
) -> Result<(impl AsyncRead + AsyncWrite + Unpin + Send + use<>, AMQPUri), WireError> {
    let uri: AMQPUri = url
        .expose()
        .parse()
        .map_err(|e| WireError::Setup(format!("the broker URL: {e}")))?;
    let tls = match (url.tls(), &uri.scheme) {
        (Some(files), _) => Some((
            tls::read(files).map_err(|e| WireError::Setup(e.to_string()))?,
            files.server_name.clone(),
        )),
        (None, AMQPScheme::AMQPS) => Some((Default::default(), None)),
        (None, AMQPScheme::AMQP) => None,
    };
    let server_name = tls.as_ref().and_then(|(_, name)| name.clone());
    let stream = tls::stream(&uri, server_name.as_deref(), tls.map(|(config, _)| config))
        .await
        .map_err(WireError::io)?;
    Ok((stream, uri))
}

/// Opens AMQP on `stream` to the broker of `uri` (its credentials and virtual host; PLAIN
/// or EXTERNAL), shown in the management UI as `name`, asking for heartbeats every
/// `heartbeat` seconds (`0`: none; the URL's `heartbeat` instead when it has one; a lower
/// proposal of the broker wins). The URL's `frame_max` and `channel_max` lower the broker's
/// offer. Gives the stream, the limits agreed, and the `version` the broker announced. A
/// refused login is [`WireError::Closed`] with the broker's code (403), as the client
/// asks for (`authentication_failure_close`).
pub(super) async fn handshake<S: AsyncRead + AsyncWrite + Unpin>(
    mut stream: S,
    uri: &AMQPUri,
    name: &str,
    heartbeat: u16,
) -> Result<(S, Tuned, Option<String>), WireError> {
    let mut frame_max = DEFAULT_FRAME_MAX;
    write(&mut stream, b"AMQP\x00\x00\x09\x01").await?;
    let version = match next_method(&mut stream, frame_max).await? {
        AMQPClass::Connection(connection::AMQPMethod::Start(start)) => {
            match start.server_properties.inner().get("version") {
                Some(AMQPValue::LongString(version)) => {
                    Some(String::from_utf8_lossy(version.as_bytes()).into_owned())
                }
                _ => None,
            }
        }
        other => return Err(unexpected(&other, "connection.start")),
    };
    let userinfo = &uri.authority.userinfo;
    let mechanism = uri.query.auth_mechanism.unwrap_or_default();
    let response = match mechanism {
        SASLMechanism::Plain => format!("\0{}\0{}", userinfo.username, userinfo.password),
        SASLMechanism::External => String::new(),
        other => {
            return Err(WireError::Setup(format!(
                "the {} login mechanism (only PLAIN and EXTERNAL here)",
                other.name()
            )));
        }
    };
    let start_ok = connection::StartOk {
        client_properties: client_properties(name),
        mechanism: mechanism.name().into(),
        response: LongString::from(response),
        locale: "en_US".into(),
    };
    send(
        &mut stream,
        AMQPClass::Connection(connection::AMQPMethod::StartOk(start_ok)),
    )
    .await?;
    let tune = match next_method(&mut stream, frame_max).await? {
        AMQPClass::Connection(connection::AMQPMethod::Tune(tune)) => tune,
        other => return Err(unexpected(&other, "connection.tune")),
    };
    let tuned = agree(&tune, uri, heartbeat);
    frame_max = tuned.frame_max;
    send(
        &mut stream,
        AMQPClass::Connection(connection::AMQPMethod::TuneOk(connection::TuneOk {
            channel_max: tuned.channel_max,
            frame_max: tuned.frame_max,
            heartbeat: tuned.heartbeat,
        })),
    )
    .await?;
    send(
        &mut stream,
        AMQPClass::Connection(connection::AMQPMethod::Open(connection::Open {
            virtual_host: uri.vhost.as_str().into(),
        })),
    )
    .await?;
    match next_method(&mut stream, frame_max).await? {
        AMQPClass::Connection(connection::AMQPMethod::OpenOk(_)) => {}
        other => return Err(unexpected(&other, "connection.open-ok")),
    }
    Ok((stream, tuned, version))
}

/// The limits both sides keep: the lower of the broker's offer and what the URL asks
/// (`frame_max` at least AMQP's smallest, 4096); heartbeats every `heartbeat` seconds or the
/// URL's interval when it names one, the broker's when lower; none when this side asks
/// for none.
fn agree(tune: &connection::Tune, uri: &AMQPUri, heartbeat: u16) -> Tuned {
    let query = &uri.query;
    let asked_frame_max = query.frame_max.map_or(DEFAULT_FRAME_MAX, |max| {
        max.clamp(SMALLEST_FRAME_MAX, DEFAULT_FRAME_MAX)
    });
    let offered_channels = match tune.channel_max {
        0 => u16::MAX,
        max => max,
    };
    Tuned {
        frame_max: match tune.frame_max {
            0 => asked_frame_max,
            offered => offered.min(asked_frame_max),
        },
        channel_max: match query.channel_max {
            Some(asked) if asked > 0 => offered_channels.min(asked),
            _ => offered_channels,
        },
        heartbeat: match (tune.heartbeat, query.heartbeat.unwrap_or(heartbeat)) {
            (_, 0) => 0,
            (0, asked) => asked,
            (offered, asked) => offered.min(asked),
        },
    }
}

/// The client properties: the connection's name, and what this client can do.
fn client_properties(name: &str) -> FieldTable {
    let mut properties = FieldTable::default();
    properties.insert(
        "connection_name".into(),
        AMQPValue::LongString(LongString::from(name)),
    );
    let mut capabilities = FieldTable::default();
    for capability in [
        "publisher_confirms",
        "basic.nack",
        "connection.blocked",
        "consumer_cancel_notify",
        // A refused login is then a `connection.close` with 403 ACCESS_REFUSED, not a
        // socket closed without a word (which reads as a network blip).
        "authentication_failure_close",
    ] {
        capabilities.insert(capability.into(), AMQPValue::Boolean(true));
    }
    properties.insert("capabilities".into(), AMQPValue::FieldTable(capabilities));
    properties
}

/// Sends `method` on channel 0.
async fn send<S: AsyncWrite + Unpin>(stream: &mut S, method: AMQPClass) -> Result<(), WireError> {
    let frame = AMQPFrame::Method(0, method);
    let bytes = gen_frame(&frame)(WriteContext::from(Vec::new()))
        .map(|written| written.write)
        .map_err(|e| WireError::Unexpected(format!("encoding a frame: {e:?}")))?;
    write(stream, &bytes).await
}

async fn write<S: AsyncWrite + Unpin>(stream: &mut S, bytes: &[u8]) -> Result<(), WireError> {
    stream.write_all(bytes).await.map_err(WireError::io)?;
    stream.flush().await.map_err(WireError::io)
}

/// The next method on channel 0, heartbeats skipped; a `connection.close` is the broker's
/// refusal ([`WireError::Closed`]).
async fn next_method<S: AsyncRead + Unpin>(
    stream: &mut S,
    frame_max: u32,
) -> Result<AMQPClass, WireError> {
    loop {
        let mut head = [0u8; 7];
        stream.read_exact(&mut head).await.map_err(WireError::io)?;
        let kind = head[0];
        let channel = u16::from_be_bytes([head[1], head[2]]);
        let size = u32::from_be_bytes([head[3], head[4], head[5], head[6]]);
        if size > frame_max {
            return Err(WireError::Unexpected(format!(
                "a frame of {size} bytes in the handshake (frame_max {frame_max})"
            )));
        }
        let mut payload = vec![0u8; size as usize + 1];
        stream
            .read_exact(&mut payload)
            .await
            .map_err(WireError::io)?;
        if payload.pop() != Some(FRAME_END) {
            return Err(WireError::Unexpected("a frame without its end byte".into()));
        }
        if kind == FRAME_HEARTBEAT {
            continue;
        }
        if kind != FRAME_METHOD || channel != 0 {
            return Err(WireError::Unexpected(format!(
                "a frame of type {kind} on channel {channel} in the handshake"
            )));
        }
        let (_, method) = amq_protocol::protocol::parse_class(&payload[..])
            .map_err(|e| WireError::Unreadable(format!("a handshake method: {e:?}")))?;
        if let AMQPClass::Connection(connection::AMQPMethod::Close(close)) = method {
            return Err(WireError::Closed {
                what: "connection",
                code: close.reply_code,
                text: close.reply_text.to_string(),
            });
        }
        return Ok(method);
    }
}

fn unexpected(method: &AMQPClass, due: &str) -> WireError {
    WireError::Unexpected(format!("{method:?} where {due} was due"))
}
