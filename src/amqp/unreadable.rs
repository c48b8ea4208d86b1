//! What lapin cannot read, where lapin still reads: the parked queue (`parked` commands)
//! and the cancel stream (the bridge's follower and `status`). The bridge's work and returns
//! queues are consumed on the project's own connection, which hands such a delivery over as
//! bytes for the carrier to park within the session.
//!
//! AMQP says short strings (header names, most properties, the routing key) are UTF-8, but
//! the broker passes on whatever bytes a publisher sent. lapin fails its whole connection on
//! such a delivery; the broker hands the message to the next consumer, which fails the same
//! way. [`sweep`]: a bare connection ([`super::bare`]) consumes a queue, parks every
//! delivery lapin cannot read as a message it can (the original's properties kept as bytes
//! in a header, its body as it was), acks it once the broker confirmed the parked copy, and
//! closes, which gives every readable delivery it took back to the queue.
//!
//! Such an entry in the cancel stream fails every session at its catch-up. Nothing can be
//! removed from a stream: [`read_stream`] reads it past that entry instead, for the bridge to
//! apply what it can read, and the next follower resumes after it.

use std::ops::ControlFlow;
use std::time::Duration;

use amq_protocol::protocol::{AMQPClass, basic};
use futures::{AsyncRead, AsyncWrite};
use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable};
use thiserror::Error;

use super::bare::{self, Bare, BareError, FRAME_BODY, FRAME_HEADER, FRAME_METHOD, RawFrame};
use crate::clock::now_ms;
use crate::config::BrokerUrl;
use crate::contract;
use crate::naming::Names;

/// Why a sweep stopped before it was done (what it parked until then stays parked).
#[derive(Debug, Error)]
pub enum SweepError {
    /// The connection failed or the broker said something unexpected.
    #[error(transparent)]
    Bare(#[from] BareError),
    /// The parked copy was not taken (returned: no queue is bound to the parked exchange;
    /// or nacked): the message stays in the work queue.
    #[error("the parked exchange did not take an unreadable message: {0}")]
    NotParked(String),
}

/// What a sweep did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Swept {
    /// Deliveries lapin can read, given back to the queue.
    pub readable: u64,
    /// Deliveries lapin cannot read, now in the parked queue.
    pub parked: u64,
}

/// Consumes `queue` (the work queue, or the parked queue) on a bare connection to `url`, at
/// most `window` deliveries at once, until it read one lapin cannot read or none came for
/// `idle`; then parks every unreadable one it holds through `names`' parked exchange (see
/// the module) and closes.
pub async fn sweep(
    url: &BrokerUrl,
    names: &Names,
    queue: &str,
    window: u16,
    idle: Duration,
) -> Result<Swept, SweepError> {
    let mut bare = bare::connect(url, &format!("delay-bridge {} sweep", names.prefix())).await?;
    let result = sweep_on(&mut bare, names, queue, window, idle).await;
    bare.close().await;
    result
}

/// An entry of the cancel stream as [`read_stream`] found it.
#[derive(Debug)]
pub enum StreamEntry {
    /// lapin reads it: its properties (the broker's `x-stream-offset` among its headers).
    Readable(Box<BasicProperties>),
    /// lapin cannot read it; its offset, read by hand from its headers when they hold it.
    Unreadable(Option<u64>),
}

/// Reads the cancel stream of `names` over a bare connection to `url`, from offset `from`
/// (its first entry when `None`) until no entry came for `idle` (its end) or `each` breaks,
/// and hands each entry to `each`, in order. Gives how many entries it read. Over this
/// connection every entry reads, so `delay-bridge status` counts the stream with it as
/// well. A stream delivers whole
/// chunks, so an unreadable entry fails every lapin consumer that starts in its chunk; a
/// follower that resumes after the last entry read here starts past it.
pub async fn read_stream(
    url: &BrokerUrl,
    names: &Names,
    from: Option<u64>,
    idle: Duration,
    mut each: impl FnMut(StreamEntry) -> ControlFlow<()>,
) -> Result<u64, SweepError> {
    let mut bare = bare::connect(
        url,
        &format!("delay-bridge {} stream sweep", names.prefix()),
    )
    .await?;
    let result = async {
        let mut arguments = FieldTable::default();
        arguments.insert(
            "x-stream-offset".into(),
            match from {
                Some(offset) => AMQPValue::LongLongInt(i64::try_from(offset).unwrap_or(i64::MAX)),
                None => AMQPValue::LongString("first".into()),
            },
        );
        bare.consume(&names.cancel_stream(), STREAM_WINDOW, arguments)
            .await?;
        let mut read = 0u64;
        loop {
            let next = match tokio::time::timeout(idle, next_delivery(&mut bare)).await {
                Err(_) => return Ok(read),
                Ok(next) => next?,
            };
            let Next::Delivery(delivery) = next else {
                return Ok(read);
            };
            read += 1;
            let entry = match delivery.properties {
                Some(properties) if delivery.method_readable => {
                    StreamEntry::Readable(Box::new(properties))
                }
                _ => StreamEntry::Unreadable(super::stream_offset::raw_stream_offset(
                    delivery.header_properties(),
                )),
            };
            if each(entry).is_break() {
                return Ok(read);
            }
            // A stream consumer's acks give its credit back.
            if read.is_multiple_of(u64::from(STREAM_WINDOW) / 2) {
                bare.ack([(delivery.tag, true)]).await?;
            }
        }
    }
    .await;
    bare.close().await;
    result
}

/// How many stream entries [`read_stream`] takes at once.
const STREAM_WINDOW: u16 = 1000;

async fn sweep_on<S: AsyncRead + AsyncWrite + Unpin>(
    bare: &mut Bare<S>,
    names: &Names,
    queue: &str,
    window: u16,
    idle: Duration,
) -> Result<Swept, SweepError> {
    bare.confirm_select().await?;
    let consumer_tag = bare.consume(queue, window, FieldTable::default()).await?;

    let mut swept = Swept::default();
    let mut unreadable = Vec::new();
    // Until the first unreadable one: the message that failed the session is at the head
    // of the queue, among the deliveries that session held.
    while unreadable.is_empty() && swept.readable < u64::from(window.max(1)) {
        match tokio::time::timeout(idle, next_delivery(bare)).await {
            Err(_) => break,
            Ok(next) => match next? {
                Next::Delivery(d) if d.readable() => swept.readable += 1,
                Next::Delivery(d) => unreadable.push(d),
                Next::Cancelled => break,
            },
        }
    }
    // No more: those already on their way still arrive before the cancel's answer.
    bare.send_method(
        super::bare::CHANNEL,
        AMQPClass::Basic(basic::AMQPMethod::Cancel(basic::Cancel {
            consumer_tag,
            nowait: false,
        })),
    )
    .await?;
    loop {
        match next_delivery(bare).await? {
            Next::Delivery(d) if d.readable() => swept.readable += 1,
            Next::Delivery(d) => unreadable.push(d),
            Next::Cancelled => break,
        }
    }

    let exchange = names.parked_exchange();
    for (seq, delivery) in (1u64..).zip(&unreadable) {
        let (routing_key, properties) = contract::unreadable_parked(
            delivery.header_properties(),
            &delivery.routing_key,
            delivery.what(),
            now_ms(),
        );
        bare.publish(
            basic::Publish {
                exchange: exchange.as_str().into(),
                routing_key,
                mandatory: true,
                immediate: false,
            },
            properties,
            &delivery.body,
        )
        .await?;
        confirmed(bare, seq).await?;
        bare.ack([(delivery.tag, false)]).await?;
        swept.parked += 1;
    }
    Ok(swept)
}

/// What the consumer handed over next.
enum Next {
    /// A delivery, readable by lapin or not.
    Delivery(Box<Delivery>),
    /// The consumer ended (its cancel was answered, or the broker cancelled it).
    Cancelled,
}

/// A delivery as the broker sent it.
struct Delivery {
    tag: u64,
    /// The routing key's bytes.
    routing_key: Vec<u8>,
    /// lapin reads the `basic.deliver` method (exchange, routing key, consumer tag).
    method_readable: bool,
    /// The content header's payload, as sent.
    header: Vec<u8>,
    /// The properties, when lapin reads the content header (every property, every header
    /// name).
    properties: Option<BasicProperties>,
    body: Vec<u8>,
}

impl Delivery {
    fn readable(&self) -> bool {
        self.method_readable && self.properties.is_some()
    }

    /// The property bytes of the content header (after class, weight and body size).
    fn header_properties(&self) -> &[u8] {
        self.header.get(12..).unwrap_or_default()
    }

    /// Which part lapin cannot read, for the parked copy's detail.
    fn what(&self) -> &'static str {
        match (self.method_readable, self.properties.is_some()) {
            (false, false) => "its routing key or exchange, and its properties",
            (false, true) => "its routing key or exchange",
            _ => "its properties (a header name or a property)",
        }
    }
}

/// Reads the next delivery with its content, or the consumer's end.
async fn next_delivery<S: AsyncRead + AsyncWrite + Unpin>(
    bare: &mut Bare<S>,
) -> Result<Next, SweepError> {
    let deliver = bare.read().await?;
    if deliver.kind != FRAME_METHOD {
        return Err(unexpected(&deliver, "a delivery"));
    }
    let method = deliver.method();
    match &method {
        Some(AMQPClass::Basic(basic::AMQPMethod::CancelOk(_)))
        | Some(AMQPClass::Basic(basic::AMQPMethod::Cancel(_))) => return Ok(Next::Cancelled),
        _ => {}
    }
    let Some(fields) = super::wire::raw_deliver(&deliver.payload) else {
        return Err(unexpected(&deliver, "a delivery"));
    };
    let header = bare.read().await?;
    if header.kind != FRAME_HEADER || header.payload.len() < 12 {
        return Err(unexpected(&header, "a content header"));
    }
    let body_size = u64::from_be_bytes(header.payload[4..12].try_into().expect("8 bytes"));
    let properties = amq_protocol::frame::parsing::parse_content_header(&header.payload[..])
        .ok()
        .map(|(_, header)| header.properties);
    let mut body = Vec::new();
    while (body.len() as u64) < body_size {
        let part = bare.read().await?;
        if part.kind != FRAME_BODY {
            return Err(unexpected(&part, "a body frame"));
        }
        body.extend(part.payload);
    }
    Ok(Next::Delivery(Box::new(Delivery {
        tag: fields.delivery_tag,
        routing_key: fields.routing_key,
        method_readable: method.is_some(),
        header: header.payload,
        properties,
        body,
    })))
}

/// Waits for the broker's answer to the `seq`th publish: an ack; a return or a nack is an
/// error (the delivery stays unacked, so the message stays in the work queue).
async fn confirmed<S: AsyncRead + AsyncWrite + Unpin>(
    bare: &mut Bare<S>,
    seq: u64,
) -> Result<(), SweepError> {
    let frame = bare.read().await?;
    match frame.method() {
        Some(AMQPClass::Basic(basic::AMQPMethod::Ack(ack)))
            if ack.delivery_tag == seq || (ack.multiple && ack.delivery_tag >= seq) =>
        {
            Ok(())
        }
        Some(AMQPClass::Basic(basic::AMQPMethod::Return(ret))) => Err(SweepError::NotParked(
            format!("returned {} {}", ret.reply_code, ret.reply_text),
        )),
        Some(AMQPClass::Basic(basic::AMQPMethod::Nack(_))) => {
            Err(SweepError::NotParked("nacked".into()))
        }
        _ => Err(unexpected(&frame, "the parked copy's confirm")),
    }
}

fn unexpected(frame: &RawFrame, due: &str) -> SweepError {
    SweepError::Bare(BareError::Unexpected(format!(
        "a frame of type {} on channel {} where {due} was due",
        frame.kind, frame.channel
    )))
}
