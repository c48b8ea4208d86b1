//! A message arriving in frames: the method that carries it (`basic.deliver` or
//! `basic.return`), its content header (size and properties), then its body in as many
//! frames as it takes. Pure assembly: frames in, a whole message out.

use amq_protocol::frame::AMQPContentHeader;
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
    /// A mandatory publish the broker could not route.
    Return(basic::Return),
}

/// A whole message.
#[derive(Debug, PartialEq)]
pub(super) struct Content {
    /// The method it came with.
    pub(super) carrier: Carrier,
    /// Its properties.
    pub(super) properties: BasicProperties,
    /// Its body.
    pub(super) body: Vec<u8>,
}

/// A message whose frames are still arriving.
#[derive(Debug)]
pub(super) struct Incoming {
    carrier: Carrier,
    /// The size and properties, once the content header came.
    header: Option<(usize, BasicProperties)>,
    body: Vec<u8>,
}

impl Incoming {
    /// A message announced by `carrier`; its content header is next.
    pub(super) fn new(carrier: Carrier) -> Self {
        Self {
            carrier,
            header: None,
            body: Vec::new(),
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
                body: self.body,
            }),
            _ => Step::Waiting(self),
        }
    }
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

    #[test]
    fn frames_out_of_place_are_errors() {
        assert!(Incoming::new(deliver()).body(b"x").is_err());
        let incoming = waiting(Incoming::new(deliver()).header(header(2)));
        assert!(incoming.body(b"xyz").is_err());
        let incoming = waiting(Incoming::new(deliver()).header(header(2)));
        assert!(incoming.header(header(2)).is_err());
    }
}
