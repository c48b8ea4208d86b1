//! One confirm-mode publisher per target exchange (and one for the bridge's own queues).
//!
//! Publishing to a missing exchange makes the broker close the channel (404) and fail every
//! confirm pending on it; so does a refused message (403, 406). With a channel per target,
//! only publishes to that same target fail; a closed channel is replaced on next use.
//! Private channels for single publishes are few at a time, so that a burst of refusals
//! cannot run the connection out of channels.
//!
//! A target's channel is used only once a passive declare on it found the exchange. A
//! client that answers the broker's `channel.close` with `close-ok` ahead of publish frames
//! it still has queued for that channel makes the broker close the whole connection ("expected
//! 'channel.open'"; lapin did). A burst to a missing target costs one passive declare,
//! whose refusal every publish waiting for that channel shares.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::publisher::Publisher;
use super::wire::{Connection, WireError};

/// Which of a target's channels a publish uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Share {
    /// The target's channel for everything but bursts.
    Common,
    /// The target's channel for the messages of a burst, so that the broker works through a
    /// burst on one channel while a message due meanwhile goes through the other.
    Bulk,
}

/// Lazily opened confirm channels, per target exchange one for most publishes and one for
/// bursts.
pub struct TargetChannels {
    connection: Connection,
    confirm_timeout: Duration,
    /// A plain mutex, held only for a map lookup or insert (never across an await): a burst
    /// of thousands of deliveries due at once must not queue on an async lock.
    /// Keyed by exchange name first, so that a lookup borrows the name (no `String` per
    /// publish).
    channels: Mutex<HashMap<String, ByShare>>,
    /// One async lock per target, taken only to open its channel, so that thousands of
    /// deliveries to a target that has no channel yet open one between them, not one each
    /// (which ran the connection out of channels in a burst). It holds the last opening's
    /// failure, which every caller that waited for that opening shares.
    opening: Mutex<HashMap<ChannelKey, Opening>>,
    /// Permits for private channels: at most [`ISOLATED_AT_ONCE`] open at a time.
    isolated: Arc<Semaphore>,
}

/// A target exchange (or the empty key: the bridge's own) and which of its channels.
type ChannelKey = (String, Share);

/// A target's channels, one per [`Share`].
#[derive(Default)]
struct ByShare {
    common: Option<Publisher>,
    bulk: Option<Publisher>,
}

impl ByShare {
    fn slot(&mut self, share: Share) -> &mut Option<Publisher> {
        match share {
            Share::Common => &mut self.common,
            Share::Bulk => &mut self.bulk,
        }
    }
}

/// The lock an opening of one channel holds, with the last opening's failure.
type Opening = Arc<tokio::sync::Mutex<Option<FailedOpening>>>;

/// Private single-publish channels open at once, at most (a connection has 2047).
pub const ISOLATED_AT_ONCE: usize = 16;

/// Why a target's channel could not be opened, and when that was known.
struct FailedOpening {
    at: Instant,
    error: WireError,
}

/// A private confirm channel for one publish, counted against [`ISOLATED_AT_ONCE`] until
/// it is closed.
pub struct Isolated {
    publisher: Publisher,
    _permit: OwnedSemaphorePermit,
}

impl Isolated {
    /// The channel to publish on.
    pub fn publisher(&self) -> &Publisher {
        &self.publisher
    }

    /// Closes the channel and gives its place back.
    pub async fn close(self) {
        self.publisher.close().await;
    }
}

impl TargetChannels {
    /// No channels yet; they open on first use. Each publish waits at most
    /// `confirm_timeout` for its confirm.
    pub fn new(connection: Connection, confirm_timeout: Duration) -> Self {
        Self {
            connection,
            confirm_timeout,
            channels: Mutex::new(HashMap::new()),
            opening: Mutex::new(HashMap::new()),
            isolated: Arc::new(Semaphore::new(ISOLATED_AT_ONCE)),
        }
    }

    /// The open channel for `key`, opening a new one if there is none or it was closed.
    /// A non-empty `key` is a target exchange: a new channel is used only after a passive
    /// declare on it found that exchange (a 404 here is the target's refusal, and the
    /// broker closed only that channel, with nothing queued on it). The empty key is the
    /// bridge's own channel ([`adopt`](Self::adopt)ed), which needs no check. Concurrent
    /// callers for the same key share one opening, and its failure.
    pub async fn get(&self, key: &str) -> Result<Publisher, WireError> {
        self.get_shared(key, Share::Common).await
    }

    /// As [`get`](Self::get), the channel `share` of `key`'s two.
    pub async fn get_shared(&self, key: &str, share: Share) -> Result<Publisher, WireError> {
        if let Some(channel) = self.open_channel(key, share) {
            return Ok(channel);
        }
        let asked = Instant::now();
        let opening = self
            .opening
            .lock()
            .expect("target opening lock")
            .entry((key.to_string(), share))
            .or_default()
            .clone();
        let mut last_failure = opening.lock().await;
        // Whoever held the lock before us may have opened it, or found it cannot be opened.
        if let Some(channel) = self.open_channel(key, share) {
            return Ok(channel);
        }
        if let Some(failed) = last_failure.as_ref().filter(|failed| failed.at >= asked) {
            return Err(failed.error.clone());
        }
        let opened = match self.open_checked(key).await {
            Ok(opened) => opened,
            Err(error) => {
                *last_failure = Some(FailedOpening {
                    at: Instant::now(),
                    error: error.clone(),
                });
                return Err(error);
            }
        };
        *last_failure = None;
        self.put(key, share, opened.clone());
        Ok(opened)
    }

    /// A new confirm channel for `key`, its exchange checked when it names one.
    async fn open_checked(&self, key: &str) -> Result<Publisher, WireError> {
        let opened = Publisher::open(&self.connection, self.confirm_timeout).await?;
        if !key.is_empty() {
            opened.check_exchange(key).await?;
        }
        Ok(opened)
    }

    /// Uses `publisher` as the channel for `key` until it closes.
    pub fn adopt(&self, key: &str, publisher: Publisher) {
        self.put(key, Share::Common, publisher);
    }

    /// Keeps `publisher` as `key`'s channel `share`, in place of any earlier one.
    fn put(&self, key: &str, share: Share, publisher: Publisher) {
        let mut channels = self.channels.lock().expect("target channels lock");
        if let Some(target) = channels.get_mut(key) {
            *target.slot(share) = Some(publisher);
        } else {
            *channels.entry(key.to_string()).or_default().slot(share) = Some(publisher);
        }
    }

    /// A private confirm channel for one publish that must not share the fate of others
    /// (after a refusal: every publish pending on a closed channel gets the same error).
    /// Waits while [`ISOLATED_AT_ONCE`] are open. The caller closes it.
    pub async fn isolated(&self) -> Result<Isolated, WireError> {
        let permit = self
            .isolated
            .clone()
            .acquire_owned()
            .await
            .expect("the isolation semaphore is never closed");
        Ok(Isolated {
            publisher: Publisher::open(&self.connection, self.confirm_timeout).await?,
            _permit: permit,
        })
    }

    fn open_channel(&self, target: &str, share: Share) -> Option<Publisher> {
        let mut channels = self.channels.lock().expect("target channels lock");
        channels
            .get_mut(target)?
            .slot(share)
            .as_ref()
            .filter(|p| p.is_open())
            .cloned()
    }

    /// Closes every open target channel (on shutdown).
    pub async fn close_all(&self) {
        let publishers: Vec<Publisher> = self
            .channels
            .lock()
            .expect("target channels lock")
            .drain()
            .flat_map(|(_, target)| [target.common, target.bulk])
            .flatten()
            .collect();
        for publisher in publishers {
            publisher.close().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::amqp::PublishError;
    use crate::amqp::disposition::Disposition;

    /// The broker the tests use: `DELAY_BRIDGE_TEST_URL`, or the local default.
    fn broker_url() -> String {
        std::env::var("DELAY_BRIDGE_TEST_URL")
            .unwrap_or_else(|_| crate::config::DEFAULT_URL.to_string())
    }

    /// A connection to the test broker (`DELAY_BRIDGE_TEST_URL`, like the integration tests)
    /// and its target channels.
    async fn connected() -> (Connection, Arc<TargetChannels>) {
        let url = crate::config::BrokerUrl::parse(&broker_url()).expect("a broker URL");
        let connection = crate::amqp::connect_wire(&url, "targets unit test")
            .await
            .expect("the test broker answers (run scripts/broker.sh)");
        let targets = Arc::new(TargetChannels::new(
            connection.clone(),
            Duration::from_secs(30),
        ));
        (connection, targets)
    }

    /// One publish of a small body to the exchange `target`.
    async fn publish_to(
        publisher: &Publisher,
        target: &str,
    ) -> crate::amqp::disposition::Disposition {
        publisher
            .publish(target, "key", b"body", &lapin::BasicProperties::default())
            .await
    }

    /// A burst of deliveries to a target that has no channel yet opens one channel between
    /// them, not one each: 3000 at once would exceed the broker's 2047 channels per
    /// connection. (Needs the test broker, like the integration tests.)
    #[tokio::test]
    async fn concurrent_first_publishes_to_a_target_share_one_channel() {
        let (connection, targets) = connected().await;
        let opens = (0..3000).map(|_| {
            let targets = targets.clone();
            tokio::spawn(async move { targets.get("amq.direct").await.map(|p| p.channel_id()) })
        });
        let ids = tokio::time::timeout(Duration::from_secs(30), futures::future::join_all(opens))
            .await
            .expect("3000 lookups within 30 s");
        let mut distinct: Vec<u16> = ids
            .into_iter()
            .map(|joined| joined.expect("task").expect("a channel"))
            .collect();
        distinct.sort();
        distinct.dedup();
        assert_eq!(distinct.len(), 1, "channels opened: {distinct:?}");
        targets.close_all().await;
        connection.close().await;
    }

    /// A burst of publishes to a target exchange that does not exist costs its channel, never
    /// the connection: a target's channel is not used until the target is known to exist.
    #[tokio::test]
    async fn a_burst_to_a_missing_target_leaves_the_connection_open() {
        const ROUNDS: usize = 10;
        const PUBLISHES: usize = 2000;
        let (connection, targets) = connected().await;
        for round in 0..ROUNDS {
            let target = format!("targets-test-missing-{:08x}", rand::random::<u32>());
            let publishes = (0..PUBLISHES).map(|_| {
                let (targets, target) = (targets.clone(), target.clone());
                tokio::spawn(async move {
                    match targets.get(&target).await {
                        Ok(publisher) => publish_to(&publisher, &target).await,
                        Err(e) => Disposition::of_error(PublishError::Broker(e)),
                    }
                })
            });
            let answers = tokio::time::timeout(
                Duration::from_secs(60),
                futures::future::join_all(publishes),
            )
            .await
            .expect("every publish answered within 60 s");
            let refused = answers
                .into_iter()
                .map(|joined| joined.expect("task"))
                .filter(|answer| matches!(answer, Disposition::Refused(r) if r.code == 404))
                .count();
            assert!(
                connection.is_open(),
                "round {round}: the broker closed the connection"
            );
            assert_eq!(
                refused, PUBLISHES,
                "round {round}: every publish refused 404"
            );
        }
        targets.close_all().await;
        connection.close().await;
    }

    /// An exchange deleted under a burst of publishes on its channel costs that channel,
    /// never the connection: the broker closes the channel at the first publish after the
    /// delete, with many more queued behind it, and the channel's `close-ok` goes out after
    /// every publish frame queued for it, so the broker sees no publish on a closed
    /// channel. (lapin answered the close ahead of publishes it still had queued, and the
    /// broker closed the whole connection: "expected 'channel.open'".) The burst keeps
    /// `IN_FLIGHT` publishes outstanding until the first refusal, so the delete always lands
    /// under it, however fast the broker drains a fixed batch.
    #[tokio::test]
    async fn an_exchange_deleted_under_a_burst_leaves_the_connection_open() {
        const ROUNDS: usize = 10;
        const IN_FLIGHT: usize = 2000;
        const MAX_PUBLISHES: usize = 200_000;
        let (connection, targets) = connected().await;
        let url = crate::config::BrokerUrl::parse(&broker_url()).expect("a broker URL");
        let admin = crate::amqp::connect(&url, "targets unit test admin")
            .await
            .expect("the test broker answers");
        let declaring = admin.create_channel().await.expect("a channel");
        for round in 0..ROUNDS {
            let target = format!("targets-test-deleted-{:08x}", rand::random::<u32>());
            declaring
                .exchange_declare(
                    target.as_str().into(),
                    lapin::ExchangeKind::Fanout,
                    lapin::options::ExchangeDeclareOptions::default(),
                    lapin::types::FieldTable::default(),
                )
                .await
                .expect("the test exchange");
            let publisher = targets.get(&target).await.expect("its channel");
            let spawn_publish = |in_flight: &mut tokio::task::JoinSet<_>| {
                let (publisher, target) = (publisher.clone(), target.clone());
                in_flight.spawn(async move { publish_to(&publisher, &target).await });
            };
            let mut in_flight = tokio::task::JoinSet::new();
            for _ in 0..IN_FLIGHT {
                spawn_publish(&mut in_flight);
            }
            let mut sent = IN_FLIGHT;
            let first = in_flight
                .join_next()
                .await
                .expect("a publish")
                .expect("task");
            assert!(
                matches!(first, Disposition::Routed | Disposition::Returned { .. }),
                "round {round}: {first:?} before the delete"
            );
            let deleting = {
                let (declaring, target) = (declaring.clone(), target.clone());
                tokio::spawn(async move {
                    declaring
                        .exchange_delete(
                            target.as_str().into(),
                            lapin::options::ExchangeDeleteOptions::default(),
                        )
                        .await
                })
            };
            let mut refused = 0;
            let drained = tokio::time::timeout(Duration::from_secs(60), async {
                while let Some(joined) = in_flight.join_next().await {
                    match joined.expect("task") {
                        Disposition::Refused(r) if r.code == 404 => refused += 1,
                        Disposition::Routed | Disposition::Returned { .. }
                            if refused == 0 && sent < MAX_PUBLISHES =>
                        {
                            spawn_publish(&mut in_flight);
                            sent += 1;
                        }
                        Disposition::Routed | Disposition::Returned { .. } => {}
                        other => panic!("round {round}: {other:?}"),
                    }
                }
            })
            .await;
            assert!(
                drained.is_ok(),
                "round {round}: every publish answered within 60 s"
            );
            deleting
                .await
                .expect("task")
                .expect("the test exchange deleted");
            println!("round {round}: {refused} of {sent} refused 404");
            assert!(
                connection.is_open(),
                "round {round}: the broker closed the connection ({refused} refused 404)"
            );
            assert!(
                refused > 0,
                "round {round}: {sent} publishes and none refused after the delete"
            );
        }
        targets.close_all().await;
        connection.close().await;
        let _ = admin.close(200, "done".into()).await;
    }
}
