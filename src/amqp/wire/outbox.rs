//! The bytes waiting to be written, and the task that writes them. Whoever sends a frame
//! encodes it into the outbox under one lock and wakes the writer; the writer takes all that
//! is queued and writes it in one go. So the frames of many publishes and acks made in one
//! turn of the caller's tasks leave in one write, and no thread is woken for any of them.

use std::sync::Mutex;

use amq_protocol::frame::{AMQPFrame, WriteContext, gen_frame};
use amq_protocol::protocol::basic::gen_properties;
use amq_protocol::protocol::{AMQPClass, BasicProperties};
use futures::{AsyncWrite, AsyncWriteExt};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::WireError;

/// The class id of `basic`, the only class with content.
const BASIC_CLASS: u16 = 60;
/// A frame's header (type, channel, size) and end byte.
const FRAME_OVERHEAD: usize = 8;

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
        let mut queued = self.queued.lock().expect("outbox lock");
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

    /// Takes no more frames: every later [`Outbox::send`] fails with `error`.
    pub(super) fn close(&self, error: &WireError) {
        let mut queued = self.queued.lock().expect("outbox lock");
        queued.closed.get_or_insert_with(|| error.clone());
        queued.bytes.clear();
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
                let mut queued = self.queued.lock().expect("outbox lock");
                std::mem::swap(&mut queued.bytes, &mut writing);
            }
            if writing.is_empty() {
                continue;
            }
            writer.write_all(&writing).await.map_err(WireError::io)?;
            writer.flush().await.map_err(WireError::io)?;
            writing.clear();
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
        let size = (self.bytes.len() - start - 7) as u32;
        self.bytes[start + 3..start + 7].copy_from_slice(&size.to_be_bytes());
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
