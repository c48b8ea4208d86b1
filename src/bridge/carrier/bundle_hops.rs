//! The hop side of bundles (`bridge.bundle_hops`): the messages that hop into the same level
//! in the same `bridge.hop_window` travel as one message (`contract::bundle`). The first
//! message of a (level, window) group leads it: it waits for the window's end, publishes the
//! group as one bundle (more when it passes [`MAX_BUNDLE_BYTES`]) and tells every message
//! how that went; each message's delivery is acked once its bundle is confirmed, as after a
//! hop of its own. The return side is `bundle_returns`.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::sync::oneshot;

use super::publish::Attempt;
use super::settling::Settled;
use super::{Carrier, Outcome, Stop};
use crate::bridge::inlet::Tag;
use crate::clock::until_epoch_ms;
use crate::contract::Envelope;
use crate::contract::bundle::{self, Summary};

/// A message that takes more than this in a bundle (body and properties) hops alone: a
/// bundle must never be refused for a size its messages would pass alone.
const MAX_MEMBER_BYTES: usize = 64 * 1024;
/// A bundle takes messages until it is this large; the rest of its group goes in the next.
const MAX_BUNDLE_BYTES: usize = 1024 * 1024;

/// How the bundle a message hopped in was settled, when it was.
#[derive(Debug, Clone, Copy)]
enum Joined {
    /// Confirmed into its level.
    Routed,
    /// The level refused the bundle (for its size): the message hops alone.
    Alone,
}

/// What each message of a bundle is told: how it was settled, or why it goes back.
type Answer = Result<Joined, Stop>;

/// A message waiting for its bundle to leave.
struct Waiting {
    /// Its bytes in the bundle's body.
    member: Vec<u8>,
    /// When it is due, epoch ms; `None` for a recurring occurrence (see `Summary::of`).
    due: Option<u64>,
    answer: oneshot::Sender<Answer>,
}

/// A group of hops: the level they go to and when their bundle leaves (epoch ms).
type GroupKey = (Duration, u64);

/// The bundles filling up now.
#[derive(Default)]
pub(in crate::bridge) struct Filling {
    groups: Mutex<HashMap<GroupKey, Vec<Waiting>>>,
}

impl Filling {
    /// Adds a message to its group: how its bundle is settled, and whether it is the
    /// group's first (its leader).
    fn join(
        &self,
        key: GroupKey,
        member: Vec<u8>,
        due: Option<u64>,
    ) -> (oneshot::Receiver<Answer>, bool) {
        let (answer, answered) = oneshot::channel();
        let mut groups = self.groups.lock().unwrap_or_else(|e| e.into_inner());
        let group = groups.entry(key).or_default();
        group.push(Waiting {
            member,
            due,
            answer,
        });
        (answered, group.len() == 1)
    }

    /// Takes a group out: a message that joins after this starts the next.
    fn take(&self, key: GroupKey) -> Vec<Waiting> {
        self.groups
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&key)
            .unwrap_or_default()
    }
}

/// `items` in order, cut into runs whose `size`s add up to at most `max` (an item larger
/// than `max` makes a run of its own).
fn split_by_size<T>(items: Vec<T>, size: impl Fn(&T) -> usize, max: usize) -> Vec<Vec<T>> {
    let mut runs: Vec<Vec<T>> = Vec::new();
    let mut filled = 0;
    for item in items {
        let len = size(&item);
        match runs.last_mut() {
            Some(run) if filled + len <= max => run.push(item),
            _ => {
                runs.push(vec![item]);
                filled = 0;
            }
        }
        filled += len;
    }
    runs
}

impl Carrier {
    /// Hops a message in the bundle of its level that leaves at `leaves_at` (epoch ms); level
    /// zero is the returns queue. `None` when it must hop alone (too large for a bundle, or
    /// its bundle was refused).
    pub(super) async fn hop_bundled(
        &self,
        tag: Tag,
        body: &[u8],
        envelope: &Envelope,
        level: Duration,
        leaves_at: u64,
    ) -> Option<Outcome> {
        let member = bundle::encode_hop_member(envelope, body)
            .filter(|member| member.len() <= MAX_MEMBER_BYTES)?;
        let key = (level, leaves_at);
        let due = envelope.occurrence.is_none().then_some(envelope.deliver_at);
        let (answered, leads) = self.bundles.join(key, member, due);
        if leads {
            self.lead(tag, key).await;
        }
        match answered.await.unwrap_or(Err(Stop::Release)) {
            Ok(Joined::Routed) => {
                self.shared.stats.hops.fetch_add(1, Ordering::Relaxed);
                tracing::trace!(
                    ?level,
                    hops = envelope.hops.saturating_add(1),
                    "hop in a bundle"
                );
                Some(Ok(()))
            }
            Ok(Joined::Alone) => None,
            Err(stop) => Some(Err(stop)),
        }
    }

    /// Leads the group `key`: waits for its window's end, then publishes it and answers
    /// every message in it (on a stop first, each is released).
    async fn lead(&self, tag: Tag, key: GroupKey) {
        let stopped = tokio::select! {
            _ = tokio::time::sleep(until_epoch_ms(key.1)) => false,
            _ = self.stop.cancelled() => true,
        };
        let waiting = self.bundles.take(key);
        if stopped {
            for message in waiting {
                let _ = message.answer.send(Err(Stop::Release));
            }
            return;
        }
        let (exchange, queue) = self.level_route(key.0);
        let bundles = split_by_size(waiting, |w| w.member.len(), MAX_BUNDLE_BYTES);
        futures::future::join_all(
            bundles
                .into_iter()
                .map(|messages| self.publish_bundle(tag, exchange, &queue, messages)),
        )
        .await;
    }

    /// The exchange and the queue a bundle into `level` goes through: a level queue through
    /// the default exchange, and level zero, the returns queue, through the work exchange.
    pub(super) fn level_route(&self, level: Duration) -> (&str, String) {
        let names = &self.shared.config.names;
        if level.is_zero() {
            (self.shared.work_exchange.as_str(), names.returns_queue())
        } else {
            ("", names.level_queue(level))
        }
    }

    /// Publishes `messages` as one bundle through `exchange` into `queue` (a level queue
    /// through the default exchange, or the returns queue through the work exchange) and
    /// answers each of them.
    async fn publish_bundle(&self, tag: Tag, exchange: &str, queue: &str, messages: Vec<Waiting>) {
        let body = bundle::bundle_body(messages.iter().map(|w| w.member.as_slice()));
        let properties = bundle::summarised_properties(
            messages.len(),
            &Summary::of(messages.iter().map(|w| w.due)),
        );
        let attempt = Attempt::own(
            tag,
            queue,
            exchange,
            queue,
            &body,
            self.signed(properties, &body),
        );
        let answer = match self.publishing.until_settled(attempt).await {
            Ok(Settled::Routed) => {
                self.shared.stats.bundles.fetch_add(1, Ordering::Relaxed);
                tracing::trace!(queue, messages = messages.len(), "bundle");
                Ok(Joined::Routed)
            }
            Ok(Settled::Park(refused)) => {
                tracing::warn!(
                    queue,
                    messages = messages.len(),
                    reason = refused.reason.as_str(),
                    "a level refused a bundle: its messages hop alone"
                );
                Ok(Joined::Alone)
            }
            Err(stop) => Err(stop),
        };
        for message in messages {
            let _ = message.answer.send(match &answer {
                Ok(joined) => Ok(*joined),
                Err(stop) => Err(stop.shared()),
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_keep_the_order_and_stay_within_the_size() {
        let runs = split_by_size(vec![4, 4, 3, 9, 12, 1, 1], |n| *n, 10);
        assert_eq!(
            runs,
            vec![vec![4, 4], vec![3], vec![9], vec![12], vec![1, 1]]
        );
        assert_eq!(
            split_by_size(Vec::<usize>::new(), |n| *n, 10),
            Vec::<Vec<usize>>::new()
        );
        assert_eq!(split_by_size(vec![5, 5], |n| *n, 10), vec![vec![5, 5]]);
    }
}
