//! A bare AMQP 0-9-1 connection that reads frames as bytes. lapin's parser fails a whole
//! connection on a frame it cannot read (a short string that is not UTF-8, which the
//! broker passes on as published); this connection hands such frames over unparsed, so
//! that [`super::unreadable`] can take the message out of the work queue. It does the
//! handshake and one channel, and no more: no heartbeats (it asks for none and lives
//! seconds), no recovery.

use std::io;

use amq_protocol::frame::{AMQPContentHeader, AMQPFrame, WriteContext, gen_frame};
use amq_protocol::protocol::{AMQPClass, basic, channel, confirm, connection};
use futures::io::BufReader;
use futures::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::uri::{AMQPScheme, AMQPUri, SASLMechanism};
use thiserror::Error;

use super::tls;
use crate::config::BrokerUrl;

/// The frame type of a method.
pub const FRAME_METHOD: u8 = 1;
/// The frame type of a content header.
pub const FRAME_HEADER: u8 = 2;
/// The frame type of a content body.
pub const FRAME_BODY: u8 = 3;
/// The frame type of a heartbeat.
const FRAME_HEARTBEAT: u8 = 8;
/// The byte that ends every frame.
const FRAME_END: u8 = 0xCE;
/// The one channel a bare connection opens.
pub const CHANNEL: u16 = 1;
/// The frame size asked for when the broker sets no limit (RabbitMQ's default).
const DEFAULT_FRAME_MAX: u32 = 131_072;

/// Why a bare connection failed.
#[derive(Debug, Error)]
pub enum BareError {
    /// The socket failed.
    #[error(transparent)]
    Io(#[from] io::Error),
    /// The broker closed the connection or the channel.
    #[error("the broker closed the {what}: {code} {text}")]
    Closed {
        /// `connection` or `channel`.
        what: &'static str,
        /// The reply code.
        code: u16,
        /// The reply text.
        text: String,
    },
    /// The broker sent something this connection does not expect.
    #[error("unexpected from the broker: {0}")]
    Unexpected(String),
    /// The broker URL or its TLS files.
    #[error("{0}")]
    Setup(String),
}

/// A bare connection to `url`, named `name` (shown in the management UI), over TLS when
/// the URL says so, with its channel [`CHANNEL`] open.
pub async fn connect(
    url: &BrokerUrl,
    name: &str,
) -> Result<Bare<impl AsyncRead + AsyncWrite + Unpin + use<>>, BareError> {
    let (stream, uri) = open_stream(url).await?;
    Bare::open(BufReader::new(stream), &uri, name).await
}

/// A socket to the broker of `url`, over TLS when the URL says so (with its TLS files, read
/// now), and the URL parsed: what [`Bare::open`] and [`Bare::handshake`] open AMQP on.
pub async fn open_stream(
    url: &BrokerUrl,
) -> Result<(impl AsyncRead + AsyncWrite + Unpin + Send + use<>, AMQPUri), BareError> {
    let uri: AMQPUri = url
        .expose()
        .parse()
        .map_err(|e| BareError::Setup(format!("the broker URL: {e}")))?;
    let tls = match (url.tls(), &uri.scheme) {
        (Some(files), _) => Some((
            tls::read(files).map_err(|e| BareError::Setup(e.to_string()))?,
            files.server_name.clone(),
        )),
        (None, AMQPScheme::AMQPS) => Some((Default::default(), None)),
        (None, AMQPScheme::AMQP) => None,
    };
    let server_name = tls.as_ref().and_then(|(_, name)| name.clone());
    let stream = tls::stream(&uri, server_name.as_deref(), tls.map(|(config, _)| config)).await?;
    Ok((stream, uri))
}

/// A frame as read: its type, channel and payload.
#[derive(Debug)]
pub struct RawFrame {
    /// [`FRAME_METHOD`], [`FRAME_HEADER`] or [`FRAME_BODY`].
    pub kind: u8,
    /// The channel it came on.
    pub channel: u16,
    /// The payload, as sent.
    pub payload: Vec<u8>,
}

impl RawFrame {
    /// The method this frame carries, when it is a method frame lapin's parser reads.
    pub fn method(&self) -> Option<AMQPClass> {
        if self.kind != FRAME_METHOD {
            return None;
        }
        amq_protocol::protocol::parse_class(&self.payload[..])
            .ok()
            .map(|(_, class)| class)
    }
}

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

/// An open bare connection with its channel [`CHANNEL`] open.
pub struct Bare<S> {
    stream: S,
    frame_max: u32,
}

impl<S: AsyncRead + AsyncWrite + Unpin> Bare<S> {
    /// Opens AMQP on `stream` to the broker of `uri` (its credentials and virtual host;
    /// PLAIN or EXTERNAL), shown in the management UI as `name`, and opens the channel.
    pub async fn open(stream: S, uri: &AMQPUri, name: &str) -> Result<Self, BareError> {
        let (mut bare, _, _) = Self::handshake(stream, uri, name, 0).await?;
        bare.send_method(
            CHANNEL,
            AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
        )
        .await?;
        bare.expect(CHANNEL, |m| {
            matches!(m, AMQPClass::Channel(channel::AMQPMethod::OpenOk(_)))
        })
        .await?;
        Ok(bare)
    }

    /// Opens AMQP on `stream` as [`Bare::open`] does, asking for heartbeats every
    /// `heartbeat` seconds (`0`: none; the URL's `heartbeat` instead when it has one; a
    /// lower proposal of the broker wins), and opens no channel. The URL's `frame_max` and
    /// `channel_max` lower the broker's offer. Gives the limits agreed with the broker, and
    /// the `version` the broker announced in its server properties.
    pub async fn handshake(
        stream: S,
        uri: &AMQPUri,
        name: &str,
        heartbeat: u16,
    ) -> Result<(Self, Tuned, Option<String>), BareError> {
        let mut bare = Bare {
            stream,
            frame_max: DEFAULT_FRAME_MAX,
        };
        bare.stream.write_all(b"AMQP\x00\x00\x09\x01").await?;
        let version = match bare.next_method(0).await? {
            AMQPClass::Connection(connection::AMQPMethod::Start(start)) => {
                match start.server_properties.inner().get("version") {
                    Some(AMQPValue::LongString(version)) => {
                        Some(String::from_utf8_lossy(version.as_bytes()).into_owned())
                    }
                    _ => None,
                }
            }
            other => return Err(BareError::Unexpected(format!("{other:?}"))),
        };
        let userinfo = &uri.authority.userinfo;
        let mechanism = uri.query.auth_mechanism.unwrap_or_default();
        let response = match mechanism {
            SASLMechanism::Plain => format!("\0{}\0{}", userinfo.username, userinfo.password),
            SASLMechanism::External => String::new(),
            other => {
                return Err(BareError::Unexpected(format!(
                    "the {} login mechanism (only PLAIN and EXTERNAL here)",
                    other.name()
                )));
            }
        };
        let mut client_properties = FieldTable::default();
        client_properties.insert(
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
        client_properties.insert("capabilities".into(), AMQPValue::FieldTable(capabilities));
        bare.send_method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
                client_properties,
                mechanism: mechanism.name().into(),
                response: LongString::from(response),
                locale: "en_US".into(),
            })),
        )
        .await?;
        let tune = match bare.next_method(0).await? {
            AMQPClass::Connection(connection::AMQPMethod::Tune(tune)) => tune,
            AMQPClass::Connection(connection::AMQPMethod::Close(close)) => {
                return Err(BareError::Closed {
                    what: "connection",
                    code: close.reply_code,
                    text: close.reply_text.to_string(),
                });
            }
            other => {
                return Err(BareError::Unexpected(format!(
                    "{other:?} (connection.tune)"
                )));
            }
        };
        // The URL's `frame_max`, `channel_max` and `heartbeat` ask for less than the
        // broker offers (as lapin reads them); AMQP's smallest frame_max is 4096.
        let query = &uri.query;
        let asked_frame_max = query
            .frame_max
            .map_or(DEFAULT_FRAME_MAX, |max| max.clamp(4096, DEFAULT_FRAME_MAX));
        bare.frame_max = match tune.frame_max {
            0 => asked_frame_max,
            offered => offered.min(asked_frame_max),
        };
        let heartbeat = query.heartbeat.unwrap_or(heartbeat);
        let offered_channels = match tune.channel_max {
            0 => u16::MAX,
            max => max,
        };
        let tuned = Tuned {
            frame_max: bare.frame_max,
            channel_max: match query.channel_max {
                Some(asked) if asked > 0 => offered_channels.min(asked),
                _ => offered_channels,
            },
            heartbeat: match (tune.heartbeat, heartbeat) {
                (_, 0) => 0,
                (0, asked) => asked,
                (offered, asked) => offered.min(asked),
            },
        };
        bare.send_method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::TuneOk(connection::TuneOk {
                channel_max: tuned.channel_max,
                frame_max: bare.frame_max,
                heartbeat: tuned.heartbeat,
            })),
        )
        .await?;
        bare.send_method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Open(connection::Open {
                virtual_host: uri.vhost.as_str().into(),
            })),
        )
        .await?;
        bare.expect(0, |m| {
            matches!(m, AMQPClass::Connection(connection::AMQPMethod::OpenOk(_)))
        })
        .await?;
        Ok((bare, tuned, version))
    }

    /// The stream, for a connection that takes over after [`Bare::handshake`].
    pub fn into_stream(self) -> S {
        self.stream
    }

    /// Sends `method` on `channel` and waits for the broker's next method there, which must
    /// be what `is_reply` accepts.
    pub async fn call(
        &mut self,
        method: AMQPClass,
        is_reply: impl Fn(&AMQPClass) -> bool,
    ) -> Result<AMQPClass, BareError> {
        self.send_method(CHANNEL, method).await?;
        self.expect(CHANNEL, is_reply).await
    }

    /// Puts the channel in publisher-confirm mode.
    pub async fn confirm_select(&mut self) -> Result<(), BareError> {
        self.call(
            AMQPClass::Confirm(confirm::AMQPMethod::Select(confirm::Select {
                nowait: false,
            })),
            |m| matches!(m, AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(_))),
        )
        .await?;
        Ok(())
    }

    /// Consumes `queue` with `arguments`, at most `window` deliveries unacked; gives the
    /// consumer tag.
    pub async fn consume(
        &mut self,
        queue: &str,
        window: u16,
        arguments: FieldTable,
    ) -> Result<ShortString, BareError> {
        self.call(
            AMQPClass::Basic(basic::AMQPMethod::Qos(basic::Qos {
                prefetch_count: window.max(1),
                global: false,
            })),
            |m| matches!(m, AMQPClass::Basic(basic::AMQPMethod::QosOk(_))),
        )
        .await?;
        let consume = AMQPClass::Basic(basic::AMQPMethod::Consume(basic::Consume {
            queue: queue.into(),
            consumer_tag: ShortString::from(""),
            no_local: false,
            no_ack: false,
            exclusive: false,
            nowait: false,
            arguments,
        }));
        match self
            .call(consume, |m| {
                matches!(m, AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(_)))
            })
            .await?
        {
            AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(ok)) => Ok(ok.consumer_tag),
            _ => unreachable!("call returns the reply it accepted"),
        }
    }

    /// Acks deliveries, each `(tag, multiple)` (`multiple` acks every one up to `tag`), in
    /// one write.
    pub async fn ack(
        &mut self,
        acks: impl IntoIterator<Item = (u64, bool)>,
    ) -> Result<(), BareError> {
        let mut bytes = Vec::new();
        for (delivery_tag, multiple) in acks {
            bytes.extend(encode(&AMQPFrame::Method(
                CHANNEL,
                AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
                    delivery_tag,
                    multiple,
                })),
            ))?);
        }
        self.stream.write_all(&bytes).await?;
        Ok(())
    }

    /// Sends `method` on `channel`.
    pub async fn send_method(&mut self, channel: u16, method: AMQPClass) -> Result<(), BareError> {
        self.send(&AMQPFrame::Method(channel, method)).await
    }

    /// Publishes `body` with `properties` on the channel (the method, its content header and
    /// the body in frames of at most the negotiated size).
    pub async fn publish(
        &mut self,
        publish: basic::Publish,
        properties: basic::AMQPProperties,
        body: &[u8],
    ) -> Result<(), BareError> {
        let mut frames = vec![
            AMQPFrame::Method(
                CHANNEL,
                AMQPClass::Basic(basic::AMQPMethod::Publish(publish)),
            ),
            AMQPFrame::Header(
                CHANNEL,
                AMQPContentHeader {
                    class_id: 60,
                    body_size: body.len() as u64,
                    properties,
                },
            ),
        ];
        // Frame header (7 bytes) and end byte.
        let chunk = (self.frame_max as usize).saturating_sub(8).max(1);
        frames.extend(
            body.chunks(chunk)
                .map(|part| AMQPFrame::Body(CHANNEL, part.to_vec())),
        );
        let mut bytes = Vec::new();
        for frame in &frames {
            bytes.extend(encode(frame)?);
        }
        self.stream.write_all(&bytes).await?;
        Ok(())
    }

    /// The next frame the broker sends, heartbeats skipped. A `connection.close` or a
    /// `channel.close` is answered and becomes [`BareError::Closed`].
    pub async fn read(&mut self) -> Result<RawFrame, BareError> {
        loop {
            let mut head = [0u8; 7];
            self.stream.read_exact(&mut head).await?;
            let channel = u16::from_be_bytes([head[1], head[2]]);
            let size = u32::from_be_bytes([head[3], head[4], head[5], head[6]]) as usize;
            if size > self.frame_max as usize {
                return Err(BareError::Unexpected(format!(
                    "a frame of {size} bytes (frame_max {})",
                    self.frame_max
                )));
            }
            let mut payload = vec![0u8; size + 1];
            self.stream.read_exact(&mut payload).await?;
            if payload.pop() != Some(FRAME_END) {
                return Err(BareError::Unexpected("a frame without its end byte".into()));
            }
            let frame = RawFrame {
                kind: head[0],
                channel,
                payload,
            };
            match frame.method() {
                Some(AMQPClass::Connection(connection::AMQPMethod::Close(close))) => {
                    let _ = self
                        .send_method(
                            0,
                            AMQPClass::Connection(connection::AMQPMethod::CloseOk(
                                connection::CloseOk {},
                            )),
                        )
                        .await;
                    return Err(BareError::Closed {
                        what: "connection",
                        code: close.reply_code,
                        text: close.reply_text.to_string(),
                    });
                }
                Some(AMQPClass::Channel(channel::AMQPMethod::Close(close))) => {
                    let _ = self
                        .send_method(
                            frame.channel,
                            AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
                        )
                        .await;
                    return Err(BareError::Closed {
                        what: "channel",
                        code: close.reply_code,
                        text: close.reply_text.to_string(),
                    });
                }
                _ if frame.kind == FRAME_HEARTBEAT => continue,
                _ => return Ok(frame),
            }
        }
    }

    /// Closes the connection (the broker requeues every delivery not acked). Best effort:
    /// the socket closes with it either way.
    pub async fn close(mut self) {
        let close = AMQPClass::Connection(connection::AMQPMethod::Close(connection::Close {
            reply_code: 200,
            reply_text: ShortString::from("done"),
            class_id: 0,
            method_id: 0,
        }));
        if self.send_method(0, close).await.is_ok() {
            let _ = self
                .expect(0, |m| {
                    matches!(m, AMQPClass::Connection(connection::AMQPMethod::CloseOk(_)))
                })
                .await;
        }
        let _ = self.stream.close().await;
    }

    async fn send(&mut self, frame: &AMQPFrame) -> Result<(), BareError> {
        self.stream.write_all(&encode(frame)?).await?;
        Ok(())
    }

    /// The next method on `channel`, parsed (other frames before it are an error).
    async fn next_method(&mut self, channel: u16) -> Result<AMQPClass, BareError> {
        let frame = self.read().await?;
        match frame.method() {
            Some(method) if frame.channel == channel => Ok(method),
            _ => Err(BareError::Unexpected(format!(
                "a frame of type {} on channel {} where a method on channel {channel} was due",
                frame.kind, frame.channel
            ))),
        }
    }

    async fn expect(
        &mut self,
        channel: u16,
        is_reply: impl Fn(&AMQPClass) -> bool,
    ) -> Result<AMQPClass, BareError> {
        let method = self.next_method(channel).await?;
        if is_reply(&method) {
            Ok(method)
        } else {
            Err(BareError::Unexpected(format!("{method:?}")))
        }
    }
}

/// `frame`'s bytes on the wire.
fn encode(frame: &AMQPFrame) -> Result<Vec<u8>, BareError> {
    gen_frame(frame)(WriteContext::from(Vec::new()))
        .map(|written| written.write)
        .map_err(|e| BareError::Unexpected(format!("encoding a frame: {e:?}")))
}
