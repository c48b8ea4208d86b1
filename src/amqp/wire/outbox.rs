//! The bytes waiting to be written, and the task that writes them. Whoever sends a frame
//! encodes it into the outbox under one lock and wakes the writer; the writer takes all that
//! is queued and writes it in one go. So the frames of many publishes and acks made in one
//! turn of the caller's tasks leave in one write, and no thread is woken for any of them.

use std::sync::{Mutex, PoisonError};

use amq_protocol::frame::{AMQPFrame, WriteContext, gen_frame};
use amq_protocol::protocol::basic::gen_properties;
use amq_protocol::protocol::{AMQPClass, BasicProperties};
use futures::{AsyncWrite, AsyncWriteExt};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::WireError;

/// The class id of `basic`, the only class with content.
const BASIC_CLASS: u16 = 60;
/// The frame type of a method.
const FRAME_METHOD: u8 = 1;
/// The method ids of `basic.publish`, `basic.ack` and `basic.nack`.
const BASIC_PUBLISH: u16 = 40;
const BASIC_ACK: u16 = 80;
const BASIC_NACK: u16 = 120;
/// A frame's header (type, channel, size) and end byte.
const FRAME_OVERHEAD: usize = 8;
/// How long the writer tries to write its last frame (a `close-ok`) once the connection
/// has failed.
const FAREWELL_WITHIN: std::time::Duration = std::time::Duration::from_secs(1);

/// Frames encoded and not yet written.
pub(super) struct Outbox {
    queued: Mutex<Queued>,
    ready: Notify,
    /// The largest frame the broker takes, overhead included.
    frame_max: usize,
}

struct Queued {
    /// Encoded frames, in the order they were sent.
    bytes: Vec<u8>,
    /// Why nothing more is taken, once the connection failed.
    closed: Option<WireError>,
    /// Where a frame is encoded before it joins `bytes` (so a frame that fails to encode
    /// leaves the queued ones whole).
    scratch: Vec<u8>,
}

impl Outbox {
    /// An empty outbox for frames of at most `frame_max` bytes.
    pub(super) fn new(frame_max: u32) -> Self {
        Self {
            queued: Mutex::new(Queued {
                bytes: Vec::new(),
                closed: None,
                scratch: Vec::new(),
            }),
            ready: Notify::new(),
            frame_max: frame_max as usize,
        }
    }

    /// Queues the frames `write` encodes, all together or none, and wakes the writer.
    pub(super) fn send(
        &self,
        write: impl FnOnce(&mut Frames<'_>) -> Result<(), WireError>,
    ) -> Result<(), WireError> {
        let mut queued = self.queued.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(error) = &queued.closed {
            return Err(error.clone());
        }
        let queued = &mut *queued;
        queued.scratch.clear();
        let mut frames = Frames {
            bytes: &mut queued.scratch,
            frame_max: self.frame_max,
        };
        write(&mut frames)?;
        queued.bytes.extend_from_slice(&queued.scratch);
        self.ready.notify_one();
        Ok(())
    }

    /// Takes no more frames: every later [`Outbox::send`] fails with `error`, and what was
    /// queued is not written (after a [`Outbox::farewell`], only its frame is).
    pub(super) fn close(&self, error: &WireError) {
        let mut queued = self.queued.lock().unwrap_or_else(PoisonError::into_inner);
        if queued.closed.is_none() {
            queued.closed = Some(error.clone());
            queued.bytes.clear();
        }
    }

    /// Closes with `error` like [`Outbox::close`], keeping one last frame to write: the
    /// `connection.close-ok` that answers the broker's `connection.close`.
    pub(super) fn farewell(
        &self,
        error: &WireError,
        write: impl FnOnce(&mut Frames<'_>) -> Result<(), WireError>,
    ) {
        let mut queued = self.queued.lock().unwrap_or_else(PoisonError::into_inner);
        if queued.closed.is_some() {
            return;
        }
        queued.closed = Some(error.clone());
        queued.bytes.clear();
        let mut frames = Frames {
            bytes: &mut queued.bytes,
            frame_max: self.frame_max,
        };
        let _ = write(&mut frames);
        self.ready.notify_one();
    }

    /// Writes what is queued to `writer` as it comes, until `stop`; then closes `writer`.
    pub(super) async fn write_to<W: AsyncWrite + Unpin>(
        &self,
        mut writer: W,
        stop: &CancellationToken,
    ) -> Result<(), WireError> {
        let mut writing = Vec::new();
        loop {
            tokio::select! {
                biased;
                _ = stop.cancelled() => break,
                _ = self.ready.notified() => {}
            }
            {
                let mut queued = self.queued.lock().unwrap_or_else(PoisonError::into_inner);
                std::mem::swap(&mut queued.bytes, &mut writing);
            }
            if writing.is_empty() {
                continue;
            }
            writer.write_all(&writing).await.map_err(WireError::io)?;
            writer.flush().await.map_err(WireError::io)?;
            writing.clear();
        }
        // A farewell is all a closed outbox still holds; a peer that does not read it
        // within a moment does not keep the writer.
        let last = std::mem::take(
            &mut self
                .queued
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .bytes,
        );
        if !last.is_empty() {
            let _ = tokio::time::timeout(FAREWELL_WITHIN, async {
                writer.write_all(&last).await?;
                writer.flush().await
            })
            .await;
        }
        let _ = writer.close().await;
        Ok(())
    }
}

/// Encodes frames into the outbox.
pub(super) struct Frames<'a> {
    bytes: &'a mut Vec<u8>,
    frame_max: usize,
}

impl Frames<'_> {
    /// A method frame.
    pub(super) fn method(&mut self, channel: u16, method: AMQPClass) -> Result<(), WireError> {
        self.frame(&AMQPFrame::Method(channel, method))
    }

    /// A `basic.publish` method frame, encoded in place: the per-message methods
    /// (publish, ack, nack) do not go through [`AMQPClass`], whose names and flags are
    /// owned and allocated for every frame. An exchange or routing key longer than a short
    /// string (255 bytes) is refused, as the broker would refuse it.
    pub(super) fn publish(
        &mut self,
        channel: u16,
        exchange: &str,
        routing_key: &str,
        mandatory: bool,
    ) -> Result<(), WireError> {
        for (what, name) in [("exchange", exchange), ("routing key", routing_key)] {
            if name.len() > usize::from(u8::MAX) {
                return Err(WireError::Unexpected(format!(
                    "a publish's {what} of {} bytes (at most 255)",
                    name.len()
                )));
            }
        }
        let start = self.method_start(channel, BASIC_PUBLISH);
        self.bytes.extend_from_slice(&0u16.to_be_bytes()); // reserved (ticket)
        for name in [exchange, routing_key] {
            self.bytes.push(name.len() as u8);
            self.bytes.extend_from_slice(name.as_bytes());
        }
        self.bytes.push(u8::from(mandatory)); // immediate: never
        self.method_end(start);
        Ok(())
    }

    /// A `basic.ack` or `basic.nack` method frame, encoded in place (see
    /// [`Frames::publish`]).
    pub(super) fn settle(&mut self, channel: u16, settle: super::channel::Settle) {
        use super::channel::Settle;
        let (method, tag, bits) = match settle {
            Settle::Ack { tag, multiple } => (BASIC_ACK, tag, u8::from(multiple)),
            Settle::Nack {
                tag,
                multiple,
                requeue,
            } => (
                BASIC_NACK,
                tag,
                u8::from(multiple) | (u8::from(requeue) << 1),
            ),
        };
        let start = self.method_start(channel, method);
        self.bytes.extend_from_slice(&tag.to_be_bytes());
        self.bytes.push(bits);
        self.method_end(start);
    }

    /// Starts a method frame of class `basic` (its size filled in by
    /// [`Frames::method_end`]); returns where it starts.
    fn method_start(&mut self, channel: u16, method: u16) -> usize {
        let start = self.bytes.len();
        self.bytes.push(FRAME_METHOD);
        self.bytes.extend_from_slice(&channel.to_be_bytes());
        self.bytes.extend_from_slice(&[0; 4]);
        self.bytes.extend_from_slice(&BASIC_CLASS.to_be_bytes());
        self.bytes.extend_from_slice(&method.to_be_bytes());
        start
    }

    /// Ends the method frame begun at `start`: its size, then the end byte.
    fn method_end(&mut self, start: usize) {
        let size = self.bytes.len() - start - 7;
        self.bytes[start + 3..start + 7].copy_from_slice(&(size as u32).to_be_bytes());
        self.bytes.push(super::FRAME_END);
    }

    /// A content header and `body` in frames of at most the agreed size.
    pub(super) fn content(
        &mut self,
        channel: u16,
        properties: &BasicProperties,
        body: &[u8],
    ) -> Result<(), WireError> {
        // The content header by hand, so that the properties are encoded where they are.
        let start = self.bytes.len();
        self.bytes.push(super::FRAME_HEADER);
        self.bytes.extend_from_slice(&channel.to_be_bytes());
        self.bytes.extend_from_slice(&[0; 4]);
        self.bytes.extend_from_slice(&BASIC_CLASS.to_be_bytes());
        self.bytes.extend_from_slice(&0u16.to_be_bytes());
        self.bytes
            .extend_from_slice(&(body.len() as u64).to_be_bytes());
        let bytes = std::mem::take(self.bytes);
        let written = gen_properties(properties)(WriteContext::from(bytes))
            .map_err(|e| WireError::Unexpected(format!("encoding properties: {e:?}")))?;
        *self.bytes = written.write;
        let size = self.bytes.len() - start - 7;
        if size + FRAME_OVERHEAD > self.frame_max {
            self.bytes.truncate(start);
            return Err(WireError::HeaderTooLarge {
                header: size + FRAME_OVERHEAD,
                frame_max: self.frame_max,
            });
        }
        self.bytes[start + 3..start + 7].copy_from_slice(&(size as u32).to_be_bytes());
        self.bytes.push(super::FRAME_END);
        let chunk = self.frame_max.saturating_sub(FRAME_OVERHEAD).max(1);
        for part in body.chunks(chunk) {
            self.bytes.push(super::FRAME_BODY);
            self.bytes.extend_from_slice(&channel.to_be_bytes());
            self.bytes
                .extend_from_slice(&(part.len() as u32).to_be_bytes());
            self.bytes.extend_from_slice(part);
            self.bytes.push(super::FRAME_END);
        }
        Ok(())
    }

    /// A heartbeat.
    pub(super) fn heartbeat(&mut self) {
        self.bytes
            .extend_from_slice(&[super::FRAME_HEARTBEAT, 0, 0, 0, 0, 0, 0, super::FRAME_END]);
    }

    fn frame(&mut self, frame: &AMQPFrame) -> Result<(), WireError> {
        let bytes = std::mem::take(self.bytes);
        let written = gen_frame(frame)(WriteContext::from(bytes))
            .map_err(|e| WireError::Unexpected(format!("encoding a frame: {e:?}")))?;
        *self.bytes = written.write;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use amq_protocol::types::{AMQPValue, FieldTable, LongString};

    use super::*;

    /// The method frames encoded in place are the bytes amq-protocol writes for them.
    #[test]
    fn methods_encoded_in_place_match_the_codec() {
        use super::super::channel::Settle;
        use amq_protocol::protocol::basic;
        let encoded = |write: &dyn Fn(&mut Frames<'_>)| {
            let mut bytes = Vec::new();
            write(&mut Frames {
                bytes: &mut bytes,
                frame_max: 131_072,
            });
            bytes
        };
        let by_codec = |channel: u16, method: basic::AMQPMethod| {
            encoded(&|frames| {
                frames
                    .method(channel, AMQPClass::Basic(method.clone()))
                    .unwrap()
            })
        };
        let long = "k".repeat(255);
        for (channel, exchange, key, mandatory) in [
            (1, "", "q", false),
            (7, "orders.delay", "order.created", true),
            (65535, "x", long.as_str(), true),
        ] {
            assert_eq!(
                encoded(&|frames| frames.publish(channel, exchange, key, mandatory).unwrap()),
                by_codec(
                    channel,
                    basic::AMQPMethod::Publish(basic::Publish {
                        exchange: exchange.into(),
                        routing_key: key.into(),
                        mandatory,
                        immediate: false,
                    })
                ),
                "publish {channel} {exchange} {mandatory}"
            );
        }
        for tag in [1, 300, u64::MAX] {
            for multiple in [false, true] {
                assert_eq!(
                    encoded(&|frames| frames.settle(3, Settle::Ack { tag, multiple })),
                    by_codec(
                        3,
                        basic::AMQPMethod::Ack(basic::Ack {
                            delivery_tag: tag,
                            multiple
                        })
                    )
                );
                for requeue in [false, true] {
                    assert_eq!(
                        encoded(&|frames| frames.settle(
                            3,
                            Settle::Nack {
                                tag,
                                multiple,
                                requeue
                            }
                        )),
                        by_codec(
                            3,
                            basic::AMQPMethod::Nack(basic::Nack {
                                delivery_tag: tag,
                                multiple,
                                requeue
                            })
                        )
                    );
                }
            }
        }
        let too_long = "k".repeat(256);
        let mut bytes = Vec::new();
        let mut frames = Frames {
            bytes: &mut bytes,
            frame_max: 131_072,
        };
        assert!(frames.publish(1, "", &too_long, false).is_err());
        assert!(frames.publish(1, &too_long, "q", false).is_err());
        assert!(bytes.is_empty(), "a refused publish leaves nothing queued");
    }

    /// Properties whose headers hold `bytes` bytes of one long string.
    fn with_headers_of(bytes: usize) -> BasicProperties {
        let mut headers = FieldTable::default();
        headers.insert(
            "big".into(),
            AMQPValue::LongString(LongString::from(vec![b'x'; bytes])),
        );
        BasicProperties::default().with_headers(headers)
    }

    /// The contract's size of a content header frame (`contract::content_header_frame_len`,
    /// which the bridge checks before it publishes, parking what does not fit) is the frame
    /// written here: the two never disagree, so the outbox's refusal is never a bridge's.
    #[test]
    fn the_contracts_header_size_is_the_frame_written() {
        let mut nested = FieldTable::default();
        nested.insert("n".into(), AMQPValue::LongLongInt(-7));
        let mut headers = FieldTable::default();
        headers.insert("t".into(), AMQPValue::FieldTable(nested));
        headers.insert("b".into(), AMQPValue::Boolean(true));
        let mut deep = FieldTable::default();
        deep.insert("x".into(), AMQPValue::LongString(LongString::from("yz")));
        let mut in_array = FieldTable::default();
        in_array.insert(
            "arr".into(),
            AMQPValue::FieldArray(
                vec![
                    AMQPValue::FieldTable(deep),
                    AMQPValue::FieldArray(vec![AMQPValue::ShortInt(3)].into()),
                    AMQPValue::Double(1.5),
                ]
                .into(),
            ),
        );
        headers.insert("deep".into(), AMQPValue::FieldTable(in_array));
        let cases = [
            BasicProperties::default(),
            with_headers_of(10),
            with_headers_of(3000),
            BasicProperties::default()
                .with_message_id("m-1".into())
                .with_timestamp(5)
                .with_delivery_mode(2)
                .with_expiration("60000".into())
                .with_headers(headers),
        ];
        for properties in cases {
            let mut bytes = Vec::new();
            let mut frames = Frames {
                bytes: &mut bytes,
                frame_max: 1 << 20,
            };
            frames.content(1, &properties, b"").expect("encoded");
            assert_eq!(
                bytes.len(),
                crate::contract::content_header_frame_len(&properties),
                "{properties:?}"
            );
        }
    }

    /// A content header over `frame_max` is refused before anything is queued: the broker
    /// closes the whole connection for one (501), which cost the typed client its only
    /// connection for one oversized `schedule`.
    #[test]
    fn a_content_header_over_frame_max_is_refused_and_nothing_is_queued() {
        let outbox = Outbox::new(4096);
        let refused = outbox.send(|frames| {
            frames.publish(1, "x", "k", true)?;
            frames.content(1, &with_headers_of(5000), b"body")
        });
        match refused {
            Err(WireError::HeaderTooLarge { header, frame_max }) => {
                assert!(header > 5000, "{header}");
                assert_eq!(frame_max, 4096);
            }
            other => panic!("expected HeaderTooLarge, got {other:?}"),
        }
        assert!(
            outbox.queued.lock().unwrap().bytes.is_empty(),
            "nothing queued"
        );
        // A header that fits, with a body over several frames, goes.
        outbox
            .send(|frames| frames.content(1, &with_headers_of(3000), &[7; 10_000]))
            .expect("a header within frame_max");
        let queued = outbox.queued.lock().unwrap().bytes.len();
        assert!(queued > 13_000, "{queued} bytes queued");
    }
}
