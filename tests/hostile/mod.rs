//! Hostile input gets a reason or goes through; it never crashes the bridge.

use std::time::{Duration, Instant};

use delay_bridge::client::{Message, When};
use delay_bridge::config::Route;
use delay_bridge::contract::{ParkReason, header};
use lapin::types::{AMQPValue, LongString};
use lapin::{BasicProperties, ExchangeKind};

use crate::support::raw::{deep_headers, publish_raw};
use crate::support::*;

const SEC: Duration = Duration::from_secs(1);

/// A header table nested 18 000 levels deep (126 KiB, within the broker's 128 KiB
/// frame) overflows a 2 MiB stack in the AMQP client's recursive parser, on the bridge's
/// I/O thread: the process aborted, and the message was redelivered to the next start. The
/// `delay-bridge` binary now gives its threads a stack that holds the deepest table a frame
/// can carry. The message is delivered (headers are kept end to end) and the bridge goes
/// on. Nothing in this test process ever parses that message: its target queue is only
/// counted.
#[tokio::test]
async fn a_header_nested_18_000_levels_deep_neither_crashes_the_bridge_nor_is_lost() {
    let mut w = World::without_bridge("deep").await;
    let deep_in = format!("{}.deep-in", w.prefix());
    let deep_out = format!("{}.deep-out", w.prefix());
    let deep_queue = format!("{deep_out}.q");
    w.declare_extra_exchange(&deep_out, ExchangeKind::Fanout)
        .await;
    w.add_route(Route::new(deep_in.clone(), deep_out.clone()))
        .await
        .unwrap();
    w.declare_bound_queue(&deep_queue, &deep_out, "").await;
    let config = w.config_file(100);
    let mut bridge = spawn_process(&config);
    wait_for_consumers(&w, 1, 20 * SEC).await;

    publish_raw(
        &broker_url(),
        &deep_in,
        "rk.deep",
        &deep_headers(300, 18_000),
        b"deep",
    )
    .await;
    w.publish("rk.after", b"after", with_delay(600)).await;
    // Generous deadlines: the debug build the tests run takes seconds per pass over such a
    // table (parsing, copying and encoding it recursively), more on a loaded machine.
    let after = w.recv_within(30 * SEC).await;
    assert_eq!(after.body, b"after", "the bridge goes on");
    let deadline = Instant::now() + 30 * SEC;
    while w.queue_depth(&deep_queue).await < 1 {
        assert!(
            bridge.exited().unwrap().is_none(),
            "the bridge died: {:?}",
            bridge.exited()
        );
        assert!(Instant::now() < deadline, "the deep message did not arrive");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(bridge.exited().unwrap().is_none(), "the bridge is alive");
    assert!(bridge.terminate(20 * SEC).await.unwrap().success());
    w.cleanup().await;
}

/// AMQP long strings are bytes, not text: a header value, and `x-delay` itself, that is not
/// UTF-8 is legal on the wire (some clients write binary values this way). The message is
/// delivered with its header byte for byte, and the bridge goes on without a reconnect.
#[tokio::test]
async fn a_header_whose_long_string_is_not_utf8_is_delivered_as_it_came() {
    let mut w = World::start(Setup::new("not-utf8")).await;
    let binary = AMQPValue::LongString(LongString::from(vec![0xff_u8, 0xfe, 0x00, 0xc3]));
    let properties = BasicProperties::default().with_headers(headers(vec![
        ("x-delay", AMQPValue::LongLongInt(300)),
        ("binary", binary.clone()),
    ]));
    w.publish("rk.binary", b"binary", properties).await;
    w.publish("rk.after", b"after", with_delay(600)).await;
    let first = w.recv_within(10 * SEC).await;
    assert_eq!(first.body, b"binary");
    assert_eq!(first.header("binary"), Some(&binary));
    let after = w.recv_within(10 * SEC).await;
    assert_eq!(after.body, b"after");
    assert_eq!(w.stats().snapshot().reconnects, 0, "no session was lost");
    w.cleanup().await;
}

/// AMQP says short strings (header names, most properties, the routing key) are UTF-8, but
/// the broker passes on any bytes. lapin fails its whole connection on such a delivery, and
/// the broker gave it to the next session, which failed the same way: ten reconnects a
/// second and nothing else moved (281 reconnects in 30 s, nothing consumed); then a sweep
/// parked it after one lost session. The bridge's own connection reads it as bytes: it is
/// parked `unreadable` within the session, with the original property bytes and the body,
/// and no session is lost.
async fn an_unreadable_delivery_is_parked_and_the_bridge_goes_on(
    name: &str,
    routing_key: &[u8],
    properties: &[u8],
) -> Received {
    let mut w = World::start(Setup::new(name)).await;
    crate::support::raw::publish_raw_properties(
        &broker_url(),
        &w.ingress,
        routing_key,
        properties,
        b"unreadable",
    )
    .await;
    w.publish("rk.after", b"after", with_delay(600)).await;
    let parked = w.parked_within(20 * SEC).await;
    assert_eq!(parked.body, b"unreadable");
    assert_eq!(
        parked.header(header::REASON),
        Some(&text(ParkReason::Unreadable.as_str()))
    );
    let Some(AMQPValue::ByteArray(raw)) = parked.header(header::RAW_PROPERTIES) else {
        panic!("the original properties as bytes: {:?}", parked.properties);
    };
    // RabbitMQ 4 encodes again a table it can read (its entries in another order).
    let parse = |bytes: &[u8]| lapin::protocol::basic::parse_properties(bytes).map(|(_, p)| p);
    match (parse(raw.as_slice()), parse(properties)) {
        (Ok(kept), Ok(sent)) => assert_eq!(kept, sent, "the original properties"),
        _ => assert_eq!(
            raw.as_slice(),
            properties,
            "the original properties, byte for byte"
        ),
    }
    let after = w.recv_within(10 * SEC).await;
    assert_eq!(after.body, b"after", "the bridge goes on");
    let counts = w.stats().snapshot();
    assert_eq!(counts.parked, 1);
    assert_eq!(counts.reconnects, 0, "no session lost to it");
    w.cleanup().await;
    parked
}

/// An unreadable delivery among readable ones: it is parked, every readable message
/// arrives, and the session goes on.
#[tokio::test]
async fn an_unreadable_delivery_amid_a_stream_costs_no_session_and_no_message() {
    const EACH_SIDE: usize = 200;
    let mut w = World::start(Setup::new("unreadable-amid")).await;
    let publish_batch = |from: usize| {
        let w = &w;
        async move {
            for i in from..from + EACH_SIDE {
                w.publish(
                    &format!("rk.{i}"),
                    format!("m{i}").as_bytes(),
                    with_delay(800),
                )
                .await;
            }
        }
    };
    publish_batch(0).await;
    crate::support::raw::publish_with_header_named(
        &broker_url(),
        &w.ingress,
        800,
        &[0xc0, 0x80],
        b"unreadable",
    )
    .await;
    publish_batch(EACH_SIDE).await;
    let parked = w.parked_within(20 * SEC).await;
    assert_eq!(parked.body, b"unreadable");
    let mut seen = std::collections::BTreeSet::new();
    while seen.len() < 2 * EACH_SIDE {
        let m = w.recv_within(20 * SEC).await;
        seen.insert(String::from_utf8(m.body).unwrap());
    }
    assert!(w.pending_in_queues().await == 0, "nothing left behind");
    assert_eq!(w.stats().snapshot().reconnects, 0, "no session lost to it");
    w.cleanup().await;
}

#[tokio::test]
async fn a_header_name_that_is_not_utf8_is_parked_unreadable() {
    let mut properties = (1u16 << 13).to_be_bytes().to_vec();
    properties.extend(crate::support::raw::headers_named(300, &[0xff, 0xfe]));
    let parked = an_unreadable_delivery_is_parked_and_the_bridge_goes_on(
        "name-not-utf8",
        b"rk.bad",
        &properties,
    )
    .await;
    assert_eq!(parked.routing_key, "rk.bad");
    assert_eq!(parked.header(header::RAW_ROUTING_KEY), None);
}

#[tokio::test]
async fn a_message_id_that_is_not_utf8_is_parked_unreadable() {
    let properties = crate::support::raw::message_id_properties(300, &[b'i', 0xc3, b'd']);
    an_unreadable_delivery_is_parked_and_the_bridge_goes_on("id-not-utf8", b"rk.bad", &properties)
        .await;
}

#[tokio::test]
async fn a_routing_key_that_is_not_utf8_is_parked_unreadable() {
    let mut properties = (1u16 << 13).to_be_bytes().to_vec();
    properties.extend(crate::support::raw::headers_named(300, b"fine"));
    let routing_key = [b'r', b'k', 0xff];
    let parked = an_unreadable_delivery_is_parked_and_the_bridge_goes_on(
        "key-not-utf8",
        &routing_key,
        &properties,
    )
    .await;
    assert_eq!(
        parked.header(header::RAW_ROUTING_KEY),
        Some(&AMQPValue::ByteArray(routing_key.to_vec().into()))
    );
}

/// A message whose headers fill the broker's 128 KiB frame (the content header must fit in
/// one frame) is accepted from the publisher, but the bridge's state headers would push its
/// next hop past the frame size, which costs the whole connection: it is parked `too-large`
/// instead, and the bridge goes on without a reconnect.
#[tokio::test]
async fn headers_the_bridge_state_would_push_past_the_frame_size_are_parked_too_large() {
    let mut w = World::start(Setup::new("frame-full")).await;
    // Content header payload: 14 bytes + table (4 + 17 for x-delay + 9 + pad): 20 bytes
    // short of the 131 064 a 131 072-byte frame carries.
    publish_raw(
        &broker_url(),
        &w.ingress,
        "rk.full",
        &crate::support::raw::padded_headers(2_000, 131_000),
        b"full",
    )
    .await;
    w.publish("rk.after", b"after", with_delay(300)).await;
    let parked = w.parked_within(10 * SEC).await;
    assert_eq!(parked.body, b"full");
    assert_eq!(
        parked.header("delay-bridge-reason"),
        Some(&text("too-large"))
    );
    // With the parking headers it would not fit either: parked without the publisher's.
    assert_eq!(parked.header("pad"), None);
    let detail = format!("{:?}", parked.header("delay-bridge-detail"));
    assert!(detail.len() > 20, "a detail: {detail}");
    let after = w.recv_within(10 * SEC).await;
    assert_eq!(after.body, b"after");
    assert_eq!(w.stats().snapshot().reconnects, 0, "no session was lost");
    w.cleanup().await;
}

/// A `schedule` whose headers do not fit in one frame is refused by the typed client,
/// saying so, and costs nothing else: its connection stays open and the next schedule goes.
/// (The client sent such a content header; the broker closed the whole connection for it,
/// 501, and the client never reconnected.)
#[tokio::test]
async fn a_schedule_whose_headers_exceed_the_frame_is_refused_and_the_client_goes_on() {
    let mut w = World::start(Setup {
        ladder: "200ms",
        margin: Duration::from_millis(30),
        ..Setup::new("client-frame")
    })
    .await;
    let client = w.client().await;
    let big = BasicProperties::default().with_headers(headers(vec![(
        "big",
        AMQPValue::LongString(LongString::from(vec![b'x'; 200 * 1024])),
    )]));
    let refused = client
        .schedule(
            Message::new(w.ingress.as_str(), "rk.frame", b"over".to_vec())
                .with_properties(big)
                .with_message_id("over"),
            When::After(Duration::from_millis(300)),
        )
        .await
        .unwrap_err();
    assert!(refused.to_string().contains("frame_max"), "{refused}");
    client
        .schedule(
            Message::new(w.ingress.as_str(), "rk.frame", b"next".to_vec()).with_message_id("next"),
            When::After(Duration::from_millis(300)),
        )
        .await
        .expect("the client's connection is still open");
    let m = w.recv_within(10 * SEC).await;
    assert_eq!(m.body, b"next");
    client.close().await.unwrap();
    w.cleanup().await;
}

/// Large bodies due at one instant would all be held unacked for their last moments: 24
/// bodies of 256 KiB are 6 MiB. With `bridge.max_unacked_bytes` at 1 MiB the bridge narrows
/// its prefetch window to the four such bodies that fit, so it never holds more than that,
/// and every message still arrives once. (Before the byte budget, all 24 were held at once.)
#[tokio::test]
async fn large_bodies_are_held_within_the_byte_budget() {
    const BUDGET: u64 = 1 << 20;
    const BODY: usize = 256 << 10;
    const N: usize = 24;
    let mut w = World::start(Setup {
        max_unacked_bytes: Some(BUDGET),
        ..Setup::new("budget")
    })
    .await;
    // One body first: the bridge learns what bodies look like.
    w.publish("rk.warm", &vec![b'w'; BODY], with_delay(0)).await;
    w.recv_within(10 * SEC).await;
    let due = delay_bridge::clock::now_ms() + 1_500;
    for i in 0..N {
        let props = lapin::BasicProperties::default()
            .with_message_id(format!("big-{i}").into())
            .with_headers(headers(vec![(
                "x-deliver-at",
                lapin::types::AMQPValue::LongLongInt(due as i64),
            )]));
        w.publish("rk.big", &vec![b'b'; BODY], props).await;
    }
    large_bodies_arrive_once_within(w, N, BODY, BUDGET).await;
}

/// A backlog of large bodies that waits when the bridge starts: a new consumer's first
/// window is pushed whole before the bridge has seen a body, so that window must be one. A
/// session used to start at 64 and took the whole backlog at once (6 MiB here, against a
/// budget of 1 MiB), whatever the budget said.
#[tokio::test]
async fn a_backlog_of_large_bodies_at_a_start_is_held_within_the_byte_budget() {
    const BUDGET: u64 = 1 << 20;
    const BODY: usize = 256 << 10;
    const N: usize = 24;
    let mut w = World::start(Setup {
        max_unacked_bytes: Some(BUDGET),
        start_bridge: false,
        ..Setup::new("budget-backlog")
    })
    .await;
    for i in 0..N {
        let props = with_delay(0).with_message_id(format!("big-{i}").into());
        w.publish("rk.big", &vec![b'b'; BODY], props).await;
    }
    w.start_bridge().await;
    large_bodies_arrive_once_within(w, N, BODY, BUDGET).await;
}

/// Receives `n` messages of `body` bytes, each once, checks that the bridge never held more
/// than `budget` bytes of bodies unacked, and deletes the world.
async fn large_bodies_arrive_once_within(mut w: World, n: usize, body: usize, budget: u64) {
    let got = w.recv_n(n, 30 * SEC).await;
    let mut ids: Vec<String> = got
        .iter()
        .map(|m| m.properties.message_id().as_ref().unwrap().to_string())
        .collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), n, "every message once");
    assert!(got.iter().all(|m| m.body.len() == body));
    let most = w.stats().snapshot().max_unacked_bytes_seen;
    println!("budget: at most {most} body bytes unacked (budget {budget})");
    assert!(
        most <= budget,
        "held {most} bytes of bodies unacked, over the budget of {budget}"
    );
    w.assert_quiet(Duration::from_millis(300)).await;
    w.cleanup().await;
}

/// An entry of the cancel stream lapin cannot read (a header name that is not UTF-8,
/// appended by hand) failed every session at its catch-up, before it consumed anything;
/// then a bare connection read the stream apart after one lost session. The follower now
/// reads on the bridge's own connection, which hands the entry over as bytes: it is
/// skipped (nothing can be removed from a stream), a cancel appended after it still drops
/// its message, the next message is delivered, and no session is lost.
#[tokio::test]
async fn an_unreadable_cancel_stream_entry_is_skipped_without_a_lost_session() {
    use delay_bridge::client::{Message, When};
    let mut w = World::start(Setup::new("stream-unreadable")).await;
    crate::support::raw::publish_unreadable_into(
        &broker_url(),
        &w.config.names.cancel_stream(),
        b"not a tombstone anyone reads",
    )
    .await;
    let client = w.client().await;
    let message = |id: &str| {
        Message::new(w.ingress.as_str(), "rk.cancel", id.as_bytes().to_vec()).with_message_id(id)
    };
    client
        .schedule(message("doomed"), When::After(3 * SEC))
        .await
        .unwrap();
    client.cancel("doomed").await.unwrap();
    client
        .schedule(message("sentinel"), When::After(4 * SEC))
        .await
        .unwrap();
    let got = w.recv_within(20 * SEC).await;
    assert_eq!(
        got.body, b"sentinel",
        "the cancel after the bad entry applied"
    );
    assert_eq!(
        w.stats().snapshot().reconnects,
        0,
        "no session lost to it: {:?}",
        w.stats().snapshot()
    );
    client.close().await.unwrap();
    w.cleanup().await;
}
