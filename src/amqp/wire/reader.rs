//! The task that reads the broker's frames and hands each to its channel.

use amq_protocol::protocol::{AMQPClass, basic, parse_class};
use amq_protocol::types::ShortString;
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

fn parse_method(kind: u8, payload: &[u8]) -> Result<AMQPClass, WireError> {
    if kind != FRAME_METHOD {
        return Err(WireError::Unexpected(format!(
            "a frame of type {kind} on channel 0"
        )));
    }
    if let Some(method) = per_message_method(payload) {
        return Ok(method);
    }
    parse_class(payload)
        .map(|(_, method)| method)
        .map_err(|e| WireError::Unreadable(format!("a method: {e:?}")))
}

/// The methods that come with every message (`basic.ack` and `basic.nack` confirming a
/// publish, `basic.deliver`), read by hand: the codec builds each method's flags as a
/// vector of named bits, several allocations per frame. `None` for any other method, or one
/// cut short or not UTF-8 (the codec then reads it, or says why it cannot); what it reads,
/// the codec reads the same.
fn per_message_method(payload: &[u8]) -> Option<AMQPClass> {
    let (ids, args) = payload.split_at_checked(4)?;
    let method = match ids {
        [0, 60, 0, 80] | [0, 60, 0, 120] => {
            let [tag @ .., bits] = args else { return None };
            let delivery_tag = u64::from_be_bytes(tag.try_into().ok()?);
            let multiple = bits & 1 == 1;
            if ids[3] == 80 {
                basic::AMQPMethod::Ack(basic::Ack {
                    delivery_tag,
                    multiple,
                })
            } else {
                basic::AMQPMethod::Nack(basic::Nack {
                    delivery_tag,
                    multiple,
                    requeue: bits & 2 == 2,
                })
            }
        }
        [0, 60, 0, 60] => {
            // The layout is read in one place (`content::raw_deliver`); here its names
            // must be UTF-8.
            let raw = super::content::raw_deliver(payload)?;
            let text = |bytes: Vec<u8>| String::from_utf8(bytes).ok().map(ShortString::from);
            basic::AMQPMethod::Deliver(basic::Deliver {
                consumer_tag: text(raw.consumer_tag)?,
                delivery_tag: raw.delivery_tag,
                redelivered: raw.redelivered,
                exchange: text(raw.exchange)?,
                routing_key: text(raw.routing_key)?,
            })
        }
        _ => return None,
    };
    Some(AMQPClass::Basic(method))
}

#[cfg(test)]
mod tests {
    use amq_protocol::frame::{AMQPFrame, WriteContext, gen_frame};

    use super::*;

    /// A method frame's payload as amq-protocol encodes it.
    fn payload(method: basic::AMQPMethod) -> Vec<u8> {
        let frame = AMQPFrame::Method(1, AMQPClass::Basic(method));
        let bytes = gen_frame(&frame)(WriteContext::from(Vec::new()))
            .unwrap()
            .write;
        bytes[7..bytes.len() - 1].to_vec()
    }

    /// Read by hand, the per-message methods are what the codec reads; anything not whole
    /// is left to the codec.
    #[test]
    fn per_message_methods_read_by_hand_are_what_the_codec_reads() {
        let long = "r".repeat(255);
        let mut methods = Vec::new();
        for delivery_tag in [1, 4_096, u64::MAX] {
            for multiple in [false, true] {
                methods.push(basic::AMQPMethod::Ack(basic::Ack {
                    delivery_tag,
                    multiple,
                }));
                for requeue in [false, true] {
                    methods.push(basic::AMQPMethod::Nack(basic::Nack {
                        delivery_tag,
                        multiple,
                        requeue,
                    }));
                }
                for (exchange, routing_key) in [("", "q"), ("orders", long.as_str()), ("é", "")] {
                    methods.push(basic::AMQPMethod::Deliver(basic::Deliver {
                        consumer_tag: "ctag-1".into(),
                        delivery_tag,
                        redelivered: multiple,
                        exchange: exchange.into(),
                        routing_key: routing_key.into(),
                    }));
                }
            }
        }
        for method in methods {
            let payload = payload(method.clone());
            let by_codec = parse_class(payload.as_slice()).unwrap().1;
            assert_eq!(per_message_method(&payload), Some(by_codec.clone()));
            assert_eq!(by_codec, AMQPClass::Basic(method));
            for cut in 0..payload.len() {
                assert_eq!(per_message_method(&payload[..cut]), None, "cut at {cut}");
            }
            let mut longer = payload.clone();
            longer.push(0);
            if let Some(read) = per_message_method(&longer) {
                assert_eq!(read, parse_class(longer.as_slice()).unwrap().1);
            }
        }
        let mut not_utf8 = payload(basic::AMQPMethod::Deliver(basic::Deliver {
            consumer_tag: "c".into(),
            delivery_tag: 1,
            redelivered: false,
            exchange: "x".into(),
            routing_key: "k".into(),
        }));
        let last = not_utf8.len() - 1;
        not_utf8[last] = 0xff;
        assert_eq!(per_message_method(&not_utf8), None);
        // The codec reads only the bits it knows; so does the hand.
        let mut high_bits = payload(basic::AMQPMethod::Ack(basic::Ack {
            delivery_tag: 9,
            multiple: false,
        }));
        let bits = high_bits.len() - 1;
        high_bits[bits] = 0xFE;
        let by_codec = parse_class(high_bits.as_slice()).unwrap().1;
        assert_eq!(per_message_method(&high_bits), Some(by_codec));
        let other = payload(basic::AMQPMethod::QosOk(basic::QosOk {}));
        assert_eq!(per_message_method(&other), None);
    }
}
