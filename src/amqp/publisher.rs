//! The one confirmed, mandatory publish: a confirm-mode channel on the project's own
//! connection ([`super::wire`]) whose publishes learn their own return, each within a
//! confirm deadline.
//!
//! The broker sends a publish's return before the confirm that covers it, and the
//! connection hands each return to the channel's handler before it reads on; a return pool
//! (`amqp::returns`) gives each publish the return with its own content.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use lapin::BasicProperties;
use thiserror::Error;
use tokio::sync::watch;

use super::disposition::Disposition;
use super::returns::{Claimed, Fingerprint, Return, ReturnPool};
use super::wire::{self, Returned, WireError};

/// Why a publish has no answer from the broker.
#[derive(Debug, Error)]
pub enum PublishError {
    /// The channel or connection failed (the broker closed it, or it was lost).
    #[error(transparent)]
    Broker(#[from] WireError),
    /// The broker did not confirm in time. Time while the broker blocks the connection (a
    /// resource alarm) does not count. The channel has been closed: nothing more is
    /// confirmed on it.
    #[error("the broker did not confirm a publish within {0:?}")]
    ConfirmTimeout(Duration),
}

/// A confirm-mode channel for many concurrent confirmed, mandatory publishes.
#[derive(Clone)]
pub struct Publisher {
    channel: wire::Channel,
    /// Set while the broker blocks the connection: the confirm deadline pauses.
    blocked: watch::Receiver<Option<String>>,
    returns: Arc<Mutex<ReturnPool>>,
    confirm_timeout: Duration,
}

impl Publisher {
    /// Opens a confirm-mode channel on `connection`.
    pub async fn open(
        connection: &wire::Connection,
        confirm_timeout: Duration,
    ) -> Result<Self, WireError> {
        let channel = connection.open_channel().await?;
        let returns = Arc::new(Mutex::new(ReturnPool::new()));
        let pool = returns.clone();
        channel.on_return(Box::new(move |returned: Returned| {
            let fingerprint = Fingerprint::of(
                returned.exchange.as_str(),
                returned.routing_key.as_str(),
                &returned.properties,
                &returned.body,
            );
            let ret = Return {
                code: returned.reply_code,
                text: returned.reply_text.to_string(),
            };
            lock(&pool).returned(fingerprint, ret);
        }));
        channel.confirm_select().await?;
        Ok(Self {
            channel,
            blocked: connection.blocked(),
            returns,
            confirm_timeout,
        })
    }

    /// True while the channel is open.
    pub fn is_open(&self) -> bool {
        self.channel.is_open()
    }

    /// The channel's id.
    #[cfg(test)]
    pub fn channel_id(&self) -> u16 {
        self.channel.id()
    }

    /// Passively declares `exchange`: `Ok` when it exists. A missing one is a 404 channel
    /// error, and the broker closes this channel.
    pub async fn check_exchange(&self, exchange: &str) -> Result<(), WireError> {
        self.channel.check_exchange(exchange).await
    }

    /// Closes the channel (publishes still waiting fail).
    pub async fn close(&self) {
        if self.is_open() {
            let _ = self.channel.close().await;
        }
    }

    /// Publishes with `mandatory` and waits for the broker's confirm and for what became of
    /// this very message ([`Disposition`]): routed, returned, nacked, refused by a channel
    /// error that blames it or its exchange, or lost. Many run at once on one channel.
    pub async fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        properties: &BasicProperties,
    ) -> Disposition {
        self.publish_confirmed(exchange, routing_key, body, properties)
            .await
            .unwrap_or_else(Disposition::of_error)
    }

    /// [`Self::publish`], with what got no confirm as an error.
    async fn publish_confirmed(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        properties: &BasicProperties,
    ) -> Result<Disposition, PublishError> {
        let mut entry = Entry {
            seq: lock(&self.returns).register(),
            returns: &self.returns,
            claimed: false,
        };
        let confirm = self
            .channel
            .publish(exchange, routing_key, true, properties, body)?;
        let confirmed = match self.within_deadline(confirm).await {
            Ok(confirmed) => confirmed?,
            Err(_) => {
                // The message is sent again elsewhere: nothing more may be confirmed here.
                self.close().await;
                return Err(PublishError::ConfirmTimeout(self.confirm_timeout));
            }
        };
        let claimed = entry.claim(|| Fingerprint::of(exchange, routing_key, properties, body));
        if claimed.stale > 0 {
            tracing::error!(
                stale = claimed.stale,
                "the broker returned messages that match no publish in flight"
            );
        }
        Ok(Disposition::confirmed(confirmed, claimed.ret))
    }

    /// Runs `confirmed` until it completes or `confirm_timeout` passes while the connection
    /// is not blocked and the broker answers: a broker under a resource alarm stops reading,
    /// and a stopped or paused one says nothing at all ([`wire::stall::wait_on`]); waiting
    /// for either is safe, while giving up would send the message round again. A broker
    /// that never speaks again fails the connection after two heartbeat intervals.
    async fn within_deadline<T>(
        &self,
        confirmed: impl std::future::Future<Output = T>,
    ) -> Result<T, tokio::time::error::Elapsed> {
        tokio::pin!(confirmed);
        loop {
            match tokio::time::timeout(self.confirm_timeout, &mut confirmed).await {
                Ok(done) => return Ok(done),
                // Blocked by a resource alarm: the deadline pauses.
                Err(_) if self.blocked.borrow().is_some() => {}
                // The broker says nothing at all (stopped, paused): it holds the message,
                // and sending it again would deliver it twice when it wakes up.
                Err(_)
                    if wire::stall::wait_on(
                        self.channel.broker_silent_for(),
                        self.confirm_timeout,
                    ) => {}
                Err(elapsed) => return Err(elapsed),
            }
        }
    }
}

fn lock(returns: &Mutex<ReturnPool>) -> std::sync::MutexGuard<'_, ReturnPool> {
    returns.lock().unwrap_or_else(|e| e.into_inner())
}

/// One publish in the return pool: it claims once, or is forgotten when its future ends
/// without a confirm (failed, timed out, or dropped), so its return cannot go to another.
struct Entry<'a> {
    seq: u64,
    returns: &'a Mutex<ReturnPool>,
    claimed: bool,
}

impl Entry<'_> {
    /// Takes this publish's return, if it has one (`fingerprint` gives its content's).
    fn claim(&mut self, fingerprint: impl FnOnce() -> Fingerprint) -> Claimed {
        self.claimed = true;
        lock(self.returns).claim(self.seq, fingerprint)
    }
}

impl Drop for Entry<'_> {
    fn drop(&mut self) {
        if !self.claimed {
            lock(self.returns).forget(self.seq);
        }
    }
}

// The integration tests' scripted broker; these tests use part of it.
#[cfg(test)]
#[allow(dead_code)]
#[path = "../../tests/wire/fake_broker.rs"]
mod fake_broker;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::BrokerUrl;
    use lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
    use lapin::types::FieldTable;

    /// The broker the tests use: `DELAY_BRIDGE_TEST_URL`, or the local default.
    fn broker_url() -> BrokerUrl {
        let url = std::env::var("DELAY_BRIDGE_TEST_URL")
            .unwrap_or_else(|_| crate::config::DEFAULT_URL.to_string());
        BrokerUrl::parse(&url).expect("a broker URL")
    }

    /// 6 000 publishes from 30 tasks on one channel, every third to a queue that does not
    /// exist: each publish learns its own fate, and the queue holds exactly the others.
    /// (Needs the test broker, like the integration tests.)
    #[tokio::test]
    async fn each_of_many_concurrent_publishes_learns_its_own_return() {
        const TASKS: usize = 30;
        const EACH: usize = 200;
        let url = broker_url();
        let admin = crate::amqp::connect(&url, "publisher unit test admin")
            .await
            .expect("the test broker answers (run scripts/broker.sh)");
        let declaring = admin.create_channel().await.expect("a channel");
        let queue = format!("publisher-test-{:08x}", rand::random::<u32>());
        declaring
            .queue_declare(
                queue.as_str().into(),
                QueueDeclareOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("the test queue");
        let connection = crate::amqp::connect_wire(&url, "publisher unit test")
            .await
            .expect("the test broker answers");
        let publisher = Publisher::open(&connection, Duration::from_secs(30))
            .await
            .expect("a confirm channel");
        let nowhere = format!("{queue}-nowhere");
        let tasks = (0..TASKS).map(|task| {
            let (publisher, queue, nowhere) = (publisher.clone(), queue.clone(), nowhere.clone());
            tokio::spawn(async move {
                let mut wrong = Vec::new();
                for i in 0..EACH {
                    let n = task * EACH + i;
                    let unroutable = n.is_multiple_of(3);
                    let key = if unroutable { &nowhere } else { &queue };
                    let published = publisher
                        .publish(
                            "",
                            key.as_str(),
                            n.to_string().as_bytes(),
                            &BasicProperties::default(),
                        )
                        .await;
                    let returned = matches!(published, Disposition::Returned { .. });
                    if returned != unroutable
                        || !matches!(
                            published,
                            Disposition::Returned { .. } | Disposition::Routed
                        )
                    {
                        wrong.push((n, published));
                    }
                }
                wrong
            })
        });
        let answers =
            tokio::time::timeout(Duration::from_secs(60), futures::future::join_all(tasks))
                .await
                .expect("every publish answered within 60 s");
        let wrong: Vec<_> = answers
            .into_iter()
            .flat_map(|joined| joined.expect("task"))
            .collect();
        assert!(wrong.is_empty(), "publishes told another's fate: {wrong:?}");
        let held = crate::amqp::queue_counts(&declaring, &queue)
            .await
            .expect("the queue's depth")
            .messages;
        assert_eq!(held, (TASKS * EACH * 2 / 3) as u64);
        declaring
            .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
            .await
            .expect("the test queue deleted");
        connection.close().await;
        let _ = admin.close(200, "done".into()).await;
    }

    /// A publisher on a fresh connection to the scripted broker, with `deadline` for its
    /// confirms, and the broker's side of it (channel 1 open in confirm mode).
    async fn publisher_on_fake(
        deadline: Duration,
    ) -> (wire::Connection, Publisher, super::fake_broker::Peer) {
        use amq_protocol::protocol::{AMQPClass, channel, confirm, connection};
        let broker = super::fake_broker::FakeBroker::listen().await;
        let url = BrokerUrl::parse(&broker.url("")).expect("a broker URL");
        let opening = tokio::spawn(async move {
            wire::Connection::open(&url, "publisher test", Duration::from_secs(600)).await
        });
        let tune = connection::Tune {
            channel_max: 16,
            frame_max: 131_072,
            heartbeat: 600,
        };
        let mut peer = broker.accept_and_open(tune).await;
        let connection = opening.await.expect("task").expect("opened");
        let publisher = Publisher::open(&connection, deadline);
        let broker_side = async {
            assert!(matches!(
                peer.method().await,
                AMQPClass::Channel(channel::AMQPMethod::Open(_))
            ));
            peer.send_on(
                1,
                AMQPClass::Channel(channel::AMQPMethod::OpenOk(channel::OpenOk {})),
            )
            .await;
            assert!(matches!(
                peer.method().await,
                AMQPClass::Confirm(confirm::AMQPMethod::Select(_))
            ));
            peer.send_on(
                1,
                AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(confirm::SelectOk {})),
            )
            .await;
        };
        let (publisher, ()) = tokio::join!(publisher, broker_side);
        (connection, publisher.expect("a publisher"), peer)
    }

    /// One publish on a fresh publisher to the scripted broker, which has read its
    /// `basic.publish` and answered nothing yet.
    async fn one_publish_on_fake(
        deadline: Duration,
    ) -> (
        wire::Connection,
        super::fake_broker::Peer,
        tokio::task::JoinHandle<Disposition>,
    ) {
        use amq_protocol::protocol::{AMQPClass, basic};
        let (connection, publisher, mut peer) = publisher_on_fake(deadline).await;
        let publishing = tokio::spawn(async move {
            publisher
                .publish("ex", "rk", b"body", &BasicProperties::default())
                .await
        });
        assert!(matches!(
            peer.method().await,
            AMQPClass::Basic(basic::AMQPMethod::Publish(_))
        ));
        (connection, peer, publishing)
    }

    /// A broker that says nothing at all (its VM stopped, say) holds what it was sent: a
    /// publish waits past its confirm deadline for as long as the broker is silent, and
    /// takes the confirm when it comes, instead of failing and being sent again, which
    /// delivered 744 messages twice after a 40 s stop at 1 000 msg/s.
    #[tokio::test]
    async fn a_publish_waits_past_its_deadline_while_the_broker_says_nothing() {
        use amq_protocol::protocol::{AMQPClass, basic};
        const DEADLINE: Duration = Duration::from_millis(200);
        let (_connection, mut peer, publishing) = one_publish_on_fake(DEADLINE).await;
        // The broker's stall: five deadlines without a frame.
        tokio::time::sleep(DEADLINE * 5).await;
        assert!(
            !publishing.is_finished(),
            "it waits while the broker is silent"
        );
        peer.send_on(
            1,
            AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
                delivery_tag: 1,
                multiple: false,
            })),
        )
        .await;
        let published = tokio::time::timeout(Duration::from_secs(5), publishing)
            .await
            .expect("confirmed in time")
            .expect("task");
        assert!(matches!(published, Disposition::Routed), "{published:?}");
    }

    /// A broker that answers (here: heartbeats) but never confirms a publish fails it at
    /// its deadline, as before.
    #[tokio::test]
    async fn a_publish_the_answering_broker_never_confirms_fails_at_its_deadline() {
        use amq_protocol::protocol::{AMQPClass, channel};
        const DEADLINE: Duration = Duration::from_millis(200);
        let (_connection, mut peer, publishing) = one_publish_on_fake(DEADLINE).await;
        while !publishing.is_finished() {
            peer.heartbeat().await;
            // Past the deadline the publisher closes its channel: answer it.
            if let Ok(method) = tokio::time::timeout(DEADLINE / 4, peer.method()).await {
                assert!(matches!(
                    method,
                    AMQPClass::Channel(channel::AMQPMethod::Close(_))
                ));
                peer.send_on(
                    1,
                    AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
                )
                .await;
                break;
            }
        }
        let published = tokio::time::timeout(Duration::from_secs(5), publishing)
            .await
            .expect("ended in time")
            .expect("task");
        assert!(
            matches!(
                published,
                Disposition::Lost(PublishError::ConfirmTimeout(_))
            ),
            "{published:?}"
        );
    }
}
