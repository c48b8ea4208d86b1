//! The task that reads the broker's frames and hands each to its channel.

use amq_protocol::protocol::parse_class;
use futures::{AsyncRead, AsyncReadExt};

use super::{FRAME_BODY, FRAME_END, FRAME_HEADER, FRAME_HEARTBEAT, Inner, WireError};

/// The frame type of a method.
const FRAME_METHOD: u8 = 1;

/// Reads frames from `reader` until the connection fails; gives why.
///
/// Each frame spends a unit of the task's cooperative budget: frames already buffered are
/// read without waiting, and a reader that never waited would keep the runtime's worker
/// from the other tasks (holds whose instant came, among them) for as long as frames
/// keep coming.
pub(super) async fn read_frames<R: AsyncRead + Unpin>(inner: &Inner, mut reader: R) -> WireError {
    let mut payload = Vec::new();
    loop {
        if let Err(error) = read_frame(inner, &mut reader, &mut payload).await {
            return error;
        }
        tokio::task::coop::consume_budget().await;
    }
}

async fn read_frame<R: AsyncRead + Unpin>(
    inner: &Inner,
    reader: &mut R,
    payload: &mut Vec<u8>,
) -> Result<(), WireError> {
    let mut head = [0u8; 7];
    reader.read_exact(&mut head).await.map_err(WireError::io)?;
    let kind = head[0];
    let channel = u16::from_be_bytes([head[1], head[2]]);
    let size = u32::from_be_bytes([head[3], head[4], head[5], head[6]]) as usize;
    if size > inner.tuned.frame_max as usize {
        return Err(WireError::Unexpected(format!(
            "a frame of {size} bytes (frame_max {})",
            inner.tuned.frame_max
        )));
    }
    payload.resize(size + 1, 0);
    reader.read_exact(payload).await.map_err(WireError::io)?;
    if payload.pop() != Some(FRAME_END) {
        return Err(WireError::Unexpected("a frame without its end byte".into()));
    }
    inner.heard();
    if kind == FRAME_HEARTBEAT {
        return Ok(());
    }
    if channel == 0 {
        let method = parse_method(kind, payload)?;
        return inner.on_connection_method(method);
    }
    // A frame for a channel closed here, before the broker saw the close, is dropped.
    let Some(shared) = inner.channel(channel) else {
        return Ok(());
    };
    match kind {
        FRAME_METHOD => match parse_method(kind, payload) {
            Ok(method) => shared.on_method(inner, method),
            // A delivery whose exchange or routing key is not UTF-8: its consumer gets it
            // with those as bytes (see `content`).
            Err(error) => match super::content::raw_deliver(payload) {
                Some(deliver) => shared.on_raw_deliver(deliver),
                None => Err(error),
            },
        },
        FRAME_HEADER => shared.on_header(payload),
        FRAME_BODY => shared.on_body(payload),
        other => Err(WireError::Unexpected(format!("a frame of type {other}"))),
    }
}

fn parse_method(kind: u8, payload: &[u8]) -> Result<amq_protocol::protocol::AMQPClass, WireError> {
    if kind != FRAME_METHOD {
        return Err(WireError::Unexpected(format!(
            "a frame of type {kind} on channel 0"
        )));
    }
    parse_class(payload)
        .map(|(_, method)| method)
        .map_err(|e| WireError::Unreadable(format!("a method: {e:?}")))
}
