//! A message arriving in frames: the method that carries it (`basic.deliver` or
//! `basic.return`), its content header (size and properties), then its body in as many
//! frames as it takes. Pure assembly: frames in, a whole message out.
//!
//! AMQP says short strings (the routing key, header names, most properties) are UTF-8, but
//! the broker passes on whatever bytes a publisher sent. A delivery whose method or content
//! header the codec cannot read is assembled all the same, with what could not be read
//! kept as bytes ([`Raw`]), for its consumer to set aside: failing the connection for it
//! would fail every session the broker hands it to next.

use amq_protocol::frame::AMQPContentHeader;
use amq_protocol::frame::parsing::parse_content_header;
use amq_protocol::protocol::{BasicProperties, basic};

/// The most bytes reserved for a body when its content header comes; a larger body grows
/// as its frames arrive. The size is the peer's word: a content header announcing terabytes
/// must cost no memory before the bytes come.
const RESERVE_AT_MOST: usize = 1 << 20;

/// The method a message came with.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Carrier {
    /// A delivery to a consumer.
    Deliver(basic::Deliver),
    /// A delivery whose method the codec cannot read (its exchange or routing key is not
    /// UTF-8), read by hand.
    RawDeliver(RawDeliver),
    /// A mandatory publish the broker could not route.
    Return(basic::Return),
}

impl Carrier {
    fn is_delivery(&self) -> bool {
        !matches!(self, Carrier::Return(_))
    }
}

/// The fields of a `basic.deliver` read by hand, names as bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct RawDeliver {
    /// The consumer's tag.
    pub(super) consumer_tag: Vec<u8>,
    /// The delivery's tag on the channel.
    pub(super) delivery_tag: u64,
    /// Delivered before and not acked.
    pub(super) redelivered: bool,
    /// The exchange's name as sent.
    pub(super) exchange: Vec<u8>,
    /// The routing key as sent.
    pub(super) routing_key: Vec<u8>,
}

/// Reads a `basic.deliver` method frame's payload (class and method ids, consumer tag,
/// delivery tag, redelivered, exchange, routing key) without the codec, which refuses a
/// name that is not UTF-8; `None` when the payload is not a whole `basic.deliver`.
pub(super) fn raw_deliver(payload: &[u8]) -> Option<RawDeliver> {
    fn short_string(bytes: &[u8], at: &mut usize) -> Option<Vec<u8>> {
        let len = usize::from(*bytes.get(*at)?);
        let text = bytes.get(*at + 1..*at + 1 + len)?;
        *at += 1 + len;
        Some(text.to_vec())
    }
    if payload.get(..4)? != [0, 60, 0, 60] {
        return None;
    }
    let mut at = 4;
    let consumer_tag = short_string(payload, &mut at)?;
    let delivery_tag = u64::from_be_bytes(payload.get(at..at + 8)?.try_into().ok()?);
    let redelivered = *payload.get(at + 8)? & 1 == 1;
    at += 9;
    let exchange = short_string(payload, &mut at)?;
    let routing_key = short_string(payload, &mut at)?;
    Some(RawDeliver {
        consumer_tag,
        delivery_tag,
        redelivered,
        exchange,
        routing_key,
    })
}

/// What of a delivery could not be read, kept as the broker sent it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Raw {
    /// The routing key's bytes.
    pub routing_key: Vec<u8>,
    /// The content header's property bytes (flags, then the properties), as sent.
    pub properties: Vec<u8>,
    /// Which part could not be read, in words: "its routing key or exchange", "its
    /// properties (a header name or a property)", or both.
    pub what: &'static str,
}

/// A whole message.
#[derive(Debug, PartialEq)]
pub(super) struct Content {
    /// The method it came with.
    pub(super) carrier: Carrier,
    /// Its properties (the defaults when they could not be read).
    pub(super) properties: BasicProperties,
    /// What could not be read, when anything could not.
    pub(super) raw: Option<Raw>,
    /// Its body.
    pub(super) body: Vec<u8>,
}

/// A message whose frames are still arriving.
#[derive(Debug)]
pub(super) struct Incoming {
    carrier: Carrier,
    /// The size and properties, once the content header came.
    header: Option<(usize, BasicProperties)>,
    raw: Option<Raw>,
    body: Vec<u8>,
}

impl Incoming {
    /// A message announced by `carrier`; its content header is next.
    pub(super) fn new(carrier: Carrier) -> Self {
        Self {
            carrier,
            header: None,
            raw: None,
            body: Vec::new(),
        }
    }

    /// Takes the content header frame's payload: the whole message when its body is
    /// empty. A delivery's header the codec cannot read is kept as bytes; any other
    /// message's is an error.
    pub(super) fn header_frame(self, payload: &[u8]) -> Result<Step, Malformed> {
        let parsed = parse_content_header(payload).ok().map(|(_, header)| header);
        let raw_deliver = match &self.carrier {
            Carrier::RawDeliver(raw) => Some(raw.routing_key.clone()),
            _ => None,
        };
        match (parsed, raw_deliver) {
            (Some(header), None) => self.header(header).map_err(Malformed::OutOfPlace),
            (parsed, routing_key) => {
                if !self.carrier.is_delivery() {
                    return Err(Malformed::Unreadable(
                        "the content header of a returned message".into(),
                    ));
                }
                let body_size = payload
                    .get(4..12)
                    .and_then(|size| size.try_into().ok())
                    .map(u64::from_be_bytes)
                    .ok_or_else(|| Malformed::Unreadable("a content header cut short".into()))?;
                let properties = payload.get(12..).unwrap_or_default().to_vec();
                let what = match (routing_key.is_some(), parsed.is_some()) {
                    (true, true) => "its routing key or exchange",
                    (true, false) => "its routing key or exchange, and its properties",
                    _ => "its properties (a header name or a property)",
                };
                let routing_key = match (routing_key, &self.carrier) {
                    (Some(key), _) => key,
                    (None, Carrier::Deliver(deliver)) => {
                        deliver.routing_key.as_str().as_bytes().to_vec()
                    }
                    (None, _) => Vec::new(),
                };
                let mut incoming = self;
                incoming.raw = Some(Raw {
                    routing_key,
                    properties,
                    what,
                });
                incoming
                    .header(AMQPContentHeader {
                        class_id: 60,
                        body_size,
                        properties: parsed.map(|h| h.properties).unwrap_or_default(),
                    })
                    .map_err(Malformed::OutOfPlace)
            }
        }
    }

    /// Takes the content header: the whole message when its body is empty.
    pub(super) fn header(mut self, header: AMQPContentHeader) -> Result<Step, String> {
        if self.header.is_some() {
            return Err("a second content header for one message".into());
        }
        let size = usize::try_from(header.body_size)
            .map_err(|_| format!("a body of {} bytes", header.body_size))?;
        self.body.reserve_exact(size.min(RESERVE_AT_MOST));
        self.header = Some((size, header.properties));
        Ok(self.step())
    }

    /// Takes a body frame: the whole message when it was the last.
    pub(super) fn body(mut self, part: &[u8]) -> Result<Step, String> {
        let Some((size, _)) = &self.header else {
            return Err("a body frame before its content header".into());
        };
        if self.body.len() + part.len() > *size {
            return Err(format!(
                "body frames of more than the {size} bytes the content header announced"
            ));
        }
        self.body.extend_from_slice(part);
        Ok(self.step())
    }

    fn step(self) -> Step {
        match self.header {
            Some((size, properties)) if self.body.len() == size => Step::Done(Content {
                carrier: self.carrier,
                properties,
                raw: self.raw,
                body: self.body,
            }),
            _ => Step::Waiting(self),
        }
    }
}

/// Why a frame cannot be part of a message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Malformed {
    /// Not where the message's frames are (a second header, a body longer than announced).
    OutOfPlace(String),
    /// What is not a delivery and cannot be read.
    Unreadable(String),
}

/// What a frame made of a message.
#[derive(Debug)]
pub(super) enum Step {
    /// More frames are due.
    Waiting(Incoming),
    /// The message is whole.
    Done(Content),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn deliver() -> Carrier {
        Carrier::Deliver(basic::Deliver {
            consumer_tag: "c".into(),
            delivery_tag: 1,
            redelivered: false,
            exchange: "".into(),
            routing_key: "q".into(),
        })
    }

    fn header(size: u64) -> AMQPContentHeader {
        AMQPContentHeader {
            class_id: 60,
            body_size: size,
            properties: BasicProperties::default().with_priority(3),
        }
    }

    fn waiting(step: Result<Step, String>) -> Incoming {
        match step {
            Ok(Step::Waiting(incoming)) => incoming,
            other => panic!("expected more frames, got {other:?}"),
        }
    }

    fn done(step: Result<Step, String>) -> Content {
        match step {
            Ok(Step::Done(content)) => content,
            other => panic!("expected a whole message, got {other:?}"),
        }
    }

    #[test]
    fn an_empty_body_is_whole_at_its_header() {
        let content = done(Incoming::new(deliver()).header(header(0)));
        assert_eq!(content.carrier, deliver());
        assert_eq!(content.properties.priority(), &Some(3));
        assert!(content.body.is_empty());
    }

    #[test]
    fn a_body_in_several_frames_is_joined_in_order() {
        let incoming = waiting(Incoming::new(deliver()).header(header(5)));
        let incoming = waiting(incoming.body(b"ab"));
        let content = done(incoming.body(b"cde"));
        assert_eq!(content.body, b"abcde");
    }

    #[test]
    fn a_body_size_that_lies_reserves_at_most_a_mebibyte() {
        let incoming = waiting(Incoming::new(deliver()).header(header(1 << 45)));
        assert!(
            incoming.body.capacity() <= RESERVE_AT_MOST,
            "reserved {} bytes for a body announced as 32 TiB",
            incoming.body.capacity()
        );
        let incoming = waiting(incoming.body(b"the first frame"));
        assert_eq!(incoming.body, b"the first frame");
    }

    /// A `basic.deliver` payload: consumer tag, delivery tag, redelivered, exchange, key.
    fn deliver_payload(
        consumer_tag: &[u8],
        tag: u64,
        exchange: &[u8],
        routing_key: &[u8],
    ) -> Vec<u8> {
        let mut payload = vec![0, 60, 0, 60];
        for (i, part) in [consumer_tag, exchange, routing_key]
            .into_iter()
            .enumerate()
        {
            payload.push(part.len() as u8);
            payload.extend_from_slice(part);
            if i == 0 {
                payload.extend_from_slice(&tag.to_be_bytes());
                payload.push(1);
            }
        }
        payload
    }

    /// A content header payload: class, weight, body size, then `properties` as sent.
    fn header_payload(size: u64, properties: &[u8]) -> Vec<u8> {
        let mut payload = vec![0, 60, 0, 0];
        payload.extend(size.to_be_bytes());
        payload.extend(properties);
        payload
    }

    /// Headers (flag 13) holding one entry named `name`, a long string "v".
    fn headers_named(name: &[u8]) -> Vec<u8> {
        let mut table = vec![name.len() as u8];
        table.extend(name);
        table.extend([b'S', 0, 0, 0, 1, b'v']);
        let mut properties = (1u16 << 13).to_be_bytes().to_vec();
        properties.extend((table.len() as u32).to_be_bytes());
        properties.extend(table);
        properties
    }

    #[test]
    fn a_deliver_with_a_routing_key_that_is_not_utf8_is_read_by_hand() {
        let payload = deliver_payload(b"ctag", 42, b"ex", &[0xff, b'k']);
        assert!(
            amq_protocol::protocol::parse_class(&payload[..]).is_err(),
            "the codec refuses it"
        );
        assert_eq!(
            raw_deliver(&payload),
            Some(RawDeliver {
                consumer_tag: b"ctag".to_vec(),
                delivery_tag: 42,
                redelivered: true,
                exchange: b"ex".to_vec(),
                routing_key: vec![0xff, b'k'],
            })
        );
    }

    #[test]
    fn other_methods_and_cut_payloads_are_no_deliver() {
        let payload = deliver_payload(b"ctag", 42, b"ex", b"key");
        assert_eq!(raw_deliver(&payload[..payload.len() - 1]), None);
        let mut ack = payload.clone();
        ack[3] = 80;
        assert_eq!(raw_deliver(&ack), None);
        assert_eq!(raw_deliver(&[]), None);
    }

    #[test]
    fn a_delivery_whose_header_cannot_be_read_is_whole_with_its_bytes_kept() {
        let properties = headers_named(&[0xff, 0xfe]);
        let payload = header_payload(3, &properties);
        assert!(
            parse_content_header(&payload[..]).is_err(),
            "the codec refuses it"
        );
        let incoming = waiting(
            Incoming::new(deliver())
                .header_frame(&payload)
                .map_err(|e| format!("{e:?}")),
        );
        let content = done(incoming.body(b"abc"));
        assert_eq!(content.body, b"abc");
        assert_eq!(content.properties, BasicProperties::default());
        let raw = content.raw.expect("what could not be read");
        assert_eq!(raw.properties, properties, "the property bytes as sent");
        assert_eq!(raw.routing_key, b"q", "the routing key the method carried");
        assert_eq!(raw.what, "its properties (a header name or a property)");
    }

    #[test]
    fn a_raw_delivery_keeps_its_key_and_its_property_bytes_even_when_they_read() {
        let deliver = raw_deliver(&deliver_payload(b"c", 7, b"ex", &[b'k', 0xc3])).unwrap();
        let properties = headers_named(b"fine");
        let payload = header_payload(0, &properties);
        let content = done(
            Incoming::new(Carrier::RawDeliver(deliver))
                .header_frame(&payload)
                .map_err(|e| format!("{e:?}")),
        );
        let raw = content.raw.expect("what could not be read");
        assert_eq!(raw.routing_key, vec![b'k', 0xc3]);
        assert_eq!(raw.properties, properties);
        assert_eq!(raw.what, "its routing key or exchange");
        assert!(
            content.properties.headers().is_some(),
            "what could be read is read"
        );
    }

    #[test]
    fn a_readable_delivery_has_nothing_raw() {
        let payload = header_payload(0, &headers_named(b"fine"));
        let content = done(
            Incoming::new(deliver())
                .header_frame(&payload)
                .map_err(|e| format!("{e:?}")),
        );
        assert_eq!(content.raw, None);
    }

    #[test]
    fn a_return_whose_header_cannot_be_read_is_an_error() {
        let returned = Carrier::Return(basic::Return {
            reply_code: 312,
            reply_text: "NO_ROUTE".into(),
            exchange: "".into(),
            routing_key: "q".into(),
        });
        let payload = header_payload(0, &headers_named(&[0xff]));
        assert!(matches!(
            Incoming::new(returned).header_frame(&payload),
            Err(Malformed::Unreadable(_))
        ));
        let cut = &header_payload(0, &[])[..8];
        assert!(Incoming::new(deliver()).header_frame(cut).is_err());
    }

    #[test]
    fn frames_out_of_place_are_errors() {
        assert!(Incoming::new(deliver()).body(b"x").is_err());
        let incoming = waiting(Incoming::new(deliver()).header(header(2)));
        assert!(incoming.body(b"xyz").is_err());
        let incoming = waiting(Incoming::new(deliver()).header(header(2)));
        assert!(incoming.header(header(2)).is_err());
    }
}
