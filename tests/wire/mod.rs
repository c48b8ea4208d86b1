//! The project's own connection (`delay_bridge::amqp::wire`) on the real broker: what it
//! carries comes out as sent, every publish learns its own confirm, a return reaches its
//! handler before the confirm of its publish (proved by counts under concurrency), a
//! channel error stays on its channel, and a connection the broker closes fails every
//! waiter. Its edges a real broker does not show on demand (a silent peer, a tune, a
//! refused login, channel numbers running out, a dropped connection) are tested against a
//! scripted fake broker (`fake_broker`).

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use delay_bridge::amqp::wire::{Channel, Confirm, Connection, Consumer, Delivery, WireError};
use delay_bridge::config::BrokerUrl;
use lapin::BasicProperties;
use lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};

use crate::support::*;

mod edges;
mod fake_broker;
use fake_broker::FakeBroker;

/// How long any single wait of these tests may take.
const WITHIN: Duration = Duration::from_secs(20);

async fn open(name: &str) -> Connection {
    let url = BrokerUrl::parse(&broker_url()).expect("the test URL");
    open_url(&url, name)
        .await
        .expect("the test broker answers (run scripts/broker.sh)")
}

/// A connection to `url` named `name`, or why not, answered within [`WITHIN`].
async fn open_url(url: &BrokerUrl, name: &str) -> Result<Connection, WireError> {
    tokio::time::timeout(WITHIN, Connection::open(url, name, Duration::from_secs(60)))
        .await
        .expect("answered in time")
}

/// A wrong password is the broker's refusal, 403 ACCESS_REFUSED, not a lost socket: the
/// connection asks for `authentication_failure_close`, so the broker says why it closes.
#[tokio::test]
async fn a_wrong_password_is_refused_with_403() {
    let mut url = url::Url::parse(&broker_url()).expect("the test URL");
    url.set_password(Some("certainly-not-the-password"))
        .expect("a URL with a password");
    let url = BrokerUrl::parse(url.as_str()).expect("a broker URL");
    match open_url(&url, "wire test wrong password").await {
        Err(error) => assert_eq!(error.reply_code(), Some(403), "{error}"),
        Ok(_) => panic!("a wrong password was accepted"),
    }
}

/// A return handler that panics (a bug in the caller's code, on the connection's reader)
/// fails the connection with a reason, and every waiter is answered: the publish's confirm
/// gets an error instead of waiting for ever, the connection no longer looks open, and a
/// later publish is refused at once.
#[tokio::test]
async fn a_panicking_return_handler_fails_the_connection_and_answers_every_waiter() {
    let connection = open("delay-bridge test wire panicking handler").await;
    let channel = confirm_channel(&connection).await;
    channel.on_return(Box::new(|_| panic!("a return handler's bug")));
    let confirm = channel
        .publish(
            "",
            "nowhere-at-all",
            true,
            &BasicProperties::default(),
            b"unroutable",
        )
        .unwrap();
    let answered = tokio::time::timeout(WITHIN, confirm)
        .await
        .expect("the confirm is answered");
    assert!(answered.is_err(), "{answered:?}");
    let failed = tokio::time::timeout(WITHIN, connection.failed())
        .await
        .expect("the connection fails");
    assert!(failed.to_string().contains("panicked"), "{failed}");
    assert!(!connection.is_open());
    assert!(
        channel
            .publish("", "q", false, &BasicProperties::default(), b"later")
            .is_err()
    );
}

/// A peer that accepts the socket and never answers (a broker stopped with SIGSTOP, a
/// black hole behind a load balancer) fails the connect within the URL's
/// `connection_timeout`, instead of holding the caller for ever.
#[tokio::test]
async fn a_peer_that_never_answers_fails_the_connect_within_its_timeout() {
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = silent.local_addr().unwrap().port();
    let holding = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = silent.accept().await {
            held.push(socket);
        }
    });
    let url = BrokerUrl::parse(&format!(
        "amqp://guest:guest@127.0.0.1:{port}/%2f?connection_timeout=300"
    ))
    .expect("a broker URL");
    match open_url(&url, "wire test silent peer").await {
        Err(error) => assert!(error.to_string().contains("300ms"), "{error}"),
        Ok(_) => panic!("a silent peer was taken for a broker"),
    }
    holding.abort();
}

/// The URL's `frame_max`, `channel_max` and `heartbeat` are what the connection agrees
/// with the broker (each lower than RabbitMQ's offer), and a body larger than the frame
/// travels in several frames and comes out whole.
#[tokio::test]
async fn the_urls_frame_max_channel_max_and_heartbeat_are_agreed() {
    let mut url = url::Url::parse(&broker_url()).expect("the test URL");
    url.query_pairs_mut()
        .append_pair("frame_max", "8192")
        .append_pair("channel_max", "10")
        .append_pair("heartbeat", "7");
    let url = BrokerUrl::parse(url.as_str()).expect("a broker URL");
    let connection = open_url(&url, "wire test tuned")
        .await
        .expect("the test broker answers");
    let tuned = connection.tuned();
    assert_eq!(
        (tuned.frame_max, tuned.channel_max, tuned.heartbeat),
        (8192, 10, 7)
    );
    let queue = TestQueue::declare("wire-tuned").await;
    let channel = confirm_channel(&connection).await;
    let body: Vec<u8> = (0..50_000u32).map(|i| i as u8).collect();
    let confirm = channel
        .publish("", &queue.name, false, &BasicProperties::default(), &body)
        .unwrap();
    assert_eq!(confirm.await.unwrap(), Confirm::Ack);
    let (_consuming, mut consumer) = consume(&connection, &queue.name).await;
    assert_eq!(next_delivery(&mut consumer).await.data, body);
    connection.close().await;
    queue.delete().await;
}

/// The tune a fake broker offers.
fn offer(
    channel_max: u16,
    frame_max: u32,
    heartbeat: u16,
) -> amq_protocol::protocol::connection::Tune {
    amq_protocol::protocol::connection::Tune {
        channel_max,
        frame_max,
        heartbeat,
    }
}

/// Opens a connection to `broker` with `query` on its URL, the broker offering `tune`.
async fn open_to_fake(
    broker: &FakeBroker,
    query: &str,
    heartbeat: Duration,
    tune: amq_protocol::protocol::connection::Tune,
) -> (Connection, fake_broker::Peer) {
    let url = BrokerUrl::parse(&broker.url(query)).expect("a broker URL");
    let opening =
        tokio::spawn(
            async move { Connection::open(&url, "wire test fake broker", heartbeat).await },
        );
    let peer = broker.accept_and_open(tune).await;
    let connection = tokio::time::timeout(WITHIN, opening)
        .await
        .expect("opened in time")
        .expect("task")
        .unwrap_or_else(|e| panic!("the fake broker's connection: {e}"));
    (connection, peer)
}

/// What the connection agrees for each offer: the broker's limits when the URL asks for
/// none, the lower of the two otherwise; a `0` offer means no limit (a heartbeat of `0`:
/// the client's choice).
#[tokio::test]
async fn the_tune_is_the_lower_of_the_offer_and_the_urls() {
    let cases = [
        ("", 60, offer(2047, 131_072, 60), (2047, 131_072, 60)),
        ("", 60, offer(0, 0, 0), (u16::MAX, 131_072, 60)),
        ("", 60, offer(5, 4096, 10), (5, 4096, 10)),
        (
            "?frame_max=8192&channel_max=3&heartbeat=4",
            60,
            offer(2047, 131_072, 60),
            (3, 8192, 4),
        ),
        (
            "?frame_max=1000000",
            60,
            offer(0, 0, 0),
            (u16::MAX, 131_072, 60),
        ),
        (
            "?heartbeat=0",
            60,
            offer(2047, 131_072, 60),
            (2047, 131_072, 0),
        ),
    ];
    for (query, heartbeat, tune, expected) in cases {
        let broker = FakeBroker::listen().await;
        let (connection, _peer) =
            open_to_fake(&broker, query, Duration::from_secs(heartbeat), tune.clone()).await;
        let tuned = connection.tuned();
        assert_eq!(
            (tuned.channel_max, tuned.frame_max, tuned.heartbeat),
            expected,
            "offer {tune:?}, URL query {query:?}"
        );
    }
}

/// A login the broker refuses is its `connection.close` with 403, read as such (no
/// RabbitMQ needed: the fake broker refuses as RabbitMQ does).
#[tokio::test]
async fn a_refused_login_is_the_brokers_403() {
    let broker = FakeBroker::listen().await;
    let url = BrokerUrl::parse(&broker.url("")).expect("a broker URL");
    let opening = tokio::spawn(async move {
        Connection::open(&url, "wire test refused login", Duration::ZERO).await
    });
    let _peer = broker.accept_and_refuse_login().await;
    let refused = tokio::time::timeout(WITHIN, opening)
        .await
        .expect("answered in time")
        .expect("task");
    match refused {
        Err(error) => {
            assert_eq!(error.reply_code(), Some(403), "{error}");
            assert!(error.to_string().contains("ACCESS_REFUSED"), "{error}");
        }
        Ok(_) => panic!("a refused login opened a connection"),
    }
}

/// A broker that stops answering (here: says nothing after the handshake) fails the
/// connection after two heartbeat intervals, and whoever waits on it learns why.
#[tokio::test]
async fn a_silent_broker_fails_the_connection_after_two_heartbeats() {
    let broker = FakeBroker::listen().await;
    let (connection, _peer) =
        open_to_fake(&broker, "", Duration::from_secs(1), offer(2047, 131_072, 1)).await;
    assert_eq!(connection.tuned().heartbeat, 1);
    let failed = tokio::time::timeout(WITHIN, connection.failed())
        .await
        .expect("the connection failed in time");
    assert!(matches!(failed, WireError::MissedHeartbeats(_)), "{failed}");
    assert!(!connection.is_open());
}

/// A broker that answers only with heartbeats keeps the connection open past two
/// heartbeat intervals: silence, not idleness, fails it.
#[tokio::test]
async fn a_broker_that_sends_heartbeats_keeps_the_connection_open() {
    let broker = FakeBroker::listen().await;
    let (connection, mut peer) =
        open_to_fake(&broker, "", Duration::from_secs(1), offer(2047, 131_072, 1)).await;
    let until = tokio::time::Instant::now() + Duration::from_secs(3);
    while tokio::time::Instant::now() < until {
        peer.heartbeat().await;
        tokio::select! {
            failed = connection.failed() => panic!("the connection failed: {failed}"),
            _ = tokio::time::sleep(Duration::from_millis(300)) => {}
        }
    }
    assert!(
        connection.is_open(),
        "three intervals of heartbeats and nothing else"
    );
}

/// With every channel number the broker allows in use, opening one more fails at once
/// (`NoChannelFree`), asking the broker nothing.
#[tokio::test]
async fn channel_numbers_run_out_at_the_brokers_channel_max() {
    let broker = FakeBroker::listen().await;
    let (connection, peer) = open_to_fake(&broker, "", Duration::ZERO, offer(2, 131_072, 0)).await;
    let answering = tokio::spawn(peer.open_every_channel());
    let first = connection.open_channel().await.expect("channel 1");
    let second = connection.open_channel().await.expect("channel 2");
    assert_eq!((first.id(), second.id()), (1, 2));
    assert!(matches!(
        connection.open_channel().await,
        Err(WireError::NoChannelFree)
    ));
    drop((first, second));
    drop(connection);
    tokio::time::timeout(WITHIN, answering)
        .await
        .expect("the fake broker saw the client go")
        .expect("task");
}

/// A dropped connection ends its reader and writer even while the peer keeps its socket
/// open and says nothing (a broker that blocks, or stopped): it does not keep a task
/// reading for ever.
#[tokio::test]
async fn a_dropped_connection_ends_its_tasks_while_the_peer_says_nothing() {
    let broker = FakeBroker::listen().await;
    let (connection, mut peer) = open_to_fake(
        &broker,
        "?heartbeat=0",
        Duration::ZERO,
        offer(2047, 131_072, 0),
    )
    .await;
    let metrics = tokio::runtime::Handle::current().metrics();
    // The reader and the writer (no heartbeat task: heartbeats are off).
    let with_connection = metrics.num_alive_tasks();
    drop(connection);
    assert!(
        peer.closed_by_client_within(WITHIN).await,
        "the client closed its side of the socket"
    );
    wait_until("the connection's two tasks ended", WITHIN, move || {
        metrics.num_alive_tasks() + 2 <= with_connection
    })
    .await;
}

/// A channel in confirm mode.
async fn confirm_channel(connection: &Connection) -> Channel {
    let channel = connection.open_channel().await.unwrap();
    channel.confirm_select().await.unwrap();
    channel
}

/// A channel with a prefetch of 10 consuming `queue`.
async fn consume(connection: &Connection, queue: &str) -> (Channel, Consumer) {
    let channel = connection.open_channel().await.unwrap();
    channel.qos(10).await.unwrap();
    let consumer = channel
        .consume(queue, "", FieldTable::default())
        .await
        .unwrap();
    (channel, consumer)
}

/// The consumer's next delivery, within [`WITHIN`].
async fn next_delivery(consumer: &mut Consumer) -> Delivery {
    tokio::time::timeout(WITHIN, consumer.next())
        .await
        .expect("delivered in time")
        .expect("the consumer is open")
        .expect("a delivery, not the consumer's end")
}

/// A queue of the test's own (lapin declares and deletes it, so that what is tested is
/// only the connection's traffic).
struct TestQueue {
    name: String,
    lapin: lapin::Connection,
}

impl TestQueue {
    async fn declare(test: &str) -> Self {
        let lapin = connect().await;
        let name = unique_prefix(test);
        let channel = lapin.create_channel().await.unwrap();
        channel
            .queue_declare(
                name.as_str().into(),
                QueueDeclareOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        Self { name, lapin }
    }

    async fn messages(&self) -> u64 {
        let channel = self.lapin.create_channel().await.unwrap();
        delay_bridge::amqp::queue_counts(&channel, &self.name)
            .await
            .unwrap()
            .messages
    }

    async fn delete(self) {
        let channel = self.lapin.create_channel().await.unwrap();
        channel
            .queue_delete(self.name.as_str().into(), QueueDeleteOptions::default())
            .await
            .unwrap();
        let _ = self.lapin.close(200, "done".into()).await;
    }
}

/// [`every_property`], with a header whose long string is not UTF-8 (AMQP allows any
/// bytes there).
fn every_kind_of_property() -> BasicProperties {
    let properties = every_property();
    let mut headers = properties.headers().clone().unwrap_or_default();
    headers.insert(
        "binary".into(),
        AMQPValue::LongString(LongString::from(vec![0xff, 0xfe, 0x00, 0x80])),
    );
    properties.with_headers(headers)
}

#[tokio::test]
async fn what_it_publishes_and_consumes_comes_out_as_sent() {
    let queue = TestQueue::declare("wire-roundtrip").await;
    let connection = open("delay-bridge test wire roundtrip").await;
    let publishing = confirm_channel(&connection).await;
    let properties = every_kind_of_property();
    // Larger than a frame (128 KiB): it travels in several body frames each way.
    let large: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    for body in [&b""[..], b"small", &large] {
        let confirm = publishing
            .publish("", &queue.name, true, &properties, body)
            .unwrap();
        assert_eq!(confirm.await.unwrap(), Confirm::Ack);
    }
    let (consuming, mut consumer) = consume(&connection, &queue.name).await;
    for body in [&b""[..], b"small", &large] {
        let delivery = next_delivery(&mut consumer).await;
        assert_eq!(delivery.data, body);
        assert_eq!(delivery.properties, properties);
        assert_eq!(delivery.routing_key.as_str(), queue.name);
        assert!(!delivery.redelivered);
        consuming.ack([(delivery.delivery_tag, false)]).unwrap();
    }
    connection.close().await;
    assert!(!connection.is_open());
    queue.delete().await;
}

#[tokio::test]
async fn a_nacked_delivery_comes_back_redelivered_and_a_multiple_ack_settles_the_rest() {
    let queue = TestQueue::declare("wire-acks").await;
    let connection = open("delay-bridge test wire acks").await;
    let publishing = confirm_channel(&connection).await;
    let mut confirms = Vec::new();
    for i in 0..5u8 {
        confirms.push(
            publishing
                .publish("", &queue.name, false, &BasicProperties::default(), &[i])
                .unwrap(),
        );
    }
    for confirm in confirms {
        assert_eq!(confirm.await.unwrap(), Confirm::Ack);
    }
    let (consuming, mut consumer) = consume(&connection, &queue.name).await;
    let mut first = Vec::new();
    for _ in 0..5 {
        first.push(next_delivery(&mut consumer).await);
    }
    consuming
        .nack([(first[0].delivery_tag, false)], true)
        .unwrap();
    let again = next_delivery(&mut consumer).await;
    assert!(again.redelivered);
    assert_eq!(again.data, first[0].data);
    consuming.ack([(again.delivery_tag, true)]).unwrap();
    // Everything acked: after a close and reopen the queue is empty.
    connection.close().await;
    assert_eq!(queue.messages().await, 0, "every delivery was acked");
    queue.delete().await;
}

#[tokio::test]
async fn every_return_reaches_its_handler_before_the_confirm_of_its_publish() {
    const TASKS: usize = 6;
    const EACH: usize = 1_000;
    let queue = TestQueue::declare("wire-returns").await;
    let connection = open("delay-bridge test wire returns").await;
    let channel = confirm_channel(&connection).await;
    let returned: Arc<Mutex<HashSet<String>>> = Arc::default();
    let seen = returned.clone();
    channel.on_return(Box::new(move |message| {
        let id = message.properties.message_id().clone().unwrap();
        assert!(
            seen.lock().unwrap().insert(id.to_string()),
            "returned twice"
        );
    }));
    let mut tasks = tokio::task::JoinSet::new();
    for task in 0..TASKS {
        let channel = channel.clone();
        let queue = queue.name.clone();
        let returned = returned.clone();
        tasks.spawn(async move {
            let mut returns_before_confirm = 0;
            for i in 0..EACH {
                let id = format!("{task}-{i}");
                let unroutable = i % 3 == 0;
                let key = if unroutable { "nowhere-at-all" } else { &queue };
                let properties = BasicProperties::default().with_message_id(id.as_str().into());
                let confirm = channel
                    .publish("", key, true, &properties, id.as_bytes())
                    .unwrap();
                assert_eq!(confirm.await.unwrap(), Confirm::Ack);
                let was_returned = returned.lock().unwrap().contains(&id);
                assert_eq!(was_returned, unroutable, "publish {id}");
                returns_before_confirm += usize::from(was_returned);
                if i % 50 == 0 {
                    tokio::task::yield_now().await;
                }
            }
            returns_before_confirm
        });
    }
    let mut returns_before_confirm = 0;
    while let Some(counted) = tasks.join_next().await {
        returns_before_confirm += counted.unwrap();
    }
    let unroutable = TASKS * EACH.div_ceil(3);
    assert_eq!(returns_before_confirm, unroutable);
    assert_eq!(returned.lock().unwrap().len(), unroutable);
    assert_eq!(channel.unconfirmed(), 0);
    assert_eq!(queue.messages().await as usize, TASKS * EACH - unroutable);
    connection.close().await;
    queue.delete().await;
}

#[tokio::test]
async fn a_channel_error_fails_its_channel_and_leaves_the_others_working() {
    let queue = TestQueue::declare("wire-channel-error").await;
    let connection = open("delay-bridge test wire channel error").await;
    let doomed = connection.open_channel().await.unwrap();
    let working = confirm_channel(&connection).await;
    match doomed
        .check_exchange(&format!("{}-missing", queue.name))
        .await
    {
        Err(WireError::Closed {
            what: "channel",
            code: 404,
            ..
        }) => {}
        other => panic!("expected a 404 channel error, got {other:?}"),
    }
    assert!(!doomed.is_open());
    assert!(doomed.error().unwrap().is_channel_error());
    assert!(
        doomed.qos(1).await.is_err(),
        "a closed channel refuses calls"
    );
    let confirm = working
        .publish("", &queue.name, true, &BasicProperties::default(), b"still")
        .unwrap();
    assert_eq!(confirm.await.unwrap(), Confirm::Ack);
    assert!(connection.is_open());
    // A new channel opens beside them.
    let fresh = connection.open_channel().await.unwrap();
    fresh.qos(5).await.unwrap();
    fresh.close().await.unwrap();
    assert!(!fresh.is_open());
    connection.close().await;
    queue.delete().await;
}

/// Once `close` has begun, the channel takes no more publishes: a publish sent after the
/// broker's `close-ok` would be on a closed channel, which costs the whole connection.
#[tokio::test]
async fn a_channel_being_closed_takes_no_more_publishes() {
    use futures::FutureExt;
    let queue = TestQueue::declare("wire-closing").await;
    let connection = open("delay-bridge test wire closing").await;
    let channel = confirm_channel(&connection).await;
    let confirm = channel
        .publish(
            "",
            &queue.name,
            true,
            &BasicProperties::default(),
            b"before",
        )
        .unwrap();
    let mut closing = Box::pin(channel.close());
    assert!(
        (&mut closing).now_or_never().is_none(),
        "the close waits for the broker"
    );
    match channel.publish("", &queue.name, true, &BasicProperties::default(), b"after") {
        Err(WireError::ChannelClosed) => {}
        Err(other) => panic!("expected ChannelClosed, got {other}"),
        Ok(_) => panic!("a publish went out on a channel being closed"),
    }
    tokio::time::timeout(WITHIN, closing)
        .await
        .expect("closed in time")
        .expect("the broker answered the close");
    // The broker may answer the close before it confirms what came before it: that
    // publish then fails with the channel; it does not hang.
    let confirmed = tokio::time::timeout(WITHIN, confirm)
        .await
        .expect("in time");
    assert!(
        matches!(confirmed, Ok(Confirm::Ack) | Err(WireError::ChannelClosed)),
        "what was published before the close is settled: {confirmed:?}"
    );
    assert!(connection.is_open());
    connection.close().await;
    queue.delete().await;
}

#[tokio::test]
async fn a_connection_the_broker_closes_fails_every_waiter() {
    let queue = TestQueue::declare("wire-closed").await;
    let name = format!("delay-bridge test wire closed {}", queue.name);
    let connection = open(&name).await;
    let channel = connection.open_channel().await.unwrap();
    channel.qos(10).await.unwrap();
    let mut consumer = channel
        .consume(&queue.name, "", FieldTable::default())
        .await
        .unwrap();
    let closer = tokio::task::spawn_blocking(move || close_connections_named(&name));
    let ended = tokio::time::timeout(WITHIN, consumer.next())
        .await
        .expect("the consumer ends in time");
    assert_eq!(closer.await.unwrap(), 1);
    match ended {
        Err(WireError::Closed {
            what: "connection",
            code: 320,
            ..
        }) => {}
        other => panic!("expected the broker's 320, got {other:?}"),
    }
    let failed = tokio::time::timeout(WITHIN, connection.failed())
        .await
        .expect("failed() resolves");
    assert!(matches!(failed, WireError::Closed { code: 320, .. }));
    assert!(channel.qos(1).await.is_err());
    assert!(connection.open_channel().await.is_err());
    queue.delete().await;
}

#[tokio::test]
async fn heartbeats_keep_an_idle_connection_open() {
    let url = BrokerUrl::parse(&broker_url()).expect("the test URL");
    let connection = Connection::open(
        &url,
        "delay-bridge test wire heartbeat",
        Duration::from_secs(1),
    )
    .await
    .unwrap();
    assert_eq!(connection.tuned().heartbeat, 1);
    // The broker closes a connection that sends nothing for two intervals; it stays open
    // for three times as long, idle but for heartbeats.
    let idle = tokio::time::timeout(Duration::from_secs(6), connection.failed()).await;
    assert!(idle.is_err(), "the connection failed: {:?}", idle.unwrap());
    let channel = connection.open_channel().await.unwrap();
    channel.qos(1).await.unwrap();
    connection.close().await;
}

#[tokio::test]
async fn a_cancelled_consumer_ends_without_an_error_and_its_channel_stays_open() {
    let queue = TestQueue::declare("wire-cancel").await;
    let connection = open("delay-bridge test wire cancel").await;
    let channel = connection.open_channel().await.unwrap();
    let mut mine = channel
        .consume(&queue.name, "mine", FieldTable::default())
        .await
        .unwrap();
    assert_eq!(mine.tag().as_str(), "mine");
    channel.cancel(mine.tag()).await.unwrap();
    let ended = tokio::time::timeout(WITHIN, mine.next()).await.unwrap();
    assert!(matches!(ended, Ok(None)), "{ended:?}");
    // The broker cancels a consumer whose queue is deleted.
    let mut theirs = channel
        .consume(&queue.name, "", FieldTable::default())
        .await
        .unwrap();
    let name = queue.name.clone();
    queue.delete().await;
    let ended = tokio::time::timeout(WITHIN, theirs.next()).await.unwrap();
    assert!(matches!(ended, Ok(None)), "{ended:?} after deleting {name}");
    assert!(channel.is_open());
    channel.qos(3).await.unwrap();
    connection.close().await;
}
