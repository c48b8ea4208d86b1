//! What moving the bridge's data path to amqprs (docs/performance.md, "The client's share")
//! would rely on, checked on the real broker before anything relies on it, and what rules
//! the move out (a delivery with a binary long string ends amqprs's connection). amqprs is a
//! dependency of the `bench` feature only, as is this module.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use amqprs::callbacks::{ChannelCallback, DefaultConnectionCallback};
use amqprs::channel::{BasicPublishArguments, Channel as RsChannel, ConfirmSelectArguments};
use amqprs::connection::{Connection as RsConnection, OpenConnectionArguments};
use amqprs::{Ack, BasicProperties as RsProperties, Cancel, CloseChannel, Nack, Return};
use lapin::options::{
    ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions, QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::uri::AMQPUri;

use crate::support::*;

/// What the broker told a confirm-mode channel, in the order the callback saw it.
#[derive(Debug, Clone, Copy)]
enum Event {
    /// A returned publish, by the sequence number its body carries.
    Returned(u64),
    /// A confirm: `multiple` settles every unsettled publish up to `tag`.
    Acked { tag: u64, multiple: bool },
    /// A negative confirm.
    Nacked { tag: u64, multiple: bool },
}

/// Records every event of the channel it is registered on.
struct Recorder(Arc<Mutex<Vec<Event>>>);

impl Recorder {
    fn push(&self, event: Event) {
        self.0.lock().unwrap().push(event);
    }
}

#[async_trait::async_trait]
impl ChannelCallback for Recorder {
    async fn close(
        &mut self,
        _: &RsChannel,
        close: CloseChannel,
    ) -> Result<(), amqprs::error::Error> {
        panic!("the broker closed the publishing channel: {close}");
    }
    async fn cancel(&mut self, _: &RsChannel, _: Cancel) -> Result<(), amqprs::error::Error> {
        Ok(())
    }
    async fn flow(&mut self, _: &RsChannel, active: bool) -> Result<bool, amqprs::error::Error> {
        Ok(active)
    }
    async fn publish_ack(&mut self, _: &RsChannel, ack: Ack) {
        self.push(Event::Acked {
            tag: ack.delivery_tag(),
            multiple: ack.mutiple(),
        });
    }
    async fn publish_nack(&mut self, _: &RsChannel, nack: Nack) {
        self.push(Event::Nacked {
            tag: nack.delivery_tag(),
            multiple: nack.multiple(),
        });
    }
    async fn publish_return(&mut self, _: &RsChannel, _: Return, _: RsProperties, body: Vec<u8>) {
        let sequence = u64::from_be_bytes(body[..8].try_into().expect("an 8-byte body"));
        self.push(Event::Returned(sequence));
    }
}

/// How many publishes the confirms among `events` settled, each counted once.
fn confirmed(events: &[Event]) -> u64 {
    let mut settled = BTreeSet::new();
    for event in events {
        match *event {
            Event::Acked {
                tag,
                multiple: true,
            }
            | Event::Nacked {
                tag,
                multiple: true,
            } => settled.extend(1..=tag),
            Event::Acked { tag, .. } | Event::Nacked { tag, .. } => {
                settled.insert(tag);
            }
            Event::Returned(_) => {}
        }
    }
    settled.len() as u64
}

/// An amqprs connection to the test broker.
async fn rs_connect() -> RsConnection {
    let uri: AMQPUri = broker_url().parse().expect("the test broker's URL");
    let mut arguments = OpenConnectionArguments::new(
        &uri.authority.host,
        uri.authority.port,
        &uri.authority.userinfo.username,
        &uri.authority.userinfo.password,
    );
    arguments.virtual_host(&uri.vhost);
    let connection = RsConnection::open(&arguments)
        .await
        .expect("amqprs connects");
    connection
        .register_callback(DefaultConnectionCallback)
        .await
        .unwrap();
    connection
}

/// The trap lapin fell into (it hands a return to whichever confirm completes first; hence
/// `amqp::returns`), checked for amqprs with counts: many publishes from several tasks at
/// once on one channel, a third of them unroutable and mandatory. Every return reaches the
/// callback before any ack that settles its publish, exactly the unroutable publishes are
/// returned, and every publish is settled once. The ack right after a return is not always
/// its own: the broker may confirm earlier routable publishes in between (counted and
/// printed), so a publisher on amqprs still needs the return ledger.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqprs_hands_each_return_over_before_the_ack_that_settles_its_publish() {
    const PUBLISHES: u64 = 6000;
    const TASKS: u64 = 6;
    let prefix = unique_prefix("amqprs-pairing");
    let exchange = format!("{prefix}.exchange");
    let queue = format!("{prefix}.queue");
    let lapin = connect().await;
    let setup = lapin.create_channel().await.unwrap();
    setup
        .exchange_declare(
            exchange.as_str().into(),
            lapin::ExchangeKind::Direct,
            ExchangeDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    declare_queue(&setup, &queue).await;
    setup
        .queue_bind(
            queue.as_str().into(),
            exchange.as_str().into(),
            "routable".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();

    let connection = rs_connect().await;
    let channel = connection.open_channel(None).await.unwrap();
    let events = Arc::new(Mutex::new(Vec::new()));
    channel
        .register_callback(Recorder(events.clone()))
        .await
        .unwrap();
    channel
        .confirm_select(ConfirmSelectArguments::default())
        .await
        .unwrap();
    // A publish's sequence number is the order its frames are written in: taken and
    // written under one lock.
    let next_sequence = Arc::new(tokio::sync::Mutex::new(0u64));
    let unroutable = Arc::new(Mutex::new(BTreeSet::new()));
    let mut publishers = tokio::task::JoinSet::new();
    for _ in 0..TASKS {
        let (channel, exchange) = (channel.clone(), exchange.clone());
        let (next_sequence, unroutable) = (next_sequence.clone(), unroutable.clone());
        publishers.spawn(async move {
            for _ in 0..PUBLISHES / TASKS {
                let mut last = next_sequence.lock().await;
                *last += 1;
                let sequence = *last;
                let routable = rand::random_ratio(2, 3);
                if !routable {
                    unroutable.lock().unwrap().insert(sequence);
                }
                let key = if routable { "routable" } else { "nowhere" };
                let mut arguments = BasicPublishArguments::new(&exchange, key);
                arguments.mandatory(true);
                channel
                    .basic_publish(
                        RsProperties::default(),
                        sequence.to_be_bytes().to_vec(),
                        arguments,
                    )
                    .await
                    .unwrap();
                drop(last);
                tokio::task::yield_now().await;
            }
        });
    }
    while let Some(published) = publishers.join_next().await {
        published.unwrap();
    }
    // Not "until tag PUBLISHES is confirmed": the broker confirms an unroutable publish
    // right after its return, ahead of earlier routable ones still waiting on their queue.
    wait_until("every publish confirmed", Duration::from_secs(30), || {
        confirmed(&events.lock().unwrap()) == PUBLISHES
    })
    .await;

    let events = events.lock().unwrap().clone();
    let unroutable = unroutable.lock().unwrap().clone();
    let mut settled = BTreeSet::new();
    let mut waiting_returns = BTreeSet::new();
    let mut returns = BTreeSet::new();
    // Acks that came between a return and the ack settling its publish.
    let mut acks_between = 0;
    // Acks of a publish older than one the broker had already confirmed.
    let (mut highest_acked, mut acks_out_of_order) = (0, 0);
    for event in &events {
        match *event {
            Event::Returned(sequence) => {
                assert!(
                    !settled.contains(&sequence),
                    "publish {sequence} returned after its ack"
                );
                assert!(
                    returns.insert(sequence),
                    "publish {sequence} returned twice"
                );
                waiting_returns.insert(sequence);
            }
            Event::Acked { tag, multiple } => {
                if tag < highest_acked {
                    acks_out_of_order += 1;
                }
                highest_acked = highest_acked.max(tag);
                let covered: Vec<u64> = if multiple {
                    (1..=tag).filter(|s| !settled.contains(s)).collect()
                } else {
                    vec![tag]
                };
                for sequence in &covered {
                    assert!(settled.insert(*sequence), "publish {sequence} acked twice");
                    waiting_returns.remove(sequence);
                }
                acks_between += waiting_returns.len();
            }
            Event::Nacked { tag, multiple } => {
                panic!("the broker nacked {tag} (multiple {multiple})")
            }
        }
    }
    assert!(
        waiting_returns.is_empty(),
        "returns whose publish no ack settled: {waiting_returns:?}"
    );
    assert_eq!(settled.len() as u64, PUBLISHES, "publishes settled");
    assert_eq!(
        returns, unroutable,
        "the returned publishes are exactly the unroutable ones"
    );
    eprintln!(
        "{PUBLISHES} publishes, {} returned; {acks_between} times an ack of another publish came between a return and its own ack; {acks_out_of_order} acks settled an older publish than one already acked",
        returns.len()
    );

    let _ = connection.close().await;
    setup
        .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    setup
        .exchange_delete(exchange.as_str().into(), ExchangeDeleteOptions::default())
        .await
        .unwrap();
    let _ = lapin.close(200, "done".into()).await;
}

/// The bridge publishes each message with its original properties. Relayed by amqprs
/// (consumed, then published as it came), a message with every property and every header
/// type arrives exactly as the same message through a plain queue does: amqprs's codec
/// keeps what it does not interpret.
#[tokio::test]
async fn a_message_relayed_by_amqprs_keeps_every_property_and_header_type() {
    use amqprs::channel::{BasicConsumeArguments, BasicPublishArguments};
    use futures::StreamExt;
    use lapin::options::{BasicConsumeOptions, BasicPublishOptions};
    const WITHIN: Duration = Duration::from_secs(10);
    let prefix = unique_prefix("amqprs-fidelity");
    let [plain, into_relay, out_of_relay] =
        ["plain", "into-relay", "out-of-relay"].map(|q| format!("{prefix}.{q}"));
    let lapin = connect().await;
    let channel = lapin.create_channel().await.unwrap();
    for queue in [&plain, &into_relay, &out_of_relay] {
        declare_queue(&channel, queue).await;
    }
    let body = b"{\"order\": 42}".to_vec();
    for queue in [&plain, &into_relay] {
        channel
            .basic_publish(
                "".into(),
                queue.as_str().into(),
                BasicPublishOptions::default(),
                &body,
                every_property(),
            )
            .await
            .unwrap();
    }

    let connection = rs_connect().await;
    let relay = connection.open_channel(None).await.unwrap();
    let (_, mut relayed) = relay
        .basic_consume_rx(
            BasicConsumeArguments::new(&into_relay, "")
                .auto_ack(true)
                .finish(),
        )
        .await
        .unwrap();
    let message = tokio::time::timeout(WITHIN, relayed.recv())
        .await
        .expect("amqprs receives the message")
        .expect("the consumer is open");
    relay
        .basic_publish(
            message.basic_properties.expect("properties"),
            message.content.expect("a body"),
            BasicPublishArguments::new("", &out_of_relay),
        )
        .await
        .unwrap();

    let mut arrived = Vec::new();
    for queue in [&plain, &out_of_relay] {
        let mut consumer = channel
            .basic_consume(
                queue.as_str().into(),
                "".into(),
                BasicConsumeOptions {
                    no_ack: true,
                    ..BasicConsumeOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap();
        let delivery = tokio::time::timeout(WITHIN, consumer.next())
            .await
            .unwrap_or_else(|_| panic!("a message arrives in {queue}"))
            .expect("the consumer is open")
            .unwrap();
        arrived.push(delivery);
    }
    let [through_plain, through_relay] = [&arrived[0], &arrived[1]];
    let headers = through_plain
        .properties
        .headers()
        .as_ref()
        .expect("headers");
    assert_eq!(
        headers.inner().len(),
        17,
        "the broker kept every header: {headers:?}"
    );
    assert_eq!(through_relay.data, body);
    assert_eq!(through_relay.properties, through_plain.properties);

    let _ = connection.close().await;
    for queue in [&plain, &into_relay, &out_of_relay] {
        channel
            .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
            .await
            .unwrap();
    }
    let _ = lapin.close(200, "done".into()).await;
}

/// AMQP long strings are bytes, and a header may carry any (the bridge delivers such a
/// message as it came: `hostile::a_header_whose_long_string_is_not_utf8_is_delivered_as_it_came`).
/// amqprs 2.1 reads every long string as UTF-8 text: a delivery whose header is not ends
/// its whole connection, not only that message, and the message, unacked, is delivered
/// again to the next consumer. A bridge consuming with amqprs would lose its session to such
/// a message at every redelivery. So amqprs cannot carry the bridge's deliveries as it is.
#[tokio::test]
async fn amqprs_loses_its_connection_to_a_delivery_whose_header_is_not_utf8() {
    use amqprs::channel::BasicConsumeArguments;
    use lapin::options::BasicPublishOptions;
    use lapin::types::{AMQPValue, LongString};
    const WITHIN: Duration = Duration::from_secs(10);
    let queue = format!("{}.q", unique_prefix("amqprs-not-utf8"));
    let lapin = connect().await;
    let channel = lapin.create_channel().await.unwrap();
    declare_queue(&channel, &queue).await;
    let connection = rs_connect().await;
    let consuming = connection.open_channel(None).await.unwrap();
    let (_, mut deliveries) = consuming
        .basic_consume_rx(BasicConsumeArguments::new(&queue, ""))
        .await
        .expect("amqprs consumes the empty queue");
    let binary = AMQPValue::LongString(LongString::from(vec![0xff_u8, 0xfe, 0x00, 0xc3]));
    channel
        .basic_publish(
            "".into(),
            queue.as_str().into(),
            BasicPublishOptions::default(),
            b"binary",
            lapin::BasicProperties::default().with_headers(headers(vec![("binary", binary)])),
        )
        .await
        .unwrap();
    let handed_over = tokio::time::timeout(WITHIN, deliveries.recv())
        .await
        .expect("the consumer ends within 10 s");
    assert!(
        handed_over.is_none(),
        "amqprs read the message: did it learn to read binary long strings?"
    );
    assert!(!connection.is_open(), "amqprs closed its whole connection");
    // Unacked, the message is back in the queue for the next consumer.
    let deadline = tokio::time::Instant::now() + WITHIN;
    loop {
        let ready = delay_bridge::amqp::queue_counts(&channel, &queue)
            .await
            .expect("the queue exists")
            .messages;
        if ready == 1 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the message is not back in the queue"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    channel
        .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    let _ = lapin.close(200, "done".into()).await;
}
