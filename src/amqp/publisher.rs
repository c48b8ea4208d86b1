//! The one confirmed, mandatory publish: a confirm-mode channel whose publishes learn their
//! own return, each within a confirm deadline.
//!
//! lapin pairs a returned message with whichever confirm completes next, not with the
//! publish it came from; a return ledger (`amqp::returns`) puts each return back with its
//! own publish.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use lapin::options::{BasicPublishOptions, ExchangeDeclareOptions};
use lapin::types::{FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionStatus};
use thiserror::Error;
use tokio::sync::oneshot;

use super::returns::{Fingerprint, Return, ReturnLedger};
use super::{Published, confirm_channel};

/// Why a publish has no answer from the broker.
#[derive(Debug, Error)]
pub enum PublishError {
    /// The channel or connection failed (the broker closed it, or it was lost).
    #[error(transparent)]
    Broker(#[from] lapin::Error),
    /// The broker did not confirm in time. Time while the broker blocks the connection (a
    /// resource alarm) does not count. The channel has been closed: nothing more is
    /// confirmed on it.
    #[error("the broker did not confirm a publish within {0:?}")]
    ConfirmTimeout(Duration),
}

/// A confirm-mode channel for many concurrent confirmed, mandatory publishes.
#[derive(Clone)]
pub struct Publisher {
    channel: Channel,
    /// The connection's status: its `blocked` flag pauses the confirm deadline.
    connection: ConnectionStatus,
    ledger: Arc<Mutex<ReturnLedger<oneshot::Sender<()>>>>,
    confirm_timeout: Duration,
}

impl Publisher {
    /// Opens a confirm-mode channel on `connection`.
    pub async fn open(
        connection: &Connection,
        confirm_timeout: Duration,
    ) -> Result<Self, lapin::Error> {
        Ok(Self {
            channel: confirm_channel(connection).await?,
            connection: connection.status().clone(),
            ledger: Arc::new(Mutex::new(ReturnLedger::new())),
            confirm_timeout,
        })
    }

    /// True while the channel is open.
    pub fn is_open(&self) -> bool {
        self.channel.status().connected()
    }

    /// The channel's id.
    #[cfg(test)]
    pub fn channel_id(&self) -> u16 {
        self.channel.id()
    }

    /// Passively declares `exchange`: `Ok` when it exists. A missing one is a 404 channel
    /// error, and the broker closes this channel.
    pub async fn check_exchange(&self, exchange: &str) -> Result<(), lapin::Error> {
        self.channel
            .exchange_declare(
                exchange.into(),
                lapin::ExchangeKind::Direct,
                ExchangeDeclareOptions {
                    passive: true,
                    ..ExchangeDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
    }

    /// Closes the channel (publishes still waiting fail).
    pub async fn close(&self, reason: &str) {
        if self.is_open() {
            let _ = self.channel.close(200, reason.into()).await;
        }
    }

    /// Publishes with `mandatory` and waits for the broker's confirm and for what became of
    /// this very message: routed, returned, or nacked. Many run at once on one channel.
    pub async fn publish(
        &self,
        exchange: ShortString,
        routing_key: ShortString,
        body: &[u8],
        properties: BasicProperties,
    ) -> Result<Published, PublishError> {
        let fingerprint =
            Fingerprint::of(exchange.as_str(), routing_key.as_str(), &properties, body);
        let mut entry = Entry {
            seq: self.lock().register(),
            publisher: self,
            resolved: false,
            finished: false,
        };
        let sent = self
            .within_deadline(async {
                self.channel
                    .basic_publish(
                        exchange,
                        routing_key,
                        BasicPublishOptions {
                            mandatory: true,
                            ..BasicPublishOptions::default()
                        },
                        body,
                        properties,
                    )
                    .await?
                    .await
            })
            .await;
        let (acked, carried) = match sent {
            Ok(Ok(Confirmation::Ack(carried))) => (true, carried),
            Ok(Ok(Confirmation::Nack(carried))) => (false, carried),
            Ok(Ok(Confirmation::NotRequested)) => {
                unreachable!("a Publisher's channel is in confirm mode")
            }
            Ok(Err(e)) => {
                entry.resolve(None);
                entry.forget();
                return Err(PublishError::Broker(e));
            }
            Err(_) => {
                // A confirm arriving later could carry another publish's return: stop
                // every confirm on this channel first.
                self.close("delay-bridge: a publish was not confirmed in time")
                    .await;
                entry.resolve(None);
                entry.forget();
                return Err(PublishError::ConfirmTimeout(self.confirm_timeout));
            }
        };
        let carried = carried.map(|r| {
            let d = &r.delivery;
            (
                Fingerprint::of(
                    d.exchange.as_str(),
                    d.routing_key.as_str(),
                    &d.properties,
                    &d.data,
                ),
                Return {
                    code: r.reply_code,
                    text: r.reply_text.to_string(),
                },
            )
        });
        if let Some(barrier) = entry.resolve(carried) {
            let (tx, rx) = oneshot::channel();
            if self.lock().wait(barrier, tx).is_none() {
                // Every earlier publish completes or fails within its own deadline.
                let _ = rx.await;
            }
        }
        let claimed = entry.claim(fingerprint);
        if claimed.stale > 0 {
            tracing::error!(
                stale = claimed.stale,
                "the broker returned messages that match no publish in flight"
            );
        }
        Ok(match (acked, claimed.ret) {
            (true, None) => Published::Routed,
            (true, Some(Return { code, text })) => Published::Returned { code, text },
            (false, _) => Published::Nacked,
        })
    }

    /// Runs `confirmed` until it completes or `confirm_timeout` passes while the connection
    /// is not blocked: a broker under a resource alarm stops reading, and waiting for it is
    /// safe, while giving up would send the message round again.
    async fn within_deadline<T>(
        &self,
        confirmed: impl std::future::Future<Output = T>,
    ) -> Result<T, tokio::time::error::Elapsed> {
        tokio::pin!(confirmed);
        loop {
            match tokio::time::timeout(self.confirm_timeout, &mut confirmed).await {
                Ok(done) => return Ok(done),
                Err(elapsed) if !self.connection.blocked() => return Err(elapsed),
                Err(_) => {}
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ReturnLedger<oneshot::Sender<()>>> {
        self.ledger.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// One publish in the ledger: resolved once and claimed (or forgotten) once, also when its
/// future is dropped, so later publishes never wait on it.
struct Entry<'a> {
    seq: u64,
    publisher: &'a Publisher,
    resolved: bool,
    finished: bool,
}

impl Entry<'_> {
    /// Records the completion; gives the barrier to wait for, unless it already passed.
    fn resolve(&mut self, carried: Option<(Fingerprint, Return)>) -> Option<u64> {
        self.resolved = true;
        let mut ledger = self.publisher.lock();
        let (barrier, released) = ledger.resolve(self.seq, carried);
        let passed = ledger.passed(barrier);
        drop(ledger);
        for waiter in released {
            let _ = waiter.send(());
        }
        (!passed).then_some(barrier)
    }

    /// Takes this publish's return, if it has one.
    fn claim(&mut self, fingerprint: Fingerprint) -> super::returns::Claimed {
        self.finished = true;
        self.publisher.lock().claim(self.seq, fingerprint)
    }

    /// This publish failed: it claims nothing.
    fn forget(&mut self) {
        self.finished = true;
        self.publisher.lock().forget(self.seq);
    }
}

impl Drop for Entry<'_> {
    fn drop(&mut self) {
        if !self.resolved {
            self.resolve(None);
        }
        if !self.finished {
            self.forget();
        }
    }
}
