//! The connection's edges against the scripted fake broker, with no RabbitMQ: callers that
//! go before the broker's answer, a broker that closes the connection under publishes and
//! calls, a small `frame_max` both ways, and frames that are malformed or too large.

use std::time::Duration;

use amq_protocol::frame::{AMQPContentHeader, AMQPFrame};
use amq_protocol::protocol::{AMQPClass, basic, channel, confirm, connection};
use delay_bridge::amqp::wire::{Channel, Connection, Consumer, WireError};
use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, LongString};

use super::fake_broker::{FakeBroker, Peer};
use super::{WITHIN, offer, open_to_fake};

/// The frame types of a content header and a content body.
const FRAME_HEADER: u8 = 2;
const FRAME_BODY: u8 = 3;

/// A connection to a fresh fake broker with heartbeats off, offering `frame_max`.
async fn fake(frame_max: u32) -> (Connection, Peer) {
    let broker = FakeBroker::listen().await;
    open_to_fake(
        &broker,
        "?heartbeat=0",
        Duration::ZERO,
        offer(2047, frame_max, 0),
    )
    .await
}

/// A channel the fake broker opened, and its number.
async fn open_channel(connection: &Connection, peer: &mut Peer) -> Channel {
    let opening = tokio::spawn({
        let connection = connection.clone();
        async move { connection.open_channel().await }
    });
    peer.answer_open().await;
    answered(opening).await.expect("a channel")
}

/// A channel in confirm mode on the fake broker.
async fn confirm_channel(connection: &Connection, peer: &mut Peer) -> Channel {
    let channel = open_channel(connection, peer).await;
    let selecting = tokio::spawn({
        let channel = channel.clone();
        async move { channel.confirm_select().await }
    });
    let (id, method) = peer.method_on().await;
    assert!(matches!(
        method,
        AMQPClass::Confirm(confirm::AMQPMethod::Select(_))
    ));
    peer.send_on(
        id,
        AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(confirm::SelectOk {})),
    )
    .await;
    answered(selecting).await.expect("confirm mode");
    channel
}

/// What a spawned call returned, within [`WITHIN`].
async fn answered<T>(call: tokio::task::JoinHandle<T>) -> T {
    tokio::time::timeout(WITHIN, call)
        .await
        .expect("answered in time")
        .expect("task")
}

/// Drops a call that waits for the broker's reply, as a caller that gives up does.
async fn drop_call<T>(call: tokio::task::JoinHandle<T>) {
    call.abort();
    let _ = call.await;
}

/// The broker's next method, within [`WITHIN`]: the client said something.
async fn next_method(peer: &mut Peer) -> (u16, AMQPClass) {
    tokio::time::timeout(WITHIN, peer.method_on())
        .await
        .expect("the client sent a method in time")
}

/// A consumer of `q` tagged `tag` on `channel`, the fake broker answering its
/// `basic.consume`.
async fn consumer(channel: &Channel, peer: &mut Peer, tag: &str) -> Consumer {
    let consuming = tokio::spawn({
        let (channel, tag) = (channel.clone(), tag.to_string());
        async move { channel.consume("q", &tag, FieldTable::default()).await }
    });
    let (id, method) = next_method(peer).await;
    assert!(matches!(
        method,
        AMQPClass::Basic(basic::AMQPMethod::Consume(_))
    ));
    peer.send_on(
        id,
        AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(basic::ConsumeOk {
            consumer_tag: tag.into(),
        })),
    )
    .await;
    answered(consuming).await.expect("a consumer")
}

/// Delivers to the consumer `tag` on `channel` a message whose content header announces
/// `body_size` bytes, then `parts` as its body frames.
async fn deliver(
    peer: &mut Peer,
    channel: u16,
    tag: &str,
    body_size: usize,
    properties: BasicProperties,
    parts: &[&[u8]],
) {
    peer.send_on(
        channel,
        AMQPClass::Basic(basic::AMQPMethod::Deliver(basic::Deliver {
            consumer_tag: tag.into(),
            delivery_tag: 1,
            redelivered: false,
            exchange: "".into(),
            routing_key: "q".into(),
        })),
    )
    .await;
    peer.send_frame(AMQPFrame::Header(
        channel,
        AMQPContentHeader {
            class_id: 60,
            body_size: body_size as u64,
            properties,
        },
    ))
    .await;
    for part in parts {
        peer.send_frame(AMQPFrame::Body(channel, part.to_vec()))
            .await;
    }
}

/// A caller that drops `open_channel` before the broker's `open-ok` leaves no channel open
/// on the broker: the connection closes the channel the broker opened for it, and a call
/// after that gets its own reply.
#[tokio::test]
async fn a_dropped_channel_open_closes_the_channel_the_broker_opened() {
    let (connection, mut peer) = fake(131_072).await;
    let opening = tokio::spawn({
        let connection = connection.clone();
        async move { connection.open_channel().await }
    });
    let (id, method) = next_method(&mut peer).await;
    assert!(matches!(
        method,
        AMQPClass::Channel(channel::AMQPMethod::Open(_))
    ));
    drop_call(opening).await;
    peer.send_on(
        id,
        AMQPClass::Channel(channel::AMQPMethod::OpenOk(channel::OpenOk {})),
    )
    .await;
    let (closed, method) = next_method(&mut peer).await;
    assert_eq!(closed, id);
    assert!(
        matches!(method, AMQPClass::Channel(channel::AMQPMethod::Close(_))),
        "{method:?} where the abandoned channel's close was due"
    );
    peer.send_on(
        id,
        AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
    )
    .await;
    let next = open_channel(&connection, &mut peer).await;
    assert!(next.is_open());
}

/// A caller that drops `consume` before the broker's `consume-ok` leaves no consumer that
/// the broker feeds and nobody reads: the connection cancels it, and the channel's next
/// call gets its own reply, not the cancel's.
#[tokio::test]
async fn a_dropped_consume_cancels_the_consumer_the_broker_started() {
    let (connection, mut peer) = fake(131_072).await;
    let channel = open_channel(&connection, &mut peer).await;
    let consuming = tokio::spawn({
        let channel = channel.clone();
        async move {
            channel
                .consume("q", "abandoned", FieldTable::default())
                .await
        }
    });
    let (id, method) = next_method(&mut peer).await;
    assert!(matches!(
        method,
        AMQPClass::Basic(basic::AMQPMethod::Consume(_))
    ));
    drop_call(consuming).await;
    peer.send_on(
        id,
        AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(basic::ConsumeOk {
            consumer_tag: "abandoned".into(),
        })),
    )
    .await;
    match next_method(&mut peer).await {
        (on, AMQPClass::Basic(basic::AMQPMethod::Cancel(cancel))) => {
            assert_eq!((on, cancel.consumer_tag.as_str()), (id, "abandoned"));
            assert!(!cancel.nowait, "a cancel whose reply is taken in turn");
        }
        other => panic!("{other:?} where the abandoned consumer's cancel was due"),
    }
    peer.send_on(
        id,
        AMQPClass::Basic(basic::AMQPMethod::CancelOk(basic::CancelOk {
            consumer_tag: "abandoned".into(),
        })),
    )
    .await;
    let setting = tokio::spawn({
        let channel = channel.clone();
        async move { channel.qos(7).await }
    });
    match next_method(&mut peer).await {
        (_, AMQPClass::Basic(basic::AMQPMethod::Qos(qos))) => assert_eq!(qos.prefetch_count, 7),
        other => panic!("{other:?} where basic.qos was due"),
    }
    peer.send_on(
        id,
        AMQPClass::Basic(basic::AMQPMethod::QosOk(basic::QosOk {})),
    )
    .await;
    answered(setting).await.expect("the qos call's own reply");
}

/// A caller that drops `cancel` before the broker's `cancel-ok` still ends its consumer:
/// the cancel went out, and the consumer's stream ends instead of waiting for ever.
#[tokio::test]
async fn a_dropped_cancel_ends_its_consumer() {
    let (connection, mut peer) = fake(131_072).await;
    let channel = open_channel(&connection, &mut peer).await;
    let id = channel.id();
    let mut consumer = consumer(&channel, &mut peer, "ending").await;
    let cancelling = tokio::spawn({
        let (channel, tag) = (channel.clone(), consumer.tag().clone());
        async move { channel.cancel(&tag).await }
    });
    let (_, method) = next_method(&mut peer).await;
    assert!(matches!(
        method,
        AMQPClass::Basic(basic::AMQPMethod::Cancel(_))
    ));
    drop_call(cancelling).await;
    peer.send_on(
        id,
        AMQPClass::Basic(basic::AMQPMethod::CancelOk(basic::CancelOk {
            consumer_tag: "ending".into(),
        })),
    )
    .await;
    let ended = tokio::time::timeout(WITHIN, consumer.next())
        .await
        .expect("the consumer's stream ended in time");
    assert!(matches!(ended, Ok(None)), "{ended:?}");
    assert!(channel.is_open());
}

/// The broker closing the connection (320 CONNECTION_FORCED, an operator's `close_connection`)
/// while publishes wait for their confirms, a call for its reply and a consumer for its next
/// delivery answers every one of them with the broker's reason, and the client says
/// `close-ok`.
#[tokio::test]
async fn a_connection_the_broker_closes_mid_publish_answers_every_waiter() {
    let (connection, mut peer) = fake(131_072).await;
    let publishing = confirm_channel(&connection, &mut peer).await;
    let consuming = open_channel(&connection, &mut peer).await;
    let mut consumer = consumer(&consuming, &mut peer, "waiting").await;
    let calling = tokio::spawn({
        let channel = consuming.clone();
        async move { channel.qos(1).await }
    });
    let (_, method) = next_method(&mut peer).await;
    assert!(matches!(
        method,
        AMQPClass::Basic(basic::AMQPMethod::Qos(_))
    ));
    let confirms: Vec<_> = (0..3)
        .map(|i| {
            publishing
                .publish("", "q", true, &BasicProperties::default(), &[i])
                .expect("sent")
        })
        .collect();
    for _ in 0..3 {
        let (_, method) = next_method(&mut peer).await;
        assert!(matches!(
            method,
            AMQPClass::Basic(basic::AMQPMethod::Publish(_))
        ));
    }

    peer.send(AMQPClass::Connection(connection::AMQPMethod::Close(
        connection::Close {
            reply_code: 320,
            reply_text: "CONNECTION_FORCED - closed via management plugin".into(),
            class_id: 0,
            method_id: 0,
        },
    )))
    .await;
    let forced = |error: &WireError| error.reply_code() == Some(320);
    for confirm in confirms {
        let answer = tokio::time::timeout(WITHIN, confirm)
            .await
            .expect("the confirm answered in time");
        assert!(matches!(&answer, Err(e) if forced(e)), "{answer:?}");
    }
    let call = answered(calling).await;
    assert!(matches!(&call, Err(e) if forced(e)), "{call:?}");
    let next = tokio::time::timeout(WITHIN, consumer.next())
        .await
        .expect("the consumer answered in time");
    assert!(matches!(&next, Err(e) if forced(e)), "{next:?}");
    assert!(forced(&connection.failed().await));
    assert!(matches!(
        next_method(&mut peer).await,
        (0, AMQPClass::Connection(connection::AMQPMethod::CloseOk(_)))
    ));
}

/// Headers that fill most of a 4 096-byte frame: over the frame on their own when
/// `over` is set.
fn properties_of_size(over: bool) -> BasicProperties {
    let mut headers = FieldTable::default();
    let size = if over { 5_000 } else { 3_000 };
    headers.insert(
        "filler".into(),
        AMQPValue::LongString(LongString::from(vec![b'x'; size])),
    );
    BasicProperties::default().with_headers(headers)
}

/// At a `frame_max` of 4 096 (RabbitMQ's smallest is 4 096; its default 131 072) a body of
/// 10 000 bytes goes out in frames of at most 4 096 bytes and comes in whole from frames
/// of that size; a publish whose content header alone is over the frame is refused before
/// anything of it is sent, and the connection goes on.
#[tokio::test]
async fn at_a_small_frame_max_bodies_are_split_and_joined_and_an_oversized_header_is_refused() {
    const FRAME_MAX: usize = 4096;
    let (connection, mut peer) = fake(FRAME_MAX as u32).await;
    assert_eq!(connection.tuned().frame_max, FRAME_MAX as u32);
    let channel = confirm_channel(&connection, &mut peer).await;
    let body: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();

    let refused = channel.publish("", "q", false, &properties_of_size(true), b"never");
    assert!(
        matches!(
            refused,
            Err(WireError::HeaderTooLarge {
                frame_max: FRAME_MAX,
                ..
            })
        ),
        "{:?}",
        refused.err()
    );
    // Its confirm is not the point.
    drop(
        channel
            .publish("", "q", false, &properties_of_size(false), &body)
            .expect("sent"),
    );
    // What the broker reads: the publish method, its header, and the body in frames of at
    // most frame_max bytes (7 of frame header and 1 of frame end around each payload).
    let (kind, _, _) = peer.frame().await;
    assert_eq!(
        kind, 1,
        "the publish method first: nothing of the refused one"
    );
    let (kind, _, header) = peer.frame().await;
    assert_eq!(kind, FRAME_HEADER);
    assert!(header.len() + 8 <= FRAME_MAX);
    let mut sent = Vec::new();
    while sent.len() < body.len() {
        let (kind, _, part) = peer.frame().await;
        assert_eq!(kind, FRAME_BODY);
        assert!(
            part.len() + 8 <= FRAME_MAX,
            "a body frame of {}",
            part.len()
        );
        sent.extend(part);
    }
    assert_eq!(sent, body);

    // And the other way: a delivery in frames of frame_max comes out whole.
    let mut consumer = consumer(&channel, &mut peer, "small-frames").await;
    let parts: Vec<&[u8]> = body.chunks(FRAME_MAX - 8).collect();
    deliver(
        &mut peer,
        channel.id(),
        "small-frames",
        body.len(),
        properties_of_size(false),
        &parts,
    )
    .await;
    let delivery = tokio::time::timeout(WITHIN, consumer.next())
        .await
        .expect("delivered in time")
        .expect("the connection is open")
        .expect("a delivery");
    assert_eq!(delivery.data, body);
    assert!(connection.is_open());
}

/// Waits until `connection` fails, and says why.
async fn failure(connection: &Connection) -> WireError {
    tokio::time::timeout(WITHIN, connection.failed())
        .await
        .expect("the connection failed in time")
}

/// A frame that does not end with the frame-end byte fails the connection, answers the
/// call that waited, and the client closes its socket: no panic, no hang.
#[tokio::test]
async fn a_frame_without_its_end_byte_fails_the_connection_and_every_waiter() {
    let (connection, mut peer) = fake(131_072).await;
    let channel = open_channel(&connection, &mut peer).await;
    let calling = tokio::spawn({
        let channel = channel.clone();
        async move { channel.qos(1).await }
    });
    let _ = next_method(&mut peer).await;
    // A heartbeat frame whose last byte is not 0xCE.
    peer.send_bytes(&[8, 0, 0, 0, 0, 0, 0, 0x00]).await;
    let failed = failure(&connection).await;
    assert!(!failed.to_string().is_empty());
    assert!(answered(calling).await.is_err());
    assert!(peer.closed_by_client_within(WITHIN).await);
}

/// A frame announcing more than `frame_max` fails the connection at its header, without
/// waiting for (or reserving room for) the payload it announces.
#[tokio::test]
async fn a_frame_over_frame_max_fails_the_connection_at_its_header() {
    let (connection, mut peer) = fake(4096).await;
    let mut head = vec![1, 0, 1];
    head.extend_from_slice(&(64u32 << 20).to_be_bytes());
    peer.send_bytes(&head).await;
    let failed = failure(&connection).await;
    assert!(failed.to_string().contains("frame_max"), "{failed}");
}

/// A delivery whose body frames carry more than its content header announced is malformed:
/// the connection fails with a reason and the consumer learns it, instead of a message
/// made of two.
#[tokio::test]
async fn a_body_longer_than_its_header_said_fails_the_connection() {
    let (connection, mut peer) = fake(131_072).await;
    let channel = open_channel(&connection, &mut peer).await;
    let mut consumer = consumer(&channel, &mut peer, "lied-to").await;
    deliver(
        &mut peer,
        channel.id(),
        "lied-to",
        3,
        BasicProperties::default(),
        &[b"five!"],
    )
    .await;
    let failed = failure(&connection).await;
    assert!(failed.to_string().contains("announced"), "{failed}");
    let next = tokio::time::timeout(WITHIN, consumer.next())
        .await
        .expect("the consumer answered in time");
    assert!(next.is_err(), "{next:?}");
}
